// tests/test-cuda-host.cu - what of the CUDA backend can be checked without a GPU, built by nvcc
// (make KVR_CUDA=1, and make test's compile gate wherever nvcc is installed).
//
// 1. The shared per-element functions of kvr.h (KVR_HD) as nvcc compiles them for the host,
//    against the same functions as the C compiler builds them for the CPU path
//    (tests/cuda-host-c.c, kvr.c's flags): the same bits for every fp16 and bf16 value, for every
//    fp16 input of GELU, for random blocks of every quant type, for RoPE angles and rotations, the
//    online-softmax step, the log-sum-exp merge and the attention tile rule. The device build of
//    these functions is the same source; only the fused multiply-adds nvcc's device code may form
//    can move its last bits (that, and the device's expf/sinf/cosf, is what kvr-compare measures
//    on a GPU).
//    The KV cache's element math too (kvr_kv_quant_q8_0, kvr_kv_operand_round, kvr_kv_dot_q8_0,
//    kvr_kv_elem: what the GPU's cache stores and attention tiles run).
// 2. The attention kernel's tiling: which (query tile, key tile) pairs its blocks visit, counted
//    with the kernel's own grid and tile functions (kvr_cuda_attn_count), against the counters of
//    the CPU kernel run on the same positions: contiguous causal blocks, the ring strategies'
//    zig-zag shards, a KV-Runahead rank's block over a longer cache, decode, GQA/MQA groups, dense
//    mode, with and without a sliding window.
// 3. Without a device: kvr_backend_new("cuda") fails within seconds with a message saying that no
//    CUDA device was found (with one, it succeeds and names it).
//
//   test-cuda-host [SHARED (ignored)]     prints "cuda-host: N passed, M failed"

#define KVR_BUILD
#include "kvr.h"
#include "tests/check.h"

#include <initializer_list>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
void     hd_c_dequant_block(enum kvr_type t, const void * row, int64_t i, float * y);
float    hd_c_half_to_f32(uint16_t h);
uint16_t hd_c_f32_to_half(float f);
float    hd_c_bfloat_to_f32(uint16_t h);
uint16_t hd_c_f32_to_bfloat(float f);
uint16_t hd_c_gelu_half(uint16_t h);
float    hd_c_gelu_ggml(float x);
float    hd_c_rope_theta_scale(float base, int n_rot);
float    hd_c_rope_theta(int32_t pos, float scale, int i);
void     hd_c_rope_rotate(float x0, float x1, float c, float s, float * y0, float * y1);
float    hd_c_softmax_max(float m, float tile_max);
float    hd_c_softmax_step(float * m, float * l, float m_new, float sum);
void     hd_c_softmax_finish(float m, float l, float * inv, float * lse);
float    hd_c_lse_weight(float lse, float m);
float    hd_c_lse_merged(float m, float sum);
float    hd_c_rope_angle(float theta, const float * freqs, int i, float freq_scale);
int      hd_c_attn_tile(int mode, int32_t qmin, int32_t qmax, int32_t kmin, int32_t kmax, int64_t window);
bool     hd_c_attn_visible(int32_t qp, int32_t kp, int64_t window);
int64_t  hd_c_attn_tile_tokens(int64_t group);
void     hd_c_kv_quant_q8_0(const float * x, struct kvr_block_q8_0 * y);
float    hd_c_kv_operand_round(enum kvr_type t, float x);
float    hd_c_kv_dot_q8_0(const struct kvr_block_q8_0 * k, const struct kvr_block_q8_0 * q, int n);
float    hd_c_kv_elem(enum kvr_type t, const void * row, int64_t i);
}

