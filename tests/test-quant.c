// test-quant.c - the quantized block types (Q4_0 ... Q8_K) against an independent reference.
//
// For every quantized type: blocks of seeded random bytes with sane half-precision scales are
// dequantized through kvr_to_float and compared, exactly, with a reference written here in another
// way (each element's bits are picked out of the block by its index, scales decoded by hand); a row
// of such blocks dotted with a random vector, and the same row multiplied through a kvr_mul_mat
// graph, must match the reference within 1e-4 relative. The quantizers (kvr_from_float) must
// round-trip within each format's error bound. On the llama.cpp-made tiny-llama files of
// ../shared/reference, every quantized tensor must agree with the Q8_0 file's copy of the same
// weights within the format's error, and the Q4_0/Q5_0/Q8_0/Q4_K blocks must requantize to
// llama.cpp's bytes (its reference quantizers are stable on their own output).
// Every quantized matmul is also run by the CPU's fast paths and by its plain reference kernels
// (kvr_backend_params.ref_kernels), exact and with 8-bit activations, and the two compared; under
// KVR_REF=1 (every CPU backend on the reference kernels) that comparison is skipped.
//
//   test-quant [SHARED]      (default ../shared; without the files those checks count as skipped)
//
// The dequantization of one block is kvr.h's internal KVR_HD function (kvr_dequant_block, what the
// CUDA kernels call; KVR_BUILD opens that section here): every block is checked through it too,
// and the fp16/bf16 conversions of that section against the reference on all 65536 halves.
//
// Build with -DQUANT_STANDALONE (and the parts directory on the include path) to test the
// quantization fragment alone, before kvr.c links it: the graph and GGUF checks are then left out.

#define KVR_BUILD // kvr.h's internal section: the per-block functions the CPU and GPU paths share
#include "kvr.h"
#include "tests/check.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h> // _mm_getcsr / _mm_setcsr: the denormals-are-zero case of test_mul_vec
#endif

#ifdef QUANT_STANDALONE
#include "quant.c"

// Stand-ins for the few kvr.c functions the fragment and this test call.
float kvr_fp16_to_fp32(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? ldexpf((float)m, -24) : e < 31 ? ldexpf((float)(1024 + m), e - 25)
                  : m ? NAN : INFINITY;
    return (h & 0x8000) ? -v : v;
}
uint16_t kvr_fp32_to_fp16(float f) { // round to nearest even, through double (exact for floats)
    const uint16_t s = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (isnan(f)) return s | 0x7e00;
    if (a >= 65520.0) return s | 0x7c00;
    int e;
    frexp(a, &e);                          // a = r * 2^e, r in [0.5, 1)
    int ex = e - 1 < -14 ? -14 : e - 1;    // exponent of the half, subnormals share -14
    double q = nearbyint(ldexp(a, 10 - ex)); // mantissa with 10 fraction bits, ties to even
    if (q >= 2048) { q /= 2; ex++; }
    if (q < 1024) return (uint16_t)(s | (uint16_t)q);              // subnormal (or zero)
    return (uint16_t)(s | (uint16_t)((ex + 15) << 10) | (uint16_t)((int)q - 1024));
}
int64_t kvr_blck_size(enum kvr_type t) { const struct quant_traits * q = quant_get(t); return q ? q->blck_size : 0; }
size_t  kvr_type_size(enum kvr_type t) { const struct quant_traits * q = quant_get(t); return q ? q->type_size : 0; }
void kvr_to_float(enum kvr_type t, const void * src, float * dst, int64_t n) {
    quant_to_float_fn(t)(src, dst, n);
}
size_t kvr_from_float(enum kvr_type t, const float * src, void * dst, int64_t n) {
    size_t (*f)(const float *, void *, int64_t) = quant_from_float_fn(t);
    return f ? f(src, dst, n) : 0;
}
#endif

// splitmix64: small, seeded, the same on every machine
static uint64_t rng_state;
static uint64_t rng_u64(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(void) { return (float)(rng_u64() >> 40) / (float)(1 << 24) * 2.0f - 1.0f; } // [-1, 1)
static float rng_normal(void) { // Irwin-Hall: mean 0, variance 1
    float s = 0;
    for (int i = 0; i < 12; i++) s += (rng_uniform() + 1.0f) * 0.5f;
    return s - 6.0f;
}

//
// the reference: element e of a block, read bit by bit from the byte layout
//

// n bits (n <= 32) of the little-endian bit stream p, starting at bit pos
static uint32_t bits(const uint8_t * p, int pos, int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; k++) {
        v |= (uint32_t)((p[(pos + k) / 8] >> ((pos + k) % 8)) & 1) << k;
    }
    return v;
}
static int sbits8(const uint8_t * p, int byte) { // an int8 at a byte offset
    const int v = (int)bits(p, 8*byte, 8);
    return v >= 128 ? v - 256 : v;
}
static float ref_half(const uint8_t * p) {      // IEEE binary16, decoded from its fields
    const int m = (int)bits(p, 0, 10), e = (int)bits(p, 10, 5), s = (int)bits(p, 15, 1);
    float v;
    if (e == 0)       v = ldexpf((float)m, -24);
    else if (e < 31)  v = ldexpf((float)(m + 1024), e - 25);
    else              v = m ? NAN : INFINITY;
    return s ? -v : v;
}
// nibble or 2-bit field number `which` of byte `byte`
static int field(const uint8_t * p, int byte, int which, int width) {
    return (int)bits(p, 8*byte + width*which, width);
}

static float ref_q4_0(const uint8_t * b, int e) {
    const int q = field(b, 2 + e%16, e/16, 4);
    return (float)(q - 8) * ref_half(b);
}
static float ref_q4_1(const uint8_t * b, int e) {
    const int q = field(b, 4 + e%16, e/16, 4);
    return (float)q * ref_half(b) + ref_half(b + 2);
}
static float ref_q5_0(const uint8_t * b, int e) {
    const int q = field(b, 6 + e%16, e/16, 4) + 16*(int)bits(b, 16 + e, 1);
    return (float)(q - 16) * ref_half(b);
}
static float ref_q5_1(const uint8_t * b, int e) {
    const int q = field(b, 8 + e%16, e/16, 4) + 16*(int)bits(b, 32 + e, 1);
    return (float)q * ref_half(b) + ref_half(b + 2);
}
static float ref_q8_0(const uint8_t * b, int e) { return (float)sbits8(b, 2 + e) * ref_half(b); }
static float ref_q8_1(const uint8_t * b, int e) { return (float)sbits8(b, 4 + e) * ref_half(b); }

// Q2_K/Q3_K 2-bit planes: element e is in 128-half e/128, byte e%32 of that half, plane (e%128)/32
static int plane2(const uint8_t * b, int qs_off, int e) {
    return field(b, qs_off + (e/128)*32 + e%32, (e%128)/32, 2);
}
static float ref_q2_K(const uint8_t * b, int e) {
    const float dl = ref_half(b + 80) * (float)field(b, e/16, 0, 4);
    const float ml = ref_half(b + 82) * (float)field(b, e/16, 1, 4);
    return dl * (float)plane2(b, 16, e) - ml;
}
static float ref_q3_K(const uint8_t * b, int e) {
    const int j   = e/16;
    const int sc  = field(b, 96 + j%8, j/8, 4) | field(b, 104 + j%4, j/4, 2) << 4;
    const int q   = plane2(b, 32, e) + 4*(int)bits(b, 8*(e%32) + e/32, 1) - 4;
    const float dl = ref_half(b + 108) * (float)(sc - 32);
    return dl * (float)q;
}
// Q4_K/Q5_K: scale and min of sub-block j from the 12 bytes at offset 4
static void ref_k4(const uint8_t * b, int j, int * sc, int * m) {
    const uint8_t * s = b + 4;
    if (j < 4) {
        *sc = (int)bits(s, 8*j, 6);
        *m  = (int)bits(s, 8*(j + 4), 6);
    } else {
        *sc = (int)(bits(s, 8*(j + 4), 4)     | bits(s, 8*(j - 4) + 6, 2) << 4);
        *m  = (int)(bits(s, 8*(j + 4) + 4, 4) | bits(s, 8*j + 6, 2) << 4);
    }
}
static float ref_q4_K(const uint8_t * b, int e) {
    int sc, m;
    ref_k4(b, e/32, &sc, &m);
    const int q = field(b, 16 + (e/64)*32 + e%32, (e/32)%2, 4);
    const float dl = ref_half(b) * (float)sc, ml = ref_half(b + 2) * (float)m;
    return dl * (float)q - ml;
}
static float ref_q5_K(const uint8_t * b, int e) {
    int sc, m;
    ref_k4(b, e/32, &sc, &m);
    const int q = field(b, 48 + (e/64)*32 + e%32, (e/32)%2, 4) + 16*(int)bits(b, 8*(16 + e%32) + e/32, 1);
    const float dl = ref_half(b) * (float)sc, ml = ref_half(b + 2) * (float)m;
    return dl * (float)q - ml;
}
static float ref_q6_K(const uint8_t * b, int e) {
    const int h = e/128, k = (e%128)/32, l = e%32;
    const int q = field(b, h*64 + (k%2)*32 + l, k/2, 4) | field(b, 128 + h*32 + l, k, 2) << 4;
    const float ds = ref_half(b + 208) * (float)sbits8(b, 192 + e/16);
    return ds * (float)(q - 32);
}
static float ref_q8_K(const uint8_t * b, int e) {
    const uint32_t u = bits(b, 0, 32);
    float d;
    memcpy(&d, &u, 4);
    return d * (float)sbits8(b, 4 + e);
}

// MXFP4: byte 0 the E8M0 exponent e, element j of 0..15 the low nibble of byte 1+j and element
// j+16 its high nibble, a 4-bit E2M1 code (sign in bit 3) whose value ggml keeps doubled; x =
// value * 2^(e-128); the values are integers, so code 8 is +0 as in ggml's table
static float ref_mxfp4(const uint8_t * b, int e) {
    static const int doubled_e2m1[8] = { 0, 1, 2, 3, 4, 6, 8, 12 };
    const int code = field(b, 1 + e%16, e/16, 4);
    const int v = doubled_e2m1[code & 7];
    return ldexpf((float)(code & 8 ? -v : v), (int)b[0] - 128);
}

struct qtype {
    enum kvr_type type;
    const char *  name;
    int           blck, size;       // elements and bytes per block
    int           half[2], n_half;  // byte offsets of the fp16 scales
    int           f32;              // byte offset of an f32 scale, or -1
    float       (*ref)(const uint8_t * b, int e);
    double        rt_rms;           // round-trip: max relative RMS error of a quantizer, 0 if none
};

static const struct qtype qtypes[] = {
    { KVR_TYPE_Q4_0, "q4_0",  32,  18, { 0,   0 }, 1, -1, ref_q4_0, 0.12 },
    { KVR_TYPE_Q4_1, "q4_1",  32,  20, { 0,   2 }, 2, -1, ref_q4_1, 0.12 },
    { KVR_TYPE_Q5_0, "q5_0",  32,  22, { 0,   0 }, 1, -1, ref_q5_0, 0.06 },
    { KVR_TYPE_Q5_1, "q5_1",  32,  24, { 0,   2 }, 2, -1, ref_q5_1, 0.06 },
    { KVR_TYPE_Q8_0, "q8_0",  32,  34, { 0,   0 }, 1, -1, ref_q8_0, 0.01 },
    { KVR_TYPE_Q8_1, "q8_1",  32,  36, { 0,   2 }, 2, -1, ref_q8_1, 0    },
    { KVR_TYPE_Q2_K, "q2_K", 256,  84, { 80, 82 }, 2, -1, ref_q2_K, 0    },
    { KVR_TYPE_Q3_K, "q3_K", 256, 110, { 108, 0 }, 1, -1, ref_q3_K, 0    },
    { KVR_TYPE_Q4_K, "q4_K", 256, 144, { 0,   2 }, 2, -1, ref_q4_K, 0.11 },
    { KVR_TYPE_Q5_K, "q5_K", 256, 176, { 0,   2 }, 2, -1, ref_q5_K, 0.06 },
    { KVR_TYPE_Q6_K, "q6_K", 256, 210, { 208, 0 }, 1, -1, ref_q6_K, 0.03 },
    { KVR_TYPE_Q8_K, "q8_K", 256, 292, { 0,   0 }, 0,  0, ref_q8_K, 0    },
};
// MXFP4 has its own checks (test_mxfp4): the generic integer references above do not know its codes
static const struct qtype qtype_mxfp4 = { KVR_TYPE_MXFP4, "mxfp4", 32, 17, { 0, 0 }, 0, -1, ref_mxfp4, 0 };
#define N_QTYPES ((int)(sizeof qtypes / sizeof qtypes[0]))

