//! Scalar references of the [`super::Backend`] operations: plain loops, f64 accumulation, written for
//! clarity rather than speed. They are the oracle of [`super::parity`]; no model runs on them.

use super::{Activation, AttnShape, Rope, RopeMode, Visibility};

pub use super::cpu::gdn::tree_reference as gdn_tree;
pub use super::cpu::matmul_reference;

/// Causal depthwise conv + SiLU of the Gated DeltaNet for one tree or chain: row `i` convolves (weights
/// `w[ch][m]`, channel-major `conv_dim × K`) its own pre-conv row, its parent's, grandparent's, … and, above
/// the root, the rows of `conv_state` (`(K−1) × conv_dim`, oldest first).
pub fn gdn_conv(w: &[f32], kernel: usize, conv_state: &[f32], x: &[f32], parents: &[usize]) -> Vec<f32> {
    let cd = w.len() / kernel;
    let mut out = vec![0f32; parents.len() * cd];
    for i in 0..parents.len() {
        // Rows feeding taps K−1, K−2, …: the node, then its ancestors, then the conv state newest first.
        let mut srcs: Vec<&[f32]> = Vec::new();
        let mut node = i;
        loop {
            srcs.push(&x[node * cd..(node + 1) * cd]);
            if srcs.len() == kernel || parents[node] == usize::MAX {
                break;
            }
            node = parents[node];
        }
        let mut row = kernel - 1;
        while srcs.len() < kernel {
            row -= 1;
            srcs.push(&conv_state[row * cd..(row + 1) * cd]);
        }
        for ch in 0..cd {
            let acc: f64 = (0..kernel).map(|m| w[ch * kernel + (kernel - 1 - m)] as f64 * srcs[m][ch] as f64).sum();
            out[i * cd + ch] = (acc / (1.0 + (-acc).exp())) as f32;
        }
    }
    out
}

/// `out[t] = x[t] / sqrt(mean(x[t]²) + eps) · w` for every row of `x` (width `w.len()`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| (v as f64 * inv * g as f64) as f32));
    }
    out
}

/// `act(gate) · up` elementwise: SiLU `g·σ(g)`, or GELU with the tanh approximation.
pub fn gated_act(act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = g as f64;
            let a = match act {
                Activation::Silu => g / (1.0 + (-g).exp()),
                Activation::GeluTanh => 0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh()),
            };
            (a * u as f64) as f32
        })
        .collect()
}

/// RoPE of one row `x` (heads of `head_dim`) at position `pos`: pairs `(2i, 2i+1)` ([`RopeMode::Normal`])
/// or `(i, i + rot/2)` ([`RopeMode::Neox`]) of the first `rot_dims` dims of each head rotated by
/// `pos · inv_freq[i]`.
pub fn rope(r: &Rope, x: &[f32], head_dim: usize, pos: usize) -> Vec<f32> {
    let half = r.rot_dims / 2;
    let mut out = x.to_vec();
    for head in out.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = match r.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + half),
            };
            let ang = pos as f64 * r.inv_freq[i] as f64;
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            head[a] = (x0 * ang.cos() - x1 * ang.sin()) as f32;
            head[b] = (x0 * ang.sin() + x1 * ang.cos()) as f32;
        }
    }
    out
}

/// Softmax attention of `t` queries against cache rows `k`, `v` (`n_kv_heads·head_dim` each), GQA
/// (query head `h` uses KV head `h / (n_heads / n_kv_heads)`), with the sliding window and logit
/// soft-capping of `s`. Query `i` sees positions `0..=n_past + i` (causal) or the committed rows
/// `0..n_past` plus its tree ancestors and itself (node `j` in row `n_past + j`), or every row `0..rows`
/// (a block).
#[allow(clippy::too_many_arguments)]
pub fn attention(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32], n_past: usize, t: usize, vis: Visibility) -> Vec<f32> {
    let (hd, qd, kvd) = (s.head_dim, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
    let mut out = vec![0f32; t * qd];
    for i in 0..t {
        // (position, cache row) of every key the query sees.
        let keys: Vec<(usize, usize)> = match vis {
            Visibility::Causal => (0..=n_past + i).map(|j| (j, j)).collect(),
            Visibility::Tree { first, paths } => {
                let path = paths.path(first + i);
                (0..n_past).map(|j| (j, j)).chain(path.iter().enumerate().map(|(d, &node)| (n_past + d, n_past + node as usize))).collect()
            }
            Visibility::Block { rows } => (0..rows).map(|j| (j, j)).collect(),
        };
        let pos = keys.last().map_or(0, |k| k.0);
        let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let keys: Vec<usize> = keys.into_iter().filter(|&(p, _)| p >= lo).map(|(_, r)| r).collect();
        for h in 0..s.n_heads {
            let kvh = h / (s.n_heads / s.n_kv_heads);
            let qh = &q[i * qd + h * hd..i * qd + (h + 1) * hd];
            let sc: Vec<f64> = keys
                .iter()
                .map(|&r| {
                    let dot = (0..hd).map(|d| qh[d] as f64 * k[r * kvd + kvh * hd + d] as f64).sum::<f64>() * s.scale as f64;
                    s.softcap.map_or(dot, |c| c as f64 * (dot / c as f64).tanh())
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let o: f64 = keys.iter().zip(&e).map(|(&r, &p)| p / z * v[r * kvd + kvh * hd + d] as f64).sum();
                out[i * qd + h * hd + d] = o as f32;
            }
        }
    }
    out
}
