//! Qwen3.5 hybrid decoder: Gated DeltaNet (GDN) layers and gated full-attention layers (usually three GDN
//! layers, then one attention layer), with its own per-sequence state ([`Qwen35State`]: KV cache rows for the
//! attention layers, conv window + fp32 recurrent state for the GDN layers), its own forward pass
//! ([`forward`] for prefill/decode, [`forward_tree`] + [`Qwen35State::commit`] for rollback-free tree
//! verification), and loaders for Hugging Face folders (`Qwen3_5ForCausalLM`, and the language model inside
//! `Qwen3_5ForConditionalGeneration`; the vision tower and `mtp.*` are skipped) and GGUF files (arch
//! `qwen35`, llama.cpp's tensor names and conventions), plus a GGUF exporter ([`export_gguf`]).
//!
//! Math (`../shared/research/algorithms.md` §1, §2; transformers `models/qwen3_5/modeling_qwen3_5.py`):
//! - block: `x += mixer(RMSNorm₁₊w(x)); x += down(silu(gate(h)) ⊙ up(h))` with `h = RMSNorm₁₊w(x)`; final
//!   `RMSNorm₁₊w`, LM head (tied to the embedding or not). Zero-centred norms are stored here with the 1
//!   added (as llama.cpp's converter stores them), so one RMSNorm kernel serves.
//! - gated attention: `q_proj` rows are per head `[q_h (head_dim), gate_h (head_dim)]`; q/k RMSNorm₁₊w per
//!   head; NeoX RoPE on the first `rope_dims` dims (text-only M-RoPE reduces to it); GQA softmax attention;
//!   `o ⊙ σ(gate)`; `o_proj`.
//! - GDN: `x = in_proj_qkv(h)` → causal depthwise conv (kernel 4, state = last 3 pre-conv inputs) → SiLU →
//!   split q|k|v, L2-normalised q, k (q also scaled by `d_k^−½`); `g = −exp(A_log)·softplus(in_proj_a(h) +
//!   dt_bias)`, `β = σ(in_proj_b(h))`; delta rule on an fp32 state per value head (see
//!   [`crate::backend::cpu::gdn`]); gated RMSNorm with `silu(in_proj_z(h))`; `out_proj`.
//!
//! Prefill runs the GDN layers in the chunked WY form, in chunks of [`GDN_CHUNK`] tokens whose boundaries sit
//! at absolute multiples of `GDN_CHUNK` (so a prefill computes the same values however the prompt was split
//! into calls); decode is a one-node tree ([`forward_tree`]). Activations are quantized to int8 for quantized
//! weights, as in the other models.
//!
//! Prefix cache: a GDN state cannot be rewound, so a prefill that starts from an exact state (empty, or a
//! snapshot) also saves the GDN states at its last chunk boundary before its last token
//! ([`Qwen35State`] keeps [`MAX_SNAPSHOTS`]). A later request sharing that prefix restores the snapshot and
//! prefills only the rest, computing exactly what a cold prefill computes (same chunk boundaries, same
//! kernels); states reached by decoding are never reused, as a cold prefill would compute them differently
//! (up to rounding).
//!
//! Tree verification: nodes `0..n` in topological order, `parents[0] = usize::MAX` (node 0 = the first token
//! not yet in the state), `parents[i] < i`; node i sits at position `n_past + depth(i)`. [`forward_tree`]
//! reads the committed state only: GDN layers solve all nodes at once with the ancestor-masked WY form (each
//! node's conv window taken from its ancestor chain), attention layers write node i's K/V to scratch row
//! `n_past + i` and let each node attend to the committed rows plus its ancestors. [`Qwen35State::commit`]
//! then applies the accepted root path once: a rank-|path| update of every GDN state, the conv windows set
//! from the path, the accepted K/V rows compacted to `n_past..n_past+|path|`.

use crate::backend::cpu::attention::{attention, AttnShape, Visibility};
use crate::backend::cpu::gdn::{self, GdnShape};
use crate::backend::cpu::norm::{rms_norm, rms_norm_inplace};
use crate::backend::cpu::rope::{Rope, RopeMode};
use crate::backend::cpu::{matmul, quantize_activations, QuantizedActivations, ThreadPool};
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, GgufValue};
use crate::model_dir::{Quant, Tensors, CONFIG_FILE};
use crate::models::forward::Logits;
use crate::quant::{import, WeightMatrix};
use crate::tree::TreePaths;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Tokens per chunk of the chunked GDN prefill (transformers uses 64 too).
pub const GDN_CHUNK: usize = 64;
/// GDN state snapshots kept per sequence for the prefix cache (each `Σ (state + conv window)` of the GDN
/// layers: 19 MiB for the 0.8B shape).
pub const MAX_SNAPSHOTS: usize = 4;
/// GGUF architecture name.
pub const GGUF_ARCH: &str = "qwen35";

/// Hyper-parameters of a Qwen3.5 text model.
#[derive(Debug, Clone)]
pub struct Qwen35Config {
    /// Decoder blocks.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// MLP inner width.
    pub ffn_dim: usize,
    /// Embedding rows.
    pub vocab_size: usize,
    /// Training context.
    pub train_ctx: usize,
    /// RMSNorm epsilon (all norms).
    pub norm_eps: f32,
    /// Attention query heads.
    pub n_heads: usize,
    /// Attention key/value heads.
    pub n_kv_heads: usize,
    /// Attention head dimension (256 in the released models).
    pub head_dim: usize,
    /// Rotated dims per head (partial RoPE: 64 of 256).
    pub rope_dims: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// Per layer: full attention (true) or Gated DeltaNet (false).
    pub attention_layers: Vec<bool>,
    /// Shape of the GDN layers.
    pub gdn: GdnShape,
    /// LM head tied to the embedding.
    pub tie_embeddings: bool,
}

impl Qwen35Config {
    /// `n_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.gdn.check()?;
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
            || self.rope_dims > 512
        {
            return Err(format!(
                "inconsistent attention shape: {} heads, {} kv heads, head_dim {}, rope dims {}",
                self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dims
            ));
        }
        if self.attention_layers.len() != self.n_layers || self.n_layers == 0 || self.vocab_size == 0 {
            return Err(format!("{} layer types for {} layers (vocab {})", self.attention_layers.len(), self.n_layers, self.vocab_size));
        }
        for (what, v) in [
            ("hidden_size", self.d_model),
            ("intermediate_size", self.ffn_dim),
            ("q dim", self.q_dim()),
            ("GDN value dim", self.gdn.value_dim()),
        ] {
            if v == 0 || v % 32 != 0 {
                return Err(format!("unsupported shape: {what} {v} must be a positive multiple of 32"));
            }
        }
        Ok(())
    }
}

/// Weights of a gated full-attention mixer.
pub struct GatedAttention {
    /// `2·q_dim × d_model`, rows per head `[q_h, gate_h]`.
    pub wq: WeightMatrix,
    /// `kv_dim × d_model`.
    pub wk: WeightMatrix,
    /// `kv_dim × d_model`.
    pub wv: WeightMatrix,
    /// Per-head q norm (`head_dim`, 1 + w).
    pub q_norm: Vec<f32>,
    /// Per-head k norm (`head_dim`, 1 + w).
    pub k_norm: Vec<f32>,
    /// `d_model × q_dim`.
    pub wo: WeightMatrix,
}

/// Weights of a Gated DeltaNet mixer.
pub struct DeltaNet {
    /// `conv_dim × d_model` (`in_proj_qkv`).
    pub w_qkv: WeightMatrix,
    /// `value_dim × d_model` (`in_proj_z`).
    pub w_z: WeightMatrix,
    /// `n_v_heads × d_model` (`in_proj_b`).
    pub w_b: WeightMatrix,
    /// `n_v_heads × d_model` (`in_proj_a`).
    pub w_a: WeightMatrix,
    /// Depthwise conv, tap-major: `kernel × conv_dim` (see [`gdn::conv_taps`]).
    pub conv: Vec<f32>,
    /// `−exp(A_log)`, per value head.
    pub a_neg: Vec<f32>,
    /// `dt_bias`, per value head.
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight (`d_v`, plain w).
    pub norm: Vec<f32>,
    /// `d_model × value_dim` (`out_proj`).
    pub w_out: WeightMatrix,
}

/// The token mixer of a block (one per layer, so the size difference of the variants does not matter).
#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    /// Gated full attention.
    Attention(GatedAttention),
    /// Gated DeltaNet.
    DeltaNet(DeltaNet),
}

/// One decoder block.
pub struct Qwen35Layer {
    /// Norm before the mixer (`d_model`, 1 + w).
    pub attn_norm: Vec<f32>,
    /// Mixer.
    pub mixer: Mixer,
    /// Norm before the MLP (`d_model`, 1 + w).
    pub ffn_norm: Vec<f32>,
    /// `ffn × d_model`.
    pub w_gate: WeightMatrix,
    /// `ffn × d_model`.
    pub w_up: WeightMatrix,
    /// `d_model × ffn`.
    pub w_down: WeightMatrix,
}

/// A loaded Qwen3.5 text model.
pub struct Qwen35Model {
    /// Hyper-parameters.
    pub config: Qwen35Config,
    /// `vocab × d_model`.
    pub embed: WeightMatrix,
    /// Blocks.
    pub layers: Vec<Qwen35Layer>,
    /// Final norm (1 + w).
    pub output_norm: Vec<f32>,
    /// Untied LM head.
    pub output: Option<WeightMatrix>,
    /// RoPE of the attention layers.
    pub rope: Rope,
    /// Multi-token-prediction head, when the checkpoint ships one (`mtp.*`).
    pub mtp: Option<Mtp>,
}

