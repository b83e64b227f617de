//! Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"; the Qwen3.5 / Qwen3-Next linear
//! attention layers): the causal depthwise conv, the q/k/g/β preparation, the recurrent (decode) form, the
//! chunked WY/UT (prefill) form, its ancestor-masked generalisation to token trees, the state commit, and
//! the gated RMSNorm. Math and notation: `docs/qwen35.md` and `docs/gated-deltanet.md`;
//! the reference is transformers' `modeling_qwen3_5.py` (`torch_recurrent_gated_delta_rule`,
//! `torch_chunk_gated_delta_rule`, `causal_conv1d_*`, `Qwen3_5RMSNormGated`).
//!
//! Layouts (all f32, row-major):
//! - pre-conv stream `x` and post-conv stream `c`: `n × conv_dim`, channels `[q (all key heads) | k (all key
//!   heads) | v (all value heads)]`, each head contiguous;
//! - conv weights `conv_dim × K`; conv state `(K−1) × conv_dim`, the last `K−1` *pre-conv* inputs, oldest first;
//! - recurrent state `S`: `n_v_heads × d_k × d_v` (per value head, `S[m][j]`, row = key index), fp32;
//! - per-node scalars `g`, `β`, `γ`: `n × n_v_heads`; outputs and `ũ`: `n × n_v_heads·d_v`.
//!
//! Per token and value head h (key head κ(h)): `S̄ = e^g·S`, `ũ = β(v − S̄ᵀk)`, `S ← S̄ + k ũᵀ`, `o = Sᵀq` (read
//! after the write). Value head h uses key head `h / r` (transformers' `repeat_interleave`, "grouped") or
//! `h mod n_k_heads` (llama.cpp GGUF files, "tiled"), see [`GdnShape::v_tiled`].
//!
//! The masked WY solve ([`wy_outputs`]) handles a chain (chunked prefill) and a tree (verification) alike:
//! nodes in topological order with `parents[0] = usize::MAX` and `parents[i] < i`; with path-cumulative log
//! decays `γ_i = g_i + γ_parent(i)`, for every node
//! `ũ_i = β_i(v_i − e^{γ_i} S₀ᵀk_i) − Σ_{j≺i} β_i e^{γ_i−γ_j}(k_i·k_j) ũ_j` (forward substitution over proper
//! ancestors j) and `o_i = e^{γ_i} S₀ᵀq_i + Σ_{j⪯i} e^{γ_i−γ_j}(q_i·k_j) ũ_j`; `S₀` is only read. Committing a
//! root path P ending at node n ([`apply_path`]) is `S ← e^{γ_n} S₀ + Σ_{j∈P} e^{γ_n−γ_j} k_j ũ_jᵀ`. Every
//! exponent is ≤ 0, so nothing overflows. A per-branch sequential recurrence ([`tree_reference`]) is the
//! test oracle.

use super::{Kernel, SyncPtr, ThreadPool};
use std::cell::RefCell;

/// Shape of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    /// Query/key heads (`linear_num_key_heads`).
    pub n_k_heads: usize,
    /// Value heads (`linear_num_value_heads`, a multiple of `n_k_heads`).
    pub n_v_heads: usize,
    /// Key head dimension (`linear_key_head_dim`).
    pub d_k: usize,
    /// Value head dimension (`linear_value_head_dim`).
    pub d_v: usize,
    /// Conv kernel width (`linear_conv_kernel_dim`, 4).
    pub kernel: usize,
    /// Value heads are tiled over key heads (llama.cpp order: head h uses key head `h mod n_k_heads`) instead
    /// of grouped (transformers order: `h / (n_v_heads / n_k_heads)`).
    pub v_tiled: bool,
}

impl GdnShape {
    /// `n_k_heads · d_k`.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.d_k
    }
    /// `n_v_heads · d_v`.
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.d_v
    }
    /// Channels of the conv stream: `2·key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 values of one recurrent state: `n_v_heads · d_k · d_v`.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.d_k * self.d_v
    }
    /// f32 values of one conv state: `(kernel − 1) · conv_dim`.
    pub fn conv_state_len(&self) -> usize {
        (self.kernel - 1) * self.conv_dim()
    }
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.v_tiled {
            h % self.n_k_heads
        } else {
            h / (self.n_v_heads / self.n_k_heads)
        }
    }
    /// Problem with the shape, in words.
    pub fn check(&self) -> Result<(), String> {
        if self.n_k_heads == 0
            || !self.n_v_heads.is_multiple_of(self.n_k_heads)
            || self.d_k == 0
            || self.d_v == 0
            || self.kernel < 1
            || self.kernel > MAX_CONV_KERNEL
        {
            return Err(format!(
                "inconsistent Gated DeltaNet shape: {} key heads, {} value heads, d_k {}, d_v {}, conv kernel {}",
                self.n_k_heads, self.n_v_heads, self.d_k, self.d_v, self.kernel
            ));
        }
        Ok(())
    }
}

/// The ancestors of `node` from its parent upwards (at most `max`), per the tree convention above.
fn ancestors(parents: &[usize], node: usize, max: usize) -> impl Iterator<Item = usize> + '_ {
    let mut cur = parents[node];
    std::iter::from_fn(move || {
        if cur == usize::MAX {
            return None;
        }
        let n = cur;
        cur = parents[n];
        Some(n)
    })
    .take(max)
}

/// Whether `parents` is a valid tree in topological order (`parents[0] = usize::MAX`, `parents[i] < i`).
pub fn check_parents(parents: &[usize]) -> Result<(), String> {
    for (i, &p) in parents.iter().enumerate() {
        let ok = if i == 0 { p == usize::MAX } else { p < i };
        if !ok {
            return Err(format!("bad tree: parents[{i}] = {p} (need parents[0] = usize::MAX and parents[i] < i)"));
        }
    }
    Ok(())
}

/// Chain parents `[MAX, 0, 1, …, n−2]`.
pub fn chain_parents(n: usize) -> Vec<usize> {
    (0..n).map(|i| if i == 0 { usize::MAX } else { i - 1 }).collect()
}

/// Longest conv kernel [`conv_silu`] takes (Qwen3.5 uses 4; the loaders refuse longer ones).
pub const MAX_CONV_KERNEL: usize = 8;

