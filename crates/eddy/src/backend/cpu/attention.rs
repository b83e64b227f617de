//! Scaled dot-product attention over the KV cache (Vaswani et al. 2017, eq. 1) with grouped-query heads
//! (Ainslie et al. 2023), optional sliding window and optional logit soft-capping.
//!
//! Layout: `q` is `T × n_heads × head_dim`; the cache of one layer is `rows × n_kv_heads × head_dim` for K
//! and V, f32. Query `i` of the batch sits at absolute position `n_past + i` and sees cache rows
//! `0..=n_past + i` (the batch's own K/V were written to rows `n_past..n_past+T` before the call), limited
//! to the last `window` positions when a sliding window is set. Each (query, head) is computed alone, in a
//! fixed order, so results never depend on the batch size.
//!
//! Token trees ([`Visibility::Tree`]): query `i` is tree node `first + i` at position `n_past + depth`;
//! its keys are the committed rows `0..n_past` followed by its ancestors' rows (`n_past + node`), root
//! first. Keys are visited in position order, exactly as for a chain, so a node's output is bit-identical
//! to what plain decoding computes at the same position with the same K/V.

use super::ThreadPool;
use crate::tree::TreePaths;
use std::cell::RefCell;

/// Shape and options of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Multiplier of q·k (usually `1/√head_dim`).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions > p − window.
    pub window: Option<usize>,
    /// Soft-capping of attention logits: `c·tanh(s/c)`.
    pub softcap: Option<f32>,
}

