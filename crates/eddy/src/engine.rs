//! The engine: owns the model, the sequence state and the workspace, and runs the generate loop.
//!
//! `generate` = prefill the prompt in one forward pass (chunked internally) → sample the first token →
//! decode until an end-of-generation token, `max_tokens`, or the context is full.
//! Sampling is keyed by (seed, absolute position), see [`crate::sampling`].
//!
//! Decoding is one loop for plain and speculative decoding: each step builds a token tree below the last
//! sampled token (the root; just the root without speculators), verifies it in one target forward pass
//! ([`forward_tree`]), walks it with the target's own samples ([`accept_walk`]) and commits the accepted
//! path ([`SeqState::commit_path`]). The emitted tokens are those of plain decoding whatever the tree.
//!
//! Prefix cache: the committed sequence of the previous request is kept; a new prompt that starts with
//! part of it reuses those KV rows and prefills only the rest (batch-invariant kernels make the result
//! identical to a cold prefill).

#[cfg(feature = "cuda")]
use crate::backend::cuda::Cuda;
use crate::backend::{Backend, Cpu};
use crate::error::{Error, Result};
use crate::load::LoadedModel;
use crate::models::forward::{
    commit_tree, decode, decode_ahead, forward, forward_tree, last_hidden, reusable_prefix, take_ahead_id, Logits, Workspace,
};
use crate::models::Model;
use crate::sampling::{LogitMask, Sampler, SamplerParams};
use crate::spec::dflash::{time_block_pass, DFlashDrafter, TargetParts};
use crate::spec::{
    accept_walk_into, build_speculators, Budget, CostModel, DraftTree, Drafter, FeatureRows, ProposeCtx, SelectScratch, SpecGate,
    Speculator, SpeculatorKind, Walk,
};
use crate::state::{LayerKind, SeqState};
use crate::stats::{FinishReason, GenerationStats};
use crate::tree::TreePaths;
use std::time::Instant;

/// Which backend runs the model ([`Engine::on_device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// An NVIDIA GPU when the build has CUDA and one is present and can run the model, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU (builds with the `cuda` feature).
    Cuda,
}

/// Engine construction options.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Worker threads (the calling thread included).
    pub threads: usize,
    /// Context length in tokens (KV cache rows); capped at the model's training context.
    pub ctx: usize,
    /// Largest batch of one forward pass (prefill piece); 0 (the default) takes the backend's
    /// [`Backend::prefill_tokens`] (256 on the CPU, 512 on a GPU).
    pub max_batch: usize,
    /// Reuse the KV of the longest common prefix with the previous request instead of prefilling it
    /// again (`eddy serve --no-prefix-cache` turns it off). Output is identical either way on the CPU. On a
    /// GPU a prompt's KV rows depend in their last bits on whether its tokens were prefilled in a pass of more
    /// than 64 tokens (products in block order) or decoded, so a reused prefix that holds a previous reply
    /// can change later tokens slightly, as in llama.cpp (docs/cuda.md, "Batch invariance").
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { threads: default_threads(), ctx: 4096, max_batch: 0, prefix_cache: true }
    }
}

/// Physical cores available to this process (at least 1).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampler: SamplerParams,
    /// Keep generating through end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// ([`TokenLogprobs`]); `None`: none (no cost).
    pub logprobs: Option<usize>,
}

/// The log-probability of one generated token and the `k` most likely tokens at its position, under the
/// target model's own distribution: log-softmax of the raw logits, before temperature, repetition
/// penalty and top-k/top-p/min-p truncation (OpenAI's `logprobs`; vLLM's `raw_logprobs`). Identical with
/// and without speculation (the tree's logits are plain decoding's: bit-identical for attention layers, up
/// to rounding through Gated DeltaNet layers).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The generated token.
    pub id: u32,
    /// Its log-probability (natural log, ≤ 0).
    pub logprob: f32,
    /// The `k` most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// From the raw logits `row` (one position, `vocab` values) and the token `id` generated there.
    pub fn new(row: &[f32], id: u32, k: usize) -> TokenLogprobs {
        let lse = log_sum_exp(row);
        let lp = |v: f32| (v as f64 - lse) as f32;
        TokenLogprobs {
            id,
            logprob: lp(row[id as usize]),
            top: match k.min(row.len()) {
                0 => Vec::new(),
                k => crate::spec::top_k(row, k).into_iter().map(|(t, v)| (t, lp(v))).collect(),
            },
        }
    }
}

/// Where the tokens of [`Engine::generate_to`] go.
pub trait TokenSink {
    /// A generated token (end-of-generation tokens are not passed on) and its log-probabilities when
    /// [`GenerateParams::logprobs`] asks for them; `false` stops the generation ([`FinishReason::Cancelled`]).
    fn token(&mut self, id: u32, logprobs: Option<&TokenLogprobs>) -> bool;

    /// Polled before each prefill piece; `true` ends the generation with [`FinishReason::Cancelled`] and no
    /// token.
    fn cancelled(&self) -> bool {
        false
    }
}

/// The emitting side of one generation: the sequence so far, the statistics and the sink.
struct Emit<'a, 'm> {
    stats: GenerationStats,
    t0: Instant,
    t_first: Option<Instant>,
    t_last: Instant,
    /// Prompt and every emitted token (the sampler's penalty history).
    history: Vec<u32>,
    params: &'a GenerateParams,
    sink: &'a mut dyn TokenSink,
    /// The constraint on every sampled token ([`Engine::generate_masked`]), if any.
    mask: Option<&'m mut dyn LogitMask>,
}

impl Emit<'_, '_> {
    fn stats_mut(&mut self) -> &mut GenerationStats {
        &mut self.stats
    }

    /// Emit token `y` (`stop`: an end-of-generation token; `full`: the context has no room for another):
    /// the one place where generation ends for a stop token, the sink, `max_tokens` or a full context.
    fn emit(&mut self, y: u32, lp: Option<&TokenLogprobs>, stop: bool, full: bool) -> Option<FinishReason> {
        let now = Instant::now();
        if self.t_first.is_none() {
            self.t_first = Some(now);
            self.stats.ttft = now - self.t0;
        }
        self.t_last = now;
        self.stats.generated_tokens += 1;
        if !self.params.ignore_eos && stop {
            return Some(FinishReason::Stop);
        }
        if !self.sink.token(y, lp) {
            return Some(FinishReason::Cancelled);
        }
        self.history.push(y);
        if self.stats.generated_tokens >= self.params.max_tokens || full {
            return Some(FinishReason::Length);
        }
        None
    }
}

/// A backend with the workspace and sequence state of the engine's one sequence, and the speculators
/// that draft for it (a draft model on this backend, host-side speculators through [`crate::spec::OnHost`]).
struct Core<B: Backend> {
    be: B,
    ws: Workspace<B>,
    state: SeqState<B>,
    specs: Vec<Box<dyn Speculator<B>>>,
}

impl<B: Backend> Core<B> {
    /// `max_batch` 0: the backend's [`Backend::prefill_tokens`].
    fn new(be: B, model: &Model<B>, ctx: usize, max_batch: usize) -> Self {
        let state = model.new_state(&be, ctx);
        let max_batch = if max_batch == 0 { be.prefill_tokens() } else { max_batch };
        let ws = Workspace::new(&be, model, max_batch);
        Core { be, ws, state, specs: Vec::new() }
    }
}

/// Where the model runs: the CPU runs the host model itself ([`Engine::lm`]'s); a device backend holds its
/// own copy of the weights (uploaded once) next to a CPU pool for host-side work (drafters that run on the
/// CPU). One variant per backend; the engine's code is written once, generic over the backend, through
/// [`on_device!`] / [`on_core!`].
enum Exec {
    Cpu(Box<Core<Cpu>>),
    #[cfg(feature = "cuda")]
    Cuda {
        core: Box<Core<Cuda>>,
        model: Box<Model<Cuda>>,
        host: Cpu,
    },
}

/// `$body` with `$c` the active [`Core`] and `$m` the model it runs (for the CPU, `$host`).
macro_rules! on_device {
    ($exec:expr, $host:expr, |$c:ident, $m:ident| $body:expr) => {
        match $exec {
            Exec::Cpu($c) => {
                let $m = $host;
                $body
            }
            #[cfg(feature = "cuda")]
            Exec::Cuda { core: $c, model, .. } => {
                let $m = &**model;
                $body
            }
        }
    };
}

