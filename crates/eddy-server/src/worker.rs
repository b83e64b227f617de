//! The engine thread: owns the [`Engine`], takes jobs from a bounded FIFO queue one at a time, and streams
//! text deltas back over each job's channel. A job whose receiver is gone is skipped (still queued) or
//! cancelled (at the next decode step).

use eddy::engine::{Engine, GenerateParams};
use eddy::stats::{FinishReason, GenerationStats};
use eddy::tokenizer::{StreamDecoder, Tokenizer};
use crate::metrics::Metrics;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, prompt already tokenized.
pub(crate) struct Job {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    pub stops: Vec<String>,
    pub tx: UnboundedSender<Event>,
    /// When the job entered the queue.
    pub queued_at: Instant,
}

/// What the engine thread sends back for a job.
#[derive(Debug)]
pub(crate) enum Event {
    /// New text (valid UTF-8, never containing or ending in the start of a stop string).
    Delta(String),
    /// Generation ended normally.
    Done {
        finish: &'static str,
        completion_tokens: usize,
        stats: GenerationStats,
    },
    /// The engine failed.
    Error(String),
}

/// Start the engine thread; jobs are read from `rx` until every sender is dropped. Every job taken from
/// the queue is counted out of `metrics`' queue depth.
pub(crate) fn spawn(
    mut engine: Engine,
    rx: std::sync::mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("eddy-engine".into())
        .spawn(move || {
            let tok = engine.lm.tokenizer.clone();
            while let Ok(job) = rx.recv() {
                metrics.queue_delta(-1);
                if job.tx.is_closed() {
                    continue; // the client left while the job was queued
                }
                metrics.queue_time(job.queued_at.elapsed());
                let tx = job.tx.clone();
                metrics.running_delta(1);
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    run_job(&mut engine, &tok, job, &metrics)
                }));
                // Counted out before the last event goes: a client that scrapes /metrics right after its
                // answer sees the job finished.
                metrics.running_delta(-1);
                let last = r.unwrap_or_else(|_| {
                    Some(Event::Error("the engine panicked while generating".into()))
                });
                if let Some(ev) = last {
                    let _ = tx.send(ev);
                }
            }
        })
}

/// Generates one job, sending its text deltas; returns the last event to send (none when the client left).
fn run_job(engine: &mut Engine, tok: &Tokenizer, job: Job, metrics: &Metrics) -> Option<Event> {
    let Job {
        prompt,
        params,
        stops,
        tx,
        ..
    } = job;
    let mut last_token: Option<Instant> = None;
    let mut dec = StreamDecoder::new(tok, true);
    let mut stop = StopMatcher::new(stops);
    let mut n = 0usize;
    let mut hit = false;
    let send = |text: String| {
        if !text.is_empty() {
            let _ = tx.send(Event::Delta(text));
        }
    };
    let r = engine.generate(&prompt, &params, &mut |id| {
        if tx.is_closed() {
            return false;
        }
        let now = Instant::now();
        if let Some(prev) = last_token.replace(now) {
            metrics.token_latency(now - prev);
        }
        n += 1;
        if let Ok(Some(text)) = dec.push(id) {
            let (out, h) = stop.push(&text);
            send(out);
            if h {
                hit = true;
                return false;
            }
        }
        true
    });
    match r {
        Err(e) => Some(Event::Error(e.to_string())),
        Ok(stats) => {
            metrics.generation(&stats, n);
            if stats.finish == FinishReason::Cancelled && !hit {
                return None; // client gone
            }
            if !hit {
                if let Ok(Some(text)) = dec.finish() {
                    let (out, h) = stop.push(&text);
                    send(out);
                    hit = h;
                }
                if !hit {
                    send(stop.flush());
                }
            }
            let finish = if hit || stats.finish == FinishReason::Stop {
                "stop"
            } else {
                "length"
            };
            Some(Event::Done {
                finish,
                completion_tokens: n,
                stats,
            })
        }
    }
}

/// Finds stop strings in streamed text across delta boundaries. Text that could be the start of a stop
/// string is held back until it is known not to be one.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds `text`; returns the text that is safe to emit, and whether a stop string was found (then the
    /// returned text is everything before it and the rest is dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(i) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..i].to_string();
            self.pending.clear();
            return (out, true);
        }
        let cut = self.pending.len() - self.holdback();
        let out: String = self.pending.drain(..cut).collect();
        (out, false)
    }

    /// Everything still held back (at the end of generation).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a prefix of some stop string.
    fn holdback(&self) -> usize {
        let p = &self.pending;
        p.char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&p[i..])))
            .map_or(0, |i| p.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for d in deltas {
            let (t, hit) = m.push(d);
            out.push(t);
            if hit {
                return (out, true);
            }
        }
        out.push(m.flush());
        (out, false)
    }

    #[test]
    fn stop_across_deltas_is_never_emitted() {
        let (out, hit) = run(&["END"], &["abc E", "N", "D tail"]);
        assert!(hit);
        assert_eq!(out, vec!["abc ", "", ""]);
    }

    #[test]
    fn false_start_is_released() {
        let (out, hit) = run(&["END"], &["xE", "Ny", "z"]);
        assert!(!hit);
        assert_eq!(out.concat(), "xENyz");
        assert_eq!(out[0], "x");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        let (out, hit) = run(&["é!", "b"], &["aé", "!b"]);
        assert!(hit);
        assert_eq!(out.concat(), "a");
    }
}