// Random blocks: random bytes, then scales replaced by finite values of a sane range (half
// exponents 0..18, so subnormal scales are covered too).
static void random_blocks(const struct qtype * qt, uint8_t * buf, int nblocks) {
    for (int i = 0; i < nblocks * qt->size; i++) {
        buf[i] = (uint8_t)rng_u64();
    }
    for (int i = 0; i < nblocks; i++) {
        uint8_t * b = buf + (size_t)i * qt->size;
        for (int k = 0; k < qt->n_half; k++) {
            const uint16_t h = (uint16_t)((rng_u64() & 0x8000) | ((rng_u64() % 19) << 10) | (rng_u64() & 0x3ff));
            b[qt->half[k]]     = (uint8_t)(h & 0xff);
            b[qt->half[k] + 1] = (uint8_t)(h >> 8);
        }
        if (qt->f32 >= 0) {
            const float d = rng_uniform() * 0.01f;
            memcpy(b + qt->f32, &d, 4);
        }
        if (qt->type == KVR_TYPE_MXFP4) { // exponents around 2^0, and 0 and 1 (subnormal scales) now and then
            const uint64_t r = rng_u64();
            b[0] = (uint8_t)(r % 8 == 0 ? r / 8 % 2 : 108 + r / 8 % 32);
        }
    }
}

static void ref_row(const struct qtype * qt, const uint8_t * buf, float * out, int64_t n) {
    for (int64_t e = 0; e < n; e++) {
        out[e] = qt->ref(buf + (e / qt->blck) * qt->size, (int)(e % qt->blck));
    }
}

static int same_float(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

// exact dequantization of random blocks, at an aligned and at an odd address
static void test_dequant(const struct qtype * qt) {
    enum { NB = 16 };
    const int64_t n = (int64_t)NB * qt->blck;
    uint8_t * buf  = malloc((size_t)NB * qt->size + 1);
    float   * got  = malloc(sizeof(float) * (size_t)n);
    float   * want = malloc(sizeof(float) * (size_t)n);
    for (int round = 0; round < 24; round++) {
        random_blocks(qt, buf, NB);
        ref_row(qt, buf, want, n);
        for (int odd = 0; odd < 2; odd++) {
            if (odd) {
                memmove(buf + 1, buf, (size_t)NB * qt->size);
            }
            memset(got, 0xff, sizeof(float) * (size_t)n);
            kvr_to_float(qt->type, buf + odd, got, n);
            int64_t bad = -1;
            for (int64_t e = 0; e < n && bad < 0; e++) {
                if (!same_float(got[e], want[e])) bad = e;
            }
            CHECK(bad < 0, "%s dequant round %d%s: element %lld is %.9g, reference %.9g", qt->name, round,
                  odd ? " (odd address)" : "", (long long)bad, bad < 0 ? 0.0 : got[bad], bad < 0 ? 0.0 : want[bad]);
            // the same blocks one at a time through the shared per-block function
            memset(got, 0xff, sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < NB; i++) kvr_dequant_block(qt->type, buf + odd, i, got + i * qt->blck);
            bad = -1;
            for (int64_t e = 0; e < n && bad < 0; e++) {
                if (!same_float(got[e], want[e])) bad = e;
            }
            CHECK(bad < 0, "%s kvr_dequant_block round %d%s: element %lld is %.9g, reference %.9g", qt->name, round,
                  odd ? " (odd address)" : "", (long long)bad, bad < 0 ? 0.0 : got[bad], bad < 0 ? 0.0 : want[bad]);
        }
    }
    free(buf); free(got); free(want);
}

// a dequantized row dotted with a random vector, against the reference in double
static void test_row_dot(const struct qtype * qt) {
    const int64_t K = 1024;
    const int nb = (int)(K / qt->blck);
    uint8_t * buf  = malloc((size_t)nb * qt->size);
    float   * row  = malloc(sizeof(float) * K);
    float   * want = malloc(sizeof(float) * K);
    float   * x    = malloc(sizeof(float) * K);
    for (int round = 0; round < 8; round++) {
        random_blocks(qt, buf, nb);
        for (int64_t i = 0; i < K; i++) x[i] = rng_uniform();
        kvr_to_float(qt->type, buf, row, K);
        ref_row(qt, buf, want, K);
        float  dot = 0;
        double ref = 0, mag = 0;
        for (int64_t i = 0; i < K; i++) {
            dot += row[i] * x[i];
            ref += (double)want[i] * x[i];
            mag += fabs((double)want[i] * x[i]);
        }
        CHECK(fabs(dot - ref) <= 1e-4 * mag + 1e-30, "%s row dot round %d: %.9g vs reference %.9g",
              qt->name, round, (double)dot, ref);
    }
    free(buf); free(row); free(want); free(x);
}

// the largest error of rounding v to half precision (subnormal halves have a fixed step of 2^-24)
static double half_err(double v) { return fmax(fabs(v) * ldexp(1, -11), ldexp(1, -25)); }

// Quantize then dequantize: every element within the format's bound (legacy types), the relative
// RMS error within the expected one (all quantizers), and all-zero and constant blocks exact.
static void test_round_trip(const struct qtype * qt) {
    enum { NB = 64 };
    const int64_t n = (int64_t)NB * qt->blck;
    float   * x   = malloc(sizeof(float) * (size_t)n);
    float   * y   = malloc(sizeof(float) * (size_t)n);
    uint8_t * buf = malloc((size_t)NB * qt->size);

    if (qt->rt_rms == 0) {
        CHECK(kvr_from_float(qt->type, x, buf, qt->blck) == 0, "%s: from_float should be unsupported", qt->name);
        free(x); free(y); free(buf);
        return;
    }
    for (int round = 0; round < 4; round++) {
        for (int b = 0; b < NB; b++) {
            const float scale = ldexpf(1.0f, (int)(rng_u64() % 16) - 10);
            const float shift = round == 3 ? scale * rng_uniform() * 2 : 0; // offset blocks for the *_1 types
            for (int i = 0; i < qt->blck; i++) x[b*qt->blck + i] = rng_normal() * scale + shift;
        }
        const size_t wrote = kvr_from_float(qt->type, x, buf, n);
        CHECK(wrote == (size_t)NB * qt->size, "%s from_float wrote %zu bytes, expected %zu", qt->name, wrote,
              (size_t)NB * qt->size);
        kvr_to_float(qt->type, buf, y, n);
        double err2 = 0, sum2 = 0;
        int64_t worst = -1;
        double worst_ratio = 0;
        for (int b = 0; b < NB; b++) {
            const float * xb = x + b*qt->blck, * yb = y + b*qt->blck;
            float mn = xb[0], mx = xb[0], amax = 0;
            for (int i = 0; i < qt->blck; i++) {
                mn = fminf(mn, xb[i]); mx = fmaxf(mx, xb[i]); amax = fmaxf(amax, fabsf(xb[i]));
            }
            // per element, from the format: half a step (a whole step where the top value clamps),
            // plus what rounding the scale (and min) to half precision costs
            double bound = 0;
            switch (qt->type) {
                case KVR_TYPE_Q8_0: bound = 0.5 * amax / 127 + 127 * half_err(amax / 127); break;
                case KVR_TYPE_Q4_0: bound = 1.0 * amax /   8 +   8 * half_err(amax /   8); break;
                case KVR_TYPE_Q5_0: bound = 1.0 * amax /  16 +  16 * half_err(amax /  16); break;
                case KVR_TYPE_Q4_1: bound = 0.5 * (mx - mn) / 15 + 15 * half_err((mx - mn) / 15) + half_err(mn); break;
                case KVR_TYPE_Q5_1: bound = 0.5 * (mx - mn) / 31 + 31 * half_err((mx - mn) / 31) + half_err(mn); break;
                default: break;
            }
            bound *= 1.0001;
            for (int i = 0; i < qt->blck; i++) {
                const double e = fabs((double)xb[i] - yb[i]);
                err2 += e*e; sum2 += (double)xb[i]*xb[i];
                if (bound > 0 && e / bound > worst_ratio) { worst_ratio = e / bound; worst = b*qt->blck + i; }
            }
        }
        const double rms = sqrt(err2 / sum2);
        CHECK(rms <= qt->rt_rms, "%s round trip %d: relative RMS error %.4g > %.4g", qt->name, round, rms, qt->rt_rms);
        if (qt->type == KVR_TYPE_Q8_0 || qt->type == KVR_TYPE_Q4_0 || qt->type == KVR_TYPE_Q5_0 ||
            qt->type == KVR_TYPE_Q4_1 || qt->type == KVR_TYPE_Q5_1) {
            CHECK(worst_ratio <= 1.0, "%s round trip %d: element %lld off by %.3g of its bound", qt->name, round,
                  (long long)worst, worst_ratio);
        }
    }
    // edge blocks: zeros stay zeros (no NaN from a zero scale); a constant block comes back close
    const int64_t nk = qt->blck;
    memset(x, 0, sizeof(float) * (size_t)nk);
    kvr_from_float(qt->type, x, buf, nk);
    kvr_to_float(qt->type, buf, y, nk);
    int zeros_ok = 1;
    for (int64_t i = 0; i < nk; i++) zeros_ok &= y[i] == 0.0f;
    CHECK(zeros_ok, "%s: an all-zero block does not come back as zeros", qt->name);
    for (int64_t i = 0; i < nk; i++) x[i] = 0.75f;
    kvr_from_float(qt->type, x, buf, nk);
    kvr_to_float(qt->type, buf, y, nk);
    int const_ok = 1;
    for (int64_t i = 0; i < nk; i++) const_ok &= fabsf(y[i] - 0.75f) <= 0.75f * 0.02f;
    CHECK(const_ok, "%s: a constant block comes back as %g", qt->name, (double)y[0]);

    free(x); free(y); free(buf);
}

// ggml's reference quantizers of the legacy types, restated per element: the block's bytes are
// built bit by bit and must equal kvr_from_float's exactly (this is what makes our files read the
// same in llama.cpp). The float operations are ggml's, in its order.
static void set_bits(uint8_t * p, int pos, int n, uint32_t v) {
    for (int k = 0; k < n; k++) {
        const int bit = pos + k;
        p[bit / 8] = (uint8_t)((p[bit / 8] & ~(1u << (bit % 8))) | (((v >> k) & 1u) << (bit % 8)));
    }
}
static void set_half(uint8_t * p, float f) { set_bits(p, 0, 16, kvr_fp32_to_fp16(f)); }

static void ref_quantize_block(enum kvr_type type, const float * x, uint8_t * b) {
    float amax = 0, max = 0, mn = x[0], mx = x[0];
    for (int i = 0; i < 32; i++) {
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
        // strict comparisons as ggml's rule: of equal extremes (-0 and +0) the first one counts;
        // fminf/fmaxf may return either zero, and did differently from build to build
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
    }
    switch (type) {
        case KVR_TYPE_Q8_0: {
            const float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
            set_half(b, d);
            for (int e = 0; e < 32; e++) set_bits(b, 16 + 8*e, 8, (uint32_t)(int)roundf(x[e] * id) & 0xff);
            break;
        }
        case KVR_TYPE_Q4_0: case KVR_TYPE_Q5_0: {
            const int bits5 = type == KVR_TYPE_Q5_0, half = bits5 ? 16 : 8, top = 2*half - 1;
            const float d = max / (float)-half, id = d != 0 ? 1.0f / d : 0.0f;
            set_half(b, d);
            for (int e = 0; e < 32; e++) {
                int q = (int)(x[e] * id + ((float)half + 0.5f));
                if (q > top) q = top;
                set_bits(b, 8*(2 + 4*bits5 + e%16) + 4*(e/16), 4, (uint32_t)q & 15);
                if (bits5) set_bits(b, 16 + e, 1, (uint32_t)q >> 4);
            }
            break;
        }
        case KVR_TYPE_Q4_1: case KVR_TYPE_Q5_1: {
            const int bits5 = type == KVR_TYPE_Q5_1, top = bits5 ? 31 : 15;
            const float d = (mx - mn) / (float)top, id = d != 0 ? 1.0f / d : 0.0f;
            set_half(b, d);
            set_half(b + 2, mn);
            for (int e = 0; e < 32; e++) {
                int q = (int)((x[e] - mn) * id + 0.5f);
                if (q > top) q = top;
                set_bits(b, 8*(4 + 4*bits5 + e%16) + 4*(e/16), 4, (uint32_t)q & 15);
                if (bits5) set_bits(b, 32 + e, 1, (uint32_t)q >> 4);
            }
            break;
        }
        default: break;
    }
}

static void test_quantize_exact(const struct qtype * qt) {
    enum { NB = 256 };
    if (qt->blck != 32 || qt->rt_rms == 0) return;
    float   * x    = malloc(sizeof(float) * NB * 32);
    uint8_t * got  = calloc(NB, (size_t)qt->size);
    uint8_t * want = calloc(NB, (size_t)qt->size);
    for (int b = 0; b < NB; b++) {
        const float scale = ldexpf(1.0f, (int)(rng_u64() % 24) - 14), shift = b % 3 ? 0 : scale * rng_uniform() * 3;
        for (int i = 0; i < 32; i++) {
            float v = rng_normal() * scale + shift;
            if (b % 5 == 1) v = roundf(v / scale * 2) * scale / 2; // ties
            if (b % 7 == 2 && i % 4) v = 0;                        // sparse
            x[b*32 + i] = v;
        }
        ref_quantize_block(qt->type, x + b*32, want + (size_t)b * qt->size);
    }
    kvr_from_float(qt->type, x, got, NB * 32);
    int bad = 0;
    for (int b = 0; b < NB; b++) bad += memcmp(got + (size_t)b * qt->size, want + (size_t)b * qt->size, (size_t)qt->size) != 0;
    CHECK(bad == 0, "%s quantizer: %d of %d blocks differ from ggml's reference rule", qt->name, bad, NB);
    free(x); free(got); free(want);
}

#ifndef QUANT_STANDALONE

// W [K, N] of type qt times X [K, T] f32 through a graph, against the reference in double.
static void test_mul_mat(const struct qtype * qt) {
    const int64_t K = 512, N = 7, T = 3;
    if (!kvr_type_supported(qt->type)) {
        CHECK(0, "%s: kvr_type_supported says no", qt->name);
        return;
    }
    struct kvr_context * ctx = kvr_init(8u << 20, false);
    CHECK(ctx != NULL, "kvr_init");
    if (!ctx) return;
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, qt->type, K, N);
    struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
    random_blocks(qt, w->data, (int)(K / qt->blck * N));
    for (int64_t i = 0; i < K*T; i++) ((float *)x->data)[i] = rng_uniform();
    struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
    y->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, y);
    const int rc = kvr_graph_compute_cpu(g, 2);
    CHECK(rc == KVR_OK, "%s mul_mat: compute returned %d (%s)", qt->name, rc, kvr_last_error());
    if (rc == KVR_OK) {
        float * wr = malloc(sizeof(float) * (size_t)K);
        double worst = 0;
        for (int64_t nn = 0; nn < N; nn++) {
            ref_row(qt, (const uint8_t *)w->data + nn * w->nb[1], wr, K);
            for (int64_t t = 0; t < T; t++) {
                const float * xt = (const float *)((const char *)x->data + t * x->nb[1]);
                double ref = 0, mag = 0;
                for (int64_t i = 0; i < K; i++) { ref += (double)wr[i] * xt[i]; mag += fabs((double)wr[i] * xt[i]); }
                const float got = *(const float *)((const char *)y->data + nn * y->nb[0] + t * y->nb[1]);
                const double r = fabs(got - ref) / (mag + 1e-30);
                if (r > worst) worst = r;
            }
        }
        CHECK(worst <= 1e-4, "%s mul_mat: worst relative error %.3g", qt->name, worst);
        free(wr);
    }
    kvr_free(ctx);
}

