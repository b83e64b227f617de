//! OpenAI's Responses API (`POST /v1/responses`), which the OpenAI Agents SDK and Codex speak, on top of the
//! chat path, as [`crate::anthropic`] does for Anthropic's: a request is translated into the chat request
//! it means ([`to_chat`]: `instructions` and `input` items become messages, `function_call` /
//! `function_call_output` items become tool calls and tool messages, the flat tool shape becomes OpenAI
//! chat's), answered by the same engine job, and the reply translated back into output items (`reasoning`,
//! `message`, `function_call`; [`from_chat`]) or, streamed, the Responses events ([`EventStream`]). The API
//! is stateless here: `previous_response_id` is refused (send the conversation in `input`). Reference:
//! OpenAI's API reference, "Responses" and "Streaming events".

use crate::api::ApiError;
use axum::body::Bytes;
use serde_json::{json, Map, Value};

type R<T> = Result<T, ApiError>;

/// A Responses request as the chat request it means.
pub struct Request {
    /// The chat-completions request body.
    pub chat: Value,
    /// The request fields a response object repeats (instructions, tools, sampling, ...; the server adds
    /// `model`, the served model's name).
    pub echo: Map<String, Value>,
    /// Where each chat message came from in the client's request: `instructions`, `input` (a string), or
    /// `input[i]`, the item that began it ([`ApiError::at_origins`]).
    pub origins: Vec<String>,
}

/// The chat request's field names in the Responses API's, for errors of a translated request
/// ([`ApiError::renamed`]).
pub const RENAMES: [(&str, &str); 7] = [
    ("max_tokens", "max_output_tokens"),
    // The schema's wrapper is chat's alone (text.format holds name, schema and strict): before its parent.
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
    ("reasoning_effort", "reasoning.effort"),
    ("function.parameters", "parameters"),
    ("function.name", "name"),
];

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param), message)
}

/// The text of an input message's `content`: a string, or `input_text` / `output_text` parts (joined).
fn text_of(content: &Value, at: &str) -> R<String> {
    crate::api::content_text(content, at, "input", &["input_text", "output_text", "text"], "parts")
}

