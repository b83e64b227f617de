//! Speculative decoding is lossless: on 8 prompts (code and chat), with Qwen2.5-Coder 0.5B and 1.5B as
//! targets, suffix lookup, a draft model and both combined, each under every budget 4, 16, 32 and auto,
//! the generated token ids equal plain decoding's for 128 tokens, greedy and at temperature 0.8 with a seed.
//!
//! The full product (3 kinds × 8 prompts × 4 budgets × 2 temperatures per target, ≈ 25 minutes on two
//! AVX-512 cores) runs with `EDDY_FULL_SPEC=1`. Otherwise each (kind, budget) pair runs on one prompt,
//! rotated so that every kind meets 4 prompts, every budget 3, and every prompt one or two pairs: an eighth
//! of the product, every dimension still covered.

mod common;

use eddy::engine::{Engine, GenerateParams};
use eddy::sampling::SamplerParams;
use eddy::spec::{Budget, SpeculatorKind};

const QWEN05: &str = "qwen2.5-coder-0.5b-instruct.gguf";
const QWEN15: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

const PROMPTS: [&str; 8] = [
    "Write a python function to merge two sorted lists.",
    "Write a Rust function that reverses the order of the words in a string, with unit tests.",
    "Complete this code:\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Rewrite with async/await:\nfunction load(url, cb) { fetch(url).then(r => r.json()).then(d => cb(null, d)).catch(e => cb(e)); }",
    "What is the capital of France? Answer in one sentence, then list three facts about it.",
    "Explain the difference between a process and a thread.",
    "Write a short poem about the sea.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react. The fox jumped again, and the dog finally barked.",
];

fn chat(engine: &Engine, msg: &str) -> Vec<u32> {
    let t = engine.lm.template.as_ref().expect("chat template");
    let msgs = vec![eddy::chat::ChatMessage { role: "user".into(), content: msg.into() }];
    let text = t.render(&msgs, true, &Default::default()).unwrap();
    eddy::chat::encode_chat(&engine.lm.tokenizer, &text).unwrap()
}

fn sampler(temperature: f32) -> SamplerParams {
    SamplerParams { temperature, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1234, ..Default::default() }
}

fn generate(engine: &mut Engine, prompt: &[u32], temperature: f32) -> (Vec<u32>, eddy::stats::GenerationStats) {
    let params = GenerateParams { max_tokens: 128, sampler: sampler(temperature), ignore_eos: false, logprobs: None };
    let mut out = Vec::new();
    let stats = engine
        .generate(prompt, &params, &mut |t| {
            out.push(t);
            true
        })
        .unwrap();
    (out, stats)
}

/// Whether `EDDY_FULL_SPEC=1` asks for the whole kind × prompt × budget × temperature product.
fn full_product() -> bool {
    std::env::var("EDDY_FULL_SPEC").is_ok_and(|v| v == "1")
}

/// Whether the (kind `k`, budget `b`) pair runs on prompt `i` of `n`: all of them for the full product,
/// else prompt `(k + 3b) mod n` — the 12 pairs meet prompts 0–3 twice and 4–7 once, each kind 4 distinct
/// prompts (its 4 budgets) and each budget 3 (its 3 kinds).
fn selected(k: usize, b: usize, i: usize, n: usize) -> bool {
    full_product() || i == (k + 3 * b) % n
}

