//! Decoder-only models: dense transformers and hybrids with Gated DeltaNet layers.
//!
//! Each supported architecture has one file ([`llama`], [`qwen2`], [`qwen3`], [`gemma3`], [`qwen35`]) that
//! reads its hyper-parameters into a [`ModelConfig`], names its tensors and states how it differs from the
//! common pre-norm decoder (biases, q/k norms, extra norms, embedding scale, activation, sliding-window
//! layers, RoPE pairing, output gate, Gated DeltaNet layers, MTP head). The weights ([`Model`]: a [`Layer`] is
//! a token [`Mixer`] plus the FFN) and the one forward pass ([`forward`]) are shared: prefill, decode and tree
//! verification all run through it, generic over the [`crate::backend::Backend`]. GGUF files are read here
//! ([`Model::from_gguf`]); Hugging Face folders by [`hf`] (dense `model_type`s) and [`qwen35`], which convert
//! their conventions to the same [`Model`].

pub mod forward;
pub mod gemma3;
pub mod hf;
pub mod llama;
pub mod quantize;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;

pub use forward::{forward, Workspace};

use crate::backend::{Activation, Backend, Cpu, GdnShape, Rope, RopeMode};
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
    /// Qwen3.5 hybrid: Gated DeltaNet and gated-attention layers, MTP head ([`qwen35`]).
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
    /// Shape of the Gated DeltaNet layers of a hybrid model (Qwen3.5), `None` when every layer is attention.
    pub gdn: Option<GdnShape>,
}

impl ModelConfig {
    /// The settings most architectures share, for struct-update syntax (`ModelConfig { n_layers, …,
    /// ..ModelConfig::plain(arch, head_dim, rope_theta) }`): NeoX RoPE over the whole head with base
    /// `rope_theta` (also for local layers) and no scaling, scores scaled by `1/√head_dim`, SiLU, no sliding
    /// window, embedding scale, post-norms, soft-cap or Gated DeltaNet; RMSNorm epsilon 1e-6. The shape
    /// fields (layers, widths, heads, vocabulary, training context) are 0: set them.
    pub fn plain(arch: Arch, head_dim: usize, rope_theta: f32) -> ModelConfig {
        ModelConfig {
            arch,
            n_layers: 0,
            d_model: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim,
            ffn_dim: 0,
            vocab_size: 0,
            train_ctx: 0,
            norm_eps: 1e-6,
            rope_mode: RopeMode::Neox,
            rope_dims: head_dim,
            rope_theta,
            rope_scale: 1.0,
            rope_theta_local: rope_theta,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            sliding_pattern: 0,
            embed_scale: None,
            activation: Activation::Silu,
            post_norms: false,
            final_softcap: None,
            gdn: None,
        }
    }