/// Translates a Responses request body into the chat request it means. `input` (a string, or items:
/// messages of role user, system, developer or assistant; `function_call`; `function_call_output`;
/// `reasoning` items are dropped, the template re-renders past turns; a `function_call_output` must answer
/// a `function_call` item before it, as OpenAI requires), `instructions` (a system message
/// first), `tools` (function tools), `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
/// `temperature`, `top_p`, `text.format` (text, json_object, json_schema), `reasoning.effort` (chat's
/// `reasoning_effort`), `stream` are read; `truncation` (`disabled`, the default, or `auto`) is checked and
/// repeated in the echo (with `auto` the server drops leading input items that do not fit); `previous_response_id`,
/// non-function tools and image or file inputs are refused; `store`, `metadata`, `reasoning.summary`,
/// `include` (but log-probabilities: refused, as `top_logprobs`), `user` are accepted and ignored.
pub fn to_chat(o: &Map<String, Value>) -> R<Request> {
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    // State this server does not keep, or work it does not do in the background.
    for k in ["previous_response_id", "conversation", "prompt"] {
        if get(k).is_some() {
            return Err(invalid(
                k,
                format!("{k} is not supported: this server keeps no responses, conversations or prompts; send the conversation in input"),
            ));
        }
    }
    if get("background") == Some(&Value::Bool(true)) {
        return Err(invalid("background", "background responses are not supported"));
    }
    // Log-probabilities asked for are refused rather than answered with empty lists.
    let wants_logprobs = get("include").and_then(Value::as_array).is_some_and(|a| a.iter().any(|i| i == "message.output_text.logprobs"));
    if wants_logprobs || get("top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        let k = if wants_logprobs { "include" } else { "top_logprobs" };
        return Err(invalid(
            k,
            "log-probabilities are not supported on /v1/responses: use /v1/chat/completions with logprobs and top_logprobs",
        ));
    }
    let mut messages: Vec<Value> = Vec::new();
    let mut origins: Vec<String> = Vec::new();
    match get("instructions") {
        None => {}
        // Empty instructions are none (a template's default system prompt stays).
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => {
            messages.push(json!({"role": "system", "content": s}));
            origins.push("instructions".into());
        }
        Some(v) => return Err(invalid("instructions", format!("instructions must be a string, got {v}"))),
    }
    match get("input") {
        None => return Err(invalid("input", "input is required")),
        Some(Value::String(s)) => {
            messages.push(json!({"role": "user", "content": s}));
            origins.push("input".into());
        }
        Some(Value::Array(items)) => {
            // The call ids of the function_call items so far: an output must answer one of them.
            let mut call_ids = std::collections::HashSet::new();
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let field =
                    |k: &str| item.get(k).and_then(Value::as_str).ok_or_else(|| invalid("input", format!("{at}.{k} must be a string")));
                match item.get("type").and_then(Value::as_str) {
                    None | Some("message") => {
                        let role = match item.get("role").and_then(Value::as_str) {
                            Some("developer") => "system",
                            Some(r @ ("user" | "system" | "assistant")) => r,
                            _ => return Err(invalid("input", format!("{at}.role must be user, system, developer or assistant"))),
                        };
                        let content = text_of(item.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                        messages.push(json!({"role": role, "content": content}));
                        origins.push(at.clone());
                    }
                    Some("function_call") => {
                        let call_id = field("call_id")?;
                        call_ids.insert(call_id);
                        let call = json!({"id": call_id, "type": "function",
                                          "function": {"name": field("name")?, "arguments": field("arguments")?}});
                        // Consecutive calls are one assistant turn's parallel calls.
                        match messages.last_mut() {
                            Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                                if let Some(calls) = m["tool_calls"].as_array_mut() {
                                    calls.push(call);
                                }
                            }
                            Some(m) if m["role"] == "assistant" => m["tool_calls"] = json!([call]),
                            _ => {
                                messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}));
                                origins.push(at.clone());
                            }
                        }
                    }
                    Some("function_call_output") => {
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ Value::Array(_)) => text_of(v, &format!("{at}.output"))?,
                            _ => return Err(invalid("input", format!("{at}.output must be a string"))),
                        };
                        let call_id = field("call_id")?;
                        if call_id.trim().is_empty() {
                            return Err(invalid("input", format!("{at}.call_id must name the function_call it answers, not be blank")));
                        }
                        if !call_ids.contains(call_id) {
                            return Err(invalid(
                                "input",
                                format!("{at}: No tool call found for function call output with call_id {}: no function_call item before it has that call_id", crate::api::shown(call_id)),
                            ));
                        }
                        messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                        origins.push(at.clone());
                    }
                    Some("reasoning") => {}
                    Some(t) => return Err(invalid("input", format!("{at}: {t} items are not supported"))),
                }
            }
        }
        Some(v) => return Err(invalid("input", format!("input must be a string or an array of items, got {v}"))),
    }
    let mut chat = json!({"messages": messages});
    for (from, to) in [
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("stream", "stream"),
    ] {
        if let Some(v) = get(from) {
            chat[to] = v.clone();
        }
    }
    // reasoning.effort: the chat request's reasoning_effort (chat template variables there, checked there).
    if let Some(effort) = get("reasoning").and_then(|r| r.get("effort")).filter(|v| !v.is_null()) {
        chat["reasoning_effort"] = effort.clone();
    }
    match get("tools") {
        None => {}
        Some(Value::Array(tools)) => {
            let mut out = Vec::with_capacity(tools.len());
            for (i, t) in tools.iter().enumerate() {
                match t.get("type").and_then(Value::as_str) {
                    Some("function") => {}
                    other => {
                        return Err(invalid(
                            "tools",
                            format!("tools[{i}]: only function tools are supported, got {}", other.unwrap_or("no type")),
                        ))
                    }
                }
                let mut f = Map::new();
                for k in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                        f.insert(k.into(), v.clone());
                    }
                }
                out.push(json!({"type": "function", "function": f}));
            }
            chat["tools"] = Value::Array(out);
        }
        Some(v) => return Err(invalid("tools", format!("tools must be an array, got {v}"))),
    }
    if let Some(tc) = get("tool_choice") {
        chat["tool_choice"] = match tc {
            Value::String(_) => tc.clone(),
            Value::Object(m) if m.get("type") == Some(&json!("function")) => match m.get("name") {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => return Err(invalid("tool_choice", "tool_choice of type function needs a name")),
            },
            v => {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, got {v}"),
                ))
            }
        };
    }
    if let Some(t) = get("text").filter(|t| !t.is_object()) {
        return Err(invalid("text", format!("text must be an object like {{\"format\": {{\"type\": \"text\"}}}}, got {t}")));
    }
    if let Some(f) = get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        chat["response_format"] = match f.get("type").and_then(Value::as_str) {
            Some("text") => json!({"type": "text"}),
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => {
                // OpenAI's Responses API asks for the schema itself here (there is no json_schema wrapper).
                if f.get("schema").is_none_or(Value::is_null) {
                    return Err(invalid("text", "text.format of type json_schema needs a schema (and a name)"));
                }
                let mut js = Map::new();
                for k in ["name", "schema", "strict", "description"] {
                    if let Some(v) = f.get(k) {
                        js.insert(k.into(), v.clone());
                    }
                }
                json!({"type": "json_schema", "json_schema": js})
            }
            _ => return Err(invalid("text", "text.format.type must be text, json_object or json_schema")),
        };
    }
    let truncation = match get("truncation") {
        None => "disabled",
        Some(Value::String(t)) if t == "auto" || t == "disabled" => t.as_str(),
        Some(v) => return Err(invalid("truncation", format!("truncation must be \"auto\" or \"disabled\", got {v}"))),
    };
    let mut echo = Map::new();
    echo.insert("truncation".into(), json!(truncation));
    for k in
        ["instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_output_tokens", "text", "metadata"]
    {
        echo.insert(k.into(), get(k).cloned().unwrap_or(Value::Null));
    }
    Ok(Request { chat, echo, origins })
}

