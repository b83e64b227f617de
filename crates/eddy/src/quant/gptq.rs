//! Hessian-aware rounding of eddy's M format (GPTQ, Frantar et al. 2022, in the LDLQ form of QuIP, Chee et
//! al. 2023; `docs/quant-formats.md`, "Hessian-aware rounding").
//!
//! A matrix `W` (`rows × cols`) that reads inputs `x` is rounded to minimize the output error
//! `tr((Ŵ − W)·H·(Ŵ − W)ᵀ)` with `H = Σ x·xᵀ` over a calibration text ([`Hessian`]), rather than `‖Ŵ − W‖²`.
//! LDLQ: with the decomposition `H = (U̇ + I)·D·(U̇ + I)ᵀ` (`U̇` strictly upper triangular, `D` diagonal;
//! [`ldl_feedback`]), columns are rounded in order, each after adding the linear feedback of the errors
//! of the columns before it: `ŵ_k = Q(w_k + Σ_{j<k} (w_j − ŵ_j)·U̇[j][k])`, which is what GPTQ's update by
//! the Cholesky factor of `H⁻¹` computes (QuIP, Theorem 6), without the inverse. `Q` is the M rounding:
//! each group's `(S, M)` is searched ([`super::rtn::search_scale_min`]) on the group's fed-back values when
//! its first column comes up, then every value takes its nearest code.
//!
//! Cost bounds: `H` is kept and used block-diagonally over column segments of at most [`MAX_SEGMENT`]
//! (e.g. the FFN down projection's 8960 inputs as 5 segments of 1792: the errors of one segment are not fed
//! into the next), so a factorization costs at most `2048³/6` multiply-adds and the feedback
//! `rows·cols·segment/2`. `H` is dampened by [`DAMP`] × its mean diagonal (GPTQ's `percdamp`, whose 1 % is
//! far too little for the few thousand calibration tokens a CPU run takes), and an input that never fired
//! (zero diagonal) gets a diagonal of 1.

use super::rtn::{m_code, minmax_scale_min, search_scale_min, KGrid, K_GROUP};
use super::{super_block, super_blocks, GroupScales, QMatrix, QK, QK_SUPER};
use half::f16;

/// Largest column segment over which `H` is kept whole.
pub const MAX_SEGMENT: usize = 2048;

/// Default dampening of `H` ([`Hessian::damp`]): this fraction of the mean of its diagonal is added to
/// the diagonal. Measured (BENCHMARKS.md, "GPTQ's dampening"; m g128, rotated, 2048 calibration tokens,
/// KL against grid-free sources): on Qwen2.5-Coder-1.5B 0.01 / 0.1 / 0.3 / 1 / 3 give 0.0932 / 0.0695 /
/// 0.0611 / 0.0542 / 0.0612 against 0.0660 rounding to nearest; on the 0.5B 0.01 / 0.1 / 1 give 0.0583 /
/// 0.0468 / 0.0456 against 0.0635, and on a second held-out text 0.0631 / – / 0.0510 against 0.0768. A
/// sample `H` of 2048 tokens for 1536–1792 columns has many small, noisy eigenvalues that GPTQ's usual 1 %
/// lets the error feedback chase.
pub const DAMP: f64 = 1.0;

/// Column segments `(start, len)` of a row of `cols` values: `ceil(cols / MAX_SEGMENT)` pieces of equal
/// length rounded up to a multiple of 128 (so every segment is whole groups of 32/64/128 when `cols` is a
/// multiple of the group), the last one shorter if needed.
pub fn segments(cols: usize) -> Vec<(usize, usize)> {
    let n = cols.div_ceil(MAX_SEGMENT).max(1);
    let len = cols.div_ceil(n).next_multiple_of(128).min(cols.max(1));
    (0..cols).step_by(len.max(1)).map(|s| (s, len.min(cols - s))).collect()
}

