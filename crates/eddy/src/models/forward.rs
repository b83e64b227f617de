//! The forward pass shared by every decoder architecture.
//!
//! One function serves prefill (many tokens) and decode (one token): the batch is a run of tokens at
//! positions `n_past..n_past+T`. Per block (pre-norm, Xiong et al. 2020):
//!
//! ```text
//! h = norm(x);  q,k,v = Wq·h (+b), Wk·h (+b), Wv·h (+b);  q,k = qk_norm(q,k);  q,k = rope(q,k)
//! cache[n_past..] = k,v;  a = attention(q, cache);  o = Wo·a;  x += post_norm(o)
//! h = norm(x);  f = Wdown·(act(Wgate·h) ⊙ Wup·h);  x += post_norm(f)
//! ```
//! then `logits = W_lm · norm(x)` for the rows asked for. Activations are quantized to int8 once per
//! input (shared by q/k/v and by gate/up). All buffers live in a [`Workspace`] allocated once.

use super::Model;
use crate::backend::cpu::activation::gated_act;
use crate::backend::cpu::attention::{attention, AttnShape, Visibility};
use crate::backend::cpu::norm::{rms_norm, rms_norm_inplace};
use crate::backend::cpu::{matmul, quantize_activations, QuantizedActivations, ThreadPool};
use crate::error::{Error, Result};
use crate::state::{FeatureCapture, KvCache, SeqState};
use crate::tree::TreePaths;

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

/// Scratch buffers for a batch of up to `max_batch` tokens.
pub struct Workspace {
    /// Largest batch processed at once; longer inputs are split into chunks of this size.
    pub max_batch: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    xq: QuantizedActivations,
}

impl Workspace {
    /// Allocate for `model` and batches of up to `max_batch` tokens.
    pub fn new(model: &Model, max_batch: usize) -> Self {
        let c = &model.config;
        let z = |n: usize| vec![0f32; n * max_batch];
        Workspace {
            max_batch,
            x: z(c.d_model),
            h: z(c.d_model),
            q: z(c.q_dim()),
            k: z(c.kv_dim()),
            v: z(c.kv_dim()),
            att: z(c.q_dim()),
            o: z(c.d_model),
            gate: z(c.ffn_dim),
            up: z(c.ffn_dim),
            xq: QuantizedActivations::new(),
        }
    }
}

/// Run `tokens` through the model at positions `state.n_past()..`, append their K/V and the tokens to
/// `state`, and write logits (`vocab` floats per requested row, in batch order) into `logits`.
///
/// Errors: a token id outside the vocabulary, or a sequence longer than the KV cache.
pub fn forward(
    model: &Model,
    pool: &ThreadPool,
    ws: &mut Workspace,
    state: &mut SeqState,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) -> Result<()> {
    if let Some(m) = &model.qwen35 {
        return super::qwen35::forward_seq(m, pool, state, tokens, want, logits);
        // hybrid: its own forward
    }
    let vocab = model.config.vocab_size;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    state.check_room(tokens.len())?;
    logits.clear();
    state.capture.rows.clear();
    let n_chunks = tokens.len().div_ceil(ws.max_batch);
    for (ci, chunk) in tokens.chunks(ws.max_batch).enumerate() {
        let last_chunk = ci + 1 == n_chunks;
        let chunk_want = match want {
            Logits::All => Logits::All,
            Logits::Last if last_chunk => Logits::Last,
            _ => Logits::None,
        };
        let n_past = state.n_past();
        forward_chunk(model, pool, ws, &mut state.kv, &mut state.capture, n_past, chunk, Rows::Chain, chunk_want, logits);
        state.tokens.extend_from_slice(chunk);
    }
    Ok(())
}

/// How many leading tokens of `prompt` the committed sequence in `state` can keep (prefix cache): the
/// longest shared prefix, at most `prompt.len() − 1` (one token is always run, for the logits); for a hybrid
/// model (Qwen3.5), the longest shared prefix its GDN state can resume from exactly
/// ([`super::qwen35::Qwen35State::reusable_prefix`]). Prefilling the rest gives what a cold prefill gives.
pub fn reusable_prefix(model: &Model, state: &SeqState, prompt: &[u32]) -> usize {
    let limit = prompt.len().saturating_sub(1);
    let common = state.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
    match (&model.qwen35, &state.qwen35) {
        (Some(_), Some(h)) => h.state.reusable_prefix(prompt, common),
        (Some(_), None) => 0,
        _ => common,
    }
}