/// The response id for a chat completion id (`chatcmpl-…` → `resp_…`), and item ids under it.
fn ids(chat_id: &str) -> String {
    chat_id.trim_start_matches("chatcmpl-").to_string()
}

/// The response object around `output` (items), with the request's fields repeated and `usage` from the
/// chat `usage`; `incomplete` when the reply was cut by `max_output_tokens`.
fn response(id: &str, created: &Value, echo: &Map<String, Value>, output: Vec<Value>, usage: Option<&Value>, status: &str) -> Value {
    let mut r = json!({
        "id": format!("resp_{id}"), "object": "response", "created_at": created, "status": status, "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "output": output, "previous_response_id": null, "store": false, "truncation": "disabled",
        "reasoning": {"effort": null, "summary": null},
    });
    for (k, v) in echo {
        r[k] = v.clone();
    }
    for (k, default) in [
        ("tools", json!([])),
        ("tool_choice", json!("auto")),
        ("parallel_tool_calls", json!(true)),
        ("metadata", json!({})),
        ("text", json!({"format": {"type": "text"}})),
    ] {
        if r[k].is_null() {
            r[k] = default;
        }
    }
    if let Some(u) = usage {
        let (prompt, completion) = (u["prompt_tokens"].as_u64().unwrap_or(0), u["completion_tokens"].as_u64().unwrap_or(0));
        r["usage"] = json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + completion});
    }
    r
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{id}"), "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": format!("msg_{id}"), "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call_id: &Value, name: &Value, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// A whole chat completion (one choice) as a response object: output items in order (reasoning, message,
/// function calls), `status` `incomplete` when cut by the token limit, usage from the chat usage.
pub fn from_chat(v: &Value, echo: &Map<String, Value>) -> Value {
    let id = ids(v["id"].as_str().unwrap_or(""));
    let ch = &v["choices"][0];
    let m = &ch["message"];
    let mut output = Vec::new();
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        output.push(reasoning_item(&id, r));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        output.push(message_item(&id, t, "completed"));
    }
    for (i, c) in m["tool_calls"].as_array().into_iter().flatten().enumerate() {
        let f = &c["function"];
        output.push(call_item(&format!("{id}_{i}"), &c["id"], &f["name"], f["arguments"].as_str().unwrap_or(""), "completed"));
    }
    let status = if ch["finish_reason"] == "length" { "incomplete" } else { "completed" };
    // The item the token limit cut is incomplete too.
    if let Some(last) = output.last_mut().filter(|_| status == "incomplete") {
        last["status"] = json!("incomplete");
    }
    response(&id, &v["created"], echo, output, Some(&v["usage"]), status)
}

