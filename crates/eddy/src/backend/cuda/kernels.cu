// eddy's CUDA kernels (the `cuda` feature): compiled by nvcc at build time (build.rs) into a fatbin that is
// embedded in the binary and loaded with the driver API (backend/cuda/mod.rs). docs/cuda.md describes the
// layouts and the operation order each kernel follows.
//
// Batch invariance: every output (row, token) of a product, every (query, head) of the attention and every
// row of a norm is computed by an operation sequence that depends only on that row's data and the layer's
// shape, never on the number of rows in the launch or on which block handles it. Float operations that
// matter for it use the explicit-rounding intrinsics (__fmaf_rn, __fmul_rn, __fadd_rn), so template
// instances compiled for different token tiles cannot contract differently.

#include <stdint.h>

#define FULL 0xffffffffu

// Programmatic dependent launch (docs/cuda.md, "Programmatic dependent launch"): on sm_90 the host may launch
// a kernel with the programmatic-stream-serialization attribute, so that it starts while the kernel before it
// still runs. Every kernel calls pdl_wait() before it touches memory another kernel of the pass writes or reads
// (in practice: first, except the products' weight prefetch): `griddepcontrol.wait` returns once the previous
// grid has completed and its writes are visible (at once for a launch without the attribute), so each kernel
// still sees exactly what a serialized launch would, and the chain of waits keeps the order transitive. Then
// `griddepcontrol.launch_dependents` lets the next kernel launch (its blocks are scheduled while this one
// runs). Neither changes any arithmetic. Older targets (the compute_80 PTX) compile them away.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A load issued before pdl_wait() of data no kernel writes (weights, what the pass stages): coherent (L2), because
// ptxas moves a read-only (`ld.global.nc`, a `const __restrict__` pointer's) load that the source places before
// `griddepcontrol.wait` to after it (seen in the SASS of rms_norm_quant and attention_dec), which puts its memory
// round trip back on the chain the early load was to take it off. Meant for loads before the wait: sm_90 compiles
// it to strong L2 loads (`LDG.E.*.STRONG.GPU`), and after the wait plain loads were faster where measured
// (docs/cuda.md, "Weak loads after the wait").
template <typename T>
__device__ __forceinline__ T ld_early(const T* p) {
    return __ldcg(p);
}

// Thread-block clusters (sm_90; docs/cuda.md): a launch with a cluster dimension groups consecutive blocks along z
// (Op::Kernel's `cluster`). Without one, or on older targets, a block is a cluster of one.
// This block's rank in its cluster, and the cluster's size into `size`.
__device__ __forceinline__ unsigned int cluster_rank_and_size(unsigned int& size) {
    unsigned int r = 0;
    size = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(size));
#endif
    return r;
}
// The cluster barrier in its two halves: arrive (release: this thread's earlier writes, global and shared, are
// visible to any thread of the cluster that then waits) and wait (acquire). Every thread of the block takes both
// (the .aligned forms); a thread may exit after arriving, and exited threads do not hold the barrier up.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
// The arrive without release semantics (the barrier only orders the blocks' progress, not their writes).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __syncthreads();
#endif
}
__device__ __forceinline__ void cluster_barrier() {
    cluster_arrive();
    cluster_wait();
}
// The cluster barrier that publishes this block's shared-memory writes only (what a neighbour then reads
// through distributed shared memory): a release fence restricted to the block's shared memory at cluster scope
// (MEMBAR.CTA in the SASS, where arrive.release puts a GPU-wide MEMBAR), a relaxed arrive, the acquiring wait.
// It does not order this block's earlier remote reads (use cluster_barrier() before a block may exit while
// others read it). The restricted fence needs PTX ISA 8.6 (nvcc 12.8+); older compilers get the full barrier.
__device__ __forceinline__ void cluster_barrier_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8))
    asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    cluster_barrier();
#endif
}
// The float at `p` (this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float ld_cluster_shared_f32(const float* p, unsigned int rank);
// The 32-bit value at `p` (this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ unsigned int ld_cluster_shared(const unsigned int* p, unsigned int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned int v;
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(ra) : "memory");
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ float ld_cluster_shared_f32(const float* p, unsigned int rank) {
    return __uint_as_float(ld_cluster_shared(reinterpret_cast<const unsigned int*>(p), rank));
}

// A hint to bring the 128-byte line at `p` into L2 (no register, no result): the products prefetch their
// weights, which no kernel writes, before pdl_wait().
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// Prefetch `bytes` bytes from `p` into L2, the 32 lanes of a warp one line each in turn.
__device__ __forceinline__ void prefetch_l2_range(const void* p, long long bytes, int lane) {
    const char* c = reinterpret_cast<const char*>(p);
    for (long long o = (long long)lane * 128; o < bytes; o += 32 * 128) prefetch_l2(c + o);
}

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same value (float addition is commutative).
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

__device__ __forceinline__ int warp_isum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// Unsigned bytes of `a` times signed bytes of `b`, summed into `c` (dp4a.u32.s32).
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// H_32 · v over the 32 lanes of a warp: the butterfly (a, b) -> (a + b, a - b) over strides 1, 2, ..., 16,
// then times 1/sqrt(32) (the CPU's fwht order: quant/rotation.rs).
__device__ __forceinline__ float warp_fwht32(float v, int lane) {
    for (int h = 1; h < 32; h <<= 1) {
        float p = __shfl_xor_sync(FULL, v, h);
        v = (lane & h) ? __fsub_rn(p, v) : __fadd_rn(v, p);
    }
    return __fmul_rn(v, 1.0f / sqrtf(32.0f));
}

// ---------------------------------------------------------------------------------------------------------
// Activation quantization: one warp per (token, group of 32). Optional input rotation x~ = H (D_in x).
// d = amax/127, q = rint(x * 127/amax) (ties to even) clamped to [-127, 127]; d = 0, q = 0 when amax < 1e-30.
// `quant_group` quantizes the group `gid` whose value `v` lane `lane` holds (`signs`: the group's 32 input
// signs, or null); the fused kernels below call it on values they computed, so their codes equal those of
// quantize_q8 on the stored values.
//
// Where `tq` is not null it also writes the same values in the token-tiled copy the verify-size products
// (mm_qv*) read, so that a warp's loads of 8 tokens' operands for one block of 32 touch one or two 128-byte
// lines instead of 8: group (token t, block b) at position p = ((t / 8)·G + b)·8 + t % 8 of `tg` positions
// (tokens padded to a multiple of 8): codes at tq + 32p with the 4-byte words in the order 0, 4, 1, 5, 2, 6,
// 3, 7 (a B fragment's two words side by side), then from tq + 32·tg the scales (f32, p), the sums (i32, p),
// d·sums (f32, p) and the half sums (i32 pairs, 2p).
struct QActOut {
    int8_t* __restrict__ q;
    float* __restrict__ scale;
    int* __restrict__ sum;
    float* __restrict__ dsum;
    int* __restrict__ sum16;
    unsigned char* __restrict__ tq;
    long long tg;  // positions of the tiled copy
    long long G;   // groups of 32 per token
};

__device__ __forceinline__ void quant_group(float v, int lane, long long gid, const float* __restrict__ signs,
                                            const QActOut& o) {
    int8_t* __restrict__ q = o.q;
    float* __restrict__ scale = o.scale;
    int* __restrict__ sum = o.sum;
    float* __restrict__ dsum = o.dsum;
    int* __restrict__ sum16 = o.sum16;
    if (signs != nullptr) {
        v = __fmul_rn(v, signs[lane]);
        v = warp_fwht32(v, lane);
    }
    const float amax = warp_max(fabsf(v));
    float d = 0.0f, inv = 0.0f;
    if (amax >= 1e-30f) {
        d = __fdiv_rn(amax, 127.0f);
        inv = __fdiv_rn(127.0f, amax);
    }
    const int qi = (int)fminf(fmaxf(rintf(__fmul_rn(v, inv)), -127.0f), 127.0f);
    q[gid * 32 + lane] = (int8_t)qi;
    const int s = warp_isum(qi);
    const int lo = warp_isum(lane < 16 ? qi : 0);
    if (lane == 0) {
        scale[gid] = d;
        sum[gid] = s;
        dsum[gid] = __fmul_rn(d, (float)s);
        sum16[2 * gid] = lo;
        sum16[2 * gid + 1] = s - lo;
    }
    if (o.tq != nullptr) {
        const long long t = gid / o.G, b = gid % o.G, p = ((t >> 3) * o.G + b) * 8 + (t & 7);
        const int w = lane >> 2;
        o.tq[p * 32 + (w < 4 ? 2 * w : 2 * (w - 4) + 1) * 4 + (lane & 3)] = (int8_t)qi;
        if (lane == 0) {
            reinterpret_cast<float*>(o.tq + 32 * o.tg)[p] = d;
            reinterpret_cast<int*>(o.tq + 36 * o.tg)[p] = s;
            reinterpret_cast<float*>(o.tq + 40 * o.tg)[p] = __fmul_rn(d, (float)s);
            reinterpret_cast<int*>(o.tq + 44 * o.tg)[2 * p] = lo;
            reinterpret_cast<int*>(o.tq + 44 * o.tg)[2 * p + 1] = s - lo;
        }
    }
}

extern "C" __global__ void quantize_q8(const float* __restrict__ x, int n, int cols, const float* __restrict__ signs,
                                       int8_t* __restrict__ q, float* __restrict__ scale, int* __restrict__ sum,
                                       float* __restrict__ dsum, int* __restrict__ sum16, unsigned char* tq,
                                       long long tg) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const long long G = cols >> 5;
    const long long gid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gid >= (long long)n * G) return;
    const QActOut o = {q, scale, sum, dsum, sum16, tq, tg, G};
    quant_group(x[gid * 32 + lane], lane, gid, signs != nullptr ? signs + (gid % G) * 32 : nullptr, o);
}

// ---------------------------------------------------------------------------------------------------------
// Quantized matrix x int8 activations. One warp per weight row, TT tokens per block column (grid.y).
// Lane l walks the row's code blocks b = l, l + 32, ... in order; per block and token the integer dots are
// exact and the block's term is added to that token's accumulator with one or two fused multiply-adds;
// the 32 lane sums are then combined by the fixed xor tree. So output (row, token) has one operation
// sequence whatever n and TT are.
//
// Layout (docs/cuda.md): codes per block of 32: P4 (bits 4) 16 bytes, byte j = code j | code j+16 << 4;
// otherwise 32 bytes, one code each. `sc` one f32 scale per 16 values (g16) or per 32, `mn` one f32 offset
// per 32 (explicit offsets) or null; `half` = 2^(bits-1) for the implicit offset.
#define MM_ROWS 4
// The parameters of a one-launch `dp4a` product of a block row `bx` (G: the group-16 flag, or MM_Q3's flags).
#define MM_Q_PARAMS(G)                                                                                      \
    int bx, const uint8_t *__restrict__ codes, const float *__restrict__ sc, const float *__restrict__ mn,   \
        int rows, int cols, int half, int G, const int8_t *__restrict__ xq, const float *__restrict__ xs,    \
        const int *__restrict__ xsum, const float *__restrict__ xdsum, const int *__restrict__ xsum16, int n, \
        const float *__restrict__ bias, float *__restrict__ out

template <int TT, bool P4, int U = 0>
__device__ __forceinline__ void mm_q_impl(MM_Q_PARAMS(g16)) {
    static_assert(U == 0 || TT <= 4, "deeper loads for launches of up to four tokens");
    const int lane = threadIdx.x & 31;
    const int row = bx * MM_ROWS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * TT;
    const int nblk = cols >> 5;
    // Block b's codes (c1: the second 16 bytes of 8-bit codes), scales and offset.
    auto load = [&](int b, uint4& c0, uint4& c1, float& s0, float& s1, float& m) {
        const long long blk = (long long)row * nblk + b;
        if (P4) {
            c0 = *reinterpret_cast<const uint4*>(codes + blk * 16);
        } else {
            c0 = *reinterpret_cast<const uint4*>(codes + blk * 32);
            c1 = *reinterpret_cast<const uint4*>(codes + blk * 32 + 16);
        }
        s1 = 0.0f;
        m = 0.0f;
        if (g16) {
            s0 = sc[2 * blk];
            s1 = sc[2 * blk + 1];
        } else {
            s0 = sc[blk];
        }
        if (mn != nullptr) m = mn[blk];
    };
    // Block b's term added to each token's accumulator.
    auto step = [&](int b, const uint4& c0, const uint4& c1, float s0, float s1, float m, float (&acc)[TT], int nt) {
        uint32_t w[8];
        if (P4) {
            const uint32_t L[4] = {c0.x, c0.y, c0.z, c0.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                w[k] = L[k] & 0x0F0F0F0Fu;
                w[k + 4] = (L[k] >> 4) & 0x0F0F0F0Fu;
            }
        } else {
            w[0] = c0.x; w[1] = c0.y; w[2] = c0.z; w[3] = c0.w;
            w[4] = c1.x; w[5] = c1.y; w[6] = c1.z; w[7] = c1.w;
        }
#pragma unroll
        for (int i = 0; i < TT; ++i) {
            if (i < nt) {
                const long long t = t0 + i;
                const int4* ap = reinterpret_cast<const int4*>(xq + t * cols + (long long)b * 32);
                const int4 a0 = ap[0], a1 = ap[1];
                int d0 = 0, d1 = 0;
                d0 = dp4a_us(w[0], a0.x, d0);
                d0 = dp4a_us(w[1], a0.y, d0);
                d0 = dp4a_us(w[2], a0.z, d0);
                d0 = dp4a_us(w[3], a0.w, d0);
                d1 = dp4a_us(w[4], a1.x, d1);
                d1 = dp4a_us(w[5], a1.y, d1);
                d1 = dp4a_us(w[6], a1.z, d1);
                d1 = dp4a_us(w[7], a1.w, d1);
                const long long ab = t * nblk + b;
                const float d = xs[ab];
                float a = acc[i];
                if (g16) {
                    const int e0 = d0 - half * xsum16[2 * ab];
                    const int e1 = d1 - half * xsum16[2 * ab + 1];
                    a = __fmaf_rn(__fmul_rn(s0, d), (float)e0, a);
                    a = __fmaf_rn(__fmul_rn(s1, d), (float)e1, a);
                } else if (mn != nullptr) {
                    a = __fmaf_rn(__fmul_rn(s0, d), (float)(d0 + d1), a);
                    a = __fmaf_rn(m, xdsum[ab], a);
                } else {
                    const int e = d0 + d1 - half * xsum[ab];
                    a = __fmaf_rn(__fmul_rn(s0, d), (float)e, a);
                }
                acc[i] = a;
            }
        }
    };
    // Before the wait (programmatic dependent launch), what no kernel writes: the lane's first block into
    // registers, the rest of the row's weights towards L2.
    uint4 pc0 = make_uint4(0, 0, 0, 0), pc1 = pc0;
    float ps0 = 0.0f, ps1 = 0.0f, pm = 0.0f;
    const bool first = row < rows && lane < nblk;
    if (first) load(lane, pc0, pc1, ps0, ps1, pm);
    if (row < rows && blockIdx.y == 0 && nblk > 32) {
        prefetch_l2_range(codes + ((long long)row * nblk + 32) * (P4 ? 16 : 32), (long long)(nblk - 32) * (P4 ? 16 : 32), lane);
        prefetch_l2_range(sc + ((long long)row * nblk + 32) * (g16 ? 2 : 1), (long long)(nblk - 32) * (g16 ? 8 : 4), lane);
        if (mn != nullptr) prefetch_l2_range(mn + (long long)row * nblk + 32, (long long)(nblk - 32) * 4, lane);
    }
    pdl_wait();
    if (row >= rows) return;
    const int nt = min(TT, n - t0);
    float acc[TT];
#pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.0f;
    if (first) step(lane, pc0, pc1, ps0, ps1, pm, acc, nt);
    if (U == 0) {
#pragma unroll 2
        for (int b = lane + 32; b < nblk; b += 32) {
            uint4 c0, c1 = make_uint4(0, 0, 0, 0);
            float s0, s1, m;
            load(b, c0, c1, s0, s1, m);
            step(b, c0, c1, s0, s1, m, acc, nt);
        }
    } else {
        // The `u` kernels: the lane's next U blocks loaded together, then their terms in order (the same chains):
        // one memory round trip per U blocks of a long row (the down projections) instead of about one per two.
        // The activations of the U blocks (each of the launch's TT tokens: 1 or 2) are loaded with them, so that
        // no step waits on its own load. (TT == 1 keeps the one-token code free of token checks.)
        constexpr int UU = U > 0 ? U : 1;
        long long tok[TT];
#pragma unroll
        for (int i = 0; i < TT; ++i) tok[i] = t0 + i;
        for (int b0 = lane + 32; b0 < nblk; b0 += 32 * UU) {
            uint4 c0[UU], c1[UU];
            float s0[UU], s1[UU], m[UU], d[UU][TT], xd[UU][TT];
            int4 a0[UU][TT], a1[UU][TT];
            int h0[UU][TT], h1[UU][TT];
#pragma unroll
            for (int u = 0; u < UU; ++u) {
                const int b = b0 + 32 * u;
                c1[u] = make_uint4(0, 0, 0, 0);
                if (b < nblk) {
                    load(b, c0[u], c1[u], s0[u], s1[u], m[u]);
#pragma unroll
                    for (int i = 0; i < TT; ++i) {
                        if (TT > 1 && i >= nt) continue;
                        const long long t = tok[i];
                        const int4* ap = reinterpret_cast<const int4*>(xq + t * cols + (long long)b * 32);
                        a0[u][i] = ap[0];
                        a1[u][i] = ap[1];
                        const long long ab = t * nblk + b;
                        d[u][i] = xs[ab];
                        if (g16) {
                            h0[u][i] = xsum16[2 * ab];
                            h1[u][i] = xsum16[2 * ab + 1];
                        } else if (mn != nullptr) {
                            xd[u][i] = xdsum[ab];
                        } else {
                            h0[u][i] = xsum[ab];
                        }
                    }
                }
            }
            // Each block's term, as `step` adds it for each token (the same operations in the same order).
#pragma unroll
            for (int u = 0; u < UU; ++u) {
                if (b0 + 32 * u >= nblk) continue;
                uint32_t w[8];
                if (P4) {
                    const uint32_t L[4] = {c0[u].x, c0[u].y, c0[u].z, c0[u].w};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        w[k] = L[k] & 0x0F0F0F0Fu;
                        w[k + 4] = (L[k] >> 4) & 0x0F0F0F0Fu;
                    }
                } else {
                    w[0] = c0[u].x; w[1] = c0[u].y; w[2] = c0[u].z; w[3] = c0[u].w;
                    w[4] = c1[u].x; w[5] = c1[u].y; w[6] = c1[u].z; w[7] = c1[u].w;
                }
#pragma unroll
                for (int i = 0; i < TT; ++i) {
                    if (TT > 1 && i >= nt) continue;
                    int e0 = 0, e1 = 0;
                    e0 = dp4a_us(w[0], a0[u][i].x, e0);
                    e0 = dp4a_us(w[1], a0[u][i].y, e0);
                    e0 = dp4a_us(w[2], a0[u][i].z, e0);
                    e0 = dp4a_us(w[3], a0[u][i].w, e0);
                    e1 = dp4a_us(w[4], a1[u][i].x, e1);
                    e1 = dp4a_us(w[5], a1[u][i].y, e1);
                    e1 = dp4a_us(w[6], a1[u][i].z, e1);
                    e1 = dp4a_us(w[7], a1[u][i].w, e1);
                    float a = acc[i];
                    if (g16) {
                        a = __fmaf_rn(__fmul_rn(s0[u], d[u][i]), (float)(e0 - half * h0[u][i]), a);
                        a = __fmaf_rn(__fmul_rn(s1[u], d[u][i]), (float)(e1 - half * h1[u][i]), a);
                    } else if (mn != nullptr) {
                        a = __fmaf_rn(__fmul_rn(s0[u], d[u][i]), (float)(e0 + e1), a);
                        a = __fmaf_rn(m[u], xd[u][i], a);
                    } else {
                        a = __fmaf_rn(__fmul_rn(s0[u], d[u][i]), (float)(e0 + e1 - half * h0[u][i]), a);
                    }
                    acc[i] = a;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < TT; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && i < nt) out[(long long)(t0 + i) * rows + row] = bias != nullptr ? __fadd_rn(v, bias[row]) : v;
    }
}

// mm_q_t2 serves 2 tokens, mm_q_t4 3..4 (below the tensor-core kernels' crossover, docs/cuda.md; a tile's rows
// past n are skipped). A tile of TT tokens keeps TT accumulators in registers: t1 42 registers a thread, t2 64,
// t4 96; a tile of 8 took 142, a quarter of t1's warps per multiprocessor, and cost 1.4x t2's time at 2 tokens.
#define MM_Q(NAME, TT, P4)                                                                                   \
    extern "C" __global__ void NAME(const uint8_t* codes, const float* sc, const float* mn, int rows,       \
                                    int cols, int half, int g16, const int8_t* xq, const float* xs,         \
                                    const int* xsum, const float* xdsum, const int* xsum16, int n,          \
                                    const float* bias, float* out) {                                        \
        mm_q_impl<TT, P4>(blockIdx.x, codes, sc, mn, rows, cols, half, g16, xq, xs, xsum, xdsum, xsum16, n, bias,  \
                          out);                                                                             \
    }
MM_Q(mm_q_t1_p4, 1, true)
MM_Q(mm_q_t1_p8, 1, false)
MM_Q(mm_q_t2_p4, 2, true)
MM_Q(mm_q_t2_p8, 2, false)
MM_Q(mm_q_t4_p4, 4, true)
MM_Q(mm_q_t4_p8, 4, false)
// One token with U = 4 blocks of a row and their activations in flight a lane (the default for rows of
// 3+ blocks a lane; bit-identical to mm_q_t1). 95 (packed 4-bit) and 122 registers a thread: 4 blocks of 4 warps
// a multiprocessor, enough for a row count of one wave (1,536 rows: 384 blocks); U = 8 took 188–217 and was
// dropped unmeasured. Two tokens likewise with U = 4 (`mm_q_t2u4*`: bit-identical to mm_q_t2; the default for
// rows of 3+ blocks a lane, the verify's down projections: the 1.5B's 2-node verify −7 % on an H100, where U = 2
// gave −6 % and was dropped; docs/cuda.md, session 53). Three or four tokens with U = 2 (`mm_q_t4u2*`, 136 / 146
// registers; opt-in, EDDY_CUDA_T4_UNROLL, not yet measured).
#define MM_QU(NAME, TT, P4, U)                                                                               \
    extern "C" __global__ void NAME(const uint8_t* codes, const float* sc, const float* mn, int rows,       \
                                    int cols, int half, int g16, const int8_t* xq, const float* xs,         \
                                    const int* xsum, const float* xdsum, const int* xsum16, int n,          \
                                    const float* bias, float* out) {                                        \
        mm_q_impl<TT, P4, U>(blockIdx.x, codes, sc, mn, rows, cols, half, g16, xq, xs, xsum, xdsum, xsum16, n,  \
                             bias, out);                                                                    \
    }
MM_QU(mm_q_t1u4_p4, 1, true, 4)
MM_QU(mm_q_t1u4_p8, 1, false, 4)
MM_QU(mm_q_t2u4_p4, 2, true, 4)
MM_QU(mm_q_t2u4_p8, 2, false, 4)
MM_QU(mm_q_t4u2_p4, 4, true, 2)
MM_QU(mm_q_t4u2_p8, 4, false, 2)

// ---------------------------------------------------------------------------------------------------------
// The same products for 5 and more tokens (DP4A_MAX in mod.rs) on the tensor cores (mma.sync m16n8k32 /
// m16n8k16, u8 codes times s8 activations, exact int32 dots), with the float order of mm_q_t1 per output:
//
// mm_q_t1's lane l sums the chain P_l over the blocks b = l, l + 32, ... (class l) in increasing b, and the
// xor butterfly then adds the 32 lane sums in a fixed binary tree. In the order of visit i = 0..31 with class
// rev5(i) (the 5-bit reversal of i), that tree is the plain binary tree over consecutive visits:
// T(i, 2^k) = T(i, 2^(k-1)) + T(i + 2^(k-1), 2^(k-1)), T(i, 1) = P_rev5(i) (lane l meets lane l^16 first,
// and rev5(l^16) = rev5(l)^1; then l^8, ...). So a block of QW_WARPS = 16 warps computes a tile of 16 weight
// rows x 8*NJ tokens (NJ = 1, 2): warp w owns the two classes of visits 2w, 2w+1 (a subtree), walks the row's
// blocks 32 at a time (one block of each of its classes per step, so each class chain runs in increasing b),
// gets the int32 dots of the whole tile for a block from one mma per 8 tokens (two k16 ones for group-16
// scales), and adds the block's term to that class's accumulator with exactly mm_q_t1's one or two __fmaf_rn;
// then each warp adds its two class sums (P0 + P1) and the 16 warp sums meet in the binary tree over
// consecutive warps, ((w0 + w1) + (w2 + w3)) + ..., then the bias. Empty classes add 0, as mm_q_t1's idle
// lanes do. Every output is thus bit-identical to mm_q_t1's for any n and tile.
//
// mma fragments (PTX ISA, "Matrix fragments for mma.m16n8k32", 8-bit types): lane = 4g + q; A (16 x 32,
// row-major) regs a0, a1, a2, a3 = row g cols 4q..4q+3, row g+8 cols 4q.., row g cols 16+4q.., row g+8 cols
// 16+4q..; B (32 x 8, by column: a token's codes) b0, b1 = token g codes 4q.., 16+4q..; C c0, c1, c2, c3 =
// (row g, token 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1). m16n8k16 takes a0/a1 with b0 (codes 0..15) or
// a2/a3 with b1 (codes 16..31). The nibble layout gives a0/a2 of a row from one word: w & 0x0F0F0F0F, w >> 4.
#define MMA_ROWS 16

__device__ __forceinline__ int rev5(int i) { return (int)(__brev((unsigned)i) >> 27); }

__device__ __forceinline__ void mma_k32(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, int b0,
                                        int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, int b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

__device__ __forceinline__ void mma_k32c(int (&c)[4], const uint32_t (&a)[4], int b0, int b1, int e0, int e1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%10,%11};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(e0), "r"(e1));
}
__device__ __forceinline__ void mma_k16c(int (&c)[4], uint32_t a0, uint32_t a1, int b0, int e0, int e1) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%7,%8};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(e0), "r"(e1));
}
// The same with accumulator inputs (e0 for the C fragment's tokens 2q, e1 for 2q + 1). With e = QT_BIAS - h
// (h = half·Σx of the token's block, or 0) the result's bits are the float 1.5·2^23 + (dot - h), exact for
// |dot - h| < 2^22 (32 codes under 256 times activations within ±127, h under 2^19): qt_float subtracts
// 1.5·2^23, exactly, which gives the float mm_q_t1's int-to-float conversion gives, at the full float rate (the
// conversion instruction runs at a sixteenth of it: the bound of the many-token products' epilogues).
#define QT_BIAS 0x4B400000
__device__ __forceinline__ float qt_float(int r) { return __fsub_rn(__int_as_float(r), 12582912.0f); }


// Part p's implicit-offset code 2^(bits-1) (`half`): a launch of several parts passes them packed, part p's in
// bits 8p..8p+7 (every `half` is at most 128), so parts of different code widths (the 0.5B's Q5_0 q/k and Q8_0
// v) share one launch; a one-matrix launch passes its own, which is part 0's.
__device__ __forceinline__ int part_half(int packed, int p) { return (packed >> (8 * p)) & 0xFF; }

// Up to three matrices of one code packing and width that read the same activations (q/k/v, gate/up) in one
// launch: the grid's block rows cover part 0's rows, then part 1's, then part 2's (rows 0 for an absent part),
// RPB rows per block; each part's rows are computed exactly as the one-matrix kernel computes them. The parts'
// `half` are packed (part_half), their offsets by pointer; part p's group-16 flag is bit p of `g16` and its code
// packing bit 4 + p, handed to IMPL as `flags` (bit 0 group 16, bit 1 nibble-packed).
#define MM_Q3(NAME, IMPL, RPB, BOUNDS)                                                                       \
    extern "C" __global__ void BOUNDS NAME(                                                                  \
        int cols, int half, int g16, const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, \
        const int* xsum16, int n, const uint8_t* c0, const float* s0, const float* m0, int r0,               \
        const float* b0, float* o0, const uint8_t* c1, const float* s1, const float* m1, int r1,             \
        const float* b1, float* o1, const uint8_t* c2, const float* s2, const float* m2, int r2,             \
        const float* b2, float* o2) {                                                                        \
        int bx = blockIdx.x;                                                                                \
        const int nb0 = (r0 + RPB - 1) / RPB, nb1 = (r1 + RPB - 1) / RPB;                                   \
        const uint8_t* c = c0;                                                                              \
        const float *s = s0, *m = m0, *b = b0;                                                              \
        float* o = o0;                                                                                      \
        int r = r0, p = 0;                                                                                  \
        if (bx >= nb0 + nb1) {                                                                              \
            bx -= nb0 + nb1;                                                                                \
            c = c2; s = s2; m = m2; r = r2; b = b2; o = o2; p = 2;                                          \
        } else if (bx >= nb0) {                                                                             \
            bx -= nb0;                                                                                      \
            c = c1; s = s1; m = m1; r = r1; b = b1; o = o1; p = 1;                                          \
        }                                                                                                   \
        const int flags = ((g16 >> p) & 1) | (((g16 >> (4 + p)) & 1) << 1);                                 \
        IMPL(bx, c, s, m, r, cols, part_half(half, p), flags, xq, xs, xsum, xdsum, xsum16, n, b, o);        \
    }
