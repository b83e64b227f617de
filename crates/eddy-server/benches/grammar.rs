//! Cost of constrained decoding per token: the llguidance mask (compute + apply to a row of logits) and
//! the grammar advance (and refilling the row, a memset of 600 KB), on Qwen2.5-Coder-1.5B's vocabulary (151,936 logits), along a reply that fills a JSON
//! schema with nested objects and arrays. Compare with a decode step of the same model (`eddy speed`).
//!
//! `cargo bench -p eddy-server --bench grammar` (needs qwen2.5-coder-1.5b-instruct-q4_k_m.gguf in the
//! models folder).

use criterion::{criterion_group, criterion_main, Criterion};
use eddy::sampling::LogitMask;
use eddy_server::grammar::Grammars;
use serde_json::json;

fn bench(c: &mut Criterion) {
    let p = eddy::load::models_dir().join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let lm = eddy::load::load_gguf(&p, &mut |_, _| {}).expect("load the 1.5B (tools/fetch_models.sh qwen15)");
    let n_vocab = lm.model.config.vocab_size;
    let t0 = std::time::Instant::now();
    let g = Grammars::new(&lm.tokenizer, n_vocab).unwrap();
    eprintln!("token trie and llguidance tables: {:.2} s", t0.elapsed().as_secs_f64());
    let schema = json!({"type": "object", "properties": {"employees": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
        "role": {"type": "string"}, "skills": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "role", "skills"]}}}, "required": ["employees"],
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
    let reply = r#"{"employees": [{"name": "John Doe", "age": 30, "role": "Software Engineer", "skills": ["Python", "Java", "C++"]}, {"name": "Jane Smith", "age": 25, "role": "Data Scientist", "skills": ["Python", "R", "SQL"]}, {"name": "Alice Johnson", "age": 35, "role": "Product Manager", "skills": ["Agile", "Scrum", "Jira"]}]}"#;
    let tokens = lm.tokenizer.encode(reply, false).unwrap();
    let grammar = format!("start: body\nbody: %json {}\n", serde_json::to_string(&schema).unwrap());
    let mut logits = vec![0.5f32; n_vocab];
    eprintln!("{} tokens per reply", tokens.len());
    c.bench_function(&format!("mask+advance, {} tokens of JSON", tokens.len()), |b| {
        b.iter_batched(
            || g.lark(grammar.clone()).unwrap(),
            |mut m| {
                for &t in &tokens {
                    // A fresh row each step, as the model writes one.
                    logits.fill(0.5);
                    assert!(m.apply(&mut logits));
                    assert!(logits[t as usize].is_finite(), "token {t} masked");
                    m.consume(t);
                }
                m
            },
            criterion::BatchSize::SmallInput,
        )
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