fn check_target(target: &str, draft: &str) {
    let Some(mut engine) = common::engine(target, 1024) else { return };
    let draft_path = common::model_path(draft).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|m| chat(&engine, m)).collect();
    let temps = [0.0f32, 0.8];
    let mut plain = Vec::new();
    for p in &prompts {
        for &t in &temps {
            plain.push(generate(&mut engine, p, t).0);
        }
    }
    let budgets = [Budget::Fixed(4), Budget::Fixed(16), Budget::Fixed(32), Budget::Auto];
    let (mut accepted, mut proposed, mut passes, mut generated) = (0, 0, 0, 0);
    // Every speculator kind × every prompt × every budget × both temperatures; a fresh speculator per
    // prompt and budget.
    for (ki, kind) in [SpeculatorKind::Suffix, SpeculatorKind::Draft, SpeculatorKind::Auto].into_iter().enumerate() {
        for (i, p) in prompts.iter().enumerate() {
            for (bi, &budget) in budgets.iter().enumerate() {
                if !selected(ki, bi, i, prompts.len()) {
                    continue;
                }
                let d = match kind {
                    SpeculatorKind::Suffix => None,
                    _ => Some(eddy::spec::Drafter::Model(Box::new(eddy::load::load_gguf(&draft_path, &mut |_, _| {}).unwrap()))),
                };
                engine.speculate(kind, d, budget).unwrap();
                for (j, &t) in temps.iter().enumerate() {
                    let (out, st) = generate(&mut engine, p, t);
                    assert_eq!(
                        out,
                        plain[i * 2 + j],
                        "{target}: {kind:?} speculation with budget {budget:?} at temperature {t} changed the output of prompt {i}"
                    );
                    accepted += st.draft_accepted;
                    proposed += st.draft_tokens;
                    passes += st.decode_passes;
                    generated += st.generated_tokens;
                }
                engine.set_speculation(Vec::new(), Budget::Auto);
            }
        }
    }
    eprintln!(
        "{target}: {generated} tokens in {passes} verify passes ({:.2} t/f), {accepted}/{proposed} draft tokens accepted",
        (generated as f64) / passes.max(1) as f64
    );
    // Speculation must actually have happened (and helped) for the test to mean anything.
    assert!(accepted > 0 && passes < generated, "no draft token was ever accepted");
}

#[test]
fn lossless_on_qwen05() {
    // The 0.5B drafts for itself: maximal acceptance, deep trees.
    check_target(QWEN05, QWEN05);
}

#[test]
fn lossless_on_qwen15() {
    check_target(QWEN15, QWEN05);
}

/// The hybrid Qwen3.5 path (Gated DeltaNet layers verified rollback-free by the ancestor-masked solve):
/// the tiny synthetic checkpoint through the engine, suffix lookup, its MTP head, and both (auto), under
/// fixed and automatic budgets: identical to plain decoding greedy and at temperature 0.8.
#[test]
fn lossless_on_qwen35_tiny() {
    use eddy::engine::EngineOptions;
    let mut engine = common::qwen35_tiny_engine(&EngineOptions { threads: common::threads(), ctx: 256, ..Default::default() });
    // A repetitive prompt, so the suffix automaton has something to propose.
    let prompt: Vec<u32> = (0..3).flat_map(|_| [5u32, 17, 42, 99, 7, 130, 64, 3, 250, 11]).chain([5, 17, 42]).collect();
    let run = |engine: &mut Engine, t: f32| {
        let params = GenerateParams { max_tokens: 48, sampler: sampler(t), ignore_eos: true, logprobs: None };
        let mut out = Vec::new();
        let st = engine.generate(&prompt, &params, &mut |x| {
            out.push(x);
            true
        });
        (out, st.unwrap())
    };
    for t in [0.0f32, 0.8] {
        let (plain, _) = run(&mut engine, t);
        for kind in [SpeculatorKind::Suffix, SpeculatorKind::Mtp, SpeculatorKind::Auto] {
            for budget in [Budget::Fixed(4), Budget::Fixed(8), Budget::Auto] {
                engine.speculate(kind, None, budget).unwrap();
                let (out, st) = run(&mut engine, t);
                assert_eq!(out, plain, "Qwen3.5 speculation ({kind:?}, {budget:?}, T={t}) changed the output");
                if budget != Budget::Auto {
                    assert!(st.draft_tokens > 0, "no drafts proposed ({kind:?})");
                }
                engine.set_speculation(Vec::new(), Budget::Auto);
            }
        }
    }
}
