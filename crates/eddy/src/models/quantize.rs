//! A loaded model re-quantized into eddy's own M/L/K formats (`docs/quant-formats.md`): every matrix a
//! forward pass multiplies by (and the token embedding) is dequantized to f32 (undoing any rotation it
//! carries), rotated and rounded to nearest by [`crate::quant::rtn::quantize`], or, with a
//! [`Calibration`] ([`calibrate`]: the model run on a text, `H = Σ x·xᵀ` per input site), rounded by
//! GPTQ/LDLQ ([`crate::quant::gptq`]).
//!
//! Signs: matrices that read the same quantized activations must share their input signs (one activation
//! quantization serves them: q/k/v, gate/up, the Gated DeltaNet input projections); every input site gets
//! its own signs, and every matrix its own output signs, all drawn from one seed. The embedding and the
//! LM head are rotated on the input side only (an embedding lookup then undoes the rotation of one row:
//! `D_in·H·row`); by default ([`QuantizeOptions::new`]) the LM head (a tied embedding included) is stored in
//! L (int8) under either format
//! (llama.cpp's 4-bit types likewise keep the output matrix at 6-8 bits; requantizing SmolLM2-135M's tied
//! embedding to 4 bits alone costs several times the KL of all the other matrices), an untied embedding in
//! the asked format (it is only looked up, as llama.cpp's Q4_K_M keeps `token_embd` in Q4_K).
//!
//! The folder ([`write_folder`]) is a Hugging Face folder; a model loaded from a GGUF file is first put in
//! Hugging Face conventions ([`gguf_to_hf_layout`]) and its config and tokenizer files are made from what
//! eddy read from the GGUF metadata ([`Source::Gguf`]).
//!
//! Group: a matrix whose row length is not a multiple of the asked group (e.g. width 576 at group 128)
//! takes the largest of 64, 32 that divides it; a row length that is not a multiple of 32 stays f32. K is
//! always group 32 and K6 group 16, under super-blocks of 256 values (the last one of a row partial when its
//! length is not a multiple of 256).

use super::{Arch, Mixer, Model};
use crate::backend::{Cpu, RopeMode};
use crate::error::{Error, Result};
use crate::model_dir::Tensors;
use crate::quant::gptq::{self, Hessian};
use crate::quant::rotation::{splitmix64, Rotation, Signs};
use crate::quant::rtn::{self, Format};
use crate::quant::WeightMatrix;
use crate::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

/// Which matrices a [`TensorRule`] applies to, by their Hugging Face names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// `embed_tokens` (an untied token embedding; a tied one is the LM head).
    Embed,
    /// `lm_head` (or the tied embedding).
    Head,
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl TensorKind {
    /// Parse the comma-separated matrix names whose rotation is left out (`--no-rotation-for`): any of
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`. Matrices that read the
    /// same input share its rotation (the activations are quantized once for them), so q/k/v go together
    /// and gate/up go together.
    ///
    /// `none` (alone) leaves nothing out: every matrix is rotated.
    ///
    /// Errors: an unknown name, embed_tokens/lm_head (their input signs are shared with the embedding),
    /// or a partial q/k/v or gate/up set, as `Error::Input`.
    pub fn parse_unrotated(text: &str) -> Result<Vec<TensorKind>> {
        let mut out = Vec::new();
        if text.trim() == "none" {
            return Ok(out);
        }
        if text.split(',').all(|n| n.trim().is_empty()) {
            return Err(Error::Input("--no-rotation-for: names no matrix (`none` rotates every matrix)".into()));
        }
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let kind = TensorKind::NAMES.iter().find(|(n, _)| *n == name).map(|&(_, k)| k);
            match kind {
                Some(TensorKind::Embed | TensorKind::Head) | None => {
                    return Err(Error::Input(format!(
                        "--no-rotation-for: '{name}' (expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj)"
                    )))
                }
                Some(k) => out.push(k),
            }
        }
        for set in [&[TensorKind::Q, TensorKind::K, TensorKind::V][..], &[TensorKind::Gate, TensorKind::Up]] {
            let n = set.iter().filter(|k| out.contains(k)).count();
            if n != 0 && n != set.len() {
                return Err(Error::Input(
                    "--no-rotation-for: q_proj, k_proj and v_proj read one input and share its rotation (name all three or none); so do gate_proj and up_proj".into(),
                ));
            }
        }
        Ok(out)
    }

    /// The matrix name rules and messages use (`q_proj`, `embed_tokens`, …).
    pub fn name(self) -> &'static str {
        TensorKind::NAMES.iter().find(|(_, k)| *k == self).map_or("?", |(n, _)| *n)
    }

    const NAMES: [(&'static str, TensorKind); 9] = [
        ("embed_tokens", TensorKind::Embed),
        ("lm_head", TensorKind::Head),
        ("q_proj", TensorKind::Q),
        ("k_proj", TensorKind::K),
        ("v_proj", TensorKind::V),
        ("o_proj", TensorKind::O),
        ("gate_proj", TensorKind::Gate),
        ("up_proj", TensorKind::Up),
        ("down_proj", TensorKind::Down),
    ];
}

/// A per-tensor format: matrices of `kind` (in the layers `layers`, inclusive ranges; every layer when
/// empty) are stored in `format` at `group` values per scale, overriding [`QuantizeOptions`]' defaults.
/// Later rules override earlier ones. Written `NAME[@LAYERS]=FORMAT[/GROUP]` ([`TensorRule::parse_list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRule {
    /// The matrices it applies to.
    pub kind: TensorKind,
    /// Inclusive layer ranges (`(0, 3)` = layers 0..=3); empty = every layer (ignored for the embedding
    /// and the LM head).
    pub layers: Vec<(usize, usize)>,
    /// Their format.
    pub format: Format,
    /// Their values per scale: 32, 64 or 128 for m and l, 16 or 32 for k6, 32 for k.
    pub group: usize,
}

impl TensorRule {
    /// Parse a comma-separated list of rules `NAME[@LAYERS]=FORMAT[/GROUP]`: NAME one of `embed_tokens`,
    /// `lm_head`, `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; LAYERS
    /// `+`-separated layer numbers or inclusive ranges `a-b` (e.g. `0-3+25-27`); FORMAT `m`, `l`, `k` or `k6`;
    /// GROUP 32, 64 or 128 for m and l (default `default_group`), 16 (default) or 32 for k6, none for k.
    /// Example: `v_proj=l/32,down_proj@0-3+24-27=k6/32`.
    ///
    /// Errors: an unknown name or format, a malformed layer list, a group the format does not take, as
    /// `Error::Input` naming the rule.
    pub fn parse_list(text: &str, default_group: usize) -> Result<Vec<TensorRule>> {
        let mut out = Vec::new();
        for rule in text.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let bad = |why: String| Error::Input(format!("tensor format rule '{rule}': {why}"));
            let (lhs, rhs) = rule.split_once('=').ok_or_else(|| bad("expected NAME[@LAYERS]=FORMAT[/GROUP]".into()))?;
            let (name, layer_text) = match lhs.split_once('@') {
                Some((n, l)) => (n.trim(), Some(l.trim())),
                None => (lhs.trim(), None),
            };
            let kind = TensorKind::NAMES.iter().find(|(n, _)| *n == name).map(|&(_, k)| k).ok_or_else(|| {
                let names: Vec<&str> = TensorKind::NAMES.iter().map(|(n, _)| *n).collect();
                bad(format!("unknown matrix '{name}' (expected one of {})", names.join(", ")))
            })?;
            let mut layers = Vec::new();
            if let Some(lt) = layer_text {
                for part in lt.split('+') {
                    let num = |t: &str| t.trim().parse::<usize>().map_err(|_| bad(format!("bad layer '{t}'")));
                    let (a, b) = match part.split_once('-') {
                        Some((a, b)) => (num(a)?, num(b)?),
                        None => (num(part)?, num(part)?),
                    };
                    if a > b {
                        return Err(bad(format!("empty layer range {a}-{b}")));
                    }
                    layers.push((a, b));
                }
            }
            let (f, g) = match rhs.split_once('/') {
                Some((f, g)) => (f.trim(), Some(g.trim())),
                None => (rhs.trim(), None),
            };
            let format = Format::parse(f).ok_or_else(|| bad(format!("unknown format '{f}' (expected m, l, k or k6)")))?;
            let group = match g {
                Some(g) => g.parse::<usize>().map_err(|_| bad(format!("bad group '{g}'")))?,
                None => format.own_group().unwrap_or(default_group),
            };
            match format {
                Format::K if g.is_some() => {
                    return Err(bad(format!("format k has its own groups (32 under super-blocks of 256): drop the /{group}")))
                }
                Format::K6 if !format.takes_group(group) => {
                    return Err(bad(format!("format k6 takes groups of 16 (the default) or 32, got {group}")))
                }
                Format::M | Format::L if !format.takes_group(group) => {
                    return Err(bad(format!("group must be 32, 64 or 128, got {group}")))
                }
                _ => {}
            }
            out.push(TensorRule { kind, layers, format, group });
        }
        Ok(out)
    }

    fn applies(&self, kind: TensorKind, layer: Option<usize>) -> bool {
        self.kind == kind && (self.layers.is_empty() || layer.is_none_or(|l| self.layers.iter().any(|&(a, b)| (a..=b).contains(&l))))
    }
}