// A part of an MM_Q3 launch on the kernel of one packing (the packing bit of `flags` is the kernel's own).
template <int TT, bool P4, int U = 0>
__device__ __forceinline__ void mm_q_part(MM_Q_PARAMS(flags)) {
    mm_q_impl<TT, P4, U>(bx, codes, sc, mn, rows, cols, half, flags & 1, xq, xs, xsum, xdsum, xsum16, n, bias, out);
}
// One token (or two: `mm_q3x_t2`, EDDY_CUDA_MIXED_T2; three or four: `mm_q3x_t4`, opt-in, EDDY_CUDA_MIXED_T4), parts of either packing (the 1.5B's Q4_K q/k
// beside a Q6_K v): a branch uniform over the block into the part's packing.
template <int TT, int U>
__device__ __forceinline__ void mm_q_mixed(MM_Q_PARAMS(flags)) {
    if (flags & 2)
        mm_q_part<TT, true, U>(bx, codes, sc, mn, rows, cols, half, flags, xq, xs, xsum, xdsum, xsum16, n, bias, out);
    else
        mm_q_part<TT, false, U>(bx, codes, sc, mn, rows, cols, half, flags, xq, xs, xsum, xdsum, xsum16, n, bias, out);
}
#define NO_BOUNDS
MM_Q3(mm_q3_t1_p4, (mm_q_part<1, true>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t1_p8, (mm_q_part<1, false>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t2_p4, (mm_q_part<2, true>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t2_p8, (mm_q_part<2, false>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t4_p4, (mm_q_part<4, true>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t4_p8, (mm_q_part<4, false>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t1u4_p4, (mm_q_part<1, true, 4>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3_t1u4_p8, (mm_q_part<1, false, 4>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3x_t1, (mm_q_mixed<1, 0>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3x_t1u4, (mm_q_mixed<1, 4>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3x_t2, (mm_q_mixed<2, 0>), MM_ROWS, NO_BOUNDS)
MM_Q3(mm_q3x_t4, (mm_q_mixed<4, 0>), MM_ROWS, NO_BOUNDS)

// ---------------------------------------------------------------------------------------------------------
// mm_qw*: the block walks a list of work items — (row tile, step of 32 blocks) for its row tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... (a persistent grid when the host caps gridDim.x), each tile's steps in order —
// and stages each item's data in shared memory with cp.async (global -> shared without registers, 16-byte
// copies for codes and activation codes, 4-byte ones for scales, offsets and token sums), two stages (QwSmem::DB:
// every variant, in dynamic shared memory): the next item's copies are issued before this item's mma's and its
// tile's reduction, so the loads of the next step, or of the next row tile, fly meanwhile.
// Rows padded by 16 bytes, so the fragment reads hit 32 distinct banks. The epilogue form is a template
// parameter (FORM: 0 implicit offset, 1 explicit offsets, 2 group-16 scales).
//
// Split (S = gridDim.z = 1, 2, 4 blocks per tile, blockIdx.z = h): the tree's top log2(S) levels are cut off.
// Block h owns the visits V·h .. V·h + V - 1 (V = 32 / S), i.e. the subtree T(V·h, V): the classes rev5(i) of
// those visits, which are exactly the classes congruent to revS(h) mod S, so it stages only the blocks
// b ≡ revS(h) (mod S) of each step (slot m = class / S). Its warps own C = 2 (S = 1) or 1 class each; the
// warps with classes (WA = V / C) meet in the binary tree over consecutive warps through shared memory. For
// S > 1 each block writes its subtree sums to `part`, and the last of the tile's S blocks to finish (a device
// counter per tile, reset by that block) adds them in the tree's order, p0 + p1 or (p0 + p1) + (p2 + p3), then
// the bias. So every output keeps mm_q_t1's float order for any S, grid and tile.
// 512 threads and at most 64 registers: two blocks per multiprocessor.
#define QW_WARPS 16
// Shared memory of a block (dynamic, two stages): at most this, so two blocks fit on an sm_90 multiprocessor
// (228 KB; one on sm_80's 164 KB and sm_86/89's 100 KB).
#define QW_SMEM_MAX (96 * 1024)

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void cp_async4(void* s, const void* g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int NJ, bool P4, int FORM, int S>
struct QwSmem {
    static constexpr int V = 32 / S;               // blocks of a row per step in this block (its classes)
    static constexpr int LS = S == 1 ? 0 : (S == 2 ? 1 : 2);
    static constexpr int NT = 8 * NJ;
    static constexpr int CS = P4 ? 16 : 32;        // code bytes per block
    static constexpr int CPB = CS / 16;            // 16-byte copies per block of codes
    static constexpr int RS = V * CS + 16;         // bytes per weight row of a step (padded)
    static constexpr int AS = V * 32 + 16;         // bytes per token of a step (padded)
    static constexpr int SPB = FORM == 2 ? 2 : 1;  // scales (and token sums) per block
    static constexpr int SS = V * SPB + 1;         // words per row of scales / token of sums (padded)
    static constexpr int VS = V + 1;               // words per row of offsets / token of scales (padded)
    static constexpr int codes = 0;
    static constexpr int acts = codes + MMA_ROWS * RS;
    static constexpr int scales = acts + NT * AS;
    static constexpr int mins = scales + MMA_ROWS * SS * 4;
    static constexpr int xs = mins + (FORM == 1 ? MMA_ROWS * VS * 4 : 0);
    static constexpr int hs = xs + NT * VS * 4;
    static constexpr int stage = (hs + NT * SS * 4 + 15) / 16 * 16;
    static constexpr int C = S == 1 ? 2 : 1;       // classes per warp
    static constexpr int WA = V / C;               // warps with classes
    static constexpr int red = WA * MMA_ROWS * NT * 4;  // the warps' subtree sums (in a stage buffer)
    static constexpr bool DB = 2 * stage <= QW_SMEM_MAX;  // double-buffered
    static constexpr bool RED_OWN = red > stage;          // else the reduction reuses the tile's last stage
    static constexpr int bytes = (DB ? 2 * stage : stage) + (RED_OWN ? red : 0);
    static_assert(DB && bytes <= QW_SMEM_MAX, "two stages in QW_SMEM_MAX bytes");
};

// Up to three matrices of one format and width read from the same activations: the row tiles of part 0,
// then part 1's, then part 2's (absent parts have 0 rows).
struct QParts {
    const uint8_t* c[3];
    const float* s[3];
    const float* m[3];
    const float* b[3];
    float* o[3];
    int r[3];
    int nb0, nb1;
    __device__ __forceinline__ int tiles() const { return nb0 + nb1 + (r[2] + MMA_ROWS - 1) / MMA_ROWS; }
    // The part of row tile `tile` and its first row there, for tiles of `tr` rows (nb0 / nb1 counted in them).
    __device__ __forceinline__ int part(int tile, int& r0, int tr = MMA_ROWS) const {
        if (tile >= nb0 + nb1) {
            r0 = (tile - nb0 - nb1) * tr;
            return 2;
        }
        if (tile >= nb0) {
            r0 = (tile - nb0) * tr;
            return 1;
        }
        r0 = tile * tr;
        return 0;
    }
    __device__ __forceinline__ static int half_of(int packed, int p) { return part_half(packed, p); }
    // Part p's entries by selects (no local-memory array indexed at run time).
    template <typename X>
    __device__ __forceinline__ static X pick(const X (&x)[3], int p) {
        return p == 2 ? x[2] : (p == 1 ? x[1] : x[0]);
    }
};

template <int NJ, bool P4, int FORM, int S>
__device__ __forceinline__ void mm_qw_impl(const QParts& PT, int cols, int half, const int8_t* __restrict__ xq,
                                           const float* __restrict__ xs, const int* __restrict__ xsum,
                                           const float* __restrict__ xdsum, const int* __restrict__ xsum16, int n,
                                           float* __restrict__ part, int* __restrict__ count) {
    using L = QwSmem<NJ, P4, FORM, S>;
    constexpr int NT = L::NT, V = L::V, C = L::C, WA = L::WA, T = 32 * QW_WARPS, CS = L::CS, SPB = L::SPB;
    constexpr int CPB = L::CPB;
    extern __shared__ __align__(16) unsigned char sm[];  // L::bytes (mm_qw_smem)
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.y * NT, h = blockIdx.z;
    const int off = S == 1 ? 0 : (S == 2 ? h : ((h >> 1) | ((h & 1) << 1)));  // revS(h)
    pdl_wait();
    const int ntiles = PT.tiles();
    if ((int)blockIdx.x >= ntiles) return;  // whole block: no barrier skipped by part of it
    const int nblk = cols >> 5, nsteps = (nblk + 31) >> 5;
    const int items = (ntiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * nsteps;
    // Stage item `it` into `buf`: every copy of the item issued (rows and tokens past the ends clamped, blocks
    // past the row's end skipped).
    auto issue = [&](int it, unsigned char* buf) {
        const int tile = (int)blockIdx.x + (it / nsteps) * (int)gridDim.x, c0 = (it % nsteps) * 32;
        int r0;
        const int p = PT.part(tile, r0);
        const uint8_t* __restrict__ codes = QParts::pick(PT.c, p);
        const float* __restrict__ sc = QParts::pick(PT.s, p);
        const float* __restrict__ mn = QParts::pick(PT.m, p);
        const int rows = QParts::pick(PT.r, p), sb = min(32, nblk - c0);
        constexpr int NC = MMA_ROWS * V * CPB, NA = NT * V * 2, NS = MMA_ROWS * V * SPB;
        constexpr int NM = FORM == 1 ? MMA_ROWS * V : 0, NX = NT * V, NH = NT * V * SPB;
#pragma unroll
        for (int u = 0; u < (NC + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i / (V * CPB), k = i % (V * CPB), bk = (k / CPB) * S + off;
            if (i < NC && bk < sb)
                cp_async16(buf + L::codes + r * L::RS + k * 16,
                           codes + ((long long)min(r0 + r, rows - 1) * nblk + c0 + bk) * CS + (k % CPB) * 16);
        }
#pragma unroll
        for (int u = 0; u < (NA + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i / (2 * V), k = i % (2 * V), bk = (k >> 1) * S + off;
            if (i < NA && bk < sb)
                cp_async16(buf + L::acts + t * L::AS + k * 16,
                           xq + (long long)min(t0 + t, n - 1) * cols + (c0 + bk) * 32 + (k & 1) * 16);
        }
#pragma unroll
        for (int u = 0; u < (NS + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i / (V * SPB), k = i % (V * SPB), bk = (k / SPB) * S + off;
            if (i < NS && bk < sb)
                cp_async4(buf + L::scales + (r * L::SS + k) * 4,
                          sc + ((long long)min(r0 + r, rows - 1) * nblk + c0 + bk) * SPB + k % SPB);
        }
#pragma unroll
        for (int u = 0; u < (NM + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i / V, bk = (i % V) * S + off;
            if (i < NM && bk < sb)
                cp_async4(buf + L::mins + (r * L::VS + i % V) * 4, mn + (long long)min(r0 + r, rows - 1) * nblk + c0 + bk);
        }
#pragma unroll
        for (int u = 0; u < (NX + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i / V, bk = (i % V) * S + off;
            if (i < NX && bk < sb)
                cp_async4(buf + L::xs + (t * L::VS + i % V) * 4, xs + (long long)min(t0 + t, n - 1) * nblk + c0 + bk);
        }
#pragma unroll
        for (int u = 0; u < (NH + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i / (V * SPB), k = i % (V * SPB), bk = (k / SPB) * S + off;
            if (i < NH && bk < sb) {
                const long long at = (long long)min(t0 + t, n - 1) * nblk + c0 + bk;
                const void* src = FORM == 2 ? (const void*)(xsum16 + 2 * at + k % SPB)
                                            : (FORM == 1 ? (const void*)(xdsum + at) : (const void*)(xsum + at));
                cp_async4(buf + L::hs + (t * L::SS + k) * 4, src);
            }
        }
    };
    float P[C][NJ][4];
#pragma unroll
    for (int k = 0; k < C; ++k)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) P[k][j][e] = 0.0f;
    int cls[C];
#pragma unroll
    for (int k = 0; k < C; ++k) cls[k] = rev5(V * h + C * warp + k);
    if (L::DB) {
        issue(0, sm);
        cp_async_commit();
    }
#pragma unroll 1
    for (int it = 0; it < items; ++it) {
        unsigned char* const cur = sm + (L::DB ? (it & 1) * L::stage : 0);
        if (L::DB) {
            if (it + 1 < items) issue(it + 1, sm + ((it + 1) & 1) * L::stage);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            issue(it, cur);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();
        const float* const cf = reinterpret_cast<const float*>(cur);
        const int* const ci = reinterpret_cast<const int*>(cur);
        const int step = it % nsteps, sb = min(32, nblk - step * 32);
        int tr0;
        const int hp = QParts::half_of(half, PT.part((int)blockIdx.x + (it / nsteps) * (int)gridDim.x, tr0));
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const int cl = cls[k], m = cl >> L::LS;
            if (warp < WA && cl < sb) {  // warp-uniform: this class has a block in the step
                uint32_t a[4];
                if (P4) {
                    const uint32_t wa = *reinterpret_cast<const uint32_t*>(cur + L::codes + g * L::RS + m * 16 + 4 * q);
                    const uint32_t wb = *reinterpret_cast<const uint32_t*>(cur + L::codes + (g + 8) * L::RS + m * 16 + 4 * q);
                    a[0] = wa & 0x0F0F0F0Fu;
                    a[1] = wb & 0x0F0F0F0Fu;
                    a[2] = (wa >> 4) & 0x0F0F0F0Fu;
                    a[3] = (wb >> 4) & 0x0F0F0F0Fu;
                } else {
                    const unsigned char* pa = cur + L::codes + g * L::RS + m * 32 + 4 * q;
                    a[0] = *reinterpret_cast<const uint32_t*>(pa);
                    a[1] = *reinterpret_cast<const uint32_t*>(pa + 8 * L::RS);
                    a[2] = *reinterpret_cast<const uint32_t*>(pa + 16);
                    a[3] = *reinterpret_cast<const uint32_t*>(pa + 8 * L::RS + 16);
                }
                float s[2][2], mm[2];
#pragma unroll
                for (int ri = 0; ri < 2; ++ri) {
                    const float* srow = cf + L::scales / 4 + (g + 8 * ri) * L::SS + m * SPB;
                    s[ri][0] = srow[0];
                    s[ri][1] = FORM == 2 ? srow[1] : 0.0f;
                    mm[ri] = FORM == 1 ? cf[L::mins / 4 + (g + 8 * ri) * L::VS + m] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const unsigned char* pb = cur + L::acts + (8 * j + g) * L::AS + m * 32 + 4 * q;
                    const int b0 = *reinterpret_cast<const int*>(pb), b1 = *reinterpret_cast<const int*>(pb + 16);
                    int d0[4], d1[4];
                    if (FORM == 2) {
                        mma_k16(d0, a[0], a[1], b0);
                        mma_k16(d1, a[2], a[3], b1);
                    } else {
                        mma_k32(d0, a[0], a[1], a[2], a[3], b0, b1);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int ri = e >> 1, tok = 8 * j + 2 * q + (e & 1);  // row g or g+8; token 2q or 2q+1
                        const float d = cf[L::xs / 4 + tok * L::VS + m];
                        const int hx = ci[L::hs / 4 + tok * L::SS + m * SPB];
                        const int hy = FORM == 2 ? ci[L::hs / 4 + tok * L::SS + m * SPB + 1] : 0;
                        float acc = P[k][j][e];
                        if (FORM == 2) {
                            acc = __fmaf_rn(__fmul_rn(s[ri][0], d), (float)(d0[e] - hp * hx), acc);
                            acc = __fmaf_rn(__fmul_rn(s[ri][1], d), (float)(d1[e] - hp * hy), acc);
                        } else if (FORM == 1) {
                            acc = __fmaf_rn(__fmul_rn(s[ri][0], d), (float)d0[e], acc);
                            acc = __fmaf_rn(mm[ri], __int_as_float(hx), acc);
                        } else {
                            acc = __fmaf_rn(__fmul_rn(s[ri][0], d), (float)(d0[e] - hp * hx), acc);
                        }
                        P[k][j][e] = acc;
                    }
                }
            }
        }
        if (step == nsteps - 1) {
            // The tile is done: the warp's subtree over its classes, then the tree over the warps with classes.
            const int tile = (int)blockIdx.x + (it / nsteps) * (int)gridDim.x;
            int r0;
            const int p = PT.part(tile, r0);
            const int rows = QParts::pick(PT.r, p);
            const float* __restrict__ bias = QParts::pick(PT.b, p);
            float* __restrict__ out = QParts::pick(PT.o, p);
#pragma unroll
            for (int s = 1; s < C; s <<= 1)
#pragma unroll
                for (int k = 0; k < C; k += 2 * s)
#pragma unroll
                    for (int j = 0; j < NJ; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) P[k][j][e] = __fadd_rn(P[k][j][e], P[k + s][j][e]);
            __syncthreads();  // every warp is done reading this item's data
            // Each warp with classes puts its subtree sums T(C·w, C) in this item's buffer; then thread i of the
            // first 16·NT adds output i's WA warp sums in the binary tree over consecutive warps, one level at a
            // time in registers (T(w, 2s) = T(w, s) + T(w + s, s)): one barrier instead of one per level.
            float* const red = reinterpret_cast<float*>(L::RED_OWN ? sm + (L::DB ? 2 : 1) * L::stage : cur);  // [WA][NT][16]
            if (warp < WA) {
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        red[warp * MMA_ROWS * NT + (8 * j + 2 * q + (e & 1)) * MMA_ROWS + g + 8 * (e >> 1)] = P[0][j][e];
            }
            __syncthreads();
            float v = 0.0f;
            if (tid < MMA_ROWS * NT) {
                float w[WA];
#pragma unroll
                for (int i = 0; i < WA; ++i) w[i] = red[i * MMA_ROWS * NT + tid];
#pragma unroll
                for (int s = 1; s < WA; s <<= 1)
#pragma unroll
                    for (int i = 0; i < WA; i += 2 * s) w[i] = __fadd_rn(w[i], w[i + s]);
                v = w[0];
            }
            const int orow = tid % MMA_ROWS, otok = tid / MMA_ROWS;  // thread tid's output (tid < 16·NT)
            if (S == 1) {
                const int gr = r0 + orow, t = t0 + otok;
                if (tid < MMA_ROWS * NT && gr < rows && t < n)
                    out[(long long)t * rows + gr] = bias != nullptr ? __fadd_rn(v, bias[gr]) : v;
            } else {
                const long long ti = (long long)tile * gridDim.y + blockIdx.y;
                if (tid < MMA_ROWS * NT) part[(ti * S + h) * (MMA_ROWS * NT) + tid] = v;
                // The last of the tile's S blocks to finish adds the subtrees in the tree's order.
                __threadfence();
                __syncthreads();
                if (tid == 0) last = atomicAdd(count + ti, 1) == S - 1;
                __syncthreads();
                if (last) {
                    __threadfence();
                    if (tid == 0) count[ti] = 0;
                    if (tid < MMA_ROWS * NT) {
                        const float* base = part + ti * S * (MMA_ROWS * NT) + tid;
                        if (S == 2) {
                            v = __fadd_rn(__ldcg(base), __ldcg(base + MMA_ROWS * NT));
                        } else {
                            v = __fadd_rn(__fadd_rn(__ldcg(base), __ldcg(base + MMA_ROWS * NT)),
                                          __fadd_rn(__ldcg(base + 2 * MMA_ROWS * NT), __ldcg(base + 3 * MMA_ROWS * NT)));
                        }
                        const int gr = r0 + orow, t = t0 + otok;
                        if (gr < rows && t < n) out[(long long)t * rows + gr] = bias != nullptr ? __fadd_rn(v, bias[gr]) : v;
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < C; ++k)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) P[k][j][e] = 0.0f;
        }
        __syncthreads();  // the next item's copies (or the reduction) overwrite this buffer
    }
}

// Dynamic shared memory bytes of each variant, [split 1, 2, 4][NJ 1, 2][FORM][p4, p8], read by the host.
#define QWB(NJ, F, S) QwSmem<NJ, true, F, S>::bytes, QwSmem<NJ, false, F, S>::bytes
#define QWB_NJ(NJ, S) QWB(NJ, 0, S), QWB(NJ, 1, S), QWB(NJ, 2, S)
#define QWB_S(S) QWB_NJ(1, S), QWB_NJ(2, S)
extern "C" __device__ const int mm_qw_smem[36] = {QWB_S(1), QWB_S(2), QWB_S(4)};

// One matrix (`mm_qw{NJ}_f{F}_{p4,p8}_s{S}`) and up to three (`mm_q3w…`, the parts' arguments as MM_Q3's).
// `part` and `count` (zeroed, one per (row tile, token tile)) serve the split (S > 1); null otherwise.
// The three parts of a `mm_q3*` kernel's arguments (c0, s0, m0, r0, b0, o0, then part 1's and part 2's).
#define QPARTS3                                                                                                \
    {{c0, c1, c2}, {s0, s1, s2}, {m0, m1, m2}, {b0, b1, b2}, {o0, o1, o2}, {r0, r1, r2},                       \
     (r0 + MMA_ROWS - 1) / MMA_ROWS, (r1 + MMA_ROWS - 1) / MMA_ROWS}
#define QW_BOUNDS __launch_bounds__(32 * QW_WARPS, 2)
#define MM_QW_P(NJ, F, P4, PS, S)                                                                            \
    extern "C" __global__ void QW_BOUNDS mm_qw##NJ##_f##F##_##PS##_s##S(                                      \
        const uint8_t* codes, const float* sc, const float* mn, int rows, int cols, int half, int g16,       \
        const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, const int* xsum16, int n,    \
        const float* bias, float* out, float* part, int* count) {                                            \
        (void)g16;                                                                                           \
        const QParts pt = {{codes, nullptr, nullptr}, {sc, nullptr, nullptr}, {mn, nullptr, nullptr},        \
                           {bias, nullptr, nullptr},  {out, nullptr, nullptr}, {rows, 0, 0},                  \
                           (rows + MMA_ROWS - 1) / MMA_ROWS, 0};                                             \
        mm_qw_impl<NJ, P4, F, S>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n, part, count);              \
    }                                                                                                        \
    extern "C" __global__ void QW_BOUNDS mm_q3w##NJ##_f##F##_##PS##_s##S(                                     \
        int cols, int half, int g16, const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, \
        const int* xsum16, int n, const uint8_t* c0, const float* s0, const float* m0, int r0,               \
        const float* b0, float* o0, const uint8_t* c1, const float* s1, const float* m1, int r1,             \
        const float* b1, float* o1, const uint8_t* c2, const float* s2, const float* m2, int r2,             \
        const float* b2, float* o2, float* part, int* count) {                                               \
        (void)g16;                                                                                           \
        const QParts pt = QPARTS3;                                                                           \
        mm_qw_impl<NJ, P4, F, S>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n, part, count);              \
    }
// A family's kernels for both code packings, three launch variants (S) and every (NJ, FORM).
#define MM_PACKINGS(P, NJ, F, S) P(NJ, F, true, p4, S) P(NJ, F, false, p8, S)
#define MM_FAMILY(P, S0, S1, S2)                                                                         \
    MM_PACKINGS(P, 1, 0, S0) MM_PACKINGS(P, 1, 0, S1) MM_PACKINGS(P, 1, 0, S2) MM_PACKINGS(P, 1, 1, S0) \
    MM_PACKINGS(P, 1, 1, S1) MM_PACKINGS(P, 1, 1, S2) MM_PACKINGS(P, 1, 2, S0) MM_PACKINGS(P, 1, 2, S1) \
    MM_PACKINGS(P, 1, 2, S2) MM_PACKINGS(P, 2, 0, S0) MM_PACKINGS(P, 2, 0, S1) MM_PACKINGS(P, 2, 0, S2) \
    MM_PACKINGS(P, 2, 1, S0) MM_PACKINGS(P, 2, 1, S1) MM_PACKINGS(P, 2, 1, S2) MM_PACKINGS(P, 2, 2, S0) \
    MM_PACKINGS(P, 2, 2, S1) MM_PACKINGS(P, 2, 2, S2)
MM_FAMILY(MM_QW_P, 1, 2, 4)

// ---------------------------------------------------------------------------------------------------------
// mm_qv*: the same products for the verify sizes (a few to a few dozen tokens), each warp on its own, in
// mm_q_t1's float order. mm_qw's blocks stage every (row tile, step) through shared memory behind barriers,
// activations included, and hold too few weight bytes in flight to stream them (session 23: a third of the
// one-token kernel's rate at 16 tokens). Here a block of S warps (S = 4, 8, 16) computes one tile of 16 rows
// x 8·NJ tokens (NJ = 1, 2, 4), warp w owning the V = 32/S consecutive visits V·w .. V·w + V - 1, i.e. the subtree
// T(V·w, V) of mm_q_t1's tree (above: visit i is class rev5(i), whose chain runs over the blocks rev5(i),
// rev5(i) + 32, ... in increasing order). The warp runs its chains one after the other in visit order, each
// block's int32 dots from one mma per 8 tokens (two k16 ones for group-16 scales) and its term added with
// mm_q_t1's one or two __fmaf_rn, and builds its subtree as the chains finish (pairwise: chain k meets the
// finished subtrees of k's trailing one bits, as mm_qt's walk); an empty chain adds 0, as mm_q_t1's idle
// lanes do. The S subtree sums meet in the binary tree over consecutive warps through shared memory, then the
// bias: every output bit-identical to mm_q_t1's.
// Each warp streams its blocks' weights (16 rows of codes, scales, offsets) through a ring of QvSmem::D
// stages of its own with cp.async, D blocks ahead of the one it computes, so D blocks' bytes per warp are in
// flight without registers; no barrier but the final one. The activations (a few KB, read by every tile)
// come from the token-tiled copy (QActOut), staged in the ring with the weights by the 16-warp kernels of up to
// 16 tokens (QvSmem::staged), else through L1: per block, 8 tokens' B fragments are one 8-byte load
// a lane from 256 contiguous bytes, their scales and sums one load from 32 or 64; token-major they were 8
// lines a load, and the L1 wavefronts of those loads bounded the kernel (measured: 16 tokens through the LM
// head of the 1.5B 275 against 126 µs with every lane reading one token).
template <bool P4, int FORM, int S>
struct QvSmem {
    static constexpr int CS = P4 ? 16 : 32;          // code bytes per block and row
    static constexpr int RS = P4 ? 16 : 48;          // bytes per row in a stage (8-bit rows padded: no bank conflicts)
    static constexpr int SPB = FORM == 2 ? 2 : 1;    // scales per block and row
    static constexpr int scales = MMA_ROWS * RS;
    static constexpr int mins = scales + MMA_ROWS * SPB * 4;
    static constexpr int stage = mins + (FORM == 1 ? MMA_ROWS * 4 : 0);
    static constexpr int D = S == 4 ? 8 : (S == 8 ? 4 : 2);  // stages a warp
    static constexpr int DR = 8;                              // stages a warp of the resident kernels
    // A block's activations, staged with its weights by the 16-warp kernels of up to 16 tokens (NJ ≤ 2; the
    // others read them through L1): per column j its 8 tokens' codes (256 bytes), scales (32) and (half·)sums
    // (32, or 64 with group-16 scales). Measured on an H100 (docs/cuda.md, "Verify products with their
    // activations staged"): the 0.5B's 16-node verify 3.7 % faster; the 8-warp kernels ran slower staged (more
    // registers and shared memory a block, fewer blocks a multiprocessor), so they keep the L1 loads.
    static constexpr int SU = FORM == 2 ? 64 : 32;
    template <int NJ>
    __host__ __device__ static constexpr bool staged() {
        return NJ <= 2 && S == 16;
    }
    template <int NJ>
    __host__ __device__ static constexpr int astage() {
        return staged<NJ>() ? NJ * (256 + 32 + SU) : 0;
    }
    // A warp's rings: D weight stages, then D + 1 activation stages (the block issued D ahead lands in the stage
    // of the block computed last, not the one being computed).
    template <int NJ>
    __host__ __device__ static constexpr int warp_bytes() {
        return D * stage + (staged<NJ>() ? (D + 1) * astage<NJ>() : 0);
    }
    // The block's dynamic shared memory: the warps' rings, then (after a barrier) the warps' subtree sums over
    // them.
    template <int NJ>
    __host__ __device__ static constexpr int bytes() {
        return S * warp_bytes<NJ>() > S * MMA_ROWS * 8 * NJ * 4 ? S * warp_bytes<NJ>() : S * MMA_ROWS * 8 * NJ * 4;
    }
    // The resident kernels (`…r`, RES): a block's activation bytes of one block of 32 columns (NJ columns of 8
    // tokens: codes, scales, sums), and its fixed part: the warps' weight rings of DR stages (never staged
    // activations; twice the 8-warp kernels' D: with fewer blocks a multiprocessor, as many weight bytes in
    // flight), then the warps' subtree sums beside them (the rings stay in use across tiles). Each warp's
    // resident activations follow: `qv_res_entries` blocks of `act` bytes (the host adds S·entries·act).
    template <int NJ>
    __host__ __device__ static constexpr int act() {
        return NJ * (256 + 32 + SU);
    }
    template <int NJ>
    __host__ __device__ static constexpr int res_fixed() {
        return S * DR * stage + S * MMA_ROWS * 8 * NJ * 4;
    }
};
// The most blocks of 32 columns a warp of a resident kernel visits in a tile (warp w: the chains of the classes
// rev5(V·w + k), k < V, class c holding the blocks c, c + 32, ... below nblk): the host's `qv_res_entries`.
__device__ __forceinline__ int qv_res_entries(int v, int nblk) {
    int most = 0;
    for (int w = 0; w < 32 / v; ++w) {
        int e = 0;
        for (int k = 0; k < v; ++k) {
            const int c = rev5(v * w + k);
            e += c < nblk ? (nblk - 1 - c) / 32 + 1 : 0;
        }
        most = max(most, e);
    }
    return most;
}

template <int NJ, bool P4, int FORM, int S, bool CL, bool RES>
__device__ __forceinline__ void mm_qv_impl(const QParts& PT, int cols, int halves, const unsigned char* __restrict__ tq,
                                           long long tg, int n) {
    using L = QvSmem<P4, FORM, S>;
    constexpr int V = 32 / S, LV = V == 8 ? 3 : (V == 4 ? 2 : (V == 2 ? 1 : 0)), NT = 8 * NJ;
    constexpr int CS = L::CS, RS = L::RS, SPB = L::SPB, D = RES ? L::DR : L::D;
    static_assert(S == 4 || S == 8 || S == 16, "4, 8 or 16 warps a tile");
    static_assert(L::stage % 16 == 0, "16-byte aligned stages");
    // RES (the `…r` kernels): a block walks the row tiles blockIdx.x, + gridDim.x, ... (a grid of the blocks that
    // fit at once), each warp's weight ring running on from one tile into the next, and each warp holds the
    // activations of the blocks it visits (the same in every tile) in shared memory, loaded once: a launch of
    // many tiles (the gate/up products, the LM head) reads the activations from L2 once a block instead of once
    // a tile (16 tokens through the LM head: as many bytes as its weights).
    static_assert(!(RES && CL), "resident kernels are not split over clusters");
    constexpr bool STG = !RES && L::template staged<NJ>(), ASM = STG || RES;
    constexpr int AST = RES ? L::template act<NJ>() : L::template astage<NJ>(), SU = L::SU;
    static_assert(AST % 16 == 0, "16-byte aligned activation stages");
    extern __shared__ __align__(16) unsigned char smem[];  // L::bytes<NJ>() (mm_qv_smem)
    __shared__ float csum[CL ? MMA_ROWS * NT : 1];  // the block's subtree sums, read by the cluster's block 0
    static_assert(L::template bytes<NJ>() + MMA_ROWS * NT * 4 <= 64 * 1024, "shared memory every sm_80+ GPU grants");
    float(&red)[S][MMA_ROWS * NT] = *reinterpret_cast<float(*)[S][MMA_ROWS * NT]>(smem + (RES ? S * D * L::stage : 0));
    // (RES: the warp's ring of D stages at warp·D·stage, its resident activations after the sums.)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.y * NT;
    // The row tiles this block walks: RES, blockIdx.x, + gridDim.x, ...; else blockIdx.x alone (a compile-time
    // single pass: a walk of run-time length kept the tile's state live and cost the other kernels registers).
    const int ntiles = RES ? PT.tiles() : 0, nwalk = RES ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 1;
    // CL (the `…c` kernels): a tile split over a cluster of SC blocks along z (the host keeps SC ≤ 32 / S): block
    // h owns the visits 32h/SC .. 32(h+1)/SC − 1, its warp w the VR = V / SC of them from VR·(S·h + w), i.e. the
    // subtree T(VR·(S·h + w), VR); the block's warps build T(32h/SC, 32/SC), and block 0 adds the SC block sums
    // in the binary tree over consecutive blocks: mm_q_t1's tree still.
    unsigned int sc_n = 1, sc_h = 0;
    if (CL) sc_h = cluster_rank_and_size(sc_n);
    const int VR = CL ? V / (int)sc_n : V, wv = VR * (S * (int)sc_h + warp);
    if (CL && VR == 0) __trap();  // a cluster larger than the visits (the host never launches one)
    const int nblk = cols >> 5;
    unsigned char(&ring)[D][L::stage] =
        *reinterpret_cast<unsigned char(*)[D][L::stage]>(smem + warp * (RES ? D * L::stage : L::template warp_bytes<NJ>()));
    // The activation stages (STG), or the warp's resident activations (RES: its blocks in walk order).
    unsigned char* const aring = RES ? smem + L::template res_fixed<NJ>() + warp * qv_res_entries(V, nblk) * AST
                                     : &ring[0][0] + D * L::stage;
    // This lane's copies of a stage: P4 lanes 0..15 row `lane`'s 16 code bytes, 8-bit lanes 0..31 half `lane & 1`
    // of row `lane >> 1`'s 32; lanes under 16·SPB one scale (row lane / SPB); lanes under 16 one offset (FORM 1).
    const int crow = P4 ? lane : lane >> 1, srow = lane / SPB;
    const uint8_t* cbase;
    const float *sbase, *mbase;
    int ip, ir0;  // the issuing tile's part and first row there
    // The issuing tile's copy sources (RES: the issue cursor moves to the block's next tile ahead of the walk).
    auto set_bases = [&](int t) {
        ip = PT.part(t, ir0);
        const int ir = QParts::pick(PT.r, ip);
        cbase = QParts::pick(PT.c, ip) + (long long)min(ir0 + min(crow, 15), ir - 1) * nblk * CS + (P4 ? 0 : (lane & 1) * 16);
        sbase = QParts::pick(PT.s, ip) + (long long)min(ir0 + min(srow, 15), ir - 1) * nblk * SPB + lane % SPB;
        mbase = FORM == 1 ? QParts::pick(PT.m, ip) + (long long)min(ir0 + min(lane, 15), ir - 1) * nblk : nullptr;
    };
    int itile = blockIdx.x;
    set_bases(itile);
    const int cdst = P4 ? lane * 16 : (lane >> 1) * RS + (lane & 1) * 16;
    // The issue cursor: visit ki's block bi, D blocks ahead of the compute walk (ki = VR: past the end).
    int ki = 0, bi = rev5(wv);
    auto norm = [&]() {
        while (ki < VR && bi >= nblk) {
            ++ki;
            bi = ki < VR ? rev5(wv + ki) : nblk;
        }
    };
    // The activations (STG): a block's come from L2 (every tile reads them), and loaded by the walk each sat
    // on its chain (ncu: long-scoreboard stalls 37 % of the 16-warp kernels' cycles). So they travel with the
    // block's weights, D blocks ahead, into activation stage (block's index in the walk) mod D + 1 — one more
    // stage than the weights, since they land while the previous block's are still being read. This lane's
    // copies of a block's (tiled copy QActOut, column j at (tile (t0 + 8j)/8, block 0, token 0) = abase +
    // j·nblk·8): codes chunk `lane` (16 chunks of 16 bytes a column: one a lane), then lanes under NJ·(2 + SU/16)
    // one chunk of the scales (2 a column) or of the sums (SU/16 a column). Only after the wait: the previous
    // kernel writes them.
    const long long abase = (long long)(t0 >> 3) * nblk * 8;
    const unsigned char* __restrict__ acsrc = tq + (abase + (long long)(lane >> 4) * nblk * 8) * 32 + (lane & 15) * 16;
    constexpr int NSC = 2 * NJ, NSU = NJ * (SU / 16);
    const int si = lane < NSC ? lane : lane - NSC, sj = lane < NSC ? si >> 1 : si / (SU / 16);
    const long long sjb = abase + (long long)sj * nblk * 8;
    const unsigned char* __restrict__ assrc =
        lane < NSC ? tq + 32 * tg + sjb * 4 + (si & 1) * 16
                   : (FORM == 2 ? tq + 44 * tg + sjb * 8 + (si % 4) * 16 : tq + (FORM == 1 ? 40 : 36) * tg + sjb * 4 + (si & 1) * 16);
    const int asstep = lane < NSC ? 32 : SU, asdst = lane < NSC ? NJ * 256 + lane * 16 : NJ * 288 + si * 16;
    auto issue_act = [&](int as, int b) {
        unsigned char* ad = aring + as * AST;
        // Code chunk c (column c / 16's chunk c % 16) by lane c % 32 (RES with NJ = 4: two a lane).
#pragma unroll
        for (int c = lane; c < 16 * NJ; c += 32)
            cp_async16(ad + c * 16, acsrc + (long long)((c >> 4) - (lane >> 4)) * nblk * 8 * 32 + (long long)b * 256);
        if (lane < NSC + NSU) cp_async16(ad + asdst, assrc + (long long)b * asstep);
    };
    bool acts = false;  // past the wait (the previous kernel writes the activations)
    int ais = 0;        // the activation stage of the next block issued
    auto issue = [&](int slot) {
        if (ki < VR) {
            unsigned char* st = ring[slot];
            if (P4 ? lane < 16 : true) cp_async16(st + cdst, cbase + (long long)bi * CS);
            if (lane < MMA_ROWS * SPB) cp_async4(st + L::scales + lane * 4, sbase + (long long)bi * SPB);
            if (FORM == 1 && lane < MMA_ROWS) cp_async4(st + L::mins + lane * 4, mbase + bi);
            if (STG && acts) {
                issue_act(ais, bi);
                ais = ais == D ? 0 : ais + 1;
            }
            bi += 32;
            norm();
            if (RES && ki >= VR && (itile += gridDim.x) < ntiles) {
                set_bases(itile);
                ki = 0;
                bi = rev5(wv);
                norm();
            }
        }
        cp_async_commit();
    };
    norm();
    // Weights are never written by a kernel: the first stages fly before the wait (programmatic launch).
#pragma unroll
    for (int i = 0; i < D; ++i) issue(i);
    pdl_wait();
    if (STG) {
        // The first D blocks' activations (their weights flew before the wait), waited for here: the walk's
        // stage waits count one group per block.
        int k = 0, b = rev5(wv);
#pragma unroll
        for (int i = 0; i < D; ++i) {
            while (k < VR && b >= nblk) {
                ++k;
                b = k < VR ? rev5(wv + k) : nblk;
            }
            if (k < VR) {
                issue_act(i, b);
                b += 32;
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        acts = true;
        ais = D;
    }
    if (RES) {
        // The warp's blocks' activations, once for every tile (read by the walk in the same order).
        int e = 0;
        for (int k = 0; k < VR; ++k)
            for (int b = rev5(wv + k); b < nblk; b += 32) issue_act(e++, b);
        cp_async_commit();
        cp_async_wait<0>();
        __syncwarp();
    }
    int acur = 0;  // the activation stage of the block computed next
    // This lane's operands in the tiled copy, per column j of 8 tokens (tile (t0 + 8j)/8; rows past n hold
    // whatever the buffer held: their outputs are not stored): the B fragment's words at 8g + 2q.. of the block's
    // 64 words; the scales and sums of tokens 2q, 2q + 1 side by side.
    const int2* pq[NJ];
    const float2* px[NJ];
    const int* ph[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const long long base = (long long)((t0 >> 3) + j) * nblk * 8;  // position of (tile, block 0, token 0)
        pq[j] = reinterpret_cast<const int2*>(tq + base * 32) + 4 * g + q;
        px[j] = reinterpret_cast<const float2*>(tq + 32 * tg) + (base >> 1) + q;
        ph[j] = FORM == 2 ? reinterpret_cast<const int*>(tq + 44 * tg) + 2 * base + 4 * q
                          : reinterpret_cast<const int*>(tq + (FORM == 1 ? 40 : 36) * tg) + base + 2 * q;
    }
    // The walk: visit k's chain (class rev5(V·warp + k)) block by block from the ring; after each chain, the
    // pairwise merge (compile time).
    float cur[NJ][4], st[LV > 0 ? LV : 1][NJ][4];
    int slot = 0;
    for (int it = 0; it < nwalk; ++it) {
        const int tile = blockIdx.x + (RES ? it * gridDim.x : 0);
        int r0 = ir0;  // (not RES: the issuing tile is this one)
        const int p = RES ? PT.part(tile, r0) : ip;
        const int half = QParts::half_of(halves, p), rows = QParts::pick(PT.r, p);
        int ei = 0;  // RES: the block's entry in the warp's resident activations
#pragma unroll
        for (int k = 0; k < V; ++k) {
            if (CL && k >= VR) break;  // a split tile: this warp's VR visits are done
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) cur[j][e] = 0.0f;
#pragma unroll 1
            for (int b = rev5(wv + k); b < nblk; b += 32) {
                cp_async_wait<D - 1>();
                __syncwarp();
                const unsigned char* stg = ring[slot];
                uint32_t a[4];
                if (P4) {
                    const uint32_t wa = *reinterpret_cast<const uint32_t*>(stg + g * RS + 4 * q);
                    const uint32_t wb = *reinterpret_cast<const uint32_t*>(stg + (g + 8) * RS + 4 * q);
                    a[0] = wa & 0x0F0F0F0Fu;
                    a[1] = wb & 0x0F0F0F0Fu;
                    a[2] = (wa >> 4) & 0x0F0F0F0Fu;
                    a[3] = (wb >> 4) & 0x0F0F0F0Fu;
                } else {
                    a[0] = *reinterpret_cast<const uint32_t*>(stg + g * RS + 4 * q);
                    a[1] = *reinterpret_cast<const uint32_t*>(stg + (g + 8) * RS + 4 * q);
                    a[2] = *reinterpret_cast<const uint32_t*>(stg + g * RS + 16 + 4 * q);
                    a[3] = *reinterpret_cast<const uint32_t*>(stg + (g + 8) * RS + 16 + 4 * q);
                }
                const float* ss = reinterpret_cast<const float*>(stg + L::scales);
                float s[2][2], m[2];
#pragma unroll
                for (int ri = 0; ri < 2; ++ri) {
                    s[ri][0] = ss[(g + 8 * ri) * SPB];
                    s[ri][1] = FORM == 2 ? ss[(g + 8 * ri) * SPB + 1] : 0.0f;
                    m[ri] = FORM == 1 ? reinterpret_cast<const float*>(stg + L::mins)[g + 8 * ri] : 0.0f;
                }
                __syncwarp();  // every lane has read the stage: refill it with the block D ahead
                issue(slot);
                slot = (slot + 1) & (D - 1);
                // Block b's activations (STG: from its stage; RES: resident).
                const unsigned char* ast = aring + (RES ? ei++ : acur) * AST;
                if (STG) acur = acur == D ? 0 : acur + 1;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    // Block b's 8 tokens (256 bytes, 32 int2), then tokens 2q, 2q + 1 of the column: their
                    // activation scales and (half·)sums; the dots arrive as floats (mma_k32c's accumulator inputs).
                    const int2 bb = ASM ? *reinterpret_cast<const int2*>(ast + j * 256 + (4 * g + q) * 8) : __ldg(pq[j] + 32 * b);
                    const int b0 = bb.x, b1 = bb.y;
                    const float2 dd = ASM ? *reinterpret_cast<const float2*>(ast + NJ * 256 + j * 32 + q * 8) : __ldg(px[j] + 4 * b);
                    const float d[2] = {dd.x, dd.y};
                    int hx[2], hy[2];
                    if (FORM == 2) {
                        const int4 hh = ASM ? *reinterpret_cast<const int4*>(ast + NJ * 288 + j * 64 + q * 16)
                                            : __ldg(reinterpret_cast<const int4*>(ph[j] + 16 * b));
                        hx[0] = hh.x;
                        hy[0] = hh.y;
                        hx[1] = hh.z;
                        hy[1] = hh.w;
                    } else {
                        const int2 hh = ASM ? *reinterpret_cast<const int2*>(ast + NJ * 288 + j * 32 + q * 8)
                                            : __ldg(reinterpret_cast<const int2*>(ph[j] + 8 * b));
                        hx[0] = hh.x;
                        hx[1] = hh.y;
                        hy[0] = hy[1] = 0;
                    }
                    int d0[4], d1[4];
                    if (FORM == 2) {
                        mma_k16c(d0, a[0], a[1], b0, QT_BIAS - half * hx[0], QT_BIAS - half * hx[1]);
                        mma_k16c(d1, a[2], a[3], b1, QT_BIAS - half * hy[0], QT_BIAS - half * hy[1]);
                    } else if (FORM == 1) {
                        mma_k32c(d0, a, b0, b1, QT_BIAS, QT_BIAS);
                    } else {
                        mma_k32c(d0, a, b0, b1, QT_BIAS - half * hx[0], QT_BIAS - half * hx[1]);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {  // row g (e < 2) or g + 8, token 2q + (e & 1)
                        const int ri = e >> 1, h = e & 1;
                        float acc = cur[j][e];
                        acc = __fmaf_rn(__fmul_rn(s[ri][0], d[h]), qt_float(d0[e]), acc);
                        if (FORM == 2) acc = __fmaf_rn(__fmul_rn(s[ri][1], d[h]), qt_float(d1[e]), acc);
                        if (FORM == 1) acc = __fmaf_rn(m[ri], __int_as_float(hx[h]), acc);
                        cur[j][e] = acc;
                    }
                }
            }
            // Chain k meets the finished subtrees of k's trailing one bits (T(i, 2s) = T(i, s) + T(i + s, s)).
            int l = 0;
#pragma unroll
            for (; l < LV && ((k >> l) & 1); ++l)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) cur[j][e] = __fadd_rn(st[l][j][e], cur[j][e]);
            if (l < LV) {
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[l][j][e] = cur[j][e];
            }
        }
        if (!RES) {
            cp_async_wait<0>();  // no copy outlives the block (the tail's issues were empty groups)
            __syncthreads();     // every warp is done with its ring: the sums go over the rings
        }
        // After the last visit (k = VR - 1, all ones) cur holds the warp's subtree T(wv, VR).
        float(&res)[NJ][4] = cur;
        // The warps' subtrees meet in the binary tree over consecutive warps, then the bias.
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][(8 * j + 2 * q + (e & 1)) * MMA_ROWS + g + 8 * (e >> 1)] = res[j][e];
        __syncthreads();
        const float* __restrict__ bias = QParts::pick(PT.b, p);
        float* __restrict__ out = QParts::pick(PT.o, p);
        for (int o = tid; o < MMA_ROWS * NT; o += 32 * S) {
            float x[S];
#pragma unroll
            for (int i = 0; i < S; ++i) x[i] = red[i][o];
#pragma unroll
            for (int s = 1; s < S; s <<= 1)
#pragma unroll
                for (int i = 0; i < S; i += 2 * s) x[i] = __fadd_rn(x[i], x[i + s]);
            if (CL && sc_n > 1) {
                csum[o] = x[0];
                continue;
            }
            const int gr = r0 + o % MMA_ROWS, t = t0 + o / MMA_ROWS;
            if (gr < rows && t < n) out[(long long)t * rows + gr] = bias != nullptr ? __fadd_rn(x[0], bias[gr]) : x[0];
        }
        if (CL && sc_n > 1) {
            cluster_barrier_shared();  // every block's sums are in its shared memory (only shared stores to release)
            if (sc_h == 0) {
                for (int o = tid; o < MMA_ROWS * NT; o += 32 * S) {
                    float x[8];  // SC ≤ 8 (S ≥ 4)
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        if (i < (int)sc_n) x[i] = i == 0 ? csum[o] : ld_cluster_shared_f32(&csum[o], i);
#pragma unroll
                    for (int s = 1; s < 8; s <<= 1)
#pragma unroll
                        for (int i = 0; i < 8; i += 2 * s)
                            if (i + s < (int)sc_n) x[i] = __fadd_rn(x[i], x[i + s]);
                    const int gr = r0 + o % MMA_ROWS, t = t0 + o / MMA_ROWS;
                    if (gr < rows && t < n) out[(long long)t * rows + gr] = bias != nullptr ? __fadd_rn(x[0], bias[gr]) : x[0];
                }
            }
            cluster_barrier();  // no block leaves while block 0 may still read its sums
        }
        if (RES) __syncthreads();  // the sums' buffer serves the next tile
    }
    if (RES) cp_async_wait<0>();  // (the issues past the last tile were empty groups)
}

// One matrix (`mm_qv{NJ}_f{F}_{p4,p8}_w{S}`) and up to three (`mm_q3v…`, the parts' arguments as MM_Q3's).
// Grid: (row tiles of 16, summed over the parts; token tiles of 8·NJ); block 32·S threads.
// Blocks a multiprocessor should hold at once (registers capped to fit them): 1 (no cap; capping to 24 warps
// spilled the group-16 variants).
#define QV_MINB(S) 1
#define MM_QV_PX(NJ, F, P4, PS, S, CL, RES, SUF)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * S, QV_MINB(S)) mm_qv##NJ##_f##F##_##PS##_w##S##SUF(                      \
        const uint8_t* codes, const float* sc, const float* mn, int rows, int cols, int half, int g16,       \
        const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, const int* xsum16, int n,    \
        const float* bias, float* out, const unsigned char* tq, long long tg) {                              \
        (void)g16, (void)xq, (void)xs, (void)xsum, (void)xdsum, (void)xsum16;                                \
        const QParts pt = {{codes, nullptr, nullptr}, {sc, nullptr, nullptr}, {mn, nullptr, nullptr},        \
                           {bias, nullptr, nullptr},  {out, nullptr, nullptr}, {rows, 0, 0},                  \
                           (rows + MMA_ROWS - 1) / MMA_ROWS, 0};                                             \
        mm_qv_impl<NJ, P4, F, S, CL, RES>(pt, cols, half, tq, tg, n);                                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * S, QV_MINB(S)) mm_q3v##NJ##_f##F##_##PS##_w##S##SUF(                     \
        int cols, int half, int g16, const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, \
        const int* xsum16, int n, const uint8_t* c0, const float* s0, const float* m0, int r0,               \
        const float* b0, float* o0, const uint8_t* c1, const float* s1, const float* m1, int r1,             \
        const float* b1, float* o1, const uint8_t* c2, const float* s2, const float* m2, int r2,             \
        const float* b2, float* o2, const unsigned char* tq, long long tg) {                                 \
        (void)g16, (void)xq, (void)xs, (void)xsum, (void)xdsum, (void)xsum16;                                \
        const QParts pt = QPARTS3;                                                                           \
        mm_qv_impl<NJ, P4, F, S, CL, RES>(pt, cols, half, tq, tg, n);                                           \
    }
// The kernels (`…_w{S}`) and their cluster-split forms (`…_w{S}c`, launched in clusters along z).
#define MM_QV_P(NJ, F, P4, PS, S) MM_QV_PX(NJ, F, P4, PS, S, false, false, ) MM_QV_PX(NJ, F, P4, PS, S, true, false, c)
MM_FAMILY(MM_QV_P, 4, 8, 16)
// And tiles of 32 tokens (17–32 in one pass over the weights).
#define MM_QV4(F, S) MM_PACKINGS(MM_QV_P, 4, F, S)
MM_QV4(0, 4) MM_QV4(0, 8) MM_QV4(0, 16) MM_QV4(1, 4) MM_QV4(1, 8) MM_QV4(1, 16) MM_QV4(2, 4) MM_QV4(2, 8) MM_QV4(2, 16)
// Dynamic shared memory bytes of each variant, [S 4, 8, 16][NJ 1, 2, 4][FORM][p4, p8], read by the host (the
// cluster-split forms take the same).
#define QVB(NJ, F, S) QvSmem<true, F, S>::template bytes<NJ>(), QvSmem<false, F, S>::template bytes<NJ>()
#define QVB_NJ(NJ, S) QVB(NJ, 0, S), QVB(NJ, 1, S), QVB(NJ, 2, S)
#define QVB_S(S) QVB_NJ(1, S), QVB_NJ(2, S), QVB_NJ(4, S)
extern "C" __device__ const int mm_qv_smem[54] = {QVB_S(4), QVB_S(8), QVB_S(16)};
// The resident kernels (`…_w8r`, RES; 8 warps, grid: the blocks that fit at once, each walking row tiles
// blockIdx.x, + gridDim.x, ...) and their shared memory, [NJ 1, 2, 4][FORM][p4, p8][fixed bytes, bytes a
// resident block of 32 columns]: the host asks for fixed + 8·qv_res_entries(4, cols / 32)·(bytes a block).
#define MM_QV_R(NJ, F, P4, PS, S) MM_QV_PX(NJ, F, P4, PS, S, false, true, r)
MM_PACKINGS(MM_QV_R, 1, 0, 8) MM_PACKINGS(MM_QV_R, 1, 1, 8) MM_PACKINGS(MM_QV_R, 1, 2, 8)
MM_PACKINGS(MM_QV_R, 2, 0, 8) MM_PACKINGS(MM_QV_R, 2, 1, 8) MM_PACKINGS(MM_QV_R, 2, 2, 8)
MM_PACKINGS(MM_QV_R, 4, 0, 8) MM_PACKINGS(MM_QV_R, 4, 1, 8) MM_PACKINGS(MM_QV_R, 4, 2, 8)
#define QVR(NJ, F)                                                                                  \
    QvSmem<true, F, 8>::template res_fixed<NJ>(), QvSmem<true, F, 8>::template act<NJ>(),          \
        QvSmem<false, F, 8>::template res_fixed<NJ>(), QvSmem<false, F, 8>::template act<NJ>()
#define QVR_NJ(NJ) QVR(NJ, 0), QVR(NJ, 1), QVR(NJ, 2)
extern "C" __device__ const int mm_qvr_smem[36] = {QVR_NJ(1), QVR_NJ(2), QVR_NJ(4)};

// ---------------------------------------------------------------------------------------------------------
// mm_qt*: the large products (prefill) on the tensor cores with large tiles, in mm_q_t1's float order.
//
// mm_q_t1's output is T(0, 32), the binary tree over the visits i = 0..31 of the classes rev5(i) (above), and
// class c's chain P_c runs over the row's blocks c, c + 32, ... in increasing order. A chain reads its own blocks
// only, so one warp can run the chains one after the other in visit order and build the tree as it goes
// (pairwise summation: after visit i its chain meets the finished subtrees of i's trailing one bits,
// T(i + 1 - 2^k, 2^k) = T(i + 1 - 2^k, 2^(k-1)) + T(i + 1 - 2^(k-1), 2^(k-1))). Per output that keeps one running
// chain and at most five subtree sums alive instead of 32 chains, so no sums cross warps and the tiles can
// grow: warp w of QT_WARPS = 8 covers 16 rows x 8·NJ tokens of the whole row (rows 16·(w % 4), tokens
// 8·NJ·(w / 4)), the block 64 rows x 16·NJ tokens. The row's blocks are visited in the order of the chains (the
// sequence seq: class rev5(0)'s blocks, then rev5(1)'s, ...), staged QT_G at a time in shared memory with
// cp.async, QtSmem::STAGES deep (offsets in 32 bits: the host keeps a matrix's codes and a launch's activation
// codes under 2^31 bytes); a stage's positions run unrolled, and after a chain's last block (fin) the chain
// merges, then the empty chains of the visits after it (classes past the row's last block) merge as 0. Per block and mma the int32 dots come from one m16n8k32 per 8 tokens (two m16n8k16
// for group-16 scales); the accumulator input C carries 0x4B400000 - half·Σx, so the result's bits are the float
// 1.5·2^23 + (dot - half·Σx) (|dot - half·Σx| < 2^22) and one subtraction gives exactly the float mm_q_t1's
// conversion gives, at the full float rate; then mm_q_t1's one or two __fmaf_rn. Fragments by ldmatrix
// (PTX ISA, "Warp-level matrix load instruction: ldmatrix"; 8-bit codes as pairs of 16-bit elements: matrix 0
// rows 0-7 bytes 0-15 gives a0, matrix 1 rows 8-15 a1, matrix 2 rows 0-7 bytes 16-31 a2, matrix 3 a3).
#define QT_WARPS 8
#define QT_ROWS 64
#define QT_G 8
// Most 32-value blocks of a row (the visit sequence's table in shared memory, 16 bits each).
#define QT_MAXB 1024
#define QT_SMEM_MAX (99 * 1024)

template <int NJ, bool P4, int FORM>
struct QtSmem {
    static constexpr int BN = 16 * NJ;             // tokens per block
    static constexpr int CS = P4 ? 16 : 32;        // code bytes per block of 32
    static constexpr int CPB = CS / 16;            // 16-byte copies per block of codes
    static constexpr int RS = QT_G * CS + 16;      // bytes per weight row of a stage (padded: ldmatrix rows hit distinct banks)
    static constexpr int AS = QT_G * 32 + 16;      // bytes per token of a stage (padded)
    static constexpr int SPB = FORM == 2 ? 2 : 1;  // scales (and token sums) per block
    static constexpr int codes = 0;
    static constexpr int acts = codes + QT_ROWS * RS;
    static constexpr int scales = acts + BN * AS;                     // [slot·SPB + k][row] f32
    static constexpr int mins = scales + QT_G * SPB * QT_ROWS * 4;    // [slot][row] f32 (FORM 1)
    static constexpr int xs = mins + (FORM == 1 ? QT_G * QT_ROWS * 4 : 0);  // [slot][token] f32
    static constexpr int hs = xs + QT_G * BN * 4;                     // [slot·SPB + k][token] i32 (f32 bits for FORM 1)
    static constexpr int stage = (hs + QT_G * SPB * BN * 4 + 127) / 128 * 128;
    static constexpr int STAGES = 3 * stage + 3 * QT_MAXB <= QT_SMEM_MAX ? 3 : 2;
    static constexpr int seq = STAGES * stage;                        // the visit sequence, u16 per block
    static constexpr int bytes = seq + 3 * QT_MAXB;  // seq (u16) and fin (u8) per block
    static_assert(bytes <= QT_SMEM_MAX, "the stages and the sequence in QT_SMEM_MAX bytes");
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
// Blocks of class c in a row of nblk blocks.
__device__ __forceinline__ int qt_count(int c, int nblk) { return c < nblk ? ((nblk - 1 - c) >> 5) + 1 : 0; }

template <int NJ, bool P4, int FORM>
__device__ __forceinline__ void mm_qt_impl(const QParts& PT, int cols, int half, const int8_t* __restrict__ xq,
                                           const float* __restrict__ xs, const int* __restrict__ xsum,
                                           const float* __restrict__ xdsum, const int* __restrict__ xsum16, int n) {
    using L = QtSmem<NJ, P4, FORM>;
    constexpr int T = 32 * QT_WARPS, BN = L::BN, CS = L::CS, CPB = L::CPB, SPB = L::SPB, G = QT_G;
    constexpr int NE = 4 * NJ;  // outputs of a thread
    extern __shared__ __align__(128) unsigned char qt_smem[];  // L::bytes (mm_qt_smem)
    unsigned char* const sm = qt_smem;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int wr = warp & 3, wt = warp >> 2;
    const int nblk = cols >> 5;
    // Row tile -> part (the host passes the parts' tile counts of QT_ROWS rows in nb0 / nb1).
    int r0;
    const int p = PT.part(blockIdx.x, r0, QT_ROWS);
    half = QParts::half_of(half, p);
    const uint8_t* __restrict__ codes = QParts::pick(PT.c, p);
    const float* __restrict__ sc = QParts::pick(PT.s, p);
    const float* __restrict__ mn = QParts::pick(PT.m, p);
    const int rows = QParts::pick(PT.r, p);
    const int t0 = blockIdx.y * BN;
    // The visit sequence: block b (class c = b % 32, j = b / 32) at position start(rev5(c)) + j.
    uint16_t* const seq = reinterpret_cast<uint16_t*>(sm + L::seq);
    unsigned char* const fin = sm + L::seq + 2 * QT_MAXB;
    for (int b = tid; b < nblk; b += T) {
        const int v = rev5(b & 31);
        int s = 0;
        for (int i = 0; i < v; ++i) s += qt_count(rev5(i), nblk);
        seq[s + (b >> 5)] = (uint16_t)b;
        fin[s + (b >> 5)] = b + 32 >= nblk;  // the last block of its class
    }
    const int nst = (nblk + G - 1) / G;  // stages of the row
    pdl_wait();
    __syncthreads();  // the sequence is written
    // Stage k: positions k·G .. k·G + G - 1 of the sequence.
    auto issue = [&](int k, unsigned char* buf) {
        const int p0 = k * G, ns = min(G, nblk - p0);
#pragma unroll
        for (int u = 0; u < (QT_ROWS * G * CPB + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i / (G * CPB), sl = (i / CPB) % G, h = i % CPB;
            if (i < QT_ROWS * G * CPB && sl < ns) {
                const int bk = seq[p0 + sl];
                cp_async16(buf + L::codes + r * L::RS + sl * CS + h * 16,
                           codes + ((unsigned)(min(r0 + r, rows - 1) * nblk + bk) * CS + h * 16));
            }
        }
#pragma unroll
        for (int u = 0; u < (BN * G * 2 + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i / (2 * G), sl = (i >> 1) % G, h = i & 1;
            if (i < BN * G * 2 && sl < ns) {
                const int bk = seq[p0 + sl];
                cp_async16(buf + L::acts + t * L::AS + sl * 32 + h * 16,
                           xq + ((unsigned)min(t0 + t, n - 1) * cols + bk * 32 + h * 16));
            }
        }
#pragma unroll
        for (int u = 0; u < (QT_ROWS * G * SPB + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i % QT_ROWS, sk = i / QT_ROWS, sl = sk / SPB;
            if (i < QT_ROWS * G * SPB && sl < ns) {
                const int bk = seq[p0 + sl];
                cp_async4(buf + L::scales + (sk * QT_ROWS + r) * 4,
                          sc + ((unsigned)(min(r0 + r, rows - 1) * nblk + bk) * SPB + sk % SPB));
            }
        }
        if (FORM == 1) {
#pragma unroll
            for (int u = 0; u < (QT_ROWS * G + T - 1) / T; ++u) {
                const int i = tid + u * T, r = i % QT_ROWS, sl = i / QT_ROWS;
                if (i < QT_ROWS * G && sl < ns)
                    cp_async4(buf + L::mins + (sl * QT_ROWS + r) * 4, mn + ((unsigned)min(r0 + r, rows - 1) * nblk + seq[p0 + sl]));
            }
        }
#pragma unroll
        for (int u = 0; u < (BN * G + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i % BN, sl = i / BN;
            if (i < BN * G && sl < ns)
                cp_async4(buf + L::xs + (sl * BN + t) * 4, xs + ((unsigned)min(t0 + t, n - 1) * nblk + seq[p0 + sl]));
        }
#pragma unroll
        for (int u = 0; u < (BN * G * SPB + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i % BN, sk = i / BN, sl = sk / SPB;
            if (i < BN * G * SPB && sl < ns) {
                const unsigned at = (unsigned)min(t0 + t, n - 1) * nblk + seq[p0 + sl];
                const void* src = FORM == 2 ? (const void*)(xsum16 + 2 * at + sk % SPB)
                                            : (FORM == 1 ? (const void*)(xdsum + at) : (const void*)(xsum + at));
                cp_async4(buf + L::hs + (sk * BN + t) * 4, src);
            }
        }
    };
#pragma unroll
    for (int k = 0; k < L::STAGES - 1; ++k) {
        if (k < nst) issue(k, sm + k * L::stage);
        cp_async_commit();
    }
    // This lane's ldmatrix rows: weights (row, byte offset) and tokens of each pair of mma columns.
    const int arow = 16 * wr + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 16;
    const int brow = 8 * NJ * wt + (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 16;
    const int tb = 8 * NJ * wt;  // the warp's first token in the tile
    float cur[NE], st[5][NE];
#pragma unroll
    for (int e = 0; e < NE; ++e) {
        cur[e] = 0.0f;
#pragma unroll
        for (int l = 0; l < 5; ++l) st[l][e] = 0.0f;
    }
    // After the last block of visit v's chain: the chain meets the finished subtrees of v's trailing one bits
    // (warp-uniform branch), then the chain restarts at 0.
    auto merge = [&](int v) {
        switch (__ffs(~v) - 1) {
            case 0:
#pragma unroll
                for (int e = 0; e < NE; ++e) st[0][e] = cur[e];
                break;
            case 1:
#pragma unroll
                for (int e = 0; e < NE; ++e) st[1][e] = __fadd_rn(st[0][e], cur[e]);
                break;
            case 2:
#pragma unroll
                for (int e = 0; e < NE; ++e) st[2][e] = __fadd_rn(st[1][e], __fadd_rn(st[0][e], cur[e]));
                break;
            case 3:
#pragma unroll
                for (int e = 0; e < NE; ++e) st[3][e] = __fadd_rn(st[2][e], __fadd_rn(st[1][e], __fadd_rn(st[0][e], cur[e])));
                break;
            case 4:
#pragma unroll
                for (int e = 0; e < NE; ++e)
                    st[4][e] = __fadd_rn(st[3][e], __fadd_rn(st[2][e], __fadd_rn(st[1][e], __fadd_rn(st[0][e], cur[e]))));
                break;
            default:  // v = 31: the whole tree, kept in cur
#pragma unroll
                for (int e = 0; e < NE; ++e)
                    cur[e] = __fadd_rn(st[4][e], __fadd_rn(st[3][e], __fadd_rn(st[2][e], __fadd_rn(st[1][e], __fadd_rn(st[0][e], cur[e])))));
                return;
        }
#pragma unroll
        for (int e = 0; e < NE; ++e) cur[e] = 0.0f;
    };
    // Visits whose class has no block before the first block: none in practice (visit 0 is class 0, which has a
    // block whenever the row has one), kept as the general rule.
    int vis = 0;
    while (qt_count(rev5(vis), nblk) == 0) merge(vis++);
#pragma unroll 1
    for (int k = 0; k < nst; ++k) {
        cp_async_wait<L::STAGES - 2>();
        __syncthreads();  // stage k visible to all; stage k - 1's buffer free
        if (k + L::STAGES - 1 < nst) issue(k + L::STAGES - 1, sm + ((k + L::STAGES - 1) % L::STAGES) * L::stage);
        cp_async_commit();
        const unsigned char* const cb = sm + (k % L::STAGES) * L::stage;
        const float* const cf = reinterpret_cast<const float*>(cb);
        const int* const ci = reinterpret_cast<const int*>(cb);
        const int ns = min(G, nblk - k * G);
#pragma unroll
        for (int sl = 0; sl < G; ++sl) {
            if (sl < ns) {
            uint32_t a[4];
            if (P4) {
                uint32_t w2[2];
                ldsm_x2(w2, cb + L::codes + arow * L::RS + sl * CS);
                a[0] = w2[0] & 0x0F0F0F0Fu;
                a[1] = w2[1] & 0x0F0F0F0Fu;
                a[2] = (w2[0] >> 4) & 0x0F0F0F0Fu;
                a[3] = (w2[1] >> 4) & 0x0F0F0F0Fu;
            } else {
                ldsm_x4(a, cb + L::codes + arow * L::RS + sl * CS + acol);
            }
            float s[2][SPB], m[2];
#pragma unroll
            for (int ri = 0; ri < 2; ++ri) {
#pragma unroll
                for (int k2 = 0; k2 < SPB; ++k2) s[ri][k2] = cf[L::scales / 4 + (sl * SPB + k2) * QT_ROWS + 16 * wr + g + 8 * ri];
                m[ri] = FORM == 1 ? cf[L::mins / 4 + sl * QT_ROWS + 16 * wr + g + 8 * ri] : 0.0f;
            }
#pragma unroll
            for (int jp = 0; jp < NJ / 2; ++jp) {
                uint32_t b[4];
                ldsm_x4(b, cb + L::acts + (brow + 16 * jp) * L::AS + sl * 32 + bcol);
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    const int j = 2 * jp + jj, tok = tb + 8 * j + 2 * q;
                    const float2 d = *reinterpret_cast<const float2*>(cf + L::xs / 4 + sl * BN + tok);
                    const float dd[2] = {d.x, d.y};
                    int r[4], r2[4];
                    int2 h0 = make_int2(0, 0), h1 = h0;
                    if (FORM != 1) h0 = *reinterpret_cast<const int2*>(ci + L::hs / 4 + (sl * SPB) * BN + tok);
                    if (FORM == 2) h1 = *reinterpret_cast<const int2*>(ci + L::hs / 4 + (sl * SPB + 1) * BN + tok);
                    if (FORM == 2) {
                        mma_k16c(r, a[0], a[1], (int)b[2 * jj], QT_BIAS - half * h0.x, QT_BIAS - half * h0.y);
                        mma_k16c(r2, a[2], a[3], (int)b[2 * jj + 1], QT_BIAS - half * h1.x, QT_BIAS - half * h1.y);
                    } else if (FORM == 1) {
                        mma_k32c(r, a, (int)b[2 * jj], (int)b[2 * jj + 1], QT_BIAS, QT_BIAS);
                    } else {
                        mma_k32c(r, a, (int)b[2 * jj], (int)b[2 * jj + 1], QT_BIAS - half * h0.x, QT_BIAS - half * h0.y);
                    }
                    float ds[2] = {0.0f, 0.0f};
                    if (FORM == 1) {
                        const float2 x2 = *reinterpret_cast<const float2*>(cf + L::hs / 4 + sl * BN + tok);
                        ds[0] = x2.x;
                        ds[1] = x2.y;
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int ri = e >> 1, ti = e & 1;  // row g or g+8; token 2q or 2q+1
                        float acc = cur[4 * j + e];
                        acc = __fmaf_rn(__fmul_rn(s[ri][0], dd[ti]), qt_float(r[e]), acc);
                        if (FORM == 2) acc = __fmaf_rn(__fmul_rn(s[ri][SPB - 1], dd[ti]), qt_float(r2[e]), acc);
                        if (FORM == 1) acc = __fmaf_rn(m[ri], ds[ti], acc);
                        cur[4 * j + e] = acc;
                    }
                }
            }
            // The last block of visit vis's chain: merge it, and the empty chains of the visits after it.
            if (fin[k * G + sl]) {
                merge(vis++);
                while (vis < 32 && qt_count(rev5(vis), nblk) == 0) merge(vis++);
            }
            }
        }
    }
    cp_async_wait<0>();
    const float* __restrict__ bias = QParts::pick(PT.b, p);
    float* __restrict__ out = QParts::pick(PT.o, p);
#pragma unroll
    for (int e = 0; e < NE; ++e) {
        const int j = e >> 2, gr = r0 + 16 * wr + g + 8 * ((e >> 1) & 1), t = t0 + tb + 8 * j + 2 * q + (e & 1);
        if (gr < rows && t < n) out[(long long)t * rows + gr] = bias != nullptr ? __fadd_rn(cur[e], bias[gr]) : cur[e];
    }
}

// Dynamic shared memory bytes of each variant, [FORM][p4, p8], read by the host. (NJ = 4, a 64 x 64 tile,
// needs more than the 128 registers two blocks a multiprocessor allow: it spilled and ran 15 % slower.)
#define QTB(NJ, F) QtSmem<NJ, true, F>::bytes, QtSmem<NJ, false, F>::bytes
extern "C" __device__ const int mm_qt_smem[6] = {QTB(2, 0), QTB(2, 1), QTB(2, 2)};

// One matrix (`mm_qt{NJ}_f{F}_{p4,p8}`) and up to three (`mm_q3t…`, the parts' arguments as MM_Q3's). Grid: (row
// tiles of QT_ROWS, summed over the parts; token tiles of 16·NJ).
#define QT_BOUNDS __launch_bounds__(32 * QT_WARPS, 2)
#define MM_QT_P(NJ, F, P4, PS)                                                                               \
    extern "C" __global__ void QT_BOUNDS mm_qt##NJ##_f##F##_##PS(                                             \
        const uint8_t* codes, const float* sc, const float* mn, int rows, int cols, int half, int g16,       \
        const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, const int* xsum16, int n,    \
        const float* bias, float* out) {                                                                     \
        (void)g16;                                                                                           \
        const QParts pt = {{codes, nullptr, nullptr}, {sc, nullptr, nullptr}, {mn, nullptr, nullptr},        \
                           {bias, nullptr, nullptr},  {out, nullptr, nullptr}, {rows, 0, 0},                  \
                           (rows + QT_ROWS - 1) / QT_ROWS, 0};                                               \
        mm_qt_impl<NJ, P4, F>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n);                              \
    }                                                                                                        \
    extern "C" __global__ void QT_BOUNDS mm_q3t##NJ##_f##F##_##PS(                                            \
        int cols, int half, int g16, const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, \
        const int* xsum16, int n, const uint8_t* c0, const float* s0, const float* m0, int r0,               \
        const float* b0, float* o0, const uint8_t* c1, const float* s1, const float* m1, int r1,             \
        const float* b1, float* o1, const uint8_t* c2, const float* s2, const float* m2, int r2,             \
        const float* b2, float* o2) {                                                                        \
        (void)g16;                                                                                           \
        const QParts pt = {{c0, c1, c2}, {s0, s1, s2}, {m0, m1, m2}, {b0, b1, b2}, {o0, o1, o2}, {r0, r1, r2}, \
                           (r0 + QT_ROWS - 1) / QT_ROWS, (r1 + QT_ROWS - 1) / QT_ROWS};                      \
        mm_qt_impl<NJ, P4, F>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n);                              \
    }
#define MM_QT(NJ, F)                \
    MM_QT_P(NJ, F, true, p4)        \
    MM_QT_P(NJ, F, false, p8)
MM_QT(2, 0)
MM_QT(2, 1)
MM_QT(2, 2)

// ---------------------------------------------------------------------------------------------------------
// mm_qp*: products of more than QV_MAX (64) tokens — prefill runs — in block order.
//
// Batch invariance is owed to 1..64 tokens only (speculation verifies at most 64 tokens a pass; the engine caps
// trees to Backend::invariant_tokens). A prefill run's rows need not equal a one-token product's bits, only be
// deterministic, so these kernels drop mm_q_t1's tree: every output adds its blocks' terms (the same term as
// mm_q_t1's: the exact int32 dot, then its one or two __fmaf_rn) in increasing block order, one chain per output.
// The result depends only on the row's and the token's data, never on n, the tile or the grid (so one token's
// rows are the same in every launch of 65+ tokens), and it differs from mm_q_t1's by the float reassociation of a
// sum only. What that buys: no per-class chains, merges or visit tables (mm_qt* spends ~50 instructions a mma on
// them), and warp tiles of 32 rows × 32 tokens (8 mma a block of 32 from 2 A and 2 B fragment loads).
//
// Block: WR × QP_WT = 2 × 2 warps, tile BM = 32·WR = 64 rows × QP_BN = 64 tokens; warp (wr, wt) owns rows
// 32·wr .. 32·wr + 31 and tokens 32·wt .. 32·wt + 31 of it (two m16 × four n8 mma tiles). (Tiles of 32 rows, WR = 1,
// twice the blocks for launches that do not fill the GPU, measured slower at every 1.5B shape, 256 and 512 tokens:
// docs/cuda.md.) The row's
// blocks are staged QP_G at a time in shared memory with cp.async, QP_STAGES deep: codes and activation codes by
// 16-byte copies (rows padded by 16 bytes so the ldmatrix rows hit distinct banks), scales, offsets, token
// scales and token sums by 4-byte copies in each row's (token's) order, stored per slot with 8 words of padding.
// The accumulator input carries QT_BIAS − half·Σx as in mm_qt (one float subtraction gives mm_q_t1's converted
// dot exactly).
#define QP_WT 2
#define QP_BN 64
#define QP_G 4
#define QP_STAGES 3

template <int WR, bool P4, int FORM>
struct QpSmem {
    static constexpr int BM = 32 * WR;               // rows per block
    static constexpr int BN = QP_BN;                 // tokens per block
    static constexpr int G = QP_G;                   // blocks of 32 per stage
    static constexpr int CS = P4 ? 16 : 32;          // code bytes per block of 32
    static constexpr int CPB = CS / 16;              // 16-byte copies per block of codes
    static constexpr int RS = G * CS + 16;           // bytes per weight row of a stage (padded)
    static constexpr int AS = G * 32 + 16;           // bytes per token of a stage (padded)
    static constexpr int SPB = FORM == 2 ? 2 : 1;    // scales (and token sums) per block
    static constexpr int MP = BM + 8;                // words per slot of row data (padded)
    static constexpr int NP = BN + 8;                // words per slot of token data (padded)
    static constexpr int codes = 0;
    static constexpr int acts = codes + BM * RS;
    static constexpr int scales = acts + BN * AS;                       // [slot·SPB + k][MP] f32
    static constexpr int mins = scales + G * SPB * MP * 4;              // [slot][MP] f32 (FORM 1)
    static constexpr int xs = mins + (FORM == 1 ? G * MP * 4 : 0);      // [slot][NP] f32
    static constexpr int hs = xs + G * NP * 4;                          // [slot·SPB + k][NP] i32 (f32 for FORM 1)
    static constexpr int stage = (hs + G * SPB * NP * 4 + 127) / 128 * 128;
    static constexpr int bytes = QP_STAGES * stage;
};

template <int WR, bool P4, int FORM>
__device__ __forceinline__ void mm_qp_impl(const QParts& PT, int cols, int half, const int8_t* __restrict__ xq,
                                           const float* __restrict__ xs, const int* __restrict__ xsum,
                                           const float* __restrict__ xdsum, const int* __restrict__ xsum16, int n) {
    using L = QpSmem<WR, P4, FORM>;
    constexpr int T = 32 * WR * QP_WT, BM = L::BM, BN = L::BN, CS = L::CS, CPB = L::CPB, SPB = L::SPB, G = QP_G;
    constexpr int MP = L::MP, NP = L::NP;
    extern __shared__ __align__(128) unsigned char qp_smem[];  // L::bytes (mm_qp_smem)
    unsigned char* const sm = qp_smem;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int wr = warp % WR, wt = warp / WR;
    const int nblk = cols >> 5;
    // Row tile -> part (the host passes the parts' tile counts of BM rows in nb0 / nb1).
    int r0;
    const int p = PT.part(blockIdx.x, r0, BM);
    half = QParts::half_of(half, p);
    const uint8_t* __restrict__ codes = QParts::pick(PT.c, p);
    const float* __restrict__ sc = QParts::pick(PT.s, p);
    const float* __restrict__ mn = QParts::pick(PT.m, p);
    const int rows = QParts::pick(PT.r, p);
    const int t0 = blockIdx.y * BN;
    const int nst = (nblk + G - 1) / G;  // stages of the row
    pdl_wait();
    // Stage k: blocks k·G .. k·G + G − 1 of every row of the tile and of every token.
    auto issue = [&](int k, unsigned char* buf) {
        const int b0 = k * G, ns = min(G, nblk - b0);
#pragma unroll
        for (int u = 0; u < (BM * G * CPB + T - 1) / T; ++u) {
            const int i = tid + u * T, r = i / (G * CPB), sl = (i / CPB) % G, h = i % CPB;
            if (i < BM * G * CPB && sl < ns)
                cp_async16(buf + L::codes + r * L::RS + sl * CS + h * 16,
                           codes + ((size_t)min(r0 + r, rows - 1) * nblk + b0 + sl) * CS + h * 16);
        }
#pragma unroll
        for (int u = 0; u < (BN * G * 2 + T - 1) / T; ++u) {
            const int i = tid + u * T, t = i / (2 * G), sl = (i >> 1) % G, h = i & 1;
            if (i < BN * G * 2 && sl < ns)
                cp_async16(buf + L::acts + t * L::AS + sl * 32 + h * 16,
                           xq + (size_t)min(t0 + t, n - 1) * cols + (b0 + sl) * 32 + h * 16);
        }
#pragma unroll
        for (int u = 0; u < (BM * G * SPB + T - 1) / T; ++u) {
            const int i = tid + u * T, sk = i % (G * SPB), r = i / (G * SPB), sl = sk / SPB;
            if (i < BM * G * SPB && sl < ns)
                cp_async4(buf + L::scales + (sk * MP + r) * 4, sc + ((size_t)min(r0 + r, rows - 1) * nblk + b0) * SPB + sk);
        }
        if (FORM == 1) {
#pragma unroll
            for (int u = 0; u < (BM * G + T - 1) / T; ++u) {
                const int i = tid + u * T, sl = i % G, r = i / G;
                if (i < BM * G && sl < ns)
                    cp_async4(buf + L::mins + (sl * MP + r) * 4, mn + (size_t)min(r0 + r, rows - 1) * nblk + b0 + sl);
            }
        }
#pragma unroll
        for (int u = 0; u < (BN * G + T - 1) / T; ++u) {
            const int i = tid + u * T, sl = i % G, t = i / G;
            if (i < BN * G && sl < ns)
                cp_async4(buf + L::xs + (sl * NP + t) * 4, xs + (size_t)min(t0 + t, n - 1) * nblk + b0 + sl);
        }
#pragma unroll
        for (int u = 0; u < (BN * G * SPB + T - 1) / T; ++u) {
            const int i = tid + u * T, sk = i % (G * SPB), t = i / (G * SPB), sl = sk / SPB;
            if (i < BN * G * SPB && sl < ns) {
                const size_t at = (size_t)min(t0 + t, n - 1) * nblk + b0;
                const void* src = FORM == 2 ? (const void*)(xsum16 + 2 * at + sk)
                                            : (FORM == 1 ? (const void*)(xdsum + at + sk) : (const void*)(xsum + at + sk));
                cp_async4(buf + L::hs + (sk * NP + t) * 4, src);
            }
        }
    };
#pragma unroll
    for (int k = 0; k < QP_STAGES - 1; ++k) {
        if (k < nst) issue(k, sm + k * L::stage);
        cp_async_commit();
    }
    // This lane's ldmatrix rows: weights (row, byte offset) and tokens (row, byte offset) of a pair of n8 tiles.
    const int arow = 32 * wr + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 16;
    const int brow = 32 * wt + (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 16;
    // acc[mi][j][e]: row 32·wr + 16·mi + g (+ 8 for e ≥ 2), token 32·wt + 8·j + 2·q (+ 1 for odd e).
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.0f;
#pragma unroll 1
    for (int k = 0; k < nst; ++k) {
        cp_async_wait<QP_STAGES - 2>();
        __syncthreads();  // stage k visible to all; stage k − 1's buffer free
        if (k + QP_STAGES - 1 < nst) issue(k + QP_STAGES - 1, sm + ((k + QP_STAGES - 1) % QP_STAGES) * L::stage);
        cp_async_commit();
        const unsigned char* const cb = sm + (k % QP_STAGES) * L::stage;
        const float* const cf = reinterpret_cast<const float*>(cb);
        const int* const ci = reinterpret_cast<const int*>(cb);
        const int ns = min(G, nblk - k * G);
#pragma unroll
        for (int sl = 0; sl < G; ++sl) {
            if (sl < ns) {
                uint32_t a[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    if (P4) {
                        uint32_t w2[2];
                        ldsm_x2(w2, cb + L::codes + (arow + 16 * mi) * L::RS + sl * CS);
                        a[mi][0] = w2[0] & 0x0F0F0F0Fu;
                        a[mi][1] = w2[1] & 0x0F0F0F0Fu;
                        a[mi][2] = (w2[0] >> 4) & 0x0F0F0F0Fu;
                        a[mi][3] = (w2[1] >> 4) & 0x0F0F0F0Fu;
                    } else {
                        ldsm_x4(a[mi], cb + L::codes + (arow + 16 * mi) * L::RS + sl * CS + acol);
                    }
                }
                uint32_t b[2][4];
#pragma unroll
                for (int jp = 0; jp < 2; ++jp) ldsm_x4(b[jp], cb + L::acts + (brow + 16 * jp) * L::AS + sl * 32 + bcol);
                // Row data of the lane's four rows: s[mi][ri][k], m[mi][ri].
                float s[2][2][SPB], m[2][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int ri = 0; ri < 2; ++ri) {
                        const int r = 32 * wr + 16 * mi + g + 8 * ri;
#pragma unroll
                        for (int k2 = 0; k2 < SPB; ++k2) s[mi][ri][k2] = cf[L::scales / 4 + (sl * SPB + k2) * MP + r];
                        m[mi][ri] = FORM == 1 ? cf[L::mins / 4 + sl * MP + r] : 0.0f;
                    }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int tok = 32 * wt + 8 * j + 2 * q;
                    const float2 d = *reinterpret_cast<const float2*>(cf + L::xs / 4 + sl * NP + tok);
                    const float dd[2] = {d.x, d.y};
                    int2 h0 = make_int2(0, 0), h1 = h0;
                    float ds[2] = {0.0f, 0.0f};
                    if (FORM != 1) h0 = *reinterpret_cast<const int2*>(ci + L::hs / 4 + (sl * SPB) * NP + tok);
                    if (FORM == 2) h1 = *reinterpret_cast<const int2*>(ci + L::hs / 4 + (sl * SPB + 1) * NP + tok);
                    if (FORM == 1) {
                        const float2 x2 = *reinterpret_cast<const float2*>(cf + L::hs / 4 + sl * NP + tok);
                        ds[0] = x2.x;
                        ds[1] = x2.y;
                    }
                    const int e0 = QT_BIAS - half * h0.x, e1 = QT_BIAS - half * h0.y;
                    const int f0 = QT_BIAS - half * h1.x, f1 = QT_BIAS - half * h1.y;
                    const int b0 = (int)b[j >> 1][2 * (j & 1)], b1 = (int)b[j >> 1][2 * (j & 1) + 1];
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        int r[4], r2[4];
                        if (FORM == 2) {
                            mma_k16c(r, a[mi][0], a[mi][1], b0, e0, e1);
                            mma_k16c(r2, a[mi][2], a[mi][3], b1, f0, f1);
                        } else if (FORM == 1) {
                            mma_k32c(r, a[mi], b0, b1, QT_BIAS, QT_BIAS);
                        } else {
                            mma_k32c(r, a[mi], b0, b1, e0, e1);
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int ri = e >> 1, ti = e & 1;  // row g or g + 8; token 2q or 2q + 1
                            float v = acc[mi][j][e];
                            v = __fmaf_rn(__fmul_rn(s[mi][ri][0], dd[ti]), qt_float(r[e]), v);
                            if (FORM == 2) v = __fmaf_rn(__fmul_rn(s[mi][ri][SPB - 1], dd[ti]), qt_float(r2[e]), v);
                            if (FORM == 1) v = __fmaf_rn(m[mi][ri], ds[ti], v);
                            acc[mi][j][e] = v;
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    const float* __restrict__ bias = QParts::pick(PT.b, p);
    float* __restrict__ out = QParts::pick(PT.o, p);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int gr = r0 + 32 * wr + 16 * mi + g + 8 * (e >> 1), t = t0 + 32 * wt + 8 * j + 2 * q + (e & 1);
                if (gr < rows && t < n) out[(size_t)t * rows + gr] = bias != nullptr ? __fadd_rn(acc[mi][j][e], bias[gr]) : acc[mi][j][e];
            }
}

// Dynamic shared memory bytes of each variant, [FORM][p4, p8], read by the host.
#define QPB(WR, F) QpSmem<WR, true, F>::bytes, QpSmem<WR, false, F>::bytes
extern "C" __device__ const int mm_qp_smem[6] = {QPB(2, 0), QPB(2, 1), QPB(2, 2)};

// One matrix (`mm_qp{WR}_f{F}_{p4,p8}`) and up to three (`mm_q3p…`, the parts' arguments as MM_Q3's). Grid: (row
// tiles of 32·WR rows, summed over the parts; token tiles of QP_BN).
#define MM_QP_P(WR, F, P4, PS)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * WR * QP_WT, 6 / WR) mm_qp##WR##_f##F##_##PS(           \
        const uint8_t* codes, const float* sc, const float* mn, int rows, int cols, int half, int g16,       \
        const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, const int* xsum16, int n,    \
        const float* bias, float* out) {                                                                     \
        (void)g16;                                                                                           \
        const QParts pt = {{codes, nullptr, nullptr}, {sc, nullptr, nullptr}, {mn, nullptr, nullptr},        \
                           {bias, nullptr, nullptr},  {out, nullptr, nullptr}, {rows, 0, 0},                  \
                           (rows + 32 * WR - 1) / (32 * WR), 0};                                             \
        mm_qp_impl<WR, P4, F>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n);                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * WR * QP_WT, 6 / WR) mm_q3p##WR##_f##F##_##PS(          \
        int cols, int half, int g16, const int8_t* xq, const float* xs, const int* xsum, const float* xdsum, \
        const int* xsum16, int n, const uint8_t* c0, const float* s0, const float* m0, int r0,               \
        const float* b0, float* o0, const uint8_t* c1, const float* s1, const float* m1, int r1,             \
        const float* b1, float* o1, const uint8_t* c2, const float* s2, const float* m2, int r2,             \
        const float* b2, float* o2) {                                                                        \
        (void)g16;                                                                                           \
        const QParts pt = {{c0, c1, c2}, {s0, s1, s2}, {m0, m1, m2}, {b0, b1, b2}, {o0, o1, o2}, {r0, r1, r2}, \
                           (r0 + 32 * WR - 1) / (32 * WR), (r1 + 32 * WR - 1) / (32 * WR)};                  \
        mm_qp_impl<WR, P4, F>(pt, cols, half, xq, xs, xsum, xdsum, xsum16, n);                              \
    }
#define MM_QP(WR, F)                \
    MM_QP_P(WR, F, true, p4)        \
    MM_QP_P(WR, F, false, p8)
MM_QP(2, 0)
MM_QP(2, 1)
MM_QP(2, 2)

// Float weights (f32, or bf16 when BF) times f32 activations: one warp per row, lane l sums columns
// l, l + 32, ... with fused multiply-adds, then the xor tree.
template <int TT, bool BF>
__device__ __forceinline__ void mm_f_impl(const void* __restrict__ wv, int rows, int cols,
                                          const float* __restrict__ x, int n, const float* __restrict__ bias,
                                          float* __restrict__ out) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MM_ROWS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * TT;
    if (row >= rows) return;
    const int nt = min(TT, n - t0);
    float acc[TT];
#pragma unroll
    for (int i = 0; i < TT; ++i) acc[i] = 0.0f;
    for (int c = lane; c < cols; c += 32) {
        float w;
        if (BF) {
            w = __uint_as_float((uint32_t)(reinterpret_cast<const uint16_t*>(wv)[(long long)row * cols + c]) << 16);
        } else {
            w = reinterpret_cast<const float*>(wv)[(long long)row * cols + c];
        }
#pragma unroll
        for (int i = 0; i < TT; ++i)
            if (i < nt) acc[i] = __fmaf_rn(w, x[(long long)(t0 + i) * cols + c], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < TT; ++i) {
        const float v = warp_sum(acc[i]);
        if (lane == 0 && i < nt) out[(long long)(t0 + i) * rows + row] = bias != nullptr ? __fadd_rn(v, bias[row]) : v;
    }
}

#define MM_F(NAME, TT, BF)                                                                              \
    extern "C" __global__ void NAME(const void* w, int rows, int cols, const float* x, int n, const float* bias, \
                                    float* out) {                                                         \
        mm_f_impl<TT, BF>(w, rows, cols, x, n, bias, out);                                                \
    }
MM_F(mm_f32_t1, 1, false)
MM_F(mm_f32_t8, 8, false)
MM_F(mm_bf16_t1, 1, true)
MM_F(mm_bf16_t8, 8, true)

// The Hadamard blocks of a vector of `len` values (quant/rotation.rs `blocks`): len/32 blocks of 32, then the
// tail's binary digits in decreasing order. Block `i` -> (start, size); false past the last block.
__device__ __forceinline__ bool hadamard_block(int len, int i, int* start, int* size) {
    const int full = len >> 5, tail = len & 31;
    if (i < full) {
        *start = i * 32;
        *size = 32;
        return true;
    }
    int at = full * 32, k = i - full;
    for (int b = 4; b >= 0; --b) {
        if (tail & (1 << b)) {
            if (k == 0) {
                *start = at;
                *size = 1 << b;
                return true;
            }
            --k;
            at += 1 << b;
        }
    }
    return false;
}

// Output side of a rotated product: y <- D_out (H y) on every Hadamard block of every token's row. One thread
// per (token, block), the CPU's butterfly order.
extern "C" __global__ void rotate_out(float* __restrict__ y, int n, int rows, int nblocks, const float* __restrict__ signs) {
    pdl_wait();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n * nblocks) return;
    const int t = (int)(id / nblocks), bi = (int)(id % nblocks);
    int s, len;
    if (!hadamard_block(rows, bi, &s, &len)) return;
    float v[32];
    float* p = y + (long long)t * rows + s;
    for (int j = 0; j < len; ++j) v[j] = p[j];
    for (int h = 1; h < len; h <<= 1)
        for (int i = 0; i < len; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j] = __fadd_rn(a, b);
                v[j + h] = __fsub_rn(a, b);
            }
    const float sc = len > 1 ? 1.0f / sqrtf((float)len) : 1.0f;
    for (int j = 0; j < len; ++j) p[j] = __fmul_rn(len > 1 ? __fmul_rn(v[j], sc) : v[j], signs[s + j]);
}

// ---------------------------------------------------------------------------------------------------------
// Embedding rows. wtype 0: f32, 1: bf16, 2: quantized (layout as mm_q). A rotated quantized table gives the
// rows of W = D_out H W' H D_in (output side: the stored rows of the row's Hadamard block mixed; input side:
// H per 32 columns, then the signs). One block per token, one warp per 32 columns at a time.
__device__ __forceinline__ float stored_value(const void* w, int wtype, int cols, int p4, int g16, int half,
                                              const float* sc, const float* mn, long long r, int c) {
    if (wtype == 0) return reinterpret_cast<const float*>(w)[r * cols + c];
    if (wtype == 1) return __uint_as_float((uint32_t)(reinterpret_cast<const uint16_t*>(w)[r * cols + c]) << 16);
    const long long blk = r * (cols >> 5) + (c >> 5);
    const int j = c & 31;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(w);
    int q;
    if (p4) {
        const uint8_t byte = codes[blk * 16 + (j & 15)];
        q = j < 16 ? (byte & 15) : (byte >> 4);
    } else {
        q = codes[blk * 32 + j];
    }
    const float s = g16 ? sc[2 * blk + (j >> 4)] : sc[blk];
    if (mn != nullptr) return __fadd_rn(__fmul_rn(s, (float)q), mn[blk]);
    return __fmul_rn(s, (float)(q - half));
}

extern "C" __global__ void embed(const void* __restrict__ w, int wtype, int rows, int cols, int p4, int g16, int half,
                                 const float* __restrict__ sc, const float* __restrict__ mn,
                                 const float* __restrict__ in_signs, const float* __restrict__ out_signs,
                                 const uint32_t* __restrict__ tokens, float scale, int has_scale,
                                 float* __restrict__ x) {
    pdl_wait();
    const int t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const long long r = tokens[t];
    int bs = 0, bl = 1;
    if (out_signs != nullptr) {
        for (int i = 0;; ++i) {
            if (!hadamard_block(rows, i, &bs, &bl)) break;
            if (r < bs + bl) break;
        }
    }
    for (int g = warp; g < (cols >> 5); g += nw) {
        const int c = g * 32 + lane;
        float v;
        if (out_signs != nullptr) {
            // Row r of D_out H W': sum_j H[r - s][j] W'[s + j] (a Sylvester block: (-1)^popcount(i & j) / sqrt(n)).
            const float norm = 1.0f / sqrtf((float)bl);
            v = 0.0f;
            for (int jj = 0; jj < bl; ++jj) {
                const float h = (__popc((int)(r - bs) & jj) & 1) ? -norm : norm;
                v = __fadd_rn(v, __fmul_rn(h, stored_value(w, wtype, cols, p4, g16, half, sc, mn, bs + jj, c)));
            }
            v = __fmul_rn(v, out_signs[r]);
        } else {
            v = stored_value(w, wtype, cols, p4, g16, half, sc, mn, r, c);
        }
        if (in_signs != nullptr) {
            v = warp_fwht32(v, lane);
            v = __fmul_rn(v, in_signs[c]);
        }
        if (has_scale) v = __fmul_rn(v, scale);
        x[(long long)t * cols + c] = v;
    }
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm: one block per row of nw warps (nw = min(32, ceil(d / 32)), a function of d only). Warp w holds the
// 32-value groups g = w + k*nw (k < NORM_KMAX) of the row in registers, lane l value g*32 + l. Sum of squares:
// each thread's fma chain over its values in k order, the warp's xor tree, then the warps' sums added in warp
// order; inv = 1/sqrt(sum/d + eps); out = (x * inv) * w. d <= NORM_KMAX * 32 * 32.
#define NORM_KMAX 8

// The row's values into v (x += res first when res is not null, written back) and 1/rms. K ≤ NORM_KMAX: the
// groups a warp holds (rows of at most K·32 warps' groups; the loop over k stops at the row's end either way,
// so every K that covers the row computes the same values).
template <int K = NORM_KMAX>
__device__ __forceinline__ float norm_row(float (&v)[K], float* x, const float* __restrict__ res, int d, float eps,
                                          float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = (warp + k * nw) * 32 + lane;
        v[k] = 0.0f;
        if (c < d) {
            float t = x[c];
            if (res != nullptr) {
                t = __fadd_rn(t, res[c]);
                x[c] = t;
            }
            v[k] = t;
            ss = __fmaf_rn(t, t, ss);
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < nw; ++w) tot = __fadd_rn(tot, red[w]);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(tot, (float)d), eps)));
}

// A kernel that does nothing but take part in programmatic dependent launch: run in place of every kernel of a
// pass (same grid, block and shared memory; Cuda::set_empty_kernels) it measures what the launches and the gaps
// between them cost.
extern "C" __global__ void noop() { pdl_wait(); }

// ---------------------------------------------------------------------------------------------------------
// What a phase boundary costs (Cuda::sync_probe; docs/cuda.md, "What a phase boundary costs"): the price of the
// persistent decode kernel's grid barriers against the kernel boundaries they would replace. Each round, every
// block writes a value into its slot of `slots` (block b, round r: r·gridDim.x + b + 1), synchronizes, and
// reads the slot its neighbour wrote that round (the dependency a phase has on the one before), checking it.
//  kind 0: a grid-wide barrier (one counter: each block adds 1 with release semantics, then waits until it
//          reads (r + 1)·blocks with acquire semantics); all blocks must be resident at once (the host launches
//          one a multiprocessor);
//  kind 1: the cluster barrier, the neighbour taken inside the cluster and read from its shared memory
//          (distributed shared memory; sm_90, launched with a cluster dimension);
//  kind 2: the cluster barrier, the neighbour's slot read from global memory;
//  kind 3: no barrier, one round: a chain of such launches (programmatic dependent launch) measures a kernel
//          boundary with the same dependent read (the neighbour's slot of the launch before);
//  kind 4: kind 1 with a lighter barrier: a release fence restricted to the block's shared memory
//          (fence.release.sync_restrict::shared::cta.cluster: MEMBAR.CTA in the SASS, where arrive.release
//          puts a GPU-wide MEMBAR) and a relaxed arrive; the wait acquires.
// A grid barrier that waits a second counts a million misses and stops waiting for the rest of the launch, so
// that a GPU shared with other work cannot hang the probe.
// Rounds are numbered from `first` (the host goes on numbering from run to run, so that no value of an earlier
// run can pass for the current one and the barrier counter needs no reset); `bad` counts reads that did not see
// the expected value (a barrier that does not order: must stay 0).
__device__ __forceinline__ unsigned int ld_acquire_gpu(const unsigned int* p) {
    unsigned int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
#else
    v = *(volatile const unsigned int*)p;
#endif
    return v;
}
// Nanoseconds of the GPU's global timer (the same on every multiprocessor, unlike clock64).
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
__device__ __forceinline__ void red_release_gpu(unsigned int* p, unsigned int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
#else
    __threadfence();
    atomicAdd(p, v);
#endif
}
extern "C" __global__ void sync_probe(unsigned int* bar, unsigned int* slots, unsigned int* bad, int rounds, int kind,
                                      int first) {
    __shared__ unsigned int mine[2];
    pdl_wait();
    const unsigned int nb = gridDim.z, b = blockIdx.z;  // blocks along z (clusters group consecutive z)
    unsigned int csize;
    const unsigned int crank = cluster_rank_and_size(csize);
    const bool in_cluster = kind == 1 || kind == 2 || kind == 4;
    const unsigned int nbr = in_cluster ? b - crank + (crank + 1) % csize : (b + 1) % nb;
    unsigned int errors = 0;
    bool gave_up = false;
    // Slots are double-buffered by round: a block writes round r + 2's value only after the barrier of round
    // r + 1, which every block passes only after its read of round r.
    for (int r = 0; r < (kind == 3 ? 1 : rounds); ++r) {
        const unsigned int round = (unsigned int)(first + r);
        if (threadIdx.x == 0) {
            const unsigned int v = round * nb + b + 1;
            if (kind == 1 || kind == 4) mine[round & 1] = v;
            else slots[(round & 1) * nb + b] = v;
        }
        if (kind == 0) {
            __syncthreads();
            if (threadIdx.x == 0) {
                red_release_gpu(bar, 1);
                const unsigned int target = (round + 1) * nb;
                const unsigned long long start = global_ns();
                while (!gave_up && ld_acquire_gpu(bar) < target) {
                    if (global_ns() - start > 1000000000ull) {
                        errors += 1000000;
                        gave_up = true;  // no more waiting in later rounds either
                    }
                }
            }
        } else if (kind == 4) {
            cluster_barrier_shared();
        } else if (in_cluster) {
            cluster_barrier();
        }
        if (threadIdx.x == 0) {
            // kind 3 reads what the launch before wrote (the first launch has nothing to read).
            const unsigned int rd = kind == 3 ? round - 1 : round;
            const unsigned int want = rd * nb + nbr + 1;
            unsigned int got = want;
            if (kind == 1 || kind == 4) got = ld_cluster_shared(&mine[round & 1], (crank + 1) % csize);
            else if (kind != 3 || first > 0) got = __ldcg(slots + (rd & 1) * nb + nbr);
            errors += got != want;
        }
    }
    // No block leaves while a neighbour may still read its shared memory.
    if (kind == 1 || kind == 4) cluster_barrier();
    if (threadIdx.x == 0 && errors != 0) atomicAdd(bad, errors);
}

extern "C" __global__ void rms_norm(const float* x, float* out, const float* __restrict__ w, int d, float eps,
                                    int nrows) {
    pdl_wait();
    __shared__ float red[32];
    const long long row = blockIdx.x;
    if (row >= nrows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float v[NORM_KMAX];
    const float inv = norm_row(v, const_cast<float*>(x) + row * d, nullptr, d, eps, red);
    float* o = out + row * d;
#pragma unroll
    for (int k = 0; k < NORM_KMAX; ++k) {
        const int c = (warp + k * nw) * 32 + lane;
        if (c < d) o[c] = __fmul_rn(__fmul_rn(v[k], inv), w[c]);
    }
}

// The residual add, RMSNorm and int8 quantization of a row in one kernel (rms_norm's block and sequence): with
// `res`, x += res first (written back); the normed row goes to `h`, and each warp quantizes its groups as
// quantize_q8 would (`signs`: the input rotation of the next product, or null). d must be a multiple of 32.
// `rms_norm_quant_k{1,2}` hold at most 1 or 2 groups a warp (rows up to 1,024 or 2,048 values; the host picks
// them there): the same operations without the 8-group body's unrolled copies of `quant_group` (4,040
// instructions against about a fifth, which a kernel run twice a layer fetches cold each time).
#define RMS_NORM_QUANT_PARAMS                                                                                      \
    float *x, const float *__restrict__ res, float *__restrict__ h, const float *__restrict__ w, int d, float eps,   \
        const float *__restrict__ signs, int8_t *__restrict__ q, float *__restrict__ scale, int *__restrict__ sum,   \
        float *__restrict__ dsum, int *__restrict__ sum16, unsigned char *tq, long long tg
template <int K>
__device__ __forceinline__ void rms_norm_quant_impl(RMS_NORM_QUANT_PARAMS) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int G = d >> 5;
    // The norm's weights (written by no kernel) into registers before the wait (`ld_early`).
    float wv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int g = warp + k * nw;
        wv[k] = g < G ? ld_early(w + g * 32 + lane) : 0.0f;
    }
    pdl_wait();
    float v[K];
    const float inv = norm_row<K>(v, x + row * d, res != nullptr ? res + row * d : nullptr, d, eps, red);
    const QActOut o = {q, scale, sum, dsum, sum16, tq, tg, G};
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int g = warp + k * nw;
        if (g < G) {
            const int c = g * 32 + lane;
            const float hv = __fmul_rn(__fmul_rn(v[k], inv), wv[k]);
            h[row * d + c] = hv;
            quant_group(hv, lane, row * G + g, signs != nullptr ? signs + g * 32 : nullptr, o);
        }
    }
}
extern "C" __global__ void rms_norm_quant(RMS_NORM_QUANT_PARAMS) {
    rms_norm_quant_impl<NORM_KMAX>(x, res, h, w, d, eps, signs, q, scale, sum, dsum, sum16, tq, tg);
}
extern "C" __global__ void rms_norm_quant_k1(RMS_NORM_QUANT_PARAMS) {
    rms_norm_quant_impl<1>(x, res, h, w, d, eps, signs, q, scale, sum, dsum, sum16, tq, tg);
}
extern "C" __global__ void rms_norm_quant_k2(RMS_NORM_QUANT_PARAMS) {
    rms_norm_quant_impl<2>(x, res, h, w, d, eps, signs, q, scale, sum, dsum, sum16, tq, tg);
}

// ---------------------------------------------------------------------------------------------------------
// Elementwise.
extern "C" __global__ void add(float* __restrict__ x, const float* __restrict__ y, long long len) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = __fadd_rn(x[i], y[i]);
}

extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ b, int width, long long len) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = __fadd_rn(x[i], b[i % width]);
}

// act 0: SiLU g*sigma(g); 1: GELU with the tanh approximation.
__device__ __forceinline__ float activate(int act, float x) {
    if (act == 0) return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
    const float C = 0.7978846f;
    const float inner = __fmul_rn(C, __fadd_rn(x, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

extern "C" __global__ void gated_act(int act, float* __restrict__ g, const float* __restrict__ u, long long len) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    g[i] = __fmul_rn(activate(act, g[i]), u[i]);
}

// gated_act on n rows of `cols` values and the int8 quantization of the result (as quantize_q8 of it), one warp
// per (row, group of 32).
extern "C" __global__ void gated_act_quant(int act, float* __restrict__ g, const float* __restrict__ u, int n,
                                           int cols, const float* __restrict__ signs, int8_t* __restrict__ q,
                                           float* __restrict__ scale, int* __restrict__ sum,
                                           float* __restrict__ dsum, int* __restrict__ sum16, unsigned char* tq,
                                           long long tg) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const long long G = cols >> 5;
    const long long gid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gid >= (long long)n * G) return;
    const long long i = gid * 32 + lane;
    const float v = __fmul_rn(activate(act, g[i]), u[i]);
    g[i] = v;
    const QActOut o = {q, scale, sum, dsum, sum16, tq, tg, G};
    quant_group(v, lane, gid, signs != nullptr ? signs + (gid % G) * 32 : nullptr, o);
}

// dst rows row0[0] .. row0[0] + len/width (width values each) = src: the KV cache write, its first row read
// from device memory so that a captured decode step replays at any position.
extern "C" __global__ void store_rows(const float* __restrict__ src, long long len, int width, float* __restrict__ dst,
                                      const int* __restrict__ row0) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) dst[(long long)row0[0] * width + i] = src[i];
}

// Row dst_row + i of dst (columns dcol.., stride dstride) = row rows[i] of src (columns scol.., stride sstride)
// for i < n, width values a row; at = [dst_row, rows[0..n]] (staged, so a graph replays for other rows).
extern "C" __global__ void gather_rows(const float* __restrict__ src, int sstride, int scol, float* __restrict__ dst,
                                       int dstride, int dcol, int n, int width, const int* __restrict__ at) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * width) return;
    const int r = (int)(i / width), c = (int)(i % width);
    dst[(long long)(at[0] + r) * dstride + dcol + c] = src[(long long)at[1 + r] * sstride + scol + c];
}

// Within buf (rows of width): row base + d = row base + path[d] for d = 1, 2, ... in order, at = [base, len,
// path[0..len]] (staged). One thread per column walks the rows in order, so a row is read before a later d
// overwrites it (path[d] >= d), as the CPU's sequential copies do.
extern "C" __global__ void commit_rows(float* __restrict__ buf, int width, const int* __restrict__ at) {
    pdl_wait();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const long long base = at[0];
    for (int d = 1; d < at[1]; d++) {
        const int node = at[2 + d];
        if (node != d) buf[(base + d) * width + c] = buf[(base + node) * width + c];
    }
}

extern "C" __global__ void mul_sigmoid(float* __restrict__ x, const float* __restrict__ g, long long len) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = __fmul_rn(x[i], __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g[i]))));
}

