// tests/test-cuda-host.cu - what of the CUDA backend can be checked without a GPU, built by nvcc
// (make KVR_CUDA=1, and make test's compile gate wherever nvcc is installed).
//
// 1. The shared per-element functions of kvr.h (KVR_HD) as nvcc compiles them for the host,
//    against the same functions as the C compiler builds them for the CPU path
//    (tests/cuda-host-c.c, kvr.c's flags): the same bits for every fp16 and bf16 value, for every
//    fp16 input of GELU (and random ones of its f32 form and of soft-capping), for random blocks of every quant type, for RoPE angles and rotations, the
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
// 3. The one-token matmul kernel: each lane's 8 elements (kvr_dequant8) against whole blocks, bit
//    for bit, and the kernel's warp emulated on the host (lanes as arrays, its shuffles' sums)
//    against the CPU's MUL_MAT, for every weight type.
// 4. The tensor-core attention kernel (k_fattn): the pairs its schedule computes are exactly the
//    visible ones over a grid of prompt length, cached length, window, head dim, GQA group and rank
//    slice (and the CPU kernel's counter), and its algorithm run on the host (kvr_cuda_fattn_emulate)
//    agrees with the CPU's ATTN on F16 keys and values. Flash-decoding (decode attention split
//    over the keys, merged by LSE): its splits partition the keys, and its kernels run on the host
//    (kvr_cuda_fdec_emulate) agree with the CPU's ATTN.
// 5. Without a device: kvr_backend_new("cuda") fails within seconds with a message saying that no
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
float    hd_c_gelu_tanh(float x);
float    hd_c_softcap_f32(float x, float cap);
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
    // GELU in f32 (gemma2) and soft-capping (gemma2's scores and logits, caps of 50 and 30 and a
    // small one that saturates): the same bits
    bool ok_t = true, ok_c = true;
    float bad_t = 0.0f, bad_c = 0.0f, bad_cap = 0.0f;
    static const float caps[3] = { 50.0f, 30.0f, 0.5f };
    for (int i = 0; i < 1 << 18; i++) {
        const float x = rng_f(-12.0f, 12.0f), y = rng_f(-200.0f, 200.0f), cap = caps[i % 3];
        if (ok_t && !same(kvr_gelu_tanh(x), hd_c_gelu_tanh(x))) { ok_t = false; bad_t = x; }
        if (ok_c && !same(kvr_softcap_f32(y, cap), hd_c_softcap_f32(y, cap))) { ok_c = false; bad_c = y; bad_cap = cap; }
    }
    CHECK(ok_t, "kvr_gelu_tanh differs at %.9g", bad_t);
    CHECK(ok_c, "kvr_softcap_f32 differs at %.9g (cap %g)", bad_c, bad_cap);
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
    { KVR_TYPE_F32, 1, 4, { 0, 0 }, 0 },       { KVR_TYPE_MXFP4, 32, 17, { 0, 0 }, 0 },
};

// nb random blocks of type q (or elements, of the plain types) with finite scales (half exponents
// 0..18: subnormals too)
static void random_blocks(const struct qt * q, uint8_t * buf, int nb) {
    for (int i = 0; i < nb * q->size; i++) buf[i] = (uint8_t)rng_u64();
    for (int k = 0; k < nb; k++) {
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
        if (q->type == KVR_TYPE_F32) { // finite values
            const float v = rng_f(-4.0f, 4.0f);
            memcpy(blk, &v, 4);
        }
        if (q->type == KVR_TYPE_MXFP4) blk[0] = (uint8_t)(1 + rng_u64() % 140); // E8M0 2^-127..2^12: subnormal scales too, no overflow
        if (q->type == KVR_TYPE_F16 || q->type == KVR_TYPE_BF16) { // finite: exponent below all ones
            blk[1] &= 0xbf; // the exponent's top bit
        }
    }
}

