//! `eddy bench`: a streaming client for any OpenAI-compatible endpoint (eddy serve, llama-server,
//! mlx_lm.server). Per request: time to first token, decode speed = (completion tokens − 1) ÷ time from
//! the first to the last token, and tokens per forward pass where the server reports `spec_verify_ct`.
//! A summary (median, p10, p90) is printed and written as JSON; `--compare` reads several such files and
//! prints them side by side, `--plot` draws them (SVG).

use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type R<T> = Result<T, String>;

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct BenchArgs {
    /// Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (requests go to
    /// ENDPOINT/chat/completions).
    #[arg(long)]
    endpoint: Option<String>,
    /// Model name sent in each request (default: the first model ENDPOINT/models lists).
    #[arg(long)]
    model: Option<String>,
    /// One prompt, sent --num times.
    #[arg(long, conflicts_with = "dataset", allow_hyphen_values = true)]
    prompt: Option<String>,
    /// Prompts: humaneval, sharegpt (first human turn of each complete conversation), or a FILE (.jsonl of
    /// strings or {"prompt": ...} objects; any other file: one prompt per non-empty line). The two named
    /// sets come from tools/fetch_datasets.sh (~/.cache/eddy/data, $EDDY_DATA overrides).
    #[arg(long)]
    dataset: Option<String>,
    /// Requests to measure (the first N prompts of the dataset, or --prompt N times).
    #[arg(long, default_value_t = 10)]
    num: usize,
    /// max_tokens of each request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Unmeasured requests sent first (with the first prompt).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Sampling temperature of each request (default greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Write the run (every request and the summary) as JSON to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Name of this run in comparisons (default: the endpoint's host and port).
    #[arg(long)]
    label: Option<String>,
    /// Compare runs written by --out (no requests are sent): prints each metric side by side.
    #[arg(long, num_args = 1.., value_name = "RUN.json")]
    compare: Vec<PathBuf>,
    /// With --compare: draw TTFT and decode speed of the runs side by side into this SVG file.
    #[arg(long, requires = "compare")]
    plot: Option<PathBuf>,
    /// Let the server reuse its prefix cache. By default each request asks for a cold prefill
    /// (`cache_prompt: false`, which eddy serve and llama-server honour), so that repeated prompts measure
    /// the time to first token of a cold prompt; requests the server still reports cached tokens for are
    /// counted apart, as prefix-cache hits.
    #[arg(long)]
    warm: bool,
    /// Seconds one request may take before it counts as failed (at least 1).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    timeout: u64,
}

/// One measured request.
#[derive(Debug, Default, Clone)]
struct Sample {
    prompt_tokens: Option<u64>,
    completion_tokens: u64,
    ttft_s: f64,
    decode_tps: Option<f64>,
    e2e_s: f64,
    tokens_per_pass: Option<f64>,
    cached_tokens: Option<u64>,
    finish_reason: Option<String>,
    /// The server's own decode speed (llama-server's `timings.predicted_per_second`, which eddy serve
    /// sends too), to set against the client-side one.
    server_decode_tps: Option<f64>,
}

impl Sample {
    fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "ttft_s": self.ttft_s, "decode_tps": self.decode_tps, "e2e_s": self.e2e_s,
            "tokens_per_pass": self.tokens_per_pass, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason, "server_decode_tps": self.server_decode_tps,
        })
    }
}

