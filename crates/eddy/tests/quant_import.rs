//! GGUF block-type import against an independent reference: gguf-py's `gguf.quants.dequantize`.
//!
//! Fixtures: crates/eddy/tests/fixtures/quant/*.bin, written by tools/make_quant_fixtures.py (see its
//! header for how to regenerate and for the file format). The real-model test needs
//! tools/fetch_models.sh smollm2 (or EDDY_SKIP_MODEL_TESTS=1 to skip it).

use eddy::gguf::{ggml_type as gt, GgufFile, TensorInfo};
use eddy::quant::import::{dequantize, dequantize_blocks, import_matrix, SUPPORTED_TYPES};
use eddy::quant::WeightMatrix;
use eddy::Error;
use std::path::{Path, PathBuf};

struct Case {
    name: String,
    ggml_type: u32,
    rows: usize,
    cols: usize,
    raw: Vec<u8>,
    reference: Vec<f32>,
}

impl Case {
    fn info(&self) -> TensorInfo {
        TensorInfo {
            name: self.name.clone(),
            dims: vec![self.cols as u64, self.rows as u64],
            ggml_type: self.ggml_type,
            offset: 0,
            nbytes: self.raw.len() as u64,
        }
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn load_cases() -> Vec<Case> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixture_dir())
        .expect("fixture dir (run tools/make_quant_fixtures.py)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let b = std::fs::read(p).unwrap();
            assert_eq!(&b[..4], b"EQF1", "{}", p.display());
            let (ggml_type, rows, cols, nbytes) = (u32_at(&b, 4), u32_at(&b, 8) as usize, u32_at(&b, 12) as usize, u32_at(&b, 16) as usize);
            let raw = b[20..20 + nbytes].to_vec();
            let reference: Vec<f32> = b[20 + nbytes..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(reference.len(), rows * cols, "{}", p.display());
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            Case { name, ggml_type, rows, cols, raw, reference }
        })
        .collect()
}

/// The `QMatrix` parameters each block type imports to: (bits, group, bits per weight incl. scales).
fn expected_format(t: u32) -> Option<(u8, usize, f64)> {
    Some(match t {
        gt::Q4_0 => (4, 32, 4.5),
        gt::Q4_1 => (4, 32, 5.0),
        gt::Q4_K => (4, 32, 4.75),
        gt::Q5_0 => (5, 32, 5.5),
        gt::Q5_1 => (5, 32, 6.0),
        gt::Q5_K => (5, 32, 5.75),
        gt::Q6_K => (6, 16, 6.625),
        gt::Q8_0 => (8, 32, 8.5),
        _ => return None,
    })
}

fn dequant_all(m: &WeightMatrix) -> Vec<f32> {
    let (rows, cols) = (m.rows(), m.cols());
    let mut out = vec![0f32; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
        m.dequant_row(r, row);
    }
    out
}

#[test]
fn fixtures_cover_every_supported_type() {
    let cases = load_cases();
    for &t in SUPPORTED_TYPES.iter() {
        assert!(cases.iter().any(|c| c.ggml_type == t), "no fixture for {}", gt::name(t));
    }
    let total: u64 = std::fs::read_dir(fixture_dir()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(total < 300_000, "fixtures take {total} bytes");
}

#[test]
fn dequantize_blocks_matches_gguf_py_bit_for_bit() {
    for c in load_cases() {
        let got = dequantize_blocks(c.ggml_type, &c.raw, c.rows * c.cols).unwrap_or_else(|| panic!("{}: None", c.name));
        assert_eq!(got.len(), c.reference.len());
        for (i, (a, b)) in got.iter().zip(&c.reference).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{} value {i}: {a} vs reference {b}", c.name);
        }
        // The path-level API gives the same.
        let via_info = dequantize(Path::new("fixture.gguf"), &c.info(), &c.raw).unwrap();
        assert!(via_info.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{}", c.name);
        // Wrong n or bytes: None.
        assert!(dequantize_blocks(c.ggml_type, &c.raw[1..], c.rows * c.cols).is_none(), "{}", c.name);
        assert!(dequantize_blocks(c.ggml_type, &c.raw, c.rows * c.cols + 1).is_none(), "{}", c.name);
    }
}

#[test]
fn import_matrix_matches_reference() {
    for c in load_cases() {
        let m = import_matrix(Path::new("fixture.gguf"), &c.info(), &c.raw).unwrap();
        assert_eq!((m.rows(), m.cols()), (c.rows, c.cols), "{}", c.name);
        // The format each type maps to, and its size.
        let kind_ok = match (c.ggml_type, &m) {
            (gt::F32 | gt::F16, WeightMatrix::F32 { .. }) | (gt::BF16, WeightMatrix::Bf16 { .. }) => true,
            (t, WeightMatrix::Q(q)) => expected_format(t).is_some_and(|(bits, group, bpw)| {
                q.bits == bits && q.group == group && m.nbytes() as f64 == bpw * (c.rows * c.cols) as f64 / 8.0
            }),
            // Rows not a multiple of the block size: exact f32 fallback.
            (t, WeightMatrix::F32 { .. }) => c.cols % 32 != 0 || c.cols % gt::block_size(t).map_or(1, |b| b.0) != 0,
            _ => false,
        };
        assert!(kind_ok, "{}: imported as {m:?}", c.name);
        let got = dequant_all(&m);
        for (i, (a, b)) in got.iter().zip(&c.reference).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{} value {i}: {a} vs reference {b}", c.name);
        }
    }
}

