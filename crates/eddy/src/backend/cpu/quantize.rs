//! Per-token, per-32-group int8 quantization of activations, with the input side of a weight rotation
//! (`x̃ = H·(D_in ⊙ x)`, `crate::quant::rotation`) fused in.

use super::{Kernel, SyncPtr, ThreadPool};
use crate::quant::rotation::Signs;
use crate::quant::QK;

/// Activations quantized to int8 per token (row of `x`) and per group of [`QK`] = 32 values.
///
/// For token `t` and group `g` (`G = cols / 32` groups per token, index `t*G + g`):
/// `d = scale[t*G+g] = max|x| / 127` (f32), codes `q[t*cols + g*32 + j] ∈ [-127, 127]` with
/// `x ≈ d·q`, `sum[t*G+g] = Σ_j q` (i32), `dsum[t*G+g] = d · (Σ_j q as f32)` (f32, the offset term's
/// activation factor), and `sum16[2(t*G+g) + h] = Σ_{j<16} q[.. + 16h + j]` (sums per half group, for
/// group-16 weights).
/// A group with `max|x| < 1e-30` (in particular an all-zero group) has `d = 0` and all codes 0.
/// Buffers are reused across calls; they only grow.
#[derive(Debug, Clone, Default)]
pub struct QuantizedActivations {
    /// Number of tokens.
    pub n: usize,
    /// Values per token (a multiple of 32).
    pub cols: usize,
    /// `n * cols` codes in `[-127, 127]`, token-major.
    pub q: Vec<i8>,
    /// `n * cols / 32` group scales `d` (f32), `x ≈ d·q`.
    pub scale: Vec<f32>,
    /// `n * cols / 32` per-group sums of the codes.
    pub sum: Vec<i32>,
    /// `n * cols / 32` values `scale · (sum as f32)` (one f32 multiply, rounded).
    pub dsum: Vec<f32>,
    /// `n * cols / 16` sums of the codes per 16 values.
    pub sum16: Vec<i32>,
    /// [`Signs::id`] of the input rotation applied before quantizing (0: none); a product checks it
    /// against its weights' input signs.
    pub rotation: u64,
}

impl QuantizedActivations {
    /// Empty buffers; [`quantize_activations`] sizes them.
    pub fn new() -> Self {
        Self::default()
    }

    /// Dequantize token `t` into `out` (`cols` values): `out[c] = d_g · q[c]`.
    pub fn dequantize_row(&self, t: usize, out: &mut [f32]) {
        assert!(t < self.n && out.len() == self.cols);
        let gpr = self.cols / QK;
        for (c, o) in out.iter_mut().enumerate() {
            *o = self.scale[t * gpr + c / QK] * self.q[t * self.cols + c] as f32;
        }
    }

    fn resize(&mut self, n: usize, cols: usize) {
        self.n = n;
        self.cols = cols;
        self.q.resize(n * cols, 0);
        self.sum16.resize(n * cols / 16, 0);
        self.scale.resize(n * cols / QK, 0.0);
        self.sum.resize(n * cols / QK, 0);
        self.dsum.resize(n * cols / QK, 0.0);
    }
}

/// Quantize `x` (`n × cols` f32, row-major, `cols % 32 == 0`) into `out`, reusing its buffers (no
/// allocation once they are large enough), on the [`Kernel::active`] path.
///
/// Per group of 32: `amax = max|x|`, `d = amax / 127`, codes `q = round(x · (127 / amax))` rounded to
/// nearest with **ties to even**, clamped to `[-127, 127]`. All paths produce bit-identical output
/// (for finite inputs; NaN/inf inputs give unspecified codes). Large batches are split across `pool`
/// by tokens.
pub fn quantize_activations(pool: &ThreadPool, x: &[f32], n: usize, cols: usize, out: &mut QuantizedActivations) {
    quantize_activations_with(Kernel::active(), pool, x, n, cols, out)
}

/// [`quantize_activations`] on an explicitly chosen path. Panics if `kernel` is not available.
pub fn quantize_activations_with(kernel: Kernel, pool: &ThreadPool, x: &[f32], n: usize, cols: usize, out: &mut QuantizedActivations) {
    quantize_rotated_with(kernel, pool, x, n, cols, None, out)
}

/// Values rotated per step of the fused rotation (8 groups of 32, a 1 KiB stack buffer).
const ROT_GROUPS: usize = 8;

