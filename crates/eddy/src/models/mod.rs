//! Decoder-only transformer models.
//!
//! Each supported architecture has one file ([`llama`], [`qwen2`], [`qwen3`], [`gemma3`]) that reads its
//! hyper-parameters into a [`ModelConfig`] and states how it differs from the common pre-norm decoder (biases,
//! q/k norms, extra norms, embedding scale, activation, sliding-window layers, RoPE pairing). The weights
//! ([`Model`]) and the one forward pass ([`forward`]) are shared: prefill, decode and (later) tree
//! verification all run through [`forward`]. GGUF files are read here ([`Model::from_gguf`]); Hugging Face
//! safetensors folders by [`crate::model_dir`], which converts their conventions to the same [`Model`].

pub mod forward;
pub mod gemma3;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;

pub use forward::{forward, Workspace};

use crate::backend::cpu::activation::Activation;
use crate::backend::cpu::rope::{Rope, RopeMode};
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::quant::{import, WeightMatrix};

/// Supported architectures (GGUF `general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama family (SmolLM2).
    Llama,
    /// Qwen2 / Qwen2.5 (q/k/v biases).
    Qwen2,
    /// Qwen3 dense (q/k RMSNorm).
    Qwen3,
    /// Gemma 3 text (1+w norms, pre/post norms, embedding scale, sliding-window layers, GeGLU).
    Gemma3,
    /// Qwen3.5 hybrid (Gated DeltaNet + gated attention): weights, state and forward in [`qwen35`], reached
    /// through [`Model::qwen35`].
    Qwen35,
}

impl Arch {
    /// Parse a GGUF architecture name.
    pub fn from_gguf_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            qwen35::GGUF_ARCH => Arch::Qwen35,
            _ => return None,
        })
    }
}

/// Hyper-parameters and architectural switches of a decoder.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Decoder blocks.
    pub n_layers: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Feed-forward inner width.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Context length the model was trained for.
    pub train_ctx: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// RoPE pairing.
    pub rope_mode: RopeMode,
    /// Rotated dims per head.
    pub rope_dims: usize,
    /// RoPE base of global-attention layers.
    pub rope_theta: f32,
    /// Linear RoPE scaling of global layers (1 = none).
    pub rope_scale: f32,
    /// RoPE base of sliding-window layers (Gemma 3 uses a different one).
    pub rope_theta_local: f32,
    /// Multiplier of q·k.
    pub attn_scale: f32,
    /// Sliding window length, for layers where [`ModelConfig::is_sliding`] holds.
    pub sliding_window: Option<usize>,
    /// Every `n`-th layer (1-based) is global, the others sliding (Gemma 3: 6). 0 = all global.
    pub sliding_pattern: usize,
    /// Multiply embeddings by this (Gemma: √d_model).
    pub embed_scale: Option<f32>,
    /// Feed-forward activation.
    pub activation: Activation,
    /// Gemma-style extra norms after attention and after the FFN.
    pub post_norms: bool,
    /// Final logit soft-capping.
    pub final_softcap: Option<f32>,
}

impl ModelConfig {
    /// Whether layer `l` uses the sliding window.
    pub fn is_sliding(&self, l: usize) -> bool {
        self.sliding_window.is_some() && self.sliding_pattern > 0 && (l + 1) % self.sliding_pattern != 0
    }
    /// `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// `n_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Checks that the attention shape is consistent and that the widths suit eddy's kernels (multiples of
    /// 32); the problem in words otherwise.
    pub fn check_shapes(&self) -> std::result::Result<(), String> {
        let c = self;
        if c.n_heads == 0 || c.n_kv_heads == 0 || c.n_heads % c.n_kv_heads != 0 || c.rope_dims > c.head_dim || c.rope_dims % 2 != 0 {
            return Err(format!(
                "inconsistent attention shape: {} heads, {} kv heads, head_dim {}, rope dims {}",
                c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims
            ));
        }
        if c.d_model % 32 != 0 || c.ffn_dim % 32 != 0 || c.q_dim() % 32 != 0 {
            return Err(format!(
                "unsupported shape: d_model {} / ffn {} / q_dim {} must be multiples of 32",
                c.d_model,
                c.ffn_dim,
                c.q_dim()
            ));
        }
        Ok(())
    }
}

