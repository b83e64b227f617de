//! `eddy serve`: an OpenAI-compatible HTTP server (axum).
//!
//! The server knows HTTP and the wire formats only: OpenAI's chat and text completions, and, as translations
//! around the chat path, OpenAI's Responses ([`responses`]) and Anthropic's Messages ([`anthropic`]). Requests are validated, templated and tokenized
//! on Tokio's blocking pool (so that large bodies never stall the async workers); generation runs on one dedicated engine thread ([`worker`]) that owns the
//! [`Engine`] and takes jobs from a bounded FIFO queue (full → 503 with `Retry-After`). Each job streams its
//! text back over its own channel; a client that goes away closes that channel, which cancels the job at
//! the next decode step (or skips it while still queued, its place in the queue given back at once).
//!
//! Every error, those axum produces included (body over [`ServeOptions::max_body_bytes`], bad
//! requests), is an OpenAI error object, or on `/v1/messages` an Anthropic one.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `POST /v1/messages`,
//! `POST /v1/messages/count_tokens`, `POST /tokenize`, `POST /detokenize`, `GET /v1/models`,
//! `GET /v1/models/{id}` (in Anthropic's shapes for Anthropic clients), `GET /health`, `GET /metrics`
//! (Prometheus text).
//!
//! The server has one model and answers a request naming any model with it (llama-server's behaviour;
//! clients often send a fixed name): `model` in a response is the first served name. Chat requests may
//! bring `tools` ([`tools`]) and any request a `response_format` JSON schema; `tool_choice` `required` or a
//! named function, and JSON schemas, constrain decoding with llguidance ([`grammar`]). A model without a
//! chat template chats in ChatML, as llama-server does ([`ChatTemplate::or_chatml`]; tools then take eddy's
//! generic format; a reply stops at [`ChatTemplate::end_text`] where the vocabulary has no `<|im_end|>`).
//!
//! A streaming request that is still waiting for its first token (queued, or in a long prefill) gets an
//! SSE comment `: keep-alive` every [`ServeOptions::keep_alive`], so that proxies and clients with read
//! timeouts do not give up on it.

mod anthropic;
pub mod api;
pub mod grammar;
pub mod metrics;
pub mod reasoning;
mod responses;
pub mod tools;
pub mod worker;

use api::{ApiError, Common};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use eddy::chat::{encode_chat_guarded, ChatTemplate};
use eddy::engine::{Engine, GenerateParams};
use eddy::stats::GenerationStats;
use eddy::tokenizer::Tokenizer;
use metrics::Metrics;
use reasoning::{ReasoningSplitter, Split, Start};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tools::CallStreamer;
use worker::{Choice, Event, Job, JobPrompt, Logprob, Queue, SlotGuard, TokenText};

/// Server options.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The names `/v1/models` lists (`--alias`, repeatable); default: the model file's name without
    /// extension. Requests may name any model: the one model answers.
    pub aliases: Vec<String>,
    /// Origins browsers may call the API from (CORS, `--cors-origin`, repeatable; `*` = any); empty: no
    /// CORS headers.
    pub cors_origins: Vec<String>,
    /// Jobs that may wait for the engine thread; more are answered 503 (0: none wait, a request arriving
    /// while another runs is answered 503).
    pub max_queue: usize,
    /// Period of the `: keep-alive` SSE comments sent while a streaming request waits for its first
    /// token; `None` sends none.
    pub keep_alive: Option<Duration>,
    /// Largest request body accepted; larger ones get a 413.
    pub max_body_bytes: usize,
    /// Longest wait for the next bytes of a request body (`--body-timeout`, more than zero); a client that
    /// stalls longer is answered 408 Request Timeout and its connection closed (so it holds neither a
    /// worker nor the drain at shutdown).
    pub body_timeout: Duration,
}

/// Default [`ServeOptions::body_timeout`]: 60 s.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// Default [`ServeOptions::max_body_bytes`]: 32 MiB (clients send long histories).
pub const MAX_BODY_BYTES: usize = 32 << 20;

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            aliases: Vec::new(),
            cors_origins: Vec::new(),
            max_queue: 16,
            keep_alive: Some(Duration::from_secs(5)),
            max_body_bytes: MAX_BODY_BYTES,
            body_timeout: BODY_TIMEOUT,
        }
    }
}

impl ServeOptions {
    /// Checks what needs no model (so the CLI can refuse before loading one): no empty `--alias`, every
    /// `--cors-origin` `*` or an origin, a `body_timeout` (`--body-timeout`) longer than zero.
    ///
    /// Errors: `InvalidInput` naming the option.
    pub fn validate(&self) -> std::io::Result<()> {
        if self.aliases.iter().any(|a| a.trim().is_empty()) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "--alias: a model name must not be empty"));
        }
        if self.body_timeout.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "--body-timeout: the timeout must be more than 0 seconds"));
        }
        cors_layer(&self.cors_origins).map(|_| ())
    }
}

/// The id a model is served under: the file (or folder) name without `.gguf`.
pub fn model_id_for(engine: &Engine) -> String {
    let src = &engine.lm.source;
    let name = src.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| src.display().to_string());
    name.strip_suffix(".gguf").map(str::to_string).unwrap_or(name)
}

struct AppState {
    /// Served names; the first is the one responses carry.
    names: Vec<String>,
    /// Compiled on the first constrained request (the token trie takes a moment to build).
    grammars: std::sync::OnceLock<Result<grammar::Grammars, String>>,
    /// Hashes of the tool lists (with their call syntax) whose call grammar compiled: agents send the same
    /// tools with every turn, and a list is checked once ([`check_tools`]).
    checked_tools: std::sync::Mutex<std::collections::HashSet<u64>>,
    /// Tokens per row of the model's logits.
    n_logits: usize,
    tokenizer: Tokenizer,
    /// The model's chat template, or ChatML when it has none ([`ChatTemplate::or_chatml`]).
    template: ChatTemplate,
    ctx: usize,
    /// Token ids a prompt may hold: below the vocabulary of both the tokenizer and the model.
    vocab: usize,
    /// Bytes of text that surely hold more tokens than the context ([`surely_too_long`]).
    max_prompt_bytes: usize,
    jobs: std::sync::mpsc::Sender<Job>,
    queue: Arc<Queue>,
    max_body_bytes: usize,
    /// [`ServeOptions::body_timeout`], for the 408's message.
    body_timeout: Duration,
    created: u64,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    keep_alive: Option<Duration>,
}

/// Serves the OpenAI API on `listener` until the listener fails. The engine moves to its own thread.
pub async fn serve(listener: tokio::net::TcpListener, engine: Engine, opts: ServeOptions) -> std::io::Result<()> {
    axum::serve(listener, router(engine, opts)?).await
}

/// Blocking entry point for the CLI: binds `host:port`, builds a Tokio runtime and serves until the first
/// SIGINT or SIGTERM, then drains: no new connections are accepted, the requests in flight (streams included)
/// run to their end, and the call returns `Ok`. A second signal during the drain exits the process at once
/// (status 128 + the signal's number: 130 for SIGINT, 143 for SIGTERM), as llama-server and vLLM do on a
/// repeated Ctrl-C.
pub fn run_blocking(host: &str, port: u16, engine: Engine, opts: ServeOptions) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let id = opts.aliases.first().cloned().unwrap_or_else(|| model_id_for(&engine));
        let ctx = engine.ctx();
        let app = router(engine, opts)?;
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {host}:{port} (--host, --port): {e}")))?;
        eprintln!("eddy serve: model `{id}`, context {ctx} tokens, listening on http://{}", listener.local_addr()?);
        axum::serve(listener, app).with_graceful_shutdown(drain_on_signal()).await?;
        eprintln!("eddy serve: stopped");
        Ok(())
    })
}

/// Resolves on the first SIGINT/SIGTERM (the start of the drain); from then on a second one exits at once.
async fn drain_on_signal() {
    stop_signal().await;
    eprintln!("eddy serve: stopping: finishing the requests in flight, accepting no new ones (signal again to stop now)");
    tokio::spawn(async {
        let signal = stop_signal().await;
        eprintln!("eddy serve: stopped with requests in flight");
        std::process::exit(128 + signal);
    });
}

/// The next SIGINT (Ctrl-C) or, on Unix, SIGTERM, as its number (2 or 15). If a handler cannot be installed
/// the signal keeps its default action (the process ends), so this only waits for the other one.
async fn stop_signal() -> i32 {
    let int = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = int => 2,
        _ = term => 15,
    }
}

