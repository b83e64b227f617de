//! CPU matmul benchmarks.
//!
//! Formats: `q4` (bits 4, f16 scale + min: Q4_1-like), `q5` (bits 5, f16 implicit: Q5_0), `q6` (bits 6,
//! group 16, k-quant scales: Q6_K), `q8` (bits 8, f16 implicit: Q8_0).
//!
//! * `gemv_q*`: one token (decode) at 1536×1536, 8960×1536 and 1536×8960 (rows×cols),
//!   1 and 2 threads; throughput = weight bytes streamed per call (`WeightMatrix::nbytes`).
//! * `gemm_q*`: 128 tokens (prefill); throughput in "elements" = 2·rows·cols·n
//!   operations (multiply + add), i.e. read Gelem/s as GOP/s.
//!
//! * `gemv_cold_*`: like `gemv_*` at 8960×1536 but rotating through ≥ 384 MB of weight copies, so the
//!   weights come from DRAM (the plain `gemv_*` sizes fit in L2/L3 and measure cache bandwidth).
//! * `small_*`: n = 2..8 tokens at 1536×1536 (speculative decoding), GOP/s.
//! * `small_cold_*`: n = 1..16 tokens at 8960×1536 from DRAM, 2 threads (verify passes), natural and
//!   prepacked layout.
//!
//! Activations are quantized once outside the timed loop.
//! Run: `cargo bench -p eddy --bench matmul -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use eddy::backend::cpu::{matmul, quantize_activations, Kernel, QuantizedActivations, ThreadPool};
use eddy::quant::{GroupScales, QMatrix, WeightMatrix, QK};
use half::f16;
use std::hint::black_box;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn f(&mut self) -> f32 {
        (self.next() & 0xFFFFFF) as f32 / 16777216.0
    }
}

fn qm(bits: u8, rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    let n = rows * cols;
    let group = if bits == 6 { 16 } else { QK };
    let ng = n / group;
    let scales = match bits {
        4 => GroupScales::F16 {
            scale: (0..ng).map(|_| f16::from_f32(0.001 + 0.01 * rng.f())).collect(),
            min: Some((0..ng).map(|_| f16::from_f32(-0.05 * rng.f())).collect()),
        },
        6 => GroupScales::SuperI8 {
            sc: (0..ng).map(|_| rng.next() as i8).collect(),
            mn: None,
            d: (0..n / 256).map(|_| 0.0001 * rng.f()).collect(),
            dmin: vec![],
        },
        _ => GroupScales::F16 { scale: (0..ng).map(|_| f16::from_f32(0.001 + 0.01 * rng.f())).collect(), min: None },
    };
    qmatrix(bits, rows, cols, group, scales, rng)
}

fn qmatrix(bits: u8, rows: usize, cols: usize, group: usize, scales: GroupScales, rng: &mut Rng) -> WeightMatrix {
    let n = rows * cols;
    let planes = if bits == 5 || bits == 6 { bits as usize - 4 } else { 0 };
    WeightMatrix::Q(QMatrix {
        rows,
        cols,
        bits,
        group,
        lo: (0..if bits == 8 { n } else { n / 2 }).map(|_| rng.next() as u8).collect(),
        hi: (0..n / QK * 4 * planes).map(|_| rng.next() as u8).collect(),
        scales,
        packed: None,
        rotation: Default::default(),
    })
}
fn q4(r: usize, c: usize, g: &mut Rng) -> WeightMatrix {
    qm(4, r, c, g)
}
fn q5(r: usize, c: usize, g: &mut Rng) -> WeightMatrix {
    qm(5, r, c, g)
}
fn q6(r: usize, c: usize, g: &mut Rng) -> WeightMatrix {
    qm(6, r, c, g)
}
fn q8(r: usize, c: usize, g: &mut Rng) -> WeightMatrix {
    qm(8, r, c, g)
}
/// Bits 4, group 32, k-quant scales with offsets (Q4_K, eddy's `k`), prepacked.
fn q4k(rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    let n = rows * cols;
    let scales = GroupScales::SuperI8 {
        sc: (0..n / QK).map(|_| (rng.next() % 64) as i8).collect(),
        mn: Some((0..n / QK).map(|_| (rng.next() % 64) as i8).collect()),
        d: (0..n / 256).map(|_| 0.0001 * rng.f()).collect(),
        dmin: (0..n / 256).map(|_| -0.0001 * rng.f()).collect(),
    };
    packed(qmatrix(4, rows, cols, QK, scales, rng))
}
/// [`q6`] (Q6_K, eddy's `k6`), prepacked.
fn q6k(rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    packed(qm(6, rows, cols, rng))
}
/// Bits 6, group 32, k-quant scales with the implicit offset (eddy's `k6` at group 32), prepacked.
fn q6k32(rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    let n = rows * cols;
    let scales = GroupScales::SuperI8 {
        sc: (0..n / QK).map(|_| rng.next() as i8).collect(),
        mn: None,
        d: (0..n / 256).map(|_| 0.0001 * rng.f()).collect(),
        dmin: vec![],
    };
    packed(qmatrix(6, rows, cols, QK, scales, rng))
}
fn packed(mut w: WeightMatrix) -> WeightMatrix {
    if let WeightMatrix::Q(m) = &mut w {
        m.prepack();
        m.drop_natural();
    }
    w
}
type Make = fn(usize, usize, &mut Rng) -> WeightMatrix;
const FORMATS: [(&str, Make); 4] = [("q4", q4), ("q5", q5), ("q6", q6), ("q8", q8)];

