//! Draft-model speculator: a smaller model with the same tokenizer proposes a tree best-first from its
//! per-node top-k probabilities (the DDTree heap of `docs/speculation.md`, expanded with an autoregressive
//! draft: every expansion step is one draft forward over the frontier it picked, as a token tree through
//! [`forward_tree`]).
//!
//! Per round: the draft catches up on the tokens the target committed since last round — accepted nodes
//! it had already run are compacted from its scratch rows ([`SeqState::commit_path`]), the rest (the
//! bonus token, an accepted leaf) are prefilled — which also yields its distribution after the root.
//! Then, repeatedly: pop the best `width` candidates from the heap into the draft tree, run them through
//! the draft in one pass, push each one's top-k children with score = parent score × draft probability.
//! Expansion stops at the node budget, the depth limit, or — with the automatic budget — when another
//! draft pass is not expected to raise tokens per second. Candidates left in the heap still enter the
//! proposal as leaves. The draft's committed state is never changed by drafting itself, so it stays in
//! step with what the target accepted.

use super::{probs_of, top_k, Budget, CostModel, DraftTree, DrafterStats, ProposeCtx, Ranked, Round, Speculator};
use crate::backend::{Backend, Cpu};
use crate::error::{Error, Result};
use crate::load::LoadedModel;
use crate::models::forward::{commit_tree, forward, forward_tree, Logits, Workspace};
use crate::models::Model;
use crate::state::SeqState;
use crate::tokenizer::Tokenizer;
use crate::tree::{TreePaths, NO_PARENT};
use std::collections::BinaryHeap;
use std::time::Instant;

/// Children taken per expanded node.
const TOP_K: usize = 4;
/// Candidates expanded per draft pass.
const WIDTH: usize = 4;
/// Deepest draft node below the root.
const MAX_DEPTH: usize = 16;

/// A draft model and its own sequence state, on the engine's backend `B` (on a GPU next to the target, its
/// KV cache there; each pass sends back only its rows' top candidates, reduced on the device).
pub struct DraftModel<B: Backend = Cpu> {
    model: Model<B>,
    ws: Workspace<B>,
    state: SeqState<B>,
    logits: Vec<f32>,
    /// Nodes run through the draft this round (hanging off its committed sequence): tokens, parents.
    tokens: Vec<u32>,
    parents: Vec<usize>,
    /// Pass cost and top-1 hit rate.
    stats: DrafterStats,
}

/// Error unless `draft` tokenizes exactly as `target`: same vocabulary size and the same string for
/// every id.
pub fn check_same_vocab(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    if target.vocab_size() != draft.vocab_size() {
        return Err(Error::Input(format!(
            "draft model: its vocabulary has {} tokens but the target's has {}; a draft model must share the target's tokenizer",
            draft.vocab_size(),
            target.vocab_size()
        )));
    }
    for id in 0..target.vocab_size() as u32 {
        if target.token_str(id) != draft.token_str(id) {
            return Err(Error::Input(format!(
                "draft model: token {id} is {:?} in the draft but {:?} in the target; a draft model must share the target's tokenizer",
                draft.token_str(id),
                target.token_str(id)
            )));
        }
    }
    Ok(())
}

impl<B: Backend> DraftModel<B> {
    /// Wrap `lm` as a draft for a target with tokenizer `target` and context `ctx` tokens, running on `be`
    /// (its weights moved there: [`Model::into_backend`]), with its KV cache and workspace there.
    ///
    /// Errors: the tokenizers differ; a model `be` cannot run.
    pub fn new(lm: LoadedModel, target: &Tokenizer, ctx: usize, be: &B) -> Result<DraftModel<B>> {
        check_same_vocab(target, &lm.tokenizer)?;
        let ctx = ctx.min(lm.model.config.train_ctx).max(1);
        let model = lm.model.into_backend(be)?;
        let state = model.new_state(be, ctx);
        let ws = Workspace::new(be, &model, 256);
        Ok(DraftModel { ws, state, logits: Vec::new(), tokens: Vec::new(), parents: Vec::new(), stats: DrafterStats::default(), model })
    }

