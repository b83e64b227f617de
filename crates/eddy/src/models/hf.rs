//! Dense models from Hugging Face folders: `config.json` (serde types) and the tensor names of the llama, qwen2,
//! qwen3 and gemma3 families; the weights come through [`crate::model_dir::Tensors`].
//!
//! A folder holds `config.json`, the weights in `model.safetensors` or in shards listed by
//! `model.safetensors.index.json`, `tokenizer.json` (+ `tokenizer_config.json`) and optionally a chat
//! template (see [`ChatTemplate::from_dir`]). Supported `model_type`s: `llama`, `qwen2`, `qwen3`,
//! `gemma3_text` (and `gemma3` with a nested `text_config`, whose vision tower is ignored). Fields missing
//! from `config.json` take transformers' defaults for the architecture. Both the transformers-5 form of the
//! RoPE settings (`rope_parameters`, per layer type for Gemma 3) and the older one (`rope_theta`,
//! `rope_scaling`, `rope_local_base_freq`) are read; RoPE types other than `default` and `linear` are
//! rejected.
//!
//! Hugging Face conventions differ from llama.cpp's GGUF ones, and are converted here:
//! - RoPE: transformers rotates halves (`rotate_half`) on unpermuted q/k rows, i.e. [`RopeMode::Neox`] for
//!   every architecture (llama.cpp's converter permutes llama's q/k rows to use adjacent pairs instead);
//! - Gemma 3 RMSNorms are stored as `w` and applied as `(1 + w)`: 1 is added at load (the GGUF converter
//!   stores `1 + w`), for all block norms, q/k norms and the final norm;
//! - Gemma 3's `post_attention_layernorm` normalizes the attention *output* (eddy's `post_attn_norm`) and
//!   `pre_feedforward_layernorm` is the norm before the FFN (`ffn_norm`), whereas for llama/qwen
//!   `post_attention_layernorm` is the norm before the FFN;
//! - per-layer sliding windows come from `layer_types` (Gemma 3, or Qwen with `use_sliding_window`);
//!   Gemma 3's attention scale is `query_pre_attn_scalar^-1/2`.

use crate::backend::{Activation, Rope, RopeMode};
use crate::error::{Error, Result};
use crate::model_dir::{Quant, Tensors, CONFIG_FILE};
use crate::models::{Arch, Attention, Layer, Mixer, Model, ModelConfig};
use crate::quant::WeightMatrix;
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Load the model of a Hugging Face folder (weights only: [`crate::load::load_dir`] adds the tokenizer);
/// `progress(done, total)` is called as tensors are imported.
///
/// Errors ([`Error::Model`] naming the file at fault): missing or malformed `config.json`, unknown
/// `model_type`, unsupported settings, missing weights, tensors that are missing, of the wrong shape or of
/// an unsupported dtype.
pub fn load_model(dir: &Path, quant: Quant, progress: &mut dyn FnMut(usize, usize)) -> Result<Model> {
    refuse_foreign_quantization(dir)?;
    if quant != Quant::None && quantized_by_eddy(dir) {
        return Err(Error::Input(format!(
            "{}: --quant {quant} is for unquantized safetensors folders; this one was written by `eddy quantize` and is used as quantized (leave --quant out)",
            dir.display()
        )));
    }
    if super::qwen35::is_qwen35_dir(dir) {
        return super::qwen35::load_dir(dir, quant);
    }
    let hf = HfConfig::read(dir)?;
    let plan = Plan::new(&hf, &dir.join(CONFIG_FILE))?;
    let tensors = Tensors::open(dir)?;
    DirLoader::new(&tensors, &plan, quant, progress)?.load()
}

/// The hyper-parameters of a Hugging Face folder's `config.json` as eddy's [`ModelConfig`].
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    refuse_foreign_quantization(dir)?;
    if super::qwen35::is_qwen35_dir(dir) {
        return super::qwen35::config_from_dir(dir);
    }
    let hf = HfConfig::read(dir)?;
    Ok(Plan::new(&hf, &dir.join(CONFIG_FILE))?.config)
}

