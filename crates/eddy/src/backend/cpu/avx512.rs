//! AVX-512 (F/BW/VL/VNNI) kernels.
//!
//! # Int4 / Int8 weights: one canonical operation order per (row, token)
//! Let `D_g` be the exact i32 dot of weight group `g` (32 values; 16 for Int8 with group 16) with the
//! activation codes. Each (row, token) pair owns 16 f32 chains `acc[0..16]`, all starting at +0.
//! For `g = 0, 1, 2, ...` chain `c = g % 16` is updated as
//! * Int4: `acc[c] = fma(f32(D_g), s_g·d_g, acc[c]); acc[c] = fma(m_g, dsum_g, acc[c])` with
//!   `dsum_g = d_g·f32(Σq_x)` from [`super::QuantizedActivations::dsum`]
//! * Int8: `acc[c] = fma(f32(D_g), s_g·d_g, acc[c])`
//!
//! and the result is the fixed tree `((a0+a8)+(a4+a12))+((a2+a10)+(a6+a14)) + (same for odd c)`.
//! Two kernels implement exactly this:
//! * GEMV (`n < GEMM_MIN_N`): rows stream through `vpdpbusd` in natural layout; the i32 lanes of 16
//!   groups are reduced exactly (integer shuffles/adds) into one vector whose lane `c` is `D_{16b+c}`,
//!   and the 16 chains are the 16 lanes of one accumulator (final reduction = the tree above).
//! * GEMM (`n >= GEMM_MIN_N`): 16 rows are repacked (16×16 transposes) so that lane `r` of a vector holds 4
//!   consecutive codes of row `r`; `vpdpbusd` with a broadcast 4-byte activation quad accumulates
//!   `D_g` for 16 rows at once (8 instructions per group and token, no conversion in between), and
//!   chain `acc[c]` is a vector over the 16 rows. Tokens are processed 8 at a time per weight load.
//!
//! Integer parts are exact and the float operations per pair are identical in both kernels, so a
//! token's output is bit-identical for any `n`, tile, or thread count. (An untouched chain equals one
//! updated with `fma(0, 0, acc)`, since chains can never be −0.)
//!
//! # F32 / Bf16 weights
//! `R × T` register tiles; each pair owns one 16-lane accumulator (`fma` per 16 columns, masked tail)
//! reduced by the same tree, independent of `R`/`T`.

#![allow(clippy::needless_range_loop)] // SIMD tiles index several parallel arrays

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::rows;