#[test]
fn unsupported_type_is_a_model_error() {
    for (t, name) in [(gt::Q3_K, "Q3_K"), (gt::Q2_K, "Q2_K"), (gt::Q8_1, "Q8_1"), (16, "ggml type 16"), (9999, "ggml type 9999")] {
        let info = TensorInfo { name: "blk.0.attn_q.weight".into(), dims: vec![256, 2], ggml_type: t, offset: 0, nbytes: 0 };
        let bytes = vec![0u8; 220];
        for r in [import_matrix(Path::new("m.gguf"), &info, &bytes).err(), dequantize(Path::new("m.gguf"), &info, &bytes).err()] {
            let e = r.expect("unsupported type accepted");
            assert!(matches!(e, Error::Model { .. }), "{e:?}");
            let msg = e.to_string();
            assert!(msg.starts_with("m.gguf: tensor blk.0.attn_q.weight has type "), "{msg}");
            assert!(msg.contains(&format!("type {name}, which eddy does not import (supported: F32, F16, BF16, Q4_0")), "{msg}");
        }
        assert!(dequantize_blocks(t, &bytes, 256).is_none());
    }
}

#[test]
fn wrong_byte_length_is_a_model_error() {
    for c in load_cases() {
        let info = c.info();
        for bytes in [&c.raw[..c.raw.len() - 1], &[c.raw.as_slice(), &[0u8; 1]].concat()[..], &[][..]] {
            let e = import_matrix(Path::new("m.gguf"), &info, bytes).expect_err("wrong length accepted");
            assert!(matches!(e, Error::Model { .. }));
            let msg = e.to_string();
            assert!(msg.contains(&c.name) && msg.contains("bytes"), "{msg}");
            assert!(dequantize(Path::new("m.gguf"), &info, bytes).is_err());
        }
        // Dimensions that are not a whole number of blocks, or that overflow.
        if c.ggml_type != gt::F32 && c.ggml_type != gt::F16 && c.ggml_type != gt::BF16 {
            let bad = TensorInfo { dims: vec![c.cols as u64 + 1, c.rows as u64], ..info.clone() };
            assert!(import_matrix(Path::new("m.gguf"), &bad, &c.raw).is_err(), "{}", c.name);
        }
        let huge = TensorInfo { dims: vec![u64::MAX, 2], ..info };
        assert!(import_matrix(Path::new("m.gguf"), &huge, &c.raw).is_err(), "{}", c.name);
    }
}

fn models_dir() -> PathBuf {
    std::env::var_os("EDDY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/eddy/models"))
}

/// Imports every tensor of `file`; checks 2-D imports against `dequantize` bit-for-bit. Returns the
/// number of values checked.
fn import_whole_model(file: &Path) -> usize {
    let g = GgufFile::open(file).unwrap();
    let mut checked = 0;
    for t in &g.tensors {
        let bytes = g.tensor_data(t).unwrap();
        let reference = dequantize(file, t, bytes).unwrap();
        assert_eq!(reference.len() as u64, t.n_elements());
        if t.dims.len() < 2 {
            continue;
        }
        let m = import_matrix(file, t, bytes).unwrap();
        assert_eq!((m.cols() as u64, m.rows() as u64), (t.dims[0], t.n_elements() / t.dims[0]), "{}", t.name);
        let mut row = vec![0f32; m.cols()];
        for (r, want) in reference.chunks_exact(m.cols()).enumerate() {
            m.dequant_row(r, &mut row);
            assert!(
                row.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} ({}) row {r} differs from dequantize()",
                t.name,
                gt::name(t.ggml_type)
            );
        }
        checked += reference.len();
    }
    checked
}

#[test]
fn imports_every_tensor_of_smollm2() {
    let file = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !file.exists() {
        if std::env::var("EDDY_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
            eprintln!("skipping: {} is missing and EDDY_SKIP_MODEL_TESTS=1", file.display());
            return;
        }
        panic!("{} is missing: run tools/fetch_models.sh smollm2 (or set EDDY_SKIP_MODEL_TESTS=1)", file.display());
    }
    let n = import_whole_model(&file);
    assert!(n > 100_000_000, "only {n} values in 2-D tensors");
}

/// Every tensor of every model file present, checked like SmolLM2 (slow: `-- --ignored`).
#[test]
#[ignore]
fn imports_every_tensor_of_all_models_present() {
    for f in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5-coder-0.5b-instruct.gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ] {
        let file = models_dir().join(f);
        if file.exists() {
            let n = import_whole_model(&file);
            eprintln!("{f}: {n} values of 2-D tensors imported exactly");
        }
    }
}
