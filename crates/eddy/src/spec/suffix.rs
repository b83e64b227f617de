//! Suffix lookup: propose what followed earlier occurrences of the longest recent suffix of the sequence
//! (prompt plus everything generated), as prompt-lookup decoding and SuffixDecoding do
//! (`docs/speculation.md`), from a suffix automaton (Blumer et al. 1985) extended one token at a time.
//!
//! In the automaton of a text `S`, the states on the suffix-link path from the state of all of `S` are
//! exactly the classes of suffixes of `S`; the first of them with outgoing transitions holds the longest
//! suffix `u` that also occurs earlier, and its transitions are the tokens that followed `u` somewhere.
//! Following a transition `c` gives the state of `uc`, whose transitions are what followed `uc`: the draft
//! tree is read off the automaton best-first. Each state keeps an occurrence count (|endpos|, updated along
//! the suffix-link path when a token is appended, capped at [`COUNT_WALK`] steps per token), which ranks
//! sibling continuations.
//!
//! Scores: a continuation's acceptance probability is estimated as `λ(L) · cnt(child) / Σ cnt(siblings)`,
//! where `L` is the length of the matched suffix and `λ` is this sequence's measured hit rate of the top
//! continuation at that match length (a Beta(1, 1) prior per length bucket, updated from what the target
//! actually produced).

use super::{DraftTree, ProposeCtx, Ranked, Speculator};
use crate::backend::Cpu;
use crate::error::Result;
use std::collections::BinaryHeap;
use std::time::Instant;

const NONE: u32 = u32::MAX;
/// Most suffix-link steps used to update occurrence counts per appended token.
pub const COUNT_WALK: usize = 48;

#[derive(Debug, Clone)]
struct State {
    len: u32,
    link: u32,
    cnt: u32,
    next: Vec<(u32, u32)>,
}

/// Suffix automaton over token ids, built online.
#[derive(Debug, Clone)]
pub struct SuffixAutomaton {
    states: Vec<State>,
    last: u32,
    text: Vec<u32>,
}

impl Default for SuffixAutomaton {
    fn default() -> Self {
        SuffixAutomaton { states: vec![State { len: 0, link: NONE, cnt: 0, next: Vec::new() }], last: 0, text: Vec::new() }
    }
}

impl SuffixAutomaton {
    /// The text fed so far.
    pub fn text(&self) -> &[u32] {
        &self.text
    }

    fn next(&self, s: u32, c: u32) -> Option<u32> {
        self.states[s as usize].next.iter().find(|e| e.0 == c).map(|e| e.1)
    }

    fn set_next(&mut self, s: u32, c: u32, to: u32) {
        let st = &mut self.states[s as usize];
        match st.next.iter_mut().find(|e| e.0 == c) {
            Some(e) => e.1 = to,
            None => st.next.push((c, to)),
        }
    }

    /// Append one token (amortized O(1) plus the count walk).
    pub fn push(&mut self, c: u32) {
        self.text.push(c);
        let cur = self.states.len() as u32;
        let len = self.states[self.last as usize].len + 1;
        self.states.push(State { len, link: NONE, cnt: 0, next: Vec::new() });
        let mut p = self.last;
        while p != NONE && self.next(p, c).is_none() {
            self.set_next(p, c, cur);
            p = self.states[p as usize].link;
        }
        if p == NONE {
            self.states[cur as usize].link = 0;
        } else {
            let q = self.next(p, c).unwrap();
            if self.states[p as usize].len + 1 == self.states[q as usize].len {
                self.states[cur as usize].link = q;
            } else {
                let clone = self.states.len() as u32;
                let mut st = self.states[q as usize].clone();
                st.len = self.states[p as usize].len + 1;
                self.states.push(st);
                while p != NONE && self.next(p, c) == Some(q) {
                    self.set_next(p, c, clone);
                    p = self.states[p as usize].link;
                }
                self.states[q as usize].link = clone;
                self.states[cur as usize].link = clone;
            }
        }
        self.last = cur;
        // The new end position joins endpos of every state on the suffix-link path of `cur`.
        let mut v = cur;
        for _ in 0..COUNT_WALK {
            if v == NONE || v == 0 {
                break;
            }
            self.states[v as usize].cnt += 1;
            v = self.states[v as usize].link;
        }
    }

