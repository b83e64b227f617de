//! OpenAI wire formats: request validation (field by field, so that every error names its parameter) and
//! the error object.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use eddy::sampling::SamplerParams;
use serde_json::{json, Map, Value};

/// An OpenAI error response: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 invalid_request_error about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 400 for a parameter eddy does not implement yet.
    pub fn unsupported(param: &str, what: &str) -> Self {
        let mut e = Self::invalid(Some(param), format!("{what} is not supported yet"));
        e.code = Some("unsupported_parameter");
        e
    }

    /// The same error with another status, type and code.
    pub fn with_status(mut self, status: StatusCode, kind: &'static str, code: Option<&'static str>) -> Self {
        self.status = status;
        self.kind = kind;
        self.code = code;
        self
    }

    /// The JSON error object.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl ApiError {
    /// The error in the names a translated request's client used: `renames` maps a chat-completions field
    /// (`max_tokens`, `messages`, ...) to the client's (`max_output_tokens`, `input`, ...), in `param`
    /// (its first path segment) and where the message names it.
    pub fn renamed(mut self, renames: &[(&str, &str)]) -> ApiError {
        for &(chat, client) in renames {
            if let Some(p) = self.param.as_mut().filter(|p| p.split(['[', '.']).next() == Some(chat)) {
                *p = format!("{client}{}", &p[chat.len()..]);
            }
            self.message = replace_word(&self.message, chat, client);
        }
        self
    }
}

impl ApiError {
    /// The error in the fields a translated request's client sent: each `messages[k]` in `param` and in the
    /// message (message `k` of the chat request the client's request became, a place the client never
    /// wrote) is replaced by `origins[k]`, the client's own field (`messages[1].content[0]`, `input[2]`,
    /// `system`). Indices beyond `origins` are left as they are. Apply before [`ApiError::renamed`].
    pub fn at_origins(mut self, origins: &[String]) -> ApiError {
        self.param = self.param.map(|p| chat_indices_replaced(&p, origins));
        self.message = chat_indices_replaced(&self.message, origins);
        self
    }
}

/// `text` with each `messages[k]` (not inside a longer identifier) replaced by `origins[k]` where it exists.
fn chat_indices_replaced(text: &str, origins: &[String]) -> String {
    const HEAD: &str = "messages[";
    let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(HEAD) {
        out.push_str(&rest[..i]);
        let after = &rest[i + HEAD.len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        let origin = after[digits..]
            .starts_with(']')
            .then(|| after[..digits].parse::<usize>().ok())
            .flatten()
            .and_then(|k| origins.get(k))
            .filter(|_| !ident(rest[..i].chars().next_back()));
        match origin {
            Some(o) => {
                out.push_str(o);
                rest = &after[digits + 1..];
            }
            None => {
                out.push_str(HEAD);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `text` with each whole-word `from` (not inside a longer identifier) replaced by `to`.
fn replace_word(text: &str, from: &str, to: &str) -> String {
    let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(from) {
        let (before, after) = (rest[..i].chars().next_back(), rest[i + from.len()..].chars().next());
        out.push_str(&rest[..i]);
        out.push_str(if ident(before) || ident(after) { from } else { to });
        rest = &rest[i + from.len()..];
    }
    out.push_str(rest);
    out
}

impl IntoResponse for ApiError {
    /// The error object with its status; a 503 (queue full) carries `Retry-After: 1`.
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

type R<T> = Result<T, ApiError>;

/// Parses the body as a JSON object.
pub fn parse_object(body: &[u8]) -> R<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid(None, "the request body must be a JSON object")),
        Err(e) => {
            // serde_json's words for a lone UTF-16 surrogate escape (`"\ud83d"` alone, which Python's json.dumps
            // writes for a string cut inside a character) do not say what is wrong with the text.
            let m = e.to_string();
            let hint = if let Err(u) = std::str::from_utf8(body) {
                format!(" (the body is not UTF-8: invalid bytes at byte {})", u.valid_up_to())
            } else if m.contains("hex escape") || m.contains("surrogate") || m.contains("unicode code point") {
                " (a \\u escape must spell Unicode text: surrogates U+D800–U+DFFF only as high-low pairs)".to_string()
            } else {
                String::new()
            };
            Err(ApiError::invalid(None, format!("invalid JSON in the request body: {m}{hint}")))
        }
    }
}

fn get<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

/// A float field, checked after its conversion to f32 (the type the sampler uses): a value that
/// overflows to infinity or underflows to 0 is judged as such.
fn number(o: &Map<String, Value>, k: &str, ok: impl Fn(f32) -> bool, range: &str) -> R<Option<f32>> {
    match get(o, k) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (x as f32).is_finite() && ok(x as f32) => Ok(Some(x as f32)),
            Some(x) => Err(ApiError::invalid(Some(k), format!("{k} must be {range}, got {x}"))),
            None => Err(ApiError::invalid(Some(k), format!("{k} must be a number, got {v}"))),
        },
    }
}

/// A client's value as an error message echoes it: at most 200 characters, then an ellipsis.
pub fn shown(v: &str) -> String {
    if v.chars().count() > 200 {
        v.chars().take(200).chain("…".chars()).collect()
    } else {
        v.to_string()
    }
}

/// An integer, or a float with no fractional part within ±2^53 (where f64 holds every integer exactly):
/// `5.0` reads as 5, as vLLM and llama-server read it (clients that keep settings as floats send it).
fn whole_i64(v: &Value) -> Option<i64> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    v.as_i64().or_else(|| v.as_f64().filter(|x| x.fract() == 0.0 && x.abs() <= EXACT).map(|x| x as i64))
}