/// `H = Σ x·xᵀ` of the inputs of one matrix (or of the matrices that share them), kept as the diagonal
/// blocks of its column [`segments`] (f32, row-major, symmetric after [`Hessian::finish`]).
#[derive(Debug, Clone)]
pub struct Hessian {
    /// Input width.
    pub cols: usize,
    /// Column segments, see [`segments`].
    pub segs: Vec<(usize, usize)>,
    /// `len × len` block of each segment.
    pub blocks: Vec<Vec<f32>>,
    /// Input rows accumulated.
    pub count: usize,
    /// Dampening: this fraction of the mean diagonal is added to the diagonal before factoring
    /// ([`DAMP`] unless set). A calibration text of few tokens against the input width (a sample `H`
    /// with many near-zero eigenvalues) needs more.
    pub damp: f64,
}

impl Hessian {
    /// A zero `H` for inputs of `cols` values.
    pub fn new(cols: usize) -> Self {
        let segs = segments(cols);
        let blocks = segs.iter().map(|&(_, l)| vec![0f32; l * l]).collect();
        Hessian { cols, segs, blocks, count: 0, damp: DAMP }
    }

    /// `H += Σ_t x_t·x_tᵀ` over the `n` rows of `x` (`n × cols`, row-major), on up to `threads` threads. Only
    /// the upper triangle is accumulated; call [`Hessian::finish`] before use.
    pub fn add(&mut self, x: &[f32], n: usize, threads: usize) {
        let cols = self.cols;
        assert_eq!(x.len(), n * cols, "Hessian::add: x is not n × cols");
        const TOK: usize = 64;
        const ROWS: usize = 16;
        for (&(s0, len), h) in self.segs.iter().zip(&mut self.blocks) {
            let chunks: Vec<(usize, &mut [f32])> = h.chunks_mut(ROWS * len).enumerate().collect();
            let threads = threads.clamp(1, chunks.len().max(1));
            let mut per: Vec<Vec<(usize, &mut [f32])>> = (0..threads).map(|_| Vec::new()).collect();
            for (i, c) in chunks {
                per[i % threads].push((i, c));
            }
            std::thread::scope(|sc| {
                for mut mine in per {
                    sc.spawn(move || {
                        for t0 in (0..n).step_by(TOK) {
                            let t1 = (t0 + TOK).min(n);
                            for (ci, hc) in mine.iter_mut() {
                                for (ri, hrow) in hc.chunks_exact_mut(len).enumerate() {
                                    let i = *ci * ROWS + ri;
                                    let mut t = t0;
                                    while t < t1 {
                                        let k = (t1 - t).min(4);
                                        let mut a = [0f32; 4];
                                        let mut src: [&[f32]; 4] = [&[]; 4];
                                        for q in 0..4 {
                                            let tt = if q < k { t + q } else { t };
                                            let row = &x[tt * cols + s0..tt * cols + s0 + len];
                                            a[q] = if q < k { row[i] } else { 0.0 };
                                            src[q] = &row[i..];
                                        }
                                        axpy4(&mut hrow[i..], a, src);
                                        t += k;
                                    }
                                }
                            }
                        }
                    });
                }
            });
        }
        self.count += n;
    }

    /// Mirror the accumulated upper triangle into the lower one.
    pub fn finish(&mut self) {
        for (&(_, len), h) in self.segs.iter().zip(&mut self.blocks) {
            for i in 0..len {
                for j in 0..i {
                    h[i * len + j] = h[j * len + i];
                }
            }
        }
    }
}

/// `dst[c] += Σ_q a[q]·src[q][c]` for `c < dst.len()` (each `src[q]` at least that long), with the widest
/// vector unit available.
#[inline]
pub fn axpy4(dst: &mut [f32], a: [f32; 4], src: [&[f32]; 4]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { axpy4_avx512(dst, a, src) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { axpy4_avx2(dst, a, src) };
        }
    }
    axpy4_body(dst, a, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn axpy4_avx512(dst: &mut [f32], a: [f32; 4], src: [&[f32]; 4]) {
    axpy4_fma(dst, a, src)
}

/// [`axpy4_avx512`]'s operations on 8-lane vectors: the same `fma`s per element, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy4_avx2(dst: &mut [f32], a: [f32; 4], src: [&[f32]; 4]) {
    axpy4_fma(dst, a, src)
}

