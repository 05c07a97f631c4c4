// tests/test-gguf.c - the GGUF reader against files made byte by byte here (a tiny little-endian
// writer of its own, not the library's): a valid v3 image with every metadata type,
// general.alignment and three tensors must come back exactly (through the kv/tensor structs, the
// typed getters and the data pointers); v2, vocab-only, zero-KV and empty files must load; and
// ~150 malformed variants (truncated in every section and mid-field, bad magic and version, absurd
// counts and lengths, counts whose byte size wraps, unknown or nested types, bad dimensions and
// element counts, misaligned, overlapping or out-of-file tensors, duplicate names and keys, bad
// alignment) must each be rejected with a message by kvr_gguf_open_mem, and a few of them (plus a
// zero-length file, a directory and a missing path) by the mmap path kvr_gguf_open, without
// leaking descriptors. Where the format leaves room, a case follows what llama.cpp's gguf.cpp does
// and says so; cases llama.cpp accepts but kvr may reasonably refuse are "either" cases (no crash,
// a message if refused, sane values if accepted).
//
//   test-gguf [--write-corpus DIR] [-v] [SHARED_DIR (ignored: everything is made here)]
//
// --write-corpus DIR also writes every image (valid and malformed) into DIR as seeds for
// fuzz-gguf. The last line printed is "gguf: N passed, M failed" (cases); the exit status is
// non-zero on failure.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char * corpus_dir; // --write-corpus

//
// a little-endian byte writer with named marks (the offset where each field starts)
//

#define MAX_MARKS 512

struct mark {
    char   name[48];
    size_t off;
};

struct tdesc {
    const char * name;
    int          n_dims;
    int64_t      ne[4];
    uint32_t     type;  // KVR_TYPE_F32 or KVR_TYPE_F16 (the builder writes their data)
};

struct img {
    uint32_t     version;
    uint8_t    * p;
    size_t       n, cap;
    struct mark  marks[MAX_MARKS];
    int          n_marks;
    uint64_t     n_kv;
    // the layout the builder chose, for the checks
    size_t       align;
    size_t       data_offset;
    int          n_tensors;
    struct tdesc tensors[8];
    uint64_t     t_off[8];   // relative to the data section
    size_t       t_size[8];
    size_t       t_end;      // file offset just past the last tensor's bytes
};

static void put(struct img * im, const void * src, size_t n) {
    if (im->n + n > im->cap) {
        size_t cap = im->cap ? im->cap * 2 : 4096;
        while (cap < im->n + n) cap *= 2;
        im->p = realloc(im->p, cap);
        if (!im->p) { fprintf(stderr, "out of memory\n"); exit(2); }
        im->cap = cap;
    }
    if (n) memcpy(im->p + im->n, src, n);
    im->n += n;
}

static void put_le(struct img * im, uint64_t v, int nbytes) {
    uint8_t b[8];
    for (int i = 0; i < nbytes; i++) b[i] = (uint8_t)(v >> (8 * i));
    put(im, b, (size_t)nbytes);
}

static void w_u8 (struct img * im, uint8_t  v) { put_le(im, v, 1); }
static void w_u32(struct img * im, uint32_t v) { put_le(im, v, 4); }
static void w_u64(struct img * im, uint64_t v) { put_le(im, v, 8); }
static void w_f32(struct img * im, float v)    { uint32_t u; memcpy(&u, &v, 4); w_u32(im, u); }
static void w_str(struct img * im, const char * s, size_t len) { w_u64(im, len); put(im, s, len); }
static void w_pad(struct img * im, size_t align) { while (im->n % align) w_u8(im, 0); }

static void mark(struct img * im, const char * fmt, ...) {
    if (im->n_marks == MAX_MARKS) { fprintf(stderr, "test bug: too many marks\n"); exit(2); }
    struct mark * m = &im->marks[im->n_marks++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->name, sizeof(m->name), fmt, ap);
    va_end(ap);
    m->off = im->n;
}

static size_t at(const struct img * im, const char * fmt, ...) {
    char name[48];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    for (int i = 0; i < im->n_marks; i++) {
        if (strcmp(im->marks[i].name, name) == 0) return im->marks[i].off;
    }
    fprintf(stderr, "test bug: no mark '%s'\n", name);
    exit(2);
}

// Scalars and arrays of numbers: n values of esz bytes each (host order in, little-endian out).
static size_t gguf_esz(uint32_t t) {
    switch (t) {
        case KVR_GGUF_UINT8: case KVR_GGUF_INT8: case KVR_GGUF_BOOL: return 1;
        case KVR_GGUF_UINT16: case KVR_GGUF_INT16: return 2;
        case KVR_GGUF_UINT32: case KVR_GGUF_INT32: case KVR_GGUF_FLOAT32: return 4;
        case KVR_GGUF_UINT64: case KVR_GGUF_INT64: case KVR_GGUF_FLOAT64: return 8;
        default: return 0;
    }
}

static void w_vals(struct img * im, uint32_t type, const void * vals, uint64_t n) {
    const size_t esz = gguf_esz(type);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t v = 0;
        const uint8_t * src = (const uint8_t *) vals + i * esz;
        switch (esz) {
            case 1: { uint8_t  x; memcpy(&x, src, 1); v = x; } break;
            case 2: { uint16_t x; memcpy(&x, src, 2); v = x; } break;
            case 4: { uint32_t x; memcpy(&x, src, 4); v = x; } break;
            case 8: { uint64_t x; memcpy(&x, src, 8); v = x; } break;
        }
        put_le(im, v, (int) esz);
    }
}

// One metadata entry; marks <tag>.keylen, .key, .type, (.arrtype, .count,) .val
static void kv_head(struct img * im, const char * tag, const char * key, size_t keylen, uint32_t type) {
    mark(im, "%s.keylen", tag);
    w_u64(im, keylen);
    mark(im, "%s.key", tag);
    put(im, key, keylen);
    mark(im, "%s.type", tag);
    w_u32(im, type);
    im->n_kv++;
}

static void kv_num(struct img * im, const char * tag, const char * key, uint32_t type, const void * val) {
    kv_head(im, tag, key, strlen(key), type);
    mark(im, "%s.val", tag);
    w_vals(im, type, val, 1);
}

static void kv_str(struct img * im, const char * tag, const char * key, const char * s) {
    kv_head(im, tag, key, strlen(key), KVR_GGUF_STRING);
    mark(im, "%s.val", tag);
    w_str(im, s, strlen(s));
}

static void kv_arr(struct img * im, const char * tag, const char * key, uint32_t type, const void * vals, uint64_t n) {
    kv_head(im, tag, key, strlen(key), KVR_GGUF_ARRAY);
    mark(im, "%s.arrtype", tag);
    w_u32(im, type);
    mark(im, "%s.count", tag);
    w_u64(im, n);
    mark(im, "%s.val", tag);
    w_vals(im, type, vals, n);
}

static void kv_arr_str(struct img * im, const char * tag, const char * key, const char * const * strs, uint64_t n) {
    kv_head(im, tag, key, strlen(key), KVR_GGUF_ARRAY);
    mark(im, "%s.arrtype", tag);
    w_u32(im, KVR_GGUF_STRING);
    mark(im, "%s.count", tag);
    w_u64(im, n);
    mark(im, "%s.val", tag);
    for (uint64_t i = 0; i < n; i++) w_str(im, strs[i], strlen(strs[i]));
}

//
// the standard image: its metadata and tensors
//

static const uint8_t  v_u8   = 200;
static const int8_t   v_i8   = -5;
static const uint16_t v_u16  = 60000;
static const int16_t  v_i16  = -300;
static const uint32_t v_u32  = 4000000000u;
static const int32_t  v_i32  = -123456;
static const int32_t  v_i32p = 42;
static const float    v_f32  = 3.25f;
static const uint8_t  v_bool = 1;
static const uint64_t v_u64  = 0x123456789ABCDEF0ull;
static const uint64_t v_u64s = 77;
static const int64_t  v_i64  = -9;
static const double   v_f64  = -2.5e300;
static const int32_t  v_arr_i32[5] = { 1, -2, 3, -4, 5 };
static const double   v_arr_f64[3] = { 0.5, -1e-300, 1e300 };
static const uint8_t  v_arr_u8[3]  = { 0, 1, 255 };
static const char *   v_str        = "hello, gguf file";
static const char * const v_arr_str[4] = { "a", "bc", "", "d\303\251f" };

struct numkv { const char * tag; const char * key; uint32_t type; const void * val; };
static const struct numkv std_nums[] = {
    { "u8",   "test.u8",        KVR_GGUF_UINT8,   &v_u8   },
    { "i8",   "test.i8",        KVR_GGUF_INT8,    &v_i8   },
    { "u16",  "test.u16",       KVR_GGUF_UINT16,  &v_u16  },
    { "i16",  "test.i16",       KVR_GGUF_INT16,   &v_i16  },
    { "u32",  "test.u32",       KVR_GGUF_UINT32,  &v_u32  },
    { "i32",  "test.i32",       KVR_GGUF_INT32,   &v_i32  },
    { "i32p", "test.i32_pos",   KVR_GGUF_INT32,   &v_i32p },
    { "f32",  "test.f32",       KVR_GGUF_FLOAT32, &v_f32  },
    { "bool", "test.bool",      KVR_GGUF_BOOL,    &v_bool },
    { "u64",  "test.u64",       KVR_GGUF_UINT64,  &v_u64  },
    { "u64s", "test.u64_small", KVR_GGUF_UINT64,  &v_u64s },
    { "i64",  "test.i64",       KVR_GGUF_INT64,   &v_i64  },
    { "f64",  "test.f64",       KVR_GGUF_FLOAT64, &v_f64  },
};
#define N_STD_NUMS ((int)(sizeof(std_nums) / sizeof(std_nums[0])))

