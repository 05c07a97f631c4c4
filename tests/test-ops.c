// tests/test-ops.c - every op of the CPU backend checked against a naive scalar reference.
//
// Each case is a tiny graph, as in ggml's test-backend-ops: seeded random inputs, one op (or a
// short chain of ops, or ATTN_BLOCK nodes rewritten by kvr_pass_single over a KV cache), run by
// kvr_graph_compute_cpu with 1, 2 and 3 threads, and compared element by element with a
// double-precision reference written here from the op's definition in kvr.h (half-precision
// conversions included: the test has its own). Every input lives in its own exactly sized
// allocation, so AddressSanitizer sees a read past it; every output is pre-filled with NaN, so an
// element left unwritten fails, and has 64 guard bytes on each side, so a write past it fails.
// Nodes are built in a no_alloc context: the memory planner places every intermediate.
// Element i passes when |got - ref| <= tol * max(1, |ref|) (+ a per-element allowance where f32
// cannot do better: the ROPE angle); NaN never passes and infinities must match exactly.
// To cover a new op: copy t_binary (build, tc_output, tc_compute, reference, tc_check), loop it
// over shapes and 1..3 threads in a grp_ function, and list that in GROUPS at the end.
//
// usage: test-ops [-v] [-o GROUP[,GROUP...]] [-s SEED] [-b BACKEND] [SHARED_DIR (ignored: no data needed)]
//   -v  print every case     -o  run only these groups (names as printed)     -s  input seed
//   -b  the backend checked against the CPU: any registered name (kvr_backend_count); default
//       the first registered one that is not the CPU (cuda); -b cpu runs the CPU backend through
//       the same seam
// Prints one line per group and "N passed, M failed, K skipped"; exits 1 if a case failed.
// The backend axis: when that backend can be had (CUDA: a make KVR_CUDA=1 build with a GPU),
// every case's graph also runs there and is compared with the CPU's outputs by NMSE (a bound per
// op, as ggml's test-backend-ops); when not, one line says why and the cases count as skipped.
// The FAST_REF group runs graphs on the CPU's fast kernels and on its plain reference kernels
// (kvr_backend_params.ref_kernels) and compares the two; under KVR_REF=1 every case above runs on
// the reference kernels, and FAST_REF, which would compare them with themselves, says so and stops.

#define _POSIX_C_SOURCE 200809L

#define KVR_BUILD // kvr.h's internal part: the KV cache's element math (kvr_kv_elem), which the GPU runs too
#include "kvr.h"
#include "tests/check.h"

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// One tolerance per kind of op (relative, with an absolute floor of the same size near zero).
#define TOL_EXACT 0.0    // copies, and conversions to f32: bit-exact
#define TOL_ELEM  1e-5   // elementwise ops and per-row norms of O(1) data
#define TOL_RED   1e-4   // long f32 reductions: matmul, attention, merges of them, chains of ops
#define TOL_GELU  2e-3   // GELU computes in fp16 (as GGML): one fp16 step of its input or result
// NORM of rows with a large offset: even a two-pass f32 mean is off by ~|mean|*sqrt(n)*2^-24
// (~2e-5 at offset 30), while a one-pass E[x^2] - E[x]^2 in f32 is off by ~1e-3.
#define TOL_NORM_OFFSET 1e-4

#define GUARD      64
#define GUARD_BYTE 0xA5
#define MAX_BUFS   256
#define CTX_MEM    (4u << 20)
#define GRAPH_SIZE 1024

static struct {
    bool         verbose;
    uint64_t     seed;
    const char * only;    // comma-separated group names, or NULL for all
} g_opt = { false, 20240601, NULL };

static int  g_grp_pass, g_grp_fail; // cases of the running group; n_pass, n_fail: over all groups

static void on_abort(int sig) {
    static const char pre[] = "test-ops: aborted in case ";
    ssize_t r = write(2, pre, sizeof(pre) - 1);
    r = write(2, g_case, strlen(g_case));
    r = write(2, "\n", 1);
    (void) r;
    signal(sig, SIG_DFL);
    raise(sig);
}

//
// random numbers (splitmix64): every case seeds from its own id, so a case reproduces alone
//

static uint64_t g_rng;

static uint64_t rng_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_f(float lo, float hi) {
    return lo + (hi - lo) * (float) ((double) (rng_u64() >> 40) / 16777216.0);
}

static int rng_int(int n) {
    return (int) (rng_u64() % (uint64_t) n);
}

static uint64_t hash_str(const char * s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t) *s) * 0x100000001b3ull;
    }
    return h;
}

//
// half-precision references, independent of kvr's (round to nearest even)
//

static uint16_t ref_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t ax   = x & 0x7fffffff;
    if (ax > 0x7f800000) {
        return (uint16_t) (sign | 0x7e00);                 // NaN
    }
    if (ax >= 0x477ff000) {
        return (uint16_t) (sign | 0x7c00);                 // >= 65520 rounds to inf
    }
    if (ax < 0x38800000) {                                  // below 2^-14: subnormal or zero
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t) (sign | (uint32_t) nearbyint((double) a * 16777216.0));
    }
    uint32_t h = ((((ax >> 23) - 127 + 15)) << 10) | ((ax & 0x7fffff) >> 13);
    const uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) {
        h++;                                                // a carry into the exponent is right
    }
    return (uint16_t) (sign | h);
}

static float ref_f16_to_f32(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) {
        v = ldexp(m, -24);
    } else if (e == 31) {
        v = m ? NAN : INFINITY;
    } else {
        v = ldexp(m + 1024, e - 25);
    }
    return (float) ((h & 0x8000) ? -v : v);
}

static uint16_t ref_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) {
        return (uint16_t) ((x >> 16) | 0x40);
    }
    return (uint16_t) ((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static float ref_bf16_to_f32(uint16_t h) {
    const uint32_t x = (uint32_t) h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static const char * type_str(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return "f32";
        case KVR_TYPE_F16:  return "f16";
        case KVR_TYPE_BF16: return "bf16";
        case KVR_TYPE_Q8_0: return "q8_0";
        case KVR_TYPE_Q4_1: return "q4_1";
        case KVR_TYPE_I32:  return "i32";
        default:            return "?";
    }
}

static const char * mode_str(enum kvr_attn_mode m) {
    return m == KVR_ATTN_DENSE ? "dense" : "causal";
}

//
// a case: its buffers, its context, its verdict
//

struct tbuf {
    uint8_t *    base;
    uint8_t *    data;
    size_t       n;
    bool         guarded;
    const char * what;
};

struct tcase {
    struct kvr_context * ctx;
    int         nt;
    int         n_fail;        // failed checks
    char        msg[1536];     // the first failures
    double      err;           // the largest |got - ref| over every check
    struct tbuf buf[MAX_BUFS];
    int         n_buf;
};

static void tc_fail(struct tcase * tc, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Up to three failures of a case are kept for its report, one a line.
static void tc_fail(struct tcase * tc, const char * fmt, ...) {
    if (tc->n_fail++ < 3) {
        const size_t len = strlen(tc->msg);
        if (len > 0 && len + 8 < sizeof(tc->msg)) {
            snprintf(tc->msg + len, sizeof(tc->msg) - len, "\n       ");
        }
        const size_t at = strlen(tc->msg);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(tc->msg + at, sizeof(tc->msg) - at, fmt, ap);
        va_end(ap);
    }
}

static void tc_begin(struct tcase * tc, int nt, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void tc_begin(struct tcase * tc, int nt, const char * fmt, ...) {
    memset(tc, 0, sizeof(*tc));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_case, sizeof(g_case), fmt, ap);
    va_end(ap);
    g_rng  = g_opt.seed ^ hash_str(g_case);   // the same inputs for every thread count
    tc->nt = nt;
    tc->ctx = kvr_init(CTX_MEM, true);
    if (!tc->ctx) {
        fprintf(stderr, "test-ops: kvr_init failed: %s\n", kvr_last_error());
        exit(2);
    }
}

// n bytes that live until the end of the case. Outputs are guarded and pre-filled (0xFF: NaN);
// inputs and scratch are exactly sized so that AddressSanitizer sees a read past them.
static void * tc_alloc(struct tcase * tc, size_t n, bool guarded, int fill, const char * what) {
    if (tc->n_buf == MAX_BUFS) {
        fprintf(stderr, "test-ops: too many buffers in case %s\n", g_case);
        exit(2);
    }
    struct tbuf * b = &tc->buf[tc->n_buf++];
    const size_t g = guarded ? GUARD : 0;
    void * p = NULL;
    if (posix_memalign(&p, 64, n + 2 * g + (n + 2 * g == 0)) != 0) {
        fprintf(stderr, "test-ops: out of memory\n");
        exit(2);
    }
    b->base = p;
    b->data = b->base + g;
    b->n = n;
    b->guarded = guarded;
    b->what = what;
    memset(b->base, GUARD_BYTE, g);
    memset(b->data, fill, n);
    memset(b->data + n, GUARD_BYTE, g);
    return b->data;
}

static float * tc_floats(struct tcase * tc, int64_t n) {
    return tc_alloc(tc, (size_t) n * sizeof(float), false, 0, "scratch");
}

static double * tc_doubles(struct tcase * tc, int64_t n) {
    return tc_alloc(tc, (size_t) n * sizeof(double), false, 0, "scratch");
}

static void tc_end(struct tcase * tc) {
    for (int i = 0; i < tc->n_buf; i++) {
        const struct tbuf * b = &tc->buf[i];
        if (!b->guarded) {
            continue;
        }
        for (size_t j = 0; j < GUARD; j++) {
            if (b->base[j] != GUARD_BYTE) {
                tc_fail(tc, "write before '%s': guard byte %d before its start is 0x%02x",
                        b->what, (int) (GUARD - j), b->base[j]);
                break;
            }
        }
        for (size_t j = 0; j < GUARD; j++) {
            if (b->data[b->n + j] != GUARD_BYTE) {
                tc_fail(tc, "write past '%s' (%zu bytes): guard byte %zu after its end is 0x%02x",
                        b->what, b->n, j, b->data[b->n + j]);
                break;
            }
        }
    }
    for (int i = 0; i < tc->n_buf; i++) {
        free(tc->buf[i].base);
    }
    kvr_free(tc->ctx);
    const bool ok = tc->n_fail == 0;
    ok ? (n_pass++, g_grp_pass++) : (n_fail++, g_grp_fail++);
    if (!ok) {
        printf("  FAIL %s nt=%d: %s\n", g_case, tc->nt, tc->msg);
    } else if (g_opt.verbose) {
        printf("  ok   %s nt=%d  max|err| %.2e\n", g_case, tc->nt, tc->err);
    }
    fflush(stdout);
    g_case[0] = '\0';
}

//
// tensors of a case
//

static size_t elem_size(enum kvr_type t) {
    return t == KVR_TYPE_F16 || t == KVR_TYPE_BF16 ? 2 : 4;
}

// An input leaf with its own exactly sized memory.
static struct kvr_tensor * tc_input(struct tcase * tc, enum kvr_type type, int n_dims,
                                    int64_t ne0, int64_t ne1, int64_t ne2) {
    const int64_t ne[3] = { ne0, ne1, ne2 };
    struct kvr_tensor * t = kvr_new_tensor(tc->ctx, type, n_dims, ne);
    t->data = tc_alloc(tc, (size_t) (ne0 * ne1 * ne2) * elem_size(type), false, 0, "input");
    t->flags |= KVR_FLAG_INPUT;
    return t;
}

static void fill(float * p, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++) {
        p[i] = rng_f(lo, hi);
    }
}

static struct kvr_tensor * tc_input_f32(struct tcase * tc, int n_dims, int64_t ne0, int64_t ne1, int64_t ne2,
                                        float amp) {
    struct kvr_tensor * t = tc_input(tc, KVR_TYPE_F32, n_dims, ne0, ne1, ne2);
    fill(t->data, ne0 * ne1 * ne2, -amp, amp);
    return t;
}

static struct kvr_tensor * tc_input_i32(struct tcase * tc, int64_t n, const int32_t * v) {
    struct kvr_tensor * t = tc_input(tc, KVR_TYPE_I32, 1, n, 1, 1);
    memcpy(t->data, v, (size_t) n * sizeof(int32_t));
    return t;
}

// A [K, N] matrix of `type` with values in [-1, 1); *ref receives the values it holds, in f32.
static struct kvr_tensor * tc_weight(struct tcase * tc, enum kvr_type type, int64_t K, int64_t N, float ** ref) {
    struct kvr_tensor * w = tc_input(tc, type, 2, K, N, 1);
    float * r = tc_floats(tc, K * N);
    for (int64_t i = 0; i < K * N; i++) {
        const float x = rng_f(-1.0f, 1.0f);
        if (type == KVR_TYPE_F16) {
            ((uint16_t *) w->data)[i] = ref_f32_to_f16(x);
            r[i] = ref_f16_to_f32(ref_f32_to_f16(x));
        } else if (type == KVR_TYPE_BF16) {
            ((uint16_t *) w->data)[i] = ref_f32_to_bf16(x);
            r[i] = ref_bf16_to_f32(ref_f32_to_bf16(x));
        } else {
            ((float *) w->data)[i] = x;
            r[i] = x;
        }
    }
    *ref = r;
    return w;
}

// The result must have this type and shape before anything is computed into it.
static bool tc_shape(struct tcase * tc, const struct kvr_tensor * t, enum kvr_type type,
                     int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    if (!t) {
        tc_fail(tc, "the constructor returned NULL");
        return false;
    }
    if (t->type != type || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != ne3) {
        tc_fail(tc, "result is %s [%lld,%lld,%lld,%lld], expected %s [%lld,%lld,%lld,%lld]",
                type_str(t->type), (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                (long long) t->ne[3], type_str(type), (long long) ne0, (long long) ne1, (long long) ne2,
                (long long) ne3);
        return false;
    }
    return true;
}

// Give a node guarded, NaN-filled memory of its own and keep it past the compute.
static void tc_output(struct tcase * tc, struct kvr_tensor * t, const char * what) {
    t->data = tc_alloc(tc, kvr_nbytes(t), true, 0xFF, what);
    t->flags |= KVR_FLAG_OUTPUT;
}

static void tc_other_backend(struct tcase * tc, struct kvr_graph * g, struct kvr_tensor ** outs, int n_out);

// A leaf the case's ops update in place (GDN's state): the other backend starts from its values
// before the CPU's compute, and the CPU's result is put back for the case's checks.
static struct { float * data; const float * init; int64_t n; } g_inplace;

static bool tc_compute(struct tcase * tc, struct kvr_tensor ** outs, int n_out) {
    struct kvr_graph * g = kvr_graph_new(tc->ctx, GRAPH_SIZE);
    for (int i = 0; i < n_out; i++) {
        kvr_graph_expand(g, outs[i]);
    }
    const int rc = kvr_graph_compute_cpu(g, tc->nt);
    if (rc != KVR_OK) {
        tc_fail(tc, "kvr_graph_compute_cpu returned %d: %s", rc, kvr_last_error());
        return false;
    }
    if (tc->nt == 1) { // once per case: threads are the CPU's business
        float * after = NULL;
        if (g_inplace.data) {
            after = tc_floats(tc, g_inplace.n);
            memcpy(after, g_inplace.data, sizeof(float) * (size_t)g_inplace.n);
            memcpy(g_inplace.data, g_inplace.init, sizeof(float) * (size_t)g_inplace.n);
        }
        tc_other_backend(tc, g, outs, n_out);
        if (after) memcpy(g_inplace.data, after, sizeof(float) * (size_t)g_inplace.n);
    }
    return true;
}

// A dense copy of an f32 tensor read through its strides.
// One element of an output as f32: outputs are F32, or F16/BF16 (CPY, KV_STORE into a half cache;
// a Q8_0 cache's rows are read whole: tc_read).
static float elem_f32(const void * p, enum kvr_type type) {
    uint16_t h;
    float f;
    switch (type) {
        case KVR_TYPE_F16:  memcpy(&h, p, 2); return ref_f16_to_f32(h);
        case KVR_TYPE_BF16: memcpy(&h, p, 2); return ref_bf16_to_f32(h);
        default:            memcpy(&f, p, 4); return f;
    }
}

static float * tc_read(struct tcase * tc, const struct kvr_tensor * t) {
    float * out = tc_floats(tc, kvr_nelements(t));
    if (!t->data) {
        tc_fail(tc, "result '%s' has no data after compute", t->name);
        for (int64_t i = 0; i < kvr_nelements(t); i++) {
            out[i] = NAN;
        }
        return out;
    }
    int64_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                const char * row = (const char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                if (kvr_blck_size(t->type) > 1) { // a block type (a Q8_0 cache): the row as a whole
                    kvr_to_float(t->type, row, out + k, t->ne[0]);
                    k += t->ne[0];
                    continue;
                }
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    out[k++] = elem_f32(row + i0 * t->nb[0], t->type);
                }
            }
        }
    }
    return out;
}

// Element i passes when |got - ref| <= tol * max(1, |ref|) + extra[i]. ne0 only shapes the message.
static void tc_check(struct tcase * tc, const char * what, const float * got, const double * ref, int64_t n,
                     int64_t ne0, double tol, const double * extra) {
    int64_t worst = -1;
    double  worst_r = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double g = got[i], r = ref[i];
        double ratio;
        if (isnan(g) || isnan(r)) {
            ratio = INFINITY;
        } else if (isinf(g) || isinf(r)) {
            ratio = g == r ? 0.0 : INFINITY;
        } else {
            const double d = fabs(g - r);
            const double allowed = tol * fmax(1.0, fabs(r)) + (extra ? extra[i] : 0.0);
            tc->err = fmax(tc->err, d);
            ratio = d == 0.0 ? 0.0 : (allowed > 0.0 ? d / allowed : INFINITY);
        }
        if (ratio > worst_r) {
            worst_r = ratio;
            worst = i;
        }
    }
    if (worst_r > 1.0) {
        const double allowed = tol * fmax(1.0, fabs(ref[worst])) + (extra ? extra[worst] : 0.0);
        tc_fail(tc, "%s: worst element [%lld,%lld] (flat %lld): got %.9g expected %.9g, |err| %.3g > %.3g",
                what, (long long) (worst % ne0), (long long) (worst / ne0), (long long) worst, got[worst],
                ref[worst], fabs((double) got[worst] - ref[worst]), allowed);
    }
}

//
// the backend axis: every case's graph again on the backend -b names (by default the first
// registered one besides the CPU: CUDA, in a build with make KVR_CUDA=1 on a machine with a
// GPU), its outputs against the CPU's by NMSE with a
// bound per op as ggml's test-backend-ops has them. The graph is moved onto the backend (its
// inputs copied into a buffer of the backend, its nodes planned in another), computed, read back
// through kvr_backend_tensor_get, and moved back. Without such a backend every case is counted as
// skipped, with one line saying why, never as passed.
//

static struct {
    struct kvr_backend * be;       // NULL: none available
    const char         * name;     // -b's, or the default (main)
    char                 why[256]; // why not
    int                  n_pass, n_fail, n_skip;
    double               worst;    // the largest NMSE over the cases that passed
} g_other = { NULL, NULL, "", 0, 0, 0, 0.0 };

// The NMSE a backend may reach against the CPU, by op: 1e-7 for elementwise work (ggml's default),
// 5e-4 where a device multiplies in half precision (matrix products; attention's sums run in
// another order), and the largest over the ops of a graph.
static double op_nmse_bound(int op) {
    switch (op) {
        case KVR_OP_MUL_MAT:
        case KVR_OP_MUL_MAT_ID: return 5e-4;
        case KVR_OP_ATTN:
        case KVR_OP_MERGE_ATTN: return 1e-5;
        default:                return 1e-7;
    }
}

struct moved { struct kvr_tensor * t; void * data; struct kvr_buffer * buffer; };

static void remember(struct moved * m, int * n, int cap, struct kvr_tensor * t) {
    for (; t; t = t->view_src) {
        for (int i = 0; i < *n; i++) {
            if (m[i].t == t) return;
        }
        if (*n == cap) {
            fprintf(stderr, "test-ops: a graph of more than %d tensors in case %s\n", cap, g_case);
            exit(2);
        }
        m[(*n)++] = (struct moved) { t, t->data, t->buffer };
    }
}

static void follow_owner(struct kvr_tensor * t) {
    if (!t->view_src) return;
    follow_owner(t->view_src);
    t->data   = (uint8_t *) t->view_src->data + t->view_offs;
    t->buffer = t->view_src->buffer;
}

// t's elements in order, read through its strides (from the backend when it lives there)
static float * tc_read_backend(struct tcase * tc, const struct kvr_tensor * t) {
    float * out = tc_floats(tc, kvr_nelements(t));
    int64_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                const size_t off = (size_t) (i1 * (int64_t) t->nb[1] + i2 * (int64_t) t->nb[2] + i3 * (int64_t) t->nb[3]);
                if (t->type == KVR_TYPE_F32 && t->nb[0] == sizeof(float)) {
                    kvr_backend_tensor_get(t, out + k, off, (size_t) t->ne[0] * sizeof(float));
                    k += t->ne[0];
                } else if (kvr_blck_size(t->type) > 1) { // a block type (a Q8_0 cache): whole rows
                    const size_t rb = kvr_row_size(t->type, t->ne[0]);
                    uint8_t * row = tc_alloc(tc, rb, false, 0, "row");
                    kvr_backend_tensor_get(t, row, off, rb);
                    kvr_to_float(t->type, row, out + k, t->ne[0]);
                    k += t->ne[0];
                } else {
                    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                        uint8_t e[4];
                        kvr_backend_tensor_get(t, e, off + (size_t) i0 * t->nb[0], elem_size(t->type));
                        out[k++] = elem_f32(e, t->type);
                    }
                }
            }
        }
    }
    return out;
}

