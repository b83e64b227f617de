//! AVX2 + FMA tile kernels: `R` rows × `T` tokens per call, 32 activation bytes (one group) per step.
//!
//! No VNNI: byte products go through `vpmaddubsw` (u8 × i8 → i16 pairs, never saturating here: explicit
//! offsets use codes ≤ 63 (bits ≤ 6); implicit ones the signed codes `c = q − 2^(bits−1)` as
//! `|c| ≤ 128` × `±q_x`, which also folds the offset into the integer dot) and `vpmaddwd` by ones (→ i32
//! lanes of 4 products). One step is one block of 32 codes.
//! As in the AVX-512 path, each (row, token) pair has its own accumulator and a fixed per-pair
//! operation sequence, so results do not depend on the tile shape or batch size.
//!
//! # Packed weights
//! Matrices prepacked at load time ([`crate::quant::QMatrix::prepack`], lane-per-row lines of 16 rows)
//! run on [`packed_rows`] for every batch size: each 64-byte line is two vectors of 8 rows, a broadcast
//! 4-byte activation quad is multiplied into them with `vpmaddubsw` (i16 pairs, summed over several quads
//! while they cannot overflow) and `vpmaddwd` by ones, giving the exact group dot `D_g` of 8 rows. The
//! float operations per (row, token) are the AVX-512 kernels' (16 chains `c = g % 16`, the same `fma`s
//! and reduction tree; see `avx512.rs`), so this path's outputs are bit-identical to the AVX-512 path's.
//! 8-bit codes (`q ≤ 255`, whose pair sums would saturate i16) go through the sign trick below, which
//! gives `D'_g` directly.

#![allow(clippy::needless_range_loop)] // SIMD tiles index several parallel arrays

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::{lanes, packed_rows, tile};

/// Unreachable on non-x86 targets (the path is never available there).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn tile(_: &super::Ctx, _: usize, _: usize, _: usize, _: usize) {
    unreachable!("AVX2 kernel on a non-x86 target")
}

/// Unreachable on non-x86 targets (the path is never available there).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn packed_rows(_: &super::Ctx, _: usize, _: std::ops::Range<usize>) {
    unreachable!("AVX2 kernel on a non-x86 target")
}

