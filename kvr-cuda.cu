// kvr-cuda.cu - the CUDA backend: device buffers, a kernel or a cuBLAS call for every op the model
// graphs use, and the vtable of kvr.h's "backends" around them (make KVR_CUDA=1).
//
// What lives here, top to bottom: error handling (every CUDA and cuBLAS call checked, a failure
// becomes a kvr error naming the call, the op and the tensor); the backend's state (one device,
// a compute stream and a transfer stream ordered by events, a cuBLAS handle, a caching pool of
// device memory over the stream-ordered allocator, pinned staging buffers); the kernels, built on
// the per-element math of kvr.h's internal section (KVR_HD), so the CPU tests check the arithmetic
// they run, most of them written simply (a thread per block or element, a block per row); the
// launchers and the one dispatch switch; supports_op as one switch over every op and type; graphs
// run node by node or captured as one CUDA graph (cu_run_captured); the constructor.
//
// Matrix products: prompts (more than 8 tokens) go to cuBLAS in f32, F32 weights as they are and
// every other type expanded to F32 tile by tile (no F16 in them: activations above 65504 stay
// finite, and the product is the CPU's exact one up to the order of the sums; KVR_CUDA_TF32=1
// trades that for tensor cores in TF32, which keeps f32's range); up to 8 tokens, a
// kernel reads the weights in their own type, a warp per row (k_dot8). Attention returns O and the
// log-sum-exp at absolute positions, tiles decided by the CPU kernel's rule (kvr.h's
// kvr_attn_tile: causal tiles that no query can see are skipped, dense mode computes them all):
// over F16 K/V on tensor cores for prompts (k_fattn) and split over the keys for decode steps
// (k_fdec, flash-decoding); over F32 K/V one scalar kernel (k_attn).
//
// Nothing here has run on a GPU on the machines kvr is developed on (they have none): it is
// compiled with -Werror for sm_80 and sm_90; the KVR_HD math, the matmul and attention kernels'
// schedules and their algorithms are tested on the host (tests/test-cuda-host.cu); make gpu-check
// (tests/gpu-check.sh) is what checks a real device.

#define KVR_BUILD
#include "kvr.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

namespace wmma = nvcuda::wmma;

//
// errors
//

// The op and tensor a failing call belongs to (NULL outside a node).
static const char * cu_what(const struct kvr_tensor * t, char * buf, size_t cap) {
    if (!t) return "";
    snprintf(buf, cap, " (op %s, tensor '%s')", kvr_op_name((enum kvr_op)t->op), t->name[0] ? t->name : "?");
    return buf;
}

static int cu_fail(int device, const char * call, cudaError_t e, const struct kvr_tensor * t) {
    char what[128];
    const int code = e == cudaErrorMemoryAllocation ? KVR_ERR_NOMEM : KVR_ERR_DEVICE;
    return kvr_error(code, "cuda:%d: %s failed: %s (%s)%s", device, call, cudaGetErrorString(e),
                     cudaGetErrorName(e), cu_what(t, what, sizeof(what)));
}

static const char * cublas_status_name(cublasStatus_t s) {
    switch (s) {
        case CUBLAS_STATUS_SUCCESS:          return "success";
        case CUBLAS_STATUS_NOT_INITIALIZED:  return "not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED:     return "allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE:    return "invalid value";
        case CUBLAS_STATUS_ARCH_MISMATCH:    return "architecture mismatch";
        case CUBLAS_STATUS_MAPPING_ERROR:    return "mapping error";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
        case CUBLAS_STATUS_INTERNAL_ERROR:   return "internal error";
        case CUBLAS_STATUS_NOT_SUPPORTED:    return "not supported";
        case CUBLAS_STATUS_LICENSE_ERROR:    return "license error";
    }
    return "unknown status";
}

static int cublas_fail(int device, const char * call, cublasStatus_t s, const struct kvr_tensor * t) {
    char what[128];
    return kvr_error(s == CUBLAS_STATUS_ALLOC_FAILED ? KVR_ERR_NOMEM : KVR_ERR_DEVICE, "cuda:%d: %s failed: %s (%d)%s",
                     device, call, cublas_status_name(s), (int)s, cu_what(t, what, sizeof(what)));
}

// Inside functions that have `cb` (the backend) and `node` (the tensor being computed, or NULL).
#define CU(call) do { const cudaError_t e_ = (call); \
    if (e_ != cudaSuccess) return cu_fail(cb->device, #call, e_, node); } while (0)
#define CUBLAS(call) do { const cublasStatus_t s_ = (call); \
    if (s_ != CUBLAS_STATUS_SUCCESS) return cublas_fail(cb->device, #call, s_, node); } while (0)
// after a kernel launch: a bad configuration shows here, a fault in the kernel at the next wait
#define CU_LAUNCHED() CU(cudaGetLastError())
#define CU_TRY(x) do { const int rc_ = (x); if (rc_ != KVR_OK) return rc_; } while (0)

//
// the backend's state
//

#define CU_STAGE_BYTES   ((size_t)16 << 20) // each of the two pinned staging buffers
#define CU_POOL_CACHED   32                 // freed device blocks kept for reuse
#define CU_W32_TILE      ((size_t)64 << 20) // bytes of F32 weight rows expanded per cuBLAS call
#define CU_DOT_MAX_T     8                  // quantized MUL_MAT over at most this many tokens: dot kernel
#define CU_POOL_BIG      ((size_t)1 << 30)  // freed blocks larger than this go back to the driver
#define CU_BLAS_WORKSPACE ((size_t)32 << 20) // cuBLAS's workspace (what it asks for on Hopper)

struct cu_alloc { void * ptr; size_t size; };

struct cu_backend {
    int              device;
    char             name[32];
    cudaDeviceProp   prop;
    cudaStream_t     compute;      // every kernel and cuBLAS call
    cudaStream_t     copy;         // uploads and downloads
    cudaEvent_t      ev_order;     // recorded on one stream, waited for by the other
    cudaEvent_t      ev_done;      // the end of a graph or a download, polled with a deadline
    cudaEvent_t      ev_stage[2];  // a staging buffer may be refilled once its copy is done
    cublasHandle_t   blas;
    double           timeout_ms;   // every device wait polls against this deadline
    FILE           * progress;     // the upload's progress line (stderr, when it takes long)
    bool             sync_nodes;   // KVR_CUDA_SYNC=1: wait after every node (errors name their node)
    bool             node_times;   // events around every node (kvr_backend_params.node_times, trace)
    bool             tf32;         // KVR_CUDA_TF32=1: prompts' products on tensor cores in TF32 (10-bit
                                   // mantissas, f32's range: ~1e-3 relative, not the CPU's exact math)
    cudaGraphExec_t  replay;       // the last captured graph, instantiated; updated in place while
                                   // the node topology stays (decode: every step)
    int64_t          n_replays, n_instantiated; // how often it was updated and launched, or made anew

    // memory: live allocations and a small cache of freed blocks
    struct cu_alloc * live;   int n_live, cap_live;
    struct cu_alloc   cached[CU_POOL_CACHED]; int n_cached;
    void            * stage[2];    // pinned host staging
    uint16_t        * gelu_table;  // device copy of the CPU's GELU table (kvr_gelu_half of every fp16)
    void            * w32;  size_t w32_bytes;   // weight tiles expanded to F32 (prefill)
    void            * moe;  size_t moe_bytes;   // MUL_MAT_ID over a prompt: slots grouped by expert,
                                                 // their rows of x and their products
    void            * moe_host; size_t moe_host_bytes; // its slot order and experts' runs on the host
    void            * moe_ids;  size_t moe_ids_bytes;  // the slot order and experts on the device
    const struct kvr_tensor * moe_route;             // the route they were made from in this graph (NULL:
                                                     // none): a layer's gate, up and down share it
    float           * fd_part;     // flash-decoding's partial results (CU_FD_BYTES, made at start)
    unsigned long long * dcount;   // device: [attn dense, attn causal, bad ids]
    unsigned long long * hcount;   // pinned copy of it

    // per-node timing events (compute stream), grown as graphs need
    cudaEvent_t     * ev_node; int n_ev_node;

    struct kvr_counters counters;
    bool              trace;
    struct kvr_span * spans; int n_spans, cap_spans;
    int               span_layer;  // layer of the open compute span (-1: none)

    // tensor_set, tensor_get and buf_clear cannot return an error: the first one is kept and
    // returned by the next graph_compute or synchronize
    int               sticky;
    char              sticky_msg[512];
};

static void cu_stick(struct cu_backend * cb, int rc) {
    if (rc == KVR_OK || cb->sticky != KVR_OK) return;
    cb->sticky = rc;
    snprintf(cb->sticky_msg, sizeof(cb->sticky_msg), "%s", kvr_last_error());
}

static int cu_unstick(struct cu_backend * cb) {
    if (cb->sticky == KVR_OK) return KVR_OK;
    const int rc = cb->sticky;
    cb->sticky = KVR_OK;
    return kvr_error(rc, "%s", cb->sticky_msg);
}

// Poll an event until done, sleeping between polls, until the deadline: a device that hangs
// becomes an error instead of a hang.
static int cu_wait(struct cu_backend * cb, cudaEvent_t ev, const char * what, const struct kvr_tensor * node) {
    const double t0 = kvr_time_ms();
    for (int polls = 0;; polls++) {
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) return KVR_OK;
        if (e != cudaErrorNotReady) return cu_fail(cb->device, what, e, node);
        if (kvr_time_ms() - t0 > cb->timeout_ms) {
            char buf[128];
            return kvr_error(KVR_ERR_DEVICE, "cuda:%d: %s did not finish within %.0f s%s", cb->device, what,
                             cb->timeout_ms / 1e3, cu_what(node, buf, sizeof(buf)));
        }
        if (polls > 64) usleep(polls > 4096 ? 1000 : 20);
    }
}

//
// device memory: a caching pool over CUDA's stream-ordered allocator. cudaFree would wait for the
// whole device, NCCL's stream included, with no deadline (a peer that dies mid-transfer would hang
// it); cudaFreeAsync on the compute stream returns a block once the work queued before it is done,
// and nothing waits. Graphs allocate every eval: freed blocks are kept for reuse.
//

static int pool_alloc(struct cu_backend * cb, size_t size, void ** out) {
    const struct kvr_tensor * node = NULL;
    size = (size + 255) & ~(size_t)255;
    if (size == 0) size = 256;
    // the smallest cached block that fits without wasting more than half of it
    int best = -1;
    for (int i = 0; i < cb->n_cached; i++) {
        const size_t s = cb->cached[i].size;
        if (s >= size && s <= 2 * size && (best < 0 || s < cb->cached[best].size)) best = i;
    }
    struct cu_alloc a = { NULL, 0 };
    if (best >= 0) {
        a = cb->cached[best];
        cb->cached[best] = cb->cached[--cb->n_cached];
    } else {
        cudaError_t e = cudaMallocAsync(&a.ptr, size, cb->compute);
        if (e == cudaErrorMemoryAllocation && cb->n_cached > 0) {
            cudaGetLastError(); // clear it, give the cache back, try once more (the stream reuses it)
            for (int i = 0; i < cb->n_cached; i++) CU(cudaFreeAsync(cb->cached[i].ptr, cb->compute));
            cb->n_cached = 0;
            e = cudaMallocAsync(&a.ptr, size, cb->compute);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            return kvr_error(KVR_ERR_NOMEM, "cuda:%d: cudaMalloc of %.1f MiB failed: %s (%.1f MiB free of %.1f MiB)",
                             cb->device, size / 1048576.0, cudaGetErrorString(e), free_b / 1048576.0, total_b / 1048576.0);
        }
        a.size = size;
    }
    if (cb->n_live == cb->cap_live) {
        cb->cap_live = cb->cap_live ? 2 * cb->cap_live : 256;
        cb->live = (struct cu_alloc *)realloc(cb->live, sizeof(*cb->live) * (size_t)cb->cap_live);
        KVR_ASSERT(cb->live != NULL);
    }
    cb->live[cb->n_live++] = a;
    *out = a.ptr;
    return KVR_OK;
}

// Freed blocks go to the cache (the largest is released when it is full). Work queued on the
// compute stream may still use a block: a later user of it, and its release, queue behind that
// work. Work on the copy stream must be ordered before the compute stream's by the caller.
static int pool_free(struct cu_backend * cb, void * ptr) {
    const struct kvr_tensor * node = NULL;
    if (!ptr) return KVR_OK;
    int i = 0;
    while (i < cb->n_live && cb->live[i].ptr != ptr) i++;
    KVR_ASSERT(i < cb->n_live && "freeing a buffer this backend did not allocate");
    struct cu_alloc a = cb->live[i];
    cb->live[i] = cb->live[--cb->n_live];
    if (a.size > CU_POOL_BIG) { // weights and caches: keeping them would keep the memory
        CU(cudaFreeAsync(a.ptr, cb->compute));
        return KVR_OK;
    }
    if (cb->n_cached == CU_POOL_CACHED) {
        int big = 0;
        for (int j = 1; j < cb->n_cached; j++) if (cb->cached[j].size > cb->cached[big].size) big = j;
        if (cb->cached[big].size > a.size) {
            struct cu_alloc t = cb->cached[big];
            cb->cached[big] = a;
            a = t;
        }
        CU(cudaFreeAsync(a.ptr, cb->compute));
        return KVR_OK;
    }
    cb->cached[cb->n_cached++] = a;
    return KVR_OK;
}

// A scratch buffer of at least n bytes (grown, never shrunk). The old one is released in stream
// order, behind the kernels queued that read it: nothing waits.
static int scratch(struct cu_backend * cb, void ** buf, size_t * have, size_t n, const struct kvr_tensor * node) {
    if (n <= *have) return KVR_OK;
    (void)node;
    if (*buf) {
        CU_TRY(pool_free(cb, *buf));
        *buf = NULL;
        *have = 0;
    }
    const size_t want = n + n / 4;
    CU_TRY(pool_alloc(cb, want, buf));
    *have = want;
    return KVR_OK;
}

//
// kernels
//

// A tensor as kernels see it: device data, element counts and byte strides.
struct cu_tensor {
    char  * data;
    int64_t ne[4];
    int64_t nb[4];
};

static cu_tensor cu_t(const struct kvr_tensor * t) {
    cu_tensor c;
    c.data = (char *)t->data;
    for (int i = 0; i < 4; i++) {
        c.ne[i] = t->ne[i];
        c.nb[i] = (int64_t)t->nb[i];
    }
    return c;
}

// row r of t counted over dims 1..3 (as the CPU's row_ptr_flat)
static __device__ __forceinline__ char * cu_row(const cu_tensor & t, int64_t r) {
    const int64_t i1 = r % t.ne[1];
    const int64_t i2 = (r / t.ne[1]) % t.ne[2];
    const int64_t i3 = r / (t.ne[1] * t.ne[2]);
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Elements per block of a type, at compile time: the kernels are instantiated per weight type, and
// the plain types (a block of one element) alone have rows whose length is not a multiple of 8.
static __host__ __device__ constexpr int cu_blck(int type) {
    return type == KVR_TYPE_Q4_0 || type == KVR_TYPE_Q4_1 || type == KVR_TYPE_Q5_0 || type == KVR_TYPE_Q5_1 ||
           type == KVR_TYPE_Q8_0 || type == KVR_TYPE_Q8_1 || type == KVR_TYPE_MXFP4 ? KVR_QK
         : type == KVR_TYPE_Q2_K || type == KVR_TYPE_Q3_K || type == KVR_TYPE_Q4_K || type == KVR_TYPE_Q5_K ||
           type == KVR_TYPE_Q6_K || type == KVR_TYPE_Q8_K ? KVR_QK_K : 1;
}

// every weight type the backend reads; the launchers switch over this list
#define CU_WEIGHT_TYPES(X) \
    X(KVR_TYPE_F32) X(KVR_TYPE_F16) X(KVR_TYPE_BF16) \
    X(KVR_TYPE_Q4_0) X(KVR_TYPE_Q4_1) X(KVR_TYPE_Q5_0) X(KVR_TYPE_Q5_1) X(KVR_TYPE_Q8_0) X(KVR_TYPE_Q8_1) \
    X(KVR_TYPE_Q2_K) X(KVR_TYPE_Q3_K) X(KVR_TYPE_Q4_K) X(KVR_TYPE_Q5_K) X(KVR_TYPE_Q6_K) X(KVR_TYPE_Q8_K) \
    X(KVR_TYPE_MXFP4)

static bool cu_type_ok(enum kvr_type t) {
    switch (t) {
#define CU_CASE(T) case T:
        CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            return true;
        default:
            return false;
    }
}

// GET_ROWS: a block per picked row, a thread per 8 elements of it (kvr_dequant8)
template <int TYPE>
static __global__ void k_get_rows(const char * a, int64_t a_nb1, int64_t ne0, int64_t a_rows, const int32_t * ids,
                                  char * dst, int64_t d_nb1, unsigned long long * bad) {
    const int64_t i  = blockIdx.x;
    const int32_t id = ids[i];
    float * y = (float *)(dst + i * d_nb1);
    if (id < 0 || id >= a_rows) { // ids are checked before a graph runs: count it, fail the graph
        if (threadIdx.x == 0) atomicAdd(bad, 1ull);
        return;
    }
    const char * row = a + id * a_nb1;
    for (int64_t g = threadIdx.x; g < ne0 / 8; g += blockDim.x) {
        float v[8];
        kvr_dequant8((enum kvr_type)TYPE, row, g, v);
        for (int j = 0; j < 8; j++) y[8 * g + j] = v[j];
    }
    if constexpr (cu_blck(TYPE) == 1) { // a plain row's tail (blocks are whole groups)
        for (int64_t e = ne0 / 8 * 8 + threadIdx.x; e < ne0; e += blockDim.x) kvr_dequant_block((enum kvr_type)TYPE, row, e, y + e);
    }
}

// ADD, MUL: a block per row; b is one row broadcast over a's rows, shaped as a, or one value a row
// (scalar: b [1, rows of a]) spread along that row
static __global__ void k_binary(int op, cu_tensor a, cu_tensor b, cu_tensor d, int bcast, int scalar) {
    const int64_t r = blockIdx.x;
    const float * x = (const float *)cu_row(a, r);
    const float * y = bcast ? (const float *)b.data : (const float *)cu_row(b, r);
    float * z = (float *)cu_row(d, r);
    for (int64_t i = threadIdx.x; i < a.ne[0]; i += blockDim.x) {
        const float v = y[scalar ? 0 : i];
        z[i] = op == KVR_OP_ADD ? x[i] + v : x[i] * v;
    }
}

// SCALE, SILU, GELU (exact: its f32 formula, not the table), SOFTCAP (s: the cap), SIGMOID, SOFTPLUS: a block per row
static __global__ void k_unary(int op, int exact, cu_tensor a, cu_tensor d, float s, const uint16_t * gelu_table) {
    const int64_t r = blockIdx.x;
    const float * x = (const float *)cu_row(a, r);
    float * y = (float *)cu_row(d, r);
    for (int64_t i = threadIdx.x; i < a.ne[0]; i += blockDim.x) {
        const float v = x[i];
        y[i] = op == KVR_OP_SCALE    ? v * s
             : op == KVR_OP_SILU     ? v / (1.0f + expf(-v))
             : op == KVR_OP_SOFTCAP  ? kvr_softcap_f32(v, s)
             : op == KVR_OP_SIGMOID  ? kvr_sigmoid_f32(v)
             : op == KVR_OP_SOFTPLUS ? kvr_softplus_f32(v)
             : exact                 ? kvr_gelu_tanh(v) : kvr_gelu_ggml(v, gelu_table);
    }
}

// SSM_CONV: a thread per channel, its window sliding over the tokens in order (kvr.h's
// kvr_ssm_conv_out), the last K-1 inputs left in the state
static __global__ void k_ssm_conv(cu_tensor x, const float * w, int K, float * state, int fresh, cu_tensor d) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, C = x.ne[0];
    if (c >= C) return;
    float win[KVR_SSM_CONV_MAX_K];
    float * st = state + c * (K - 1);
    for (int i = 0; i < K - 1; i++) win[i] = fresh ? 0.0f : st[i];
    for (int64_t t = 0; t < x.ne[1]; t++) {
        win[K - 1] = ((const float *)(x.data + t * x.nb[1]))[c];
        ((float *)(d.data + t * d.nb[1]))[c] = kvr_ssm_conv_out(win, w + c * K, K);
        for (int i = 0; i + 1 < K; i++) win[i] = win[i + 1];
    }
    for (int i = 0; i < K - 1; i++) st[i] = win[i];
}

// GDN: a block per value head, a thread per row of its state (kvr.h's kvr_gdn_row); per token the
// first thread L2-normalises q and k into shared memory
static __global__ void k_gdn(cu_tensor q, cu_tensor k, cu_tensor v, cu_tensor g, cu_tensor b, float * state, int fresh,
                             float eps, cu_tensor d) {
    extern __shared__ float qk[];
    const int64_t h = blockIdx.x, Dk = q.ne[0], Hk = q.ne[1], Dv = v.ne[0], T = v.ne[2];
    float * qn = qk, * kn = qk + Dk, * S = state + h * Dv * Dk;
    const float scale = 1.0f / sqrtf((float)Dv);
    for (int64_t j = threadIdx.x; j < Dv && fresh; j += blockDim.x) {
        for (int64_t i = 0; i < Dk; i++) S[j * Dk + i] = 0.0f;
    }
    for (int64_t t = 0; t < T; t++) {
        __syncthreads();
        if (threadIdx.x == 0) {
            kvr_gdn_l2_norm((const float *)(q.data + (h % Hk) * q.nb[1] + t * q.nb[2]), qn, (int)Dk, eps);
            kvr_gdn_l2_norm((const float *)(k.data + (h % Hk) * k.nb[1] + t * k.nb[2]), kn, (int)Dk, eps);
        }
        __syncthreads();
        const float eg = expf(((const float *)(g.data + t * g.nb[1]))[h]), beta = ((const float *)(b.data + t * b.nb[1]))[h];
        const float * vr = (const float *)(v.data + h * v.nb[1] + t * v.nb[2]);
        float * o = (float *)(d.data + h * d.nb[1] + t * d.nb[2]);
        for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) o[j] = kvr_gdn_row(S + j * Dk, kn, qn, (int)Dk, eg, beta, vr[j]) * scale;
    }
}

