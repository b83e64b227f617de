//! The decode loop allocates nothing per step once warm (issue 11): heap allocations during a generation
//! of `2n` tokens minus those of `n` tokens, counted by a global allocator, for plain decoding of an
//! attention model and of the hybrid (Gated DeltaNet) model. (Speculators' own structures may allocate: the
//! suffix automaton grows with the text.)

mod common;

use eddy::engine::GenerateParams;
use eddy::sampling::SamplerParams;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `System`, counting every allocation and reallocation (all threads).
struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
/// The counter is process-wide: the tests run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by one generation of exactly `n` tokens (end-of-generation ignored) from `prompt`.
fn allocs(engine: &mut eddy::engine::Engine, prompt: &[u32], n: usize) -> usize {
    let params = GenerateParams { max_tokens: n, sampler: SamplerParams::default(), ignore_eos: true, logprobs: None };
    let mut count = 0;
    let before = ALLOCS.load(Ordering::SeqCst);
    engine
        .generate(prompt, &params, &mut |_| {
            count += 1;
            true
        })
        .unwrap();
    let after = ALLOCS.load(Ordering::SeqCst);
    assert_eq!(count, n);
    after - before
}

/// Per-step allocations: the generation of `2n` tokens against that of `n` (same prompt, prefix cache
/// dropped before each), after a warm-up generation of `2n` tokens (thread-local scratch grows with the
/// context, and which worker thread takes which job varies).
fn per_step(engine: &mut eddy::engine::Engine, prompt: &[u32], n: usize) -> f64 {
    let mut run = |len| {
        engine.clear_cache();
        allocs(engine, prompt, len)
    };
    run(2 * n);
    let (short, long) = (run(n), run(2 * n));
    eprintln!("allocations: {short} for {n} tokens, {long} for {}", 2 * n);
    (long as f64 - short as f64) / n as f64
}

/// A few allocations per generation vary from run to run (which worker thread first takes which job, the
/// test harness's own threads); one allocation per decode step would add `n`. So the `n` extra steps must
/// add fewer than `n / 4`.
fn assert_none_per_step(per: f64, what: &str) {
    assert!(per < 0.25, "{what} allocates {per:.2} times per decode step");
}

#[test]
fn plain_decode_allocates_nothing_per_step() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut engine) = common::engine("SmolLM2-135M-Instruct.Q4_1.gguf", 512) else { return };
    let prompt = engine.lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick", true).unwrap();
    let per = per_step(&mut engine, &prompt, 48);
    assert_none_per_step(per, "plain decode");
}

#[test]
fn hybrid_decode_allocates_nothing_per_step() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = eddy::engine::EngineOptions { threads: common::threads(), ctx: 256, max_batch: 64, ..Default::default() };
    let mut engine = common::qwen35_tiny_engine(&opts);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 250) as u32).collect();
    let per = per_step(&mut engine, &prompt, 48);
    assert_none_per_step(per, "hybrid decode");
}
