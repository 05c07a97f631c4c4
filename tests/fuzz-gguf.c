// tests/fuzz-gguf.c - the libFuzzer target for the GGUF reader: every input goes through
// kvr_gguf_open_mem; a rejection must leave a message, and an accepted file must hold together:
// every key, string, array and tensor lies inside the buffer, is readable to its last byte (so the
// sanitizers see any lie), is found again by the lookups and the typed getters, and the tensors are
// aligned, sized by their type and shape, and do not overlap. The tokenizer loader then runs on
// the result (it returns NULL on error) and, when it loads, tokenizes and detokenizes a little.
//
//   clang -fsanitize=fuzzer,address,undefined -I. tests/fuzz-gguf.c kvr.c ... -o build/fuzz-gguf
//   build/fuzz-gguf -max_total_time=30 -rss_limit_mb=2048 build/fuzz-corpus
//
// Seeds: `test-gguf --write-corpus build/fuzz-corpus` writes the valid images and the malformed
// variants of tests/test-gguf.c.

#include "kvr.h"

#include <stdlib.h>
#include <string.h>

// Fail loudly: libFuzzer saves the input as a crash reproducer.
#define FUZZ_CHECK(x) do { if (!(x)) { fprintf(stderr, "fuzz-gguf: invariant failed: %s (line %d)\n", #x, __LINE__); abort(); } } while (0)

static volatile uint64_t sink; // keeps the reads from being optimized away

static void touch(const void * p, uint64_t n) {
    const uint8_t * q = p;
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++) s += q[i];
    sink += s;
}

static bool inside(const struct kvr_gguf * g, const void * p, uint64_t n) {
    const uint8_t * q = p;
    if (n == 0) return true; // an empty string may point anywhere (or nowhere)
    return q >= g->base && q <= g->base + g->size && n <= (uint64_t)(g->base + g->size - q);
}

static size_t elem_size(enum kvr_gguf_type t) {
    switch (t) {
        case KVR_GGUF_UINT8: case KVR_GGUF_INT8: case KVR_GGUF_BOOL: return 1;
        case KVR_GGUF_UINT16: case KVR_GGUF_INT16: return 2;
        case KVR_GGUF_UINT32: case KVR_GGUF_INT32: case KVR_GGUF_FLOAT32: return 4;
        case KVR_GGUF_UINT64: case KVR_GGUF_INT64: case KVR_GGUF_FLOAT64: return 8;
        default: return 0;
    }
}

static void check_kv(const struct kvr_gguf * g, uint64_t i) {
    const struct kvr_gguf_kv * kv = &g->kv[i];
    FUZZ_CHECK(kv->key.len > 0);
    FUZZ_CHECK(inside(g, kv->key.s, kv->key.len));
    touch(kv->key.s, kv->key.len);
    FUZZ_CHECK(kv->type >= 0 && kv->type < KVR_GGUF_TYPE_COUNT);
    FUZZ_CHECK(kvr_gguf_type_name(kv->type) != NULL);

    const bool arr = kv->type == KVR_GGUF_ARRAY;
    const enum kvr_gguf_type et = arr ? kv->arr_type : kv->type;
    FUZZ_CHECK(et != KVR_GGUF_ARRAY && et >= 0 && et < KVR_GGUF_TYPE_COUNT);
    if (!arr) FUZZ_CHECK(kv->n == 1);
    if (et == KVR_GGUF_STRING) {
        FUZZ_CHECK(kv->n == 0 || kv->strs != NULL);
        // each string carries an 8-byte length in the file: n can't exceed the file
        FUZZ_CHECK(kv->n <= g->size / 8);
        for (uint64_t j = 0; j < kv->n; j++) {
            FUZZ_CHECK(inside(g, kv->strs[j].s, kv->strs[j].len));
            touch(kv->strs[j].s, kv->strs[j].len);
        }
    } else {
        const size_t es = elem_size(et);
        FUZZ_CHECK(es > 0);
        FUZZ_CHECK(kv->n <= g->size / es);
        FUZZ_CHECK(kv->n == 0 || kv->data != NULL);
        if (kv->n) {
            FUZZ_CHECK(inside(g, kv->data, kv->n * es));
            touch(kv->data, kv->n * es);
        }
    }

    // the lookups and getters, with the key as a C string (keys with a NUL inside can't be named)
    if (memchr(kv->key.s, 0, kv->key.len) != NULL) return;
    char * key = malloc(kv->key.len + 1);
    FUZZ_CHECK(key != NULL);
    memcpy(key, kv->key.s, kv->key.len);
    key[kv->key.len] = 0;
    const int64_t idx = kvr_gguf_find_key(g, key);
    FUZZ_CHECK(idx == (int64_t) i); // duplicate keys are refused, so the first match is this one
    FUZZ_CHECK(kvr_gguf_get_kv(g, key) == kv);
    uint32_t u = 0; float f = 0; bool b = false; char s[32];
    const int r_u = kvr_gguf_get_u32(g, key, &u);
    const int r_f = kvr_gguf_get_f32(g, key, &f);
    const int r_b = kvr_gguf_get_bool(g, key, &b);
    const int r_s = kvr_gguf_get_str(g, key, s, sizeof(s));
    if (r_u == KVR_OK) FUZZ_CHECK(!arr && et != KVR_GGUF_STRING && et != KVR_GGUF_FLOAT32 && et != KVR_GGUF_FLOAT64);
    if (r_f == KVR_OK) FUZZ_CHECK(!arr);
    if (r_b == KVR_OK) FUZZ_CHECK(!arr);
    if (r_s == KVR_OK) { FUZZ_CHECK(!arr && et == KVR_GGUF_STRING); FUZZ_CHECK(memchr(s, 0, sizeof(s)) != NULL); }
    if (r_s != KVR_OK) FUZZ_CHECK(kvr_last_error()[0] != 0);
    uint32_t fb;
    memcpy(&fb, &f, sizeof(fb)); // not a float-to-int cast: f may be NaN or huge
    sink += u + fb + b;
    free(key);
}