static void tc_other_backend(struct tcase * tc, struct kvr_graph * g, struct kvr_tensor ** outs, int n_out) {
    if (!g_other.be) {
        g_other.n_skip++;
        return;
    }
    // the CPU's results, and the bound of this graph's ops
    float * want[8];
    KVR_ASSERT(n_out <= 8);
    double bound = 0.0;
    for (int i = 0; i < n_out; i++) want[i] = tc_read(tc, outs[i]);
    for (int i = 0; i < g->n_nodes; i++) bound = fmax(bound, op_nmse_bound(g->nodes[i]->op));
    for (int i = 0; i < g->n_nodes; i++) {
        if (!kvr_backend_supports_op(g_other.be, g->nodes[i])) {
            tc_fail(tc, "%s: supports_op refuses node '%s' (%s)", g_other.name, g->nodes[i]->name, kvr_op_name(g->nodes[i]->op));
            g_other.n_fail++;
            return;
        }
    }
    // every tensor the graph touches, and where its memory is now
    enum { CAP = 4 * GRAPH_SIZE };
    static struct moved m[CAP];
    int n = 0;
    for (int i = 0; i < g->n_leafs; i++) remember(m, &n, CAP, g->leafs[i]);
    for (int i = 0; i < g->n_nodes; i++) {
        remember(m, &n, CAP, g->nodes[i]);
        for (int j = 0; j < KVR_MAX_SRC; j++) remember(m, &n, CAP, g->nodes[i]->src[j]);
    }
    // inputs (leaf memory owners) into one buffer of the backend, with their bytes
    size_t in_bytes = 0;
    for (int i = 0; i < n; i++) {
        if (m[i].t->op == KVR_OP_NONE && !m[i].t->view_src && m[i].data) in_bytes += (kvr_nbytes(m[i].t) + 255) & ~(size_t) 255;
    }
    struct kvr_buffer * in = kvr_backend_alloc_buffer(g_other.be, in_bytes ? in_bytes : 256);
    struct kvr_buffer * work = NULL;
    int rc = in ? KVR_OK : KVR_ERR_NOMEM;
    for (int i = 0, off = 0; i < n && in; i++) {
        struct kvr_tensor * t = m[i].t;
        if (t->op != KVR_OP_NONE || t->view_src || !m[i].data) continue;
        t->data = NULL;
        t->buffer = NULL;
        kvr_buffer_place(in, t, (size_t) off);
        kvr_backend_tensor_set(t, m[i].data, 0, kvr_nbytes(t));
        off += (int) ((kvr_nbytes(t) + 255) & ~(size_t) 255);
    }
    // nodes planned afresh in another, views following their owners
    if (rc == KVR_OK) {
        for (int i = 0; i < n; i++) {
            if (m[i].t->op != KVR_OP_NONE && !m[i].t->view_src) { m[i].t->data = NULL; m[i].t->buffer = NULL; }
        }
        work = kvr_backend_alloc_buffer(g_other.be, kvr_graph_plan(g));
        if (work) kvr_graph_place(g, work);
        else { kvr_graph_place(g, NULL); rc = KVR_ERR_NOMEM; }
        for (int i = 0; i < n; i++) follow_owner(m[i].t);
    }
    if (rc == KVR_OK) rc = kvr_backend_graph_compute(g_other.be, g);
    if (rc != KVR_OK) {
        tc_fail(tc, "%s: %s", g_other.name, kvr_last_error());
    } else {
        for (int i = 0; i < n_out; i++) {
            const float * got = tc_read_backend(tc, outs[i]);
            double num = 0.0, den = 0.0;
            bool same_inf = true;
            for (int64_t e = 0; e < kvr_nelements(outs[i]); e++) {
                // an LSE of -inf, an infinity or NaN copied (CPY's special values): the same in both
                if (!isfinite(want[i][e]) || !isfinite(got[e])) {
                    same_inf = same_inf && (want[i][e] == got[e] || (isnan(want[i][e]) && isnan(got[e])));
                    continue;
                }
                num += ((double) got[e] - want[i][e]) * ((double) got[e] - want[i][e]);
                den += (double) want[i][e] * want[i][e];
            }
            const double nmse = den > 0.0 ? num / den : num;
            if (!(nmse <= bound) || !same_inf) {
                tc_fail(tc, "%s: output '%s': NMSE %.3g against the CPU (bound %.0e)%s", g_other.name, outs[i]->name, nmse,
                        bound, same_inf ? "" : ", an infinity or NaN differs");
            } else {
                g_other.worst = fmax(g_other.worst, nmse);
            }
        }
    }
    // everything back where the CPU's checks read it
    for (int i = 0; i < n; i++) {
        m[i].t->data = m[i].data;
        m[i].t->buffer = m[i].buffer;
    }
    kvr_buffer_free(work);
    kvr_buffer_free(in);
    if (tc->n_fail) g_other.n_fail++; else g_other.n_pass++;
}

//
// references
//

struct attn_ref {
    int hd, H, Hkv, Tq, Tk;
    const float * q;     int64_t q_tok;    // q of token i, head h: q + i*q_tok + h*hd
    const float * k;                       // k and v of token j, kv head g: k + j*kv_tok + g*hd
    const float * v;     int64_t kv_tok;
    const int32_t * qpos, * kpos;
    double scale;
    int window;          // 0: none; else key j is seen by query i only if qpos[i] - kpos[j] < window
    double softcap;      // 0: none; else each scaled score s becomes softcap * tanh(s / softcap)
    const float * sinks; // NULL: none; else head h's sink logit joins each softmax's denominator
};

static bool ref_masked(const struct attn_ref * a, int i, int j) {
    return a->kpos[j] > a->qpos[i] || (a->window > 0 && (int64_t) a->qpos[i] - a->kpos[j] >= a->window);
}

// out: per query row, O of each head then the LSE of each head (kvr_attn's layout)
static void ref_attn(const struct attn_ref * a, double * out) {
    const int64_t row = (int64_t) a->hd * a->H + a->H;
    const int rep = a->H / a->Hkv;
    double * s = malloc(sizeof(double) * (size_t) (a->Tk > 0 ? a->Tk : 1));
    for (int i = 0; i < a->Tq; i++) {
        for (int h = 0; h < a->H; h++) {
            const float * q = a->q + i * a->q_tok + (int64_t) h * a->hd;
            const int64_t g = h / rep;
            double * o = out + i * row + (int64_t) h * a->hd;
            double m = -INFINITY;
            for (int j = 0; j < a->Tk; j++) {
                if (ref_masked(a, i, j)) {
                    continue;
                }
                const float * k = a->k + j * a->kv_tok + g * a->hd;
                double dot = 0.0;
                for (int d = 0; d < a->hd; d++) {
                    dot += (double) q[d] * k[d];
                }
                s[j] = a->softcap > 0.0 ? a->softcap * tanh(a->scale * dot / a->softcap) : a->scale * dot;
                m = fmax(m, s[j]);
            }
            for (int d = 0; d < a->hd; d++) {
                o[d] = 0.0;
            }
            if (a->sinks) m = fmax(m, a->sinks[h]);
            if (m == -INFINITY) {
                out[i * row + (int64_t) a->hd * a->H + h] = -INFINITY;
                continue;
            }
            double sum = a->sinks ? exp(a->sinks[h] - m) : 0.0; // a sink: a term with no value
            for (int j = 0; j < a->Tk; j++) {
                if (ref_masked(a, i, j)) {
                    continue;
                }
                const double w = exp(s[j] - m);
                const float * v = a->v + j * a->kv_tok + g * a->hd;
                sum += w;
                for (int d = 0; d < a->hd; d++) {
                    o[d] += w * v[d];
                }
            }
            for (int d = 0; d < a->hd; d++) {
                o[d] /= sum;
            }
            out[i * row + (int64_t) a->hd * a->H + h] = m + log(sum);
        }
    }
    free(s);
}

// y = x rotated; extra = the allowance of an f32 angle: whatever the method (one powf, or ggml's
// running product theta *= theta_scale), theta_i carries up to ~(3i + 4) ulps of itself, and an
// error e in the angle moves the pair by e * |(x0, x1)|.
// yarn NULL: plain RoPE; else { ext_factor, attn_factor, corr_lo, corr_hi } as kvr_rope_yarn defines them
static void ref_rope_yarn(const float * x, double * y, double * extra, int hd, int H, int T, const int32_t * pos,
                          const float * ff, int n_rot, enum kvr_rope_mode mode, double base, double fs, const float * yarn) {
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const float * xr = x + ((int64_t) t * H + h) * hd;
            double * yr = y + ((int64_t) t * H + h) * hd;
            double * er = extra + ((int64_t) t * H + h) * hd;
            for (int d = n_rot; d < hd; d++) {
                yr[d] = xr[d];
                er[d] = 0.0;
            }
            for (int i = 0; i < n_rot / 2; i++) {
                const double plain = pos[t] * pow(base, -2.0 * i / n_rot) / (ff ? ff[i] : 1.0);
                double theta = plain * fs, mscale = 1.0;
                if (yarn) {
                    mscale = yarn[1];
                    if (yarn[0] != 0.0f) { // the interpolated angle mixed with the plain one by the ramp
                        const double r = (1.0 - fmin(1.0, fmax(0.0, (i - yarn[2]) / fmax(0.001, yarn[3] - yarn[2])))) * yarn[0];
                        theta = theta * (1.0 - r) + plain * r;
                        mscale *= 1.0 + 0.1 * log(1.0 / fs);
                    }
                }
                const int i0 = mode == KVR_ROPE_NEOX ? i : 2 * i;
                const int i1 = mode == KVR_ROPE_NEOX ? i + n_rot / 2 : 2 * i + 1;
                const double x0 = xr[i0], x1 = xr[i1], c = cos(theta) * mscale, s = sin(theta) * mscale;
                yr[i0] = x0 * c - x1 * s;
                yr[i1] = x0 * s + x1 * c;
                er[i0] = er[i1] = (3.0 * i + 4.0) * 0x1p-24 * fmax(fabs(theta), fabs(plain)) * hypot(x0, x1) * mscale;
            }
        }
    }
}

// GGML's CPU GELU, which llama.cpp's reference outputs come from: the input rounded to fp16, the
// tanh approximation rounded to fp16, the tails passed through. Here in double with the test's
// own fp16 rounding, so results may differ by one fp16 step where a value sits on a rounding
// boundary: TOL_GELU allows that.
static double ref_round_fp16(double x) {
    if (x == 0.0 || !isfinite(x)) return x;
    int e;
    frexp(x, &e);                              // |x| = m * 2^e, m in [0.5, 1)
    const int ee = e - 1 < -14 ? -14 : e - 1;  // exponent of the fp16 binade (subnormals fixed)
    const double q = ldexp(1.0, ee - 10);      // spacing of fp16 values there
    return nearbyint(x / q) * q;               // round half to even (the default mode)
}

static double ref_gelu(double x) {
    if (x <= -10.0) return 0.0;
    if (x >= 10.0) return x;
    const double v = ref_round_fp16(x);
    return ref_round_fp16(0.5 * v * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (v + 0.044715 * v * v * v))));
}

static double ref_silu(double x) {
    return x / (1.0 + exp(-x));
}

static void ref_rms_norm(const float * x, double * y, int64_t n, int64_t rows, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) {
            ss += (double) x[r * n + i] * x[r * n + i];
        }
        const double s = 1.0 / sqrt(ss / n + eps);
        for (int64_t i = 0; i < n; i++) {
            y[r * n + i] = x[r * n + i] * s;
        }
    }
}

static void ref_norm(const double * x, double * y, int64_t n, int64_t rows, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double mean = 0.0, var = 0.0;
        for (int64_t i = 0; i < n; i++) {
            mean += x[r * n + i];
        }
        mean /= n;
        for (int64_t i = 0; i < n; i++) {
            var += (x[r * n + i] - mean) * (x[r * n + i] - mean);
        }
        const double s = 1.0 / sqrt(var / n + eps);
        for (int64_t i = 0; i < n; i++) {
            y[r * n + i] = (x[r * n + i] - mean) * s;
        }
    }
}

// y[t][n] = sum_k w[n][k] x[t][k], x rows x_row floats apart
static void ref_mul_mat(const float * w, const float * x, int64_t x_row, double * y, int64_t K, int64_t N, int64_t T) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t n = 0; n < N; n++) {
            double s = 0.0;
            for (int64_t k = 0; k < K; k++) {
                s += (double) w[n * K + k] * x[t * x_row + k];
            }
            y[t * N + n] = s;
        }
    }
}

static void ref_mul_mat_d(const float * w, const double * x, double * y, int64_t K, int64_t N, int64_t T) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t n = 0; n < N; n++) {
            double s = 0.0;
            for (int64_t k = 0; k < K; k++) {
                s += (double) w[n * K + k] * x[t * K + k];
            }
            y[t * N + n] = s;
        }
    }
}

//
// GET_ROWS
//

static void t_get_rows(enum kvr_type type, int n, int rows, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "GET_ROWS(type=%s,n=%d,rows=%d,T=%d)", type_str(type), n, rows, T);
    float * ar;
    struct kvr_tensor * a = tc_weight(&tc, type, n, rows, &ar);
    // the first elements (row 0 is always picked): subnormals, extremes, infinities, signed zero
    static const uint16_t f16[] = { 0x0001, 0x03ff, 0x0400, 0x7bff, 0x8001, 0x7c00, 0xfc00, 0x8000, 0x3c00, 0x3555 };
    static const uint16_t bf16[] = { 0x0001, 0x007f, 0x0080, 0x7f7f, 0x7f80, 0xff80, 0x8000, 0x3f80, 0xc2f7 };
    for (int i = 0; type != KVR_TYPE_F32 && i < n * rows && i < (type == KVR_TYPE_F16 ? 10 : 9); i++) {
        const uint16_t h = type == KVR_TYPE_F16 ? f16[i] : bf16[i];
        ((uint16_t *) a->data)[i] = h;
        ar[i] = type == KVR_TYPE_F16 ? ref_f16_to_f32(h) : ref_bf16_to_f32(h);
    }
    int32_t * ids = (int32_t *) tc_floats(&tc, T);
    for (int i = 0; i < T; i++) {
        ids[i] = rng_int(rows);
    }
    ids[0] = rows - 1;
    ids[T - 1] = 0;
    struct kvr_tensor * y = kvr_get_rows(tc.ctx, a, tc_input_i32(&tc, T, ids));
    if (tc_shape(&tc, y, KVR_TYPE_F32, n, T, 1, 1)) {
        tc_output(&tc, y, "get_rows");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, (int64_t) n * T);
            for (int t = 0; t < T; t++) {
                for (int i = 0; i < n; i++) {
                    ref[(int64_t) t * n + i] = ar[(int64_t) ids[t] * n + i];
                }
            }
            tc_check(&tc, "get_rows", tc_read(&tc, y), ref, (int64_t) n * T, n, TOL_EXACT, NULL);
        }
    }
    tc_end(&tc);
}

static void grp_get_rows(void) {
    static const int shapes[][3] = { {1, 1, 1}, {7, 7, 7}, {33, 130, 33}, {130, 33, 1}, {64, 5, 130} };
    static const enum kvr_type types[] = { KVR_TYPE_F32, KVR_TYPE_F16, KVR_TYPE_BF16 };
    for (size_t ti = 0; ti < 3; ti++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_get_rows(types[ti], shapes[s][0], shapes[s][1], shapes[s][2], nt);
            }
        }
    }
}

//
// ADD, MUL: b the same shape as a, one row ([n] or [n,1]) broadcast over a's rows, or one value
// a row ([1,r,r2]) along its row
//

static void t_binary(bool add, int n, int r, int r2, int bmode, int nt) {
    static const char * bname[] = { "same", "[n]", "[n,1]", "[1,r]" };
    struct tcase tc;
    tc_begin(&tc, nt, "%s(ne=[%d,%d,%d],b=%s)", add ? "ADD" : "MUL", n, r, r2, bname[bmode]);
    const int nd = r2 > 1 ? 3 : 2;
    struct kvr_tensor * a = tc_input_f32(&tc, nd, n, r, r2, 1.0f);
    struct kvr_tensor * b = bmode == 0 ? tc_input_f32(&tc, nd, n, r, r2, 1.0f)
                          : bmode == 3 ? tc_input_f32(&tc, nd, 1, r, r2, 1.0f)
                                       : tc_input_f32(&tc, bmode, n, 1, 1, 1.0f);
    struct kvr_tensor * y = add ? kvr_add(tc.ctx, a, b) : kvr_mul(tc.ctx, a, b);
    if (tc_shape(&tc, y, KVR_TYPE_F32, n, r, r2, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            const int64_t N = (int64_t) n * r * r2;
            const float * A = a->data, * B = b->data;
            double * ref = tc_doubles(&tc, N);
            for (int64_t i = 0; i < N; i++) {
                const double bv = B[bmode == 3 ? i / n : bmode ? i % n : i];
                ref[i] = add ? A[i] + bv : A[i] * bv;
            }
            tc_check(&tc, "y", tc_read(&tc, y), ref, N, n, TOL_ELEM, NULL);
        }
    }
    tc_end(&tc);
}

static const int g_bin_shapes[][3] = { {1, 1, 1}, {7, 1, 1}, {1, 7, 1}, {33, 7, 1}, {130, 33, 1}, {7, 130, 1}, {33, 5, 3} };

static void grp_binary(bool add) {
    for (size_t s = 0; s < sizeof(g_bin_shapes) / sizeof(g_bin_shapes[0]); s++) {
        for (int bmode = 0; bmode < 4; bmode++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_binary(add, g_bin_shapes[s][0], g_bin_shapes[s][1], g_bin_shapes[s][2], bmode, nt);
            }
        }
    }
}

static void grp_add(void) { grp_binary(true); }
static void grp_mul(void) { grp_binary(false); }

//
// SCALE, SILU, GELU
//

enum unary_op { U_SCALE, U_SILU, U_GELU, U_GELU_EXACT, U_SOFTCAP, U_SIGMOID, U_SOFTPLUS };

// GELU's tanh approximation with no rounding (kvr_gelu_exact's definition)
static double ref_gelu_exact(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
}

static void t_unary(enum unary_op op, int n, int r, float amp, float s, int nt) {
    static const char * name[] = { "SCALE", "SILU", "GELU", "GELU(exact)", "SOFTCAP", "SIGMOID", "SOFTPLUS" };
    struct tcase tc;
    if (op == U_SCALE || op == U_SOFTCAP) {
        tc_begin(&tc, nt, "%s(ne=[%d,%d],%s=%g,x in +-%g)", name[op], n, r, op == U_SCALE ? "s" : "cap", s, amp);
    } else {
        tc_begin(&tc, nt, "%s(ne=[%d,%d],x in +-%g)", name[op], n, r, amp);
    }
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, r, 1, amp);
    struct kvr_tensor * y = op == U_SCALE      ? kvr_scale(tc.ctx, a, s)
                          : op == U_SILU       ? kvr_silu(tc.ctx, a)
                          : op == U_GELU       ? kvr_gelu(tc.ctx, a)
                          : op == U_GELU_EXACT ? kvr_gelu_exact(tc.ctx, a)
                          : op == U_SIGMOID    ? kvr_sigmoid(tc.ctx, a)
                          : op == U_SOFTPLUS   ? kvr_softplus(tc.ctx, a) : kvr_softcap(tc.ctx, a, s);
    if (tc_shape(&tc, y, KVR_TYPE_F32, n, r, 1, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            const int64_t N = (int64_t) n * r;
            const float * A = a->data;
            double * ref = tc_doubles(&tc, N);
            for (int64_t i = 0; i < N; i++) {
                const double x = A[i];
                ref[i] = op == U_SCALE      ? x * s
                       : op == U_SILU       ? ref_silu(A[i])
                       : op == U_GELU       ? ref_gelu(A[i])
                       : op == U_GELU_EXACT ? ref_gelu_exact(x)
                       : op == U_SIGMOID    ? 1.0 / (1.0 + exp(-x))
                       : op == U_SOFTPLUS   ? (x > 20.0 ? x : log1p(exp(x))) // GGML's: the identity above 20
                       : s * tanh(x / (double) s);
            }
            tc_check(&tc, "y", tc_read(&tc, y), ref, N, n, op == U_GELU ? TOL_GELU : TOL_ELEM, NULL);
        }
    }
    tc_end(&tc);
}

static const int g_un_shapes[][2] = { {1, 1}, {7, 33}, {130, 7}, {33, 130} };

static void grp_scale(void) {
    static const float s[] = { 0.5f, -3.25f, 0.0f, 0.125f };
    for (size_t i = 0; i < sizeof(g_un_shapes) / sizeof(g_un_shapes[0]); i++) {
        for (size_t j = 0; j < sizeof(s) / sizeof(s[0]); j++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_unary(U_SCALE, g_un_shapes[i][0], g_un_shapes[i][1], 1.0f, s[j], nt);
            }
        }
    }
}

static void grp_act(enum unary_op op) {
    static const float amp[] = { 1.0f, 8.0f, 100.0f };
    for (size_t i = 0; i < sizeof(g_un_shapes) / sizeof(g_un_shapes[0]); i++) {
        for (size_t j = 0; j < sizeof(amp) / sizeof(amp[0]); j++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_unary(op, g_un_shapes[i][0], g_un_shapes[i][1], amp[j], 1.0f, nt);
            }
        }
    }
}

static void grp_silu(void) { grp_act(U_SILU); }
static void grp_gelu(void) { grp_act(U_GELU); grp_act(U_GELU_EXACT); }

// SOFTCAP: caps far above the inputs (nearly x), around them, and far below (nearly +-cap)
static void grp_softcap(void) {
    static const float cap[] = { 30.0f, 50.0f, 2.5f };
    static const float amp[] = { 1.0f, 100.0f };
    for (size_t i = 0; i < sizeof(g_un_shapes) / sizeof(g_un_shapes[0]); i++) {
        for (size_t c = 0; c < sizeof(cap) / sizeof(cap[0]); c++) {
            for (size_t j = 0; j < sizeof(amp) / sizeof(amp[0]); j++) {
                for (int nt = 1; nt <= 3; nt += 2) t_unary(U_SOFTCAP, g_un_shapes[i][0], g_un_shapes[i][1], amp[j], cap[c], nt);
            }
        }
    }
}

static void grp_sigmoid(void) { grp_act(U_SIGMOID); }
static void grp_softplus(void) { grp_act(U_SOFTPLUS); }

//
// GDN: a Gated DeltaNet layer's recurrence (SSM_CONV then GDN, kvr_gdn_segment) over a carried
// state, in two segments [0, n1) and [n1, T) one after the other on the same state, against a
// double-precision reference of the whole sequence written from kvr.h's definition: the outputs
// of both segments and the state after the last token. The state starts from random values (the
// reference starts from them too) or, fresh, from zero whatever it holds.
//

struct gdn_case { int d_conv, n_k, d_k, n_v, T, n1; bool fresh; };