#define CU_NORM_THREADS 256

static __device__ double block_sum_d(double v, double * sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = CU_NORM_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    const double r = sh[0];
    __syncthreads();
    return r;
}

// RMS_NORM, NORM: a block per row, sums in double as the CPU path (and GGML) does
static __global__ void k_norm(int rms, cu_tensor a, cu_tensor d, float eps) {
    __shared__ double sh[CU_NORM_THREADS];
    const int64_t r = blockIdx.x, n = a.ne[0];
    const float * x = (const float *)cu_row(a, r);
    float * y = (float *)cu_row(d, r);
    double acc = 0.0;
    if (rms) {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += (double)(x[i] * x[i]);
        const double sum = block_sum_d(acc, sh);
        const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * scale;
        return;
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += (double)x[i];
    const float mean = (float)block_sum_d(acc, sh) / (float)n;
    acc = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float dx = x[i] - mean;
        acc += (double)(dx * dx);
    }
    const double var = block_sum_d(acc, sh);
    const float scale = 1.0f / sqrtf((float)(var / (double)n) + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i] = (x[i] - mean) * scale;
}

// ROPE: a block per (head, token); a thread per rotated pair, then the dims past n_rot copied
static __global__ void k_rope(cu_tensor a, cu_tensor d, const int32_t * pos, const float * freqs, int n_rot, int mode,
                              float theta_scale, float freq_scale, float ext_factor, float mscale, float corr_lo, float corr_hi) {
    const int64_t H = a.ne[1];
    const int64_t h = blockIdx.x % H, t = blockIdx.x / H;
    const float * x = (const float *)(a.data + h * a.nb[1] + t * a.nb[2]);
    float * y = (float *)(d.data + h * d.nb[1] + t * d.nb[2]);
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
        const float th = kvr_rope_theta(pos[t], theta_scale, i);
        float c, sn; // YaRN's ramp and magnitude where the node has them (kvr_rope_yarn)
        kvr_rope_yarn_cs(freqs ? th / freqs[i] : th, freq_scale, ext_factor, mscale, corr_lo, corr_hi, i, &c, &sn);
        int i0, i1;
        kvr_rope_dims(mode, n_rot, i, &i0, &i1);
        float y0, y1;
        kvr_rope_rotate(x[i0], x[i1], c, sn, &y0, &y1);
        y[i0] = y0;
        y[i1] = y1;
    }
    for (int64_t i = n_rot + threadIdx.x; i < a.ne[0]; i += blockDim.x) y[i] = x[i];
}

// CPY, KV_STORE: f32 rows into f32 or f16 (row by row when the row lengths match, else flat into a
// contiguous destination), or, a cache store, into bf16 or q8_0 rows (a thread per Q8_0 block,
// kvr_kv_quant_q8_0 as the CPU's store)
static __global__ void k_cpy(cu_tensor a, cu_tensor d, int same_rows, int dtype) {
    const int64_t r = blockIdx.x, n = a.ne[0];
    const float * x = (const float *)cu_row(a, r);
    char * y = same_rows ? cu_row(d, r) : d.data + r * n * (dtype == KVR_TYPE_F16 ? 2 : 4);
    if (dtype == KVR_TYPE_Q8_0) {
        for (int64_t b = threadIdx.x; b < n / 32; b += blockDim.x) kvr_kv_quant_q8_0(x + 32 * b, (struct kvr_block_q8_0 *)y + b);
        return;
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        if (dtype == KVR_TYPE_F16)       ((uint16_t *)y)[i] = kvr_f32_to_half(x[i]);
        else if (dtype == KVR_TYPE_BF16) ((uint16_t *)y)[i] = kvr_f32_to_bfloat(x[i]);
        else                             ((float *)y)[i] = x[i];
    }
}

// Weights that are not F32 -> an F32 tile [rows, K] for cuBLAS's f32 product (prefill): a thread
// per 8 elements of a row (kvr_dequant8), two 16-byte stores. F32, not F16: an activation above
// 65504 would overflow F16 (inf, then NaN), and f32 keeps the product the CPU's exact one.
template <int TYPE>
static __global__ void k_dequant_f32(const char * w, int64_t nb1, int64_t K, int64_t rows, float * out) {
    const int64_t ng = (K + 7) / 8; // a plain row's last group may be partial
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= rows * ng) return;
    const int64_t r = idx / ng, g = idx % ng;
    const char * row = w + r * nb1;
    float * o = out + r * K + g * 8;
    if (8 * g + 8 > K) {
        if constexpr (cu_blck(TYPE) == 1) { // blocks of the quantized types are whole groups
            for (int64_t e = 8 * g; e < K; e++) kvr_dequant_block((enum kvr_type)TYPE, row, e, out + r * K + e);
        }
        return;
    }
    float v[8];
    kvr_dequant8((enum kvr_type)TYPE, row, g, v);
    if (K % 8 == 0) { // 16-byte stores: the tile is 256-aligned, its rows 32-byte multiples
        ((float4 *)o)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)o)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        for (int j = 0; j < 8; j++) o[j] = v[j];
    }
}

// One to CU_DOT_MAX_T tokens over weights of any type but F32 (decode): a warp per output row. Lane
// l takes the row's groups of 8 elements l, l+32, ... (kvr_dequant8: 8 floats in registers, never a
// whole block), so the warp's 32 lanes read 32 consecutive groups: a block is fetched by one warp
// in one pass (the two halves of a 4-bit block share bytes: two lanes read them from one cache
// line); the group's weights in one wide load where the type and the rows' alignment allow it (F16,
// BF16, Q4_K: cu_weights8; the other types byte by byte, coalesced across the warp), and each
// group's 8 activations of a token as two 16-byte loads when the rows allow it (x_vec); a butterfly
// of shuffles sums the lanes. cu_dot8_lane is the lane's whole work, shared by the kernel and its
// host emulation (kvr_cuda_dot8_emulate, which tests/test-cuda-host.cu checks against the CPU's
// MUL_MAT for every type).
#define CU_DOT_WARPS 4

static __host__ __device__ inline void cu_load8(const float * p, bool vec, float v[8]) {
    if (vec) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        for (int j = 0; j < 8; j++) v[j] = p[j];
    }
}

// A lane's 8 weights: kvr_dequant8's values, the bytes read in one 16-byte (F16, BF16) or 8-byte
// (Q4_K's quants) load when the rows are aligned for it (w_vec), else byte by byte
template <int TYPE>
static __host__ __device__ inline void cu_weights8(const char * row, int64_t g, bool w_vec, float v[8]) {
    if constexpr (TYPE == KVR_TYPE_F16 || TYPE == KVR_TYPE_BF16) {
        if (w_vec) {
            const uint4 u = ((const uint4 *)row)[g];
            const uint32_t w[4] = { u.x, u.y, u.z, u.w };
            for (int j = 0; j < 8; j++) {
                const uint16_t h = (uint16_t)(w[j / 2] >> (16 * (j % 2)));
                v[j] = TYPE == KVR_TYPE_F16 ? kvr_half_to_f32(h) : kvr_bfloat_to_f32(h);
            }
            return;
        }
    }
    if constexpr (TYPE == KVR_TYPE_Q4_K) {
        if (w_vec) {
            const struct kvr_block_q4_K * b = (const struct kvr_block_q4_K *)row + g / 32;
            const int e0 = 8 * (int)(g % 32), gg = e0 / 64, hi = (e0 % 64) / 32;
            const uint2 u = *(const uint2 *)(b->qs + 32*gg + e0 % 32);
            float dl, ml;
            kvr_k4_scale1(b, 2*gg + hi, &dl, &ml);
            for (int j = 0; j < 8; j++) {
                const int q = (int)(((j < 4 ? u.x : u.y) >> (8 * (j % 4))) & 0xff);
                v[j] = dl * (float)(hi ? q >> 4 : q & 0x0f) - ml;
            }
            return;
        }
    }
    (void)w_vec;
    kvr_dequant8((enum kvr_type)TYPE, row, g, v);
}

// whether rows at w, nb1 bytes apart, allow cu_weights8's wide loads
static bool cu_w_vec(enum kvr_type type, const void * w, int64_t nb1) {
    const bool wide = type == KVR_TYPE_F16 || type == KVR_TYPE_BF16 || type == KVR_TYPE_Q4_K;
    return wide && (uintptr_t)w % 16 == 0 && nb1 % 16 == 0;
}

template <int TYPE>
static __host__ __device__ inline void cu_dot8_lane(const char * row, int64_t K, const float * x, int64_t ldx, int T,
                                                    bool x_vec, bool w_vec, int lane, float acc[CU_DOT_MAX_T]) {
    for (int t = 0; t < CU_DOT_MAX_T; t++) acc[t] = 0.0f;
    const int64_t ng = K / 8;
    for (int64_t g = lane; g < ng; g += 32) {
        float v[8];
        cu_weights8<TYPE>(row, g, w_vec, v);
        for (int t = 0; t < CU_DOT_MAX_T; t++) {
            if (t >= T) break;
            float xv[8];
            cu_load8(x + t * ldx + g * 8, x_vec, xv);
            float s = 0.0f;
            for (int j = 0; j < 8; j++) s += v[j] * xv[j];
            acc[t] += s;
        }
    }
    if constexpr (cu_blck(TYPE) == 1) { // a plain row's tail past the last whole group
        for (int64_t e = ng * 8 + lane; e < K; e += 32) {
            float v;
            kvr_dequant_block((enum kvr_type)TYPE, row, e, &v);
            for (int t = 0; t < CU_DOT_MAX_T; t++) {
                if (t >= T) break;
                acc[t] += v * x[t * ldx + e];
            }
        }
    }
}

template <int TYPE>
static __global__ void __launch_bounds__(CU_DOT_WARPS * 32) k_dot8(const char * w, int64_t nb1, int64_t K, int64_t N,
                                                                  const float * x, int64_t ldx, int T, bool x_vec, bool w_vec,
                                                                  float * y) {
    const int lane = threadIdx.x % 32;
    const int64_t n = blockIdx.x * (int64_t)CU_DOT_WARPS + threadIdx.x / 32;
    if (n >= N) return; // a whole warp leaves: the shuffles below see only full warps
    float acc[CU_DOT_MAX_T];
    cu_dot8_lane<TYPE>(w + n * nb1, K, x, ldx, T, x_vec, w_vec, lane, acc);
#pragma unroll
    for (int t = 0; t < CU_DOT_MAX_T; t++) {
        if (t >= T) break;
        const float s = warp_sum(acc[t]);
        if (lane == 0) y[t * N + n] = s;
    }
}

// The host emulation of k_dot8's warp for one row: the 32 lanes as an array, each running
// cu_dot8_lane, then warp_sum's butterfly (lane l adds lane l ^ o, o = 16 .. 1) as the shuffles do.
void kvr_cuda_dot8_emulate(enum kvr_type type, const void * row, int64_t K, const float * x, int64_t ldx, int T,
                           bool w_vec, float * y) {
    KVR_ASSERT(T >= 1 && T <= CU_DOT_MAX_T);
    KVR_ASSERT(!w_vec || cu_w_vec(type, row, 0));
    float acc[32][CU_DOT_MAX_T];
    for (int lane = 0; lane < 32; lane++) {
        switch (type) {
#define CU_CASE(TY) case TY: cu_dot8_lane<TY>((const char *)row, K, x, ldx, T, false, w_vec, lane, acc[lane]); break;
            CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            default: KVR_ASSERT(!"a type the backend does not read");
        }
    }
    for (int t = 0; t < T; t++) {
        float v[32];
        for (int l = 0; l < 32; l++) v[l] = acc[l][t];
        for (int o = 16; o > 0; o >>= 1) {
            float nv[32];
            for (int l = 0; l < 32; l++) nv[l] = v[l] + v[l ^ o];
            memcpy(v, nv, sizeof(v));
        }
        y[t] = v[0];
    }
}

// ATTN. A thread block per (KV head, query tile) as the CPU kernel's work items: the tile's rows are
// its tokens times the query heads of the group (token-major). Warps take one row each at a time;
// for every key tile the block decides with kvr_attn_tile whether it is skipped (causal) or
// masked, then stages CU_ATTN_CK keys and values at a time in shared memory, which all its warps
// read. A lane holds D/32 of its row's query and output; a row's scores of a chunk are one per
// lane, folded into the running max and sum by kvr_softmax_step.
#define CU_ATTN_WARPS 8
#define CU_ATTN_CK    32
#define CU_ATTN_DMAX  256

struct cu_attn_args {
    const char * q, * k, * v;
    int64_t q_nb1, q_nb2, k_nb1, k_nb2, v_nb1, v_nb2;
    const int32_t * qpos, * kpos;
    char * out;
    int64_t out_nb1;
    int D, H, Hkv, Tq, Tk, mode;
    int ktype, vtype;             // K's and V's types (a KV cache's: f32, f16, bf16, q8_0)
    int64_t window;               // sliding window (0: none)
    float scale;
    float softcap;                // scores soft-capped at this (0: not)
    const float * sink;           // per-head sink logits (NULL: none; kvr_attn_sinks)
    unsigned long long * count;   // [0] pairs computed, [1] pairs causality needs (KV head 0)
};

// The grid of k_attn: a block per (KV head, query tile), KV head fastest; and the query tile of
// one block. Host and device: kvr_cuda_attn_count counts the kernel's pairs with them.
static __host__ __device__ inline int64_t cu_attn_blocks(int H, int Hkv, int64_t Tq) {
    const int64_t BT = kvr_attn_tile_tokens(H / Hkv);
    return Hkv * ((Tq + BT - 1) / BT);
}

static __host__ __device__ inline void cu_attn_block(int64_t block, int H, int Hkv, int64_t Tq, int * g, int64_t * i0,
                                                     int64_t * bt) {
    const int64_t BT = kvr_attn_tile_tokens(H / Hkv);
    *g  = (int)(block % Hkv);
    *i0 = (block / Hkv) * BT;
    *bt = *i0 + BT <= Tq ? BT : Tq - *i0;
}

// min and max of one int per thread over the block (every thread gets them)
static __device__ void block_minmax(int vmin, int vmax, int * sh, int * out_min, int * out_max) {
    for (int o = 16; o > 0; o >>= 1) {
        vmin = min(vmin, __shfl_xor_sync(0xffffffffu, vmin, o));
        vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
    }
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) { sh[w] = vmin; sh[CU_ATTN_WARPS + w] = vmax; }
    __syncthreads();
    int mn = sh[0], mx = sh[CU_ATTN_WARPS];
    for (int i = 1; i < CU_ATTN_WARPS; i++) { mn = min(mn, sh[i]); mx = max(mx, sh[CU_ATTN_WARPS + i]); }
    __syncthreads();
    *out_min = mn;
    *out_max = mx;
}

