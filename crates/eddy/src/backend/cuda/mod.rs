//! [`Cuda`]: the [`Backend`] on an NVIDIA GPU (the `cuda` cargo feature; `docs/cuda.md`).
//!
//! Buffers are device `f32` allocations ([`CudaBuf`]), weights are [`CudaWeights`] (quantized matrices in
//! the GPU layout of [`GpuQ`], or f32/bf16), quantized activations are [`CudaQAct`] (int8 per token and
//! group of 32 with the CPU's scheme, [`crate::backend::cpu::QuantizedActivations`]). All work goes to one
//! stream, queued on the host first (`Queue`): a pass reaches the GPU as one list of launches, and a list
//! seen before runs as a CUDA graph ([`GraphPlan`]); host arrays an operation needs (token ids, positions,
//! the attention's key lists, the KV row written) go through a device arena the kernels read, so every
//! decode step of one shape is the same list. Device scratch only grows, so a warm decode step allocates
//! nothing. Only [`Backend::read`] and [`Backend::matmul_to_host`] wait for the GPU (and the growth of a
//! RoPE table, once per doubling of the positions, `Cuda::rope_table`).
//!
//! # Kernels compiled at build time, not at run time
//! The kernels (`kernels.cu`) are compiled by nvcc when the crate is built (`build.rs`) into a fatbin
//! (SASS for sm_90, PTX for compute_90 and compute_80) embedded in the binary, rather than compiled at start with NVRTC:
//! every build (CI included) checks them, and a user's machine needs only the NVIDIA driver — no runtime
//! compiler library, no first-start compilation. The driver API is loaded dynamically (`cudarc`), so a
//! binary built with the feature starts on a machine without CUDA; [`Cuda::new`] then returns an error.
//!
//! # Batch invariance
//! Every kernel computes a row's result with an operation sequence that depends only on that row (see
//! `kernels.cu`): the products sum each (row, token)'s 32-value blocks lane by lane in a fixed order and
//! reduce the lanes with a fixed tree, whatever the token count or tile; attention visits each query's keys
//! in position order with fixed reductions. So a 1-row decode and a 16-row verify give bit-identical rows.
//!
//! Gated DeltaNet operations are not implemented: [`Backend::has_gdn`] is false and
//! [`crate::models::Model::to_backend`] refuses hybrid models.

mod graph;
mod layout;

pub use graph::{GraphPlan, Plan};
pub use layout::{one_launch, Form, GpuQ};

use super::{Activation, Attend, AttnShape, Backend, Cols, GdnShape, Rope, RopeMode, Visibility, AHEAD_IN_FLIGHT};
use crate::error::{Error, Result};
use crate::quant::rotation::blocks;
use crate::quant::{WeightMatrix, QK};
use crate::sampling::{Candidates, MAX_CANDIDATES};
use cudarc::driver::{result, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The kernels, compiled by build.rs.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/eddy_kernels.fatbin"));

/// Threads per block of the elementwise kernels.
const THREADS: u32 = 256;
/// Blocks per row of the argmax (`AM_PARTS` in `kernels.cu`).
const AM_PARTS: usize = 128;
/// Blocks per row of the candidates' row passes and u64 words of a row's work area (`CAND_PARTS`,
/// `CAND_WORK` in `kernels.cu`).
const CAND_PARTS: usize = 32;
const CAND_WORK: usize = 3104;
/// Weight rows per block of the product kernels (one warp each; `MM_ROWS` in kernels.cu).
const MM_ROWS: usize = 4;
/// Tokens per block of the f32/bf16 product kernels for batches of more than one token (`TT` of `mm_f*_t8`), and
/// the most tokens `EDDY_CUDA_DP4A_MAX` may put on the `dp4a` kernels.
const MM_TT: usize = 8;
/// Most tokens of a quantized product on the `dp4a` kernels (`mm_q*_t2` for 2 tokens, `mm_q*_t4` for 3); more
/// go to the tensor cores. Measured on the H200 (docs/cuda.md, session 16; 0.5B, argmax on the device): a 2-node
/// verify 0.97 ms with `mm_q_t2` (1.38 with the former 8-token tile), 4 nodes 1.20 with `mm_q_t4` (1.59), 8
/// nodes 1.46 on two `mm_q_t4` tiles against 1.38 with `mma`. Since the verify products' rework (sessions 35–50)
/// 4 tokens run faster on the tensor cores: on an H100 (session 51, `eddy speed --verify-sizes`) the 1.5B's
/// 4-node verify 2.151–2.156 ms with 3 here against 2.351–2.392 with 4 (−8 %), the 0.5B's 1.318 / 1.327 against
/// 1.326–1.342; 3 tokens stay on `mm_q_t4` (2 here put the 0.5B's 3-node verify 5 % slower). Every kernel gives
/// the same bits (batch invariance), so the cut is free.
const DP4A_MAX: usize = 3;
/// Weight rows per block of the tensor-core quantized products (`MMA_ROWS`; `QW_WARPS` warps each).
const MMA_ROWS: usize = 16;
/// Threads per block of the tensor-core quantized products (`32·QW_WARPS`).
const MMA_THREADS: u32 = 512;

/// Warps per row tile of the verify-size tensor-core products (`S` of `mm_qv*_w{S}`; index in `Kernels::mm_qv`).
const QV_WARPS: [usize; 3] = [4, 8, 16];
/// `Cuda::forced_qv`'s value for "never `mm_qv*`" (not a warp count of [`QV_WARPS`]).
const QV_OFF: usize = 1;
/// Most tokens of a quantized product on `mm_qv*` by default (more take `mm_qw*` or `mm_qt*`).
const QV_MAX: usize = 64;
/// Most tokens whose quantized activations also get the token-tiled copy `mm_qv*` reads (bytes: 52 per token
/// and group of 32).
const QV_TILED_MAX: usize = 64;
/// Warps per multiprocessor a `mm_qv*` launch should bring at least, where fewer warps per tile allow it
/// ([`Cuda::qv_plan`]).
const QV_MIN_WARPS_PER_SM: usize = 16;

/// Blocks of a tensor-core product that run at once on one multiprocessor (`__launch_bounds__(512, 2)`).
const MMA_BLOCKS_PER_SM: usize = 2;
/// Splits of a row tile over blocks (`S` of `mm_qw*_s{S}`; index in `Kernels::mm_qw`).
const MMA_SPLITS: [usize; 3] = [1, 2, 4];
/// Weight rows per block of the large-tile tensor-core products (`QT_ROWS` of `mm_qt*`).
const QT_ROWS: usize = 64;
/// Threads per block of `mm_qt*` (`32·QT_WARPS`).
const QT_THREADS: u32 = 256;
/// Most 32-value blocks of a row `mm_qt*` takes (`QT_MAXB`: its visit sequence in shared memory).
const QT_MAXB: usize = 1024;
/// Fewest tokens of a quantized product on `mm_qt*` (`EDDY_CUDA_QT_MIN`; fewer take `mm_qw*`).
const QT_MIN: usize = 64;
/// Waves of blocks (two a multiprocessor) from which a product runs on `mm_qt*` ([`Cuda::tiled_for`]).
const QT_WAVES: usize = 2;
/// Tokens per block of `mm_qt*` (`16·NJ`, NJ = 2 mma columns of 8 per warp).
const QT_TOKENS: usize = 32;

/// Most tokens of a pass whose product rows equal a one-token pass's bit for bit ([`Backend::invariant_tokens`]):
/// the largest verify pass. Launches of more tokens (prefill runs) take `mm_qp*`, whose float order is the plain
/// block order instead of `mm_q_t1`'s tree (docs/cuda.md, "Prefill products in block order").
const INVARIANT_TOKENS: usize = 64;
/// Tokens per prefill pass ([`Backend::prefill_tokens`]), llama.cpp's default ubatch. Measured on the H200
/// (docs/cuda.md, "Prefill products in block order"): 512 tokens of the 1.5B in one run 21.6 ms against 28.5 in
/// runs of 256 (the products' grids twice as large, half the launches).
const PREFILL_TOKENS: usize = 512;
/// Queries per block of `attention_mma` (`FA_QT`).
const FA_QUERIES: usize = 64;
/// Threads per block of `attention_mma` (`32·FA_WARPS`).
const FA_THREADS: u32 = 128;
/// TF32 products of `attention_mma`'s P·V by default (`EDDY_CUDA_FA`): 1. Three (about f32's precision) gave
/// the same KL divergence from the CPU on a real model and a slower prefill (docs/cuda.md, "Flash attention for
/// prefill runs").
pub const FA_PV_PRODUCTS: usize = 1;
/// Token tile of `mm_qp*` (`QP_BN`).
const QP_TOKENS: usize = 64;
/// Weight rows per block of `mm_qp*` (`32·WR`).
const QP_ROWS: usize = 64;
/// Threads per block of `mm_qp*` (`64·WR`).
const QP_THREADS: u32 = 128;

/// The tensor-core product for `n` tokens (n ≥ 2): the kernel variant (tiles of 8 or 16 tokens: `NJ` = 1 or 2
/// mma columns of 8) and the tokens per block.
fn mma_tile(n: usize) -> (usize, usize) {
    if n <= 8 {
        (0, 8)
    } else {
        (1, 16)
    }
}

/// The `mm_qv*` tile for `n` tokens (n ≥ 2): the kernel variant (`NJ` = 1, 2, 4 mma columns of 8) and the
/// tokens per block. Above 32 tokens, tiles of 32 unless they would pad 16 tokens or more (measured on the
/// 1.5B, session 24: a 48-node verify 4.69 ms on three tiles of 16, 4.99 on two of 32; 17–32 nodes 3.11–3.29
/// ms on one tile of 32, 3.49–3.60 on two of 16).
fn qv_tile(n: usize) -> (usize, usize) {
    match n {
        ..=8 => (0, 8),
        9..=16 => (1, 16),
        17..=32 => (2, 32),
        _ if n.next_multiple_of(32) - n < 16 => (2, 32),
        _ => (1, 16),
    }
}

/// The epilogue form of a quantized matrix (`FORM` of `mm_qw*`): 0 implicit offset, 1 explicit offsets,
/// 2 group-16 scales (which take precedence, as in `mm_q_impl`).
fn qform(q: &CudaQ) -> usize {
    if q.g16 {
        2
    } else if q.mins.is_some() {
        1
    } else {
        0
    }
}
/// Threads per (query, head, chunk) block of the attention kernel (`ATT_THREADS`).
const ATT_THREADS: u32 = 256;
/// Register groups of 32 values per thread of the RMSNorm kernels (`NORM_KMAX`).
const NORM_KMAX: usize = 8;

/// Threads per row of the RMSNorm kernels for rows of `d` values: one warp per 32 values up to 32 warps (a
/// function of `d` only, so rows give the same bits in any batch). Panics past `NORM_KMAX·32·32` values.
fn norm_threads(d: usize) -> u32 {
    let groups = d.div_ceil(32);
    assert!(groups <= NORM_KMAX * 32, "rms_norm: rows of {d} values exceed the kernel's {}", NORM_KMAX * 32 * 32);
    32 * groups.clamp(1, 32) as u32
}
/// Largest head dimension of the attention kernel (`ATT_MAX_HD`).
const ATT_MAX_HD: usize = 512;
/// Keys per block of the attention kernel (`ATT_CHUNK`).
const ATT_CHUNK: usize = 64;
/// Most blocks of an attention cluster (`EDDY_CUDA_ATT_CLUSTER`): 8 is the portable limit, 16 what sm_90 allows
/// a kernel that opts in (both attention kernels do).
const ATT_MAX_CLUSTER: usize = 16;
/// Fewest queries of an attention launch that runs `attention_kv` (one block per KV head and query: its query
/// heads share each chunk's keys and values in shared memory); `EDDY_CUDA_ATT_KV_MIN` overrides it (0: never).
/// Measured on the H200 (docs/cuda.md, session 16; 0.5B, 7 query heads per KV head): a 64-token prefill pass's
/// attention 98 → 26 µs a layer; 16-node verify after 512 tokens 3.25 ms against 3.6–3.7 per query head; with 2
/// nodes 1.28–1.38 against 1.14, and a decode step 0.90 against 0.83 ms (fewer, longer blocks).
const ATT_KV_MIN_T: usize = 16;
/// Largest head dimension of `attention_kv` (`ATT_KV_MAX_HD`), and most query heads per KV head it takes.
const ATT_KV_MAX_HD: usize = 128;
const ATT_KV_MAX_GROUP: usize = 16;

/// Dynamic shared memory bytes of `attention_kv` for `group` query heads per KV head of dimension `hd`: keys
/// and values `[ATT_CHUNK][hd + 1]`, the query rows `[group][hd]`, the 8 warps' exponentials `[8][ATT_CHUNK]`.
fn att_kv_smem(group: usize, hd: usize) -> usize {
    4 * (2 * ATT_CHUNK * (hd + 1) + group * hd + (ATT_THREADS as usize / 32) * ATT_CHUNK)
}

/// Dynamic shared memory bytes of `attention_kvc` in clusters of `cluster` blocks: `attention_kv`'s, then the
/// chunk records `[cluster][group][hd + 2]` (those of chunks below `cluster`, in the cluster's first block).
fn att_kvc_smem(group: usize, hd: usize, cluster: usize) -> usize {
    att_kv_smem(group, hd) + 4 * cluster * group * (hd + 2)
}

/// Query rows (query, query head) a warp of `attention_kvs` takes at most (`ATT_KVS_RPW`), and by default
/// (`EDDY_CUDA_ATT_KVS_ROWS` fewer: more blocks, each staging its chunk again, and less reuse of each key a
/// warp holds).
const ATT_KVS_RPW: usize = 6;

/// Dynamic shared memory bytes of `attention_kvs` of head dimension `hd`: keys and values
/// `[ATT_CHUNK][hd + 1]`, the block's query rows `[8·ATT_KVS_RPW][hd]`, their exponentials
/// `[8·ATT_KVS_RPW][ATT_CHUNK]`.
fn att_kvs_smem(hd: usize) -> usize {
    let rows = (ATT_THREADS as usize / 32) * ATT_KVS_RPW;
    4 * (2 * ATT_CHUNK * (hd + 1) + rows * hd + rows * ATT_CHUNK)
}

/// The attention grid's third dimension `Z` for `blocks_per_query` blocks over the heads of each of `t`
/// queries and key lists of at most `nmax` chunks, where `resident` blocks of the kernel fit on the GPU at
/// once (its occupancy per multiprocessor times the multiprocessors): block z of a (query, heads) takes its
/// chunks z, z + Z, … (see the kernel), so any `Z` in 1..=nmax gives the same bits. The grid is sized to one
/// wave of resident blocks instead of `nmax` (the cache's capacity in chunks: at 4096 rows 64, nearly all of
/// them past a decode, prefill or verify query's keys; such a block only reads its key count and exits, but it
/// takes a slot, and the next kernel cannot launch before every block of this one has started). It depends
/// on the launch shape only, so a captured graph replays it for any context length.
///
/// (Sessions 16–30 aimed at 8 blocks a multiprocessor, a full one by threads; the kernels' registers let
/// only 2 reside (`attention` 118 a thread, `attention_kv` 128), so a 0.5B decode step's 14 × 64 blocks ran
/// in 3.4 waves, nearly all of them blocks past the keys.)
fn att_chunk_blocks(blocks_per_query: usize, t: usize, nmax: usize, resident: usize) -> usize {
    resident.max(1).div_ceil((blocks_per_query * t).max(1)).clamp(1, nmax.max(1))
}
/// Blocks of `f` (of `threads` threads and `smem` bytes of dynamic shared memory) that fit on one
/// multiprocessor at once, by the driver's occupancy calculator (registers, shared memory, threads); at least 1.
fn occupancy(f: Func, threads: u32, smem: u32) -> Result<usize> {
    // SAFETY: `f` is a kernel of the loaded module; the call only reads its attributes.
    let n = unsafe { result::occupancy::max_active_block_per_multiprocessor(f.0, threads as i32, smem as usize) }
        .map_err(|e| Error::Input(format!("no CUDA driver/GPU: occupancy of a kernel: {e:?}")))?;
    Ok(n.max(1) as usize)
}
/// The phase boundaries [`Cuda::sync_probe`] times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncProbe {
    /// A grid-wide barrier among one block a multiprocessor.
    Grid,
    /// The cluster barrier among clusters of this many blocks; whether the neighbour's value comes from its
    /// shared memory (distributed shared memory) rather than global memory.
    Cluster(usize, bool),
    /// The same from shared memory behind a lighter barrier: a release fence restricted to the block's shared
    /// memory, then a relaxed arrive.
    ClusterShared(usize),
    /// A kernel boundary: consecutive launches with programmatic dependent launch.
    Launches,
}

/// A measurement setting from the environment (`EDDY_CUDA_*`): `None` when unset, the value when it parses and
/// `ok` takes it; otherwise a one-line warning on stderr naming the variable and what it takes (`takes`), and
/// `None`, so that a mistyped setting is not silently measured as the default.
fn env_setting<T: std::str::FromStr>(name: &str, takes: &str, ok: impl Fn(&T) -> bool) -> Option<T> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse::<T>() {
        Ok(x) if ok(&x) => Some(x),
        _ => {
            eprintln!("warning: {name}={v} ignored: it takes {takes}");
            None
        }
    }
}

/// `EDDY_CUDA_DP4A_MAX` (1 to 8), else [`DP4A_MAX`].
fn dp4a_max_from_env() -> usize {
    env_setting("EDDY_CUDA_DP4A_MAX", "1 to 8", |m: &usize| (1..=MM_TT).contains(m)).unwrap_or(DP4A_MAX)
}

/// Whether `matmul_parts` groups parts of different forms by default ([`one_launch`]): measured on an H100 in
/// session 38 (docs/cuda.md, "Three defaults measured"): the 0.5B's decode step −5 %, the 1.5B's −5 %.
const JOINT_PARTS: bool = true;

/// `EDDY_CUDA_PAIR`: 0, `matmul_parts` runs each part alone where its parts cannot all share one launch; unset or
/// anything else, two that can share one ([`Cuda::force_pair_parts`]).
fn pair_from_env() -> bool {
    std::env::var("EDDY_CUDA_PAIR").map_or(true, |v| v != "0")
}

/// `EDDY_CUDA_QT`: `Cuda::forced_tiled`'s start value (0 by the launch's size, 1 never, 2 always).
fn tiled_from_env() -> usize {
    env_setting("EDDY_CUDA_QT", "0, 1 or 2", |t: &usize| *t <= 2).unwrap_or(0)
}

/// `EDDY_CUDA_JOINT`: 1, parts of different forms in one launch where the kernels allow it; 0, only parts of
/// one form; unset, [`JOINT_PARTS`].
fn joint_from_env() -> bool {
    env_setting("EDDY_CUDA_JOINT", "0 or 1", |j: &u8| *j <= 1).map_or(JOINT_PARTS, |j| j == 1)
}

/// `EDDY_CUDA_T1_UNROLL`: 2 (`mm_q_t1` for every one-token product) or 4 (unset, the default: `mm_q_t1u4*`
/// for rows of 3+ blocks a lane).
fn t1_unroll_from_env() -> usize {
    env_setting("EDDY_CUDA_T1_UNROLL", "2 or 4 (4 is the default)", |&u: &usize| u == 4 || u == 2).unwrap_or(4)
}

/// Blocks of the thread-block cluster a decode step's attention runs as by default ([`Cuda::att_cluster`]).
/// Measured on the H100 (docs/cuda.md, session 32): see there for the A/B against no clusters and 8.
const ATT_DECODE_CLUSTER: usize = 16;

/// Where a decode step's attention runs split over blocks per KV head (`attention_dkv_hd*`: each KV head's
/// chunks read once for the item's query heads, the chunks spread over [`ATT_DKV_PER_SM`] blocks a
/// multiprocessor; docs/cuda.md, "The decode attention per KV head, over many blocks") instead of in clusters
/// of at most 16 blocks per query head (`attention_dec_hd*`): 0 nowhere, 1 from [`ATT_DKV_MIN_CHUNKS`] key
/// chunks on, 2 everywhere (tests). The same bits either way.
const ATT_DKV: u8 = 1;

/// The fewest key chunks of a decode step on `attention_dkv` by default: more than a cluster of
/// [`ATT_DECODE_CLUSTER`] blocks holds (below, `attention_dec`'s blocks take one chunk each and combine in
/// shared memory, which the split kernel's combination through memory does not beat).
const ATT_DKV_MIN_CHUNKS: usize = ATT_DECODE_CLUSTER + 1;

/// Blocks a multiprocessor of `attention_dkv`'s grid by default ([`Cuda::att_dkv_per_sm`]): the grid is
/// ⌈this × multiprocessors / KV heads⌉ blocks per KV head.
const ATT_DKV_PER_SM: usize = 2;
/// The blocks a multiprocessor `attention_dkv`'s grid may be given (`EDDY_CUDA_ATT_DKV_SM`,
/// [`Cuda::force_split_decode_blocks`]).
const ATT_DKV_SM_RANGE: std::ops::RangeInclusive<usize> = 1..=8;

/// Whether a decode step whose query sees `keys` keys runs `attention_dkv` under `mode` (0 nowhere, 1 from
/// [`ATT_DKV_MIN_CHUNKS`] chunks of 64 keys, 2 always: [`ATT_DKV`]), and if so its grid's blocks per KV head:
/// ⌈`per_sm` × `sms` / `n_kv_heads`⌉ (`per_sm` blocks on each of `sms` multiprocessors), at least 1. A function
/// of the launch's shape and depth, so a captured graph holds the choice of its step.
pub fn split_decode_plan(mode: u8, keys: usize, per_sm: usize, sms: usize, n_kv_heads: usize) -> Option<usize> {
    let takes = match mode {
        0 => false,
        1 => keys.div_ceil(ATT_CHUNK) >= ATT_DKV_MIN_CHUNKS,
        _ => true,
    };
    takes.then(|| (per_sm * sms).div_ceil(n_kv_heads.max(1)).max(1))
}

/// `EDDY_CUDA_ATT_DKV`: 0 runs decode steps' attention in clusters per query head (`attention_dec`), 1 on
/// `attention_dkv` from [`ATT_DKV_MIN_CHUNKS`] chunks, 2 always; unset, [`ATT_DKV`].
fn att_dkv_from_env() -> u8 {
    env_setting("EDDY_CUDA_ATT_DKV", "0, 1 or 2", |d: &u8| *d <= 2).unwrap_or(ATT_DKV)
}

/// `EDDY_CUDA_ATT_DKV_SM`: `attention_dkv`'s blocks a multiprocessor, 1 to 8; unset, [`ATT_DKV_PER_SM`].
fn att_dkv_per_sm_from_env() -> usize {
    env_setting("EDDY_CUDA_ATT_DKV_SM", "1 to 8", |d: &usize| ATT_DKV_SM_RANGE.contains(d)).unwrap_or(ATT_DKV_PER_SM)
}

/// `EDDY_CUDA_ATT_CLUSTER`: 2 to 16, clusters of that size for every attention launch; 0 or 1, none; unset,
/// [`ATT_DECODE_CLUSTER`] for one-query launches only. Returns (size, whether every launch takes it).
fn att_cluster_from_env() -> (usize, bool) {
    match env_setting("EDDY_CUDA_ATT_CLUSTER", "0 or 1 (none) or 2 to 16", |c: &usize| *c <= ATT_MAX_CLUSTER) {
        Some(c) if c >= 2 => (c, true),
        Some(_) => (0, true),
        None => (ATT_DECODE_CLUSTER, false),
    }
}
/// Blocks of the cluster a launch per KV head of head dims 64 and 128 (verifies) runs as on `attention_kvc`
/// by default ([`Cuda::att_kvc`]; capped at one wave). Measured on an H100 in session 38 (docs/cuda.md, "Three
/// defaults measured"): the 0.5B's 16-node verify −1.8 % against `attention_kv`, clusters of 4 and 16 within
/// ±0.6 % of 8; the 1.5B's even.
const ATT_KVC_CLUSTER: usize = 8;

/// `EDDY_CUDA_ATT_KVC`: 0 or 1 puts launches per KV head on `attention_kv` without clusters; 2 to 16,
/// `attention_kvc` in clusters of that size; unset, [`ATT_KVC_CLUSTER`].
fn att_kvc_from_env() -> usize {
    match env_setting("EDDY_CUDA_ATT_KVC", "0 or 1 (off) or 2 to 16", |c: &usize| *c <= ATT_MAX_CLUSTER) {
        Some(c) if c >= 2 => c,
        Some(_) => 0,
        None => ATT_KVC_CLUSTER,
    }
}

/// Whether a verify's committed chunks run once for all its queries (`attention_kvs`) by default.
const ATT_KVS: bool = true;

/// `EDDY_CUDA_ATT_KVS`: 0 or 1; unset, [`ATT_KVS`].
fn att_kvs_from_env() -> bool {
    env_setting("EDDY_CUDA_ATT_KVS", "0 or 1", |c: &u8| *c <= 1).map_or(ATT_KVS, |c| c == 1)
}

/// The fewest queries a launch computes its committed chunks once for (`attention_kvs`) by default: with 2 the
/// extra launch costs more than the second reading of the keys saves (1.5B, depth 2,048, H100: a 2-node verify
/// 2.49 ms against 2.34 per query; 4 nodes 3.05 against 3.72).
const ATT_KVS_MIN_QUERIES: usize = 4;

/// The fewest (query, committed key) pairs, t × committed rows, a launch computes its committed chunks once
/// for by default: below it the second launch and the combination over more records cost about what sharing
/// saves (1.5B, H100, depth 512: 4 nodes +7.8 %, 16 nodes +1.5 %, 64 nodes −6.5 %; depth 2,048: 4 nodes −25 %).
const ATT_KVS_MIN_PAIRS: usize = 8192;

/// The fewest committed rows a launch computes its committed chunks once for by default (depth 64: the
/// model-free timing's 64-node launch 44 µs shared against 28 per query).
const ATT_KVS_MIN_COMMITTED: usize = 256;

/// `EDDY_CUDA_ATT_KVS_ROWS`: 1 to [`ATT_KVS_RPW`]; unset, [`ATT_KVS_RPW`].
fn att_kvs_rows_from_env() -> usize {
    env_setting("EDDY_CUDA_ATT_KVS_ROWS", "1 to 6", |r: &usize| (1..=ATT_KVS_RPW).contains(r)).unwrap_or(ATT_KVS_RPW)
}

/// Whether `rms_norm_quantize` runs rows of at most one or two groups a warp on `rms_norm_quant_k{1,2}` by
/// default. Measured on an H100 in session 38 (docs/cuda.md, "Three defaults measured"): the decode step −4.1 %
/// (0.5B) and −3.5 % (1.5B).
const NORM_FIT: bool = true;

/// `EDDY_CUDA_NORM_FIT`: 1 runs `rms_norm_quantize` of rows of at most one or two groups of 32 a warp on
/// `rms_norm_quant_k{1,2}`, 0 every row on the 8-group kernel; unset, [`NORM_FIT`].
fn norm_fit_from_env() -> bool {
    env_setting("EDDY_CUDA_NORM_FIT", "0 or 1", |d: &u8| *d <= 1).map_or(NORM_FIT, |d| d == 1)
}