static const struct tdesc std_tensors[3] = {
    { "t.a", 2, { 4, 3, 1, 1 }, KVR_TYPE_F32 },
    { "t.b", 1, { 8, 1, 1, 1 }, KVR_TYPE_F16 },
    { "t.c", 3, { 2, 2, 2, 1 }, KVR_TYPE_F32 },
};

static const uint16_t f16_pattern[8] = { 0x3C00, 0xC000, 0x3800, 0x0000, 0x7BFF, 0x0001, 0xBC00, 0x4200 };

static float f32_value(int ti, int64_t i) { return (float)(ti * 100 + i) * 0.5f - 3.0f; }

enum { ALIGN_U32, ALIGN_NONE, ALIGN_U64, ALIGN_STR };

struct opts {
    uint32_t     version;     // 0 means 3
    int          align_mode;  // how general.alignment is written
    uint32_t     align_val;   // the value written (0 with ALIGN_U32 means 64)
    bool         std_kvs;     // general.architecture and the test.* entries
    bool         vocab;       // a tiny SPM tokenizer
    void      (* extra)(struct img * im); // more entries at the end of the metadata
    const struct tdesc * tensors; // NULL: std_tensors
    int          n_tensors;   // -1: all of std_tensors
    bool         no_trailing_pad; // the file ends with the last tensor's bytes
    uint64_t     data_gap;    // extra bytes before the last tensor (a hole in the data section)
};

static void vocab_kvs(struct img * im) {
    static char   storage[300][8];
    const char *  toks[300];
    float         scores[300];
    int32_t       types[300];
    int           n = 0;
    toks[n] = "<unk>"; types[n] = KVR_TOKEN_UNKNOWN; scores[n] = 0; n++;
    toks[n] = "<s>";   types[n] = KVR_TOKEN_CONTROL; scores[n] = 0; n++;
    toks[n] = "</s>";  types[n] = KVR_TOKEN_CONTROL; scores[n] = 0; n++;
    for (int b = 0; b < 256; b++) {
        snprintf(storage[b], sizeof(storage[b]), "<0x%02X>", b);
        toks[n] = storage[b]; types[n] = KVR_TOKEN_BYTE; scores[n] = 0; n++;
    }
    static const char * const pieces[] = {
        "\xe2\x96\x81", "\xe2\x96\x81h", "\xe2\x96\x81he", "llo", "\xe2\x96\x81hello", "e", "h", "l", "o",
        "\xe2\x96\x81w", "or", "ld", "\xe2\x96\x81world", "\xe2\x96\x81wor", "r", "d", "w",
    };
    for (size_t i = 0; i < sizeof(pieces) / sizeof(pieces[0]); i++) {
        toks[n] = pieces[i]; types[n] = KVR_TOKEN_NORMAL; scores[n] = -(float) i; n++;
    }
    const uint32_t bos = 1, eos = 2, unk = 0;
    const uint8_t  yes = 1;
    kv_str    (im, "tok_model",  "tokenizer.ggml.model", "llama");
    kv_arr_str(im, "tok_tokens", "tokenizer.ggml.tokens", toks, (uint64_t) n);
    kv_arr    (im, "tok_scores", "tokenizer.ggml.scores", KVR_GGUF_FLOAT32, scores, (uint64_t) n);
    kv_arr    (im, "tok_types",  "tokenizer.ggml.token_type", KVR_GGUF_INT32, types, (uint64_t) n);
    kv_num    (im, "tok_bos",    "tokenizer.ggml.bos_token_id", KVR_GGUF_UINT32, &bos);
    kv_num    (im, "tok_eos",    "tokenizer.ggml.eos_token_id", KVR_GGUF_UINT32, &eos);
    kv_num    (im, "tok_unk",    "tokenizer.ggml.unknown_token_id", KVR_GGUF_UINT32, &unk);
    kv_num    (im, "tok_addbos", "tokenizer.ggml.add_bos_token", KVR_GGUF_BOOL, &yes);
}

#define N_VOCAB_TOKENS (3 + 256 + 17)

static int64_t nelem(const struct tdesc * t) {
    int64_t n = 1;
    for (int j = 0; j < t->n_dims; j++) n *= t->ne[j];
    return n;
}

static size_t t_bytes(const struct tdesc * t) {
    return (size_t) nelem(t) * (t->type == KVR_TYPE_F16 ? 2 : 4);
}

static void build(struct img * im, const struct opts * o) {
    memset(im, 0, sizeof(*im));
    const uint32_t version = o->version ? o->version : 3;
    im->version = version;
    const struct tdesc * tens = o->tensors ? o->tensors : std_tensors;
    const int n_tensors = o->n_tensors < 0 ? 3 : o->n_tensors;
    uint32_t align_val = o->align_val ? o->align_val : 64;
    size_t align = 32; // GGUF's default
    if (o->align_mode == ALIGN_U32 && align_val && !(align_val & (align_val - 1)) && align_val <= 4096) {
        align = align_val;
    }

    mark(im, "magic");
    put(im, "GGUF", 4);
    mark(im, "version");
    w_u32(im, version);
    mark(im, "n_tensors");
    w_u64(im, (uint64_t) n_tensors);
    mark(im, "n_kv");
    w_u64(im, 0); // patched below
    mark(im, "kvs");

    if (o->std_kvs) {
        kv_str(im, "arch", "general.architecture", "llama");
    }
    if (o->align_mode == ALIGN_U32) {
        kv_num(im, "align", "general.alignment", KVR_GGUF_UINT32, &align_val);
    } else if (o->align_mode == ALIGN_U64) {
        const uint64_t a = align_val;
        kv_num(im, "align", "general.alignment", KVR_GGUF_UINT64, &a);
    } else if (o->align_mode == ALIGN_STR) {
        kv_str(im, "align", "general.alignment", "64");
    }
    if (o->std_kvs) {
        for (int i = 0; i < N_STD_NUMS; i++) {
            kv_num(im, std_nums[i].tag, std_nums[i].key, std_nums[i].type, std_nums[i].val);
        }
        kv_str    (im, "str",       "test.str", v_str);
        kv_str    (im, "str_empty", "test.str_empty", "");
        kv_arr    (im, "arr_i32",   "test.arr_i32", KVR_GGUF_INT32, v_arr_i32, 5);
        kv_arr    (im, "arr_f64",   "test.arr_f64", KVR_GGUF_FLOAT64, v_arr_f64, 3);
        kv_arr    (im, "arr_u8",    "test.arr_u8", KVR_GGUF_UINT8, v_arr_u8, 3);
        kv_arr    (im, "arr_empty", "test.arr_empty", KVR_GGUF_INT32, NULL, 0);
        kv_arr_str(im, "arr_str",   "test.arr_str", v_arr_str, 4);
    }
    if (o->vocab) vocab_kvs(im);
    if (o->extra) o->extra(im);
    mark(im, "kvs_end");

    // tensor infos; the data section is laid out as llama.cpp's writer does: each tensor at an
    // aligned offset, in order
    uint64_t off = 0;
    im->n_tensors = n_tensors;
    for (int i = 0; i < n_tensors; i++) {
        const struct tdesc * t = &tens[i];
        im->tensors[i] = *t;
        if (i == n_tensors - 1) off += o->data_gap;
        im->t_off[i]  = off;
        im->t_size[i] = t_bytes(t);
        off += (im->t_size[i] + align - 1) / align * align;

        mark(im, "t%d.namelen", i);
        w_u64(im, strlen(t->name));
        mark(im, "t%d.name", i);
        put(im, t->name, strlen(t->name));
        mark(im, "t%d.ndims", i);
        w_u32(im, (uint32_t) t->n_dims);
        mark(im, "t%d.ne", i);
        for (int j = 0; j < t->n_dims; j++) w_u64(im, (uint64_t) t->ne[j]);
        mark(im, "t%d.type", i);
        w_u32(im, t->type);
        mark(im, "t%d.offset", i);
        w_u64(im, im->t_off[i]);
    }
    mark(im, "pad");
    if (n_tensors > 0) w_pad(im, align);
    im->align       = align;
    im->data_offset = im->n;
    mark(im, "data");
    for (int i = 0; i < n_tensors; i++) {
        const struct tdesc * t = &tens[i];
        while (im->n < im->data_offset + im->t_off[i]) w_u8(im, 0xAB); // a gap: not zeros, on purpose
        mark(im, "t%d.data", i);
        const int64_t ne = nelem(t);
        for (int64_t k = 0; k < ne; k++) {
            if (t->type == KVR_TYPE_F16) put_le(im, f16_pattern[k % 8], 2);
            else                         w_f32(im, f32_value(i, k));
        }
        im->t_end = im->n;
        if (i < n_tensors - 1 || !o->no_trailing_pad) w_pad(im, align);
    }

    // patch n_kv
    const size_t p = at(im, "n_kv");
    for (int b = 0; b < 8; b++) im->p[p + b] = (uint8_t)(im->n_kv >> (8 * b));
}