static uint64_t rng_state = 0x6b7672637564ull;
static uint64_t rng_u64(void) { // splitmix64
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_f(float lo, float hi) { return lo + (hi - lo) * (float)((double)(rng_u64() >> 40) / 16777216.0); }

static bool same(float a, float b) { return memcmp(&a, &b, sizeof(a)) == 0; }

static float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

//
// 1. the shared functions, nvcc's host build against the C compiler's
//

static void test_halves(void) {
    int bad = -1, bad_b = -1, bad_g = -1;
    for (uint32_t h = 0; h < 65536; h++) {
        if (bad < 0 && !same(kvr_half_to_f32((uint16_t)h), hd_c_half_to_f32((uint16_t)h))) bad = (int)h;
        if (bad_b < 0 && !same(kvr_bfloat_to_f32((uint16_t)h), hd_c_bfloat_to_f32((uint16_t)h))) bad_b = (int)h;
        if (bad_g < 0 && kvr_gelu_half((uint16_t)h) != hd_c_gelu_half((uint16_t)h)) bad_g = (int)h;
    }
    CHECK(bad < 0, "kvr_half_to_f32 differs at 0x%04x", bad);
    CHECK(bad_b < 0, "kvr_bfloat_to_f32 differs at 0x%04x", bad_b);
    CHECK(bad_g < 0, "kvr_gelu_half differs at 0x%04x", bad_g);
    // f32 -> half/bf16 over random bit patterns (every exponent, subnormals, inf, nan) and values
    // around the rounding boundaries of halves
    uint32_t bad_f = 0, bad_fb = 0;
    bool ok_f = true, ok_fb = true;
    for (int i = 0; i < 1 << 20; i++) {
        const uint32_t u = (uint32_t)rng_u64();
        const float f = i % 2 ? f32_of(u) : kvr_half_to_f32((uint16_t)u) * (1.0f + rng_f(-1e-3f, 1e-3f));
        if (ok_f && kvr_f32_to_half(f) != hd_c_f32_to_half(f)) { ok_f = false; bad_f = u; }
        if (ok_fb && kvr_f32_to_bfloat(f) != hd_c_f32_to_bfloat(f)) { ok_fb = false; bad_fb = u; }
    }
    CHECK(ok_f, "kvr_f32_to_half differs (bits 0x%08x)", bad_f);
    CHECK(ok_fb, "kvr_f32_to_bfloat differs (bits 0x%08x)", bad_fb);
    float bad_x = 0.0f;
    bool ok_g = true;
    for (int i = 0; i < 1 << 18 && ok_g; i++) {
        const float x = rng_f(-12.0f, 12.0f);
        if (!same(kvr_gelu_ggml(x, NULL), hd_c_gelu_ggml(x))) { ok_g = false; bad_x = x; }
    }
    CHECK(ok_g, "kvr_gelu_ggml differs at %.9g", bad_x);
}

struct qt { enum kvr_type type; int blck, size; int half[2], n_half; };

static const struct qt qtypes[] = {
    { KVR_TYPE_Q4_0, 32, 18, { 0, 0 }, 1 },    { KVR_TYPE_Q4_1, 32, 20, { 0, 2 }, 2 },
    { KVR_TYPE_Q5_0, 32, 22, { 0, 0 }, 1 },    { KVR_TYPE_Q5_1, 32, 24, { 0, 2 }, 2 },
    { KVR_TYPE_Q8_0, 32, 34, { 0, 0 }, 1 },    { KVR_TYPE_Q8_1, 32, 36, { 0, 2 }, 2 },
    { KVR_TYPE_Q2_K, 256, 84, { 80, 82 }, 2 }, { KVR_TYPE_Q3_K, 256, 110, { 108, 0 }, 1 },
    { KVR_TYPE_Q4_K, 256, 144, { 0, 2 }, 2 },  { KVR_TYPE_Q5_K, 256, 176, { 0, 2 }, 2 },
    { KVR_TYPE_Q6_K, 256, 210, { 208, 0 }, 1 }, { KVR_TYPE_Q8_K, 256, 292, { 0, 0 }, 0 },
    { KVR_TYPE_F16, 1, 2, { 0, 0 }, 0 },       { KVR_TYPE_BF16, 1, 2, { 0, 0 }, 0 },
    { KVR_TYPE_F32, 1, 4, { 0, 0 }, 0 },
};

static void test_dequant(void) {
    enum { NB = 64 };
    static uint8_t buf[NB * 292 + 1];
    static float a[NB * 256], b[NB * 256];
    for (size_t t = 0; t < sizeof(qtypes) / sizeof(qtypes[0]); t++) {
        const struct qt * q = &qtypes[t];
        int64_t bad = -1;
        for (int round = 0; round < 16 && bad < 0; round++) {
            for (int i = 0; i < NB * q->size; i++) buf[i] = (uint8_t)rng_u64();
            for (int k = 0; k < NB; k++) { // finite scales (half exponents 0..18: subnormals too)
                uint8_t * blk = buf + k * q->size;
                for (int j = 0; j < q->n_half; j++) {
                    const uint16_t h = (uint16_t)((rng_u64() & 0x8000) | ((rng_u64() % 19) << 10) | (rng_u64() & 0x3ff));
                    blk[q->half[j]] = (uint8_t)h;
                    blk[q->half[j] + 1] = (uint8_t)(h >> 8);
                }
                if (q->type == KVR_TYPE_Q8_K) {
                    const float d = rng_f(-0.01f, 0.01f);
                    memcpy(blk, &d, 4);
                }
            }
            const int odd = round % 2; // blocks at odd addresses too
            if (odd) memmove(buf + 1, buf, (size_t)NB * q->size);
            for (int64_t k = 0; k < NB; k++) {
                kvr_dequant_block(q->type, buf + odd, k, a + k * q->blck);
                hd_c_dequant_block(q->type, buf + odd, k, b + k * q->blck);
            }
            for (int64_t e = 0; e < (int64_t)NB * q->blck && bad < 0; e++) {
                if (!same(a[e], b[e]) && !(isnan(a[e]) && isnan(b[e]))) bad = e;
            }
        }
        CHECK(bad < 0, "kvr_dequant_block(%s) differs at element %lld", kvr_type_name(q->type), (long long)bad);
    }
}

static void test_rope(void) {
    const float bases[] = { 10000.0f, 500000.0f, 1000000.0f, 10.0f };
    const int rots[] = { 64, 128, 32, 80, 8 };
    bool ok = true;
    for (int b = 0; b < 4; b++) {
        for (int r = 0; r < 5; r++) {
            const float ts = kvr_rope_theta_scale(bases[b], rots[r]);
            ok = ok && same(ts, hd_c_rope_theta_scale(bases[b], rots[r]));
            for (int k = 0; k < 64; k++) {
                const int32_t pos = (int32_t)(rng_u64() % 200000);
                const int i = (int)(rng_u64() % (uint64_t)(rots[r] / 2));
                ok = ok && same(kvr_rope_theta(pos, ts, i), hd_c_rope_theta(pos, ts, i));
            }
        }
    }
    float freqs[64];
    for (int i = 0; i < 64; i++) freqs[i] = rng_f(1.0f, 8.0f);
    for (int k = 0; k < 10000 && ok; k++) {
        const float th = rng_f(0, 1e5f), fs = rng_f(0.1f, 2.0f);
        const int i = (int)(rng_u64() % 64);
        ok = same(kvr_rope_angle(th, freqs, i, fs), hd_c_rope_angle(th, freqs, i, fs)) &&
             same(kvr_rope_angle(th, NULL, i, fs), hd_c_rope_angle(th, NULL, i, fs));
    }
    CHECK(ok, "kvr_rope_theta_scale / kvr_rope_theta / kvr_rope_angle differ");
    ok = true;
    for (int k = 0; k < 100000 && ok; k++) {
        const float x0 = rng_f(-4, 4), x1 = rng_f(-4, 4), th = rng_f(-100, 100);
        float a0, a1, b0, b1;
        kvr_rope_rotate(x0, x1, cosf(th), sinf(th), &a0, &a1);
        hd_c_rope_rotate(x0, x1, cosf(th), sinf(th), &b0, &b1);
        ok = same(a0, b0) && same(a1, b1);
    }
    CHECK(ok, "kvr_rope_rotate differs");
    int dims_ok = 1;
    for (int i = 0; i < 32; i++) {
        int n0, n1, m0, m1;
        kvr_rope_dims(KVR_ROPE_NORM, 64, i, &n0, &n1);
        kvr_rope_dims(KVR_ROPE_NEOX, 64, i, &m0, &m1);
        dims_ok &= n0 == 2 * i && n1 == 2 * i + 1 && m0 == i && m1 == i + 32;
    }
    CHECK(dims_ok, "kvr_rope_dims: pairs are (2i, 2i+1) normal and (i, i+n_rot/2) NeoX");
}

static void test_softmax(void) {
    bool ok = true;
    for (int k = 0; k < 200000 && ok; k++) {
        // a running state (sometimes the empty one) and a tile
        float ma = k % 7 == 0 ? -INFINITY : rng_f(-30, 30), la = k % 7 == 0 ? 0.0f : rng_f(0.5f, 300.0f);
        float mb = ma, lb = la;
        const float tmax = rng_f(-30, 30), sum = rng_f(1.0f, 256.0f);
        const float na = kvr_softmax_max(ma, tmax), nb = hd_c_softmax_max(mb, tmax);
        const float ca = kvr_softmax_step(&ma, &la, na, sum), cb = hd_c_softmax_step(&mb, &lb, nb, sum);
        float ia, sa, ib, sb;
        kvr_softmax_finish(ma, la, &ia, &sa);
        hd_c_softmax_finish(mb, lb, &ib, &sb);
        ok = same(na, nb) && same(ca, cb) && same(ma, mb) && same(la, lb) && same(ia, ib) && same(sa, sb);
        const float lse = k % 5 == 0 ? -INFINITY : rng_f(-40, 40), m = rng_f(-40, 40);
        ok = ok && same(kvr_lse_weight(lse, m), hd_c_lse_weight(lse, m)) &&
             same(kvr_lse_merged(m, sum), hd_c_lse_merged(m, sum));
    }
    CHECK(ok, "the online-softmax step, its finish or the LSE merge differ");
    float inv, lse;
    kvr_softmax_finish(-INFINITY, 0.0f, &inv, &lse);
    CHECK(inv == 0.0f && lse == -INFINITY, "a row that saw no key: output 0 and LSE -inf");
    CHECK(kvr_lse_weight(-INFINITY, 3.0f) == 0.0f, "an empty partial weighs 0 in the merge");
}

static void test_tile_rule(void) {
    bool ok = true;
    for (int k = 0; k < 100000 && ok; k++) {
        const int32_t a = (int32_t)(rng_u64() % 1000), b = a + (int32_t)(rng_u64() % 300);
        const int32_t c = (int32_t)(rng_u64() % 1000), d = c + (int32_t)(rng_u64() % 300);
        const int mode = (int)(rng_u64() % 2);
        const int64_t w = k % 3 ? 0 : (int64_t)(rng_u64() % 600);
        ok = kvr_attn_tile(mode, a, b, c, d, w) == hd_c_attn_tile(mode, a, b, c, d, w) &&
             kvr_attn_visible(a, c, w) == hd_c_attn_visible(a, c, w);
    }
    for (int64_t g = 1; g <= 512 && ok; g++) ok = kvr_attn_tile_tokens(g) == hd_c_attn_tile_tokens(g);
    CHECK(ok, "kvr_attn_tile / kvr_attn_tile_tokens differ");
    CHECK(kvr_attn_tile(KVR_ATTN_CAUSAL, 0, 255, 256, 511, 0) == 0 && kvr_attn_tile(KVR_ATTN_DENSE, 0, 255, 256, 511, 0) == 2 &&
          kvr_attn_tile(KVR_ATTN_CAUSAL, 256, 511, 0, 255, 0) == 1 && kvr_attn_tile(KVR_ATTN_CAUSAL, 0, 255, 0, 255, 0) == 2 &&
          kvr_attn_tile(KVR_ATTN_CAUSAL, 1000, 1255, 0, 255, 512) == 0 && kvr_attn_tile(KVR_ATTN_CAUSAL, 600, 855, 256, 511, 512) == 2,
          "kvr_attn_tile: skip after (or before the window), compute before, mask across the diagonal and the window's edge");
}

//
// 2. the attention kernel's tiles against the CPU kernel's counters
//

// The CPU's counters of one ATTN over these positions (tiny head dim: only the tiles matter).
static bool cpu_attn_counts(const int32_t * qpos, int Tq, const int32_t * kpos, int Tk, int H, int Hkv, int mode,
                            int window, int64_t * dense, int64_t * causal) {
    const int D = 4;
    struct kvr_context * ctx = kvr_init((size_t)64 << 20, false);
    if (!ctx) return false;
    struct kvr_tensor * q  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, H, Tq);
    struct kvr_tensor * k  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
    struct kvr_tensor * v  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
    struct kvr_tensor * qp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tq);
    struct kvr_tensor * kp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tk);
    for (int64_t i = 0; i < kvr_nelements(q); i++) ((float *)q->data)[i] = rng_f(-1, 1);
    for (int64_t i = 0; i < kvr_nelements(k); i++) ((float *)k->data)[i] = rng_f(-1, 1);
    for (int64_t i = 0; i < kvr_nelements(v); i++) ((float *)v->data)[i] = rng_f(-1, 1);
    memcpy(qp->data, qpos, sizeof(int32_t) * (size_t)Tq);
    memcpy(kp->data, kpos, sizeof(int32_t) * (size_t)Tk);
    struct kvr_tensor * out = kvr_attn(ctx, q, k, v, qp, kp, NULL, 0.5f, window, (enum kvr_attn_mode)mode);
    struct kvr_graph * g = kvr_graph_new(ctx, 64);
    kvr_graph_expand(g, out);
    struct kvr_backend * be = kvr_backend_cpu_new(1);
    bool ok = false;
    if (be) {
        const size_t need = kvr_graph_plan(g);
        struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, need ? need : 64);
        if (buf) {
            kvr_graph_place(g, buf);
            struct kvr_counters c;
            kvr_backend_counters(be, NULL, true);
            ok = kvr_backend_graph_compute(be, g) == KVR_OK && kvr_backend_counters(be, &c, false);
            *dense = c.attn_dot_dense;
            *causal = c.attn_dot_causal;
            kvr_buffer_free(buf);
        }
        kvr_backend_free(be);
    }
    if (!ok) printf("test-cuda-host: the CPU attention did not run: %s\n", kvr_last_error());
    kvr_free(ctx);
    return ok;
}