/// [`whole_i64`] for values of 0 and up, unsigned integers up to 2^64 − 1 included.
fn whole_u64(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| whole_i64(v).and_then(|x| u64::try_from(x).ok()))
}

fn integer(o: &Map<String, Value>, k: &str, min: i64) -> R<Option<i64>> {
    match get(o, k) {
        None => Ok(None),
        Some(v) => match whole_i64(v) {
            Some(x) if x >= min => Ok(Some(x)),
            Some(x) => Err(ApiError::invalid(Some(k), format!("{k} must be at least {min}, got {x}"))),
            // A whole number too large for i64 (as an integer, or as a float past 2^53: 1e20).
            None if v.is_u64() || v.as_f64().is_some_and(|x| x.fract() == 0.0) => {
                Err(ApiError::invalid(Some(k), format!("{k} is out of range, got {v} (at most {})", i64::MAX)))
            }
            None => Err(ApiError::invalid(Some(k), format!("{k} must be an integer, got {v}"))),
        },
    }
}

fn boolean(o: &Map<String, Value>, k: &str) -> R<Option<bool>> {
    match get(o, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(Some(k), format!("{k} must be a boolean, got {v}"))),
    }
}

/// Parameters shared by chat and text completions.
#[derive(Debug)]
pub struct Common {
    pub max_tokens: Option<usize>,
    pub sampler: SamplerParams,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `logprobs` asked for: how many alternatives per token (`top_logprobs`, or the completions
    /// endpoint's integer `logprobs`).
    pub logprobs: Option<usize>,
    /// llama-server's `cache_prompt` (default true): `false` prefills the whole prompt, reusing nothing
    /// from the prefix cache (benchmarks measure a cold time to first token with it).
    pub cache_prompt: bool,
    /// OpenAI's `n`: choices generated one after another, choice `i` with seed `seed + i` (wrapping), so
    /// each is the reply a request with `n` 1 and that seed gets.
    pub n: usize,
    /// Text completions' `echo`: the reply starts with the prompt (its tokens' log-probabilities too
    /// when `logprobs` is set; `max_tokens` may then be 0: the prompt scored, nothing generated).
    pub echo: bool,
}

/// Most choices one request may ask for (`n`): they are generated one after another, each as long as
/// `max_tokens` allows.
pub const MAX_CHOICES: usize = 16;

/// Most alternatives per token `logprobs` / `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

/// Validates the shared sampling/streaming parameters (`model` may name anything: the one model answers);
/// rejects the OpenAI features eddy does not implement yet. `chat`: the chat endpoint (`logprobs` is a boolean
/// there, an integer in text completions).
pub fn parse_common(o: &Map<String, Value>, chat: bool) -> R<Common> {
    // A server of one model answers whatever model a request names (clients often send a fixed name).
    match get(o, "model") {
        None | Some(Value::String(_)) => {}
        Some(v) => return Err(ApiError::invalid(Some("model"), format!("model must be a string, got {v}"))),
    }
    // Features not implemented: refuse rather than silently ignore.
    if !chat {
        for k in ["tools", "tool_choice", "reasoning_effort"] {
            if get(o, k).is_some() {
                return Err(ApiError::invalid(Some(k), format!("{k} is only accepted by /v1/chat/completions")));
            }
        }
    }
    for k in ["audio", "prediction", "web_search_options", "functions", "function_call"] {
        if get(o, k).is_some() {
            return Err(ApiError::unsupported(k, k));
        }
    }
    match get(o, "modalities") {
        None => {}
        Some(Value::Array(a)) if a.iter().all(|m| m == "text") => {}
        Some(_) => return Err(ApiError::unsupported("modalities", "output other than text")),
    }
    // Chat: `logprobs: true` and `top_logprobs` 0..=20; completions: `logprobs` 0..=20 alternatives.
    let logprobs = match get(o, "logprobs") {
        None | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(0),
        Some(v) if chat => {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("logprobs must be a boolean, got {v} (top_logprobs sets the alternatives)"),
            ))
        }
        Some(v) => match whole_u64(v) {
            Some(k) if k <= MAX_LOGPROBS as u64 => Some(k as usize),
            _ => {
                return Err(ApiError::invalid(
                    Some("logprobs"),
                    format!("logprobs must be a boolean, or an integer from 0 to {MAX_LOGPROBS}, got {v}"),
                ))
            }
        },
    };
    let logprobs = match (integer(o, "top_logprobs", 0)?, logprobs) {
        (Some(k), _) if k > MAX_LOGPROBS as i64 => {
            return Err(ApiError::invalid(Some("top_logprobs"), format!("top_logprobs must be at most {MAX_LOGPROBS}, got {k}")))
        }
        (Some(k), Some(_)) => Some(k as usize),
        (Some(k), None) if k > 0 => return Err(ApiError::invalid(Some("top_logprobs"), "top_logprobs needs logprobs: true")),
        (_, l) => l,
    };
    let echo = boolean(o, "echo")? == Some(true);
    if echo && chat {
        return Err(ApiError::unsupported("echo", "echo on chat completions (/v1/completions has it)"));
    }
    match get(o, "suffix") {
        Some(_) if chat => return Err(ApiError::invalid(Some("suffix"), "suffix is only accepted by /v1/completions")),
        Some(_) if echo => return Err(ApiError::invalid(Some("suffix"), "suffix cannot be combined with echo")),
        _ => {}
    }
    let n = match integer(o, "n", 1)? {
        Some(n) if n > MAX_CHOICES as i64 => {
            return Err(ApiError::invalid(Some("n"), format!("n must be from 1 to {MAX_CHOICES}, got {n}")))
        }
        n => n.map_or(1, |n| n as usize),
    };
    // best_of > n would rank candidates the reply leaves out; eddy returns every choice it generates.
    if let Some(b) = integer(o, "best_of", 1)? {
        if b != n as i64 {
            return Err(ApiError::invalid(Some("best_of"), format!("best_of must equal n ({n}) when given, got {b}")));
        }
    }
    // 0 only with echo: the prompt is scored, nothing generated (lm-eval's log-likelihood requests).
    let least = if echo { 0 } else { 1 };
    let mut max_tokens = integer(o, "max_tokens", least)?;
    if let Some(m) = integer(o, "max_completion_tokens", least)? {
        max_tokens = Some(m);
    }
    let mut s = SamplerParams { temperature: 1.0, seed: random_seed(), ..SamplerParams::default() };
    if let Some(t) = number(o, "temperature", |x| (0.0..=2.0).contains(&x), "in [0, 2]")? {
        s.temperature = t;
    }
    if let Some(p) = number(o, "top_p", |x| x > 0.0 && x <= 1.0, "in (0, 1]")? {
        s.top_p = p;
    }
    if let Some(k) = integer(o, "top_k", 0)? {
        s.top_k = k as usize;
    }
    if let Some(p) = number(o, "min_p", |x| (0.0..=1.0).contains(&x), "in [0, 1]")? {
        s.min_p = p;
    }
    if let Some(p) = number(o, "repetition_penalty", |x| x > 0.0, "a finite number > 0")? {
        s.repetition_penalty = p;
    }
    // OpenAI's penalties over the generated tokens (the server sets `prompt_len` once it has the prompt).
    let penalty = |k| number(o, k, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]");
    if let Some(p) = penalty("presence_penalty")? {
        s.presence_penalty = p;
    }
    if let Some(p) = penalty("frequency_penalty")? {
        s.frequency_penalty = p;
    }
    s.logit_bias = logit_bias(o)?;
    // Whatever the sampler would refuse is a 400 here, not an engine error later.
    if let Err(e) = s.validate() {
        let param = e.split_whitespace().next().map(str::to_string);
        return Err(ApiError::invalid(param.as_deref(), e));
    }
    // -1 asks for a random seed (llama.cpp's convention, and `eddy run --seed -1`), as no seed does.
    match get(o, "seed") {
        None => {}
        Some(v) => match (whole_u64(v), whole_i64(v)) {
            (Some(x), _) => s.seed = x,
            (None, Some(-1)) => {}
            _ => {
                return Err(ApiError::invalid(
                    Some("seed"),
                    format!("seed must be an integer from 0 to 2^64 - 1, or -1 for a random seed, got {v}"),
                ))
            }
        },
    }
    let stops = match get(o, "stop") {
        None => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid(Some("stop"), "stop must be a string or a list of strings"))
            })
            .collect::<R<Vec<_>>>()?,
        Some(_) => return Err(ApiError::invalid(Some("stop"), "stop must be a string or a list of strings")),
    };
    let stream = boolean(o, "stream")?.unwrap_or(false);
    let include_usage = match get(o, "stream_options") {
        None => false,
        Some(_) if !stream => return Err(ApiError::invalid(Some("stream_options"), "stream_options is only allowed when stream is true")),
        Some(Value::Object(so)) => boolean(so, "include_usage")
            .map_err(|mut e| {
                e.param = Some("stream_options.include_usage".into());
                e
            })?
            .unwrap_or(false),
        Some(_) => return Err(ApiError::invalid(Some("stream_options"), "stream_options must be an object")),
    };
    Ok(Common {
        max_tokens: max_tokens.map(|m| m as usize),
        sampler: s,
        stops,
        stream,
        include_usage,
        logprobs,
        cache_prompt: boolean(o, "cache_prompt")?.unwrap_or(true),
        echo,
        n,
    })
}