// The decode kernels (a matmul of at most 4 tokens reads each row once in its stored form) for
// every weight type, against the bit-layout reference in double: K with an odd number of legacy
// blocks (416 = 13 x 32) and with whole super-blocks (768), 37 rows (threads split them unevenly),
// 1, 2 and 4 tokens, 1-3 threads. Activations include exact zeros and values of large magnitude.
// f16, bf16 and f32 weights are read from their bits here too.
static float ref_plain(enum kvr_type t, const uint8_t * row, int64_t e) {
    if (t == KVR_TYPE_F16)  return ref_half(row + 2 * e);
    if (t == KVR_TYPE_BF16) { const uint32_t u = bits(row + 2 * e, 0, 16) << 16; float f; memcpy(&f, &u, 4); return f; }
    float f;
    memcpy(&f, row + 4 * e, 4);
    return f;
}

// One case: the worst error of a K x 37 matmul with T tokens on nth threads, the activations
// times xscale; with daz, the calling thread (and so the backend's threads it starts) runs with
// denormals-are-zero and flush-to-zero on, as an application built with -ffast-math does.
static void test_mul_vec_case(enum kvr_type type, const struct qtype * qt, const char * name, int64_t K, int T, int nth, float xscale, bool daz) {
    const int64_t N = 37;
    struct kvr_context * ctx = kvr_init(8u << 20, false);
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, type, K, N);
    struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
    if (qt) {
        random_blocks(qt, w->data, (int)(K / qt->blck * N));
    } else {
        for (int64_t i = 0; i < K * N; i++) {
            const float v = rng_normal() * 0.1f;
            if (type == KVR_TYPE_F32) ((float *)w->data)[i] = v;
            else ((uint16_t *)w->data)[i] = type == KVR_TYPE_F16 ? kvr_fp32_to_fp16(v) : kvr_fp32_to_bf16(v);
        }
    }
    float * xs = x->data;
    for (int64_t i = 0; i < K * T; i++) {
        const uint64_t r = rng_u64() % 16;
        xs[i] = (r == 0 ? 0.0f : r == 1 ? 1e3f * rng_uniform() : rng_normal()) * xscale;
    }
    struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
    y->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, y);
#if defined(__SSE__)
    const unsigned csr = _mm_getcsr();
    if (daz) _mm_setcsr(csr | 0x8040u);
#else
    (void)daz;
#endif
    struct kvr_backend * be = kvr_backend_cpu_new(nth);
    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
    KVR_ASSERT(buf != NULL);
    kvr_graph_place(g, buf);
    const int rc = kvr_backend_graph_compute(be, g);
    kvr_buffer_free(buf);
    kvr_backend_free(be);
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
    CHECK(rc == KVR_OK, "%s mul_vec K=%lld T=%d, %d threads: compute returned %d (%s)", name, (long long)K, T, nth, rc, kvr_last_error());
    double worst = 0;
    for (int64_t nn = 0; nn < N && rc == KVR_OK; nn++) {
        const uint8_t * row = (const uint8_t *)w->data + nn * w->nb[1];
        for (int t = 0; t < T; t++) {
            double ref = 0, mag = 0;
            for (int64_t e = 0; e < K; e++) {
                const double wv = qt ? qt->ref(row + (e / qt->blck) * qt->size, (int)(e % qt->blck)) : ref_plain(type, row, e);
                ref += wv * xs[t * K + e];
                mag += fabs(wv * xs[t * K + e]);
                if (type == KVR_TYPE_Q4_0) { // the -8 rides in the kernel's sum as -8 d x beside d q x
                    const uint8_t * blk = row + (e / 32) * qt->size;
                    mag += 8.0 * fabs(kvr_fp16_to_fp32((uint16_t)(blk[0] | blk[1] << 8)) * xs[t * K + e]);
                }
            }
            const float got = ((const float *)y->data)[t * N + nn];
            const double r = fabs(got - ref) / (mag + 1e-30);
            if (!(r <= worst)) worst = r; // a NaN stays the worst
        }
    }
    // the cases of the plain data hold the kernels to 2e-6 of the magnitude of the terms they sum
    // (Q4_0's: d q x and -8 d x, which may cancel to a small w x); the scaled and denormals-are-zero cases
    // (whose failure is O(1): a wrong scale, quants read as 0) to 1e-5, as their data has the odd
    // row where an offset type's -8 sum x (Q4_0) cancels a large q x to within ~3e-6, with this
    // kernel and with the one before it alike
    const double bound = xscale == 1.0f && !daz ? 2e-6 : 1e-5;
    CHECK(worst <= bound, "%s mul_vec K=%lld T=%d, %d threads, x times %g%s: worst relative error %.3g", name, (long long)K, T, nth, xscale,
          daz ? ", denormals-are-zero on" : "", worst);
    kvr_free(ctx);
}

// Every case above, and activations far from 1 (the kernels scale them by powers of two) and a
// caller with denormals-are-zero on (the kernels read quants as subnormal floats).
// K = 437 (6 steps of 64, one of 32, 21 alone) reaches every loop of the 16-bit kernels; the
// block types skip it.
static void test_mul_vec_type(enum kvr_type type, const struct qtype * qt, const char * name) {
    const int64_t Ks[3] = { 416, 768, 437 };
    for (int ki = 0; ki < 3; ki++) {
        const int64_t K = Ks[ki];
        if (qt && K % qt->blck) continue;
        for (int T = 1; T <= 4; T *= 2) {
            for (int nth = 1; nth <= 3; nth++) test_mul_vec_case(type, qt, name, K, T, nth, 1.0f, false);
        }
        test_mul_vec_case(type, qt, name, K, 2, 2, 0x1p-100f, false);
        test_mul_vec_case(type, qt, name, K, 2, 2, 0x1p+90f, false);
        test_mul_vec_case(type, qt, name, K, 1, 1, 1.0f, true);
        test_mul_vec_case(type, qt, name, K, 3, 2, 1.0f, true);
    }
}

static void test_mul_vec(void) {
    for (int i = 0; i < N_QTYPES; i++) test_mul_vec_type(qtypes[i].type, &qtypes[i], qtypes[i].name);
    test_mul_vec_type(KVR_TYPE_F16, NULL, "f16");
    test_mul_vec_type(KVR_TYPE_BF16, NULL, "bf16");
    test_mul_vec_type(KVR_TYPE_F32, NULL, "f32");
}

// The integer prefill path (kvr_backend_params' q8_activations) for Q4_K: every token's 256
// values quantized to int8 by ggml's Q8_K rule (largest magnitude -> -127, round half to even), then
// per super-block d*d_a*sum_j sc_j*sum(q*a) - dmin*d_a*sum_j m_j*sum(a), all written out here from
// the bit layout. 601 tokens (more than one chunk of 512; not a multiple of the kernel's 4), 13 rows (not a
// multiple of 8), with 1, 2 and 3 threads.
static void ref_act_q8(const float * x, int8_t * q, float * d) {
    float amax = 0, max = 0;
    for (int j = 0; j < 256; j++) if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
    if (amax == 0) { memset(q, 0, 256); *d = 0; return; }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
        const float v = nearbyintf(iscale * x[j]);
        q[j] = (int8_t)(v > 127 ? 127 : v);
    }
    *d = 1.0f / iscale;
}