static int g_window; // the sliding window of the cases (0: none)

static void tiles_case(const char * what, const int32_t * qpos, int Tq, const int32_t * kpos, int Tk, int H, int Hkv,
                       int mode) {
    int64_t cd = -1, cc = -1, gd = -1, gc = -1;
    const bool ran = cpu_attn_counts(qpos, Tq, kpos, Tk, H, Hkv, mode, g_window, &cd, &cc);
    kvr_cuda_attn_count(qpos, Tq, kpos, Tk, H, Hkv, mode, g_window, &gd, &gc);
    CHECK(ran && cd == gd && cc == gc, "attention tiles, %s (Tq %d, Tk %d, heads %d/%d, %s, window %d): CPU dense %lld "
          "causal %lld, CUDA kernel dense %lld causal %lld", what, Tq, Tk, H, Hkv, mode ? "dense" : "causal", g_window,
          (long long)cd, (long long)cc, (long long)gd, (long long)gc);
}

static void test_tiles(void) {
    static int32_t qpos[4096], kpos[4096];
    const int heads[][2] = { { 4, 4 }, { 8, 2 }, { 8, 1 }, { 32, 4 }, { 6, 3 } };
    for (int hw = 0; hw < 10; hw++) {
        const int hh = hw % 5;
        g_window = hw < 5 ? 0 : 300; // the second round with a sliding window (gemma3's local layers)
        const int H = heads[hh][0], Hkv = heads[hh][1];
        for (int mode = 0; mode < 2; mode++) {
            // a whole prompt on one rank: queries and keys 0..T-1
            for (int T : { 1, 100, 256, 300, 777 }) {
                for (int i = 0; i < T; i++) qpos[i] = kpos[i] = i;
                tiles_case("one rank", qpos, T, kpos, T, H, Hkv, mode);
            }
            // a KV-Runahead rank: its block [s, e) over the cache [0, e)
            for (int s : { 200, 511, 1000 }) {
                const int e = s + 300;
                for (int i = 0; i < e; i++) kpos[i] = i;
                for (int i = 0; i < e - s; i++) qpos[i] = s + i;
                tiles_case("a block after a cache", qpos, e - s, kpos, e, H, Hkv, mode);
            }
            // ring shards: rank r's zig-zag queries against every rank's zig-zag keys
            const int T = 1000, N = 3;
            for (int r = 0; r < N; r++) {
                const int nq = kvr_ring_shard(T, 0, N, r, qpos);
                for (int s = 0; s < N; s++) {
                    const int nk = kvr_ring_shard(T, 0, N, s, kpos);
                    tiles_case("ring shards", qpos, nq, kpos, nk, H, Hkv, mode);
                }
            }
            // decode: one query at the end of a long cache
            for (int i = 0; i < 1500; i++) kpos[i] = i;
            qpos[0] = 1499;
            tiles_case("decode", qpos, 1, kpos, 1500, H, Hkv, mode);
        }
    }
}

