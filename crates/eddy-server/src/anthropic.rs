//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), the API Claude Code and
//! the `anthropic` SDKs speak, on top of the chat path: a request is translated into the chat-completions
//! request it means ([`to_chat`]: the system prompt becomes a system message, `tool_use` / `tool_result`
//! blocks become tool calls and tool messages, tools and `tool_choice` become OpenAI's), answered by the same
//! engine job, and the reply translated back: content blocks (`thinking`, `text`, `tool_use`), `stop_reason`
//! and usage ([`from_chat`]), or, streamed, Anthropic's events ([`EventStream`]). Reference: Anthropic's
//! API documentation, "Messages" and "Streaming Messages".

use crate::api::ApiError;
use axum::body::Bytes;
use axum::http::StatusCode;

/// The chat request's field names in the Messages API's, for errors of a translated request
/// ([`ApiError::renamed`]).
pub const RENAMES: [(&str, &str); 5] = [
    // The schema's wrapper is chat's alone (output_config.format holds the schema): before its parent.
    ("response_format.json_schema", "output_config.format"),
    ("response_format", "output_config.format"),
    ("stop", "stop_sequences"),
    ("function.parameters", "input_schema"),
    ("function.name", "name"),
];
use serde_json::{json, Map, Value};

type R<T> = Result<T, ApiError>;

/// A Messages request as the chat request it means.
pub struct Request {
    /// The chat-completions request body.
    pub chat: Value,
    /// Where each chat message came from in the client's request: `system`, `messages[i]`, or
    /// `messages[i].content[j]` for a tool result ([`ApiError::at_origins`]).
    pub origins: Vec<String>,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param), message)
}

/// The text of `content`: a string, or an array of `text` blocks (joined); other blocks are refused.
fn text_of(content: &Value, at: &str) -> R<String> {
    crate::api::content_text(content, at, at, &["text"], "blocks")
}

