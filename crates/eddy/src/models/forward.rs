//! The forward pass shared by every architecture, written against [`Backend`].
//!
//! One path serves prefill (many tokens), decode (one token) and tree verification (a chain is a tree):
//! the batch is a run of tokens at positions `n_past..` (or tree nodes at `n_past + depth`). Per block
//! (pre-norm, Xiong et al. 2020):
//!
//! ```text
//! h = norm(x);  x += post_norm(mixer(h));  h = norm(x);  x += post_norm(Wdown·(act(Wgate·h) ⊙ Wup·h))
//! attention mixer:   q,k,v = Wq·h (+b), Wk·h (+b), Wv·h (+b);  [q, gate = split per head];  q,k = qk_norm(q,k)
//!                    q,k = rope(q,k);  cache[row0..] = k,v;  a = attention(q, cache) [⊙ σ(gate)];  Wo·a
//! Gated DeltaNet:    conv + SiLU of Wqkv·h, q/k L2 norms, g and β, the delta rule on the recurrent state
//!                    (chunked for a chain, the ancestor-masked solve for a tree), gated norm, Wout·o
//! ```
//! then `logits = W_lm · norm(x)` for the rows asked for (Gated DeltaNet math: `docs/qwen35.md`,
//! `docs/gated-deltanet.md`). Activations are quantized to int8 once per input (shared by q/k/v and by
//! gate/up). All buffers live in a [`Workspace`] allocated once; the sequence's per-layer state in
//! [`SeqState`].

use super::{Attention, DeltaNet, Layer, Mixer, Model, ModelConfig};
use crate::backend::{Attend, AttnShape, Backend, Cpu, GdnShape, Visibility};
use crate::error::{Error, Result};
use crate::sampling::Candidates;
use crate::state::{Capture, GdnTree, LayerKind, LayerState, SeqState, GDN_CHUNK};
use crate::tree::{TreePaths, NO_PARENT};

/// Which rows of the batch get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// No logits (prefill of a prefix).
    None,
    /// Only the last token's (prefill before sampling, decode).
    Last,
    /// Every token's (perplexity, verification).
    All,
}

/// Scratch buffers (in the backend's memory) for a batch of up to `max_batch` tokens.
pub struct Workspace<B: Backend = Cpu> {
    /// Largest batch processed at once; longer inputs are split into runs ending at multiples of it
    /// (rounded up to a multiple of [`GDN_CHUNK`] for hybrid models).
    pub max_batch: usize,
    pub(crate) x: B::Buf,
    pub(crate) h: B::Buf,
    pub(crate) q: B::Buf,
    pub(crate) k: B::Buf,
    pub(crate) v: B::Buf,
    att: B::Buf,
    pub(crate) o: B::Buf,
    /// FFN gate and up rows; the mixers reuse them (the FFN runs after the mixer): the gated attention's
    /// `wq` output (`2·q_dim`) and gate (`q_dim`), the Gated DeltaNet's pre-conv and post-conv streams
    /// (`conv_dim`). One set of buffers keeps a prefill's working set small (as the old bump scratch did).
    gate: B::Buf,
    up: B::Buf,
    /// Gated DeltaNet: z and outputs (`value_dim`), g and β (`n_v_heads`).
    gz: B::Buf,
    go: B::Buf,
    ga: B::Buf,
    gb: B::Buf,
    /// MTP: the normed hidden rows (`d_model`) and `[norm(embed) ; norm(hidden)]` rows (`2·d_model`); a
    /// DFlash drafter's feature rows in `cat` ([`Workspace::for_blocks`]).
    h2: B::Buf,
    pub(crate) cat: B::Buf,
    pub(crate) xq: B::QAct,
    /// Host: RoPE position and tree parent of each row, and `0..max_batch` (chain paths).
    pub(crate) positions: Vec<usize>,
    parents: Vec<usize>,
    iota: Vec<usize>,
    /// Greedy head: when set, a pass that computes logits takes the argmax of each logits row where they are
    /// computed ([`Backend::matmul_argmax`]) and leaves the token ids in [`Workspace::ids`] instead of the
    /// logits (the logits output stays empty). Models with a final logit soft-cap ignore it (their logits
    /// come back as usual). Off by default.
    pub argmax_head: bool,
    /// The greedy head's token ids of the last pass, one per logits row in the order logits would have come.
    pub ids: Vec<u32>,
    /// Sampling head: when `Some((inv_t, k))`, a pass that computes logits keeps them in backend memory
    /// ([`Workspace::head_logits`]) and leaves each row's sampling candidates at inverse temperature `inv_t`
    /// with `k` slots in [`Workspace::cands`] ([`Backend::candidate_rows`]) instead of the logits (the logits
    /// output stays empty). The pass must compute at most `max_batch` logits rows (one head product). Models
    /// with a final logit soft-cap ignore it. Off by default; [`Workspace::argmax_head`] takes precedence.
    pub sample_head: Option<(f32, usize)>,
    /// The sampling head's candidates of the last pass, one row per logits row.
    pub cands: Candidates,
    /// The sampling head's logits of the last pass (`max_batch × vocab`, allocated on first use), for the
    /// rows whose candidates do not decide the sample.
    pub head_logits: Option<B::Buf>,
    /// Run-ahead passes' argmaxes taken at once on a backend that does not run ahead (oldest first;
    /// [`decode_ahead`], [`take_ahead_id`]).
    ahead_ids: std::collections::VecDeque<u32>,
    /// A run-ahead pass: the greedy head keeps its argmax on a backend that runs ahead.
    ahead_head: bool,
    /// A run-ahead pass's input token when the host knows it (`None`: the previous pass's argmax).
    ahead_token: Option<u32>,
}

