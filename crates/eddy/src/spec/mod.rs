//! Speculative decoding: drafters propose a token tree below the last sampled token, the target verifies
//! the whole tree in one forward pass ([`crate::models::forward::forward_tree`]) and keeps the longest path
//! that matches its own samples.
//!
//! * Proposals: every [`Speculator`] adds candidate nodes, each with a score — its estimate of the
//!   probability that the target accepts the whole path from the root to that node. Identical paths from
//!   several speculators merge into one node (the higher score wins), so suffix lookup and a draft model
//!   share one tree.
//! * Budget: [`DraftTree::select`] keeps the best nodes, best-first by score (a child never outscores its
//!   parent, so every prefix of that order is a prefix-closed subtree: DDTree's heap,
//!   `docs/speculation.md`). With a fixed budget it keeps that many; with [`Budget::Auto`] it adds a node only while it
//!   raises expected tokens per second under the measured [`CostModel`] (CaDDTree, `docs/speculation.md`):
//!   with `E(B) = 1 + Σ_{i≤B} s_i` and round cost `C(B) = c_draft + c_verify(B + 1)`, node `B + 1` is
//!   added iff `s_{B+1} · C(B) > E(B) · (C(B+1) − C(B))`. A tree of the root alone is plain decoding.
//! * Acceptance ([`accept_walk`]): sample-and-match (`docs/speculation.md`). At each node the target's
//!   sample is drawn exactly as plain decoding draws it (same processed distribution, randomness keyed by
//!   seed and absolute position); if a child carries that token the walk moves there, otherwise the
//!   sample is the bonus token. The output is therefore identical to plain decoding at any temperature.

pub mod dflash;
pub mod draft;
pub mod mtp;
pub mod suffix;

use crate::backend::{Backend, Cpu};
use crate::error::Result;
use crate::tree::NO_PARENT;

/// How many draft nodes a verify pass may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// At most this many nodes below the root (best-first).
    Fixed(usize),
    /// Chosen per step by the cost model, up to [`MAX_AUTO_NODES`].
    Auto,
}

/// Largest tree (nodes below the root) the automatic budget considers.
pub const MAX_AUTO_NODES: usize = 64;

impl Budget {
    /// Parse `auto` or a node count.
    pub fn parse(s: &str) -> std::result::Result<Budget, String> {
        if s == "auto" {
            return Ok(Budget::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n <= 1024 => Ok(Budget::Fixed(n)),
            _ => Err(format!("spec budget must be `auto` or a node count 0..=1024, got `{s}`")),
        }
    }

    /// Upper bound on nodes below the root.
    pub fn max_nodes(self) -> usize {
        match self {
            Budget::Fixed(n) => n,
            Budget::Auto => MAX_AUTO_NODES,
        }
    }
}

/// A token tree under construction: node 0 is the root (the last sampled token, not yet in the KV cache),
/// every other node's parent precedes it. Scores are path-acceptance estimates in `[0, 1]`; the root's is
/// 1 and a child's never exceeds its parent's.
#[derive(Debug, Clone, Default)]
pub struct DraftTree {
    /// Token of each node.
    pub tokens: Vec<u32>,
    /// Parent of each node ([`NO_PARENT`] for the root).
    pub parents: Vec<usize>,
    /// Estimated probability that the target accepts the path root → node.
    pub scores: Vec<f32>,
}

impl DraftTree {
    /// A tree holding only `root`.
    pub fn new(root: u32) -> DraftTree {
        DraftTree { tokens: vec![root], parents: vec![NO_PARENT], scores: vec![1.0] }
    }

    /// Make this the tree holding only `root`, keeping the allocations.
    pub fn reset(&mut self, root: u32) {
        self.tokens.clear();
        self.parents.clear();
        self.scores.clear();
        self.tokens.push(root);
        self.parents.push(NO_PARENT);
        self.scores.push(1.0);
    }

