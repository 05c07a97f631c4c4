// kvr.c - the single-rank runtime: errors, types and conversions, tensors and contexts, op
// constructors, the graph (build, memory plan, the single-rank strategy pass), the CPU backend
// (thread pool, one dispatch switch, the kernels), the GGUF reader and writer, the tokenizers,
// the KV cache, model loading, sessions and sampling. The architecture graph builders live in
// models/*.c and are compiled as part of this file (included at the end), so an application
// embeds kvr.h + kvr.c (+ models/) and nothing else.
//
// Reading order for one prefill: kvr_session_eval -> kvr_model_build (models/llama.c) ->
// kvr_pass_single -> kvr_graph_plan -> cpu_graph_compute -> cpu_compute_node -> cpu_op_*.

#define _GNU_SOURCE
#define KVR_AMALGAMATED
#define STB_DS_IMPLEMENTATION
#if defined(__GNUC__) && !defined(__clang__) && !defined(typeof)
#define typeof __typeof__ // stb_ds spells it so; strict C11 has only the GNU spelling
#endif
#include <stb/stb_ds.h>

#include "kvr.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

// OpenBLAS exposes this; we set it to 1 so each of our threads runs its own sgemm on its slice.
extern void openblas_set_num_threads(int n);

//
// errors
//

static _Thread_local char kvr_errbuf[1024];

const char * kvr_last_error(void) {
    return kvr_errbuf;
}

int kvr_error(int code, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvr_errbuf, sizeof(kvr_errbuf), fmt, ap);
    va_end(ap);
    return code;
}

void kvr_abort(const char * file, int line, const char * expr) {
    fprintf(stderr, "kvr: %s:%d: assertion failed: %s\n", file, line, expr);
    fflush(stderr);
    abort();
}

double kvr_time_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void * kvr_malloc(size_t n) {
    void * p = malloc(n ? n : 1);
    KVR_ASSERT(p != NULL && "out of memory");
    return p;
}

static void * kvr_calloc(size_t n, size_t sz) {
    void * p = calloc(n ? n : 1, sz ? sz : 1);
    KVR_ASSERT(p != NULL && "out of memory");
    return p;
}

//
// half precision
//

float kvr_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp  = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { // subnormal: normalize
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400));
            mant &= 0x3ff;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kvr_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000u) { // inf or nan
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    }
    if (absx >= 0x477ff000u) { // rounds to >= 65520: overflow to inf
        return (uint16_t)(sign | 0x7c00);
    }
    if (absx < 0x38800000u) { // below the smallest normal half: subnormal or zero
        // add the value to 0.5 (as float) so the FPU does round-to-nearest-even for us
        float a;
        memcpy(&a, &absx, 4);
        a += 0.5f;
        uint32_t ab;
        memcpy(&ab, &a, 4);
        // no mask: a value that rounds up to 2^-14 becomes the smallest normal (0x400)
        return (uint16_t)(sign | (ab - 0x3f000000u));
    }
    const uint32_t mant_odd = (absx >> 13) & 1;
    uint32_t v = absx + 0xc8000fffu + mant_odd; // rebias exponent (-112 << 23) and round to nearest even
    return (uint16_t)(sign | (v >> 13));
}

float kvr_bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kvr_fp32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 64); // quiet nan
    }
    return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

//
// types
//

struct type_traits {
    const char * name;
    int64_t      blck_size;
    size_t       type_size;
};

// Every type GGUF files use that kvr knows the block layout of. Block sizes and bytes per block
// are GGML's; the quantized layouts themselves live in the quantization section below.
static const struct type_traits type_traits[KVR_TYPE_COUNT] = {
    [KVR_TYPE_F32]  = { "f32",  1,   4   },
    [KVR_TYPE_F16]  = { "f16",  1,   2   },
    [KVR_TYPE_Q4_0] = { "q4_0", 32,  18  },
    [KVR_TYPE_Q4_1] = { "q4_1", 32,  20  },
    [KVR_TYPE_Q5_0] = { "q5_0", 32,  22  },
    [KVR_TYPE_Q5_1] = { "q5_1", 32,  24  },
    [KVR_TYPE_Q8_0] = { "q8_0", 32,  34  },
    [KVR_TYPE_Q8_1] = { "q8_1", 32,  36  },
    [KVR_TYPE_Q2_K] = { "q2_K", 256, 84  },
    [KVR_TYPE_Q3_K] = { "q3_K", 256, 110 },
    [KVR_TYPE_Q4_K] = { "q4_K", 256, 144 },
    [KVR_TYPE_Q5_K] = { "q5_K", 256, 176 },
    [KVR_TYPE_Q6_K] = { "q6_K", 256, 210 },
    [KVR_TYPE_Q8_K] = { "q8_K", 256, 292 },
    [KVR_TYPE_I8]   = { "i8",   1,   1   },
    [KVR_TYPE_I16]  = { "i16",  1,   2   },
    [KVR_TYPE_I32]  = { "i32",  1,   4   },
    [KVR_TYPE_I64]  = { "i64",  1,   8   },
    [KVR_TYPE_F64]  = { "f64",  1,   8   },
    [KVR_TYPE_BF16] = { "bf16", 1,   2   },
};

static bool type_known(enum kvr_type t) {
    return (unsigned)t < KVR_TYPE_COUNT && type_traits[t].blck_size > 0;
}

int64_t kvr_blck_size(enum kvr_type t) { return type_known(t) ? type_traits[t].blck_size : 0; }
size_t  kvr_type_size(enum kvr_type t) { return type_known(t) ? type_traits[t].type_size : 0; }
const char * kvr_type_name(enum kvr_type t) { return type_known(t) ? type_traits[t].name : "?"; }

size_t kvr_row_size(enum kvr_type t, int64_t ne0) {
    KVR_ASSERT(type_known(t) && ne0 % type_traits[t].blck_size == 0);
    return (size_t)(ne0 / type_traits[t].blck_size) * type_traits[t].type_size;
}

typedef void   (*to_float_fn)  (const void * src, float * dst, int64_t n);
typedef size_t (*from_float_fn)(const float * src, void * dst, int64_t n);

static void f32_to_float(const void * src, float * dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void f16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = kvr_fp16_to_fp32(s[i]);
    }
}

static void bf16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)s[i] << 16;
        memcpy(&dst[i], &bits, 4);
    }
}

static size_t f32_from_float(const float * src, void * dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
    return (size_t)n * 4;
}

static size_t f16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) {
        d[i] = kvr_fp32_to_fp16(src[i]);
    }
    return (size_t)n * 2;
}

static size_t bf16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) {
        d[i] = kvr_fp32_to_bf16(src[i]);
    }
    return (size_t)n * 2;
}

// The quantization section (further down) answers these for the block-quantized types.
static to_float_fn   quant_to_float_fn(enum kvr_type t);
static from_float_fn quant_from_float_fn(enum kvr_type t);

static to_float_fn type_to_float(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return f32_to_float;
        case KVR_TYPE_F16:  return f16_to_float;
        case KVR_TYPE_BF16: return bf16_to_float;
        default:            return quant_to_float_fn(t);
    }
}

static from_float_fn type_from_float(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return f32_from_float;
        case KVR_TYPE_F16:  return f16_from_float;
        case KVR_TYPE_BF16: return bf16_from_float;
        default:            return quant_from_float_fn(t);
    }
}

bool kvr_type_supported(enum kvr_type t) {
    return type_known(t) && type_to_float(t) != NULL;
}

void kvr_to_float(enum kvr_type t, const void * src, float * dst, int64_t n) {
    to_float_fn f = type_to_float(t);
    KVR_ASSERT(f != NULL && n % kvr_blck_size(t) == 0);
    f(src, dst, n);
}

size_t kvr_from_float(enum kvr_type t, const float * src, void * dst, int64_t n) {
    from_float_fn f = type_known(t) ? type_from_float(t) : NULL;
    if (!f || n % kvr_blck_size(t) != 0) {
        return 0;
    }
    return f(src, dst, n);
}

//
// tensors and contexts
//

struct kvr_context {
    uint8_t * mem;
    size_t    size;
    size_t    used;
    bool      no_alloc;
    void   ** bufs;     // stb_ds array of buffers freed with the context
};

struct kvr_context * kvr_init(size_t mem_size, bool no_alloc) {
    struct kvr_context * ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        return NULL;
    }
    ctx->mem = malloc(mem_size);
    if (!ctx->mem) {
        free(ctx);
        return NULL;
    }
    ctx->size     = mem_size;
    ctx->no_alloc = no_alloc;
    return ctx;
}

void kvr_free(struct kvr_context * ctx) {
    if (ctx) {
        for (ptrdiff_t i = 0; i < arrlen(ctx->bufs); i++) free(ctx->bufs[i]);
        arrfree(ctx->bufs);
        free(ctx->mem);
        free(ctx);
    }
}

size_t kvr_used_mem(const struct kvr_context * ctx) {
    return ctx->used;
}

static void * ctx_alloc(struct kvr_context * ctx, size_t n) {
    const size_t align = 64;
    size_t off = (ctx->used + align - 1) & ~(align - 1);
    // The arena is sized by the caller from the model shape; running out is our bug.
    KVR_ASSERT(off + n <= ctx->size && "context arena too small");
    ctx->used = off + n;
    return ctx->mem + off;
}

int64_t kvr_nelements(const struct kvr_tensor * t) {
    return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
}

int64_t kvr_nrows(const struct kvr_tensor * t) {
    return t->ne[1] * t->ne[2] * t->ne[3];
}

size_t kvr_nbytes(const struct kvr_tensor * t) {
    size_t n = kvr_row_size(t->type, t->ne[0]);
    for (int i = 1; i < KVR_MAX_DIMS; i++) {
        if (t->ne[i] == 0) {
            return 0;
        }
        n += (size_t)(t->ne[i] - 1) * t->nb[i];
    }
    return n;
}

bool kvr_is_contiguous(const struct kvr_tensor * t) {
    size_t next = kvr_row_size(t->type, t->ne[0]);
    if (t->nb[0] != kvr_type_size(t->type)) {
        return false;
    }
    for (int i = 1; i < KVR_MAX_DIMS; i++) {
        if (t->ne[i] != 1 && t->nb[i] != next) {
            return false;
        }
        next = t->nb[i] * t->ne[i];
    }
    return true;
}

struct kvr_tensor * kvr_set_name(struct kvr_tensor * t, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    return t;
}

float kvr_get_f32_1d(const struct kvr_tensor * t, int64_t i) {
    KVR_ASSERT(t->data && t->type == KVR_TYPE_F32 && kvr_is_contiguous(t));
    return ((const float *)t->data)[i];
}

static struct kvr_tensor * new_tensor_impl(struct kvr_context * ctx, enum kvr_type type, int n_dims,
                                           const int64_t * ne, struct kvr_tensor * view_src, size_t view_offs) {
    KVR_ASSERT(type_known(type) && n_dims >= 1 && n_dims <= KVR_MAX_DIMS);
    struct kvr_tensor * t = ctx_alloc(ctx, sizeof(struct kvr_tensor));
    memset(t, 0, sizeof(*t));
    t->type = type;
    for (int i = 0; i < KVR_MAX_DIMS; i++) {
        t->ne[i] = i < n_dims ? ne[i] : 1;
    }
    KVR_ASSERT(t->ne[0] % type_traits[type].blck_size == 0);
    t->nb[0] = type_traits[type].type_size;
    t->nb[1] = kvr_row_size(type, t->ne[0]);
    for (int i = 2; i < KVR_MAX_DIMS; i++) {
        t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    }
    if (view_src) {
        if (view_src->view_src) { // views of views point at the owner of the memory
            view_offs += view_src->view_offs;
            view_src   = view_src->view_src;
        }
        t->view_src  = view_src;
        t->view_offs = view_offs;
        t->data      = view_src->data ? (uint8_t *)view_src->data + view_offs : NULL;
    } else if (!ctx->no_alloc) {
        t->data = ctx_alloc(ctx, t->nb[3] * (size_t)t->ne[3]);
    }
    return t;
}

struct kvr_tensor * kvr_new_tensor(struct kvr_context * ctx, enum kvr_type type, int n_dims, const int64_t * ne) {
    return new_tensor_impl(ctx, type, n_dims, ne, NULL, 0);
}

struct kvr_tensor * kvr_new_tensor_1d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0) {
    return kvr_new_tensor(ctx, type, 1, &ne0);
}

struct kvr_tensor * kvr_new_tensor_2d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1) {
    const int64_t ne[2] = { ne0, ne1 };
    return kvr_new_tensor(ctx, type, 2, ne);
}

struct kvr_tensor * kvr_new_tensor_3d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    const int64_t ne[3] = { ne0, ne1, ne2 };
    return kvr_new_tensor(ctx, type, 3, ne);
}

static struct kvr_tensor * view_impl(struct kvr_context * ctx, struct kvr_tensor * a, int n_dims,
                                     const int64_t * ne, const size_t * nb, size_t offset) {
    struct kvr_tensor * t = new_tensor_impl(ctx, a->type, n_dims, ne, a, offset);
    for (int i = 1; i < n_dims; i++) {
        t->nb[i] = nb[i];
    }
    for (int i = n_dims; i < KVR_MAX_DIMS; i++) {
        t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    }
    t->op     = KVR_OP_VIEW;
    t->src[0] = a;
    snprintf(t->name, sizeof(t->name), "%.50s (view)", a->name);
    return t;
}

struct kvr_tensor * kvr_view_1d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, size_t offset) {
    return view_impl(ctx, a, 1, &ne0, NULL, offset);
}

struct kvr_tensor * kvr_view_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1,
                                size_t nb1, size_t offset) {
    const int64_t ne[2] = { ne0, ne1 };
    const size_t  nb[2] = { 0, nb1 };
    return view_impl(ctx, a, 2, ne, nb, offset);
}

struct kvr_tensor * kvr_view_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
                                size_t nb1, size_t nb2, size_t offset) {
    const int64_t ne[3] = { ne0, ne1, ne2 };
    const size_t  nb[3] = { 0, nb1, nb2 };
    return view_impl(ctx, a, 3, ne, nb, offset);
}

struct kvr_tensor * kvr_reshape_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2) {
    KVR_ASSERT(kvr_is_contiguous(a) && ne0 * ne1 * ne2 == kvr_nelements(a));
    const int64_t ne[3] = { ne0, ne1, ne2 };
    const size_t  nb[3] = { 0, kvr_row_size(a->type, ne0), kvr_row_size(a->type, ne0) * (size_t)ne1 };
    return view_impl(ctx, a, 3, ne, nb, 0);
}

struct kvr_tensor * kvr_reshape_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1) {
    KVR_ASSERT(kvr_is_contiguous(a) && ne0 * ne1 == kvr_nelements(a));
    const int64_t ne[2] = { ne0, ne1 };
    const size_t  nb[2] = { 0, kvr_row_size(a->type, ne0) };
    return view_impl(ctx, a, 2, ne, nb, 0);
}

//
// ops: constructors only record the op and its arguments; nothing is computed here
//

static const char * const op_names[KVR_OP_COUNT] = {
#define KVR_OP_NAME(name) #name,
    KVR_OPS(KVR_OP_NAME)
#undef KVR_OP_NAME
};

const char * kvr_op_name(enum kvr_op op) {
    return (unsigned)op < KVR_OP_COUNT ? op_names[op] : "?";
}

// the tensor that owns t's memory (views point at it)
static struct kvr_tensor * mem_owner(struct kvr_tensor * t) {
    return t->view_src ? t->view_src : t;
}

static void set_param_f32(struct kvr_tensor * t, int i, float v) { memcpy(&t->op_params[i], &v, 4); }
static float get_param_f32(const struct kvr_tensor * t, int i) { float v; memcpy(&v, &t->op_params[i], 4); return v; }

static struct kvr_tensor * new_node(struct kvr_context * ctx, enum kvr_op op, enum kvr_type type,
                                    int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    const int64_t ne[4] = { ne0, ne1, ne2, ne3 };
    struct kvr_tensor * t = new_tensor_impl(ctx, type, 4, ne, NULL, 0);
    t->op = op;
    return t;
}

static struct kvr_tensor * new_node_like(struct kvr_context * ctx, enum kvr_op op, const struct kvr_tensor * a) {
    return new_node(ctx, op, KVR_TYPE_F32, a->ne[0], a->ne[1], a->ne[2], a->ne[3]);
}

struct kvr_tensor * kvr_get_rows(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * ids) {
    KVR_ASSERT(ids->type == KVR_TYPE_I32 && ids->ne[1] == 1 && a->ne[2] == 1);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_GET_ROWS, KVR_TYPE_F32, a->ne[0], ids->ne[0], 1, 1);
    t->src[0] = a;
    t->src[1] = ids;
    return t;
}

static struct kvr_tensor * binary_op(struct kvr_context * ctx, enum kvr_op op, struct kvr_tensor * a, struct kvr_tensor * b) {
    KVR_ASSERT(a->type == KVR_TYPE_F32 && b->type == KVR_TYPE_F32);
    KVR_ASSERT(a->ne[0] == b->ne[0] && (kvr_nrows(b) == 1 || kvr_nrows(b) == kvr_nrows(a)));
    struct kvr_tensor * t = new_node_like(ctx, op, a);
    t->src[0] = a;
    t->src[1] = b;
    return t;
}

struct kvr_tensor * kvr_add(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    return binary_op(ctx, KVR_OP_ADD, a, b);
}

struct kvr_tensor * kvr_mul(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    return binary_op(ctx, KVR_OP_MUL, a, b);
}

static struct kvr_tensor * unary_op(struct kvr_context * ctx, enum kvr_op op, struct kvr_tensor * a) {
    KVR_ASSERT(a->type == KVR_TYPE_F32);
    struct kvr_tensor * t = new_node_like(ctx, op, a);
    t->src[0] = a;
    return t;
}

struct kvr_tensor * kvr_scale(struct kvr_context * ctx, struct kvr_tensor * a, float s) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_SCALE, a);
    set_param_f32(t, 0, s);
    return t;
}

struct kvr_tensor * kvr_rms_norm(struct kvr_context * ctx, struct kvr_tensor * a, float eps) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_RMS_NORM, a);
    set_param_f32(t, 0, eps);
    return t;
}

struct kvr_tensor * kvr_norm(struct kvr_context * ctx, struct kvr_tensor * a, float eps) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_NORM, a);
    set_param_f32(t, 0, eps);
    return t;
}

struct kvr_tensor * kvr_silu(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_SILU, a);
}

struct kvr_tensor * kvr_gelu(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_GELU, a);
}

struct kvr_tensor * kvr_mul_mat(struct kvr_context * ctx, struct kvr_tensor * w, struct kvr_tensor * x) {
    KVR_ASSERT(w->ne[0] == x->ne[0] && w->ne[2] == 1 && w->ne[3] == 1);
    KVR_ASSERT(x->type == KVR_TYPE_F32 && x->nb[0] == sizeof(float));
    KVR_ASSERT(w->nb[0] == kvr_type_size(w->type));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MUL_MAT, KVR_TYPE_F32, w->ne[1], x->ne[1], x->ne[2], x->ne[3]);
    t->src[0] = w;
    t->src[1] = x;
    return t;
}

