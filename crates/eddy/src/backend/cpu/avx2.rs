//! AVX2 + FMA tile kernels: `R` rows × `T` tokens per call, 32 activation bytes (one group) per step.
//!
//! No VNNI: byte products go through `vpmaddubsw` (u8 × i8 → i16 pairs, never saturating here: Int4
//! nibbles ≤ 15, Int8 uses `|q_w| ≤ 127` × `±q_x`) and `vpmaddwd` by ones (→ i32 lanes of 4 products).
//! As in the AVX-512 path, each (row, token) pair has its own accumulator and a fixed per-pair
//! operation sequence, so results do not depend on the tile shape or batch size.

#![allow(clippy::needless_range_loop)] // SIMD tiles index several parallel arrays

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::tile;

/// Unreachable on non-x86 targets (the path is never available there).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn tile(_: &super::Ctx, _: usize, _: usize, _: usize, _: usize) {
    unreachable!("AVX2 kernel on a non-x86 target")
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::Ctx;
    use crate::quant::{Int4Matrix, Int8Matrix, WeightMatrix, QK};
    use std::arch::x86_64::*;

    /// Software prefetch distance in rows (see the AVX-512 GEMV).
    const PF_ROWS: usize = 8;

    /// Dispatch a `(nr ∈ {1,4}, nt ∈ {1,2})` tile to its monomorphized kernel.
    macro_rules! dispatch {
        ($nr:expr, $nt:expr, $f:ident, [$($extra:tt)*], $($arg:expr),*) => {
            match ($nr, $nt) {
                (4, 1) => $f::<4, 1 $($extra)*>($($arg),*),
                (4, 2) => $f::<4, 2 $($extra)*>($($arg),*),
                (1, 1) => $f::<1, 1 $($extra)*>($($arg),*),
                (1, 2) => $f::<1, 2 $($extra)*>($($arg),*),
                _ => unreachable!("tile shape {}x{}", $nr, $nt),
            }
        };
    }

    /// Compute rows `r0..r0+nr` (nr ∈ {1, 4}) × tokens `t0..t0+nt` (nt ∈ 1..=4) into `ctx.out`
    /// (token tiles are split into 2-token tiles: 16 ymm registers).
    ///
    /// # Safety
    /// The CPU must support AVX2 + FMA; shapes validated by `matmul_with`.
    pub(crate) unsafe fn tile(ctx: &Ctx, r0: usize, nr: usize, t0: usize, nt: usize) {
        let mut t = t0;
        while t < t0 + nt {
            let n2 = (t0 + nt - t).min(2);
            match ctx.w {
                WeightMatrix::Int4(m) => dispatch!(nr, n2, int4, [], m, ctx, r0, t),
                WeightMatrix::Int8(m) if m.group == 16 => dispatch!(nr, n2, int8, [, true], m, ctx, r0, t),
                WeightMatrix::Int8(m) => dispatch!(nr, n2, int8, [, false], m, ctx, r0, t),
                WeightMatrix::F32 { data, .. } => {
                    dispatch!(nr, n2, float, [, false], data.as_ptr() as *const u8, ctx, r0, t)
                }
                WeightMatrix::Bf16 { data, .. } => {
                    dispatch!(nr, n2, float, [, true], data.as_ptr() as *const u8, ctx, r0, t)
                }
            }
            t += n2;
        }
    }

    /// Horizontal sum with a fixed shuffle tree (4+4, 2+2, 1+1).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Lane mask (all ones in lanes `< n`) for `vmaskmov`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn lanes(n: usize) -> __m256i {
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store<const R: usize, const T: usize>(ctx: &Ctx, r0: usize, t0: usize, acc: &[[__m256; T]; R]) {
        for t in 0..T {
            for r in 0..R {
                *ctx.out.0.add((t0 + t) * ctx.rows + r0 + r) = hsum(acc[r][t]);
            }
        }
    }

    /// Int4 weights × int8 activations; one step = one group (16 packed bytes × 32 activation bytes).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn int4<const R: usize, const T: usize>(m: &Int4Matrix, ctx: &Ctx, r0: usize, t0: usize) {
        let cols = ctx.cols;
        let gpr = cols / QK;
        let xq = ctx.xq;
        let (pk, sc, mn) = (m.packed.as_ptr(), m.scale.as_ptr(), m.min.as_ptr());
        let (xqp, xsc, xsm) = (xq.q.as_ptr(), xq.scale.as_ptr(), xq.sum.as_ptr());
        let nib = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut g = 0;
        while g < gpr {
            let nb = (gpr - g).min(8);
            let lm = lanes(nb);
            let mut dx = [_mm256_setzero_ps(); T];
            let mut sx = [_mm256_setzero_ps(); T];
            for t in 0..T {
                let o = (t0 + t) * gpr + g;
                dx[t] = _mm256_maskload_ps(xsc.add(o), lm);
                sx[t] = _mm256_cvtepi32_ps(_mm256_maskload_epi32(xsm.add(o), lm));
            }
            let mut sw = [_mm256_setzero_ps(); R];
            for r in 0..R {
                let o = (r0 + r) * gpr + g;
                sw[r] = _mm256_maskload_ps(sc.add(o), lm);
                // Prefetch (into L2) the same block PF_ROWS rows on (never faults; wrapping pointer arithmetic).
                let ahead = ((r0 + r + PF_ROWS) * cols + g * QK) / 2;
                _mm_prefetch::<_MM_HINT_T1>(pk.wrapping_add(ahead) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(pk.wrapping_add(ahead + 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(sc.wrapping_add(o + PF_ROWS * gpr) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(mn.wrapping_add(o + PF_ROWS * gpr) as *const i8);
                let mv = _mm256_maskload_ps(mn.add(o), lm);
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(mv, dx[t]), sx[t], acc[r][t]);
                }
            }
            for k in 0..nb {
                let e = (g + k) * QK;
                let idx = _mm256_set1_epi32(k as i32);
                let mut wv = [_mm256_setzero_si256(); R];
                let mut swe = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    let raw = _mm_loadu_si128(pk.add(((r0 + r) * cols + e) / 2) as *const __m128i);
                    let lo = _mm_and_si128(raw, nib);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), nib);
                    wv[r] = _mm256_set_m128i(hi, lo);
                    swe[r] = _mm256_permutevar8x32_ps(sw[r], idx);
                }
                for t in 0..T {
                    let xv = _mm256_loadu_si256(xqp.add((t0 + t) * cols + e) as *const __m256i);
                    let dxe = _mm256_permutevar8x32_ps(dx[t], idx);
                    for r in 0..R {
                        let d = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], xv), ones);
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(swe[r], dxe), acc[r][t]);
                    }
                }
            }
            g += nb;
        }
        store::<R, T>(ctx, r0, t0, &acc);
    }

    /// Int8 weights (group 32, or 16 if `G16`) × int8 activations via `maddubs(|w|, sign(x, w))`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn int8<const R: usize, const T: usize, const G16: bool>(
        m: &Int8Matrix,
        ctx: &Ctx,
        r0: usize,
        t0: usize,
    ) {
        let cols = ctx.cols;
        let gs = if G16 { 16 } else { 32 };
        let wgpr = cols / gs;
        let xgpr = cols / QK;
        let xq = ctx.xq;
        let (wq, sc) = (m.q.as_ptr(), m.scale.as_ptr());
        let (xqp, xsc) = (xq.q.as_ptr(), xq.scale.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut gw = 0;
        while gw < wgpr {
            let nb = (wgpr - gw).min(8);
            let e0 = gw * gs;
            let ne = nb * gs;
            let mut dx = [_mm256_setzero_ps(); T];
            for t in 0..T {
                let v = _mm256_maskload_ps(xsc.add((t0 + t) * xgpr + e0 / QK), lanes(ne / QK));
                dx[t] = if G16 { _mm256_permutevar8x32_ps(v, dup) } else { v };
            }
            let mut sw = [_mm256_setzero_ps(); R];
            for r in 0..R {
                sw[r] = _mm256_maskload_ps(sc.add((r0 + r) * wgpr + gw), lanes(nb));
                let ahead = (r0 + r + PF_ROWS) * cols + e0;
                for l in 0..ne / 64 {
                    _mm_prefetch::<_MM_HINT_T1>(wq.wrapping_add(ahead + 64 * l));
                }
                _mm_prefetch::<_MM_HINT_T1>(sc.wrapping_add((r0 + r + PF_ROWS) * wgpr + gw) as *const i8);
            }
            for k in 0..ne / QK {
                let e = e0 + k * QK;
                // i32 lane l belongs to weight group k (G32) or 2k + l/4 (G16) of the block.
                let idx = if G16 {
                    _mm256_setr_epi32(
                        2 * k as i32,
                        2 * k as i32,
                        2 * k as i32,
                        2 * k as i32,
                        2 * k as i32 + 1,
                        2 * k as i32 + 1,
                        2 * k as i32 + 1,
                        2 * k as i32 + 1,
                    )
                } else {
                    _mm256_set1_epi32(k as i32)
                };
                let mut wv = [_mm256_setzero_si256(); R];
                let mut aw = [_mm256_setzero_si256(); R];
                let mut swe = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    wv[r] = _mm256_loadu_si256(wq.add((r0 + r) * cols + e) as *const __m256i);
                    aw[r] = _mm256_abs_epi8(wv[r]);
                    swe[r] = _mm256_permutevar8x32_ps(sw[r], idx);
                }
                for t in 0..T {
                    let xv = _mm256_loadu_si256(xqp.add((t0 + t) * cols + e) as *const __m256i);
                    let dxe = _mm256_permutevar8x32_ps(dx[t], idx);
                    for r in 0..R {
                        let sxv = _mm256_sign_epi8(xv, wv[r]);
                        let d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], sxv), ones);
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(swe[r], dxe), acc[r][t]);
                    }
                }
            }
            gw += nb;
        }
        store::<R, T>(ctx, r0, t0, &acc);
    }

    /// Load 8 weights at element offset `off` as f32 (`n < 8`: only the first `n`, rest zero).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_w<const BF16: bool>(data: *const u8, off: usize, n: usize) -> __m256 {
        if BF16 {
            let p = (data as *const u16).add(off);
            let h = if n == 8 {
                _mm_loadu_si128(p as *const __m128i)
            } else {
                let mut tmp = [0u16; 8];
                std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
                _mm_loadu_si128(tmp.as_ptr() as *const __m128i)
            };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            let p = (data as *const f32).add(off);
            if n == 8 {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskload_ps(p, lanes(n))
            }
        }
    }

    /// F32 (or bf16 if `BF16`) weights × f32 activations, 8 columns per step, masked tail.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn float<const R: usize, const T: usize, const BF16: bool>(
        data: *const u8,
        ctx: &Ctx,
        r0: usize,
        t0: usize,
    ) {
        let cols = ctx.cols;
        let x = ctx.x.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut c = 0;
        while c < cols {
            let n = (cols - c).min(8);
            let mut wv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                wv[r] = load_w::<BF16>(data, (r0 + r) * cols + c, n);
            }
            for t in 0..T {
                let p = x.add((t0 + t) * cols + c);
                let xv = if n == 8 { _mm256_loadu_ps(p) } else { _mm256_maskload_ps(p, lanes(n)) };
                for r in 0..R {
                    acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            c += 8;
        }
        store::<R, T>(ctx, r0, t0, &acc);
    }
}