/// The multi-token-prediction head of Qwen3.5 checkpoints (vLLM's `Qwen3_5MultiTokenPredictor`; algorithms.md
/// §6): for the hidden state `h_t` (after the final norm) and the next token `x_{t+1}`,
/// `z = fc([RMSNorm₁₊w(embed(x_{t+1})) ; RMSNorm₁₊w(h_t)])`, one full-attention decoder block with its own KV
/// cache, `h' = RMSNorm₁₊w(z)`, logits for `x_{t+2}` = LM head(h'); chained by feeding `h'` as the next `h`.
pub struct Mtp {
    /// Norm of the token embedding (`d_model`, 1 + w).
    pub emb_norm: Vec<f32>,
    /// Norm of the hidden state (`d_model`, 1 + w).
    pub hid_norm: Vec<f32>,
    /// `d_model × 2·d_model`: embedding half first, then the hidden half.
    pub fc: WeightMatrix,
    /// The full-attention block.
    pub layer: Qwen35Layer,
    /// Final norm (1 + w).
    pub norm: Vec<f32>,
}

impl Qwen35Model {
    /// The LM head (the embedding when tied).
    pub fn lm_head(&self) -> &WeightMatrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights one decode step streams (every matrix once, the LM head included).
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.lm_head().nbytes();
        for l in &self.layers {
            n += l.w_gate.nbytes() + l.w_up.nbytes() + l.w_down.nbytes();
            n += match &l.mixer {
                Mixer::Attention(a) => a.wq.nbytes() + a.wk.nbytes() + a.wv.nbytes() + a.wo.nbytes(),
                Mixer::DeltaNet(g) => g.w_qkv.nbytes() + g.w_z.nbytes() + g.w_a.nbytes() + g.w_b.nbytes() + g.w_out.nbytes(),
            };
        }
        n
    }

    /// Every matrix a forward pass multiplies by (MTP head included; the embedding only as the tied head).
    pub fn matmul_weights_mut(&mut self) -> Vec<&mut WeightMatrix> {
        let mut v: Vec<&mut WeightMatrix> = vec![match &mut self.output {
            Some(o) => o,
            None => &mut self.embed,
        }];
        let mtp = self.mtp.as_mut().map(|m| {
            v.push(&mut m.fc);
            &mut m.layer
        });
        for l in self.layers.iter_mut().chain(mtp) {
            v.extend([&mut l.w_gate, &mut l.w_up, &mut l.w_down]);
            match &mut l.mixer {
                Mixer::Attention(a) => v.extend([&mut a.wq, &mut a.wk, &mut a.wv, &mut a.wo]),
                Mixer::DeltaNet(g) => v.extend([&mut g.w_qkv, &mut g.w_z, &mut g.w_b, &mut g.w_a, &mut g.w_out]),
            }
        }
        v
    }

    /// Build the prepacked layout of every quantized matmul weight when
    /// [`crate::backend::cpu::prepack_wanted`] (the loaders call this).
    pub fn prepack(&mut self) {
        if crate::backend::cpu::prepack_wanted() {
            crate::quant::prepack_all(self.matmul_weights_mut());
        }
    }

    /// Load a Hugging Face folder (`config.json` + safetensors); matrices stored per `quant` like
    /// [`crate::model_dir::load_model`]. Errors name the file: unsupported config, missing tensor, wrong shape.
    pub fn load_dir(dir: &Path, quant: Quant) -> Result<Qwen35Model> {
        let cfg_path = dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
        let top: Value = serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?;
        let config = config_from_hf(&top).map_err(|m| Error::model(&cfg_path, m))?;
        let t = Tensors::open(dir)?;
        let prefix = ["model.language_model.", "model.", "language_model.model."]
            .into_iter()
            .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::model(&t.listing, "missing tensor model.embed_tokens.weight"))?;
        HfLoader { t: &t, quant, pre: prefix }.load(config.clone())
    }

    /// Load a GGUF file of architecture `qwen35` (llama.cpp's names; norms stored as 1 + w, `ssm_a` = −exp(A_log),
    /// value heads tiled over key heads).
    pub fn from_gguf(g: &GgufFile) -> Result<Qwen35Model> {
        let config = config_from_gguf(g)?;
        GgufLoader { g, n_layers: config.n_layers }.load(config.clone())
    }

    /// [`Qwen35Model::from_gguf`] on a path.
    pub fn from_gguf_path(path: &Path) -> Result<Qwen35Model> {
        Self::from_gguf(&GgufFile::open(path)?)
    }
}

impl Qwen35Model {
    /// Wrap into the engine's [`crate::models::Model`] (placeholders plus this model in `qwen35`; see there).
    pub fn into_model(self) -> crate::models::Model {
        crate::models::Model {
            config: summary_config(&self.config),
            embed: WeightMatrix::F32 { rows: 0, cols: 0, data: Vec::new() },
            layers: Vec::new(),
            output_norm: Vec::new(),
            output: None,
            qwen35: Some(Box::new(self)),
        }
    }
}

/// The engine-facing summary of a Qwen3.5 config: the attention shape and sizes, `n_layers` 0 (the engine
/// allocates no KV cache of its own; [`HybridSeq`] holds the state).
pub fn summary_config(c: &Qwen35Config) -> crate::models::ModelConfig {
    crate::models::ModelConfig {
        arch: crate::models::Arch::Qwen35,
        n_layers: 0,
        d_model: c.d_model,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        ffn_dim: c.ffn_dim,
        vocab_size: c.vocab_size,
        train_ctx: c.train_ctx,
        norm_eps: c.norm_eps,
        rope_mode: RopeMode::Neox,
        rope_dims: c.rope_dims,
        rope_theta: c.rope_theta,
        rope_scale: 1.0,
        rope_theta_local: c.rope_theta,
        attn_scale: 1.0 / (c.head_dim as f32).sqrt(),
        sliding_window: None,
        sliding_pattern: 0,
        embed_scale: None,
        activation: crate::backend::cpu::activation::Activation::Silu,
        post_norms: false,
        final_softcap: None,
    }
}

/// [`summary_config`] of a GGUF file of architecture `qwen35`.
pub fn summary_config_from_gguf(g: &GgufFile) -> Result<crate::models::ModelConfig> {
    Ok(summary_config(&config_from_gguf(g)?))
}

/// [`summary_config`] of a Hugging Face folder's `config.json`.
pub fn summary_config_from_dir(dir: &Path) -> Result<crate::models::ModelConfig> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
    let top: Value = serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?;
    Ok(summary_config(&config_from_hf(&top).map_err(|m| Error::model(&cfg_path, m))?))
}

/// A sequence of a Qwen3.5 model inside the engine's [`crate::state::SeqState`]: state and scratch.
pub struct HybridSeq {
    /// Caches and recurrent states.
    pub state: Qwen35State,
    /// Scratch buffers.
    pub ws: Qwen35Workspace,
}

/// The sequence's [`HybridSeq`] (created on first use with the sequence's context length), holding exactly
/// the committed tokens: the GDN state cannot be rewound, so when the engine has cleared or changed them the
/// hybrid state restores its longest valid prefix snapshot ([`Qwen35State::restore_prefix`]) and re-runs
/// the tokens after it.
fn synced<'a>(model: &Qwen35Model, pool: &ThreadPool, seq: &'a mut crate::state::SeqState) -> Result<&'a mut HybridSeq> {
    let ctx = seq.kv.ctx;
    let h = seq
        .qwen35
        .get_or_insert_with(|| Box::new(HybridSeq { state: Qwen35State::new(&model.config, ctx), ws: Qwen35Workspace::new(256) }));
    if h.state.tokens != seq.tokens {
        let have = h.state.restore_prefix(&seq.tokens);
        if have < seq.tokens.len() {
            let mut scratch = Vec::new();
            forward(model, pool, &mut h.ws, &mut h.state, &seq.tokens[have..], Logits::None, &mut scratch)?;
        }
    }
    Ok(h)
}

/// The engine's entry point for Qwen3.5 (called by [`crate::models::forward()`]): runs `tokens` on the
/// sequence's [`HybridSeq`] (created on first use with the sequence's context length) and appends them to
/// `seq.tokens`. The GDN state cannot be rewound, so when the engine has cleared or changed the committed
/// tokens the hybrid state restores a snapshot (or restarts) and re-runs the tokens after it.
pub fn forward_seq(
    model: &Qwen35Model,
    pool: &ThreadPool,
    seq: &mut crate::state::SeqState,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let want_hidden = seq.want_hidden;
    let h = synced(model, pool, seq)?;
    h.ws.all_hidden = want_hidden;
    let r = forward(model, pool, &mut h.ws, &mut h.state, tokens, want, logits);
    h.ws.all_hidden = false;
    r?;
    seq.tokens.extend_from_slice(tokens);
    Ok(())
}

/// The engine's tree verify for Qwen3.5 ([`crate::models::forward::forward_tree`] hands off here): syncs the
/// sequence's [`HybridSeq`] with the committed tokens like [`forward_seq`], then runs [`forward_tree`].
pub fn forward_tree_seq(
    model: &Qwen35Model,
    pool: &ThreadPool,
    seq: &mut crate::state::SeqState,
    tokens: &[u32],
    parents: &[usize],
    logits: &mut Vec<f32>,
) -> Result<()> {
    let h = synced(model, pool, seq)?;
    forward_tree(model, pool, &mut h.ws, &mut h.state, tokens, parents, logits)
}

/// Commit the accepted `path` of the last [`forward_tree_seq`]: the hybrid state applies it once, and the
/// path's tokens join the sequence's committed tokens.
///
/// Errors: no verified tree pending, or a path that is not a root path of it.
pub fn commit_seq(pool: &ThreadPool, seq: &mut crate::state::SeqState, tokens: &[u32], path: &[usize]) -> Result<()> {
    let h = seq.qwen35.as_mut().ok_or_else(|| Error::Input("commit without a verified tree".into()))?;
    h.state.commit(pool, path)?;
    seq.tokens.extend(path.iter().map(|&i| tokens[i]));
    Ok(())
}