static __global__ void __launch_bounds__(CU_ATTN_WARPS * 32, 1) k_attn(cu_attn_args p) {
    extern __shared__ float kv_sh[];             // [CU_ATTN_CK][D] keys, then as many values
    __shared__ int mm_sh[2 * CU_ATTN_WARPS];
    float * Ks = kv_sh;
    float * Vs = kv_sh + CU_ATTN_CK * p.D;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int G = p.H / p.Hkv;
    int g;
    int64_t i0, bt;
    cu_attn_block(blockIdx.x, p.H, p.Hkv, p.Tq, &g, &i0, &bt);
    const int64_t rows = bt * G;
    constexpr int ND = CU_ATTN_DMAX / 32;

    int qmin, qmax;
    {
        const int qp = tid < bt ? p.qpos[i0 + tid] : 0;
        block_minmax(tid < bt ? qp : INT32_MAX, tid < bt ? qp : INT32_MIN, mm_sh, &qmin, &qmax);
    }
    for (int64_t rg = 0; rg < rows; rg += CU_ATTN_WARPS) {
        const int64_t r = rg + warp;
        const bool active = r < rows;
        const int64_t i = active ? r / G : 0;
        const int h = g * G + (int)(active ? r % G : 0);
        const int32_t qp = active ? p.qpos[i0 + i] : 0;
        float qr[ND], o[ND];
        const float * qrow = (const float *)(p.q + h * p.q_nb1 + (i0 + i) * p.q_nb2);
        #pragma unroll
        for (int c = 0; c < ND; c++) {
            const int dd = lane + 32 * c;
            qr[c] = active && dd < p.D ? qrow[dd] : 0.0f;
            o[c] = 0.0f;
            // the query as the keys' type makes it (the CPU's attn_q_as): F16/BF16 rounded; Q8_0
            // quantized by its 32-value block, which is this warp's 32 lanes
            if (p.ktype == KVR_TYPE_Q8_0) {
                const float amax = warp_max(fabsf(qr[c]));
                const float dq = kvr_half_to_f32(kvr_f32_to_half(amax / 127.0f));
                qr[c] = dq * rintf(qr[c] * (amax != 0.0f ? 127.0f / amax : 0.0f));
            } else {
                qr[c] = kvr_kv_operand_round((enum kvr_type)p.ktype, qr[c]);
            }
        }
        float M = -INFINITY, L = 0.0f;
        long long seen = 0;
        for (int64_t j0 = 0; j0 < p.Tk; j0 += KVR_ATTN_BK) {
            const int64_t bk = j0 + KVR_ATTN_BK <= p.Tk ? KVR_ATTN_BK : p.Tk - j0;
            int kmin, kmax;
            {
                const bool in = tid < bk;
                const int kp = in ? p.kpos[j0 + tid] : 0;
                block_minmax(in ? kp : INT32_MAX, in ? kp : INT32_MIN, mm_sh, &kmin, &kmax);
            }
            const int vis = kvr_attn_tile(p.mode, qmin, qmax, kmin, kmax, p.window);
            if (vis == 0) continue; // the same decision in every thread: the block stays in step
            if (rg == 0 && g == 0 && tid == 0) atomicAdd(&p.count[0], (unsigned long long)(bt * bk));
            for (int64_t c0 = 0; c0 < bk; c0 += CU_ATTN_CK) {
                const int ck = (int)(c0 + CU_ATTN_CK <= bk ? CU_ATTN_CK : bk - c0);
                __syncthreads(); // the previous chunk is consumed
                for (int e = tid; e < ck * p.D; e += blockDim.x) {
                    const int jj = e / p.D, dd = e % p.D;
                    const int64_t j = j0 + c0 + jj;
                    Ks[jj * p.D + dd] = kvr_kv_elem((enum kvr_type)p.ktype, p.k + g * p.k_nb1 + j * p.k_nb2, dd);
                    Vs[jj * p.D + dd] = kvr_kv_elem((enum kvr_type)p.vtype, p.v + g * p.v_nb1 + j * p.v_nb2, dd);
                }
                __syncthreads();
                if (!active) continue;
                float my_s = -INFINITY; // lane jj keeps key jj's score
                for (int jj = 0; jj < ck; jj++) {
                    float part = 0.0f;
                    #pragma unroll
                    for (int c = 0; c < ND; c++) {
                        const int dd = lane + 32 * c;
                        if (dd < p.D) part += qr[c] * Ks[jj * p.D + dd];
                    }
                    const float s = kvr_softcap_f32(warp_sum(part) * p.scale, p.softcap);
                    const bool visible = vis == 1 || kvr_attn_visible(qp, p.kpos[j0 + c0 + jj], p.window);
                    seen += visible;
                    if (lane == jj) my_s = visible ? s : -INFINITY;
                }
                const float mx = warp_max(my_s);
                if (mx == -INFINITY) continue; // nothing visible for this row in this chunk
                const float m_new = kvr_softmax_max(M, mx);
                const float pj = my_s == -INFINITY ? 0.0f : expf(my_s - m_new);
                const float corr = kvr_softmax_step(&M, &L, m_new, warp_sum(pj));
                #pragma unroll
                for (int c = 0; c < ND; c++) o[c] *= corr;
                for (int jj = 0; jj < ck; jj++) {
                    // F16/BF16 values: the weights in that type (the CPU's tiled kernel does the same)
                    const float w = kvr_kv_operand_round((enum kvr_type)p.vtype, __shfl_sync(0xffffffffu, pj, jj));
                    #pragma unroll
                    for (int c = 0; c < ND; c++) {
                        const int dd = lane + 32 * c;
                        if (dd < p.D) o[c] += w * Vs[jj * p.D + dd];
                    }
                }
            }
        }
        if (!active) continue;
        if (g == 0 && r % G == 0 && lane == 0) atomicAdd(&p.count[1], (unsigned long long)seen);
        if (p.sink) { // the sink's logit: one more term of the denominator, no value
            const float corr = kvr_softmax_step(&M, &L, kvr_softmax_max(M, p.sink[h]), 0.0f);
            L += expf(p.sink[h] - M);
            #pragma unroll
            for (int c = 0; c < ND; c++) o[c] *= corr;
        }
        float inv, lse;
        kvr_softmax_finish(M, L, &inv, &lse);
        float * out = (float *)(p.out + (i0 + i) * p.out_nb1);
        #pragma unroll
        for (int c = 0; c < ND; c++) {
            const int dd = lane + 32 * c;
            if (dd < p.D) out[h * p.D + dd] = o[c] * inv;
        }
        if (lane == 0) out[p.D * p.H + h] = lse;
    }
}

// What k_attn's counters will say for these positions, from its own grid and tile functions: per
// visited tile of KV head 0, its tokens times its keys (dense); per token, the keys it sees in the
// visited tiles (causal). tests/test-cuda-host.cu compares them with the CPU kernel's counters.
void kvr_cuda_attn_count(const int32_t * qpos, int64_t Tq, const int32_t * kpos, int64_t Tk, int H, int Hkv,
                         int mode, int64_t window, int64_t * dense, int64_t * causal) {
    *dense = *causal = 0;
    for (int64_t b = 0; b < cu_attn_blocks(H, Hkv, Tq); b++) {
        int g;
        int64_t i0, bt;
        cu_attn_block(b, H, Hkv, Tq, &g, &i0, &bt);
        if (g != 0) continue; // the kernel counts KV head 0 only
        int32_t qmin = INT32_MAX, qmax = INT32_MIN;
        for (int64_t i = 0; i < bt; i++) {
            qmin = qpos[i0 + i] < qmin ? qpos[i0 + i] : qmin;
            qmax = qpos[i0 + i] > qmax ? qpos[i0 + i] : qmax;
        }
        for (int64_t j0 = 0; j0 < Tk; j0 += KVR_ATTN_BK) {
            const int64_t bk = j0 + KVR_ATTN_BK <= Tk ? KVR_ATTN_BK : Tk - j0;
            int32_t kmin = INT32_MAX, kmax = INT32_MIN;
            for (int64_t j = 0; j < bk; j++) {
                kmin = kpos[j0 + j] < kmin ? kpos[j0 + j] : kmin;
                kmax = kpos[j0 + j] > kmax ? kpos[j0 + j] : kmax;
            }
            const int vis = kvr_attn_tile(mode, qmin, qmax, kmin, kmax, window);
            if (vis == 0) continue;
            *dense += bt * bk;
            for (int64_t i = 0; i < bt; i++) {
                for (int64_t j = 0; j < bk; j++) *causal += vis == 1 || kvr_attn_visible(qpos[i0 + i], kpos[j0 + j], window);
            }
        }
    }
}

// ATTN on tensor cores (FlashAttention-2's schedule, written with WMMA): F16 K/V (the cache's type),
// f32 scores, softmax and output accumulators. Why WMMA and not cuBLAS GEMMs over tiles: the
// scores never leave the multiprocessor (memory O(T): no T x T buffer, not even per tile in
// device memory), and one kernel does the masking, the online softmax and the LSE the ring
// strategies' merges need. A thread block takes one KV head and CU_FA_BQ query rows of it (the
// rows are tokens times the query heads of the group, token-major, as the CPU kernel's tiles:
// GQA/MQA read every key once for the whole group); 4 warps of 16 rows each. Per key tile of BK
// keys, decided from its extreme positions by kvr_attn_tile (skipped when no query of the block
// can see a key of it; masked per element when some cannot):
//   1. K and V of the tile into shared memory (16-byte copies), the block's Q already there (F16,
//      scaled by the softmax scale first, so large queries stay in F16's range)
//   2. S = Q K^T, 16x16x16 HMMA tiles with f32 accumulators, into shared memory (a warp's own rows)
//   3. two lanes per row: mask, row max, exp, row sum, the running max and sum (kvr_softmax_step,
//      the CPU kernel's function), P = exp(S - m) as F16, the factor the row's output is scaled by
//   4. O (f32, shared memory: D up to 256 would not fit in registers without spilling) scaled by
//      that factor, then O += P V, HMMA again
// At the end O / l and the LSE (kvr_softmax_finish), as k_attn writes them. A row that sees no key
// has O = 0 and LSE -inf. The counters (pairs computed, pairs causality needs) are counted apart,
// on the CPU kernel's tiles (k_attn_count), so that they mean what the CPU's mean.
// kvr_cuda_fattn_emulate runs this algorithm on the host (its warps' lanes as loops, its shared
// tiles as arrays, F16 rounding where the kernel rounds); tests/test-cuda-host.cu checks it and
// kvr_cuda_fattn_pairs (the pairs the schedule computes) against the CPU kernel.
#define CU_FA_BQ    64
#define CU_FA_WARPS 4

static __host__ __device__ constexpr int cu_fa_bk(int D) { return D >= 256 ? 32 : 64; }

static __host__ __device__ constexpr size_t cu_fa_smem(int D) {
    return (size_t)CU_FA_BQ * D * 4                    // O, f32
         + (size_t)CU_FA_BQ * cu_fa_bk(D) * 4          // S, f32
         + (size_t)CU_FA_BQ * D * 2                    // Q, f16
         + (size_t)2 * cu_fa_bk(D) * D * 2             // K and V, f16
         + (size_t)CU_FA_BQ * cu_fa_bk(D) * 2          // P, f16
         + (size_t)CU_FA_BQ * 4 * 2;                   // per row: factor, position
}

// the head dims the kernel is built for (multiples of 16: whole HMMA tiles)
static bool cu_fa_dim(int D) { return D == 64 || D == 80 || D == 96 || D == 128 || D == 256; }

// The grid: a block per (KV head, tile of CU_FA_BQ rows), KV head fastest; a block's rows.
static __host__ __device__ inline int64_t cu_fa_blocks(int H, int Hkv, int64_t Tq) {
    return Hkv * ((Tq * (H / Hkv) + CU_FA_BQ - 1) / CU_FA_BQ);
}

static __host__ __device__ inline void cu_fa_block(int64_t block, int H, int Hkv, int64_t Tq, int * g, int64_t * r0,
                                                   int64_t * nr) {
    const int64_t rows = Tq * (H / Hkv);
    *g  = (int)(block % Hkv);
    *r0 = (block / Hkv) * CU_FA_BQ;
    *nr = *r0 + CU_FA_BQ <= rows ? CU_FA_BQ : rows - *r0;
}

// The extreme positions of a block's tokens, and one key tile's decision for the block (host and
// device): 0 skip, 1 all visible, 2 masked per element (kvr_attn_tile, as the CPU kernel decides).
static __host__ __device__ inline void cu_fa_qrange(const int32_t * qpos, int64_t i_first, int64_t i_last, int32_t * qmin,
                                                    int32_t * qmax) {
    *qmin = INT32_MAX;
    *qmax = INT32_MIN;
    for (int64_t i = i_first; i <= i_last; i++) {
        *qmin = qpos[i] < *qmin ? qpos[i] : *qmin;
        *qmax = qpos[i] > *qmax ? qpos[i] : *qmax;
    }
}

static __host__ __device__ inline int cu_fa_tile(int32_t qmin, int32_t qmax, const int32_t * kpos, int64_t j0, int64_t bk,
                                                 int mode, int64_t window) {
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    for (int64_t j = j0; j < j0 + bk; j++) {
        kmin = kpos[j] < kmin ? kpos[j] : kmin;
        kmax = kpos[j] > kmax ? kpos[j] : kmax;
    }
    return kvr_attn_tile(mode, qmin, qmax, kmin, kmax, window);
}

struct cu_fattn_args {
    const char * q, * k, * v;
    int64_t q_nb1, q_nb2, k_nb1, k_nb2, v_nb1, v_nb2;
    const int32_t * qpos, * kpos;
    char * out;
    int64_t out_nb1;
    int H, Hkv, Tq, Tk, mode;
    int64_t window;
    float scale;
};