    /// Number of nodes, root included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when empty (never, once built with [`DraftTree::new`]).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The child of `parent` carrying `token`, if any.
    pub fn child(&self, parent: usize, token: u32) -> Option<usize> {
        (parent + 1..self.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }

    /// Add (or merge into an existing) child of `parent` with `token`; the score is clamped to the
    /// parent's and the larger of two merged scores wins. Returns the node index.
    pub fn add(&mut self, parent: usize, token: u32, score: f32) -> usize {
        let s = score.clamp(0.0, self.scores[parent]);
        if let Some(i) = self.child(parent, token) {
            if s > self.scores[i] {
                self.scores[i] = s;
            }
            return i;
        }
        self.tokens.push(token);
        self.parents.push(parent);
        self.scores.push(s);
        self.len() - 1
    }

    /// The nodes whose branch (the tokens from below the root down to the node) `allowed` accepts, with
    /// their scores; a node whose parent is dropped is dropped too (a constraint on the output prunes the
    /// drafts it rejects before they are verified).
    pub fn prune(&self, mut allowed: impl FnMut(&[u32]) -> bool) -> DraftTree {
        let mut out = DraftTree::new(self.tokens[0]);
        let mut kept = vec![NO_PARENT; self.len()];
        kept[0] = 0;
        let mut branch = Vec::new();
        for i in 1..self.len() {
            let parent = kept[self.parents[i]];
            if parent == NO_PARENT {
                continue;
            }
            branch.clear();
            let mut j = i;
            while j != 0 {
                branch.push(self.tokens[j]);
                j = self.parents[j];
            }
            branch.reverse();
            if allowed(&branch) {
                kept[i] = out.add(parent, self.tokens[i], self.scores[i]);
            }
        }
        out
    }

    /// Depth of node `i` (root 0).
    pub fn depth(&self, mut i: usize) -> usize {
        let mut d = 0;
        while self.parents[i] != NO_PARENT {
            i = self.parents[i];
            d += 1;
        }
        d
    }

    /// Keep the best nodes below the root under `budget`, best-first by score (ties: lower index first),
    /// renumbered in that order, which is topological and prefix-closed. `cost` and `draft_cost` (seconds
    /// already spent drafting this round) drive [`Budget::Auto`]; at most `max_nodes` nodes are kept in
    /// any case (room in the KV cache, tokens left to generate).
    pub fn select(&self, budget: Budget, max_nodes: usize, cost: &CostModel, draft_cost: f64) -> DraftTree {
        let mut out = DraftTree::default();
        self.select_into(budget, max_nodes, cost, draft_cost, &mut SelectScratch::default(), &mut out);
        out
    }

    /// [`DraftTree::select`] into `out`, with `scratch` for the ranking (no allocation once both have
    /// grown to the largest tree seen).
    pub fn select_into(
        &self,
        budget: Budget,
        max_nodes: usize,
        cost: &CostModel,
        draft_cost: f64,
        scratch: &mut SelectScratch,
        out: &mut DraftTree,
    ) {
        out.reset(self.tokens[0]);
        if self.len() == 1 {
            return;
        }
        let SelectScratch { order, scores, new_index } = scratch;
        order.clear();
        order.extend(1..self.len());
        // Scores are monotone along paths, so with index tie-breaking a parent always sorts before its
        // children.
        order.sort_unstable_by(|&a, &b| self.scores[b].total_cmp(&self.scores[a]).then(a.cmp(&b)));
        let cap = budget.max_nodes().min(max_nodes).min(order.len());
        let keep = match budget {
            Budget::Fixed(_) => cap,
            Budget::Auto => {
                scores.clear();
                scores.extend(order[..cap].iter().map(|&i| self.scores[i] as f64));
                cost.best_size(scores, draft_cost)
            }
        };
        new_index.clear();
        new_index.resize(self.len(), usize::MAX);
        new_index[0] = 0;
        for &i in &order[..keep] {
            let p = new_index[self.parents[i]];
            debug_assert!(p != usize::MAX, "selection is prefix-closed");
            out.tokens.push(self.tokens[i]);
            out.parents.push(p);
            out.scores.push(self.scores[i]);
            new_index[i] = out.len() - 1;
        }
    }
}

/// Reusable scratch of [`DraftTree::select_into`].
#[derive(Debug, Clone, Default)]
pub struct SelectScratch {
    order: Vec<usize>,
    scores: Vec<f64>,
    new_index: Vec<usize>,
}

/// Measured costs of this machine: verify time as a function of tree size, per-speculator draft time.
///
/// Verify times are exponential moving averages per tree size (nodes including the root) of the real
/// verify passes, seeded by [`CostModel::record_verify`] from a calibration run; sizes never measured are
/// interpolated linearly between measured neighbours (extrapolated from the two nearest beyond them).
///
/// On a backend whose first passes of a shape are slower than the rest (the GPU's graph capture,
/// [`crate::backend::Backend::passes_to_steady_state`]), the first passes of each size are not recorded
/// ([`CostModel::set_warmup`]).
#[derive(Debug, Clone, Default)]
pub struct CostModel {
    verify: Vec<Option<f64>>,
    /// Passes seen per size, recorded or not.
    passes: Vec<usize>,
    /// Leading passes of each size left unrecorded.
    warmup: usize,
}

impl CostModel {
    /// Leave the first `passes` verify passes of each size out of the table (their times are not the
    /// backend's steady state).
    pub fn set_warmup(&mut self, passes: usize) {
        self.warmup = passes;
    }

    /// Leading passes of each size left out of the table ([`CostModel::set_warmup`]).
    pub fn warmup(&self) -> usize {
        self.warmup
    }

    /// Record that a verify pass over `nodes` nodes (root included) took `secs` seconds (skipped while
    /// that size is within its warm-up passes).
    pub fn record_verify(&mut self, nodes: usize, secs: f64) {
        if nodes == 0 || !secs.is_finite() {
            return;
        }
        if self.verify.len() <= nodes {
            self.verify.resize(nodes + 1, None);
            self.passes.resize(nodes + 1, 0);
        }
        self.passes[nodes] += 1;
        if self.passes[nodes] <= self.warmup {
            return;
        }
        let e = &mut self.verify[nodes];
        *e = Some(match *e {
            Some(old) => 0.8 * old + 0.2 * secs,
            None => secs,
        });
    }

    /// True once any verify time is known.
    pub fn is_calibrated(&self) -> bool {
        self.verify.iter().any(|v| v.is_some())
    }

    /// Estimated seconds of a verify pass over `nodes` nodes (root included); 0 when nothing is known.
    pub fn verify_cost(&self, nodes: usize) -> f64 {
        let known: Vec<(usize, f64)> = self.verify.iter().enumerate().filter_map(|(n, v)| v.map(|v| (n, v))).collect();
        match known.len() {
            0 => 0.0,
            1 => known[0].1,
            _ => {
                if let Some(&(_, v)) = known.iter().find(|(n, _)| *n == nodes) {
                    return v;
                }
                // The two measured sizes bracketing `nodes`, or the two nearest at the end it lies beyond.
                let hi = known.iter().position(|(n, _)| *n > nodes).unwrap_or(known.len() - 1).max(1);
                let (a, b) = (known[hi - 1], known[hi]);
                let slope = (b.1 - a.1) / (b.0 - a.0) as f64;
                (a.1 + slope * (nodes as f64 - a.0 as f64)).max(a.1.min(b.1) * 0.5)
            }
        }
    }

    /// The CaDDTree stopping rule over path scores `s` in non-increasing order: the number of them to keep.
    pub fn best_size(&self, s: &[f64], draft_cost: f64) -> usize {
        if !self.is_calibrated() {
            return 0;
        }
        let mut e = 1.0;
        let mut b = 0;
        while b < s.len() {
            let c_b = draft_cost + self.verify_cost(b + 1);
            let c_next = draft_cost + self.verify_cost(b + 2);
            if s[b] * c_b > e * (c_next - c_b) {
                e += s[b];
                b += 1;
            } else {
                break;
            }
        }
        b
    }