/// The axum router with the engine thread started behind it.
pub fn router(mut engine: Engine, opts: ServeOptions) -> std::io::Result<Router> {
    opts.validate()?;
    // Model ids are unique in both APIs: a repeated --alias is listed once.
    let mut names: Vec<String> = Vec::new();
    for a in &opts.aliases {
        if !names.contains(a) {
            names.push(a.clone());
        }
    }
    if names.is_empty() {
        names.push(model_id_for(&engine));
    }
    let cors = cors_layer(&opts.cors_origins)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let metrics = Arc::new(Metrics::default());
    let queue = Queue::new(opts.max_queue, metrics.clone());
    let state = Arc::new(AppState {
        names,
        grammars: std::sync::OnceLock::new(),
        checked_tools: std::sync::Mutex::new(std::collections::HashSet::new()),
        n_logits: engine.lm.model.config.vocab_size,
        tokenizer: engine.lm.tokenizer.clone(),
        template: ChatTemplate::or_chatml(engine.lm.template.take(), &engine.lm.tokenizer),
        ctx: engine.ctx(),
        vocab: engine.lm.tokenizer.vocab_size().min(engine.lm.model.config.vocab_size),
        max_prompt_bytes: engine.lm.tokenizer.max_text_bytes(engine.ctx()),
        jobs: tx,
        queue: queue.clone(),
        max_body_bytes: opts.max_body_bytes,
        body_timeout: opts.body_timeout,
        created: unix_now(),
        next_id: AtomicU64::new(1),
        metrics: metrics.clone(),
        keep_alive: opts.keep_alive.filter(|d| !d.is_zero()),
    });
    worker::spawn(engine, rx, queue, metrics)?;
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        // The same API without the /v1 prefix, as llama-server answers it (clients given a bare host).
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(models))
        .route("/models/{*id}", get(model))
        .route("/v1/responses", post(create_response))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(DefaultBodyLimit::max(opts.max_body_bytes))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(opts.body_timeout))
        .layer(axum::middleware::from_fn_with_state(state.clone(), json_errors))
        .layer(axum::middleware::from_fn_with_state(state.clone(), count_requests))
        .with_state(state);
    // Outermost, so that preflight requests are answered before routing.
    Ok(match cors {
        Some(c) => router.layer(c),
        None => router,
    })
}

/// The CORS layer for `origins` (`*`: any origin), `None` when empty. A malformed origin is an
/// [`std::io::ErrorKind::InvalidInput`] error.
fn cors_layer(origins: &[String]) -> std::io::Result<Option<tower_http::cors::CorsLayer>> {
    use tower_http::cors::{AllowHeaders, AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::from(Any)
    } else {
        let list = origins
            .iter()
            .map(|o| {
                let bad = || {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("--cors-origin: `{o}` is not an origin (`*` or scheme://host[:port], e.g. http://localhost:3000)"),
                    )
                };
                let o = o.trim_end_matches('/');
                if !is_origin(o) {
                    return Err(bad());
                }
                axum::http::HeaderValue::from_str(o).map_err(|_| bad())
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            // The headers the preflight asks for, echoed: `*` never covers `Authorization` (Fetch
            // standard), which every OpenAI client sends.
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(Duration::from_secs(600)),
    ))
}

/// Whether `o` is a serialized origin as browsers send it in `Origin` (RFC 6454): `scheme://host[:port]` with
/// an http(s) or other scheme, a host, no user info, path, query or fragment. Anything else could never
/// match a request, so `--cors-origin` refuses it instead of silently allowing nothing.
fn is_origin(o: &str) -> bool {
    let Ok(uri) = o.parse::<axum::http::Uri>() else { return false };
    let (Some(scheme), Some(auth)) = (uri.scheme_str(), uri.authority()) else { return false };
    !scheme.is_empty()
        && !auth.host().is_empty()
        && !auth.as_str().contains('@')
        && uri.path_and_query().is_none_or(|pq| pq.as_str().is_empty() || pq.as_str() == "/")
        && !o.contains('#')
}

/// The 400 for a prompt whose text (`bytes` long) is longer than [`AppState::max_prompt_bytes`], worded as the
/// counted case (OpenAI's `context_length_exceeded`).
fn surely_too_long(st: &AppState, what: &str, bytes: usize) -> Option<ApiError> {
    (bytes > st.max_prompt_bytes).then(|| {
        ApiError::invalid(
            Some(what),
            format!("This model's maximum context length is {} tokens. However, the {what} text is {bytes} bytes long, more than that many tokens can hold. Please reduce the length of the {what}.", st.ctx),
        )
        .with_status(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded"))
    })
}

/// Status code counted for a request whose client left before its answer was ready (nginx's "client
/// closed request"; no response is sent).
const CLIENT_CLOSED: u16 = 499;

/// Counts every request by endpoint and status: answered ones with their status, those whose client
/// disconnected before the answer (axum then drops the handler) as [`CLIENT_CLOSED`].
async fn count_requests(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    /// Counts the request as [`CLIENT_CLOSED`] if dropped before the answer.
    struct Unanswered<'a>(&'a metrics::Metrics, &'static str, bool);
    impl Drop for Unanswered<'_> {
        fn drop(&mut self) {
            if !self.2 {
                self.0.request(self.1, CLIENT_CLOSED);
            }
        }
    }
    let endpoint = metrics::endpoint_label(req.uri().path());
    let mut guard = Unanswered(&st.metrics, endpoint, false);
    let resp = next.run(req).await;
    guard.2 = true;
    st.metrics.request(endpoint, resp.status().as_u16());
    resp
}