template <int D>
static __global__ void __launch_bounds__(CU_FA_WARPS * 32) k_fattn(cu_fattn_args p) {
    constexpr int BK = cu_fa_bk(D);
    extern __shared__ __align__(128) unsigned char fa_sh[];
    float  * Os = (float *)fa_sh;                       // [BQ][D]
    float  * Ss = Os + CU_FA_BQ * D;                    // [BQ][BK]
    __half * Qs = (__half *)(Ss + CU_FA_BQ * BK);      // [BQ][D]
    __half * Ks = Qs + CU_FA_BQ * D;                    // [BK][D]
    __half * Vs = Ks + BK * D;                          // [BK][D]
    __half * Ps = Vs + BK * D;                          // [BQ][BK]
    float  * corr_s = (float *)(Ps + CU_FA_BQ * BK);   // [BQ]
    int32_t * qp_s = (int32_t *)(corr_s + CU_FA_BQ);   // [BQ]
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int G = p.H / p.Hkv;
    int g;
    int64_t r0, nr;
    cu_fa_block(blockIdx.x, p.H, p.Hkv, p.Tq, &g, &r0, &nr);

    // Q (scaled, F16), O = 0, the rows' positions
    for (int e = tid; e < CU_FA_BQ * D; e += blockDim.x) {
        const int row = e / D, d = e % D;
        float q = 0.0f;
        if (row < nr) {
            const int64_t r = r0 + row, i = r / G;
            const int h = g * G + (int)(r % G);
            q = ((const float *)(p.q + h * p.q_nb1 + i * p.q_nb2))[d] * p.scale;
        }
        Qs[e] = __float2half_rn(q);
        Os[e] = 0.0f;
    }
    if (tid < CU_FA_BQ) qp_s[tid] = tid < nr ? p.qpos[(r0 + tid) / G] : 0;
    __syncthreads();
    // the softmax state of row `my_row`, kept by its two lanes alike
    const int my_row = warp * 16 + lane / 2, half_id = lane % 2;
    const bool row_live = my_row < nr;
    const int32_t my_qp = qp_s[my_row];
    float M = -INFINITY, L = 0.0f;
    int32_t qmin, qmax;
    cu_fa_qrange(p.qpos, r0 / G, (r0 + nr - 1) / G, &qmin, &qmax);

    for (int64_t j0 = 0; j0 < p.Tk; j0 += BK) {
        const int64_t bk = j0 + BK <= p.Tk ? BK : p.Tk - j0;
        // every thread decides alike (the same reads): the block stays in step
        const int vis = cu_fa_tile(qmin, qmax, p.kpos, j0, bk, p.mode, p.window);
        if (vis == 0) continue;
        // 1. K and V, 8 halves (16 bytes) a copy; keys past Tk are zeros
        for (int e = tid; e < BK * D / 8; e += blockDim.x) {
            const int jj = e / (D / 8), c = e % (D / 8);
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (jj < bk) {
                kv = ((const uint4 *)(p.k + g * p.k_nb1 + (j0 + jj) * p.k_nb2))[c];
                vv = ((const uint4 *)(p.v + g * p.v_nb1 + (j0 + jj) * p.v_nb2))[c];
            }
            ((uint4 *)Ks)[e] = kv;
            ((uint4 *)Vs)[e] = vv;
        }
        __syncthreads();
        // 2. S = Q K^T for this warp's 16 rows (loops kept rolled: one fragment set live at a time)
#pragma unroll 1
        for (int n = 0; n < BK / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int kk = 0; kk < D / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                wmma::load_matrix_sync(a, Qs + warp * 16 * D + kk * 16, D);
                wmma::load_matrix_sync(b, Ks + n * 16 * D + kk * 16, D);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(Ss + warp * 16 * BK + n * 16, acc, BK, wmma::mem_row_major);
        }
        __syncwarp();
        // 3. the online softmax, two lanes a row, each half of the tile's keys
        {
            float * srow = Ss + my_row * BK;
            __half * prow = Ps + my_row * BK;
            const int c0 = half_id * (BK / 2);
            float mx = -INFINITY;
            for (int c = c0; c < c0 + BK / 2; c++) {
                const bool ok = row_live && c < bk && (vis == 1 || kvr_attn_visible(my_qp, p.kpos[j0 + c], p.window));
                if (!ok) srow[c] = -INFINITY;
                mx = fmaxf(mx, srow[c]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            float corr = 1.0f;
            if (mx == -INFINITY) { // nothing visible for this row in this tile
                for (int c = c0; c < c0 + BK / 2; c++) prow[c] = __float2half_rn(0.0f);
            } else {
                const float m_new = kvr_softmax_max(M, mx);
                float sum = 0.0f;
                for (int c = c0; c < c0 + BK / 2; c++) {
                    const float pj = srow[c] == -INFINITY ? 0.0f : expf(srow[c] - m_new);
                    const __half ph = __float2half_rn(pj);
                    prow[c] = ph;
                    sum += __half2float(ph); // l sums what P V multiplies: the rounded weights
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                corr = kvr_softmax_step(&M, &L, m_new, sum);
            }
            if (half_id == 0) corr_s[my_row] = corr;
        }
        __syncwarp();
        // 4. O = O * corr + P V
        for (int e = lane; e < 16 * D; e += 32) {
            const int row = warp * 16 + e / D;
            Os[row * D + e % D] *= corr_s[row];
        }
        __syncwarp();
#pragma unroll 1
        for (int n = 0; n < D / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, Os + warp * 16 * D + n * 16, D, wmma::mem_row_major);
            for (int kk = 0; kk < BK / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
                wmma::load_matrix_sync(a, Ps + warp * 16 * BK + kk * 16, BK);
                wmma::load_matrix_sync(b, Vs + kk * 16 * D + n * 16, D);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(Os + warp * 16 * D + n * 16, acc, D, wmma::mem_row_major);
        }
        __syncthreads(); // K, V are overwritten next
    }
    // the rows' ends: O / l and the LSE
    float inv = 0.0f, lse = -INFINITY;
    kvr_softmax_finish(M, L, &inv, &lse);
    if (half_id == 0) corr_s[my_row] = inv;
    if (half_id == 0 && row_live) {
        const int64_t r = r0 + my_row;
        ((float *)(p.out + (r / G) * p.out_nb1))[D * p.H + g * G + (int)(r % G)] = lse;
    }
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) {
        const int row = warp * 16 + e / D, d = e % D;
        if (row >= nr) continue;
        const int64_t r = r0 + row;
        ((float *)(p.out + (r / G) * p.out_nb1))[(g * G + (int)(r % G)) * D + d] = Os[row * D + d] * corr_s[row];
    }
}

// The counters of an ATTN run by k_fattn, on the CPU kernel's tiles (kvr_attn_tile_tokens x
// KVR_ATTN_BK, KV head 0) so that they mean what the CPU's and k_attn's mean: a thread per
// (query tile, key tile); [0] its tokens times its keys when computed, [1] the visible pairs.
static __global__ void k_attn_count(const int32_t * qpos, int64_t Tq, const int32_t * kpos, int64_t Tk, int G, int mode,
                                    int64_t window, unsigned long long * count) {
    const int64_t BT = kvr_attn_tile_tokens(G);
    const int64_t nqt = (Tq + BT - 1) / BT, nkt = (Tk + KVR_ATTN_BK - 1) / KVR_ATTN_BK;
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= nqt * nkt) return;
    const int64_t i0 = (idx / nkt) * BT, j0 = (idx % nkt) * KVR_ATTN_BK;
    const int64_t bt = i0 + BT <= Tq ? BT : Tq - i0, bk = j0 + KVR_ATTN_BK <= Tk ? KVR_ATTN_BK : Tk - j0;
    int32_t qmin, qmax;
    cu_fa_qrange(qpos, i0, i0 + bt - 1, &qmin, &qmax);
    const int vis = cu_fa_tile(qmin, qmax, kpos, j0, bk, mode, window);
    if (vis == 0) return;
    unsigned long long seen = (unsigned long long)(bt * bk);
    if (vis == 2) {
        seen = 0;
        for (int64_t i = i0; i < i0 + bt; i++) {
            for (int64_t j = j0; j < j0 + bk; j++) seen += kvr_attn_visible(qpos[i], kpos[j], window);
        }
    }
    atomicAdd(&count[0], (unsigned long long)(bt * bk));
    atomicAdd(&count[1], seen);
}

// k_fattn's algorithm on the host, for tests/test-cuda-host.cu: the same grid, tiles and decisions
// (the functions above), the warps' HMMA products as sums over F16 inputs in f32, P rounded to F16
// and the running state per row as the kernel's lanes keep them. q: f32 [Tq][H][D]; k, v: F16 bits
// [Tk][Hkv][D]; out: [Tq][H*D + H] as ATTN's result.
void kvr_cuda_fattn_emulate(int D, const float * q, const uint16_t * k, const uint16_t * v, const int32_t * qpos,
                            const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int mode, int64_t window, float scale,
                            float * out) {
    KVR_ASSERT(cu_fa_dim(D));
    const int BK = cu_fa_bk(D), G = H / Hkv;
    float * Os = (float *)malloc(sizeof(float) * (size_t)(CU_FA_BQ * D));
    float * Qs = (float *)malloc(sizeof(float) * (size_t)(CU_FA_BQ * D));
    float * S = (float *)malloc(sizeof(float) * (size_t)(CU_FA_BQ * BK));
    float * P = (float *)malloc(sizeof(float) * (size_t)(CU_FA_BQ * BK));
    KVR_ASSERT(Os && Qs && S && P);
    for (int64_t b = 0; b < cu_fa_blocks(H, Hkv, Tq); b++) {
        int g;
        int64_t r0, nr;
        cu_fa_block(b, H, Hkv, Tq, &g, &r0, &nr);
        float M[CU_FA_BQ], L[CU_FA_BQ];
        for (int row = 0; row < CU_FA_BQ; row++) {
            M[row] = -INFINITY;
            L[row] = 0.0f;
            for (int d = 0; d < D; d++) {
                const int64_t r = r0 + row;
                const float x = row < nr ? q[((r / G) * H + g * G + r % G) * D + d] * scale : 0.0f;
                Qs[row * D + d] = kvr_half_to_f32(kvr_f32_to_half(x));
                Os[row * D + d] = 0.0f;
            }
        }
        int32_t qmin, qmax;
        cu_fa_qrange(qpos, r0 / G, (r0 + nr - 1) / G, &qmin, &qmax);
        for (int64_t j0 = 0; j0 < Tk; j0 += BK) {
            const int64_t bk = j0 + BK <= Tk ? BK : Tk - j0;
            const int vis = cu_fa_tile(qmin, qmax, kpos, j0, bk, mode, window);
            if (vis == 0) continue;
            for (int row = 0; row < CU_FA_BQ; row++) {
                for (int c = 0; c < BK; c++) {
                    float s = 0.0f;
                    for (int d = 0; d < D && c < bk; d++) s += Qs[row * D + d] * kvr_half_to_f32(k[((j0 + c) * Hkv + g) * D + d]);
                    S[row * BK + c] = s;
                }
            }
            for (int row = 0; row < CU_FA_BQ; row++) {
                const bool live = row < nr;
                const int32_t qp = live ? qpos[(r0 + row) / G] : 0;
                float mx = -INFINITY;
                for (int c = 0; c < BK; c++) {
                    const bool ok = live && c < bk && (vis == 1 || kvr_attn_visible(qp, kpos[j0 + c], window));
                    if (!ok) S[row * BK + c] = -INFINITY;
                    mx = S[row * BK + c] > mx ? S[row * BK + c] : mx;
                }
                float corr = 1.0f;
                if (mx == -INFINITY) {
                    for (int c = 0; c < BK; c++) P[row * BK + c] = 0.0f;
                } else {
                    const float m_new = kvr_softmax_max(M[row], mx);
                    float sum[2] = { 0.0f, 0.0f }; // the two lanes' halves, added as the shuffle does
                    for (int c = 0; c < BK; c++) {
                        const float pj = S[row * BK + c] == -INFINITY ? 0.0f : expf(S[row * BK + c] - m_new);
                        P[row * BK + c] = kvr_half_to_f32(kvr_f32_to_half(pj));
                        sum[c / (BK / 2)] += P[row * BK + c];
                    }
                    corr = kvr_softmax_step(&M[row], &L[row], m_new, sum[0] + sum[1]);
                }
                for (int d = 0; d < D; d++) {
                    float o = Os[row * D + d] * corr;
                    for (int c = 0; c < bk; c++) o += P[row * BK + c] * kvr_half_to_f32(v[((j0 + c) * Hkv + g) * D + d]);
                    Os[row * D + d] = o;
                }
            }
        }
        for (int64_t row = 0; row < nr; row++) {
            const int64_t r = r0 + row;
            const int h = g * G + (int)(r % G);
            float inv, lse;
            kvr_softmax_finish(M[row], L[row], &inv, &lse);
            float * o = out + (r / G) * (int64_t)(H * D + H);
            for (int d = 0; d < D; d++) o[h * D + d] = Os[row * D + d] * inv;
            o[H * D + h] = lse;
        }
    }
    free(Os); free(Qs); free(S); free(P);
}

// The pairs k_fattn's schedule computes as visible: cover[(h * Tq + i) * Tk + j] counts how often
// query head h of token i and key j are (the grid, the skipped tiles, the masks).
void kvr_cuda_fattn_pairs(int D, const int32_t * qpos, const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int mode,
                          int64_t window, int32_t * cover) {
    const int BK = cu_fa_bk(D), G = H / Hkv;
    memset(cover, 0, sizeof(int32_t) * (size_t)H * (size_t)Tq * (size_t)Tk);
    for (int64_t b = 0; b < cu_fa_blocks(H, Hkv, Tq); b++) {
        int g;
        int64_t r0, nr;
        cu_fa_block(b, H, Hkv, Tq, &g, &r0, &nr);
        int32_t qmin, qmax;
        cu_fa_qrange(qpos, r0 / G, (r0 + nr - 1) / G, &qmin, &qmax);
        for (int64_t j0 = 0; j0 < Tk; j0 += BK) {
            const int64_t bk = j0 + BK <= Tk ? BK : Tk - j0;
            const int vis = cu_fa_tile(qmin, qmax, kpos, j0, bk, mode, window);
            if (vis == 0) continue;
            for (int64_t row = 0; row < nr; row++) {
                const int64_t r = r0 + row, i = r / G;
                const int h = g * G + (int)(r % G);
                for (int64_t c = 0; c < bk; c++) {
                    if (vis == 1 || kvr_attn_visible(qpos[i], kpos[j0 + c], window)) cover[((int64_t)h * Tq + i) * Tk + j0 + c]++;
                }
            }
        }
    }
}

// Decode attention split over the keys (flash-decoding): a step has few query rows (tokens x the
// heads of a group), so a block per KV head would leave most of the GPU idle while one
// multiprocessor streams the head's whole cache. Instead a block per (KV head, split of the keys):
// each computes its rows' partial output and LSE over its keys into a fixed buffer, and
// k_fdec_merge combines the splits by their LSE (kvr_lse_weight, as MERGE_ATTN does). In a block,
// 8 warps; keys come in sub-tiles of 32 (F16, shared memory, rows padded by 2 halves against bank
// conflicts); lane j scores key j of the sub-tile against the row's query (in shared memory),
// the warp folds the 32 scores into its rows' running max and sum (kvr_softmax_step), and lane l
// keeps output dims l, l+32, ... of each of its rows. Up to CU_FD_ROWS rows (a warp keeps
// CU_FD_RPW); more go to k_fattn. kvr_cuda_fdec_emulate runs it on the host.
#define CU_FD_WARPS 8
#define CU_FD_RPW   2
#define CU_FD_ROWS  (CU_FD_WARPS * CU_FD_RPW)
#define CU_FD_KT    32
#define CU_FD_SPLIT_MIN 256                   // keys a split takes at least
#define CU_FD_MAX_SPLITS 64
#define CU_FD_BYTES ((size_t)8 << 20)         // the partial results' buffer

// How many splits a decode ATTN gets (0: not this kernel): a split per CU_FD_SPLIT_MIN keys, at
// most CU_FD_MAX_SPLITS and what the buffer holds ([split][row][D + 1] floats per KV head).
static __host__ __device__ inline int cu_fd_splits(int D, int H, int Hkv, int64_t Tq, int64_t Tk) {
    const int64_t rows = Tq * (H / Hkv);
    if (rows > CU_FD_ROWS || Tk < 2 * CU_FD_SPLIT_MIN) return 0;
    int64_t n = (Tk + CU_FD_SPLIT_MIN - 1) / CU_FD_SPLIT_MIN;
    if (n > CU_FD_MAX_SPLITS) n = CU_FD_MAX_SPLITS;
    const int64_t fit = (int64_t)(CU_FD_BYTES / ((size_t)Hkv * (size_t)rows * (size_t)(D + 1) * sizeof(float)));
    if (n > fit) n = fit;
    return n >= 2 ? (int)n : 0;
}

// the keys of split s of n: [*j0, *j1), a whole number of sub-tiles each but the last
static __host__ __device__ inline void cu_fd_split(int64_t Tk, int n, int s, int64_t * j0, int64_t * j1) {
    const int64_t per = ((Tk + n - 1) / n + CU_FD_KT - 1) / CU_FD_KT * CU_FD_KT;
    *j0 = s * per < Tk ? s * per : Tk;
    *j1 = *j0 + per < Tk ? *j0 + per : Tk;
}

template <int D>
static __global__ void __launch_bounds__(CU_FD_WARPS * 32) k_fdec(cu_fattn_args p, int n_split, float * part) {
    constexpr int ND = D / 32 > 0 ? (D + 31) / 32 : 1, DP = D + 2;
    __shared__ __half Ks[CU_FD_KT * DP], Vs[CU_FD_KT * DP];
    __shared__ float qs[CU_FD_WARPS][D];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int G = p.H / p.Hkv, g = blockIdx.x % p.Hkv, s = blockIdx.x / p.Hkv;
    const int rows = p.Tq * G;
    int64_t j0, j1;
    cu_fd_split(p.Tk, n_split, s, &j0, &j1);
    float M[CU_FD_RPW], L[CU_FD_RPW], o[CU_FD_RPW][ND];
    for (int k = 0; k < CU_FD_RPW; k++) {
        M[k] = -INFINITY;
        L[k] = 0.0f;
        for (int c = 0; c < ND; c++) o[k][c] = 0.0f;
    }
    for (int64_t t0 = j0; t0 < j1; t0 += CU_FD_KT) {
        const int kt = (int)(t0 + CU_FD_KT <= j1 ? CU_FD_KT : j1 - t0);
        __syncthreads(); // the previous sub-tile is consumed
        for (int e = tid; e < CU_FD_KT * D; e += blockDim.x) {
            const int jj = e / D, d = e % D;
            __half kh = __float2half_rn(0.0f), vh = kh;
            if (jj < kt) {
                kh = ((const __half *)(p.k + g * p.k_nb1 + (t0 + jj) * p.k_nb2))[d];
                vh = ((const __half *)(p.v + g * p.v_nb1 + (t0 + jj) * p.v_nb2))[d];
            }
            Ks[jj * DP + d] = kh;
            Vs[jj * DP + d] = vh;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < CU_FD_RPW; k++) {
            const int row = warp + k * CU_FD_WARPS;
            if (row >= rows) break; // the whole warp alike
            const int64_t i = row / G;
            const int h = g * G + row % G;
            const float * qrow = (const float *)(p.q + h * p.q_nb1 + i * p.q_nb2);
            for (int d = lane; d < D; d += 32) qs[warp][d] = qrow[d];
            __syncwarp();
            const int32_t qp = p.qpos[i];
            float sc = -INFINITY;
            if (lane < kt && kvr_attn_visible(qp, p.kpos[t0 + lane], p.window)) {
                float acc = 0.0f;
                for (int d = 0; d < D; d++) acc += qs[warp][d] * __half2float(Ks[lane * DP + d]);
                sc = acc * p.scale;
            }
            __syncwarp(); // qs is rewritten for the next row
            const float mx = warp_max(sc);
            if (mx == -INFINITY) continue;
            const float m_new = kvr_softmax_max(M[k], mx);
            const float pj = sc == -INFINITY ? 0.0f : expf(sc - m_new);
            const float corr = kvr_softmax_step(&M[k], &L[k], m_new, warp_sum(pj));
            for (int c = 0; c < ND; c++) o[k][c] *= corr;
            for (int jj = 0; jj < kt; jj++) {
                const float w = __shfl_sync(0xffffffffu, pj, jj);
                for (int c = 0; c < ND; c++) {
                    const int d = lane + 32 * c;
                    if (d < D) o[k][c] += w * __half2float(Vs[jj * DP + d]);
                }
            }
        }
    }
    // this split's part of each row: O / l and the LSE, [split][KV head][row][D + 1]
#pragma unroll
    for (int k = 0; k < CU_FD_RPW; k++) {
        const int row = warp + k * CU_FD_WARPS;
        if (row >= rows) break;
        float inv, lse;
        kvr_softmax_finish(M[k], L[k], &inv, &lse);
        float * dst = part + (((int64_t)s * p.Hkv + g) * rows + row) * (D + 1);
        for (int c = 0; c < ND; c++) {
            const int d = lane + 32 * c;
            if (d < D) dst[d] = o[k][c] * inv;
        }
        if (lane == 0) dst[D] = lse;
    }
}

// The splits merged: a block per (KV head, row), a thread per output element and the LSE.
static __global__ void k_fdec_merge(cu_fattn_args p, int D, int n_split, const float * part) {
    const int G = p.H / p.Hkv, rows = p.Tq * G;
    const int g = blockIdx.x % p.Hkv, row = blockIdx.x / p.Hkv;
    const int64_t i = row / G;
    const int h = g * G + row % G;
    float * out = (float *)(p.out + i * p.out_nb1);
    for (int e = threadIdx.x; e <= D; e += blockDim.x) {
        float m = -INFINITY;
        for (int s = 0; s < n_split; s++) m = fmaxf(m, part[(((int64_t)s * p.Hkv + g) * rows + row) * (D + 1) + D]);
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < n_split && m != -INFINITY; s++) {
            const float * pr = part + (((int64_t)s * p.Hkv + g) * rows + row) * (D + 1);
            const float w = kvr_lse_weight(pr[D], m);
            sum += w;
            if (e < D && w != 0.0f) acc += w * pr[e];
        }
        if (e < D) out[h * D + e] = m == -INFINITY ? 0.0f : acc * (1.0f / sum);
        else out[D * p.H + h] = m == -INFINITY ? -INFINITY : kvr_lse_merged(m, sum);
    }
}

// k_fdec and k_fdec_merge on the host (tests/test-cuda-host.cu): the same splits and sub-tiles,
// a warp's lanes as loops; layouts as kvr_cuda_fattn_emulate's. n_split: cu_fd_splits' choice
// (returned; 0: the kernel would not take this shape, out untouched).
int kvr_cuda_fdec_emulate(int D, const float * q, const uint16_t * k, const uint16_t * v, const int32_t * qpos,
                          const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int64_t window, float scale, float * out) {
    const int n = cu_fd_splits(D, H, Hkv, Tq, Tk);
    if (n == 0) return 0;
    const int G = H / Hkv, rows = Tq * G;
    float * part = (float *)malloc(sizeof(float) * (size_t)n * (size_t)Hkv * (size_t)rows * (size_t)(D + 1));
    KVR_ASSERT(part != NULL);
    for (int s = 0; s < n; s++) {
        int64_t j0, j1;
        cu_fd_split(Tk, n, s, &j0, &j1);
        for (int g = 0; g < Hkv; g++) {
            for (int row = 0; row < rows; row++) {
                const int64_t i = row / G;
                const int h = g * G + row % G;
                float M = -INFINITY, L = 0.0f, o[256] = { 0 };
                for (int64_t t0 = j0; t0 < j1; t0 += CU_FD_KT) {
                    const int kt = (int)(t0 + CU_FD_KT <= j1 ? CU_FD_KT : j1 - t0);
                    float sc[CU_FD_KT], mx = -INFINITY;
                    for (int l = 0; l < CU_FD_KT; l++) {
                        sc[l] = -INFINITY;
                        if (l < kt && kvr_attn_visible(qpos[i], kpos[t0 + l], window)) {
                            float acc = 0.0f;
                            for (int d = 0; d < D; d++) acc += q[(i * H + h) * D + d] * kvr_half_to_f32(k[((t0 + l) * Hkv + g) * D + d]);
                            sc[l] = acc * scale;
                        }
                        mx = sc[l] > mx ? sc[l] : mx;
                    }
                    if (mx == -INFINITY) continue;
                    const float m_new = kvr_softmax_max(M, mx);
                    float pj[CU_FD_KT], sum[CU_FD_KT];
                    for (int l = 0; l < CU_FD_KT; l++) sum[l] = pj[l] = sc[l] == -INFINITY ? 0.0f : expf(sc[l] - m_new);
                    for (int off = 16; off > 0; off >>= 1) { // warp_sum's butterfly
                        float nv[CU_FD_KT];
                        for (int l = 0; l < CU_FD_KT; l++) nv[l] = sum[l] + sum[l ^ off];
                        memcpy(sum, nv, sizeof(sum));
                    }
                    const float corr = kvr_softmax_step(&M, &L, m_new, sum[0]);
                    for (int d = 0; d < D; d++) {
                        o[d] *= corr;
                        for (int jj = 0; jj < kt; jj++) o[d] += pj[jj] * kvr_half_to_f32(v[((t0 + jj) * Hkv + g) * D + d]);
                    }
                }
                float inv, lse;
                kvr_softmax_finish(M, L, &inv, &lse);
                float * dst = part + (((int64_t)s * Hkv + g) * rows + row) * (D + 1);
                for (int d = 0; d < D; d++) dst[d] = o[d] * inv;
                dst[D] = lse;
            }
        }
    }
    for (int g = 0; g < Hkv; g++) {
        for (int row = 0; row < rows; row++) {
            const int64_t i = row / G;
            const int h = g * G + row % G;
            float * o = out + i * (int64_t)(H * D + H);
            for (int e = 0; e <= D; e++) {
                float m = -INFINITY;
                for (int s = 0; s < n; s++) m = fmaxf(m, part[(((int64_t)s * Hkv + g) * rows + row) * (D + 1) + D]);
                float sum = 0.0f, acc = 0.0f;
                for (int s = 0; s < n && m != -INFINITY; s++) {
                    const float * pr = part + (((int64_t)s * Hkv + g) * rows + row) * (D + 1);
                    const float w = kvr_lse_weight(pr[D], m);
                    sum += w;
                    if (e < D && w != 0.0f) acc += w * pr[e];
                }
                if (e < D) o[h * D + e] = m == -INFINITY ? 0.0f : acc * (1.0f / sum);
                else o[D * H + h] = m == -INFINITY ? -INFINITY : kvr_lse_merged(m, sum);
            }
        }
    }
    free(part);
    return n;
}