//
// checks
//

// The summary counts cases, as the ok/FAIL lines do: a case passes when none of its checks failed.
static int case_pass0, case_fail0; // n_pass and n_fail when the case began

static void case_begin(const char * name) {
    case_pass0 = n_pass;
    case_fail0 = n_fail;
    set_case("%s", name);
    fflush(stdout); // if the reader crashes, the log says on what
}

static void case_end(const char * name, const char * outcome) {
    const bool ok = n_fail == case_fail0;
    n_pass = case_pass0 + ok;
    n_fail = case_fail0 + !ok;
    printf("%s %-34s %s\n", ok ? "ok  " : "FAIL", name, outcome ? outcome : "");
    fflush(stdout);
    g_case[0] = '\0';
}

static bool keyeq(const struct kvr_gguf_str * s, const char * want) {
    return s->len == strlen(want) && (s->len == 0 || memcmp(s->s, want, s->len) == 0);
}

static bool in_file(const struct kvr_gguf * g, const void * p, uint64_t len) {
    const uint8_t * q = p;
    return q >= g->base && q <= g->base + g->size && len <= (uint64_t)(g->base + g->size - q);
}

static const struct kvr_gguf_kv * must_kv(const struct kvr_gguf * g, const char * key) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    CHECK(kv != NULL, "key '%s' missing", key);
    if (!kv) return NULL;
    const int64_t idx = kvr_gguf_find_key(g, key);
    CHECK(idx >= 0 && (uint64_t) idx < g->n_kv && &g->kv[idx] == kv,
          "find_key('%s') = %lld does not index get_kv's entry", key, (long long) idx);
    CHECK(keyeq(&kv->key, key), "key '%s': key field wrong", key);
    CHECK(in_file(g, kv->key.s, kv->key.len), "key '%s': key string not inside the buffer", key);
    return kv;
}

static void check_num_kv(const struct kvr_gguf * g, const char * key, uint32_t type, const void * val) {
    const struct kvr_gguf_kv * kv = must_kv(g, key);
    if (!kv) return;
    CHECK(kv->type == (enum kvr_gguf_type) type, "'%s': type %d, want %u", key, (int) kv->type, type);
    CHECK(kv->n == 1, "'%s': n = %llu, want 1", key, (unsigned long long) kv->n);
    CHECK(kv->data != NULL, "'%s': data NULL", key);
    if (kv->data) CHECK(memcmp(kv->data, val, gguf_esz(type)) == 0, "'%s': value differs", key);
}

static void check_arr_kv(const struct kvr_gguf * g, const char * key, uint32_t type, const void * vals, uint64_t n) {
    const struct kvr_gguf_kv * kv = must_kv(g, key);
    if (!kv) return;
    CHECK(kv->type == KVR_GGUF_ARRAY, "'%s': type %d, want array", key, (int) kv->type);
    CHECK(kv->arr_type == (enum kvr_gguf_type) type, "'%s': arr_type %d, want %u", key, (int) kv->arr_type, type);
    CHECK(kv->n == n, "'%s': n = %llu, want %llu", key, (unsigned long long) kv->n, (unsigned long long) n);
    if (n && kv->n == n) {
        CHECK(kv->data != NULL && memcmp(kv->data, vals, n * gguf_esz(type)) == 0, "'%s': values differ", key);
    }
}

static void check_str_kv(const struct kvr_gguf * g, const char * key, const char * const * want, uint64_t n, bool arr) {
    const struct kvr_gguf_kv * kv = must_kv(g, key);
    if (!kv) return;
    if (arr) {
        CHECK(kv->type == KVR_GGUF_ARRAY && kv->arr_type == KVR_GGUF_STRING, "'%s': not an array of strings (%d/%d)",
              key, (int) kv->type, (int) kv->arr_type);
    } else {
        CHECK(kv->type == KVR_GGUF_STRING, "'%s': type %d, want string", key, (int) kv->type);
    }
    CHECK(kv->n == n, "'%s': n = %llu, want %llu", key, (unsigned long long) kv->n, (unsigned long long) n);
    CHECK(kv->strs != NULL, "'%s': strs NULL", key);
    if (!kv->strs || kv->n != n) return;
    for (uint64_t i = 0; i < n; i++) {
        CHECK(keyeq(&kv->strs[i], want[i]), "'%s'[%llu] differs", key, (unsigned long long) i);
        CHECK(in_file(g, kv->strs[i].s, kv->strs[i].len), "'%s'[%llu] not inside the buffer", key, (unsigned long long) i);
    }
}

static void check_std_kvs(const struct kvr_gguf * g) {
    const char * arch[1] = { "llama" };
    check_str_kv(g, "general.architecture", arch, 1, false);
    for (int i = 0; i < N_STD_NUMS; i++) check_num_kv(g, std_nums[i].key, std_nums[i].type, std_nums[i].val);
    const char * s[1] = { v_str };
    const char * e[1] = { "" };
    check_str_kv(g, "test.str", s, 1, false);
    check_str_kv(g, "test.str_empty", e, 1, false);
    check_arr_kv(g, "test.arr_i32", KVR_GGUF_INT32, v_arr_i32, 5);
    check_arr_kv(g, "test.arr_f64", KVR_GGUF_FLOAT64, v_arr_f64, 3);
    check_arr_kv(g, "test.arr_u8", KVR_GGUF_UINT8, v_arr_u8, 3);
    check_arr_kv(g, "test.arr_empty", KVR_GGUF_INT32, NULL, 0);
    check_str_kv(g, "test.arr_str", v_arr_str, 4, true);

    // typed getters
    uint32_t u = 0;
    CHECK(kvr_gguf_get_u32(g, "test.u32", &u) == KVR_OK && u == v_u32, "get_u32(test.u32) = %u", u);
    CHECK(kvr_gguf_get_u32(g, "test.u8", &u) == KVR_OK && u == v_u8, "get_u32(test.u8) = %u (u8 fits)", u);
    CHECK(kvr_gguf_get_u32(g, "test.u16", &u) == KVR_OK && u == v_u16, "get_u32(test.u16) = %u (u16 fits)", u);
    CHECK(kvr_gguf_get_u32(g, "test.i32_pos", &u) == KVR_OK && u == 42, "get_u32(test.i32_pos) = %u (42 fits)", u);
    CHECK(kvr_gguf_get_u32(g, "test.u64_small", &u) == KVR_OK && u == 77, "get_u32(test.u64_small) = %u (77 fits)", u);
    CHECK(kvr_gguf_get_u32(g, "general.alignment", &u) == KVR_OK && u == 64, "get_u32(general.alignment) = %u", u);
    const char * no_fit[] = { "test.i8", "test.i16", "test.i32", "test.i64", "test.u64" };
    for (size_t i = 0; i < sizeof(no_fit) / sizeof(no_fit[0]); i++) {
        CHECK(kvr_gguf_get_u32(g, no_fit[i], &u) != KVR_OK && kvr_last_error()[0],
              "get_u32(%s) accepted a value that does not fit a u32", no_fit[i]);
    }
    const char * not_int[] = { "test.f32", "test.f64", "test.str", "test.arr_i32", "test.arr_str" };
    for (size_t i = 0; i < sizeof(not_int) / sizeof(not_int[0]); i++) {
        CHECK(kvr_gguf_get_u32(g, not_int[i], &u) != KVR_OK, "get_u32(%s) accepted a non-integer", not_int[i]);
    }
    kvr_error(KVR_OK, "%s", "");
    CHECK(kvr_gguf_get_u32(g, "test.missing_key", &u) != KVR_OK && strstr(kvr_last_error(), "test.missing_key"),
          "get_u32 of a missing key: no error naming it ('%s')", kvr_last_error());

    float f = 0;
    CHECK(kvr_gguf_get_f32(g, "test.f32", &f) == KVR_OK && f == v_f32, "get_f32(test.f32) = %g", (double) f);
    CHECK(kvr_gguf_get_f32(g, "test.str", &f) != KVR_OK, "get_f32(test.str) accepted a string");
    kvr_error(KVR_OK, "%s", "");
    CHECK(kvr_gguf_get_f32(g, "test.nope", &f) != KVR_OK && strstr(kvr_last_error(), "test.nope"),
          "get_f32 of a missing key: no error naming it ('%s')", kvr_last_error());

    bool bv = false;
    CHECK(kvr_gguf_get_bool(g, "test.bool", &bv) == KVR_OK && bv, "get_bool(test.bool)");
    CHECK(kvr_gguf_get_bool(g, "test.str", &bv) != KVR_OK, "get_bool(test.str) accepted a string");

    char buf[64];
    memset(buf, 'x', sizeof(buf));
    CHECK(kvr_gguf_get_str(g, "test.str", buf, sizeof(buf)) == KVR_OK && strcmp(buf, v_str) == 0,
          "get_str(test.str) = '%.63s'", buf);
    memset(buf, 'x', sizeof(buf));
    CHECK(kvr_gguf_get_str(g, "test.str", buf, 6) == KVR_OK && strcmp(buf, "hello") == 0 && buf[6] == 'x',
          "get_str(test.str, cap 6) = '%.63s' (want 'hello', nothing written past cap)", buf);
    memset(buf, 'x', sizeof(buf));
    CHECK(kvr_gguf_get_str(g, "test.str", buf, 1) == KVR_OK && buf[0] == 0 && buf[1] == 'x', "get_str(test.str, cap 1)");
    CHECK(kvr_gguf_get_str(g, "test.str_empty", buf, sizeof(buf)) == KVR_OK && buf[0] == 0, "get_str(test.str_empty)");
    CHECK(kvr_gguf_get_str(g, "general.architecture", buf, sizeof(buf)) == KVR_OK && strcmp(buf, "llama") == 0,
          "get_str(general.architecture)");
    CHECK(kvr_gguf_get_str(g, "test.u32", buf, sizeof(buf)) != KVR_OK, "get_str(test.u32) accepted a number");
    CHECK(kvr_gguf_get_str(g, "test.arr_str", buf, sizeof(buf)) != KVR_OK, "get_str(test.arr_str) accepted an array");

    CHECK(kvr_gguf_find_key(g, "test.missing") == -1, "find_key of a missing key");
    CHECK(kvr_gguf_get_kv(g, "test.missing") == NULL, "get_kv of a missing key");
    CHECK(kvr_gguf_find_key(g, "test") == -1, "find_key matched a prefix");
    CHECK(kvr_gguf_find_key(g, "test.u32x") == -1, "find_key matched a longer key");
}