impl<B: Backend> Workspace<B> {
    /// The heads back to plain logits: [`Workspace::argmax_head`] and [`Workspace::sample_head`] off, no
    /// run-ahead pass in progress (after a pass that did not return: a caught panic).
    pub fn reset_heads(&mut self) {
        self.argmax_head = false;
        self.sample_head = None;
        self.ahead_head = false;
        self.ahead_token = None;
    }

    /// Allocate for `model` and batches of up to `max_batch` tokens.
    pub fn new(be: &B, model: &Model<B>, max_batch: usize) -> Self {
        let c = &model.config;
        let mixers = || model.layers.iter().chain(model.mtp.as_ref().map(|m| &m.layer)).map(|l| &l.mixer);
        let gated = mixers().any(|m| matches!(m, Mixer::Attention(Attention { gated: true, .. })));
        Self::sized(be, c, gated, if model.mtp.is_some() { 2 * c.d_model } else { 0 }, max_batch)
    }

    /// Allocate for a stack of plain attention blocks of shape `c` (no gated attention, no Gated DeltaNet)
    /// run by [`blocks`], batches of up to `max_batch` rows, and `input` values per row of a drafter's own
    /// input rows (DFlash's target features).
    pub(crate) fn for_blocks(be: &B, c: &ModelConfig, max_batch: usize, input: usize) -> Self {
        Self::sized(be, c, false, input, max_batch)
    }

    fn sized(be: &B, c: &ModelConfig, gated: bool, cat: usize, max_batch: usize) -> Self {
        let max_batch = if c.gdn.is_some() { max_batch.max(1).next_multiple_of(GDN_CHUNK) } else { max_batch.max(1) };
        let z = |n: usize| be.alloc(n * max_batch);
        let s = c.gdn.unwrap_or(GdnShape { n_k_heads: 0, n_v_heads: 0, d_k: 0, d_v: 0, kernel: 1, v_tiled: false });
        Workspace {
            max_batch,
            x: z(c.d_model),
            h: z(c.d_model),
            q: z(c.q_dim()),
            k: z(c.kv_dim()),
            v: z(c.kv_dim()),
            att: z(c.q_dim()),
            o: z(c.d_model),
            gate: z(c.ffn_dim.max(s.conv_dim()).max(if gated { 2 * c.q_dim() } else { 0 })),
            up: z(c.ffn_dim.max(s.conv_dim()).max(if gated { c.q_dim() } else { 0 })),
            gz: z(s.value_dim()),
            go: z(s.value_dim()),
            ga: z(s.n_v_heads),
            gb: z(s.n_v_heads),
            h2: z(if cat > 0 { c.d_model } else { 0 }),
            cat: z(cat),
            xq: be.new_qact(),
            positions: Vec::with_capacity(max_batch),
            parents: Vec::with_capacity(max_batch),
            iota: (0..max_batch).collect(),
            argmax_head: false,
            ids: Vec::with_capacity(max_batch),
            sample_head: None,
            cands: Candidates::default(),
            head_logits: None,
            ahead_ids: std::collections::VecDeque::new(),
            ahead_head: false,
            ahead_token: None,
        }
    }
}

impl<B: Backend> Model<B> {
    /// The state kind of every layer.
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Attention(_) => LayerKind::Attention,
                Mixer::DeltaNet(_) => LayerKind::DeltaNet,
            })
            .collect()
    }

    /// An empty sequence state for this model with room for `ctx` tokens.
    pub fn new_state(&self, be: &B, ctx: usize) -> SeqState<B> {
        SeqState::with_layers(be, &self.layer_kinds(), ctx, self.config.kv_dim(), self.config.gdn)
    }
}

/// Error unless `state` was made for `model` ([`Model::new_state`]): one entry per layer, of its kind.
fn check_state<B: Backend>(model: &Model<B>, state: &SeqState<B>) -> Result<()> {
    let fits = state.layers.len() == model.layers.len()
        && model.layers.iter().zip(&state.layers).all(|(l, s)| {
            matches!((&l.mixer, s), (Mixer::Attention(_), LayerState::Kv { .. }) | (Mixer::DeltaNet(_), LayerState::Gdn { .. }))
        });
    if fits {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "sequence state of {} layers does not fit this model's {} layers (make it with Model::new_state)",
            state.layers.len(),
            model.layers.len()
        )))
    }
}

fn check_tokens<B: Backend>(model: &Model<B>, tokens: &[u32]) -> Result<()> {
    let vocab = model.config.vocab_size;
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&bad) => Err(Error::Input(format!("token id {bad} is outside the vocabulary of {vocab}"))),
        None => Ok(()),
    }
}

/// Run `tokens` through the model at positions `state.n_past()..`, append their K/V (and advance the
/// recurrent states) and the tokens to `state`, and write logits (`vocab` floats per requested row, in
/// batch order) into `logits`. Runs end at multiples of [`Workspace::max_batch`] positions and Gated
/// DeltaNet chunks at multiples of [`GDN_CHUNK`], so a prefill computes the same values however it was
/// split; from an exact hybrid state a prefix-cache snapshot is taken (see [`crate::state`]). Drops any
/// pending tree.
///
/// Errors: a token id outside the vocabulary, or a sequence longer than the context.
pub fn forward<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) -> Result<()> {
    check_tokens(model, tokens)?;
    check_state(model, state)?;
    sync(model, be, ws, state)?;
    prefill(model, be, ws, state, tokens, want, logits)
}

