//! MTP speculator: Qwen3.5's multi-token-prediction head drafts from the target's own hidden states
//! (`docs/qwen35.md`; DeepSeek-V3 §2.2 and Qwen3-Next ship the same block).
//!
//! Notation: the target at position `p` (token `x_p`) gives the final-normed hidden state `h_p`, whose
//! logits predict `x_{p+1}`. MTP row `p` takes `(h_p, x_{p+1})` through one attention block with its own
//! KV cache ([`MtpState`], one row per position) and predicts `x_{p+2}`; its output state `h'_{p+1}`
//! stands in for the target's when chaining further (`(h'_{p+1}, x̂_{p+2})` predicts `x_{p+3}`, …).
//!
//! Per round, with history `x_0..x_n` (the root `x_n` last): rows `p < n` whose inputs are committed
//! facts are added to the MTP cache for good (the target's hidden states arrive through
//! [`Speculator::observe`] after the prefill and after every verify step); the last of them, `(h_{n-1},
//! x_n)`, gives the depth-1 distribution. The draft then follows its top-1 token as a chain, one MTP step
//! per depth, with the top-k alternatives of every chain step as leaves; chain rows are dropped at the
//! next round. The committed state of the target is never touched, so the output stays lossless.

use super::{probs_of, top_k, Budget, CostModel, DraftTree, DrafterStats, ProposeCtx, Speculator};
use crate::backend::Cpu;
use crate::error::{Error, Result};
use crate::models::forward::{mtp_forward, Workspace};
use crate::models::ModelConfig;
use crate::state::SeqState;
use std::time::Instant;

/// Alternatives added as leaves at every chain step.
const TOP_K: usize = 3;
/// Deepest chain step below the root.
const MAX_DEPTH: usize = 8;

/// The MTP head of the target as a drafter (needs a Qwen3.5 target whose checkpoint has `mtp.*`).
pub struct MtpSpeculator {
    d_model: usize,
    /// The MTP block's KV cache (one attention layer), its rows one per position.
    state: SeqState,
    /// Scratch, made on the first proposal (it needs the target model).
    ws: Option<Workspace>,
    logits: Vec<f32>,
    /// Position of MTP cache row 0 (rows cover positions `base..base + rows`).
    base: usize,
    /// Committed MTP rows (later rows are last round's chain).
    rows: usize,
    /// The token `x_{p+1}` each committed row took, to check it against the history.
    row_tokens: Vec<u32>,
    /// Target hidden states of positions `hid_start..` not yet fed as rows (`d_model` each).
    hid_start: usize,
    hid: Vec<f32>,
    /// Seconds per MTP step and the chain's top-1 hit rate.
    stats: DrafterStats,
}

impl MtpSpeculator {
    /// A drafter for a target of configuration `c` and context `ctx` tokens.
    pub fn new(c: &ModelConfig, ctx: usize) -> MtpSpeculator {
        // The CPU backend allocates host memory: a handle without worker threads serves for the buffers.
        let host = Cpu::new(1);
        MtpSpeculator {
            d_model: c.d_model,
            state: SeqState::new(&host, 1, ctx + MAX_DEPTH + 1, c.kv_dim()),
            ws: None,
            logits: Vec::new(),
            base: 0,
            rows: 0,
            row_tokens: Vec::new(),
            hid_start: 0,
            hid: Vec::new(),
            stats: DrafterStats::default(),
        }
    }

    fn reset(&mut self, base: usize) {
        self.state.clear();
        self.base = base;
        self.rows = 0;
        self.row_tokens.clear();
    }
}

impl Speculator for MtpSpeculator {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn prefill(&mut self, _backend: &Cpu, _host: &Cpu, _prompt: &[u32]) -> Result<()> {
        self.stats.clear_chain();
        Ok(())
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, _backend: &Cpu, _host: &Cpu, history: &[u32], start: usize, hidden: &[f32]) -> Result<()> {
        let d = self.d_model;
        if !hidden.len().is_multiple_of(d) {
            return Err(Error::Input(format!("MTP: {} hidden values are not rows of {d}", hidden.len())));
        }
        // Keep the committed rows that still describe `history` and end before `start`. Rows only go
        // stale when the sequence was rewound (a new prompt): after a verify step `start` continues them.
        self.state.truncate(self.rows);
        let mut keep = if start >= self.base + self.rows { self.rows } else { 0 };
        while keep < self.rows {
            let p = self.base + keep;
            if p >= start || history.get(p + 1) != Some(&self.row_tokens[keep]) {
                break;
            }
            keep += 1;
        }
        // Hidden states not yet fed: extend the pending run when `start` continues (or overlaps) it.
        let end = self.hid_start + self.hid.len() / d;
        if (self.hid_start..=end).contains(&start) {
            self.hid.truncate((start - self.hid_start) * d);
        } else {
            self.hid_start = start;
            self.hid.clear();
        }
        self.hid.extend_from_slice(hidden);
        if self.base + keep < self.hid_start {
            // A gap (prefix cache, restart): the MTP context starts over at the first known state.
            self.reset(self.hid_start);
        } else {
            self.rows = keep;
            self.row_tokens.truncate(keep);
            self.state.truncate(keep);
        }
        Ok(())
    }