/// Whether the folder's `config.json` says `eddy quantize` wrote it (`quantization_config.quant_method` "eddy").
fn quantized_by_eddy(dir: &Path) -> bool {
    let Some(cfg) = std::fs::read_to_string(dir.join(CONFIG_FILE)).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) else {
        return false;
    };
    let q = cfg.get("quantization_config").or_else(|| cfg.get("text_config").and_then(|t| t.get("quantization_config")));
    q.and_then(|q| q.get("quant_method")).and_then(Value::as_str) == Some("eddy")
}

/// Refuse a folder whose `config.json` names a `quantization_config` eddy does not read (GPTQ, AWQ, FP8,
/// bitsandbytes, …: their tensors are packed codes under other names), with what to give instead; eddy's own
/// (`quant_method` "eddy", written by `eddy quantize`) passes. A folder without `config.json`, or with one that
/// does not parse, passes too: the config reader reports those.
fn refuse_foreign_quantization(dir: &Path) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    let Some(cfg) = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) else {
        return Ok(());
    };
    let Some(q) = cfg.get("quantization_config").or_else(|| cfg.get("text_config").and_then(|t| t.get("quantization_config"))) else {
        return Ok(());
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("an unnamed method");
    if method == "eddy" {
        return Ok(());
    }
    Err(Error::model(
        &path,
        format!(
            "the weights are quantized by {method} (quantization_config), which eddy does not read: give the original \
             (unquantized) safetensors folder, a GGUF file, or a folder written by `eddy quantize`"
        ),
    ))
}

// ---------------------------------------------------------------------------------------------------------
// config.json

/// The fields of `config.json` eddy reads (all optional: missing ones take transformers' defaults).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    text_config: Option<Box<HfConfig>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    rope_theta: Option<f64>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    rope_local_base_freq: Option<f64>,
    partial_rotary_factor: Option<f64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
}