/// The item being streamed.
enum Open {
    Reasoning { text: String },
    Message { text: String },
    Call { call_id: Value, name: Value, args: String },
}

/// Turns the chat-completion chunks of one streamed reply into the Responses events: `response.created`,
/// `response.in_progress`; per output item `response.output_item.added`, its deltas
/// (`response.reasoning_text.delta`, `response.output_text.delta` within a content part,
/// `response.function_call_arguments.delta`) and their `.done` events, `response.output_item.done`; then
/// `response.completed` (or `response.incomplete`) with the whole response. Every event carries its
/// `sequence_number`; an error chunk becomes an `error` event.
pub struct EventStream {
    echo: Map<String, Value>,
    seq: u64,
    id: String,
    created: Value,
    /// Finished output items.
    done: Vec<Value>,
    open: Option<Open>,
}

impl EventStream {
    /// For a request whose echoed fields are `echo` ([`Request::echo`]).
    pub fn new(echo: Map<String, Value>) -> EventStream {
        EventStream { echo, seq: 0, id: String::new(), created: Value::Null, done: Vec::new(), open: None }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> Bytes {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
    }

    /// The id and output index of the open item.
    fn item_id(&self) -> (String, usize) {
        let prefix = match self.open {
            Some(Open::Reasoning { .. }) => "rs",
            Some(Open::Message { .. }) => "msg",
            Some(Open::Call { .. }) | None => "fc",
        };
        let index = self.done.len();
        (format!("{prefix}_{}_{index}", self.id), index)
    }

    /// Closes the open item: its `.done` events and `response.output_item.done`.
    fn close(&mut self, out: &mut Vec<Bytes>) {
        self.close_as(out, "completed");
    }

    /// [`close`](Self::close) with the item's `status` (`incomplete`: cut by the token limit).
    fn close_as(&mut self, out: &mut Vec<Bytes>, status: &str) {
        let (iid, index) = self.item_id();
        let Some(open) = self.open.take() else { return };
        let item = match open {
            Open::Reasoning { text } => {
                let e = json!({"item_id": iid, "output_index": index, "content_index": 0, "text": text});
                out.push(self.event("response.reasoning_text.done", e));
                json!({"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status})
            }
            Open::Message { text } => {
                let e = json!({"item_id": iid, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
                out.push(self.event("response.output_text.done", e));
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let e = json!({"item_id": iid, "output_index": index, "content_index": 0, "part": part});
                out.push(self.event("response.content_part.done", e));
                json!({"type": "message", "id": iid, "status": status, "role": "assistant", "content": [part]})
            }
            Open::Call { call_id, name, args } => {
                let e = json!({"item_id": iid, "output_index": index, "arguments": args});
                out.push(self.event("response.function_call_arguments.done", e));
                json!({"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": args, "status": status})
            }
        };
        let e = json!({"output_index": index, "item": item});
        out.push(self.event("response.output_item.done", e));
        self.done.push(item);
    }

    /// Opens `open` (closing the open item): `response.output_item.added`, and for a message its content
    /// part.
    fn start(&mut self, open: Open, out: &mut Vec<Bytes>) {
        self.close(out);
        self.open = Some(open);
        let (item_id, index) = self.item_id();
        let item = match &self.open {
            Some(Open::Reasoning { .. }) => {
                json!({"type": "reasoning", "id": item_id, "summary": [], "content": [], "status": "in_progress"})
            }
            Some(Open::Message { .. }) => {
                json!({"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
            }
            Some(Open::Call { call_id, name, .. }) => {
                json!({"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"})
            }
            None => return,
        };
        let message = item["type"] == "message";
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
        if message {
            let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
            ));
        }
    }

    /// Text `t` of the reasoning item (`reasoning`) or of the message, opened if another item is open.
    fn text_delta(&mut self, reasoning: bool, t: &str, out: &mut Vec<Bytes>) {
        match (reasoning, &mut self.open) {
            (true, Some(Open::Reasoning { text })) | (false, Some(Open::Message { text })) => text.push_str(t),
            (true, _) => self.start(Open::Reasoning { text: t.to_string() }, out),
            (false, _) => self.start(Open::Message { text: t.to_string() }, out),
        }
        let (item_id, index) = self.item_id();
        let mut e = json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": t});
        let kind = if reasoning { "response.reasoning_text.delta" } else { "response.output_text.delta" };
        if !reasoning {
            e["logprobs"] = json!([]);
        }
        out.push(self.event(kind, e));
    }

    /// The events for one chat chunk (or error object).
    pub fn push(&mut self, chunk: &Value) -> Vec<Bytes> {
        let mut out = Vec::new();
        if let Some(e) = chunk.get("error") {
            let e = json!({"code": e["code"], "message": e["message"], "param": e["param"]});
            out.push(self.event("error", e));
            return out;
        }
        if self.seq == 0 {
            self.id = ids(chunk["id"].as_str().unwrap_or(""));
            self.created = chunk["created"].clone();
            let r = response(&self.id, &self.created, &self.echo, Vec::new(), None, "in_progress");
            out.push(self.event("response.created", json!({"response": r})));
            out.push(self.event("response.in_progress", json!({"response": r})));
        }
        let Some(ch) = chunk["choices"].get(0) else { return out };
        let delta = &ch["delta"];
        if let Some(t) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            self.text_delta(true, t, &mut out);
        }
        if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            self.text_delta(false, t, &mut out);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            if call.get("id").is_some_and(Value::is_string) {
                self.start(Open::Call { call_id: call["id"].clone(), name: f["name"].clone(), args: String::new() }, &mut out);
            }
            if let (Some(a), Some(Open::Call { args, .. })) = (f["arguments"].as_str().filter(|a| !a.is_empty()), self.open.as_mut()) {
                args.push_str(a);
                let (item_id, index) = self.item_id();
                out.push(
                    self.event("response.function_call_arguments.delta", json!({"item_id": item_id, "output_index": index, "delta": a})),
                );
            }
        }
        if let Some(finish) = ch["finish_reason"].as_str() {
            let status = if finish == "length" { "incomplete" } else { "completed" };
            self.close_as(&mut out, status);
            let t = &chunk["timings"];
            let (prompt, completion) =
                (t["prompt_n"].as_u64().unwrap_or(0) + t["cache_n"].as_u64().unwrap_or(0), t["predicted_n"].as_u64().unwrap_or(0));
            let usage =
                json!({"prompt_tokens": prompt, "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": t["cache_n"]}});
            let r = response(&self.id, &self.created, &self.echo, std::mem::take(&mut self.done), Some(&usage), status);
            out.push(self.event(if status == "completed" { "response.completed" } else { "response.incomplete" }, json!({"response": r})));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{obj, sse_event};

    /// Input items with a call and its output become the chat request they mean.
    #[test]
    fn requests_translate_to_chat() {
        let r = to_chat(&obj(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0, "store": true,
            "tools": [{"type": "function", "name": "get_time", "description": "Now.", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_time"},
            "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}},
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{\"tz\": \"UTC\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
            ],
        })))
        .unwrap();
        assert_eq!(
            r.chat,
            json!({"model": "m", "temperature": 0, "max_tokens": 40,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "system", "content": "Use tools."},
                    {"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
                ],
                "tools": [{"type": "function", "function": {"name": "get_time", "description": "Now.", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}})
        );
        assert_eq!((&r.echo["instructions"], &r.echo["truncation"]), (&json!("Be brief."), &json!("disabled")));
        // The parallel calls (input[3] and input[4]) are one assistant message, begun by input[3].
        assert_eq!(r.origins, ["instructions", "input[0]", "input[1]", "input[3]", "input[5]"]);
        let r = to_chat(&obj(json!({"input": "x", "reasoning": {"effort": "none", "summary": "auto"}}))).unwrap();
        assert_eq!(r.chat["reasoning_effort"], "none");
        let r = to_chat(&obj(json!({"input": "x", "reasoning": {"effort": null}}))).unwrap();
        assert!(r.chat.get("reasoning_effort").is_none(), "{}", r.chat);
        for (body, needle) in [
            (json!({}), "input is required"),
            (json!({"input": "x", "previous_response_id": "resp_1"}), "keeps no responses"),
            (json!({"input": "x", "conversation": "conv_1"}), "keeps no responses"),
            (json!({"input": "x", "prompt": {"id": "p"}}), "keeps no responses"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "text": "json"}), "text must be an object"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), "input_image parts"),
            (json!({"input": [{"role": "tool", "content": "x"}]}), "input[0].role"),
            (json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}), "input[0].call_id"),
            (
                json!({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c2", "output": "x"}]}),
                "input[1]: No tool call found for function call output with call_id c2",
            ),
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "only function tools"),
            (json!({"input": "x", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
            (json!({"input": "x", "truncation": "middle"}), "truncation must be"),
        ] {
            let e = to_chat(&obj(body.clone())).err().unwrap_or_else(|| panic!("accepted: {body}"));
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    /// A chat reply becomes output items and usage; a cut reply is incomplete.
    #[test]
    fn replies_translate_back() {
        let chat = json!({"id": "chatcmpl-abc", "created": 5, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Checking.", "reasoning_content": "Hm.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 10}}});
        let r = from_chat(&chat, &obj(json!({"model": "m", "instructions": null})));
        assert_eq!(r["id"], "resp_abc");
        assert_eq!(r["status"], "completed");
        assert_eq!(r["model"], "m");
        assert_eq!(
            r["output"],
            json!([
                {"type": "reasoning", "id": "rs_abc", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}], "status": "completed"},
                {"type": "message", "id": "msg_abc", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
                {"type": "function_call", "id": "fc_abc_0", "call_id": "c1", "name": "get_time", "arguments": "{}", "status": "completed"},
            ])
        );
        assert_eq!(r["usage"]["total_tokens"], 42);
        assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 10);
        let mut cut = chat.clone();
        cut["choices"][0]["finish_reason"] = json!("length");
        let r = from_chat(&cut, &Map::new());
        assert_eq!((r["status"].as_str(), &r["incomplete_details"]), (Some("incomplete"), &json!({"reason": "max_output_tokens"})));
        assert_eq!((&r["output"][1]["status"], &r["output"][2]["status"]), (&json!("completed"), &json!("incomplete")));
        let instr = to_chat(&obj(json!({"input": "x", "instructions": ""}))).unwrap();
        assert_eq!(instr.chat["messages"], json!([{"role": "user", "content": "x"}]), "empty instructions are none");
    }

    /// Chunks become the event sequence, numbered, the final response holding every item.
    #[test]
    fn chunks_become_events() {
        let mut s = EventStream::new(obj(json!({"model": "m"})));
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "chatcmpl-x", "created": 1, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                   "timings": {"predicted_n": 5, "prompt_n": 7, "cache_n": 2}})
        };
        let mut events = Vec::new();
        for c in [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Hi"}), Value::Null),
            chunk(json!({"content": " there"}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}), Value::Null),
            chunk(json!({}), json!("tool_calls")),
        ] {
            for (name, data) in s.push(&c).iter().map(|b| sse_event(b)) {
                assert_eq!(data["type"], name);
                assert_eq!(data["sequence_number"], events.len());
                events.push(data);
            }
        }
        let names: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        assert_eq!(events[6]["text"], "Hi there");
        let done = &events[13]["response"];
        assert_eq!(done["output"][0]["content"][0]["text"], "Hi there");
        assert_eq!(done["output"][1]["call_id"], "c1");
        assert_eq!(done["output"][1]["arguments"], "{}");
        assert_eq!(done["usage"]["input_tokens"], 9);
        assert_eq!(done["usage"]["output_tokens"], 5);
    }
}
