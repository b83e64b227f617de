//! The seam between the models and the hardware: the [`Backend`] trait lists every operation a forward
//! pass needs, on buffers the backend owns; [`cpu::Cpu`] implements it with eddy's CPU kernels.
//!
//! A model is written once against [`Backend`]: its weights are "uploaded" into the backend's own layout
//! (for the CPU that is the prepacking of quantized matrices at load, [`cpu::prepack_wanted`]), its
//! activations, KV cache and recurrent states are [`Backend::Buf`]s, and only logits and hidden states come
//! back to the host ([`Backend::matmul_to_host`], [`Backend::read`]). The backend owns its threads, its
//! kernel choice and its scratch; model code never sees them.
//!
//! Buffers are flat `f32` arrays with row-major `rows × width` contents. Operations take whole buffers
//! with a row count (the first `n` rows are used) and explicit row offsets where a pass reads or writes
//! elsewhere (KV rows, logit rows), so a device backend needs no views into its allocations.
//!
//! The scalar reference of each operation ([`reference`]) is the test oracle: [`parity`] checks any
//! backend against it on random inputs (run for the CPU by `cargo test -p eddy --lib parity`).
//!
//! [`cuda::Cuda`] (cargo feature `cuda`) runs the attention models on an NVIDIA GPU (`docs/cuda.md`).
//!
//! Adding a backend: implement [`Backend`] (and an upload of [`crate::quant::WeightMatrix`] into
//! [`Backend::Weights`]), run [`parity::check_all`] on it, and instantiate the models with it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod parity;
pub mod reference;

pub use cpu::activation::Activation;
pub use cpu::attention::{AttnShape, Visibility};

/// The inputs of one attention operation ([`Backend::attention`], [`Backend::attention_quantize`]): `t`
/// queries (`q`: `t × n_heads·head_dim` f32) against the cache rows `k`, `v` (`n_kv_heads·head_dim` f32
/// each) that `vis` lets them see: causal at positions `n_past..n_past + t`, tree nodes with an ancestor
/// mask over the `n_past` committed rows, or a block (`docs/speculation.md`).
pub struct Attend<'a, Buf> {
    /// Heads, head size, scale, window and soft-cap of the layer.
    pub shape: AttnShape,
    /// Queries, `t` rows.
    pub q: &'a Buf,
    /// Key cache rows.
    pub k: &'a Buf,
    /// Value cache rows.
    pub v: &'a Buf,
    /// Committed cache rows before the first query.
    pub n_past: usize,
    /// Number of queries.
    pub t: usize,
    /// Which cache rows each query sees.
    pub vis: Visibility<'a>,
}

// Manual impls: a derive would ask `Buf: Clone`, which the fields (references) do not need.
impl<Buf> Clone for Attend<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Buf> Copy for Attend<'_, Buf> {}
pub use cpu::gdn::GdnShape;
pub use cpu::rope::{Rope, RopeMode};
pub use cpu::Cpu;

/// Columns `col..col + width` of a buffer's rows of `stride` values: where [`Backend::gather_rows`]
/// reads or writes (`col + width ≤ stride`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cols {
    /// Values per row of the buffer.
    pub stride: usize,
    /// First column.
    pub col: usize,
    /// Columns copied.
    pub width: usize,
}

impl Cols {
    /// All `width` columns of rows of `width` values.
    pub fn whole(width: usize) -> Cols {
        Cols { stride: width, col: 0, width }
    }
}

/// Run-ahead argmaxes a backend holds untaken at most ([`Backend::matmul_argmax_ahead`]): the step being
/// read back and the one queued behind it, with room for one more.
pub const AHEAD_IN_FLIGHT: usize = 3;