/// `EDDY_CUDA_ATT_DEC`: 0 puts decode steps' attention back on `attention` (an A/B; `attention_dkv` too); unset or
/// 1, `attention_dec` (and `attention_dkv` where [`Cuda::att_dkv`] says).
fn att_dec_from_env() -> bool {
    env_setting("EDDY_CUDA_ATT_DEC", "0 or 1", |d: &u8| *d <= 1).is_none_or(|d| d == 1)
}
/// `EDDY_CUDA_ROPE_ATT`: 0 runs a decode step's RoPE and cache store as their own kernel (`rope_store`, an
/// A/B); unset or 1, inside its attention (`attention_dec_rope_hd*`) where that kernel runs.
fn rope_att_from_env() -> bool {
    env_setting("EDDY_CUDA_ROPE_ATT", "0 or 1", |d: &u8| *d <= 1).is_none_or(|d| d == 1)
}

/// `Cuda::t1_unroll`'s, `Cuda::t2_unroll`'s and `Cuda::t4_unroll`'s value for "deeper loads at every width"
/// (`mm_q_t1u4*`, `mm_q_t2u4*`, `mm_q_t4u2*`; tests).
const DEEP_ALWAYS: usize = 104;

/// Whether a product of rows of `cols` values loads `depth` blocks of a row at once under the unroll setting
/// `u` (`Cuda::t1_unroll`, `Cuda::t2_unroll`, `Cuda::t4_unroll`): `depth` for rows of at least 3 blocks a lane,
/// [`DEEP_ALWAYS`] for all.
fn deep_at(u: usize, depth: usize, cols: usize) -> bool {
    (u == depth && cols / QK >= 3 * 32) || u == DEEP_ALWAYS
}

/// Blocks of a row a two-token product loads at once (`mm_q_t2u4*`, rows of 3+ blocks a lane: the verify's down
/// projections) by default: 4. Measured on an H100 in session 53 (docs/cuda.md, "Two-token products with deeper
/// loads … measured"): the 1.5B's 2-node verify −7.1 % (three rounds of `eddy speed`), tg128 and the 3-node verify
/// even; 2 blocks deep gave −5.8 % and were dropped.
const T2_UNROLL: usize = 4;

/// `EDDY_CUDA_T2_UNROLL`: 0 (`mm_q_t2` for every two-token product) or 4 (`mm_q_t2u4*` for rows of 3+ blocks a
/// lane); unset, [`T2_UNROLL`].
fn t2_unroll_from_env() -> usize {
    env_setting("EDDY_CUDA_T2_UNROLL", "0 or 4", |u: &usize| [0, 4].contains(u)).unwrap_or(T2_UNROLL)
}

/// Whether `matmul_parts` runs two-token parts of different code packings in one launch (`mm_q3x_t2`: the
/// 1.5B's Q4_K q/k beside its Q6_K v) by default, where the parts would otherwise pair and leave the third
/// alone. Measured on an H100 in session 53: with [`T2_UNROLL`] on, the 1.5B's 2-node verify a further −1.9 %
/// (−8.8 % for both against neither).
const MIXED_T2: bool = true;

/// `EDDY_CUDA_MIXED_T2`: 1 runs two-token parts of different code packings in one launch; 0 does not; unset,
/// [`MIXED_T2`].
fn mixed_t2_from_env() -> bool {
    env_setting("EDDY_CUDA_MIXED_T2", "0 or 1", |m: &u8| *m <= 1).map_or(MIXED_T2, |m| m == 1)
}

/// Blocks of a row a three- or four-token `dp4a` product loads at once (`mm_q_t4u2*`, rows of 3+ blocks a lane:
/// the 3-node verify's down projections) by default: 0, none (`mm_q_t4`'s loop). Written in session 53 after
/// the two-token kernels' measurement (`mm_q_impl`'s `U` path for TT = 4, 136 / 146 registers, no spills), not
/// yet run: `EDDY_CUDA_T4_UNROLL=2` is the A/B.
const T4_UNROLL: usize = 0;

/// `EDDY_CUDA_T4_UNROLL`: 0 (`mm_q_t4` for every three- or four-token `dp4a` product) or 2 (`mm_q_t4u2*` for
/// rows of 3+ blocks a lane); unset, [`T4_UNROLL`].
fn t4_unroll_from_env() -> usize {
    env_setting("EDDY_CUDA_T4_UNROLL", "0 or 2", |u: &usize| [0, 2].contains(u)).unwrap_or(T4_UNROLL)
}

/// Whether `matmul_parts` runs three- and four-token parts of different code packings in one `dp4a` launch
/// (`mm_q3x_t4`: the 1.5B's Q4_K q/k beside its Q6_K v in a 3-node verify) by default. Written in session 53,
/// not yet run: `EDDY_CUDA_MIXED_T4=1` is the A/B.
const MIXED_T4: bool = false;

/// `EDDY_CUDA_MIXED_T4`: 1 runs three- and four-token parts of different code packings in one launch; 0 does
/// not; unset, [`MIXED_T4`].
fn mixed_t4_from_env() -> bool {
    env_setting("EDDY_CUDA_MIXED_T4", "0 or 1", |m: &u8| *m <= 1).map_or(MIXED_T4, |m| m == 1)
}

/// Whether `mm_qv*` launches of more row tiles than fit the GPU at once run on the resident kernels
/// (`mm_qv*_w8r`: a grid of the blocks that fit, each walking row tiles with the activations it reads held in
/// shared memory, loaded once; [`Cuda::qv_res_plan`]). Measured on an H100 in session 39 (docs/cuda.md,
/// "Resident verify products" and the section before it): against session 38's binaries the 0.5B's 16-node
/// verify −3.6 %, the 1.5B's even (its LM head faster, its gate/up products slower).
const QV_RES: bool = true;

/// `Cuda::qv_res`'s values: never, launches of more row tiles than fit at once, every launch that fits
/// shared memory (tests).
const QV_RES_OFF: usize = 0;
const QV_RES_LARGE: usize = 1;
const QV_RES_ALWAYS: usize = 2;

/// `EDDY_CUDA_QV_RES`: 1 runs `mm_qv*` launches of more row tiles than fit at once on the resident kernels,
/// 0 never; unset, [`QV_RES`].
fn qv_res_from_env() -> usize {
    match env_setting("EDDY_CUDA_QV_RES", "0 or 1", |d: &u8| *d <= 1).map_or(QV_RES, |d| d == 1) {
        true => QV_RES_LARGE,
        false => QV_RES_OFF,
    }
}

/// The most blocks of 32 columns a warp of a resident product kernel visits in a row tile of `cols` columns:
/// warp w of the 8 takes the chains of classes rev5(4w + k), k < 4, class c the blocks c, c + 32, … below
/// cols / 32 (the kernels' `qv_res_entries`, which sizes the warps' shares of the shared memory the same way).
fn qv_res_entries(cols: usize) -> usize {
    let nblk = cols / QK;
    let rev5 = |i: usize| (i as u32).reverse_bits() as usize >> 27;
    let chain = |c: usize| if c < nblk { (nblk - 1 - c) / 32 + 1 } else { 0 };
    (0..8).map(|w| (0..4).map(|k| chain(rev5(4 * w + k))).sum::<usize>()).max().unwrap_or(0)
}

/// `EDDY_CUDA_QV_CLUSTER` (2, 4 or 8; unset or anything else: 0, no clusters).
fn qv_cluster_from_env() -> usize {
    env_setting("EDDY_CUDA_QV_CLUSTER", "2, 4 or 8", |c: &usize| [2, 4, 8].contains(c)).unwrap_or(0)
}

/// Fewest operations a queued list needs to be considered for a graph (smaller ones run eagerly).
const GRAPH_MIN_OPS: usize = 32;
/// Graphs kept per backend (decode, verify of each node count in use, a DFlash round of each accepted length).
const MAX_GRAPHS: usize = 64;
/// Initial bytes of the per-pass host-data arena (a pass of 64 tree nodes stages about 10 KiB per distinct
/// key list).
const ARENA_BYTES: usize = 1 << 20;

/// The device's primary context, our stream, and the queue of operations not yet sent to the GPU.
struct Ctx {
    raw: sys::CUcontext,
    stream: sys::CUstream,
    queue: Mutex<Queue>,
}
// SAFETY: a CUDA context may be made current on any thread; the stream is used with it bound and the queue
// behind its mutex.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

/// One queued operation, with its exact arguments: replayed one by one or captured into a graph.
// Kept unboxed: a step queues ~300 of them into a reused vector (no allocation per launch).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    /// A kernel launch (function handle as an integer, grid, block size, dynamic shared memory bytes, blocks
    /// of a thread-block cluster along the grid's z (0 or 1: no cluster), argument slots).
    Kernel { f: usize, grid: [u32; 3], block: u32, smem: u32, cluster: u8, n: u8, args: [u64; ARGS] },
    /// A device-to-device copy of `bytes`.
    Copy { dst: u64, src: u64, bytes: usize },
}

/// A graph ready to launch.
struct Exec(sys::CUgraphExec);
// SAFETY: an executable graph may be launched from any thread with its context bound.
unsafe impl Send for Exec {}

/// Operations queued since the last flush, and the host data they read.
///
/// Host arrays a pass needs (token ids, positions, key lists, the first KV row written)
/// are staged in `arena` and copied, in one transfer, to the device arena at `arena_dev` right before the
/// operations run: kernels read them there, so a pass's operation list does not change with them and a
/// captured graph replays any later step of the same shape ([`GraphPlan`]).
struct Queue {
    ops: Vec<Op>,
    /// Hash of `ops` (updated as they are pushed; a multiply-rotate fold of their words, cheap enough for
    /// the ~400 operations of a step).
    hash: u64,
    arena: Vec<u8>,
    arena_dev: u64,
    arena_cap: usize,
    /// Arenas outgrown during the current list: still read by queued operations, freed after the next flush.
    retired: Vec<u64>,
    /// Per staging slot: the bytes staged there in this flush and their device address (dedup of the
    /// positions, frequencies and key lists every layer of a pass uses).
    staged: [(Vec<u8>, u64); SLOTS],
    plan: GraphPlan<Vec<Op>, Exec>,
    /// Passes run as graphs, eagerly, and graphs captured (counters for tests and timings).
    stats: GraphStats,
    /// Whether a kernel that follows a kernel is launched with programmatic stream serialization (PDL,
    /// [`Cuda::set_programmatic_launch`]).
    pdl: bool,
    /// The empty kernel launched in place of every kernel, or 0 ([`Cuda::set_empty_kernels`]).
    noop: usize,
    /// With `noop` set, the kernels it replaces; empty: all of them ([`Cuda::set_empty_kernels_named`]).
    empty_only: Vec<usize>,
    /// The kernel `noop` never replaces: the RoPE table's fill ([`Cuda::rope_table`]), whose results outlive
    /// the measurement.
    never_empty: usize,
    /// The kernels of the last list of at least `GRAPH_MIN_OPS` operations, in order ([`Cuda::last_list_kernels`]).
    last_list: Vec<usize>,
    /// The hash of the list `last_list` came from.
    last_list_hash: u64,
    /// While recording ([`Cuda::record_kernels`]): every kernel flushed since, in launch order.
    recorded: Option<Vec<usize>>,
    /// `EDDY_CUDA_TRACE=1`: each flush prints its list's length, hash and plan to stderr (why a pass
    /// does not replay: a list that changes every time never does).
    trace: bool,
}

/// The kernels a list of operations launches, in order (its copies left out).
fn kernels_of(ops: &[Op]) -> impl Iterator<Item = usize> + '_ {
    ops.iter().filter_map(|op| match op {
        Op::Kernel { f, .. } => Some(*f),
        Op::Copy { .. } => None,
    })
}

/// Staging slots of [`Queue::staged`].
const SLOT_POS: usize = 0;
const SLOT_FREQ: usize = 1;
const SLOT_INFO: usize = 2;
const SLOT_PATHS: usize = 3;
const SLOT_ROW0: usize = 4;
const SLOTS: usize = 5;

/// How queued work has run so far ([`Cuda::graph_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Lists run op by op.
    pub eager: u64,
    /// Lists captured into a new graph (and run).
    pub captured: u64,
    /// Lists run by replaying a kept graph.
    pub replayed: u64,
    /// Programmatic (PDL) edges in the graphs captured so far: kernels that may start before the kernel
    /// they follow has finished (0 with programmatic launches off).
    pub programmatic_edges: u64,
}

thread_local! {
    /// The context this thread made current last through [`Ctx::bind`] (0: none): the driver call is skipped
    /// when it is already ours (one driver call less per operation; measured on the H200: the host's time to
    /// queue a decode step fell from 3.2 to 1.7 ms). Code outside this module that changes the thread's
    /// current context would make this stale; eddy has none.
    static BOUND: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Ctx {
    /// Make the context current on the calling thread.
    fn bind(&self) {
        if BOUND.with(|b| b.get()) == self.raw as usize {
            return;
        }
        // SAFETY: the context is retained for the life of the process.
        unsafe { result::ctx::set_current(self.raw) }.unwrap_or_else(|e| panic!("CUDA: cannot bind the context: {e:?}"));
        BOUND.with(|b| b.set(self.raw as usize));
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Send every queued operation to the GPU (as a graph when the plan says so).
    fn flush(&self) {
        self.bind();
        self.queue().flush(self.stream);
    }
}

impl Queue {
    /// A queue whose plan keeps [`MAX_GRAPHS`] graphs, or none when the environment variable
    /// `EDDY_CUDA_GRAPHS` is `0` (every list runs op by op: for measuring what graphs save, and as a fallback).
    fn new() -> Queue {
        let graphs = std::env::var("EDDY_CUDA_GRAPHS").map_or(true, |v| v != "0");
        Queue {
            ops: Vec::new(),
            hash: 0,
            arena: Vec::new(),
            arena_dev: 0,
            arena_cap: 0,
            retired: Vec::new(),
            staged: Default::default(),
            plan: GraphPlan::new(if graphs { MAX_GRAPHS } else { 0 }),
            stats: GraphStats::default(),
            pdl: false,
            noop: 0,
            empty_only: Vec::new(),
            never_empty: 0,
            last_list: Vec::new(),
            last_list_hash: 0,
            recorded: None,
            trace: std::env::var("EDDY_CUDA_TRACE").is_ok_and(|v| v == "1"),
        }
    }

    fn push(&mut self, op: Op) {
        let mut h = self.hash;
        let mut mix = |w: u64| h = (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
        match &op {
            Op::Kernel { f, grid, block, smem, cluster, n, args } => {
                mix(*f as u64);
                mix(u64::from(grid[0]) | u64::from(grid[1]) << 32);
                mix(u64::from(grid[2]) | u64::from(*block) << 32);
                mix(u64::from(*smem) | u64::from(*n) << 32 | u64::from(*cluster) << 40);
                args[..*n as usize].iter().for_each(|&a| mix(a));
            }
            Op::Copy { dst, src, bytes } => {
                mix(*dst);
                mix(*src);
                mix(*bytes as u64);
            }
        }
        self.hash = h;
        self.ops.push(op);
    }

    /// Stage `data` in the arena (16-byte aligned); its device address. In slot `slot` (not `SLOTS`),
    /// data equal to that slot's last staging in this flush is not staged again.
    fn stage(&mut self, stream: sys::CUstream, slot: usize, data: &[u8]) -> u64 {
        if slot < SLOTS && self.staged[slot].1 != 0 && self.staged[slot].0 == data {
            return self.staged[slot].1;
        }
        let at = self.arena.len().next_multiple_of(16);
        let end = at + data.len().max(4);
        if end > self.arena_cap {
            // Run what reads the old arena, then a larger one. Operations of this list may still be queued
            // with addresses in the old arena (staged before it filled up): it is freed after the next flush.
            self.flush(stream);
            if self.arena_dev != 0 {
                self.retired.push(self.arena_dev);
            }
            self.arena_cap = (data.len() + 16).next_power_of_two().max(ARENA_BYTES);
            // SAFETY: a plain allocation in the bound context.
            self.arena_dev = check(unsafe { result::malloc_sync(self.arena_cap) }, "arena allocation");
            return self.stage(stream, slot, data);
        }
        self.arena.resize(at, 0);
        self.arena.extend_from_slice(data);
        self.arena.resize(end, 0);
        let dev = self.arena_dev + at as u64;
        if slot < SLOTS {
            self.staged[slot].0.clear();
            self.staged[slot].0.extend_from_slice(data);
            self.staged[slot].1 = dev;
        }
        dev
    }

    /// Copy the arena to the device, then run the queued operations: replay a kept graph of the same list,
    /// capture one for a list seen before, or launch them one by one ([`GraphPlan`]).
    fn flush(&mut self, stream: sys::CUstream) {
        if !self.arena.is_empty() && !self.ops.is_empty() {
            // SAFETY: the arena holds `arena_cap >= arena.len()` bytes; a pageable source is staged before the
            // call returns, in stream order before the operations that read it.
            check(unsafe { result::memcpy_htod_async(self.arena_dev, &self.arena[..], stream) }, "arena copy");
        }
        self.arena.clear();
        for s in &mut self.staged {
            s.1 = 0;
        }
        if self.ops.is_empty() {
            return;
        }
        let retired = std::mem::take(&mut self.retired);
        let hash = std::mem::take(&mut self.hash);
        let ops = std::mem::take(&mut self.ops);
        let plan = if ops.len() >= GRAPH_MIN_OPS { self.plan.decide(hash, &ops) } else { Plan::Eager };
        // Refilled when the list changes (a replayed step costs one comparison).
        if ops.len() >= GRAPH_MIN_OPS && hash != self.last_list_hash {
            self.last_list_hash = hash;
            self.last_list.clear();
            self.last_list.extend(kernels_of(&ops));
        }
        if let Some(r) = &mut self.recorded {
            r.extend(kernels_of(&ops));
        }
        if self.trace {
            eprintln!("eddy cuda: list of {} ops, hash {hash:016x}: {plan:?}", ops.len());
        }
        match plan {
            Plan::Replay(i) => {
                self.stats.replayed += 1;
                // SAFETY: a graph instantiated from this very list of launches on live buffers.
                check(unsafe { result::graph::launch(self.plan.get(i).0, stream) }, "graph launch");
                self.ops = ops;
                self.ops.clear();
            }
            Plan::Capture => {
                self.stats.captured += 1;
                let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                // SAFETY: our stream; the launches below are recorded, not run, until the graph is launched.
                check(unsafe { result::stream::begin_capture(stream, mode) }, "stream capture");
                run_ops(&ops, stream, self.pdl, (self.noop, self.never_empty), &self.empty_only);
                // SAFETY: the capture begun above.
                let g = check(unsafe { result::stream::end_capture(stream) }, "end of stream capture");
                self.stats.programmatic_edges += programmatic_edges(g);
                // SAFETY: `g` is the captured graph; it is destroyed once instantiated.
                let exec = unsafe {
                    let mut e = std::mem::MaybeUninit::uninit();
                    check(sys::cuGraphInstantiateWithFlags(e.as_mut_ptr(), g, 0).result(), "graph instantiation");
                    let _ = result::graph::destroy(g);
                    e.assume_init()
                };
                // SAFETY: just instantiated.
                check(unsafe { result::graph::launch(exec, stream) }, "graph launch");
                if let Some(old) = self.plan.insert(hash, ops, Exec(exec)) {
                    // SAFETY: no longer referenced; launches already queued keep their own copy.
                    let _ = unsafe { result::graph::exec_destroy(old.0) };
                }
            }
            Plan::Eager => {
                self.stats.eager += 1;
                run_ops(&ops, stream, self.pdl, (self.noop, self.never_empty), &self.empty_only);
                self.ops = ops;
                self.ops.clear();
            }
        }
        for a in retired {
            // SAFETY: an arena no longer staged into; cuMemFree waits for the work reading it.
            let _ = unsafe { result::free_sync(a) };
        }
    }
}

/// The programmatic edges of graph `g` (0 when the driver cannot list them).
fn programmatic_edges(g: sys::CUgraph) -> u64 {
    let mut n = 0usize;
    // SAFETY: a query of the edge count (null arrays), then of at most `n` edges into arrays of `n` entries.
    unsafe {
        let null = std::ptr::null_mut();
        if sys::cuGraphGetEdges_v2(g, null, null, std::ptr::null_mut(), &mut n) != sys::CUresult::CUDA_SUCCESS || n == 0 {
            return 0;
        }
        let mut from = vec![std::ptr::null_mut(); n];
        let mut to = vec![std::ptr::null_mut(); n];
        let mut data = vec![sys::CUgraphEdgeData { from_port: 0, to_port: 0, type_: 0, reserved: [0; 5] }; n];
        if sys::cuGraphGetEdges_v2(g, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n) != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        data[..n.min(data.len())].iter().filter(|e| e.type_ == programmatic).count() as u64
    }
}

/// The launch attribute that groups `blocks` consecutive blocks along the grid's z into a thread-block cluster.
fn cluster_attr(blocks: u32) -> sys::CUlaunchAttribute {
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue { clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z: blocks } },
    }
}

/// Launch `ops` on `stream` in order; with `pdl`, each kernel that follows a kernel with programmatic stream
/// serialization (it may start before its predecessor ends and waits for it in `pdl_wait`, kernels.cu). With
/// `noop` not 0, that kernel is launched in place of each kernel but `keep` (same grid, block and shared
/// memory), or of each kernel in `only` when that is not empty.
fn run_ops(ops: &[Op], stream: sys::CUstream, pdl: bool, (noop, keep): (usize, usize), only: &[usize]) {
    let mut after_kernel = false;
    for op in ops {
        match *op {
            Op::Kernel { f, grid, block, smem, cluster, n, args } => {
                let mut ptrs = [std::ptr::null_mut::<c_void>(); ARGS];
                for (p, v) in ptrs.iter_mut().zip(&args[..n as usize]) {
                    *p = v as *const u64 as *mut c_void;
                }
                let mut attrs = [sys::CUlaunchAttribute {
                    id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                    pad: [0; 4],
                    value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
                }; 2];
                let mut na = 0;
                if pdl && after_kernel {
                    na += 1;
                }
                if cluster > 1 {
                    attrs[na] = cluster_attr(u32::from(cluster));
                    na += 1;
                }
                let config = sys::CUlaunchConfig {
                    gridDimX: grid[0],
                    gridDimY: grid[1],
                    gridDimZ: grid[2],
                    blockDimX: block,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: stream,
                    attrs: attrs.as_mut_ptr(),
                    numAttrs: na as u32,
                };
                // SAFETY: `f` is a kernel of our module whose parameters match `args` (each call site follows
                // the signature in kernels.cu); the buffers it addresses are live device allocations of the
                // right sizes (checked when queued; buffers are not freed while operations are queued). The
                // config and its attribute live through the call.
                check(
                    unsafe {
                        let f = if noop != 0 && f != keep && (only.is_empty() || only.contains(&f)) { noop } else { f };
                        sys::cuLaunchKernelEx(&config, f as sys::CUfunction, ptrs.as_mut_ptr(), std::ptr::null_mut()).result()
                    },
                    "kernel launch",
                );
                after_kernel = true;
            }
            Op::Copy { dst, src, bytes } => {
                // SAFETY: both ranges lie in live allocations (checked when queued) and do not overlap.
                check(unsafe { result::memcpy_dtod_async(dst, src, bytes, stream) }, "device-to-device copy");
                after_kernel = false;
            }
        }
    }
}

/// Device memory, freed on drop.
pub struct DevMem {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<Ctx>,
}

impl DevMem {
    fn new(ctx: &Arc<Ctx>, bytes: usize) -> DevMem {
        let ptr = if bytes == 0 {
            0
        } else {
            ctx.bind();
            // SAFETY: a plain allocation in the bound context.
            unsafe { result::malloc_sync(bytes) }.unwrap_or_else(|e| panic!("CUDA: cannot allocate {bytes} bytes of device memory: {e:?}"))
        };
        DevMem { ptr, bytes, ctx: ctx.clone() }
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // Queued operations may address this memory: run them first.
            self.ctx.flush();
            // SAFETY: allocated by `DevMem::new`, freed once (cuMemFree waits for work using it).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A device buffer of `f32` values ([`Backend::Buf`]).
pub struct CudaBuf {
    mem: DevMem,
    len: usize,
}

impl CudaBuf {
    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> u64 {
        self.mem.ptr
    }

    /// Device address of value `i`.
    fn at(&self, i: usize) -> u64 {
        self.mem.ptr + 4 * i as u64
    }
}

/// A quantized matrix on the device ([`GpuQ`]'s layout) with its rotation signs.
pub struct CudaQ {
    rows: usize,
    cols: usize,
    half: i32,
    packed4: bool,
    g16: bool,
    codes: DevMem,
    scales: DevMem,
    mins: Option<DevMem>,
    /// `(Signs::id, D_in)` of a rotated input side.
    in_signs: Option<(u64, DevMem)>,
    /// `D_out` of a rotated output side, and its number of Hadamard blocks.
    out_signs: Option<(DevMem, usize)>,
}

/// A weight matrix on the device ([`Backend::Weights`]).
pub enum CudaWeights {
    /// `rows × cols` f32.
    F32 { rows: usize, cols: usize, data: DevMem },
    /// `rows × cols` bf16 bit patterns.
    Bf16 { rows: usize, cols: usize, data: DevMem },
    /// Quantized codes and scales.
    Q(CudaQ),
}

impl CudaWeights {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            CudaWeights::F32 { rows, .. } | CudaWeights::Bf16 { rows, .. } => *rows,
            CudaWeights::Q(q) => q.rows,
        }
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            CudaWeights::F32 { cols, .. } | CudaWeights::Bf16 { cols, .. } => *cols,
            CudaWeights::Q(q) => q.cols,
        }
    }
}

/// Device scratch that only grows.
#[derive(Default)]
struct DevVec {
    mem: Option<DevMem>,
}

impl DevVec {
    fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr)
    }
}

/// Int8 activations on the device ([`Backend::QAct`]): per token and group of 32 the codes, the scale `d`,
/// the code sum, `d·sum` and the two half-group sums (as [`crate::backend::cpu::QuantizedActivations`]).
#[derive(Default)]
pub struct CudaQAct {
    n: usize,
    cols: usize,
    rotation: u64,
    q: DevVec,
    scale: DevVec,
    sum: DevVec,
    dsum: DevVec,
    sum16: DevVec,
    /// The same values in the token-tiled layout `mm_qv*` reads (`QActOut` in kernels.cu), for batches of 2 to
    /// `QV_TILED_MAX` tokens: `tg` positions (tokens padded to a multiple of 8, times groups of 32), 52 bytes
    /// each.
    tiled: DevVec,
    /// Positions of `tiled` (0: no tiled copy).
    tg: usize,
}

/// Most parameters of a kernel (`mm_q3w*` has 29).
const ARGS: usize = 30;

/// Kernel arguments as 8-byte slots (the driver reads each parameter's size from its slot's start).
struct Args {
    v: [u64; ARGS],
    n: usize,
}

impl Args {
    fn new() -> Args {
        Args { v: [0; ARGS], n: 0 }
    }
    fn push(mut self, x: u64) -> Args {
        self.v[self.n] = x;
        self.n += 1;
        self
    }
    /// A device pointer.
    fn p(self, ptr: u64) -> Args {
        self.push(ptr)
    }
    /// An `int`.
    fn i(self, x: usize) -> Args {
        let x = i32::try_from(x).expect("CUDA kernel argument exceeds i32");
        self.push(x as u32 as u64)
    }
    /// A `long long`.
    fn l(self, x: usize) -> Args {
        self.push(x as u64)
    }
    /// A `float`.
    fn f(self, x: f32) -> Args {
        self.push(x.to_bits() as u64)
    }
}