// The splits of Tk keys into n: every key in exactly one, in order (tests/test-cuda-host.cu).
void kvr_cuda_fdec_split(int64_t Tk, int n, int s, int64_t * j0, int64_t * j1) {
    cu_fd_split(Tk, n, s, j0, j1);
}

// MERGE_ATTN: a block per query row; a thread per output element, then one per head's LSE
struct cu_merge_args {
    const char * part[KVR_MAX_SRC];
    int64_t part_nb1[KVR_MAX_SRC];
    char * out;
    int64_t out_nb1;
    int n, H, D;
    const float * sink;           // per-head sink logits, added once to the merged result (NULL: none)
};

static __global__ void k_merge_attn(cu_merge_args p) {
    const int64_t r = blockIdx.x;
    float * out = (float *)(p.out + r * p.out_nb1);
    const int HD = p.H * p.D;
    for (int e = threadIdx.x; e < HD + p.H; e += blockDim.x) {
        const int h = e < HD ? e / p.D : e - HD;
        float m = -INFINITY;
        for (int i = 0; i < p.n; i++) m = fmaxf(m, ((const float *)(p.part[i] + r * p.part_nb1[i]))[HD + h]);
        if (m == -INFINITY) {
            out[e] = e < HD ? 0.0f : p.sink ? p.sink[h] : -INFINITY;
            continue;
        }
        if (p.sink) m = fmaxf(m, p.sink[h]);
        float sum = p.sink ? kvr_lse_weight(p.sink[h], m) : 0.0f, acc = 0.0f;
        for (int i = 0; i < p.n; i++) {
            const float * part = (const float *)(p.part[i] + r * p.part_nb1[i]);
            const float w = kvr_lse_weight(part[HD + h], m);
            sum += w;
            if (e < HD && w != 0.0f) acc += w * part[e];
        }
        out[e] = e < HD ? acc * (1.0f / sum) : kvr_lse_merged(m, sum);
    }
}

// MOE_ROUTE: a thread per token, the CPU's rules (kvr_moe_route): softmax then the top k (weights
// renormalised for KVR_MOE_SOFTMAX_TOPK_NORM), or the top k logits then their softmax
static __global__ void k_moe_route(cu_tensor a, cu_tensor d, int k, int gating) {
    const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= a.ne[1]) return;
    const int64_t E = a.ne[0];
    const float * x = (const float *)(a.data + t * a.nb[1]);
    float * w = (float *)(d.data + t * d.nb[1]), * ids = w + k;
    float mx = -INFINITY, inv = 1.0f;
    if (gating != KVR_MOE_TOPK_SOFTMAX) {
        for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, x[e]);
        double sum = 0.0;
        for (int64_t e = 0; e < E; e++) sum += (double)expf(x[e] - mx);
        inv = (float)(1.0 / sum);
    }
    for (int j = 0; j < k; j++) {
        int64_t best = -1;
        float best_v = -INFINITY;
        for (int64_t e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j && !taken; i++) taken = (int64_t)ids[i] == e;
            if (taken) continue;
            const float v = gating == KVR_MOE_TOPK_SOFTMAX ? x[e] : expf(x[e] - mx) * inv;
            if (best < 0 || v > best_v) { best = e; best_v = v; }
        }
        ids[j] = (float)best;
        w[j] = best_v;
    }
    if (gating == KVR_MOE_TOPK_SOFTMAX) {
        float m = -INFINITY;
        for (int j = 0; j < k; j++) m = fmaxf(m, w[j]);
        double sum = 0.0;
        for (int j = 0; j < k; j++) { w[j] = expf(w[j] - m); sum += w[j]; }
        const float is = (float)(1.0 / sum);
        for (int j = 0; j < k; j++) w[j] *= is;
    } else if (gating == KVR_MOE_SOFTMAX_TOPK_NORM) {
        double sum = 0.0;
        for (int j = 0; j < k; j++) sum += w[j];
        const float s = fmaxf((float)sum, 6.103515625e-5f);
        for (int j = 0; j < k; j++) w[j] /= s;
    }
}

// MUL_MAT_ID: a block per (token, expert slot) and CU_DOT_WARPS output rows (blockIdx.x the slot,
// blockIdx.y the rows: a decode step's few slots still fill the GPU), a warp per row reading it as
// k_dot8 does (cu_dot8_lane: 8 weights a lane in registers, the arithmetic test-cuda-host emulates);
// only the picked experts' rows are read.
template <int TYPE>
static __global__ void __launch_bounds__(CU_DOT_WARPS * 32) k_mul_mat_id(cu_tensor w, cu_tensor x, cu_tensor route,
                                                                        const char * b, int64_t b_nb1, cu_tensor d) {
    const int64_t k = d.ne[1], T = d.ne[2], K = w.ne[0], N = w.ne[1];
    const int64_t t = blockIdx.x / k, j = blockIdx.x % k;
    const int64_t n = blockIdx.y * (int64_t)CU_DOT_WARPS + threadIdx.x / 32;
    if (n >= N) return; // a whole warp leaves
    const int64_t e = (int64_t)((const float *)(route.data + t * route.nb[1]))[route.ne[0] / 2 + j];
    const bool shared = x.ne[2] == 1 && x.ne[1] == T;
    const float * xr = (const float *)(x.data + (shared ? t * x.nb[1] : j * x.nb[1] + t * x.nb[2]));
    float * y = (float *)(d.data + j * d.nb[1] + t * d.nb[2]);
    const int lane = threadIdx.x % 32;
    float acc[CU_DOT_MAX_T];
    cu_dot8_lane<TYPE>(w.data + e * w.nb[2] + n * w.nb[1], K, xr, 0, 1, false, false, lane, acc);
    const float s = warp_sum(acc[0]);
    if (lane == 0) y[n] = b ? s + ((const float *)(b + e * b_nb1))[n] : s;
}

// MUL_MAT_ID over a prompt: the (token, expert) slots sorted by expert (order[r] = t * k + j,
// experts ascending, slots ascending within one: kvr_cuda_moe_group on the host), so that each
// picked expert's matrix is read once for all its slots, in one cuBLAS product. k_moe_gather puts
// the slots' rows of x in that order, k_moe_scatter puts the products (+ bias) where each slot's
// output goes. cu_moe_x_offset is the byte offset of slot (t, j)'s row of x: x [K, T] shared by a
// token's experts, or [K, k, T].
static __host__ __device__ inline int64_t cu_moe_x_offset(const int64_t ne[4], const int64_t nb[4], int64_t T, int64_t t,
                                                          int64_t j) {
    return ne[2] == 1 && ne[1] == T ? t * nb[1] : j * nb[1] + t * nb[2];
}

static __global__ void k_moe_gather(cu_tensor x, int64_t k, int64_t T, const int32_t * order, int64_t slots, float * xg) {
    const int64_t r = blockIdx.x, K = x.ne[0];
    if (r >= slots) return;
    const int64_t s = order[r];
    const float * src = (const float *)(x.data + cu_moe_x_offset(x.ne, x.nb, T, s / k, s % k));
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x) xg[r * K + i] = src[i];
}

static __global__ void k_moe_scatter(const float * yg, const int32_t * order, const int32_t * expert, int64_t slots,
                                     const char * b, int64_t b_nb1, cu_tensor d) {
    const int64_t r = blockIdx.x, k = d.ne[1], N = d.ne[0];
    if (r >= slots) return;
    const int64_t s = order[r], t = s / k, j = s % k;
    float * y = (float *)(d.data + j * d.nb[1] + t * d.nb[2]);
    const float * bias = b ? (const float *)(b + expert[r] * b_nb1) : NULL;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) y[n] = bias ? yg[r * N + n] + bias[n] : yg[r * N + n];
}

// The slots of a route (T tokens, k picks each; route rows of ld floats: k weights, then k expert ids)
// sorted by expert: order[r] the slot t * k + j, offsets[e] .. offsets[e + 1] expert e's run in it,
// expert[r] the expert of order[r]. A stable counting sort: within an expert, slots ascending.
// Returns KVR_ERR_ARG naming the slot when an id is not an expert of E.
int kvr_cuda_moe_group(const float * route, int64_t ld, int64_t T, int64_t k, int64_t E, int32_t * order, int32_t * expert,
                       int64_t * offsets) {
    for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < k; j++) {
            const float id = route[t * ld + k + j];
            if (!(id >= 0.0f && id < (float)E) || id != (float)(int64_t)id)
                return kvr_error(KVR_ERR_ARG, "MUL_MAT_ID: token %lld's expert %lld is %g, not one of %lld experts", (long long)t,
                                 (long long)j, (double)id, (long long)E);
            offsets[(int64_t)id + 1]++;
        }
    }
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int64_t * next = (int64_t *)malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t));
    if (!next) return kvr_error(KVR_ERR_NOMEM, "MUL_MAT_ID: %lld experts' counters", (long long)E);
    for (int64_t e = 0; e < E; e++) next[e] = offsets[e];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = (int64_t)route[t * ld + k + j], r = next[e]++;
            order[r] = (int32_t)(t * k + j);
            expert[r] = (int32_t)e;
        }
    }
    free(next);
    return KVR_OK;
}

// MUL_MAT_ID over slots with the grouped kernels' index arithmetic, run on the host with plain f32
// dot products: y [N, k, T] from w [K, N, E] (f32), x as the op takes it, route [2k, T]. What
// tests/test-cuda-host.cu compares with every slot computed on its own.
int kvr_cuda_moe_grouped_emulate(const float * w, int64_t K, int64_t N, int64_t E, const float * x, const int64_t x_ne[4],
                                 const int64_t x_nb[4], const float * route, int64_t k, int64_t T, const float * bias,
                                 float * y) {
    const int64_t slots = k * T;
    int32_t * order = (int32_t *)malloc((size_t)slots * sizeof(int32_t));
    int32_t * expert = (int32_t *)malloc((size_t)slots * sizeof(int32_t));
    int64_t * offsets = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t));
    float * xg = (float *)malloc((size_t)(slots * K) * sizeof(float));
    float * yg = (float *)malloc((size_t)(slots * N) * sizeof(float));
    int rc = order && expert && offsets && xg && yg ? KVR_OK : kvr_error(KVR_ERR_NOMEM, "MUL_MAT_ID emulation");
    if (rc == KVR_OK) rc = kvr_cuda_moe_group(route, 2 * k, T, k, E, order, expert, offsets);
    if (rc == KVR_OK) {
        for (int64_t r = 0; r < slots; r++) { // k_moe_gather
            const int64_t s = order[r];
            memcpy(xg + r * K, (const char *)x + cu_moe_x_offset(x_ne, x_nb, T, s / k, s % k), (size_t)K * sizeof(float));
        }
        for (int64_t e = 0; e < E; e++) { // the product of expert e's run
            for (int64_t r = offsets[e]; r < offsets[e + 1]; r++) {
                for (int64_t n = 0; n < N; n++) {
                    float acc = 0.0f;
                    for (int64_t i = 0; i < K; i++) acc += w[(e * N + n) * K + i] * xg[r * K + i];
                    yg[r * N + n] = acc;
                }
            }
        }
        for (int64_t r = 0; r < slots; r++) { // k_moe_scatter
            const int64_t s = order[r], t = s / k, j = s % k;
            for (int64_t n = 0; n < N; n++) y[(t * k + j) * N + n] = yg[r * N + n] + (bias ? bias[expert[r] * N + n] : 0.0f);
        }
    }
    free(order); free(expert); free(offsets); free(xg); free(yg);
    return rc;
}

// MOE_SUM: a block per token; each product rounded, then added in order of the slots (the CPU's)
static __global__ void k_moe_sum(cu_tensor y, cu_tensor route, cu_tensor d) {
    const int64_t t = blockIdx.x, k = y.ne[1];
    const float * w = (const float *)(route.data + t * route.nb[1]);
    float * out = (float *)(d.data + t * d.nb[1]);
    for (int64_t n = threadIdx.x; n < y.ne[0]; n += blockDim.x) {
        float acc = __fmul_rn(((const float *)(y.data + t * y.nb[2]))[n], w[0]);
        for (int64_t j = 1; j < k; j++) acc = __fadd_rn(acc, __fmul_rn(((const float *)(y.data + j * y.nb[1] + t * y.nb[2]))[n], w[j]));
        out[n] = acc;
    }
}

// SWIGLU_OAI: a thread per element (gate and up contiguous)
static __global__ void k_swiglu_oai(const float * g, const float * u, float * y, int64_t n, float alpha, float limit) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float a = fminf(g[i], limit), c = fminf(fmaxf(u[i], -limit), limit);
    y[i] = a / (1.0f + expf(alpha * (-a))) * (c + 1.0f);
}

//
// launchers: one per op, each checks its launch; `node` is the tensor computed
//

static unsigned cu_blocks(int64_t n, int threads) {
    return (unsigned)((n + threads - 1) / threads);
}

static int cu_threads_for(int64_t n) { // threads per row: enough for the row, a warp at least
    return n >= 256 ? 256 : n > 32 ? (int)((n + 31) / 32 * 32) : 32;
}

static int op_get_rows(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0], * ids = node->src[1];
    const int64_t T = ids->ne[0];
    if (T == 0) return KVR_OK;
    const int threads = 64;
    switch (a->type) {
#define CU_CASE(TYPE) case TYPE: \
        k_get_rows<TYPE><<<(unsigned)T, threads, 0, cb->compute>>>((const char *)a->data, (int64_t)a->nb[1], a->ne[0], \
            a->ne[1], (const int32_t *)ids->data, (char *)node->data, (int64_t)node->nb[1], cb->dcount + 2); break;
        CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
        default:
            return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: GET_ROWS of type %s (tensor '%s')", cb->device,
                             kvr_type_name(a->type), node->name);
    }
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_binary(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0], * b = node->src[1];
    const int64_t rows = kvr_nrows(a);
    if (rows == 0) return KVR_OK;
    const bool scalar = b->ne[0] != a->ne[0]; // one value a row (kvr_mul's third form)
    k_binary<<<(unsigned)rows, cu_threads_for(a->ne[0]), 0, cb->compute>>>(node->op, cu_t(a), cu_t(b), cu_t(node),
                                                                            kvr_nrows(b) == 1 && !scalar, scalar);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_unary(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0];
    const int64_t rows = kvr_nrows(a);
    if (rows == 0) return KVR_OK;
    float s;
    memcpy(&s, &node->op_params[0], sizeof(s));
    const int exact = node->op == KVR_OP_GELU && node->op_params[0];
    k_unary<<<(unsigned)rows, cu_threads_for(a->ne[0]), 0, cb->compute>>>(node->op, exact, cu_t(a), cu_t(node), s, cb->gelu_table);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_ssm_conv(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * x = node->src[0], * w = node->src[1];
    if (x->ne[1] == 0 || x->ne[0] == 0) return KVR_OK;
    k_ssm_conv<<<cu_blocks(x->ne[0], 128), 128, 0, cb->compute>>>(cu_t(x), (const float *)w->data, (int)w->ne[0],
        (float *)node->src[2]->data, node->op_params[0], cu_t(node));
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_gdn(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * q = node->src[0], * v = node->src[2];
    if (v->ne[1] == 0) return KVR_OK;
    float eps;
    memcpy(&eps, &node->op_params[1], sizeof(eps));
    k_gdn<<<(unsigned)v->ne[1], cu_threads_for(v->ne[0]), 2 * (size_t)q->ne[0] * sizeof(float), cb->compute>>>(
        cu_t(q), cu_t(node->src[1]), cu_t(v), cu_t(node->src[3]), cu_t(node->src[4]), (float *)node->src[5]->data,
        node->op_params[0], eps, cu_t(node));
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_norm(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0];
    const int64_t rows = kvr_nrows(a);
    if (rows == 0) return KVR_OK;
    float eps;
    memcpy(&eps, &node->op_params[0], sizeof(eps));
    k_norm<<<(unsigned)rows, CU_NORM_THREADS, 0, cb->compute>>>(node->op == KVR_OP_RMS_NORM, cu_t(a), cu_t(node), eps);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_rope(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0], * pos = node->src[1];
    const int n_rot = node->op_params[0], mode = node->op_params[1];
    float freq_base, freq_scale, yarn[4];
    memcpy(&freq_base, &node->op_params[2], sizeof(float));
    memcpy(&freq_scale, &node->op_params[3], sizeof(float));
    memcpy(yarn, &node->op_params[4], sizeof(yarn)); // ext_factor, attn_factor, corr_lo, corr_hi
    const int64_t n = a->ne[1] * a->ne[2];
    if (n == 0) return KVR_OK;
    // theta_scale on the host, with the CPU's powf: every angle then starts from the same bits
    const float * freqs = node->src[2] ? (const float *)node->src[2]->data : NULL; // per-pair divisors
    k_rope<<<(unsigned)n, cu_threads_for(a->ne[0] / 2), 0, cb->compute>>>(cu_t(a), cu_t(node), (const int32_t *)pos->data,
        freqs, n_rot, mode, kvr_rope_theta_scale(freq_base, n_rot), freq_scale, yarn[0], yarn[1], yarn[2], yarn[3]);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_cpy(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0];
    const int64_t rows = kvr_nrows(a);
    if (rows == 0) return KVR_OK;
    k_cpy<<<(unsigned)rows, cu_threads_for(a->ne[0]), 0, cb->compute>>>(cu_t(a), cu_t(node), node->ne[0] == a->ne[0],
                                                                         (int)node->type);
    CU_LAUNCHED();
    return KVR_OK;
}

// Y [N, T] = W [K, N]^T X [K, T] in cuBLAS's column-major terms: W's rows are columns of K, so
// Y (N x T, ldc N) = op_T(W) (N x K) * X (K x T), accumulated in f32.
static int mm_gemm(struct cu_backend * cb, struct kvr_tensor * node, int64_t N, int64_t T, int64_t K,
                   const void * W, cudaDataType wt, int64_t ldw, const void * X, cudaDataType xt, int64_t ldx, float * Y,
                   int64_t ldy) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)T, (int)K, &one, W, wt, (int)ldw, X, xt,
                        (int)ldx, &zero, Y, CUDA_R_32F, (int)ldy,
                        cb->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return KVR_OK;
}

