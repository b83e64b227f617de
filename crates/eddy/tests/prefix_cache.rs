//! The engine's prefix cache on the hybrid Qwen3.5 model (tiny synthetic checkpoint): a request that shares a
//! prefix with the previous one resumes from a saved Gated DeltaNet state and gives exactly (bit for bit:
//! every token and every log-probability) what a cold engine gives; `cached_tokens` reports the reuse,
//! including conversations that share only a start (snapshotted where they part).
//! Also: prefilling in pieces of any size gives the same result, and a cancelled prefill stops early and
//! leaves the engine correct.

mod common;

use eddy::engine::{Engine, EngineOptions, GenerateParams, TokenLogprobs};
use eddy::sampling::SamplerParams;
use eddy::stats::{FinishReason, GenerationStats};

fn engine(max_batch: usize, prefix_cache: bool) -> Engine {
    common::qwen35_tiny_engine(&EngineOptions { threads: common::threads(), ctx: 512, max_batch, prefix_cache })
}

/// Tokens below the tiny model's vocabulary of 256, from a seed.
fn tokens(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            (x >> 16) % 256
        })
        .collect()
}

/// Greedy, 24 tokens, with log-probabilities (compared exactly).
fn run(e: &mut Engine, prompt: &[u32]) -> (Vec<TokenLogprobs>, GenerationStats) {
    let params = GenerateParams {
        max_tokens: 24,
        sampler: SamplerParams { temperature: 0.0, ..Default::default() },
        ignore_eos: true,
        logprobs: Some(3),
    };
    let mut out = Vec::new();
    let st = e
        .generate_with_logprobs(prompt, &params, &mut |_, lp| {
            out.push(lp.expect("logprobs asked for").clone());
            true
        })
        .unwrap();
    (out, st)
}

fn cold(prompt: &[u32]) -> Vec<TokenLogprobs> {
    run(&mut engine(256, false), prompt).0
}

/// A run of `prompt` on `e` that reuses `cached` tokens and gives exactly what a cold engine gives.
fn resumes(e: &mut Engine, prompt: &[u32], cached: usize) -> Vec<TokenLogprobs> {
    let (out, st) = run(e, prompt);
    assert_eq!(st.cached_tokens, cached, "a prompt of {} tokens", prompt.len());
    assert_eq!(out, cold(prompt), "a prompt of {} tokens", prompt.len());
    out
}

/// The first `n` tokens of `base`, then `more` others.
fn parted(base: &[u32], n: usize, more: usize, seed: u32) -> Vec<u32> {
    let mut p = base[..n].to_vec();
    p.extend(tokens(more, seed));
    p
}

#[test]
fn hybrid_prefix_cache_equals_cold_runs() {
    let a = tokens(150, 1);
    let mut e = engine(256, true);
    let first = resumes(&mut e, &a, 0);
    // The same prompt again: resumes at the last chunk boundary before its last token (128).
    let again = resumes(&mut e, &a, 128);
    // The next turn: the prompt, the reply, more text. The reply was decoded, so it is prefilled again.
    let mut next: Vec<u32> = a.clone();
    next.extend(again.iter().map(|t| t.id));
    next.extend(tokens(30, 2));
    resumes(&mut e, &next, 128);
    // A strict prefix of the first prompt.
    resumes(&mut e, &a[..140], 128);

    // A-B-A: B leaves A after 100 tokens (a shared system prompt, say), before any snapshot of A, so nothing
    // is reused, and the snapshots of A are dropped with the rows B overwrites; but B's prefill snapshots
    // where it parted from A (the chunk boundary 64), so A again resumes there, then at its own 128. A third
    // conversation with the same 100-token start resumes at the shared 64 too.
    resumes(&mut e, &parted(&a, 100, 60, 3), 0);
    assert_eq!(resumes(&mut e, &a, 64), first);
    resumes(&mut e, &a, 128);
    resumes(&mut e, &parted(&a, 100, 45, 4), 64);

    // Pieces of 64: every piece saves a snapshot (A's second one is the shared start, which B reuses and
    // keeps as its checkpoint), and a long B's six more pieces must not push that one out.
    let mut e64 = engine(64, true);
    resumes(&mut e64, &a, 0);
    resumes(&mut e64, &parted(&a, 100, 330, 5), 64);
    resumes(&mut e64, &a, 64);

    // A checkpoint at a piece's first position (pieces of 256): D (400 tokens) leaves snapshots at 192 and
    // 384; E shares D's first 280, resumes at 192, and snapshots the shared start at 256 as its second piece
    // begins; F, with the same 280-token start, resumes there.
    let mut e256 = engine(256, true);
    let d = tokens(400, 6);
    resumes(&mut e256, &d, 0);
    resumes(&mut e256, &parted(&d, 280, 100, 7), 192);
    resumes(&mut e256, &parted(&d, 280, 40, 8), 256);

    // Off: nothing reused, same output.
    let mut off = engine(256, false);
    run(&mut off, &a);
    let (ra, st) = run(&mut off, &a);
    assert_eq!(st.cached_tokens, 0);
    assert_eq!(ra, first);
}

/// The engine prefills in pieces ending at multiples of 64 positions (`max_batch` rounded up) and the Gated
/// DeltaNet chunks end at multiples of 64 too, so every `max_batch` computes the same values, cold or
/// resuming from a snapshot.
#[test]
fn hybrid_prefill_cuts_at_absolute_positions() {
    let a = tokens(150, 4);
    let want = cold(&a);
    for max_batch in [7, 48, 64, 128] {
        let mut e = engine(max_batch, true);
        assert_eq!(run(&mut e, &a).0, want, "max_batch {max_batch}");
        let (again, st) = run(&mut e, &a);
        assert_eq!(st.cached_tokens, 128);
        assert_eq!(again, want, "max_batch {max_batch}, warm");
    }
}

/// A prefill cancelled before its second piece ends the request with no token; the next request is
/// answered as a cold engine answers it, reusing the piece already computed (64 tokens from an empty
/// state end on a chunk boundary, so that state is exactly a cold prefill's).
#[test]
fn cancelled_prefill_stops_early() {
    let a = tokens(200, 5);
    let mut e = engine(64, true);
    let params = GenerateParams { max_tokens: 24, sampler: SamplerParams::default(), ignore_eos: true, logprobs: None };
    let polls = std::cell::Cell::new(0);
    let mut n = 0;
    let st = e
        .generate_cancellable(
            &a,
            &params,
            &|| {
                polls.set(polls.get() + 1);
                polls.get() > 1
            },
            &mut |_, _| {
                n += 1;
                true
            },
        )
        .unwrap();
    assert_eq!(st.finish, FinishReason::Cancelled);
    assert_eq!((n, polls.get()), (0, 2));
    let (ra, st) = run(&mut e, &a);
    assert_eq!(st.cached_tokens, 64);
    assert_eq!(ra, cold(&a));
}