/// `messages` → the JSON messages the chat template reads: `role` (`developer` given as `system`),
/// `content` (a string; text parts joined), an assistant message's `tool_calls` (each `function.arguments`
/// given to the template as the object its JSON string holds, as transformers' templates expect), a tool
/// message's `tool_call_id` (required, as OpenAI requires it) and `name`.
pub fn parse_messages(o: &Map<String, Value>) -> R<Vec<Value>> {
    let p = Some("messages");
    let Some(list) = get(o, "messages") else {
        return Err(ApiError::invalid(p, "messages is required"));
    };
    let Some(list) = list.as_array() else {
        return Err(ApiError::invalid(p, "messages must be an array"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(p, "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let bad = |msg: String| ApiError::invalid(Some(&at), msg);
        let Some(m) = m.as_object() else {
            return Err(bad(format!("{at} must be an object")));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some("developer") => "system",
            Some(r) => return Err(bad(format!("{at}.role `{r}` is not supported (system, developer, user, assistant, tool)"))),
            None => return Err(bad(format!("{at}.role must be a string"))),
        };
        let calls = match m.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if role == "assistant" => {
                let mut calls = Vec::with_capacity(a.len());
                for (j, c) in a.iter().enumerate() {
                    calls.push(template_tool_call(c).map_err(|e| bad(format!("{at}.tool_calls[{j}]: {e}")))?);
                }
                Some(calls)
            }
            Some(Value::Array(_)) => return Err(bad(format!("{at}.tool_calls is only allowed in assistant messages"))),
            Some(_) => return Err(bad(format!("{at}.tool_calls must be an array"))),
        };
        let content = match m.get("content") {
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        (Some(t), _) if t != "text" => return Err(ApiError::unsupported(&at, &format!("content part type `{t}`"))),
                        _ => return Err(bad(format!("{at}.content parts must be {{\"type\": \"text\", \"text\": string}}"))),
                    }
                }
                s
            }
            _ => return Err(bad(format!("{at}.content must be a string or an array of text parts"))),
        };
        let mut msg = Map::new();
        msg.insert("role".into(), json!(role));
        msg.insert("content".into(), json!(content));
        if let Some(calls) = calls {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        for k in ["tool_call_id", "name"] {
            match m.get(k) {
                None | Some(Value::Null) => {}
                Some(Value::String(v)) => {
                    msg.insert(k.into(), json!(v));
                }
                Some(_) => {
                    let param = format!("{at}.{k}");
                    return Err(ApiError::invalid(Some(&param), format!("{param} must be a string")));
                }
            }
        }
        // A tool result answers one call: OpenAI refuses a tool message that does not say which (an empty
        // or blank id names none).
        if role == "tool" && msg.get("tool_call_id").and_then(Value::as_str).is_none_or(|id| id.trim().is_empty()) {
            let param = format!("{at}.tool_call_id");
            return Err(ApiError::invalid(
                Some(&param),
                format!("{param} is required (a non-blank string): a message of role tool must name the tool call it answers"),
            ));
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// An OpenAI tool call of an assistant message as chat templates read it: `{id, type, function: {name,
/// arguments}}` with `arguments` parsed from its JSON string to the object. A string that is not JSON (a
/// call cut by `max_tokens`, fed back as it came) stays the string, as OpenAI takes it.
fn template_tool_call(c: &Value) -> Result<Value, String> {
    let f = c.get("function").and_then(Value::as_object).ok_or("function must be an object")?;
    let name = f.get("name").and_then(Value::as_str).ok_or("function.name must be a string")?;
    let args = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s)),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err("function.arguments must be a JSON string".into()),
    };
    let mut out = json!({"type": "function", "function": {"name": name, "arguments": args}});
    if let Some(id) = c.get("id").and_then(Value::as_str) {
        out["id"] = json!(id);
    }
    Ok(out)
}

