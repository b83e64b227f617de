//! Rotary position embedding (Su et al. 2021, RoFormer, eq. 34).
//!
//! Two pairings exist: `Normal` rotates adjacent pairs `(x[2i], x[2i+1])` (llama.cpp's GGUF llama
//! convention, whose converter permutes the q/k weights accordingly) and `Neox` rotates `(x[i], x[i+d/2])`
//! (Hugging Face `rotate_half`, used by Qwen and Gemma). Only the first `rot_dims` of each head rotate
//! (partial RoPE); frequency `θ_i = base^(−2i/rot_dims)`.

/// How rotation pairs are formed within a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs (2i, 2i+1).
    Normal,
    /// Halves (i, i + rot_dims/2).
    Neox,
}

/// Precomputed inverse frequencies for one RoPE configuration.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Pairing.
    pub mode: RopeMode,
    /// Number of rotated dimensions per head (even).
    pub rot_dims: usize,
    /// `1 / (scale · base^(2i/rot_dims))` for i in 0..rot_dims/2 (`scale` is linear position scaling).
    pub inv_freq: Vec<f32>,
}

impl Rope {
    /// Build for `rot_dims` rotated dims, base `theta`, linear scaling factor `scale` (1 = none).
    pub fn new(mode: RopeMode, rot_dims: usize, theta: f32, scale: f32) -> Self {
        let inv_freq =
            (0..rot_dims / 2).map(|i| (1.0 / (theta as f64).powf(2.0 * i as f64 / rot_dims as f64) / scale as f64) as f32).collect();
        Rope { mode, rot_dims, inv_freq }
    }

    /// Rotate every head of one token row `x` (`n_heads × head_dim`) for absolute position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        self.apply_all(&mut [x], head_dim, pos);
    }

    /// Rotate every head of several token rows at the same position (a token's q and k), computing the
    /// cos/sin table once.
    pub fn apply_all(&self, rows: &mut [&mut [f32]], head_dim: usize, pos: usize) {
        let half = self.rot_dims / 2;
        // cos/sin computed in f64 then rounded, as position·freq can exceed f32 precision at long context.
        let mut cs = [(0f32, 0f32); 256];
        for (i, f) in self.inv_freq.iter().enumerate() {
            let a = pos as f64 * *f as f64;
            cs[i] = (a.cos() as f32, a.sin() as f32);
        }
        for head in rows.iter_mut().flat_map(|x| x.chunks_exact_mut(head_dim)) {
            for (i, &(c, s)) in cs.iter().enumerate().take(half) {
                let (a, b) = match self.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let r = Rope::new(RopeMode::Neox, 8, 10000.0, 1.0);
        let x0: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut x = x0.clone();
        r.apply(&mut x, 8, 0);
        assert_eq!(x, x0);
        r.apply(&mut x, 8, 123);
        let n0: f32 = x0.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
        // Neox pairs (0,4): first pair rotates by pos·1 rad.
        let (c, s) = (123f64.cos() as f32, 123f64.sin() as f32);
        assert!((x[0] - (x0[0] * c - x0[4] * s)).abs() < 1e-5);
    }
    #[test]
    fn relative_property() {
        // <R(p)q, R(p+k)k> depends only on k.
        let r = Rope::new(RopeMode::Normal, 4, 100.0, 1.0);
        let q0 = [0.3f32, -1.0, 2.0, 0.5];
        let k0 = [1.0f32, 0.25, -0.5, 1.5];
        let dot = |p: usize| {
            let (mut q, mut k) = (q0, k0);
            r.apply(&mut q, 4, p);
            r.apply(&mut k, 4, p + 5);
            q.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>()
        };
        assert!((dot(0) - dot(40)).abs() < 1e-4);
    }
}