struct kvr_tensor * kvr_rope(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * pos,
                             int n_rot, enum kvr_rope_mode mode, float freq_base, float freq_scale) {
    KVR_ASSERT(a->type == KVR_TYPE_F32 && pos->type == KVR_TYPE_I32 && pos->ne[0] == a->ne[2]);
    KVR_ASSERT(n_rot > 0 && n_rot % 2 == 0 && n_rot <= a->ne[0]);
    struct kvr_tensor * t = new_node_like(ctx, KVR_OP_ROPE, a);
    t->src[0] = a;
    t->src[1] = pos;
    t->op_params[0] = n_rot;
    t->op_params[1] = mode;
    set_param_f32(t, 2, freq_base);
    set_param_f32(t, 3, freq_scale);
    return t;
}

struct kvr_tensor * kvr_cpy(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    KVR_ASSERT(kvr_nelements(a) == kvr_nelements(b) && a->type == KVR_TYPE_F32);
    KVR_ASSERT(b->type == KVR_TYPE_F32 || b->type == KVR_TYPE_F16);
    const int64_t ne[4] = { b->ne[0], b->ne[1], b->ne[2], b->ne[3] };
    struct kvr_tensor * t = new_tensor_impl(ctx, b->type, 4, ne, b, 0);
    memcpy(t->nb, b->nb, sizeof(t->nb));
    t->op     = KVR_OP_CPY;
    t->src[0] = a;
    t->src[1] = b;
    return t;
}

struct kvr_tensor * kvr_cont(struct kvr_context * ctx, struct kvr_tensor * a) {
    KVR_ASSERT(a->type == KVR_TYPE_F32);
    struct kvr_tensor * t = new_node_like(ctx, KVR_OP_CPY, a);
    t->src[0] = a;
    return t;
}

struct kvr_tensor * kvr_kv_store(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * dst) {
    struct kvr_tensor * t = kvr_cpy(ctx, a, dst);
    t->op = KVR_OP_KV_STORE;
    return t;
}

struct kvr_tensor * kvr_attn_block(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                   struct kvr_tensor * v, struct kvr_tensor * pos, int il) {
    KVR_ASSERT(q->ne[2] == k->ne[2] && k->ne[2] == v->ne[2] && pos->ne[0] == q->ne[2]);
    KVR_ASSERT(q->ne[0] == k->ne[0] && k->ne[0] == v->ne[0] && k->ne[1] == v->ne[1]);
    KVR_ASSERT(q->ne[1] % k->ne[1] == 0);
    const int64_t n_head = q->ne[1];
    struct kvr_tensor * t = new_node(ctx, KVR_OP_ATTN_BLOCK, KVR_TYPE_F32, q->ne[0] * n_head + n_head, q->ne[2], 1, 1);
    t->src[0] = q;
    t->src[1] = k;
    t->src[2] = v;
    t->src[3] = pos;
    t->op_params[0] = il;
    return t;
}

struct kvr_tensor * kvr_attn(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                             struct kvr_tensor * v, struct kvr_tensor * qpos, struct kvr_tensor * kpos,
                             struct kvr_tensor * dep, float scale, enum kvr_attn_mode mode) {
    KVR_ASSERT(q->type == KVR_TYPE_F32 && k->type == KVR_TYPE_F32 && v->type == KVR_TYPE_F32);
    KVR_ASSERT(q->ne[0] == k->ne[0] && k->ne[0] == v->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2]);
    KVR_ASSERT(q->ne[1] % k->ne[1] == 0 && q->nb[0] == 4 && k->nb[0] == 4 && v->nb[0] == 4);
    KVR_ASSERT(qpos->type == KVR_TYPE_I32 && kpos->type == KVR_TYPE_I32);
    KVR_ASSERT(qpos->ne[0] == q->ne[2] && kpos->ne[0] == k->ne[2]);
    const int64_t n_head = q->ne[1];
    struct kvr_tensor * t = new_node(ctx, KVR_OP_ATTN, KVR_TYPE_F32, q->ne[0] * n_head + n_head, q->ne[2], 1, 1);
    t->src[0] = q;
    t->src[1] = k;
    t->src[2] = v;
    t->src[3] = qpos;
    t->src[4] = kpos;
    t->src[5] = dep;
    t->op_params[0] = mode;
    t->op_params[1] = (int32_t)n_head;
    set_param_f32(t, 2, scale);
    return t;
}

struct kvr_tensor * kvr_merge_attn(struct kvr_context * ctx, struct kvr_tensor ** parts, int n, int n_head) {
    KVR_ASSERT(n >= 1 && n <= KVR_MAX_SRC);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MERGE_ATTN, KVR_TYPE_F32, parts[0]->ne[0], parts[0]->ne[1], 1, 1);
    for (int i = 0; i < n; i++) {
        KVR_ASSERT(parts[i]->ne[0] == parts[0]->ne[0] && parts[i]->ne[1] == parts[0]->ne[1]);
        t->src[i] = parts[i];
    }
    t->op_params[0] = n;
    t->op_params[1] = n_head;
    return t;
}

struct kvr_tensor * kvr_attn_out(struct kvr_context * ctx, struct kvr_tensor * attn, int n_head) {
    return kvr_view_2d(ctx, attn, attn->ne[0] - n_head, attn->ne[1], attn->nb[1], 0);
}

static const char * const tag_kind_names[KVR_TAG_KIND_COUNT] = {
    "K", "V", "key positions", "Q", "query positions", "partial attention", "logits",
};

const char * kvr_tag_kind_name(int kind) {
    return kind >= 0 && kind < KVR_TAG_KIND_COUNT ? tag_kind_names[kind] : "?";
}

// Memory a transfer reads must outlive the graph (sends complete at its end): never reuse it.
static void keep_alive(struct kvr_tensor * t) {
    mem_owner(t)->flags |= KVR_FLAG_OUTPUT;
}

struct kvr_tensor * kvr_send(struct kvr_context * ctx, struct kvr_tensor * src, int peer, int tag) {
    KVR_ASSERT(kvr_is_contiguous(src));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_SEND, KVR_TYPE_I32, 1, 1, 1, 1);
    t->src[0] = src;
    t->op_params[0] = peer;
    t->op_params[1] = tag;
    keep_alive(src);
    return t;
}

struct kvr_tensor * kvr_recv(struct kvr_context * ctx, struct kvr_tensor * dst, int peer, int tag) {
    const int64_t ne[4] = { dst->ne[0], dst->ne[1], dst->ne[2], dst->ne[3] };
    struct kvr_tensor * t = new_tensor_impl(ctx, dst->type, 4, ne, dst, 0);
    memcpy(t->nb, dst->nb, sizeof(t->nb));
    t->op     = KVR_OP_RECV;
    t->src[0] = dst;
    t->op_params[0] = peer;
    t->op_params[1] = tag;
    return t;
}

struct kvr_tensor * kvr_all_gather(struct kvr_context * ctx, struct kvr_tensor * src, struct kvr_tensor * dst,
                                   int n_ranks, int64_t total, int tag) {
    KVR_ASSERT(src->ne[0] == dst->ne[0] && dst->ne[1] == total && src->type == dst->type);
    struct kvr_tensor * t = kvr_recv(ctx, dst, -1, tag);
    t->op     = KVR_OP_ALL_GATHER;
    t->src[0] = src;
    t->src[1] = dst;
    t->op_params[2] = n_ranks;
    memcpy(&t->op_params[3], &total, sizeof(total));
    keep_alive(src);
    return t;
}

struct kvr_tensor * kvr_all_to_all(struct kvr_context * ctx, struct kvr_tensor * src, int n_ranks, int64_t total, int tag) {
    KVR_ASSERT(src->ne[2] == n_ranks && kvr_is_contiguous(src));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_ALL_TO_ALL, src->type, src->ne[0], src->ne[1], src->ne[2], 1);
    t->src[0] = src;
    t->flags |= KVR_FLAG_INPUT; // placed before the graph runs, never reused
    t->op_params[1] = tag;
    t->op_params[2] = n_ranks;
    memcpy(&t->op_params[3], &total, sizeof(total));
    keep_alive(src);
    return t;
}

//
// graphs
//

struct kvr_graph * kvr_graph_new(struct kvr_context * ctx, int size) {
    struct kvr_graph * g = ctx_alloc(ctx, sizeof(struct kvr_graph));
    g->size    = size;
    g->ctx     = ctx;
    g->plan    = NULL;
    g->n_nodes = 0;
    g->n_leafs = 0;
    g->nodes   = ctx_alloc(ctx, sizeof(struct kvr_tensor *) * (size_t)size);
    g->leafs   = ctx_alloc(ctx, sizeof(struct kvr_tensor *) * (size_t)size);
    return g;
}

void kvr_graph_reset(struct kvr_graph * g) {
    g->n_nodes = 0;
    g->n_leafs = 0;
}

// The set of tensors a depth-first build has seen. Marks cannot live in the tensors: weights
// are shared by every rank's graph, and ranks build their graphs at the same time. (stb_ds's
// hash of a pointer shifts a signed int, which UBSan reports; open addressing is a few lines.)
struct ptr_set {
    const void ** keys;
    size_t        cap, n;
};

static size_t ptr_hash(const void * p, size_t cap) {
    return (size_t)(((uintptr_t)p >> 4) * 0x9e3779b97f4a7c15ull) & (cap - 1);
}

static bool ptr_set_insert(struct ptr_set * s, const void * p) { // false if p was there
    if (2 * (s->n + 1) > s->cap) {
        struct ptr_set bigger = { kvr_calloc(s->cap ? 2 * s->cap : 1024, sizeof(void *)), s->cap ? 2 * s->cap : 1024, 0 };
        for (size_t i = 0; i < s->cap; i++) {
            if (s->keys[i]) ptr_set_insert(&bigger, s->keys[i]);
        }
        free(s->keys);
        *s = bigger;
    }
    size_t i = ptr_hash(p, s->cap);
    while (s->keys[i]) {
        if (s->keys[i] == p) return false;
        i = (i + 1) & (s->cap - 1);
    }
    s->keys[i] = p;
    s->n++;
    return true;
}

static void graph_visit(struct kvr_graph * g, struct ptr_set * seen, struct kvr_tensor * t) {
    if (!ptr_set_insert(seen, t)) {
        return;
    }
    for (int i = 0; i < KVR_MAX_SRC; i++) {
        if (t->src[i]) {
            graph_visit(g, seen, t->src[i]);
        }
    }
    if (t->op == KVR_OP_NONE) {
        KVR_ASSERT(g->n_leafs < g->size && "graph too small");
        g->leafs[g->n_leafs++] = t;
    } else {
        KVR_ASSERT(g->n_nodes < g->size && "graph too small");
        g->nodes[g->n_nodes++] = t;
    }
}

void kvr_graph_expand(struct kvr_graph * g, struct kvr_tensor * t) {
    // what earlier expansions added is seen already, so a second output shares their nodes
    struct ptr_set seen = { 0 };
    for (int i = 0; i < g->n_nodes; i++) ptr_set_insert(&seen, g->nodes[i]);
    for (int i = 0; i < g->n_leafs; i++) ptr_set_insert(&seen, g->leafs[i]);
    graph_visit(g, &seen, t);
    free(seen.keys);
}

struct kvr_tensor * kvr_graph_get(const struct kvr_graph * g, const char * name) {
    for (int i = 0; i < g->n_nodes; i++) {
        if (strcmp(g->nodes[i]->name, name) == 0) return g->nodes[i];
    }
    for (int i = 0; i < g->n_leafs; i++) {
        if (strcmp(g->leafs[i]->name, name) == 0) return g->leafs[i];
    }
    return NULL;
}

void kvr_graph_print(const struct kvr_graph * g, FILE * f) {
    fprintf(f, "graph: %d nodes, %d leafs\n", g->n_nodes, g->n_leafs);
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        fprintf(f, "  %4d %-11s [%5" PRId64 ",%5" PRId64 ",%4" PRId64 ",%2" PRId64 "] %-5s %-32s",
                i, kvr_op_name(t->op), t->ne[0], t->ne[1], t->ne[2], t->ne[3], kvr_type_name(t->type), t->name);
        for (int j = 0; j < KVR_MAX_SRC && t->src[j]; j++) {
            fprintf(f, "%s%s", j ? ", " : " <- ", t->src[j]->name);
        }
        if (t->why) {
            fprintf(f, "  # %s", t->why);
        }
        fputc('\n', f);
    }
}

//
// memory planning: one buffer per graph, a node's bytes reused after its last reader ran
//

struct plan_entry {
    struct kvr_tensor * key;
    size_t              offs;
    int                 readers;
};

struct plan_block {
    size_t offs, size;
};

struct plan_state {
    struct plan_entry * map;    // sorted by tensor address, looked up by bisection
    int                 n_map;
    struct plan_block * free;   // stb_ds array, sorted by offset
    size_t              top;    // high-water mark
};

#define PLAN_ALIGN 64

static int plan_cmp(const void * a, const void * b) {
    const uintptr_t x = (uintptr_t)((const struct plan_entry *)a)->key, y = (uintptr_t)((const struct plan_entry *)b)->key;
    return x < y ? -1 : x > y;
}

static struct plan_entry * plan_find(struct plan_state * ps, const struct kvr_tensor * t) {
    struct plan_entry key = { (struct kvr_tensor *)t, 0, 0 };
    return bsearch(&key, ps->map, (size_t)ps->n_map, sizeof(key), plan_cmp);
}

static size_t plan_alloc(struct plan_state * ps, size_t size) {
    size = (size + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    int best = -1;
    for (int i = 0; i < (int)arrlen(ps->free); i++) { // best fit: the smallest block that fits
        if (ps->free[i].size >= size && (best < 0 || ps->free[i].size < ps->free[best].size)) {
            best = i;
        }
    }
    if (best >= 0) {
        size_t offs = ps->free[best].offs;
        ps->free[best].offs += size;
        ps->free[best].size -= size;
        if (ps->free[best].size == 0) {
            arrdel(ps->free, best);
        }
        return offs;
    }
    // grow: if the last free block ends at the top, extend it
    int n = (int)arrlen(ps->free);
    if (n > 0 && ps->free[n - 1].offs + ps->free[n - 1].size == ps->top) {
        size_t offs = ps->free[n - 1].offs;
        ps->top = offs + size;
        arrdel(ps->free, n - 1);
        return offs;
    }
    size_t offs = ps->top;
    ps->top += size;
    return offs;
}

static void plan_release(struct plan_state * ps, size_t offs, size_t size) {
    size = (size + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    int i = 0;
    while (i < (int)arrlen(ps->free) && ps->free[i].offs < offs) i++;
    struct plan_block b = { offs, size };
    arrins(ps->free, i, b);
    // merge with the next and the previous block
    if (i + 1 < (int)arrlen(ps->free) && ps->free[i].offs + ps->free[i].size == ps->free[i + 1].offs) {
        ps->free[i].size += ps->free[i + 1].size;
        arrdel(ps->free, i + 1);
    }
    if (i > 0 && ps->free[i - 1].offs + ps->free[i - 1].size == ps->free[i].offs) {
        ps->free[i - 1].size += ps->free[i].size;
        arrdel(ps->free, i);
    }
}

static bool needs_alloc(const struct kvr_tensor * t) {
    return t->data == NULL && t->view_src == NULL;
}

// a planned buffer that is never released: inputs (and receive buffers) and outputs
static bool plan_pinned(const struct kvr_tensor * t) {
    return (t->flags & (KVR_FLAG_INPUT | KVR_FLAG_OUTPUT)) != 0;
}

size_t kvr_graph_plan(struct kvr_graph * g) {
    struct plan_state ps = { 0 };
    // a view read as an output keeps its owner's memory too
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->view_src && (t->flags & KVR_FLAG_OUTPUT)) t->view_src->flags |= KVR_FLAG_OUTPUT;
    }
    ps.map = kvr_malloc(sizeof(struct plan_entry) * (size_t)(g->n_nodes + g->n_leafs + 1));
    for (int i = 0; i < g->n_leafs; i++) {
        if (needs_alloc(g->leafs[i])) ps.map[ps.n_map++] = (struct plan_entry) { g->leafs[i], 0, 0 };
    }
    for (int i = 0; i < g->n_nodes; i++) {
        if (needs_alloc(g->nodes[i])) ps.map[ps.n_map++] = (struct plan_entry) { g->nodes[i], 0, 0 };
    }
    qsort(ps.map, (size_t)ps.n_map, sizeof(struct plan_entry), plan_cmp);
    // inputs (leafs without data, receive buffers) are placed first and never released
    for (int i = 0; i < g->n_leafs; i++) {
        struct kvr_tensor * t = g->leafs[i];
        if (needs_alloc(t)) plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (needs_alloc(t) && (t->flags & KVR_FLAG_INPUT)) plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
    }
    // count the readers of every planned buffer
    for (int i = 0; i < g->n_nodes; i++) {
        for (int j = 0; j < KVR_MAX_SRC; j++) {
            struct kvr_tensor * s = g->nodes[i]->src[j];
            struct plan_entry * e = s ? plan_find(&ps, mem_owner(s)) : NULL;
            if (e) e->readers++;
        }
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (needs_alloc(t) && !(t->flags & KVR_FLAG_INPUT)) {
            plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
        }
        for (int j = 0; j < KVR_MAX_SRC; j++) {
            struct kvr_tensor * s = t->src[j];
            if (!s) continue;
            struct kvr_tensor * o = mem_owner(s);
            struct plan_entry * e = plan_find(&ps, o);
            if (!e || o->op == KVR_OP_NONE || plan_pinned(o)) continue;
            // a tensor read twice by the same node is counted twice above; release once at zero
            if (--e->readers == 0) {
                plan_release(&ps, e->offs, kvr_nbytes(o));
            }
        }
    }
    arrfree(ps.free);
    if (g->plan) free(g->plan);
    // keep the placements for kvr_graph_place: a count, then the entries
    struct plan_entry * keep = kvr_malloc(sizeof(struct plan_entry) * (size_t)(ps.n_map + 1));
    keep[0].offs = (size_t)ps.n_map;
    memcpy(keep + 1, ps.map, sizeof(struct plan_entry) * (size_t)ps.n_map);
    free(ps.map);
    g->plan = keep;
    return ps.top ? ps.top : PLAN_ALIGN;
}

void kvr_graph_place(struct kvr_graph * g, void * buf) {
    KVR_ASSERT(g->plan != NULL && ((uintptr_t)buf % PLAN_ALIGN) == 0);
    struct plan_entry * map = g->plan;
    const size_t n = map[0].offs;
    for (size_t i = 1; buf && i <= n; i++) {
        map[i].key->data = (uint8_t *)buf + map[i].offs;
    }
    for (int i = 0; buf && i < g->n_nodes; i++) { // views see their owner's memory
        struct kvr_tensor * t = g->nodes[i];
        if (t->view_src) {
            t->data = (uint8_t *)t->view_src->data + t->view_offs;
        }
    }
    free(g->plan);
    g->plan = NULL;
}

void kvr_replace_node(struct kvr_tensor * node, const struct kvr_tensor * by, const char * why) {
    char name[KVR_MAX_NAME];
    snprintf(name, sizeof(name), "%s", node->name[0] ? node->name : "attn");
    const int flags = node->flags;
    void * data = node->data;
    *node = *by;
    snprintf(node->name, sizeof(node->name), "%s", name);
    node->flags = flags | by->flags;
    if (data) node->data = data; // the caller placed it: keep it
    node->why = why;
}

//
// the single-rank strategy pass: ATTN_BLOCK -> KV_STORE + KV_STORE + ATTN over the cache
//

