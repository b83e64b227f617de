//! Qwen3.5 hybrid decoder: its configuration and tensor names. Layers are Gated DeltaNet (GDN) or gated
//! full attention (usually three GDN layers, then one attention layer); the model is the shared
//! [`crate::models::Model`] (a [`Mixer::DeltaNet`] or gated [`Mixer::Attention`] plus the SwiGLU FFN per
//! layer, an optional MTP head) and runs through the shared forward ([`crate::models::forward`]); its
//! sequence state is the shared [`crate::state::SeqState`] (KV rows for the attention layers, conv window and
//! recurrent state for the GDN layers, prefix-cache snapshots).
//!
//! Read from Hugging Face folders (`Qwen3_5ForCausalLM`, and the language model inside
//! `Qwen3_5ForConditionalGeneration`; the vision tower is skipped) and GGUF files (arch `qwen35`, llama.cpp's
//! tensor names and conventions); [`crate::export::qwen35_gguf`] writes the latter from the former (for tests
//! and benchmarks against llama.cpp).
//!
//! Math (`docs/qwen35.md`, `docs/gated-deltanet.md`; transformers `models/qwen3_5/modeling_qwen3_5.py`):
//! - block: `x += mixer(RMSNorm₁₊w(x)); x += down(silu(gate(h)) ⊙ up(h))` with `h = RMSNorm₁₊w(x)`; final
//!   `RMSNorm₁₊w`, LM head (tied to the embedding or not). Zero-centred norms are stored here with the 1
//!   added (as llama.cpp's converter stores them), so one RMSNorm kernel serves.
//! - gated attention: `q_proj` rows are per head `[q_h (head_dim), gate_h (head_dim)]`; q/k RMSNorm₁₊w per
//!   head; NeoX RoPE on the first `rope_dims` dims (text-only M-RoPE reduces to it); GQA softmax attention;
//!   `o ⊙ σ(gate)`; `o_proj`.
//! - GDN: `x = in_proj_qkv(h)` → causal depthwise conv (kernel 4, state = last 3 pre-conv inputs) → SiLU →
//!   split q|k|v, L2-normalised q, k (q also scaled by `d_k^−½`); `g = −exp(A_log)·softplus(in_proj_a(h) +
//!   dt_bias)`, `β = σ(in_proj_b(h))`; delta rule on an fp32 state per value head; gated RMSNorm with
//!   `silu(in_proj_z(h))`; `out_proj`.

use crate::backend::cpu::gdn;
use crate::backend::{GdnShape, Rope, RopeMode};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model_dir::{Quant, Tensors, CONFIG_FILE};
use crate::models::{Arch, Attention, DeltaNet, Layer, Mixer, Model, ModelConfig, Mtp};
use crate::quant::{import, WeightMatrix};
use serde::Deserialize;
use std::path::Path;

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
        for (what, v) in [("RMSNorm epsilon", self.norm_eps), ("RoPE base", self.rope_theta)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("invalid {what}: {v} (must be a finite number > 0)"));
            }
        }
        Ok(())
    }
}

/// The shared [`ModelConfig`] of a Qwen3.5 config.
pub fn model_config(c: &Qwen35Config) -> ModelConfig {
    ModelConfig {
        n_layers: c.n_layers,
        d_model: c.d_model,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        ffn_dim: c.ffn_dim,
        vocab_size: c.vocab_size,
        train_ctx: c.train_ctx,
        norm_eps: c.norm_eps,
        rope_dims: c.rope_dims,
        gdn: Some(c.gdn),
        ..ModelConfig::plain(Arch::Qwen35, c.head_dim, c.rope_theta)
    }
}

/// [`model_config`] of a GGUF file of architecture `qwen35`.
pub fn config_from_gguf_file(g: &GgufFile) -> Result<ModelConfig> {
    Ok(model_config(&config_from_gguf(g)?))
}

/// [`model_config`] of a Hugging Face folder's `config.json`.
pub fn config_from_dir(dir: &Path) -> Result<ModelConfig> {
    Ok(model_config(&read_hf_config(dir)?.1))
}

/// `config.json` of `dir`: its M-RoPE sections (if any) and the Qwen3.5 config it describes.
pub(crate) fn read_hf_config(dir: &Path) -> Result<(Option<Vec<i32>>, Qwen35Config)> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
    let top: HfConfig = serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?;
    let c = config_from_hf(&top).map_err(|m| Error::model(&cfg_path, m))?;
    let text_config = top.text_config.as_deref().unwrap_or(&top);
    let sections = text_config.rope_parameters.as_ref().and_then(|p| p.mrope_section.clone());
    Ok((sections, c))
}