/// `$body` with `$c` the active [`Core`].
macro_rules! on_core {
    ($exec:expr, |$c:ident| $body:expr) => {
        match $exec {
            Exec::Cpu($c) => $body,
            #[cfg(feature = "cuda")]
            Exec::Cuda { core: $c, .. } => $body,
        }
    };
}

/// `$body` with the active core's speculators `$s`, its backend `$be`, its sequence state `$st`, the CPU
/// pool `$host` (on the CPU: the backend itself) and the model the backend runs `$m` (for the CPU, `$lm`).
macro_rules! on_specs {
    ($exec:expr, $lm:expr, |$s:ident, $be:ident, $st:ident, $host:ident, $m:ident| $body:expr) => {
        match $exec {
            Exec::Cpu(c) => {
                let Core { be, specs: $s, state: $st, .. } = &mut **c;
                #[allow(unused_variables)]
                let ($be, $host, $st, $m) = (&*be, &*be, &*$st, $lm);
                $body
            }
            #[cfg(feature = "cuda")]
            Exec::Cuda { core, host, model } => {
                let Core { be, specs: $s, state: $st, .. } = &mut **core;
                #[allow(unused_variables)]
                let ($be, $host, $st, $m): (_, &Cpu, _, _) = (&*be, &*host, &*$st, &**model);
                $body
            }
        }
    };
}

impl Exec {
    /// The CPU pool host-side work runs on (drafters that run on the CPU).
    fn host(&self) -> &Cpu {
        match self {
            Exec::Cpu(c) => &c.be,
            #[cfg(feature = "cuda")]
            Exec::Cuda { host, .. } => host,
        }
    }
    fn n_past(&self) -> usize {
        on_core!(self, |c| c.state.n_past())
    }
    fn ctx(&self) -> usize {
        on_core!(self, |c| c.state.ctx)
    }
    fn kv_bytes(&self) -> usize {
        on_core!(self, |c| c.state.nbytes())
    }
    fn max_batch(&self) -> usize {
        on_core!(self, |c| c.ws.max_batch)
    }
    /// Row `row` of the sampling head's logits of the last pass (`vocab` values) appended to `out`.
    fn read_head_row(&self, row: usize, vocab: usize, out: &mut Vec<f32>) {
        on_core!(self, |c| c.be.read(c.ws.head_logits.as_ref().expect("a pass under the sampling head"), row, 1, vocab, out))
    }
    fn clear(&mut self) {
        on_core!(self, |c| c.state.clear())
    }
    fn truncate(&mut self, n: usize) {
        on_core!(self, |c| c.state.truncate(n))
    }
    /// The decoder layers whose outputs the target captures for a feature drafter (empty: none).
    fn feature_layers(&self) -> &[usize] {
        on_core!(self, |c| &c.state.features.layers)
    }
    fn set_feature_layers(&mut self, layers: Vec<usize>) {
        on_core!(self, |c| c.state.features.set_layers(layers))
    }
    fn set_want_hidden(&mut self, on: bool) {
        on_core!(self, |c| c.state.want_hidden = on)
    }
    fn speculating(&self) -> bool {
        on_core!(self, |c| !c.specs.is_empty())
    }
    fn specs_want_hidden(&self) -> bool {
        on_core!(self, |c| c.specs.iter().any(|s| s.wants_hidden()))
    }
}

/// A model ready to generate, with the state of its one sequence.
pub struct Engine {
    /// The model, tokenizer and template.
    pub lm: LoadedModel,
    exec: Exec,
    sampler: Sampler,
    logits: Vec<f32>,
    prefix_cache: bool,
    budget: Budget,
    cost: CostModel,
    step: StepScratch,
    /// Greedy decoding on a device takes each logits row's argmax there ([`Engine::set_device_argmax`]).
    device_argmax: bool,
    /// Plain greedy decoding queues the next step before the current one's token is back
    /// ([`Engine::set_run_ahead`]): forced on or off, or `None` where the backend runs ahead.
    run_ahead: Option<bool>,
    /// Sampled decoding on a device reduces each logits row to its candidates there
    /// ([`Engine::set_device_sampling`]).
    device_sampling: bool,
    /// Rows sampled from device candidates, and rows among them read back in full (the candidates did not
    /// decide the sample).
    device_sampled: (u64, u64),
    /// Measured rates with and without drafts; pauses speculation that loses (automatic budget).
    gate: SpecGate,
}

/// What one decode step builds, kept between steps so that a warm decode loop allocates nothing: the
/// speculators' tree, the selected tree, its paths, the accept walk, the accepted path's rows.
#[derive(Default)]
struct StepScratch {
    draft: DraftTree,
    tree: DraftTree,
    select: SelectScratch,
    paths: TreePaths,
    walk: Walk,
    rows: Vec<f32>,
}

/// `EDDY_RUN_AHEAD`: 0 or 1 force run-ahead decoding off or on ([`Engine::set_run_ahead`]); unset, `None`.
fn run_ahead_from_env() -> Option<bool> {
    match std::env::var("EDDY_RUN_AHEAD").ok()?.trim() {
        "0" => Some(false),
        "1" => Some(true),
        v => {
            eprintln!("warning: EDDY_RUN_AHEAD={v} ignored: it takes 0 or 1");
            None
        }
    }
}

/// The machine's memory and swap together in bytes (`MemTotal` + `SwapTotal` of `/proc/meminfo`), if known.
fn host_memory_and_swap() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb =
        |key: &str| info.lines().find_map(|l| l.strip_prefix(key)).and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    Some((kb("MemTotal:")? + kb("SwapTotal:").unwrap_or(0)).saturating_mul(1024))
}

impl Engine {
    /// Allocate the KV cache and workspace for `opts.ctx` tokens.
    pub fn new(lm: LoadedModel, opts: &EngineOptions) -> Self {
        let core = Core::new(Cpu::new(opts.threads.max(1)), &lm.model, Self::ctx_for(&lm, opts), opts.max_batch);
        Self::with_exec(lm, opts, Exec::Cpu(Box::new(core)))
    }

