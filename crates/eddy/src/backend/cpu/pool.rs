//! A small persistent worker pool for the CPU kernels.
//!
//! Workers are spawned once. Between jobs a worker spins for [`SPIN`] (so back-to-back decode kernels
//! wake it within nanoseconds), then parks on a condition variable. A job is a borrowed closure; the
//! caller runs index 0 itself and waits for the others before returning, so borrowing is sound.
//!
//! Late workers do not stall the caller: a worker must *enter* a job (set its bit in the job's entry
//! word) before touching it, and the caller *closes* the job once its own share is done. Indices whose
//! worker had not entered by then are run by the caller itself, and the caller waits only for the workers
//! that entered. On a shared machine, where a worker can be descheduled for a whole time slice, a kernel
//! therefore never waits for a thread that is not running (with dynamic chunking in
//! [`ThreadPool::parallel_for`], the caller simply takes every chunk).

use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker busy-waits for the next job before parking.
const SPIN: Duration = Duration::from_micros(300);

/// Set in the entry word once the caller has closed the job to late workers.
const CLOSED: u64 = 1 << 31;
/// Largest pool whose workers enter jobs through the entry word (bits 1..31); larger pools wait for all.
const MAX_ENTRY_THREADS: usize = 31;

/// The entry word's tag for generation `g`.
fn entry_tag(g: usize) -> u64 {
    (g as u32 as u64) << 32
}

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
    /// Entry word of the current job: `(generation as u32) << 32 | CLOSED | bit i for each entered worker`.
    entry: Padded<AtomicU64>,
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
            entry: Padded(AtomicU64::new(0)),
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
            JobPtr(std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const (dyn Fn(usize, usize) + Sync + 'static)>(fref))
        };
        unsafe { *s.job.get() = Some(ptr) };
        s.done.0.store(0, Ordering::Relaxed);
        let g = s.generation.0.load(Ordering::Relaxed).wrapping_add(1);
        let gated = n <= MAX_ENTRY_THREADS;
        s.entry.0.store(entry_tag(g), Ordering::Release);
        s.generation.0.store(g, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }

        /// Closes the job and waits for the workers that entered it (also on unwind).
        struct Wait<'a> {
            s: &'a Shared,
            n: usize,
            gated: bool,
            entered: Option<u64>,
        }
        impl Wait<'_> {
            /// Close the job to late workers; returns the mask of those that entered (ungated pools:
            /// every worker counts as entered).
            fn close(&mut self) -> u64 {
                if let Some(m) = self.entered {
                    return m;
                }
                let m = if self.gated { self.s.entry.0.fetch_or(CLOSED, Ordering::AcqRel) & (CLOSED - 1) } else { u64::MAX };
                self.entered = Some(m);
                m
            }
            /// Workers to wait for.
            fn waiting_for(&mut self) -> usize {
                if self.gated {
                    self.close().count_ones() as usize
                } else {
                    self.n - 1
                }
            }
        }
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                let want = self.waiting_for();
                let mut spins = 0u32;
                while self.s.done.0.load(Ordering::Acquire) < want {
                    spins += 1;
                    if spins < 1 << 14 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        let mut wait = Wait { s, n, gated, entered: None };
        f(0, n);
        let entered = wait.close();
        // Indices whose worker did not show up in time run here.
        for i in 1..n {
            if gated && entered & (1 << i) == 0 {
                f(i, n);
            }
        }
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

/// Try to enter the job of generation `g` as worker `idx`: fails once the caller has closed it (or moved
/// on to a later generation).
fn enter(s: &Shared, g: usize, idx: usize) -> bool {
    let tag = entry_tag(g);
    let mut cur = s.entry.0.load(Ordering::Acquire);
    loop {
        if cur & !(CLOSED | (CLOSED - 1)) != tag || cur & CLOSED != 0 {
            return false;
        }
        match s.entry.0.compare_exchange_weak(cur, cur | (1 << idx), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
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
        if n <= MAX_ENTRY_THREADS && !enter(&s, g, idx) {
            // Too late: the caller closed this job and runs our index itself.
            continue;
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