/// Weights of one decoder block.
pub struct Layer {
    /// RMSNorm before attention (`d_model`).
    pub attn_norm: Vec<f32>,
    /// Query projection, `q_dim × d_model`.
    pub wq: WeightMatrix,
    /// Key projection, `kv_dim × d_model`.
    pub wk: WeightMatrix,
    /// Value projection, `kv_dim × d_model`.
    pub wv: WeightMatrix,
    /// Optional biases of q, k, v.
    pub bq: Option<Vec<f32>>,
    /// See `bq`.
    pub bk: Option<Vec<f32>>,
    /// See `bq`.
    pub bv: Option<Vec<f32>>,
    /// Per-head RMSNorm of q and k (`head_dim`), Qwen3/Gemma3.
    pub q_norm: Option<Vec<f32>>,
    /// See `q_norm`.
    pub k_norm: Option<Vec<f32>>,
    /// Output projection, `d_model × q_dim`.
    pub wo: WeightMatrix,
    /// Norm applied to the attention output before the residual add (Gemma).
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm before the FFN.
    pub ffn_norm: Vec<f32>,
    /// Gate projection, `ffn_dim × d_model`.
    pub w_gate: WeightMatrix,
    /// Up projection, `ffn_dim × d_model`.
    pub w_up: WeightMatrix,
    /// Down projection, `d_model × ffn_dim`.
    pub w_down: WeightMatrix,
    /// Norm applied to the FFN output before the residual add (Gemma).
    pub post_ffn_norm: Option<Vec<f32>>,
    /// RoPE of this layer.
    pub rope: Rope,
    /// Sliding window of this layer.
    pub window: Option<usize>,
}

/// A loaded model: configuration and weights in eddy's formats.
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding, `vocab × d_model` (also the LM head when tied).
    pub embed: WeightMatrix,
    /// Decoder blocks.
    pub layers: Vec<Layer>,
    /// Final RMSNorm.
    pub output_norm: Vec<f32>,
    /// Untied LM head, `vocab × d_model`.
    pub output: Option<WeightMatrix>,
    /// A Qwen3.5 hybrid model. When set, the fields above are placeholders (`config` summarises it with
    /// `n_layers` 0, so the engine's own KV cache is empty) and [`forward()`] runs [`qwen35::forward_seq`].
    pub qwen35: Option<Box<qwen35::Qwen35Model>>,
}

impl Model {
    /// The LM head (the embedding when tied).
    pub fn lm_head(&self) -> &WeightMatrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights streamed by one decode step (all matrices once, embedding row excluded unless tied).
    pub fn weight_bytes(&self) -> usize {
        if let Some(m) = &self.qwen35 {
            return m.weight_bytes();
        }
        let mut n = self.lm_head().nbytes();
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                n += w.nbytes();
            }
        }
        n
    }

    /// Every matrix a forward pass multiplies by: the layers' projections and the LM head (the embedding
    /// only when it is the tied head).
    pub fn matmul_weights_mut(&mut self) -> Vec<&mut WeightMatrix> {
        if let Some(m) = &mut self.qwen35 {
            return m.matmul_weights_mut();
        }
        let mut v: Vec<&mut WeightMatrix> = vec![match &mut self.output {
            Some(o) => o,
            None => &mut self.embed,
        }];
        for l in &mut self.layers {
            v.extend([&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.w_gate, &mut l.w_up, &mut l.w_down]);
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

    /// Load a GGUF model. `progress(done, total)` is called as tensors are imported.
    pub fn from_gguf(g: &GgufFile, progress: &mut dyn FnMut(usize, usize)) -> Result<Model> {
        let config = config_from_gguf(g)?;
        if config.arch == Arch::Qwen35 {
            return Ok(qwen35::Qwen35Model::from_gguf(g)?.into_model());
        }
        let loader = GgufLoader { g, config: &config, done: 0, total: g.tensors.len(), progress };
        loader.load()
    }
}

struct GgufLoader<'a> {
    g: &'a GgufFile,
    config: &'a ModelConfig,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl GgufLoader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.g.tensor(name).ok_or_else(|| Error::model(&self.g.path, format!("missing tensor {name}")))
    }

    fn tick(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total);
    }

    /// A matrix with `rows × cols` (HF orientation: out × in).
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix> {
        let info = self.info(name)?;
        let want = [cols as u64, rows as u64];
        if info.dims != want {
            return Err(Error::model(&self.g.path, format!("tensor {name} has shape {:?}, expected {:?}", info.dims, want)));
        }
        let m = import::import_matrix(&self.g.path, info, self.g.tensor_data(info)?)?;
        self.tick();
        Ok(m)
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        if info.n_elements() != n as u64 {
            return Err(Error::model(&self.g.path, format!("tensor {name} has shape {:?}, expected [{n}]", info.dims)));
        }
        let v = import::dequantize(&self.g.path, info, self.g.tensor_data(info)?)?;
        self.tick();
        Ok(v)
    }

    fn opt_vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.g.tensor(name).is_some() {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }

    fn load(mut self) -> Result<Model> {
        let c = self.config.clone();
        let (d, qd, kvd, hd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim);
        let embed = self.matrix("token_embd.weight", c.vocab_size, d)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}");
            let sliding = c.is_sliding(l);
            let rope = if sliding {
                Rope::new(c.rope_mode, c.rope_dims, c.rope_theta_local, 1.0)
            } else {
                Rope::new(c.rope_mode, c.rope_dims, c.rope_theta, c.rope_scale)
            };
            let post = c.post_norms;
            layers.push(Layer {
                attn_norm: self.vector(&p("attn_norm.weight"), d)?,
                wq: self.matrix(&p("attn_q.weight"), qd, d)?,
                wk: self.matrix(&p("attn_k.weight"), kvd, d)?,
                wv: self.matrix(&p("attn_v.weight"), kvd, d)?,
                bq: self.opt_vector(&p("attn_q.bias"), qd)?,
                bk: self.opt_vector(&p("attn_k.bias"), kvd)?,
                bv: self.opt_vector(&p("attn_v.bias"), kvd)?,
                q_norm: self.opt_vector(&p("attn_q_norm.weight"), hd)?,
                k_norm: self.opt_vector(&p("attn_k_norm.weight"), hd)?,
                wo: self.matrix(&p("attn_output.weight"), d, qd)?,
                post_attn_norm: if post { Some(self.vector(&p("post_attention_norm.weight"), d)?) } else { None },
                ffn_norm: self.vector(&p("ffn_norm.weight"), d)?,
                w_gate: self.matrix(&p("ffn_gate.weight"), c.ffn_dim, d)?,
                w_up: self.matrix(&p("ffn_up.weight"), c.ffn_dim, d)?,
                w_down: self.matrix(&p("ffn_down.weight"), d, c.ffn_dim)?,
                post_ffn_norm: if post { Some(self.vector(&p("post_ffw_norm.weight"), d)?) } else { None },
                rope,
                window: if sliding { c.sliding_window } else { None },
            });
        }
        let output_norm = self.vector("output_norm.weight", d)?;
        let output = if self.g.tensor("output.weight").is_some() { Some(self.matrix("output.weight", c.vocab_size, d)?) } else { None };
        let mut m = Model { config: c, embed, layers, output_norm, output, qwen35: None };
        m.prepack();
        Ok(m)
    }
}