extern "C" __global__ void split_gate(const float* __restrict__ qg, int n, int heads, int hd, float* __restrict__ q,
                                      float* __restrict__ gate) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long qd = (long long)heads * hd;
    if (i >= n * qd) return;
    const long long t = i / qd, r = i % qd, h = r / hd, d = r % hd;
    const float* src = qg + t * 2 * qd + h * 2 * hd;
    q[i] = src[d];
    gate[i] = src[hd + d];
}

extern "C" __global__ void concat_rows(const float* __restrict__ a, const float* __restrict__ b, int n, int width,
                                       float* __restrict__ out) {
    pdl_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * 2 * width) return;
    const long long t = i / (2 * width), c = i % (2 * width);
    out[i] = c < width ? a[t * width + c] : b[t * width + c - width];
}

// ---------------------------------------------------------------------------------------------------------
// RoPE: pair i of every head rotated by the angle pos·inv_freq[i]; cos and sin of the f64 angle rounded to f32
// (as the CPU), computed once per (position, pair) into a table (`rope_table`, kept by the host per frequency
// list and grown before a pass needs more positions), which the kernels read: (cos, sin) of pair i at position
// pos is tab[pos·half + i]. neox: pairs (i, i + half), else (2i, 2i + 1).
extern "C" __global__ void rope_table(float2* __restrict__ tab, long long n, const float* __restrict__ inv_freq,
                                      int half) {
    pdl_wait();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= n) return;
    const double ang = (double)(id / half) * (double)inv_freq[id % half];
    double sd, cd;
    sincos(ang, &sd, &cd);
    tab[id] = make_float2((float)cd, (float)sd);
}

