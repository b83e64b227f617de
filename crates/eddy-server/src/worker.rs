//! The engine thread: owns the [`Engine`], takes jobs from a bounded FIFO queue one at a time, and streams
//! text deltas back over each job's channel. A job whose receiver is gone is skipped (still queued) or
//! cancelled (at the next decode step, or at the next prefill piece while its prompt is prefilled).

use crate::metrics::Metrics;
use eddy::engine::{Engine, GenerateParams, TokenLogprobs};
use eddy::sampling::LogitMask;
use eddy::stats::{FinishReason, GenerationStats};
use eddy::stop::StopMatcher;
use eddy::tokenizer::{StreamDecoder, Tokenizer};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, its prompts already tokenized.
pub(crate) struct Job {
    /// One prompt for chat, one or more for text completions.
    pub prompts: Vec<JobPrompt>,
    /// The sampling and log-probability parameters (`max_tokens`, `seed` and `prompt_len` are each
    /// choice's own).
    pub params: GenerateParams,
    /// The client's stop strings (`stop`, `stop_sequences`).
    pub stops: Vec<String>,
    /// The text that ends a turn where the model has no token for it ([`eddy::chat::ChatTemplate::end_text`]):
    /// a stop string too, but a reply that ends there ended its turn (no client stop string is reported).
    pub end_text: Option<String>,
    pub tx: UnboundedSender<Event>,
    /// When the job entered the queue.
    pub queued_at: Instant,
    /// Its place in the queue, given back when the engine thread takes the job.
    pub slot: Slot,
    /// The choices to generate (OpenAI's `n`, at least one), one after another.
    pub choices: Vec<Choice>,
    /// Decode special tokens into the text (a tool-call marker that is a control token).
    pub keep_special: bool,
    /// Reuse the prefix cache (`false`: the prompt is prefilled cold).
    pub cache_prompt: bool,
    /// Text completions' `echo`: the prompt's text (and with `logprobs` its tokens' log-probabilities)
    /// comes first, as each choice's first delta.
    pub echo: bool,
}

/// One prompt of a [`Job`].
pub(crate) struct JobPrompt {
    pub ids: Vec<u32>,
    /// The most tokens a reply may have: the request's `max_tokens`, at most the room the context leaves.
    pub max_tokens: usize,
    /// Leading tokens `echo` leaves out: 1 for a BOS the tokenizer added to a text prompt, else 0.
    pub echo_skip: usize,
}

/// One choice of a [`Job`]: a generation from one of its prompts with its own seed and constraint state.
pub(crate) struct Choice {
    /// Index into [`Job::prompts`].
    pub prompt: usize,
    /// Replaces the job's sampler seed.
    pub seed: u64,
    /// The constraint on the output (a JSON schema, a tool call), if any, and the request field it
    /// comes from (`response_format` or `tools`).
    pub mask: Option<(Box<dyn LogitMask>, &'static str)>,
}

/// Admission to the engine thread's queue: at most `max` jobs wait at a time. A job holds its place
/// from admission until the engine thread takes it or its client leaves, whichever comes first, so a
/// client that gives up while queued frees its place at once.
pub(crate) struct Queue {
    waiting: AtomicUsize,
    max: usize,
    /// The engine thread is generating (a queue of 0 admits a job only while it is idle).
    busy: AtomicBool,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// A queue of `max` places, counted in `metrics`' queue depth.
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Arc<Queue> {
        Arc::new(Queue { waiting: AtomicUsize::new(0), max, busy: AtomicBool::new(false), metrics })
    }

    /// A place for one more job, or `None` when the queue is full.
    pub fn admit(self: &Arc<Self>) -> Option<Slot> {
        let limit = if self.max == 0 && !self.busy.load(Ordering::Acquire) { 1 } else { self.max };
        self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).ok()?;
        self.metrics.queue_delta(1);
        Some(Slot(Arc::new(SlotState { queue: self.clone(), held: AtomicBool::new(true) })))
    }
}

struct SlotState {
    queue: Arc<Queue>,
    held: AtomicBool,
}

/// One job's place in the [`Queue`]; clones share it, and it is given back once.
#[derive(Clone)]
pub(crate) struct Slot(Arc<SlotState>);

impl Slot {
    /// Gives the place back (the first call only).
    pub fn release(&self) {
        if self.0.held.swap(false, Ordering::AcqRel) {
            self.0.queue.waiting.fetch_sub(1, Ordering::AcqRel);
            self.0.queue.metrics.queue_delta(-1);
        }
    }
}

