//! [`Cpu`]: the [`Backend`] of eddy's CPU kernels. Buffers are `Vec<f32>`, weights are
//! [`WeightMatrix`] (prepacked for the AVX-512 kernels at upload, [`super::prepack_wanted`]), quantized
//! activations are [`QuantizedActivations`]; the backend owns the worker threads.

use super::activation::{gated_act, Activation};
use super::attention::attention;
use super::gdn::{self, GdnShape};
use super::norm::{rms_norm, rms_norm_inplace};
use super::rope::Rope;
use super::{matmul, quantize_rotated_with, Kernel, QuantizedActivations, ThreadPool};
use crate::backend::{Attend, Backend, Cols};
use crate::quant::WeightMatrix;

/// A hook that sees the input of every product: `(weights, x, n)` with `x` the `n × cols` f32 rows the
/// product reads (before any quantization or rotation of the activations).
pub type MatmulTap = Box<dyn Fn(&WeightMatrix, &[f32], usize) + Send + Sync>;

/// The CPU backend: eddy's kernels on a pool of worker threads (the calling thread included).
pub struct Cpu {
    pool: ThreadPool,
    tap: Option<MatmulTap>,
}

impl Cpu {
    /// A backend running on `threads` threads (at least 1).
    pub fn new(threads: usize) -> Self {
        Cpu { pool: ThreadPool::new(threads.max(1)), tap: None }
    }

    /// A backend that calls `tap` with the inputs of every product before computing it (calibration of
    /// the Hessian-aware rounding, `models::quantize`); otherwise [`Cpu::new`].
    pub fn with_tap(threads: usize, tap: MatmulTap) -> Self {
        Cpu { pool: ThreadPool::new(threads.max(1)), tap: Some(tap) }
    }

