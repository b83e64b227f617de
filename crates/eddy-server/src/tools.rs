//! Tool calls: which syntax a chat template asks the model to write calls in, the grammar of a valid call
//! (for `tool_choice` `required` or a named function), and reading the calls back from the model's text,
//! whole or as it streams.
//!
//! Families (recognised from the template's source):
//! - Hermes (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`,
//!   one block per call, text around them is content.
//! - Mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}`.
//! - Llama 3.1+: the reply is a JSON object `{"name": …, "parameters": {…}}` (after `<|python_tag|>` when the
//!   template writes one).
//!
//! A template that mentions tools in none of these ways is refused when a request brings tools.

use crate::api::{Tool, ToolChoice, Tools};
use serde_json::{json, Value};

/// The tool-call syntax of a chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Hermes,
    Mistral,
    Llama3,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const MISTRAL: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl Family {
    /// The family whose markers the template `source` writes; `None` when it has no tool-call syntax eddy
    /// knows.
    pub fn of_template(source: &str) -> Option<Family> {
        if source.contains(OPEN) {
            Some(Family::Hermes)
        } else if source.contains(MISTRAL) {
            Some(Family::Mistral)
        } else if source.contains(PYTHON_TAG) || (source.contains("tools") && source.contains("\"parameters\"")) {
            Some(Family::Llama3)
        } else {
            None
        }
    }

    /// Whether the output must be decoded with special tokens kept (the family's marker is a control
    /// token that decoding would otherwise drop).
    pub fn keeps_special_tokens(self) -> bool {
        matches!(self, Family::Mistral | Family::Llama3)
    }

    /// A llguidance Lark grammar of the reply that `tools.choice` requires: one call (or, with
    /// `parallel`, one or more) of the allowed tools, arguments valid under each tool's schema.
    /// `special_id(text)` gives the id of a control token (Mistral's marker).
    pub fn call_grammar(self, tools: &Tools, special_id: impl Fn(&str) -> Option<u32>) -> Result<String, String> {
        let allowed: Vec<&Tool> = match &tools.choice {
            ToolChoice::Named(n) => tools.tools.iter().filter(|t| &t.name == n).collect(),
            _ => tools.tools.iter().collect(),
        };
        let args_key = if self == Family::Llama3 { "parameters" } else { "arguments" };
        let one: Vec<Value> = allowed
            .iter()
            .map(|t| {
                json!({"type": "object", "properties": {"name": {"const": t.name}, args_key: t.parameters},
                       "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        let compact = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let call = json!({"anyOf": one, "x-guidance": compact});
        let text = |v: &Value| serde_json::to_string(v).map_err(|e| e.to_string());
        let more = if tools.parallel { "*" } else { "" };
        Ok(match self {
            Family::Hermes => {
                format!("start: call (\"\\n\" call){more}\ncall: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\nbody: %json {}\n", text(&call)?)
            }
            Family::Mistral => {
                let id = special_id(MISTRAL).ok_or("the tokenizer has no [TOOL_CALLS] token")?;
                let mut list = json!({"type": "array", "minItems": 1, "items": {"anyOf": one}, "x-guidance": compact});
                if !tools.parallel {
                    list["maxItems"] = json!(1);
                }
                format!("start: <[{id}]> \" \" body\nbody: %json {}\n", text(&list)?)
            }
            Family::Llama3 => format!("start: body\nbody: %json {}\n", text(&call)?),
        })
    }

    /// Splits a whole reply into its content (text outside the calls; `None` when blank) and its tool
    /// calls as `(name, arguments JSON text)`. Text that looks like a call but does not parse stays content.
    pub fn parse(self, text: &str) -> (Option<String>, Vec<(String, String)>) {
        let mut calls = Vec::new();
        let mut content = String::new();
        match self {
            Family::Hermes => {
                let mut rest = text;
                while let Some(i) = rest.find(OPEN) {
                    let after = &rest[i + OPEN.len()..];
                    let (body, next) = match after.find(CLOSE) {
                        Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
                        None => (after, ""),
                    };
                    match call_of(body) {
                        Some(c) => {
                            content.push_str(&rest[..i]);
                            calls.push(c);
                        }
                        None => content.push_str(&rest[..rest.len() - next.len()]),
                    }
                    rest = next;
                }
                content.push_str(rest);
            }
            Family::Mistral => match text.find(MISTRAL) {
                Some(i) => {
                    let body = text[i + MISTRAL.len()..].trim();
                    match serde_json::from_str::<Value>(body) {
                        Ok(Value::Array(a)) => {
                            let parsed: Vec<_> = a.iter().filter_map(call_of_value).collect();
                            if parsed.len() == a.len() && !parsed.is_empty() {
                                content.push_str(&text[..i]);
                                calls = parsed;
                            } else {
                                content.push_str(text);
                            }
                        }
                        _ => content.push_str(text),
                    }
                }
                None => content.push_str(text),
            },
            Family::Llama3 => {
                let body = text.trim().trim_start_matches(PYTHON_TAG).trim();
                let parsed: Option<Vec<_>> =
                    if body.starts_with('{') { body.split(';').map(|b| call_of(b.trim())).collect() } else { None };
                match parsed {
                    Some(p) if !p.is_empty() => calls = p,
                    _ => content.push_str(text),
                }
            }
        }
        let content = (!content.trim().is_empty()).then(|| content.trim().to_string());
        (content, calls)
    }
}

/// Calls written bare, without the family's markers, as small models often do: the whole reply (inside a
/// Markdown code fence or not) is one or more JSON objects `{"name", "arguments" | "parameters"}`, each
/// naming one of the request's tools `names`. `None` when the reply is anything else.
pub fn bare_calls(text: &str, names: &[String]) -> Option<Vec<(String, String)>> {
    let mut t = text.trim();
    if let Some(rest) = t.strip_prefix("```") {
        let rest = rest.trim_start_matches(|c: char| c.is_ascii_alphanumeric());
        t = rest.strip_suffix("```")?.trim();
    }
    if !t.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
        let (name, args) = call_of_value(&v.ok()?)?;
        if !names.contains(&name) {
            return None;
        }
        calls.push((name, args));
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": …, "arguments" | "parameters": {…}}` as (name, arguments JSON text).
fn call_of(body: &str) -> Option<(String, String)> {
    call_of_value(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

fn call_of_value(v: &Value) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    args.is_object().then(|| (name, args.to_string()))
}

/// What a streamed reply with tools produces as its text arrives.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Content text.
    Content(String),
    /// A whole tool call: name and arguments JSON text.
    Call(String, String),
}

/// Reads tool calls out of streamed text: content goes out as it comes (holding back what may be the start
/// of a call marker), each call once it is complete. Hermes calls stream one by one; the other families,
/// whose reply is either all calls or all content, are held until the reply shows which (its first
/// non-blank character) and, when calls, until the end.
pub struct CallStreamer {
    family: Family,
    /// The request's tool names (for calls written bare).
    names: Vec<String>,
    /// Hermes: the reply opens like bare JSON (`{` or a code fence): held until the end.
    bare: bool,
    /// Hermes: the first non-blank character was seen.
    started: bool,
    buf: String,
    /// Inside a Hermes call, or (other families) the reply is calls.
    in_call: bool,
    /// Other families: decided whether the reply is content.
    content_mode: bool,
}

impl CallStreamer {
    pub fn new(family: Family, names: Vec<String>) -> Self {
        CallStreamer { family, names, bare: false, started: false, buf: String::new(), in_call: false, content_mode: false }
    }

    /// Adds `text`; returns the pieces now complete.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if self.family == Family::Hermes && !self.started {
            let t = self.buf.trim_start();
            if t.is_empty() {
                return Vec::new();
            }
            self.started = true;
            self.bare = t.starts_with('{') || t.starts_with('`');
        }
        if self.bare {
            return Vec::new();
        }
        match self.family {
            Family::Hermes => loop {
                if self.in_call {
                    let Some(j) = self.buf.find(CLOSE) else { break };
                    let body: String = self.buf.drain(..j + CLOSE.len()).collect();
                    self.in_call = false;
                    match call_of(&body[..j]) {
                        Some((n, a)) => out.push(Piece::Call(n, a)),
                        None => out.push(Piece::Content(format!("{OPEN}{body}"))),
                    }
                    // The newline between calls (or before the end) is not content.
                    if self.buf.starts_with('\n') {
                        self.buf.remove(0);
                    }
                } else if let Some(i) = self.buf.find(OPEN) {
                    let before: String = self.buf.drain(..i + OPEN.len()).take(i).collect();
                    if !before.is_empty() {
                        out.push(Piece::Content(before));
                    }
                    self.in_call = true;
                } else {
                    let keep = partial_suffix(&self.buf, OPEN);
                    let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
                    if !emit.is_empty() {
                        out.push(Piece::Content(emit));
                    }
                    break;
                }
            },
            Family::Mistral | Family::Llama3 => {
                if self.content_mode {
                    out.push(Piece::Content(std::mem::take(&mut self.buf)));
                } else if !self.in_call {
                    let t = self.buf.trim_start();
                    if !t.is_empty() {
                        let marker = if self.family == Family::Mistral { MISTRAL } else { PYTHON_TAG };
                        let looks_like_call = marker.starts_with(&t[..t.len().min(marker.len())])
                            || t.starts_with(marker)
                            || (self.family == Family::Llama3 && t.starts_with('{'));
                        if looks_like_call {
                            self.in_call = true;
                        } else {
                            self.content_mode = true;
                            out.push(Piece::Content(std::mem::take(&mut self.buf)));
                        }
                    }
                }
            }
        }
        out.retain(|p| !matches!(p, Piece::Content(c) if c.is_empty()));
        out
    }

    /// The end of the reply: what is still held (an unfinished call is parsed if it can be, else content).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        if self.bare {
            let (content, mut calls) = self.family.parse(&rest);
            if calls.is_empty() {
                calls = bare_calls(&rest, &self.names).unwrap_or_default();
                if calls.is_empty() {
                    out.push(Piece::Content(rest));
                }
            } else {
                out.extend(content.map(Piece::Content));
            }
            out.extend(calls.into_iter().map(|(n, a)| Piece::Call(n, a)));
            self.bare = false;
            out.retain(|p| !matches!(p, Piece::Content(c) if c.is_empty()));
            return out;
        }
        match self.family {
            Family::Hermes if self.in_call => match call_of(&rest) {
                Some((n, a)) => out.push(Piece::Call(n, a)),
                None => out.push(Piece::Content(format!("{OPEN}{rest}"))),
            },
            Family::Hermes => out.push(Piece::Content(rest)),
            _ if self.in_call => {
                let (content, calls) = self.family.parse(&rest);
                if calls.is_empty() {
                    out.push(Piece::Content(rest));
                } else {
                    out.extend(content.map(Piece::Content));
                    out.extend(calls.into_iter().map(|(n, a)| Piece::Call(n, a)));
                }
            }
            _ => out.push(Piece::Content(rest)),
        }
        self.in_call = false;
        out.retain(|p| !matches!(p, Piece::Content(c) if c.is_empty()));
        out
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A new tool call id, `call_` and 24 letters and digits.
pub fn call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    let (mut a, mut b) = (h.finish(), std::collections::hash_map::RandomState::new().build_hasher().finish());
    let mut id = String::from("call_");
    for i in 0..24 {
        let x = if i < 12 { &mut a } else { &mut b };
        id.push(ALPHABET[(*x % ALPHABET.len() as u64) as usize] as char);
        *x /= ALPHABET.len() as u64;
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_whole_and_streamed_agree_at_every_cut() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = Family::Hermes.parse(text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls, vec![("get_weather".into(), "{\"city\":\"Paris\"}".into()), ("get_time".into(), "{}".into())]);
        for step in 1..8 {
            let mut s = CallStreamer::new(Family::Hermes, vec![]);
            let mut pieces = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for chunk in chars.chunks(step) {
                pieces.extend(s.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(s.finish());
            let got_calls: Vec<_> =
                pieces.iter().filter_map(|p| if let Piece::Call(n, a) = p { Some((n.clone(), a.clone())) } else { None }).collect();
            let got_content: String =
                pieces.iter().filter_map(|p| if let Piece::Content(c) = p { Some(c.as_str()) } else { None }).collect();
            assert_eq!(got_calls, calls, "step {step}");
            assert_eq!(got_content.trim(), "Let me check.", "step {step}");
        }
    }

    #[test]
    fn text_without_calls_and_broken_calls_stay_content() {
        assert_eq!(Family::Hermes.parse("Hello <tool"), (Some("Hello <tool".into()), vec![]));
        let broken = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>";
        assert_eq!(Family::Hermes.parse(broken), (Some(broken.into()), vec![]));
        let mut s = CallStreamer::new(Family::Hermes, vec![]);
        let mut out = s.push("a <tool");
        out.extend(s.push("box> b"));
        out.extend(s.finish());
        let text: String = out.iter().map(|p| if let Piece::Content(c) = p { c.clone() } else { panic!() }).collect();
        assert_eq!(text, "a <toolbox> b");
    }

    #[test]
    fn mistral_and_llama3() {
        let (c, calls) = Family::Mistral.parse("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": 1}}]");
        assert_eq!((c, calls), (None, vec![("f".into(), "{\"x\":1}".into())]));
        let (c, calls) = Family::Llama3.parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}");
        assert_eq!((c, calls), (None, vec![("f".into(), "{\"x\":1}".into())]));
        assert_eq!(Family::Llama3.parse("Paris."), (Some("Paris.".into()), vec![]));
        let mut s = CallStreamer::new(Family::Llama3, vec![]);
        let mut out = s.push("{\"name\": \"f\", ");
        out.extend(s.push("\"parameters\": {}}"));
        out.extend(s.finish());
        assert_eq!(out, vec![Piece::Call("f".into(), "{}".into())]);
    }

    #[test]
    fn bare_calls_name_a_tool() {
        let names = vec!["get_weather".to_string()];
        let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        assert_eq!(bare_calls(fenced, &names), Some(vec![("get_weather".into(), "{\"city\":\"Paris\"}".into())]));
        let two = "{\"name\": \"get_weather\", \"arguments\": {}}\n{\"name\": \"get_weather\", \"arguments\": {\"x\": 1}}";
        assert_eq!(bare_calls(two, &names).map(|c| c.len()), Some(2));
        assert_eq!(bare_calls("{\"name\": \"other\", \"arguments\": {}}", &names), None);
        assert_eq!(bare_calls("{\"a\": 1}", &names), None);
        assert_eq!(bare_calls("The weather is fine.", &names), None);
        // Streamed: held until the end, then the calls; JSON that is no call comes out as content.
        for (text, want) in [(fenced, 1), ("{\"a\": 1}", 0)] {
            let mut s = CallStreamer::new(Family::Hermes, names.clone());
            let mut out = Vec::new();
            for ch in text.chars() {
                out.extend(s.push(&ch.to_string()));
            }
            out.extend(s.finish());
            let calls = out.iter().filter(|p| matches!(p, Piece::Call(..))).count();
            assert_eq!(calls, want, "{out:?}");
            if want == 0 {
                assert_eq!(out, vec![Piece::Content(text.into())]);
            }
        }
    }

    #[test]
    fn families_of_templates() {
        assert_eq!(Family::of_template("{{ '<tool_call>' }}"), Some(Family::Hermes));
        assert_eq!(Family::of_template("[TOOL_CALLS] {{ x }}"), Some(Family::Mistral));
        assert_eq!(Family::of_template("<|python_tag|>"), Some(Family::Llama3));
        assert_eq!(Family::of_template("{{ messages }}"), None);
        let ids: std::collections::HashSet<String> = (0..50).map(|_| call_id()).collect();
        assert_eq!(ids.len(), 50);
        assert!(ids.iter().all(|i| i.len() == 29 && i.starts_with("call_")));
    }
}