fn bench(c: &mut Criterion) {
    eprintln!("eddy kernel path: {:?}", Kernel::active());
    let mut rng = Rng(42);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let shapes = [(1536usize, 1536usize), (8960, 1536), (1536, 8960)];
    for (name, make) in FORMATS {
        let mut g = c.benchmark_group(format!("gemv_{name}"));
        for &(rows, cols) in &shapes {
            let w = make(rows, cols, &mut rng);
            let x: Vec<f32> = (0..cols).map(|_| rng.f() * 2.0 - 1.0).collect();
            let mut xq = QuantizedActivations::new();
            quantize_activations(&pools[0], &x, 1, cols, &mut xq);
            let mut out = vec![0f32; rows];
            g.throughput(Throughput::Bytes(w.nbytes() as u64));
            for pool in &pools {
                let id = BenchmarkId::new(format!("{rows}x{cols}"), format!("t{}", pool.n_threads()));
                g.bench_function(id, |b| b.iter(|| matmul(pool, black_box(&w), &[], &xq, 1, &mut out)));
            }
        }
        g.finish();

        let n = 128;
        let mut g = c.benchmark_group(format!("gemm_{name}"));
        g.sample_size(10);
        for &(rows, cols) in &shapes[..2] {
            let w = make(rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0 - 1.0).collect();
            let mut xq = QuantizedActivations::new();
            quantize_activations(&pools[0], &x, n, cols, &mut xq);
            let mut out = vec![0f32; n * rows];
            g.throughput(Throughput::Elements((2 * rows * cols * n) as u64));
            for pool in &pools {
                let id = BenchmarkId::new(format!("{rows}x{cols}_n{n}"), format!("t{}", pool.n_threads()));
                g.bench_function(id, |b| b.iter(|| matmul(pool, black_box(&w), &[], &xq, n, &mut out)));
            }
        }
        g.finish();
    }
}

/// Random `rows × cols` matrices of one format, ≥ 384 MB in all (far more than L3).
fn dram_copies(make: Make, rows: usize, cols: usize, rng: &mut Rng) -> Vec<WeightMatrix> {
    let first = make(rows, cols, rng);
    let copies = (384 << 20) / first.nbytes() + 1;
    std::iter::once(first).chain((1..copies).map(|_| make(rows, cols, rng))).collect()
}

/// Decode from DRAM: rotate through copies of an 8960×1536 matrix totalling ≥ 128 MB (> L3), so every
/// call streams its weights from memory.
fn cold(c: &mut Criterion) {
    let mut rng = Rng(9);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let (rows, cols) = (8960, 1536);
    for (name, make) in FORMATS {
        let ws = dram_copies(make, rows, cols, &mut rng);
        let x: Vec<f32> = (0..cols).map(|_| rng.f() * 2.0 - 1.0).collect();
        let mut xq = QuantizedActivations::new();
        quantize_activations(&pools[0], &x, 1, cols, &mut xq);
        let mut out = vec![0f32; rows];
        let mut g = c.benchmark_group(format!("gemv_cold_{name}"));
        g.throughput(Throughput::Bytes(ws[0].nbytes() as u64));
        for pool in &pools {
            let mut i = 0;
            let id = BenchmarkId::new(format!("{rows}x{cols}"), format!("t{}", pool.n_threads()));
            g.bench_function(id, |b| {
                b.iter(|| {
                    i = (i + 1) % ws.len();
                    matmul(pool, black_box(&ws[i]), &[], &xq, 1, &mut out)
                })
            });
        }
        g.finish();
    }
}

/// Small batches (speculative decoding): throughput in GOP/s as in `gemm_*`; shows the GEMV → GEMM
/// switch.
fn small(c: &mut Criterion) {
    let mut rng = Rng(7);
    let pool = ThreadPool::new(1);
    for (name, make) in FORMATS {
        let mut g = c.benchmark_group(format!("small_{name}"));
        let (rows, cols) = (1536, 1536);
        let w = make(rows, cols, &mut rng);
        for n in [2usize, 4, 6, 8] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0 - 1.0).collect();
            let mut xq = QuantizedActivations::new();
            quantize_activations(&pool, &x, n, cols, &mut xq);
            let mut out = vec![0f32; n * rows];
            g.throughput(Throughput::Elements((2 * rows * cols * n) as u64));
            g.bench_function(format!("{rows}x{cols}_n{n}/t1"), |b| b.iter(|| matmul(&pool, black_box(&w), &[], &xq, n, &mut out)));
        }
        g.finish();
    }
}