/// Whether a Hugging Face folder holds a Qwen3.5 model (`model_type` `qwen3_5` / `qwen3_5_text`).
pub fn is_qwen35_dir(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(CONFIG_FILE)) else { return false };
    let Ok(v) = serde_json::from_str::<Value>(&text) else { return false };
    matches!(v.get("model_type").and_then(Value::as_str), Some("qwen3_5" | "qwen3_5_text"))
}

// ---------------------------------------------------------------------------------------------------------
// Configuration

fn config_from_hf(top: &Value) -> std::result::Result<Qwen35Config, String> {
    let mt = top.get("model_type").and_then(Value::as_str).unwrap_or("");
    let classes: Vec<&str> =
        top.get("architectures").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let nested = match mt {
        "qwen3_5" => true,
        "qwen3_5_text" => false,
        "" if classes.contains(&"Qwen3_5ForConditionalGeneration") => true,
        "" if classes.contains(&"Qwen3_5ForCausalLM") => false,
        other => return Err(format!("not a Qwen3.5 dense model (model_type '{other}', architectures {classes:?})")),
    };
    let t = if nested { top.get("text_config").ok_or("model_type qwen3_5 without a text_config")? } else { top };
    let us = |k: &str, d: usize| -> std::result::Result<usize, String> {
        match t.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or(format!("{k} is not a non-negative integer")),
        }
    };
    let fl = |k: &str, d: f64| t.get(k).and_then(Value::as_f64).unwrap_or(d);
    if let Some(a) = t.get("hidden_act").and_then(Value::as_str) {
        if a != "silu" && a != "swish" {
            return Err(format!("unsupported activation '{a}'"));
        }
    }
    if t.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err("attention biases (attention_bias) are not supported".into());
    }
    if t.get("attn_output_gate").and_then(Value::as_bool) == Some(false) {
        return Err("attention without the output gate (attn_output_gate false) is not supported".into());
    }
    let n_layers = us("num_hidden_layers", 32)?;
    let attention_layers: Vec<bool> = match t.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|x| match x.as_str() {
                Some("full_attention") => Ok(true),
                Some("linear_attention") => Ok(false),
                other => Err(format!("unsupported layer type {other:?}")),
            })
            .collect::<std::result::Result<_, _>>()?,
        None => {
            let every = us("full_attention_interval", 4)?.max(1);
            (0..n_layers).map(|l| (l + 1) % every == 0).collect()
        }
    };
    let head_dim = us("head_dim", 256)?;
    let rp = t.get("rope_parameters").filter(|v| v.is_object());
    if let Some(ty) = rp.and_then(|p| p.get("rope_type")).and_then(Value::as_str) {
        if ty != "default" {
            return Err(format!("unsupported RoPE type '{ty}'"));
        }
    }
    let theta = rp.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).unwrap_or(fl("rope_theta", 10_000.0));
    let prf = rp.and_then(|p| p.get("partial_rotary_factor")).and_then(Value::as_f64).unwrap_or(fl("partial_rotary_factor", 0.25));
    let tie = if nested { top.get("tie_word_embeddings").or(t.get("tie_word_embeddings")) } else { t.get("tie_word_embeddings") };
    let c = Qwen35Config {
        n_layers,
        d_model: us("hidden_size", 4096)?,
        ffn_dim: us("intermediate_size", 12288)?,
        vocab_size: us("vocab_size", 248_320)?,
        train_ctx: us("max_position_embeddings", 32768)?,
        norm_eps: fl("rms_norm_eps", 1e-6) as f32,
        n_heads: us("num_attention_heads", 16)?,
        n_kv_heads: us("num_key_value_heads", 4)?,
        head_dim,
        rope_dims: (head_dim as f64 * prf) as usize,
        rope_theta: theta as f32,
        attention_layers,
        gdn: GdnShape {
            n_k_heads: us("linear_num_key_heads", 16)?,
            n_v_heads: us("linear_num_value_heads", 32)?,
            d_k: us("linear_key_head_dim", 128)?,
            d_v: us("linear_value_head_dim", 128)?,
            kernel: us("linear_conv_kernel_dim", 4)?,
            v_tiled: false,
        },
        tie_embeddings: tie.and_then(Value::as_bool).unwrap_or(false),
    };
    c.check()?;
    Ok(c)
}

fn config_from_gguf(g: &GgufFile) -> Result<Qwen35Config> {
    let arch = g.architecture()?;
    if arch != GGUF_ARCH {
        return Err(Error::model(&g.path, format!("architecture '{arch}' is not {GGUF_ARCH}")));
    }
    let u = |k: &str| -> Result<usize> { Ok(g.require_u64(&format!("{GGUF_ARCH}.{k}"))? as usize) };
    let f = |k: &str, d: f64| -> Result<f64> {
        let key = format!("{GGUF_ARCH}.{k}");
        if g.get(&key).is_some() {
            g.require_f64(&key)
        } else {
            Ok(d)
        }
    };
    let mtp = match g.get(&format!("{GGUF_ARCH}.nextn_predict_layers")) {
        Some(_) => u("nextn_predict_layers")?,
        None => 0,
    };
    let n_layers = u("block_count")?.checked_sub(mtp).ok_or_else(|| Error::model(&g.path, "nextn_predict_layers exceeds block_count"))?;
    let every = u("full_attention_interval")?.max(1);
    let head_dim = u("attention.key_length")?;
    let n_v_heads = u("ssm.time_step_rank")?;
    let vocab = g
        .tensor("token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .ok_or_else(|| Error::model(&g.path, "missing tensor token_embd.weight"))? as usize;
    let c = Qwen35Config {
        n_layers,
        d_model: u("embedding_length")?,
        ffn_dim: u("feed_forward_length")?,
        vocab_size: vocab,
        train_ctx: u("context_length")?,
        norm_eps: f("attention.layer_norm_rms_epsilon", 1e-6)? as f32,
        n_heads: u("attention.head_count")?,
        n_kv_heads: u("attention.head_count_kv")?,
        head_dim,
        rope_dims: u("rope.dimension_count")?,
        rope_theta: f("rope.freq_base", 10_000.0)? as f32,
        attention_layers: (0..n_layers).map(|l| (l + 1) % every == 0).collect(),
        gdn: GdnShape {
            n_k_heads: u("ssm.group_count")?,
            n_v_heads,
            d_k: u("ssm.state_size")?,
            d_v: u("ssm.inner_size")? / n_v_heads.max(1),
            kernel: u("ssm.conv_kernel")?,
            v_tiled: true,
        },
        tie_embeddings: g.tensor("output.weight").is_none(),
    };
    c.check().map_err(|m| Error::model(&g.path, m))?;
    Ok(c)
}

// ---------------------------------------------------------------------------------------------------------
// Loading

/// What a loader provides; the assembly of [`Qwen35Model`] is shared.
trait Source {
    /// A `rows × cols` matrix; `vocab` marks the embedding / LM head.
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, vocab: bool) -> Result<WeightMatrix>;
    /// A vector of `n` values (any stored shape with `n` elements).
    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>>;
    /// Whether a tensor exists.
    fn has(&self, name: &str) -> bool;
    /// Names, in the source's convention, by role (`l` = layer).
    fn name(&self, role: Role, l: usize) -> String;
    /// Zero-centred norms stored as w (HF: add 1) or as 1 + w (GGUF).
    fn norm_offset(&self) -> f32;
    /// A_log (HF) or −exp(A_log) (GGUF).
    fn a_is_log(&self) -> bool;

    fn norm(&mut self, role: Role, l: usize, n: usize) -> Result<Vec<f32>> {
        let off = self.norm_offset();
        let mut w = self.vector(&self.name(role, l), n)?;
        w.iter_mut().for_each(|v| *v += off);
        Ok(w)
    }

    /// Block `l` (or the MTP block, `l` = [`MTP_LAYER`]) with an attention or a GDN mixer.
    fn layer(&mut self, c: &Qwen35Config, l: usize, attention: bool) -> Result<Qwen35Layer> {
        let (d, qd, kvd, hd, fd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
        let s = c.gdn;
        let attn_norm = self.norm(Role::AttnNorm, l, d)?;
        let mixer = if attention {
            Mixer::Attention(GatedAttention {
                wq: self.matrix(&self.name(Role::Q, l), 2 * qd, d, false)?,
                wk: self.matrix(&self.name(Role::K, l), kvd, d, false)?,
                wv: self.matrix(&self.name(Role::V, l), kvd, d, false)?,
                q_norm: self.norm(Role::QNorm, l, hd)?,
                k_norm: self.norm(Role::KNorm, l, hd)?,
                wo: self.matrix(&self.name(Role::O, l), d, qd, false)?,
            })
        } else {
            let mut a = self.vector(&self.name(Role::ALog, l), s.n_v_heads)?;
            if self.a_is_log() {
                a.iter_mut().for_each(|v| *v = -v.exp());
            }
            Mixer::DeltaNet(DeltaNet {
                w_qkv: self.matrix(&self.name(Role::Qkv, l), s.conv_dim(), d, false)?,
                w_z: self.matrix(&self.name(Role::Z, l), s.value_dim(), d, false)?,
                w_b: self.matrix(&self.name(Role::B, l), s.n_v_heads, d, false)?,
                w_a: self.matrix(&self.name(Role::A, l), s.n_v_heads, d, false)?,
                conv: gdn::conv_taps(&self.vector(&self.name(Role::Conv, l), s.conv_dim() * s.kernel)?, s.kernel),
                a_neg: a,
                dt_bias: self.vector(&self.name(Role::DtBias, l), s.n_v_heads)?,
                norm: self.vector(&self.name(Role::GdnNorm, l), s.d_v)?,
                w_out: self.matrix(&self.name(Role::Out, l), d, s.value_dim(), false)?,
            })
        };
        Ok(Qwen35Layer {
            attn_norm,
            mixer,
            ffn_norm: self.norm(Role::FfnNorm, l, d)?,
            w_gate: self.matrix(&self.name(Role::Gate, l), fd, d, false)?,
            w_up: self.matrix(&self.name(Role::Up, l), fd, d, false)?,
            w_down: self.matrix(&self.name(Role::Down, l), d, fd, false)?,
        })
    }

    fn load(&mut self, c: Qwen35Config) -> Result<Qwen35Model> {
        let d = c.d_model;
        let embed = self.matrix(&self.name(Role::Embed, 0), c.vocab_size, d, true)?;
        let layers = (0..c.n_layers).map(|l| self.layer(&c, l, c.attention_layers[l])).collect::<Result<Vec<_>>>()?;
        let output_norm = self.norm(Role::OutputNorm, 0, d)?;
        let head = self.name(Role::Head, 0);
        let output = if c.tie_embeddings && !self.has(&head) { None } else { Some(self.matrix(&head, c.vocab_size, d, true)?) };
        let mtp = if self.has(&self.name(Role::MtpFc, 0)) {
            Some(Mtp {
                emb_norm: self.norm(Role::MtpEmbNorm, 0, d)?,
                hid_norm: self.norm(Role::MtpHidNorm, 0, d)?,
                fc: self.matrix(&self.name(Role::MtpFc, 0), d, 2 * d, false)?,
                layer: self.layer(&c, MTP_LAYER, true)?,
                norm: self.norm(Role::MtpNorm, 0, d)?,
            })
        } else {
            None
        };
        let rope = Rope::new(RopeMode::Neox, c.rope_dims, c.rope_theta, 1.0);
        let mut m = Qwen35Model { config: c, embed, layers, output_norm, output, rope, mtp };
        m.prepack();
        Ok(m)
    }
}

/// Layer index that names the MTP block's tensors.
const MTP_LAYER: usize = usize::MAX;

/// Tensor roles, named per source by [`Source::name`].
#[derive(Clone, Copy)]
enum Role {
    MtpEmbNorm,
    MtpHidNorm,
    MtpFc,
    MtpNorm,
    Embed,
    Head,
    OutputNorm,
    AttnNorm,
    FfnNorm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    Qkv,
    Z,
    A,
    B,
    Conv,
    ALog,
    DtBias,
    GdnNorm,
    Out,
    Gate,
    Up,
    Down,
}

struct HfLoader<'a> {
    t: &'a Tensors,
    quant: Quant,
    pre: &'static str,
}

