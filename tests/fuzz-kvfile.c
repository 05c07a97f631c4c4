// tests/fuzz-kvfile.c - the libFuzzer target for the readers of kvr's own files: KV cache files
// (kvr_kv_file_read) and replication logs (kvr_kv_log_read), both checked against stories260K. The
// input's first byte picks the reader (bit 0: 0 cache, 1 log) and whether the harness mends the
// file's CRC32Cs before reading it (bit 1): with them mended, a mutation of a count, an offset or a
// record type reaches the checks behind the CRCs instead of stopping at the first one. A rejection
// must leave a message naming the file; an accepted file must hold together: every token in the
// vocabulary, every position inside the cache (or the prompt's range), and every row readable to
// its last byte (so the sanitizers see any lie about a size).
//
//   make build/fuzz-kvfile && KVR_FUZZ_MODEL=../shared/models/stories260K.gguf KVR_FUZZ_KV_SEEDS=DIR \
//       build/fuzz-kvfile -max_total_time=60 -timeout=10 DIR
//
// KVR_FUZZ_KV_SEEDS=DIR writes the seeds into DIR first: caches and logs written by the library
// (a whole cache with and without logits, ring shards, a log of two steps and the same log with its
// last step not committed), raw and to be mended.

#define _POSIX_C_SOURCE 200809L
#define KVR_BUILD // kvr.h's internal part: the replication log's reader and writer
#include "kvr.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FUZZ_CHECK(x) do { if (!(x)) { fprintf(stderr, "fuzz-kvfile: invariant failed: %s (line %d)\n", #x, __LINE__); abort(); } } while (0)

static struct kvr_model * model;
static char               path[512];  // where each input is written for the readers
static volatile uint64_t  sink;

static void touch(const void * p, size_t n) {
    const uint8_t * q = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++) s += q[i];
    sink += s;
}

