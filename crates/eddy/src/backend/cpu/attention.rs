//! Scaled dot-product attention over the KV cache (Vaswani et al. 2017, eq. 1) with grouped-query heads
//! (Ainslie et al. 2023), optional sliding window and optional logit soft-capping.
//!
//! Layout: `q` is `T × n_heads × head_dim`; the cache of one layer is `rows × n_kv_heads × head_dim` for K
//! and V, f32. Query `i` of the batch sits at absolute position `n_past + i` and sees cache rows
//! `0..=n_past + i` (the batch's own K/V were written to rows `n_past..n_past+T` before the call), limited
//! to the last `window` positions when a sliding window is set.
//!
//! Token trees ([`Visibility::Tree`]): query `i` is tree node `first + i` at position `n_past + depth`;
//! its keys are the committed rows `0..n_past` followed by its ancestors' rows (`n_past + node`), root
//! first. Keys are visited in position order, exactly as for a chain, so a node's output is bit-identical
//! to what plain decoding computes at the same position with the same K/V.
//!
//! # One canonical operation order per (query, head)
//! Results never depend on the batch, the thread count or the blocking. For a (query, head) with keys
//! `j = 0..n` (its visible keys in position order) the arithmetic is fixed:
//! * score `s_j = hsum(c) · scale` (then `cap·tanh(s_j/cap)` with soft-capping), where `c` is a 16-lane
//!   chain over the head dimension: `c[l] = fma(q[16m+l], k_j[16m+l], c[l])` for `m = 0, 1, …` (lanes past
//!   `head_dim` add `fma(0, 0, ·)`), and `hsum` is the tree `((l + l+8) + (l+4)) + (l+2)`, then `0 + 1`;
//! * `M = max_j s_j`, `e_j = exp(s_j − M)` with [`exp_avx512`] / [`exp_portable`], `Z` = the same 16-lane
//!   chain and tree over `e_j` (lane `j mod 16`);
//! * `o[d] = fma(e_j, v_j[d], o[d])` for `j = 0, 1, …, n−1` from `o = 0`, then `o[d] · (1/Z)`.
//!
//! The kernels only reorder independent chains: a work item takes a block of consecutive queries of one
//! KV head (all its query heads, or a slice of them when there are few queries) and walks the keys in
//! blocks that stay in L1, so each K and V row is loaded once per block of queries instead of once per
//! query (the FlashAttention idea, Dao 2023, §3, with a stored score row per (query, head) instead of the
//! online rescaling, whose result would depend on the key blocking). The AVX-512, AVX2 and portable kernels
//! follow the same order; AVX2 holds each 16-lane chain in two 8-lane registers and computes exactly what
//! AVX-512 does, the portable one uses separate multiply and add instead of `fma`, so its results differ,
//! never between batches on one machine (the kernel is chosen once per CPU).

use super::ThreadPool;
use crate::tree::TreePaths;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    /// Every query sees cache rows `0..rows` (a block attending to a context and to itself in both
    /// directions, as DFlash's draft block does); `n_past` is unused. The keys are visited in row order,
    /// so query `i` gives exactly what a single [`Visibility::Causal`] query at position `rows − 1` gives.
    Block {
        /// Rows every query sees.
        rows: usize,
    },
}

/// Most queries in one work item.
const MAX_QUERY_BLOCK: usize = 16;
/// Fewest queries in one work item when the batch has that many (the score rows may then outgrow L2).
const MIN_QUERY_BLOCK: usize = 4;
/// Target size of one work item's score rows (kept in L2).
const SCORE_BYTES: usize = 768 << 10;
/// Target size of one block of K (or V) rows of one KV head (kept in L1).
const KEY_BLOCK_BYTES: usize = 32 << 10;

/// Implementation of the inner loops (see the module doc for the operation order both follow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AVX-512F with `fma`.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX2 with `fma`: the AVX-512 kernels' operations, each 16-lane chain as two 8-lane halves, so the
    /// results are bit-identical to theirs.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Plain Rust, separate multiply and add.
    Portable,
}

