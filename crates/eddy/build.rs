//! With the `cuda` feature: compile the CUDA kernels (`src/backend/cuda/kernels.cu`) with nvcc into a fatbin
//! in `OUT_DIR`, which `backend::cuda` embeds. Without the feature this does nothing.
//!
//! The fatbin holds SASS for sm_90 (H100/H200), PTX for compute_90, which the driver compiles at load for GPUs
//! of compute capability 9.0 and later (Blackwell: RTX 50, B200), and PTX for compute_80 for Ampere and Ada
//! (RTX 30/40). The compute_90 PTX keeps what the kernels compile only for sm_90 and later (programmatic
//! dependent launch's wait, thread-block clusters): a Blackwell GPU given the compute_80 PTX would run the
//! programmatic launches the host asks for from 9.0 on without their wait. nvcc is found via the `NVCC` environment variable,
//! then `PATH`, then the virtual environment `tools/install_nvcc.sh` creates (`~/.cache/eddy/cuda-venv`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let src = Path::new("src/backend/cuda/kernels.cu");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-env-changed=NVCC");
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "the `cuda` feature needs nvcc (CUDA 13.0): none found in $NVCC, PATH or ~/.cache/eddy/cuda-venv. \
             Install it with tools/install_nvcc.sh (or set NVCC=/path/to/nvcc)."
        )
    });
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("eddy_kernels.fatbin");
    let mut cmd = Command::new(&nvcc);
    // The PyPI toolkit keeps its headers beside bin/: point nvcc at them (harmless for a system toolkit).
    if let Some(root) = nvcc.parent().and_then(Path::parent) {
        let inc = root.join("include");
        if inc.is_dir() {
            cmd.arg(format!("-I{}", inc.display()));
        }
    }
    cmd.args(["-fatbin", "-O3", "-std=c++17", "-Xptxas=-warn-spills"])
        .args(["-gencode", "arch=compute_90,code=[sm_90,compute_90]", "-gencode", "arch=compute_80,code=compute_80"])
        .arg("-o")
        .arg(&out)
        .arg(src);
    let status = cmd.status().unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
    if !status.success() {
        panic!("nvcc ({}) failed on {}: {status}", nvcc.display(), src.display());
    }
}

/// `$NVCC`, then `nvcc` on `PATH`, then the first `bin/nvcc` under `~/.cache/eddy/cuda-venv`.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let home = std::env::var_os("HOME")?;
    find_file(&Path::new(&home).join(".cache/eddy/cuda-venv"), 8)
}

/// A file `bin/nvcc` at most `depth` folders below `dir`.
fn find_file(dir: &Path, depth: usize) -> Option<PathBuf> {
    let p = dir.join("bin/nvcc");
    if p.is_file() {
        return Some(p);
    }
    if depth == 0 {
        return None;
    }
    let mut subs: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    subs.sort();
    subs.iter().find_map(|d| find_file(d, depth - 1))
}