    /// The longest suffix of the text that also occurs earlier: (its state, its length), if any.
    pub fn longest_repeat(&self) -> Option<(u32, usize)> {
        let mut v = self.states[self.last as usize].link;
        while v != NONE && v != 0 {
            if !self.states[v as usize].next.is_empty() {
                return Some((v, self.states[v as usize].len as usize));
            }
            v = self.states[v as usize].link;
        }
        None
    }

    /// Continuations of state `s`: (token, next state, occurrence count), most frequent first.
    pub fn continuations(&self, s: u32) -> Vec<(u32, u32, u32)> {
        let mut v: Vec<(u32, u32, u32)> =
            self.states[s as usize].next.iter().map(|&(c, t)| (c, t, self.states[t as usize].cnt.max(1))).collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        v
    }
}

/// Match-length buckets of the hit-rate estimate: 1, 2, 3, 4–5, 6–8, 9–16, 17+.
fn bucket(len: usize) -> usize {
    match len {
        0..=1 => 0,
        2 => 1,
        3 => 2,
        4..=5 => 3,
        6..=8 => 4,
        9..=16 => 5,
        _ => 6,
    }
}

/// The suffix-lookup speculator.
#[derive(Debug, Clone, Default)]
pub struct SuffixSpeculator {
    sam: SuffixAutomaton,
    /// Per match-length bucket: (hits, trials) of the top continuation.
    hits: [(u32, u32); 7],
    /// Last proposal's top chain to score against what happened: (position of its first token, tokens,
    /// match lengths).
    pending: Option<(usize, Vec<u32>, Vec<usize>)>,
}

impl SuffixSpeculator {
    /// Estimated probability that the top continuation of a length-`len` match is accepted.
    pub fn hit_rate(&self, len: usize) -> f32 {
        let (h, n) = self.hits[bucket(len)];
        (h as f32 + 1.0) / (n as f32 + 2.0)
    }

    fn sync(&mut self, history: &[u32]) {
        if !history.starts_with(self.sam.text()) {
            self.sam = SuffixAutomaton::default();
            self.pending = None;
        }
        // Score the previous top chain against the tokens that actually followed.
        if let Some((start, chain, lens)) = self.pending.take() {
            for (i, (&tok, &len)) in chain.iter().zip(&lens).enumerate() {
                match history.get(start + i) {
                    Some(&actual) => {
                        let e = &mut self.hits[bucket(len)];
                        e.1 += 1;
                        if actual == tok {
                            e.0 += 1;
                        } else {
                            break;
                        }
                    }
                    None => break,
                }
            }
        }
        for &t in &history[self.sam.text().len()..] {
            self.sam.push(t);
        }
    }
}

/// A suffix-tree candidate: the proposal node it extends, its automaton state and match length.
struct Cand {
    node: usize,
    state: u32,
    len: usize,
}

