//! Tool calls: which syntax a chat template asks the model to write calls in, the grammar of a valid call
//! (for `tool_choice` `required` or a named function), and reading the calls back from the model's text as
//! it streams (the whole reply is read by the same reader in one step, so both agree).
//!
//! Families (recognised from the template's source; the syntax is what the template writes for an
//! assistant message with `tool_calls`, which is what the model was trained to write):
//! - Hermes (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`,
//!   one block per call, text around them is content.
//! - Mistral, JSON list (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (some
//!   tokenizers decode a space after the marker; the reader allows it, the grammar allows one).
//! - Mistral, `[ARGS]` syntax (Mistral Small 3.2, Devstral, Ministral 3: the template writes `[ARGS]`):
//!   `[TOOL_CALLS]name[ARGS]{…}` per call (history may carry `[CALL_ID]id` before `[ARGS]`; the reader
//!   skips it, the grammar does not write it).
//! - Llama 3.1+: the reply is a JSON object `{"name": …, "parameters": {…}}` (the key the Llama 3.1/3.2/3.3
//!   templates ask for and render; `"arguments"` is read too), after `<|python_tag|>` when the model writes
//!   one; several calls separated by `;`.
//!
//! Streaming: a call is announced (its name) as soon as the name is read and its arguments follow as they
//! are generated, when the call opens with its marker (or, Llama 3, with `{"name": …`) and writes the name
//! before the arguments, as every template does and the call grammar forces. A call the reader can only
//! recognise at its end is held until then: a reply that opens as bare JSON or a Markdown code fence
//! without the family's marker (small models often write calls that way), and a call object whose keys
//! come in another order. A streamed call whose arguments turn out malformed (possible only without a
//! grammar) has been sent as far as it went; the whole reply then reads it as content.
//!
//! - Generic, for a template that writes calls in none of these ways (SmolLM2, Gemma 3): the model is
//!   told the tools and the format in a system message ([`generic_messages`]) and the whole reply is one
//!   JSON object under a grammar, as llama.cpp's generic format: `{"tool_call": {"name": …, "arguments":
//!   {…}}}` (`{"tool_calls": [{…}, …]}` when parallel calls are allowed) or, with `tool_choice` `auto`,
//!   `{"response": "…"}`, whose text streams as content. Past calls and tool results are written into
//!   the conversation in the same JSON (a result as a user message), as the template cannot write them.

use crate::api::{Tool, ToolChoice, Tools};
use serde_json::{json, Value};

/// A reply read for calls: its content (`None` when blank) and its calls as (name, arguments JSON text).
pub type Reply = (Option<String>, Vec<(String, String)>);