static void t_gdn(const struct gdn_case * gc, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "GDN(d_conv=%d,n_k=%d,d=%d,n_v=%d,T=%d,split=%d,fresh=%d)", gc->d_conv, gc->n_k, gc->d_k, gc->n_v,
             gc->T, gc->n1, gc->fresh);
    const struct kvr_gdn_shape sh = { .il = 0, .d_conv = gc->d_conv, .n_k = gc->n_k, .d_k = gc->d_k, .n_v = gc->n_v,
                                      .d_v = gc->d_k, .eps = 1e-6f };
    const int K = gc->d_conv, D = gc->d_k, Hk = gc->n_k, Hv = gc->n_v, T = gc->T;
    const int C = 2 * Hk * D + Hv * D;
    const int64_t NS = kvr_gdn_state_floats(&sh), NC = (int64_t) (K - 1) * C;
    struct kvr_tensor * x = tc_input_f32(&tc, 2, C, T, 1, 1.0f);
    struct kvr_tensor * w = tc_input_f32(&tc, 2, K, C, 1, 0.7f);
    struct kvr_tensor * g = tc_input_f32(&tc, 2, Hv, T, 1, 1.0f);
    struct kvr_tensor * b = tc_input_f32(&tc, 2, Hv, T, 1, 1.0f);
    struct kvr_tensor * st = tc_input_f32(&tc, 1, NS, 1, 1, 0.5f);
    for (int i = 0; i < Hv * T; i++) {
        ((float *) g->data)[i] = -fabsf(((float *) g->data)[i]) * 0.5f;       // a decay: log of a factor < 1
        ((float *) b->data)[i] = 0.5f + 0.5f * ((float *) b->data)[i];        // a write strength in (0, 1)
    }
    double * S = tc_doubles(&tc, NS); // the reference state, from the initial one
    for (int64_t i = 0; i < NS; i++) S[i] = gc->fresh ? 0.0 : ((const float *) st->data)[i];
    float * init = tc_floats(&tc, NS);
    memcpy(init, st->data, sizeof(float) * (size_t)NS);
    g_inplace.data = st->data;
    g_inplace.init = init;
    g_inplace.n = NS;
    struct kvr_tensor * blk = kvr_gdn_block(tc.ctx, x, w, g, b, &sh);
    struct kvr_tensor * y[2];
    y[0] = kvr_gdn_segment(tc.ctx, blk, 0, gc->n1, st, gc->fresh, NULL);
    y[1] = kvr_gdn_segment(tc.ctx, blk, gc->n1, T - gc->n1, st, false, y[0]); // on from the first segment's state
    if (tc_shape(&tc, y[0], KVR_TYPE_F32, D, Hv, gc->n1, 1) && tc_shape(&tc, y[1], KVR_TYPE_F32, D, Hv, T - gc->n1, 1)) {
        tc_output(&tc, y[0], "y0");
        tc_output(&tc, y[1], "y1");
        if (tc_compute(&tc, y, 2)) {
            const float * X = x->data, * W = w->data, * G = g->data, * B = b->data;
            double * ref = tc_doubles(&tc, (int64_t) D * Hv * T), * c = tc_doubles(&tc, C), * q = tc_doubles(&tc, D),
                   * k = tc_doubles(&tc, D);
            for (int t = 0; t < T; t++) {
                for (int ch = 0; ch < C; ch++) { // the convolution over the history (rolled below), then SiLU
                    double sum = 0.0;
                    for (int j = 0; j < K; j++) {
                        const double xv = j < K - 1 ? S[(int64_t) ch * (K - 1) + j] : X[(int64_t) t * C + ch];
                        sum += W[(int64_t) ch * K + j] * xv;
                    }
                    c[ch] = sum / (1.0 + exp(-sum));
                }
                for (int h = 0; h < Hv; h++) {
                    const int kh = h % Hk;
                    double nq = 0.0, nk = 0.0;
                    for (int i = 0; i < D; i++) {
                        nq += c[kh * D + i] * c[kh * D + i];
                        nk += c[Hk * D + kh * D + i] * c[Hk * D + kh * D + i];
                    }
                    for (int i = 0; i < D; i++) {
                        q[i] = c[kh * D + i] / sqrt(nq + 1e-6);
                        k[i] = c[Hk * D + kh * D + i] / sqrt(nk + 1e-6);
                    }
                    const double eg = exp(G[t * Hv + h]), beta = B[t * Hv + h];
                    for (int j = 0; j < D; j++) { // column j of S (row j as stored)
                        double * s = S + NC + ((int64_t) h * D + j) * D, kd = 0.0, o = 0.0;
                        for (int i = 0; i < D; i++) kd += (s[i] *= eg) * k[i];
                        const double d = beta * (c[2 * Hk * D + h * D + j] - kd);
                        for (int i = 0; i < D; i++) o += (s[i] += k[i] * d) * q[i];
                        ref[((int64_t) t * Hv + h) * D + j] = o / sqrt((double) D);
                    }
                }
                for (int ch = 0; ch < C; ch++) { // the history moves on by this token
                    double * hs = S + (int64_t) ch * (K - 1);
                    for (int j = 0; j + 1 < K - 1; j++) hs[j] = hs[j + 1];
                    if (K > 1) hs[K - 2] = X[(int64_t) t * C + ch];
                }
            }
            const int64_t n0 = (int64_t) D * Hv * gc->n1, n1 = (int64_t) D * Hv * T - n0;
            tc_check(&tc, "y0", tc_read(&tc, y[0]), ref, n0, D, TOL_RED, NULL);
            tc_check(&tc, "y1", tc_read(&tc, y[1]), ref + n0, n1, D, TOL_RED, NULL);
            tc_check(&tc, "state", tc_read(&tc, st), S, NS, NS, TOL_RED, NULL);
        }
    }
    memset(&g_inplace, 0, sizeof(g_inplace));
    tc_end(&tc);
}

static void grp_gdn(void) {
    static const struct gdn_case cases[] = {
        { 4, 2, 32, 4, 9, 4, false },  // tiny-qwen35's heads
        { 4, 2, 32, 4, 9, 4, true },
        { 4, 1, 16, 3, 5, 1, false },  // a segment shorter than the convolution's history
        { 4, 2, 8, 2, 2, 1, true },
        { 2, 3, 16, 6, 40, 33, false },
        { 1, 1, 4, 1, 3, 2, false },   // no history at all
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        for (int nt = 1; nt <= 3; nt++) t_gdn(&cases[i], nt);
    }
}

//
// RMS_NORM, NORM. kind 0: random rows; 1: special rows (zero, constant, one-hot) among random
// ones; 2: random rows around +30 (cancellation in the variance)
//

static void t_norm(bool rms, int n, int r, float eps, int kind, int nt) {
    static const char * kname[] = { "random", "special rows", "offset 30" };
    struct tcase tc;
    tc_begin(&tc, nt, "%s(ne=[%d,%d],eps=%g,x=%s)", rms ? "RMS_NORM" : "NORM", n, r, eps, kname[kind]);
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, r, 1, 1.0f);
    float * A = a->data;
    const int64_t N = (int64_t) n * r;
    if (kind == 1) {
        for (int i = 0; i < n; i++) {
            A[i] = 0.0f;                                       // row 0: zero
            if (r > 1) A[n + i] = 3.0f;                        // row 1: constant
            if (r > 2) A[2 * n + i] = i == n / 2 ? -2.0f : 0;  // row 2: one-hot
        }
    } else if (kind == 2) {
        for (int64_t i = 0; i < N; i++) {
            A[i] += 30.0f;
        }
    }
    struct kvr_tensor * y = rms ? kvr_rms_norm(tc.ctx, a, eps) : kvr_norm(tc.ctx, a, eps);
    if (tc_shape(&tc, y, KVR_TYPE_F32, n, r, 1, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, N);
            if (rms) {
                ref_rms_norm(A, ref, n, r, eps);
            } else {
                double * x = tc_doubles(&tc, N);
                for (int64_t i = 0; i < N; i++) {
                    x[i] = A[i];
                }
                ref_norm(x, ref, n, r, eps);
            }
            tc_check(&tc, "y", tc_read(&tc, y), ref, N, n, kind == 2 ? TOL_NORM_OFFSET : TOL_ELEM, NULL);
        }
    }
    tc_end(&tc);
}

static void grp_norms(bool rms) {
    static const int shapes[][2] = { {1, 1}, {7, 7}, {33, 33}, {130, 7}, {1, 130}, {4096, 2} };
    static const float eps[] = { 1e-5f, 1e-6f };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        for (size_t e = 0; e < 2; e++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_norm(rms, shapes[s][0], shapes[s][1], eps[e], 0, nt);
            }
        }
    }
    for (int nt = 1; nt <= 3; nt++) {
        t_norm(rms, 33, 5, 1e-5f, 1, nt);
        t_norm(rms, 130, 7, 1e-5f, 2, nt);
    }
}

static void grp_rms_norm(void) { grp_norms(true); }
static void grp_norm(void)     { grp_norms(false); }

//
// MUL_MAT: w [K, N] of f32/f16/bf16, x [K, T, T2] f32 (xpad > 0: rows of K + xpad floats,
// starting xpad/2 floats in) -> y [N, T, T2]
//

static void t_mul_mat(enum kvr_type type, int K, int N, int T, int T2, int xpad, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "MUL_MAT(type=%s,K=%d,N=%d,T=%d,T2=%d%s)", type_str(type), K, N, T, T2,
             xpad ? ",x=strided view" : "");
    float * wr;
    struct kvr_tensor * w = tc_weight(&tc, type, K, N, &wr);
    struct kvr_tensor * x;
    const float * xd;
    int64_t x_row = K;
    if (xpad) {
        struct kvr_tensor * xb = tc_input_f32(&tc, 2, K + xpad, T, 1, 1.0f);
        x = kvr_view_2d(tc.ctx, xb, K, T, xb->nb[1], (size_t) (xpad / 2) * sizeof(float));
        xd = (const float *) xb->data + xpad / 2;
        x_row = K + xpad;
    } else {
        x = tc_input_f32(&tc, T2 > 1 ? 3 : 2, K, T, T2, 1.0f);
        xd = x->data;
    }
    struct kvr_tensor * y = kvr_mul_mat(tc.ctx, w, x);
    if (tc_shape(&tc, y, KVR_TYPE_F32, N, T, T2, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, (int64_t) N * T * T2);
            ref_mul_mat(wr, xd, x_row, ref, K, N, (int64_t) T * T2);
            tc_check(&tc, "y", tc_read(&tc, y), ref, (int64_t) N * T * T2, N, TOL_RED, NULL);
        }
    }
    tc_end(&tc);
}

static void grp_mul_mat(void) {
    static const int shapes[][4] = {
        {1, 1, 1, 1}, {7, 1, 7, 1}, {33, 7, 1, 1}, {7, 33, 33, 1}, {130, 33, 7, 1}, {64, 130, 33, 1},
        {256, 130, 33, 1}, {33, 1, 130, 1}, {16, 7, 5, 3},
        {256, 1100, 7, 1}, {4100, 70, 3, 1},   // more than one block of converted weight rows
    };
    static const enum kvr_type types[] = { KVR_TYPE_F32, KVR_TYPE_F16, KVR_TYPE_BF16 };
    for (size_t ti = 0; ti < 3; ti++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_mul_mat(types[ti], shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], 0, nt);
            }
        }
        for (int nt = 1; nt <= 3; nt++) {
            t_mul_mat(types[ti], 33, 7, 7, 1, 6, nt);
            t_mul_mat(types[ti], 64, 33, 40, 1, 16, nt);
        }
    }
}

//
// ROPE
//

struct rope_case {
    int hd, H, T, n_rot;
    float base, fs;
    const char * pos;   // "seq" 0.., "offset" 1000+3i, "large" up to 2^21
    bool strided;       // a: a view one head into rows of hd*(H + 2) floats (a fused qkv)
    float af;           // the attention factor of cosines and sines (1: none)
};

// freqs: with per-pair frequency divisors (Llama 3's rope_freqs: 1, a ramp, then 8)
// af: the attention factor (kvr_rope's; YaRN's ramp off)
static void ref_rope(const float * x, double * y, double * extra, int hd, int H, int T, const int32_t * pos,
                     const float * ff, int n_rot, enum kvr_rope_mode mode, double base, double fs, float af) {
    const float plain[4] = { 0.0f, af, 0.0f, 0.0f };
    ref_rope_yarn(x, y, extra, hd, H, T, pos, ff, n_rot, mode, base, fs, plain);
}

// yarn: NULL, or { ext_factor, attn_factor, corr_lo, corr_hi } (kvr_rope_yarn)
static void t_rope_yarn(const struct rope_case * rc, enum kvr_rope_mode mode, bool freqs, const float * yarn, int nt);

static void t_rope(const struct rope_case * rc, enum kvr_rope_mode mode, bool freqs, int nt) {
    t_rope_yarn(rc, mode, freqs, NULL, nt);
}

static void t_rope_yarn(const struct rope_case * rc, enum kvr_rope_mode mode, bool freqs, const float * yarn, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ROPE(hd=%d,H=%d,T=%d,n_rot=%d,mode=%s,base=%g,freq_scale=%g,attn_factor=%g,pos=%s%s%s%s)", rc->hd, rc->H,
             rc->T, rc->n_rot, mode == KVR_ROPE_NEOX ? "neox" : "norm", rc->base, rc->fs, yarn ? yarn[1] : rc->af, rc->pos,
             rc->strided ? ",a=strided view" : "", freqs ? ",freq factors" : "", yarn ? ",yarn" : "");
    const int64_t N = (int64_t) rc->hd * rc->H * rc->T;
    struct kvr_tensor * a;
    float * x;   // a's values, dense
    if (rc->strided) {
        const int64_t row = (int64_t) rc->hd * (rc->H + 2);
        struct kvr_tensor * fused = tc_input_f32(&tc, 2, row, rc->T, 1, 1.0f);
        a = kvr_view_3d(tc.ctx, fused, rc->hd, rc->H, rc->T, (size_t) rc->hd * sizeof(float), fused->nb[1],
                        (size_t) rc->hd * sizeof(float));
        x = tc_floats(&tc, N);
        for (int t = 0; t < rc->T; t++) {
            memcpy(x + (int64_t) t * rc->hd * rc->H, (const float *) fused->data + t * row + rc->hd,
                   sizeof(float) * (size_t) (rc->hd * rc->H));
        }
    } else {
        a = tc_input_f32(&tc, 3, rc->hd, rc->H, rc->T, 1.0f);
        x = a->data;
    }
    int32_t * pos = (int32_t *) tc_floats(&tc, rc->T);
    static const int32_t large[] = { 65535, 100000, 1048576, 2097151, 32767, 4096 };
    for (int i = 0; i < rc->T; i++) {
        if (!strcmp(rc->pos, "seq")) {
            pos[i] = i;
        } else if (!strcmp(rc->pos, "offset")) {
            pos[i] = 1000 + 3 * i;
        } else {
            pos[i] = i < 6 ? large[i] : rng_int(1 << 21);
        }
    }
    struct kvr_tensor * ff = NULL;
    if (freqs) {
        ff = tc_input_f32(&tc, 1, rc->n_rot / 2, 1, 1, 1.0f);
        float * f = ff->data;
        for (int i = 0; i < rc->n_rot / 2; i++) f[i] = i < rc->n_rot / 8 ? 1.0f : i < rc->n_rot / 4 ? 1.0f + 7.0f * (float) i / (float) rc->n_rot : 8.0f;
    }
    struct kvr_tensor * pt = tc_input_i32(&tc, rc->T, pos);
    struct kvr_tensor * y = yarn ? kvr_rope_yarn(tc.ctx, a, pt, ff, rc->n_rot, mode, rc->base, rc->fs, yarn[0], yarn[1], yarn[2], yarn[3])
                                 : kvr_rope(tc.ctx, a, pt, ff, rc->n_rot, mode, rc->base, rc->fs, rc->af);
    if (tc_shape(&tc, y, KVR_TYPE_F32, rc->hd, rc->H, rc->T, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, N), * extra = tc_doubles(&tc, N);
            if (yarn) ref_rope_yarn(x, ref, extra, rc->hd, rc->H, rc->T, pos, ff ? ff->data : NULL, rc->n_rot, mode, rc->base, rc->fs, yarn);
            else ref_rope(x, ref, extra, rc->hd, rc->H, rc->T, pos, ff ? ff->data : NULL, rc->n_rot, mode, rc->base, rc->fs, rc->af);
            tc_check(&tc, "y", tc_read(&tc, y), ref, N, rc->hd, TOL_ELEM, extra);
        }
    }
    tc_end(&tc);
}

// A ROPE node's values as kvr.h's functions give them in float (kvr_rope_yarn_cs pair by pair, the
// angle stepped by kvr_rope_theta_scale, kvr_rope_rotate), from the node's own parameters: what
// the CPU kernel must give bit for bit, its vector paths included.
static void rope_want(const struct kvr_tensor * node, const float * x, float * y, int hd, int H, int T, const int32_t * pos) {
    const int n_rot = node->op_params[0], mode = node->op_params[1];
    float par[6];
    for (int k = 0; k < 6; k++) memcpy(&par[k], &node->op_params[2 + k], sizeof(float));
    const float ts = kvr_rope_theta_scale(par[0], n_rot);
    for (int t = 0; t < T; t++) {
        float theta = (float) pos[t];
        for (int i = 0; i < n_rot / 2; i++) {
            float c, s;
            kvr_rope_yarn_cs(theta, par[1], par[2], par[3], par[4], par[5], i, &c, &s);
            theta *= ts;
            for (int h = 0; h < H; h++) {
                int i0, i1;
                kvr_rope_dims(mode, n_rot, i, &i0, &i1);
                const size_t r = ((size_t) t * H + h) * hd;
                kvr_rope_rotate(x[r + i0], x[r + i1], c, s, &y[r + i0], &y[r + i1]);
            }
        }
        for (int h = 0; h < H; h++) {
            for (int i = n_rot; i < hd; i++) y[((size_t) t * H + h) * hd + i] = x[((size_t) t * H + h) * hd + i];
        }
    }
}

// Every layer's q and k rope at the same positions, and the CPU backend keeps a thread's angles
// for the next such node (struct rope_cache): four nodes over one positions tensor, two with
// another base and scale between them (the cache must not serve that), computed twice on one backend with
// the positions changed between (nor a graph's earlier run), each node bit for bit as rope_want.
static void t_rope_bits(int hd, int H, int T, int n_rot, enum kvr_rope_mode mode, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ROPE bits and angle cache(hd=%d,H=%d,T=%d,n_rot=%d,mode=%s)", hd, H, T, n_rot,
             mode == KVR_ROPE_NEOX ? "neox" : "norm");
    struct kvr_tensor * a = tc_input_f32(&tc, 3, hd, H, T, 2.0f), * b = tc_input_f32(&tc, 3, hd, H, T, 2.0f);
    int32_t * pos = (int32_t *) tc_floats(&tc, T);
    for (int t = 0; t < T; t++) pos[t] = 17 + 5 * t;
    struct kvr_tensor * pt = tc_input_i32(&tc, T, pos);
    struct kvr_tensor * y[4] = {
        kvr_rope(tc.ctx, a, pt, NULL, n_rot, mode, 10000.0f, 1.0f, 1.0f),
        kvr_rope(tc.ctx, b, pt, NULL, n_rot, mode, 10000.0f, 1.0f, 1.0f),
        kvr_rope(tc.ctx, a, pt, NULL, n_rot, mode, 1e6f, 0.5f, 1.0f),
        kvr_rope(tc.ctx, b, pt, NULL, n_rot, mode, 10000.0f, 1.0f, 1.0f),
    };
    struct kvr_graph * g = kvr_graph_new(tc.ctx, GRAPH_SIZE);
    for (int k = 0; k < 4; k++) kvr_graph_expand(g, y[k]);
    struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nt });
    struct kvr_buffer * buf = be ? kvr_backend_alloc_buffer(be, kvr_graph_plan(g)) : NULL;
    const int64_t N = (int64_t) hd * H * T;
    float * want = tc_floats(&tc, N);
    if (!buf) tc_fail(&tc, "no backend or buffer: %s", kvr_last_error());
    else      kvr_graph_place(g, buf);
    for (int run = 0; buf && run < 2; run++) {
        if (run) {
            for (int t = 0; t < T; t++) ((int32_t *) pt->data)[t] = 4000 - 3 * t;
        }
        const int rc = kvr_backend_graph_compute(be, g);
        if (rc != KVR_OK) {
            tc_fail(&tc, "compute returned %d: %s", rc, kvr_last_error());
            break;
        }
        for (int k = 0; k < 4; k++) {
            rope_want(y[k], k % 2 ? b->data : a->data, want, hd, H, T, pt->data);
            if (memcmp(want, y[k]->data, sizeof(float) * (size_t) N) != 0) {
                tc_fail(&tc, "run %d, node %d: not kvr_rope_rotate's bits", run, k);
            }
        }
    }
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    tc_end(&tc);
}

static void grp_rope(void) {
    for (int nt = 1; nt <= 2; nt++) {
        t_rope_bits(64, 9, 4, 64, KVR_ROPE_NORM, nt);
        t_rope_bits(64, 9, 4, 64, KVR_ROPE_NEOX, nt);
        t_rope_bits(96, 3, 7, 80, KVR_ROPE_NORM, nt);  // 40 pairs: vectors of 8 and 16 with a tail, dims past n_rot
        t_rope_bits(96, 3, 7, 80, KVR_ROPE_NEOX, nt);
        t_rope_bits(32, 2, 1, 20, KVR_ROPE_NEOX, nt);  // no whole vector
    }
    static const struct rope_case cases[] = {
        { 16, 1, 1, 16, 10000.0f, 1.0f, "seq", false, 1.0f },
        { 64, 4, 7, 64, 10000.0f, 1.0f, "seq", false, 1.0f },
        { 64, 2, 33, 32, 10000.0f, 1.0f, "seq", false, 1.0f },
        { 80, 3, 7, 80, 10000.0f, 1.0f, "offset", false, 1.0f },
        { 80, 2, 7, 20, 10000.0f, 1.0f, "offset", false, 1.0f },
        { 32, 4, 7, 24, 1e6f, 0.5f, "offset", false, 1.0f },
        { 128, 2, 33, 128, 500000.0f, 0.25f, "large", false, 1.0f },
        { 64, 3, 130, 64, 10000.0f, 1.0f, "large", false, 1.0f },
        { 64, 4, 7, 64, 10000.0f, 1.0f, "offset", true, 1.0f },
        { 80, 2, 33, 32, 10000.0f, 1.0f, "seq", true, 1.0f },
        // Phi-3's LongRoPE: 24 of 32 dims rotated, cosines and sines scaled (with its factors below)
        { 32, 4, 33, 24, 10000.0f, 1.0f, "large", false, 1.190238f },
        { 32, 6, 7, 24, 10000.0f, 1.0f, "offset", true, 0.75f },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_rope(&cases[c], m ? KVR_ROPE_NEOX : KVR_ROPE_NORM, false, nt);
            }
            if (cases[c].n_rot >= 16) t_rope(&cases[c], m ? KVR_ROPE_NEOX : KVR_ROPE_NORM, true, 2);
        }
    }
    // YaRN (gpt-oss: factor 32 over 4096 positions, base 150000): the ramp's dims as ggml's
    // ggml_rope_yarn_corr_dims gives them for a head of 32 ([4, 9], the reference README's), and the
    // rotation with the ramp, the magnitude, an attention factor, another base, positions far out
    float lo, hi;
    kvr_rope_yarn_corr_dims(32, 4096, 150000.0f, 32.0f, 1.0f, &lo, &hi);
    {
        struct tcase tc;
        tc_begin(&tc, 1, "ROPE(yarn corr dims of n_rot 32, 4096 positions, base 150000)");
        if (lo != 4.0f || hi != 9.0f) tc_fail(&tc, "corr dims [%g, %g], expected [4, 9]", (double)lo, (double)hi);
        tc_end(&tc);
    }
    static const struct rope_case ycases[] = {
        { 32, 8, 33, 32, 150000.0f, 1.0f / 32.0f, "seq", false, 1.0f },
        { 64, 4, 7, 64, 150000.0f, 1.0f / 32.0f, "large", false, 1.0f },
        { 64, 3, 9, 48, 10000.0f, 0.25f, "offset", true, 1.0f },
    };
    const float yarn[3][4] = { { 1.0f, 1.0f, lo, hi }, { 1.0f, 0.7f, 6.0f, 20.0f }, { 0.5f, 1.0f, 2.0f, 2.0f } };
    for (size_t c = 0; c < sizeof(ycases) / sizeof(ycases[0]); c++) {
        for (int nt = 1; nt <= 3; nt += 2) t_rope_yarn(&ycases[c], KVR_ROPE_NEOX, false, yarn[c], nt);
        t_rope_yarn(&ycases[c], KVR_ROPE_NORM, c == 1, yarn[c], 2);
    }
}

//
// CPY: a f32 into b (f32 or f16; into_view: b is rows [2, 2 + r) of a larger leaf)
//

