//! Chat templates: render a conversation to the prompt text the model was trained on, as transformers'
//! `apply_chat_template(messages, tokenize=False, add_generation_prompt=..., **kwargs)` does.
//!
//! Templates are Jinja; eddy renders them with minijinja set up like transformers' sandboxed Jinja2
//! environment: `trim_blocks` and `lstrip_blocks` on, the trailing newline dropped, loop controls, Python
//! string/dict methods (`.strip()`, `.items()`, …), `raise_exception(msg)`, `strftime_now(fmt)`, and a
//! `tojson` that writes what Python's `json.dumps(x, ensure_ascii=False)` writes (with `indent`,
//! `separators`, `sort_keys` and `ensure_ascii` arguments). Values print as Python prints them (`True`,
//! `None`, `1e-05`, `['a', 1]`). The context holds `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token` (when known), `tools = None`, `documents = None`, and the caller's kwargs (which may override
//! all but `messages` and `add_generation_prompt`).

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, ErrorKind, Output, State};
use std::path::Path;
use std::sync::Arc;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Why a model's template did not compile ([`ChatTemplate::compile_error`]): rendering it is that error.
    broken: Option<String>,
    /// [`ChatTemplate::end_text`].
    end_text: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// Most template instructions one render may run (minijinja's fuel): real chat templates, tools and long
