//! Sequence state, owned by the engine: one entry per layer ([`LayerState`]: the KV rows of an attention
//! layer, or the conv window and recurrent state of a Gated DeltaNet layer), the committed tokens, and for
//! hybrid models the prefix-cache snapshots of the recurrent states. Everything lives in the backend's
//! memory and is allocated once for the context length.
//!
//! A forward pass over a chain at positions `n_past..n_past+T` writes KV rows `n_past..n_past+T` and
//! advances the recurrent states. A verify pass over a token tree ([`crate::tree`]) only reads the
//! committed state: node `i`'s K/V go to the scratch row `n_past + i`, and each GDN layer keeps what the
//! commit of a path needs ([`GdnTree`]); [`SeqState::commit_path`] then applies the accepted path once (KV
//! rows compacted, one rank-|path| update per GDN state, conv windows set from the path).
//!
//! Prefix cache: attention rows can be kept for any shared prefix. A GDN state cannot be rewound, so a
//! prefill that starts from an exact state (empty, or a snapshot) saves the GDN states at its last
//! [`GDN_CHUNK`] boundary before its last token, and at the last boundary within the prefix it shares with the
//! tokens it replaces ([`SeqState::plan_checkpoint`]: where two conversations part, such as after a shared
//! system prompt, so that the next conversation that shares it resumes there); [`MAX_SNAPSHOTS`] are kept.
//! [`SeqState::reusable_prefix`] offers those lengths, and [`SeqState::truncate`] to one of them restores the
//! snapshot (at the next pass). States reached by decoding are never reused: a cold prefill computes them
//! differently (up to rounding).

use crate::backend::{Backend, Cols, Cpu, GdnShape};
use crate::error::{Error, Result};

/// Tokens per chunk of the chunked GDN prefill (transformers uses 64 too); chunk boundaries sit at
/// absolute multiples of it, so a prefill computes the same values however the prompt was split.
pub const GDN_CHUNK: usize = 64;
/// GDN state snapshots kept per sequence for the prefix cache (each the conv windows and recurrent states
/// of every GDN layer: 19 MiB for the Qwen3.5 0.8B shape).
pub const MAX_SNAPSHOTS: usize = 4;

/// The kind of a layer's token mixer, as far as its state is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention: K and V rows.
    Attention,
    /// Gated DeltaNet: conv window and recurrent state.
    DeltaNet,
}

/// What a verify pass leaves in a GDN layer for [`SeqState::commit_path`]: per node the pre-conv row `x`
/// (`conv_dim`), the prepared post-conv row `c` (`conv_dim`), the path-cumulative log decays `gamma`
/// (`n_v_heads`) and the corrections `u` (`value_dim`). Grown to the largest tree seen, then reused.
pub struct GdnTree<B: Backend = Cpu> {
    /// Pre-conv rows.
    pub x: B::Buf,
    /// Prepared post-conv rows.
    pub c: B::Buf,
    /// Path-cumulative log decays.
    pub gamma: B::Buf,
    /// Per-node corrections ũ.
    pub u: B::Buf,
    /// Nodes the buffers hold.
    pub rows: usize,
}

/// The state of one layer.
pub enum LayerState<B: Backend = Cpu> {
    /// K and V of an attention layer, each `ctx × kv_dim` (rows `0..n_past` committed, later rows tree scratch).
    Kv {
        /// Keys.
        k: B::Buf,
        /// Values.
        v: B::Buf,
    },
    /// A Gated DeltaNet layer.
    Gdn {
        /// Conv window: the last `K−1` pre-conv inputs, `(K−1) × conv_dim`.
        conv: B::Buf,
        /// Recurrent state, `n_v_heads × d_k × d_v` (f32).
        rec: B::Buf,
        /// The pending verify pass's per-node values.
        tree: GdnTree<B>,
    },
}