    /// Whether layer `l` uses the sliding window.
    pub fn is_sliding(&self, l: usize) -> bool {
        self.sliding_window.is_some() && self.sliding_pattern > 0 && !(l + 1).is_multiple_of(self.sliding_pattern)
    }
    /// `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// `n_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Checks that the attention shape is consistent, that the widths suit eddy's kernels (multiples of
    /// 32) and that the float settings (norm epsilon, RoPE bases and scale, attention scale, embedding scale,
    /// soft-cap) are finite and positive; the problem in words otherwise.
    pub fn check_shapes(&self) -> std::result::Result<(), String> {
        let c = self;
        check_layer_count(c.n_layers)?;
        // Sizes first: a head_dim of 0 would otherwise be reported as an infinite attention scale.
        if c.n_layers == 0
            || c.d_model == 0
            || c.ffn_dim == 0
            || c.vocab_size == 0
            || c.train_ctx == 0
            || c.rope_dims == 0
            || c.head_dim == 0
        {
            return Err(format!(
                "empty model: {} layers, d_model {}, ffn {}, vocabulary {}, context length {}, rope dims {}, head_dim {} (each must be at least 1)",
                c.n_layers, c.d_model, c.ffn_dim, c.vocab_size, c.train_ctx, c.rope_dims, c.head_dim
            ));
        }
        let floats = [
            ("RMSNorm epsilon", Some(c.norm_eps)),
            ("RoPE base (rope_theta / rope.freq_base)", Some(c.rope_theta)),
            ("RoPE base of the sliding-window layers", Some(c.rope_theta_local)),
            ("RoPE scaling factor", Some(c.rope_scale)),
            ("attention scale", Some(c.attn_scale)),
            ("embedding scale", c.embed_scale),
            ("final logit soft-cap", c.final_softcap),
        ];
        for (what, v) in floats {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(format!("invalid {what}: {v} (must be a finite number > 0)"));
            }
        }
        if c.n_heads == 0
            || c.n_kv_heads == 0
            || !c.n_heads.is_multiple_of(c.n_kv_heads)
            || c.rope_dims > c.head_dim
            || !c.rope_dims.is_multiple_of(2)
        {
            return Err(format!(
                "inconsistent attention shape: {} heads, {} kv heads, head_dim {}, rope dims {}",
                c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims
            ));
        }
        if !c.d_model.is_multiple_of(32) || !c.ffn_dim.is_multiple_of(32) || !c.q_dim().is_multiple_of(32) {
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

/// The token mixer of a decoder block: softmax attention (optionally with Qwen3.5's output gate) or a
/// Gated DeltaNet (linear attention with a recurrent state).
#[allow(clippy::large_enum_variant)]
pub enum Mixer<B: Backend = Cpu> {
    /// Softmax attention over the KV cache.
    Attention(Attention<B>),
    /// Gated DeltaNet ([`crate::backend::GdnShape`] in [`ModelConfig::gdn`]).
    DeltaNet(DeltaNet<B>),
}

/// Weights of an attention mixer.
pub struct Attention<B: Backend = Cpu> {
    /// Query projection, `q_dim × d_model` (`2·q_dim × d_model` when `gated`: rows per head `[q_h, gate_h]`).
    pub wq: B::Weights,
    /// Key projection, `kv_dim × d_model`.
    pub wk: B::Weights,
    /// Value projection, `kv_dim × d_model`.
    pub wv: B::Weights,
    /// Optional biases of q, k, v.
    pub bq: Option<B::Buf>,
    /// See `bq`.
    pub bk: Option<B::Buf>,
    /// See `bq`.
    pub bv: Option<B::Buf>,
    /// Per-head RMSNorm of q and k (`head_dim`), Qwen3/Gemma3/Qwen3.5.
    pub q_norm: Option<B::Buf>,
    /// See `q_norm`.
    pub k_norm: Option<B::Buf>,
    /// Output projection, `d_model × q_dim`.
    pub wo: B::Weights,
    /// Output gate (Qwen3.5): `o ⊙ σ(gate)` before `wo`, the gate from the second half of each head's `wq` rows.
    pub gated: bool,
    /// RoPE of this layer.
    pub rope: Rope,
    /// Sliding window of this layer.
    pub window: Option<usize>,
}

/// Weights of a Gated DeltaNet mixer (`docs/qwen35.md`).
pub struct DeltaNet<B: Backend = Cpu> {
    /// `conv_dim × d_model` (`in_proj_qkv`).
    pub w_qkv: B::Weights,
    /// `value_dim × d_model` (`in_proj_z`).
    pub w_z: B::Weights,
    /// `n_v_heads × d_model` (`in_proj_b`).
    pub w_b: B::Weights,
    /// `n_v_heads × d_model` (`in_proj_a`).
    pub w_a: B::Weights,
    /// Depthwise conv, tap-major: `kernel × conv_dim` (see [`crate::backend::cpu::gdn::conv_taps`]).
    pub conv: B::Buf,
    /// `−exp(A_log)`, per value head.
    pub a_neg: B::Buf,
    /// `dt_bias`, per value head.
    pub dt_bias: B::Buf,
    /// Gated RMSNorm weight (`d_v`, plain w).
    pub norm: B::Buf,
    /// `d_model × value_dim` (`out_proj`).
    pub w_out: B::Weights,
}

/// One decoder block: `x += post_norm(mixer(norm(x)))`, `x += post_norm(FFN(norm(x)))`.
pub struct Layer<B: Backend = Cpu> {
    /// RMSNorm before the mixer (`d_model`).
    pub attn_norm: B::Buf,
    /// The token mixer.
    pub mixer: Mixer<B>,
    /// Norm applied to the mixer output before the residual add (Gemma).
    pub post_attn_norm: Option<B::Buf>,
    /// RMSNorm before the FFN.
    pub ffn_norm: B::Buf,
    /// Gate projection, `ffn_dim × d_model`.
    pub w_gate: B::Weights,
    /// Up projection, `ffn_dim × d_model`.
    pub w_up: B::Weights,
    /// Down projection, `d_model × ffn_dim`.
    pub w_down: B::Weights,
    /// Norm applied to the FFN output before the residual add (Gemma).
    pub post_ffn_norm: Option<B::Buf>,
}

/// The multi-token-prediction head of Qwen3.5 checkpoints (vLLM's `Qwen3_5MultiTokenPredictor`;
/// `docs/qwen35.md`): for the hidden state `h_t` (after the final norm) and the next token `x_{t+1}`,
/// `z = fc([RMSNorm₁₊w(embed(x_{t+1})) ; RMSNorm₁₊w(h_t)])`, one attention decoder block with its own KV
/// cache, `h' = RMSNorm₁₊w(z)`, logits for `x_{t+2}` = LM head(h'); chained by feeding `h'` as the next `h`.
pub struct Mtp<B: Backend = Cpu> {
    /// Norm of the token embedding (`d_model`, 1 + w).
    pub emb_norm: B::Buf,
    /// Norm of the hidden state (`d_model`, 1 + w).
    pub hid_norm: B::Buf,
    /// `d_model × 2·d_model`: embedding half first, then the hidden half.
    pub fc: B::Weights,
    /// The attention block.
    pub layer: Layer<B>,
    /// Final norm (1 + w).
    pub norm: B::Buf,
}

/// A loaded model: configuration and weights in the backend's layout (the CPU's by default).
pub struct Model<B: Backend = Cpu> {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding, `vocab × d_model` (also the LM head when tied).
    pub embed: B::Weights,
    /// Decoder blocks.
    pub layers: Vec<Layer<B>>,
    /// Final RMSNorm.
    pub output_norm: B::Buf,
    /// Untied LM head, `vocab × d_model`.
    pub output: Option<B::Weights>,
    /// Multi-token-prediction head, when the checkpoint ships one (Qwen3.5 `mtp.*`).
    pub mtp: Option<Mtp<B>>,
}

impl<B: Backend> Model<B> {
    /// The LM head (the embedding when tied).
    pub fn lm_head(&self) -> &B::Weights {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Whether any layer is a Gated DeltaNet (its state cannot be rewound: see [`crate::state`]).
    pub fn is_hybrid(&self) -> bool {
        self.config.gdn.is_some()
    }
}

impl<B: Backend> Layer<B> {
    /// The attention mixer of this block, `None` for a Gated DeltaNet block.
    pub fn attention(&self) -> Option<&Attention<B>> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }

    /// The matrices of this block, mixer first.
    pub(crate) fn matrices_mut(&mut self) -> Vec<&mut B::Weights> {
        let mut v: Vec<&mut B::Weights> = match &mut self.mixer {
            Mixer::Attention(a) => vec![&mut a.wq, &mut a.wk, &mut a.wv, &mut a.wo],
            Mixer::DeltaNet(g) => vec![&mut g.w_qkv, &mut g.w_z, &mut g.w_b, &mut g.w_a, &mut g.w_out],
        };
        v.extend([&mut self.w_gate, &mut self.w_up, &mut self.w_down]);
        v
    }
}

impl Layer {
    /// This block's weights and norms uploaded to backend `be` (see [`Model::to_backend`]).
    pub fn to_backend<B: Backend>(&self, be: &B) -> Layer<B> {
        let buf = |v: &Vec<f32>| be.upload(v);
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map(|v| be.upload(v));
        let w = |m: &WeightMatrix| be.upload_weights(m.clone());
        let l = self;
        Layer {
            attn_norm: buf(&l.attn_norm),
            mixer: match &l.mixer {
                Mixer::Attention(a) => Mixer::Attention(Attention {
                    wq: w(&a.wq),
                    wk: w(&a.wk),
                    wv: w(&a.wv),
                    bq: opt(&a.bq),
                    bk: opt(&a.bk),
                    bv: opt(&a.bv),
                    q_norm: opt(&a.q_norm),
                    k_norm: opt(&a.k_norm),
                    wo: w(&a.wo),
                    gated: a.gated,
                    rope: a.rope.clone(),
                    window: a.window,
                }),
                Mixer::DeltaNet(g) => Mixer::DeltaNet(DeltaNet {
                    w_qkv: w(&g.w_qkv),
                    w_z: w(&g.w_z),
                    w_b: w(&g.w_b),
                    w_a: w(&g.w_a),
                    conv: buf(&g.conv),
                    a_neg: buf(&g.a_neg),
                    dt_bias: buf(&g.dt_bias),
                    norm: buf(&g.norm),
                    w_out: w(&g.w_out),
                }),
            },
            post_attn_norm: opt(&l.post_attn_norm),
            ffn_norm: buf(&l.ffn_norm),
            w_gate: w(&l.w_gate),
            w_up: w(&l.w_up),
            w_down: w(&l.w_down),
            post_ffn_norm: opt(&l.post_ffn_norm),
        }
    }
}

impl Model {
    /// Checks that the stored rotations fit together (`docs/quant-formats.md`, "Rotation"): matrices that
    /// read one input (q/k/v, gate/up) carry the same input signs or none, and every layer matrix is
    /// rotated on both sides or on neither. A folder that breaks this (a sign tensor missing or renamed)
    /// would compute garbage, or stop at a product whose activations were rotated for other weights.
    ///
    /// Errors: the first mismatch in words (layer and matrices).
    pub fn check_rotations(&self) -> std::result::Result<(), String> {
        let id = |w: &WeightMatrix| w.rotation().and_then(|r| r.input.as_ref().map(|s| s.id));
        for (l, layer) in self.layers.iter().enumerate() {
            let mut mats = vec![("gate_proj", &layer.w_gate), ("up_proj", &layer.w_up), ("down_proj", &layer.w_down)];
            if let Mixer::Attention(a) = &layer.mixer {
                if id(&a.wq) != id(&a.wk) || id(&a.wq) != id(&a.wv) {
                    return Err(format!("layer {l}: q_proj, k_proj and v_proj read one input but carry different input signs"));
                }
                mats.extend([("q_proj", &a.wq), ("k_proj", &a.wk), ("v_proj", &a.wv), ("o_proj", &a.wo)]);
            }
            if id(&layer.w_gate) != id(&layer.w_up) {
                return Err(format!("layer {l}: gate_proj and up_proj read one input but carry different input signs"));
            }
            for (name, w) in mats {
                if let Some(r) = w.rotation().filter(|r| r.input.is_some() != r.output.is_some()) {
                    let (has, lacks) = if r.input.is_some() { ("input", "output") } else { ("output", "input") };
                    return Err(format!("layer {l}: {name} has {has} signs but no {lacks} signs"));
                }
            }
        }
        Ok(())
    }

    /// This model on backend `be`: moved as it is when `B` is the CPU (its host layout is the CPU's), else
    /// uploaded by [`Model::to_backend`] and the host copy dropped.
    ///
    /// Errors: as [`Model::to_backend`].
    pub fn into_backend<B: Backend>(self, be: &B) -> Result<Model<B>> {
        let any: Box<dyn std::any::Any> = Box::new(self);
        match any.downcast::<Model<B>>() {
            Ok(same) => Ok(*same),
            Err(any) => {
                let host = any.downcast::<Model>().expect("a host model");
                host.to_backend(be)
            }
        }
    }

    /// This model's weights and norms uploaded to backend `be` (every [`Backend::Buf`] and
    /// [`crate::quant::WeightMatrix`] copied into its memory and layout; the CPU model is unchanged).
    ///
    /// Errors: a hybrid model (Gated DeltaNet layers) on a backend without those operations
    /// ([`Backend::has_gdn`]).
    pub fn to_backend<B: Backend>(&self, be: &B) -> Result<Model<B>> {
        let hybrid = self.config.gdn.is_some() || self.layers.iter().any(|l| matches!(l.mixer, Mixer::DeltaNet(_)));
        if hybrid && !be.has_gdn() {
            return Err(Error::Input(format!(
                "this backend has no Gated DeltaNet kernels: the hybrid {:?} model runs on the CPU only",
                self.config.arch
            )));
        }
        let buf = |v: &Vec<f32>| be.upload(v);
        let w = |m: &WeightMatrix| be.upload_weights(m.clone());
        let layer = |l: &Layer| l.to_backend(be);
        Ok(Model {
            config: self.config.clone(),
            embed: w(&self.embed),
            layers: self.layers.iter().map(layer).collect(),
            output_norm: buf(&self.output_norm),
            output: self.output.as_ref().map(w),
            mtp: self.mtp.as_ref().map(|m| Mtp {
                emb_norm: buf(&m.emb_norm),
                hid_norm: buf(&m.hid_norm),
                fc: w(&m.fc),
                layer: layer(&m.layer),
                norm: buf(&m.norm),
            }),
        })
    }

    /// Bytes of weights streamed by one decode step (all matrices once, embedding row excluded unless tied;
    /// the MTP head excluded).
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

    /// Every matrix a forward pass multiplies by: the layers' projections, the MTP head's, and the LM head
    /// (the embedding only when it is the tied head).
    pub fn matmul_weights_mut(&mut self) -> Vec<&mut WeightMatrix> {
        let mut v: Vec<&mut WeightMatrix> = vec![match &mut self.output {
            Some(o) => o,
            None => &mut self.embed,
        }];
        if let Some(m) = &mut self.mtp {
            v.push(&mut m.fc);
            v.extend(m.layer.matrices_mut());
        }
        for l in &mut self.layers {
            v.extend(l.matrices_mut());
        }
        v
    }

    /// Upload every matmul weight to the CPU backend: build the prepacked layout of the quantized ones
    /// when [`crate::backend::cpu::prepack_wanted`] (the loaders call this).
    pub fn prepack(&mut self) {
        Cpu::upload_all(self.matmul_weights_mut());
    }

    /// Load a GGUF model. `progress(done, total)` is called as tensors are imported.
    pub fn from_gguf(g: &GgufFile, progress: &mut dyn FnMut(usize, usize)) -> Result<Model> {
        let config = config_from_gguf(g)?;
        if config.arch == Arch::Qwen35 {
            return qwen35::load_gguf(g);
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
        let v = import::finite_vector(&self.g.path, name, import::dequantize(&self.g.path, info, self.g.tensor_data(info)?)?)?;
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
                mixer: Mixer::Attention(Attention {
                    wq: self.matrix(&p("attn_q.weight"), qd, d)?,
                    wk: self.matrix(&p("attn_k.weight"), kvd, d)?,
                    wv: self.matrix(&p("attn_v.weight"), kvd, d)?,
                    bq: self.opt_vector(&p("attn_q.bias"), qd)?,
                    bk: self.opt_vector(&p("attn_k.bias"), kvd)?,
                    bv: self.opt_vector(&p("attn_v.bias"), kvd)?,
                    q_norm: self.opt_vector(&p("attn_q_norm.weight"), hd)?,
                    k_norm: self.opt_vector(&p("attn_k_norm.weight"), hd)?,
                    wo: self.matrix(&p("attn_output.weight"), d, qd)?,
                    gated: false,
                    rope,
                    window: if sliding { c.sliding_window } else { None },
                }),
                post_attn_norm: if post { Some(self.vector(&p("post_attention_norm.weight"), d)?) } else { None },
                ffn_norm: self.vector(&p("ffn_norm.weight"), d)?,
                w_gate: self.matrix(&p("ffn_gate.weight"), c.ffn_dim, d)?,
                w_up: self.matrix(&p("ffn_up.weight"), c.ffn_dim, d)?,
                w_down: self.matrix(&p("ffn_down.weight"), d, c.ffn_dim)?,
                post_ffn_norm: if post { Some(self.vector(&p("post_ffw_norm.weight"), d)?) } else { None },
            });
        }
        let output_norm = self.vector("output_norm.weight", d)?;
        let output = if self.g.tensor("output.weight").is_some() { Some(self.matrix("output.weight", c.vocab_size, d)?) } else { None };
        let mut m = Model { config: c, embed, layers, output_norm, output, mtp: None };
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
        Arch::Qwen35 => qwen35::config_from_gguf_file(g),
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

/// Most decoder layers a model may declare: far above any real model's (about 130), low enough that a
/// corrupt count is refused before anything is sized by it.
pub const MAX_LAYERS: usize = 4096;

/// Refuses a layer count above [`MAX_LAYERS`] (a corrupt header or config), before per-layer tables are
/// allocated.
pub(crate) fn check_layer_count(n: usize) -> std::result::Result<(), String> {
    if n > MAX_LAYERS {
        return Err(format!("{n} layers (at most {MAX_LAYERS}: a corrupt layer count?)"));
    }
    Ok(())
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
    let n_layers = hp(g, name, "block_count")?;
    check_layer_count(n_layers).map_err(|m| Error::model(&g.path, format!("{name}.block_count: {m}")))?;
    let c = ModelConfig {
        n_layers,
        d_model,
        n_heads,
        n_kv_heads,
        ffn_dim: hp(g, name, "feed_forward_length")?,
        vocab_size,
        train_ctx: hp(g, name, "context_length")?,
        norm_eps: hp_f32_or(g, name, "attention.layer_norm_rms_epsilon", 1e-6)?,
        rope_dims,
        rope_scale: hp_f32_or(g, name, "rope.scaling.factor", 1.0)?,
        ..ModelConfig::plain(arch, head_dim, rope_theta)
    };
    c.check_shapes().map_err(|m| Error::model(&g.path, m))?;
    // Layers the header does not count would be silently left out of the forward.
    if let Some(t) = g.tensors.iter().find(|t| layer_of(&t.name).is_some_and(|l| l >= c.n_layers)) {
        return Err(Error::model(&g.path, format!("tensor {} lies beyond {name}.block_count = {}", t.name, c.n_layers)));
    }
    Ok(c)
}

/// The layer index of a GGUF tensor name `blk.N.…`.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}
