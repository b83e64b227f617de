//! Qwen3.5 speed (a plain program, not criterion: it prints tables): `cargo bench -p eddy --bench qwen35`
//! runs both parts; `-- 08b` or `-- gdn` one of them.
//! - `08b`: the 0.8B-shape model (`$EDDY_MODELS/qwen35-0.8b-synthetic`, built by `tools/fetch_models.sh qwen35`):
//!   decode and prefill per weight format against the bandwidth limit, and whole-model tree verification.
//! - `gdn`: one Gated DeltaNet layer of the 0.8B shape: verify and commit against a recurrent decode step,
//!   hot and cold.

use eddy::backend::cpu::ThreadPool;
use eddy::backend::Cpu;
use eddy::model_dir::Quant;
use eddy::models::forward::{forward, Logits, Workspace};
use eddy::models::{qwen35, Model};
use eddy::state::SeqState;
use eddy::tree::TreePaths;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let wants = |name: &str| args.is_empty() || args.iter().any(|a| name.contains(a.as_str()));
    if wants("08b") {
        bench_08b();
    }
    if wants("gdn") {
        bench_gdn_layer();
    }
}

fn pool() -> Cpu {
    Cpu::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// Verify the tree `parents` through the shared forward.
fn forward_tree(
    m: &Model,
    be: &Cpu,
    ws: &mut Workspace,
    st: &mut SeqState,
    tokens: &[u32],
    parents: &[usize],
    out: &mut Vec<f32>,
) -> eddy::Result<()> {
    let paths = TreePaths::new(parents)?;
    eddy::models::forward::forward_tree(m, be, ws, st, tokens, &paths, 0, out)
}

/// `$EDDY_MODELS/<name>` when `<file>` is in it, else a message and `None`.
fn artifact(name: &str, file: &str) -> Option<std::path::PathBuf> {
    let dir = eddy::load::models_dir().join(name);
    if dir.join(file).is_file() {
        return Some(dir);
    }
    eprintln!("skipping: {} is missing (run `tools/fetch_models.sh qwen35`)", dir.join(file).display());
    None
}

/// Speed on the 0.8B-shape model (`cargo bench -p eddy --bench qwen35 -- 08b`): decode tokens/s per weight format against the bandwidth limit (weight bytes per
/// token ÷ measured read bandwidth), prefill tokens/s at 512, and one GDN layer's tree verification (16 and
/// 64 nodes) against the same number of sequential recurrent decode steps.
fn bench_08b() {
    use eddy::backend::cpu::gdn;
    use std::time::Instant;
    let Some(dir) = artifact("qwen35-0.8b-synthetic", "model.safetensors") else { return };
    let pool = pool();
    let bw = eddy::backend::cpu::bandwidth::measure_read_bandwidth(pool.pool(), 1 << 30, 3);
    eprintln!("threads {}, read bandwidth {bw:.1} GB/s", pool.n_threads());
    for quant in [Quant::Q4, Quant::Q8, Quant::None] {
        let m = qwen35::load_dir(&dir, quant).unwrap();
        let mut ws = Workspace::new(&pool, &m, 512);
        let mut st = m.new_state(&pool, 1024);
        let mut out = Vec::new();
        let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919) % 248_000).collect();
        let t0 = Instant::now();
        forward(&m, &pool, &mut ws, &mut st, &prompt, Logits::Last, &mut out).unwrap();
        let pp = 512.0 / t0.elapsed().as_secs_f64();
        let n = 32;
        let t0 = Instant::now();
        for i in 0..n {
            forward(&m, &pool, &mut ws, &mut st, &[(i * 31) as u32], Logits::Last, &mut out).unwrap();
        }
        let tg = n as f64 / t0.elapsed().as_secs_f64();
        let gb = m.weight_bytes() as f64 / 1e9;
        eprintln!(
            "{quant}: weights {gb:.3} GB/token, pp512 {pp:.1} t/s, tg {tg:.2} t/s, bandwidth limit {:.2} t/s ({:.0} %)",
            bw / gb,
            100.0 * tg * gb / bw
        );
        // Whole-model tree verification: a 16-node chain and a 16-node two-level tree against one decode step.
        let t0 = Instant::now();
        for i in 0..8 {
            forward(&m, &pool, &mut ws, &mut st, &[(i * 17) as u32], Logits::Last, &mut out).unwrap();
        }
        let step = t0.elapsed().as_secs_f64() / 8.0;
        for (what, parents) in [
            ("chain", gdn::chain_parents(16)),
            (
                "4x4 tree",
                (0..16)
                    .map(|i| {
                        if i == 0 {
                            usize::MAX
                        } else if i < 4 {
                            0
                        } else {
                            (i - 4) / 3 + 1
                        }
                    })
                    .collect::<Vec<_>>(),
            ),
        ] {
            let tokens: Vec<u32> = (0..16).map(|i| i * 101).collect();
            let t0 = Instant::now();
            for _ in 0..3 {
                forward_tree(&m, &pool, &mut ws, &mut st, &tokens, &parents, &mut out).unwrap();
            }
            let tv = t0.elapsed().as_secs_f64() / 3.0;
            eprintln!("{quant}: 16-node {what} verify {:.1} ms = {:.2} decode steps ({:.1} ms)", tv * 1e3, tv / step, step * 1e3);
        }
    }
}