/// Held by the request handler: dropping it (the answer is complete, or the client left while the job
/// was queued) gives the job's place back.
pub(crate) struct SlotGuard(pub Slot);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// A token as log-probabilities show it: its raw bytes, and its text (the bytes when they are valid
/// UTF-8, else OpenAI's `bytes:\xf0\x9f` spelling).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TokenText {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl TokenText {
    /// Token `id` alone, as it reads after other tokens ([`Tokenizer::piece`]: a SentencePiece
    /// word-start token keeps its leading space). Its bytes are those of its text unless the text is
    /// incomplete UTF-8 (a byte fallback token, or a byte-level token that cuts a character), where they
    /// come from the vocabulary entry: `<0xHH>`, or the GPT-2 byte alphabet.
    pub fn new(tok: &Tokenizer, id: u32) -> TokenText {
        let text = tok.piece(id).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return TokenText { bytes: text.clone().into_bytes(), text };
        }
        let Some(bytes) = tok.token_str(id).as_deref().and_then(vocab_entry_bytes) else {
            return TokenText { bytes: text.clone().into_bytes(), text };
        };
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t.to_string(),
            Err(_) => {
                let mut t = String::from("bytes:");
                for b in &bytes {
                    t.push_str(&format!("\\x{b:02x}"));
                }
                t
            }
        };
        TokenText { text, bytes }
    }
}

/// The bytes a vocabulary entry stands for: a SentencePiece byte-fallback entry `<0xHH>`, or an entry
/// written in the GPT-2 byte alphabet (byte-level BPE); `None` for anything else.
fn vocab_entry_bytes(entry: &str) -> Option<Vec<u8>> {
    if let Some(h) = entry.strip_prefix("<0x").and_then(|e| e.strip_suffix('>')) {
        return (h.len() == 2).then(|| u8::from_str_radix(h, 16).ok().map(|b| vec![b]))?;
    }
    entry.chars().map(byte_alphabet_byte).collect()
}

/// The byte that a character of the GPT-2 byte alphabet stands for: printable Latin-1 bytes as
/// themselves, the other 68 bytes, in order, as U+0100 and on.
fn byte_alphabet_byte(c: char) -> Option<u8> {
    let printable = |b: u8| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let c = c as u32;
    if c < 256 {
        return printable(c as u8).then_some(c as u8);
    }
    (0..=255u8).filter(|&b| !printable(b)).nth((c - 256) as usize)
}

/// A generated token's log-probability and its top alternatives, and where its text begins in the
/// completion (in characters; a token that completes a character begun by earlier tokens begins where
/// that character does). An echoed prompt's first token has no log-probability (`None`, and no
/// alternatives).
#[derive(Debug, Clone)]
pub(crate) struct Logprob {
    pub token: TokenText,
    pub logprob: Option<f32>,
    pub top: Vec<(TokenText, f32)>,
    pub offset: usize,
}

impl Logprob {
    fn new(tok: &Tokenizer, lp: &TokenLogprobs, offset: usize) -> Logprob {
        Logprob {
            token: TokenText::new(tok, lp.id),
            logprob: Some(lp.logprob),
            top: lp.top.iter().map(|&(id, l)| (TokenText::new(tok, id), l)).collect(),
            offset,
        }
    }
}