static void check_tensor(const struct kvr_gguf * g, uint64_t i) {
    const struct kvr_gguf_tensor * t = &g->tensors[i];
    FUZZ_CHECK(memchr(t->name, 0, sizeof(t->name)) != NULL);
    FUZZ_CHECK(t->n_dims >= 0 && t->n_dims <= KVR_MAX_DIMS);
    int64_t ne = 1;
    for (int j = 0; j < KVR_MAX_DIMS; j++) {
        FUZZ_CHECK(t->ne[j] >= 0);
        FUZZ_CHECK(t->ne[j] == 0 || ne <= INT64_MAX / t->ne[j]);
        ne *= t->ne[j];
    }
    const int64_t bs = kvr_blck_size(t->type);
    FUZZ_CHECK(bs > 0);
    FUZZ_CHECK(t->ne[0] % bs == 0);
    FUZZ_CHECK(t->size == (size_t)(ne / bs) * kvr_type_size(t->type));
    FUZZ_CHECK(kvr_type_name(t->type) != NULL);
    FUZZ_CHECK(g->alignment > 0 && (g->alignment & (g->alignment - 1)) == 0);
    FUZZ_CHECK(t->offset % g->alignment == 0);
    FUZZ_CHECK(t->data == g->base + g->data_offset + t->offset);
    FUZZ_CHECK(inside(g, t->data, t->size));
    touch(t->data, t->size);
    FUZZ_CHECK(kvr_gguf_get_tensor(g, t->name) == t); // names are unique
    // no overlap with an earlier tensor (quadratic: only for small counts)
    if (g->n_tensors <= 512) {
        for (uint64_t k = 0; k < i; k++) {
            const struct kvr_gguf_tensor * o = &g->tensors[k];
            if (t->size == 0 || o->size == 0) continue;
            FUZZ_CHECK(t->offset >= o->offset + o->size || o->offset >= t->offset + t->size);
        }
    }
}

static void exercise_vocab(const struct kvr_gguf * g) {
    struct kvr_vocab * v = kvr_vocab_load(g);
    if (!v) return;
    const int n = kvr_vocab_n_tokens(v);
    FUZZ_CHECK(n >= 0);
    sink += (uint64_t) kvr_vocab_kind(v) + (uint64_t) kvr_vocab_bos(v) + (uint64_t) kvr_vocab_eos(v) + kvr_vocab_add_bos(v);

    static const char * const texts[] = { "Hello world", " <s>a\xe2\x96\x81</s> \xff\xfe\n\t 123", "" };
    int32_t ids[64];
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        for (int sp = 0; sp < 2; sp++) {
            const int m = kvr_tokenize(v, texts[i], ids, 64, true, sp);
            if (m < 0) continue;
            for (int j = 0; j < m && j < 64; j++) FUZZ_CHECK(ids[j] >= 0 && ids[j] < n);
        }
    }
    char buf[64];
    const int lim = n < 4096 ? n : 4096;
    for (int id = 0; id < lim; id++) {
        const int r = kvr_token_to_piece(v, id, buf, (int) sizeof(buf), true);
        FUZZ_CHECK(r <= (int) sizeof(buf));
        sink += (uint64_t) r + kvr_vocab_is_eog(v, id);
    }
    kvr_vocab_free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    kvr_error(KVR_OK, "%s", "");
    struct kvr_gguf * g = kvr_gguf_open_mem(data, size);
    if (!g) {
        FUZZ_CHECK(kvr_last_error()[0] != 0); // every rejection says why
        return 0;
    }
    FUZZ_CHECK(g->base == data && g->size == size && !g->mapped);
    FUZZ_CHECK(g->version == 2 || g->version == 3);
    FUZZ_CHECK(g->data_offset <= size);
    FUZZ_CHECK(g->n_kv == 0 || g->kv != NULL);
    FUZZ_CHECK(g->n_tensors == 0 || g->tensors != NULL);
    // an entry takes at least 8 + 1 + 4 + 1 bytes (non-empty key, a u8), a tensor info 8 + 4 + 4 + 8
    FUZZ_CHECK(g->n_kv <= size / 14);
    FUZZ_CHECK(g->n_tensors <= size / 24);
    for (uint64_t i = 0; i < g->n_kv; i++) check_kv(g, i);
    for (uint64_t i = 0; i < g->n_tensors; i++) check_tensor(g, i);
    FUZZ_CHECK(kvr_gguf_find_key(g, "") == -1);
    exercise_vocab(g);
    kvr_gguf_close(g);
    return 0;
}
