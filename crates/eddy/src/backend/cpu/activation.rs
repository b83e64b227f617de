//! Gated feed-forward activations: SwiGLU (`silu(g)·u`, Shazeer 2020) and GeGLU with the tanh
//! approximation of GELU (`gelu_pytorch_tanh`, used by Gemma).

/// Activation applied to the gate projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x·σ(x)`.
    Silu,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
}

/// `gate[i] = act(gate[i]) · up[i]` in place.
pub fn gated_act(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
        Activation::GeluTanh => {
            const C: f32 = 0.797_884_6; // sqrt(2/pi)
            for (g, &u) in gate.iter_mut().zip(up) {
                let x = *g;
                *g = 0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh()) * u;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn values() {
        let mut g = [1.0f32, -2.0];
        gated_act(Activation::Silu, &mut g, &[2.0, 1.0]);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
        assert!((g[1] - -2.0 * 0.119_202_92).abs() < 1e-6);
        let mut g = [1.0f32];
        gated_act(Activation::GeluTanh, &mut g, &[1.0]);
        assert!((g[0] - 0.841_192).abs() < 1e-5);
    }
}