impl HfConfig {
    fn read(dir: &Path) -> Result<HfConfig> {
        let path = dir.join(CONFIG_FILE);
        if !dir.is_dir() {
            return Err(Error::model(dir, "not a folder"));
        }
        if !path.is_file() {
            return Err(Error::model(&path, "missing: not a Hugging Face model folder (no config.json)"));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
        serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed config: {e}")))
    }
}

/// transformers' class defaults of one architecture (used for fields `config.json` leaves out).
struct Defaults {
    vocab: usize,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: Option<usize>,
    head_dim: Option<usize>,
    max_pos: usize,
    eps: f64,
    theta: f64,
    tie: bool,
}

fn defaults(arch: Arch) -> Defaults {
    match arch {
        Arch::Llama => Defaults {
            vocab: 32000,
            hidden: 4096,
            ffn: 11008,
            layers: 32,
            heads: 32,
            kv_heads: None,
            head_dim: None,
            max_pos: 2048,
            eps: 1e-6,
            theta: 10_000.0,
            tie: false,
        },
        // Qwen3.5 folders load through models::qwen35 and never reach the plan; its defaults are Qwen's.
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35 => Defaults {
            vocab: 151_936,
            hidden: 4096,
            ffn: 22016,
            layers: 32,
            heads: 32,
            kv_heads: Some(32),
            head_dim: (arch == Arch::Qwen3).then_some(128),
            max_pos: 32768,
            eps: 1e-6,
            theta: 10_000.0,
            tie: false,
        },
        Arch::Gemma3 => Defaults {
            vocab: 262_208,
            hidden: 2304,
            ffn: 9216,
            layers: 26,
            heads: 8,
            kv_heads: Some(4),
            head_dim: Some(256),
            max_pos: 131_072,
            eps: 1e-6,
            theta: 1_000_000.0,
            tie: true,
        },
    }
}

/// Gemma 3 defaults not in [`Defaults`].
const GEMMA3_LOCAL_THETA: f64 = 10_000.0;
const GEMMA3_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
const GEMMA3_SLIDING_WINDOW: usize = 4096;
const GEMMA3_SLIDING_PATTERN: usize = 6;
/// Qwen2/Qwen3 default of `max_window_layers`.
const QWEN_MAX_WINDOW_LAYERS: usize = 28;

/// Everything the weight loader needs besides the tensors.
struct Plan {
    config: ModelConfig,
    /// Per layer: sliding window (None = global attention).
    windows: Vec<Option<usize>>,
    /// RoPE of global and of sliding layers.
    rope_global: Rope,
    rope_local: Rope,
    tie: bool,
    /// Whether the text model is nested (`gemma3` multimodal checkpoints).
    nested: bool,
    config_path: PathBuf,
}

/// (theta, linear scale, partial rotary factor) from one RoPE parameter object.
fn rope_from_params(p: &Value, default_theta: f64, path: &Path, what: &str) -> Result<(f64, f64, Option<f64>)> {
    let obj = p.as_object().ok_or_else(|| Error::model(path, format!("{what} is not an object")))?;
    let theta = obj.get("rope_theta").and_then(Value::as_f64).unwrap_or(default_theta);
    let ty = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
    let scale = match ty {
        "default" => 1.0,
        "linear" => obj
            .get("factor")
            .and_then(Value::as_f64)
            .filter(|f| *f > 0.0)
            .ok_or_else(|| Error::model(path, format!("{what}: linear RoPE scaling without a positive factor")))?,
        other => return Err(Error::model(path, format!("{what}: unsupported RoPE type '{other}' (eddy supports default and linear)"))),
    };
    Ok((theta, scale, obj.get("partial_rotary_factor").and_then(Value::as_f64)))
}

/// Whether a `rope_parameters` object is nested by layer type.
fn is_nested_rope(p: &Value) -> bool {
    p.as_object().is_some_and(|o| o.contains_key("full_attention") || o.contains_key("sliding_attention"))
}

impl Plan {
    fn new(top: &HfConfig, path: &Path) -> Result<Plan> {
        let (arch, c, nested) = Self::arch(top, path)?;
        let d = defaults(arch);
        let bad = |m: String| Error::model(path, m);

        let d_model = c.hidden_size.unwrap_or(d.hidden);
        let n_heads = c.num_attention_heads.unwrap_or(d.heads);
        let n_kv_heads = c.num_key_value_heads.or(d.kv_heads).unwrap_or(n_heads);
        if n_heads == 0 {
            return Err(bad("num_attention_heads is 0".into()));
        }
        let head_dim = c.head_dim.or(d.head_dim).unwrap_or(d_model / n_heads);
        let n_layers = c.num_hidden_layers.unwrap_or(d.layers);
        super::check_layer_count(n_layers).map_err(|m| bad(format!("num_hidden_layers: {m}")))?;

        // Activation.
        let act_name = c.hidden_activation.as_deref().or(c.hidden_act.as_deref());
        let activation = match (arch, act_name) {
            (Arch::Gemma3, None | Some("gelu_pytorch_tanh") | Some("gelu_tanh")) => Activation::GeluTanh,
            (Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35, None | Some("silu") | Some("swish")) => Activation::Silu,
            (_, Some(a)) => return Err(bad(format!("unsupported activation '{a}'"))),
        };
        if c.attn_logit_softcapping.is_some() {
            return Err(bad("attention logit soft-capping (attn_logit_softcapping) is not supported".into()));
        }
        if c.use_bidirectional_attention == Some(true) {
            return Err(bad("bidirectional attention (embedding models) is not supported".into()));
        }
        if c.mlp_bias == Some(true) {
            return Err(bad("biases on the MLP projections (mlp_bias) are not supported".into()));
        }

        // Which layers slide, and over how many positions.
        let layer_sliding: Vec<bool> = match (&c.layer_types, arch) {
            (Some(types), _) => {
                if types.len() != n_layers {
                    return Err(bad(format!("layer_types has {} entries for {n_layers} layers", types.len())));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "full_attention" => Ok(false),
                        "sliding_attention" => Ok(true),
                        other => Err(bad(format!("unsupported layer type '{other}'"))),
                    })
                    .collect::<Result<_>>()?
            }
            (None, Arch::Gemma3) => {
                let p = c.sliding_window_pattern.or(c.sliding_window_pattern_private).unwrap_or(GEMMA3_SLIDING_PATTERN);
                (0..n_layers).map(|l| p > 0 && (l + 1) % p != 0).collect()
            }
            (None, Arch::Qwen2 | Arch::Qwen3) => {
                let first = c.max_window_layers.unwrap_or(QWEN_MAX_WINDOW_LAYERS);
                (0..n_layers).map(|l| l >= first).collect()
            }
            (None, Arch::Llama | Arch::Qwen35) => vec![false; n_layers],
        };
        let window = match arch {
            Arch::Gemma3 => Some(c.sliding_window.unwrap_or(GEMMA3_SLIDING_WINDOW)),
            Arch::Qwen2 | Arch::Qwen3 if c.use_sliding_window == Some(true) => c.sliding_window,
            _ => None,
        };
        let windows: Vec<Option<usize>> = layer_sliding.iter().map(|&s| if s { window } else { None }).collect();
        if windows.contains(&Some(0)) {
            return Err(bad("sliding_window is 0".into()));
        }