/// Every string inside `v` (object keys aside): the text of messages and tools that users and tools wrote,
/// which must not be read as the template's control tokens.
pub fn string_leaves<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|x| string_leaves(x, out)),
        Value::Object(m) => m.values().for_each(|x| string_leaves(x, out)),
        _ => {}
    }
}

/// One function the model may call.
#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    /// JSON schema of the arguments (`{"type": "object", "properties": {}}` when not given).
    pub parameters: Value,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// No tool call (the tools are not shown to the model).
    None,
    /// The model decides.
    Auto,
    /// At least one call of one of the tools (decoding constrained to calls).
    Required,
    /// A call of this tool (decoding constrained to it).
    Named(String),
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The tools as sent (OpenAI's `{"type": "function", "function": {...}}`), given to the template.
    pub json: Value,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one reply allowed (default true).
    pub parallel: bool,
}

const TOOL_CHOICE_FORMS: &str = "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}";

/// `tools`, `tool_choice`, `parallel_tool_calls`; `None` when no tools are given (or an empty list). A
/// `tool_choice` of `required` or a function without tools is a 400, as a named tool that is not in `tools`.
pub fn parse_tools(o: &Map<String, Value>) -> R<Option<Tools>> {
    let list = match get(o, "tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid(Some("tools"), "tools must be an array")),
    };
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let bad = |m: &str| ApiError::invalid(Some(&at), format!("{at}{m}"));
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => return Err(bad(&format!(".type `{other}` is not supported (function)"))),
            None => return Err(bad(".type must be \"function\"")),
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return Err(bad(".function must be an object"));
        };
        let Some(name) = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()) else {
            return Err(bad(".function.name must be a non-empty string"));
        };
        // OpenAI's rule for function names: they are written into the prompt and into the call grammar.
        if name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(bad(&format!(".function.name `{name}` must be 1 to 64 letters, digits, underscores or dashes")));
        }
        if tools.iter().any(|t: &Tool| t.name == name) {
            return Err(bad(&format!(".function.name `{name}` is given twice")));
        }
        // A call's arguments are a JSON object (OpenAI refuses other schemas too); a schema without a type
        // is read as one, so that the call grammar never lets a model write a string or a list there.
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(Value::Object(p)) => match p.get("type") {
                None => {
                    let mut p = p.clone();
                    p.insert("type".into(), json!("object"));
                    Value::Object(p)
                }
                Some(t) if t == "object" => Value::Object(p.clone()),
                Some(t) => {
                    return Err(bad(&format!(
                        ".function.parameters must be a JSON schema of \"type\": \"object\" (a call's arguments are an object), got \"type\": {t}"
                    )))
                }
            },
            Some(_) => return Err(bad(".function.parameters must be a JSON schema object")),
        };
        tools.push(Tool { name: name.to_string(), parameters });
    }
    let choice = match get(o, "tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(c)) => match c.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(ApiError::invalid(Some("tool_choice"), format!("{TOOL_CHOICE_FORMS}, got `{c}`"))),
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => ToolChoice::Named(n.to_string()),
            _ => return Err(ApiError::invalid(Some("tool_choice"), format!("{TOOL_CHOICE_FORMS}, got {v}"))),
        },
    };
    if tools.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::invalid(Some("tool_choice"), "tool_choice asks for a tool call but no tools are given")),
        };
    }
    if let ToolChoice::Named(n) = &choice {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(ApiError::invalid(Some("tool_choice"), format!("tool_choice names the function `{n}`, which is not in tools")));
        }
    }
    let parallel = boolean(o, "parallel_tool_calls")?.unwrap_or(true);
    Ok(Some(Tools { json: Value::Array(list), tools, choice, parallel }))
}