// The dims of pair i (neox: i and i + half; else 2i and 2i + 1).
__device__ __forceinline__ int rope_a(int i, int half, int neox) { return neox ? i : 2 * i; }
__device__ __forceinline__ int rope_b(int i, int half, int neox) { return neox ? i + half : 2 * i + 1; }
// The pair (x0, x1) rotated by the angle of cos c, sin s into (y0, y1).
__device__ __forceinline__ void rope_turn(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Pair i of the head at `p` rotated by the angle of cos c, sin s; the rotated pair also written to `copy`.
__device__ __forceinline__ void rope_rotate(float* p, float* copy, int i, int half, int neox, float c, float s) {
    const int a = rope_a(i, half, neox), b = rope_b(i, half, neox);
    float y0, y1;
    rope_turn(p[a], p[b], c, s, y0, y1);
    p[a] = y0;
    p[b] = y1;
    if (copy != nullptr) {
        copy[a] = y0;
        copy[b] = y1;
    }
}

// RoPE on rows 0..nrows of q (qw values each) and k (kw values each), heads of hd, in one launch.
extern "C" __global__ void rope(float* __restrict__ q, int qw, float* __restrict__ k, int kw, int hd, int nrows,
                                const int* __restrict__ pos, const float2* __restrict__ tab, int half, int neox) {
    pdl_wait();
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nq = (long long)nrows * (qw / hd) * half;
    float* x = q;
    int width = qw;
    if (id >= nq) {
        id -= nq;
        x = k;
        width = kw;
        if (id >= (long long)nrows * (kw / hd) * half) return;
    }
    const int heads = width / hd;
    const int i = (int)(id % half);
    const long long rh = id / half;
    const int h = (int)(rh % heads);
    const long long t = rh / heads;
    const float2 cs = tab[(long long)pos[t] * half + i];
    rope_rotate(x + t * width + (long long)h * hd, nullptr, i, half, neox, cs.x, cs.y);
}

// rope, and the batch's K and V rows stored in the cache at rows row0[0].. (kc, vc: kw values per row) in the
// same launch: q threads as rope's; per k head, threads 0..half rotate a pair (written to k and the cache) and
// the others copy the head's unrotated dims 2*half..hd; then one thread per v value.
extern "C" __global__ void rope_store(float* __restrict__ q, int qw, float* __restrict__ k, int kw, int hd,
                                      int nrows, const int* __restrict__ pos, const float2* __restrict__ tab,
                                      int half, int neox, const float* __restrict__ v, float* __restrict__ kc,
                                      float* __restrict__ vc, const int* __restrict__ row0) {
    // The positions and first cache row come from the pass's arena, copied before the pass, and the table was
    // filled before it: written by no kernel of the pass, so this thread's cos and sin are read before the wait.
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nq = (long long)nrows * (qw / hd) * half;
    const int kper = hd - half;  // half pairs + (hd - 2 half) unrotated dims
    const long long nk = (long long)nrows * (kw / hd) * kper;
    float2 cs = make_float2(0.0f, 0.0f);
    if (id < nq) {
        const long long t = id / half / (qw / hd);
        cs = ld_early(tab + (long long)ld_early(pos + t) * half + id % half);
    } else if (id - nq < nk && (int)((id - nq) % kper) < half) {
        const long long t = (id - nq) / kper / (kw / hd);
        cs = ld_early(tab + (long long)ld_early(pos + t) * half + (id - nq) % kper);
    }
    const float c = cs.x, s = cs.y;
    const long long r0 = ld_early(row0);
    pdl_wait();
    if (id < nq) {
        const int heads = qw / hd;
        const int i = (int)(id % half);
        const long long rh = id / half;
        const long long t = rh / heads;
        rope_rotate(q + t * qw + (long long)(rh % heads) * hd, nullptr, i, half, neox, c, s);
        return;
    }
    id -= nq;
    if (id < nk) {
        const int heads = kw / hd;
        const int j = (int)(id % kper);
        const long long rh = id / kper;
        const long long t = rh / heads;
        const long long off = (long long)(rh % heads) * hd;
        float* p = k + t * kw + off;
        float* cp = kc + (r0 + t) * kw + off;
        if (j < half) {
            rope_rotate(p, cp, j, half, neox, c, s);
        } else {
            const int d = 2 * half + (j - half);
            cp[d] = p[d];
        }
        return;
    }
    id -= nk;
    if (id < (long long)nrows * kw) vc[r0 * kw + id] = v[id];
}

// ---------------------------------------------------------------------------------------------------------
// Attention, split over the keys (flash-decoding). Query i sees the cache rows info[i].x .. info[i].y (committed,
// in order) then info[i].w rows listed at paths[info[i].z ..] (its tree ancestors and itself, root first): keys
// in position order, exactly as a chain would visit them. Key j of that list belongs to chunk j / ATT_CHUNK;
// blocks of ATT_THREADS on a grid (query head, query, Z): block z takes the chunks z, z + Z, z + 2Z, ... of its
// (query, head) in turn (Z is fixed per launch shape by the host, so graphs replay; blocks past the query's last
// chunk exit at once). Fixed order per (query, head), independent of the query count, of Z, of the kernel
// (`attention_kv` below computes the same values) and of which blocks run when:
//  * per chunk: score_j = (((p_0 + p_1) + p_2) + p_3) * scale with p_i = q·k_j over the i-th quarter of the
//    head dimension, an fma chain in dimension order, then the soft-cap; m = max_j score_j (exact); e_j = expf(score_j - m); z = the two
//    warps' xor-tree sums of e_j added; o[d] = sum_j e_j v_j[d]: part p of P = ATT_THREADS / hd (at least 1)
//    sums j = p, p + P, ... in order with fma, the parts added in order. (m, z, o) go to `part`;
//  * the block that finishes a (query, head) last (a device counter, reset by it) combines its chunks in
//    chunk order: M = max m_c, w_c = expf(m_c - M), Z = fma chain of z_c w_c, o[d] = fma chain of o_c[d] w_c,
//    out = o * (1/Z). With one chunk, w_0 = 1 and the combination is exact.
// With `qq` not null, the output rows are also quantized to int8 as quantize_q8 would (the next product's
// input; `qsigns`: its input rotation or null): the warp that writes 32 output values quantizes them (hd must
// then be a multiple of 32).
// hd must be a multiple of 16 and at most ATT_MAX_HD.
#define ATT_THREADS 256
#define ATT_CHUNK 64

// Output value `c` of query `i`'s row (qd values) into `out`, and with `o.q` set quantized with the 32 values of
// its warp as quantize_q8 would (lane = c % 32; `qsigns`: the next product's input rotation or null).
__device__ __forceinline__ void att_put(float* __restrict__ out, long long qd, long long i, long long c, float val,
                                        int lane, const float* __restrict__ qsigns, const QActOut& o) {
    out[i * qd + c] = val;
    if (o.q != nullptr) {
        const long long g = c >> 5;
        quant_group(val, lane, i * (qd >> 5) + g, qsigns != nullptr ? qsigns + g * 32 : nullptr, o);
    }
}
#define ATT_MAX_HD 512

// The combination of one (query, head)'s `nch` chunk records (m, z, o[hd]) at `base` (read through L2: other
// blocks wrote them), in two memory round trips for up to ATT_CB chunks: M = max m_c; then output value `d`
// before the 1/Z, the fma chain of o_c[d]·expf(m_c − M) in chunk order, with Z, the fma chain of
// z_c·expf(m_c − M) in chunk order, into `Z`.
#define ATT_CB 8
__device__ __forceinline__ float att_combine_max(const float* base, int nch, int hd) {
    float M = -INFINITY;
    for (int c0 = 0; c0 < nch; c0 += ATT_CB) {
        float m[ATT_CB];
#pragma unroll
        for (int u = 0; u < ATT_CB; ++u) m[u] = c0 + u < nch ? __ldcg(base + (long long)(c0 + u) * (hd + 2)) : -INFINITY;
#pragma unroll
        for (int u = 0; u < ATT_CB; ++u) M = fmaxf(M, m[u]);
    }
    return M;
}
__device__ __forceinline__ float att_combine_value(const float* base, int nch, int hd, float M, int d, float& Z) {
    float acc = 0.0f;
    Z = 0.0f;
    for (int c0 = 0; c0 < nch; c0 += ATT_CB) {
        float m[ATT_CB], z[ATT_CB], o[ATT_CB];
#pragma unroll
        for (int u = 0; u < ATT_CB; ++u) {
            if (c0 + u < nch) {
                const float* b = base + (long long)(c0 + u) * (hd + 2);
                m[u] = __ldcg(b);
                z[u] = __ldcg(b + 1);
                o[u] = __ldcg(b + 2 + d);
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_CB; ++u) {
            if (c0 + u < nch) {
                const float w = expf(__fsub_rn(m[u], M));
                Z = __fmaf_rn(z[u], w, Z);
                acc = __fmaf_rn(o[u], w, acc);
            }
        }
    }
    return acc;
}

// A score quarter's chain extended by four key values against the query values q[0..3], in order.
__device__ __forceinline__ float att_dot4(float p, const float* q, float4 k) {
    p = __fmaf_rn(q[0], k.x, p);
    p = __fmaf_rn(q[1], k.y, p);
    p = __fmaf_rn(q[2], k.z, p);
    return __fmaf_rn(q[3], k.w, p);
}

// Loads per thread issued together before their use (each batch one memory round trip): key float4s of the
// score chains, value rows of the output chains.
#define ATT_KB 8
#define ATT_VB 32
// The values vb[rows[j]·kvd + d] for the keys j = j0, j0 + P, ... (ATT_VB of them, those below cnt) into v.
__device__ __forceinline__ void att_load_values(float (&v)[ATT_VB], const float* __restrict__ vb,
                                                const long long* rows, long long kvd, int d, int j0, int P, int cnt) {
#pragma unroll
    for (int u = 0; u < ATT_VB; ++u) {
        const int jj = j0 + u * P;
        v[u] = jj < cnt ? vb[rows[jj] * kvd + d] : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
    attention(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
              float* __restrict__ out, const int4* __restrict__ info, const int* __restrict__ paths, float* part,
              int* count, int nmax, int n_heads, int n_kv_heads, int hd, float scale, float softcap,
              const float* __restrict__ qsigns, int8_t* __restrict__ qq, float* __restrict__ qscale,
              int* __restrict__ qsum, float* __restrict__ qdsum, int* __restrict__ qsum16, unsigned char* qtq,
              long long qtg) {
    pdl_wait();
    __shared__ __align__(16) float qs[ATT_MAX_HD];
    __shared__ float sc[ATT_CHUNK];
    __shared__ float sp[4][ATT_CHUNK];
    __shared__ float red[ATT_THREADS];
    __shared__ long long rows[ATT_CHUNK];
    __shared__ int last;
    const int h = blockIdx.x, i = blockIdx.y, tid = threadIdx.x;
    const long long qd = (long long)n_heads * hd, kvd = (long long)n_kv_heads * hd;
    const float* qh = q + i * qd + (long long)h * hd;
    const float q0 = tid < hd ? qh[tid] : 0.0f;  // loaded with the key list's bounds
    const int4 qi = info[i];
    const int nc = qi.y - qi.x, nk = nc + qi.w;
    const int nch = (nk + ATT_CHUNK - 1) / ATT_CHUNK;
    // Output value `d` of (query i, head h), quantized with its warp's 32 values when asked.
    const QActOut qo = {qq, qscale, qsum, qdsum, qsum16, qtq, qtg, qd >> 5};
    auto put = [&](int d, float val) { att_put(out, qd, i, (long long)h * hd + d, val, tid & 31, qsigns, qo); };
    // The chunks' combination (their records complete and visible), in chunk order.
    auto combine = [&]() {
        const float* base = part + ((long long)i * n_heads + h) * nmax * (hd + 2);
        const float M = att_combine_max(base, nch, hd);
        for (int d = tid; d < hd; d += ATT_THREADS) {
            float Z;
            const float o = att_combine_value(base, nch, hd, M, d, Z);
            put(d, __fmul_rn(o, __fdiv_rn(1.0f, Z)));
        }
    };
    if (nk <= 0) {
        if (blockIdx.z == 0)
            for (int d = tid; d < hd; d += ATT_THREADS) put(d, 0.0f);
        return;
    }
    if ((int)blockIdx.z >= nch) return;  // (an exited block does not hold a cluster barrier up)
    // Launched in clusters (the whole z range of a (query, head) one cluster: rank = z), the blocks' chunk
    // records meet at the cluster barrier and block 0 combines them; otherwise the last block to finish does.
    unsigned int csize;
    const unsigned int crank = cluster_rank_and_size(csize);
    const bool clustered = csize > 1;
    const int kvh = h / (n_heads / n_kv_heads);
    for (int d = tid; d < hd; d += ATT_THREADS) qs[d] = d == tid ? q0 : qh[d];
    const bool single = nch == 1;
    const float* vb = v + (long long)kvh * hd;
    // Chunks blockIdx.z, blockIdx.z + gridDim.z, ... in increasing order: a block's last chunk is the only one
    // whose completion can be the (query, head)'s last.
    for (int c = blockIdx.z; c < nch; c += gridDim.z) {
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        __syncthreads();  // the previous chunk's readers of rows/sc/red are done
        if (tid < cnt) {
            const int jj = j0 + tid;
            rows[tid] = jj < nc ? (long long)qi.x + jj : (long long)paths[qi.z + jj - nc];
        }
        __syncthreads();
        // This thread's values of the chunk (output value d = tid % hd, part pt = tid / hd: keys pt, pt + P, ...)
        // are loaded now, with its key quarter below, so that the two loads share one memory round trip.
        const int P = hd <= ATT_THREADS ? ATT_THREADS / hd : 1;
        const int vd = tid % hd, vpt = tid / hd;
        float vpre[ATT_VB];
        if (hd <= ATT_THREADS && vpt < P) att_load_values(vpre, vb, rows, kvd, vd, vpt, P, cnt);
        {
            const int j = tid % ATT_CHUNK, qt = tid / ATT_CHUNK;
            if (j < cnt) {
                const int d0 = qt * (hd >> 2);
                const float4* kr = reinterpret_cast<const float4*>(k + rows[j] * kvd + (long long)kvh * hd + d0);
                const float* qq = qs + d0;
                float p = 0.0f;
                // The quarter's keys ATT_KB float4 at a time, all loaded before the chain uses them.
                for (int b = 0; b < (hd >> 4); b += ATT_KB) {
                    float4 kv[ATT_KB];
#pragma unroll
                    for (int u = 0; u < ATT_KB; ++u)
                        if (b + u < (hd >> 4)) kv[u] = kr[b + u];
#pragma unroll
                    for (int u = 0; u < ATT_KB; ++u) {
                        if (b + u < (hd >> 4)) {
                            p = att_dot4(p, qq + 4 * (b + u), kv[u]);
                        }
                    }
                }
                sp[qt][j] = p;
            }
        }
        __syncthreads();
        if (tid < ATT_CHUNK) {
            float s = -INFINITY;
            if (tid < cnt) {
                s = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(sp[0][tid], sp[1][tid]), sp[2][tid]), sp[3][tid]), scale);
                if (softcap > 0.0f) s = __fmul_rn(softcap, tanhf(__fdiv_rn(s, softcap)));
                sc[tid] = s;
            }
            const float m = warp_max(s);
            if ((tid & 31) == 0) red[tid >> 5] = m;
        }
        __syncthreads();
        const float m = fmaxf(red[0], red[1]);
        if (tid < ATT_CHUNK) {
            float e = 0.0f;
            if (tid < cnt) e = expf(__fsub_rn(sc[tid], m));
            sc[tid] = e;
            const float z = warp_sum(e);
            if ((tid & 31) == 0) red[2 + (tid >> 5)] = z;
        }
        __syncthreads();
        const float z = __fadd_rn(red[2], red[3]);
        __syncthreads();
        // One chunk: the combination below would be exact (w_0 = 1), so the block writes the output itself.
        const float inv1 = __fdiv_rn(1.0f, z);
        float* pp = part + (((long long)i * n_heads + h) * nmax + c) * (hd + 2);
        if (hd <= ATT_THREADS) {
            const int d = vd, pt = vpt;
            if (pt < P) {
                // The fma chain over the keys pt, pt + P, ... in order: the first ATT_VB values were loaded above,
                // the rest (P·ATT_VB < cnt: head dims above 128) ATT_VB at a time.
                float acc = 0.0f;
#pragma unroll
                for (int u = 0; u < ATT_VB; ++u) {
                    const int jj = pt + u * P;
                    if (jj < cnt) acc = __fmaf_rn(sc[jj], vpre[u], acc);
                }
                for (int jb = pt + ATT_VB * P; jb < cnt; jb += ATT_VB * P) {
                    att_load_values(vpre, vb, rows, kvd, d, jb, P, cnt);
#pragma unroll
                    for (int u = 0; u < ATT_VB; ++u) {
                        const int jj = jb + u * P;
                        if (jj < cnt) acc = __fmaf_rn(sc[jj], vpre[u], acc);
                    }
                }
                red[pt * hd + d] = acc;
            }
            __syncthreads();
            if (tid < hd) {
                float acc = red[tid];
                for (int p = 1; p < P; ++p) acc = __fadd_rn(acc, red[p * hd + tid]);
                if (single) put(tid, __fmul_rn(acc, inv1));
                else pp[2 + tid] = acc;
            }
        } else {
            for (int d = tid; d < hd; d += ATT_THREADS) {
                float acc = 0.0f;
#pragma unroll 8
                for (int jj = 0; jj < cnt; ++jj) acc = __fmaf_rn(sc[jj], vb[rows[jj] * kvd + d], acc);
                if (single) put(d, __fmul_rn(acc, inv1));
                else pp[2 + d] = acc;
            }
        }
        if (single) continue;
        if (tid == 0) {
            pp[0] = m;
            pp[1] = z;
        }
        if (clustered) continue;
        // The last block of this (query, head) to finish a chunk combines the chunks.
        __threadfence();
        __syncthreads();
        int* cnt_at = count + (long long)i * n_heads + h;
        if (tid == 0) last = atomicAdd(cnt_at, 1) == nch - 1;
        __syncthreads();
        if (!last) continue;
        __threadfence();
        if (tid == 0) *cnt_at = 0;
        combine();
        return;
    }
    if (clustered && !single) {
        cluster_arrive();  // this block's records are written (each thread releases its own writes)
        if (crank != 0) return;
        cluster_wait();
        combine();
    }
}

// The decode step's attention: one query (t = 1; or any number, query i = blockIdx.y: launches per query head
// in clusters, an opt-in for verifies with EDDY_CUDA_ATT_CLUSTER and EDDY_CUDA_ATT_KV_MIN), head dims 64 and 128, its chunk blocks a thread-block cluster of Z = gridDim.z per (query, head)
// (rank = z; block z takes the chunks z, z + Z, ... in turn). A small body with
// one block barrier a chunk (two for a block walking several) and no fence, where `attention` carries every
// case in 7,000 instructions (a kernel that runs once a layer starts with a cold instruction cache;
// docs/cuda.md, "A decode attention of its own").
// Every value is computed by `attention`'s operations in its order, so a (query, head) gets the same bits from
// either kernel (and so from `attention_kv`):
//  * thread (key j = tid % 64, quarter qt = tid / 64) computes p_qt of key j as `attention` does (the query from
//    shared memory, the key's quarter in float4s loaded before the barrier);
//  * after the barrier each warp of the first HD / 32 holds the scores of keys lane and lane + 32 (the quarters
//    added in order, scaled, soft-capped), so its two xor trees are `attention`'s two warps' trees: m, the
//    exponentials e_j, and z = the two trees' sums added;
//  * thread d < HD computes output value d: the P = 256 / HD fma chains over the keys pt, pt + P, ... (e_j from
//    the lane that holds it, v_j[d] loaded before the barrier), added in order;
//  * one chunk: the output as `attention`'s single-chunk path; several: the chunk records (m, z, o[HD]), those
//    of chunks below ATT_DEC_CAP stored into the shared memory of the cluster's first block (the rest into
//    `part` as `attention` stores them), and after the cluster barrier that block combines them in chunk
//    order as `attention`'s `combine` does.
// The output quantization as `attention`'s (`qq` not null: the warp of 32 output values quantizes them).
// `attention_dec_rope_hd*` (ROPE, decode steps only) also takes the step's `rope_store` in (DecRope below): one
// launch less a layer, the same bits.
#define ATT_DEC_CAP 16
// Stores `v` at `p` (this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ void st_cluster_shared_f32(float* p, unsigned int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(ra), "f"(v) : "memory");
#else
    *p = v;
#endif
}