/// `dst[c] = fma(s3, a3, fma(s2, a2, fma(s1, a1, fma(s0, a0, dst))))` per element (vectorized by the caller's
/// target features).
#[inline(always)]
fn axpy4_fma(dst: &mut [f32], a: [f32; 4], src: [&[f32]; 4]) {
    let n = dst.len();
    let (s0, s1, s2, s3) = (&src[0][..n], &src[1][..n], &src[2][..n], &src[3][..n]);
    for c in 0..n {
        dst[c] = s3[c].mul_add(a[3], s2[c].mul_add(a[2], s1[c].mul_add(a[1], s0[c].mul_add(a[0], dst[c]))));
    }
}

#[inline(always)]
fn axpy4_body(dst: &mut [f32], a: [f32; 4], src: [&[f32]; 4]) {
    let n = dst.len();
    let (s0, s1, s2, s3) = (&src[0][..n], &src[1][..n], &src[2][..n], &src[3][..n]);
    for c in 0..n {
        dst[c] += s0[c] * a[0] + s1[c] * a[1] + s2[c] * a[2] + s3[c] * a[3];
    }
}

/// The strictly upper triangular `U̇` (`n × n`, row-major, zero on and below the diagonal) of
/// `H + λI = (U̇ + I)·D·(U̇ + I)ᵀ`, `H` the `n × n` symmetric block `h`, `λ` = `damp` × its mean diagonal
/// (a zero diagonal entry is set to 1 first). Computed as the Cholesky factor `L` of the reversed matrix
/// `J·H·J = L·Lᵀ` (`J` the reversal): `U̇ + I = J·L·diag(L)⁻¹·J`. f64 throughout.
///
/// Errors: `H` not positive definite even after the dampening (non-finite input).
pub fn ldl_feedback(h: &[f32], n: usize, damp: f64) -> Result<Vec<f32>, String> {
    assert_eq!(h.len(), n * n, "ldl_feedback: h is not n × n");
    let mean = (0..n).map(|i| h[i * n + i] as f64).sum::<f64>() / n.max(1) as f64;
    let lambda = damp * if mean > 0.0 { mean } else { 1.0 };
    // a = J·H·J + λI (lower triangle used), factored in place into L.
    let mut a = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let v = h[(n - 1 - i) * n + (n - 1 - j)] as f64;
            a[i * n + j] = if i == j { (if v > 0.0 { v } else { 1.0 }) + lambda } else { v };
        }
    }
    // Row-oriented Cholesky, rows in fours: the dot products of four rows with an earlier row share its
    // reads (the factorization streams n³/6 values, so that cuts its memory traffic by four).
    let mut i0 = 0;
    while i0 < n {
        let nb = (n - i0).min(4);
        let (done, rest) = a.split_at_mut(i0 * n);
        for j in 0..i0 {
            let lj = &done[j * n..j * n + j];
            let d = dot4(&rest[..nb * n], n, nb, lj);
            let ljj = done[j * n + j];
            for (b, d) in d.iter().enumerate().take(nb) {
                rest[b * n + j] = (rest[b * n + j] - d) / ljj;
            }
        }
        for b in 0..nb {
            let i = i0 + b;
            let (prev, cur) = rest.split_at_mut(b * n);
            let ri = &mut cur[..n];
            for j in i0..=i {
                let rj: &[f64] = if j < i { &prev[(j - i0) * n..(j - i0) * n + j] } else { &ri[..j] };
                let s = ri[j] - dot64(&ri[..j], rj);
                if j == i {
                    if !(s > 0.0 && s.is_finite()) {
                        return Err(format!("H is not positive definite (pivot {s:e} at {i})"));
                    }
                    ri[i] = s.sqrt();
                } else {
                    ri[j] = s / prev[(j - i0) * n + j];
                }
            }
        }
        i0 += nb;
    }
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        for k in i + 1..n {
            // U̇[i][k] = L'[n−1−i][n−1−k], L' = L·diag(L)⁻¹.
            let (li, lk) = (n - 1 - i, n - 1 - k);
            u[i * n + k] = (a[li * n + lk] / a[lk * n + lk]) as f32;
        }
    }
    Ok(u)
}

