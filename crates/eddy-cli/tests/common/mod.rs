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

/// Start the real `eddy serve` binary with `args` after `serve` (give `--port 0`); returns the child, the
/// address it listens on (from its "listening on http://ADDR" line) and its stderr, read up to that line.
#[allow(clippy::zombie_processes)] // the child is returned: the caller kills and waits for it
pub fn spawn_serve(args: &[&str]) -> (std::process::Child, String, std::io::BufReader<std::process::ChildStderr>) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_eddy"))
        .arg("serve")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            let status = child.wait();
            panic!("eddy serve exited before listening: {status:?}");
        }
        if let Some(a) = line.trim().split("listening on http://").nth(1) {
            return (child, a.to_string(), err);
        }
    }
}
