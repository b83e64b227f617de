//! End-to-end tests of `eddy serve` against the real SmolLM2-135M-Instruct GGUF: one server per test
//! binary (in-process, ephemeral port), a tiny HTTP/1.1 client over std TcpStream.

use eddy::chat::{encode_chat, ChatMessage};
use eddy::engine::{Engine, EngineOptions, GenerateParams};
use eddy::sampling::SamplerParams;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::OnceLock;

const CTX: usize = 512;

fn model_path() -> Option<PathBuf> {
    if std::env::var("EDDY_SKIP_MODEL_TESTS").is_ok_and(|v| v == "1") {
        return None;
    }
    let p = eddy::load::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run tools/fetch_models.sh smollm2 (or set EDDY_SKIP_MODEL_TESTS=1)",
        p.display()
    );
    Some(p)
}

fn engine(p: &PathBuf) -> Engine {
    let lm = eddy::load::load_gguf(p, &mut |_, _| {}).expect("load model");
    Engine::new(
        lm,
        &EngineOptions {
            threads: 2,
            ctx: CTX,
            max_batch: 256,
        },
    )
}

/// The shared server's address, started on first use (None when model tests are skipped).
fn server() -> Option<SocketAddr> {
    static ADDR: OnceLock<Option<SocketAddr>> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let p = model_path()?;
        let eng = engine(&p);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(l.local_addr().unwrap()).unwrap();
                eddy_server::serve(l, eng, eddy_server::ServeOptions::default())
                    .await
                    .unwrap();
            });
        });
        Some(rx.recv().unwrap())
    })
}

macro_rules! server_or_skip {
    () => {
        match server() {
            Some(a) => a,
            None => return,
        }
    };
}

struct Resp {
    status: u16,
    headers: String,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// One request, whole response (chunked bodies decoded).
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Resp {
    let mut s = send(addr, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no header end");
    let headers = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    let status = headers.split(' ').nth(1).unwrap().parse().unwrap();
    Resp {
        status,
        headers,
        body: String::from_utf8(body).expect("body is not UTF-8"),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: Value) -> Resp {
    request(addr, "POST", path, &body.to_string())
}

/// The `data:` payloads of an SSE body.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("SSE event without data")
                .to_string()
        })
        .collect()
}

