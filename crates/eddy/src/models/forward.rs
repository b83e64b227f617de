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
use crate::backend::cpu::attention::{attention, AttnShape};
use crate::backend::cpu::norm::{rms_norm, rms_norm_inplace};
use crate::backend::cpu::{matmul, quantize_activations, QuantizedActivations, ThreadPool};
use crate::error::{Error, Result};
use crate::state::SeqState;

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
        return super::qwen35::forward_seq(m, pool, state, tokens, want, logits); // hybrid: its own forward
    }
    let vocab = model.config.vocab_size;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    state.check_room(tokens.len())?;
    logits.clear();
    let n_chunks = tokens.len().div_ceil(ws.max_batch);
    for (ci, chunk) in tokens.chunks(ws.max_batch).enumerate() {
        let last_chunk = ci + 1 == n_chunks;
        let chunk_want = match want {
            Logits::All => Logits::All,
            Logits::Last if last_chunk => Logits::Last,
            _ => Logits::None,
        };
        forward_chunk(model, pool, ws, state, chunk, chunk_want, logits);
    }
    Ok(())
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

fn forward_chunk(
    model: &Model,
    pool: &ThreadPool,
    ws: &mut Workspace,
    state: &mut SeqState,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) {
    let c = &model.config;
    let t = tokens.len();
    let (d, qd, kvd, hd, fd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
    let n_past = state.n_past();
    let Workspace { x, h, q, k, v, att, o, gate, up, xq, .. } = ws;
    let (x, h, q, k, v) = (&mut x[..t * d], &mut h[..t * d], &mut q[..t * qd], &mut k[..t * kvd], &mut v[..t * kvd]);
    let (att, o, gate, up) = (&mut att[..t * qd], &mut o[..t * d], &mut gate[..t * fd], &mut up[..t * fd]);

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
            layer.rope.apply_all(&mut [qi, ki], hd, n_past + i);
        }
        let (kc, vc) = state.kv.layer_mut(l);
        kc[n_past * kvd..(n_past + t) * kvd].copy_from_slice(k);
        vc[n_past * kvd..(n_past + t) * kvd].copy_from_slice(v);
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            scale: c.attn_scale,
            window: layer.window,
            softcap: None,
        };
        attention(pool, &shape, q, kc, vc, n_past, t, att);
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
    }
    state.tokens.extend_from_slice(tokens);

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
