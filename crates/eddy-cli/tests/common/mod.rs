//! Helpers shared by the CLI tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The fastest real model, used wherever a test needs one.
pub const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Path of SmolLM2 in the eddy models folder; panics with instructions when it is missing, unless
/// EDDY_SKIP_MODEL_TESTS=1 (then `None`, and the test returns early).
pub fn smol() -> Option<PathBuf> {
    let p = eddy::load::models_dir().join(SMOL);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("EDDY_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        return None;
    }
    panic!("{} is missing: run `tools/fetch_models.sh smollm2`", p.display());
}

/// A path `name` inside a per-process scratch folder named after `suite`.
pub fn tmp(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("eddy-{suite}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}