// The decode step's RoPE and cache store taken into its attention (`attention_dec_rope_hd*`, `rope_store`'s
// operations): `q` and the new key and value rows (`kraw`, `vraw`: row 0, n_kv_heads·HD values) are as the
// products left them; the one query's rotated head goes to shared memory, the rotated key and the value of
// the block's KV head are used in place of the list's last key (the new cache row info.y − 1, which no block
// reads), and the first z block of the KV head's first query head stores both into that row of `kc`, `vc`
// (the caches `k`, `v`). Rotated pairs i < half, the dims from 2·half on copied.
struct DecRope {
    const float* kraw;
    const float* vraw;
    float* kc;
    float* vc;
    const int* pos;
    const float2* tab;  // the (cos, sin) table (`rope_table`)
    int half;
    int neox;
};

// The decode kernels' shared steps (`attention_dec_impl`, `attention_dkv_impl`).
// Chunk keys j0 .. j0 + cnt − 1 of a key list (`info` entry qi: committed rows qi.x + j below nc, then the rows
// listed at paths[qi.z ..]) as element offsets of their KV head (kvo) into the caches (kvd values a row), thread
// tid < cnt the key tid; ROPE: the list's last key (nk − 1) is the step's new row, offset −1 (read from the
// raw rows, not the cache).
template <bool ROPE>
__device__ __forceinline__ void dec_key_rows(int* offs, int4 qi, const int* __restrict__ paths, int nk, int nc,
                                             int kvd, int kvo, int j0, int cnt, int tid) {
    if (tid < cnt) {
        const int jj = j0 + tid;
        offs[tid] = ROPE && jj == nk - 1 ? -1 : (jj < nc ? qi.x + jj : paths[qi.z + jj - nc]) * kvd + kvo;
    }
}
// Thread (key j < cnt, quarter qt)'s key quarter from the key cache at the offsets (the new row, −1, left to
// the caller); `pre`: before the wait (`ld_early`).
template <int HD, bool ROPE>
__device__ __forceinline__ void dec_key_quarter(float4 (&kq)[HD / 16], const float* __restrict__ k, const int* offs,
                                                int j, int qt, int cnt, bool pre) {
    if (j < cnt) {
        const int oj = offs[j];
        if (!ROPE || oj >= 0) {
            const float4* kr = reinterpret_cast<const float4*>(k + oj + qt * (HD / 4));
#pragma unroll
            for (int u = 0; u < HD / 16; ++u) kq[u] = pre ? ld_early(kr + u) : kr[u];
        }
    }
}
// One head's chunk of cnt keys on one warp, as `attention`'s two warps: the scores of keys lane and lane + 32
// from their quarters (sq[qt·ATT_CHUNK + j], added in order, scaled, soft-capped), m = their max, the
// exponentials into `e` (0 past cnt), z = the two xor trees' sums added.
__device__ __forceinline__ void dec_chunk_softmax(const float* sq, float* e, int cnt, int lane, float scale,
                                                  float softcap, float& m, float& z) {
    float s[2], x[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int jj = lane + 32 * hf;
        s[hf] = -INFINITY;
        if (jj < cnt) {
            const float p = __fadd_rn(__fadd_rn(__fadd_rn(sq[jj], sq[ATT_CHUNK + jj]), sq[2 * ATT_CHUNK + jj]), sq[3 * ATT_CHUNK + jj]);
            s[hf] = __fmul_rn(p, scale);
            if (softcap > 0.0f) s[hf] = __fmul_rn(softcap, tanhf(__fdiv_rn(s[hf], softcap)));
        }
    }
    m = fmaxf(warp_max(s[0]), warp_max(s[1]));
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        x[hf] = lane + 32 * hf < cnt ? expf(__fsub_rn(s[hf], m)) : 0.0f;
        e[lane + 32 * hf] = x[hf];
    }
    z = __fadd_rn(warp_sum(x[0]), warp_sum(x[1]));
}
// Thread tid < HD's part of the step's new key and value row of its KV head (kvo): value tid into `vns`, the
// key rotated (pair tid < half by the cos c and sin s of that pair; the dims from 2·half copied) into `kn`;
// with `store` both also into the caches' element offset `row`. WQ: the same for the query head at `qr` into
// `qs` (the pair's or dim's query value first).
template <int HD, bool WQ>
__device__ __forceinline__ void dec_new_row(const DecRope& rp, float* kn, float* vns, int tid, int kvo,
                                            long long row, bool store, float c, float s, const float* __restrict__ qr,
                                            float* qs) {
    const float vt = rp.vraw[kvo + tid];
    vns[tid] = vt;
    if (store) rp.vc[row + tid] = vt;
    const float* kr = rp.kraw + kvo;
    if (tid < rp.half) {
        const int a = rope_a(tid, rp.half, rp.neox), b = rope_b(tid, rp.half, rp.neox);
        float y0, y1;
        if (WQ) {
            rope_turn(qr[a], qr[b], c, s, y0, y1);
            qs[a] = y0;
            qs[b] = y1;
        }
        rope_turn(kr[a], kr[b], c, s, y0, y1);
        kn[a] = y0;
        kn[b] = y1;
        if (store) {
            rp.kc[row + a] = y0;
            rp.kc[row + b] = y1;
        }
    } else if (tid < HD - rp.half) {
        const int d = tid + rp.half;  // 2·half + (tid − half)
        if (WQ) qs[d] = qr[d];
        const float kd = kr[d];
        kn[d] = kd;
        if (store) rp.kc[row + d] = kd;
    }
}