/// What the engine thread sends back for a job. A job of several choices sends each choice's events in
/// turn, each ending with its `Done`; the events after the k-th `Done` belong to choice k.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// New text (valid UTF-8, never containing or ending in the start of a stop string), and the
    /// log-probabilities (when asked for) of the tokens whose text it completes. A token cut by a stop
    /// string is reported with the text before the stop string.
    Delta(String, Vec<Logprob>),
    /// Generation (of one choice) ended normally; `stop`: the stop string that ended it, if one did.
    Done { stop: Option<String>, finish: &'static str, completion_tokens: usize, stats: GenerationStats },
    /// The engine failed.
    Error(String),
    /// The request's grammar (request field `param`) failed while the reply was generated: the
    /// request's fault, a 400.
    Invalid { param: &'static str, message: String },
}

/// Start the engine thread; jobs are read from `rx` until every sender is dropped. Every job taken from
/// the queue gives its place in `queue` back.
pub(crate) fn spawn(
    mut engine: Engine,
    rx: std::sync::mpsc::Receiver<Job>,
    queue: Arc<Queue>,
    metrics: Arc<Metrics>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("eddy-engine".into()).spawn(move || {
        let tok = engine.lm.tokenizer.clone();
        while let Ok(mut job) = rx.recv() {
            job.slot.release();
            if job.tx.is_closed() {
                continue; // the client left while the job was queued
            }
            queue.busy.store(true, Ordering::Release);
            metrics.queue_time(job.queued_at.elapsed());
            let tx = job.tx.clone();
            metrics.running_delta(1);
            // Choices run one after another; each but the last ends with its own `Done`.
            let choices = std::mem::take(&mut job.choices);
            let count = choices.len();
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // The echoed prompt (scored once per prompt: the same for each of its choices).
                let mut echoed: Option<(usize, (String, Vec<Logprob>))> = None;
                // Greedy choices of one prompt are the same reply whatever their seeds: the first is
                // generated, its events recorded and sent again for the others.
                let greedy = job.params.sampler.temperature == 0.0;
                let mut first: Option<(usize, Vec<Event>)> = None;
                for (i, c) in choices.into_iter().enumerate() {
                    if let Some((_, events)) = first.as_ref().filter(|f| f.0 == c.prompt) {
                        if job.tx.is_closed() {
                            return None; // the client left
                        }
                        let (last, rest) = events.split_last().expect("a recorded choice ends with Done");
                        for ev in rest {
                            let _ = tx.send(ev.clone());
                        }
                        if i + 1 < count {
                            let _ = tx.send(last.clone());
                            continue;
                        }
                        return Some(last.clone());
                    }
                    if job.echo && echoed.as_ref().is_none_or(|e| e.0 != c.prompt) {
                        let p = &job.prompts[c.prompt];
                        let cancelled = || job.tx.is_closed();
                        match echo_prompt(&mut engine, &tok, &p.ids, p.echo_skip, job.params.logprobs, &cancelled) {
                            Ok(Some(e)) => echoed = Some((c.prompt, e)),
                            Ok(None) => return None, // client gone
                            Err(e) => return Some(Event::Error(e.to_string())),
                        }
                    }
                    let prompt = c.prompt;
                    let mut record = (greedy && i + 1 < count).then(Vec::new);
                    let r = run_job(&mut engine, &tok, &job, c, echoed.as_ref().map(|e| &e.1), &metrics, record.as_mut());
                    match r {
                        Some(ev @ Event::Done { .. }) if i + 1 < count => {
                            if let Some(mut events) = record {
                                events.push(ev.clone());
                                first = Some((prompt, events));
                            }
                            let _ = tx.send(ev);
                        }
                        ev => return ev,
                    }
                }
                None
            }));
            // Counted out before the last event goes: a client that scrapes /metrics right after its
            // answer sees the job finished.
            metrics.running_delta(-1);
            queue.busy.store(false, Ordering::Release);
            let last = r.unwrap_or_else(|_| Some(Event::Error("the engine panicked while generating".into())));
            if let Some(ev) = last {
                let _ = tx.send(ev);
            }
        }
    })
}