static uint32_t rd32(const uint8_t * p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static void wr32(uint8_t * p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }

// The CRC32C of b[at, end) written at end, when it fits; returns the CRC (for chained logs).
static uint32_t mend(uint8_t * b, size_t n, size_t at, size_t end, uint32_t seed) {
    if (end < at || end + 4 > n) return seed;
    const uint32_t c = kvr_crc32c(seed, b + at, end - at);
    wr32(b + end, c);
    return c;
}

// Mend a cache file's CRCs, walking it as the writer laid it out (kvr.h, "KV cache files"), with
// the counts the (mutated) header and shard table give, as far as the bytes go.
static void mend_cache(uint8_t * b, size_t n) {
    if (n < KVR_KV_FILE_HEADER) return;
    mend(b, n, 0, 92, 0);
    const uint64_t kv_dim = (uint64_t)model->hp.head_dim * model->hp.n_head_kv;
    const uint64_t n_tok = rd32(b + 64), n_shards = rd32(b + 72), chunk = rd32(b + 76);
    uint64_t off = KVR_KV_FILE_HEADER;
    if (n_tok > n || off + 4 * n_tok + 4 > n) return;
    mend(b, n, off, off + 4 * n_tok, 0);
    off += 4 * n_tok + 4;
    const uint64_t tab = off;
    if (n_shards > 256 || off + 8 * n_shards > n) return;
    uint64_t rows[256], all = 0;
    for (uint64_t s = 0; s < n_shards; s++) all += rows[s] = rd32(b + tab + 8 * s + 4) <= n ? rd32(b + tab + 8 * s + 4) : n;
    off += 8 * n_shards + 4 * all;
    if (off + 4 > n) return;
    mend(b, n, tab, off, 0);
    off += 4;
    for (uint32_t il = 0; il < model->hp.n_layer && chunk; il++) {
        for (uint64_t s = 0; s < n_shards; s++) {
            for (int kind = 0; kind < 2; kind++) {
                for (uint64_t r0 = 0; r0 < rows[s]; r0 += chunk) {
                    const uint64_t c = rows[s] - r0 < chunk ? rows[s] - r0 : chunk, nb = 20 + 4 * c * kv_dim;
                    if (off + nb + 4 > n) return;
                    mend(b, n, off, off + nb, 0);
                    off += nb + 4;
                }
            }
        }
    }
    if ((rd32(b + 12) & KVR_KV_FILE_LOGITS) && off + 4 * (uint64_t)model->hp.n_vocab + 4 <= n) {
        mend(b, n, off, off + 4 * (uint64_t)model->hp.n_vocab, 0);
    }
}

// Mend a log's header, prompt and record chain (kvr.h, "Replication logs").
static void mend_log(uint8_t * b, size_t n) {
    if (n < KVR_KV_LOG_HEADER) return;
    mend(b, n, 0, 92, 0);
    // the rows' sizes by the type field (a damaged one is refused before the records are read)
    const uint32_t types = rd32(b + 32), tk = types & 0xffff, tv = types >> 16;
    for (int i = 0; i < 2; i++) {
        const uint32_t t = i ? tv : tk;
        if (t != KVR_TYPE_F32 && t != KVR_TYPE_F16 && t != KVR_TYPE_BF16 && t != KVR_TYPE_Q8_0) return;
        if (model->hp.head_dim % kvr_blck_size((enum kvr_type)t) != 0) return;
    }
    const uint64_t kv_dim = (uint64_t)model->hp.head_dim * model->hp.n_head_kv;
    const uint64_t n_prompt = rd32(b + 76), row2 = kvr_row_size((enum kvr_type)tk, (int64_t)kv_dim) + kvr_row_size((enum kvr_type)tv, (int64_t)kv_dim);
    uint64_t off = KVR_KV_LOG_HEADER + 4 * n_prompt;
    if (n_prompt > n || off + 4 > n) return;
    uint32_t crc = mend(b, n, KVR_KV_LOG_HEADER, off, 0);
    off += 4;
    while (off + 16 <= n) {
        const uint32_t type = rd32(b + off), a = rd32(b + off + 8), c = rd32(b + off + 12);
        const uint64_t need = type == KVR_KV_LOG_ROWS ? 16 + row2 * c + 4 : 16 + 4 * ((uint64_t)a + c) + 4;
        if (need > n || off + need > n) return;
        crc = mend(b, n, off, off + need - 4, crc);
        off += need;
    }
}

static void check_cache(const struct kvr_kv_file * f) {
    FUZZ_CHECK(f->n_tokens >= 0 && f->n_shards >= 1 && f->n_ranks >= f->n_shards);
    FUZZ_CHECK(f->n_layer == (int)model->hp.n_layer);
    for (int i = 0; i < f->n_tokens; i++) FUZZ_CHECK(f->tokens[i] >= 0 && (uint32_t)f->tokens[i] < model->hp.n_vocab);
    for (int s = 0; s < f->n_shards; s++) {
        const struct kvr_kv_file_shard * sh = &f->shards[s];
        FUZZ_CHECK(sh->n_rows >= 0 && sh->n_rows <= f->n_tokens);
        for (int i = 0; i < sh->n_rows; i++) FUZZ_CHECK(sh->pos[i] >= 0 && sh->pos[i] < f->n_tokens);
        for (int il = 0; il < f->n_layer; il++) {
            FUZZ_CHECK(!sh->k[il] == kvr_layer_recurrent(&model->hp, il) && !sh->v[il] == !sh->k[il]); // a recurrent layer has no rows
            if (!sh->k[il]) continue;
            touch(sh->k[il], sizeof(float) * (size_t)f->kv_dim * sh->n_rows);
            touch(sh->v[il], sizeof(float) * (size_t)f->kv_dim * sh->n_rows);
        }
    }
    if (f->logits) touch(f->logits, sizeof(float) * model->hp.n_vocab);
}

static void check_log(const struct kvr_kv_log_data * d) {
    FUZZ_CHECK(d->n_ranks >= 1 && d->rank >= 0 && d->rank < d->n_ranks);
    FUZZ_CHECK(d->n_prompt >= 0 && d->good <= d->bytes);
    for (int i = 0; i < d->n_prompt; i++) FUZZ_CHECK(d->prompt[i] >= 0 && (uint32_t)d->prompt[i] < model->hp.n_vocab);
    for (int st = 0; st < d->n_steps; st++) {
        const struct kvr_kv_log_step * s = &d->steps[st];
        FUZZ_CHECK(s->step == st && s->end <= d->good);
        for (int i = 0; i < s->n_tokens; i++) FUZZ_CHECK(s->tokens[i] >= 0 && (uint32_t)s->tokens[i] < model->hp.n_vocab);
        touch(s->pos, sizeof(int32_t) * (size_t)s->n_rows);
        for (int il = 0; s->n_rows && il < d->n_layer; il++) {
            touch(s->k[il], d->row_k * (size_t)s->n_rows);
            touch(s->v[il], d->row_v * (size_t)s->n_rows);
        }
    }
    FUZZ_CHECK(memchr(d->damage, 0, sizeof(d->damage)) != NULL);
}

static void write_file(const char * p, const void * b, size_t n) {
    FILE * f = fopen(p, "wb");
    FUZZ_CHECK(f != NULL);
    FUZZ_CHECK(n == 0 || fwrite(b, 1, n, f) == n);
    FUZZ_CHECK(fclose(f) == 0);
}

// a seed: the mode byte, then the file at src without its last cut bytes
static void seed(const char * dir, const char * name, int mode, const char * src, long cut) {
    FILE * f = fopen(src, "rb");
    FUZZ_CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t * b = malloc((size_t)n + 1);
    b[0] = (uint8_t)mode;
    FUZZ_CHECK(fread(b + 1, 1, (size_t)n, f) == (size_t)n && cut <= n);
    fclose(f);
    char p[1024];
    snprintf(p, sizeof(p), "%s/%s-%d", dir, name, mode);
    write_file(p, b, (size_t)(n - cut) + 1);
    free(b);
}

static void write_seeds(const char * dir) {
    static const int32_t prompt[] = { 1, 403, 407, 261, 378, 6, 8, 391 };
    char p[1024];
    snprintf(p, sizeof(p), "%s.seed", path);
    // a whole cache, with and without logits
    struct kvr_session * s = kvr_session_new(model, &(struct kvr_session_params) { .n_ctx = 16, .n_threads = 1 });
    FUZZ_CHECK(s != NULL && kvr_session_eval(s, prompt, 5) != NULL);
    for (int lg = 0; lg < 2; lg++) {
        if (lg) kvr_session_truncate(s, 4); // forgets the logits
        FUZZ_CHECK(kvr_session_kv_save(s, p, false) == KVR_OK);
        seed(dir, lg ? "cache-nologits" : "cache", 0, p, 0);
        seed(dir, lg ? "cache-nologits" : "cache", 2, p, 0);
    }
    kvr_session_free(s);
    // the shards of a ring over 3 ranks, gathered
    s = kvr_session_new(model, &(struct kvr_session_params) { .n_ctx = 16, .n_threads = 1, .n_ranks = 3, .strategy = KVR_STRATEGY_RING_KV });
    FUZZ_CHECK(s != NULL && kvr_session_eval(s, prompt, 7) != NULL);
    FUZZ_CHECK(kvr_session_kv_save(s, p, false) == KVR_OK);
    seed(dir, "cache-ring", 0, p, 0);
    seed(dir, "cache-ring", 2, p, 0);
    kvr_session_free(s);
    // a log of two steps: the prompt's rows, then one decoded token's
    const int kv_dim = (int)(model->hp.head_dim * model->hp.n_head_kv);
    float * k = calloc((size_t)kv_dim * 3, sizeof(float)), * v = calloc((size_t)kv_dim * 3, sizeof(float));
    for (int i = 0; i < kv_dim * 3; i++) { k[i] = (float)i; v[i] = -(float)i; }
    struct kvr_kv_log * w;
    const struct kvr_kv_log_head h = { .rank = 0, .n_ranks = 1, .strategy = KVR_STRATEGY_SINGLE, .n_prompt = 3, .prompt = prompt };
    FUZZ_CHECK(kvr_kv_log_create(&w, p, model, &h) == KVR_OK);
    const int32_t pos[3] = { 0, 1, 2 };
    for (int il = 0; il < (int)model->hp.n_layer; il++) FUZZ_CHECK(kvr_kv_log_rows(w, 0, il, 3, k, v) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_commit(w, 0, prompt, 3, pos, 3) == KVR_OK);
    const int32_t pos1 = 3;
    for (int il = 0; il < (int)model->hp.n_layer; il++) FUZZ_CHECK(kvr_kv_log_rows(w, 1, il, 1, k, v) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_commit(w, 1, prompt + 3, 1, &pos1, 1) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_close(w) == KVR_OK);
    seed(dir, "log", 1, p, 0);
    // the same steps with f16 K and q8_0 V rows (the bytes of the f32 values: any bits are rows)
    const struct kvr_kv_log_head h16 = { .rank = 0, .n_ranks = 1, .strategy = KVR_STRATEGY_SINGLE, .n_prompt = 3, .prompt = prompt,
                                         .type_k = KVR_TYPE_F16, .type_v = model->hp.head_dim % 32 ? KVR_TYPE_BF16 : KVR_TYPE_Q8_0 };
    FUZZ_CHECK(kvr_kv_log_create(&w, p, model, &h16) == KVR_OK);
    for (int il = 0; il < (int)model->hp.n_layer; il++) FUZZ_CHECK(kvr_kv_log_rows(w, 0, il, 3, k, v) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_commit(w, 0, prompt, 3, pos, 3) == KVR_OK);
    for (int il = 0; il < (int)model->hp.n_layer; il++) FUZZ_CHECK(kvr_kv_log_rows(w, 1, il, 1, k, v) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_commit(w, 1, prompt + 3, 1, &pos1, 1) == KVR_OK);
    FUZZ_CHECK(kvr_kv_log_close(w) == KVR_OK);
    seed(dir, "log-typed", 1, p, 0);
    seed(dir, "log", 3, p, 0);
    // and cut before its last commit: a step with every layer's rows and no commit, one record short
    // of the checks on a layer past the last
    seed(dir, "log-open", 1, p, 16 + 4 * 2 + 4);
    seed(dir, "log-open", 3, p, 16 + 4 * 2 + 4);
    free(k);
    free(v);
    unlink(p);
}

static void remove_files(void) {
    char p[600];
    snprintf(p, sizeof(p), "%s.seed", path);
    unlink(p);
    unlink(path);
}

int LLVMFuzzerInitialize(int * argc, char *** argv);
int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void)argc; (void)argv;
    const char * mp = getenv("KVR_FUZZ_MODEL");
    model = kvr_model_load(mp && *mp ? mp : "../shared/models/stories260K.gguf", NULL);
    if (!model) {
        fprintf(stderr, "fuzz-kvfile: %s (set KVR_FUZZ_MODEL)\n", kvr_last_error());
        abort();
    }
    const char * t = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/kvr-fuzz-kvfile-%d.bin", t && *t ? t : "/tmp", (int)getpid());
    atexit(remove_files);
    const char * seeds = getenv("KVR_FUZZ_KV_SEEDS");
    if (seeds && *seeds) write_seeds(seeds);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 1 || size > (4u << 20)) return 0;
    const int mode = data[0];
    uint8_t * b = malloc(size);
    memcpy(b, data + 1, size - 1);
    const size_t n = size - 1;
    if (mode & 2) (mode & 1 ? mend_log : mend_cache)(b, n);
    write_file(path, b, n);
    free(b);
    if (mode & 1) {
        struct kvr_kv_log_data * d = NULL;
        const int rc = kvr_kv_log_read(path, model, &d);
        if (rc != KVR_OK) {
            FUZZ_CHECK(d == NULL && strstr(kvr_last_error(), path) != NULL);
        } else {
            check_log(d);
            kvr_kv_log_free(d);
        }
    } else {
        struct kvr_kv_file * f = NULL;
        const int rc = kvr_kv_file_read(path, model, &f);
        if (rc != KVR_OK) {
            FUZZ_CHECK(f == NULL && strstr(kvr_last_error(), path) != NULL);
        } else {
            check_cache(f);
            kvr_kv_file_free(f);
        }
    }
    return 0;
}