template <int HD, bool ROPE>
__device__ __forceinline__ void attention_dec_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, float* __restrict__ out,
                                                   const int4* __restrict__ info, const int* __restrict__ paths,
                                                   float* part, int* /* count: unused (a cluster's records) */,
                                                   int nmax, int n_heads, int n_kv_heads, float scale, float softcap,
                                                   const QActOut& qo, const float* __restrict__ qsigns,
                                                   const DecRope& rp) {
    constexpr int P = ATT_THREADS / HD;  // value parts of an output value (`attention`'s P)
    constexpr int QF = HD / 16;          // float4s in a quarter of the head
    constexpr int RW = HD + 2;           // a chunk record: m, z, o[HD]
    __shared__ __align__(16) float qs[HD];
    __shared__ float sp[4][ATT_CHUNK];
    __shared__ __align__(16) float es[HD / 32][ATT_CHUNK];  // each PV warp's copy of the exponentials
    __shared__ __align__(16) int offs[ATT_CHUNK];           // the chunk's key rows, as offsets into k and v
    __shared__ float rec[ATT_DEC_CAP * RW];
    __shared__ __align__(16) float kn[ROPE ? HD : 4];  // the new key, rotated
    __shared__ float vns[ROPE ? HD : 1];               // the new value row
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const long long qh = (long long)blockIdx.y * n_heads + h;  // the (query, head)'s row of q, out and part
    // The key list is staged with the pass (written by no kernel): read before the wait (`ld_early`).
    const int4 qi = ld_early(info + blockIdx.y);
    const int nc = qi.y - qi.x, nk = nc + qi.w;
    const int nch = (nk + ATT_CHUNK - 1) / ATT_CHUNK;
    // Element offsets fit in 32 bits (the host checks the cache's length).
    const int kvd = n_kv_heads * HD, kvo = (h / (n_heads / n_kv_heads)) * HD;
    // RoPE: thread i < half's pair's cos and sin (the table, the staged position), before the wait.
    float rc = 0.0f, rs = 0.0f;
    if (ROPE && tid < rp.half) {
        const float2 cs = ld_early(rp.tab + (long long)ld_early(rp.pos) * rp.half + tid);
        rc = cs.x;
        rs = cs.y;
    }
    const int j = tid % ATT_CHUNK, qt = tid / ATT_CHUNK;
    float4 kq[QF];        // this thread's key quarter (key j of the chunk)
    float vv[ATT_CHUNK];  // thread d < HD: value d of the chunk's keys
    // Chunk c's key rows into `offs`, then this thread's key quarter and values from the caches, the new row
    // (ROPE: offset −1, taken from kn and vns) left out. `pre`: the call before the wait, whose loads must be
    // `ld_early`'s (see below); after the wait plain loads, which go through L1 as weak loads where `ld_early`'s
    // are strong L2 ones: on an H100 the 1.5B's decode at 4,000 tokens of context took 7.1 % more tokens a second
    // so (docs/cuda.md, "Weak loads after the wait").
    auto load_kv = [&](int c, bool pre) {
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        if (c != (int)blockIdx.z) __syncthreads();  // the previous chunk's readers of offs, sp, es are done
        dec_key_rows<ROPE>(offs, qi, paths, nk, nc, kvd, kvo, j0, cnt, tid);
        __syncthreads();
        // This thread's key quarter and (thread d < HD) the chunk's values of output value d, in flight at once.
        dec_key_quarter<HD, ROPE>(kq, k, offs, j, qt, cnt, pre);
        if (tid < HD) {
#pragma unroll
            for (int j4 = 0; j4 < ATT_CHUNK; j4 += 4) {
                const int4 o4 = *reinterpret_cast<const int4*>(offs + j4);
                const int o[4] = {o4.x, o4.y, o4.z, o4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    vv[j4 + u] = j4 + u < cnt && (!ROPE || o[u] >= 0) ? (pre ? ld_early(v + o[u] + tid) : v[o[u] + tid]) : 0.0f;
            }
        }
    };
    // ROPE (decode steps): the block's first chunk is read before the wait. Its rows are cache rows earlier
    // passes wrote (the step's own row comes from kraw and vraw, and this kernel's store of it is read by no
    // block; every pass starts a list of its own), the kernel before this one (the q/k/v product, or the q/k
    // norms of models that have them) writes no cache row, and every earlier kernel has ended (each block of
    // every kernel waits before it lets the next launch, and none exits before its wait): so the keys' and
    // values' memory round trip overlaps that kernel (`ld_early`: an L2 load the compiler keeps before the
    // wait). A kernel that returned before its wait, or a pass sharing a list, would break this.
    const bool early = ROPE && nk > 0 && (int)blockIdx.z < nch;
    if (early) load_kv(blockIdx.z, true);
    pdl_wait();
    float val = 0.0f;  // output value tid (tid < HD)
    if (nk > 0) {
        if ((int)blockIdx.z >= nch) return;  // (an exited block does not hold the cluster barrier up)
        unsigned int csize;
        const unsigned int crank = cluster_rank_and_size(csize);
        const bool single = nch == 1;
        // Before a block stores into the first block's shared memory, every block of the cluster has started:
        // the barrier's first phase (arrived here, waited for at the first store).
        if (!single) cluster_arrive_relaxed();
        if (!ROPE) {
            if (tid < HD) qs[tid] = q[qh * HD + tid];
        } else if (tid < HD) {
            // The KV head's first query head's first block also stores the new rows into the caches (each
            // thread the values it computed).
            const bool store = blockIdx.z == 0 && h % (n_heads / n_kv_heads) == 0;
            const long long row = (long long)(qi.y - 1) * kvd + kvo;
            dec_new_row<HD, true>(rp, kn, vns, tid, kvo, row, store, rc, rs, q + qh * HD, qs);
        }
        for (int c = blockIdx.z; c < nch; c += gridDim.z) {
            const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
            const int jn = ROPE && j0 + cnt == nk ? cnt - 1 : -1;  // RoPE: the new key's index in the chunk
            if (early && c == (int)blockIdx.z) {
                __syncthreads();  // (loaded before the wait) the RoPE above wrote qs, kn, vns
            } else {
                load_kv(c, false);
            }
            if (ROPE && j < cnt && offs[j] < 0) {  // the new key, rotated above
                const float4* kr = reinterpret_cast<const float4*>(kn + qt * (HD / 4));
#pragma unroll
                for (int u = 0; u < QF; ++u) kq[u] = kr[u];
            }
            if (j < cnt) {
                const float* qq = qs + qt * (HD / 4);
                float p = 0.0f;
#pragma unroll
                for (int u = 0; u < QF; ++u) p = att_dot4(p, qq + 4 * u, kq[u]);
                sp[qt][j] = p;
            }
            __syncthreads();
            if (!single && c == (int)blockIdx.z) cluster_wait();
            if (tid >= HD) continue;
            const float vn = ROPE && jn >= 0 ? vns[tid] : 0.0f;  // RoPE: value tid of the new row
            // Scores of keys lane and lane + 32; the chunk's max and exponential sum as `attention`'s two warps.
            float m, z;
            dec_chunk_softmax(&sp[0][0], es[w], cnt, lane, scale, softcap, m, z);
            __syncwarp();
            // Output value tid: the P chains over the keys pt, pt + P, ... (key jj extends chain jj % P, keys
            // in increasing order), added in order.
            float a[P];
#pragma unroll
            for (int pt = 0; pt < P; ++pt) a[pt] = 0.0f;
#pragma unroll
            for (int j4 = 0; j4 < ATT_CHUNK; j4 += 4) {
                const float4 e4 = *reinterpret_cast<const float4*>(&es[w][j4]);
                const float ej[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    // RoPE: the new row's value (key jn of the last chunk) from the raw row.
                    const float vj = ROPE && j4 + u == jn ? vn : vv[j4 + u];
                    if (j4 + u < cnt) a[(j4 + u) % P] = __fmaf_rn(ej[u], vj, a[(j4 + u) % P]);
                }
            }
            float acc = a[0];
#pragma unroll
            for (int pt = 1; pt < P; ++pt) acc = __fadd_rn(acc, a[pt]);
            if (single) {
                val = __fmul_rn(acc, __fdiv_rn(1.0f, z));
            } else if (c < ATT_DEC_CAP) {
                float* r = rec + c * RW;
                st_cluster_shared_f32(r + 2 + tid, 0, acc);
                if (tid == 0) {
                    st_cluster_shared_f32(r, 0, m);
                    st_cluster_shared_f32(r + 1, 0, z);
                }
            } else {
                float* r = part + (qh * nmax + c) * RW;
                r[2 + tid] = acc;
                if (tid == 0) {
                    r[0] = m;
                    r[1] = z;
                }
            }
        }
        if (!single) {
            // The records meet at the cluster barrier; the first block combines them in chunk order.
            cluster_arrive();
            if (crank != 0) return;
            cluster_wait();
            if (tid < HD) {
                const float* pb = part + qh * nmax * RW;
                auto rd = [&](int c, int x) { return c < ATT_DEC_CAP ? rec[c * RW + x] : __ldcg(pb + c * RW + x); };
                float M = -INFINITY;
                for (int c = 0; c < nch; ++c) M = fmaxf(M, rd(c, 0));
                float Z = 0.0f, o = 0.0f;
#pragma unroll 4
                for (int c = 0; c < nch; ++c) {
                    const float wc = expf(__fsub_rn(rd(c, 0), M));
                    Z = __fmaf_rn(rd(c, 1), wc, Z);
                    o = __fmaf_rn(rd(c, 2 + tid), wc, o);
                }
                val = __fmul_rn(o, __fdiv_rn(1.0f, Z));
            }
        }
    } else if (blockIdx.z != 0) {
        return;
    }
    if (tid < HD) att_put(out, (long long)n_heads * HD, blockIdx.y, (long long)h * HD + tid, val, lane, qsigns, qo);
}

// The decode kernels' parameters: `attention`'s (hd unused; count used by `attention_dkv` only), then the
// quantized output's.
#define ATT_DEC_PARAMS                                                                                             \
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ out, \
        const int4* __restrict__ info, const int* __restrict__ paths, float* part, int* count, int nmax,           \
        int n_heads, int n_kv_heads, int hd, float scale, float softcap, const float* __restrict__ qsigns,         \
        int8_t* __restrict__ qq, float* __restrict__ qscale, int* __restrict__ qsum, float* __restrict__ qdsum,    \
        int* __restrict__ qsum16, unsigned char* qtq, long long qtg
// A decode kernel family `NAME` (`IMPL`: attention_dec_impl or attention_dkv_impl): NAME_hdHDV without the
// step's RoPE, NAME_rope_hdHDV with it.
#define ATT_DEC_FAMILY(NAME, IMPL, HDV)                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) NAME##_hd##HDV(ATT_DEC_PARAMS) {                  \
        const QActOut qo = {qq, qscale, qsum, qdsum, qsum16, qtq, qtg, ((long long)n_heads * HDV) >> 5};           \
        const DecRope rp = {};                                                                                     \
        IMPL<HDV, false>(q, k, v, out, info, paths, part, count, nmax, n_heads, n_kv_heads, scale, softcap, qo,    \
                         qsigns, rp);                                                                              \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) NAME##_rope_hd##HDV(                              \
        ATT_DEC_PARAMS, const float* __restrict__ kraw, const float* __restrict__ vraw, float* kc, float* vc,      \
        const int* __restrict__ pos, const float2* __restrict__ tab, int half, int neox) {                         \
        const QActOut qo = {qq, qscale, qsum, qdsum, qsum16, qtq, qtg, ((long long)n_heads * HDV) >> 5};           \
        const DecRope rp = {kraw, vraw, kc, vc, pos, tab, half, neox};                                             \
        IMPL<HDV, true>(q, k, v, out, info, paths, part, count, nmax, n_heads, n_kv_heads, scale, softcap, qo,     \
                        qsigns, rp);                                                                               \
    }
ATT_DEC_FAMILY(attention_dec, attention_dec_impl, 64)
ATT_DEC_FAMILY(attention_dec, attention_dec_impl, 128)

// The decode step's attention split over blocks per KV head (`attention_dkv_hd*`; docs/cuda.md, "The decode
// attention per KV head, over many blocks"): one query (t = 1), head dims 64 and 128, a grid (S, KV heads) of
// blocks with no cluster. The work of a KV head is nch × G / g items (G = n_heads / n_kv_heads query heads; g
// the smallest divisor of G, at most ATT_DKV_MAXG(HD), whose items fit the S blocks, else the largest): item
// w = c + nch·hg is chunk c of the heads hg·g .. hg·g + g − 1 of the KV head, and block b takes the items b,
// b + S, ... in turn. An item loads the chunk's 64 keys and values once for its g query heads, and at depth a
// KV head's chunks run side by side where `attention_dec` walks them in the series of one cluster's blocks.
// Every value is computed by `attention`'s operations in its order (as `attention_dec_impl` states them): a
// head's scores, exponentials, z and output chains per chunk, the chunk records (m, z, o[HD]) into `part`, and
// the block that finishes a head group's last item (a device counter per group, reset by it) combines each
// head's records in chunk order as `att_combine_value` does: M = max m_c, w_c = expf(m_c − M), Z and o[d] the
// fma chains of z_c·w_c and o_c[d]·w_c, out = o·(1/Z). One chunk: out = o·(1/z) (the combination's exact
// value). ROPE: the step's RoPE and cache store as `attention_dec_rope_hd*` (the new key and value from `kraw`,
// `vraw`; the item of the last chunk and head group 0 stores them). The output quantized by the warp of 32
// output values as `attention`'s.
// Registers and shared memory are sized to run two blocks a multiprocessor next to the kernel before it (as
// `attention_dec`, 128 registers and ≈ 12 KB; a larger grid runs in waves, no block waits for another but at
// the counter): a thread holds its key quarter (32 values at HD 128), while its
// values are prefetched into L2 with the keys and loaded into registers once the scores are done; the score
// quarters, the output parts and the combination's weights share one array.
#define ATT_DKV_MAXG(HD) ((HD) == 64 ? 8 : 6)
#define ATT_DKV_CB 16  // chunks whose values a combining thread loads at once
template <int HD, bool ROPE>
__device__ __forceinline__ void attention_dkv_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, float* __restrict__ out,
                                                   const int4* __restrict__ info, const int* __restrict__ paths,
                                                   float* part, int* count, int nmax, int n_heads, int n_kv_heads,
                                                   float scale, float softcap, const QActOut& qo,
                                                   const float* __restrict__ qsigns, const DecRope& rp) {
    constexpr int P = ATT_THREADS / HD;  // value parts of an output value
    constexpr int QF = HD / 16;          // float4s in a quarter of the head
    constexpr int VPT = ATT_CHUNK / P;   // values a thread loads of a chunk
    constexpr int RW = HD + 2;           // a chunk record: m, z, o[HD]
    constexpr int MG = ATT_DKV_MAXG(HD);
    __shared__ __align__(16) float qs[MG][HD];           // the item's query heads (rotated: ROPE)
    // Score quarters sp[h][qt][j], then output parts red[h][pt·HD + d], then the combination's w_c and z_c of 64
    // chunks (cw[h][c], cz[h][c]): one after the other, a barrier between.
    __shared__ __align__(16) float work[MG * ATT_THREADS];
    __shared__ __align__(16) float es[MG][ATT_CHUNK];    // exponentials
    __shared__ float ms[MG], zs[MG];                     // a chunk's m and z; the combination's M
    __shared__ __align__(16) int offs[ATT_CHUNK];        // the chunk's key rows as offsets (−1: the new row)
    __shared__ __align__(16) float kn[ROPE ? HD : 4];    // the new key, rotated
    __shared__ float vns[ROPE ? HD : 1];                 // the new value row
    __shared__ float2 cs[ROPE ? HD / 2 : 1];             // the (cos, sin) of the pairs
    __shared__ int last;
    auto sp = [&](int h, int qt, int j) -> float& { return work[(h * 4 + qt) * ATT_CHUNK + j]; };
    auto red = [&](int h, int i) -> float& { return work[h * ATT_THREADS + i]; };
    float* cw = work;                    // [h · 64 + c]
    float* cz = work + MG * ATT_CHUNK;   // [h · 64 + c]
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int kvh = blockIdx.y, S = gridDim.x, G = n_heads / n_kv_heads;
    const long long qd = (long long)n_heads * HD;
    // The key list is staged with the pass (written by no kernel): read before the wait (`ld_early`).
    const int4 qi = ld_early(info);
    const int nc = qi.y - qi.x, nk = nc + qi.w;
    const int nch = (nk + ATT_CHUNK - 1) / ATT_CHUNK;
    int g = 1;  // query heads an item: the smallest divisor of G (at most MG) whose items fit
    for (int d = 1; d <= min(G, MG); ++d) {
        if (G % d == 0) {
            g = d;
            if (nch * (G / d) <= S) break;
        }
    }
    const int W = nch * (G / g);
    const int kvd = n_kv_heads * HD, kvo = kvh * HD;
    if (ROPE && tid < rp.half) cs[tid] = ld_early(rp.tab + (long long)ld_early(rp.pos) * rp.half + tid);
    const int j = tid % ATT_CHUNK, qt = tid / ATT_CHUNK;  // key j's quarter qt
    const int vd = tid % HD, vpt = tid / HD;              // value vd of the keys vpt, vpt + P, ...
    float4 kq[QF];
    // Chunk c's key rows into `offs`, this thread's key quarter into kq, and the chunk's values into L2 (the new
    // row left out: ROPE). `pre`: before the wait (`ld_early`; see `attention_dec_impl` for why that is safe
    // for ROPE launches; a prefetch only warms L2).
    auto load_k = [&](int c, bool pre) {
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        __syncthreads();  // the previous item's readers of offs (and of the shared arrays) are done
        dec_key_rows<ROPE>(offs, qi, paths, nk, nc, kvd, kvo, j0, cnt, tid);
        __syncthreads();
        dec_key_quarter<HD, ROPE>(kq, k, offs, j, qt, cnt, pre);
        constexpr int LPR = HD / 32;  // 128-byte lines of a value row
        for (int x = tid; x < cnt * LPR; x += ATT_THREADS) {
            const int o = offs[x / LPR];
            if (!ROPE || o >= 0) prefetch_l2(v + o + (x % LPR) * 32);
        }
    };
    const bool early = ROPE && nk > 0 && (int)blockIdx.x < W;
    if (early) load_k((int)blockIdx.x % nch, true);
    pdl_wait();
    if (nk <= 0) {
        if (blockIdx.x == 0)
            for (int e = tid; e < G * HD; e += ATT_THREADS)
                att_put(out, qd, 0, (long long)kvh * G * HD + e, 0.0f, lane, qsigns, qo);
        return;
    }
    const bool single = nch == 1;
    for (int wi = blockIdx.x; wi < W; wi += S) {
        const int c = wi % nch, h0 = kvh * G + (wi / nch) * g;  // the item's chunk and first query head
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        const int jn = ROPE && j0 + cnt == nk ? cnt - 1 : -1;  // ROPE: the new key's index in the chunk
        if (!(early && wi == (int)blockIdx.x)) load_k(c, false);
        // The item's query heads into qs (ROPE: rotated; dims from 2·half on copied), and with the last chunk
        // the new key and value (the item of head group 0 also stores them into the caches' row info.y − 1).
        if (!ROPE) {
            for (int e = tid; e < g * HD; e += ATT_THREADS) qs[e / HD][e % HD] = q[(long long)h0 * HD + e];
        } else {
            const int hw = HD - rp.half;  // a head's threads: the pairs, then the copied dims
            for (int e = tid; e < g * hw; e += ATT_THREADS) {
                const int h = e / hw, i = e % hw;
                const float* qr = q + (long long)(h0 + h) * HD;
                if (i < rp.half) {
                    const int a = rope_a(i, rp.half, rp.neox), b = rope_b(i, rp.half, rp.neox);
                    float y0, y1;
                    rope_turn(qr[a], qr[b], cs[i].x, cs[i].y, y0, y1);
                    qs[h][a] = y0;
                    qs[h][b] = y1;
                } else {
                    const int d = i + rp.half;
                    qs[h][d] = qr[d];
                }
            }
            if (jn >= 0 && tid < HD) {
                const float2 c2 = tid < rp.half ? cs[tid] : make_float2(0.0f, 0.0f);
                const long long row = (long long)(qi.y - 1) * kvd + kvo;
                dec_new_row<HD, false>(rp, kn, vns, tid, kvo, row, h0 == kvh * G, c2.x, c2.y, nullptr, nullptr);
            }
        }
        __syncthreads();
        if (ROPE && j < cnt && offs[j] < 0) {  // the new key, rotated above
            const float4* kr = reinterpret_cast<const float4*>(kn + qt * (HD / 4));
#pragma unroll
            for (int u = 0; u < QF; ++u) kq[u] = kr[u];
        }
        // Score quarters: thread (j, qt) for every head of the item.
        if (j < cnt) {
            for (int h = 0; h < g; ++h) {
                const float* qq = &qs[h][qt * (HD / 4)];
                float p = 0.0f;
#pragma unroll
                for (int u = 0; u < QF; ++u) p = att_dot4(p, qq + 4 * u, kq[u]);
                sp(h, qt, j) = p;
            }
        }
        // This thread's values (from L2: prefetched with the keys), in flight over the softmax (offs past cnt are
        // stale and not used).
        float vv[VPT];
#pragma unroll
        for (int u = 0; u < VPT; ++u) {
            const int jj = vpt + u * P;
            const int o = offs[jj];
            vv[u] = jj < cnt && (!ROPE || o >= 0) ? v[o + vd] : 0.0f;
        }
        __syncthreads();
        // Warp h: head h's scores of keys lane and lane + 32, m, the exponentials, z (`attention`'s two warps).
        for (int h = wp; h < g; h += ATT_THREADS / 32) {
            float m, z;
            dec_chunk_softmax(&sp(h, 0, 0), es[h], cnt, lane, scale, softcap, m, z);
            if (lane == 0) {
                ms[h] = m;
                zs[h] = z;
            }
        }
        __syncthreads();  // (also: every score quarter read before the output parts replace them)
        // Output chains: thread (vd, vpt) over the keys vpt, vpt + P, ... in order, for every head of the item.
        const float vn = jn >= 0 ? vns[vd] : 0.0f;
        for (int h = 0; h < g; ++h) {
            float acc = 0.0f;
#pragma unroll
            for (int u = 0; u < VPT; ++u) {
                const int jj = vpt + u * P;
                if (jj < cnt) acc = __fmaf_rn(es[h][jj], ROPE && jj == jn ? vn : vv[u], acc);
            }
            red(h, vpt * HD + vd) = acc;
        }
        __syncthreads();
        // The parts added in order: the output (one chunk) or the chunk records.
        for (int e = tid; e < g * HD; e += ATT_THREADS) {
            const int h = e / HD, d = e % HD;
            float acc = red(h, d);
#pragma unroll
            for (int pt = 1; pt < P; ++pt) acc = __fadd_rn(acc, red(h, pt * HD + d));
            if (single) {
                att_put(out, qd, 0, (long long)h0 * HD + e, __fmul_rn(acc, __fdiv_rn(1.0f, zs[h])), lane, qsigns, qo);
            } else {
                float* r = part + ((long long)(h0 + h) * nmax + c) * RW;
                r[2 + d] = acc;
                if (d == 0) {
                    r[0] = ms[h];
                    r[1] = zs[h];
                }
            }
        }
        if (single) continue;
        // The block that finishes the head group's last item combines its heads' records.
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(count + h0, 1) == nch - 1;
        __syncthreads();  // (also: the output parts are read before the weights replace them)
        if (!last) continue;
        __threadfence();
        if (tid == 0) count[h0] = 0;
        const float* base = part + (long long)h0 * nmax * RW;  // head h's chunk c at base + (h·nmax + c)·RW
        // Outputs e = tid + 256·r of the group's g·HD, two at a time (r0, r0 + 1), each over the chunks
        // ATT_DKV_CB at a time; the first batch's values are loaded with M's and the first weights' records.
        for (int r0 = 0; r0 * ATT_THREADS < g * HD; r0 += 2) {
            const float* pr[2];
            bool has[2];
            float acc[2], Z[2], o[2][ATT_DKV_CB];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int e = tid + (r0 + r) * ATT_THREADS;
                has[r] = e < g * HD;
                pr[r] = base + (long long)(e / HD) * nmax * RW + 2 + e % HD;
                acc[r] = Z[r] = 0.0f;
            }
            for (int c0 = 0; c0 < nch; c0 += ATT_DKV_CB) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (has[r]) {
#pragma unroll
                        for (int u = 0; u < ATT_DKV_CB; ++u)
                            if (c0 + u < nch) o[r][u] = __ldcg(pr[r] + (long long)(c0 + u) * RW);
                    }
                }
                // The weights of chunks c0 .. c0 + 63 (warp h: head h), with M first (over every chunk; the first
                // 64 chunks' m and z kept from that pass): in the first pass's first batch, then every 64 chunks
                // (and again from chunk 0 in later passes where they were replaced).
                if (c0 % 64 == 0 && (r0 == 0 || nch > 64)) {
                    __syncthreads();  // the weights' earlier readers are done
                    for (int h = wp; h < g; h += ATT_THREADS / 32) {
                        const float* rh = base + (long long)h * nmax * RW;
                        float m2[2], z2[2];
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const int cc = c0 + lane + 32 * hf;
                            m2[hf] = cc < nch ? __ldcg(rh + (long long)cc * RW) : -INFINITY;
                            z2[hf] = cc < nch ? __ldcg(rh + (long long)cc * RW + 1) : 0.0f;
                        }
                        if (c0 == 0 && r0 == 0) {
                            float mx = fmaxf(m2[0], m2[1]);
                            for (int cc = lane + 64; cc < nch; cc += 32) mx = fmaxf(mx, __ldcg(rh + (long long)cc * RW));
                            mx = warp_max(mx);
                            if (lane == 0) ms[h] = mx;
                            __syncwarp();
                        }
                        const float M = ms[h];
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            cw[h * 64 + lane + 32 * hf] = expf(__fsub_rn(m2[hf], M));
                            cz[h * 64 + lane + 32 * hf] = z2[hf];
                        }
                    }
                    __syncthreads();
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (has[r]) {
                        const int h = (tid + (r0 + r) * ATT_THREADS) / HD;
#pragma unroll
                        for (int u = 0; u < ATT_DKV_CB; ++u) {
                            if (c0 + u < nch) {
                                const float wc = cw[h * 64 + (c0 + u) % 64];
                                Z[r] = __fmaf_rn(cz[h * 64 + (c0 + u) % 64], wc, Z[r]);
                                acc[r] = __fmaf_rn(o[r][u], wc, acc[r]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if (has[r]) {
                    const int e = tid + (r0 + r) * ATT_THREADS;
                    att_put(out, qd, 0, (long long)h0 * HD + e, __fmul_rn(acc[r], __fdiv_rn(1.0f, Z[r])), lane, qsigns, qo);
                }
            }
        }
    }
}

