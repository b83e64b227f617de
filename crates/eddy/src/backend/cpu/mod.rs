//! CPU kernels: activation quantization and matrix products against eddy's weight formats.
//!
//! # Kernel paths
//! Three implementations, chosen once per process by [`Kernel::active`]:
//! * [`Kernel::Avx512`]: AVX-512 F/BW/VL + VNNI (`vpdpbusd`). Int weights: a streaming GEMV for small
//!   batches and a repacking GEMM (16 rows per vector, 8 tokens per weight load) for larger ones, or,
//!   for matrices prepacked at load time ([`prepack_wanted`], [`crate::quant::QMatrix::prepack`]), the
//!   GEMM's form on the prepacked layout for every batch size; all produce identical bits (see
//!   `avx512.rs`).
//! * [`Kernel::Avx2`]: AVX2 + FMA + F16C (`vpmaddubsw` + `vpmaddwd`): on prepacked matrices the AVX-512 packed
//!   kernel's form on 8-row halves, bit-identical to it; otherwise `R rows × T tokens` register tiles.
//! * [`Kernel::Scalar`]: portable loops.
//!
//! The environment variable `EDDY_KERNEL=scalar|avx2|avx512` caps the choice (a request for a path the
//! CPU lacks falls back to the best available one). Tests call [`matmul_with`] /
//! [`quantize_activations_with`] to exercise every path in one process.
//!
//! # Batch invariance
//! Within a path, output `(row, token)` is computed by a sequence of floating-point operations that
//! depends only on `(row, token)`, never on `n`, on the tile or kernel variant the pair lands in, or on
//! the thread count; integer parts are exact. So a token's row of `matmul(.., n = 1, ..)` is
//! bit-identical to the same token inside any batch. Scalar/AVX2: each pair owns one accumulator
//! (a SIMD vector reduced by a fixed shuffle tree); tiles only share loads and weight decoding.
//! AVX-512: every pair runs 16 f32 chains over its weight groups (`chain = group % 16`) reduced by a
//! fixed tree, whether the chains sit in the lanes of one register (GEMV) or in 16 registers whose
//! lanes are 16 rows (GEMM). Different paths differ by float reassociation only.
//!
//! # Quantized weights × int8 activations
//! Activations are quantized per token and group of 32 ([`quantize_activations`]): `x ≈ d·q_x`.
//! A [`crate::quant::QMatrix`] (`w = S·q + M`, unsigned `q`) gives per weight group
//! `Σ_j w·x = d·(S·D + M·Σ_j q_x)` with `D = Σ_j q·q_x` exact in i32. The codes are the unsigned operand of
//! `vpdpbusd`/`vpmaddubsw`, the activation codes the signed one. With the implicit offset
//! `M = −2^(bits−1)·S` the offset term is folded into the integer: `D' = D − 2^(bits−1)·Σ_j q_x` and the
//! group adds `(S·d)·D'`; with an explicit offset it adds `(S·d)·D` and `M·(d·Σ_j q_x)`
//! ([`QuantizedActivations::dsum`]). A group-16 weight group uses the scale of the 32-group of
//! activations containing it and the half-group sums [`QuantizedActivations::sum16`].

pub mod activation;
pub mod attention;
mod avx2;
mod avx512;
pub mod bandwidth;
pub mod gdn;
pub mod norm;
mod ops;
mod packed;
mod pool;
mod quantize;
mod reference;
pub mod rope;
mod scalar;
#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::OnceLock;

use crate::quant::{WeightMatrix, QK};

pub use ops::{Cpu, MatmulTap};
pub use pool::ThreadPool;
pub use quantize::{quantize_activations, quantize_activations_with, quantize_rotated_with, QuantizedActivations};
pub use reference::matmul_reference;

/// A kernel implementation path. Ordered from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kernel {
    /// Portable scalar code.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64; the packed kernel converts f16 group scales with `vcvtph2ps`).
    Avx2,
    /// AVX-512 F + BW + VL + VNNI (x86-64).
    Avx512,
}