/// After a truncation of a hybrid sequence: restore the GDN states from the best snapshot and re-run the
/// committed tokens after it.
fn sync<B: Backend>(model: &Model<B>, be: &B, ws: &mut Workspace<B>, state: &mut SeqState<B>) -> Result<()> {
    if !state.is_hybrid() {
        return Ok(());
    }
    state.restore(be);
    if state.gdn_len < state.tokens.len() {
        let rest = state.tokens[state.gdn_len..].to_vec();
        state.tokens.truncate(state.gdn_len);
        let want_hidden = std::mem::replace(&mut state.want_hidden, false);
        let r = prefill(model, be, ws, state, &rest, Logits::None, &mut Vec::new());
        state.want_hidden = want_hidden;
        r?;
    }
    Ok(())
}

fn prefill<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) -> Result<()> {
    state.check_room(tokens.len())?;
    state.tree.clear();
    logits.clear();
    ws.ids.clear();
    ws.cands.reset(0, 0);
    state.hidden.clear();
    state.features.clear();
    let (start, end) = (state.n_past(), state.n_past() + tokens.len());
    if let Some(s) = state.gdn_shape() {
        // From an exact state, snapshot the GDN states at the last chunk boundary before the last token (the
        // prefix cache reuses at most all but the last prompt token), and at the planned checkpoint (where
        // the prompt parted from the tokens it replaced, `SeqState::plan_checkpoint`) when this pass reaches it.
        let last = (end.saturating_sub(1) / GDN_CHUNK) * GDN_CHUNK;
        let known = last <= start && state.has_snapshot(last, &state.tokens);
        let mut ats = Vec::new();
        if last > 0 && last >= start && !(known && last == start) {
            ats.push(last);
        }
        // (A checkpoint at this pass's start, a piece boundary, is the current state: copied below.)
        if let Some(cp) = state.checkpoint.filter(|&cp| cp >= start && cp < last) {
            ats.push(cp);
        }
        state.captures.clear();
        if !state.exact {
            ats.clear();
        }
        for at in ats {
            // At `start` the snapshot is the current state; past it, the GDN layers fill it in at `at`.
            let layers = state
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Gdn { conv, rec, .. } => {
                        let (mut c, mut r) = (be.alloc(s.conv_state_len()), be.alloc(s.state_len()));
                        if at == start {
                            be.copy(conv, &mut c, s.conv_state_len());
                            be.copy(rec, &mut r, s.state_len());
                        }
                        Some((c, r))
                    }
                    LayerState::Kv { .. } => None,
                })
                .collect();
            state.captures.push(Capture { at, layers });
        }
    }
    // Runs end at multiples of `max_batch` positions: the same cuts whatever the prefill's start.
    let mb = ws.max_batch;
    let mut at = 0;
    while at < tokens.len() {
        let run_end = (((start + at) / mb + 1) * mb - start).min(tokens.len());
        let chunk = &tokens[at..run_end];
        let rows = match want {
            Logits::All => 0..chunk.len(),
            Logits::Last if run_end == tokens.len() => chunk.len() - 1..chunk.len(),
            _ => 0..0,
        };
        pass(model, be, ws, state, chunk, Rows::Chain, rows, logits);
        state.tokens.extend_from_slice(chunk);
        at = run_end;
    }
    if state.is_hybrid() {
        state.gdn_len = state.tokens.len();
        state.exact = state.exact && end.is_multiple_of(GDN_CHUNK);
        state.save_capture();
    }
    Ok(())
}

/// Drop what a decode step's pass leaves for its caller (a pending tree, captures, head ids and candidates,
/// hidden and feature rows) before the next one.
fn begin_step<B: Backend>(ws: &mut Workspace<B>, state: &mut SeqState<B>) {
    state.tree.clear();
    state.captures.clear();
    ws.ids.clear();
    ws.cands.reset(0, 0);
    state.hidden.clear();
    state.features.clear();
}

/// What `state.tokens` holds for a run-ahead step's input until its id is back ([`decode_ahead`]).
pub const AHEAD_TOKEN: u32 = u32::MAX;