/// [`quantize_activations_with`] of `H·(D_in ⊙ x)` per token, `D_in` = `signs` (`cols` of them; `None` =
/// no rotation): the rotation of every group of 32 is done in registers / a stack buffer right before the
/// group is quantized (no pass over the activations of its own). `out.rotation` records the signs' id.
/// The rotated values are bit-identical on every path (same butterfly order, see
/// [`crate::quant::rotation::fwht`]), so the codes are too.
///
/// Panics if `kernel` is not available, `cols % 32 != 0`, `x` is short, or `signs` does not number `cols`.
pub fn quantize_rotated_with(
    kernel: Kernel,
    pool: &ThreadPool,
    x: &[f32],
    n: usize,
    cols: usize,
    signs: Option<&Signs>,
    out: &mut QuantizedActivations,
) {
    assert!(kernel.is_available(), "kernel path {kernel:?} is not supported by this CPU");
    assert_eq!(cols % QK, 0, "cols must be a multiple of 32");
    assert!(x.len() >= n * cols, "x must hold n*cols values");
    assert!(signs.is_none_or(|s| s.len() == cols), "input rotation: {cols} values per token for {} signs", signs.map_or(0, |s| s.len()));
    out.resize(n, cols);
    out.rotation = signs.map_or(0, |s| s.id);
    let gpr = cols / QK;
    let q = SyncPtr(out.q.as_mut_ptr());
    let s16 = SyncPtr(out.sum16.as_mut_ptr());
    let sc = SyncPtr(out.scale.as_mut_ptr());
    let sm = SyncPtr(out.sum.as_mut_ptr());
    let ds = SyncPtr(out.dsum.as_mut_ptr());
    let groups = n * cols / QK;
    let body = |range: std::ops::Range<usize>| {
        // SAFETY: groups in `range` are disjoint between calls; buffers were sized above.
        unsafe {
            let g0 = range.start;
            let ng = range.len();
            let xs = &x[g0 * QK..(g0 + ng) * QK];
            let q = std::slice::from_raw_parts_mut(q.get().add(g0 * QK), ng * QK);
            let sc = std::slice::from_raw_parts_mut(sc.get().add(g0), ng);
            let sm = std::slice::from_raw_parts_mut(sm.get().add(g0), ng);
            match signs {
                None => quantize_groups(kernel, xs, q, sc, sm),
                Some(signs) => {
                    let mut buf = [0f32; ROT_GROUPS * QK];
                    let mut g = 0;
                    while g < ng {
                        let k = (ng - g).min(ROT_GROUPS);
                        for i in 0..k {
                            let sg = &signs.v[(g0 + g + i) % gpr * QK..][..QK];
                            rotate_group(kernel, &xs[(g + i) * QK..][..QK], sg, &mut buf[i * QK..][..QK]);
                        }
                        let (qs, scs, sms) = (&mut q[g * QK..(g + k) * QK], &mut sc[g..g + k], &mut sm[g..g + k]);
                        quantize_groups(kernel, &buf[..k * QK], qs, scs, sms);
                        g += k;
                    }
                }
            }
            let ds = std::slice::from_raw_parts_mut(ds.get().add(g0), ng);
            let s16 = std::slice::from_raw_parts_mut(s16.get().add(2 * g0), 2 * ng);
            for g in 0..ng {
                ds[g] = sc[g] * sm[g] as f32;
                let h: i32 = q[g * QK..g * QK + 16].iter().map(|&v| v as i32).sum();
                s16[2 * g] = h;
                s16[2 * g + 1] = sm[g] - h;
            }
        }
    };
    if groups < 4096 || pool.n_threads() == 1 {
        body(0..groups);
    } else {
        pool.parallel_for(groups, 1024, body);
    }
}