/// Causal depthwise conv + SiLU over a tree (a chain is the tree `chain_parents(n)`):
/// `c_i[ch] = silu(Σ_{m<K} w[ch][m] · in_{i,m}[ch])` with `in_{i,K−1} = x_i`, `in_{i,K−2} = x_parent(i)`, …,
/// continuing into `conv_state` (its newest row first) once the ancestor chain passes the root.
///
/// `w_taps`: the weights tap-major, `K × conv_dim` (`w_taps[m][ch] = w[ch][m]`, see [`conv_taps`]);
/// `conv_state`: `(K−1) × conv_dim` (read only); `x`, `out`: `n × conv_dim`.
pub fn conv_silu(w_taps: &[f32], kernel: usize, conv_state: &[f32], x: &[f32], parents: &[usize], out: &mut [f32]) {
    let cd = w_taps.len() / kernel;
    let n = parents.len();
    assert!(x.len() >= n * cd && out.len() >= n * cd && conv_state.len() >= (kernel - 1) * cd);
    // srcs[..kernel] feed the taps, newest first until reversed (no allocation: kernels are short).
    assert!(kernel <= MAX_CONV_KERNEL, "conv kernel {kernel} > {MAX_CONV_KERNEL}");
    let mut srcs: [&[f32]; MAX_CONV_KERNEL] = [&[]; MAX_CONV_KERNEL];
    for i in 0..n {
        // srcs[m] feeds tap m (m = K−1 is the node itself).
        srcs[0] = &x[i * cd..(i + 1) * cd];
        let mut len = 1;
        for a in ancestors(parents, i, kernel - 1) {
            srcs[len] = &x[a * cd..(a + 1) * cd];
            len += 1;
        }
        let mut row = kernel - 1;
        while len < kernel {
            row -= 1;
            srcs[len] = &conv_state[row * cd..(row + 1) * cd];
            len += 1;
        }
        let srcs = &mut srcs[..kernel];
        srcs.reverse();
        let o = &mut out[i * cd..(i + 1) * cd];
        o.fill(0.0);
        for (m, src) in srcs.iter().enumerate() {
            for ((oc, &wv), &xv) in o.iter_mut().zip(&w_taps[m * cd..(m + 1) * cd]).zip(src.iter()) {
                *oc += wv * xv;
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
}

/// Conv weights from channel-major (`conv_dim × K`, as stored by transformers and llama.cpp) to tap-major
/// (`K × conv_dim`), the layout [`conv_silu`] reads.
pub fn conv_taps(w: &[f32], kernel: usize) -> Vec<f32> {
    let cd = w.len() / kernel;
    (0..kernel * cd).map(|i| w[(i % cd) * kernel + i / cd]).collect()
}

/// The conv window after accepting `path` (node indices; a root path): the last `K−1` rows of
/// `conv_state ++ x[path]`, written back into `conv_state` (`(K−1) × conv_dim`).
pub fn conv_commit(conv_state: &mut [f32], conv_dim: usize, kernel: usize, x: &[f32], path: &[usize]) {
    let keep = kernel - 1;
    if keep == 0 || path.is_empty() {
        return;
    }
    // The window is the last `keep` rows of `conv_state ++ x[path]`: the state's rows shift up by
    // `path.len()` (when any survive), then the path's last rows fill the tail. In place.
    let from_path = path.len().min(keep);
    let from_state = keep - from_path;
    conv_state.copy_within((keep - from_state) * conv_dim..keep * conv_dim, 0);
    for (r, &p) in path[path.len() - from_path..].iter().enumerate() {
        conv_state[(from_state + r) * conv_dim..(from_state + r + 1) * conv_dim].copy_from_slice(&x[p * conv_dim..(p + 1) * conv_dim]);
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
fn softplus(x: f32) -> f32 {
    // PyTorch's softplus with β = 1, threshold 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[inline]
fn l2_normalize(x: &mut [f32], scale: f32) {
    let s: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (s + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// In place on the post-conv stream `c` (`n × conv_dim`): L2-normalise every q and k head
/// (`x·(Σx² + 1e-6)^−½`), then scale q by `d_k^−½`. And per node and value head: `a ← g = a_neg·softplus(a +
/// dt_bias)` (`a_neg = −exp(A_log)`), `b ← β = σ(b)`; `a`, `b` are `n × n_v_heads`.
pub fn prepare(s: &GdnShape, c: &mut [f32], a: &mut [f32], b: &mut [f32], a_neg: &[f32], dt_bias: &[f32], n: usize) {
    let (cd, kd, dk, hv) = (s.conv_dim(), s.key_dim(), s.d_k, s.n_v_heads);
    let q_scale = 1.0 / (dk as f32).sqrt();
    for i in 0..n {
        let row = &mut c[i * cd..(i + 1) * cd];
        for (j, head) in row[..2 * kd].chunks_exact_mut(dk).enumerate() {
            l2_normalize(head, if j < s.n_k_heads { q_scale } else { 1.0 });
        }
        for h in 0..hv {
            let ai = &mut a[i * hv + h];
            *ai = a_neg[h] * softplus(*ai + dt_bias[h]);
            let bi = &mut b[i * hv + h];
            *bi = 1.0 / (1.0 + (-*bi).exp());
        }
    }
}

/// Views of one node's q (`d_k`), k (`d_k`), v (`d_v`) for value head `h` in a post-conv row.
#[inline]
fn qkv<'a>(s: &GdnShape, row: &'a [f32], h: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
    let (kd, dk, dv) = (s.key_dim(), s.d_k, s.d_v);
    let kh = s.key_head(h);
    (&row[kh * dk..(kh + 1) * dk], &row[kd + kh * dk..kd + (kh + 1) * dk], &row[2 * kd + h * dv..2 * kd + (h + 1) * dv])
}

/// Defines `$name` that runs `$body::<true>` (an `#[inline(always)]` fn generic over `const FMA: bool`)
/// compiled for AVX-512 or AVX2+FMA when the CPU has them (fixed 16-lane loops then vectorize with wide
/// registers and fused multiply-adds), else `$body::<false>` for the baseline target (separate mul and add,
/// as `mul_add` without FMA hardware is a slow library call).
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident => $body:ident ($($arg:ident : $ty:ty),*)) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    #[target_feature(enable = "avx512f,avx2,fma")]
                    #[allow(clippy::too_many_arguments)]
                    unsafe fn wide($($arg: $ty),*) {
                        $body::<true>($($arg),*)
                    }
                    // SAFETY: the features were detected at run time.
                    return unsafe { wide($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    #[target_feature(enable = "avx2,fma")]
                    #[allow(clippy::too_many_arguments)]
                    unsafe fn narrow($($arg: $ty),*) {
                        $body::<true>($($arg),*)
                    }
                    // SAFETY: the features were detected at run time.
                    return unsafe { narrow($($arg),*) };
                }
            }
            $body::<false>($($arg),*)
        }
    };
}

/// Column block of the state processed in registers.
const LANES: usize = 16;

/// `acc + a·b`, fused where the hardware has FMA.
#[inline(always)]
fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

#[inline(always)]
fn axpy_f<const FMA: bool>(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FMA>(*y, a, x);
    }
}

#[inline(always)]
fn dot_f<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(acc[l], x[l], y[l]);
        }
    }
    let mut s: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    for v in acc {
        s += v;
    }
    s
}

multiversion! {
    /// `out[x] = Sᵀ xs[x]` for `nx` vectors: `st` is `dk × dv`, `xs` is `nx × dk`, `out` is `nx × dv`.
    pub fn state_t_times => state_t_times_body(st: &[f32], dk: usize, dv: usize, xs: &[f32], nx: usize, out: &mut [f32])
}

#[inline(always)]
fn state_t_times_body<const FMA: bool>(st: &[f32], dk: usize, dv: usize, xs: &[f32], nx: usize, out: &mut [f32]) {
    assert!(st.len() >= dk * dv && xs.len() >= nx * dk && out.len() >= nx * dv);
    if dv.is_multiple_of(2 * LANES) {
        state_t_times_blocked::<FMA, 2>(st, dk, dv, xs, nx, out);
    } else if dv.is_multiple_of(LANES) {
        state_t_times_blocked::<FMA, 1>(st, dk, dv, xs, nx, out);
    } else {
        for x in 0..nx {
            let o = &mut out[x * dv..(x + 1) * dv];
            o.fill(0.0);
            for m in 0..dk {
                axpy_f::<FMA>(o, xs[x * dk + m], &st[m * dv..(m + 1) * dv]);
            }
        }
    }
}

/// Groups of four vectors, then single ones, times `CH` column blocks of 16.
#[inline(always)]
fn state_t_times_blocked<const FMA: bool, const CH: usize>(st: &[f32], dk: usize, dv: usize, xs: &[f32], nx: usize, out: &mut [f32]) {
    let four = nx / 4 * 4;
    for x0 in (0..four).step_by(4) {
        state_t_times_group::<FMA, CH, 4>(st, dk, dv, xs, x0, out);
    }
    for x0 in four..nx {
        state_t_times_group::<FMA, CH, 1>(st, dk, dv, xs, x0, out);
    }
}

/// Vectors `x0..x0+NV` × `CH` column blocks of 16 per step: `NV·CH` independent accumulators share each load.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn state_t_times_group<const FMA: bool, const CH: usize, const NV: usize>(
    st: &[f32],
    dk: usize,
    dv: usize,
    xs: &[f32],
    x0: usize,
    out: &mut [f32],
) {
    for jc in (0..dv).step_by(CH * LANES) {
        let mut acc = [[[0f32; LANES]; CH]; NV];
        for m in 0..dk {
            let rows: [&[f32; LANES]; CH] = std::array::from_fn(|c| st[m * dv + jc + c * LANES..][..LANES].try_into().unwrap());
            for v in 0..NV {
                let cv = xs[(x0 + v) * dk + m];
                for c in 0..CH {
                    for l in 0..LANES {
                        acc[v][c][l] = madd::<FMA>(acc[v][c][l], cv, rows[c][l]);
                    }
                }
            }
        }
        for v in 0..NV {
            for c in 0..CH {
                let o = (x0 + v) * dv + jc + c * LANES;
                out[o..o + LANES].copy_from_slice(&acc[v][c]);
            }
        }
    }
}

multiversion! {
    /// `S ← alpha·S + Σ_p ks[p] us[p]ᵀ` (coefficients folded into `ks`): `st` is `dk × dv`, `ks` is `np × dk`,
    /// `us` is `np × dv`.
    pub fn state_rank_update => state_rank_update_body(st: &mut [f32], dk: usize, dv: usize, alpha: f32, ks: &[f32], us: &[f32], np: usize)
}

#[inline(always)]
fn state_rank_update_body<const FMA: bool>(st: &mut [f32], dk: usize, dv: usize, alpha: f32, ks: &[f32], us: &[f32], np: usize) {
    assert!(st.len() >= dk * dv && ks.len() >= np * dk && us.len() >= np * dv);
    // Row by row: the row (d_v values) stays in L1 while each rank-1 term is added with independent lanes.
    for m in 0..dk {
        let row = &mut st[m * dv..(m + 1) * dv];
        row.iter_mut().for_each(|v| *v *= alpha);
        for p in 0..np {
            axpy_f::<FMA>(row, ks[p * dk + m], &us[p * dv..(p + 1) * dv]);
        }
    }
}

/// `out = xs·b` ([`state_t_times`]'s contract: `b` is `dk × nc`, `xs` is `nx × dk`, `out` is `nx × nc`) on
/// `kernel`'s path.
#[allow(clippy::too_many_arguments)]
fn gemm(kernel: Kernel, b: &[f32], dk: usize, nc: usize, xs: &[f32], nx: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the caller checked that the path is available (avx512f).
        return unsafe { simd::gemm(b, dk, nc, xs, nx, out) };
    }
    let _ = kernel;
    state_t_times(b, dk, nc, xs, nx, out)
}

/// [`state_rank_update`] on `kernel`'s path.
#[allow(clippy::too_many_arguments)]
fn rank_update(kernel: Kernel, st: &mut [f32], dk: usize, dv: usize, alpha: f32, ks: &[f32], us: &[f32], np: usize) {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the caller checked that the path is available (avx512f).
        return unsafe { simd::rank_update(st, dk, dv, alpha, ks, us, np) };
    }
    let _ = kernel;
    state_rank_update(st, dk, dv, alpha, ks, us, np)
}