static void test_mul_mat_q8(void) {
    const int64_t K = 512, N = 13, T = 601;
    const struct qtype * qt = NULL;
    for (int i = 0; i < N_QTYPES; i++) if (qtypes[i].type == KVR_TYPE_Q4_K) qt = &qtypes[i];
    for (int nth = 1; nth <= 3; nth++) {
        struct kvr_context * ctx = kvr_init(8u << 20, false);
        struct kvr_tensor * w = kvr_new_tensor_2d(ctx, KVR_TYPE_Q4_K, K, N);
        struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
        random_blocks(qt, w->data, (int)(K / 256 * N));
        for (int64_t i = 0; i < K*T; i++) ((float *)x->data)[i] = rng_normal();
        struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
        y->flags |= KVR_FLAG_OUTPUT;
        struct kvr_graph * g = kvr_graph_new(ctx, 16);
        kvr_graph_expand(g, y);
        struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = true });
        struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
        if (!buf) { CHECK(0, "q8 mul_mat: %s", kvr_last_error()); kvr_backend_free(be); kvr_free(ctx); return; }
        kvr_graph_place(g, buf);
        const int rc = kvr_backend_graph_compute(be, g);
        CHECK(rc == KVR_OK, "q4_K q8 mul_mat, %d threads: compute returned %d (%s)", nth, rc, kvr_last_error());
        double worst_int = 0, worst_exact = 0;
        for (int64_t t = 0; t < T && rc == KVR_OK; t++) {
            const float * xt = (const float *)x->data + t * K;
            int8_t qa[512];
            float da[2];
            for (int b = 0; b < 2; b++) ref_act_q8(xt + 256 * b, qa + 256 * b, &da[b]);
            for (int64_t nn = 0; nn < N; nn++) {
                const uint8_t * row = (const uint8_t *)w->data + nn * w->nb[1];
                double ref = 0, exact = 0, mag = 0;
                for (int b = 0; b < 2; b++) {
                    const uint8_t * blk = row + 144 * b;
                    long sumi = 0, summ = 0;
                    for (int j = 0; j < 8; j++) {
                        int sc, m;
                        ref_k4(blk, j, &sc, &m);
                        long s = 0, sa = 0;
                        for (int l = 0; l < 32; l++) {
                            const int e = 32 * j + l;
                            s += field(blk, 16 + (e/64)*32 + e%32, (e/32)%2, 4) * qa[256 * b + e];
                            sa += qa[256 * b + e];
                        }
                        sumi += sc * s;
                        summ += m * sa;
                    }
                    ref += (double)ref_half(blk) * da[b] * (double)sumi - (double)ref_half(blk + 2) * da[b] * (double)summ;
                    for (int e = 0; e < 256; e++) {
                        const double p = (double)ref_q4_K(blk, e) * xt[256 * b + e];
                        exact += p;
                        mag += fabs(p);
                    }
                }
                const float got = ((const float *)y->data)[t * N + nn];
                if (fabs(got - ref) / (mag + 1e-30) > worst_int) worst_int = fabs(got - ref) / (mag + 1e-30);
                if (fabs(got - exact) / (mag + 1e-30) > worst_exact) worst_exact = fabs(got - exact) / (mag + 1e-30);
            }
        }
        CHECK(worst_int <= 1e-5, "q4_K q8 mul_mat, %d threads: worst relative error %.3g against the integer reference", nth, worst_int);
        // the activations' rounding shows against the exact product (so the integer path ran), but
        // stays within its bound: half a step of 1/127 of the largest value per 256
        CHECK(worst_exact > 1e-5 && worst_exact < 0.02, "q4_K q8 mul_mat, %d threads: relative error %.3g against the exact product", nth, worst_exact);
        kvr_buffer_free(buf);
        kvr_backend_free(be);
        kvr_free(ctx);
    }
}

// The integer path (kvr_backend_params' q8_activations) for every quantized type, decode (1-4
// tokens: row by row) and prefill (more: interleaved tiles of 16 rows, 8 without AVX-512), against
// a reference written here from the bit layout. The activations are quantized by ggml's x86 rules:
// Q8_0 blocks of 32 for Q4_0, Q5_0, Q8_0 and Q8_1 weights (d = amax/127 rounded to fp16,
// q = x*127/amax rounded half to even), Q8_1 for Q4_1 and Q5_1 (also s = d*sum(q) rounded to
// fp16), Q8_K super-blocks of 256 for the k-quants (ref_act_q8). Each weight element is split
// into its integers (quant q, scale sc, min mn) and the block's floats (d, dmin or m): a block
// contributes
//   legacy:   d*d_a * sum(q*a) + m*s_a                        (Q4_0/Q5_0: q includes the -8/-16)
//   k-quants: d*d_a * sum(sc*q*a) - dmin*d_a * sum(mn*a)      (Q3_K/Q6_K: q includes the -4/-32)
// with the integer sums exact. K = 928 (29 legacy blocks: the single-token kernel's three steps of
// 8 and 5 blocks alone) or 768 (3 super-blocks), 37 rows (threads
// split them unevenly, the row tiles end short), 1 and 3 threads; up to 515 tokens (the
// prefill quantizes 512 at a time: a second chunk of 3). Then the extremes the kernels'
// int16 sums must hold: every quant byte 0xff (the largest quants; -1 for the 8-bit types) against
// activations that all quantize to +-127.
struct ref_ints { int q, sc, mn; };

static struct ref_ints ref_int(enum kvr_type t, const uint8_t * b, int e) {
    struct ref_ints r = { 0, 1, 0 };
    switch (t) {
        case KVR_TYPE_Q4_0: r.q = field(b, 2 + e%16, e/16, 4) - 8; break;
        case KVR_TYPE_Q4_1: r.q = field(b, 4 + e%16, e/16, 4); break;
        case KVR_TYPE_Q5_0: r.q = field(b, 6 + e%16, e/16, 4) + 16*(int)bits(b, 16 + e, 1) - 16; break;
        case KVR_TYPE_Q5_1: r.q = field(b, 8 + e%16, e/16, 4) + 16*(int)bits(b, 32 + e, 1); break;
        case KVR_TYPE_Q8_0: r.q = sbits8(b, 2 + e); break;
        case KVR_TYPE_Q8_1: r.q = sbits8(b, 4 + e); break;
        case KVR_TYPE_Q2_K: r.q = plane2(b, 16, e); r.sc = field(b, e/16, 0, 4); r.mn = field(b, e/16, 1, 4); break;
        case KVR_TYPE_Q3_K: {
            const int j = e/16;
            r.sc = (field(b, 96 + j%8, j/8, 4) | field(b, 104 + j%4, j/4, 2) << 4) - 32;
            r.q = plane2(b, 32, e) + 4*(int)bits(b, 8*(e%32) + e/32, 1) - 4;
            break;
        }
        case KVR_TYPE_Q4_K: ref_k4(b, e/32, &r.sc, &r.mn); r.q = field(b, 16 + (e/64)*32 + e%32, (e/32)%2, 4); break;
        case KVR_TYPE_Q5_K:
            ref_k4(b, e/32, &r.sc, &r.mn);
            r.q = field(b, 48 + (e/64)*32 + e%32, (e/32)%2, 4) + 16*(int)bits(b, 8*(16 + e%32) + e/32, 1);
            break;
        case KVR_TYPE_Q6_K: {
            const int h = e/128, k = (e%128)/32, l = e%32;
            r.q = (field(b, h*64 + (k%2)*32 + l, k/2, 4) | field(b, 128 + h*32 + l, k, 2) << 4) - 32;
            r.sc = sbits8(b, 192 + e/16);
            break;
        }
        default: r.q = sbits8(b, 4 + e); break; // Q8_K
    }
    return r;
}

// the block's float factors: d, and dmin (k-quants) or m (Q4_1/Q5_1), else 0
static void ref_block_floats(const struct qtype * qt, const uint8_t * b, double * d, double * m) {
    if (qt->f32 >= 0) {
        const uint32_t u = bits(b + qt->f32, 0, 32);
        float f;
        memcpy(&f, &u, 4);
        *d = f;
    } else {
        *d = ref_half(b + qt->half[0]);
    }
    *m = qt->n_half > 1 && qt->type != KVR_TYPE_Q8_1 ? ref_half(b + qt->half[1]) : 0.0; // Q8_1's second half is its s
}

static float ref_round_half(float v) {
    uint8_t h[2];
    const uint16_t u = kvr_fp32_to_fp16(v);
    h[0] = (uint8_t)(u & 0xff);
    h[1] = (uint8_t)(u >> 8);
    return ref_half(h);
}

// ggml's x86 quantize_row_q8_0/q8_1 on one block of 32: q, d (fp16), s (fp16 of d*sum)
static void ref_act_q8_0(const float * x, int8_t * q, float * d, float * s) {
    float amax = 0;
    for (int j = 0; j < 32; j++) if (fabsf(x[j]) > amax) amax = fabsf(x[j]);
    const float id = amax != 0 ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        q[j] = (int8_t)nearbyintf(x[j] * id);
        sum += q[j];
    }
    *d = ref_round_half(amax / 127.0f);
    *s = ref_round_half(amax / 127.0f * (float)sum);
}