void kvr_pass_single(struct kvr_context * ctx, struct kvr_graph * g, struct kvr_kv_cache * cache,
                     int n_past, struct kvr_tensor * kpos, enum kvr_attn_mode mode) {
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op != KVR_OP_ATTN_BLOCK) continue;
        struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
        const int il = t->op_params[0];
        const int64_t D = k->ne[0], Hkv = k->ne[1], T = k->ne[2];
        KVR_ASSERT(D * Hkv == cache->kv_dim && n_past + T <= cache->n_ctx && kpos->ne[0] == n_past + T);
        struct kvr_tensor * kc = cache->k[il], * vc = cache->v[il];
        const size_t row = kc->nb[1];
        struct kvr_tensor * k_dst = kvr_view_2d(ctx, kc, cache->kv_dim, T, row, (size_t)n_past * row);
        struct kvr_tensor * v_dst = kvr_view_2d(ctx, vc, cache->kv_dim, T, row, (size_t)n_past * row);
        struct kvr_tensor * k_new = kvr_reshape_2d(ctx, k, cache->kv_dim, T);
        struct kvr_tensor * v_new = kvr_reshape_2d(ctx, v, cache->kv_dim, T);
        struct kvr_tensor * ks = kvr_set_name(kvr_kv_store(ctx, k_new, k_dst), "blk.%d.k_store", il);
        struct kvr_tensor * vs = kvr_set_name(kvr_kv_store(ctx, v_new, v_dst), "blk.%d.v_store", il);
        ks->why = vs->why = "single: append this batch's K/V at [n_past, n_past+T)";
        // the ATTN reads the cache through views that depend on both stores
        vs->src[2] = ks;
        struct kvr_tensor * kall = kvr_view_3d(ctx, kc, D, Hkv, n_past + T, D * sizeof(float), row, 0);
        struct kvr_tensor * vall = kvr_view_3d(ctx, vc, D, Hkv, n_past + T, D * sizeof(float), row, 0);
        struct kvr_tensor * a = kvr_attn(ctx, q, kall, vall, pos, kpos, vs, 1.0f / sqrtf((float)D), mode);
        // turn the ATTN_BLOCK node itself into the ATTN, so its readers need no rewiring
        kvr_replace_node(t, a, "single: causal attention over cache[0, n_past+T)");
    }
}

//
// CPU backend: a pool of threads walks the graph together; every node is split by rows
// between them (ith of nth), with a barrier between nodes.
//

struct cpu_params {
    int     ith, nth;
    float * wdata;     // this thread's scratch (weight blocks converted to f32, score tiles)
    size_t  wsize;     // floats
    struct kvr_counters * counters; // this thread's, summed after the graph
};

struct cpu_backend {
    int                 n_threads;
    pthread_t         * threads;
    pthread_mutex_t     mu;
    pthread_cond_t      cv;
    int                 generation;   // bumped to start a graph; workers wait for a change
    bool                stop;
    struct kvr_graph  * graph;
    atomic_int          barrier_count;
    atomic_int          barrier_gen;
    atomic_int          done_count;
    float            ** wdata;        // per thread
    size_t              wsize;
    struct kvr_counters counters;
    struct kvr_counters thread_counters[KVR_MAX_THREADS];
    struct kvr_comm   * comm;
    atomic_int          status;       // first error of a comm node; every thread stops on it
    bool                trace;
    struct kvr_span   * spans;        // stb_ds array
    int                 span_layer;   // layer of the open compute span (-1: none)
};

static void cpu_compute_node(const struct cpu_params * p, struct kvr_tensor * t);

static void cpu_barrier(struct cpu_backend * cb) {
    if (cb->n_threads == 1) return;
    const int gen = atomic_load(&cb->barrier_gen);
    if (atomic_fetch_add(&cb->barrier_count, 1) == cb->n_threads - 1) {
        atomic_store(&cb->barrier_count, 0);
        atomic_fetch_add(&cb->barrier_gen, 1);
        return;
    }
    // spin briefly (nodes are short), then yield so oversubscribed ranks still progress
    for (int spins = 0; atomic_load(&cb->barrier_gen) == gen; spins++) {
        if (spins > 2000) sched_yield();
    }
}

static bool node_is_noop(const struct kvr_tensor * t) {
    return t->op == KVR_OP_NONE || t->op == KVR_OP_VIEW;
}

static bool node_is_comm(const struct kvr_tensor * t) {
    return t->op == KVR_OP_SEND || t->op == KVR_OP_RECV || t->op == KVR_OP_ALL_GATHER || t->op == KVR_OP_ALL_TO_ALL;
}

// the layer a node belongs to, from its name ("blk.12.ffn_up"), or -1
static int node_layer(const struct kvr_tensor * t) {
    if (strncmp(t->name, "blk.", 4) != 0) return -1;
    return atoi(t->name + 4);
}

static void trace_node(struct cpu_backend * cb, const struct kvr_tensor * t, double t0, double t1) {
    if (node_is_comm(t)) {
        struct kvr_span sp = { .t0 = t0, .t1 = t1, .cat = 'c' };
        const int tag = t->op_params[1];
        const char * kind = kvr_tag_kind_name(kvr_tag_kind(tag));
        if (t->op == KVR_OP_SEND || t->op == KVR_OP_RECV) {
            snprintf(sp.name, sizeof(sp.name), "%s %s L%d s%d %s %d", t->op == KVR_OP_SEND ? "send" : "recv", kind,
                     kvr_tag_layer(tag), kvr_tag_step(tag), t->op == KVR_OP_SEND ? "to" : "from", t->op_params[0]);
        } else {
            snprintf(sp.name, sizeof(sp.name), "%s %s L%d", t->op == KVR_OP_ALL_GATHER ? "all-gather" : "all-to-all",
                     kind, kvr_tag_layer(tag));
        }
        arrput(cb->spans, sp);
        cb->span_layer = -1;
        return;
    }
    const int il = node_layer(t);
    const int n = (int)arrlen(cb->spans);
    if (il >= 0 && cb->span_layer == il && n > 0 && cb->spans[n - 1].cat == 'l') {
        cb->spans[n - 1].t1 = t1; // extend the open layer span
        return;
    }
    struct kvr_span sp = { .t0 = t0, .t1 = t1, .cat = 'l' };
    if (il >= 0) snprintf(sp.name, sizeof(sp.name), "layer %d", il);
    else snprintf(sp.name, sizeof(sp.name), "%.40s", t->name[0] ? t->name : kvr_op_name(t->op));
    arrput(cb->spans, sp);
    cb->span_layer = il;
}

static void cpu_run_graph(struct cpu_backend * cb, int ith) {
    struct kvr_graph * g = cb->graph;
    struct cpu_params p = { ith, cb->n_threads, cb->wdata[ith], cb->wsize, &cb->thread_counters[ith] };
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (node_is_noop(t)) continue;
        const double t0 = ith == 0 && cb->trace ? kvr_time_ms() : 0.0;
        if (node_is_comm(t)) {
            // transfers run on one thread; the others wait at the barrier
            if (ith == 0) {
                int rc = cb->comm ? cb->comm->iface.exec(cb->comm, t)
                                  : kvr_error(KVR_ERR_ARG, "graph node '%s' (%s) needs a communicator", t->name, kvr_op_name(t->op));
                if (rc != KVR_OK) atomic_store(&cb->status, rc);
            }
        } else {
            cpu_compute_node(&p, t);
        }
        cpu_barrier(cb);
        if (ith == 0 && cb->trace) trace_node(cb, t, t0, kvr_time_ms());
        if (atomic_load(&cb->status) != KVR_OK) break;
    }
}

static void * cpu_worker(void * arg) {
    struct cpu_backend * cb = ((void **)arg)[0];
    const int ith = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    int seen = 0;
    for (;;) {
        pthread_mutex_lock(&cb->mu);
        while (cb->generation == seen && !cb->stop) {
            pthread_cond_wait(&cb->cv, &cb->mu);
        }
        if (cb->stop) {
            pthread_mutex_unlock(&cb->mu);
            return NULL;
        }
        seen = cb->generation;
        pthread_mutex_unlock(&cb->mu);
        cpu_run_graph(cb, ith);
        atomic_fetch_add(&cb->done_count, 1);
    }
}

static size_t cpu_scratch_floats(const struct kvr_graph * g) {
    // matmul converts up to MM_BLOCK_BYTES of weight rows at a time; attention keeps a query
    // tile, a score tile and an output tile
    size_t need = 1 << 16;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_MUL_MAT || t->op == KVR_OP_GET_ROWS) {
            size_t n = (size_t)t->src[0]->ne[0] * 2 + (1u << 18);
            if (n > need) need = n;
        }
        if (t->op == KVR_OP_ATTN) {
            size_t D = (size_t)t->src[0]->ne[0];
            size_t n = 64 * D * 2 + 64 * 256 + 4 * 64 + 1024;
            if (n > need) need = n;
        }
    }
    return need;
}

static void cpu_ensure_scratch(struct cpu_backend * cb, size_t floats) {
    if (floats <= cb->wsize) return;
    for (int i = 0; i < cb->n_threads; i++) {
        free(cb->wdata[i]);
        cb->wdata[i] = kvr_malloc(floats * sizeof(float));
    }
    cb->wsize = floats;
}

static int cpu_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    struct cpu_backend * cb = be->context;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_ATTN_BLOCK) {
            return kvr_error(KVR_ERR_ARG, "graph node '%s' is an ATTN_BLOCK: run a strategy pass first", t->name);
        }
        if (!node_is_noop(t) && !t->data) {
            return kvr_error(KVR_ERR_ARG, "graph node '%s' has no memory: plan and place the graph first", t->name);
        }
    }
    cpu_ensure_scratch(cb, cpu_scratch_floats(g));
    const double t0 = kvr_time_ms();
    atomic_store(&cb->status, KVR_OK);
    cb->span_layer = -1;
    // receives are posted before anything runs, so transfers overlap the compute before them
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->op != KVR_OP_RECV) continue;
        if (!cb->comm) return kvr_error(KVR_ERR_ARG, "graph node '%s' (RECV) needs a communicator", g->nodes[i]->name);
        int rc = cb->comm->iface.post_recv(cb->comm, g->nodes[i]);
        if (rc != KVR_OK) return rc;
    }
    cb->graph = g;
    if (cb->n_threads > 1) {
        atomic_store(&cb->done_count, 0);
        pthread_mutex_lock(&cb->mu);
        cb->generation++;
        pthread_cond_broadcast(&cb->cv);
        pthread_mutex_unlock(&cb->mu);
    }
    cpu_run_graph(cb, 0);
    while (cb->n_threads > 1 && atomic_load(&cb->done_count) < cb->n_threads - 1) {
        sched_yield();
    }
    cb->graph = NULL;
    for (int i = 0; i < cb->n_threads; i++) {
        cb->counters.attn_dot_dense  += cb->thread_counters[i].attn_dot_dense;
        cb->counters.attn_dot_causal += cb->thread_counters[i].attn_dot_causal;
        cb->counters.matmul_flops    += cb->thread_counters[i].matmul_flops;
        memset(&cb->thread_counters[i], 0, sizeof(cb->thread_counters[i]));
    }
    cb->counters.compute_ms += kvr_time_ms() - t0;
    int rc = atomic_load(&cb->status);
    if (cb->comm) {
        // outstanding sends complete (or time out) even when the graph failed
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
        int rc2 = cb->comm->iface.finish(cb->comm);
        if (rc != KVR_OK) kvr_error(rc, "%s", msg);
        else rc = rc2;
    }
    return rc;
}

static const char * cpu_name(struct kvr_backend * be) { (void)be; return "cpu"; }

static bool cpu_supports_op(struct kvr_backend * be, const struct kvr_tensor * t) {
    (void)be;
    switch (t->op) {
        case KVR_OP_ATTN_BLOCK: return false;
        case KVR_OP_MUL_MAT:
        case KVR_OP_GET_ROWS:   return kvr_type_supported(t->src[0]->type);
        default:                return (unsigned)t->op < KVR_OP_COUNT;
    }
}

static void * cpu_buf_alloc(struct kvr_backend * be, size_t size) {
    (void)be;
    void * p = NULL;
    if (posix_memalign(&p, PLAN_ALIGN, size ? size : PLAN_ALIGN) != 0) return NULL;
    return p;
}

static void cpu_buf_free(struct kvr_backend * be, void * buf) { (void)be; free(buf); }

static void cpu_tensor_set(struct kvr_backend * be, struct kvr_tensor * t, const void * src, size_t off, size_t n) {
    (void)be;
    memcpy((uint8_t *)t->data + off, src, n);
}

static void cpu_tensor_get(struct kvr_backend * be, const struct kvr_tensor * t, void * dst, size_t off, size_t n) {
    (void)be;
    memcpy(dst, (const uint8_t *)t->data + off, n);
}

static void cpu_synchronize(struct kvr_backend * be) { (void)be; }

static void cpu_stop_threads(struct cpu_backend * cb) {
    if (cb->n_threads <= 1) return;
    pthread_mutex_lock(&cb->mu);
    cb->stop = true;
    pthread_cond_broadcast(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    for (int i = 1; i < cb->n_threads; i++) {
        pthread_join(cb->threads[i], NULL);
    }
    cb->stop = false;
}

static void cpu_start_threads(struct cpu_backend * cb, int n_threads) {
    cb->n_threads = n_threads;
    cb->threads = realloc(cb->threads, sizeof(pthread_t) * (size_t)n_threads);
    cb->wdata   = realloc(cb->wdata, sizeof(float *) * (size_t)n_threads);
    KVR_ASSERT(cb->threads && cb->wdata);
    for (int i = 0; i < n_threads; i++) {
        cb->wdata[i] = kvr_malloc(cb->wsize * sizeof(float));
    }
    cb->generation = 0;
    for (int i = 1; i < n_threads; i++) {
        void ** arg = kvr_malloc(2 * sizeof(void *));
        arg[0] = cb;
        arg[1] = (void *)(intptr_t)i;
        int rc = pthread_create(&cb->threads[i], NULL, cpu_worker, arg);
        KVR_ASSERT(rc == 0);
    }
}

static void cpu_free(struct kvr_backend * be) {
    struct cpu_backend * cb = be->context;
    cpu_stop_threads(cb);
    for (int i = 0; i < cb->n_threads; i++) free(cb->wdata[i]);
    free(cb->wdata);
    free(cb->threads);
    arrfree(cb->spans);
    pthread_mutex_destroy(&cb->mu);
    pthread_cond_destroy(&cb->cv);
    free(cb);
    free(be);
}

struct kvr_backend * kvr_backend_cpu_new(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > KVR_MAX_THREADS) n_threads = KVR_MAX_THREADS;
    // each of our threads runs its own single-threaded sgemm on its share of the rows
    openblas_set_num_threads(1);
    struct cpu_backend * cb = kvr_calloc(1, sizeof(*cb));
    pthread_mutex_init(&cb->mu, NULL);
    pthread_cond_init(&cb->cv, NULL);
    cb->wsize = 1 << 16;
    cpu_start_threads(cb, n_threads);
    struct kvr_backend * be = kvr_calloc(1, sizeof(*be));
    be->iface = (struct kvr_backend_i) {
        .name          = cpu_name,
        .free          = cpu_free,
        .supports_op   = cpu_supports_op,
        .buf_alloc     = cpu_buf_alloc,
        .buf_free      = cpu_buf_free,
        .tensor_set    = cpu_tensor_set,
        .tensor_get    = cpu_tensor_get,
        .graph_compute = cpu_graph_compute,
        .synchronize   = cpu_synchronize,
    };
    be->context = cb;
    return be;
}

void kvr_backend_cpu_set_threads(struct kvr_backend * be, int n_threads) {
    struct cpu_backend * cb = be->context;
    if (n_threads > KVR_MAX_THREADS) n_threads = KVR_MAX_THREADS;
    if (n_threads <= 0 || n_threads == cb->n_threads) return;
    cpu_stop_threads(cb);
    for (int i = 0; i < cb->n_threads; i++) free(cb->wdata[i]);
    cpu_start_threads(cb, n_threads);
}

void kvr_backend_cpu_set_comm(struct kvr_backend * be, struct kvr_comm * comm) {
    ((struct cpu_backend *)be->context)->comm = comm;
}

void kvr_backend_cpu_set_trace(struct kvr_backend * be, bool on) {
    ((struct cpu_backend *)be->context)->trace = on;
}

const struct kvr_span * kvr_backend_cpu_spans(struct kvr_backend * be, int * n, bool reset) {
    struct cpu_backend * cb = be->context;
    *n = (int)arrlen(cb->spans);
    if (reset) arrsetlen(cb->spans, 0);
    return cb->spans;
}

void kvr_backend_free(struct kvr_backend * be) {
    if (be) be->iface.free(be);
}

int kvr_backend_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    return be->iface.graph_compute(be, g);
}

bool kvr_backend_supports_op(struct kvr_backend * be, const struct kvr_tensor * op) {
    return be->iface.supports_op(be, op);
}

void kvr_backend_cpu_counters(struct kvr_backend * be, struct kvr_counters * out, bool reset) {
    struct cpu_backend * cb = be->context;
    if (out) *out = cb->counters;
    if (reset) memset(&cb->counters, 0, sizeof(cb->counters));
}

int kvr_graph_compute_cpu(struct kvr_graph * g, int n_threads) {
    size_t size = kvr_graph_plan(g);
    void * buf = NULL;
    if (posix_memalign(&buf, PLAN_ALIGN, size) != 0) {
        return kvr_error(KVR_ERR_NOMEM, "cannot allocate %zu bytes for the graph", size);
    }
    kvr_graph_place(g, buf);
    struct kvr_backend * be = kvr_backend_cpu_new(n_threads);
    int rc = kvr_backend_graph_compute(be, g);
    kvr_backend_free(be);
    // nodes keep pointers into buf and the caller reads the outputs through them: the buffer
    // lives as long as the graph's context
    arrput(g->ctx->bufs, buf);
    return rc;
}

//
// CPU kernels. Each takes the thread's (ith, nth) and does its share of the rows.
//

static inline void row_range(int64_t n, int ith, int nth, int64_t * r0, int64_t * r1) {
    *r0 = n * ith / nth;
    *r1 = n * (ith + 1) / nth;
}

