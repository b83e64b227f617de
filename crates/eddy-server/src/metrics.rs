//! `GET /metrics`: server counters in the Prometheus text exposition format (version 0.0.4).
//!
//! Requests by endpoint and status, prompt / cached / generated tokens, time to first token, per-token
//! latency, time spent queued, queue depth and running requests, and the speculation counters (draft
//! tokens proposed and accepted, per-depth acceptance) taken from each request's [`GenerationStats`].

use eddy::stats::GenerationStats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Bucket upper bounds (seconds) of the time-to-first-token and queue-time histograms.
const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0];
/// Bucket upper bounds (seconds) of the per-token latency histogram.
const TOKEN_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0];
/// Deepest speculation depth tracked (deeper levels are folded into the last one).
const MAX_DEPTH: usize = 32;

/// A cumulative histogram with fixed bucket bounds.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>, // per bucket (not cumulative); one extra for +Inf
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 }
    }

    fn observe(&mut self, x: f64) {
        let i = self.bounds.iter().position(|&b| x <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += x;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {cum}");
    }
}

#[derive(Default)]
struct Speculation {
    draft_tokens: u64,
    draft_accepted: u64,
    accepted_at_depth: Vec<u64>,
    proposed_at_depth: Vec<u64>,
}

/// Every counter of the server; shared by the HTTP handlers and the engine thread.
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    decode_passes: AtomicU64,
    queued: AtomicI64,
    running: AtomicI64,
    ttft: Mutex<Histogram>,
    token_latency: Mutex<Histogram>,
    queue_time: Mutex<Histogram>,
    spec: Mutex<Speculation>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            decode_passes: AtomicU64::new(0),
            queued: AtomicI64::new(0),
            running: AtomicI64::new(0),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            token_latency: Mutex::new(Histogram::new(TOKEN_BUCKETS)),
            queue_time: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            spec: Mutex::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `endpoint` label of a request path: the routes by name, anything else `other` (so that random
/// URLs cannot grow the label set).
pub fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" | "/chat/completions" => "/v1/chat/completions",
        "/v1/completions" | "/completions" => "/v1/completions",
        "/v1/models" | "/models" => "/v1/models",
        "/v1/responses" => "/v1/responses",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") || p.starts_with("/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

impl Metrics {
    /// One answered request (status of the response head; a stream counts when it starts).
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *lock(&self.requests).entry((endpoint, status)).or_default() += 1;
    }

    /// A job entered the queue (+1) or left it (−1).
    pub fn queue_delta(&self, d: i64) {
        self.queued.fetch_add(d, Ordering::Relaxed);
    }

    /// The engine started (+1) or finished (−1) a job.
    pub fn running_delta(&self, d: i64) {
        self.running.fetch_add(d, Ordering::Relaxed);
    }

    /// Time a job waited in the queue before the engine took it.
    pub fn queue_time(&self, t: Duration) {
        lock(&self.queue_time).observe(t.as_secs_f64());
    }

    /// Time between two consecutive tokens of one request.
    pub fn token_latency(&self, t: Duration) {
        lock(&self.token_latency).observe(t.as_secs_f64());
    }

    /// A generation finished (or was cancelled): its token counts, TTFT and speculation counters.
    pub fn generation(&self, s: &GenerationStats, completion_tokens: usize) {
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(completion_tokens as u64, Ordering::Relaxed);
        self.decode_passes.fetch_add(s.decode_passes as u64, Ordering::Relaxed);
        if s.generated_tokens > 0 {
            lock(&self.ttft).observe(s.ttft.as_secs_f64());
        }
        let mut sp = lock(&self.spec);
        sp.draft_tokens += s.draft_tokens as u64;
        sp.draft_accepted += s.draft_accepted as u64;
        add_by_depth(&mut sp.accepted_at_depth, &s.accepted_at_depth);
        add_by_depth(&mut sp.proposed_at_depth, &s.proposed_at_depth);
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let _ = writeln!(
            o,
            "# HELP eddy_requests_total HTTP requests answered, by endpoint and status code.\n# TYPE eddy_requests_total counter"
        );
        for ((ep, st), n) in lock(&self.requests).iter() {
            let _ = writeln!(o, "eddy_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
        }
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (name, help, v) in [
            ("eddy_prompt_tokens_total", "Prompt tokens of finished generations (cached ones included).", &self.prompt_tokens),
            (
                "eddy_prompt_tokens_cached_total",
                "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
                &self.cached_tokens,
            ),
            ("eddy_generation_tokens_total", "Completion tokens generated.", &self.generated_tokens),
            ("eddy_decode_passes_total", "Target forward passes while decoding (spec_verify_ct summed).", &self.decode_passes),
        ] {
            counter(&mut o, name, help, get(v));
        }
        for (name, help, v) in [
            ("eddy_queue_depth", "Requests waiting for the engine thread.", &self.queued),
            ("eddy_requests_running", "Requests the engine thread is generating.", &self.running),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}", v.load(Ordering::Relaxed).max(0));
        }
        lock(&self.ttft).render(&mut o, "eddy_time_to_first_token_seconds", "From the start of prefill to the first sampled token.");
        lock(&self.token_latency).render(
            &mut o,
            "eddy_time_per_output_token_seconds",
            "Time between consecutive output tokens of a request.",
        );
        lock(&self.queue_time).render(
            &mut o,
            "eddy_request_queue_time_seconds",
            "Time a request waited in the queue before the engine took it.",
        );
        let sp = lock(&self.spec);
        counter(&mut o, "eddy_spec_draft_tokens_total", "Draft tokens proposed to the target model.", sp.draft_tokens);
        counter(&mut o, "eddy_spec_draft_tokens_accepted_total", "Draft tokens the target model accepted.", sp.draft_accepted);
        for (name, help, v) in [
            ("eddy_spec_proposed_at_depth_total", "Verify passes whose draft reached this depth.", &sp.proposed_at_depth),
            ("eddy_spec_accepted_at_depth_total", "Verify passes that accepted at least this many draft tokens.", &sp.accepted_at_depth),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for (d, n) in v.iter().enumerate() {
                let _ = writeln!(o, "{name}{{depth=\"{}\"}} {n}", d + 1);
            }
        }
        // Accepted draft tokens per verify pass as a histogram: passes accepting at most k tokens =
        // passes that drafted (depth ≥ 1) − passes that accepted at least k + 1.
        let name = "eddy_spec_accepted_length";
        let _ = writeln!(o, "# HELP {name} Draft tokens accepted per verify pass.\n# TYPE {name} histogram");
        let passes = sp.proposed_at_depth.first().copied().unwrap_or(0);
        for k in 0..sp.accepted_at_depth.len() {
            let at_least_more = sp.accepted_at_depth.get(k).copied().unwrap_or(0);
            let _ = writeln!(o, "{name}_bucket{{le=\"{k}\"}} {}", passes.saturating_sub(at_least_more));
        }
        let _ = writeln!(o, "{name}_bucket{{le=\"+Inf\"}} {passes}");
        let _ = writeln!(o, "{name}_sum {}\n{name}_count {passes}", sp.accepted_at_depth.iter().sum::<u64>());
        o
    }
}