static void test_dequant(void) {
    enum { NB = 64 };
    static uint8_t buf[NB * 292 + 1];
    static float a[NB * 256], b[NB * 256];
    for (size_t t = 0; t < sizeof(qtypes) / sizeof(qtypes[0]); t++) {
        const struct qt * q = &qtypes[t];
        int64_t bad = -1;
        for (int round = 0; round < 16 && bad < 0; round++) {
            random_blocks(q, buf, NB);
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
    struct kvr_tensor * out = kvr_attn(ctx, q, k, v, qp, kp, NULL, 0.5f, 0.0f, window, (enum kvr_attn_mode)mode);
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
// 3. the one-token matmul kernel
//

// kvr_dequant8 (a GPU lane's 8 elements) against kvr_dequant_block, bit for bit, every type, and
// nvcc's host build of it against the C compiler's (through the blocks it must equal)
static void test_dequant8(void) {
    enum { NB = 48 };
    static uint8_t buf[NB * 292 + 1];
    static float a[NB * 256], b[8];
    for (size_t t = 0; t < sizeof(qtypes) / sizeof(qtypes[0]); t++) {
        const struct qt * q = &qtypes[t];
        int64_t bad = -1;
        for (int round = 0; round < 8 && bad < 0; round++) {
            random_blocks(q, buf, NB);
            const int odd = round % 2;
            if (odd) memmove(buf + 1, buf, (size_t)NB * q->size);
            for (int64_t k = 0; k < NB; k++) hd_c_dequant_block(q->type, buf + odd, k, a + k * q->blck);
            for (int64_t g = 0; g < (int64_t)NB * q->blck / 8 && bad < 0; g++) {
                kvr_dequant8(q->type, buf + odd, g, b);
                for (int j = 0; j < 8; j++) {
                    if (!same(a[8 * g + j], b[j]) && !(isnan(b[j]) && isnan(a[8 * g + j]))) bad = 8 * g + j;
                }
            }
        }
        CHECK(bad < 0, "kvr_dequant8(%s) differs from kvr_dequant_block at element %lld", kvr_type_name(q->type), (long long)bad);
    }
}

// The one-token matmul kernel's warp emulated on the host (kvr_cuda_dot8_emulate) against the CPU
// backend's MUL_MAT of the same weights (every type) and 1..8 tokens: the same products summed in
// another order, so they agree to f32 rounding of the sum of |w x|.
static void test_dot8(void) {
    int n_wide = 0;
    for (size_t t = 0; t < sizeof(qtypes) / sizeof(qtypes[0]); t++) {
        const struct qt * q = &qtypes[t];
        const int64_t Ks[] = { q->blck == 1 ? 77 : q->blck, q->blck == 1 ? 2048 : 8 * q->blck > 2048 ? 2048 : 8 * q->blck };
        for (int ki = 0; ki < 2; ki++) {
            const int64_t K = Ks[ki], N = 3;
            for (int T = 1; T <= 8; T += (T < 3 ? 1 : 5)) {
                struct kvr_context * ctx = kvr_init(64u << 20, false);
                KVR_ASSERT(ctx != NULL);
                struct kvr_tensor * w = kvr_new_tensor_2d(ctx, q->type, K, N);
                struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
                random_blocks(q, (uint8_t *)w->data, (int)(N * K / q->blck));
                float * xs = (float *)x->data;
                for (int64_t i = 0; i < K * T; i++) xs[i] = rng_f(-2.0f, 2.0f);
                struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
                struct kvr_graph * g = kvr_graph_new(ctx, 16);
                kvr_graph_expand(g, y);
                const int rc = kvr_graph_compute_cpu(g, 1);
                double worst = 0.0;
                bool finite = rc == KVR_OK;
                for (int64_t n = 0; n < N && finite; n++) {
                    const char * row = (const char *)w->data + n * (int64_t)w->nb[1];
                    float got[8], wide[8];
                    kvr_cuda_dot8_emulate(q->type, row, K, xs, K, T, false, got);
                    // the wide loads of the aligned rows give the same bits
                    const bool can_wide = (q->type == KVR_TYPE_F16 || q->type == KVR_TYPE_BF16 || q->type == KVR_TYPE_Q4_K) &&
                                          (uintptr_t)row % 16 == 0;
                    if (can_wide) {
                        kvr_cuda_dot8_emulate(q->type, row, K, xs, K, T, true, wide);
                        for (int tt = 0; tt < T; tt++) finite = finite && same(wide[tt], got[tt]);
                        n_wide++;
                    }
                    for (int tt = 0; tt < T; tt++) {
                        double mag = 0.0; // the scale of the sum's rounding: sum |w x|
                        for (int64_t e = 0; e < K; e++) {
                            float v[256];
                            kvr_dequant_block(q->type, row, e / q->blck, v);
                            mag += fabs((double)v[e % q->blck] * xs[tt * K + e]);
                        }
                        const float cpu = ((const float *)y->data)[tt * N + n];
                        finite = finite && isfinite(got[tt]) && isfinite(cpu);
                        const double err = fabs((double)got[tt] - cpu) / (mag > 0 ? mag : 1.0);
                        worst = err > worst ? err : worst;
                    }
                }
                CHECK(finite && worst < 4e-6, "k_dot8 emulated, %s, K %lld, %d tokens: worst |kernel - cpu| / sum|w x| %.2e%s",
                      kvr_type_name(q->type), (long long)K, T, worst, finite ? "" : " (a value is not finite, or wide loads differ)");
                kvr_free(ctx);
            }
        }
    }
    CHECK(n_wide >= 30, "k_dot8's wide weight loads were emulated on %d rows only", n_wide);
}

//
// 4. the tensor-core attention kernel (k_fattn): its schedule and its algorithm
//

// Query and key positions of one shape: a rank's slice of a sequence of `cached` cached tokens
// and T new ones. slice 0: the whole prompt after the cache (one rank, KV-Runahead's chain link);
// slice 1 and 2: the zig-zag shards of 2 ranks (ring strategies: chunks r and 3 - r of 4), every
// key of the sequence visible to the causal rule; slice 3: decode (T = 1).
static int fa_positions(int slice, int cached, int T, int32_t * qpos, int32_t * kpos, int * Tq, int * Tk) {
    const int S = cached + T;
    *Tk = S;
    for (int j = 0; j < S; j++) kpos[j] = j;
    if (slice == 0 || slice == 3) {
        const int n = slice == 3 ? 1 : T;
        for (int i = 0; i < n; i++) qpos[i] = S - n + i;
        *Tq = n;
        return 1;
    }
    const int r = slice - 1, m = T / 4;
    if (m == 0) return 0;
    int n = 0;
    for (int i = 0; i < m; i++) qpos[n++] = cached + r * m + i;
    for (int i = 0; i < m; i++) qpos[n++] = cached + (3 - r) * m + i;
    *Tq = n;
    return 1;
}

// The pairs the kernel's schedule computes (grid, skipped tiles, masks) are exactly the visible
// ones, each once, for every query head, over prompt length, cached length, window, head dim (its
// key tile), GQA group and rank slice; and their count per token is the CPU kernel's counter of
// the pairs causality needs.
static void test_fattn_schedule(void) {
    enum { TMAX = 130, SMAX = 330, HMAX = 8 };
    static int32_t qpos[TMAX], kpos[SMAX], cover[HMAX * TMAX * SMAX];
    const int Ts[] = { 1, 17, 64, 65, 130 }, caches[] = { 0, 31, 200 }, windows[] = { 0, 1, 9, 64, 1000 };
    const int heads[][2] = { { 4, 4 }, { 8, 2 }, { 6, 1 } }, dims[] = { 64, 256 };
    int cases = 0, bad = 0, bad_cpu = 0;
    char what[160] = "";
    for (int ti = 0; ti < 5; ti++) for (int ci = 0; ci < 3; ci++) for (int wi = 0; wi < 5; wi++)
    for (int hi = 0; hi < 3; hi++) for (int di = 0; di < 2; di++) for (int slice = 0; slice < 4; slice++) {
        int Tq, Tk;
        if (!fa_positions(slice, caches[ci], Ts[ti], qpos, kpos, &Tq, &Tk)) continue;
        const int H = heads[hi][0], Hkv = heads[hi][1], win = windows[wi];
        kvr_cuda_fattn_pairs(dims[di], qpos, kpos, H, Hkv, Tq, Tk, KVR_ATTN_CAUSAL, win, cover);
        cases++;
        int64_t visible_h0 = 0;
        bool ok = true;
        for (int h = 0; h < H && ok; h++) {
            for (int i = 0; i < Tq && ok; i++) {
                for (int j = 0; j < Tk && ok; j++) {
                    const int want = kvr_attn_visible(qpos[i], kpos[j], win) ? 1 : 0;
                    ok = cover[((int64_t)h * Tq + i) * Tk + j] == want;
                    if (h == 0) visible_h0 += want;
                }
            }
        }
        if (!ok && bad++ == 0) snprintf(what, sizeof(what), "T %d, cached %d, window %d, %d/%d heads, D %d, slice %d", Ts[ti], caches[ci],
                                          win, H, Hkv, dims[di], slice);
        // the CPU kernel's counter on the same positions (a subset: it runs a graph each)
        if (di == 0 && hi == 1 && wi % 2 == 0) {
            int64_t dense = 0, causal = 0;
            if (!cpu_attn_counts(qpos, Tq, kpos, Tk, H, Hkv, KVR_ATTN_CAUSAL, win, &dense, &causal) || causal != visible_h0) bad_cpu++;
        }
    }
    CHECK(cases > 500 && bad == 0, "k_fattn's schedule: %d of %d shapes cover a pair wrongly (first: %s)", bad, cases, what);
    CHECK(bad_cpu == 0, "k_fattn's visible pairs differ from the CPU kernel's counter in %d shapes", bad_cpu);
}

// The kernel's algorithm emulated on the host against the CPU's ATTN on the same F16 keys and
// values: every head dim, GQA and MQA, prompt, zig-zag slice and decode, with and without a window,
// causal and dense. F16 queries and probabilities move the output by ~1e-3 of the values' scale.
static void test_fattn_emulated(void) {
    const int dims[] = { 64, 80, 96, 128, 256 };
    const int heads[][2] = { { 4, 2 }, { 4, 1 }, { 2, 2 } };
    int cases = 0, bad = 0;
    double worst_o = 0.0, worst_l = 0.0;
    char what[160] = "";
    for (int di = 0; di < 5; di++) for (int hi = 0; hi < 3; hi++) for (int slice = 0; slice < 4; slice++)
    for (int wi = 0; wi < 2; wi++) for (int dense = 0; dense < 2; dense++) {
        if (dense && (slice != 0 || wi != 0)) continue;
        const int D = dims[di], H = heads[hi][0], Hkv = heads[hi][1], win = wi ? 24 : 0;
        const int cached = 37, T = slice == 3 ? 1 : 70;
        int32_t qpos[128], kpos[160];
        int Tq, Tk;
        if (!fa_positions(slice, cached, T, qpos, kpos, &Tq, &Tk)) continue;
        struct kvr_context * ctx = kvr_init((size_t)64 << 20, false);
        KVR_ASSERT(ctx != NULL);
        struct kvr_tensor * q  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, H, Tq);
        struct kvr_tensor * k  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
        struct kvr_tensor * v  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
        struct kvr_tensor * qp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tq);
        struct kvr_tensor * kp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tk);
        uint16_t * k16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(D * Hkv * Tk));
        uint16_t * v16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(D * Hkv * Tk));
        float * emu = (float *)malloc(sizeof(float) * (size_t)((H * D + H) * Tq));
        KVR_ASSERT(k16 && v16 && emu);
        for (int64_t i = 0; i < kvr_nelements(q); i++) ((float *)q->data)[i] = rng_f(-2, 2);
        for (int64_t i = 0; i < kvr_nelements(k); i++) { // F16 keys and values: what the cache holds
            k16[i] = kvr_f32_to_half(rng_f(-2, 2));
            v16[i] = kvr_f32_to_half(rng_f(-1, 1));
            ((float *)k->data)[i] = kvr_half_to_f32(k16[i]);
            ((float *)v->data)[i] = kvr_half_to_f32(v16[i]);
        }
        memcpy(qp->data, qpos, sizeof(int32_t) * (size_t)Tq);
        memcpy(kp->data, kpos, sizeof(int32_t) * (size_t)Tk);
        const float scale = 1.0f / sqrtf((float)D);
        const int mode = dense ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL;
        struct kvr_tensor * out = kvr_attn(ctx, q, k, v, qp, kp, NULL, scale, 0.0f, win, (enum kvr_attn_mode)mode);
        struct kvr_graph * g = kvr_graph_new(ctx, 16);
        kvr_graph_expand(g, out);
        const bool ran = kvr_graph_compute_cpu(g, 1) == KVR_OK;
        kvr_cuda_fattn_emulate(D, (const float *)q->data, k16, v16, qpos, kpos, H, Hkv, Tq, Tk, mode, win, scale, emu);
        bool ok = ran;
        for (int i = 0; i < Tq && ok; i++) {
            const float * c = (const float *)((const char *)out->data + (size_t)i * out->nb[1]);
            const float * e = emu + (size_t)i * (size_t)(H * D + H);
            for (int x = 0; x < H * D + H; x++) {
                const bool lse = x >= H * D;
                if (isinf(c[x]) || isinf(e[x])) { ok = ok && c[x] == e[x]; continue; }
                const double d = fabs((double)c[x] - e[x]);
                if (lse) worst_l = d > worst_l ? d : worst_l; else worst_o = d > worst_o ? d : worst_o;
                ok = ok && !isnan(e[x]) && d <= 2e-3;
            }
        }
        cases++;
        if (!ok && bad++ == 0) snprintf(what, sizeof(what), "D %d, %d/%d heads, slice %d, window %d, %s%s", D, H, Hkv, slice, win,
                                          dense ? "dense" : "causal", ran ? "" : " (the CPU's ATTN failed)");
        free(k16); free(v16); free(emu);
        kvr_free(ctx);
    }
    CHECK(cases >= 60 && bad == 0, "k_fattn emulated against the CPU's ATTN: %d of %d shapes off (first: %s); worst |O| %.2e, |LSE| %.2e",
          bad, cases, what, worst_o, worst_l);
    printf("k_fattn emulated: %d shapes, worst |O - cpu| %.2e, |LSE - cpu| %.2e\n", cases, worst_o, worst_l);
}