    /// Whether spending `extra_cost` seconds (drafting, larger verify) to gain `extra_tokens` expected
    /// tokens raises tokens per second, given the round so far yields `tokens` in `secs`.
    pub fn pays(tokens: f64, secs: f64, extra_tokens: f64, extra_cost: f64) -> bool {
        extra_tokens * secs > tokens * extra_cost
    }
}

/// What a speculator may use while proposing.
pub struct ProposeCtx<'a, B: Backend = Cpu> {
    /// The backend this speculator runs on: the engine's (a draft model runs on it, next to the target).
    pub backend: &'a B,
    /// The CPU pool for host-side work (the engine's backend itself on the CPU).
    pub host: &'a Cpu,
    /// Node budget of this step.
    pub budget: Budget,
    /// Hard cap on nodes below the root (KV room, tokens left).
    pub max_nodes: usize,
    /// Measured verify costs.
    pub cost: &'a CostModel,
    /// Target sampling temperature (0 = greedy); draft probabilities are taken at this temperature (1 for
    /// greedy) as acceptance estimates.
    pub temperature: f32,
    /// The target model's host copy (drafters that share its weights, like an MTP head or a DFlash
    /// drafter's embedding and LM head, read them on the CPU); `None` in unit tests of speculators that do
    /// not need it.
    pub target: Option<&'a crate::models::Model>,
    /// The target as backend `backend` runs it (drafters on that backend that share its LM head: DFlash);
    /// on the CPU the same model as `target`. `None` in unit tests of speculators that do not need it.
    pub model: Option<&'a crate::models::Model<B>>,
}

/// A source of draft tokens. Implementations keep whatever incremental state they need (a suffix
/// automaton, a draft model's KV cache) in step with the sequence they are shown.
///
/// `B` is the backend the speculator runs on. Host-side speculators (suffix lookup, the MTP head)
/// implement `Speculator<Cpu>` and serve an engine on any backend through [`OnHost`]; a draft model and a
/// DFlash drafter run on the engine's own backend ([`draft::DraftModel`] and [`dflash::DFlashSpeculator`]
/// are generic over it).
pub trait Speculator<B: Backend = Cpu>: Send {
    /// Short name (`suffix`, `draft`).
    fn name(&self) -> &'static str;

    /// A new sequence starts with `prompt` (prefill time): build state for it. The next
    /// [`Speculator::propose`] call's history starts with `prompt`.
    fn prefill(&mut self, backend: &B, host: &Cpu, prompt: &[u32]) -> Result<()>;

    /// Add candidate nodes below the root of `tree` (node 0, whose token is `history`'s last) for the
    /// sequence `history` (prompt, every token generated so far, the root last). Returns the seconds
    /// spent, which count as this round's drafting cost.
    fn propose(&mut self, ctx: &ProposeCtx<B>, history: &[u32], tree: &mut DraftTree) -> Result<f64>;

    /// Whether this speculator drafts from the target's final-normed hidden states
    /// ([`Speculator::observe`] gets them).
    fn wants_hidden(&self) -> bool {
        false
    }

    /// Decoder layers of the target whose outputs (the residual stream after them) this speculator
    /// drafts from, in the order it concatenates them ([`Speculator::observe`] gets those rows); empty
    /// for none. Only one layer set per engine: the first speculator's that asks.
    fn feature_layers(&self) -> &[usize] {
        &[]
    }

    /// The target committed positions `start..start + n` and computed their final-normed hidden states
    /// `hidden` (`n × d_model`, position order, host memory). `history` holds the sequence's tokens through
    /// position `start` at least. Called after each prefill piece (its rows) and after every verify step
    /// (the accepted path), only when [`Speculator::wants_hidden`]; `backend` is the engine's backend and
    /// `host` the CPU pool.
    fn observe(&mut self, _backend: &B, _host: &Cpu, _history: &[u32], _start: usize, _hidden: &[f32]) -> Result<()> {
        Ok(())
    }

    /// The target committed positions `start..start + features.rows.len()` and computed the outputs of
    /// [`Speculator::feature_layers`] for them, where they are (the engine's backend memory; see
    /// [`FeatureRows`]). Called as [`Speculator::observe`] is, only for speculators whose feature layers are
    /// the ones the target captures.
    fn observe_features(
        &mut self,
        _backend: &B,
        _host: &Cpu,
        _history: &[u32],
        _start: usize,
        _features: FeatureRows<'_, B>,
    ) -> Result<()> {
        Ok(())
    }
}

/// Feature rows of committed positions for [`Speculator::observe_features`]: position `start + i` has row
/// `rows[i]` of `buf` (`width` f32 a row: the captured layers' outputs concatenated; tree node order for a
/// verify pass, so the accepted path picks its nodes' rows).
#[derive(Clone, Copy)]
pub struct FeatureRows<'a, B: Backend> {
    /// The target's captured rows ([`crate::state::FeatureCapture::buf`]).
    pub buf: &'a B::Buf,
    /// Values per row.
    pub width: usize,
    /// The rows of the committed positions, in position order.
    pub rows: &'a [usize],
}

/// A host-side speculator ([`Speculator<Cpu>`]: suffix lookup, the MTP head) serving an engine on
/// any backend: it runs on the CPU pool ([`ProposeCtx::host`]) whatever the target runs on.
pub struct OnHost(pub Box<dyn Speculator>);

impl<B: Backend> Speculator<B> for OnHost {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn prefill(&mut self, _backend: &B, host: &Cpu, prompt: &[u32]) -> Result<()> {
        self.0.prefill(host, host, prompt)
    }
    fn propose(&mut self, ctx: &ProposeCtx<B>, history: &[u32], tree: &mut DraftTree) -> Result<f64> {
        let on_host = ProposeCtx {
            backend: ctx.host,
            host: ctx.host,
            budget: ctx.budget,
            max_nodes: ctx.max_nodes,
            cost: ctx.cost,
            temperature: ctx.temperature,
            target: ctx.target,
            model: ctx.target,
        };
        self.0.propose(&on_host, history, tree)
    }
    fn wants_hidden(&self) -> bool {
        self.0.wants_hidden()
    }
    fn feature_layers(&self) -> &[usize] {
        self.0.feature_layers()
    }
    fn observe(&mut self, _backend: &B, host: &Cpu, history: &[u32], start: usize, hidden: &[f32]) -> Result<()> {
        self.0.observe(host, host, history, start, hidden)
    }
    fn observe_features(&mut self, backend: &B, host: &Cpu, history: &[u32], start: usize, f: FeatureRows<'_, B>) -> Result<()> {
        // Rows in the engine's backend memory cross to the CPU pool's.
        let mut v = Vec::with_capacity(f.rows.len() * f.width);
        for &r in f.rows {
            backend.read(f.buf, r, 1, f.width, &mut v);
        }
        let (buf, rows): (_, Vec<usize>) = (host.upload(&v), (0..f.rows.len()).collect());
        self.0.observe_features(host, host, history, start, FeatureRows { buf: &buf, width: f.width, rows: &rows })
    }
}