/// Translates a Messages request body into the chat-completions request it means. `max_tokens` is required
/// (as in Anthropic's API); `system`, `messages` (strings or content blocks: text, tool_use in assistant
/// turns, tool_result in user turns; thinking blocks sent back are dropped, the template re-renders past
/// turns), `tools`, `tool_choice` (`disable_parallel_tool_use` included), `stop_sequences`, `temperature`,
/// `top_p`, `top_k`, `thinking` (the template's `enable_thinking`), `output_config.format` (a JSON schema
/// the reply follows) and `stream` are read; images,
/// documents and server tools are refused; other fields (metadata, service_tier) are ignored. `model` may
/// name any model (a string): the served one answers, and the reply names it.
pub fn to_chat(o: &Map<String, Value>) -> R<Request> {
    let model = match o.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(m)) => m.clone(),
        Some(v) => return Err(invalid("model", format!("model must be a string, got {v}"))),
    };
    let Some(max_tokens) = o.get("max_tokens").filter(|v| !v.is_null()) else {
        return Err(invalid("max_tokens", "max_tokens is required"));
    };
    let mut messages: Vec<Value> = Vec::new();
    let mut origins: Vec<String> = Vec::new();
    match o.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => {
            let text = text_of(s, "system")?;
            if !text.is_empty() {
                messages.push(json!({"role": "system", "content": text}));
                origins.push("system".into());
            }
        }
    }
    let Some(Value::Array(msgs)) = o.get("messages") else {
        return Err(invalid("messages", "messages must be an array of {role, content} objects"));
    };
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => return Err(invalid("messages", format!("{at}.role must be \"user\" or \"assistant\""))),
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                messages.push(json!({"role": role, "content": s}));
                origins.push(at);
                continue;
            }
            Some(Value::Array(b)) => b,
            _ => return Err(invalid("messages", format!("{at}.content must be a string or an array of content blocks"))),
        };
        let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("{at}.content[{j}]");
            let field = |k: &str| b.get(k).and_then(Value::as_str).ok_or_else(|| invalid("messages", format!("{at}.{k} must be a string")));
            match (b.get("type").and_then(Value::as_str), role) {
                (Some("text"), _) => text.push_str(field("text")?),
                (Some("tool_use"), "assistant") => {
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": field("id")?, "type": "function",
                                      "function": {"name": field("name")?, "arguments": input.to_string()}}));
                }
                (Some("tool_result"), "user") => {
                    // A tool result without content is an empty one.
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => crate::api::content_text(c, &format!("{at}.content"), "messages", &["text"], "blocks")?,
                    };
                    let id = field("tool_use_id")?;
                    if id.trim().is_empty() {
                        return Err(invalid("messages", format!("{at}.tool_use_id must name the tool_use block it answers, not be blank")));
                    }
                    results.push((json!({"role": "tool", "tool_call_id": id, "content": content}), at));
                }
                // The template renders past turns without their reasoning.
                (Some("thinking" | "redacted_thinking"), "assistant") => {}
                (Some(t), _) => return Err(invalid("messages", format!("{at}: {t} blocks are not supported in {role} messages"))),
                (None, _) => return Err(invalid("messages", format!("{at} needs a type"))),
            }
        }
        // Tool results answer the previous assistant turn: they come before the user's text.
        for (result, origin) in results {
            messages.push(result);
            origins.push(origin);
        }
        if role == "assistant" && (!text.is_empty() || !calls.is_empty()) {
            let mut a = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                a["tool_calls"] = Value::Array(calls);
            }
            messages.push(a);
            origins.push(at);
        } else if role == "user" && !text.is_empty() {
            messages.push(json!({"role": "user", "content": text}));
            origins.push(at);
        }
    }
    let mut chat = json!({"model": model, "messages": messages, "max_tokens": max_tokens});
    for k in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = o.get(k).filter(|v| !v.is_null()) {
            chat[k] = v.clone();
        }
    }
    if let Some(v) = o.get("stop_sequences").filter(|v| !v.is_null()) {
        chat["stop"] = v.clone();
    }
    match o.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) => {
            let mut out = Vec::with_capacity(tools.len());
            for (i, t) in tools.iter().enumerate() {
                if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
                    return Err(invalid(
                        "tools",
                        format!("tools[{i}]: server tools ({kind}) are not supported; give name, description and input_schema"),
                    ));
                }
                let Some(name) = t.get("name").and_then(Value::as_str) else {
                    return Err(invalid("tools", format!("tools[{i}].name must be a string")));
                };
                // In OpenAI's key order (name, description, parameters): the template writes the tools as given.
                let mut f = Map::new();
                f.insert("name".into(), json!(name));
                if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                    f.insert("description".into(), d.clone());
                }
                f.insert("parameters".into(), t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"})));
                out.push(json!({"type": "function", "function": f}));
            }
            chat["tools"] = Value::Array(out);
        }
        Some(v) => return Err(invalid("tools", format!("tools must be an array, got {v}"))),
    }
    if let Some(tc) = o.get("tool_choice").filter(|v| !v.is_null()) {
        chat["tool_choice"] = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match tc.get("name").and_then(Value::as_str) {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => return Err(invalid("tool_choice", "tool_choice of type tool needs a name")),
            },
            _ => return Err(invalid("tool_choice", format!("tool_choice.type must be auto, any, tool or none, got {tc}"))),
        };
        if tc.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) {
            chat["parallel_tool_calls"] = json!(false);
        }
    }
    // Structured outputs: `output_config.format` of type json_schema.
    if let Some(f) = o.get("output_config").and_then(|c| c.get("format")).filter(|f| !f.is_null()) {
        match (f.get("type").and_then(Value::as_str), f.get("schema")) {
            (Some("json_schema"), Some(schema)) => {
                chat["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}});
            }
            _ => return Err(invalid("output_config", "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")),
        }
    }
    match o.get("thinking").and_then(|t| t.get("type")).and_then(Value::as_str) {
        Some("enabled") => chat["chat_template_kwargs"] = json!({"enable_thinking": true}),
        Some("disabled") => chat["chat_template_kwargs"] = json!({"enable_thinking": false}),
        _ => {}
    }
    Ok(Request { chat, origins })
}

