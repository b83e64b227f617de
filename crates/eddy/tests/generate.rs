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

/// Run-ahead decoding (the next step queued before the current one's token is back; forced on the CPU, where
/// its argmaxes are taken at once) gives plain greedy decoding's tokens and finish reason wherever the
/// generation ends — the token limit (1, 2, 9), an end-of-generation token, a full context, the sink stopping
/// it — and leaves the same committed sequence: the next request reuses the same prefix.
#[test]
fn run_ahead_decoding_gives_plain_decodings_tokens() {
    use eddy::stats::FinishReason;
    let smol = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let Some(mut engine) = common::engine(smol, 96) else { return };
    let prompt = chat_prompt(&engine, "Say hi.");
    let tail = chat_prompt(&engine, "Then say bye.");
    // (max tokens, ignore end-of-generation tokens, tokens the sink takes before stopping)
    let cases = [(1usize, false, None), (2, false, None), (9, true, None), (200, false, None), (200, true, None), (40, true, Some(5usize))];
    let (mut ends, mut runs_cached) = (Vec::new(), Vec::new());
    for (max_tokens, ignore_eos, stop_after) in cases {
        let mut runs = Vec::new();
        for ahead in [false, true] {
            engine.set_run_ahead(Some(ahead));
            engine.clear_cache();
            let params = GenerateParams {
                max_tokens,
                sampler: SamplerParams { temperature: 0.0, ..Default::default() },
                ignore_eos,
                logprobs: None,
            };
            let mut out = Vec::new();
            let st = engine
                .generate(&prompt, &params, &mut |t| {
                    out.push(t);
                    stop_after.is_none_or(|k| out.len() < k)
                })
                .unwrap();
            // The committed sequence: what a request continuing the conversation keeps of it (every token but
            // the last one emitted, which no step ran), and that request's tokens.
            let follow: Vec<u32> = prompt.iter().chain(&out).chain(&tail).copied().collect();
            let params = GenerateParams { max_tokens: 6, ..params };
            let mut next = Vec::new();
            // (A full context leaves no room for more.)
            let cached = (follow.len() < engine.ctx()).then(|| {
                let st2 = engine
                    .generate(&follow, &params, &mut |t| {
                        next.push(t);
                        true
                    })
                    .unwrap();
                (follow.len(), st2.cached_tokens)
            });
            runs.push((out, st.finish, st.generated_tokens, cached, next));
        }
        assert_eq!(
            runs[0], runs[1],
            "max_tokens {max_tokens}, ignore_eos {ignore_eos}, sink stops after {stop_after:?}: plain vs run-ahead"
        );
        ends.push(runs[0].1);
        runs_cached.extend(runs[0].3.map(|(_, c)| (prompt.len() + runs[0].0.len(), c)));
    }
    // A sink that panics mid-generation (a server catches it and keeps the engine): the steps left in flight
    // are dropped, and the next generation is plain decoding's.
    let params = GenerateParams {
        max_tokens: 12,
        sampler: SamplerParams { temperature: 0.0, ..Default::default() },
        ignore_eos: true,
        logprobs: None,
    };
    let tokens_of = |engine: &mut eddy::engine::Engine, ahead: bool| {
        engine.set_run_ahead(Some(ahead));
        engine.clear_cache();
        let mut out = Vec::new();
        engine
            .generate(&prompt, &params, &mut |t| {
                out.push(t);
                true
            })
            .unwrap();
        out
    };
    let plain = tokens_of(&mut engine, false);
    engine.set_run_ahead(Some(true));
    let mut seen = 0;
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.generate(&prompt, &params, &mut |_| {
            seen += 1;
            assert!(seen < 3, "the sink fails at its third token");
            true
        })
    }));
    assert!(caught.is_err());
    assert_eq!(tokens_of(&mut engine, true), plain, "after a sink's panic");
    engine.set_run_ahead(None);
    // The cases reach the ends they are meant to; the next request reused every token up to the last one the
    // sink took (all of them where an end-of-generation token, which the sink never sees, ended the run).
    assert!(runs_cached.len() >= 4 && runs_cached.iter().all(|&(p, c)| c == p - 1 || c == p), "{runs_cached:?}");
    assert_eq!(ends[0], FinishReason::Length);
    assert!(ends.contains(&FinishReason::Stop) && ends.contains(&FinishReason::Cancelled), "{ends:?}");
}