/// The tool-call syntax of a chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Hermes,
    /// `[TOOL_CALLS][{…}, …]`.
    Mistral,
    /// `[TOOL_CALLS]name[ARGS]{…}`.
    MistralArgs,
    Llama3,
    /// No call syntax in the template: one JSON object a reply (see the module docs). `json`: the request
    /// has a `response_format`, so a response is its JSON and kept as written (a string with its quotes);
    /// otherwise the response is a string whose text is the content.
    Generic {
        json: bool,
    },
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const MISTRAL: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl Family {
    /// The family whose markers the template `source` writes; `None` when it has no tool-call syntax eddy
    /// knows.
    pub fn of_template(source: &str) -> Option<Family> {
        if source.contains(OPEN) {
            Some(Family::Hermes)
        } else if source.contains(MISTRAL) && source.contains(ARGS) {
            Some(Family::MistralArgs)
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
        !matches!(self, Family::Hermes | Family::Generic { .. })
    }

    /// Whether this is the generic format ([`Family::Generic`]).
    pub fn is_generic(self) -> bool {
        matches!(self, Family::Generic { .. })
    }

    fn is_mistral(self) -> bool {
        matches!(self, Family::Mistral | Family::MistralArgs)
    }

    /// A new tool call id: Mistral's templates accept only 9 letters and digits (and refuse the
    /// conversation otherwise), the others get OpenAI's form, `call_` and 24 letters and digits.
    pub fn call_id(self) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let (prefix, n) = if self.is_mistral() { ("", 9) } else { ("call_", 24) };
        let mut id = String::from(prefix);
        let mut x = crate::api::random_seed();
        for i in 0..n {
            if i % 10 == 0 {
                x = crate::api::random_seed();
            }
            id.push(ALPHABET[(x % ALPHABET.len() as u64) as usize] as char);
            x /= ALPHABET.len() as u64;
        }
        id
    }

    /// A llguidance Lark grammar of the reply that `tools.choice` requires: one call (or, with
    /// `parallel` and `required`, one or more) of the allowed tools, written as the template writes
    /// calls, arguments valid under each tool's schema. A named function is called exactly once, as
    /// OpenAI and vLLM do (repeating it would only run on to `max_tokens`). `special_id(text)` gives the
    /// id of a control token (Mistral's markers).
    ///
    /// [`Family::Generic`]'s grammar is that of every reply, whatever the choice: with `auto` it allows
    /// `{"response": …}` too, the response a string or, given `response_schema` (a `response_format`'s),
    /// JSON matching it. The other families ignore `response_schema`.
    pub fn call_grammar(
        self,
        tools: &Tools,
        response_schema: Option<&Value>,
        special_id: impl Fn(&str) -> Option<u32>,
    ) -> Result<String, String> {
        let allowed: Vec<&Tool> = match &tools.choice {
            ToolChoice::Named(n) => tools.tools.iter().filter(|t| &t.name == n).collect(),
            _ => tools.tools.iter().collect(),
        };
        let parallel = tools.parallel && !matches!(tools.choice, ToolChoice::Named(_));
        let args_key = if self == Family::Llama3 { "parameters" } else { "arguments" };
        let compact = grammar_options();
        // Arguments admit only the keys a tool's schema lists, unless it says otherwise.
        let params = |t: &Tool| {
            let mut p = t.parameters.clone();
            crate::grammar::close_objects(&mut p);
            p
        };
        // A schema with references (`#/$defs/…`, `#`) sits in the root's `$defs` as `tool{i}`, its
        // references rebased there, so that they resolve in the tool's own schema, not in the wrapper.
        let mut defs = serde_json::Map::new();
        let mut args = |i: usize, t: &Tool| {
            let mut p = params(t);
            if !has_internal_ref(&p) {
                return p;
            }
            let at = format!("#/$defs/tool{i}");
            rebase_refs(&mut p, &at);
            defs.insert(format!("tool{i}"), p);
            json!({"$ref": at})
        };
        let one: Vec<Value> = allowed
            .iter()
            .enumerate()
            .map(|(i, t)| {
                json!({"type": "object", "properties": {"name": {"const": t.name}, args_key: args(i, t)},
                       "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        // Generic with `auto`: the response a reply may be instead of calls. The response schema's own
        // `x-guidance` options (llguidance reads them at the root only) go to the root, over eddy's.
        let mut reply_options = compact.clone();
        let response = (self.is_generic() && tools.choice == ToolChoice::Auto).then(|| match response_schema {
            None => json!({"type": "string"}),
            Some(schema) => {
                let mut p = schema.clone();
                crate::grammar::close_objects(&mut p);
                if let Some(Value::Object(own)) = p.as_object_mut().and_then(|o| o.remove("x-guidance")) {
                    if let Some(r) = reply_options.as_object_mut() {
                        r.extend(own);
                    }
                }
                if !has_internal_ref(&p) {
                    return p;
                }
                rebase_refs(&mut p, "#/$defs/response");
                defs.insert("response".into(), p);
                json!({"$ref": "#/$defs/response"})
            }
        });
        let with_defs = |mut v: Value| {
            if !defs.is_empty() {
                v["$defs"] = Value::Object(defs.clone());
            }
            v
        };
        let call = with_defs(json!({"anyOf": one, "x-guidance": compact}));
        let text = |v: &Value| serde_json::to_string(v).map_err(|e| e.to_string());
        let special = |name: &str| special_id(name).ok_or_else(|| format!("the tokenizer has no {name} token"));
        Ok(match self {
            Family::Hermes => format!(
                "start: call{}\ncall: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\nbody: %json {}\n",
                if parallel { " (\"\\n\" call)*" } else { "" },
                text(&call)?
            ),
            Family::Mistral => {
                let id = special(MISTRAL)?;
                // The Nemo template writes each call's 9-character id after its arguments.
                let items: Vec<Value> = one
                    .iter()
                    .map(|o| {
                        let mut o = o.clone();
                        o["properties"]["id"] = json!({"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"});
                        o
                    })
                    .collect();
                let mut list = with_defs(json!({"type": "array", "minItems": 1, "items": {"anyOf": items}, "x-guidance": compact}));
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!("start: <[{id}]> \" \"? body\nbody: %json {}\n", text(&list)?)
            }
            Family::MistralArgs => {
                let (tc, args) = (special(MISTRAL)?, special(ARGS)?);
                let mut g = format!(
                    "start: call{}\ncall: <[{tc}]> ({})\n",
                    if parallel { "+" } else { "" },
                    (0..allowed.len()).map(|i| format!("fn{i}")).collect::<Vec<_>>().join(" | ")
                );
                for (i, t) in allowed.iter().enumerate() {
                    // Each tool's arguments are a grammar of their own: its schema is the root.
                    let schema = json!({"allOf": [params(t)], "x-guidance": compact});
                    let schema = match has_internal_ref(&schema["allOf"][0]) {
                        false => schema,
                        true => {
                            let mut p = params(t);
                            rebase_refs(&mut p, "#/$defs/tool");
                            json!({"allOf": [{"$ref": "#/$defs/tool"}], "$defs": {"tool": p}, "x-guidance": compact})
                        }
                    };
                    g.push_str(&format!("fn{i}: {} <[{args}]> args{i}\nargs{i}: %json {}\n", text(&json!(t.name))?, text(&schema)?));
                }
                g
            }
            Family::Llama3 => format!("start: body\nbody: %json {}\n", text(&call)?),
            Family::Generic { .. } => {
                let calls = if parallel {
                    json!({"type": "object", "properties": {"tool_calls": {"type": "array", "minItems": 1, "items": {"anyOf": one}}},
                           "required": ["tool_calls"], "additionalProperties": false})
                } else {
                    json!({"type": "object", "properties": {"tool_call": {"anyOf": one}}, "required": ["tool_call"], "additionalProperties": false})
                };
                let mut reply = match response {
                    None => calls,
                    Some(r) => json!({"anyOf": [calls, {"type": "object", "properties": {"response": r}, "required": ["response"],
                                                        "additionalProperties": false}]}),
                };
                reply["x-guidance"] = reply_options;
                format!("start: body\nbody: %json {}\n", text(&with_defs(reply))?)
            }
        })
    }

    /// Splits a whole reply into its content (text outside the calls, trimmed; `None` when blank; the generic
    /// format's response as written, `None` when empty) and its tool
    /// calls as `(name, arguments JSON text as written)`, read as a stream read in one step. When a call's
    /// arguments are not a JSON object (a malformed call), the whole reply is content.
    pub fn parse(self, text: &str, names: &[String]) -> Reply {
        self.parse_reply(text, names, false)
    }

    /// [`Family::parse`] of a reply that may have been `cut` off by the token limit (finish reason
    /// `length`): then the last call's arguments may be unfinished and are kept as written, as a streamed
    /// reply has already sent them (OpenAI's behaviour too); every other call must still be well formed.
    pub fn parse_reply(self, text: &str, names: &[String], cut: bool) -> Reply {
        let mut s = CallStreamer::new(self, names.to_vec());
        let mut pieces = s.push(text);
        pieces.extend(s.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(c) => content.push_str(&c),
                Piece::Call(n) => calls.push((n, String::new())),
                Piece::Args(a) => {
                    if let Some(c) = calls.last_mut() {
                        c.1.push_str(&a)
                    }
                }
            }
        }
        let whole = calls.len() - usize::from(cut && !calls.is_empty());
        let valid = calls[..whole].iter().all(|(_, a)| serde_json::from_str::<Value>(a).is_ok_and(|v| v.is_object()));
        if !valid {
            return (Some(text.trim().to_string()).filter(|t| !t.is_empty()), Vec::new());
        }
        // A generic reply's content is its response as streamed, whitespace and all.
        let content = match self.is_generic() {
            true => Some(content).filter(|c| !c.is_empty()),
            false => (!content.trim().is_empty()).then(|| content.trim().to_string()),
        };
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

/// A whole generic reply ([`Family::Generic`]) read at once: its content (the response, a string's text or
/// other JSON as written compactly) and its calls; `None` when it is no such object.
fn generic_reply(text: &str) -> Option<Reply> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    match (v.get("response"), v.get("tool_call"), v.get("tool_calls")) {
        (Some(Value::String(r)), None, None) => Some((Some(r.clone()), Vec::new())),
        (Some(r), None, None) => Some((Some(r.to_string()), Vec::new())),
        (None, Some(c), None) => Some((None, vec![call_of_value(c)?])),
        (None, None, Some(Value::Array(cs))) => Some((None, cs.iter().map(call_of_value).collect::<Option<_>>()?)),
        _ => None,
    }
}

/// JSON as Python's `json.dumps` writes it by default (`, ` and `: ` separators), as the generic format's
/// grammar makes the model write it ([`grammar_options`]).
pub fn spaced_json(v: &Value) -> String {
    struct Spaced;
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    // Writing a `Value` into memory cannot fail, and what it writes is UTF-8.
    let _ = serde::Serialize::serialize(v, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// The conversation `messages` (as [`crate::api::parse_messages`] gives them) for a template without
/// tool-call syntax ([`Family::Generic`]), as llama.cpp's generic format (and minja's polyfills for such
/// templates) writes it:
/// - a system message tells the model the tools (`tools`: the request's list, OpenAI's form, one function
///   a line) and the reply format for `choice` and `parallel`, or with `tool_choice` `none` that it calls
///   none now (appended to the conversation's own system message, or first; none without tools);
/// - an assistant message with `tool_calls` carries them as its content in the reply format, after its
///   text;
/// - a tool result becomes a user message `{"tool_response": {"name": …, "content": …}}` (the name from the
///   message, else from the call its `tool_call_id` answers; left out when neither gives it), and results
///   in a row share one message, so
///   that templates which require turns to alternate (Gemma) take them (a user message right after them
///   joins that message too).
pub fn generic_messages(messages: &[Value], tools: Option<&Value>, choice: &ToolChoice, parallel: bool) -> Vec<Value> {
    let parallel = parallel && !matches!(choice, ToolChoice::Named(_));
    let call_form = "{\"name\": \"<function name>\", \"arguments\": {<arguments>}}";
    let calls_form = if parallel {
        format!("{{\"tool_calls\": [{call_form}, …]}} to call one or more functions")
    } else {
        format!("{{\"tool_call\": {call_form}}} to call a function")
    };
    let listed = tools.and_then(Value::as_array).filter(|l| !l.is_empty());
    let mut note = String::from("You can call these functions (each with a JSON Schema of its arguments):\n");
    for t in listed.into_iter().flatten() {
        note.push_str(&spaced_json(t.get("function").unwrap_or(t)));
        note.push('\n');
    }
    note.push_str(&match choice {
        ToolChoice::None => "\nNo function can be called in this reply: answer the user in plain text.".to_string(),
        ToolChoice::Auto => format!(
            "\nReply with one JSON object: {calls_form}, or {{\"response\": \"<your reply>\"}} to answer the user. A function's result comes back as {{\"tool_response\": {{\"name\": …, \"content\": …}}}}."
        ),
        ToolChoice::Named(n) => format!("\nCall the function `{n}`: reply with one JSON object, {{\"tool_call\": {{\"name\": \"{n}\", \"arguments\": {{<arguments>}}}}}}."),
        _ => format!("\nReply with one JSON object: {calls_form}."),
    });
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    match messages.first() {
        _ if listed.is_none() => {}
        Some(m) if m["role"] == "system" => {
            let own = m["content"].as_str().unwrap_or("");
            let mut m = m.clone();
            m["content"] = json!(if own.is_empty() { note } else { format!("{own}\n\n{note}") });
            out.push(m);
        }
        _ => out.push(json!({"role": "system", "content": note})),
    }
    // Tool call ids to names, for results that give only the id.
    let mut named = std::collections::HashMap::new();
    let mut merged_result = false;
    let skip = listed.is_some() && messages.first().is_some_and(|m| m["role"] == "system");
    for m in messages.iter().skip(usize::from(skip)) {
        let mut m = m.clone();
        let calls = m.as_object_mut().and_then(|o| o.remove("tool_calls")).and_then(|c| c.as_array().cloned());
        if let Some(calls) = calls.filter(|c| !c.is_empty()) {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let name = c.pointer("/function/name").cloned().unwrap_or(Value::Null);
                    if let (Some(id), Some(n)) = (c.get("id").and_then(Value::as_str), name.as_str()) {
                        named.insert(id.to_string(), n.to_string());
                    }
                    json!({"name": name, "arguments": c.pointer("/function/arguments").cloned().unwrap_or(json!({}))})
                })
                .collect();
            let json = match calls.as_slice() {
                [one] if !parallel => json!({"tool_call": one}),
                _ => json!({"tool_calls": calls}),
            };
            let text = m["content"].as_str().unwrap_or("").trim();
            let json = spaced_json(&json);
            m["content"] = json!(if text.is_empty() { json } else { format!("{text}\n{json}") });
        }
        if m["role"] == "tool" {
            let name = m
                .get("name")
                .and_then(Value::as_str)
                .map(String::from)
                .or_else(|| m.get("tool_call_id").and_then(Value::as_str).and_then(|id| named.get(id).cloned()));
            let result = match name {
                Some(name) => json!({"tool_response": {"name": name, "content": m["content"]}}),
                None => json!({"tool_response": {"content": m["content"]}}),
            };
            let text = spaced_json(&result);
            match out.last_mut() {
                Some(last) if merged_result => {
                    let joined = format!("{}\n{text}", last["content"].as_str().unwrap_or(""));
                    last["content"] = json!(joined);
                }
                _ => out.push(json!({"role": "user", "content": text})),
            }
            merged_result = true;
            continue;
        }
        match out.last_mut() {
            // The user's next words after results: the same turn.
            Some(last) if merged_result && m["role"] == "user" => {
                let joined = format!("{}\n\n{}", last["content"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or(""));
                last["content"] = json!(joined);
            }
            _ => out.push(m),
        }
        merged_result = false;
    }
    out
}

/// The JSON values of `text`, separated by whitespace, `,` or `;` and possibly inside one `[…]` list (a
/// call list written in a form the streaming reader could not follow); `None` unless all of it parses.
fn json_values(text: &str) -> Option<Vec<Value>> {
    let mut t = text.trim();
    if let Some(inner) = t.strip_prefix('[') {
        t = inner.trim_end().strip_suffix(']')?;
    }
    let mut out = Vec::new();
    loop {
        t = t.trim_start_matches(|c: char| c.is_whitespace() || c == ',' || c == ';');
        if t.is_empty() {
            return Some(out);
        }
        let mut it = serde_json::Deserializer::from_str(t).into_iter::<Value>();
        out.push(it.next()?.ok()?);
        t = &t[it.byte_offset()..];
    }
}

/// `{"name": …, "arguments" | "parameters": {…}}` as (name, arguments JSON text).
fn call_of_value(v: &Value) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    args.is_object().then(|| (name, args.to_string()))
}

/// How far the head of a call object, `{"name": "…", "arguments" | "parameters": `, has been read.
#[derive(Debug, PartialEq)]
enum Head {
    /// The text so far may still become one.
    More,
    /// It is something else (other keys or order, or arguments that are not an object).
    Not,
    /// The name, and the byte offset where the arguments object (its `{`) begins.
    At(String, usize),
}

/// Why a scan of the text so far stopped short of what it looked for.
enum Miss {
    /// The text so far may still become it.
    More,
    /// It is something else.
    Not,
}

/// A reading position in text that may end early (more is streaming in).
struct Cursor<'a> {
    s: &'a str,
    i: usize,
}

impl Cursor<'_> {
    fn ws(&mut self) {
        let b = self.s.as_bytes();
        while self.i < b.len() && b[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    /// Skips whitespace, then the first of `lits` that is next; its index in `lits`.
    fn lit(&mut self, lits: &[&str]) -> Result<usize, Miss> {
        self.ws();
        let rest = &self.s[self.i..];
        if let Some(k) = lits.iter().position(|l| rest.starts_with(l)) {
            self.i += lits[k].len();
            return Ok(k);
        }
        Err(if lits.iter().any(|l| l.starts_with(rest)) { Miss::More } else { Miss::Not })
    }

    /// Skips whitespace, then a JSON string: its value.
    fn string(&mut self) -> Result<String, Miss> {
        self.lit(&["\""])?;
        let (b, start) = (self.s.as_bytes(), self.i - 1);
        let mut esc = false;
        loop {
            let Some(&ch) = b.get(self.i) else {
                return Err(Miss::More);
            };
            self.i += 1;
            match ch {
                _ if esc => esc = false,
                b'\\' => esc = true,
                b'"' => break,
                _ => {}
            }
        }
        serde_json::from_str(&self.s[start..self.i]).map_err(|_| Miss::Not)
    }

    /// Skips whitespace; the next byte, if the text has one yet.
    fn peek(&mut self) -> Result<u8, Miss> {
        self.ws();
        self.s.as_bytes().get(self.i).copied().ok_or(Miss::More)
    }
}

/// Reads the head of a call object at the start of `s` (leading whitespace allowed).
fn scan_head(s: &str) -> Head {
    let mut c = Cursor { s, i: 0 };
    let mut run = || -> Result<Head, Miss> {
        c.lit(&["{"])?;
        c.lit(&["\"name\""])?;
        c.lit(&[":"])?;
        let name = c.string()?;
        c.lit(&[","])?;
        c.lit(&["\"arguments\"", "\"parameters\""])?;
        c.lit(&[":"])?;
        match c.peek()? {
            b'{' => Ok(Head::At(name, c.i)),
            _ => Err(Miss::Not),
        }
    };
    run().unwrap_or_else(|m| match m {
        Miss::More => Head::More,
        Miss::Not => Head::Not,
    })
}

/// The name of a call object cut off after its name (`{"name": "…"` and perhaps more of the head).
fn head_name(s: &str) -> Option<String> {
    let mut c = Cursor { s, i: 0 };
    c.lit(&["{"]).ok()?;
    c.lit(&["\"name\""]).ok()?;
    c.lit(&[":"]).ok()?;
    c.string().ok()
}

/// How far the head of a generic reply ([`Family::Generic`]) has been read: `{"response": `,
/// `{"tool_call": ` or `{"tool_calls": [`.
#[derive(Debug, PartialEq)]
enum Envelope {
    More,
    Not,
    /// `{"response": "`: the string's text begins at this byte offset.
    Text(usize),
    /// `{"response": ` and a value other than a string (a `response_format` schema's), beginning here.
    Value(usize),
    /// `{"tool_call": `: the call object begins at this offset (after whitespace).
    Call(usize),
    /// `{"tool_calls": [`: the first call object begins at this offset.
    Calls(usize),
}

/// Reads the head of a generic reply at the start of `s` (leading whitespace allowed).
fn scan_envelope(s: &str) -> Envelope {
    let mut c = Cursor { s, i: 0 };
    let mut run = || -> Result<Envelope, Miss> {
        c.lit(&["{"])?;
        let key = c.lit(&["\"response\"", "\"tool_call\"", "\"tool_calls\""])?;
        c.lit(&[":"])?;
        let first = c.peek()?;
        Ok(match (key, first) {
            (0, b'"') => Envelope::Text(c.i + 1),
            (0, _) => Envelope::Value(c.i),
            (1, b'{') => Envelope::Call(c.i),
            (2, b'[') => Envelope::Calls(c.i + 1),
            _ => Envelope::Not,
        })
    };
    run().unwrap_or_else(|m| match m {
        Miss::More => Envelope::More,
        Miss::Not => Envelope::Not,
    })
}

/// The longest prefix of `s` (the inside of a JSON string being streamed) that holds only whole
/// characters and escapes (a `\\u` high surrogate with its low one), and whether the string's closing
/// quote ends it.
fn string_prefix(s: &str) -> (usize, bool) {
    let b = s.as_bytes();
    let hex = |at: usize| {
        b.get(at..at + 4)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .map(|h| h.iter().fold(0u32, |x, &d| x * 16 + (d as char).to_digit(16).unwrap_or(0)))
    };
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => return (i, true),
            b'\\' => {
                let need = match b.get(i + 1) {
                    None => return (i, false),
                    Some(b'u') => match hex(i + 2) {
                        None if b.len() < i + 6 => return (i, false),
                        // Not an escape: only the two bytes are stepped over (the decoder refuses it).
                        None => 2,
                        // A high surrogate takes its low one with it, once the text can tell.
                        Some(0xD800..=0xDBFF) if b.len() < i + 12 => return (i, false),
                        Some(0xD800..=0xDBFF) if b[i + 6] == b'\\' && b[i + 7] == b'u' && hex(i + 8).is_some() => 12,
                        Some(_) => 6,
                    },
                    Some(_) => 2,
                };
                if i + need > b.len() {
                    return (i, false);
                }
                i += need;
            }
            _ => i += 1,
        }
    }
    (i, false)
}

/// Finds where a JSON value ends, fed in pieces: brackets counted outside strings.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct ValueEnd {
    depth: u32,
    in_str: bool,
    esc: bool,
}

impl ValueEnd {
    /// Reads `s`, which continues the value; `Some(n)` when its first `n` bytes close it (depth back to
    /// zero), else `None` (all of `s` is inside it).
    fn feed(&mut self, s: &str) -> Option<usize> {
        for (i, &c) in s.as_bytes().iter().enumerate() {
            if self.in_str {
                match c {
                    _ if self.esc => self.esc = false,
                    b'\\' => self.esc = true,
                    b'"' => self.in_str = false,
                    _ => {}
                }
            } else {
                match c {
                    b'"' => self.in_str = true,
                    b'{' | b'[' => self.depth += 1,
                    b'}' | b']' => {
                        self.depth = self.depth.saturating_sub(1);
                        if self.depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
            }
        }
        None
    }
}

/// What a reply with tools produces as its text arrives.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Content text.
    Content(String),
    /// A tool call begins: its name. Its arguments follow as `Args`.
    Call(String),
    /// The next fragment of the current call's arguments (JSON text as the model wrote it).
    Args(String),
}

/// Where the reader is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Content; Hermes and Mistral watch for their marker. `start`: nothing non-blank seen yet.
    Text { start: bool },
    /// After `[TOOL_CALLS]`: a `[` list or a name follows.
    Marker,
    /// A call object is next.
    Head,
    /// Mistral `[ARGS]` syntax: the name, up to `[ARGS]`.
    Name,
    /// Inside the arguments.
    Args(ValueEnd),
    /// After the arguments, to the end of the call object (depth 1 when it started).
    ObjectTail(ValueEnd),
    /// After a call: what separates it from the next, or ends the calls.
    Between,
    /// A call whose head is not name first: held to its end (Hermes `</tool_call>`, else the reply end).
    Whole,
    /// The reply opened as bare JSON or a code fence: held to the end.
    Bare,
    /// The rest is content (a Llama 3 reply that is no call).
    Content,
    /// Generic: the reply's head (`{"response": ` or `{"tool_call": ` or `{"tool_calls": [`) is next.
    Envelope,
    /// Generic: inside the response string (`raw`: kept as written, quotes and escapes, else decoded).
    Response { raw: bool },
    /// Generic: inside a response that is a number, `true`, `false` or `null`.
    ResponseScalar,
    /// Generic: inside a response that is a JSON object or list.
    ResponseValue(ValueEnd),
    /// Generic: after the response or the calls, the end of the reply's object.
    Rest,
}

/// Reads tool calls out of streamed text (see the module docs): content goes out as it comes (holding
/// back what may be the start of a marker), each call's name as soon as it is read, then its arguments.
pub struct CallStreamer {
    family: Family,
    /// The request's tool names (for calls written bare).
    names: Vec<String>,
    state: State,
    /// Mistral: the current calls are a JSON list.
    list: bool,
    /// A call was read (blank text after calls is not content).
    after_call: bool,
    buf: String,
}

impl CallStreamer {
    pub fn new(family: Family, names: Vec<String>) -> Self {
        let state = if family.is_generic() { State::Envelope } else { State::Text { start: true } };
        CallStreamer { family, names, state, list: false, after_call: false, buf: String::new() }
    }

    /// Adds `text`; returns the pieces now complete.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out.retain(|p| !matches!(p, Piece::Content(c) if c.is_empty()));
        out
    }

    fn take(&mut self, n: usize) -> String {
        self.buf.drain(..n).collect()
    }

    fn skip_ws(&mut self) {
        let n = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..n);
    }

    /// One step of the reader; `false` when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        let f = self.family;
        match self.state {
            State::Text { start } => {
                if start || self.after_call {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return false;
                    }
                    if start {
                        self.state = State::Text { start: false };
                        if t.starts_with('`') || (t.starts_with('{') && f != Family::Llama3) {
                            self.state = State::Bare;
                            return false;
                        }
                        if f == Family::Llama3 {
                            if PYTHON_TAG.starts_with(t) && t.len() < PYTHON_TAG.len() {
                                self.state = State::Text { start: true };
                                return false;
                            }
                            self.skip_ws();
                            if self.buf.starts_with(PYTHON_TAG) {
                                self.take(PYTHON_TAG.len());
                            }
                            self.state = if self.buf.trim_start().starts_with('{') || self.buf.trim_start().is_empty() {
                                State::Head
                            } else {
                                State::Content
                            };
                            return true;
                        }
                    }
                    if self.after_call {
                        self.skip_ws();
                        self.after_call = false;
                    }
                }
                if f == Family::Llama3 {
                    self.state = State::Content;
                    return true;
                }
                let marker = if f == Family::Hermes { OPEN } else { MISTRAL };
                if let Some(i) = self.buf.find(marker) {
                    let before = self.take(i);
                    out.push(Piece::Content(before));
                    self.take(marker.len());
                    self.state = if f == Family::Hermes { State::Head } else { State::Marker };
                    true
                } else {
                    let keep = partial_suffix(&self.buf, marker);
                    let emit = self.take(self.buf.len() - keep);
                    out.push(Piece::Content(emit));
                    false
                }
            }
            State::Marker => {
                self.skip_ws();
                if self.buf.is_empty() {
                    return false;
                }
                self.list = self.buf.starts_with('[');
                if self.list {
                    self.take(1);
                    self.state = State::Head;
                } else {
                    self.state = State::Name;
                }
                true
            }
            State::Head => match scan_head(&self.buf) {
                Head::More => false,
                Head::Not => {
                    self.state = State::Whole;
                    true
                }
                Head::At(name, at) => {
                    self.take(at);
                    out.push(Piece::Call(name));
                    self.state = State::Args(ValueEnd::default());
                    true
                }
            },
            State::Name => {
                let Some(i) = self.buf.find(ARGS) else {
                    return false;
                };
                let raw = self.take(i);
                self.take(ARGS.len());
                let name = raw.split(CALL_ID).next().unwrap_or("").trim().to_string();
                out.push(Piece::Call(name));
                self.state = State::Args(ValueEnd::default());
                true
            }
            State::Args(mut v) => {
                // Hermes: a `</tool_call>` ends the call even if its arguments never closed.
                let (limit, closed) = match (f, self.buf.find(CLOSE)) {
                    (Family::Hermes, Some(j)) => (j, true),
                    (Family::Hermes, None) => (self.buf.len() - partial_suffix(&self.buf, CLOSE), false),
                    _ => (self.buf.len(), false),
                };
                match v.feed(&self.buf[..limit]) {
                    Some(n) => {
                        let a = self.take(n);
                        out.push(Piece::Args(a));
                        self.state = if f == Family::MistralArgs {
                            State::Between
                        } else {
                            State::ObjectTail(ValueEnd { depth: 1, ..ValueEnd::default() })
                        };
                        true
                    }
                    None => {
                        let a = self.take(limit);
                        out.push(Piece::Args(a));
                        self.state = if closed { State::Between } else { State::Args(v) };
                        closed
                    }
                }
            }
            State::ObjectTail(mut v) => {
                let limit = match (f, self.buf.find(CLOSE)) {
                    (Family::Hermes, Some(j)) => j,
                    _ => self.buf.len(),
                };
                match v.feed(&self.buf[..limit]) {
                    Some(n) => {
                        self.take(n);
                        self.state = State::Between;
                        true
                    }
                    None if limit < self.buf.len() => {
                        self.take(limit);
                        self.state = State::Between;
                        true
                    }
                    None => {
                        self.take(limit);
                        self.state = State::ObjectTail(v);
                        false
                    }
                }
            }
            State::Between => {
                self.after_call = true;
                match f {
                    Family::Hermes => {
                        let Some(j) = self.buf.find(CLOSE) else {
                            return false;
                        };
                        self.take(j + CLOSE.len());
                        self.state = State::Text { start: false };
                        true
                    }
                    Family::Mistral | Family::MistralArgs if self.list => {
                        self.skip_ws();
                        match self.buf.chars().next() {
                            None => false,
                            Some(',') => {
                                self.take(1);
                                self.state = State::Head;
                                true
                            }
                            Some(']') => {
                                self.take(1);
                                self.state = State::Text { start: false };
                                true
                            }
                            Some(_) => {
                                self.state = State::Text { start: false };
                                true
                            }
                        }
                    }
                    Family::Mistral | Family::MistralArgs => {
                        self.state = State::Text { start: false };
                        true
                    }
                    Family::Llama3 => {
                        self.skip_ws();
                        match self.buf.chars().next() {
                            None => false,
                            Some(';') => {
                                self.take(1);
                                self.state = State::Head;
                                true
                            }
                            Some(_) => {
                                self.state = State::Content;
                                true
                            }
                        }
                    }
                    Family::Generic { .. } => {
                        self.skip_ws();
                        match self.buf.chars().next() {
                            None if self.list => false,
                            Some(',') if self.list => {
                                self.take(1);
                                self.state = State::Head;
                                true
                            }
                            _ => {
                                self.state = State::Rest;
                                true
                            }
                        }
                    }
                }
            }
            State::Whole => {
                if f == Family::Hermes {
                    let Some(j) = self.buf.find(CLOSE) else {
                        return false;
                    };
                    let body = self.take(j + CLOSE.len());
                    match call_of_value_text(&body[..j]) {
                        Some((n, a)) => {
                            out.push(Piece::Call(n));
                            out.push(Piece::Args(a));
                            self.after_call = true;
                        }
                        None => out.push(Piece::Content(format!("{OPEN}{body}"))),
                    }
                    self.state = State::Text { start: false };
                    return true;
                }
                false
            }
            State::Bare => false,
            State::Content => {
                let t = std::mem::take(&mut self.buf);
                out.push(Piece::Content(t));
                false
            }
            State::Envelope => {
                let t = self.buf.trim_start();
                if t.is_empty() {
                    return false;
                }
                if !t.starts_with('{') {
                    self.state = State::Content;
                    return true;
                }
                match scan_envelope(&self.buf) {
                    Envelope::More => false,
                    Envelope::Text(at) => {
                        let raw = matches!(self.family, Family::Generic { json: true });
                        self.take(at);
                        if raw {
                            out.push(Piece::Content("\"".into()));
                        }
                        self.state = State::Response { raw };
                        true
                    }
                    Envelope::Value(at) => {
                        let object = matches!(self.buf.as_bytes()[at], b'{' | b'[');
                        self.take(at);
                        self.state = if object { State::ResponseValue(ValueEnd::default()) } else { State::ResponseScalar };
                        true
                    }
                    // Some other object: read whole at the end.
                    Envelope::Not => {
                        self.state = State::Bare;
                        false
                    }
                    Envelope::Call(at) => {
                        self.take(at);
                        self.state = State::Head;
                        true
                    }
                    Envelope::Calls(at) => {
                        self.take(at);
                        self.list = true;
                        self.state = State::Head;
                        true
                    }
                }
            }
            State::Response { raw } => {
                let (n, closed) = string_prefix(&self.buf);
                let text = self.take(n + usize::from(closed && raw));
                out.push(Piece::Content(match raw {
                    true => text,
                    false => serde_json::from_str(&format!("\"{text}\"")).unwrap_or(text),
                }));
                if closed {
                    if !raw {
                        self.take(1);
                    }
                    self.state = State::Rest;
                }
                closed
            }
            State::ResponseScalar | State::ResponseValue(_) => {
                let end = match &mut self.state {
                    State::ResponseValue(v) => v.feed(&self.buf),
                    // A scalar holds no `}`, `,` or whitespace: the first of them ends it.
                    _ => self.buf.find(|c: char| c == '}' || c == ',' || c.is_whitespace()),
                };
                let n = end.unwrap_or(self.buf.len());
                out.push(Piece::Content(self.take(n)));
                if end.is_some() {
                    self.state = State::Rest;
                }
                end.is_some()
            }
            State::Rest => {
                self.buf.clear();
                false
            }
        }
    }

    /// The end of the reply: what is still held (an unfinished call is read if it can be, else content).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        let calls = |out: &mut Vec<Piece>, calls: Vec<(String, String)>| {
            for (n, a) in calls {
                out.push(Piece::Call(n));
                out.push(Piece::Args(a));
            }
        };
        match self.state {
            State::Text { .. } if self.after_call && rest.trim().is_empty() => {}
            State::Text { .. } | State::Content => out.push(Piece::Content(rest)),
            State::Marker | State::Name => out.push(Piece::Content(format!("{MISTRAL}{rest}"))),
            State::Bare if self.family.is_generic() => match generic_reply(&rest) {
                Some((content, c)) => {
                    out.extend(content.map(Piece::Content));
                    calls(&mut out, c)
                }
                None => match bare_calls(&rest, &self.names) {
                    Some(c) => calls(&mut out, c),
                    None => out.push(Piece::Content(rest)),
                },
            },
            State::Bare => match bare_calls(&rest, &self.names) {
                Some(c) => calls(&mut out, c),
                None => out.push(Piece::Content(rest)),
            },
            State::Head | State::Whole => {
                let found =
                    json_values(&rest).and_then(|vs| vs.iter().map(call_of_value).collect::<Option<Vec<_>>>()).filter(|c| !c.is_empty());
                let named = if self.state == State::Head { head_name(&rest) } else { None };
                match (found, named) {
                    (Some(c), _) => calls(&mut out, c),
                    // Cut off after its name: the call, its arguments not begun (a whole reply keeps it
                    // only when it was cut off, as any call whose arguments did not close).
                    (None, Some(name)) => {
                        out.push(Piece::Call(name));
                        out.push(Piece::Args(String::new()));
                    }
                    // Generic: a call cut before its name is nothing (its text is the format's JSON).
                    (None, None) if self.family.is_generic() => {}
                    (None, None) => {
                        let marker = match self.family {
                            Family::Hermes => OPEN,
                            Family::Mistral | Family::MistralArgs => MISTRAL,
                            Family::Llama3 | Family::Generic { .. } => "",
                        };
                        let list = if self.list { "[" } else { "" };
                        out.push(Piece::Content(format!("{marker}{list}{rest}")))
                    }
                }
            }
            State::Args(_) => out.push(Piece::Args(rest)),
            State::ObjectTail(_) | State::Between => {}
            // A reply cut in its head or in a partial escape: nothing more to say.
            State::Envelope | State::Response { .. } | State::Rest => {}
            State::ResponseValue(_) | State::ResponseScalar => out.push(Piece::Content(rest)),
        }
        self.state = State::Text { start: false };
        out.retain(|p| !matches!(p, Piece::Content(c) if c.is_empty()));
        out
    }
}