static void test_mul_q8_type(const struct qtype * qt, bool extreme) {
    const bool kq = qt->blck == 256;
    const int64_t K = kq ? 768 : 928, N = 37, nb = K / qt->blck;
    static const int Ts_random[] = { 1, 2, 3, 4, 5, 13, 36, 515 }, Ts_extreme[] = { 1, 13 };
    const int * Ts = extreme ? Ts_extreme : Ts_random;
    const size_t n_T = extreme ? sizeof Ts_extreme / sizeof Ts_extreme[0] : sizeof Ts_random / sizeof Ts_random[0];
    struct ref_ints * wi = malloc(sizeof(*wi) * (size_t)(K * N));
    double * wd = malloc(sizeof(double) * (size_t)(2 * nb * N));
    int8_t * qa = malloc((size_t)K);
    float * da = malloc(sizeof(float) * (size_t)(2 * nb));
    for (size_t ti = 0; ti < n_T; ti++) {
        const int T = Ts[ti];
        for (int nth = T > 64 ? 3 : 1; nth <= (extreme ? 1 : 3); nth += 2) { // the long prompt: threads' chunks
            struct kvr_context * ctx = kvr_init(8u << 20, false);
            struct kvr_tensor * w = kvr_new_tensor_2d(ctx, qt->type, K, N);
            struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
            random_blocks(qt, w->data, (int)(nb * N));
            float * xs = x->data;
            for (int64_t i = 0; i < K * T; i++) xs[i] = extreme ? 1.0f : rng_normal();
            if (extreme) {
                // every byte but the d/dmin/m fields 0xff
                for (int64_t b = 0; b < nb * N; b++) {
                    uint8_t * blk = (uint8_t *)w->data + b * qt->size;
                    for (int i = 0; i < qt->size; i++) {
                        bool scale = (qt->f32 >= 0 && i >= qt->f32 && i < qt->f32 + 4);
                        for (int k = 0; k < qt->n_half; k++) scale = scale || i == qt->half[k] || i == qt->half[k] + 1;
                        if (!scale) blk[i] = 0xff;
                    }
                }
            }
            struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
            y->flags |= KVR_FLAG_OUTPUT;
            struct kvr_graph * g = kvr_graph_new(ctx, 16);
            kvr_graph_expand(g, y);
            struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = true });
            struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
            KVR_ASSERT(buf != NULL);
            kvr_graph_place(g, buf);
            const int rc = kvr_backend_graph_compute(be, g);
            CHECK(rc == KVR_OK, "%s q8 mul_mat T=%d, %d threads: compute returned %d (%s)", qt->name, T, nth, rc, kvr_last_error());
            for (int64_t nn = 0; nn < N; nn++) {
                const uint8_t * row = (const uint8_t *)w->data + nn * w->nb[1];
                for (int64_t e = 0; e < K; e++) wi[nn * K + e] = ref_int(qt->type, row + (e / qt->blck) * qt->size, (int)(e % qt->blck));
                for (int64_t b = 0; b < nb; b++) ref_block_floats(qt, row + b * qt->size, &wd[2 * (nn * nb + b)], &wd[2 * (nn * nb + b) + 1]);
            }
            double worst_int = 0, worst_exact = 0;
            for (int t = 0; t < T && rc == KVR_OK; t++) {
                const float * xt = xs + (int64_t)t * K;
                for (int64_t b = 0; b < nb; b++) {
                    if (kq) ref_act_q8(xt + 256 * b, qa + 256 * b, &da[2 * b]);
                    else    ref_act_q8_0(xt + 32 * b, qa + 32 * b, &da[2 * b], &da[2 * b + 1]);
                }
                for (int64_t nn = 0; nn < N; nn++) {
                    const uint8_t * row = (const uint8_t *)w->data + nn * w->nb[1];
                    double ref = 0, exact = 0, mag = 0;
                    for (int64_t b = 0; b < nb; b++) {
                        long sq = 0, sm = 0;
                        for (int e = 0; e < qt->blck; e++) {
                            const struct ref_ints r = wi[nn * K + b * qt->blck + e];
                            sq += (long)r.sc * r.q * qa[b * qt->blck + e];
                            sm += (long)r.mn * qa[b * qt->blck + e];
                        }
                        const double d = wd[2 * (nn * nb + b)], m = wd[2 * (nn * nb + b) + 1];
                        if (kq) ref += d * da[2 * b] * (double)sq - m * da[2 * b] * (double)sm;
                        else    ref += d * da[2 * b] * (double)sq + m * da[2 * b + 1];
                        for (int e = 0; e < qt->blck; e++) {
                            const double p = (double)qt->ref(row + b * qt->size, e) * xt[b * qt->blck + e];
                            exact += p;
                            mag += fabs(p);
                        }
                    }
                    const float got = ((const float *)y->data)[t * N + nn];
                    const double ri = fabs(got - ref) / (mag + 1e-30), re = fabs(got - exact) / (mag + 1e-30);
                    if (!(ri <= worst_int)) worst_int = ri; // a NaN stays the worst
                    if (re > worst_exact) worst_exact = re;
                }
            }
            CHECK(worst_int <= 1e-5, "%s q8 mul_mat%s T=%d, %d threads: worst relative error %.3g against the integer reference",
                  qt->name, extreme ? " (extremes)" : "", T, nth, worst_int);
            // the activations' rounding shows against the exact product (so the integer path ran),
            // within its bound: half a step of 1/127 of the largest value per block (constant
            // activations of the extremes quantize almost exactly)
            CHECK((extreme || worst_exact > 1e-6) && worst_exact < 0.05, "%s q8 mul_mat%s T=%d, %d threads: relative error %.3g against the exact product",
                  qt->name, extreme ? " (extremes)" : "", T, nth, worst_exact);
            kvr_buffer_free(buf);
            kvr_backend_free(be);
            kvr_free(ctx);
        }
    }
    free(wi);
    free(wd);
    free(qa);
    free(da);
}

static void test_mul_q8(void) {
    for (int i = 0; i < N_QTYPES; i++) test_mul_q8_type(&qtypes[i], false);
    for (int i = 0; i < N_QTYPES; i++) test_mul_q8_type(&qtypes[i], true);
}

// The fast MUL_MAT paths against the CPU backend's plain reference kernels
// (kvr_backend_params.ref_kernels) for every quantized type, exact and with 8-bit activations:
// 1 token (the decode rows; the integer path's one-token kernels), 2 and 4 (decode rows), 5 and
// 13 (sgemm on converted rows; the integer path's interleave of a row tile with a short tile of
// tokens), 64 (a prefill); 37 rows (the row tiles end short, threads split them unevenly); K
// of 29 legacy blocks (steps of 8 and a tail) or 3 super-blocks; 1 and 3 threads. Both sides
// multiply the same values (the reference rounds the activations by the same rules); only the
// order of the f32 sums differs, and the fast paths sum a block's scale, offset and min
// separately. So the difference is held to the bound of any order of K f32 additions, K 2^-24 of
// the sum of |term| over those terms (|d sc q x| + |m mn x|), twice over for the two sides.
static void test_fast_vs_ref_type(const struct qtype * qt, bool q8, double * worst_out) {
    const bool kq = qt->blck == 256;
    const int64_t K = kq ? 768 : 928, N = 37, nb = K / qt->blck;
    static const int Ts[] = { 1, 2, 4, 5, 13, 64 };
    const int64_t T_max = 64;
    uint8_t * wq = malloc((size_t)(nb * N * qt->size));
    double * mag_w = malloc(sizeof(double) * (size_t)(K * N)); // |d sc q| + |m mn| of each weight
    float * xs = malloc(sizeof(float) * (size_t)(K * T_max));
    float * fast = malloc(sizeof(float) * (size_t)(N * T_max));
    random_blocks(qt, wq, (int)(nb * N));
    for (int64_t i = 0; i < K * T_max; i++) xs[i] = rng_normal();
    for (int64_t nn = 0; nn < N; nn++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wq + (nn * nb + b) * qt->size;
            double d, m;
            ref_block_floats(qt, blk, &d, &m);
            for (int e = 0; e < qt->blck; e++) {
                const struct ref_ints r = ref_int(qt->type, blk, e);
                mag_w[nn * K + b * qt->blck + e] = fabs(d * r.sc * r.q) + fabs(m * (kq ? r.mn : 1));
            }
        }
    }
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int T = Ts[ti];
        for (int nth = 1; nth <= 3; nth += 2) {
            struct kvr_context * ctx = kvr_init(8u << 20, false);
            struct kvr_tensor * w = kvr_new_tensor_2d(ctx, qt->type, K, N);
            struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
            memcpy(w->data, wq, (size_t)(nb * N * qt->size));
            memcpy(x->data, xs, sizeof(float) * (size_t)(K * T));
            struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
            y->flags |= KVR_FLAG_OUTPUT;
            struct kvr_graph * g = kvr_graph_new(ctx, 16);
            kvr_graph_expand(g, y);
            struct kvr_backend_params bp = { .n_threads = nth, .q8_activations = q8 };
            struct kvr_backend * be_fast = kvr_backend_new("cpu", &bp);
            bp.ref_kernels = true;
            struct kvr_backend * be_ref = kvr_backend_new("cpu", &bp);
            struct kvr_buffer * buf = kvr_backend_alloc_buffer(be_fast, kvr_graph_plan(g));
            KVR_ASSERT(be_fast && be_ref && buf);
            kvr_graph_place(g, buf);
            int rc = kvr_backend_graph_compute(be_fast, g);
            memcpy(fast, y->data, sizeof(float) * (size_t)(N * T));
            memset(y->data, 0xff, sizeof(float) * (size_t)(N * T)); // NaN: an element the reference leaves fails
            if (rc == KVR_OK) rc = kvr_backend_graph_compute(be_ref, g);
            CHECK(rc == KVR_OK, "%s fast vs ref%s T=%d, %d threads: compute returned %d (%s)", qt->name, q8 ? " (q8)" : "",
                  T, nth, rc, kvr_last_error());
            double worst = 0.0;
            for (int64_t t = 0; t < T && rc == KVR_OK; t++) {
                for (int64_t nn = 0; nn < N; nn++) {
                    double mag = 0.0;
                    for (int64_t e = 0; e < K; e++) mag += mag_w[nn * K + e] * fabs(xs[t * K + e]);
                    const double r = fabs((double)fast[t * N + nn] - ((const float *)y->data)[t * N + nn]) / (mag + 1e-30);
                    if (!(r <= worst)) worst = r; // a NaN stays the worst
                }
            }
            const double bound = 2.0 * (double)K / 16777216.0;
            CHECK(worst <= bound, "%s fast vs ref%s T=%d, %d threads: worst difference %.3g of sum |w x|, bound %.3g",
                  qt->name, q8 ? " (q8)" : "", T, nth, worst, bound);
            if (!(worst <= *worst_out)) *worst_out = worst;
            kvr_buffer_free(buf);
            kvr_backend_free(be_ref);
            kvr_backend_free(be_fast);
            kvr_free(ctx);
        }
    }
    free(wq);
    free(mag_w);
    free(xs);
    free(fast);
}

// MUL_MAT_ID (a mixture of experts) of every quantized type and MXFP4, exact and with 8-bit
// activations: the fast kernel (tokens grouped by expert through the MUL_MAT paths) against the
// reference one (each token and expert on its own), held to test_fast_vs_ref_type's bound over
// the magnitudes of the experts the tokens picked; 4 experts, 2 a token, decode and a prefill.
static void test_fast_vs_ref_moe(const struct qtype * qt, bool q8, double * worst_out) {
    const bool kq = qt->blck == 256;
    const int64_t K = kq ? 768 : 928, N = 37, E = 4, k = 2, nb = K / qt->blck;
    static const int Ts[] = { 1, 13 };
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int64_t T = Ts[ti];
        struct kvr_context * ctx = kvr_init(8u << 20, false);
        const int64_t ne[3] = { K, N, E };
        struct kvr_tensor * w = kvr_new_tensor(ctx, qt->type, 3, ne);
        struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
        struct kvr_tensor * lg = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, E, T);
        random_blocks(qt, w->data, (int)(nb * N * E));
        for (int64_t i = 0; i < K * T; i++) ((float *)x->data)[i] = rng_normal();
        for (int64_t i = 0; i < E * T; i++) ((float *)lg->data)[i] = rng_normal();
        struct kvr_tensor * route = kvr_moe_route(ctx, lg, (int)k, KVR_MOE_SOFTMAX_TOPK_NORM);
        struct kvr_tensor * y = kvr_mul_mat_id(ctx, w, x, route, NULL);
        y->flags |= KVR_FLAG_OUTPUT;
        route->flags |= KVR_FLAG_OUTPUT;
        struct kvr_graph * g = kvr_graph_new(ctx, 16);
        kvr_graph_expand(g, y);
        const int64_t n_out = N * k * T;
        float * fast = malloc(sizeof(float) * (size_t)n_out);
        struct kvr_backend_params bp = { .n_threads = 3, .q8_activations = q8 };
        struct kvr_backend * be_fast = kvr_backend_new("cpu", &bp);
        bp.ref_kernels = true;
        struct kvr_backend * be_ref = kvr_backend_new("cpu", &bp);
        struct kvr_buffer * buf = kvr_backend_alloc_buffer(be_fast, kvr_graph_plan(g));
        KVR_ASSERT(be_fast && be_ref && buf);
        kvr_graph_place(g, buf);
        int rc = kvr_backend_graph_compute(be_fast, g);
        memcpy(fast, y->data, sizeof(float) * (size_t)n_out);
        memset(y->data, 0xff, sizeof(float) * (size_t)n_out);
        if (rc == KVR_OK) rc = kvr_backend_graph_compute(be_ref, g);
        CHECK(rc == KVR_OK, "%s MUL_MAT_ID fast vs ref%s T=%lld: %s", qt->name, q8 ? " (q8)" : "", (long long)T, kvr_last_error());
        double worst = 0.0;
        for (int64_t t = 0; t < T && rc == KVR_OK; t++) {
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = (int64_t)((const float *)route->data)[t * 2 * k + k + j];
                for (int64_t n = 0; n < N; n++) {
                    const uint8_t * row = (const uint8_t *)w->data + (e * N + n) * nb * qt->size;
                    double mag = 0.0;
                    for (int64_t b = 0; b < nb; b++) {
                        const uint8_t * blk = row + b * qt->size;
                        double d = 1.0, m = 0.0;
                        if (qt->type != KVR_TYPE_MXFP4) ref_block_floats(qt, blk, &d, &m);
                        for (int c = 0; c < qt->blck; c++) {
                            double mw;
                            if (qt->type == KVR_TYPE_MXFP4) {
                                mw = fabs(qt->ref(blk, c));
                            } else {
                                const struct ref_ints r = ref_int(qt->type, blk, c);
                                mw = fabs(d * r.sc * r.q) + fabs(m * (kq ? r.mn : 1));
                            }
                            mag += mw * fabs(((const float *)x->data)[t * K + b * qt->blck + c]);
                        }
                    }
                    const int64_t i = (t * k + j) * N + n;
                    const double r = fabs((double)fast[i] - ((const float *)y->data)[i]) / (mag + 1e-30);
                    if (!(r <= worst)) worst = r;
                }
            }
        }
        const double bound = 2.0 * (double)K / 16777216.0;
        CHECK(worst <= bound, "%s MUL_MAT_ID fast vs ref%s T=%lld: worst difference %.3g of sum |w x|, bound %.3g", qt->name,
              q8 ? " (q8)" : "", (long long)T, worst, bound);
        if (!(worst <= *worst_out)) *worst_out = worst;
        free(fast);
        kvr_buffer_free(buf);
        kvr_backend_free(be_ref);
        kvr_backend_free(be_fast);
        kvr_free(ctx);
    }
}

