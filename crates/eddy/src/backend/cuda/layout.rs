//! The GPU layout of a [`QMatrix`], built on the host at upload ([`GpuQ::from_qmatrix`]) and decodable back
//! ([`GpuQ::code`], [`GpuQ::scale_min`]) so the conversion is tested without a GPU.
//!
//! Per block of 32 values of a row (block `r·cols/32 + b`, row-major like the natural layout):
//! * codes, bits 4: 16 bytes, byte `j` = code `j` (low nibble) | code `j + 16` (high nibble) — the natural
//!   layout's `lo`, so a 32-bit word holds four codes of each half and one mask/shift gives the `dp4a`
//!   operands; bits 5, 6, 8: 32 bytes, one unsigned code each (the bit planes merged).
//! * scales: one f32 `S` per block, or per 16 values for group-16 matrices (`g16`); a group of 64 or 128
//!   repeats its scale in each of its blocks. [`GroupScales::SuperI8`] scales are formed exactly as
//!   [`QMatrix::scale_min`] forms them (`d·sc`, one f32 product).
//! * offsets: one f32 `M` per block for explicit offsets, none for the implicit `M = −2^(bits−1)·S`.

use crate::quant::{QMatrix, QK};

/// A [`QMatrix`] in the GPU layout (host memory, before upload).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuQ {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Code width (4, 5, 6, 8).
    pub bits: u8,
    /// Whether codes are nibble-packed (bits 4).
    pub packed4: bool,
    /// Whether there is one scale per 16 values (group 16) rather than per 32.
    pub g16: bool,
    /// Codes, 16 (packed4) or 32 bytes per block.
    pub codes: Vec<u8>,
    /// Scales `S`, per 16 (g16) or per 32 values.
    pub scales: Vec<f32>,
    /// Explicit offsets `M` per block, or `None` for the implicit offset.
    pub mins: Option<Vec<f32>>,
}

impl GpuQ {
    /// Convert `m` (natural or prepacked codes) to the GPU layout.
    pub fn from_qmatrix(m: &QMatrix) -> GpuQ {
        m.check();
        let (rows, cols) = (m.rows, m.cols);
        let nblk = rows * cols / QK;
        let packed4 = m.bits == 4;
        let g16 = m.group == 16;
        let mut codes = Vec::with_capacity(nblk * if packed4 { 16 } else { 32 });
        for blk in 0..nblk {
            let q = m.decode_block(blk);
            if packed4 {
                codes.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
            } else {
                codes.extend_from_slice(&q);
            }
        }
        let per = if g16 { 16 } else { QK };
        let mut scales = Vec::with_capacity(rows * cols / per);
        let mut mins = (!m.implicit_min()).then(|| Vec::with_capacity(nblk));
        for r in 0..rows {
            for c0 in (0..cols).step_by(per) {
                let (s, mn) = m.scale_min(r, c0 / m.group);
                scales.push(s);
                if let (Some(v), Some(mn)) = (mins.as_mut(), mn) {
                    v.push(mn);
                }
            }
        }
        GpuQ { rows, cols, bits: m.bits, packed4, g16, codes, scales, mins }
    }

    /// Code of element `c` of row `r`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        let blk = (r * self.cols + c) / QK;
        let j = c % QK;
        if self.packed4 {
            let byte = self.codes[blk * 16 + j % 16];
            if j < 16 {
                byte & 15
            } else {
                byte >> 4
            }
        } else {
            self.codes[blk * 32 + j]
        }
    }

    /// `(S, M)` of element `c` of row `r` (`M` `None` for the implicit offset).
    pub fn scale_min(&self, r: usize, c: usize) -> (f32, Option<f32>) {
        let blk = (r * self.cols + c) / QK;
        let s = if self.g16 { self.scales[2 * blk + (c % QK) / 16] } else { self.scales[blk] };
        (s, self.mins.as_ref().map(|m| m[blk]))
    }

    /// `2^(bits−1)`, the implicit offset's code.
    pub fn half(&self) -> i32 {
        1 << (self.bits - 1)
    }
}

/// What the product kernels need to know of a matrix's GPU layout to run it beside others in one launch
/// ([`one_launch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Form {
    /// Input features.
    pub cols: usize,
    /// Nibble-packed codes ([`GpuQ::packed4`]).
    pub packed4: bool,
    /// One scale per 16 values ([`GpuQ::g16`]).
    pub g16: bool,
    /// `2^(bits−1)`, the implicit offset's code ([`GpuQ::half`]): at most 128.
    pub half: i32,
    /// Explicit offsets ([`GpuQ::mins`]).
    pub explicit: bool,
    /// The input rotation's [`crate::quant::Signs`] id, 0 for none (the parts read one quantized input).
    pub rotation: u64,
}

/// Whether 2 or 3 matrices of forms `parts`, read from one input, can be one product launch of `n` tokens
/// (`Backend::matmul_parts`): the kernels take each part's `half` (packed a byte a part), group-16 flag and
/// offsets per part, so only what is a template parameter of the kernel that runs `n` tokens must agree —
/// nothing for one token (`mm_q3x_t1*` picks each part's code packing by a branch uniform over the block) or,
/// on the `dp4a` kernels, for up to `mixed_tokens` tokens (2: `mm_q3x_t2`, `EDDY_CUDA_MIXED_T2`; 4: `mm_q3x_t4`, `EDDY_CUDA_MIXED_T4`; else 1); the
/// code packing on the `dp4a` kernels (`dp4a`: the launch runs on them) beyond that; the packing and the
/// epilogue form (group-16 scales, explicit offsets) on the tensor cores. Width and input rotation always. With `mixed` off,
/// parts must agree in everything (the launches before session 38; `EDDY_CUDA_JOINT=1` turns `mixed` on). Each
/// part's outputs are computed exactly as its own launch computes them, so the grouping does not change a bit.
pub fn one_launch(parts: &[Form], n: usize, dp4a: bool, mixed: bool, mixed_tokens: usize) -> bool {
    let Some(a) = parts.first() else { return false };
    if !(2..=3).contains(&parts.len()) || n == 0 {
        return false;
    }
    parts.iter().all(|b| {
        b.cols == a.cols
            && b.rotation == a.rotation
            && (0..=128).contains(&b.half)
            && if !mixed {
                b == a
            } else if n == 1 || (dp4a && n <= mixed_tokens) {
                true
            } else if dp4a {
                b.packed4 == a.packed4
            } else {
                b.packed4 == a.packed4 && b.g16 == a.g16 && b.explicit == a.explicit
            }
    })
}
