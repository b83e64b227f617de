//! DFlash block drafter (Chen et al., arXiv 2602.06036; the math follows z-lab's reference
//! `dflash/model.py`, summarised in `docs/dflash.md`): a few Qwen3-style decoder layers that read the
//! target's own intermediate features and propose the next `block_size − 1` tokens in **one** pass.
//!
//! Notation: the target's feature row of a committed position `p` is the concatenation of the residual
//! stream after its decoder layers `target_layer_ids` (Hugging Face's `hidden_states[id + 1]`);
//! `c_p = hidden_norm(fc · features_p)`. With the root (the last sampled token, not yet in the target's
//! cache) at position `n`, the block is the target's embeddings of `[root, MASK × (B − 1)]` at positions
//! `n..n + B`. Every draft layer computes
//!
//! ```text
//! h = input_layernorm(x);  q = q_norm(Wq·h)  (block rows only)
//! K = k_norm(Wk·[c_0..c_{n−1} ; h]),  V = Wv·[c ; h]      (context rows are not normed by input_layernorm)
//! q, K = rope(q, K) at absolute positions;  x += Wo·attention(q, K, V)   (every block row sees every row)
//! x += Wdown·(silu(Wgate·h') ⊙ Wup·h'),  h' = post_attention_layernorm(x)
//! ```
//!
//! then `norm`, and the target's LM head gives the logits of block slots `1..B`: slot `k` predicts the
//! token at position `n + k`. The context rows' K/V depend only on the target's features, so they are
//! cached per draft layer and appended as tokens are committed ([`DFlashSeq`]); the block's K/V go to
//! scratch rows after them and are overwritten next round.
//!
//! The draft layers are the models' own Qwen3 blocks ([`Layer`] with q/k norms), run on the target's
//! backend by the shared `models::forward::blocks` with [`Visibility::Block`] attention, so the drafter runs
//! wherever the target runs (its context K/V in that backend's memory); only the feature rows go in and
//! each block pass's logits are reduced where they are to the per-depth top-k and the row mass
//! ([`Backend::candidate_rows`]), which alone come back to the host.
//!
//! Drafts ([`DFlashSpeculator`]): the per-depth top-k of the marginals ([`Marginals`], probabilities at
//! the target's temperature as acceptance estimates) become either the argmax chain or the DDTree
//! best-first tree (`algorithms.md` §3.2: path score = product of the marginals along it; a child never
//! outscores its parent, so every prefix of the pop order is a prefix-closed subtree), which
//! [`super::DraftTree::select`] then prunes under the measured cost model like any other proposal.
//!
//! A reduced draft vocabulary (`draft_vocab.json` next to the drafter: a JSON array of token ids, or an
//! object with such an array under `token_ids`) runs the LM head only over those rows: a sub-matrix
//! gathered from the target's head once, when the drafter is bound to the target ([`DFlashDrafter::bind`]).

use super::{Budget, DraftTree, DrafterStats, FeatureRows, ProposeCtx, Ranked, Speculator};
use crate::backend::{Backend, Cols, Cpu, Rope, RopeMode, Visibility};
use crate::error::{Error, Result};
use crate::model_dir::{Quant, Tensors};
use crate::models::forward::{self, Workspace};
use crate::models::{Arch, Attention, Layer, Mixer, Model, ModelConfig};
use crate::quant::import::{quantize_f32, QuantKind};
use crate::quant::WeightMatrix;
use crate::sampling::{exp_det, Candidates};
use crate::state::LayerState;
use serde_json::Value;
use std::collections::BinaryHeap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `architectures` entry of a DFlash drafter's `config.json`.
pub const ARCHITECTURE: &str = "DFlashDraftModel";
/// File of the optional reduced draft vocabulary, next to `config.json`.
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.json";
/// Candidates kept per depth from the marginals.
pub const TOP_K: usize = 8;
/// Largest `block_size` a drafter may declare: its block is drafted in one pass and verified as a tree of
/// at most [`super::MAX_AUTO_NODES`] nodes (published DFlash drafters use 16); a larger value is refused
/// when the config is read, before any buffer is sized from it.
pub const MAX_BLOCK_SIZE: usize = super::MAX_AUTO_NODES;

/// Whether `path` is a folder holding a DFlash drafter (`config.json` whose `architectures` names
/// [`ARCHITECTURE`]).
pub fn is_dflash_dir(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path.join("config.json")) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return false;
    };
    v.get("architectures").and_then(Value::as_array).is_some_and(|a| a.iter().any(|x| x.as_str() == Some(ARCHITECTURE)))
}

/// A DFlash drafter stored next to the model file `model`: the folder `<stem>.dflash/`, else the folder
/// `dflash-<name>/` with the longest `<name>` that begins the model's file name (case-insensitive), e.g.
/// `dflash-qwen2.5-coder-1.5b/` for `qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`. Only folders that
/// [`is_dflash_dir`] are considered.
pub fn find_next_to(model: &Path) -> Option<PathBuf> {
    let dir = model.parent()?;
    let file = model.file_name()?.to_str()?.to_lowercase();
    let stem = model.file_stem()?.to_str()?;
    let own = dir.join(format!("{stem}.dflash"));
    if is_dflash_dir(&own) {
        return Some(own);
    }
    let mut best: Option<(usize, PathBuf)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().to_lowercase();
        let Some(prefix) = name.strip_prefix("dflash-") else {
            continue;
        };
        if !prefix.is_empty() && file.starts_with(prefix) && best.as_ref().is_none_or(|b| prefix.len() > b.0) && is_dflash_dir(&e.path()) {
            best = Some((prefix.len(), e.path()));
        }
    }
    best.map(|b| b.1)
}

/// z-lab's default choice of target layers when the config names none: one per draft layer, evenly
/// spaced from layer 1 to `n_target − 3` (the middle layer for a one-layer drafter).
pub fn default_target_layers(n_target: usize, n_draft: usize) -> Vec<usize> {
    if n_draft == 1 {
        return vec![n_target / 2];
    }
    let (start, end) = (1.0f64, n_target as f64 - 3.0);
    (0..n_draft).map(|i| (start + i as f64 * (end - start) / (n_draft - 1) as f64).round() as usize).collect()
}

/// Hyper-parameters of a DFlash drafter (`config.json`, a Qwen3 config with DFlash fields).
#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
    /// Residual width (must equal the target's).
    pub d_model: usize,
    /// Draft decoder layers.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// MLP inner width.
    pub ffn_dim: usize,
    /// Vocabulary of the target it was trained for.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Block length `B` (root plus `B − 1` drafted positions).
    pub block_size: usize,
    /// Token id of the MASK placeholder.
    pub mask_token_id: u32,
    /// Target decoder layers (0-based) whose outputs form the features, in `fc`'s input order.
    pub target_layer_ids: Vec<usize>,
    /// Decoder layers of the target it was trained for, when the config says.
    pub num_target_layers: Option<usize>,
}