    /// The worker threads (for CPU-only code: draft-model kernels, benchmarks).
    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Worker threads, the calling thread included.
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Upload every matrix of `ws` in place (the prepacking of [`crate::quant::prepack_all`], on all
    /// cores), when [`super::prepack_wanted`].
    pub fn upload_all(ws: Vec<&mut WeightMatrix>) {
        if super::prepack_wanted() {
            crate::quant::prepack_all(ws);
        }
    }
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Weights = WeightMatrix;
    type QAct = QuantizedActivations;

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn upload(&self, host: &[f32]) -> Vec<f32> {
        host.to_vec()
    }

    fn upload_weights(&self, mut w: WeightMatrix) -> WeightMatrix {
        Cpu::upload_all(vec![&mut w]);
        w
    }

    fn new_qact(&self) -> QuantizedActivations {
        QuantizedActivations::new()
    }

    fn embed(&self, table: &WeightMatrix, tokens: &[u32], scale: Option<f32>, x: &mut Vec<f32>) {
        let d = table.cols();
        for (i, &tok) in tokens.iter().enumerate() {
            let row = &mut x[i * d..(i + 1) * d];
            table.dequant_row(tok as usize, row);
            if let Some(s) = scale {
                row.iter_mut().for_each(|e| *e *= s);
            }
        }
    }

    fn quantize(&self, x: &Vec<f32>, n: usize, cols: usize, w: &WeightMatrix, xq: &mut QuantizedActivations) {
        let signs = match w {
            WeightMatrix::Q(m) => m.rotation.input.as_deref(),
            _ => None,
        };
        quantize_rotated_with(Kernel::active(), &self.pool, &x[..n * cols], n, cols, signs, xq);
    }

    fn matmul(&self, w: &WeightMatrix, x: &Vec<f32>, xq: &QuantizedActivations, n: usize, out: &mut Vec<f32>) {
        if let Some(tap) = &self.tap {
            tap(w, &x[..n * w.cols()], n);
        }
        matmul(&self.pool, w, &x[..n * w.cols()], xq, n, &mut out[..n * w.rows()]);
    }

    fn matmul_to_host(&self, w: &WeightMatrix, x: &Vec<f32>, xq: &QuantizedActivations, n: usize, out: &mut [f32]) {
        if let Some(tap) = &self.tap {
            tap(w, &x[..n * w.cols()], n);
        }
        matmul(&self.pool, w, &x[..n * w.cols()], xq, n, out);
    }

    fn rms_norm(&self, x: &Vec<f32>, row0: usize, n: usize, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) {
        let d = w.len();
        rms_norm(&x[row0 * d..(row0 + n) * d], w, eps, &mut out[..n * d]);
    }

    fn rms_norm_inplace(&self, x: &mut Vec<f32>, len: usize, w: &Vec<f32>, eps: f32) {
        rms_norm_inplace(&mut x[..len], w, eps);
    }

    fn add_bias(&self, x: &mut Vec<f32>, n: usize, b: &Vec<f32>) {
        for row in x[..n * b.len()].chunks_exact_mut(b.len()) {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        for (a, &b) in x[..len].iter_mut().zip(&y[..len]) {
            *a += b;
        }
    }

    fn gated_act(&self, act: Activation, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) {
        gated_act(act, &mut gate[..len], &up[..len]);
    }

    fn rope(&self, rope: &Rope, q: &mut Vec<f32>, q_width: usize, k: &mut Vec<f32>, k_width: usize, head_dim: usize, positions: &[usize]) {
        for (i, &pos) in positions.iter().enumerate() {
            let (qi, ki) = (&mut q[i * q_width..(i + 1) * q_width], &mut k[i * k_width..(i + 1) * k_width]);
            rope.apply_all(&mut [qi, ki], head_dim, pos);
        }
    }

    fn store_rows(&self, src: &Vec<f32>, n: usize, width: usize, dst: &mut Vec<f32>, dst_row: usize) {
        dst[dst_row * width..(dst_row + n) * width].copy_from_slice(&src[..n * width]);
    }

    fn gather_rows(&self, src: &Vec<f32>, from: Cols, rows: &[usize], dst: &mut Vec<f32>, to: Cols, dst_row: usize) {
        assert!(
            from.width == to.width && from.col + from.width <= from.stride && to.col + to.width <= to.stride,
            "gather_rows: bad columns"
        );
        for (i, &r) in rows.iter().enumerate() {
            let s = r * from.stride + from.col;
            let d = (dst_row + i) * to.stride + to.col;
            dst[d..d + to.width].copy_from_slice(&src[s..s + from.width]);
        }
    }

    fn commit_rows(&self, buf: &mut Vec<f32>, width: usize, base: usize, path: &[usize]) {
        for (d, &node) in path.iter().enumerate().filter(|&(d, &node)| node != d) {
            buf.copy_within((base + node) * width..(base + node + 1) * width, (base + d) * width);
        }
    }

    fn attention(&self, a: Attend<'_, Vec<f32>>, out: &mut Vec<f32>) {
        let (s, t) = (&a.shape, a.t);
        let qd = s.n_heads * s.head_dim;
        attention(&self.pool, s, &a.q[..t * qd], a.k, a.v, a.n_past, t, a.vis, &mut out[..t * qd]);
    }

    fn candidate_rows(&self, x: &Vec<f32>, n: usize, width: usize, inv_t: f32, k: usize, out: &mut crate::sampling::Candidates) {
        // The trait's reduction on the rows where they are (no copy); several long rows (a DFlash block's
        // 15 readout rows) are shared out over the pool, one row per task (each row's answer is computed
        // alone, so the split changes no bit).
        out.reset(n, k);
        let w = width.max(1);
        if n < 2 || self.pool.n_threads() == 1 || width < 4096 {
            let mut scratch = Vec::new();
            for (r, row) in x[..n * width].chunks_exact(w).enumerate() {
                out.fill_row(r, row, inv_t, &mut scratch);
            }
            return;
        }
        // Per row: its candidates, n_finite and mass.
        type RowAnswer = (Vec<(f32, u32)>, usize, f64);
        let rows: Vec<std::sync::Mutex<RowAnswer>> = (0..n).map(|_| Default::default()).collect();
        self.pool.parallel_for(n, 1, |range| {
            for r in range {
                let mut g = rows[r].lock().unwrap_or_else(|e| e.into_inner());
                let (top, nf, mass) = &mut *g;
                (*nf, *mass) = crate::sampling::row_candidates(&x[r * w..(r + 1) * w], inv_t, k, top);
            }
        });
        for (r, m) in rows.into_iter().enumerate() {
            let (top, nf, mass) = m.into_inner().unwrap_or_else(|e| e.into_inner());
            out.top[r * k..r * k + top.len()].copy_from_slice(&top);
            out.n_finite[r] = nf;
            out.mass[r] = mass;
        }
    }

    fn read(&self, buf: &Vec<f32>, row0: usize, n: usize, width: usize, out: &mut Vec<f32>) {
        out.extend_from_slice(&buf[row0 * width..(row0 + n) * width]);
    }

    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) {
        dst[..len].copy_from_slice(&src[..len]);
    }

    fn write(&self, host: &[f32], dst: &mut Vec<f32>) {
        dst[..host.len()].copy_from_slice(host);
    }

    fn concat_rows(&self, a: &Vec<f32>, b: &Vec<f32>, n: usize, width: usize, out: &mut Vec<f32>) {
        for i in 0..n {
            out[2 * i * width..(2 * i + 1) * width].copy_from_slice(&a[i * width..(i + 1) * width]);
            out[(2 * i + 1) * width..(2 * i + 2) * width].copy_from_slice(&b[i * width..(i + 1) * width]);
        }
    }

    fn split_gate(&self, qg: &Vec<f32>, n: usize, n_heads: usize, head_dim: usize, q: &mut Vec<f32>, gate: &mut Vec<f32>) {
        let (hd, qd) = (head_dim, n_heads * head_dim);
        for i in 0..n {
            for hh in 0..n_heads {
                let src = &qg[i * 2 * qd + hh * 2 * hd..i * 2 * qd + (hh + 1) * 2 * hd];
                q[i * qd + hh * hd..i * qd + (hh + 1) * hd].copy_from_slice(&src[..hd]);
                gate[i * qd + hh * hd..i * qd + (hh + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
    }

    fn mul_sigmoid(&self, x: &mut Vec<f32>, gate: &Vec<f32>, len: usize) {
        for (o, &g) in x[..len].iter_mut().zip(&gate[..len]) {
            *o *= 1.0 / (1.0 + (-g).exp());
        }
    }

    fn gdn_conv(&self, s: &GdnShape, taps: &Vec<f32>, conv_state: &Vec<f32>, x: &Vec<f32>, parents: &[usize], out: &mut Vec<f32>) {
        let n = parents.len() * s.conv_dim();
        gdn::conv_silu(taps, s.kernel, conv_state, &x[..n], parents, &mut out[..n]);
    }

    fn gdn_prepare(
        &self,
        s: &GdnShape,
        c: &mut Vec<f32>,
        g: &mut Vec<f32>,
        beta: &mut Vec<f32>,
        a_neg: &Vec<f32>,
        dt_bias: &Vec<f32>,
        n: usize,
    ) {
        let hv = s.n_v_heads;
        gdn::prepare(s, &mut c[..n * s.conv_dim()], &mut g[..n * hv], &mut beta[..n * hv], a_neg, dt_bias, n);
    }

    fn gdn_chunked(
        &self,
        s: &GdnShape,
        state: &mut Vec<f32>,
        c: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        rows: std::ops::Range<usize>,
        chunk: usize,
        out: &mut Vec<f32>,
    ) {
        let (cd, hv, vd) = (s.conv_dim(), s.n_v_heads, s.value_dim());
        let (u, v) = (rows.start, rows.end);
        let (cs, gs, bs) = (&c[u * cd..v * cd], &g[u * hv..v * hv], &beta[u * hv..v * hv]);
        gdn::chunked(&self.pool, s, state, cs, gs, bs, v - u, chunk, &mut out[u * vd..v * vd]);
    }

    fn gdn_tree(
        &self,
        s: &GdnShape,
        state: &Vec<f32>,
        c: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        parents: &[usize],
        gamma: &mut Vec<f32>,
        u: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        let (n, cd, hv, vd) = (parents.len(), s.conv_dim(), s.n_v_heads, s.value_dim());
        let (cs, gs, bs) = (&c[..n * cd], &g[..n * hv], &beta[..n * hv]);
        gdn::wy_outputs(&self.pool, s, state, cs, gs, bs, parents, &mut gamma[..n * hv], &mut u[..n * vd], &mut out[..n * vd]);
    }

    fn gdn_step(
        &self,
        s: &GdnShape,
        state: &mut Vec<f32>,
        c: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        gamma: &mut Vec<f32>,
        u: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        gdn::step(&self.pool, s, state, c, g, beta, gamma, u, out);
    }

    fn gdn_commit(&self, s: &GdnShape, state: &mut Vec<f32>, c: &Vec<f32>, gamma: &Vec<f32>, u: &Vec<f32>, path: &[usize]) {
        gdn::apply_path(&self.pool, s, state, c, gamma, u, path);
    }

    fn gdn_conv_commit(&self, s: &GdnShape, conv_state: &mut Vec<f32>, x: &Vec<f32>, path: &[usize]) {
        gdn::conv_commit(conv_state, s.conv_dim(), s.kernel, x, path);
    }

    fn gdn_gated_norm(&self, o: &mut Vec<f32>, z: &Vec<f32>, w: &Vec<f32>, eps: f32, len: usize) {
        gdn::gated_rms_norm(&mut o[..len], &z[..len], w, eps);
    }
}