impl Kernel {
    /// The kernel for the backend's selected path ([`super::Kernel::active`]: runtime detection, capped by
    /// `EDDY_KERNEL`), so one switch picks the attention kernels with the matmul ones.
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if super::Kernel::active() == super::Kernel::Avx512 && std::arch::is_x86_feature_detected!("fma") {
            return Kernel::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if super::Kernel::active() == super::Kernel::Avx2 {
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// `out[g·stride + jj] = score(q_g, k[offs[jj]..][..hd])` for the `q.len() / hd` query heads `g`.
    #[allow(clippy::too_many_arguments)]
    fn scores(self, q: &[f32], hd: usize, k: &[f32], offs: &[usize], scale: f32, out: &mut [f32], stride: usize) {
        let gn = q.len() / hd;
        assert!(gn >= 1 && gn * hd == q.len() && offs.iter().all(|&o| o + hd <= k.len()));
        assert!(out.len() >= (gn - 1) * stride + offs.len());
        match self {
            // SAFETY: features detected in `detect`; reads and writes are within the bounds asserted above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::scores(q.as_ptr(), gn, hd, k.as_ptr(), offs, scale, out.as_mut_ptr(), stride) },
            // SAFETY: as above (AVX2 + FMA, which `super::Kernel::Avx2` implies).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::scores(q.as_ptr(), gn, hd, k.as_ptr(), offs, scale, out.as_mut_ptr(), stride) },
            Kernel::Portable => {
                for g in 0..gn {
                    let qg = &q[g * hd..(g + 1) * hd];
                    for (jj, &o) in offs.iter().enumerate() {
                        out[g * stride + jj] = portable_dot(qg, &k[o..o + hd]) * scale;
                    }
                }
            }
        }
    }

    /// Replaces the scores of one (query, head) by `exp(s − max)` and returns their sum.
    fn exp_row(self, row: &mut [f32]) -> f32 {
        match self {
            // SAFETY: features detected in `detect`.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::exp_row(row) },
            // SAFETY: features detected in `detect`.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::exp_row(row) },
            Kernel::Portable => {
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut lanes = [0f32; 16];
                for (j, x) in row.iter_mut().enumerate() {
                    *x = exp_portable(*x - m);
                    lanes[j % 16] += *x;
                }
                hsum_portable(&lanes)
            }
        }
    }

    /// `o_g[d] = fma(w[g·stride + jj], v[offs[jj] + d], o_g[d])` for `jj` in order, for the `o.len() / hd`
    /// heads `g` (`o_g = o[g·hd..]`).
    fn pv(self, w: &[f32], stride: usize, v: &[f32], offs: &[usize], hd: usize, o: &mut [f32]) {
        let gn = o.len() / hd;
        assert!(gn >= 1 && gn * hd == o.len() && offs.iter().all(|&x| x + hd <= v.len()));
        assert!(w.len() >= (gn - 1) * stride + offs.len());
        match self {
            // SAFETY: features detected in `detect`; reads and writes are within the bounds asserted above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::pv(w.as_ptr(), stride, gn, v.as_ptr(), offs, hd, o.as_mut_ptr()) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::pv(w.as_ptr(), stride, gn, v.as_ptr(), offs, hd, o.as_mut_ptr()) },
            Kernel::Portable => {
                for g in 0..gn {
                    let og = &mut o[g * hd..(g + 1) * hd];
                    for (jj, &x) in offs.iter().enumerate() {
                        let wj = w[g * stride + jj];
                        for (a, &b) in og.iter_mut().zip(&v[x..x + hd]) {
                            *a += wj * b;
                        }
                    }
                }
            }
        }
    }
}

/// The register tiles of a `scores` kernel: heads `g..g+r` (`r` ≤ 2) × keys `jj..jj+nj` (`nj` ≤ `jmax`),
/// passed to `f(g, r, jj, nj)`, heads outer. Tiles only group independent chains.
#[cfg(target_arch = "x86_64")]
fn score_tiles(gn: usize, n_keys: usize, jmax: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut g = 0;
    while g < gn {
        let r = (gn - g).min(2);
        let mut jj = 0;
        while jj < n_keys {
            let nj = (n_keys - jj).min(jmax);
            f(g, r, jj, nj);
            jj += nj;
        }
        g += r;
    }
}

/// The register tiles of a `pv` kernel: heads `g..g+r` (`r` ≤ 2) × output elements `d0..` in up to
/// `cmax` chunks of 16, passed to `f(g, r, d0, chunks)`.
#[cfg(target_arch = "x86_64")]
fn pv_tiles(gn: usize, hd: usize, cmax: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut g = 0;
    while g < gn {
        let r = (gn - g).min(2);
        for d0 in (0..hd).step_by(16 * cmax) {
            f(g, r, d0, (hd - d0).div_ceil(16).min(cmax));
        }
        g += r;
    }
}

/// Dot product in the canonical order (16 lane chains, [`hsum_portable`]'s tree), multiply then add.
fn portable_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for (d, (x, y)) in a.iter().zip(b).enumerate() {
        lanes[d % 16] += x * y;
    }
    hsum_portable(&lanes)
}

/// The canonical horizontal sum: `s[l] = a[l] + a[l+8]`, then `s[l] + s[l+4]`, then `s[l] + s[l+2]`, then
/// `s[0] + s[1]` (what the AVX-512 `hsum` computes).
fn hsum_portable(a: &[f32; 16]) -> f32 {
    let mut s = *a;
    for w in [8, 4, 2, 1] {
        for l in 0..w {
            s[l] += s[l + w];
        }
    }
    s[0]
}

const LN2_HI: f32 = 0.693_359_4; // 0.693359375 = 355/512: n·LN2_HI is exact for |n| < 2^15
const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 − LN2_HI
/// `1/k!` for k = 7 down to 2: the Taylor polynomial of e^r, whose truncation error on |r| ≤ ln2/2 is
/// below 0.1 ulp.
const EXP_POLY: [f32; 6] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5];
/// Below this, e^x rounds to 0 in f32 (e^−103.98 is half the smallest subnormal).
const EXP_MIN: f32 = -104.0;
/// Above this, e^x overflows to +inf.
const EXP_MAX: f32 = 89.0;

/// e^x in f32 without FMA (the fallback of [`exp_avx512`], same steps): `n = round(x·log2 e)`,
/// `r = x − n·ln 2` (Cody–Waite two-part ln 2), Horner on the degree-7 Taylor polynomial, times `2^n`
/// (in two steps below `2^−126`, rounding once). About 1 ulp; `−inf` and `x < −104` give `+0`, NaN stays
/// NaN, `x > 89` gives `+inf`.
pub fn exp_portable(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(EXP_MIN, EXP_MAX);
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding and subtracting it rounds to nearest even
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    p = p * r + 1.0;
    p = p * r + 1.0;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let n = n as i32;
    if n < -126 {
        p * pow2(n + 64) * pow2(-64)
    } else if n > 127 {
        p * pow2(n - 1) * 2.0
    } else {
        p * pow2(n)
    }
}

/// e^x for 16 lanes with AVX-512F: the steps of [`exp_portable`] with `fma`, and `vscalefps` for the
/// final `·2^n` (one rounding, subnormal results exact to rounding; the AVX2 kernel gets the same bits by
/// multiplying with powers of two, in two steps where the result is subnormal). About 1 ulp; `−inf` and `x < −104`
/// give `+0`, NaN stays NaN.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    avx512::exp(x)
}

thread_local! {
    /// Score rows and key offsets of the work item in progress.
    static SCRATCH: RefCell<(Vec<f32>, Vec<usize>)> = const { RefCell::new((Vec::new(), Vec::new())) };
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
    attention_with(Kernel::detect(), pool, s, q, k_cache, v_cache, n_past, t, vis, out)
}

/// The keys one query sees: positions `lo..=pos`, the position `j` in cache row `row(j)`.
#[derive(Clone, Copy)]
struct Query<'a> {
    pos: usize,
    lo: usize,
    n_past: usize,
    /// Tree path (empty for a chain).
    path: &'a [u32],
}

impl<'a> Query<'a> {
    fn new(s: &AttnShape, n_past: usize, vis: Visibility<'a>, i: usize) -> Self {
        let (pos, path): (usize, &[u32]) = match vis {
            Visibility::Causal => (n_past + i, &[]),
            Visibility::Tree { first, paths } => {
                let p = paths.path(first + i);
                (n_past + p.len() - 1, p)
            }
            Visibility::Block { rows } => (rows - 1, &[]),
        };
        let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        Query { pos, lo, n_past, path }
    }

