//! `eddy bench` against an in-process `eddy serve` on SmolLM2: the measured numbers agree with what the
//! server itself reports, the JSON run is complete, `--compare` reads runs back and `--plot` draws them;
//! bad options and unreachable endpoints get one error line.

use serde_json::Value;
use std::net::SocketAddr;
use std::process::{Command, Output};

mod common;

fn eddy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eddy")).args(args).output().unwrap()
}

fn start_server(p: &std::path::Path) -> SocketAddr {
    let lm = eddy::load::load_gguf(p, &mut |_, _| {}).unwrap();
    let opts = eddy::engine::EngineOptions { threads: 1, ctx: 1024, ..Default::default() };
    let engine = eddy::engine::Engine::new(lm, &opts);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            eddy_server::serve(l, engine, eddy_server::ServeOptions::default()).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

#[test]
fn bench_measures_an_eddy_server_and_compares_runs() {
    let Some(model) = common::smol() else { return };
    let addr = start_server(&model);
    let endpoint = format!("http://{addr}/v1");
    // An endpoint that is not the API's root (no /v1): the error hints at it.
    let o = eddy(&["bench", "--endpoint", &format!("http://{addr}/api"), "--prompt", "x", "--num", "1", "--warmup", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("is --endpoint missing it?"), "{err}");
    let data = common::tmp("bench", "prompts.jsonl");
    std::fs::write(&data, "{\"prompt\": \"Count from one to twenty in words.\"}\n\"Name the planets of the solar system.\"\n").unwrap();
    let out_a = common::tmp("bench", "a.json");
    let o = eddy(&[
        "bench",
        "--endpoint",
        &endpoint,
        "--dataset",
        data.to_str().unwrap(),
        "--num",
        "2",
        "--max-tokens",
        "16",
        "--warmup",
        "1",
        "--out",
        out_a.to_str().unwrap(),
        "--label",
        "smol-a",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("decode speed (tok/s)") && text.contains("median"), "{text}");
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&out_a).unwrap()).unwrap();
    assert_eq!(run["model"], "SmolLM2-135M-Instruct.Q4_1"); // from /v1/models: no --model given
    assert_eq!(run["label"], "smol-a");
    let reqs = run["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 2);
    for r in reqs {
        let n = r["completion_tokens"].as_u64().unwrap();
        assert!((2..=16).contains(&n), "{r}");
        let ttft = r["ttft_s"].as_f64().unwrap();
        let e2e = r["e2e_s"].as_f64().unwrap();
        assert!(ttft > 0.0 && ttft < e2e, "{r}");
        // Decode speed = (n − 1) ÷ (first → last token), so the decode span fits within the request.
        let tps = r["decode_tps"].as_f64().unwrap();
        assert!((n - 1) as f64 / tps <= e2e - ttft + 1e-3, "{r}");
        // The client's decode speed is the server's own (same tokens, timed at the other end of the socket).
        let server = r["server_decode_tps"].as_f64().unwrap();
        assert!((0.7..1.4).contains(&(tps / server)), "client {tps} vs server {server} tok/s: {r}");
        // No speculation: one token per forward pass (eddy reports spec_verify_ct).
        assert!((r["tokens_per_pass"].as_f64().unwrap() - 1.0).abs() < 1e-9, "{r}");
        assert!(r["prompt_tokens"].as_u64().unwrap() > 5);
    }
    let s = &run["summary"];
    assert_eq!(s["requests"], 2);
    let med = s["decode_tps"]["median"].as_f64().unwrap();
    assert!(s["decode_tps"]["p10"].as_f64().unwrap() <= med && med <= s["decode_tps"]["p90"].as_f64().unwrap());

    // The same prompt twice, greedy: the completion lengths agree with the server's own count.
    let out_b = common::tmp("bench", "b.json");
    let o = eddy(&[
        "bench",
        "--endpoint",
        &endpoint,
        "--model",
        "SmolLM2-135M-Instruct.Q4_1",
        "--prompt",
        "Say hi.",
        "--num",
        "2",
        "--max-tokens",
        "8",
        "--warmup",
        "0",
        "--out",
        out_b.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let b: Value = serde_json::from_str(&std::fs::read_to_string(&out_b).unwrap()).unwrap();
    assert_eq!(b["requests"][0]["completion_tokens"], b["requests"][1]["completion_tokens"]);
    assert_eq!(b["label"], addr.to_string());
    // The repeated prompt is prefilled cold each time (the default): no prefix-cache hit to flatter TTFT.
    for r in b["requests"].as_array().unwrap() {
        assert_eq!(r["cached_tokens"], 0, "{r}");
    }
    assert_eq!(b["summary"]["cache_hits"], 0);
    assert!(b["summary"]["ttft_s"]["n"] == 2 && b["summary"]["ttft_cache_hit_s"].is_null(), "{}", b["summary"]);
    // --warm lets the server reuse its cache; the hits are counted and their TTFT reported apart.
    let out_w = common::tmp("bench", "w.json");
    let o = eddy(&[
        "bench",
        "--endpoint",
        &endpoint,
        "--prompt",
        "Say hi.",
        "--num",
        "2",
        "--max-tokens",
        "4",
        "--warmup",
        "1",
        "--warm",
        "--out",
        out_w.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let w: Value = serde_json::from_str(&std::fs::read_to_string(&out_w).unwrap()).unwrap();
    assert_eq!(w["summary"]["cache_hits"], 2, "{}", w["summary"]);
    assert_eq!(w["summary"]["ttft_cache_hit_s"]["n"], 2);
    assert!(String::from_utf8_lossy(&o.stdout).contains("prefix-cache hit"));
    assert!(String::from_utf8_lossy(&o.stderr).contains("(prefix-cache hit:"));

    let svg = common::tmp("bench", "ab.svg");
    let o = eddy(&["bench", "--compare", out_a.to_str().unwrap(), out_b.to_str().unwrap(), "--plot", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(table.contains("smol-a") && table.contains(&addr.to_string()), "{table}");
    assert!(table.contains("ratios to the first"), "{table}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.starts_with("<svg") && drawn.contains("decode speed (tok/s)"));
    assert_eq!(drawn.matches("<circle").count(), 8, "a dot per request per panel");
}

#[test]
fn bench_option_errors_are_one_line() {
    let notes_path = common::tmp("bench", "notes.txt");
    std::fs::write(&notes_path, "my notes\n").unwrap();
    let bad_path = common::tmp("bench", "bad.jsonl");
    std::fs::write(&bad_path, "\"a\"\nnot json\n").unwrap();
    let (notes, bad_jsonl) = (notes_path.to_str().unwrap(), bad_path.to_str().unwrap());
    let dir = std::env::temp_dir();
    let dir = dir.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--prompt", "x"], "--endpoint: required"),
        (&["bench", "--endpoint", "localhost:1/v1", "--prompt", "x"], "not an http"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--prompt", "x", "--num", "0"], "--num"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--prompt", "x", "--timeout", "0"], "--timeout: invalid value '0'"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"], "--dataset"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--dataset", "/nonexistent/x"], "not humaneval"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--prompt", "x", "--warmup", "0"], "127.0.0.1:9"),
        (&["bench", "--compare", "/nonexistent/a.json"], "cannot read"),
        (&["bench", "--plot", "x.svg"], "--compare"),
        // Outputs are checked before any request, and a user's other files are never overwritten.
        (&["bench", "--compare", "/nonexistent/a.json", "--plot", notes], "not overwritten"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--prompt", "x", "--out", notes], "not overwritten"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--prompt", "x", "--out", dir], "is a directory"),
        (&["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--dataset", bad_jsonl], "line 2 is neither"),
    ];
    for (args, needle) in cases {
        let o = eddy(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        // Progress lines may come first; the error is the last line, and the only one.
        let last = err.lines().last().unwrap_or("");
        assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{args:?}: {err}");
        assert!(last.starts_with("error: ") && last.contains(needle), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read_to_string(&notes_path).unwrap(), "my notes\n");
}

/// The real `eddy serve` binary (with --no-prefix-cache, on an ephemeral port), measured by `eddy bench`.
#[test]
fn serve_binary_with_no_prefix_cache_is_benchmarked() {
    let Some(model) = common::smol() else { return };
    let (mut child, addr, _err) =
        common::spawn_serve(&["--model", model.to_str().unwrap(), "--threads", "1", "--ctx", "512", "--port", "0", "--no-prefix-cache"]);
    let out = common::tmp("bench", "serve.json");
    let o = eddy(&[
        "bench",
        "--endpoint",
        &format!("http://{addr}/v1"),
        "--prompt",
        "Say hi.",
        "--num",
        "2",
        "--max-tokens",
        "4",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
    ]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for r in run["requests"].as_array().unwrap() {
        assert_eq!(r["cached_tokens"], 0, "--no-prefix-cache: {r}");
        assert!(r["completion_tokens"].as_u64().unwrap() >= 1);
    }
}
