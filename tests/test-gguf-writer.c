// test-gguf-writer.c - the GGUF writer against the GGUF reader: a round trip of every metadata
// type and of tensors of several types and shapes, byte for byte.
//
// Scalars other than u32/i32/f32/bool/string have no setter: they come from a GGUF assembled by
// hand in memory here (independently of the writer) and go through kvr_gguf_copy_kv, which also
// checks the prefix filter. Then: arrays of every element type, arrays of strings, a key set
// twice, tensors (f32, f16, bf16, q8_0, i8, i32; 1 to 4 dimensions), a reserved (NULL data)
// tensor, general.alignment other than 32, the copy of a real vocabulary's tokenizer.* keys, and
// the errors (unwritable path, bad tensors).

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char * shared_dir = "../shared"; // argv[1] when given (tests/run-tests.sh passes it)

// --- a GGUF assembled by hand (little-endian host) ---

struct buf { uint8_t * p; size_t n, cap; };

static void put(struct buf * b, const void * src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p   = realloc(b->p, b->cap);
        if (!b->p) { perror("realloc"); exit(1); }
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(struct buf * b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf * b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf * b, const char * s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void put_key(struct buf * b, const char * key, enum kvr_gguf_type t) { put_str(b, key); put_u32(b, (uint32_t) t); }

static const uint8_t  v_u8  = 0xfe;
static const int8_t   v_i8  = -100;
static const uint16_t v_u16 = 0xbeef;
static const int16_t  v_i16 = -30000;
static const uint32_t v_u32 = 0xdeadbeefu;
static const int32_t  v_i32 = -2000000000;
static const float    v_f32 = 3.25f;
static const uint8_t  v_bool = 1;
static const uint64_t v_u64 = 0x0123456789abcdefull;
static const int64_t  v_i64 = -0x123456789abcdefll;
static const double   v_f64 = -1.0 / 3.0;
static const char *   v_str = "a string\xe2\x96\x81with UTF-8";

static const int16_t  a_i16[5] = { -1, 2, -3, 4, 32767 };
static const char *   a_str[4] = { "", "one", "\xe2\x96\x81two", "three three" };

// 11 numeric scalars, a string, 2 arrays under "src."; 2 keys outside the prefix.
static struct buf make_source(void) {
    struct buf b = { 0 };
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, 0);  // tensors
    put_u64(&b, 16); // kv
    put_key(&b, "src.u8",   KVR_GGUF_UINT8);   put(&b, &v_u8, 1);
    put_key(&b, "other.x",  KVR_GGUF_UINT32);  put(&b, &v_u32, 4);
    put_key(&b, "src.i8",   KVR_GGUF_INT8);    put(&b, &v_i8, 1);
    put_key(&b, "src.u16",  KVR_GGUF_UINT16);  put(&b, &v_u16, 2);
    put_key(&b, "src.i16",  KVR_GGUF_INT16);   put(&b, &v_i16, 2);
    put_key(&b, "src.u32",  KVR_GGUF_UINT32);  put(&b, &v_u32, 4);
    put_key(&b, "src.i32",  KVR_GGUF_INT32);   put(&b, &v_i32, 4);
    put_key(&b, "src.f32",  KVR_GGUF_FLOAT32); put(&b, &v_f32, 4);
    put_key(&b, "src.bool", KVR_GGUF_BOOL);    put(&b, &v_bool, 1);
    put_key(&b, "src.str",  KVR_GGUF_STRING);  put_str(&b, v_str);
    put_key(&b, "src.u64",  KVR_GGUF_UINT64);  put(&b, &v_u64, 8);
    put_key(&b, "src.i64",  KVR_GGUF_INT64);   put(&b, &v_i64, 8);
    put_key(&b, "src.f64",  KVR_GGUF_FLOAT64); put(&b, &v_f64, 8);
    put_key(&b, "src.arr_i16", KVR_GGUF_ARRAY); put_u32(&b, KVR_GGUF_INT16); put_u64(&b, 5); put(&b, a_i16, sizeof(a_i16));
    put_key(&b, "src.arr_str", KVR_GGUF_ARRAY); put_u32(&b, KVR_GGUF_STRING); put_u64(&b, 4);
    for (int i = 0; i < 4; i++) put_str(&b, a_str[i]);
    put_key(&b, "sr", KVR_GGUF_STRING); put_str(&b, "shorter than the prefix");
    // data section: empty, aligned
    while (b.n % 32) put(&b, "", 1);
    return b;
}

// --- checks on what was read back ---

static const struct kvr_gguf_kv * expect_kv(const struct kvr_gguf * g, const char * key,
                                            enum kvr_gguf_type type, uint64_t n) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    CHECK(kv != NULL, "key %s missing", key);
    if (!kv) return NULL;
    CHECK(kv->type == type, "key %s: type %d, want %d", key, (int) kv->type, (int) type);
    CHECK(kv->n == n, "key %s: n %llu, want %llu", key, (unsigned long long) kv->n, (unsigned long long) n);
    if (kv->type != type || kv->n != n) return NULL;
    return kv;
}