pub fn run(a: BenchArgs) -> R<()> {
    if !a.compare.is_empty() {
        if a.endpoint.is_some() || a.prompt.is_some() || a.dataset.is_some() {
            return Err("--compare: reads saved runs; it takes no --endpoint, --prompt or --dataset".into());
        }
        if let Some(p) = &a.plot {
            check_output(
                "--plot",
                p,
                |f| {
                    let mut head = [0u8; 5];
                    let read = std::fs::File::open(f).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head));
                    read.is_ok() && (head.starts_with(b"<svg") || head == *b"<?xml")
                },
                "an SVG file",
            )?;
        }
        return compare(&a.compare, a.plot.as_deref());
    }
    let Some(endpoint) = a.endpoint.as_deref() else {
        return Err("--endpoint: required (e.g. http://127.0.0.1:8000/v1), or --compare RUN.json ...".into());
    };
    let base = endpoint.trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(format!("--endpoint: '{endpoint}' is not an http:// or https:// URL"));
    }
    if let Some(out) = &a.out {
        // Fail before the run, not after it.
        check_output("--out", out, |f| read_run(f).is_ok(), "a run written by eddy bench --out")?;
    }
    if a.num == 0 {
        return Err("--num: must be at least 1".into());
    }
    if a.max_tokens == 0 {
        return Err("--max-tokens: must be at least 1".into());
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(format!("--temperature: must be a number >= 0, got {}", a.temperature));
    }
    let (prompts, dataset) = match (&a.prompt, &a.dataset) {
        (Some(p), _) => (vec![p.clone(); a.num], "prompt".to_string()),
        (None, Some(d)) => (load_dataset(d, a.num)?, d.clone()),
        (None, None) => return Err("give --prompt TEXT or --dataset humaneval|sharegpt|FILE".into()),
    };
    if prompts.is_empty() {
        return Err(format!("--dataset {dataset}: no prompts"));
    }
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(a.timeout))).http_status_as_error(false).build().into();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model(&agent, base)?,
    };
    let label = a.label.clone().unwrap_or_else(|| base.split("//").nth(1).unwrap_or(base).split('/').next().unwrap_or(base).to_string());
    let send = |p: &str| request(&agent, base, &model, p, a.max_tokens, a.temperature, a.warm);
    for i in 0..a.warmup {
        send(&prompts[0]).map_err(|e| format!("warm-up request {}: {e}", i + 1))?;
    }
    eprintln!("eddy bench: {} requests to {base} (model {model}, {dataset}, max_tokens {})", prompts.len(), a.max_tokens);
    let mut samples = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let s = send(p).map_err(|e| format!("request {}: {e}", i + 1))?;
        eprintln!(
            "  {:>3}/{}: ttft {:.3} s{}, {} tokens, decode {}",
            i + 1,
            prompts.len(),
            s.ttft_s,
            match s.cached_tokens {
                Some(c) if c > 0 => format!(" (prefix-cache hit: {c} tokens)"),
                _ => String::new(),
            },
            s.completion_tokens,
            s.decode_tps.map(|t| format!("{t:.2} tok/s")).unwrap_or_else(|| "n/a".into())
        );
        samples.push(s);
    }
    let run = json!({
        "eddy_bench": 1,
        "label": label, "endpoint": base, "model": model, "dataset": dataset,
        "max_tokens": a.max_tokens, "temperature": a.temperature, "warmup": a.warmup, "warm": a.warm,
        "requests": samples.iter().map(Sample::to_json).collect::<Vec<_>>(),
        "summary": summary(&samples),
    });
    println!("{}", summary_text(&run));
    if let Some(out) = &a.out {
        let text = serde_json::to_string_pretty(&run).map_err(|e| e.to_string())?;
        std::fs::write(out, text + "\n").map_err(|e| format!("--out {}: cannot write: {e}", out.display()))?;
    }
    Ok(())
}

/// The first model id of `base`/models; errors name the URL, and hint at `/v1` when `base` lacks it (the
/// usual mistake: `--endpoint http://host:port`).
fn first_model(agent: &ureq::Agent, base: &str) -> R<String> {
    let url = format!("{base}/models");
    let hint = if base.trim_end_matches('/').ends_with("/v1") { "" } else { " (OpenAI endpoints end in /v1: is --endpoint missing it?)" };
    let mut resp = agent.get(&url).call().map_err(|e| format!("{url}: {e}{hint}"))?;
    let v: Value = resp.body_mut().read_json().map_err(|e| format!("{url}: not a JSON model list ({e}); give --model{hint}"))?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| format!("{url}: lists no model; give --model{hint}"))
}