/// How [`quantize_model`] stores the matrices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// M (int4) or L (int8).
    pub format: Format,
    /// Values per scale: 32, 64 or 128.
    pub group: usize,
    /// Format of the LM head (a tied embedding included): L by default (see the module docs).
    pub head_format: Format,
    /// Values per scale of the LM head.
    pub head_group: usize,
    /// Values per scale of an untied embedding (stored in `format`).
    pub embed_group: usize,
    /// Apply the block Hadamard rotation (both sides; input side only for the embedding / LM head).
    pub rotate: bool,
    /// Matrices left unrotated when `rotate` is set ([`TensorKind::parse_unrotated`]: whole input sites).
    pub unrotated: Vec<TensorKind>,
    /// Seed of the random signs.
    pub seed: u64,
    /// Per-tensor formats overriding the above (the last matching rule wins).
    pub rules: Vec<TensorRule>,
}

/// The matrices `eddy quantize` leaves unrotated unless told otherwise (`--no-rotation-for`): the gate and up
/// projections. Measured on grid-free sources of both Qwen2.5-Coder models (BENCHMARKS.md, "rotation by
/// matrix" and "the rotation on the best recipe"): rotating gate/up raises their KL 11 % at m g128 when only
/// they are rotated; leaving them out of a whole-model rotation turns −15 % into −22 % (1.5B, m g128, round to
/// nearest), −18.7 % into −30 % (0.5B, m g128, GPTQ), and on the best 5-bit recipe (k with k6) +38 % into
/// −4.7 % against no rotation.
pub const DEFAULT_UNROTATED: [TensorKind; 2] = [TensorKind::Gate, TensorKind::Up];

impl QuantizeOptions {
    /// Whether matrices of `kind` are rotated (`None`: a matrix no rule names, rotated with the rest).
    fn rotates(&self, kind: Option<TensorKind>) -> bool {
        self.rotate && !kind.is_some_and(|k| self.unrotated.contains(&k))
    }

    /// `format` at `group` for every matrix but the LM head (L at `group`), rotated, seed 14.
    pub fn new(format: Format, group: usize) -> Self {
        QuantizeOptions {
            format,
            group,
            head_format: Format::L,
            head_group: group,
            embed_group: group,
            rotate: true,
            unrotated: Vec::new(),
            seed: 14,
            rules: Vec::new(),
        }
    }
}

/// Input site of the LM head (and of the embedding's input signs).
const HEAD: u64 = u64::MAX;

/// Input sites of the matrices of `model` that read activations, one matrix per site (the others of the
/// site read the same rows): `(matrix address, site, input width)`; the site numbering of
/// [`quantize_model`]. The address is only compared, never dereferenced.
fn tapped_sites(model: &Model) -> Vec<(usize, u64, usize, Option<TensorKind>)> {
    let at = |w: &WeightMatrix, site: u64, kind| (w as *const WeightMatrix as usize, site, w.cols(), kind);
    let mut v = vec![at(model.lm_head(), HEAD, Some(TensorKind::Head))];
    for (l, layer) in model.layers.iter().enumerate() {
        let l = l as u64;
        if let Mixer::Attention(a) = &layer.mixer {
            v.push(at(&a.wq, 4 * l, Some(TensorKind::Q)));
            v.push(at(&a.wo, 4 * l + 1, Some(TensorKind::O)));
        }
        v.push(at(&layer.w_gate, 4 * l + 2, Some(TensorKind::Gate)));
        v.push(at(&layer.w_down, 4 * l + 3, Some(TensorKind::Down)));
    }
    v
}

/// The Hessians `H = Σ x·xᵀ` of every input site of a model over a calibration text (GPTQ,
/// [`crate::quant::gptq`]), in the coordinates its matrices are quantized in (each input row rotated by
/// the site's input signs when [`QuantizeOptions::rotate`]).
pub struct Calibration {
    sites: std::collections::HashMap<u64, Hessian>,
    /// Tokens the model ran on.
    pub tokens: usize,
}

impl Calibration {
    /// Set the dampening of every Hessian ([`Hessian::damp`]).
    pub fn set_damp(&mut self, damp: f64) {
        self.sites.values_mut().for_each(|h| h.damp = damp);
    }
}

/// Run `model` (still in its source precision) on `tokens` in windows of `window` tokens (each from an
/// empty state, logits of every position computed so the LM head sees its inputs) on `threads` threads,
/// accumulating the Hessian of every input site of the attention layers, the FFN and the LM head
/// (hybrid models' Gated DeltaNet projections get none and are rounded to nearest).
///
/// Errors: no tokens, a window beyond the model's context, a token outside the vocabulary.
pub fn calibrate(model: &Model, opts: &QuantizeOptions, tokens: &[u32], window: usize, threads: usize) -> Result<Calibration> {
    use std::sync::Mutex;
    if tokens.is_empty() || window == 0 {
        return Err(Error::Input("eddy quantize: the calibration text has no tokens".into()));
    }
    // Input width of every site, and the signs its quantized matrices will carry.
    let widths: std::collections::HashMap<u64, usize> = tapped_sites(model).into_iter().map(|(_, site, cols, _)| (site, cols)).collect();
    let sites: std::collections::HashMap<usize, (u64, Option<Arc<Signs>>)> = tapped_sites(model)
        .into_iter()
        .map(|(a, site, cols, kind)| (a, (site, opts.rotates(kind).then(|| site_signs(opts, site, cols)))))
        .collect();
    let acc: Arc<Mutex<std::collections::HashMap<u64, Hessian>>> =
        Arc::new(Mutex::new(widths.iter().map(|(&site, &cols)| (site, Hessian::new(cols))).collect()));
    let acc_tap = Arc::clone(&acc);
    let tap_threads = threads.max(1);
    let tap: crate::backend::cpu::MatmulTap = Box::new(move |w, x, n| {
        let Some((site, signs)) = sites.get(&(w as *const WeightMatrix as usize)) else { return };
        let cols = w.cols();
        let mut rows;
        let x = match signs {
            Some(s) => {
                rows = x.to_vec();
                let rot = Rotation { input: Some(Arc::clone(s)), output: None };
                rows.chunks_exact_mut(cols).for_each(|r| rot.rotate_input(r));
                &rows[..]
            }
            None => x,
        };
        let mut acc = acc_tap.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = acc.get_mut(site) {
            h.add(x, n, tap_threads);
        }
    });
    let be = Cpu::with_tap(threads, tap);
    let window = window.min(tokens.len());
    let mut ws = super::forward::Workspace::new(&be, model, window);
    let mut logits = Vec::new();
    for chunk in tokens.chunks(window) {
        let mut state = model.new_state(&be, window);
        super::forward::forward(model, &be, &mut ws, &mut state, chunk, super::forward::Logits::All, &mut logits)?;
    }
    drop(be);
    let mut sites = std::mem::take(&mut *acc.lock().unwrap_or_else(|e| e.into_inner()));
    sites.values_mut().for_each(Hessian::finish);
    Ok(Calibration { sites, tokens: tokens.len() })
}