impl DFlashConfig {
    /// Parse `config.json` of `dir`.
    ///
    /// Errors: unreadable or malformed JSON, not a DFlash config, missing or inconsistent fields,
    /// features this loader does not implement (attention biases, an activation other than SiLU, RoPE
    /// scaling).
    pub fn read(dir: &Path) -> Result<DFlashConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed JSON: {e}")))?;
        let bad = |m: String| Error::model(&path, m);
        let archs = v.get("architectures").and_then(Value::as_array);
        if !archs.is_some_and(|a| a.iter().any(|x| x.as_str() == Some(ARCHITECTURE))) {
            return Err(bad(format!("not a DFlash drafter (architectures must name {ARCHITECTURE})")));
        }
        let num = |k: &str| -> Result<usize> {
            v.get(k).and_then(Value::as_u64).map(|x| x as usize).ok_or_else(|| bad(format!("missing or invalid integer field `{k}`")))
        };
        let d_model = num("hidden_size")?;
        let n_heads = num("num_attention_heads")?;
        let n_kv_heads = match v.get("num_key_value_heads") {
            Some(_) => num("num_key_value_heads")?,
            None => n_heads,
        };
        let head_dim = match v.get("head_dim") {
            Some(x) if !x.is_null() => num("head_dim")?,
            _ => d_model / n_heads.max(1),
        };
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(bad("attention biases (attention_bias: true) are not supported in a DFlash drafter".into()));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(format!("hidden_act `{act}` is not supported (DFlash drafters use silu)")));
            }
        }
        let rope_params = v.get("rope_parameters").or_else(|| v.get("rope_scaling")).filter(|x| !x.is_null());
        if let Some(p) = rope_params {
            let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                return Err(bad(format!("RoPE scaling `{kind}` is not supported in a DFlash drafter")));
            }
        }
        let rope_theta =
            v.get("rope_theta").or_else(|| rope_params.and_then(|p| p.get("rope_theta"))).and_then(Value::as_f64).unwrap_or(10000.0) as f32;
        let norm_eps = v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32;
        let n_layers = num("num_hidden_layers")?;
        let num_target_layers = v.get("num_target_layers").and_then(Value::as_u64).map(|x| x as usize);
        let dc = v.get("dflash_config").ok_or_else(|| bad("missing `dflash_config`".into()))?;
        let mask_token_id =
            dc.get("mask_token_id").and_then(Value::as_u64).ok_or_else(|| bad("missing or invalid `dflash_config.mask_token_id`".into()))?
                as u32;
        let target_layer_ids = match dc.get("target_layer_ids").filter(|x| !x.is_null()) {
            Some(ids) => ids
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad("`dflash_config.target_layer_ids` must be a list of layer indices".into()))?,
            None => {
                let n = num_target_layers.ok_or_else(|| bad("needs `dflash_config.target_layer_ids` or `num_target_layers`".into()))?;
                if n < 4 && n_layers > 1 {
                    return Err(bad(format!("num_target_layers {n} is too small for the default target layers")));
                }
                default_target_layers(n, n_layers)
            }
        };
        let c = DFlashConfig {
            d_model,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: num("intermediate_size")?,
            vocab_size: num("vocab_size")?,
            norm_eps,
            rope_theta,
            block_size: num("block_size")?,
            mask_token_id,
            target_layer_ids,
            num_target_layers,
        };
        if c.n_layers == 0 || c.target_layer_ids.is_empty() {
            return Err(bad("a DFlash drafter needs at least one layer and one target layer".into()));
        }
        if !(2..=MAX_BLOCK_SIZE).contains(&c.block_size) {
            return Err(bad(format!("block_size {} must be between 2 and {MAX_BLOCK_SIZE}", c.block_size)));
        }
        if c.n_heads == 0 || c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads) || !c.head_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "inconsistent attention shape: {} heads, {} kv heads, head_dim {}",
                c.n_heads, c.n_kv_heads, c.head_dim
            )));
        }
        if !c.d_model.is_multiple_of(32) || !c.ffn_dim.is_multiple_of(32) || !(c.n_heads * c.head_dim).is_multiple_of(32) {
            return Err(bad(format!(
                "unsupported shape: hidden_size {} / intermediate_size {} / heads × head_dim {} must be multiples of 32",
                c.d_model,
                c.ffn_dim,
                c.n_heads * c.head_dim
            )));
        }
        if c.mask_token_id as usize >= c.vocab_size {
            return Err(bad(format!("mask_token_id {} is outside the vocabulary of {}", c.mask_token_id, c.vocab_size)));
        }
        Ok(c)
    }

    /// `n_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Values per feature row: `target_layer_ids.len() × d_model`.
    pub fn feature_dim(&self) -> usize {
        self.target_layer_ids.len() * self.d_model
    }

    /// The draft layers' shape as a dense model's (Qwen3 blocks: q/k RMSNorm, NeoX RoPE over the whole
    /// head, scores scaled by `1/√head_dim`, SiLU), for the shared block code.
    pub fn decoder(&self) -> ModelConfig {
        ModelConfig {
            n_layers: self.n_layers,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            ffn_dim: self.ffn_dim,
            vocab_size: self.vocab_size,
            norm_eps: self.norm_eps,
            ..ModelConfig::plain(Arch::Qwen3, self.head_dim, self.rope_theta)
        }
    }
}

/// A loaded DFlash drafter on backend `B`: configuration, its decoder blocks and projections (loaded on the
/// CPU by [`DFlashDrafter::load`], moved by [`DFlashDrafter::into_backend`]), the optional reduced draft
/// vocabulary. The embedding and the LM head are the target's.
pub struct DFlashDrafter<B: Backend = Cpu> {
    /// Hyper-parameters.
    pub config: DFlashConfig,
    /// Folder it was loaded from.
    pub source: PathBuf,
    /// The draft blocks as a model's: Qwen3 blocks (q/k RMSNorm, NeoX RoPE, SiLU), run by the shared
    /// [`forward::blocks`].
    decoder: ModelConfig,
    fc: B::Weights,
    hidden_norm: B::Buf,
    norm: B::Buf,
    /// Draft layers: `input_layernorm` as the attention norm, `post_attention_layernorm` as the FFN norm.
    layers: Vec<Layer<B>>,
    /// Token ids of the reduced draft vocabulary (`None`: the full vocabulary).
    vocab_ids: Option<Vec<u32>>,
    /// The target LM head's rows of `vocab_ids` (built by [`DFlashDrafter::bind`]).
    head: Option<B::Weights>,
    /// Bytes of the layers' matrices (what one block pass streams besides `fc` and the LM head).
    weight_bytes: usize,
}