/// conversations included, run well under a million; a runaway loop (nested `range`s that each stay under
/// minijinja's own range limit) is stopped at this many — about a second — with an error instead of
/// holding a core and the request forever.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// ChatML, the chat format llama.cpp falls back to for a model without a template: each message
/// `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n` as the generation prompt
/// ([`ChatTemplate::chatml`] puts the tokenizer's BOS first where it adds one).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The text that ends a ChatML turn ([`CHATML_TEMPLATE`]).
pub const CHATML_END: &str = "<|im_end|>";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings the template sees under those names.
    /// A syntax error is an [`Error::Text`].
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| Error::Text(format!("chat template: {e}")))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Text(format!("chat template does not compile: {}", describe(&e))))?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token, eos_token, broken: None, end_text: None })
    }

    /// Why the model's template does not compile, if it does not: a model's template (from a GGUF file or a
    /// folder) that fails to compile is kept with its error, which every rendering returns, so that what
    /// needs no template (raw prompts, perplexity, speed, quantize) still runs, as llama.cpp's tools do.
    pub fn compile_error(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The template in GGUF metadata `tokenizer.chat_template`, with the tokenizer's BOS/EOS names;
    /// `None` when the file has none (base models). A non-string value is an [`Error::Model`].
    pub fn from_gguf(g: &GgufFile, tok: &Tokenizer) -> Result<Option<Self>> {
        let Some(v) = g.get("tokenizer.chat_template") else { return Ok(None) };
        let source = v.as_str().ok_or_else(|| Error::model(&g.path, "metadata tokenizer.chat_template is not a string"))?;
        Self::with_tokenizer(source, tok).map(Some).map_err(|e| Error::model(&g.path, e.to_string()))
    }

    /// The template of a Hugging Face model folder: `chat_template.jinja`, else `chat_template.json`
    /// (`{"chat_template": ...}`), else `"chat_template"` in `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` of which the one named `default` is used). `None` when there is none.
    pub fn from_dir(dir: &Path, tok: &Tokenizer) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| Error::model(&jinja, format!("cannot read: {e}")))?;
            return Self::with_tokenizer(&source, tok).map(Some).map_err(|e| Error::model(&jinja, e.to_string()));
        }
        for name in ["chat_template.json", "tokenizer_config.json"] {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed JSON: {e}")))?;
            let source = match json.get("chat_template") {
                None | Some(serde_json::Value::Null) => continue,
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(list)) => {
                    let named = list.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                    match named.and_then(|t| t.get("template")).and_then(|t| t.as_str()) {
                        Some(s) => s.to_string(),
                        None => return Err(Error::model(&path, "chat_template list has no template named \"default\"")),
                    }
                }
                Some(_) => return Err(Error::model(&path, "chat_template is neither a string nor a list of templates")),
            };
            return Self::with_tokenizer(&source, tok).map(Some).map_err(|e| Error::model(&path, e.to_string()));
        }
        Ok(None)
    }

    /// [`CHATML_TEMPLATE`] for the model of `tok`, with its BOS first when `tok` adds one to a text it
    /// encodes (as llama.cpp's prompt then starts with it; the chat prompt is encoded without adding it).
    pub fn chatml(tok: &Tokenizer) -> Self {
        let bos = tok.add_bos && tok.bos_id.is_some();
        let source = if bos { format!("{{{{ bos_token }}}}{CHATML_TEMPLATE}") } else { CHATML_TEMPLATE.to_string() };
        // The source is eddy's own and compiles: a failure would be kept as the template's error.
        let mut t = Self::with_tokenizer(&source, tok).unwrap_or_else(|e| ChatTemplate {
            env: Environment::new(),
            source,
            bos_token: None,
            eos_token: None,
            broken: Some(e.to_string()),
            end_text: None,
        });
        // A vocabulary without `<|im_end|>` cannot end the turn with a token: the model writes it as text.
        t.end_text = tok.token_id(CHATML_END).is_none().then(|| CHATML_END.to_string());
        t
    }

    /// Text that ends a reply in this template's format where the model has no token for it: the ChatML
    /// fallback's `<|im_end|>` on a vocabulary without that token ([`ChatTemplate::chatml`]; `None` for a
    /// model's own template). Generation stops at it, as at a stop string ([`crate::stop::StopMatcher`]),
    /// and the text is left out of the reply; without it the model writes on into turns it invents.
    pub fn end_text(&self) -> Option<&str> {
        self.end_text.as_deref()
    }

    /// The model's template `template`, or when it has none [`ChatTemplate::chatml`], announced by a
    /// one-line warning on stderr: what `eddy run` and `eddy serve` chat with (llama.cpp's fallback too).
    pub fn or_chatml(template: Option<Self>, tok: &Tokenizer) -> Self {
        template.unwrap_or_else(|| {
            eprintln!("warning: the model has no chat template; chatting in ChatML (<|im_start|>role ... <|im_end|>), as llama.cpp does");
            Self::chatml(tok)
        })
    }

    fn with_tokenizer(source: &str, tok: &Tokenizer) -> Result<Self> {
        let name = |id: Option<u32>| id.and_then(|i| tok.token_str(i));
        let (bos, eos) = (name(tok.bos_id), name(tok.eos_id));
        match Self::new(source, bos.clone(), eos.clone()) {
            Err(Error::Text(m)) if m.starts_with("chat template does not compile") => Ok(ChatTemplate {
                env: Environment::new(),
                source: source.to_string(),
                bos_token: bos,
                eos_token: eos,
                broken: Some(m),
                end_text: None,
            }),
            r => r,
        }
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` as transformers' `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=..., **kwargs)`. A template that raises, or fails, is an [`Error::Text`].
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        // Built directly (not through serde_json, whose maps sort their keys unless its `preserve_order`
        // feature is on): role first, then content, as Python dicts keep them.
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                OrderedMap::value(vec![
                    ("role".to_string(), Value::from(m.role.as_str())),
                    ("content".to_string(), Value::from(m.content.as_str())),
                ])
            })
            .collect();
        self.render_values(msgs, add_generation_prompt, kwargs)
    }

    /// [`render`](Self::render) of messages given as JSON objects, passed to the template as they are (key
    /// order kept): `role`, `content`, and whatever else the template reads, e.g. an assistant message's
    /// `tool_calls` or a tool message's `tool_call_id`. Tools go in `kwargs` under `tools`. Keys keep the
    /// order of `serde_json::Map` (insertion order when serde_json's `preserve_order` feature is on).
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.render_values(messages.iter().map(json_to_value).collect(), add_generation_prompt, kwargs)
    }

    fn render_values(
        &self,
        msgs: Vec<Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = Vec::new();
        let mut set = |k: &str, v: Value| match ctx.iter_mut().find(|(key, _)| key == k) {
            Some(slot) => slot.1 = v,
            None => ctx.push((k.to_string(), v)),
        };
        if let Some(b) = &self.bos_token {
            set("bos_token", Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos_token {
            set("eos_token", Value::from(e.as_str()));
        }
        set("tools", Value::from(()));
        set("documents", Value::from(()));
        for (k, v) in kwargs {
            set(k, json_to_value(v));
        }
        set("messages", Value::from(msgs));
        set("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(m) = &self.broken {
            return Err(Error::Text(m.clone()));
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Text(format!("chat template: {}", describe(&e))))?;
        tmpl.render(OrderedMap::value(ctx)).map_err(|e| Error::Text(format!("chat template: {}", describe(&e))))
    }
}

impl ChatTemplate {
    /// Renders `messages` so that the model continues the final (assistant) message, as transformers'
    /// `apply_chat_template(messages, continue_final_message=True)`: the whole conversation is rendered
    /// without a generation prompt and cut right after the final message's (whitespace-trimmed)
    /// content, dropping the end-of-turn text the template writes after it. A final assistant message
    /// with empty content starts a fresh reply instead (the other messages with the generation prompt).
    ///
    /// Errors ([`Error::Text`]): the last message is not `assistant`; the rendered text does not contain
    /// the final message's content (the template rewrites it, so it cannot be continued); template errors.
    pub fn render_continue(&self, messages: &[ChatMessage], kwargs: &serde_json::Map<String, serde_json::Value>) -> Result<String> {
        let Some(last) = messages.last().filter(|m| m.role == "assistant") else {
            return Err(Error::Text("only a final assistant message can be continued".into()));
        };
        let tail = last.content.trim();
        if tail.is_empty() {
            return self.render(&messages[..messages.len() - 1], true, kwargs);
        }
        let full = self.render(messages, false, kwargs)?;
        cut_after(full, tail)
    }

    /// [`render_continue`](Self::render_continue) of messages given as JSON objects (see
    /// [`render_json`](Self::render_json)).
    pub fn render_continue_json(
        &self,
        messages: &[serde_json::Value],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let Some(last) = messages.last().filter(|m| m["role"] == "assistant") else {
            return Err(Error::Text("only a final assistant message can be continued".into()));
        };
        let tail = last["content"].as_str().unwrap_or("").trim();
        if tail.is_empty() {
            return self.render_json(&messages[..messages.len() - 1], true, kwargs);
        }
        let full = self.render_json(messages, false, kwargs)?;
        cut_after(full, tail)
    }
}

/// `full` cut right after the last occurrence of `tail` (the continued message's content).
fn cut_after(full: String, tail: &str) -> Result<String> {
    match full.rfind(tail) {
        Some(at) => Ok(full[..at + tail.len()].to_string()),
        None => Err(Error::Text("the chat template does not write the final assistant message as given, so it cannot be continued".into())),
    }
}

/// The prompt ids for a rendered chat, as transformers' `apply_chat_template(tokenize=True)`: templates
/// write BOS themselves, so the text is encoded without adding special tokens.
pub fn encode_chat(tok: &Tokenizer, rendered: &str) -> Result<Vec<u32>> {
    tok.encode(rendered, false)
}

/// Whether `s` holds the text of one of `tok`'s special tokens (what [`encode_chat_guarded`] guards).
pub fn has_special_text(tok: &Tokenizer, s: &str) -> bool {
    tok.special_token_texts().iter().any(|t| s.contains(t.as_str()))
}

/// The byte that [`defang`] writes over the first byte of a special token's text.
const DEFANG: u8 = b'~';

/// `s` with the first byte of every special-token text in it overwritten by `~` (`^` where it already is
/// `~`): the same length, the same characters elsewhere, no special token left, nothing a JSON string
/// escapes or a trim removes. `None` if `s` holds none, or one that starts with a non-ASCII byte or that the
/// overwrite cannot remove. A chat rendered with its messages' texts defanged has the template's markup, and
/// only it, as special tokens: [`encode_chat_guarded`] takes their places from there.
pub fn defang(tok: &Tokenizer, s: &str) -> Option<String> {
    let specials = tok.special_token_texts();
    let find = |s: &str| specials.iter().filter_map(|t| s.find(t.as_str())).min();
    find(s)?;
    let mut b = s.as_bytes().to_vec();
    for _ in 0..8 {
        let Some(at) = find(std::str::from_utf8(&b).ok()?) else {
            return String::from_utf8(b).ok();
        };
        if !b[at].is_ascii() {
            return None;
        }
        b[at] = if b[at] == DEFANG { b'^' } else { DEFANG };
    }
    None
}

/// [`encode_chat`] that reads special-token text written inside `untrusted` strings (message contents,
/// tool arguments and descriptions: what users and tools wrote) as plain text, and only the template's own
/// markup as special tokens, so that a user cannot open a turn of another role by writing `<|im_start|>`,
/// nor turn the template's `<|im_end|>` into text by writing `<|im_end|>`.
///
/// `render_defanged`: renders the same conversation with each untrusted string passed through [`defang`]
/// (`None` where that fails); called only when an untrusted string holds special-token text. Where its
/// rendering differs from `rendered` only by those overwritten bytes (a template that does not branch on the
/// texts), its special tokens are the markup, by position. Otherwise (or without it) each untrusted string
/// that holds a special token's text is looked up in `rendered` (as written, trimmed, or as a JSON string
/// body, the way `tojson` writes it) and every occurrence is read as text — also one that is the
/// template's own markup, where the string is nothing but markup text. Without such strings this is
/// [`encode_chat`], token for token. Errors ([`Error::Text`]): without a usable defanged rendering, an untrusted
/// string with special-token text that the template rewrote (it cannot be told apart from the markup);
/// tokenizer errors.
pub fn encode_chat_guarded(
    tok: &Tokenizer,
    rendered: &str,
    untrusted: &[&str],
    render_defanged: impl FnOnce() -> Option<String>,
) -> Result<Vec<u32>> {
    let specials = tok.special_token_texts();
    let has_special = |s: &str| specials.iter().any(|t| s.contains(t.as_str()));
    if !untrusted.iter().any(|u| has_special(u)) {
        return encode_chat(tok, rendered);
    }
    if let Some(marks) = render_defanged().and_then(|d| markup_by_position(&specials, rendered, &d)) {
        return encode_marked(tok, rendered, marks);
    }
    // Byte ranges of `rendered` that are untrusted text.
    let mut plain: Vec<(usize, usize)> = Vec::new();
    for &u in untrusted.iter().filter(|u| has_special(u)) {
        let quoted = serde_json::to_string(u).unwrap_or_default();
        let forms = [u, u.trim(), quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or("")];
        let mut found = false;
        for f in forms.iter().filter(|f| !f.is_empty() && has_special(f)) {
            for (at, _) in rendered.match_indices(f) {
                plain.push((at, at + f.len()));
                found = true;
            }
        }
        if !found {
            return Err(Error::Text(
                "a message holds special-token text that the chat template rewrites, so it cannot be kept apart from the template's markup"
                    .into(),
            ));
        }
    }
    // The markup's special tokens: occurrences outside the untrusted ranges.
    let mut marks: Vec<(usize, usize)> = Vec::new();
    for t in &specials {
        for (at, _) in rendered.match_indices(t.as_str()) {
            let end = at + t.len();
            if !plain.iter().any(|&(a, b)| at < b && end > a) {
                marks.push((at, end));
            }
        }
    }
    encode_marked(tok, rendered, marks)
}

/// The special tokens of `defanged` (byte ranges), if `rendered` equals it but where `defanged` holds a
/// [`defang`] byte over the first byte of a special token's text of `rendered`; each range checked to hold
/// the same text in `rendered`.
fn markup_by_position(specials: &[String], rendered: &str, defanged: &str) -> Option<Vec<(usize, usize)>> {
    let (r, d) = (rendered.as_bytes(), defanged.as_bytes());
    if r.len() != d.len() {
        return None;
    }
    for i in (0..r.len()).filter(|&i| r[i] != d[i]) {
        let starts_special = specials.iter().any(|t| r[i..].starts_with(t.as_bytes()));
        if !(starts_special && (d[i] == DEFANG || d[i] == b'^')) {
            return None;
        }
    }
    let mut marks = Vec::new();
    for t in specials {
        for (at, _) in defanged.match_indices(t.as_str()) {
            if !rendered[at..].starts_with(t.as_str()) {
                return None;
            }
            marks.push((at, at + t.len()));
        }
    }
    Some(marks)
}

/// `rendered` encoded with the byte ranges `marks` as special tokens and the rest as plain text.
fn encode_marked(tok: &Tokenizer, rendered: &str, mut marks: Vec<(usize, usize)>) -> Result<Vec<u32>> {
    // Longest first at a position, then drop overlaps.
    marks.sort_by_key(|&(a, b)| (a, std::cmp::Reverse(b)));
    let mut ids = Vec::new();
    let mut at = 0;
    for (a, b) in marks {
        if a < at {
            continue;
        }
        if a > at {
            ids.extend(tok.encode_plain(&rendered[at..a])?);
        }
        ids.extend(tok.encode(&rendered[a..b], false)?);
        at = b;
    }
    if at < rendered.len() {
        ids.extend(tok.encode_plain(&rendered[at..])?);
    }
    Ok(ids)
}

/// One-line description of a minijinja error (with the template's message for `raise_exception`).
fn describe(e: &minijinja::Error) -> String {
    let mut s = match (e.kind(), e.detail()) {
        (ErrorKind::OutOfFuel, _) => format!("rendering ran past {TEMPLATE_FUEL} template instructions (a runaway loop?)"),
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s.push_str(&format!(" (line {line})"));
        }
    }
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

// ---------------------------------------------------------------------------------------------------------
// Values

/// A map that keeps insertion order (Python dicts do; minijinja's own maps are sorted).
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl OrderedMap {
    fn value(entries: Vec<(String, Value)>) -> Value {
        Value::from_object(OrderedMap(entries))
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| Value::from(k.as_str())).collect())
    }
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// JSON (kwargs) to template values; objects keep their key order.
fn json_to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(o) => OrderedMap::value(o.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect()),
    }
}

// ---------------------------------------------------------------------------------------------------------
// Functions and filters

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: local time formatted with strftime directives (as Python's `datetime.now().strftime`).
fn strftime_now(fmt: String) -> std::result::Result<Value, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item> = StrftimeItems::new(&fmt).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: invalid format {fmt:?}")));
    }
    Ok(Value::from(chrono::Local::now().format_with_items(items.into_iter()).to_string()))
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` as transformers defines
/// it: Python's `json.dumps` with those arguments (`separators` and `sort_keys` by keyword only).
fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let pick = |pos: Option<Value>, name: &str| -> std::result::Result<Option<Value>, minijinja::Error> {
        match pos {
            Some(v) => Ok(Some(v)),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.kind() {
            ValueKind::String => v.as_str().unwrap_or("").to_string(),
            ValueKind::Number => " ".repeat(i64::try_from(v.clone()).unwrap_or(0).max(0) as usize),
            _ => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap().to_string(), b.as_str().unwrap().to_string())
                }
                _ => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
            }
        }
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOpts { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn not_serializable(value: &Value) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: object of kind {} is not JSON serializable", value.kind()))
}