impl Source for HfLoader<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, vocab: bool) -> Result<WeightMatrix> {
        self.t.matrix(name, rows, cols, self.quant, vocab)
    }
    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let shape = self.t.shape(name).ok_or_else(|| Error::model(&self.t.listing, format!("missing tensor {name}")))?;
        if shape.iter().product::<usize>() != n {
            return Err(Error::model(&self.t.listing, format!("tensor {name} has shape {shape:?}, expected {n} values")));
        }
        self.t.f32_tensor(name, &shape)
    }
    fn has(&self, name: &str) -> bool {
        self.t.contains(name)
    }
    fn name(&self, role: Role, l: usize) -> String {
        let p = self.pre;
        let lyr = |s: &str| if l == MTP_LAYER { format!("mtp.layers.0.{s}") } else { format!("{p}layers.{l}.{s}") };
        match role {
            Role::MtpEmbNorm => "mtp.pre_fc_norm_embedding.weight".into(),
            Role::MtpHidNorm => "mtp.pre_fc_norm_hidden.weight".into(),
            Role::MtpFc => "mtp.fc.weight".into(),
            Role::MtpNorm => "mtp.norm.weight".into(),
            Role::Embed => format!("{p}embed_tokens.weight"),
            Role::Head => {
                // ForCausalLM: lm_head.weight; ForConditionalGeneration: lm_head.weight at the top as well.
                if self.t.contains("lm_head.weight") || !self.t.contains("language_model.lm_head.weight") {
                    "lm_head.weight".into()
                } else {
                    "language_model.lm_head.weight".into()
                }
            }
            Role::OutputNorm => format!("{p}norm.weight"),
            Role::AttnNorm => lyr("input_layernorm.weight"),
            Role::FfnNorm => lyr("post_attention_layernorm.weight"),
            Role::Q => lyr("self_attn.q_proj.weight"),
            Role::K => lyr("self_attn.k_proj.weight"),
            Role::V => lyr("self_attn.v_proj.weight"),
            Role::O => lyr("self_attn.o_proj.weight"),
            Role::QNorm => lyr("self_attn.q_norm.weight"),
            Role::KNorm => lyr("self_attn.k_norm.weight"),
            Role::Qkv => lyr("linear_attn.in_proj_qkv.weight"),
            Role::Z => lyr("linear_attn.in_proj_z.weight"),
            Role::A => lyr("linear_attn.in_proj_a.weight"),
            Role::B => lyr("linear_attn.in_proj_b.weight"),
            Role::Conv => lyr("linear_attn.conv1d.weight"),
            Role::ALog => lyr("linear_attn.A_log"),
            Role::DtBias => lyr("linear_attn.dt_bias"),
            Role::GdnNorm => lyr("linear_attn.norm.weight"),
            Role::Out => lyr("linear_attn.out_proj.weight"),
            Role::Gate => lyr("mlp.gate_proj.weight"),
            Role::Up => lyr("mlp.up_proj.weight"),
            Role::Down => lyr("mlp.down_proj.weight"),
        }
    }
    fn norm_offset(&self) -> f32 {
        1.0
    }
    fn a_is_log(&self) -> bool {
        true
    }
}

struct GgufLoader<'a> {
    g: &'a GgufFile,
    /// Decoder blocks (the MTP block, when present, is block `n_layers`).
    n_layers: usize,
}

impl Source for GgufLoader<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, _vocab: bool) -> Result<WeightMatrix> {
        let info = self.g.tensor(name).ok_or_else(|| Error::model(&self.g.path, format!("missing tensor {name}")))?;
        if info.dims != [cols as u64, rows as u64] {
            return Err(Error::model(&self.g.path, format!("tensor {name} has shape {:?}, expected {:?}", info.dims, [cols, rows])));
        }
        import::import_matrix(&self.g.path, info, self.g.tensor_data(info)?)
    }
    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let info = self.g.tensor(name).ok_or_else(|| Error::model(&self.g.path, format!("missing tensor {name}")))?;
        if info.n_elements() != n as u64 {
            return Err(Error::model(&self.g.path, format!("tensor {name} has shape {:?}, expected {n} values", info.dims)));
        }
        import::dequantize(&self.g.path, info, self.g.tensor_data(info)?)
    }
    fn has(&self, name: &str) -> bool {
        self.g.tensor(name).is_some()
    }
    fn name(&self, role: Role, l: usize) -> String {
        gguf_name(role, if l == MTP_LAYER { self.n_layers } else { l }, self.n_layers)
    }
    fn norm_offset(&self) -> f32 {
        0.0
    }
    fn a_is_log(&self) -> bool {
        false
    }
}

/// llama.cpp's name of a tensor (`n_layers`: where the MTP block sits, as `blk.{n_layers}.nextn.*` and the
/// usual block tensors).
fn gguf_name(role: Role, l: usize, n_layers: usize) -> String {
    let lyr = |s: &str| format!("blk.{l}.{s}");
    let mtp = |s: &str| format!("blk.{n_layers}.nextn.{s}");
    match role {
        Role::MtpEmbNorm => mtp("enorm.weight"),
        Role::MtpHidNorm => mtp("hnorm.weight"),
        Role::MtpFc => mtp("eh_proj.weight"),
        Role::MtpNorm => mtp("shared_head_norm.weight"),
        Role::Embed => "token_embd.weight".into(),
        Role::Head => "output.weight".into(),
        Role::OutputNorm => "output_norm.weight".into(),
        Role::AttnNorm => lyr("attn_norm.weight"),
        Role::FfnNorm => lyr("post_attention_norm.weight"),
        Role::Q => lyr("attn_q.weight"),
        Role::K => lyr("attn_k.weight"),
        Role::V => lyr("attn_v.weight"),
        Role::O => lyr("attn_output.weight"),
        Role::QNorm => lyr("attn_q_norm.weight"),
        Role::KNorm => lyr("attn_k_norm.weight"),
        Role::Qkv => lyr("attn_qkv.weight"),
        Role::Z => lyr("attn_gate.weight"),
        Role::A => lyr("ssm_alpha.weight"),
        Role::B => lyr("ssm_beta.weight"),
        Role::Conv => lyr("ssm_conv1d.weight"),
        Role::ALog => lyr("ssm_a"),
        Role::DtBias => lyr("ssm_dt.bias"),
        Role::GdnNorm => lyr("ssm_norm.weight"),
        Role::Out => lyr("ssm_out.weight"),
        Role::Gate => lyr("ffn_gate.weight"),
        Role::Up => lyr("ffn_up.weight"),
        Role::Down => lyr("ffn_down.weight"),
    }
}

// ---------------------------------------------------------------------------------------------------------
// GGUF export

