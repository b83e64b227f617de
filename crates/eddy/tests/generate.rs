//! Generation on real models: the reference prompt gives Python code; a seed fixes sampled output;
//! prefill and decode produce bit-identical logits (batch invariance).

mod common;

use eddy::chat::{encode_chat, ChatMessage};
use eddy::engine::GenerateParams;
use eddy::sampling::SamplerParams;

const DEFAULT: &str = eddy::load::DEFAULT_MODEL_FILE;

fn chat_prompt(engine: &eddy::engine::Engine, msg: &str) -> Vec<u32> {
    let t = engine.lm.template.as_ref().expect("template");
    let text = t.render(&[ChatMessage { role: "user".into(), content: msg.into() }], true, &Default::default()).unwrap();
    encode_chat(&engine.lm.tokenizer, &text).unwrap()
}

fn generate(engine: &mut eddy::engine::Engine, prompt: &[u32], sampler: SamplerParams, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    engine
        .generate(prompt, &GenerateParams { max_tokens: n, sampler, ignore_eos: false, logprobs: None }, &mut |t| {
            out.push(t);
            true
        })
        .unwrap();
    out
}

#[test]
fn reference_prompt_gives_python_code() {
    let Some(mut engine) = common::engine(DEFAULT, 2048) else { return };
    let prompt = chat_prompt(&engine, "Write a python function to merge two sorted lists.");
    let ids = generate(&mut engine, &prompt, SamplerParams::default(), 600);
    let text = engine.lm.tokenizer.decode(&ids, true).unwrap();
    eprintln!("{text}");
    // The first ```python block must parse as Python, define a function, and merge two sorted lists.
    let code = text
        .split("```python")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("no python code block in: {text}"));
    let name = code.split("def ").nth(1).and_then(|r| r.split('(').next()).unwrap_or_else(|| panic!("no function in: {code}"));
    let check = format!("{code}\nassert {name}([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]\nprint('ok')\n");
    let out = std::process::Command::new("python3").args(["-c", &check]).output().expect("python3 is needed to check the generated code");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "ok",
        "generated code failed: {}\n{code}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn same_seed_same_output_and_different_seed_differs() {
    let Some(mut engine) = common::engine("SmolLM2-135M-Instruct.Q4_1.gguf", 1024) else { return };
    let prompt = chat_prompt(&engine, "Tell me a short story about a fox.");
    let s = |seed| SamplerParams { temperature: 0.8, top_p: 0.95, seed, ..Default::default() };
    let a = generate(&mut engine, &prompt, s(42), 48);
    let b = generate(&mut engine, &prompt, s(42), 48);
    let c = generate(&mut engine, &prompt, s(43), 48);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn prefill_and_decode_logits_are_bit_identical() {
    // Logits of the last prompt position from a full prefill must equal those from prefilling all but the
    // last token and decoding it: the kernels are batch-invariant.
    let Some(mut engine) = common::engine("SmolLM2-135M-Instruct.Q4_1.gguf", 512) else { return };
    let tokens = engine.lm.tokenizer.encode("The quick brown fox jumps over the lazy dog because", true).unwrap();
    let vocab = engine.lm.model.config.vocab_size;
    let all = engine.score(&tokens).unwrap();
    for cut in [1, tokens.len() / 2, tokens.len() - 1] {
        let prefix = engine.score(&tokens[..cut]).unwrap();
        assert_eq!(prefix[..], all[..cut * vocab], "prefix of {cut} tokens");
    }
}

/// Token log-probabilities: the raw model distribution (greedy picks the most likely token, the top list
/// is sorted and normalised), identical with suffix speculation (tree logits = plain decode logits) and at
/// temperature 0.8 (logprobs are taken before temperature and truncation).
#[test]
fn logprobs_are_the_raw_distribution_and_speculation_keeps_them() {
    use eddy::engine::TokenLogprobs;
    use eddy::spec::{Budget, SpeculatorKind};
    let Some(mut engine) = common::engine(DEFAULT, 1024) else { return };
    // Repetitive text, so suffix drafts are accepted and tokens come from tree nodes.
    let prompt = chat_prompt(&engine, "Repeat exactly, three times: the quick brown fox jumps over the lazy dog.");
    let run = |engine: &mut eddy::engine::Engine, sampler: SamplerParams| {
        let mut out: Vec<TokenLogprobs> = Vec::new();
        let params = GenerateParams { max_tokens: 48, sampler, ignore_eos: false, logprobs: Some(5) };
        let st = engine
            .generate_with_logprobs(&prompt, &params, &mut |id, lp| {
                let lp = lp.expect("logprobs asked for").clone();
                assert_eq!(lp.id, id);
                out.push(lp);
                true
            })
            .unwrap();
        (out, st)
    };
    let (plain, _) = run(&mut engine, SamplerParams::default());
    assert!(plain.len() > 10);
    for lp in &plain {
        assert_eq!(lp.top.len(), 5);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
        let mass: f64 = lp.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!(mass <= 1.0 + 1e-4 && mass > 0.0, "{lp:?}");
        // Greedy: the generated token is the most likely one.
        assert_eq!(lp.top[0], (lp.id, lp.logprob), "{lp:?}");
        assert!(lp.logprob <= 0.0);
    }
    let hot = SamplerParams { temperature: 0.8, seed: 7, top_k: 40, ..SamplerParams::default() };
    let (plain_hot, _) = run(&mut engine, hot.clone());
    engine.speculate(SpeculatorKind::Suffix, None, Budget::Fixed(8)).unwrap();
    let (spec, st) = run(&mut engine, SamplerParams::default());
    assert!(st.draft_accepted > 0, "no draft accepted: the test does not exercise tree logits");
    assert_eq!(spec, plain);
    let (spec_hot, _) = run(&mut engine, hot);
    assert_eq!(spec_hot, plain_hot);
}
