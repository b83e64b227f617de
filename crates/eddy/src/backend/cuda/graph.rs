//! When a queued pass runs as a CUDA graph: [`GraphPlan`], the host-side decision (no GPU needed, tested in
//! `tests/cuda.rs`).
//!
//! The backend queues the operations of a pass ([`super::Cuda`] records every kernel launch and device copy
//! with its exact arguments) and, at the pass's end, asks the plan what to do with that list:
//!
//! * a list seen for the first time runs eagerly (op by op): prefill passes of ever-changing shapes never
//!   pay for a capture;
//! * a list seen before (same hash) is captured into a graph, instantiated, launched and kept;
//! * a list equal to a kept graph's list (compared in full, not only by hash) replays that graph: one launch
//!   for the whole pass.
//!
//! Replaying is exact because everything a pass takes from the host at run time (token ids, positions, key
//! lists, the KV row written) lives in one device arena at fixed offsets that is rewritten before the
//! launch, so equal lists mean equal work. At most `max_graphs` graphs are kept (least recently used
//! evicted); the caller destroys what [`GraphPlan::insert`] evicts.

/// What to do with a queued list of operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Replay the kept graph with this index ([`GraphPlan::get`]).
    Replay(usize),
    /// Capture the list into a graph, then [`GraphPlan::insert`] it.
    Capture,
    /// Run the operations one by one.
    Eager,
}

/// Kept graphs (`E`) keyed by their operation lists (`K`), and the hashes of lists seen once.
pub struct GraphPlan<K, E> {
    /// (hash, list, graph), least recently used first.
    kept: Vec<(u64, K, E)>,
    /// Hashes of lists seen but not captured, oldest first (at most `2 · max_graphs + 16`).
    seen: Vec<u64>,
    max_graphs: usize,
}

impl<K: PartialEq, E> GraphPlan<K, E> {
    /// A plan keeping at most `max_graphs` graphs (0: never capture).
    pub fn new(max_graphs: usize) -> Self {
        GraphPlan { kept: Vec::new(), seen: Vec::new(), max_graphs }
    }

    /// The decision for the list `key` with hash `hash`; records the sighting.
    pub fn decide(&mut self, hash: u64, key: &K) -> Plan {
        if let Some(i) = self.kept.iter().position(|(h, k, _)| *h == hash && k == key) {
            // Most recently used last.
            let e = self.kept.remove(i);
            self.kept.push(e);
            return Plan::Replay(self.kept.len() - 1);
        }
        if self.max_graphs == 0 {
            return Plan::Eager;
        }
        if let Some(i) = self.seen.iter().position(|&h| h == hash) {
            self.seen.remove(i);
            return Plan::Capture;
        }
        if self.seen.len() >= 2 * self.max_graphs + 16 {
            self.seen.remove(0);
        }
        self.seen.push(hash);
        Plan::Eager
    }

    /// Keep the graph captured for `key`; returns the graph evicted to make room (to be destroyed).
    pub fn insert(&mut self, hash: u64, key: K, graph: E) -> Option<E> {
        let evicted = (self.kept.len() >= self.max_graphs && !self.kept.is_empty()).then(|| self.kept.remove(0).2);
        self.kept.push((hash, key, graph));
        evicted
    }

    /// Kept graph `i` (from [`Plan::Replay`]).
    pub fn get(&self, i: usize) -> &E {
        &self.kept[i].2
    }

    /// Whether lists are ever captured (a plan made with `max_graphs` 0 runs everything eagerly).
    pub fn captures(&self) -> bool {
        self.max_graphs > 0
    }

    /// Graphs kept.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether no graph is kept.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Remove and return every kept graph (to destroy them).
    pub fn drain(&mut self) -> Vec<E> {
        self.seen.clear();
        self.kept.drain(..).map(|(_, _, e)| e).collect()
    }
}
