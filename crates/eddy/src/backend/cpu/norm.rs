//! RMSNorm (Zhang & Sennrich 2019): `y = x / sqrt(mean(x²) + eps) · w`.
//!
//! Gemma-style "1 + w" norms are handled at load time by adding 1 to the stored weight, so one kernel
//! serves every architecture. The reduction order is fixed (sequential over the row, f32), so a row's
//! result never depends on the batch it is in.

/// Normalize each row of `x` (`n` rows of `w.len()` values) in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let scale = inv_rms(row, eps);
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// `out[r] = rms_norm(x[r]) · w` for each row; `x` and `out` are `n × w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let scale = inv_rms(row, eps);
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// `1 / sqrt(mean(x²) + eps)`, accumulated in 8 fixed lanes (vectorizes, order independent of batch).
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for &v in rem {
        s += v * v;
    }
    1.0 / (s / row.len() as f32 + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn matches_f64_reference() {
        let d = 37;
        let x: Vec<f32> = (0..2 * d).map(|i| ((i * 7919) % 101) as f32 / 13.0 - 3.0).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
        let mut out = vec![0.0; 2 * d];
        rms_norm(&x, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * d..(r + 1) * d];
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            for i in 0..d {
                let want = row[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64;
                assert!((out[r * d + i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
            }
        }
        let mut y = x.clone();
        rms_norm_inplace(&mut y, &w, 1e-6);
        assert_eq!(y, out);
    }
}