impl Kernel {
    /// The best path this CPU supports (runtime detection, no environment override).
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
            {
                return Kernel::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Whether this path can run on this CPU.
    pub fn is_available(self) -> bool {
        self <= Kernel::detect()
    }

    /// Every path available on this CPU, lowest first.
    pub fn available() -> Vec<Kernel> {
        [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512].into_iter().filter(|k| k.is_available()).collect()
    }

    /// Parse `scalar`, `avx2` or `avx512` (case-insensitive).
    pub fn parse(s: &str) -> Option<Kernel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Kernel::Scalar),
            "avx2" => Some(Kernel::Avx2),
            "avx512" => Some(Kernel::Avx512),
            _ => None,
        }
    }

    /// The path used by [`matmul`] and [`quantize_activations`]: [`Kernel::detect`], capped by the
    /// `EDDY_KERNEL` environment variable if set. Decided once per process.
    pub fn active() -> Kernel {
        static ACTIVE: OnceLock<Kernel> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = Kernel::detect();
            match std::env::var("EDDY_KERNEL") {
                Ok(v) => match Kernel::parse(&v) {
                    Some(k) => k.min(best),
                    None => {
                        eprintln!("eddy: ignoring EDDY_KERNEL={v:?} (expected scalar, avx2 or avx512)");
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }
}

/// Whether loaded models should build the prepacked weight layout ([`crate::quant::QMatrix::prepack`]):
/// the [`Kernel::Avx512`] and [`Kernel::Avx2`] paths use it, and `EDDY_PREPACK=0` turns it off. Decided
/// once per process.
pub fn prepack_wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| Kernel::active() >= Kernel::Avx2 && std::env::var("EDDY_PREPACK").map_or(true, |v| v.trim() != "0"))
}

/// Whether the AVX-512 packed kernel may compute its integer dots on AMX (tile `tdpbsud`; same bits as
/// without), for the products where that measured faster (`avx512::amx_pays`): when the CPU and OS
/// allow it ([`amx_available`]) and `EDDY_AMX=0` is not set. Decided once per process.
pub fn amx_wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| {
        Kernel::active() == Kernel::Avx512 && std::env::var("EDDY_AMX").map_or(true, |v| v.trim() != "0") && avx512::amx_available()
    })
}

/// Whether this CPU and OS can run the packed kernel's AMX path (see [`amx_wanted`]).
pub fn amx_available() -> bool {
    avx512::amx_available()
}

/// A raw output pointer shared by workers that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub(crate) *mut T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    #[inline]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Everything a tile kernel needs. `out[t * rows + r]` receives `(row r, token t)`.
pub(crate) struct Ctx<'a> {
    pub(crate) w: &'a WeightMatrix,
    pub(crate) x: &'a [f32],
    pub(crate) xq: &'a QuantizedActivations,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) out: SyncPtr<f32>,
    /// The activations in the token-tile layout of the AVX-512 packed kernel (built once per product by
    /// the calling thread, read by every worker), or null.
    pub(crate) xt: SyncPtr<u8>,
    /// The packed kernel runs its dots on AMX (decided per product; `xt` laid out for its token tiles).
    pub(crate) amx: bool,
}

/// Matrix product `out[t*rows + r] = Σ_c W[r][c] · x[t][c]` for `t in 0..n`, on the [`Kernel::active`]
/// path, split across `pool` by rows.
///
/// * `w`: `rows × cols` weights.
/// * `x`: `n × cols` f32 activations, row-major. Read for `F32`/`Bf16` weights; ignored for
///   quantized weights (may then be empty; if non-empty its length is debug-asserted).
/// * `xq`: `x` quantized by [`quantize_activations`] (`xq.n >= n`, `xq.cols == cols`). Read for
///   quantized weights, ignored otherwise.
/// * `out`: `n × rows` f32, token-major (`out.len() == n * rows`).
///
/// Nothing is allocated. Results are bit-identical for a token regardless of `n` and of the thread
/// count (see the module docs).
pub fn matmul(pool: &ThreadPool, w: &WeightMatrix, x: &[f32], xq: &QuantizedActivations, n: usize, out: &mut [f32]) {
    matmul_with(Kernel::active(), pool, w, x, xq, n, out)
}

/// [`matmul`] on an explicitly chosen path. Panics if `kernel` is not available on this CPU.
pub fn matmul_with(kernel: Kernel, pool: &ThreadPool, w: &WeightMatrix, x: &[f32], xq: &QuantizedActivations, n: usize, out: &mut [f32]) {
    let amx = amx_wanted() && matches!(w, WeightMatrix::Q(m) if avx512::amx_pays(m, n));
    matmul_amx(kernel, amx, pool, w, x, xq, n, out)
}