/// What one input site is: its signs are drawn from `(seed, site)`.
fn site_signs(opts: &QuantizeOptions, site: u64, n: usize) -> Arc<Signs> {
    let mut s = opts.seed ^ site.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Arc::new(Signs::random(n, splitmix64(&mut s)))
}

/// One matrix to convert: where it is, its input site, whether its output side is rotated, whether it is
/// the LM head (stored in L under either format).
struct Job<'a> {
    w: &'a mut WeightMatrix,
    site: u64,
    output: bool,
    head: bool,
    /// Whether the site's Hessian applies (not for an untied embedding, which is only looked up).
    reads: bool,
    /// What it is, for the [`TensorRule`]s (None: a matrix no rule names, e.g. Gated DeltaNet's).
    kind: Option<(TensorKind, Option<usize>)>,
}

/// Checks, before any work, what [`quantize_model`] would otherwise do silently: every matrix's values are
/// finite (a NaN or infinity would zero or poison its group scales), and every rule of `opts` names at least
/// one matrix of this model (e.g. `embed_tokens` when the embedding is tied to the LM head names none).
/// Dequantizes each matrix once, a row at a time.
///
/// Errors: the first matrix holding a non-finite value (by name and layer, with the row), or the first rule
/// that applies to nothing, as `Error::Input`.
pub fn check_source(model: &mut Model, opts: &QuantizeOptions) -> Result<()> {
    let jobs = jobs(model);
    for r in &opts.rules {
        if !jobs.iter().any(|j| j.kind.is_some_and(|(k, l)| r.applies(k, l))) {
            let name = r.kind.name();
            let hint = if r.kind == TensorKind::Embed { " (the embedding is tied to the LM head here: name lm_head)" } else { "" };
            return Err(Error::Input(format!("--tensor-format: the rule for {name} applies to no matrix of this model{hint}")));
        }
    }
    for job in jobs {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            job.w.dequant_row(r, &mut row);
            if let Some(c) = row.iter().position(|v| !v.is_finite()) {
                let name = match job.kind {
                    Some((k, l)) => l.map_or(k.name().to_string(), |l| format!("{} of layer {l}", k.name())),
                    None => "a Gated DeltaNet or MTP matrix".to_string(),
                };
                return Err(Error::Input(format!(
                    "the source's {name} holds a non-finite value ({} at row {r}, column {c}): not quantized",
                    row[c]
                )));
            }
        }
    }
    Ok(())
}

/// Every matrix [`quantize_model`] converts, in its order (the order numbers the output signs).
fn jobs(model: &mut Model) -> Vec<Job<'_>> {
    let n_layers = model.layers.len() as u64;
    let mut jobs: Vec<Job> = Vec::new();
    let tied = model.output.is_none();
    let embed_kind = Some((if tied { TensorKind::Head } else { TensorKind::Embed }, None));
    jobs.push(Job { w: &mut model.embed, site: HEAD, output: false, head: tied, reads: tied, kind: embed_kind });
    if let Some(o) = &mut model.output {
        jobs.push(Job { w: o, site: HEAD, output: false, head: true, reads: true, kind: Some((TensorKind::Head, None)) });
    }
    let mtp = model.mtp.as_mut().map(|m| (&mut m.fc, &mut m.layer));
    let layers = model.layers.iter_mut().enumerate().map(|(l, layer)| (l as u64, layer));
    let mut all_layers: Vec<(u64, &mut super::Layer)> = layers.collect();
    if let Some((fc, layer)) = mtp {
        jobs.push(Job { w: fc, site: 4 * (n_layers + 1), output: true, head: false, reads: true, kind: None });
        all_layers.push((n_layers, layer));
    }
    for (l, layer) in all_layers {
        let (a_in, a_out, f_in, f_down) = (4 * l, 4 * l + 1, 4 * l + 2, 4 * l + 3);
        let k = |kind| Some((kind, Some(l as usize)));
        match &mut layer.mixer {
            Mixer::Attention(a) => {
                for (w, kind) in [(&mut a.wq, TensorKind::Q), (&mut a.wk, TensorKind::K), (&mut a.wv, TensorKind::V)] {
                    jobs.push(Job { w, site: a_in, output: true, head: false, reads: true, kind: k(kind) });
                }
                jobs.push(Job { w: &mut a.wo, site: a_out, output: true, head: false, reads: true, kind: k(TensorKind::O) });
            }
            Mixer::DeltaNet(g) => {
                for w in [&mut g.w_qkv, &mut g.w_z, &mut g.w_b, &mut g.w_a] {
                    jobs.push(Job { w, site: a_in, output: true, head: false, reads: true, kind: None });
                }
                jobs.push(Job { w: &mut g.w_out, site: a_out, output: true, head: false, reads: true, kind: None });
            }
        }
        jobs.push(Job { w: &mut layer.w_gate, site: f_in, output: true, head: false, reads: true, kind: k(TensorKind::Gate) });
        jobs.push(Job { w: &mut layer.w_up, site: f_in, output: true, head: false, reads: true, kind: k(TensorKind::Up) });
        jobs.push(Job { w: &mut layer.w_down, site: f_down, output: true, head: false, reads: true, kind: k(TensorKind::Down) });
    }
    jobs
}

/// The rotation of job `i` (`rows × cols`, `cols` a multiple of 32) under `opts`: input signs of its
/// site, output signs of its own when its output side is rotated; none for a kind left unrotated.
fn job_rotation(opts: &QuantizeOptions, job: &Job, i: usize, rows: usize, cols: usize) -> Rotation {
    if !opts.rotates(job.kind.map(|(k, _)| k)) {
        return Rotation::default();
    }
    Rotation { input: Some(site_signs(opts, job.site, cols)), output: job.output.then(|| site_signs(opts, (1u64 << 40) + i as u64, rows)) }
}