/// One decode step of one value head, in place (`S₀` = `st` before the call): `ũ = β(v − α·S₀ᵀk)`,
/// `S ← α·S₀ + k ũᵀ` and `o = S_newᵀq`, computed as `α·S₀ᵀq + (q·k)·ũ` so that one read pass yields both
/// products (§1.5 rearranged). `scratch`: `2·dk + 3·dv` values (portable path only).
#[allow(clippy::too_many_arguments)]
fn decode_head(
    kernel: Kernel,
    st: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: f32,
    beta: f32,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let qk = dot_f::<false>(q, k);
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the caller checked that the path is available (avx512f).
        return unsafe { simd::decode_head(st, dk, dv, q, k, v, alpha, beta, qk, out) };
    }
    let (xs, rest) = scratch.split_at_mut(2 * dk);
    let (kq, rest) = rest.split_at_mut(2 * dv);
    let u = &mut rest[..dv];
    xs[..dk].copy_from_slice(k);
    xs[dk..].copy_from_slice(q);
    gemm(kernel, st, dk, dv, xs, 2, kq);
    for j in 0..dv {
        u[j] = beta * (v[j] - alpha * kq[j]);
        out[j] = alpha * kq[dv + j] + qk * u[j];
    }
    rank_update(kernel, st, dk, dv, alpha, k, u, 1);
}

multiversion! {
    /// The ancestor phase of one value head of [`wy_outputs`], given the state products: `kqs` holds
    /// `S₀ᵀk_i, S₀ᵀq_i` (`2n × dv`), `gram` holds `k_i·k_j, q_i·k_j` for all j (`2n × n`), `vs` the values
    /// (`n × dv`), `gam`/`eg`/`bet` the node's γ, e^g and β. Forward substitution over each node's ancestors
    /// (decays `e^{γ_i−γ_j}` as running products of e^g up the path, no exp per pair); writes `us` (ũ) and
    /// `os` (outputs), `n × dv` each; `coef` is scratch (`2n`).
    fn wy_solve => wy_solve_body(kernel: Kernel, dv: usize, parents: &[usize], kqs: &[f32], gram: &[f32], vs: &[f32], gam: &[f32], eg: &[f32], bet: &[f32], us: &mut [f32], os: &mut [f32], coef: &mut [f32])
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn wy_solve_body<const FMA: bool>(
    kernel: Kernel,
    dv: usize,
    parents: &[usize],
    kqs: &[f32],
    gram: &[f32],
    vs: &[f32],
    gam: &[f32],
    eg: &[f32],
    bet: &[f32],
    us: &mut [f32],
    os: &mut [f32],
    coef: &mut [f32],
) {
    let n = parents.len();
    let (cu, co) = coef[..2 * n].split_at_mut(n);
    for i in 0..n {
        let (b, egi) = (bet[i], gam[i].exp());
        let (kk, qk) = (&gram[2 * i * n..(2 * i + 1) * n], &gram[(2 * i + 1) * n..(2 * i + 2) * n]);
        // Coefficients of the ancestors in walk order (parent first): ũ_i −= β_i·decay·(k_i·k_a)·ũ_a and
        // o_i += decay·(q_i·k_a)·ũ_a, decay = e^{γ_i − γ_a}: e^{g_i} for the parent, times e^{g_a} per step further
        // up; the walk stops where it underflows.
        let (mut a, mut decay, mut na) = (parents[i], eg[i], 0);
        while a != usize::MAX && decay >= f32::MIN_POSITIVE {
            (cu[na], co[na]) = (-b * decay * kk[a], decay * qk[a]);
            na += 1;
            decay *= eg[a];
            a = parents[a];
        }
        let (sk, sq) = (&kqs[2 * i * dv..(2 * i + 1) * dv], &kqs[(2 * i + 1) * dv..(2 * i + 2) * dv]);
        let oi = &mut os[i * dv..(i + 1) * dv];
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Avx512 {
            // SAFETY: the caller checked that the path is available (avx512f).
            unsafe { simd::solve_node(dv, parents, i, na, &cu[..na], &co[..na], b, egi, qk[i], &vs[i * dv..(i + 1) * dv], sk, sq, us, oi) };
            continue;
        }
        let _ = kernel;
        let (done, rest) = us.split_at_mut(i * dv);
        let ui = &mut rest[..dv];
        for j in 0..dv {
            ui[j] = b * (vs[i * dv + j] - egi * sk[j]);
            oi[j] = egi * sq[j];
        }
        let mut a = parents[i];
        for t in 0..na {
            for ((u, o), &ua) in ui.iter_mut().zip(oi.iter_mut()).zip(&done[a * dv..(a + 1) * dv]) {
                *u = madd::<FMA>(*u, cu[t], ua);
                *o = madd::<FMA>(*o, co[t], ua);
            }
            a = parents[a];
        }
        axpy_f::<FMA>(oi, qk[i], ui);
    }
}

/// Per-thread scratch of the GDN kernels (grown, never shrunk: no allocation per call once warm).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|sc| {
        let mut sc = sc.borrow_mut();
        if sc.len() < len {
            sc.resize(len, 0.0);
        }
        f(&mut sc[..len])
    })
}

/// Recurrent (decode) form over `n` consecutive tokens, updating `state` in place: per value head and token,
/// `S̄ = e^g S`, `ũ = β(v − S̄ᵀk)`, `S = S̄ + k ũᵀ`, `out = Sᵀq`. `c`: prepared stream (`n × conv_dim`); `g`, `beta`:
/// `n × n_v_heads`; `out`: `n × value_dim`. Parallel over value heads; each step reads the head's state once
/// and writes it once (see `decode_head`).
#[allow(clippy::too_many_arguments)]
pub fn recurrent(pool: &ThreadPool, s: &GdnShape, state: &mut [f32], c: &[f32], g: &[f32], beta: &[f32], n: usize, out: &mut [f32]) {
    recurrent_with(Kernel::active(), pool, s, state, c, g, beta, n, out)
}

/// [`recurrent`] on a given kernel path (which must be available on this CPU).
#[allow(clippy::too_many_arguments)]
pub fn recurrent_with(
    kernel: Kernel,
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let (cd, dk, dv, hv, vd) = (s.conv_dim(), s.d_k, s.d_v, s.n_v_heads, s.value_dim());
    assert!(state.len() >= s.state_len() && c.len() >= n * cd && out.len() >= n * vd);
    assert!(kernel.is_available(), "{kernel:?} kernels are not available on this CPU");
    let sp = SyncPtr(state.as_mut_ptr());
    let op = SyncPtr(out.as_mut_ptr());
    pool.parallel_for(hv, 1, |range| {
        with_scratch(2 * dk + 3 * dv, |scratch| {
            for h in range {
                // SAFETY: each head owns its state block and its `dv` slice of every output row.
                let st = unsafe { std::slice::from_raw_parts_mut(sp.get().add(h * dk * dv), dk * dv) };
                for t in 0..n {
                    let (q, k, v) = qkv(s, &c[t * cd..(t + 1) * cd], h);
                    let o = unsafe { std::slice::from_raw_parts_mut(op.get().add(t * vd + h * dv), dv) };
                    decode_head(kernel, st, dk, dv, q, k, v, g[t * hv + h].exp(), beta[t * hv + h], o, scratch);
                }
            }
        })
    });
}