/// What a model drafter (draft model, MTP head) learns online: seconds per forward pass (moving average)
/// and the hit rate of its top-1 chain, scored against the tokens the target went on to commit.
#[derive(Debug, Default)]
pub(crate) struct DrafterStats {
    pass_cost: Option<f64>,
    /// (hits, trials) of the top-1 chain.
    hits: (u32, u32),
    /// The last round's top-1 chain and the history position of its first token.
    pending_chain: Option<(usize, Vec<u32>)>,
    rounds: u64,
}

impl DrafterStats {
    /// Add one measured pass of `secs` seconds to the moving average.
    pub(crate) fn record_pass(&mut self, secs: f64) {
        self.pass_cost = Some(match self.pass_cost {
            Some(o) => 0.8 * o + 0.2 * secs,
            None => secs,
        });
    }

    /// Seconds per pass (0 before the first).
    pub(crate) fn pass_cost(&self) -> f64 {
        self.pass_cost.unwrap_or(0.0)
    }

    /// Hit rate of the top-1 chain (Beta(1, 1) prior).
    pub(crate) fn hit_rate(&self) -> f64 {
        (self.hits.0 as f64 + 1.0) / (self.hits.1 as f64 + 2.0)
    }

    /// Remember this round's top-1 chain, whose first token would sit at `history[start]`.
    pub(crate) fn set_chain(&mut self, start: usize, chain: Vec<u32>) {
        self.pending_chain = Some((start, chain));
    }

    /// Forget the pending chain (a new sequence).
    pub(crate) fn clear_chain(&mut self) {
        self.pending_chain = None;
    }

    /// Score the last round's chain against `history` (up to its first miss).
    pub(crate) fn score_chain(&mut self, history: &[u32]) {
        let Some((start, chain)) = self.pending_chain.take() else { return };
        for (i, &t) in chain.iter().enumerate() {
            let Some(&a) = history.get(start + i) else { break };
            self.hits.1 += 1;
            if a != t {
                break;
            }
            self.hits.0 += 1;
        }
    }

    /// What this round should do ([`Round`]). A fixed budget always drafts. With the automatic one a round
    /// drafts while the best chain it could draft is expected to beat plain decoding's rate: with hit rate
    /// `h`, pass cost `p` (the drafter's forward pass, [`DrafterStats::record_pass`]) and verify costs
    /// `c(n)`, a chain of `k` drafted tokens yields `1 + h + … + h^k` tokens in `⌈k/block⌉·p + c(k+1)`
    /// seconds, against plain decoding's one token in `c(1)`; `block` is how many chain tokens one pass
    /// drafts (1 for a draft model or an MTP head, the block for DFlash). When no depth pays, every 16th
    /// round explores ([`Round::Explore`]) so the hit rate and the pass cost can recover; otherwise the round
    /// is skipped. (The rule compares whole rounds with plain decoding; the expansion inside a round then
    /// only adds what raises that round's own rate.)
    pub(crate) fn plan_round(&mut self, auto: bool, cost: &CostModel, block: usize) -> Round {
        self.rounds += 1;
        if !auto || self.pass_cost.is_none() || !cost.is_calibrated() {
            return Round::Draft;
        }
        if chain_pays(self.hit_rate(), self.pass_cost(), cost, block) {
            Round::Draft
        } else if self.rounds.is_multiple_of(16) {
            Round::Explore
        } else {
            Round::Skip
        }
    }
}

/// Whether some chain of `1..=MAX_CHAIN` drafted tokens is expected to yield more tokens per second than
/// plain decoding ([`DrafterStats::plan_round`]).
fn chain_pays(h: f64, pass: f64, cost: &CostModel, block: usize) -> bool {
    /// Deepest chain considered (the drafters' own depth limits are 16).
    const MAX_CHAIN: usize = 16;
    let plain = cost.verify_cost(1);
    let (mut tokens, mut hk) = (1.0, 1.0);
    (1..=MAX_CHAIN).any(|k| {
        hk *= h;
        tokens += hk;
        let secs = k.div_ceil(block.max(1)) as f64 * pass + cost.verify_cost(k + 1);
        tokens * plain > secs
    })
}

/// What a model drafter does this round ([`DrafterStats::plan_round`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    /// Draft as the budget allows.
    Draft,
    /// No depth pays, but draft from one pass only, to keep measuring the hit rate and the pass cost.
    Explore,
    /// Do not draft.
    Skip,
}

/// Measured decode rates of rounds that verified drafts and of plain rounds: the engine's check that
/// speculation pays on this machine and this text, whatever the speculators' cost models predict (on a GPU a
/// round costs syncs, read-backs and commits they do not price). With the automatic budget, once both rates
/// are known (4 rounds each; plain rounds are forced for a moment when speculation left none), rounds with
/// drafts running below 0.95× the plain rate pause speculation for 8, 16, … up to 256 rounds (doubling
/// while it keeps losing, back to 8 once it wins), then try again with fresh measurements; the first drafted
/// round after a pause (the speculators' catch-up on what they missed) is not measured.
#[derive(Debug, Default)]
pub struct SpecGate {
    spec: RateEma,
    plain: RateEma,
    /// Rounds left to decode without drafting.
    pause: u32,
    /// Length of the last pause forced by losing rounds (0 after a win).
    backoff: u32,
    /// Leave the next drafted round unmeasured.
    skip_next: bool,
}