static void test_fast_vs_ref(void) {
    const char * env = getenv("KVR_REF");
    if (env && *env && strcmp(env, "0") != 0) {
        printf("skipped: the fast paths against the reference kernels (KVR_REF=1 puts every CPU backend on the latter)\n");
        n_skip++;
        return;
    }
    double worst[2] = { 0.0, 0.0 };
    for (int q8 = 0; q8 < 2; q8++) {
        for (int i = 0; i < N_QTYPES; i++) test_fast_vs_ref_type(&qtypes[i], q8, &worst[q8]);
    }
    printf("fast paths vs reference kernels: worst difference %.3g (exact), %.3g (8-bit activations) of sum |w x|\n",
           worst[0], worst[1]);
    double worst_id[2] = { 0.0, 0.0 };
    for (int q8 = 0; q8 < 2; q8++) {
        for (int i = 0; i < N_QTYPES; i++) test_fast_vs_ref_moe(&qtypes[i], q8, &worst_id[q8]);
        test_fast_vs_ref_moe(&qtype_mxfp4, q8, &worst_id[q8]);
    }
    printf("MUL_MAT_ID fast vs reference kernels: worst difference %.3g (exact), %.3g (8-bit activations) of sum |w x|\n",
           worst_id[0], worst_id[1]);
}

// A decode batch (op_params[0] KVR_MM_ROWS, as kvr_pass_batch marks a batch's matmuls) of 1..9
// tokens, exact and with 8-bit activations, MUL_MAT and MUL_MAT_ID (4 experts, 2 a token), every
// quantized type and MXFP4: each token's row of the result must be the bits the same token gives
// alone (T = 1, the decode kernels), whatever the tokens beside it; 1 and 3 threads. K of 29
// legacy blocks (the one-token kernel's steps of 8 and a tail of 5) or 3 super-blocks, 37 rows.
static float * batch_rows_run(const struct qtype * qt, bool q8, bool moe, int nth, const uint8_t * wq, const float * xs,
                              const float * lg, int64_t T) {
    const bool kq = qt->blck == 256;
    const int64_t K = kq ? 768 : 928, N = 37, E = 4, k = 2, nb = K / qt->blck;
    struct kvr_context * ctx = kvr_init(8u << 20, false);
    const int64_t ne[3] = { K, N, moe ? E : 1 };
    struct kvr_tensor * w = kvr_new_tensor(ctx, qt->type, moe ? 3 : 2, ne);
    struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
    memcpy(w->data, wq, (size_t)(nb * N * (moe ? E : 1) * qt->size));
    memcpy(x->data, xs, sizeof(float) * (size_t)(K * T));
    struct kvr_tensor * y;
    if (moe) {
        struct kvr_tensor * l = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, E, T);
        memcpy(l->data, lg, sizeof(float) * (size_t)(E * T));
        y = kvr_mul_mat_id(ctx, w, x, kvr_moe_route(ctx, l, (int)k, KVR_MOE_SOFTMAX_TOPK_NORM), NULL);
    } else {
        y = kvr_mul_mat(ctx, w, x);
    }
    y->op_params[0] = KVR_MM_ROWS;
    y->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, y);
    struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = q8 });
    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
    KVR_ASSERT(be && buf);
    kvr_graph_place(g, buf);
    const int rc = kvr_backend_graph_compute(be, g);
    CHECK(rc == KVR_OK, "%s batch rows%s%s T=%lld: compute returned %d (%s)", qt->name, q8 ? " (q8)" : "", moe ? " (experts)" : "",
          (long long)T, rc, kvr_last_error());
    const size_t n_out = (size_t)(N * (moe ? k : 1) * T);
    float * out = malloc(sizeof(float) * n_out);
    memcpy(out, y->data, sizeof(float) * n_out);
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    kvr_free(ctx);
    return out;
}

static void test_batch_rows_type(const struct qtype * qt) {
    const bool kq = qt->blck == 256;
    const int64_t K = kq ? 768 : 928, N = 37, E = 4, k = 2, nb = K / qt->blck, T_max = 9;
    uint8_t * wq = malloc((size_t)(nb * N * E * qt->size));
    float * xs = malloc(sizeof(float) * (size_t)(K * T_max)), * lg = malloc(sizeof(float) * (size_t)(E * T_max));
    random_blocks(qt, wq, (int)(nb * N * E));
    for (int64_t i = 0; i < K * T_max; i++) xs[i] = rng_normal();
    for (int64_t i = 0; i < E * T_max; i++) lg[i] = rng_normal();
    for (int q8 = 0; q8 < 2; q8++) {
        for (int moe = 0; moe < 2; moe++) {
            const int64_t per = N * (moe ? k : 1); // one token's outputs
            float * solo[9];
            for (int64_t t = 0; t < T_max; t++) solo[t] = batch_rows_run(qt, q8, moe, 1, wq, xs + t * K, lg + t * E, 1);
            for (int nth = 1; nth <= 3; nth += 2) {
                for (int64_t T = 1; T <= T_max; T++) {
                    // the batch's tokens start at token 9 - T: each count puts a token in another lane of a group
                    const int64_t t0 = T_max - T;
                    float * got = batch_rows_run(qt, q8, moe, nth, wq, xs + t0 * K, lg + t0 * E, T);
                    int64_t bad = -1;
                    for (int64_t t = 0; t < T && bad < 0; t++) {
                        if (memcmp(got + t * per, solo[t0 + t], sizeof(float) * (size_t)per) != 0) bad = t;
                    }
                    CHECK(bad < 0, "%s batch rows%s%s T=%lld, %d threads: token %lld differs from its solo product", qt->name,
                          q8 ? " (q8)" : "", moe ? " (experts)" : "", (long long)T, nth, (long long)bad);
                    free(got);
                }
            }
            for (int64_t t = 0; t < T_max; t++) free(solo[t]);
        }
    }
    free(wq);
    free(xs);
    free(lg);
}

static void test_batch_rows(void) {
    for (int i = 0; i < N_QTYPES; i++) test_batch_rows_type(&qtypes[i]);
    test_batch_rows_type(&qtype_mxfp4);
}

// Weights in tiles (kvr_weight_tile, what kvr_model_load does on a CPU with AVX-512 VNNI): Q4_0,
// Q4_1, Q5_0, Q5_1 and Q8_0, 48 rows (3 tiles) of 29 blocks, and Q4_K, Q5_K and Q6_K, 48 rows of
// 3 super-blocks. The tiles' bytes against the layout kvr.h and kvr.c
// describe, computed here from the file's blocks; untiling gives the file's bytes back. Through
// kvr_mul_mat with 8-bit activations every count of tokens (1..9, and a prompt of 37) gives each
// token the bits it gets alone, on 1 and 3 threads, and a prompt the bits of the file's rows
// through the interleaving prompt kernel (the same integers and float steps); one token is within
// 1e-5 of the file's row kernel. The exact paths, the reference kernels (exact and 8-bit) and
// get-rows give the file's rows' bits (the decode of one token: within 1e-5, another kernel).
static float * tile_run(enum kvr_type type, const uint8_t * wq, bool tiled, const float * xs, int64_t T, int nth, bool q8, bool ref,
                        bool rows) {
    const int64_t K = kvr_blck_size(type) == 256 ? 768 : 928, N = 48;
    struct kvr_context * ctx = kvr_init(8u << 20, false);
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, type, K, N);
    memcpy(w->data, wq, kvr_nbytes(w));
    if (tiled) KVR_ASSERT(kvr_weight_tile(w));
    struct kvr_tensor * y;
    if (rows) {
        struct kvr_tensor * ids = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, T);
        for (int64_t t = 0; t < T; t++) ((int32_t *)ids->data)[t] = (int32_t)((t * 7 + 3) % N);
        y = kvr_get_rows(ctx, w, ids);
    } else {
        struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
        memcpy(x->data, xs, sizeof(float) * (size_t)(K * T));
        y = kvr_mul_mat(ctx, w, x);
    }
    y->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, y);
    struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = q8,
                                                                                    .ref_kernels = ref });
    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
    KVR_ASSERT(be && buf);
    kvr_graph_place(g, buf);
    const int rc = kvr_backend_graph_compute(be, g);
    CHECK(rc == KVR_OK, "tiles %s T=%lld: compute returned %d (%s)", kvr_type_name(type), (long long)T, rc, kvr_last_error());
    const size_t n_out = (size_t)(rows ? K : N) * (size_t)T;
    float * out = malloc(sizeof(float) * n_out);
    memcpy(out, y->data, sizeof(float) * n_out);
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    kvr_free(ctx);
    return out;
}

// the largest difference relative to the largest value of b
static double tile_rel(const float * a, const float * b, size_t n) {
    double worst = 0.0, big = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (fabs((double)a[i] - b[i]) > worst) worst = fabs((double)a[i] - b[i]);
        if (fabs((double)b[i]) > big) big = fabs((double)b[i]);
    }
    return big > 0.0 ? worst / big : worst;
}