/// `response_format`: `None` for text, else the JSON schema the output must match (`json_object`:
/// `{"type": "object"}`; `json_schema`: its `json_schema.schema`).
pub fn parse_response_format(o: &Map<String, Value>) -> R<Option<Value>> {
    let p = Some("response_format");
    let Some(rf) = get(o, "response_format") else { return Ok(None) };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => {
            let Some(js) = rf.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(p, "response_format json_schema needs a json_schema object"));
            };
            if !js.get("name").is_none_or(|v| v.is_string() || v.is_null()) {
                return Err(ApiError::invalid(p, "response_format.json_schema.name must be a string"));
            }
            if !js.get("strict").is_none_or(|v| v.is_boolean() || v.is_null()) {
                return Err(ApiError::invalid(p, "response_format.json_schema.strict must be a boolean"));
            }
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(json!({"type": "object"}))),
                Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
                Some(_) => Err(ApiError::invalid(p, "response_format.json_schema.schema must be a JSON schema object")),
            }
        }
        Some(t) => Err(ApiError::invalid(p, format!("response_format type `{t}` is not supported (text, json_object, json_schema)"))),
        None => Err(ApiError::invalid(p, "response_format must be an object with a type")),
    }
}

/// OpenAI's `reasoning_effort` (`none`, `minimal`, `low`, `medium`, `high`; null: not given) as chat template
/// variables, where `chat_template_kwargs` does not set them itself: `reasoning_effort` (templates that
/// grade their reasoning read it, as vLLM passes it), and for `none` `enable_thinking: false` (Qwen3's
/// switch; thinking models here have no other grades, so the others leave the template's default). A model
/// without reasoning ignores both, as vLLM and llama.cpp do.
///
/// Errors: a value that is not one of those strings (400 naming `reasoning_effort`).
pub fn apply_reasoning_effort(o: &Map<String, Value>, kwargs: &mut Map<String, Value>) -> R<()> {
    const EFFORTS: [&str; 5] = ["none", "minimal", "low", "medium", "high"];
    let effort = match get(o, "reasoning_effort") {
        None => return Ok(()),
        Some(Value::String(e)) if EFFORTS.contains(&e.as_str()) => e.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                Some("reasoning_effort"),
                format!("reasoning_effort must be one of none, minimal, low, medium, high; got {v}"),
            ))
        }
    };
    if effort == "none" {
        kwargs.entry("enable_thinking").or_insert(Value::Bool(false));
    }
    kwargs.entry("reasoning_effort").or_insert(Value::String(effort));
    Ok(())
}

/// `chat_template_kwargs` (an object, default empty).
pub fn parse_kwargs(o: &Map<String, Value>) -> R<Map<String, Value>> {
    let p = Some("chat_template_kwargs");
    match get(o, "chat_template_kwargs") {
        None => Ok(Map::new()),
        Some(Value::Object(m)) => {
            // The variables the server itself sets come from their own fields, checked there: a `tools` given
            // here would reach the prompt unchecked and its calls would not be read back.
            for (k, how) in [
                ("tools", "give the tools as `tools`"),
                ("messages", "give them as `messages`"),
                ("add_generation_prompt", "a last assistant message is continued instead"),
            ] {
                if m.contains_key(k) {
                    return Err(ApiError::invalid(p, format!("chat_template_kwargs.{k} is set by the server ({how})")));
                }
            }
            Ok(m.clone())
        }
        Some(_) => Err(ApiError::invalid(p, "chat_template_kwargs must be an object")),
    }
}

/// The prompt of a text completion.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized by the server (BOS added when the model wants it).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

