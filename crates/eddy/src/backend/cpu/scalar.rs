//! Portable scalar tile kernel. Each (row, token) is an independent f32 dot product with a fixed
//! operation order, so batch invariance is immediate.

use super::Ctx;
use crate::quant::{WeightMatrix, QK};

/// Compute rows `r0..r0+nr` × tokens `t0..t0+nt` into `ctx.out`.
///
/// # Safety
/// Shapes must have been validated by `matmul_with`; the output range must not be written concurrently.
pub(crate) unsafe fn tile(ctx: &Ctx, r0: usize, nr: usize, t0: usize, nt: usize) {
    for t in t0..t0 + nt {
        for r in r0..r0 + nr {
            let v = dot(ctx, r, t);
            *ctx.out.0.add(t * ctx.rows + r) = v;
        }
    }
}

fn dot(ctx: &Ctx, r: usize, t: usize) -> f32 {
    let cols = ctx.cols;
    match ctx.w {
        WeightMatrix::F32 { data, .. } => {
            let w = &data[r * cols..(r + 1) * cols];
            let x = &ctx.x[t * cols..(t + 1) * cols];
            let mut acc = 0f32;
            for c in 0..cols {
                acc += w[c] * x[c];
            }
            acc
        }
        WeightMatrix::Bf16 { data, .. } => {
            let w = &data[r * cols..(r + 1) * cols];
            let x = &ctx.x[t * cols..(t + 1) * cols];
            let mut acc = 0f32;
            for c in 0..cols {
                acc += f32::from_bits((w[c] as u32) << 16) * x[c];
            }
            acc
        }
        WeightMatrix::Q(m) => {
            // Units of min(group, 32) values: one activation scale and one weight scale each.
            let gs = m.group;
            let u = gs.min(QK);
            let xgpr = cols / QK;
            let xq = ctx.xq;
            let xs = &xq.q[t * cols..(t + 1) * cols];
            let half = 1i32 << (m.bits - 1);
            let mut q = [0u8; QK];
            let mut acc = 0f32;
            for k in 0..cols / u {
                let c0 = k * u;
                if c0 % QK == 0 {
                    q = m.decode_block((r * cols + c0) / QK);
                }
                let mut dot = 0i32;
                for j in 0..u {
                    dot += q[c0 % QK + j] as i32 * xs[c0 + j] as i32;
                }
                let xi = t * xgpr + c0 / QK;
                let d = xq.scale[xi];
                match m.scale_min(r, c0 / gs) {
                    (s, None) => {
                        let sx = if u == 16 { xq.sum16[t * cols / 16 + k] } else { xq.sum[xi] };
                        acc += (s * d) * (dot - half * sx) as f32;
                    }
                    (s, Some(mn)) => {
                        acc += (s * d) * dot as f32;
                        acc += mn * xq.dsum[xi];
                    }
                }
            }
            acc
        }
    }
}