    /// [`Engine::new`] on `device`: the CPU, or a GPU that gets its own copy of the weights (`lm` keeps the
    /// host copy, which CPU-side drafters read). [`Device::Auto`] takes the GPU when this build has CUDA,
    /// one is present and the model runs there (attention models), else the CPU.
    ///
    /// Errors: [`Device::Cuda`] in a build without the `cuda` feature, without a usable GPU and driver, or
    /// for a model the GPU backend cannot run (Gated DeltaNet layers).
    pub fn on_device(lm: LoadedModel, opts: &EngineOptions, device: Device) -> Result<Self> {
        Self::check_context(&lm, opts, device)?;
        match device {
            Device::Cpu => Ok(Self::new(lm, opts)),
            #[cfg(feature = "cuda")]
            Device::Cuda | Device::Auto => {
                let gpu = Cuda::new().and_then(|be| Ok((lm.model.to_backend(&be)?, be)));
                match gpu {
                    Ok((model, be)) => {
                        let core = Core::new(be, &model, Self::ctx_for(&lm, opts), opts.max_batch);
                        let exec = Exec::Cuda { core: Box::new(core), model: Box::new(model), host: Cpu::new(opts.threads.max(1)) };
                        Ok(Self::with_exec(lm, opts, exec))
                    }
                    Err(_) if device == Device::Auto => {
                        Self::check_context(&lm, opts, Device::Cpu)?;
                        Ok(Self::new(lm, opts))
                    }
                    Err(e) => Err(e),
                }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => {
                Err(Error::Input("this eddy was built without CUDA: build it with `cargo build --release --features cuda`".into()))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Auto => Ok(Self::new(lm, opts)),
        }
    }

    /// Which backend runs the model: [`Device::Cpu`] or [`Device::Cuda`] (never `Auto`).
    pub fn runs_on(&self) -> Device {
        match self.exec {
            Exec::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Exec::Cuda { .. } => Device::Cuda,
        }
    }

    /// [`Engine::runs_on`] as a name: `cpu` or `cuda` (stats and JSON lines).
    pub fn device(&self) -> &'static str {
        match self.runs_on() {
            Device::Cuda => "cuda",
            Device::Cpu | Device::Auto => "cpu",
        }
    }

    /// The PCI address of the GPU the model runs on (for its energy counter, [`crate::stats::EnergyMeter`]);
    /// None on the CPU.
    pub fn gpu_pci_bus_id(&self) -> Option<String> {
        match &self.exec {
            Exec::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Exec::Cuda { core, .. } => core.be.pci_bus_id().map(str::to_string),
        }
    }

    /// Refuses a context (`opts.ctx`, capped at the model's training context) whose KV cache
    /// (`2 · ctx · kv_dim` f32 a layer with attention) does not fit in a `usize` or, on the CPU (and where
    /// `/proc/meminfo` tells), exceeds the machine's memory and swap together: it could never be allocated,
    /// and an allocation failure aborts the process. Checked by [`Engine::on_device`] before it allocates.
    ///
    /// Errors ([`Error::Input`]): the size and the limit in words.
    pub fn check_context(lm: &LoadedModel, opts: &EngineOptions, device: Device) -> Result<()> {
        let c = &lm.model.config;
        let ctx = Self::ctx_for(lm, opts);
        let attn = lm.model.layer_kinds().iter().filter(|k| matches!(k, LayerKind::Attention)).count();
        let bytes = [attn, 2, ctx, c.kv_dim(), 4].iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        let gb = |b: f64| b / 1e9;
        let Some(bytes) = bytes else {
            return Err(Error::Input(format!(
                "a context of {ctx} tokens needs a KV cache larger than this machine can address: use a smaller --ctx"
            )));
        };
        if device == Device::Cpu {
            if let Some(limit) = host_memory_and_swap() {
                if bytes as u64 > limit {
                    return Err(Error::Input(format!(
                        "a context of {ctx} tokens needs a KV cache of {:.1} GB, more than this machine's {:.1} GB of memory and swap: use a smaller --ctx",
                        gb(bytes as f64),
                        gb(limit as f64)
                    )));
                }
            }
        }
        Ok(())
    }

    fn ctx_for(lm: &LoadedModel, opts: &EngineOptions) -> usize {
        opts.ctx.min(lm.model.config.train_ctx).max(1)
    }

    fn with_exec(lm: LoadedModel, opts: &EngineOptions, exec: Exec) -> Self {
        let mut cost = CostModel::default();
        cost.set_warmup(on_core!(&exec, |c| c.be.passes_to_steady_state()).saturating_sub(1));
        Engine {
            exec,
            sampler: Sampler::default(),
            logits: Vec::new(),
            prefix_cache: opts.prefix_cache,
            budget: Budget::Auto,
            cost,
            step: StepScratch::default(),
            device_argmax: std::env::var("EDDY_DEVICE_ARGMAX").map_or(true, |v| v != "0"),
            run_ahead: run_ahead_from_env(),
            device_sampling: std::env::var("EDDY_DEVICE_SAMPLING").map_or(true, |v| v != "0"),
            device_sampled: (0, 0),
            gate: SpecGate::default(),
            lm,
        }
    }

    /// Whether greedy decoding on a device (CUDA) takes the argmax of each verified row on the device and copies
    /// back only the token ids (default on; `EDDY_DEVICE_ARGMAX=0` turns it off): used for decode steps whose
    /// sampling is a plain argmax (temperature 0, no penalty or logit bias, no
    /// log-probabilities, no constraint) on models without a final logit soft-cap. The tokens are the host
    /// path's (same argmax, same tie rule); the CPU always samples on the host.
    pub fn set_device_argmax(&mut self, on: bool) {
        self.device_argmax = on;
    }

    /// Whether plain greedy decoding (no speculation, temperature 0, no penalty or logit bias, no
    /// log-probabilities, no constraint, an attention model without a final logit soft-cap) queues step n + 1
    /// before step n's token is back, its input token read where step n's argmax was taken
    /// ([`crate::models::forward::decode_ahead`]): the host's queueing and the token's trip back then run
    /// while the device computes. The tokens are plain decoding's; a generation that ends (a stop token,
    /// the sink, a stop string) drops the one step run past it. `Some(true)` forces it (on the CPU too,
    /// where nothing overlaps: for tests), `Some(false)` turns it off, `None` (default; `EDDY_RUN_AHEAD=0` /
    /// `1` at start force it) uses it where the backend runs ahead ([`Backend::runs_ahead`]) and the device
    /// takes the argmax ([`Engine::set_device_argmax`]).
    pub fn set_run_ahead(&mut self, on: Option<bool>) {
        self.run_ahead = on;
    }

    /// Whether sampled decoding on a device (CUDA) reduces each verified logits row to its sampling
    /// candidates there and copies back only those (default on; `EDDY_DEVICE_SAMPLING=0` turns it off): the
    /// first `k` scaled logits in the sampler's order, the count of finite logits and the row's mass
    /// ([`crate::sampling::row_candidates`], `k` from [`Sampler::candidate_count`]). Used for decode steps
    /// with temperature > 0, no penalty or logit bias, a top-k of at most
    /// [`crate::sampling::MAX_CANDIDATES`], no log-probabilities and no constraint, on models without a
    /// final logit soft-cap, when the verify pass computes at most `max_batch` rows. A row whose candidates
    /// do not decide the sample (a nucleus or a draw reaching past them) is read back in full: the tokens are
    /// the host path's ([`Sampler::sample_candidates`]).
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on;
    }

    /// Rows sampled from device candidates since the engine was made, and how many of them were read back in
    /// full because the candidates did not decide the sample ([`Engine::set_device_sampling`]).
    pub fn device_sampled_rows(&self) -> (u64, u64) {
        self.device_sampled
    }

    /// Speculate with the host-side `speculators` (merged into one tree per step) under `budget`; an empty
    /// list is plain decoding. They run on the CPU whatever the target runs on ([`crate::spec::OnHost`]); to run a draft
    /// model on the target's device, use [`Engine::speculate`].
    pub fn set_speculation(&mut self, speculators: Vec<Box<dyn Speculator>>, budget: Budget) {
        match &mut self.exec {
            Exec::Cpu(c) => c.specs = speculators,
            #[cfg(feature = "cuda")]
            Exec::Cuda { core, .. } => {
                core.specs = speculators.into_iter().map(|s| Box::new(crate::spec::OnHost(s)) as Box<dyn Speculator<Cuda>>).collect()
            }
        }
        self.speculators_changed(budget);
    }

    /// Speculate with the speculators of `kind` ([`build_speculators`]) under `budget`, built for the
    /// backend the target runs on: a draft model or DFlash drafter in `draft` is moved there (on a GPU:
    /// uploaded, its KV cache on the device), host-side speculators run on the CPU.
    ///
    /// Errors: as [`build_speculators`]; the engine keeps its previous speculators then.
    pub fn speculate(&mut self, kind: SpeculatorKind, draft: Option<Drafter>, budget: Budget) -> Result<()> {
        let ctx = self.ctx();
        let lm = &self.lm;
        on_core!(&mut self.exec, |c| c.specs = build_speculators(kind, draft, lm, ctx, &c.be)?);
        self.speculators_changed(budget);
        Ok(())
    }

    fn speculators_changed(&mut self, budget: Budget) {
        // The target captures the features of the first speculator that reads its intermediate layers.
        let layers = on_core!(&self.exec, |c| c.specs.iter().map(|s| s.feature_layers()).find(|l| !l.is_empty()).unwrap_or(&[]).to_vec());
        if !layers.is_empty() {
            // A new feature drafter has seen none of the cached rows: prefill from scratch next time.
            self.exec.clear();
        }
        self.exec.set_feature_layers(layers);
        self.budget = budget;
        self.gate = SpecGate::default();
    }