/// One streamed chat completion, timed.
fn request(agent: &ureq::Agent, base: &str, model: &str, prompt: &str, max_tokens: usize, temperature: f64, warm: bool) -> R<Sample> {
    let url = format!("{base}/chat/completions");
    let body = json!({
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": temperature,
        "stream": true, "stream_options": {"include_usage": true},
        "cache_prompt": warm,
    });
    let t0 = Instant::now();
    let resp =
        agent.post(&url).header("Content-Type", "application/json").send(body.to_string().as_bytes()).map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body.read_to_string().unwrap_or_default();
        let msg =
            serde_json::from_str::<Value>(&text).ok().and_then(|v| v["error"]["message"].as_str().map(str::to_string)).unwrap_or(text);
        return Err(format!("{url}: HTTP {status}: {msg}"));
    }
    let mut s = Sample::default();
    let (mut first, mut last, mut chunks) = (None, None, 0u64);
    let mut usage = Value::Null;
    let reader = BufReader::new(body.as_reader());
    for line in reader.lines() {
        let line = line.map_err(|e| format!("{url}: reading the stream: {e}"))?;
        let Some(data) = line.strip_prefix("data:") else { continue }; // blank lines, `: comments`
        let data = data.trim();
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{url}: bad SSE data ({e}): {data}"))?;
        if v.get("error").is_some() {
            return Err(format!("{url}: error in the stream: {}", v["error"]));
        }
        if v["usage"].is_object() {
            usage = v["usage"].clone();
        }
        if let Some(t) = v["timings"]["predicted_per_second"].as_f64() {
            s.server_decode_tps = Some(t);
        }
        let Some(c) = v["choices"].get(0) else { continue };
        let text =
            ["content", "reasoning_content"].iter().filter_map(|k| c["delta"][k].as_str()).chain(c["text"].as_str()).any(|t| !t.is_empty());
        if text {
            let now = Instant::now();
            first.get_or_insert(now);
            last = Some(now);
            chunks += 1;
        }
        if let Some(f) = c["finish_reason"].as_str() {
            s.finish_reason = Some(f.to_string());
        }
    }
    s.e2e_s = t0.elapsed().as_secs_f64();
    let Some(first) = first else {
        return Err(format!("{url}: the stream carried no text"));
    };
    s.ttft_s = (first - t0).as_secs_f64();
    // Token counts from `usage` when the server sends it, else one token per text chunk.
    s.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(chunks);
    s.prompt_tokens = usage["prompt_tokens"].as_u64();
    s.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    let span = last.map_or(0.0, |l| (l - first).as_secs_f64());
    if s.completion_tokens >= 2 && span > 0.0 {
        s.decode_tps = Some((s.completion_tokens - 1) as f64 / span);
    }
    if let Some(passes) = usage["spec_verify_ct"].as_u64().filter(|&p| p > 0) {
        s.tokens_per_pass = Some(s.completion_tokens.saturating_sub(1) as f64 / passes as f64);
    }
    Ok(s)
}

/// The q-quantile (0..1) of sorted values, linearly interpolated.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// {median, p10, p90, mean, n} of the values present; null when there are none.
fn stats(v: impl Iterator<Item = Option<f64>>) -> Value {
    let mut v: Vec<f64> = v.flatten().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    json!({
        "median": quantile(&v, 0.5), "p10": quantile(&v, 0.1), "p90": quantile(&v, 0.9),
        "mean": v.iter().sum::<f64>() / v.len() as f64, "n": v.len(),
    })
}

/// Whether the server reported reusing prompt tokens from its prefix cache for this request.
fn cache_hit(x: &Sample) -> bool {
    x.cached_tokens.is_some_and(|c| c > 0)
}

/// `ttft_s` is the time to first token of the requests prefilled cold (no cached tokens reported);
/// `ttft_cache_hit_s` that of the prefix-cache hits, counted in `cache_hits`.
fn summary(s: &[Sample]) -> Value {
    json!({
        "requests": s.len(),
        "cache_hits": s.iter().filter(|x| cache_hit(x)).count(),
        "ttft_s": stats(s.iter().map(|x| (!cache_hit(x)).then_some(x.ttft_s))),
        "ttft_cache_hit_s": stats(s.iter().map(|x| cache_hit(x).then_some(x.ttft_s))),
        "decode_tps": stats(s.iter().map(|x| x.decode_tps)),
        "e2e_s": stats(s.iter().map(|x| Some(x.e2e_s))),
        "completion_tokens": stats(s.iter().map(|x| Some(x.completion_tokens as f64))),
        "prompt_tokens": stats(s.iter().map(|x| x.prompt_tokens.map(|n| n as f64))),
        "tokens_per_pass": stats(s.iter().map(|x| x.tokens_per_pass)),
        "server_decode_tps": stats(s.iter().map(|x| x.server_decode_tps)),
    })
}