/// Which cache rows each query of a batch sees.
#[derive(Debug, Clone, Copy)]
pub enum Visibility<'a> {
    /// Query `i` sits at position `n_past + i` and sees rows `0..=n_past + i`.
    Causal,
    /// Query `i` is node `first + i` of the tree; it sees the committed rows and its ancestors' rows.
    Tree {
        /// Tree node of query 0.
        first: usize,
        /// Root-to-node paths of the whole tree.
        paths: &'a TreePaths,
    },
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention of `t` queries against the cache. `out` is `t × n_heads × head_dim`.
///
/// The cache must hold every row a query sees: `n_past + t` rows for [`Visibility::Causal`],
/// `n_past + first + t` for a tree.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    s: &AttnShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_past: usize,
    t: usize,
    vis: Visibility,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let kv_stride = s.n_kv_heads * hd;
    let group = s.n_heads / s.n_kv_heads;
    let out_ptr = SendPtr(out.as_mut_ptr());
    assert!(q.len() >= t * s.n_heads * hd && out.len() >= t * s.n_heads * hd);
    let rows_used = match vis {
        Visibility::Causal => n_past + t,
        Visibility::Tree { first, paths } => {
            assert!(first + t <= paths.len());
            n_past + first + t
        }
    };
    assert!(k_cache.len() >= rows_used * kv_stride && v_cache.len() >= rows_used * kv_stride);
    // One work item per (query, KV head, slice of its query heads): the query heads sharing a KV head
    // read each K and V row once (GQA) instead of once per head; the heads are split further only when
    // there are fewer (query, KV head) pairs than threads. Each head's operations and their order are
    // the same as computing it alone, so the split never changes a bit.
    let pairs = t * s.n_kv_heads;
    let per_item = group.div_ceil(pool.n_threads().div_ceil(pairs).min(group));
    let slices = group.div_ceil(per_item);
    pool.parallel_for(pairs * slices, 1, |range| {
        SCORES.with(|sc| {
            let mut scores = sc.borrow_mut();
            for item in range {
                let (pair, slice) = (item / slices, item % slices);
                let (i, kvh) = (pair / s.n_kv_heads, pair % s.n_kv_heads);
                let g0 = slice * per_item;
                let group = per_item.min(group - g0);
                let (pos, path): (usize, &[u32]) = match vis {
                    Visibility::Causal => (n_past + i, &[]),
                    Visibility::Tree { first, paths } => {
                        let p = paths.path(first + i);
                        (n_past + p.len() - 1, p)
                    }
                };
                // Cache row of the key at absolute position `j`.
                let row = |j: usize| if path.is_empty() || j < n_past { j } else { n_past + path[j - n_past] as usize };
                let lo = match s.window {
                    Some(w) => (pos + 1).saturating_sub(w),
                    None => 0,
                };
                let n = pos + 1 - lo;
                // Scores of head g at scores[g·n..], then the per-head max and 1/sum.
                let need = group * (n + 2);
                if scores.len() < need {
                    scores.resize(need, 0.0);
                }
                let (sc, stats) = scores.split_at_mut(group * n);
                let (max, inv) = stats[..2 * group].split_at_mut(group);
                max.fill(f32::NEG_INFINITY);
                let q0 = (i * s.n_heads + kvh * (s.n_heads / s.n_kv_heads) + g0) * hd;
                let qg = &q[q0..q0 + group * hd];
                for j in 0..n {
                    let kr = &k_cache[row(lo + j) * kv_stride + kvh * hd..][..hd];
                    for g in 0..group {
                        let mut v = dot(&qg[g * hd..(g + 1) * hd], kr) * s.scale;
                        if let Some(c) = s.softcap {
                            v = c * (v / c).tanh();
                        }
                        sc[g * n + j] = v;
                        max[g] = max[g].max(v);
                    }
                }
                for g in 0..group {
                    let mut sum = 0f32;
                    for x in sc[g * n..(g + 1) * n].iter_mut() {
                        *x = (*x - max[g]).exp();
                        sum += *x;
                    }
                    inv[g] = 1.0 / sum;
                }
                // SAFETY: each item writes its own disjoint `group·hd` slice of `out` (its heads of query i).
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(q0), group * hd) };
                o.fill(0.0);
                for j in 0..n {
                    let vr = &v_cache[row(lo + j) * kv_stride + kvh * hd..][..hd];
                    for g in 0..group {
                        let w = sc[g * n + j] * inv[g];
                        for (a, &b) in o[g * hd..(g + 1) * hd].iter_mut().zip(vr) {
                            *a += w * b;
                        }
                    }
                }
            }
        })
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint output slices to pool workers.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Dot product with 16 fixed accumulation lanes (auto-vectorizes; order fixed for a given length).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    for l in 0..8 {
        acc[l] += acc[l + 8];
    }
    for l in 0..4 {
        acc[l] += acc[l + 4];
    }
    acc[0] + acc[1] + acc[2] + acc[3] + s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32], n_past: usize, t: usize) -> Vec<f64> {
        let hd = s.head_dim;
        let kvs = s.n_kv_heads * hd;
        let mut out = vec![0f64; t * s.n_heads * hd];
        for i in 0..t {
            for h in 0..s.n_heads {
                let kvh = h / (s.n_heads / s.n_kv_heads);
                let pos = n_past + i;
                let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let sc: Vec<f64> = (first..=pos)
                    .map(|j| (0..hd).map(|d| q[(i * s.n_heads + h) * hd + d] as f64 * k[j * kvs + kvh * hd + d] as f64).sum::<f64>() * s.scale as f64)
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (jj, j) in (first..=pos).enumerate() {
                    for d in 0..hd {
                        out[(i * s.n_heads + h) * hd + d] += e[jj] / z * v[j * kvs + kvh * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_and_is_batch_invariant() {
        let pool = ThreadPool::new(2);
        for window in [None, Some(3)] {
            let s = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 20, scale: 0.3, window, softcap: None };
            let (n_past, t) = (5, 4);
            let rows = n_past + t;
            let mut seed = 1u32;
            let mut rnd = || {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            };
            let q: Vec<f32> = (0..t * 6 * 20).map(|_| rnd()).collect();
            let k: Vec<f32> = (0..rows * 40).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..rows * 40).map(|_| rnd()).collect();
            let mut out = vec![0f32; t * 120];
            attention(&pool, &s, &q, &k, &v, n_past, t, Visibility::Causal, &mut out);
            let want = reference(&s, &q, &k, &v, n_past, t);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
            }
            // The last query alone (as in decode) gives bit-identical output, on any thread count (the
            // query heads of a KV head are split across threads when there are few queries).
            for threads in 1..=4 {
                let p = ThreadPool::new(threads);
                let mut one = vec![0f32; 120];
                attention(&p, &s, &q[3 * 120..], &k, &v, n_past + 3, 1, Visibility::Causal, &mut one);
                assert_eq!(one, out[3 * 120..], "{threads} threads");
                let mut all = vec![0f32; t * 120];
                attention(&p, &s, &q, &k, &v, n_past, t, Visibility::Causal, &mut all);
                assert_eq!(all, out, "{threads} threads");
            }
        }
    }
}