/// The ancestor-masked WY solve: outputs of every node of a tree (or chain) from the committed state `state`
/// (read only). Writes `gamma` (`n × n_v_heads`, path-cumulative log decays), `u` (`n × value_dim`, the
/// per-node corrections `ũ`) and `out` (`n × value_dim`). `c`, `g`, `beta` as in [`recurrent`]. Parallel over
/// value heads. See the module docs for the math. Per head: `[S₀ᵀk_i; S₀ᵀq_i] = X·S₀` with `X = [k_i; q_i]`
/// (`2n × d_k`) and the Gram products `X·Kᵀ` (`2n × n`) as register-blocked GEMMs, then the ancestor-masked
/// forward substitution ([`wy_solve`]).
#[allow(clippy::too_many_arguments)]
pub fn wy_outputs(
    pool: &ThreadPool,
    s: &GdnShape,
    state: &[f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    parents: &[usize],
    gamma: &mut [f32],
    u: &mut [f32],
    out: &mut [f32],
) {
    wy_outputs_with(Kernel::active(), pool, s, state, c, g, beta, parents, gamma, u, out)
}

/// [`wy_outputs`] on a given kernel path (which must be available on this CPU).
#[allow(clippy::too_many_arguments)]
pub fn wy_outputs_with(
    kernel: Kernel,
    pool: &ThreadPool,
    s: &GdnShape,
    state: &[f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    parents: &[usize],
    gamma: &mut [f32],
    u: &mut [f32],
    out: &mut [f32],
) {
    let n = parents.len();
    let (cd, dk, dv, hv, vd) = (s.conv_dim(), s.d_k, s.d_v, s.n_v_heads, s.value_dim());
    assert!(state.len() >= s.state_len() && c.len() >= n * cd && out.len() >= n * vd && u.len() >= n * vd);
    assert!(gamma.len() >= n * hv && g.len() >= n * hv && beta.len() >= n * hv);
    assert!(kernel.is_available(), "{kernel:?} kernels are not available on this CPU");
    for i in 0..n {
        for h in 0..hv {
            let up = if parents[i] == usize::MAX { 0.0 } else { gamma[parents[i] * hv + h] };
            gamma[i * hv + h] = g[i * hv + h] + up;
        }
    }
    let gamma: &[f32] = gamma;
    let up = SyncPtr(u.as_mut_ptr());
    let op = SyncPtr(out.as_mut_ptr());
    pool.parallel_for(hv, 1, |range| {
        with_scratch(wy_scratch_len(s, n), |sc| {
            for h in range {
                // SAFETY: head h writes only its own columns of `u` and `out`.
                unsafe { wy_head(kernel, s, &state[h * dk * dv..(h + 1) * dk * dv], c, g, beta, parents, gamma, h, sc, up, op) };
            }
        })
    });
}

/// Scratch of [`wy_head`] for a tree of `n` nodes: X (2n × dk), Kᵀ (dk × n), values (n × dv), γ, e^g, β (n
/// each), X·S₀ (2n × dv), X·Kᵀ (2n × n), ũ and outputs (n × dv each), the solve's coefficients (2n).
fn wy_scratch_len(s: &GdnShape, n: usize) -> usize {
    let (dk, dv) = (s.d_k, s.d_v);
    2 * n * dk + dk * n + n * dv + 3 * n + 2 * n * dv + 2 * n * n + 2 * n * dv + 2 * n
}

/// [`wy_outputs`] for value head `h` (its state block `st`, `d_k × d_v`): writes the head's columns of
/// `u` and `out` (row stride `value_dim`).
///
/// # Safety
/// `up`/`op` point to `n × value_dim` floats of which no other thread writes head `h`'s columns.
#[allow(clippy::too_many_arguments)]
unsafe fn wy_head(
    kernel: Kernel,
    s: &GdnShape,
    st: &[f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    parents: &[usize],
    gamma: &[f32],
    h: usize,
    sc: &mut [f32],
    up: SyncPtr<f32>,
    op: SyncPtr<f32>,
) {
    let n = parents.len();
    let (cd, dk, dv, hv, vd) = (s.conv_dim(), s.d_k, s.d_v, s.n_v_heads, s.value_dim());
    let (xs, sc) = sc.split_at_mut(2 * n * dk);
    let (kt, sc) = sc.split_at_mut(dk * n);
    let (vs, sc) = sc.split_at_mut(n * dv);
    let (gam, sc) = sc.split_at_mut(n);
    let (eg, sc) = sc.split_at_mut(n);
    let (bet, sc) = sc.split_at_mut(n);
    let (kqs, sc) = sc.split_at_mut(2 * n * dv);
    let (gram, sc) = sc.split_at_mut(2 * n * n);
    let (us, sc) = sc.split_at_mut(n * dv);
    let (os, coef) = sc.split_at_mut(n * dv);
    for i in 0..n {
        let (q, k, v) = qkv(s, &c[i * cd..(i + 1) * cd], h);
        xs[2 * i * dk..(2 * i + 1) * dk].copy_from_slice(k);
        xs[(2 * i + 1) * dk..(2 * i + 2) * dk].copy_from_slice(q);
        for (m, &km) in k.iter().enumerate() {
            kt[m * n + i] = km;
        }
        vs[i * dv..(i + 1) * dv].copy_from_slice(v);
        gam[i] = gamma[i * hv + h];
        eg[i] = g[i * hv + h].exp();
        bet[i] = beta[i * hv + h];
    }
    gemm(kernel, st, dk, dv, xs, 2 * n, kqs);
    gemm(kernel, kt, dk, n, xs, 2 * n, gram);
    wy_solve(kernel, dv, parents, kqs, gram, vs, gam, eg, bet, us, os, &mut coef[..2 * n]);
    for i in 0..n {
        // SAFETY: head h owns the `dv` slices at column h·dv of every row of `u` and `out` (caller).
        unsafe {
            std::ptr::copy_nonoverlapping(us[i * dv..].as_ptr(), up.get().add(i * vd + h * dv), dv);
            std::ptr::copy_nonoverlapping(os[i * dv..].as_ptr(), op.get().add(i * vd + h * dv), dv);
        }
    }
}

/// [`step_with`] on the active kernel path.
#[allow(clippy::too_many_arguments)]
pub fn step(
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    gamma: &mut [f32],
    u: &mut [f32],
    out: &mut [f32],
) {
    step_with(Kernel::active(), pool, s, state, c, g, beta, gamma, u, out)
}

/// One decode token: [`wy_outputs`] of the one-node tree (`parents = [root]`) then [`apply_path`] of the
/// path `[0]`, fused per value head so each head's state block is read by the solve and updated while it is
/// still in cache (one pass over the state from memory instead of two). The same arithmetic in the same
/// order as the two calls: bit-identical results. Writes `gamma` (`n_v_heads`), `u` and `out` (`value_dim`).
#[allow(clippy::too_many_arguments)]
pub fn step_with(
    kernel: Kernel,
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    gamma: &mut [f32],
    u: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, hv, vd) = (s.d_k, s.d_v, s.n_v_heads, s.value_dim());
    assert!(state.len() >= s.state_len() && c.len() >= s.conv_dim() && out.len() >= vd && u.len() >= vd);
    assert!(gamma.len() >= hv && g.len() >= hv && beta.len() >= hv);
    assert!(kernel.is_available(), "{kernel:?} kernels are not available on this CPU");
    const ROOT: [usize; 1] = [usize::MAX];
    for h in 0..hv {
        // As wy_outputs for a root: its parent's (absent) cumulative decay is 0.
        gamma[h] = g[h] + 0.0;
    }
    let gamma: &[f32] = gamma;
    let (sp, up, op) = (SyncPtr(state.as_mut_ptr()), SyncPtr(u.as_mut_ptr()), SyncPtr(out.as_mut_ptr()));
    let wy_len = wy_scratch_len(s, 1);
    pool.parallel_for(hv, 1, |range| {
        with_scratch(wy_len + dk + dv, |sc| {
            let (wy, ap) = sc.split_at_mut(wy_len);
            for h in range {
                // SAFETY: each head owns its state block and its columns of `u` and `out`.
                let st = unsafe { std::slice::from_raw_parts_mut(sp.get().add(h * dk * dv), dk * dv) };
                unsafe { wy_head(kernel, s, st, c, g, beta, &ROOT, gamma, h, wy, up, op) };
                // SAFETY: head h's `u` columns, just written by this thread and touched by no other.
                let uh = unsafe { std::slice::from_raw_parts(up.get().add(h * dv).cast_const(), dv) };
                apply_head(kernel, s, st, c, gamma, (uh, 0, 0), &[0], h, ap);
            }
        })
    });
}

/// Commit a root path `path` (node indices from 0, each the parent of the next) into `state`:
/// `S ← e^{γ_n} S + Σ_{j∈P} e^{γ_n−γ_j} k_j ũ_jᵀ` with n the last node; `c`, `gamma`, `u` from [`wy_outputs`].
/// Parallel over value heads; a rank-|P| update that loads and stores each state element once.
pub fn apply_path(pool: &ThreadPool, s: &GdnShape, state: &mut [f32], c: &[f32], gamma: &[f32], u: &[f32], path: &[usize]) {
    apply_path_with(Kernel::active(), pool, s, state, c, gamma, u, path)
}

/// [`apply_path`] on a given kernel path (which must be available on this CPU).
#[allow(clippy::too_many_arguments)]
pub fn apply_path_with(
    kernel: Kernel,
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    gamma: &[f32],
    u: &[f32],
    path: &[usize],
) {
    if path.is_empty() {
        return;
    }
    let (dk, dv, hv) = (s.d_k, s.d_v, s.n_v_heads);
    assert!(kernel.is_available(), "{kernel:?} kernels are not available on this CPU");
    let np = path.len();
    let sp = SyncPtr(state.as_mut_ptr());
    pool.parallel_for(hv, 1, |range| {
        with_scratch(np * (dk + dv), |sc| {
            for h in range {
                // SAFETY: each head owns its state block.
                let st = unsafe { std::slice::from_raw_parts_mut(sp.get().add(h * dk * dv), dk * dv) };
                apply_head(kernel, s, st, c, gamma, (u, s.value_dim(), h * dv), path, h, sc);
            }
        })
    });
}

/// [`apply_path`] for value head `h` on its state block `st` (`d_k × d_v`); node `j`'s `ũ` for this head at
/// `u.0[j·u.1 + u.2..][..d_v]`; `sc`: `|path|·(d_k + d_v)` scratch.
#[allow(clippy::too_many_arguments)]
fn apply_head(
    kernel: Kernel,
    s: &GdnShape,
    st: &mut [f32],
    c: &[f32],
    gamma: &[f32],
    u: (&[f32], usize, usize),
    path: &[usize],
    h: usize,
    sc: &mut [f32],
) {
    let Some(&last) = path.last() else { return };
    let (cd, dk, dv, hv) = (s.conv_dim(), s.d_k, s.d_v, s.n_v_heads);
    let (u, stride, off) = u;
    let np = path.len();
    let (ks, us) = sc[..np * (dk + dv)].split_at_mut(np * dk);
    let gl = gamma[last * hv + h];
    for (p, &j) in path.iter().enumerate() {
        let coef = (gl - gamma[j * hv + h]).exp();
        let k = qkv(s, &c[j * cd..(j + 1) * cd], h).1;
        ks[p * dk..(p + 1) * dk].iter_mut().zip(k).for_each(|(d, &x)| *d = coef * x);
        us[p * dv..(p + 1) * dv].copy_from_slice(&u[j * stride + off..j * stride + off + dv]);
    }
    rank_update(kernel, st, dk, dv, gl.exp(), ks, us, np);
}

/// AVX-512 (`avx512f`) kernels of the state products: register tiles of zmm accumulators that share every
/// load, with masked loads and stores for a partial last column block, so any `d_k`, `d_v` (and any `T` in
/// the Gram products) take them. Callers check [`Kernel::Avx512`] first.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// f32 lanes of a zmm register.
    const W: usize = 16;
    /// Rows of the state ahead that the first pass over it prefetches.
    const PF_ROWS: usize = 8;

    /// Lanes of the column block starting `rem` columns before the end (all 16 when `rem ≥ 16`).
    #[inline(always)]
    fn mask(rem: usize) -> __mmask16 {
        if rem >= W {
            0xFFFF
        } else {
            ((1u32 << rem) - 1) as __mmask16
        }
    }

    /// Masks of `CB` column blocks starting at column `j0` of `nc` (blocks past the end get mask 0).
    #[inline(always)]
    fn masks<const CB: usize>(nc: usize, j0: usize) -> [__mmask16; CB] {
        let mut mk = [0; CB];
        for (c, m) in mk.iter_mut().enumerate() {
            *m = mask(nc.saturating_sub(j0 + c * W));
        }
        mk
    }

    /// `out[x][j] = Σ_m xs[x][m]·b[m][j]`: `b` is `dk × nc`, `xs` is `nx × dk`, `out` is `nx × nc` (all
    /// row-major, contiguous). When `b` is wider than 64 columns, the first two vectors pass over whole rows
    /// (2 × 8 blocks, prefetching ahead), so `b` streams in once in order; the rest in tiles of 4 vectors × up to
    /// 4 column blocks (16 accumulators; per row of `b`, ≤ 4 block loads and 4 broadcasts feed 16 FMAs; 8
    /// vectors when the chunk is ≤ 2 blocks wide), column chunk outermost so a chunk of `b` stays in cache while
    /// every vector group passes over it.
    ///
    /// # Safety
    /// The CPU must have `avx512f`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemm(b: &[f32], dk: usize, nc: usize, xs: &[f32], nx: usize, out: &mut [f32]) {
        assert!(b.len() >= dk * nc && xs.len() >= nx * dk && out.len() >= nx * nc);
        let (b, xs, mut out) = (b.as_ptr(), xs.as_ptr(), out.as_mut_ptr());
        let (mut xs, mut nx) = (xs, nx);
        if nc > 4 * W && nx >= 2 {
            // The first two vectors stream whole rows (8 column blocks): a cold `b` then arrives from memory in
            // order, as in the decode step, instead of in strided half rows.
            let mut j0 = 0;
            while j0 < nc {
                gemm_tile::<2, 8>(b, dk, nc, j0, masks::<8>(nc, j0), xs, 0, out);
                j0 += 8 * W;
            }
            (xs, out, nx) = (xs.add(2 * dk), out.add(2 * nc), nx - 2);
        }
        let mut j0 = 0;
        while j0 < nc {
            let blocks = (nc - j0).div_ceil(W).min(4);
            match blocks {
                1 => gemm_cols::<1>(b, dk, nc, j0, xs, nx, out),
                2 => gemm_cols::<2>(b, dk, nc, j0, xs, nx, out),
                3 => gemm_cols::<3>(b, dk, nc, j0, xs, nx, out),
                _ => gemm_cols::<4>(b, dk, nc, j0, xs, nx, out),
            }
            j0 += blocks * W;
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn gemm_cols<const CB: usize>(b: *const f32, dk: usize, nc: usize, j0: usize, xs: *const f32, nx: usize, out: *mut f32) {
        let mk = masks::<CB>(nc, j0);
        let mut x0 = 0;
        // Narrow chunks (the Gram products) take 8 vectors per tile to keep ≥ 8 FMA chains in flight.
        if CB <= 2 {
            while x0 + 8 <= nx {
                gemm_tile::<8, CB>(b, dk, nc, j0, mk, xs, x0, out);
                x0 += 8;
            }
        }
        while x0 + 4 <= nx {
            gemm_tile::<4, CB>(b, dk, nc, j0, mk, xs, x0, out);
            x0 += 4;
        }
        match nx - x0 {
            3 => gemm_tile::<3, CB>(b, dk, nc, j0, mk, xs, x0, out),
            2 => gemm_tile::<2, CB>(b, dk, nc, j0, mk, xs, x0, out),
            1 => gemm_tile::<1, CB>(b, dk, nc, j0, mk, xs, x0, out),
            _ => {}
        }
    }

    /// Vectors `x0..x0+NV` × column blocks `j0..j0+16·CB`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn gemm_tile<const NV: usize, const CB: usize>(
        b: *const f32,
        dk: usize,
        nc: usize,
        j0: usize,
        mk: [__mmask16; CB],
        xs: *const f32,
        x0: usize,
        out: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); CB]; NV];
        let xr = xs.add(x0 * dk);
        let mut row = b.add(j0);
        for m in 0..dk {
            let mut bv = [_mm512_setzero_ps(); CB];
            for c in 0..CB {
                bv[c] = _mm512_maskz_loadu_ps(mk[c], row.add(c * W));
            }
            if x0 == 0 && m + PF_ROWS < dk {
                // The first vector group brings the chunk in (from DRAM in a real decode step): ask for the
                // rows PF_ROWS ahead (prefetches never fault).
                for c in 0..CB {
                    _mm_prefetch::<_MM_HINT_T0>(row.add(PF_ROWS * nc + c * W) as *const i8);
                }
            }
            for v in 0..NV {
                let a = _mm512_set1_ps(*xr.add(v * dk + m));
                for c in 0..CB {
                    acc[v][c] = _mm512_fmadd_ps(a, bv[c], acc[v][c]);
                }
            }
            row = row.add(nc);
        }
        for v in 0..NV {
            for c in 0..CB {
                _mm512_mask_storeu_ps(out.add((x0 + v) * nc + j0 + c * W), mk[c], acc[v][c]);
            }
        }
    }

    /// One value head of one decode step, in place, in two passes over the state: the first computes `S₀ᵀk`
    /// and `S₀ᵀq` together (each row loaded once), then `ũ = β(v − α·S₀ᵀk)` and `o = α·S₀ᵀq + (q·k)·ũ`
    /// (which is `S_newᵀq`), the second writes `S ← α·S₀ + k ũᵀ`. `st` is `dk × dv`; `qk = q·k`. Columns are
    /// independent, so each chunk of 128 does both passes before the next.
    ///
    /// # Safety
    /// The CPU must have `avx512f`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_head(
        st: &mut [f32],
        dk: usize,
        dv: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        alpha: f32,
        beta: f32,
        qk: f32,
        out: &mut [f32],
    ) {
        assert!(st.len() >= dk * dv && q.len() >= dk && k.len() >= dk && v.len() >= dv && out.len() >= dv);
        let mut j0 = 0;
        while j0 < dv {
            decode_cols(st.as_mut_ptr(), dk, dv, j0, q.as_ptr(), k.as_ptr(), v.as_ptr(), alpha, beta, qk, out.as_mut_ptr());
            j0 += 8 * W;
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn decode_cols(
        s: *mut f32,
        dk: usize,
        dv: usize,
        j0: usize,
        q: *const f32,
        k: *const f32,
        v: *const f32,
        alpha: f32,
        beta: f32,
        qk: f32,
        out: *mut f32,
    ) {
        let mk = masks::<8>(dv, j0);
        let (mut ak, mut aq) = ([_mm512_setzero_ps(); 8], [_mm512_setzero_ps(); 8]);
        let mut row = s.add(j0);
        for m in 0..dk {
            let (kb, qb) = (_mm512_set1_ps(*k.add(m)), _mm512_set1_ps(*q.add(m)));
            for c in 0..8 {
                let x = _mm512_maskz_loadu_ps(mk[c], row.add(c * W));
                ak[c] = _mm512_fmadd_ps(kb, x, ak[c]);
                aq[c] = _mm512_fmadd_ps(qb, x, aq[c]);
            }
            row = row.add(dv);
        }
        let (va, vb, vqk) = (_mm512_set1_ps(alpha), _mm512_set1_ps(beta), _mm512_set1_ps(qk));
        let mut u = [_mm512_setzero_ps(); 8];
        for c in 0..8 {
            let vv = _mm512_maskz_loadu_ps(mk[c], v.add(j0 + c * W));
            u[c] = _mm512_mul_ps(vb, _mm512_fnmadd_ps(va, ak[c], vv));
            let o = _mm512_fmadd_ps(vqk, u[c], _mm512_mul_ps(va, aq[c]));
            _mm512_mask_storeu_ps(out.add(j0 + c * W), mk[c], o);
        }
        let mut row = s.add(j0);
        for m in 0..dk {
            let kb = _mm512_set1_ps(*k.add(m));
            for c in 0..8 {
                let x = _mm512_maskz_loadu_ps(mk[c], row.add(c * W));
                _mm512_mask_storeu_ps(row.add(c * W), mk[c], _mm512_fmadd_ps(kb, u[c], _mm512_mul_ps(va, x)));
            }
            row = row.add(dv);
        }
    }

    /// One node `i` of the ancestor solve, columns in chunks of 128 held in registers: `ũ_i = β(v − e^γ·S₀ᵀk_i) +
    /// Σ_t cu[t]·ũ_{a_t}` and `o_i = e^γ·S₀ᵀq_i + Σ_t co[t]·ũ_{a_t} + (q_i·k_i)·ũ_i` over the first `na` ancestors
    /// `a_t` of `i` (parent first); `us` holds ũ (`n × dv`, rows `< i` done, row `i` written here).
    ///
    /// # Safety
    /// The CPU must have `avx512f`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    pub unsafe fn solve_node(
        dv: usize,
        parents: &[usize],
        i: usize,
        na: usize,
        cu: &[f32],
        co: &[f32],
        b: f32,
        egi: f32,
        qkii: f32,
        v: &[f32],
        sk: &[f32],
        sq: &[f32],
        us: &mut [f32],
        oi: &mut [f32],
    ) {
        assert!(cu.len() >= na && co.len() >= na && v.len() >= dv && sk.len() >= dv && sq.len() >= dv && oi.len() >= dv);
        assert!(us.len() >= (i + 1) * dv && i < parents.len());
        let (vb, ve, vqk) = (_mm512_set1_ps(b), _mm512_set1_ps(egi), _mm512_set1_ps(qkii));
        let up = us.as_mut_ptr();
        let mut j0 = 0;
        while j0 < dv {
            let mk = masks::<8>(dv, j0);
            let (mut u, mut o) = ([_mm512_setzero_ps(); 8], [_mm512_setzero_ps(); 8]);
            for c in 0..8 {
                let j = j0 + c * W;
                let (vv, kk) = (_mm512_maskz_loadu_ps(mk[c], v.as_ptr().add(j)), _mm512_maskz_loadu_ps(mk[c], sk.as_ptr().add(j)));
                u[c] = _mm512_mul_ps(vb, _mm512_fnmadd_ps(ve, kk, vv));
                o[c] = _mm512_mul_ps(ve, _mm512_maskz_loadu_ps(mk[c], sq.as_ptr().add(j)));
            }
            let mut a = parents[i];
            for t in 0..na {
                debug_assert!(a < i);
                let (cut, cot) = (_mm512_set1_ps(cu[t]), _mm512_set1_ps(co[t]));
                let ua = up.add(a * dv + j0);
                for c in 0..8 {
                    let x = _mm512_maskz_loadu_ps(mk[c], ua.add(c * W));
                    u[c] = _mm512_fmadd_ps(cut, x, u[c]);
                    o[c] = _mm512_fmadd_ps(cot, x, o[c]);
                }
                a = parents[a];
            }
            for c in 0..8 {
                let j = j0 + c * W;
                _mm512_mask_storeu_ps(up.add(i * dv + j), mk[c], u[c]);
                _mm512_mask_storeu_ps(oi.as_mut_ptr().add(j), mk[c], _mm512_fmadd_ps(vqk, u[c], o[c]));
            }
            j0 += 8 * W;
        }
    }

    /// `S ← α·S + Σ_p ks[p] us[p]ᵀ`: `st` is `dk × dv`, `ks` is `np × dk` (coefficients folded in), `us` is
    /// `np × dv`. Tiles of 4 state rows × up to 4 column blocks held in registers while all `np` terms are
    /// added, so every state element is loaded and stored once.
    ///
    /// # Safety
    /// The CPU must have `avx512f`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rank_update(st: &mut [f32], dk: usize, dv: usize, alpha: f32, ks: &[f32], us: &[f32], np: usize) {
        assert!(st.len() >= dk * dv && ks.len() >= np * dk && us.len() >= np * dv);
        let (s, ks, us) = (st.as_mut_ptr(), ks.as_ptr(), us.as_ptr());
        let mut m0 = 0;
        while m0 < dk {
            let rb = (dk - m0).min(4);
            match rb {
                1 => rank_rows::<1>(s, dk, dv, m0, alpha, ks, us, np),
                2 => rank_rows::<2>(s, dk, dv, m0, alpha, ks, us, np),
                3 => rank_rows::<3>(s, dk, dv, m0, alpha, ks, us, np),
                _ => rank_rows::<4>(s, dk, dv, m0, alpha, ks, us, np),
            }
            m0 += rb;
        }
    }

    /// State rows `m0..m0+RB`, all columns (the state streams through once, in order; the `np × dv` terms
    /// stay in L1).
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rank_rows<const RB: usize>(
        s: *mut f32,
        dk: usize,
        dv: usize,
        m0: usize,
        alpha: f32,
        ks: *const f32,
        us: *const f32,
        np: usize,
    ) {
        let mut j0 = 0;
        while j0 < dv {
            let blocks = (dv - j0).div_ceil(W).min(4);
            match blocks {
                1 => rank_tile::<RB, 1>(s, dk, dv, m0, j0, masks::<1>(dv, j0), alpha, ks, us, np),
                2 => rank_tile::<RB, 2>(s, dk, dv, m0, j0, masks::<2>(dv, j0), alpha, ks, us, np),
                3 => rank_tile::<RB, 3>(s, dk, dv, m0, j0, masks::<3>(dv, j0), alpha, ks, us, np),
                _ => rank_tile::<RB, 4>(s, dk, dv, m0, j0, masks::<4>(dv, j0), alpha, ks, us, np),
            }
            j0 += blocks * W;
        }
    }

    /// State rows `m0..m0+RB` × column blocks `j0..j0+16·CB`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn rank_tile<const RB: usize, const CB: usize>(
        s: *mut f32,
        dk: usize,
        dv: usize,
        m0: usize,
        j0: usize,
        mk: [__mmask16; CB],
        alpha: f32,
        ks: *const f32,
        us: *const f32,
        np: usize,
    ) {
        let va = _mm512_set1_ps(alpha);
        let mut acc = [[_mm512_setzero_ps(); CB]; RB];
        for r in 0..RB {
            for c in 0..CB {
                acc[r][c] = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(mk[c], s.add((m0 + r) * dv + j0 + c * W)));
            }
        }
        for p in 0..np {
            let mut ub = [_mm512_setzero_ps(); CB];
            for c in 0..CB {
                ub[c] = _mm512_maskz_loadu_ps(mk[c], us.add(p * dv + j0 + c * W));
            }
            for r in 0..RB {
                let a = _mm512_set1_ps(*ks.add(p * dk + m0 + r));
                for c in 0..CB {
                    acc[r][c] = _mm512_fmadd_ps(a, ub[c], acc[r][c]);
                }
            }
        }
        for r in 0..RB {
            for c in 0..CB {
                _mm512_mask_storeu_ps(s.add((m0 + r) * dv + j0 + c * W), mk[c], acc[r][c]);
            }
        }
    }
}