// address of row (i1, i2, i3) of t
static inline void * row_ptr(const struct kvr_tensor * t, int64_t i1, int64_t i2, int64_t i3) {
    return (uint8_t *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

// the flat row index r of t as (i1, i2, i3)
static inline void * row_ptr_flat(const struct kvr_tensor * t, int64_t r) {
    const int64_t i1 = r % t->ne[1];
    const int64_t i2 = (r / t->ne[1]) % t->ne[2];
    const int64_t i3 = r / (t->ne[1] * t->ne[2]);
    return row_ptr(t, i1, i2, i3);
}

static void cpu_op_get_rows(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * ids = dst->src[1];
    const to_float_fn to_float = type_to_float(a->type);
    int64_t r0, r1;
    row_range(ids->ne[0], p->ith, p->nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        const int32_t id = ((const int32_t *)ids->data)[i];
        KVR_ASSERT(id >= 0 && id < a->ne[1]); // token ids are checked against n_vocab at eval
        to_float(row_ptr(a, id, 0, 0), row_ptr(dst, i, 0, 0), a->ne[0]);
    }
}

static void cpu_op_binary(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t n = a->ne[0];
    const bool bcast = kvr_nrows(b) == 1;
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        const float * y = bcast ? (const float *)b->data : (const float *)row_ptr_flat(b, r);
        float * z = row_ptr_flat(dst, r);
        if (dst->op == KVR_OP_ADD) {
            for (int64_t i = 0; i < n; i++) z[i] = x[i] + y[i];
        } else {
            for (int64_t i = 0; i < n; i++) z[i] = x[i] * y[i];
        }
    }
}

static void cpu_op_unary(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const float s = get_param_f32(dst, 0);
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        switch (dst->op) {
            case KVR_OP_SCALE:
                for (int64_t i = 0; i < n; i++) y[i] = x[i] * s;
                break;
            case KVR_OP_SILU:
                for (int64_t i = 0; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
                break;
            case KVR_OP_GELU: {
                const float c = 0.79788456080286535588f; // sqrt(2/pi)
                for (int64_t i = 0; i < n; i++) {
                    const float v = x[i];
                    y[i] = 0.5f * v * (1.0f + tanhf(c * v * (1.0f + 0.044715f * v * v)));
                }
            } break;
            default:
                KVR_ASSERT(!"not a unary op");
        }
    }
}

static void cpu_op_norm(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const float eps = get_param_f32(dst, 0);
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        // sums in double, as GGML does, so long rows agree with llama.cpp to the last bits
        if (dst->op == KVR_OP_RMS_NORM) {
            double sum = 0.0;
            for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
            const float scale = 1.0f / sqrtf((float)(sum / n) + eps);
            for (int64_t i = 0; i < n; i++) y[i] = x[i] * scale;
        } else {
            double sum = 0.0;
            for (int64_t i = 0; i < n; i++) sum += (double)x[i];
            const float mean = (float)(sum / n);
            double var = 0.0;
            for (int64_t i = 0; i < n; i++) {
                const float d = x[i] - mean;
                y[i] = d;
                var += (double)(d * d);
            }
            const float scale = 1.0f / sqrtf((float)(var / n) + eps);
            for (int64_t i = 0; i < n; i++) y[i] *= scale;
        }
    }
}

// Bytes of weight rows converted to f32 per sgemm call: large enough for sgemm to reach its
// peak, small enough to stay in L2/L3 while all the tokens stream past it.
#define MM_BLOCK_BYTES (1u << 20)

static void cpu_op_mul_mat(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1];
    const int64_t T = x->ne[1] * x->ne[2] * x->ne[3];
    // rows of x must be evenly strided to hand them to sgemm as one matrix
    KVR_ASSERT(x->ne[2] == 1 || x->nb[2] == x->nb[1] * (size_t)x->ne[1]);
    KVR_ASSERT(x->ne[3] == 1 || x->nb[3] == x->nb[2] * (size_t)x->ne[2]);
    KVR_ASSERT(kvr_is_contiguous(dst));
    const int lda = (int)(x->nb[1] / sizeof(float));
    const float * X = x->data;
    float * Y = dst->data;
    int64_t n0, n1;
    row_range(N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return;
    if (w->type == KVR_TYPE_F32) {
        const float * W = (const float *)((const uint8_t *)w->data + n0 * w->nb[1]);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)(n1 - n0), (int)K,
                    1.0f, X, lda, W, (int)(w->nb[1] / sizeof(float)), 0.0f, Y + n0, (int)N);
    } else {
        const to_float_fn to_float = type_to_float(w->type);
        int64_t rows = (int64_t)(MM_BLOCK_BYTES / (K * sizeof(float)));
        if (rows < 1) rows = 1;
        if ((size_t)(rows * K) > p->wsize) rows = (int64_t)p->wsize / K;
        KVR_ASSERT(rows >= 1);
        for (int64_t b0 = n0; b0 < n1; b0 += rows) {
            const int64_t nb = b0 + rows <= n1 ? rows : n1 - b0;
            for (int64_t r = 0; r < nb; r++) {
                to_float((const uint8_t *)w->data + (b0 + r) * w->nb[1], p->wdata + r * K, K);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)nb, (int)K,
                        1.0f, X, lda, p->wdata, (int)K, 0.0f, Y + b0, (int)N);
        }
    }
    p->counters->matmul_flops += 2 * K * (n1 - n0) * T;
}

static void cpu_op_rope(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * pos = dst->src[1];
    const int n_rot = dst->op_params[0];
    const int mode = dst->op_params[1];
    const float freq_base = get_param_f32(dst, 2), freq_scale = get_param_f32(dst, 3);
    const int64_t D = a->ne[0], H = a->ne[1], T = a->ne[2];
    // theta_i = pos * base^(-2i/n_rot), stepped by repeated multiplication as GGML does
    const float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
    int64_t r0, r1;
    row_range(T, p->ith, p->nth, &r0, &r1);
    float cs[2 * 512];
    KVR_ASSERT(n_rot <= 1024);
    for (int64_t t = r0; t < r1; t++) {
        float theta = (float)((const int32_t *)pos->data)[t];
        for (int i = 0; i < n_rot / 2; i++) {
            const float th = theta * freq_scale;
            cs[2 * i]     = cosf(th);
            cs[2 * i + 1] = sinf(th);
            theta *= theta_scale;
        }
        for (int64_t h = 0; h < H; h++) {
            const float * x = row_ptr(a, h, t, 0);
            float * y = row_ptr(dst, h, t, 0);
            for (int i = 0; i < n_rot / 2; i++) {
                const int i0 = mode == KVR_ROPE_NEOX ? i : 2 * i;
                const int i1 = mode == KVR_ROPE_NEOX ? i + n_rot / 2 : 2 * i + 1;
                const float x0 = x[i0], x1 = x[i1];
                y[i0] = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
                y[i1] = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
            }
            for (int64_t i = n_rot; i < D; i++) y[i] = x[i];
        }
    }
}

static void cpu_op_cpy(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    // dst may have another shape with the same element count: copy element by element when the
    // row lengths differ, row by row (the common case: cache stores) when they match
    if (dst->ne[0] == n) {
        for (int64_t r = r0; r < r1; r++) {
            const float * x = row_ptr_flat(a, r);
            void * y = row_ptr_flat(dst, r);
            if (dst->type == KVR_TYPE_F32) memcpy(y, x, (size_t)n * sizeof(float));
            else f16_from_float(x, y, n);
        }
    } else {
        KVR_ASSERT(kvr_is_contiguous(dst));
        for (int64_t r = r0; r < r1; r++) {
            const float * x = row_ptr_flat(a, r);
            if (dst->type == KVR_TYPE_F32) memcpy((float *)dst->data + r * n, x, (size_t)n * sizeof(float));
            else f16_from_float(x, (uint16_t *)dst->data + r * n, n);
        }
    }
}

// Attention tile sizes: a query tile is processed against key tiles with an online softmax.
#define ATTN_BQ 64
#define ATTN_BK 256

static void cpu_op_attn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const int mode = dst->op_params[0];
    const float scale = get_param_f32(dst, 2);
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1], Tk = k->ne[2];
    const int64_t group = H / Hkv;
    const int64_t row_len = dst->ne[0]; // D*H + H
    const int64_t n_qt = (Tq + ATTN_BQ - 1) / ATTN_BQ;
    const int ldq = (int)(q->nb[2] / sizeof(float));
    const int ldk = (int)(k->nb[2] / sizeof(float));
    const int ldv = (int)(v->nb[2] / sizeof(float));

    float * S   = p->wdata;                    // [BQ, BK] scores, then probabilities
    float * O   = S + ATTN_BQ * ATTN_BK;       // [BQ, D] running output
    float * M   = O + ATTN_BQ * D;             // [BQ] running max
    float * L   = M + ATTN_BQ;                 // [BQ] running sum
    KVR_ASSERT((size_t)(ATTN_BQ * ATTN_BK + ATTN_BQ * D + 2 * ATTN_BQ) <= p->wsize);

    int64_t dot_dense = 0, dot_causal = 0;
    // work items are (head, query tile), dealt round-robin so causal tiles of all lengths mix
    for (int64_t item = p->ith; item < H * n_qt; item += p->nth) {
        const int64_t h = item % H, qt = item / H;
        const int64_t g = h / group;
        const int64_t i0 = qt * ATTN_BQ, bq = (i0 + ATTN_BQ <= Tq) ? ATTN_BQ : Tq - i0;
        int32_t qmin = INT32_MAX, qmax = INT32_MIN;
        for (int64_t i = 0; i < bq; i++) {
            if (qpos[i0 + i] < qmin) qmin = qpos[i0 + i];
            if (qpos[i0 + i] > qmax) qmax = qpos[i0 + i];
        }
        for (int64_t i = 0; i < bq; i++) { M[i] = -INFINITY; L[i] = 0.0f; }
        memset(O, 0, sizeof(float) * (size_t)(bq * D));
        const float * Q = (const float *)((const uint8_t *)q->data + h * q->nb[1] + i0 * q->nb[2]);

        for (int64_t j0 = 0; j0 < Tk; j0 += ATTN_BK) {
            const int64_t bk = (j0 + ATTN_BK <= Tk) ? ATTN_BK : Tk - j0;
            int32_t kmin = INT32_MAX, kmax = INT32_MIN;
            for (int64_t j = 0; j < bk; j++) {
                if (kpos[j0 + j] < kmin) kmin = kpos[j0 + j];
                if (kpos[j0 + j] > kmax) kmax = kpos[j0 + j];
            }
            if (mode == KVR_ATTN_CAUSAL && kmin > qmax) continue; // every key is after every query
            const bool need_mask = kmax > qmin;
            const float * Kt = (const float *)((const uint8_t *)k->data + g * k->nb[1] + j0 * k->nb[2]);
            const float * Vt = (const float *)((const uint8_t *)v->data + g * v->nb[1] + j0 * v->nb[2]);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bq, (int)bk, (int)D,
                        scale, Q, ldq, Kt, ldk, 0.0f, S, (int)bk);
            if (h == 0) dot_dense += bq * bk;
            for (int64_t i = 0; i < bq; i++) {
                float * s = S + i * bk;
                const int32_t qp = qpos[i0 + i];
                float mx = -INFINITY;
                int64_t seen = bk;
                if (need_mask) {
                    seen = 0;
                    for (int64_t j = 0; j < bk; j++) {
                        if (kpos[j0 + j] > qp) s[j] = -INFINITY;
                        else seen++;
                    }
                }
                if (h == 0) dot_causal += seen;
                for (int64_t j = 0; j < bk; j++) mx = s[j] > mx ? s[j] : mx;
                if (mx == -INFINITY) { // nothing visible for this row in this tile
                    memset(s, 0, sizeof(float) * (size_t)bk);
                    continue;
                }
                const float m_new = mx > M[i] ? mx : M[i];
                const float corr = expf(M[i] - m_new); // 0 when M[i] is -inf
                float sum = 0.0f;
                for (int64_t j = 0; j < bk; j++) {
                    const float e = expf(s[j] - m_new);
                    s[j] = e;
                    sum += e;
                }
                L[i] = L[i] * corr + sum;
                M[i] = m_new;
                if (corr != 1.0f) {
                    float * o = O + i * D;
                    for (int64_t d = 0; d < D; d++) o[d] *= corr;
                }
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bq, (int)D, (int)bk,
                        1.0f, S, (int)bk, Vt, ldv, 1.0f, O, (int)D);
        }
        for (int64_t i = 0; i < bq; i++) {
            float * out = (float *)dst->data + (i0 + i) * row_len;
            float * lse = out + D * H + h;
            if (L[i] > 0.0f) {
                const float inv = 1.0f / L[i];
                for (int64_t d = 0; d < D; d++) out[h * D + d] = O[i * D + d] * inv;
                *lse = M[i] + logf(L[i]);
            } else {
                for (int64_t d = 0; d < D; d++) out[h * D + d] = 0.0f;
                *lse = -INFINITY;
            }
        }
    }
    p->counters->attn_dot_dense  += dot_dense;
    p->counters->attn_dot_causal += dot_causal;
}

static void cpu_op_merge_attn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const int n = dst->op_params[0];
    const int64_t H = dst->op_params[1];
    const int64_t row_len = dst->ne[0], D = (row_len - H) / H;
    int64_t r0, r1;
    row_range(dst->ne[1], p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        float * out = row_ptr(dst, r, 0, 0);
        for (int64_t h = 0; h < H; h++) {
            float m = -INFINITY;
            for (int i = 0; i < n; i++) {
                const float l = ((const float *)row_ptr(dst->src[i], r, 0, 0))[D * H + h];
                if (l > m) m = l;
            }
            float * o = out + h * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            if (m == -INFINITY) {
                out[D * H + h] = -INFINITY;
                continue;
            }
            float sum = 0.0f;
            for (int i = 0; i < n; i++) {
                const float * part = row_ptr(dst->src[i], r, 0, 0);
                const float l = part[D * H + h];
                if (l == -INFINITY) continue;
                const float w = expf(l - m);
                sum += w;
                for (int64_t d = 0; d < D; d++) o[d] += w * part[h * D + d];
            }
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
            out[D * H + h] = m + logf(sum);
        }
    }
}

// The one dispatch point of the CPU backend.
static void cpu_compute_node(const struct cpu_params * p, struct kvr_tensor * t) {
    switch ((enum kvr_op)t->op) {
        case KVR_OP_GET_ROWS:   cpu_op_get_rows(p, t);   break;
        case KVR_OP_ADD:
        case KVR_OP_MUL:        cpu_op_binary(p, t);     break;
        case KVR_OP_SCALE:
        case KVR_OP_SILU:
        case KVR_OP_GELU:       cpu_op_unary(p, t);      break;
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:       cpu_op_norm(p, t);       break;
        case KVR_OP_MUL_MAT:    cpu_op_mul_mat(p, t);    break;
        case KVR_OP_ROPE:       cpu_op_rope(p, t);       break;
        case KVR_OP_CPY:
        case KVR_OP_KV_STORE:   cpu_op_cpy(p, t);        break;
        case KVR_OP_ATTN:       cpu_op_attn(p, t);       break;
        case KVR_OP_MERGE_ATTN: cpu_op_merge_attn(p, t); break;
        case KVR_OP_NONE:
        case KVR_OP_VIEW:                                break;
        case KVR_OP_SEND:
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
        case KVR_OP_ATTN_BLOCK:
        case KVR_OP_COUNT:      KVR_ASSERT(!"op cannot run on the CPU backend");
    }
}

//
// GGUF reader. Every count, length, offset and extent is checked against the bytes that are
// actually there before it is used, so a malformed file is an error naming the field and its
// offset — never a crash, a hang or a giant allocation.
//

static const size_t gguf_type_size[KVR_GGUF_TYPE_COUNT] = {
    [KVR_GGUF_UINT8] = 1, [KVR_GGUF_INT8] = 1, [KVR_GGUF_UINT16] = 2, [KVR_GGUF_INT16] = 2,
    [KVR_GGUF_UINT32] = 4, [KVR_GGUF_INT32] = 4, [KVR_GGUF_FLOAT32] = 4, [KVR_GGUF_BOOL] = 1,
    [KVR_GGUF_STRING] = 0, [KVR_GGUF_ARRAY] = 0, [KVR_GGUF_UINT64] = 8, [KVR_GGUF_INT64] = 8,
    [KVR_GGUF_FLOAT64] = 8,
};

static const char * const gguf_type_names[KVR_GGUF_TYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

const char * kvr_gguf_type_name(enum kvr_gguf_type t) {
    return (unsigned)t < KVR_GGUF_TYPE_COUNT ? gguf_type_names[t] : "?";
}

struct gguf_rd {
    const uint8_t * p;
    size_t          size;
    size_t          off;
};

static int gguf_fail(const struct gguf_rd * r, const char * what, const char * why) {
    return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: %s", what, r->off, why);
}

static int gguf_bytes(struct gguf_rd * r, void * dst, size_t n, const char * what) {
    if (n > r->size - r->off) {
        return gguf_fail(r, what, "file ends inside it (truncated)");
    }
    memcpy(dst, r->p + r->off, n);
    r->off += n;
    return KVR_OK;
}

static int gguf_u32(struct gguf_rd * r, uint32_t * v, const char * what) { return gguf_bytes(r, v, 4, what); }
static int gguf_u64(struct gguf_rd * r, uint64_t * v, const char * what) { return gguf_bytes(r, v, 8, what); }

static int gguf_string(struct gguf_rd * r, struct kvr_gguf_str * s, const char * what) {
    uint64_t len = 0;
    if (gguf_u64(r, &len, what)) return KVR_ERR_FORMAT;
    if (len > r->size - r->off) {
        r->off -= 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: length %" PRIu64 " runs past the end of the file (%zu bytes left)",
                         what, r->off, len, r->size - r->off - 8);
    }
    s->len = len;
    s->s   = (const char *)r->p + r->off;
    r->off += len;
    return KVR_OK;
}

static bool gguf_str_eq(const struct kvr_gguf_str * s, const char * z) {
    size_t n = strlen(z);
    return s->len == n && memcmp(s->s, z, n) == 0;
}

static int gguf_value(struct gguf_rd * r, struct kvr_gguf_kv * kv, char * what) {
    if (kv->type == KVR_GGUF_STRING) {
        kv->strs = kvr_malloc(sizeof(struct kvr_gguf_str));
        kv->n = 1;
        return gguf_string(r, kv->strs, what);
    }
    if (kv->type != KVR_GGUF_ARRAY) {
        size_t sz = gguf_type_size[kv->type];
        if (sz > r->size - r->off) return gguf_fail(r, what, "file ends inside the value (truncated)");
        kv->n    = 1;
        kv->data = r->p + r->off;
        r->off  += sz;
        return KVR_OK;
    }
    uint32_t at = 0;
    if (gguf_u32(r, &at, what)) return KVR_ERR_FORMAT;
    if (at >= KVR_GGUF_TYPE_COUNT || at == KVR_GGUF_ARRAY) {
        r->off -= 4;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array element type %u is %s", what, r->off, at,
                         at == KVR_GGUF_ARRAY ? "an array (nested arrays are not supported)" : "unknown");
    }
    kv->arr_type = (enum kvr_gguf_type)at;
    uint64_t n = 0;
    if (gguf_u64(r, &n, what)) return KVR_ERR_FORMAT;
    const size_t left = r->size - r->off;
    if (at == KVR_GGUF_STRING) {
        if (n > left / 8) { // each string is at least its 8-byte length
            r->off -= 8;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array of %" PRIu64 " strings cannot fit in the %zu bytes left",
                             what, r->off, n, left);
        }
        kv->n = n;
        kv->strs = kvr_malloc(sizeof(struct kvr_gguf_str) * (size_t)n);
        for (uint64_t i = 0; i < n; i++) {
            if (gguf_string(r, &kv->strs[i], what)) return KVR_ERR_FORMAT;
        }
        return KVR_OK;
    }
    const size_t sz = gguf_type_size[at];
    if (n > left / sz) {
        r->off -= 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array of %" PRIu64 " %s values needs more than the %zu bytes left",
                         what, r->off, n, gguf_type_names[at], left);
    }
    kv->n    = n;
    kv->data = r->p + r->off;
    r->off  += (size_t)n * sz;
    return KVR_OK;
}

void kvr_gguf_close(struct kvr_gguf * g) {
    if (!g) return;
    for (uint64_t i = 0; g->kv && i < g->n_kv; i++) free(g->kv[i].strs);
    free(g->kv);
    free(g->tensors);
    if (g->mapped) munmap((void *)g->base, g->size);
    free(g);
}