// The tensors of im, as laid out by build().
static void check_tensors(const struct kvr_gguf * g, const struct img * im) {
    CHECK(g->n_tensors == (uint64_t) im->n_tensors, "n_tensors = %llu, want %d", (unsigned long long) g->n_tensors, im->n_tensors);
    CHECK(g->alignment == im->align, "alignment = %zu, want %zu", g->alignment, im->align);
    if (im->n_tensors > 0) {
        CHECK(g->data_offset == im->data_offset, "data_offset = %zu, want %zu", g->data_offset, im->data_offset);
    }
    if (g->n_tensors != (uint64_t) im->n_tensors) return;
    for (int i = 0; i < im->n_tensors; i++) {
        const struct tdesc * d = &im->tensors[i];
        const struct kvr_gguf_tensor * t = kvr_gguf_get_tensor(g, d->name);
        CHECK(t != NULL, "tensor '%s' missing", d->name);
        if (!t) continue;
        CHECK(t == &g->tensors[i], "tensor '%s' is not tensors[%d] (file order)", d->name, i);
        CHECK(strcmp(t->name, d->name) == 0, "tensor '%s': name '%s'", d->name, t->name);
        CHECK(t->n_dims == d->n_dims, "tensor '%s': n_dims %d, want %d", d->name, t->n_dims, d->n_dims);
        for (int j = 0; j < KVR_MAX_DIMS; j++) {
            const int64_t want = j < d->n_dims ? d->ne[j] : 1;
            CHECK(t->ne[j] == want, "tensor '%s': ne[%d] = %lld, want %lld", d->name, j, (long long) t->ne[j], (long long) want);
        }
        CHECK(t->type == (enum kvr_type) d->type, "tensor '%s': type %d", d->name, (int) t->type);
        CHECK(t->offset == im->t_off[i], "tensor '%s': offset %llu, want %llu", d->name,
              (unsigned long long) t->offset, (unsigned long long) im->t_off[i]);
        CHECK(t->size == im->t_size[i], "tensor '%s': size %zu, want %zu", d->name, t->size, im->t_size[i]);
        CHECK(t->data == g->base + im->data_offset + im->t_off[i], "tensor '%s': data pointer not base + data_offset + offset", d->name);
        if (t->data != g->base + im->data_offset + im->t_off[i]) continue;
        const int64_t ne = nelem(d);
        int bad = 0;
        for (int64_t k = 0; k < ne; k++) {
            const uint8_t * p = (const uint8_t *) t->data;
            if (d->type == KVR_TYPE_F16) {
                const uint16_t h = (uint16_t)(p[2 * k] | p[2 * k + 1] << 8);
                bad += h != f16_pattern[k % 8];
            } else {
                const uint32_t w = (uint32_t) p[4 * k] | (uint32_t) p[4 * k + 1] << 8 | (uint32_t) p[4 * k + 2] << 16 | (uint32_t) p[4 * k + 3] << 24;
                float v;
                memcpy(&v, &w, 4);
                bad += v != f32_value(i, k);
            }
        }
        CHECK(bad == 0, "tensor '%s': %d elements differ", d->name, bad);
    }
    CHECK(kvr_gguf_get_tensor(g, "t.zzz") == NULL, "get_tensor of a missing name");
    CHECK(kvr_gguf_get_tensor(g, "t") == NULL, "get_tensor matched a prefix");
}

static void check_header(const struct kvr_gguf * g, const struct img * im, uint32_t version, const void * buf, bool mapped) {
    CHECK(g->version == version, "version = %u, want %u", g->version, version);
    CHECK(g->n_kv == im->n_kv, "n_kv = %llu, want %llu", (unsigned long long) g->n_kv, (unsigned long long) im->n_kv);
    CHECK(g->size == im->n, "size = %zu, want %zu", g->size, im->n);
    CHECK(g->mapped == mapped, "mapped = %d, want %d", g->mapped, mapped);
    if (buf) CHECK(g->base == buf, "base is not the caller's buffer");
    if (g->base && !mapped) CHECK(memcmp(g->base, im->p, im->n) == 0, "base contents differ");
    for (uint64_t i = 0; i < g->n_kv && i < im->n_kv; i++) {
        CHECK(in_file(g, g->kv[i].key.s, g->kv[i].key.len), "kv[%llu] key not inside the buffer", (unsigned long long) i);
    }
}

//
// running a case
//

static void write_file(const char * path, const void * p, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno)); exit(2); }
    if (n && fwrite(p, 1, n, f) != n) { fprintf(stderr, "short write %s\n", path); exit(2); }
    fclose(f);
}

static void to_corpus(const char * name, const void * p, size_t n) {
    if (!corpus_dir) return;
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s.gguf", corpus_dir, name);
    write_file(path, p, n);
}

// A heap copy of exactly n bytes, so any read past the end is a sanitizer report.
static uint8_t * exact_copy(const void * p, size_t n) {
    uint8_t * q = malloc(n ? n : 1);
    if (!q) { fprintf(stderr, "out of memory\n"); exit(2); }
    if (n) memcpy(q, p, n);
    return q;
}

enum expect { REJECT, ACCEPT, EITHER };

// Open (p, n) from memory; check the outcome; run `more` on an accepted result.
static void run_case(const char * name, const void * p, size_t n, enum expect want,
                     void (*more)(const struct kvr_gguf * g, const void * arg), const void * arg) {
    to_corpus(name, p, n);
    case_begin(name);
    uint8_t * buf = exact_copy(p, n);
    kvr_error(KVR_OK, "%s", "");
    struct kvr_gguf * g = kvr_gguf_open_mem(buf, n);
    char outcome[600];
    if (g) {
        snprintf(outcome, sizeof(outcome), "(accepted)");
        CHECK(want != REJECT, "accepted a malformed file");
        CHECK(g->base == buf && g->size == n, "base/size are not the caller's buffer");
        if (more) more(g, arg);
        kvr_gguf_close(g);
    } else {
        snprintf(outcome, sizeof(outcome), "-> %.560s", kvr_last_error());
        CHECK(want != ACCEPT, "rejected a valid file: %s", kvr_last_error());
        CHECK(kvr_last_error()[0] != 0, "rejected without a message");
    }
    free(buf);
    case_end(name, outcome);
}

static void reject(const char * name, const void * p, size_t n) { run_case(name, p, n, REJECT, NULL, NULL); }

// Variants of an image: a copy with a field overwritten.
struct var { uint8_t * p; size_t n; };

static struct var vdup(const struct img * im) {
    struct var v = { exact_copy(im->p, im->n), im->n };
    return v;
}

static void set_le(struct var * v, size_t off, uint64_t x, int nbytes) {
    if (off + (size_t) nbytes > v->n) { fprintf(stderr, "test bug: patch past the end\n"); exit(2); }
    for (int i = 0; i < nbytes; i++) v->p[off + (size_t) i] = (uint8_t)(x >> (8 * i));
}

static void reject_patch(const char * name, const struct img * im, size_t off, uint64_t x, int nbytes) {
    struct var v = vdup(im);
    set_le(&v, off, x, nbytes);
    reject(name, v.p, v.n);
    free(v.p);
}

static void reject_trunc(const char * name, const struct img * im, size_t n) {
    if (n >= im->n) { fprintf(stderr, "test bug: truncation %s not shorter\n", name); exit(2); }
    reject(name, im->p, n);
}

// A prefix of n bytes whose header counts only the entries and tensor infos that start in it
// (one cut at the very start of an entry counts that entry, so the prefix stays truncated).
// Without this, a reader that bounds the counts by the bytes left rejects most metadata cuts at
// the header; with it, the cut itself is what must be found. n must be past the header.
static struct var fitted_prefix(const struct img * im, size_t n) {
    struct var v = { exact_copy(im->p, n), n };
    uint64_t n_kv = 0, n_tensors = 0;
    for (int i = 0; i < im->n_marks; i++) {
        const char * m = im->marks[i].name;
        const size_t len = strlen(m);
        if (im->marks[i].off > n) continue;
        if (len > 7 && strcmp(m + len - 7, ".keylen") == 0) n_kv++;
        if (m[0] == 't' && len > 8 && strcmp(m + len - 8, ".namelen") == 0) n_tensors++;
    }
    set_le(&v, at(im, "n_tensors"), n_tensors, 8);
    set_le(&v, at(im, "n_kv"), n_kv, 8);
    return v;
}