/// Chunked (WY/UT) prefill of `n` consecutive tokens, updating `state`: chunks of `chunk` tokens, each a chain
/// solved by [`wy_outputs`] and committed by [`apply_path`]. `gamma`/`u` are scratch (`chunk × n_v_heads`,
/// `chunk × value_dim`). Agrees with [`recurrent`] up to rounding.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    n: usize,
    chunk: usize,
    out: &mut [f32],
) {
    chunked_with(Kernel::active(), pool, s, state, c, g, beta, n, chunk, out)
}

/// [`chunked`] on a given kernel path (which must be available on this CPU).
#[allow(clippy::too_many_arguments)]
pub fn chunked_with(
    kernel: Kernel,
    pool: &ThreadPool,
    s: &GdnShape,
    state: &mut [f32],
    c: &[f32],
    g: &[f32],
    beta: &[f32],
    n: usize,
    chunk: usize,
    out: &mut [f32],
) {
    let (cd, hv, vd) = (s.conv_dim(), s.n_v_heads, s.value_dim());
    let chunk = chunk.max(1).min(n.max(1));
    let mut gamma = vec![0f32; chunk * hv];
    let mut u = vec![0f32; chunk * vd];
    let parents = chain_parents(chunk);
    let path: Vec<usize> = (0..chunk).collect();
    let mut t0 = 0;
    while t0 < n {
        let len = chunk.min(n - t0);
        let (cs, gs, bs) = (&c[t0 * cd..(t0 + len) * cd], &g[t0 * hv..(t0 + len) * hv], &beta[t0 * hv..(t0 + len) * hv]);
        wy_outputs_with(kernel, pool, s, state, cs, gs, bs, &parents[..len], &mut gamma, &mut u, &mut out[t0 * vd..(t0 + len) * vd]);
        apply_path_with(kernel, pool, s, state, cs, &gamma, &u, &path[..len]);
        t0 += len;
    }
}

