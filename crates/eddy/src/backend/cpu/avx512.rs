//! AVX-512 (F/BW/VL/VNNI) kernels.
//!
//! # Quantized weights: one canonical operation order per (row, token)
//! Let `D_g` be the exact i32 dot of the codes of weight group `g` (32 or 16 values) with the activation
//! codes, and `D'_g = D_g − 2^(bits−1)·Σq_x` for the implicit offset. Each (row, token) pair owns 16 f32
//! chains `acc[0..16]`, all starting at +0. For `g = 0, 1, 2, ...` chain `c = g % 16` is updated as
//! * implicit offset: `acc[c] = fma(f32(D'_g), S_g·d_g, acc[c])`
//! * explicit offset: `acc[c] = fma(f32(D_g), S_g·d_g, acc[c]); acc[c] = fma(M_g, dsum_g, acc[c])` with
//!   `dsum_g = d_g·f32(Σq_x)` from [`super::QuantizedActivations::dsum`]
//!
//! (`S_g`, `M_g` formed as `QMatrix::scale_min` forms them) and the result is the fixed tree
//! `((a0+a8)+(a4+a12))+((a2+a10)+(a6+a14)) + (same for odd c)`. Two kernels implement exactly this:
//! * GEMV (`n < 6`, 12 for bits 4): rows stream through `vpdpbusd` in natural layout (5/6-bit codes: the
//!   bit planes become byte masks with `vpshufbitqmb`, or `vpermw` + mask moves, and are added into the
//!   nibbles); the i32 lanes of 16 groups are reduced exactly into one vector whose lane `c` is
//!   `D_{16b+c}`, and the 16 chains are the 16 lanes of one accumulator (final reduction = the tree
//!   above). Tiles of `R` rows × `T` tokens (`T` up to 2 for bits 4, 4 otherwise): each weight chunk is
//!   loaded and unpacked once and dotted with the `T` tokens' activations, which are laid out once per
//!   call in the chunk order (`fill_xperm`), so the extra tokens of a small batch ride on one weight
//!   stream.
//! * GEMM (larger `n`): 16 rows are repacked (16×16 transposes, codes expanded to bytes) so that lane
//!   `r` of a vector holds 4 consecutive codes of row `r`; `vpdpbusd` with a broadcast 4-byte activation
//!   quad accumulates `D_g` for 16 rows at once, and chain `acc[c]` is a vector over the 16 rows. Tokens
//!   are processed 8 at a time per weight load.
//! * Packed (any `n`, when the matrix carries [`crate::quant::QMatrix::packed`], built once at load
//!   time): the GEMM's lane-per-row form without the per-call repack. The codes are stored at their
//!   width in lane-per-row lines (see [`crate::quant::Packed`]) and unpacked with and/shift/ternlog;
//!   scales are the same values in lane order, `S`/`M` formed as `scale_min` forms them. Token tiles of
//!   up to 8 per row block (16 for bits 5/6, whose unpacking costs more); the tiles' activations are laid
//!   out once per product ([`super::packed::fill_xtiles`]) so that every field a tile reads (codes, scales, the offset
//!   terms `−2^(bits−1)·Σq_x` or `dsum`) sits at a constant offset from one pointer per code block. Measured faster than both kernels above at every `n` on Zen 4 (also `n = 1`:
//!   no horizontal reductions), so it is used whenever present.
//! * Packed on AMX (`tdpbsud`; where the CPU and OS allow it, `EDDY_AMX=0` off, from n = 16 for groups of
//!   32 or more: [`amx_pays`]): the same tiles with `D_g` from tile dot products. `A` = the tile's tokens'
//!   codes straight from the activation record (row = token, 32 bytes, or 16 per half block for groups
//!   of 16), `B` = the block's 8 unpacked quad lines (the packed lines themselves for bits 8), which are
//!   exactly the VNNI `B` layout with lane = row, so row `t` of the i32 `C` tile is the vector over the
//!   16 rows that the epilogue consumes for token `t`. `C` is stored, the implicit-offset term added as
//!   an integer (exact), and the float epilogue is the same code, so outputs are bit-identical to the
//!   `vpdpbusd` path. Token tiles of 16 ([`AMX_TOKENS`]); blocks unpacked once per row block (by the
//!   first token tile, one chunk ahead of the tile loads) into a per-thread buffer.
//!
//! Weight groups of 64 or 128 values (eddy's M/L formats, F16 scales) run on the packed kernel only: the
//! order above with `g` counting units of 32 values (one activation scale each), each unit using the
//! `S`/`M` of the weight group containing it. Unpacked they run on the scalar tile.
//!
//! Integer parts are exact and the float operations per pair are identical in all kernels, so a
//! token's output is bit-identical for any `n`, tile, or thread count. (An untouched chain equals one
//! updated with `fma(0, 0, acc)`, since chains can never be −0.)
//!
//! # F32 / Bf16 weights
//! `R × T` register tiles; each pair owns one 16-lane accumulator (`fma` per 16 columns, masked tail)
//! reduced by the same tree, independent of `R`/`T`.

#![allow(clippy::needless_range_loop)] // SIMD tiles index several parallel arrays

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::{hsum, rows};

/// Unreachable on non-x86 targets (the path is never available there).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn rows(_: &super::Ctx, _: usize, _: std::ops::Range<usize>) {
    unreachable!("AVX-512 kernel on a non-x86 target")
}

/// Most tokens per packed tile of a `bits`-bit matrix (each unpacked block is dotted with all of them).
/// VNNI: 16 for bits 5/6, whose bit-plane unpacking costs as much as the 4-bit codes' whole epilogue
/// (measured on Sapphire Rapids, 8960×1536 Q6_K at n = 128: 1.13× over 8), else 8 (16 measured 0.92× for
/// Q4_K). AMX: [`AMX_TOKENS`].
pub(crate) const fn packed_tokens(bits: u8, amx: bool) -> usize {
    if amx {
        AMX_TOKENS
    } else if bits == 5 || bits == 6 {
        16
    } else {
        8
    }
}

/// Tokens per AMX tile (the rows of the `A` and `C` tiles, at most 16); 8 measured 0.83× of 16 at
/// n = 64 (Q4_K-like 8960×1536).
const AMX_TOKENS: usize = 16;

/// Whether a product of `n` tokens on `m` runs the packed kernel's dots on AMX (where available and
/// wanted): from n = 16, groups of 32 or more. Measured on Sapphire Rapids (8960×1536, one thread,
/// AMX/VNNI): Q4_K-like 0.74× at n = 8, 1.0–1.1× at 16, 1.3–1.5× at 64; Q6_K-like (groups of 16: dots of
/// K = 16, twice the tile work and epilogue per value) 0.87–1.03× at every n, so those stay on `vpdpbusd`.
pub(crate) fn amx_pays(m: &crate::quant::QMatrix, n: usize) -> bool {
    n >= 16 && m.group != 16
}