impl DFlashDrafter {
    /// Load the drafter in `dir` (`config.json`, `model.safetensors` or an index with shards, optional
    /// [`DRAFT_VOCAB_FILE`]); matrices are stored as `quant` says ([`Quant::Q8`]: eddy's int8 format,
    /// prepacked for the AVX-512 kernels where they run).
    ///
    /// Errors: see [`DFlashConfig::read`]; missing tensors or tensors of the wrong shape (the message names
    /// the tensor and both shapes); a malformed draft vocabulary or one with ids outside the vocabulary.
    pub fn load(dir: &Path, quant: Quant) -> Result<DFlashDrafter> {
        let c = DFlashConfig::read(dir)?;
        let t = Tensors::open(dir)?;
        let (d, qd, kvd, hd) = (c.d_model, c.q_dim(), c.kv_dim(), c.head_dim);
        let m = |name: &str, rows: usize, cols: usize| t.matrix(name, rows, cols, quant, false);
        let v = |name: &str, n: usize| t.f32_tensor(name, &[n]);
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("layers.{l}.{s}");
            layers.push(Layer {
                attn_norm: v(&p("input_layernorm.weight"), d)?,
                mixer: Mixer::Attention(Attention {
                    wq: m(&p("self_attn.q_proj.weight"), qd, d)?,
                    wk: m(&p("self_attn.k_proj.weight"), kvd, d)?,
                    wv: m(&p("self_attn.v_proj.weight"), kvd, d)?,
                    bq: None,
                    bk: None,
                    bv: None,
                    q_norm: Some(v(&p("self_attn.q_norm.weight"), hd)?),
                    k_norm: Some(v(&p("self_attn.k_norm.weight"), hd)?),
                    wo: m(&p("self_attn.o_proj.weight"), d, qd)?,
                    gated: false,
                    rope: Rope::new(RopeMode::Neox, hd, c.rope_theta, 1.0),
                    window: None,
                }),
                post_attn_norm: None,
                ffn_norm: v(&p("post_attention_layernorm.weight"), d)?,
                w_gate: m(&p("mlp.gate_proj.weight"), c.ffn_dim, d)?,
                w_up: m(&p("mlp.up_proj.weight"), c.ffn_dim, d)?,
                w_down: m(&p("mlp.down_proj.weight"), d, c.ffn_dim)?,
                post_ffn_norm: None,
            });
        }
        let mut drafter = DFlashDrafter {
            fc: m("fc.weight", d, c.feature_dim())?,
            hidden_norm: v("hidden_norm.weight", d)?,
            norm: v("norm.weight", d)?,
            decoder: c.decoder(),
            layers,
            vocab_ids: read_draft_vocab(dir, c.vocab_size)?,
            head: None,
            source: dir.to_path_buf(),
            config: c,
            weight_bytes: 0,
        };
        let mut ws: Vec<&mut WeightMatrix> = vec![&mut drafter.fc];
        for l in &mut drafter.layers {
            ws.extend(l.matrices_mut());
        }
        drafter.weight_bytes = ws[1..].iter().map(|w| w.nbytes()).sum();
        if crate::backend::cpu::prepack_wanted() {
            crate::quant::prepack_all(ws);
        }
        Ok(drafter)
    }

    /// Error unless the drafter fits a target of `d_model` residual width, `n_layers` decoder layers and
    /// `vocab` tokens: same width, every target layer id below `n_layers` (and `num_target_layers`, when
    /// given, equal to it), same vocabulary size.
    pub fn check_target(&self, d_model: usize, n_layers: usize, vocab: usize) -> Result<()> {
        let c = &self.config;
        let bad = |m: String| Err(Error::model(&self.source, m));
        if c.d_model != d_model {
            return bad(format!("DFlash drafter has hidden_size {} but the target's is {d_model}", c.d_model));
        }
        if let Some(&l) = c.target_layer_ids.iter().find(|&&l| l >= n_layers) {
            return bad(format!("DFlash drafter reads target layer {l} but the target has {n_layers} layers (0..{n_layers})"));
        }
        if let Some(n) = c.num_target_layers.filter(|&n| n != n_layers) {
            return bad(format!("DFlash drafter was trained for a target of {n} layers, this one has {n_layers}"));
        }
        if c.vocab_size != vocab {
            return bad(format!("DFlash drafter has a vocabulary of {} tokens but the target's has {vocab}", c.vocab_size));
        }
        Ok(())
    }

    /// Check the drafter against the target `target` ([`DFlashDrafter::check_target`]; dense models only)
    /// and build the draft-vocabulary LM head from its head ([`DFlashDrafter::bind_head`]).
    pub fn bind(&mut self, target: &Model) -> Result<()> {
        if target.config.gdn.is_some() {
            return Err(Error::model(&self.source, "DFlash drafters run with dense targets only (not Qwen3.5)"));
        }
        let c = &target.config;
        self.check_target(c.d_model, c.n_layers, c.vocab_size)?;
        self.bind_head(target.lm_head());
        Ok(())
    }

    /// With a reduced draft vocabulary, gather its rows of the target's LM head `lm_head` once: kept
    /// exactly for f32/bf16 heads, re-quantized to int8 (group 32) for quantized ones. Nothing to do with
    /// the full vocabulary.
    pub fn bind_head(&mut self, lm_head: &WeightMatrix) {
        let Some(ids) = &self.vocab_ids else { return };
        let d = lm_head.cols();
        let mut data = vec![0f32; ids.len() * d];
        for (row, &id) in data.chunks_exact_mut(d).zip(ids) {
            lm_head.dequant_row(id as usize, row);
        }
        let mut head = match lm_head {
            WeightMatrix::F32 { .. } | WeightMatrix::Bf16 { .. } => WeightMatrix::f32(ids.len(), d, data),
            WeightMatrix::Q(_) => quantize_f32(ids.len(), d, &data, QuantKind::Q8),
        };
        if crate::backend::cpu::prepack_wanted() {
            crate::quant::prepack_all(vec![&mut head]);
        }
        self.head = Some(head);
    }

    /// This drafter on backend `be`: moved as it is when `B` is the CPU, else its matrices and norms
    /// uploaded (the gathered draft-vocabulary head too, so bind before moving).
    pub fn into_backend<B: Backend>(self, be: &B) -> DFlashDrafter<B> {
        let any: Box<dyn std::any::Any> = Box::new(self);
        match any.downcast::<DFlashDrafter<B>>() {
            Ok(same) => *same,
            Err(any) => {
                let d = any.downcast::<DFlashDrafter>().expect("a host drafter");
                DFlashDrafter {
                    config: d.config.clone(),
                    source: d.source.clone(),
                    decoder: d.decoder.clone(),
                    fc: be.upload_weights(d.fc.clone()),
                    hidden_norm: be.upload(&d.hidden_norm),
                    norm: be.upload(&d.norm),
                    layers: d.layers.iter().map(|l| l.to_backend(be)).collect(),
                    vocab_ids: d.vocab_ids.clone(),
                    head: d.head.as_ref().map(|h| be.upload_weights(h.clone())),
                    weight_bytes: d.weight_bytes,
                }
            }
        }
    }
}

