//! Memory read bandwidth of this machine, measured the way a decode step reads weights: every worker
//! streams its own contiguous part of a buffer much larger than the caches. Used to state decode speed as a
//! fraction of its limit (bytes streamed per token ÷ bandwidth).

use super::ThreadPool;
use std::time::Instant;

/// Best-of-`reps` read bandwidth in GB/s (10⁹ bytes per second) over a `bytes`-sized buffer.
pub fn measure_read_bandwidth(pool: &ThreadPool, bytes: usize, reps: usize) -> f64 {
    let n = bytes / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.n_threads()).map(|_| Default::default()).collect();
        pool.run(|i, nt| {
            let chunk = n.div_ceil(nt);
            let part = &buf[(i * chunk).min(n)..((i + 1) * chunk).min(n)];
            // Eight independent accumulators keep the loads in flight (the compiler vectorizes this).
            let mut acc = [0u64; 8];
            for c in part.chunks_exact(8) {
                for l in 0..8 {
                    acc[l] = acc[l].wrapping_add(c[l]);
                }
            }
            sums[i].store(acc.iter().fold(0, |a, &b| a.wrapping_add(b)), std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        best = best.max((n * 8) as f64 / secs / 1e9);
    }
    best
}
