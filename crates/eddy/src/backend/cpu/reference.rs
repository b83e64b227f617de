//! Plain-loop oracle for the matrix product (f64 accumulation).

use super::QuantizedActivations;
use crate::quant::{WeightMatrix, QK};

/// Reference for [`super::matmul`]: `out[t*rows + r] = Σ_c W[r][c]·x[t][c]` for `t in 0..n`, with plain
/// loops and f64 accumulation (a test oracle, not fast).
///
/// * `F32`/`Bf16` weights: uses `x` (`n × cols` f32), ignores `xq`.
/// * `Int4` weights: `Σ_g s_g·d_g·(Σ_j q_w·q_x) + m_g·d_g·sum_x_g` over groups of 32, from `xq`.
/// * `Int8` weights: `Σ_{weight groups} s_w·d_x·(Σ_j q_w·q_x)` (`d_x` of the 32-group containing the
///   weight group), from `xq`.
///
/// Integer dots are exact; only the f64 sum of group terms rounds.
pub fn matmul_reference(w: &WeightMatrix, x: &[f32], xq: &QuantizedActivations, n: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(out.len(), n * rows);
    for t in 0..n {
        for r in 0..rows {
            let v: f64 = match w {
                WeightMatrix::F32 { data, .. } => {
                    (0..cols).map(|c| data[r * cols + c] as f64 * x[t * cols + c] as f64).sum()
                }
                WeightMatrix::Bf16 { data, .. } => (0..cols)
                    .map(|c| f32::from_bits((data[r * cols + c] as u32) << 16) as f64 * x[t * cols + c] as f64)
                    .sum(),
                WeightMatrix::Int4(m) => {
                    let gpr = cols / QK;
                    let mut acc = 0f64;
                    for g in 0..gpr {
                        let bytes = &m.packed[(r * cols + g * QK) / 2..][..QK / 2];
                        let xs = &xq.q[t * cols + g * QK..][..QK];
                        let mut dot = 0i32;
                        for j in 0..QK / 2 {
                            dot += (bytes[j] & 15) as i32 * xs[j] as i32;
                            dot += (bytes[j] >> 4) as i32 * xs[j + 16] as i32;
                        }
                        let d = xq.scale[t * gpr + g] as f64;
                        let gi = r * gpr + g;
                        acc += m.scale[gi] as f64 * d * dot as f64
                            + m.min[gi] as f64 * d * xq.sum[t * gpr + g] as f64;
                    }
                    acc
                }
                WeightMatrix::Int8(m) => {
                    let gs = m.group;
                    let gpr = cols / gs;
                    let mut acc = 0f64;
                    for g in 0..gpr {
                        let c0 = g * gs;
                        let dot: i32 =
                            (0..gs).map(|j| m.q[r * cols + c0 + j] as i32 * xq.q[t * cols + c0 + j] as i32).sum();
                        let d = xq.scale[t * (cols / QK) + c0 / QK] as f64;
                        acc += m.scale[r * gpr + g] as f64 * d * dot as f64;
                    }
                    acc
                }
            };
            out[t * rows + r] = v as f32;
        }
    }
}