/// The rotation alone, without rounding: every matrix [`quantize_model`] would rotate under `opts` (rows
/// a multiple of 32 long, a kind not in [`QuantizeOptions::unrotated`]) becomes f32
/// `W′ = H·D_out·W·D_in·H` with the signs `quantize_model` would draw (same seed, the same sharing
/// between matrices that read one input); the rest stay as they are; formats and groups are ignored.
/// The model then computes what it computed before, up to f32 rounding: the check that the run-time
/// rotations (each product's input and output sides, the embedding lookup's inverse) compose to the
/// identity (`tests/quant_model.rs`). Runs on the CPU backend only.
pub fn rotate_model(model: &mut Model, opts: &QuantizeOptions) {
    for (i, job) in jobs(model).into_iter().enumerate() {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        if !cols.is_multiple_of(crate::quant::QK) {
            continue;
        }
        let rotation = job_rotation(opts, &job, i, rows, cols);
        let mut data = vec![0f32; rows * cols];
        for (r, row) in data.chunks_exact_mut(cols).enumerate() {
            job.w.dequant_row(r, row);
        }
        rotation.rotate_matrix(&mut data, rows, cols);
        *job.w = WeightMatrix::F32 { rows, cols, data, rotation };
    }
}

/// Re-quantize every matrix of `model` to `opts` (see the module docs), then upload them to the CPU
/// backend (prepack). With `calib` ([`calibrate`] of the same model and options), every M matrix whose
/// input site has a Hessian is rounded by GPTQ/LDLQ ([`gptq::quantize_m`]) instead of to nearest (a
/// segment whose Hessian cannot be factored falls back to round to nearest, with a warning on stderr).
/// `progress(done, total)` is called after each matrix. Returns the bits per weight of the converted
/// matrices as a folder stores them (the bytes of their tensors, rotation signs included, over their
/// weights; f32 leftovers count 32).
pub fn quantize_model(
    model: &mut Model,
    opts: &QuantizeOptions,
    calib: Option<&Calibration>,
    progress: &mut dyn FnMut(usize, usize),
) -> f64 {
    for g in [opts.group, opts.head_group, opts.embed_group] {
        assert!(rtn::GROUPS.contains(&g), "group {g} (expected 32, 64 or 128)");
    }
    for r in &opts.rules {
        assert!(r.format.takes_group(r.group), "rule group {} for format {} (parse_list refuses it)", r.group, r.format.name());
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = jobs(model);
    let total = jobs.len();
    let (mut bits, mut weights) = (0f64, 0f64);
    for (i, job) in jobs.into_iter().enumerate() {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        let mut data = vec![0f32; rows * cols];
        for (r, row) in data.chunks_exact_mut(cols).enumerate() {
            job.w.dequant_row(r, row);
        }
        // The LM head (and a tied embedding) in its own format (L by default: the most sensitive matrix, as
        // llama.cpp keeps its output at 6-8 bits in every 4-bit type); an untied embedding (only looked
        // up, one row per token) in the asked format at its own group, as llama.cpp's Q4_K_M stores
        // token_embd in Q4_K.
        let (mut format, mut want) = if job.head {
            (opts.head_format, opts.head_group)
        } else if job.site == HEAD {
            (opts.format, opts.embed_group)
        } else {
            (opts.format, opts.group)
        };
        // K's and K6's own groups (32; 16 unless a rule says k6/32) under super-blocks.
        want = format.own_group().unwrap_or(want);
        if let Some((kind, layer)) = job.kind {
            if let Some(r) = opts.rules.iter().rev().find(|r| r.applies(kind, layer)) {
                (format, want) = (r.format, r.group);
            }
        }
        let group = [want, 64, 32].into_iter().find(|&g| g <= want && cols.is_multiple_of(g));
        let new = match group {
            Some(group) => {
                let rotation = job_rotation(opts, &job, i, rows, cols);
                let h = calib.filter(|_| job.reads && matches!(format, Format::M | Format::K) && cols.is_multiple_of(crate::quant::QK));
                match h.and_then(|c| c.sites.get(&job.site)).filter(|h| h.cols == cols) {
                    Some(h) => {
                        let mut w = data.clone();
                        rotation.rotate_matrix(&mut w, rows, cols);
                        let k = format == Format::K;
                        let q = if k {
                            gptq::quantize_k(rows, cols, &w, h, threads)
                        } else {
                            gptq::quantize_m(rows, cols, &w, group, h, threads)
                        };
                        match q {
                            Ok(mut m) => {
                                m.rotation = rotation;
                                WeightMatrix::Q(m)
                            }
                            Err(e) => {
                                eprintln!("eddy quantize: matrix {i} rounded to nearest: {e}");
                                rtn::quantize(rows, cols, &data, format, group, rotation)
                            }
                        }
                    }
                    None => rtn::quantize(rows, cols, &data, format, group, rotation),
                }
            }
            None => WeightMatrix::f32(rows, cols, data),
        };
        bits += 8.0 * matrix_tensors("", &new).iter().map(|t| t.3.len()).sum::<usize>() as f64;
        weights += (rows * cols) as f64;
        *job.w = new;
        progress(i + 1, total);
    }
    Cpu::upload_all(model.matmul_weights_mut());
    bits / weights
}

/// The matrices of `model` under their Hugging Face tensor names (`pre`: the folder's prefix, e.g.
/// `model.`), for the dense architectures.
fn named_matrices<'a>(model: &'a Model, pre: &str, lm_head: &str) -> Result<Vec<(String, &'a WeightMatrix)>> {
    let mut v = vec![(format!("{pre}embed_tokens.weight"), &model.embed)];
    if let Some(o) = &model.output {
        v.push((lm_head.to_string(), o));
    }
    for (l, layer) in model.layers.iter().enumerate() {
        let Mixer::Attention(a) = &layer.mixer else {
            return Err(Error::Input("eddy quantize: hybrid (Gated DeltaNet) models cannot be written yet".into()));
        };
        let p = |s: &str| format!("{pre}layers.{l}.{s}");
        v.extend([
            (p("self_attn.q_proj.weight"), &a.wq),
            (p("self_attn.k_proj.weight"), &a.wk),
            (p("self_attn.v_proj.weight"), &a.wv),
            (p("self_attn.o_proj.weight"), &a.wo),
            (p("mlp.gate_proj.weight"), &layer.w_gate),
            (p("mlp.up_proj.weight"), &layer.w_up),
            (p("mlp.down_proj.weight"), &layer.w_down),
        ]);
    }
    Ok(v)
}