/// Whether the CPU has AMX-TILE and AMX-INT8 and the OS lets this process use the tile registers
/// (Linux: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, requested once per process, for every
/// thread). Any failure means no AMX, silently.
pub(crate) fn amx_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            use std::arch::x86_64::__cpuid_count;
            // Leaf 7 (read only if the CPU reports it), EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
            let cpu = __cpuid_count(0, 0).eax >= 7 && (__cpuid_count(7, 0).edx >> 24) & 3 == 3;
            if !cpu || !is_x86_feature_detected!("avx512vnni") {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it only changes this process's permissions.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::packed::{xtile_bytes, ScaleStreams};
    use super::super::{Ctx, ROW_BLOCK};
    use super::packed_tokens;
    use crate::quant::{super_block, GroupScales, Packed, QMatrix, WeightMatrix, PACK_ROWS, QK, QK_SUPER};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::cell::RefCell;
    use std::ops::Range;

    /// GEMV software prefetch (into L2) distance in rows: the hardware prefetchers alone leave ~40% of
    /// the DRAM bandwidth of one core unused (measured on Zen 4 and Sapphire Rapids; the L2 hint is
    /// much better than L1 on Zen 4).
    const PF_ROWS: usize = 8;
    /// Rows per GEMM block (one vector lane per row).
    const GEMM_ROWS: usize = 16;
    /// Most tokens per GEMV tile: each weight chunk is loaded and unpacked once for them (measured on
    /// Zen 4: the 4-bit unpack is cheap enough that 2-token tiles, which keep every partial dot in
    /// registers, win; the 5/6/8-bit ones gain from 4).
    const fn gemv_tokens(b: u8) -> usize {
        if b == 4 {
            2
        } else {
            4
        }
    }

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    thread_local! {
        /// Repacked weights of one 16-row block (GEMM); grows once per thread, then reused.
        static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
        /// GEMV activations in chunk layout ([`fill_xperm`]); grows once per thread, then reused.
        static XPERM: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
        /// The AMX `B` tiles of one row block (8 lines per code block): unpacked by its first token tile,
        /// reused by the others; grows, then reused.
        static AMX_W: std::cell::Cell<Vec<Line>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// Compute outputs for rows `range` and all `n` tokens.
    ///
    /// # Safety
    /// The CPU must support the AVX-512 path; shapes validated by `matmul_with`; no other writer of
    /// these rows.
    pub(crate) unsafe fn rows(ctx: &Ctx, n: usize, range: Range<usize>) {
        let m = match ctx.w {
            WeightMatrix::Q(m) => m,
            WeightMatrix::F32 { .. } | WeightMatrix::Bf16 { .. } => return float_rows(ctx, n, range),
        };
        match (m.bits, m.group == 16) {
            (4, false) => q_rows::<4, false>(ctx, m, n, range),
            (5, false) => q_rows::<5, false>(ctx, m, n, range),
            (6, false) => q_rows::<6, false>(ctx, m, n, range),
            (8, false) => q_rows::<8, false>(ctx, m, n, range),
            (4, true) => q_rows::<4, true>(ctx, m, n, range),
            (5, true) => q_rows::<5, true>(ctx, m, n, range),
            (6, true) => q_rows::<6, true>(ctx, m, n, range),
            _ => unreachable!("QMatrix bits {} group {} (check() rejects it)", m.bits, m.group),
        }
    }

    unsafe fn q_rows<const B: u8, const G16: bool>(ctx: &Ctx, m: &QMatrix, n: usize, range: Range<usize>) {
        if let Some(pk) = &m.packed {
            if n >= PACKED_MIN_N || !m.has_natural() {
                return packed_rows::<B, G16>(ctx, m, pk, n, range);
            }
        }
        if m.group > QK {
            // Groups of 64/128 (eddy's M/L formats) have only the packed kernel; unpacked (EDDY_PREPACK=0)
            // they run on the scalar tile, for every n (so still batch invariant).
            return super::super::scalar::tile(ctx, range.start, range.len(), 0, n);
        }
        // Smallest batch that uses the repacking GEMM (measured crossover; both give identical bits).
        let gemm_min_n = if B == 4 { 12 } else { 6 };
        if n >= gemm_min_n {
            let gs = if G16 { 16 } else { 32 };
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
                    gemm_block::<B, G16>(ctx, m, n, r, nr, scratch);
                    r += nr;
                }
            });
        } else {
            let bitalg = is_x86_feature_detected!("avx512bitalg");
            let lines = n * (ctx.cols / QK).div_ceil(4) * 2;
            XPERM.with(|xb| {
                let mut xb = xb.borrow_mut();
                if xb.len() < lines {
                    xb.resize(lines, Line([0; 64]));
                }
                let xperm = xb.as_mut_ptr() as *mut __m512i;
                fill_xperm::<B>(ctx, n, xperm);
                let mut rb = range.start;
                while rb < range.end {
                    let rb_end = (rb + ROW_BLOCK).min(range.end);
                    let mut t = 0;
                    while t < n {
                        let nt = (n - t).min(gemv_tokens(B));
                        let mut r = rb;
                        while r < rb_end {
                            r += gemv_tile::<B, G16>(ctx, m, r, rb_end - r, t, nt, bitalg, xperm);
                        }
                        t += nt;
                    }
                    rb = rb_end;
                }
            });
        }
    }

    /// Run one GEMV tile at rows `r..` (`left` rows left in the block) × tokens `t..t+nt`; returns the
    /// rows done. Row tiles: 4 for one token, else 2 (measured: 1-row tiles are much slower, even at 4
    /// tokens), 1 at a block's odd tail.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemv_tile<const B: u8, const G16: bool>(
        ctx: &Ctx,
        m: &QMatrix,
        r: usize,
        left: usize,
        t: usize,
        nt: usize,
        bitalg: bool,
        xperm: *const __m512i,
    ) -> usize {
        macro_rules! go {
            ($r:literal, $t:literal) => {{
                if bitalg {
                    gemv_bitalg::<B, G16, $r, $t>(ctx, m, r, t, xperm)
                } else {
                    gemv_plain::<B, G16, $r, $t>(ctx, m, r, t, xperm)
                }
                $r
            }};
        }
        match (nt, left) {
            (1, 4..) => go!(4, 1),
            (1, _) => go!(1, 1),
            (2, 2..) => go!(2, 2),
            (2, _) => go!(1, 2),
            (3, 2..) => go!(2, 3),
            (3, _) => go!(1, 3),
            (_, 2..) => go!(2, 4),
            _ => go!(1, 4),
        }
    }

    /// Horizontal sum with the fixed tree (c + c+8, then + c+4, then + c+2, then lane 0 + lane 1).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn hsum(v: __m512) -> f32 {
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

    /// Bit planes above the low nibble per block.
    const fn planes(b: u8) -> usize {
        if b == 5 || b == 6 {
            b as usize - 4
        } else {
            0
        }
    }

    /// `(S, M)` of the 16 weight groups `g..g+16` (`nb` of them valid, `g % 16 == 0`) of row `row`, lane
    /// `i` = group `g + i`, formed exactly as [`QMatrix::scale_min`] forms them. `M` is zero for the
    /// implicit offset.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn group_sm<const G16: bool>(m: &QMatrix, row: usize, g: usize, nb: usize) -> (__m512, __m512) {
        let gs = if G16 { 16 } else { 32 };
        let gi = row * (m.cols / gs) + g;
        let bm = mask16(nb);
        match &m.scales {
            GroupScales::F16 { scale, min } => {
                let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, scale.as_ptr().add(gi) as *const i16));
                let mn = match min {
                    Some(min) => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, min.as_ptr().add(gi) as *const i16)),
                    None => _mm512_setzero_ps(),
                };
                (s, mn)
            }
            GroupScales::SuperI8 { sc, mn, d, dmin } => {
                let sb = super_block(m.cols, row, g * gs);
                // 16 groups of 32 span super-blocks sb (lanes 0..8) and sb+1; 16 groups of 16 span sb.
                let two = |v: &[f32]| {
                    if G16 || nb <= 8 {
                        _mm512_set1_ps(v[sb])
                    } else {
                        _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(v[sb]), _mm512_set1_ps(v[sb + 1]))
                    }
                };
                let i8v = |p: *const i8| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(bm, p)));
                let s = _mm512_mul_ps(two(d), i8v(sc.as_ptr().add(gi)));
                let mnv = match mn {
                    Some(mn) => _mm512_mul_ps(two(dmin), i8v(mn.as_ptr().add(gi))),
                    None => _mm512_setzero_ps(),
                };
                (s, mnv)
            }
        }
    }

    /// `vpermw` index that transposes the 16-bit halves of the bit-plane words of a 4-block chunk: source
    /// word `2Pc + q` (block `c`, plane `q / 2`, half `q % 2`) goes to word `4q + c`, so that u64 `q` of the
    /// result is the byte mask of plane `q / 2` for the low (`q` even: elements `0..16` of each block) or
    /// high (elements `16..32`) nibble vector. `[P − 1]`.
    const PLANE_T: [[i16; 16]; 2] = [plane_t(1), plane_t(2)];

    const fn plane_t(planes: usize) -> [i16; 16] {
        let mut v = [0i16; 16];
        let mut q = 0;
        while q < 2 * planes {
            let mut c = 0;
            while c < 4 {
                v[4 * q + c] = (2 * planes * c + q) as i16;
                c += 1;
            }
            q += 1;
        }
        v
    }

    /// `vpshufbitqmb` bit selectors: mask bit `16c + j` of the low (`h` = 0: element `j`) or high (`h` = 1:
    /// element `j + 16`) nibble vector is bit `j + 16h` of block `c`'s plane `p`, where qword `q` of the
    /// source holds u64 [`PLANE_Q`]`[q]` of the chunk's plane bytes. `[P − 1][p][h]`.
    const PLANE_SEL: [[[[u8; 64]; 2]; 2]; 2] = [
        [[plane_sel(1, 0, 0), plane_sel(1, 0, 1)], [[0; 64]; 2]],
        [[plane_sel(2, 0, 0), plane_sel(2, 0, 1)], [plane_sel(2, 1, 0), plane_sel(2, 1, 1)]],
    ];
    /// Source qword of 64-bit lane `q` (block `q / 2`) of the plane bytes: `[P − 1]`.
    const PLANE_Q: [[i64; 8]; 2] = [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3]];

    const fn plane_sel(planes: usize, p: usize, h: usize) -> [u8; 64] {
        let mut v = [0u8; 64];
        let mut q = 0;
        while q < 8 {
            let c = q / 2;
            // Bit offset of block c's plane p word inside its source qword.
            let base = if planes == 1 { 32 * (c % 2) } else { 32 * p };
            let mut i = 0;
            while i < 8 {
                v[8 * q + i] = (base + 16 * h + 8 * (q % 2) + i) as u8;
                i += 1;
            }
            q += 1;
        }
        v
    }

    /// [`reduce_idx`] for group 32 and group 16.
    const REDUCE_IDX: [[i32; 16]; 2] = [reduce_idx(false), reduce_idx(true)];

    /// Weights of one GEMV chunk: blocks `blk..blk+nbk` (`nbk <= 4`, `blk` row-relative and a multiple of
    /// 4) of rows `r0..r0+R`, zero-filled past `nbk`. Bits 4/5/6: per row the codes expanded to bytes,
    /// elements `0..16` of block `c` in 128-bit lane `c` of the first vector and elements `16..32` in the
    /// second (the activation layout of [`fill_xperm`]); bits 8: the 128 code bytes as they are. Prefetches
    /// `PF_ROWS` rows ahead. `BITALG`: build the plane masks with `vpshufbitqmb` (else `vpermw` and moves
    /// through GPRs); both give the same bytes. Inlined into [`gemv_bitalg`] / [`gemv_plain`], which enable
    /// the features.
    #[inline(always)]
    unsafe fn wchunk<const B: u8, const R: usize, const BITALG: bool>(
        m: &QMatrix,
        r0: usize,
        blk: usize,
        nbk: usize,
        pf_hi: bool,
    ) -> [[__m512i; 2]; R] {
        let cols = m.cols;
        let zero = _mm512_setzero_si512();
        let mut v = [[zero; 2]; R];
        let e = blk * QK;
        if B == 8 {
            for r in 0..R {
                let w = m.lo.as_ptr().add((r0 + r) * cols + e);
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(PF_ROWS * cols) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(PF_ROWS * cols + 64) as *const i8);
                v[r][0] = load_bytes(w, 32 * nbk);
                v[r][1] = if nbk > 2 { load_bytes(w.add(64), 32 * nbk - 64) } else { zero };
            }
            return v;
        }
        let p_n = planes(B);
        let nib = _mm512_set1_epi8(0x0F);
        let pt = _mm256_loadu_si256(PLANE_T[p_n.max(1) - 1].as_ptr() as *const __m256i);
        let pq = _mm512_loadu_si512(PLANE_Q[p_n.max(1) - 1].as_ptr() as *const __m512i);
        let mut sel = [[zero; 2]; 2];
        for p in 0..p_n {
            for h in 0..2 {
                sel[p][h] = _mm512_loadu_si512(PLANE_SEL[p_n - 1][p][h].as_ptr() as *const __m512i);
            }
        }
        let hi_row = cols / QK * 4 * p_n;
        for r in 0..R {
            let pp = m.lo.as_ptr().add(((r0 + r) * cols + e) / 2);
            _mm_prefetch::<_MM_HINT_T1>(pp.wrapping_add(PF_ROWS * cols / 2) as *const i8);
            let pw = load_bytes(pp, 16 * nbk);
            let mut lo = _mm512_and_si512(pw, nib);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(pw), nib);
            if p_n > 0 {
                let ph = m.hi.as_ptr().add((r0 + r) * hi_row + blk * 4 * p_n);
                if pf_hi {
                    _mm_prefetch::<_MM_HINT_T1>(ph.wrapping_add(PF_ROWS * hi_row) as *const i8);
                }
                let hb = _mm256_maskz_loadu_epi8(mask64(4 * p_n * nbk) as __mmask32, ph as *const i8);
                if BITALG {
                    let src = _mm512_permutexvar_epi64(pq, _mm512_castsi256_si512(hb));
                    for p in 0..p_n {
                        let add = _mm512_set1_epi8((16 << p) as i8);
                        let kl = _mm512_bitshuffle_epi64_mask(src, sel[p][0]);
                        let kh = _mm512_bitshuffle_epi64_mask(src, sel[p][1]);
                        lo = _mm512_mask_add_epi8(lo, kl, lo, add);
                        hi = _mm512_mask_add_epi8(hi, kh, hi, add);
                    }
                } else {
                    let t = _mm256_permutexvar_epi16(pt, hb);
                    let add = _mm512_set1_epi8(16);
                    let kl = _cvtu64_mask64(_mm256_extract_epi64::<0>(t) as u64);
                    let kh = _cvtu64_mask64(_mm256_extract_epi64::<1>(t) as u64);
                    lo = _mm512_mask_add_epi8(lo, kl, lo, add);
                    hi = _mm512_mask_add_epi8(hi, kh, hi, add);
                    if p_n == 2 {
                        let add = _mm512_set1_epi8(32);
                        let kl = _cvtu64_mask64(_mm256_extract_epi64::<2>(t) as u64);
                        let kh = _cvtu64_mask64(_mm256_extract_epi64::<3>(t) as u64);
                        lo = _mm512_mask_add_epi8(lo, kl, lo, add);
                        hi = _mm512_mask_add_epi8(hi, kh, hi, add);
                    }
                }
            }
            v[r] = [lo, hi];
        }
        v
    }

    /// Exact i32 partial dots of one row's chunk weights `w` ([`wchunk`]) with one token's chunk
    /// activations `x` ([`fill_xperm`]). Group 32: the first vector has in 128-bit lane `c` four partial
    /// dots of block `c` (the second is unused); group 16: lane `c` of the first holds group `2c` of the
    /// chunk, of the second group `2c + 1`.
    #[inline(always)]
    unsafe fn cdot<const B: u8, const G16: bool>(w: &[__m512i; 2], x: &[__m512i; 2]) -> [__m512i; 2] {
        let zero = _mm512_setzero_si512();
        if B == 8 {
            let da = _mm512_dpbusd_epi32(zero, w[0], x[0]);
            let db = _mm512_dpbusd_epi32(zero, w[1], x[1]);
            [_mm512_add_epi32(_mm512_shuffle_i32x4::<0b10_00_10_00>(da, db), _mm512_shuffle_i32x4::<0b11_01_11_01>(da, db)), zero]
        } else if G16 {
            [_mm512_dpbusd_epi32(zero, w[0], x[0]), _mm512_dpbusd_epi32(zero, w[1], x[1])]
        } else {
            [_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w[0], x[0]), w[1], x[1]), zero]
        }
    }

    /// Lay out the activation codes of tokens `0..n` for the GEMV: per token, per chunk of 4 blocks, two
    /// vectors (zero-filled past the row end). Bits 4/5/6: the low halves (elements `0..16`) of the 4
    /// blocks, then the high halves; bits 8: the 128 bytes as they are. `dst` holds
    /// `n · ceil(cols/128) · 2` vectors.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn fill_xperm<const B: u8>(ctx: &Ctx, n: usize, dst: *mut __m512i) {
        let cols = ctx.cols;
        let nblk = cols / QK;
        let zero = _mm512_setzero_si512();
        let idx_lo = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
        let idx_hi = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
        let mut o = dst;
        for t in 0..n {
            let xp = (ctx.xq.q.as_ptr() as *const u8).add(t * cols);
            let mut blk = 0;
            while blk < nblk {
                let nbk = (nblk - blk).min(4);
                let e = blk * QK;
                let x0 = load_bytes(xp.add(e), 32 * nbk);
                let x1 = if nbk > 2 { load_bytes(xp.add(e + 64), 32 * nbk - 64) } else { zero };
                let (a, b) =
                    if B == 8 { (x0, x1) } else { (_mm512_permutex2var_epi64(x0, idx_lo, x1), _mm512_permutex2var_epi64(x0, idx_hi, x1)) };
                _mm512_store_si512(o, a);
                _mm512_store_si512(o.add(1), b);
                o = o.add(2);
                blk += nbk;
            }
        }
    }

    /// Lane permutation of the GEMV reduction: lane `g` (group `g` of a 16-group step) takes dword
    /// `idx[g]` (and `idx[g] + 2`) of the pair vectors. Slot `4q + c` is 128-bit lane `c` of chunk
    /// vector `q`; group 32: slot = group; group 16: vector `q = 2k + h` lane `c` is group `8k + 2c + h`.
    const fn reduce_idx(g16: bool) -> [i32; 16] {
        let mut idx = [0i32; 16];
        let mut g = 0;
        while g < 16 {
            let (q, c) = if g16 { (2 * (g / 8) + g % 2, (g % 8) / 2) } else { (g / 4, g % 4) };
            idx[g] = (4 * c + (q & 1) + 16 * (q / 2)) as i32;
            g += 1;
        }
        idx
    }

    /// GEMV: rows `r0..r0+R` × tokens `t0..t0+T`, natural weight layout; `xperm` from [`fill_xperm`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bitalg,avx2,fma")]
    unsafe fn gemv_bitalg<const B: u8, const G16: bool, const R: usize, const T: usize>(
        ctx: &Ctx,
        m: &QMatrix,
        r0: usize,
        t0: usize,
        xperm: *const __m512i,
    ) {
        gemv::<B, G16, R, T, true>(ctx, m, r0, t0, xperm)
    }

    /// [`gemv`] for CPUs without AVX512-BITALG.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemv_plain<const B: u8, const G16: bool, const R: usize, const T: usize>(
        ctx: &Ctx,
        m: &QMatrix,
        r0: usize,
        t0: usize,
        xperm: *const __m512i,
    ) {
        gemv::<B, G16, R, T, false>(ctx, m, r0, t0, xperm)
    }

    /// GEMV body, inlined into [`gemv_bitalg`] / [`gemv_plain`]. Each weight chunk is loaded and unpacked
    /// once for the `T` tokens; every (row, token) pair runs the same integer and float operations as
    /// with `T = 1`.
    #[inline(always)]
    unsafe fn gemv<const B: u8, const G16: bool, const R: usize, const T: usize, const BITALG: bool>(
        ctx: &Ctx,
        m: &QMatrix,
        r0: usize,
        t0: usize,
        xperm: *const __m512i,
    ) {
        let cols = ctx.cols;
        let xq = ctx.xq;
        let gs = if G16 { 16 } else { 32 };
        let wgpr = cols / gs;
        let xgpr = cols / QK;
        let nch = xgpr.div_ceil(4);
        let imp = m.implicit_min();
        let mut xs = [xq.scale.as_ptr(); T];
        let mut xds = [xq.dsum.as_ptr(); T];
        let mut xsum = [xq.sum.as_ptr(); T];
        let mut xc = [xperm; T];
        for t in 0..T {
            let tt = t0 + t;
            xs[t] = xq.scale.as_ptr().add(tt * xgpr);
            xds[t] = xq.dsum.as_ptr().add(tt * xgpr);
            xsum[t] = if G16 { xq.sum16.as_ptr().add(tt * cols / 16) } else { xq.sum.as_ptr().add(tt * xgpr) };
            xc[t] = xperm.add(tt * nch * 2);
        }

        let zero = _mm512_setzero_si512();
        let idx_a = _mm512_loadu_si512(REDUCE_IDX[G16 as usize].as_ptr() as *const __m512i);
        let idx_b = _mm512_add_epi32(idx_a, _mm512_set1_epi32(2));
        let dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        // Scale bytes per group and their base, for the prefetch of the scales PF_ROWS rows on.
        let (sp, sbytes): (*const u8, usize) = match &m.scales {
            GroupScales::F16 { scale, .. } => (scale.as_ptr() as *const u8, 2),
            GroupScales::SuperI8 { sc, .. } => (sc.as_ptr() as *const u8, 1),
        };
        let mp: *const u8 = match &m.scales {
            GroupScales::F16 { min: Some(v), .. } => v.as_ptr() as *const u8,
            GroupScales::SuperI8 { mn: Some(v), .. } => v.as_ptr() as *const u8,
            _ => sp,
        };
        // Blocks per chunk line of the bit planes: prefetch them once per 64 bytes.
        let pf_every = if planes(B) == 2 { 2 } else { 4 };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut g = 0;
        while g < wgpr {
            let nb = (wgpr - g).min(16);
            let bm = mask16(nb);
            let blk0 = g * gs / QK;
            let nblk = nb * gs / QK;
            // 128-bit lane c of chunk vector q holds 4 partials of slot 4q+c: reduce pairs of vectors
            // (q = 2p, 2p + 1) as soon as both exist.
            let mut pairs = [[[zero; T]; R]; 2];
            for p in 0..2 {
                let mut v = [[[zero; T]; R]; 2];
                // Group 16: chunk p gives both vectors; group 32: chunk 2p + h gives vector h.
                for h in 0..(if G16 { 1 } else { 2 }) {
                    let k = if G16 { p } else { 2 * p + h };
                    let nbk = nblk.saturating_sub(4 * k).min(4);
                    if nbk == 0 {
                        continue;
                    }
                    let blk = blk0 + 4 * k;
                    let w = wchunk::<B, R, BITALG>(m, r0, blk, nbk, k % pf_every == 0);
                    for t in 0..T {
                        let xa = xc[t].add(2 * (blk / 4));
                        let x = [_mm512_load_si512(xa), _mm512_load_si512(xa.add(1))];
                        for r in 0..R {
                            let c = cdot::<B, G16>(&w[r], &x);
                            if G16 {
                                v[0][r][t] = c[0];
                                v[1][r][t] = c[1];
                            } else {
                                v[h][r][t] = c[0];
                            }
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..T {
                        pairs[p][r][t] =
                            _mm512_add_epi32(_mm512_unpacklo_epi32(v[0][r][t], v[1][r][t]), _mm512_unpackhi_epi32(v[0][r][t], v[1][r][t]));
                    }
                }
            }
            let mut d16 = [_mm512_setzero_ps(); T];
            let mut corr = [zero; T];
            let mut e16 = [_mm512_setzero_ps(); T];
            for t in 0..T {
                d16[t] = if G16 {
                    _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mask16(nb / 2), xs[t].add(g / 2)))
                } else {
                    _mm512_maskz_loadu_ps(bm, xs[t].add(g))
                };
                if imp {
                    corr[t] = _mm512_sllv_epi32(_mm512_maskz_loadu_epi32(bm, xsum[t].add(g)), _mm512_set1_epi32(B as i32 - 1));
                } else {
                    e16[t] = _mm512_maskz_loadu_ps(bm, xds[t].add(g));
                }
            }
            for r in 0..R {
                let gi = (r0 + r) * wgpr + g;
                _mm_prefetch::<_MM_HINT_T1>(sp.wrapping_add((gi + PF_ROWS * wgpr) * sbytes) as *const i8);
                if !imp {
                    _mm_prefetch::<_MM_HINT_T1>(mp.wrapping_add((gi + PF_ROWS * wgpr) * sbytes) as *const i8);
                }
                let (s16, m16) = group_sm::<G16>(m, r0 + r, g, nb);
                for t in 0..T {
                    let d = _mm512_sub_epi32(
                        _mm512_add_epi32(
                            _mm512_permutex2var_epi32(pairs[0][r][t], idx_a, pairs[1][r][t]),
                            _mm512_permutex2var_epi32(pairs[0][r][t], idx_b, pairs[1][r][t]),
                        ),
                        corr[t],
                    );
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s16, d16[t]), acc[r][t]);
                    if !imp {
                        acc[r][t] = _mm512_fmadd_ps(m16, e16[t], acc[r][t]);
                    }
                }
            }
            g += nb;
        }
        for t in 0..T {
            for r in 0..R {
                *ctx.out.0.add((t0 + t) * ctx.rows + r0 + r) = hsum(acc[r][t]);
            }
        }
    }

    /// GEMM for rows `r0..r0+nr` (`nr <= 16`) and all `n` tokens: repack, then token tiles of 8.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemm_block<const B: u8, const G16: bool>(ctx: &Ctx, m: &QMatrix, n: usize, r0: usize, nr: usize, scratch: *mut __m512i) {
        repack::<B, G16>(m, r0, nr, scratch);
        let mut t = 0;
        while t < n {
            let left = n - t;
            let step = if left >= 8 {
                gemm_tile::<B, G16, 8>(ctx, m, r0, nr, t, scratch);
                8
            } else if left >= 4 {
                gemm_tile::<B, G16, 4>(ctx, m, r0, nr, t, scratch);
                4
            } else if left >= 2 {
                gemm_tile::<B, G16, 2>(ctx, m, r0, nr, t, scratch);
                2
            } else {
                gemm_tile::<B, G16, 1>(ctx, m, r0, nr, t, scratch);
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

    /// Repack rows `r0..r0+nr` into `scratch`: per weight group `w`, `gs/4` vectors whose lane `r` holds
    /// 4 consecutive codes of row `r0+r` (expanded to bytes), then the 16 scales `S`, then the 16 offsets
    /// `M` (zero for the implicit offset). Missing rows are zero. Done with 16×16 transposes of 64-byte
    /// row slices.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn repack<const B: u8, const G16: bool>(m: &QMatrix, r0: usize, nr: usize, scratch: *mut __m512i) {
        let cols = m.cols;
        let gs = if G16 { 16 } else { 32 };
        let qj = gs / 4;
        let stride = qj + 2;
        let wgpr = cols / gs;
        let nblk = cols / QK;
        let p_n = planes(B);
        let zero = _mm512_setzero_si512();
        let nib = _mm512_set1_epi8(0x0F);
        let mut a = [zero; 16];
        if B == 8 {
            // 64-byte slices = 2 blocks; a[8c + j] lane r = codes 4j.. of block c of row r.
            let mut b = 0;
            while b < nblk {
                let nbk = (nblk - b).min(2);
                for r in 0..16 {
                    a[r] = if r < nr { load_bytes(m.lo.as_ptr().add((r0 + r) * cols + b * QK), 32 * nbk) } else { zero };
                }
                transpose16(&mut a);
                for c in 0..nbk {
                    for j in 0..8 {
                        _mm512_store_si512(scratch.add((b + c) * stride + j), a[8 * c + j]);
                    }
                }
                b += nbk;
            }
        } else {
            let hi_row = nblk * 4 * p_n;
            let mut hv = [zero; 32];
            // Byte j/2 of each dword to all 4 bytes; bit 4(j%2)+k selects element 4j+k.
            let sel = [_mm512_set1_epi32(0x0804_0201), _mm512_set1_epi32(0x8040_2010u32 as i32)];
            let mut ctl = [zero; 4];
            for (h, c) in ctl.iter_mut().enumerate() {
                let mut v = [0u8; 64];
                for (i, b) in v.iter_mut().enumerate() {
                    *b = ((i % 16) / 4 * 4 + h) as u8;
                }
                *c = _mm512_loadu_si512(v.as_ptr() as *const __m512i);
            }
            let mut b0 = 0;
            while b0 < nblk {
                let nb16 = (nblk - b0).min(16);
                // Plane words: hv[P·b + p] lane r = plane p of block b0+b of row r.
                for s in 0..p_n {
                    let nbytes = (4 * p_n * nb16).saturating_sub(64 * s).min(64);
                    if nbytes == 0 {
                        continue;
                    }
                    for r in 0..16 {
                        a[r] = if r < nr { load_bytes(m.hi.as_ptr().add((r0 + r) * hi_row + b0 * 4 * p_n + 64 * s), nbytes) } else { zero };
                    }
                    transpose16(&mut a);
                    hv[16 * s..16 * s + 16].copy_from_slice(&a);
                }
                let mut b = 0;
                while b < nb16 {
                    let nbk = (nb16 - b).min(4);
                    for r in 0..16 {
                        a[r] = if r < nr { load_bytes(m.lo.as_ptr().add(((r0 + r) * cols + (b0 + b) * QK) / 2), 16 * nbk) } else { zero };
                    }
                    transpose16(&mut a);
                    for c in 0..nbk {
                        let bi = b + c; // block within the 16-block step
                        for j in 0..4 {
                            let v = a[4 * c + j];
                            let mut lo = _mm512_and_si512(v, nib);
                            let mut hi = _mm512_and_si512(_mm512_srli_epi32::<4>(v), nib);
                            for p in 0..p_n {
                                let w = hv[p_n * bi + p];
                                let add = _mm512_set1_epi8((16 << p) as i8);
                                let kl = _mm512_test_epi8_mask(_mm512_shuffle_epi8(w, ctl[j / 2]), sel[j % 2]);
                                let kh = _mm512_test_epi8_mask(_mm512_shuffle_epi8(w, ctl[2 + j / 2]), sel[j % 2]);
                                lo = _mm512_mask_add_epi8(lo, kl, lo, add);
                                hi = _mm512_mask_add_epi8(hi, kh, hi, add);
                            }
                            let blk = b0 + bi;
                            if G16 {
                                _mm512_store_si512(scratch.add(2 * blk * stride + j), lo);
                                _mm512_store_si512(scratch.add((2 * blk + 1) * stride + j), hi);
                            } else {
                                _mm512_store_si512(scratch.add(blk * stride + j), lo);
                                _mm512_store_si512(scratch.add(blk * stride + j + 4), hi);
                            }
                        }
                    }
                    b += nbk;
                }
                b0 += nb16;
            }
        }
        // Scales and offsets: 16 rows × 16 groups at a time.
        let mut sa = [zero; 16];
        let mut w = 0;
        while w < wgpr {
            let nb = (wgpr - w).min(16);
            for r in 0..16 {
                (a[r], sa[r]) = if r < nr {
                    let (s, mn) = group_sm::<G16>(m, r0 + r, w, nb);
                    (_mm512_castps_si512(s), _mm512_castps_si512(mn))
                } else {
                    (zero, zero)
                };
            }
            transpose16(&mut a);
            transpose16(&mut sa);
            for c in 0..nb {
                _mm512_store_si512(scratch.add((w + c) * stride + qj), a[c]);
                _mm512_store_si512(scratch.add((w + c) * stride + qj + 1), sa[c]);
            }
            w += nb;
        }
    }

    /// Per token `t0 + t`: its activation codes, scales, `dsum`s, and code sums per weight group
    /// (`sum16` for group 16, else `sum`).
    #[allow(clippy::type_complexity)]
    unsafe fn token_ptrs<const G16: bool, const T: usize>(
        ctx: &Ctx,
        t0: usize,
    ) -> ([*const u8; T], [*const f32; T], [*const f32; T], [*const i32; T]) {
        let (cols, xq) = (ctx.cols, ctx.xq);
        let xgpr = cols / QK;
        let xbase = xq.q.as_ptr() as *const u8;
        let mut xp = [xbase; T];
        let mut xs = [xq.scale.as_ptr(); T];
        let mut xds = [xq.dsum.as_ptr(); T];
        let mut xsum = [xq.sum.as_ptr(); T];
        for t in 0..T {
            xp[t] = xbase.add((t0 + t) * cols);
            xs[t] = xs[t].add((t0 + t) * xgpr);
            xds[t] = xds[t].add((t0 + t) * xgpr);
            xsum[t] = if G16 { xq.sum16.as_ptr().add((t0 + t) * cols / 16) } else { xsum[t].add((t0 + t) * xgpr) };
        }
        (xp, xs, xds, xsum)
    }

    /// GEMM tile: the repacked 16-row block × tokens `t0..t0+T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn gemm_tile<const B: u8, const G16: bool, const T: usize>(
        ctx: &Ctx,
        m: &QMatrix,
        r0: usize,
        nr: usize,
        t0: usize,
        scratch: *const __m512i,
    ) {
        let cols = ctx.cols;
        let gs = if G16 { 16 } else { 32 };
        let qj = gs / 4;
        let stride = qj + 2;
        let wgpr = cols / gs;
        let imp = m.implicit_min();
        let (xp, xs, xds, xsum) = token_ptrs::<G16, T>(ctx, t0);
        let mut acc = [[_mm512_setzero_ps(); 16]; T];
        for w in 0..wgpr {
            let c = w & 15;
            let blk = scratch.add(w * stride);
            let mut d = [_mm512_setzero_si512(); T];
            if imp {
                for t in 0..T {
                    d[t] = _mm512_set1_epi32(-(*xsum[t].add(w) << (B - 1)));
                }
            }
            for j in 0..qj {
                let wv = _mm512_load_si512(blk.add(j));
                for t in 0..T {
                    let xb = _mm512_set1_epi32((xp[t].add(w * gs + 4 * j) as *const i32).read_unaligned());
                    d[t] = _mm512_dpbusd_epi32(d[t], wv, xb);
                }
            }
            let s = _mm512_load_ps(blk.add(qj) as *const f32);
            let xg = w * gs / QK;
            for t in 0..T {
                let dg = *xs[t].add(xg);
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[t]), _mm512_mul_ps(s, _mm512_set1_ps(dg)), acc[t][c]);
                acc[t][c] =
                    if imp { a } else { _mm512_fmadd_ps(_mm512_load_ps(blk.add(qj + 1) as *const f32), _mm512_set1_ps(*xds[t].add(w)), a) };
            }
        }
        for t in 0..T {
            store_chains(ctx, &acc[t], r0, nr, t0 + t);
        }
    }

    /// Reduce the 16 chain vectors of a 16-row block (lane = row) with the fixed tree and store rows
    /// `r0..r0+nr` of token `t`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn store_chains(ctx: &Ctx, a: &[__m512; 16], r0: usize, nr: usize, t: usize) {
        let mut s8 = [_mm512_setzero_ps(); 8];
        for c in 0..8 {
            s8[c] = _mm512_add_ps(a[c], a[c + 8]);
        }
        let s4 = [_mm512_add_ps(s8[0], s8[4]), _mm512_add_ps(s8[1], s8[5]), _mm512_add_ps(s8[2], s8[6]), _mm512_add_ps(s8[3], s8[7])];
        let s2 = [_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3])];
        let v = _mm512_add_ps(s2[0], s2[1]);
        _mm512_mask_storeu_ps(ctx.out.0.add(t * ctx.rows + r0), mask16(nr), v);
    }

    /// Smallest batch that uses the prepacked kernel when the matrix has [`QMatrix::packed`] (measured
    /// on Zen 4, 8960×1536 from DRAM: faster than the natural-layout GEMV at `n = 1` too).
    const PACKED_MIN_N: usize = 1;
    /// Packed-code prefetch distance in lines (into L2).
    const PF_LINES: usize = 64;

    /// Prepacked kernel: the 16-row blocks of `range` (`range.start % 16 == 0`) × all `n` tokens, token
    /// tiles of up to [`packed_tokens`]; the same operations per (row, token) as [`gemm_tile`].
    unsafe fn packed_rows<const B: u8, const G16: bool>(ctx: &Ctx, m: &QMatrix, pk: &Packed, n: usize, range: Range<usize>) {
        assert!(range.start.is_multiple_of(PACK_ROWS), "packed rows start on a 16-row block");
        assert!(!ctx.xt.get().is_null(), "packed kernel without its activation tiles (matmul_with lays them out)");
        if ctx.amx {
            return packed_rows_amx::<B, G16>(ctx, m, pk, n, range);
        }
        let tile = packed_tokens(B, false);
        let mut r = range.start;
        while r < range.end {
            let nr = (range.end - r).min(PACK_ROWS);
            let mut t = 0;
            while t < n {
                let nt = (n - t).min(tile);
                packed_tile_n::<B, G16, false>(nt, ctx, m, pk, r, nr, t, std::ptr::null_mut(), false);
                t += nt;
            }
            r += nr;
        }
    }

    /// [`packed_tile`] for a token tile of `nt` tokens (1 to 16), the tile size chosen at run time.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn packed_tile_n<const B: u8, const G16: bool, const AMX: bool>(
        nt: usize,
        ctx: &Ctx,
        m: &QMatrix,
        pk: &Packed,
        r0: usize,
        nr: usize,
        t0: usize,
        wb: *mut u8,
        fill: bool,
    ) {
        macro_rules! go {
            ($($k:literal)*) => {
                match nt {
                    $($k => packed_tile::<B, G16, $k, AMX>(ctx, m, pk, r0, nr, t0, wb, fill),)*
                    _ => unreachable!("token tile of {nt}"),
                }
            };
        }
        go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// Weight groups per AMX chunk (one [`amx_chunk`] step): their `C` tiles are all stored before the
    /// epilogue reads them. Measured 8960×1536 Q4_K-like, n = 64: chunks of 16 groups 295 GOP/s, 8 360, 4
    /// 378 (the `C` buffer's L1 footprint).
    const AMX_CHUNK: usize = 4;

    /// 64-byte AMX tile configuration (palette 1): `colsb[16]` at byte 16, `rows[16]` at byte 48.
    #[repr(C, align(64))]
    struct TileCfg([u8; 64]);

    /// Tiles of the packed AMX kernel ([`amx_chunk`]) for `t` tokens and dots of `gs` values: `C` tiles
    /// tmm0/1/6/7 (`t` × 16 i32: token × row), `A` tiles tmm2/3 (`t` × `gs` activation bytes), `B` tiles
    /// tmm4/5 (`gs/4` × 64 bytes: VNNI quads, lane = row).
    fn amx_config(t: usize, gs: usize) -> TileCfg {
        let mut c = TileCfg([0; 64]);
        c.0[0] = 1;
        let mut set = |tmm: usize, rows: usize, colsb: usize| {
            c.0[16 + 2 * tmm..18 + 2 * tmm].copy_from_slice(&(colsb as u16).to_le_bytes());
            c.0[48 + tmm] = rows as u8;
        };
        for h in 0..2 {
            set(h, t, 64);
            set(6 + h, t, 64);
            set(2 + h, t, gs);
            set(4 + h, gs / 4, 64);
        }
        c
    }

    /// [`packed_rows`] with the integer dots on AMX (`tdpbsud`): the same tiles' operations, token tiles
    /// of up to [`super::AMX_TOKENS`]. Loads the tile configuration in this thread (again when the tile
    /// size changes) and releases the tiles before returning.
    unsafe fn packed_rows_amx<const B: u8, const G16: bool>(ctx: &Ctx, m: &QMatrix, pk: &Packed, n: usize, range: Range<usize>) {
        let tile = packed_tokens(B, true);
        let gs = if G16 { 16 } else { 32 };
        let mut wbuf = AMX_W.with(|b| b.take());
        if B != 8 && wbuf.len() < 8 * (ctx.cols / QK) {
            wbuf.resize(8 * (ctx.cols / QK), Line([0; 64]));
        }
        let wb = wbuf.as_mut_ptr() as *mut u8;
        let mut cfg_t = 0;
        let mut r = range.start;
        while r < range.end {
            let nr = (range.end - r).min(PACK_ROWS);
            let mut t = 0;
            while t < n {
                let nt = (n - t).min(tile);
                if nt != cfg_t {
                    let cfg = amx_config(nt, gs);
                    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, preserves_flags, readonly));
                    cfg_t = nt;
                }
                packed_tile_n::<B, G16, true>(nt, ctx, m, pk, r, nr, t, wb, t == 0);
                t += nt;
            }
            r += nr;
        }
        asm!("tilerelease", options(nostack, preserves_flags, nomem));
        AMX_W.with(|b| b.replace(wbuf));
    }

    /// Shift every 16-bit lane left by `s` (right by `−s`), `−4 ≤ s ≤ 4`; `s` is a constant after
    /// unrolling.
    #[inline(always)]
    unsafe fn shl16(v: __m512i, s: i32) -> __m512i {
        match s {
            4 => _mm512_slli_epi16::<4>(v),
            3 => _mm512_slli_epi16::<3>(v),
            2 => _mm512_slli_epi16::<2>(v),
            1 => _mm512_slli_epi16::<1>(v),
            0 => v,
            -1 => _mm512_srli_epi16::<1>(v),
            -2 => _mm512_srli_epi16::<2>(v),
            -3 => _mm512_srli_epi16::<3>(v),
            _ => _mm512_srli_epi16::<4>(v),
        }
    }

    /// The 8 quad lines of one code block of [`Packed`] at `bl`: line `j` lane `r` = codes `4j..4j+4` of
    /// row `r`, one byte each.
    #[inline(always)]
    unsafe fn unpack<const B: u8>(bl: *const __m512i) -> [__m512i; 8] {
        let mut q = [_mm512_setzero_si512(); 8];
        if B == 8 {
            for j in 0..8 {
                q[j] = _mm512_load_si512(bl.add(j));
            }
        } else {
            let nib = _mm512_set1_epi8(0x0F);
            for j in 0..4 {
                let v = _mm512_load_si512(bl.add(j));
                q[2 * j] = _mm512_and_si512(v, nib);
                q[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
            }
            if B == 5 {
                let h = _mm512_load_si512(bl.add(4));
                let bit = _mm512_set1_epi8(0x10);
                for i in 0..8 {
                    q[i] = _mm512_ternarylogic_epi32::<0xF8>(q[i], shl16(h, 4 - i as i32), bit);
                }
            } else if B == 6 {
                let bits = _mm512_set1_epi8(0x30);
                for i in 0..8 {
                    let h = _mm512_load_si512(bl.add(4 + i / 4));
                    let s = 4 - 2 * (i % 4) as i32;
                    q[i] = _mm512_ternarylogic_epi32::<0xF8>(q[i], shl16(h, s), bits);
                }
            }
        }
        q
    }

    /// Unpack code blocks `k0..k1` at `lines` (one [`Packed`] row block) to `dst` (8 lines each,
    /// [`unpack`]): the AMX `B` tiles.
    #[inline(always)]
    unsafe fn unpack_to<const B: u8>(lines: *const __m512i, k0: usize, k1: usize, dst: *mut __m512i) {
        let lpb = Packed::lines_per_block(B);
        for k in k0..k1 {
            let bl = lines.add(k * lpb);
            for l in 0..lpb {
                _mm_prefetch::<_MM_HINT_T1>(bl.wrapping_add(l + PF_LINES) as *const i8);
            }
            let q = unpack::<B>(bl);
            for j in 0..8 {
                _mm512_store_si512(dst.add(8 * (k - k0) + j), q[j]);
            }
        }
    }

    /// The AMX dots of `units` consecutive weight groups (`units` ≤ [`AMX_CHUNK`]; groups of 32 = code
    /// blocks, or halves of them for `G16`) from the `B` lines at `w` (512 bytes per code block) and the
    /// activation records at `x` (one per code block, [`super::super::packed::fill_xtiles`]): group `u`'s `C` (`T` × 16
    /// i32, token × row) to `c + 64·T·u`. Four groups per step on four `C` tiles (tmm0/1/6/7; `A`/`B`
    /// alternate tmm2/4 and tmm3/5) so that one group's `tdpbsud` overlaps the others' stores.
    #[inline(always)]
    unsafe fn amx_chunk<const G16: bool, const T: usize>(w: *const u8, x: *const u8, c: *mut u8, units: usize) {
        let r1 = xtile_bytes(if G16 { 2 } else { 1 });
        // Offsets of group `u` of a step: `B` 256 (G16) or 512 bytes apart, `A` per code block `T·r1`.
        let (wu, xu) = if G16 { (256, [0, 16, T * r1, T * r1 + 16]) } else { (512, [0, T * r1, 2 * T * r1, 3 * T * r1]) };
        let xstep = if G16 { 2 * T * r1 } else { 4 * T * r1 };
        let mut u = 0;
        while u + 4 <= units {
            let (wp, xp, cp) = (w.add(wu * u), x.add(xstep * (u / 4)), c.add(64 * T * u));
            asm!(
                "tileloadd tmm4, [{w} + {s64}*1]",
                "tileloadd tmm2, [{x} + {s32}*1]",
                "tilezero tmm0",
                "tdpbsud tmm0, tmm2, tmm4",
                "tileloadd tmm5, [{w} + {s64}*1 + {w1}]",
                "tileloadd tmm3, [{x} + {s32}*1 + {x1}]",
                "tilezero tmm1",
                "tdpbsud tmm1, tmm3, tmm5",
                "tilestored [{c} + {s64}*1], tmm0",
                "tileloadd tmm4, [{w} + {s64}*1 + {w2}]",
                "tileloadd tmm2, [{x} + {s32}*1 + {x2}]",
                "tilezero tmm6",
                "tdpbsud tmm6, tmm2, tmm4",
                "tilestored [{c} + {s64}*1 + {c1}], tmm1",
                "tileloadd tmm5, [{w} + {s64}*1 + {w3}]",
                "tileloadd tmm3, [{x} + {s32}*1 + {x3}]",
                "tilezero tmm7",
                "tdpbsud tmm7, tmm3, tmm5",
                "tilestored [{c} + {s64}*1 + {c2}], tmm6",
                "tilestored [{c} + {s64}*1 + {c3}], tmm7",
                w = in(reg) wp, x = in(reg) xp, c = in(reg) cp, s64 = in(reg) 64usize, s32 = in(reg) 32usize,
                w1 = const if G16 { 256 } else { 512 }, w2 = const if G16 { 512 } else { 1024 }, w3 = const if G16 { 768 } else { 1536 },
                x1 = const if G16 { 16 } else { T * xtile_bytes(1) },
                x2 = const if G16 { T * xtile_bytes(2) } else { 2 * T * xtile_bytes(1) },
                x3 = const if G16 { T * xtile_bytes(2) + 16 } else { 3 * T * xtile_bytes(1) },
                c1 = const 64 * T, c2 = const 128 * T, c3 = const 192 * T,
                options(nostack, preserves_flags),
            );
            u += 4;
        }
        while u < units {
            let (wp, xp, cp) = (w.add(wu * u), x.add(xstep * (u / 4) + xu[u % 4]), c.add(64 * T * u));
            asm!(
                "tileloadd tmm4, [{w} + {s64}*1]",
                "tileloadd tmm2, [{x} + {s32}*1]",
                "tilezero tmm0",
                "tdpbsud tmm0, tmm2, tmm4",
                "tilestored [{c} + {s64}*1], tmm0",
                w = in(reg) wp, x = in(reg) xp, c = in(reg) cp, s64 = in(reg) 64usize, s32 = in(reg) 32usize,
                options(nostack, preserves_flags),
            );
            u += 1;
        }
    }

    /// Packed tile: rows `r0..r0+nr` (one 16-row block of [`Packed`]) × tokens `t0..t0+T`. With `AMX`
    /// the group dots `D_g` come from `tdpbsud` (tiles configured by [`packed_rows_amx`] for `T` tokens):
    /// the unpacked quad lines are the VNNI `B` tile (lane = row), the record's codes the `A` tile (row =
    /// token), so row `t` of `C` is token `t`'s i32 vector over the 16 rows; the epilogue is the same.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn packed_tile<const B: u8, const G16: bool, const T: usize, const AMX: bool>(
        ctx: &Ctx,
        m: &QMatrix,
        pk: &Packed,
        r0: usize,
        nr: usize,
        t0: usize,
        wb: *mut u8,
        fill: bool,
    ) {
        let cols = ctx.cols;
        let gs = if G16 { 16 } else { 32 };
        let gpb = QK / gs;
        let qpg = gs / 4;
        let nblk = cols / QK;
        let lpb = Packed::lines_per_block(B);
        let rb = r0 / PACK_ROWS;
        let imp = m.implicit_min();
        // This tile's activation records ([`super::super::packed::fill_xtiles`]): one per code block, fields at
        // constant offsets.
        let r1 = xtile_bytes(gpb);
        let xt = ctx.xt.get().add(t0 * nblk * r1) as *const u8;
        let lines = pk.lines.as_ptr().add(rb * nblk * lpb) as *const __m512i;
        // Units of `gs` values per weight group (1, or 2/4 for groups of 64/128: the scale index is the
        // unit's >> sh; the chains still run per unit of 32, as in the module docs' order with `g` = unit).
        let sh = (m.group / gs).trailing_zeros();
        // Scale streams of this row block: per group 16 lanes; `d`/`dmin` per super-block.
        let ScaleStreams { f16s, f16m, sc, mn, d: dd, dmin: dm } = ScaleStreams::new(m, pk, rb);
        let sup = f16s.is_null();
        let i8v = |p: *const i8| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)));
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 16]; T];
        // AMX: the `C` tiles of a chunk of [`AMX_CHUNK`] groups (`T` lines each), all stored by one
        // [`amx_chunk`] before the epilogue reads them.
        let mut cbuf = [Line([0; 64]); AMX_CHUNK * 16];
        let bpc = AMX_CHUNK / gpb;
        for b in 0..nblk {
            let bl = lines.add(b * lpb);
            let mut q = [zero; 8];
            if !AMX {
                for l in 0..lpb {
                    _mm_prefetch::<_MM_HINT_T1>(bl.wrapping_add(l + PF_LINES) as *const i8);
                }
                q = unpack::<B>(bl);
            }
            let rec = xt.add(b * T * r1);
            if AMX && b % bpc == 0 {
                // `B` tiles: bits 8 the packed lines themselves; else unpacked one chunk ahead into a ring
                // of two chunks (stored well before a tile load reads them).
                let wp = if B == 8 {
                    bl as *const u8
                } else {
                    let wbv = wb as *mut __m512i;
                    if fill {
                        if b == 0 {
                            unpack_to::<B>(lines, 0, bpc.min(nblk), wbv);
                        }
                        if b + bpc < nblk {
                            unpack_to::<B>(lines, b + bpc, (b + 2 * bpc).min(nblk), wbv.add(8 * (b + bpc)));
                        }
                    }
                    wbv.add(8 * b) as *const u8
                };
                amx_chunk::<G16, T>(wp, xt.add(b * T * r1), cbuf.as_mut_ptr() as *mut u8, (nblk - b).min(bpc) * gpb);
            }
            for hg in 0..gpb {
                let w = b * gpb + hg;
                let c = w & 15;
                let gl = (w >> sh) * PACK_ROWS;
                if sup {
                    _mm_prefetch::<_MM_HINT_T1>(sc.wrapping_add(gl + 1024));
                } else {
                    _mm_prefetch::<_MM_HINT_T1>(f16s.wrapping_add(2 * gl + 1024) as *const i8);
                }
                let (s, mv) = if sup {
                    let sl = (w * gs / QK_SUPER) * PACK_ROWS;
                    let s = _mm512_mul_ps(_mm512_loadu_ps(dd.add(sl)), i8v(sc.add(gl)));
                    let mv = if imp { _mm512_setzero_ps() } else { _mm512_mul_ps(_mm512_loadu_ps(dm.add(sl)), i8v(mn.add(gl))) };
                    (s, mv)
                } else {
                    let h16 = |p: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * gl) as *const __m256i));
                    (h16(f16s), if imp { _mm512_setzero_ps() } else { h16(f16m) })
                };
                for t in 0..T {
                    let term = rec.add(36 * T + 4 * (hg * T + t));
                    let mut d = if imp { _mm512_set1_epi32((term as *const i32).read_unaligned()) } else { zero };
                    if AMX {
                        // Integer sum: exact, the same `D_g` (or `D'_g`) as the `vpdpbusd` chain below.
                        let ci = ((b % bpc) * gpb + hg) * T + t;
                        d = _mm512_add_epi32(d, _mm512_load_si512(cbuf.as_ptr().add(ci) as *const __m512i));
                    } else {
                        for j in 0..qpg {
                            let xb = _mm512_set1_epi32((rec.add(32 * t + 4 * (hg * qpg + j)) as *const i32).read_unaligned());
                            d = _mm512_dpbusd_epi32(d, q[hg * qpg + j], xb);
                        }
                    }
                    let xs = (rec.add(32 * T + 4 * t) as *const f32).read_unaligned();
                    let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(xs)), acc[t][c]);
                    acc[t][c] = if imp { a } else { _mm512_fmadd_ps(mv, _mm512_set1_ps((term as *const f32).read_unaligned()), a) };
                }
            }
        }
        for t in 0..T {
            store_chains(ctx, &acc[t], r0, nr, t0 + t);
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
    unsafe fn float<const R: usize, const T: usize, const BF16: bool>(data: *const u8, ctx: &Ctx, r0: usize, t0: usize) {
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