ATT_DEC_FAMILY(attention_dkv, attention_dkv_impl, 64)
ATT_DEC_FAMILY(attention_dkv, attention_dkv_impl, 128)

// The same attention with one block per (KV head, query, z) for launches of several queries (prefill and
// verify): the block stages each chunk's keys and values of its KV head in shared memory once, and its warps
// take the query heads that share them (warp w the heads w, w + 8, ...), so the g = n_heads / n_kv_heads heads
// read them once instead of g times and a launch has g times fewer blocks. Every value is computed by the
// operations `attention` uses, in its order: the four quarter chains of a score (one lane computes all four
// for its key, lane l the keys l and l + 32), the max and the exponential sum as its two warps' trees (here one
// warp's two trees), each output value's P = ATT_THREADS / hd fma chains over the keys p, p + P, ... added in
// order, the same chunk records and combination; so each (query, head) gets the same bits from either kernel.
// Dynamic shared memory: keys and values [ATT_CHUNK][hd + 1] each (padded: lane l reads row l), the g query
// rows [g][hd] and the warps' exponentials [8][ATT_CHUNK] (`att_kv_smem` on the host). hd: a multiple of 16 up
// to ATT_KV_MAX_HD.
#define ATT_KV_MAX_HD 128
#define ATT_KV_ND (ATT_KV_MAX_HD / 32)  // output values a lane computes at once
#define ATT_KVB 4                       // float4s of keys (and of values) a thread loads at once
#define ATT_KV_MAX_GROUP 16
#define ATT_KV_QB (ATT_KV_MAX_GROUP * ATT_KV_MAX_HD / ATT_THREADS)  // query values a thread loads
// Output values lane + 32·u (u < ND) of a (query, head) and chunk into acc[u]: per value the P chains over the
// keys pt, pt + P, ... (weights es, values vs with row stride ld) in order, then their sum in order.
struct AttAcc {
    float v[ATT_KV_ND];
};
template <int ND>
__device__ __forceinline__ AttAcc att_kv_values(const float* es, const float* vs, int ld, int lane, int hd, int P, int cnt) {
    AttAcc r;
    float* acc = r.v;
#pragma unroll
    for (int u = 0; u < ATT_KV_ND; ++u) acc[u] = 0.0f;
#pragma unroll 1
    for (int pt = 0; pt < P; ++pt) {
        float a[ND];
#pragma unroll
        for (int u = 0; u < ND; ++u) a[u] = 0.0f;
#pragma unroll 4
        for (int jj = pt; jj < cnt; jj += P) {
            const float e = es[jj];
            const float* vr = vs + jj * ld + lane;
#pragma unroll
            for (int u = 0; u < ND; ++u)
                if (lane + 32 * u < hd) a[u] = __fmaf_rn(e, vr[32 * u], a[u]);
        }
#pragma unroll
        for (int u = 0; u < ND; ++u) acc[u] = pt == 0 ? a[u] : __fadd_rn(acc[u], a[u]);
    }
    return r;
}
// A chunk's scores from the summed quarter chains of keys lane and lane + 32 (`raw0`, `raw1`): scaled and
// soft-capped; the chunk's max `m` and exponential sum `z` as `attention`'s two warps' trees; the exponentials
// into `es` (read back after the `__syncwarp`). Shared by `att_kv_scores` and `attention_kvs`.
__device__ __forceinline__ void att_kv_softmax(float raw0, float raw1, float* es, int lane, int cnt, float scale,
                                               float softcap, float& m, float& z) {
    float s[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float sv = -INFINITY;
        if (lane + 32 * half < cnt) {
            sv = __fmul_rn(half == 0 ? raw0 : raw1, scale);
            if (softcap > 0.0f) sv = __fmul_rn(softcap, tanhf(__fdiv_rn(sv, softcap)));
        }
        s[half] = sv;
    }
    m = fmaxf(warp_max(s[0]), warp_max(s[1]));
    const float e0 = lane < cnt ? expf(__fsub_rn(s[0], m)) : 0.0f;
    const float e1 = lane + 32 < cnt ? expf(__fsub_rn(s[1], m)) : 0.0f;
    z = __fadd_rn(warp_sum(e0), warp_sum(e1));
    es[lane] = e0;
    es[lane + 32] = e1;
    __syncwarp();
}
// One warp's query head on a staged chunk (`attention_kv`, `attention_kvc`): the scores of keys lane and lane + 32
// against the query row `qr` (keys `ks`, row stride `ld`, q4 = hd / 4), each the four quarter chains in increasing
// d (four query values from one broadcast load serve both keys' chains), added in order, scaled, soft-capped; the
// chunk's max `m` and exponential sum `z` as `attention`'s two warps' trees; the exponentials into `es` (the
// warp's copy, read back by `att_kv_values` after the `__syncwarp`).
__device__ __forceinline__ void att_kv_scores(const float* qr, const float* ks, float* es, int ld, int q4, int lane,
                                              int cnt, float scale, float softcap, float& m, float& z) {
    float pc[2][4];
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
        pc[0][k4] = 0.0f;
        pc[1][k4] = 0.0f;
        const float* kq = qr + k4 * q4;
#pragma unroll 4
        for (int d = 0; d < q4; d += 4) {
            const float4 qv = *reinterpret_cast<const float4*>(kq + d);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int j = lane + 32 * half;
                if (j < cnt) {
                    const float* kr = ks + j * ld + k4 * q4 + d;
                    float a = pc[half][k4];
                    a = __fmaf_rn(qv.x, kr[0], a);
                    a = __fmaf_rn(qv.y, kr[1], a);
                    a = __fmaf_rn(qv.z, kr[2], a);
                    a = __fmaf_rn(qv.w, kr[3], a);
                    pc[half][k4] = a;
                }
            }
        }
    }
    float raw[2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
        raw[half] = __fadd_rn(__fadd_rn(__fadd_rn(pc[half][0], pc[half][1]), pc[half][2]), pc[half][3]);
    att_kv_softmax(raw[0], raw[1], es, lane, cnt, scale, softcap, m, z);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2)
    attention_kv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 float* __restrict__ out, const int4* __restrict__ info, const int* __restrict__ paths, float* part,
                 int* count, int nmax, int n_heads, int n_kv_heads, int hd, float scale, float softcap,
                 const float* __restrict__ qsigns, int8_t* __restrict__ qq, float* __restrict__ qscale,
                 int* __restrict__ qsum, float* __restrict__ qdsum, int* __restrict__ qsum16, unsigned char* qtq,
                 long long qtg) {
    pdl_wait();
    extern __shared__ __align__(16) float att_smem[];
    __shared__ long long rows[ATT_CHUNK];
    const int kvh = blockIdx.x, i = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = n_heads / n_kv_heads, h0 = kvh * g, ld = hd + 1, q4 = hd >> 2;
    float* ks = att_smem;
    float* vs = ks + ATT_CHUNK * ld;
    float* qs = vs + ATT_CHUNK * ld;
    float* es = qs + g * hd + warp * ATT_CHUNK;
    const long long qd = (long long)n_heads * hd, kvd = (long long)n_kv_heads * hd;
    // The group's query rows, loaded with the key list's bounds (g·hd ≤ ATT_KV_QB·ATT_THREADS values).
    float qpre[ATT_KV_QB];
#pragma unroll
    for (int u = 0; u < ATT_KV_QB; ++u) {
        const int x = tid + u * ATT_THREADS;
        qpre[u] = x < g * hd ? q[i * qd + (long long)h0 * hd + x] : 0.0f;
    }
    const int4 qi = info[i];
    const int nc = qi.y - qi.x, nk = nc + qi.w;
    const int nch = (nk + ATT_CHUNK - 1) / ATT_CHUNK;
    // Output value `d` of (query i, head h), quantized with its warp's 32 values when asked (lane = d % 32).
    const QActOut qo = {qq, qscale, qsum, qdsum, qsum16, qtq, qtg, qd >> 5};
    auto put = [&](int h, int d, float val) { att_put(out, qd, i, (long long)h * hd + d, val, lane, qsigns, qo); };
    if (nk <= 0) {
        if (blockIdx.z == 0)
            for (int r = warp; r < g; r += ATT_THREADS / 32)
                for (int d = lane; d < hd; d += 32) put(h0 + r, d, 0.0f);
        return;
    }
    if ((int)blockIdx.z >= nch) return;  // (an exited block does not hold a cluster barrier up)
    // Launched in clusters (rank = z), the chunk records meet at the cluster barrier and block 0's warps combine
    // them per head; otherwise the last block to finish a (query, head) does.
    unsigned int csize;
    const unsigned int crank = cluster_rank_and_size(csize);
    const bool clustered = csize > 1;
    // Head h's combination (its records complete and visible), in chunk order, by one warp.
    auto combine = [&](int h) {
        const float* base = part + ((long long)i * n_heads + h) * nmax * (hd + 2);
        const float M = att_combine_max(base, nch, hd);
        for (int d0 = 0; d0 < hd; d0 += 32) {
            const int d = d0 + lane;
            if (d >= hd) break;  // hd % 32 != 0 (never with quantization, which needs whole groups)
            float Z;
            const float o = att_combine_value(base, nch, hd, M, d, Z);
            put(h, d, __fmul_rn(o, __fdiv_rn(1.0f, Z)));
        }
    };
#pragma unroll
    for (int u = 0; u < ATT_KV_QB; ++u)
        if (tid + u * ATT_THREADS < g * hd) qs[tid + u * ATT_THREADS] = qpre[u];
    const bool single = nch == 1;
    const int P = ATT_THREADS / hd;
    for (int c = blockIdx.z; c < nch; c += gridDim.z) {
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        __syncthreads();  // the previous chunk's readers of rows, keys and values are done
        if (tid < cnt) {
            const int jj = j0 + tid;
            rows[tid] = jj < nc ? (long long)qi.x + jj : (long long)paths[qi.z + jj - nc];
        }
        __syncthreads();
        // The chunk's keys and values ATT_KVB float4s of each a thread at a time, all loaded before they are
        // stored (one memory round trip for a chunk of hd ≤ 128).
        for (int x0 = tid; x0 < cnt * q4; x0 += ATT_KVB * ATT_THREADS) {
            float4 kv[ATT_KVB], vv[ATT_KVB];
#pragma unroll
            for (int u = 0; u < ATT_KVB; ++u) {
                const int x = x0 + u * ATT_THREADS;
                if (x < cnt * q4) {
                    const long long at = rows[x / q4] * kvd + (long long)kvh * hd + 4 * (x % q4);
                    kv[u] = *reinterpret_cast<const float4*>(k + at);
                    vv[u] = *reinterpret_cast<const float4*>(v + at);
                }
            }
#pragma unroll
            for (int u = 0; u < ATT_KVB; ++u) {
                const int x = x0 + u * ATT_THREADS;
                if (x < cnt * q4) {
                    float* kd = ks + (x / q4) * ld + 4 * (x % q4);
                    float* vd = vs + (x / q4) * ld + 4 * (x % q4);
                    kd[0] = kv[u].x, kd[1] = kv[u].y, kd[2] = kv[u].z, kd[3] = kv[u].w;
                    vd[0] = vv[u].x, vd[1] = vv[u].y, vd[2] = vv[u].z, vd[3] = vv[u].w;
                }
            }
        }
        __syncthreads();
        for (int r = warp; r < g; r += ATT_THREADS / 32) {
            const int h = h0 + r;
            float m, z;
            att_kv_scores(qs + r * hd, ks, es, ld, q4, lane, cnt, scale, softcap, m, z);
            const float inv1 = __fdiv_rn(1.0f, z);
            float* pp = part + (((long long)i * n_heads + h) * nmax + c) * (hd + 2);
            // Output values lane, lane + 32, ... at once (two for head dims up to 64, else ATT_KV_ND): each
            // exponential read serves all of them; per value the P chains over the keys pt, pt + P, ... and their
            // sum in order, as before.
            const AttAcc va = hd <= 64 ? att_kv_values<2>(es, vs, ld, lane, hd, P, cnt)
                                       : att_kv_values<ATT_KV_ND>(es, vs, ld, lane, hd, P, cnt);
            const float* acc = va.v;
#pragma unroll
            for (int u = 0; u < ATT_KV_ND; ++u) {
                const int d = lane + 32 * u;
                if (32 * u < hd) {  // warp-uniform (put quantizes with the whole warp)
                    if (d < hd && !single) pp[2 + d] = acc[u];
                    if (single && d < hd) put(h, d, __fmul_rn(acc[u], inv1));
                }
            }
            __syncwarp();  // es is rewritten by the warp's next head
            if (single) continue;
            if (lane == 0) {
                pp[0] = m;
                pp[1] = z;
            }
            if (clustered) continue;
            // The last block of this (query, head) to finish a chunk combines the chunks.
            __threadfence();
            __syncwarp();
            int* cnt_at = count + (long long)i * n_heads + h;
            int last = 0;
            if (lane == 0) last = atomicAdd(cnt_at, 1) == nch - 1;
            last = __shfl_sync(FULL, last, 0);
            if (!last) continue;
            __threadfence();
            if (lane == 0) *cnt_at = 0;
            combine(h);
        }
    }
    if (clustered && !single) {
        cluster_arrive();  // this block's records are written (each thread releases its own writes)
        if (crank != 0) return;
        cluster_wait();
        for (int r = warp; r < g; r += ATT_THREADS / 32) combine(h0 + r);
    }
}

// `attention_kv`'s launches in clusters, head dims 64 and 128 (verifies and short prefill passes by default
// from `att_kv_min` queries on; docs/cuda.md, "The verify's attention in clusters"): one 256-thread block per
// (KV head, query, z), the Z = gridDim.z chunk blocks of a (query, KV head) one thread-block cluster (rank =
// z; block z takes the chunks z, z + Z, … in turn). `attention_dec`'s shape on `attention_kv`'s work: the key
// list and the first chunk's key rows (as 32-bit element offsets) read before the wait (staged with the
// pass, written by no kernel); after it the group's query rows and the chunk's keys and values loaded at once
// (one memory round trip), staged in shared memory, one block barrier; the chunk records (m, z, o[HD]) of
// chunks below Z stored straight into the cluster's first block's shared memory (`st.shared::cluster`), the
// rest into `part`; after the cluster barrier that block's warps combine them per head in chunk order. No
// fence and no device counter (`attention_kv` without clusters: a fence, an atomic and two more round trips).
// Every value is computed by `attention_kv`'s operations in its order (the quarter chains of a score, the
// two xor trees, the P chains of an output value added in order, `attention`'s combination), so a (query,
// head) gets the same bits from either kernel.
// Dynamic shared memory (`att_kvc_smem` on the host): keys and values [ATT_CHUNK][HD + 1], the query rows
// [g][HD], the warps' exponentials [8][ATT_CHUNK], the records [Z][g][HD + 2] (used in the first block).
template <int HD>
__device__ __forceinline__ void attention_kvc_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, float* __restrict__ out,
                                                   const int4* __restrict__ info, const int* __restrict__ paths,
                                                   float* part, int nmax, int n_heads, int n_kv_heads, float scale,
                                                   float softcap, const QActOut& qo, const float* __restrict__ qsigns,
                                                   int shared) {
    constexpr int LD = HD + 1, Q4 = HD / 4, RW = HD + 2, P = ATT_THREADS / HD, ND = HD / 32;
    constexpr int KB = (ATT_CHUNK * Q4) / ATT_THREADS;  // float4s of keys (and of values) a thread loads
    extern __shared__ __align__(16) float kvc_smem[];
    __shared__ int offs[ATT_CHUNK];
    const int kvh = blockIdx.x, i = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = n_heads / n_kv_heads, h0 = kvh * g, Z = gridDim.z;
    float* ks = kvc_smem;
    float* vs = ks + ATT_CHUNK * LD;
    float* qs = vs + ATT_CHUNK * LD;
    float* es = qs + g * HD + warp * ATT_CHUNK;
    float* rec = qs + g * HD + (ATT_THREADS / 32) * ATT_CHUNK;
    const long long qd = (long long)n_heads * HD;
    // Element offsets fit in 32 bits (the host checks the cache's length).
    const int kvd = n_kv_heads * HD, kvo = kvh * HD;
    const int4 qi = ld_early(info + i);
    const int nc = qi.y - qi.x, nk = nc + qi.w;
    const int nch = (nk + ATT_CHUNK - 1) / ATT_CHUNK;
    // With `shared`, the chunks below S, wholly inside the first query's committed rows (which every query of
    // the launch sees from the same first row), have their records in `part` (`attention_kvs`, the launch
    // before); this launch computes the chunks S, S + 1, … (the tail) and combines them all.
    const int4 first = shared ? ld_early(info) : qi;
    const int S = shared ? (first.y - first.x) / ATT_CHUNK : 0, T = nch - S;
    // The first chunk's key rows, before the wait.
    const int c0 = blockIdx.z;
    auto offset = [&](int jj) { return (jj < nc ? qi.x + jj : ld_early(paths + qi.z + jj - nc)) * kvd + kvo; };
    if (c0 < T && tid < min(ATT_CHUNK, nk - (S + c0) * ATT_CHUNK)) offs[tid] = offset((S + c0) * ATT_CHUNK + tid);
    pdl_wait();
    auto put = [&](int h, int d, float val) { att_put(out, qd, i, (long long)h * HD + d, val, lane, qsigns, qo); };
    if (nk <= 0) {
        if (c0 == 0)
            for (int r = warp; r < g; r += ATT_THREADS / 32)
                for (int d = lane; d < HD; d += 32) put(h0 + r, d, 0.0f);
        return;
    }
    // (An exited block does not hold the cluster barrier up; the first block combines even without a tail.)
    if (c0 >= T && c0 != 0) return;
    unsigned int csize;
    const unsigned int crank = cluster_rank_and_size(csize);
    const bool single = nch == 1 && S == 0;
    // Before a block stores into the first block's shared memory, every block of the cluster has started: the
    // barrier's first phase (arrived here, waited for before the first store; without a tail, no store).
    if (!single && T > 0) cluster_arrive_relaxed();
    for (int c = S + c0; c < nch; c += Z) {
        const int j0 = c * ATT_CHUNK, cnt = min(ATT_CHUNK, nk - j0);
        if (c != S + c0) {
            __syncthreads();  // the previous chunk's readers of offs, keys, values are done
            if (tid < cnt) offs[tid] = offset(j0 + tid);
        }
        __syncthreads();
        // The chunk's keys and values (and with the first chunk the group's query rows), all in flight at once.
        float4 kv[KB], vv[KB];
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            const int x = tid + u * ATT_THREADS, j = x / Q4;
            if (j < cnt) {
                const int at = offs[j] + 4 * (x % Q4);
                kv[u] = *reinterpret_cast<const float4*>(k + at);
                vv[u] = *reinterpret_cast<const float4*>(v + at);
            }
        }
        if (c == S + c0)
            for (int x = tid; x < g * HD; x += ATT_THREADS) qs[x] = q[i * qd + (long long)h0 * HD + x];
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            const int x = tid + u * ATT_THREADS, j = x / Q4;
            if (j < cnt) {
                float* kd = ks + j * LD + 4 * (x % Q4);
                float* vd = vs + j * LD + 4 * (x % Q4);
                kd[0] = kv[u].x, kd[1] = kv[u].y, kd[2] = kv[u].z, kd[3] = kv[u].w;
                vd[0] = vv[u].x, vd[1] = vv[u].y, vd[2] = vv[u].z, vd[3] = vv[u].w;
            }
        }
        __syncthreads();
        if (!single && c == S + c0) cluster_wait();
#pragma unroll 1
        for (int r = warp; r < g; r += ATT_THREADS / 32) {
            const int h = h0 + r;
            float m, z;
            att_kv_scores(qs + r * HD, ks, es, LD, Q4, lane, cnt, scale, softcap, m, z);
            const AttAcc va = att_kv_values<ND>(es, vs, LD, lane, HD, P, cnt);
            if (single) {
                const float inv1 = __fdiv_rn(1.0f, z);
#pragma unroll 1
                for (int u = 0; u < ND; ++u) {
                    float a = va.v[0];  // va.v[u] by selects (an indexed register array would live in memory)
#pragma unroll
                    for (int x = 1; x < ND; ++x) a = u == x ? va.v[x] : a;
                    put(h, lane + 32 * u, __fmul_rn(a, inv1));
                }
            } else if (c - S < Z) {
                float* rr = rec + ((c - S) * g + r) * RW;
#pragma unroll
                for (int u = 0; u < ND; ++u) st_cluster_shared_f32(rr + 2 + lane + 32 * u, 0, va.v[u]);
                if (lane == 0) {
                    st_cluster_shared_f32(rr, 0, m);
                    st_cluster_shared_f32(rr + 1, 0, z);
                }
            } else {
                float* rr = part + (((long long)i * n_heads + h) * nmax + c) * RW;
#pragma unroll
                for (int u = 0; u < ND; ++u) rr[2 + lane + 32 * u] = va.v[u];
                if (lane == 0) {
                    rr[0] = m;
                    rr[1] = z;
                }
            }
            __syncwarp();  // es is rewritten by the warp's next head
        }
    }
    if (single) return;
    // The records meet at the cluster barrier; the first block's warps combine them per head in chunk order.
    if (T > 0) {
        cluster_arrive();
        if (crank != 0) return;
        cluster_wait();
    }
#pragma unroll 1
    for (int r = warp; r < g; r += ATT_THREADS / 32) {
        const int h = h0 + r;
        const float* pb = part + ((long long)i * n_heads + h) * nmax * RW;
        auto rd = [&](int c, int x) {
            return c >= S && c - S < Z ? rec[((c - S) * g + r) * RW + x] : __ldcg(pb + c * RW + x);
        };
        if (nch == 1) {
            // One chunk (its record from `attention_kvs`): the single chunk's output as above, not the
            // combination (which would turn an output of −0 into +0).
            const float inv1 = __fdiv_rn(1.0f, rd(0, 1));
#pragma unroll 1
            for (int u = 0; u < ND; ++u) put(h, lane + 32 * u, __fmul_rn(rd(0, 2 + lane + 32 * u), inv1));
            continue;
        }
        // M: the lanes' maxima over chunks lane, lane + 32, …, then the warp's (a max does not depend on the
        // order). Then the chains in chunk order, ATT_CB chunks' records loaded before their fmas, every
        // output value of the head at once: one memory round trip per ATT_CB chunks instead of one a chunk
        // and value.
        float M = -INFINITY;
        for (int c = lane; c < nch; c += 32) M = fmaxf(M, rd(c, 0));
        M = warp_max(M);
        float Zs = 0.0f, o[ND];
#pragma unroll
        for (int u = 0; u < ND; ++u) o[u] = 0.0f;
#pragma unroll 1
        for (int cb = 0; cb < nch; cb += ATT_CB) {
            float mb[ATT_CB], zb[ATT_CB], ob[ATT_CB][ND];
#pragma unroll
            for (int x = 0; x < ATT_CB; ++x) {
                const int c = min(cb + x, nch - 1);
                mb[x] = rd(c, 0);
                zb[x] = rd(c, 1);
#pragma unroll
                for (int u = 0; u < ND; ++u) ob[x][u] = rd(c, 2 + lane + 32 * u);
            }
#pragma unroll
            for (int x = 0; x < ATT_CB; ++x) {
                if (cb + x < nch) {
                    const float wc = expf(__fsub_rn(mb[x], M));
                    Zs = __fmaf_rn(zb[x], wc, Zs);
#pragma unroll
                    for (int u = 0; u < ND; ++u) o[u] = __fmaf_rn(ob[x][u], wc, o[u]);
                }
            }
        }
        const float inv = __fdiv_rn(1.0f, Zs);
#pragma unroll
        for (int u = 0; u < ND; ++u) put(h, lane + 32 * u, __fmul_rn(o[u], inv));
    }
}
#define ATT_KVC(HDV)                                                                                               \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_kvc_hd##HDV(ATT_DEC_PARAMS, int shared) { \
        const QActOut qo = {qq, qscale, qsum, qdsum, qsum16, qtq, qtg, ((long long)n_heads * HDV) >> 5};           \
        attention_kvc_impl<HDV>(q, k, v, out, info, paths, part, nmax, n_heads, n_kv_heads, scale, softcap, qo,   \
                                qsigns, shared);                                                                   \
    }
ATT_KVC(64)
ATT_KVC(128)

// The committed chunks of a tree verify (or of a block of queries that all see the same rows, or of causal
// queries without a window), shared by its queries: every query of such a launch sees the committed cache rows
// from the same first row info[i].x on, at least as far as the first query does (then its own path), so the
// chunks wholly inside the first query's, c < S = (info[0].y − info[0].x) / ATT_CHUNK, hold the same keys for
// all of them. `attention_kvs_hd<HD>`: one block of ATT_THREADS per (KV head, z, s) stages chunk c = z, z + Z,
// … (< S) of its KV head once and computes the chunk record (m, z, o[HD]) of every (query, query head) row of
// its share s of the launch's t·g rows (row i·g + r: query i, head kvh·g + r; the warps' rows consecutive, at
// most ATT_KVS_RPW a warp) into `part`, where `attention_kvc` (with `shared` set) reads them and computes the
// chunks from S on, the tail with the path keys, per query, as before. A block reads each committed key and
// value once for all the launch's queries instead of once per query, and a warp's rows reuse every key it
// holds in registers. Each record is computed by `att_kv_scores`' and `att_kv_values`' operations in their
// order (per score the four quarter chains in increasing d, added in order: the running sum over the quarters
// is that sum; the max and the exponential sum by the same xor trees over keys lane and lane + 32; per output
// value the P chains over the keys pt, pt + P, … added in order), so every row gets the bits it gets from
// `attention_kvc` alone, and from the decode kernel.
// Dynamic shared memory (`att_kvs_smem` on the host): keys and values [ATT_CHUNK][HD + 1], the block's query
// rows [8·ATT_KVS_RPW][HD], the warps' exponentials [8·ATT_KVS_RPW][ATT_CHUNK].
#define ATT_KVS_RPW 6
template <int HD>
__device__ __forceinline__ void attention_kvs_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, const int4* __restrict__ info,
                                                   float* __restrict__ part, int nmax, int t, int n_heads,
                                                   int n_kv_heads, float scale, float softcap) {
    constexpr int LD = HD + 1, Q4 = HD / 4, RW = HD + 2, P = ATT_THREADS / HD, ND = HD / 32, R = ATT_KVS_RPW;
    constexpr int W = ATT_THREADS / 32, KB = (ATT_CHUNK * Q4) / ATT_THREADS;
    extern __shared__ __align__(16) float kvs_smem[];
    const int kvh = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = n_heads / n_kv_heads, Z = gridDim.y;
    float* ks = kvs_smem;
    float* vs = ks + ATT_CHUNK * LD;
    float* qs = vs + ATT_CHUNK * LD + warp * R * HD;
    float* es = vs + ATT_CHUNK * LD + W * R * HD + warp * R * ATT_CHUNK;
    const int4 qi = ld_early(info);
    const int S = (qi.y - qi.x) / ATT_CHUNK;
    pdl_wait();  // (before any exit: the next kernel may launch once every block has passed its wait)
    if ((int)blockIdx.y >= S) return;
    // This warp's rows: the launch's t·g rows split evenly over the grid's warps (at most R each: the host's
    // share count).
    const int rows = t * g, per = (rows + W * gridDim.z - 1) / (W * gridDim.z);
    if (per > R) __trap();
    const int r0 = (blockIdx.z * W + warp) * per, nr = max(0, min(per, rows - r0));
    const long long qd = (long long)n_heads * HD;
    const int kvd = n_kv_heads * HD, kvo = kvh * HD;
    for (int r = 0; r < nr; ++r) {
        const int row = r0 + r, i = row / g, h = kvh * g + row % g;
        for (int x = lane; x < HD; x += 32) qs[r * HD + x] = q[i * qd + (long long)h * HD + x];
    }
    for (int c = blockIdx.y; c < S; c += Z) {
        const int j0 = qi.x + c * ATT_CHUNK;
        __syncthreads();  // the previous chunk's readers of keys and values are done
        {
            float4 kv[KB], vv[KB];
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                const int x = tid + u * ATT_THREADS, at = (j0 + x / Q4) * kvd + kvo + 4 * (x % Q4);
                kv[u] = *reinterpret_cast<const float4*>(k + at);
                vv[u] = *reinterpret_cast<const float4*>(v + at);
            }
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                const int x = tid + u * ATT_THREADS;
                float* kd = ks + (x / Q4) * LD + 4 * (x % Q4);
                float* vd = vs + (x / Q4) * LD + 4 * (x % Q4);
                kd[0] = kv[u].x, kd[1] = kv[u].y, kd[2] = kv[u].z, kd[3] = kv[u].w;
                vd[0] = vv[u].x, vd[1] = vv[u].y, vd[2] = vv[u].z, vd[3] = vv[u].w;
            }
        }
        __syncthreads();
        if (nr == 0) continue;
        // Scores of keys lane and lane + 32 against the warp's rows: per quarter the keys' values in registers,
        // each row's two quarter chains, added to the running sums in quarter order.
        float ps[R][2];