/// The metrics of a summary: JSON key, row title, decimals.
const METRICS: &[(&str, &str, usize)] = &[
    ("ttft_s", "time to first token (s)", 3),
    ("ttft_cache_hit_s", "TTFT, prefix-cache hit (s)", 3),
    ("decode_tps", "decode speed (tok/s)", 2),
    ("tokens_per_pass", "tokens per pass", 2),
    ("server_decode_tps", "server-reported decode", 2),
    ("e2e_s", "request time (s)", 2),
    ("completion_tokens", "completion tokens", 0),
    ("prompt_tokens", "prompt tokens", 0),
];

fn summary_text(run: &Value) -> String {
    let mut t = format!(
        "{} ({} requests, model {}, {})\n{:<26}{:>10}{:>10}{:>10}\n",
        run["label"].as_str().unwrap_or("run"),
        run["summary"]["requests"],
        run["model"].as_str().unwrap_or("?"),
        run["dataset"].as_str().unwrap_or("?"),
        "",
        "median",
        "p10",
        "p90"
    );
    for &(k, title, d) in METRICS {
        let m = &run["summary"][k];
        if m.is_null() {
            continue;
        }
        let f = |q: &str| format!("{:.*}", d, m[q].as_f64().unwrap_or(f64::NAN));
        t += &format!("{title:<26}{:>10}{:>10}{:>10}\n", f("median"), f("p10"), f("p90"));
    }
    t.trim_end().to_string()
}

/// An output path checked before any work: writable, not a directory, and an existing file replaced only
/// when `ours` says it is `what` (an earlier output of the same kind), never a user's other file (such as a
/// `--compare` input named as `--plot`).
fn check_output(flag: &str, p: &Path, ours: impl Fn(&Path) -> bool, what: &str) -> R<()> {
    if p.is_dir() {
        return Err(format!("{flag} {}: is a directory", p.display()));
    }
    // Special files (/dev/null) are written through; a regular file only if it is an earlier output.
    if p.is_file() && !ours(p) {
        return Err(format!("{flag} {}: exists and is not {what}: not overwritten (pick another path)", p.display()));
    }
    crate::check_writable(flag, p).map_err(|e| e.to_string())
}

fn read_run(p: &Path) -> R<Value> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("{}: cannot read: {e}", p.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON ({e})", p.display()))?;
    if v["eddy_bench"].is_null() || !v["summary"].is_object() || !v["requests"].is_array() {
        return Err(format!("{}: not a run written by eddy bench --out", p.display()));
    }
    Ok(v)
}

fn compare(files: &[PathBuf], plot: Option<&Path>) -> R<()> {
    let runs = files.iter().map(|f| read_run(f)).collect::<R<Vec<_>>>()?;
    let name = |r: &Value| r["label"].as_str().unwrap_or("run").to_string();
    let mut t = format!("{:<26}", "median (p10–p90)");
    for r in &runs {
        t += &format!("{:>28}", name(r));
    }
    if runs.len() > 1 {
        t += "   ratios to the first";
    }
    t.push('\n');
    for &(k, title, d) in METRICS {
        if runs.iter().all(|r| r["summary"][k].is_null()) {
            continue;
        }
        t += &format!("{title:<26}");
        let first = runs[0]["summary"][k]["median"].as_f64();
        let mut ratios = Vec::new();
        for r in &runs {
            let m = &r["summary"][k];
            let g = |q: &str| m[q].as_f64();
            t += &match (g("median"), g("p10"), g("p90")) {
                (Some(a), Some(b), Some(c)) => format!("{:>28}", format!("{a:.d$} ({b:.d$}–{c:.d$})")),
                _ => format!("{:>28}", "n/a"),
            };
            ratios.push(match (g("median"), first) {
                (Some(a), Some(f)) if f != 0.0 => format!("{:.2}", a / f),
                _ => "n/a".into(),
            });
        }
        if runs.len() > 1 {
            t += &format!("   {}", ratios[1..].join(" "));
        }
        t.push('\n');
    }
    println!("{}", t.trim_end());
    if let Some(p) = plot {
        draw(&runs, p).map_err(|e| format!("--plot {}: {e}", p.display()))?;
        eprintln!("plot written to {}", p.display());
    }
    Ok(())
}