/// `Σ a[i]·b[i]` in f64 with four accumulators.
#[inline]
fn dot64(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut s = [0f64; 4];
    let mut i = 0;
    while i + 4 <= n {
        for q in 0..4 {
            s[q] += a[i + q] * b[i + q];
        }
        i += 4;
    }
    let mut t = (s[0] + s[1]) + (s[2] + s[3]);
    while i < n {
        t += a[i] * b[i];
        i += 1;
    }
    t
}

/// The dot products of the first `l.len()` values of rows `0..nb` (`nb ≤ 4`, stride `n`) of `rows` with `l`.
fn dot4(rows: &[f64], n: usize, nb: usize, l: &[f64]) -> [f64; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { dot4_avx512(rows, n, nb, l) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { dot4_avx2(rows, n, nb, l) };
        }
    }
    dot4_body(rows, n, nb, l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot4_avx512(rows: &[f64], n: usize, nb: usize, l: &[f64]) -> [f64; 4] {
    dot4_body(rows, n, nb, l)
}

/// [`dot4_body`] vectorized for AVX2 (its 8 accumulators per row fix the order: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(rows: &[f64], n: usize, nb: usize, l: &[f64]) -> [f64; 4] {
    dot4_body(rows, n, nb, l)
}

#[inline(always)]
fn dot4_body(rows: &[f64], n: usize, nb: usize, l: &[f64]) -> [f64; 4] {
    let m = l.len();
    let r = |b: usize| if b < nb { &rows[b * n..b * n + m] } else { &rows[..m] };
    let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
    let mut acc = [[0f64; 8]; 4];
    let mut c = 0;
    while c + 8 <= m {
        for q in 0..8 {
            let x = l[c + q];
            acc[0][q] += r0[c + q] * x;
            acc[1][q] += r1[c + q] * x;
            acc[2][q] += r2[c + q] * x;
            acc[3][q] += r3[c + q] * x;
        }
        c += 8;
    }
    let mut out = [0f64; 4];
    for b in 0..4 {
        let a = &acc[b];
        let mut t = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        let rb = [r0, r1, r2, r3][b];
        for k in c..m {
            t += rb[k] * l[k];
        }
        out[b] = t;
    }
    out
}

/// One tile of rows of [`quantize_m`]: its index, its codes and its groups' `(S, M)`.
type Tile<'a> = (usize, &'a mut [u8], &'a mut [(f32, f32)]);

/// Columns rounded between feedback updates from earlier blocks (a multiple of every group size).
const BLOCK_COLS: usize = 128;
/// Rows processed together (they share every read of `U̇`).
const TILE_ROWS: usize = 16;

/// M codes of `w` (`rows × cols`, row-major, already rotated if the matrix is) by LDLQ against `h` (the
/// Hessian of the inputs as the matrix sees them: rotated inputs for a rotated matrix), group `group`, on
/// up to `threads` threads. Returns the [`QMatrix`] (no rotation set).
///
/// Errors: a segment of `h` that cannot be factored ([`ldl_feedback`]).
///
/// # Panics
/// If the shapes disagree, or `cols` is not a multiple of `group` (a multiple of 32).
pub fn quantize_m(rows: usize, cols: usize, w: &[f32], group: usize, h: &Hessian, threads: usize) -> Result<QMatrix, String> {
    let (codes, sm) = ldlq(rows, cols, w, group, None, h, threads)?;
    let mut m = super::rtn::m_matrix(rows, cols, group);
    let GroupScales::F16 { scale, min: Some(min) } = &mut m.scales else { unreachable!("M matrix") };
    for (g, &(s, mn)) in sm.iter().enumerate() {
        // f32 forms of f16 values: exact.
        scale[g] = f16::from_f32(s);
        min[g] = f16::from_f32(mn);
    }
    pack_codes(&codes, &mut m.lo);
    m.check();
    Ok(m)
}