        // RoPE of global and sliding layers.
        let ((theta, scale, prf), (theta_local, scale_local, prf_local)) = match (&c.rope_parameters, arch) {
            (Some(p), _) if is_nested_rope(p) => {
                let get = |key: &str, default: f64| match p.get(key) {
                    Some(v) if !v.is_null() => rope_from_params(v, default, path, &format!("rope_parameters.{key}")),
                    _ => Ok((default, 1.0, None)),
                };
                let global_default = c.rope_theta.unwrap_or(d.theta);
                let local_default = match arch {
                    Arch::Gemma3 => c.rope_local_base_freq.unwrap_or(GEMMA3_LOCAL_THETA),
                    _ => global_default,
                };
                (get("full_attention", global_default)?, get("sliding_attention", local_default)?)
            }
            (Some(p), _) if !p.is_null() => {
                let g = rope_from_params(p, c.rope_theta.unwrap_or(d.theta), path, "rope_parameters")?;
                (g, g)
            }
            _ => {
                let theta = c.rope_theta.unwrap_or(d.theta);
                let global = match &c.rope_scaling {
                    Some(s) if !s.is_null() => {
                        let mut s = s.clone();
                        if let Some(o) = s.as_object_mut() {
                            o.insert("rope_theta".into(), theta.into());
                        }
                        rope_from_params(&s, theta, path, "rope_scaling")?
                    }
                    _ => (theta, 1.0, None),
                };
                let local = if arch == Arch::Gemma3 { (c.rope_local_base_freq.unwrap_or(GEMMA3_LOCAL_THETA), 1.0, None) } else { global };
                (global, local)
            }
        };
        if scale_local != 1.0 && layer_sliding.iter().any(|&s| s) && arch == Arch::Gemma3 {
            return Err(bad("RoPE scaling on sliding-window layers is not supported".into()));
        }
        let prf = prf.or(prf_local).or(c.partial_rotary_factor).unwrap_or(1.0);
        let rope_dims = (head_dim as f64 * prf) as usize;

