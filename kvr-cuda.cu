// kvr-cuda.cu - the CUDA backend: device buffers, a kernel or a cuBLAS call for every op the model
// graphs use, and the vtable of kvr.h's "backends" around them (make KVR_CUDA=1).
//
// What lives here, top to bottom: error handling (every CUDA and cuBLAS call checked, a failure
// becomes a kvr error naming the call, the op and the tensor); the backend's state (one device,
// a compute stream and a transfer stream ordered by events, a cuBLAS handle, a caching pool of
// device memory, pinned staging buffers); the kernels, one short __global__ function per op,
// written simply (a thread per block or element, a block per row, a warp per attention row) and
// built on the per-element math of kvr.h's internal section (KVR_HD), so the CPU tests check the
// arithmetic they run; the launchers and the one dispatch switch; supports_op as one switch over
// every op and type; the constructor.
//
// Matrix products go to cuBLAS with f32 accumulation: F32 weights as they are, F16/BF16 weights
// against activations converted to F16/BF16, quantized weights dequantized tile by tile into F16
// first (one token at a time instead: a dequantize-and-dot kernel). Attention is one kernel that
// returns O and the log-sum-exp at absolute positions with the CPU kernel's tiles (kvr.h's
// kvr_attn_tile): causal tiles that no query can see are skipped, dense mode computes them all.
//
// Nothing here has run on a GPU on the machines kvr is developed on (they have none): it is
// compiled with -Werror for sm_80 and sm_90, the KVR_HD math is tested on the host as nvcc
// compiles it (tests/test-cuda-host.cu), and tools/kvr-compare is what checks a real device.