fn write_json(out: &mut String, value: &Value, o: &JsonOpts, depth: usize) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, true),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or(""), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), o, depth, |out, i| write_json(out, &items[i], o, depth + 1))?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            write_container(out, '{', '}', keys.len(), o, depth, |out, i| {
                let k = &keys[i];
                match k.kind() {
                    ValueKind::String => write_json_str(out, k.as_str().unwrap_or(""), o.ensure_ascii),
                    ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                        let mut s = String::new();
                        write_json(&mut s, k, o, depth)?;
                        write_json_str(out, &s, o.ensure_ascii)
                    }
                    _ => return Err(not_serializable(k)),
                }
                out.push_str(&o.key_sep);
                write_json(out, &value.get_item(k)?, o, depth + 1)
            })?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    n: usize,
    o: &JsonOpts,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), minijinja::Error>,
) -> std::result::Result<(), minijinja::Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// A JSON string as `json.dumps` writes it (`ensure_ascii` escapes everything outside ASCII as `\uXXXX`).
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python writes it (`repr`): integers plainly, floats in shortest round-trip form with
/// Python's exponent rules (`1e-05`, `1e+16`, `0.0001`, `1.0`). `json` selects JSON's spelling of
/// non-finite values (`NaN`, `Infinity`) over Python's (`nan`, `inf`).
fn write_number(out: &mut String, value: &Value, json: bool) {
    if value.is_integer() {
        if let Ok(i) = i128::try_from(value.clone()) {
            out.push_str(&i.to_string());
            return;
        }
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    out.push_str(&py_float_repr(f, json));
}

fn py_float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{s}") } else { s.into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest round-trip digits and exponent, from Rust's `{:e}` ("d.ddde±x").
    let e = format!("{:e}", f.abs());
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let decpt = exp + 1; // position of the decimal point relative to the digit string
    let sign = if f < 0.0 { "-" } else { "" };
    let body = if decpt <= -4 || decpt > 16 {
        let (first, rest) = digits.split_at(1);
        let m = if rest.is_empty() { first.to_string() } else { format!("{first}.{rest}") };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    } else if decpt <= 0 {
        format!("0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(decpt as usize - digits.len()))
    } else {
        let (a, b) = digits.split_at(decpt as usize);
        format!("{a}.{b}")
    };
    format!("{sign}{body}")
}

/// Python's `repr` of a string: single quotes unless the text has `'` and no `"`.
fn py_str_repr(out: &mut String, s: &str) {
    let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(q);
}

/// Python's `str()` of a value (`repr` inside containers).
fn py_str(out: &mut String, value: &Value, nested: bool) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                write_number(out, value, false)
            } else {
                let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&py_float_repr(f, false));
            }
        }
        ValueKind::String if nested => py_str_repr(out, value.as_str().unwrap_or("")),
        ValueKind::Seq => match value.try_iter() {
            Ok(it) => {
                out.push(if value.is_tuple() { '(' } else { '[' });
                for (i, v) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_str(out, &v, true);
                }
                out.push(if value.is_tuple() { ')' } else { ']' });
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(it) => {
                out.push('{');
                for (i, k) in it.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_str(out, &k, true);
                    out.push_str(": ");
                    py_str(out, &value.get_item(&k).unwrap_or_default(), true);
                }
                out.push('}');
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        _ => out.push_str(&value.to_string()),
    }
}