/// One run-ahead greedy decode step: [`decode`] of `token` (with `None`: the argmax of the previous run-ahead
/// step, still where the backend computed it) whose own argmax stays on the backend — taken later, in order,
/// by [`take_ahead_id`] — so that the host can queue the next step while this one runs (on a backend that
/// [`Backend::runs_ahead`]; on others each argmax is taken at once and held in `ws`). `state.tokens` records
/// [`AHEAD_TOKEN`] for a `None` input until [`SeqState::resolve_ahead`] gives it its id. The same values as
/// [`decode`] with the greedy head ([`Workspace::argmax_head`]), so the same tokens: only the host's wait
/// moves.
///
/// Errors: as [`decode`]; a `None` input with no run-ahead argmax in flight; a hybrid model (its recurrent
/// state's bookkeeping is [`decode`]'s) or one whose logits are soft-capped (its greedy head runs on the host).
///
/// # Panics
/// On a backend that runs ahead, a `None` input with no run-ahead argmax untaken.
pub fn decode_ahead<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    token: Option<u32>,
) -> Result<()> {
    if state.is_hybrid() || model.config.final_softcap.is_some() {
        return Err(Error::Input("run-ahead decoding: not for hybrid or logit-soft-capped models".into()));
    }
    if token.is_none() && !be.runs_ahead() && ws.ahead_ids.is_empty() {
        return Err(Error::Input("run-ahead decoding: no argmax in flight to continue from".into()));
    }
    if let Some(t) = token {
        check_tokens(model, &[t])?;
    }
    // On a backend that runs ahead every step embeds through `embed_ahead` (one operation list for both
    // inputs); elsewhere a known token is embedded as usual.
    let tokens = [match token {
        Some(t) if !be.runs_ahead() => t,
        _ => AHEAD_TOKEN,
    }];
    check_state(model, state)?;
    state.check_room(1)?;
    begin_step(ws, state);
    let (argmax_head, sample_head) = (ws.argmax_head, ws.sample_head.take());
    (ws.argmax_head, ws.ahead_head, ws.ahead_token) = (true, true, token);
    let mut none = Vec::new();
    pass(model, be, ws, state, &tokens, Rows::Chain, 0..1, &mut none);
    (ws.argmax_head, ws.sample_head, ws.ahead_head, ws.ahead_token) = (argmax_head, sample_head, false, None);
    // `pass` left the id in `ws.ids` (not running ahead) or on the backend.
    if let Some(id) = ws.ids.pop() {
        ws.ahead_ids.push_back(id);
    }
    state.tokens.push(token.unwrap_or(AHEAD_TOKEN));
    Ok(())
}

/// The argmax of the oldest run-ahead step ([`decode_ahead`]) not yet taken, waiting for it; `None` when
/// none is in flight.
pub fn take_ahead_id<B: Backend>(be: &B, ws: &mut Workspace<B>) -> Option<u32> {
    if be.runs_ahead() {
        be.take_ahead_id()
    } else {
        ws.ahead_ids.pop_front()
    }
}

/// One decode step: `token` at position `n_past`, committed by the same pass, its logits into `logits`
/// (`vocab` values). Equals [`forward_tree`] of the one-node tree followed by [`commit_tree`] of its root,
/// bit for bit, in one pass: K/V rows go straight to their place and Gated DeltaNet layers take the fused
/// recurrent step ([`Backend::gdn_step`]) instead of a tree solve and a separate commit. Drops any pending
/// tree.
///
/// Errors: a token id outside the vocabulary, a full context.
pub fn decode<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    token: u32,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let tokens = [token];
    check_tokens(model, &tokens)?;
    check_state(model, state)?;
    sync(model, be, ws, state)?;
    state.check_room(1)?;
    logits.clear();
    begin_step(ws, state);
    pass(model, be, ws, state, &tokens, Rows::Chain, 0..1, logits);
    state.tokens.push(token);
    if state.is_hybrid() {
        state.gdn_len = state.tokens.len();
        // A decoded state differs (by rounding) from what a chunked prefill of the same tokens computes.
        state.exact = false;
    }
    Ok(())
}

/// How many leading tokens of `prompt` the committed sequence in `state` can keep (prefix cache; see
/// [`SeqState::reusable_prefix`]). Prefilling the rest gives what a cold prefill gives.
pub fn reusable_prefix<B: Backend>(_model: &Model<B>, state: &SeqState<B>, prompt: &[u32]) -> usize {
    state.reusable_prefix(prompt)
}

/// Verify pass over a token tree: run nodes `first..n` of the tree (`tokens[i]` is node `i`'s token,
/// `paths` its topology, see [`crate::tree`]) against the committed sequence in `state`, and append every
/// computed node's logits (`vocab` floats each, in node order) to `logits`.
///
/// Node `i` is at position `n_past + depth(i)` and its K/V go to the scratch row `n_past + i`, beyond the
/// committed rows; Gated DeltaNet layers solve all nodes at once with the ancestor-masked WY form and keep
/// what the commit needs: the committed state is only read. Nodes `0..first` must have been computed by
/// an earlier call on the same committed state (incremental drafting; attention-only models). After
/// acceptance, [`commit_tree`] applies the accepted path. For attention layers each node's logits are
/// bit-identical to those plain decoding computes at the same position (batch-invariant kernels); through
/// Gated DeltaNet layers they agree up to rounding.
///
/// Errors: a token id outside the vocabulary, `tokens.len() != paths.len()`, a tree that does not fit in
/// the context after the committed rows, or (hybrid models) `first != 0`, an empty tree or one larger than
/// [`Workspace::max_batch`].
#[allow(clippy::too_many_arguments)]
pub fn forward_tree<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    tokens: &[u32],
    paths: &TreePaths,
    first: usize,
    logits: &mut Vec<f32>,
) -> Result<()> {
    if tokens.len() != paths.len() || first > tokens.len() {
        return Err(Error::Input(format!("token tree: {} tokens for {} nodes (from node {first})", tokens.len(), paths.len())));
    }
    check_tokens(model, tokens)?;
    check_state(model, state)?;
    if state.is_hybrid() {
        if first != 0 {
            return Err(Error::Input("hybrid models verify whole token trees only (incremental drafting is not supported)".into()));
        }
        if tokens.is_empty() || tokens.len() > ws.max_batch {
            return Err(Error::Input(format!("tree of {} nodes: hybrid models verify 1 to {} nodes at once", tokens.len(), ws.max_batch)));
        }
    }
    sync(model, be, ws, state)?;
    state.check_room(tokens.len())?;
    logits.clear();
    ws.ids.clear();
    ws.cands.reset(0, 0);
    state.hidden.clear();
    state.features.clear();
    if state.is_hybrid() {
        state.tree.clear();
        state.tree.extend((0..paths.len()).map(|i| parent_of(paths, i)));
    }
    let mut start = first;
    while start < tokens.len() {
        let end = (start + ws.max_batch).min(tokens.len());
        let n = end - start;
        pass(model, be, ws, state, &tokens[start..end], Rows::Tree { first: start, paths }, 0..n, logits);
        start = end;
    }
    Ok(())
}