/// Decayed sums of seconds and tokens (factor 0.9 per round) and the rounds seen.
#[derive(Debug, Default, Clone, Copy)]
struct RateEma {
    secs: f64,
    tokens: f64,
    rounds: u32,
}

impl RateEma {
    fn add(&mut self, secs: f64, tokens: usize) {
        self.secs = 0.9 * self.secs + secs;
        self.tokens = 0.9 * self.tokens + tokens as f64;
        self.rounds += 1;
    }
    /// Tokens per second.
    fn rate(&self) -> f64 {
        self.tokens / self.secs.max(1e-12)
    }
}

impl SpecGate {
    /// Rounds measured before the rates are compared.
    const MIN_ROUNDS: u32 = 4;

    /// Whether this round may draft (false during a pause, which it counts down).
    pub fn allow(&mut self) -> bool {
        if self.pause > 0 {
            self.pause -= 1;
            return false;
        }
        true
    }

    /// Record a finished round: `secs` of wall time (drafting, verify, commit) that produced `tokens` tokens
    /// (accepted drafts and the bonus); `drafted` when its tree had drafts.
    pub fn record(&mut self, drafted: bool, secs: f64, tokens: usize) {
        if !drafted {
            self.plain.add(secs, tokens);
            return;
        }
        if std::mem::take(&mut self.skip_next) {
            return;
        }
        self.spec.add(secs, tokens);
        if self.spec.rounds < Self::MIN_ROUNDS {
            return;
        }
        if self.plain.rounds < Self::MIN_ROUNDS {
            // No plain baseline yet: measure plain decoding for a moment.
            self.pause = Self::MIN_ROUNDS - self.plain.rounds;
            self.skip_next = true;
            return;
        }
        if self.spec.rate() < 0.95 * self.plain.rate() {
            self.backoff = (2 * self.backoff).clamp(8, 256);
            self.pause = self.backoff;
            self.skip_next = true;
            self.spec = RateEma::default();
        } else if self.spec.rate() >= self.plain.rate() {
            self.backoff = 0;
        }
    }

    /// (tokens per second with drafts, without), as measured so far (0 when unmeasured).
    pub fn rates(&self) -> (f64, f64) {
        let r = |e: &RateEma| if e.rounds == 0 { 0.0 } else { e.rate() };
        (r(&self.spec), r(&self.plain))
    }
}

/// Which speculators to run (`--speculator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeculatorKind {
    /// Plain decoding.
    None,
    /// Suffix lookup over the prompt and the generated text.
    Suffix,
    /// A draft model (needs one).
    Draft,
    /// The target's own multi-token-prediction head (Qwen3.5 checkpoints with `mtp.*`).
    Mtp,
    /// A DFlash block drafter (needs one), drafting the best-first tree of its marginals.
    DFlash,
    /// A DFlash block drafter drafting only its argmax chain.
    DFlashChain,
    /// Suffix lookup, plus the MTP head when the target has one, plus the draft model or DFlash drafter
    /// when one is given.
    Auto,
}

impl SpeculatorKind {
    /// Parse `none|suffix|draft|mtp|dflash|dflash-chain|auto`.
    pub fn parse(s: &str) -> std::result::Result<SpeculatorKind, String> {
        Ok(match s {
            "none" => SpeculatorKind::None,
            "suffix" => SpeculatorKind::Suffix,
            "draft" => SpeculatorKind::Draft,
            "mtp" => SpeculatorKind::Mtp,
            "dflash" => SpeculatorKind::DFlash,
            "dflash-chain" => SpeculatorKind::DFlashChain,
            "auto" => SpeculatorKind::Auto,
            _ => return Err(format!("speculator must be none, suffix, draft, mtp, dflash, dflash-chain or auto, got `{s}`")),
        })
    }

    /// Whether this kind runs a drafter given with `--draft-model` (or found next to the model).
    pub fn uses_drafter(self) -> bool {
        matches!(self, SpeculatorKind::Draft | SpeculatorKind::DFlash | SpeculatorKind::DFlashChain | SpeculatorKind::Auto)
    }
}

/// A separate drafter for [`build_speculators`].
pub enum Drafter {
    /// A smaller model with the target's tokenizer.
    Model(Box<crate::load::LoadedModel>),
    /// A DFlash block drafter (not yet bound to the target).
    DFlash(Box<dflash::DFlashDrafter>),
}