/// Test oracle for trees: a plain per-branch sequential recurrence (each node starts from a copy of its
/// parent's post-state, the root from `state`, which is not modified), on the portable path. Same arguments as
/// [`wy_outputs`].
pub fn tree_reference(s: &GdnShape, state: &[f32], c: &[f32], g: &[f32], beta: &[f32], parents: &[usize], out: &mut [f32]) {
    let n = parents.len();
    let (cd, hv, vd) = (s.conv_dim(), s.n_v_heads, s.value_dim());
    let pool = ThreadPool::new(1);
    let mut states: Vec<Vec<f32>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut st = if parents[i] == usize::MAX { state[..s.state_len()].to_vec() } else { states[parents[i]].clone() };
        recurrent_with(
            Kernel::Scalar,
            &pool,
            s,
            &mut st,
            &c[i * cd..(i + 1) * cd],
            &g[i * hv..(i + 1) * hv],
            &beta[i * hv..(i + 1) * hv],
            1,
            &mut out[i * vd..(i + 1) * vd],
        );
        states.push(st);
    }
}

/// Gated RMSNorm per value head (norm before gate): `o ← w ⊙ o/√(mean(o²)+ε) ⊙ silu(z)`; `o`, `z` are rows of
/// `d_v = w.len()` values.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (row, zr) in o.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((x, &wz), &zz) in row.iter_mut().zip(w).zip(zr) {
            *x = wz * (*x * inv) * silu(zz);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() + 1.0) * 0.5 * n as f32) as usize % n.max(1)
        }
    }

    /// Shapes for the path tests: d_v = 32 (whole 16-lane blocks), 24, 40 and 130 (partial blocks, more than
    /// one 128-column decode chunk), d_k not a multiple of 4 or 16; grouped and tiled value heads.
    fn shapes() -> [GdnShape; 4] {
        [
            GdnShape { n_k_heads: 2, n_v_heads: 4, d_k: 16, d_v: 32, kernel: 4, v_tiled: false },
            GdnShape { n_k_heads: 2, n_v_heads: 4, d_k: 16, d_v: 24, kernel: 4, v_tiled: true },
            GdnShape { n_k_heads: 1, n_v_heads: 2, d_k: 20, d_v: 40, kernel: 4, v_tiled: false },
            GdnShape { n_k_heads: 1, n_v_heads: 1, d_k: 13, d_v: 130, kernel: 4, v_tiled: true },
        ]
    }

    /// Random prepared inputs for n nodes: (c, g, beta, state).
    fn inputs(s: &GdnShape, n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut c: Vec<f32> = (0..n * s.conv_dim()).map(|_| rng.next()).collect();
        let mut a: Vec<f32> = (0..n * s.n_v_heads).map(|_| rng.next() * 2.0).collect();
        let mut b: Vec<f32> = (0..n * s.n_v_heads).map(|_| rng.next() * 3.0).collect();
        let a_neg: Vec<f32> = (0..s.n_v_heads).map(|h| -(0.05 + 0.3 * h as f32)).collect();
        let dt: Vec<f32> = (0..s.n_v_heads).map(|_| rng.next()).collect();
        prepare(s, &mut c, &mut a, &mut b, &a_neg, &dt, n);
        let st: Vec<f32> = (0..s.state_len()).map(|_| rng.next() * 0.5).collect();
        (c, a, b, st)
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// f64 scalar recurrence, straight from the definition, for one chain.
    fn scalar_chain(s: &GdnShape, st0: &[f32], c: &[f32], g: &[f32], beta: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
        let (cd, dk, dv, hv, vd) = (s.conv_dim(), s.d_k, s.d_v, s.n_v_heads, s.value_dim());
        let mut st: Vec<f64> = st0.iter().map(|&x| x as f64).collect();
        let mut out = vec![0f32; n * vd];
        for t in 0..n {
            for h in 0..hv {
                let (q, k, v) = qkv(s, &c[t * cd..(t + 1) * cd], h);
                let a = (g[t * hv + h] as f64).exp();
                let sh = &mut st[h * dk * dv..(h + 1) * dk * dv];
                sh.iter_mut().for_each(|x| *x *= a);
                for j in 0..dv {
                    let mem: f64 = (0..dk).map(|m| sh[m * dv + j] * k[m] as f64).sum();
                    let u = beta[t * hv + h] as f64 * (v[j] as f64 - mem);
                    for m in 0..dk {
                        sh[m * dv + j] += k[m] as f64 * u;
                    }
                }
                for j in 0..dv {
                    out[t * vd + h * dv + j] = (0..dk).map(|m| sh[m * dv + j] * q[m] as f64).sum::<f64>() as f32;
                }
            }
        }
        (out, st.iter().map(|&x| x as f32).collect())
    }

    #[test]
    fn gdn_recurrent_and_chunked_match_scalar_reference() {
        let pool = ThreadPool::new(2);
        for s in shapes() {
            let mut rng = Rng(7);
            let n = 37;
            let (c, g, beta, st0) = inputs(&s, n, &mut rng);
            let (want, want_st) = scalar_chain(&s, &st0, &c, &g, &beta, n);
            for kernel in Kernel::available() {
                let mut st = st0.clone();
                let mut out = vec![0f32; n * s.value_dim()];
                recurrent_with(kernel, &pool, &s, &mut st, &c, &g, &beta, n, &mut out);
                assert!(max_rel(&out, &want) < 1e-5, "{kernel:?} {s:?} recurrent {}", max_rel(&out, &want));
                assert!(max_rel(&st, &want_st) < 1e-5, "{kernel:?} {s:?} recurrent state");
                for chunk in [1, 5, 16, 64] {
                    let mut st = st0.clone();
                    let mut out = vec![0f32; n * s.value_dim()];
                    chunked_with(kernel, &pool, &s, &mut st, &c, &g, &beta, n, chunk, &mut out);
                    assert!(max_rel(&out, &want) < 1e-5, "{kernel:?} {s:?} chunk {chunk}: {}", max_rel(&out, &want));
                    assert!(max_rel(&st, &want_st) < 1e-5, "{kernel:?} {s:?} chunk {chunk} state");
                }
            }
        }
    }

    fn random_tree(kind: usize, n: usize, rng: &mut Rng) -> Vec<usize> {
        (0..n)
            .map(|i| match (i, kind) {
                (0, _) => usize::MAX,
                (_, 0) => i - 1, // chain
                (_, 1) => 0,     // wide: star
                (_, 2) => {
                    if rng.below(4) == 0 {
                        rng.below(i)
                    } else {
                        i - 1
                    }
                } // deep, few branches
                _ => rng.below(i), // random
            })
            .collect()
    }

    #[test]
    fn gdn_tree_matches_per_branch_oracle_and_commit_matches_chain() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng(99);
        let mut worst = 0f32;
        for &n in &[1usize, 2, 3, 5, 7, 16, 17, 33, 64, 70] {
            for kind in 0..4 {
                for s in shapes() {
                    let parents = random_tree(kind, n, &mut rng);
                    check_parents(&parents).unwrap();
                    let (c, g, beta, st0) = inputs(&s, n, &mut rng);
                    let (hv, vd) = (s.n_v_heads, s.value_dim());
                    let mut want = vec![0f32; n * vd];
                    tree_reference(&s, &st0, &c, &g, &beta, &parents, &mut want);
                    // Commit the path to the deepest node; compare with the chain recurrence along it.
                    let leaf = n - 1;
                    let mut path = vec![leaf];
                    while parents[*path.last().unwrap()] != usize::MAX {
                        path.push(parents[*path.last().unwrap()]);
                    }
                    path.reverse();
                    let cd = s.conv_dim();
                    let cp: Vec<f32> = path.iter().flat_map(|&p| c[p * cd..(p + 1) * cd].to_vec()).collect();
                    let gp: Vec<f32> = path.iter().flat_map(|&p| g[p * hv..(p + 1) * hv].to_vec()).collect();
                    let bp: Vec<f32> = path.iter().flat_map(|&p| beta[p * hv..(p + 1) * hv].to_vec()).collect();
                    let mut st_chain = st0.clone();
                    let mut o = vec![0f32; path.len() * vd];
                    recurrent_with(Kernel::Scalar, &pool, &s, &mut st_chain, &cp, &gp, &bp, path.len(), &mut o);
                    for kernel in Kernel::available() {
                        let (mut gamma, mut u, mut out) = (vec![0f32; n * hv], vec![0f32; n * vd], vec![0f32; n * vd]);
                        let st_copy = st0.clone();
                        wy_outputs_with(kernel, &pool, &s, &st0, &c, &g, &beta, &parents, &mut gamma, &mut u, &mut out);
                        assert_eq!(st0, st_copy);
                        let e = max_rel(&out, &want);
                        worst = worst.max(e);
                        assert!(e < 1e-4, "{kernel:?} {s:?} n {n} kind {kind}: {e}");
                        let mut st = st0.clone();
                        apply_path_with(kernel, &pool, &s, &mut st, &c, &gamma, &u, &path);
                        assert!(max_rel(&st, &st_chain) < 1e-4, "{kernel:?} {s:?} commit n {n} kind {kind}");
                    }
                }
            }
        }
        eprintln!("worst tree relative error {worst:e}");
    }

    #[test]
    fn gdn_conv_tree_windows_and_commit() {
        let (cd, k) = (5, 4);
        let mut rng = Rng(3);
        let w: Vec<f32> = (0..cd * k).map(|_| rng.next()).collect();
        let state: Vec<f32> = (0..(k - 1) * cd).map(|_| rng.next()).collect();
        let parents = vec![usize::MAX, 0, 0, 1, 3, 2];
        let n = parents.len();
        let x: Vec<f32> = (0..n * cd).map(|_| rng.next()).collect();
        let mut out = vec![0f32; n * cd];
        conv_silu(&conv_taps(&w, k), k, &state, &x, &parents, &mut out);
        // Oracle: the full input stream along each node's path, then a plain causal conv.
        for i in 0..n {
            let mut path = vec![i];
            while parents[*path.last().unwrap()] != usize::MAX {
                path.push(parents[*path.last().unwrap()]);
            }
            path.reverse();
            let mut stream: Vec<&[f32]> = (0..k - 1).map(|r| &state[r * cd..(r + 1) * cd]).collect();
            stream.extend(path.iter().map(|&p| &x[p * cd..(p + 1) * cd]));
            let tail = &stream[stream.len() - k..];
            for ch in 0..cd {
                let s: f32 = (0..k).map(|m| w[ch * k + m] * tail[m][ch]).sum();
                assert!((out[i * cd + ch] - silu(s)).abs() < 1e-6);
            }
            // Commit along the path: the window is the last K−1 of the stream.
            let mut st = state.clone();
            conv_commit(&mut st, cd, k, &x, &path);
            let want: Vec<f32> = stream[stream.len() - (k - 1)..].iter().flat_map(|r| r.to_vec()).collect();
            assert_eq!(st, want);
        }
    }

    #[test]
    fn gdn_state_products_match_reference_on_every_path() {
        let mut rng = Rng(11);
        for (dk, dv) in [(16usize, 24usize), (8, 16), (12, 64), (1, 5), (7, 33), (13, 130), (128, 128)] {
            let st: Vec<f32> = (0..dk * dv).map(|_| rng.next()).collect();
            for nx in [0usize, 1, 2, 3, 4, 5, 9, 33] {
                let xs: Vec<f32> = (0..nx * dk).map(|_| rng.next()).collect();
                let us: Vec<f32> = (0..nx * dv).map(|_| rng.next()).collect();
                let want: Vec<f32> = (0..nx * dv)
                    .map(|i| (0..dk).map(|m| xs[i / dv * dk + m] as f64 * st[m * dv + i % dv] as f64).sum::<f64>() as f32)
                    .collect();
                let want_st: Vec<f32> = (0..dk * dv)
                    .map(|i| {
                        (0.7 * st[i] as f64 + (0..nx).map(|p| xs[p * dk + i / dv] as f64 * us[p * dv + i % dv] as f64).sum::<f64>()) as f32
                    })
                    .collect();
                let mut outs = vec![vec![0f32; nx * dv]; 2];
                state_t_times_body::<false>(&st, dk, dv, &xs, nx, &mut outs[0]);
                state_t_times_body::<true>(&st, dk, dv, &xs, nx, &mut outs[1]);
                let mut sts = vec![st.clone(), st.clone()];
                state_rank_update_body::<false>(&mut sts[0], dk, dv, 0.7, &xs, &us, nx);
                state_rank_update_body::<true>(&mut sts[1], dk, dv, 0.7, &xs, &us, nx);
                for kernel in Kernel::available() {
                    let mut o = vec![0f32; nx * dv];
                    gemm(kernel, &st, dk, dv, &xs, nx, &mut o);
                    outs.push(o);
                    let mut s2 = st.clone();
                    rank_update(kernel, &mut s2, dk, dv, 0.7, &xs, &us, nx);
                    sts.push(s2);
                }
                for o in &outs {
                    assert!(max_rel(o, &want) < 1e-5, "dk {dk} dv {dv} nx {nx}");
                }
                for s2 in &sts {
                    assert!(max_rel(s2, &want_st) < 1e-5, "update dk {dk} dv {dv} nx {nx}");
                }
            }
        }
    }

    #[test]
    fn gdn_gated_norm_and_prepare() {
        let o0 = [1.0f32, -2.0, 0.5, 3.0];
        let z = [0.3f32, -1.0, 2.0, 0.0];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut o = o0;
        gated_rms_norm(&mut o, &z, &w, 1e-6);
        let ms = o0.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0;
        for i in 0..4 {
            let zz = z[i] as f64;
            let want = w[i] as f64 * o0[i] as f64 / (ms + 1e-6).sqrt() * zz / (1.0 + (-zz).exp());
            assert!((o[i] as f64 - want).abs() < 1e-6);
        }
        let s = GdnShape { n_k_heads: 1, n_v_heads: 1, d_k: 4, d_v: 4, kernel: 4, v_tiled: false };
        let mut c = vec![3.0f32, 0.0, 4.0, 0.0, 0.0, 2.0, 0.0, 0.0, 9.0, 9.0, 9.0, 9.0];
        let (mut a, mut b) = (vec![0.5f32], vec![0.0f32]);
        prepare(&s, &mut c, &mut a, &mut b, &[-2.0], &[0.25], 1);
        assert!((c[0] - 0.6 / 2.0).abs() < 1e-6 && (c[2] - 0.8 / 2.0).abs() < 1e-6);
        assert!((c[5] - 1.0).abs() < 1e-6 && c[8] == 9.0);
        assert!((a[0] - (-2.0 * (0.75f32.exp()).ln_1p())).abs() < 1e-6 && b[0] == 0.5);
    }
}

