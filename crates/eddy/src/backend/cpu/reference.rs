//! Plain-loop oracle for the matrix product (f64 accumulation).

use super::QuantizedActivations;
use crate::quant::{WeightMatrix, QK};

/// Reference for [`super::matmul`]: `out[t*rows + r] = Σ_c W[r][c]·x[t][c]` for `t in 0..n`, with plain
/// loops and f64 accumulation (a test oracle, not fast).
///
/// * `F32`/`Bf16` weights: uses `x` (`n × cols` f32), ignores `xq`.
/// * `Q` weights (`w = S·q + M` per weight group): `Σ_g d_g·(S_g·Σ_j q_w·q_x + M_g·Σ_j q_x)` with the
///   activation codes and scales of `xq` (`d_g` of the 32-group containing the weight group; a weight
///   group of 64 or 128 is summed per 32-group of activations; the implicit offset is `M = −2^(bits−1)·S`).
///
/// A rotated f32 matrix rotates each input row first (`H·(D_in ⊙ x)`). A rotated matrix's output side is
/// applied per token ([`crate::quant::rotation::Rotation::rotate_output`]);
/// `xq` must already hold the rotated activations. Integer dots are exact; only the f64 sum of group
/// terms rounds.
pub fn matmul_reference(w: &WeightMatrix, x: &[f32], xq: &QuantizedActivations, n: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(out.len(), n * rows);
    for t in 0..n {
        for r in 0..rows {
            let v: f64 = match w {
                WeightMatrix::F32 { data, rotation, .. } => {
                    let mut xr = x[t * cols..(t + 1) * cols].to_vec();
                    rotation.rotate_input(&mut xr);
                    (0..cols).map(|c| data[r * cols + c] as f64 * xr[c] as f64).sum()
                }
                WeightMatrix::Bf16 { data, .. } => {
                    (0..cols).map(|c| f32::from_bits((data[r * cols + c] as u32) << 16) as f64 * x[t * cols + c] as f64).sum()
                }
                WeightMatrix::Q(m) => {
                    let (gs, u) = (m.group, m.group.min(QK));
                    let mut acc = 0f64;
                    let mut q = [0u8; QK];
                    for k in 0..cols / u {
                        let c0 = k * u;
                        if c0 % QK == 0 {
                            q = m.decode_block((r * cols + c0) / QK);
                        }
                        let (mut dot, mut sx) = (0i64, 0i64);
                        for c in c0..c0 + u {
                            let xv = xq.q[t * cols + c] as i64;
                            dot += q[c % QK] as i64 * xv;
                            sx += xv;
                        }
                        let d = xq.scale[t * (cols / QK) + c0 / QK] as f64;
                        let (s, mn) = m.scale_min(r, c0 / gs);
                        let mn = mn.map_or(-((1i64 << (m.bits - 1)) as f64) * s as f64, |v| v as f64);
                        acc += s as f64 * d * dot as f64 + mn * d * sx as f64;
                    }
                    acc
                }
            };
            out[t * rows + r] = v as f32;
        }
        if let Some(rotation) = w.rotation() {
            rotation.rotate_output(&mut out[t * rows..(t + 1) * rows]);
        }
    }
}