        let attn_scale = match arch {
            Arch::Gemma3 => {
                let s = c.query_pre_attn_scalar.unwrap_or(GEMMA3_QUERY_PRE_ATTN_SCALAR);
                if s <= 0.0 {
                    return Err(bad(format!("query_pre_attn_scalar must be positive, is {s}")));
                }
                s.powf(-0.5) as f32
            }
            _ => (head_dim as f64).powf(-0.5) as f32,
        };
        let any_sliding = windows.iter().any(Option::is_some);
        let config = ModelConfig {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: c.intermediate_size.unwrap_or(d.ffn),
            vocab_size: c.vocab_size.unwrap_or(d.vocab),
            train_ctx: c.max_position_embeddings.unwrap_or(d.max_pos),
            norm_eps: c.rms_norm_eps.unwrap_or(d.eps) as f32,
            rope_mode: RopeMode::Neox,
            rope_dims,
            rope_theta: theta as f32,
            rope_scale: scale as f32,
            rope_theta_local: theta_local as f32,
            attn_scale,
            sliding_window: if any_sliding { window } else { None },
            sliding_pattern: if any_sliding { sliding_pattern(&layer_sliding) } else { 0 },
            embed_scale: (arch == Arch::Gemma3).then(|| (d_model as f32).sqrt()),
            activation,
            post_norms: arch == Arch::Gemma3,
            final_softcap: if arch == Arch::Gemma3 { c.final_logit_softcapping.map(|v| v as f32) } else { None },
            gdn: None,
        };
        config.check_shapes().map_err(bad)?;
        if config.vocab_size == 0 || config.n_layers == 0 {
            return Err(bad("vocab_size and num_hidden_layers must be positive".into()));
        }
        let tie = c.tie_word_embeddings.or(top.tie_word_embeddings).unwrap_or(d.tie);
        Ok(Plan {
            windows,
            rope_global: Rope::new(RopeMode::Neox, rope_dims, theta as f32, scale as f32),
            rope_local: Rope::new(RopeMode::Neox, rope_dims, theta_local as f32, scale_local as f32),
            config,
            tie,
            nested,
            config_path: path.to_path_buf(),
        })
    }

    /// The architecture, the (possibly nested) text config, and whether it was nested.
    fn arch<'a>(top: &'a HfConfig, path: &Path) -> Result<(Arch, &'a HfConfig, bool)> {
        let from_type = |t: &str| match t {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3_text" => Some(Arch::Gemma3),
            _ => None,
        };
        let from_class = |a: &str| match a {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "Gemma3ForCausalLM" => Some(Arch::Gemma3),
            _ => None,
        };
        let unknown = |what: String| {
            Error::model(path, format!("unsupported model {what} (eddy supports llama, qwen2, qwen3, gemma3 / gemma3_text)"))
        };
        match top.model_type.as_deref() {
            Some("gemma3") => match &top.text_config {
                Some(t) => Ok((Arch::Gemma3, t, true)),
                None => Ok((Arch::Gemma3, top, false)),
            },
            Some(t) => from_type(t).map(|a| (a, top, false)).ok_or_else(|| unknown(format!("type '{t}'"))),
            None => {
                let classes = top.architectures.as_deref().unwrap_or(&[]);
                classes
                    .iter()
                    .find_map(|a| from_class(a))
                    .map(|a| (a, top, false))
                    .ok_or_else(|| unknown(format!("architectures {classes:?} (no model_type)")))
            }
        }
    }
}

/// The smallest `p` with "layer `l` slides ⇔ `(l + 1) % p != 0`" for every layer (see
/// [`ModelConfig::is_sliding`]), or 0 when no such `p` exists (the per-layer windows in [`Layer::window`]
/// are authoritative either way).
fn sliding_pattern(sliding: &[bool]) -> usize {
    (1..=sliding.len() + 1).find(|&p| sliding.iter().enumerate().all(|(l, &s)| s == ((l + 1) % p != 0))).unwrap_or(0)
}

/// Which storage a matrix gets under [`Quant::Q4`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Projection,
    /// Embedding / LM head: int8 even under Q4.
    Vocab,
}

