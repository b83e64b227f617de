//! AVX2 + FMA tile kernels: `R` rows × `T` tokens per call, 32 activation bytes (one group) per step.
//!
//! No VNNI: byte products go through `vpmaddubsw` (u8 × i8 → i16 pairs, never saturating here: explicit
//! offsets use codes ≤ 63 (bits ≤ 6); implicit ones the signed codes `c = q − 2^(bits−1)` as
//! `|c| ≤ 128` × `±q_x`, which also folds the offset into the integer dot) and `vpmaddwd` by ones (→ i32
//! lanes of 4 products). One step is one block of 32 codes.
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
    use crate::quant::{QMatrix, WeightMatrix, QK};
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
                WeightMatrix::Q(m) if m.group == 16 => {
                    dispatch!(nr, n2, qtile, [, true], m, ctx, r0, t)
                }
                WeightMatrix::Q(m) => dispatch!(nr, n2, qtile, [, false], m, ctx, r0, t),
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

    /// The 32 codes of block `blk` as bytes in natural order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode32(m: &QMatrix, blk: usize, p_n: usize) -> __m256i {
        if m.bits == 8 {
            return _mm256_loadu_si256(m.lo.as_ptr().add(blk * QK) as *const __m256i);
        }
        let nib = _mm_set1_epi8(0x0F);
        let raw = _mm_loadu_si128(m.lo.as_ptr().add(blk * 16) as *const __m128i);
        let mut v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(raw), nib), _mm_and_si128(raw, nib));
        if p_n > 0 {
            // Byte j ← byte j/8 of the plane word; select bit j%8.
            let ctl = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
            let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            for p in 0..p_n {
                let w = (m.hi.as_ptr().add(4 * (p_n * blk + p)) as *const i32).read_unaligned();
                let bv = _mm256_shuffle_epi8(_mm256_set1_epi32(w), ctl);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(bv, sel), sel);
                v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8((16 << p) as i8)));
            }
        }
        v
    }

    /// Quantized weights (group 32, or 16 if `G16`) × int8 activations, one block of 32 per step.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn qtile<const R: usize, const T: usize, const G16: bool>(m: &QMatrix, ctx: &Ctx, r0: usize, t0: usize) {
        let cols = ctx.cols;
        let nblk = cols / QK;
        let xq = ctx.xq;
        let imp = m.implicit_min();
        let p_n = m.planes();
        let half = _mm256_set1_epi8((1u32 << (m.bits - 1)) as u8 as i8);
        let ones = _mm256_set1_epi16(1);
        let lo_row = if m.bits == 8 { cols } else { cols / 2 };
        let pf_every = if m.bits == 8 { 2 } else { 4 };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for k in 0..nblk {
            let mut wv = [_mm256_setzero_si256(); R];
            let mut aw = [_mm256_setzero_si256(); R];
            let mut sm = [(0f32, 0f32, 0f32); R];
            for r in 0..R {
                let blk = (r0 + r) * nblk + k;
                if k % pf_every == 0 {
                    let ahead = (r0 + r + PF_ROWS) * lo_row + k * lo_row / nblk;
                    _mm_prefetch::<_MM_HINT_T1>(m.lo.as_ptr().wrapping_add(ahead) as *const i8);
                }
                let q = decode32(m, blk, p_n);
                if imp {
                    wv[r] = _mm256_sub_epi8(q, half);
                    aw[r] = _mm256_abs_epi8(wv[r]);
                } else {
                    wv[r] = q;
                }
                sm[r] = if G16 {
                    (m.scale_min(r0 + r, 2 * k).0, m.scale_min(r0 + r, 2 * k + 1).0, 0.0)
                } else {
                    let (s, mn) = m.scale_min(r0 + r, k);
                    (s, s, mn.unwrap_or(0.0))
                };
            }
            for t in 0..T {
                let xv = _mm256_loadu_si256(xq.q.as_ptr().add((t0 + t) * cols + k * QK) as *const __m256i);
                let xi = (t0 + t) * nblk + k;
                let dx = xq.scale[xi];
                for r in 0..R {
                    let p = if imp { _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r])) } else { _mm256_maddubs_epi16(wv[r], xv) };
                    let d = _mm256_madd_epi16(p, ones);
                    let (s0, s1, mn) = sm[r];
                    let (a, b) = (s0 * dx, s1 * dx);
                    let sv = _mm256_setr_ps(a, a, a, a, b, b, b, b);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc[r][t]);
                    if !imp {
                        let mv = _mm256_setr_ps(mn, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
                        acc[r][t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xq.dsum[xi]), acc[r][t]);
                    }
                }
            }
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
    unsafe fn float<const R: usize, const T: usize, const BF16: bool>(data: *const u8, ctx: &Ctx, r0: usize, t0: usize) {
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