/// The GDN states after the first `tokens.len()` tokens of a sequence, as an aligned chunked prefill from
/// the start computes them; per layer (conv window, recurrent state), `None` for attention layers.
struct Snapshot<B: Backend> {
    tokens: Vec<u32>,
    layers: Vec<Option<(B::Buf, B::Buf)>>,
    /// Taken where a prompt parted from the sequence it replaced ([`SeqState::plan_checkpoint`]): a shared
    /// start, evicted only after every other snapshot.
    checkpoint: bool,
}

/// A snapshot being filled by the current prefill at absolute position `at`.
pub(crate) struct Capture<B: Backend> {
    pub(crate) at: usize,
    pub(crate) layers: Vec<Option<(B::Buf, B::Buf)>>,
}

/// Residual-stream rows captured after chosen decoder layers of the last forward pass, for drafters that
/// read the target's intermediate features (DFlash: the outputs of its `target_layer_ids`, Hugging Face's
/// `hidden_states[id + 1]`). Dense models only; empty `layers` captures nothing. The rows stay in the
/// backend's memory ([`Backend::gather_rows`] writes and reads them): a GPU pass runs without a readback.
pub struct FeatureCapture<B: Backend = Cpu> {
    /// Decoder layers (0-based) whose outputs are captured, in feature order.
    pub layers: Vec<usize>,
    /// `cap × row_len` f32: rows `0..rows` hold one row per token of the last
    /// [`crate::models::forward::forward`] (batch order) or per computed node of the last `forward_tree`
    /// (node order), the outputs of `layers` concatenated in that order.
    buf: Option<B::Buf>,
    cap: usize,
    rows: usize,
}

impl<B: Backend> Default for FeatureCapture<B> {
    fn default() -> Self {
        FeatureCapture { layers: Vec::new(), buf: None, cap: 0, rows: 0 }
    }
}

impl<B: Backend> Clone for FeatureCapture<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        FeatureCapture { layers: self.layers.clone(), buf: self.buf.clone(), cap: self.cap, rows: self.rows }
    }
}

impl<B: Backend> FeatureCapture<B> {
    /// Values per captured row (`layers.len() × d_model`).
    pub fn row_len(&self, d_model: usize) -> usize {
        self.layers.len() * d_model
    }

    /// Rows captured by the last pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The captured rows ([`FeatureCapture::rows`] of [`FeatureCapture::row_len`] values, backend memory);
    /// `None` before the first capture.
    pub fn buf(&self) -> Option<&B::Buf> {
        self.buf.as_ref()
    }

    /// Capture the outputs of `layers` from now on (none for an empty list).
    pub fn set_layers(&mut self, layers: Vec<usize>) {
        *self = FeatureCapture { layers, ..FeatureCapture::default() };
    }

    /// Forget the rows of the last pass.
    pub(crate) fn clear(&mut self) {
        self.rows = 0;
    }

    /// Append `t` rows (a chunk of the forward pass is about to run; the buffer grows, keeping its rows,
    /// when they do not fit); nothing when no layer is captured.
    pub(crate) fn grow(&mut self, be: &B, t: usize, d_model: usize) {
        if self.layers.is_empty() {
            return;
        }
        let w = self.row_len(d_model);
        if self.rows + t > self.cap {
            let cap = (self.rows + t).max(2 * self.cap);
            let mut buf = be.alloc(cap * w);
            if let Some(old) = &self.buf {
                be.copy(old, &mut buf, self.rows * w);
            }
            (self.buf, self.cap) = (Some(buf), cap);
        }
        self.rows += t;
    }

    /// Whether the output of decoder layer `layer` is captured.
    pub(crate) fn captures(&self, layer: usize) -> bool {
        self.layers.contains(&layer)
    }

    /// Copy the residual rows `x` (rows `0..t`, `iota = [0, 1, …, t − 1]`, `d_model` each: the output of
    /// decoder layer `layer`) into the last `t` rows, in the columns of each place `layer` is captured.
    pub(crate) fn record(&mut self, be: &B, layer: usize, x: &B::Buf, iota: &[usize], d_model: usize) {
        let stride = self.row_len(d_model);
        let row0 = self.rows - iota.len();
        let buf = self.buf.as_mut().expect("grow comes before record");
        for (j, _) in self.layers.iter().enumerate().filter(|(_, &l)| l == layer) {
            let to = Cols { stride, col: j * d_model, width: d_model };
            be.gather_rows(x, Cols::whole(d_model), iota, buf, to, row0);
        }
    }
}