static void test_tiles_type(const struct qtype * qt) {
    const int64_t K = qt->blck == 256 ? 768 : 928, N = 48, nb = K / qt->blck, T_max = 9, T_long = 37;
    const size_t rb = (size_t)(nb * qt->size), bytes = rb * (size_t)N;
    uint8_t * wq = malloc(bytes), * tl = malloc(bytes);
    float * xs = malloc(sizeof(float) * (size_t)(K * T_long));
    random_blocks(qt, wq, (int)(nb * N));
    for (int64_t i = 0; i < K * T_long; i++) xs[i] = rng_normal();
    struct kvr_context * ctx = kvr_init(1u << 20, false);
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, qt->type, K, N);
    memcpy(w->data, wq, bytes);
    if (!kvr_weight_tile(w)) {
        skip("tiles %s: this build's CPU kernels read no tiles", qt->name);
        kvr_free(ctx);
        free(wq), free(tl), free(xs);
        return;
    }
    CHECK((w->flags & KVR_FLAG_TILED) && !kvr_weight_tile(w), "tiles %s: flagged, and not tiled twice", qt->name);
    memcpy(tl, w->data, bytes);
    // the layout: block b of tile g at g 16 rb + b 16 size holds the block's fields in the file's
    // order, each for the 16 rows: a 2-byte field row i's at 2i, a field of 4m bytes as m vectors of
    // 64 bytes, row i's bytes 4j..4j+3 at 64j + 4i; Q8_0's quants with the sign bit flipped
    static const struct { enum kvr_type type; int size[5]; } fields[] = {
        { KVR_TYPE_Q4_0, { 2, 16 } },        { KVR_TYPE_Q4_1, { 2, 2, 16 } },      { KVR_TYPE_Q5_0, { 2, 4, 16 } },
        { KVR_TYPE_Q5_1, { 2, 2, 4, 16 } }, { KVR_TYPE_Q8_0, { 2, 32 } },         { KVR_TYPE_Q4_K, { 2, 2, 12, 128 } },
        { KVR_TYPE_Q5_K, { 2, 2, 12, 32, 128 } }, { KVR_TYPE_Q6_K, { 128, 64, 16, 2 } },
    };
    const int * size = NULL;
    for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) if (fields[f].type == qt->type) size = fields[f].size;
    CHECK(size != NULL, "tiles %s: a type the test has no layout of", qt->name);
    int64_t bad = 0;
    for (int64_t n = 0; size && n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t * blk = wq + (size_t)n * rb + (size_t)b * (size_t)qt->size;
            const uint8_t * tf = tl + (size_t)(n / 16) * 16 * rb + (size_t)b * 16 * (size_t)qt->size;
            const int i = (int)(n % 16);
            for (int k = 0; k < 5 && size[k]; k++) {
                const uint8_t flip = qt->type == KVR_TYPE_Q8_0 && k == 1 ? 0x80 : 0;
                for (int j = 0; j < size[k]; j++) {
                    const uint8_t got = size[k] == 2 ? tf[2 * i + j] : tf[64 * (j / 4) + 4 * i + j % 4];
                    bad += got != (uint8_t)(blk[j] ^ flip);
                }
                blk += size[k];
                tf += 16 * size[k];
            }
        }
    }
    CHECK(bad == 0, "tiles %s: %lld fields not where the layout puts them", qt->name, (long long)bad);
    kvr_weight_untile(w);
    CHECK(!(w->flags & KVR_FLAG_TILED) && memcmp(w->data, wq, bytes) == 0, "tiles %s: untiled, the file's bytes", qt->name);
    kvr_free(ctx);

    // 8-bit activations: each token alone, and with others, on the tiles
    float * solo[9];
    for (int64_t t = 0; t < T_max; t++) solo[t] = tile_run(qt->type, wq, true, xs + t * K, 1, 1, true, false, false);
    for (int nth = 1; nth <= 3; nth += 2) {
        for (int64_t T = 1; T <= T_max; T++) {
            const int64_t t0 = T_max - T;
            float * got = tile_run(qt->type, wq, true, xs + t0 * K, T, nth, true, false, false);
            int64_t diff = -1;
            for (int64_t t = 0; t < T && diff < 0; t++) {
                if (memcmp(got + t * N, solo[t0 + t], sizeof(float) * (size_t)N) != 0) diff = t;
            }
            CHECK(diff < 0, "tiles %s (q8) T=%lld, %d threads: token %lld differs from its solo product", qt->name, (long long)T, nth,
                  (long long)diff);
            free(got);
        }
    }
    float * plain1 = tile_run(qt->type, wq, false, xs, 1, 1, true, false, false);
    const double d1 = tile_rel(solo[0], plain1, (size_t)N);
    CHECK(d1 < 1e-5, "tiles %s (q8): one token within 1e-5 of the file's row kernel (%g)", qt->name, d1);
    free(plain1);
    for (int64_t t = 0; t < T_max; t++) free(solo[t]);
    float * tp = tile_run(qt->type, wq, true, xs, T_long, 2, true, false, false);
    float * pp = tile_run(qt->type, wq, false, xs, T_long, 2, true, false, false);
    CHECK(memcmp(tp, pp, sizeof(float) * (size_t)(N * T_long)) == 0, "tiles %s (q8): a prompt of %lld gets the prompt kernel's bits "
          "(%g)", qt->name, (long long)T_long, tile_rel(tp, pp, (size_t)(N * T_long)));
    free(tp), free(pp);
    // the exact paths, the reference kernels and get-rows: the file's rows
    const struct { bool q8, ref, rows; int64_t T; } cs[] = {
        { false, false, false, 1 }, { false, false, false, 6 }, { false, false, false, T_long },
        { false, true, false, 3 },  { true, true, false, 3 },   { false, false, true, 5 },
    };
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        float * a = tile_run(qt->type, wq, true, xs, cs[c].T, 2, cs[c].q8, cs[c].ref, cs[c].rows);
        float * b = tile_run(qt->type, wq, false, xs, cs[c].T, 2, cs[c].q8, cs[c].ref, cs[c].rows);
        const size_t n = (size_t)(cs[c].rows ? K : N) * (size_t)cs[c].T;
        const bool decode = !cs[c].q8 && !cs[c].ref && !cs[c].rows && cs[c].T == 1; // the file's one-token row kernel
        if (decode) {
            CHECK(tile_rel(a, b, n) < 1e-5, "tiles %s exact T=1: within 1e-5 of the file's rows (%g)", qt->name, tile_rel(a, b, n));
        } else {
            CHECK(memcmp(a, b, sizeof(float) * n) == 0, "tiles %s %s%s%s T=%lld: the file's rows' bits (%g)", qt->name,
                  cs[c].rows ? "get-rows" : cs[c].q8 ? "q8" : "exact", cs[c].ref ? " (reference kernels)" : "", "",
                  (long long)cs[c].T, tile_rel(a, b, n));
        }
        free(a), free(b);
    }
    free(wq), free(tl), free(xs);
}

// One tiled matmul alone on a backend of its own: what a node of a bigger graph must give.
static float * tile_alone(enum kvr_type type, const uint8_t * wq, int64_t K, int64_t N, const float * xs, int64_t T, int nth) {
    struct kvr_context * ctx = kvr_init(8u << 20, false);
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, type, K, N), * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
    memcpy(w->data, wq, kvr_nbytes(w));
    KVR_ASSERT(kvr_weight_tile(w));
    memcpy(x->data, xs, sizeof(float) * (size_t)(K * T));
    struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
    struct kvr_graph * g = kvr_graph_new(ctx, 8);
    kvr_graph_expand(g, y);
    struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = true });
    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
    KVR_ASSERT(be && buf);
    kvr_graph_place(g, buf);
    CHECK(kvr_backend_graph_compute(be, g) == KVR_OK, "tiles alone %s: %s", kvr_type_name(type), kvr_last_error());
    float * out = malloc(sizeof(float) * (size_t)(N * T));
    memcpy(out, y->data, sizeof(float) * (size_t)(N * T));
    kvr_buffer_free(buf);
    kvr_backend_free(be);
    kvr_free(ctx);
    return out;
}

// A decode step's q, k and v (and gate and up) read one input, and each thread keeps that input's
// 8-bit activations for the next matmul of the same input (struct qx_act_cache): seven matmuls in
// one graph over two inputs of one shape, with weights of types whose activations differ (Q4_1,
// Q5_0 and Q8_0 blocks with their offsets folded in, Q4_K's super-blocks) and types that share
// them, run twice on one backend with the inputs changed between: every product the bits of the
// same matmul alone.
static void test_tiles_shared_input(void) {
    static const enum kvr_type types[] = { KVR_TYPE_Q4_1, KVR_TYPE_Q4_1, KVR_TYPE_Q5_0, KVR_TYPE_Q4_K, KVR_TYPE_Q4_1, KVR_TYPE_Q8_0,
                                           KVR_TYPE_Q4_1 };
    enum { NW = sizeof(types) / sizeof(types[0]) };
    const int64_t K = 768, N = 48;
    for (int nth = 1; nth <= 3; nth += 2) {
        for (int64_t T = 1; T <= 9; T += 4) {
            struct kvr_context * ctx = kvr_init(16u << 20, false);
            struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T), * z = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
            uint8_t * wq[NW];
            struct kvr_tensor * y[NW];
            bool tiled = true;
            for (int i = 0; i < NW; i++) {
                const struct qtype * qt = NULL;
                for (int q = 0; q < N_QTYPES; q++) if (qtypes[q].type == types[i]) qt = &qtypes[q];
                KVR_ASSERT(qt != NULL);
                struct kvr_tensor * w = kvr_new_tensor_2d(ctx, types[i], K, N);
                wq[i] = malloc(kvr_nbytes(w));
                random_blocks(qt, wq[i], (int)(K / qt->blck * N));
                memcpy(w->data, wq[i], kvr_nbytes(w));
                tiled = tiled && kvr_weight_tile(w);
                y[i] = kvr_mul_mat(ctx, w, i == 4 ? z : x); // the fifth: the other input, of the same shape
            }
            struct kvr_graph * g = kvr_graph_new(ctx, 32);
            for (int i = 0; i < NW; i++) kvr_graph_expand(g, y[i]);
            struct kvr_backend * be = tiled ? kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = true }) : NULL;
            struct kvr_buffer * buf = be ? kvr_backend_alloc_buffer(be, kvr_graph_plan(g)) : NULL;
            if (!tiled) skip("tiles, one input for several matmuls: this build's CPU kernels read no tiles");
            else        kvr_graph_place(g, buf);
            for (int run = 0; buf && run < 2; run++) {
                for (int64_t e = 0; e < K * T; e++) {
                    ((float *)x->data)[e] = rng_normal();
                    ((float *)z->data)[e] = rng_normal();
                }
                const int rc = kvr_backend_graph_compute(be, g);
                CHECK(rc == KVR_OK, "tiles, one input: compute returned %d (%s)", rc, kvr_last_error());
                for (int i = 0; rc == KVR_OK && i < NW; i++) {
                    float * want = tile_alone(types[i], wq[i], K, N, i == 4 ? z->data : x->data, T, nth);
                    CHECK(memcmp(want, y[i]->data, sizeof(float) * (size_t)(N * T)) == 0,
                          "tiles, one input for several matmuls: %s matmul %d of the graph, T=%lld, %d threads, run %d: not its bits alone",
                          kvr_type_name(types[i]), i, (long long)T, nth, run);
                    free(want);
                }
            }
            kvr_buffer_free(buf);
            kvr_backend_free(be);
            for (int i = 0; i < NW; i++) free(wq[i]);
            kvr_free(ctx);
        }
    }
}

static void test_tiles(void) {
    test_tiles_shared_input();
    for (int i = 0; i < N_QTYPES; i++) {
        const enum kvr_type t = qtypes[i].type;
        if ((t != KVR_TYPE_Q8_1 && qtypes[i].blck == 32) || t == KVR_TYPE_Q4_K || t == KVR_TYPE_Q5_K || t == KVR_TYPE_Q6_K) {
            test_tiles_type(&qtypes[i]);
        }
    }
}

// The tiny-llama files hold one set of random weights quantized to several types: each quantized
// tensor must match the Q8_0 file's copy within its format's error (a wrong bit layout gives an
// error near sqrt(2)), and the Q4_0/Q5_0/Q8_0/Q4_K blocks llama.cpp wrote must come back byte for
// byte when their dequantized values are quantized again.
static const char * const tiny_files[] = { "Q8_0", "Q4_0", "Q5_0", "Q6_K", "Q4_K_M" };

static float * dequant_tensor(const struct kvr_gguf_tensor * t, int64_t * n_out) {
    const int64_t n = t->ne[0] * (t->n_dims > 1 ? t->ne[1] : 1);
    float * f = malloc(sizeof(float) * (size_t)n);
    kvr_to_float(t->type, t->data, f, n);
    *n_out = n;
    return f;
}