static void t_cpy(enum kvr_type type, int n, int r, bool into_view, int nt) {
    static const float specials[] = {
        0.0f, -0.0f, 1.0f, -2.0f, 65504.0f, 65519.0f, 65520.0f, -1e5f, 6.103515625e-05f, 5.9604645e-08f,
        2.9802322e-08f, 4.4703484e-08f, 1.00048828125f, 1.00146484375f, 0.33333334f, INFINITY, -INFINITY,
        NAN,
        // around the smallest normal 2^-14: the largest subnormal, and values that round up to 2^-14
        6.0975552e-05f, 6.102e-05f, -6.1005353927612305e-05f, 6.1035e-05f,
    };
    const int n_spec = (int) (sizeof(specials) / sizeof(specials[0]));
    struct tcase tc;
    tc_begin(&tc, nt, "CPY(f32->%s,ne=[%d,%d]%s)", type_str(type), n, r, into_view ? ",b=view" : "");
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, r, 1, 2.0f);
    float * A = a->data;
    if (type == KVR_TYPE_F16) {
        for (int i = 0; i < n_spec && i < n * r; i++) {
            A[i] = specials[i];
        }
    }
    const size_t es = elem_size(type), row = (size_t) n * es;
    const int pad = into_view ? 3 : 0;
    struct kvr_tensor * big = kvr_new_tensor_2d(tc.ctx, type, n, r + pad);
    big->data = tc_alloc(&tc, row * (size_t) (r + pad), true, 0x5A, "cpy dst");
    struct kvr_tensor * b = into_view ? kvr_view_2d(tc.ctx, big, n, r, big->nb[1], 2 * row) : big;
    // into a view, copy a computed node (planned memory) rather than a leaf
    struct kvr_tensor * src = into_view ? kvr_scale(tc.ctx, a, 1.0f) : a;
    struct kvr_tensor * y = kvr_cpy(tc.ctx, src, b);
    if (tc_shape(&tc, y, type, n, r, 1, 1)) {
        y->flags |= KVR_FLAG_OUTPUT;
        if (tc_compute(&tc, &y, 1)) {
            const uint8_t * base = big->data;
            for (int64_t row_i = 0; row_i < r + pad; row_i++) {
                const bool inside = !into_view || (row_i >= 2 && row_i < 2 + r);
                for (int64_t i = 0; i < n && tc.n_fail == 0; i++) {
                    const uint8_t * p = base + (size_t) row_i * row + (size_t) i * es;
                    if (!inside) {
                        for (size_t k = 0; k < es; k++) {
                            if (p[k] != 0x5A) {
                                tc_fail(&tc, "row %lld outside the view [2,%d) was written", (long long) row_i, 2 + r);
                            }
                        }
                        continue;
                    }
                    const float x = A[(row_i - (into_view ? 2 : 0)) * n + i];
                    if (type == KVR_TYPE_F16) {
                        uint16_t got, exp = ref_f32_to_f16(x);
                        memcpy(&got, p, 2);
                        const bool both_nan = isnan(x) && (got & 0x7c00) == 0x7c00 && (got & 0x3ff);
                        if (got != exp && !both_nan) {
                            tc_fail(&tc, "[%lld,%lld]: %.9g -> f16 0x%04x, expected 0x%04x", (long long) i,
                                    (long long) row_i, x, got, exp);
                        }
                    } else {
                        float got;
                        memcpy(&got, p, 4);
                        if (memcmp(&got, &x, 4) != 0) {
                            tc_fail(&tc, "[%lld,%lld]: got %.9g expected %.9g", (long long) i, (long long) row_i,
                                    got, x);
                        }
                    }
                }
            }
        }
    }
    tc_end(&tc);
}

// CPY of typed rows into rows of the same type (ring-kv's gathered blocks): the bytes as they are,
// into rows [2, 2 + r) of a larger leaf, the rows around untouched
static void t_cpy_rows(enum kvr_type type, int n, int r, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "CPY(%s->%s,ne=[%d,%d],b=view)", type_str(type), type_str(type), n, r);
    const size_t row = kvr_row_size(type, n);
    struct kvr_tensor * a = kvr_new_tensor_2d(tc.ctx, type, n, r);
    uint8_t * A = tc_alloc(&tc, row * (size_t) r, true, 0, "cpy src");
    for (size_t i = 0; i < row * (size_t) r; i++) A[i] = (uint8_t) (i * 37 + 11);
    a->data = A;
    struct kvr_tensor * big = kvr_new_tensor_2d(tc.ctx, type, n, r + 3);
    big->data = tc_alloc(&tc, row * (size_t) (r + 3), true, 0x5A, "cpy dst");
    struct kvr_tensor * y = kvr_cpy(tc.ctx, a, kvr_view_2d(tc.ctx, big, n, r, big->nb[1], 2 * row));
    if (tc_shape(&tc, y, type, n, r, 1, 1)) {
        y->flags |= KVR_FLAG_OUTPUT;
        if (tc_compute(&tc, &y, 1)) {
            const uint8_t * B = big->data;
            for (int64_t i = 0; i < (int64_t) (row * (size_t) (r + 3)) && tc.n_fail == 0; i++) {
                const int64_t ri = i / (int64_t) row;
                const uint8_t want = ri >= 2 && ri < 2 + r ? A[i - 2 * (int64_t) row] : 0x5A;
                if (B[i] != want) tc_fail(&tc, "byte %lld of row %lld: 0x%02x, expected 0x%02x", (long long) (i % (int64_t) row), (long long) ri, B[i], want);
            }
        }
    }
    tc_end(&tc);
}

static void grp_cpy(void) {
    static const enum kvr_type typed[] = { KVR_TYPE_F16, KVR_TYPE_BF16, KVR_TYPE_Q8_0, KVR_TYPE_I32 };
    for (size_t ti = 0; ti < sizeof(typed) / sizeof(typed[0]); ti++) {
        for (int nt = 1; nt <= 3; nt += 2) t_cpy_rows(typed[ti], 64, 5, nt);
    }
    static const int shapes[][2] = { {1, 1}, {7, 7}, {33, 33}, {130, 7} };
    for (int f16 = 0; f16 < 2; f16++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            for (int v = 0; v < 2; v++) {
                for (int nt = 1; nt <= 3; nt++) {
                    t_cpy(f16 ? KVR_TYPE_F16 : KVR_TYPE_F32, shapes[s][0], shapes[s][1], v, nt);
                }
            }
        }
    }
}

//
// KV_STORE: T new rows (a computed node, 0.5 * x) into cache rows [p, p + T), then ATTN of the
// T queries over cache rows [0, p + T) that depends on the stores
//

static void t_kv_store(int hd, int Hkv, int H, int n_ctx, int p, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "KV_STORE(hd=%d,Hkv=%d,n_ctx=%d,rows=[%d,%d)) + ATTN(H=%d)", hd, Hkv, n_ctx, p, p + T, H);
    const int64_t kv_dim = (int64_t) hd * Hkv;
    const size_t  row = (size_t) kv_dim * sizeof(float);
    struct kvr_tensor * cache[2], * store[2];
    float * hist[2], * xin[2];
    for (int c = 0; c < 2; c++) {
        cache[c] = kvr_new_tensor_2d(tc.ctx, KVR_TYPE_F32, kv_dim, n_ctx);
        cache[c]->data = tc_alloc(&tc, row * (size_t) n_ctx, true, 0xFF, c ? "cache v" : "cache k");
        hist[c] = cache[c]->data;
        fill(hist[c], kv_dim * p, -1.0f, 1.0f);   // rows before p: earlier tokens
        struct kvr_tensor * x = tc_input_f32(&tc, 2, kv_dim, T, 1, 1.0f);
        xin[c] = x->data;
        struct kvr_tensor * dst = kvr_view_2d(tc.ctx, cache[c], kv_dim, T, cache[c]->nb[1], (size_t) p * row);
        store[c] = kvr_kv_store(tc.ctx, kvr_scale(tc.ctx, x, 0.5f), dst);
    }
    float * hist_copy = tc_floats(&tc, kv_dim * p * 2 + 1);
    memcpy(hist_copy, hist[0], row * (size_t) p);
    memcpy(hist_copy + kv_dim * p, hist[1], row * (size_t) p);

    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, H, T, 1.0f);
    int32_t * qpos = (int32_t *) tc_floats(&tc, T), * kpos = (int32_t *) tc_floats(&tc, p + T);
    for (int i = 0; i < T; i++) qpos[i] = p + i;
    for (int j = 0; j < p + T; j++) kpos[j] = j;
    struct kvr_tensor * kv[2];
    for (int c = 0; c < 2; c++) {
        kv[c] = kvr_view_3d(tc.ctx, cache[c], hd, Hkv, p + T, (size_t) hd * sizeof(float), row, 0);
    }
    const float scale = 1.0f / sqrtf((float) hd);
    struct kvr_tensor * attn = kvr_attn(tc.ctx, q, kv[0], kv[1], tc_input_i32(&tc, T, qpos),
                                        tc_input_i32(&tc, p + T, kpos), store[0], scale, 0.0f, 0, KVR_ATTN_CAUSAL);
    if (tc_shape(&tc, store[0], KVR_TYPE_F32, kv_dim, T, 1, 1) && tc_shape(&tc, store[1], KVR_TYPE_F32, kv_dim, T, 1, 1) &&
        tc_shape(&tc, attn, KVR_TYPE_F32, (int64_t) hd * H + H, T, 1, 1)) {
        tc_output(&tc, attn, "attn");
        struct kvr_tensor * outs[3] = { store[1], store[0], attn };   // the V store first, then ATTN after its dep
        if (tc_compute(&tc, outs, 3)) {
            for (int c = 0; c < 2; c++) {
                const uint32_t * bits = (const uint32_t *) hist[c];
                for (int64_t j = 0; j < n_ctx && tc.n_fail == 0; j++) {
                    for (int64_t i = 0; i < kv_dim; i++) {
                        const float got = hist[c][j * kv_dim + i];
                        if (j < p) {
                            if (memcmp(&got, &hist_copy[c * kv_dim * p + j * kv_dim + i], 4)) {
                                tc_fail(&tc, "cache %c row %lld (before the store) changed", "kv"[c], (long long) j);
                                break;
                            }
                        } else if (j < p + T) {
                            const float exp = 0.5f * xin[c][(j - p) * kv_dim + i];
                            if (got != exp) {
                                tc_fail(&tc, "cache %c [%lld,%lld]: got %.9g expected %.9g", "kv"[c], (long long) i,
                                        (long long) j, got, exp);
                                break;
                            }
                        } else if (bits[j * kv_dim + i] != 0xFFFFFFFFu) {
                            tc_fail(&tc, "cache %c row %lld (after the store) was written", "kv"[c], (long long) j);
                            break;
                        }
                    }
                }
            }
            const struct attn_ref ar = {
                .hd = hd, .H = H, .Hkv = Hkv, .Tq = T, .Tk = p + T,
                .q = q->data, .q_tok = (int64_t) hd * H, .k = hist[0], .v = hist[1], .kv_tok = kv_dim,
                .qpos = qpos, .kpos = kpos, .scale = scale,
            };
            double * ref = tc_doubles(&tc, ((int64_t) hd * H + H) * T);
            ref_attn(&ar, ref);
            tc_check(&tc, "attn", tc_read(&tc, attn), ref, ((int64_t) hd * H + H) * T, (int64_t) hd * H + H,
                     TOL_RED, NULL);
        }
    }
    tc_end(&tc);
}

// KV_STORE into a typed cache (F16, BF16, Q8_0): the stored rows are kvr_kv_rows_from_float's bytes
// of the same values (one rule for the CPU's store, the GPU's and the files), rows outside untouched;
// and kvr_kv_elem (the GPU's element reader, kvr.h I5) reads every stored element as
// kvr_kv_rows_to_float does.
static void t_kv_store_typed(enum kvr_type type, int kv_dim, int n_ctx, int p, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "KV_STORE(type=%s,kv_dim=%d,n_ctx=%d,rows=[%d,%d))", type_str(type), kv_dim, n_ctx, p, p + T);
    const size_t row = kvr_row_size(type, kv_dim);
    struct kvr_tensor * cache = kvr_new_tensor_2d(tc.ctx, type, kv_dim, n_ctx);
    cache->data = tc_alloc(&tc, row * (size_t) n_ctx, true, 0xFF, "cache");
    struct kvr_tensor * x = tc_input_f32(&tc, 2, kv_dim, T, 1, 3.0f);
    struct kvr_tensor * dst = kvr_view_2d(tc.ctx, cache, kv_dim, T, cache->nb[1], (size_t) p * row);
    struct kvr_tensor * st = kvr_kv_store(tc.ctx, kvr_scale(tc.ctx, x, 0.5f), dst);
    if (tc_shape(&tc, st, type, kv_dim, T, 1, 1) && tc_compute(&tc, &st, 1)) {
        float * half = tc_floats(&tc, (int64_t) kv_dim * T), * back = tc_floats(&tc, (int64_t) kv_dim * T);
        for (int64_t i = 0; i < (int64_t) kv_dim * T; i++) half[i] = 0.5f * ((const float *) x->data)[i];
        uint8_t * want = tc_alloc(&tc, row * (size_t) T, false, 0, "want");
        kvr_kv_rows_from_float(type, half, want, T, kv_dim);
        const uint8_t * c = cache->data;
        if (memcmp(c + (size_t) p * row, want, row * (size_t) T) != 0) tc_fail(&tc, "the stored rows differ from kvr_kv_rows_from_float's");
        for (size_t b = 0; b < row * (size_t) n_ctx; b++) {
            if ((b < (size_t) p * row || b >= (size_t) (p + T) * row) && c[b] != 0xFF) {
                tc_fail(&tc, "byte %zu outside the stored rows was written", b);
                break;
            }
        }
        kvr_kv_rows_to_float(type, c + (size_t) p * row, back, T, kv_dim);
        for (int64_t r = 0; r < T && tc.n_fail == 0; r++) {
            for (int64_t i = 0; i < kv_dim; i++) {
                const float e = kvr_kv_elem(type, c + (size_t) (p + r) * row, i), w = back[r * kv_dim + i];
                if (memcmp(&e, &w, 4) != 0) {
                    tc_fail(&tc, "kvr_kv_elem of row %lld element %lld: %.9g, kvr_kv_rows_to_float %.9g", (long long) r, (long long) i, e, w);
                    break;
                }
                tc.err = fmax(tc.err, fabs((double) w - half[r * kv_dim + i]));
            }
        }
    }
    tc_end(&tc);
}

static void grp_kv_store(void) {
    static const int cases[][6] = {
        // hd, Hkv, H, n_ctx, p, T
        { 16, 2, 4, 48, 0, 7 }, { 16, 2, 4, 48, 13, 1 }, { 64, 1, 4, 80, 40, 33 }, { 80, 2, 2, 48, 47, 1 },
        { 16, 4, 8, 130, 0, 130 },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int nt = 1; nt <= 3; nt++) {
            t_kv_store(cases[c][0], cases[c][1], cases[c][2], cases[c][3], cases[c][4], cases[c][5], nt);
        }
    }
    static const enum kvr_type types[] = { KVR_TYPE_F16, KVR_TYPE_BF16, KVR_TYPE_Q8_0 };
    for (int t = 0; t < 3; t++) {
        for (int nt = 1; nt <= 3; nt += 2) {
            t_kv_store_typed(types[t], 64, 48, 0, 7, nt);
            t_kv_store_typed(types[t], 192, 130, 40, 33, nt);
            t_kv_store_typed(types[t], 32, 16, 15, 1, nt);
        }
    }
}

//
// ATTN
//

struct attn_case {
    int hd, H, Hkv, Tq, Tk;
    const char * pos;
    bool q_strided;   // q: a view into rows of hd*(H + 3) floats, one head in (a fused qkv)
    bool hot;         // q in +-16 and scale 1: scores in the hundreds (exp overflows if unshifted)
};

// Rank r's tokens of a zigzag shard over 4 ranks: chunks r and 7 - r of c tokens each.
static void zigzag(int32_t * pos, int r, int c) {
    for (int i = 0; i < c; i++) {
        pos[i] = r * c + i;
        pos[c + i] = (7 - r) * c + i;
    }
}

static void attn_positions(const char * kind, int Tq, int Tk, int32_t * qpos, int32_t * kpos) {
    if (!strcmp(kind, "causal")) {            // the queries are the last Tq of the Tk keys
        for (int j = 0; j < Tk; j++) kpos[j] = j;
        for (int i = 0; i < Tq; i++) qpos[i] = Tk - Tq + i;
    } else if (!strcmp(kind, "mid")) {        // later keys exist and are masked for every query
        for (int j = 0; j < Tk; j++) kpos[j] = j;
        for (int i = 0; i < Tq; i++) qpos[i] = (Tk - Tq) / 2 + i;
    } else if (!strcmp(kind, "masked")) {     // every key is after every query
        for (int j = 0; j < Tk; j++) kpos[j] = 1000 + j;
        for (int i = 0; i < Tq; i++) qpos[i] = i;
    } else if (!strcmp(kind, "zz-1-2") || !strcmp(kind, "zz-2-1") || !strcmp(kind, "zz-1-1")) {
        zigzag(qpos, kind[3] - '0', Tq / 2);  // a ring step: queries of rank a, keys of rank b
        zigzag(kpos, kind[5] - '0', Tk / 2);
    } else {                                  // "shuffled": keys in any order, queries anywhere
        for (int j = 0; j < Tk; j++) kpos[j] = j;
        for (int j = Tk - 1; j > 0; j--) {
            const int k = rng_int(j + 1), t = kpos[j];
            kpos[j] = kpos[k];
            kpos[k] = t;
        }
        for (int i = 0; i < Tq; i++) qpos[i] = rng_int(Tk + 2) - 1;
    }
}

static void t_attn_sinks(const struct attn_case * ac, int window, float softcap, enum kvr_attn_mode mode, bool sinks, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ATTN(hd=%d,H=%d,Hkv=%d,Tq=%d,Tk=%d,pos=%s,mode=%s%s%s,window=%d,softcap=%g%s)", ac->hd, ac->H, ac->Hkv,
             ac->Tq, ac->Tk, ac->pos, mode_str(mode), ac->q_strided ? ",q=strided" : "", ac->hot ? ",hot" : "", window, softcap,
             sinks ? ",sinks" : "");
    const int hd = ac->hd, H = ac->H, Tq = ac->Tq, Tk = ac->Tk;
    const float amp = ac->hot ? 16.0f : 1.0f;
    struct kvr_tensor * q;
    const float * qd;
    int64_t q_tok = (int64_t) hd * H;
    if (ac->q_strided) {
        q_tok = (int64_t) hd * (H + 3);
        struct kvr_tensor * qb = tc_input_f32(&tc, 2, q_tok, Tq, 1, amp);
        q = kvr_view_3d(tc.ctx, qb, hd, H, Tq, (size_t) hd * sizeof(float), qb->nb[1], (size_t) hd * sizeof(float));
        qd = (const float *) qb->data + hd;
    } else {
        q = tc_input_f32(&tc, 3, hd, H, Tq, amp);
        qd = q->data;
    }
    struct kvr_tensor * k = tc_input_f32(&tc, 3, hd, ac->Hkv, Tk, 1.0f);
    struct kvr_tensor * v = tc_input_f32(&tc, 3, hd, ac->Hkv, Tk, 1.0f);
    int32_t * qpos = (int32_t *) tc_floats(&tc, Tq), * kpos = (int32_t *) tc_floats(&tc, Tk);
    attn_positions(ac->pos, Tq, Tk, qpos, kpos);
    const float scale = ac->hot ? 1.0f : 1.0f / sqrtf((float) hd);
    struct kvr_tensor * y = kvr_attn(tc.ctx, q, k, v, tc_input_i32(&tc, Tq, qpos), tc_input_i32(&tc, Tk, kpos), NULL,
                                     scale, softcap, window, mode);
    // sink logits around the scores' range (hot: in the hundreds, as the scores)
    struct kvr_tensor * sk = sinks ? tc_input_f32(&tc, 1, H, 1, 1, ac->hot ? 200.0f : 3.0f) : NULL;
    if (sk) kvr_attn_sinks(y, sk);
    const int64_t row = (int64_t) hd * H + H;
    if (tc_shape(&tc, y, KVR_TYPE_F32, row, Tq, 1, 1)) {
        tc_output(&tc, y, "attn");
        if (tc_compute(&tc, &y, 1)) {
            const struct attn_ref ar = {
                .hd = hd, .H = H, .Hkv = ac->Hkv, .Tq = Tq, .Tk = Tk, .q = qd, .q_tok = q_tok,
                .k = k->data, .v = v->data, .kv_tok = (int64_t) hd * ac->Hkv,
                .qpos = qpos, .kpos = kpos, .scale = scale, .window = window, .softcap = softcap,
                .sinks = sk ? sk->data : NULL,
            };
            double * ref = tc_doubles(&tc, row * Tq);
            ref_attn(&ar, ref);
            tc_check(&tc, "attn", tc_read(&tc, y), ref, row * Tq, row, TOL_RED, NULL);
        }
    }
    tc_end(&tc);
}

static void t_attn(const struct attn_case * ac, int window, float softcap, enum kvr_attn_mode mode, int nt) {
    t_attn_sinks(ac, window, softcap, mode, false, nt);
}

static void grp_attn(void) {
    static const struct attn_case cases[] = {
        { 16, 4, 4, 1, 1, "causal", false, false },
        { 16, 2, 2, 7, 7, "causal", false, false },
        { 64, 4, 4, 33, 33, "causal", false, false },      // MHA
        { 64, 8, 2, 33, 33, "causal", false, false },      // GQA
        { 64, 4, 1, 7, 40, "causal", false, false },       // MQA, Tq < Tk
        { 80, 4, 2, 33, 130, "mid", false, false },
        { 80, 2, 1, 130, 130, "causal", false, false },
        { 64, 4, 2, 1, 67, "causal", false, false },       // one decode step
        { 128, 2, 1, 17, 65, "causal", false, false },
        { 16, 4, 2, 10, 10, "zz-1-2", false, false },      // rank 1's first chunk sees nothing
        { 16, 4, 2, 10, 10, "zz-2-1", false, false },
        { 80, 2, 2, 14, 14, "zz-1-1", false, false },
        { 64, 6, 3, 66, 66, "zz-1-2", false, false },
        { 64, 4, 4, 7, 9, "masked", false, false },
        { 64, 4, 2, 33, 33, "shuffled", false, false },
        { 64, 4, 2, 33, 33, "causal", false, true },
        { 80, 6, 3, 7, 33, "causal", true, false },
        { 16, 4, 1, 33, 130, "mid", true, false },
        // more than one key tile (and query tile) of the CPU kernel
        { 16, 2, 1, 300, 300, "causal", false, true },
        { 64, 4, 2, 7, 600, "mid", false, false },
        { 16, 2, 2, 520, 520, "zz-2-1", false, false },
        { 32, 4, 1, 1, 777, "causal", true, false },
        { 16, 2, 1, 40, 700, "shuffled", false, false },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_attn(&cases[c], 0, 0.0f, m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt);
            }
        }
    }
    // sliding windows (gemma3's local layers): shorter and longer than a key tile, 1 (a query sees
    // only itself), over zigzag shards (a ring step), shuffled keys, a decode step far from the keys
    static const struct { struct attn_case c; int window; } wcases[] = {
        { { 16, 2, 2, 7, 7, "causal", false, false }, 3 },
        { { 64, 8, 2, 33, 33, "causal", false, false }, 1 },
        { { 64, 4, 1, 7, 40, "causal", false, false }, 16 },
        { { 80, 4, 2, 33, 130, "mid", false, false }, 20 },
        { { 16, 4, 2, 10, 10, "zz-1-2", false, false }, 4 },
        { { 64, 6, 3, 66, 66, "zz-2-1", false, false }, 9 },
        { { 64, 4, 2, 33, 33, "shuffled", false, false }, 8 },
        { { 64, 4, 2, 1, 67, "causal", false, false }, 16 },
        { { 16, 2, 1, 300, 300, "causal", false, true }, 100 },
        { { 16, 2, 1, 40, 700, "shuffled", false, false }, 300 },
        { { 16, 2, 2, 520, 520, "zz-2-1", false, false }, 50 },
        { { 32, 4, 1, 1, 777, "causal", true, false }, 1000 },
    };
    for (size_t c = 0; c < sizeof(wcases) / sizeof(wcases[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt += 2) {
                t_attn(&wcases[c].c, wcases[c].window, 0.0f, m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt);
            }
        }
    }
    // soft-capped scores (gemma2): hot scores in the hundreds capped at 50 (most saturate), mild
    // ones capped at 2 (every score bent); exact and tiled kernels, a decode step, zigzag shards,
    // and a window
    static const struct { struct attn_case c; int window; float cap; } ccases[] = {
        { { 64, 4, 2, 33, 33, "causal", false, true }, 0, 50.0f },
        { { 64, 8, 2, 33, 33, "causal", false, false }, 0, 2.0f },
        { { 64, 4, 2, 1, 67, "causal", false, true }, 16, 50.0f },
        { { 16, 4, 2, 10, 10, "zz-1-2", false, false }, 0, 0.5f },
        { { 80, 6, 3, 7, 33, "causal", true, false }, 5, 2.0f },
        { { 16, 2, 1, 300, 300, "causal", false, true }, 100, 50.0f },
        { { 32, 4, 1, 1, 777, "causal", true, true }, 0, 30.0f },
        { { 16, 2, 1, 40, 700, "shuffled", false, false }, 300, 1.0f },
    };
    for (size_t c = 0; c < sizeof(ccases) / sizeof(ccases[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt += 2) {
                t_attn(&ccases[c].c, ccases[c].window, ccases[c].cap, m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt);
            }
        }
    }
    // attention sinks (gpt-oss): the exact kernel and the tiled one, GQA, windows, a decode step,
    // rows that see no key (O 0, LSE the sink's logit), scores in the hundreds
    static const struct { struct attn_case c; int window; } scases[] = {
        { { 64, 8, 2, 33, 33, "causal", false, false }, 0 },
        { { 32, 8, 2, 64, 64, "causal", false, false }, 16 },
        { { 64, 4, 2, 1, 67, "causal", false, false }, 0 },
        { { 64, 4, 4, 7, 9, "masked", false, false }, 0 },
        { { 16, 4, 2, 10, 10, "zz-1-2", false, false }, 0 },
        { { 64, 4, 2, 33, 33, "causal", false, true }, 0 },
        { { 16, 2, 1, 300, 300, "causal", false, true }, 100 },
        { { 16, 2, 1, 40, 700, "shuffled", false, false }, 0 },
    };
    for (size_t c = 0; c < sizeof(scases) / sizeof(scases[0]); c++) {
        for (int nt = 1; nt <= 3; nt += 2) t_attn_sinks(&scases[c].c, scases[c].window, 0.0f, KVR_ATTN_CAUSAL, true, nt);
    }
}