#pragma unroll
        for (int k4 = 0; k4 < 4; ++k4) {
            float kr[2][Q4];
#pragma unroll
            for (int d = 0; d < Q4; ++d) {
                kr[0][d] = ks[lane * LD + k4 * Q4 + d];
                kr[1][d] = ks[(lane + 32) * LD + k4 * Q4 + d];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < nr) {
                    const float* qr = qs + r * HD + k4 * Q4;
                    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
                    for (int d = 0; d < Q4; d += 4) {
                        const float4 qv = *reinterpret_cast<const float4*>(qr + d);
                        a0 = __fmaf_rn(qv.x, kr[0][d], a0);
                        a0 = __fmaf_rn(qv.y, kr[0][d + 1], a0);
                        a0 = __fmaf_rn(qv.z, kr[0][d + 2], a0);
                        a0 = __fmaf_rn(qv.w, kr[0][d + 3], a0);
                        a1 = __fmaf_rn(qv.x, kr[1][d], a1);
                        a1 = __fmaf_rn(qv.y, kr[1][d + 1], a1);
                        a1 = __fmaf_rn(qv.z, kr[1][d + 2], a1);
                        a1 = __fmaf_rn(qv.w, kr[1][d + 3], a1);
                    }
                    ps[r][0] = k4 == 0 ? a0 : __fadd_rn(ps[r][0], a0);
                    ps[r][1] = k4 == 0 ? a1 : __fadd_rn(ps[r][1], a1);
                }
            }
        }
        // Per row: scale, soft-cap, the chunk's max and exponential sum, the exponentials into the warp's rows.
        float ms[R], zs[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r < nr) att_kv_softmax(ps[r][0], ps[r][1], es + r * ATT_CHUNK, lane, ATT_CHUNK, scale, softcap, ms[r], zs[r]);
        // Output values lane + 32·u: the P chains (keys pt, pt + P, …) of every row at once, each value read
        // once for the warp's rows; the chains added in order.
        float a[R][P][ND];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int pt = 0; pt < P; ++pt)
#pragma unroll
                for (int u = 0; u < ND; ++u) a[r][pt][u] = 0.0f;
#pragma unroll 2
        for (int jj = 0; jj < ATT_CHUNK; jj += P) {
            float vv[P][ND];
#pragma unroll
            for (int pt = 0; pt < P; ++pt)
#pragma unroll
                for (int u = 0; u < ND; ++u) vv[pt][u] = vs[(jj + pt) * LD + lane + 32 * u];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < nr) {
#pragma unroll
                    for (int pt = 0; pt < P; ++pt) {
                        const float e = es[r * ATT_CHUNK + jj + pt];
#pragma unroll
                        for (int u = 0; u < ND; ++u) a[r][pt][u] = __fmaf_rn(e, vv[pt][u], a[r][pt][u]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < nr) {
                const int row = r0 + r, i = row / g, h = kvh * g + row % g;
                float* pp = part + (((long long)i * n_heads + h) * nmax + c) * RW;
#pragma unroll
                for (int u = 0; u < ND; ++u) {
                    float o = a[r][0][u];
#pragma unroll
                    for (int pt = 1; pt < P; ++pt) o = __fadd_rn(o, a[r][pt][u]);
                    pp[2 + lane + 32 * u] = o;
                }
                if (lane == 0) {
                    pp[0] = ms[r];
                    pp[1] = zs[r];
                }
            }
        }
        __syncwarp();  // es is rewritten with the next chunk
    }
}
#define ATT_KVS(HDV)                                                                                               \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_kvs_hd##HDV(                           \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                     \
        const int4* __restrict__ info, float* __restrict__ part, int nmax, int t, int n_heads, int n_kv_heads,     \
        float scale, float softcap) {                                                                              \
        attention_kvs_impl<HDV>(q, k, v, info, part, nmax, t, n_heads, n_kv_heads, scale, softcap);               \
    }
ATT_KVS(64)
ATT_KVS(128)

// ---------------------------------------------------------------------------------------------------------
// Greedy sampling: the index of the largest value of each row (sampling.rs `argmax`: lowest index on ties,
// NaN never wins, 0 when no value exceeds -inf), in two kernels so that the row is read by many blocks at
// once: `argmax_part`, grid (AM_PARTS, rows) of 256 threads, block b of a row scans the values
// i = b·256 + tid + j·AM_PARTS·256 keeping each thread's first strict maximum, then a tree over the threads
// keeps the larger value and on equal values the lower index, and writes the block's (value, index);
// `argmax_finish`, one AM_PARTS-thread block per row, reduces the parts the same way. Exact (comparisons
// only), so any split and order give the host's answer.
#define AM_PARTS 128
__device__ __forceinline__ void argmax_pick(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The block's (value, index) by the rule above into thread 0 (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ void argmax_block(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL, bv, o);
        const int i = __shfl_xor_sync(FULL, bi, o);
        argmax_pick(bv, bi, v, i);
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? sv[lane] : -INFINITY;
        bi = lane < warps ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(FULL, bv, o);
            const int i = __shfl_xor_sync(FULL, bi, o);
            argmax_pick(bv, bi, v, i);
        }
    }
}

// `part` holds AM_PARTS values (f32) then AM_PARTS indices (i32) per row.
extern "C" __global__ void argmax_part(const float* __restrict__ x, int width, float* __restrict__ part) {
    pdl_wait();
    const float* row = x + (long long)blockIdx.y * width;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += AM_PARTS * blockDim.x) {
        const float v = row[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    argmax_block(bv, bi);
    if (threadIdx.x == 0) {
        float* p = part + (long long)blockIdx.y * 2 * AM_PARTS;
        p[blockIdx.x] = bv;
        reinterpret_cast<int*>(p)[AM_PARTS + blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_finish(const float* __restrict__ part, unsigned int* __restrict__ out) {
    pdl_wait();
    const float* p = part + (long long)blockIdx.x * 2 * AM_PARTS;
    float bv = p[threadIdx.x];
    int bi = reinterpret_cast<const int*>(p)[AM_PARTS + threadIdx.x];
    argmax_block(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
}

// ---- Sampling candidates (`Backend::candidate_rows`; the host reference is `sampling::row_candidates`). ----

// `sampling::exp_det`: e^x for x <= 0 by the same correctly rounded f32 multiplications and additions
// (explicit intrinsics, so nothing is contracted into a fused multiply-add): the same bits as the host.
__device__ __forceinline__ float exp_det(float x) {
    const float xc = fminf(fmaxf(x, -87.0f), 0.0f);
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(xc, __int_as_float(0x3fb8aa3b)), 12582912.0f), 12582912.0f);
    float r = __fsub_rn(xc, __fmul_rn(n, __int_as_float(0x3f317200)));
    r = __fsub_rn(r, __fmul_rn(n, __int_as_float(0x35bfbe8e)));
    float p = __int_as_float(0x39500d01);
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3ab60b61));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3c088889));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3d2aaaab));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3e2aaaab));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3f000000));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3f800000));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3f800000));
    const float v = __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
    return x >= -87.0f ? v : 0.0f;
}

// The sampler's order as one integer, larger first: the scaled logit by Rust's `f32::total_cmp` (high word),
// then the lower token id (low word). Keys of real candidates are never 0.
__device__ __forceinline__ unsigned long long cand_key(float s, int id) {
    int b = __float_as_int(s);
    b ^= (int)(((unsigned)(b >> 31)) >> 1);
    return ((unsigned long long)((unsigned)b ^ 0x80000000u) << 32) | (unsigned)(0xffffffffu - (unsigned)id);
}
__device__ __forceinline__ float cand_value(unsigned long long key) {
    int b = (int)((unsigned)(key >> 32) ^ 0x80000000u);
    b ^= (int)(((unsigned)(b >> 31)) >> 1);
    return __int_as_float(b);
}

#define CAND_THREADS 1024

// Sorts `buf[0..1024)` descending (bitonic network; every thread of the block takes part).
__device__ void cand_sort(unsigned long long* buf) {
    const int t = threadIdx.x;
    for (int size = 2; size <= CAND_THREADS; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            const int o = t ^ stride;
            if (o > t) {
                const unsigned long long a = buf[t], b = buf[o];
                const bool desc = (t & size) == 0;
                if (desc ? a < b : a > b) {
                    buf[t] = b;
                    buf[o] = a;
                }
            }
        }
    }
    __syncthreads();
}

// The candidates of each row of `x` (`width` logits) at inverse temperature `inv_t`, in four kernels so that
// the row is read by many blocks: a record of `2k + 4` words at `out + row·(2k + 4)`: the first min(k, n)
// scaled logits (f32 bits) in the sampler's order, their ids, n (finite logits), 0, and the mass (f64, lo word
// first). Finite logits are scaled by one rounded product. Value i belongs to lane i mod 1024; the row's
// work area (`CAND_WORK` u64 words at `work + row·CAND_WORK`) holds per lane its largest key and its mass,
// the gathered keys, the selection and the blocks' finite counts.
//  1. `cand_lanes`, grid (CAND_PARTS, rows) × 256: block b takes lanes 32b … 32b + 31, its 8 warps the
//     values of those lanes in turn; per lane the largest key, per block the finite count.
//  2. `cand_select`, one 1024-thread block per row: n, the maximum, and a threshold above which at least k
//     keys lie: the k-th largest lane maximum (1: every finite logit); zeroes the gather count.
//  3. `cand_gather`, grid (CAND_PARTS, rows) × 256, the lanes as in 1: the keys at or above the threshold
//     (up to 1024 kept), and per lane the mass: its values' exp_det(s_i − max) are formed CAND_CHUNK at a time
//     by the 8 warps and added by warp 0 in index order in f64 — `sampling::row_candidates`' order.
//  4. `cand_finish`, one 1024-thread block per row: when more than 1024 keys lie above the threshold (many
//     equal values) a radix select over the key's bytes (256-bin histogram per byte, from the top) finds
//     the exact threshold and gathers again; the keys are sorted, the first kk written, and the 1024 lanes'
//     masses meet in a halving tree.
#define CAND_PARTS 32
#define CAND_CHUNK 32
#define CAND_WORK 3104
#define CW_MASS 1024
#define CW_GATH 2048
#define CW_SEL 3072
#define CW_CNT 3080

extern "C" __global__ void __launch_bounds__(256)
    cand_lanes(const float* __restrict__ x, int width, float inv_t, unsigned long long* __restrict__ work) {
    pdl_wait();
    __shared__ unsigned long long smax[8][32];
    __shared__ unsigned int scnt[8];
    const float* row = x + (long long)blockIdx.y * width;
    unsigned long long* w = work + (long long)blockIdx.y * CAND_WORK;
    const int lane = blockIdx.x * 32 + (threadIdx.x & 31), s = threadIdx.x >> 5;
    unsigned int cnt = 0;
    unsigned long long mine = 0;
    for (int i = lane + s * CAND_THREADS; i < width; i += 8 * CAND_THREADS) {
        const float l = row[i];
        if (isfinite(l)) {
            cnt++;
            const unsigned long long key = cand_key(__fmul_rn(l, inv_t), i);
            mine = key > mine ? key : mine;
        }
    }
    smax[s][threadIdx.x & 31] = mine;
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(FULL, cnt, o);
    if ((threadIdx.x & 31) == 0) scnt[s] = cnt;
    __syncthreads();
    if (s == 0) {
        unsigned long long m = smax[0][threadIdx.x];
        for (int q = 1; q < 8; ++q) m = smax[q][threadIdx.x] > m ? smax[q][threadIdx.x] : m;
        w[lane] = m;
        if (threadIdx.x == 0) {
            unsigned int c = 0;
            for (int q = 0; q < 8; ++q) c += scnt[q];
            reinterpret_cast<unsigned int*>(w + CW_CNT)[blockIdx.x] = c;
        }
    }
}

// The selection record (`w + CW_SEL`): threshold key, then (max bits | n << 32), then the gather count.
extern "C" __global__ void __launch_bounds__(CAND_THREADS, 1)
    cand_select(int k, unsigned long long* __restrict__ work) {
    pdl_wait();
    __shared__ unsigned long long buf[CAND_THREADS];
    unsigned long long* w = work + (long long)blockIdx.x * CAND_WORK;
    const int t = threadIdx.x;
    buf[t] = w[t];
    unsigned int n = 0;
    for (int q = 0; q < CAND_PARTS; ++q) n += reinterpret_cast<const unsigned int*>(w + CW_CNT)[q];
    cand_sort(buf);
    if (t == 0) {
        const float mx = n > 0 ? cand_value(buf[0]) : 0.0f;
        w[CW_SEL] = (int)n <= k || buf[k - 1] == 0 ? 1ull : buf[k - 1];
        w[CW_SEL + 1] = (unsigned long long)__float_as_uint(mx) | ((unsigned long long)n << 32);
        w[CW_SEL + 2] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    cand_gather(const float* __restrict__ x, int width, float inv_t, unsigned long long* __restrict__ work) {
    pdl_wait();
    __shared__ double se[CAND_CHUNK][32];
    const float* row = x + (long long)blockIdx.y * width;
    unsigned long long* w = work + (long long)blockIdx.y * CAND_WORK;
    const int lane = blockIdx.x * 32 + (threadIdx.x & 31), s = threadIdx.x >> 5;
    const unsigned long long thr = w[CW_SEL], sel = w[CW_SEL + 1];
    const float mx = __uint_as_float((unsigned int)(sel & 0xffffffffu));
    const unsigned int n = (unsigned int)(sel >> 32);
    const bool mass = n > 0 && isfinite(mx);
    unsigned long long* count = w + CW_SEL + 2;
    double acc = 0.0;
    // Chunks of CAND_CHUNK values a lane: warp s forms values j0 + s, j0 + s + 8, … (its loads issued together),
    // then warp 0 adds the chunk's values in index order.
    for (int j0 = 0; j0 * CAND_THREADS < width; j0 += CAND_CHUNK) {
        float l[CAND_CHUNK / 8];
#pragma unroll
        for (int q = 0; q < CAND_CHUNK / 8; ++q) {
            const int i = lane + (j0 + s + 8 * q) * CAND_THREADS;
            l[q] = i < width ? row[i] : NAN;
        }
#pragma unroll
        for (int q = 0; q < CAND_CHUNK / 8; ++q) {
            const int i = lane + (j0 + s + 8 * q) * CAND_THREADS;
            double e = 0.0;
            if (isfinite(l[q])) {
                const float sc = __fmul_rn(l[q], inv_t);
                const unsigned long long key = cand_key(sc, i);
                if (key >= thr) {
                    const unsigned long long slot = atomicAdd(count, 1ull);
                    if (slot < CAND_THREADS) w[CW_GATH + slot] = key;
                }
                if (mass) e = (double)exp_det(__fsub_rn(sc, mx));
            }
            se[s + 8 * q][threadIdx.x & 31] = e;
        }
        __syncthreads();
        if (s == 0)
            for (int q = 0; q < CAND_CHUNK; ++q) acc = __dadd_rn(acc, se[q][threadIdx.x]);
        __syncthreads();
    }
    if (s == 0) reinterpret_cast<double*>(w + CW_MASS)[lane] = acc;
}

extern "C" __global__ void __launch_bounds__(CAND_THREADS, 1)
    cand_finish(const float* __restrict__ x, int width, float inv_t, int k, const unsigned long long* __restrict__ work,
                unsigned int* __restrict__ out) {
    pdl_wait();
    __shared__ unsigned long long buf[CAND_THREADS];
    __shared__ double lane[CAND_THREADS];
    __shared__ unsigned int hist[256];
    __shared__ unsigned int s_count;
    __shared__ unsigned long long s_thr;
    const float* row = x + (long long)blockIdx.x * width;
    const unsigned long long* w = work + (long long)blockIdx.x * CAND_WORK;
    unsigned int* rec = out + (long long)blockIdx.x * (2 * k + 4);
    const int t = threadIdx.x;
    const unsigned long long sel = w[CW_SEL + 1], gathered = w[CW_SEL + 2];
    const unsigned int n = (unsigned int)(sel >> 32);
    const bool mass = n > 0 && isfinite(__uint_as_float((unsigned int)(sel & 0xffffffffu)));
    const int kk = (int)min((unsigned int)k, n);
    lane[t] = reinterpret_cast<const double*>(w + CW_MASS)[t];
    buf[t] = (unsigned long long)t < gathered ? w[CW_GATH + t] : 0ull;
    unsigned int got = (unsigned int)min(gathered, (unsigned long long)CAND_THREADS);
    if (gathered > CAND_THREADS) {
        // Too many keys above the threshold: radix select of the kk-th largest key, a byte at a time.
        unsigned long long prefix = 0;
        unsigned int need = (unsigned int)kk;
        int bits = 0;
        for (;;) {
            if (t < 256) hist[t] = 0;
            __syncthreads();
            for (int i = t; i < width; i += CAND_THREADS) {
                const float l = row[i];
                if (isfinite(l)) {
                    const unsigned long long key = cand_key(__fmul_rn(l, inv_t), i);
                    if (bits == 0 || (key >> (64 - bits)) == prefix) atomicAdd(&hist[(key >> (56 - bits)) & 255], 1u);
                }
            }
            __syncthreads();
            if (t == 0) {
                unsigned int above = 0;
                int b = 255;
                while (above + hist[b] < need) above += hist[b--];
                need -= above;
                prefix = (prefix << 8) | (unsigned)b;
                s_thr = prefix;
                s_count = hist[b] == need ? 1u : 0u;
            }
            __syncthreads();
            prefix = s_thr;
            bits += 8;
            const bool done = s_count == 1u;
            __syncthreads();
            if (done || bits == 64) break;
        }
        const unsigned long long thr = bits == 64 ? prefix : prefix << (64 - bits);
        if (t == 0) s_count = 0;
        buf[t] = 0;
        __syncthreads();
        for (int i = t; i < width; i += CAND_THREADS) {
            const float l = row[i];
            if (isfinite(l)) {
                const unsigned long long key = cand_key(__fmul_rn(l, inv_t), i);
                if (key >= thr) buf[atomicAdd(&s_count, 1u)] = key;
            }
        }
        __syncthreads();
        got = min(s_count, (unsigned int)CAND_THREADS);
        if (t >= (int)got) buf[t] = 0;
    }
    cand_sort(buf);
    if (t < kk) {
        const unsigned long long key = buf[t];
        rec[t] = __float_as_uint(cand_value(key));
        rec[k + t] = 0xffffffffu - (unsigned)(key & 0xffffffffu);
    }
    for (int h = CAND_THREADS / 2; h > 0; h >>= 1) {
        if (t < h) lane[t] = __dadd_rn(lane[t], lane[t + h]);
        __syncthreads();
    }
    if (t == 0) {
        rec[2 * k] = n;
        rec[2 * k + 1] = 0;
        const double m = mass ? lane[0] : 0.0;
        const unsigned long long mb = (unsigned long long)__double_as_longlong(m);
        rec[2 * k + 2] = (unsigned)(mb & 0xffffffffu);
        rec[2 * k + 3] = (unsigned)(mb >> 32);
    }
}

// ---------------------------------------------------------------------------------------------------------
// attention_mma: causal attention of more than 64 queries (prefill runs) on the tensor cores, flash-attention
// style (Dao, "FlashAttention-2", 2023: a query tile's rows stream the key tiles with an online softmax). Owed no
// equality with `attention` (no verify pass holds more than 64 queries): the scores at about f32's precision, the
// probabilities times values too (`attention_mma3_*`) or at TF32's (`attention_mma_*`, the default: each term's
// relative error about 2^-11, ≈ 3e-4 of the output in a lane-level emulation; 2e-3 allowed by the test, 2e-5 for
// the three-product form).
//
// Block (query tile of FA_QT = 64 queries, query head), FA_WARPS = 4 warps of 16 queries. The query tile, then
// each key tile of FA_KT = 64 rows of the head's KV head (keys and values), staged in shared memory by cp.async
// (f32, rows padded by 4 floats so the fragment loads hit distinct banks). Scores S = Q·Kᵀ by mma.sync m16n8k8
// TF32 in three products per step (hi·hi + hi·lo + lo·hi, x = hi + lo with hi = tf32(x): about f32's precision,
// Ootomo & Yokota 2022), so large q·k (biased keys) keep their low bits; P·V (P in [0, 1]) the same way or by one
// TF32 product per step (PV3 false). The P operand comes straight from the score accumulators: the A fragment's column q stands for key
// 2q and column q + 4 for key 2q + 1 of the 8-key step, and the V fragment is read with the same permutation, so
// no shuffles. Masks: key j is visible to the query at position p when lo(p) ≤ j ≤ p (lo from the window).
#define FA_QT 64
#define FA_KT 64
#define FA_WARPS 4

// x rounded to TF32 (to nearest, ties away), as the f32 bit pattern whose low 13 bits are zero: the mask makes
// that explicit rather than relying on cvt's unused bits, since lo = x − hi must be taken from the hi the mma
// sees (the compiled code cleared them already: the mask changes no result).
__device__ __forceinline__ uint32_t tf32_hi(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r & 0xFFFFE000u;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int HD>
struct FaSmem {
    static constexpr int S = HD + 4;  // floats per staged row
    static constexpr int q = 0, k = FA_QT * S, v = k + FA_KT * S;
    static constexpr int bytes = 4 * (v + FA_KT * S);
};

template <int HD, bool PV3>
__device__ __forceinline__ void attention_mma_impl(const float* __restrict__ q, const float* __restrict__ kc,
                                                   const float* __restrict__ vc, float* __restrict__ out, int t,
                                                   int n_past, int n_heads, int n_kv_heads, float scale,
                                                   float softcap, int window) {
    using L = FaSmem<HD>;
    constexpr int S = L::S, NT = HD / 8;  // n8 tiles of the head dimension
    extern __shared__ __align__(16) float fa_smem[];
    float* const sq = fa_smem + L::q;
    float* const sk = fa_smem + L::k;
    float* const sv = fa_smem + L::v;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd4 = lane & 3;
    const int q0 = blockIdx.x * FA_QT, h = blockIdx.y, kvh = h / (n_heads / n_kv_heads);
    const int qd = n_heads * HD, kvd = n_kv_heads * HD;
    constexpr int T = 32 * FA_WARPS, CPR = HD / 4;  // 16-byte copies per row
    pdl_wait();
    for (int i = tid; i < FA_QT * CPR; i += T) {
        const int r = i / CPR, c = i % CPR;
        cp_async16(sq + r * S + 4 * c, q + (size_t)min(q0 + r, t - 1) * qd + h * HD + 4 * c);
    }
    cp_async_commit();
    // The tile's positions and its key range [klo, khi).
    const int p_first = n_past + q0, p_last = n_past + min(q0 + FA_QT, t) - 1;
    const int klo = window > 0 ? max(0, p_first + 1 - window) : 0, khi = p_last + 1;
    // This lane's rows: r0 = 16·warp + g and r0 + 8; their positions and lowest visible keys.
    const int r0 = 16 * warp + g;
    int pos[2], lo[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        pos[i] = n_past + q0 + r0 + 8 * i;
        lo[i] = window > 0 ? max(0, pos[i] + 1 - window) : 0;
    }
    const bool live = q0 + 16 * warp < t;  // the warp has a query row
    float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
    const float l2e = 1.4426950408889634f;
    for (int k0 = klo / FA_KT * FA_KT; k0 < khi; k0 += FA_KT) {
        __syncthreads();  // the previous tile's keys and values are no longer read
        for (int i = tid; i < FA_KT * CPR; i += T) {
            const int r = i / CPR, c = i % CPR, row = min(k0 + r, khi - 1);
            cp_async16(sk + r * S + 4 * c, kc + (size_t)row * kvd + kvh * HD + 4 * c);
        }
        cp_async_commit();
        for (int i = tid; i < FA_KT * CPR; i += T) {
            const int r = i / CPR, c = i % CPR, row = min(k0 + r, khi - 1);
            cp_async16(sv + r * S + 4 * c, vc + (size_t)row * kvd + kvh * HD + 4 * c);
        }
        cp_async_commit();
        cp_async_wait<1>();  // the queries (first tile) and this tile's keys
        __syncthreads();
        float s[FA_KT / 8][4];
#pragma unroll
        for (int j = 0; j < FA_KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
        if (live) {
#pragma unroll 4
            for (int d0 = 0; d0 < HD; d0 += 8) {
                const float* qa = sq + r0 * S + d0 + qd4;
                const float x[4] = {qa[0], qa[8 * S], qa[4], qa[8 * S + 4]};
                uint32_t ah[4], al[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ah[e] = tf32_hi(x[e]);
                    al[e] = tf32_hi(__fsub_rn(x[e], __uint_as_float(ah[e])));
                }
#pragma unroll
                for (int j = 0; j < FA_KT / 8; ++j) {
                    const float* kb = sk + (8 * j + g) * S + d0 + qd4;
                    const float y0 = kb[0], y1 = kb[4];
                    const uint32_t bh0 = tf32_hi(y0), bh1 = tf32_hi(y1);
                    const uint32_t bl0 = tf32_hi(__fsub_rn(y0, __uint_as_float(bh0))), bl1 = tf32_hi(__fsub_rn(y1, __uint_as_float(bh1)));
                    mma_tf32(s[j], al[0], al[1], al[2], al[3], bh0, bh1);
                    mma_tf32(s[j], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
                    mma_tf32(s[j], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
                }
            }
        }
        // Scores (log2 units), masks, the rows' new maxima.
        float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < FA_KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, key = k0 + 8 * j + 2 * qd4 + (e & 1);
                float v = __fmul_rn(s[j][e], scale);
                if (softcap > 0.0f) v = __fmul_rn(softcap, tanhf(__fdiv_rn(v, softcap)));
                v = (key >= lo[i] && key <= pos[i]) ? __fmul_rn(v, l2e) : -INFINITY;
                s[j][e] = v;
                mt[i] = fmaxf(mt[i], v);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(FULL, mt[i], 1));
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(FULL, mt[i], 2));
            const float mn = fmaxf(m[i], mt[i]);
            corr[i] = mn == -INFINITY ? 1.0f : exp2f(m[i] - mn);
            m[i] = mn;
        }
#pragma unroll
        for (int j = 0; j < FA_KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const float p = m[i] == -INFINITY ? 0.0f : exp2f(s[j][e] - m[i]);
                s[j][e] = p;
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < FA_KT / 8; ++j) rs += s[j][2 * i] + s[j][2 * i + 1];
            l[i] = l[i] * corr[i] + rs;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
        cp_async_wait<0>();  // this tile's values
        __syncthreads();
        if (live) {
#pragma unroll
            for (int kk = 0; kk < FA_KT / 8; ++kk) {
                // A: rows g, g + 8; column q ↔ key 2q, column q + 4 ↔ key 2q + 1 (the accumulator's layout).
                const float pa[4] = {s[kk][0], s[kk][2], s[kk][1], s[kk][3]};
                uint32_t ah[4], al[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ah[e] = tf32_hi(pa[e]);
                    al[e] = PV3 ? tf32_hi(__fsub_rn(pa[e], __uint_as_float(ah[e]))) : 0u;
                }
                const float* vb = sv + (8 * kk + 2 * qd4) * S + g;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float y0 = vb[8 * j], y1 = vb[S + 8 * j];
                    const uint32_t b0 = tf32_hi(y0), b1 = tf32_hi(y1);
                    if (PV3) {
                        const uint32_t c0 = tf32_hi(__fsub_rn(y0, __uint_as_float(b0)));
                        const uint32_t c1 = tf32_hi(__fsub_rn(y1, __uint_as_float(b1)));
                        mma_tf32(o[j], al[0], al[1], al[2], al[3], b0, b1);
                        mma_tf32(o[j], ah[0], ah[1], ah[2], ah[3], c0, c1);
                    }
                    mma_tf32(o[j], ah[0], ah[1], ah[2], ah[3], b0, b1);
                }
            }
        }
    }
    // The rows' sums over their quads, then the outputs.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(FULL, l[i], 1);
        l[i] += __shfl_xor_sync(FULL, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = q0 + r0 + 8 * i;
        if (row >= t) continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        float* dst = out + (size_t)row * qd + h * HD + 2 * qd4;
#pragma unroll
        for (int j = 0; j < NT; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
    }
}

extern "C" __device__ const int attention_mma_smem[3] = {FaSmem<64>::bytes, FaSmem<128>::bytes, FaSmem<256>::bytes};

// Grid: (query tiles of FA_QT, query heads). `window` 0: none.
// `attention_mma_hd*`: P·V in one TF32 product; `attention_mma3_hd*`: in three, as the scores.
#define ATT_MMA(NAME, HD, PV3)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS) NAME(                                        \
        const float* q, const float* k, const float* v, float* out, int t, int n_past, int n_heads,          \
        int n_kv_heads, float scale, float softcap, int window) {                                            \
        attention_mma_impl<HD, PV3>(q, k, v, out, t, n_past, n_heads, n_kv_heads, scale, softcap, window);   \
    }
ATT_MMA(attention_mma_hd64, 64, false)
ATT_MMA(attention_mma_hd128, 128, false)
ATT_MMA(attention_mma_hd256, 256, false)
ATT_MMA(attention_mma3_hd64, 64, true)
ATT_MMA(attention_mma3_hd128, 128, true)
ATT_MMA(attention_mma3_hd256, 256, true)