    /// Names of the active speculators.
    pub fn speculator_names(&self) -> Vec<&'static str> {
        on_core!(&self.exec, |c| c.specs.iter().map(|s| s.name()).collect())
    }

    /// The CPU backend (its worker threads): the one the model runs on, or on a device the pool that
    /// host-side work (drafters on the CPU) uses.
    pub fn backend(&self) -> &Cpu {
        self.exec.host()
    }

    /// Median seconds of one block pass of the DFlash drafter `d` (bound to this engine's target) where the
    /// engine would run it (the GPU for a GPU engine) over `context` context rows, `reps` passes
    /// ([`crate::spec::dflash::time_block_pass`]).
    ///
    /// Errors: as [`crate::spec::dflash::DFlashSeq::draft`].
    pub fn time_dflash_pass(&self, d: DFlashDrafter, context: usize, reps: usize) -> Result<f64> {
        let host = &self.lm.model;
        on_device!(&self.exec, host, |c, m| {
            let d = d.into_backend(&c.be);
            time_block_pass(&c.be, &d, TargetParts::new(host, m), context, reps)
        })
    }

    /// The measured verify-cost model.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// Verify-pass time over trees of each of `sizes` nodes (chains, root included) after prefilling
    /// `prompt`: the median of `reps` passes each, in seconds, after the passes the backend needs to reach
    /// its steady state ([`Backend::passes_to_steady_state`]). Scratch rows only: nothing is committed
    /// beyond the prompt. Feeds the cost model too.
    ///
    /// Errors: an empty prompt, or a prompt plus the largest tree that does not fit in the context.
    pub fn verify_times(&mut self, prompt: &[u32], sizes: &[usize], reps: usize) -> Result<Vec<(usize, f64)>> {
        let largest = sizes.iter().copied().max().unwrap_or(0);
        if prompt.is_empty() || prompt.len() + largest > self.ctx() {
            return Err(Error::Input(format!(
                "verify timing: a prompt of {} tokens plus a tree of {largest} nodes must fit in the context of {}",
                prompt.len(),
                self.ctx()
            )));
        }
        self.exec.clear();
        on_device!(&mut self.exec, &self.lm.model, |c, m| forward(
            m,
            &c.be,
            &mut c.ws,
            &mut c.state,
            prompt,
            Logits::None,
            &mut self.logits
        ))?;
        let warm = self.cost.warmup();
        let mut out = Vec::new();
        for &n in sizes {
            let tokens: Vec<u32> = prompt.iter().cycle().take(n).copied().collect();
            for _ in 0..warm {
                let secs = self.time_chain(&tokens)?;
                self.cost.record_verify(n, secs);
            }
            let mut times = Vec::new();
            for _ in 0..reps.max(1) {
                let secs = self.time_chain(&tokens)?;
                self.cost.record_verify(n, secs);
                times.push(secs);
            }
            times.sort_by(|a, b| a.total_cmp(b));
            out.push((n, times[times.len() / 2]));
        }
        Ok(out)
    }

    /// Drop the prefix cache (the next request prefills from scratch).
    pub fn clear_cache(&mut self) {
        self.exec.clear();
    }

    /// Measure verify passes over chains of 1, 2, 4, 8, 16 nodes after the committed sequence (scratch
    /// rows only; nothing is committed), seeding the cost model.
    fn calibrate(&mut self, token: u32) -> Result<()> {
        let room = self.ctx() - self.exec.n_past();
        // One pass per size on the CPU (larger sizes are extrapolated; every real verify pass refines the
        // table), so the first request's TTFT grows by about 18 decode steps. A backend whose first passes of
        // a shape run slower (the GPU's graph capture) repeats each size and keeps the last, steady time:
        // seeded with first-pass times, the model would price every tree at several decode steps and never
        // speculate, so never measure a real verify pass either. (The cost model drops those first passes.)
        let passes = self.cost.warmup() + 1;
        for n in [1usize, 2, 4, 8, 16] {
            if n > room || n > self.exec.max_batch() {
                break;
            }
            for _ in 0..passes {
                let secs = self.time_chain(&vec![token; n])?;
                self.cost.record_verify(n, secs);
            }
        }
        Ok(())
    }

    /// Seconds of one verify pass over the chain `tokens` after the committed sequence (scratch rows only;
    /// nothing is committed). On a device the head ends as greedy verify passes end there, in each row's
    /// argmax on the device ([`Engine::set_device_argmax`]): the logits' copy to the host (10 MB for 16 rows
    /// of a 152k vocabulary, ≈ 1.6 ms on the H200 machine) is not what a verify pass costs there.
    fn time_chain(&mut self, tokens: &[u32]) -> Result<f64> {
        let paths = TreePaths::chain(tokens.len());
        let on_device_argmax = self.device_argmax && !matches!(self.exec, Exec::Cpu(_));
        on_core!(&mut self.exec, |c| c.ws.argmax_head = on_device_argmax);
        let t = Instant::now();
        let r = on_device!(&mut self.exec, &self.lm.model, |c, m| forward_tree(
            m,
            &c.be,
            &mut c.ws,
            &mut c.state,
            tokens,
            &paths,
            0,
            &mut self.logits
        ));
        let secs = t.elapsed().as_secs_f64();
        on_core!(&mut self.exec, |c| c.ws.argmax_head = false);
        r.map(|()| secs)
    }

    /// Context length in tokens.
    pub fn ctx(&self) -> usize {
        self.exec.ctx()
    }

    /// Bytes of the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.exec.kv_bytes()
    }

    /// Generate from `prompt` (token ids, template already applied). `on_token(id)` is called for every
    /// sampled token, end-of-generation tokens excluded; returning `false` stops generation.
    ///
    /// Errors: empty prompt, prompt that does not fit in the context, invalid sampling parameters.
    pub fn generate(&mut self, prompt: &[u32], params: &GenerateParams, on_token: &mut dyn FnMut(u32) -> bool) -> Result<GenerationStats> {
        self.generate_with_logprobs(prompt, params, &mut |id, _| on_token(id))
    }

    /// [`Engine::generate`], also handing `on_token` each token's [`TokenLogprobs`] when
    /// `params.logprobs` asks for them (else `None`).
    pub fn generate_with_logprobs(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32, Option<&TokenLogprobs>) -> bool,
    ) -> Result<GenerationStats> {
        self.generate_cancellable(prompt, params, &|| false, on_token)
    }

    /// [`Engine::generate_with_logprobs`] that also stops a long prefill: `cancelled()` is polled before
    /// each prefill piece ([`EngineOptions::max_batch`] tokens rounded up to a multiple of 64); once it returns true
    /// the generation ends with [`FinishReason::Cancelled`] and no token (the pieces already computed stay
    /// in the prefix cache). While decoding, `on_token` returning `false` stops it as before.
    pub fn generate_cancellable(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        cancelled: &dyn Fn() -> bool,
        on_token: &mut dyn FnMut(u32, Option<&TokenLogprobs>) -> bool,
    ) -> Result<GenerationStats> {
        self.generate_masked(prompt, params, cancelled, None, on_token)
    }

    /// [`Engine::generate_cancellable`] under a constraint: `mask` ([`LogitMask`]) is applied to the logits
    /// of every sampled position, and with speculation the draft branches it rejects are pruned before
    /// verification, so the tokens are those of plain constrained decoding. When the mask allows no token
    /// the generation ends with [`FinishReason::Stop`].
    pub fn generate_masked(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        cancelled: &dyn Fn() -> bool,
        mask: Option<&mut dyn LogitMask>,
        on_token: &mut dyn FnMut(u32, Option<&TokenLogprobs>) -> bool,
    ) -> Result<GenerationStats> {
        struct Closures<'a> {
            cancelled: &'a dyn Fn() -> bool,
            on_token: &'a mut dyn FnMut(u32, Option<&TokenLogprobs>) -> bool,
        }
        impl TokenSink for Closures<'_> {
            fn token(&mut self, id: u32, logprobs: Option<&TokenLogprobs>) -> bool {
                (self.on_token)(id, logprobs)
            }
            fn cancelled(&self) -> bool {
                (self.cancelled)()
            }
        }
        self.generate_constrained(prompt, params, mask, &mut Closures { cancelled, on_token })
    }

    /// The generate loop, the one entry point the others wrap: prefill the prompt ([`Engine::prefill`]),
    /// sample the first token from its logits, then one decode step per round ([`Engine::decode_step`]:
    /// tree, verify, accept walk, commit), every sampled token going to `sink` through one emit (stop,
    /// cancel and length checks). Stops at an end-of-generation token (unless `params.ignore_eos`),
    /// `params.max_tokens`, a full context, or when `sink` asks.
    ///
    /// Errors: empty prompt, prompt that does not fit in the context, invalid sampling parameters.
    pub fn generate_to(&mut self, prompt: &[u32], params: &GenerateParams, sink: &mut dyn TokenSink) -> Result<GenerationStats> {
        self.generate_constrained(prompt, params, None, sink)
    }

    /// [`Engine::generate_to`] with every sampled token constrained by `mask` (see
    /// [`Engine::generate_masked`]).
    ///
    /// Errors: as [`Engine::generate_to`].
    pub fn generate_constrained(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        mask: Option<&mut dyn LogitMask>,
        sink: &mut dyn TokenSink,
    ) -> Result<GenerationStats> {
        params.sampler.validate().map_err(Error::Input)?;
        if prompt.is_empty() {
            return Err(Error::Input("prompt: empty (no tokens)".into()));
        }
        if prompt.len() >= self.ctx() {
            // A context at the model's training length is where --ctx is capped: a longer one cannot help.
            let advice = if self.ctx() >= self.lm.model.config.train_ctx {
                "the model's training context, where --ctx is capped); use a shorter prompt"
            } else {
                "room is needed for at least one new token); use a longer --ctx or a shorter prompt"
            };
            return Err(Error::Input(format!("prompt: {} tokens but the context holds {} ({advice}", prompt.len(), self.ctx())));
        }
        // A run-ahead loop unwound by a panic (a server catches them and keeps the engine) leaves its steps.
        self.recover_ahead();
        let t0 = Instant::now();
        let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
        if !self.prefill(prompt, &mut stats, &*sink)? {
            stats.finish = FinishReason::Cancelled;
            return Ok(stats);
        }
        let vocab = self.lm.model.config.vocab_size;
        let mut history: Vec<u32> = Vec::with_capacity(self.ctx() + 1);
        history.extend_from_slice(prompt);
        let mut out = Emit { stats, t0, t_first: None, t_last: t0, history, params, sink, mask };
        out.stats.finish = FinishReason::Length;
        // Raw logits of a row before sampling changes it (only when log-probabilities are wanted).
        let mut raw: Vec<f32> = Vec::new();
        // The first token comes from the prefill logits.
        if params.logprobs.is_some() {
            raw = self.logits[..vocab].to_vec();
        }
        let mut next = None;
        if out.mask.as_deref_mut().is_none_or(|m| m.apply(&mut self.logits[..vocab])) {
            let first = self.sampler.sample(&params.sampler, &mut self.logits[..vocab], &out.history, out.history.len());
            if let Some(m) = out.mask.as_deref_mut() {
                m.consume(first);
            }
            next = Some((first, params.logprobs.map(|k| TokenLogprobs::new(&raw, first, k))));
        } else {
            // The constraint allows no first token.
            out.stats.finish = FinishReason::Stop;
        }
        let ahead_from = match &next {
            Some((tok, None)) if self.runs_ahead_for(params, out.mask.is_none()) => Some(*tok),
            _ => None,
        };
        if let Some(tok) = ahead_from {
            next = None;
            let r = self.decode_ahead_loop(tok, &mut out);
            if r.is_err() {
                // Whatever was in flight: waited for and dropped, so the next generation starts clean.
                self.recover_ahead();
            }
            r?;
        }
        while let Some((tok, tok_lp)) = next.take() {
            // Emit `tok` (sampled at position history.len()), then one decode step below it.
            let full = self.exec.n_past() >= self.ctx();
            if let Some(f) = out.emit(tok, tok_lp.as_ref(), self.lm.tokenizer.is_stop(tok), full) {
                out.stats.finish = f;
                break;
            }
            next = self.decode_step(tok, &mut out, &mut raw)?;
        }
        let mut stats = out.stats;
        stats.decode_time = out.t_first.map(|f| out.t_last - f).unwrap_or_default();
        stats.duration = t0.elapsed();
        if out.t_first.is_none() {
            // max_tokens = 0: only the prefill ran; keep prefill speed meaningful (not prompt ÷ 0).
            stats.ttft = stats.duration;
        }
        Ok(stats)
    }

    /// Prefill `prompt` after the longest prefix the prefix cache can keep, in pieces of `max_batch` tokens
    /// rounded up to a multiple of the Gated DeltaNet chunk, ending at multiples of that many positions (so a
    /// prefix-cache hit cuts the prompt where a cold prefill does: hybrid models need that to compute the same
    /// values), checking `sink.cancelled()` before each; the speculators see the prompt (and the hidden states
    /// when they want them). Leaves the last position's logits in `self.logits`; false when cancelled.
    fn prefill(&mut self, prompt: &[u32], stats: &mut GenerationStats, sink: &dyn TokenSink) -> Result<bool> {
        // Prefix cache: keep the committed rows shared with this prompt (at least one token is prefilled,
        // for its logits).
        let mut keep = 0;
        if self.prefix_cache {
            keep = on_device!(&self.exec, &self.lm.model, |c, m| reusable_prefix(m, &c.state, prompt));
            // Hybrid models: also snapshot where this prompt parts from the tokens it replaces.
            on_core!(&mut self.exec, |c| c.state.plan_checkpoint(prompt, keep));
        }
        self.exec.truncate(keep);
        stats.cached_tokens = keep;
        if self.exec.speculating() && !self.cost.is_calibrated() {
            // Once per engine, inside the TTFT (not counted as prefill): the verify-cost curve of this machine.
            let t = Instant::now();
            self.calibrate(prompt[0])?;
            stats.calibration_time = t.elapsed();
        }
        on_specs!(&mut self.exec, &self.lm.model, |specs, be, _st, host, _m| {
            for s in specs.iter_mut() {
                s.prefill(be, host, prompt)?;
            }
        });
        let want_hidden = self.exec.specs_want_hidden();
        let want_features = !self.exec.feature_layers().is_empty();
        let piece = self.exec.max_batch().next_multiple_of(crate::state::GDN_CHUNK);
        let mut at = keep;
        while at < prompt.len() {
            if sink.cancelled() {
                on_core!(&mut self.exec, |c| c.state.drop_checkpoint());
                return Ok(false);
            }
            let end = ((at / piece + 1) * piece).min(prompt.len());
            let want = if end == prompt.len() { Logits::Last } else { Logits::None };
            self.exec.set_want_hidden(want_hidden);
            let chunk = &prompt[at..end];
            let prefilled = on_device!(&mut self.exec, &self.lm.model, |c, m| forward(
                m,
                &c.be,
                &mut c.ws,
                &mut c.state,
                chunk,
                want,
                &mut self.logits
            ));
            self.exec.set_want_hidden(false);
            prefilled?;
            on_specs!(&mut self.exec, &self.lm.model, |specs, be, st, host, m| {
                if want_hidden {
                    if let Some(h) = last_hidden(st) {
                        for s in specs.iter_mut().filter(|s| s.wants_hidden()) {
                            s.observe(be, host, prompt, at, h)?;
                        }
                    }
                }
                if want_features {
                    let f = &st.features;
                    if let Some(buf) = f.buf() {
                        let rows: Vec<usize> = (0..f.rows()).collect();
                        let width = f.row_len(m.config.d_model);
                        for s in specs.iter_mut().filter(|s| s.feature_layers() == f.layers) {
                            s.observe_features(be, host, prompt, at, FeatureRows { buf, width, rows: &rows })?;
                        }
                    }
                }
            });
            at = end;
        }
        on_core!(&mut self.exec, |c| c.state.drop_checkpoint());
        Ok(true)
    }

    /// Whether a generation with `params` (and a constraint unless `no_mask`) decodes ahead
    /// ([`Engine::set_run_ahead`]).
    fn runs_ahead_for(&self, params: &GenerateParams, no_mask: bool) -> bool {
        let sp = &params.sampler;
        let on = match self.run_ahead {
            Some(on) => on,
            None => self.device_argmax && on_core!(&self.exec, |c| c.be.runs_ahead()),
        };
        on && no_mask
            && sp.temperature == 0.0
            && !sp.modifies_logits()
            && params.logprobs.is_none()
            && self.lm.model.config.final_softcap.is_none()
            && !self.exec.speculating()
            && !on_core!(&self.exec, |c| c.state.is_hybrid())
    }

    /// Plain greedy decoding from `tok` (sampled, not yet emitted) with one step queued ahead
    /// ([`Engine::set_run_ahead`]): the step below `tok` is queued before `tok` is emitted, and the step
    /// below the next token (its input: this step's argmax, on the device) before this step's token is
    /// waited for. Each token is emitted exactly as [`Engine::decode_step`]'s loop emits it; where the
    /// generation ends, the step queued below the last token is waited for and its row dropped.
    fn decode_ahead_loop(&mut self, mut tok: u32, out: &mut Emit) -> Result<()> {
        let ctx = self.ctx();
        // Whether the step below `tok` is queued (its row counted in `n_past`).
        let mut queued = false;
        loop {
            let before = self.exec.n_past() - usize::from(queued);
            let full = before >= ctx;
            if let Some(f) = out.emit(tok, None, self.lm.tokenizer.is_stop(tok), full) {
                out.stats.finish = f;
                if queued {
                    self.settle_ahead(before);
                }
                return Ok(());
            }
            let t = Instant::now();
            // Not full, so there is room for the step below `tok`: queued before `tok` was emitted where it came
            // from a run-ahead step, else now (the first token: emitted first, as plain decoding does, so the
            // time to the first token does not change).
            if !queued {
                self.queue_ahead(Some(tok))?;
            }
            // The step below the next token, unless the next token ends the generation for certain (the token
            // limit, a full context).
            let ahead = self.exec.n_past() < ctx && out.stats.generated_tokens + 1 < out.params.max_tokens;
            if ahead {
                self.queue_ahead(None)?;
            }
            let next = on_core!(&mut self.exec, |c| take_ahead_id(&c.be, &mut c.ws))
                .ok_or_else(|| Error::Input("run-ahead decoding: a queued step's token went missing".into()))?;
            if ahead {
                on_core!(&mut self.exec, |c| c.state.resolve_ahead(next));
            }
            let stats = &mut out.stats;
            stats.decode_passes += 1;
            stats.verify_time += t.elapsed();
            (tok, queued) = (next, ahead);
        }
    }

    /// Queue one run-ahead decode step of `token` (`None`: the last queued step's argmax).
    fn queue_ahead(&mut self, token: Option<u32>) -> Result<()> {
        on_device!(&mut self.exec, &self.lm.model, |c, m| decode_ahead(m, &c.be, &mut c.ws, &mut c.state, token))
    }

    /// Drop what a run-ahead loop that did not finish left: its untaken argmaxes (waited for), the rows from
    /// its first step whose input never came back, and the workspace's head settings. Nothing when it finished.
    fn recover_ahead(&mut self) {
        on_core!(&mut self.exec, |c| {
            while take_ahead_id(&c.be, &mut c.ws).is_some() {}
            c.ws.reset_heads();
        });
        let keep = on_core!(&self.exec, |c| c.state.tokens.iter().take_while(|&&t| t != crate::models::forward::AHEAD_TOKEN).count());
        self.exec.truncate(keep);
    }

    /// Wait for every run-ahead step still in flight, drop their argmaxes, keep the first `keep` committed
    /// rows.
    fn settle_ahead(&mut self, keep: usize) {
        on_core!(&mut self.exec, |c| while take_ahead_id(&c.be, &mut c.ws).is_some() {});
        self.exec.truncate(keep);
    }

    /// One decode step below the last emitted token `tok`: the speculators' tree (just the root without
    /// them), one verify pass, the accept walk with the target's own samples, the commit of the accepted
    /// path, and the emission of the accepted draft tokens. Returns the bonus token (and its
    /// log-probabilities) to emit next, or `None` when the generation ended (`out.stats.finish` says why).
    fn decode_step(&mut self, tok: u32, out: &mut Emit, raw: &mut Vec<f32>) -> Result<Option<(u32, Option<TokenLogprobs>)>> {
        // The step's buffers leave `self` for the step (so the speculators can borrow it) and come back.
        let mut sc = std::mem::take(&mut self.step);
        let r = self.decode_step_with(&mut sc, tok, out, raw);
        self.step = sc;
        r
    }

    fn decode_step_with(
        &mut self,
        sc: &mut StepScratch,
        tok: u32,
        out: &mut Emit,
        raw: &mut Vec<f32>,
    ) -> Result<Option<(u32, Option<TokenLogprobs>)>> {
        let params = out.params;
        let vocab = self.lm.model.config.vocab_size;
        let lp_k = params.logprobs;
        let want_hidden = self.exec.specs_want_hidden();
        let want_features = !self.exec.feature_layers().is_empty();
        let room = self.ctx() - self.exec.n_past();
        let left = params.max_tokens - out.stats.generated_tokens;
        // A verify pass holds the root and its nodes: at most the backend's batch-invariant pass (lossless).
        let invariant = on_core!(&self.exec, |c| c.be.invariant_tokens());
        let max_nodes = (room - 1).min(left.saturating_sub(1)).min(invariant.saturating_sub(1));
        sc.draft.reset(tok);
        let t_round = Instant::now();
        let mut draft_cost = 0.0;
        let gated = self.budget == Budget::Auto && !self.gate.allow();
        if self.exec.speculating() && max_nodes > 0 && !gated {
            let (budget, cost, temperature, target) = (self.budget, &self.cost, params.sampler.temperature, Some(&self.lm.model));
            on_specs!(&mut self.exec, &self.lm.model, |specs, be, _st, host, model| {
                let ctx = ProposeCtx { backend: be, host, budget, max_nodes, cost, temperature, target, model: Some(model) };
                for s in specs.iter_mut() {
                    draft_cost += s.propose(&ctx, &out.history, &mut sc.draft)?;
                }
            });
        }
        if let Some(m) = out.mask.as_deref_mut() {
            if sc.draft.len() > 1 {
                // Drafts the constraint rejects cannot be accepted: prune them before the verify pass.
                sc.draft = sc.draft.prune(|branch| m.accepted_prefix(branch) == branch.len());
            }
        }
        sc.draft.select_into(self.budget, max_nodes, &self.cost, draft_cost, &mut sc.select, &mut sc.tree);
        let StepScratch { tree, paths, walk, rows, .. } = sc;
        let tree = &*tree;
        paths.rebuild(&tree.parents)?;
        let paths = &*paths;
        let n_committed = self.exec.n_past();
        let sp = &params.sampler;
        // Greedy without anything that needs the whole distribution: the device returns each row's argmax.
        let on_device_argmax = self.device_argmax
            && !matches!(self.exec, Exec::Cpu(_))
            && sp.temperature == 0.0
            && !sp.modifies_logits()
            && lp_k.is_none()
            && out.mask.is_none()
            && self.lm.model.config.final_softcap.is_none();
        // Sampling without anything that needs the whole row: the device returns each row's candidates.
        let device_k = if self.device_sampling
            && !matches!(self.exec, Exec::Cpu(_))
            && lp_k.is_none()
            && out.mask.is_none()
            && self.lm.model.config.final_softcap.is_none()
            && tree.len() <= self.exec.max_batch()
        {
            Sampler::candidate_count(sp)
        } else {
            None
        };
        on_core!(&mut self.exec, |c| {
            c.ws.argmax_head = on_device_argmax;
            c.ws.sample_head = device_k.map(|k| (1.0 / sp.temperature, k));
        });
        let tv = Instant::now();
        let verified = on_device!(&mut self.exec, &self.lm.model, |c, m| if tree.len() == 1 {
            // No drafts: the plain decode step (verify and commit of the root in one pass).
            decode(m, &c.be, &mut c.ws, &mut c.state, tok, &mut self.logits)
        } else {
            forward_tree(m, &c.be, &mut c.ws, &mut c.state, &tree.tokens, paths, 0, &mut self.logits)
        });
        on_core!(&mut self.exec, |c| {
            c.ws.argmax_head = false;
            c.ws.sample_head = None;
        });
        verified?;
        let verify_secs = tv.elapsed().as_secs_f64();
        self.cost.record_verify(tree.len(), verify_secs);
        let stats = &mut *out.stats_mut();
        stats.decode_passes += 1;
        stats.draft_time += tv.duration_since(t_round);
        stats.verify_time += std::time::Duration::from_secs_f64(verify_secs);
        // Walk with the target's samples (the walk's samples join `history` for the penalties, and
        // leave it again below); every sample but the bonus is emitted after the commit.
        let history = &mut out.history;
        let mut mask = out.mask.as_deref_mut();
        // The constraint allowed no token at some node of the walk.
        let mut dead_end = false;
        let base = history.len();
        let sampler = &mut self.sampler;
        let logits = &mut self.logits;
        let mut walk_lp: Vec<TokenLogprobs> = Vec::new();
        let device_ids: Option<&[u32]> = if on_device_argmax { Some(on_core!(&self.exec, |c| &c.ws.ids)) } else { None };
        let device_cands = if device_k.is_some() && !on_device_argmax { Some(on_core!(&self.exec, |c| &c.ws.cands)) } else { None };
        let exec = &self.exec;
        let device_sampled = &mut self.device_sampled;
        accept_walk_into(tree, walk, |node| {
            if let Some(ids) = device_ids {
                history.push(ids[node]);
                return Some(ids[node]);
            }
            if let Some(cands) = device_cands {
                let pos = history.len();
                device_sampled.0 += 1;
                let y = sampler.sample_candidates(sp, cands.row(node), pos).unwrap_or_else(|| {
                    // The candidates do not decide it: the host path on the full row.
                    device_sampled.1 += 1;
                    logits.clear();
                    exec.read_head_row(node, vocab, logits);
                    sampler.sample(sp, &mut logits[..vocab], history, pos)
                });
                history.push(y);
                return Some(y);
            }
            let row = &mut logits[node * vocab..(node + 1) * vocab];
            let pos = history.len();
            debug_assert_eq!(pos, n_committed + paths.depth(node) + 1);
            if lp_k.is_some() {
                raw.clear();
                raw.extend_from_slice(row);
            }
            if let Some(m) = mask.as_deref_mut() {
                if !m.apply(row) {
                    dead_end = true;
                    return None;
                }
            }
            let y = sampler.sample(&params.sampler, row, history, pos);
            if let Some(m) = mask.as_deref_mut() {
                m.consume(y);
            }
            if let Some(k) = lp_k {
                walk_lp.push(TokenLogprobs::new(raw, y, k));
            }
            history.push(y);
            Some(y)
        });
        history.truncate(base);
        let accepted = walk.path.len() - 1;
        let stats = &mut out.stats;
        stats.draft_tokens += tree.len() - 1;
        stats.draft_accepted += accepted;
        let depth = (1..tree.len()).map(|i| paths.depth(i)).max().unwrap_or(0);
        if stats.proposed_at_depth.len() < depth {
            stats.proposed_at_depth.resize(depth, 0);
            stats.accepted_at_depth.resize(depth, 0);
        }
        for d in 0..depth {
            stats.proposed_at_depth[d] += 1;
        }
        for d in 0..accepted {
            stats.accepted_at_depth[d] += 1;
        }
        let history = &out.history;
        on_specs!(&mut self.exec, &self.lm.model, |specs, be, st, host, m| {
            if want_hidden {
                // The accepted path's hidden states (tree node order → position order), before the
                // commit moves on.
                if let Some(h) = last_hidden(st) {
                    let d = h.len() / tree.len();
                    rows.clear();
                    rows.extend(walk.path.iter().flat_map(|&i| h[i * d..(i + 1) * d].iter().copied()));
                    for s in specs.iter_mut().filter(|s| s.wants_hidden()) {
                        s.observe(be, host, history, n_committed, rows)?;
                    }
                }
            }
            if want_features {
                // The accepted path's feature rows (their tree nodes, in position order).
                let f = &st.features;
                if let Some(buf) = f.buf() {
                    let width = f.row_len(m.config.d_model);
                    for s in specs.iter_mut().filter(|s| s.feature_layers() == f.layers) {
                        s.observe_features(be, host, history, n_committed, FeatureRows { buf, width, rows: &walk.path })?;
                    }
                }
            }
        });
        if tree.len() > 1 {
            on_device!(&mut self.exec, &self.lm.model, |c, m| commit_tree(m, &c.be, &mut c.state, &tree.tokens, &walk.path))?;
        }
        // The round's wall time so far (drafting, verify, accept walk, commit; not the emission below).
        self.gate.record(tree.len() > 1, t_round.elapsed().as_secs_f64(), accepted + 1);
        // Emit the accepted draft tokens (all but the last sample), then continue with the bonus.
        for (i, &y) in walk.samples[..accepted].iter().enumerate() {
            if let Some(f) = out.emit(y, walk_lp.get(i), self.lm.tokenizer.is_stop(y), false) {
                out.stats.finish = f;
                return Ok(None);
            }
        }
        if dead_end && walk.samples.len() == accepted {
            // The walk ended where the constraint allows nothing: no bonus token to continue with.
            out.stats.finish = FinishReason::Stop;
            return Ok(None);
        }
        Ok(walk.samples.last().map(|&y| (y, walk_lp.pop())))
    }

    /// Teacher-forced logits for every position of `tokens` (`tokens.len() × vocab`, row i predicts token
    /// i+1), computed from an empty state.
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.exec.clear();
        let mut out = Vec::new();
        on_device!(&mut self.exec, &self.lm.model, |c, m| forward(m, &c.be, &mut c.ws, &mut c.state, tokens, Logits::All, &mut out))?;
        Ok(out)
    }

    /// The log-probability of each token of `tokens` after the first, given those before it (OpenAI's
    /// `echo` with `logprobs`: entry i is token i + 1, its `k` most likely alternatives with it), computed
    /// from an empty state in pieces of the prefill batch, so memory stays at one piece's logits. The
    /// prefix cache is cleared (the next request prefills cold). `cancelled` is asked before each piece:
    /// `true` stops the scoring (`Ok(None)`).
    ///
    /// Errors: more tokens than the context; ids outside the vocabulary; a backend failure.
    pub fn prompt_logprobs(&mut self, tokens: &[u32], k: usize, cancelled: &dyn Fn() -> bool) -> Result<Option<Vec<TokenLogprobs>>> {
        if tokens.len() > self.ctx() {
            return Err(Error::Input(format!("{} tokens exceed the context of {}", tokens.len(), self.ctx())));
        }
        let vocab = self.lm.model.config.vocab_size;
        let piece = self.exec.max_batch().max(1);
        self.exec.clear();
        let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
        let mut logits = Vec::new();
        let mut r = Ok(());
        for (p, w) in tokens.chunks(piece).enumerate() {
            if cancelled() {
                self.exec.clear();
                return Ok(None);
            }
            // The last piece's last row predicts nothing in `tokens`.
            let rows = (tokens.len() - 1 - p * piece).min(w.len());
            r = on_device!(&mut self.exec, &self.lm.model, |c, m| forward(m, &c.be, &mut c.ws, &mut c.state, w, Logits::All, &mut logits));
            if r.is_err() {
                break;
            }
            for i in 0..rows {
                out.push(TokenLogprobs::new(&logits[i * vocab..(i + 1) * vocab], tokens[p * piece + i + 1], k));
            }
        }
        self.exec.clear();
        r.map(|()| Some(out))
    }

    /// Perplexity over non-overlapping windows of `window` tokens: each window starts from an empty state,
    /// tokens 1..n−1 of each window are scored (as `llama-perplexity` and the transformers recipe do without
    /// stride). Returns (perplexity, scored tokens). A last window shorter than 2 tokens is dropped.
    pub fn perplexity(&mut self, tokens: &[u32], window: usize) -> Result<(f64, usize)> {
        self.perplexity_with(tokens, window, &mut |_, _, _| {})
    }

    /// [`Engine::perplexity`], calling `progress(windows done, windows in all, perplexity so far)` after
    /// each window (llama-perplexity's running `[i]ppl` line).
    pub fn perplexity_with(&mut self, tokens: &[u32], window: usize, progress: &mut dyn FnMut(usize, usize, f64)) -> Result<(f64, usize)> {
        if window < 2 {
            return Err(Error::Input("perplexity window must be at least 2 tokens".into()));
        }
        if window > self.ctx() {
            return Err(Error::Input(format!("perplexity window of {window} tokens exceeds the context of {}", self.ctx())));
        }
        let vocab = self.lm.model.config.vocab_size;
        let (mut nll, mut n) = (0f64, 0usize);
        let total = tokens.chunks(window).filter(|w| w.len() >= 2).count();
        for (k, w) in tokens.chunks(window).filter(|w| w.len() >= 2).enumerate() {
            let logits = self.score(w)?;
            for i in 0..w.len() - 1 {
                let row = &logits[i * vocab..(i + 1) * vocab];
                nll += log_sum_exp(row) - row[w[i + 1] as usize] as f64;
                n += 1;
            }
            progress(k + 1, total, (nll / n as f64).exp());
        }
        if n == 0 {
            return Err(Error::Input("the text has fewer than 2 tokens: nothing to score".into()));
        }
        Ok(((nll / n as f64).exp(), n))
    }

    /// This model's next-token distributions against `base`'s on the same `tokens` (what
    /// llama-perplexity's `--kl-divergence` reports): windows and scored positions as in
    /// [`Engine::perplexity`]; per position `KL(p_base ‖ p_model) = Σ_v p_base(v)·(log p_base(v) −
    /// log p_model(v))` over the full vocabulary (f64), and whether both argmaxes agree.
    ///
    /// Errors: as [`Engine::perplexity`], for either engine; vocabularies of different sizes.
    pub fn kl_divergence(&mut self, base: &mut Engine, tokens: &[u32], window: usize) -> Result<KlReport> {
        let vocab = self.lm.model.config.vocab_size;
        let base_vocab = base.lm.model.config.vocab_size;
        if vocab != base_vocab {
            return Err(Error::Input(format!("the base model's vocabulary of {base_vocab} differs from the model's {vocab}")));
        }
        for e in [&*self, &*base] {
            if window < 2 || window > e.ctx() {
                return Err(Error::Input(format!("perplexity window of {window} tokens: must be 2 to the context of {}", e.ctx())));
            }
        }
        self.kl_against(&mut |w| base.score(w), tokens, window)
    }

    /// Write this model's logits over `tokens` to `path`, for [`Engine::kl_divergence_file`] (a base model
    /// scored once, compared with many models): windows and positions as in [`Engine::perplexity`]. Layout
    /// (little-endian): the 8 bytes [`LOGITS_MAGIC`], u64 vocabulary size, u64 window, u64 token count, the
    /// tokens as u32, then per window of at least 2 tokens its first `len − 1` rows of `vocab` f32 logits.
    /// Written to [`crate::load::temp_sibling`] and renamed; removed on an error. An existing file at `path` is
    /// replaced only when it is itself a logits file.
    ///
    /// Errors: as [`Engine::perplexity`]; `path` holds something other than a logits file; an I/O failure.
    pub fn save_logits(&mut self, tokens: &[u32], window: usize, path: &std::path::Path) -> Result<()> {
        if window < 2 || window > self.ctx() {
            return Err(Error::Input(format!("perplexity window of {window} tokens: must be 2 to the context of {}", self.ctx())));
        }
        if path.exists() && !is_logits_file(path) {
            return Err(Error::model(path, "exists and is not an eddy logits file: not overwritten (pick another path)"));
        }
        let tmp = crate::load::temp_sibling(path);
        let result = self
            .write_logits(tokens, window, &tmp)
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e }));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// [`Engine::save_logits`]'s file, written at `tmp`.
    fn write_logits(&mut self, tokens: &[u32], window: usize, tmp: &std::path::Path) -> Result<()> {
        use std::io::Write;
        let vocab = self.lm.model.config.vocab_size;
        let io = |e: std::io::Error| Error::Io { path: tmp.to_path_buf(), source: e };
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp).map_err(io)?);
        f.write_all(LOGITS_MAGIC).map_err(io)?;
        for v in [vocab as u64, window as u64, tokens.len() as u64] {
            f.write_all(&v.to_le_bytes()).map_err(io)?;
        }
        let tb: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        f.write_all(&tb).map_err(io)?;
        for w in tokens.chunks(window).filter(|w| w.len() >= 2) {
            let logits = self.score(w)?;
            let rows: Vec<u8> = logits[..(w.len() - 1) * vocab].iter().flat_map(|x| x.to_le_bytes()).collect();
            f.write_all(&rows).map_err(io)?;
        }
        f.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
    }

    /// [`Engine::kl_divergence`] against a base model's logits written by [`Engine::save_logits`] for the
    /// same `tokens` and `window`: the same report, numbers identical to comparing with the base engine.
    ///
    /// Errors: a file that is not such a logits file, is truncated, or was written for another vocabulary
    /// size, window or token sequence ([`Error::Model`] naming it); as [`Engine::perplexity`].
    pub fn kl_divergence_file(&mut self, path: &std::path::Path, tokens: &[u32], window: usize) -> Result<KlReport> {
        use std::io::Read;
        let bad = |m: String| Error::model(path, m);
        let mut f = std::io::BufReader::new(std::fs::File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?);
        let mut head = [0u8; 32];
        f.read_exact(&mut head).map_err(|_| bad("not an eddy logits file (too short)".into()))?;
        if &head[..8] != LOGITS_MAGIC {
            return Err(bad("not an eddy logits file (eddy perplexity --save-logits writes them)".into()));
        }
        let u = |i: usize| u64::from_le_bytes(head[8 + 8 * i..16 + 8 * i].try_into().unwrap_or_default()) as usize;
        let (vocab, file_window, n) = (u(0), u(1), u(2));
        let want_vocab = self.lm.model.config.vocab_size;
        if vocab != want_vocab || file_window != window || n != tokens.len() {
            return Err(bad(format!(
                "written for vocabulary {vocab}, window {file_window}, {n} tokens; this run has {want_vocab}, {window}, {}",
                tokens.len()
            )));
        }
        if window < 2 || window > self.ctx() {
            return Err(Error::Input(format!("perplexity window of {window} tokens: must be 2 to the context of {}", self.ctx())));
        }
        let rows: usize = tokens.chunks(window).filter(|w| w.len() >= 2).map(|w| w.len() - 1).sum();
        let want_len = 32 + 4 * n as u64 + 4 * (rows * vocab) as u64;
        let len = std::fs::metadata(path).map_err(|e| bad(format!("cannot read: {e}")))?.len();
        if len != want_len {
            let what = if len < want_len { "truncated" } else { "longer than its header says" };
            return Err(bad(format!("{what}: {len} bytes where {want_len} are expected")));
        }
        let mut tb = vec![0u8; 4 * n];
        f.read_exact(&mut tb).map_err(|_| bad("truncated".into()))?;
        if tb.chunks_exact(4).zip(tokens).any(|(b, &t)| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != t) {
            return Err(bad("written for another text (its tokens differ)".into()));
        }
        let mut read_rows = |w: &[u32]| -> Result<Vec<f32>> {
            let mut b = vec![0u8; 4 * (w.len() - 1) * vocab];
            f.read_exact(&mut b).map_err(|_| bad("truncated".into()))?;
            let v: Vec<f32> = b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(bad(format!("holds a non-finite logit ({} at position {} of a window)", v[i], i / vocab)));
            }
            Ok(v)
        };
        self.kl_against(&mut read_rows, tokens, window)
    }

    /// The KL report against base logits that `base(window_tokens)` returns (at least `len − 1` rows).
    fn kl_against(&mut self, base: &mut dyn FnMut(&[u32]) -> Result<Vec<f32>>, tokens: &[u32], window: usize) -> Result<KlReport> {
        let vocab = self.lm.model.config.vocab_size;
        let (mut nll, mut base_nll, mut agree) = (0f64, 0f64, 0usize);
        let mut kls = Vec::new();
        for w in tokens.chunks(window).filter(|w| w.len() >= 2) {
            let q = self.score(w)?;
            let p = base(w)?;
            for i in 0..w.len() - 1 {
                let (rq, rp) = (&q[i * vocab..(i + 1) * vocab], &p[i * vocab..(i + 1) * vocab]);
                let (lq, lp) = (log_sum_exp(rq), log_sum_exp(rp));
                let next = w[i + 1] as usize;
                nll += lq - rq[next] as f64;
                base_nll += lp - rp[next] as f64;
                let kl: f64 = rp
                    .iter()
                    .zip(rq)
                    .map(|(&a, &b)| {
                        let la = a as f64 - lp;
                        la.exp() * (la - (b as f64 - lq))
                    })
                    .sum();
                kls.push(kl.max(0.0));
                agree += (crate::sampling::argmax(rp) == crate::sampling::argmax(rq)) as usize;
            }
        }
        let n = kls.len();
        if n == 0 {
            return Err(Error::Input("the text has fewer than 2 tokens: nothing to score".into()));
        }
        let kl_mean = kls.iter().sum::<f64>() / n as f64;
        let var = kls.iter().map(|k| (k - kl_mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
        kls.sort_by(f64::total_cmp);
        let pct = |q: f64| kls[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Ok(KlReport {
            n,
            perplexity: (nll / n as f64).exp(),
            base_perplexity: (base_nll / n as f64).exp(),
            kl_mean,
            kl_mean_se: (var / n as f64).sqrt(),
            kl_median: pct(0.5),
            kl_p99: pct(0.99),
            kl_max: kls[n - 1],
            top1: agree as f64 / n as f64,
        })
    }
}

/// First 8 bytes of a logits file written by [`Engine::save_logits`].
pub const LOGITS_MAGIC: &[u8; 8] = b"EDDYLGT1";

/// Whether `path` is a file that starts with [`LOGITS_MAGIC`].
pub fn is_logits_file(path: &std::path::Path) -> bool {
    let mut magic = [0u8; 8];
    path.is_file()
        && std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
        && &magic == LOGITS_MAGIC
}

/// [`Engine::kl_divergence`]'s result over `n` scored positions (KL in nats).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlReport {
    /// Scored positions.
    pub n: usize,
    /// The model's perplexity on the text.
    pub perplexity: f64,
    /// The base model's perplexity on the text.
    pub base_perplexity: f64,
    /// Mean KL(base ‖ model).
    pub kl_mean: f64,
    /// Standard error of the mean.
    pub kl_mean_se: f64,
    /// Median (the ⌈n/2⌉-th smallest).
    pub kl_median: f64,
    /// 99th percentile (the ⌈0.99·n⌉-th smallest).
    pub kl_p99: f64,
    /// Largest.
    pub kl_max: f64,
    /// Share of positions where both models' most likely token is the same.
    pub top1: f64,
}

/// `log Σ exp(x)` in f64.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}