static int gguf_cmp_offset(const void * a, const void * b) {
    const struct kvr_gguf_tensor * x = *(struct kvr_gguf_tensor * const *)a, * y = *(struct kvr_gguf_tensor * const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int gguf_parse(struct kvr_gguf * g) {
    struct gguf_rd r = { g->base, g->size, 0 };
    char magic[4] = { 0 };
    if (gguf_bytes(&r, magic, 4, "magic")) return KVR_ERR_FORMAT;
    if (memcmp(magic, "GGUF", 4) != 0) {
        r.off = 0;
        return gguf_fail(&r, "magic", "not a GGUF file (the first 4 bytes are not \"GGUF\")");
    }
    if (gguf_u32(&r, &g->version, "version")) return KVR_ERR_FORMAT;
    if (g->version != 2 && g->version != 3) {
        r.off -= 4;
        return kvr_error(KVR_ERR_FORMAT, "gguf: version at offset %zu: version %u is not supported (2 and 3 are)", r.off, g->version);
    }
    if (gguf_u64(&r, &g->n_tensors, "tensor count")) return KVR_ERR_FORMAT;
    if (gguf_u64(&r, &g->n_kv, "metadata count")) return KVR_ERR_FORMAT;
    // the smallest key-value pair is 13 bytes and the smallest tensor info 28
    if (g->n_tensors > (r.size - r.off) / 28) {
        r.off = 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: tensor count at offset 8: %" PRIu64 " tensors cannot fit in a %zu-byte file", g->n_tensors, r.size);
    }
    if (g->n_kv > (r.size - r.off) / 13) {
        r.off = 16;
        return kvr_error(KVR_ERR_FORMAT, "gguf: metadata count at offset 16: %" PRIu64 " entries cannot fit in a %zu-byte file", g->n_kv, r.size);
    }
    g->kv = kvr_calloc((size_t)g->n_kv, sizeof(struct kvr_gguf_kv));
    g->alignment = 32;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct kvr_gguf_kv * kv = &g->kv[i];
        char what[160];
        snprintf(what, sizeof(what), "key of metadata entry %" PRIu64, i);
        if (gguf_string(&r, &kv->key, what)) return KVR_ERR_FORMAT;
        snprintf(what, sizeof(what), "metadata '%.*s'", (int)(kv->key.len < 100 ? kv->key.len : 100), kv->key.s);
        if (kv->key.len == 0) return gguf_fail(&r, what, "empty key");
        for (uint64_t j = 0; j < i; j++) {
            if (g->kv[j].key.len == kv->key.len && memcmp(g->kv[j].key.s, kv->key.s, kv->key.len) == 0) {
                return gguf_fail(&r, what, "duplicate key");
            }
        }
        uint32_t type = 0;
        if (gguf_u32(&r, &type, what)) return KVR_ERR_FORMAT;
        if (type >= KVR_GGUF_TYPE_COUNT) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: unknown value type %u", what, r.off, type);
        }
        kv->type = (enum kvr_gguf_type)type;
        if (gguf_value(&r, kv, what)) return KVR_ERR_FORMAT;
        if (gguf_str_eq(&kv->key, "general.alignment")) {
            uint32_t a;
            if (kv->type != KVR_GGUF_UINT32) return gguf_fail(&r, what, "must be a u32");
            memcpy(&a, kv->data, 4);
            if (a == 0 || (a & (a - 1)) != 0) return gguf_fail(&r, what, "must be a power of two");
            g->alignment = a;
        }
    }
    g->tensors = kvr_calloc((size_t)g->n_tensors, sizeof(struct kvr_gguf_tensor));
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct kvr_gguf_tensor * t = &g->tensors[i];
        char what[160];
        snprintf(what, sizeof(what), "name of tensor %" PRIu64, i);
        struct kvr_gguf_str name;
        if (gguf_string(&r, &name, what)) return KVR_ERR_FORMAT;
        if (name.len == 0 || name.len >= KVR_MAX_NAME) {
            return gguf_fail(&r, what, name.len ? "longer than 63 bytes" : "empty");
        }
        memcpy(t->name, name.s, name.len);
        t->name[name.len] = 0;
        if (strlen(t->name) != name.len) return gguf_fail(&r, what, "contains a NUL byte");
        for (uint64_t j = 0; j < i; j++) {
            if (strcmp(g->tensors[j].name, t->name) == 0) return gguf_fail(&r, what, "duplicate tensor name");
        }
        snprintf(what, sizeof(what), "tensor '%s'", t->name);
        uint32_t n_dims = 0;
        if (gguf_u32(&r, &n_dims, what)) return KVR_ERR_FORMAT;
        if (n_dims < 1 || n_dims > KVR_MAX_DIMS) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: %u dimensions (1 to 4 are allowed)", what, r.off, n_dims);
        }
        t->n_dims = (int)n_dims;
        int64_t nel = 1;
        for (int d = 0; d < KVR_MAX_DIMS; d++) {
            uint64_t ne = 1;
            if (d < (int)n_dims && gguf_u64(&r, &ne, what)) return KVR_ERR_FORMAT;
            if (ne > (uint64_t)INT64_MAX || (ne > 0 && nel > INT64_MAX / (int64_t)ne)) {
                return gguf_fail(&r, what, "element count overflows");
            }
            t->ne[d] = (int64_t)ne;
            nel *= (int64_t)ne;
        }
        uint32_t type = 0;
        if (gguf_u32(&r, &type, what)) return KVR_ERR_FORMAT;
        if (!type_known((enum kvr_type)type)) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: unknown tensor type %u", what, r.off, type);
        }
        t->type = (enum kvr_type)type;
        if (t->ne[0] % type_traits[type].blck_size != 0) {
            return gguf_fail(&r, what, "first dimension is not a multiple of the type's block size");
        }
        const uint64_t rows = (uint64_t)(t->ne[0] ? nel / t->ne[0] : 0);
        const uint64_t row  = (uint64_t)(t->ne[0] / type_traits[type].blck_size) * type_traits[type].type_size;
        if (rows && row > UINT64_MAX / rows) return gguf_fail(&r, what, "byte size overflows");
        t->size = (size_t)(row * rows);
        if (gguf_u64(&r, &t->offset, what)) return KVR_ERR_FORMAT;
        if (t->offset % g->alignment != 0) {
            r.off -= 8;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: data offset %" PRIu64 " is not a multiple of the alignment %zu",
                             what, r.off, t->offset, g->alignment);
        }
    }
    // the data section starts at the next multiple of the alignment
    size_t data = r.off;
    if (data % g->alignment) data += g->alignment - data % g->alignment;
    if (g->n_tensors > 0 && data > g->size) {
        r.off = g->size;
        return gguf_fail(&r, "padding before the tensor data", "file ends before the data section (truncated)");
    }
    g->data_offset = data;
    const size_t avail = g->size - (data < g->size ? data : g->size);
    struct kvr_gguf_tensor ** order = kvr_malloc(sizeof(*order) * (size_t)(g->n_tensors ? g->n_tensors : 1));
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct kvr_gguf_tensor * t = &g->tensors[i];
        if (t->offset > avail || t->size > avail - t->offset) {
            free(order);
            return kvr_error(KVR_ERR_FORMAT, "gguf: tensor '%s' data at offset %zu: %zu bytes at data offset %" PRIu64 " run past the end of the file (%zu data bytes)",
                             t->name, data + (size_t)(t->offset < avail ? t->offset : avail), t->size, t->offset, avail);
        }
        t->data = g->base + data + t->offset;
        order[i] = t;
    }
    qsort(order, (size_t)g->n_tensors, sizeof(*order), gguf_cmp_offset);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        if (order[i - 1]->offset + order[i - 1]->size > order[i]->offset) {
            int rc = kvr_error(KVR_ERR_FORMAT, "gguf: tensor '%s' data at offset %zu: overlaps tensor '%s'",
                               order[i]->name, data + (size_t)order[i]->offset, order[i - 1]->name);
            free(order);
            return rc;
        }
    }
    free(order);
    return KVR_OK;
}

struct kvr_gguf * kvr_gguf_open_mem(const void * buf, size_t size) {
    struct kvr_gguf * g = kvr_calloc(1, sizeof(*g));
    g->base = buf;
    g->size = size;
    if (gguf_parse(g) != KVR_OK) {
        kvr_gguf_close(g);
        return NULL;
    }
    return g;
}

struct kvr_gguf * kvr_gguf_open(const char * path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        kvr_error(KVR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        kvr_error(KVR_ERR_IO, "%s: not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size < 4) {
        close(fd);
        kvr_error(KVR_ERR_FORMAT, "%s: gguf: magic at offset 0: file is %lld bytes, too short to be GGUF", path, (long long)st.st_size);
        return NULL;
    }
    void * p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        kvr_error(KVR_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
        return NULL;
    }
    struct kvr_gguf * g = kvr_calloc(1, sizeof(*g));
    g->base   = p;
    g->size   = (size_t)st.st_size;
    g->mapped = true;
    if (gguf_parse(g) != KVR_OK) {
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
        kvr_error(KVR_ERR_FORMAT, "%s: %s", path, msg);
        kvr_gguf_close(g);
        return NULL;
    }
    return g;
}

int64_t kvr_gguf_find_key(const struct kvr_gguf * g, const char * key) {
    for (uint64_t i = 0; i < g->n_kv; i++) {
        if (gguf_str_eq(&g->kv[i].key, key)) return (int64_t)i;
    }
    return -1;
}

const struct kvr_gguf_kv * kvr_gguf_get_kv(const struct kvr_gguf * g, const char * key) {
    int64_t i = kvr_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

const struct kvr_gguf_tensor * kvr_gguf_get_tensor(const struct kvr_gguf * g, const char * name) {
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        if (strcmp(g->tensors[i].name, name) == 0) return &g->tensors[i];
    }
    return NULL;
}

static int gguf_get_int(const struct kvr_gguf * g, const char * key, int64_t * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    switch (kv->type) {
        case KVR_GGUF_UINT8:  { uint8_t  v; memcpy(&v, kv->data, 1); *out = v; } break;
        case KVR_GGUF_INT8:   { int8_t   v; memcpy(&v, kv->data, 1); *out = v; } break;
        case KVR_GGUF_UINT16: { uint16_t v; memcpy(&v, kv->data, 2); *out = v; } break;
        case KVR_GGUF_INT16:  { int16_t  v; memcpy(&v, kv->data, 2); *out = v; } break;
        case KVR_GGUF_UINT32: { uint32_t v; memcpy(&v, kv->data, 4); *out = v; } break;
        case KVR_GGUF_INT32:  { int32_t  v; memcpy(&v, kv->data, 4); *out = v; } break;
        case KVR_GGUF_INT64:  { int64_t  v; memcpy(&v, kv->data, 8); *out = v; } break;
        case KVR_GGUF_UINT64: {
            uint64_t v; memcpy(&v, kv->data, 8);
            if (v > INT64_MAX) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' = %" PRIu64 " is out of range", key, v);
            *out = (int64_t)v;
        } break;
        default:
            return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected an integer", key, kvr_gguf_type_name(kv->type));
    }
    return KVR_OK;
}

int kvr_gguf_get_u32(const struct kvr_gguf * g, const char * key, uint32_t * out) {
    int64_t v = 0;
    int rc = gguf_get_int(g, key, &v);
    if (rc) return rc;
    if (v < 0 || v > UINT32_MAX) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' = %" PRId64 " is out of range", key, v);
    *out = (uint32_t)v;
    return KVR_OK;
}

int kvr_gguf_get_f32(const struct kvr_gguf * g, const char * key, float * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type == KVR_GGUF_FLOAT32) { memcpy(out, kv->data, 4); return KVR_OK; }
    if (kv->type == KVR_GGUF_FLOAT64) { double d; memcpy(&d, kv->data, 8); *out = (float)d; return KVR_OK; }
    return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a float", key, kvr_gguf_type_name(kv->type));
}

int kvr_gguf_get_bool(const struct kvr_gguf * g, const char * key, bool * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type != KVR_GGUF_BOOL) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a bool", key, kvr_gguf_type_name(kv->type));
    *out = *(const uint8_t *)kv->data != 0;
    return KVR_OK;
}

int kvr_gguf_get_str(const struct kvr_gguf * g, const char * key, char * out, size_t cap) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type != KVR_GGUF_STRING) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a string", key, kvr_gguf_type_name(kv->type));
    size_t n = kv->strs[0].len < cap - 1 ? (size_t)kv->strs[0].len : cap - 1;
    memcpy(out, kv->strs[0].s, n);
    out[n] = 0;
    return KVR_OK;
}

// gguf-writer.c - the GGUF writer of kvr (kvr.h section 8, "A writer"): metadata entries of
// every type, tensor infos, and a save that streams tensor data from the callers' buffers.
//
// Values are serialized when they are set (the bytes that follow the type tag in the file), so
// save is a plain walk. Files are GGUF version 3 with the data section and every tensor aligned
// to 32 bytes (or to general.alignment, when a caller or kvr_gguf_copy_kv set one). Each tensor is
// padded to the alignment, the last one too, as llama.cpp writes them.
//
// Tensor data is never copied: the pointer given to kvr_gguf_add_tensor is written out by save.
// A NULL data pointer reserves the tensor's bytes without writing them (a hole that reads as
// zeros): kvr-gen fills such tensors afterwards, one at a time, so a model larger than memory
// can be generated.
//
// Mistakes in what is added (an unknown type, a row that is not whole blocks, a name too long or
// used twice, an array of arrays) are remembered and reported by kvr_gguf_writer_save.
//
// This is a fragment of kvr.c: it needs kvr.h and stb_ds (STB_DS_IMPLEMENTATION lives in kvr.c,
// which defines KVR_AMALGAMATED before its includes).

#include "kvr.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// kvr.c includes stb_ds once, with its implementation: including it again there would repeat it
#ifndef KVR_AMALGAMATED
#include <stb/stb_ds.h>
#endif

#define GW_VERSION           3u
#define GW_DEFAULT_ALIGNMENT 32u

struct gw_kv {
    char *             key;      // malloc'ed, zero-terminated
    enum kvr_gguf_type type;     // a scalar type or KVR_GGUF_ARRAY
    enum kvr_gguf_type arr_type; // for arrays
    uint64_t           n;        // array length (1 for scalars)
    uint8_t *          val;      // stb_ds array: the serialized value (after the type tags)
};

struct gw_tensor {
    char          name[KVR_MAX_NAME];
    int           n_dims;
    int64_t       ne[KVR_MAX_DIMS];
    enum kvr_type type;
    size_t        size;   // bytes, unpadded
    uint64_t      offset; // in the data section, set by save
    const void *  data;   // NULL: reserve the bytes only
};

struct gw_name { char * key; int value; };

struct kvr_gguf_writer {
    struct gw_kv     * kv;       // stb_ds array, in the order first set
    struct gw_tensor * tensors;  // stb_ds array, in the order added
    struct gw_name   * names;    // stb_ds string hash: tensor names already used
    int                err;      // the first mistake, reported by save
    char               errmsg[256];
};

static size_t gw_scalar_size(enum kvr_gguf_type t) {
    switch (t) {
        case KVR_GGUF_UINT8:   case KVR_GGUF_INT8:  case KVR_GGUF_BOOL:    return 1;
        case KVR_GGUF_UINT16:  case KVR_GGUF_INT16:                        return 2;
        case KVR_GGUF_UINT32:  case KVR_GGUF_INT32: case KVR_GGUF_FLOAT32: return 4;
        case KVR_GGUF_UINT64:  case KVR_GGUF_INT64: case KVR_GGUF_FLOAT64: return 8;
        default:                                                           return 0;
    }
}

// Remember the first mistake; the later ones are usually its consequences.
static void gw_fail(struct kvr_gguf_writer * w, const char * what, const char * name, size_t len) {
    if (w->err) {
        return;
    }
    w->err = KVR_ERR_ARG;
    if (len > 100) {
        len = 100;
    }
    snprintf(w->errmsg, sizeof(w->errmsg), "gguf writer: %s '%.*s'", what, (int) len, name);
}

// GGUF is little-endian; kvr runs on little-endian hosts only, so values are copied as they are.
static void gw_put(uint8_t ** buf, const void * src, size_t n) {
    if (n == 0) {
        return;
    }
    uint8_t * dst = arraddnptr(*buf, n);
    memcpy(dst, src, n);
}

static void gw_put_u32(uint8_t ** buf, uint32_t v) { gw_put(buf, &v, sizeof(v)); }
static void gw_put_u64(uint8_t ** buf, uint64_t v) { gw_put(buf, &v, sizeof(v)); }

static void gw_put_str(uint8_t ** buf, const char * s, uint64_t len) {
    gw_put_u64(buf, len);
    gw_put(buf, s, (size_t) len);
}

// The entry of key (created at the end if new, emptied if it exists: a key is written once,
// llama.cpp rejects files with duplicate keys).
static struct gw_kv * gw_kv_slot(struct kvr_gguf_writer * w, const char * key, size_t key_len) {
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        if (strlen(w->kv[i].key) == key_len && memcmp(w->kv[i].key, key, key_len) == 0) {
            arrsetlen(w->kv[i].val, 0);
            return &w->kv[i];
        }
    }
    char * k = malloc(key_len + 1);
    KVR_ASSERT(k != NULL);
    memcpy(k, key, key_len);
    k[key_len] = '\0';
    struct gw_kv kv = { .key = k, .type = KVR_GGUF_UINT8, .arr_type = KVR_GGUF_UINT8, .n = 1, .val = NULL };
    arrput(w->kv, kv);
    return &arrlast(w->kv);
}

static void gw_set_scalar(struct kvr_gguf_writer * w, const char * key, size_t key_len,
                          enum kvr_gguf_type type, const void * v) {
    struct gw_kv * kv = gw_kv_slot(w, key, key_len);
    kv->type = type;
    kv->n    = 1;
    gw_put(&kv->val, v, gw_scalar_size(type));
}

static void gw_set_arr(struct kvr_gguf_writer * w, const char * key, size_t key_len,
                       enum kvr_gguf_type elem_type, const void * data, uint64_t n) {
    const size_t es = gw_scalar_size(elem_type);
    if (es == 0) {
        gw_fail(w, "arrays of strings go through kvr_gguf_set_arr_str, arrays of arrays are not supported:", key, key_len);
        return;
    }
    KVR_ASSERT(n == 0 || data != NULL);
    KVR_ASSERT(n <= SIZE_MAX / es);
    struct gw_kv * kv = gw_kv_slot(w, key, key_len);
    kv->type     = KVR_GGUF_ARRAY;
    kv->arr_type = elem_type;
    kv->n        = n;
    gw_put(&kv->val, data, (size_t) n * es);
}

struct kvr_gguf_writer * kvr_gguf_writer_new(void) {
    struct kvr_gguf_writer * w = calloc(1, sizeof(*w));
    if (!w) {
        kvr_error(KVR_ERR_NOMEM, "gguf writer: out of memory");
        return NULL;
    }
    sh_new_strdup(w->names);
    return w;
}

void kvr_gguf_writer_free(struct kvr_gguf_writer * w) {
    if (!w) {
        return;
    }
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        free(w->kv[i].key);
        arrfree(w->kv[i].val);
    }
    arrfree(w->kv);
    arrfree(w->tensors);
    shfree(w->names);
    free(w);
}

void kvr_gguf_set_u32(struct kvr_gguf_writer * w, const char * key, uint32_t v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_UINT32, &v);
}

void kvr_gguf_set_i32(struct kvr_gguf_writer * w, const char * key, int32_t v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_INT32, &v);
}

void kvr_gguf_set_f32(struct kvr_gguf_writer * w, const char * key, float v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_FLOAT32, &v);
}

void kvr_gguf_set_bool(struct kvr_gguf_writer * w, const char * key, bool v) {
    const uint8_t b = v ? 1 : 0;
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_BOOL, &b);
}