#[cfg(test)]
mod speed {
    /// The parts of one value head of the tree verify (0.8B shape, chain of `n` nodes), hot in cache.
    #[test]
    #[ignore]
    fn gdn_wy_parts_speed() {
        use super::Kernel;
        let (dk, dv) = (128, 128);
        let kernel = Kernel::active();
        let st: Vec<f32> = (0..dk * dv).map(|i| (i % 7) as f32 * 0.01).collect();
        let time = |f: &mut dyn FnMut()| {
            (0..200)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        for n in [4usize, 16, 64] {
            let xs: Vec<f32> = (0..2 * n * dk).map(|i| (i % 5) as f32 * 0.01).collect();
            let kt: Vec<f32> = (0..dk * n).map(|i| (i % 3) as f32 * 0.01).collect();
            let mut kqs = vec![0f32; 2 * n * dv];
            let mut gram = vec![0f32; 2 * n * n];
            let main = time(&mut || super::gemm(kernel, &st, dk, dv, &xs, 2 * n, &mut kqs));
            let g = time(&mut || super::gemm(kernel, &kt, dk, n, &xs, 2 * n, &mut gram));
            let parents = super::chain_parents(n);
            let vs = vec![0.1f32; n * dv];
            let (gam, eg, bet) = (vec![-0.1f32; n], vec![0.9f32; n], vec![0.5f32; n]);
            let (mut us, mut os, mut coef) = (vec![0f32; n * dv], vec![0f32; n * dv], vec![0f32; 2 * n]);
            let solve = time(&mut || super::wy_solve(kernel, dv, &parents, &kqs, &gram, &vs, &gam, &eg, &bet, &mut us, &mut os, &mut coef));
            let gm = |macs: usize, t: f64| macs as f64 / t / 1e9;
            eprintln!(
                "{kernel:?} n {n}: X·S₀ {:.2} µs ({:.1} GMAC/s), Gram {:.2} µs ({:.1} GMAC/s), solve {:.2} µs",
                main * 1e6,
                gm(2 * n * dk * dv, main),
                g * 1e6,
                gm(2 * n * n * dk, g),
                solve * 1e6
            );
        }
    }

    #[test]
    #[ignore]
    fn gdn_state_t_times_speed() {
        let (dk, dv) = (128, 128);
        let st: Vec<f32> = (0..dk * dv).map(|i| (i % 7) as f32 * 0.1).collect();
        for nx in [1usize, 2, 8, 32] {
            let xs: Vec<f32> = (0..nx * dk).map(|i| (i % 5) as f32 * 0.1).collect();
            let mut out = vec![0f32; nx * dv];
            let mut best = f64::INFINITY;
            for _ in 0..200 {
                let t = std::time::Instant::now();
                super::state_t_times(&st, dk, dv, &xs, nx, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            let mut ks = vec![0f32; nx * dk];
            ks.copy_from_slice(&xs);
            let mut s2 = st.clone();
            let mut best_u = f64::INFINITY;
            for _ in 0..200 {
                let t = std::time::Instant::now();
                super::state_rank_update(&mut s2, dk, dv, 0.9, &ks, &out, nx);
                best_u = best_u.min(t.elapsed().as_secs_f64());
            }
            eprintln!(
                "nx {nx}: Sᵀx {:.2} µs = {:.1} G madd/s; rank update {:.2} µs = {:.1} G madd/s",
                best * 1e6,
                (nx * dk * dv) as f64 / best / 1e9,
                best_u * 1e6,
                (nx * dk * dv) as f64 / best_u / 1e9
            );
        }
    }
}