impl<B: Backend> DFlashDrafter<B> {
    /// Token ids of the draft vocabulary (`None`: all of them).
    pub fn vocab_ids(&self) -> Option<&[u32]> {
        self.vocab_ids.as_deref()
    }

    /// Token ids of the rows of the LM head a block pass multiplies by ([`DFlashDrafter::head`]): the draft
    /// vocabulary once its head is gathered ([`DFlashDrafter::bind`]), else `None` (the target's head).
    pub fn head_ids(&self) -> Option<&[u32]> {
        self.head.as_ref().and(self.vocab_ids.as_deref())
    }

    /// Rows of the LM head a block pass multiplies by ([`DFlashDrafter::head`]).
    pub fn head_rows(&self) -> usize {
        self.head_ids().map_or(self.config.vocab_size, <[u32]>::len)
    }

    /// The LM head the block pass multiplies by: the gathered draft-vocabulary head, else `target_head`.
    pub fn head<'a>(&'a self, target_head: &'a B::Weights) -> &'a B::Weights {
        self.head.as_ref().unwrap_or(target_head)
    }

    /// Bytes of the drafter's own layer weights (what one block pass streams besides `fc` and the LM head).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
}

/// Read the optional draft vocabulary of `dir`.
fn read_draft_vocab(dir: &Path, vocab: usize) -> Result<Option<Vec<u32>>> {
    let path = dir.join(DRAFT_VOCAB_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed JSON: {e}")))?;
    let list = v.as_array().or_else(|| v.get("token_ids").and_then(Value::as_array));
    let ids = list
        .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
        .ok_or_else(|| Error::model(&path, "expected a JSON array of token ids (or {\"token_ids\": [...]})"))?;
    if ids.is_empty() {
        return Err(Error::model(&path, "the draft vocabulary is empty"));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::model(&path, format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    Ok(Some(ids.into_iter().map(|i| i as u32).collect()))
}

/// Context rows a [`DFlashSeq`] projects per pass (longer feature runs are cut into pieces of this many).
const CONTEXT_BATCH: usize = 128;

/// What a block pass borrows from the target: its token embedding on the host (rows times `embed_scale`
/// when set, Gemma's √d_model) and its LM head on the drafter's backend (a drafter with a draft vocabulary
/// of its own uses its own head, [`DFlashDrafter::head`]).
pub struct TargetParts<'a, B: Backend> {
    /// Token embedding, `vocab × d_model`, on the host.
    pub embed: &'a WeightMatrix,
    /// Multiplier of embedding rows, or `None`.
    pub embed_scale: Option<f32>,
    /// LM head, `vocab × d_model`, on the backend.
    pub lm_head: &'a B::Weights,
}

// Manual impls: a derive would ask `B: Clone`.
impl<B: Backend> Clone for TargetParts<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for TargetParts<'_, B> {}

impl<'a, B: Backend> TargetParts<'a, B> {
    /// The parts of a target held twice, as engines hold it: `host` (its embedding) and `on_backend` (its
    /// LM head where the drafter runs).
    pub fn new(host: &'a Model, on_backend: &'a Model<B>) -> Self {
        TargetParts { embed: &host.embed, embed_scale: host.config.embed_scale, lm_head: on_backend.lm_head() }
    }
}

/// Per-sequence state of a drafter on backend `B`: the cached context K/V of every draft layer (in the
/// backend's memory, one attention [`LayerState`] per layer) and the scratch of its passes.
///
/// Context rows cover positions `base..base + rows` (cache row `r` is position `base + r`); the block's
/// `B` rows follow them.
pub struct DFlashSeq<B: Backend = Cpu> {
    /// Rows per layer (context plus one block).
    cap: usize,
    /// Values per K (or V) row.
    kv_dim: usize,
    kv: Vec<LayerState<B>>,
    /// First position with a context row.
    pub base: usize,
    /// Context rows held.
    pub rows: usize,
    ws: Workspace<B>,
    /// Host rows of the block's input (its tokens' embeddings).
    input: Vec<f32>,
    /// The last block pass's logits (`(B − 1) × head rows`), in the backend's memory, and their capacity.
    logits: Option<B::Buf>,
    logits_len: usize,
}

impl<B: Backend> DFlashSeq<B> {
    /// State for `d` on `be` with room for `ctx` context positions.
    pub fn new(be: &B, d: &DFlashDrafter<B>, ctx: usize) -> DFlashSeq<B> {
        let c = &d.config;
        let cap = ctx + c.block_size;
        let kv = (0..c.n_layers).map(|_| LayerState::Kv { k: be.alloc(cap * c.kv_dim()), v: be.alloc(cap * c.kv_dim()) }).collect();
        let ws = Workspace::for_blocks(be, &d.decoder, CONTEXT_BATCH.max(c.block_size), c.feature_dim());
        DFlashSeq { cap, kv_dim: c.kv_dim(), kv, base: 0, rows: 0, ws, input: Vec::new(), logits: None, logits_len: 0 }
    }

    /// Forget every context row; the next one will be at position `base`.
    pub fn reset(&mut self, base: usize) {
        self.base = base;
        self.rows = 0;
    }

    /// Keep only the first `rows` context rows.
    pub fn truncate(&mut self, rows: usize) {
        self.rows = self.rows.min(rows);
    }

    /// Context rows that still fit (the block's rows are reserved).
    pub fn room(&self, block: usize) -> usize {
        self.cap - block - self.rows
    }

    /// Append the context rows of `m = rows.len()` committed positions `base + rows ..` from their target
    /// features, rows `rows` of `features` (`feature_dim` f32 each, backend memory, in position order):
    /// `c = hidden_norm(fc·f)` projected by every layer's `k_proj` (then `k_norm`, RoPE) and `v_proj`.
    ///
    /// Panics if the rows do not fit ([`DFlashSeq::room`]) or lie outside `features` (callers check).
    pub fn add_context(&mut self, be: &B, d: &DFlashDrafter<B>, features: &B::Buf, rows: &[usize]) {
        let c = &d.config;
        let (dm, kvd, fd, eps) = (c.d_model, c.kv_dim(), c.feature_dim(), c.norm_eps);
        assert!(rows.len() <= self.room(c.block_size), "context rows beyond the drafter's room");
        for piece in rows.chunks(self.ws.max_batch) {
            let m = piece.len();
            let Workspace { x, h, q, k, v, cat, xq, positions, .. } = &mut self.ws;
            be.gather_rows(features, Cols::whole(fd), piece, cat, Cols::whole(fd), 0);
            be.quantize(cat, m, fd, &d.fc, xq);
            be.matmul(&d.fc, cat, xq, m, x);
            be.rms_norm(x, 0, m, &d.hidden_norm, eps, h);
            positions.clear();
            positions.extend(self.base + self.rows..self.base + self.rows + m);
            for (layer, st) in d.layers.iter().zip(self.kv.iter_mut()) {
                let (Some(a), LayerState::Kv { k: kc, v: vc }) = (layer.attention(), st) else {
                    unreachable!("DFlash layers are attention layers with K/V caches")
                };
                be.quantize(h, m, dm, &a.wk, xq);
                be.matmul_parts(&mut [(&a.wk, None, &mut *k), (&a.wv, None, &mut *v)], h, xq, m);
                if let Some(w) = &a.k_norm {
                    be.rms_norm_inplace(k, m * kvd, w, eps);
                }
                // Keys only: no query rows (width 0).
                be.rope_store(&a.rope, q, 0, k, v, kvd, c.head_dim, positions, kc, vc, self.rows);
            }
            self.rows += m;
        }
    }

    /// [`DFlashSeq::add_context`] of host rows (`features`: whole rows of `feature_dim` f32, position
    /// order; fixtures and benchmarks).
    ///
    /// Panics as [`DFlashSeq::add_context`] does, or if `features` is not whole rows.
    pub fn add_context_from_host(&mut self, be: &B, d: &DFlashDrafter<B>, features: &[f32]) {
        let fd = d.config.feature_dim();
        assert!(features.len().is_multiple_of(fd), "features must be whole rows of {fd}");
        let rows: Vec<usize> = (0..features.len() / fd).collect();
        self.add_context(be, d, &be.upload(features), &rows);
    }

    /// One block pass: the root `root` at position `base + rows` followed by `B − 1` MASK tokens, over
    /// every context row; the logits of slots `1..B` (`(B − 1) × head_rows` f32, slot order, the head of
    /// [`DFlashDrafter::head`] with [`DFlashDrafter::head_rows`] rows) are read back into `logits`. The
    /// context is not changed (the block's K/V go to scratch rows).
    ///
    /// Errors: `root` or the mask token outside the embedding.
    pub fn draft(&mut self, be: &B, d: &DFlashDrafter<B>, target: TargetParts<'_, B>, root: u32, logits: &mut Vec<f32>) -> Result<()> {
        let out = self.block_pass(be, d, target, root)?;
        logits.clear();
        be.read(out, 0, d.config.block_size - 1, d.head_rows(), logits);
        Ok(())
    }

    /// [`DFlashSeq::draft`] reduced where the logits are: each slot's `k` most likely tokens at inverse
    /// temperature `inv_t` and the row's mass, as [`Backend::candidate_rows`] gives them (slot order, ids
    /// are head rows), into `out`; only those cross to the host.
    ///
    /// Errors: as [`DFlashSeq::draft`].
    #[allow(clippy::too_many_arguments)]
    pub fn draft_candidates(
        &mut self,
        be: &B,
        d: &DFlashDrafter<B>,
        target: TargetParts<'_, B>,
        root: u32,
        inv_t: f32,
        k: usize,
        out: &mut Candidates,
    ) -> Result<()> {
        let logits = self.block_pass(be, d, target, root)?;
        be.candidate_rows(logits, d.config.block_size - 1, d.head_rows(), inv_t, k, out);
        Ok(())
    }

    /// The block pass of [`DFlashSeq::draft`]; returns the logits buffer.
    fn block_pass(&mut self, be: &B, d: &DFlashDrafter<B>, target: TargetParts<'_, B>, root: u32) -> Result<&B::Buf> {
        let TargetParts { embed, embed_scale, lm_head } = target;
        let (head, head_rows) = (d.head(lm_head), d.head_rows());
        let c = &d.config;
        let (dm, b) = (c.d_model, c.block_size);
        for tok in [root, c.mask_token_id] {
            if tok as usize >= embed.rows() {
                return Err(Error::Input(format!("DFlash: token id {tok} is outside the vocabulary of {}", embed.rows())));
            }
        }
        assert!(self.rows + b <= self.cap, "no room for the block");
        let n = self.base + self.rows;
        self.input.resize(b * dm, 0.0);
        for (i, row) in self.input.chunks_exact_mut(dm).enumerate() {
            embed.dequant_row(if i == 0 { root } else { c.mask_token_id } as usize, row);
            if let Some(s) = embed_scale {
                row.iter_mut().for_each(|e| *e *= s);
            }
        }
        let ws = &mut self.ws;
        be.write(&self.input, &mut ws.x);
        ws.positions.clear();
        ws.positions.extend(n..n + b);
        forward::blocks(be, &d.decoder, &d.layers, &mut self.kv, ws, b, self.rows, Visibility::Block { rows: self.rows + b });
        let rows = b - 1;
        be.rms_norm(&ws.x, 1, rows, &d.norm, c.norm_eps, &mut ws.h);
        be.quantize(&ws.h, rows, dm, head, &mut ws.xq);
        if self.logits.as_ref().is_none_or(|_| self.logits_len < rows * head_rows) {
            self.logits = Some(be.alloc(rows * head_rows));
            self.logits_len = rows * head_rows;
        }
        let out = self.logits.as_mut().expect("allocated above");
        be.matmul(head, &ws.h, &ws.xq, rows, out);
        Ok(out)
    }

    /// Bytes of the context K/V cache.
    pub fn nbytes(&self) -> usize {
        2 * self.kv.len() * self.cap * self.kv_dim * 4
    }
}

/// The per-depth candidates of one block pass: for depth `1..=depth` (block slot `k` = depth `k`), the
/// `k` most likely tokens, most likely first, with their probabilities at the target's temperature.
#[derive(Debug, Clone, Default)]
pub struct Marginals {
    /// Depths (block slots 1..B).
    pub depth: usize,
    /// Candidates per depth.
    pub k: usize,
    /// `depth × k` token ids, row-major.
    pub tokens: Vec<u32>,
    /// `depth × k` probabilities, non-increasing along each row.
    pub probs: Vec<f32>,
}

impl Marginals {
    /// Fill from a block pass's candidates `c` ([`DFlashSeq::draft_candidates`]: one row per depth, ids
    /// are rows of the head, i.e. indices into the draft vocabulary `ids`, or token ids when `None`):
    /// `c.k` candidates per depth with probabilities `exp(s − s_max) / mass`, the softmax of the scaled
    /// logits. A depth with fewer finite logits than `c.k` is padded with probability-0 entries (never
    /// drafted).
    pub fn fill(&mut self, c: &Candidates, ids: Option<&[u32]>) {
        self.depth = c.rows();
        self.k = c.k;
        self.tokens.clear();
        self.probs.clear();
        for r in 0..c.rows() {
            let row = c.row(r);
            let max = row.top.first().map_or(0.0, |e| e.0);
            for j in 0..c.k {
                let (p, id) = match row.top.get(j) {
                    Some(&(s, id)) if row.mass > 0.0 => ((exp_det(s - max) as f64 / row.mass) as f32, id),
                    Some(&(_, id)) => (0.0, id),
                    None => (0.0, row.top.first().map_or(0, |e| e.1)),
                };
                self.probs.push(p);
                self.tokens.push(ids.map_or(id, |ids| ids[id as usize]));
            }
        }
    }

    /// [`Marginals::fill`] from host logits (`depth × row` f32) at `temperature` (1 for greedy decoding),
    /// `k` candidates per depth.
    pub fn fill_logits(&mut self, logits: &[f32], row: usize, ids: Option<&[u32]>, k: usize, temperature: f32) {
        let mut c = Candidates::default();
        let n = logits.len() / row;
        c.reset(n, k.min(row));
        let mut scratch = Vec::new();
        for (r, l) in logits.chunks_exact(row).enumerate() {
            c.fill_row(r, l, inv_temperature(temperature), &mut scratch);
        }
        self.fill(&c, ids);
    }

    /// Token and probability of candidate `rank` at depth `depth` (1-based).
    pub fn at(&self, depth: usize, rank: usize) -> (u32, f32) {
        let i = (depth - 1) * self.k + rank;
        (self.tokens[i], self.probs[i])
    }
}

/// Inverse temperature the marginals are taken at: the target's (clamped to 1e-3 and above), 1 for greedy.
fn inv_temperature(temperature: f32) -> f32 {
    if temperature > 0.0 {
        1.0 / temperature.max(1e-3)
    } else {
        1.0
    }
}

/// Median seconds of one block pass of `d` on `be` and its reduction to each depth's [`TOP_K`] candidates
/// ([`DFlashSeq::draft_candidates`], as the speculator runs it, the candidates' copy to the host included)
/// over a context of `context` rows of synthetic features (the cost does not depend on their values), over
/// `reps` passes after the backend's warm-up passes ([`Backend::passes_to_steady_state`]). `eddy speed`'s
/// `dflash_pass`.
///
/// Errors: as [`DFlashSeq::draft`].
pub fn time_block_pass<B: Backend>(be: &B, d: &DFlashDrafter<B>, target: TargetParts<'_, B>, context: usize, reps: usize) -> Result<f64> {
    let mut seq = DFlashSeq::new(be, d, context);
    let features: Vec<f32> = (0..context * d.config.feature_dim()).map(|i| ((i % 97) as f32 - 48.0) / 16.0).collect();
    seq.add_context_from_host(be, d, &features);
    let vocab = target.embed.rows();
    let mut cands = Candidates::default();
    let mut times = Vec::with_capacity(reps);
    let warm = be.passes_to_steady_state();
    for i in 0..warm + reps.max(1) {
        let t = Instant::now();
        let root = ((1000 + i) % vocab) as u32;
        seq.draft_candidates(be, d, target, root, 1.0, TOP_K, &mut cands)?;
        if i >= warm {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// How a DFlash speculator shapes its drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeShape {
    /// The argmax chain (the reference DFlash loop).
    Chain,
    /// DDTree's best-first tree over the per-depth candidates.
    Best,
}

/// Add up to `max_nodes` draft nodes below the root of `tree` from the marginals `m`, shaped as `shape`
/// says, with path scores = products of the marginals along each path (nodes below 1e-4 are not added).
/// Returns the number of nodes added.
pub fn grow_tree(m: &Marginals, shape: TreeShape, max_nodes: usize, tree: &mut DraftTree) -> usize {
    const MIN_SCORE: f32 = 1e-4;
    let mut added = 0;
    if m.depth == 0 || m.k == 0 {
        return 0;
    }
    match shape {
        TreeShape::Chain => {
            let (mut parent, mut score) = (0, 1.0f32);
            for depth in 1..=m.depth {
                let (tok, p) = m.at(depth, 0);
                score *= p;
                if added >= max_nodes || score < MIN_SCORE {
                    break;
                }
                parent = tree.add(parent, tok, score);
                added += 1;
            }
        }
        TreeShape::Best => {
            // Heap entries: (parent node, its score, depth, rank); score = parent score × p(depth, rank).
            let mut heap = BinaryHeap::new();
            let mut seq = 0;
            heap.push(Ranked { score: m.at(1, 0).1, seq, item: (0usize, 1.0f32, 1usize, 0usize) });
            while let Some(Ranked { score, item: (parent, ps, depth, rank), .. }) = heap.pop() {
                if added >= max_nodes || score < MIN_SCORE {
                    break;
                }
                let node = tree.add(parent, m.at(depth, rank).0, score);
                added += 1;
                if rank + 1 < m.k {
                    seq += 1;
                    heap.push(Ranked { score: ps * m.at(depth, rank + 1).1, seq, item: (parent, ps, depth, rank + 1) });
                }
                if depth < m.depth {
                    seq += 1;
                    heap.push(Ranked { score: score * m.at(depth + 1, 0).1, seq, item: (node, score, depth + 1, 0) });
                }
            }
        }
    }
    added
}

/// A DFlash drafter as a [`Speculator`]: keeps its context rows in step with the committed sequence from
/// the target's features ([`Speculator::observe`]), runs one block pass per round and proposes the chain
/// or the best-first tree of its marginals. It runs on the target's backend `B` (its context K/V in that
/// backend's memory); only the feature rows and the block's logits cross to and from the host.
pub struct DFlashSpeculator<B: Backend = Cpu> {
    drafter: DFlashDrafter<B>,
    seq: DFlashSeq<B>,
    shape: TreeShape,
    /// The last sequence seen (`history` of the last call): the context rows of positions below its
    /// length were computed for these tokens.
    seen: Vec<u32>,
    cands: Candidates,
    marginals: Marginals,
    stats: DrafterStats,
    calibration: Calibration,
}

/// Per-depth calibration of the marginals as acceptance estimates, learned online from the top-1 chain
/// of each pass: at depth `d`, reached when the chain's tokens above it were the ones the target
/// committed, `predicted[d]` sums the top-1 probability and `hits[d]` counts the times it was the
/// committed token. Probabilities at depth `d` are scaled by `(hits[d] + 1) / (predicted[d] + 1)`
/// (clamped to 0.1..10, and each probability to 1): a drafter whose marginals are flatter (or sharper) than
/// its real acceptance gets trees sized for what it achieves (the automatic budget weighs nodes by these
/// scores).
#[derive(Debug, Clone, Default)]
pub struct Calibration {
    predicted: Vec<f64>,
    hits: Vec<f64>,
    /// The last pass's top-1 chain (token, raw probability) and the history position of its first token.
    pending: Option<(usize, Vec<(u32, f32)>)>,
}

/// Whether the marginals are calibrated before tree building: off unless `EDDY_DFLASH_CALIBRATION=1`
/// (on the trained 1.5B drafter it lowered tokens per pass slightly, 1.36–1.45 vs 1.47–1.50 on the
/// reference prompt, and the speed difference was within the noise of a loaded machine; a quiet
/// benchmark decides).
fn calibration_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("EDDY_DFLASH_CALIBRATION").is_ok_and(|v| v.trim() == "1"))
}

impl Calibration {
    /// Score the pending chain against `history` (up to its first miss).
    pub fn score(&mut self, history: &[u32]) {
        let Some((start, chain)) = self.pending.take() else {
            return;
        };
        for (i, &(t, p)) in chain.iter().enumerate() {
            let Some(&a) = history.get(start + i) else {
                break;
            };
            if self.predicted.len() <= i {
                self.predicted.resize(i + 1, 0.0);
                self.hits.resize(i + 1, 0.0);
            }
            self.predicted[i] += p as f64;
            if a != t {
                break;
            }
            self.hits[i] += 1.0;
        }
    }

    /// Scale factor of depth `depth` (1-based).
    pub fn factor(&self, depth: usize) -> f32 {
        let (h, p) = (self.hits.get(depth - 1).copied().unwrap_or(0.0), self.predicted.get(depth - 1).copied().unwrap_or(0.0));
        (((h + 1.0) / (p + 1.0)) as f32).clamp(0.1, 10.0)
    }

    /// Remember the top-1 chain of `m` (raw probabilities), whose first token would sit at `history[start]`.
    pub fn remember(&mut self, start: usize, m: &Marginals) {
        self.pending = Some((start, (1..=m.depth).map(|d| m.at(d, 0)).collect()));
    }

    /// Scale the probabilities of `m` by the per-depth factors.
    pub fn apply(&self, m: &mut Marginals) {
        for d in 1..=m.depth {
            let f = self.factor(d);
            for p in &mut m.probs[(d - 1) * m.k..d * m.k] {
                *p = (*p * f).min(1.0);
            }
        }
    }
}

impl<B: Backend> DFlashSpeculator<B> {
    /// Wrap `drafter` (already bound to the target with [`DFlashDrafter::bind`], then moved to `be`) for a
    /// context of `ctx` tokens.
    pub fn new(be: &B, drafter: DFlashDrafter<B>, ctx: usize, shape: TreeShape) -> DFlashSpeculator<B> {
        DFlashSpeculator {
            seq: DFlashSeq::new(be, &drafter, ctx),
            drafter,
            shape,
            seen: Vec::new(),
            cands: Candidates::default(),
            marginals: Marginals::default(),
            stats: DrafterStats::default(),
            calibration: Calibration::default(),
        }
    }

    /// The drafter.
    pub fn drafter(&self) -> &DFlashDrafter<B> {
        &self.drafter
    }

    /// Seconds per block pass (moving average; 0 before the first).
    pub fn pass_cost(&self) -> f64 {
        self.stats.pass_cost()
    }

    /// Run one block pass on `be` for the sequence `history` (root last) and return its marginals, or
    /// `None` when the context rows do not reach the root (features missing) or there is no room. `host` is
    /// the target's host copy (the block's embedding rows), `target` the target on `be` (its LM head, when
    /// the drafter has no draft vocabulary of its own).
    ///
    /// Errors: a token outside the target's vocabulary.
    pub fn marginals(&mut self, be: &B, host: &Model, target: &Model<B>, history: &[u32], temperature: f32) -> Result<Option<&Marginals>> {
        let n = history.len() - 1;
        self.note_tokens(history);
        let b = self.drafter.config.block_size;
        if self.seq.base + self.seq.rows != n || self.seq.rows + b > self.seq.cap {
            return Ok(None);
        }
        let t = Instant::now();
        let parts = TargetParts::new(host, target);
        self.seq.draft_candidates(be, &self.drafter, parts, history[n], inv_temperature(temperature), TOP_K, &mut self.cands)?;
        self.stats.record_pass(t.elapsed().as_secs_f64());
        self.marginals.fill(&self.cands, self.drafter.head_ids());
        Ok(Some(&self.marginals))
    }

    /// Record `history` as the sequence the context rows belong to.
    fn note_tokens(&mut self, history: &[u32]) {
        let common = common_prefix(&self.seen, history);
        self.seen.truncate(common);
        self.seen.extend_from_slice(&history[common..]);
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> Speculator<B> for DFlashSpeculator<B> {
    fn name(&self) -> &'static str {
        "dflash"
    }

    fn prefill(&mut self, _backend: &B, _host: &Cpu, _prompt: &[u32]) -> Result<()> {
        self.stats.clear_chain();
        Ok(())
    }

    fn feature_layers(&self) -> &[usize] {
        &self.drafter.config.target_layer_ids
    }

    fn observe_features(&mut self, backend: &B, _host: &Cpu, history: &[u32], start: usize, f: FeatureRows<'_, B>) -> Result<()> {
        let fd = self.drafter.config.feature_dim();
        if f.width != fd {
            return Err(Error::Input(format!("DFlash: feature rows of {} values, the drafter reads {fd}", f.width)));
        }
        // Rows stay valid while their positions precede `start` and the tokens they were computed for
        // (every token up to their position) are still the sequence's.
        let valid_end = start.min(common_prefix(&self.seen, history));
        if valid_end < self.seq.base {
            self.seq.reset(start);
        } else {
            self.seq.truncate(valid_end - self.seq.base);
            if self.seq.base + self.seq.rows < start {
                // A gap (features of earlier positions were never seen): start the context over here.
                self.seq.reset(start);
            }
        }
        self.note_tokens(history);
        let m = f.rows.len().min(self.seq.room(self.drafter.config.block_size));
        self.seq.add_context(backend, &self.drafter, f.buf, &f.rows[..m]);
        Ok(())
    }

    fn propose(&mut self, ctx: &ProposeCtx<B>, history: &[u32], tree: &mut DraftTree) -> Result<f64> {
        let t0 = Instant::now();
        self.stats.score_chain(history);
        self.calibration.score(history);
        self.note_tokens(history);
        let want = ctx.max_nodes.min(ctx.budget.max_nodes());
        let (Some(host), Some(target)) = (ctx.target, ctx.model) else {
            return Ok(0.0);
        };
        if want == 0
            || self.stats.plan_round(ctx.budget == Budget::Auto, ctx.cost, self.drafter.config.block_size - 1) == super::Round::Skip
        {
            return Ok(t0.elapsed().as_secs_f64());
        }
        let shape = self.shape;
        if self.marginals(ctx.backend, host, target, history, ctx.temperature)?.is_none() {
            return Ok(t0.elapsed().as_secs_f64());
        }
        let m = &mut self.marginals;
        self.calibration.remember(history.len(), m);
        if calibration_wanted() {
            self.calibration.apply(m);
        }
        grow_tree(m, shape, want, tree);
        let chain: Vec<u32> = (1..=m.depth).map(|d| m.at(d, 0).0).collect();
        self.stats.set_chain(history.len(), chain);
        Ok(t0.elapsed().as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marginals(rows: &[&[(u32, f32)]]) -> Marginals {
        let k = rows[0].len();
        Marginals {
            depth: rows.len(),
            k,
            tokens: rows.iter().flat_map(|r| r.iter().map(|e| e.0)).collect(),
            probs: rows.iter().flat_map(|r| r.iter().map(|e| e.1)).collect(),
        }
    }

    #[test]
    fn calibration_scales_each_depth_by_its_hit_rate() {
        let m = marginals(&[&[(5, 0.2), (6, 0.1)], &[(7, 0.2), (8, 0.1)]]);
        let mut c = Calibration::default();
        assert_eq!((c.factor(1), c.factor(2)), (1.0, 1.0), "no evidence: unchanged");
        // Ten rounds: depth 1 always right (predicted 0.2), depth 2 always wrong.
        for _ in 0..10 {
            c.remember(3, &m);
            c.score(&[0, 0, 0, 5, 9]);
        }
        assert!((c.factor(1) - 11.0 / 3.0).abs() < 1e-5, "{}", c.factor(1));
        assert!((c.factor(2) - 1.0 / 3.0).abs() < 1e-5, "{}", c.factor(2));
        let mut mm = m.clone();
        c.apply(&mut mm);
        assert!((mm.probs[0] - 0.2 * 11.0 / 3.0).abs() < 1e-5 && (mm.probs[2] - 0.2 / 3.0).abs() < 1e-6);
        // A miss at depth 1 stops the scoring there.
        c.remember(3, &m);
        c.score(&[0, 0, 0, 6, 7]);
        assert_eq!(c.hits[1], 0.0);
        assert!((c.predicted[1] - 2.0).abs() < 1e-6, "depth 2 was not reached");
    }

    #[test]
    fn default_target_layers_follow_the_reference() {
        // z-lab's build_target_layer_ids: 64-layer target, 5 draft layers → [1, 16, 31, 46, 61].
        assert_eq!(default_target_layers(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(default_target_layers(28, 1), vec![14]);
        assert_eq!(default_target_layers(28, 2), vec![1, 25]);
        assert_eq!(default_target_layers(28, 3), vec![1, 13, 25]);
    }

    #[test]
    fn chain_follows_the_argmax_with_product_scores() {
        let m = marginals(&[&[(5, 0.9), (6, 0.05)], &[(7, 0.5), (8, 0.4)], &[(9, 0.1), (1, 0.1)]]);
        let mut t = DraftTree::new(3);
        assert_eq!(grow_tree(&m, TreeShape::Chain, 10, &mut t), 3);
        assert_eq!(t.tokens, vec![3, 5, 7, 9]);
        assert_eq!(t.parents[1..], [0, 1, 2]);
        assert!((t.scores[3] - 0.9 * 0.5 * 0.1).abs() < 1e-7);
        let mut t = DraftTree::new(3);
        assert_eq!(grow_tree(&m, TreeShape::Chain, 2, &mut t), 2, "the node cap holds");
    }

    /// The best-first tree pops nodes in non-increasing path score and is exactly the set of the
    /// `budget` most probable prefixes (checked against brute-force enumeration).
    #[test]
    fn best_first_tree_is_the_top_paths() {
        let m = marginals(&[&[(10, 0.6), (11, 0.3), (12, 0.05)], &[(20, 0.7), (21, 0.2), (22, 0.1)], &[(30, 0.5), (31, 0.45), (32, 0.05)]]);
        // Every prefix path and its score.
        let mut all: Vec<(Vec<usize>, f32)> = Vec::new();
        for a in 0..3 {
            all.push((vec![a], m.at(1, a).1));
            for b in 0..3 {
                all.push((vec![a, b], m.at(1, a).1 * m.at(2, b).1));
                for c in 0..3 {
                    all.push((vec![a, b, c], m.at(1, a).1 * m.at(2, b).1 * m.at(3, c).1));
                }
            }
        }
        all.sort_by(|x, y| y.1.total_cmp(&x.1));
        for budget in [1, 4, 9, 20] {
            let mut t = DraftTree::new(0);
            let n = grow_tree(&m, TreeShape::Best, budget, &mut t);
            assert_eq!(n, budget);
            let mut got: Vec<f32> = t.scores[1..].to_vec();
            got.sort_by(|x, y| y.total_cmp(x));
            for (g, w) in got.iter().zip(&all) {
                assert!((g - w.1).abs() < 1e-6, "budget {budget}: {got:?}");
            }
            for i in 1..t.len() {
                assert!(t.parents[i] < i && t.scores[i] <= t.scores[t.parents[i]]);
                assert_eq!(t.tokens[i] / 10, t.depth(i) as u32, "depth {} holds a depth-{} token", t.depth(i), t.tokens[i] / 10);
            }
        }
    }

    /// The marginals from a pass's candidates are the top-k of the logits at the target's temperature and
    /// their softmax probabilities (against a direct f64 softmax), on random rows; a row with fewer finite
    /// logits than k is padded with probability-0 entries.
    #[test]
    fn marginals_are_the_softmax_top_k() {
        let (depth, row, k) = (3, 300, TOP_K);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut logits: Vec<f32> = (0..depth * row)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
            })
            .collect();
        for t in [0.0f32, 0.7, 1.3] {
            let mut m = Marginals::default();
            m.fill_logits(&logits, row, None, k, t);
            assert_eq!((m.depth, m.k), (depth, k));
            let inv_t = if t > 0.0 { 1.0 / t as f64 } else { 1.0 };
            for (d, r) in logits.chunks_exact(row).enumerate() {
                let mut order: Vec<usize> = (0..row).collect();
                order.sort_by(|&a, &b| r[b].total_cmp(&r[a]).then(a.cmp(&b)));
                let max = r[order[0]] as f64 * inv_t;
                let z: f64 = r.iter().map(|&v| (v as f64 * inv_t - max).exp()).sum();
                for (rank, &i) in order[..k].iter().enumerate() {
                    let (tok, p) = m.at(d + 1, rank);
                    let want = ((r[i] as f64 * inv_t - max).exp() / z) as f32;
                    assert_eq!(tok, i as u32, "t {t} depth {} rank {rank}", d + 1);
                    assert!((p - want).abs() <= 1e-6 + 1e-5 * want, "t {t} depth {} rank {rank}: {p} vs {want}", d + 1);
                }
            }
        }
        // Only 2 finite logits in the last row.
        for v in &mut logits[2 * row + 2..] {
            *v = f32::NEG_INFINITY;
        }
        let mut m = Marginals::default();
        m.fill_logits(&logits, row, None, k, 0.0);
        let p: Vec<f32> = (0..k).map(|r| m.at(3, r).1).collect();
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6 && p[2..].iter().all(|&x| x == 0.0), "{p:?}");
    }

    #[test]
    fn marginals_map_draft_vocabulary_ids() {
        let logits = [0.0f32, 2.0, 1.0, 5.0, 0.0, 0.0];
        let mut m = Marginals::default();
        m.fill_logits(&logits, 3, Some(&[100, 200, 300]), 2, 0.0);
        assert_eq!((m.depth, m.k), (2, 2));
        assert_eq!(m.tokens, vec![200, 300, 100, 200]);
        let z: f32 = [0.0f32, 2.0, 1.0].iter().map(|v| v.exp()).sum();
        assert!((m.probs[0] - 2f32.exp() / z).abs() < 1e-6);
    }
}
