use super::*;
use crate::quant::{GroupScales, QMatrix};
use half::f16;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::parity::Rng;

/// Scale encodings of [`QMatrix`] under test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Sc {
    F16Implicit,
    F16Min,
    SuperMin,
    SuperImplicit,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// bits, group, scales.
    Q(u8, usize, Sc),
    F32,
    Bf16,
}
/// Every bits × scales combination the imports produce (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
/// and the `--quant` formats), plus a few more the format allows.
const KINDS: [Kind; 18] = [
    Kind::Q(4, 32, Sc::F16Implicit),
    Kind::Q(4, 32, Sc::F16Min),
    Kind::Q(4, 32, Sc::SuperMin),
    Kind::Q(5, 32, Sc::F16Implicit),
    Kind::Q(5, 32, Sc::F16Min),
    Kind::Q(5, 32, Sc::SuperMin),
    Kind::Q(6, 16, Sc::SuperImplicit),
    Kind::Q(8, 32, Sc::F16Implicit),
    Kind::Q(6, 32, Sc::F16Min),
    Kind::Q(8, 32, Sc::SuperImplicit),
    Kind::Q(4, 16, Sc::SuperImplicit),
    Kind::Q(5, 16, Sc::F16Implicit),
    // eddy's M and L formats (`quant::rtn`): groups of 64 and 128.
    Kind::Q(4, 64, Sc::F16Min),
    Kind::Q(4, 128, Sc::F16Min),
    Kind::Q(8, 64, Sc::F16Implicit),
    Kind::Q(8, 128, Sc::F16Implicit),
    Kind::F32,
    Kind::Bf16,
];

/// Row length to test `kind` at for a requested `cols` (a multiple of 32 and of the group; SuperI8 scales
/// take any multiple of 32, a row's last super-block partial, e.g. 96, 576 = 2·256 + 64, 896 = 3·256 + 128).
fn cols_for(kind: Kind, cols: usize) -> usize {
    match kind {
        Kind::Q(_, group, _) => cols.next_multiple_of(group.max(QK)),
        _ => cols,
    }
}

fn rand_weights(kind: Kind, rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    match kind {
        Kind::Q(bits, group, sc) => {
            let n = rows * cols;
            let planes = if bits == 5 || bits == 6 { bits as usize - 4 } else { 0 };
            let lo_len = if bits == 8 { n } else { n / 2 };
            let ng = n / group;
            let scales = match sc {
                Sc::F16Implicit | Sc::F16Min => GroupScales::F16 {
                    scale: (0..ng).map(|_| f16::from_f32(rng.nz(0.002, 0.02))).collect(),
                    min: (sc == Sc::F16Min).then(|| (0..ng).map(|_| f16::from_f32(rng.nz(0.01, 0.2))).collect()),
                },
                Sc::SuperMin | Sc::SuperImplicit => GroupScales::SuperI8 {
                    sc: (0..ng).map(|_| rng.next() as i8).collect(),
                    mn: (sc == Sc::SuperMin).then(|| (0..ng).map(|_| rng.next() as i8).collect()),
                    d: (0..rows * crate::quant::super_blocks(cols)).map(|_| rng.nz(0.00002, 0.0002)).collect(),
                    dmin: if sc == Sc::SuperMin {
                        (0..rows * crate::quant::super_blocks(cols)).map(|_| rng.nz(0.0001, 0.002)).collect()
                    } else {
                        vec![]
                    },
                },
            };
            WeightMatrix::Q(QMatrix {
                rows,
                cols,
                bits,
                group,
                lo: (0..lo_len).map(|_| rng.next() as u8).collect(),
                hi: (0..n / QK * 4 * planes).map(|_| rng.next() as u8).collect(),
                scales,
                packed: None,
                rotation: Default::default(),
            })
        }
        Kind::F32 => WeightMatrix::f32(rows, cols, (0..rows * cols).map(|_| rng.nz(0.001, 0.1)).collect()),
        Kind::Bf16 => {
            WeightMatrix::Bf16 { rows, cols, data: (0..rows * cols).map(|_| (rng.nz(0.001, 0.1).to_bits() >> 16) as u16).collect() }
        }
    }
}

/// Activations in ±[0.01, 1) with occasional outliers; never zero.
fn rand_x(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n * cols).map(|_| if rng.next() % 50 == 7 { rng.nz(2.0, 20.0) } else { rng.nz(0.01, 1.0) }).collect()
}