/// Headroom of the K grid fixed before the feedback ([`quantize_k`]): the super-scales are this much above
/// what the original values' groups need, so that groups whose fed-back values spread a little wider are
/// not clipped by the 6-bit multipliers.
pub const K_GRID_HEADROOM: f32 = 1.05;

/// K codes ([`super::rtn::Format::K`], `cols % 32 == 0`; the last super-block of a row partial when
/// `cols % 256 != 0`, [`super::super_blocks`]) of `w` by LDLQ against `h`, as [`quantize_m`]. The
/// super-block grids are fixed first ([`KGrid::fit`] of each group's searched `(S, M)` on the original
/// values, times [`K_GRID_HEADROOM`]); when a group's first column comes up its `(S, M)` is searched on the
/// fed-back values and its multipliers picked on that grid ([`KGrid::pick`]).
///
/// Errors and panics as [`quantize_m`]; panics if `cols % 32 != 0`.
pub fn quantize_k(rows: usize, cols: usize, w: &[f32], h: &Hessian, threads: usize) -> Result<QMatrix, String> {
    assert!(cols.is_multiple_of(QK) && cols > 0, "gptq: K needs cols % 32 == 0, got {cols}");
    let f32s = |(s, m): (f16, f16)| (s.to_f32() * K_GRID_HEADROOM, m.to_f32() * K_GRID_HEADROOM);
    // One grid per super-block, row-major: `super_blocks(cols)` per row.
    let grids: Vec<KGrid> = w
        .chunks_exact(cols)
        .flat_map(|row| row.chunks(QK_SUPER))
        .map(|sb| KGrid::fit(&sb.chunks_exact(K_GROUP).map(|g| f32s(search_scale_min(g))).collect::<Vec<_>>()))
        .collect();
    let (codes, sm) = ldlq(rows, cols, w, K_GROUP, Some(&grids), h, threads)?;
    let mut m = super::rtn::k_matrix(rows, cols);
    let GroupScales::SuperI8 { sc, mn: Some(mn), d, dmin } = &mut m.scales else { unreachable!("K matrix") };
    for (sb, g) in grids.iter().enumerate() {
        (d[sb], dmin[sb]) = (g.d, g.dmin);
    }
    // `sm` holds the f32 products `d·sc`, `dmin·mn` of small integers: the quotients round back exactly.
    let mult = |v: f32, step: f32| if step == 0.0 { 0 } else { (v / step).round() as i8 };
    let gpr = cols / K_GROUP;
    for (gi, &(s, m)) in sm.iter().enumerate() {
        let g = grids[super_block(cols, gi / gpr, gi % gpr * K_GROUP)];
        (sc[gi], mn[gi]) = (mult(s, g.d), mult(m, g.dmin));
    }
    pack_codes(&codes, &mut m.lo);
    m.check();
    Ok(m)
}

/// Codes one per byte into the 4-bit block layout of [`QMatrix::lo`].
fn pack_codes(codes: &[u8], lo: &mut [u8]) {
    for (b, p) in codes.chunks_exact(QK).zip(lo.chunks_exact_mut(QK / 2)) {
        for k in 0..QK / 2 {
            p[k] = b[k] | (b[k + 16] << 4);
        }
    }
}

/// Codes one per byte and each group's `(S, M)`, as [`ldlq`] returns them.
type Rounded = (Vec<u8>, Vec<(f32, f32)>);