/// Node `i`'s parent in `paths`, [`NO_PARENT`] for a root.
fn parent_of(paths: &TreePaths, i: usize) -> usize {
    let p = paths.path(i);
    if p.len() < 2 {
        NO_PARENT
    } else {
        p[p.len() - 2] as usize
    }
}

/// The final-normed hidden states (`d_model` floats per row) of the last [`forward`] (its logit rows, or
/// every row when [`SeqState::want_hidden`] is set) or [`forward_tree`] (every node), for drafters that
/// run on the target's hidden states (Qwen3.5's MTP head): kept for models with an MTP head (or when
/// asked); `None` otherwise.
pub fn last_hidden<B: Backend>(state: &SeqState<B>) -> Option<&[f32]> {
    (!state.hidden.is_empty() || state.is_hybrid()).then_some(&state.hidden[..])
}

/// Commit the accepted `path` (node indices, root first) of the last [`forward_tree`] on `state`
/// ([`SeqState::commit_path`]: K/V rows compacted, recurrent states updated once).
///
/// Errors: a path that is not a root path of the verified tree.
pub fn commit_tree<B: Backend>(_model: &Model<B>, be: &B, state: &mut SeqState<B>, tokens: &[u32], path: &[usize]) -> Result<()> {
    state.commit_path(be, tokens, path)
}

/// Where a batch's rows sit: a chain at `n_past..`, or tree nodes `first..` (scratch rows `n_past + node`).
#[derive(Clone, Copy)]
enum Rows<'a> {
    Chain,
    Tree { first: usize, paths: &'a TreePaths },
}

/// A GDN layer's part of the snapshot the current prefill takes: (absolute position, its conv window and
/// recurrent state to fill), when the snapshot falls in this pass.
/// The snapshots a GDN layer fills during this pass: (absolute position, that layer's conv window and state).
type SnapshotSlot<'a, B> = Vec<(usize, &'a mut (<B as Backend>::Buf, <B as Backend>::Buf))>;

/// What every layer of one pass shares.
struct Pass<'a> {
    c: &'a ModelConfig,
    /// Rows in the pass.
    t: usize,
    /// Committed positions.
    n_past: usize,
    /// First cache row written (`n_past + first` for a tree).
    row0: usize,
    /// What the attention sees.
    vis: Visibility<'a>,
    /// Tree verification (read-only state) rather than a chain that advances it.
    tree: bool,
}

/// One pass of the decoder blocks over a batch of `tokens` (a chain at `n_past..` or tree nodes); logits
/// of the batch rows `logit_rows` appended to `logits`.
#[allow(clippy::too_many_arguments)]
fn pass<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    tokens: &[u32],
    rows: Rows,
    logit_rows: std::ops::Range<usize>,
    logits: &mut Vec<f32>,
) {
    let c = &model.config;
    let t = tokens.len();
    let n_past = state.n_past();
    let (row0, vis) = match rows {
        Rows::Chain => (n_past, Visibility::Causal),
        Rows::Tree { first, paths } => (n_past + first, Visibility::Tree { first, paths }),
    };
    ws.positions.clear();
    ws.parents.clear();
    match rows {
        Rows::Chain => {
            ws.positions.extend(n_past..n_past + t);
            ws.parents.extend((0..t).map(|i| i.checked_sub(1).unwrap_or(NO_PARENT)));
        }
        Rows::Tree { first, paths } => {
            ws.positions.extend((first..first + t).map(|i| n_past + paths.depth(i)));
            ws.parents.extend((first..first + t).map(|i| parent_of(paths, i)));
        }
    }
    let p = Pass { c, t, n_past, row0, vis, tree: matches!(rows, Rows::Tree { .. }) };
    if tokens == [AHEAD_TOKEN] {
        // A run-ahead step's input: the previous step's argmax (`decode_ahead`).
        match ws.ahead_ids.back() {
            Some(&id) if !be.runs_ahead() => be.embed(&model.embed, &[id], c.embed_scale, &mut ws.x),
            _ => be.embed_ahead(&model.embed, ws.ahead_token, c.embed_scale, &mut ws.x),
        }
    } else {
        be.embed(&model.embed, tokens, c.embed_scale, &mut ws.x);
    }
    let SeqState { layers, captures, features, .. } = state;
    features.grow(be, t, c.d_model);
    // Whether `ws.o` holds the last block's FFN output, not yet added to the residual stream (the add is
    // fused into the next block's norm).
    let mut pending = false;
    for (l, (layer, st)) in model.layers.iter().zip(layers.iter_mut()).enumerate() {
        let slot = captures.iter_mut().filter_map(|cap| cap.layers[l].as_mut().map(|s| (cap.at, s))).collect();
        block(be, &p, layer, st, slot, ws, pending);
        pending = true;
        if features.captures(l) {
            // The residual stream after layer `l`, for a feature-reading drafter (DFlash).
            be.add(&mut ws.x, &ws.o, t * c.d_model);
            pending = false;
            features.record(be, l, &ws.x, &ws.iota[..t], c.d_model);
        }
    }
    if pending {
        be.add(&mut ws.x, &ws.o, t * c.d_model);
    }
    head(model, be, ws, state, &model.output_norm, t, logit_rows, logits);
}