static void expect_scalar(const struct kvr_gguf * g, const char * key, enum kvr_gguf_type type,
                          const void * v, size_t size) {
    const struct kvr_gguf_kv * kv = expect_kv(g, key, type, 1);
    if (kv) CHECK(kv->data && memcmp(kv->data, v, size) == 0, "key %s: value differs", key);
}

static bool str_eq(struct kvr_gguf_str s, const char * want, size_t want_len) {
    return s.len == want_len && (want_len == 0 || memcmp(s.s, want, want_len) == 0);
}

static void expect_str(const struct kvr_gguf * g, const char * key, const char * want) {
    const struct kvr_gguf_kv * kv = expect_kv(g, key, KVR_GGUF_STRING, 1);
    if (kv) CHECK(kv->strs && str_eq(kv->strs[0], want, strlen(want)), "key %s: string differs", key);
}

static void expect_arr(const struct kvr_gguf * g, const char * key, enum kvr_gguf_type elem,
                       const void * data, uint64_t n, size_t es) {
    const struct kvr_gguf_kv * kv = expect_kv(g, key, KVR_GGUF_ARRAY, n);
    if (!kv) return;
    CHECK(kv->arr_type == elem, "key %s: element type %d, want %d", key, (int) kv->arr_type, (int) elem);
    if (n > 0) CHECK(kv->data && memcmp(kv->data, data, n * es) == 0, "key %s: values differ", key);
}

static void expect_arr_str(const struct kvr_gguf * g, const char * key, const char * const * strs,
                           const uint64_t * lens, uint64_t n) {
    const struct kvr_gguf_kv * kv = expect_kv(g, key, KVR_GGUF_ARRAY, n);
    if (!kv) return;
    CHECK(kv->arr_type == KVR_GGUF_STRING, "key %s: element type %d", key, (int) kv->arr_type);
    int bad = 0;
    for (uint64_t i = 0; i < n && kv->strs; i++) {
        bad += !str_eq(kv->strs[i], strs[i], lens ? lens[i] : strlen(strs[i]));
    }
    CHECK(kv->strs && bad == 0, "key %s: %d strings differ", key, bad);
}

// --- tensors ---