// Y [N, T] (ldy) = W . X for N weight rows of `type` nb1 bytes apart and X [K, T] (ldx): F32 rows
// straight to cuBLAS; others expanded into F32 CU_W32_TILE bytes of rows at a time, one cuBLAS f32
// product per tile (a prompt's MUL_MAT, each picked expert of a prompt's MUL_MAT_ID)
static int mm_expand_gemm(struct cu_backend * cb, struct kvr_tensor * node, enum kvr_type type, const char * Wd, int64_t nb1,
                          int64_t K, int64_t N, int64_t T, const float * X, int64_t ldx, float * Y, int64_t ldy) {
    if (type == KVR_TYPE_F32) return mm_gemm(cb, node, N, T, K, Wd, CUDA_R_32F, nb1 / 4, X, CUDA_R_32F, ldx, Y, ldy);
    int64_t tile = (int64_t)(CU_W32_TILE / ((size_t)K * 4));
    if (tile < 1) tile = 1;
    if (tile > N) tile = N;
    CU_TRY(scratch(cb, &cb->w32, &cb->w32_bytes, (size_t)(tile * K) * 4, node));
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int64_t rows = n0 + tile <= N ? tile : N - n0;
        const char * W = Wd + n0 * nb1;
        const int64_t ng = rows * ((K + 7) / 8);
        switch (type) {
#define CU_CASE(TYPE) case TYPE: \
            k_dequant_f32<TYPE><<<cu_blocks(ng, 128), 128, 0, cb->compute>>>(W, nb1, K, rows, (float *)cb->w32); break;
            CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            default:
                return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: %s with weights of type %s (tensor '%s')", cb->device,
                                 kvr_op_name((enum kvr_op)node->op), kvr_type_name(type), node->name);
        }
        CU_LAUNCHED();
        CU_TRY(mm_gemm(cb, node, rows, T, K, cb->w32, CUDA_R_32F, K, X, CUDA_R_32F, ldx, Y + n0, ldy));
    }
    return KVR_OK;
}

static int op_mul_mat(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * w = node->src[0], * x = node->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], T = x->ne[1] * x->ne[2] * x->ne[3];
    const int64_t ldx = (int64_t)(x->nb[1] / sizeof(float));
    const float * X = (const float *)x->data;
    float * Y = (float *)node->data;
    if (T == 0 || N == 0) return KVR_OK;
    cb->counters.matmul_flops += 2 * K * N * T;
    if (w->type != KVR_TYPE_F32 && T <= CU_DOT_MAX_T) { // decode: no tile, the weights read once
        const bool x_vec = ((uintptr_t)X % 16 == 0) && ldx % 4 == 0;
        const bool w_vec = cu_w_vec(w->type, w->data, (int64_t)w->nb[1]);
        switch (w->type) {
#define CU_CASE(TYPE) case TYPE: \
            k_dot8<TYPE><<<cu_blocks(N, CU_DOT_WARPS), 32 * CU_DOT_WARPS, 0, cb->compute>>>((const char *)w->data, \
                (int64_t)w->nb[1], K, N, X, ldx, (int)T, x_vec, w_vec, Y); break;
            CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            default:
                return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT with weights of type %s (tensor '%s')", cb->device,
                                 kvr_type_name(w->type), node->name);
        }
        CU_LAUNCHED();
        return KVR_OK;
    }
    // F32 weights, and prompts: cuBLAS
    return mm_expand_gemm(cb, node, w->type, (const char *)w->data, (int64_t)w->nb[1], K, N, T, X, ldx, Y, N);
}

static int op_moe_route(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0];
    if (a->ne[1] == 0) return KVR_OK;
    k_moe_route<<<cu_blocks(a->ne[1], 64), 64, 0, cb->compute>>>(cu_t(a), cu_t(node), node->op_params[0], node->op_params[1]);
    CU_LAUNCHED();
    return KVR_OK;
}

// MUL_MAT_ID over a prompt (more than CU_DOT_MAX_T tokens): the route comes to the host through a
// pinned staging buffer, the slots are grouped by expert there (kvr_cuda_moe_group), and each picked
// expert's matrix is expanded to F32 tiles once and multiplied by all its slots' rows in one cuBLAS
// product; per slot, a prompt would read an expert's matrix once for every token that picked it.
// Waits on the host: never inside a captured graph (cu_graph_capturable).
static int op_mul_mat_id_grouped(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * w = node->src[0], * x = node->src[1], * route = node->src[2], * b = node->src[3];
    const int64_t K = w->ne[0], N = w->ne[1], E = w->ne[2], k = node->ne[1], T = node->ne[2], slots = k * T;
    const size_t route_bytes = (size_t)route->nb[1] * (size_t)T;
    KVR_ASSERT(route->ne[0] == 2 * k && route->nb[0] == sizeof(float));
    const size_t ids_bytes = 2 * (size_t)slots * sizeof(int32_t);
    // the staging buffer holds the route, then the order and experts on their way back
    if (route_bytes > CU_STAGE_BYTES || ids_bytes > CU_STAGE_BYTES)
        return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT_ID over %lld tokens (tensor '%s'): more slots than a staging buffer holds",
                         cb->device, (long long)T, node->name);
    const size_t host_bytes = ids_bytes + (size_t)(E + 1) * sizeof(int64_t);
    if (host_bytes > cb->moe_host_bytes) {
        void * h = realloc(cb->moe_host, host_bytes);
        if (!h) return kvr_error(KVR_ERR_NOMEM, "cuda:%d: MUL_MAT_ID's slot order (tensor '%s')", cb->device, node->name);
        cb->moe_host = h;
        cb->moe_host_bytes = host_bytes;
        cb->moe_route = NULL;
    }
    int64_t * offsets = (int64_t *)cb->moe_host;
    if (cb->moe_route != route) { // the first of the layer's products: group its slots
        cb->moe_route = NULL;
        int32_t * ids = (int32_t *)(offsets + E + 1);
        CU_TRY(cu_wait(cb, cb->ev_stage[0], "a staging buffer", node));
        CU(cudaMemcpyAsync(cb->stage[0], route->data, route_bytes, cudaMemcpyDeviceToHost, cb->compute));
        CU(cudaEventRecord(cb->ev_stage[0], cb->compute));
        CU_TRY(cu_wait(cb, cb->ev_stage[0], "the experts' route", node));
        CU_TRY(kvr_cuda_moe_group((const float *)cb->stage[0], (int64_t)(route->nb[1] / sizeof(float)), T, k, E, ids, ids + slots,
                                  offsets));
        memcpy(cb->stage[0], ids, ids_bytes);
        CU_TRY(scratch(cb, &cb->moe_ids, &cb->moe_ids_bytes, ids_bytes, node));
        CU(cudaMemcpyAsync(cb->moe_ids, cb->stage[0], ids_bytes, cudaMemcpyHostToDevice, cb->compute));
        CU(cudaEventRecord(cb->ev_stage[0], cb->compute)); // the next user of the buffer waits for this copy
        cb->moe_route = route;
    }
    const int32_t * order = (const int32_t *)cb->moe_ids, * expert = order + slots;
    CU_TRY(scratch(cb, &cb->moe, &cb->moe_bytes, (size_t)slots * (size_t)(K + N) * sizeof(float), node));
    float * xg = (float *)cb->moe, * yg = xg + slots * K;
    k_moe_gather<<<(unsigned)slots, cu_threads_for(K), 0, cb->compute>>>(cu_t(x), k, T, order, slots, xg);
    CU_LAUNCHED();
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], n_e = offsets[e + 1] - offsets[e];
        if (n_e == 0) continue; // an expert no token picked: its matrix is not read
        CU_TRY(mm_expand_gemm(cb, node, w->type, (const char *)w->data + e * (int64_t)w->nb[2], (int64_t)w->nb[1], K, N, n_e,
                              xg + r0 * K, K, yg + r0 * N, N));
    }
    k_moe_scatter<<<(unsigned)slots, cu_threads_for(N), 0, cb->compute>>>(yg, order, expert, slots,
                                                                          b ? (const char *)b->data : NULL,
                                                                          b ? (int64_t)b->nb[1] : 0, cu_t(node));
    CU_LAUNCHED();
    return KVR_OK;
}

// MUL_MAT_ID: a decode step's few slots each read their expert's rows (k_mul_mat_id); a prompt's
// slots go grouped by expert through cuBLAS
static int op_mul_mat_id(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * w = node->src[0], * x = node->src[1], * route = node->src[2], * b = node->src[3];
    const int64_t slots = node->ne[1] * node->ne[2];
    if (slots == 0) return KVR_OK;
    cb->counters.matmul_flops += 2 * w->ne[0] * w->ne[1] * slots;
    if (node->ne[2] > CU_DOT_MAX_T) return op_mul_mat_id_grouped(cb, node);
    const unsigned row_blocks = cu_blocks(w->ne[1], CU_DOT_WARPS);
    if (slots > INT32_MAX || row_blocks > 65535)
        return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT_ID over %lld slots of %lld rows (tensor '%s'): more than one launch holds",
                         cb->device, (long long)slots, (long long)w->ne[1], node->name);
    const dim3 grid((unsigned)slots, row_blocks);
    switch (w->type) {
#define CU_CASE(TYPE) case TYPE: \
        k_mul_mat_id<TYPE><<<grid, 32 * CU_DOT_WARPS, 0, cb->compute>>>(cu_t(w), cu_t(x), cu_t(route), \
            b ? (const char *)b->data : NULL, b ? (int64_t)b->nb[1] : 0, cu_t(node)); break;
        CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
        default:
            return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT_ID with weights of type %s (tensor '%s')", cb->device,
                             kvr_type_name(w->type), node->name);
    }
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_moe_sum(struct cu_backend * cb, struct kvr_tensor * node) {
    if (node->ne[1] == 0) return KVR_OK;
    k_moe_sum<<<(unsigned)node->ne[1], cu_threads_for(node->ne[0]), 0, cb->compute>>>(cu_t(node->src[0]), cu_t(node->src[1]),
                                                                                      cu_t(node));
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_swiglu_oai(struct cu_backend * cb, struct kvr_tensor * node) {
    const int64_t n = kvr_nelements(node);
    if (n == 0) return KVR_OK;
    float alpha, limit;
    memcpy(&alpha, &node->op_params[0], sizeof(float));
    memcpy(&limit, &node->op_params[1], sizeof(float));
    k_swiglu_oai<<<cu_blocks(n, 256), 256, 0, cb->compute>>>((const float *)node->src[0]->data, (const float *)node->src[1]->data,
                                                             (float *)node->data, n, alpha, limit);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_attn(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * q = node->src[0], * k = node->src[1], * v = node->src[2];
    cu_attn_args p;
    p.q = (const char *)q->data; p.k = (const char *)k->data; p.v = (const char *)v->data;
    p.q_nb1 = (int64_t)q->nb[1]; p.q_nb2 = (int64_t)q->nb[2];
    p.k_nb1 = (int64_t)k->nb[1]; p.k_nb2 = (int64_t)k->nb[2];
    p.v_nb1 = (int64_t)v->nb[1]; p.v_nb2 = (int64_t)v->nb[2];
    p.qpos = (const int32_t *)node->src[3]->data;
    p.kpos = (const int32_t *)node->src[4]->data;
    p.out = (char *)node->data;
    p.out_nb1 = (int64_t)node->nb[1];
    p.D = (int)q->ne[0]; p.H = (int)q->ne[1]; p.Hkv = (int)k->ne[1];
    p.Tq = (int)q->ne[2]; p.Tk = (int)k->ne[2];
    p.ktype = (int)k->type; p.vtype = (int)v->type;
    p.mode = node->op_params[0];
    p.window = node->op_params[3];
    memcpy(&p.scale, &node->op_params[2], sizeof(float));
    memcpy(&p.softcap, &node->op_params[4], sizeof(float));
    p.sink = node->src[6] ? (const float *)node->src[6]->data : NULL;
    p.count = cb->dcount;
    if (p.Tq == 0) return KVR_OK;
    const size_t shmem = (size_t)(2 * CU_ATTN_CK * p.D) * sizeof(float);
    k_attn<<<(unsigned)cu_attn_blocks(p.H, p.Hkv, p.Tq), CU_ATTN_WARPS * 32, shmem, cb->compute>>>(p);
    CU_LAUNCHED();
    return KVR_OK;
}

// Whether k_fattn runs this ATTN: F16 K/V rows of 16-byte aligned strides, f32 queries and
// output rows, a head dim it is built for; else k_attn does.
static bool cu_fattn_ok(const struct kvr_tensor * t) {
    const struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2];
    const bool f16 = k->type == KVR_TYPE_F16 && v->type == KVR_TYPE_F16 && k->nb[0] == 2 && v->nb[0] == 2;
    const bool aligned = (k->nb[1] | k->nb[2] | v->nb[1] | v->nb[2]) % 16 == 0 &&
                         ((uintptr_t)k->data | (uintptr_t)v->data) % 16 == 0; // data NULL: checked again at the launch
    // soft-capped scores (gemma2) and sinks (gpt-oss) are k_attn's alone
    float softcap;
    memcpy(&softcap, &t->op_params[4], sizeof(float));
    const bool plain = softcap == 0.0f && !kvr_attn_sinks_of(t);
    return f16 && aligned && plain && q->type == KVR_TYPE_F32 && q->nb[0] == 4 && t->type == KVR_TYPE_F32 &&
           cu_fa_dim((int)q->ne[0]) && k->ne[0] == q->ne[0] && v->ne[0] == q->ne[0] && q->ne[1] % k->ne[1] == 0;
}

static cu_fattn_args cu_fattn_args_of(const struct kvr_tensor * node) {
    const struct kvr_tensor * q = node->src[0], * k = node->src[1], * v = node->src[2];
    cu_fattn_args p;
    p.q = (const char *)q->data; p.k = (const char *)k->data; p.v = (const char *)v->data;
    p.q_nb1 = (int64_t)q->nb[1]; p.q_nb2 = (int64_t)q->nb[2];
    p.k_nb1 = (int64_t)k->nb[1]; p.k_nb2 = (int64_t)k->nb[2];
    p.v_nb1 = (int64_t)v->nb[1]; p.v_nb2 = (int64_t)v->nb[2];
    p.qpos = (const int32_t *)node->src[3]->data;
    p.kpos = (const int32_t *)node->src[4]->data;
    p.out = (char *)node->data;
    p.out_nb1 = (int64_t)node->nb[1];
    p.H = (int)q->ne[1]; p.Hkv = (int)k->ne[1];
    p.Tq = (int)q->ne[2]; p.Tk = (int)k->ne[2];
    p.mode = node->op_params[0];
    p.window = node->op_params[3];
    memcpy(&p.scale, &node->op_params[2], sizeof(float));
    return p;
}

// ATTN with F16 K/V: flash-decoding when a step's few rows would leave the GPU idle, else k_fattn;
// the counters on the CPU's tiles either way
static int op_fattn(struct cu_backend * cb, struct kvr_tensor * node) {
    if (!cu_fattn_ok(node)) { // the dispatch asked before the data was placed: its alignment now
        return kvr_error(KVR_ERR_UNSUPP, "%s: ATTN '%s' has F16 keys or values not 16-byte aligned", cb->name, node->name);
    }
    const cu_fattn_args p = cu_fattn_args_of(node);
    const int D = (int)node->src[0]->ne[0];
    if (p.Tq == 0) return KVR_OK;
    const int64_t BT = kvr_attn_tile_tokens(p.H / p.Hkv);
    const int64_t nq = (p.Tq + BT - 1) / BT, nk = (p.Tk + KVR_ATTN_BK - 1) / KVR_ATTN_BK;
    if (nq * nk > 0) {
        k_attn_count<<<cu_blocks(nq * nk, 128), 128, 0, cb->compute>>>(p.qpos, p.Tq, p.kpos, p.Tk, p.H / p.Hkv, p.mode, p.window,
                                                                       cb->dcount);
        CU_LAUNCHED();
    }
    const int n_split = p.mode == KVR_ATTN_CAUSAL ? cu_fd_splits(D, p.H, p.Hkv, p.Tq, p.Tk) : 0;
    if (n_split > 0) {
        const unsigned blocks = (unsigned)(p.Hkv * n_split);
        switch (D) {
            case 64:  k_fdec<64><<<blocks, CU_FD_WARPS * 32, 0, cb->compute>>>(p, n_split, cb->fd_part); break;
            case 80:  k_fdec<80><<<blocks, CU_FD_WARPS * 32, 0, cb->compute>>>(p, n_split, cb->fd_part); break;
            case 96:  k_fdec<96><<<blocks, CU_FD_WARPS * 32, 0, cb->compute>>>(p, n_split, cb->fd_part); break;
            case 128: k_fdec<128><<<blocks, CU_FD_WARPS * 32, 0, cb->compute>>>(p, n_split, cb->fd_part); break;
            case 256: k_fdec<256><<<blocks, CU_FD_WARPS * 32, 0, cb->compute>>>(p, n_split, cb->fd_part); break;
            default: KVR_ASSERT(!"a head dim cu_fattn_ok refuses");
        }
        CU_LAUNCHED();
        k_fdec_merge<<<(unsigned)(p.Hkv * p.Tq * (p.H / p.Hkv)), 128, 0, cb->compute>>>(p, D, n_split, cb->fd_part);
        CU_LAUNCHED();
        return KVR_OK;
    }
    const unsigned blocks = (unsigned)cu_fa_blocks(p.H, p.Hkv, p.Tq);
    const int threads = CU_FA_WARPS * 32;
    switch (D) {
        case 64:  k_fattn<64><<<blocks, threads, cu_fa_smem(64), cb->compute>>>(p); break;
        case 80:  k_fattn<80><<<blocks, threads, cu_fa_smem(80), cb->compute>>>(p); break;
        case 96:  k_fattn<96><<<blocks, threads, cu_fa_smem(96), cb->compute>>>(p); break;
        case 128: k_fattn<128><<<blocks, threads, cu_fa_smem(128), cb->compute>>>(p); break;
        case 256: k_fattn<256><<<blocks, threads, cu_fa_smem(256), cb->compute>>>(p); break;
        default: KVR_ASSERT(!"a head dim cu_fattn_ok refuses");
    }
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_merge_attn(struct cu_backend * cb, struct kvr_tensor * node) {
    cu_merge_args p;
    memset(&p, 0, sizeof(p));
    p.n = node->op_params[0];
    p.H = node->op_params[1];
    p.D = (int)((node->ne[0] - p.H) / p.H);
    for (int i = 0; i < p.n; i++) {
        p.part[i] = (const char *)node->src[i]->data;
        p.part_nb1[i] = (int64_t)node->src[i]->nb[1];
    }
    p.out = (char *)node->data;
    p.out_nb1 = (int64_t)node->nb[1];
    p.sink = kvr_attn_sinks_of(node) ? (const float *)kvr_attn_sinks_of(node)->data : NULL;
    if (node->ne[1] == 0) return KVR_OK;
    k_merge_attn<<<(unsigned)node->ne[1], 256, 0, cb->compute>>>(p);
    CU_LAUNCHED();
    return KVR_OK;
}

//
// the vtable: memory, tensors in and out, graphs
//

// Work on stream `to` waits for everything queued on `from` so far.
static int cu_order(struct cu_backend * cb, cudaStream_t from, cudaStream_t to, const struct kvr_tensor * node) {
    CU(cudaEventRecord(cb->ev_order, from));
    CU(cudaStreamWaitEvent(to, cb->ev_order, 0));
    return KVR_OK;
}

static const char * cu_name(struct kvr_backend * be) {
    return ((struct cu_backend *)be->context)->name;
}

static int cu_buf_alloc(struct kvr_backend * be, struct kvr_buffer * buf) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    const struct kvr_tensor * node = NULL;
    CU(cudaSetDevice(cb->device));
    void * p = NULL;
    CU_TRY(pool_alloc(cb, buf->size, &p));
    buf->base = p;
    buf->host = false;
    buf->owned = true;
    buf->context = NULL;
    return KVR_OK;
}

// Everything queued on both streams has finished (or the deadline passed).
static int cu_idle(struct cu_backend * cb) {
    const struct kvr_tensor * node = NULL;
    CU(cudaSetDevice(cb->device));
    CU_TRY(cu_order(cb, cb->copy, cb->compute, node));
    CU(cudaEventRecord(cb->ev_done, cb->compute));
    return cu_wait(cb, cb->ev_done, "the queued work", node);
}

static void cu_buf_free(struct kvr_backend * be, struct kvr_buffer * buf) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    const struct kvr_tensor * node = NULL;
    // an upload may still be writing it: the release queues behind the copy stream's work too
    int rc = cudaSetDevice(cb->device) == cudaSuccess ? KVR_OK : cu_fail(cb->device, "cudaSetDevice", cudaGetLastError(), node);
    if (rc == KVR_OK) rc = cu_order(cb, cb->copy, cb->compute, node);
    if (rc == KVR_OK) rc = pool_free(cb, buf->base);
    cu_stick(cb, rc);
    buf->base = NULL;
}