/// Final norm of the batch rows `rows` and their logits appended to `logits`; the normed rows kept in
/// `state.hidden` for models with an MTP head (every row of the batch with `state.want_hidden`).
#[allow(clippy::too_many_arguments)]
fn head<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    norm: &B::Buf,
    t: usize,
    rows: std::ops::Range<usize>,
    logits: &mut Vec<f32>,
) {
    let c = &model.config;
    let d = c.d_model;
    let keep_hidden = model.mtp.is_some() || state.want_hidden;
    if state.want_hidden {
        be.rms_norm(&ws.x, 0, t, norm, c.norm_eps, &mut ws.h);
        be.read(&ws.h, 0, t, d, &mut state.hidden);
    }
    let n = rows.len();
    if n == 0 {
        return;
    }
    be.rms_norm(&ws.x, rows.start, n, norm, c.norm_eps, &mut ws.h);
    if keep_hidden && !state.want_hidden {
        be.read(&ws.h, 0, n, d, &mut state.hidden);
    }
    be.quantize(&ws.h, n, d, model.lm_head(), &mut ws.xq);
    // (`decode_ahead` sets the greedy head with it and refuses soft-capped logits.)
    if ws.ahead_head && n == 1 && be.runs_ahead() {
        be.matmul_argmax_ahead(model.lm_head(), &ws.h, &ws.xq, c.vocab_size);
        return;
    }
    if ws.argmax_head && c.final_softcap.is_none() {
        let start = ws.ids.len();
        ws.ids.resize(start + n, 0);
        be.matmul_argmax(model.lm_head(), &ws.h, &ws.xq, n, c.vocab_size, &mut ws.ids[start..]);
        return;
    }
    if let (Some((inv_t, k)), None) = (ws.sample_head, c.final_softcap) {
        assert!(ws.cands.rows() == 0 && n <= ws.max_batch, "sampling head: one head product of at most max_batch rows per pass");
        let v = c.vocab_size;
        let buf = ws.head_logits.get_or_insert_with(|| be.alloc(ws.max_batch * v));
        be.matmul(model.lm_head(), &ws.h, &ws.xq, n, buf);
        be.candidate_rows(buf, n, v, inv_t, k, &mut ws.cands);
        return;
    }
    let start = logits.len();
    logits.resize(start + n * c.vocab_size, 0.0);
    let out = &mut logits[start..];
    be.matmul_to_host(model.lm_head(), &ws.h, &ws.xq, n, out);
    if let Some(cap) = c.final_softcap {
        out.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }
}

/// One block on the residual stream `ws.x`: `x += post_norm(mixer(norm(x)))`, then the FFN, whose output
/// is left in `ws.o` for the caller to add (`x += o`; the next block does it when `residual`, fused with its
/// norm). With `residual`, `ws.o` first goes into `x`.
fn block<B: Backend>(
    be: &B,
    p: &Pass,
    layer: &Layer<B>,
    st: &mut LayerState<B>,
    capture: SnapshotSlot<B>,
    ws: &mut Workspace<B>,
    residual: bool,
) {
    let (c, t, d) = (p.c, p.t, p.c.d_model);
    let mixer_in = match &layer.mixer {
        Mixer::Attention(a) => &a.wq,
        Mixer::DeltaNet(g) => &g.w_qkv,
    };
    {
        let Workspace { x, h, o, xq, .. } = ws;
        be.rms_norm_quantize(x, residual.then_some(&*o), t, d, &layer.attn_norm, c.norm_eps, h, mixer_in, xq);
    }
    match (&layer.mixer, st) {
        (Mixer::Attention(a), LayerState::Kv { k, v }) => attention_mixer(be, p, a, k, v, ws),
        (Mixer::DeltaNet(g), LayerState::Gdn { conv, rec, tree }) => delta_net_mixer(be, p, g, conv, rec, tree, capture, ws),
        _ => panic!("layer state does not match the layer's mixer (state made for another model)"),
    }
    if let Some(w) = &layer.post_attn_norm {
        be.rms_norm_inplace(&mut ws.o, t * d, w, c.norm_eps);
    }
    ffn(be, c, layer, ws, t);
}

/// `o = post_norm(Wdown · (act(Wgate·h) ⊙ Wup·h))` with `h = norm(x + o)` (the mixer's output `o` added to
/// the residual stream first); `x += o` is left to the caller.
fn ffn<B: Backend>(be: &B, c: &ModelConfig, layer: &Layer<B>, ws: &mut Workspace<B>, t: usize) {
    let (d, fd) = (c.d_model, c.ffn_dim);
    let Workspace { x, h, o, gate, up, xq, .. } = ws;
    be.rms_norm_quantize(x, Some(&*o), t, d, &layer.ffn_norm, c.norm_eps, h, &layer.w_gate, xq);
    be.matmul_parts(&mut [(&layer.w_gate, None, &mut *gate), (&layer.w_up, None, &mut *up)], h, xq, t);
    be.gated_act_quantize(c.activation, gate, up, t, fd, &layer.w_down, xq);
    be.matmul(&layer.w_down, gate, xq, t, o);
    if let Some(w) = &layer.post_ffn_norm {
        be.rms_norm_inplace(o, t * d, w, c.norm_eps);
    }
}