    /// The top [`TOP_K`] tokens of each of the last pass's `n` logits rows with their probabilities at
    /// inverse temperature `inv_t`: on a backend that reduces rows where they live
    /// ([`Backend::reduces_on_device`]: the GPU sends back `n × TOP_K` candidates, not `n` rows of the
    /// vocabulary; [`Workspace::sample_head`], set by [`Speculator::propose`]) from those candidates,
    /// `exp(s − s_max) / mass` of each scaled logit `s` ([`crate::sampling::CandidateRow`]; none for a row
    /// without a finite logit); else (the CPU, or a model whose head is not reduced: a final logit
    /// soft-cap) from the rows in `self.logits` ([`top_k`], [`probs_of`]).
    fn children(&mut self, n: usize, inv_t: f32) -> Vec<Vec<(u32, f32)>> {
        if self.ws.cands.rows() < n {
            let v = self.model.config.vocab_size;
            return self
                .logits
                .chunks_exact(v)
                .take(n)
                .map(|row| {
                    let top = top_k(row, TOP_K);
                    let probs = probs_of(row, &top, 1.0 / inv_t);
                    top.iter().zip(probs).map(|(&(id, _), p)| (id, p)).collect()
                })
                .collect();
        }
        let cands = &self.ws.cands;
        (0..n)
            .map(|r| {
                let row = cands.row(r);
                let Some(&(max, _)) = row.top.first() else { return Vec::new() };
                if row.mass <= 0.0 {
                    return Vec::new();
                }
                row.top.iter().map(|&(s, id)| (id, (((s - max) as f64).exp() / row.mass) as f32)).collect()
            })
            .collect()
    }