struct DirLoader<'a> {
    t: &'a Tensors,
    plan: &'a Plan,
    quant: Quant,
    /// Prefix of the text model's tensors (`model.` or a nested form).
    prefix: String,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl<'a> DirLoader<'a> {
    fn new(t: &'a Tensors, plan: &'a Plan, quant: Quant, progress: &'a mut dyn FnMut(usize, usize)) -> Result<Self> {
        let candidates: &[&str] = if plan.nested { &["model.language_model.", "language_model.model.", "model."] } else { &["model."] };
        let prefix = candidates
            .iter()
            .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::model(&t.listing, format!("missing tensor {}embed_tokens.weight", candidates[0])))?
            .to_string();
        let mut total = t.names().filter(|n| n.starts_with(&prefix) && !n.ends_with("inv_freq")).count();
        if !plan.tie {
            total += 1;
        }
        Ok(DirLoader { t, plan, quant, prefix, done: 0, total, progress })
    }

    fn tick(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total.max(self.done));
    }

    /// A `rows × cols` matrix (out × in, as stored by PyTorch).
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, role: Role) -> Result<WeightMatrix> {
        let m = self.t.matrix(name, rows, cols, self.quant, role == Role::Vocab)?;
        self.tick();
        Ok(m)
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let v = crate::quant::import::finite_vector(&self.t.listing, name, self.t.f32_tensor(name, &[n])?)?;
        self.tick();
        Ok(v)
    }

    fn opt_vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.t.contains(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }

    /// An RMSNorm weight; Gemma's `(1 + w)` convention is folded in.
    fn norm(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let mut w = self.vector(name, n)?;
        if self.plan.config.arch == Arch::Gemma3 {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    }

    fn reject(&self, name: &str, what: &str) -> Result<()> {
        match self.t.file_of(name) {
            Some(path) => Err(Error::model(path, format!("tensor {name}: {what} is not supported"))),
            None => Ok(()),
        }
    }

    fn load(mut self) -> Result<Model> {
        let plan = self.plan;
        let c = plan.config.clone();
        let (d, qd, kvd, hd, fd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
        let gemma = c.arch == Arch::Gemma3;
        let pre = self.prefix.clone();
        let embed = self.matrix(&format!("{pre}embed_tokens.weight"), c.vocab_size, d, Role::Vocab)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("{pre}layers.{l}.{s}");
            self.reject(&p("self_attn.o_proj.bias"), "a bias on the attention output")?;
            for m in ["gate_proj", "up_proj", "down_proj"] {
                self.reject(&p(&format!("mlp.{m}.bias")), "a bias on the MLP")?;
            }
            let bias = |s: &mut Self, name: &str, n: usize| -> Result<Option<Vec<f32>>> {
                if c.arch == Arch::Qwen2 {
                    s.vector(&p(name), n).map(Some)
                } else {
                    s.opt_vector(&p(name), n)
                }
            };
            let attn_norm = self.norm(&p("input_layernorm.weight"), d)?;
            let wq = self.matrix(&p("self_attn.q_proj.weight"), qd, d, Role::Projection)?;
            let wk = self.matrix(&p("self_attn.k_proj.weight"), kvd, d, Role::Projection)?;
            let wv = self.matrix(&p("self_attn.v_proj.weight"), kvd, d, Role::Projection)?;
            let bq = bias(&mut self, "self_attn.q_proj.bias", qd)?;
            let bk = bias(&mut self, "self_attn.k_proj.bias", kvd)?;
            let bv = bias(&mut self, "self_attn.v_proj.bias", kvd)?;
            let (q_norm, k_norm) = if matches!(c.arch, Arch::Qwen3 | Arch::Gemma3) {
                (Some(self.norm(&p("self_attn.q_norm.weight"), hd)?), Some(self.norm(&p("self_attn.k_norm.weight"), hd)?))
            } else {
                (None, None)
            };
            let wo = self.matrix(&p("self_attn.o_proj.weight"), d, qd, Role::Projection)?;
            let (post_attn_norm, ffn_norm, post_ffn_norm) = if gemma {
                (
                    Some(self.norm(&p("post_attention_layernorm.weight"), d)?),
                    self.norm(&p("pre_feedforward_layernorm.weight"), d)?,
                    Some(self.norm(&p("post_feedforward_layernorm.weight"), d)?),
                )
            } else {
                (None, self.norm(&p("post_attention_layernorm.weight"), d)?, None)
            };
            let w_gate = self.matrix(&p("mlp.gate_proj.weight"), fd, d, Role::Projection)?;
            let w_up = self.matrix(&p("mlp.up_proj.weight"), fd, d, Role::Projection)?;
            let w_down = self.matrix(&p("mlp.down_proj.weight"), d, fd, Role::Projection)?;
            let window = plan.windows[l];
            let rope = if window.is_some() { plan.rope_local.clone() } else { plan.rope_global.clone() };
            let mixer = Mixer::Attention(Attention { wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo, gated: false, rope, window });
            layers.push(Layer { attn_norm, mixer, post_attn_norm, ffn_norm, w_gate, w_up, w_down, post_ffn_norm });
        }
        let output_norm = self.norm(&format!("{pre}norm.weight"), d)?;
        let output = if plan.tie {
            None
        } else {
            let name = ["lm_head.weight", "language_model.lm_head.weight"].into_iter().find(|n| self.t.contains(n)).ok_or_else(|| {
                Error::model(
                    &self.t.listing,
                    format!("missing tensor lm_head.weight ({} says tie_word_embeddings is false)", plan.config_path.display()),
                )
            })?;
            Some(self.matrix(name, c.vocab_size, d, Role::Vocab)?)
        };
        // Layers the config does not count (num_hidden_layers smaller than the weights) would be dropped
        // silently and the model compute garbage.
        let layers_prefix = format!("{pre}layers.");
        let extra = self.t.names().filter_map(|n| n.strip_prefix(&layers_prefix)?.split('.').next()?.parse::<usize>().ok()).max();
        if let Some(last) = extra.filter(|&l| l >= c.n_layers) {
            return Err(Error::model(
                &plan.config_path,
                format!(
                    "num_hidden_layers is {}, but the weights hold layer {last} ({} in the folder)",
                    c.n_layers,
                    self.t.listing.display()
                ),
            ));
        }
        let mut m = Model { config: c, embed, layers, output_norm, output, mtp: None };
        m.check_rotations().map_err(|e| Error::model(&self.t.listing, format!("{e} (a damaged eddy folder?)")))?;
        m.prepack();
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_pattern_matches_is_sliding() {
        assert_eq!(sliding_pattern(&[true, true, true, true, true, false, true]), 6);
        assert_eq!(sliding_pattern(&[true, false]), 2);
        assert_eq!(sliding_pattern(&[false, false]), 1);
        assert_eq!(sliding_pattern(&[false, true]), 0);
    }

    fn plan(json: &str) -> Result<Plan> {
        let c: HfConfig = serde_json::from_str(json).unwrap();
        Plan::new(&c, Path::new("config.json"))
    }

    #[test]
    fn old_style_gemma3_config() {
        // gemma-3-1b-it's config.json as written by transformers 4.50 (no layer_types, no rope_parameters).
        let p = plan(
            r#"{"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": null, "final_logit_softcapping": null,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
            "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
            "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512,
            "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}"#,
        )
        .unwrap();
        let c = &p.config;
        assert_eq!((c.arch, c.n_layers, c.head_dim, c.n_kv_heads, c.vocab_size), (Arch::Gemma3, 26, 256, 1, 262144));
        assert_eq!((c.rope_theta, c.rope_theta_local, c.rope_scale), (1e6, 1e4, 1.0));
        assert_eq!((c.sliding_window, c.sliding_pattern), (Some(512), 6));
        assert_eq!(c.final_softcap, None);
        assert!(p.tie);
        for l in 0..26 {
            assert_eq!(p.windows[l].is_some(), c.is_sliding(l), "layer {l}");
        }
        assert_eq!(p.windows[5], None);
        assert_eq!(c.embed_scale, Some(1152f32.sqrt()));
    }

    #[test]
    fn nested_gemma3_config_with_linear_scaling() {
        let p = plan(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}"#,
        )
        .unwrap();
        let c = &p.config;
        assert!(p.nested);
        assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size), (8, 4, 256, 262_208));
        assert_eq!((c.rope_theta, c.rope_scale, c.rope_theta_local), (1e6, 8.0, 1e4));
        assert_eq!(p.rope_local.inv_freq[1], Rope::new(RopeMode::Neox, 256, 1e4, 1.0).inv_freq[1]);
        assert_eq!(p.rope_global.inv_freq[1], Rope::new(RopeMode::Neox, 256, 1e6, 8.0).inv_freq[1]);
    }

    #[test]
    fn old_style_llama_and_qwen_configs() {
        let p = plan(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
            "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
            "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 100000,
            "tie_word_embeddings": true, "vocab_size": 49152}"#,
        )
        .unwrap();
        let c = &p.config;
        assert_eq!((c.head_dim, c.rope_theta, c.rope_mode, c.norm_eps), (64, 1e5, RopeMode::Neox, 1e-5));
        assert!(p.tie && p.windows.iter().all(Option::is_none));
        let p = plan(
            r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
            "num_key_value_heads": 2, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
            "use_sliding_window": false, "vocab_size": 151936}"#,
        )
        .unwrap();
        assert!(p.windows.iter().all(Option::is_none));
        assert_eq!(p.config.sliding_window, None);
    }

    #[test]
    fn config_errors() {
        let err = |json: &str| plan(json).err().expect("should fail").to_string();
        assert!(err(r#"{"model_type": "mamba"}"#).contains("unsupported model type 'mamba'"));
        assert!(err(r#"{"architectures": ["Foo"]}"#).contains("unsupported model architectures"));
        assert!(err(r#"{"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}"#).contains("'yarn'"));
        assert!(err(r#"{"model_type": "llama", "hidden_act": "relu"}"#).contains("activation 'relu'"));
        assert!(err(r#"{"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}"#).contains("soft-capping"));
        assert!(err(r#"{"model_type": "llama", "hidden_size": 80, "num_attention_heads": 4}"#).contains("multiples of 32"));
        assert!(err(r#"{"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["full_attention"]}"#).contains("layer_types"));
    }

    #[test]
    fn foreign_quantization_is_refused() {
        let dir = std::env::temp_dir().join(format!("eddy-hf-quant-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |json: &str| std::fs::write(dir.join(CONFIG_FILE), json).unwrap();
        let load = || load_model(&dir, Quant::None, &mut |_, _| {}).err().expect("no weights: must fail").to_string();
        write(r#"{"model_type": "qwen2", "quantization_config": {"quant_method": "gptq", "bits": 4}}"#);
        let e = load();
        assert!(e.contains("quantized by gptq") && e.contains("eddy quantize"), "{e}");
        assert!(read_config(&dir).unwrap_err().to_string().contains("quantized by gptq"));
        write(r#"{"model_type": "qwen2", "quantization_config": {"bits": 4}}"#);
        assert!(load().contains("quantized by an unnamed method"));
        // eddy's own folders pass this check (and here fail later: the folder holds no weights).
        write(r#"{"model_type": "qwen2", "quantization_config": {"quant_method": "eddy", "format": "m"}}"#);
        let e = load();
        assert!(!e.contains("quantized by"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn quant_parses() {
        assert_eq!("q8".parse::<Quant>(), Ok(Quant::Q8));
        assert_eq!("Q4".parse::<Quant>(), Ok(Quant::Q4));
        assert_eq!("none".parse::<Quant>(), Ok(Quant::None));
        assert!("q5".parse::<Quant>().is_err());
    }
}