//
// 3. no device: a clear error, quickly
//

static void test_no_device(void) {
    const double t0 = kvr_time_ms();
    struct kvr_backend * be = kvr_backend_new("cuda", NULL);
    const double dt = kvr_time_ms() - t0;
    if (be) {
        printf("test-cuda-host: a CUDA device is present (%s): the no-device check does not apply\n", kvr_backend_name(be));
        kvr_backend_free(be);
        CHECK(dt < 60e3, "kvr_backend_new(\"cuda\") took %.1f s", dt / 1e3);
        return;
    }
    CHECK(strstr(kvr_last_error(), "no CUDA device was found") != NULL,
          "without a device the error says so: '%s'", kvr_last_error());
    CHECK(dt < 10e3, "kvr_backend_new(\"cuda\") gave up within 10 s (took %.1f s)", dt / 1e3);
}

// The KV cache's element math (kvr_cache_type): the Q8_0 store's quantization, the operand rounding
// of F16/BF16, the Q8_0 dot in ggml's lane order, and the element reader of the GPU's attention
// tiles, over random rows (with zero blocks and halfway values): nvcc's host build against the C one.
static void test_kv_types(void) {
    enum { N = 128 };
    bool ok_q = true, ok_r = true, ok_d = true, ok_e = true;
    for (int it = 0; it < 200; it++) {
        float x[N], y[N];
        for (int i = 0; i < N; i++) {
            x[i] = (float)((double)(rng_u64() >> 11) / 9007199254740992.0 * 8.0 - 4.0);
            y[i] = (float)((double)(rng_u64() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
            if (it % 7 == 0 && i < 32) x[i] = 0.0f;              // an all-zero block
            if (it % 5 == 0) x[i] = (float)((int)(x[i] * 64)) / 64.0f + 1.0f / 128.0f; // near-ties
        }
        struct kvr_block_q8_0 a[N / 32], b[N / 32], qa[N / 32], qb[N / 32];
        for (int k = 0; k < N / 32; k++) {
            kvr_kv_quant_q8_0(x + 32 * k, &a[k]);
            hd_c_kv_quant_q8_0(x + 32 * k, &b[k]);
            kvr_kv_quant_q8_0(y + 32 * k, &qa[k]);
            hd_c_kv_quant_q8_0(y + 32 * k, &qb[k]);
        }
        ok_q = ok_q && !memcmp(a, b, sizeof(a)) && !memcmp(qa, qb, sizeof(qa));
        const float d0 = kvr_kv_dot_q8_0(a, qa, N), d1 = hd_c_kv_dot_q8_0(a, qa, N);
        ok_d = ok_d && !memcmp(&d0, &d1, 4);
        uint16_t h[N];
        for (int i = 0; i < N; i++) h[i] = kvr_f32_to_half(x[i]);
        for (int i = 0; i < N; i++) {
            for (enum kvr_type t : { KVR_TYPE_F16, KVR_TYPE_BF16, KVR_TYPE_F32 }) {
                const float r0 = kvr_kv_operand_round(t, x[i]), r1 = hd_c_kv_operand_round(t, x[i]);
                ok_r = ok_r && !memcmp(&r0, &r1, 4);
            }
            const float e0 = kvr_kv_elem(KVR_TYPE_Q8_0, a, i), e1 = hd_c_kv_elem(KVR_TYPE_Q8_0, a, i);
            const float f0 = kvr_kv_elem(KVR_TYPE_F16, h, i), f1 = hd_c_kv_elem(KVR_TYPE_F16, h, i);
            const float g0 = kvr_kv_elem(KVR_TYPE_F32, x, i), g1 = hd_c_kv_elem(KVR_TYPE_F32, x, i);
            ok_e = ok_e && !memcmp(&e0, &e1, 4) && !memcmp(&f0, &f1, 4) && !memcmp(&g0, &g1, 4) && g0 == x[i];
        }
    }
    CHECK(ok_q, "kvr_kv_quant_q8_0 differs");
    CHECK(ok_r, "kvr_kv_operand_round differs");
    CHECK(ok_d, "kvr_kv_dot_q8_0 differs");
    CHECK(ok_e, "kvr_kv_elem differs (or does not read f32 rows as they are)");
}

int main(int argc, char ** argv) {
    (void)argc;
    (void)argv;
    test_kv_types();
    test_halves();
    test_dequant();
    test_rope();
    test_softmax();
    test_tile_rule();
    test_tiles();
    test_no_device();
    return check_summary("cuda-host");
}