/// Prints values the way Jinja2 (Python `str`) does.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::String | ValueKind::Undefined => minijinja::escape_formatter(out, state, value),
        _ => {
            let mut s = String::new();
            py_str(&mut s, value, false);
            out.write_str(&s).map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "cannot write output"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ChatML, as Qwen2.5's template writes it (without its tool branches).
    const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn continue_final_assistant_message() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let kw = serde_json::Map::new();
        let user = ChatMessage::new("user", "Merge two lists.");
        let conv = [user.clone(), ChatMessage::new("assistant", "def merge(a, b):\n  ")];
        // Cut after the trimmed content: the end-of-turn marker and the trailing spaces go.
        assert_eq!(
            t.render_continue(&conv, &kw).unwrap(),
            "<|im_start|>user\nMerge two lists.<|im_end|>\n<|im_start|>assistant\ndef merge(a, b):"
        );
        // The content also appearing earlier: the last occurrence is the one continued.
        let conv = [ChatMessage::new("user", "ok"), ChatMessage::new("assistant", "ok")];
        assert_eq!(t.render_continue(&conv, &kw).unwrap(), "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\nok");
        // Empty content: a fresh reply (the generation prompt).
        let conv = [user.clone(), ChatMessage::new("assistant", " ")];
        assert_eq!(t.render_continue(&conv, &kw).unwrap(), "<|im_start|>user\nMerge two lists.<|im_end|>\n<|im_start|>assistant\n");
        // Not an assistant message last.
        assert!(t.render_continue(std::slice::from_ref(&user), &kw).is_err());
        // A template that rewrites the assistant content cannot be continued.
        let upper = ChatTemplate::new("{% for m in messages %}{{ m.content | upper }}{% endfor %}", None, None).unwrap();
        let conv = [user, ChatMessage::new("assistant", "abc")];
        let e = upper.render_continue(&conv, &kw).unwrap_err().to_string();
        assert!(e.contains("cannot be continued"), "{e}");
    }

    /// A template that would loop 10¹² times (each `range` under minijinja's own limit) stops at
    /// [`TEMPLATE_FUEL`] with an error naming it; ChatML over a long conversation stays far below it.
    #[test]
    fn runaway_template_runs_out_of_fuel() {
        let looping =
            "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}{% endfor %}{% endfor %}{% endfor %}x";
        let t = ChatTemplate::new(looping, None, None).unwrap();
        let kw = serde_json::Map::new();
        let e = t.render(&[ChatMessage::new("user", "hi")], true, &kw).unwrap_err().to_string();
        assert!(e.contains("runaway loop") && e.contains(&TEMPLATE_FUEL.to_string()), "{e}");
        let long: Vec<ChatMessage> =
            (0..2000).map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "some words")).collect();
        let out = ChatTemplate::new(CHATML, None, None).unwrap().render(&long, true, &kw).unwrap();
        assert_eq!(out.matches("<|im_start|>").count(), 2001);
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (-1.5e-7, "-1.5e-07"),
            (1e20, "1e+20"),
            (123.456, "123.456"),
            (-0.0, "-0.0"),
            (2.5e300, "2.5e+300"),
        ] {
            assert_eq!(py_float_repr(f, true), s, "{f}");
        }
    }
}