/// Σ of absolute values of every term the product is made of (the scale for tolerances).
fn magnitude(w: &WeightMatrix, x: &[f32], xq: &QuantizedActivations, r: usize, t: usize) -> f64 {
    let cols = w.cols();
    match w {
        WeightMatrix::Q(m) => (0..cols)
            .map(|c| {
                let g = c / m.group;
                let (sw, mn) = m.scale_min(r, g);
                let mn = mn.unwrap_or(-((1i32 << (m.bits - 1)) as f32) * sw);
                let d = xq.scale[t * (cols / QK) + c / QK] as f64;
                let q = m.code(r, c) as f64;
                d * (sw.abs() as f64 * q + mn.abs() as f64) * (xq.q[t * cols + c] as f64).abs()
            })
            .sum(),
        _ => {
            let mut row = vec![0f32; cols];
            w.dequant_row(r, &mut row);
            (0..cols).map(|c| (row[c] as f64 * x[t * cols + c] as f64).abs()).sum()
        }
    }
}

fn quantize(kernel: Kernel, x: &[f32], n: usize, cols: usize) -> QuantizedActivations {
    let pool = ThreadPool::new(1);
    let mut xq = QuantizedActivations::new();
    quantize_activations_with(kernel, &pool, x, n, cols, &mut xq);
    xq
}

