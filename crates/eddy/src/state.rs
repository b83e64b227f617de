//! Sequence state, owned by the engine: the KV cache and the committed tokens.
//!
//! The KV cache is allocated once for the context length (`n_layers × ctx × kv_dim` f32 for K and for V)
//! and never grows; a forward pass over a batch at positions `n_past..n_past+T` writes rows
//! `n_past..n_past+T` and reads rows `0..n_past+T`. Committing a batch just advances `n_past`.

use crate::error::{Error, Result};

/// Preallocated key/value cache of one sequence.
pub struct KvCache {
    /// Layers.
    pub n_layers: usize,
    /// Rows per layer (the context length in tokens).
    pub ctx: usize,
    /// Values per row: `n_kv_heads × head_dim`.
    pub kv_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// Allocate (zeroed) for `ctx` tokens.
    pub fn new(n_layers: usize, ctx: usize, kv_dim: usize) -> Self {
        let n = n_layers * ctx * kv_dim;
        KvCache { n_layers, ctx, kv_dim, k: vec![0.0; n], v: vec![0.0; n] }
    }

    /// K and V of layer `l`, each `ctx × kv_dim`.
    pub fn layer_mut(&mut self, l: usize) -> (&mut [f32], &mut [f32]) {
        let n = self.ctx * self.kv_dim;
        (&mut self.k[l * n..(l + 1) * n], &mut self.v[l * n..(l + 1) * n])
    }

    /// Copy row `src` to row `dst` (K and V) in every layer.
    pub fn copy_row(&mut self, src: usize, dst: usize) {
        let (n, kvd) = (self.ctx * self.kv_dim, self.kv_dim);
        for l in 0..self.n_layers {
            let (s, d) = (l * n + src * kvd, l * n + dst * kvd);
            self.k.copy_within(s..s + kvd, d);
            self.v.copy_within(s..s + kvd, d);
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }
}

/// Residual-stream rows captured after chosen decoder layers of the last forward pass, for drafters that
/// read the target's intermediate features (DFlash: the outputs of its `target_layer_ids`, Hugging Face's
/// `hidden_states[id + 1]`). Dense models only; empty `layers` captures nothing.
#[derive(Debug, Clone, Default)]
pub struct FeatureCapture {
    /// Decoder layers (0-based) whose outputs are captured, in feature order.
    pub layers: Vec<usize>,
    /// `rows × (layers.len() · d_model)` f32: one row per token of the last [`crate::models::forward::forward`]
    /// (batch order) or per computed node of the last `forward_tree` (node order), holding the outputs of
    /// `layers` concatenated in that order.
    pub rows: Vec<f32>,
}

impl FeatureCapture {
    /// Values per captured row (`layers.len() × d_model`).
    pub fn row_len(&self, d_model: usize) -> usize {
        self.layers.len() * d_model
    }

    /// Append `t` rows (a chunk of the forward pass is about to run); nothing when no layer is captured.
    pub(crate) fn grow(&mut self, t: usize, d_model: usize) {
        if !self.layers.is_empty() {
            let n = self.rows.len() + t * self.row_len(d_model);
            self.rows.resize(n, 0.0);
        }
    }

    /// Copy the residual rows `x` (`t × d_model`, the output of decoder layer `layer`) into the last `t`
    /// rows wherever `layer` is captured.
    pub(crate) fn record(&mut self, layer: usize, x: &[f32], d_model: usize) {
        let stride = self.row_len(d_model);
        let t = x.len() / d_model;
        for (j, _) in self.layers.iter().enumerate().filter(|(_, &l)| l == layer) {
            let base = self.rows.len() - t * stride + j * d_model;
            for (i, src) in x.chunks_exact(d_model).enumerate() {
                self.rows[base + i * stride..][..d_model].copy_from_slice(src);
            }
        }
    }
}

/// The committed state of one sequence.
pub struct SeqState {
    /// KV cache; rows `0..tokens.len()` are valid.
    pub kv: KvCache,
    /// Tokens whose K/V are in the cache, in order.
    pub tokens: Vec<u32>,
    /// Qwen3.5 hybrid models keep their own state here (created by their forward pass).
    pub qwen35: Option<Box<crate::models::qwen35::HybridSeq>>,
    /// Keep the final-normed hidden state of every prefilled row, for an MTP drafter
    /// ([`crate::models::forward::last_hidden`]; Qwen3.5 only).
    pub want_hidden: bool,
    /// Intermediate features captured by every forward pass (dense models), for a DFlash drafter.
    pub capture: FeatureCapture,
}

impl SeqState {
    /// New empty sequence with room for `ctx` tokens.
    pub fn new(n_layers: usize, ctx: usize, kv_dim: usize) -> Self {
        SeqState {
            kv: KvCache::new(n_layers, ctx, kv_dim),
            tokens: Vec::with_capacity(ctx),
            qwen35: None,
            want_hidden: false,
            capture: FeatureCapture::default(),
        }
    }

    /// Number of committed positions.
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// Forget everything (the cache memory is kept).
    pub fn clear(&mut self) {
        self.tokens.clear();
    }

    /// Keep only the first `n` committed tokens (the rows after them become scratch).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
    }

    /// Commit an accepted path of a verified token tree (see [`crate::tree`]): `path` lists node indices
    /// (each node's K/V in scratch row `n_past + node`), root first, each the parent of the next;
    /// `tokens[node]` is the node's token. The node at depth `d` moves to row `n_past + d`. Copies run in
    /// increasing depth and a node's index is at least its depth, so no source is overwritten before it
    /// is read.
    ///
    /// Panics if the path is not increasing or runs past the cache (engine bugs, not user input).
    pub fn commit_path(&mut self, tokens: &[u32], path: &[usize]) {
        let n_past = self.n_past();
        for (d, &node) in path.iter().enumerate() {
            assert!(node >= d && (d == 0 || node > path[d - 1]) && n_past + node < self.kv.ctx, "bad accepted path {path:?}");
            if node != d {
                self.kv.copy_row(n_past + node, n_past + d);
            }
            self.tokens.push(tokens[node]);
        }
    }

    /// Error unless `extra` more tokens fit.
    pub fn check_room(&self, extra: usize) -> Result<()> {
        if self.n_past() + extra > self.kv.ctx {
            return Err(Error::Input(format!(
                "sequence of {} tokens exceeds the context length of {} tokens",
                self.n_past() + extra,
                self.kv.ctx
            )));
        }
        Ok(())
    }
}