/// The text of a translated API's content field (`at` in messages, `param` the request field): a string, or
/// an array of parts whose `type` is one of `kinds`, their `text` joined; other parts (images, files) are
/// refused, named as the API names them (`noun`: "blocks", "parts").
pub fn content_text(content: &Value, at: &str, param: &str, kinds: &[&str], noun: &str) -> R<String> {
    let bad = |m: String| ApiError::invalid(Some(param), m);
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some(t), Some(s)) if kinds.contains(&t) => text.push_str(s),
                    (Some(t), None) if kinds.contains(&t) => return Err(bad(format!("{at}[{j}].text must be a string"))),
                    (Some(t), _) => return Err(bad(format!("{at}[{j}]: {t} {noun} are not supported (text only)"))),
                    (None, _) => return Err(bad(format!("{at}[{j}] needs a type"))),
                }
            }
            Ok(text)
        }
        v => Err(bad(format!("{at} must be a string or an array of content {noun}, got {v}"))),
    }
}

/// A `/tokenize` request (llama-server's `content`, or vLLM's `prompt`).
#[derive(Debug)]
pub struct Tokenize {
    pub text: String,
    /// Add the model's special tokens (BOS when it wants one): `add_special` or `add_special_tokens`;
    /// default false with `content` (llama-server), true with `prompt` (vLLM).
    pub add_special: bool,
    /// Return each token as `{id, piece}` (llama-server's `with_pieces`).
    pub with_pieces: bool,
}

/// Parses a `/tokenize` body: `content` or `prompt` (a string, one of them), `add_special` /
/// `add_special_tokens`, `with_pieces`.
pub fn parse_tokenize(o: &Map<String, Value>) -> R<Tokenize> {
    let (key, text) = match (get(o, "content"), get(o, "prompt")) {
        (Some(_), Some(_)) => return Err(ApiError::invalid(Some("prompt"), "give content or prompt, not both")),
        (Some(v), None) => ("content", v),
        (None, Some(v)) => ("prompt", v),
        (None, None) => return Err(ApiError::invalid(Some("content"), "content (the text to tokenize) is required")),
    };
    let Value::String(text) = text else {
        return Err(ApiError::invalid(Some(key), format!("{key} must be a string, got {text}")));
    };
    let add_special = match (boolean(o, "add_special")?, boolean(o, "add_special_tokens")?) {
        (Some(a), None) | (None, Some(a)) => a,
        (Some(_), Some(_)) => return Err(ApiError::invalid(Some("add_special"), "give add_special or add_special_tokens, not both")),
        (None, None) => key == "prompt",
    };
    Ok(Tokenize { text: text.clone(), add_special, with_pieces: boolean(o, "with_pieces")?.unwrap_or(false) })
}

/// Parses a `/detokenize` body: `tokens`, an array of ids below `vocab`.
pub fn parse_detokenize(o: &Map<String, Value>, vocab: usize) -> R<Vec<u32>> {
    match get(o, "tokens") {
        Some(Value::Array(a)) => token_ids(a, "tokens", "tokens", vocab),
        Some(v) => Err(ApiError::invalid(Some("tokens"), format!("tokens must be an array of token ids, got {v}"))),
        None => Err(ApiError::invalid(Some("tokens"), "tokens (an array of token ids) is required")),
    }
}

/// Text completions' `suffix` (OpenAI's insertion: the text after the gap the completion fills), or
/// `None` when absent or null.
pub fn parse_suffix(o: &Map<String, Value>) -> R<Option<String>> {
    match get(o, "suffix") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ApiError::invalid(Some("suffix"), format!("suffix must be a string, got {v}"))),
    }
}

/// Most prompts one text completion may send (each gets `n` choices), and most choices (prompts × `n`) in
/// one request.
pub const MAX_PROMPTS: usize = 64;

/// `prompt` of a text completion: a string, an array of token ids, or an array of prompts (strings, or
/// arrays of token ids, not mixed), at most [`MAX_PROMPTS`]. Token ids must be below `vocab`.
pub fn parse_prompts(o: &Map<String, Value>, vocab: usize) -> R<Vec<Prompt>> {
    let p = Some("prompt");
    let shape = "prompt must be a string, an array of token ids, or an array of strings or of token-id arrays";
    let list = match get(o, "prompt") {
        None => return Err(ApiError::invalid(p, "prompt is required")),
        Some(Value::String(s)) => return Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::invalid(p, format!("{shape}, got {v}"))),
    };
    let first = match list.first() {
        None => return Err(ApiError::invalid(p, "prompt must not be an empty array")),
        Some(first @ (Value::String(_) | Value::Array(_))) => first,
        Some(_) => return token_ids(list, "prompt", "prompt", vocab).map(|ids| vec![Prompt::Tokens(ids)]),
    };
    // A batch: all strings, or all arrays.
    let same = |v: &Value| matches!((first, v), (Value::String(_), Value::String(_)) | (Value::Array(_), Value::Array(_)));
    if let Some(i) = list.iter().position(|v| !same(v)) {
        return Err(ApiError::invalid(p, format!("{shape}; prompt[0] is {} but prompt[{i}] is {}", kind(first), list[i])));
    }
    if list.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(p, format!("at most {MAX_PROMPTS} prompts per request, got {}", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Array(ids) if ids.is_empty() => Err(ApiError::invalid(p, format!("prompt[{i}] must not be an empty array"))),
            Value::Array(ids) => token_ids(ids, "prompt", &format!("prompt[{i}]"), vocab).map(Prompt::Tokens),
            v => Ok(Prompt::Text(v.as_str().unwrap_or_default().to_string())),
        })
        .collect()
}