/// Most tokens per tile of the packed kernel ([`packed_rows`]): each unpacked code block is dotted with
/// all of them ([`super::packed::fill_xtiles`] lays the activations out in tiles of this many). 16 for bits
/// 5/6, whose bit planes cost more to unpack, else 8 — as on AVX-512. Measured on Zen 3 (2 threads,
/// `eddy speed -p 128`): Qwen2.5-1.5B Q4_K_M 63 t/s with 8 for every width, 72 with 16 for bits 5/6, 73 with
/// 16 for all; Qwen2.5-0.5B Q8_0 197–206 t/s with 8 or 12, 183 with 16, 138 with 4.
pub(crate) const fn packed_tokens(bits: u8) -> usize {
    if bits == 5 || bits == 6 {
        16
    } else {
        8
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::packed::{xtile_bytes, ScaleStreams};
    use super::super::Ctx;
    use crate::quant::{Line, Packed, QMatrix, WeightMatrix, PACK_ROWS, QK, QK_SUPER};
    use std::arch::x86_64::*;
    use std::ops::Range;

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
    pub(crate) fn lanes(n: usize) -> __m256i {
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

    /// Packed code prefetch distance in lines (into L2).
    const PF_LINES: usize = 64;

    /// Rows `range` (`range.start % 16 == 0`) of a prepacked matrix × all `n` tokens: 16-row blocks,
    /// token tiles of up to [`super::packed_tokens`] (the activation records of [`super::super::packed`]).
    ///
    /// # Safety
    /// The CPU must support AVX2 + FMA; shapes validated by `matmul_with`, which also lays out `ctx.xt`
    /// for tiles of [`super::packed_tokens`]; no other writer of these rows.
    pub(crate) unsafe fn packed_rows(ctx: &Ctx, n: usize, range: Range<usize>) {
        let WeightMatrix::Q(m) = ctx.w else { unreachable!("packed kernel on float weights") };
        let pk = m.packed.as_deref().expect("packed kernel on a matrix without its packed copy");
        assert!(range.start.is_multiple_of(PACK_ROWS), "packed rows start on a 16-row block");
        assert!(!ctx.xt.get().is_null(), "packed kernel without its activation tiles (matmul_with lays them out)");
        macro_rules! go {
            ($b:literal, $g16:literal) => {{
                let mut r = range.start;
                while r < range.end {
                    let nr = (range.end - r).min(PACK_ROWS);
                    let mut t = 0;
                    while t < n {
                        let nt = (n - t).min(super::packed_tokens($b));
                        match nt {
                            1 => packed_tile::<$b, $g16, 1>(ctx, m, pk, r, nr, t),
                            2 => packed_tile::<$b, $g16, 2>(ctx, m, pk, r, nr, t),
                            3 => packed_tile::<$b, $g16, 3>(ctx, m, pk, r, nr, t),
                            4 => packed_tile::<$b, $g16, 4>(ctx, m, pk, r, nr, t),
                            5 => packed_tile::<$b, $g16, 5>(ctx, m, pk, r, nr, t),
                            6 => packed_tile::<$b, $g16, 6>(ctx, m, pk, r, nr, t),
                            7 => packed_tile::<$b, $g16, 7>(ctx, m, pk, r, nr, t),
                            8 => packed_tile::<$b, $g16, 8>(ctx, m, pk, r, nr, t),
                            9 => packed_tile::<$b, $g16, 9>(ctx, m, pk, r, nr, t),
                            10 => packed_tile::<$b, $g16, 10>(ctx, m, pk, r, nr, t),
                            11 => packed_tile::<$b, $g16, 11>(ctx, m, pk, r, nr, t),
                            12 => packed_tile::<$b, $g16, 12>(ctx, m, pk, r, nr, t),
                            13 => packed_tile::<$b, $g16, 13>(ctx, m, pk, r, nr, t),
                            14 => packed_tile::<$b, $g16, 14>(ctx, m, pk, r, nr, t),
                            15 => packed_tile::<$b, $g16, 15>(ctx, m, pk, r, nr, t),
                            _ => packed_tile::<$b, $g16, 16>(ctx, m, pk, r, nr, t),
                        }
                        t += nt;
                    }
                    r += nr;
                }
            }};
        }
        match (m.bits, m.group == 16) {
            (4, false) => go!(4, false),
            (5, false) => go!(5, false),
            (6, false) => go!(6, false),
            (8, false) => go!(8, false),
            (4, true) => go!(4, true),
            (5, true) => go!(5, true),
            (6, true) => go!(6, true),
            _ => unreachable!("QMatrix bits {} group {} (check() rejects it)", m.bits, m.group),
        }
    }

    /// Shift the 16-bit lanes of `v` left by `s` (right by `−s`), `|s| ≤ 4`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn shl16(v: __m256i, s: i32) -> __m256i {
        if s >= 0 {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128(s))
        } else {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(-s))
        }
    }

    /// The 8 quad vectors of half `h` (rows `8h..8h+8` of the block) of one code block of [`Packed`] at
    /// `bl`: vector `j` lane `r` = codes `4j..4j+4` of row `8h + r`, one byte each.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unpack<const B: u8>(bl: *const Line, h: usize) -> [__m256i; 8] {
        let ld = |l: usize| _mm256_load_si256((bl.add(l) as *const u8).add(32 * h) as *const __m256i);
        let mut q = [_mm256_setzero_si256(); 8];
        if B == 8 {
            for j in 0..8 {
                q[j] = ld(j);
            }
            return q;
        }
        let nib = _mm256_set1_epi8(0x0F);
        for j in 0..4 {
            let v = ld(j);
            q[2 * j] = _mm256_and_si256(v, nib);
            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
        }
        if B == 5 {
            let hv = ld(4);
            let bit = _mm256_set1_epi8(0x10);
            for i in 0..8 {
                q[i] = _mm256_or_si256(q[i], _mm256_and_si256(shl16(hv, 4 - i as i32), bit));
            }
        } else if B == 6 {
            let bits = _mm256_set1_epi8(0x30);
            for i in 0..8 {
                let hv = ld(4 + i / 4);
                q[i] = _mm256_or_si256(q[i], _mm256_and_si256(shl16(hv, 4 - 2 * (i % 4) as i32), bits));
            }
        }
        q
    }

    /// Packed tile: rows `r0..r0+nr` (one 16-row block of [`Packed`], as two halves of 8) × tokens
    /// `t0..t0+T`; the float operations of the AVX-512 `packed_tile` per (row, token).
    ///
    /// F16C is enabled here for the f16 group scales (`vcvtph2ps`): without it the intrinsic is not
    /// inlined, and the call it left in the loop over groups (which clobbers every ymm register) made the
    /// kernel reload its unpacked codes from the stack after each group — on the DFlash drafter's 8-bit
    /// L-format matrices (Zen 3, one thread) its products took 10–12 % longer. Same instructions, same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn packed_tile<const B: u8, const G16: bool, const T: usize>(
        ctx: &Ctx,
        m: &QMatrix,
        pk: &Packed,
        r0: usize,
        nr: usize,
        t0: usize,
    ) {
        let cols = ctx.cols;
        let gs = if G16 { 16 } else { 32 };
        let gpb = QK / gs;
        let qpg = gs / 4;
        // Quads whose i16 pair sums may be added before `vpmaddwd` without overflow: |pair| ≤ 2·qmax·127.
        let run = match B {
            4 => 8,
            5 => 4,
            6 => 2,
            _ => 1,
        };
        let nblk = cols / QK;
        let lpb = Packed::lines_per_block(B);
        let rb = r0 / PACK_ROWS;
        let imp = m.implicit_min();
        debug_assert!(B != 8 || imp, "8-bit codes have the implicit offset");
        let r1 = xtile_bytes(gpb);
        let xt = ctx.xt.get().add(t0 * nblk * r1) as *const u8;
        let lines = pk.lines.as_ptr().add(rb * nblk * lpb);
        let sh = (m.group / gs).trailing_zeros();
        // Scale streams of this row block: per group 16 lanes; `d`/`dmin` per super-block.
        let ScaleStreams { f16s, f16m, sc, mn, d: dd, dmin: dm } = ScaleStreams::new(m, pk, rb);
        let sup = f16s.is_null();
        let i8v = |p: *const i8| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)));
        let ones = _mm256_set1_epi16(1);
        let zero = _mm256_setzero_si256();
        // Chains per half, token and c = g % 16 (the AVX-512 kernel's 16 chains, 8 rows a vector).
        let mut acc = [[[_mm256_setzero_ps(); 16]; T]; 2];
        for b in 0..nblk {
            let bl = lines.add(b * lpb);
            for l in 0..lpb {
                _mm_prefetch::<_MM_HINT_T1>(bl.wrapping_add(l + PF_LINES) as *const i8);
            }
            let rec = xt.add(b * T * r1);
            for h in 0..2 {
                if 8 * h >= nr {
                    break;
                }
                let q = unpack::<B>(bl, h);
                // 8-bit: signed codes c = q − 128, |c| as the unsigned operand, the sign moved to the activations.
                let (qa, qs) = if B == 8 {
                    let mut qa = [zero; 8];
                    let mut qs = [zero; 8];
                    let off = _mm256_set1_epi8(-128);
                    for j in 0..8 {
                        qs[j] = _mm256_add_epi8(q[j], off);
                        qa[j] = _mm256_abs_epi8(qs[j]);
                    }
                    (qa, qs)
                } else {
                    (q, q)
                };
                for hg in 0..gpb {
                    let w = b * gpb + hg;
                    let c = w & 15;
                    let gl = (w >> sh) * PACK_ROWS + 8 * h;
                    if sup {
                        _mm_prefetch::<_MM_HINT_T1>(sc.wrapping_add(gl + 1024));
                    } else {
                        _mm_prefetch::<_MM_HINT_T1>(f16s.wrapping_add(2 * gl + 1024) as *const i8);
                    }
                    let (s, mv) = if sup {
                        let sl = (w * gs / QK_SUPER) * PACK_ROWS + 8 * h;
                        let s = _mm256_mul_ps(_mm256_loadu_ps(dd.add(sl)), i8v(sc.add(gl)));
                        let mv = if imp { _mm256_setzero_ps() } else { _mm256_mul_ps(_mm256_loadu_ps(dm.add(sl)), i8v(mn.add(gl))) };
                        (s, mv)
                    } else {
                        let h16 = |p: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * gl) as *const __m128i));
                        (h16(f16s), if imp { _mm256_setzero_ps() } else { h16(f16m) })
                    };
                    for t in 0..T {
                        let term = rec.add(36 * T + 4 * (hg * T + t));
                        // 8-bit: the sign trick gives D' itself; otherwise D plus the record's offset term.
                        let mut d = if imp && B != 8 { _mm256_set1_epi32((term as *const i32).read_unaligned()) } else { zero };
                        let mut j = 0;
                        while j < qpg {
                            let mut p16 = zero;
                            for i in j..(j + run).min(qpg) {
                                let k = hg * qpg + i;
                                let xb = _mm256_set1_epi32((rec.add(32 * t + 4 * k) as *const i32).read_unaligned());
                                let p = if B == 8 {
                                    _mm256_maddubs_epi16(qa[k], _mm256_sign_epi8(xb, qs[k]))
                                } else {
                                    _mm256_maddubs_epi16(q[k], xb)
                                };
                                p16 = _mm256_add_epi16(p16, p);
                            }
                            d = _mm256_add_epi32(d, _mm256_madd_epi16(p16, ones));
                            j += run;
                        }
                        let xs = (rec.add(32 * T + 4 * t) as *const f32).read_unaligned();
                        let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_set1_ps(xs)), acc[h][t][c]);
                        acc[h][t][c] = if imp { a } else { _mm256_fmadd_ps(mv, _mm256_set1_ps((term as *const f32).read_unaligned()), a) };
                    }
                }
            }
        }
        for h in 0..2 {
            if 8 * h >= nr {
                break;
            }
            for t in 0..T {
                let a = &acc[h][t];
                let mut s8 = [_mm256_setzero_ps(); 8];
                for c in 0..8 {
                    s8[c] = _mm256_add_ps(a[c], a[c + 8]);
                }
                let s4 =
                    [_mm256_add_ps(s8[0], s8[4]), _mm256_add_ps(s8[1], s8[5]), _mm256_add_ps(s8[2], s8[6]), _mm256_add_ps(s8[3], s8[7])];
                let s2 = [_mm256_add_ps(s4[0], s4[2]), _mm256_add_ps(s4[1], s4[3])];
                let v = _mm256_add_ps(s2[0], s2[1]);
                _mm256_maskstore_ps(ctx.out.0.add((t0 + t) * ctx.rows + r0 + 8 * h), lanes(nr - 8 * h), v);
            }
        }
    }
}