#define KVR_BUILD
#include "kvr.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
#define CU_W16_TILE      ((size_t)64 << 20) // bytes of dequantized F16 weights per cuBLAS call
#define CU_DOT_MAX_T     8                  // quantized MUL_MAT over at most this many tokens: dot kernel
#define CU_POOL_BIG      ((size_t)1 << 30)  // freed blocks larger than this go back to the driver

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

    // memory: live allocations and a small cache of freed blocks
    struct cu_alloc * live;   int n_live, cap_live;
    struct cu_alloc   cached[CU_POOL_CACHED]; int n_cached;
    void            * stage[2];    // pinned host staging
    uint16_t        * gelu_table;  // device copy of the CPU's GELU table (kvr_gelu_half of every fp16)
    void            * w16;  size_t w16_bytes;   // dequantized weight tiles (F16)
    void            * x16;  size_t x16_bytes;   // activations converted to F16/BF16
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
// device memory: a caching pool (cudaMalloc is slow and synchronizes; graphs allocate every eval)
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
        cudaError_t e = cudaMalloc(&a.ptr, size);
        if (e == cudaErrorMemoryAllocation && cb->n_cached > 0) {
            cudaGetLastError(); // clear it, give the cache back, try once more
            for (int i = 0; i < cb->n_cached; i++) CU(cudaFree(cb->cached[i].ptr));
            cb->n_cached = 0;
            e = cudaMalloc(&a.ptr, size);
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
// compute stream may still use a block: a later user of it queues behind that work.
static void pool_free(struct cu_backend * cb, void * ptr) {
    if (!ptr) return;
    int i = 0;
    while (i < cb->n_live && cb->live[i].ptr != ptr) i++;
    KVR_ASSERT(i < cb->n_live && "freeing a buffer this backend did not allocate");
    struct cu_alloc a = cb->live[i];
    cb->live[i] = cb->live[--cb->n_live];
    if (a.size > CU_POOL_BIG) { // weights and caches: keeping them would keep the memory
        cudaFree(a.ptr);
        return;
    }
    if (cb->n_cached == CU_POOL_CACHED) {
        int big = 0;
        for (int j = 1; j < cb->n_cached; j++) if (cb->cached[j].size > cb->cached[big].size) big = j;
        if (cb->cached[big].size > a.size) {
            struct cu_alloc t = cb->cached[big];
            cb->cached[big] = a;
            a = t;
        }
        cudaFree(a.ptr); // synchronizes the device: nothing queued still uses it afterwards
        return;
    }
    cb->cached[cb->n_cached++] = a;
}

// A scratch buffer of at least n bytes (grown, never shrunk; growing waits for queued work).
static int scratch(struct cu_backend * cb, void ** buf, size_t * have, size_t n, const struct kvr_tensor * node) {
    if (n <= *have) return KVR_OK;
    if (*buf) {
        CU(cudaStreamSynchronize(cb->compute));
        pool_free(cb, *buf);
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

// Elements per block of a type, at compile time: the kernels are instantiated per weight type so
// a thread's block buffer has the right size and kvr_dequant_block folds to one case.
static __host__ __device__ constexpr int cu_blck(int type) {
    return type == KVR_TYPE_Q4_0 || type == KVR_TYPE_Q4_1 || type == KVR_TYPE_Q5_0 || type == KVR_TYPE_Q5_1 ||
           type == KVR_TYPE_Q8_0 || type == KVR_TYPE_Q8_1 ? KVR_QK
         : type == KVR_TYPE_Q2_K || type == KVR_TYPE_Q3_K || type == KVR_TYPE_Q4_K || type == KVR_TYPE_Q5_K ||
           type == KVR_TYPE_Q6_K || type == KVR_TYPE_Q8_K ? KVR_QK_K : 1;
}

// every weight type the backend reads; the launchers switch over this list
#define CU_WEIGHT_TYPES(X) \
    X(KVR_TYPE_F32) X(KVR_TYPE_F16) X(KVR_TYPE_BF16) \
    X(KVR_TYPE_Q4_0) X(KVR_TYPE_Q4_1) X(KVR_TYPE_Q5_0) X(KVR_TYPE_Q5_1) X(KVR_TYPE_Q8_0) X(KVR_TYPE_Q8_1) \
    X(KVR_TYPE_Q2_K) X(KVR_TYPE_Q3_K) X(KVR_TYPE_Q4_K) X(KVR_TYPE_Q5_K) X(KVR_TYPE_Q6_K) X(KVR_TYPE_Q8_K)

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

// GET_ROWS: a block per picked row, a thread per quant block of it
template <int TYPE>
static __global__ void k_get_rows(const char * a, int64_t a_nb1, int64_t ne0, int64_t a_rows, const int32_t * ids,
                                  char * dst, int64_t d_nb1, unsigned long long * bad) {
    constexpr int BS = cu_blck(TYPE);
    const int64_t i  = blockIdx.x;
    const int32_t id = ids[i];
    float * y = (float *)(dst + i * d_nb1);
    if (id < 0 || id >= a_rows) { // ids are checked before a graph runs: count it, fail the graph
        if (threadIdx.x == 0) atomicAdd(bad, 1ull);
        return;
    }
    const char * row = a + id * a_nb1;
    for (int64_t b = threadIdx.x; b < ne0 / BS; b += blockDim.x) {
        float v[BS];
        kvr_dequant_block((enum kvr_type)TYPE, row, b, v);
        for (int j = 0; j < BS; j++) y[b * BS + j] = v[j];
    }
}

// ADD, MUL: a block per row; b is one row broadcast over a's rows, or shaped as a
static __global__ void k_binary(int op, cu_tensor a, cu_tensor b, cu_tensor d, int bcast) {
    const int64_t r = blockIdx.x;
    const float * x = (const float *)cu_row(a, r);
    const float * y = bcast ? (const float *)b.data : (const float *)cu_row(b, r);
    float * z = (float *)cu_row(d, r);
    for (int64_t i = threadIdx.x; i < a.ne[0]; i += blockDim.x) {
        z[i] = op == KVR_OP_ADD ? x[i] + y[i] : x[i] * y[i];
    }
}

// SCALE, SILU, GELU: a block per row
static __global__ void k_unary(int op, cu_tensor a, cu_tensor d, float s, const uint16_t * gelu_table) {
    const int64_t r = blockIdx.x;
    const float * x = (const float *)cu_row(a, r);
    float * y = (float *)cu_row(d, r);
    for (int64_t i = threadIdx.x; i < a.ne[0]; i += blockDim.x) {
        const float v = x[i];
        y[i] = op == KVR_OP_SCALE ? v * s : op == KVR_OP_SILU ? v / (1.0f + expf(-v)) : kvr_gelu_ggml(v, gelu_table);
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
                              float theta_scale, float freq_scale) {
    const int64_t H = a.ne[1];
    const int64_t h = blockIdx.x % H, t = blockIdx.x / H;
    const float * x = (const float *)(a.data + h * a.nb[1] + t * a.nb[2]);
    float * y = (float *)(d.data + h * d.nb[1] + t * d.nb[2]);
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
        const float th = kvr_rope_angle(kvr_rope_theta(pos[t], theta_scale, i), freqs, i, freq_scale);
        int i0, i1;
        kvr_rope_dims(mode, n_rot, i, &i0, &i1);
        float y0, y1;
        kvr_rope_rotate(x[i0], x[i1], cosf(th), sinf(th), &y0, &y1);
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

// quantized weights -> F16 tile [rows, K], a thread per quant block
template <int TYPE>
static __global__ void k_dequant_f16(const char * w, int64_t nb1, int64_t K, int64_t rows, __half * out) {
    constexpr int BS = cu_blck(TYPE);
    const int64_t nblk = K / BS;
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= rows * nblk) return;
    const int64_t r = idx / nblk, b = idx % nblk;
    float v[BS];
    kvr_dequant_block((enum kvr_type)TYPE, w + r * nb1, b, v);
    __half * o = out + r * K + b * BS;
    for (int j = 0; j < BS; j++) o[j] = __float2half_rn(v[j]);
}

// activations [K, T] (row stride ldx floats) -> a contiguous F16 or BF16 matrix for cuBLAS
template <typename T>
static __device__ __forceinline__ T cu_from_f32(float v);
template <> __device__ __forceinline__ __half        cu_from_f32<__half>(float v)        { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 cu_from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
static __global__ void k_x_convert(const float * x, int64_t ldx, int64_t K, int64_t n, T * out) {
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= n) return;
    out[idx] = cu_from_f32<T>(x[(idx / K) * ldx + idx % K]);
}

// a few tokens over quantized weights: a warp per output row, each lane dequantizes whole blocks
// of the row and dots them with every token
template <int TYPE>
static __global__ void k_dq_dot(const char * w, int64_t nb1, int64_t K, int64_t N, const float * x, int64_t ldx,
                                int T, float * y) {
    constexpr int BS = cu_blck(TYPE);
    const int lane = threadIdx.x % 32;
    const int64_t n = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) return;
    float acc[CU_DOT_MAX_T];
    for (int t = 0; t < CU_DOT_MAX_T; t++) acc[t] = 0.0f;
    const char * row = w + n * nb1;
    for (int64_t b = lane; b < K / BS; b += 32) {
        float v[BS];
        kvr_dequant_block((enum kvr_type)TYPE, row, b, v);
        for (int t = 0; t < CU_DOT_MAX_T; t++) {
            if (t >= T) break;
            const float * xt = x + t * ldx + b * BS;
            float s = 0.0f;
            for (int j = 0; j < BS; j++) s += v[j] * xt[j];
            acc[t] += s;
        }
    }
    for (int t = 0; t < T; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) y[t * N + n] = s;
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

static __global__ void __launch_bounds__(CU_ATTN_WARPS * 32) k_attn(cu_attn_args p) {
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
                    for (int c = 0; c < ND; c++) {
                        const int dd = lane + 32 * c;
                        if (dd < p.D) part += qr[c] * Ks[jj * p.D + dd];
                    }
                    const float s = warp_sum(part) * p.scale;
                    const bool visible = vis == 1 || kvr_attn_visible(qp, p.kpos[j0 + c0 + jj], p.window);
                    seen += visible;
                    if (lane == jj) my_s = visible ? s : -INFINITY;
                }
                const float mx = warp_max(my_s);
                if (mx == -INFINITY) continue; // nothing visible for this row in this chunk
                const float m_new = kvr_softmax_max(M, mx);
                const float pj = my_s == -INFINITY ? 0.0f : expf(my_s - m_new);
                const float corr = kvr_softmax_step(&M, &L, m_new, warp_sum(pj));
                for (int c = 0; c < ND; c++) o[c] *= corr;
                for (int jj = 0; jj < ck; jj++) {
                    // F16/BF16 values: the weights in that type (the CPU's tiled kernel does the same)
                    const float w = kvr_kv_operand_round((enum kvr_type)p.vtype, __shfl_sync(0xffffffffu, pj, jj));
                    for (int c = 0; c < ND; c++) {
                        const int dd = lane + 32 * c;
                        if (dd < p.D) o[c] += w * Vs[jj * p.D + dd];
                    }
                }
            }
        }
        if (!active) continue;
        if (g == 0 && r % G == 0 && lane == 0) atomicAdd(&p.count[1], (unsigned long long)seen);
        float inv, lse;
        kvr_softmax_finish(M, L, &inv, &lse);
        float * out = (float *)(p.out + (i0 + i) * p.out_nb1);
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

// MERGE_ATTN: a block per query row; a thread per output element, then one per head's LSE
struct cu_merge_args {
    const char * part[KVR_MAX_SRC];
    int64_t part_nb1[KVR_MAX_SRC];
    char * out;
    int64_t out_nb1;
    int n, H, D;
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
            out[e] = e < HD ? 0.0f : -INFINITY;
            continue;
        }
        float sum = 0.0f, acc = 0.0f;
        for (int i = 0; i < p.n; i++) {
            const float * part = (const float *)(p.part[i] + r * p.part_nb1[i]);
            const float w = kvr_lse_weight(part[HD + h], m);
            sum += w;
            if (e < HD && w != 0.0f) acc += w * part[e];
        }
        out[e] = e < HD ? acc * (1.0f / sum) : kvr_lse_merged(m, sum);
    }
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
    k_binary<<<(unsigned)rows, cu_threads_for(a->ne[0]), 0, cb->compute>>>(node->op, cu_t(a), cu_t(b), cu_t(node),
                                                                            kvr_nrows(b) == 1);
    CU_LAUNCHED();
    return KVR_OK;
}