/// `o = Wo · attention(rope(qk_norm(Wq·h + b)), cache) [⊙ σ(gate)]` (`h`, `xq` hold the normed input),
/// the batch's K/V stored at cache rows `row0..`.
fn attention_mixer<B: Backend>(be: &B, p: &Pass, a: &Attention<B>, kc: &mut B::Buf, vc: &mut B::Buf, ws: &mut Workspace<B>) {
    let (c, t) = (p.c, p.t);
    let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
    let Workspace { h, q, k, v, att, o, gate: qg, up: attn_gate, xq, positions, .. } = ws;
    // Biases in the products' epilogues (the gated q's after the split).
    if a.gated {
        be.matmul(&a.wq, h, xq, t, qg);
        be.matmul_parts(&mut [(&a.wk, a.bk.as_ref(), &mut *k), (&a.wv, a.bv.as_ref(), &mut *v)], h, xq, t);
    } else {
        be.matmul_parts(&mut [(&a.wq, a.bq.as_ref(), &mut *q), (&a.wk, a.bk.as_ref(), &mut *k), (&a.wv, a.bv.as_ref(), &mut *v)], h, xq, t);
    }
    if a.gated {
        be.split_gate(qg, t, c.n_heads, hd, q, attn_gate);
        if let Some(b) = &a.bq {
            be.add_bias(q, t, b);
        }
    }
    if let Some(w) = &a.q_norm {
        be.rms_norm_inplace(q, t * qd, w, c.norm_eps);
    }
    if let Some(w) = &a.k_norm {
        be.rms_norm_inplace(k, t * kvd, w, c.norm_eps);
    }
    let shape =
        AttnShape { n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: hd, scale: c.attn_scale, window: a.window, softcap: None };
    if a.gated {
        be.rope_store(&a.rope, q, qd, k, v, kvd, hd, positions, kc, vc, p.row0);
        be.attention(Attend { shape, q, k: kc, v: vc, n_past: p.n_past, t, vis: p.vis }, att);
        be.mul_sigmoid(att, attn_gate, t * qd);
        be.quantize(att, t, qd, &a.wo, xq);
    } else {
        be.rope_store_attention_quantize(&a.rope, shape, q, k, v, positions, kc, vc, p.n_past, p.row0, p.vis, att, &a.wo, xq);
    }
    be.matmul(&a.wo, att, xq, t, o);
}

/// `o = Wout · GatedNorm(delta rule(conv(Wqkv·h)), silu(Wz·h))` over the batch: a chain advances the
/// state (chunked form, chunk boundaries at absolute multiples of [`GDN_CHUNK`], cut also where the
/// prefill's snapshot `capture` is due); a tree reads it and keeps its per-node values in `tree`.
#[allow(clippy::too_many_arguments)]
fn delta_net_mixer<B: Backend>(
    be: &B,
    p: &Pass,
    w: &DeltaNet<B>,
    conv: &mut B::Buf,
    rec: &mut B::Buf,
    tree: &mut GdnTree<B>,
    mut capture: SnapshotSlot<B>,
    ws: &mut Workspace<B>,
) {
    let (c, t) = (p.c, p.t);
    let s = c.gdn.expect("a GDN layer needs ModelConfig::gdn");
    let (cd, vd, hv) = (s.conv_dim(), s.value_dim(), s.n_v_heads);
    let Workspace { h, gate: gx, up: gc, gz, go, ga, gb, xq, o, parents, iota, .. } = ws;
    be.matmul(&w.w_qkv, h, xq, t, gx);
    be.matmul(&w.w_z, h, xq, t, gz);
    be.matmul(&w.w_b, h, xq, t, gb);
    be.matmul(&w.w_a, h, xq, t, ga);
    be.gdn_conv(&s, &w.conv, conv, gx, parents, gc);
    be.gdn_prepare(&s, gc, ga, gb, &w.a_neg, &w.dt_bias, t);
    if p.tree {
        if tree.rows < t {
            *tree = GdnTree { x: be.alloc(t * cd), c: be.alloc(t * cd), gamma: be.alloc(t * hv), u: be.alloc(t * vd), rows: t };
        }
        be.gdn_tree(&s, rec, gc, ga, gb, parents, &mut tree.gamma, &mut tree.u, go);
        be.copy(gx, &mut tree.x, t * cd);
        be.copy(gc, &mut tree.c, t * cd);
    } else if t == 1 && !capture.iter().any(|c| c.0 == p.n_past + 1) {
        // One token (the decode step): the fused recurrent step, the same values as a chunk of one row.
        if tree.rows < 1 {
            *tree = GdnTree { x: be.alloc(cd), c: be.alloc(cd), gamma: be.alloc(hv), u: be.alloc(vd), rows: 1 };
        }
        be.gdn_step(&s, rec, gc, ga, gb, &mut tree.gamma, &mut tree.u, go);
        be.gdn_conv_commit(&s, conv, gx, &iota[..1]);
    } else {
        // Chunk boundaries at absolute multiples of GDN_CHUNK, cut also where a snapshot is due (snapshots
        // sit on such boundaries, so the cuts change no value).
        let n_past = p.n_past;
        let due = |at: usize| at > n_past && at <= n_past + t;
        let lead = (GDN_CHUNK - n_past % GDN_CHUNK) % GDN_CHUNK;
        debug_assert!(capture.len() <= 2, "a pass fills at most two snapshots (its last boundary, the checkpoint)");
        let mut cuts = [0, t, lead, 0, 0];
        for (slot, &(at, _)) in cuts[3..].iter_mut().zip(capture.iter()) {
            if due(at) {
                *slot = at - n_past;
            }
        }
        cuts.sort_unstable();
        let mut prev = 0;
        for &cut in cuts.iter().filter(|&&x| x > 0 && x <= t) {
            if cut == prev {
                continue;
            }
            be.gdn_chunked(&s, rec, gc, ga, gb, prev..cut, GDN_CHUNK, go);
            for (_, (snap_conv, snap_rec)) in capture.iter_mut().filter(|c| due(c.0) && c.0 - n_past == cut) {
                be.copy(conv, snap_conv, s.conv_state_len());
                be.gdn_conv_commit(&s, snap_conv, gx, &iota[..cut]);
                be.copy(rec, snap_rec, s.state_len());
            }
            prev = cut;
        }
        be.gdn_conv_commit(&s, conv, gx, &iota[..t]);
    }
    be.gdn_gated_norm(go, gz, &w.norm, c.norm_eps, t * vd);
    be.quantize(go, t, vd, &w.w_out, xq);
    be.matmul(&w.w_out, go, xq, t, o);
}