/// Write the Qwen3.5 text model of Hugging Face folder `dir` as an f32 GGUF of architecture `qwen35`, with
/// llama.cpp's conventions (the ones transformers' GGUF loader undoes): `blk.N.*` names, zero-centred norms
/// stored as `1 + w` (not `ssm_norm`), `ssm_a = −exp(A_log)`, the conv squeezed to `[conv_dim, K]`, and value
/// heads reordered from grouped to tiled on every value-indexed tensor (rows of the v part of `attn_qkv` and
/// `ssm_conv1d`, of `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_a`, `ssm_dt`; columns of `ssm_out`); the MTP head
/// as `blk.{n_layers}.*` when present; the folder's `tokenizer.json` (byte-level BPE) as `tokenizer.ggml.*`
/// when present. Errors: what [`Qwen35Model::load_dir`] reports, layer types that no `full_attention_interval`
/// describes, or an I/O failure.
pub fn export_gguf(dir: &Path, out: &Path) -> Result<()> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
    let top: Value = serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?;
    let c = config_from_hf(&top).map_err(|m| Error::model(&cfg_path, m))?;
    let every = (1..=c.n_layers).find(|&p| c.attention_layers.iter().enumerate().all(|(l, &a)| a == ((l + 1) % p == 0)));
    let every = every.ok_or_else(|| Error::model(&cfg_path, "layer_types are not periodic: no full_attention_interval describes them"))?;
    let t = Tensors::open(dir)?;
    let pre = ["model.language_model.", "model."]
        .into_iter()
        .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| Error::model(&t.listing, "missing tensor model.embed_tokens.weight"))?;
    let hf = HfLoader { t: &t, quant: Quant::None, pre };
    let s = c.gdn;
    let r = s.n_v_heads / s.n_k_heads;
    // tiled position of grouped value head h = kh·r + j is j·n_k + kh.
    let tiled_of = |h: usize| (h % r) * s.n_k_heads + h / r;
    let permute_rows = |data: &[f32], row_len: usize, head_rows: usize, offset_rows: usize| -> Vec<f32> {
        let mut o = data.to_vec();
        for h in 0..s.n_v_heads {
            let src = (offset_rows + h * head_rows) * row_len;
            let dst = (offset_rows + tiled_of(h) * head_rows) * row_len;
            o[dst..dst + head_rows * row_len].copy_from_slice(&data[src..src + head_rows * row_len]);
        }
        o
    };
    let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, data: Vec<f32>| tensors.push((name, dims, data));
    let read = |role: Role, l: usize| -> Result<(Vec<usize>, Vec<f32>)> {
        let n = hf.name(role, l);
        let shape = t.shape(&n).ok_or_else(|| Error::model(&t.listing, format!("missing tensor {n}")))?;
        Ok((shape.clone(), t.f32_tensor(&n, &shape)?))
    };
    let mut roles: Vec<(Role, usize)> = vec![(Role::Embed, 0), (Role::OutputNorm, 0)];
    if t.contains(&hf.name(Role::Head, 0)) && !c.tie_embeddings {
        roles.push((Role::Head, 0));
    }
    for l in 0..c.n_layers {
        roles.extend([Role::AttnNorm, Role::FfnNorm, Role::Gate, Role::Up, Role::Down].map(|x| (x, l)));
        if c.attention_layers[l] {
            roles.extend([Role::Q, Role::K, Role::V, Role::O, Role::QNorm, Role::KNorm].map(|x| (x, l)));
        } else {
            roles.extend(
                [Role::Qkv, Role::Z, Role::A, Role::B, Role::Conv, Role::ALog, Role::DtBias, Role::GdnNorm, Role::Out].map(|x| (x, l)),
            );
        }
    }
    let has_mtp = t.contains(&hf.name(Role::MtpFc, 0));
    if has_mtp {
        roles.extend([Role::MtpEmbNorm, Role::MtpHidNorm, Role::MtpFc, Role::MtpNorm].map(|x| (x, 0)));
        roles.extend(
            [Role::AttnNorm, Role::FfnNorm, Role::Gate, Role::Up, Role::Down, Role::Q, Role::K, Role::V, Role::O, Role::QNorm, Role::KNorm]
                .map(|x| (x, MTP_LAYER)),
        );
    }
    for (role, l) in roles {
        let (shape, mut data) = read(role, l)?;
        let norm_1p = matches!(
            role,
            Role::OutputNorm
                | Role::AttnNorm
                | Role::FfnNorm
                | Role::QNorm
                | Role::KNorm
                | Role::MtpEmbNorm
                | Role::MtpHidNorm
                | Role::MtpNorm
        );
        if norm_1p {
            data.iter_mut().for_each(|v| *v += 1.0);
        }
        let kd2 = 2 * s.key_dim();
        data = match role {
            Role::ALog => permute_rows(&data.iter().map(|v| -v.exp()).collect::<Vec<_>>(), 1, 1, 0),
            Role::DtBias | Role::A | Role::B => permute_rows(&data, data.len() / s.n_v_heads, 1, 0),
            Role::Z => permute_rows(&data, c.d_model, s.d_v, 0),
            Role::Qkv => permute_rows(&data, c.d_model, s.d_v, kd2),
            Role::Conv => permute_rows(&data, s.kernel, s.d_v, kd2),
            Role::Out => {
                // Columns: transpose, permute rows, transpose back.
                let (rows, cols) = (c.d_model, s.value_dim());
                let tr: Vec<f32> = (0..cols * rows).map(|i| data[(i % rows) * cols + i / rows]).collect();
                let p = permute_rows(&tr, rows, s.d_v, 0);
                (0..rows * cols).map(|i| p[(i % cols) * rows + i / cols]).collect()
            }
            _ => data,
        };
        let dims: Vec<u64> = match role {
            Role::Conv => vec![s.kernel as u64, s.conv_dim() as u64],
            _ => shape.iter().rev().map(|&x| x as u64).collect(),
        };
        add(gguf_name(role, if l == MTP_LAYER { c.n_layers } else { l }, c.n_layers), dims, data);
    }
    let p = |k: &str| format!("{GGUF_ARCH}.{k}");
    let mut md: BTreeMap<String, GgufValue> = BTreeMap::new();
    md.insert("general.architecture".into(), GgufValue::String(GGUF_ARCH.into()));
    md.insert(p("nextn_predict_layers"), GgufValue::U32(has_mtp as u32));
    for (k, v) in [
        ("block_count", c.n_layers + has_mtp as usize),
        ("context_length", c.train_ctx),
        ("embedding_length", c.d_model),
        ("feed_forward_length", c.ffn_dim),
        ("attention.head_count", c.n_heads),
        ("attention.head_count_kv", c.n_kv_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.rope_dims),
        ("full_attention_interval", every),
        ("ssm.conv_kernel", s.kernel),
        ("ssm.state_size", s.d_k),
        ("ssm.group_count", s.n_k_heads),
        ("ssm.time_step_rank", s.n_v_heads),
        ("ssm.inner_size", s.value_dim()),
    ] {
        md.insert(p(k), GgufValue::U32(v as u32));
    }
    md.insert(p("attention.layer_norm_rms_epsilon"), GgufValue::F32(c.norm_eps));
    md.insert(p("rope.freq_base"), GgufValue::F32(c.rope_theta));
    let text_cfg = top.get("text_config").unwrap_or(&top);
    let mut sections: Vec<i32> = text_cfg
        .pointer("/rope_parameters/mrope_section")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_i64).map(|x| x as i32).collect())
        .unwrap_or_else(|| vec![11, 11, 10]);
    sections.resize(4, 0);
    md.insert(p("rope.dimension_sections"), GgufValue::Array(sections.into_iter().map(GgufValue::I32).collect()));
    if dir.join(crate::model_dir::TOKENIZER_FILE).is_file() {
        tokenizer_metadata(dir, c.vocab_size, &mut md)?;
    }
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let table: Vec<(String, Vec<u64>, u32, &[u8])> =
        tensors.iter().zip(&bytes).map(|((n, dims, _), b)| (n.clone(), dims.clone(), 0u32, b.as_slice())).collect();
    crate::gguf::write_gguf(out, &md, &table).map_err(|e| Error::Io { path: out.to_path_buf(), source: e })
}

/// llama.cpp's `tokenizer.ggml.*` metadata (byte-level BPE, pre-tokenizer `qwen35`) from the folder's
/// `tokenizer.json` (and `tokenizer_config.json` for the EOS token): tokens by id, padded to `vocab` with
/// unused `<|pad_N|>` entries; token types (1 normal, 3 control for special added tokens, 5 padding); merges.
fn tokenizer_metadata(dir: &Path, vocab: usize, md: &mut BTreeMap<String, GgufValue>) -> Result<()> {
    let path = dir.join(crate::model_dir::TOKENIZER_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
    let j: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed JSON: {e}")))?;
    let bad = |m: &str| Error::model(&path, m.to_string());
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab];
    let mut put = |id: u64, tok: &str, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| bad(&format!("token id {id} beyond the {vocab} embedding rows")))?;
        *slot = Some((tok.to_string(), ty));
        Ok(())
    };
    for (tok, id) in j.pointer("/model/vocab").and_then(Value::as_object).ok_or_else(|| bad("no model.vocab (not a BPE tokenizer)"))? {
        put(id.as_u64().ok_or_else(|| bad("vocab id is not an integer"))?, tok, 1)?;
    }
    let mut eos = None;
    let eos_name = std::fs::read_to_string(dir.join(crate::model_dir::TOKENIZER_CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("eos_token").and_then(Value::as_str).map(str::to_string));
    for a in j.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let (id, content) = (a["id"].as_u64().unwrap_or(u64::MAX), a["content"].as_str().unwrap_or(""));
        put(id, content, if a["special"].as_bool() == Some(true) { 3 } else { 4 })?;
        if eos_name.as_deref() == Some(content) {
            eos = Some(id);
        }
    }
    let merges: Vec<GgufValue> = j
        .pointer("/model/merges")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) => Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?)),
            _ => None,
        })
        .map(|m| m.map(GgufValue::String).ok_or_else(|| bad("a merge is neither \"a b\" nor [a, b]")))
        .collect::<Result<_>>()?;
    let (mut list, mut types) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
    for (i, t) in tokens.into_iter().enumerate() {
        let (tok, ty) = t.unwrap_or_else(|| (format!("<|pad_{i}|>"), 5));
        list.push(GgufValue::String(tok));
        types.push(GgufValue::I32(ty));
    }
    md.insert("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), GgufValue::String("qwen35".into()));
    md.insert("tokenizer.ggml.tokens".into(), GgufValue::Array(list));
    md.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types));
    md.insert("tokenizer.ggml.merges".into(), GgufValue::Array(merges));
    md.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false));
    if let Some(e) = eos {
        md.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e as u32));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// State