/// What a JSON value is, for error messages: "a string", "an array", ...
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// OpenAI's `logit_bias`: an object from token ids (decimal strings) to biases in [-100, 100] or `false`
/// (a ban, as llama-server), or null;
/// returned in id order. The ids are checked against the vocabulary by [`check_logit_bias`].
fn logit_bias(o: &Map<String, Value>) -> R<Vec<(u32, f32)>> {
    let m = match get(o, "logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias must be an object from token ids to biases, like {{\"1734\": -100}}, got {v}"),
            ))
        }
    };
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let id = Some(k).filter(|k| k.bytes().all(|b| b.is_ascii_digit())).and_then(|k| k.parse::<u32>().ok()).ok_or_else(|| {
            ApiError::invalid(Some("logit_bias"), format!("logit_bias keys must be token ids (decimal integers), got {k:?}"))
        })?;
        // `false` bans the token (llama-server's spelling; JSON has no -inf).
        let b = match v {
            Value::Bool(false) => f32::NEG_INFINITY,
            _ => v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                ApiError::invalid(Some("logit_bias"), format!("logit_bias[{k:?}] must be a number in [-100, 100] or false, got {v}"))
            })? as f32,
        };
        out.push((id, b));
    }
    // "7" and "007" name one token: a request naming it twice is ambiguous.
    out.sort_by_key(|e| e.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(Some("logit_bias"), format!("logit_bias names token {} twice", w[0].0)));
    }
    Ok(out)
}

/// Every `logit_bias` id must be below `vocab` (the tokens the model's tokenizer knows).
pub fn check_logit_bias(s: &SamplerParams, vocab: usize) -> R<()> {
    match s.logit_bias.iter().find(|e| e.0 as usize >= vocab) {
        Some(e) => Err(ApiError::invalid(
            Some("logit_bias"),
            format!("logit_bias: token id {} is out of range (the vocabulary has {vocab} tokens)", e.0),
        )),
        None => Ok(()),
    }
}

/// An array of token ids, each an integer below `vocab`; errors name the first bad element.
fn token_ids(a: &[Value], param: &'static str, at: &str, vocab: usize) -> R<Vec<u32>> {
    a.iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id < vocab as u64 => Ok(id as u32),
            Some(id) => {
                Err(ApiError::invalid(Some(param), format!("{at}[{i}]: token id {id} is out of range (the vocabulary has {vocab} tokens)")))
            }
            None => Err(ApiError::invalid(
                Some(param),
                format!("{at}[{i}] must be a token id (an integer from 0 to {}), got {v}", vocab.saturating_sub(1)),
            )),
        })
        .collect()
}

/// A random 64-bit value from the clock and the process's random hash keys (each call different): the
/// seed of requests without `seed`, and tool call ids.
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// A JSON object literal as a request body's map (tests).
#[cfg(test)]
pub(crate) fn obj(v: Value) -> Map<String, Value> {
    v.as_object().expect("an object").clone()
}