/// The decoder blocks `layers` (plain attention mixers) of a model of shape `c` over the `t` rows of
/// `ws.x` at the positions `ws.positions`: each layer's K/V rows go to rows `row0..row0 + t` of its cache in
/// `kv` and its queries see the rows `vis` lets them (a DFlash draft block: [`Visibility::Block`]). The
/// residual stream is left in `ws.x`, every block's output added.
///
/// Panics if a state is not an attention layer's or the rows do not fit the workspace or the cache.
#[allow(clippy::too_many_arguments)]
pub(crate) fn blocks<B: Backend>(
    be: &B,
    c: &ModelConfig,
    layers: &[Layer<B>],
    kv: &mut [LayerState<B>],
    ws: &mut Workspace<B>,
    t: usize,
    row0: usize,
    vis: Visibility,
) {
    assert!(t <= ws.max_batch && ws.positions.len() == t, "blocks: {t} rows, {} positions, batch {}", ws.positions.len(), ws.max_batch);
    let p = Pass { c, t, n_past: row0, row0, vis, tree: false };
    for (l, (layer, st)) in layers.iter().zip(kv.iter_mut()).enumerate() {
        block(be, &p, layer, st, Vec::new(), ws, l > 0);
    }
    be.add(&mut ws.x, &ws.o, t * c.d_model);
}

/// Run the MTP head for `tokens.len()` steps: row i takes the next token `tokens[i]` and the hidden state
/// `hidden[i]` (`d_model` values, after the final norm: [`last_hidden`] of the main model, or the previous
/// MTP step's for chained drafting), at MTP positions `state.n_past()..` of the MTP block's own state (one
/// attention layer: [`SeqState::new`] with 1 layer). Appends the rows to that state, writes `vocab` logits
/// per row to `logits` (predictions two tokens ahead of the hidden state's position) and leaves the MTP
/// outputs h' in `state.hidden`.
///
/// Errors: no MTP head, a token outside the vocabulary, a hidden buffer of the wrong size, a full cache.
pub fn mtp_forward<B: Backend>(
    model: &Model<B>,
    be: &B,
    ws: &mut Workspace<B>,
    state: &mut SeqState<B>,
    tokens: &[u32],
    hidden: &[f32],
    logits: &mut Vec<f32>,
) -> Result<()> {
    let mtp = model.mtp.as_ref().ok_or_else(|| Error::Input("the model has no MTP head (no mtp.* / nextn tensors)".into()))?;
    check_tokens(model, tokens)?;
    let c = &model.config;
    let (t, d) = (tokens.len(), c.d_model);
    if hidden.len() != t * d {
        return Err(Error::Input(format!("MTP: {} hidden values for {t} tokens of width {d}", hidden.len())));
    }
    if !matches!(state.layers.as_slice(), [LayerState::Kv { .. }]) {
        return Err(Error::Input("MTP: the state must be one attention layer (SeqState::new with 1 layer)".into()));
    }
    state.check_room(t)?;
    logits.clear();
    ws.ids.clear();
    ws.cands.reset(0, 0);
    state.hidden.clear();
    for (toks, hs) in tokens.chunks(ws.max_batch).zip(hidden.chunks(ws.max_batch * d)) {
        let n = toks.len();
        let n_past = state.n_past();
        be.embed(&model.embed, toks, None, &mut ws.x);
        be.rms_norm(&ws.x, 0, n, &mtp.emb_norm, c.norm_eps, &mut ws.o);
        be.write(hs, &mut ws.h);
        be.rms_norm(&ws.h, 0, n, &mtp.hid_norm, c.norm_eps, &mut ws.h2);
        be.concat_rows(&ws.o, &ws.h2, n, d, &mut ws.cat);
        be.quantize(&ws.cat, n, 2 * d, &mtp.fc, &mut ws.xq);
        be.matmul(&mtp.fc, &ws.cat, &ws.xq, n, &mut ws.x);
        ws.positions.clear();
        ws.positions.extend(n_past..n_past + n);
        let p = Pass { c, t: n, n_past, row0: n_past, vis: Visibility::Causal, tree: false };
        block(be, &p, &mtp.layer, &mut state.layers[0], Vec::new(), ws, false);
        be.add(&mut ws.x, &ws.o, n * d);
        head(model, be, ws, state, &mtp.norm, n, 0..n, logits);
        state.tokens.extend_from_slice(toks);
    }
    Ok(())
}