//
// the cases
//

static void more_std(const struct kvr_gguf * g, const void * arg) {
    const struct img * im = arg;
    check_header(g, im, im->version, NULL, false);
    check_std_kvs(g);
    check_tensors(g, im);
}

static void more_tensors_only(const struct kvr_gguf * g, const void * arg) {
    const struct img * im = arg;
    check_header(g, im, im->version, NULL, false);
    check_tensors(g, im);
}

static void more_vocab(const struct kvr_gguf * g, const void * arg) {
    const struct img * im = arg;
    check_header(g, im, 3, NULL, false);
    CHECK(g->n_tensors == 0 && g->n_kv == 8, "n_tensors %llu n_kv %llu", (unsigned long long) g->n_tensors,
          (unsigned long long) g->n_kv);
    CHECK(g->alignment == 32, "default alignment = %zu, want 32", g->alignment);
    // no tensors: llama.cpp's data offset is the end of the metadata (no padding); at the least it
    // must not point past the end of the file
    CHECK(g->data_offset <= g->size, "data_offset %zu is past the end of the %zu-byte file", g->data_offset, g->size);
    char buf[16];
    CHECK(kvr_gguf_get_str(g, "tokenizer.ggml.model", buf, sizeof(buf)) == KVR_OK && strcmp(buf, "llama") == 0,
          "tokenizer.ggml.model");
    const struct kvr_gguf_kv * kv = must_kv(g, "tokenizer.ggml.tokens");
    if (kv) {
        CHECK(kv->n == N_VOCAB_TOKENS, "%llu tokens", (unsigned long long) kv->n);
        CHECK(kv->strs && keyeq(&kv->strs[3 + 0x41], "<0x41>"), "token 68 is not <0x41>");
    }
    uint32_t bos = 0;
    CHECK(kvr_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos) == KVR_OK && bos == 1, "bos");
    bool add = false;
    CHECK(kvr_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add) == KVR_OK && add, "add_bos");
}

static void more_empty(const struct kvr_gguf * g, const void * arg) {
    (void) arg;
    CHECK(g->version == 3 && g->n_kv == 0 && g->n_tensors == 0, "header");
    CHECK(kvr_gguf_find_key(g, "general.alignment") == -1, "find_key in an empty file");
    CHECK(kvr_gguf_get_tensor(g, "t.a") == NULL, "get_tensor in an empty file");
    CHECK(g->alignment == 32, "default alignment = %zu", g->alignment);
    CHECK(g->data_offset <= g->size, "data_offset %zu is past the end of the %zu-byte file", g->data_offset, g->size);
}

// an accepted "either" case must still be self-consistent
static void more_sane(const struct kvr_gguf * g, const void * arg) {
    (void) arg;
    CHECK(g->data_offset <= g->size, "data_offset past the end");
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct kvr_gguf_tensor * t = &g->tensors[i];
        CHECK(t->n_dims >= 0 && t->n_dims <= KVR_MAX_DIMS, "tensor %llu: n_dims %d", (unsigned long long) i, t->n_dims);
        int64_t ne = 1;
        for (int j = 0; j < KVR_MAX_DIMS; j++) {
            CHECK(t->ne[j] >= 0, "tensor '%s': ne[%d] < 0", t->name, j);
            ne *= t->ne[j];
        }
        const int64_t bs = kvr_blck_size(t->type);
        CHECK(bs > 0, "tensor '%s': type %d unknown to kvr", t->name, (int) t->type);
        if (bs > 0) {
            CHECK(t->size == (size_t)(ne / bs) * kvr_type_size(t->type),
                  "tensor '%s': size %zu for %lld elements", t->name, t->size, (long long) ne);
        }
        CHECK(in_file(g, t->data, t->size), "tensor '%s': data outside the buffer", t->name);
        CHECK(t->offset % g->alignment == 0, "tensor '%s': offset %llu not aligned", t->name, (unsigned long long) t->offset);
        CHECK(memchr(t->name, 0, KVR_MAX_NAME) != NULL, "tensor %llu: name not terminated", (unsigned long long) i);
    }
}

// extra metadata for the rebuilt variants
static void extra_nested(struct img * im) {
    // test.nested = [[7, 8]]: an array whose elements are arrays
    kv_head(im, "nested", "test.nested", 11, KVR_GGUF_ARRAY);
    w_u32(im, KVR_GGUF_ARRAY);
    w_u64(im, 1);
    w_u32(im, KVR_GGUF_INT32);
    w_u64(im, 2);
    w_u32(im, 7);
    w_u32(im, 8);
}
static void extra_empty_key(struct img * im) {
    const uint8_t x = 1;
    kv_head(im, "ek", "", 0, KVR_GGUF_UINT8);
    w_vals(im, KVR_GGUF_UINT8, &x, 1);
}
static void extra_non_utf8_key(struct img * im) {
    const uint8_t x = 1;
    kv_num(im, "bad8", "test.\xff\xfe", KVR_GGUF_UINT8, &x);
}
static void extra_dup_key(struct img * im) {
    const uint32_t x = 5;
    kv_num(im, "dup", "test.u32", KVR_GGUF_UINT32, &x); // test.u32 exists already (a different type would do too)
}
static void extra_key_nul(struct img * im) {
    const uint8_t x = 1;
    kv_head(im, "nul", "test.u8\0zz", 10, KVR_GGUF_UINT8); // a key with a NUL inside: "test.u8" as a C string
    w_vals(im, KVR_GGUF_UINT8, &x, 1);
}

static void more_non_utf8(const struct kvr_gguf * g, const void * arg) {
    (void) arg;
    CHECK(kvr_gguf_find_key(g, "test.\xff\xfe") >= 0, "the non-UTF-8 key is not found");
}

static void v1_file(struct img * im) {
    // GGUF v1: 32-bit counts and string lengths
    memset(im, 0, sizeof(*im));
    put(im, "GGUF", 4);
    w_u32(im, 1);
    w_u32(im, 0); // n_tensors
    w_u32(im, 1); // n_kv
    w_u32(im, 20);
    put(im, "general.architecture", 20);
    w_u32(im, KVR_GGUF_STRING);
    w_u32(im, 5);
    put(im, "llama", 5);
}

