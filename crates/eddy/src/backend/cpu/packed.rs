//! What both packed kernels (AVX-512 and AVX2, on [`crate::quant::Packed`] weights) share: the activations
//! of a product in their token-tile layout ([`fill_xtiles`]: laid out once per product by the calling
//! thread, read by every worker, so that each field a tile needs sits at a constant offset from one pointer
//! per code block), and the scale streams of one 16-row block ([`ScaleStreams`]).

use super::QuantizedActivations;
use crate::quant::{super_blocks, GroupScales, Packed, QMatrix, PACK_ROWS};

/// Pointers to the lane-order scales of one 16-row block of a [`Packed`] matrix: per weight group 16 lanes
/// (`f16s`/`f16m` for [`GroupScales::F16`], `sc`/`mn` for [`GroupScales::SuperI8`]), and for the latter
/// `d`/`dmin` per super-block of 256 values, 16 lanes each. The pointers of the other kind, and the offsets'
/// when the offset is implicit, are null.
pub(crate) struct ScaleStreams {
    /// f16 scales (as bytes), or null.
    pub(crate) f16s: *const u8,
    /// f16 offsets (as bytes), or null.
    pub(crate) f16m: *const u8,
    /// i8 scale multipliers, or null.
    pub(crate) sc: *const i8,
    /// i8 offset multipliers, or null.
    pub(crate) mn: *const i8,
    /// f32 super-block scales, or null.
    pub(crate) d: *const f32,
    /// f32 super-block offset scales, or null.
    pub(crate) dmin: *const f32,
}

impl ScaleStreams {
    /// The streams of row block `rb` (rows `16·rb..`) of `m`'s packed copy `pk`.
    pub(crate) fn new(m: &QMatrix, pk: &Packed, rb: usize) -> ScaleStreams {
        let g0 = rb * (m.cols / m.group) * PACK_ROWS;
        let s0 = rb * super_blocks(m.cols) * PACK_ROWS;
        let imp = m.implicit_min();
        // `wrapping_add`: plain offsets into the scale vectors (in bounds for a row block of `m`).
        match &pk.scales {
            GroupScales::F16 { scale, min } => ScaleStreams {
                f16s: scale.as_ptr().wrapping_add(g0) as *const u8,
                f16m: min.as_ref().map_or(std::ptr::null(), |v| v.as_ptr().wrapping_add(g0) as *const u8),
                sc: std::ptr::null(),
                mn: std::ptr::null(),
                d: std::ptr::null(),
                dmin: std::ptr::null(),
            },
            GroupScales::SuperI8 { sc, mn, d, dmin } => ScaleStreams {
                f16s: std::ptr::null(),
                f16m: std::ptr::null(),
                sc: sc.as_ptr().wrapping_add(g0),
                mn: mn.as_ref().map_or(std::ptr::null(), |v| v.as_ptr().wrapping_add(g0)),
                d: d.as_ptr().wrapping_add(s0),
                dmin: if imp { std::ptr::null() } else { dmin.as_ptr().wrapping_add(s0) },
            },
        }
    }
}

/// One 64-byte line of the token-tile activation layout ([`fill_xtiles`]).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct XLine(#[allow(dead_code)] [u8; 64]);

/// Bytes per token and code block of 32 values in [`fill_xtiles`]'s layout: 32 codes, the f32 scale, and
/// per weight group in the block (1, or 2 for groups of 16) one 4-byte term.
pub(crate) const fn xtile_bytes(gpb: usize) -> usize {
    36 + 4 * gpb
}

/// Lay out the activations of tokens `0..n` for the packed kernel on `m` (into `buf`, grown if
/// needed): tokens in tiles of `P` = `tile` (the packed kernel's tiles, [`super::avx512::packed_tokens`] or [`super::avx2::packed_tokens`]: `t0 = 0, P, 2P, ..`;
/// the last one `T = n − t0 ≤ P`), and per tile and code block `b` a record of `T·xtile_bytes(gpb)` bytes at
/// byte `(t0·nblk + b·T)·xtile_bytes(gpb)`: the `T` tokens' 32 codes (`32·t`), their scales `d`
/// (f32 at `32·T + 4·t`), then per weight group `h` of the block (`gpb` = 32 / group, units of 32
/// for groups of 64/128) at `36·T + 4·(h·T + t)` the offset term: with the implicit offset the i32
/// `−2^(bits−1)·Σq_x` over the group's values (the start of `D'`), else the f32 `dsum`. Every field of
/// a tile is then at a constant offset from the record, so the kernel needs one pointer per tile.
pub(crate) fn fill_xtiles(m: &crate::quant::QMatrix, xq: &QuantizedActivations, n: usize, tile: usize, buf: &mut Vec<XLine>) {
    use crate::quant::QK;
    let cols = xq.cols;
    let nblk = cols / QK;
    let g16 = m.group == 16;
    let gpb = if g16 { 2 } else { 1 };
    let r1 = xtile_bytes(gpb);
    let bytes = n * nblk * r1;
    let lines = bytes.div_ceil(64);
    if buf.len() < lines {
        buf.resize(lines, XLine([0; 64]));
    }
    // SAFETY: `buf` holds `bytes`; every write below is inside it (offsets as documented above).
    let out = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, bytes) };
    let imp = m.implicit_min();
    let half = m.bits as u32 - 1;
    let codes: &[u8] = unsafe { std::slice::from_raw_parts(xq.q.as_ptr() as *const u8, xq.q.len()) };
    for t in 0..n {
        let t0 = t / tile * tile;
        let tn = (n - t0).min(tile);
        let ti = t - t0;
        let xc = &codes[t * cols..(t + 1) * cols];
        for b in 0..nblk {
            let rec = &mut out[(t0 * nblk + b * tn) * r1..][..tn * r1];
            rec[32 * ti..32 * ti + 32].copy_from_slice(&xc[b * QK..b * QK + QK]);
            let xi = t * nblk + b;
            rec[32 * tn + 4 * ti..][..4].copy_from_slice(&xq.scale[xi].to_le_bytes());
            for h in 0..gpb {
                let v = if !imp {
                    xq.dsum[xi].to_le_bytes()
                } else if g16 {
                    (-(xq.sum16[2 * xi + h] << half)).to_le_bytes()
                } else {
                    (-(xq.sum[xi] << half)).to_le_bytes()
                };
                rec[36 * tn + 4 * (h * tn + ti)..][..4].copy_from_slice(&v);
            }
        }
    }
}
