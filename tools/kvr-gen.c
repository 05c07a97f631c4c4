// kvr-gen.c - writes random-weight GGUF models with the shapes of real architectures, for tests
// and benchmarks: the same tensor names, shapes and metadata keys as llama.cpp's convert script,
// so the files load in kvr and in llama.cpp alike. Llama presets: tinyllama-1.1b, llama-7b,
// llama-3.2-1b and the few-MB tiny (GQA), tiny-mha, tiny-mqa; falcon presets (7B layout, BPE
// vocabulary from --vocab): falcon-7b and tiny; qwen2: qwen2.5-0.5b; qwen3: qwen3-0.6b; gemma3:
// gemma-3-270m, gemma-3-1b (the real models' shapes: the files people run, with random weights);
// phi3 (fused QKV and gate-up; LongRoPE factors when the context exceeds 4096): phi-3.5-mini and
// tiny; gemma2 (head size of its own, post norms, soft-caps, alternating windows, tied output):
// gemma-2-2b and tiny; qwen3moe (a mixture of experts, head size 128 from attention.key_length):
// qwen3-30b-a3b (its layer shapes: 128 experts of width 768, 8 a token; --layers makes fewer of
// them) and tiny; qwen35 (Qwen3.5's hybrid: Gated DeltaNet layers, every 4th layer gated full
// attention): qwen3.5-0.8b's layer shapes and tiny.
//
// --ftype q4_k_m|q5_k_m|q6_k|q8_0 writes the per-tensor mixture llama-quantize makes for that file
// type (without an importance matrix): the output (and a tied token embedding) in Q6_K, Q6_K for V
// and the FFN down projection on the layers that get more bits, and for a width that is not a
// multiple of 256 its fallbacks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; the output in Q8_0), so
// a benchmark sees the types a downloaded file has without llama-quantize (llama, falcon, qwen2,
// qwen3 and gemma3 layouts).
//
// Weights are uniform with the spread of a N(0, 1/fan_in) initialisation, so the residual stream
// and the logits stay of order one through any number of layers; norm weights are 1 plus a little
// noise. Every row of every tensor has its own random stream, seeded from --seed, the tensor's
// name and the row, so a file is the same for any --threads, and a tensor keeps its values when
// the other dimensions (layers, vocabulary) change.
//
// The file is written in two passes so that models larger than memory can be generated: the
// writer lays out the header and reserves every tensor (NULL data), then each tensor is generated
// a slab of rows at a time and written in place. The tokenizer is either copied from a GGUF
// (--vocab: every tokenizer.* key) or a small byte-fallback SPM vocabulary made up here.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "kvr-cli.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include <stb/stb_ds.h>

static const char * usage_line =
    "usage: kvr-gen --preset NAME -o FILE [--type f32|f16|bf16|q8_0|q4_0|... | --ftype q4_k_m|...]\n"
    "               [--seed S] [--vocab GGUF] [--arch llama|falcon|qwen2|qwen3|gemma3|phi3|gemma2|qwen3moe|qwen35]\n"
    "               [--layers N] [--ctx N] [--heads N] [--kv-heads N] [--embd N] [--ff N] [--vocab-size N]\n"
    "               [--threads N] [--quiet]";