/// An SSE event `event: NAME\ndata: JSON\n\n` as (name, data) (tests).
#[cfg(test)]
pub(crate) fn sse_event(b: &[u8]) -> (String, Value) {
    let t = std::str::from_utf8(b).expect("UTF-8");
    let (name, data) = t.trim_end().split_once('\n').expect("two lines");
    (name.trim_start_matches("event: ").to_string(), serde_json::from_str(data.trim_start_matches("data: ")).expect("JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_effort_becomes_template_variables() {
        let apply = |req: Value, kw: Value| {
            let mut kwargs = obj(kw);
            super::apply_reasoning_effort(&obj(req), &mut kwargs).map(|()| Value::Object(kwargs))
        };
        assert_eq!(apply(json!({}), json!({})).unwrap(), json!({}));
        assert_eq!(apply(json!({"reasoning_effort": null}), json!({})).unwrap(), json!({}));
        assert_eq!(apply(json!({"reasoning_effort": "high"}), json!({})).unwrap(), json!({"reasoning_effort": "high"}));
        assert_eq!(
            apply(json!({"reasoning_effort": "none"}), json!({})).unwrap(),
            json!({"reasoning_effort": "none", "enable_thinking": false})
        );
        // The request's own template variables win.
        assert_eq!(
            apply(json!({"reasoning_effort": "none"}), json!({"enable_thinking": true, "reasoning_effort": "x"})).unwrap(),
            json!({"reasoning_effort": "x", "enable_thinking": true})
        );
        for bad in [json!("extreme"), json!(3), json!(["low"])] {
            let e = apply(json!({"reasoning_effort": bad}), json!({})).unwrap_err();
            assert!(format!("{e:?}").contains("reasoning_effort must be one of"), "{e:?}");
        }
    }

    /// A body that is not UTF-8 is told so (not that a `\u` escape is wrong); a lone surrogate escape in
    /// valid UTF-8 still gets the escape hint.
    #[test]
    fn invalid_json_errors_say_what_is_wrong() {
        let msg = |body: &[u8]| parse_object(body).expect_err("refused").body()["error"]["message"].as_str().unwrap().to_string();
        let m = msg(b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}");
        assert!(m.contains("not UTF-8: invalid bytes at byte 43") && !m.contains("escape"), "{m}");
        let m = msg(br#"{"content": "hi \ud83d"}"#);
        assert!(m.contains("high-low pairs") && !m.contains("UTF-8"), "{m}");
    }

    /// `seed`: any u64 as given; -1 a random seed (two requests differ); other negatives refused.
    #[test]
    fn seed_minus_one_is_random() {
        let seed = |v: Value| parse_common(&obj(serde_json::json!({ "seed": v })), true).map(|c| c.sampler.seed);
        assert_eq!(seed(serde_json::json!(7)).unwrap(), 7);
        assert_eq!(seed(serde_json::json!(u64::MAX)).unwrap(), u64::MAX);
        assert_ne!(seed(serde_json::json!(-1)).unwrap(), seed(serde_json::json!(-1)).unwrap());
        for bad in [serde_json::json!(-2), serde_json::json!(i64::MIN), serde_json::json!(1.5), serde_json::json!("7")] {
            let e = seed(bad.clone()).expect_err("refused");
            let m = e.body()["error"]["message"].as_str().unwrap().to_string();
            assert!(m.contains("or -1 for a random seed"), "{bad}: {m}");
        }
    }

    /// Errors of a translated request use the client's field names, whole words only.
    #[test]
    fn errors_are_renamed_for_the_client() {
        let e =
            ApiError::invalid(Some("max_tokens"), "max_tokens must be at least 1, got 0").renamed(&[("max_tokens", "max_output_tokens")]);
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("max_output_tokens"), "max_output_tokens must be at least 1, got 0"));
        let e = ApiError::invalid(Some("stop[1]"), "stop[1] stopped: no stop_x").renamed(&[("stop", "stop_sequences")]);
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("stop_sequences[1]"), "stop_sequences[1] stopped: no stop_x"));
        let e = ApiError::invalid(Some("stops"), "x").renamed(&[("stop", "stop_sequences")]);
        assert_eq!(e.param.as_deref(), Some("stops"));
    }

    /// Errors of a translated request name the client's fields where they name a chat message: each
    /// `messages[k]` becomes the message's origin, in param and message; other text is left alone.
    #[test]
    fn chat_indices_become_the_clients_fields() {
        let origins = ["system".to_string(), "messages[0]".into(), "messages[1].content[0]".into()];
        let e =
            ApiError::invalid(Some("messages[2].tool_call_id"), "messages[2].tool_call_id is required; messages[1] and messages[7] too")
                .at_origins(&origins);
        assert_eq!(e.param.as_deref(), Some("messages[1].content[0].tool_call_id"));
        assert_eq!(e.message, "messages[1].content[0].tool_call_id is required; messages[0] and messages[7] too");
        let e = ApiError::invalid(Some("messages"), "x.messages[0], my_messages[0], messages[], messages[1x]").at_origins(&origins);
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("messages"), "x.messages[0], my_messages[0], messages[], messages[1x]"));
        // Then renamed: an index mapped to `input[…]` is not renamed again, a bare `messages` is.
        let e =
            ApiError::invalid(Some("messages[1]"), "messages[1] of the messages").at_origins(&["instructions".into(), "input[0]".into()]);
        let e = e.renamed(&[("messages", "input")]);
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("input[0]"), "input[0] of the input"));
    }

    /// A prompt array mixing strings and token ids is malformed (not "2 prompts"); batches of strings or of
    /// token arrays are prompts, up to [`MAX_PROMPTS`].
    #[test]
    fn prompt_arrays() {
        let parse = |v: Value| parse_prompts(&obj(serde_json::json!({ "prompt": v })), 100);
        let err = |v: Value| parse(v).expect_err("refused").body()["error"]["message"].as_str().unwrap().to_string();
        let m = err(serde_json::json!(["a", 1]));
        assert!(m.contains("prompt[0] is a string but prompt[1] is 1"), "{m}");
        let m = err(serde_json::json!([[1, 2], "b"]));
        assert!(m.contains("prompt[0] is an array but prompt[1] is \"b\""), "{m}");
        assert!(err(serde_json::json!([[1], []])).contains("prompt[1] must not be an empty array"));
        assert!(err(serde_json::json!([[1], [2, 100]])).contains("prompt[1][1]: token id 100 is out of range"));
        assert!(err(serde_json::json!(vec!["a"; MAX_PROMPTS + 1])).contains("at most 64 prompts"));
        let texts = |v: Value| -> Vec<String> {
            parse(v).unwrap().into_iter().map(|p| if let Prompt::Text(t) = p { t } else { panic!("tokens") }).collect()
        };
        assert_eq!(texts(serde_json::json!(["a", "b"])), ["a", "b"]);
        assert_eq!(texts(serde_json::json!("a")), ["a"]);
        let ids: Vec<Vec<u32>> = parse(serde_json::json!([[1, 2], [3]]))
            .unwrap()
            .into_iter()
            .map(|p| if let Prompt::Tokens(t) = p { t } else { panic!("text") })
            .collect();
        assert_eq!(ids, [vec![1, 2], vec![3]]);
    }
}