struct tensor_case {
    const char *  name;
    enum kvr_type type;
    int           n_dims;
    int64_t       ne[4];
    uint8_t *     data; // filled by fill_case
    size_t        size;
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_case(struct tensor_case * c) {
    int64_t rows = 1;
    for (int i = 1; i < c->n_dims; i++) rows *= c->ne[i];
    c->size = kvr_row_size(c->type, c->ne[0]) * (size_t) rows;
    c->data = malloc(c->size ? c->size : 1);
    for (size_t i = 0; i < c->size; i++) c->data[i] = (uint8_t) rng();
}

static void expect_tensor(const struct kvr_gguf * g, const struct tensor_case * c) {
    const struct kvr_gguf_tensor * t = kvr_gguf_get_tensor(g, c->name);
    CHECK(t != NULL, "tensor %s missing", c->name);
    if (!t) return;
    CHECK(t->type == c->type, "tensor %s: type %d, want %d", c->name, (int) t->type, (int) c->type);
    CHECK(t->n_dims == c->n_dims, "tensor %s: n_dims %d, want %d", c->name, t->n_dims, c->n_dims);
    int bad_ne = 0;
    for (int i = 0; i < c->n_dims && i < KVR_MAX_DIMS; i++) bad_ne += t->ne[i] != c->ne[i];
    CHECK(bad_ne == 0, "tensor %s: shape differs", c->name);
    CHECK(t->size == c->size, "tensor %s: size %zu, want %zu", c->name, t->size, c->size);
    CHECK(t->offset % g->alignment == 0, "tensor %s: offset %llu not aligned to %zu", c->name,
          (unsigned long long) t->offset, g->alignment);
    CHECK(t->data == g->base + g->data_offset + t->offset, "tensor %s: data pointer", c->name);
    if (t->size == c->size && c->data) {
        CHECK(memcmp(t->data, c->data, c->size) == 0, "tensor %s: bytes differ", c->name);
    }
}

static long file_size(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

static char tmp_path[512];

static void make_tmp_path(void) {
    const char * dir = getenv("TMPDIR");
    snprintf(tmp_path, sizeof(tmp_path), "%s/kvr-test-gguf-writer-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(tmp_path);
    if (fd < 0) { perror("mkstemp"); exit(1); }
    close(fd);
}

// The main round trip.
static void test_round_trip(void) {
    struct buf src_buf = make_source();
    struct kvr_gguf * src = kvr_gguf_open_mem(src_buf.p, src_buf.n);
    CHECK(src != NULL, "hand-made source: %s", kvr_last_error());
    if (!src) { free(src_buf.p); return; }

    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    CHECK(w != NULL, "writer_new");
    if (!w) { kvr_gguf_close(src); free(src_buf.p); return; }

    kvr_gguf_set_str (w, "general.architecture", "llama");
    kvr_gguf_set_u32 (w, "set.u32", 7);             // set twice: the last value wins, one entry
    kvr_gguf_set_u32 (w, "set.u32", v_u32);
    kvr_gguf_set_i32 (w, "set.i32", v_i32);
    kvr_gguf_set_f32 (w, "set.f32", -0.0f);
    kvr_gguf_set_bool(w, "set.bool_t", true);
    kvr_gguf_set_bool(w, "set.bool_f", false);
    kvr_gguf_set_str (w, "set.str", v_str);
    kvr_gguf_set_str (w, "set.str_empty", "");
    kvr_gguf_set_str (w, "set.retyped", "was a string");
    kvr_gguf_set_f32 (w, "set.retyped", 1.5f);       // same key, another type

    // arrays of every numeric type
    const uint8_t  a_u8[3]  = { 0, 128, 255 };
    const int8_t   a_i8[3]  = { -128, 0, 127 };
    const uint16_t a_u16[2] = { 1, 65535 };
    const uint32_t a_u32[4] = { 0, 1, 0x80000000u, 0xffffffffu };
    const int32_t  a_i32[3] = { -1, 0, 2147483647 };
    const float    a_f32[3] = { 1.0f, -INFINITY, 1e-30f };
    const uint8_t  a_bool[4] = { 1, 0, 0, 1 };
    const uint64_t a_u64[2] = { 0xffffffffffffffffull, 42 };
    const int64_t  a_i64[2] = { -1, 0x7fffffffffffffffll };
    const double   a_f64[2] = { 3.141592653589793, -2.5e300 };
    kvr_gguf_set_arr(w, "arr.u8",   KVR_GGUF_UINT8,   a_u8, 3);
    kvr_gguf_set_arr(w, "arr.i8",   KVR_GGUF_INT8,    a_i8, 3);
    kvr_gguf_set_arr(w, "arr.u16",  KVR_GGUF_UINT16,  a_u16, 2);
    kvr_gguf_set_arr(w, "arr.i16",  KVR_GGUF_INT16,   a_i16, 5);
    kvr_gguf_set_arr(w, "arr.u32",  KVR_GGUF_UINT32,  a_u32, 4);
    kvr_gguf_set_arr(w, "arr.i32",  KVR_GGUF_INT32,   a_i32, 3);
    kvr_gguf_set_arr(w, "arr.f32",  KVR_GGUF_FLOAT32, a_f32, 3);
    kvr_gguf_set_arr(w, "arr.bool", KVR_GGUF_BOOL,    a_bool, 4);
    kvr_gguf_set_arr(w, "arr.u64",  KVR_GGUF_UINT64,  a_u64, 2);
    kvr_gguf_set_arr(w, "arr.i64",  KVR_GGUF_INT64,   a_i64, 2);
    kvr_gguf_set_arr(w, "arr.f64",  KVR_GGUF_FLOAT64, a_f64, 2);
    kvr_gguf_set_arr(w, "arr.empty", KVR_GGUF_INT32,  NULL, 0);

    // arrays of strings: zero-terminated, and with lengths (embedded NUL)
    kvr_gguf_set_arr_str(w, "arr.str", a_str, NULL, 4);
    const char *   b_str[2] = { "nul\0inside", "xyz" };
    const uint64_t b_len[2] = { 10, 2 };
    kvr_gguf_set_arr_str(w, "arr.str_len", b_str, b_len, 2);
    kvr_gguf_set_arr_str(w, "arr.str_empty", NULL, NULL, 0);

    kvr_gguf_copy_kv(w, src, "src.");

    struct tensor_case cases[] = {
        { "t.f32",       KVR_TYPE_F32,  2, { 7, 3, 1, 1 },   NULL, 0 },
        { "t.f16.3d",    KVR_TYPE_F16,  3, { 64, 2, 3, 1 },  NULL, 0 },
        { "t.bf16",      KVR_TYPE_BF16, 1, { 16, 1, 1, 1 },  NULL, 0 },
        { "t.q8_0",      KVR_TYPE_Q8_0, 2, { 64, 3, 1, 1 },  NULL, 0 },
        { "t.i8.4d",     KVR_TYPE_I8,   4, { 3, 2, 2, 2 },   NULL, 0 },
        { "t.i32",       KVR_TYPE_I32,  1, { 5, 1, 1, 1 },   NULL, 0 },
        { "blk.0.ffn_up.weight", KVR_TYPE_F32, 2, { 32, 1, 1, 1 }, NULL, 0 },
    };
    const int n_cases = (int) (sizeof(cases) / sizeof(cases[0]));
    for (int i = 0; i < n_cases; i++) {
        fill_case(&cases[i]);
        kvr_gguf_add_tensor(w, cases[i].name, cases[i].type, cases[i].n_dims, cases[i].ne, cases[i].data);
    }
    // reserved: reads back as zeros, in the middle and at the end
    const int64_t ne_hole[2] = { 40, 5 };
    kvr_gguf_add_tensor(w, "t.hole", KVR_TYPE_F32, 2, ne_hole, NULL);
    const int64_t ne_small[1] = { 3 };
    const float small[3] = { 1, 2, 3 };
    kvr_gguf_add_tensor(w, "t.after_hole", KVR_TYPE_F32, 1, ne_small, small);
    const int64_t ne_tail[1] = { 1000 };
    kvr_gguf_add_tensor(w, "t.tail_hole", KVR_TYPE_F16, 1, ne_tail, NULL);

    int rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_OK, "save: %s", kvr_last_error());
    kvr_gguf_writer_free(w);

    struct kvr_gguf * g = rc == KVR_OK ? kvr_gguf_open(tmp_path) : NULL;
    CHECK(g != NULL, "reopen: %s", kvr_last_error());
    if (g) {
        CHECK(g->version == 3, "version %u", g->version);
        CHECK(g->alignment == 32, "alignment %zu", g->alignment);
        CHECK(kvr_gguf_find_key(g, "general.alignment") < 0, "general.alignment written though 32");
        CHECK(g->data_offset % 32 == 0, "data offset %zu", g->data_offset);
        // 9 set (one of them twice, one retyped) + 12 numeric arrays + 3 string arrays + 14 copied
        CHECK(g->n_kv == 9 + 12 + 3 + 14, "n_kv %llu", (unsigned long long) g->n_kv);
        CHECK(g->n_tensors == (uint64_t) n_cases + 3, "n_tensors %llu", (unsigned long long) g->n_tensors);
        CHECK(g->kv && str_eq(g->kv[0].key, "general.architecture", 20), "keys keep the order they were set in");

        expect_str(g, "general.architecture", "llama");
        expect_scalar(g, "set.u32", KVR_GGUF_UINT32, &v_u32, 4);
        expect_scalar(g, "set.i32", KVR_GGUF_INT32, &v_i32, 4);
        const float negz = -0.0f;
        expect_scalar(g, "set.f32", KVR_GGUF_FLOAT32, &negz, 4);
        const uint8_t t1 = 1, f0 = 0;
        expect_scalar(g, "set.bool_t", KVR_GGUF_BOOL, &t1, 1);
        expect_scalar(g, "set.bool_f", KVR_GGUF_BOOL, &f0, 1);
        expect_str(g, "set.str", v_str);
        expect_str(g, "set.str_empty", "");
        const float retyped = 1.5f;
        expect_scalar(g, "set.retyped", KVR_GGUF_FLOAT32, &retyped, 4);

        uint32_t u; float fl; bool bo; char s[64];
        CHECK(kvr_gguf_get_u32(g, "set.u32", &u) == KVR_OK && u == v_u32, "get_u32");
        CHECK(kvr_gguf_get_f32(g, "set.retyped", &fl) == KVR_OK && fl == 1.5f, "get_f32");
        CHECK(kvr_gguf_get_bool(g, "set.bool_t", &bo) == KVR_OK && bo, "get_bool");
        CHECK(kvr_gguf_get_str(g, "set.str", s, sizeof(s)) == KVR_OK && strcmp(s, v_str) == 0, "get_str");

        expect_arr(g, "arr.u8",   KVR_GGUF_UINT8,   a_u8, 3, 1);
        expect_arr(g, "arr.i8",   KVR_GGUF_INT8,    a_i8, 3, 1);
        expect_arr(g, "arr.u16",  KVR_GGUF_UINT16,  a_u16, 2, 2);
        expect_arr(g, "arr.i16",  KVR_GGUF_INT16,   a_i16, 5, 2);
        expect_arr(g, "arr.u32",  KVR_GGUF_UINT32,  a_u32, 4, 4);
        expect_arr(g, "arr.i32",  KVR_GGUF_INT32,   a_i32, 3, 4);
        expect_arr(g, "arr.f32",  KVR_GGUF_FLOAT32, a_f32, 3, 4);
        expect_arr(g, "arr.bool", KVR_GGUF_BOOL,    a_bool, 4, 1);
        expect_arr(g, "arr.u64",  KVR_GGUF_UINT64,  a_u64, 2, 8);
        expect_arr(g, "arr.i64",  KVR_GGUF_INT64,   a_i64, 2, 8);
        expect_arr(g, "arr.f64",  KVR_GGUF_FLOAT64, a_f64, 2, 8);
        expect_arr(g, "arr.empty", KVR_GGUF_INT32,  NULL, 0, 4);
        expect_arr_str(g, "arr.str", a_str, NULL, 4);
        expect_arr_str(g, "arr.str_len", b_str, b_len, 2);
        expect_arr_str(g, "arr.str_empty", NULL, NULL, 0);

        // copied, with their own types
        expect_scalar(g, "src.u8",   KVR_GGUF_UINT8,   &v_u8, 1);
        expect_scalar(g, "src.i8",   KVR_GGUF_INT8,    &v_i8, 1);
        expect_scalar(g, "src.u16",  KVR_GGUF_UINT16,  &v_u16, 2);
        expect_scalar(g, "src.i16",  KVR_GGUF_INT16,   &v_i16, 2);
        expect_scalar(g, "src.u32",  KVR_GGUF_UINT32,  &v_u32, 4);
        expect_scalar(g, "src.i32",  KVR_GGUF_INT32,   &v_i32, 4);
        expect_scalar(g, "src.f32",  KVR_GGUF_FLOAT32, &v_f32, 4);
        expect_scalar(g, "src.bool", KVR_GGUF_BOOL,    &v_bool, 1);
        expect_scalar(g, "src.u64",  KVR_GGUF_UINT64,  &v_u64, 8);
        expect_scalar(g, "src.i64",  KVR_GGUF_INT64,   &v_i64, 8);
        expect_scalar(g, "src.f64",  KVR_GGUF_FLOAT64, &v_f64, 8);
        expect_str(g, "src.str", v_str);
        expect_arr(g, "src.arr_i16", KVR_GGUF_INT16, a_i16, 5, 2);
        expect_arr_str(g, "src.arr_str", a_str, NULL, 4);
        CHECK(kvr_gguf_find_key(g, "other.x") < 0, "copy_kv copied a key outside the prefix");
        CHECK(kvr_gguf_find_key(g, "sr") < 0, "copy_kv copied a key shorter than the prefix");

        for (int i = 0; i < n_cases; i++) expect_tensor(g, &cases[i]);
        struct tensor_case hole = { "t.hole", KVR_TYPE_F32, 2, { 40, 5, 1, 1 }, NULL, 800 };
        hole.data = calloc(1, hole.size);
        expect_tensor(g, &hole);
        free(hole.data);
        struct tensor_case after = { "t.after_hole", KVR_TYPE_F32, 1, { 3, 1, 1, 1 }, (uint8_t *) small, 12 };
        expect_tensor(g, &after);
        struct tensor_case tail = { "t.tail_hole", KVR_TYPE_F16, 1, { 1000, 1, 1, 1 }, NULL, 2000 };
        tail.data = calloc(1, tail.size);
        expect_tensor(g, &tail);
        free(tail.data);
        // every tensor padded, the last one too
        const struct kvr_gguf_tensor * last = kvr_gguf_get_tensor(g, "t.tail_hole");
        if (last) {
            const long want = (long) (g->data_offset + last->offset + (last->size + 31) / 32 * 32);
            CHECK(file_size(tmp_path) == want, "file size %ld, want %ld", file_size(tmp_path), want);
        }
        // tensor order is the order added
        CHECK(g->tensors && strcmp(g->tensors[0].name, "t.f32") == 0 &&
              strcmp(g->tensors[g->n_tensors - 1].name, "t.tail_hole") == 0, "tensor order");
        kvr_gguf_close(g);
    }
    for (int i = 0; i < n_cases; i++) free(cases[i].data);
    kvr_gguf_close(src);
    free(src_buf.p);
}

// general.alignment other than 32: honoured by the data layout and by the reader.
static void test_alignment(void) {
    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    kvr_gguf_set_u32(w, "general.alignment", 64);
    float a[5] = { 1, 2, 3, 4, 5 }, b[3] = { 6, 7, 8 };
    const int64_t na[1] = { 5 }, nb[1] = { 3 };
    kvr_gguf_add_tensor(w, "a", KVR_TYPE_F32, 1, na, a);
    kvr_gguf_add_tensor(w, "b", KVR_TYPE_F32, 1, nb, b);
    int rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_OK, "save (alignment 64): %s", kvr_last_error());
    kvr_gguf_writer_free(w);
    struct kvr_gguf * g = rc == KVR_OK ? kvr_gguf_open(tmp_path) : NULL;
    CHECK(g != NULL, "reopen (alignment 64): %s", kvr_last_error());
    if (!g) return;
    CHECK(g->alignment == 64, "alignment %zu", g->alignment);
    CHECK(g->data_offset % 64 == 0, "data offset %zu", g->data_offset);
    const struct kvr_gguf_tensor * tb = kvr_gguf_get_tensor(g, "b");
    CHECK(tb && tb->offset == 64, "offset of b %llu", tb ? (unsigned long long) tb->offset : 0ull);
    CHECK(tb && memcmp(tb->data, b, sizeof(b)) == 0, "data of b");
    kvr_gguf_close(g);
}

// Every tokenizer.* key of a real vocabulary survives kvr_gguf_copy_kv unchanged.
static void test_copy_vocab(void) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/vocab/ggml-vocab-llama-spm.gguf", shared_dir);
    FILE * f = fopen(path, "rb");
    if (!f) {
        skip("%s not found (the copy of a real vocabulary)", path);
        return;
    }
    fclose(f);
    struct kvr_gguf * src = kvr_gguf_open(path);
    CHECK(src != NULL, "open %s: %s", path, kvr_last_error());
    if (!src) return;
    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    kvr_gguf_copy_kv(w, src, "tokenizer.");
    int rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_OK, "save (vocab copy): %s", kvr_last_error());
    kvr_gguf_writer_free(w);
    struct kvr_gguf * g = rc == KVR_OK ? kvr_gguf_open(tmp_path) : NULL;
    CHECK(g != NULL, "reopen (vocab copy): %s", kvr_last_error());
    if (g) {
        uint64_t n_tok = 0;
        int bad = 0;
        for (uint64_t i = 0; i < src->n_kv; i++) {
            const struct kvr_gguf_kv * a = &src->kv[i];
            if (a->key.len < 10 || memcmp(a->key.s, "tokenizer.", 10) != 0) continue;
            n_tok++;
            char key[256];
            snprintf(key, sizeof(key), "%.*s", (int) a->key.len, a->key.s);
            const struct kvr_gguf_kv * b = kvr_gguf_get_kv(g, key);
            if (!b || b->type != a->type || b->n != a->n || (a->type == KVR_GGUF_ARRAY && b->arr_type != a->arr_type)) {
                bad++;
                continue;
            }
            enum kvr_gguf_type et = a->type == KVR_GGUF_ARRAY ? a->arr_type : a->type;
            if (et == KVR_GGUF_STRING) {
                for (uint64_t j = 0; j < a->n; j++) {
                    if (!str_eq(b->strs[j], a->strs[j].s, a->strs[j].len)) { bad++; break; }
                }
            } else {
                size_t es = et == KVR_GGUF_UINT8 || et == KVR_GGUF_INT8 || et == KVR_GGUF_BOOL ? 1 :
                            et == KVR_GGUF_UINT16 || et == KVR_GGUF_INT16 ? 2 :
                            et == KVR_GGUF_UINT64 || et == KVR_GGUF_INT64 || et == KVR_GGUF_FLOAT64 ? 8 : 4;
                if (memcmp(a->data, b->data, a->n * es) != 0) bad++;
            }
        }
        CHECK(n_tok >= 5, "the vocabulary has %llu tokenizer keys", (unsigned long long) n_tok);
        CHECK(g->n_kv == n_tok, "copied %llu keys, want %llu", (unsigned long long) g->n_kv, (unsigned long long) n_tok);
        CHECK(bad == 0, "%d copied keys differ", bad);
        struct kvr_vocab * v = kvr_vocab_load(g);
        CHECK(v != NULL, "vocab from the copy: %s", kvr_last_error());
        if (v) kvr_vocab_free(v);
        kvr_gguf_close(g);
    }
    kvr_gguf_close(src);
}