//
// MERGE_ATTN: of given partials, and of ATTN over chunks of the keys against ATTN over all keys
//

static void ref_merge(float * const * parts, int n, int hd, int H, int Tq, double * out) {
    const int64_t row = (int64_t) hd * H + H;
    for (int i = 0; i < Tq; i++) {
        for (int h = 0; h < H; h++) {
            const int64_t lo = i * row + (int64_t) h * hd, li = i * row + (int64_t) hd * H + h;
            double m = -INFINITY;
            for (int p = 0; p < n; p++) {
                m = fmax(m, parts[p][li]);
            }
            for (int d = 0; d < hd; d++) {
                out[lo + d] = 0.0;
            }
            if (m == -INFINITY) {
                out[li] = -INFINITY;
                continue;
            }
            double sum = 0.0;
            for (int p = 0; p < n; p++) {
                sum += exp(parts[p][li] - m);
            }
            const double lse = m + log(sum);
            for (int p = 0; p < n; p++) {
                const double w = exp(parts[p][li] - lse);
                for (int d = 0; d < hd; d++) {
                    out[lo + d] += w * parts[p][lo + d];
                }
            }
            out[li] = lse;
        }
    }
}

// kind: "rand" LSE in +-4, a quarter empty; "big" LSE around +-100; "empty" every third row
// empty in every partial. Empty partials carry random O: they must drop out whatever it is.
static void t_merge(int hd, int H, int Tq, int n, const char * kind, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "MERGE_ATTN(hd=%d,H=%d,Tq=%d,n=%d,lse=%s)", hd, H, Tq, n, kind);
    const int64_t row = (int64_t) hd * H + H;
    struct kvr_tensor * parts[KVR_MAX_SRC];
    float * pd[KVR_MAX_SRC];
    for (int p = 0; p < n; p++) {
        parts[p] = tc_input_f32(&tc, 2, row, Tq, 1, 1.0f);
        pd[p] = parts[p]->data;
        for (int i = 0; i < Tq; i++) {
            for (int h = 0; h < H; h++) {
                float * l = &pd[p][i * row + (int64_t) hd * H + h];
                if (!strcmp(kind, "big")) {
                    *l = (rng_int(2) ? 1.0f : -1.0f) * rng_f(80.0f, 120.0f);
                } else if (!strcmp(kind, "empty") && i % 3 == 0) {
                    *l = -INFINITY;
                } else {
                    *l = rng_int(4) == 0 ? -INFINITY : rng_f(-4.0f, 4.0f);
                }
            }
        }
    }
    struct kvr_tensor * y = kvr_merge_attn(tc.ctx, parts, n, H);
    if (tc_shape(&tc, y, KVR_TYPE_F32, row, Tq, 1, 1)) {
        tc_output(&tc, y, "merged");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, row * Tq);
            ref_merge(pd, n, hd, H, Tq, ref);
            tc_check(&tc, "merged", tc_read(&tc, y), ref, row * Tq, row, TOL_ELEM, NULL);
        }
    }
    tc_end(&tc);
}

// Keys [0, Tk) in n_chunks contiguous chunks, one ATTN each (views of k, v and kpos), merged;
// queries: every token ("causal") or rank 1's zigzag shard over 4 ranks ("zz"), so some
// partials are empty for some queries, as in a ring step.
static void t_merge_chunks_sinks(int hd, int H, int Hkv, int Tk, int n_chunks, const char * qkind, float softcap,
                                 enum kvr_attn_mode mode, bool sinks, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "MERGE_ATTN(ATTN over %d key chunks,hd=%d,H=%d,Hkv=%d,Tk=%d,q=%s,softcap=%g,mode=%s%s)", n_chunks, hd, H,
             Hkv, Tk, qkind, softcap, mode_str(mode), sinks ? ",sinks on the merge" : "");
    const int Tq = !strcmp(qkind, "zz") ? Tk / 4 : Tk;
    int32_t * qpos = (int32_t *) tc_floats(&tc, Tq), * kpos = (int32_t *) tc_floats(&tc, Tk);
    for (int j = 0; j < Tk; j++) kpos[j] = j;
    if (Tq == Tk) {
        for (int i = 0; i < Tq; i++) qpos[i] = i;
    } else {
        zigzag(qpos, 1, Tk / 8);
    }
    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, H, Tq, 1.0f);
    struct kvr_tensor * k = tc_input_f32(&tc, 3, hd, Hkv, Tk, 1.0f);
    struct kvr_tensor * v = tc_input_f32(&tc, 3, hd, Hkv, Tk, 1.0f);
    struct kvr_tensor * qp = tc_input_i32(&tc, Tq, qpos), * kp = tc_input_i32(&tc, Tk, kpos);
    const float scale = 1.0f / sqrtf((float) hd);
    struct kvr_tensor * parts[KVR_MAX_SRC];
    for (int c = 0; c < n_chunks; c++) {
        const int j0 = Tk * c / n_chunks, j1 = Tk * (c + 1) / n_chunks;
        struct kvr_tensor * kc = kvr_view_3d(tc.ctx, k, hd, Hkv, j1 - j0, k->nb[1], k->nb[2], (size_t) j0 * k->nb[2]);
        struct kvr_tensor * vc = kvr_view_3d(tc.ctx, v, hd, Hkv, j1 - j0, v->nb[1], v->nb[2], (size_t) j0 * v->nb[2]);
        struct kvr_tensor * pc = kvr_view_1d(tc.ctx, kp, j1 - j0, (size_t) j0 * sizeof(int32_t));
        parts[c] = kvr_attn(tc.ctx, q, kc, vc, qp, pc, NULL, scale, softcap, 0, mode);
    }
    const int64_t row = (int64_t) hd * H + H;
    struct kvr_tensor * y = kvr_merge_attn(tc.ctx, parts, n_chunks, H);
    // the sinks once, on the merge of partials that have none: the softmax over all keys with them
    struct kvr_tensor * sk = sinks ? tc_input_f32(&tc, 1, H, 1, 1, 3.0f) : NULL;
    if (sk) kvr_attn_sinks(y, sk);
    if (tc_shape(&tc, y, KVR_TYPE_F32, row, Tq, 1, 1)) {
        tc_output(&tc, y, "merged");
        if (tc_compute(&tc, &y, 1)) {
            const struct attn_ref ar = {
                .hd = hd, .H = H, .Hkv = Hkv, .Tq = Tq, .Tk = Tk, .q = q->data, .q_tok = (int64_t) hd * H,
                .k = k->data, .v = v->data, .kv_tok = (int64_t) hd * Hkv, .qpos = qpos, .kpos = kpos, .scale = scale,
                .softcap = softcap,
                .sinks = sk ? sk->data : NULL,
            };
            double * ref = tc_doubles(&tc, row * Tq);
            ref_attn(&ar, ref);
            tc_check(&tc, "merged", tc_read(&tc, y), ref, row * Tq, row, TOL_RED, NULL);
        }
    }
    tc_end(&tc);
}

static void t_merge_chunks(int hd, int H, int Hkv, int Tk, int n_chunks, const char * qkind, float softcap,
                           enum kvr_attn_mode mode, int nt) {
    t_merge_chunks_sinks(hd, H, Hkv, Tk, n_chunks, qkind, softcap, mode, false, nt);
}

static void grp_merge_attn(void) {
    static const struct { int hd, H, Tq, n; const char * kind; } cases[] = {
        { 16, 4, 7, 1, "rand" }, { 16, 4, 7, 2, "rand" }, { 64, 2, 33, 3, "empty" }, { 80, 3, 5, 4, "big" },
        { 16, 1, 1, 2, "empty" }, { 64, 4, 130, 2, "rand" }, { 16, 2, 9, KVR_MAX_SRC, "empty" },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int nt = 1; nt <= 3; nt++) {
            t_merge(cases[c].hd, cases[c].H, cases[c].Tq, cases[c].n, cases[c].kind, nt);
        }
    }
    // softcap: soft-capped partials (gemma2 on a ring) merge to the capped attention over all keys
    static const struct { int hd, H, Hkv, Tk, n; const char * q; float softcap; } chunks[] = {
        { 16, 4, 2, 40, 4, "zz", 0.0f }, { 64, 4, 1, 33, 3, "causal", 0.0f }, { 80, 2, 2, 130, 2, "causal", 0.0f },
        { 64, 2, 1, 80, KVR_MAX_SRC, "zz", 0.0f }, { 16, 2, 1, 600, 3, "causal", 0.0f },
        { 16, 4, 2, 40, 4, "zz", 0.5f }, { 64, 4, 1, 33, 3, "causal", 2.0f }, { 16, 2, 1, 600, 3, "causal", 1.0f },
    };
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_merge_chunks(chunks[c].hd, chunks[c].H, chunks[c].Hkv, chunks[c].Tk, chunks[c].n, chunks[c].q, chunks[c].softcap,
                               m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt);
            }
        }
    }
    for (int nt = 1; nt <= 3; nt += 2) { // one chunk too: a merge of one partial is where ring decode of 1 rank adds them
        t_merge_chunks_sinks(16, 4, 2, 40, 4, "zz", 0.0f, KVR_ATTN_CAUSAL, true, nt);
        t_merge_chunks_sinks(64, 4, 1, 33, 1, "causal", 20.0f, KVR_ATTN_CAUSAL, true, nt);
        t_merge_chunks_sinks(64, 2, 1, 80, KVR_MAX_SRC - 1, "zz", 0.0f, KVR_ATTN_CAUSAL, true, nt);
    }
}

//
// VIEW: the metadata of views, and views (of leaves and of planned intermediates) feeding ops
//

static void t_view_meta(void) {
    struct tcase tc;
    tc_begin(&tc, 1, "VIEW(metadata: view_1d/2d/3d, reshape_2d/3d, nbytes, is_contiguous)");
    struct kvr_tensor * a = kvr_new_tensor_3d(tc.ctx, KVR_TYPE_F32, 10, 6, 3);
    struct {
        const char * what;
        struct kvr_tensor * t;
        int64_t ne[4];
        size_t nb[4], offs, nbytes;
        bool contiguous;
    } v[] = {
        { "view_1d(a, 7, 8)", kvr_view_1d(tc.ctx, a, 7, 8), {7, 1, 1, 1}, {4, 28, 28, 28}, 8, 28, true },
        { "view_2d(a, 4, 5, 40, 12)", kvr_view_2d(tc.ctx, a, 4, 5, 40, 12), {4, 5, 1, 1}, {4, 40, 200, 200}, 12,
          16 + 4 * 40, false },
        { "view_2d(a, 10, 5, 40, 80)", kvr_view_2d(tc.ctx, a, 10, 5, 40, 80), {10, 5, 1, 1}, {4, 40, 200, 200}, 80,
          200, true },
        { "view_3d(a, 2, 3, 4, 8, 40, 4)", kvr_view_3d(tc.ctx, a, 2, 3, 4, 8, 40, 4), {2, 3, 4, 1}, {4, 8, 40, 160},
          4, 8 + 2 * 8 + 3 * 40, false },
        { "reshape_2d(a, 30, 6)", kvr_reshape_2d(tc.ctx, a, 30, 6), {30, 6, 1, 1}, {4, 120, 720, 720}, 0, 720, true },
        { "reshape_3d(a, 5, 4, 9)", kvr_reshape_3d(tc.ctx, a, 5, 4, 9), {5, 4, 9, 1}, {4, 20, 80, 720}, 0, 720, true },
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        const struct kvr_tensor * t = v[i].t;
        if (!t) {
            tc_fail(&tc, "%s returned NULL", v[i].what);
            continue;
        }
        bool ok = t->type == KVR_TYPE_F32 && t->view_src == a && t->view_offs == v[i].offs;
        for (int d = 0; d < 4; d++) {
            // nb of a dimension of size 1 above the last is not part of the contract
            ok = ok && t->ne[d] == v[i].ne[d] && (t->ne[d] == 1 || t->nb[d] == v[i].nb[d]);
        }
        if (!ok) {
            tc_fail(&tc, "%s: ne [%lld,%lld,%lld,%lld] nb [%zu,%zu,%zu,%zu] view_src %s offs %zu; expected ne "
                    "[%lld,%lld,%lld,%lld] nb [%zu,%zu,%zu,%zu] offs %zu", v[i].what, (long long) t->ne[0],
                    (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3], t->nb[0], t->nb[1], t->nb[2],
                    t->nb[3], t->view_src == a ? "a" : "not a", t->view_offs, (long long) v[i].ne[0],
                    (long long) v[i].ne[1], (long long) v[i].ne[2], (long long) v[i].ne[3], v[i].nb[0], v[i].nb[1],
                    v[i].nb[2], v[i].nb[3], v[i].offs);
        }
        if (kvr_nbytes(t) != v[i].nbytes) {
            tc_fail(&tc, "kvr_nbytes(%s) = %zu, expected %zu", v[i].what, kvr_nbytes(t), v[i].nbytes);
        }
        if (kvr_is_contiguous(t) != v[i].contiguous) {
            tc_fail(&tc, "kvr_is_contiguous(%s) = %d, expected %d", v[i].what, kvr_is_contiguous(t), v[i].contiguous);
        }
    }
    if (kvr_nbytes(a) != 720 || !kvr_is_contiguous(a) || kvr_nelements(a) != 180 || kvr_nrows(a) != 18) {
        tc_fail(&tc, "a [10,6,3] f32: nbytes %zu nelements %lld nrows %lld contiguous %d", kvr_nbytes(a),
                (long long) kvr_nelements(a), (long long) kvr_nrows(a), kvr_is_contiguous(a));
    }
    tc_end(&tc);
}

// t = a + b [hd*H, T] (planned); y1 = t[rows 0..T/2) * t[rows T/2..T); y2 = 0.5 * t[3 .. end) as
// 1d; y3 = ROPE(reshape_3d(t, hd, H, T))
static void t_view_ops(int hd, int H, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "VIEW(of a planned node: view_2d x2 -> MUL, view_1d -> SCALE, reshape_3d -> ROPE; hd=%d,H=%d,T=%d)",
             hd, H, T);
    const int n = hd * H, half = T / 2;
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, T, 1, 1.0f);
    struct kvr_tensor * b = tc_input_f32(&tc, 2, n, T, 1, 1.0f);
    int32_t * pos = (int32_t *) tc_floats(&tc, T);
    for (int i = 0; i < T; i++) pos[i] = 7 * i;
    struct kvr_tensor * t = kvr_add(tc.ctx, a, b);
    struct kvr_tensor * v1 = kvr_view_2d(tc.ctx, t, n, half, t->nb[1], 0);
    struct kvr_tensor * v2 = kvr_view_2d(tc.ctx, t, n, half, t->nb[1], (size_t) half * t->nb[1]);
    struct kvr_tensor * y[3] = {
        kvr_mul(tc.ctx, v1, v2),
        kvr_scale(tc.ctx, kvr_view_1d(tc.ctx, t, (int64_t) n * T - 3, 3 * sizeof(float)), 0.5f),
        kvr_rope(tc.ctx, kvr_reshape_3d(tc.ctx, t, hd, H, T), tc_input_i32(&tc, T, pos), NULL, hd, KVR_ROPE_NORM, 10000.0f, 1.0f,
                 1.0f),
    };
    if (tc_shape(&tc, y[0], KVR_TYPE_F32, n, half, 1, 1) && tc_shape(&tc, y[1], KVR_TYPE_F32, (int64_t) n * T - 3, 1, 1, 1) &&
        tc_shape(&tc, y[2], KVR_TYPE_F32, hd, H, T, 1)) {
        tc_output(&tc, y[0], "mul");
        tc_output(&tc, y[1], "scale");
        tc_output(&tc, y[2], "rope");
        if (tc_compute(&tc, y, 3)) {
            const int64_t N = (int64_t) n * T;
            float * s = tc_floats(&tc, N);   // a + b as f32 computes it
            for (int64_t i = 0; i < N; i++) {
                s[i] = ((float *) a->data)[i] + ((float *) b->data)[i];
            }
            double * r0 = tc_doubles(&tc, N), * r1 = tc_doubles(&tc, N), * r2 = tc_doubles(&tc, N), * ex = tc_doubles(&tc, N);
            for (int64_t i = 0; i < (int64_t) n * half; i++) {
                r0[i] = (double) s[i] * s[(int64_t) half * n + i];
            }
            for (int64_t i = 0; i < N - 3; i++) {
                r1[i] = 0.5 * s[i + 3];
            }
            ref_rope(s, r2, ex, hd, H, T, pos, NULL, hd, KVR_ROPE_NORM, 10000.0, 1.0, 1.0);
            tc_check(&tc, "mul of views", tc_read(&tc, y[0]), r0, (int64_t) n * half, n, TOL_ELEM, NULL);
            tc_check(&tc, "scale of view_1d", tc_read(&tc, y[1]), r1, N - 3, N - 3, TOL_ELEM, NULL);
            tc_check(&tc, "rope of reshape", tc_read(&tc, y[2]), r2, N, hd, TOL_ELEM, ex);
        }
    }
    tc_end(&tc);
}

// ATTN (a planned node) -> kvr_attn_out -> MUL_MAT(wo): the O part read through its row stride
static void t_attn_out(int hd, int H, int Hkv, int T, int N, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "VIEW(kvr_attn_out -> MUL_MAT; hd=%d,H=%d,Hkv=%d,T=%d,N=%d)", hd, H, Hkv, T, N);
    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, H, T, 1.0f);
    struct kvr_tensor * k = tc_input_f32(&tc, 3, hd, Hkv, T, 1.0f);
    struct kvr_tensor * v = tc_input_f32(&tc, 3, hd, Hkv, T, 1.0f);
    int32_t * pos = (int32_t *) tc_floats(&tc, T);
    for (int i = 0; i < T; i++) pos[i] = i;
    struct kvr_tensor * p = tc_input_i32(&tc, T, pos);
    const float scale = 1.0f / sqrtf((float) hd);
    struct kvr_tensor * attn = kvr_attn(tc.ctx, q, k, v, p, p, NULL, scale, 0.0f, 0, KVR_ATTN_CAUSAL);
    struct kvr_tensor * o = kvr_attn_out(tc.ctx, attn, H);
    float * wr;
    struct kvr_tensor * wo = tc_weight(&tc, KVR_TYPE_F32, (int64_t) hd * H, N, &wr);
    const int64_t row = (int64_t) hd * H + H;
    if (o && (o->ne[0] != (int64_t) hd * H || o->ne[1] != T || o->nb[1] != (size_t) row * sizeof(float))) {
        tc_fail(&tc, "kvr_attn_out: ne [%lld,%lld] nb1 %zu, expected [%d,%d] nb1 %zu", (long long) o->ne[0],
                (long long) o->ne[1], o->nb[1], hd * H, T, (size_t) row * sizeof(float));
    } else if (tc_shape(&tc, o, KVR_TYPE_F32, (int64_t) hd * H, T, 1, 1)) {
        struct kvr_tensor * y = kvr_mul_mat(tc.ctx, wo, o);
        if (tc_shape(&tc, y, KVR_TYPE_F32, N, T, 1, 1)) {
            tc_output(&tc, y, "y");
            if (tc_compute(&tc, &y, 1)) {
                const struct attn_ref ar = {
                    .hd = hd, .H = H, .Hkv = Hkv, .Tq = T, .Tk = T, .q = q->data, .q_tok = (int64_t) hd * H,
                    .k = k->data, .v = v->data, .kv_tok = (int64_t) hd * Hkv, .qpos = pos, .kpos = pos, .scale = scale,
                };
                double * ra = tc_doubles(&tc, row * T), * ro = tc_doubles(&tc, (int64_t) hd * H * T);
                double * ref = tc_doubles(&tc, (int64_t) N * T);
                ref_attn(&ar, ra);
                for (int t = 0; t < T; t++) {
                    memcpy(ro + (int64_t) t * hd * H, ra + t * row, sizeof(double) * (size_t) (hd * H));
                }
                ref_mul_mat_d(wr, ro, ref, (int64_t) hd * H, N, T);
                tc_check(&tc, "y", tc_read(&tc, y), ref, (int64_t) N * T, N, TOL_RED, NULL);
            }
        }
    }
    tc_end(&tc);
}

// The planner reuses a node's memory after its last reader, but not when the node or a view of
// it is flagged OUTPUT. t = a + b is read only through v, a view flagged OUTPUT; u = a * b is
// an OUTPUT itself; s1 = 2c, s2 = 3 s1 follow and would take their memory if it were free.
// v and u keep the memory the planner gave them (no buffer of the test's own).
static void t_view_output(int n, int r, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "VIEW(planned outputs: a view of a node, and a node, flagged OUTPUT; ne=[%d,%d])", n, r);
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, r, 1, 1.0f);
    struct kvr_tensor * b = tc_input_f32(&tc, 2, n, r, 1, 1.0f);
    struct kvr_tensor * c = tc_input_f32(&tc, 2, n, r, 1, 1.0f);
    struct kvr_tensor * t = kvr_add(tc.ctx, a, b);
    struct kvr_tensor * v = kvr_view_2d(tc.ctx, t, n, r - 1, t->nb[1], t->nb[1]);
    struct kvr_tensor * u = kvr_mul(tc.ctx, a, b);
    struct kvr_tensor * s2 = kvr_scale(tc.ctx, kvr_scale(tc.ctx, c, 2.0f), 3.0f);
    v->flags |= KVR_FLAG_OUTPUT;
    u->flags |= KVR_FLAG_OUTPUT;
    tc_output(&tc, s2, "s2");
    struct kvr_tensor * outs[3] = { v, u, s2 };
    if (tc_compute(&tc, outs, 3)) {
        const int64_t N = (int64_t) n * r;
        const float * A = a->data, * B = b->data, * C = c->data;
        double * rv = tc_doubles(&tc, N), * ru = tc_doubles(&tc, N), * rs = tc_doubles(&tc, N);
        for (int64_t i = 0; i < N; i++) {
            rv[i] = (double) A[i] + B[i];
            ru[i] = (double) A[i] * B[i];
            rs[i] = (double) C[i] * 6.0;
        }
        tc_check(&tc, "view of a + b", tc_read(&tc, v), rv + n, N - n, n, TOL_ELEM, NULL);
        tc_check(&tc, "a * b", tc_read(&tc, u), ru, N, n, TOL_ELEM, NULL);
        tc_check(&tc, "6c", tc_read(&tc, s2), rs, N, n, TOL_ELEM, NULL);
    }
    tc_end(&tc);
}

