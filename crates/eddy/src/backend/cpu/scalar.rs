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
        WeightMatrix::Int4(m) => {
            let gpr = cols / QK;
            let xq = ctx.xq;
            let packed = &m.packed[r * cols / 2..(r + 1) * cols / 2];
            let xs = &xq.q[t * cols..(t + 1) * cols];
            let mut acc = 0f32;
            for g in 0..gpr {
                let b = &packed[g * QK / 2..(g + 1) * QK / 2];
                let xg = &xs[g * QK..(g + 1) * QK];
                let mut dot = 0i32;
                for j in 0..QK / 2 {
                    dot += (b[j] & 15) as i32 * xg[j] as i32 + (b[j] >> 4) as i32 * xg[j + 16] as i32;
                }
                let d = xq.scale[t * gpr + g];
                let gi = r * gpr + g;
                acc += (m.scale[gi] * d) * dot as f32;
                acc += (m.min[gi] * d) * xq.sum[t * gpr + g] as f32;
            }
            acc
        }
        WeightMatrix::Int8(m) => {
            let gs = m.group;
            let gpr = cols / gs;
            let xq = ctx.xq;
            let wq = &m.q[r * cols..(r + 1) * cols];
            let xs = &xq.q[t * cols..(t + 1) * cols];
            let mut acc = 0f32;
            for g in 0..gpr {
                let mut dot = 0i32;
                for j in g * gs..(g + 1) * gs {
                    dot += wq[j] as i32 * xs[j] as i32;
                }
                let d = xq.scale[t * (cols / QK) + g * gs / QK];
                acc += (m.scale[r * gpr + g] * d) * dot as f32;
            }
            acc
        }
    }
}