/// LDLQ of the whole matrix: codes one per byte and each group's `(S, M)` (f32 forms of what is stored: f16
/// values for M, the grid's products for K when `grids` holds one [`KGrid`] per super-block).
fn ldlq(
    rows: usize,
    cols: usize,
    w: &[f32],
    group: usize,
    grids: Option<&[KGrid]>,
    h: &Hessian,
    threads: usize,
) -> Result<Rounded, String> {
    assert_eq!(w.len(), rows * cols, "gptq: w is not rows × cols");
    assert_eq!(h.cols, cols, "gptq: Hessian of {} inputs for {cols} columns", h.cols);
    assert!(group.is_multiple_of(QK) && cols.is_multiple_of(group), "gptq: group {group} for {cols} columns");
    let mut codes = vec![0u8; rows * cols];
    let mut sm = vec![(0f32, 0f32); rows * cols / group];
    let gpr = cols / group;
    for (&(s0, len), hb) in h.segs.iter().zip(&h.blocks) {
        assert!(s0.is_multiple_of(group) && len.is_multiple_of(group), "gptq: segment ({s0}, {len}) not whole groups of {group}");
        let u = ldl_feedback(hb, len, h.damp)?;
        let u = &u[..];
        let tiles: Vec<Tile> =
            codes.chunks_mut(TILE_ROWS * cols).zip(sm.chunks_mut(TILE_ROWS * gpr)).enumerate().map(|(i, (c, s))| (i, c, s)).collect();
        let threads = threads.clamp(1, tiles.len().max(1));
        let mut per: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, t) in tiles.into_iter().enumerate() {
            per[i % threads].push(t);
        }
        std::thread::scope(|sc| {
            for mine in per {
                sc.spawn(move || {
                    for (ti, c, s) in mine {
                        let r0 = ti * TILE_ROWS;
                        let nr = c.len() / cols;
                        let sbpr = super_blocks(cols);
                        let g = grids.map(|g| &g[r0 * sbpr..(r0 + nr) * sbpr]);
                        ldlq_tile(&w[r0 * cols..(r0 + nr) * cols], nr, cols, s0, len, group, g, u, c, s);
                    }
                });
            }
        });
    }
    Ok((codes, sm))
}