/// The committed state of one sequence.
pub struct SeqState<B: Backend = Cpu> {
    /// Rows of the KV cache (context length in tokens, tree scratch included).
    pub ctx: usize,
    /// Values per K/V row: `n_kv_heads × head_dim`.
    pub kv_dim: usize,
    /// Per layer state.
    pub layers: Vec<LayerState<B>>,
    /// Committed tokens, in order.
    pub tokens: Vec<u32>,
    /// Keep the final-normed hidden state of every prefilled row, not only of the logit rows (for an MTP
    /// drafter, see [`SeqState::hidden`]).
    pub want_hidden: bool,
    /// The final-normed hidden states (`d_model` each, host) of the last pass's logit rows (every row with
    /// `want_hidden`) when the model has an MTP head.
    pub hidden: Vec<f32>,
    gdn: Option<GdnShape>,
    /// Tokens the GDN states cover (less than `tokens.len()` after a [`SeqState::truncate`] whose restore
    /// or re-run is pending).
    pub(crate) gdn_len: usize,
    /// A truncation happened: restore the best snapshot before the next pass.
    restore_pending: bool,
    /// The GDN states equal those an aligned chunked prefill of `tokens` from the start computes.
    pub(crate) exact: bool,
    snapshots: Vec<Snapshot<B>>,
    /// The snapshots the current prefill fills (at most two: its last boundary and `checkpoint`).
    pub(crate) captures: Vec<Capture<B>>,
    /// A position the next prefills should also snapshot at (a [`GDN_CHUNK`] boundary where the prompt parted
    /// from the tokens it replaced), until one of them reaches it.
    pub(crate) checkpoint: Option<usize>,
    /// Parents of the pending verified tree (hybrid models; commit checks paths against it); empty when
    /// none is pending (a tree has at least its root).
    pub(crate) tree: Vec<usize>,
    /// Intermediate features captured by every forward pass, for a DFlash drafter.
    pub features: FeatureCapture<B>,
}

impl<B: Backend> SeqState<B> {
    /// An empty sequence of `n_layers` attention layers with room for `ctx` tokens.
    pub fn new(be: &B, n_layers: usize, ctx: usize, kv_dim: usize) -> Self {
        Self::with_layers(be, &vec![LayerKind::Attention; n_layers], ctx, kv_dim, None)
    }