/// [`matmul_with`] with the packed kernel's AMX path on or off for this product, whatever `n` and the
/// format (`amx` is ignored where AMX is not available, or the matrix is not packed), for tests that
/// compare both paths in one process.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_amx(
    kernel: Kernel,
    amx: bool,
    pool: &ThreadPool,
    w: &WeightMatrix,
    x: &[f32],
    xq: &QuantizedActivations,
    n: usize,
    out: &mut [f32],
) {
    assert!(kernel.is_available(), "kernel path {kernel:?} is not supported by this CPU");
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(out.len(), n * rows, "out must hold n*rows values");
    check_weights(w);
    if let WeightMatrix::Q(m) = w {
        assert!(
            m.has_natural() || (m.packed.is_some() && kernel >= Kernel::Avx2),
            "prepacked weights without their natural codes need a packed kernel (AVX2 or AVX-512), not {kernel:?}"
        );
    }
    match w {
        WeightMatrix::F32 { .. } | WeightMatrix::Bf16 { .. } => {
            assert!(x.len() >= n * cols, "x must hold n*cols values");
        }
        WeightMatrix::Q(_) => {
            assert_eq!(cols % QK, 0, "quantized weights need cols % 32 == 0");
            assert!(xq.n >= n && xq.cols == cols, "xq must hold n tokens of cols values (quantize_activations)");
            assert!(
                xq.q.len() >= n * cols
                    && xq.sum16.len() >= n * cols / 16
                    && xq.scale.len() >= n * cols / QK
                    && xq.sum.len() >= n * cols / QK
                    && xq.dsum.len() >= n * cols / QK,
                "xq buffers too short"
            );
            debug_assert!(x.is_empty() || x.len() >= n * cols);
        }
    }
    let out_signs = match w {
        WeightMatrix::Q(m) => {
            let want = m.rotation.input.as_ref().map_or(0, |s| s.id);
            assert_eq!(xq.rotation, want, "activations quantized for another input rotation than these weights' (quantize_rotated_with)");
            m.rotation.output.as_deref()
        }
        WeightMatrix::F32 { rotation, .. } => rotation.output.as_deref(),
        WeightMatrix::Bf16 { .. } => None,
    };
    if n == 0 || rows == 0 {
        return;
    }
    // Rotated f32 weights (the rotation alone, a check, not a product format): their input side on a copy
    // of the activations.
    let rotated_x: Vec<f32>;
    let x = match w {
        WeightMatrix::F32 { rotation, .. } if rotation.input.is_some() => {
            rotated_x = x[..n * cols]
                .chunks_exact(cols)
                .flat_map(|row| {
                    let mut row = row.to_vec();
                    rotation.rotate_input(&mut row);
                    row
                })
                .collect();
            &rotated_x[..]
        }
        _ => x,
    };
    // The packed kernels (AVX-512, AVX2) read the activations in their token-tile layout, laid out once
    // here (on the calling thread, into a buffer kept per thread) for all workers.
    let packed = matches!(w, WeightMatrix::Q(m) if m.packed.is_some()) && kernel >= Kernel::Avx2;
    let amx = packed && amx && kernel == Kernel::Avx512 && avx512::amx_available();
    let mut xt = if packed { XTILES.with(|b| b.take()) } else { Vec::new() };
    if packed {
        if let WeightMatrix::Q(m) = w {
            let tile = if kernel == Kernel::Avx512 { avx512::packed_tokens(m.bits, amx) } else { avx2::packed_tokens(m.bits) };
            packed::fill_xtiles(m, xq, n, tile, &mut xt);
        }
    }
    let ctx = Ctx {
        w,
        x,
        xq,
        rows,
        cols,
        out: SyncPtr(out.as_mut_ptr()),
        xt: SyncPtr(if packed { xt.as_mut_ptr() as *mut u8 } else { std::ptr::null_mut() }),
        amx,
    };
    // Rows per claimed chunk: a multiple of the 16-row GEMM block (of the 32-row Hadamard block with an
    // output rotation, so that every block lies in one chunk), and at least ~64 K multiply-adds.
    let align = if out_signs.is_some() { 32 } else { 16 };
    let min_chunk = (65536 / (cols * n).max(1)).clamp(16, 256).next_multiple_of(align);
    // SAFETY (both arms): shapes checked above; chunks are disjoint row ranges, so workers write disjoint
    // outputs, and the epilogue reads and writes only its chunk's rows.
    let chunk = |range: Range<usize>| unsafe {
        process_rows(kernel, &ctx, n, range.clone());
        if let Some(signs) = out_signs {
            rotate_output_rows(kernel, &ctx, n, range, signs);
        }
    };
    if pool.n_threads() == 1 || rows * cols * n < 1 << 17 {
        chunk(0..rows);
    } else {
        pool.parallel_for(rows, min_chunk, chunk);
    }
    if packed {
        XTILES.with(|b| b.replace(xt));
    }
}