/// LDLQ of segment `s0..s0 + len` of `nr` rows of `w` (`nr × cols`): codes into `codes` (`nr × cols`, one per
/// byte), each group's `(S, M)` into `sm` (`nr × cols/group`); K grids of these rows in `grids`.
#[allow(clippy::too_many_arguments)]
fn ldlq_tile(
    w: &[f32],
    nr: usize,
    cols: usize,
    s0: usize,
    len: usize,
    group: usize,
    grids: Option<&[KGrid]>,
    u: &[f32],
    codes: &mut [u8],
    sm: &mut [(f32, f32)],
) {
    let gpr = cols / group;
    let f32s = |(s, m): (f16, f16)| (s.to_f32(), m.to_f32());
    // e[r][j]: w − ŵ of column s0 + j; t[r][..]: the fed-back values of the current block.
    let mut e = vec![0f32; nr * len];
    let mut t = vec![0f32; nr * BLOCK_COLS];
    for b0 in (0..len).step_by(BLOCK_COLS) {
        let b1 = (b0 + BLOCK_COLS).min(len);
        let bl = b1 - b0;
        // Feedback from the columns of earlier blocks.
        for r in 0..nr {
            let tr = &mut t[r * BLOCK_COLS..r * BLOCK_COLS + bl];
            tr.copy_from_slice(&w[r * cols + s0 + b0..r * cols + s0 + b1]);
            let er = &e[r * len..r * len + b0];
            let mut j = 0;
            while j < b0 {
                let k = (b0 - j).min(4);
                let mut a = [0f32; 4];
                let mut src: [&[f32]; 4] = [&[]; 4];
                for q in 0..4 {
                    let jj = if q < k { j + q } else { j };
                    a[q] = if q < k { er[jj] } else { 0.0 };
                    src[q] = &u[jj * len + b0..jj * len + b1];
                }
                axpy4(tr, a, src);
                j += k;
            }
        }
        // Within the block, column by column, the feedback applied right away.
        for k in b0..b1 {
            let uk = &u[k * len..(k + 1) * len];
            for r in 0..nr {
                let tr = &mut t[r * BLOCK_COLS..r * BLOCK_COLS + bl];
                let gi = r * gpr + (s0 + k) / group;
                if k.is_multiple_of(group) {
                    // The group lies inside this block (blocks are whole groups).
                    let lo = k - b0;
                    let vals = &tr[lo..lo + group];
                    sm[gi] = match grids {
                        None => f32s(search_scale_min(vals)),
                        Some(gs) => {
                            let g = gs[super_block(cols, r, s0 + k)];
                            let (sc, mn, _) = g.pick(vals, &[f32s(search_scale_min(vals)), f32s(minmax_scale_min(vals))]);
                            g.value(sc, mn)
                        }
                    };
                }
                let (s, m) = sm[gi];
                let x = tr[k - b0];
                let (q, deq) = if s > 0.0 && s.is_finite() && m.is_finite() {
                    let q = m_code(x, s, m);
                    (q, s * q as f32 + m)
                } else {
                    (0, m)
                };
                codes[r * cols + s0 + k] = q;
                let err = w[r * cols + s0 + k] - deq;
                e[r * len + k] = err;
                for c in k + 1..b1 {
                    tr[c - b0] += err * uk[c];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rotation::splitmix64;
    use super::super::rtn::{self, Format};
    use super::super::WeightMatrix;
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn uni(&mut self) -> f32 {
            (splitmix64(&mut self.0) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    }

    /// `n × cols` inputs with correlated features: a few shared factors plus per-feature noise and scales
    /// that vary by feature (as activations do), never zero.
    fn inputs(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
        let k = 6;
        let load: Vec<f32> = (0..k * cols).map(|_| rng.uni()).collect();
        let scale: Vec<f32> = (0..cols).map(|c| 0.2 + 2.0 * ((c * 7919) % 13) as f32 / 13.0).collect();
        let mut x = vec![0f32; n * cols];
        for t in 0..n {
            let f: Vec<f32> = (0..k).map(|_| 3.0 * rng.uni()).collect();
            for c in 0..cols {
                let v: f32 = (0..k).map(|q| f[q] * load[q * cols + c]).sum::<f32>() + 0.3 * rng.uni();
                x[t * cols + c] = v * scale[c];
            }
        }
        x
    }

    #[test]
    fn segments_are_whole_groups_and_cover_the_row() {
        assert_eq!(segments(1536), vec![(0, 1536)]);
        assert_eq!(segments(8960), vec![(0, 1792), (1792, 1792), (3584, 1792), (5376, 1792), (7168, 1792)]);
        assert_eq!(segments(2048), vec![(0, 2048)]);
        for cols in [32, 96, 2080, 4864, 18944] {
            let s = segments(cols);
            assert_eq!(s.iter().map(|x| x.1).sum::<usize>(), cols);
            assert!(s.iter().all(|&(a, l)| a % 128 == 0 && l <= MAX_SEGMENT && (l % 32 == 0)));
        }
    }

    /// The accumulated H equals Σ x·xᵀ computed directly (segment blocks), and the decomposition
    /// reproduces H + λI.
    #[test]
    fn hessian_and_ldl_decomposition_are_exact() {
        let mut rng = Rng(5);
        let (n, cols) = (37, 99);
        let x = inputs(n, cols, &mut rng);
        let mut h = Hessian::new(cols);
        h.add(&x[..20 * cols], 20, 2);
        h.add(&x[20 * cols..], n - 20, 1);
        h.finish();
        assert_eq!(h.count, n);
        let hb = &h.blocks[0];
        for i in 0..cols {
            for j in 0..cols {
                let want: f64 = (0..n).map(|t| x[t * cols + i] as f64 * x[t * cols + j] as f64).sum();
                assert!((hb[i * cols + j] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()), "H[{i}][{j}] {} vs {want}", hb[i * cols + j]);
            }
        }
        let u = ldl_feedback(hb, cols, DAMP).expect("positive definite");
        // Rebuild (U̇ + I)·D·(U̇ + I)ᵀ: D[k] is fixed by the last row/column; check every entry against
        // H + λI with D solved from the diagonal, going from the last index down.
        let mean = (0..cols).map(|i| hb[i * cols + i] as f64).sum::<f64>() / cols as f64;
        let hd = |i: usize, j: usize| hb[i * cols + j] as f64 + if i == j { DAMP * mean } else { 0.0 };
        let ui = |i: usize, k: usize| {
            if i == k {
                1.0
            } else if i < k {
                u[i * cols + k] as f64
            } else {
                0.0
            }
        };
        let mut d = vec![0f64; cols];
        for k in (0..cols).rev() {
            d[k] = hd(k, k) - (k + 1..cols).map(|m| ui(k, m).powi(2) * d[m]).sum::<f64>();
            assert!(d[k] > 0.0);
        }
        for i in 0..cols {
            for j in 0..cols {
                let v: f64 = (0..cols).map(|m| ui(i, m) * d[m] * ui(j, m)).sum();
                assert!((v - hd(i, j)).abs() <= 1e-3 * (1.0 + hd(i, j).abs()), "({i},{j}) {v} vs {}", hd(i, j));
            }
        }
        assert!(u.iter().enumerate().all(|(p, &v)| p / cols < p % cols || v == 0.0), "U̇ must be strictly upper");
    }

    /// On a random matrix with correlated inputs, LDLQ's output error ‖(W − Ŵ)·X‖ is well below round to
    /// nearest's (same searched group scales, same format: M at groups 32/64/128 and K), also across two
    /// column segments.
    #[test]
    fn gptq_output_error_is_below_rtn() {
        let mut rng = Rng(9);
        // Group 0: format K (group 32 under 256-value super-blocks; 896 = 3·256 + a partial super-block of 128).
        for (rows, cols, group) in [(48, 256, 64), (40, 2560, 128), (33, 192, 32), (24, 512, 0), (20, 896, 0)] {
            let n = 300;
            let x = inputs(n, cols, &mut rng);
            let w: Vec<f32> = (0..rows * cols).map(|_| 0.05 * (rng.uni() + rng.uni() + rng.uni())).collect();
            let mut h = Hessian::new(cols);
            h.add(&x, n, 2);
            h.finish();
            let (format, g) = if group == 0 {
                (Format::K, quantize_k(rows, cols, &w, &h, 2))
            } else {
                (Format::M, quantize_m(rows, cols, &w, group, &h, 2))
            };
            let g = g.expect("gptq");
            let WeightMatrix::Q(r) = rtn::quantize(rows, cols, &w, format, group.max(32), Default::default()) else { panic!() };
            assert_eq!(std::mem::discriminant(&g.scales), std::mem::discriminant(&r.scales));
            let out_err = |m: &QMatrix| -> f64 {
                let wm = WeightMatrix::Q(m.clone());
                let mut row = vec![0f32; cols];
                let mut tot = 0f64;
                for o in 0..rows {
                    wm.dequant_row(o, &mut row);
                    for t in 0..n {
                        let y: f64 = (0..cols).map(|c| (row[c] - w[o * cols + c]) as f64 * x[t * cols + c] as f64).sum();
                        tot += y * y;
                    }
                }
                tot
            };
            let (eg, er) = (out_err(&g), out_err(&r));
            assert!(eg < 0.75 * er, "{rows}x{cols} g{group}: GPTQ {eg:e} vs RTN {er:e}");
        }
    }
}