void kvr_gguf_set_str(struct kvr_gguf_writer * w, const char * key, const char * v) {
    struct gw_kv * kv = gw_kv_slot(w, key, strlen(key));
    kv->type = KVR_GGUF_STRING;
    kv->n    = 1;
    gw_put_str(&kv->val, v, strlen(v));
}

void kvr_gguf_set_arr(struct kvr_gguf_writer * w, const char * key, enum kvr_gguf_type elem_type,
                      const void * data, uint64_t n) {
    gw_set_arr(w, key, strlen(key), elem_type, data, n);
}

void kvr_gguf_set_arr_str(struct kvr_gguf_writer * w, const char * key, const char * const * strs,
                          const uint64_t * lens, uint64_t n) {
    KVR_ASSERT(n == 0 || strs != NULL);
    struct gw_kv * kv = gw_kv_slot(w, key, strlen(key));
    kv->type     = KVR_GGUF_ARRAY;
    kv->arr_type = KVR_GGUF_STRING;
    kv->n        = n;
    for (uint64_t i = 0; i < n; i++) {
        gw_put_str(&kv->val, strs[i], lens ? lens[i] : strlen(strs[i]));
    }
}

void kvr_gguf_copy_kv(struct kvr_gguf_writer * w, const struct kvr_gguf * src, const char * prefix) {
    const size_t plen = strlen(prefix);
    for (uint64_t i = 0; i < src->n_kv; i++) {
        const struct kvr_gguf_kv * e = &src->kv[i];
        const char * key     = e->key.s;
        const size_t key_len = (size_t) e->key.len;
        if (key_len < plen || memcmp(key, prefix, plen) != 0) {
            continue;
        }
        if (e->type == KVR_GGUF_STRING) {
            struct gw_kv * kv = gw_kv_slot(w, key, key_len);
            kv->type = KVR_GGUF_STRING;
            kv->n    = 1;
            gw_put_str(&kv->val, e->strs[0].s, e->strs[0].len);
        } else if (e->type == KVR_GGUF_ARRAY && e->arr_type == KVR_GGUF_STRING) {
            struct gw_kv * kv = gw_kv_slot(w, key, key_len);
            kv->type     = KVR_GGUF_ARRAY;
            kv->arr_type = KVR_GGUF_STRING;
            kv->n        = e->n;
            for (uint64_t j = 0; j < e->n; j++) {
                gw_put_str(&kv->val, e->strs[j].s, e->strs[j].len);
            }
        } else if (e->type == KVR_GGUF_ARRAY) {
            gw_set_arr(w, key, key_len, e->arr_type, e->data, e->n);
        } else if (gw_scalar_size(e->type) != 0) {
            gw_set_scalar(w, key, key_len, e->type, e->data);
        } else {
            gw_fail(w, "cannot copy the value type of key", key, key_len);
        }
    }
}

void kvr_gguf_add_tensor(struct kvr_gguf_writer * w, const char * name, enum kvr_type type, int n_dims,
                         const int64_t * ne, const void * data) {
    const size_t name_len = strlen(name);
    if (name_len >= KVR_MAX_NAME) {
        gw_fail(w, "tensor name too long:", name, name_len);
        return;
    }
    if (shgeti(w->names, name) >= 0) {
        gw_fail(w, "duplicate tensor name", name, name_len);
        return;
    }
    if (n_dims < 1 || n_dims > KVR_MAX_DIMS) {
        gw_fail(w, "bad number of dimensions of tensor", name, name_len);
        return;
    }
    const int64_t blck = kvr_blck_size(type);
    if (blck <= 0) {
        gw_fail(w, "unknown type of tensor", name, name_len);
        return;
    }
    struct gw_tensor t = { .n_dims = n_dims, .type = type, .data = data };
    memcpy(t.name, name, name_len + 1);
    int64_t rows = 1;
    for (int i = 0; i < KVR_MAX_DIMS; i++) {
        t.ne[i] = i < n_dims ? ne[i] : 1;
        if (t.ne[i] < 0 || (i > 0 && t.ne[i] > 0 && rows > INT64_MAX / t.ne[i])) {
            gw_fail(w, "bad shape of tensor", name, name_len);
            return;
        }
        if (i > 0) {
            rows *= t.ne[i];
        }
    }
    if (t.ne[0] % blck != 0) {
        gw_fail(w, "row length is not a whole number of blocks in tensor", name, name_len);
        return;
    }
    const size_t row = kvr_row_size(type, t.ne[0]);
    if (rows > 0 && row > SIZE_MAX / (size_t) rows) {
        gw_fail(w, "tensor too large:", name, name_len);
        return;
    }
    t.size = row * (size_t) rows;
    arrput(w->tensors, t);
    shput(w->names, name, 1);
}

static size_t gw_pad(size_t x, size_t align) {
    return (x + align - 1) / align * align;
}

// The alignment of the data section: general.alignment when set, else GGUF's default.
static size_t gw_alignment(const struct kvr_gguf_writer * w) {
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        if (strcmp(w->kv[i].key, "general.alignment") == 0 && w->kv[i].type == KVR_GGUF_UINT32) {
            uint32_t a;
            memcpy(&a, w->kv[i].val, sizeof(a));
            return a;
        }
    }
    return GW_DEFAULT_ALIGNMENT;
}

static const uint8_t gw_zeros[256];

// Writes out and counts; the first failure sticks (checked once, at the end of each part).
struct gw_out {
    FILE *   f;
    uint64_t pos;  // where the next byte goes
    uint64_t end;  // the end of what was written (pos is past it after a trailing hole)
    bool     ok;
};

static void gw_write(struct gw_out * o, const void * p, size_t n) {
    if (o->ok && n > 0 && fwrite(p, 1, n, o->f) != n) {
        o->ok = false;
    }
    o->pos += n;
    o->end  = o->pos;
}

static void gw_write_pad(struct gw_out * o, size_t align) {
    size_t n = (size_t) (gw_pad((size_t) o->pos, align) - o->pos);
    while (n > 0) {
        const size_t k = n < sizeof(gw_zeros) ? n : sizeof(gw_zeros);
        gw_write(o, gw_zeros, k);
        n -= k;
    }
}

// Leave n bytes unwritten (a hole if the file system makes one; zeros either way).
static void gw_skip(struct gw_out * o, uint64_t n) {
    if (n == 0) {
        return;
    }
    if (o->ok && (o->pos + n > (uint64_t) LONG_MAX || fseek(o->f, (long) (o->pos + n), SEEK_SET) != 0)) {
        o->ok = false;
    }
    o->pos += n;
}

int kvr_gguf_writer_save(struct kvr_gguf_writer * w, const char * path) {
    if (w->err) {
        return kvr_error(w->err, "%s (writing %s)", w->errmsg, path);
    }
    const size_t align = gw_alignment(w);
    if (align == 0 || (align & (align - 1)) != 0) {
        return kvr_error(KVR_ERR_ARG, "gguf writer: general.alignment %zu is not a power of two (writing %s)", align, path);
    }

    const ptrdiff_t n_tensors = arrlen(w->tensors);
    uint64_t offset = 0;
    for (ptrdiff_t i = 0; i < n_tensors; i++) {
        w->tensors[i].offset = offset;
        offset += gw_pad(w->tensors[i].size, align);
    }

    FILE * f = fopen(path, "wb");
    if (!f) {
        return kvr_error(KVR_ERR_IO, "cannot open %s for writing: %s", path, strerror(errno));
    }
    struct gw_out o = { .f = f, .pos = 0, .end = 0, .ok = true };

    // header and metadata: small, gathered in one buffer
    uint8_t * head = NULL;
    gw_put(&head, "GGUF", 4);
    gw_put_u32(&head, GW_VERSION);
    gw_put_u64(&head, (uint64_t) n_tensors);
    gw_put_u64(&head, (uint64_t) arrlen(w->kv));
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        const struct gw_kv * kv = &w->kv[i];
        gw_put_str(&head, kv->key, strlen(kv->key));
        gw_put_u32(&head, (uint32_t) kv->type);
        if (kv->type == KVR_GGUF_ARRAY) {
            gw_put_u32(&head, (uint32_t) kv->arr_type);
            gw_put_u64(&head, kv->n);
        }
        gw_put(&head, kv->val, (size_t) arrlen(kv->val));
    }
    for (ptrdiff_t i = 0; i < n_tensors; i++) {
        const struct gw_tensor * t = &w->tensors[i];
        gw_put_str(&head, t->name, strlen(t->name));
        gw_put_u32(&head, (uint32_t) t->n_dims);
        for (int d = 0; d < t->n_dims; d++) {
            gw_put_u64(&head, (uint64_t) t->ne[d]);
        }
        gw_put_u32(&head, (uint32_t) t->type);
        gw_put_u64(&head, t->offset);
    }
    gw_write(&o, head, (size_t) arrlen(head));
    arrfree(head);
    gw_write_pad(&o, align);

    // tensor data, straight from the callers' buffers
    for (ptrdiff_t i = 0; i < n_tensors && o.ok; i++) {
        const struct gw_tensor * t = &w->tensors[i];
        if (t->data) {
            gw_write(&o, t->data, t->size);
            gw_write_pad(&o, align);
        } else {
            gw_skip(&o, gw_pad(t->size, align));
        }
    }
    // a trailing hole does not make the file longer: end it with a written byte
    if (o.ok && o.end < o.pos) {
        if (fseek(f, (long) (o.pos - 1), SEEK_SET) != 0 || fwrite(gw_zeros, 1, 1, f) != 1) {
            o.ok = false;
        }
    }

    const int saved_errno = errno;
    const bool closed = fclose(f) == 0;
    if (!o.ok || !closed) {
        const int e = !o.ok ? saved_errno : errno;
        remove(path);
        return kvr_error(KVR_ERR_IO, "cannot write %s: %s", path, e ? strerror(e) : "write error");
    }
    return KVR_OK;
}

//
// KV cache
//

struct kvr_kv_cache * kvr_kv_cache_new(const struct kvr_hparams * hp, int n_ctx) {
    const int kv_dim = (int)(hp->head_dim * hp->n_head_kv);
    const size_t bytes = (size_t)2 * hp->n_layer * (size_t)kv_dim * (size_t)n_ctx * sizeof(float);
    struct kvr_kv_cache * c = kvr_calloc(1, sizeof(*c));
    c->ctx = kvr_init(bytes + (size_t)(2 * hp->n_layer + 4) * (sizeof(struct kvr_tensor) + 128), false);
    if (!c->ctx) {
        free(c);
        kvr_error(KVR_ERR_NOMEM, "cannot allocate a KV cache of %zu MiB (%d positions)", bytes >> 20, n_ctx);
        return NULL;
    }
    c->n_layer = (int)hp->n_layer;
    c->n_ctx   = n_ctx;
    c->kv_dim  = kv_dim;
    c->k = kvr_calloc(hp->n_layer, sizeof(struct kvr_tensor *));
    c->v = kvr_calloc(hp->n_layer, sizeof(struct kvr_tensor *));
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        c->k[il] = kvr_set_name(kvr_new_tensor_2d(c->ctx, KVR_TYPE_F32, kv_dim, n_ctx), "cache_k.%u", il);
        c->v[il] = kvr_set_name(kvr_new_tensor_2d(c->ctx, KVR_TYPE_F32, kv_dim, n_ctx), "cache_v.%u", il);
    }
    return c;
}

void kvr_kv_cache_free(struct kvr_kv_cache * c) {
    if (!c) return;
    kvr_free(c->ctx);
    free(c->k);
    free(c->v);
    free(c);
}

//
// model loading
//

struct arch_info {
    const char * name;
    enum kvr_arch arch;
    int (*load)(struct kvr_model * m);                                           // tensors + arch-specific hparams
    struct kvr_tensor * (*build)(const struct kvr_model * m, const struct kvr_build * b);
};

static int llama_load(struct kvr_model * m);
static struct kvr_tensor * llama_build(const struct kvr_model * m, const struct kvr_build * b);
static int falcon_load(struct kvr_model * m);
static struct kvr_tensor * falcon_build(const struct kvr_model * m, const struct kvr_build * b);

static const struct arch_info arch_table[KVR_ARCH_COUNT] = {
    [KVR_ARCH_LLAMA]  = { "llama",  KVR_ARCH_LLAMA,  llama_load,  llama_build  },
    [KVR_ARCH_FALCON] = { "falcon", KVR_ARCH_FALCON, falcon_load, falcon_build },
};

// "%s.key" of the model's architecture
static const char * arch_key(const struct kvr_model * m, const char * suffix) {
    static _Thread_local char buf[128];
    snprintf(buf, sizeof(buf), "%s.%s", m->hp.arch_name, suffix);
    return buf;
}

static int hp_u32(const struct kvr_model * m, const char * suffix, uint32_t * out, bool required, uint32_t def) {
    const char * key = arch_key(m, suffix);
    if (!kvr_gguf_get_kv(m->gguf, key)) {
        if (required) return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing", m->path, key);
        *out = def;
        return KVR_OK;
    }
    if (kvr_gguf_get_u32(m->gguf, key, out)) return kvr_error(KVR_ERR_FORMAT, "%s: %s", m->path, kvr_last_error());
    return KVR_OK;
}

static int hp_f32(const struct kvr_model * m, const char * suffix, float * out, bool required, float def) {
    const char * key = arch_key(m, suffix);
    if (!kvr_gguf_get_kv(m->gguf, key)) {
        if (required) return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing", m->path, key);
        *out = def;
        return KVR_OK;
    }
    if (kvr_gguf_get_f32(m->gguf, key, out)) return kvr_error(KVR_ERR_FORMAT, "%s: %s", m->path, kvr_last_error());
    return KVR_OK;
}

// The hyper-parameters every architecture shares.
static int load_common_hparams(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_u32(m, "context_length", &hp->n_ctx_train, false, 2048) ||
        hp_u32(m, "embedding_length", &hp->n_embd, true, 0) ||
        hp_u32(m, "block_count", &hp->n_layer, true, 0) ||
        hp_u32(m, "feed_forward_length", &hp->n_ff, false, 0) ||
        hp_u32(m, "attention.head_count", &hp->n_head, true, 0)) {
        return KVR_ERR_FORMAT;
    }
    if (hp_u32(m, "attention.head_count_kv", &hp->n_head_kv, false, hp->n_head)) return KVR_ERR_FORMAT;
    if (hp->n_embd == 0 || hp->n_layer == 0 || hp->n_head == 0 || hp->n_head_kv == 0 ||
        hp->n_layer > 4096 || hp->n_head > 4096 || hp->n_embd % hp->n_head != 0 || hp->n_head % hp->n_head_kv != 0) {
        return kvr_error(KVR_ERR_FORMAT, "%s: inconsistent shape: embedding_length %u, block_count %u, head_count %u, head_count_kv %u",
                         m->path, hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv);
    }
    if (hp_u32(m, "attention.key_length", &hp->head_dim, false, hp->n_embd / hp->n_head)) return KVR_ERR_FORMAT;
    if (hp->head_dim != hp->n_embd / hp->n_head) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = %u differs from embedding_length/head_count; not supported",
                         m->path, arch_key(m, "attention.key_length"), hp->head_dim);
    }
    if (hp_u32(m, "rope.dimension_count", &hp->n_rot, false, hp->head_dim)) return KVR_ERR_FORMAT;
    if (hp->n_rot == 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0 || hp->n_rot > 1024) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not an even number up to the head size %u",
                         m->path, arch_key(m, "rope.dimension_count"), hp->n_rot, hp->head_dim);
    }
    if (hp_f32(m, "rope.freq_base", &hp->rope_freq_base, false, 10000.0f)) return KVR_ERR_FORMAT;
    hp->rope_freq_scale = 1.0f;
    char stype[32] = "none";
    const char * key = arch_key(m, "rope.scaling.type");
    if (kvr_gguf_get_kv(m->gguf, key) && kvr_gguf_get_str(m->gguf, key, stype, sizeof(stype))) {
        return kvr_error(KVR_ERR_FORMAT, "%s: %s", m->path, kvr_last_error());
    }
    if (strcmp(stype, "linear") == 0) {
        float factor;
        if (hp_f32(m, "rope.scaling.factor", &factor, true, 1.0f)) return KVR_ERR_FORMAT;
        if (!(factor > 0.0f)) return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' must be positive", m->path, arch_key(m, "rope.scaling.factor"));
        hp->rope_freq_scale = 1.0f / factor;
    } else if (strcmp(stype, "none") != 0) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = '%s' is not supported (none and linear are)", m->path, arch_key(m, "rope.scaling.type"), stype);
    }
    if (kvr_gguf_get_tensor(m->gguf, "rope_freqs.weight")) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: tensor 'rope_freqs.weight' (per-dimension RoPE frequency factors) is not supported", m->path);
    }
    return KVR_OK;
}

// Find a weight by name and check its shape; optional weights may be absent (NULL, OK).
static int model_tensor(struct kvr_model * m, struct kvr_tensor ** out, bool required, int n_dims,
                        int64_t ne0, int64_t ne1, const char * fmt, ...) {
    char name[KVR_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    *out = NULL;
    const struct kvr_gguf_tensor * gt = kvr_gguf_get_tensor(m->gguf, name);
    if (!gt) {
        return required ? kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' is missing", m->path, name) : KVR_OK;
    }
    const int64_t want[2] = { ne0, ne1 };
    bool ok = gt->n_dims == n_dims || (n_dims == 2 && gt->n_dims == 1 && ne1 == 1);
    for (int d = 0; d < 2 && ok; d++) ok = (d < n_dims ? gt->ne[d] == want[d] : gt->ne[d] == 1);
    ok = ok && gt->ne[2] == 1 && gt->ne[3] == 1;
    if (!ok) {
        return kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64 ", %" PRId64 "]",
                         m->path, name, gt->ne[0], gt->ne[1], gt->ne[2], gt->ne[3], ne0, ne1);
    }
    if (!kvr_type_supported(gt->type)) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s, which kvr cannot compute with yet",
                         m->path, name, kvr_type_name(gt->type));
    }
    struct kvr_tensor * t = kvr_new_tensor(m->ctx, gt->type, gt->n_dims, gt->ne);
    t->data  = (void *)gt->data;
    t->flags = KVR_FLAG_PARAM;
    snprintf(t->name, sizeof(t->name), "%s", name);
    *out = t;
    return KVR_OK;
}

struct kvr_model * kvr_model_load(const char * path, const struct kvr_model_params * params) {
    struct kvr_model * m = kvr_calloc(1, sizeof(*m));
    snprintf(m->path, sizeof(m->path), "%s", path);
    m->gguf = kvr_gguf_open(path);
    if (!m->gguf) goto fail;
    m->vocab = kvr_vocab_load(m->gguf);
    if (!m->vocab) {
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
        kvr_error(KVR_ERR_FORMAT, "%s: %s", path, msg);
        goto fail;
    }
    if (params && params->vocab_only) return m;
    if (kvr_gguf_get_str(m->gguf, "general.architecture", m->hp.arch_name, sizeof(m->hp.arch_name))) {
        kvr_error(KVR_ERR_FORMAT, "%s: %s", path, kvr_last_error());
        goto fail;
    }
    const struct arch_info * ai = NULL;
    char known[128] = "";
    for (int i = 0; i < KVR_ARCH_COUNT; i++) {
        if (!arch_table[i].name) continue;
        if (strcmp(arch_table[i].name, m->hp.arch_name) == 0) ai = &arch_table[i];
        snprintf(known + strlen(known), sizeof(known) - strlen(known), "%s%s", known[0] ? ", " : "", arch_table[i].name);
    }
    if (!ai) {
        kvr_error(KVR_ERR_UNSUPP, "%s: architecture '%s' (general.architecture) is not supported (known: %s)", path, m->hp.arch_name, known);
        goto fail;
    }
    m->hp.arch = ai->arch;
    if (load_common_hparams(m)) goto fail;
    m->hp.n_vocab = (uint32_t)kvr_vocab_n_tokens(m->vocab);
    m->ctx = kvr_init((size_t)(m->hp.n_layer * 24 + 16) * (sizeof(struct kvr_tensor) + 64), true);
    m->layers = kvr_calloc(m->hp.n_layer, sizeof(struct kvr_layer));
    if (ai->load(m)) goto fail;
    return m;
fail:
    kvr_model_free(m);
    return NULL;
}