    /// Bring the draft's committed sequence to `history` and leave the logits after its last token in
    /// `self.logits`.
    fn catch_up(&mut self, backend: &B, history: &[u32]) -> Result<()> {
        let committed = &self.state.tokens;
        if history.len() > committed.len() && history.starts_with(committed) && !self.tokens.is_empty() {
            // Compact the accepted nodes that were already run.
            let paths = TreePaths::new(&self.parents)?;
            let mut path = Vec::new();
            let mut parent = NO_PARENT;
            let n_past = committed.len();
            // The last history token is never compacted: its logits are needed.
            for &tok in &history[n_past..history.len() - 1] {
                match (0..self.tokens.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == tok) {
                    Some(i) => {
                        path.push(i);
                        parent = i;
                    }
                    None => break,
                }
            }
            debug_assert!(path.iter().enumerate().all(|(d, &i)| paths.depth(i) == d));
            if !path.is_empty() {
                let toks = self.tokens.clone();
                commit_tree(&self.model, backend, &mut self.state, &toks, &path)?;
            }
        }
        self.tokens.clear();
        self.parents.clear();
        let common = self.state.tokens.iter().zip(history).take_while(|(a, b)| a == b).count();
        let keep = common.min(history.len() - 1);
        self.state.truncate(keep);
        let t0 = Instant::now();
        forward(&self.model, backend, &mut self.ws, &mut self.state, &history[keep..], Logits::Last, &mut self.logits)?;
        if history.len() - keep <= WIDTH {
            self.stats.record_pass(t0.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

/// A draft candidate: its parent in the proposal tree and in the draft's own tree ([`NO_PARENT`]: the
/// root), its token and depth below the root.
#[derive(Debug, Clone)]
struct Cand {
    tree_parent: usize,
    draft_parent: usize,
    token: u32,
    depth: usize,
}

type Scored = Ranked<Cand>;

impl<B: Backend> Speculator<B> for DraftModel<B> {
    fn name(&self) -> &'static str {
        "draft"
    }

    fn prefill(&mut self, backend: &B, _host: &Cpu, prompt: &[u32]) -> Result<()> {
        self.tokens.clear();
        self.parents.clear();
        self.stats.clear_chain();
        if prompt.len() < 2 {
            return Ok(());
        }
        // Everything but the last token: the first propose runs the rest and gets its logits.
        let body = &prompt[..prompt.len() - 1];
        let common = self.state.tokens.iter().zip(body).take_while(|(a, b)| a == b).count();
        self.state.truncate(common);
        forward(&self.model, backend, &mut self.ws, &mut self.state, &body[common..], Logits::None, &mut self.logits)
    }

    fn propose(&mut self, ctx: &ProposeCtx<B>, history: &[u32], tree: &mut DraftTree) -> Result<f64> {
        let t0 = Instant::now();
        self.stats.score_chain(history);
        // Tokens the draft has not run yet must be in its vocabulary (the committed ones were run).
        let vocab = self.model.config.vocab_size;
        if history[self.state.tokens.len().min(history.len())..].iter().any(|&t| t as usize >= vocab) {
            return Ok(0.0);
        }
        let want = ctx.max_nodes.min(ctx.budget.max_nodes());
        let auto = ctx.budget == Budget::Auto;
        let hit = self.stats.hit_rate();
        let cost = ctx.cost;
        let c_pass = self.stats.pass_cost();
        if want == 0 {
            return Ok(0.0);
        }
        let round = self.stats.plan_round(auto, cost, 1);
        if round == Round::Skip {
            return Ok(0.0);
        }
        if self.state.ctx < history.len() + 1 {
            return Ok(0.0);
        }
        let temp = if ctx.temperature > 0.0 { ctx.temperature } else { 1.0 };
        let inv_t = 1.0 / temp.max(1e-3);
        // On a GPU each logits row comes back as its top candidates, reduced on the device; on the CPU the
        // rows are in host memory already.
        self.ws.sample_head = ctx.backend.reduces_on_device().then_some((inv_t, TOP_K));
        self.catch_up(ctx.backend, history)?;
        let n_past = self.state.n_past();
        let room = self.state.ctx - n_past;
        let mut heap = BinaryHeap::new();
        let mut seq = 0usize;
        let push_children = |heap: &mut BinaryHeap<Scored>,
                             seq: &mut usize,
                             children: &[(u32, f32)],
                             score: f32,
                             tree_parent: usize,
                             draft_parent: usize,
                             depth: usize| {
            for &(tok, p) in children {
                *seq += 1;
                heap.push(Ranked { score: score * p, seq: *seq, item: Cand { tree_parent, draft_parent, token: tok, depth } });
            }
        };
        let first_row = self.children(1, inv_t).swap_remove(0);
        let Some(&(top1, _)) = first_row.first() else {
            return Ok(t0.elapsed().as_secs_f64());
        };
        push_children(&mut heap, &mut seq, &first_row, 1.0, 0, NO_PARENT, 1);
        // The draft's greedy chain (to learn its hit rate from what the target does next), and the draft
        // node its last token hangs from.
        let mut chain = vec![top1];
        let mut chain_tail = NO_PARENT;
        let mut added = 0usize;
        let mut spent = t0.elapsed().as_secs_f64();
        let mut expected = 1.0f64;
        // Proposal nodes not yet run through the draft (their children are unknown): (candidate, node).
        let mut unexpanded: Vec<(Scored, usize)> = Vec::new();
        loop {
            // Lazy expansion: run the draft on the popped nodes whose expected best child (score × the
            // draft's top-1 hit rate) beats every candidate already known.
            let best_known = heap.peek().map_or(0.0, |c| c.score as f64);
            unexpanded.sort_by(|x, y| y.0.score.total_cmp(&x.0.score));
            // (An exploring round drafts from the catch-up pass only.)
            let n_expand = if round == Round::Explore {
                0
            } else {
                unexpanded.iter().take(WIDTH).take_while(|(c, _)| c.score as f64 * hit > best_known && c.item.depth < MAX_DEPTH).count()
            };
            if n_expand > 0 && self.tokens.len() + n_expand <= room {
                let frontier: Vec<(Scored, usize)> = unexpanded.drain(..n_expand).collect();
                let go = !auto || {
                    let gain: f64 = frontier.iter().map(|(c, _)| c.score as f64).sum::<f64>() * hit;
                    let extra = c_pass + cost.verify_cost(added + 1 + frontier.len()) - cost.verify_cost(added + 1);
                    CostModel::pays(expected, spent + cost.verify_cost(added + 1), gain, extra)
                };
                if go {
                    let first = self.tokens.len();
                    for (c, _) in &frontier {
                        self.tokens.push(c.item.token);
                        self.parents.push(c.item.draft_parent);
                    }
                    let paths = TreePaths::new(&self.parents)?;
                    let tp = Instant::now();
                    forward_tree(&self.model, ctx.backend, &mut self.ws, &mut self.state, &self.tokens, &paths, first, &mut self.logits)?;
                    self.stats.record_pass(tp.elapsed().as_secs_f64());
                    let rows = self.children(frontier.len(), inv_t);
                    for (j, ((c, node), row)) in frontier.iter().zip(&rows).enumerate() {
                        if c.item.draft_parent == chain_tail && chain.last() == Some(&c.item.token) {
                            // The draft's own greedy chain continues through this node.
                            chain_tail = first + j;
                            if let Some(&(tok, _)) = row.first() {
                                chain.push(tok);
                            }
                        }
                        push_children(&mut heap, &mut seq, row, c.score, *node, first + j, c.item.depth + 1);
                    }
                    spent = t0.elapsed().as_secs_f64();
                    continue;
                }
                // Not worth a draft pass: these nodes stay leaves.
            }
            if added >= want {
                break;
            }
            let Some(c) = heap.pop() else { break };
            if c.score < 1e-4 {
                break;
            }
            if auto {
                let (cb, cn) = (spent + cost.verify_cost(added + 1), spent + cost.verify_cost(added + 2));
                if !CostModel::pays(expected, cb, c.score as f64, cn - cb) {
                    break;
                }
            }
            let node = tree.add(c.item.tree_parent, c.item.token, c.score);
            added += 1;
            expected += c.score as f64;
            unexpanded.push((c, node));
        }
        self.stats.set_chain(history.len(), chain);
        Ok(t0.elapsed().as_secs_f64())
    }
}