impl Speculator for SuffixSpeculator {
    fn name(&self) -> &'static str {
        "suffix"
    }

    fn prefill(&mut self, _backend: &Cpu, _host: &Cpu, prompt: &[u32]) -> Result<()> {
        self.sync(prompt);
        Ok(())
    }

    fn propose(&mut self, ctx: &ProposeCtx, history: &[u32], tree: &mut DraftTree) -> Result<f64> {
        let t0 = Instant::now();
        self.sync(history);
        let Some((state, len)) = self.sam.longest_repeat() else { return Ok(0.0) };
        let want = ctx.max_nodes.min(ctx.budget.max_nodes());
        // Best-first expansion of the automaton below the matched state.
        let mut heap = BinaryHeap::new();
        heap.push(Ranked { score: 1.0, seq: 0, item: Cand { node: 0, state, len } });
        let mut added = 0;
        let mut top_chain = (Vec::new(), Vec::new());
        let mut chain_node = 0;
        while let Some(Ranked { score: c_score, item: c, .. }) = heap.pop() {
            if added >= want {
                break;
            }
            let conts = self.sam.continuations(c.state);
            let total: u32 = conts.iter().map(|e| e.2).sum();
            let lambda = self.hit_rate(c.len);
            for (rank, &(tok, next, cnt)) in conts.iter().enumerate().take(4) {
                let p = lambda * cnt as f32 / total as f32;
                let score = c_score * p;
                if score < 1e-3 || added >= want {
                    break;
                }
                let node = tree.add(c.node, tok, score);
                added += 1;
                if rank == 0 && c.node == chain_node {
                    top_chain.0.push(tok);
                    top_chain.1.push(c.len);
                    chain_node = node;
                }
                heap.push(Ranked { score, seq: node, item: Cand { node, state: next, len: c.len + 1 } });
            }
        }
        if !top_chain.0.is_empty() {
            self.pending = Some((history.len(), top_chain.0, top_chain.1));
        }
        Ok(t0.elapsed().as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Budget, CostModel};

    /// Brute force: every distinct token that followed an earlier occurrence of the longest suffix that
    /// occurs earlier.
    fn brute(text: &[u32]) -> Option<(usize, Vec<u32>)> {
        let n = text.len();
        for l in (1..n).rev() {
            let suf = &text[n - l..];
            let mut follow: Vec<u32> = (0..n - l).filter(|&i| &text[i..i + l] == suf).map(|i| text[i + l]).collect();
            if !follow.is_empty() {
                follow.sort();
                follow.dedup();
                return Some((l, follow));
            }
        }
        None
    }

    #[test]
    fn automaton_matches_brute_force() {
        let mut seed = 7u64;
        for alphabet in [2u64, 3, 5, 50] {
            let mut sam = SuffixAutomaton::default();
            let mut text = Vec::new();
            for _ in 0..300 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let c = ((seed >> 33) % alphabet) as u32;
                sam.push(c);
                text.push(c);
                let got = sam.longest_repeat().map(|(s, l)| {
                    let mut f: Vec<u32> = sam.continuations(s).iter().map(|e| e.0).collect();
                    f.sort();
                    (l, f)
                });
                assert_eq!(got, brute(&text), "alphabet {alphabet}, text {text:?}");
            }
        }
    }

    #[test]
    fn counts_rank_frequent_continuations_first() {
        let mut sam = SuffixAutomaton::default();
        // "1 2" followed by 10 twice and by 11 once; the text ends in "1 2".
        for &t in &[1, 2, 10, 5, 1, 2, 11, 6, 1, 2, 10, 7, 1, 2] {
            sam.push(t);
        }
        let (s, l) = sam.longest_repeat().unwrap();
        assert_eq!(l, 2);
        let c = sam.continuations(s);
        assert_eq!((c[0].0, c[0].2, c[1].0, c[1].2), (10, 2, 11, 1));
    }

    #[test]
    fn proposes_a_tree_and_learns_hit_rates() {
        let backend = Cpu::new(1);
        let cost = CostModel::default();
        let ctx = ProposeCtx {
            backend: &backend,
            host: &backend,
            budget: Budget::Fixed(8),
            max_nodes: 8,
            cost: &cost,
            temperature: 0.0,
            target: None,
            model: None,
        };
        let mut s = SuffixSpeculator::default();
        let mut hist: Vec<u32> = vec![5, 6, 7, 8, 9, 1, 2, 3, 5, 6];
        s.prefill(&backend, &backend, &hist[..4]).unwrap();
        let mut tree = DraftTree::new(6);
        s.propose(&ctx, &hist, &mut tree).unwrap();
        // "5 6" occurred before, followed by 7 8 9 1 …: a chain 7 → 8 → 9 ….
        assert!(tree.len() > 3);
        assert_eq!(&tree.tokens[1..4], &[7, 8, 9]);
        assert_eq!(&tree.parents[1..4], &[0, 1, 2]);
        for i in 1..tree.len() {
            assert!(tree.scores[i] <= tree.scores[tree.parents[i]]);
        }
        let before = s.hit_rate(2);
        // The target produced 7 8 (hits at lengths 2 and 3) then 4 (miss at length 4).
        hist.extend_from_slice(&[7, 8, 4]);
        let mut tree = DraftTree::new(4);
        s.propose(&ctx, &hist, &mut tree).unwrap();
        assert!(s.hit_rate(2) > before);
        assert!(s.hit_rate(4) < 0.5);
        // A history that is not an extension restarts cleanly.
        let mut tree = DraftTree::new(3);
        s.propose(&ctx, &[1, 2, 3, 1, 2, 3], &mut tree).unwrap();
        assert_eq!(tree.tokens[1], 1);
    }
}