thread_local! {
    /// The calling thread's buffer for [`Ctx::xt`]: grows to the largest product, then reused.
    static XTILES: std::cell::Cell<Vec<packed::XLine>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Epilogue of a product with an output rotation: `y ← D_out ⊙ (H·y)` on the Hadamard blocks of rows
/// `range` (whole blocks: `range` starts on a multiple of 32 and ends on one or at `rows`) of every token,
/// right after the worker computed them.
///
/// # Safety
/// `range` must be this worker's rows of `ctx.out` (`n × rows`), already computed.
unsafe fn rotate_output_rows(kernel: Kernel, ctx: &Ctx, n: usize, range: Range<usize>, signs: &crate::quant::rotation::Signs) {
    use crate::quant::rotation::{blocks, fwht, BLOCK};
    for t in 0..n {
        let row = std::slice::from_raw_parts_mut(ctx.out.get().add(t * ctx.rows), ctx.rows);
        // `range` starts on a block boundary: skip straight to its first block (`nth` on the block
        // iterator is O(1)) instead of filtering all of them, which made every chunk cost O(rows).
        for (s, len) in blocks(ctx.rows).skip(range.start / BLOCK).take_while(|&(s, _)| s < range.end) {
            debug_assert!(s + len <= range.end);
            let y = &mut row[s..s + len];
            if len == BLOCK {
                quantize::rotate_output_block(kernel, y, &signs.v[s..s + len]);
            } else {
                fwht(y);
                y.iter_mut().zip(&signs.v[s..s + len]).for_each(|(y, s)| *y *= s);
            }
        }
    }
}

fn check_weights(w: &WeightMatrix) {
    let (rows, cols) = (w.rows(), w.cols());
    match w {
        WeightMatrix::F32 { data, .. } => assert!(data.len() >= rows * cols),
        WeightMatrix::Bf16 { data, .. } => assert!(data.len() >= rows * cols),
        WeightMatrix::Q(m) => m.check(),
    }
}

/// Rows processed per block: its weights stay in L2 while every token tile passes over them.
pub(crate) const ROW_BLOCK: usize = 32;

/// Compute outputs for rows `range` and all `n` tokens.
///
/// Scalar/AVX2: row blocks of [`ROW_BLOCK`], token tiles of 4, row tiles of 4 (1 at a row tail); AVX2 on a
/// prepacked matrix: its packed kernel (`avx2.rs`). AVX-512 has its own blocking (see `avx512.rs`).
unsafe fn process_rows(kernel: Kernel, ctx: &Ctx, n: usize, range: Range<usize>) {
    if kernel == Kernel::Avx512 {
        return avx512::rows(ctx, n, range);
    }
    if kernel == Kernel::Avx2 && matches!(ctx.w, WeightMatrix::Q(m) if m.packed.is_some()) {
        return avx2::packed_rows(ctx, n, range);
    }
    // Weight groups of 64/128 (eddy's M/L formats) unpacked: the AVX2 path hands them to the scalar tile.
    let kernel = if kernel == Kernel::Avx2 && matches!(ctx.w, WeightMatrix::Q(m) if m.group > QK) { Kernel::Scalar } else { kernel };
    let mut rb = range.start;
    while rb < range.end {
        let rb_end = (rb + ROW_BLOCK).min(range.end);
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            let mut r = rb;
            while r < rb_end {
                let nr = if rb_end - r >= 4 { 4 } else { 1 };
                match kernel {
                    Kernel::Avx2 => avx2::tile(ctx, r, nr, t, nt),
                    _ => scalar::tile(ctx, r, nr, t, nt),
                }
                r += nr;
            }
            t += nt;
        }
        rb = rb_end;
    }
}
