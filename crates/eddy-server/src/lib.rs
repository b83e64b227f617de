//! `eddy serve`: an OpenAI-compatible HTTP server (axum).
//!
//! The server knows HTTP and the OpenAI wire formats only. Requests are validated, templated and tokenized
//! on the async side; generation runs on one dedicated engine thread ([`worker`]) that owns the
//! [`Engine`] and takes jobs from a bounded FIFO queue (full → 503). Each job streams its text back over
//! its own channel; a client that goes away closes that channel, which cancels the job at the next decode
//! step (or skips it while still queued).
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`.

pub mod api;
pub mod worker;

use api::{ApiError, Common};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use eddy::chat::{encode_chat, ChatTemplate};
use eddy::engine::{Engine, GenerateParams};
use eddy::stats::GenerationStats;
use eddy::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;
use worker::{Event, Job};

/// Server options.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The model id clients must use (or omit); default: the model file's name without extension.
    pub model_id: Option<String>,
    /// Jobs that may wait for the engine thread; more are answered 503.
    pub max_queue: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            model_id: None,
            max_queue: 16,
        }
    }
}

/// The id a model is served under: the file (or folder) name without `.gguf`.
pub fn model_id_for(engine: &Engine) -> String {
    let src = &engine.lm.source;
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| src.display().to_string());
    name.strip_suffix(".gguf")
        .map(str::to_string)
        .unwrap_or(name)
}

struct AppState {
    model_id: String,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    ctx: usize,
    jobs: std::sync::mpsc::SyncSender<Job>,
    created: u64,
    next_id: AtomicU64,
}

/// Serves the OpenAI API on `listener` until the listener fails. The engine moves to its own thread.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Engine,
    opts: ServeOptions,
) -> std::io::Result<()> {
    axum::serve(listener, router(engine, opts)?).await
}

/// Blocking entry point for the CLI: binds `host:port`, builds a Tokio runtime and serves.
pub fn run_blocking(
    host: &str,
    port: u16,
    engine: Engine,
    opts: ServeOptions,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((host, port)).await?;
        let id = opts
            .model_id
            .clone()
            .unwrap_or_else(|| model_id_for(&engine));
        eprintln!(
            "eddy serve: model `{id}`, context {} tokens, listening on http://{}",
            engine.ctx(),
            listener.local_addr()?
        );
        serve(listener, engine, opts).await
    })
}

/// The axum router with the engine thread started behind it.
pub fn router(mut engine: Engine, opts: ServeOptions) -> std::io::Result<Router> {
    let model_id = opts
        .model_id
        .clone()
        .unwrap_or_else(|| model_id_for(&engine));
    let (tx, rx) = std::sync::mpsc::sync_channel(opts.max_queue);
    let state = Arc::new(AppState {
        model_id,
        tokenizer: engine.lm.tokenizer.clone(),
        template: engine.lm.template.take(),
        ctx: engine.ctx(),
        jobs: tx,
        created: unix_now(),
        next_id: AtomicU64::new(1),
    });
    worker::spawn(engine, rx)?;
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .with_state(state))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::invalid(None, format!("Invalid URL ({method} {uri})")).with_status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("not_found"),
    )
}

async fn not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::invalid(None, format!("method {method} is not allowed on {uri}")).with_status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        Some("method_not_allowed"),
    )
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.model_id, "object": "model", "created": st.created, "owned_by": "eddy"}]}),
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, Kind::Chat, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, Kind::Text, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Validate, tokenize, queue, and answer (whole or streamed).
async fn handle(st: Arc<AppState>, kind: Kind, body: Bytes) -> Result<Response, ApiError> {
    let o = api::parse_object(&body)?;
    let common = api::parse_common(&o, &st.model_id)?;
    let prompt = match kind {
        Kind::Chat => {
            let messages = api::parse_messages(&o)?;
            let kwargs = api::parse_kwargs(&o)?;
            let Some(t) = &st.template else {
                return Err(ApiError::invalid(
                    None,
                    "the model has no chat template; use /v1/completions",
                ));
            };
            let text = t
                .render(&messages, true, &kwargs)
                .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
            encode_chat(&st.tokenizer, &text)
                .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?
        }
        Kind::Text => {
            let text = api::parse_prompt(&o)?;
            st.tokenizer
                .encode(&text, true)
                .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?
        }
    };
    let what = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            Some(what),
            format!("the {what} is empty"),
        ));
    }
    let room = st.ctx.saturating_sub(prompt.len());
    let max_tokens = match common.max_tokens {
        Some(m) if prompt.len() + m > st.ctx => {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the {what}, {m} in the completion). Please reduce the length of the {what} or the completion.",
                    st.ctx,
                    prompt.len() + m,
                    prompt.len()
                ),
            )
            .with_status(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")))
        }
        Some(m) => m,
        None if room == 0 => {
            return Err(ApiError::invalid(
                Some(what),
                format!("This model's maximum context length is {} tokens. However, the {what} has {} tokens, leaving no room for the completion.", st.ctx, prompt.len()),
            )
            .with_status(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")))
        }
        None => room,
    };
    // The engine needs the prompt strictly shorter than the context.
    if prompt.len() >= st.ctx {
        return Err(ApiError::invalid(
            Some(what),
            format!("This model's maximum context length is {} tokens. However, the {what} has {} tokens.", st.ctx, prompt.len()),
        )
        .with_status(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")));
    }

    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt,
        params: GenerateParams {
            max_tokens,
            sampler: common.sampler.clone(),
            ignore_eos: false,
        },
        stops: common.stops.clone(),
        tx,
    };
    match st.jobs.try_send(job) {
        Ok(()) => {}
        Err(std::sync::mpsc::TrySendError::Full(_)) => {
            return Err(ApiError::invalid(
                None,
                "the server is busy: the request queue is full; retry later",
            )
            .with_status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("queue_full"),
            ))
        }
        Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
            return Err(
                ApiError::invalid(None, "the engine thread has stopped").with_status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    None,
                ),
            )
        }
    }
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let fmt = Formatter {
        kind,
        id: format!(
            "{}-{:x}{:06x}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            unix_now(),
            n
        ),
        created: unix_now(),
        model: st.model_id.clone(),
        include_usage: common.include_usage,
    };
    if common.stream {
        Ok(stream_response(fmt, rx))
    } else {
        whole_response(fmt, rx, &common).await
    }
}

/// Builds the OpenAI JSON objects of one request.
struct Formatter {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// llama-server's `timings` object.
fn timings(s: &GenerationStats, completion_tokens: usize) -> Value {
    json!({
        "prompt_n": s.prompt_tokens,
        "prompt_ms": s.ttft.as_secs_f64() * 1e3,
        "predicted_n": completion_tokens,
        "predicted_ms": s.decode_time.as_secs_f64() * 1e3,
        "predicted_per_second": s.generation_speed(),
    })
}

impl Formatter {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn whole(
        &self,
        text: String,
        finish: &str,
        completion_tokens: usize,
        stats: &GenerationStats,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
            }
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice],
            "usage": usage(stats.prompt_tokens, completion_tokens),
            "timings": timings(stats, completion_tokens),
        })
    }

    /// One chunk with one choice: `text` (content delta), `role` on the first chat chunk, `finish`.
    fn chunk(&self, role: bool, text: Option<&str>, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Text => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn usage_chunk(&self, stats: &GenerationStats, completion_tokens: usize) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [],
               "usage": usage(stats.prompt_tokens, completion_tokens)})
    }
}

async fn whole_response(
    fmt: Formatter,
    mut rx: mpsc::UnboundedReceiver<Event>,
    _c: &Common,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta(t) => text.push_str(&t),
            Event::Done {
                finish,
                completion_tokens,
                stats,
            } => {
                return Ok(Json(fmt.whole(text, finish, completion_tokens, &stats)).into_response());
            }
            Event::Error(e) => return Err(server_error(e)),
        }
    }
    Err(server_error("the engine dropped the request".into()))
}

fn server_error(msg: String) -> ApiError {
    ApiError::invalid(None, msg).with_status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        None,
    )
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response(fmt: Formatter, rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut queued = VecDeque::new();
    if fmt.kind == Kind::Chat {
        queued.push_back(sse(&fmt.chunk(true, Some(""), None)));
    }
    let body = SseBody {
        fmt,
        rx,
        queued,
        finished: false,
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The SSE body: formats engine events as they arrive. Dropping it (client gone) drops the receiver,
/// which cancels the job on the engine thread.
struct SseBody {
    fmt: Formatter,
    rx: mpsc::UnboundedReceiver<Event>,
    queued: VecDeque<Bytes>,
    finished: bool,
}

impl SseBody {
    fn on_event(&mut self, ev: Option<Event>) {
        let f = &self.fmt;
        match ev {
            Some(Event::Delta(t)) => self.queued.push_back(sse(&f.chunk(false, Some(&t), None))),
            Some(Event::Done {
                finish,
                completion_tokens,
                stats,
            }) => {
                let mut last = f.chunk(false, None, Some(finish));
                if f.kind == Kind::Chat {
                    last["choices"][0]["delta"] = json!({});
                }
                last["timings"] = timings(&stats, completion_tokens);
                self.queued.push_back(sse(&last));
                if f.include_usage {
                    self.queued
                        .push_back(sse(&f.usage_chunk(&stats, completion_tokens)));
                }
                self.finish();
            }
            Some(Event::Error(e)) => {
                self.queued.push_back(sse(&server_error(e).body()));
                self.finish();
            }
            None => {
                self.queued.push_back(sse(
                    &server_error("the engine dropped the request".into()).body()
                ));
                self.finish();
            }
        }
    }

    fn finish(&mut self) {
        self.queued
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}

impl futures_core::Stream for SseBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.queued.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(ev) => this.on_event(ev),
            }
        }
    }
}