/// Load a Hugging Face folder (`config.json` + safetensors); matrices stored per `quant` like
/// [`crate::models::hf::load_model`]. Errors name the file: unsupported config, missing tensor, wrong shape.
pub fn load_dir(dir: &Path, quant: Quant) -> Result<Model> {
    let (_, config) = read_hf_config(dir)?;
    let t = Tensors::open(dir)?;
    let prefix = ["model.language_model.", "model.", "language_model.model."]
        .into_iter()
        .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| Error::model(&t.listing, "missing tensor model.embed_tokens.weight"))?;
    HfLoader { t: &t, quant, pre: prefix }.load(config)
}

/// Load a GGUF file of architecture `qwen35` (llama.cpp's names; norms stored as 1 + w, `ssm_a` = −exp(A_log),
/// value heads tiled over key heads).
pub fn load_gguf(g: &GgufFile) -> Result<Model> {
    let config = config_from_gguf(g)?;
    GgufLoader { g, n_layers: config.n_layers }.load(config)
}

/// [`load_gguf`] on a path.
pub fn load_gguf_path(path: &Path) -> Result<Model> {
    load_gguf(&GgufFile::open(path)?)
}

/// Whether a Hugging Face folder holds a Qwen3.5 model (`model_type` `qwen3_5` / `qwen3_5_text`).
pub fn is_qwen35_dir(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(CONFIG_FILE)) else { return false };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return false };
    matches!(v.get("model_type").and_then(serde_json::Value::as_str), Some("qwen3_5" | "qwen3_5_text"))
}

// ---------------------------------------------------------------------------------------------------------
// Configuration

/// The fields of a Qwen3.5 `config.json` eddy reads (missing ones take transformers' defaults); the text model's
/// fields sit in `text_config` for `Qwen3_5ForConditionalGeneration`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    text_config: Option<Box<HfConfig>>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    attn_output_gate: Option<bool>,
    num_hidden_layers: Option<usize>,
    layer_types: Option<Vec<Option<String>>>,
    full_attention_interval: Option<usize>,
    head_dim: Option<usize>,
    rope_parameters: Option<RopeParameters>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
}

/// `rope_parameters` (transformers 5).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RopeParameters {
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    /// M-RoPE sections (text decoding does not need them; the GGUF export records them).
    pub(crate) mrope_section: Option<Vec<i32>>,
}