/// One GDN layer of the 0.8B shape (`cargo bench -p eddy --bench qwen35 -- gdn`): tree verification (`wy_outputs`) of 1–64 chain nodes
/// and the commit (`apply_path`) against one recurrent decode step, with the state hot in cache and cold
/// (caches flushed before every timed call by streaming a 64 MiB buffer, as in a real decode step where ~500 MB
/// of weights pass between two visits of a layer's state; the activations are then read back in, as a real step
/// has just produced them). Best-of-N, one thread; the verify/step ratios come
/// from the same run. Achieved GMAC/s counts the state products `2T·d_k·d_v` per head (the masked WY form's
/// lower bound) against the FMA peak measured here (16 f32 MACs per cycle on Zen 4: one zmm FMA per cycle).
fn bench_gdn_layer() {
    use eddy::backend::cpu::gdn;
    use std::hint::black_box;
    use std::time::Instant;
    let pool = ThreadPool::new(1);
    let evict_buf: Vec<u64> = (0..(64 << 20) / 8).map(|i| i as u64).collect();
    let evict = || {
        let s = evict_buf.iter().fold(0u64, |a, &x| a.wrapping_add(x));
        black_box(s);
    };
    // Best of `reps` timed calls of `f`, each after `before` (untimed).
    let best = |reps: usize, before: &dyn Fn(), f: &mut dyn FnMut()| -> f64 {
        (0..reps)
            .map(|_| {
                before();
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let peak = fma_peak_gmacs();
    eprintln!("FMA peak measured on one core: {peak:.1} GMAC/s (f32; the stated 16 MACs/cycle × 3.7 GHz = 59.2)");
    let stream = best(5, &|| {}, &mut || evict());
    eprintln!(
        "one-core DRAM read (the 64 MiB flush): {:.1} GB/s, so one layer's 1 MiB state takes ≥ {:.1} µs to read",
        (64 << 20) as f64 / stream / 1e9,
        stream / 64.0 * 1e6
    );
    let s = gdn::GdnShape { n_k_heads: 16, n_v_heads: 16, d_k: 128, d_v: 128, kernel: 4, v_tiled: false };
    let mut seed = 9u64;
    let mut rnd = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    eprintln!("GDN layer (1 thread), chain trees; times in µs; ratio = verify / one decode step under the same cache state");
    eprintln!("nodes | step hot | verify hot | ratio | commit hot | GMAC/s (% peak) | step cold | verify cold | ratio | commit cold");
    for n in [1usize, 2, 4, 8, 16, 32, 64] {
        let mut c: Vec<f32> = (0..n * s.conv_dim()).map(|_| rnd()).collect();
        let mut a: Vec<f32> = (0..n * 16).map(|_| rnd()).collect();
        let mut b: Vec<f32> = (0..n * 16).map(|_| rnd()).collect();
        gdn::prepare(&s, &mut c, &mut a, &mut b, &[-0.5; 16], &[0.0; 16], n);
        let state: Vec<f32> = (0..s.state_len()).map(|_| rnd() * 0.1).collect();
        let parents = gdn::chain_parents(n);
        let path: Vec<usize> = (0..n).collect();
        let (mut gamma, mut u, mut o) = (vec![0f32; n * 16], vec![0f32; n * s.value_dim()], vec![0f32; n * s.value_dim()]);
        // Cold: the state evicted, the layer's activations (just produced by the conv in a real step) in cache.
        let touch = |xs: &[&[f32]]| black_box(xs.iter().map(|x| x.iter().sum::<f32>()).sum::<f32>());
        macro_rules! time {
            ($cold:expr, $reps:expr, $call:expr) => {
                (0..$reps)
                    .map(|_| {
                        if $cold {
                            evict();
                            touch(&[&c, &a, &b, &gamma, &u, &o]);
                        }
                        let t0 = Instant::now();
                        $call;
                        t0.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min)
            };
        }
        let mut row = Vec::new();
        for (cold, reps) in [(false, 25), (true, 9)] {
            let mut st = state.clone();
            let one = time!(cold, reps, gdn::recurrent(&pool, &s, &mut st, &c, &a, &b, 1, &mut o[..s.value_dim()]));
            let tree = time!(cold, reps, gdn::wy_outputs(&pool, &s, &state, &c, &a, &b, &parents, &mut gamma, &mut u, &mut o));
            let mut st2 = state.clone();
            let commit = time!(cold, reps, gdn::apply_path(&pool, &s, &mut st2, &c, &gamma, &u, &path));
            row.push((one, tree, commit));
        }
        let macs = (2 * n * s.d_k * s.d_v * s.n_v_heads) as f64;
        let ((h1, ht, hc), (c1, ct, cc)) = (row[0], row[1]);
        eprintln!(
            "{n:5} | {:8.1} | {:10.1} | {:5.2} | {:10.1} | {:6.1} ({:3.0} %) | {:9.1} | {:11.1} | {:5.2} | {:11.1}",
            h1 * 1e6,
            ht * 1e6,
            ht / h1,
            hc * 1e6,
            macs / ht / 1e9,
            100.0 * macs / ht / 1e9 / peak,
            c1 * 1e6,
            ct * 1e6,
            ct / c1,
            cc * 1e6
        );
    }
}

/// f32 multiply-adds per second (in 10⁹) one core sustains on independent zmm FMA chains (AVX-512), or on
/// 8-lane AVX2 FMA chains, or 0 when the CPU has neither.
fn fma_peak_gmacs() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f")]
        unsafe fn chains(iters: usize) -> f32 {
            let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            let mut acc = [_mm512_setzero_ps(); 12];
            for _ in 0..iters {
                for r in acc.iter_mut() {
                    *r = _mm512_fmadd_ps(*r, a, b);
                }
            }
            let mut s = _mm512_setzero_ps();
            for r in acc {
                s = _mm512_add_ps(s, r);
            }
            _mm512_reduce_add_ps(s)
        }
        if is_x86_feature_detected!("avx512f") {
            let iters = 2_000_000;
            let best = (0..20)
                .map(|_| {
                    let t0 = std::time::Instant::now();
                    // SAFETY: avx512f was detected.
                    std::hint::black_box(unsafe { chains(std::hint::black_box(iters)) });
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            return (iters * 12 * 16) as f64 / best / 1e9;
        }
    }
    0.0
}