/// Verify pass over a token tree: run nodes `first..n` of the tree (`tokens[i]` is node `i`'s token,
/// `paths` its topology, see [`crate::tree`]) against the committed sequence in `state`, and append every
/// computed node's logits (`vocab` floats each, in node order) to `logits`.
///
/// Node `i` is at position `n_past + depth(i)` and its K/V go to the scratch row `n_past + i`, beyond the
/// committed rows: the committed state is only read. Nodes `0..first` must have been computed by an
/// earlier call on the same committed state (incremental drafting). After acceptance,
/// [`SeqState::commit_path`] moves the accepted nodes' K/V into place. Each node's logits are
/// bit-identical to those plain decoding computes at the same position (batch-invariant kernels).
///
/// Errors: a token id outside the vocabulary, `tokens.len() != paths.len()`, or a tree that does not fit
/// in the KV cache after the committed rows.
#[allow(clippy::too_many_arguments)]
pub fn forward_tree(
    model: &Model,
    pool: &ThreadPool,
    ws: &mut Workspace,
    state: &mut SeqState,
    tokens: &[u32],
    paths: &TreePaths,
    first: usize,
    logits: &mut Vec<f32>,
) -> Result<()> {
    if let Some(m) = &model.qwen35 {
        // Hybrid: its own tree verify (GDN layers by the ancestor-masked solve); whole trees only.
        if first != 0 {
            return Err(Error::Input("Qwen3.5 verifies whole token trees only (incremental drafting is not supported)".into()));
        }
        let parents: Vec<usize> = (0..paths.len())
            .map(|i| {
                let p = paths.path(i);
                if p.len() < 2 {
                    crate::tree::NO_PARENT
                } else {
                    p[p.len() - 2] as usize
                }
            })
            .collect();
        return super::qwen35::forward_tree_seq(m, pool, state, tokens, &parents, logits);
    }
    let vocab = model.config.vocab_size;
    if tokens.len() != paths.len() || first > tokens.len() {
        return Err(Error::Input(format!("token tree: {} tokens for {} nodes (from node {first})", tokens.len(), paths.len())));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    state.check_room(tokens.len())?;
    logits.clear();
    state.capture.rows.clear();
    let n_past = state.n_past();
    let mut start = first;
    while start < tokens.len() {
        let end = (start + ws.max_batch).min(tokens.len());
        let rows = Rows::Tree { first: start, paths };
        forward_chunk(model, pool, ws, &mut state.kv, &mut state.capture, n_past, &tokens[start..end], rows, Logits::All, logits);
        start = end;
    }
    Ok(())
}

/// The final-normed hidden states (`d_model` floats per row) of the last [`forward`] (its logit rows, or
/// every row when [`SeqState::want_hidden`] is set) or [`forward_tree`] (every node), for drafters that
/// run on the target's hidden states (Qwen3.5's MTP head). `None` for architectures without such a head
/// or before the first pass.
pub fn last_hidden(state: &SeqState) -> Option<&[f32]> {
    state.qwen35.as_ref().map(|h| h.ws.hidden())
}

/// Commit the accepted `path` (node indices, root first) of the last [`forward_tree`] on `state`: the
/// dense models compact K/V rows ([`SeqState::commit_path`]); Qwen3.5 also applies the path to its
/// recurrent states once.
///
/// Errors: a path that is not a root path of the verified tree (Qwen3.5).
pub fn commit_tree(model: &Model, pool: &ThreadPool, state: &mut SeqState, tokens: &[u32], path: &[usize]) -> Result<()> {
    if model.qwen35.is_some() {
        return super::qwen35::commit_seq(pool, state, tokens, path);
    }
    state.commit_path(tokens, path);
    Ok(())
}

/// Where a batch's rows sit: a chain at `n_past..`, or tree nodes `first..` (scratch rows `n_past + node`).
#[derive(Clone, Copy)]
enum Rows<'a> {
    Chain,
    Tree { first: usize, paths: &'a TreePaths },
}

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[allow(clippy::too_many_arguments)]
fn forward_chunk(
    model: &Model,
    pool: &ThreadPool,
    ws: &mut Workspace,
    kv: &mut KvCache,
    capture: &mut FeatureCapture,
    n_past: usize,
    tokens: &[u32],
    rows: Rows,
    want: Logits,
    logits: &mut Vec<f32>,
) {
    let c = &model.config;
    let t = tokens.len();
    let (d, qd, kvd, hd, fd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
    // First cache row written, RoPE position of each row, and what the attention sees.
    let (row0, vis) = match rows {
        Rows::Chain => (n_past, Visibility::Causal),
        Rows::Tree { first, paths } => (n_past + first, Visibility::Tree { first, paths }),
    };
    let position = |i: usize| match rows {
        Rows::Chain => n_past + i,
        Rows::Tree { first, paths } => n_past + paths.depth(first + i),
    };
    let Workspace { x, h, q, k, v, att, o, gate, up, xq, .. } = ws;
    let (x, h, q, k, v) = (&mut x[..t * d], &mut h[..t * d], &mut q[..t * qd], &mut k[..t * kvd], &mut v[..t * kvd]);
    let (att, o, gate, up) = (&mut att[..t * qd], &mut o[..t * d], &mut gate[..t * fd], &mut up[..t * fd]);

    capture.grow(t, d);
    for (i, &tok) in tokens.iter().enumerate() {
        let row = &mut x[i * d..(i + 1) * d];
        model.embed.dequant_row(tok as usize, row);
        if let Some(s) = c.embed_scale {
            row.iter_mut().for_each(|e| *e *= s);
        }
    }

    for (l, layer) in model.layers.iter().enumerate() {
        // Attention.
        rms_norm(x, &layer.attn_norm, c.norm_eps, h);
        quantize_activations(pool, h, t, d, xq);
        matmul(pool, &layer.wq, h, xq, t, q);
        matmul(pool, &layer.wk, h, xq, t, k);
        matmul(pool, &layer.wv, h, xq, t, v);
        add_bias(q, &layer.bq);
        add_bias(k, &layer.bk);
        add_bias(v, &layer.bv);
        if let Some(w) = &layer.q_norm {
            rms_norm_inplace(q, w, c.norm_eps);
        }
        if let Some(w) = &layer.k_norm {
            rms_norm_inplace(k, w, c.norm_eps);
        }
        for i in 0..t {
            let (qi, ki) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
            layer.rope.apply_all(&mut [qi, ki], hd, position(i));
        }
        let (kc, vc) = kv.layer_mut(l);
        kc[row0 * kvd..(row0 + t) * kvd].copy_from_slice(k);
        vc[row0 * kvd..(row0 + t) * kvd].copy_from_slice(v);
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            scale: c.attn_scale,
            window: layer.window,
            softcap: None,
        };
        attention(pool, &shape, q, kc, vc, n_past, t, vis, att);
        quantize_activations(pool, att, t, qd, xq);
        matmul(pool, &layer.wo, att, xq, t, o);
        if let Some(w) = &layer.post_attn_norm {
            rms_norm_inplace(o, w, c.norm_eps);
        }
        add_into(x, o);

        // Feed-forward.
        rms_norm(x, &layer.ffn_norm, c.norm_eps, h);
        quantize_activations(pool, h, t, d, xq);
        matmul(pool, &layer.w_gate, h, xq, t, gate);
        matmul(pool, &layer.w_up, h, xq, t, up);
        gated_act(c.activation, gate, up);
        quantize_activations(pool, gate, t, fd, xq);
        matmul(pool, &layer.w_down, gate, xq, t, o);
        if let Some(w) = &layer.post_ffn_norm {
            rms_norm_inplace(o, w, c.norm_eps);
        }
        add_into(x, o);
        capture.record(l, x, d);
    }

    let rows = match want {
        Logits::None => return,
        Logits::Last => t - 1..t,
        Logits::All => 0..t,
    };
    let n = rows.len();
    let hs = &mut h[..n * d];
    rms_norm(&x[rows.start * d..rows.end * d], &model.output_norm, c.norm_eps, hs);
    quantize_activations(pool, hs, n, d, xq);
    let start = logits.len();
    logits.resize(start + n * c.vocab_size, 0.0);
    let out = &mut logits[start..];
    matmul(pool, model.lm_head(), hs, xq, n, out);
    if let Some(cap) = c.final_softcap {
        out.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }
}