/// Two panels (TTFT, decode speed): per run, every request as a dot, the median as a bar and the p10–p90
/// range as a whisker.
fn draw(runs: &[Value], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let names: Vec<String> = runs.iter().map(|r| r["label"].as_str().unwrap_or("run").to_string()).collect();
    let palette = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(214, 39, 40)];
    for (panel, (key, title)) in panels.iter().zip([("ttft_s", "time to first token (s)"), ("decode_tps", "decode speed (tok/s)")]) {
        let values: Vec<Vec<f64>> = runs
            .iter()
            .map(|r| r["requests"].as_array().map(|a| a.iter().filter_map(|q| q[key].as_f64()).collect()).unwrap_or_default())
            .collect();
        let top = values.iter().flatten().cloned().fold(0.0f64, f64::max).max(1e-3) * 1.15;
        let n = runs.len();
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..top)?;
        let labels = names.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.max(2) * 2 + 1)
            .x_label_formatter(&move |x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                    labels[i as usize].clone()
                } else {
                    String::new()
                }
            })
            .y_desc(title)
            .draw()?;
        for (i, (r, vals)) in runs.iter().zip(&values).enumerate() {
            let c = palette[i % palette.len()];
            let x = i as f64;
            let s = &r["summary"][key];
            if let (Some(med), Some(lo), Some(hi)) = (s["median"].as_f64(), s["p10"].as_f64(), s["p90"].as_f64()) {
                chart.draw_series([Rectangle::new([(x - 0.3, 0.0), (x + 0.3, med)], c.mix(0.35).filled())])?;
                chart.draw_series([
                    PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(2)),
                    PathElement::new(vec![(x - 0.1, lo), (x + 0.1, lo)], c.stroke_width(2)),
                    PathElement::new(vec![(x - 0.1, hi), (x + 0.1, hi)], c.stroke_width(2)),
                ])?;
            }
            let m = vals.len().max(1) as f64;
            chart.draw_series(
                vals.iter().enumerate().map(|(j, &v)| Circle::new((x - 0.2 + 0.4 * (j as f64 + 0.5) / m, v), 3, c.filled())),
            )?;
        }
    }
    root.present()?;
    Ok(())
}

/// Folder of the benchmark data sets (tools/fetch_datasets.sh writes there).
fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("EDDY_DATA") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    home.join(".cache/eddy/data")
}

fn load_dataset(name: &str, n: usize) -> R<Vec<String>> {
    let named = |file: &str, which: &str| {
        let p = data_dir().join(file);
        if p.is_file() {
            Ok(p)
        } else {
            Err(format!("--dataset {name}: {} is missing; run tools/fetch_datasets.sh {which}", p.display()))
        }
    };
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("--dataset {}: cannot read: {e}", p.display()));
    match name {
        "humaneval" => {
            let p = named("HumanEval.jsonl", "humaneval")?;
            let text = String::from_utf8_lossy(&read(&p)?).into_owned();
            let prompts = jsonl_prompts(&text, n).map_err(|e| format!("--dataset {}: {e}", p.display()))?;
            Ok(prompts.into_iter().map(|p| format!("Complete this Python function:\n\n{p}")).collect())
        }
        "sharegpt" => {
            let p = named("ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt")?;
            Ok(sharegpt_first_turns(&read(&p)?, n))
        }
        file => {
            let p = Path::new(file);
            if !p.is_file() {
                return Err(format!("--dataset {file}: not humaneval, sharegpt or an existing file"));
            }
            let text = String::from_utf8(read(p)?).map_err(|e| format!("--dataset {file}: not UTF-8 text ({e})"))?;
            Ok(if file.ends_with(".jsonl") {
                jsonl_prompts(&text, n).map_err(|e| format!("--dataset {file}: {e}"))?
            } else {
                text.lines().filter(|l| !l.trim().is_empty()).take(n).map(str::to_string).collect()
            })
        }
    }
}