static void cu_buf_clear(struct kvr_backend * be, struct kvr_buffer * buf, uint8_t value) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    const struct kvr_tensor * node = NULL;
    int rc = KVR_OK;
    do {
        if (cudaSetDevice(cb->device) != cudaSuccess) { rc = cu_fail(cb->device, "cudaSetDevice", cudaGetLastError(), node); break; }
        if ((rc = cu_order(cb, cb->copy, cb->compute, node)) != KVR_OK) break;
        const cudaError_t e = cudaMemsetAsync(buf->base, value, buf->size, cb->compute);
        if (e != cudaSuccess) rc = cu_fail(cb->device, "cudaMemsetAsync", e, node);
    } while (0);
    cu_stick(cb, rc);
}

// Host -> device through the two pinned staging buffers: chunk i+1 is copied into one while
// chunk i travels from the other. After it returns, src may be reused: the bytes are staged.
static int cu_upload(struct cu_backend * cb, char * dst, const char * src, size_t n, const struct kvr_tensor * node) {
    CU(cudaSetDevice(cb->device));
    CU_TRY(cu_order(cb, cb->compute, cb->copy, node)); // no graph still reads what is overwritten
    const double t0 = kvr_time_ms();
    double last = t0;
    for (size_t off = 0, i = 0; off < n; off += CU_STAGE_BYTES, i ^= 1) {
        const size_t len = n - off < CU_STAGE_BYTES ? n - off : CU_STAGE_BYTES;
        CU_TRY(cu_wait(cb, cb->ev_stage[i], "an upload to the device", node));
        memcpy(cb->stage[i], src + off, len);
        CU(cudaMemcpyAsync(dst + off, cb->stage[i], len, cudaMemcpyHostToDevice, cb->copy));
        CU(cudaEventRecord(cb->ev_stage[i], cb->copy));
        const double now = kvr_time_ms();
        if (cb->progress && n >= ((size_t)256 << 20) && now - last >= 1000.0) { // large buffers only: the weights
            fprintf(cb->progress, "\r%s: uploading %.0f of %.0f MiB (%.0f MiB/s)", cb->name, (off + len) / 1048576.0,
                    n / 1048576.0, (off + len) / 1048576.0 / ((now - t0) / 1e3));
            fflush(cb->progress);
            last = now;
        }
    }
    if (last != t0) fprintf(cb->progress, "\r%s: uploaded %.0f MiB in %.1f s%20s\n", cb->name, n / 1048576.0,
                            (kvr_time_ms() - t0) / 1e3, "");
    return cu_order(cb, cb->copy, cb->compute, node); // graphs read what was written
}

// Device -> host, the same way round; complete when it returns.
static int cu_download(struct cu_backend * cb, char * dst, const char * src, size_t n, const struct kvr_tensor * node) {
    CU(cudaSetDevice(cb->device));
    CU_TRY(cu_order(cb, cb->compute, cb->copy, node)); // what the graphs wrote
    size_t pending = 0, pending_len = 0; // the chunk in flight in staging buffer pending_i
    int pending_i = -1;
    for (size_t off = 0, i = 0; off < n || pending_i >= 0; off += CU_STAGE_BYTES, i ^= 1) {
        if (off < n) {
            const size_t len = n - off < CU_STAGE_BYTES ? n - off : CU_STAGE_BYTES;
            CU_TRY(cu_wait(cb, cb->ev_stage[i], "a download from the device", node));
            CU(cudaMemcpyAsync(cb->stage[i], src + off, len, cudaMemcpyDeviceToHost, cb->copy));
            CU(cudaEventRecord(cb->ev_stage[i], cb->copy));
        }
        if (pending_i >= 0) {
            CU_TRY(cu_wait(cb, cb->ev_stage[pending_i], "a download from the device", node));
            memcpy(dst + pending, cb->stage[pending_i], pending_len);
            pending_i = -1;
        }
        if (off < n) {
            pending = off;
            pending_len = n - off < CU_STAGE_BYTES ? n - off : CU_STAGE_BYTES;
            pending_i = (int)i;
        }
    }
    return KVR_OK;
}

static int cu_buf_from_host(struct kvr_backend * be, struct kvr_buffer * buf, const void * host) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    CU_TRY(cu_buf_alloc(be, buf));
    const int rc = cu_upload(cb, (char *)buf->base, (const char *)host, buf->size, NULL);
    if (rc != KVR_OK) { // the error of the upload is the one returned; a failing release sticks
        const struct kvr_tensor * node = NULL;
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvr_last_error());
        int rf = cu_order(cb, cb->copy, cb->compute, node);
        if (rf == KVR_OK) rf = pool_free(cb, buf->base);
        cu_stick(cb, rf);
        buf->base = NULL;
        return kvr_error(rc, "%s", msg);
    }
    return rc;
}

static void cu_tensor_set(struct kvr_backend * be, struct kvr_tensor * t, const void * src, size_t off, size_t n) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    if (n) cu_stick(cb, cu_upload(cb, (char *)t->data + off, (const char *)src, n, t));
}

static void cu_tensor_get(struct kvr_backend * be, const struct kvr_tensor * t, void * dst, size_t off, size_t n) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    if (!n) return;
    const int rc = cu_download(cb, (char *)dst, (const char *)t->data + off, n, t);
    if (rc != KVR_OK) memset(dst, 0xff, n); // NaN rather than stale bytes; the error comes next
    cu_stick(cb, rc);
}

static int cu_synchronize(struct kvr_backend * be) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    CU_TRY(cu_idle(cb));
    return cu_unstick(cb);
}

// One switch over every op and type: what this backend runs. Shapes the kernels assume are
// checked here too (a head dimension the attention kernel holds in registers, f32 activations).
static bool cu_supports_op(struct kvr_backend * be, const struct kvr_tensor * t) {
    (void)be;
    const struct kvr_tensor * a = t->src[0];
    switch ((enum kvr_op)t->op) {
        case KVR_OP_NONE:
        case KVR_OP_VIEW:
            return true;
        case KVR_OP_GET_ROWS:
            return cu_type_ok(a->type) && t->src[1]->type == KVR_TYPE_I32 && t->type == KVR_TYPE_F32 &&
                   a->ne[0] % kvr_blck_size(a->type) == 0;
        case KVR_OP_ADD:
        case KVR_OP_MUL:
            return a->type == KVR_TYPE_F32 && t->src[1]->type == KVR_TYPE_F32 && a->nb[0] == 4 &&
                   t->src[1]->nb[0] == 4 && (t->src[1]->ne[0] == a->ne[0] || t->src[1]->ne[0] == 1);
        case KVR_OP_SCALE:
        case KVR_OP_SILU:
        case KVR_OP_GELU:
        case KVR_OP_SOFTCAP:
        case KVR_OP_SIGMOID:
        case KVR_OP_SOFTPLUS:
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4;
        case KVR_OP_SSM_CONV:
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4 && t->src[1]->type == KVR_TYPE_F32 && kvr_is_contiguous(t->src[1]) &&
                   t->src[1]->ne[0] <= KVR_SSM_CONV_MAX_K && kvr_is_contiguous(t->src[2]);
        case KVR_OP_GDN:   // q and k normalised in shared memory: 2 * d_k floats
            return a->ne[0] <= 4096 && kvr_is_contiguous(t->src[5]);
        case KVR_OP_MUL_MAT: {
            const struct kvr_tensor * x = t->src[1];
            if (!cu_type_ok(a->type) || x->type != KVR_TYPE_F32 || a->ne[0] % kvr_blck_size(a->type) != 0) return false;
            // plain weights go to cuBLAS as they lie: rows a whole number of elements apart
            if ((a->type == KVR_TYPE_F32 || a->type == KVR_TYPE_F16 || a->type == KVR_TYPE_BF16) &&
                a->nb[1] % kvr_type_size(a->type) != 0) return false;
            return x->nb[1] % sizeof(float) == 0 && (x->ne[2] == 1 || x->nb[2] == x->nb[1] * (size_t)x->ne[1]) &&
                   (x->ne[3] == 1 || x->nb[3] == x->nb[2] * (size_t)x->ne[2]);
        }
        case KVR_OP_ROPE:
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4 && t->src[1]->type == KVR_TYPE_I32 &&
                   (!t->src[2] || (t->src[2]->type == KVR_TYPE_F32 && kvr_is_contiguous(t->src[2])));
        case KVR_OP_CPY:
        case KVR_OP_KV_STORE:
            if (t->type == KVR_TYPE_BF16 || t->type == KVR_TYPE_Q8_0) { // cache stores: whole rows (blocks)
                return a->type == KVR_TYPE_F32 && a->nb[0] == 4 && t->ne[0] == a->ne[0] && t->nb[0] == kvr_type_size(t->type) &&
                       t->ne[0] % kvr_blck_size(t->type) == 0;
            }
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4 && (t->type == KVR_TYPE_F32 || t->type == KVR_TYPE_F16) &&
                   (t->ne[0] == a->ne[0] ? t->nb[0] == kvr_type_size(t->type) : kvr_is_contiguous(t));
        case KVR_OP_ATTN: {
            const struct kvr_tensor * k = t->src[1], * v = t->src[2];
            const bool kv_ok = (k->type == KVR_TYPE_F32 || k->type == KVR_TYPE_F16 || k->type == KVR_TYPE_BF16 || k->type == KVR_TYPE_Q8_0) &&
                               (v->type == KVR_TYPE_F32 || v->type == KVR_TYPE_F16 || v->type == KVR_TYPE_BF16 || v->type == KVR_TYPE_Q8_0);
            return cu_fattn_ok(t) ||
                   (a->ne[0] <= CU_ATTN_DMAX && kv_ok && k->nb[0] == kvr_type_size(k->type) && v->nb[0] == kvr_type_size(v->type) &&
                    (k->type != KVR_TYPE_Q8_0 || a->ne[0] % 32 == 0) && (v->type != KVR_TYPE_Q8_0 || a->ne[0] % 32 == 0));
        }
        case KVR_OP_MERGE_ATTN:
            return true;
        case KVR_OP_ATTN_STATS:  // the rings' exact F16 rounding: this backend's ATTN rounds its own way, so
        case KVR_OP_ATTN_NORMED: //   the passes keep ATTN + MERGE_ATTN here (kvr-comm.c: ring_exact)
            return false;
        case KVR_OP_MUL_MAT_ID:
            return cu_type_ok(a->type) && t->src[1]->type == KVR_TYPE_F32 && t->src[1]->nb[0] == 4 &&
                   a->ne[0] % kvr_blck_size(a->type) == 0;
        case KVR_OP_MOE_ROUTE:
        case KVR_OP_MOE_SUM:
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4;
        case KVR_OP_SWIGLU_OAI:
            return kvr_is_contiguous(a) && kvr_is_contiguous(t->src[1]);
        case KVR_OP_SEND:        // through kvr_backend_comm_node: staged in host memory by kvr
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
            return true;
        case KVR_OP_ATTN_BLOCK:  // a strategy pass rewrites it; it never reaches a backend
        case KVR_OP_GDN_BLOCK:
        case KVR_OP_COUNT:
            return false;
    }
    return false;
}

static bool node_is_comm(const struct kvr_tensor * t) {
    return t->op == KVR_OP_SEND || t->op == KVR_OP_RECV || t->op == KVR_OP_ALL_GATHER || t->op == KVR_OP_ALL_TO_ALL;
}

// The one dispatch point of this backend.
static int cu_compute_node(struct cu_backend * cb, struct kvr_tensor * t) {
    switch ((enum kvr_op)t->op) {
        case KVR_OP_GET_ROWS:   return op_get_rows(cb, t);
        case KVR_OP_ADD:
        case KVR_OP_MUL:        return op_binary(cb, t);
        case KVR_OP_SCALE:
        case KVR_OP_SILU:
        case KVR_OP_GELU:
        case KVR_OP_SOFTCAP:    return op_unary(cb, t);
        case KVR_OP_SIGMOID:
        case KVR_OP_SOFTPLUS:   return op_unary(cb, t);
        case KVR_OP_SSM_CONV:   return op_ssm_conv(cb, t);
        case KVR_OP_GDN:        return op_gdn(cb, t);
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:       return op_norm(cb, t);
        case KVR_OP_MUL_MAT:    return op_mul_mat(cb, t);
        case KVR_OP_ROPE:       return op_rope(cb, t);
        case KVR_OP_CPY:
        case KVR_OP_KV_STORE:   return op_cpy(cb, t);
        case KVR_OP_ATTN:       return cu_fattn_ok(t) ? op_fattn(cb, t) : op_attn(cb, t);
        case KVR_OP_MERGE_ATTN: return op_merge_attn(cb, t);
        case KVR_OP_MUL_MAT_ID: return op_mul_mat_id(cb, t);
        case KVR_OP_MOE_ROUTE:  return op_moe_route(cb, t);
        case KVR_OP_MOE_SUM:    return op_moe_sum(cb, t);
        case KVR_OP_SWIGLU_OAI: return op_swiglu_oai(cb, t);
        case KVR_OP_NONE:
        case KVR_OP_VIEW:       return KVR_OK;
        case KVR_OP_SEND:       // the graph loop hands these to kvr_backend_comm_node
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
        case KVR_OP_ATTN_STATS: // refused by cu_supports_op
        case KVR_OP_ATTN_NORMED:
        case KVR_OP_ATTN_BLOCK:
        case KVR_OP_GDN_BLOCK:
        case KVR_OP_COUNT:      break;
    }
    return kvr_error(KVR_ERR_UNSUPP, "%s: no kernel for op %s (node '%s')", cb->name, kvr_op_name((enum kvr_op)t->op), t->name);
}

// the layer a node belongs to, from its name ("blk.12.ffn_up"), or -1
static int node_layer(const struct kvr_tensor * t) {
    if (strncmp(t->name, "blk.", 4) != 0) return -1;
    return atoi(t->name + 4);
}

static void cu_span(struct cu_backend * cb, const struct kvr_tensor * t, double t0, double t1) {
    const int il = node_is_comm(t) ? -1 : node_layer(t);
    if (!node_is_comm(t) && il >= 0 && il == cb->span_layer && cb->n_spans > 0 && cb->spans[cb->n_spans - 1].cat == 'l') {
        cb->spans[cb->n_spans - 1].t1 = t1; // extend the open layer span
        return;
    }
    if (cb->n_spans == cb->cap_spans) {
        cb->cap_spans = cb->cap_spans ? 2 * cb->cap_spans : 256;
        cb->spans = (struct kvr_span *)realloc(cb->spans, sizeof(*cb->spans) * (size_t)cb->cap_spans);
        KVR_ASSERT(cb->spans != NULL);
    }
    struct kvr_span * sp = &cb->spans[cb->n_spans++];
    memset(sp, 0, sizeof(*sp));
    sp->t0 = t0;
    sp->t1 = t1;
    sp->cat = node_is_comm(t) ? 'c' : 'l';
    if (node_is_comm(t)) {
        const int tag = t->op_params[1];
        snprintf(sp->name, sizeof(sp->name), "%s %s L%d", kvr_op_name((enum kvr_op)t->op),
                 kvr_tag_kind_name(kvr_tag_kind(tag)), kvr_tag_layer(tag));
    } else if (il >= 0) {
        snprintf(sp->name, sizeof(sp->name), "layer %d", il);
    } else {
        snprintf(sp->name, sizeof(sp->name), "%.40s", t->name[0] ? t->name : kvr_op_name((enum kvr_op)t->op));
    }
    cb->span_layer = node_is_comm(t) ? -1 : il;
}

static int cu_events(struct cu_backend * cb, int n) {
    const struct kvr_tensor * node = NULL;
    if (n <= cb->n_ev_node) return KVR_OK;
    cb->ev_node = (cudaEvent_t *)realloc(cb->ev_node, sizeof(cudaEvent_t) * (size_t)n);
    KVR_ASSERT(cb->ev_node != NULL);
    for (; cb->n_ev_node < n; cb->n_ev_node++) CU(cudaEventCreate(&cb->ev_node[cb->n_ev_node]));
    return KVR_OK;
}

// After a graph: the kernels' counters, and each node's time from the events around it.
static int cu_account(struct cu_backend * cb, struct kvr_graph * g, const double * host_t, double t_start) {
    const struct kvr_tensor * node = NULL;
    if (cb->hcount[2] != 0) {
        return kvr_error(KVR_ERR_ARG, "%s: GET_ROWS met %llu token ids outside the table", cb->name, cb->hcount[2]);
    }
    cb->counters.attn_dot_dense  += (int64_t)cb->hcount[0];
    cb->counters.attn_dot_causal += (int64_t)cb->hcount[1];
    for (int i = 0; i < g->n_nodes && (cb->node_times || cb->trace); i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_NONE || t->op == KVR_OP_VIEW) continue;
        double t0, t1;
        if (node_is_comm(t)) { // a host-side wait: its times are the host's
            t0 = host_t[2 * i];
            t1 = host_t[2 * i + 1];
        } else {
            float a = 0.0f, b = 0.0f;
            CU(cudaEventElapsedTime(&a, cb->ev_node[0], cb->ev_node[i]));
            CU(cudaEventElapsedTime(&b, cb->ev_node[0], cb->ev_node[i + 1]));
            t0 = t_start + a;
            t1 = t_start + b;
        }
        cb->counters.op_ms[t->op] += t1 - t0;
        if (cb->trace) cu_span(cb, t, t0, t1);
    }
    return KVR_OK;
}