void kvr_model_free(struct kvr_model * m) {
    if (!m) return;
    kvr_vocab_free(m->vocab);
    kvr_gguf_close(m->gguf);
    kvr_free(m->ctx);
    free(m->layers);
    free(m);
}

const struct kvr_vocab * kvr_model_vocab(const struct kvr_model * m) {
    return m->vocab;
}

void kvr_model_describe(const struct kvr_model * m, char * buf, size_t cap) {
    const struct kvr_hparams * hp = &m->hp;
    size_t bytes = 0;
    int64_t params = 0;
    enum kvr_type wtype = KVR_TYPE_F32;
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) {
        const struct kvr_gguf_tensor * t = &m->gguf->tensors[i];
        bytes  += t->size;
        params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (t->n_dims == 2) wtype = t->type;
    }
    snprintf(buf, cap, "%s: %u layers, width %u, %u heads (%u kv), ffn %u, vocab %u, %.2fM params, %s weights, %.1f MiB",
             hp->arch_name, hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->n_ff, hp->n_vocab,
             params / 1e6, kvr_type_name(wtype), bytes / 1048576.0);
}

struct kvr_tensor * kvr_model_build(const struct kvr_model * m, const struct kvr_build * b) {
    return arch_table[m->hp.arch].build(m, b);
}

//
// sessions: the model, its cache and a backend; each eval builds the graph of one batch
//

struct kvr_session {
    const struct kvr_model * m;
    struct kvr_kv_cache    * cache;
    struct kvr_backend     * be;
    int                      n_past;
    enum kvr_attn_mode       attn_mode;
    FILE                   * graph_out;
    float                  * logits;
    void                   * buf;        // compute buffer, grown as needed
    size_t                   buf_size;
};

struct kvr_session * kvr_session_new(const struct kvr_model * m, const struct kvr_session_params * p) {
    struct kvr_session_params def = { 0 };
    if (!p) p = &def;
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : (int)(m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096);
    if (n_ctx <= 0) n_ctx = 2048;
    struct kvr_session * s = kvr_calloc(1, sizeof(*s));
    s->m = m;
    s->attn_mode = p->attn_mode;
    s->graph_out = p->graph_out;
    s->cache = kvr_kv_cache_new(&m->hp, n_ctx);
    if (!s->cache) {
        free(s);
        return NULL;
    }
    s->be = kvr_backend_cpu_new(p->n_threads);
    s->logits = kvr_calloc(m->hp.n_vocab, sizeof(float));
    return s;
}

void kvr_session_free(struct kvr_session * s) {
    if (!s) return;
    kvr_kv_cache_free(s->cache);
    kvr_backend_free(s->be);
    free(s->buf);
    free(s->logits);
    free(s);
}

int kvr_session_n_past(const struct kvr_session * s) { return s->n_past; }
int kvr_session_n_ctx(const struct kvr_session * s) { return s->cache->n_ctx; }
struct kvr_kv_cache * kvr_session_cache(struct kvr_session * s) { return s->cache; }
struct kvr_backend * kvr_session_backend(struct kvr_session * s) { return s->be; }
void kvr_session_reset(struct kvr_session * s) { s->n_past = 0; }

// Enough room in a graph context for the tensor structs of a forward pass.
static size_t graph_ctx_size(const struct kvr_model * m, int * graph_size) {
    *graph_size = (int)(m->hp.n_layer * 48 + 64);
    return (size_t)*graph_size * (3 * sizeof(struct kvr_tensor) + 2 * sizeof(void *)) + (1 << 16);
}

const float * kvr_session_eval(struct kvr_session * s, const int32_t * tokens, int n) {
    const struct kvr_model * m = s->m;
    if (n <= 0) {
        kvr_error(KVR_ERR_ARG, "eval: no tokens");
        return NULL;
    }
    if (s->n_past + n > s->cache->n_ctx) {
        kvr_error(KVR_ERR_ARG, "eval: %d cached + %d new tokens exceed the context of %d (raise -c)",
                  s->n_past, n, s->cache->n_ctx);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->hp.n_vocab) {
            kvr_error(KVR_ERR_ARG, "eval: token %d at index %d is outside the vocabulary of %u", tokens[i], i, m->hp.n_vocab);
            return NULL;
        }
    }
    int gsize;
    struct kvr_context * ctx = kvr_init(graph_ctx_size(m, &gsize), true);
    if (!ctx) {
        kvr_error(KVR_ERR_NOMEM, "eval: cannot allocate the graph context");
        return NULL;
    }
    struct kvr_build b = { 0 };
    b.ctx       = ctx;
    b.n_tokens  = n;
    b.n_outputs = 1;
    b.tokens    = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, n), "tokens");
    b.pos       = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, n), "pos");
    struct kvr_tensor * kpos = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, s->n_past + n), "kpos");
    b.tokens->flags |= KVR_FLAG_INPUT;
    b.pos->flags    |= KVR_FLAG_INPUT;
    kpos->flags     |= KVR_FLAG_INPUT;
    struct kvr_tensor * out = kvr_model_build(m, &b);
    out->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, gsize);
    kvr_graph_expand(g, out);
    kvr_pass_single(ctx, g, s->cache, s->n_past, kpos, s->attn_mode);
    kvr_graph_reset(g);
    kvr_graph_expand(g, out);
    if (s->graph_out) {
        kvr_graph_print(g, s->graph_out);
        s->graph_out = NULL;
    }
    size_t need = kvr_graph_plan(g);
    if (need > s->buf_size) {
        free(s->buf);
        s->buf = NULL;
        if (posix_memalign(&s->buf, PLAN_ALIGN, need) != 0) {
            s->buf = NULL;
            s->buf_size = 0;
            kvr_graph_place(g, NULL); // frees the plan
            kvr_free(ctx);
            kvr_error(KVR_ERR_NOMEM, "eval: cannot allocate %zu MiB of activations for %d tokens", need >> 20, n);
            return NULL;
        }
        s->buf_size = need;
    }
    kvr_graph_place(g, s->buf);
    memcpy(b.tokens->data, tokens, sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) ((int32_t *)b.pos->data)[i] = s->n_past + i;
    for (int i = 0; i < s->n_past + n; i++) ((int32_t *)kpos->data)[i] = i;
    int rc = kvr_backend_graph_compute(s->be, g);
    if (rc == KVR_OK) {
        memcpy(s->logits, (const float *)out->data, sizeof(float) * m->hp.n_vocab);
        s->n_past += n;
    }
    kvr_free(ctx);
    return rc == KVR_OK ? s->logits : NULL;
}

//
// sampling
//

static uint64_t rng_next(uint64_t * state) { // splitmix64: tiny, seedable, good enough to sample
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kvr_sampler_init(struct kvr_sampler * s, const struct kvr_sampler_params * p) {
    memset(s, 0, sizeof(*s));
    s->p   = *p;
    s->rng = p->seed;
}

void kvr_sampler_free(struct kvr_sampler * s) {
    free(s->probs);
    memset(s, 0, sizeof(*s));
}

int32_t kvr_argmax(const float * x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++) {
        if (x[i] > x[best]) best = i;
    }
    return best;
}

struct prob_id {
    float   p;
    int32_t id;
};

static int cmp_prob_desc(const void * a, const void * b) {
    const struct prob_id * x = a, * y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id - y->id; // ties by id: reproducible
}

int32_t kvr_sample(struct kvr_sampler * s, const float * logits, int n_vocab) {
    if (s->p.temp <= 0.0f) return kvr_argmax(logits, n_vocab);
    if (s->n_alloc < n_vocab) {
        free(s->probs);
        s->probs = kvr_malloc(sizeof(struct prob_id) * (size_t)n_vocab);
        s->n_alloc = n_vocab;
    }
    struct prob_id * pi = (struct prob_id *)s->probs;
    const float mx = logits[kvr_argmax(logits, n_vocab)];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) {
        pi[i].p  = expf((logits[i] - mx) / s->p.temp);
        pi[i].id = i;
        sum += pi[i].p;
    }
    for (int i = 0; i < n_vocab; i++) pi[i].p = (float)(pi[i].p / sum);
    qsort(pi, (size_t)n_vocab, sizeof(struct prob_id), cmp_prob_desc);
    int n = n_vocab;
    if (s->p.top_k > 0 && s->p.top_k < n) n = s->p.top_k;
    if (s->p.top_p > 0.0f && s->p.top_p < 1.0f) {
        double cum = 0.0;
        for (int i = 0; i < n; i++) {
            cum += pi[i].p;
            if (cum >= s->p.top_p) { n = i + 1; break; }
        }
    }
    double total = 0.0;
    for (int i = 0; i < n; i++) total += pi[i].p;
    const double u = (double)(rng_next(&s->rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += pi[i].p;
        if (u < cum) return pi[i].id;
    }
    return pi[n - 1].id;
}

//
// quantized types: block layouts and their conversion to f32
//

// quant.c - the quantized GGUF block formats (a fragment pasted verbatim into kvr.c).
//
// What lives here: the byte layouts of GGML's block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and
// the k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K; their dequantization to f32, written as plain
// scalar loops with fixed trip counts so the compiler vectorizes them (a matmul dequantizes each
// weight row once and reuses it over every token); the reference quantizers for the types kvr
// writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), which reproduce ggml's *_ref quantizers
// decision for decision so that the files we write read the same in llama.cpp; and one table,
// quant_traits_table, that the type functions of kvr.c dispatch to through quant_get().
//
// Layouts and math follow ggml (ggml-common.h, ggml-quants.c); the code is our own. Every block
// struct is made of bytes only, so a block may sit at any address (GGUF views need not be aligned)
// and the half-precision fields are read little-endian by hand. Dequantization multiplies in the
// same order as ggml so results are bit-identical to ggml built with the same contraction flags.

#include "kvr.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    QUANT_QK   = 32,   // elements per block of the legacy formats
    QUANT_QK_K = 256,  // elements per super-block of the k-quants
};

// Blocks. Field order and sizes are GGML's; comments give the element each bit belongs to.

struct quant_block_q4_0 {      // x = d * (q - 8)
    uint8_t d[2];              // fp16 scale
    uint8_t qs[QUANT_QK/2];    // element j: low nibble of qs[j]; element j+16: high nibble
};
struct quant_block_q4_1 {      // x = d * q + m
    uint8_t d[2], m[2];        // fp16 scale and min
    uint8_t qs[QUANT_QK/2];    // as q4_0
};
struct quant_block_q5_0 {      // x = d * (q - 16)
    uint8_t d[2];
    uint8_t qh[4];             // bit j of this little-endian u32: the 5th bit of element j
    uint8_t qs[QUANT_QK/2];    // low 4 bits as q4_0
};
struct quant_block_q5_1 {      // x = d * q + m
    uint8_t d[2], m[2];
    uint8_t qh[4];
    uint8_t qs[QUANT_QK/2];
};
struct quant_block_q8_0 {      // x = d * q
    uint8_t d[2];
    int8_t  qs[QUANT_QK];
};
struct quant_block_q8_1 {      // x = d * q (s = d * sum(q) serves dot products only)
    uint8_t d[2], s[2];
    int8_t  qs[QUANT_QK];
};
// k-quants: a super-block of 256 elements in sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
// The 2-bit planes of Q2_K/Q3_K and the nibbles of Q4_K..Q6_K are laid out in 128- or 64-element
// halves: element e of half h reads byte h*32 + e%32 at bit offset 2*((e%128)/32) (2-bit planes).
struct quant_block_q2_K {      // x = d*sc * q - dmin*m, q in 0..3
    uint8_t scales[QUANT_QK_K/16]; // per 16 elements: low nibble scale, high nibble min
    uint8_t qs[QUANT_QK_K/4];
    uint8_t d[2], dmin[2];
};
struct quant_block_q3_K {      // x = d*(sc - 32) * (q - 4), q in 0..7
    uint8_t hmask[QUANT_QK_K/8];   // bit e/32 of hmask[e%32]: the 3rd bit of element e
    uint8_t qs[QUANT_QK_K/4];      // low 2 bits, as q2_K
    uint8_t scales[12];            // 16 6-bit scales: low nibbles in bytes 0..7, high pairs in 8..11
    uint8_t d[2];
};
struct quant_block_q4_K {      // x = d*sc * q - dmin*m, q in 0..15, per 32 elements
    uint8_t d[2], dmin[2];
    uint8_t scales[12];            // 8 6-bit scales and 8 6-bit mins (see quant_unpack_k4)
    uint8_t qs[QUANT_QK_K/2];      // element e: byte (e/64)*32 + e%32, high nibble if (e%64) >= 32
};
struct quant_block_q5_K {      // x = d*sc * q - dmin*m, q in 0..31, per 32 elements
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qh[QUANT_QK_K/8];      // bit e/32 of qh[e%32]: the 5th bit of element e
    uint8_t qs[QUANT_QK_K/2];      // low 4 bits as q4_K
};
struct quant_block_q6_K {      // x = d*sc * (q - 32), q in 0..63, per 16 elements
    uint8_t ql[QUANT_QK_K/2];      // low 4 bits: half h, quarter k of the half, index l:
                                   //   ql[h*64 + (k&1)*32 + l], high nibble if k >= 2
    uint8_t qh[QUANT_QK_K/4];      // high 2 bits: qh[h*32 + l] >> 2*k
    int8_t  scales[QUANT_QK_K/16];
    uint8_t d[2];
};
struct quant_block_q8_K {      // x = d * q (intermediate type of ggml's k-quant dot products)
    uint8_t d[4];                  // f32 scale
    int8_t  qs[QUANT_QK_K];
    uint8_t bsums[QUANT_QK_K/16*2];// int16 sums of 16 quants
};

_Static_assert(sizeof(struct quant_block_q4_0) ==  18, "q4_0 size");
_Static_assert(sizeof(struct quant_block_q4_1) ==  20, "q4_1 size");
_Static_assert(sizeof(struct quant_block_q5_0) ==  22, "q5_0 size");
_Static_assert(sizeof(struct quant_block_q5_1) ==  24, "q5_1 size");
_Static_assert(sizeof(struct quant_block_q8_0) ==  34, "q8_0 size");
_Static_assert(sizeof(struct quant_block_q8_1) ==  36, "q8_1 size");
_Static_assert(sizeof(struct quant_block_q2_K) ==  84, "q2_K size");
_Static_assert(sizeof(struct quant_block_q3_K) == 110, "q3_K size");
_Static_assert(sizeof(struct quant_block_q4_K) == 144, "q4_K size");
_Static_assert(sizeof(struct quant_block_q5_K) == 176, "q5_K size");
_Static_assert(sizeof(struct quant_block_q6_K) == 210, "q6_K size");
_Static_assert(sizeof(struct quant_block_q8_K) == 292, "q8_K size");

static inline float q_half(const uint8_t * p) {
    return kvr_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

static inline void q_set_half(uint8_t * p, float f) {
    const uint16_t h = kvr_fp32_to_fp16(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

static inline uint32_t q_u32le(const uint8_t * p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

//
// dequantization
//

static void q_to_float_q4_0(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q4_0 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float d = q_half(b->d);
        for (int j = 0; j < QUANT_QK/2; j++) {
            dst[j]              = (float)((b->qs[j] & 0x0f) - 8) * d;
            dst[j + QUANT_QK/2] = (float)((b->qs[j] >>   4) - 8) * d;
        }
    }
}

static void q_to_float_q4_1(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q4_1 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float d = q_half(b->d);
        const float m = q_half(b->m);
        for (int j = 0; j < QUANT_QK/2; j++) {
            dst[j]              = (float)(b->qs[j] & 0x0f) * d + m;
            dst[j + QUANT_QK/2] = (float)(b->qs[j] >>   4) * d + m;
        }
    }
}

static void q_to_float_q5_0(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q5_0 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float    d  = q_half(b->d);
        const uint32_t qh = q_u32le(b->qh);
        for (int j = 0; j < QUANT_QK/2; j++) {
            // the 5th bit lands at bit 4: from bit j for the low half, bit j+16 for the high half
            const int lo = (b->qs[j] & 0x0f) | (int)(((qh >> j) << 4) & 0x10);
            const int hi = (b->qs[j] >>   4) | (int)((qh >> 12 >> j) & 0x10);
            dst[j]              = (float)(lo - 16) * d;
            dst[j + QUANT_QK/2] = (float)(hi - 16) * d;
        }
    }
}

static void q_to_float_q5_1(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q5_1 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float    d  = q_half(b->d);
        const float    m  = q_half(b->m);
        const uint32_t qh = q_u32le(b->qh);
        for (int j = 0; j < QUANT_QK/2; j++) {
            const int lo = (b->qs[j] & 0x0f) | (int)(((qh >> j) << 4) & 0x10);
            const int hi = (b->qs[j] >>   4) | (int)((qh >> 12 >> j) & 0x10);
            dst[j]              = (float)lo * d + m;
            dst[j + QUANT_QK/2] = (float)hi * d + m;
        }
    }
}

static void q_to_float_q8_0(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q8_0 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float d = q_half(b->d);
        for (int j = 0; j < QUANT_QK; j++) {
            dst[j] = (float)b->qs[j] * d;
        }
    }
}

static void q_to_float_q8_1(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q8_1 * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK; i++, b++, dst += QUANT_QK) {
        const float d = q_half(b->d);
        for (int j = 0; j < QUANT_QK; j++) {
            dst[j] = (float)b->qs[j] * d;
        }
    }
}

static void q_to_float_q2_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q2_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++) {
        const float d    = q_half(b->d);
        const float dmin = q_half(b->dmin);
        // 16 runs of 16 elements; run r is half r/8, bit plane (r%8)/2, bytes 16*(r%2) .. +15
        for (int r = 0; r < QUANT_QK_K/16; r++, dst += 16) {
            const uint8_t * restrict q = b->qs + (r/8)*32 + (r%2)*16;
            const int   shift = 2*((r%8)/2);
            const float dl = d    * (float)(b->scales[r] & 0x0f);
            const float ml = dmin * (float)(b->scales[r] >>   4);
            for (int l = 0; l < 16; l++) {
                dst[l] = dl * (float)((q[l] >> shift) & 3) - ml;
            }
        }
    }
}

// Q3_K's 16 scales, 6 bits each, stored as 12 bytes: the low nibble of scale j is byte j (j < 8)
// or the high nibble of byte j-8; its top 2 bits are bits 2*(j/4) of byte 8 + j%4.
static inline void quant_unpack_q3_scales(const uint8_t * s, int sc[16]) {
    for (int j = 0; j < 8; j++) {
        sc[j]     = (s[j] & 0x0f) | (((s[8 + j%4] >> (2*(j/4)))       & 3) << 4);
        sc[j + 8] = (s[j] >>   4) | (((s[8 + j%4] >> (2*((j + 8)/4))) & 3) << 4);
    }
}