static void grp_view(void) {
    t_view_meta();
    for (int nt = 1; nt <= 3; nt++) {
        t_view_ops(8, 2, 6, nt);
        t_view_ops(16, 3, 11, nt);
        t_attn_out(16, 4, 2, 7, 33, nt);
        t_attn_out(64, 2, 1, 33, 7, nt);
        t_view_output(7, 5, nt);
        t_view_output(64, 33, nt);
    }
}

//
// GRAPH: a llama-like block, so that the planner reuses memory while values are still read
//   x = x_in + bias; h = rms_norm(x) * wn; f = silu(W1 h) * (W3 h); y = x + W2 f;
//   outputs norm(y) and gelu(y)
//

static void t_chain(int n, int n_ff, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "GRAPH(llama-like block: n=%d,n_ff=%d,T=%d; W1 f16, W3 bf16, W2 f32)", n, n_ff, T);
    struct kvr_tensor * x_in = tc_input_f32(&tc, 2, n, T, 1, 1.0f);
    struct kvr_tensor * bias = tc_input_f32(&tc, 1, n, 1, 1, 1.0f);
    struct kvr_tensor * wn = tc_input_f32(&tc, 1, n, 1, 1, 1.0f);
    float * w1r, * w3r, * w2r;
    struct kvr_tensor * w1 = tc_weight(&tc, KVR_TYPE_F16, n, n_ff, &w1r);
    struct kvr_tensor * w3 = tc_weight(&tc, KVR_TYPE_BF16, n, n_ff, &w3r);
    struct kvr_tensor * w2 = tc_weight(&tc, KVR_TYPE_F32, n_ff, n, &w2r);
    struct kvr_context * c = tc.ctx;
    struct kvr_tensor * x = kvr_add(c, x_in, bias);
    struct kvr_tensor * h = kvr_mul(c, kvr_rms_norm(c, x, 1e-5f), wn);
    struct kvr_tensor * f = kvr_mul(c, kvr_silu(c, kvr_mul_mat(c, w1, h)), kvr_mul_mat(c, w3, h));
    struct kvr_tensor * y = kvr_add(c, x, kvr_mul_mat(c, w2, f));
    struct kvr_tensor * out[2] = { kvr_norm(c, y, 1e-5f), kvr_gelu(c, y) };
    if (tc_shape(&tc, out[0], KVR_TYPE_F32, n, T, 1, 1) && tc_shape(&tc, out[1], KVR_TYPE_F32, n, T, 1, 1)) {
        tc_output(&tc, out[0], "norm");
        tc_output(&tc, out[1], "gelu");
        if (tc_compute(&tc, out, 2)) {
            const int64_t N = (int64_t) n * T, F = (int64_t) n_ff * T;
            double * rx = tc_doubles(&tc, N), * rh = tc_doubles(&tc, N), * r1 = tc_doubles(&tc, F);
            double * r3 = tc_doubles(&tc, F), * rd = tc_doubles(&tc, N), * ry = tc_doubles(&tc, N);
            double * rn = tc_doubles(&tc, N), * rg = tc_doubles(&tc, N);
            const float * X = x_in->data, * B = bias->data, * WN = wn->data;
            for (int64_t i = 0; i < N; i++) rx[i] = (double) X[i] + B[i % n];
            for (int t = 0; t < T; t++) {
                double ss = 0.0;
                for (int i = 0; i < n; i++) ss += rx[(int64_t) t * n + i] * rx[(int64_t) t * n + i];
                const double s = 1.0 / sqrt(ss / n + 1e-5);
                for (int i = 0; i < n; i++) rh[(int64_t) t * n + i] = rx[(int64_t) t * n + i] * s * WN[i];
            }
            ref_mul_mat_d(w1r, rh, r1, n, n_ff, T);
            ref_mul_mat_d(w3r, rh, r3, n, n_ff, T);
            for (int64_t i = 0; i < F; i++) r1[i] = ref_silu(r1[i]) * r3[i];
            ref_mul_mat_d(w2r, r1, rd, n_ff, n, T);
            for (int64_t i = 0; i < N; i++) {
                ry[i] = rx[i] + rd[i];
                rg[i] = ref_gelu(ry[i]);
            }
            ref_norm(ry, rn, n, T, 1e-5);
            tc_check(&tc, "norm(y)", tc_read(&tc, out[0]), rn, N, n, TOL_RED, NULL);
            tc_check(&tc, "gelu(y)", tc_read(&tc, out[1]), rg, N, n, TOL_GELU, NULL);
        }
    }
    tc_end(&tc);
}

static void grp_graph(void) {
    for (int nt = 1; nt <= 3; nt++) {
        t_chain(16, 16, 1, nt);
        t_chain(32, 88, 7, nt);
        t_chain(64, 130, 33, nt);
    }
}

//
// PASS: kvr_pass_single rewrites the ATTN_BLOCK of two layers over a KV cache; two steps (a
// prompt of T1 tokens, then T2 more at n_past = T1), each checked against scalar causal
// attention over every token so far, and the cache rows written (and only those). Each block
// is flagged OUTPUT and read twice: through its own memory, and through blk -> MUL_MAT(I) ->
// SCALE(2) -> SCALE(0.5), whose middle node would take the block's memory if it were free.
// as_is: compute g as the pass left it; otherwise reset and expand g again from the outputs,
// as kvr_session_eval does.
//

static void t_pass(int hd, int H, int Hkv, int n_ctx, int T1, int T2, float softcap, enum kvr_attn_mode mode, bool as_is, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "PASS(kvr_pass_single, 2 layers: hd=%d,H=%d,Hkv=%d,n_ctx=%d,T=%d then %d,softcap=%g,mode=%s%s)", hd, H,
             Hkv, n_ctx, T1, T2, softcap, mode_str(mode), as_is ? ",graph as the pass leaves it" : "");
    struct kvr_hparams hp;
    memset(&hp, 0, sizeof(hp));
    hp.arch = KVR_ARCH_LLAMA;
    hp.n_layer = 2;
    hp.n_head = (uint32_t) H;
    hp.n_head_kv = (uint32_t) Hkv;
    hp.head_dim = (uint32_t) hd;
    hp.n_embd = (uint32_t) (hd * H);
    hp.n_rot = (uint32_t) hd;
    hp.n_ff = (uint32_t) (4 * hd * H);
    hp.n_vocab = 32;
    hp.n_ctx_train = (uint32_t) n_ctx;
    hp.rope_freq_base = 10000.0f;
    hp.rope_freq_scale = 1.0f;
    hp.norm_eps = 1e-5f;
    // the cache in a CPU backend's buffer (host memory: kvr_graph_compute_cpu's backend reads it)
    struct kvr_backend * cache_be = kvr_backend_cpu_new(1);
    // F32: the rows are checked against this test's f32 reference (typed caches: FAST_REF ATTN)
    struct kvr_kv_cache * cache = kvr_kv_cache_new(&hp, n_ctx, KVR_TYPE_F32, KVR_TYPE_F32, cache_be);
    const int64_t kv_dim = (int64_t) hd * Hkv, row = (int64_t) hd * H + H;
    if (!cache) {
        tc_fail(&tc, "kvr_kv_cache_new returned NULL: %s", kvr_last_error());
        kvr_backend_free(cache_be);
        tc_end(&tc);
        return;
    }
    if (cache->n_layer != 2 || cache->n_ctx != n_ctx || cache->kv_dim != kv_dim) {
        tc_fail(&tc, "cache: n_layer %d n_ctx %d kv_dim %d, expected 2 %d %lld", cache->n_layer, cache->n_ctx,
                cache->kv_dim, n_ctx, (long long) kv_dim);
        goto done;
    }
    for (int il = 0; il < 2; il++) {
        for (int c = 0; c < 2; c++) {
            struct kvr_tensor * t = c ? cache->v[il] : cache->k[il];
            if (!t || !t->data || t->type != KVR_TYPE_F32 || t->ne[0] != kv_dim || t->ne[1] != n_ctx) {
                tc_fail(&tc, "cache %c[%d] is not an f32 [%lld, %d] tensor with data", "kv"[c], il, (long long) kv_dim,
                        n_ctx);
                goto done;
            }
            memset(t->data, 0xFF, kvr_nbytes(t));   // NaN: a read of a row never written shows
        }
    }
    float * allk[2], * allv[2];   // every token's k and v so far, per layer
    for (int il = 0; il < 2; il++) {
        allk[il] = tc_floats(&tc, kv_dim * n_ctx);
        allv[il] = tc_floats(&tc, kv_dim * n_ctx);
    }
    for (int step = 0; step < 2 && tc.n_fail == 0; step++) {
        const int n_past = step ? T1 : 0, T = step ? T2 : T1, e = n_past + T;
        struct kvr_context * ctx = tc.ctx;
        int32_t * pos = (int32_t *) tc_floats(&tc, T), * kpos = (int32_t *) tc_floats(&tc, e);
        for (int i = 0; i < T; i++) pos[i] = n_past + i;
        for (int j = 0; j < e; j++) kpos[j] = j;
        struct kvr_tensor * tpos = tc_input_i32(&tc, T, pos);
        struct kvr_tensor * tkpos = tc_input_i32(&tc, e, kpos);
        struct kvr_tensor * q[2], * blk[2], * out[2];
        struct kvr_graph * g = kvr_graph_new(ctx, GRAPH_SIZE);
        for (int il = 0; il < 2; il++) {
            q[il] = tc_input_f32(&tc, 3, hd, H, T, 1.0f);
            struct kvr_tensor * k = tc_input_f32(&tc, 3, hd, Hkv, T, 1.0f);
            struct kvr_tensor * v = tc_input_f32(&tc, 3, hd, Hkv, T, 1.0f);
            memcpy(allk[il] + n_past * kv_dim, k->data, sizeof(float) * (size_t) (kv_dim * T));
            memcpy(allv[il] + n_past * kv_dim, v->data, sizeof(float) * (size_t) (kv_dim * T));
            blk[il] = kvr_attn_block(ctx, q[il], k, v, tpos, il, 1.0f / sqrtf((float) hd), softcap, 0);
            if (!tc_shape(&tc, blk[il], KVR_TYPE_F32, row, T, 1, 1)) {
                goto done;
            }
            kvr_set_name(blk[il], "test.attn_block.%d", il);
            blk[il]->flags |= KVR_FLAG_OUTPUT;
            float * ir;
            struct kvr_tensor * id = tc_weight(&tc, KVR_TYPE_F32, row, row, &ir);
            for (int64_t i = 0; i < row * row; i++) {
                ((float *) id->data)[i] = (i / row == i % row) ? 1.0f : 0.0f;
            }
            struct kvr_tensor * y = kvr_scale(ctx, kvr_mul_mat(ctx, id, blk[il]), 2.0f);
            out[il] = kvr_scale(ctx, y, 0.5f);
            tc_output(&tc, out[il], "block out");
            kvr_graph_expand(g, out[il]);
        }
        kvr_pass_single(ctx, g, cache, n_past, tkpos, mode);
        if (as_is) {
            // the graph must now hold the stores, or the ATTN reads cache rows nobody wrote
            int n_op[KVR_OP_COUNT] = { 0 };
            for (int i = 0; i < g->n_nodes; i++) {
                const int op = g->nodes[i]->op;
                if (op >= 0 && op < KVR_OP_COUNT) n_op[op]++;
            }
            if (n_op[KVR_OP_ATTN_BLOCK] != 0 || n_op[KVR_OP_KV_STORE] != 4 || n_op[KVR_OP_ATTN] != 2) {
                tc_fail(&tc, "step %d: after kvr_pass_single g has %d ATTN_BLOCK, %d KV_STORE, %d ATTN nodes "
                        "(expected 0, 4, 2): computing it would read cache rows never stored", step,
                        n_op[KVR_OP_ATTN_BLOCK], n_op[KVR_OP_KV_STORE], n_op[KVR_OP_ATTN]);
                break;
            }
        } else {
            kvr_graph_reset(g);
            kvr_graph_expand(g, out[0]);
            kvr_graph_expand(g, out[1]);
        }
        for (int il = 0; il < 2; il++) {
            if (blk[il]->op != KVR_OP_ATTN_BLOCK && !(blk[il]->flags & KVR_FLAG_OUTPUT)) {
                tc_fail(&tc, "step %d: kvr_pass_single dropped the OUTPUT flag of ATTN_BLOCK '%s' (rewritten in "
                        "place): its memory may be reused before the caller reads it", step, blk[il]->name);
            }
        }
        const int rc = kvr_graph_compute_cpu(g, nt);
        if (rc != KVR_OK) {
            tc_fail(&tc, "step %d: kvr_graph_compute_cpu returned %d: %s", step, rc, kvr_last_error());
            break;
        }
        for (int il = 0; il < 2; il++) {
            for (int c = 0; c < 2; c++) {
                const float * got = c ? cache->v[il]->data : cache->k[il]->data;
                const float * exp = c ? allv[il] : allk[il];
                for (int64_t i = 0; i < kv_dim * n_ctx; i++) {
                    const bool written = i < kv_dim * e;
                    uint32_t bits;
                    memcpy(&bits, &got[i], 4);
                    if (written ? memcmp(&got[i], &exp[i], 4) != 0 : bits != 0xFFFFFFFFu) {
                        tc_fail(&tc, "step %d: cache %c[%d] [%lld,%lld] is %.9g, expected %s", step, "kv"[c], il,
                                (long long) (i % kv_dim), (long long) (i / kv_dim), got[i],
                                written ? "the stored value" : "unwritten");
                        break;
                    }
                }
            }
            const struct attn_ref ar = {
                .hd = hd, .H = H, .Hkv = Hkv, .Tq = T, .Tk = e, .q = q[il]->data, .q_tok = (int64_t) hd * H,
                .k = allk[il], .v = allv[il], .kv_tok = kv_dim, .qpos = pos, .kpos = kpos,
                .scale = 1.0 / sqrt((double) hd), .softcap = softcap,
            };
            double * ref = tc_doubles(&tc, row * T);
            ref_attn(&ar, ref);
            char what[64];
            snprintf(what, sizeof(what), "step %d layer %d (via matmul)", step, il);
            tc_check(&tc, what, tc_read(&tc, out[il]), ref, row * T, row, TOL_RED, NULL);
            snprintf(what, sizeof(what), "step %d layer %d (block's memory)", step, il);
            tc_check(&tc, what, tc_read(&tc, blk[il]), ref, row * T, row, TOL_RED, NULL);
        }
    }
done:
    kvr_kv_cache_free(cache);
    kvr_backend_free(cache_be);
    tc_end(&tc);
}

static void grp_pass(void) {
    static const int cases[][6] = {
        // hd, H, Hkv, n_ctx, T1, T2
        { 16, 4, 2, 64, 33, 7 }, { 64, 4, 1, 128, 67, 1 }, { 80, 2, 2, 40, 1, 1 }, { 16, 2, 2, 600, 300, 270 },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt++) {
                t_pass(cases[c][0], cases[c][1], cases[c][2], cases[c][3], cases[c][4], cases[c][5], 0.0f,
                       m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, false, nt);
            }
        }
    }
    t_pass(16, 4, 2, 64, 33, 7, 0.0f, KVR_ATTN_CAUSAL, true, 1);
    // the block's soft-capping reaches the ATTN the pass makes (gemma2)
    t_pass(16, 4, 2, 64, 33, 7, 1.0f, KVR_ATTN_CAUSAL, false, 2);
    t_pass(64, 4, 1, 128, 67, 1, 0.5f, KVR_ATTN_DENSE, false, 3);
}

//
// COUNTERS: the CPU backend's counters after kvr_graph_plan, kvr_graph_place (in a buffer of the backend) and
// kvr_backend_graph_compute (also checked: supports_op, and the results of that path).
// Pairs are counted once per ATTN node, whatever its number of heads.
//

static void t_counters(int hd, int H, int Tq, int Tk, const char * pos, enum kvr_attn_mode mode, int K, int N, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "COUNTERS(ATTN hd=%d,H=%d,Tq=%d,Tk=%d,pos=%s,mode=%s; MUL_MAT K=%d,N=%d)", hd, H, Tq, Tk, pos,
             mode_str(mode), K, N);
    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, H, Tq, 1.0f);
    struct kvr_tensor * k = tc_input_f32(&tc, 3, hd, 1, Tk, 1.0f);
    struct kvr_tensor * v = tc_input_f32(&tc, 3, hd, 1, Tk, 1.0f);
    int32_t * qpos = (int32_t *) tc_floats(&tc, Tq), * kpos = (int32_t *) tc_floats(&tc, Tk);
    attn_positions(pos, Tq, Tk, qpos, kpos);
    const float scale = 1.0f / sqrtf((float) hd);
    struct kvr_tensor * attn = kvr_attn(tc.ctx, q, k, v, tc_input_i32(&tc, Tq, qpos), tc_input_i32(&tc, Tk, kpos),
                                        NULL, scale, 0.0f, 0, mode);
    float * wr;
    struct kvr_tensor * w = tc_weight(&tc, KVR_TYPE_F16, K, N, &wr);
    struct kvr_tensor * x = tc_input_f32(&tc, 2, K, Tq, 1, 1.0f);
    struct kvr_tensor * y = kvr_mul_mat(tc.ctx, w, x);
    tc_output(&tc, attn, "attn");
    tc_output(&tc, y, "y");
    struct kvr_graph * g = kvr_graph_new(tc.ctx, GRAPH_SIZE);
    kvr_graph_expand(g, attn);
    kvr_graph_expand(g, y);
    struct kvr_backend * be = kvr_backend_cpu_new(nt);
    for (int i = 0; i < g->n_nodes; i++) {
        if (!kvr_backend_supports_op(be, g->nodes[i])) {
            tc_fail(&tc, "the CPU backend does not support node %d (%s)", i, kvr_op_name(g->nodes[i]->op));
        }
    }
    const size_t size = kvr_graph_plan(g);
    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, size);
    if (!buf) {
        fprintf(stderr, "test-ops: %s\n", kvr_last_error());
        exit(2);
    }
    kvr_graph_place(g, buf);
    struct kvr_counters cnt;
    if (!kvr_backend_counters(be, NULL, true)) tc_fail(&tc, "the CPU backend keeps no counters");
    const int rc = kvr_backend_graph_compute(be, g);
    kvr_backend_counters(be, &cnt, true);
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    if (rc != KVR_OK) {
        tc_fail(&tc, "kvr_backend_graph_compute returned %d: %s", rc, kvr_last_error());
    } else {
        int64_t visible = 0;
        for (int i = 0; i < Tq; i++) {
            for (int j = 0; j < Tk; j++) visible += kpos[j] <= qpos[i];
        }
        const int64_t rect = (int64_t) Tq * Tk;
        if (cnt.attn_dot_causal != visible) {
            tc_fail(&tc, "attn_dot_causal %lld, expected %lld (visible query-key pairs)", (long long) cnt.attn_dot_causal,
                    (long long) visible);
        }
        if (mode == KVR_ATTN_DENSE ? cnt.attn_dot_dense != rect : (cnt.attn_dot_dense < visible || cnt.attn_dot_dense > rect)) {
            tc_fail(&tc, "attn_dot_dense %lld, expected %s %lld", (long long) cnt.attn_dot_dense,
                    mode == KVR_ATTN_DENSE ? "Tq*Tk =" : "between the visible pairs and Tq*Tk =", (long long) rect);
        }
        if (cnt.matmul_flops != 2LL * K * N * Tq) {
            tc_fail(&tc, "matmul_flops %lld, expected 2*K*N*T = %lld", (long long) cnt.matmul_flops, 2LL * K * N * Tq);
        }
        const int64_t row = (int64_t) hd * H + H;
        const struct attn_ref ar = {
            .hd = hd, .H = H, .Hkv = 1, .Tq = Tq, .Tk = Tk, .q = q->data, .q_tok = (int64_t) hd * H,
            .k = k->data, .v = v->data, .kv_tok = hd, .qpos = qpos, .kpos = kpos, .scale = scale,
        };
        double * ra = tc_doubles(&tc, row * Tq), * ry = tc_doubles(&tc, (int64_t) N * Tq);
        ref_attn(&ar, ra);
        ref_mul_mat(wr, x->data, K, ry, K, N, Tq);
        tc_check(&tc, "attn", tc_read(&tc, attn), ra, row * Tq, row, TOL_RED, NULL);
        tc_check(&tc, "mul_mat", tc_read(&tc, y), ry, (int64_t) N * Tq, N, TOL_RED, NULL);
    }
    tc_end(&tc);
}

static void grp_counters(void) {
    for (int m = 0; m < 2; m++) {
        const enum kvr_attn_mode mode = m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL;
        for (int nt = 1; nt <= 3; nt++) {
            t_counters(16, 3, 300, 300, "causal", mode, 33, 7, nt);
            t_counters(16, 2, 66, 66, "zz-1-2", mode, 7, 130, nt);
            t_counters(16, 2, 7, 600, "mid", mode, 64, 33, nt);
        }
    }
}

//
// ARGMAX: kvr_argmax (greedy decoding's pick over the logits; SIMD over large vocabularies) against
// the plain loop: the first index of the largest value, NaNs passed over, a NaN first the answer.
// Lengths around the vector width and a Gemma-sized vocabulary, with ties of the largest value,
// NaNs, signed zeros and infinities.
//

static int32_t ref_argmax(const float * x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++) {
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static void t_argmax(int n, const char * kind) {
    struct tcase tc;
    tc_begin(&tc, 1, "argmax n=%d %s", n, kind);
    float * x = tc_alloc(&tc, (size_t)n * sizeof(float), false, 0, "x");
    for (int i = 0; i < n; i++) x[i] = rng_f(-8.0f, 8.0f);
    if (!strcmp(kind, "ties")) {
        for (int k = 0; k < 3; k++) x[rng_int(n)] = 9.0f;
    } else if (!strcmp(kind, "nan")) {
        for (int k = 0; k < 1 + n / 8; k++) x[rng_int(n)] = NAN;
    } else if (!strcmp(kind, "nan-first")) {
        x[0] = NAN;
    } else if (!strcmp(kind, "zeros")) {
        for (int i = 0; i < n; i++) x[i] = rng_int(2) ? 0.0f : -0.0f;
    } else if (!strcmp(kind, "inf")) {
        x[rng_int(n)] = INFINITY;
        x[rng_int(n)] = -INFINITY;
    } else if (!strcmp(kind, "last")) {
        x[n - 1] = 100.0f;
    }
    const int32_t got = kvr_argmax(x, n), want = ref_argmax(x, n);
    if (got != want) tc_fail(&tc, "kvr_argmax %d, the plain loop %d", got, want);
    tc_end(&tc);
}

static void grp_argmax(void) {
    static const int ns[] = { 1, 2, 7, 8, 9, 15, 16, 17, 31, 64, 100, 1000, 262147 };
    static const char * const kinds[] = { "random", "ties", "nan", "nan-first", "zeros", "inf", "last" };
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) t_argmax(ns[i], kinds[k]);
    }
}