/// What [`forward_tree`] leaves for [`Qwen35State::commit`].
#[derive(Clone)]
struct TreeStash {
    tokens: Vec<u32>,
    parents: Vec<usize>,
    /// Per GDN layer (indexed like `conv`): pre-conv stream, prepared post-conv stream, γ, ũ.
    gdn: Vec<Option<GdnStash>>,
}

/// The GDN states (conv window and recurrent state of every layer, empty for attention layers) after the
/// first `tokens.len()` tokens of a sequence, as an aligned chunked prefill from the start computes them.
#[derive(Clone)]
struct GdnSnapshot {
    tokens: Vec<u32>,
    conv: Vec<Vec<f32>>,
    rec: Vec<Vec<f32>>,
}

#[derive(Clone)]
struct GdnStash {
    x: Vec<f32>,
    c: Vec<f32>,
    gamma: Vec<f32>,
    u: Vec<f32>,
}

/// Per-sequence state of a Qwen3.5 model: K/V rows of the attention layers (`ctx × kv_dim` f32 each, rows
/// `0..n_past` committed, rows after them tree scratch), the conv window (`(K−1) × conv_dim`) and the fp32
/// recurrent state (`n_v_heads × d_k × d_v`) of every GDN layer, the committed tokens, and the pending tree.
#[derive(Clone)]
pub struct Qwen35State {
    /// Rows of the KV cache (context length in tokens).
    pub ctx: usize,
    /// Committed tokens.
    pub tokens: Vec<u32>,
    gdn_shape: GdnShape,
    kv_dim: usize,
    /// Per layer: (K, V) for attention layers, empty for GDN layers.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Per layer: conv window (GDN layers) or empty.
    conv: Vec<Vec<f32>>,
    /// Per layer: recurrent state (GDN layers) or empty.
    rec: Vec<Vec<f32>>,
    tree: Option<TreeStash>,
    /// The GDN states equal those an aligned chunked prefill of `tokens` from the start computes (true after
    /// [`Qwen35State::clear`] and a snapshot restore, kept by prefills ending on a chunk boundary).
    exact: bool,
    /// Prefix-cache snapshots, oldest first.
    snapshots: Vec<GdnSnapshot>,
    /// Snapshot being filled by the current prefill: (absolute position, per-layer conv, per-layer state).
    capture: Option<(usize, Vec<Vec<f32>>, Vec<Vec<f32>>)>,
}

impl Qwen35State {
    /// Empty state with room for `ctx` tokens (committed plus tree scratch).
    pub fn new(c: &Qwen35Config, ctx: usize) -> Self {
        let kvd = c.kv_dim();
        let s = c.gdn;
        let per = |attn: bool, a: usize, g: usize| if attn { vec![0f32; a] } else { vec![0f32; g] };
        Qwen35State {
            ctx,
            tokens: Vec::new(),
            gdn_shape: s,
            kv_dim: kvd,
            kv: c.attention_layers.iter().map(|&a| (per(a, ctx * kvd, 0), per(a, ctx * kvd, 0))).collect(),
            conv: c.attention_layers.iter().map(|&a| per(a, 0, s.conv_state_len())).collect(),
            rec: c.attention_layers.iter().map(|&a| per(a, 0, s.state_len())).collect(),
            tree: None,
            exact: true,
            snapshots: Vec::new(),
            capture: None,
        }
    }