// Flash-decoding's splits: every key in exactly one split, in order, each split but the last a
// whole number of 32-key sub-tiles.
static void test_fdec_splits(void) {
    int bad = 0, cases = 0;
    for (int64_t Tk = 1; Tk < 5000; Tk += 1 + Tk / 7) {
        for (int n = 2; n <= 64; n++) {
            int64_t next = 0;
            bool ok = true;
            for (int s = 0; s < n; s++) {
                int64_t j0, j1;
                kvr_cuda_fdec_split(Tk, n, s, &j0, &j1);
                ok = ok && j0 == next && j1 >= j0 && (j1 == Tk || (j1 - j0) % 32 == 0);
                next = j1;
            }
            ok = ok && next == Tk;
            cases++;
            bad += !ok;
        }
    }
    CHECK(bad == 0, "flash-decoding's splits: %d of %d (keys, splits) do not partition the keys", bad, cases);
}

// Flash-decoding emulated (the splits' partial outputs and their LSE merge) against the CPU's ATTN
// on F16 keys and values: one and two tokens, GQA and MQA, every head dim, with and without a
// window, cached lengths that give 2 to 17 splits.
static void test_fdec_emulated(void) {
    const int dims[] = { 64, 80, 96, 128, 256 }, Tks[] = { 600, 1000, 4100 };
    const int heads[][2] = { { 8, 2 }, { 4, 4 }, { 16, 1 } };
    int cases = 0, bad = 0, most = 0;
    double worst = 0.0;
    char what[160] = "";
    for (int di = 0; di < 5; di++) for (int ti = 0; ti < 3; ti++) for (int hi = 0; hi < 3; hi++)
    for (int Tq = 1; Tq <= 2; Tq++) for (int wi = 0; wi < 2; wi++) {
        if (ti == 2 && di != 3 && di != 4) continue; // the longest cache at two head dims
        const int D = dims[di], H = heads[hi][0], Hkv = heads[hi][1], Tk = Tks[ti], win = wi ? 300 : 0;
        int32_t qpos[2], * kpos = (int32_t *)malloc(sizeof(int32_t) * (size_t)Tk);
        KVR_ASSERT(kpos != NULL);
        for (int j = 0; j < Tk; j++) kpos[j] = j;
        for (int i = 0; i < Tq; i++) qpos[i] = Tk - Tq + i;
        struct kvr_context * ctx = kvr_init((size_t)160 << 20, false);
        KVR_ASSERT(ctx != NULL);
        struct kvr_tensor * q  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, H, Tq);
        struct kvr_tensor * k  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
        struct kvr_tensor * v  = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
        struct kvr_tensor * qp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tq);
        struct kvr_tensor * kp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tk);
        uint16_t * k16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(D * Hkv * Tk));
        uint16_t * v16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(D * Hkv * Tk));
        float * emu = (float *)malloc(sizeof(float) * (size_t)((H * D + H) * Tq));
        KVR_ASSERT(k16 && v16 && emu);
        for (int64_t i = 0; i < kvr_nelements(q); i++) ((float *)q->data)[i] = rng_f(-2, 2);
        for (int64_t i = 0; i < kvr_nelements(k); i++) {
            k16[i] = kvr_f32_to_half(rng_f(-2, 2));
            v16[i] = kvr_f32_to_half(rng_f(-1, 1));
            ((float *)k->data)[i] = kvr_half_to_f32(k16[i]);
            ((float *)v->data)[i] = kvr_half_to_f32(v16[i]);
        }
        memcpy(qp->data, qpos, sizeof(int32_t) * (size_t)Tq);
        memcpy(kp->data, kpos, sizeof(int32_t) * (size_t)Tk);
        const float scale = 1.0f / sqrtf((float)D);
        struct kvr_tensor * out = kvr_attn(ctx, q, k, v, qp, kp, NULL, scale, 0.0f, win, KVR_ATTN_CAUSAL);
        struct kvr_graph * g = kvr_graph_new(ctx, 16);
        kvr_graph_expand(g, out);
        bool ok = kvr_graph_compute_cpu(g, 1) == KVR_OK;
        const int n = kvr_cuda_fdec_emulate(D, (const float *)q->data, k16, v16, qpos, kpos, H, Hkv, Tq, Tk, win, scale, emu);
        // the kernel takes up to 16 rows (tokens x the group's heads); more go to k_fattn
        const bool taken = Tq * (H / Hkv) <= 16;
        ok = ok && (taken ? n >= 2 : n == 0);
        most = n > most ? n : most;
        for (int i = 0; i < Tq && ok && taken; i++) {
            const float * c = (const float *)((const char *)out->data + (size_t)i * out->nb[1]);
            const float * e = emu + (size_t)i * (size_t)(H * D + H);
            for (int x = 0; x < H * D + H; x++) {
                const double d = fabs((double)c[x] - e[x]);
                worst = d > worst ? d : worst;
                ok = ok && isfinite(e[x]) && d <= 1e-4;
            }
        }
        cases++;
        if (!ok && bad++ == 0) snprintf(what, sizeof(what), "D %d, %d keys, %d/%d heads, %d tokens, window %d: %d splits", D, Tk, H, Hkv,
                                          Tq, win, n);
        free(kpos); free(k16); free(v16); free(emu);
        kvr_free(ctx);
    }
    CHECK(cases >= 100 && bad == 0 && most >= 16, "flash-decoding emulated against the CPU's ATTN: %d of %d shapes off (first: %s); "
          "worst %.2e, most splits %d", bad, cases, what, worst, most);
    printf("flash-decoding emulated: %d shapes, up to %d splits, worst |out - cpu| %.2e\n", cases, most, worst);
}