/// The tensors that store one matrix in an eddy model folder (`docs/quant-formats.md`, "Model folder"):
/// `(name, dtype, shape, bytes)`.
fn matrix_tensors(name: &str, w: &WeightMatrix) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    use safetensors::Dtype;
    let (rows, cols) = (w.rows(), w.cols());
    let m = match w {
        WeightMatrix::Q(m) => m,
        _ => {
            let mut data = vec![0f32; cols];
            let mut bytes = Vec::with_capacity(rows * cols * 4);
            for r in 0..rows {
                // The values the matrix stands for (a rotated f32 matrix of `rotate_model` unrotated).
                w.dequant_row(r, &mut data);
                bytes.extend(data.iter().flat_map(|v| v.to_le_bytes()));
            }
            return vec![(name.to_string(), Dtype::F32, vec![rows, cols], bytes)];
        }
    };
    let nblk = rows * cols / crate::quant::QK;
    let mut codes = Vec::with_capacity(if m.bits == 8 { rows * cols } else { rows * cols / 2 });
    // Bits 6 (K6): the bit planes 4 and 5 of each block as in `QMatrix::hi` (the natural copy may be dropped).
    let mut high = Vec::with_capacity(if m.bits == 6 { rows * cols / 4 } else { 0 });
    for b in 0..nblk {
        let q = m.decode_block(b);
        if m.bits == 8 {
            codes.extend_from_slice(&q);
        } else {
            codes.extend((0..16).map(|j| (q[j] & 15) | ((q[j + 16] & 15) << 4)));
        }
        if m.bits == 6 {
            for p in 4..6 {
                let word = q.iter().enumerate().fold(0u32, |a, (j, &c)| a | (((c >> p) & 1) as u32) << j);
                high.extend_from_slice(&word.to_le_bytes());
            }
        }
    }
    let ccols = if m.bits == 8 { cols } else { cols / 2 };
    let mut out = vec![(name.to_string(), Dtype::U8, vec![rows, ccols], codes)];
    let f16b = |v: &[half::f16]| v.iter().flat_map(|h| h.to_bits().to_le_bytes()).collect::<Vec<u8>>();
    let ng = rows * cols / m.group;
    match &m.scales {
        crate::quant::GroupScales::F16 { scale, min } => {
            out.push((format!("{name}.scales"), Dtype::F16, vec![rows, cols / m.group], f16b(&scale[..ng])));
            if let Some(min) = min {
                out.push((format!("{name}.zero_points"), Dtype::F16, vec![rows, cols / m.group], f16b(&min[..ng])));
            }
        }
        crate::quant::GroupScales::SuperI8 { sc, mn: None, d, .. } => {
            // K6: the high bit planes, i8 multipliers per 16, f16 super-scales.
            let sbpr = crate::quant::super_blocks(cols);
            out.push((format!("{name}.high_bits"), Dtype::U8, vec![rows, cols / 4], std::mem::take(&mut high)));
            out.push((format!("{name}.scales"), Dtype::I8, vec![rows, cols / m.group], sc[..ng].iter().map(|&x| x as u8).collect()));
            let sup: Vec<half::f16> = d[..rows * sbpr].iter().map(|&x| half::f16::from_f32(x)).collect();
            out.push((format!("{name}.super_scales"), Dtype::F16, vec![rows, sbpr], f16b(&sup)));
        }
        crate::quant::GroupScales::SuperI8 { sc, mn: Some(mn), d, dmin } => {
            // K: 6-bit multipliers packed 4 to 3 bytes per row (a row's last triple padded with zero
            // multipliers when its group count is not a multiple of 4), f16 super-scales (exact: the grid
            // holds f16 values).
            let sbpr = crate::quant::super_blocks(cols);
            let per_row = 3 * (cols / m.group).div_ceil(4);
            let sup = |v: &[f32]| v[..rows * sbpr].iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>();
            let sb_shape = vec![rows, sbpr];
            out.push((format!("{name}.scales"), Dtype::U8, vec![rows, per_row], rtn::pack6_rows(&sc[..ng], cols / m.group)));
            out.push((format!("{name}.zero_points"), Dtype::U8, vec![rows, per_row], rtn::pack6_rows(&mn[..ng], cols / m.group)));
            out.push((format!("{name}.super_scales"), Dtype::F16, sb_shape.clone(), f16b(&sup(d))));
            out.push((format!("{name}.super_zero_points"), Dtype::F16, sb_shape, f16b(&sup(dmin))));
        }
    }
    let signs = |s: &Signs| s.v.iter().map(|&x| if x < 0.0 { 0xFFu8 } else { 1 }).collect::<Vec<u8>>();
    if let Some(s) = &m.rotation.input {
        out.push((format!("{name}.input_signs"), Dtype::I8, vec![cols], signs(s)));
    }
    if let Some(s) = &m.rotation.output {
        out.push((format!("{name}.output_signs"), Dtype::I8, vec![rows], signs(s)));
    }
    out
}

/// Where [`write_folder`] takes everything but the re-quantized matrices from.
pub enum Source<'a> {
    /// A Hugging Face folder: its files but the weights are copied, `config.json` gets a
    /// `quantization_config`, and its tensors other than the matrices are copied as stored.
    Hf(&'a Path),
    /// A model loaded from a GGUF file (after [`gguf_to_hf_layout`]): `config.json` is made from its
    /// [`ModelConfig`], `tokenizer.json` from `tokenizer` (the pipeline eddy built from the GGUF metadata),
    /// `tokenizer_config.json` names its BOS/EOS tokens and holds `chat_template`; the norms and biases are
    /// written as F32 under their Hugging Face names.
    Gguf {
        /// The tokenizer loaded with the model.
        tokenizer: &'a Tokenizer,
        /// The GGUF file's chat template, if any.
        chat_template: Option<&'a str>,
    },
}

/// Bring a model loaded from a GGUF file to the Hugging Face conventions an eddy folder is written in,
/// before [`quantize_model`] (the rotation must see the final row order): llama's q/k rows, which
/// llama.cpp's converter permutes per head so that RoPE pairs adjacent dimensions, are put back in the
/// `rotate_half` order (GGUF row `h·hd + 2j + s` → row `h·hd + s·hd/2 + j`, the inverse of the converter's
/// permutation) and the RoPE mode becomes [`RopeMode::Neox`]; qwen2/qwen3/gemma3 GGUFs already use the HF
/// order. Gemma 3's `1 + w` norms are converted when written ([`write_folder`]).
///
/// Errors: a hybrid (Qwen3.5) model, which eddy folders cannot hold yet; a llama whose RoPE does not cover
/// the whole head.
pub fn gguf_to_hf_layout(model: &mut Model) -> Result<()> {
    let c = model.config.clone();
    if c.arch == Arch::Qwen35 || model.is_hybrid() {
        return Err(Error::Input("eddy quantize: hybrid (Qwen3.5) models cannot be written as eddy folders yet".into()));
    }
    if c.rope_mode != RopeMode::Normal {
        return Ok(());
    }
    if c.rope_dims != c.head_dim {
        return Err(Error::Input(format!(
            "eddy quantize: adjacent-pair RoPE over {} of {} head dims has no Hugging Face layout",
            c.rope_dims, c.head_dim
        )));
    }
    let hd = c.head_dim;
    let unpermute_rows = |v: &[f32], row_len: usize| -> Vec<f32> {
        let mut o = vec![0f32; v.len()];
        for (r, src) in v.chunks_exact(row_len).enumerate() {
            let (h, i) = (r / hd, r % hd);
            let (j, s) = (i / 2, i % 2);
            let dst = h * hd + s * hd / 2 + j;
            o[dst * row_len..][..row_len].copy_from_slice(src);
        }
        o
    };
    let unpermute = |w: &mut WeightMatrix| {
        let (rows, cols) = (w.rows(), w.cols());
        let mut data = vec![0f32; rows * cols];
        for (r, row) in data.chunks_exact_mut(cols).enumerate() {
            w.dequant_row(r, row);
        }
        *w = WeightMatrix::f32(rows, cols, unpermute_rows(&data, cols));
    };
    for layer in &mut model.layers {
        let Mixer::Attention(a) = &mut layer.mixer else { continue };
        unpermute(&mut a.wq);
        unpermute(&mut a.wk);
        for b in [&mut a.bq, &mut a.bk].into_iter().flatten() {
            *b = unpermute_rows(b, 1);
        }
        a.rope.mode = RopeMode::Neox;
    }
    model.config.rope_mode = RopeMode::Neox;
    Ok(())
}