    /// Committed positions.
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// Forget everything, prefix-cache snapshots included (memory kept).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.snapshots.clear();
        self.conv.iter_mut().for_each(|v| v.fill(0.0));
        self.rec.iter_mut().for_each(|v| v.fill(0.0));
        self.tree = None;
        self.exact = true;
        self.capture = None;
    }

    /// Longest prefix of `prompt`, at most `limit` tokens and shared with the committed tokens, from which
    /// a prefill computes exactly what a cold prefill computes: a snapshot's length, or the committed length
    /// when the state is exact; 0 when none.
    pub fn reusable_prefix(&self, prompt: &[u32], limit: usize) -> usize {
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let limit = limit.min(common);
        let live = if self.exact && self.tokens.len() <= limit { self.tokens.len() } else { 0 };
        self.snapshots
            .iter()
            .filter(|s| s.tokens.len() <= limit && s.tokens[..] == prompt[..s.tokens.len()])
            .map(|s| s.tokens.len())
            .fold(live, usize::max)
    }

    /// Make the committed tokens `tokens` (usually a prefix of the current ones) without a cold restart when
    /// possible: drop the snapshots the K/V rows no longer back (longer than the prefix shared with the
    /// current tokens, or of other tokens), restore the longest remaining one (or clear) and return how many
    /// leading tokens of `tokens` are now committed; the caller prefills the rest.
    pub fn restore_prefix(&mut self, tokens: &[u32]) -> usize {
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        self.snapshots.retain(|s| s.tokens.len() <= common && s.tokens[..] == tokens[..s.tokens.len()]);
        self.tree = None;
        self.capture = None;
        if self.exact && self.tokens.len() == common {
            return common; // already a prefix of `tokens`, exact
        }
        let best = self.snapshots.iter().enumerate().max_by_key(|(_, s)| s.tokens.len()).map(|(i, _)| i);
        match best {
            Some(i) => {
                let snap = &self.snapshots[i];
                for (d, s) in self.conv.iter_mut().zip(&snap.conv) {
                    d.copy_from_slice(s);
                }
                for (d, s) in self.rec.iter_mut().zip(&snap.rec) {
                    d.copy_from_slice(s);
                }
                self.tokens.clear();
                self.tokens.extend_from_slice(&snap.tokens);
                self.exact = true;
            }
            None => self.clear(),
        }
        self.tokens.len()
    }

    /// Bytes held by the caches and states.
    pub fn nbytes(&self) -> usize {
        4 * (self.kv.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            + self.conv.iter().map(Vec::len).sum::<usize>()
            + self.rec.iter().map(Vec::len).sum::<usize>())
    }

    /// The recurrent state of layer `l` (empty for attention layers), `n_v_heads × d_k × d_v`.
    pub fn recurrent_state(&self, l: usize) -> &[f32] {
        &self.rec[l]
    }

    /// The conv window of layer `l` (empty for attention layers), `(K−1) × conv_dim`.
    pub fn conv_state(&self, l: usize) -> &[f32] {
        &self.conv[l]
    }

    fn check_room(&self, extra: usize) -> Result<()> {
        if self.n_past() + extra > self.ctx {
            return Err(Error::Input(format!(
                "sequence of {} tokens exceeds the context length of {} tokens",
                self.n_past() + extra,
                self.ctx
            )));
        }
        Ok(())
    }

    /// Accept `path` of the last [`forward_tree`]: node indices from the root (0), each the parent of the next.
    /// The path's tokens are appended to the committed tokens; every GDN state gets one rank-|path| update and
    /// its conv window the path's last inputs; the accepted K/V rows `n_past + path[i]` move to `n_past + i`.
    /// The tree is then dropped (another commit needs another verification).
    ///
    /// Errors: no pending tree, an empty path, or one that is not a root path of the tree.
    pub fn commit(&mut self, pool: &ThreadPool, path: &[usize]) -> Result<()> {
        let tree = self.tree.take().ok_or_else(|| Error::Input("commit without a pending tree (call forward_tree first)".into()))?;
        let n = tree.parents.len();
        let ok = !path.is_empty() && path[0] == 0 && path.iter().all(|&p| p < n) && path.windows(2).all(|w| tree.parents[w[1]] == w[0]);
        if !ok {
            self.tree = Some(tree);
            return Err(Error::Input(format!("commit: {path:?} is not a root path of the {n}-node tree")));
        }
        let n_past = self.n_past();
        let s = self.gdn_shape;
        let kvd = self.kv_dim;
        for (l, st) in tree.gdn.iter().enumerate() {
            match st {
                Some(g) => {
                    gdn::apply_path(pool, &s, &mut self.rec[l], &g.c, &g.gamma, &g.u, path);
                    gdn::conv_commit(&mut self.conv[l], s.conv_dim(), s.kernel, &g.x, path);
                }
                None => {
                    let (k, v) = &mut self.kv[l];
                    for (i, &p) in path.iter().enumerate() {
                        if p != i {
                            k.copy_within((n_past + p) * kvd..(n_past + p + 1) * kvd, (n_past + i) * kvd);
                            v.copy_within((n_past + p) * kvd..(n_past + p + 1) * kvd, (n_past + i) * kvd);
                        }
                    }
                }
            }
        }
        self.tokens.extend(path.iter().map(|&p| tree.tokens[p]));
        // A decoded state differs (by rounding) from what a prefill of the same tokens computes.
        self.exact = false;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------
// Forward

/// Scratch buffers, grown on demand (allocate once per model and reuse).
#[derive(Default)]
pub struct Qwen35Workspace {
    /// Largest chain processed at once; longer prefills are split.
    pub max_batch: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    hidden: Vec<f32>,
    xq: QuantizedActivations,
    /// [`forward`] keeps the final-normed hidden state of every row, not only of the rows it computes
    /// logits for (an MTP drafter needs the prompt's).
    pub all_hidden: bool,
}

impl Qwen35Workspace {
    /// A workspace for chains of up to `max_batch` tokens per pass.
    pub fn new(max_batch: usize) -> Self {
        Qwen35Workspace { max_batch: max_batch.max(1), xq: QuantizedActivations::new(), ..Default::default() }
    }

    /// The final-normed hidden states (`d_model` each) of the rows whose logits the last [`forward`] /
    /// [`forward_tree`] produced — of every row with [`Qwen35Workspace::all_hidden`] — (the MTP outputs h'
    /// after [`mtp_forward`]), in the same order.
    pub fn hidden(&self) -> &[f32] {
        &self.hidden
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Run `tokens` at positions `n_past..` (prefill), append them to the state and write logits (`vocab`
/// floats per requested row, batch order) into `logits`. GDN layers use the chunked form with chunk
/// boundaries at absolute multiples of [`GDN_CHUNK`]; from an exact state a prefix-cache snapshot is taken
/// (see the module docs). Drops any pending tree.
///
/// Errors: a token outside the vocabulary, or more tokens than the context holds.
pub fn forward(
    model: &Qwen35Model,
    pool: &ThreadPool,
    ws: &mut Qwen35Workspace,
    state: &mut Qwen35State,
    tokens: &[u32],
    want: Logits,
    logits: &mut Vec<f32>,
) -> Result<()> {
    check_tokens(model, tokens)?;
    state.check_room(tokens.len())?;
    state.tree = None;
    logits.clear();
    ws.hidden.clear();
    // From an exact state, snapshot the GDN states at the last chunk boundary before the last token (the
    // prefix cache reuses at most all but the last prompt token).
    let (start, end) = (state.n_past(), state.n_past() + tokens.len());
    let at = (end.saturating_sub(1) / GDN_CHUNK) * GDN_CHUNK;
    let known = state.snapshots.iter().any(|s| s.tokens.len() == at && s.tokens[..] == state.tokens[..at.min(start)]);
    state.capture = None;
    if state.exact && at > 0 && at >= start && !(known && at == start) {
        // At `start` the snapshot is the current state; past it, the GDN layers fill it in at `at`.
        let (conv, rec) = if at == start {
            (state.conv.clone(), state.rec.clone())
        } else {
            (vec![Vec::new(); state.conv.len()], vec![Vec::new(); state.rec.len()])
        };
        state.capture = Some((at, conv, rec));
    }
    // Runs end at multiples of `max_batch` positions: the same cuts whatever the prefill's start.
    let mut at = 0;
    while at < tokens.len() {
        let end = (((start + at) / ws.max_batch + 1) * ws.max_batch - start).min(tokens.len());
        let chunk = &tokens[at..end];
        let rows = match want {
            Logits::All => 0..chunk.len(),
            Logits::Last if end == tokens.len() => chunk.len() - 1..chunk.len(),
            _ => 0..0,
        };
        run(model, pool, ws, state, chunk, None, rows, logits);
        state.tokens.extend_from_slice(chunk);
        at = end;
    }
    state.exact = state.exact && end % GDN_CHUNK == 0;
    if let Some((at, conv, rec)) = state.capture.take() {
        let tokens = state.tokens[..at].to_vec();
        state.snapshots.retain(|s| s.tokens != tokens);
        if state.snapshots.len() >= MAX_SNAPSHOTS {
            state.snapshots.remove(0);
        }
        state.snapshots.push(GdnSnapshot { tokens, conv, rec });
    }
    Ok(())
}

/// Verify a token tree in one pass: `tokens[i]` is node i, `parents` the tree (see the module docs). Reads the
/// committed state only (writes the attention layers' scratch rows `n_past..n_past+n` and a pending tree for
/// [`Qwen35State::commit`]); `logits` receives `vocab` floats for every node, in node order.
///
/// Errors: a token outside the vocabulary, a malformed tree, or a tree that does not fit the context.
pub fn forward_tree(
    model: &Qwen35Model,
    pool: &ThreadPool,
    ws: &mut Qwen35Workspace,
    state: &mut Qwen35State,
    tokens: &[u32],
    parents: &[usize],
    logits: &mut Vec<f32>,
) -> Result<()> {
    check_tokens(model, tokens)?;
    if tokens.len() != parents.len() || tokens.is_empty() {
        return Err(Error::Input(format!("tree of {} tokens with {} parents", tokens.len(), parents.len())));
    }
    gdn::check_parents(parents).map_err(Error::Input)?;
    state.check_room(tokens.len())?;
    logits.clear();
    ws.hidden.clear();
    state.tree = Some(TreeStash { tokens: tokens.to_vec(), parents: parents.to_vec(), gdn: vec![None; model.config.n_layers] });
    run(model, pool, ws, state, tokens, Some(parents), 0..tokens.len(), logits);
    Ok(())
}

fn check_tokens(model: &Qwen35Model, tokens: &[u32]) -> Result<()> {
    let vocab = model.config.vocab_size;
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&bad) => Err(Error::Input(format!("token id {bad} is outside the vocabulary of {vocab}"))),
        None => Ok(()),
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// One pass over the blocks for `tokens` (a chain continuing the committed state when `tree` is None, else a
/// tree); logits for batch rows `rows` are appended to `logits`.
#[allow(clippy::too_many_arguments)]
fn run(
    model: &Qwen35Model,
    pool: &ThreadPool,
    ws: &mut Qwen35Workspace,
    state: &mut Qwen35State,
    tokens: &[u32],
    tree: Option<&[usize]>,
    rows: std::ops::Range<usize>,
    logits: &mut Vec<f32>,
) {
    let c = &model.config;
    let t = tokens.len();
    let d = c.d_model;
    let n_past = state.n_past();
    let chain;
    let parents: &[usize] = match tree {
        Some(p) => p,
        None => {
            chain = gdn::chain_parents(t);
            &chain
        }
    };
    let mut depth = vec![0usize; t];
    for i in 1..t {
        depth[i] = depth[parents[i]] + 1;
    }
    let positions: Vec<usize> = depth.iter().map(|&dp| n_past + dp).collect();
    let pass = Pass { model, pool, t, positions: &positions, parents, tree: tree.is_some() };
    let Qwen35Workspace { x, h, a, b, xq, hidden, all_hidden, .. } = ws;
    let x = grow(x, t * d);
    let scratch = grow(b, scratch_len(c, t));
    for (i, &tok) in tokens.iter().enumerate() {
        model.embed.dequant_row(tok as usize, &mut x[i * d..(i + 1) * d]);
    }
    for (l, layer) in model.layers.iter().enumerate() {
        block(&pass, layer, state, l, x, h, a, scratch, xq);
    }
    if *all_hidden {
        // Every row's final-normed state (the same values `head` forms for the logit rows).
        let at = hidden.len();
        hidden.resize(at + t * d, 0.0);
        rms_norm(x, &model.output_norm, c.norm_eps, &mut hidden[at..]);
        head(model, pool, &x[rows.start * d..rows.end * d], &model.output_norm, h, xq, logits, &mut Vec::new());
    } else {
        head(model, pool, &x[rows.start * d..rows.end * d], &model.output_norm, h, xq, logits, hidden);
    }
}

/// One pre-norm block on the residual stream `x` (`t × d_model`): mixer, then SwiGLU MLP.
#[allow(clippy::too_many_arguments)]
fn block(
    p: &Pass,
    layer: &Qwen35Layer,
    state: &mut Qwen35State,
    l: usize,
    x: &mut [f32],
    h: &mut Vec<f32>,
    a: &mut Vec<f32>,
    scratch: &mut [f32],
    xq: &mut QuantizedActivations,
) {
    let (c, pool, t) = (&p.model.config, p.pool, p.t);
    let (d, fd) = (c.d_model, c.ffn_dim);
    let hb = grow(h, t * d);
    rms_norm(x, &layer.attn_norm, c.norm_eps, hb);
    quantize_activations(pool, hb, t, d, xq);
    let o = grow(a, t * d);
    let io = Io { h: hb, xq: &mut *xq, bufs: Bump { rest: &mut *scratch }, out: &mut *o };
    match &layer.mixer {
        Mixer::Attention(at) => attention_layer(p, at, state, l, io),
        Mixer::DeltaNet(g) => delta_net_layer(p, g, state, l, io),
    }
    add_into(x, o);

    let hb = grow(h, t * d);
    rms_norm(x, &layer.ffn_norm, c.norm_eps, hb);
    quantize_activations(pool, hb, t, d, xq);
    let mut bufs = Bump { rest: &mut *scratch };
    let (gate, up) = (bufs.take(t * fd), bufs.take(t * fd));
    matmul(pool, &layer.w_gate, hb, xq, t, gate);
    matmul(pool, &layer.w_up, hb, xq, t, up);
    crate::backend::cpu::activation::gated_act(crate::backend::cpu::activation::Activation::Silu, gate, up);
    quantize_activations(pool, gate, t, fd, xq);
    matmul(pool, &layer.w_down, gate, xq, t, o);
    add_into(x, o);
}

/// Final norm of the rows `x` (`n × d_model`), appended to `hidden`, and their logits appended to `logits`.
#[allow(clippy::too_many_arguments)]
fn head(
    model: &Qwen35Model,
    pool: &ThreadPool,
    x: &[f32],
    norm: &[f32],
    h: &mut Vec<f32>,
    xq: &mut QuantizedActivations,
    logits: &mut Vec<f32>,
    hidden: &mut Vec<f32>,
) {
    let c = &model.config;
    let d = c.d_model;
    let n = x.len() / d;
    if n == 0 {
        return;
    }
    let hs = grow(h, n * d);
    rms_norm(x, norm, c.norm_eps, hs);
    hidden.extend_from_slice(hs);
    quantize_activations(pool, hs, n, d, xq);
    let start = logits.len();
    logits.resize(start + n * c.vocab_size, 0.0);
    matmul(pool, model.lm_head(), hs, xq, n, &mut logits[start..]);
}

/// KV cache of the MTP block (a one-layer [`Qwen35State`]); its positions advance with every
/// [`mtp_forward`] row.
#[derive(Clone)]
pub struct MtpState(Qwen35State);

impl MtpState {
    /// Room for `ctx` MTP steps.
    pub fn new(c: &Qwen35Config, ctx: usize) -> Self {
        let mut one = c.clone();
        one.n_layers = 1;
        one.attention_layers = vec![true];
        MtpState(Qwen35State::new(&one, ctx))
    }
    /// Rows in the cache.
    pub fn n_past(&self) -> usize {
        self.0.n_past()
    }
    /// Forget everything.
    pub fn clear(&mut self) {
        self.0.clear()
    }
    /// Keep only the first `n` rows (drop draft steps that were not accepted).
    pub fn truncate(&mut self, n: usize) {
        self.0.tokens.truncate(n)
    }
}

/// Run the MTP head for `tokens.len()` steps: row i takes the next token `tokens[i]` and the hidden state
/// `hidden[i]` (`d_model` values, after the final norm: [`Qwen35Workspace::hidden`] of the main model, or the
/// previous MTP step's for chained drafting), at MTP positions `state.n_past()..`. Appends the rows to the
/// MTP cache, writes `vocab` logits per row to `logits` (predictions two tokens ahead of the hidden state's
/// position) and leaves the MTP outputs h' in [`Qwen35Workspace::hidden`].
///
/// Errors: no MTP head, a token outside the vocabulary, a hidden buffer of the wrong size, a full cache.
#[allow(clippy::too_many_arguments)]
pub fn mtp_forward(
    model: &Qwen35Model,
    pool: &ThreadPool,
    ws: &mut Qwen35Workspace,
    state: &mut MtpState,
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
    state.0.check_room(t)?;
    logits.clear();
    let n_past = state.n_past();
    let positions: Vec<usize> = (n_past..n_past + t).collect();
    let parents = gdn::chain_parents(t);
    let pass = Pass { model, pool, t, positions: &positions, parents: &parents, tree: false };
    let Qwen35Workspace { x, h, a, b, xq, hidden: hid_out, .. } = ws;
    let cat = grow(a, 2 * t * d);
    let mut e = vec![0f32; d];
    for i in 0..t {
        model.embed.dequant_row(tokens[i] as usize, &mut e);
        rms_norm(&e, &mtp.emb_norm, c.norm_eps, &mut cat[2 * i * d..(2 * i + 1) * d]);
        rms_norm(&hidden[i * d..(i + 1) * d], &mtp.hid_norm, c.norm_eps, &mut cat[(2 * i + 1) * d..(2 * i + 2) * d]);
    }
    quantize_activations(pool, cat, t, 2 * d, xq);
    let x = grow(x, t * d);
    matmul(pool, &mtp.fc, cat, xq, t, x);
    let scratch = grow(b, scratch_len(c, t));
    block(&pass, &mtp.layer, &mut state.0, 0, x, h, a, scratch, xq);
    hid_out.clear();
    head(model, pool, x, &mtp.norm, h, xq, logits, hid_out);
    state.0.tokens.extend_from_slice(tokens);
    Ok(())
}

/// Hands out consecutive slices of one scratch vector.
struct Bump<'a> {
    rest: &'a mut [f32],
}

impl<'a> Bump<'a> {
    fn take(&mut self, n: usize) -> &'a mut [f32] {
        let rest = std::mem::take(&mut self.rest);
        let (head, tail) = rest.split_at_mut(n);
        self.rest = tail;
        head
    }
}

/// Sizes the shared scratch vector for `t` tokens.
fn scratch_len(c: &Qwen35Config, t: usize) -> usize {
    let s = c.gdn;
    let attn = t * (5 * c.q_dim() + 2 * c.kv_dim());
    let gdn = t * (2 * s.conv_dim() + 2 * s.value_dim() + 2 * s.n_v_heads + s.n_v_heads + s.value_dim());
    let mlp = 2 * t * c.ffn_dim;
    attn.max(gdn).max(mlp)
}

/// What every layer of one pass shares.
struct Pass<'a> {
    model: &'a Qwen35Model,
    pool: &'a ThreadPool,
    /// Tokens (nodes) in the pass.
    t: usize,
    /// Absolute position of each token.
    positions: &'a [usize],
    /// Tree (or chain) parents.
    parents: &'a [usize],
    /// Tree verification (read-only state) rather than a chain that advances it.
    tree: bool,
}

/// A layer's input `h` (`t × d_model`, with `xq` its int8 form) and output `out` (`t × d_model`).
struct Io<'a, 'b> {
    h: &'a [f32],
    xq: &'a mut QuantizedActivations,
    bufs: Bump<'b>,
    out: &'a mut [f32],
}

fn attention_layer(p: &Pass, w: &GatedAttention, state: &mut Qwen35State, l: usize, io: Io) {
    let Io { h, xq, mut bufs, out } = io;
    let (model, pool, t, positions) = (p.model, p.pool, p.t, p.positions);
    let c = &model.config;
    let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
    let n_past = state.n_past();
    let (qg, q, gate) = (bufs.take(t * 2 * qd), bufs.take(t * qd), bufs.take(t * qd));
    let (k, v, att) = (bufs.take(t * kvd), bufs.take(t * kvd), bufs.take(t * qd));
    matmul(pool, &w.wq, h, xq, t, qg);
    matmul(pool, &w.wk, h, xq, t, k);
    matmul(pool, &w.wv, h, xq, t, v);
    for i in 0..t {
        for hh in 0..c.n_heads {
            let src = &qg[i * 2 * qd + hh * 2 * hd..i * 2 * qd + (hh + 1) * 2 * hd];
            q[i * qd + hh * hd..i * qd + (hh + 1) * hd].copy_from_slice(&src[..hd]);
            gate[i * qd + hh * hd..i * qd + (hh + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    rms_norm_inplace(q, &w.q_norm, c.norm_eps);
    rms_norm_inplace(k, &w.k_norm, c.norm_eps);
    for i in 0..t {
        let (qi, ki) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
        model.rope.apply_all(&mut [qi, ki], hd, positions[i]);
    }
    let (kc, vc) = &mut state.kv[l];
    kc[n_past * kvd..(n_past + t) * kvd].copy_from_slice(k);
    vc[n_past * kvd..(n_past + t) * kvd].copy_from_slice(v);
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
    };
    if p.tree {
        let paths = TreePaths::new(p.parents).expect("tree validated by forward_tree");
        attention(pool, &shape, q, kc, vc, n_past, t, Visibility::Tree { first: 0, paths: &paths }, att);
    } else {
        attention(pool, &shape, q, kc, vc, n_past, t, Visibility::Causal, att);
    }
    for (o, &g) in att.iter_mut().zip(gate.iter()) {
        *o *= 1.0 / (1.0 + (-g).exp());
    }
    quantize_activations(pool, att, t, qd, xq);
    matmul(pool, &w.wo, att, xq, t, out);
}

fn delta_net_layer(p: &Pass, w: &DeltaNet, state: &mut Qwen35State, l: usize, io: Io) {
    let Io { h, xq, mut bufs, out } = io;
    let (model, pool, t, parents) = (p.model, p.pool, p.t, p.parents);
    let c = &model.config;
    let s = c.gdn;
    let (cd, vd, hv) = (s.conv_dim(), s.value_dim(), s.n_v_heads);
    let (x, cc) = (bufs.take(t * cd), bufs.take(t * cd));
    let (z, o) = (bufs.take(t * vd), bufs.take(t * vd));
    let (a, b) = (bufs.take(t * hv), bufs.take(t * hv));
    matmul(pool, &w.w_qkv, h, xq, t, x);
    matmul(pool, &w.w_z, h, xq, t, z);
    matmul(pool, &w.w_b, h, xq, t, b);
    matmul(pool, &w.w_a, h, xq, t, a);
    gdn::conv_silu(&w.conv, s.kernel, &state.conv[l], x, parents, cc);
    gdn::prepare(&s, cc, a, b, &w.a_neg, &w.dt_bias, t);
    if p.tree {
        let mut gamma = vec![0f32; t * hv];
        let mut u = vec![0f32; t * vd];
        gdn::wy_outputs(pool, &s, &state.rec[l], cc, a, b, parents, &mut gamma, &mut u, o);
        if let Some(tr) = state.tree.as_mut() {
            tr.gdn[l] = Some(GdnStash { x: x.to_vec(), c: cc.to_vec(), gamma, u });
        }
    } else {
        // Chunk boundaries at absolute multiples of GDN_CHUNK, cut also where a snapshot is due.
        let n_past = p.positions[0];
        let cap = state.capture.as_ref().map(|c| c.0).filter(|&at| at > n_past && at <= n_past + t).map(|at| at - n_past);
        let lead = (GDN_CHUNK - n_past % GDN_CHUNK) % GDN_CHUNK;
        let mut cuts = vec![0, t];
        cuts.extend([lead, cap.unwrap_or(0)].into_iter().filter(|&c| c > 0 && c < t));
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let (u, v) = (w[0], w[1]);
            let (cs, gs, bs) = (&cc[u * cd..v * cd], &a[u * hv..v * hv], &b[u * hv..v * hv]);
            gdn::chunked(pool, &s, &mut state.rec[l], cs, gs, bs, v - u, GDN_CHUNK, &mut o[u * vd..v * vd]);
            if Some(v) == cap {
                let mut conv = state.conv[l].clone();
                gdn::conv_commit(&mut conv, cd, s.kernel, x, &(0..v).collect::<Vec<_>>());
                let rec = state.rec[l].clone();
                let c = state.capture.as_mut().expect("capture checked above");
                (c.1[l], c.2[l]) = (conv, rec);
            }
        }
        let path: Vec<usize> = (0..t).collect();
        gdn::conv_commit(&mut state.conv[l], cd, s.kernel, x, &path);
    }
    gdn::gated_rms_norm(o, z, &w.norm, c.norm_eps);
    quantize_activations(pool, o, t, vd, xq);
    matmul(pool, &w.w_out, o, xq, t, out);
}