fn config_from_hf(top: &HfConfig) -> std::result::Result<Qwen35Config, String> {
    let mt = top.model_type.as_deref().unwrap_or("");
    let classes: Vec<&str> = top.architectures.iter().flatten().map(String::as_str).collect();
    let nested = match mt {
        "qwen3_5" => true,
        "qwen3_5_text" => false,
        "" if classes.contains(&"Qwen3_5ForConditionalGeneration") => true,
        "" if classes.contains(&"Qwen3_5ForCausalLM") => false,
        other => return Err(format!("not a Qwen3.5 dense model (model_type '{other}', architectures {classes:?})")),
    };
    let t: &HfConfig = if nested { top.text_config.as_deref().ok_or("model_type qwen3_5 without a text_config")? } else { top };
    if let Some(a) = &t.hidden_act {
        if a != "silu" && a != "swish" {
            return Err(format!("unsupported activation '{a}'"));
        }
    }
    if t.attention_bias == Some(true) {
        return Err("attention biases (attention_bias) are not supported".into());
    }
    if t.attn_output_gate == Some(false) {
        return Err("attention without the output gate (attn_output_gate false) is not supported".into());
    }
    let n_layers = t.num_hidden_layers.unwrap_or(32);
    let attention_layers: Vec<bool> = match &t.layer_types {
        Some(types) => types
            .iter()
            .map(|x| match x.as_deref() {
                Some("full_attention") => Ok(true),
                Some("linear_attention") => Ok(false),
                other => Err(format!("unsupported layer type {other:?}")),
            })
            .collect::<std::result::Result<_, _>>()?,
        None => {
            let every = t.full_attention_interval.unwrap_or(4).max(1);
            (0..n_layers).map(|l| (l + 1) % every == 0).collect()
        }
    };
    let head_dim = t.head_dim.unwrap_or(256);
    let rp = t.rope_parameters.as_ref();
    if let Some(ty) = rp.and_then(|p| p.rope_type.as_deref()) {
        if ty != "default" {
            return Err(format!("unsupported RoPE type '{ty}'"));
        }
    }
    let theta = rp.and_then(|p| p.rope_theta).unwrap_or(t.rope_theta.unwrap_or(10_000.0));
    let prf = rp.and_then(|p| p.partial_rotary_factor).unwrap_or(t.partial_rotary_factor.unwrap_or(0.25));
    let tie = if nested { top.tie_word_embeddings.or(t.tie_word_embeddings) } else { t.tie_word_embeddings };
    let c = Qwen35Config {
        n_layers,
        d_model: t.hidden_size.unwrap_or(4096),
        ffn_dim: t.intermediate_size.unwrap_or(12288),
        vocab_size: t.vocab_size.unwrap_or(248_320),
        train_ctx: t.max_position_embeddings.unwrap_or(32768),
        norm_eps: t.rms_norm_eps.unwrap_or(1e-6) as f32,
        n_heads: t.num_attention_heads.unwrap_or(16),
        n_kv_heads: t.num_key_value_heads.unwrap_or(4),
        head_dim,
        rope_dims: (head_dim as f64 * prf) as usize,
        rope_theta: theta as f32,
        attention_layers,
        gdn: GdnShape {
            n_k_heads: t.linear_num_key_heads.unwrap_or(16),
            n_v_heads: t.linear_num_value_heads.unwrap_or(32),
            d_k: t.linear_key_head_dim.unwrap_or(128),
            d_v: t.linear_value_head_dim.unwrap_or(128),
            kernel: t.linear_conv_kernel_dim.unwrap_or(4),
            v_tiled: false,
        },
        tie_embeddings: tie.unwrap_or(false),
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

/// What a loader provides; the assembly of the [`Model`] is shared.
pub(crate) trait Source {
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
    fn layer(&mut self, c: &Qwen35Config, l: usize, attention: bool) -> Result<Layer> {
        let (d, qd, kvd, hd, fd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
        let s = c.gdn;
        let attn_norm = self.norm(Role::AttnNorm, l, d)?;
        let mixer = if attention {
            Mixer::Attention(Attention {
                wq: self.matrix(&self.name(Role::Q, l), 2 * qd, d, false)?,
                wk: self.matrix(&self.name(Role::K, l), kvd, d, false)?,
                wv: self.matrix(&self.name(Role::V, l), kvd, d, false)?,
                bq: None,
                bk: None,
                bv: None,
                q_norm: Some(self.norm(Role::QNorm, l, hd)?),
                k_norm: Some(self.norm(Role::KNorm, l, hd)?),
                wo: self.matrix(&self.name(Role::O, l), d, qd, false)?,
                gated: true,
                rope: Rope::new(RopeMode::Neox, c.rope_dims, c.rope_theta, 1.0),
                window: None,
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
        Ok(Layer {
            attn_norm,
            mixer,
            post_attn_norm: None,
            ffn_norm: self.norm(Role::FfnNorm, l, d)?,
            w_gate: self.matrix(&self.name(Role::Gate, l), fd, d, false)?,
            w_up: self.matrix(&self.name(Role::Up, l), fd, d, false)?,
            w_down: self.matrix(&self.name(Role::Down, l), d, fd, false)?,
            post_ffn_norm: None,
        })
    }

    fn load(&mut self, c: Qwen35Config) -> Result<Model> {
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
        let mut m = Model { config: model_config(&c), embed, layers, output_norm, output, mtp };
        m.prepack();
        Ok(m)
    }
}

/// Layer index that names the MTP block's tensors.
pub(crate) const MTP_LAYER: usize = usize::MAX;

/// Tensor roles, named per source by [`Source::name`].
#[derive(Clone, Copy)]
#[allow(missing_docs)]
pub(crate) enum Role {
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

pub(crate) struct HfLoader<'a> {
    pub(crate) t: &'a Tensors,
    pub(crate) quant: Quant,
    pub(crate) pre: &'static str,
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
        import::finite_vector(&self.t.listing, name, self.t.f32_tensor(name, &shape)?)
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
        import::finite_vector(&self.g.path, name, import::dequantize(&self.g.path, info, self.g.tensor_data(info)?)?)
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
pub(crate) fn gguf_name(role: Role, l: usize, n_layers: usize) -> String {
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