/// Speculative verification from DRAM: n = 1..16 tokens at 8960×1536 rotating through ≥ 384 MB of
/// weight copies (as `gemv_cold_*`), 2 threads; throughput = weight bytes per call, so the ratio to `n1`
/// is the cost of the extra tokens. `/t2`: natural layout only; `/t2_packed`: with the prepacked layout
/// ([`QMatrix::prepack`], used on the AVX-512 path), same copies in the same run.
fn small_cold(c: &mut Criterion) {
    let mut rng = Rng(11);
    let pool = ThreadPool::new(2);
    let (rows, cols) = (8960, 1536);
    for (name, make) in FORMATS {
        let mut ws = dram_copies(make, rows, cols, &mut rng);
        let mut g = c.benchmark_group(format!("small_cold_{name}"));
        g.throughput(Throughput::Bytes(ws[0].nbytes() as u64));
        for packed in [false, true] {
            if packed {
                for w in &mut ws {
                    if let WeightMatrix::Q(m) = w {
                        m.prepack();
                    }
                }
            }
            let suffix = if packed { "_packed" } else { "" };
            for n in [1usize, 2, 3, 4, 6, 8, 12, 16] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0 - 1.0).collect();
                let mut xq = QuantizedActivations::new();
                quantize_activations(&pool, &x, n, cols, &mut xq);
                let mut out = vec![0f32; n * rows];
                let mut i = 0;
                g.bench_function(format!("{rows}x{cols}_n{n}/t2{suffix}"), |b| {
                    b.iter(|| {
                        i = (i + 1) % ws.len();
                        matmul(&pool, black_box(&ws[i]), &[], &xq, n, &mut out)
                    })
                });
            }
        }
        g.finish();
    }
}

/// The k-quant formats on the prepacked layout (the layout models run on): `q4k` (Q4_K, eddy's `k`),
/// `q6k` (Q6_K, eddy's `k6`) and `q6k32` (eddy's `k6/32`: groups of 32, run on AMX where `q6k` is not), 8960×1536 rotating through ≥ 384 MB of copies, 1 and 2 threads. `n1`: decode,
/// throughput = weight bytes per call; `n128`: prefill, throughput in GOP/s as in `gemm_*`; `n4`..`n64`
/// (tree verification sizes, AMX from n = 2): `t1_cpu` only.
fn packed_k(c: &mut Criterion) {
    let mut rng = Rng(13);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let (rows, cols) = (8960, 1536);
    const K: [(&str, Make); 3] = [("q4k", q4k), ("q6k", q6k), ("q6k32", q6k32)];
    for (name, make) in K {
        let ws = dram_copies(make, rows, cols, &mut rng);
        let mut g = c.benchmark_group(format!("packed_{name}"));
        for n in [1usize, 4, 8, 16, 64, 128] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f() * 2.0 - 1.0).collect();
            let mut xq = QuantizedActivations::new();
            quantize_activations(&pools[0], &x, n, cols, &mut xq);
            let mut out = vec![0f32; n * rows];
            if n == 1 {
                g.throughput(Throughput::Bytes(ws[0].nbytes() as u64));
            } else {
                g.sample_size(10);
                g.throughput(Throughput::Elements((2 * rows * cols * n) as u64));
            }
            for pool in pools.iter().filter(|_| n == 1 || n == 128) {
                let mut i = 0;
                g.bench_function(format!("{rows}x{cols}_n{n}/t{}", pool.n_threads()), |b| {
                    b.iter(|| {
                        i = (i + 1) % ws.len();
                        matmul(pool, black_box(&ws[i]), &[], &xq, n, &mut out)
                    })
                });
            }
            // One thread timed by its own CPU time (the calling thread runs the whole product): robust
            // to other processes on a shared machine, for A/B comparisons of the kernels.
            let mut i = 0;
            g.bench_function(format!("{rows}x{cols}_n{n}/t1_cpu"), |b| {
                b.iter_custom(|iters| {
                    let t = thread_cpu_time();
                    for _ in 0..iters {
                        i = (i + 1) % ws.len();
                        matmul(&pools[0], black_box(&ws[i]), &[], &xq, n, &mut out);
                    }
                    thread_cpu_time() - t
                })
            });
        }
        g.finish();
    }
}

/// CPU time of the calling thread.
fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_THREAD_CPUTIME_ID is always available on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

criterion_group!(benches, bench, cold, small, small_cold, packed_k);
criterion_main!(benches);
