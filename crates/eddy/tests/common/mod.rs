//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// Path of a real model file in the eddy models folder. Panics with instructions when it is missing,
/// unless EDDY_SKIP_MODEL_TESTS=1, in which case `None` is returned and the test returns early.
pub fn model_path(file: &str) -> Option<PathBuf> {
    let p = eddy::load::models_dir().join(file);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("EDDY_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipping: {} missing and EDDY_SKIP_MODEL_TESTS=1", p.display());
        return None;
    }
    panic!("{} is missing: run `tools/fetch_models.sh all` (or set EDDY_SKIP_MODEL_TESTS=1)", p.display());
}

/// Threads for tests (the CI machine has 2 cores).
pub fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get().min(2)).unwrap_or(1)
}

/// Load a model file into an engine.
pub fn engine(file: &str, ctx: usize) -> Option<eddy::engine::Engine> {
    let p = model_path(file)?;
    let lm = eddy::load::load_gguf(&p, &mut |_, _| {}).unwrap_or_else(|e| panic!("{e}"));
    let opts = eddy::engine::EngineOptions { threads: threads(), ctx, max_batch: 256, ..Default::default() };
    Some(eddy::engine::Engine::new(lm, &opts))
}

/// The tiny synthetic Qwen3.5 checkpoint (tests/fixtures/qwen35/tiny, vocabulary 256) in an engine. It has no
/// tokenizer; the engine only needs one for end-of-generation ids, so the Llama fixture's stands in.
pub fn qwen35_tiny_engine(opts: &eddy::engine::EngineOptions) -> eddy::engine::Engine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = root.join("qwen35/tiny");
    let model = eddy::models::qwen35::load_dir(&dir, eddy::model_dir::Quant::None).unwrap();
    let tok = root.join("hf/llama");
    let tokenizer = eddy::tokenizer::Tokenizer::from_file(&tok.join("tokenizer.json"), Some(&tok.join("tokenizer_config.json"))).unwrap();
    let lm = eddy::load::LoadedModel { model, tokenizer, template: None, source: dir };
    eddy::engine::Engine::new(lm, opts)
}
