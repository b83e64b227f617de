//! A small persistent worker pool for the CPU kernels.
//!
//! Workers are spawned once. Between jobs a worker spins for [`SPIN`] (so back-to-back decode kernels
//! wake it within nanoseconds), then parks on a condition variable. A job is a borrowed closure; the
//! caller runs index 0 itself and waits for the others before returning, so borrowing is sound.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker busy-waits for the next job before parking.
const SPIN: Duration = Duration::from_micros(300);

/// A type-erased pointer to the current job (`&dyn Fn(thread_index, n_threads)`).
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize, usize) + Sync + 'static));

#[repr(align(64))]
struct Padded<T>(T);

struct Shared {
    /// Bumped once per job (and once at shutdown); workers run each generation exactly once.
    generation: Padded<AtomicUsize>,
    /// Workers that finished the current generation.
    done: Padded<AtomicUsize>,
    /// Written by the caller only while no worker can read it (between generations).
    job: UnsafeCell<Option<JobPtr>>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the thread holding `ThreadPool::busy` while every worker is idle
// (all have reported `done` for the previous generation), and read by workers only after they observe
// the next generation with Acquire ordering.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// Persistent worker pool used by the decode and prefill kernels.
///
/// `n_threads - 1` OS threads are spawned at construction; the thread calling [`ThreadPool::run`]
/// acts as worker 0. Idle workers spin for ~300 µs and then park, so a pool costs no CPU when unused.
/// No thread is spawned and nothing is allocated per call.
///
/// Re-entrancy: if `run`/`parallel_for` is called while the pool is already busy (from inside a job,
/// or concurrently from another thread), the work is executed serially on the calling thread with
/// the same `(thread_index, n_threads)` arguments, so results never depend on it.
pub struct ThreadPool {
    n: usize,
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
}

impl ThreadPool {
    /// Create a pool of `n_threads` workers (`n_threads >= 1`; values of 0 are treated as 1). The
    /// calling thread counts as worker 0, so `n_threads - 1` threads are spawned.
    pub fn new(n_threads: usize) -> Self {
        let n = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: Padded(AtomicUsize::new(0)),
            done: Padded(AtomicUsize::new(0)),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let handles = (1..n)
            .map(|idx| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("eddy-cpu-{idx}"))
                    .spawn(move || worker(s, idx, n))
                    .expect("failed to spawn eddy worker thread")
            })
            .collect();
        ThreadPool { n, shared, handles, busy: Mutex::new(()) }
    }

    /// Number of workers, including the calling thread.
    pub fn n_threads(&self) -> usize {
        self.n
    }

    /// Run `f(thread_index, n_threads)` once for every `thread_index` in `0..n_threads` (the caller
    /// runs index 0) and return when all have finished. A panic in any worker is re-raised here
    /// after all workers are done.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        let n = self.n;
        if n == 1 {
            f(0, 1);
            return;
        }
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                for i in 0..n {
                    f(i, n);
                }
                return;
            }
        };
        let s = &*self.shared;
        let fref: &(dyn Fn(usize, usize) + Sync) = &f;
        // SAFETY: the lifetime is erased only for the duration of this call: `Wait` below blocks
        // (even on unwind) until every worker has finished with the pointer.
        let ptr: JobPtr = unsafe {
            JobPtr(std::mem::transmute::<
                *const (dyn Fn(usize, usize) + Sync + '_),
                *const (dyn Fn(usize, usize) + Sync + 'static),
            >(fref))
        };
        unsafe { *s.job.get() = Some(ptr) };
        s.done.0.store(0, Ordering::Relaxed);
        s.generation.0.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }

        struct Wait<'a>(&'a Shared, usize);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                let mut spins = 0u32;
                while self.0.done.0.load(Ordering::Acquire) < self.1 {
                    spins += 1;
                    if spins < 1 << 14 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        let wait = Wait(s, n - 1);
        f(0, n);
        drop(wait);
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("an eddy worker thread panicked");
        }
    }

    /// Split `0..n` into contiguous chunks and call `f(chunk)` on the workers until all are processed.
    ///
    /// Chunk length is a multiple of `min_chunk` (at least `min_chunk`, except the last chunk), sized
    /// for about four chunks per worker; chunks are claimed dynamically through an atomic counter.
    /// With one thread, or `n <= min_chunk`, `f(0..n)` is called directly on the caller.
    pub fn parallel_for<F: Fn(Range<usize>) + Sync>(&self, n: usize, min_chunk: usize, f: F) {
        if n == 0 {
            return;
        }
        let min_chunk = min_chunk.max(1);
        if self.n == 1 || n <= min_chunk {
            f(0..n);
            return;
        }
        let target = n.div_ceil(self.n * 4);
        let chunk = target.div_ceil(min_chunk) * min_chunk;
        let n_chunks = n.div_ceil(chunk);
        let next = AtomicUsize::new(0);
        self.run(|_, _| loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= n_chunks {
                break;
            }
            f(c * chunk..((c + 1) * chunk).min(n));
        });
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        s.generation.0.fetch_add(1, Ordering::SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("n_threads", &self.n).finish()
    }
}

fn worker(s: Arc<Shared>, idx: usize, n: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin first, then park.
        let mut g = s.generation.0.load(Ordering::Acquire);
        if g == seen {
            let start = Instant::now();
            let mut i = 0u32;
            loop {
                std::hint::spin_loop();
                g = s.generation.0.load(Ordering::Acquire);
                if g != seen {
                    break;
                }
                i = i.wrapping_add(1);
                if i & 63 == 0 && start.elapsed() > SPIN {
                    break;
                }
            }
            if g == seen {
                let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                loop {
                    g = s.generation.0.load(Ordering::SeqCst);
                    if g != seen {
                        break;
                    }
                    guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
        seen = g;
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: see `Shared`; the caller keeps the closure alive until we bump `done`.
        let job = unsafe { (*s.job.get()).expect("job set before generation bump") };
        let f = unsafe { &*job.0 };
        if catch_unwind(AssertUnwindSafe(|| f(idx, n))).is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.done.0.fetch_add(1, Ordering::Release);
    }
}