    fn n(&self) -> usize {
        self.pos + 1 - self.lo
    }

    fn row(&self, j: usize) -> usize {
        if self.path.is_empty() || j < self.n_past {
            j
        } else {
            self.n_past + self.path[j - self.n_past] as usize
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_with(
    kernel: Kernel,
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
        Visibility::Block { rows } => {
            assert!(rows > 0, "a block query must see at least one row");
            rows
        }
    };
    assert!(k_cache.len() >= rows_used * kv_stride && v_cache.len() >= rows_used * kv_stride);
    if t == 0 {
        return;
    }
    // Work items: (block of `qb` queries, KV head, slice of its query heads). The heads are split only
    // when there are fewer (block, KV head) pairs than threads (decode). The blocking never changes a
    // bit (module doc).
    let max_n = (0..t).map(|i| Query::new(s, n_past, vis, i).n()).max().unwrap_or(1);
    let qb = (SCORE_BYTES / (4 * group * max_n)).clamp(MIN_QUERY_BLOCK, MAX_QUERY_BLOCK).min(t);
    let n_blocks = t.div_ceil(qb);
    let pairs = n_blocks * s.n_kv_heads;
    let per_item = group.div_ceil(pool.n_threads().div_ceil(pairs).min(group));
    let slices = group.div_ceil(per_item);
    let per_block = s.n_kv_heads * slices;
    let kb = (KEY_BLOCK_BYTES / (4 * hd)).clamp(16, 256);
    let next = AtomicUsize::new(0);
    pool.run(|_, _| {
        SCRATCH.with(|sc| {
            let (scores, offs) = &mut *sc.borrow_mut();
            loop {
                let item = next.fetch_add(1, Ordering::Relaxed);
                if item >= n_blocks * per_block {
                    break;
                }
                // Last blocks first: under causal masking they see the most keys (longest jobs first).
                let b = n_blocks - 1 - item / per_block;
                let (kvh, slice) = ((item % per_block) / slices, item % slices);
                let g0 = slice * per_item;
                let item = Item { kvh, h0: kvh * group + g0, gn: per_item.min(group - g0), queries: b * qb..(b * qb + qb).min(t) };
                // SAFETY: each item writes only the `gn·hd` outputs of its heads for its queries, disjoint
                // from every other item's.
                unsafe { run_item(kernel, s, q, k_cache, v_cache, n_past, vis, &item, kb, out_ptr, scores, offs) };
            }
        })
    });
}

/// Called per (key block, query): query index in the item, the query, its score rows, the first key
/// of the block in its rows, the block's key offsets.
type BlockFn<'f> = dyn FnMut(usize, &Query, &mut [f32], usize, &[usize]) + 'f;

/// One work item: heads `h0..h0+gn` (of KV head `kvh`) of the queries `queries`.
struct Item {
    kvh: usize,
    h0: usize,
    gn: usize,
    queries: std::ops::Range<usize>,
}

/// # Safety
/// `out` points to `t × n_heads × head_dim` floats, of which no other thread touches this item's.
#[allow(clippy::too_many_arguments)]
unsafe fn run_item(
    kernel: Kernel,
    s: &AttnShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_past: usize,
    vis: Visibility,
    it: &Item,
    kb: usize,
    out: SendPtr,
    scores: &mut Vec<f32>,
    offs: &mut Vec<usize>,
) {
    let hd = s.head_dim;
    let kv_stride = s.n_kv_heads * hd;
    let gn = it.gn;
    // At most MAX_QUERY_BLOCK queries per item: on the stack (no allocation per call).
    let mut qbuf = [Query { pos: 0, lo: 0, n_past: 0, path: &[] }; MAX_QUERY_BLOCK];
    let nq = it.queries.len();
    assert!(nq <= MAX_QUERY_BLOCK);
    for (slot, i) in qbuf.iter_mut().zip(it.queries.clone()) {
        *slot = Query::new(s, n_past, vis, i);
    }
    let queries = &qbuf[..nq];
    // Score rows: query qi's head g at base[qi] + g·n_qi; then 1/Z per (query, head).
    let total: usize = queries.iter().map(|x| gn * x.n()).sum();
    let n_rows = gn * queries.len();
    if scores.len() < total + n_rows {
        scores.resize(total + n_rows, 0.0);
    }
    let (sc, inv) = scores.split_at_mut(total);
    let inv = &mut inv[..n_rows];
    let j_lo = queries.iter().map(|x| x.lo).min().unwrap_or(0);
    let j_hi = queries.iter().map(|x| x.pos + 1).max().unwrap_or(0);
    // Calls `f` for each key block and each query that sees some of it.
    let each_block = |sc: &mut [f32], offs: &mut Vec<usize>, f: &mut BlockFn| {
        for jb in (j_lo..j_hi).step_by(kb) {
            let je = (jb + kb).min(j_hi);
            let mut base = 0;
            for (qi, x) in queries.iter().enumerate() {
                let (a, e) = (jb.max(x.lo), je.min(x.pos + 1));
                if a < e {
                    offs.clear();
                    offs.extend((a..e).map(|j| x.row(j) * kv_stride + it.kvh * hd));
                    f(qi, x, &mut sc[base..base + gn * x.n()], a - x.lo, offs);
                }
                base += gn * x.n();
            }
        }
    };
    // Pass 1: scores.
    each_block(sc, offs, &mut |qi, x, rows, col, offs| {
        let q0 = ((it.queries.start + qi) * s.n_heads + it.h0) * hd;
        let n = x.n();
        kernel.scores(&q[q0..q0 + gn * hd], hd, k_cache, offs, s.scale, &mut rows[col..], n);
        if let Some(c) = s.softcap {
            for g in 0..gn {
                for v in &mut rows[g * n + col..g * n + col + offs.len()] {
                    *v = c * (*v / c).tanh();
                }
            }
        }
    });
    // Softmax numerators and 1/Z.
    let mut base = 0;
    for (qi, x) in queries.iter().enumerate() {
        for g in 0..gn {
            inv[qi * gn + g] = 1.0 / kernel.exp_row(&mut sc[base + g * x.n()..base + (g + 1) * x.n()]);
        }
        base += gn * x.n();
    }
    let o_at = |qi: usize| {
        // SAFETY: the item's own outputs (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(out.get().add(((it.queries.start + qi) * s.n_heads + it.h0) * hd), gn * hd) }
    };
    for qi in 0..queries.len() {
        o_at(qi).fill(0.0);
    }
    // Pass 2: Σ e_j v_j.
    each_block(sc, offs, &mut |qi, x, rows, col, offs| kernel.pv(&rows[col..], x.n(), v_cache, offs, hd, o_at(qi)));
    for qi in 0..queries.len() {
        for (g, o) in o_at(qi).chunks_exact_mut(hd).enumerate() {
            let r = inv[qi * gn + g];
            o.iter_mut().for_each(|v| *v *= r);
        }
    }
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 kernels of [`super::Kernel`] (operation order in the module doc of `attention`).
    #![allow(clippy::needless_range_loop)] // register tiles index parallel arrays
    use super::super::avx512::hsum; // the canonical tree (`l + l+8`, `+ l+4`, `+ l+2`, then lane 0 + 1)
    use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};
    use std::arch::x86_64::*;

    /// Low `min(n, 16)` bits set.
    #[inline]
    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// Largest lane (exact in any order).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn hmax(v: __m512) -> f32 {
        let mut a = [0f32; 16];
        // SAFETY: `a` holds 16 floats.
        unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) };
        a.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }

    /// See [`super::exp_avx512`].
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn exp(x: __m512) -> __m512 {
        // `max`/`min` return their second operand when one is NaN, so NaN passes through.
        let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        _mm512_scalef_ps(p, n)
    }

    /// See [`super::Kernel::exp_row`].
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn exp_row(row: &mut [f32]) -> f32 {
        let (n, p) = (row.len(), row.as_mut_ptr());
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for d in (0..n).step_by(16) {
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask(n - d), p.add(d));
            mx = _mm512_max_ps(mx, x);
        }
        let m = _mm512_set1_ps(hmax(mx));
        let mut sum = _mm512_setzero_ps();
        for d in (0..n).step_by(16) {
            let k = mask(n - d);
            let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(d)), m));
            _mm512_mask_storeu_ps(p.add(d), k, e);
            sum = _mm512_mask_add_ps(sum, k, sum, e);
        }
        hsum(sum)
    }

    /// Calls `$f::<R, N>(args)` with the constants `R = $r` (1 or 2) and `N = $n` (1 to 4).
    macro_rules! tile {
        ($f:ident, $r:expr, $n:expr, $args:tt) => {
            match ($r, $n) {
                (2, 4) => $f::<2, 4> $args,
                (2, 3) => $f::<2, 3> $args,
                (2, 2) => $f::<2, 2> $args,
                (2, _) => $f::<2, 1> $args,
                (_, 4) => $f::<1, 4> $args,
                (_, 3) => $f::<1, 3> $args,
                (_, 2) => $f::<1, 2> $args,
                _ => $f::<1, 1> $args,
            }
        };
    }

    /// See [`super::Kernel::scores`]: tiles of up to 2 heads × 4 keys.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores(
        q: *const f32,
        gn: usize,
        hd: usize,
        k: *const f32,
        offs: &[usize],
        scale: f32,
        out: *mut f32,
        stride: usize,
    ) {
        super::score_tiles(gn, offs.len(), 4, |g, r, jj, nj| {
            let (qg, o, ks) = (q.add(g * hd), out.add(g * stride + jj), &offs[jj..jj + nj]);
            tile!(score_tile, r, nj, (qg, hd, k, ks, scale, o, stride));
        });
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn score_tile<const R: usize, const J: usize>(
        q: *const f32,
        hd: usize,
        k: *const f32,
        offs: &[usize],
        scale: f32,
        out: *mut f32,
        stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        for d in (0..hd).step_by(16) {
            let m = mask(hd - d);
            let mut kv = [_mm512_setzero_ps(); J];
            for j in 0..J {
                kv[j] = _mm512_maskz_loadu_ps(m, k.add(offs[j] + d));
            }
            for r in 0..R {
                let qv = _mm512_maskz_loadu_ps(m, q.add(r * hd + d));
                for j in 0..J {
                    acc[r][j] = _mm512_fmadd_ps(qv, kv[j], acc[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..J {
                *out.add(r * stride + j) = hsum(acc[r][j]) * scale;
            }
        }
    }

    /// See [`super::Kernel::pv`]: tiles of up to 2 heads × 64 output elements held in registers.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn pv(w: *const f32, stride: usize, gn: usize, v: *const f32, offs: &[usize], hd: usize, o: *mut f32) {
        super::pv_tiles(gn, hd, 4, |g, r, d0, chunks| {
            tile!(pv_tile, r, chunks, (w.add(g * stride), stride, v, offs, hd, d0, o.add(g * hd)));
        });
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn pv_tile<const R: usize, const C: usize>(
        w: *const f32,
        stride: usize,
        v: *const f32,
        offs: &[usize],
        hd: usize,
        d0: usize,
        o: *mut f32,
    ) {
        let mut m = [0 as __mmask16; C];
        for c in 0..C {
            m[c] = mask(hd - d0 - 16 * c);
        }
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for r in 0..R {
            for c in 0..C {
                acc[r][c] = _mm512_maskz_loadu_ps(m[c], o.add(r * hd + d0 + 16 * c));
            }
        }
        for (jj, &x) in offs.iter().enumerate() {
            let mut vv = [_mm512_setzero_ps(); C];
            for c in 0..C {
                vv[c] = _mm512_maskz_loadu_ps(m[c], v.add(x + d0 + 16 * c));
            }
            for r in 0..R {
                let wv = _mm512_set1_ps(*w.add(r * stride + jj));
                for c in 0..C {
                    acc[r][c] = _mm512_fmadd_ps(wv, vv[c], acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                _mm512_mask_storeu_ps(o.add(r * hd + d0 + 16 * c), m[c], acc[r][c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernels of [`super::Kernel`]: the AVX-512 kernels' operations (module doc of `attention`)
    //! with each 16-lane vector held as two 8-lane halves `[lo, hi]` (lanes 0–7, 8–15), so every result is
    //! bit-identical to AVX-512's. Register tiles are smaller (16 registers), which changes no result.
    #![allow(clippy::needless_range_loop)] // register tiles index parallel arrays
    use super::super::avx2::lanes;
    use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};
    use std::arch::x86_64::*;

    /// A 16-lane f32 vector as two halves.
    type V16 = [__m256; 2];

    /// Lane masks of the two halves for the first `min(n, 16)` lanes (all ones where loaded).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mask(n: usize) -> [__m256i; 2] {
        let n = n.min(16);
        [lanes(n), lanes(n.saturating_sub(8))]
    }

    /// Load 16 lanes at `p`, zero where `m` is off (`_mm512_maskz_loadu_ps`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(m: &[__m256i; 2], p: *const f32) -> V16 {
        [_mm256_maskload_ps(p, m[0]), _mm256_maskload_ps(p.add(8), m[1])]
    }

    /// Store the lanes of `v` where `m` is on.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(m: &[__m256i; 2], p: *mut f32, v: V16) {
        _mm256_maskstore_ps(p, m[0], v[0]);
        _mm256_maskstore_ps(p.add(8), m[1], v[1]);
    }

    /// The canonical tree of `avx512::hsum`: `l + l+8`, then `+ l+4`, then `+ l+2`, then lane 0 + lane 1.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: V16) -> f32 {
        let s8 = _mm256_add_ps(v[0], v[1]);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        _mm_cvtss_f32(s1)
    }

    /// e^x on 8 lanes: `avx512::exp`'s steps; its `vscalefps(p, n)` as `p·2^n` with exact powers of two
    /// (`n > 127`: `p·2^(n−1)·2`; `n < −126`: `p·2^(n+64)·2^−64`, the only rounding in the last product),
    /// which rounds exactly as `vscalefps` does.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // `max`/`min` return their second operand when one is NaN, so NaN passes through.
        let x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
        // NaN lanes: `n` is NaN; its conversion gives i32::MIN, the clamps below keep the powers finite and
        // `p` (NaN) carries the NaN through the products.
        let ni = _mm256_cvtps_epi32(n);
        let pow2 = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
        let big = _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127));
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ni);
        // First factor: 2^(n−1) above 127, 2^(n+64) below −126, else 2^n; second: 2, 2^−64 or 1.
        let e1 = _mm256_add_epi32(
            ni,
            _mm256_or_si256(_mm256_and_si256(big, _mm256_set1_epi32(-1)), _mm256_and_si256(small, _mm256_set1_epi32(64))),
        );
        let e1 = _mm256_max_epi32(_mm256_set1_epi32(-126), _mm256_min_epi32(_mm256_set1_epi32(127), e1));
        let f2 = _mm256_blendv_ps(
            _mm256_blendv_ps(_mm256_set1_ps(1.0), _mm256_set1_ps(2.0), _mm256_castsi256_ps(big)),
            _mm256_set1_ps(f32::from_bits(((127 - 64) as u32) << 23)),
            _mm256_castsi256_ps(small),
        );
        _mm256_mul_ps(_mm256_mul_ps(p, pow2(e1)), f2)
    }

    /// 16 lanes of e^x (what `avx512::exp` gives on the same lanes).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp(x: V16) -> V16 {
        [exp8(x[0]), exp8(x[1])]
    }

    /// See [`super::Kernel::exp_row`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_row(row: &mut [f32]) -> f32 {
        let (n, p) = (row.len(), row.as_mut_ptr());
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut mx = [ninf; 2];
        for d in (0..n).step_by(16) {
            let k = mask(n - d);
            let x = load(&k, p.add(d));
            for h in 0..2 {
                mx[h] = _mm256_max_ps(mx[h], _mm256_blendv_ps(ninf, x[h], _mm256_castsi256_ps(k[h])));
            }
        }
        let mut a = [0f32; 16];
        _mm256_storeu_ps(a.as_mut_ptr(), mx[0]);
        _mm256_storeu_ps(a.as_mut_ptr().add(8), mx[1]);
        let m = _mm256_set1_ps(a.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
        let mut sum = [_mm256_setzero_ps(); 2];
        for d in (0..n).step_by(16) {
            let k = mask(n - d);
            let x = load(&k, p.add(d));
            let e = exp([_mm256_sub_ps(x[0], m), _mm256_sub_ps(x[1], m)]);
            store(&k, p.add(d), e);
            for h in 0..2 {
                // Masked-off lanes keep their sum (adding +0 to a sum that is never −0).
                sum[h] = _mm256_add_ps(sum[h], _mm256_and_ps(e[h], _mm256_castsi256_ps(k[h])));
            }
        }
        hsum(sum)
    }

    /// Calls `$f::<R, N>(args)` with the constants `R = $r` (1 or 2) and `N = $n` (1 or 2).
    macro_rules! tile {
        ($f:ident, $r:expr, $n:expr, $args:tt) => {
            match ($r, $n) {
                (2, 2) => $f::<2, 2> $args,
                (2, _) => $f::<2, 1> $args,
                (_, 2) => $f::<1, 2> $args,
                _ => $f::<1, 1> $args,
            }
        };
    }

    /// See [`super::Kernel::scores`]: tiles of up to 2 heads × 2 keys.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores(
        q: *const f32,
        gn: usize,
        hd: usize,
        k: *const f32,
        offs: &[usize],
        scale: f32,
        out: *mut f32,
        stride: usize,
    ) {
        super::score_tiles(gn, offs.len(), 2, |g, r, jj, nj| {
            let (qg, o, ks) = (q.add(g * hd), out.add(g * stride + jj), &offs[jj..jj + nj]);
            tile!(score_tile, r, nj, (qg, hd, k, ks, scale, o, stride));
        });
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_tile<const R: usize, const J: usize>(
        q: *const f32,
        hd: usize,
        k: *const f32,
        offs: &[usize],
        scale: f32,
        out: *mut f32,
        stride: usize,
    ) {
        let zero = [_mm256_setzero_ps(); 2];
        let mut acc = [[zero; J]; R];
        for d in (0..hd).step_by(16) {
            let m = mask(hd - d);
            let mut kv = [zero; J];
            for j in 0..J {
                kv[j] = load(&m, k.add(offs[j] + d));
            }
            for r in 0..R {
                let qv = load(&m, q.add(r * hd + d));
                for j in 0..J {
                    for h in 0..2 {
                        acc[r][j][h] = _mm256_fmadd_ps(qv[h], kv[j][h], acc[r][j][h]);
                    }
                }
            }
        }
        for r in 0..R {
            for j in 0..J {
                *out.add(r * stride + j) = hsum(acc[r][j]) * scale;
            }
        }
    }

    /// See [`super::Kernel::pv`]: tiles of up to 2 heads × 32 output elements held in registers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn pv(w: *const f32, stride: usize, gn: usize, v: *const f32, offs: &[usize], hd: usize, o: *mut f32) {
        super::pv_tiles(gn, hd, 2, |g, r, d0, chunks| {
            tile!(pv_tile, r, chunks, (w.add(g * stride), stride, v, offs, hd, d0, o.add(g * hd)));
        });
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pv_tile<const R: usize, const C: usize>(
        w: *const f32,
        stride: usize,
        v: *const f32,
        offs: &[usize],
        hd: usize,
        d0: usize,
        o: *mut f32,
    ) {
        let mut m = [[_mm256_setzero_si256(); 2]; C];
        for c in 0..C {
            m[c] = mask(hd - d0 - 16 * c);
        }
        let zero = [_mm256_setzero_ps(); 2];
        let mut acc = [[zero; C]; R];
        for r in 0..R {
            for c in 0..C {
                acc[r][c] = load(&m[c], o.add(r * hd + d0 + 16 * c));
            }
        }
        for (jj, &x) in offs.iter().enumerate() {
            let mut vv = [zero; C];
            for c in 0..C {
                vv[c] = load(&m[c], v.add(x + d0 + 16 * c));
            }
            for r in 0..R {
                let wv = _mm256_set1_ps(*w.add(r * stride + jj));
                for c in 0..C {
                    for h in 0..2 {
                        acc[r][c][h] = _mm256_fmadd_ps(wv, vv[c][h], acc[r][c][h]);
                    }
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                store(&m[c], o.add(r * hd + d0 + 16 * c), acc[r][c]);
            }
        }
    }
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
                    .map(|j| {
                        (0..hd).map(|d| q[(i * s.n_heads + h) * hd + d] as f64 * k[j * kvs + kvh * hd + d] as f64).sum::<f64>()
                            * s.scale as f64
                    })
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

    /// The kernels this CPU can run (all of them, whatever `EDDY_KERNEL` says).
    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::Kernel::Avx2.is_available() {
                k.push(Kernel::Avx2);
            }
            if super::super::Kernel::Avx512.is_available() && std::arch::is_x86_feature_detected!("fma") {
                k.push(Kernel::Avx512);
            }
        }
        k
    }

    /// Error of `got` in units in the last place of the f32 nearest `want` (subnormal ulp below 2^−126).
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = if w == 0.0 || w.abs() < f32::MIN_POSITIVE { 2f64.powi(-149) } else { 2f64.powi(w.abs().log2().floor() as i32 - 23) };
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_is_accurate_and_handles_special_values() {
        let specials = [f32::NEG_INFINITY, -1e30, -1000.0, -104.0, -103.98, -103.0, -87.5, -0.0, 0.0, -1e-30, f32::MIN_POSITIVE];
        let mut xs: Vec<f32> = (0..=2_000_000).map(|i| -100.0 * i as f32 / 2_000_000.0).collect();
        xs.extend(specials);
        xs.extend((0..1000).map(|i| 88.0 * i as f32 / 1000.0));
        for kernel in kernels() {
            let mut got = xs.clone();
            match kernel {
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512 => {
                    for c in got.chunks_mut(16) {
                        let mut a = [0f32; 16];
                        a[..c.len()].copy_from_slice(c);
                        // SAFETY: AVX-512F was detected; `a` holds 16 floats.
                        unsafe {
                            use std::arch::x86_64::*;
                            _mm512_storeu_ps(a.as_mut_ptr(), exp_avx512(_mm512_loadu_ps(a.as_ptr())));
                        }
                        let n = c.len();
                        c.copy_from_slice(&a[..n]);
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx2 => {
                    for c in got.chunks_mut(16) {
                        let mut a = [0f32; 16];
                        a[..c.len()].copy_from_slice(c);
                        // SAFETY: AVX2 + FMA were detected; `a` holds 16 floats.
                        unsafe {
                            use std::arch::x86_64::*;
                            let v = avx2::exp([_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(a.as_ptr().add(8))]);
                            _mm256_storeu_ps(a.as_mut_ptr(), v[0]);
                            _mm256_storeu_ps(a.as_mut_ptr().add(8), v[1]);
                        }
                        let n = c.len();
                        c.copy_from_slice(&a[..n]);
                    }
                }
                Kernel::Portable => got.iter_mut().for_each(|x| *x = exp_portable(*x)),
            }
            if kernel != Kernel::Portable {
                // NaN stays NaN, and past the top of the range e^x is +inf, as for `exp_portable`.
                // e^88.5 ≈ 2.7e38 needs 2^128 (n = 128), a power of two past f32's exponent range.
                let mut special = [f32::NAN, 100.0, 88.5, -0.0];
                special.iter_mut().for_each(|x| *x = exp_lanes(kernel, *x));
                assert!(special[0].is_nan() && special[1] == f32::INFINITY, "{kernel:?}: {special:?}");
                assert!(special[2].is_finite() && ulps(special[2], 88.5f64.exp()) <= 2.0, "{kernel:?}: e^88.5 = {}", special[2]);
                assert_eq!(special[3], 1.0, "{kernel:?}: e^-0");
            }
            let mut worst = (0f64, 0f32);
            for (&x, &y) in xs.iter().zip(&got) {
                let e = ulps(y, (x as f64).exp());
                if e > worst.0 {
                    worst = (e, x);
                }
            }
            assert!(worst.0 <= 2.0, "{kernel:?}: {} ulp at {}", worst.0, worst.1);
            let at = |x: f32| got[xs.iter().position(|&v| v.to_bits() == x.to_bits()).unwrap()];
            for x in [f32::NEG_INFINITY, -1e30, -1000.0, -104.0] {
                assert_eq!(at(x).to_bits(), 0, "{kernel:?}: exp({x})");
            }
            assert_eq!(at(0.0), 1.0);
            assert_eq!(at(-0.0), 1.0);
            assert_eq!(at(-1e-30), 1.0);
            if kernel == Kernel::Portable {
                assert!(exp_portable(f32::NAN).is_nan() && exp_portable(100.0) == f32::INFINITY);
            }
        }
    }

    /// e^x of one value on `kernel`'s vector exp (lane 0 of a register of `x`).
    fn exp_lanes(kernel: Kernel, x: f32) -> f32 {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only called for kernels in `kernels()`, whose features were detected.
            Kernel::Avx512 => unsafe {
                use std::arch::x86_64::*;
                _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(x))))
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Avx2 => unsafe {
                use std::arch::x86_64::*;
                _mm_cvtss_f32(_mm256_castps256_ps128(avx2::exp([_mm256_set1_ps(x); 2])[0]))
            },
            Kernel::Portable => exp_portable(x),
        }
    }

    /// The AVX2 kernels give the AVX-512 kernels' bits: e^x on every f32 bit pattern of a grid over the
    /// whole range (subnormal results, the overflow edge, NaN, ±inf) and attention (causal with window
    /// and soft-capping, trees, blocks; head sizes that leave partial 16-lane chunks) on random inputs.
    /// Needs both paths (an AVX-512 CPU); on an AVX2-only CPU the other tests hold AVX2 to the reference.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_is_bit_identical_to_avx512() {
        let ks = kernels();
        if !ks.contains(&Kernel::Avx512) || !ks.contains(&Kernel::Avx2) {
            eprintln!("skipped: needs AVX-512 and AVX2");
            return;
        }
        for bits in (0..=u32::MAX).step_by(4099).chain([0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xc2cf_ffff, 0x42b1_7218]) {
            let x = f32::from_bits(bits);
            let (a, b) = (exp_lanes(Kernel::Avx2, x), exp_lanes(Kernel::Avx512, x));
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "e^{x:e} ({bits:#x}): {a:e} vs {b:e}");
        }
        let pool = ThreadPool::new(2);
        let mut seed = 13u32;
        for (n_heads, n_kv_heads, head_dim) in [(6, 2, 72), (4, 1, 128), (2, 2, 8), (8, 2, 256)] {
            for (window, softcap) in [(None, None), (Some(33), Some(2.0))] {
                let s = AttnShape { n_heads, n_kv_heads, head_dim, scale: 1.5 / (head_dim as f32).sqrt(), window, softcap };
                let (qs, kvs) = (n_heads * head_dim, n_kv_heads * head_dim);
                let (n_past, t) = (57, 21);
                let q = random(t * qs, &mut seed);
                let k = random((n_past + t) * kvs, &mut seed);
                let v = random((n_past + t) * kvs, &mut seed);
                let parents: Vec<usize> = (0..t).map(|i| if i == 0 { crate::tree::NO_PARENT } else { (i * 7 + 3) % i }).collect();
                let paths = TreePaths::new(&parents).unwrap();
                for vis in [Visibility::Causal, Visibility::Tree { first: 0, paths: &paths }, Visibility::Block { rows: n_past + t }] {
                    let mut out = [vec![0f32; t * qs], vec![0f32; t * qs]];
                    for (o, kernel) in out.iter_mut().zip([Kernel::Avx2, Kernel::Avx512]) {
                        attention_with(kernel, &pool, &s, &q, &k, &v, n_past, t, vis, o);
                    }
                    let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(bits(&out[0]) == bits(&out[1]), "{s:?} {vis:?}");
                }
            }
        }
    }

    /// f64 attention of each query over the cache rows it sees (`rows[i]`, in position order).
    fn reference_rows(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32], rows: &[Vec<usize>]) -> Vec<f64> {
        let hd = s.head_dim;
        let kvs = s.n_kv_heads * hd;
        let mut out = vec![0f64; rows.len() * s.n_heads * hd];
        for (i, rows) in rows.iter().enumerate() {
            for h in 0..s.n_heads {
                let kvh = h / (s.n_heads / s.n_kv_heads);
                let qh = &q[(i * s.n_heads + h) * hd..][..hd];
                let sc: Vec<f64> = rows
                    .iter()
                    .map(|&r| {
                        let x = (0..hd).map(|d| qh[d] as f64 * k[r * kvs + kvh * hd + d] as f64).sum::<f64>() * s.scale as f64;
                        s.softcap.map_or(x, |c| c as f64 * (x / c as f64).tanh())
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&r, e) in rows.iter().zip(&e) {
                    for d in 0..hd {
                        out[(i * s.n_heads + h) * hd + d] += e / z * v[r * kvs + kvh * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    fn random(n: usize, seed: &mut u32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                (*seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        for (idx, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((*a as f64 - b).abs() < 2e-5, "{what}: element {idx}: {a} vs {b}");
        }
    }

    /// Causal batches of every size from 1 to 70 starting at various `n_past`, split into sub-batches
    /// across query-block boundaries, on 1–4 threads, are bit-identical to one batch of 70 and close to f64.
    #[test]
    fn causal_batches_are_bit_identical_across_blocks() {
        let pools: Vec<ThreadPool> = (1..=4).map(ThreadPool::new).collect();
        let mut seed = 7u32;
        for kernel in kernels() {
            for (n_heads, n_kv_heads, head_dim) in [(6, 2, 72), (4, 1, 128)] {
                for (window, softcap) in [(None, None), (Some(40), None), (None, Some(2.0)), (Some(131), Some(3.0))] {
                    let s = AttnShape { n_heads, n_kv_heads, head_dim, scale: 2.0 / (head_dim as f32).sqrt(), window, softcap };
                    let (qs, kvs) = (n_heads * head_dim, n_kv_heads * head_dim);
                    for n_past in [0, 45, 300] {
                        let t = 70;
                        let q = random(t * qs, &mut seed);
                        let k = random((n_past + t) * kvs, &mut seed);
                        let v = random((n_past + t) * kvs, &mut seed);
                        let mut full = vec![0f32; t * qs];
                        attention_with(kernel, &pools[1], &s, &q, &k, &v, n_past, t, Visibility::Causal, &mut full);
                        let rows: Vec<Vec<usize>> = (0..t)
                            .map(|i| {
                                let pos = n_past + i;
                                (window.map_or(0, |w| (pos + 1).saturating_sub(w))..=pos).collect()
                            })
                            .collect();
                        let what = format!("{kernel:?} {s:?} n_past {n_past}");
                        assert_close(&full, &reference_rows(&s, &q, &k, &v, &rows), &what);
                        // Prefixes of every length, then the rest split at ragged points.
                        for (c, len) in (1..=t).enumerate() {
                            let mut part = vec![0f32; len * qs];
                            attention_with(kernel, &pools[c % 4], &s, &q, &k, &v, n_past, len, Visibility::Causal, &mut part);
                            assert!(part == full[..len * qs], "{what}: prefix of {len}");
                        }
                        let mut i = 0;
                        for (c, len) in [1, 3, 17, 5, 16, 28].into_iter().enumerate() {
                            let mut part = vec![0f32; len * qs];
                            let qp = &q[i * qs..(i + len) * qs];
                            attention_with(kernel, &pools[c % 4], &s, qp, &k, &v, n_past + i, len, Visibility::Causal, &mut part);
                            assert!(part == full[i * qs..(i + len) * qs], "{what}: queries {i}..{}", i + len);
                            i += len;
                        }
                    }
                }
            }
        }
    }

    /// A block of queries that all see the same rows (DFlash's draft block): close to f64 with those rows,
    /// and each query bit-identical to one causal query at the last visible position, on 1–4 threads.
    #[test]
    fn block_queries_see_every_row() {
        let pools: Vec<ThreadPool> = (1..=4).map(ThreadPool::new).collect();
        let mut seed = 5u32;
        for kernel in kernels() {
            let s = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 32, scale: 0.2, window: None, softcap: None };
            let (qs, kvs) = (4 * 32, 2 * 32);
            for (rows, t) in [(16, 16), (53, 16), (7, 3)] {
                let q = random(t * qs, &mut seed);
                let k = random(rows * kvs, &mut seed);
                let v = random(rows * kvs, &mut seed);
                let mut all = vec![0f32; t * qs];
                attention_with(kernel, &pools[1], &s, &q, &k, &v, 0, t, Visibility::Block { rows }, &mut all);
                let want_rows: Vec<Vec<usize>> = (0..t).map(|_| (0..rows).collect()).collect();
                assert_close(&all, &reference_rows(&s, &q, &k, &v, &want_rows), &format!("{kernel:?} block {rows}/{t}"));
                for i in 0..t {
                    let mut one = vec![0f32; qs];
                    let qi = &q[i * qs..(i + 1) * qs];
                    attention_with(kernel, &pools[i % 4], &s, qi, &k, &v, rows - 1, 1, Visibility::Causal, &mut one);
                    assert!(one == all[i * qs..(i + 1) * qs], "{kernel:?}: block query {i} vs a causal query");
                }
            }
        }
    }

    /// A token tree verified in one batch, node by node, or as a slice gives each node the bits plain
    /// decoding computes at its position with its ancestors' K/V laid out as a chain.
    #[test]
    fn tree_nodes_match_decoding_their_path() {
        let pools: Vec<ThreadPool> = (1..=4).map(ThreadPool::new).collect();
        let mut seed = 11u32;
        for kernel in kernels() {
            for (window, softcap) in [(None, None), (Some(60), Some(2.5))] {
                let s = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 64, scale: 0.25, window, softcap };
                let (qs, kvs) = (6 * 64, 2 * 64);
                let nodes = 45;
                let parents: Vec<usize> = (0..nodes)
                    .map(|i| {
                        let r = random(1, &mut seed)[0];
                        if i == 0 {
                            crate::tree::NO_PARENT
                        } else {
                            ((r + 1.0) * 0.5 * i as f32) as usize % i
                        }
                    })
                    .collect();
                let paths = TreePaths::new(&parents).unwrap();
                for n_past in [0, 100] {
                    let q = random(nodes * qs, &mut seed);
                    let k = random((n_past + nodes) * kvs, &mut seed);
                    let v = random((n_past + nodes) * kvs, &mut seed);
                    let mut full = vec![0f32; nodes * qs];
                    let vis = Visibility::Tree { first: 0, paths: &paths };
                    attention_with(kernel, &pools[1], &s, &q, &k, &v, n_past, nodes, vis, &mut full);
                    let rows: Vec<Vec<usize>> = (0..nodes)
                        .map(|i| {
                            let p = paths.path(i);
                            let all: Vec<usize> = (0..n_past).chain(p.iter().map(|&x| n_past + x as usize)).collect();
                            let lo = window.map_or(0, |w| all.len().saturating_sub(w));
                            all[lo..].to_vec()
                        })
                        .collect();
                    let what = format!("{kernel:?} window {window:?} n_past {n_past}");
                    assert_close(&full, &reference_rows(&s, &q, &k, &v, &rows), &what);
                    let mut part = vec![0f32; 20 * qs];
                    let vis = Visibility::Tree { first: 10, paths: &paths };
                    attention_with(kernel, &pools[2], &s, &q[10 * qs..], &k, &v, n_past, 20, vis, &mut part);
                    assert!(part == full[10 * qs..30 * qs], "{what}: nodes 10..30");
                    for i in 0..nodes {
                        let qi = &q[i * qs..(i + 1) * qs];
                        let pool = &pools[i % 4];
                        let mut one = vec![0f32; qs];
                        attention_with(kernel, pool, &s, qi, &k, &v, n_past, 1, Visibility::Tree { first: i, paths: &paths }, &mut one);
                        assert!(one == full[i * qs..(i + 1) * qs], "{what}: node {i} alone");
                        // The same node decoded as a chain: its ancestors' K/V at consecutive rows.
                        let p = paths.path(i);
                        let (mut kc, mut vc) = (k[..n_past * kvs].to_vec(), v[..n_past * kvs].to_vec());
                        for &x in p {
                            let r = (n_past + x as usize) * kvs;
                            kc.extend_from_slice(&k[r..r + kvs]);
                            vc.extend_from_slice(&v[r..r + kvs]);
                        }
                        let mut dec = vec![0f32; qs];
                        attention_with(kernel, pool, &s, qi, &kc, &vc, n_past + p.len() - 1, 1, Visibility::Causal, &mut dec);
                        assert!(dec == one, "{what}: node {i} vs decoding its path");
                    }
                }
            }
        }
    }
}