#[test]
fn pool_run_visits_every_index_once() {
    for n in 1..=4 {
        let pool = ThreadPool::new(n);
        assert_eq!(pool.n_threads(), n);
        for iter in 0..2000 {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(|i, nt| {
                assert_eq!(nt, n);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "iteration {iter}");
            if iter % 500 == 499 {
                // Let workers park, then wake them again.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }
}

#[test]
fn pool_parallel_for_covers_range_exactly_once() {
    let mut rng = Rng(7);
    let pool = ThreadPool::new(3);
    for _ in 0..300 {
        let n = rng.int(0, 2000) as usize;
        let min_chunk = rng.int(1, 64) as usize;
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.parallel_for(n, min_chunk, |range| {
            assert!(range.start % min_chunk == 0, "chunks start at multiples of min_chunk");
            for i in range {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }
}

#[test]
fn pool_nested_calls_run_serially_and_panics_propagate() {
    let pool = ThreadPool::new(2);
    let total = AtomicUsize::new(0);
    pool.run(|_, _| {
        pool.parallel_for(100, 10, |r| {
            total.fetch_add(r.len(), Ordering::Relaxed);
        })
    });
    assert_eq!(total.load(Ordering::Relaxed), 200);
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run(|i, _| {
            if i == 1 {
                panic!("boom");
            }
        })
    }));
    assert!(res.is_err());
    let count = AtomicUsize::new(0);
    pool.run(|_, _| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 2, "pool still usable after a panic");
}

#[test]
fn pool_late_workers_never_lose_or_repeat_work() {
    // More workers than cores, and tiny jobs back to back: workers routinely arrive after the caller has
    // closed a job (their indices then run on the caller). Every index and every chunk must run exactly once.
    let pool = ThreadPool::new(5);
    for round in 0..3000 {
        let hits: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
        pool.run(|i, n| {
            assert_eq!(n, 5);
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
        let seen: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
        pool.parallel_for(97, 3, |r| {
            for i in r {
                seen[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(seen.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
    }
}

#[test]
fn kernel_parse_and_availability() {
    assert_eq!(Kernel::parse("AVX512"), Some(Kernel::Avx512));
    assert_eq!(Kernel::parse("avx2"), Some(Kernel::Avx2));
    assert_eq!(Kernel::parse("scalar"), Some(Kernel::Scalar));
    assert_eq!(Kernel::parse("sse"), None);
    assert!(Kernel::Scalar.is_available());
    assert!(Kernel::active() <= Kernel::detect());
    assert!(Kernel::available().contains(&Kernel::active()));
}

#[test]
fn quantize_simd_matches_scalar_exactly() {
    let mut rng = Rng(1);
    for &cols in &[32usize, 96, 576, 928] {
        for &n in &[1usize, 3, 7] {
            let mut x = rand_x(n, cols, &mut rng);
            // Special groups: all zero, tiny, exact ties after scaling, one huge value.
            x[..QK].fill(0.0);
            if n * cols >= 4 * QK {
                x[QK..2 * QK].iter_mut().for_each(|v| *v *= 1e-32);
                // amax = 127 → inverse scale 1: codes hit k + 0.5 ties exactly.
                x[2 * QK] = 127.0;
                for j in 1..QK {
                    x[2 * QK + j] = j as f32 - 15.5;
                }
                x[3 * QK + 5] = 1e6;
            }
            let want = quantize(Kernel::Scalar, &x, n, cols);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for k in Kernel::available() {
                let got = quantize(k, &x, n, cols);
                assert_eq!(got.q, want.q, "{k:?} codes");
                assert_eq!(got.sum16, want.sum16, "{k:?} half-group sums");
                assert_eq!(got.sum, want.sum, "{k:?} sums");
                assert_eq!(bits(&got.dsum), bits(&want.dsum), "{k:?} dsums");
                assert_eq!(bits(&got.scale), bits(&want.scale), "{k:?} scales");
            }
            // Invariants: codes in range, sums match, reconstruction error ≤ d/2.
            for g in 0..n * cols / QK {
                let d = want.scale[g];
                let mut s = 0;
                for j in 0..QK {
                    let i = g * QK + j;
                    let q = want.q[i] as i32;
                    assert!((-127..=127).contains(&q));
                    s += q;
                    assert!((x[i] - d * q as f32).abs() <= d * 0.5001 + 1e-30, "group {g}");
                }
                assert_eq!(s, want.sum[g]);
                let h: i32 = want.q[g * QK..g * QK + 16].iter().map(|&v| v as i32).sum();
                assert_eq!((want.sum16[2 * g], want.sum16[2 * g + 1]), (h, s - h));
                assert_eq!(want.dsum[g].to_bits(), (d * s as f32).to_bits());
            }
            assert_eq!(want.scale[0], 0.0);
            assert!(want.q[..QK].iter().all(|&q| q == 0));
        }
    }
}

#[test]
fn quantize_reuses_buffers_and_splits_across_threads() {
    let mut rng = Rng(2);
    let (n, cols) = (300, 576);
    let x = rand_x(n, cols, &mut rng);
    let want = quantize(Kernel::Scalar, &x, n, cols);
    let pool = ThreadPool::new(3);
    let mut xq = QuantizedActivations::new();
    quantize_activations(&pool, &x, n, cols, &mut xq);
    let ptr = xq.q.as_ptr();
    quantize_activations(&pool, &x[..cols], 1, cols, &mut xq);
    quantize_activations(&pool, &x, n, cols, &mut xq);
    assert_eq!(ptr, xq.q.as_ptr(), "no reallocation once large enough");
    assert_eq!(xq.q, want.q);
    assert_eq!(xq.scale, want.scale);
}

#[test]
fn matmul_all_paths_match_reference() {
    let mut rng = Rng(3);
    let pool = ThreadPool::new(2);
    for kind in KINDS {
        for &rows in &[1usize, 7, 33, 97] {
            for &cols in &[32usize, 96, 576, 928] {
                let cols = cols_for(kind, cols);
                let w = rand_weights(kind, rows, cols, &mut rng);
                for &n in &[1usize, 2, 4, 5, 9] {
                    let x = rand_x(n, cols, &mut rng);
                    let xq = quantize(Kernel::Scalar, &x, n, cols);
                    let mut want = vec![0f32; n * rows];
                    matmul_reference(&w, &x, &xq, n, &mut want);
                    for k in Kernel::available() {
                        let mut got = vec![f32::NAN; n * rows];
                        matmul_with(k, &pool, &w, &x, &xq, n, &mut got);
                        for t in 0..n {
                            for r in 0..rows {
                                let (g, e) = (got[t * rows + r], want[t * rows + r]);
                                let tol = 1e-5 * magnitude(&w, &x, &xq, r, t) + 1e-30;
                                assert!(
                                    ((g - e) as f64).abs() <= tol,
                                    "{kind:?} {k:?} rows={rows} cols={cols} n={n} r={r} t={t}: {g} vs {e} (tol {tol})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_is_batch_and_thread_invariant_bitwise() {
    let mut rng = Rng(4);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    for kind in KINDS {
        for &(rows, cols) in &[(203usize, 928usize), (45, 96)] {
            let cols = cols_for(kind, cols);
            let w = rand_weights(kind, rows, cols, &mut rng);
            let nmax = 17;
            let x = rand_x(nmax, cols, &mut rng);
            let xq_all = quantize(Kernel::Scalar, &x, nmax, cols);
            for k in Kernel::available() {
                // Single-token results, one call per token.
                let mut single = vec![0f32; nmax * rows];
                for t in 0..nmax {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let xq = quantize(k, xt, 1, cols);
                    assert_eq!(xq.q[..], xq_all.q[t * cols..(t + 1) * cols]);
                    matmul_with(k, &pools[0], &w, xt, &xq, 1, &mut single[t * rows..(t + 1) * rows]);
                }
                for &n in &[1usize, 2, 3, 4, 5, 6, 7, 8, 12, 17] {
                    let xq = quantize(k, &x[..n * cols], n, cols);
                    for pool in &pools {
                        let mut got = vec![f32::NAN; n * rows];
                        matmul_with(k, pool, &w, &x[..n * cols], &xq, n, &mut got);
                        for i in 0..n * rows {
                            assert_eq!(
                                got[i].to_bits(),
                                single[i].to_bits(),
                                "{kind:?} {k:?} {rows}x{cols} n={n} threads={} t={} r={}",
                                pool.n_threads(),
                                i / rows,
                                i % rows
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_matches_dequantized_dot() {
    let mut rng = Rng(5);
    let pool = ThreadPool::new(2);
    for kind in KINDS.into_iter().filter(|k| matches!(k, Kind::Q(..))) {
        let (rows, cols, n) = (64, cols_for(kind, 896 + 32), 3);
        let w = rand_weights(kind, rows, cols, &mut rng);
        let x = rand_x(n, cols, &mut rng);
        let mut xq = QuantizedActivations::new();
        quantize_activations(&pool, &x, n, cols, &mut xq);
        let mut got = vec![0f32; n * rows];
        matmul(&pool, &w, &[], &xq, n, &mut got);
        let (mut wrow, mut xrow) = (vec![0f32; cols], vec![0f32; cols]);
        for t in 0..n {
            xq.dequantize_row(t, &mut xrow);
            for r in 0..rows {
                w.dequant_row(r, &mut wrow);
                let exact_q: f64 = (0..cols).map(|c| wrow[c] as f64 * xrow[c] as f64).sum();
                let exact: f64 = (0..cols).map(|c| wrow[c] as f64 * x[t * cols + c] as f64).sum();
                let mag: f64 = (0..cols).map(|c| (wrow[c] as f64 * x[t * cols + c] as f64).abs()).sum();
                let g = got[t * rows + r] as f64;
                assert!((g - exact_q).abs() <= 1e-5 * magnitude(&w, &x, &xq, r, t), "{kind:?} r={r} t={t}: {g} vs {exact_q}");
                // Activation quantization error: |Δx| ≤ d/2 per value, ~1% of the magnitude at most.
                assert!((g - exact).abs() <= 0.02 * mag, "{kind:?} r={r} t={t}: {g} vs unquantized {exact}");
            }
        }
    }
}

/// Every format the kernels take: bits × group × scales (explicit offsets need group 32 and bits ≠ 8;
/// bits 8 has no group-16 kernel).
fn all_q_kinds() -> Vec<Kind> {
    let mut v = Vec::new();
    for bits in [4u8, 5, 6, 8] {
        for group in [32usize, 16] {
            if bits == 8 && group == 16 {
                continue;
            }
            for sc in [Sc::F16Implicit, Sc::F16Min, Sc::SuperImplicit, Sc::SuperMin] {
                let explicit = matches!(sc, Sc::F16Min | Sc::SuperMin);
                if !explicit || (group == 32 && bits != 8) {
                    v.push(Kind::Q(bits, group, sc));
                }
            }
        }
    }
    v
}

/// [`all_q_kinds`] and the groups of 64/128 that only the packed kernels take.
fn packed_kinds() -> Vec<Kind> {
    let mut kinds = all_q_kinds();
    kinds.extend([
        Kind::Q(4, 64, Sc::F16Min),
        Kind::Q(4, 128, Sc::F16Min),
        Kind::Q(8, 64, Sc::F16Implicit),
        Kind::Q(8, 128, Sc::F16Implicit),
        Kind::Q(5, 128, Sc::F16Implicit),
        Kind::Q(6, 64, Sc::F16Min),
    ]);
    kinds
}

/// `natural` prepacked, without its natural codes (what the CPU backend runs).
fn packed_only(natural: &WeightMatrix) -> WeightMatrix {
    let mut w = natural.clone();
    if let WeightMatrix::Q(m) = &mut w {
        m.prepack();
        m.drop_natural();
    }
    w
}

#[test]
fn prepacked_matmul_is_bit_identical_to_unpacked() {
    if !Kernel::Avx512.is_available() {
        eprintln!("skipped: no AVX-512 VNNI");
        return;
    }
    let mut rng = Rng(6);
    let pools: Vec<ThreadPool> = (1..=2).map(ThreadPool::new).collect();
    for kind in all_q_kinds() {
        for &(rows, cols) in &[(37usize, 512usize), (100, 256), (37, 1536), (16, 96), (37, 896)] {
            let cols = cols_for(kind, cols);
            let w = rand_weights(kind, rows, cols, &mut rng);
            let mut wp = w.clone();
            let WeightMatrix::Q(m) = &mut wp else { unreachable!() };
            m.prepack();
            let p = m.packed.as_ref().unwrap();
            let natural = m.nbytes();
            // Same bytes per weight, up to the zero rows of the last 16-row block.
            assert!(p.nbytes() <= natural * rows.next_multiple_of(16) / rows, "{kind:?}");
            // Without its natural codes the matrix decodes the same blocks and rows from the packed copy.
            let mut wd = wp.clone();
            let WeightMatrix::Q(md) = &mut wd else { unreachable!() };
            md.drop_natural();
            assert!(!md.has_natural() && md.lo.is_empty());
            for blk in 0..rows * cols / 32 {
                let WeightMatrix::Q(m0) = &w else { unreachable!() };
                assert_eq!(md.decode_block(blk), m0.decode_block(blk), "{kind:?} block {blk}");
            }
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in [0, rows / 2, rows - 1] {
                w.dequant_row(r, &mut a);
                wd.dequant_row(r, &mut b);
                assert_eq!(a, b, "{kind:?} row {r}");
            }
            let nmax = 20;
            let x = rand_x(nmax, cols, &mut rng);
            let xq_all = quantize(Kernel::Avx512, &x, nmax, cols);
            // One call per token, unpacked: the reference bits.
            let mut single = vec![0f32; nmax * rows];
            for t in 0..nmax {
                let xt = &x[t * cols..(t + 1) * cols];
                let xq = quantize(Kernel::Avx512, xt, 1, cols);
                let out = &mut single[t * rows..(t + 1) * rows];
                matmul_with(Kernel::Avx512, &pools[0], &w, xt, &xq, 1, out);
            }
            let mut want = vec![0f32; nmax * rows];
            matmul_reference(&w, &x, &xq_all, nmax, &mut want);
            for n in 1..=nmax {
                let xq = quantize(Kernel::Avx512, &x[..n * cols], n, cols);
                for pool in &pools {
                    let mut unpacked = vec![f32::NAN; n * rows];
                    matmul_with(Kernel::Avx512, pool, &w, &[], &xq, n, &mut unpacked);
                    let mut packed = vec![f32::NAN; n * rows];
                    matmul_with(Kernel::Avx512, pool, &wp, &[], &xq, n, &mut packed);
                    let mut dropped = vec![f32::NAN; n * rows];
                    matmul_with(Kernel::Avx512, pool, &wd, &[], &xq, n, &mut dropped);
                    for i in 0..n * rows {
                        assert_eq!(dropped[i].to_bits(), packed[i].to_bits());
                        let (t, r) = (i / rows, i % rows);
                        let what = format!("{kind:?} {rows}x{cols} n={n} threads={} t={t} r={r}", pool.n_threads());
                        assert_eq!(packed[i].to_bits(), unpacked[i].to_bits(), "{what}");
                        assert_eq!(packed[i].to_bits(), single[i].to_bits(), "{what} vs n=1");
                        let tol = 1e-5 * magnitude(&w, &x, &xq, r, t) + 1e-30;
                        assert!(((packed[i] - want[i]) as f64).abs() <= tol, "{what}: vs reference");
                    }
                }
            }
        }
    }
}

/// The packed kernel's AMX path (`tdpbsud` dots) against its `vpdpbusd` path and the scalar reference:
/// bit-identical to the VNNI path (and to one call per token) for every format the packed kernel takes
/// (bits 4/5/6/8, groups 16/32/64/128, implicit and explicit offsets), n = 1..40 (AMX token tiles of 16
/// and their tails), rows that are no multiple of 16, 1–3 threads. Both paths run in this process through
/// [`matmul_amx`]; on a CPU without AMX (or where the OS refuses it) both calls run the VNNI path and the
/// test compares it with itself (it says which ran). Rotation is not the kernel's business (quantizer and
/// epilogue), and the rotated test below runs the default path, AMX where available.
#[test]
fn packed_amx_is_bit_identical_to_vnni_and_reference() {
    if !Kernel::Avx512.is_available() {
        eprintln!("skipped: no AVX-512 VNNI");
        return;
    }
    eprintln!("AMX path {}", if amx_available() { "runs" } else { "not available: comparing VNNI with itself" });
    let mut rng = Rng(41);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    for kind in packed_kinds() {
        for &(rows, cols) in &[(37usize, 512usize), (100, 256), (21, 896)] {
            let cols = cols_for(kind, cols);
            let natural = rand_weights(kind, rows, cols, &mut rng);
            let w = packed_only(&natural);
            let nmax = 40;
            let x = rand_x(nmax, cols, &mut rng);
            let xq_all = quantize(Kernel::Avx512, &x, nmax, cols);
            let mut want = vec![0f32; nmax * rows];
            matmul_reference(&natural, &x, &xq_all, nmax, &mut want);
            let tol: Vec<f64> = (0..nmax * rows).map(|i| 1e-5 * magnitude(&natural, &x, &xq_all, i % rows, i / rows) + 1e-30).collect();
            let mut single = vec![0f32; nmax * rows];
            for t in 0..nmax {
                let xq = quantize(Kernel::Avx512, &x[t * cols..(t + 1) * cols], 1, cols);
                matmul_amx(Kernel::Avx512, false, &pools[0], &w, &[], &xq, 1, &mut single[t * rows..(t + 1) * rows]);
            }
            for n in 1..=nmax {
                let xq = quantize(Kernel::Avx512, &x[..n * cols], n, cols);
                for pool in &pools {
                    let mut vnni = vec![f32::NAN; n * rows];
                    matmul_amx(Kernel::Avx512, false, pool, &w, &[], &xq, n, &mut vnni);
                    let mut amx = vec![f32::NAN; n * rows];
                    matmul_amx(Kernel::Avx512, true, pool, &w, &[], &xq, n, &mut amx);
                    for i in 0..n * rows {
                        let (t, r) = (i / rows, i % rows);
                        let what = format!("{kind:?} {rows}x{cols} n={n} threads={} t={t} r={r}", pool.n_threads());
                        assert_eq!(amx[i].to_bits(), vnni[i].to_bits(), "{what}: AMX vs VNNI");
                        assert_eq!(amx[i].to_bits(), single[i].to_bits(), "{what}: vs n=1");
                        assert!(((amx[i] - want[i]) as f64).abs() <= tol[i], "{what}: vs reference {} {}", amx[i], want[i]);
                    }
                }
            }
        }
    }
}

/// The AVX2 packed kernel against the scalar reference, one call per token (batch invariance) and, where
/// the CPU has it, the AVX-512 packed kernel (the same float operations: bit-identical), for every format
/// the packed kernels take (bits 4/5/6/8, groups 16/32/64/128, implicit and explicit offsets), n = 1..20
/// (token tiles of 8 or 16 and their tails), rows that are no multiple of 16 (a half-empty last block), 1–3
/// threads, without the natural codes (what the CPU backend runs).
#[test]
fn avx2_packed_matches_reference_and_avx512() {
    if !Kernel::Avx2.is_available() {
        eprintln!("skipped: no AVX2");
        return;
    }
    let avx512 = Kernel::Avx512.is_available();
    eprintln!("AVX-512 {}", if avx512 { "available: compared bit for bit" } else { "not available: reference only" });
    let mut rng = Rng(57);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    for kind in packed_kinds() {
        for &(rows, cols) in &[(37usize, 512usize), (100, 256), (5, 896), (24, 1536)] {
            let cols = cols_for(kind, cols);
            let natural = rand_weights(kind, rows, cols, &mut rng);
            let w = packed_only(&natural);
            let nmax = 20;
            let x = rand_x(nmax, cols, &mut rng);
            let xq_all = quantize(Kernel::Avx2, &x, nmax, cols);
            let mut want = vec![0f32; nmax * rows];
            matmul_reference(&natural, &x, &xq_all, nmax, &mut want);
            let mut single = vec![0f32; nmax * rows];
            for t in 0..nmax {
                let xq = quantize(Kernel::Avx2, &x[t * cols..(t + 1) * cols], 1, cols);
                matmul_with(Kernel::Avx2, &pools[0], &w, &[], &xq, 1, &mut single[t * rows..(t + 1) * rows]);
            }
            for n in 1..=nmax {
                let xq = quantize(Kernel::Avx2, &x[..n * cols], n, cols);
                for pool in &pools {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul_with(Kernel::Avx2, pool, &w, &[], &xq, n, &mut got);
                    let mut other = vec![f32::NAN; n * rows];
                    if avx512 {
                        matmul_with(Kernel::Avx512, pool, &w, &[], &xq, n, &mut other);
                    }
                    for i in 0..n * rows {
                        let (t, r) = (i / rows, i % rows);
                        let what = format!("{kind:?} {rows}x{cols} n={n} threads={} t={t} r={r}", pool.n_threads());
                        assert_eq!(got[i].to_bits(), single[i].to_bits(), "{what}: vs n=1");
                        if avx512 {
                            assert_eq!(got[i].to_bits(), other[i].to_bits(), "{what}: AVX2 vs AVX-512");
                        }
                        let tol = 1e-5 * magnitude(&natural, &x, &xq_all, r, t) + 1e-30;
                        assert!(((got[i] - want[i]) as f64).abs() <= tol, "{what}: vs reference {} {}", got[i], want[i]);
                    }
                }
            }
        }
    }
}

/// Rotated M/L matrices of heavy-tailed random weights (`quant::rtn`), both sides rotated.
fn rotated_matrix(format: crate::quant::rtn::Format, group: usize, rows: usize, cols: usize, rng: &mut Rng) -> WeightMatrix {
    use crate::quant::rotation::{Rotation, Signs};
    use std::sync::Arc;
    let data: Vec<f32> =
        (0..rows * cols).map(|_| if rng.next().is_multiple_of(64) { rng.nz(0.1, 1.0) } else { rng.nz(0.001, 0.03) }).collect();
    let rot = Rotation { input: Some(Arc::new(Signs::random(cols, rng.next()))), output: Some(Arc::new(Signs::random(rows, rng.next()))) };
    crate::quant::rtn::quantize(rows, cols, &data, format, group, rot)
}

fn input_signs(w: &WeightMatrix) -> &crate::quant::rotation::Signs {
    let WeightMatrix::Q(m) = w else { panic!("not quantized") };
    m.rotation.input.as_deref().expect("input rotation")
}

/// The fused rotate-and-quantize is bit-identical on every path and equals quantizing the explicitly
/// rotated activations (`Rotation::rotate_input` per token), split across threads or not.
#[test]
fn quantize_rotated_matches_explicit_rotation_exactly() {
    use crate::quant::rotation::{Rotation, Signs};
    use std::sync::Arc;
    let mut rng = Rng(21);
    let pools: Vec<ThreadPool> = (1..=2).map(ThreadPool::new).collect();
    for &cols in &[32usize, 96, 576, 928] {
        let signs = Arc::new(Signs::random(cols, cols as u64));
        let rot = Rotation { input: Some(signs.clone()), output: None };
        for &n in &[1usize, 3, 150] {
            let x = rand_x(n, cols, &mut rng);
            let mut xr = x.clone();
            xr.chunks_exact_mut(cols).for_each(|row| rot.rotate_input(row));
            let want = quantize(Kernel::Scalar, &xr, n, cols);
            for k in Kernel::available() {
                for pool in &pools {
                    let mut got = QuantizedActivations::new();
                    quantize_rotated_with(k, pool, &x, n, cols, Some(&signs), &mut got);
                    let what = format!("{k:?} cols {cols} n {n} threads {}", pool.n_threads());
                    assert_eq!(got.rotation, signs.id, "{what}");
                    assert_eq!(got.q, want.q, "{what}");
                    assert_eq!(
                        got.scale.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.scale.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                    assert_eq!((&got.sum, &got.sum16), (&want.sum, &want.sum16), "{what}");
                    assert_ne!(got.q, quantize(Kernel::Scalar, &x, n, cols).q, "{what}: rotation changed nothing");
                }
            }
        }
    }
}

/// Rotated M/L/K/K6 products (input rotation fused into the quantizer, output rotation in the epilogue) on
/// every path — unpacked, prepacked, and prepacked without natural codes (what the CPU backend runs) —
/// against the reference, and bit-identical for any batch size and thread count; odd rows (tail Hadamard
/// blocks), partial 16-row blocks, several groups per row.
#[test]
fn rotated_matmul_matches_reference_and_is_batch_invariant() {
    use crate::quant::rtn::Format;
    let mut rng = Rng(22);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    for (format, group) in [
        (Format::M, 32),
        (Format::M, 64),
        (Format::M, 128),
        (Format::L, 32),
        (Format::L, 128),
        (Format::K, 32),
        (Format::K6, 16),
        (Format::K6, 32),
    ] {
        for &(rows, cols) in &[(1usize, 128usize), (7, 256), (45, 384), (100, 640), (203, 1024)] {
            let w = rotated_matrix(format, group, rows, cols, &mut rng);
            let mut wp = w.clone();
            if let WeightMatrix::Q(m) = &mut wp {
                m.prepack();
            }
            let mut wd = wp.clone();
            if let WeightMatrix::Q(m) = &mut wd {
                m.drop_natural();
            }
            let signs = input_signs(&w);
            let nmax = 13;
            let x = rand_x(nmax, cols, &mut rng);
            let xq_all = {
                let mut q = QuantizedActivations::new();
                quantize_rotated_with(Kernel::Scalar, &pools[0], &x, nmax, cols, Some(signs), &mut q);
                q
            };
            let mut want = vec![0f32; nmax * rows];
            matmul_reference(&w, &x, &xq_all, nmax, &mut want);
            for k in Kernel::available() {
                let variants: Vec<&WeightMatrix> = if k >= Kernel::Avx2 { vec![&w, &wp, &wd] } else { vec![&w] };
                for (v, ww) in variants.into_iter().enumerate() {
                    let what = format!("{format:?} g{group} {k:?} variant {v} {rows}x{cols}");
                    let mut single = vec![0f32; nmax * rows];
                    for t in 0..nmax {
                        let mut xq = QuantizedActivations::new();
                        quantize_rotated_with(k, &pools[0], &x[t * cols..(t + 1) * cols], 1, cols, Some(signs), &mut xq);
                        matmul_with(k, &pools[0], ww, &[], &xq, 1, &mut single[t * rows..(t + 1) * rows]);
                    }
                    for t in 0..nmax {
                        // Output rotation mixes the rows of a block: tolerance from the block's largest term sum.
                        let mags: Vec<f64> = (0..rows).map(|r| magnitude(&w, &x, &xq_all, r, t)).collect();
                        for r in 0..rows {
                            let blk = r / 32 * 32;
                            let m = mags[blk..(blk + 32).min(rows)].iter().fold(0f64, |a, &b| a.max(b));
                            let (g, e) = (single[t * rows + r], want[t * rows + r]);
                            assert!(((g - e) as f64).abs() <= 1e-5 * m * 6.0, "{what} t={t} r={r}: {g} vs {e}");
                        }
                    }
                    for &n in &[2usize, 5, 8, 13] {
                        let mut xq = QuantizedActivations::new();
                        quantize_rotated_with(k, &pools[1], &x[..n * cols], n, cols, Some(signs), &mut xq);
                        for pool in &pools {
                            let mut got = vec![f32::NAN; n * rows];
                            matmul_with(k, pool, ww, &[], &xq, n, &mut got);
                            for i in 0..n * rows {
                                assert_eq!(got[i].to_bits(), single[i].to_bits(), "{what} n={n} threads={} i={i}", pool.n_threads());
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The output side of a rotated product's epilogue (`y ← D_out ⊙ (H·y)` per block of 32) is bit-identical
/// on every kernel path and equals the scalar butterfly followed by the signs, on random values.
#[test]
fn output_rotation_block_is_bit_identical_on_every_path() {
    let mut rng = Rng(31);
    for _ in 0..200 {
        let y = rand_x(1, 32, &mut rng);
        let signs: Vec<f32> = (0..32).map(|_| if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 }).collect();
        let mut want = y.clone();
        crate::quant::rotation::fwht(&mut want);
        want.iter_mut().zip(&signs).for_each(|(w, s)| *w *= s);
        assert!(want.iter().zip(&y).any(|(a, b)| a != b), "the rotation changed nothing");
        for k in Kernel::available() {
            let mut got = y.clone();
            super::quantize::rotate_output_block(k, &mut got, &signs);
            for i in 0..32 {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "{k:?} i={i}: {} vs {}", got[i], want[i]);
            }
        }
    }
}

/// Activations quantized without (or with other) input signs are refused by a rotated matrix.
#[test]
fn rotated_matmul_refuses_unrotated_activations() {
    let mut rng = Rng(23);
    let pool = ThreadPool::new(1);
    let w = rotated_matrix(crate::quant::rtn::Format::M, 64, 32, 128, &mut rng);
    let x = rand_x(1, 128, &mut rng);
    let xq = quantize(Kernel::Scalar, &x, 1, 128);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| matmul_with(Kernel::Scalar, &pool, &w, &[], &xq, 1, &mut [0f32; 32])));
    assert!(r.is_err(), "unrotated activations were accepted");
}