static int op_unary(struct cu_backend * cb, struct kvr_tensor * node) {
    const struct kvr_tensor * a = node->src[0];
    const int64_t rows = kvr_nrows(a);
    if (rows == 0) return KVR_OK;
    float s;
    memcpy(&s, &node->op_params[0], sizeof(s));
    k_unary<<<(unsigned)rows, cu_threads_for(a->ne[0]), 0, cb->compute>>>(node->op, cu_t(a), cu_t(node), s, cb->gelu_table);
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
    float freq_base, freq_scale;
    memcpy(&freq_base, &node->op_params[2], sizeof(float));
    memcpy(&freq_scale, &node->op_params[3], sizeof(float));
    const int64_t n = a->ne[1] * a->ne[2];
    if (n == 0) return KVR_OK;
    // theta_scale on the host, with the CPU's powf: every angle then starts from the same bits
    const float * freqs = node->src[2] ? (const float *)node->src[2]->data : NULL; // per-pair divisors
    k_rope<<<(unsigned)n, cu_threads_for(a->ne[0] / 2), 0, cb->compute>>>(cu_t(a), cu_t(node), (const int32_t *)pos->data,
        freqs, n_rot, mode, kvr_rope_theta_scale(freq_base, n_rot), freq_scale);
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

// x [K, T] f32 with row stride ldx into a contiguous F16/BF16 copy in the x16 scratch
static int mm_convert_x(struct cu_backend * cb, struct kvr_tensor * node, const float * x, int64_t ldx, int64_t K,
                        int64_t T, bool bf16) {
    CU_TRY(scratch(cb, &cb->x16, &cb->x16_bytes, (size_t)(K * T) * 2, node));
    const int64_t n = K * T;
    if (bf16) k_x_convert<__nv_bfloat16><<<cu_blocks(n, 256), 256, 0, cb->compute>>>(x, ldx, K, n, (__nv_bfloat16 *)cb->x16);
    else      k_x_convert<__half><<<cu_blocks(n, 256), 256, 0, cb->compute>>>(x, ldx, K, n, (__half *)cb->x16);
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
                        (int)ldx, &zero, Y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
    switch (w->type) {
        case KVR_TYPE_F32:
            return mm_gemm(cb, node, N, T, K, w->data, CUDA_R_32F, (int64_t)(w->nb[1] / 4), X, CUDA_R_32F, ldx, Y, N);
        case KVR_TYPE_F16:
        case KVR_TYPE_BF16: {
            const bool bf = w->type == KVR_TYPE_BF16;
            CU_TRY(mm_convert_x(cb, node, X, ldx, K, T, bf));
            return mm_gemm(cb, node, N, T, K, w->data, bf ? CUDA_R_16BF : CUDA_R_16F, (int64_t)(w->nb[1] / 2), cb->x16,
                           bf ? CUDA_R_16BF : CUDA_R_16F, K, Y, N);
        }
        default:
            break;
    }
    if (T <= CU_DOT_MAX_T) { // decode: no tile, no conversion of the activations
        const int warps = 4;
        switch (w->type) {
#define CU_CASE(TYPE) case TYPE: \
            k_dq_dot<TYPE><<<cu_blocks(N, warps), 32 * warps, 0, cb->compute>>>((const char *)w->data, (int64_t)w->nb[1], \
                K, N, X, ldx, (int)T, Y); break;
            CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            default:
                return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT with weights of type %s (tensor '%s')", cb->device,
                                 kvr_type_name(w->type), node->name);
        }
        CU_LAUNCHED();
        return KVR_OK;
    }
    // prefill: a tile of weight rows dequantized into F16, then one cuBLAS call per tile
    CU_TRY(mm_convert_x(cb, node, X, ldx, K, T, false));
    int64_t tile = (int64_t)(CU_W16_TILE / ((size_t)K * 2));
    if (tile < 1) tile = 1;
    if (tile > N) tile = N;
    CU_TRY(scratch(cb, &cb->w16, &cb->w16_bytes, (size_t)(tile * K) * 2, node));
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int64_t rows = n0 + tile <= N ? tile : N - n0;
        const char * W = (const char *)w->data + n0 * (int64_t)w->nb[1];
        const int64_t nblk = rows * (K / kvr_blck_size(w->type));
        switch (w->type) {
#define CU_CASE(TYPE) case TYPE: \
            k_dequant_f16<TYPE><<<cu_blocks(nblk, 128), 128, 0, cb->compute>>>(W, (int64_t)w->nb[1], K, rows, (__half *)cb->w16); break;
            CU_WEIGHT_TYPES(CU_CASE)
#undef CU_CASE
            default:
                return kvr_error(KVR_ERR_UNSUPP, "cuda:%d: MUL_MAT with weights of type %s (tensor '%s')", cb->device,
                                 kvr_type_name(w->type), node->name);
        }
        CU_LAUNCHED();
        CU_TRY(mm_gemm(cb, node, rows, T, K, cb->w16, CUDA_R_16F, K, cb->x16, CUDA_R_16F, K, Y + n0, N));
    }
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
    p.count = cb->dcount;
    if (p.Tq == 0) return KVR_OK;
    const size_t shmem = (size_t)(2 * CU_ATTN_CK * p.D) * sizeof(float);
    k_attn<<<(unsigned)cu_attn_blocks(p.H, p.Hkv, p.Tq), CU_ATTN_WARPS * 32, shmem, cb->compute>>>(p);
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
    // an upload may still be writing it: the memory goes back to the pool once nothing uses it
    cu_stick(cb, cu_idle(cb));
    pool_free(cb, buf->base);
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
    if (rc != KVR_OK) {
        pool_free(cb, buf->base);
        buf->base = NULL;
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
                   t->src[1]->nb[0] == 4 && t->src[1]->ne[0] == a->ne[0];
        case KVR_OP_SCALE:
        case KVR_OP_SILU:
        case KVR_OP_GELU:
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:
            return a->type == KVR_TYPE_F32 && a->nb[0] == 4;
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
            return a->ne[0] <= CU_ATTN_DMAX && kv_ok && k->nb[0] == kvr_type_size(k->type) && v->nb[0] == kvr_type_size(v->type) &&
                   (k->type != KVR_TYPE_Q8_0 || a->ne[0] % 32 == 0) && (v->type != KVR_TYPE_Q8_0 || a->ne[0] % 32 == 0);
        }
        case KVR_OP_MERGE_ATTN:
            return true;
        case KVR_OP_SEND:        // through kvr_backend_comm_node: staged in host memory by kvr
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
            return true;
        case KVR_OP_ATTN_BLOCK:  // a strategy pass rewrites it; it never reaches a backend
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
        case KVR_OP_GELU:       return op_unary(cb, t);
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:       return op_norm(cb, t);
        case KVR_OP_MUL_MAT:    return op_mul_mat(cb, t);
        case KVR_OP_ROPE:       return op_rope(cb, t);
        case KVR_OP_CPY:
        case KVR_OP_KV_STORE:   return op_cpy(cb, t);
        case KVR_OP_ATTN:       return op_attn(cb, t);
        case KVR_OP_MERGE_ATTN: return op_merge_attn(cb, t);
        case KVR_OP_NONE:
        case KVR_OP_VIEW:       return KVR_OK;
        case KVR_OP_SEND:       // the graph loop hands these to kvr_backend_comm_node
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
        case KVR_OP_ATTN_BLOCK:
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
    for (int i = 0; i < g->n_nodes; i++) {
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

static int cu_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    struct cu_backend * cb = (struct cu_backend *)be->context;
    struct kvr_tensor * node = NULL;
    CU(cudaSetDevice(cb->device));
    CU_TRY(cu_unstick(cb)); // an upload before this graph failed
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
    CU_TRY(cu_events(cb, g->n_nodes + 1));
    double * host_t = (double *)calloc((size_t)(2 * g->n_nodes + 1), sizeof(double));
    KVR_ASSERT(host_t != NULL);
    int rc = KVR_OK;
    const double t_start = kvr_time_ms();
    do {
        if ((rc = cu_order(cb, cb->copy, cb->compute, node)) != KVR_OK) break;
        cudaError_t e = cudaMemsetAsync(cb->dcount, 0, 3 * sizeof(unsigned long long), cb->compute);
        if (e == cudaSuccess) e = cudaEventRecord(cb->ev_node[0], cb->compute);
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
            if (rc == KVR_OK && (e = cudaEventRecord(cb->ev_node[i + 1], cb->compute)) != cudaSuccess) {
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
    if (cb->device >= 0 && cudaSetDevice(cb->device) == cudaSuccess) {
        if (cb->compute) cudaStreamSynchronize(cb->compute);
        if (cb->copy) cudaStreamSynchronize(cb->copy);
        if (cb->blas) cublasDestroy(cb->blas);
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
        for (int i = 0; i < cb->n_live; i++) cudaFree(cb->live[i].ptr); // gelu table, scratch, counters
        for (int i = 0; i < cb->n_cached; i++) cudaFree(cb->cached[i].ptr);
    }
    free(cb->live);
    free(cb->ev_node);
    free(cb->spans);
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
    // ranks ask for the device of their index: rank r runs on device r mod (devices)
    const int want = p && p->device > 0 ? p->device : 0;
    cb->device = want % n;
    snprintf(cb->name, sizeof(cb->name), "cuda:%d", cb->device);
    CU(cudaSetDevice(cb->device));
    CU(cudaGetDeviceProperties(&cb->prop, cb->device));
    if (cb->prop.major < 8) {
        return kvr_error(KVR_ERR_DEVICE, "%s (%s) has compute capability %d.%d; this build runs on 8.0 and newer",
                         cb->name, cb->prop.name, cb->prop.major, cb->prop.minor);
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
    void * q = NULL;
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

// The registry's constructor of "cuda" (kvr.c's "backends"): of p it reads device (p may be NULL:
// device 0); the CPU's fields are ignored: no 8-bit activations here (q8_activations), and its
// sums are in its own order (vec_dot_order).
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