/// The operations of a forward pass, on buffers owned by the implementation.
///
/// Shapes are in rows of `width` values; `n` is the number of rows an operation reads/writes from the
/// start of its buffers unless a row offset says otherwise. Every operation must be batch invariant: a
/// row's result does not depend on `n` or on the other rows (speculative decoding relies on it to be
/// lossless), and deterministic for a given backend.
pub trait Backend: Send + Sync + 'static {
    /// A buffer of `f32` values in the backend's memory.
    type Buf: Send + Sync + 'static;
    /// A weight matrix (`rows × cols`, HF orientation: out × in) in the backend's layout.
    type Weights: Send + Sync + 'static;
    /// Activations quantized to int8 per token and group of 32 (the input of [`Backend::matmul`] for
    /// quantized weights).
    type QAct: Send + Sync + 'static;

    /// A zeroed buffer of `len` values.
    fn alloc(&self, len: usize) -> Self::Buf;
    /// A buffer holding `host`.
    fn upload(&self, host: &[f32]) -> Self::Buf;
    /// A weight matrix moved into the backend's layout (the CPU prepacks quantized matrices for its
    /// AVX-512 kernels).
    fn upload_weights(&self, w: crate::quant::WeightMatrix) -> Self::Weights;
    /// Empty quantized-activation scratch (grows on use).
    fn new_qact(&self) -> Self::QAct;
    /// Whether the Gated DeltaNet operations (`gdn_*`) are implemented; a backend without them cannot run
    /// hybrid models ([`crate::models::Model::to_backend`] refuses them).
    fn has_gdn(&self) -> bool {
        true
    }
    /// Passes of one shape a backend runs before a pass of that shape takes its steady-state time. The
    /// CUDA backend runs a list of operations it has not seen eagerly (op by op), captures it into a graph
    /// the second time and replays the graph from the third (`cuda::GraphPlan`), so its first two passes of
    /// a new shape cost several times a replayed one. Timings that feed the speculation cost model (the
    /// engine's calibration, `eddy speed --verify-sizes`) run each shape this many times and keep the last.
    fn passes_to_steady_state(&self) -> usize {
        1
    }
    /// Whether [`Backend::candidate_rows`] runs where the buffers live (a GPU reduces each logits row to its
    /// candidates on the device and copies back only those), so that a caller wanting the top of a few
    /// logits rows should ask for candidates rather than read the rows. False for host memory, where the
    /// default reads the rows anyway.
    fn reduces_on_device(&self) -> bool {
        false
    }

    /// Most tokens of a pass whose rows equal those of one-token passes bit for bit (batch invariance): the
    /// engine verifies at most this many tokens a pass, so that speculative decoding stays token-for-token equal
    /// to plain decoding. Passes of more tokens (prefill runs) may sum in another, fixed order. Unbounded here:
    /// the CPU's kernels keep one order for any count.
    fn invariant_tokens(&self) -> usize {
        usize::MAX
    }

    /// Tokens per prefill pass this backend runs best at: the engine's default piece
    /// ([`crate::engine::EngineOptions::max_batch`] 0). 256 here: on the CPU a larger piece gains little
    /// and delays the check for a client that has gone (made between pieces).
    fn prefill_tokens(&self) -> usize {
        256
    }

    /// `x[i] = scale · embedding row tokens[i]` (`d_model` each; `scale` None = 1).
    fn embed(&self, table: &Self::Weights, tokens: &[u32], scale: Option<f32>, x: &mut Self::Buf);
    /// Quantize rows `0..n` of `x` (`cols` each) to int8 into `xq`, as the input of products with `w` (and
    /// with every matrix that shares `w`'s input rotation, `docs/quant-formats.md`): a rotated `w`'s input
    /// side `x̃ = H·(D_in ⊙ x)` is applied first, fused into the quantization.
    fn quantize(&self, x: &Self::Buf, n: usize, cols: usize, w: &Self::Weights, xq: &mut Self::QAct);
    /// `out[t][r] = Σ_c W[r][c] · x[t][c]` for `t < n`; quantized weights read `xq` (from
    /// [`Backend::quantize`] of `x`), float weights read `x`.
    fn matmul(&self, w: &Self::Weights, x: &Self::Buf, xq: &Self::QAct, n: usize, out: &mut Self::Buf);
    /// [`Backend::matmul`] whose output (`n × rows`) lands in host memory: the logits readout.
    fn matmul_to_host(&self, w: &Self::Weights, x: &Self::Buf, xq: &Self::QAct, n: usize, out: &mut [f32]);

    /// The index of the largest value of each of rows `0..n` of `x` (`width` values each) into `out[..n]`:
    /// [`crate::sampling::argmax`] of each row (lowest index on ties, NaN never wins, 0 when no value exceeds
    /// −∞). Greedy sampling where the logits live (the default reads the rows back and runs it on the host).
    fn argmax_rows(&self, x: &Self::Buf, n: usize, width: usize, out: &mut [u32]) {
        let mut rows = Vec::with_capacity(n * width);
        self.read(x, 0, n, width, &mut rows);
        for (o, row) in out[..n].iter_mut().zip(rows.chunks_exact(width.max(1))) {
            *o = crate::sampling::argmax(row);
        }
    }
    /// [`Backend::matmul_to_host`] followed by [`crate::sampling::argmax`] of each of its `n` rows into
    /// `out[..n]` (`n` token ids instead of `n × rows` logits come back: greedy decoding's logits readout).
    /// The default computes the logits on the host and takes the argmax there; a GPU takes it on the device
    /// ([`Backend::argmax_rows`]) and copies back the ids only.
    fn matmul_argmax(&self, w: &Self::Weights, x: &Self::Buf, xq: &Self::QAct, n: usize, rows: usize, out: &mut [u32]) {
        let mut logits = vec![0.0; n * rows];
        self.matmul_to_host(w, x, xq, n, &mut logits);
        for (o, row) in out[..n].iter_mut().zip(logits.chunks_exact(rows.max(1))) {
            *o = crate::sampling::argmax(row);
        }
    }

    /// Run-ahead greedy decoding ([`crate::models::forward::decode_ahead`]): whether this backend keeps a
    /// pass's argmax where it computes it ([`Backend::matmul_argmax_ahead`]), embeds it as the next pass's
    /// token without the host ([`Backend::embed_ahead`]) and hands it back later
    /// ([`Backend::take_ahead_id`]), so that the host queues step n + 1 while step n runs. Without it
    /// (the default) run-ahead passes take their argmax at once and the workspace holds it.
    fn runs_ahead(&self) -> bool {
        false
    }
    /// [`Backend::matmul_argmax`] of one row whose id stays on the backend: the queued work is sent to the
    /// device and nothing waits. Ids come back in order from [`Backend::take_ahead_id`]; at most
    /// [`AHEAD_IN_FLIGHT`] may be untaken. Only called where [`Backend::runs_ahead`].
    fn matmul_argmax_ahead(&self, w: &Self::Weights, x: &Self::Buf, xq: &Self::QAct, rows: usize) {
        let _ = (w, x, xq, rows);
        unreachable!("matmul_argmax_ahead on a backend that does not run ahead");
    }
    /// [`Backend::embed`] of one token: `token`, or with `None` the id of the latest
    /// [`Backend::matmul_argmax_ahead`] (one must be untaken), read where it was computed when the pass runs.
    /// Both forms queue the same operations (a device replays one graph for every run-ahead step). Only called
    /// where [`Backend::runs_ahead`].
    fn embed_ahead(&self, table: &Self::Weights, token: Option<u32>, scale: Option<f32>, x: &mut Self::Buf) {
        let _ = (table, token, scale, x);
        unreachable!("embed_ahead on a backend that does not run ahead");
    }
    /// The id of the oldest [`Backend::matmul_argmax_ahead`] not yet taken (waiting for its pass), or `None`
    /// when none is in flight.
    fn take_ahead_id(&self) -> Option<u32> {
        None
    }

    /// The sampling candidates of rows `0..n` of `x` (`width` logits each) at inverse temperature `inv_t`,
    /// `k ≥ 1` slots per row, into `out` (reset to `n` rows of `k`): [`crate::sampling::row_candidates`] of
    /// each row, bit for bit (the scaled logits are single f32 products, the mass follows its fixed lane
    /// order with [`crate::sampling::exp_det`]). Sampled decoding where the logits live: the host draws the
    /// full row's token from them ([`crate::sampling::Sampler::sample_candidates`]) and reads the row only
    /// when they do not decide it. The default reads the rows back and reduces them on the host.
    fn candidate_rows(&self, x: &Self::Buf, n: usize, width: usize, inv_t: f32, k: usize, out: &mut crate::sampling::Candidates) {
        let mut rows = Vec::with_capacity(n * width);
        self.read(x, 0, n, width, &mut rows);
        out.reset(n, k);
        let mut scratch = Vec::new();
        for (r, row) in rows.chunks_exact(width.max(1)).take(n).enumerate() {
            out.fill_row(r, row, inv_t, &mut scratch);
        }
    }

    /// [`Backend::matmul`] plus `bias[r]` on every output row (`bias`: one value per weight row; None: plain
    /// matmul): the product and [`Backend::add_bias`] in one operation (a GPU adds it in the product's epilogue).
    fn matmul_bias(&self, w: &Self::Weights, x: &Self::Buf, xq: &Self::QAct, n: usize, bias: Option<&Self::Buf>, out: &mut Self::Buf) {
        self.matmul(w, x, xq, n, out);
        if let Some(b) = bias {
            self.add_bias(out, n, b);
        }
    }
    /// [`Backend::matmul_bias`] of every `(weights, bias, out)` part, in order, on the same input (q/k/v;
    /// gate/up): one operation, which a GPU runs as one launch when the matrices share a format.
    #[allow(clippy::type_complexity)]
    fn matmul_parts(&self, parts: &mut [(&Self::Weights, Option<&Self::Buf>, &mut Self::Buf)], x: &Self::Buf, xq: &Self::QAct, n: usize) {
        for (w, bias, out) in parts.iter_mut() {
            self.matmul_bias(w, x, xq, n, *bias, out);
        }
    }
    /// The residual add, RMSNorm and int8 quantization that open a block or its FFN, as one operation: on rows
    /// `0..n` (`d` values each, `w`'s length), `x += residual` (when given), `h = rms_norm(x)·w`, and `xq` the
    /// quantization of `h` for `qw` ([`Backend::quantize`]). Equals [`Backend::add`], [`Backend::rms_norm`] and
    /// [`Backend::quantize`] in that order (which is what the default runs; a GPU fuses them in one kernel).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_quantize(
        &self,
        x: &mut Self::Buf,
        residual: Option<&Self::Buf>,
        n: usize,
        d: usize,
        w: &Self::Buf,
        eps: f32,
        h: &mut Self::Buf,
        qw: &Self::Weights,
        xq: &mut Self::QAct,
    ) {
        if let Some(r) = residual {
            self.add(x, r, n * d);
        }
        self.rms_norm(x, 0, n, w, eps, h);
        self.quantize(h, n, d, qw, xq);
    }
    /// [`Backend::gated_act`] on `n` rows of `width` values, then [`Backend::quantize`] of the result for `w`
    /// (the FFN's down projection), as one operation.
    #[allow(clippy::too_many_arguments)]
    fn gated_act_quantize(
        &self,
        act: Activation,
        gate: &mut Self::Buf,
        up: &Self::Buf,
        n: usize,
        width: usize,
        w: &Self::Weights,
        xq: &mut Self::QAct,
    ) {
        self.gated_act(act, gate, up, n * width);
        self.quantize(gate, n, width, w, xq);
    }

    /// RMSNorm of rows `row0..row0 + n` of `x` (width `w`'s length) into rows `0..n` of `out`:
    /// `out = x / sqrt(mean(x²) + eps) · w`.
    fn rms_norm(&self, x: &Self::Buf, row0: usize, n: usize, w: &Self::Buf, eps: f32, out: &mut Self::Buf);
    /// In-place RMSNorm of the first `len` values of `x`, in rows of `w`'s length (per-head q/k norms).
    fn rms_norm_inplace(&self, x: &mut Self::Buf, len: usize, w: &Self::Buf, eps: f32);
    /// `x[t] += b` for rows `t < n` (width `b`'s length).
    fn add_bias(&self, x: &mut Self::Buf, n: usize, b: &Self::Buf);
    /// `x[i] += y[i]` for `i < len` (the residual add).
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize);
    /// `gate[i] = act(gate[i]) · up[i]` for `i < len` (SwiGLU, GeGLU).
    fn gated_act(&self, act: Activation, gate: &mut Self::Buf, up: &Self::Buf, len: usize);
    /// RoPE at `positions[t]` on rows `t < positions.len()` of `q` (`q_width` each) and `k` (`k_width`
    /// each), heads of `head_dim`.
    #[allow(clippy::too_many_arguments)]
    fn rope(&self, rope: &Rope, q: &mut Self::Buf, q_width: usize, k: &mut Self::Buf, k_width: usize, head_dim: usize, positions: &[usize]);

    /// [`Backend::rope`] of `q` and `k` (`kv_width` values per row) at `positions`, then the rows of `k` and `v`
    /// stored at cache rows `row0..` of `kc` and `vc` ([`Backend::store_rows`] of each), as one operation (the
    /// default runs those three; a GPU does them in one kernel).
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        rope: &Rope,
        q: &mut Self::Buf,
        q_width: usize,
        k: &mut Self::Buf,
        v: &Self::Buf,
        kv_width: usize,
        head_dim: usize,
        positions: &[usize],
        kc: &mut Self::Buf,
        vc: &mut Self::Buf,
        row0: usize,
    ) {
        self.rope(rope, q, q_width, k, kv_width, head_dim, positions);
        let n = positions.len();
        self.store_rows(k, n, kv_width, kc, row0);
        self.store_rows(v, n, kv_width, vc, row0);
    }
    /// Copy rows `0..n` of `src` (`width` each) to rows `dst_row..dst_row + n` of `dst` (KV cache writes).
    fn store_rows(&self, src: &Self::Buf, n: usize, width: usize, dst: &mut Self::Buf, dst_row: usize);
    /// Row `dst_row + i` of `dst`, its columns `to` = row `rows[i]` of `src`, its columns `from`, for
    /// `i < rows.len()` (`from.width == to.width`): a layer's output rows into its columns of the target's
    /// feature rows, the accepted ones into a drafter's input rows (DFlash), without leaving the device.
    fn gather_rows(&self, src: &Self::Buf, from: Cols, rows: &[usize], dst: &mut Self::Buf, to: Cols, dst_row: usize);
    /// Within `buf` (rows of `width`): row `base + d` = row `base + path[d]` for `d = 1, 2, …` in that
    /// order (`path[d] ≥ d`; a row may be read before a later `d` overwrites it): the commit of an accepted
    /// tree path's K/V rows to consecutive positions.
    fn commit_rows(&self, buf: &mut Self::Buf, width: usize, base: usize, path: &[usize]);
    /// Attention of `a.t` queries against the cache rows they see ([`Attend`]) into `out`
    /// (`t × n_heads·head_dim`).
    fn attention(&self, a: Attend<'_, Self::Buf>, out: &mut Self::Buf);

    /// [`Backend::attention`] into `out`, then [`Backend::quantize`] of its `t` rows for `w` (the output
    /// projection) into `xq`, as one operation (a GPU quantizes the rows as it writes them).
    fn attention_quantize(&self, a: Attend<'_, Self::Buf>, out: &mut Self::Buf, w: &Self::Weights, xq: &mut Self::QAct) {
        self.attention(a, out);
        self.quantize(out, a.t, a.shape.n_heads * a.shape.head_dim, w, xq);
    }

    /// [`Backend::rope_store`] of the `positions.len()` rows of `q` and `k` (`v` unrotated), whose K/V rows go
    /// to cache rows `row0..` of `kc`, `vc`, then [`Backend::attention_quantize`] of the rotated queries
    /// against those caches (`n_past`, `vis` as in [`Attend`]) into `out` and `xq`, as one operation: a GPU
    /// runs a decode step's three in one kernel. Afterwards `q` and `k` hold either the rotated rows or the
    /// products' (a backend's choice): only the caches, `out` and `xq` are results.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_attention_quantize(
        &self,
        rope: &Rope,
        shape: AttnShape,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        positions: &[usize],
        kc: &mut Self::Buf,
        vc: &mut Self::Buf,
        n_past: usize,
        row0: usize,
        vis: Visibility<'_>,
        out: &mut Self::Buf,
        w: &Self::Weights,
        xq: &mut Self::QAct,
    ) {
        let (qd, kvd, hd) = (shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.head_dim);
        self.rope_store(rope, q, qd, k, v, kvd, hd, positions, kc, vc, row0);
        let a = Attend { shape, q, k: kc, v: vc, n_past, t: positions.len(), vis };
        self.attention_quantize(a, out, w, xq);
    }

    /// Copy rows `row0..row0 + n` of `buf` (`width` each) to the end of `out` (hidden-state readout).
    fn read(&self, buf: &Self::Buf, row0: usize, n: usize, width: usize, out: &mut Vec<f32>);
    /// `dst[..len] = src[..len]` (state snapshots).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, len: usize);
    /// Copy `host` to the start of `dst`.
    fn write(&self, host: &[f32], dst: &mut Self::Buf);
    /// `out[t] = [a[t] ; b[t]]` for rows `t < n` (`width` values each from `a` and `b`).
    fn concat_rows(&self, a: &Self::Buf, b: &Self::Buf, n: usize, width: usize, out: &mut Self::Buf);

    /// Gated attention: rows `t < n` of `qg` hold per head `[q_h, gate_h]` (`2·head_dim` each); write the
    /// q halves to `q` and the gate halves to `gate` (`n_heads·head_dim` per row each).
    fn split_gate(&self, qg: &Self::Buf, n: usize, n_heads: usize, head_dim: usize, q: &mut Self::Buf, gate: &mut Self::Buf);
    /// `x[i] *= σ(gate[i])` for `i < len` (the gated attention's output gate).
    fn mul_sigmoid(&self, x: &mut Self::Buf, gate: &Self::Buf, len: usize);

    /// Gated DeltaNet causal depthwise conv + SiLU of the pre-conv rows `x` (`conv_dim` each) of a tree or
    /// chain (`parents`, one per row; see [`crate::tree`]) into `out`, windows continuing into
    /// `conv_state` (`(K−1) × conv_dim`, read only); `taps`: the weights tap-major (`K × conv_dim`).
    fn gdn_conv(&self, s: &GdnShape, taps: &Self::Buf, conv_state: &Self::Buf, x: &Self::Buf, parents: &[usize], out: &mut Self::Buf);
    /// In place on `n` rows: L2-normalised q, k heads of `c` (q also scaled by `d_k^−½`);
    /// `g ← a_neg·softplus(g + dt_bias)`, `beta ← σ(beta)` (`n × n_v_heads` each).
    #[allow(clippy::too_many_arguments)]
    fn gdn_prepare(
        &self,
        s: &GdnShape,
        c: &mut Self::Buf,
        g: &mut Self::Buf,
        beta: &mut Self::Buf,
        a_neg: &Self::Buf,
        dt_bias: &Self::Buf,
        n: usize,
    );
    /// Chunked (WY) prefill of rows `rows` of the prepared stream, updating `state`
    /// (`n_v_heads × d_k × d_v`), chunks of `chunk` rows from `rows.start`; outputs to the same rows of
    /// `out` (`value_dim` each).
    #[allow(clippy::too_many_arguments)]
    fn gdn_chunked(
        &self,
        s: &GdnShape,
        state: &mut Self::Buf,
        c: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        rows: std::ops::Range<usize>,
        chunk: usize,
        out: &mut Self::Buf,
    );
    /// Tree verification: outputs of every node (`parents`) from the committed `state` (read only), and
    /// the path-cumulative log decays `gamma` and corrections `u` that [`Backend::gdn_commit`] needs.
    #[allow(clippy::too_many_arguments)]
    fn gdn_tree(
        &self,
        s: &GdnShape,
        state: &Self::Buf,
        c: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        parents: &[usize],
        gamma: &mut Self::Buf,
        u: &mut Self::Buf,
        out: &mut Self::Buf,
    );
    /// One token (row 0 of the prepared stream) advancing `state` in place, its output to row 0 of `out`:
    /// [`Backend::gdn_tree`] of the one-node tree then [`Backend::gdn_commit`] of the path `[0]`, fused so the
    /// state is streamed once (the decode step). `gamma` (`n_v_heads`) and `u` (`value_dim`) are scratch.
    #[allow(clippy::too_many_arguments)]
    fn gdn_step(
        &self,
        s: &GdnShape,
        state: &mut Self::Buf,
        c: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        gamma: &mut Self::Buf,
        u: &mut Self::Buf,
        out: &mut Self::Buf,
    );
    /// Apply the accepted root `path` of the last [`Backend::gdn_tree`] to `state` (one rank-|path|
    /// update).
    fn gdn_commit(&self, s: &GdnShape, state: &mut Self::Buf, c: &Self::Buf, gamma: &Self::Buf, u: &Self::Buf, path: &[usize]);
    /// The conv window after accepting `path`: the last `K−1` rows of `conv_state ++ x[path]`.
    fn gdn_conv_commit(&self, s: &GdnShape, conv_state: &mut Self::Buf, x: &Self::Buf, path: &[usize]);
    /// Gated RMSNorm per value head on the first `len` values: `o ← w ⊙ o/√(mean(o²)+ε) ⊙ silu(z)`.
    fn gdn_gated_norm(&self, o: &mut Self::Buf, z: &Self::Buf, w: &Self::Buf, eps: f32, len: usize);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::WeightMatrix;

    #[test]
    fn argmax_rows_and_matmul_argmax_are_the_samplers_argmax() {
        let be = Cpu::new(1);
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        #[rustfmt::skip]
        let rows = [
            1.0, 3.0, 3.0, -2.0, 0.5, // a tie: the lower index
            nan, -inf, 2.0, nan, 2.0, // NaN never wins
            -inf, -inf, -inf, -inf, -inf, // nothing above −∞: 0
            nan, nan, nan, nan, nan,
            -1.0, inf, 4.0, inf, 0.0, // +∞ wins, the first one
        ];
        let mut out = [9u32; 5];
        be.argmax_rows(&be.upload(&rows), 5, 5, &mut out);
        assert_eq!(out, [1, 2, 0, 0, 1]);
        for (row, &o) in rows.chunks(5).zip(&out) {
            assert_eq!(crate::sampling::argmax(row), o);
        }
        // One-hot inputs pick columns of W exactly: column 0 ties rows 2 and 4, column 1 peaks at row 5.
        let (r, c) = (6, 32);
        let mut data: Vec<f32> = (0..r * c).map(|i| ((i * 7919) % 13) as f32 * 0.25 - 1.0).collect();
        for (row, v) in [(2, 9.0), (4, 9.0), (0, 1.0)] {
            data[row * c] = v;
        }
        data[5 * c + 1] = 10.0;
        let w = be.upload_weights(WeightMatrix::f32(r, c, data));
        let mut x = vec![0.0; 2 * c];
        x[0] = 1.0;
        x[c + 1] = 1.0;
        let x = be.upload(&x);
        let mut xq = be.new_qact();
        be.quantize(&x, 2, c, &w, &mut xq);
        let mut ids = [9u32; 2];
        be.matmul_argmax(&w, &x, &xq, 2, r, &mut ids);
        assert_eq!(ids, [2, 5]);
        let mut logits = vec![0.0; 2 * r];
        be.matmul_to_host(&w, &x, &xq, 2, &mut logits);
        assert_eq!(logits[2], 9.0);
        assert_eq!(ids.to_vec(), logits.chunks(r).map(crate::sampling::argmax).collect::<Vec<_>>());
    }

    #[test]
    fn candidate_rows_are_the_samplers_candidates() {
        // One thread on short rows; two threads on rows long enough to be shared out over the pool.
        for (threads, n, width) in [(1, 3, 700), (2, 5, 5000)] {
            let be = Cpu::new(threads);
            let mut rng = 7u64;
            let rows: Vec<f32> = (0..n).flat_map(|r| crate::sampling::tests::random_row(&mut rng, width, r % 3, r % 3 == 2)).collect();
            let mut out = crate::sampling::Candidates::default();
            be.candidate_rows(&be.upload(&rows), n, width, 1.25, 64, &mut out);
            let mut top = Vec::new();
            for r in 0..n {
                let (nf, mass) = crate::sampling::row_candidates(&rows[r * width..(r + 1) * width], 1.25, 64, &mut top);
                assert_eq!(out.row(r), crate::sampling::CandidateRow { top: &top, n_finite: nf, mass });
                assert_eq!(top.len(), 64);
            }
        }
    }
}