/// The first `n` prompts of a JSONL text: each line a JSON string or an object with a string `prompt` (or
/// `text`); blank lines and empty prompts are skipped, any other line is an error naming it (a prompt
/// silently dropped would change what a run measures).
fn jsonl_prompts(text: &str, n: usize) -> R<Vec<String>> {
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if out.len() == n {
            break;
        }
        if l.trim().is_empty() {
            continue;
        }
        let prompt = match serde_json::from_str::<Value>(l) {
            Ok(Value::String(s)) => Some(s),
            Ok(v) => v.get("prompt").or_else(|| v.get("text")).and_then(Value::as_str).map(str::to_string),
            Err(_) => None,
        };
        match prompt {
            Some(p) if p.trim().is_empty() => {}
            Some(p) => out.push(p),
            None => return Err(format!("line {} is neither a JSON string nor an object with a string prompt (or text)", i + 1)),
        }
    }
    Ok(out)
}

/// The first human turn of the first `n` complete conversations of a ShareGPT JSON array, read element by
/// element so that a file cut off mid-way yields every conversation before the cut.
fn sharegpt_first_turns(bytes: &[u8], n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let skip = |mut i: usize, extra: u8| {
        while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == extra) {
            i += 1;
        }
        i
    };
    let mut i = skip(0, b' ');
    if bytes.get(i) != Some(&b'[') {
        return out;
    }
    i += 1;
    while out.len() < n {
        i = skip(i, b',');
        if i >= bytes.len() || bytes[i] == b']' {
            break;
        }
        let mut it = serde_json::Deserializer::from_slice(&bytes[i..]).into_iter::<Value>();
        let Some(Ok(conv)) = it.next() else { break }; // truncated (or malformed) from here on
        i += it.byte_offset();
        let first = conv["conversations"].as_array().and_then(|turns| {
            let t = turns.first()?;
            (t["from"] == "human").then(|| t["value"].as_str())?
        });
        if let Some(text) = first.filter(|t| !t.trim().is_empty()) {
            out.push(text.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharegpt_truncated_file_keeps_complete_conversations() {
        let full = r#"[
  {"id": "a", "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "x"}]},
  {"id": "b", "conversations": [{"from": "gpt", "value": "starts with gpt"}]},
  {"id": "c", "conversations": []},
  {"id": "d", "conversations": [{"from": "human", "value": "sec\"ond ]"}, {"from": "gpt", "value": "y"}]},
  {"id": "e", "conversations": [{"from": "human", "value": "cut off her"#;
        assert_eq!(sharegpt_first_turns(full.as_bytes(), 10), vec!["first", "sec\"ond ]"]);
        assert_eq!(sharegpt_first_turns(full.as_bytes(), 1), vec!["first"]);
        let closed = r#"[{"conversations": [{"from": "human", "value": "only"}]}]"#;
        assert_eq!(sharegpt_first_turns(closed.as_bytes(), 10), vec!["only"]);
        assert!(sharegpt_first_turns(b"{}", 10).is_empty());
    }

    #[test]
    fn jsonl_strings_and_objects() {
        let t = "\"plain\"\n{\"prompt\": \"p\", \"x\": 1}\n\n{\"text\": \"t\"}\n\"\"\n";
        assert_eq!(jsonl_prompts(t, 10).unwrap(), vec!["plain", "p", "t"]);
        assert_eq!(jsonl_prompts(t, 2).unwrap(), vec!["plain", "p"]);
        for bad in ["not json", "{\"other\": 1}", "{\"prompt\": 5}", "[1]"] {
            let e = jsonl_prompts(&format!("\"a\"\n{bad}\n\"b\"\n"), 10).unwrap_err();
            assert!(e.starts_with("line 2 "), "{bad}: {e}");
        }
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0];
        assert_eq!(quantile(&v, 0.5), 6.0);
        assert_eq!(quantile(&v, 0.1), 2.0);
        assert!((quantile(&v, 0.9) - 10.0).abs() < 1e-12);
        assert_eq!(quantile(&[3.0], 0.9), 3.0);
        let s = stats([Some(4.0), None, Some(2.0)].into_iter());
        assert_eq!(s["median"], 3.0);
        assert_eq!(s["n"], 2);
        assert!(stats([None].into_iter()).is_null());
    }
}