/// `out = H₃₂·(signs ⊙ x)` for one group of 32 ([`crate::quant::rotation::fwht`]'s operation order on every
/// path).
#[inline]
fn rotate_group(kernel: Kernel, x: &[f32], signs: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the AVX-512 path was checked to be available; all slices hold 32 values.
        return unsafe { simd::rotate_avx512(x, signs, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx2 {
        // SAFETY: the AVX2 path was checked to be available; all slices hold 32 values.
        return unsafe { simd::rotate_avx2(x, signs, out) };
    }
    let _ = kernel;
    for ((o, &v), &s) in out.iter_mut().zip(x).zip(signs) {
        *o = v * s;
    }
    crate::quant::rotation::fwht(out);
}

/// `y ← signs ⊙ (H₃₂·y)` for one block of 32 outputs: the output side of a rotated product's epilogue
/// (`crate::quant::rotation`). Bit-identical on every path: the AVX-512 and AVX2 butterflies do the scalar
/// [`crate::quant::rotation::fwht`]'s operations in its order, and a product with `±1` is exact.
///
/// Panics (debug) if `y` or `signs` holds fewer than 32 values.
pub(crate) fn rotate_output_block(kernel: Kernel, y: &mut [f32], signs: &[f32]) {
    debug_assert!(y.len() >= QK && signs.len() >= QK);
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the AVX-512 path was checked to be available; both slices hold 32 values.
        return unsafe { simd::rotate_output_avx512(y, signs) };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx2 {
        // SAFETY: the AVX2 path was checked to be available; both slices hold 32 values.
        return unsafe { simd::rotate_output_avx2(y, signs) };
    }
    let _ = kernel;
    crate::quant::rotation::fwht(&mut y[..QK]);
    y.iter_mut().zip(signs).for_each(|(y, s)| *y *= s);
}

/// Scale, inverse scale for a group with maximum magnitude `amax`.
#[inline]
pub(crate) fn group_scale(amax: f32) -> (f32, f32) {
    if amax >= 1e-30 {
        (amax / 127.0, 127.0 / amax)
    } else {
        (0.0, 0.0)
    }
}

unsafe fn quantize_groups(kernel: Kernel, x: &[f32], q: &mut [i8], sc: &mut [f32], sm: &mut [i32]) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => simd::quantize_avx512(x, q, sc, sm),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => simd::quantize_avx2(x, q, sc, sm),
        _ => quantize_scalar(x, q, sc, sm),
    }
}