static void q_to_float_q3_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q3_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++) {
        const float d = q_half(b->d);
        int sc[16];
        quant_unpack_q3_scales(b->scales, sc);
        for (int r = 0; r < QUANT_QK_K/16; r++, dst += 16) {
            const uint8_t * restrict q  = b->qs + (r/8)*32 + (r%2)*16;
            const uint8_t * restrict hm = b->hmask + (r%2)*16;
            const int   shift = 2*((r%8)/2);
            const int   hbit  = r/2;              // element e's high bit is bit e/32 = r/2
            const float dl = d * (float)(sc[r] - 32);
            for (int l = 0; l < 16; l++) {
                // q - 4 when the high bit is clear, q when it is set (no branch)
                const int v = (int)(((q[l] >> shift) & 3) | (((hm[l] >> hbit) & 1) << 2)) - 4;
                dst[l] = dl * (float)v;
            }
        }
    }
}

// The 8 scales and 8 mins (6 bits each) of Q4_K and Q5_K in 12 bytes: for j < 4 they are the low
// 6 bits of bytes j and j+4; for j >= 4 the low 4 bits come from byte j+4 (scale: low nibble,
// min: high nibble) and the top 2 bits from the top of bytes j-4 (scale) and j (min).
static inline void quant_unpack_k4(const uint8_t * s, float d, float dmin, float dl[8], float ml[8]) {
    for (int j = 0; j < 4; j++) {
        dl[j]     = d    * (float)(s[j]     & 63);
        ml[j]     = dmin * (float)(s[j + 4] & 63);
        dl[j + 4] = d    * (float)((s[j + 8] & 0x0f) | ((s[j]     >> 6) << 4));
        ml[j + 4] = dmin * (float)((s[j + 8] >>   4) | ((s[j + 4] >> 6) << 4));
    }
}

static void q_to_float_q4_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q4_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++) {
        float dl[8], ml[8];
        quant_unpack_k4(b->scales, q_half(b->d), q_half(b->dmin), dl, ml);
        for (int g = 0; g < 4; g++, dst += 64) {
            const uint8_t * restrict q = b->qs + 32*g;
            const float d1 = dl[2*g],     m1 = ml[2*g];
            const float d2 = dl[2*g + 1], m2 = ml[2*g + 1];
            for (int l = 0; l < 32; l++) {
                dst[l]      = d1 * (float)(q[l] & 0x0f) - m1;
                dst[l + 32] = d2 * (float)(q[l] >>   4) - m2;
            }
        }
    }
}

static void q_to_float_q5_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q5_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++) {
        float dl[8], ml[8];
        quant_unpack_k4(b->scales, q_half(b->d), q_half(b->dmin), dl, ml);
        for (int g = 0; g < 4; g++, dst += 64) {
            const uint8_t * restrict q  = b->qs + 32*g;
            const uint8_t * restrict qh = b->qh;
            const float d1 = dl[2*g],     m1 = ml[2*g];
            const float d2 = dl[2*g + 1], m2 = ml[2*g + 1];
            for (int l = 0; l < 32; l++) {
                const int lo = (q[l] & 0x0f) | (((qh[l] >> (2*g))     & 1) << 4);
                const int hi = (q[l] >>   4) | (((qh[l] >> (2*g + 1)) & 1) << 4);
                dst[l]      = d1 * (float)lo - m1;
                dst[l + 32] = d2 * (float)hi - m2;
            }
        }
    }
}

static void q_to_float_q6_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q6_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++) {
        const float d = q_half(b->d);
        float ds[16];
        for (int j = 0; j < 16; j++) {
            ds[j] = d * (float)b->scales[j];
        }
        for (int h = 0; h < 2; h++, dst += 128) {
            const uint8_t * restrict ql = b->ql + 64*h;
            const uint8_t * restrict qh = b->qh + 32*h;
            const float * s = ds + 8*h;
            for (int l = 0; l < 32; l++) {
                const int q1 = ((ql[l]      & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l]      >>   4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >>   4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                const int is = l/16;
                dst[l]      = s[is + 0] * (float)q1;
                dst[l + 32] = s[is + 2] * (float)q2;
                dst[l + 64] = s[is + 4] * (float)q3;
                dst[l + 96] = s[is + 6] * (float)q4;
            }
        }
    }
}

static void q_to_float_q8_K(const void * src, float * restrict dst, int64_t n) {
    const struct quant_block_q8_K * restrict b = src;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, b++, dst += QUANT_QK_K) {
        float d;
        memcpy(&d, b->d, sizeof d);
        for (int j = 0; j < QUANT_QK_K; j++) {
            dst[j] = d * (float)b->qs[j];
        }
    }
}

//
// quantization (ggml's reference quantizers, the ones llama.cpp uses without an importance matrix)
//

static inline float q_maxf(float a, float b) { return a > b ? a : b; }

// Round to nearest, ties to even, for |f| < 2^22: adding 1.5*2^23 leaves the integer in the
// mantissa. Same rounding as ggml's helper, so quantizer decisions match bit for bit.
static inline int q_nearest_int(float f) {
    const float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int q_clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static size_t q_from_float_q8_0(const float * x, void * dst, int64_t n) {
    struct quant_block_q8_0 * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK; i++, y++, x += QUANT_QK) {
        float amax = 0.0f;
        for (int j = 0; j < QUANT_QK; j++) {
            amax = q_maxf(amax, fabsf(x[j]));
        }
        const float d  = amax / 127;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        for (int j = 0; j < QUANT_QK; j++) {
            y->qs[j] = (int8_t)roundf(x[j]*id);
        }
    }
    return (size_t)(n/QUANT_QK) * sizeof(struct quant_block_q8_0);
}

// The value of largest magnitude, with its sign (the first one on ties).
static inline float q_signed_absmax(const float * x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max  = x[j];
        }
    }
    return max;
}

static size_t q_from_float_q4_0(const float * x, void * dst, int64_t n) {
    struct quant_block_q4_0 * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK; i++, y++, x += QUANT_QK) {
        // the extreme value maps to -8, so the full range [-8, 7] is used on the wider side
        const float d  = q_signed_absmax(x, QUANT_QK) / -8;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        for (int j = 0; j < QUANT_QK/2; j++) {
            // truncation of v + 8.5 (v >= -8) is rounding half up; 16 clamps to 15
            const int q0 = (int8_t)(x[j]*id + 8.5f);
            const int q1 = (int8_t)(x[j + QUANT_QK/2]*id + 8.5f);
            y->qs[j] = (uint8_t)((q0 < 15 ? q0 : 15) | ((q1 < 15 ? q1 : 15) << 4));
        }
    }
    return (size_t)(n/QUANT_QK) * sizeof(struct quant_block_q4_0);
}

static inline void q_minmax(const float * x, int n, float * mn, float * mx) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < n; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo; *mx = hi;
}

static size_t q_from_float_q4_1(const float * x, void * dst, int64_t n) {
    struct quant_block_q4_1 * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK; i++, y++, x += QUANT_QK) {
        float mn, mx;
        q_minmax(x, QUANT_QK, &mn, &mx);
        const float d  = (mx - mn) / 15;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        q_set_half(y->m, mn);
        for (int j = 0; j < QUANT_QK/2; j++) {
            const int q0 = (int8_t)((x[j] - mn)*id + 0.5f);
            const int q1 = (int8_t)((x[j + QUANT_QK/2] - mn)*id + 0.5f);
            y->qs[j] = (uint8_t)((q0 < 15 ? q0 : 15) | ((q1 < 15 ? q1 : 15) << 4));
        }
    }
    return (size_t)(n/QUANT_QK) * sizeof(struct quant_block_q4_1);
}

static inline void q_store_u32le(uint8_t * p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static size_t q_from_float_q5_0(const float * x, void * dst, int64_t n) {
    struct quant_block_q5_0 * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK; i++, y++, x += QUANT_QK) {
        const float d  = q_signed_absmax(x, QUANT_QK) / -16;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        uint32_t qh = 0;
        for (int j = 0; j < QUANT_QK/2; j++) {
            int q0 = (int8_t)(x[j]*id + 16.5f);
            int q1 = (int8_t)(x[j + QUANT_QK/2]*id + 16.5f);
            q0 = q0 < 31 ? q0 : 31;
            q1 = q1 < 31 ? q1 : 31;
            y->qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + QUANT_QK/2);
        }
        q_store_u32le(y->qh, qh);
    }
    return (size_t)(n/QUANT_QK) * sizeof(struct quant_block_q5_0);
}

static size_t q_from_float_q5_1(const float * x, void * dst, int64_t n) {
    struct quant_block_q5_1 * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK; i++, y++, x += QUANT_QK) {
        float mn, mx;
        q_minmax(x, QUANT_QK, &mn, &mx);
        const float d  = (mx - mn) / 31;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        q_set_half(y->m, mn);
        uint32_t qh = 0;
        for (int j = 0; j < QUANT_QK/2; j++) {
            const int q0 = (uint8_t)((x[j] - mn)*id + 0.5f);
            const int q1 = (uint8_t)((x[j + QUANT_QK/2] - mn)*id + 0.5f);
            y->qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + QUANT_QK/2);
        }
        q_store_u32le(y->qh, qh);
    }
    return (size_t)(n/QUANT_QK) * sizeof(struct quant_block_q5_1);
}

// Fit x ~ scale*L - min (L in 0..nmax, min >= 0) minimizing the weighted squared error: start from
// the full range, then try nstep+1 other grids and keep the best least-squares fit (ggml's
// make_qkx2_quants with use_mad = false). Returns the scale; *the_min gets the min.
static float quant_fit_scale_min(int n, int nmax, const float * x, const float * w, uint8_t * L,
                                 float * the_min, uint8_t * Laux, float rmin, float rdelta, int nstep) {
    float mn = x[0], mx = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx == mn) {
        memset(L, 0, (size_t)n);
        *the_min = -mn;
        return 0.0f;
    }
    float iscale = nmax/(mx - mn);
    float scale  = 1/iscale;
    float best_err = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)q_clampi(q_nearest_int(iscale*(x[i] - mn)), 0, nmax);
        float diff = scale * L[i] + mn - x[i];
        diff = diff * diff;
        best_err += w[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta*is + nmax)/(mx - mn);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = q_clampi(q_nearest_int(iscale*(x[i] - mn)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l  += w[i]*l;
            sum_l2 += w[i]*l*l;
            sum_xl += w[i]*l*x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l)/D;
            float this_min   = (sum_l2 * sum_x - sum_l * sum_xl)/D;
            if (this_min > 0) {
                this_min   = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                err += w[i] * diff;
            }
            if (err < best_err) {
                memcpy(L, Laux, (size_t)n);
                best_err = err;
                scale    = this_scale;
                mn       = this_min;
            }
        }
    }
    *the_min = -mn;
    return scale;
}

static size_t q_from_float_q4_K(const float * x, void * dst, int64_t n) {
    struct quant_block_q4_K * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, y++, x += QUANT_QK_K) {
        uint8_t L[QUANT_QK_K], Laux[32];
        float   w[32], scales[8], mins[8];
        float   max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            const float * xs = x + 32*j;
            float sum_x2 = 0;
            for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
            const float av_x = sqrtf(sum_x2/32);
            for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
            scales[j] = quant_fit_scale_min(32, 15, xs, w, L + 32*j, &mins[j], Laux, -1.0f, 0.1f, 20);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j]   > max_min)   max_min   = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.f/max_scale : 0.f;
        const float inv_min   = max_min   > 0 ? 63.f/max_min   : 0.f;
        for (int j = 0; j < 8; j++) {
            uint8_t ls = (uint8_t)q_nearest_int(inv_scale*scales[j]);
            uint8_t lm = (uint8_t)q_nearest_int(inv_min*mins[j]);
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
            if (j < 4) {
                y->scales[j]     = ls;
                y->scales[j + 4] = lm;
            } else {
                y->scales[j + 4]  = (uint8_t)((ls & 0x0f) | ((lm & 0x0f) << 4));
                y->scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
                y->scales[j]     |= (uint8_t)((lm >> 4) << 6);
            }
        }
        q_set_half(y->d,    max_scale/63.f);
        q_set_half(y->dmin, max_min/63.f);
        // requantize against the rounded scales that will actually be stored
        float dl[8], ml[8];
        quant_unpack_k4(y->scales, q_half(y->d), q_half(y->dmin), dl, ml);
        for (int j = 0; j < 8; j++) {
            if (dl[j] == 0.0f) continue;
            for (int l = 0; l < 32; l++) {
                L[32*j + l] = (uint8_t)q_clampi(q_nearest_int((x[32*j + l] + ml[j])/dl[j]), 0, 15);
            }
        }
        for (int g = 0; g < 4; g++) {
            for (int l = 0; l < 32; l++) {
                y->qs[32*g + l] = (uint8_t)(L[64*g + l] | (L[64*g + 32 + l] << 4));
            }
        }
    }
    return (size_t)(n/QUANT_QK_K) * sizeof(struct quant_block_q4_K);
}

// Symmetric fit x ~ scale*(L - nmax), L in 0..2*nmax-1, weighted by x^2: the naive scale and 18
// perturbations of it, keeping the best least-squares one (ggml's make_qx_quants, rmse_type 1).
static float quant_fit_scale_sym(int n, int nmax, const float * x, int8_t * L) {
    const float max = q_signed_absmax(x, n);
    if (fabsf(max) < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i]*x[i];
        sumlx += w*x[i]*l;
        suml2 += w*l*l;
    }
    float scale = suml2 != 0.0f ? sumlx/suml2 : 0.0f;
    float best  = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f*is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i]*x[i];
            sumlx += w*x[i]*l;
            suml2 += w*l*l;
        }
        if (suml2 > 0 && sumlx*sumlx > best*suml2) {
            for (int i = 0; i < n; i++) {
                L[i] = (int8_t)(nmax + q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            }
            scale = sumlx/suml2;
            best  = scale*sumlx;
        }
    }
    return scale;
}

static size_t q_from_float_q6_K(const float * x, void * dst, int64_t n) {
    struct quant_block_q6_K * y = dst;
    for (int64_t i = 0; i < n/QUANT_QK_K; i++, y++, x += QUANT_QK_K) {
        int8_t L[QUANT_QK_K];
        float  scales[16];
        float  max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            scales[ib] = quant_fit_scale_sym(16, 32, x + 16*ib, L + 16*ib);
            if (fabsf(scales[ib]) > max_abs_scale) {
                max_abs_scale = fabsf(scales[ib]);
                max_scale     = scales[ib];
            }
        }
        if (max_abs_scale < 1e-15f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        const float iscale = -128.f/max_scale;
        q_set_half(y->d, 1/iscale);
        for (int ib = 0; ib < 16; ib++) {
            const int l = q_nearest_int(iscale*scales[ib]);
            y->scales[ib] = (int8_t)(l < 127 ? l : 127);
        }
        const float dh = q_half(y->d);
        for (int j = 0; j < 16; j++) {
            const float d = dh * y->scales[j];
            if (d == 0.0f) continue;
            for (int l = 0; l < 16; l++) {
                L[16*j + l] = (int8_t)(q_clampi(q_nearest_int(x[16*j + l]/d), -32, 31) + 32);
            }
        }
        for (int h = 0; h < 2; h++) {
            const int8_t * Lh = L + 128*h;
            uint8_t * ql = y->ql + 64*h;
            uint8_t * qh = y->qh + 32*h;
            for (int l = 0; l < 32; l++) {
                ql[l]      = (uint8_t)((Lh[l]      & 0x0f) | ((Lh[l + 64] & 0x0f) << 4));
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0x0f) | ((Lh[l + 96] & 0x0f) << 4));
                qh[l]      = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) |
                                       ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
            }
        }
    }
    return (size_t)(n/QUANT_QK_K) * sizeof(struct quant_block_q6_K);
}

//
// the table kvr.c dispatches through
//

static const struct quant_traits {
    enum kvr_type type;
    const char *  name;       // as ggml_type_name
    int64_t       blck_size;  // elements per block
    size_t        type_size;  // bytes per block
    void   (*to_float)  (const void * src, float * dst, int64_t n);   // n: a multiple of blck_size
    size_t (*from_float)(const float * src, void * dst, int64_t n);   // NULL: kvr does not write it
} quant_traits_table[] = {
    { KVR_TYPE_Q4_0, "q4_0", QUANT_QK,   sizeof(struct quant_block_q4_0), q_to_float_q4_0, q_from_float_q4_0 },
    { KVR_TYPE_Q4_1, "q4_1", QUANT_QK,   sizeof(struct quant_block_q4_1), q_to_float_q4_1, q_from_float_q4_1 },
    { KVR_TYPE_Q5_0, "q5_0", QUANT_QK,   sizeof(struct quant_block_q5_0), q_to_float_q5_0, q_from_float_q5_0 },
    { KVR_TYPE_Q5_1, "q5_1", QUANT_QK,   sizeof(struct quant_block_q5_1), q_to_float_q5_1, q_from_float_q5_1 },
    { KVR_TYPE_Q8_0, "q8_0", QUANT_QK,   sizeof(struct quant_block_q8_0), q_to_float_q8_0, q_from_float_q8_0 },
    { KVR_TYPE_Q8_1, "q8_1", QUANT_QK,   sizeof(struct quant_block_q8_1), q_to_float_q8_1, NULL },
    { KVR_TYPE_Q2_K, "q2_K", QUANT_QK_K, sizeof(struct quant_block_q2_K), q_to_float_q2_K, NULL },
    { KVR_TYPE_Q3_K, "q3_K", QUANT_QK_K, sizeof(struct quant_block_q3_K), q_to_float_q3_K, NULL },
    { KVR_TYPE_Q4_K, "q4_K", QUANT_QK_K, sizeof(struct quant_block_q4_K), q_to_float_q4_K, q_from_float_q4_K },
    { KVR_TYPE_Q5_K, "q5_K", QUANT_QK_K, sizeof(struct quant_block_q5_K), q_to_float_q5_K, NULL },
    { KVR_TYPE_Q6_K, "q6_K", QUANT_QK_K, sizeof(struct quant_block_q6_K), q_to_float_q6_K, q_from_float_q6_K },
    { KVR_TYPE_Q8_K, "q8_K", QUANT_QK_K, sizeof(struct quant_block_q8_K), q_to_float_q8_K, NULL },
};

// The traits of a quantized type; NULL for the plain types (f32, f16, bf16, integers) and unknowns.
static const struct quant_traits * quant_get(enum kvr_type t) {
    for (size_t i = 0; i < sizeof quant_traits_table / sizeof quant_traits_table[0]; i++) {
        if (quant_traits_table[i].type == t) {
            return &quant_traits_table[i];
        }
    }
    return NULL;
}

// The hooks kvr.c's type functions call (it declares them with its to_float_fn / from_float_fn
// typedefs, which name these same function pointer types).
static void (*quant_to_float_fn(enum kvr_type t))(const void * src, float * dst, int64_t n) {
    const struct quant_traits * q = quant_get(t);
    return q ? q->to_float : NULL;
}

static size_t (*quant_from_float_fn(enum kvr_type t))(const float * src, void * dst, int64_t n) {
    const struct quant_traits * q = quant_get(t);
    return q ? q->from_float : NULL;
}

//
// architectures: each models/<arch>.c defines <arch>_load and <arch>_build
//

#include "models/llama.c"
#include "models/falcon.c"