/// Generates one choice of a job, sending its text deltas (after `echoed`, the echoed prompt's text and
/// log-probabilities), each also pushed to `record` when given; returns the last event to send (none when
/// the client left).
fn run_job(
    engine: &mut Engine,
    tok: &Tokenizer,
    job: &Job,
    choice: Choice,
    echoed: Option<&(String, Vec<Logprob>)>,
    metrics: &Metrics,
    mut record: Option<&mut Vec<Event>>,
) -> Option<Event> {
    let Job { prompts, params, stops, end_text, tx, keep_special, cache_prompt, .. } = job;
    let Choice { prompt, seed, mut mask } = choice;
    let JobPrompt { ids: prompt, max_tokens, .. } = &prompts[prompt];
    let (prompt, keep_special, echo) = (&prompt[..], *keep_special, echoed.is_some());
    if tx.is_closed() {
        return None; // the client left (between two choices)
    }
    let mut params = params.clone();
    params.max_tokens = *max_tokens;
    params.sampler.seed = seed;
    // Presence and frequency penalties count the generated tokens only.
    params.sampler.prompt_len = prompt.len();
    if !cache_prompt {
        engine.clear_cache();
    }
    let mut echoed_chars = 0;
    if let Some((text, lps)) = echoed {
        echoed_chars = text.chars().count();
        if !text.is_empty() || !lps.is_empty() {
            let ev = Event::Delta(text.clone(), lps.clone());
            if let Some(r) = record.as_deref_mut() {
                r.push(ev.clone());
            }
            let _ = tx.send(ev);
        }
        if params.max_tokens == 0 {
            let stats = GenerationStats { prompt_tokens: prompt.len(), finish: FinishReason::Length, ..Default::default() };
            return Some(Event::Done { finish: "length", stop: None, completion_tokens: 0, stats });
        }
    }
    let mut last_token: Option<Instant> = None;
    // After an echoed prompt the reply's text continues it (its first word keeps a SentencePiece space).
    let mut dec = match echo {
        true => StreamDecoder::with_context(tok, !keep_special, &prompt[prompt.len().saturating_sub(8)..])
            .unwrap_or_else(|_| StreamDecoder::new(tok, !keep_special)),
        false => StreamDecoder::new(tok, !keep_special),
    };
    // Tokens whose text the decoder still holds (an incomplete character), for the cut at the end.
    let mut held: Vec<u32> = Vec::new();
    let mut stop = StopMatcher::new(stops.iter().chain(end_text).cloned().collect());
    let mut n = 0usize;
    let mut hit = false;
    let want_lp = params.logprobs.is_some();
    let mut lpq = LogprobQueue { decoded_chars: echoed_chars, ..Default::default() };
    let mut send = |text: String, lps: Vec<Logprob>| {
        if !text.is_empty() || !lps.is_empty() {
            let ev = Event::Delta(text, lps);
            if let Some(r) = record.as_deref_mut() {
                r.push(ev.clone());
            }
            let _ = tx.send(ev);
        }
    };
    // A client that leaves during the prefill stops it at the next prefill piece.
    let left = || tx.is_closed();
    let constraint = mask.as_mut().map(|(m, _)| m.as_mut() as &mut dyn LogitMask);
    let r = engine.generate_masked(prompt, &params, &left, constraint, &mut |id, lp| {
        if tx.is_closed() {
            return false;
        }
        let now = Instant::now();
        if let Some(prev) = last_token.replace(now) {
            metrics.token_latency(now - prev);
        }
        n += 1;
        if let (true, Some(lp)) = (want_lp, lp) {
            lpq.push(Logprob::new(tok, lp, lpq.decoded_chars));
        }
        held.push(id);
        if let Ok(Some(text)) = dec.push(id) {
            held.clear();
            lpq.decoded(&text);
            let (out, h) = stop.push(&text);
            if h {
                lpq.stop_after(out.len());
                let lps = lpq.take(&out, true);
                send(out, lps);
                hit = true;
                return false;
            }
            let lps = lpq.take(&out, false);
            send(out, lps);
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
            // A grammar that failed (rather than ended) is the request's error, not a finished reply
            // (llguidance's message, without the parser state it appends).
            if let Some(((_, param), e)) = mask.as_ref().and_then(|m| Some((m, m.0.failure()?))).filter(|_| !hit) {
                let e = e.lines().next().unwrap_or_default();
                return Some(Event::Invalid {
                    param,
                    message: format!("invalid {param}: its grammar failed after {n} generated tokens: {e}"),
                });
            }
            if !hit {
                if let Ok(Some(mut text)) = dec.finish() {
                    // A reply cut inside a character: its incomplete bytes are withheld, not sent as U+FFFD.
                    if incomplete_utf8_tail(tok, &held) {
                        while text.ends_with('\u{FFFD}') {
                            text.pop();
                        }
                    }
                    lpq.decoded(&text);
                    let (out, h) = stop.push(&text);
                    if h {
                        lpq.stop_after(out.len());
                    }
                    let lps = lpq.take(&out, h);
                    send(out, lps);
                    hit = h;
                }
                if !hit {
                    let out = stop.flush();
                    let lps = lpq.take(&out, true);
                    send(out, lps);
                }
            }
            let finish = if hit || stats.finish == FinishReason::Stop { "stop" } else { "length" };
            // The turn's end text is reported as no stop string, unless the client listed it too.
            let matched = stop.matched().filter(|m| stops.iter().any(|s| s == m));
            Some(Event::Done { finish, stop: matched.map(str::to_string), completion_tokens: n, stats })
        }
    }
}

/// The text of `prompt[skip..]` as a completion's `echo` gives it: decoded with its special tokens (a
/// prompt in a chat format comes back as it was sent; `skip` leaves out a BOS the tokenizer added, not the
/// user), and with `logprobs` (`Some(k)` alternatives) an entry per echoed token at its character offset:
/// `prompt[0]` without a log-probability, the others from [`Engine::prompt_logprobs`] over the whole
/// prompt. `None` when `cancelled` (the client left) stopped the scoring.
fn echo_prompt(
    engine: &mut Engine,
    tok: &Tokenizer,
    prompt: &[u32],
    skip: usize,
    logprobs: Option<usize>,
    cancelled: &dyn Fn() -> bool,
) -> eddy::Result<Option<(String, Vec<Logprob>)>> {
    let mut dec = StreamDecoder::new(tok, false);
    let mut text = String::new();
    let echoed = prompt.get(skip..).unwrap_or_default();
    let (mut offsets, mut chars) = (Vec::with_capacity(echoed.len()), 0);
    for &id in echoed {
        offsets.push(chars);
        if let Some(t) = dec.push(id)? {
            chars += t.chars().count();
            text.push_str(&t);
        }
    }
    if let Some(t) = dec.finish()? {
        text.push_str(&t);
    }
    let Some(k) = logprobs else {
        return Ok(Some((text, Vec::new())));
    };
    let Some(scored) = engine.prompt_logprobs(prompt, k, cancelled)? else {
        return Ok(None);
    };
    // `scored[i - 1]` is prompt token i.
    let lps = (skip..prompt.len())
        .zip(&offsets)
        .map(|(i, &offset)| match i {
            0 => Logprob { token: TokenText::new(tok, prompt[0]), logprob: None, top: Vec::new(), offset },
            _ => Logprob::new(tok, &scored[i - 1], offset),
        })
        .collect();
    Ok(Some((text, lps)))
}

/// Whether the raw bytes of `ids` end inside a UTF-8 character (a token sequence cut mid-character).
fn incomplete_utf8_tail(tok: &Tokenizer, ids: &[u32]) -> bool {
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| TokenText::new(tok, id).bytes).collect();
    matches!(std::str::from_utf8(&bytes), Err(e) if e.error_len().is_none())
}