fn quantize_scalar(x: &[f32], q: &mut [i8], sc: &mut [f32], sm: &mut [i32]) {
    for g in 0..sc.len() {
        let xs = &x[g * QK..(g + 1) * QK];
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, inv) = group_scale(amax);
        let mut sum = 0i32;
        for j in 0..QK {
            let v = (xs[j] * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
            q[g * QK + j] = v as i8;
            sum += v;
        }
        sc[g] = d;
        sm[g] = sum;
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{group_scale, QK};
    use std::arch::x86_64::*;

    /// `out = H₃₂·(signs ⊙ x)`: strides 1, 2, 4, 8 inside each 16-lane half (partner lane `i ^ h` by a
    /// permute; lanes with bit `h` set take `partner − self`, the others `self + partner`), stride 16
    /// across the halves, then `× 1/√32`: the scalar butterfly's operations, so bit-identical.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rotate_avx512(x: &[f32], signs: &[f32], out: &mut [f32]) {
        debug_assert!(x.len() >= QK && signs.len() >= QK && out.len() >= QK);
        let a = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(signs.as_ptr()));
        let b = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(16)), _mm512_loadu_ps(signs.as_ptr().add(16)));
        let (lo, hi) = butterfly32(a, b);
        _mm512_storeu_ps(out.as_mut_ptr(), lo);
        _mm512_storeu_ps(out.as_mut_ptr().add(16), hi);
    }

    /// `y ← signs ⊙ (H₃₂·y)`: [`butterfly32`], then the signs (exact).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rotate_output_avx512(y: &mut [f32], signs: &[f32]) {
        debug_assert!(y.len() >= QK && signs.len() >= QK);
        let (lo, hi) = butterfly32(_mm512_loadu_ps(y.as_ptr()), _mm512_loadu_ps(y.as_ptr().add(16)));
        _mm512_storeu_ps(y.as_mut_ptr(), _mm512_mul_ps(lo, _mm512_loadu_ps(signs.as_ptr())));
        _mm512_storeu_ps(y.as_mut_ptr().add(16), _mm512_mul_ps(hi, _mm512_loadu_ps(signs.as_ptr().add(16))));
    }

    /// `H₃₂·(a ‖ b)` as (first 16, last 16) values: strides 1, 2, 4, 8 inside each half, stride 16 across
    /// them, then `× 1/√32` — the scalar butterfly's operations in its order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn butterfly32(mut a: __m512, mut b: __m512) -> (__m512, __m512) {
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (h, hi) in [(1, 0xAAAAu16), (2, 0xCCCC), (4, 0xF0F0), (8, 0xFF00)] {
            let idx = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
            let pa = _mm512_permutexvar_ps(idx, a);
            a = _mm512_mask_sub_ps(_mm512_add_ps(a, pa), hi, pa, a);
            let pb = _mm512_permutexvar_ps(idx, b);
            b = _mm512_mask_sub_ps(_mm512_add_ps(b, pb), hi, pb, b);
        }
        let s = _mm512_set1_ps(1.0 / (QK as f32).sqrt());
        (_mm512_mul_ps(_mm512_add_ps(a, b), s), _mm512_mul_ps(_mm512_sub_ps(a, b), s))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn quantize_avx512(x: &[f32], q: &mut [i8], sc: &mut [f32], sm: &mut [i32]) {
        for g in 0..sc.len() {
            let p = x.as_ptr().add(g * QK);
            let a = _mm512_loadu_ps(p);
            let b = _mm512_loadu_ps(p.add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            let (d, inv) = group_scale(amax);
            let vi = _mm512_set1_ps(inv);
            const R: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let ia = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvt_roundps_epi32::<R>(_mm512_mul_ps(a, vi)), _mm512_set1_epi32(127)),
                _mm512_set1_epi32(-127),
            );
            let ib = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvt_roundps_epi32::<R>(_mm512_mul_ps(b, vi)), _mm512_set1_epi32(127)),
                _mm512_set1_epi32(-127),
            );
            let qa = _mm512_cvtepi32_epi8(ia);
            let qb = _mm512_cvtepi32_epi8(ib);
            let qp = q.as_mut_ptr().add(g * QK) as *mut __m128i;
            _mm_storeu_si128(qp, qa);
            _mm_storeu_si128(qp.add(1), qb);
            sc[g] = d;
            sm[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
        }
    }

    /// [`rotate_avx512`] with AVX2: `out = H₃₂·(signs ⊙ x)`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rotate_avx2(x: &[f32], signs: &[f32], out: &mut [f32]) {
        debug_assert!(x.len() >= QK && signs.len() >= QK && out.len() >= QK);
        let v = std::array::from_fn(|i| _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * i)), _mm256_loadu_ps(signs.as_ptr().add(8 * i))));
        for (i, r) in butterfly32_avx2(v).into_iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), r);
        }
    }

    /// [`rotate_output_avx512`] with AVX2: `y ← signs ⊙ (H₃₂·y)`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rotate_output_avx2(y: &mut [f32], signs: &[f32]) {
        debug_assert!(y.len() >= QK && signs.len() >= QK);
        let v = std::array::from_fn(|i| _mm256_loadu_ps(y.as_ptr().add(8 * i)));
        for (i, r) in butterfly32_avx2(v).into_iter().enumerate() {
            _mm256_storeu_ps(y.as_mut_ptr().add(8 * i), _mm256_mul_ps(r, _mm256_loadu_ps(signs.as_ptr().add(8 * i))));
        }
    }

    /// `H₃₂·v` on four registers of 8 values: strides 1, 2, 4 inside each register (a lane permute, then
    /// `a + b` in the lower lane of each pair and `a − b` in the upper), 8 and 16 across registers, then
    /// `× 1/√32` — the scalar butterfly's operations in its order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn butterfly32_avx2(mut v: [__m256; 4]) -> [__m256; 4] {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for h in [1, 2, 4] {
            let idx = _mm256_xor_si256(lane, _mm256_set1_epi32(h));
            // Upper lanes of each pair (bit h set).
            let hi = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(h)), _mm256_set1_epi32(h)));
            for r in &mut v {
                let p = _mm256_permutevar8x32_ps(*r, idx);
                *r = _mm256_blendv_ps(_mm256_add_ps(*r, p), _mm256_sub_ps(p, *r), hi);
            }
        }
        let [a, b, c, d] = v;
        let (a, b, c, d) = (_mm256_add_ps(a, b), _mm256_sub_ps(a, b), _mm256_add_ps(c, d), _mm256_sub_ps(c, d));
        let s = _mm256_set1_ps(1.0 / (QK as f32).sqrt());
        [
            _mm256_mul_ps(_mm256_add_ps(a, c), s),
            _mm256_mul_ps(_mm256_add_ps(b, d), s),
            _mm256_mul_ps(_mm256_sub_ps(a, c), s),
            _mm256_mul_ps(_mm256_sub_ps(b, d), s),
        ]
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_avx2(x: &[f32], q: &mut [i8], sc: &mut [f32], sm: &mut [i32]) {
        let sign = _mm256_set1_ps(-0.0);
        let lo = _mm256_set1_epi32(-127);
        let hi = _mm256_set1_epi32(127);
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for g in 0..sc.len() {
            let p = x.as_ptr().add(g * QK);
            let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let (d, inv) = group_scale(amax);
            let vi = _mm256_set1_ps(inv);
            const R: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let mut iv = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let r = _mm256_round_ps::<R>(_mm256_mul_ps(v[k], vi));
                iv[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), hi), lo);
            }
            let p01 = _mm256_packs_epi32(iv[0], iv[1]);
            let p23 = _mm256_packs_epi32(iv[2], iv[3]);
            let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
            _mm256_storeu_si256(q.as_mut_ptr().add(g * QK) as *mut __m256i, b);
            let s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b10_11_00_01>(s4));
            sc[g] = d;
            sm[g] = _mm_cvtsi128_si32(s4);
        }
    }
}