//
// FAST_REF: the CPU backend's fast kernels against its plain reference kernels
// (kvr_backend_params.ref_kernels, KVR_REF=1): the same graph computed by both into the same
// memory, in shapes that reach every fast path: MUL_MAT's llama.cpp-order dots (1 token, a batch
// in tinyBLAS's order, K and N off its multiples), decode rows (1-4 tokens), sgemm on F32 and on
// converted rows; ATTN's llama.cpp-arithmetic kernel (up to 2^14 scores a head) and its tiled one;
// the SIMD exp of SILU; NORM's GGML order. Both compute the same products; the tolerances are
// what another order of the sums (and the fast exp's few ulp) can give: for a sum of K terms, K
// units of 2^-24 of sum |term| (the bound of any order of K f32 additions).
//

#define ULP (1.0 / 16777216.0) // 2^-24

// y (the graph's only output) by the fast kernels into *fast and by the reference kernels into
// *ref, on nt threads; false (and the case failed) if either compute fails.
static bool tc_compute_fast_ref(struct tcase * tc, struct kvr_tensor * y, float ** fast, float ** ref) {
    struct kvr_graph * g = kvr_graph_new(tc->ctx, GRAPH_SIZE);
    kvr_graph_expand(g, y);
    struct kvr_backend_params bp = { .n_threads = tc->nt };
    struct kvr_backend * be_fast = kvr_backend_new("cpu", &bp);
    bp.ref_kernels = true;
    struct kvr_backend * be_ref = kvr_backend_new("cpu", &bp);
    struct kvr_buffer * buf = be_fast && be_ref ? kvr_backend_alloc_buffer(be_fast, kvr_graph_plan(g)) : NULL;
    bool ok = buf != NULL;
    if (ok) {
        kvr_graph_place(g, buf);
        int rc = kvr_backend_graph_compute(be_fast, g);
        *fast = tc_read(tc, y);
        memset(y->data, 0xFF, kvr_nbytes(y)); // NaN again: an element the reference leaves fails
        if (rc == KVR_OK) rc = kvr_backend_graph_compute(be_ref, g);
        *ref = tc_read(tc, y);
        if (rc != KVR_OK) tc_fail(tc, "compute returned %d: %s", rc, kvr_last_error());
        ok = rc == KVR_OK;
    } else {
        tc_fail(tc, "no CPU backends or buffer: %s", kvr_last_error());
    }
    kvr_buffer_free(buf);
    kvr_backend_free(be_ref);
    kvr_backend_free(be_fast);
    return ok;
}

static double * tc_widen(struct tcase * tc, const float * x, int64_t n) {
    double * d = tc_doubles(tc, n);
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static void t_fr_mul_mat(enum kvr_type type, int K, int N, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "FAST_REF MUL_MAT(type=%s,K=%d,N=%d,T=%d)", type_str(type), K, N, T);
    float * wr;
    struct kvr_tensor * w = tc_weight(&tc, type, K, N, &wr);
    struct kvr_tensor * x = tc_input_f32(&tc, 2, K, T, 1, 1.0f);
    struct kvr_tensor * y = kvr_mul_mat(tc.ctx, w, x);
    float * fast, * ref;
    tc_output(&tc, y, "y");
    if (tc_compute_fast_ref(&tc, y, &fast, &ref)) {
        double * extra = tc_doubles(&tc, (int64_t) N * T);
        for (int64_t t = 0; t < T; t++) {
            for (int64_t n = 0; n < N; n++) {
                double mag = 0.0;
                for (int64_t k = 0; k < K; k++) mag += fabs((double) wr[n * K + k] * ((const float *) x->data)[t * K + k]);
                extra[t * N + n] = (K + 2) * ULP * mag; // K additions, the products, the result's rounding
            }
        }
        tc_check(&tc, "y", fast, tc_widen(&tc, ref, (int64_t) N * T), (int64_t) N * T, N, 0.0, extra);
    }
    tc_end(&tc);
}

// MUL_MAT_ID, fast (tokens grouped by expert, the MUL_MAT paths per expert) against the reference
// (every token and expert on its own), held to the bound of any order of the K additions over the
// largest of the experts' |w x|; both count the same expert bytes
static void t_fr_mul_mat_id(enum kvr_type type, int K, int N, int E, int k, int T, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "FAST_REF MUL_MAT_ID(type=%s,K=%d,N=%d,E=%d,k=%d,T=%d)", type_str(type), K, N, E, k, T);
    float * wr;
    struct kvr_tensor * w2 = tc_weight(&tc, type, K, (int64_t) N * E, &wr);
    struct kvr_tensor * w = kvr_view_3d(tc.ctx, w2, K, N, E, w2->nb[1], w2->nb[1] * (size_t) N, 0);
    struct kvr_tensor * x = tc_input_f32(&tc, 2, K, T, 1, 1.0f);
    struct kvr_tensor * route = kvr_moe_route(tc.ctx, tc_input_f32(&tc, 2, E, T, 1, 3.0f), k, KVR_MOE_SOFTMAX_TOPK_NORM);
    struct kvr_tensor * y = kvr_mul_mat_id(tc.ctx, w, x, route, NULL);
    float * fast, * ref;
    tc_output(&tc, y, "y");
    if (tc_compute_fast_ref(&tc, y, &fast, &ref)) {
        double * extra = tc_doubles(&tc, (int64_t) N * k * T);
        for (int64_t t = 0; t < T; t++) {
            for (int64_t n = 0; n < N; n++) {
                double mag = 0.0;
                for (int64_t e = 0; e < E; e++) {
                    double m = 0.0;
                    for (int64_t c = 0; c < K; c++) m += fabs((double) wr[(e * N + n) * K + c] * ((const float *) x->data)[t * K + c]);
                    mag = fmax(mag, m);
                }
                for (int64_t j = 0; j < k; j++) extra[(t * k + j) * N + n] = (K + 2) * ULP * mag;
            }
        }
        tc_check(&tc, "y", fast, tc_widen(&tc, ref, (int64_t) N * k * T), (int64_t) N * k * T, N, 0.0, extra);
    }
    tc_end(&tc);
}

// K or V of a cache type (kvr_cache_type): f32 values in [-1, 1) stored as that type
static struct kvr_tensor * tc_kv_input(struct tcase * tc, enum kvr_type type, int hd, int Hkv, int Tk) {
    float * x = tc_floats(tc, (int64_t) hd * Hkv * Tk);
    fill(x, (int64_t) hd * Hkv * Tk, -1.0f, 1.0f);
    const int64_t ne[3] = { hd, Hkv, Tk };
    struct kvr_tensor * t = kvr_new_tensor(tc->ctx, type, 3, ne);
    t->data = tc_alloc(tc, kvr_row_size(type, (int64_t) hd * Hkv) * (size_t) Tk, false, 0, "input");
    t->flags |= KVR_FLAG_INPUT;
    kvr_kv_rows_from_float(type, x, t->data, Tk, hd * Hkv);
    return t;
}

//
// ATTN_STATS, ATTN_NORMED: a ring's blocks of keys, rounded at the whole softmax's scale, merged
//

// The Tq last of Tk keys as queries; the keys split as a ring's shards over n ranks (block b holds
// chunks b and 2n-1-b of 2n, its rows together: the K/V are stored block after block). Each block's
// statistics (ATTN_STATS), folded one into the next (chain: ring-kv) or each on its own in a stack
// [2H, Tq, n] (ring-q, the ring decode), then ATTN_NORMED per block, merged: against ATTN over all
// keys (Tq*Tk within its llama.cpp kernel, cpu_op_attn_exact, which rounds F16/BF16 probabilities
// after normalising them). Both sum e^(s - M) in another order, so 1/S may move by an ulp and an
// f32 probability on a rounding tie of the type may round the other way: a rare one-unit step
// (2^-11, 2^-8 of a weight) on top of the f32 sums' few ulp. (Plain ATTN partials merged, each
// rounding at its block's scale, miss by 1e-3 here: what the rings did before.)
static void t_attn_normed(int hd, int H, int Hkv, int Tq, int Tk, int n, bool chain, enum kvr_type type, float softcap, int window,
                          bool sinks, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ATTN_NORMED(hd=%d,H=%d,Hkv=%d,Tq=%d,Tk=%d,blocks=%d,%s,kv=%s,softcap=%g,window=%d%s)", hd, H, Hkv, Tq, Tk, n,
             chain ? "chain" : "stack", type_str(type), softcap, window, sinks ? ",sinks" : "");
    int32_t * qpos = (int32_t *) tc_floats(&tc, Tq), * kpos = (int32_t *) tc_floats(&tc, Tk);
    int b0[KVR_MAX_SRC + 1];
    int j = 0;
    for (int b = 0; b < n; b++) { // block b: chunks b and 2n-1-b
        b0[b] = j;
        for (int c = 0; c < 2 * n; c++) {
            if (c != b && c != 2 * n - 1 - b) continue;
            for (int p = Tk * c / (2 * n); p < Tk * (c + 1) / (2 * n); p++) kpos[j++] = p;
        }
    }
    b0[n] = Tk;
    for (int i = 0; i < Tq; i++) qpos[i] = Tk - Tq + i;
    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, H, Tq, 1.0f);
    struct kvr_tensor * k = tc_kv_input(&tc, type, hd, Hkv, Tk), * v = tc_kv_input(&tc, type, hd, Hkv, Tk);
    struct kvr_tensor * qp = tc_input_i32(&tc, Tq, qpos), * kp = tc_input_i32(&tc, Tk, kpos);
    struct kvr_tensor * sk = sinks ? tc_input_f32(&tc, 1, H, 1, 1, 3.0f) : NULL;
    const float scale = 1.0f / sqrtf((float) hd);
    struct kvr_tensor * kb[KVR_MAX_SRC], * vb[KVR_MAX_SRC], * pb[KVR_MAX_SRC], * parts[KVR_MAX_SRC], * deps[KVR_MAX_SRC];
    int n_deps = 0;
    for (int b = 0; b < n; b++) {
        const int nb = b0[b + 1] - b0[b];
        kb[b] = kvr_view_3d(tc.ctx, k, hd, Hkv, nb, k->nb[1], k->nb[2], (size_t) b0[b] * k->nb[2]);
        vb[b] = kvr_view_3d(tc.ctx, v, hd, Hkv, nb, v->nb[1], v->nb[2], (size_t) b0[b] * v->nb[2]);
        pb[b] = kvr_view_1d(tc.ctx, kp, nb, (size_t) b0[b] * sizeof(int32_t));
    }
    struct kvr_tensor * st = NULL;
    if (chain) {
        for (int b = 0; b < n; b++) st = kvr_attn_stats(tc.ctx, q, kb[b], qp, pb[b], st, NULL, scale, softcap, window, KVR_ATTN_CAUSAL);
    } else {
        st = tc_input(&tc, KVR_TYPE_F32, 3, 2 * H, Tq, n);
        for (int b = 0; b < n; b++) {
            struct kvr_tensor * sb = kvr_attn_stats(tc.ctx, q, kb[b], qp, pb[b], NULL, NULL, scale, softcap, window, KVR_ATTN_CAUSAL);
            deps[n_deps++] = kvr_cpy(tc.ctx, sb, kvr_view_2d(tc.ctx, st, 2 * H, Tq, st->nb[1], (size_t) b * st->nb[2]));
        }
    }
    for (int b = 0; b < n; b++) {
        parts[b] = kvr_attn_normed(tc.ctx, q, kb[b], vb[b], qp, pb[b], st, sk, NULL, scale, softcap, window, KVR_ATTN_CAUSAL);
    }
    struct kvr_tensor * y = kvr_merge_attn(tc.ctx, parts, n, H);
    if (sk) kvr_attn_sinks(y, sk);
    struct kvr_tensor * all = kvr_attn_sinks(kvr_attn(tc.ctx, q, k, v, qp, kp, NULL, scale, softcap, window, KVR_ATTN_CAUSAL), sk);
    const int64_t row = (int64_t) hd * H + H;
    if (tc_shape(&tc, y, KVR_TYPE_F32, row, Tq, 1, 1) && tc_shape(&tc, st, KVR_TYPE_F32, 2 * H, Tq, chain ? 1 : n, 1)) {
        tc_output(&tc, y, "merged");
        tc_output(&tc, all, "attn");
        struct kvr_graph * g = kvr_graph_new(tc.ctx, GRAPH_SIZE);
        for (int i = 0; i < n_deps; i++) kvr_graph_expand(g, deps[i]); // the stack's slices first
        kvr_graph_expand(g, y);
        kvr_graph_expand(g, all);
        const int rc = kvr_graph_compute_cpu(g, nt);
        if (rc != KVR_OK) {
            tc_fail(&tc, "kvr_graph_compute_cpu returned %d: %s", rc, kvr_last_error());
        } else {
            double tol = (2.0 * Tk + hd * sqrt((double) hd) + 16) * ULP;
            // the rare probability on a tie: one unit of the type's rounding of one weight
            double * extra = tc_doubles(&tc, row * Tq);
            const float * want = tc_read(&tc, all);
            int ties = 0;
            for (int64_t i = 0; i < row * Tq; i++) extra[i] = 0.0;
            const float * got = tc_read(&tc, y);
            for (int64_t i = 0; i < row * Tq; i++) {
                const double unit = type == KVR_TYPE_F16 ? 1.0 / 2048 : type == KVR_TYPE_BF16 ? 1.0 / 256 : 0.0;
                if (fabs((double) got[i] - want[i]) > tol * fmax(1.0, fabs((double) want[i])) && ties < 2) {
                    extra[i] = unit;
                    ties++;
                }
            }
            tc_check(&tc, "merged", got, tc_widen(&tc, want, row * Tq), row * Tq, row, tol, extra);
        }
    }
    tc_end(&tc);
}

static void grp_attn_normed(void) {
    static const enum kvr_type types[] = { KVR_TYPE_F16, KVR_TYPE_BF16, KVR_TYPE_F32 };
    static const struct { int hd, H, Hkv, Tq, Tk, n; float softcap; int window; bool sinks; } cases[] = {
        { 64, 4, 2, 33, 67, 2, 0.0f, 0, false }, { 64, 4, 2, 40, 80, 3, 0.0f, 0, false }, { 64, 8, 2, 64, 64, 4, 0.0f, 0, false },
        { 64, 4, 2, 1, 130, 3, 0.0f, 0, false },  // a decode step over three shards
        { 32, 4, 1, 33, 67, 2, 2.0f, 0, false },  // soft-capped scores
        { 32, 4, 4, 48, 96, 3, 0.0f, 20, false }, // a sliding window: blocks some queries see nothing of
        { 64, 4, 2, 33, 67, 3, 0.0f, 0, true },   // sinks: in the denominator the probabilities round at
    };
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            for (int chain = 0; chain < 2; chain++) {
                t_attn_normed(cases[c].hd, cases[c].H, cases[c].Hkv, cases[c].Tq, cases[c].Tk, cases[c].n, chain, types[t], cases[c].softcap,
                              cases[c].window, cases[c].sinks, 1 + (int) ((c + chain) % 3));
            }
        }
    }
}

// kt, vt: the types of K and V (an F16, BF16 or Q8_0 cache: the kernels read them as they are)
static void t_fr_attn(const struct attn_case * ac, int window, float softcap, enum kvr_attn_mode mode, int nt, enum kvr_type kt,
                      enum kvr_type vt) {
    struct tcase tc;
    tc_begin(&tc, nt, "FAST_REF ATTN(hd=%d,H=%d,Hkv=%d,Tq=%d,Tk=%d,pos=%s,mode=%s,window=%d,softcap=%g,k=%s,v=%s)", ac->hd, ac->H,
             ac->Hkv, ac->Tq, ac->Tk, ac->pos, mode_str(mode), window, softcap, type_str(kt), type_str(vt));
    const int hd = ac->hd, Tq = ac->Tq, Tk = ac->Tk;
    struct kvr_tensor * q = tc_input_f32(&tc, 3, hd, ac->H, Tq, 1.0f);
    struct kvr_tensor * k = tc_kv_input(&tc, kt, hd, ac->Hkv, Tk);
    struct kvr_tensor * v = tc_kv_input(&tc, vt, hd, ac->Hkv, Tk);
    int32_t * qpos = (int32_t *) tc_floats(&tc, Tq), * kpos = (int32_t *) tc_floats(&tc, Tk);
    attn_positions(ac->pos, Tq, Tk, qpos, kpos);
    struct kvr_tensor * y = kvr_attn(tc.ctx, q, k, v, tc_input_i32(&tc, Tq, qpos), tc_input_i32(&tc, Tk, kpos), NULL,
                                     1.0f / sqrtf((float) hd), softcap, window, mode);
    float * fast, * ref;
    tc_output(&tc, y, "attn");
    const int64_t n = ((int64_t) hd * ac->H + ac->H) * Tq;
    // the scores are sums of hd products (|q|, |k| <= 1, so they move by hd ulp of hd/sqrt(hd)),
    // the softmax's and the output's sums run over the keys, the fast exps are a few ulp off. An
    // F16/BF16 V: the reference rounds the normalized probabilities to that type, the tiled kernel
    // (above 2^14 scores a head) the running ones, which differ by a unit of the type's rounding
    // (2^-11, 2^-8) of a weight; an f32 probability on either side of a rounding tie moves one
    // weight by that unit anywhere.
    double tol = (2.0 * Tk + hd * sqrt((double) hd) + 16) * ULP;
    if (vt == KVR_TYPE_F16)  tol += 1.0 / 2048;
    if (vt == KVR_TYPE_BF16) tol += 1.0 / 256;
    if (tc_compute_fast_ref(&tc, y, &fast, &ref)) {
        tc_check(&tc, "attn", fast, tc_widen(&tc, ref, n), n, (int64_t) hd * ac->H + ac->H, tol, NULL);
    }
    tc_end(&tc);
}

// SILU (a SIMD exp: a few ulp), NORM (GGML's order of the sums) and RMS_NORM over rows of n
static void t_fr_rows(int op, int n, int r, int nt) {
    static const char * name[] = { "SILU", "NORM", "RMS_NORM", "GELU", "GELU(exact)", "SOFTCAP" };
    struct tcase tc;
    tc_begin(&tc, nt, "FAST_REF %s(n=%d,r=%d)", name[op], n, r);
    struct kvr_tensor * a = tc_input_f32(&tc, 2, n, r, 1, 4.0f);
    struct kvr_tensor * y = op == 0 ? kvr_silu(tc.ctx, a) : op == 1 ? kvr_norm(tc.ctx, a, 1e-5f)
                          : op == 2 ? kvr_rms_norm(tc.ctx, a, 1e-6f) : op == 3 ? kvr_gelu(tc.ctx, a)
                          : op == 4 ? kvr_gelu_exact(tc.ctx, a) : kvr_softcap(tc.ctx, a, 3.0f);
    float * fast, * ref;
    tc_output(&tc, y, "y");
    if (tc_compute_fast_ref(&tc, y, &fast, &ref)) {
        // GELU: the same fp16 table either way, bit for bit; its exact form and SOFTCAP: f32 against
        // double, a few ulp
        const double tol = op == 0 || op >= 4 ? 8 * ULP : op == 3 ? 0.0 : (2.0 * n + 8) * ULP;
        tc_check(&tc, name[op], fast, tc_widen(&tc, ref, (int64_t) n * r), (int64_t) n * r, n, tol, NULL);
    }
    tc_end(&tc);
}

static void grp_fast_ref(void) {
    const char * env = getenv("KVR_REF");
    if (env && *env && strcmp(env, "0") != 0) {
        printf("FAST_REF: not run: KVR_REF=1 puts every CPU backend on the reference kernels\n");
        return;
    }
    static const int mm[][3] = {
        {64, 36, 1}, {64, 36, 3}, {63, 37, 5}, {96, 36, 4}, {100, 7, 33}, // small: llama.cpp's dots (F32)
        {544, 520, 1}, {544, 520, 4}, {544, 520, 9}, {4100, 70, 3}, {4100, 70, 17}, // decode rows, sgemm
    };
    static const enum kvr_type types[] = { KVR_TYPE_F32, KVR_TYPE_F16, KVR_TYPE_BF16 };
    for (size_t ti = 0; ti < 3; ti++) {
        for (size_t s = 0; s < sizeof(mm) / sizeof(mm[0]); s++) {
            for (int nt = 1; nt <= 3; nt += 2) t_fr_mul_mat(types[ti], mm[s][0], mm[s][1], mm[s][2], nt);
        }
    }
    static const struct { struct attn_case c; int window; float softcap; } at[] = {
        { { 64, 4, 4, 1, 1, "causal", false, false }, 0, 0.0f },
        { { 64, 8, 2, 33, 33, "causal", false, false }, 0, 0.0f },     // llama.cpp's arithmetic, tinyBLAS's order
        { { 64, 4, 2, 1, 67, "causal", false, false }, 0, 0.0f },      // one decode step: ggml_vec_dot's order
        { { 80, 4, 2, 33, 130, "mid", false, false }, 20, 0.0f },
        { { 16, 2, 1, 300, 300, "causal", false, false }, 0, 0.0f },   // tiled: several key and query tiles
        { { 64, 4, 2, 7, 3000, "mid", false, false }, 0, 0.0f },
        { { 16, 2, 2, 520, 520, "zz-2-1", false, false }, 50, 0.0f },
        { { 16, 2, 1, 40, 700, "shuffled", false, false }, 300, 0.0f },
        { { 64, 8, 2, 33, 33, "causal", false, false }, 16, 1.0f },    // soft-capped scores (gemma2)
        { { 16, 2, 1, 300, 300, "causal", false, false }, 0, 0.5f },
    };
    for (size_t c = 0; c < sizeof(at) / sizeof(at[0]); c++) {
        for (int m = 0; m < 2; m++) {
            for (int nt = 1; nt <= 3; nt += 2) t_fr_attn(&at[c].c, at[c].window, at[c].softcap, m ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt, KVR_TYPE_F32,
                                                          KVR_TYPE_F32);
        }
    }
    // a typed cache: every kernel (llama.cpp's arithmetic, its flash attention for Q8_0, tiled)
    static const enum kvr_type kv_types[][2] = {
        { KVR_TYPE_F16, KVR_TYPE_F16 }, { KVR_TYPE_BF16, KVR_TYPE_BF16 }, { KVR_TYPE_Q8_0, KVR_TYPE_Q8_0 },
        { KVR_TYPE_F16, KVR_TYPE_Q8_0 }, { KVR_TYPE_Q8_0, KVR_TYPE_F32 },
    };
    for (size_t t = 0; t < sizeof(kv_types) / sizeof(kv_types[0]); t++) {
        for (size_t c = 0; c < sizeof(at) / sizeof(at[0]); c++) {
            if (at[c].c.hd % 32 != 0 && (kv_types[t][0] == KVR_TYPE_Q8_0 || kv_types[t][1] == KVR_TYPE_Q8_0)) continue;
            t_fr_attn(&at[c].c, at[c].window, at[c].softcap, KVR_ATTN_CAUSAL, 1 + (int)(c % 3), kv_types[t][0], kv_types[t][1]);
        }
    }
    // prefill shapes of the tiled kernel (AVX-512: cpu_op_attn_lanes, queries in the lanes): head
    // sizes 64 to 256, GQA 7:1 and 8:1, MHA, G = 3 (48 rows an item), a cached prefix (the queries
    // are the last of the keys), Gemma 3's head 256 with a sliding window, query counts that leave a
    // partial tile (padding rows), keys in blocks that end mid-block, shuffled positions
    static const struct { struct attn_case c; int window; float softcap; } pf[] = {
        { { 256, 4, 1, 150, 150, "causal", false, false }, 0, 0.0f },
        { { 256, 4, 1, 150, 150, "causal", false, false }, 40, 0.0f },
        { { 64, 14, 2, 130, 130, "causal", false, false }, 0, 0.0f },
        { { 80, 6, 2, 37, 600, "causal", false, false }, 0, 0.0f },
        { { 96, 4, 4, 140, 140, "mid", false, false }, 0, 0.0f },
        { { 128, 8, 1, 50, 400, "causal", false, false }, 100, 0.0f },
        { { 64, 3, 1, 150, 150, "shuffled", false, false }, 0, 0.0f },
        { { 64, 2, 2, 131, 131, "causal", false, false }, 7, 2.0f },
    };
    static const enum kvr_type pf_types[] = { KVR_TYPE_F32, KVR_TYPE_F16, KVR_TYPE_BF16, KVR_TYPE_Q8_0 };
    for (size_t t = 0; t < sizeof(pf_types) / sizeof(pf_types[0]); t++) {
        for (size_t c = 0; c < sizeof(pf) / sizeof(pf[0]); c++) {
            if (pf[c].c.hd % 32 != 0 && pf_types[t] == KVR_TYPE_Q8_0) continue;
            for (int nt = 1; nt <= 3; nt += 2) {
                t_fr_attn(&pf[c].c, pf[c].window, pf[c].softcap, c % 2 ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL, nt, pf_types[t], pf_types[t]);
            }
        }
    }
    static const int id[][5] = { // K, N, E, k, T: llama.cpp's dots; decode rows; sgemm over the grouped tokens
        { 64, 36, 8, 2, 5 }, { 544, 520, 4, 2, 1 }, { 544, 520, 4, 2, 9 }, { 1040, 300, 6, 3, 40 },
    };
    for (size_t ti = 0; ti < 2; ti++) {
        for (size_t c = 0; c < sizeof(id) / sizeof(id[0]); c++) {
            for (int nt = 1; nt <= 3; nt += 2) t_fr_mul_mat_id(types[ti], id[c][0], id[c][1], id[c][2], id[c][3], id[c][4], nt);
        }
    }
    for (int op = 0; op < 6; op++) {
        for (int nt = 1; nt <= 3; nt += 2) {
            t_fr_rows(op, 7, 3, nt);
            t_fr_rows(op, 1030, 9, nt);
        }
    }
}