static int count_fds(void) {
    DIR * d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

static void mmap_reject(const char * name, const char * path) {
    case_begin(name);
    kvr_error(KVR_OK, "%s", "");
    struct kvr_gguf * g = kvr_gguf_open(path);
    char outcome[600];
    if (g) {
        snprintf(outcome, sizeof(outcome), "(accepted)");
        CHECK(false, "kvr_gguf_open accepted it");
        kvr_gguf_close(g);
    } else {
        snprintf(outcome, sizeof(outcome), "-> %.560s", kvr_last_error());
        CHECK(kvr_last_error()[0] != 0, "rejected without a message");
    }
    case_end(name, outcome);
}

static void mmap_cases(const struct img * std) {
    const char * tmp = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/test-gguf-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) { fprintf(stderr, "mkdtemp: %s\n", strerror(errno)); n_fail++; return; }
    char path[700];
    const int fds0 = count_fds();

    // the valid image through the mapping
    snprintf(path, sizeof(path), "%s/valid.gguf", dir);
    write_file(path, std->p, std->n);
    case_begin("mmap.valid");
    kvr_error(KVR_OK, "%s", "");
    struct kvr_gguf * g = kvr_gguf_open(path);
    CHECK(g != NULL, "kvr_gguf_open rejected the valid file: %s", kvr_last_error());
    if (g) {
        check_header(g, std, 3, NULL, true);
        CHECK(g->base && memcmp(g->base, std->p, std->n) == 0, "the mapping differs from the file");
        check_std_kvs(g);
        check_tensors(g, std);
        kvr_gguf_close(g);
    }
    case_end("mmap.valid", NULL);
    unlink(path);

    // malformed files
    struct { const char * name; size_t n; size_t patch_off; uint64_t patch; int nbytes; } files[] = {
        { "mmap.trunc_data",       std->t_end - 1, 0, 0, 0 },
        { "mmap.trunc_header",     13, 0, 0, 0 },
        { "mmap.trunc_tensor_info", at(std, "t1.ne") + 3, 0, 0, 0 },
        { "mmap.bad_magic",        std->n, at(std, "magic"), 0x47475546u /* FUGG */, 4 },
        { "mmap.n_kv_huge",        std->n, at(std, "n_kv"), 1ull << 62, 8 },
        { "mmap.offset_past_end",  std->n, at(std, "t2.offset"), 1ull << 40, 8 },
        { "mmap.string_past_end",  std->n, at(std, "str.val"), 1ull << 20, 8 },
    };
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        struct var v = { exact_copy(std->p, files[i].n), files[i].n };
        if (files[i].nbytes) set_le(&v, files[i].patch_off, files[i].patch, files[i].nbytes);
        snprintf(path, sizeof(path), "%s/bad.gguf", dir);
        write_file(path, v.p, v.n);
        mmap_reject(files[i].name, path);
        unlink(path);
        free(v.p);
    }

    snprintf(path, sizeof(path), "%s/empty.gguf", dir);
    write_file(path, "", 0);
    mmap_reject("mmap.zero_length_file", path);
    unlink(path);

    mmap_reject("mmap.directory", dir);

    snprintf(path, sizeof(path), "%s/no-such-file.gguf", dir);
    mmap_reject("mmap.missing_file", path);

    // the same malformed file many times: a leak per rejection would show in the descriptor count
    // (and in LeakSanitizer's report at exit)
    snprintf(path, sizeof(path), "%s/bad.gguf", dir);
    write_file(path, std->p, std->t_end - 1);
    for (int i = 0; i < 50; i++) {
        struct kvr_gguf * b = kvr_gguf_open(path);
        if (b) kvr_gguf_close(b);
    }
    snprintf(path, sizeof(path), "%s/valid.gguf", dir);
    write_file(path, std->p, std->n);
    for (int i = 0; i < 50; i++) {
        struct kvr_gguf * b = kvr_gguf_open(path);
        if (b) kvr_gguf_close(b);
    }
    unlink(path);
    snprintf(path, sizeof(path), "%s/bad.gguf", dir);
    unlink(path);
    rmdir(dir);

    case_begin("mmap.no_fd_leak");
    const int fds1 = count_fds();
    CHECK(fds0 == fds1, "open descriptors %d before, %d after", fds0, fds1);
    case_end("mmap.no_fd_leak", NULL);
}

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--write-corpus") == 0 && i + 1 < argc) {
            corpus_dir = argv[++i];
            if (mkdir(corpus_dir, 0755) != 0 && errno != EEXIST) {
                fprintf(stderr, "cannot create %s: %s\n", corpus_dir, strerror(errno));
                return 2;
            }
        } else if (strcmp(argv[i], "-v") == 0) {
            verbose = true;
        } else if (argv[i][0] != '-') {
            // the shared-data directory every test is given (tests/run-tests.sh): not needed here
        } else {
            fprintf(stderr, "usage: %s [--write-corpus DIR] [-v] [SHARED_DIR]\n", argv[0]);
            return 2;
        }
    }

    const double t0 = kvr_time_ms();

    //
    // valid files
    //

    struct img std;
    build(&std, &(struct opts){ .std_kvs = true, .n_tensors = -1 });
    if (at(&std, "data") - at(&std, "pad") < 2) {
        fprintf(stderr, "test bug: the standard image needs at least 2 bytes of padding before the data (infos end at %zu)\n",
                at(&std, "pad"));
        return 2;
    }
    printf("standard image: %zu bytes, %llu kvs, data at %zu, tensors end at %zu\n", std.n,
           (unsigned long long) std.n_kv, std.data_offset, std.t_end);

    // exactly the values written, through the structs, the getters and the tensors
    {
        to_corpus("valid.v3", std.p, std.n);
        case_begin("valid.v3");
        uint8_t * buf = exact_copy(std.p, std.n);
        kvr_error(KVR_OK, "%s", "");
        struct kvr_gguf * g = kvr_gguf_open_mem(buf, std.n);
        CHECK(g != NULL, "rejected: %s", kvr_last_error());
        if (g) {
            check_header(g, &std, 3, buf, false);
            check_std_kvs(g);
            check_tensors(g, &std);
            // the order of the entries is the file's
            CHECK(g->n_kv > 2 && keyeq(&g->kv[0].key, "general.architecture") && keyeq(&g->kv[1].key, "general.alignment"),
                  "kv[] is not in file order");
            kvr_gguf_close(g);
        }
        free(buf);
        case_end("valid.v3", NULL);
    }

    struct img v2;
    build(&v2, &(struct opts){ .version = 2, .std_kvs = true, .n_tensors = -1 });
    run_case("valid.v2", v2.p, v2.n, ACCEPT, more_std, &v2);

    struct img voc;
    build(&voc, &(struct opts){ .align_mode = ALIGN_NONE, .vocab = true, .n_tensors = 0 });
    run_case("valid.vocab_only", voc.p, voc.n, ACCEPT, more_vocab, &voc);

    struct img nokv; // tensors, no metadata at all: the default alignment (32) lays them out
    build(&nokv, &(struct opts){ .align_mode = ALIGN_NONE, .n_tensors = -1 });
    run_case("valid.zero_kv", nokv.p, nokv.n, ACCEPT, more_tensors_only, &nokv);

    struct img empty;
    build(&empty, &(struct opts){ .align_mode = ALIGN_NONE, .n_tensors = 0 });
    run_case("valid.empty_header_only", empty.p, empty.n, ACCEPT, more_empty, NULL);

    struct img al1; // alignment 1 is a power of two: llama.cpp accepts it
    build(&al1, &(struct opts){ .align_val = 1, .std_kvs = false, .n_tensors = -1 });
    run_case("valid.alignment_1", al1.p, al1.n, ACCEPT, more_tensors_only, &al1);

    {   // bytes after the data section are ignored (llama.cpp never reads past the last tensor)
        struct img tg;
        build(&tg, &(struct opts){ .std_kvs = true, .n_tensors = -1 });
        put(&tg, "trailing garbage", 16);
        run_case("valid.trailing_bytes", tg.p, tg.n, ACCEPT, more_std, &tg);
        free(tg.p);
    }
    {   // a 63-character tensor name fits KVR_MAX_NAME (64 with the terminator); llama.cpp's limit too
        static const struct tdesc t63[1] = {
            { "t.0123456789012345678901234567890123456789012345678901234567890", 1, { 4, 1, 1, 1 }, KVR_TYPE_F32 } };
        struct img im;
        build(&im, &(struct opts){ .tensors = t63, .n_tensors = 1 });
        run_case("valid.tensor_name_63_chars", im.p, im.n, ACCEPT, more_tensors_only, &im);
        free(im.p);
    }

    //
    // truncations: at every section boundary and in the middle of every kind of field
    //

    struct { const char * name; size_t n; } truncs[] = {
        { "trunc.empty_file",          0 },
        { "trunc.magic",               2 },
        { "trunc.version",             at(&std, "version") + 2 },
        { "trunc.at_n_tensors",        at(&std, "n_tensors") },
        { "trunc.n_tensors",           at(&std, "n_tensors") + 4 },
        { "trunc.n_kv",                at(&std, "n_kv") + 4 },
        { "trunc.header_end",          at(&std, "kvs") },
        { "trunc.key_length",          at(&std, "arch.keylen") + 3 },
        { "trunc.key",                 at(&std, "arch.key") + 5 },
        { "trunc.value_type",          at(&std, "arch.type") + 2 },
        { "trunc.string_length",       at(&std, "arch.val") + 4 },
        { "trunc.string_value",        at(&std, "arch.val") + 8 + 2 },
        { "trunc.u32_value",           at(&std, "align.val") + 1 },
        { "trunc.u8_value",            at(&std, "u8.val") },
        { "trunc.bool_value",          at(&std, "bool.val") },
        { "trunc.u64_value",           at(&std, "u64.val") + 5 },
        { "trunc.f64_value",           at(&std, "f64.val") + 7 },
        { "trunc.array_type",          at(&std, "arr_i32.arrtype") + 2 },
        { "trunc.array_count",         at(&std, "arr_i32.count") + 4 },
        { "trunc.array_body",          at(&std, "arr_i32.val") + 6 },
        { "trunc.array_f64_body",      at(&std, "arr_f64.val") + 16 },
        { "trunc.array_str_length",    at(&std, "arr_str.val") + 3 },
        { "trunc.array_str_body",      at(&std, "arr_str.val") + 8 },
        { "trunc.array_str_last",      at(&std, "kvs_end") - 1 },
        { "trunc.kvs_end",             at(&std, "kvs_end") },
        { "trunc.tensor_name_length",  at(&std, "t0.namelen") + 2 },
        { "trunc.tensor_name",         at(&std, "t0.name") + 1 },
        { "trunc.n_dims",              at(&std, "t0.ndims") + 2 },
        { "trunc.ne",                  at(&std, "t0.ne") + 8 + 3 },
        { "trunc.tensor_type",         at(&std, "t0.type") + 1 },
        { "trunc.tensor_offset",       at(&std, "t0.offset") + 7 },
        { "trunc.second_tensor_info",  at(&std, "t1.namelen") },
        { "trunc.last_tensor_offset",  at(&std, "t2.offset") + 4 },
        { "trunc.tensor_infos_end",    at(&std, "pad") },
        { "trunc.padding",             at(&std, "pad") + 1 },
        { "trunc.data_start",          at(&std, "data") },
        { "trunc.data_first_tensor",   at(&std, "t0.data") + 20 },
        { "trunc.data_between_tensors",at(&std, "t1.data") - 4 },
        { "trunc.data_last_tensor",    at(&std, "t2.data") + 16 },
        { "trunc.data_last_byte",      std.t_end - 1 },
    };
    for (size_t i = 0; i < sizeof(truncs) / sizeof(truncs[0]); i++) reject_trunc(truncs[i].name, &std, truncs[i].n);

    // the same cuts inside the metadata and the tensor infos, with the counts fitted to the prefix
    for (size_t i = 0; i < sizeof(truncs) / sizeof(truncs[0]); i++) {
        if (truncs[i].n < at(&std, "kvs") || truncs[i].n > at(&std, "pad")) continue;
        char name[80];
        snprintf(name, sizeof(name), "trunc_fit.%s", truncs[i].name + strlen("trunc."));
        struct var v = fitted_prefix(&std, truncs[i].n);
        reject(name, v.p, v.n);
        free(v.p);
    }

    // every shorter prefix that cuts into the last tensor's bytes or earlier (one case), and every
    // prefix inside the metadata and tensor infos with fitted counts (another)
    {
        case_begin("trunc.every_length");
        size_t bad_len = (size_t) -1;
        bool   no_msg  = false;
        uint8_t * buf = NULL;
        for (size_t n = 0; n < std.t_end; n++) {
            buf = exact_copy(std.p, n);
            kvr_error(KVR_OK, "%s", "");
            struct kvr_gguf * g = kvr_gguf_open_mem(buf, n);
            if (g) { kvr_gguf_close(g); if (bad_len == (size_t) -1) bad_len = n; }
            else if (!kvr_last_error()[0]) no_msg = true;
            free(buf);
        }
        CHECK(bad_len == (size_t) -1, "a prefix of %zu bytes (of %zu) was accepted", bad_len, std.t_end);
        CHECK(!no_msg, "a prefix was rejected without a message");
        char outcome[64];
        snprintf(outcome, sizeof(outcome), "(%zu prefixes)", std.t_end);
        case_end("trunc.every_length", outcome);

        case_begin("trunc_fit.every_length");
        bad_len = (size_t) -1;
        no_msg  = false;
        const size_t from = at(&std, "kvs"), to = at(&std, "pad");
        for (size_t n = from; n <= to; n++) {
            struct var v = fitted_prefix(&std, n);
            kvr_error(KVR_OK, "%s", "");
            struct kvr_gguf * g = kvr_gguf_open_mem(v.p, v.n);
            if (g) { kvr_gguf_close(g); if (bad_len == (size_t) -1) bad_len = n; }
            else if (!kvr_last_error()[0]) no_msg = true;
            free(v.p);
        }
        CHECK(bad_len == (size_t) -1, "a fitted prefix of %zu bytes was accepted", bad_len);
        CHECK(!no_msg, "a fitted prefix was rejected without a message");
        snprintf(outcome, sizeof(outcome), "(%zu prefixes)", to - from + 1);
        case_end("trunc_fit.every_length", outcome);
    }
    // the file ends with the last tensor's bytes, without the padding after them: the tensors are
    // all inside; llama.cpp's mmap path accepts (its fread path, which reads the padding, does not)
    {
        struct img np;
        build(&np, &(struct opts){ .std_kvs = true, .n_tensors = -1, .no_trailing_pad = true });
        run_case("either.no_trailing_padding", np.p, np.n, EITHER, more_std, &np);
        free(np.p);
    }

    //
    // header
    //

    reject_patch("magic.bad",             &std, at(&std, "magic"), 0x58554747u /* GGUX */, 4);
    reject_patch("magic.byte_swapped",    &std, at(&std, "magic"), 0x47475546u /* FUGG */, 4);
    reject_patch("magic.ggjt",            &std, at(&std, "magic"), 0x67676a74u, 4);
    reject_patch("magic.zero",            &std, at(&std, "magic"), 0, 4);
    reject_patch("version.0",             &std, at(&std, "version"), 0, 4);
    reject_patch("version.1",             &std, at(&std, "version"), 1, 4);  // llama.cpp: v1 no longer supported
    reject_patch("version.4",             &std, at(&std, "version"), 4, 4);  // newer than we know
    reject_patch("version.ffffffff",      &std, at(&std, "version"), 0xFFFFFFFFu, 4);
    reject_patch("version.big_endian_3",  &std, at(&std, "version"), 0x03000000u, 4); // a big-endian file
    {
        struct img v1;
        v1_file(&v1);
        reject("version.1_real_layout", v1.p, v1.n);
        free(v1.p);
    }
    reject_patch("n_kv.2^63",             &std, at(&std, "n_kv"), 1ull << 63, 8); // negative as llama.cpp's int64
    reject_patch("n_kv.max",              &std, at(&std, "n_kv"), UINT64_MAX, 8);
    reject_patch("n_kv.2^40",             &std, at(&std, "n_kv"), 1ull << 40, 8); // positive, far more than fit
    reject_patch("n_kv.one_more",         &std, at(&std, "n_kv"), std.n_kv + 1, 8); // eats the tensor infos
    reject_patch("n_tensors.huge",        &std, at(&std, "n_tensors"), 0xFFFFFFFFFFFFull, 8);
    reject_patch("n_tensors.2^63",        &std, at(&std, "n_tensors"), 1ull << 63, 8);
    reject_patch("n_tensors.max",         &std, at(&std, "n_tensors"), UINT64_MAX, 8);

    //
    // metadata
    //

    reject_patch("key_length.2^62",       &std, at(&std, "arch.keylen"), 1ull << 62, 8);
    reject_patch("key_length.max",        &std, at(&std, "arch.keylen"), UINT64_MAX, 8);
    reject_patch("key_length.past_end",   &std, at(&std, "arch.keylen"), std.n - at(&std, "arch.key") + 1, 8);
    reject_patch("string_length.past_end",&std, at(&std, "str.val"), std.n - at(&std, "str.val") - 8 + 1, 8);
    reject_patch("string_length.2^63",    &std, at(&std, "str.val"), 1ull << 63, 8);
    reject_patch("string_length.max",     &std, at(&std, "str.val"), UINT64_MAX, 8);
    // counts whose byte size wraps around 2^64 to exactly the bytes that are there
    reject_patch("array_count.i32_wraps", &std, at(&std, "arr_i32.count"), (1ull << 62) + 5, 8);
    reject_patch("array_count.f64_wraps", &std, at(&std, "arr_f64.count"), (1ull << 61) + 3, 8);
    reject_patch("array_count.u8_max",    &std, at(&std, "arr_u8.count"), UINT64_MAX, 8);
    reject_patch("array_count.past_end",  &std, at(&std, "arr_i32.count"), 100000, 8);
    reject_patch("array_count.str_huge",  &std, at(&std, "arr_str.count"), 1ull << 60, 8);
    reject_patch("array_count.str_wraps", &std, at(&std, "arr_str.count"), (1ull << 61) + 4, 8);
    reject_patch("array_str.length_huge", &std, at(&std, "arr_str.val"), 1ull << 62, 8);
    reject_patch("array_type.13",         &std, at(&std, "arr_i32.arrtype"), 13, 4);
    reject_patch("array_type.255",        &std, at(&std, "arr_i32.arrtype"), 255, 4);
    reject_patch("array_type.array",      &std, at(&std, "arr_i32.arrtype"), KVR_GGUF_ARRAY, 4); // patched in place
    {
        struct img im; // a well-formed array of arrays: llama.cpp rejects nested arrays
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .extra = extra_nested });
        reject("array.nested", im.p, im.n);
        free(im.p);
    }
    reject_patch("value_type.13",         &std, at(&std, "u32.type"), 13, 4);
    reject_patch("value_type.255",        &std, at(&std, "u32.type"), 255, 4);
    reject_patch("value_type.ffffffff",   &std, at(&std, "u32.type"), 0xFFFFFFFFu, 4);
    reject_patch("value_type.bool_to_i64_past_end", &std, at(&std, "bool.type"), KVR_GGUF_INT64, 4); // shifts the parse
    {
        struct var v = vdup(&std); // "test.u8" renamed "test.i8": two entries with the same key
        v.p[at(&std, "u8.key") + 5] = 'i';
        reject("key.duplicate_renamed", v.p, v.n);
        free(v.p);
    }
    {
        struct img im;
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .extra = extra_dup_key });
        reject("key.duplicate_appended", im.p, im.n);
        free(im.p);
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .extra = extra_empty_key });
        reject("key.empty", im.p, im.n); // llama.cpp asserts on an empty key
        free(im.p);
        // non-UTF-8 bytes in a key: llama.cpp accepts them
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .extra = extra_non_utf8_key });
        run_case("either.key_not_utf8", im.p, im.n, EITHER, more_non_utf8, NULL);
        free(im.p);
        // "test.u8\0zz": llama.cpp keeps it as a std::string (distinct from "test.u8"); as a C
        // string it equals an existing key, so kvr may refuse it
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .extra = extra_key_nul });
        run_case("either.key_with_nul", im.p, im.n, EITHER, NULL, NULL);
        free(im.p);
    }

    // general.alignment
    reject_patch("alignment.0",           &std, at(&std, "align.val"), 0, 4);
    reject_patch("alignment.48",          &std, at(&std, "align.val"), 48, 4);  // not a power of two
    reject_patch("alignment.2^31",        &std, at(&std, "align.val"), 1u << 31, 4); // llama.cpp: > 1 MiB
    reject_patch("alignment.128_misaligned_tensors", &std, at(&std, "align.val"), 128, 4); // a valid value the offsets do not follow
    {
        struct img im;
        build(&im, &(struct opts){ .align_mode = ALIGN_U64, .std_kvs = true, .n_tensors = -1 });
        reject("alignment.type_u64", im.p, im.n); // llama.cpp: must be u32 (asserts otherwise)
        free(im.p);
        build(&im, &(struct opts){ .align_mode = ALIGN_STR, .std_kvs = true, .n_tensors = -1 });
        reject("alignment.type_string", im.p, im.n);
        free(im.p);
    }

    //
    // tensor infos
    //

    reject_patch("tensor_name.length_2^62", &std, at(&std, "t0.namelen"), 1ull << 62, 8);
    reject_patch("tensor_name.length_max",  &std, at(&std, "t0.namelen"), UINT64_MAX, 8);
    {
        struct var v = vdup(&std); // "t.b" renamed "t.a"
        v.p[at(&std, "t1.name") + 2] = 'a';
        reject("tensor_name.duplicate", v.p, v.n);
        free(v.p);
    }
    {
        static const struct tdesc t64[1] = {
            { "t.01234567890123456789012345678901234567890123456789012345678901", 1, { 4, 1, 1, 1 }, KVR_TYPE_F32 } };
        struct img im; // 64 characters do not fit name[64] with its terminator (llama.cpp: >= GGML_MAX_NAME)
        build(&im, &(struct opts){ .tensors = t64, .n_tensors = 1 });
        reject("tensor_name.64_chars", im.p, im.n);
        free(im.p);
    }
    {
        static const struct tdesc tempty[2] = {
            { "",    1, { 4, 1, 1, 1 }, KVR_TYPE_F32 },
            { "t.b", 1, { 8, 1, 1, 1 }, KVR_TYPE_F16 } };
        struct img im; // llama.cpp does not check for empty tensor names
        build(&im, &(struct opts){ .tensors = tempty, .n_tensors = 2 });
        run_case("either.tensor_name_empty", im.p, im.n, EITHER, more_sane, NULL);
        free(im.p);
    }
    reject_patch("n_dims.5",               &std, at(&std, "t0.ndims"), 5, 4);
    reject_patch("n_dims.255",             &std, at(&std, "t0.ndims"), 255, 4);
    reject_patch("n_dims.ffffffff",        &std, at(&std, "t0.ndims"), 0xFFFFFFFFu, 4);
    {
        static const struct tdesc t0d[3] = {
            { "t.a", 2, { 4, 3, 1, 1 }, KVR_TYPE_F32 },
            { "t.b", 0, { 1, 1, 1, 1 }, KVR_TYPE_F16 },
            { "t.c", 3, { 2, 2, 2, 1 }, KVR_TYPE_F32 } };
        struct img im; // a 0-dimensional tensor is a scalar to llama.cpp (ne all 1): accepted there
        build(&im, &(struct opts){ .tensors = t0d, .n_tensors = 3 });
        run_case("either.n_dims_0_scalar", im.p, im.n, EITHER, more_sane, NULL);
        free(im.p);
    }
    reject_patch("ne.negative",            &std, at(&std, "t0.ne"), (uint64_t) -1, 8);
    reject_patch("ne.int64_min",           &std, at(&std, "t2.ne") + 16, 1ull << 63, 8);
    {
        struct var v = vdup(&std); // t.a [2^32, 2^32]: the element count wraps to exactly 0
        set_le(&v, at(&std, "t0.ne"), 1ull << 32, 8);
        set_le(&v, at(&std, "t0.ne") + 8, 1ull << 32, 8);
        reject("ne.product_wraps_to_0", v.p, v.n);
        free(v.p);
        v = vdup(&std); // t.c [2^21, 2^21, 2^22]: 2^64 elements
        set_le(&v, at(&std, "t2.ne"), 1ull << 21, 8);
        set_le(&v, at(&std, "t2.ne") + 8, 1ull << 21, 8);
        set_le(&v, at(&std, "t2.ne") + 16, 1ull << 22, 8);
        reject("ne.product_overflows_3d", v.p, v.n);
        free(v.p);
    }
    reject_patch("ne.bytes_wrap",          &std, at(&std, "t0.ne"), 1ull << 62, 8); // 4 * 2^62 * 3 bytes
    {
        struct var v = vdup(&std); // t.b as F32 [2^62]: the elements fit an int64, their 4 * 2^62 bytes wrap to 0
        set_le(&v, at(&std, "t1.ne"), 1ull << 62, 8);
        set_le(&v, at(&std, "t1.type"), KVR_TYPE_F32, 4);
        reject("ne.f32_bytes_wrap_to_0", v.p, v.n);
        CHECK(strstr(kvr_last_error(), "tensor 't.b'") && strstr(kvr_last_error(), "byte size overflows"),
              "a 1-D F32 tensor of 2^62 elements: %s", kvr_last_error());
        free(v.p);
        v = vdup(&std); // the same in Q8_0 blocks: 2^57 blocks of 34 bytes do not wrap; far past the file
        set_le(&v, at(&std, "t1.ne"), 1ull << 62, 8);
        set_le(&v, at(&std, "t1.type"), KVR_TYPE_Q8_0, 4);
        reject("ne.q8_0_past_the_file", v.p, v.n);
        free(v.p);
    }
    reject_patch("ne.int64_max",           &std, at(&std, "t1.ne"), INT64_MAX, 8);
    {
        struct var v = vdup(&std); // llama.cpp accepts 0 elements in ne[0] (it divides by ne[1..3])
        set_le(&v, at(&std, "t0.ne"), 0, 8);
        run_case("either.ne0_zero", v.p, v.n, EITHER, more_sane, NULL);
        free(v.p);
        v = vdup(&std);
        set_le(&v, at(&std, "t0.ne") + 8, 0, 8);
        run_case("either.ne1_zero", v.p, v.n, EITHER, more_sane, NULL);
        free(v.p);
    }
    reject_patch("blck.q4_0_ne0_4",        &std, at(&std, "t0.type"), KVR_TYPE_Q4_0, 4); // 4 % 32 != 0
    reject_patch("blck.q4_K_ne0_4",        &std, at(&std, "t0.type"), KVR_TYPE_Q4_K, 4); // 4 % 256 != 0
    reject_patch("blck.q8_0_ne0_8",        &std, at(&std, "t1.type"), KVR_TYPE_Q8_0, 4); // 8 % 32 != 0
    reject_patch("type.4_removed_q4_2",    &std, at(&std, "t0.type"), 4, 4);
    reject_patch("type.5_removed_q4_3",    &std, at(&std, "t0.type"), 5, 4);
    reject_patch("type.99",                &std, at(&std, "t0.type"), 99, 4);
    reject_patch("type.count",             &std, at(&std, "t0.type"), KVR_TYPE_COUNT, 4);
    reject_patch("type.ffffffff",          &std, at(&std, "t0.type"), 0xFFFFFFFFu, 4);

    //
    // the data section
    //

    reject_patch("offset.past_end",        &std, at(&std, "t1.offset"), 1ull << 40, 8);
    reject_patch("offset.max_aligned",     &std, at(&std, "t2.offset"), UINT64_MAX - 63, 8); // offset + size wraps
    reject_patch("offset.at_end",          &std, at(&std, "t2.offset"), std.n - std.data_offset, 8);
    reject_patch("offset.misaligned_65",   &std, at(&std, "t1.offset"), 65, 8);
    reject_patch("offset.misaligned_96",   &std, at(&std, "t1.offset"), 96, 8); // aligned to 32, not to general.alignment 64
    reject_patch("overlap.same_start",     &std, at(&std, "t1.offset"), 0, 8);  // t.b on t.a
    reject_patch("overlap.same_as_previous", &std, at(&std, "t2.offset"), 64, 8); // t.c on t.b
    reject_patch("overlap.first_covers_rest", &std, at(&std, "t0.ne"), 16, 8); // t.a [16,3]: 192 bytes over t.b, t.c
    reject_patch("extent.past_end",        &std, at(&std, "t2.ne") + 16, 16, 8); // t.c [2,2,16] from 128 to 256 > 192
    reject_patch("extent.past_end_first",  &std, at(&std, "t0.ne") + 8, 1000, 8);
    {
        // tensors stored out of order (t.b after t.c): no overlap, all inside; llama.cpp insists on
        // the writer's order and refuses
        struct var v = vdup(&std);
        set_le(&v, at(&std, "t1.offset"), 128, 8);
        set_le(&v, at(&std, "t2.offset"), 64, 8);
        run_case("either.tensors_out_of_order", v.p, v.n, EITHER, more_sane, NULL);
        free(v.p);
        // a hole before the last tensor: llama.cpp refuses (offset != expected)
        struct img im;
        build(&im, &(struct opts){ .std_kvs = true, .n_tensors = -1, .data_gap = 64 });
        run_case("either.data_gap", im.p, im.n, EITHER, more_sane, NULL);
        free(im.p);
    }

    // no buffer
    {
        case_begin("null_buffer");
        kvr_error(KVR_OK, "%s", "");
        struct kvr_gguf * g = kvr_gguf_open_mem(NULL, 0);
        CHECK(g == NULL, "accepted a NULL buffer");
        if (g) kvr_gguf_close(g);
        else CHECK(kvr_last_error()[0] != 0, "rejected without a message");
        case_end("null_buffer", kvr_last_error());
    }

    //
    // the mmap path
    //

    mmap_cases(&std);

    // more seeds for the fuzzer: the valid files under their own names
    to_corpus("valid.v2", v2.p, v2.n);
    to_corpus("valid.vocab_only", voc.p, voc.n);

    free(std.p); free(v2.p); free(voc.p); free(nokv.p); free(empty.p); free(al1.p);

    printf("%.0f ms\n", kvr_time_ms() - t0);
    return check_summary("gguf");
}