/// Unreachable on non-x86 targets (the path is never available there).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn rows(_: &super::Ctx, _: usize, _: std::ops::Range<usize>) {
    unreachable!("AVX-512 kernel on a non-x86 target")
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::{Ctx, ROW_BLOCK};
    use crate::quant::{WeightMatrix, QK};
    use std::arch::x86_64::*;
    use std::cell::RefCell;
    use std::ops::Range;

    /// Smallest batch that uses the repacking GEMM kernel, for Int4 and Int8 weights (measured
    /// crossover; both kernels give identical bits).
    const GEMM_MIN_N: [usize; 2] = [6, 4];
    /// GEMV software prefetch (into L2) distance in rows: the hardware prefetchers alone leave ~40% of
    /// the DRAM bandwidth of one core unused (measured on Zen 4 and Sapphire Rapids; the L2 hint is
    /// much better than L1 on Zen 4).
    const PF_ROWS: usize = 8;
    /// Rows per GEMM block (one vector lane per row).
    const GEMM_ROWS: usize = 16;

    const INT4: u8 = 0;
    const I8G32: u8 = 1;
    const I8G16: u8 = 2;

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    thread_local! {
        /// Repacked weights of one 16-row block (GEMM); grows once per thread, then reused.
        static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    }

    /// Compute outputs for rows `range` and all `n` tokens.
    ///
    /// # Safety
    /// The CPU must support the AVX-512 path; shapes validated by `matmul_with`; no other writer of
    /// these rows.
    pub(crate) unsafe fn rows(ctx: &Ctx, n: usize, range: Range<usize>) {
        let kind = match ctx.w {
            WeightMatrix::Int4(_) => INT4,
            WeightMatrix::Int8(m) if m.group == 16 => I8G16,
            WeightMatrix::Int8(_) => I8G32,
            WeightMatrix::F32 { .. } | WeightMatrix::Bf16 { .. } => return float_rows(ctx, n, range),
        };
        if n >= GEMM_MIN_N[(kind != INT4) as usize] {
            let gs = if kind == I8G16 { 16 } else { 32 };
            let lines = ctx.cols / gs * (gs / 4 + 2);
            SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < lines {
                    s.resize(lines, Line([0; 64]));
                }
                let scratch = s.as_mut_ptr() as *mut __m512i;
                let mut r = range.start;
                while r < range.end {
                    let nr = (range.end - r).min(GEMM_ROWS);
                    match kind {
                        INT4 => gemm_block::<INT4>(ctx, n, r, nr, scratch),
                        I8G32 => gemm_block::<I8G32>(ctx, n, r, nr, scratch),
                        _ => gemm_block::<I8G16>(ctx, n, r, nr, scratch),
                    }
                    r += nr;
                }
            });
        } else {
            let mut rb = range.start;
            while rb < range.end {
                let rb_end = (rb + ROW_BLOCK).min(range.end);
                for t in 0..n {
                    let mut r = rb;
                    while r < rb_end {
                        let four = rb_end - r >= 4;
                        match (kind, four) {
                            (INT4, true) => gemv::<INT4, 4>(ctx, r, t),
                            (INT4, false) => gemv::<INT4, 1>(ctx, r, t),
                            (I8G32, true) => gemv::<I8G32, 4>(ctx, r, t),
                            (I8G32, false) => gemv::<I8G32, 1>(ctx, r, t),
                            (_, true) => gemv::<I8G16, 4>(ctx, r, t),
                            (_, false) => gemv::<I8G16, 1>(ctx, r, t),
                        }
                        r += if four { 4 } else { 1 };
                    }
                }
                rb = rb_end;
            }
        }
    }

    /// Horizontal sum with the fixed tree (c + c+8, then + c+4, then + c+2, then lane 0 + lane 1).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn hsum(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s = _mm256_add_ps(lo, hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Low `n` bits set (n <= 16).
    #[inline]
    fn mask16(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// Low `n` bits set (n <= 64).
    #[inline]
    fn mask64(n: usize) -> __mmask64 {
        if n >= 64 {
            u64::MAX
        } else {
            (1u64 << n) - 1
        }
    }

    /// Load `n <= 64` bytes (zero-filled above).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_bytes(p: *const u8, n: usize) -> __m512i {
        if n >= 64 {
            _mm512_loadu_si512(p as *const __m512i)
        } else {
            _mm512_maskz_loadu_epi8(mask64(n), p as *const i8)
        }
    }

    /// One GEMV chunk: weight groups starting at element `e` (`ng <= 4` groups: 128 values for Int4 and
    /// Int8/32, 64 for Int8/16) of rows `r0..r0+R` against the activations `xp` (codes for Int4, shifted
    /// codes for Int8). Returns per row the i32 vector whose 128-bit lane `c` holds 4 partial dots of
    /// group `c` (exact; Int8 still includes the `+128` shift). Prefetches `pf` bytes ahead.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn chunk<const K: u8, const R: usize>(
        ctx: &Ctx,
        wq: *const u8,
        xp: *const u8,
        r0: usize,
        e: usize,
        ng: usize,
        pf: usize,
    ) -> [__m512i; R] {
        let cols = ctx.cols;
        let zero = _mm512_setzero_si512();
        let mut v = [zero; R];
        match K {
            INT4 => {
                // Split 128 activation bytes (4 groups) into the low and high half of each group.
                let idx_lo = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
                let idx_hi = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
                let nib = _mm512_set1_epi8(0x0F);
                let x0 = load_bytes(xp.add(e), 32 * ng);
                let x1 = if ng > 2 { load_bytes(xp.add(e + 64), 32 * ng - 64) } else { zero };
                let xl = _mm512_permutex2var_epi64(x0, idx_lo, x1);
                let xh = _mm512_permutex2var_epi64(x0, idx_hi, x1);
                for r in 0..R {
                    let pp = wq.add(((r0 + r) * cols + e) / 2);
                    _mm_prefetch::<_MM_HINT_T1>(pp.wrapping_add(pf) as *const i8);
                    let pw = load_bytes(pp, 16 * ng);
                    let lo = _mm512_and_si512(pw, nib);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(pw), nib);
                    v[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xl), hi, xh);
                }
            }
            I8G32 => {
                let x0 = load_bytes(xp.add(e), 32 * ng);
                let x1 = if ng > 2 { load_bytes(xp.add(e + 64), 32 * ng - 64) } else { zero };
                for r in 0..R {
                    let w = wq.add((r0 + r) * cols + e);
                    _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(pf) as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(pf + 64) as *const i8);
                    let da = _mm512_dpbusd_epi32(zero, x0, load_bytes(w, 32 * ng));
                    let db =
                        if ng > 2 { _mm512_dpbusd_epi32(zero, x1, load_bytes(w.add(64), 32 * ng - 64)) } else { zero };
                    v[r] = _mm512_add_epi32(
                        _mm512_shuffle_i32x4::<0b10_00_10_00>(da, db),
                        _mm512_shuffle_i32x4::<0b11_01_11_01>(da, db),
                    );
                }
            }
            _ => {
                let x0 = load_bytes(xp.add(e), 16 * ng);
                for r in 0..R {
                    let pp = wq.add((r0 + r) * cols + e);
                    _mm_prefetch::<_MM_HINT_T1>(pp.wrapping_add(pf) as *const i8);
                    v[r] = _mm512_dpbusd_epi32(zero, x0, load_bytes(pp, 16 * ng));
                }
            }
        }
        v
    }

    /// GEMV: rows `r0..r0+R` × token `t`, natural weight layout.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemv<const K: u8, const R: usize>(ctx: &Ctx, r0: usize, t: usize) {
        let cols = ctx.cols;
        let xq = ctx.xq;
        let gs = if K == I8G16 { 16 } else { 32 };
        let wgpr = cols / gs;
        let xgpr = cols / QK;
        // Weight codes, scales, and (Int4) offsets or (Int8) code sums.
        let (wq, ws, wx): (*const u8, *const f32, *const u8) = match ctx.w {
            WeightMatrix::Int4(m) => (m.packed.as_ptr(), m.scale.as_ptr(), m.min.as_ptr() as *const u8),
            WeightMatrix::Int8(m) => (m.q.as_ptr() as *const u8, m.scale.as_ptr(), m.qsum.as_ptr() as *const u8),
            _ => unreachable!(),
        };
        let xp: *const u8 = if K == INT4 { xq.q.as_ptr() as *const u8 } else { xq.qu.as_ptr() }.add(t * cols);
        let xs = xq.scale.as_ptr().add(t * xgpr);
        let xds = xq.dsum.as_ptr().add(t * xgpr);

        let zero = _mm512_setzero_si512();
        // Final reduction step: lane g (natural group order) of the block.
        // Group 4q+c sits in lanes 4c+(q&1) and 4c+(q&1)+2 of pair q/2 (second pair: index + 16).
        let idx_a = _mm512_set_epi32(29, 25, 21, 17, 28, 24, 20, 16, 13, 9, 5, 1, 12, 8, 4, 0);
        let idx_b = _mm512_add_epi32(idx_a, _mm512_set1_epi32(2));
        let dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);

        // Software prefetch into L2: the same position PF_ROWS rows further on (may point past the end:
        // prefetches never fault, and the pointers are formed with wrapping arithmetic).
        let pf = PF_ROWS * if K == INT4 { cols / 2 } else { cols };
        let pfs = PF_ROWS * wgpr;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut g = 0;
        while g < wgpr {
            let nb = (wgpr - g).min(16);
            let bm = mask16(nb);
            let d16 = if K == I8G16 {
                _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mask16(nb / 2), xs.add(g / 2)))
            } else {
                _mm512_maskz_loadu_ps(bm, xs.add(g))
            };
            // Chunk q covers weight groups g+4q .. g+4q+4; a full block is straight-line code.
            let mut v = [[zero; R]; 4];
            if nb == 16 {
                for q in 0..4 {
                    v[q] = chunk::<K, R>(ctx, wq, xp, r0, (g + 4 * q) * gs, 4, pf);
                }
            } else {
                for q in 0..4 {
                    let ng = nb.saturating_sub(4 * q).min(4);
                    if ng > 0 {
                        v[q] = chunk::<K, R>(ctx, wq, xp, r0, (g + 4 * q) * gs, ng, pf);
                    }
                }
            }
            // 128-bit lane c of chunk q holds 4 partials of group 4q+c: reduce pairs of chunks.
            let mut pairs = [[zero; R]; 2];
            for p in 0..2 {
                for r in 0..R {
                    pairs[p][r] = _mm512_add_epi32(
                        _mm512_unpacklo_epi32(v[2 * p][r], v[2 * p + 1][r]),
                        _mm512_unpackhi_epi32(v[2 * p][r], v[2 * p + 1][r]),
                    );
                }
            }
            let e16 = if K == INT4 {
                _mm512_maskz_loadu_ps(bm, xds.add(g))
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                let gi = (r0 + r) * wgpr + g;
                _mm_prefetch::<_MM_HINT_T1>(ws.wrapping_add(gi + pfs) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>((wx as *const f32).wrapping_add(gi + pfs) as *const i8);
                let mut d = _mm512_add_epi32(
                    _mm512_permutex2var_epi32(pairs[0][r], idx_a, pairs[1][r]),
                    _mm512_permutex2var_epi32(pairs[0][r], idx_b, pairs[1][r]),
                );
                if K != INT4 {
                    let qs = _mm512_maskz_loadu_epi32(bm, (wx as *const i32).add(gi));
                    d = _mm512_sub_epi32(d, _mm512_slli_epi32::<7>(qs));
                }
                let s16 = _mm512_maskz_loadu_ps(bm, ws.add(gi));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s16, d16), acc[r]);
                if K == INT4 {
                    let m16 = _mm512_maskz_loadu_ps(bm, (wx as *const f32).add(gi));
                    acc[r] = _mm512_fmadd_ps(m16, e16, acc[r]);
                }
            }
            g += nb;
        }
        for r in 0..R {
            *ctx.out.0.add(t * ctx.rows + r0 + r) = hsum(acc[r]);
        }
    }

    /// GEMM for rows `r0..r0+nr` (`nr <= 16`) and all `n` tokens: repack, then token tiles of 8.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemm_block<const K: u8>(ctx: &Ctx, n: usize, r0: usize, nr: usize, scratch: *mut __m512i) {
        repack::<K>(ctx, r0, nr, scratch);
        let mut t = 0;
        while t < n {
            let left = n - t;
            let step = if left >= 8 {
                gemm_tile::<K, 8>(ctx, r0, nr, t, scratch);
                8
            } else if left >= 4 {
                gemm_tile::<K, 4>(ctx, r0, nr, t, scratch);
                4
            } else if left >= 2 {
                gemm_tile::<K, 2>(ctx, r0, nr, t, scratch);
                2
            } else {
                gemm_tile::<K, 1>(ctx, r0, nr, t, scratch);
                1
            };
            t += step;
        }
    }

    /// Transpose a 16×16 matrix of 32-bit values held as 16 row vectors (64 shuffles).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    fn transpose16(a: &mut [__m512i; 16]) {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
        }
        // u[4i+k], 128-bit lane L = column 4L+k of rows 4i..4i+4.
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for k in 0..4 {
            let xa = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[k], u[4 + k]);
            let xb = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[k], u[4 + k]);
            let ya = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + k], u[12 + k]);
            let yb = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + k], u[12 + k]);
            a[k] = _mm512_shuffle_i32x4::<0b10_00_10_00>(xa, ya);
            a[4 + k] = _mm512_shuffle_i32x4::<0b11_01_11_01>(xa, ya);
            a[8 + k] = _mm512_shuffle_i32x4::<0b10_00_10_00>(xb, yb);
            a[12 + k] = _mm512_shuffle_i32x4::<0b11_01_11_01>(xb, yb);
        }
    }

    /// Repack rows `r0..r0+nr` into `scratch`: per weight group `w`, `gs/4` vectors whose lane `r`
    /// holds 4 consecutive codes of row `r0+r` (Int4 nibbles expanded to bytes), then the 16 scales,
    /// then the 16 offsets (Int4) or `−128·Σq` (Int8). Missing rows are zero. Done with 16×16
    /// transposes of 64-byte row slices.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn repack<const K: u8>(ctx: &Ctx, r0: usize, nr: usize, scratch: *mut __m512i) {
        let cols = ctx.cols;
        let gs = if K == I8G16 { 16 } else { 32 };
        let qj = gs / 4;
        let stride = qj + 2;
        let wgpr = cols / gs;
        let zero = _mm512_setzero_si512();
        let nib = _mm512_set1_epi8(0x0F);
        let (codes, scale, extra): (*const u8, *const f32, *const i32) = match ctx.w {
            WeightMatrix::Int4(m) => (m.packed.as_ptr(), m.scale.as_ptr(), m.min.as_ptr() as *const i32),
            WeightMatrix::Int8(m) => (m.q.as_ptr() as *const u8, m.scale.as_ptr(), m.qsum.as_ptr()),
            _ => unreachable!(),
        };
        // Bytes per row, and weight groups per 64-byte slice.
        let row_bytes = if K == INT4 { cols / 2 } else { cols };
        let gpl = if K == I8G32 { 2 } else { 4 };
        let mut a = [zero; 16];
        let mut w = 0;
        while w < wgpr {
            let ng = (wgpr - w).min(gpl);
            let nbytes = 64 * ng / gpl;
            for r in 0..16 {
                a[r] = if r < nr { load_bytes(codes.add((r0 + r) * row_bytes + w * 64 / gpl), nbytes) } else { zero };
            }
            transpose16(&mut a);
            // a[col]: lane r = dword `col` of row r's slice; slice group c owns cols c*16/gpl ..
            for c in 0..ng {
                let dst = scratch.add((w + c) * stride);
                if K == INT4 {
                    for j in 0..4 {
                        let v = a[4 * c + j];
                        _mm512_store_si512(dst.add(j), _mm512_and_si512(v, nib));
                        _mm512_store_si512(dst.add(j + 4), _mm512_and_si512(_mm512_srli_epi32::<4>(v), nib));
                    }
                } else {
                    for j in 0..qj {
                        _mm512_store_si512(dst.add(j), a[qj * c + j]);
                    }
                }
            }
            w += ng;
        }
        // Scales and offsets / code sums: 16 rows × 16 groups at a time.
        let mut w = 0;
        while w < wgpr {
            let nb = (wgpr - w).min(16);
            for pass in 0..2 {
                for r in 0..16 {
                    a[r] = if r < nr {
                        let src = if pass == 0 { scale as *const i32 } else { extra };
                        _mm512_maskz_loadu_epi32(mask16(nb), src.add((r0 + r) * wgpr + w))
                    } else {
                        zero
                    };
                }
                transpose16(&mut a);
                for c in 0..nb {
                    let v = if pass == 1 && K != INT4 { _mm512_sub_epi32(zero, _mm512_slli_epi32::<7>(a[c])) } else { a[c] };
                    _mm512_store_si512(scratch.add((w + c) * stride + qj + pass), v);
                }
            }
            w += nb;
        }
    }

    /// GEMM tile: the repacked 16-row block × tokens `t0..t0+T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemm_tile<const K: u8, const T: usize>(
        ctx: &Ctx,
        r0: usize,
        nr: usize,
        t0: usize,
        scratch: *const __m512i,
    ) {
        let cols = ctx.cols;
        let xq = ctx.xq;
        let gs = if K == I8G16 { 16 } else { 32 };
        let qj = gs / 4;
        let stride = qj + 2;
        let wgpr = cols / gs;
        let xgpr = cols / QK;
        let xbase: *const u8 = if K == INT4 { xq.q.as_ptr() as *const u8 } else { xq.qu.as_ptr() };
        let mut xp = [xbase; T];
        let mut xs = [xq.scale.as_ptr(); T];
        let mut xds = [xq.dsum.as_ptr(); T];
        for t in 0..T {
            xp[t] = xbase.add((t0 + t) * cols);
            xs[t] = xs[t].add((t0 + t) * xgpr);
            xds[t] = xds[t].add((t0 + t) * xgpr);
        }
        let mut acc = [[_mm512_setzero_ps(); 16]; T];
        for w in 0..wgpr {
            let c = w & 15;
            let blk = scratch.add(w * stride);
            let init = if K == INT4 { _mm512_setzero_si512() } else { _mm512_load_si512(blk.add(qj + 1)) };
            let mut d = [init; T];
            for j in 0..qj {
                let wv = _mm512_load_si512(blk.add(j));
                for t in 0..T {
                    let xb = _mm512_set1_epi32((xp[t].add(w * gs + 4 * j) as *const i32).read_unaligned());
                    d[t] = if K == INT4 { _mm512_dpbusd_epi32(d[t], wv, xb) } else { _mm512_dpbusd_epi32(d[t], xb, wv) };
                }
            }
            let s = _mm512_load_ps(blk.add(qj) as *const f32);
            let xg = w * gs / QK;
            for t in 0..T {
                let dg = *xs[t].add(xg);
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[t]), _mm512_mul_ps(s, _mm512_set1_ps(dg)), acc[t][c]);
                acc[t][c] = if K == INT4 {
                    _mm512_fmadd_ps(_mm512_load_ps(blk.add(qj + 1) as *const f32), _mm512_set1_ps(*xds[t].add(w)), a)
                } else {
                    a
                };
            }
        }
        let km = mask16(nr);
        for t in 0..T {
            let a = &acc[t];
            let mut s8 = [_mm512_setzero_ps(); 8];
            for c in 0..8 {
                s8[c] = _mm512_add_ps(a[c], a[c + 8]);
            }
            let s4 = [
                _mm512_add_ps(s8[0], s8[4]),
                _mm512_add_ps(s8[1], s8[5]),
                _mm512_add_ps(s8[2], s8[6]),
                _mm512_add_ps(s8[3], s8[7]),
            ];
            let s2 = [_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3])];
            let v = _mm512_add_ps(s2[0], s2[1]);
            _mm512_mask_storeu_ps(ctx.out.0.add((t0 + t) * ctx.rows + r0), km, v);
        }
    }

    /// F32/Bf16 rows: `R × T` tiles (row tiles of 4, token tiles of 4) inside row blocks.
    unsafe fn float_rows(ctx: &Ctx, n: usize, range: Range<usize>) {
        let bf16 = matches!(ctx.w, WeightMatrix::Bf16 { .. });
        let data = match ctx.w {
            WeightMatrix::F32 { data, .. } => data.as_ptr() as *const u8,
            WeightMatrix::Bf16 { data, .. } => data.as_ptr() as *const u8,
            _ => unreachable!(),
        };
        let mut rb = range.start;
        while rb < range.end {
            let rb_end = (rb + ROW_BLOCK).min(range.end);
            let mut t = 0;
            while t < n {
                let nt = (n - t).min(4);
                let mut r = rb;
                while r < rb_end {
                    let nr = if rb_end - r >= 4 { 4 } else { 1 };
                    macro_rules! go {
                        ($b:expr) => {
                            match (nr, nt) {
                                (4, 1) => float::<4, 1, $b>(data, ctx, r, t),
                                (4, 2) => float::<4, 2, $b>(data, ctx, r, t),
                                (4, 3) => float::<4, 3, $b>(data, ctx, r, t),
                                (4, 4) => float::<4, 4, $b>(data, ctx, r, t),
                                (_, 1) => float::<1, 1, $b>(data, ctx, r, t),
                                (_, 2) => float::<1, 2, $b>(data, ctx, r, t),
                                (_, 3) => float::<1, 3, $b>(data, ctx, r, t),
                                _ => float::<1, 4, $b>(data, ctx, r, t),
                            }
                        };
                    }
                    if bf16 {
                        go!(true)
                    } else {
                        go!(false)
                    }
                    r += nr;
                }
                t += nt;
            }
            rb = rb_end;
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn store<const R: usize, const T: usize>(ctx: &Ctx, r0: usize, t0: usize, acc: &[[__m512; T]; R]) {
        for t in 0..T {
            for r in 0..R {
                *ctx.out.0.add((t0 + t) * ctx.rows + r0 + r) = hsum(acc[r][t]);
            }
        }
    }

    /// F32 (or bf16 if `BF16`) weights × f32 activations, 16 columns per step, masked tail.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn float<const R: usize, const T: usize, const BF16: bool>(
        data: *const u8,
        ctx: &Ctx,
        r0: usize,
        t0: usize,
    ) {
        let cols = ctx.cols;
        let x = ctx.x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        macro_rules! step {
            ($c:expr, $mask:expr) => {{
                let c = $c;
                let k: __mmask16 = $mask;
                let mut wv = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    let off = (r0 + r) * cols + c;
                    wv[r] = if BF16 {
                        let p = (data as *const u16).add(off);
                        let h = if k == 0xFFFF {
                            _mm256_loadu_si256(p as *const __m256i)
                        } else {
                            _mm256_maskz_loadu_epi16(k, p as *const i16)
                        };
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                    } else {
                        let p = (data as *const f32).add(off);
                        if k == 0xFFFF {
                            _mm512_loadu_ps(p)
                        } else {
                            _mm512_maskz_loadu_ps(k, p)
                        }
                    };
                }
                for t in 0..T {
                    let p = x.add((t0 + t) * cols + c);
                    let xv = if k == 0xFFFF { _mm512_loadu_ps(p) } else { _mm512_maskz_loadu_ps(k, p) };
                    for r in 0..R {
                        acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                    }
                }
            }};
        }
        let full = cols / 16 * 16;
        let mut c = 0;
        while c < full {
            step!(c, 0xFFFF);
            c += 16;
        }
        if cols > full {
            step!(full, mask16(cols - full));
        }
        store::<R, T>(ctx, r0, t0, &acc);
    }
}