//
// MoE: MOE_ROUTE (each gating) -> MUL_MAT_ID gate/up (x shared by a token's experts, with biases)
// -> SWIGLU_OAI or SILU*MUL -> MUL_MAT_ID down (x one row per slot) -> MOE_SUM, against a
// double-precision forward pass written from kvr.h's definitions
//

static void t_moe(int K, int F, int E, int k, int T, int gating, bool oai, bool bias, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "MOE(K=%d,F=%d,E=%d,k=%d,T=%d,gating=%d%s%s)", K, F, E, k, T, gating, oai ? ",swiglu_oai" : "",
             bias ? ",biases" : "");
    struct kvr_tensor * x = tc_input_f32(&tc, 2, K, T, 1, 1.0f);
    struct kvr_tensor * lg = tc_input_f32(&tc, 2, E, T, 1, 2.0f);
    struct kvr_tensor * wg = tc_input_f32(&tc, 3, K, F, E, 0.3f), * wu = tc_input_f32(&tc, 3, K, F, E, 0.3f);
    struct kvr_tensor * wd = tc_input_f32(&tc, 3, F, K, E, 0.3f);
    struct kvr_tensor * bg = bias ? tc_input_f32(&tc, 2, F, E, 1, 1.0f) : NULL, * bu = bias ? tc_input_f32(&tc, 2, F, E, 1, 1.0f) : NULL;
    struct kvr_tensor * bd = bias ? tc_input_f32(&tc, 2, K, E, 1, 1.0f) : NULL;
    struct kvr_tensor * route = kvr_moe_route(tc.ctx, lg, k, (enum kvr_moe_gating)gating);
    struct kvr_tensor * g = kvr_mul_mat_id(tc.ctx, wg, x, route, bg), * u = kvr_mul_mat_id(tc.ctx, wu, x, route, bu);
    struct kvr_tensor * a = oai ? kvr_swiglu_oai(tc.ctx, g, u, 1.702f, 7.0f) : kvr_mul(tc.ctx, kvr_silu(tc.ctx, g), u);
    struct kvr_tensor * y = kvr_moe_sum(tc.ctx, kvr_mul_mat_id(tc.ctx, wd, a, route, bd), route);
    if (tc_shape(&tc, y, KVR_TYPE_F32, K, T, 1, 1)) {
        tc_output(&tc, y, "y");
        if (tc_compute(&tc, &y, 1)) {
            double * ref = tc_doubles(&tc, (int64_t)K * T), * act = tc_doubles(&tc, F);
            const float * X = x->data, * L = lg->data, * G = wg->data, * U = wu->data, * D = wd->data;
            for (int t = 0; t < T; t++) {
                const float * l = L + (int64_t)t * E;
                double p[256], w[16];
                int id[16];
                double mx = -INFINITY, sum = 0;
                for (int e = 0; e < E; e++) mx = fmax(mx, l[e]);
                for (int e = 0; e < E; e++) { p[e] = exp(l[e] - mx); sum += p[e]; }
                for (int e = 0; e < E; e++) p[e] = gating == KVR_MOE_TOPK_SOFTMAX ? l[e] : p[e] / sum;
                for (int j = 0; j < k; j++) { // the k largest, largest first
                    id[j] = -1;
                    for (int e = 0; e < E; e++) {
                        bool used = false;
                        for (int i = 0; i < j; i++) used = used || id[i] == e;
                        if (!used && (id[j] < 0 || p[e] > p[id[j]])) id[j] = e;
                    }
                    w[j] = p[id[j]];
                }
                if (gating == KVR_MOE_TOPK_SOFTMAX) {
                    double m = -INFINITY, s = 0;
                    for (int j = 0; j < k; j++) m = fmax(m, w[j]);
                    for (int j = 0; j < k; j++) { w[j] = exp(w[j] - m); s += w[j]; }
                    for (int j = 0; j < k; j++) w[j] /= s;
                } else if (gating == KVR_MOE_SOFTMAX_TOPK_NORM) {
                    double s = 0;
                    for (int j = 0; j < k; j++) s += w[j];
                    for (int j = 0; j < k; j++) w[j] /= s;
                }
                for (int n = 0; n < K; n++) ref[(int64_t)t * K + n] = 0;
                for (int j = 0; j < k; j++) {
                    const int64_t e = id[j];
                    for (int f = 0; f < F; f++) {
                        double gv = 0, uv = 0;
                        for (int c = 0; c < K; c++) {
                            gv += (double)G[(e * F + f) * K + c] * X[(int64_t)t * K + c];
                            uv += (double)U[(e * F + f) * K + c] * X[(int64_t)t * K + c];
                        }
                        if (bias) { gv += ((const float *)bg->data)[e * F + f]; uv += ((const float *)bu->data)[e * F + f]; }
                        if (oai) {
                            const double ga = fmin(gv, 7.0), ua = fmax(-7.0, fmin(uv, 7.0));
                            act[f] = ga / (1 + exp(-1.702 * ga)) * (ua + 1);
                        } else {
                            act[f] = gv / (1 + exp(-gv)) * uv;
                        }
                    }
                    for (int n = 0; n < K; n++) {
                        double dv = bias ? ((const float *)bd->data)[e * K + n] : 0.0;
                        for (int f = 0; f < F; f++) dv += (double)D[(e * K + n) * F + f] * act[f];
                        ref[(int64_t)t * K + n] += w[j] * dv;
                    }
                }
            }
            tc_check(&tc, "y", tc_read(&tc, y), ref, (int64_t)K * T, K, TOL_RED, NULL);
        }
    }
    tc_end(&tc);
}

static void grp_moe(void) {
    for (int nt = 1; nt <= 3; nt++) {
        t_moe(32, 16, 8, 2, 1, KVR_MOE_SOFTMAX_TOPK_NORM, false, false, nt);   // decode: x [K, 1] vs [F, k, 1]
        t_moe(32, 16, 8, 2, 13, KVR_MOE_SOFTMAX_TOPK_NORM, false, false, nt);
        t_moe(64, 32, 8, 2, 2, KVR_MOE_TOPK_SOFTMAX, true, true, nt);          // T == k: shared x is not per slot
        t_moe(64, 24, 16, 4, 37, KVR_MOE_SOFTMAX_TOPK, false, true, nt);
        t_moe(96, 40, 6, 1, 5, KVR_MOE_TOPK_SOFTMAX, true, true, nt);
    }
}

//
// ORDER16: a CPU backend with avx512_order (exact arithmetic) against a scalar model, written here
// from llama.cpp's source, of how its CPU backend built for AVX-512 sums on the weights' F32 twin,
// compared bit for bit (memcmp): MUL_MAT's batches that its llamafile sgemm takes (two or more
// tokens, K % 16 == 0, N % 4 == 0: tinyBLAS<16>, one 16-lane FMA chain an output, then
// _mm512_reduce_add_ps's tree) and the rest (one token, a decode batch's tokens each alone, other
// shapes: ggml_vec_dot_f32, four 16-lane chains over blocks of 64, then the tail one product at a
// time, as its AVX-512 build compiles it); F32, Q4_1 and Q8_0 weights (the quantized ones as their dequantized values, kvr_to_float);
// shapes whose rows and tokens end mid-tile; and SILU (ggml_v_silu on 16 lanes, libm's expf past
// the last multiple of 16).
//

// _mm512_reduce_add_ps: the 256-bit halves added, then the 128-bit halves, then (0 + 2) + (1 + 3)
static float model_reduce16(const float * a) {
    float h[8], q[4];
    for (int j = 0; j < 8; j++) h[j] = a[j] + a[8 + j];
    for (int j = 0; j < 4; j++) q[j] = h[j] + h[4 + j];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static float model_tinyblas16(const float * w, const float * x, int K) {
    float acc[16] = { 0 };
    for (int k = 0; k < K; k++) acc[k % 16] = fmaf(w[k], x[k], acc[k % 16]);
    return model_reduce16(acc);
}

static float model_vec_dot16(const float * w, const float * x, int K) {
    const int np = K - K % 64;
    float acc[4][16] = { { 0 } }, s[16];
    for (int k = 0; k < np; k++) acc[(k / 16) % 4][k % 16] = fmaf(w[k], x[k], acc[(k / 16) % 4][k % 16]);
    for (int j = 0; j < 16; j++) s[j] = (acc[0][j] + acc[2][j]) + (acc[1][j] + acc[3][j]);
    float sum = model_reduce16(s);
    for (int k = np; k < K; k++) { // GCC 12's object code of the loop: the last K % 8 fused
        const float p = w[k] * x[k];
        sum = k < K - (K - np) % 8 ? sum + p : fmaf(w[k], x[k], sum);
    }
    return sum;
}

// ggml_v_expf on AVX-512 (ggml-cpu/vec.h), one lane
static float model_expf16(float x) {
    const float z = fmaf(x, 0x1.715476p+0f, 0x1.8p23f);
    const float n = z - 0x1.8p23f;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return ldexpf(j, (int) n);
}

// y by a CPU backend with avx512_order on nt threads; false (and the case failed) on an error
static bool tc_compute_order16(struct tcase * tc, struct kvr_tensor * y, float ** got) {
    struct kvr_graph * g = kvr_graph_new(tc->ctx, GRAPH_SIZE);
    kvr_graph_expand(g, y);
    const struct kvr_backend_params bp = { .n_threads = tc->nt, .avx512_order = true };
    struct kvr_backend * be = kvr_backend_new("cpu", &bp);
    struct kvr_buffer * buf = be ? kvr_backend_alloc_buffer(be, kvr_graph_plan(g)) : NULL;
    int rc = KVR_ERR_NOMEM;
    if (buf) {
        kvr_graph_place(g, buf);
        rc = kvr_backend_graph_compute(be, g);
        *got = tc_read(tc, y);
    }
    if (rc != KVR_OK) tc_fail(tc, "no CPU backend, buffer or compute (%d): %s", rc, kvr_last_error());
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    return rc == KVR_OK;
}

// got against want, n floats, bit for bit; the first difference is the failure
static void tc_check_bits(struct tcase * tc, const float * got, const float * want, int64_t n, int64_t row) {
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            tc_fail(tc, "element [%lld, %lld] is %.9g, the model %.9g (not the same bits)", (long long) (i % row),
                    (long long) (i / row), got[i], want[i]);
            return;
        }
    }
}

// rows: the product a decode batch (KVR_MM_ROWS: each token as alone)
static void t_order16_mul_mat(enum kvr_type type, int K, int N, int T, bool rows, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ORDER16 MUL_MAT(type=%s,K=%d,N=%d,T=%d%s)", type_str(type), K, N, T, rows ? ",rows" : "");
    const int64_t ne[2] = { K, N };
    struct kvr_tensor * w = kvr_new_tensor(tc.ctx, type, 2, ne);
    w->data = tc_alloc(&tc, kvr_row_size(type, K) * (size_t) N, false, 0, "weights");
    w->flags |= KVR_FLAG_INPUT;
    float * twin = tc_floats(&tc, (int64_t) K * N);
    fill(twin, (int64_t) K * N, -1.0f, 1.0f);
    for (int n = 0; n < N; n++) {
        if (kvr_from_float(type, twin + (size_t) n * K, (uint8_t *) w->data + (size_t) n * w->nb[1], K) == 0) {
            tc_fail(&tc, "kvr_from_float cannot write %s", type_str(type));
        }
    }
    kvr_to_float(type, w->data, twin, (int64_t) K * N); // the weights' values: the F32 twin llama.cpp would run
    struct kvr_tensor * x = tc_input_f32(&tc, 2, K, T, 1, 1.0f);
    struct kvr_tensor * y = kvr_mul_mat(tc.ctx, w, x);
    if (rows) y->op_params[0] = KVR_MM_ROWS;
    tc_output(&tc, y, "y");
    float * got;
    if (tc.n_fail == 0 && tc_compute_order16(&tc, y, &got)) {
        const bool tinyblas = T >= 2 && !rows && K % 16 == 0 && N % 4 == 0;
        float * want = tc_floats(&tc, (int64_t) N * T);
        for (int t = 0; t < T; t++) {
            const float * xt = (const float *) x->data + (size_t) t * K;
            for (int n = 0; n < N; n++) {
                const float * wn = twin + (size_t) n * K;
                want[(size_t) t * N + n] = tinyblas ? model_tinyblas16(wn, xt, K) : model_vec_dot16(wn, xt, K);
            }
        }
        tc_check_bits(&tc, got, want, (int64_t) N * T, N);
    }
    tc_end(&tc);
}

static void t_order16_silu(int n, int rows, int nt) {
    struct tcase tc;
    tc_begin(&tc, nt, "ORDER16 SILU(n=%d,rows=%d)", n, rows);
    struct kvr_tensor * x = tc_input_f32(&tc, 2, n, rows, 1, 20.0f);
    struct kvr_tensor * y = kvr_silu(tc.ctx, x);
    tc_output(&tc, y, "y");
    float * got;
    if (tc_compute_order16(&tc, y, &got)) {
        float * want = tc_floats(&tc, (int64_t) n * rows);
        const float * xv = x->data;
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < n; i++) {
                const float v = xv[r * n + i];
                want[r * n + i] = i < n - n % 16 ? v / (1.0f + model_expf16(0.0f - v)) : v / (1.0f + expf(-v));
            }
        }
        tc_check_bits(&tc, got, want, (int64_t) n * rows, n);
    }
    tc_end(&tc);
}

static void grp_order16(void) {
    const char * env = getenv("KVR_REF");
    if (env && *env && strcmp(env, "0") != 0) {
        printf("ORDER16: not run: KVR_REF=1 puts every CPU backend on the reference kernels\n");
        return;
    }
    static const struct { int K, N, T; bool rows; } mm[] = {
        { 64, 4, 2, false }, { 576, 196, 7, false },  // SmolLM2's width; 16-row blocks and 6-token tiles that end partway
        { 576, 580, 7, false },                        // F32 above MM_DOT_MAX_WEIGHTS (else sgemm's order)
        { 96, 52, 13, false }, { 1536, 20, 6, false }, { 32, 8, 31, false },
        { 576, 196, 1, false }, { 96, 10, 3, false },  // one token; N % 4 != 0 (and K's tail past 64): vec_dot
        { 224, 6, 2, false },                          // a tail of 32 + 0 fused
        { 576, 36, 5, true },                          // a decode batch: each token as alone
    };
    static const enum kvr_type types[] = { KVR_TYPE_F32, KVR_TYPE_Q4_1, KVR_TYPE_Q8_0 };
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        for (size_t s = 0; s < sizeof(mm) / sizeof(mm[0]); s++) {
            for (int nt = 1; nt <= 3; nt++) t_order16_mul_mat(types[ti], mm[s].K, mm[s].N, mm[s].T, mm[s].rows, nt);
        }
    }
    for (int nt = 1; nt <= 3; nt++) {
        t_order16_mul_mat(KVR_TYPE_F32, 72, 8, 3, false, nt);   // K % 16 != 0: vec_dot, a tail of 8 (none fused)
        t_order16_mul_mat(KVR_TYPE_F32, 172, 64, 5, false, nt); // a tail of 32 + 8 + 4 fused (stories260K's FFN)
        t_order16_mul_mat(KVR_TYPE_F32, 13, 4, 1, false, nt);   // no block of 64, 8 + 5 fused
    }
    for (int nt = 1; nt <= 3; nt += 2) {
        t_order16_silu(1536, 5, nt);
        t_order16_silu(37, 3, nt); // a tail past the last 16
    }
}

//
// main
//

static const struct group {
    const char * name;
    void (*run)(void);
} GROUPS[] = {
    { "GET_ROWS", grp_get_rows }, { "ADD", grp_add }, { "MUL", grp_mul }, { "SCALE", grp_scale },
    { "RMS_NORM", grp_rms_norm }, { "NORM", grp_norm }, { "MUL_MAT", grp_mul_mat }, { "ROPE", grp_rope },
    { "SILU", grp_silu }, { "GELU", grp_gelu }, { "SOFTCAP", grp_softcap }, { "SIGMOID", grp_sigmoid },
    { "SOFTPLUS", grp_softplus }, { "GDN", grp_gdn }, { "CPY", grp_cpy }, { "KV_STORE", grp_kv_store },
    { "ATTN", grp_attn }, { "MERGE_ATTN", grp_merge_attn }, { "VIEW", grp_view }, { "GRAPH", grp_graph },
    { "PASS", grp_pass }, { "COUNTERS", grp_counters }, { "MOE", grp_moe }, { "ARGMAX", grp_argmax },
    { "FAST_REF", grp_fast_ref }, { "ATTN_NORMED", grp_attn_normed }, { "ORDER16", grp_order16 },
};

// Whether name is in the comma-separated list (case-insensitive).
static bool in_list(const char * list, const char * name) {
    const size_t n = strlen(name);
    for (const char * p = list; *p; ) {
        const char * end = strchr(p, ',');
        const size_t len = end ? (size_t) (end - p) : strlen(p);
        bool eq = len == n;
        for (size_t i = 0; eq && i < n; i++) {
            eq = (p[i] | 0x20) == (name[i] | 0x20);
        }
        if (eq) {
            return true;
        }
        p += len + (end != NULL);
    }
    return false;
}

static void usage(FILE * f) {
    char names[256];
    fprintf(f, "usage: test-ops [-v] [-o GROUP[,GROUP...]] [-s SEED] [-b BACKEND] [SHARED_DIR (ignored)]\ngroups:");
    for (size_t i = 0; i < sizeof(GROUPS) / sizeof(GROUPS[0]); i++) {
        fprintf(f, " %s", GROUPS[i].name);
    }
    fprintf(f, "\nbackends (-b, checked against the CPU): %s\n", kvr_backend_names(names, sizeof(names), " "));
}

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) {
            g_opt.verbose = true;
        } else if (!strcmp(argv[i], "-o") && i + 1 < argc) {
            g_opt.only = argv[++i];
        } else if (!strcmp(argv[i], "-s") && i + 1 < argc) {
            g_opt.seed = strtoull(argv[++i], NULL, 0);
        } else if (!strcmp(argv[i], "-b") && i + 1 < argc) {
            g_other.name = argv[++i];
            if (!kvr_backend_find(g_other.name)) {
                char names[256];
                fprintf(stderr, "test-ops: -b '%s': not a registered backend; want one of %s\n", g_other.name,
                        kvr_backend_names(names, sizeof(names), ", "));
                return 2;
            }
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] != '-') {
            // the shared data directory that tests/run-tests.sh passes to every test: none needed
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (g_opt.only) {
        // every name asked for must exist: a typo must not pass as "0 failed"
        for (const char * p = g_opt.only; *p; ) {
            const char * end = strchr(p, ',');
            const size_t len = end ? (size_t) (end - p) : strlen(p);
            char name[32];
            snprintf(name, sizeof(name), "%.*s", (int) len, p);
            bool found = false;
            for (size_t g = 0; g < sizeof(GROUPS) / sizeof(GROUPS[0]); g++) {
                found = found || in_list(name, GROUPS[g].name);
            }
            if (!found) {
                fprintf(stderr, "test-ops: no group '%s'\n", name);
                usage(stderr);
                return 2;
            }
            p += len + (end != NULL);
        }
    }
    signal(SIGABRT, on_abort);
    for (int i = 0; i < kvr_backend_count() && !g_other.name; i++) {
        if (strcmp(kvr_backend_registered(i)->name, "cpu") != 0) g_other.name = kvr_backend_registered(i)->name;
    }
    if (!g_other.name) g_other.name = "cpu"; // a registry of the CPU alone: the seam is still worth a run
    g_other.be = kvr_backend_new(g_other.name, NULL);
    if (!g_other.be) snprintf(g_other.why, sizeof(g_other.why), "%s", kvr_last_error());
    printf("test-ops: seed %llu, threads 1 2 3; backends: cpu%s%s\n", (unsigned long long) g_opt.seed,
           g_other.be ? ", " : "", g_other.be ? kvr_backend_name(g_other.be) : "");
    const double t0 = kvr_time_ms();
    for (size_t g = 0; g < sizeof(GROUPS) / sizeof(GROUPS[0]); g++) {
        if (g_opt.only && !in_list(g_opt.only, GROUPS[g].name)) {
            continue;
        }
        g_grp_pass = g_grp_fail = 0;
        GROUPS[g].run();
        printf("%-10s %4d passed %4d failed\n", GROUPS[g].name, g_grp_pass, g_grp_fail);
        fflush(stdout);
    }
    if (g_other.be) {
        printf("%s: %d cases passed, %d failed against the CPU (worst NMSE %.2e)\n", kvr_backend_name(g_other.be),
               g_other.n_pass, g_other.n_fail, g_other.worst);
        kvr_backend_free(g_other.be);
    } else {
        printf("%s: %d cases skipped, not run: %s\n", g_other.name, g_other.n_skip, g_other.why);
    }
    // a case that failed on the other backend failed (its CPU checks are in n_pass/n_fail too)
    printf("all groups: %.1f s\n", (kvr_time_ms() - t0) / 1000.0);
    n_skip = g_other.n_skip;
    return check_summary("ops");
}