//
// 5. no device: a clear error, quickly
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

// A prompt's MUL_MAT_ID on the GPU groups its slots by expert on the host (kvr_cuda_moe_group) and
// gathers, multiplies and scatters with k_moe_gather / k_moe_scatter's index arithmetic: the order is
// a stable sort of the slots by expert, bad ids are refused, and the grouped product emulated on the
// host equals the CPU's MUL_MAT_ID for x shared by a token's experts and x per slot, with a bias.
static void test_moe_grouped(void) {
    const int64_t K = 40, N = 24, E = 6, k = 2;
    for (int per_slot = 0; per_slot < 2; per_slot++) {
        for (int64_t T = 1; T <= 33; T += 16) {
            struct kvr_context * ctx = kvr_init(16u << 20, false);
            KVR_ASSERT(ctx != NULL);
            struct kvr_tensor * w = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, K, N, E);
            struct kvr_tensor * x = per_slot ? kvr_new_tensor_3d(ctx, KVR_TYPE_F32, K, k, T) : kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
            struct kvr_tensor * route = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, 2 * k, T);
            struct kvr_tensor * b = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, N, E);
            for (int64_t i = 0; i < K * N * E; i++) ((float *)w->data)[i] = rng_f(-1.0f, 1.0f);
            for (int64_t i = 0; i < kvr_nelements(x); i++) ((float *)x->data)[i] = rng_f(-1.0f, 1.0f);
            for (int64_t i = 0; i < N * E; i++) ((float *)b->data)[i] = rng_f(-1.0f, 1.0f);
            float * rt = (float *)route->data;
            for (int64_t t = 0; t < T; t++) { // k distinct experts a token, expert 5 never picked
                const int64_t e0 = (t * 7 + 3) % (E - 1), e1 = (e0 + 1 + t % (E - 2)) % (E - 1);
                rt[t * 2 * k + 0] = 0.6f; rt[t * 2 * k + 1] = 0.4f;
                rt[t * 2 * k + 2] = (float)e0; rt[t * 2 * k + 3] = (float)e1;
            }
            struct kvr_tensor * y = kvr_mul_mat_id(ctx, w, x, route, b);
            struct kvr_graph * g = kvr_graph_new(ctx, 16);
            kvr_graph_expand(g, y);
            const int rc = kvr_graph_compute_cpu(g, 1);
            int32_t order[2 * 33], expert[2 * 33];
            int64_t offsets[7];
            bool sorted = kvr_cuda_moe_group(rt, 2 * k, T, k, E, order, expert, offsets) == KVR_OK && offsets[0] == 0 &&
                          offsets[E] == k * T && offsets[E] == offsets[E - 1]; // expert 5: an empty run
            bool seen[2 * 33] = { false };
            for (int64_t r = 0; r < k * T && sorted; r++) {
                const int64_t s = order[r];
                sorted = s >= 0 && s < k * T && !seen[s] && rt[(s / k) * 2 * k + k + s % k] == (float)expert[r] &&
                         r >= offsets[expert[r]] && r < offsets[expert[r] + 1] &&
                         (r == 0 || expert[r - 1] < expert[r] || (expert[r - 1] == expert[r] && order[r - 1] < s));
                if (sorted) seen[s] = true;
            }
            CHECK(sorted, "kvr_cuda_moe_group, T %lld: not a stable sort of the slots by expert", (long long)T);
            float got[2 * 33 * 24];
            const int erc = kvr_cuda_moe_grouped_emulate((const float *)w->data, K, N, E, (const float *)x->data, x->ne, (const int64_t *)x->nb,
                                                         rt, k, T, (const float *)b->data, got);
            double worst = 0.0;
            for (int64_t i = 0; i < N * k * T; i++) {
                const double d = fabs((double)got[i] - ((const float *)y->data)[i]);
                worst = d > worst ? d : worst;
            }
            CHECK(rc == KVR_OK && erc == KVR_OK && worst < 1e-5,
                  "grouped MUL_MAT_ID emulated, x %s, T %lld: worst |grouped - cpu| %.2e", per_slot ? "per slot" : "shared",
                  (long long)T, worst);
            kvr_free(ctx);
        }
    }
    float bad[4] = { 1.0f, 0.0f, 2.0f, 6.0f }; // the second id names a 7th expert of 6
    int32_t order[2], expert[2];
    int64_t offsets[7];
    CHECK(kvr_cuda_moe_group(bad, 4, 1, 2, 6, order, expert, offsets) == KVR_ERR_ARG && strstr(kvr_last_error(), "not one of 6"),
          "kvr_cuda_moe_group accepted an expert id outside the experts: %s", kvr_last_error());
    bad[3] = 2.5f;
    CHECK(kvr_cuda_moe_group(bad, 4, 1, 2, 6, order, expert, offsets) == KVR_ERR_ARG,
          "kvr_cuda_moe_group accepted a fractional expert id");
}

int main(int argc, char ** argv) {
    (void)argc;
    (void)argv;
    test_kv_types();
    test_halves();
    test_dequant();
    test_dequant8();
    test_dot8();
    test_moe_grouped();
    test_rope();
    test_softmax();
    test_tile_rule();
    test_tiles();
    test_fattn_schedule();
    test_fattn_emulated();
    test_fdec_splits();
    test_fdec_emulated();
    test_no_device();
    return check_summary("cuda-host");
}