/// Build the speculators of `kind` for the target `target` with a context of `ctx` tokens, for an engine
/// whose target runs on `be`: a draft model or a DFlash drafter is moved there ([`draft::DraftModel`],
/// [`dflash::DFlashSpeculator`]); the host-side speculators run on the CPU through [`OnHost`].
///
/// Errors: `Draft`/`DFlash` without a drafter (or with the other kind of drafter: a DFlash folder is
/// only run by `Draft`, `DFlash`, `DFlashChain` and `Auto`), a drafter given to `None`/`Suffix`/`Mtp`,
/// a draft model whose tokenizer differs from the target's or that `be` cannot run, a DFlash drafter that
/// does not fit the target ([`dflash::DFlashDrafter::bind`]), `Mtp` for a target without an MTP head.
pub fn build_speculators<B: Backend>(
    kind: SpeculatorKind,
    draft: Option<Drafter>,
    target: &crate::load::LoadedModel,
    ctx: usize,
    be: &B,
) -> Result<Vec<Box<dyn Speculator<B>>>> {
    use crate::error::Error;
    let tok = &target.tokenizer;
    let host = |s: Box<dyn Speculator>| -> Box<dyn Speculator<B>> { Box::new(OnHost(s)) };
    let mtp = || -> Option<Box<dyn Speculator<B>>> {
        target.model.mtp.as_ref()?;
        Some(host(Box::new(mtp::MtpSpeculator::new(&target.model.config, ctx))))
    };
    let dflash = |mut d: Box<dflash::DFlashDrafter>, shape| -> Result<Box<dyn Speculator<B>>> {
        d.bind(&target.model)?;
        Ok(Box::new(dflash::DFlashSpeculator::new(be, d.into_backend(be), ctx, shape)))
    };
    let draft_model =
        |d: Box<crate::load::LoadedModel>| -> Result<Box<dyn Speculator<B>>> { Ok(Box::new(draft::DraftModel::new(*d, tok, ctx, be)?)) };
    let mut out: Vec<Box<dyn Speculator<B>>> = Vec::new();
    match (kind, draft) {
        (SpeculatorKind::None, None) => {}
        (SpeculatorKind::Suffix, None) => out.push(host(Box::<suffix::SuffixSpeculator>::default())),
        (SpeculatorKind::Mtp, None) => out.push(mtp().ok_or_else(|| {
            Error::Input("speculator `mtp` needs a model with a multi-token-prediction head (Qwen3.5 with mtp.* weights)".into())
        })?),
        (SpeculatorKind::Auto, d) => {
            out.push(host(Box::<suffix::SuffixSpeculator>::default()));
            out.extend(mtp());
            match d {
                Some(Drafter::Model(d)) => out.push(draft_model(d)?),
                Some(Drafter::DFlash(d)) => out.push(dflash(d, dflash::TreeShape::Best)?),
                None => {}
            }
        }
        (SpeculatorKind::Draft, Some(Drafter::Model(d))) => out.push(draft_model(d)?),
        (SpeculatorKind::Draft | SpeculatorKind::DFlash, Some(Drafter::DFlash(d))) => out.push(dflash(d, dflash::TreeShape::Best)?),
        (SpeculatorKind::DFlashChain, Some(Drafter::DFlash(d))) => out.push(dflash(d, dflash::TreeShape::Chain)?),
        (SpeculatorKind::Draft, None) => return Err(Error::Input("speculator `draft` needs a draft model (--draft-model PATH)".into())),
        (k @ (SpeculatorKind::DFlash | SpeculatorKind::DFlashChain), None) => {
            let name = if k == SpeculatorKind::DFlash { "dflash" } else { "dflash-chain" };
            return Err(Error::Input(format!(
                "speculator `{name}` needs a DFlash drafter (--draft-model DIR, or a drafter folder next to the model)"
            )));
        }
        (SpeculatorKind::DFlash | SpeculatorKind::DFlashChain, Some(Drafter::Model(m))) => {
            return Err(Error::model(&m.source, "not a DFlash drafter (config.json must name DFlashDraftModel); use --speculator draft"))
        }
        (k, Some(_)) => {
            return Err(Error::Input(format!("a drafter was given but the speculator is {k:?}; use --speculator draft, dflash or auto")))
        }
    }
    Ok(out)
}

/// Result of walking a verified tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Walk {
    /// Nodes whose tokens are accepted, root first (the root is always accepted: it was sampled).
    pub path: Vec<usize>,
    /// The target's samples along the path: `samples[d]` was drawn at node `path[d]`. Every sample but the
    /// last equals the token of the next path node; the last is the bonus token. Shorter than `path`
    /// when `sample` asked to stop.
    pub samples: Vec<u32>,
}

/// Sample-and-match walk from the root: at node `n` (path so far `path`), `sample(n, &path_tokens)`
/// returns the target's token for the position after `n`, or `None` to stop (end of generation, token
/// limit, cancellation). Follows the child carrying the sample; the first sample with no such child ends
/// the walk.
pub fn accept_walk(tree: &DraftTree, sample: impl FnMut(usize) -> Option<u32>) -> Walk {
    let mut walk = Walk::default();
    accept_walk_into(tree, &mut walk, sample);
    walk
}

/// [`accept_walk`] into `walk`, reusing its allocations.
pub fn accept_walk_into(tree: &DraftTree, walk: &mut Walk, mut sample: impl FnMut(usize) -> Option<u32>) {
    walk.path.clear();
    walk.samples.clear();
    walk.path.push(0);
    let mut node = 0;
    while let Some(y) = sample(node) {
        walk.samples.push(y);
        match tree.child(node, y) {
            Some(c) => {
                walk.path.push(c);
                node = c;
            }
            None => break,
        }
    }
}

/// A max-heap entry: higher score first, then lower `seq` (earlier insertion) first.
#[derive(Debug, Clone)]
pub(crate) struct Ranked<T> {
    pub score: f32,
    pub seq: usize,
    pub item: T,
}

impl<T> PartialEq for Ranked<T> {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl<T> Eq for Ranked<T> {}
impl<T> PartialOrd for Ranked<T> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<T> Ord for Ranked<T> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&o.score).then(o.seq.cmp(&self.seq))
    }
}

/// Indices of the `k` largest values of `x` (ties: lower index), in decreasing order.
pub fn top_k(x: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in x.iter().enumerate() {
        if best.len() == k && v <= best[k - 1].1 {
            continue;
        }
        let pos = best.iter().position(|&(_, b)| v > b).unwrap_or(best.len());
        best.insert(pos, (i as u32, v));
        best.truncate(k);
    }
    best
}