/// The architecture's hyper-parameters; errors on an unknown architecture.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let arch_name = g.architecture()?;
    let arch = Arch::from_gguf_name(arch_name).ok_or_else(|| {
        Error::model(&g.path, format!("unknown architecture '{arch_name}' (eddy supports llama, qwen2, qwen3, gemma3, qwen35)"))
    })?;
    match arch {
        Arch::Llama => llama::config(g),
        Arch::Qwen2 => qwen2::config(g),
        Arch::Qwen3 => qwen3::config(g),
        Arch::Gemma3 => gemma3::config(g),
        Arch::Qwen35 => qwen35::summary_config_from_gguf(g),
    }
}

/// Read `{arch}.{key}` as usize.
pub(crate) fn hp(g: &GgufFile, arch: &str, key: &str) -> Result<usize> {
    Ok(g.require_u64(&format!("{arch}.{key}"))? as usize)
}

/// Read `{arch}.{key}` as f32, or `default` when absent.
pub(crate) fn hp_f32_or(g: &GgufFile, arch: &str, key: &str, default: f32) -> Result<f32> {
    let k = format!("{arch}.{key}");
    match g.get(&k) {
        Some(_) => Ok(g.require_f64(&k)? as f32),
        None => Ok(default),
    }
}

/// The hyper-parameters every GGUF decoder shares, with llama-family defaults for the switches.
pub(crate) fn common_config(g: &GgufFile, arch: Arch, name: &str) -> Result<ModelConfig> {
    let d_model = hp(g, name, "embedding_length")?;
    let n_heads = hp(g, name, "attention.head_count")?;
    let n_kv_heads = match g.get(&format!("{name}.attention.head_count_kv")) {
        Some(_) => hp(g, name, "attention.head_count_kv")?,
        None => n_heads,
    };
    let head_dim = match g.get(&format!("{name}.attention.key_length")) {
        Some(_) => hp(g, name, "attention.key_length")?,
        None => d_model / n_heads.max(1),
    };
    let vocab_size = match g.get(&format!("{name}.vocab_size")) {
        Some(_) => hp(g, name, "vocab_size")?,
        None => g
            .tensor("token_embd.weight")
            .map(|t| t.dims.get(1).copied().unwrap_or(0) as usize)
            .ok_or_else(|| Error::model(&g.path, "missing tensor token_embd.weight"))?,
    };
    let rope_dims = match g.get(&format!("{name}.rope.dimension_count")) {
        Some(_) => hp(g, name, "rope.dimension_count")?,
        None => head_dim,
    };
    let rope_theta = hp_f32_or(g, name, "rope.freq_base", 10000.0)?;
    let c = ModelConfig {
        arch,
        n_layers: hp(g, name, "block_count")?,
        d_model,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim: hp(g, name, "feed_forward_length")?,
        vocab_size,
        train_ctx: hp(g, name, "context_length")?,
        norm_eps: hp_f32_or(g, name, "attention.layer_norm_rms_epsilon", 1e-6)?,
        rope_mode: RopeMode::Neox,
        rope_dims,
        rope_theta,
        rope_scale: hp_f32_or(g, name, "rope.scaling.factor", 1.0)?,
        rope_theta_local: rope_theta,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        sliding_window: None,
        sliding_pattern: 0,
        embed_scale: None,
        activation: Activation::Silu,
        post_norms: false,
        final_softcap: None,
    };
    c.check_shapes().map_err(|m| Error::model(&g.path, m))?;
    Ok(c)
}