fn chat_body(msg: &str, extra: Value) -> Value {
    let mut b =
        json!({"messages": [{"role": "user", "content": msg}], "temperature": 0, "max_tokens": 24});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// Streamed content concatenated, plus all parsed events (without [DONE], which is asserted last).
fn streamed(addr: SocketAddr, path: &str, body: Value) -> (String, Vec<Value>) {
    let r = post(addr, path, body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.to_ascii_lowercase().contains("text/event-stream"));
    let mut ev = sse_events(&r.body);
    assert_eq!(ev.pop().as_deref(), Some("[DONE]"));
    let ev: Vec<Value> = ev
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = ev
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .map(|c| {
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap_or("")
                .to_string()
        })
        .collect();
    (text, ev)
}

const Q: &str = "Name three colors of the rainbow.";

#[test]
fn chat_greedy_matches_engine_generate() {
    let addr = server_or_skip!();
    let r = post(addr, "/v1/chat/completions", chat_body(Q, json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();

    // Reference: the engine directly, same template, greedy.
    let mut e = engine(&model_path().unwrap());
    let t = e.lm.template.as_ref().unwrap();
    let text = t
        .render(
            &[ChatMessage::new("user", Q)],
            true,
            &serde_json::Map::new(),
        )
        .unwrap();
    let prompt = encode_chat(&e.lm.tokenizer, &text).unwrap();
    let params = GenerateParams {
        max_tokens: 24,
        sampler: SamplerParams::default(),
        ignore_eos: false,
    };
    let mut ids = Vec::new();
    let stats = e
        .generate(&prompt, &params, &mut |id| {
            ids.push(id);
            true
        })
        .unwrap();
    let want = e.lm.tokenizer.decode(&ids, true).unwrap();
    assert_eq!(content, want);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["usage"]["completion_tokens"], ids.len());
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + ids.len());
    let finish = if stats.finish == eddy::stats::FinishReason::Stop {
        "stop"
    } else {
        "length"
    };
    assert_eq!(v["choices"][0]["finish_reason"], finish);
    for k in [
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    ] {
        assert!(
            v["timings"][k].is_number(),
            "timings.{k} missing: {}",
            v["timings"]
        );
    }
}

#[test]
fn streamed_chat_equals_whole_with_usage_and_done() {
    let addr = server_or_skip!();
    let whole = post(addr, "/v1/chat/completions", chat_body(Q, json!({}))).json();
    let (text, ev) = streamed(
        addr,
        "/v1/chat/completions",
        chat_body(
            Q,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(ev.iter().all(|e| e["object"] == "chat.completion.chunk"));
    let n = ev.len();
    assert!(n >= 3);
    for e in &ev[..n - 2] {
        assert!(e["choices"][0]["finish_reason"].is_null(), "{e}");
        assert!(e["usage"].is_null());
    }
    assert_eq!(
        ev[n - 2]["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert!(ev[n - 2]["timings"]["predicted_n"].is_number());
    assert_eq!(ev[n - 1]["choices"], json!([]));
    assert_eq!(ev[n - 1]["usage"], whole["usage"]);
}

#[test]
fn completions_whole_and_streamed() {
    let addr = server_or_skip!();
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "model": "SmolLM2-135M-Instruct.Q4_1"});
    let v = post(addr, "/v1/completions", body.clone()).json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let mut sb = body;
    sb["stream"] = json!(true);
    let (st, ev) = streamed(addr, "/v1/completions", sb);
    assert_eq!(st, text);
    assert_eq!(ev.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[test]
fn stop_string_across_tokens_is_not_emitted() {
    let addr = server_or_skip!();
    let whole = post(
        addr,
        "/v1/chat/completions",
        chat_body(Q, json!({"max_tokens": 40})),
    )
    .json();
    let full = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // A stop string made of the middle two words (contains a space, so it spans tokens).
    let words: Vec<&str> = full.split(' ').collect();
    assert!(words.len() >= 5, "reply too short: {full:?}");
    let stop = format!("{} {}", words[2], words[3]);
    let at = full.find(&stop).unwrap();
    let want = &full[..at];
    let v = post(
        addr,
        "/v1/chat/completions",
        chat_body(
            Q,
            json!({"max_tokens": 40, "stop": [stop.clone(), "\u{1}never"]}),
        ),
    )
    .json();
    assert_eq!(v["choices"][0]["message"]["content"], want);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (text, ev) = streamed(
        addr,
        "/v1/chat/completions",
        chat_body(Q, json!({"max_tokens": 40, "stop": stop, "stream": true})),
    );
    assert_eq!(text, want);
    assert_eq!(ev.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

fn assert_error(r: &Resp, status: u16, needle: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(
        e["message"].as_str().unwrap().contains(needle),
        "{:?} lacks {needle:?}",
        e["message"]
    );
    assert!(e["type"].is_string());
    assert!(e.get("param").is_some() && e.get("code").is_some());
    v
}

#[test]
fn errors() {
    let addr = server_or_skip!();
    let c = "/v1/chat/completions";
    assert_error(
        &request(addr, "POST", c, "{\"messages\": ["),
        400,
        "invalid JSON",
    );
    let v = assert_error(
        &post(addr, c, chat_body("hi", json!({"temperature": "hot"}))),
        400,
        "temperature",
    );
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "temperature");
    assert_error(
        &post(addr, c, chat_body("hi", json!({"temperature": 7}))),
        400,
        "temperature",
    );
    assert_error(
        &post(addr, c, chat_body("hi", json!({"max_tokens": -1}))),
        400,
        "max_tokens",
    );
    assert_error(&post(addr, c, json!({"messages": "hi"})), 400, "messages");
    assert_error(
        &post(
            addr,
            c,
            json!({"messages": [{"role": "robot", "content": "hi"}]}),
        ),
        400,
        "robot",
    );
    assert_error(&post(addr, c, chat_body("hi", json!({"n": 2}))), 400, "n=2");
    assert_error(
        &post(
            addr,
            c,
            chat_body("hi", json!({"response_format": {"type": "json_object"}})),
        ),
        400,
        "not supported yet",
    );
    assert_error(
        &post(
            addr,
            c,
            chat_body("hi", json!({"tools": [{"type": "function"}]})),
        ),
        400,
        "not supported yet",
    );
    assert_error(
        &post(addr, c, chat_body("hi", json!({"logprobs": true}))),
        400,
        "not supported yet",
    );
    assert_error(
        &post(addr, c, chat_body("hi", json!({"model": "gpt-4"}))),
        404,
        "gpt-4",
    );
    assert_error(
        &post(addr, "/v1/completions", json!({"prompt": 5})),
        400,
        "prompt",
    );
    // Prompt + max_tokens over the context: both numbers named.
    let long = "word ".repeat(300);
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 400}),
    );
    let v = assert_error(&r, 400, &format!("{CTX}"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("400 in the completion"), "{msg}");
    assert!(msg.contains(" in the prompt"), "{msg}");
    let r = request(addr, "GET", "/v1/nope", "");
    assert_error(&r, 404, "/v1/nope");
    // Unknown fields are ignored; content as text parts; developer role accepted.
    let ok = post(
        addr,
        c,
        json!({"messages": [{"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2, "frobnicate": 1}),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[test]
fn models_and_health() {
    let addr = server_or_skip!();
    let v = request(addr, "GET", "/v1/models", "").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(request(addr, "GET", "/health", "").status, 200);
}

#[test]
fn concurrent_requests_both_answered() {
    let addr = server_or_skip!();
    let a = std::thread::spawn(move || {
        post(addr, "/v1/chat/completions", chat_body(Q, json!({}))).json()
    });
    let b = std::thread::spawn(move || {
        post(
            addr,
            "/v1/chat/completions",
            chat_body("What is 2+2?", json!({})),
        )
        .json()
    });
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    let a2 = post(addr, "/v1/chat/completions", chat_body(Q, json!({}))).json();
    let b2 = post(
        addr,
        "/v1/chat/completions",
        chat_body("What is 2+2?", json!({})),
    )
    .json();
    assert_eq!(a["choices"][0]["message"], a2["choices"][0]["message"]);
    assert_eq!(b["choices"][0]["message"], b2["choices"][0]["message"]);
}

#[test]
fn client_disconnect_mid_stream_does_not_block_the_next_request() {
    let addr = server_or_skip!();
    let s = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &chat_body(
            "Write a long story about a dragon.",
            json!({"max_tokens": 400, "stream": true}),
        )
        .to_string(),
    );
    let mut r = BufReader::new(s);
    let mut seen = 0;
    let mut line = String::new();
    while seen < 3 {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0);
        if line.contains("data: ") {
            seen += 1;
        }
    }
    drop(r); // disconnect mid-stream
    let t = std::time::Instant::now();
    let v = post(
        addr,
        "/v1/chat/completions",
        chat_body("Hi", json!({"max_tokens": 4})),
    )
    .json();
    assert!(v["choices"][0]["message"]["content"].is_string());
    // 400 tokens of the abandoned story would take far longer than this on any machine eddy runs on.
    assert!(t.elapsed().as_secs() < 60);
}

#[test]
fn python_stdlib_streaming_client() {
    let addr = server_or_skip!();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/stream_client.py");
    let out = match std::process::Command::new("python3")
        .arg(script)
        .arg(addr.to_string())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipping: python3 not runnable: {e}");
            return;
        }
    };
    assert!(
        out.status.success(),
        "python client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let whole = post(addr, "/v1/chat/completions", chat_body(Q, json!({}))).json();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

/// A server of its own with --max-queue 1: one job running, one queued, the third is refused with 503.
#[test]
fn full_queue_answers_503() {
    let Some(p) = model_path() else { return };
    let eng = engine(&p);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            eddy_server::serve(
                l,
                eng,
                eddy_server::ServeOptions {
                    max_queue: 1,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        });
    });
    let addr = rx.recv().unwrap();
    let long = json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
    // Wait until the first job is running (its first text chunk arrives), then queue a second.
    let mut first = BufReader::new(send(addr, "POST", "/v1/completions", &long));
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(first.read_line(&mut line).unwrap() > 0);
    }
    let second = send(addr, "POST", "/v1/completions", &long);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 1}),
    );
    assert_error(&r, 503, "queue is full");
    drop(first);
    drop(second);
    // Both abandoned jobs are cancelled or skipped (within a decode step or two): the server answers again.
    let t = std::time::Instant::now();
    loop {
        let r = post(
            addr,
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 1}),
        );
        if r.status == 200 {
            assert_eq!(r.json()["usage"]["completion_tokens"], 1);
            break;
        }
        assert_error(&r, 503, "queue is full");
        assert!(
            t.elapsed().as_secs() < 5,
            "the abandoned jobs still hold the queue after 5 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    eprintln!("queue free again after {:?}", t.elapsed());
}