/// `softmax(x / temperature)` evaluated at the `top` entries: their probabilities.
pub fn probs_of(x: &[f32], top: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let inv_t = 1.0 / temperature.max(1e-3);
    let m = top.first().map(|t| t.1).unwrap_or(0.0) * inv_t;
    let z: f64 = x.iter().filter(|v| v.is_finite()).map(|&v| ((v * inv_t - m) as f64).exp()).sum();
    top.iter().map(|&(_, v)| (((v * inv_t - m) as f64).exp() / z) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verify costs `c(n) = c1 + slope·(n − 1)` for n = 1, 2, 4, 8, 16, 32.
    fn linear_costs(c1: f64, slope: f64) -> CostModel {
        let mut c = CostModel::default();
        for n in [1, 2, 4, 8, 16, 32] {
            c.record_verify(n, c1 + slope * (n - 1) as f64);
        }
        c
    }

    /// A drafter with `hits` of `trials` chain tokens hit and a pass cost of `pass` seconds.
    fn drafter(hits: u32, trials: u32, pass: f64) -> DrafterStats {
        let mut d = DrafterStats { hits: (hits, trials), ..Default::default() };
        d.record_pass(pass);
        d
    }

    #[test]
    fn a_round_drafts_only_when_some_chain_beats_plain_decoding() {
        // The GPU case of docs/cuda.md: a 1.5B target at 1.4 ms a step, a 0.5B draft whose pass (forward
        // and top-k on the host) costs 2 ms; even at a 95 % hit rate every chain loses: 1 + 0.95 + … over
        // k passes of 2 ms never reaches one token per 1.4 ms.
        let gpu = linear_costs(1.4e-3, 0.2e-3);
        assert!(!chain_pays(0.95, 2.0e-3, &gpu, 1));
        // A draft pass of 0.3 ms pays there.
        assert!(chain_pays(0.95, 0.3e-3, &gpu, 1));
        // The CPU case: a 45 ms step, verify nearly flat, a 15 ms draft pass at a 70 % hit rate.
        let cpu = linear_costs(45e-3, 1e-3);
        assert!(chain_pays(0.7, 15e-3, &cpu, 1));
        // A rate of 40 % does not pay a 20 ms pass one chain token at a time (1.4 tokens in 66 ms against
        // one in 45); a block drafter whose one pass drafts 15 does (1.62 tokens in 20 + 48 ms at k = 3).
        assert!(!chain_pays(0.4, 20e-3, &cpu, 1));
        assert!(chain_pays(0.4, 20e-3, &cpu, 15));
        // Deeper chains can pay when one token does not (the single-node rule's verdict): a verify of 2+
        // nodes costs 15 ms against a 10 ms step, a pass 5 ms, 90 % hit: 1.9 tokens in 20 ms at k = 1, 4.1
        // in 35 ms at k = 4.
        let mut step = CostModel::default();
        step.record_verify(1, 10e-3);
        for n in [2, 4, 8, 16, 32] {
            step.record_verify(n, 15e-3);
        }
        assert!(!CostModel::pays(1.0, 10e-3, 0.9, 5e-3 + 15e-3 - 10e-3));
        assert!(chain_pays(0.9, 5e-3, &step, 1));
    }

    #[test]
    fn the_gate_pauses_speculation_that_loses_and_keeps_what_wins() {
        // Plain rounds: 1 token in 1.4 ms (714 t/s); drafted rounds: 2.8 tokens in 7 ms (400 t/s).
        let mut g = SpecGate::default();
        let mut drafted_rounds = 0;
        for _ in 0..400 {
            if g.allow() {
                drafted_rounds += 1;
                g.record(true, 7e-3, 3);
            } else {
                g.record(false, 1.4e-3, 1);
            }
        }
        // 4 to start, 4 after the plain baseline's pause, then 4 after each pause of 8, 16, …, 256.
        assert!(drafted_rounds < 40, "{drafted_rounds} of 400 rounds drafted");
        assert!(g.backoff == 256, "{g:?}");
        // Drafted rounds that win (3 tokens in 2.5 ms) keep speculating every round.
        let mut g = SpecGate::default();
        let mut paused = 0;
        for _ in 0..400 {
            if g.allow() {
                g.record(true, 2.5e-3, 3);
            } else {
                paused += 1;
                g.record(false, 1.4e-3, 1);
            }
        }
        assert_eq!(paused, 4, "only the plain baseline's rounds: {g:?}");
        let (spec, plain) = g.rates();
        assert!((spec - 1200.0).abs() < 1.0 && (plain - 714.3).abs() < 1.0, "{spec} {plain}");
    }

    #[test]
    fn a_losing_drafter_explores_one_round_in_sixteen() {
        let gpu = linear_costs(1.4e-3, 0.2e-3);
        let mut d = drafter(95, 100, 2.0e-3);
        let rounds: Vec<Round> = (0..32).map(|_| d.plan_round(true, &gpu, 1)).collect();
        let explore: Vec<usize> = (0..32).filter(|&i| rounds[i] == Round::Explore).collect();
        assert_eq!(explore, vec![15, 31]);
        assert!(rounds.iter().all(|&r| r != Round::Draft));
        // A fixed budget always drafts; so does a drafter not measured yet.
        assert_eq!(d.plan_round(false, &gpu, 1), Round::Draft);
        assert_eq!(DrafterStats::default().plan_round(true, &gpu, 1), Round::Draft);
        // A fast drafter drafts every round.
        let mut fast = drafter(95, 100, 0.3e-3);
        assert!((0..32).all(|_| fast.plan_round(true, &gpu, 1) == Round::Draft));
    }

    fn sample_tree() -> DraftTree {
        let mut t = DraftTree::new(7);
        let a = t.add(0, 10, 0.9);
        let b = t.add(0, 11, 0.05);
        let c = t.add(a, 12, 0.8);
        t.add(c, 13, 0.95); // clamped to 0.8
        t.add(b, 14, 0.04);
        t.add(a, 15, 0.1);
        t
    }

    #[test]
    fn add_merges_and_clamps() {
        let mut t = sample_tree();
        assert_eq!(t.len(), 7);
        assert_eq!(t.scores[4], 0.8, "a child never outscores its parent");
        let again = t.add(0, 10, 0.95);
        assert_eq!((again, t.len(), t.scores[1]), (1, 7, 0.95), "an identical path merges, higher score wins");
        assert_eq!(t.depth(4), 3);
    }

    #[test]
    fn select_is_prefix_closed_within_budget_parents_first() {
        let t = sample_tree();
        let cost = CostModel::default();
        for budget in 0..8 {
            let s = t.select(Budget::Fixed(budget), usize::MAX, &cost, 0.0);
            assert_eq!(s.len(), 1 + budget.min(6));
            for i in 1..s.len() {
                assert!(s.parents[i] < i, "parents before children");
                assert!(s.scores[i] <= s.scores[s.parents[i]]);
            }
            // The kept nodes are the best ones: every dropped node scores no more than every kept one.
            let kept_min = s.scores[1..].iter().cloned().fold(1.0f32, f32::min);
            let mut all: Vec<f32> = t.scores[1..].to_vec();
            all.sort_by(|a, b| b.total_cmp(a));
            if budget < 6 {
                assert!(all[budget] <= kept_min);
            }
        }
        let s = t.select(Budget::Fixed(3), usize::MAX, &cost, 0.0);
        assert_eq!(s.tokens, vec![7, 10, 12, 13]);
        assert_eq!(s.parents, vec![NO_PARENT, 0, 1, 2]);
        // The hard cap wins over the budget.
        assert_eq!(t.select(Budget::Fixed(5), 2, &cost, 0.0).len(), 3);
    }

    #[test]
    fn prune_keeps_allowed_branches_and_drops_subtrees() {
        let t = sample_tree();
        // Branches: [10], [11], [10,12], [10,12,13], [11,14], [10,15]. Refuse every branch through 12, and 11.
        let mut asked = Vec::new();
        let p = t.prune(|b| {
            asked.push(b.to_vec());
            !b.contains(&12) && b != [11]
        });
        assert_eq!(p.tokens, vec![7, 10, 15]);
        assert_eq!(p.parents, vec![NO_PARENT, 0, 1]);
        assert_eq!(p.scores, vec![1.0, 0.9, 0.1]);
        // The children of a dropped node are never asked about.
        assert!(!asked.contains(&vec![10, 12, 13]) && !asked.contains(&vec![11, 14]), "{asked:?}");
        assert_eq!(t.prune(|_| true).tokens, t.tokens);
        assert_eq!(t.prune(|_| false).len(), 1);
    }

    #[test]
    fn accept_walk_follows_samples_and_stops_at_bonus() {
        let t = sample_tree();
        // Target samples 10, 12, 99: accepts nodes 1 and 3, bonus 99.
        let answers = [(0usize, 10u32), (1, 12), (3, 99)];
        let w = accept_walk(&t, |n| answers.iter().find(|a| a.0 == n).map(|a| a.1));
        assert_eq!(w.path, vec![0, 1, 3]);
        assert_eq!(w.samples, vec![10, 12, 99]);
        // First sample matches no child: only the root, bonus = that sample.
        let w = accept_walk(&t, |_| Some(42));
        assert_eq!((w.path, w.samples), (vec![0], vec![42]));
        // Down to a leaf: the leaf's sample is the bonus.
        let answers = [(0usize, 10u32), (1, 12), (3, 13), (4, 5)];
        let w = accept_walk(&t, |n| answers.iter().find(|a| a.0 == n).map(|a| a.1));
        assert_eq!(w.path, vec![0, 1, 3, 4]);
        assert_eq!(w.samples, vec![10, 12, 13, 5]);
        // Stopping (e.g. end of generation) mid-walk.
        let w = accept_walk(&t, |n| if n == 0 { Some(10) } else { None });
        assert_eq!((w.path, w.samples), (vec![0, 1], vec![10]));
    }

    #[test]
    fn cost_model_leaves_out_each_sizes_warm_up_passes() {
        // A GPU-like backend: per size, an eager pass and a capture (slow), then graph replays.
        let mut c = CostModel::default();
        c.set_warmup(2);
        for (n, fast) in [(1usize, 1.0e-3), (2, 1.5e-3)] {
            c.record_verify(n, 3.0e-3);
            c.record_verify(n, 4.0e-3);
            assert!(!c.verify.get(n).is_some_and(|v| v.is_some()), "size {n}: a warm-up pass was recorded");
            c.record_verify(n, fast);
            assert_eq!(c.verify_cost(n), fast);
        }
        // Later passes average in as before (0.8 · old + 0.2 · new), whatever their size's history.
        c.record_verify(2, 2.5e-3);
        assert!((c.verify_cost(2) - 1.7e-3).abs() < 1e-12);
        // Without warm-up (the CPU) the first pass counts.
        let mut cpu = CostModel::default();
        cpu.record_verify(4, 7.0e-3);
        assert_eq!(cpu.verify_cost(4), 7.0e-3);
    }

    #[test]
    fn cost_model_interpolates_and_stops_when_a_node_does_not_pay() {
        let mut c = CostModel::default();
        assert_eq!(c.best_size(&[0.9, 0.9], 0.0), 0, "uncalibrated: no speculation");
        // Verify cost: 10 ms for 1 node, +1 ms per extra node up to 8, then +4 ms per node.
        for (n, ms) in [(1, 10.0), (2, 11.0), (4, 13.0), (8, 17.0), (16, 49.0)] {
            c.record_verify(n, ms / 1000.0);
        }
        assert!((c.verify_cost(3) - 0.012).abs() < 1e-9);
        assert!((c.verify_cost(12) - 0.033).abs() < 1e-9);
        assert!((c.verify_cost(32) - 0.113).abs() < 1e-9, "extrapolated from the last two: {}", c.verify_cost(32));
        // Confident chain: every node pays while its score beats E·ΔC/C.
        let s = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5, 0.4];
        let b = c.best_size(&s, 0.0);
        // Hand-check the rule at the stopping point.
        let e: f64 = 1.0 + s[..b].iter().sum::<f64>();
        let (cb, cn) = (c.verify_cost(b + 1), c.verify_cost(b + 2));
        assert!(b < s.len() && s[b] * cb <= e * (cn - cb), "stopped at {b} though node {b} pays");
        let (cp, cq) = (c.verify_cost(b), c.verify_cost(b + 1));
        let ep = e - s[b - 1];
        assert!(s[b - 1] * cp > ep * (cq - cp), "kept node {} that does not pay", b - 1);
        assert_eq!(b, 7);
        // Hopeless drafts: nothing pays.
        assert_eq!(c.best_size(&[0.01, 0.01], 0.0), 0);
        // Expensive drafting already spent makes each extra node relatively cheaper.
        assert!(c.best_size(&s, 0.05) >= b);
        // EMA update.
        c.record_verify(1, 0.020);
        assert!((c.verify_cost(1) - 0.012).abs() < 1e-9);
    }

    #[test]
    fn top_k_and_probs() {
        let x = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        let t = top_k(&x, 3);
        assert_eq!(t.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3, 4]);
        let p = probs_of(&x, &t, 1.0);
        let z: f32 = x.iter().map(|v| v.exp()).sum();
        assert!((p[0] - 3f32.exp() / z).abs() < 1e-6 && (p[2] - 2f32.exp() / z).abs() < 1e-6);
    }
}