/// Anthropic's `stop_reason` and `stop_sequence` for a chat choice (its `finish_reason`, and the stop string
/// that ended it in `stop_reason`, vLLM's field).
fn stop_of(choice: &Value) -> (&'static str, Value) {
    match (choice["finish_reason"].as_str(), &choice["stop_reason"]) {
        (Some("stop"), Value::String(s)) => ("stop_sequence", json!(s)),
        (Some("tool_calls"), _) => ("tool_use", Value::Null),
        (Some("length"), _) => ("max_tokens", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

/// A call's arguments as the `input` object of a `tool_use` block: a text cut off mid-way (by `max_tokens` or
/// a stop sequence) completed as [`complete_partial_object`] does, which is what Anthropic's SDKs make of the
/// same text streamed as `input_json_delta`s; a malformed one `{}`.
fn tool_input(args: &str) -> Value {
    serde_json::from_str::<Value>(args).ok().filter(Value::is_object).or_else(|| complete_partial_object(args)).unwrap_or_else(|| json!({}))
}

/// The JSON object that the cut-off text `s` begins, completed as partial-JSON parsers complete a stream: an
/// unfinished string value is closed, an unfinished key (and a key without its value) and an unfinished
/// literal are dropped, open objects and lists are closed. Candidates, longest first: all of `s`, then `s` up
/// to each point where a member or element was whole (after `{`/`[`, before a `,`, after a value's end),
/// each with its closers; the first that parses as an object. `None` when none does.
fn complete_partial_object(s: &str) -> Option<Value> {
    // Per open container: its closer and, for objects, whether a key is expected next.
    let mut stack: Vec<(u8, bool)> = Vec::new();
    let closers = |stack: &[(u8, bool)]| stack.iter().rev().map(|&(c, _)| c as char).collect::<String>();
    let mut points: Vec<(usize, String)> = Vec::new();
    let (mut in_str, mut esc, mut key) = (false, false, false);
    for (i, &c) in s.as_bytes().iter().enumerate() {
        if in_str {
            match c {
                _ if esc => esc = false,
                b'\\' => esc = true,
                b'"' => {
                    in_str = false;
                    if !key {
                        points.push((i + 1, closers(&stack)));
                    }
                }
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => {
                in_str = true;
                key = stack.last().is_some_and(|&(_, k)| k);
            }
            b'{' | b'[' => {
                stack.push((if c == b'{' { b'}' } else { b']' }, c == b'{'));
                points.push((i + 1, closers(&stack)));
            }
            b'}' | b']' => {
                stack.pop();
                points.push((i + 1, closers(&stack)));
            }
            b',' => {
                points.push((i, closers(&stack)));
                if let Some(top) = stack.last_mut() {
                    top.1 = top.0 == b'}';
                }
            }
            b':' => {
                if let Some(top) = stack.last_mut() {
                    top.1 = false;
                }
            }
            _ => {}
        }
    }
    let whole = format!("{s}{}{}", if in_str { "\"" } else { "" }, closers(&stack));
    let parse = |t: &str| serde_json::from_str::<Value>(t).ok().filter(Value::is_object);
    parse(&whole).or_else(|| points.iter().rev().find_map(|(at, close)| parse(&format!("{}{close}", &s[..*at]))))
}

/// A `tool_use` block's id for a chat tool call's: OpenAI's `call_…` in Anthropic's form, `toolu_…` (the
/// Mistral families' 9-character ids, which their templates require back, are kept).
fn tool_use_id(call_id: &str) -> String {
    call_id.strip_prefix("call_").map_or_else(|| call_id.to_string(), |rest| format!("toolu_{rest}"))
}

/// The message id for a chat completion id (`chatcmpl-…` → `msg_…`).
fn message_id(chat_id: &str) -> String {
    format!("msg_{}", chat_id.trim_start_matches("chatcmpl-"))
}

/// A whole chat completion (one choice) as a Messages reply: content blocks in order (thinking, text,
/// tool_use), the stop reason, and usage (`input_tokens` the prompt tokens prefilled,
/// `cache_read_input_tokens` those reused from the prefix cache).
pub fn from_chat(v: &Value, model: &str) -> Value {
    let ch = &v["choices"][0];
    let m = &ch["message"];
    let mut content = Vec::new();
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        let f = &c["function"];
        content.push(json!({"type": "tool_use", "id": tool_use_id(c["id"].as_str().unwrap_or("")), "name": f["name"],
                   "input": tool_input(f["arguments"].as_str().unwrap_or(""))}));
    }
    let (stop_reason, stop_sequence) = stop_of(ch);
    let u = &v["usage"];
    let (prompt, cached) = (u["prompt_tokens"].as_u64().unwrap_or(0), u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0));
    json!({
        "id": message_id(v["id"].as_str().unwrap_or("")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": prompt - cached.min(prompt), "output_tokens": u["completion_tokens"], "cache_read_input_tokens": cached},
    })
}

/// Anthropic's error object for `e`, and its status.
pub fn error(e: &ApiError) -> (StatusCode, Value) {
    let kind = match e.status {
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    (e.status, json!({"type": "error", "error": {"type": kind, "message": e.message}}))
}

/// A served model as Anthropic's Models API describes one (`GET /v1/models/{id}` from an Anthropic client):
/// the name as id and display name, `created_at` the server's start (`created`, Unix seconds) in RFC 3339,
/// active, and the context as both token limits.
pub fn model_info(id: &str, created: u64, ctx: usize) -> Value {
    json!({"type": "model", "id": id, "display_name": id, "created_at": rfc3339(created), "lifecycle": "active",
           "max_input_tokens": ctx, "max_tokens": ctx})
}

/// A page of Anthropic's model list from the query (`limit` 1 to 1000, default 20; `after_id` / `before_id`:
/// the models after / before that id in the list; `lifecycle`: every served model is active). Errors: a
/// `limit` out of range or not a number, an `after_id` or `before_id` not served, or both given.
pub fn model_page(names: &[String], created: u64, ctx: usize, q: &std::collections::HashMap<String, String>) -> R<Value> {
    let limit = match q.get("limit") {
        None => 20,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => return Err(invalid("limit", format!("limit must be an integer from 1 to 1000, got {}", crate::api::shown(l)))),
        },
    };
    let pos = |k: &str| -> R<Option<usize>> {
        match q.get(k) {
            None => Ok(None),
            Some(id) => names
                .iter()
                .position(|n| n == id)
                .map(Some)
                .ok_or_else(|| invalid(k, format!("{k} `{}` is not a model of this server", crate::api::shown(id)))),
        }
    };
    let (after, before) = (pos("after_id")?, pos("before_id")?);
    let (lo, hi) = match (after, before) {
        (Some(_), Some(_)) => return Err(invalid("before_id", "give after_id or before_id, not both")),
        (Some(a), None) => (a + 1, (a + 1 + limit).min(names.len())),
        (None, Some(b)) => (b.saturating_sub(limit), b),
        (None, None) => (0, limit.min(names.len())),
    };
    let active = q.get("lifecycle").is_none_or(|l| l.split(',').any(|v| v.trim() == "active"));
    let page: &[String] = if active { &names[lo..hi] } else { &[] };
    let has_more = active && if before.is_some() { lo > 0 } else { hi < names.len() };
    let data: Vec<Value> = page.iter().map(|n| model_info(n, created, ctx)).collect();
    Ok(json!({"data": data, "has_more": has_more, "first_id": page.first(), "last_id": page.last()}))
}

/// Unix seconds as an RFC 3339 UTC time, `YYYY-MM-DDTHH:MM:SSZ` (chrono's formatting).
fn rfc3339(secs: u64) -> String {
    i64::try_from(secs)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn event(name: &str, data: Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The kind of the content block being streamed.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    Tool,
}

/// Turns the chat-completion chunks of one streamed reply into Anthropic's events: `message_start`, then per
/// content block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
/// `content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`; an error
/// chunk becomes an `error` event.
pub struct EventStream {
    model: String,
    input_tokens: usize,
    started: bool,
    /// The open block and its index.
    open: Option<(usize, Block)>,
    blocks: usize,
}

impl EventStream {
    /// For a reply from `model` to a prompt of `input_tokens` tokens.
    pub fn new(model: String, input_tokens: usize) -> EventStream {
        EventStream { model, input_tokens, started: false, open: None, blocks: 0 }
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        if let Some((index, _)) = self.open.take() {
            out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }

    /// Opens a block of `kind` (closing the open one) unless one of that kind is open (`fresh`: always a
    /// new one); returns its index.
    fn open(&mut self, kind: Block, start: Value, fresh: bool, out: &mut Vec<Bytes>) -> usize {
        if let Some((index, k)) = self.open.filter(|&(_, k)| k == kind && !fresh) {
            debug_assert!(k == kind);
            return index;
        }
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, kind));
        out.push(event("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": start})));
        index
    }

    /// The events for one chat chunk (or error object).
    pub fn push(&mut self, chunk: &Value) -> Vec<Bytes> {
        let mut out = Vec::new();
        if let Some(e) = chunk.get("error") {
            let kind = if e["type"] == "invalid_request_error" { "invalid_request_error" } else { "api_error" };
            out.push(event("error", json!({"type": "error", "error": {"type": kind, "message": e["message"]}})));
            return out;
        }
        if !self.started {
            self.started = true;
            let id = message_id(chunk["id"].as_str().unwrap_or(""));
            out.push(event(
                "message_start",
                json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": self.model,
                       "content": [], "stop_reason": null, "stop_sequence": null,
                       "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}),
            ));
        }
        let Some(ch) = chunk["choices"].get(0) else { return out };
        let delta = &ch["delta"];
        if let Some(t) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            let index = self.open(Block::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}), false, &mut out);
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": t}}),
            ));
        }
        if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            let index = self.open(Block::Text, json!({"type": "text", "text": ""}), false, &mut out);
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
            ));
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            if let Some(id) = call["id"].as_str() {
                let id = tool_use_id(id);
                self.open(Block::Tool, json!({"type": "tool_use", "id": id, "name": f["name"], "input": {}}), true, &mut out);
            }
            if let (Some(args), Some((index, Block::Tool))) = (f["arguments"].as_str().filter(|a| !a.is_empty()), self.open) {
                out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": args}}),
                ));
            }
        }
        if ch["finish_reason"].is_string() {
            self.close(&mut out);
            let (stop_reason, stop_sequence) = stop_of(ch);
            // The final usage, as the whole reply has it (the prefix cache is known once the prompt ran).
            let t = &chunk["timings"];
            out.push(event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": {"output_tokens": t["predicted_n"], "input_tokens": t["prompt_n"], "cache_read_input_tokens": t["cache_n"]}}),
            ));
            out.push(event("message_stop", json!({"type": "message_stop"})));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{obj, sse_event};

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z"); // a leap day of a 400-year leap year
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z"); // 2100 is not a leap year
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_428_800 + 3_723), "2026-12-05T01:02:03Z");
    }

    /// Cut-off arguments complete as a partial-JSON parser completes the same text streamed.
    #[test]
    fn cut_tool_input_is_completed() {
        for (cut, want) in [
            ("{\"city\": \"Paris\", \"unit\": \"c\"", json!({"city": "Paris", "unit": "c"})),
            ("{\"city\": \"Paris\", \"unit\": \"c", json!({"city": "Paris", "unit": "c"})),
            ("{\"city\": \"Paris\", \"un", json!({"city": "Paris"})),
            ("{\"city\": \"Paris\", \"unit\": ", json!({"city": "Paris"})),
            ("{\"n\": 12", json!({"n": 12})),
            ("{\"n\": 12, \"b\": tr", json!({"n": 12})),
            ("{\"a\": [1, {\"b\": \"x\"}, [2", json!({"a": [1, {"b": "x"}, [2]]})),
            ("{\"a\": \"x\\", json!({})),
            ("{\"q\": \"say \\\"hi", json!({"q": "say \"hi"})),
            ("{", json!({})),
            ("", json!({})),
            ("[1, 2", json!({})),
        ] {
            assert_eq!(tool_input(cut), want, "{cut}");
        }
        assert_eq!(tool_input("{\"x\": 1}"), json!({"x": 1}));
    }

    /// A conversation with a tool round trip becomes the chat request it means.
    #[test]
    fn requests_translate_to_chat() {
        let r = to_chat(&obj(json!({
            "model": "claude-x", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"], "temperature": 0.5,
            "tools": [{"name": "get_time", "description": "Now.", "input_schema": {"type": "object", "properties": {}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "What time is it?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"tz": "UTC"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "12:00"}]},
                    {"type": "text", "text": "Thanks"}]},
            ],
        })))
        .unwrap();
        assert_eq!(
            r.chat,
            json!({"model": "claude-x", "max_tokens": 64, "temperature": 0.5, "stop": ["\n\n"],
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What time is it?"},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "t1", "type": "function",
                        "function": {"name": "get_time", "arguments": "{\"tz\":\"UTC\"}"}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": "12:00"},
                    {"role": "user", "content": "Thanks"},
                ],
                "tools": [{"type": "function", "function": {"name": "get_time", "description": "Now.", "parameters": {"type": "object", "properties": {}}}}],
                "tool_choice": "required", "parallel_tool_calls": false})
        );
        assert_eq!(r.origins, ["system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2]"]);
        for (body, needle) in [
            (json!({"messages": []}), "max_tokens is required"),
            (json!({"max_tokens": 5}), "messages must be an array"),
            (json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
            (json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "image blocks"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]}),
                "tool_result blocks",
            ),
            (json!({"max_tokens": 5, "messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}), "server tools"),
            (json!({"max_tokens": 5, "messages": [], "tool_choice": {"type": "tool"}}), "needs a name"),
        ] {
            let e = to_chat(&obj(body.clone())).err().unwrap_or_else(|| panic!("accepted: {body}"));
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    /// A chat reply with reasoning, text and a call becomes the content blocks, stop reason and usage.
    #[test]
    fn replies_translate_back() {
        let chat = json!({"id": "chatcmpl-abc", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Checking.", "reasoning_content": "Need the time.",
            "tool_calls": [{"id": "call_c1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]}}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 10}}});
        assert_eq!(
            from_chat(&chat, "m"),
            json!({"id": "msg_abc", "type": "message", "role": "assistant", "model": "m", "content": [
                {"type": "thinking", "thinking": "Need the time.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_c1", "name": "get_time", "input": {"tz": "UTC"}}],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 20, "output_tokens": 12, "cache_read_input_tokens": 10}})
        );
    }

    /// Chunks become Anthropic's event sequence, blocks opened and closed in order.
    #[test]
    fn chunks_become_events() {
        let mut s = EventStream::new("m".into(), 7);
        let chunk = |delta: Value, finish: Value| json!({"id": "chatcmpl-x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "timings": {"predicted_n": 5}});
        let mut names = Vec::new();
        let mut datas = Vec::new();
        for c in [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"reasoning_content": "hm"}), Value::Null),
            chunk(json!({"content": "Hi"}), Value::Null),
            chunk(json!({"content": " there"}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]}), Value::Null),
            chunk(json!({}), json!("tool_calls")),
        ] {
            for (name, data) in s.push(&c).iter().map(|b| sse_event(b)) {
                names.push(name);
                datas.push(data);
            }
        }
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(datas[0]["message"]["usage"]["input_tokens"], 7);
        assert_eq!(datas[1]["content_block"]["type"], "thinking");
        assert_eq!(datas[4], json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}));
        assert_eq!(datas[6]["delta"], json!({"type": "text_delta", "text": " there"}));
        assert_eq!(datas[8]["content_block"], json!({"type": "tool_use", "id": "toolu_c1", "name": "f", "input": {}}));
        assert_eq!(datas[9]["delta"], json!({"type": "input_json_delta", "partial_json": "{\"a\": 1}"}));
        assert_eq!(datas[11]["delta"]["stop_reason"], "tool_use");
        assert_eq!(datas[11]["usage"]["output_tokens"], 5);
    }
}