fn add_by_depth(total: &mut Vec<u64>, v: &[usize]) {
    for (d, &n) in v.iter().enumerate() {
        let d = d.min(MAX_DEPTH - 1);
        if total.len() <= d {
            total.resize(d + 1, 0);
        }
        total[d] += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Value of the sample line `name` (labels included) in `text`.
    fn sample(text: &str, name: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
    }

    #[test]
    fn counts_histograms_and_speculation() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.request(endpoint_label("/nope"), 404);
        for route in ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize"] {
            assert_eq!(endpoint_label(route), route);
        }
        // One label for every model id (ids cannot grow the label set).
        for path in ["/v1/models/smol", "/models/gpt-4o-mini", "/v1/models/"] {
            assert_eq!(endpoint_label(path), "/v1/models/{id}");
        }
        m.queue_delta(1);
        m.queue_delta(1);
        m.queue_delta(-1);
        let s = GenerationStats {
            prompt_tokens: 30,
            generated_tokens: 11,
            decode_passes: 4,
            ttft: Duration::from_millis(300),
            cached_tokens: 12,
            draft_tokens: 9,
            draft_accepted: 6,
            // 3 passes drafted 3 deep; accepted ≥1: 3 passes, ≥2: 2, ≥3: 1 → 6 accepted.
            accepted_at_depth: vec![3, 2, 1],
            proposed_at_depth: vec![3, 3, 3],
            ..Default::default()
        };
        m.generation(&s, 10);
        for ms in [4, 8, 8, 40] {
            m.token_latency(Duration::from_millis(ms));
        }
        let t = m.render();
        assert_eq!(sample(&t, "eddy_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"), 2.0);
        assert_eq!(sample(&t, "eddy_requests_total{endpoint=\"other\",status=\"404\"}"), 1.0);
        assert_eq!(sample(&t, "eddy_prompt_tokens_total"), 30.0);
        assert_eq!(sample(&t, "eddy_prompt_tokens_cached_total"), 12.0);
        assert_eq!(sample(&t, "eddy_generation_tokens_total"), 10.0);
        assert_eq!(sample(&t, "eddy_decode_passes_total"), 4.0);
        assert_eq!(sample(&t, "eddy_queue_depth"), 1.0);
        assert_eq!(sample(&t, "eddy_time_to_first_token_seconds_bucket{le=\"0.25\"}"), 0.0);
        assert_eq!(sample(&t, "eddy_time_to_first_token_seconds_bucket{le=\"0.5\"}"), 1.0);
        assert_eq!(sample(&t, "eddy_time_to_first_token_seconds_count"), 1.0);
        assert_eq!(sample(&t, "eddy_time_per_output_token_seconds_bucket{le=\"0.005\"}"), 1.0);
        assert_eq!(sample(&t, "eddy_time_per_output_token_seconds_bucket{le=\"0.01\"}"), 3.0);
        assert_eq!(sample(&t, "eddy_time_per_output_token_seconds_bucket{le=\"+Inf\"}"), 4.0);
        assert!((sample(&t, "eddy_time_per_output_token_seconds_sum") - 0.060).abs() < 1e-9);
        assert_eq!(sample(&t, "eddy_spec_draft_tokens_total"), 9.0);
        assert_eq!(sample(&t, "eddy_spec_draft_tokens_accepted_total"), 6.0);
        assert_eq!(sample(&t, "eddy_spec_accepted_at_depth_total{depth=\"2\"}"), 2.0);
        assert_eq!(sample(&t, "eddy_spec_proposed_at_depth_total{depth=\"3\"}"), 3.0);
        // The three passes accepted 3, 2 and 1 tokens: cumulative 0 / 1 / 2 / 3 at le 0, 1, 2, +Inf.
        assert_eq!(sample(&t, "eddy_spec_accepted_length_bucket{le=\"0\"}"), 0.0);
        assert_eq!(sample(&t, "eddy_spec_accepted_length_bucket{le=\"1\"}"), 1.0);
        assert_eq!(sample(&t, "eddy_spec_accepted_length_bucket{le=\"2\"}"), 2.0);
        assert_eq!(sample(&t, "eddy_spec_accepted_length_bucket{le=\"+Inf\"}"), 3.0);
        assert_eq!(sample(&t, "eddy_spec_accepted_length_sum"), 6.0);
        // Every line is a comment or `name[{labels}] number`.
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let v = l.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "bad sample line {l:?}");
        }
    }
}