static void test_tiny_llama(const char * shared) {
    char path[1024];
    snprintf(path, sizeof path, "%s/reference/tiny-llama-%s.gguf", shared, tiny_files[0]);
    struct kvr_gguf * q8 = kvr_gguf_open(path);
    if (!q8) {
        skip("the tiny-llama checks (%s)", kvr_last_error());
        return;
    }
    for (size_t f = 0; f < sizeof tiny_files / sizeof tiny_files[0]; f++) {
        snprintf(path, sizeof path, "%s/reference/tiny-llama-%s.gguf", shared, tiny_files[f]);
        struct kvr_gguf * g = kvr_gguf_open(path);
        CHECK(g != NULL, "open %s: %s", path, kvr_last_error());
        if (!g) continue;
        int n_tensors = 0;
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            const struct kvr_gguf_tensor * t = &g->tensors[i];
            const struct kvr_gguf_tensor * r = kvr_gguf_get_tensor(q8, t->name);
            if (kvr_blck_size(t->type) <= 1 || !r) continue;
            n_tensors++;
            int64_t n, nr;
            float * a = dequant_tensor(t, &n);
            float * b = dequant_tensor(r, &nr);
            double err2 = 0, sum2 = 0;
            int finite = 1;
            for (int64_t e = 0; e < n && n == nr; e++) {
                finite &= isfinite(a[e]);
                err2 += ((double)a[e] - b[e]) * ((double)a[e] - b[e]);
                sum2 += (double)b[e] * b[e];
            }
            const double rel = sqrt(err2 / sum2);
            double tol = 0.0;
            switch (t->type) {
                case KVR_TYPE_Q8_0: tol = 0.0;  break; // the same file: identical
                case KVR_TYPE_Q6_K: tol = 0.03; break;
                case KVR_TYPE_Q5_0: tol = 0.07; break;
                case KVR_TYPE_Q4_K: tol = 0.12; break;
                case KVR_TYPE_Q4_0: tol = 0.15; break;
                default:            tol = 0.3;  break;
            }
            CHECK(n == nr && finite && rel <= tol, "%s %s (%s): relative RMS difference to the q8_0 copy %.4g > %.3g",
                  tiny_files[f], t->name, kvr_type_name(t->type), rel, tol);

            if (t->type == KVR_TYPE_Q8_0 || t->type == KVR_TYPE_Q4_0 || t->type == KVR_TYPE_Q5_0 ||
                t->type == KVR_TYPE_Q4_K) {
                const size_t bytes = kvr_row_size(t->type, n);
                uint8_t * re = malloc(bytes);
                const size_t wrote = kvr_from_float(t->type, a, re, n);
                int64_t diff_blocks = 0;
                for (size_t o = 0; o < bytes; o += kvr_type_size(t->type)) {
                    diff_blocks += memcmp(re + o, (const uint8_t *)t->data + o, kvr_type_size(t->type)) != 0;
                }
                CHECK(wrote == bytes && diff_blocks == 0, "%s %s: %lld of %lld blocks requantize differently",
                      tiny_files[f], t->name, (long long)diff_blocks, (long long)(bytes / kvr_type_size(t->type)));
                free(re);
            }
            free(a); free(b);
        }
        CHECK(n_tensors > 0, "%s: no quantized tensors", tiny_files[f]);
        kvr_gguf_close(g);
    }
    kvr_gguf_close(q8);
}
#endif

// kvr.h's shared half-precision conversions on every half: to f32 exactly as the reference
// decodes it, back to the same half (nan stays nan), and bf16 likewise through its bits
// MXFP4 (gpt-oss's experts): the block layout bit for bit (test_dequant, at odd addresses too, and
// through kvr_dequant_block), a row's dot and a graph's MUL_MAT; the quantizer against ggml's
// rule (the exponent floor(log2 amax) - 2, each value the nearest code, the first of equals); and
// the 8-bit path (--q8-act) against ggml's vec_dot_mxfp4_q8_0 in integers: per block d_a 2^(e-128)
// times the sum of doubled E2M1 values times the Q8_0 quants.
static void test_mxfp4(void) {
    const struct qtype * qt = &qtype_mxfp4;
    CHECK(kvr_blck_size(qt->type) == 32 && kvr_type_size(qt->type) == 17 && strcmp(kvr_type_name(qt->type), "mxfp4") == 0,
          "mxfp4: block %lld x %zu bytes, name %s", (long long)kvr_blck_size(qt->type), kvr_type_size(qt->type), kvr_type_name(qt->type));
    test_dequant(qt);
    test_row_dot(qt);
#ifndef QUANT_STANDALONE
    test_mul_mat(qt);
#endif
    // the quantizer: ggml's rule written out here
    enum { NB = 64 };
    float x[NB * 32];
    uint8_t got[NB * 17], want[NB * 17];
    for (int b = 0; b < NB; b++) {
        const float scale = ldexpf(1.0f, (int)(rng_u64() % 20) - 10);
        for (int i = 0; i < 32; i++) x[b * 32 + i] = b % 9 == 4 ? 0.0f : rng_normal() * scale;
        if (b % 5 == 1) x[b * 32 + 3] = -x[b * 32 + 3] * 0.0f; // a -0
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fabsf(x[b * 32 + i]) > amax ? fabsf(x[b * 32 + i]) : amax;
        uint8_t * blk = want + b * 17;
        blk[0] = amax > 0 ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0;
        memset(blk + 1, 0, 16);
        for (int i = 0; i < 32; i++) {
            int best = 0;
            float err = INFINITY;
            for (int c = 0; c < 16; c++) {
                uint8_t probe[17] = { blk[0] };
                probe[1] = (uint8_t)c;
                const float e = fabsf(ref_mxfp4(probe, 0) - x[b * 32 + i]);
                if (e < err) { err = e; best = c; }
            }
            blk[1 + i % 16] |= (uint8_t)(best << (i < 16 ? 0 : 4));
        }
    }
    CHECK(kvr_from_float(KVR_TYPE_MXFP4, x, got, NB * 32) == NB * 17, "mxfp4: from_float wrote another size");
    int bad = 0;
    for (int b = 0; b < NB; b++) bad += memcmp(got + b * 17, want + b * 17, 17) != 0;
    CHECK(bad == 0, "mxfp4 quantizer: %d of %d blocks differ from ggml's rule", bad, NB);
#ifndef QUANT_STANDALONE
    // the 8-bit path, decode and prefill, 1 and 3 threads
    const int64_t K = 320, N = 29;
    static const int Ts[] = { 1, 3, 37 };
    for (int nth = 1; nth <= 3; nth += 2) {
        for (int ti = 0; ti < 3; ti++) {
            const int64_t T = Ts[ti];
            struct kvr_context * ctx = kvr_init(4u << 20, false);
            struct kvr_tensor * w = kvr_new_tensor_2d(ctx, KVR_TYPE_MXFP4, K, N);
            struct kvr_tensor * xt = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
            random_blocks(qt, w->data, (int)(K / 32 * N));
            for (int64_t i = 0; i < K * T; i++) ((float *)xt->data)[i] = rng_normal();
            struct kvr_tensor * y = kvr_mul_mat(ctx, w, xt);
            y->flags |= KVR_FLAG_OUTPUT;
            struct kvr_graph * g = kvr_graph_new(ctx, 16);
            kvr_graph_expand(g, y);
            struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = nth, .q8_activations = true });
            struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, kvr_graph_plan(g));
            kvr_graph_place(g, buf);
            const int rc = kvr_backend_graph_compute(be, g);
            CHECK(rc == KVR_OK, "mxfp4 q8 mul_mat: %s", kvr_last_error());
            double worst = 0;
            for (int64_t t = 0; t < T && rc == KVR_OK; t++) {
                const float * xr = (const float *)xt->data + t * K;
                for (int64_t n = 0; n < N; n++) {
                    const uint8_t * row = (const uint8_t *)w->data + n * w->nb[1];
                    double ref = 0, mag = 0;
                    for (int64_t b = 0; b < K / 32; b++) {
                        int8_t q[32];
                        float d, sd;
                        ref_act_q8_0(xr + 32 * b, q, &d, &sd);
                        long sumi = 0;
                        for (int e = 0; e < 32; e++) {
                            const float v = ref_mxfp4(row + 17 * b, e); // doubled value times 2^(e-128)
                            sumi += lrintf(ldexpf(v, 128 - (int)row[17 * b])) * q[e];
                            mag += fabs((double)v * xr[32 * b + e]);
                        }
                        ref += (double)d * ldexp(1.0, (int)row[17 * b] - 128) * (double)sumi;
                    }
                    const double err = fabs(((const float *)y->data)[t * N + n] - ref) / (mag + 1e-30);
                    if (err > worst) worst = err;
                }
            }
            CHECK(worst <= 1e-5, "mxfp4 q8 mul_mat T=%lld, %d threads: worst relative error %.3g against the integer reference",
                  (long long)T, nth, worst);
            kvr_buffer_free(buf);
            kvr_backend_free(be);
            kvr_free(ctx);
        }
    }
#endif
}

static void test_halves(void) {
    int bad_h = -1, bad_b = -1;
    for (uint32_t i = 0; i < 65536; i++) {
        const uint8_t le[2] = { (uint8_t)(i & 0xff), (uint8_t)(i >> 8) };
        const float f = kvr_half_to_f32((uint16_t)i), r = ref_half(le);
        const bool is_nan = isnan(r);
        if (bad_h < 0 && (is_nan ? !isnan(f) || (kvr_f32_to_half(f) & 0x7c00) != 0x7c00 || !(kvr_f32_to_half(f) & 0x3ff)
                                 : !same_float(f, r) || kvr_f32_to_half(f) != i)) bad_h = (int)i;
        const float fb = kvr_bfloat_to_f32((uint16_t)i);
        uint32_t u;
        memcpy(&u, &fb, 4);
        if (bad_b < 0 && (u != i << 16 || (!isnan(fb) && kvr_f32_to_bfloat(fb) != i))) bad_b = (int)i;
    }
    CHECK(bad_h < 0, "kvr_half_to_f32/kvr_f32_to_half: half 0x%04x does not round-trip", bad_h);
    CHECK(bad_b < 0, "kvr_bfloat_to_f32/kvr_f32_to_bfloat: bf16 0x%04x does not round-trip", bad_b);
    // rounding to nearest even at a tie, and overflow to inf
    CHECK(kvr_f32_to_half(1.0f + 0x1p-11f) == 0x3c00 && kvr_f32_to_half(1.0f + 0x3p-11f) == 0x3c02 &&
          kvr_f32_to_half(65520.0f) == 0x7c00 && kvr_f32_to_half(65519.0f) == 0x7bff,
          "kvr_f32_to_half: ties to even or overflow wrong");
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    (void)shared;
    rng_state = 0x5eed0000u;
    test_halves();
    test_mxfp4();

    for (int i = 0; i < N_QTYPES; i++) {
        const struct qtype * qt = &qtypes[i];
        CHECK(kvr_blck_size(qt->type) == qt->blck && kvr_type_size(qt->type) == (size_t)qt->size,
              "%s: block %lld x %zu bytes, expected %d x %d", qt->name, (long long)kvr_blck_size(qt->type),
              kvr_type_size(qt->type), qt->blck, qt->size);
        test_dequant(qt);
        test_row_dot(qt);
        test_round_trip(qt);
        test_quantize_exact(qt);
#ifndef QUANT_STANDALONE
        test_mul_mat(qt);
#endif
    }
#ifndef QUANT_STANDALONE
    test_mul_mat_q8();
    test_mul_vec();
    test_mul_q8(); // after the exact checks, which keep their random inputs
    test_fast_vs_ref();
    test_batch_rows();
    test_tiles();
    test_tiny_llama(shared);
#endif

    return check_summary("quant");
}