/// Log-probabilities of generated tokens waiting for their text to be emitted: a token's entry goes out
/// with the delta that completes its text (byte offsets in the decoded output).
#[derive(Default)]
struct LogprobQueue {
    /// (end of the token's text, or `None` while its bytes are incomplete UTF-8; entry).
    pending: std::collections::VecDeque<(Option<usize>, Logprob)>,
    /// Bytes decoded so far.
    decoded: usize,
    /// Characters decoded so far.
    decoded_chars: usize,
    /// Bytes emitted so far.
    emitted: usize,
    /// End of the last entry taken.
    taken_end: usize,
}

impl LogprobQueue {
    fn push(&mut self, lp: Logprob) {
        self.pending.push_back((None, lp));
    }

    /// `text` was decoded: the tokens waiting for bytes end here.
    fn decoded(&mut self, text: &str) {
        self.decoded += text.len();
        self.decoded_chars += text.chars().count();
        for p in self.pending.iter_mut().rev() {
            if p.0.is_some() {
                break;
            }
            p.0 = Some(self.decoded);
        }
    }

    /// A stop string begins `out_len` bytes after what was emitted: keep only the tokens that start
    /// before it.
    fn stop_after(&mut self, out_len: usize) {
        let kept = self.emitted + out_len;
        let mut start = self.taken_end;
        let mut i = 0;
        while i < self.pending.len() && start < kept {
            start = self.pending[i].0.unwrap_or(usize::MAX);
            i += 1;
        }
        self.pending.truncate(i);
    }

    /// `out` is emitted: the entries whose text it completes (`all`: every entry left).
    fn take(&mut self, out: &str, all: bool) -> Vec<Logprob> {
        self.emitted += out.len();
        let mut lps = Vec::new();
        while let Some(&(end, _)) = self.pending.front() {
            if !all && end.is_none_or(|e| e > self.emitted) {
                break;
            }
            self.taken_end = end.unwrap_or(self.emitted);
            if let Some((_, lp)) = self.pending.pop_front() {
                lps.push(lp);
            }
        }
        lps
    }
}