/// The Hugging Face `config.json` of `model` (loaded from a GGUF file, in HF layout: [`gguf_to_hf_layout`]),
/// which [`crate::models::hf`] reads back into the same [`ModelConfig`].
///
/// Errors: a hybrid (Qwen3.5) model.
pub fn hf_config(model: &Model, tokenizer: &Tokenizer) -> Result<serde_json::Value> {
    use serde_json::json;
    let c = &model.config;
    let (model_type, class) = match c.arch {
        Arch::Llama => ("llama", "LlamaForCausalLM"),
        Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
        Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
        Arch::Qwen35 => return Err(Error::Input("eddy quantize: hybrid (Qwen3.5) models cannot be written as eddy folders yet".into())),
    };
    let attention_bias = model.layers.iter().any(|l| l.attention().is_some_and(|a| a.bq.is_some()));
    let mut v = json!({
        "architectures": [class],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.train_ctx,
        "rms_norm_eps": c.norm_eps as f64,
        "rope_theta": c.rope_theta as f64,
        "tie_word_embeddings": model.output.is_none(),
        "attention_bias": attention_bias,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
    });
    if c.rope_scale != 1.0 {
        v["rope_scaling"] = json!({"rope_type": "linear", "factor": c.rope_scale as f64});
    }
    if c.rope_dims != c.head_dim {
        v["partial_rotary_factor"] = json!(c.rope_dims as f64 / c.head_dim as f64);
    }
    match c.arch {
        Arch::Gemma3 => {
            v["hidden_activation"] = json!("gelu_pytorch_tanh");
            v["rope_local_base_freq"] = json!(c.rope_theta_local as f64);
            v["query_pre_attn_scalar"] = json!(1.0 / (c.attn_scale as f64 * c.attn_scale as f64));
            let types: Vec<&str> = (0..c.n_layers).map(|l| if c.is_sliding(l) { "sliding_attention" } else { "full_attention" }).collect();
            v["layer_types"] = json!(types);
            if let Some(w) = c.sliding_window {
                v["sliding_window"] = json!(w);
            }
            if let Some(s) = c.final_softcap {
                v["final_logit_softcapping"] = json!(s as f64);
            }
        }
        _ => {
            v["hidden_act"] = json!("silu");
            v["use_sliding_window"] = json!(false);
        }
    }
    Ok(v)
}

/// The norms and biases of `model` (loaded from a GGUF file) under their Hugging Face names, as F32
/// (Gemma 3's `1 + w` norms stored as `w`).
fn gguf_vectors(model: &Model) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let gemma = model.config.arch == Arch::Gemma3;
    let norm = |name: String, v: &[f32]| (name, vec![v.len()], v.iter().map(|&x| if gemma { x - 1.0 } else { x }).collect());
    let mut out = vec![norm("model.norm.weight".into(), &model.output_norm)];
    for (l, layer) in model.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.push(norm(p("input_layernorm.weight"), &layer.attn_norm));
        match (&layer.post_attn_norm, &layer.post_ffn_norm) {
            (Some(pa), Some(pf)) => {
                out.push(norm(p("post_attention_layernorm.weight"), pa));
                out.push(norm(p("pre_feedforward_layernorm.weight"), &layer.ffn_norm));
                out.push(norm(p("post_feedforward_layernorm.weight"), pf));
            }
            _ => out.push(norm(p("post_attention_layernorm.weight"), &layer.ffn_norm)),
        }
        if let Some(a) = layer.attention() {
            for (s, b) in [("q_proj", &a.bq), ("k_proj", &a.bk), ("v_proj", &a.bv)] {
                if let Some(b) = b {
                    out.push((p(&format!("self_attn.{s}.bias")), vec![b.len()], b.clone()));
                }
            }
            if let Some(n) = &a.q_norm {
                out.push(norm(p("self_attn.q_norm.weight"), n));
            }
            if let Some(n) = &a.k_norm {
                out.push(norm(p("self_attn.k_norm.weight"), n));
            }
        }
    }
    out
}