    fn propose(&mut self, ctx: &ProposeCtx, history: &[u32], tree: &mut DraftTree) -> Result<f64> {
        let t0 = Instant::now();
        self.stats.score_chain(history);
        let Some(model) = ctx.target.filter(|t| t.mtp.is_some()) else { return Ok(0.0) };
        let d = self.d_model;
        let n = history.len() - 1;
        let want = ctx.max_nodes.min(ctx.budget.max_nodes());
        // Rows to add: positions base+rows .. n-1, each with its target hidden state.
        let from = self.base + self.rows;
        let have = self.hid_start + self.hid.len() / d;
        if want == 0 || from < self.hid_start || have < n || from >= n {
            return Ok(0.0);
        }
        // (Every history token came from the target's own vocabulary: no range check needed.)
        let vocab = model.config.vocab_size;
        let auto = ctx.budget == Budget::Auto;
        let hit = self.stats.hit_rate();
        let cost = ctx.cost;
        let c_step = self.stats.pass_cost();
        // When no chain of MTP steps pays, the committed rows wait and go in one batch next time; an
        // exploring round drafts from the first step only.
        let round = self.stats.plan_round(auto, cost, 1);
        if round == super::Round::Skip {
            return Ok(0.0);
        }
        let max_depth = if round == super::Round::Explore { 1 } else { MAX_DEPTH };
        self.state.truncate(self.rows);
        let toks = &history[from + 1..=n];
        let hs = &self.hid[(from - self.hid_start) * d..(n - self.hid_start) * d];
        let ts = Instant::now();
        let ws = self.ws.get_or_insert_with(|| Workspace::new(ctx.backend, model, 256));
        mtp_forward(model, ctx.backend, ws, &mut self.state, toks, hs, &mut self.logits)?;
        if toks.len() == 1 {
            self.stats.record_pass(ts.elapsed().as_secs_f64());
        }
        self.rows += toks.len();
        self.row_tokens.extend_from_slice(toks);
        let consumed = n - self.hid_start;
        self.hid.drain(..consumed * d);
        self.hid_start = n;

        let temp = if ctx.temperature > 0.0 { ctx.temperature } else { 1.0 };
        let mut row = self.logits[(toks.len() - 1) * vocab..toks.len() * vocab].to_vec();
        let mut h_prev = self.state.hidden[(toks.len() - 1) * d..toks.len() * d].to_vec();
        let (mut parent, mut score, mut added, mut expected) = (0usize, 1.0f32, 0usize, 1.0f64);
        let mut chain = Vec::new();
        let mut spent = t0.elapsed().as_secs_f64();
        for depth in 1..=max_depth {
            let top = top_k(&row, TOP_K);
            let probs = probs_of(&row, &top, temp);
            // The chain's next node (top-1, scaled by the measured hit rate) and its alternatives.
            let mut next = None;
            for (i, (&(tok, _), &p)) in top.iter().zip(&probs).enumerate() {
                if added >= want {
                    break;
                }
                let s = score * p;
                if s < 1e-4 {
                    continue;
                }
                if auto {
                    let (cb, cn) = (spent + cost.verify_cost(added + 1), spent + cost.verify_cost(added + 2));
                    if !CostModel::pays(expected, cb, s as f64, cn - cb) {
                        continue;
                    }
                }
                let node = tree.add(parent, tok, s);
                added += 1;
                expected += s as f64;
                if i == 0 {
                    next = Some((node, tok, s));
                }
            }
            let Some((node, tok, s)) = next else { break };
            chain.push(tok);
            if depth == max_depth || added >= want {
                break;
            }
            // Another MTP step pays if the chain's next node is likely enough.
            let gain = s as f64 * hit;
            if auto
                && !CostModel::pays(
                    expected,
                    spent + cost.verify_cost(added + 1),
                    gain,
                    c_step + cost.verify_cost(added + 2) - cost.verify_cost(added + 1),
                )
            {
                break;
            }
            let ts = Instant::now();
            let ws = self.ws.as_mut().expect("made above");
            mtp_forward(model, ctx.backend, ws, &mut self.state, &[tok], &h_prev, &mut self.logits)?;
            self.stats.record_pass(ts.elapsed().as_secs_f64());
            row.copy_from_slice(&self.logits[..vocab]);
            h_prev.copy_from_slice(&self.state.hidden[..d]);
            parent = node;
            score = s;
            spent = t0.elapsed().as_secs_f64();
        }
        self.stats.set_chain(history.len(), chain);
        Ok(t0.elapsed().as_secs_f64())
    }
}