static void usage_error(const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;

static void usage_error(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvr-gen: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n%s\n(kvr-gen -h for every option)\n", usage_line);
    va_end(ap);
    exit(2);
}

//
// presets
//

struct gen_shape {
    const char * name;
    const char * arch;       // "llama", "falcon", "qwen2", "qwen3", "gemma3", "phi3", "gemma2", "qwen3moe" or "qwen35"
    uint32_t n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
    float    rope_base, norm_eps;
    uint32_t head_dim;       // 0: n_embd / n_head
    bool     tied;           // no output.weight: the token embedding serves as the output
    uint32_t n_swa;          // gemma3: the sliding window of its local layers
    uint32_t n_expert, n_expert_used, n_ff_exp; // qwen3moe
    // qwen35: the rotated dims, and the Gated DeltaNet layers' key heads, value heads and their
    // size (state_size)
    uint32_t n_rot, ssm_groups, ssm_v_heads, ssm_state;
};

static const struct gen_shape presets[] = {
    // name              arch     embd  layers heads kv  ff     vocab   ctx    rope     eps    head tied  swa  experts used ffn_exp (qwen3moe), n_rot groups v_heads state (qwen35)
    { "tinyllama-1.1b", "llama", 2048, 22,    32,   4,  5632,  32000,  2048,  10000,   1e-5f, 0,   false, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "llama-7b",       "llama", 4096, 32,    32,   32, 11008, 32000,  4096,  10000,   1e-5f, 0,   false, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "llama-3.2-1b",   "llama", 2048, 16,    32,   8,  8192,  128256, 8192,  500000,  1e-5f, 0,   true,  0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny",           "llama", 256,  4,     8,    4,  768,   1024,   4096,  10000,   1e-5f, 0,   false, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny-mha",       "llama", 256,  4,     8,    8,  768,   1024,   4096,  10000,   1e-5f, 0,   false, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny-mqa",       "llama", 256,  4,     8,    1,  768,   1024,   4096,  10000,   1e-5f, 0,   false, 0, 0, 0, 0, 0, 0, 0, 0 },
    // falcon: the vocabulary comes from --vocab (a BPE one: ggml-vocab-falcon.gguf)
    { "falcon-7b",      "falcon", 4544, 32,   71,   1,  18176, 65024,  2048,  10000,   1e-5f, 0,   true,  0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny",           "falcon", 256,  4,    8,    1,  1024,  65024,  4096,  10000,   1e-5f, 0,   true,  0, 0, 0, 0, 0, 0, 0, 0 },
    { "qwen2.5-0.5b",   "qwen2", 896,  24,    14,   2,  4864,  151936, 32768, 1000000, 1e-6f, 0,   true,  0, 0, 0, 0, 0, 0, 0, 0 },
    { "qwen3-0.6b",     "qwen3", 1024, 28,    16,   8,  3072,  151936, 40960, 1000000, 1e-6f, 128, true,  0, 0, 0, 0, 0, 0, 0, 0 },
    { "gemma-3-270m",   "gemma3", 640, 18,    4,    1,  2048,  262144, 32768, 1000000, 1e-6f, 256, true,  512, 0, 0, 0, 0, 0, 0, 0 },
    { "gemma-3-1b",     "gemma3", 1152, 26,   4,    1,  6912,  262144, 32768, 1000000, 1e-6f, 256, true,  512, 0, 0, 0, 0, 0, 0, 0 },
    // phi3: a context past 4096 brings LongRoPE's factors (Phi-3.5-mini's 128k)
    { "phi-3.5-mini", "phi3", 3072, 32, 32, 32, 8192, 32064, 131072, 10000, 1e-5f, 0, false, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny", "phi3", 256, 4, 8, 4, 768, 1024, 131072, 10000, 1e-5f, 0, false, 0, 0, 0, 0, 0, 0, 0, 0 },
    // gemma2: the head size (key_length) is not n_embd / n_head
    { "gemma-2-2b", "gemma2", 2304, 26, 8, 4, 9216, 256000, 8192, 10000, 1e-6f, 256, true, 0, 0, 0, 0, 0, 0, 0, 0 },
    { "tiny", "gemma2", 256, 4, 8, 4, 768, 1024, 4096, 10000, 1e-6f, 64, true, 0, 0, 0, 0, 0, 0, 0, 0 },
    // qwen3moe: Qwen3-30B-A3B's layers (48 of them there); n_ff is the file's unused dense width
    { "qwen3-30b-a3b", "qwen3moe", 2048, 48, 32, 4, 6144, 151936, 40960, 1e6f, 1e-6f, 128, false, 0, 128, 8, 768, 0, 0, 0, 0 },
    { "tiny", "qwen3moe", 256, 4, 8, 2, 768, 1024, 4096, 1e6f, 1e-6f, 64, false, 0, 8, 2, 128, 0, 0, 0, 0 },
    // qwen35: head_dim, then n_rot, key heads, value heads, state size
    { "qwen3.5-0.8b", "qwen35", 1024, 24, 8, 2, 3584, 1024, 4096, 1e7f, 1e-6f, 256, false, 0, 0, 0, 0, 64, 16, 16, 128 },
    { "tiny", "qwen35", 256, 4, 4, 2, 768, 1024, 4096, 1e7f, 1e-6f, 64, false, 0, 0, 0, 0, 16, 2, 4, 32 },
};

//
// random numbers: splitmix64, one stream per row
//

static uint64_t splitmix64(uint64_t * state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t hash_name(const char * s) {
    uint64_t h = 0xcbf29ce484222325ull; // FNV-1a
    for (; *s; s++) {
        h = (h ^ (uint8_t) *s) * 0x100000001b3ull;
    }
    return h;
}

// What the values of a tensor are: center + uniform(-spread, spread).
struct gen_dist {
    float center;
    float spread;
};

static void gen_row(float * out, int64_t n, uint64_t seed, uint64_t tensor_hash, int64_t row,
                    struct gen_dist d) {
    uint64_t s = seed ^ tensor_hash;
    s = splitmix64(&s) ^ (uint64_t) row;
    s = splitmix64(&s);
    const float scale = d.spread * (2.0f / 16777216.0f);
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
        const uint64_t x = splitmix64(&s);
        out[i]     = d.center + ((float) (x >> 40)              * scale - d.spread);
        out[i + 1] = d.center + ((float) ((x >> 16) & 0xffffff) * scale - d.spread);
    }
    if (i < n) {
        out[i] = d.center + ((float) (splitmix64(&s) >> 40) * scale - d.spread);
    }
}

//
// tensors to generate
//

struct gen_tensor {
    char            name[KVR_MAX_NAME];
    enum kvr_type   type;
    int             n_dims;
    int64_t         ne[3];   // ne[2]: the experts of a 3-D expert tensor (1 otherwise)
    struct gen_dist dist;
    uint64_t        file_offset; // where its data goes, from the reopened file
};

static void add_tensor(struct gen_tensor ** ts, const char * name, enum kvr_type type, int n_dims,
                       int64_t ne0, int64_t ne1, struct gen_dist dist) {
    struct gen_tensor t = { .type = type, .n_dims = n_dims, .ne = { ne0, ne1, 1 }, .dist = dist };
    snprintf(t.name, sizeof(t.name), "%s", name);
    arrput(*ts, t);
}

static struct gen_dist matrix_dist(int64_t fan_in) {
    // uniform(-a, a) has variance a^2/3: a = sqrt(3/fan_in) gives variance 1/fan_in
    return (struct gen_dist) { 0.0f, sqrtf(3.0f / (float) fan_in) };
}

static const struct gen_dist norm_dist = { 1.0f, 0.05f };
static const struct gen_dist bias_dist = { 0.0f, 0.02f };

// What a weight matrix is in a file of a llama-quantize mixture (enum gen_ftype); plain --type
// files have one type for every matrix.
enum gen_role { ROLE_TOKEN_EMBD, ROLE_OUTPUT, ROLE_ATTN_V, ROLE_FFN_DOWN, ROLE_ATTN_QKV, ROLE_OTHER };

// The llama-family layers (llama, qwen2, qwen3, gemma3): what differs is which optional pieces a
// layer has (Q/K/V biases, per-head Q/K norms, norms after attention and FFN) and the head size.
static struct gen_tensor * llama_tensors(const struct gen_shape * s, enum kvr_type wtype, enum gen_role ** roles) {
    struct gen_tensor * ts = NULL;
    const int64_t embd   = s->n_embd;
    const int64_t hd     = s->head_dim ? s->head_dim : s->n_embd / s->n_head;
    const int64_t embd_q = hd * s->n_head, embd_k = hd * s->n_head_kv;
    const bool bias = strcmp(s->arch, "qwen2") == 0;
    const bool qk_norm = strcmp(s->arch, "qwen3") == 0 || strcmp(s->arch, "gemma3") == 0;
    const bool post = strcmp(s->arch, "gemma3") == 0;
    char name[KVR_MAX_NAME];

#define ADD(role, ...) (add_tensor(&ts, __VA_ARGS__), arrput(*roles, role))
    ADD(ROLE_TOKEN_EMBD, "token_embd.weight", wtype, 2, embd, s->n_vocab, (struct gen_dist) { 0.0f, 1.0f });
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        ADD(ROLE_OTHER,    BLK("attn_norm.weight"),   KVR_TYPE_F32, 1, embd, 1, norm_dist);
        ADD(ROLE_OTHER,    BLK("attn_q.weight"),      wtype, 2, embd, embd_q, matrix_dist(embd));
        ADD(ROLE_OTHER,    BLK("attn_k.weight"),      wtype, 2, embd, embd_k, matrix_dist(embd));
        ADD(ROLE_ATTN_V,   BLK("attn_v.weight"),      wtype, 2, embd, embd_k, matrix_dist(embd));
        if (bias) {
            ADD(ROLE_OTHER, BLK("attn_q.bias"), KVR_TYPE_F32, 1, embd_q, 1, bias_dist);
            ADD(ROLE_OTHER, BLK("attn_k.bias"), KVR_TYPE_F32, 1, embd_k, 1, bias_dist);
            ADD(ROLE_OTHER, BLK("attn_v.bias"), KVR_TYPE_F32, 1, embd_k, 1, bias_dist);
        }
        if (qk_norm) {
            ADD(ROLE_OTHER, BLK("attn_q_norm.weight"), KVR_TYPE_F32, 1, hd, 1, norm_dist);
            ADD(ROLE_OTHER, BLK("attn_k_norm.weight"), KVR_TYPE_F32, 1, hd, 1, norm_dist);
        }
        ADD(ROLE_OTHER,    BLK("attn_output.weight"), wtype, 2, embd_q, embd, matrix_dist(embd_q));
        if (post) ADD(ROLE_OTHER, BLK("post_attention_norm.weight"), KVR_TYPE_F32, 1, embd, 1, norm_dist);
        ADD(ROLE_OTHER,    BLK("ffn_norm.weight"),    KVR_TYPE_F32, 1, embd, 1, norm_dist);
        ADD(ROLE_OTHER,    BLK("ffn_gate.weight"),    wtype, 2, embd, s->n_ff, matrix_dist(embd));
        ADD(ROLE_OTHER,    BLK("ffn_up.weight"),      wtype, 2, embd, s->n_ff, matrix_dist(embd));
        ADD(ROLE_FFN_DOWN, BLK("ffn_down.weight"),    wtype, 2, s->n_ff, embd, matrix_dist(s->n_ff));
        if (post) ADD(ROLE_OTHER, BLK("post_ffw_norm.weight"), KVR_TYPE_F32, 1, embd, 1, norm_dist);
#undef BLK
    }
    ADD(ROLE_OTHER, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    if (!s->tied) ADD(ROLE_OUTPUT, "output.weight", wtype, 2, embd, s->n_vocab, matrix_dist(embd));
#undef ADD
    return ts;
}

// Qwen3.5 (dense hybrid): layer il is gated full attention when (il+1) % 4 == 0 (attn_q gives q and a
// gate per head), a Gated DeltaNet layer otherwise; the norms are stored as their final multipliers
// (1 + w, as the converter writes them); ssm_a is -exp(A_log), negative; the output untied (a tied
// random model keeps predicting its input token).
static struct gen_tensor * qwen35_tensors(const struct gen_shape * s, enum kvr_type wtype) {
    struct gen_tensor * ts = NULL;
    const int64_t embd = s->n_embd, D = s->head_dim, q = D * s->n_head, kv = D * s->n_head_kv;
    const int64_t d = s->ssm_state, nk = s->ssm_groups, nv = s->ssm_v_heads, C = 2 * nk * d + nv * d;
    char name[KVR_MAX_NAME];

    add_tensor(&ts, "token_embd.weight", wtype, 2, embd, s->n_vocab, (struct gen_dist) { 0.0f, 1.0f });
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        add_tensor(&ts, BLK("attn_norm.weight"), KVR_TYPE_F32, 1, embd, 1, norm_dist);
        if ((il + 1) % 4 == 0) {
            add_tensor(&ts, BLK("attn_q.weight"),      wtype, 2, embd, 2 * q, matrix_dist(embd));
            add_tensor(&ts, BLK("attn_k.weight"),      wtype, 2, embd, kv,    matrix_dist(embd));
            add_tensor(&ts, BLK("attn_v.weight"),      wtype, 2, embd, kv,    matrix_dist(embd));
            add_tensor(&ts, BLK("attn_output.weight"), wtype, 2, q, embd,     matrix_dist(q));
            add_tensor(&ts, BLK("attn_q_norm.weight"), KVR_TYPE_F32, 1, D, 1, norm_dist);
            add_tensor(&ts, BLK("attn_k_norm.weight"), KVR_TYPE_F32, 1, D, 1, norm_dist);
        } else {
            add_tensor(&ts, BLK("attn_qkv.weight"),    wtype, 2, embd, C,      matrix_dist(embd));
            add_tensor(&ts, BLK("attn_gate.weight"),   wtype, 2, embd, nv * d, matrix_dist(embd));
            add_tensor(&ts, BLK("ssm_conv1d.weight"),  KVR_TYPE_F32, 2, 4, C, matrix_dist(4));
            add_tensor(&ts, BLK("ssm_dt.bias"),        KVR_TYPE_F32, 1, nv, 1, (struct gen_dist) { 0.0f, 1.0f });
            add_tensor(&ts, BLK("ssm_a"),              KVR_TYPE_F32, 1, nv, 1, (struct gen_dist) { -1.0f, 0.5f });
            add_tensor(&ts, BLK("ssm_beta.weight"),    wtype, 2, embd, nv, matrix_dist(embd));
            add_tensor(&ts, BLK("ssm_alpha.weight"),   wtype, 2, embd, nv, matrix_dist(embd));
            add_tensor(&ts, BLK("ssm_norm.weight"),    KVR_TYPE_F32, 1, d, 1, norm_dist);
            add_tensor(&ts, BLK("ssm_out.weight"),     wtype, 2, nv * d, embd, matrix_dist(nv * d));
        }
        add_tensor(&ts, BLK("post_attention_norm.weight"), KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_gate.weight"),    wtype, 2, embd, s->n_ff, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_up.weight"),      wtype, 2, embd, s->n_ff, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_down.weight"),    wtype, 2, s->n_ff, embd, matrix_dist(s->n_ff));
#undef BLK
    }
    add_tensor(&ts, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    add_tensor(&ts, "output.weight",      wtype, 2, embd, s->n_vocab, matrix_dist(embd));
    return ts;
}

// Falcon (7B layout): parallel attention and MLP after one layer norm, fused QKV, GELU MLP, the
// output tied to the token embedding (no output.weight, as the convert script writes falcon-7b).
static struct gen_tensor * falcon_tensors(const struct gen_shape * s, enum kvr_type wtype, enum gen_role ** roles) {
    struct gen_tensor * ts = NULL;
    const int64_t embd   = s->n_embd;
    const int64_t embd_k = (int64_t) s->n_embd / s->n_head * s->n_head_kv;
    char name[KVR_MAX_NAME];

#define ADD(role, ...) (add_tensor(&ts, __VA_ARGS__), arrput(*roles, role))
    ADD(ROLE_TOKEN_EMBD, "token_embd.weight", wtype, 2, embd, s->n_vocab, matrix_dist(embd));
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        ADD(ROLE_OTHER,    BLK("attn_norm.weight"),   KVR_TYPE_F32, 1, embd, 1, norm_dist);
        ADD(ROLE_OTHER,    BLK("attn_norm.bias"),     KVR_TYPE_F32, 1, embd, 1, bias_dist);
        ADD(ROLE_ATTN_QKV, BLK("attn_qkv.weight"),    wtype, 2, embd, embd + 2*embd_k, matrix_dist(embd));
        ADD(ROLE_OTHER,    BLK("attn_output.weight"), wtype, 2, embd, embd,    matrix_dist(embd));
        ADD(ROLE_OTHER,    BLK("ffn_up.weight"),      wtype, 2, embd, s->n_ff, matrix_dist(embd));
        ADD(ROLE_FFN_DOWN, BLK("ffn_down.weight"),    wtype, 2, s->n_ff, embd, matrix_dist(s->n_ff));
#undef BLK
    }
    ADD(ROLE_OTHER, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    ADD(ROLE_OTHER, "output_norm.bias",   KVR_TYPE_F32, 1, embd, 1, bias_dist);
#undef ADD
    return ts;
}

// Phi-3: attention and FFN fused (attn_qkv: Q, K, V rows; ffn_up: gate rows, then up rows), an
// untied output, and with a long context the LongRoPE divisors of every rotated pair (short ones
// near 1, long ones up to ~11).
static struct gen_tensor * phi3_tensors(const struct gen_shape * s, enum kvr_type wtype) {
    struct gen_tensor * ts = NULL;
    const int64_t embd   = s->n_embd;
    const int64_t embd_k = (int64_t) s->n_embd / s->n_head * s->n_head_kv;
    char name[KVR_MAX_NAME];

    add_tensor(&ts, "token_embd.weight", wtype, 2, embd, s->n_vocab, (struct gen_dist) { 0.0f, 1.0f });
    if (s->n_ctx > 4096) {
        add_tensor(&ts, "rope_factors_long.weight",  KVR_TYPE_F32, 1, embd / s->n_head / 2, 1, (struct gen_dist) { 6.0f, 5.0f });
        add_tensor(&ts, "rope_factors_short.weight", KVR_TYPE_F32, 1, embd / s->n_head / 2, 1, (struct gen_dist) { 1.25f, 0.25f });
    }
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        add_tensor(&ts, BLK("attn_norm.weight"),   KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("attn_qkv.weight"),    wtype, 2, embd, embd + 2*embd_k, matrix_dist(embd));
        add_tensor(&ts, BLK("attn_output.weight"), wtype, 2, embd, embd,    matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_norm.weight"),    KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_up.weight"),      wtype, 2, embd, 2 * (int64_t) s->n_ff, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_down.weight"),    wtype, 2, s->n_ff, embd, matrix_dist(s->n_ff));
#undef BLK
    }
    add_tensor(&ts, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    add_tensor(&ts, "output.weight",      wtype, 2, embd, s->n_vocab, matrix_dist(embd));
    return ts;
}

// Qwen3-MoE: Qwen 3's attention (head size head_dim, q/k RMS norms) and a mixture of experts in
// every layer: the router ffn_gate_inp (f32, as the converter keeps it) and the experts' gate, up
// and down matrices stacked [in, out, n_expert].
static struct gen_tensor * qwen3moe_tensors(const struct gen_shape * s, enum kvr_type wtype) {
    struct gen_tensor * ts = NULL;
    const int64_t embd = s->n_embd, q = (int64_t) s->head_dim * s->n_head, kv = (int64_t) s->head_dim * s->n_head_kv;
    const int64_t F = s->n_ff_exp, E = s->n_expert;
    char name[KVR_MAX_NAME];

    add_tensor(&ts, "token_embd.weight", wtype, 2, embd, s->n_vocab, (struct gen_dist) { 0.0f, 1.0f });
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        add_tensor(&ts, BLK("attn_norm.weight"),   KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("attn_q.weight"),      wtype, 2, embd, q,  matrix_dist(embd));
        add_tensor(&ts, BLK("attn_k.weight"),      wtype, 2, embd, kv, matrix_dist(embd));
        add_tensor(&ts, BLK("attn_v.weight"),      wtype, 2, embd, kv, matrix_dist(embd));
        add_tensor(&ts, BLK("attn_output.weight"), wtype, 2, q, embd,  matrix_dist(q));
        add_tensor(&ts, BLK("attn_q_norm.weight"), KVR_TYPE_F32, 1, s->head_dim, 1, norm_dist);
        add_tensor(&ts, BLK("attn_k_norm.weight"), KVR_TYPE_F32, 1, s->head_dim, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_norm.weight"),    KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_gate_inp.weight"), KVR_TYPE_F32, 2, embd, E, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_gate_exps.weight"), wtype, 3, embd, F, matrix_dist(embd));
        arrlast(ts).ne[2] = E;
        add_tensor(&ts, BLK("ffn_up_exps.weight"),   wtype, 3, embd, F, matrix_dist(embd));
        arrlast(ts).ne[2] = E;
        add_tensor(&ts, BLK("ffn_down_exps.weight"), wtype, 3, F, embd, matrix_dist(F));
        arrlast(ts).ne[2] = E;
#undef BLK
    }
    add_tensor(&ts, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    add_tensor(&ts, "output.weight",      wtype, 2, embd, s->n_vocab, matrix_dist(embd));
    return ts;
}

// Gemma 2: separate Q/K/V of head_dim-wide heads, post-attention and post-FFN norms, the output
// tied to the token embedding (no output.weight, as Gemma's converter writes it).
static struct gen_tensor * gemma2_tensors(const struct gen_shape * s, enum kvr_type wtype) {
    struct gen_tensor * ts = NULL;
    const int64_t embd = s->n_embd, q = (int64_t) s->head_dim * s->n_head, kv = (int64_t) s->head_dim * s->n_head_kv;
    char name[KVR_MAX_NAME];

    add_tensor(&ts, "token_embd.weight", wtype, 2, embd, s->n_vocab, matrix_dist(embd));
    for (uint32_t il = 0; il < s->n_layer; il++) {
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, il), name)
        add_tensor(&ts, BLK("attn_norm.weight"),           KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("attn_q.weight"),              wtype, 2, embd, q,  matrix_dist(embd));
        add_tensor(&ts, BLK("attn_k.weight"),              wtype, 2, embd, kv, matrix_dist(embd));
        add_tensor(&ts, BLK("attn_v.weight"),              wtype, 2, embd, kv, matrix_dist(embd));
        add_tensor(&ts, BLK("attn_output.weight"),         wtype, 2, q, embd,  matrix_dist(q));
        add_tensor(&ts, BLK("post_attention_norm.weight"), KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_norm.weight"),            KVR_TYPE_F32, 1, embd, 1, norm_dist);
        add_tensor(&ts, BLK("ffn_gate.weight"),            wtype, 2, embd, s->n_ff, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_up.weight"),              wtype, 2, embd, s->n_ff, matrix_dist(embd));
        add_tensor(&ts, BLK("ffn_down.weight"),            wtype, 2, s->n_ff, embd, matrix_dist(s->n_ff));
        add_tensor(&ts, BLK("post_ffw_norm.weight"),       KVR_TYPE_F32, 1, embd, 1, norm_dist);
#undef BLK
    }
    add_tensor(&ts, "output_norm.weight", KVR_TYPE_F32, 1, embd, 1, norm_dist);
    return ts;
}

// llama-quantize's file types that kvr-gen writes as mixtures, with llama.cpp's llama_ftype numbers.
enum gen_ftype { FTYPE_NONE, FTYPE_Q4_K_M, FTYPE_Q5_K_M, FTYPE_Q6_K, FTYPE_Q8_0 };
static const char * const ftype_names[] = { "", "q4_k_m", "q5_k_m", "q6_k", "q8_0" };
static const uint32_t ftype_ids[] = { 0, 15, 17, 18, 7 };

// The layers that get more bits in the _M mixtures: the first and last eighth, and every third in between.
static bool more_bits(int64_t il, int64_t n) {
    return il < n / 8 || il >= 7 * n / 8 || (il - n / 8) % 3 == 2;
}

// A type that needs rows of a multiple of 256 falls back, for a narrower or odd width, to the
// 32-block type llama-quantize picks (and to F16 where even that does not divide the width).
static enum kvr_type mix_fallback(enum kvr_type t, int64_t ne0) {
    if (ne0 % kvr_blck_size(t) == 0) return t;
    switch (t) {
        case KVR_TYPE_Q2_K: case KVR_TYPE_Q3_K: t = KVR_TYPE_Q4_0; break;
        case KVR_TYPE_Q4_K: t = KVR_TYPE_Q5_0; break;
        case KVR_TYPE_Q5_K: t = KVR_TYPE_Q5_1; break;
        case KVR_TYPE_Q6_K: t = KVR_TYPE_Q8_0; break;
        default: break;
    }
    return ne0 % kvr_blck_size(t) == 0 ? t : KVR_TYPE_F16;
}

// The type of a weight matrix of layer il (of n) in a file of type ft, as llama-quantize chooses it.
static enum kvr_type mix_type(enum gen_ftype ft, enum gen_role role, int64_t il, int64_t n, int64_t ne0, bool falcon, bool tied) {
    static const enum kvr_type base[] = { KVR_TYPE_F32, KVR_TYPE_Q4_K, KVR_TYPE_Q5_K, KVR_TYPE_Q6_K, KVR_TYPE_Q8_0 };
    enum kvr_type t = base[ft];
    if (role == ROLE_OUTPUT || (role == ROLE_TOKEN_EMBD && tied)) {
        // the output: Q6_K, or Q8_0 for falcon and where the width does not fit the base type's blocks
        if (falcon || ne0 % kvr_blck_size(t) != 0) t = KVR_TYPE_Q8_0;
        else if (t != KVR_TYPE_Q8_0) t = KVR_TYPE_Q6_K;
    } else if (role == ROLE_ATTN_V) {
        if ((ft == FTYPE_Q4_K_M || ft == FTYPE_Q5_K_M) && more_bits(il, n)) t = KVR_TYPE_Q6_K;
    } else if (role == ROLE_FFN_DOWN) {
        if (ft == FTYPE_Q4_K_M && falcon) {
            t = il < n / 16 ? KVR_TYPE_Q6_K : more_bits(il, n) ? KVR_TYPE_Q5_K : KVR_TYPE_Q4_K;
        } else if ((ft == FTYPE_Q4_K_M || ft == FTYPE_Q5_K_M) && more_bits(il, n)) {
            t = KVR_TYPE_Q6_K;
        }
    } else if (role == ROLE_ATTN_QKV) {
        if (ft == FTYPE_Q4_K_M) t = KVR_TYPE_Q5_K;
        else if (ft == FTYPE_Q5_K_M) t = KVR_TYPE_Q6_K;
    }
    return mix_fallback(t, ne0);
}

// llama.cpp's llama_ftype of a file whose matrices are all of one type.
static uint32_t file_type_of(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return 0;
        case KVR_TYPE_F16:  return 1;
        case KVR_TYPE_Q4_0: return 2;
        case KVR_TYPE_Q4_1: return 3;
        case KVR_TYPE_Q8_0: return 7;
        case KVR_TYPE_Q5_0: return 8;
        case KVR_TYPE_Q5_1: return 9;
        case KVR_TYPE_Q2_K: return 10;
        case KVR_TYPE_Q3_K: return 11; // Q3_K_S
        case KVR_TYPE_Q4_K: return 14; // Q4_K_S
        case KVR_TYPE_Q5_K: return 16; // Q5_K_S
        case KVR_TYPE_Q6_K: return 18;
        case KVR_TYPE_BF16: return 32;
        case KVR_TYPE_MXFP4: return 38; // MXFP4_MOE
        default:            return 0;
    }
}

//
// the made-up SPM vocabulary
//

struct gen_vocab {
    char ** pieces;  // stb_ds array of malloc'ed strings
    float * scores;
    int32_t * types;
    struct { char * key; int value; } * seen; // stb_ds string hash
};

static bool vocab_add(struct gen_vocab * v, const char * piece, float score, int32_t type) {
    if (shgeti(v->seen, piece) >= 0) {
        return false;
    }
    shput(v->seen, piece, 1);
    const size_t n = strlen(piece) + 1;
    char * p = malloc(n);
    if (!p) {
        fprintf(stderr, "kvr-gen: out of memory\n");
        exit(1);
    }
    memcpy(p, piece, n);
    arrput(v->pieces, p);
    arrput(v->scores, score);
    arrput(v->types, type);
    return true;
}

#define SPM_SPACE "\xe2\x96\x81" // U+2581, the piece of a space

// A piece and every prefix of it, shortest first, so that SPM's pairwise merges can reach it.
static void vocab_add_word(struct gen_vocab * v, const char * word, int n_vocab) {
    char buf[64];
    const size_t len = strlen(word);
    const size_t start = strncmp(word, SPM_SPACE, 3) == 0 ? 3 : 0;
    for (size_t k = start < len ? start + 1 : len; k <= len && k < sizeof(buf) && arrlen(v->pieces) < n_vocab; k++) {
        memcpy(buf, word, k);
        buf[k] = '\0';
        vocab_add(v, buf, -(float) arrlen(v->pieces), KVR_TOKEN_NORMAL);
    }
}

static const char * common_words =
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by not word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father once upon story happy girl dog cat";

static const char * common_pieces[] = {
    "ing", "ed", "er", "es", "ly", "tion", "en", "al", "an", "in", "on", "re", "st", "nd", "th",
    "ou", "or", "at", "it", "is", "ar", "le", "se", "ve", "ch", "ll", "ss", "ent", "ter", "est",
    "'s", "n't", ",", ".", "!", "?", "'", "\"", ":", ";", "-", "(", ")",
};

static struct gen_vocab make_vocab(int n_vocab) {
    struct gen_vocab v = { 0 };
    sh_new_strdup(v.seen);
    char buf[32];

    vocab_add(&v, "<unk>", 0.0f, KVR_TOKEN_UNKNOWN);
    vocab_add(&v, "<s>",   0.0f, KVR_TOKEN_CONTROL);
    vocab_add(&v, "</s>",  0.0f, KVR_TOKEN_CONTROL);
    for (int b = 0; b < 256; b++) {
        snprintf(buf, sizeof(buf), "<0x%02X>", b);
        vocab_add(&v, buf, 0.0f, KVR_TOKEN_BYTE);
    }
    // the space piece and every printable ASCII character, then a space before each letter
    vocab_add_word(&v, SPM_SPACE, n_vocab);
    for (int c = '!'; c <= '~'; c++) {
        buf[0] = (char) c;
        buf[1] = '\0';
        vocab_add_word(&v, buf, n_vocab);
    }
    for (int c = 'a'; c <= 'z'; c++) {
        snprintf(buf, sizeof(buf), SPM_SPACE "%c", c);
        vocab_add_word(&v, buf, n_vocab);
    }
    for (size_t i = 0; i < sizeof(common_pieces) / sizeof(common_pieces[0]); i++) {
        vocab_add_word(&v, common_pieces[i], n_vocab);
    }
    // common words, with a leading space (and their prefixes)
    for (const char * p = common_words; *p && arrlen(v.pieces) < n_vocab; ) {
        const size_t len = strcspn(p, " ");
        if (len > 0 && len < 20) {
            snprintf(buf, sizeof(buf), SPM_SPACE "%.*s", (int) len, p);
            vocab_add_word(&v, buf, n_vocab);
        }
        p += len + (p[len] == ' ');
    }
    // then letter pairs and triples (inside words and after a space), then numbered fillers
    for (int a = 'a'; a <= 'z' && arrlen(v.pieces) < n_vocab; a++) {
        for (int b = 'a'; b <= 'z' && arrlen(v.pieces) < n_vocab; b++) {
            snprintf(buf, sizeof(buf), "%c%c", a, b);
            vocab_add_word(&v, buf, n_vocab);
            snprintf(buf, sizeof(buf), SPM_SPACE "%c%c", a, b);
            vocab_add_word(&v, buf, n_vocab);
        }
    }
    for (int a = 'a'; a <= 'z' && arrlen(v.pieces) < n_vocab; a++) {
        for (int b = 'a'; b <= 'z' && arrlen(v.pieces) < n_vocab; b++) {
            for (int c = 'a'; c <= 'z' && arrlen(v.pieces) < n_vocab; c++) {
                snprintf(buf, sizeof(buf), "%c%c%c", a, b, c);
                vocab_add_word(&v, buf, n_vocab);
                snprintf(buf, sizeof(buf), SPM_SPACE "%c%c%c", a, b, c);
                vocab_add_word(&v, buf, n_vocab);
            }
        }
    }
    for (int i = 0; arrlen(v.pieces) < n_vocab; i++) {
        snprintf(buf, sizeof(buf), "<filler%d>", i);
        vocab_add(&v, buf, -(float) arrlen(v.pieces), KVR_TOKEN_NORMAL);
    }
    return v;
}

static void free_vocab(struct gen_vocab * v) {
    for (ptrdiff_t i = 0; i < arrlen(v->pieces); i++) {
        free(v->pieces[i]);
    }
    arrfree(v->pieces);
    arrfree(v->scores);
    arrfree(v->types);
    shfree(v->seen);
}

//
// generation: a slab of rows at a time, rows split over threads
//

struct gen_job {
    const struct gen_tensor * t;
    uint64_t  seed;
    uint64_t  tensor_hash;
    int64_t   row0, row1;    // this thread's rows
    int64_t   slab_row0;     // the first row of the slab (out is the slab's buffer)
    float   * scratch;       // ne0 floats
    uint8_t * out;
    size_t    row_size;
    bool      ok;
    bool      started;       // on a thread of its own
};

static void * gen_rows(void * arg) {
    struct gen_job * j = arg;
    const int64_t ne0 = j->t->ne[0];
    for (int64_t r = j->row0; r < j->row1; r++) {
        gen_row(j->scratch, ne0, j->seed, j->tensor_hash, r, j->t->dist);
        uint8_t * dst = j->out + (size_t) (r - j->slab_row0) * j->row_size;
        if (kvr_from_float(j->t->type, j->scratch, dst, ne0) != j->row_size) {
            j->ok = false;
            return NULL;
        }
    }
    j->ok = true;
    return NULL;
}

static bool parse_type(const char * s, enum kvr_type * out) {
    for (int t = 0; t < KVR_TYPE_COUNT; t++) {
        const char * name = kvr_type_name((enum kvr_type) t);
        if (kvr_blck_size((enum kvr_type) t) == 0 || strlen(name) != strlen(s)) {
            continue;
        }
        bool eq = true;
        for (size_t i = 0; s[i]; i++) {
            eq = eq && tolower((unsigned char) s[i]) == tolower((unsigned char) name[i]);
        }
        if (eq) {
            *out = (enum kvr_type) t;
            return true;
        }
    }
    return false;
}

static int parse_type_flag(const char * v, void * dst, char * why, size_t cap) {
    if (parse_type(v, dst)) return 0;
    snprintf(why, cap, "not a type kvr knows (f32, f16, bf16, q8_0, q4_0, q4_k, ...)");
    return -1;
}

static int parse_ftype_flag(const char * v, void * dst, char * why, size_t cap) {
    for (int f = 1; f < (int)(sizeof(ftype_names) / sizeof(ftype_names[0])); f++) {
        bool eq = strlen(v) == strlen(ftype_names[f]);
        for (size_t i = 0; eq && v[i]; i++) eq = tolower((unsigned char) v[i]) == ftype_names[f][i];
        if (eq) {
            *(enum gen_ftype *) dst = (enum gen_ftype) f;
            return 0;
        }
    }
    snprintf(why, cap, "not a mixture kvr-gen writes (q4_k_m, q5_k_m, q6_k, q8_0)");
    return -1;
}

int main(int argc, char ** argv) {
    const char * preset = NULL, * out_path = NULL, * vocab_path = NULL;
    enum kvr_type wtype = KVR_TYPE_F32;
    enum gen_ftype ftype = FTYPE_NONE;
    int arch_i = 0;
    uint64_t seed = 42;
    int o_layers = 0, o_ctx = 0, o_heads = 0, o_kv_heads = 0, o_embd = 0, o_ff = 0, o_vocab = 0;
    int n_threads = 0;
    bool quiet = false;
    const struct kvr_cli_flag flags[] = {
        { .name = "--preset", .kind = KVR_CLI_TEXT, .dst = &preset, .meta = "NAME",
          .help = "llama: tinyllama-1.1b, llama-7b, llama-3.2-1b, tiny (GQA 8/4), tiny-mha,\ntiny-mqa; falcon: falcon-7b, tiny (MQA; both need --vocab);\nqwen2: qwen2.5-0.5b; qwen3: qwen3-0.6b; gemma3: gemma-3-270m, gemma-3-1b;\n"
                  "phi3: phi-3.5-mini, tiny; gemma2: gemma-2-2b, tiny; qwen3moe: qwen3-30b-a3b, tiny; qwen35: qwen3.5-0.8b, tiny" },
        { .name = "-o", .alt = "--output", .kind = KVR_CLI_OUT, .dst = &out_path, .meta = "FILE", .help = "the GGUF file to write" },
        { .name = "--type", .kind = KVR_CLI_CUSTOM, .dst = &wtype, .meta = "T", .parse = parse_type_flag,
          .help = "type of the weight matrices (default f32); norms are always f32" },
        { .name = "--ftype", .kind = KVR_CLI_CUSTOM, .dst = &ftype, .meta = "F", .parse = parse_ftype_flag,
          .help = "instead of --type: llama-quantize's mixture of that file type,\nq4_k_m, q5_k_m, q6_k or q8_0 (per tensor, with its fallbacks\nfor widths that are not a multiple of 256)" },
        { .name = "--seed", .kind = KVR_CLI_U64, .dst = &seed, .meta = "S", .help = "random seed (default 42); the same seed gives the same file" },
        { .name = "--vocab", .kind = KVR_CLI_IN, .dst = &vocab_path, .meta = "GGUF",
          .help = "copy the tokenizer (every tokenizer.* key) from this GGUF and take\nthe vocabulary size from it; without it a byte-fallback SPM\nvocabulary is made up" },
        { .name = "--arch", .kind = KVR_CLI_CHOICE, .dst = &arch_i, .meta = "A", .choices = "llama|falcon|qwen2|qwen3|gemma3|phi3|gemma2|qwen3moe|qwen35",
          .help = "llama (default), falcon, qwen2, qwen3, gemma3, phi3, gemma2,\nqwen3moe (mixture of experts) or qwen35 (hybrid)" },
        { .name = "--layers", .kind = KVR_CLI_INT, .dst = &o_layers, .meta = "N", .lo = 1, .hi = 4096, .help = "override the preset's layer count" },
        { .name = "--ctx", .kind = KVR_CLI_INT, .dst = &o_ctx, .meta = "N", .lo = 1, .hi = 1 << 24, .k_suffix = true, .help = "... its trained context length" },
        { .name = "--heads", .kind = KVR_CLI_INT, .dst = &o_heads, .meta = "N", .lo = 1, .hi = 4096, .help = "... its attention heads" },
        { .name = "--kv-heads", .kind = KVR_CLI_INT, .dst = &o_kv_heads, .meta = "N", .lo = 1, .hi = 4096, .help = "... its KV heads" },
        { .name = "--embd", .kind = KVR_CLI_INT, .dst = &o_embd, .meta = "N", .lo = 1, .hi = 1 << 20, .help = "... its width" },
        { .name = "--ff", .kind = KVR_CLI_INT, .dst = &o_ff, .meta = "N", .lo = 1, .hi = 1 << 22, .help = "... its FFN width" },
        { .name = "--vocab-size", .kind = KVR_CLI_INT, .dst = &o_vocab, .meta = "N", .lo = 300, .hi = 1 << 22,
          .help = "... the size of the made-up vocabulary" },
        { .name = "--threads", .kind = KVR_CLI_INT, .dst = &n_threads, .meta = "N", .lo = 1, .hi = 256, .help = "generator threads (default: the cores, at most 8)" },
        { .name = "-q", .alt = "--quiet", .kind = KVR_CLI_SWITCH, .dst = &quiet, .help = "no progress on stderr" },
    };
    const struct kvr_cli cli = { "kvr-gen", usage_line, "Writes a GGUF model with random weights and a real architecture's shape.",
                                 flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    const int prc = kvr_cli_parse(&cli, argc, argv);
    if (prc) {
        return prc < 0 ? 0 : prc;
    }
    static const char * const archs[] = { "llama", "falcon", "qwen2", "qwen3", "gemma3", "phi3", "gemma2", "qwen3moe", "qwen35" };
    const char * arch = archs[arch_i];
    if (!preset) {
        usage_error("--preset is required");
    }
    if (!out_path) {
        usage_error("-o FILE is required");
    }
    struct gen_shape s = { 0 };
    bool found = false;
    for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        if (strcmp(presets[i].arch, arch) == 0 && strcmp(presets[i].name, preset) == 0) {
            s = presets[i];
            found = true;
        }
    }
    if (!found) {
        // a preset named alone brings its architecture
        for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]) && arch_i == 0 && !found; i++) {
            if (strcmp(presets[i].name, preset) == 0 && strcmp(presets[i].arch, "falcon") != 0) {
                s = presets[i];
                arch = s.arch;
                found = true;
            }
        }
    }
    if (!found) {
        usage_error("unknown %s preset '%s' (llama: tinyllama-1.1b, llama-7b, llama-3.2-1b, tiny, tiny-mha, tiny-mqa; "
                    "falcon: falcon-7b, tiny; qwen2.5-0.5b, qwen3-0.6b, gemma-3-270m, gemma-3-1b; phi3: phi-3.5-mini, tiny; "
                    "gemma2: gemma-2-2b, tiny; qwen3moe: qwen3-30b-a3b, tiny; qwen35: qwen3.5-0.8b, tiny)", arch, preset);
    }
    if (ftype != FTYPE_NONE && wtype != KVR_TYPE_F32) {
        usage_error("--type and --ftype exclude each other");
    }
    const bool falcon = strcmp(arch, "falcon") == 0, phi3 = strcmp(arch, "phi3") == 0, gemma2 = strcmp(arch, "gemma2") == 0;
    const bool moe = strcmp(arch, "qwen3moe") == 0, qwen35 = strcmp(arch, "qwen35") == 0;
    if (ftype != FTYPE_NONE && (phi3 || gemma2 || moe || qwen35)) {
        usage_error("--ftype writes the llama, falcon, qwen2, qwen3 and gemma3 layouts, not %s (use --type)", arch);
    }
    if (falcon && !vocab_path) {
        usage_error("falcon models need --vocab (a BPE vocabulary such as ggml-vocab-falcon.gguf)");
    }
    if (o_layers)   s.n_layer   = (uint32_t) o_layers;
    if (o_ctx)      s.n_ctx     = (uint32_t) o_ctx;
    if (o_heads)    s.n_head    = (uint32_t) o_heads;
    if (o_kv_heads) s.n_head_kv = (uint32_t) o_kv_heads;
    if (o_embd)     s.n_embd    = (uint32_t) o_embd;
    if (o_ff)       s.n_ff      = (uint32_t) o_ff;
    if (o_vocab)    s.n_vocab   = (uint32_t) o_vocab;

    // the tokenizer first: it decides the vocabulary size
    struct kvr_gguf * vocab_src = NULL;
    if (vocab_path) {
        if (o_vocab) {
            usage_error("--vocab-size and --vocab exclude each other");
        }
        vocab_src = kvr_gguf_open(vocab_path);
        if (!vocab_src) {
            fprintf(stderr, "kvr-gen: %s\n", kvr_last_error());
            return 1;
        }
        const struct kvr_gguf_kv * toks = kvr_gguf_get_kv(vocab_src, "tokenizer.ggml.tokens");
        if (!toks || toks->type != KVR_GGUF_ARRAY || toks->arr_type != KVR_GGUF_STRING || toks->n == 0 ||
            toks->n > INT32_MAX) {
            fprintf(stderr, "kvr-gen: %s has no tokenizer.ggml.tokens array of strings\n", vocab_path);
            return 1;
        }
        s.n_vocab = (uint32_t) toks->n;
    } else if (s.n_vocab < 300) {
        usage_error("the made-up vocabulary needs at least 300 tokens, not %u", s.n_vocab);
    }

    // shape checks: what llama.cpp and kvr need of it
    const int64_t blck = kvr_blck_size(wtype);
    if (o_heads) s.head_dim = 0; // other heads: the head size is the width's share (a new width alone keeps a preset's own)
    const uint32_t head_dim = s.head_dim ? s.head_dim : s.n_head ? s.n_embd / s.n_head : 0;
    if ((!s.head_dim && s.n_embd % s.n_head != 0) || head_dim % 2 != 0 || head_dim == 0) {
        usage_error("n_embd %u is not an even head size times %u heads", s.n_embd, s.n_head);
    }
    const bool own_head = s.head_dim != 0; // key_length written only where the head is not n_embd / n_head
    s.head_dim = head_dim;
    if (moe && s.n_ff_exp % blck != 0) {
        usage_error("type %s needs the expert width (%u) to be a multiple of %lld", kvr_type_name(wtype), s.n_ff_exp, (long long) blck);
    }
    if (s.n_head_kv > s.n_head || s.n_head % s.n_head_kv != 0) {
        usage_error("%u heads cannot share %u kv heads", s.n_head, s.n_head_kv);
    }
    if (ftype == FTYPE_NONE && (s.n_embd % blck != 0 || s.n_ff % blck != 0 || (head_dim * s.n_head) % blck != 0 ||
                                (qwen35 && s.ssm_v_heads * s.ssm_state % blck != 0))) {
        usage_error("type %s needs n_embd (%u) and n_ff (%u) to be multiples of %lld",
                    kvr_type_name(wtype), s.n_embd, s.n_ff, (long long) blck);
    }
    {
        float   zeros[256] = { 0 };
        uint8_t probe[512];
        if (ftype == FTYPE_NONE && (blck > 256 || kvr_type_size(wtype) > sizeof(probe) ||
            kvr_from_float(wtype, zeros, probe, blck) == 0)) {
            fprintf(stderr, "kvr-gen: type %s cannot be written yet\n", kvr_type_name(wtype));
            return 1;
        }
    }
    if (n_threads == 0) {
        const long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc < 1 ? 1 : nc > 8 ? 8 : (int) nc;
    }

    // metadata, in the order llama.cpp's convert script writes it
    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    if (!w) {
        fprintf(stderr, "kvr-gen: %s\n", kvr_last_error());
        return 1;
    }
    char general_name[128];
    snprintf(general_name, sizeof(general_name), "kvr-gen %s seed %llu", preset, (unsigned long long) seed);
    char key[96];
#define ARCH_KEY(suffix) (snprintf(key, sizeof(key), "%s." suffix, arch), key)
    kvr_gguf_set_str(w, "general.architecture", arch);
    kvr_gguf_set_str(w, "general.name", general_name);
    kvr_gguf_set_u32(w, ARCH_KEY("block_count"), s.n_layer);
    kvr_gguf_set_u32(w, ARCH_KEY("context_length"), s.n_ctx);
    kvr_gguf_set_u32(w, ARCH_KEY("embedding_length"), s.n_embd);
    kvr_gguf_set_u32(w, ARCH_KEY("feed_forward_length"), s.n_ff);
    kvr_gguf_set_u32(w, ARCH_KEY("attention.head_count"), s.n_head);
    kvr_gguf_set_u32(w, ARCH_KEY("attention.head_count_kv"), s.n_head_kv);
    kvr_gguf_set_f32(w, ARCH_KEY("rope.freq_base"), s.rope_base);
    if (falcon) {
        kvr_gguf_set_f32(w, ARCH_KEY("attention.layer_norm_epsilon"), s.norm_eps);
    } else {
        kvr_gguf_set_f32(w, ARCH_KEY("attention.layer_norm_rms_epsilon"), s.norm_eps);
    }
    if (own_head) {
        kvr_gguf_set_u32(w, ARCH_KEY("attention.key_length"), head_dim);
        kvr_gguf_set_u32(w, ARCH_KEY("attention.value_length"), head_dim);
    }
    if (s.n_swa) {
        kvr_gguf_set_u32(w, ARCH_KEY("attention.sliding_window"), s.n_swa);
        kvr_gguf_set_f32(w, ARCH_KEY("rope.freq_base_swa"), 10000.0f);
    }
    kvr_gguf_set_u32(w, "general.file_type", ftype != FTYPE_NONE ? ftype_ids[ftype] : file_type_of(wtype));
    kvr_gguf_set_u32(w, ARCH_KEY("vocab_size"), s.n_vocab);
    kvr_gguf_set_u32(w, ARCH_KEY("rope.dimension_count"), qwen35 ? s.n_rot : head_dim);
    if (phi3 && s.n_ctx > 4096) { // LongRoPE: the converter's attention factor for the extension
        kvr_gguf_set_u32(w, ARCH_KEY("rope.scaling.original_context_length"), 4096);
        kvr_gguf_set_f32(w, ARCH_KEY("rope.scaling.attn_factor"), sqrtf(1.0f + logf((float) s.n_ctx / 4096.0f) / logf(4096.0f)));
    }
    if (gemma2) {
        kvr_gguf_set_f32(w, ARCH_KEY("attn_logit_softcapping"), 50.0f);
        kvr_gguf_set_f32(w, ARCH_KEY("final_logit_softcapping"), 30.0f);
        kvr_gguf_set_u32(w, ARCH_KEY("attention.sliding_window"), 4096);
    }
    if (moe) {
        kvr_gguf_set_u32(w, ARCH_KEY("expert_count"), s.n_expert);
        kvr_gguf_set_u32(w, ARCH_KEY("expert_used_count"), s.n_expert_used);
        kvr_gguf_set_u32(w, ARCH_KEY("expert_feed_forward_length"), s.n_ff_exp);
    }
    if (qwen35) {
        // the converter's keys: mrope sections (text tokens rotate every pair by their position)
        const int32_t sections[4] = { 11, 11, 10, 0 };
        kvr_gguf_set_arr(w, ARCH_KEY("rope.dimension_sections"), KVR_GGUF_INT32, sections, 4);
        kvr_gguf_set_u32(w, ARCH_KEY("ssm.conv_kernel"), 4);
        kvr_gguf_set_u32(w, ARCH_KEY("ssm.state_size"), s.ssm_state);
        kvr_gguf_set_u32(w, ARCH_KEY("ssm.group_count"), s.ssm_groups);
        kvr_gguf_set_u32(w, ARCH_KEY("ssm.time_step_rank"), s.ssm_v_heads);
        kvr_gguf_set_u32(w, ARCH_KEY("ssm.inner_size"), s.ssm_v_heads * s.ssm_state);
        kvr_gguf_set_u32(w, ARCH_KEY("full_attention_interval"), 4);
    }
#undef ARCH_KEY

    struct gen_vocab gv = { 0 };
    if (vocab_src) {
        kvr_gguf_copy_kv(w, vocab_src, "tokenizer.");
    } else {
        gv = make_vocab((int) s.n_vocab);
        uint64_t n = (uint64_t) arrlen(gv.pieces);
        kvr_gguf_set_str(w, "tokenizer.ggml.model", "llama");
        kvr_gguf_set_arr_str(w, "tokenizer.ggml.tokens", (const char * const *) gv.pieces, NULL, n);
        kvr_gguf_set_arr(w, "tokenizer.ggml.scores", KVR_GGUF_FLOAT32, gv.scores, n);
        kvr_gguf_set_arr(w, "tokenizer.ggml.token_type", KVR_GGUF_INT32, gv.types, n);
        kvr_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
        kvr_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
        kvr_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
        kvr_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
        kvr_gguf_set_bool(w, "tokenizer.ggml.add_eos_token", false);
    }
    kvr_gguf_set_u32(w, "general.quantization_version", 2);

    // pass 1: the header, every tensor reserved
    enum gen_role * roles = NULL;
    struct gen_tensor * ts = falcon ? falcon_tensors(&s, wtype, &roles) : phi3 ? phi3_tensors(&s, wtype)
                           : gemma2 ? gemma2_tensors(&s, wtype) : moe ? qwen3moe_tensors(&s, wtype)
                           : qwen35 ? qwen35_tensors(&s, wtype) : llama_tensors(&s, wtype, &roles);
    const int n_tensors = (int) arrlen(ts);
    int type_count[KVR_TYPE_COUNT] = { 0 };
    for (int i = 0; i < n_tensors; i++) {
        unsigned il = 0;
        if (ftype != FTYPE_NONE && ts[i].n_dims == 2) {
            sscanf(ts[i].name, "blk.%u.", &il);
            ts[i].type = mix_type(ftype, roles[i], il, s.n_layer, ts[i].ne[0], falcon, s.tied);
        }
        if (ts[i].n_dims == 2) type_count[ts[i].type]++;
    }
    arrfree(roles);
    char types_used[256] = "";
    for (int t = 0; t < KVR_TYPE_COUNT; t++) {
        if (type_count[t] == 0) continue;
        const size_t len = strlen(types_used);
        snprintf(types_used + len, sizeof(types_used) - len, "%s%d %s", len ? ", " : "", type_count[t], kvr_type_name((enum kvr_type) t));
    }
    for (int i = 0; i < n_tensors; i++) {
        kvr_gguf_add_tensor(w, ts[i].name, ts[i].type, ts[i].n_dims, ts[i].ne, NULL);
    }
    const double t_start = kvr_time_ms();
    // one temporary beside out_path (kvr_file_create) until every tensor is in: an interrupted run
    // leaves no half-zero model, a killed one a temporary the next run removes
    struct kvr_file * kf;
    int rc = kvr_file_create(&kf, out_path);
    if (rc == KVR_OK) {
        rc = kvr_gguf_writer_write(w, kf);
        if (rc == KVR_OK && fflush(kvr_file_stream(kf)) != 0) {
            rc = kvr_error(KVR_ERR_IO, "cannot write %s: %s", out_path, strerror(errno));
        }
        if (rc != KVR_OK) kvr_file_abort(kf);
    }
    kvr_gguf_writer_free(w);
    free_vocab(&gv);
    if (vocab_src) {
        kvr_gguf_close(vocab_src);
    }
    if (rc != KVR_OK) {
        fprintf(stderr, "kvr-gen: %s\n", kvr_last_error());
        arrfree(ts);
        return 1;
    }

    // where the writer put each tensor, as a reader sees it (the temporary is this run's own: made
    // with O_EXCL and locked)
    const char * tmp_path = kvr_file_temp_path(kf);
    struct kvr_gguf * g = kvr_gguf_open(tmp_path);
    if (!g) {
        fprintf(stderr, "kvr-gen: reopening %s: %s\n", tmp_path, kvr_last_error());
        kvr_file_abort(kf);
        arrfree(ts);
        return 1;
    }
    size_t max_row = 0, total = 0;
    for (int i = 0; i < n_tensors; i++) {
        const struct kvr_gguf_tensor * gt = kvr_gguf_get_tensor(g, ts[i].name);
        KVR_ASSERT(gt != NULL && gt->type == ts[i].type);
        ts[i].file_offset = (uint64_t) g->data_offset + gt->offset;
        const size_t row = kvr_row_size(ts[i].type, ts[i].ne[0]);
        max_row = row > max_row ? row : max_row;
        total += row * (size_t) (ts[i].ne[1] * ts[i].ne[2]);
    }
    kvr_gguf_close(g);

    // pass 2: generate and write each tensor in place, a slab of rows at a time
    FILE * f = kvr_file_stream(kf);
    const size_t slab_bytes = (size_t) 32 << 20;
    uint8_t * slab = malloc(slab_bytes > max_row ? slab_bytes : max_row);
    int64_t max_ne0 = 0;
    for (int i = 0; i < n_tensors; i++) {
        max_ne0 = ts[i].ne[0] > max_ne0 ? ts[i].ne[0] : max_ne0;
    }
    float * scratch = malloc((size_t) max_ne0 * (size_t) n_threads * sizeof(float));
    pthread_t * threads = malloc((size_t) n_threads * sizeof(pthread_t));
    struct gen_job * jobs = malloc((size_t) n_threads * sizeof(struct gen_job));
    if (!slab || !scratch || !threads || !jobs) {
        fprintf(stderr, "kvr-gen: out of memory\n");
        kvr_file_abort(kf);
        return 1;
    }
    const bool tty = isatty(fileno(stderr));
    bool ok = true;
    size_t done = 0;
    double last_report = kvr_time_ms();
    for (int i = 0; i < n_tensors && ok; i++) {
        const struct gen_tensor * t = &ts[i];
        // on a terminal every tensor, one line rewritten; in a log a line a second at most
        const double now = kvr_time_ms();
        if (!quiet && (tty || now - last_report >= 1000.0)) {
            fprintf(stderr, "%stensor %d/%d %-28s %5.1f%%%s", tty ? "\r" : "", i + 1, n_tensors, t->name,
                    total ? 100.0 * (double) done / (double) total : 100.0, tty ? "\033[K" : "\n");
            fflush(stderr);
            last_report = now;
        }
        const size_t  row_size = kvr_row_size(t->type, t->ne[0]);
        const int64_t rows     = t->ne[1] * t->ne[2]; // an expert tensor's experts one after the other
        const int64_t slab_rows = (int64_t) (slab_bytes / row_size) > 0 ? (int64_t) (slab_bytes / row_size) : 1;
        const uint64_t th = hash_name(t->name);
        if (fseeko(f, (off_t) t->file_offset, SEEK_SET) != 0) {
            ok = false;
            break;
        }
        for (int64_t r0 = 0; r0 < rows && ok; r0 += slab_rows) {
            const int64_t r1 = r0 + slab_rows < rows ? r0 + slab_rows : rows;
            const int64_t nt = (int64_t) n_threads < r1 - r0 ? (int64_t) n_threads : r1 - r0;
            for (int64_t k = 0; k < nt; k++) {
                jobs[k] = (struct gen_job) {
                    .t = t, .seed = seed, .tensor_hash = th,
                    .row0 = r0 + (r1 - r0) * k / nt, .row1 = r0 + (r1 - r0) * (k + 1) / nt,
                    .slab_row0 = r0, .scratch = scratch + (size_t) k * (size_t) max_ne0,
                    .out = slab, .row_size = row_size, .ok = false, .started = false,
                };
            }
            for (int64_t k = 1; k < nt; k++) {
                jobs[k].started = pthread_create(&threads[k], NULL, gen_rows, &jobs[k]) == 0;
                if (!jobs[k].started) {
                    gen_rows(&jobs[k]); // no thread to be had: do its share here
                }
            }
            gen_rows(&jobs[0]);
            for (int64_t k = 1; k < nt; k++) {
                if (jobs[k].started) {
                    pthread_join(threads[k], NULL);
                }
            }
            for (int64_t k = 0; k < nt; k++) {
                if (!jobs[k].ok) {
                    fprintf(stderr, "\nkvr-gen: type %s cannot be written yet\n", kvr_type_name(t->type));
                    ok = false;
                }
            }
            const size_t n = (size_t) (r1 - r0) * row_size;
            if (ok && fwrite(slab, 1, n, f) != n) {
                ok = false;
            }
            done += n;
        }
    }
    if (!ok) {
        fprintf(stderr, "\nkvr-gen: writing %s failed: %s\n", tmp_path, errno ? strerror(errno) : "?");
        kvr_file_abort(kf);
    } else if (kvr_file_commit(kf) != KVR_OK) { // flushed, synced and renamed onto out_path, or removed
        fprintf(stderr, "kvr-gen: %s\n", kvr_last_error());
        ok = false;
    } else if (!quiet) {
        const double secs = (kvr_time_ms() - t_start) / 1000.0;
        fprintf(stderr, "%swrote %s: %s (matrices: %s), %d tensors, %.1f MB of weights in %.1f s\n", tty ? "\r\033[K" : "",
                out_path, ftype != FTYPE_NONE ? ftype_names[ftype] : kvr_type_name(wtype), types_used, n_tensors,
                (double) total / 1e6, secs);
    }
    free(slab);
    free(scratch);
    free(threads);
    free(jobs);
    arrfree(ts);
    return ok ? 0 : 1;
}