// Whether a graph can run as one CUDA graph: no transfer (those wait on the host), no node that
// waits on the host (a prompt's MUL_MAT_ID), and no node that may grow a buffer (a prompt's matmul over weights that are not F32 expands them into a
// scratch tile, and an allocation may not happen inside a capture). Decode steps qualify.
static bool cu_graph_capturable(const struct kvr_graph * g) {
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (node_is_comm(t)) return false;
        if (t->op == KVR_OP_MUL_MAT && t->src[0]->type != KVR_TYPE_F32 &&
            t->src[1]->ne[1] * t->src[1]->ne[2] * t->src[1]->ne[3] > CU_DOT_MAX_T) return false;
        if (t->op == KVR_OP_MUL_MAT_ID && t->ne[2] > CU_DOT_MAX_T) return false; // waits for its route on the host
    }
    return true;
}

// The graph's kernels and cuBLAS calls captured from the compute stream into a CUDA graph, which
// then runs as one launch: the GPU goes from kernel to kernel without a launch gap each (a decode
// step has hundreds of small ones). The instantiated graph is kept and updated in place by the
// next capture when only the kernels' arguments changed (cudaGraphExecUpdate: the next decode
// step, one more key), else made anew. The capture ends on every path, errors included: a stream
// left capturing would refuse all later work.
static int cu_run_captured(struct cu_backend * cb, struct kvr_graph * g) {
    struct kvr_tensor * node = NULL;
    CU_TRY(cu_order(cb, cb->copy, cb->compute, node)); // outside the capture: a plain wait
    CU(cudaStreamBeginCapture(cb->compute, cudaStreamCaptureModeThreadLocal));
    int rc = KVR_OK;
    cudaError_t e = cudaMemsetAsync(cb->dcount, 0, 3 * sizeof(unsigned long long), cb->compute);
    if (e != cudaSuccess) rc = cu_fail(cb->device, "starting a captured graph", e, node);
    for (int i = 0; i < g->n_nodes && rc == KVR_OK; i++) {
        node = g->nodes[i];
        rc = cu_compute_node(cb, node);
    }
    node = NULL;
    if (rc == KVR_OK) {
        e = cudaMemcpyAsync(cb->hcount, cb->dcount, 3 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, cb->compute);
        if (e != cudaSuccess) rc = cu_fail(cb->device, "ending a captured graph", e, node);
    }
    cudaGraph_t cg = NULL;
    e = cudaStreamEndCapture(cb->compute, &cg);
    if (rc == KVR_OK && e != cudaSuccess) rc = cu_fail(cb->device, "cudaStreamEndCapture", e, node);
    if (rc == KVR_OK && cb->replay) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(cb->replay, cg, &info) == cudaSuccess) {
            cb->n_replays++;
        } else { // another topology: made anew below
            cudaGetLastError();
            cudaGraphExecDestroy(cb->replay);
            cb->replay = NULL;
        }
    }
    if (rc == KVR_OK && !cb->replay) {
        e = cudaGraphInstantiate(&cb->replay, cg, 0);
        if (e != cudaSuccess) {
            cb->replay = NULL;
            rc = cu_fail(cb->device, "cudaGraphInstantiate", e, node);
        } else {
            cb->n_instantiated++;
        }
    }
    if (cg) cudaGraphDestroy(cg);
    if (rc != KVR_OK) return rc;
    CU(cudaGraphLaunch(cb->replay, cb->compute));
    CU(cudaEventRecord(cb->ev_done, cb->compute));
    return cu_wait(cb, cb->ev_done, "the graph", node);
}

static int cu_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    struct kvr_tensor * node = NULL;
    CU(cudaSetDevice(cb->device));
    CU_TRY(cu_unstick(cb)); // an upload before this graph failed
    cb->moe_route = NULL;   // a route of an earlier graph: its node and memory are another's now
    // refuse, before anything runs, a graph with a node this backend cannot run or read
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (!cu_supports_op(be, t)) {
            return kvr_error(KVR_ERR_UNSUPP, "%s cannot run op %s of node '%s' (types %s <- %s%s%s)", cb->name,
                             kvr_op_name((enum kvr_op)t->op), t->name, kvr_type_name(t->type),
                             t->src[0] ? kvr_type_name(t->src[0]->type) : "-", t->src[1] ? ", " : "",
                             t->src[1] ? kvr_type_name(t->src[1]->type) : "");
        }
        for (int j = -1; j < KVR_MAX_SRC && !node_is_comm(t); j++) {
            const struct kvr_tensor * s = j < 0 ? t : t->src[j];
            if (s && s->data && (!s->buffer || s->buffer->host)) {
                return kvr_error(KVR_ERR_ARG, "%s: node '%s' (%s) reads '%s', which is in host memory: put it in a "
                                 "buffer of this backend", cb->name, t->name, kvr_op_name((enum kvr_op)t->op), s->name);
            }
        }
    }
    const bool timed = cb->node_times || cb->trace;
    if (!timed && !cb->sync_nodes && cu_graph_capturable(g)) {
        const double t0 = kvr_time_ms();
        int rc = cu_run_captured(cb, g);
        if (rc == KVR_OK) rc = cu_account(cb, g, NULL, t0);
        if (rc == KVR_OK) cb->counters.compute_ms += kvr_time_ms() - t0;
        return rc;
    }
    if (timed) CU_TRY(cu_events(cb, g->n_nodes + 1));
    double * host_t = (double *)calloc((size_t)(2 * g->n_nodes + 1), sizeof(double));
    KVR_ASSERT(host_t != NULL);
    int rc = KVR_OK;
    const double t_start = kvr_time_ms();
    do {
        if ((rc = cu_order(cb, cb->copy, cb->compute, node)) != KVR_OK) break;
        cudaError_t e = cudaMemsetAsync(cb->dcount, 0, 3 * sizeof(unsigned long long), cb->compute);
        if (e == cudaSuccess && timed) e = cudaEventRecord(cb->ev_node[0], cb->compute);
        if (e != cudaSuccess) { rc = cu_fail(cb->device, "starting a graph", e, node); break; }
        for (int i = 0; i < g->n_nodes && rc == KVR_OK; i++) {
            node = g->nodes[i];
            // the session's interrupt: nothing more is queued (what is queued finishes, and the
            // graph's end waits for it as after any error)
            if (kvr_backend_interrupted(be)) { rc = KVR_ERR_INTERRUPTED; break; }
            if (node_is_comm(node)) {
                // everything before it completes, then kvr's comm routine runs it (it stages the
                // data through tensor_get/tensor_set, which order themselves after this stream);
                // a transport that moves device memory itself (NCCL) orders its transfers against
                // this stream by events instead, so the compute queued before keeps running
                const bool device_comm = be->comm && be->comm->device_ptrs;
                if (!device_comm && (e = cudaEventRecord(cb->ev_done, cb->compute)) != cudaSuccess) { rc = cu_fail(cb->device, "cudaEventRecord", e, node); break; }
                if (!device_comm && (rc = cu_wait(cb, cb->ev_done, "the nodes before a transfer", node)) != KVR_OK) break;
                host_t[2 * i] = kvr_time_ms();
                rc = kvr_backend_comm_node(be, node);
                host_t[2 * i + 1] = kvr_time_ms();
                if (rc == KVR_OK) rc = cu_unstick(cb);
                if (rc == KVR_OK) rc = cu_order(cb, cb->copy, cb->compute, node);
            } else {
                rc = cu_compute_node(cb, node);
                if (rc == KVR_OK && cb->sync_nodes) { // debugging: a fault is blamed on its node
                    if ((e = cudaEventRecord(cb->ev_done, cb->compute)) != cudaSuccess) rc = cu_fail(cb->device, "cudaEventRecord", e, node);
                    else rc = cu_wait(cb, cb->ev_done, "a node", node);
                }
            }
            if (rc == KVR_OK && timed && (e = cudaEventRecord(cb->ev_node[i + 1], cb->compute)) != cudaSuccess) {
                rc = cu_fail(cb->device, "cudaEventRecord", e, node);
            }
        }
        if (rc != KVR_OK) break;
        node = NULL;
        e = cudaMemcpyAsync(cb->hcount, cb->dcount, 3 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, cb->compute);
        if (e == cudaSuccess) e = cudaEventRecord(cb->ev_done, cb->compute);
        if (e != cudaSuccess) { rc = cu_fail(cb->device, "ending a graph", e, node); break; }
        if ((rc = cu_wait(cb, cb->ev_done, "the graph", node)) != KVR_OK) break;
        rc = cu_account(cb, g, host_t, t_start);
    } while (0);
    free(host_t);
    if (rc == KVR_OK) cb->counters.compute_ms += kvr_time_ms() - t_start;
    return rc;
}

static void cu_set_trace(struct kvr_backend * be, bool on) {
    ((struct cu_backend *)be->context)->trace = on;
}

static const struct kvr_span * cu_spans(struct kvr_backend * be, int * n, bool reset) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    *n = cb->n_spans;
    if (reset) cb->n_spans = 0; // the memory stays until the next graph records spans
    return cb->spans;
}

static void cu_counters(struct kvr_backend * be, struct kvr_counters * out, bool reset) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    if (out) *out = cb->counters;
    if (reset) memset(&cb->counters, 0, sizeof(cb->counters));
}

static void cu_free(struct kvr_backend * be) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    // what is queued must end before the memory goes, within the deadline; a device that does not
    // get there (a hung kernel or transfer) keeps its memory, handles and streams until the process
    // ends: freeing them would wait for it without one
    bool idle = cb->device >= 0 && cudaSetDevice(cb->device) == cudaSuccess;
    if (idle && cb->compute && cb->copy && cb->ev_order && cb->ev_done) { // else nothing was queued
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvr_last_error()); // a constructor's error stays the last one
        idle = cu_idle(cb) == KVR_OK;
        if (!idle) fprintf(stderr, "%s: freeing the backend: %s (its memory stays until the process ends)\n", cb->name, kvr_last_error());
        kvr_error(KVR_OK, "%s", msg);
    }
    if (idle) {
        // device memory in stream order (no wait for the whole device, NCCL's streams included);
        // the streams are idle, so the pinned buffers' release finds nothing to wait for
        if (cb->replay) cudaGraphExecDestroy(cb->replay);
        if (cb->blas) cublasDestroy(cb->blas); // before its workspace goes
        for (int i = 0; i < cb->n_live; i++) cudaFreeAsync(cb->live[i].ptr, cb->compute);
        for (int i = 0; i < cb->n_cached; i++) cudaFreeAsync(cb->cached[i].ptr, cb->compute);
        for (int i = 0; i < cb->n_ev_node; i++) cudaEventDestroy(cb->ev_node[i]);
        if (cb->ev_order) cudaEventDestroy(cb->ev_order);
        if (cb->ev_done) cudaEventDestroy(cb->ev_done);
        for (int i = 0; i < 2; i++) {
            if (cb->ev_stage[i]) cudaEventDestroy(cb->ev_stage[i]);
            if (cb->stage[i]) cudaFreeHost(cb->stage[i]);
        }
        if (cb->hcount) cudaFreeHost(cb->hcount);
        if (cb->compute) cudaStreamDestroy(cb->compute);
        if (cb->copy) cudaStreamDestroy(cb->copy);
    }
    free(cb->live);
    free(cb->ev_node);
    free(cb->spans);
    free(cb->moe_host);
    free(cb);
    free(be);
}

//
// the constructor
//

// How many devices there are, or an error saying why none can be used (no driver, no device).
static int cu_device_count(int * n) {
    *n = 0;
    int drv = 0;
    cudaDriverGetVersion(&drv);
    const cudaError_t e = cudaGetDeviceCount(n);
    if (e == cudaSuccess && *n > 0) return KVR_OK;
    cudaGetLastError();
    *n = 0;
    if (drv == 0) {
        return kvr_error(KVR_ERR_DEVICE, "no CUDA device was found: no NVIDIA driver is installed (cudaGetDeviceCount: %s)",
                         cudaGetErrorString(e));
    }
    if (e == cudaErrorInsufficientDriver) {
        return kvr_error(KVR_ERR_DEVICE, "no CUDA device was found: the NVIDIA driver (CUDA %d.%d) is older than this build "
                         "needs (CUDA %d.%d)", drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    }
    return kvr_error(KVR_ERR_DEVICE, "no CUDA device was found (cudaGetDeviceCount: %s)",
                     e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
}

static int cu_init(struct cu_backend * cb, const struct kvr_backend_params * p) {
    const struct kvr_tensor * node = NULL;
    int n = 0;
    CU_TRY(cu_device_count(&n));
    // the rank's GPU by the one rule of every launch (kvr.h, kvr_rank_gpu): node rank, first GPU
    cb->device = kvr_rank_gpu(p ? p->node_rank : 0, p ? p->device : 0, n);
    snprintf(cb->name, sizeof(cb->name), "cuda:%d", cb->device);
    CU(cudaSetDevice(cb->device));
    CU(cudaGetDeviceProperties(&cb->prop, cb->device));
    if (cb->prop.major < 8) {
        return kvr_error(KVR_ERR_DEVICE, "%s (%s) has compute capability %d.%d; this build runs on 8.0 and newer",
                         cb->name, cb->prop.name, cb->prop.major, cb->prop.minor);
    }
    int pools = 0; // the device memory pool is CUDA's stream-ordered allocator (see pool_alloc)
    CU(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, cb->device));
    if (!pools) {
        return kvr_error(KVR_ERR_DEVICE, "%s (%s) has no stream-ordered memory pools (cudaMallocAsync), which this backend "
                         "allocates from", cb->name, cb->prop.name);
    }
    CU(cudaStreamCreateWithFlags(&cb->compute, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&cb->copy, cudaStreamNonBlocking));
    CU(cudaEventCreateWithFlags(&cb->ev_order, cudaEventDisableTiming));
    CU(cudaEventCreateWithFlags(&cb->ev_done, cudaEventDisableTiming));
    for (int i = 0; i < 2; i++) {
        CU(cudaEventCreateWithFlags(&cb->ev_stage[i], cudaEventDisableTiming));
        CU(cudaHostAlloc(&cb->stage[i], CU_STAGE_BYTES, cudaHostAllocDefault));
    }
    CU(cudaHostAlloc((void **)&cb->hcount, 3 * sizeof(unsigned long long), cudaHostAllocDefault));
    CUBLAS(cublasCreate(&cb->blas));
    CUBLAS(cublasSetStream(cb->blas, cb->compute));
    CU(cudaFuncSetAttribute(k_attn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)(2 * CU_ATTN_CK * CU_ATTN_DMAX * sizeof(float))));
    CU(cudaFuncSetAttribute(k_fattn<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cu_fa_smem(64)));
    CU(cudaFuncSetAttribute(k_fattn<80>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cu_fa_smem(80)));
    CU(cudaFuncSetAttribute(k_fattn<96>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cu_fa_smem(96)));
    CU(cudaFuncSetAttribute(k_fattn<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cu_fa_smem(128)));
    CU(cudaFuncSetAttribute(k_fattn<256>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cu_fa_smem(256)));
    void * q = NULL;
    // cuBLAS's workspace given up front: a capture (cu_run_captured) must not find it allocating
    CU_TRY(pool_alloc(cb, CU_BLAS_WORKSPACE, &q));
    CUBLAS(cublasSetWorkspace(cb->blas, q, CU_BLAS_WORKSPACE));
    CU_TRY(pool_alloc(cb, CU_FD_BYTES, &q));
    cb->fd_part = (float *)q;
    CU_TRY(pool_alloc(cb, 3 * sizeof(unsigned long long), &q));
    cb->dcount = (unsigned long long *)q;
    // GELU's table, as the CPU builds it (kvr_gelu_half of every fp16 value), uploaded once
    uint16_t * table = (uint16_t *)malloc(sizeof(uint16_t) << 16);
    KVR_ASSERT(table != NULL);
    for (uint32_t i = 0; i < (1u << 16); i++) table[i] = kvr_gelu_half((uint16_t)i);
    int rc = pool_alloc(cb, sizeof(uint16_t) << 16, &q);
    if (rc == KVR_OK) {
        cb->gelu_table = (uint16_t *)q;
        rc = cu_upload(cb, (char *)q, (const char *)table, sizeof(uint16_t) << 16, NULL);
    }
    free(table);
    return rc;
}

void * kvr_backend_cuda_stream(struct kvr_backend * be) {
    if (!be || be->iface.name != cu_name) return NULL;
    return (void *)((struct cu_backend *)be->context)->compute;
}

// The registry's constructor of "cuda" (kvr.c's "backends"): of p it reads device and node_rank
// (p may be NULL: device 0); the CPU's fields are ignored: no 8-bit activations here
// (q8_activations), and its sums are in its own order (vec_dot_order).
struct kvr_backend * kvr_backend_cuda_new(const struct kvr_backend_params * p) {
    struct cu_backend * cb = (struct cu_backend *)calloc(1, sizeof(*cb));
    struct kvr_backend * be = (struct kvr_backend *)calloc(1, sizeof(*be));
    KVR_ASSERT(cb != NULL && be != NULL);
    cb->device = -1;
    cb->timeout_ms = 600e3; // a long prefill on a slow device still finishes; a hang does not
    const char * env = getenv("KVR_CUDA_TIMEOUT");
    if (env && atof(env) > 0) cb->timeout_ms = atof(env) * 1e3;
    env = getenv("KVR_CUDA_SYNC");
    cb->sync_nodes = env && env[0] == '1';
    env = getenv("KVR_CUDA_TF32");
    cb->tf32 = env && env[0] == '1';
    cb->progress = stderr;
    cb->span_layer = -1;
    be->context = cb;
    be->iface.name          = cu_name;
    be->iface.free          = cu_free;
    be->iface.supports_op   = cu_supports_op;
    be->iface.buf_alloc     = cu_buf_alloc;
    be->iface.buf_from_host = cu_buf_from_host;
    be->iface.buf_free      = cu_buf_free;
    be->iface.buf_clear     = cu_buf_clear;
    be->iface.tensor_set    = cu_tensor_set;
    be->iface.tensor_get    = cu_tensor_get;
    be->iface.graph_compute = cu_graph_compute;
    be->iface.synchronize   = cu_synchronize;
    be->iface.set_trace     = cu_set_trace;
    be->iface.spans         = cu_spans;
    be->iface.counters      = cu_counters;
    cb->node_times = p && p->node_times;
    const int rc = cu_init(cb, p);
    if (rc != KVR_OK) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", kvr_last_error());
        cu_free(be);
        kvr_error(rc, "%s", msg);
        return NULL;
    }
    return be;
}