/// Refuse a safetensors folder whose `config.json` has a `quantization_config` (an eddy folder, or a
/// GPTQ/AWQ/bitsandbytes checkpoint) as a source: its matrices are already rounded to a grid and their
/// side tensors (scales, zero points, signs) are not model weights, so re-quantizing would compound the
/// error and mix old side tensors into the new folder. A folder without a readable config is left to the
/// loader's own errors.
///
/// Errors: [`Error::Model`] naming the folder and the quantization method.
pub fn refuse_quantized_source(dir: &Path) -> Result<()> {
    let cfg = dir.join(crate::model_dir::CONFIG_FILE);
    let Ok(text) = std::fs::read_to_string(&cfg) else { return Ok(()) };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return Ok(()) };
    match v.get("quantization_config") {
        Some(q) if !q.is_null() => {
            let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("unknown");
            Err(Error::model(
                dir,
                format!(
                    "already quantized (quantization_config.quant_method = {method}); give the original GGUF or \
                     unquantized safetensors model"
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Write `model` — re-quantized by [`quantize_model`] with `opts` — as an eddy model folder `out`
/// (`docs/quant-formats.md`, "Model folder"): config, tokenizer and the other tensors from `src` (see
/// [`Source`]), `config.json` with a `quantization_config` added, and `model.safetensors` with the
/// re-quantized matrices. Written into a temporary folder next to `out` and renamed into place at the end:
/// on any error nothing is left at `out` (nor the temporary).
///
/// Errors: `out` exists, a hybrid model, an I/O failure, what reading `src` reports.
pub fn write_folder(src: Source, model: &Model, opts: &QuantizeOptions, out: &Path) -> Result<()> {
    write_atomically(out, |tmp| write_into(&src, model, opts, tmp))
}

/// Run `write` on a temporary folder next to `out`, then rename it to `out`; on any error the temporary
/// folder is removed, so nothing half-written is left behind.
///
/// Errors: `out` exists or has no folder name; `write`'s error; the rename's.
fn write_atomically(out: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if out.exists() {
        return Err(Error::model(out, "already exists (eddy quantize never overwrites; remove it or pick another -o)"));
    }
    let file_name = out.file_name().ok_or_else(|| Error::model(out, "not a folder name"))?.to_string_lossy().into_owned();
    remove_stale_temporaries(out, &file_name);
    let tmp = crate::load::temp_sibling(out);
    let result = write(&tmp).and_then(|()| std::fs::rename(&tmp, out).map_err(|e| Error::Io { path: out.to_path_buf(), source: e }));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Remove `.NAME.tmp-PID` folders next to `out` left by an earlier write of the same output that was killed
/// (SIGKILL/SIGTERM skip [`write_atomically`]'s cleanup) and whose process no longer runs (Linux: no
/// `/proc/PID`; elsewhere nothing is removed). Failures are ignored: a stale folder only costs disk space.
fn remove_stale_temporaries(out: &Path, file_name: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let prefix = format!(".{file_name}.tmp-");
    let Ok(entries) = std::fs::read_dir(&parent) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// One tensor to serialize: name, dtype, shape, little-endian bytes.
type RawTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Write `tensors` as `tmp`/model.safetensors.
fn write_tensors(tmp: &Path, tensors: &[RawTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::model(tmp, format!("cannot lay out the tensors: {e}")))?;
    let out_w = tmp.join(crate::model_dir::WEIGHTS_FILE);
    safetensors::serialize_to_file(views, None, &out_w).map_err(|e| Error::model(&out_w, format!("cannot write: {e}")))?;
    // safetensors writes through a private (0600) temporary file; the folder's other files are
    // world-readable, and a model folder is read by other users and containers.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&out_w, std::fs::Permissions::from_mode(0o644)).map_err(io(&out_w))?;
    }
    Ok(())
}

/// Write the safetensors folder `src` (a DFlash drafter: `config.json`, `model.safetensors`, optional
/// `draft_vocab.json`) to `out` with every matrix (2-D F32/F16/BF16 tensor) in eddy's L format, groups of 32,
/// no rotation (`docs/quant-formats.md`, "Model folder"): exactly the matrices `--quant q8` builds when it
/// loads `src` ([`crate::model_dir::Quant::Q8`], the min/max rule of `quant::rtn`), so the written folder
/// drafts bit-identically to `src` loaded with q8, in about half the bytes of bf16. Vectors (norms) are
/// copied as stored, every other file of `src` is copied, and `config.json` gains a `quantization_config`
/// that names the format. Written to a temporary folder next to `out`, renamed into place at the end.
///
/// Errors: `out` exists; `src` unreadable or not a safetensors folder; a matrix with a row length that is not
/// a multiple of 32 (it would stay f32; refused so the output is always int8); I/O errors.
pub fn write_q8_folder(src: &Path, out: &Path) -> Result<()> {
    use crate::model_dir::{Quant, CONFIG_FILE, WEIGHTS_INDEX_FILE};
    write_atomically(out, |tmp| {
        std::fs::create_dir_all(tmp).map_err(io(tmp))?;
        let t = Tensors::open(src)?;
        let mut names: Vec<&String> = t.names().collect();
        names.sort();
        let mut tensors = Vec::new();
        for name in names {
            let Some((dtype, shape, bytes)) = t.raw(name) else { continue };
            let float = matches!(dtype, safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16);
            if let ([rows, cols], true) = (shape, float) {
                if !cols.is_multiple_of(crate::quant::QK) {
                    return Err(Error::model(&t.listing, format!("matrix {name}: row length {cols} is not a multiple of 32")));
                }
                tensors.extend(matrix_tensors(name, &t.matrix(name, *rows, *cols, Quant::Q8, false)?));
            } else {
                tensors.push((name.clone(), dtype, shape.to_vec(), bytes.to_vec()));
            }
        }
        write_tensors(tmp, &tensors)?;
        for entry in std::fs::read_dir(src).map_err(io(src))? {
            let entry = entry.map_err(io(src))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !entry.path().is_file() || name.ends_with(".safetensors") || name == WEIGHTS_INDEX_FILE || name == "SHA256SUMS" {
                continue;
            }
            std::fs::copy(entry.path(), tmp.join(&name)).map_err(io(&entry.path()))?;
        }
        let cfg_path = src.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let mut cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?;
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "eddy", "format": "l", "group_size": crate::quant::QK, "rotation": false,
            "layout": "docs/quant-formats.md of eddy"
        });
        let out_cfg = tmp.join(CONFIG_FILE);
        std::fs::write(&out_cfg, serde_json::to_string_pretty(&cfg).unwrap_or_default() + "\n").map_err(io(&out_cfg))
    })
}

fn io(p: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let p = p.to_path_buf();
    move |e: std::io::Error| Error::Io { path: p, source: e }
}

fn write_into(src: &Source, model: &Model, opts: &QuantizeOptions, tmp: &Path) -> Result<()> {
    use crate::model_dir::{CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_INDEX_FILE};
    if let Source::Hf(src) = src {
        refuse_quantized_source(src)?;
    }
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    let mut cfg = match src {
        Source::Hf(src) => {
            for entry in std::fs::read_dir(src).map_err(io(src))? {
                let entry = entry.map_err(io(src))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if !entry.path().is_file() || name.ends_with(".safetensors") || name == WEIGHTS_INDEX_FILE || name == CONFIG_FILE {
                    continue;
                }
                std::fs::copy(entry.path(), tmp.join(&name)).map_err(io(&entry.path()))?;
            }
            let cfg_path = src.join(CONFIG_FILE);
            let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
            serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("malformed config: {e}")))?
        }
        Source::Gguf { tokenizer, chat_template } => {
            let tok_path = tmp.join(TOKENIZER_FILE);
            tokenizer.inner().save(&tok_path, false).map_err(|e| Error::model(&tok_path, format!("cannot write: {e}")))?;
            let name = |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i));
            let tok_cfg = serde_json::json!({
                "bos_token": name(tokenizer.bos_id),
                "eos_token": name(tokenizer.eos_id),
                "add_bos_token": tokenizer.add_bos,
                "clean_up_tokenization_spaces": false,
                "chat_template": chat_template,
            });
            let p = tmp.join(TOKENIZER_CONFIG_FILE);
            std::fs::write(&p, serde_json::to_string_pretty(&tok_cfg).unwrap_or_default()).map_err(io(&p))?;
            hf_config(model, tokenizer)?
        }
    };
    let fmt = opts.format.name();
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "eddy", "format": fmt,
        "group_size": opts.format.own_group().unwrap_or(opts.group), "rotation": opts.rotate, "seed": opts.seed,
        "layout": "docs/quant-formats.md of eddy"
    });
    if opts.rotate && !opts.unrotated.is_empty() {
        let names: Vec<&str> = TensorKind::NAMES.iter().filter(|(_, k)| opts.unrotated.contains(k)).map(|(n, _)| *n).collect();
        cfg["quantization_config"]["unrotated"] = serde_json::json!(names);
    }
    let out_cfg = tmp.join(CONFIG_FILE);
    std::fs::write(&out_cfg, serde_json::to_string_pretty(&cfg).unwrap_or_default()).map_err(io(&out_cfg))?;
    let mut tensors = Vec::new();
    match src {
        Source::Hf(src) => {
            let t = Tensors::open(src)?;
            let pre = ["model.language_model.", "language_model.model.", "model."]
                .into_iter()
                .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
                .ok_or_else(|| Error::model(&t.listing, "missing tensor model.embed_tokens.weight"))?;
            let lm_head =
                ["lm_head.weight", "language_model.lm_head.weight"].into_iter().find(|n| t.contains(n)).unwrap_or("lm_head.weight");
            let matrices: std::collections::HashMap<String, &WeightMatrix> = named_matrices(model, pre, lm_head)?.into_iter().collect();
            for name in t.names() {
                if let Some(w) = matrices.get(name) {
                    tensors.extend(matrix_tensors(name, w));
                } else if let Some((dtype, shape, bytes)) = t.raw(name) {
                    tensors.push((name.clone(), dtype, shape.to_vec(), bytes.to_vec()));
                }
            }
            if let Some(name) = matrices.keys().find(|n| !t.contains(n)) {
                return Err(Error::model(&t.listing, format!("matrix {name} of the model is not in the folder")));
            }
        }
        Source::Gguf { .. } => {
            for (name, w) in named_matrices(model, "model.", "lm_head.weight")? {
                tensors.extend(matrix_tensors(&name, w));
            }
            for (name, shape, v) in gguf_vectors(model) {
                tensors.push((name, safetensors::Dtype::F32, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()));
            }
        }
    }
    write_tensors(tmp, &tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed quantize's `.NAME.tmp-PID` folder (its PID gone) is removed by the next write of NAME; folders
    /// of running processes, of this process and of other outputs are kept.
    #[test]
    fn stale_temporary_folders_of_dead_writers_are_removed() {
        if !Path::new("/proc/self").exists() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("eddy-stale-tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let dead = dir.join(".out.tmp-4194305"); // above Linux's largest pid_max (2^22)
        let live = dir.join(".out.tmp-1");
        let own = dir.join(format!(".out.tmp-{}", std::process::id()));
        let other = dir.join(".other.tmp-4194305");
        for d in [&dead, &live, &own, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.safetensors"), b"partial").unwrap();
        }
        remove_stale_temporaries(&dir.join("out"), "out");
        assert!(!dead.exists());
        assert!(live.exists() && own.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A K (and a K6) matrix written as a folder's tensors ([`matrix_tensors`], [`write_tensors`]) loads back
    /// (`Tensors::matrix`) as the same [`QMatrix`]: codes, multipliers, super-scales; the side tensors with a
    /// wrong shape or dtype, or missing, are errors naming the tensor (no panic). Rows of 512 (whole super-blocks),
    /// 896 (3·256 + a partial super-block of 128) and 864 (27 groups: the packed multipliers of a row padded).
    #[test]
    fn k_matrix_folder_round_trip_and_bad_tensors() {
        for cols in [512, 896, 864] {
            k_matrix_folder_round_trip_at(cols);
        }
    }

    fn k_matrix_folder_round_trip_at(cols: usize) {
        use crate::model_dir::Quant;
        use crate::quant::GroupScales;
        use safetensors::Dtype;
        let rows = 24;
        let mut s = 9u64 + cols as u64;
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                let u = (splitmix64(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if splitmix64(&mut s).is_multiple_of(50) {
                    u
                } else {
                    0.03 * u + 0.002
                }
            })
            .collect();
        let q = rtn::quantize(rows, cols, &w, Format::K, 32, Rotation::default());
        let WeightMatrix::Q(m) = &q else { panic!("not quantized") };
        assert!(m.cols == cols && m.bits == 4 && matches!(m.scales, GroupScales::SuperI8 { mn: Some(_), .. }), "not K");
        let tmp = std::env::temp_dir().join(format!("eddy-k-folder-{}-{cols}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let ts = matrix_tensors("w", &q);
        // Codes, 6-bit multipliers (packed per row), super-scales: 4.5 bits per weight at cols % 256 == 0.
        let (tri, sbpr) = (3 * (cols / 32).div_ceil(4), cols.div_ceil(256));
        assert_eq!(ts.iter().map(|t| t.3.len()).sum::<usize>(), rows * (cols / 2 + 2 * tri + 4 * sbpr));
        write_tensors(&tmp, &ts).unwrap();
        let back = crate::model_dir::Tensors::open(&tmp).unwrap().matrix("w", rows, cols, Quant::None, false).unwrap();
        let WeightMatrix::Q(b) = &back else { panic!("not quantized") };
        assert_eq!((b.rows, b.cols, b.bits, b.group), (m.rows, m.cols, m.bits, m.group));
        assert_eq!(b.lo, m.lo);
        let (GroupScales::SuperI8 { sc, mn, d, dmin }, GroupScales::SuperI8 { sc: sc2, mn: mn2, d: d2, dmin: dmin2 }) =
            (&m.scales, &b.scales)
        else {
            panic!("not K scales")
        };
        assert!(sc.iter().any(|&x| x > 1) && mn.as_ref().unwrap().iter().any(|&x| x > 1), "trivial multipliers");
        assert_eq!((sc, mn, d, dmin), (sc2, mn2, d2, dmin2));
        for (victim, dtype, shape) in [
            ("w.scales", Dtype::U8, vec![rows, tri - 3]),
            ("w.zero_points", Dtype::I8, vec![rows, tri]),
            ("w.super_scales", Dtype::F16, vec![rows, sbpr + 1]),
            ("w.super_zero_points", Dtype::F32, vec![rows, sbpr]),
            ("w.super_zero_points", Dtype::U8, vec![0, 0]),
        ] {
            let mut bad: Vec<RawTensor> = ts.iter().filter(|t| t.0 != victim).cloned().collect();
            if shape != [0, 0] {
                let n = shape.iter().product::<usize>()
                    * if matches!(dtype, Dtype::F16) {
                        2
                    } else if dtype == Dtype::F32 {
                        4
                    } else {
                        1
                    };
                bad.push((victim.to_string(), dtype, shape.clone(), vec![1u8; n]));
            }
            let dir = tmp.join(format!("bad-{victim}-{dtype:?}"));
            std::fs::create_dir_all(&dir).unwrap();
            write_tensors(&dir, &bad).unwrap();
            let err = crate::model_dir::Tensors::open(&dir).unwrap().matrix("w", rows, cols, Quant::None, false).unwrap_err().to_string();
            let short = victim.trim_start_matches("w.");
            assert!(err.contains("tensor w") && err.contains(short), "{victim} {dtype:?} {shape:?}: {err}");
        }
        // K6 at both groups: the same round trip; its side tensors checked too.
        for group in rtn::K6_GROUPS {
            let q6 = rtn::quantize(rows, cols, &w, Format::K6, group, Rotation::default());
            let WeightMatrix::Q(m6) = &q6 else { panic!("not quantized") };
            let ts6 = matrix_tensors("w", &q6);
            assert_eq!(ts6.iter().map(|t| t.3.len()).sum::<usize>(), rows * (cols / 2 + cols / 4 + cols / group + 2 * sbpr));
            let dir6 = tmp.join(format!("k6-{group}"));
            std::fs::create_dir_all(&dir6).unwrap();
            write_tensors(&dir6, &ts6).unwrap();
            let back6 = crate::model_dir::Tensors::open(&dir6).unwrap().matrix("w", rows, cols, Quant::None, false).unwrap();
            let WeightMatrix::Q(b6) = &back6 else { panic!("not quantized") };
            assert_eq!((b6.bits, b6.group, &b6.lo, &b6.hi), (6, group, &m6.lo, &m6.hi));
            let (GroupScales::SuperI8 { sc, mn: None, d, .. }, GroupScales::SuperI8 { sc: sc2, mn: None, d: d2, .. }) =
                (&m6.scales, &b6.scales)
            else {
                panic!("not K6 scales")
            };
            assert_eq!((sc, d), (sc2, d2));
            let bad_victims = [
                ("w.high_bits", Dtype::U8, vec![rows, cols / 2]),
                ("w.scales", Dtype::U8, vec![rows, cols / group]),
                ("w.scales", Dtype::I8, vec![rows, cols / 64]),
            ];
            for (victim, dtype, shape) in bad_victims {
                let mut bad: Vec<RawTensor> = ts6.iter().filter(|t| t.0 != victim).cloned().collect();
                bad.push((victim.to_string(), dtype, shape.clone(), vec![1u8; shape.iter().product()]));
                let dir = tmp.join(format!("bad6-{group}-{victim}-{dtype:?}"));
                std::fs::create_dir_all(&dir).unwrap();
                write_tensors(&dir, &bad).unwrap();
                let err =
                    crate::model_dir::Tensors::open(&dir).unwrap().matrix("w", rows, cols, Quant::None, false).unwrap_err().to_string();
                assert!(err.contains(victim.trim_start_matches("w.")), "{victim}: {err}");
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }

    /// Rules parse into the documented fields (default group, layer ranges, case of the format) and match
    /// the layers they name; malformed rules are errors naming the rule.
    #[test]
    fn tensor_rules_parse_and_match() {
        let r = TensorRule::parse_list(" v_proj=l/32, down_proj@0+2-3=M ,lm_head=m/128,", 64).unwrap();
        assert_eq!(
            r,
            vec![
                TensorRule { kind: TensorKind::V, layers: vec![], format: Format::L, group: 32 },
                TensorRule { kind: TensorKind::Down, layers: vec![(0, 0), (2, 3)], format: Format::M, group: 64 },
                TensorRule { kind: TensorKind::Head, layers: vec![], format: Format::M, group: 128 },
            ]
        );
        let hits: Vec<usize> = (0..6).filter(|&l| r[1].applies(TensorKind::Down, Some(l))).collect();
        assert_eq!(hits, [0, 2, 3]);
        assert!(!r[1].applies(TensorKind::Up, Some(0)) && r[0].applies(TensorKind::V, Some(17)));
        assert!(r[2].applies(TensorKind::Head, None));
        for bad in ["v_proj", "w_proj=l", "v_proj=q", "v_proj=l/48", "down_proj@3-1=l", "down_proj@x=l", "down_proj@=m"] {
            let e = TensorRule::parse_list(bad, 64).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
        assert!(TensorRule::parse_list("", 64).unwrap().is_empty());
    }
}