    /// An empty sequence of layers `kinds` (GDN layers of shape `gdn`) with room for `ctx` tokens.
    ///
    /// Panics if a layer is [`LayerKind::DeltaNet`] and `gdn` is `None` (a model bug).
    pub fn with_layers(be: &B, kinds: &[LayerKind], ctx: usize, kv_dim: usize, gdn: Option<GdnShape>) -> Self {
        let layers = kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Kv { k: be.alloc(ctx * kv_dim), v: be.alloc(ctx * kv_dim) },
                LayerKind::DeltaNet => {
                    let s = gdn.expect("a GDN layer needs a GDN shape");
                    let tree = GdnTree { x: be.alloc(0), c: be.alloc(0), gamma: be.alloc(0), u: be.alloc(0), rows: 0 };
                    LayerState::Gdn { conv: be.alloc(s.conv_state_len()), rec: be.alloc(s.state_len()), tree }
                }
            })
            .collect();
        SeqState {
            ctx,
            kv_dim,
            layers,
            tokens: Vec::with_capacity(ctx),
            want_hidden: false,
            hidden: Vec::new(),
            gdn,
            gdn_len: 0,
            restore_pending: false,
            exact: true,
            snapshots: Vec::new(),
            captures: Vec::new(),
            checkpoint: None,
            tree: Vec::new(),
            features: FeatureCapture::default(),
        }
    }

    /// Whether some layer has a recurrent state.
    pub fn is_hybrid(&self) -> bool {
        self.gdn.is_some()
    }

    /// Number of committed positions.
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// Forget everything, prefix-cache snapshots included (the memory is kept).
    pub fn clear(&mut self) {
        self.truncate(0);
        self.snapshots.clear();
        self.checkpoint = None;
    }

    /// Give the last committed token, a run-ahead step's input recorded as
    /// [`crate::models::forward::AHEAD_TOKEN`], its id once it is back. Returns whether there was one.
    pub fn resolve_ahead(&mut self, id: u32) -> bool {
        match self.tokens.last_mut() {
            Some(t) if *t == crate::models::forward::AHEAD_TOKEN => {
                *t = id;
                true
            }
            _ => false,
        }
    }

    /// Keep only the first `n` committed tokens (the rows after them become scratch). A hybrid model's
    /// GDN states are restored from the longest snapshot of at most `n` tokens before the next pass, which
    /// re-runs the tokens after it (none when `n` came from [`SeqState::reusable_prefix`]).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(n);
        self.tree.clear();
        self.captures.clear();
        if self.is_hybrid() {
            self.restore_pending = true;
        }
    }

    /// Longest prefix of `prompt` (at most `prompt.len() − 1` tokens: one is always run, for its logits)
    /// that a prefill can continue from and compute exactly what a cold prefill computes: the shared prefix
    /// with the committed tokens; for a hybrid model, a snapshot's length or the committed length when the
    /// state is exact, 0 when none.
    pub fn reusable_prefix(&self, prompt: &[u32]) -> usize {
        let limit = prompt.len().saturating_sub(1);
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
        if !self.is_hybrid() {
            return common;
        }
        let live = if self.exact && !self.restore_pending && self.tokens.len() <= common { self.tokens.len() } else { 0 };
        self.snapshots
            .iter()
            .filter(|s| s.tokens.len() <= common && s.tokens[..] == prompt[..s.tokens.len()])
            .map(|s| s.tokens.len())
            .fold(live, usize::max)
    }

    /// Apply a pending truncation to the GDN states: keep the snapshots the committed tokens still back,
    /// restore the longest (or zero the states); afterwards the GDN states cover `gdn_len` tokens and the
    /// caller re-runs the rest.
    pub(crate) fn restore(&mut self, be: &B) {
        if !self.restore_pending {
            return;
        }
        self.restore_pending = false;
        let tokens = &self.tokens;
        self.snapshots.retain(|s| s.tokens.len() <= tokens.len() && s.tokens[..] == tokens[..s.tokens.len()]);
        let s = self.gdn.expect("restore is only pending for hybrid models");
        let best = self.snapshots.iter().enumerate().max_by_key(|(_, s)| s.tokens.len()).map(|(i, _)| i);
        let zeros = best.is_none().then(|| (be.alloc(s.conv_state_len()), be.alloc(s.state_len())));
        for (l, layer) in self.layers.iter_mut().enumerate() {
            if let LayerState::Gdn { conv, rec, .. } = layer {
                let (src_conv, src_rec) = match best {
                    Some(i) => self.snapshots[i].layers[l].as_ref().expect("snapshot of a GDN layer"),
                    None => zeros.as_ref().expect("zeros allocated when no snapshot"),
                };
                be.copy(src_conv, conv, s.conv_state_len());
                be.copy(src_rec, rec, s.state_len());
            }
        }
        self.gdn_len = best.map_or(0, |i| self.snapshots[i].tokens.len());
        self.exact = true;
    }

    /// Keep the captures of the last prefill pass as snapshots of the first `at` committed tokens. The oldest
    /// snapshot makes room, a checkpoint only when every snapshot is one: a long prefill saves one snapshot a
    /// piece, and those must not push out the shared start it was asked to keep.
    pub(crate) fn save_capture(&mut self) {
        for Capture { at, layers } in std::mem::take(&mut self.captures) {
            let checkpoint = self.checkpoint == Some(at);
            if checkpoint {
                self.checkpoint = None;
            }
            let tokens = self.tokens[..at].to_vec();
            self.snapshots.retain(|s| s.tokens != tokens);
            if self.snapshots.len() >= MAX_SNAPSHOTS {
                let oldest = self.snapshots.iter().position(|s| !s.checkpoint).unwrap_or(0);
                self.snapshots.remove(oldest);
            }
            self.snapshots.push(Snapshot { tokens, layers, checkpoint });
        }
    }

    /// Forget a checkpoint the last prefill did not reach (cancelled, or not exact there).
    pub(crate) fn drop_checkpoint(&mut self) {
        self.checkpoint = None;
    }

    /// Before a prefill of `prompt` that keeps the first `keep` committed tokens: for a hybrid model, ask the
    /// prefill to snapshot also at the last [`GDN_CHUNK`] boundary of the prefix `prompt` shares with the
    /// committed tokens, when that lies past `keep`, or mark the snapshot already there as that checkpoint.
    /// Two conversations that share a system prompt part there; without it the first one's snapshots lie past
    /// the shared part and the second overwrites them, so every conversation would prefill the shared part
    /// again. A no-op for attention-only models (their rows are kept for any shared prefix).
    pub fn plan_checkpoint(&mut self, prompt: &[u32], keep: usize) {
        self.checkpoint = None;
        if !self.is_hybrid() {
            return;
        }
        let limit = prompt.len().saturating_sub(1);
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
        let at = common / GDN_CHUNK * GDN_CHUNK;
        if at == 0 {
            return;
        }
        // A snapshot already there (the previous prefill's, one a piece) is kept as the checkpoint.
        if let Some(i) = self.snapshot_at(at, prompt) {
            self.snapshots[i].checkpoint = true;
        } else if at > keep {
            self.checkpoint = Some(at);
        }
    }

    /// Whether a snapshot of exactly the first `at` committed tokens (of `tokens`) exists.
    pub(crate) fn has_snapshot(&self, at: usize, tokens: &[u32]) -> bool {
        self.snapshot_at(at, tokens).is_some()
    }

    /// The index of the snapshot of exactly the first `at` tokens of `tokens`, if one exists.
    fn snapshot_at(&self, at: usize, tokens: &[u32]) -> Option<usize> {
        self.snapshots.iter().position(|s| s.tokens.len() == at && s.tokens[..] == tokens[..at])
    }

    /// Commit an accepted path of the last verified token tree (see [`crate::tree`]): `path` lists node
    /// indices, root first, each the parent of the next; `tokens[node]` is the node's token. The node at
    /// depth `d` moves to KV row `n_past + d` (copies run in increasing depth and a node's index is at
    /// least its depth, so no source is overwritten before it is read); GDN layers apply the path to their
    /// states once.
    ///
    /// Errors: a path that is not increasing, runs past the cache, or (hybrid models) is not a root path
    /// of the pending tree, or no tree is pending.
    pub fn commit_path(&mut self, be: &B, tokens: &[u32], path: &[usize]) -> Result<()> {
        let n_past = self.n_past();
        let increasing = path.iter().enumerate().all(|(d, &node)| node >= d && (d == 0 || node > path[d - 1]));
        if !increasing || path.iter().any(|&node| n_past + node >= self.ctx || node >= tokens.len()) {
            return Err(Error::Input(format!("commit: bad accepted path {path:?}")));
        }
        if self.is_hybrid() {
            let parents = &self.tree;
            if parents.is_empty() {
                return Err(Error::Input("commit without a pending tree (verify it first)".into()));
            }
            let ok = !path.is_empty()
                && path[0] == 0
                && path.iter().all(|&p| p < parents.len())
                && path.windows(2).all(|w| parents[w[1]] == w[0]);
            if !ok {
                return Err(Error::Input(format!("commit: {path:?} is not a root path of the {}-node tree", parents.len())));
            }
            self.tree.clear();
        }
        let kvd = self.kv_dim;
        for layer in self.layers.iter_mut() {
            match layer {
                LayerState::Kv { k, v } => {
                    be.commit_rows(k, kvd, n_past, path);
                    be.commit_rows(v, kvd, n_past, path);
                }
                LayerState::Gdn { conv, rec, tree } => {
                    let s = self.gdn.expect("GDN layer");
                    be.gdn_commit(&s, rec, &tree.c, &tree.gamma, &tree.u, path);
                    be.gdn_conv_commit(&s, conv, &tree.x, path);
                }
            }
        }
        self.tokens.extend(path.iter().map(|&node| tokens[node]));
        if self.is_hybrid() {
            self.gdn_len = self.tokens.len();
            // A decoded state differs (by rounding) from what a prefill of the same tokens computes.
            self.exact = false;
        }
        Ok(())
    }

    /// Error unless `extra` more tokens fit.
    pub fn check_room(&self, extra: usize) -> Result<()> {
        if self.n_past() + extra > self.ctx {
            return Err(Error::Input(format!(
                "sequence of {} tokens exceeds the context length of {} tokens",
                self.n_past() + extra,
                self.ctx
            )));
        }
        Ok(())
    }

    /// Bytes held by the KV rows and the recurrent states (snapshots and tree values excluded).
    pub fn nbytes(&self) -> usize {
        let s = self.gdn;
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kv { .. } => 2 * self.ctx * self.kv_dim * 4,
                LayerState::Gdn { .. } => s.map_or(0, |s| (s.conv_state_len() + s.state_len()) * 4),
            })
            .sum()
    }

    /// The GDN shape of a hybrid sequence.
    pub(crate) fn gdn_shape(&self) -> Option<GdnShape> {
        self.gdn
    }
}