/// Turns every error response that is not JSON (axum's own rejections: body too large, unreadable body)
/// into an OpenAI error object with the same status.
async fn json_errors(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let models_route = path.starts_with("/v1/models") || path.starts_with("/models");
    let anthropic = path.starts_with("/v1/messages") || (models_route && from_anthropic_client(req.headers()));
    // A compressed body would be read as bytes that are not JSON: refused by name instead (vLLM and
    // llama.cpp do not decompress request bodies either).
    let encoding = req.headers().get(header::CONTENT_ENCODING).filter(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if let Some(enc) = encoding {
        let enc = String::from_utf8_lossy(enc.as_bytes()).into_owned();
        let e = ApiError::invalid(None, format!("Content-Encoding `{enc}` is not supported: send the request body uncompressed"))
            .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", None);
        if anthropic {
            let (status, v) = anthropic::error(&e);
            return (status, Json(v)).into_response();
        }
        return e.into_response();
    }
    let mut resp = next.run(req).await;
    if models_route {
        // The models routes answer in the shape anthropic-version asks for: caches must keep them apart.
        resp.headers_mut().append(header::VARY, header::HeaderValue::from_static("anthropic-version"));
    }
    let status = resp.status();
    let json = resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    if json && anthropic {
        // An OpenAI error object from a fallback (404, 405) on Anthropic's routes: in Anthropic's shape, its
        // headers (Allow, Retry-After, Vary) kept.
        let (mut parts, body) = resp.into_parts();
        let body = axum::body::to_bytes(body, 64 << 10).await.unwrap_or_default();
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        if v["type"] == "error" {
            return Response::from_parts(parts, Body::from(body));
        }
        let message = v["error"]["message"].as_str().unwrap_or(status.canonical_reason().unwrap_or("error")).to_string();
        let (status, v) = anthropic::error(&ApiError::invalid(None, message).with_status(status, "invalid_request_error", None));
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.status = status;
        return Response::from_parts(parts, Body::from(v.to_string()));
    }
    if json {
        return resp;
    }
    let (message, code) = if status == StatusCode::PAYLOAD_TOO_LARGE {
        let limit = st.max_body_bytes;
        (format!("the request body is larger than this server's limit of {limit} bytes"), Some("request_too_large"))
    } else {
        let body = axum::body::to_bytes(resp.into_body(), 64 << 10).await.unwrap_or_default();
        let text = String::from_utf8_lossy(&body).trim().to_string();
        let reason = status.canonical_reason().unwrap_or("error");
        (if text.is_empty() { reason.to_string() } else { text }, None)
    };
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    let e = ApiError::invalid(None, message).with_status(status, kind, code);
    if anthropic {
        // Anthropic's routes answer in Anthropic's error shape, these too.
        let (status, v) = anthropic::error(&e);
        return (status, Json(v)).into_response();
    }
    e.into_response()
}

/// A request body read whole (axum's [`Bytes`] extractor), except that a body whose bytes stopped arriving
/// for [`ServeOptions::body_timeout`] is answered 408 Request Timeout (axum's own rejection is a 400 that
/// names no cause the client can act on). Other rejections are axum's, made error objects by [`json_errors`].
struct RequestBody(Bytes);

impl axum::extract::FromRequest<Arc<AppState>> for RequestBody {
    type Rejection = Response;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<Self, Response> {
        let rejection = match Bytes::from_request(req, st).await {
            Ok(b) => return Ok(RequestBody(b)),
            Err(r) => r,
        };
        // The timeout layer's error, under axum's buffering error and its boxes.
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&rejection);
        while let Some(e) = cause {
            if e.is::<tower_http::timeout::TimeoutError>() {
                let secs = st.body_timeout.as_secs_f64();
                let e = ApiError::invalid(None, format!("no bytes of the request body arrived for {secs} s: the request timed out"))
                    .with_status(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", Some("request_timeout"));
                return Err(e.into_response());
            }
            cause = e.source();
        }
        Err(rejection.into_response())
    }
}

async fn prometheus(State(st): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render()).into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
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

/// `POST /tokenize` (llama-server's and vLLM's): the token ids of `content` (or `prompt`), their `count`
/// and the context length (`max_model_len`); with `with_pieces` each token is `{id, piece}`, the piece its
/// text, or its bytes when they are not valid UTF-8 alone (as llama-server). Tokenized on the blocking pool.
async fn tokenize(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Json<Value>, ApiError> {
    let s = st.clone();
    let run = move || -> Result<Value, ApiError> {
        let t = api::parse_tokenize(&api::parse_object(&body)?)?;
        // A text that cannot be a prompt is not tokenized (the work and memory grow with its length).
        if let Some(e) = surely_too_long(&s, "content", t.text.len()) {
            return Err(e);
        }
        let ids = s.tokenizer.encode(&t.text, t.add_special).map_err(|e| ApiError::invalid(None, e.to_string()))?;
        let tokens: Vec<Value> = match t.with_pieces {
            false => ids.iter().map(|&id| json!(id)).collect(),
            true => ids
                .iter()
                .map(|&id| {
                    let t = TokenText::new(&s.tokenizer, id);
                    match String::from_utf8(t.bytes) {
                        Ok(piece) => json!({"id": id, "piece": piece}),
                        Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                    }
                })
                .collect(),
        };
        Ok(json!({"tokens": tokens, "count": ids.len(), "max_model_len": s.ctx}))
    };
    let v = tokio::task::spawn_blocking(run).await.map_err(|e| server_error(format!("tokenizing failed: {e}")))??;
    Ok(Json(v))
}

/// `POST /detokenize`: the text of `tokens` (special tokens included), as `content` (llama-server) and
/// `prompt` (vLLM).
async fn detokenize(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Json<Value>, ApiError> {
    let s = st.clone();
    let run = move || -> Result<Value, ApiError> {
        let ids = api::parse_detokenize(&api::parse_object(&body)?, s.vocab)?;
        let text = s.tokenizer.decode(&ids, false).map_err(|e| ApiError::invalid(Some("tokens"), e.to_string()))?;
        Ok(json!({"content": text, "prompt": text}))
    };
    let v = tokio::task::spawn_blocking(run).await.map_err(|e| server_error(format!("detokenizing failed: {e}")))??;
    Ok(Json(v))
}

/// The model object of served name `id`: OpenAI's fields, and the context length (`context_length`, and
/// vLLM's `max_model_len`).
fn model_object(st: &AppState, id: &str) -> Value {
    json!({"id": id, "object": "model", "created": st.created, "owned_by": "eddy",
           "context_length": st.ctx, "max_model_len": st.ctx})
}

/// Whether a request comes from an Anthropic client (its SDKs send `anthropic-version` on every request):
/// `/v1/models` then answers in Anthropic's shapes.
fn from_anthropic_client(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

async fn models(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    if from_anthropic_client(&headers) {
        return match anthropic::model_page(&st.names, st.created, st.ctx, &q) {
            Ok(v) => Json(v).into_response(),
            Err(e) => anthropic_error(e),
        };
    }
    let data: Vec<Value> = st.names.iter().map(|n| model_object(&st, n)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn model(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let anthropic = from_anthropic_client(&headers);
    if st.names.contains(&id) {
        let v = if anthropic { anthropic::model_info(&id, st.created, st.ctx) } else { model_object(&st, &id) };
        return Json(v).into_response();
    }
    let e = ApiError::invalid(
        Some("model"),
        format!("the model `{}` does not exist; this server serves {}", api::shown(&id), st.names.join(", ")),
    )
    .with_status(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"));
    if anthropic {
        return anthropic_error(e);
    }
    e.into_response()
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn chat_completions(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Response {
    handle(st, Kind::Chat, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Response {
    handle(st, Kind::Text, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// A text completion's prompts, each tokenized (BOS added when the model wants one, or as a fill-in-the-middle
/// prompt with `suffix`), with whether the tokenizer put a BOS first.
fn text_prompts(st: &AppState, o: &serde_json::Map<String, Value>) -> Result<Vec<(Vec<u32>, bool)>, ApiError> {
    let suffix = api::parse_suffix(o)?;
    let mut out = Vec::new();
    for p in api::parse_prompts(o, st.vocab)? {
        out.push(match (p, &suffix) {
            (api::Prompt::Tokens(ids), None) => (ids, false),
            (api::Prompt::Tokens(_), Some(_)) => {
                return Err(ApiError::invalid(Some("suffix"), "suffix needs the prompt as text (the text before the gap), not token ids"))
            }
            (api::Prompt::Text(text), suffix) => {
                if let Some(e) = surely_too_long(st, "prompt", text.len() + suffix.as_ref().map_or(0, String::len)) {
                    return Err(e);
                }
                let bad = |e: eddy::Error| ApiError::invalid(Some("prompt"), e.to_string());
                match suffix {
                    None => {
                        let ids = st.tokenizer.encode(&text, true).map_err(bad)?;
                        let bos = st.tokenizer.add_bos && st.tokenizer.bos_id.is_some() && ids.first() == st.tokenizer.bos_id.as_ref();
                        (ids, bos)
                    }
                    // Fill in the middle: the model writes what goes between the prompt and the suffix.
                    Some(suffix) => {
                        let ids = st.tokenizer.fim_prompt(&text, suffix).map_err(bad)?.ok_or_else(|| {
                            ApiError::invalid(
                                Some("suffix"),
                                "suffix needs a fill-in-the-middle model (one whose vocabulary has FIM tokens such as <|fim_prefix|>); this one has none",
                            )
                        })?;
                        (ids, false)
                    }
                }
            }
        });
    }
    Ok(out)
}

/// Every string leaf of `v` passed through [`eddy::chat::defang`] (those without special-token text kept).
fn defang_leaves(tok: &eddy::tokenizer::Tokenizer, v: &mut Value) {
    match v {
        Value::String(s) => {
            if let Some(d) = eddy::chat::defang(tok, s) {
                *s = d;
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| defang_leaves(tok, x)),
        Value::Object(m) => m.values_mut().for_each(|x| defang_leaves(tok, x)),
        _ => {}
    }
}

/// Parses and validates a request body, renders the chat template and tokenizes the prompt, and compiles
/// its grammar: the CPU-heavy part of a request, run off the async workers.
///
/// `count_only` (`/v1/messages/count_tokens`): the prompt is only counted, so a conversation longer than
/// the context is counted too (clients count to decide when to compact one) instead of refused.
fn prepare(st: &AppState, kind: Kind, body: &[u8], count_only: bool) -> Result<Prepared, ApiError> {
    let o = api::parse_object(body)?;
    let common = api::parse_common(&o, kind == Kind::Chat)?;
    api::check_logit_bias(&common.sampler, st.vocab)?;
    let schema = api::parse_response_format(&o)?;
    let mut thinking = None;
    let mut calls = None;
    let mut grammar: Option<(&'static str, String)> = None;
    let prompt = match kind {
        Kind::Chat => {
            let messages = api::parse_messages(&o)?;
            let mut kwargs = api::parse_kwargs(&o)?;
            api::apply_reasoning_effort(&o, &mut kwargs)?;
            let tools = api::parse_tools(&o)?;
            // The tools reach the prompt whatever tool_choice says (vLLM's default for `none`: the model
            // knows them and answers in text); only the other choices read calls back.
            if let Some(tools) = &tools {
                kwargs.insert("tools".into(), tools.json.clone());
            }
            let t = &st.template;
            let made_calls = |m: &Value| m.get("tool_calls").is_some_and(|c| c.as_array().is_some_and(|a| !a.is_empty()));
            // A template without a call syntax eddy knows gets the generic one ([`tools::generic_messages`]):
            // the conversation is rewritten for it whenever it has tools or past calls (with tool_choice
            // `none` too, so that the model still sees them), inside `render` so that the defanged rendering
            // is rewritten alike.
            let known = tools::Family::of_template(t.source());
            let past_calls = messages.iter().any(|m| m["role"] == "tool" || made_calls(m));
            let generic = (known.is_none() && (tools.is_some() || past_calls))
                .then(|| (tools.as_ref().map_or(api::ToolChoice::None, |t| t.choice.clone()), tools.as_ref().is_none_or(|t| t.parallel)));
            let tools = tools.filter(|t| t.choice != api::ToolChoice::None);
            if let Some(tools) = &tools {
                let family = known.unwrap_or(tools::Family::Generic { json: schema.is_some() });
                if schema.is_some() && tools.choice != api::ToolChoice::Auto {
                    return Err(ApiError::invalid(
                        Some("response_format"),
                        "response_format cannot be combined with a tool_choice that forces a call",
                    ));
                }
                check_each_tool(st, tools)?;
                let g = family.call_grammar(tools, schema.as_ref(), |name| st.tokenizer.token_id(name));
                if family.is_generic() || matches!(tools.choice, api::ToolChoice::Required | api::ToolChoice::Named(_)) {
                    grammar = Some(("tools", g.map_err(|e| ApiError::invalid(Some("tools"), e))?));
                } else if let Ok(g) = g {
                    check_tools(st, &g)?;
                }
                calls = Some(Calls {
                    family,
                    parallel: tools.parallel,
                    names: tools.tools.iter().map(|t| t.name.clone()).collect(),
                    forced: matches!(tools.choice, api::ToolChoice::Required | api::ToolChoice::Named(_)),
                });
            }
            // An assistant message last is continued (the reply extends it), as vLLM's and
            // llama-server's prefill of the assistant turn; one that made tool calls is a finished turn
            // (vLLM renders it and opens a new one: its results may still be coming).
            let continued = messages.last().is_some_and(|m| m["role"] == "assistant" && !made_calls(m));
            if continued && calls.as_ref().is_some_and(|c| c.family.is_generic()) {
                let at = format!("messages[{}]", messages.len() - 1);
                return Err(ApiError::invalid(
                    Some(&at),
                    format!("{at}: a last assistant message cannot be continued with tools on this model: its chat template has no tool-call syntax, so every reply is one JSON object (eddy's generic tool format) that cannot extend that text"),
                ));
            }
            let render = |messages: &[Value], kwargs: &serde_json::Map<String, Value>| {
                let rewritten;
                let messages = match &generic {
                    Some((choice, parallel)) => {
                        rewritten = tools::generic_messages(messages, kwargs.get("tools"), choice, *parallel);
                        &rewritten[..]
                    }
                    None => messages,
                };
                if continued {
                    t.render_continue_json(messages, kwargs)
                } else {
                    t.render_json(messages, true, kwargs)
                }
            };
            let text = render(&messages, &kwargs).map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
            thinking = reasoning::thinking_mode(t, &messages, &kwargs, &text);
            // What users and tools wrote is text, whatever special-token spelling it holds.
            let mut untrusted = Vec::new();
            for m in &messages {
                if let Some(m) = m.as_object() {
                    m.iter().filter(|(k, _)| k.as_str() != "role").for_each(|(_, v)| api::string_leaves(v, &mut untrusted));
                }
            }
            if let Some(tools) = kwargs.get("tools") {
                api::string_leaves(tools, &mut untrusted);
            }
            if let Some(e) = surely_too_long(st, "messages", text.len()).filter(|_| !count_only) {
                return Err(e);
            }
            // Where they hold special-token text, the conversation rendered again with it defanged: the
            // template's markup told apart by position.
            let render_defanged = || {
                let defang_all = |v: &mut Value| defang_leaves(&st.tokenizer, v);
                let mut dm = messages.clone();
                for m in dm.iter_mut().filter_map(|m| m.as_object_mut()) {
                    m.iter_mut().filter(|(k, _)| k.as_str() != "role").for_each(|(_, v)| defang_all(v));
                }
                let mut dk = kwargs.clone();
                if let Some(tools) = dk.get_mut("tools") {
                    defang_all(tools);
                }
                render(&dm, &dk).ok()
            };
            encode_chat_guarded(&st.tokenizer, &text, &untrusted, render_defanged)
                .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?
        }
        Kind::Text => Vec::new(),
    };
    // (prompt tokens, a BOS the tokenizer added) of each prompt: one for chat, one or more for text.
    let prompts = match kind {
        Kind::Chat => vec![(prompt, false)],
        Kind::Text => text_prompts(st, &o)?,
    };
    let what = if kind == Kind::Chat { "messages" } else { "prompt" };
    let mut job_prompts = Vec::with_capacity(prompts.len());
    let many = prompts.len() > 1;
    for (i, (ids, bos_added)) in prompts.into_iter().enumerate() {
        let name = if many { format!("{what}[{i}]") } else { what.to_string() };
        if ids.is_empty() {
            return Err(ApiError::invalid(Some(what), format!("the {name} is empty")));
        }
        // The engine needs a prompt strictly shorter than the context; `max_tokens` beyond the room left
        // is clamped to it (the reply then ends with finish_reason `length`), as llama-server does.
        if ids.len() >= st.ctx && !count_only {
            return Err(ApiError::invalid(
                Some(what),
                format!("This model's maximum context length is {} tokens. However, the {name} came to {} tokens, leaving no room for the completion. Please reduce the length of the {what}.", st.ctx, ids.len()),
            )
            .with_status(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")));
        }
        let room = st.ctx.saturating_sub(ids.len());
        let max_tokens = common.max_tokens.map_or(room, |m| m.min(room));
        job_prompts.push(JobPrompt { ids, max_tokens, echo_skip: bos_added as usize });
    }
    if grammar.is_none() {
        if let Some(schema) = &schema {
            grammar = Some(("response_format", schema_grammar(schema)?));
            // The reply is the requested JSON (the grammar leaves no room for call markup): a JSON
            // object that happens to look like a call is content, as vLLM reads it.
            calls = None;
        }
    }
    let mask = match grammar {
        None => None,
        Some((param, g)) => {
            let gs = st
                .grammars
                .get_or_init(|| grammar::Grammars::new(&st.tokenizer, st.n_logits))
                .as_ref()
                .map_err(|e| ApiError::invalid(Some(param), format!("structured output is not available for this model: {e}")))?;
            let c = gs.lark(g).map_err(|e| match param {
                "tools" => tools_error(gs, schema.as_ref(), &e),
                _ => ApiError::invalid(Some(param), grammar_error(param, &e)),
            })?;
            // A grammar failing before the reply's first free choice ([`grammar::Constraint::early_failure`])
            // is a 400 before any byte of the reply (a streamed reply could only report it after its 200).
            if let Some(e) = c.early_failure() {
                let e = compiler_message(&e);
                return Err(ApiError::invalid(Some(param), format!("invalid {param}: its grammar failed before the first token: {e}")));
            }
            Some((c, param))
        }
    };
    // Every choice is a generation of up to max_tokens: their number is bounded as the prompts' is.
    if job_prompts.len() * common.n > api::MAX_PROMPTS {
        return Err(ApiError::invalid(
            Some("n"),
            format!("{} prompts × n = {} choices: at most {} choices per request", job_prompts.len(), common.n, api::MAX_PROMPTS),
        ));
    }
    // `n` choices per prompt, prompt by prompt; each samples with its own seed and constraint state.
    let choices = (0..job_prompts.len() * common.n)
        .map(|i| Choice {
            prompt: i / common.n,
            seed: common.sampler.seed.wrapping_add((i % common.n) as u64),
            mask: mask.as_ref().map(|(c, param)| (Box::new(c.clone()) as Box<dyn eddy::sampling::LogitMask>, *param)),
        })
        .collect();
    Ok(Prepared { common, prompts: job_prompts, thinking, calls, choices })
}

/// With `tool_choice` `auto` no grammar constrains the reply, but the tools' schemas are checked as a forced
/// call would check them: `g` (the call grammar of every tool) is compiled once per distinct list, so a
/// malformed schema is a 400 with `auto` as with the forced choices (which compile it anyway). With `none` the
/// tools only reach the prompt and are not checked.
fn check_tools(st: &AppState, g: &str) -> Result<(), ApiError> {
    // Without grammars for this model (no end-of-sequence token) only the forced choices are refused.
    let Ok(gs) = st.grammars.get_or_init(|| grammar::Grammars::new(&st.tokenizer, st.n_logits)).as_ref() else {
        return Ok(());
    };
    once_per_grammar(st, "list", g, || gs.lark(g.to_string()).map(|_| ()).map_err(|e| tools_error(gs, None, &e)))
}

/// `check` for the grammar `g` (of the kind `kind`) unless it passed before: the outcome of a passed check is
/// kept in [`AppState::checked_tools`] (at most 1,024 entries; then it starts over).
fn once_per_grammar(st: &AppState, kind: &str, g: &str, check: impl FnOnce() -> Result<(), ApiError>) -> Result<(), ApiError> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (kind, g).hash(&mut h);
    let key = h.finish();
    if st.checked_tools.lock().unwrap_or_else(|e| e.into_inner()).contains(&key) {
        return Ok(());
    }
    check()?;
    let mut seen = st.checked_tools.lock().unwrap_or_else(|e| e.into_inner());
    if seen.len() >= 1024 {
        seen.clear();
    }
    seen.insert(key);
    Ok(())
}

/// Each tool's arguments grammar compiled alone and its first steps probed
/// ([`grammar::Constraint::early_failure`]), once per distinct schema: a tool whose grammar fails lazily (a
/// pattern too large for the lexer) would fail only when a reply reaches it, after the 200 of a stream and
/// perhaps after a valid call of another tool; found here, it is a 400 before the reply that names the tool.
fn check_each_tool(st: &AppState, tools: &api::Tools) -> Result<(), ApiError> {
    let Ok(gs) = st.grammars.get_or_init(|| grammar::Grammars::new(&st.tokenizer, st.n_logits)).as_ref() else {
        return Ok(());
    };
    for (i, t) in tools.tools.iter().enumerate() {
        let g = schema_grammar(&t.parameters)?;
        let name = format!("tools[{i}].function.parameters (`{}`)", t.name);
        once_per_grammar(st, "tool", &g, || {
            let c = gs.lark(g.clone()).map_err(|e| ApiError::invalid(Some("tools"), grammar_error(&name, &e)))?;
            match c.early_failure() {
                Some(e) => Err(ApiError::invalid(
                    Some("tools"),
                    format!("invalid {name}: its grammar failed before the first token: {}", compiler_message(&e)),
                )),
                None => Ok(()),
            }
        })?;
    }
    Ok(())
}

/// The Lark grammar of JSON matching `schema`, with [`tools::grammar_options`] where the schema's own
/// `x-guidance` leaves them out.
fn schema_grammar(schema: &Value) -> Result<String, ApiError> {
    let mut s = schema.clone();
    grammar::close_objects(&mut s);
    if let Some(o) = s.as_object_mut() {
        // The schema's own `x-guidance` options (llguidance's) are kept; eddy's defaults fill in the ones
        // it leaves out.
        let g = o.entry("x-guidance").or_insert(json!({}));
        if let (Some(g), Value::Object(d)) = (g.as_object_mut(), tools::grammar_options()) {
            for (k, v) in d {
                g.entry(k).or_insert(v);
            }
        }
    }
    let text = serde_json::to_string(&s).map_err(|e| ApiError::invalid(Some("response_format"), e.to_string()))?;
    Ok(format!("start: body\nbody: %json {text}\n"))
}

/// The 400 message for a grammar of `param` that the compiler refused (`e`), without the grammar's listing
/// and the position in it that llguidance adds (the grammar is eddy's wrapper, not what the client sent);
/// for a `response_format` schema, with how to set the llguidance option the message names, where it names
/// one.
fn grammar_error(param: &str, e: &str) -> String {
    let hint = if param == "response_format" && e.contains("lenient") {
        " (to let unsupported keywords through unchecked, add \"x-guidance\": {\"lenient\": true} at the top level of the schema)"
    } else {
        ""
    };
    format!("invalid {param}: {}{hint}", compiler_message(e))
}

/// llguidance's message `e` on one line, without what describes eddy's wrapper grammar rather than the
/// client's schema: the listing of the grammar (`   2 | body: %json …` and its `^` marker), the position in it
/// (`at 2(7): `) and the parser state it appends to a failure (`<state>…`). The other lines (a regex
/// error's pattern and reason) are kept, joined by spaces.
fn compiler_message(e: &str) -> String {
    let e = e.split("<state>").next().unwrap_or("");
    let listing = |l: &str| {
        let t = l.trim_start();
        let digits = t.len() - t.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        (digits > 0 && t[digits..].starts_with(" |")) || (!t.is_empty() && t.chars().all(|c| c == '^' || c == ' '))
    };
    let text = e.lines().filter(|l| !listing(l)).map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ");
    // `at 2(7): …`: a line and column of the wrapper grammar.
    text.strip_prefix("at ").and_then(|r| r.split_once("): ")).map_or(text.clone(), |(_, rest)| rest.to_string())
}

/// The 400 for a call grammar of tools that the compiler refused (`e`): the `response` schema (a
/// `response_format`'s, in the generic format's grammar) when it fails alone, else [`grammar_error`]'s for
/// `tools`. A tool whose schema fails alone never gets here: [`check_each_tool`] names it first.
fn tools_error(gs: &grammar::Grammars, response: Option<&Value>, e: &str) -> ApiError {
    match response.and_then(|schema| schema_grammar(schema).ok().and_then(|g| gs.lark(g).err())) {
        Some(e) => ApiError::invalid(Some("response_format"), grammar_error("response_format", &e)),
        None => ApiError::invalid(Some("tools"), grammar_error("tools", e)),
    }
}

/// A chat request with tools: how to read the calls back.
#[derive(Clone)]
struct Calls {
    family: tools::Family,
    parallel: bool,
    /// The tools' names (calls written bare must name one).
    names: Vec<String>,
    /// `tool_choice` forces a call: the reply is call markup under a grammar, never content, and its
    /// last call may be cut (by the token limit or a stop string) whatever the finish reason.
    forced: bool,
}

/// A validated request, its prompt tokenized.
struct Prepared {
    common: Common,
    prompts: Vec<JobPrompt>,
    thinking: Option<Start>,
    calls: Option<Calls>,
    /// `n` per prompt, prompt by prompt.
    choices: Vec<Choice>,
}

/// How a reply is written: OpenAI's chat or text completions, Anthropic's Messages, or OpenAI's Responses
/// (`echo`: the request fields a response repeats). Each names the served model as chat does.
enum Dialect {
    OpenAi,
    Anthropic,
    Responses { echo: serde_json::Map<String, Value> },
}

/// Validate, tokenize (on the blocking pool), queue, and answer (whole or streamed).
async fn handle(st: Arc<AppState>, kind: Kind, body: Bytes) -> Result<Response, ApiError> {
    answer(st, kind, body, Dialect::OpenAi).await
}

/// [`handle`] in either dialect.
async fn answer(st: Arc<AppState>, kind: Kind, body: Bytes, dialect: Dialect) -> Result<Response, ApiError> {
    let s = st.clone();
    let Prepared { common, prompts, thinking, calls, choices } = tokio::task::spawn_blocking(move || prepare(&s, kind, &body, false))
        .await
        .map_err(|e| server_error(format!("preparing the request failed: {e}")))??;
    let Some(slot) = st.queue.admit() else {
        return Err(ApiError::invalid(None, "the server is busy: the request queue is full; retry later").with_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("queue_full"),
        ));
    };
    let guard = SlotGuard(slot.clone());
    let (tx, rx) = mpsc::unbounded_channel();
    let n_choices = choices.len();
    let input_tokens = prompts.first().map_or(0, |p| p.ids.len());
    let job = Job {
        prompts,
        params: GenerateParams { max_tokens: 0, sampler: common.sampler.clone(), ignore_eos: false, logprobs: common.logprobs },
        stops: common.stops.clone(),
        end_text: if kind == Kind::Chat { st.template.end_text().map(str::to_string) } else { None },
        tx,
        queued_at: Instant::now(),
        slot,
        choices,
        keep_special: calls.as_ref().is_some_and(|c| c.family.keeps_special_tokens()),
        cache_prompt: common.cache_prompt,
        echo: common.echo,
    };
    if st.jobs.send(job).is_err() {
        return Err(server_error("the engine thread has stopped".into()));
    }
    // The reply's receiver travels with the guard: a client that leaves drops both, which frees a
    // queued job's place at once and cancels a running one.
    let rx = Reply { rx, _slot: guard };
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let fmt = Formatter {
        kind,
        id: format!("{}-{:x}{:06x}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, unix_now(), n),
        created: unix_now(),
        model: st.names[0].clone(),
        include_usage: common.include_usage,
        thinking,
        logprobs: common.logprobs.is_some(),
        calls,
        n: common.n,
        choices: n_choices,
    };
    match (common.stream, dialect) {
        (true, Dialect::OpenAi) => Ok(stream_response(fmt, rx, st.keep_alive, None)),
        (true, Dialect::Anthropic) => {
            let events = Events::Anthropic(anthropic::EventStream::new(fmt.model.clone(), input_tokens));
            Ok(stream_response(fmt, rx, st.keep_alive, Some(events)))
        }
        (true, Dialect::Responses { echo }) => {
            Ok(stream_response(fmt, rx, st.keep_alive, Some(Events::Responses(Box::new(responses::EventStream::new(echo))))))
        }
        (false, Dialect::OpenAi) => Ok(Json(whole_response(fmt, rx).await?).into_response()),
        (false, Dialect::Anthropic) => {
            let model = fmt.model.clone();
            Ok(Json(anthropic::from_chat(&whole_response(fmt, rx).await?, &model)).into_response())
        }
        (false, Dialect::Responses { echo }) => Ok(Json(responses::from_chat(&whole_response(fmt, rx).await?, &echo)).into_response()),
    }
}

/// `POST /v1/responses`: OpenAI's Responses API, answered through the chat path ([`responses`]).
async fn create_response(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Response, ApiError> {
    let mut req = responses::to_chat(&api::parse_object(&body)?)?;
    // The served model, whatever the request named (as chat completions report it).
    req.echo.insert("model".into(), json!(st.names[0]));
    // Errors of the chat request at the client's items, in the Responses API's names.
    let client_error = |e: ApiError, origins: &[String]| e.at_origins(origins).renamed(&responses::RENAMES);
    if req.echo["truncation"] == "auto" {
        let (s, mut chat, mut origins) = (st.clone(), req.chat, req.origins);
        (req.chat, req.origins) = tokio::task::spawn_blocking(move || {
            truncate_to_fit(&s, &mut chat, &mut origins).map_err(|e| client_error(e, &origins))?;
            Ok::<_, ApiError>((chat, origins))
        })
        .await
        .map_err(|e| server_error(format!("truncating the input failed: {e}")))??;
    }
    let chat = Bytes::from(serde_json::to_vec(&req.chat).map_err(|e| server_error(e.to_string()))?);
    let origins = req.origins;
    answer(st, Kind::Chat, chat, Dialect::Responses { echo: req.echo }).await.map_err(|e| client_error(e, &origins))
}

/// The Responses API's `truncation: "auto"`: when the prompt of `chat` (a chat request) does not fit the
/// context, its first messages are dropped, the fewest that make it fit; system messages (instructions,
/// system and developer items) are kept wherever they are. `origins` (the messages' places in the client's
/// request) lose the same entries.
///
/// The kept part starts at a message boundary that keeps no tool message whose call was dropped: at a user
/// message when one fits, else at an assistant message (its calls with their outputs after it), unless the
/// template refuses such a start. With `max_tokens` (the client's `max_output_tokens`) the kept part leaves
/// that room for the reply where some start does; otherwise it only has to fit the prompt. Nothing is
/// dropped when the prompt fits (with that room, when some start gives it), or when no start fits (the chat
/// path then refuses the request as too long).
///
/// Each try renders and counts the prompt, as the chat path does: a kept part whose message text alone is
/// longer than [`AppState::max_prompt_bytes`] cannot fit and is never tried, and [`first_fit`] searches from
/// the end, so that the text tokenized stays within a few times that of the answer.
fn truncate_to_fit(st: &AppState, chat: &mut Value, origins: &mut Vec<String>) -> Result<(), ApiError> {
    let Some(messages) = chat.get_mut("messages").and_then(Value::as_array_mut).map(std::mem::take) else { return Ok(()) };
    // The rest of the request, without its messages: each try serializes it with the kept ones.
    let rest = std::mem::take(chat);
    let kept = |from: usize| -> Vec<usize> { (0..messages.len()).filter(|&i| i >= from || messages[i]["role"] == "system").collect() };
    // A try's prompt tokens; `None` when it is longer than the context (or the template refuses it, at
    // an assistant start: `lenient`).
    let count = |from: usize, lenient: bool| -> Result<Option<usize>, ApiError> {
        #[derive(serde::Serialize)]
        struct Try<'a> {
            #[serde(flatten)]
            rest: &'a Value,
            messages: Vec<&'a Value>,
        }
        let body = serde_json::to_vec(&Try { rest: &rest, messages: kept(from).into_iter().map(|i| &messages[i]).collect() })
            .map_err(|e| server_error(e.to_string()))?;
        match prepare(st, Kind::Chat, &body, false) {
            Ok(p) => Ok(p.prompts.first().map(|p| p.ids.len())),
            Err(e) if e.code == Some("context_length_exceeded") || lenient => Ok(None),
            Err(e) => Err(e),
        }
    };
    let result = (|| {
        let ctx = st.ctx;
        let room = rest["max_tokens"].as_u64().map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX));
        // Bytes of text each start keeps: the system messages' and those of the messages from it on.
        let bytes: Vec<usize> = messages.iter().map(message_text_bytes).collect();
        let system: usize = messages.iter().zip(&bytes).filter(|(m, _)| m["role"] == "system").map(|(_, b)| b).sum();
        let mut after = vec![system; messages.len() + 1];
        for i in (0..messages.len()).rev() {
            after[i] = after[i + 1] + if messages[i]["role"] == "system" { 0 } else { bytes[i] };
        }
        let with_room = |n: usize| room < ctx && n + room <= ctx;
        let whole = if after[0] <= st.max_prompt_bytes { count(0, false)? } else { None };
        if whole.is_some_and(with_room) || (whole.is_some() && room >= ctx) {
            return Ok(None);
        }
        let first = messages.iter().position(|m| m["role"] != "system").unwrap_or(messages.len());
        let valid = valid_starts(&messages);
        let starts = |role: &str| -> Vec<usize> {
            (first + 1..messages.len()).filter(|&i| valid[i] && messages[i]["role"] == role && after[i] <= st.max_prompt_bytes).collect()
        };
        let mut counted = std::collections::HashMap::new();
        let mut count_once = |from: usize, lenient: bool| -> Result<Option<usize>, ApiError> {
            if let Some(&n) = counted.get(&from) {
                return Ok(n);
            }
            let n = count(from, lenient)?;
            counted.insert(from, n);
            Ok(n)
        };
        let roles = [(starts("user"), false), (starts("assistant"), true)];
        // Room for the reply first (a user start, then an assistant one), then the prompt alone (unless the
        // whole request fits it).
        for (alone, wanted) in [(false, room < ctx), (true, whole.is_none())] {
            for (starts, lenient) in roles.iter().filter(|_| wanted) {
                let fits = |k: usize| Ok(count_once(starts[k], *lenient)?.is_some_and(|n| alone || with_room(n)));
                if let Some(k) = first_fit(starts.len(), |k| after[starts[k]], fits)? {
                    return Ok(Some(starts[k]));
                }
            }
        }
        Ok(None)
    })();
    *chat = rest;
    let from = result?;
    let keep = from.map_or_else(|| (0..messages.len()).collect(), kept);
    if from.is_some() {
        *origins = keep.iter().filter_map(|&i| origins.get(i).cloned()).collect();
    }
    let mut messages = messages;
    chat["messages"] =
        if from.is_some() { keep.into_iter().map(|i| std::mem::take(&mut messages[i])).collect() } else { Value::Array(messages) };
    Ok(())
}

/// Bytes of the text a message's content holds (its strings; the role and tool-call ids left out): a
/// rendering of the message is at least about that long.
fn message_text_bytes(m: &Value) -> usize {
    let mut leaves = Vec::new();
    api::string_leaves(&m["content"], &mut leaves);
    leaves.iter().map(|s| s.len()).sum()
}

/// Whether each message may start the kept part of a truncated conversation: it is no system or tool
/// message, and no tool message from it on answers a call made before it (an orphaned output).
fn valid_starts(messages: &[Value]) -> Vec<bool> {
    // The message that made each call id (the last such before the output).
    let mut made: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    // Starts in (call, output] would orphan the output: counted by a difference array.
    let mut cut = vec![0i64; messages.len() + 1];
    for (i, m) in messages.iter().enumerate() {
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            if let Some(id) = c["id"].as_str() {
                made.insert(id, i);
            }
        }
        if m["role"] == "tool" {
            if let Some(&c) = m["tool_call_id"].as_str().and_then(|id| made.get(id)) {
                cut[c + 1] += 1;
                cut[i + 1] -= 1;
            }
        }
    }
    let mut open = 0;
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            open += cut[i];
            open == 0 && m["role"] != "system" && m["role"] != "tool"
        })
        .collect()
}

/// The first of `n` candidates (ordered from the longest kept text to the shortest) for which `fits` holds,
/// given that it holds from some candidate on. Searched from the end: back from the last candidate, each try
/// keeping at least twice the text (`bytes(k)`) of the one before, until one does not fit; then a binary
/// search between the two. So the text tried stays within a small multiple of the answer's (plus the
/// longest single candidate step), whatever the length of the whole.
fn first_fit(
    n: usize,
    bytes: impl Fn(usize) -> usize,
    mut fits: impl FnMut(usize) -> Result<bool, ApiError>,
) -> Result<Option<usize>, ApiError> {
    if n == 0 || !fits(n - 1)? {
        return Ok(None);
    }
    // `hi` fits; then, once a try does not fit, everything before `lo` does not either.
    let mut hi = n - 1;
    let mut lo = loop {
        if hi == 0 {
            return Ok(Some(0));
        }
        // The latest candidate before `hi` keeping at least twice its text.
        let want = bytes(hi).saturating_mul(2).max(1);
        let k = (0..hi).rev().find(|&k| bytes(k) >= want).unwrap_or(0);
        if fits(k)? {
            hi = k;
        } else {
            break k + 1;
        }
    };
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(Some(hi))
}

/// `POST /v1/messages`: Anthropic's Messages API, answered through the chat path ([`anthropic`]); errors
/// in Anthropic's shape.
async fn messages(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Response {
    let r = async {
        let req = anthropic::to_chat(&api::parse_object(&body)?)?;
        let chat = Bytes::from(serde_json::to_vec(&req.chat).map_err(|e| server_error(e.to_string()))?);
        // Errors of the chat request at the client's messages and blocks, in the Messages API's names.
        let origins = req.origins;
        answer(st, Kind::Chat, chat, Dialect::Anthropic).await.map_err(|e| e.at_origins(&origins).renamed(&anthropic::RENAMES))
    };
    r.await.unwrap_or_else(anthropic_error)
}

/// `e` in Anthropic's shape, with `Retry-After` on a 503 as OpenAI's errors have it.
fn anthropic_error(e: ApiError) -> Response {
    let (status, v) = anthropic::error(&e);
    let mut r = (status, Json(v)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
    }
    r
}

/// `POST /v1/messages/count_tokens`: the prompt tokens a Messages request would have (`input_tokens`).
async fn count_tokens(State(st): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Response {
    let r = async {
        let mut o = api::parse_object(&body)?;
        // A count needs no max_tokens.
        if o.get("max_tokens").is_none_or(Value::is_null) {
            o.insert("max_tokens".into(), json!(1));
        }
        let req = anthropic::to_chat(&o)?;
        let chat = serde_json::to_vec(&req.chat).map_err(|e| server_error(e.to_string()))?;
        let s = st.clone();
        let p = tokio::task::spawn_blocking(move || prepare(&s, Kind::Chat, &chat, true))
            .await
            .map_err(|e| server_error(format!("preparing the request failed: {e}")))?
            .map_err(|e| e.at_origins(&req.origins).renamed(&anthropic::RENAMES))?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": p.prompts.first().map_or(0, |p| p.ids.len())})).into_response())
    };
    r.await.unwrap_or_else(anthropic_error)
}

/// The engine's events for one request, and the request's place in the queue (given back when this is
/// dropped, if the engine thread has not taken the job yet).
struct Reply {
    rx: mpsc::UnboundedReceiver<Event>,
    _slot: SlotGuard,
}

/// Builds the OpenAI JSON objects of one request.
struct Formatter {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Thinking mode of a chat request: `<think>` text goes to `reasoning_content`.
    thinking: Option<Start>,
    /// The request asked for log-probabilities.
    logprobs: bool,
    /// A chat request with tools: tool calls are read out of the text.
    calls: Option<Calls>,
    /// Choices asked for per prompt (OpenAI's `n`).
    n: usize,
    /// Choices in all: `n` for each prompt.
    choices: usize,
}

/// The statistics of a request's choices together: each prompt's tokens and cached tokens counted once
/// (from its first choice), the first choice's TTFT and prefill, the decoding counts and times summed.
#[derive(Default)]
struct Totals {
    stats: GenerationStats,
    completion_tokens: usize,
    choices: usize,
}

impl Totals {
    /// Adds the next choice (`n` choices per prompt, prompt by prompt).
    fn add(&mut self, s: GenerationStats, completion_tokens: usize, n: usize) {
        self.completion_tokens += completion_tokens;
        self.choices += 1;
        if self.choices == 1 {
            self.stats = s;
            return;
        }
        let t = &mut self.stats;
        if (self.choices - 1).is_multiple_of(n) {
            t.prompt_tokens += s.prompt_tokens;
            t.cached_tokens += s.cached_tokens;
        }
        t.generated_tokens += s.generated_tokens;
        t.decode_passes += s.decode_passes;
        t.decode_time += s.decode_time;
        t.duration += s.duration;
        t.draft_tokens += s.draft_tokens;
        t.draft_accepted += s.draft_accepted;
    }
}

/// The OpenAI `usage` object, with `prompt_tokens_details.cached_tokens` (prefix cache) and
/// `spec_verify_ct` (target forward passes while decoding).
fn usage(s: &GenerationStats, completion: usize) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": s.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        "spec_verify_ct": s.decode_passes,
    })
}

/// llama-server's `timings` object: `prompt_n` counts the prompt tokens actually prefilled, `cache_n`
/// those reused from the prefix cache; `draft_n` / `draft_n_accepted` count speculation drafts. The
/// decode rate is eddy's: the tokens after the first over the time from the first to the last
/// (`predicted_per_second` and `predicted_per_token_ms` are reciprocals); llama-server divides all
/// `predicted_n` tokens by that time, about one token's worth faster on short replies.
fn timings(s: &GenerationStats, completion_tokens: usize) -> Value {
    let prompt_n = s.prompt_tokens.saturating_sub(s.cached_tokens);
    let prompt_ms = s.ttft.as_secs_f64() * 1e3;
    let predicted_ms = s.decode_time.as_secs_f64() * 1e3;
    let per = |n: usize, ms: f64| if n > 0 { ms / n as f64 } else { 0.0 };
    json!({
        "cache_n": s.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per(prompt_n, prompt_ms),
        "prompt_per_second": if prompt_ms > 0.0 { prompt_n as f64 * 1e3 / prompt_ms } else { 0.0 },
        "predicted_n": completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per(s.generated_tokens.saturating_sub(1), predicted_ms),
        "predicted_per_second": s.generation_speed(),
        "draft_n": s.draft_tokens,
        "draft_n_accepted": s.draft_accepted,
    })
}

impl Formatter {
    /// The `logprobs` of a choice holding the tokens `lps` (null when not asked for). Chat:
    /// `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`; completions:
    /// `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (offsets in characters
    /// of the completion text). `bytes` are the token's raw bytes; a token that is not valid UTF-8 alone
    /// reads `bytes:\xf0\x9f` ([`TokenText`]).
    fn logprobs(&self, lps: &[Logprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let entry = |t: &TokenText, l: Option<f32>| json!({"token": t.text, "logprob": l, "bytes": t.bytes});
                let content: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let mut e = entry(&l.token, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|(t, v)| entry(t, Some(*v))).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Text => {
                let text_offset: Vec<usize> = lps.iter().map(|l| l.offset).collect();
                // An echoed prompt's first token: null log-probability and alternatives (OpenAI's legacy API).
                let top: Vec<Value> = lps
                    .iter()
                    .map(|l| match l.logprob {
                        None => Value::Null,
                        Some(_) => Value::Object(l.top.iter().map(|(t, v)| (t.text.clone(), json!(v))).collect()),
                    })
                    .collect();
                json!({
                    "tokens": lps.iter().map(|l| l.token.text.as_str()).collect::<Vec<_>>(),
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": text_offset,
                })
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    /// Choice `index` of a whole reply; `stop`: the stop string that ended it (vLLM's `stop_reason`).
    fn choice(&self, index: usize, text: String, lps: &[Logprob], finish: &str, stop: Option<String>) -> Value {
        let logprobs = self.logprobs(lps);
        match self.kind {
            Kind::Chat => {
                let mut finish = finish;
                let (text, reasoning) = match self.thinking {
                    Some(start) => {
                        let mut sp = ReasoningSplitter::new(start);
                        let (a, b) = (sp.push(&text), sp.finish());
                        (a.content + &b.content, a.reasoning + &b.reasoning)
                    }
                    None => (text, String::new()),
                };
                let mut message = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                if let Some(c) = &self.calls {
                    // Cut off (by the token limit or a stop string), the last call is kept as streamed.
                    let cut = c.forced || finish == "length" || stop.is_some();
                    let (content, mut calls) = c.family.parse_reply(&text, &c.names, cut);
                    if !c.parallel {
                        calls.truncate(1);
                    }
                    // The generic format's reply is never content as written (its JSON is the format's).
                    if !calls.is_empty() || c.forced || c.family.is_generic() {
                        message["content"] = json!(if c.forced { None } else { content });
                        let complete = calls.last().is_some_and(|(_, a)| complete_arguments(a));
                        if !calls.is_empty() {
                            message["tool_calls"] = calls
                                .into_iter()
                                .map(|(name, args)| json!({"id": c.family.call_id(), "type": "function", "function": {"name": name, "arguments": args}}))
                                .collect();
                        }
                        if finish == "stop" && complete {
                            finish = "tool_calls";
                        }
                    }
                }
                json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop})
            }
            Kind::Text => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop})
            }
        }
    }

    /// A whole reply of `choices` (from [`Formatter::choice`]).
    fn whole(&self, choices: Vec<Value>, t: &Totals) -> Value {
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": choices,
            "usage": usage(&t.stats, t.completion_tokens),
            "timings": timings(&t.stats, t.completion_tokens),
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

    /// A chat chunk whose delta is `reasoning_content`.
    fn reasoning_chunk(&self, text: &str) -> Value {
        let mut v = self.chunk(false, None, None);
        v["choices"][0]["delta"] = json!({"reasoning_content": text});
        v
    }

    fn usage_chunk(&self, stats: &GenerationStats, completion_tokens: usize) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [],
               "usage": usage(stats, completion_tokens)})
    }
}

async fn whole_response(fmt: Formatter, mut rx: Reply) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut choices = Vec::with_capacity(fmt.choices);
    let mut totals = Totals::default();
    while let Some(ev) = rx.rx.recv().await {
        match ev {
            Event::Delta(t, l) => {
                text.push_str(&t);
                lps.extend(l);
            }
            Event::Done { finish, stop, completion_tokens, stats } => {
                choices.push(fmt.choice(choices.len(), std::mem::take(&mut text), &std::mem::take(&mut lps), finish, stop));
                totals.add(stats, completion_tokens, fmt.n);
                if choices.len() == fmt.choices {
                    return Ok(fmt.whole(choices, &totals));
                }
            }
            Event::Error(e) => return Err(server_error(e)),
            Event::Invalid { param, message } => return Err(ApiError::invalid(Some(param), message)),
        }
    }
    Err(server_error("the engine dropped the request".into()))
}

/// Whether a call's arguments text is a whole JSON object (not cut off by the token limit or a stop
/// string): only then is the finish reason `tool_calls`.
fn complete_arguments(args: &str) -> bool {
    serde_json::from_str::<Value>(args).is_ok_and(|v| v.is_object())
}

fn server_error(msg: String) -> ApiError {
    ApiError::invalid(None, msg).with_status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None)
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response(fmt: Formatter, rx: Reply, keep_alive: Option<Duration>, events: Option<Events>) -> Response {
    let role = (fmt.kind == Kind::Chat).then(|| fmt.chunk(true, Some(""), None));
    let calls = fmt.calls.as_ref().map(|c| CallStreamer::new(c.family, c.names.clone()));
    let body = SseBody {
        splitter: fmt.thinking.map(ReasoningSplitter::new),
        fmt,
        rx,
        queued: VecDeque::new(),
        finished: false,
        keep_alive: keep_alive.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
        keep_alive_period: keep_alive,
        lp_pending: Vec::new(),
        calls,
        n_calls: 0,
        last_args: String::new(),
        skipping: false,
        choice: 0,
        totals: Totals::default(),
        events,
    };
    let mut body = body;
    if let Some(role) = role {
        body.emit(&role);
    }
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
    rx: Reply,
    queued: VecDeque<Bytes>,
    finished: bool,
    /// Period and timer of the keep-alive comments; dropped at the first text.
    keep_alive: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
    /// The keep-alive period, to re-arm the comments while a later choice's prompt is prefilled.
    keep_alive_period: Option<Duration>,
    /// Thinking mode: splits the text into reasoning and content.
    splitter: Option<ReasoningSplitter>,
    /// Log-probabilities not yet sent (their text is held back by the reasoning splitter).
    lp_pending: Vec<Logprob>,
    /// A chat request with tools: reads the calls out of the content.
    calls: Option<CallStreamer>,
    /// Tool calls sent so far.
    n_calls: usize,
    /// The arguments text sent for the last call.
    last_args: String,
    /// The current call is dropped (a second call when `parallel_tool_calls` is false).
    skipping: bool,
    /// The choice being streamed (choices come one after another).
    choice: usize,
    /// The finished choices' statistics.
    totals: Totals,
    /// Anthropic's Messages or OpenAI's Responses API: the chunks become their events.
    events: Option<Events>,
}

/// The events of a streamed reply in a wire format other than chat completions' chunks.
enum Events {
    Anthropic(anthropic::EventStream),
    Responses(Box<responses::EventStream>),
}

impl Events {
    fn push(&mut self, v: &Value) -> Vec<Bytes> {
        match self {
            Events::Anthropic(a) => a.push(v),
            Events::Responses(r) => r.push(v),
        }
    }
}

const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

impl SseBody {
    fn split_chunks(&mut self, s: Split) -> Vec<Value> {
        let mut out = Vec::new();
        if !s.reasoning.is_empty() {
            out.push(self.fmt.reasoning_chunk(&s.reasoning));
        }
        if !s.content.is_empty() {
            out.extend(self.content_chunks(&s.content));
        }
        out
    }

    /// Chunks for content text: content deltas, and with tools the calls read out of it (OpenAI's
    /// `delta.tool_calls`: a call's index, id and name first, then its arguments).
    fn content_chunks(&mut self, text: &str) -> Vec<Value> {
        let Some(cs) = self.calls.as_mut() else {
            return vec![self.fmt.chunk(false, Some(text), None)];
        };
        let pieces = cs.push(text);
        self.piece_chunks(pieces)
    }

    fn piece_chunks(&mut self, pieces: Vec<tools::Piece>) -> Vec<Value> {
        let parallel = self.fmt.calls.as_ref().is_none_or(|c| c.parallel);
        let mut out = Vec::new();
        for p in pieces {
            match p {
                // A forced call's markup (a call cut before its name was read) is never content.
                tools::Piece::Content(_) if self.fmt.calls.as_ref().is_some_and(|c| c.forced) => {}
                tools::Piece::Content(c) => out.push(self.fmt.chunk(false, Some(&c), None)),
                tools::Piece::Call(name) => {
                    self.skipping = !parallel && self.n_calls > 0;
                    if self.skipping {
                        continue;
                    }
                    self.last_args.clear();
                    let index = self.n_calls;
                    self.n_calls += 1;
                    let id = self.fmt.calls.as_ref().map(|c| c.family.call_id()).unwrap_or_default();
                    let mut head = self.fmt.chunk(false, None, None);
                    head["choices"][0]["delta"] = json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]});
                    out.push(head);
                }
                tools::Piece::Args(args) => {
                    if self.skipping || args.is_empty() || self.n_calls == 0 {
                        continue;
                    }
                    self.last_args.push_str(&args);
                    let mut body = self.fmt.chunk(false, None, None);
                    body["choices"][0]["delta"] = json!({"tool_calls": [{"index": self.n_calls - 1, "function": {"arguments": args}}]});
                    out.push(body);
                }
            }
        }
        out
    }

    /// Queue `chunks` (of the current choice), the last one carrying the log-probabilities not yet sent.
    fn queue(&mut self, mut chunks: Vec<Value>) {
        for c in &mut chunks {
            c["choices"][0]["index"] = json!(self.choice);
        }
        if let Some(last) = chunks.last_mut() {
            if self.fmt.logprobs {
                let lps = std::mem::take(&mut self.lp_pending);
                last["choices"][0]["logprobs"] = self.fmt.logprobs(&lps);
            }
        }
        for c in &chunks {
            self.emit(c);
        }
    }

    fn on_event(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::Delta(t, lps)) => {
                self.keep_alive = None;
                self.lp_pending.extend(lps);
                let chunks = match self.splitter.as_mut() {
                    Some(sp) => {
                        let s = sp.push(&t);
                        self.split_chunks(s)
                    }
                    None => self.content_chunks(&t),
                };
                self.queue(chunks);
            }
            Some(Event::Done { finish, stop, completion_tokens, stats }) => {
                if let Some(s) = self.splitter.as_mut().map(ReasoningSplitter::finish) {
                    let chunks = self.split_chunks(s);
                    self.queue(chunks);
                }
                if let Some(pieces) = self.calls.as_mut().map(CallStreamer::finish) {
                    let chunks = self.piece_chunks(pieces);
                    self.queue(chunks);
                }
                let finish =
                    if self.n_calls > 0 && finish == "stop" && complete_arguments(&self.last_args) { "tool_calls" } else { finish };
                let mut last = self.fmt.chunk(false, None, Some(finish));
                last["choices"][0]["index"] = json!(self.choice);
                last["choices"][0]["stop_reason"] = json!(stop);
                if self.fmt.kind == Kind::Chat {
                    last["choices"][0]["delta"] = json!({});
                }
                last["timings"] = timings(&stats, completion_tokens);
                if !self.lp_pending.is_empty() {
                    let lps = std::mem::take(&mut self.lp_pending);
                    last["choices"][0]["logprobs"] = self.fmt.logprobs(&lps);
                }
                self.emit(&last);
                self.totals.add(stats, completion_tokens, self.fmt.n);
                if self.totals.choices < self.fmt.choices {
                    self.next_choice();
                    return;
                }
                let f = &self.fmt;
                if f.include_usage {
                    let usage = f.usage_chunk(&self.totals.stats, self.totals.completion_tokens);
                    self.emit(&usage);
                }
                self.finish();
            }
            Some(Event::Error(e)) => {
                self.emit(&server_error(e).body());
                self.finish();
            }
            Some(Event::Invalid { param, message }) => {
                self.emit(&ApiError::invalid(Some(param), message).body());
                self.finish();
            }
            None => {
                self.emit(&server_error("the engine dropped the request".into()).body());
                self.finish();
            }
        }
    }

    /// The next choice starts: the per-choice state from scratch, and a chat choice's first chunk (its role).
    fn next_choice(&mut self) {
        self.choice += 1;
        self.keep_alive = self.keep_alive_period.map(|d| (d, Box::pin(tokio::time::sleep(d))));
        self.splitter = self.fmt.thinking.map(ReasoningSplitter::new);
        self.calls = self.fmt.calls.as_ref().map(|c| CallStreamer::new(c.family, c.names.clone()));
        self.lp_pending.clear();
        self.n_calls = 0;
        self.last_args.clear();
        self.skipping = false;
        if self.fmt.kind == Kind::Chat {
            let mut role = self.fmt.chunk(true, Some(""), None);
            role["choices"][0]["index"] = json!(self.choice);
            self.emit(&role);
        }
    }

    /// Queues `v` (a chunk or an error object) as OpenAI's `data:` line, or as Anthropic's events.
    fn emit(&mut self, v: &Value) {
        match self.events.as_mut() {
            Some(e) => self.queued.extend(e.push(v)),
            None => self.queued.push_back(sse(v)),
        }
    }

    fn finish(&mut self) {
        if self.events.is_none() {
            self.queued.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        }
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
            match this.rx.rx.poll_recv(cx) {
                Poll::Ready(ev) => this.on_event(ev),
                Poll::Pending => {
                    if let Some((period, timer)) = this.keep_alive.as_mut() {
                        if timer.as_mut().poll(cx).is_ready() {
                            let next = tokio::time::Instant::now() + *period;
                            timer.as_mut().reset(next);
                            return Poll::Ready(Some(Ok(Bytes::from_static(KEEP_ALIVE))));
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cors_origins_are_checked() {
        for ok in ["http://localhost:3000", "https://app.example", "http://127.0.0.1:8080", "http://[::1]:5173"] {
            assert!(is_origin(ok), "{ok}");
        }
        for bad in ["localhost:3000", "app.example", "http://", "http://a/b", "http://a?x=1", "http://u@a", "http://a#f", "", "null"] {
            assert!(!is_origin(bad), "{bad}");
        }
        assert!(cors_layer(&["http://localhost:3000/".into()]).is_ok());
        let e = cors_layer(&["localhost:3000".into()]).unwrap_err().to_string();
        assert!(e.contains("--cors-origin") && e.contains("not an origin"), "{e}");
    }

    /// Compiler messages keep what is about the client's schema (a regex error's reason on its later
    /// lines) and lose eddy's wrapper grammar (its listing, the position in it, the parser state).
    #[test]
    fn compiler_messages_lose_the_wrapper_grammar() {
        let listing = "at 2(7): failed to compile JSON schema: Invalid type: strin\n   1 | start: body\n   2 | body: %json {\"type\": \"strin\"}\n             ^\n";
        assert_eq!(compiler_message(listing), "failed to compile JSON schema: Invalid type: strin");
        let regex = "at 2(7): failed to compile JSON schema: regex parse error:\n    (?<=a)b\n    ^^^^\nerror: look-around is not supported\n   1 | start: body\n";
        assert_eq!(
            compiler_message(regex),
            "failed to compile JSON schema: regex parse error: (?<=a)b error: look-around is not supported"
        );
        let state = "lexer error: too many expressions constructed\n<state>\nTokens: ⟦\"⟧\n</state><grammar>\n\n</grammar>";
        assert_eq!(compiler_message(state), "lexer error: too many expressions constructed");
    }

    /// The search for the first start that fits tries text within a small multiple of the answer's, however
    /// long the conversation: 3,000 turns of 4 KB each, of which the last 30 fit.
    #[test]
    fn first_fit_tries_bounded_text() {
        let (n, turn, fit) = (3000usize, 4400usize, 30usize);
        let bytes = |k: usize| (n - k) * turn;
        let mut tried = Vec::new();
        let found = first_fit(n, bytes, |k| {
            tried.push(k);
            Ok(n - k <= fit)
        })
        .unwrap();
        assert_eq!(found, Some(n - fit));
        let text: usize = tried.iter().map(|&k| bytes(k)).sum();
        assert!(text <= 8 * fit * turn && tried.len() < 20, "tried {tried:?}: {text} bytes");
        // All fit, none fits, no candidates.
        assert_eq!(first_fit(5, |k| 5 - k, |_| Ok(true)).unwrap(), Some(0));
        assert_eq!(first_fit(5, |k| 5 - k, |_| Ok(false)).unwrap(), None);
        assert_eq!(first_fit(0, |_| 0, |_| Ok(true)).unwrap(), None);
        for answer in 0..7 {
            assert_eq!(first_fit(7, |k| 1 << (7 - k), |k| Ok(k >= answer)).unwrap(), Some(answer), "answer {answer}");
        }
    }

    /// A start is refused inside a call and its output (the output would be kept without its call), and at
    /// system and tool messages.
    #[test]
    fn valid_starts_orphan_no_output() {
        let call = |id: &str| json!({"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let out = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "r"});
        let user = json!({"role": "user", "content": "u"});
        let system = json!({"role": "system", "content": "s"});
        let m = [user.clone(), call("a"), user.clone(), out("a"), user.clone(), system, call("b"), out("b"), user];
        assert_eq!(valid_starts(&m), [true, true, false, false, true, false, true, false, true]);
    }
}