#[derive(Clone, Copy)]
struct Func(sys::CUfunction);
// SAFETY: function handles are immutable and valid in the context on any thread.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

/// Handles of every kernel of the module.
struct Kernels {
    quantize: Func,
    /// `dp4a` kernels: `[1 token (mm_q_t1) / 2 (mm_q_t2) / tiles of 4 (mm_q_t4)][bits 4 packed / bytes]`.
    mm_q: [[Func; 2]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3: [[Func; 2]; 3],
    /// One-token products with 4 blocks of a row and their activations in flight a lane (`mm_q_t1u4_{p4,p8}`,
    /// `mm_q3_t1u4_*`; the default for rows of 3+ blocks a lane): `[p4, p8]`.
    mm_qu: [Func; 2],
    mm_q3u: [Func; 2],
    /// Two-token products with 4 blocks of a row and their activations in flight a lane (`mm_q_t2u4_*`;
    /// [`T2_UNROLL`]): `[p4, p8]`.
    mm_q2u: [Func; 2],
    /// Three- or four-token products with 2 blocks of a row and their activations in flight a lane
    /// (`mm_q_t4u2_*`; [`T4_UNROLL`]): `[p4, p8]`.
    mm_q4u: [Func; 2],
    /// Parts of either code packing in one launch: one token (`mm_q3x_t1`, `mm_q3x_t1u4`), two (`mm_q3x_t2`),
    /// three or four (`mm_q3x_t4`).
    mm_q3x: [Func; 4],
    /// The empty kernel ([`Cuda::set_empty_kernels`]).
    noop: Func,
    /// The phase-boundary probe ([`Cuda::sync_probe`]).
    sync_probe: Func,
    /// Five or more tokens, on the tensor cores (`mm_qw{1,2}_f{form}_{p4,p8}_s{S}`): `[split (MMA_SPLITS)][tile
    /// (mma_tile)][form (qform)][bits 4 packed / bytes]`.
    mm_qw: [[[[Func; 2]; 3]; 2]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3w: [[[[Func; 2]; 3]; 2]; 3],
    /// The verify sizes on the tensor cores, warps with loads of their own (`mm_qv{1,2,4}_f{form}_{p4,p8}_w{S}`):
    /// `[warps per row tile (QV_WARPS)][tile (qv_tile)][form (qform)][bits 4 packed / bytes]`.
    mm_qv: [[[[Func; 2]; 3]; 3]; 3],
    /// Their cluster-split forms (`…_w{S}c`): a row tile's visits split over a thread-block cluster along z,
    /// the block sums added by the cluster's first block ([`Cuda::qv_plan`], `EDDY_CUDA_QV_CLUSTER`).
    mm_qvc: [[[[Func; 2]; 3]; 3]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3v: [[[[Func; 2]; 3]; 3]; 3],
    /// `mm_q3v*`'s cluster-split forms.
    mm_q3vc: [[[[Func; 2]; 3]; 3]; 3],
    /// The resident forms (`mm_qv{1,2,4}_f{form}_{p4,p8}_w8r`, [`Cuda::qv_res_plan`]): `[tile (qv_tile)][form
    /// (qform)][bits 4 packed / bytes]`.
    mm_qvr: [[[Func; 2]; 3]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3vr: [[[Func; 2]; 3]; 3],
    /// Their shared memory (the kernels' table `mm_qvr_smem`, same index): (fixed bytes, bytes a resident
    /// block of 32 columns); a launch takes fixed + 8 · [`qv_res_entries`] · the second.
    mm_qvr_smem: [[[(u32, u32); 2]; 3]; 3],
    /// Dynamic shared memory bytes of `mm_qw` / `mm_q3w` (the kernels' table `mm_qw_smem`, same index).
    mm_qw_smem: [[[[u32; 2]; 3]; 2]; 3],
    /// Dynamic shared memory bytes of `mm_qv` / `mm_q3v` and their cluster-split forms (the kernels' table
    /// `mm_qv_smem`, same index).
    mm_qv_smem: [[[[u32; 2]; 3]; 3]; 3],
    /// Large products on the tensor cores with large tiles (`mm_qt2_f{form}_{p4,p8}`): `[form (qform)][bits 4
    /// packed / bytes]`.
    mm_qt: [[Func; 2]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3t: [[Func; 2]; 3],
    /// Dynamic shared memory bytes of `mm_qt` / `mm_q3t` (the kernels' table `mm_qt_smem`, same index).
    mm_qt_smem: [[u32; 2]; 3],
    /// Products of more than [`INVARIANT_TOKENS`] tokens in block order (`mm_qp2_f{form}_{p4,p8}`): `[form
    /// (qform)][bits 4 packed / bytes]`.
    mm_qp: [[Func; 2]; 3],
    /// The same for up to three matrices in one launch.
    mm_q3p: [[Func; 2]; 3],
    /// Dynamic shared memory bytes of `mm_qp` / `mm_q3p` (the kernels' table `mm_qp_smem`, same index).
    mm_qp_smem: [[u32; 2]; 3],
    /// `[f32 / bf16][tokens per block 1 / 8]`.
    mm_f: [[Func; 2]; 2],
    rotate_out: Func,
    embed: Func,
    rms_norm: Func,
    rms_norm_quant: Func,
    /// The same for rows of at most one and two groups of 32 a warp (`rms_norm_quant_k{1,2}`).
    rms_norm_quant_k: [Func; 2],
    gated_act_quant: Func,
    store_rows: Func,
    gather_rows: Func,
    commit_rows: Func,
    rope_store: Func,
    add: Func,
    add_bias: Func,
    gated_act: Func,
    mul_sigmoid: Func,
    split_gate: Func,
    concat_rows: Func,
    rope: Func,
    /// The (cos, sin) table of a RoPE frequency list (`Cuda::rope_table`).
    rope_table: Func,
    attention: Func,
    /// The decode step's attention (one query, in a cluster; `attention_dec_hd{64,128}`).
    attention_dec: [Func; 2],
    /// The same with the step's RoPE and K/V cache store (`attention_dec_rope_hd{64,128}`).
    attention_dec_rope: [Func; 2],
    /// The decode step's attention split over blocks per KV head (`attention_dkv_hd{64,128}`).
    attention_dkv: [Func; 2],
    /// The same with the step's RoPE and K/V cache store (`attention_dkv_rope_hd{64,128}`).
    attention_dkv_rope: [Func; 2],
    /// The attention with one block per KV head (`attention_kv`; dynamic shared memory `att_kv_smem`).
    attention_kv: Func,
    /// The same in clusters over a (query, KV head)'s chunks, head dims 64 and 128 (`attention_kvc_hd{64,128}`;
    /// dynamic shared memory `att_kvc_smem`).
    attention_kvc: [Func; 2],
    /// The committed chunks of a verify shared by its queries, head dims 64 and 128 (`attention_kvs_hd{64,128}`;
    /// dynamic shared memory `att_kvs_smem`): their records for `attention_kvc`'s combination.
    attention_kvs: [Func; 2],
    /// Causal attention of prefill runs on the tensor cores: `[P·V in one TF32 product (attention_mma_hd*) /
    /// three (attention_mma3_hd*)][hd 64, 128, 256]`.
    attention_mma: [[Func; 3]; 2],
    /// Dynamic shared memory bytes of `attention_mma` (the kernels' table `attention_mma_smem`, same index; 0
    /// where the device's shared memory is too small for the tiles).
    attention_mma_smem: [u32; 3],
    argmax_part: Func,
    argmax_finish: Func,
    cand_lanes: Func,
    cand_select: Func,
    cand_gather: Func,
    cand_finish: Func,
}

/// Device scratch of the operations (grows; host staging vectors reused).
#[derive(Default)]
struct Scratch {
    /// The attention's per-chunk partial results and per-(query, head) completion counters (zeroed).
    att_part: DevVec,
    att_count: DevVec,
    logits: DevVec,
    /// The token ids of [`Backend::argmax_rows`] / [`Backend::matmul_argmax`].
    ids: DevVec,
    /// The argmax blocks' (value, index) per row (`AM_PARTS` f32 values, then as many i32 indices).
    am_part: DevVec,
    /// The candidates kernels' work area, `CAND_WORK` u64 words per row (`kernels.cu`, `cand_lanes`).
    cand_work: DevVec,
    /// The records of [`Backend::candidate_rows`] (`2k + 4` words per row) and their host copy.
    cands: DevVec,
    cands_host: Vec<u32>,
    /// Page-locked landing buffer of the logits (a copy into pageable memory is staged by the driver and
    /// runs at a fraction of the speed).
    pinned: Option<Pinned>,
    /// Host staging of positions and of the attention's key lists.
    pos_host: Vec<i32>,
    info_host: Vec<i32>,
    paths_host: Vec<i32>,
    /// `attention_kv`'s blocks per multiprocessor for the last dynamic shared memory size asked (bytes, blocks).
    att_kv_occupancy: Option<(u32, usize)>,
}

/// Device scratch of the split tensor-core products: per (row tile, token tile) the `S` blocks' subtree sums
/// (`16 × tokens` f32 each) and a completion counter (zeroed; the last block resets it).
#[derive(Default)]
struct MmaSplit {
    part: DevVec,
    count: DevVec,
}

/// Page-locked host memory of `len` f32 values, freed on drop.
struct Pinned {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: plain host memory, used behind the scratch mutex.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`; no copy into it is pending (copies are waited for).
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// Run-ahead argmaxes in flight ([`Backend::matmul_argmax_ahead`]): a page-locked landing slot each and the
/// event recorded after its copy, taken in order from `first`.
struct Ahead {
    ids: *mut u32,
    events: [sys::CUevent; AHEAD_IN_FLIGHT],
    first: usize,
    len: usize,
}
// SAFETY: page-locked host memory and events of our context, used behind the backend's mutex.
unsafe impl Send for Ahead {}

impl Ahead {
    /// Slots and events in the bound context.
    fn new() -> Ahead {
        // SAFETY: a page-locked allocation of AHEAD_IN_FLIGHT ids in the bound context.
        let ids = check(unsafe { result::malloc_host(4 * AHEAD_IN_FLIGHT, 0) }, "page-locked allocation") as *mut u32;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let events = std::array::from_fn(|_| check(result::event::create(flags), "event creation"));
        Ahead { ids, events, first: 0, len: 0 }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        // SAFETY: ours; a copy still in flight is waited for before its slot is freed.
        unsafe {
            for &e in &self.events {
                let _ = result::event::synchronize(e);
                let _ = result::event::destroy(e);
            }
            let _ = result::free_host(self.ids as *mut c_void);
        }
    }
}

/// Whether run-ahead argmaxes stay on the device by default ([`Backend::runs_ahead`], so the engine decodes
/// ahead): measured on an H200 in session 38 (docs/cuda.md, "Run-ahead greedy decoding"): tg128 +10.7 % on the
/// 0.5B, +5.9 % on the 1.5B. `EDDY_CUDA_RUN_AHEAD=0` turns it off.
const RUN_AHEAD: bool = true;

/// `EDDY_CUDA_RUN_AHEAD`: 1 or 0 ([`Backend::runs_ahead`]); unset, [`RUN_AHEAD`].
fn run_ahead_from_env() -> bool {
    env_setting("EDDY_CUDA_RUN_AHEAD", "0 or 1", |r: &u8| *r <= 1).map_or(RUN_AHEAD, |r| r == 1)
}

/// The CUDA backend: one device, one stream, kernels from the embedded fatbin.
///
/// Operations are queued on the host (`Queue`) and sent to the GPU when a result is read back
/// ([`Backend::read`], [`Backend::matmul_to_host`]), when a pass begins ([`Backend::embed`]), on
/// [`Cuda::synchronize`], and before device memory is freed; a list of operations seen before runs as a CUDA
/// graph ([`GraphPlan`]).
pub struct Cuda {
    ctx: Arc<Ctx>,
    k: Kernels,
    /// Each kernel's name by its function handle (for [`Cuda::set_empty_kernels_named`] and
    /// [`Cuda::last_list_kernels`]).
    kernel_names: HashMap<usize, String>,
    scratch: Mutex<Scratch>,
    /// Run-ahead argmaxes in flight (made on first use).
    ahead: Mutex<Option<Ahead>>,
    /// [`Backend::runs_ahead`] ([`RUN_AHEAD`], `EDDY_CUDA_RUN_AHEAD`, [`Cuda::force_run_ahead`]).
    run_ahead: AtomicBool,
    /// The split products' partial sums and per-tile counters (apart from `scratch`, which callers of the
    /// products may hold).
    mma_split: Mutex<MmaSplit>,
    /// Multiprocessors of the GPU.
    sms: usize,
    /// Whether clusters of a kernel fit the GPU at once: (kernel, threads, dynamic shared memory, cluster
    /// blocks) → fits ([`Cuda::fitting_cluster`]).
    cluster_fits: Mutex<HashMap<(usize, u32, u32, usize), bool>>,
    /// The RoPE (cos, sin) tables, one per frequency list in use (`Cuda::rope_table`).
    rope_tables: Mutex<Vec<RopeTable>>,
    /// Launches queued as thread-block clusters ([`Cuda::cluster_launches`]).
    cluster_launches: AtomicU64,
    /// Launches queued on the resident product kernels ([`Cuda::resident_launches`]).
    resident_launches: AtomicU64,
    /// Blocks of `attention` (no dynamic shared memory) that fit on one multiprocessor at once.
    att_occupancy: usize,
    /// Blocks per row tile of every tensor-core product (1, 2, 4), or 0 to choose by the launch's size
    /// ([`Cuda::mma_plan`]); `EDDY_CUDA_SPLIT` at start, [`Cuda::force_product_launch`].
    forced_split: AtomicUsize,
    /// Most blocks over the row tiles of a tensor-core product, or 0 (by the launch's size).
    forced_row_blocks: AtomicUsize,
    /// Attention blocks per (query, heads), or 0 (by the launch's size: [`att_chunk_blocks`]);
    /// `EDDY_CUDA_ATT_BLOCKS` at start (a large value: one block per chunk the cache holds, as before).
    forced_att_blocks: AtomicUsize,
    /// Whether the attention runs one block per KV head (`attention_kv`: 2) or per query head (1), or 0 (by
    /// the launch's size: from `att_kv_min` queries on, where the shapes allow).
    forced_att_kernel: AtomicUsize,
    /// Fewest queries whose attention runs `attention_kv` ([`ATT_KV_MIN_T`]).
    att_kv_min: usize,
    /// Blocks of the thread-block cluster a (query, heads) of `attention` / `attention_kv` runs as (its chunk
    /// records combined after the cluster barrier instead of by the last block through a device counter), or 0
    /// for no clusters; with `att_cluster_all` false only one-query launches (decode steps) without a forced
    /// block count take it. Default [`ATT_DECODE_CLUSTER`] for those; `EDDY_CUDA_ATT_CLUSTER` at start,
    /// [`Cuda::force_attention_clusters`].
    /// Taken only on sm_90 and later.
    att_cluster: AtomicUsize,
    att_cluster_all: AtomicBool,
    /// Whether launches per query head in clusters (one-query launches by default; with
    /// `EDDY_CUDA_ATT_CLUSTER`, every launch of fewer than `att_kv_min` queries) of head dims 64 and 128 run
    /// `attention_dec` (default; the same bits as `attention`): `EDDY_CUDA_ATT_DEC=0` at start,
    /// [`Cuda::force_decode_attention`].
    att_dec: AtomicBool,
    /// `attention_dec` and `attention_dkv` launches chosen since [`Cuda::new`] (counted when queued; tests: that
    /// it ran).
    att_dec_launches: AtomicU64,
    /// Where one-query launches that would run `attention_dec` (and no forced clusters or block counts) run
    /// `attention_dkv` instead: 0 nowhere, 1 from [`ATT_DKV_MIN_CHUNKS`] key chunks, 2 always ([`ATT_DKV`];
    /// `EDDY_CUDA_ATT_DKV` at start, [`Cuda::force_split_decode_attention`]).
    att_dkv: AtomicU8,
    /// `attention_dkv`'s blocks a multiprocessor ([`ATT_DKV_PER_SM`]; `EDDY_CUDA_ATT_DKV_SM` at start,
    /// [`Cuda::force_split_decode_blocks`]).
    att_dkv_per_sm: AtomicUsize,
    /// `attention_dkv` launches queued since [`Cuda::new`] (tests: that it ran).
    att_dkv_launches: AtomicU64,
    /// Blocks of the cluster a launch per KV head (`att_kv_min` queries on: verifies) of head dims 64 and 128
    /// runs as on `attention_kvc` without forced clusters or block counts, or 0: `attention_kv` as before
    /// ([`ATT_KVC_CLUSTER`]; `EDDY_CUDA_ATT_KVC` at start, [`Cuda::force_kv_cluster_attention`]). With forced
    /// clusters (`att_cluster_all`) those launches take `attention_kvc` unless this is 0.
    att_kvc: AtomicUsize,
    /// `attention_kvc` launches queued since [`Cuda::new`] (tests: that it ran).
    att_kvc_launches: AtomicU64,
    /// Where verifies (and blocks of queries seeing the same rows) compute their committed chunks once for all
    /// their queries (`attention_kvs`) before `attention_kvc` takes the tail: 0 nowhere; 1 where it pays
    /// ([`ATT_KVS_MIN_QUERIES`], [`ATT_KVS_MIN_COMMITTED`], [`ATT_KVS_MIN_PAIRS`]); 2 wherever it can run (tests).
    /// [`ATT_KVS`] and `EDDY_CUDA_ATT_KVS` at start choose 0 or 1; [`Cuda::force_shared_chunk_attention`] any.
    att_kvs: AtomicU8,
    /// Whether the device grants `attention_kvs` its shared memory, head dims 64 and 128.
    kvs_fits: [bool; 2],
    /// `attention_kvs` launches queued since [`Cuda::new`] (tests: that it ran).
    att_kvs_launches: AtomicU64,
    /// The query rows an `attention_kvs` warp takes at most ([`ATT_KVS_RPW`]; `EDDY_CUDA_ATT_KVS_ROWS`, or
    /// [`Cuda::force_shared_chunk_rows`]).
    att_kvs_rows: AtomicUsize,
    /// Whether `rms_norm_quantize` of rows of at most one or two groups of 32 a warp runs the kernel of that
    /// many (`rms_norm_quant_k{1,2}`) or the 8-group one ([`NORM_FIT`]; `EDDY_CUDA_NORM_FIT` at start,
    /// [`Cuda::force_fitted_norm`]).
    norm_fit: AtomicBool,
    /// `rms_norm_quant_k{1,2}` launches queued since [`Cuda::new`] (tests: that they ran).
    norm_fit_launches: AtomicU64,
    /// Whether a decode step's RoPE and K/V store run inside its attention where `attention_dec` runs it
    /// (default; the same bits as `rope_store`): `EDDY_CUDA_ROPE_ATT=0` at start, [`Cuda::force_fused_rope`].
    rope_att: AtomicBool,
    /// `attention_dec_rope` launches queued since [`Cuda::new`] (tests: that it ran).
    rope_att_launches: AtomicU64,
    /// Whether large tensor-core products run on a grid of at most the blocks that fit at once, each walking
    /// several row tiles with the next one's loads in flight (`EDDY_CUDA_PERSIST=0`: one row tile per block).
    persist: bool,
    /// Most tokens of a quantized product on the `dp4a` kernels: `DP4A_MAX`, or `EDDY_CUDA_DP4A_MAX` (1 to 8;
    /// to measure the crossover), or [`Cuda::force_dp4a_tokens`].
    dp4a_max: AtomicUsize,
    /// Whether `matmul_parts` runs two of three parts in one launch where all three cannot share one
    /// (`EDDY_CUDA_PAIR=0` at start, [`Cuda::force_pair_parts`]: each part alone then).
    pair_parts: AtomicBool,
    /// Whether products of 5+ tokens run on `mm_qt*`: 0 by the launch's size (from `qt_min` tokens), 1 never,
    /// 2 always where the width allows (`EDDY_CUDA_QT` at start, [`Cuda::force_tiled_products`]).
    forced_tiled: AtomicUsize,
    /// Fewest tokens on `mm_qt*` (`QT_MIN`, or `EDDY_CUDA_QT_MIN`).
    qt_min: usize,
    /// Whether products of more than [`INVARIANT_TOKENS`] tokens run on `mm_qp*` (else on the kernels in
    /// `mm_q_t1`'s order, to measure against them): `EDDY_CUDA_QP=0` at start, [`Cuda::force_prefill_products`].
    prefill_qp: AtomicBool,
    /// How causal attention of more than [`INVARIANT_TOKENS`] queries runs: 0 on the kernels every other
    /// launch takes (`attention_kv`, or `attention` where its shapes do not fit; to measure against them),
    /// else on `attention_mma` with P·V in that many TF32 products (1 or 3); `EDDY_CUDA_FA=0|1|3` at start
    /// (unset: [`FA_PV_PRODUCTS`]; another value is ignored with a warning), [`Cuda::force_prefill_attention`].
    prefill_fa: AtomicUsize,
    /// Whether products of 5+ tokens below the large-tile kernels run on `mm_qv*`: 0 by the launch's size
    /// (up to `QV_MAX` tokens, warps per tile by [`Cuda::qv_plan`]), [`QV_OFF`] never (`mm_qw*`), else always with that
    /// many warps per row tile (4, 8, 16); `EDDY_CUDA_QV` at start, [`Cuda::force_verify_products`].
    forced_qv: AtomicUsize,
    /// Blocks of the cluster an `mm_qv*` row tile is split over, or 0 for none ([`Cuda::qv_plan`],
    /// `EDDY_CUDA_QV_CLUSTER`, [`Cuda::force_verify_clusters`]); whether every launch splits (else only launches
    /// of fewer tiles than multiprocessors).
    qv_cluster: AtomicUsize,
    qv_cluster_always: AtomicBool,
    /// Whether launches of more `mm_qv*` row tiles than fit at once run on the resident kernels ([`QV_RES`],
    /// `EDDY_CUDA_QV_RES`, [`Cuda::force_resident_products`]).
    qv_res: AtomicUsize,
    /// The most dynamic shared memory a resident product kernel may ask for (bytes).
    qvr_smem_max: u32,
    /// Blocks of a resident product kernel that fit on one multiprocessor: (kernel, dynamic shared memory) →
    /// blocks ([`Cuda::qv_res_plan`]).
    qvr_occupancy: Mutex<HashMap<(usize, u32), usize>>,
    /// Blocks of a row a one-token product loads at once: 4 (the default: `mm_q_t1u4*`, rows of 3+ blocks a
    /// lane), else `mm_q_t1`'s two, or [`DEEP_ALWAYS`] (`EDDY_CUDA_T1_UNROLL`, [`Cuda::force_decode_unroll`]).
    t1_unroll: AtomicUsize,
    /// Blocks of a row a two-token product loads at once: 0 (`mm_q_t2`), 4 for rows of 3+ blocks a lane, or
    /// [`DEEP_ALWAYS`] (4 at every width) ([`T2_UNROLL`], `EDDY_CUDA_T2_UNROLL`, [`Cuda::force_two_token_unroll`]).
    t2_unroll: AtomicUsize,
    /// Whether two-token parts of different code packings share a `matmul_parts` launch ([`MIXED_T2`],
    /// `EDDY_CUDA_MIXED_T2`, [`Cuda::force_mixed_two_tokens`]).
    mixed_t2: AtomicBool,
    /// Blocks of a row a three- or four-token `dp4a` product loads at once: 0 (`mm_q_t4`), 2 for rows of 3+
    /// blocks a lane, or [`DEEP_ALWAYS`] (2 at every width) ([`T4_UNROLL`], `EDDY_CUDA_T4_UNROLL`,
    /// [`Cuda::force_four_token_unroll`]).
    t4_unroll: AtomicUsize,
    /// Whether three- and four-token parts of different code packings share a `dp4a` launch ([`MIXED_T4`],
    /// `EDDY_CUDA_MIXED_T4`, [`Cuda::force_mixed_four_tokens`]).
    mixed_t4: AtomicBool,
    /// Whether `matmul_parts` runs parts of different forms in one launch where the kernels allow it
    /// ([`one_launch`]; [`JOINT_PARTS`] unless `EDDY_CUDA_JOINT` says otherwise, [`Cuda::force_joint_parts`]).
    joint: AtomicBool,
    name: String,
    capability: (i32, i32),
    /// The GPU's PCI address (`domain:bus:device.function`), when the driver gives it.
    pci_bus_id: Option<String>,
    /// Kernel launches and copies queued so far ([`Cuda::launches`]).
    queued: AtomicU64,
}

/// Launch error or fault, as a panic with the driver's words (device failures are not input errors).
fn check<T>(r: std::result::Result<T, result::DriverError>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("CUDA: {what} failed: {e:?}"))
}

impl Cuda {
    /// The first GPU ([`Cuda::with_device`] 0).
    ///
    /// Errors: "no CUDA driver/GPU: …" when the driver library is missing or older than CUDA 13.0, no GPU is
    /// present, or the GPU is older than compute capability 8.0 (the fatbin's oldest target).
    pub fn new() -> Result<Cuda> {
        Cuda::with_device(0)
    }

    /// GPU `ordinal`; errors as [`Cuda::new`].
    pub fn with_device(ordinal: usize) -> Result<Cuda> {
        let no = |what: String| Error::Input(format!("no CUDA driver/GPU: {what}"));
        // cudarc panics when libcuda is missing or lacks an entry point of the bindings' CUDA version.
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        // SAFETY: only loads the library.
        let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        std::panic::set_hook(prev);
        if !present {
            return Err(no("the NVIDIA driver library (libcuda.so.1) is missing or older than CUDA 13.0 (driver 580)".into()));
        }
        result::init().map_err(|e| no(format!("cuInit: {e:?}")))?;
        let count = result::device::get_count().map_err(|e| no(format!("cuDeviceGetCount: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(no(format!("GPU {ordinal} requested, {count} present")));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| no(format!("cuDeviceGet: {e:?}")))?;
        let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
        // SAFETY: `dev` comes from cuDeviceGet.
        let attr = |a| unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0);
        let capability = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        if capability.0 < 8 {
            return Err(no(format!("{name} has compute capability {}.{}; eddy's kernels need 8.0 or later", capability.0, capability.1)));
        }
        // SAFETY: the primary context of a valid device; retained for the life of the process.
        let raw = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| no(format!("cuDevicePrimaryCtxRetain: {e:?}")))?;
        // SAFETY: the context just retained.
        unsafe { result::ctx::set_current(raw) }.map_err(|e| no(format!("cuCtxSetCurrent: {e:?}")))?;
        BOUND.with(|b| b.set(raw as usize));
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| no(format!("cuStreamCreate: {e:?}")))?;
        let ctx = Arc::new(Ctx { raw, stream, queue: Mutex::new(Queue::new()) });
        // The image must be 8-byte aligned: copy it into u64s.
        let mut image = vec![0u64; FATBIN.len().div_ceil(8)];
        // SAFETY: `image` holds at least FATBIN.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(FATBIN.as_ptr(), image.as_mut_ptr() as *mut u8, FATBIN.len()) };
        // SAFETY: a fatbin produced by nvcc; the context is bound.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| no(format!("loading eddy's kernels on {name} (compute {}.{}): {e:?}", capability.0, capability.1)))?;
        let names = std::cell::RefCell::new(HashMap::new());
        let get = |n: &str| -> Result<Func> {
            // SAFETY: the module stays loaded for the life of the process.
            let f = unsafe { result::module::get_function(module, CString::new(n).expect("kernel name")) }
                .map(Func)
                .map_err(|e| no(format!("kernel {n} missing from the fatbin: {e:?}")))?;
            names.borrow_mut().insert(f.0 as usize, n.to_string());
            Ok(f)
        };
        let tile = |base: &str, nj: usize, sp: &str| -> Result<[[Func; 2]; 3]> {
            let f = |form: usize, p: &str| get(&format!("{base}{nj}_f{form}_{p}_{sp}"));
            Ok([[f(0, "p4")?, f(0, "p8")?], [f(1, "p4")?, f(1, "p8")?], [f(2, "p4")?, f(2, "p8")?]])
        };
        let qw = |base: &str| -> Result<[[[[Func; 2]; 3]; 2]; 3]> {
            let sp = |s: &str| -> Result<[[[Func; 2]; 3]; 2]> { Ok([tile(base, 1, s)?, tile(base, 2, s)?]) };
            Ok([sp("s1")?, sp("s2")?, sp("s4")?])
        };
        let qv = |base: &str, c: &str| -> Result<[[[[Func; 2]; 3]; 3]; 3]> {
            let sp = |s: &str| -> Result<[[[Func; 2]; 3]; 3]> { Ok([tile(base, 1, s)?, tile(base, 2, s)?, tile(base, 4, s)?]) };
            Ok([sp(&format!("w4{c}"))?, sp(&format!("w8{c}"))?, sp(&format!("w16{c}"))?])
        };
        // The products' shared-memory tables (i32 bytes per variant, beyond the 48 KB a launch gets unasked).
        let table = |name: &str, len: usize| -> Result<Vec<i32>> {
            // SAFETY: a global of the loaded module; the copy reads its `size` bytes into a buffer of that size.
            let (ptr, size) = unsafe { result::module::get_global(module, CString::new(name).expect("name")) }
                .map_err(|e| no(format!("{name} missing from the fatbin: {e:?}")))?;
            let mut t = vec![0i32; len];
            if size != 4 * len {
                return Err(no(format!("{name} holds {size} bytes, {} expected", 4 * len)));
            }
            // SAFETY: `t` holds `size` bytes; the context is bound.
            unsafe { result::memcpy_dtoh_sync(&mut t, ptr) }.map_err(|e| no(format!("reading {name}: {e:?}")))?;
            Ok(t)
        };
        let mut smem = [[[[0u32; 2]; 3]; 2]; 3];
        for (i, &b) in table("mm_qw_smem", 36)?.iter().enumerate() {
            smem[i / 12][i / 6 % 2][i / 2 % 3][i % 2] = b as u32;
        }
        let mut qv_smem = [[[[0u32; 2]; 3]; 3]; 3];
        for (i, &b) in table("mm_qv_smem", 54)?.iter().enumerate() {
            qv_smem[i / 18][i / 6 % 3][i / 2 % 3][i % 2] = b as u32;
        }
        let mut qvr_smem = [[[(0u32, 0u32); 2]; 3]; 3];
        let t = table("mm_qvr_smem", 36)?;
        for (i, b) in t.chunks(2).enumerate() {
            qvr_smem[i / 6][i / 2 % 3][i % 2] = (b[0] as u32, b[1] as u32);
        }
        let mut qt_smem = [[0u32; 2]; 3];
        for (i, &b) in table("mm_qt_smem", 6)?.iter().enumerate() {
            qt_smem[i / 2][i % 2] = b as u32;
        }
        // `attention_mma` for head dims whose tiles fit the device's shared memory (hd 256 needs sm_90's 227 KB):
        // 0 marks a kernel the device cannot run (`attention_into` then takes the other kernels).
        let optin = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).max(0) as u32;
        let mut fa_smem = [0u32; 3];
        for (i, &b) in table("attention_mma_smem", 3)?.iter().enumerate() {
            fa_smem[i] = if b as u32 <= optin { b as u32 } else { 0 };
        }
        let mut qp_smem = [[0u32; 2]; 3];
        for (i, &b) in table("mm_qp_smem", 6)?.iter().enumerate() {
            qp_smem[i / 2][i % 2] = b as u32;
        }
        let qt = |base: &str| -> Result<[[Func; 2]; 3]> {
            let f = |form: usize, p: &str| get(&format!("{base}2_f{form}_{p}"));
            Ok([[f(0, "p4")?, f(0, "p8")?], [f(1, "p4")?, f(1, "p8")?], [f(2, "p4")?, f(2, "p8")?]])
        };
        let sms = (attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).max(1)) as usize;
        let k = Kernels {
            quantize: get("quantize_q8")?,
            mm_q: [
                [get("mm_q_t1_p4")?, get("mm_q_t1_p8")?],
                [get("mm_q_t2_p4")?, get("mm_q_t2_p8")?],
                [get("mm_q_t4_p4")?, get("mm_q_t4_p8")?],
            ],
            mm_qu: [get("mm_q_t1u4_p4")?, get("mm_q_t1u4_p8")?],
            mm_q3u: [get("mm_q3_t1u4_p4")?, get("mm_q3_t1u4_p8")?],
            mm_q2u: [get("mm_q_t2u4_p4")?, get("mm_q_t2u4_p8")?],
            mm_q4u: [get("mm_q_t4u2_p4")?, get("mm_q_t4u2_p8")?],
            mm_q3x: [get("mm_q3x_t1")?, get("mm_q3x_t1u4")?, get("mm_q3x_t2")?, get("mm_q3x_t4")?],
            mm_q3: [
                [get("mm_q3_t1_p4")?, get("mm_q3_t1_p8")?],
                [get("mm_q3_t2_p4")?, get("mm_q3_t2_p8")?],
                [get("mm_q3_t4_p4")?, get("mm_q3_t4_p8")?],
            ],
            noop: get("noop")?,
            sync_probe: get("sync_probe")?,
            mm_qw: qw("mm_qw")?,
            mm_q3w: qw("mm_q3w")?,
            mm_qv: qv("mm_qv", "")?,
            mm_q3v: qv("mm_q3v", "")?,
            mm_qvc: qv("mm_qv", "c")?,
            mm_q3vc: qv("mm_q3v", "c")?,
            mm_qvr: [tile("mm_qv", 1, "w8r")?, tile("mm_qv", 2, "w8r")?, tile("mm_qv", 4, "w8r")?],
            mm_q3vr: [tile("mm_q3v", 1, "w8r")?, tile("mm_q3v", 2, "w8r")?, tile("mm_q3v", 4, "w8r")?],
            mm_qvr_smem: qvr_smem,
            mm_qw_smem: smem,
            mm_qv_smem: qv_smem,
            mm_qt: qt("mm_qt")?,
            mm_q3t: qt("mm_q3t")?,
            mm_qt_smem: qt_smem,
            mm_qp: qt("mm_qp")?,
            mm_q3p: qt("mm_q3p")?,
            mm_qp_smem: qp_smem,
            mm_f: [[get("mm_f32_t1")?, get("mm_f32_t8")?], [get("mm_bf16_t1")?, get("mm_bf16_t8")?]],
            rotate_out: get("rotate_out")?,
            embed: get("embed")?,
            rms_norm: get("rms_norm")?,
            rms_norm_quant: get("rms_norm_quant")?,
            rms_norm_quant_k: [get("rms_norm_quant_k1")?, get("rms_norm_quant_k2")?],
            gated_act_quant: get("gated_act_quant")?,
            store_rows: get("store_rows")?,
            gather_rows: get("gather_rows")?,
            commit_rows: get("commit_rows")?,
            rope_store: get("rope_store")?,
            rope_table: get("rope_table")?,
            add: get("add")?,
            add_bias: get("add_bias")?,
            gated_act: get("gated_act")?,
            mul_sigmoid: get("mul_sigmoid")?,
            split_gate: get("split_gate")?,
            concat_rows: get("concat_rows")?,
            rope: get("rope")?,
            attention: get("attention")?,
            attention_kv: get("attention_kv")?,
            attention_kvc: [get("attention_kvc_hd64")?, get("attention_kvc_hd128")?],
            attention_kvs: [get("attention_kvs_hd64")?, get("attention_kvs_hd128")?],
            attention_dec: [get("attention_dec_hd64")?, get("attention_dec_hd128")?],
            attention_dec_rope: [get("attention_dec_rope_hd64")?, get("attention_dec_rope_hd128")?],
            attention_dkv: [get("attention_dkv_hd64")?, get("attention_dkv_hd128")?],
            attention_dkv_rope: [get("attention_dkv_rope_hd64")?, get("attention_dkv_rope_hd128")?],
            attention_mma: [
                [get("attention_mma_hd64")?, get("attention_mma_hd128")?, get("attention_mma_hd256")?],
                [get("attention_mma3_hd64")?, get("attention_mma3_hd128")?, get("attention_mma3_hd256")?],
            ],
            attention_mma_smem: fa_smem,
            argmax_part: get("argmax_part")?,
            argmax_finish: get("argmax_finish")?,
            cand_lanes: get("cand_lanes")?,
            cand_select: get("cand_select")?,
            cand_gather: get("cand_gather")?,
            cand_finish: get("cand_finish")?,
        };
        let kernel_names = names.into_inner();
        let mut bus = [0 as std::ffi::c_char; 32];
        // SAFETY: `bus` holds 32 bytes, the length passed; the driver writes a NUL-terminated string.
        let pci_bus_id = (unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) } == sys::CUresult::CUDA_SUCCESS)
            // SAFETY: NUL-terminated by the driver (the last byte is never written past the length).
            .then(|| unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned());
        let qw_all = [&k.mm_qw, &k.mm_q3w].into_iter().flat_map(|t| t.iter().flatten().flatten().zip(smem.iter().flatten().flatten()));
        let qv_all = [&k.mm_qv, &k.mm_qvc, &k.mm_q3v, &k.mm_q3vc]
            .into_iter()
            .flat_map(|t| t.iter().flatten().flatten().zip(qv_smem.iter().flatten().flatten()));
        let qt_all = [&k.mm_qt, &k.mm_q3t].into_iter().flat_map(|t| t.iter().zip(qt_smem.iter()));
        let qp_all = [&k.mm_qp, &k.mm_q3p].into_iter().flat_map(|t| t.iter().zip(qp_smem.iter()));
        let pairs = qw_all.chain(qv_all).chain(qt_all).chain(qp_all).flat_map(|(fs, bs)| fs.iter().zip(bs.iter()));
        let fa_all = k.attention_mma.iter().flat_map(|fs| fs.iter().zip(fa_smem.iter())).filter(|(_, &b)| b > 0);
        for (f, &b) in pairs.chain(fa_all) {
            // SAFETY: a kernel of the loaded module; its table entry is at most the device's limit (checked by
            // the attribute call).
            unsafe {
                result::function::set_function_attribute(
                    f.0,
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    b as i32,
                )
            }
            .map_err(|e| no(format!("shared memory of {b} bytes for a kernel: {e:?}")))?;
        }
        // SAFETY: a kernel of the loaded module; the size is under every supported GPU's per-block limit (99 KB).
        unsafe {
            result::function::set_function_attribute(
                k.attention_kv.0,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                att_kv_smem(ATT_KV_MAX_GROUP, ATT_KV_MAX_HD) as i32,
            )
        }
        .map_err(|e| no(format!("shared memory for the attention kernel: {e:?}")))?;
        // Kernels whose dynamic shared memory grows with the launch (the resident products with the columns,
        // [`Cuda::qv_res_plan`]; `attention_kvc` with the cluster) may take what the device grants a block beside
        // their static part (the driver refuses a sum above the limit): `grant_all` returns those bytes.
        let grant_all = |f: Func, what: &str| -> Result<u32> {
            // SAFETY: a kernel of the loaded module; attributes every device defines.
            let fixed = unsafe {
                result::function::get_function_attribute(f.0, sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            }
            .map_err(|e| no(format!("shared memory of {what}: {e:?}")))?;
            let dynamic = optin.saturating_sub(fixed.max(0) as u32);
            // SAFETY: as above; `dynamic` plus the static part is the device's own limit.
            unsafe {
                result::function::set_function_attribute(
                    f.0,
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic as i32,
                )
            }
            .map_err(|e| no(format!("shared memory for {what}: {e:?}")))?;
            Ok(dynamic)
        };
        // `qvr_smem_max`: the least any resident product kernel may ask for.
        let mut qvr_smem_max = optin;
        for &f in k.mm_qvr.iter().chain(k.mm_q3vr.iter()).flatten().flatten() {
            qvr_smem_max = qvr_smem_max.min(grant_all(f, "a resident product kernel")?);
        }
        // A launch of `attention_kvc` asking for more than it was granted is never made (`fitting_cluster` finds
        // no cluster for it, and the launch falls back to `attention_kv`).
        for f in k.attention_kvc {
            grant_all(f, "the attention kernel")?;
        }
        // `attention_kvs` runs where the device grants its shared memory (sm_90's 227 KB a block; not sm_86's 99).
        let mut kvs_fits = [false; 2];
        for ((f, hd), fits) in k.attention_kvs.into_iter().zip([64, 128]).zip(&mut kvs_fits) {
            *fits = grant_all(f, "the shared-chunk attention kernel")? as usize >= att_kvs_smem(hd);
        }
        // The empty kernel stands in for any kernel with that kernel's dynamic shared memory
        // (`Cuda::set_empty_kernels`): it may ask for as much as the device grants one block.
        // SAFETY: a kernel of the loaded module; `optin` is the device's own limit.
        unsafe {
            result::function::set_function_attribute(
                k.noop.0,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                optin as i32,
            )
        }
        .map_err(|e| no(format!("shared memory for the empty kernel: {e:?}")))?;
        // Attention clusters of up to 16 blocks (sm_90's non-portable size; `att_cluster`), and the empty kernel
        // that may stand in for them (`Cuda::set_empty_kernels`).
        if capability.0 >= 9 {
            let dec = k.attention_dec.iter().chain(&k.attention_dec_rope).chain(&k.attention_kvc).map(|f| f.0);
            for f in [k.attention.0, k.attention_kv.0, k.noop.0].into_iter().chain(dec) {
                // SAFETY: a kernel of the loaded module; an attribute sm_90 defines.
                unsafe {
                    result::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                        1,
                    )
                }
                .map_err(|e| no(format!("clusters of 16 blocks for the attention: {e:?}")))?;
            }
        }
        // Programmatic dependent launch needs sm_90 (`griddepcontrol`); EDDY_CUDA_PDL=0 turns it off.
        let att_occupancy = occupancy(k.attention, ATT_THREADS, 0)?;
        ctx.queue().pdl = capability.0 >= 9 && std::env::var("EDDY_CUDA_PDL").map_or(true, |v| v != "0");
        let split = env_setting("EDDY_CUDA_SPLIT", "1, 2 or 4", |s: &usize| MMA_SPLITS.contains(s)).unwrap_or(0);
        let persist = std::env::var("EDDY_CUDA_PERSIST").map_or(true, |v| v != "0");
        let att_cluster = att_cluster_from_env();
        Ok(Cuda {
            kernel_names,
            ctx,
            k,
            scratch: Mutex::new(Scratch::default()),
            ahead: Mutex::new(None),
            run_ahead: AtomicBool::new(run_ahead_from_env()),
            mma_split: Mutex::new(MmaSplit::default()),
            sms,
            cluster_fits: Mutex::new(HashMap::new()),
            rope_tables: Mutex::new(Vec::new()),
            cluster_launches: AtomicU64::new(0),
            resident_launches: AtomicU64::new(0),
            att_occupancy,
            forced_split: AtomicUsize::new(split),
            forced_row_blocks: AtomicUsize::new(0),
            forced_att_blocks: AtomicUsize::new(
                env_setting("EDDY_CUDA_ATT_BLOCKS", "a block count from 1", |&b: &usize| b > 0).unwrap_or(0),
            ),
            forced_att_kernel: AtomicUsize::new(0),
            att_cluster: AtomicUsize::new(att_cluster.0),
            att_cluster_all: AtomicBool::new(att_cluster.1),
            att_dec: AtomicBool::new(att_dec_from_env()),
            att_dec_launches: AtomicU64::new(0),
            att_dkv: AtomicU8::new(att_dkv_from_env()),
            att_dkv_per_sm: AtomicUsize::new(att_dkv_per_sm_from_env()),
            att_dkv_launches: AtomicU64::new(0),
            att_kvc: AtomicUsize::new(att_kvc_from_env()),
            att_kvc_launches: AtomicU64::new(0),
            att_kvs: AtomicU8::new(att_kvs_from_env().into()),
            kvs_fits,
            att_kvs_launches: AtomicU64::new(0),
            att_kvs_rows: AtomicUsize::new(att_kvs_rows_from_env()),
            norm_fit: AtomicBool::new(norm_fit_from_env()),
            norm_fit_launches: AtomicU64::new(0),
            rope_att: AtomicBool::new(rope_att_from_env()),
            rope_att_launches: AtomicU64::new(0),
            att_kv_min: env_setting("EDDY_CUDA_ATT_KV_MIN", "a query count (0: never)", |_: &usize| true).map_or(ATT_KV_MIN_T, |m| {
                if m == 0 {
                    usize::MAX
                } else {
                    m
                }
            }),
            persist,
            dp4a_max: AtomicUsize::new(dp4a_max_from_env()),
            pair_parts: AtomicBool::new(pair_from_env()),
            forced_tiled: AtomicUsize::new(tiled_from_env()),
            qt_min: env_setting("EDDY_CUDA_QT_MIN", "a token count", |_: &usize| true).unwrap_or(QT_MIN),
            prefill_qp: AtomicBool::new(std::env::var("EDDY_CUDA_QP").map_or(true, |v| v != "0")),
            prefill_fa: AtomicUsize::new(
                env_setting("EDDY_CUDA_FA", "0, 1 or 3", |f: &usize| [0, 1, 3].contains(f)).unwrap_or(FA_PV_PRODUCTS),
            ),
            qv_cluster: AtomicUsize::new(qv_cluster_from_env()),
            qv_cluster_always: AtomicBool::new(false),
            qv_res: AtomicUsize::new(qv_res_from_env()),
            qvr_smem_max,
            qvr_occupancy: Mutex::new(HashMap::new()),
            t1_unroll: AtomicUsize::new(t1_unroll_from_env()),
            t2_unroll: AtomicUsize::new(t2_unroll_from_env()),
            mixed_t2: AtomicBool::new(mixed_t2_from_env()),
            t4_unroll: AtomicUsize::new(t4_unroll_from_env()),
            mixed_t4: AtomicBool::new(mixed_t4_from_env()),
            joint: AtomicBool::new(joint_from_env()),
            forced_qv: AtomicUsize::new(match env_setting("EDDY_CUDA_QV", "0, 4, 8 or 16", |w: &usize| *w == 0 || QV_WARPS.contains(w)) {
                Some(0) => QV_OFF,
                Some(w) => w,
                None => 0,
            }),
            name,
            capability,
            pci_bus_id,
            queued: AtomicU64::new(0),
        })
    }

    /// The GPU's name and compute capability, e.g. "NVIDIA H200 (compute 9.0)".
    pub fn device_name(&self) -> String {
        format!("{} (compute {}.{})", self.name, self.capability.0, self.capability.1)
    }

    /// The GPU's PCI address (`domain:bus:device.function`, as NVML names devices), if the driver gives it.
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.pci_bus_id.as_deref()
    }

    /// Launches queued as thread-block clusters since [`Cuda::new`] (tests: that a cluster kernel ran).
    pub fn cluster_launches(&self) -> u64 {
        self.cluster_launches.load(Ordering::Relaxed)
    }

    /// Launches queued on the resident product kernels (`mm_qv*_w8r`, [`Cuda::force_resident_products`]) since
    /// [`Cuda::new`] (tests: that they ran).
    pub fn resident_launches(&self) -> u64 {
        self.resident_launches.load(Ordering::Relaxed)
    }

    /// Launches of the decode attention (`attention_dec`) queued since [`Cuda::new`] (tests: that it ran).
    pub fn decode_attention_launches(&self) -> u64 {
        self.att_dec_launches.load(Ordering::Relaxed)
    }

    /// Run `rms_norm_quantize` of rows of at most one or two groups of 32 a warp on the kernel of that many
    /// (`Some(true)`) or on the 8-group one (`Some(false)`); `None`: as `EDDY_CUDA_NORM_FIT` said at start
    /// (unset: [`NORM_FIT`]). The results do not depend on it; for tests and measurements.
    pub fn force_fitted_norm(&self, on: Option<bool>) {
        self.norm_fit.store(on.unwrap_or_else(norm_fit_from_env), Ordering::Relaxed);
    }

    /// Launches of `rms_norm_quant_k{1,2}` queued since [`Cuda::new`] (tests: that they ran).
    pub fn fitted_norm_launches(&self) -> u64 {
        self.norm_fit_launches.load(Ordering::Relaxed)
    }

    /// Launches of the attention per KV head in clusters (`attention_kvc`) queued since [`Cuda::new`] (tests:
    /// that it ran).
    pub fn kv_cluster_attention_launches(&self) -> u64 {
        self.att_kvc_launches.load(Ordering::Relaxed)
    }

    /// Run attention launches per KV head of head dims 64 and 128 (verifies) on `attention_kvc` in clusters of
    /// `blocks` (2 to 16; under forced clusters, [`Cuda::force_attention_clusters`], their size), or with
    /// `Some(0)` / `Some(1)` on `attention_kv` as before; `None`: as `EDDY_CUDA_ATT_KVC` said at start (unset:
    /// [`ATT_KVC_CLUSTER`]). The results do not depend on it (the same operations in the same
    /// order); ignored below compute capability 9.0; for tests and measurements.
    ///
    /// # Panics
    /// On a size above 16.
    pub fn force_kv_cluster_attention(&self, blocks: Option<usize>) {
        let c = match blocks {
            Some(c) => {
                assert!(c <= ATT_MAX_CLUSTER, "attention clusters of at most {ATT_MAX_CLUSTER} blocks");
                if c >= 2 {
                    c
                } else {
                    0
                }
            }
            None => att_kvc_from_env(),
        };
        self.att_kvc.store(c, Ordering::Relaxed);
    }

    /// Launches of the shared committed chunks' attention (`attention_kvs`) queued since [`Cuda::new`] (tests:
    /// that it ran).
    pub fn shared_chunk_attention_launches(&self) -> u64 {
        self.att_kvs_launches.load(Ordering::Relaxed)
    }

    /// Compute the committed chunks of a verify (tree visibility, a block of queries that see the same rows, or
    /// causal queries; no sliding window; head dims 64 and 128 on sm_90) once for all its queries (`attention_kvs`, then
    /// `attention_kvc` over the rest) wherever it can run, from 2 queries and one whole committed chunk on,
    /// `Some(true)`, or per query (`Some(false)`, as before); `None`: as `EDDY_CUDA_ATT_KVS` said at start
    /// (unset: [`ATT_KVS`]), where it pays ([`ATT_KVS_MIN_QUERIES`], [`ATT_KVS_MIN_PAIRS`],
    /// [`ATT_KVS_MIN_COMMITTED`]). The results do not depend on it (the same operations in the same order); for
    /// tests and measurements.
    pub fn force_shared_chunk_attention(&self, on: Option<bool>) {
        let mode = match on {
            Some(on) => 2 * u8::from(on),
            None => att_kvs_from_env().into(),
        };
        self.att_kvs.store(mode, Ordering::Relaxed);
    }

    /// At most `rows` query rows (1 to 6) an `attention_kvs` warp; `None`: as `EDDY_CUDA_ATT_KVS_ROWS` said at
    /// start (unset: [`ATT_KVS_RPW`]). Fewer rows a warp means more blocks, each staging its chunk again. The
    /// results do not depend on it (every row's operations are the same); for tests and measurements.
    ///
    /// # Panics
    /// If `rows` is outside 1 to 6.
    pub fn force_shared_chunk_rows(&self, rows: Option<usize>) {
        let r = rows.unwrap_or_else(att_kvs_rows_from_env);
        assert!((1..=ATT_KVS_RPW).contains(&r), "attention_kvs: {r} rows a warp (1 to {ATT_KVS_RPW})");
        self.att_kvs_rows.store(r, Ordering::Relaxed);
    }

    /// Run attention launches per query head in clusters (head dims 64 and 128) on `attention_dec`
    /// (`Some(true)`) or on `attention` (`Some(false)`); `None`: as `EDDY_CUDA_ATT_DEC` said at start (unset: `attention_dec`).
    /// The results do not depend on it (the same operations in the same order); for tests and measurements.
    pub fn force_decode_attention(&self, on: Option<bool>) {
        self.att_dec.store(on.unwrap_or_else(att_dec_from_env), Ordering::Relaxed);
    }

    /// Run one-query launches that take the decode attention split over blocks per KV head (`attention_dkv`)
    /// at every context (`Some(true)`) or in clusters per query head (`attention_dec`, `Some(false)`); `None`:
    /// as `EDDY_CUDA_ATT_DKV` said at start (unset: [`ATT_DKV`], the split kernel from [`ATT_DKV_MIN_CHUNKS`]
    /// chunks). The same bits either way; for tests and measurements.
    pub fn force_split_decode_attention(&self, on: Option<bool>) {
        let mode = on.map_or_else(att_dkv_from_env, |on| if on { 2 } else { 0 });
        self.att_dkv.store(mode, Ordering::Relaxed);
    }

    /// `attention_dkv`'s grid: this many blocks a multiprocessor (1 to 8; fewer give each block more items and
    /// an item more query heads); `None`: as `EDDY_CUDA_ATT_DKV_SM` said at start (unset: [`ATT_DKV_PER_SM`]).
    pub fn force_split_decode_blocks(&self, per_sm: Option<usize>) {
        let n = per_sm.unwrap_or_else(att_dkv_per_sm_from_env);
        assert!(ATT_DKV_SM_RANGE.contains(&n), "attention_dkv: 1 to 8 blocks a multiprocessor");
        self.att_dkv_per_sm.store(n, Ordering::Relaxed);
    }

    /// Launches of `attention_dkv` queued since [`Cuda::new`] (tests: that it ran).
    pub fn split_decode_launches(&self) -> u64 {
        self.att_dkv_launches.load(Ordering::Relaxed)
    }

    /// Launches of the decode attention with the step's RoPE and cache store (`attention_dec_rope`) queued
    /// since [`Cuda::new`] (tests: that it ran).
    pub fn fused_rope_launches(&self) -> u64 {
        self.rope_att_launches.load(Ordering::Relaxed)
    }

    /// Run a decode step's RoPE and K/V cache store inside its attention (`Some(true)`, where the decode
    /// attention runs) or as `rope_store` (`Some(false)`); `None`: as `EDDY_CUDA_ROPE_ATT` said at start
    /// (unset: inside). The results do not depend on it; for tests and measurements.
    pub fn force_fused_rope(&self, on: Option<bool>) {
        self.rope_att.store(on.unwrap_or_else(rope_att_from_env), Ordering::Relaxed);
    }

    /// The GPU's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Kernel launches plus memory copies and sets queued on the stream since [`Cuda::new`] (to count the
    /// operations of a forward pass).
    pub fn launches(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// What a phase boundary costs on this GPU (kernels.cu, `sync_probe`; docs/cuda.md, "What a phase boundary
    /// costs"): seconds a round, the mean of `reps` timed runs after one warm-up, and the reads that missed
    /// the value the round should have shown them (0 for a barrier that orders). Every block writes a value,
    /// synchronizes, and reads its neighbour's:
    /// - [`SyncProbe::Grid`]: one launch of one block a multiprocessor (256 threads each; all resident, as a
    ///   persistent kernel's) synchronizing `rounds` times through a grid-wide barrier (a release add, an
    ///   acquire spin);
    /// - [`SyncProbe::Cluster`]`(c, dsmem)`: clusters of `c` blocks (2..=8) synchronizing `rounds` times
    ///   through the cluster barrier, the neighbour's value read from its shared memory (`dsmem`) or from global
    ///   memory;
    /// - [`SyncProbe::ClusterShared`]`(c)`: the DSMEM form behind a release fence restricted to shared memory and
    ///   a relaxed arrive (`MEMBAR.CTA` where `arrive.release` puts a GPU-wide one);
    /// - [`SyncProbe::Launches`]: `rounds` launches of one round each, in one pass (replayed as a graph from the
    ///   third run on, programmatic dependent launch between them): the kernel boundary the barriers would
    ///   replace.
    ///
    /// # Errors
    /// A cluster probe on a GPU below compute capability 9.0, or a cluster size outside 2..=8.
    pub fn sync_probe(&self, probe: SyncProbe, rounds: usize, reps: usize) -> Result<(f64, u64)> {
        let cluster_kind = |c: usize, kind: usize| {
            if self.capability.0 < 9 || !(2..=8).contains(&c) {
                return Err(Error::Input(format!("a cluster probe of {c} blocks needs sm_90 and 2..=8 blocks")));
            }
            Ok((kind, c))
        };
        let (kind, cluster) = match probe {
            SyncProbe::Grid => (0, 1),
            SyncProbe::Cluster(c, dsmem) => cluster_kind(c, if dsmem { 1 } else { 2 })?,
            SyncProbe::ClusterShared(c) => cluster_kind(c, 4)?,
            SyncProbe::Launches => (3, 1),
        };
        // One block a multiprocessor (what a persistent kernel would run: all resident, one arrival each).
        let blocks = if kind == 0 { self.sms } else { (self.sms / cluster).max(1) * cluster };
        let rounds = rounds.max(1);
        // Counter, the miss count, two buffers of slots; zeroed once: the barriers' targets and every value
        // written go on from run to run (`base`), so a stale value never looks current. The launches' chain
        // (kind 3) keeps its arguments from run to run, so that its pass is captured as a graph (seen, captured,
        // then replayed: the first three runs are not timed), and zeroes the slots before each run instead.
        let words = 2 + 2 * blocks;
        let mem = DevMem::new(&self.ctx, 4 * words);
        // SAFETY: fresh memory of `4 · words` bytes that nothing queued addresses.
        check(unsafe { result::memset_d8_async(mem.ptr, 0, mem.bytes, self.ctx.stream) }, "memset");
        let (bar, bad, slots) = (mem.ptr, mem.ptr + 4, mem.ptr + 8);
        let mut total = 0.0;
        let mut base = 0usize;
        let warm = if kind == 3 { 3 } else { 1 };
        for rep in 0..warm + reps.max(1) {
            if kind == 3 {
                // SAFETY: the slots lie in our allocation; the stream is idle (synchronized after each run).
                check(unsafe { result::memset_d8_async(slots, 0, 4 * 2 * blocks, self.ctx.stream) }, "memset");
            }
            let t0 = std::time::Instant::now();
            if kind == 3 {
                for l in 0..rounds {
                    let a = Args::new().p(bar).p(slots).p(bad).i(1).i(kind).i(l);
                    self.launch_cluster(self.k.sync_probe, (1, 1, blocks), ATT_THREADS, 0, 1, a);
                }
            } else {
                let a = Args::new().p(bar).p(slots).p(bad).i(rounds).i(kind).i(base);
                self.launch_cluster(self.k.sync_probe, (1, 1, blocks), ATT_THREADS, 0, cluster as u8, a);
            }
            self.synchronize();
            if rep >= warm {
                total += t0.elapsed().as_secs_f64();
            }
            base += rounds;
        }
        let mut missed = 0u32;
        // SAFETY: 4 bytes of our allocation; the stream is idle (synchronized above).
        check(unsafe { result::memcpy_dtoh_sync(std::slice::from_mut(&mut missed), bad) }, "copy to the host");
        Ok((total / (reps.max(1) * rounds) as f64, u64::from(missed)))
    }

    /// The largest cluster of at most `want` blocks of `f` (`threads` a block, `smem` bytes of dynamic shared
    /// memory) that the GPU can hold at once, by the driver's `cuOccupancyMaxActiveClusters` (cached): `want`,
    /// `want − 1`, … down to 2 (`pow2`: `want`, `want / 2`, …), else 1 (no cluster).
    fn fitting_cluster(&self, f: Func, threads: u32, smem: u32, want: usize, pow2: bool) -> usize {
        let mut c = want;
        while c >= 2 {
            let key = (f.0 as usize, threads, smem, c);
            let cached = self.cluster_fits.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
            let fits = cached.unwrap_or_else(|| {
                let mut attr = cluster_attr(c as u32);
                let config = sys::CUlaunchConfig {
                    gridDimX: 1,
                    gridDimY: 1,
                    gridDimZ: c as u32,
                    blockDimX: threads,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: self.ctx.stream,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                let mut n: std::ffi::c_int = 0;
                self.ctx.bind();
                // SAFETY: a kernel of our module; the config and its attribute live through the call, which
                // only computes.
                let ok = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.0, &config) } == sys::CUresult::CUDA_SUCCESS;
                // A failed call (an unrelated earlier error, say) is not an answer: not cached.
                if ok {
                    self.cluster_fits.lock().unwrap_or_else(|e| e.into_inner()).insert(key, n > 0);
                }
                ok && n > 0
            });
            if fits {
                return c;
            }
            c = if pow2 { c / 2 } else { c - 1 };
        }
        1
    }

    /// Send the queued work and wait for it (for timing).
    pub fn synchronize(&self) {
        self.ctx.flush();
        // SAFETY: our stream.
        check(unsafe { result::stream::synchronize(self.ctx.stream) }, "stream synchronize");
    }

    /// Run every tensor-core product (5+ tokens) with its row tiles split over `split` blocks (1, 2 or 4) and
    /// on a grid of at most `row_blocks` blocks over the row tiles (each block walking several), or choose
    /// them by the launch's size (`None`, the default). The results do not depend on either (batch
    /// invariance); for tests and measurements.
    ///
    /// # Panics
    /// On a split other than 1, 2 or 4, or 0 row blocks.
    pub fn force_product_launch(&self, split: Option<usize>, row_blocks: Option<usize>) {
        let s = split.unwrap_or(0);
        assert!(s == 0 || MMA_SPLITS.contains(&s), "product split {s}: 1, 2 or 4");
        assert!(row_blocks != Some(0), "a grid of 0 row blocks");
        self.forced_split.store(s, Ordering::Relaxed);
        self.forced_row_blocks.store(row_blocks.unwrap_or(0), Ordering::Relaxed);
    }

    /// Run every quantized product of 5+ tokens on the large-tile kernels `mm_qt*` (`Some(true)`, where the row
    /// has at most `QT_MAXB` blocks of 32), never (`Some(false)`), or as `EDDY_CUDA_QT` said at start (`None`;
    /// unset: from `QT_MIN` tokens). The results do not depend on it (batch invariance); for tests and
    /// measurements.
    pub fn force_tiled_products(&self, tiled: Option<bool>) {
        self.forced_tiled.store(tiled.map_or_else(tiled_from_env, |t| if t { 2 } else { 1 }), Ordering::Relaxed);
    }

    /// Whether a product of `n` tokens runs on `mm_qp*`: `n` above [`INVARIANT_TOKENS`] (a prefill run), unless
    /// turned off.
    fn prefill_products(&self, n: usize) -> bool {
        n > INVARIANT_TOKENS && self.prefill_qp.load(Ordering::Relaxed)
    }

    /// Run products of more than [`INVARIANT_TOKENS`] tokens on `mm_qp*` in block order (`true`, the default) or
    /// on the kernels in `mm_q_t1`'s order (`false`); for tests and measurements.
    pub fn force_prefill_products(&self, on: bool) {
        self.prefill_qp.store(on, Ordering::Relaxed);
    }

    /// Run causal attention of more than [`INVARIANT_TOKENS`] queries on the tensor cores (`attention_mma`,
    /// the default, head dims 64, 128 and 256) with P·V in `pv_products` TF32 products (1, or 3: about f32's
    /// precision, as the scores), or not (0: the kernels every other size takes); for tests and measurements.
    ///
    /// # Panics
    /// If `pv_products` is not 0, 1 or 3.
    pub fn force_prefill_attention(&self, pv_products: usize) {
        assert!(matches!(pv_products, 0 | 1 | 3), "P·V products: 0 (off), 1 or 3");
        self.prefill_fa.store(pv_products, Ordering::Relaxed);
    }

    /// Whether a product of `n > dp4a_max` tokens over `rows × cols` (all parts' rows) runs on `mm_qt*` (else
    /// `mm_qw*`). By default `mm_qt*` from `qt_min` tokens when its grid fills the
    /// GPU twice (`QT_WAVES` waves of two blocks a multiprocessor): with fewer, larger blocks than `mm_qw*`'s, a
    /// grid under one wave leaves multiprocessors idle (measured: o and ffn_down of the 0.5B at 256 tokens, 112
    /// blocks, 16–24 % slower on `mm_qt*`; gate/up, 1,216 blocks, 22 % faster). Offsets inside the kernel are
    /// 32-bit: matrices of 2^31 code bytes or more, and activations of 2^31 codes, stay on `mm_qw*`.
    fn tiled_for(&self, n: usize, rows: usize, cols: usize) -> bool {
        let fits = (1..=QT_MAXB).contains(&(cols / QK)) && rows * cols < 1 << 31 && n * cols < 1 << 31;
        let blocks = rows.div_ceil(QT_ROWS) * n.div_ceil(QT_TOKENS);
        let on = match self.forced_tiled.load(Ordering::Relaxed) {
            1 => false,
            2 => true,
            _ => n >= self.qt_min && blocks >= QT_WAVES * 2 * self.sms,
        };
        on && fits
    }

    /// Run every quantized product of 5+ tokens that does not take the large-tile kernels on `mm_qv*` with
    /// `warps` warps per row tile (`Some(4 | 8 | 16)`), on `mm_qw*` (`Some(0)`), or choose by the launch's size
    /// (`None`, the default). The results do not depend on it (batch invariance); for tests and measurements.
    ///
    /// # Panics
    /// On other warp counts.
    pub fn force_verify_products(&self, warps: Option<usize>) {
        let v = match warps {
            None => 0,
            Some(0) => QV_OFF,
            Some(w) => {
                assert!(QV_WARPS.contains(&w), "{w} warps a row tile: 4, 8 or 16");
                w
            }
        };
        self.forced_qv.store(v, Ordering::Relaxed);
    }

    /// Whether the `mm_qv*` kernels may run at all (not turned off by `EDDY_CUDA_QV=0` or
    /// [`Cuda::force_verify_products`]`(Some(0))`): [`Cuda::qv_plan`] picks them, and the quantizing kernels
    /// write their token-tiled activations, only then.
    fn qv_enabled(&self) -> bool {
        self.forced_qv.load(Ordering::Relaxed) != QV_OFF
    }

    /// The `mm_qv*` launch for a product of `n` tokens (below the large-tile kernels) over `tiles` row tiles of
    /// 16 from `xq`: `Some((index into QV_WARPS, grid))`, grid `(tiles, token tiles, 1)`, or `None` for
    /// `mm_qw*` (always where `xq` has no tiled copy: more than `QV_TILED_MAX` tokens). By default up to
    /// `QV_MAX` tokens, with 8 warps a tile where that brings `QV_MIN_WARPS_PER_SM` warps to every
    /// multiprocessor, else 16 (measured on the 1.5B's shapes, random Q4_K/Q6_K-form weights, 8–32 tokens: 8
    /// beat 4 everywhere, e.g. the LM head at 16 tokens 166 against 186 µs, and 16 gains where tiles are few).
    ///
    /// The third grid dimension is the cluster size: 1, or with `EDDY_CUDA_QV_CLUSTER=c` (sm_90) `c` where the
    /// launch has fewer row and token tiles than the GPU has multiprocessors — each tile then split over a
    /// cluster of `c` blocks (`mm_qvc*`) of 32 / c warps, one visit each — or always where
    /// [`Cuda::force_verify_clusters`] says so (with forced warps, `c` at most 32 / warps).
    fn qv_plan(&self, tiles: usize, n: usize, xq: &CudaQAct) -> Option<(usize, (usize, usize, usize))> {
        if xq.tg == 0 {
            return None;
        }
        let (_, nt) = qv_tile(n);
        let ttiles = n.div_ceil(nt);
        let warps = match self.forced_qv.load(Ordering::Relaxed) {
            QV_OFF => return None,
            0 if n > QV_MAX => return None,
            0 if tiles * ttiles * 8 >= QV_MIN_WARPS_PER_SM * self.sms => 8,
            0 => 16,
            w => w,
        };
        let cluster = match self.qv_cluster.load(Ordering::Relaxed) {
            c if c >= 2 && self.capability.0 >= 9 && (self.qv_cluster_always.load(Ordering::Relaxed) || tiles * ttiles < self.sms) => c,
            _ => 1,
        };
        // A split tile has 32 / c visits a block: unless forced, 32 / c warps (one visit each), else at most
        // the warps' visits allow.
        let (warps, cluster) = match (cluster, self.forced_qv.load(Ordering::Relaxed)) {
            (1, _) => (warps, 1),
            (c, 0) => (32 / c, c),
            (c, _) => (warps, c.min(32 / warps)),
        };
        let wi = QV_WARPS.iter().position(|&w| w == warps).expect("a warp count of QV_WARPS");
        Some((wi, (tiles, ttiles, cluster)))
    }

    /// The resident launch of a product of `n` tokens over `tiles` row tiles of 16 (`mm_qv*_w8r`, or
    /// `mm_q3v*_w8r` for `parts`) from `xq`, of `cols` columns, form `form` and packing `p`: `Some((tile
    /// variant (qv_tile), grid, dynamic shared memory bytes))` where the resident kernels are on, the product
    /// would take `mm_qv*` with the warps chosen by its size, the activations its warps visit fit shared memory,
    /// and its tiles are more than the blocks that fit at once (or always, [`Cuda::force_resident_products`]);
    /// the grid `(at most the blocks that fit, token tiles, 1)`, block x walking row tiles x, x + grid.0, ….
    /// Each output has `mm_q_t1`'s bits (docs/cuda.md, "Resident verify products").
    #[allow(clippy::too_many_arguments)]
    fn qv_res_plan(
        &self,
        tiles: usize,
        n: usize,
        cols: usize,
        form: usize,
        p: usize,
        parts: bool,
        xq: &CudaQAct,
    ) -> Option<(usize, (usize, usize, usize), u32)> {
        let mode = self.qv_res.load(Ordering::Relaxed);
        if mode == QV_RES_OFF || xq.tg == 0 || n > QV_MAX || self.forced_qv.load(Ordering::Relaxed) != 0 {
            return None;
        }
        let (v, nt) = qv_tile(n);
        let ttiles = n.div_ceil(nt);
        let (fixed, act) = self.k.mm_qvr_smem[v][form][p];
        let smem = fixed as usize + 8 * qv_res_entries(cols) * act as usize;
        if smem > self.qvr_smem_max as usize {
            return None;
        }
        let f = if parts { self.k.mm_q3vr[v][form][p] } else { self.k.mm_qvr[v][form][p] };
        let per_sm = {
            let mut m = self.qvr_occupancy.lock().unwrap_or_else(|e| e.into_inner());
            *m.entry((f.0 as usize, smem as u32)).or_insert_with(|| occupancy(f, 256, smem as u32).unwrap_or(1))
        };
        let slots = per_sm.max(1) * self.sms;
        if mode != QV_RES_ALWAYS && tiles * ttiles <= slots {
            return None;
        }
        let gx = match self.forced_row_blocks.load(Ordering::Relaxed) {
            0 => (slots / ttiles).clamp(1, tiles),
            b => tiles.min(b),
        };
        self.resident_launches.fetch_add(1, Ordering::Relaxed);
        Some((v, (gx, ttiles, 1), smem as u32))
    }

    /// Run `mm_qv*` launches on the resident kernels where their activations fit shared memory (`Some(true)`:
    /// every such launch, however few its tiles), never (`Some(false)`), or as `EDDY_CUDA_QV_RES` said at start
    /// (`None`; unset: [`QV_RES`], launches of more tiles than fit at once). Only where the warps per tile
    /// are not forced ([`Cuda::force_verify_products`]). The results do not depend on it (batch invariance);
    /// for tests and measurements.
    pub fn force_resident_products(&self, on: Option<bool>) {
        let mode = match on {
            Some(true) => QV_RES_ALWAYS,
            Some(false) => QV_RES_OFF,
            None => qv_res_from_env(),
        };
        self.qv_res.store(mode, Ordering::Relaxed);
    }

    /// Split every `mm_qv*` row tile over a thread-block cluster of `blocks` blocks (2, 4 or 8; at most 32 / the
    /// tile's warps): `Some`, for every launch; `None`, as `EDDY_CUDA_QV_CLUSTER` said at start (unset: never;
    /// set: launches of fewer tiles than multiprocessors). The results do not depend on it (batch invariance);
    /// ignored below compute capability 9.0; for tests and measurements.
    ///
    /// # Panics
    /// On other sizes.
    pub fn force_verify_clusters(&self, blocks: Option<usize>) {
        match blocks {
            Some(c) => {
                assert!([2, 4, 8].contains(&c), "verify-product clusters of 2, 4 or 8 blocks");
                self.qv_cluster.store(c, Ordering::Relaxed);
                self.qv_cluster_always.store(true, Ordering::Relaxed);
            }
            None => {
                self.qv_cluster.store(qv_cluster_from_env(), Ordering::Relaxed);
                self.qv_cluster_always.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Run the attention with `blocks` blocks per (query, heads), each walking every `blocks`-th key chunk
    /// (clamped to 1..=the chunks the cache holds), and with one block per KV head (`attention_kv`:
    /// `Some(true)`, where the head dimension and group allow it) or per query head (`Some(false)`); `None`
    /// chooses by the launch's size (the default). The results do not depend on either (batch invariance);
    /// for tests and measurements. Causal runs of more than [`INVARIANT_TOKENS`] queries on `attention_mma`
    /// ignore both ([`Cuda::force_prefill_attention`]`(0)` puts them back on these kernels).
    ///
    /// # Panics
    /// On `Some(0)` blocks.
    pub fn force_attention_launch(&self, blocks: Option<usize>, per_kv_head: Option<bool>) {
        assert!(blocks != Some(0), "0 attention blocks per (query, heads)");
        self.forced_att_blocks.store(blocks.unwrap_or(0), Ordering::Relaxed);
        self.forced_att_kernel.store(per_kv_head.map_or(0, |k| if k { 2 } else { 1 }), Ordering::Relaxed);
    }

    /// Run every `attention` and `attention_kv` launch as thread-block clusters of `blocks` blocks (2 to 16, at
    /// most the chunks the cache holds) over each (query, heads)'s chunks, their records combined by the
    /// cluster's first block after the cluster barrier; `Some(0)` or `Some(1)`: no clusters (the last block to
    /// finish combines through a device counter); `None`: as `EDDY_CUDA_ATT_CLUSTER` said at start (unset:
    /// clusters of 16 for one-query launches without a forced block count, none for more queries). The results
    /// do not depend on it (batch invariance); ignored below compute capability 9.0; for tests and measurements.
    ///
    /// # Panics
    /// On a size above 16.
    pub fn force_attention_clusters(&self, blocks: Option<usize>) {
        let (c, all) = match blocks {
            Some(c) => {
                assert!(c <= ATT_MAX_CLUSTER, "attention clusters of at most {ATT_MAX_CLUSTER} blocks");
                (if c >= 2 { c } else { 0 }, true)
            }
            None => att_cluster_from_env(),
        };
        self.att_cluster.store(c, Ordering::Relaxed);
        self.att_cluster_all.store(all, Ordering::Relaxed);
    }

    /// Whether an `n`-token product of rows of `cols` values runs on the one-token kernel with deeper loads
    /// (`mm_q_t1u4*`): one token, and rows of at least 3 blocks a lane (the down projections; the default,
    /// `EDDY_CUDA_T1_UNROLL=2` turns it off), or every width when forced ([`Cuda::force_decode_unroll`]).
    fn t1_deep(&self, n: usize, cols: usize) -> bool {
        n == 1 && deep_at(self.t1_unroll.load(Ordering::Relaxed), 4, cols)
    }

    /// Whether an `n`-token product of rows of `cols` values runs on the two-token kernel with deeper loads
    /// (`mm_q_t2u4*`): two tokens and rows of at least 3 blocks a lane where [`T2_UNROLL`] or
    /// `EDDY_CUDA_T2_UNROLL` says 4, or every width when forced ([`Cuda::force_two_token_unroll`]).
    fn t2_deep(&self, n: usize, cols: usize) -> bool {
        n == 2 && deep_at(self.t2_unroll.load(Ordering::Relaxed), 4, cols)
    }

    /// Whether an `n`-token `dp4a` product of rows of `cols` values runs on the four-token kernel with deeper
    /// loads (`mm_q_t4u2*`): three or four tokens and rows of at least 3 blocks a lane where [`T4_UNROLL`] or
    /// `EDDY_CUDA_T4_UNROLL` says 2, or every width when forced ([`Cuda::force_four_token_unroll`]).
    fn t4_deep(&self, n: usize, cols: usize) -> bool {
        (3..=4).contains(&n) && deep_at(self.t4_unroll.load(Ordering::Relaxed), 2, cols)
    }

    /// Run three- and four-token `dp4a` products with 2 blocks of a row and their activations in flight a lane
    /// for every width (`Some(2)`: `mm_q_t4u2*`, `mm_q_t4`'s chains with the loads issued together), on `mm_q_t4`
    /// (`Some(0)`), or as `EDDY_CUDA_T4_UNROLL` said at start (`None`; unset: [`T4_UNROLL`]). The results do not
    /// depend on it; for tests and measurements.
    ///
    /// # Panics
    /// On other depths.
    pub fn force_four_token_unroll(&self, blocks: Option<usize>) {
        let u = match blocks {
            Some(0) => 0,
            Some(2) => DEEP_ALWAYS,
            Some(u) => panic!("three- and four-token loads 0 or 2 blocks deep, not {u}"),
            None => t4_unroll_from_env(),
        };
        self.t4_unroll.store(u, Ordering::Relaxed);
    }

    /// Run three- and four-token parts of different code packings in one `dp4a` launch (`Some(true)`:
    /// `mm_q3x_t4`), apart (`Some(false)`), or as `EDDY_CUDA_MIXED_T4` said at start (`None`; unset:
    /// [`MIXED_T4`]). The results do not depend on it; for tests and measurements.
    pub fn force_mixed_four_tokens(&self, on: Option<bool>) {
        self.mixed_t4.store(on.unwrap_or_else(mixed_t4_from_env), Ordering::Relaxed);
    }

    /// Run two-token products with 4 blocks of a row and their activations in flight a lane for every width
    /// (`Some(4)`: `mm_q_t2u4*`, `mm_q_t2`'s chains with the loads issued together), on `mm_q_t2` (`Some(0)`), or
    /// as `EDDY_CUDA_T2_UNROLL` said at start (`None`; unset: [`T2_UNROLL`]). The results do not depend on it; for
    /// tests and measurements.
    ///
    /// # Panics
    /// On other depths.
    pub fn force_two_token_unroll(&self, blocks: Option<usize>) {
        let u = match blocks {
            Some(0) => 0,
            Some(4) => DEEP_ALWAYS,
            Some(u) => panic!("two-token loads 0 or 4 blocks deep, not {u}"),
            None => t2_unroll_from_env(),
        };
        self.t2_unroll.store(u, Ordering::Relaxed);
    }

    /// Most tokens of a `matmul_parts` launch on the `dp4a` kernels whose parts may differ in code packing: 4
    /// where three- and four-token parts share a launch (`mm_q3x_t4`; [`MIXED_T4`], `EDDY_CUDA_MIXED_T4`; two
    /// tokens then too), 2 where two-token parts do (`mm_q3x_t2`; [`MIXED_T2`], `EDDY_CUDA_MIXED_T2`), else 1.
    pub fn mixed_packing_tokens(&self) -> usize {
        if self.mixed_t4.load(Ordering::Relaxed) {
            4
        } else if self.mixed_t2.load(Ordering::Relaxed) {
            2
        } else {
            1
        }
    }

    /// Run two-token parts of different code packings in one `matmul_parts` launch (`Some(true)`:
    /// `mm_q3x_t2`), apart (`Some(false)`), or as `EDDY_CUDA_MIXED_T2` said at start (`None`; unset:
    /// [`MIXED_T2`]). The results do not depend on it; for tests and measurements.
    pub fn force_mixed_two_tokens(&self, on: Option<bool>) {
        self.mixed_t2.store(on.unwrap_or_else(mixed_t2_from_env), Ordering::Relaxed);
    }

    /// Run one-token products with 4 blocks of a row and their activations in flight a lane for every width
    /// (`Some(4)`: `mm_q_t1u4*`, whose chains are `mm_q_t1`'s with the loads issued together), with `mm_q_t1`
    /// (`Some(2)`), or as `EDDY_CUDA_T1_UNROLL` said at start (`None`; unset or `4`: `mm_q_t1u4*` for rows of
    /// 3+ blocks a lane; `2`: `mm_q_t1`). The results do not depend on it; for tests and measurements.
    ///
    /// # Panics
    /// On other depths.
    pub fn force_decode_unroll(&self, blocks: Option<usize>) {
        let u = match blocks {
            Some(4) => DEEP_ALWAYS,
            Some(2) => 2,
            Some(u) => panic!("one-token loads 2 or 4 blocks deep, not {u}"),
            None => t1_unroll_from_env(),
        };
        self.t1_unroll.store(u, Ordering::Relaxed);
    }

    /// Keep run-ahead argmaxes on the device ([`Backend::runs_ahead`]: `Some(true)`), take them at once
    /// (`Some(false)`), or as `EDDY_CUDA_RUN_AHEAD` said at start (`None`; unset: [`RUN_AHEAD`]). Change it
    /// only with no run-ahead step in flight. The tokens do not depend on it; for tests and measurements.
    pub fn force_run_ahead(&self, on: Option<bool>) {
        self.run_ahead.store(on.unwrap_or_else(run_ahead_from_env), Ordering::Relaxed);
    }

    /// Run `matmul_parts` of different forms in one launch where the kernels allow it (`Some(true)`,
    /// [`one_launch`]), only parts of one form (`Some(false)`), or as `EDDY_CUDA_JOINT` said at start (`None`;
    /// unset: [`JOINT_PARTS`]). The results do not depend on it; for tests and measurements.
    pub fn force_joint_parts(&self, on: Option<bool>) {
        let on = on.unwrap_or_else(joint_from_env);
        self.joint.store(on, Ordering::Relaxed);
    }

    /// Where the parts of a `matmul_parts` cannot all share one launch, run two that can together and the third
    /// alone (`Some(true)`), each alone (`Some(false)`), or as `EDDY_CUDA_PAIR` said at start (`None`; unset:
    /// pairs). The results do not depend on it; for tests and measurements.
    pub fn force_pair_parts(&self, on: Option<bool>) {
        self.pair_parts.store(on.unwrap_or_else(pair_from_env), Ordering::Relaxed);
    }

    /// Most tokens of a quantized product on the `dp4a` kernels (`DP4A_MAX`, or `EDDY_CUDA_DP4A_MAX`).
    pub fn dp4a_tokens(&self) -> usize {
        self.dp4a_max.load(Ordering::Relaxed)
    }

    /// Put products of up to `tokens` tokens (1 to 8) on the `dp4a` kernels and more on the tensor cores
    /// (`Some`), or as `EDDY_CUDA_DP4A_MAX` said at start (`None`; unset: `DP4A_MAX`). The results do not depend
    /// on it (batch invariance); for tests and measurements.
    pub fn force_dp4a_tokens(&self, tokens: Option<usize>) {
        let m = tokens.filter(|t| (1..=MM_TT).contains(t)).unwrap_or_else(dp4a_max_from_env);
        self.dp4a_max.store(m, Ordering::Relaxed);
    }

    /// The `dp4a` kernel for `n` tokens (at most `DP4A_MAX`, or `MM_TT` through `EDDY_CUDA_DP4A_MAX`): (index
    /// into `mm_q` / `mm_q3`, tokens per tile): 1 → t1, 2 → t2, more → t4 (tiles of 4).
    fn dp4a_tile(n: usize) -> (usize, usize) {
        match n {
            1 => (0, 1),
            2 => (1, 2),
            _ => (2, 4),
        }
    }

    /// The launch of a tensor-core product over `tiles` row tiles of 16 and `n` tokens: (index into
    /// `MMA_SPLITS`, grid) with grid `(blocks over the row tiles, token tiles, split)`. A launch of fewer blocks
    /// than the GPU runs at once splits each row tile over 2 or 4 blocks (the tree's top levels, docs/cuda.md);
    /// a larger one runs, unless `EDDY_CUDA_PERSIST=0`, on a grid of at most the blocks that fit at once, each
    /// block walking row tiles `x, x + grid.0, …` with the next tile's loads in flight.
    fn mma_plan(&self, tiles: usize, n: usize) -> (usize, (usize, usize, usize)) {
        let (_, nt) = mma_tile(n);
        let ttiles = n.div_ceil(nt);
        let slots = MMA_BLOCKS_PER_SM * self.sms;
        let forced = self.forced_split.load(Ordering::Relaxed);
        let split = if forced != 0 { forced } else { *MMA_SPLITS.iter().rev().find(|&&s| tiles * ttiles * s <= slots).unwrap_or(&1) };
        let si = MMA_SPLITS.iter().position(|&s| s == split).expect("a split of MMA_SPLITS");
        let gx = match self.forced_row_blocks.load(Ordering::Relaxed) {
            0 if self.persist => tiles.min((slots / (ttiles * split)).max(1)),
            0 => tiles,
            b => tiles.min(b),
        };
        (si, (gx, ttiles, split))
    }

    /// The partial-sum and counter buffers of a split product over `tiles × ttiles` tiles of `nt` tokens
    /// (0, 0 for an unsplit one).
    fn mma_split_bufs(&self, split: usize, tiles: usize, ttiles: usize, nt: usize) -> (u64, u64) {
        if split == 1 {
            return (0, 0);
        }
        let mut m = self.mma_split.lock().unwrap_or_else(|e| e.into_inner());
        let m = &mut *m;
        let part = self.ensure(&mut m.part, 4 * tiles * ttiles * split * MMA_ROWS * nt, false);
        let count = self.ensure(&mut m.count, 4 * tiles * ttiles, true);
        (part, count)
    }

    /// How queued passes have run so far: one by one, captured into a graph, or replayed from one.
    pub fn graph_stats(&self) -> GraphStats {
        self.ctx.queue().stats
    }

    /// Launch an empty kernel in place of every kernel (same grid, block and shared memory; copies still run),
    /// or the real ones again: runs the queued work and drops the kept graphs. A pass then costs only its
    /// launches and the gaps between them (its results are meaningless); for measurements only.
    pub fn set_empty_kernels(&self, on: bool) {
        self.set_empty(on, Vec::new());
    }

    /// Launch the empty kernel in place of each kernel named in `names` (none: the real kernels again), as
    /// [`Cuda::set_empty_kernels`] does for all: a step's time without them, against the full step, is what
    /// those kernels cost inside the step (their own time and the gaps they add). Unknown names match nothing.
    /// For measurements only.
    pub fn set_empty_kernels_named(&self, names: &[&str]) {
        let only: Vec<usize> = self.kernel_names.iter().filter(|(_, n)| names.contains(&n.as_str())).map(|(&f, _)| f).collect();
        let on = !only.is_empty();
        self.set_empty(on, only);
    }

    /// The names of the kernels of the last list of operations long enough to be a graph (a decode step, a
    /// verify or prefill pass), in launch order.
    pub fn last_list_kernels(&self) -> Vec<String> {
        let q = self.ctx.queue();
        q.last_list.iter().map(|f| self.kernel_name(*f)).collect()
    }

    /// Start recording the kernels sent to the GPU (`true`, dropping any earlier record) or stop (`false`): for
    /// tests that a setting picked the kernel it names. Work queued before the call counts when it is flushed.
    pub fn record_kernels(&self, on: bool) {
        self.ctx.queue().recorded = on.then(Vec::new);
    }

    /// The names of the kernels sent to the GPU since [`Cuda::record_kernels`]`(true)` or the last call, in
    /// launch order (flushes the queue first); empty while not recording.
    pub fn recorded_kernels(&self) -> Vec<String> {
        self.ctx.flush();
        let mut q = self.ctx.queue();
        let fs = q.recorded.as_mut().map(std::mem::take).unwrap_or_default();
        fs.iter().map(|&f| self.kernel_name(f)).collect()
    }

    /// The name of the kernel `f` (a launch's function), or `?` for one not loaded from eddy's module.
    fn kernel_name(&self, f: usize) -> String {
        self.kernel_names.get(&f).cloned().unwrap_or_else(|| "?".into())
    }

    fn set_empty(&self, on: bool, only: Vec<usize>) {
        self.synchronize();
        let mut q = self.ctx.queue();
        q.noop = if on { self.k.noop.0 as usize } else { 0 };
        q.never_empty = self.k.rope_table.0 as usize;
        q.empty_only = only;
        for g in q.plan.drain() {
            // SAFETY: the graphs' work is done (synchronized above) and nothing refers to them any more.
            let _ = unsafe { result::graph::exec_destroy(g.0) };
        }
    }

    /// Whether kernels are launched with programmatic dependent launch (PDL): on compute capability 9.0 and
    /// later unless `EDDY_CUDA_PDL=0` (docs/cuda.md, "Programmatic dependent launch").
    pub fn programmatic_launch(&self) -> bool {
        self.ctx.queue().pdl
    }

    /// Turn programmatic dependent launch on or off (on only where the GPU has it): runs the queued work and
    /// drops the kept graphs, so later passes are captured again with the new launches. The results do not
    /// depend on it (each kernel waits for its predecessor before touching memory); for tests and
    /// measurements.
    pub fn set_programmatic_launch(&self, on: bool) {
        self.synchronize();
        let mut q = self.ctx.queue();
        q.pdl = on && self.capability.0 >= 9;
        for g in q.plan.drain() {
            // SAFETY: the graphs' work is done (synchronized above) and nothing refers to them any more.
            let _ = unsafe { result::graph::exec_destroy(g.0) };
        }
    }

    fn launch(&self, f: Func, grid: (usize, usize), block: u32, args: Args) {
        self.launch3(f, (grid.0, grid.1, 1), block, args)
    }

    /// Queue a kernel launch.
    fn launch3(&self, f: Func, grid: (usize, usize, usize), block: u32, args: Args) {
        self.launch_smem(f, grid, block, 0, args)
    }

    /// A launch with `smem` bytes of dynamic shared memory.
    fn launch_smem(&self, f: Func, grid: (usize, usize, usize), block: u32, smem: u32, args: Args) {
        self.launch_cluster(f, grid, block, smem, 1, args)
    }

    /// A launch whose blocks form thread-block clusters of `cluster` blocks along the grid's z (sm_90; 1: none;
    /// `grid.2` a multiple of it).
    fn launch_cluster(&self, f: Func, grid: (usize, usize, usize), block: u32, smem: u32, cluster: u8, args: Args) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        debug_assert!(cluster <= 1 || grid.2.is_multiple_of(cluster as usize), "a grid of whole clusters");
        if cluster > 1 {
            self.cluster_launches.fetch_add(1, Ordering::Relaxed);
        }
        let g = |x: usize| u32::try_from(x).expect("CUDA grid too large");
        self.queued.fetch_add(1, Ordering::Relaxed);
        let op =
            Op::Kernel { f: f.0 as usize, grid: [g(grid.0), g(grid.1), g(grid.2)], block, smem, cluster, n: args.n as u8, args: args.v };
        self.ctx.queue().push(op);
    }

    /// Elementwise launch over `len` items.
    fn launch_1d(&self, f: Func, len: usize, args: Args) {
        self.launch(f, (len.div_ceil(THREADS as usize), 1), THREADS, args);
    }

    /// The device address of the RoPE table of the frequencies `inv_freq` (the rotated pairs' `1/θ_i`) for
    /// positions up to at least `max_pos`: f32 pairs (cos, sin) of the f64 angle `pos·θ_i`, pair i of position
    /// pos at `pos·half + i` (`rope_table` in kernels.cu: the CPU's rounding, computed once on the device). A
    /// table is kept per frequency list; one too short is replaced by one of the next power-of-two positions
    /// (at least [`ROPE_TABLE_MIN`]), filled before anything queued after this call runs (the queue is run and
    /// waited for), so kernels may read it before their `griddepcontrol.wait`.
    fn rope_table(&self, inv_freq: &[f32], max_pos: usize) -> u64 {
        let mut tabs = self.rope_tables.lock().unwrap_or_else(|e| e.into_inner());
        let same = |f: &[f32]| f.len() == inv_freq.len() && f.iter().zip(inv_freq).all(|(a, b)| a.to_bits() == b.to_bits());
        let at = tabs.iter().position(|t| same(&t.freq));
        if let Some(t) = at.map(|i| &tabs[i]).filter(|t| t.positions > max_pos) {
            return t.mem.ptr;
        }
        let positions = (max_pos + 1).next_power_of_two().max(ROPE_TABLE_MIN);
        let n = positions.checked_mul(inv_freq.len()).expect("rope table too large");
        self.ctx.bind();
        self.ctx.flush();
        let mem = DevMem::new(&self.ctx, 8 * n);
        let freq = self.stage(SLOT_FREQ, inv_freq);
        self.launch_1d(self.k.rope_table, n, Args::new().p(mem.ptr).l(n).p(freq).i(inv_freq.len()));
        self.synchronize();
        let table = RopeTable { freq: inv_freq.to_vec(), positions, mem };
        // The replaced table is freed: no queued work reads it (all ran above), and a kept graph that names it
        // replays only for a list naming the same address, whatever memory holds it then.
        match at {
            Some(i) => tabs[i] = table,
            None => tabs.push(table),
        }
        tabs[at.unwrap_or(tabs.len() - 1)].mem.ptr
    }

    /// Stage a host array for the queued operations (see [`Queue`]); its device address, valid for operations
    /// queued before the next flush: an operation stages its arrays after anything that may flush (`ensure`)
    /// and right before its launch.
    fn stage<T: Copy>(&self, slot: usize, data: &[T]) -> u64 {
        // SAFETY: plain-old-data values (u32, i32, f32) viewed as bytes.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.ctx.queue().stage(self.ctx.stream, slot, bytes)
    }

    /// Copy `src` to fresh memory at `dst` now (uploads of weights and buffers: nothing queued reads them).
    fn htod<T: Copy>(&self, dst: u64, src: &[T]) {
        if src.is_empty() {
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `dst` holds at least `size_of_val(src)` bytes (callers); a pageable source is staged before
        // the call returns.
        check(unsafe { result::memcpy_htod_async(dst, src, self.ctx.stream) }, "host-to-device copy");
    }

    /// Run the queued work, then copy `dst.len()` values from `src` and wait.
    fn dtoh<T: Copy>(&self, dst: &mut [T], src: u64) {
        self.ctx.flush();
        if dst.is_empty() {
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `src` holds `dst.len()` values (callers); the stream is synchronized before `dst` is used.
        check(unsafe { result::memcpy_dtoh_async(dst, src, self.ctx.stream) }, "device-to-host copy");
        self.synchronize();
    }

    /// Queue a copy of `values` f32 values.
    fn dtod(&self, dst: u64, src: u64, values: usize) {
        if values == 0 {
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.ctx.queue().push(Op::Copy { dst, src, bytes: 4 * values });
    }

    /// [`Backend::embed`], the first token's id copied (queued) from device memory at `from` when given
    /// ([`Backend::embed_ahead`]).
    fn embed_from(&self, table: &CudaWeights, tokens: &[u32], scale: Option<f32>, x: &mut CudaBuf, from: Option<u64>) {
        let (rows, cols) = (table.rows(), table.cols());
        let n = tokens.len();
        assert!(x.len >= n * cols, "embed: x holds {} values, {n}×{cols} needed", x.len);
        assert!(tokens.iter().all(|&t| (t as usize) < rows), "embed: token id outside the table of {rows} rows");
        if n == 0 {
            return;
        }
        assert_eq!(cols % QK, 0, "embed: the table's width must be a multiple of 32");
        // A pass begins: what was queued before runs as its own list.
        self.ctx.flush();
        let tok = self.stage(SLOTS, tokens);
        if let Some(src) = from {
            // The id is read on the device when the pass runs (the argmax of the pass queued before).
            self.dtod(tok, src, 1);
        }
        let (w, wtype, p4, g16, half, sc, mn, ins, outs) = match table {
            CudaWeights::F32 { data, .. } => (data.ptr, 0, 0, 0, 0, 0, 0, 0, 0),
            CudaWeights::Bf16 { data, .. } => (data.ptr, 1, 0, 0, 0, 0, 0, 0, 0),
            CudaWeights::Q(q) => (
                q.codes.ptr,
                2,
                q.packed4 as usize,
                q.g16 as usize,
                q.half as usize,
                q.scales.ptr,
                q.mins.as_ref().map_or(0, |m| m.ptr),
                q.in_signs.as_ref().map_or(0, |s| s.1.ptr),
                q.out_signs.as_ref().map_or(0, |s| s.0.ptr),
            ),
        };
        let a = Args::new()
            .p(w)
            .i(wtype)
            .i(rows)
            .i(cols)
            .i(p4)
            .i(g16)
            .i(half)
            .p(sc)
            .p(mn)
            .p(ins)
            .p(outs)
            .p(tok)
            .f(scale.unwrap_or(1.0))
            .i(scale.is_some() as usize)
            .p(x.ptr());
        self.launch(self.k.embed, (n, 1), THREADS, a);
    }

    /// Queue [`Backend::argmax_rows`] of the `n` rows (`width` values each) at `src`, run the queue and copy
    /// the `n` ids into `out`.
    fn argmax_into(&self, src: u64, n: usize, width: usize, out: &mut [u32]) {
        if n == 0 {
            return;
        }
        let ids = self.argmax_queue(src, n, width);
        self.dtoh(out, ids);
    }

    /// Queue the argmax kernels of the `n` rows (`width` values each) at `src`; the device address of the
    /// `n` ids they write.
    fn argmax_queue(&self, src: u64, n: usize, width: usize) -> u64 {
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let ids = self.ensure(&mut s.ids, 4 * n, false);
        let part = self.ensure(&mut s.am_part, 8 * AM_PARTS * n, false);
        self.launch(self.k.argmax_part, (AM_PARTS, n), THREADS, Args::new().p(src).i(width).p(part));
        self.launch(self.k.argmax_finish, (n, 1), AM_PARTS as u32, Args::new().p(part).p(ids));
        ids
    }

    /// Queue the product of `n` rows into the logits scratch (`n × rows` values); its device address.
    fn head_logits(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, rows: usize) -> u64 {
        let dev = {
            let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            self.ensure(&mut s.logits, 4 * n * rows, false)
        };
        self.matmul_into(w, x, xq, n, dev, 0);
        dev
    }

    fn mem_from<T: Copy>(&self, host: &[T]) -> DevMem {
        let m = DevMem::new(&self.ctx, std::mem::size_of_val(host));
        self.htod(m.ptr, host);
        m
    }

    /// At least `bytes` bytes in `v` (grown after running the queued work that may use the old memory);
    /// the address. With `zeroed`, new memory is zeroed.
    fn ensure(&self, v: &mut DevVec, bytes: usize, zeroed: bool) -> u64 {
        if v.mem.as_ref().is_none_or(|m| m.bytes < bytes) {
            self.ctx.flush();
            v.mem = None;
            let m = DevMem::new(&self.ctx, bytes.next_power_of_two().max(256));
            if zeroed {
                // SAFETY: fresh memory of `m.bytes` bytes that nothing queued addresses.
                check(unsafe { result::memset_d8_async(m.ptr, 0, m.bytes, self.ctx.stream) }, "memset");
            }
            v.mem = Some(m);
        }
        v.ptr()
    }

    /// Size `xq` for `n` rows of `cols` values quantized for `w`; the kernel arguments (signs, codes, scales,
    /// sums, d·sums, half sums) of the quantization.
    fn prepare_qact(&self, xq: &mut CudaQAct, n: usize, cols: usize, w: &CudaWeights) -> [u64; 8] {
        assert_eq!(cols % QK, 0, "quantize: cols must be a multiple of 32");
        let signs = match w {
            CudaWeights::Q(q) => q.in_signs.as_ref(),
            _ => None,
        };
        if let Some((_, s)) = signs {
            assert_eq!(s.bytes, 4 * cols, "quantize: input rotation of another width");
        }
        let groups = n * cols / QK;
        let q = self.ensure(&mut xq.q, n * cols, false);
        let sc = self.ensure(&mut xq.scale, 4 * groups, false);
        let sm = self.ensure(&mut xq.sum, 4 * groups, false);
        let ds = self.ensure(&mut xq.dsum, 4 * groups, false);
        let s16 = self.ensure(&mut xq.sum16, 8 * groups, false);
        // The token-tiled copy only where an `mm_qv*` kernel may read it: past the dp4a kernels' token counts,
        // up to QV_TILED_MAX, with `mm_qv*` enabled.
        // Its tokens padded to the `mm_qv*` tile the launch takes (8, 16 or 32 tokens: a tile's rows past n are
        // read, never stored).
        xq.tg = if self.qv_enabled() && n > self.dp4a_tokens() && n <= QV_TILED_MAX {
            n.next_multiple_of(qv_tile(n).1) * (cols / QK)
        } else {
            0
        };
        let tq = if xq.tg > 0 { self.ensure(&mut xq.tiled, 52 * xq.tg, false) } else { 0 };
        xq.n = n;
        xq.cols = cols;
        xq.rotation = signs.map_or(0, |s| s.0);
        [signs.map_or(0, |s| s.1.ptr), q, sc, sm, ds, s16, tq, xq.tg as u64]
    }

    /// `out[t·rows + r]` (plus `bias[r]` when `bias` is not 0) for `t < n` into device memory at `out`.
    fn matmul_into(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, out: u64, bias: u64) {
        let (rows, cols) = (w.rows(), w.cols());
        if n == 0 || rows == 0 {
            return;
        }
        match w {
            CudaWeights::F32 { data, .. } | CudaWeights::Bf16 { data, .. } => {
                assert!(x.len >= n * cols, "matmul: x holds {} values, {n}×{cols} needed", x.len);
                let bf = matches!(w, CudaWeights::Bf16 { .. }) as usize;
                let (tile, tt) = if n == 1 { (0, 1) } else { (1, MM_TT) };
                let a = Args::new().p(data.ptr).i(rows).i(cols).p(x.ptr()).i(n).p(bias).p(out);
                self.launch(self.k.mm_f[bf][tile], (rows.div_ceil(MM_ROWS), n.div_ceil(tt)), (32 * MM_ROWS) as u32, a);
            }
            CudaWeights::Q(q) => {
                assert_eq!(cols % QK, 0, "quantized weights need cols % 32 == 0");
                assert!(xq.n >= n && xq.cols == cols, "matmul: xq holds {} tokens of {} values, {n} of {cols} needed", xq.n, xq.cols);
                let want = q.in_signs.as_ref().map_or(0, |s| s.0);
                assert_eq!(xq.rotation, want, "activations quantized for another input rotation than these weights'");
                let mins = q.mins.as_ref().map_or(0, |m| m.ptr);
                let a = Args::new()
                    .p(q.codes.ptr)
                    .p(q.scales.ptr)
                    .p(mins)
                    .i(rows)
                    .i(cols)
                    .i(q.half as usize)
                    .i(q.g16 as usize)
                    .p(xq.q.ptr())
                    .p(xq.scale.ptr())
                    .p(xq.sum.ptr())
                    .p(xq.dsum.ptr())
                    .p(xq.sum16.ptr())
                    .i(n)
                    .p(if q.out_signs.is_some() { 0 } else { bias })
                    .p(out);
                let p = if q.packed4 { 0 } else { 1 };
                if n <= self.dp4a_tokens() {
                    let (ti, tt) = Self::dp4a_tile(n);
                    let f = if self.t1_deep(n, cols) {
                        self.k.mm_qu[p]
                    } else if self.t2_deep(n, cols) {
                        self.k.mm_q2u[p]
                    } else if self.t4_deep(n, cols) {
                        self.k.mm_q4u[p]
                    } else {
                        self.k.mm_q[ti][p]
                    };
                    self.launch(f, (rows.div_ceil(MM_ROWS), n.div_ceil(tt)), (32 * MM_ROWS) as u32, a);
                } else if self.prefill_products(n) {
                    let smem = self.k.mm_qp_smem[qform(q)][p];
                    let grid = (rows.div_ceil(QP_ROWS), n.div_ceil(QP_TOKENS), 1);
                    self.launch_smem(self.k.mm_qp[qform(q)][p], grid, QP_THREADS, smem, a);
                } else if self.tiled_for(n, rows, cols) {
                    let grid = (rows.div_ceil(QT_ROWS), n.div_ceil(QT_TOKENS), 1);
                    let smem = self.k.mm_qt_smem[qform(q)][p];
                    self.launch_smem(self.k.mm_qt[qform(q)][p], grid, QT_THREADS, smem, a);
                } else if let Some((v, grid, smem)) = self.qv_res_plan(rows.div_ceil(MMA_ROWS), n, cols, qform(q), p, false, xq) {
                    self.launch_smem(self.k.mm_qvr[v][qform(q)][p], grid, 256, smem, a.p(xq.tiled.ptr()).l(xq.tg));
                } else if let Some((wi, mut grid)) = self.qv_plan(rows.div_ceil(MMA_ROWS), n, xq) {
                    let (v, _) = qv_tile(n);
                    let a = a.p(xq.tiled.ptr()).l(xq.tg);
                    let threads = (32 * QV_WARPS[wi]) as u32;
                    let fc = self.k.mm_qvc[wi][v][qform(q)][p];
                    let smem = self.k.mm_qv_smem[wi][v][qform(q)][p];
                    grid.2 = if grid.2 > 1 { self.fitting_cluster(fc, threads, smem, grid.2, true) } else { 1 };
                    let f = if grid.2 > 1 { fc } else { self.k.mm_qv[wi][v][qform(q)][p] };
                    self.launch_cluster(f, grid, threads, smem, grid.2 as u8, a);
                } else {
                    let (v, nt) = mma_tile(n);
                    let tiles = rows.div_ceil(MMA_ROWS);
                    let (si, grid) = self.mma_plan(tiles, n);
                    let (part, count) = self.mma_split_bufs(grid.2, tiles, grid.1, nt);
                    let smem = self.k.mm_qw_smem[si][v][qform(q)][p];
                    self.launch_smem(self.k.mm_qw[si][v][qform(q)][p], grid, MMA_THREADS, smem, a.p(part).p(count));
                }
                if let Some((signs, nb)) = &q.out_signs {
                    let a = Args::new().p(out).i(n).i(rows).i(*nb).p(signs.ptr);
                    self.launch_1d(self.k.rotate_out, n * nb, a);
                    if bias != 0 {
                        // The bias adds to the rotated output (add_bias's operation).
                        self.launch_1d(self.k.add_bias, n * rows, Args::new().p(out).p(bias).i(rows).l(n * rows));
                    }
                }
            }
        }
    }

    /// Attention of `t` queries into `out` ([`Backend::attention`]); with `quant`, `out` also quantized for the
    /// weights into the activations (head dims a multiple of 32).
    /// Whether an attention launch of `t` queries of shape `s` runs one block per KV head (`attention_kv`).
    fn att_per_kv(&self, s: &AttnShape, t: usize) -> bool {
        let group = s.n_heads / s.n_kv_heads;
        let fits = s.head_dim <= ATT_KV_MAX_HD && group <= ATT_KV_MAX_GROUP;
        fits && match self.forced_att_kernel.load(Ordering::Relaxed) {
            0 => t >= self.att_kv_min,
            f => f == 2,
        }
    }

    /// The cluster an attention launch of `t` queries over at most `nmax` chunks asks for (0: none): in
    /// clusters, the cluster is the (query, heads)'s whole z range (the largest the GPU holds at once).
    fn att_want_cluster(&self, t: usize, nmax: usize) -> usize {
        // One-query launches take the default clusters unless a block count is forced (an A/B of the grid).
        let clustered = self.att_cluster_all.load(Ordering::Relaxed) || (t == 1 && self.forced_att_blocks.load(Ordering::Relaxed) == 0);
        match self.att_cluster.load(Ordering::Relaxed) {
            c if c >= 2 && clustered && self.capability.0 >= 9 => c.min(nmax),
            _ => 0,
        }
    }

    /// The decode kernel for an attention launch of `t` queries of shape `s` per query head (`per_kv` false)
    /// seeing at most `keys` keys and asking for clusters of `want`, if it runs it: head dims 64 and 128, caches
    /// of `k_len`, `v_len` values (element offsets in 32 bits); one query without forced clusters or block
    /// counts on `attention_dkv` where [`Cuda::att_dkv`] says so, else on `attention_dec` in a cluster of at
    /// least 2 that fits (its chunk records meet in the first block's shared memory). `rope`: the variant with
    /// the step's RoPE and cache store. The choice depends on `keys`: a captured graph holds its launch's.
    #[allow(clippy::too_many_arguments)]
    fn att_dec_launch(
        &self,
        s: &AttnShape,
        t: usize,
        keys: usize,
        per_kv: bool,
        want: usize,
        k_len: usize,
        v_len: usize,
        rope: bool,
    ) -> Option<DecKernel> {
        let di = [64, 128].iter().position(|&d| d == s.head_dim)?;
        if per_kv || !self.att_dec.load(Ordering::Relaxed) || k_len.max(v_len) > i32::MAX as usize {
            return None;
        }
        // sm_90 only, as the cluster kernel: the one measured and tested (its compute_80 PTX would run, but no GPU
        // below 9.0 has run it).
        let free = t == 1
            && self.capability.0 >= 9
            && !self.att_cluster_all.load(Ordering::Relaxed)
            && self.forced_att_blocks.load(Ordering::Relaxed) == 0;
        let per_sm = self.att_dkv_per_sm.load(Ordering::Relaxed);
        if let Some(blocks) = split_decode_plan(self.att_dkv.load(Ordering::Relaxed), keys, per_sm, self.sms, s.n_kv_heads).filter(|_| free)
        {
            let f = if rope { self.k.attention_dkv_rope[di] } else { self.k.attention_dkv[di] };
            return Some(DecKernel::Split(f, blocks));
        }
        if want < 2 {
            return None;
        }
        let f = if rope { self.k.attention_dec_rope[di] } else { self.k.attention_dec[di] };
        let c = self.fitting_cluster(f, ATT_THREADS, 0, want, false);
        (c > 1).then_some(DecKernel::Cluster(f, c))
    }

    /// `attention_kvc` and its cluster size for a launch of `t` queries of shape `s` per KV head (`per_kv`) over
    /// key lists of at most `nmax` chunks, if it runs it: head dims 64 and 128, sm_90, caches of at most `cache`
    /// values (element offsets in 32 bits), clusters not turned off, a cluster of at least 2 that fits with its
    /// records in shared memory. The default size is [`Cuda::att_kvc`]'s, capped at what fills the GPU's
    /// multiprocessors about once at two blocks each (as [`att_chunk_blocks`]; a function of the launch's shape,
    /// so a captured graph replays it): 8 for 16 queries of 2 KV heads on 132 multiprocessors, 3 for 64.
    /// Returns the kernel, the cluster, its dynamic shared memory.
    /// With `shared` (`attention_kvs` takes the committed chunks), the cluster is capped at the tail's most
    /// chunks, ⌈(63 + t) / 64⌉ (the last committed rows and a path of at most `t` keys).
    fn att_kvc_launch(&self, s: &AttnShape, t: usize, per_kv: bool, nmax: usize, cache: usize, shared: bool) -> Option<(Func, usize, u32)> {
        let (hd, group) = (s.head_dim, s.n_heads / s.n_kv_heads);
        let di = [64, 128].iter().position(|&d| d == hd)?;
        let kvc = self.att_kvc.load(Ordering::Relaxed);
        if !per_kv || kvc < 2 || self.capability.0 < 9 || cache > i32::MAX as usize {
            return None;
        }
        let want = if self.att_cluster_all.load(Ordering::Relaxed) {
            self.att_cluster.load(Ordering::Relaxed)
        } else if self.forced_att_blocks.load(Ordering::Relaxed) == 0 {
            let tail = if shared { (ATT_CHUNK - 1 + t).div_ceil(ATT_CHUNK).max(2) } else { usize::MAX };
            kvc.min(att_chunk_blocks(s.n_kv_heads, t, nmax, 2 * self.sms).max(2)).min(tail)
        } else {
            0
        }
        .min(nmax);
        if want < 2 {
            return None;
        }
        let f = self.k.attention_kvc[di];
        // The records' shared memory grows with the cluster: each size asks for its own.
        let mut c = want;
        while c >= 2 {
            let smem = att_kvc_smem(group, hd, c) as u32;
            if self.fitting_cluster(f, ATT_THREADS, smem, c, false) == c {
                return Some((f, c, smem));
            }
            c -= 1;
        }
        None
    }

    /// Whether a launch of `t` queries of shape `s` seeing `vis`, whose first query sees `committed` cache rows,
    /// computes its whole committed chunks once for all queries (`attention_kvs`): every query sees the first
    /// query's committed rows (a tree, a block, or causal queries; no sliding window), at least one whole chunk
    /// of them, 2 queries or more, head dims 64 and 128 where the device grants the kernel's shared memory,
    /// sm_90 with `attention_kvc` on, no kernel, block count or per-query-head launch forced, and no forced
    /// clusters below 2 (`attention_kvc` takes the rest); by default only where it pays (at least
    /// [`ATT_KVS_MIN_QUERIES`] queries, [`ATT_KVS_MIN_COMMITTED`] committed rows and [`ATT_KVS_MIN_PAIRS`] of both).
    fn att_kvs_use(&self, s: &AttnShape, t: usize, vis: Visibility, committed: usize) -> bool {
        let same_rows = matches!(vis, Visibility::Tree { .. } | Visibility::Block { .. } | Visibility::Causal) && s.window.is_none();
        let fits = [64, 128].iter().position(|&d| d == s.head_dim).is_some_and(|di| self.kvs_fits[di]);
        let pays = t >= ATT_KVS_MIN_QUERIES && committed >= ATT_KVS_MIN_COMMITTED && t * committed >= ATT_KVS_MIN_PAIRS;
        let mode = self.att_kvs.load(Ordering::Relaxed);
        same_rows
            && fits
            && t >= 2
            && committed >= ATT_CHUNK
            && s.n_heads / s.n_kv_heads <= ATT_KV_MAX_GROUP
            && self.capability.0 >= 9
            && (mode == 2 || (mode == 1 && pays))
            && self.att_kvc.load(Ordering::Relaxed) >= 2
            && self.forced_att_kernel.load(Ordering::Relaxed) != 1
            && self.forced_att_blocks.load(Ordering::Relaxed) == 0
            && !(self.att_cluster_all.load(Ordering::Relaxed) && self.att_cluster.load(Ordering::Relaxed) < 2)
    }

    /// `rope`: the launch is a decode step's with its RoPE and cache store (`Backend::rope_store_attention_quantize`;
    /// `a.k`, `a.v` the caches, the decode kernel chosen by the caller).
    fn attention_into(
        &self,
        a: Attend<'_, CudaBuf>,
        out: &mut CudaBuf,
        quant: Option<(&CudaWeights, &mut CudaQAct)>,
        rope: Option<RopeIn>,
    ) {
        let Attend { shape, q, k, v, n_past, t, vis } = a;
        let s = &shape;
        let qd = s.n_heads * s.head_dim;
        assert!(q.len >= t * qd && out.len >= t * qd, "attention: q/out too short");
        assert!(s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads), "attention: heads must be a multiple of kv heads");
        assert!(
            s.head_dim.is_multiple_of(16) && s.head_dim <= ATT_MAX_HD,
            "attention: head_dim {} (a multiple of 16 up to {ATT_MAX_HD})",
            s.head_dim
        );
        if t == 0 {
            return;
        }
        self.ctx.bind();
        // Prefill runs: the tensor-core kernel (no batch invariance owed above INVARIANT_TOKENS queries).
        let fa = [64, 128, 256].iter().position(|&d| d == s.head_dim).filter(|&i| self.k.attention_mma_smem[i] > 0);
        if let (Some(fi), Visibility::Causal) = (fa, vis) {
            let pv = self.prefill_fa.load(Ordering::Relaxed);
            if t > INVARIANT_TOKENS && pv > 0 {
                let kvd = s.n_kv_heads * s.head_dim;
                assert!(
                    k.len >= (n_past + t) * kvd && v.len >= (n_past + t) * kvd,
                    "attention: the cache holds fewer rows than the queries see"
                );
                let a = Args::new()
                    .p(q.ptr())
                    .p(k.ptr())
                    .p(v.ptr())
                    .p(out.ptr())
                    .i(t)
                    .i(n_past)
                    .i(s.n_heads)
                    .i(s.n_kv_heads)
                    .f(s.scale)
                    .f(s.softcap.unwrap_or(0.0))
                    .i(s.window.unwrap_or(0));
                let grid = (t.div_ceil(FA_QUERIES), s.n_heads, 1);
                let f = self.k.attention_mma[(pv == 3) as usize][fi];
                self.launch_smem(f, grid, FA_THREADS, self.k.attention_mma_smem[fi], a);
                if let Some((w, xq)) = quant {
                    self.quantize(out, t, qd, w, xq);
                }
                return;
            }
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        let (mut info, mut paths) = (std::mem::take(&mut sc.info_host), std::mem::take(&mut sc.paths_host));
        let maxk = Cuda::key_lists(s, n_past, t, vis, &mut info, &mut paths);
        let shared = self.att_kvs_use(s, t, vis, (info[1] - info[0]) as usize);
        let kvd = s.n_kv_heads * s.head_dim;
        let rows_needed = info.chunks_exact(4).map(|c| c[1] as usize).chain(paths.iter().map(|&r| r as usize + 1)).max().unwrap_or(0);
        assert!(k.len >= rows_needed * kvd && v.len >= rows_needed * kvd, "attention: the cache holds fewer rows than the queries see");
        let nmax = att_chunks(k.len, kvd, maxk);
        let part = self.ensure(&mut sc.att_part, 4 * t * s.n_heads * nmax * (s.head_dim + 2), false);
        let count = self.ensure(&mut sc.att_count, 4 * t * s.n_heads, true);
        // The output's quantization (signs, codes, scales, sums, d·sums, half sums; codes 0: none).
        let qa = match quant {
            Some((w, xq)) => self.prepare_qact(xq, t, qd, w),
            None => [0; 8],
        };
        // Staged after the `ensure`s (which may flush the queue and so reuse the arena).
        let info_dev = self.stage(SLOT_INFO, &info);
        let paths_dev = self.stage(SLOT_PATHS, &paths);
        let rope_pos = rope.map(|r| self.stage(SLOT_POS, &[r.pos]));
        sc.info_host = info;
        sc.paths_host = paths;
        let a = Args::new()
            .p(q.ptr())
            .p(k.ptr())
            .p(v.ptr())
            .p(out.ptr())
            .p(info_dev)
            .p(paths_dev)
            .p(part)
            .p(count)
            .i(nmax)
            .i(s.n_heads)
            .i(s.n_kv_heads)
            .i(s.head_dim)
            .f(s.scale)
            .f(s.softcap.unwrap_or(0.0))
            .p(qa[0])
            .p(qa[1])
            .p(qa[2])
            .p(qa[3])
            .p(qa[4])
            .p(qa[5])
            .p(qa[6])
            .l(qa[7] as usize);
        let a = match (rope, rope_pos) {
            (Some(r), Some(pos)) => a.p(r.k).p(r.v).p(k.ptr()).p(v.ptr()).p(pos).p(r.tab).i(r.half).i(r.neox as usize),
            _ => a,
        };
        // One block per KV head and query from `att_kv_min` queries on (prefill, verify), where the shapes fit.
        let group = s.n_heads / s.n_kv_heads;
        let per_kv = shared || self.att_per_kv(s, t);
        let heads = if per_kv { s.n_kv_heads } else { s.n_heads };
        let kv_smem = att_kv_smem(group, s.head_dim) as u32;
        let per_sm = if per_kv {
            match sc.att_kv_occupancy {
                Some((b, n)) if b == kv_smem => n,
                _ => {
                    // A shape the device refused here would fail its launch below with the driver's message.
                    let n = occupancy(self.k.attention_kv, ATT_THREADS, kv_smem).unwrap_or(1);
                    sc.att_kv_occupancy = Some((kv_smem, n));
                    n
                }
            }
        } else {
            self.att_occupancy
        };
        let f = if per_kv { self.k.attention_kv } else { self.k.attention };
        let smem = if per_kv { kv_smem } else { 0 };
        let want = self.att_want_cluster(t, nmax);
        // Launches per query head in clusters (decode steps; with EDDY_CUDA_ATT_CLUSTER, launches below
        // `att_kv_min` queries too) on the decode kernel where it runs them.
        let dec = match rope {
            Some(r) => Some(r.launch),
            None => self.att_dec_launch(s, t, maxk, per_kv, want, k.len, v.len, false),
        };
        let kvc = if dec.is_none() { self.att_kvc_launch(s, t, per_kv, nmax, k.len.max(v.len), shared) } else { None };
        // A verify's whole committed chunks, once for all its queries, before `attention_kvc` takes the rest
        // (it reads their records from `part`; `shared` tells it from where its chunks start).
        let shared = shared && kvc.is_some();
        if shared {
            let di = usize::from(s.head_dim == 128);
            let rows = self.att_kvs_rows.load(Ordering::Relaxed);
            let splits = (t * group).div_ceil((ATT_THREADS as usize / 32) * rows);
            let zs = (2 * self.sms).div_ceil(s.n_kv_heads * splits).clamp(1, nmax);
            let ka = Args::new()
                .p(q.ptr())
                .p(k.ptr())
                .p(v.ptr())
                .p(info_dev)
                .p(part)
                .i(nmax)
                .i(t)
                .i(s.n_heads)
                .i(s.n_kv_heads)
                .f(s.scale)
                .f(s.softcap.unwrap_or(0.0));
            self.att_kvs_launches.fetch_add(1, Ordering::Relaxed);
            self.launch_smem(self.k.attention_kvs[di], (s.n_kv_heads, zs, splits), ATT_THREADS, att_kvs_smem(s.head_dim) as u32, ka);
        }
        if dec.is_some() {
            self.att_dec_launches.fetch_add(1, Ordering::Relaxed);
            self.rope_att_launches.fetch_add(rope.is_some() as u64, Ordering::Relaxed);
        }
        if let Some(DecKernel::Split(fd, blocks)) = dec {
            self.att_dkv_launches.fetch_add(1, Ordering::Relaxed);
            self.launch_cluster(fd, (blocks, s.n_kv_heads, 1), ATT_THREADS, 0, 1, a);
            return;
        }
        let (f, cluster, smem) = match (dec, kvc) {
            (Some(DecKernel::Cluster(fd, c)), _) => (fd, c, smem),
            (None, Some((fk, c, kb))) => {
                self.att_kvc_launches.fetch_add(1, Ordering::Relaxed);
                (fk, c, kb)
            }
            _ if want >= 2 => (f, self.fitting_cluster(f, ATT_THREADS, smem, want, false), smem),
            _ => (f, 1, smem),
        };
        let z = match self.forced_att_blocks.load(Ordering::Relaxed) {
            _ if cluster > 1 => cluster,
            0 => att_chunk_blocks(heads, t, nmax, per_sm * self.sms),
            f => f.min(nmax),
        };
        // `attention_kvc` takes whether `attention_kvs` ran.
        let a = if dec.is_none() && kvc.is_some() { a.i(usize::from(shared)) } else { a };
        self.launch_cluster(f, (heads, t, z), ATT_THREADS, smem, cluster as u8, a);
    }

    /// The key lists of `t` queries (see the attention kernel): per query `(lo, hi, path offset, path
    /// length)` into `info`, path rows into `paths`; returns the most keys a query sees.
    fn key_lists(s: &AttnShape, n_past: usize, t: usize, vis: Visibility, info: &mut Vec<i32>, paths: &mut Vec<i32>) -> usize {
        info.clear();
        paths.clear();
        let lo_of = |pos: usize| s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut maxk = 0;
        for i in 0..t {
            let (lo, hi, off) = match vis {
                Visibility::Causal => {
                    let pos = n_past + i;
                    (lo_of(pos), pos + 1, paths.len())
                }
                Visibility::Block { rows } => (lo_of(rows.saturating_sub(1)), rows, paths.len()),
                Visibility::Tree { first, paths: tree } => {
                    let path = tree.path(first + i);
                    let pos = n_past + path.len().saturating_sub(1);
                    let lo = lo_of(pos);
                    let off = paths.len();
                    for (d, &node) in path.iter().enumerate() {
                        if n_past + d >= lo {
                            paths.push((n_past + node as usize) as i32);
                        }
                    }
                    (lo.min(n_past), n_past, off)
                }
            };
            let np = paths.len() - off;
            info.extend([lo as i32, hi as i32, off as i32, np as i32]);
            maxk = maxk.max(hi - lo + np);
        }
        maxk
    }
}

/// Chunks of the longest key list a cache of `k_len` values (`kvd` a row) can give, at least `maxk` keys: an
/// attention launch's fixed grid for every step of one shape (the blocks past a query's keys exit at once).
fn att_chunks(k_len: usize, kvd: usize, maxk: usize) -> usize {
    (k_len / kvd).max(maxk).div_ceil(ATT_CHUNK).max(1)
}

/// A decode step's RoPE and K/V cache store taken into its attention (`attention_dec_rope_hd*`): device
/// addresses of the products' unrotated `k` row and its `v` row (`n_kv_heads·head_dim` f32 each), the query's
/// position, the layer's (cos, sin) table ([`Cuda::rope_table`]) and rotated pairs, the pair layout, and the
/// decode kernel chosen for the launch.
#[derive(Clone, Copy)]
struct RopeIn {
    k: u64,
    v: u64,
    pos: i32,
    tab: u64,
    half: usize,
    neox: bool,
    launch: DecKernel,
}

/// The decode attention kernel a one-query launch (or, with forced clusters, a launch per query head) runs.
#[derive(Clone, Copy)]
enum DecKernel {
    /// `attention_dec[_rope]_hd*` in clusters of this many blocks per query head.
    Cluster(Func, usize),
    /// `attention_dkv[_rope]_hd*` on this many blocks per KV head (grid (blocks, KV heads)).
    Split(Func, usize),
}

/// Fewest positions of a RoPE table ([`Cuda::rope_table`]).
const ROPE_TABLE_MIN: usize = 1024;

/// A RoPE (cos, sin) table on the device: its frequency list, the positions it covers, its memory.
struct RopeTable {
    freq: Vec<f32>,
    positions: usize,
    mem: DevMem,
}

impl Drop for Cuda {
    /// Waits for queued work and destroys the stream (the primary context stays retained: buffers may
    /// outlive the backend and free their memory in it).
    fn drop(&mut self) {
        self.synchronize();
        let (graphs, arena) = {
            let mut q = self.ctx.queue();
            (q.plan.drain(), std::mem::take(&mut q.arena_dev))
        };
        if arena != 0 {
            // SAFETY: allocated by `Queue::stage`; the queue is empty and its work done.
            let _ = unsafe { result::free_sync(arena) };
        }
        // SAFETY: the graphs' work is done (synchronized); our stream, on which nothing is queued after this
        // (buffers outliving the backend flush an empty queue).
        unsafe {
            for g in graphs {
                let _ = result::graph::exec_destroy(g.0);
            }
            let _ = result::stream::destroy(self.ctx.stream);
        }
    }
}

/// Whether two quantized matrices share the layout one product launch needs (width, code packing, scale and
/// offset forms, input rotation).
fn form(q: &CudaQ) -> Form {
    Form {
        cols: q.cols,
        packed4: q.packed4,
        g16: q.g16,
        half: q.half,
        explicit: q.mins.is_some(),
        rotation: q.in_signs.as_ref().map_or(0, |s| s.0),
    }
}

/// Upload of a host weight matrix into the device layout.
fn upload_matrix(be: &Cuda, w: &WeightMatrix) -> CudaWeights {
    match w {
        WeightMatrix::F32 { rows, cols, data, rotation } => {
            // Only `models::quantize::rotate_model` makes them (a check of the rotation on the CPU).
            assert!(rotation.input.is_none() && rotation.output.is_none(), "rotated f32 weights run on the CPU only");
            CudaWeights::F32 { rows: *rows, cols: *cols, data: be.mem_from(&data[..rows * cols]) }
        }
        WeightMatrix::Bf16 { rows, cols, data } => CudaWeights::Bf16 { rows: *rows, cols: *cols, data: be.mem_from(&data[..rows * cols]) },
        WeightMatrix::Q(m) => {
            let g = GpuQ::from_qmatrix(m);
            let out_signs = m.rotation.output.as_ref().map(|s| (be.mem_from(&s.v), blocks(m.rows).count()));
            CudaWeights::Q(CudaQ {
                rows: g.rows,
                cols: g.cols,
                half: g.half(),
                packed4: g.packed4,
                g16: g.g16,
                codes: be.mem_from(&g.codes),
                scales: be.mem_from(&g.scales),
                mins: g.mins.as_ref().map(|v| be.mem_from(v)),
                in_signs: m.rotation.input.as_ref().map(|s| (s.id, be.mem_from(&s.v))),
                out_signs,
            })
        }
    }
}

impl Backend for Cuda {
    type Buf = CudaBuf;
    type Weights = CudaWeights;
    type QAct = CudaQAct;

    fn has_gdn(&self) -> bool {
        false
    }

    fn passes_to_steady_state(&self) -> usize {
        // Eager, captured, replayed ([`GraphPlan::decide`]); with graphs off every pass runs eagerly.
        if self.ctx.queue().plan.captures() {
            3
        } else {
            1
        }
    }

    fn invariant_tokens(&self) -> usize {
        INVARIANT_TOKENS
    }

    fn prefill_tokens(&self) -> usize {
        PREFILL_TOKENS
    }

    fn reduces_on_device(&self) -> bool {
        true
    }

    fn alloc(&self, len: usize) -> CudaBuf {
        let mem = DevMem::new(&self.ctx, 4 * len);
        if len > 0 {
            // SAFETY: `mem` holds 4·len bytes; fresh memory that nothing queued addresses.
            check(unsafe { result::memset_d8_async(mem.ptr, 0, 4 * len, self.ctx.stream) }, "memset");
        }
        CudaBuf { mem, len }
    }

    fn upload(&self, host: &[f32]) -> CudaBuf {
        CudaBuf { mem: self.mem_from(host), len: host.len() }
    }

    fn upload_weights(&self, w: WeightMatrix) -> CudaWeights {
        upload_matrix(self, &w)
    }

    fn new_qact(&self) -> CudaQAct {
        CudaQAct::default()
    }

    fn embed(&self, table: &CudaWeights, tokens: &[u32], scale: Option<f32>, x: &mut CudaBuf) {
        self.embed_from(table, tokens, scale, x, None);
    }

    fn runs_ahead(&self) -> bool {
        self.run_ahead.load(Ordering::Relaxed)
    }

    fn matmul_argmax_ahead(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, rows: usize) {
        assert_eq!(rows, w.rows(), "matmul_argmax_ahead: {rows} rows for a matrix of {}", w.rows());
        self.ctx.bind();
        let dev = self.head_logits(w, x, xq, 1, rows);
        let ids = self.argmax_queue(dev, 1, rows);
        // The pass goes to the GPU; its id lands in a page-locked slot, with an event after it.
        self.ctx.flush();
        let mut g = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let a = g.get_or_insert_with(Ahead::new);
        assert!(a.len < AHEAD_IN_FLIGHT, "matmul_argmax_ahead: {AHEAD_IN_FLIGHT} ids already untaken");
        let slot = (a.first + a.len) % AHEAD_IN_FLIGHT;
        self.queued.fetch_add(1, Ordering::Relaxed);
        // SAFETY: slot `slot` of the page-locked ids (untaken slots are not reused), one u32 from `ids`; the event
        // orders its read after the copy.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(a.ids.add(slot), 1);
            check(result::memcpy_dtoh_async(dst, ids, self.ctx.stream), "device-to-host copy");
            check(result::event::record(a.events[slot], self.ctx.stream), "event record");
        }
        a.len += 1;
    }

    fn embed_ahead(&self, table: &CudaWeights, token: Option<u32>, scale: Option<f32>, x: &mut CudaBuf) {
        self.ctx.bind();
        let ids = {
            let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            self.ensure(&mut s.ids, 4, false)
        };
        if token.is_none() {
            let pending = self.ahead.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|a| a.len > 0);
            assert!(pending, "embed_ahead: no run-ahead argmax is untaken to continue from");
        }
        if let Some(t) = token {
            assert!((t as usize) < table.rows(), "embed: token id outside the table of {} rows", table.rows());
            // A known token goes where an argmax would have left it, in stream order before the pass, so
            // that both inputs queue the same list (one graph).
            self.ctx.flush();
            self.htod(ids, &[t]);
        }
        self.embed_from(table, &[0], scale, x, Some(ids));
    }

    fn take_ahead_id(&self) -> Option<u32> {
        let mut g = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let a = g.as_mut().filter(|a| a.len > 0)?;
        // SAFETY: the slot's copy was recorded before its event; waiting for the event makes it visible.
        let id = unsafe {
            check(result::event::synchronize(a.events[a.first]), "event wait");
            a.ids.add(a.first).read_volatile()
        };
        a.first = (a.first + 1) % AHEAD_IN_FLIGHT;
        a.len -= 1;
        Some(id)
    }

    fn quantize(&self, x: &CudaBuf, n: usize, cols: usize, w: &CudaWeights, xq: &mut CudaQAct) {
        assert!(x.len >= n * cols, "quantize: x holds {} values, {n}×{cols} needed", x.len);
        self.ctx.bind();
        let [signs, q, sc, sm, ds, s16, tq, tg] = self.prepare_qact(xq, n, cols, w);
        let a = Args::new().p(x.ptr()).i(n).i(cols).p(signs).p(q).p(sc).p(sm).p(ds).p(s16).p(tq).l(tg as usize);
        self.launch(self.k.quantize, ((n * cols / QK).div_ceil((THREADS / 32) as usize), 1), THREADS, a);
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_quantize(
        &self,
        x: &mut CudaBuf,
        residual: Option<&CudaBuf>,
        n: usize,
        d: usize,
        w: &CudaBuf,
        eps: f32,
        h: &mut CudaBuf,
        qw: &CudaWeights,
        xq: &mut CudaQAct,
    ) {
        assert!(w.len == d && x.len >= n * d && h.len >= n * d, "rms_norm_quantize: buffers too short");
        assert!(residual.is_none_or(|r| r.len >= n * d), "rms_norm_quantize: residual too short");
        if n == 0 {
            return;
        }
        self.ctx.bind();
        let [signs, q, sc, sm, ds, s16, tq, tg] = self.prepare_qact(xq, n, d, qw);
        let a = Args::new()
            .p(x.ptr())
            .p(residual.map_or(0, |r| r.ptr()))
            .p(h.ptr())
            .p(w.ptr())
            .i(d)
            .f(eps)
            .p(signs)
            .p(q)
            .p(sc)
            .p(sm)
            .p(ds)
            .p(s16)
            .p(tq)
            .l(tg as usize);
        // Rows of at most one or two groups a warp on the kernels of that many (the same operations).
        let threads = norm_threads(d);
        let per_warp = d.div_ceil(32).div_ceil(threads as usize / 32);
        let f = match per_warp {
            1 | 2 if self.norm_fit.load(Ordering::Relaxed) => {
                self.norm_fit_launches.fetch_add(1, Ordering::Relaxed);
                self.k.rms_norm_quant_k[per_warp - 1]
            }
            _ => self.k.rms_norm_quant,
        };
        self.launch(f, (n, 1), threads, a);
    }

    #[allow(clippy::too_many_arguments)]
    fn gated_act_quantize(
        &self,
        act: Activation,
        gate: &mut CudaBuf,
        up: &CudaBuf,
        n: usize,
        width: usize,
        w: &CudaWeights,
        xq: &mut CudaQAct,
    ) {
        assert!(gate.len >= n * width && up.len >= n * width, "gated_act_quantize: buffers too short");
        self.ctx.bind();
        let [signs, q, sc, sm, ds, s16, tq, tg] = self.prepare_qact(xq, n, width, w);
        let act = match act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        };
        let a = Args::new().i(act).p(gate.ptr()).p(up.ptr()).i(n).i(width).p(signs).p(q).p(sc).p(sm).p(ds).p(s16).p(tq).l(tg as usize);
        self.launch(self.k.gated_act_quant, ((n * width / QK).div_ceil((THREADS / 32) as usize), 1), THREADS, a);
    }

    #[allow(clippy::type_complexity)]
    fn matmul_parts(&self, parts: &mut [(&CudaWeights, Option<&CudaBuf>, &mut CudaBuf)], x: &CudaBuf, xq: &CudaQAct, n: usize) {
        // One launch when the parts are 2 or 3 quantized matrices without an output rotation whose forms the
        // kernel for `n` tokens can run together (`one_launch`); else two of three that can in one and the third
        // alone, or one product per part.
        let qs: Vec<&CudaQ> = parts
            .iter()
            .filter_map(|(w, _, _)| match w {
                CudaWeights::Q(q) if q.out_signs.is_none() => Some(q),
                _ => None,
            })
            .collect();
        let forms: Vec<Form> = qs.iter().map(|q| form(q)).collect();
        let dp4a = n <= self.dp4a_tokens();
        let joint = self.joint.load(Ordering::Relaxed);
        let mixed_tokens = self.mixed_packing_tokens();
        if qs.len() != parts.len() || !one_launch(&forms, n, dp4a, joint, mixed_tokens) {
            // Three parts that cannot share a launch: two of them that can in one (a verify's q and k beside a
            // v of another code width), the third alone.
            let pair = |i: usize, j: usize| one_launch(&[forms[i], forms[j]], n, dp4a, joint, mixed_tokens);
            let pairing = self.pair_parts.load(Ordering::Relaxed) && qs.len() == 3;
            if let ([a, b, c], true) = (&mut *parts, pairing) {
                if let Some((i, j)) = [(0, 1), (0, 2), (1, 2)].into_iter().find(|&(i, j)| pair(i, j)) {
                    // The pair in one launch, the third alone (the launches write disjoint outputs).
                    let (p, q, r) = match (i, j) {
                        (0, 1) => (a, b, c),
                        (0, _) => (a, c, b),
                        _ => (b, c, a),
                    };
                    self.matmul_parts(&mut [(p.0, p.1, &mut *p.2), (q.0, q.1, &mut *q.2)], x, xq, n);
                    self.matmul_bias(r.0, x, xq, n, r.1, r.2);
                    return;
                }
            }
            for (w, bias, out) in parts.iter_mut() {
                self.matmul_bias(w, x, xq, n, *bias, out);
            }
            return;
        }
        let q0 = qs[0];
        assert_eq!(q0.cols % QK, 0, "quantized weights need cols % 32 == 0");
        assert!(xq.n >= n && xq.cols == q0.cols, "matmul: xq holds {} tokens of {} values, {n} of {} needed", xq.n, xq.cols, q0.cols);
        assert_eq!(
            xq.rotation,
            q0.in_signs.as_ref().map_or(0, |s| s.0),
            "activations quantized for another input rotation than these weights'"
        );
        self.ctx.bind();
        // Per part p: its `half` in bits 8p.., its group-16 flag in bit p, its code packing in bit 4 + p (read
        // by the kernels that take parts of different forms; the others' forms agree in the rest).
        let half = qs.iter().enumerate().fold(0, |h, (i, q)| h | (q.half as usize) << (8 * i));
        let flags = qs.iter().enumerate().fold(0, |f, (i, q)| f | (q.g16 as usize) << i | (q.packed4 as usize) << (4 + i));
        let mixed_packing = qs.iter().any(|q| q.packed4 != q0.packed4);
        let mut a =
            Args::new().i(q0.cols).i(half).i(flags).p(xq.q.ptr()).p(xq.scale.ptr()).p(xq.sum.ptr()).p(xq.dsum.ptr()).p(xq.sum16.ptr()).i(n);
        let mut blocks = 0;
        let all_rows: usize = qs.iter().map(|q| q.rows).sum();
        let prefill = self.prefill_products(n);
        let tiled = !dp4a && !prefill && self.tiled_for(n, all_rows, q0.cols);
        let tile_rows = if dp4a {
            MM_ROWS
        } else if prefill {
            QP_ROWS
        } else if tiled {
            QT_ROWS
        } else {
            MMA_ROWS
        };
        for (q, (_, bias, out)) in qs.iter().zip(parts.iter()) {
            assert!(out.len >= n * q.rows, "matmul: out holds {} values, {n}×{} needed", out.len, q.rows);
            assert!(bias.is_none_or(|b| b.len == q.rows), "matmul_bias: the bias must hold one value per row");
            blocks += q.rows.div_ceil(tile_rows);
            a = a
                .p(q.codes.ptr)
                .p(q.scales.ptr)
                .p(q.mins.as_ref().map_or(0, |m| m.ptr))
                .i(q.rows)
                .p(bias.map_or(0, |b| b.ptr()))
                .p(out.ptr());
        }
        for _ in qs.len()..3 {
            a = a.p(0).p(0).p(0).i(0).p(0).p(0);
        }
        let p = if q0.packed4 { 0 } else { 1 };
        if dp4a {
            let (ti, tt) = Self::dp4a_tile(n);
            let deep = self.t1_deep(n, q0.cols);
            let f = match (mixed_packing, deep) {
                (true, _) => match n {
                    1 => self.k.mm_q3x[deep as usize],
                    2 => self.k.mm_q3x[2],
                    3 | 4 => self.k.mm_q3x[3],
                    _ => unreachable!("parts of different code packings share launches of at most 4 tokens (one_launch)"),
                },
                (false, true) => self.k.mm_q3u[p],
                (false, false) => self.k.mm_q3[ti][p],
            };
            self.launch(f, (blocks, n.div_ceil(tt)), (32 * MM_ROWS) as u32, a);
        } else if prefill {
            let smem = self.k.mm_qp_smem[qform(q0)][p];
            self.launch_smem(self.k.mm_q3p[qform(q0)][p], (blocks, n.div_ceil(QP_TOKENS), 1), QP_THREADS, smem, a);
        } else if tiled {
            let smem = self.k.mm_qt_smem[qform(q0)][p];
            self.launch_smem(self.k.mm_q3t[qform(q0)][p], (blocks, n.div_ceil(QT_TOKENS), 1), QT_THREADS, smem, a);
        } else if let Some((v, grid, smem)) = self.qv_res_plan(blocks, n, q0.cols, qform(q0), p, true, xq) {
            self.launch_smem(self.k.mm_q3vr[v][qform(q0)][p], grid, 256, smem, a.p(xq.tiled.ptr()).l(xq.tg));
        } else if let Some((wi, mut grid)) = self.qv_plan(blocks, n, xq) {
            let (v, _) = qv_tile(n);
            let a = a.p(xq.tiled.ptr()).l(xq.tg);
            let threads = (32 * QV_WARPS[wi]) as u32;
            let fc = self.k.mm_q3vc[wi][v][qform(q0)][p];
            let smem = self.k.mm_qv_smem[wi][v][qform(q0)][p];
            grid.2 = if grid.2 > 1 { self.fitting_cluster(fc, threads, smem, grid.2, true) } else { 1 };
            let f = if grid.2 > 1 { fc } else { self.k.mm_q3v[wi][v][qform(q0)][p] };
            self.launch_cluster(f, grid, threads, smem, grid.2 as u8, a);
        } else {
            let (v, nt) = mma_tile(n);
            let (si, grid) = self.mma_plan(blocks, n);
            let (part, count) = self.mma_split_bufs(grid.2, blocks, grid.1, nt);
            let smem = self.k.mm_qw_smem[si][v][qform(q0)][p];
            self.launch_smem(self.k.mm_q3w[si][v][qform(q0)][p], grid, MMA_THREADS, smem, a.p(part).p(count));
        }
    }

    fn matmul_bias(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, bias: Option<&CudaBuf>, out: &mut CudaBuf) {
        assert!(out.len >= n * w.rows(), "matmul: out holds {} values, {n}×{} needed", out.len, w.rows());
        assert!(bias.is_none_or(|b| b.len == w.rows()), "matmul_bias: the bias must hold one value per row");
        self.ctx.bind();
        self.matmul_into(w, x, xq, n, out.ptr(), bias.map_or(0, |b| b.ptr()));
    }

    fn matmul(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, out: &mut CudaBuf) {
        assert!(out.len >= n * w.rows(), "matmul: out holds {} values, {n}×{} needed", out.len, w.rows());
        self.ctx.bind();
        self.matmul_into(w, x, xq, n, out.ptr(), 0);
    }

    fn matmul_to_host(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, out: &mut [f32]) {
        assert_eq!(out.len(), n * w.rows(), "matmul_to_host: out must hold n × rows values");
        self.ctx.bind();
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.ensure(&mut s.logits, 4 * out.len(), false);
        self.matmul_into(w, x, xq, n, dev, 0);
        if s.pinned.as_ref().is_none_or(|p| p.len < out.len()) {
            s.pinned = None;
            let len = out.len().next_power_of_two();
            // SAFETY: a page-locked host allocation in the bound context.
            let ptr = check(unsafe { result::malloc_host(4 * len, 0) }, "page-locked allocation") as *mut f32;
            s.pinned = Some(Pinned { ptr, len });
        }
        let p = s.pinned.as_ref().expect("allocated above");
        // SAFETY: `p` holds `p.len >= out.len()` values and is used only here, under the scratch lock.
        let staged = unsafe { std::slice::from_raw_parts_mut(p.ptr, out.len()) };
        self.dtoh(staged, dev);
        out.copy_from_slice(staged);
    }

    fn argmax_rows(&self, x: &CudaBuf, n: usize, width: usize, out: &mut [u32]) {
        assert!(x.len >= n * width && out.len() >= n, "argmax_rows: buffers too short");
        self.ctx.bind();
        self.argmax_into(x.ptr(), n, width, &mut out[..n]);
    }

    fn matmul_argmax(&self, w: &CudaWeights, x: &CudaBuf, xq: &CudaQAct, n: usize, rows: usize, out: &mut [u32]) {
        assert!(rows == w.rows() && out.len() >= n, "matmul_argmax: {rows} rows for a matrix of {}, {} ids for {n}", w.rows(), out.len());
        self.ctx.bind();
        let dev = self.head_logits(w, x, xq, n, rows);
        self.argmax_into(dev, n, rows, &mut out[..n]);
    }

    fn candidate_rows(&self, x: &CudaBuf, n: usize, width: usize, inv_t: f32, k: usize, out: &mut Candidates) {
        assert!(x.len >= n * width, "candidate_rows: buffer too short");
        assert!((1..=MAX_CANDIDATES).contains(&k), "candidate_rows: {k} slots (1 to {MAX_CANDIDATES})");
        self.ctx.bind();
        out.reset(n, k);
        if n == 0 {
            return;
        }
        // Per row: k scaled logits (f32 bits), k ids, the finite count, 0, the mass (f64, low word first).
        let stride = 2 * k + 4;
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.ensure(&mut s.cands, 4 * n * stride, false);
        let work = self.ensure(&mut s.cand_work, 8 * CAND_WORK * n, false);
        let lanes = Args::new().p(x.ptr()).i(width).f(inv_t).p(work);
        self.launch(self.k.cand_lanes, (CAND_PARTS, n), THREADS, lanes);
        self.launch(self.k.cand_select, (n, 1), 1024, Args::new().i(k).p(work));
        self.launch(self.k.cand_gather, (CAND_PARTS, n), THREADS, Args::new().p(x.ptr()).i(width).f(inv_t).p(work));
        let fin = Args::new().p(x.ptr()).i(width).f(inv_t).i(k).p(work).p(dev);
        self.launch(self.k.cand_finish, (n, 1), 1024, fin);
        let mut host = std::mem::take(&mut s.cands_host);
        host.resize(n * stride, 0);
        self.dtoh(&mut host, dev);
        for (r, rec) in host.chunks_exact(stride).enumerate() {
            let nf = rec[2 * k] as usize;
            for j in 0..k.min(nf) {
                out.top[r * k + j] = (f32::from_bits(rec[j]), rec[k + j]);
            }
            out.n_finite[r] = nf;
            out.mass[r] = f64::from_bits(rec[2 * k + 2] as u64 | (rec[2 * k + 3] as u64) << 32);
        }
        s.cands_host = host;
    }

    fn rms_norm(&self, x: &CudaBuf, row0: usize, n: usize, w: &CudaBuf, eps: f32, out: &mut CudaBuf) {
        let d = w.len;
        assert!(x.len >= (row0 + n) * d && out.len >= n * d, "rms_norm: buffers too short");
        self.ctx.bind();
        let a = Args::new().p(x.at(row0 * d)).p(out.ptr()).p(w.ptr()).i(d).f(eps).i(n);
        self.launch(self.k.rms_norm, (n, 1), norm_threads(d), a);
    }

    fn rms_norm_inplace(&self, x: &mut CudaBuf, len: usize, w: &CudaBuf, eps: f32) {
        let d = w.len;
        assert!(x.len >= len && len.is_multiple_of(d), "rms_norm_inplace: {len} values in rows of {d}");
        self.ctx.bind();
        let n = len / d;
        let a = Args::new().p(x.ptr()).p(x.ptr()).p(w.ptr()).i(d).f(eps).i(n);
        self.launch(self.k.rms_norm, (n, 1), norm_threads(d), a);
    }

    fn add_bias(&self, x: &mut CudaBuf, n: usize, b: &CudaBuf) {
        let len = n * b.len;
        assert!(x.len >= len, "add_bias: x too short");
        self.ctx.bind();
        self.launch_1d(self.k.add_bias, len, Args::new().p(x.ptr()).p(b.ptr()).i(b.len).l(len));
    }

    fn add(&self, x: &mut CudaBuf, y: &CudaBuf, len: usize) {
        assert!(x.len >= len && y.len >= len, "add: buffers too short");
        self.ctx.bind();
        self.launch_1d(self.k.add, len, Args::new().p(x.ptr()).p(y.ptr()).l(len));
    }

    fn gated_act(&self, act: Activation, gate: &mut CudaBuf, up: &CudaBuf, len: usize) {
        assert!(gate.len >= len && up.len >= len, "gated_act: buffers too short");
        self.ctx.bind();
        let a = match act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        };
        self.launch_1d(self.k.gated_act, len, Args::new().i(a).p(gate.ptr()).p(up.ptr()).l(len));
    }

    fn rope(&self, rope: &Rope, q: &mut CudaBuf, q_width: usize, k: &mut CudaBuf, k_width: usize, head_dim: usize, positions: &[usize]) {
        let n = positions.len();
        assert!(q.len >= n * q_width && k.len >= n * k_width, "rope: buffers too short");
        assert!(rope.rot_dims <= head_dim && rope.inv_freq.len() >= rope.rot_dims / 2, "rope: rotated dims exceed the head");
        let half = rope.rot_dims / 2;
        if n == 0 || half == 0 {
            return;
        }
        self.ctx.bind();
        let tab = self.rope_table(&rope.inv_freq[..half], positions.iter().copied().max().unwrap_or(0));
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        s.pos_host.clear();
        s.pos_host.extend(positions.iter().map(|&p| i32::try_from(p).expect("position exceeds i32")));
        let pos_dev = self.stage(SLOT_POS, &s.pos_host);
        let neox = (rope.mode == RopeMode::Neox) as usize;
        let a = Args::new().p(q.ptr()).i(q_width).p(k.ptr()).i(k_width).i(head_dim).i(n).p(pos_dev).p(tab).i(half).i(neox);
        self.launch_1d(self.k.rope, n * (q_width / head_dim + k_width / head_dim) * half, a);
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        rope: &Rope,
        q: &mut CudaBuf,
        q_width: usize,
        k: &mut CudaBuf,
        v: &CudaBuf,
        kv_width: usize,
        head_dim: usize,
        positions: &[usize],
        kc: &mut CudaBuf,
        vc: &mut CudaBuf,
        row0: usize,
    ) {
        let n = positions.len();
        let half = rope.rot_dims / 2;
        if half == 0 || head_dim == 0 {
            // Nothing to rotate: the plain stores.
            self.store_rows(k, n, kv_width, kc, row0);
            self.store_rows(v, n, kv_width, vc, row0);
            return;
        }
        assert!(q.len >= n * q_width && k.len >= n * kv_width && v.len >= n * kv_width, "rope_store: buffers too short");
        assert!(kc.len >= (row0 + n) * kv_width && vc.len >= (row0 + n) * kv_width, "rope_store: cache rows outside the cache");
        assert!(rope.rot_dims <= head_dim && rope.inv_freq.len() >= half, "rope: rotated dims exceed the head");
        assert!(q_width.is_multiple_of(head_dim) && kv_width.is_multiple_of(head_dim), "rope_store: widths must be whole heads");
        if n == 0 {
            return;
        }
        self.ctx.bind();
        let tab = self.rope_table(&rope.inv_freq[..half], positions.iter().copied().max().unwrap_or(0));
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        s.pos_host.clear();
        s.pos_host.extend(positions.iter().map(|&p| i32::try_from(p).expect("position exceeds i32")));
        let pos_dev = self.stage(SLOT_POS, &s.pos_host);
        let row0_dev = self.stage(SLOT_ROW0, &[i32::try_from(row0).expect("row exceeds i32")]);
        let neox = (rope.mode == RopeMode::Neox) as usize;
        let a = Args::new()
            .p(q.ptr())
            .i(q_width)
            .p(k.ptr())
            .i(kv_width)
            .i(head_dim)
            .i(n)
            .p(pos_dev)
            .p(tab)
            .i(half)
            .i(neox)
            .p(v.ptr())
            .p(kc.ptr())
            .p(vc.ptr())
            .p(row0_dev);
        let threads = n * (q_width / head_dim * half + kv_width / head_dim * (head_dim - half) + kv_width);
        self.launch_1d(self.k.rope_store, threads, a);
    }

    fn store_rows(&self, src: &CudaBuf, n: usize, width: usize, dst: &mut CudaBuf, dst_row: usize) {
        assert!(src.len >= n * width && dst.len >= (dst_row + n) * width, "store_rows: buffers too short");
        if n == 0 || width == 0 {
            return;
        }
        self.ctx.bind();
        let row0 = self.stage(SLOT_ROW0, &[i32::try_from(dst_row).expect("row exceeds i32")]);
        let a = Args::new().p(src.ptr()).l(n * width).i(width).p(dst.ptr()).p(row0);
        self.launch_1d(self.k.store_rows, n * width, a);
    }

    fn gather_rows(&self, src: &CudaBuf, from: Cols, rows: &[usize], dst: &mut CudaBuf, to: Cols, dst_row: usize) {
        let (n, w) = (rows.len(), to.width);
        assert!(from.width == w && from.col + w <= from.stride && to.col + w <= to.stride, "gather_rows: bad columns");
        assert!(rows.iter().all(|&r| src.len >= r * from.stride + from.col + w), "gather_rows: a row outside the source");
        assert!(n == 0 || dst.len >= (dst_row + n - 1) * to.stride + to.col + w, "gather_rows: rows outside the destination");
        if n == 0 || w == 0 {
            return;
        }
        self.ctx.bind();
        let at: Vec<i32> =
            std::iter::once(dst_row).chain(rows.iter().copied()).map(|v| i32::try_from(v).expect("gather_rows: row exceeds i32")).collect();
        let at = self.stage(SLOTS, &at);
        let a = Args::new().p(src.ptr()).i(from.stride).i(from.col).p(dst.ptr()).i(to.stride).i(to.col).i(n).i(w).p(at);
        self.launch_1d(self.k.gather_rows, n * w, a);
    }

    fn commit_rows(&self, buf: &mut CudaBuf, width: usize, base: usize, path: &[usize]) {
        assert!(path.iter().all(|&r| buf.len >= (base + r + 1) * width), "commit_rows: a row outside the buffer");
        if path.iter().enumerate().all(|(d, &node)| node == d) || width == 0 {
            return;
        }
        self.ctx.bind();
        // Staged [base, len, path…]: a graph of this list replays for any path and position.
        let at: Vec<i32> = [base, path.len()]
            .into_iter()
            .chain(path.iter().copied())
            .map(|v| i32::try_from(v).expect("commit_rows: row exceeds i32"))
            .collect();
        let at = self.stage(SLOTS, &at);
        self.launch_1d(self.k.commit_rows, width, Args::new().p(buf.ptr()).i(width).p(at));
    }

    fn attention(&self, a: Attend<'_, CudaBuf>, out: &mut CudaBuf) {
        self.attention_into(a, out, None, None);
    }

    fn attention_quantize(&self, a: Attend<'_, CudaBuf>, out: &mut CudaBuf, w: &CudaWeights, xq: &mut CudaQAct) {
        if a.shape.head_dim.is_multiple_of(QK) {
            self.attention_into(a, out, Some((w, xq)), None);
        } else {
            // A head's outputs are not whole quantization groups: two launches.
            self.attention_into(a, out, None, None);
            self.quantize(out, a.t, a.shape.n_heads * a.shape.head_dim, w, xq);
        }
    }

    /// A decode step (one causal query whose K/V row is the cache's next) on the decode attention takes its
    /// RoPE and cache store into that kernel (`attention_dec_rope_hd*`: one launch less a layer, the same
    /// bits; `EDDY_CUDA_ROPE_ATT=0` turns it off); anything else runs `rope_store` and `attention_quantize`.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_attention_quantize(
        &self,
        rope: &Rope,
        shape: AttnShape,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        positions: &[usize],
        kc: &mut CudaBuf,
        vc: &mut CudaBuf,
        n_past: usize,
        row0: usize,
        vis: Visibility<'_>,
        out: &mut CudaBuf,
        w: &CudaWeights,
        xq: &mut CudaQAct,
    ) {
        let (hd, half, t) = (shape.head_dim, rope.rot_dims / 2, positions.len());
        let (qd, kvd) = (shape.n_heads * hd, shape.n_kv_heads * hd);
        let step = t == 1
            && matches!(vis, Visibility::Causal)
            && shape.window != Some(0)
            && row0 == n_past
            && half > 0
            && rope.rot_dims <= hd
            && rope.inv_freq.len() >= half
            && hd.is_multiple_of(QK)
            && shape.n_kv_heads > 0
            && shape.n_heads.is_multiple_of(shape.n_kv_heads)
            && self.rope_att.load(Ordering::Relaxed);
        let launch = step
            .then(|| {
                let lo = shape.window.map_or(0, |w| (n_past + 1).saturating_sub(w));
                let nmax = att_chunks(kc.len, kvd, n_past + 1 - lo);
                let want = self.att_want_cluster(1, nmax);
                self.att_dec_launch(&shape, 1, n_past + 1 - lo, self.att_per_kv(&shape, 1), want, kc.len, vc.len, true)
            })
            .flatten();
        let Some(launch) = launch else {
            self.rope_store(rope, q, qd, k, v, kvd, hd, positions, kc, vc, row0);
            self.attention_quantize(Attend { shape, q, k: kc, v: vc, n_past, t, vis }, out, w, xq);
            return;
        };
        assert!(k.len >= kvd && v.len >= kvd, "rope_store_attention_quantize: k/v rows too short");
        assert!(kc.len >= (row0 + 1) * kvd && vc.len >= (row0 + 1) * kvd, "rope_store_attention_quantize: cache row outside the cache");
        let pos = i32::try_from(positions[0]).expect("position exceeds i32");
        let tab = self.rope_table(&rope.inv_freq[..half], positions[0]);
        let r = RopeIn { k: k.ptr(), v: v.ptr(), pos, tab, half, neox: rope.mode == RopeMode::Neox, launch };
        self.attention_into(Attend { shape, q, k: kc, v: vc, n_past, t, vis }, out, Some((w, xq)), Some(r));
    }

    fn read(&self, buf: &CudaBuf, row0: usize, n: usize, width: usize, out: &mut Vec<f32>) {
        assert!(buf.len >= (row0 + n) * width, "read: rows outside the buffer");
        self.ctx.bind();
        let start = out.len();
        out.resize(start + n * width, 0.0);
        self.dtoh(&mut out[start..], buf.at(row0 * width));
    }

    fn copy(&self, src: &CudaBuf, dst: &mut CudaBuf, len: usize) {
        assert!(src.len >= len && dst.len >= len, "copy: buffers too short");
        self.ctx.bind();
        self.dtod(dst.ptr(), src.ptr(), len);
    }

    fn write(&self, host: &[f32], dst: &mut CudaBuf) {
        assert!(dst.len >= host.len(), "write: destination too short");
        self.ctx.bind();
        // Queued work may read or write `dst`: run it first.
        self.ctx.flush();
        self.htod(dst.ptr(), host);
    }

    fn concat_rows(&self, a: &CudaBuf, b: &CudaBuf, n: usize, width: usize, out: &mut CudaBuf) {
        assert!(a.len >= n * width && b.len >= n * width && out.len >= 2 * n * width, "concat_rows: buffers too short");
        self.ctx.bind();
        self.launch_1d(self.k.concat_rows, 2 * n * width, Args::new().p(a.ptr()).p(b.ptr()).i(n).i(width).p(out.ptr()));
    }

    fn split_gate(&self, qg: &CudaBuf, n: usize, n_heads: usize, head_dim: usize, q: &mut CudaBuf, gate: &mut CudaBuf) {
        let qd = n_heads * head_dim;
        assert!(qg.len >= 2 * n * qd && q.len >= n * qd && gate.len >= n * qd, "split_gate: buffers too short");
        self.ctx.bind();
        let a = Args::new().p(qg.ptr()).i(n).i(n_heads).i(head_dim).p(q.ptr()).p(gate.ptr());
        self.launch_1d(self.k.split_gate, n * qd, a);
    }

    fn mul_sigmoid(&self, x: &mut CudaBuf, gate: &CudaBuf, len: usize) {
        assert!(x.len >= len && gate.len >= len, "mul_sigmoid: buffers too short");
        self.ctx.bind();
        self.launch_1d(self.k.mul_sigmoid, len, Args::new().p(x.ptr()).p(gate.ptr()).l(len));
    }

    fn gdn_conv(&self, _: &GdnShape, _: &CudaBuf, _: &CudaBuf, _: &CudaBuf, _: &[usize], _: &mut CudaBuf) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_prepare(&self, _: &GdnShape, _: &mut CudaBuf, _: &mut CudaBuf, _: &mut CudaBuf, _: &CudaBuf, _: &CudaBuf, _: usize) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_chunked(
        &self,
        _: &GdnShape,
        _: &mut CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: std::ops::Range<usize>,
        _: usize,
        _: &mut CudaBuf,
    ) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_tree(
        &self,
        _: &GdnShape,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &[usize],
        _: &mut CudaBuf,
        _: &mut CudaBuf,
        _: &mut CudaBuf,
    ) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_step(
        &self,
        _: &GdnShape,
        _: &mut CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &CudaBuf,
        _: &mut CudaBuf,
        _: &mut CudaBuf,
        _: &mut CudaBuf,
    ) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_commit(&self, _: &GdnShape, _: &mut CudaBuf, _: &CudaBuf, _: &CudaBuf, _: &CudaBuf, _: &[usize]) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_conv_commit(&self, _: &GdnShape, _: &mut CudaBuf, _: &CudaBuf, _: &[usize]) {
        unreachable!("{NO_GDN}")
    }

    fn gdn_gated_norm(&self, _: &mut CudaBuf, _: &CudaBuf, _: &CudaBuf, _: f32, _: usize) {
        unreachable!("{NO_GDN}")
    }
}

/// Why a Gated DeltaNet operation cannot run here (never reached: uploads refuse hybrid models).
const NO_GDN: &str = "the CUDA backend has no Gated DeltaNet kernels (Model::to_backend refuses hybrid models)";
