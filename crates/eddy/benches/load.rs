//! Load-time speed (a plain program that prints, not criterion): `cargo bench -p eddy --bench load`.
//! - GGUF import of every tensor of Qwen2.5-Coder-1.5B (Q4_K_M) into eddy's formats;
//! - the Qwen tokenizer (151k tokens) from GGUF metadata.

use eddy::gguf::GgufFile;
use eddy::quant::import::{dequantize, import_matrix};
use eddy::tokenizer::Tokenizer;
use std::time::Instant;

fn main() {
    import_speed_qwen15();
    tokenizer_load_speed();
}

fn models_dir() -> std::path::PathBuf {
    eddy::load::models_dir()
}

/// Time to import every tensor of the 1.5B model (2-D: `import_matrix`, others: `dequantize`), as a
/// loader would.
fn import_speed_qwen15() {
    let file = models_dir().join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let g = GgufFile::open(&file).unwrap();
    // Touch the pages first so the timing is of the conversion, not of the disk.
    let mut x = 0u8;
    for t in &g.tensors {
        for b in g.tensor_data(t).unwrap().iter().step_by(4096) {
            x ^= b;
        }
    }
    std::hint::black_box(x);
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut bytes = 0;
        for t in &g.tensors {
            let data = g.tensor_data(t).unwrap();
            if t.dims.len() >= 2 {
                bytes += import_matrix(&file, t, data).unwrap().nbytes();
            } else {
                bytes += 4 * dequantize(&file, t, data).unwrap().len();
            }
        }
        eprintln!(
            "imported {} tensors ({:.0} MB in eddy formats) in {:.3} s",
            g.tensors.len(),
            bytes as f64 / 1e6,
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Loading the 151k-token Qwen tokenizer from GGUF metadata (best of 3; the target is < 0.5 s).
fn tokenizer_load_speed() {
    let path = models_dir().join("qwen2.5-coder-0.5b-instruct.gguf");
    if !path.is_file() {
        eprintln!("skipping: {} is missing", path.display());
        return;
    }
    let t0 = Instant::now();
    let g = GgufFile::open(&path).unwrap();
    eprintln!("qwen 0.5b: GgufFile::open (all metadata) took {:.3} s", t0.elapsed().as_secs_f64());
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        best = best.min(t0.elapsed().as_secs_f64());
        std::hint::black_box(tok.vocab_size());
    }
    eprintln!("qwen 0.5b: Tokenizer::from_gguf best of 3: {best:.3} s");
}