/// Keywords whose values are data, not schemas (a `$ref` inside them is not a reference).
const DATA_KEYS: &[&str] = &["const", "enum", "default", "examples"];
/// Keywords whose values map names to schemas (their keys are names, never keywords).
const NAME_MAPS: &[&str] = &["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// A reference into the schema itself: `#`, or `#` and a JSON pointer (`#/…`).
fn is_internal(r: &str) -> bool {
    r == "#" || r.starts_with("#/")
}

/// Whether `schema` holds a reference into itself ([`is_internal`]).
fn has_internal_ref(schema: &Value) -> bool {
    let mut found = false;
    visit_refs(schema, false, &mut |r| found |= is_internal(r));
    found
}

/// Calls `f` on every `$ref` string of `schema` in keyword position (`names`: `schema` maps names to
/// schemas), skipping data keywords.
fn visit_refs(schema: &Value, names: bool, f: &mut dyn FnMut(&str)) {
    match schema {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    _ if names => visit_refs(v, false, f),
                    ("$ref", Value::String(r)) => f(r),
                    (k, _) if DATA_KEYS.contains(&k) => {}
                    (k, v) => visit_refs(v, NAME_MAPS.contains(&k), f),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| visit_refs(v, false, f)),
        _ => {}
    }
}

/// Rewrites every reference into `schema` itself (`#` or `#/…`) to the same pointer under `base`, where
/// the schema is placed in a larger one (`#/$defs/P` → `base/$defs/P`, `#` → `base`). Property names such as
/// `default` are names, not keywords: the schemas under them are rewritten too.
fn rebase_refs(schema: &mut Value, base: &str) {
    fn walk(v: &mut Value, names: bool, base: &str) {
        match v {
            Value::Object(m) => {
                for (k, v) in m.iter_mut() {
                    if names {
                        walk(v, false, base);
                        continue;
                    }
                    match (k.as_str(), v) {
                        ("$ref", Value::String(r)) if is_internal(r) => *r = format!("{base}{}", &r[1..]),
                        (k, _) if DATA_KEYS.contains(&k) => {}
                        (k, v) => walk(v, NAME_MAPS.contains(&k), base),
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|v| walk(v, false, base)),
            _ => {}
        }
    }
    walk(schema, false, base);
}

/// A call object's text as (name, arguments JSON text).
fn call_of_value_text(body: &str) -> Option<(String, String)> {
    call_of_value(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// llguidance options (`x-guidance`) of every JSON grammar eddy builds: JSON written compactly (`, ` and
/// `: ` separators, as Python's `json.dumps`) so that a small model cannot wander off into whitespace, and
/// `oneOf` accepted as `anyOf` (as llama.cpp's JSON-schema converter does: a value matching more than one
/// branch is let through; tool schemas in the wild use `oneOf` where branches rarely overlap).
pub fn grammar_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": true})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::Grammars;
    use eddy::sampling::LogitMask;

    /// Runs `text` through a fresh reader in pieces of `step` characters.
    fn streamed(f: Family, text: &str, step: usize, names: &[String]) -> Vec<Piece> {
        let mut s = CallStreamer::new(f, names.to_vec());
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for chunk in chars.chunks(step) {
            out.extend(s.push(&chunk.iter().collect::<String>()));
        }
        out.extend(s.finish());
        out
    }

    /// Content and calls (name, concatenated argument fragments) of streamed pieces.
    fn gather(pieces: &[Piece]) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(c) => content.push_str(c),
                Piece::Call(n) => calls.push((n.clone(), String::new())),
                Piece::Args(a) => calls.last_mut().unwrap().1.push_str(a),
            }
        }
        (content, calls)
    }

    /// Whole and streamed at every cut agree, and give `content` and `calls`.
    fn check(f: Family, text: &str, content: Option<&str>, calls: &[(&str, &str)]) {
        let want: Vec<(String, String)> = calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect();
        let whole = f.parse(text, &[]);
        assert_eq!(whole, (content.map(String::from), want.clone()), "{f:?} whole: {text}");
        for step in 1..9 {
            let (c, got) = gather(&streamed(f, text, step, &[]));
            assert_eq!(got, want, "{f:?} step {step}: {text}");
            // The generic format's content is exactly what streamed; the others' is trimmed.
            let c = if f.is_generic() { c.as_str() } else { c.trim() };
            assert_eq!(c, content.unwrap_or(""), "{f:?} step {step}: {text}");
        }
    }

    #[test]
    fn hermes_whole_and_streamed_agree_at_every_cut() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        check(Family::Hermes, text, Some("Let me check."), &[("get_weather", "{\"city\": \"Paris\"}"), ("get_time", "{}")]);
        // Keys in another order: recognised at the call's end.
        check(Family::Hermes, "<tool_call>\n{\"arguments\": {\"x\": 1}, \"name\": \"f\"}\n</tool_call>", None, &[("f", "{\"x\":1}")]);
    }

    #[test]
    fn long_arguments_stream_in_many_fragments() {
        let args = format!("{{\"path\": \"a.rs\", \"text\": \"{}\", \"n\": [1, {{\"k\": \"}}]\"}}]}}", "x y ".repeat(40));
        for (f, text) in [
            (Family::Hermes, format!("<tool_call>\n{{\"name\": \"write\", \"arguments\": {args}}}\n</tool_call>")),
            (Family::Mistral, format!("[TOOL_CALLS][{{\"name\": \"write\", \"arguments\": {args}}}]")),
            (Family::MistralArgs, format!("[TOOL_CALLS]write[ARGS]{args}")),
            (Family::Llama3, format!("{{\"name\": \"write\", \"parameters\": {args}}}")),
        ] {
            let pieces = streamed(f, &text, 3, &[]);
            // The name comes first, before any argument text; then many fragments.
            assert_eq!(pieces[0], Piece::Call("write".into()), "{f:?}");
            let fragments = pieces.iter().filter(|p| matches!(p, Piece::Args(_))).count();
            assert!(fragments > 20, "{f:?}: {fragments} fragments");
            assert_eq!(gather(&pieces).1, vec![("write".to_string(), args.clone())], "{f:?}");
            assert_eq!(f.parse(&text, &[]), (None, vec![("write".to_string(), args.clone())]), "{f:?}");
        }
    }

    #[test]
    fn text_without_calls_and_broken_calls_stay_content() {
        assert_eq!(Family::Hermes.parse("Hello <tool", &[]), (Some("Hello <tool".into()), vec![]));
        let broken = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>";
        assert_eq!(Family::Hermes.parse(broken, &[]), (Some(broken.into()), vec![]));
        let (text, calls) = gather(&streamed(Family::Hermes, "a <toolbox> b", 2, &[]));
        assert_eq!((text.as_str(), calls), ("a <toolbox> b", vec![]));
        assert_eq!(Family::Llama3.parse("Paris.", &[]), (Some("Paris.".into()), vec![]));
        assert_eq!(Family::Llama3.parse("{\"a\": 1}", &[]), (Some("{\"a\": 1}".into()), vec![]));
        assert_eq!(Family::Mistral.parse("No tools needed.", &[]), (Some("No tools needed.".into()), vec![]));
    }

    #[test]
    fn a_reply_cut_off_keeps_its_calls_as_streamed() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"city";
        let want = vec![("f".to_string(), "{\"x\": 1}".to_string()), ("g".to_string(), "{\"city".to_string())];
        assert_eq!(Family::Hermes.parse_reply(text, &[], true), (None, want.clone()));
        for step in 1..9 {
            assert_eq!(gather(&streamed(Family::Hermes, text, step, &[])), (String::new(), want.clone()), "step {step}");
        }
        // Cut off after a name: that call, no arguments yet, whole as streamed.
        let named = "<tool_call>\n{\"name\": \"get_weather\", \"argu";
        let want = vec![("get_weather".to_string(), String::new())];
        assert_eq!(Family::Hermes.parse_reply(named, &[], true), (None, want.clone()));
        for step in 1..9 {
            assert_eq!(gather(&streamed(Family::Hermes, named, step, &[])), (String::new(), want.clone()), "step {step}");
        }
        // Not cut off, the unfinished call makes the reply content, as before.
        assert_eq!(Family::Hermes.parse(text, &[]), (Some(text.into()), vec![]));
        // A block that is no call (its arguments are no object) stays content in both readings.
        let early = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"x\"}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {";
        let (content, calls) = Family::Hermes.parse_reply(early, &[], true);
        assert_eq!(calls, vec![("g".to_string(), "{".to_string())]);
        let (streamed_content, streamed_calls) = gather(&streamed(Family::Hermes, early, 3, &[]));
        assert_eq!((streamed_content.trim(), streamed_calls), (content.unwrap().as_str(), calls));
    }

    #[test]
    fn mistral_list_and_args_syntax() {
        let call = [("f", "{\"x\": 1}")];
        // As the Nemo template writes it (no space), as SentencePiece tokenizers decode it (a space), and
        // with the id the template adds.
        check(Family::Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}}]", None, &call);
        check(Family::Mistral, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": 1}}]", None, &call);
        check(
            Family::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}, \"id\": \"abcDEF123\"}, {\"name\": \"g\", \"arguments\": {}}]",
            None,
            &[("f", "{\"x\": 1}"), ("g", "{}")],
        );
        // Mistral Small 3.2 / Devstral / Ministral 3: name[ARGS]{…}, one marker per call, [CALL_ID] skipped.
        check(Family::MistralArgs, "[TOOL_CALLS]f[ARGS]{\"x\": 1}", None, &call);
        check(
            Family::MistralArgs,
            "Sure.[TOOL_CALLS]f[CALL_ID]abcDEF123[ARGS]{\"x\": 1}[TOOL_CALLS]g[ARGS]{}",
            Some("Sure."),
            &[("f", "{\"x\": 1}"), ("g", "{}")],
        );
    }

    #[test]
    fn llama3_calls() {
        let call = [("f", "{\"x\": 1}")];
        check(Family::Llama3, "{\"name\": \"f\", \"parameters\": {\"x\": 1}}", None, &call);
        check(Family::Llama3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}", None, &call);
        check(Family::Llama3, "{\"name\": \"f\", \"arguments\": {\"x\": 1}}", None, &call);
        // A `;` inside an argument is text, `;` between objects separates calls.
        check(
            Family::Llama3,
            "{\"name\": \"sh\", \"parameters\": {\"cmd\": \"cd a; ls\"}}; {\"name\": \"f\", \"parameters\": {\"x\": 1}}",
            None,
            &[("sh", "{\"cmd\": \"cd a; ls\"}"), ("f", "{\"x\": 1}")],
        );
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
        for f in [Family::Hermes, Family::Mistral, Family::Llama3] {
            let (c, calls) = gather(&streamed(f, fenced, 1, &names));
            assert_eq!((c.as_str(), calls.len()), ("", 1), "{f:?}");
            assert_eq!(f.parse(fenced, &names).1.len(), 1, "{f:?}");
        }
        let out = streamed(Family::Hermes, "{\"a\": 1}", 1, &names);
        assert_eq!(out, vec![Piece::Content("{\"a\": 1}".into())]);
    }

    #[test]
    fn families_of_templates_and_call_ids() {
        assert_eq!(Family::of_template("{{ '<tool_call>' }}"), Some(Family::Hermes));
        assert_eq!(Family::of_template("[TOOL_CALLS] {{ x }}"), Some(Family::Mistral));
        assert_eq!(Family::of_template("{{ '[TOOL_CALLS]' + n + '[ARGS]' }}"), Some(Family::MistralArgs));
        assert_eq!(Family::of_template("<|python_tag|>"), Some(Family::Llama3));
        assert_eq!(Family::of_template("{{ messages }}"), None);
        let ids: std::collections::HashSet<String> = (0..50).map(|_| Family::Hermes.call_id()).collect();
        assert_eq!(ids.len(), 50);
        assert!(ids.iter().all(|i| i.len() == 29 && i.starts_with("call_")), "{ids:?}");
        let ids: std::collections::HashSet<String> = (0..50).map(|_| Family::MistralArgs.call_id()).collect();
        assert_eq!(ids.len(), 50);
        assert!(ids.iter().all(|i| i.len() == 9 && i.chars().all(|c| c.is_ascii_alphanumeric())), "{ids:?}");
    }

    #[test]
    fn generic_replies_whole_and_streamed_agree_at_every_cut() {
        let g = Family::Generic { json: false };
        // Escapes, a surrogate pair, raw UTF-8: the response's text, decoded, whatever the cuts.
        check(
            g,
            "{\"response\": \"Line 1\\n\\\"q\\\" caf\\u00e9 \\ud83d\\ude00 naïve \\\\ end\"}",
            Some("Line 1\n\"q\" café 😀 naïve \\ end"),
            &[],
        );
        check(
            g,
            "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}",
            None,
            &[("get_weather", "{\"city\": \"Paris\"}")],
        );
        check(
            g,
            "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"x\": \"}]\"}}, {\"name\": \"g\", \"arguments\": {}}]}",
            None,
            &[("f", "{\"x\": \"}]\"}"), ("g", "{}")],
        );
        // A response_format schema's JSON streams as written: objects, numbers past f64 and i64, strings
        // with their quotes and escapes.
        check(g, "{\"response\": {\"a\": [1, \"}\"]}}", Some("{\"a\": [1, \"}\"]}"), &[]);
        check(g, "{\"response\": 25492651248239236268}", Some("25492651248239236268"), &[]);
        check(g, "{\"response\": 28E81384430994283248760}", Some("28E81384430994283248760"), &[]);
        check(g, "{\"response\": true}", Some("true"), &[]);
        check(g, "{\"response\": \" Hello, \"}", Some(" Hello, "), &[]);
        let json = Family::Generic { json: true };
        check(json, "{\"response\": \"a\\\"b \\u00e9\"}", Some("\"a\\\"b \\u00e9\""), &[]);
        check(json, "{\"tool_call\": {\"name\": \"f\", \"arguments\": {}}}", None, &[("f", "{}")]);
        // Without the envelope (a grammar-free model): text is content, a bare call is read at the end.
        check(g, "Hello there.", Some("Hello there."), &[]);
        let names = vec!["f".to_string()];
        assert_eq!(g.parse("{\"name\": \"f\", \"arguments\": {}}", &names), (None, vec![("f".into(), "{}".into())]));
        // The reply's text streams as it comes, not at its end.
        let pieces = streamed(g, &format!("{{\"response\": \"{}\"}}", "word ".repeat(30)), 4, &[]);
        assert!(pieces.iter().filter(|p| matches!(p, Piece::Content(_))).count() > 20, "{pieces:?}");
    }

    #[test]
    fn generic_replies_cut_off() {
        let g = Family::Generic { json: false };
        // Cut in the response: what was written; cut in an escape: the escape is not half-written.
        assert_eq!(g.parse_reply("{\"response\": \"Hello wor", &[], true), (Some("Hello wor".into()), vec![]));
        for step in 1..6 {
            let (c, calls) = gather(&streamed(g, "{\"response\": \"ab\\u00", step, &[]));
            assert_eq!((c.as_str(), calls.len()), ("ab", 0), "step {step}");
        }
        // Cut in a call's arguments: kept as streamed; cut in the next call's head: the call once its name
        // is whole, its arguments empty; nothing of it before.
        let text = "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"x\": 1}}, {\"name\": \"g\", \"argu";
        let f = ("f".to_string(), "{\"x\": 1}".to_string());
        assert_eq!(g.parse_reply(text, &[], true), (None, vec![f.clone(), ("g".into(), String::new())]));
        let text = "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"x\": 1}}, {\"name\": \"g";
        assert_eq!(g.parse_reply(text, &[], true), (None, vec![f]));
        let text = "{\"tool_call\": {\"name\": \"f\", \"arguments\": {\"x\": ";
        assert_eq!(g.parse_reply(text, &[], true), (None, vec![("f".into(), "{\"x\": ".into())]));
    }

    #[test]
    fn generic_grammar_by_choice() {
        let g = byte_grammars();
        let f = Family::Generic { json: false };
        let call = "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}";
        let calls = "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]}";
        let reply = "{\"response\": \"Hi!\"}";
        let auto = |parallel| test_tools(ToolChoice::Auto, parallel);
        for (tools, text, ok) in [
            (auto(false), call, true),
            (auto(false), reply, true),
            (auto(false), calls, false),
            (auto(true), calls, true),
            (auto(true), reply, true),
            (auto(true), call, false),
            (test_tools(ToolChoice::Required, false), reply, false),
            (test_tools(ToolChoice::Required, false), call, true),
            (test_tools(ToolChoice::Named("get_weather".into()), true), call, true),
            (test_tools(ToolChoice::Named("get_time".into()), true), call, false),
            (auto(false), "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}}", false),
            (auto(false), "{\"response\": \"Hi!\", \"tool_call\": {}}", false),
        ] {
            let r = grammar_allows(&g, f, &tools, text);
            assert_eq!(r.is_ok(), ok, "{:?} parallel {}: {text}: {r:?}", tools.choice, tools.parallel);
        }
        // A response_format schema (with a reference of its own) is the response's.
        let schema = json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
            "$defs": {"P": {"type": "integer"}}});
        grammar_allows_response(&g, f, &auto(false), Some(&schema), "{\"response\": {\"p\": 3}}").unwrap();
        assert!(grammar_allows_response(&g, f, &auto(false), Some(&schema), reply).is_err());
        grammar_allows_response(&g, f, &auto(false), Some(&schema), call).unwrap();
        // The schema's own llguidance options apply (at the root, where llguidance reads them).
        let tight = "{\"response\":{\"p\":3}}";
        assert!(grammar_allows_response(&g, f, &auto(false), Some(&schema), tight).is_err());
        let mut loose = schema.clone();
        loose["x-guidance"] = json!({"key_separator": ":"});
        grammar_allows_response(&g, f, &auto(false), Some(&loose), tight).unwrap();
    }

    #[test]
    fn generic_conversation_for_templates_without_tool_syntax() {
        let tools = test_tools(ToolChoice::Auto, false);
        let msgs = |m: Value| crate::api::parse_messages(json!({"messages": m}).as_object().unwrap()).unwrap();
        let conv = msgs(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
            {"role": "user", "content": "Thanks!"},
        ]));
        let out = generic_messages(&conv, Some(&tools.json), &tools.choice, false);
        let roles: Vec<&str> = out.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        let system = out[0]["content"].as_str().unwrap();
        assert!(system.starts_with("Be brief.\n\nYou can call these functions"), "{system}");
        assert!(
            system.contains("{\"name\": \"get_weather\", \"description\": \"The forecast.\", \"parameters\": {\"type\": \"object\""),
            "{system}"
        );
        assert!(system.contains("{\"tool_call\": {\"name\": \"<function name>\"") && system.contains("{\"response\": "), "{system}");
        assert_eq!(
            out[2],
            json!({"role": "assistant", "content": "Checking.\n{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]}"})
        );
        assert_eq!(
            out[3]["content"],
            "{\"tool_response\": {\"name\": \"get_weather\", \"content\": \"Sunny\"}}\n{\"tool_response\": {\"name\": \"get_time\", \"content\": \"12:00\"}}\n\nThanks!"
        );
        // Without a system message one comes first; a forced call leaves `response` out; one call with
        // parallel calls off is written as `tool_call`.
        let conv = msgs(json!([{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]));
        let out = generic_messages(&conv, Some(&tools.json), &ToolChoice::Required, false);
        assert_eq!(out[0]["role"], "system");
        assert!(!out[0]["content"].as_str().unwrap().contains("response"), "{}", out[0]["content"]);
        assert_eq!(out[2]["content"], "{\"tool_call\": {\"name\": \"get_time\", \"arguments\": {}}}");
        // Without tools (or with tool_choice none) past calls and results are still written out; the note
        // comes only with tools, and with none it says that no call can be made now.
        let conv = msgs(json!([{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            {"role": "assistant", "content": "Noon.", "tool_calls": []}]));
        let out = generic_messages(&conv, None, &ToolChoice::None, true);
        assert_eq!(
            out,
            vec![
                json!({"role": "user", "content": "Hi"}),
                json!({"role": "assistant", "content": "{\"tool_calls\": [{\"name\": \"get_time\", \"arguments\": {}}]}"}),
                json!({"role": "user", "content": "{\"tool_response\": {\"name\": \"get_time\", \"content\": \"12:00\"}}"}),
                json!({"role": "assistant", "content": "Noon."}),
            ]
        );
        let out = generic_messages(&conv, Some(&tools.json), &ToolChoice::None, true);
        let system = out[0]["content"].as_str().unwrap();
        assert!(system.contains("get_weather") && system.contains("plain text") && !system.contains("\"response\""), "{system}");
        // A template that requires alternating turns (as Gemma's) takes the rewritten conversation.
        let gemma = "{%- for m in messages %}{%- if m.role == 'system' %}{%- continue %}{%- endif %}{%- if (m.role == 'user') != (loop.index0 % 2 == 1) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{%- endfor %}";
        let t = eddy::chat::ChatTemplate::new(gemma, None, None).unwrap();
        let conv = msgs(json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        ]));
        assert!(t.render_json(&conv, true, &serde_json::Map::new()).is_err(), "the test template must refuse a tool turn");
        let out = generic_messages(&conv, Some(&tools.json), &tools.choice, true);
        let text = t.render_json(&out, true, &serde_json::Map::new()).unwrap();
        assert!(
            text.contains("<start_of_turn>user\n{\"tool_response\": {\"name\": \"get_weather\", \"content\": \"Sunny\"}}<end_of_turn>"),
            "{text}"
        );
    }

    #[test]
    fn spaced_json_writes_as_python() {
        assert_eq!(spaced_json(&json!({"a": [1, {"b": "é\n"}], "c": null})), "{\"a\": [1, {\"b\": \"é\\n\"}], \"c\": null}");
    }

    /// Special tokens of the test vocabulary (after the 256 bytes); the last is end-of-sequence.
    const SPECIALS: [&str; 6] = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<|eot_id|>", "</s>"];

    /// A vocabulary of the 256 bytes and `SPECIALS`, its grammars, and `text` as its token ids.
    fn byte_grammars() -> Grammars {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for s in SPECIALS {
            let mut w = vec![llguidance::toktrie::TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(s.as_bytes());
            words.push(w);
        }
        let eos = 256 + SPECIALS.len() as u32 - 1;
        Grammars::from_vocab(words, &[eos], Box::new(|s| s.bytes().map(u32::from).collect())).unwrap()
    }

    fn byte_tokens(mut text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        while !text.is_empty() {
            if let Some((i, s)) = SPECIALS.iter().enumerate().find(|(_, s)| text.starts_with(*s)) {
                ids.push(256 + i as u32);
                text = &text[s.len()..];
            } else {
                ids.push(text.as_bytes()[0] as u32);
                text = &text[1..];
            }
        }
        ids
    }

    /// Whether the call grammar of `f` for `tools` allows exactly `text` (each token under the mask, then
    /// the end).
    fn grammar_allows(g: &Grammars, f: Family, tools: &Tools, text: &str) -> Result<(), String> {
        grammar_allows_response(g, f, tools, None, text)
    }

    /// [`grammar_allows`] with a `response_format` schema (the generic format's response).
    fn grammar_allows_response(g: &Grammars, f: Family, tools: &Tools, response: Option<&Value>, text: &str) -> Result<(), String> {
        let special = |name: &str| SPECIALS.iter().position(|s| *s == name).map(|i| 256 + i as u32);
        let mut c = g.lark(f.call_grammar(tools, response, special)?)?;
        let n = 256 + SPECIALS.len();
        for (k, id) in byte_tokens(text).into_iter().enumerate() {
            let mut logits = vec![0.0f32; n];
            c.apply(&mut logits);
            if logits[id as usize] == f32::NEG_INFINITY {
                return Err(format!("token {k} ({id}) refused in {text:?}"));
            }
            c.consume(id);
        }
        let mut logits = vec![0.0f32; n];
        c.apply(&mut logits);
        if logits[n - 1] == f32::NEG_INFINITY {
            return Err(format!("the end refused after {text:?}"));
        }
        Ok(())
    }

    fn test_tools(choice: ToolChoice, parallel: bool) -> Tools {
        let params =
            json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]});
        let json = json!([{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": params}},
                          {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": {"type": "object", "properties": {}}}}]);
        Tools {
            tools: vec![
                Tool { name: "get_weather".into(), parameters: params },
                Tool { name: "get_time".into(), parameters: json!({"type": "object", "properties": {}}) },
            ],
            json,
            choice,
            parallel,
        }
    }

    /// The assistant turn with one call of get_weather(city="Paris", days=3) as `template` renders it
    /// (between the generation prompt and the end-of-turn text `end`), with the end-of-turn text cut.
    fn rendered_call(template: &str, f: Family, bos: &str, end: &str) -> String {
        let t = eddy::chat::ChatTemplate::new(template, Some(bos.into()), Some(end.into())).unwrap();
        let tools = test_tools(ToolChoice::Auto, true);
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("tools".into(), tools.json.clone());
        // The messages as the server passes them on (an OpenAI SDK's assistant message: content null,
        // arguments a JSON string).
        let user = json!({"role": "user", "content": "Weather in Paris for 3 days?"});
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": f.call_id(), "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]});
        let msgs = |m: Value| crate::api::parse_messages(json!({"messages": m}).as_object().unwrap()).unwrap();
        let prompt = t.render_json(&msgs(json!([user])), true, &kwargs).unwrap();
        let full = t.render_json(&msgs(json!([user, call])), false, &kwargs).unwrap();
        let turn = full.strip_prefix(prompt.as_str()).unwrap_or_else(|| panic!("{full:?} does not extend {prompt:?}"));
        let turn = turn.trim_end();
        turn.strip_suffix(end).unwrap_or(turn).to_string()
    }

    /// The template's call, the reader and the grammar agree: the rendered call is read back as the call,
    /// and the grammar of `required` / a named call allows exactly that text (the grammar does not write a
    /// `[CALL_ID]`: ids are the server's).
    fn check_template(template: &str, want: Family, bos: &str, end: &str) {
        let f = Family::of_template(template);
        assert_eq!(f, Some(want));
        let text = rendered_call(template, want, bos, end);
        let (content, calls) = want.parse(&text, &[]);
        assert_eq!(content, None, "{text:?}");
        assert_eq!(calls.len(), 1, "{text:?}");
        assert_eq!(calls[0].0, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), json!({"city": "Paris", "days": 3}));
        let g = byte_grammars();
        let text = match text.find(CALL_ID) {
            Some(i) => format!("{}{}", &text[..i], &text[text.find(ARGS).unwrap()..]),
            None => text,
        };
        for choice in [ToolChoice::Required, ToolChoice::Named("get_weather".into())] {
            for parallel in [false, true] {
                grammar_allows(&g, want, &test_tools(choice.clone(), parallel), &text)
                    .unwrap_or_else(|e| panic!("{want:?} {choice:?}: {e}"));
            }
        }
        // And refuses a call of another tool when one is named.
        assert!(grammar_allows(&g, want, &test_tools(ToolChoice::Named("get_time".into()), true), &text).is_err());
        if want == Family::Hermes {
            // Two calls: allowed for `required` with parallel calls, never for a named function.
            let two = format!("{text}\n{text}");
            grammar_allows(&g, want, &test_tools(ToolChoice::Required, true), &two).unwrap_or_else(|e| panic!("two calls: {e}"));
            assert!(grammar_allows(&g, want, &test_tools(ToolChoice::Required, false), &two).is_err());
            assert!(grammar_allows(&g, want, &test_tools(ToolChoice::Named("get_weather".into()), true), &two).is_err());
        }
    }

    /// Short templates written for these tests, each writing a call in its family's syntax as the real
    /// templates do (Llama 3.1: `{"name": …, "parameters": …}`; Mistral Nemo: `[TOOL_CALLS][…]`;
    /// Mistral Small 3.2: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{…}`; Qwen2.5: `<tool_call>`).
    #[test]
    fn template_reader_and_grammar_agree() {
        let head =
            "{%- for m in messages %}{%- if m.role == 'user' %}[U]{{ m.content }}{%- if tools %}{{ tools | tojson }}{%- endif %}[/U]";
        let tail = "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}[A]{%- endif %}";
        let llama = format!("{head}{{%- elif m.tool_calls %}}[A]{{%- set c = m.tool_calls[0].function %}}{{{{ '{{\"name\": \"' + c.name + '\", ' }}}}{{{{ '\"parameters\": ' }}}}{{{{ c.arguments | tojson }}}}{{{{ '}}' }}}}<|eot_id|>{tail}");
        check_template(&llama, Family::Llama3, "", "<|eot_id|>");
        let nemo = format!("{head}{{%- elif m.tool_calls %}}[A]{{{{ '[TOOL_CALLS][' }}}}{{%- for t in m.tool_calls %}}{{%- set out = t.function | tojson %}}{{{{ out[:-1] }}}}{{{{ ', \"id\": \"' + t.id + '\"}}' }}}}{{%- if not loop.last %}}, {{%- else %}}]{{{{ eos_token }}}}{{%- endif %}}{{%- endfor %}}{tail}");
        check_template(&nemo, Family::Mistral, "<s>", "</s>");
        let small = format!("{head}{{%- elif m.tool_calls %}}[A]{{%- for t in m.tool_calls %}}{{{{ '[TOOL_CALLS]' + t.function.name }}}}{{%- if t.id | length != 9 %}}{{{{ raise_exception('ids of length 9') }}}}{{%- endif %}}{{{{ '[CALL_ID]' + t.id }}}}{{{{ '[ARGS]' + t.function.arguments | tojson }}}}{{%- endfor %}}{{{{ eos_token }}}}{tail}");
        check_template(&small, Family::MistralArgs, "<s>", "</s>");
        let qwen = format!("{head}{{%- elif m.tool_calls %}}[A]{{%- for t in m.tool_calls %}}{{%- if not loop.first %}}{{{{ '\\n' }}}}{{%- endif %}}<tool_call>\n{{{{ '{{\"name\": \"' + t.function.name + '\", \"arguments\": ' }}}}{{{{ t.function.arguments | tojson }}}}{{{{ '}}' }}}}\n</tool_call>{{%- endfor %}}<|im_end|>{tail}");
        check_template(&qwen, Family::Hermes, "", "<|im_end|>");
    }

    /// Tool schemas with references (`$defs`, `definitions`, `#` recursion; pydantic's nested models) resolve
    /// in the tool's own schema in every family's grammar: the right shape is allowed, a wrong one refused,
    /// and a `$ref` inside `const`/`enum` data is left alone.
    #[test]
    fn tool_schemas_with_references() {
        let g = byte_grammars();
        let nested = json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}});
        let old = json!({"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}}, "required": ["p"],
            "definitions": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}});
        let tree = json!({"type": "object", "properties": {"label": {"type": "string"}, "child": {"$ref": "#"}}, "required": ["label"]});
        let tools = |params: &Value| Tools {
            tools: vec![Tool { name: "f".into(), parameters: params.clone() }, Tool { name: "g".into(), parameters: nested.clone() }],
            json: json!([]),
            choice: ToolChoice::Named("f".into()),
            parallel: false,
        };
        let call = |f: Family, args: &str| match f {
            Family::Hermes => format!("<tool_call>\n{{\"name\": \"f\", \"arguments\": {args}}}\n</tool_call>"),
            Family::Llama3 => format!("{{\"name\": \"f\", \"parameters\": {args}}}"),
            Family::Mistral => format!("[TOOL_CALLS][{{\"name\": \"f\", \"arguments\": {args}, \"id\": \"abcdefghi\"}}]"),
            Family::MistralArgs => format!("[TOOL_CALLS]f[ARGS]{args}"),
            Family::Generic { .. } => format!("{{\"tool_call\": {{\"name\": \"f\", \"arguments\": {args}}}}}"),
        };
        for f in [Family::Hermes, Family::Llama3, Family::Mistral, Family::MistralArgs, Family::Generic { json: false }] {
            for params in [&nested, &old] {
                grammar_allows(&g, f, &tools(params), &call(f, "{\"p\": {\"x\": 1}}")).unwrap_or_else(|e| panic!("{f:?}: {e}"));
                assert!(grammar_allows(&g, f, &tools(params), &call(f, "{\"p\": {\"y\": 1}}")).is_err(), "{f:?}");
            }
            let ok = "{\"label\": \"root\", \"child\": {\"label\": \"leaf\"}}";
            grammar_allows(&g, f, &tools(&tree), &call(f, ok)).unwrap_or_else(|e| panic!("{f:?}: {e}"));
            let wrapper = "{\"label\": \"root\", \"child\": {\"name\": \"f\", \"arguments\": {\"label\": \"x\"}}}";
            assert!(grammar_allows(&g, f, &tools(&tree), &call(f, wrapper)).is_err(), "{f:?}: # is the tool's schema");
        }
        let mut data = json!({"properties": {"k": {"const": {"$ref": "#/x"}}, "r": {"$ref": "#/$defs/A"},
            "default": {"$ref": "#/$defs/M"}, "n": {"$ref": "#node"}}});
        assert!(has_internal_ref(&json!({"properties": {"default": {"$ref": "#"}}})), "a property named default is a schema");
        rebase_refs(&mut data, "#/$defs/tool0");
        assert_eq!(
            data,
            json!({"properties": {"k": {"const": {"$ref": "#/x"}}, "r": {"$ref": "#/$defs/tool0/$defs/A"},
                "default": {"$ref": "#/$defs/tool0/$defs/M"}, "n": {"$ref": "#node"}}})
        );
    }

    /// The same against the real templates in llama.cpp's source tree (`models/templates`), when
    /// `EDDY_CHAT_TEMPLATES` names that folder (README, "Tool calls"); without it this test does nothing.
    /// The files are not part of this repository (their licences and provenance are the model makers').
    #[test]
    fn real_templates_reader_and_grammar_agree() {
        let Ok(dir) = std::env::var("EDDY_CHAT_TEMPLATES") else {
            return;
        };
        let dir = std::path::Path::new(&dir);
        for (file, f, bos, end) in [
            ("meta-llama-Llama-3.1-8B-Instruct.jinja", Family::Llama3, "<|begin_of_text|>", "<|eot_id|>"),
            ("meta-llama-Llama-3.2-3B-Instruct.jinja", Family::Llama3, "<|begin_of_text|>", "<|eot_id|>"),
            ("meta-llama-Llama-3.3-70B-Instruct.jinja", Family::Llama3, "<|begin_of_text|>", "<|eot_id|>"),
            ("mistralai-Mistral-Nemo-Instruct-2407.jinja", Family::Mistral, "<s>", "</s>"),
            ("Mistral-Small-3.2-24B-Instruct-2506.jinja", Family::MistralArgs, "<s>", "</s>"),
            ("unsloth-mistral-Devstral-Small-2507.jinja", Family::MistralArgs, "<s>", "</s>"),
            ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", Family::MistralArgs, "<s>", "</s>"),
            ("Qwen-Qwen2.5-7B-Instruct.jinja", Family::Hermes, "", "<|im_end|>"),
            ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", Family::Hermes, "<|begin_of_text|>", "<|im_end|>"),
        ] {
            let p = dir.join(file);
            let src = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            check_template(&src, f, bos, end);
        }
    }
}