// Mistakes and I/O failures come back from save as error codes with a message.
static void test_errors(void) {
    const float x[32] = { 0 };
    const int64_t ne[2] = { 32, 1 };

    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    kvr_gguf_add_tensor(w, "x", KVR_TYPE_F32, 2, ne, x);
    const char * bad_path = "no-such-dir-kvr/sub/out.gguf";
    int rc = kvr_gguf_writer_save(w, bad_path);
    CHECK(rc == KVR_ERR_IO, "unwritable path: rc %d", rc);
    CHECK(strstr(kvr_last_error(), bad_path) != NULL, "message names the path: %s", kvr_last_error());
    kvr_gguf_writer_free(w);

    w = kvr_gguf_writer_new();
    kvr_gguf_add_tensor(w, "x", KVR_TYPE_F32, 2, ne, x);
    kvr_gguf_add_tensor(w, "x", KVR_TYPE_F32, 2, ne, x);
    rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_ERR_ARG, "duplicate tensor: rc %d", rc);
    CHECK(strstr(kvr_last_error(), "duplicate") != NULL, "message: %s", kvr_last_error());
    kvr_gguf_writer_free(w);

    w = kvr_gguf_writer_new();
    const int64_t ne_odd[1] = { 33 };
    kvr_gguf_add_tensor(w, "odd", KVR_TYPE_Q8_0, 1, ne_odd, x);
    rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_ERR_ARG, "row not a whole number of blocks: rc %d", rc);
    CHECK(strstr(kvr_last_error(), "odd") != NULL, "message names the tensor: %s", kvr_last_error());
    kvr_gguf_writer_free(w);

    w = kvr_gguf_writer_new();
    const int64_t ne_wrap[1] = { (int64_t) 1 << 62 };  // 4 * 2^62 bytes wrap to 0
    kvr_gguf_add_tensor(w, "huge", KVR_TYPE_F32, 1, ne_wrap, NULL);
    rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "too large") && strstr(kvr_last_error(), "huge"),
          "a tensor whose byte size wraps: rc %d %s", rc, kvr_last_error());
    kvr_gguf_writer_free(w);

    w = kvr_gguf_writer_new();
    kvr_gguf_add_tensor(w, "x", (enum kvr_type) 5, 2, ne, x);   // 4 and 5 are gone from GGUF
    CHECK(kvr_gguf_writer_save(w, tmp_path) == KVR_ERR_ARG, "unknown type");
    kvr_gguf_writer_free(w);

    w = kvr_gguf_writer_new();
    char long_name[KVR_MAX_NAME + 8];
    memset(long_name, 'n', sizeof(long_name) - 1);
    long_name[sizeof(long_name) - 1] = '\0';
    kvr_gguf_add_tensor(w, long_name, KVR_TYPE_F32, 2, ne, x);
    CHECK(kvr_gguf_writer_save(w, tmp_path) == KVR_ERR_ARG, "name too long");
    kvr_gguf_writer_free(w);

    // an empty writer is a valid file
    w = kvr_gguf_writer_new();
    rc = kvr_gguf_writer_save(w, tmp_path);
    CHECK(rc == KVR_OK, "empty: %s", kvr_last_error());
    kvr_gguf_writer_free(w);
    struct kvr_gguf * g = rc == KVR_OK ? kvr_gguf_open(tmp_path) : NULL;
    CHECK(g && g->n_kv == 0 && g->n_tensors == 0, "empty file reads back: %s", kvr_last_error());
    if (g) kvr_gguf_close(g);
    kvr_gguf_writer_free(NULL);
}

int main(int argc, char ** argv) {
    if (argc > 1) shared_dir = argv[1];
    make_tmp_path();
    test_round_trip();
    test_alignment();
    test_copy_vocab();
    test_errors();
    remove(tmp_path);
    return check_summary("gguf-writer");
}