impl<B: Backend> Clone for GdnTree<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        GdnTree { x: self.x.clone(), c: self.c.clone(), gamma: self.gamma.clone(), u: self.u.clone(), rows: self.rows }
    }
}

impl<B: Backend> Clone for LayerState<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        match self {
            LayerState::Kv { k, v } => LayerState::Kv { k: k.clone(), v: v.clone() },
            LayerState::Gdn { conv, rec, tree } => LayerState::Gdn { conv: conv.clone(), rec: rec.clone(), tree: tree.clone() },
        }
    }
}

impl<B: Backend> Clone for Snapshot<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        Snapshot { tokens: self.tokens.clone(), layers: self.layers.clone(), checkpoint: self.checkpoint }
    }
}

impl<B: Backend> Clone for Capture<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        Capture { at: self.at, layers: self.layers.clone() }
    }
}

/// A copy of the whole state (caches, recurrent states, snapshots): for tests and experiments that branch
/// a sequence.
impl<B: Backend> Clone for SeqState<B>
where
    B::Buf: Clone,
{
    fn clone(&self) -> Self {
        SeqState {
            ctx: self.ctx,
            kv_dim: self.kv_dim,
            layers: self.layers.clone(),
            tokens: self.tokens.clone(),
            want_hidden: self.want_hidden,
            hidden: self.hidden.clone(),
            gdn: self.gdn,
            gdn_len: self.gdn_len,
            restore_pending: self.restore_pending,
            exact: self.exact,
            snapshots: self.snapshots.clone(),
            captures: self.captures.clone(),
            checkpoint: self.checkpoint,
            tree: self.tree.clone(),
            features: self.features.clone(),
        }
    }
}

impl SeqState<Cpu> {
    /// The recurrent state of layer `l` (empty for attention layers), `n_v_heads × d_k × d_v`.
    pub fn recurrent_state(&self, l: usize) -> &[f32] {
        match &self.layers[l] {
            LayerState::Gdn { rec, .. } => rec,
            LayerState::Kv { .. } => &[],
        }
    }

    /// The conv window of layer `l` (empty for attention layers), `(K−1) × conv_dim`.
    pub fn conv_state(&self, l: usize) -> &[f32] {
        match &self.layers[l] {
            LayerState::Gdn { conv, .. } => conv,
            LayerState::Kv { .. } => &[],
        }
    }
}
