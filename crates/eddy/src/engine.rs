//! The engine: owns the model, the sequence state and the workspace, and runs the generate loop.
//!
//! `generate` = prefill the prompt in one forward pass (chunked internally) → sample the first token →
//! decode one token per forward pass until an end-of-generation token, `max_tokens`, or the context is full.
//! Sampling is keyed by (seed, absolute position), see [`crate::sampling`].

use crate::backend::cpu::ThreadPool;
use crate::error::{Error, Result};
use crate::load::LoadedModel;
use crate::models::forward::{forward, Logits, Workspace};
use crate::sampling::{Sampler, SamplerParams};
use crate::state::SeqState;
use crate::stats::{FinishReason, GenerationStats};
use std::time::Instant;

/// Engine construction options.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Worker threads (the calling thread included).
    pub threads: usize,
    /// Context length in tokens (KV cache rows); capped at the model's training context.
    pub ctx: usize,
    /// Largest batch of one forward pass (prefill chunk).
    pub max_batch: usize,
    /// Reuse the KV of the longest common prefix with the previous request instead of prefilling it
    /// again (`eddy serve --no-prefix-cache` turns it off). Output is identical either way.
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: default_threads(),
            ctx: 4096,
            max_batch: 256,
            prefix_cache: true,
        }
    }
}

/// Physical cores available to this process (at least 1).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
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
}

/// A model ready to generate, with the state of its one sequence.
pub struct Engine {
    /// The model, tokenizer and template.
    pub lm: LoadedModel,
    pool: ThreadPool,
    ws: Workspace,
    state: SeqState,
    sampler: Sampler,
    logits: Vec<f32>,
}

impl Engine {
    /// Allocate the KV cache and workspace for `opts.ctx` tokens.
    pub fn new(lm: LoadedModel, opts: &EngineOptions) -> Self {
        let c = &lm.model.config;
        let ctx = opts.ctx.min(c.train_ctx).max(1);
        let state = SeqState::new(c.n_layers, ctx, c.kv_dim());
        let ws = Workspace::new(&lm.model, opts.max_batch.max(1));
        Engine {
            pool: ThreadPool::new(opts.threads.max(1)),
            ws,
            state,
            sampler: Sampler::default(),
            logits: Vec::new(),
            lm,
        }
    }

    /// Context length in tokens.
    pub fn ctx(&self) -> usize {
        self.state.kv.ctx
    }

    /// Bytes of the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.state.kv.nbytes()
    }

    /// Generate from `prompt` (token ids, template already applied). `on_token(id)` is called for every
    /// sampled token, end-of-generation tokens excluded; returning `false` stops generation.
    ///
    /// Errors: empty prompt, prompt that does not fit in the context, invalid sampling parameters.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<GenerationStats> {
        params.sampler.validate().map_err(Error::Input)?;
        if prompt.is_empty() {
            return Err(Error::Input("prompt: empty (no tokens)".into()));
        }
        if prompt.len() >= self.ctx() {
            return Err(Error::Input(format!(
                "prompt: {} tokens but the context holds {} (room is needed for at least one new token); use a longer --ctx or a shorter prompt",
                prompt.len(),
                self.ctx()
            )));
        }
        let t0 = Instant::now();
        self.state.clear();
        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        forward(
            &self.lm.model,
            &self.pool,
            &mut self.ws,
            &mut self.state,
            prompt,
            Logits::Last,
            &mut self.logits,
        )?;
        let mut history: Vec<u32> = Vec::with_capacity(self.ctx());
        history.extend_from_slice(prompt);
        let mut t_first = None;
        let mut t_last = t0;
        stats.finish = FinishReason::Length;
        while stats.generated_tokens < params.max_tokens {
            let pos = history.len();
            let tok = self
                .sampler
                .sample(&params.sampler, &mut self.logits, &history, pos);
            let now = Instant::now();
            if t_first.is_none() {
                t_first = Some(now);
                stats.ttft = now - t0;
            }
            t_last = now;
            stats.generated_tokens += 1;
            if !params.ignore_eos && self.lm.tokenizer.is_stop(tok) {
                stats.finish = FinishReason::Stop;
                break;
            }
            if !on_token(tok) {
                stats.finish = FinishReason::Cancelled;
                break;
            }
            history.push(tok);
            if stats.generated_tokens >= params.max_tokens || self.state.n_past() >= self.ctx() {
                stats.finish = FinishReason::Length;
                break;
            }
            forward(
                &self.lm.model,
                &self.pool,
                &mut self.ws,
                &mut self.state,
                &[tok],
                Logits::Last,
                &mut self.logits,
            )?;
            stats.decode_passes += 1;
        }
        stats.decode_time = t_first.map(|f| t_last - f).unwrap_or_default();
        stats.duration = t0.elapsed();
        if t_first.is_none() {
            // max_tokens = 0: only the prefill ran; keep prefill speed meaningful (not prompt ÷ 0).
            stats.ttft = stats.duration;
        }
        Ok(stats)
    }

    /// Teacher-forced logits for every position of `tokens` (`tokens.len() × vocab`, row i predicts token
    /// i+1), computed from an empty state.
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.state.clear();
        let mut out = Vec::new();
        forward(
            &self.lm.model,
            &self.pool,
            &mut self.ws,
            &mut self.state,
            tokens,
            Logits::All,
            &mut out,
        )?;
        Ok(out)
    }

    /// Perplexity over non-overlapping windows of `window` tokens: each window starts from an empty state,
    /// tokens 1..n−1 of each window are scored (as `llama-perplexity` and the transformers recipe do without
    /// stride). Returns (perplexity, scored tokens). A last window shorter than 2 tokens is dropped.
    pub fn perplexity(&mut self, tokens: &[u32], window: usize) -> Result<(f64, usize)> {
        if window < 2 {
            return Err(Error::Input(
                "perplexity window must be at least 2 tokens".into(),
            ));
        }
        if window > self.ctx() {
            return Err(Error::Input(format!(
                "perplexity window of {window} tokens exceeds the context of {}",
                self.ctx()
            )));
        }
        let vocab = self.lm.model.config.vocab_size;
        let (mut nll, mut n) = (0f64, 0usize);
        for w in tokens.chunks(window) {
            if w.len() < 2 {
                continue;
            }
            let logits = self.score(w)?;
            for i in 0..w.len() - 1 {
                let row = &logits[i * vocab..(i + 1) * vocab];
                nll += log_sum_exp(row) - row[w[i + 1] as usize] as f64;
                n += 1;
            }
        }
        if n == 0 {
            return Err(Error::Input(
                "the text has fewer than 2 tokens: nothing to score".into(),
            ));
        }
        Ok(((nll / n as f64).exp(), n))
    }
}

/// `log Σ exp(x)` in f64.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}
