// tests/test-kvcache.c - KV cache files, save/restore, swap and streaming (kvr.h "KV cache files",
// kvr_session_kv_*), on stories260K from the shared directory:
//
//   crc        CRC32C against the standard check values
//   session    a session saved after a prompt and 8 decoded tokens, loaded into a new session,
//              continues with the same logits, bit for bit, and the same ids as the one that never
//              stopped; saving twice gives the same bytes; truncation forgets the logits
//   swap       swapped out to host memory and to a file, then back: the same continuation; evals
//              fail while the cache is out; the swap file is gone once back
//   shards     a cache written as three ring shards gathered into one file loads into a session
//              as the whole cache; one rank's shard alone is refused by a session
//   other type a file of another cache type than the session's: loaded converted (F32 into F16 and
//              BF16, F16 into F32), the rows the file's in the session's type; F16 files' rows are
//              half the bytes
//   malformed  every way a file can be wrong (truncations, bit flips, patched fields with their
//              CRC mended, another model, a newer version, ...): each refused with KVR_ERR_*,
//              a message naming what and where, and the session left exactly as it was
//   weights    copies of the model file with one weight byte changed, or one tokenizer score:
//              a cache (and a --session file) of the original is refused by each, naming the
//              weights or the tokenizer hash; an unchanged copy loads it
//   session       restore-and-continue through kvr_session for single, tsp, kvr, ring-kv and ring-q on
//              1..4 ranks: the logits of every continued step equal, bit for bit, those of the
//              session that never stopped; a gathered file loads across rank counts
//   stream     kv_stream during the first prefill, every strategy on 1..4 ranks: the file written
//              while the prefill ran equals kvr_session_kv_save's after it, byte for byte; the bytes
//              streamed are the cache's
//   P/D        prefill on N-1 ranks, decode on the last (every strategy, N = 2..4): the decode rank
//              receives the whole cache, computes no prompt token, and continues as one rank does
//              (same ids, logits within 1e-4; chain strategies: bit for bit as without P/D)
//   hybrid     tiny-qwen35 (SHARED/reference/archs-next; Gated DeltaNet layers keep a state): saved
//              after a prompt and 3 decoded tokens by single, tsp, kvr, ring-kv and ring-q on 1..3
//              ranks (ring: gathered and a file per rank), loaded into a new session of the same
//              kind, continues bit for bit; a gathered file into one rank continues with the same
//              ids; swap to memory and to a file continues bit for bit; truncation keeps all or
//              none (anything else refused, naming why); a damaged state is refused, naming it;
//              streaming, P/D and replication are refused for it; the recurrent layers have no K
//              and V (the cache's buffer and a file hold the attention layers' rows alone), and a
//              file of an older kvr with rows for every layer loads and continues the same
//   LongRoPE   tiny-phi3 (SHARED/reference/archs-next): a cache or a replication log made in a
//              context that takes the short factors is refused by a session whose context takes
//              the long ones, naming both, and the other way round; one of the same choice loads
//   files      a symbolic link planted where a writer could put its temporary (PATH.part, the
//              name writers once used) redirects neither a save nor a stream: its target is left
//              as it was; 4 threads saving to one path at once, 30 times: every save succeeds and
//              the file left always loads; a save that hits a full disk (RLIMIT_FSIZE) fails with
//              KVR_ERR_IO, leaves the old file whole and no temporary behind
//
// usage: test-kvcache [SHARED_DIR (default ../shared)] [-v]
// Prints "kvcache: N passed, M failed" (", K skipped"); exits 1 on a failure.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"

// An F32 KV cache (the default is F16): these tests read and compare cache rows as f32.
#define KVR_TEST_F32_CACHE .cache_type_k = KVR_CACHE_F32, .cache_type_v = KVR_CACHE_F32

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char         tmp_dir[512];

static char * tmp_path(const char * name) {
    static char buf[8][640];
    static int k;
    char * p = buf[k++ % 8];
    snprintf(p, 640, "%s/%s", tmp_dir, name);
    return p;
}

// how many entries of tmp_dir start with prefix (leftover temporaries)
static int count_prefixed(const char * prefix) {
    DIR * d = opendir(tmp_dir);
    int n = 0;
    for (struct dirent * e; d && (e = readdir(d)); ) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d) closedir(d);
    return n;
}

static uint8_t * read_all(const char * path, size_t * n) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t * b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

static void write_all(const char * path, const void * b, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    if (n && fwrite(b, 1, n, f) != n) { perror(path); exit(2); }
    fclose(f);
}

static bool same_file(const char * a, const char * b) {
    size_t na, nb;
    uint8_t * x = read_all(a, &na), * y = read_all(b, &nb);
    const bool same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

static void put32(uint8_t * p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get32(const uint8_t * p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

//
// crc
//

static void test_crc(void) {
    set_case("crc");
    // the check values of CRC-32C (RFC 3720, B.4): "123456789", 32 zeros, 32 0xff, 0..31
    CHECK(kvr_crc32c(0, "123456789", 9) == 0xe3069283u, "crc32c(123456789) = %08x", kvr_crc32c(0, "123456789", 9));
    uint8_t b[32];
    memset(b, 0, 32);
    CHECK(kvr_crc32c(0, b, 32) == 0x8a9136aau, "crc32c(32 zeros)");
    memset(b, 0xff, 32);
    CHECK(kvr_crc32c(0, b, 32) == 0x62a8ab43u, "crc32c(32 x ff)");
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    CHECK(kvr_crc32c(0, b, 32) == 0x46dd794eu, "crc32c(0..31)");
    // continued over pieces of any alignment = over the whole
    CHECK(kvr_crc32c(kvr_crc32c(0, b, 13), b + 13, 19) == 0x46dd794eu, "crc32c continued");
}

//
// sessions
//

static const int32_t prompt[] = { 1, 403, 407, 261, 378, 6, 8, 391, 153, 289, 327, 372, 260, 284, 320, 261 };
#define N_PROMPT ((int)(sizeof(prompt) / sizeof(prompt[0])))

static struct kvr_session * new_session(const struct kvr_model * m, int n_ctx) {
    struct kvr_session * s = kvr_session_new(m, &(struct kvr_session_params) { KVR_TEST_F32_CACHE, .n_ctx = n_ctx, .n_threads = 1 });
    if (!s) { fprintf(stderr, "kvr_session_new: %s\n", kvr_last_error()); exit(2); }
    return s;
}

// the cache of a session's one rank
static const struct kvr_kv_cache * one_cache(const struct kvr_session * s) {
    const int32_t * pos;
    const struct kvr_kv_cache * c = NULL;
    kvr_session_cache(s, 0, &pos, &c);
    return c;
}

// greedy steps from the session's logits; ids and every step's logits out
static bool run_greedy(struct kvr_session * s, int n, int32_t * ids, float * logits_out, int n_vocab) {
    for (int i = 0; i < n; i++) {
        const float * l = kvr_session_logits(s);
        if (!l) return false;
        memcpy(logits_out + (size_t)i * n_vocab, l, sizeof(float) * (size_t)n_vocab);
        ids[i] = kvr_argmax(l, n_vocab);
        if (!kvr_session_eval(s, &ids[i], 1)) return false;
    }
    return true;
}

static void test_session(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab, N = 16;
    set_case("session save after prompt + 8 tokens, load, continue 16");
    struct kvr_session * a = new_session(m, 128);
    CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
    int32_t pre[8];
    float * scratch = malloc(sizeof(float) * (size_t)n_vocab * 32);
    CHECK(run_greedy(a, 8, pre, scratch, n_vocab), "decode");
    char f1[640], f2[640];
    snprintf(f1, sizeof(f1), "%s", tmp_path("s1.kv"));
    snprintf(f2, sizeof(f2), "%s", tmp_path("s2.kv"));
    CHECK(kvr_session_kv_save(a, f1, false) == KVR_OK, "save: %s", kvr_last_error());
    CHECK(kvr_session_kv_save(a, f2, false) == KVR_OK, "save again: %s", kvr_last_error());
    CHECK(same_file(f1, f2), "two saves of one cache differ");
    CHECK(count_prefixed("s1.kv.") == 0 && count_prefixed("s2.kv.") == 0, "a temporary is left behind");
    // a destination that is not a regular file is refused and left as it was: the rename at the
    // end would replace it (as root, --kv-save /dev/null once turned the device into a file)
    {
        char fifo[640];
        snprintf(fifo, sizeof(fifo), "%s", tmp_path("fifo.kv"));
        unlink(fifo);
        struct stat st;
        if (mkfifo(fifo, 0600) == 0) {
            CHECK(kvr_session_kv_save(a, fifo, false) == KVR_ERR_ARG && strstr(kvr_last_error(), "not a regular file"),
                  "save onto a FIFO: %s", kvr_last_error());
            CHECK(stat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO was replaced");
            unlink(fifo);
        } else {
            CHECK(0, "mkfifo %s: %s", fifo, strerror(errno));
        }
        CHECK(kvr_session_kv_save(a, tmp_dir, false) == KVR_ERR_ARG, "save onto a directory: %s", kvr_last_error());
    }

    struct kvr_session * b = new_session(m, 128);
    CHECK(kvr_session_eval(b, prompt, 3) != NULL, "b's own tokens first"); // overwritten by the load
    CHECK(kvr_session_kv_load(b, f1) == KVR_OK, "load: %s", kvr_last_error());
    CHECK(kvr_session_n_past(b) == N_PROMPT + 8, "n_past %d after the load, %d expected", kvr_session_n_past(b), N_PROMPT + 8);
    CHECK(memcmp(kvr_session_tokens(b), kvr_session_tokens(a), sizeof(int32_t) * (N_PROMPT + 8)) == 0, "tokens differ");
    int32_t ia[N], ib[N];
    float * la = malloc(sizeof(float) * (size_t)n_vocab * N), * lb = malloc(sizeof(float) * (size_t)n_vocab * N);
    CHECK(run_greedy(a, N, ia, la, n_vocab), "a continues");
    CHECK(run_greedy(b, N, ib, lb, n_vocab), "b continues");
    CHECK(memcmp(ia, ib, sizeof(ia)) == 0, "restored ids differ");
    CHECK(memcmp(la, lb, sizeof(float) * (size_t)n_vocab * N) == 0, "restored logits differ (not bit-identical)");

    set_case("session truncate");
    CHECK(kvr_session_truncate(b, 5) == KVR_OK && kvr_session_logits(b) == NULL, "truncate keeps logits");
    CHECK(kvr_session_truncate(b, 6) != KVR_OK, "truncate past n_past accepted");

    set_case("session swap to host memory and to a file");
    for (int k = 0; k < 2; k++) {
        struct kvr_session * c = new_session(m, 128);
        CHECK(kvr_session_kv_load(c, f1) == KVR_OK, "load: %s", kvr_last_error());
        const char * sp = k ? tmp_path("swap.kv") : NULL;
        CHECK(kvr_session_kv_swap_out(c, sp) == KVR_OK, "swap out: %s", kvr_last_error());
        CHECK(kvr_session_kv_swapped(c), "not swapped");
        CHECK(kvr_session_eval(c, prompt, 1) == NULL && strstr(kvr_last_error(), "swapped out"), "eval while swapped out: %s", kvr_last_error());
        CHECK(kvr_session_kv_swap_out(c, sp) != KVR_OK, "swapped out twice");
        if (sp) CHECK(access(sp, F_OK) == 0, "no swap file");
        CHECK(kvr_session_kv_swap_in(c) == KVR_OK, "swap in: %s", kvr_last_error());
        if (sp) CHECK(access(sp, F_OK) != 0, "the swap file is left behind");
        int32_t ic[N];
        float * lc = malloc(sizeof(float) * (size_t)n_vocab * N);
        CHECK(run_greedy(c, N, ic, lc, n_vocab), "continues after the swap");
        CHECK(memcmp(ia, ic, sizeof(ia)) == 0 && memcmp(la, lc, sizeof(float) * (size_t)n_vocab * N) == 0,
              "swap %s: the continuation differs", k ? "file" : "memory");
        free(lc);
        kvr_session_free(c);
    }
    free(la);
    free(lb);
    free(scratch);
    kvr_session_free(a);
    kvr_session_free(b);
}

// a session's cache written as ring shards over 3 ranks (gathered), and as one rank's shard
static void test_shards(const struct kvr_model * m) {
    set_case("shards");
    struct kvr_session * a = new_session(m, 64);
    CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill");
    const struct kvr_kv_cache * c = one_cache(a);
    const int n = N_PROMPT, R = 3, kv_dim = c->kv_dim;
    int32_t pos[3][N_PROMPT];
    struct kvr_kv_shard sh[3];
    for (int r = 0; r < R; r++) {
        sh[r].rank = r;
        sh[r].n_rows = kvr_ring_shard(n, 0, R, r, pos[r]);
        sh[r].pos = pos[r];
    }
    const float * logits = kvr_session_logits(a);
    for (int one = 0; one < 2; one++) {
        const char * path = tmp_path(one ? "shard1.kv" : "gathered.kv");
        struct kvr_kv_layout lay = { .n_tokens = n, .tokens = kvr_session_tokens(a), .n_ranks = R, .n_shards = one ? 1 : R,
                                     .shards = one ? &sh[1] : sh, .ring_next = 2, .logits = true, .chunk_rows = 3 };
        struct kvr_kv_writer * w;
        CHECK(kvr_kv_writer_open(&w, path, m, &lay) == KVR_OK, "open: %s", kvr_last_error());
        float * k = malloc(sizeof(float) * (size_t)kv_dim * n), * v = malloc(sizeof(float) * (size_t)kv_dim * n);
        for (int il = 0; il < c->n_layer; il++) {
            for (int s = 0; s < lay.n_shards; s++) {
                const struct kvr_kv_shard * x = &lay.shards[s];
                for (int i = 0; i < x->n_rows; i++) {
                    kvr_kv_cache_get_rows(kvr_session_backend(a, 0), c, il, x->pos[i], 1, k + (size_t)i * kv_dim, v + (size_t)i * kv_dim);
                }
                CHECK(kvr_kv_writer_layer(w, il, s, k, v) == KVR_OK, "layer");
            }
        }
        CHECK(kvr_kv_writer_close(w, logits) == KVR_OK, "close: %s", kvr_last_error());
        free(k);
        free(v);
        struct kvr_kv_file * f;
        CHECK(kvr_kv_file_read(path, m, &f) == KVR_OK, "read: %s", kvr_last_error());
        if (f) {
            CHECK(f->n_ranks == R && f->n_shards == lay.n_shards && f->ring_next == 2 && f->chunk_rows == 3, "header fields");
            CHECK(f->shards[0].rank == (one ? 1 : 0) && f->shards[0].n_rows == sh[one].n_rows, "shard table");
            kvr_kv_file_free(f);
        }
        struct kvr_session * b = new_session(m, 64);
        const int rc = kvr_session_kv_load(b, path);
        if (one) {
            CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "shard of rank 1") && kvr_session_n_past(b) == 0,
                  "one shard loaded into a session: %d %s", rc, kvr_last_error());
        } else {
            CHECK(rc == KVR_OK, "gathered load: %s", kvr_last_error());
            // the rows land at their positions: the cache equals a's
            bool same = kvr_session_n_past(b) == n;
            float * x = malloc(sizeof(float) * (size_t)kv_dim * n), * y = malloc(sizeof(float) * (size_t)kv_dim * n);
            for (int il = 0; same && il < c->n_layer; il++) {
                kvr_kv_cache_get_rows(kvr_session_backend(a, 0), c, il, 0, n, x, NULL);
                kvr_kv_cache_get_rows(kvr_session_backend(b, 0), one_cache(b), il, 0, n, y, NULL);
                same = memcmp(x, y, sizeof(float) * (size_t)kv_dim * n) == 0;
                kvr_kv_cache_get_rows(kvr_session_backend(a, 0), c, il, 0, n, NULL, x);
                kvr_kv_cache_get_rows(kvr_session_backend(b, 0), one_cache(b), il, 0, n, NULL, y);
                same = same && memcmp(x, y, sizeof(float) * (size_t)kv_dim * n) == 0;
            }
            CHECK(same, "the gathered shards do not restore the cache");
            free(x);
            free(y);
        }
        kvr_session_free(b);
    }
    kvr_session_free(a);
}

//
// malformed files
//

struct mutation {
    const char * name;
    int          rc;        // the status expected
    const char * expect;    // a substring of the message
};

// header offsets (kvr.h's table)
#define OFF_VERSION 8
#define OFF_FLAGS   12
#define OFF_FIELD(i) (16 + 4 * (i))
#define OFF_CRC     92

static void mend_header(uint8_t * b) { put32(b + OFF_CRC, kvr_crc32c(0, b, OFF_CRC)); }

// A copy of the model file at path with one byte changed at off (off < 0: none), loaded.
static struct kvr_model * load_changed(const char * path, const char * name, long off) {
    size_t n;
    uint8_t * b = read_all(path, &n);
    if (!b) return NULL;
    if (off >= 0 && (size_t)off < n) b[off] ^= 0x01;
    write_all(tmp_path(name), b, n);
    free(b);
    struct kvr_model * m = kvr_model_load(tmp_path(name), NULL);
    CHECK(m != NULL, "%s: %s", name, kvr_last_error());
    return m;
}

static void test_weights(const struct kvr_model * m, const char * path) {
    set_case("weights: a cache of the original");
    struct kvr_session * a = new_session(m, 32);
    CHECK(kvr_session_eval(a, prompt, 6) != NULL, "prefill");
    char good[640];
    snprintf(good, sizeof(good), "%s", tmp_path("orig.kv"));
    CHECK(kvr_session_kv_save(a, good, false) == KVR_OK, "save: %s", kvr_last_error());
    kvr_session_free(a);

    // a byte in the middle of the data section (a weight of some middle tensor), one in the
    // tokenizer's scores (the text and the shapes stay as they were)
    const struct kvr_gguf * g = m->gguf;
    const long w_off = (long)(g->data_offset + (g->size - g->data_offset) / 2);
    const struct kvr_gguf_kv * sc = kvr_gguf_get_kv(g, "tokenizer.ggml.scores");
    const long t_off = sc && sc->n > 10 ? (long)((const uint8_t *)sc->data - g->base) + 4 * 10 + 2 : -1;
    const struct { const char * name; long off; int rc; const char * expect; } v[] = {
        { "same.gguf",      -1,    KVR_OK,      NULL },
        { "weights.gguf",   w_off, KVR_ERR_ARG, "offset 56: the cache is of another model: weights hash" },
        { "tokenizer.gguf", t_off, KVR_ERR_ARG, "offset 84: the cache is of another model: tokenizer hash" },
    };
    CHECK(t_off > 0, "the model has tokenizer scores");
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        set_case("weights: %s", v[i].name);
        struct kvr_model * c = load_changed(path, v[i].name, v[i].off);
        if (!c) continue;
        struct kvr_session * s = new_session(c, 32);
        // --kv-load's road and --session's (kvr-run loads an existing --session file the same way)
        int rc = kvr_session_kv_load(s, good);
        CHECK(rc == v[i].rc, "kv_load: %d, %d expected (%s)", rc, v[i].rc, rc ? kvr_last_error() : "");
        if (v[i].expect) {
            CHECK(strstr(kvr_last_error(), v[i].expect) != NULL, "message '%s' lacks '%s'", kvr_last_error(), v[i].expect);
            CHECK(kvr_session_n_past(s) == 0, "nothing loaded");
        } else {
            CHECK(kvr_session_n_past(s) == 6, "the unchanged copy's load has %d tokens", kvr_session_n_past(s));
        }
        if (verbose && rc) printf("  -> %s\n", kvr_last_error());
        kvr_session_free(s);
        kvr_model_free(c);
    }
}

static void test_malformed(const struct kvr_model * m, const char * other_model_path) {
    const int n_vocab = (int)m->hp.n_vocab;
    set_case("malformed: setup");
    struct kvr_session * a = new_session(m, 64);
    CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill");
    char good[640];
    snprintf(good, sizeof(good), "%s", tmp_path("good.kv"));
    CHECK(kvr_session_kv_save(a, good, false) == KVR_OK, "save: %s", kvr_last_error());
    size_t n;
    uint8_t * g = read_all(good, &n);
    const uint32_t n_tok = get32(g + OFF_FIELD(12)), kv_dim = m->hp.head_dim * m->hp.n_head_kv;
    const size_t tok_off = 96, tab_off = tok_off + 4 * n_tok + 4, pos_off = tab_off + 8, rows_off = pos_off + 4 * n_tok + 4;
    const size_t chunk = 20 + 4 * (size_t)kv_dim * n_tok + 4; // chunk_rows holds the whole prompt
    CHECK(get32(g + OFF_FIELD(15)) >= n_tok, "the test assumes one chunk per layer and kind");
    const size_t logits_off = n - 4 - 4 * (size_t)n_vocab;

    // the session that must stay as it is: other tokens, other logits
    struct kvr_session * s = new_session(m, 64);
    CHECK(kvr_session_eval(s, prompt + 2, 5) != NULL, "victim prefill");
    float * want_logits = malloc(sizeof(float) * (size_t)n_vocab);
    memcpy(want_logits, kvr_session_logits(s), sizeof(float) * (size_t)n_vocab);
    const size_t kb = sizeof(float) * kv_dim * 64;
    float * want_k = malloc(kb), * got_k = malloc(kb);
    kvr_kv_cache_get_rows(kvr_session_backend(s, 0), one_cache(s), 0, 0, 64, want_k, NULL);

    int n_cases = 0;
    for (int v = 0; ; v++) {
        uint8_t * b = malloc(n + 4096);
        memcpy(b, g, n);
        size_t len = n;
        struct mutation mu = { 0 };
        switch (v) {
        case 0:  mu = (struct mutation) { "empty file", KVR_ERR_FORMAT, "empty file" }; len = 0; break;
        case 1:  mu = (struct mutation) { "cut in the magic", KVR_ERR_FORMAT, "truncated" }; len = 5; break;
        case 2:  mu = (struct mutation) { "cut in the header", KVR_ERR_FORMAT, "truncated: the header at offset 0" }; len = 50; break;
        case 3:  mu = (struct mutation) { "another magic", KVR_ERR_FORMAT, "not a kvr cache file" }; memcpy(b, "GGUF", 4); break;
        case 4:  mu = (struct mutation) { "a newer version", KVR_ERR_UNSUPP, "offset 8: version 4 is newer" }; put32(b + OFF_VERSION, KVR_KV_FILE_VERSION + 1); mend_header(b); break;
        case 5:  mu = (struct mutation) { "version 0", KVR_ERR_FORMAT, "version 0" }; put32(b + OFF_VERSION, 0); mend_header(b); break;
        case 6:  mu = (struct mutation) { "a bit flipped in the header", KVR_ERR_FORMAT, "offset 92: the header's CRC32C" }; b[30] ^= 0x10; break;
        case 7:  mu = (struct mutation) { "unknown flags", KVR_ERR_FORMAT, "offset 12: flags 0x11" }; put32(b + OFF_FLAGS, 0x11); mend_header(b); break;
        case 8:  mu = (struct mutation) { "another architecture", KVR_ERR_ARG, "offset 16: the cache is of another model: architecture 1" }; put32(b + OFF_FIELD(0), 1); mend_header(b); break;
        case 9:  mu = (struct mutation) { "other layers", KVR_ERR_ARG, "offset 20: the cache is of another model: layers 9" }; put32(b + OFF_FIELD(1), 9); mend_header(b); break;
        case 10: mu = (struct mutation) { "other KV heads", KVR_ERR_ARG, "offset 24: the cache is of another model: KV heads 7" }; put32(b + OFF_FIELD(2), 7); mend_header(b); break;
        case 11: mu = (struct mutation) { "another head size", KVR_ERR_ARG, "offset 28: the cache is of another model: head size 16" }; put32(b + OFF_FIELD(3), 16); mend_header(b); break;
        case 12: mu = (struct mutation) { "a cache type field naming q5_1", KVR_ERR_FORMAT,
                                          "offset 32: the cache type field 0x00000007 gives K type 7 (q5_1), not a KV cache type" };
                 put32(b + OFF_FIELD(4), KVR_TYPE_Q5_1); mend_header(b); break;
        case 13: mu = (struct mutation) { "another RoPE base", KVR_ERR_ARG, "offset 44: the cache is of another model: RoPE base 500000" }; {
                     float x = 500000.0f; uint32_t u; memcpy(&u, &x, 4); put32(b + OFF_FIELD(7), u); mend_header(b); } break;
        case 14: mu = (struct mutation) { "another RoPE mode", KVR_ERR_ARG, "offset 40: the cache is of another model: RoPE mode 2" }; put32(b + OFF_FIELD(6), 2); mend_header(b); break;
        case 15: mu = (struct mutation) { "other weights", KVR_ERR_ARG, "offset 56: the cache is of another model: weights hash" }; b[57] ^= 1; mend_header(b); break;
        case 16: mu = (struct mutation) { "another vocabulary", KVR_ERR_ARG, "offset 52: the cache is of another model: vocabulary size" }; put32(b + OFF_FIELD(9), 32000); mend_header(b); break;
        case 17: mu = (struct mutation) { "more tokens than the context", KVR_ERR_FORMAT, "tokens" }; put32(b + OFF_FIELD(12), 1u << 25); mend_header(b); break;
        case 18: mu = (struct mutation) { "shards of more ranks", KVR_ERR_FORMAT, "offset 72: 3 shards of a cache over 2 ranks" }; put32(b + OFF_FIELD(13), 2); put32(b + OFF_FIELD(14), 3); mend_header(b); break;
        case 19: mu = (struct mutation) { "ring's next shard outside", KVR_ERR_FORMAT, "offset 80: the ring's next shard 4" }; put32(b + OFF_FIELD(16), 4); mend_header(b); break;
        case 20: mu = (struct mutation) { "another tokenizer", KVR_ERR_ARG, "offset 84: the cache is of another model: tokenizer hash" }; b[90] ^= 4; mend_header(b); break;
        case 21: mu = (struct mutation) { "a token's bit flipped", KVR_ERR_FORMAT, "the CRC32C of the token ids" }; b[tok_off + 5] ^= 0x40; break;
        case 22: mu = (struct mutation) { "a token outside the vocabulary", KVR_ERR_FORMAT, "token 2 is 100000, outside the vocabulary" }; {
                     put32(b + tok_off + 8, 100000); put32(b + tok_off + 4 * n_tok, kvr_crc32c(0, b + tok_off, 4 * n_tok)); } break;
        case 23: mu = (struct mutation) { "a shard of another rank", KVR_ERR_FORMAT, "shard 0 has rank 3" }; {
                     put32(b + tab_off, 3); put32(b + pos_off + 4 * n_tok, kvr_crc32c(0, b + tab_off, 8 + 4 * n_tok)); } break;
        case 24: mu = (struct mutation) { "a shard with fewer rows", KVR_ERR_FORMAT, "the shards hold 15 rows, the cache 16 tokens" }; {
                     // the last position dropped, the table's CRC mended
                     put32(b + tab_off + 4, n_tok - 1);
                     memmove(b + pos_off + 4 * (n_tok - 1), b + pos_off + 4 * n_tok, n - (pos_off + 4 * n_tok));
                     len = n - 4;
                     put32(b + pos_off + 4 * (n_tok - 1), kvr_crc32c(0, b + tab_off, 8 + 4 * (n_tok - 1))); } break;
        case 25: mu = (struct mutation) { "a position twice", KVR_ERR_FORMAT, "row 3 of shard 0 is at position 2 (a position held twice)" }; {
                     put32(b + pos_off + 12, 2); put32(b + pos_off + 4 * n_tok, kvr_crc32c(0, b + tab_off, 8 + 4 * n_tok)); } break;
        case 26: mu = (struct mutation) { "a position outside", KVR_ERR_FORMAT, "is at position 99 (outside the cache's tokens)" }; {
                     put32(b + pos_off + 4 * (n_tok - 1), 99); put32(b + pos_off + 4 * n_tok, kvr_crc32c(0, b + tab_off, 8 + 4 * n_tok)); } break;
        case 27: mu = (struct mutation) { "a position's bit flipped", KVR_ERR_FORMAT, "the CRC32C of the shard table" }; b[pos_off + 9] ^= 0x04; break;
        case 28: mu = (struct mutation) { "a K value's bit flipped", KVR_ERR_FORMAT, "the CRC32C of the chunk of layer 0, shard 0, K rows [0, 16)" }; b[rows_off + 20 + 100] ^= 0x01; break;
        case 29: mu = (struct mutation) { "a V value of the last layer flipped", KVR_ERR_FORMAT, "layer 4, shard 0, V rows [0, 16)" }; b[rows_off + chunk * (2 * m->hp.n_layer - 1) + 30] ^= 0x80; break;
        case 30: mu = (struct mutation) { "a chunk of another layer", KVR_ERR_FORMAT, "the chunk of layer 1, shard 0, K rows [0, 16): layer is 0, 1 expected" }; {
                     // the chunks of layer 0 copied over layer 1: each chunk's own CRC holds
                     memcpy(b + rows_off + 2 * chunk, b + rows_off, 2 * chunk); } break;
        case 31: mu = (struct mutation) { "V before K", KVR_ERR_FORMAT, "kind (0 K, 1 V) is 1, 0 expected" }; {
                     uint8_t * t = malloc(chunk); memcpy(t, b + rows_off, chunk); memmove(b + rows_off, b + rows_off + chunk, chunk);
                     memcpy(b + rows_off + chunk, t, chunk); free(t); } break;
        case 32: mu = (struct mutation) { "cut in the rows", KVR_ERR_FORMAT, "truncated: the file has" }; len = rows_off + chunk + 77; break;
        case 33: mu = (struct mutation) { "cut before the logits", KVR_ERR_FORMAT, "truncated: the file has" }; len = logits_off; break;
        case 34: mu = (struct mutation) { "a byte too many", KVR_ERR_FORMAT, "trailing bytes: the file has" }; b[n] = 0; len = n + 1; break;
        case 35: mu = (struct mutation) { "a logit's bit flipped", KVR_ERR_FORMAT, "the CRC32C of the logits" }; b[logits_off + 8] ^= 2; break;
        case 36: mu = (struct mutation) { "no logits flag, logits there", KVR_ERR_FORMAT, "trailing bytes" }; put32(b + OFF_FLAGS, 0); mend_header(b); break;
        case 37: mu = (struct mutation) { "zero rows per chunk", KVR_ERR_FORMAT, "offset 76: rows per chunk 0 is out of range" }; put32(b + OFF_FIELD(15), 0); mend_header(b); break;
        case 38: mu = (struct mutation) { "smaller chunks than written", KVR_ERR_FORMAT, "rows is 16, 4 expected" }; {
                     // the size check is bypassed by a file of the size smaller chunks make: the chunk header tells
                     put32(b + OFF_FIELD(15), 4); mend_header(b); len = n + (size_t)2 * m->hp.n_layer * 3 * 24; memset(b + n, 0, len - n); } break;
        case 39: mu = (struct mutation) { "an older version", KVR_ERR_FORMAT,
                                          "offset 8: version 1 is older than this kvr reads (3): its fingerprint does not cover the weights' bytes" };
                 put32(b + OFF_VERSION, 1); mend_header(b); break;
        case 40: mu = (struct mutation) { "version 2 (f32 rows, no cache type)", KVR_ERR_FORMAT,
                                          "offset 8: version 2 is older than this kvr reads (3): it was written before KV caches had a type" };
                 put32(b + OFF_VERSION, 2); mend_header(b); break;
        case 41: mu = (struct mutation) { "a V type of 99 in the cache type field", KVR_ERR_FORMAT, "gives V type 99 (?), not a KV cache type" };
                 put32(b + OFF_FIELD(4), 99u << 16); mend_header(b); break;
        case 42: mu = (struct mutation) { "q8_0 rows for a head size of 8", KVR_ERR_FORMAT, "gives K type 8 (q8_0), not a KV cache type (f32, f16, bf16, q8_0) for a head size of 8" };
                 put32(b + OFF_FIELD(4), KVR_TYPE_Q8_0); mend_header(b); break;
        case 43: mu = (struct mutation) { "f16 rows where f32 ones were written", KVR_ERR_FORMAT, "the file has" };
                 put32(b + OFF_FIELD(4), KVR_TYPE_F16 | KVR_TYPE_F16 << 16); mend_header(b); break;
        case 44: mu = (struct mutation) { "long LongRoPE factors for a model without them", KVR_ERR_FORMAT,
                                          "offset 12: the file's keys took long LongRoPE factors (flag 0x4), the model" };
                 put32(b + OFF_FLAGS, get32(b + OFF_FLAGS) | KVR_KV_FILE_ROPE_LONG); mend_header(b); break;
        default: break;
        }
        if (!mu.name) { free(b); break; }
        n_cases++;
        set_case("malformed %d: %s", v, mu.name);
        const char * path = tmp_path("bad.kv");
        write_all(path, b, len);
        free(b);
        const int rc = kvr_session_kv_load(s, path);
        const char * msg = kvr_last_error();
        CHECK(rc == mu.rc, "status %d, %d expected (%s)", rc, mu.rc, msg);
        CHECK(strstr(msg, mu.expect) != NULL && strstr(msg, path) != NULL, "message '%s' lacks '%s' or the path", msg, mu.expect);
        if (verbose) printf("  -> %s\n", msg);
        // nothing half-loaded: the session is as it was
        CHECK(kvr_session_n_past(s) == 5 && memcmp(kvr_session_tokens(s), prompt + 2, 5 * sizeof(int32_t)) == 0, "tokens changed");
        CHECK(kvr_session_logits(s) && memcmp(kvr_session_logits(s), want_logits, sizeof(float) * (size_t)n_vocab) == 0, "logits changed");
        kvr_kv_cache_get_rows(kvr_session_backend(s, 0), one_cache(s), 0, 0, 64, got_k, NULL);
        CHECK(memcmp(got_k, want_k, kb) == 0, "the cache changed");
    }
    set_case("malformed: count");
    CHECK(n_cases >= 15, "%d malformed variants", n_cases);

    set_case("malformed: a missing file, another model's cache");
    CHECK(kvr_session_kv_load(s, tmp_path("none.kv")) == KVR_ERR_IO && strstr(kvr_last_error(), "cannot open"), "missing file: %s", kvr_last_error());
    struct kvr_model * om = other_model_path ? kvr_model_load(other_model_path, NULL) : NULL;
    if (om) {
        struct kvr_session * o = new_session(om, 32);
        const int rc = kvr_session_kv_load(o, good);
        CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "the cache is of another model"), "another model's cache: %d %s", rc, kvr_last_error());
        if (verbose) printf("  -> %s\n", kvr_last_error());
        kvr_session_free(o);
        kvr_model_free(om);
    } else {
        n_skip++;
    }
    // the same shapes, other weights (Q4_0 against Q8_0 of one model): only the hash tells them apart
    char q4[1100];
    snprintf(q4, sizeof(q4), "%s", other_model_path ? other_model_path : "");
    char * dot = strstr(q4, "Q8_0");
    struct kvr_model * m8 = other_model_path ? kvr_model_load(other_model_path, NULL) : NULL;
    struct kvr_model * m4 = dot ? (memcpy(dot, "Q4_0", 4), kvr_model_load(q4, NULL)) : NULL;
    if (m8 && m4) {
        struct kvr_session * s8 = new_session(m8, 32), * s4 = new_session(m4, 32);
        CHECK(kvr_session_eval(s8, prompt, 4) != NULL, "Q8_0 prefill");
        CHECK(kvr_session_kv_save(s8, tmp_path("q8.kv"), false) == KVR_OK, "Q8_0 save");
        const int rc = kvr_session_kv_load(s4, tmp_path("q8.kv"));
        CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "offset 56: the cache is of another model: weights hash"),
              "a cache of other weights of the same shape: %d %s", rc, kvr_last_error());
        if (verbose) printf("  -> %s\n", kvr_last_error());
        kvr_session_free(s8);
        kvr_session_free(s4);
    } else {
        n_skip++;
    }
    kvr_model_free(m8);
    kvr_model_free(m4);
    free(want_logits);
    free(want_k);
    free(got_k);
    free(g);
    kvr_session_free(s);
    kvr_session_free(a);
}

//
// session: restore-and-continue through kvr_session_kv_save/_load
//

static struct kvr_session * new_dist(const struct kvr_model * m, enum kvr_strategy st, int n_ranks) {
    struct kvr_session_params p = { KVR_TEST_F32_CACHE, .strategy = st, .n_ranks = n_ranks, .n_threads = 1, .n_ctx = 96, .timeout_s = 30 };
    struct kvr_session * d = kvr_session_new(m, &p);
    if (!d) { fprintf(stderr, "kvr_session_new: %s\n", kvr_last_error()); exit(2); }
    return d;
}

// n greedy steps from the session's logits, every step's logits out
static bool dist_greedy(struct kvr_session * d, int n, int32_t * ids, float * logits_out, int n_vocab) {
    for (int i = 0; i < n; i++) {
        const float * l = kvr_session_logits(d);
        if (!l) return false;
        memcpy(logits_out + (size_t)i * n_vocab, l, sizeof(float) * (size_t)n_vocab);
        ids[i] = kvr_argmax(l, n_vocab);
        if (!kvr_session_eval(d, &ids[i], 1)) return false;
    }
    return true;
}

static void test_dist(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab, N = 12;
    const enum kvr_strategy strats[] = { KVR_STRATEGY_SINGLE, KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV, KVR_STRATEGY_RING_Q };
    float * la = malloc(sizeof(float) * (size_t)n_vocab * N), * lb = malloc(sizeof(float) * (size_t)n_vocab * N);
    float * scratch = malloc(sizeof(float) * (size_t)n_vocab * 8);
    for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
        for (int nr = 1; nr <= 4; nr++) {
            if (strats[si] == KVR_STRATEGY_SINGLE && nr > 1) continue;
            for (int per_rank = 0; per_rank < 2; per_rank++) {
                const bool ring = strats[si] == KVR_STRATEGY_RING_KV || strats[si] == KVR_STRATEGY_RING_Q;
                if (per_rank && !ring) continue;
                set_case("dist %s x%d%s: save after prompt + 5, load, continue %d", kvr_strategy_name(strats[si]), nr,
                         per_rank ? " (a file per rank)" : "", N);
                struct kvr_session * a = new_dist(m, strats[si], nr);
                CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
                int32_t pre[5], ia[N], ib[N];
                CHECK(dist_greedy(a, 5, pre, scratch, n_vocab), "decode: %s", kvr_last_error());
                char path[640];
                snprintf(path, sizeof(path), "%s", tmp_path("dist.kv"));
                CHECK(kvr_session_kv_save(a, path, per_rank) == KVR_OK, "save: %s", kvr_last_error());
                char p0[700];
                kvr_session_kv_shard_path(path, nr - 1, p0, sizeof(p0));
                CHECK(access(per_rank ? p0 : path, F_OK) == 0, "no file written");
                struct kvr_session * b = new_dist(m, strats[si], nr);
                CHECK(kvr_session_eval(b, prompt + 3, 4) != NULL, "b's own tokens first");
                CHECK(kvr_session_kv_load(b, path) == KVR_OK, "load: %s", kvr_last_error());
                CHECK(kvr_session_n_past(b) == N_PROMPT + 5 && memcmp(kvr_session_tokens(b), kvr_session_tokens(a), sizeof(int32_t) * (N_PROMPT + 5)) == 0,
                      "tokens after the load");
                CHECK(dist_greedy(a, N, ia, la, n_vocab), "a continues: %s", kvr_last_error());
                CHECK(dist_greedy(b, N, ib, lb, n_vocab), "b continues: %s", kvr_last_error());
                CHECK(memcmp(ia, ib, sizeof(ia)) == 0, "restored ids differ");
                CHECK(memcmp(la, lb, sizeof(float) * (size_t)n_vocab * N) == 0, "restored logits differ (not bit-identical)");
                // a later turn after the restore works as after a prefill (ring: the ring again)
                CHECK(kvr_session_eval(b, prompt, 7) != NULL, "a second turn after the restore: %s", kvr_last_error());
                kvr_session_free(b);
                // the gathered file of any layout into a single session: the same rows, close continuation
                if (!per_rank) {
                    struct kvr_session * s = new_session(m, 96);
                    CHECK(kvr_session_kv_load(s, path) == KVR_OK, "into a session: %s", kvr_last_error());
                    int32_t is[4];
                    float * ls = malloc(sizeof(float) * (size_t)n_vocab * 4);
                    CHECK(run_greedy(s, 4, is, ls, n_vocab), "the session continues");
                    CHECK(memcmp(is, ia, sizeof(is)) == 0, "the session's continuation differs");
                    free(ls);
                    kvr_session_free(s);
                } else {
                    struct kvr_session * c = new_dist(m, KVR_STRATEGY_KVR, nr);
                    const int rc = kvr_session_kv_load(c, path);
                    CHECK(nr == 1 ? rc == KVR_OK : rc == KVR_ERR_ARG, "per-rank files into a chain: %d %s", rc, kvr_last_error());
                    kvr_session_free(c);
                }
                kvr_session_free(a);
            }
        }
    }
    set_case("dist: a ring cache of 3 ranks into 2 ring ranks and into kvr x3");
    {
        struct kvr_session * a = new_dist(m, KVR_STRATEGY_RING_KV, 3);
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill");
        char path[640];
        snprintf(path, sizeof(path), "%s", tmp_path("ring3.kv"));
        CHECK(kvr_session_kv_save(a, path, false) == KVR_OK, "save");
        int32_t ia[4];
        CHECK(dist_greedy(a, 4, ia, la, n_vocab), "a continues");
        const enum kvr_strategy to[2] = { KVR_STRATEGY_RING_Q, KVR_STRATEGY_KVR };
        for (int k = 0; k < 2; k++) {
            struct kvr_session * b = new_dist(m, to[k], k ? 3 : 2);
            CHECK(kvr_session_kv_load(b, path) == KVR_OK, "load: %s", kvr_last_error());
            int32_t ib[4];
            CHECK(dist_greedy(b, 4, ib, lb, n_vocab), "continues");
            CHECK(memcmp(ia, ib, sizeof(ia)) == 0, "the continuation differs");
            kvr_session_free(b);
        }
        set_case("dist: a failed load leaves the dist as it was");
        struct kvr_session * b = new_dist(m, KVR_STRATEGY_RING_KV, 3);
        CHECK(kvr_session_eval(b, prompt, 6) != NULL, "prefill");
        write_all(tmp_path("bad.kv"), "KVRCACHE", 8);
        CHECK(kvr_session_kv_load(b, tmp_path("bad.kv")) == KVR_ERR_FORMAT, "a truncated file accepted");
        CHECK(kvr_session_n_past(b) == 6 && kvr_session_logits(b) != NULL, "the dist changed");
        struct kvr_session * small = new_dist(m, KVR_STRATEGY_SINGLE, 1);
        CHECK(kvr_session_truncate(small, 1) == KVR_ERR_ARG, "truncate past n_past");
        kvr_session_free(small);
        kvr_session_free(b);
        kvr_session_free(a);
    }
    free(la);
    free(lb);
    free(scratch);
}

// kvr_session_interrupt: asked for before an eval, that eval does not start (withdrawn, it does);
// asked for during a prefill over 3 ranks on a slow emulated link, every rank stops well before
// the prefill would end (not after --comm-timeout). Either way the session keeps nothing of the batch and its next
// prefill gives the logits of one never interrupted, bit for bit.
struct interrupted_eval {
    struct kvr_session * s;
    const int32_t      * ids;
    int                  n;
    const float        * logits;
    char                 err[256];
};

static void * interrupted_eval_run(void * arg) {
    struct interrupted_eval * e = arg;
    e->logits = kvr_session_eval(e->s, e->ids, e->n);
    snprintf(e->err, sizeof(e->err), "%s", e->logits ? "" : kvr_last_error());
    return NULL;
}

//
// a hybrid model: the recurrent layers' states travel with the cache
//

static void test_hybrid(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab, N = 6;
    const enum kvr_strategy strats[] = { KVR_STRATEGY_SINGLE, KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV, KVR_STRATEGY_RING_Q };
    float * la = malloc(sizeof(float) * (size_t)n_vocab * N), * lb = malloc(sizeof(float) * (size_t)n_vocab * N);
    float * scratch = malloc(sizeof(float) * (size_t)n_vocab * 8);
    for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
        for (int nr = 1; nr <= 3; nr++) {
            if (strats[si] == KVR_STRATEGY_SINGLE && nr > 1) continue;
            const bool ring = strats[si] == KVR_STRATEGY_RING_KV || strats[si] == KVR_STRATEGY_RING_Q;
            for (int per_rank = 0; per_rank < (ring ? 2 : 1); per_rank++) {
                set_case("hybrid %s x%d%s: save after prompt + 3, load, continue %d", kvr_strategy_name(strats[si]), nr,
                         per_rank ? " (a file per rank)" : "", N);
                struct kvr_session * a = new_dist(m, strats[si], nr);
                CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
                int32_t pre[3], ia[N], ib[N];
                CHECK(dist_greedy(a, 3, pre, scratch, n_vocab), "decode: %s", kvr_last_error());
                const char * path = tmp_path("hybrid.kv");
                CHECK(kvr_session_kv_save(a, path, per_rank) == KVR_OK, "save: %s", kvr_last_error());
                struct kvr_session * b = new_dist(m, strats[si], nr);
                CHECK(kvr_session_eval(b, prompt + 3, 4) != NULL, "b's own tokens first");
                CHECK(kvr_session_kv_load(b, path) == KVR_OK, "load: %s", kvr_last_error());
                CHECK(dist_greedy(a, N, ia, la, n_vocab), "a continues: %s", kvr_last_error());
                CHECK(dist_greedy(b, N, ib, lb, n_vocab), "b continues: %s", kvr_last_error());
                CHECK(memcmp(ia, ib, sizeof(ia)) == 0, "restored ids differ");
                CHECK(memcmp(la, lb, sizeof(float) * (size_t)n_vocab * N) == 0, "restored logits differ (not bit-identical)");
                CHECK(kvr_session_eval(b, prompt, 7) != NULL, "a second turn after the restore: %s", kvr_last_error());
                kvr_session_free(b);
                if (!per_rank) { // into one rank: the same states, the same ids
                    struct kvr_session * s1 = new_session(m, 96);
                    CHECK(kvr_session_kv_load(s1, path) == KVR_OK, "into a session: %s", kvr_last_error());
                    int32_t is[4];
                    float * ls = malloc(sizeof(float) * (size_t)n_vocab * 4);
                    CHECK(run_greedy(s1, 4, is, ls, n_vocab), "the session continues");
                    CHECK(memcmp(is, ia, sizeof(is)) == 0, "the session's continuation differs");
                    free(ls);
                    kvr_session_free(s1);
                }
                kvr_session_free(a);
            }
        }
    }
    set_case("hybrid: swap out and in");
    for (int k = 0; k < 2; k++) {
        struct kvr_session * a = new_dist(m, KVR_STRATEGY_RING_KV, 2), * c = new_dist(m, KVR_STRATEGY_RING_KV, 2);
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) && kvr_session_eval(c, prompt, N_PROMPT), "prefill: %s", kvr_last_error());
        int32_t ia[N], ic[N];
        CHECK(kvr_session_kv_swap_out(c, k ? tmp_path("hybrid-swap.kv") : NULL) == KVR_OK, "swap out: %s", kvr_last_error());
        CHECK(kvr_session_kv_swap_in(c) == KVR_OK, "swap in: %s", kvr_last_error());
        CHECK(dist_greedy(a, N, ia, la, n_vocab) && dist_greedy(c, N, ic, lb, n_vocab), "continue: %s", kvr_last_error());
        CHECK(memcmp(ia, ic, sizeof(ia)) == 0 && memcmp(la, lb, sizeof(float) * (size_t)n_vocab * N) == 0,
              "swap to %s: the continuation differs", k ? "a file" : "memory");
        kvr_session_free(a);
        kvr_session_free(c);
    }
    set_case("hybrid: truncation keeps all tokens or none");
    {
        struct kvr_session * a = new_session(m, 96);
        const float * l0 = kvr_session_eval(a, prompt, N_PROMPT);
        CHECK(l0 != NULL, "prefill: %s", kvr_last_error());
        memcpy(la, l0, sizeof(float) * (size_t)n_vocab);
        CHECK(kvr_session_truncate(a, 5) == KVR_ERR_UNSUPP && strstr(kvr_last_error(), "recurrent") &&
              kvr_session_n_past(a) == N_PROMPT, "truncate to 5: %s", kvr_last_error());
        printf("  hybrid truncate refused as it should: %s\n", kvr_last_error());
        CHECK(kvr_session_truncate(a, N_PROMPT) == KVR_OK && kvr_session_truncate(a, 0) == KVR_OK, "truncate to all, to none");
        const float * l1 = kvr_session_eval(a, prompt, N_PROMPT);
        CHECK(l1 && memcmp(l1, la, sizeof(float) * (size_t)n_vocab) == 0, "after truncating to none the prompt gives other logits");
        kvr_session_free(a);
    }
    // K and V only where attention runs: the recurrent layers have no planes, the buffer holds the
    // attention layers' rows and the states, a file's layers section the attention layers' rows
    set_case("hybrid: K and V rows for the attention layers alone");
    {
        const int L = (int)m->hp.n_layer, n_rec = (int)m->hp.n_recurrent, n_attn = L - n_rec;
        struct kvr_session * a = new_session(m, 512);
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
        const struct kvr_kv_cache * c = one_cache(a);
        bool planes = c != NULL;
        for (int il = 0; c && il < L; il++) planes = planes && !c->k[il] == kvr_layer_recurrent(&m->hp, il) && !c->v[il] == !c->k[il];
        CHECK(n_rec > 0 && n_attn > 0 && planes, "K/V planes: recurrent layers must have none, attention layers both");
        if (c) {
            const size_t rows = (c->row_k > c->row_v ? c->row_k : c->row_v) * (size_t)c->n_ctx;
            const size_t lo = 2 * (size_t)n_attn * rows + (size_t)n_rec * sizeof(float) * (size_t)c->n_state;
            const size_t hi = lo + (2 * (size_t)n_attn + (size_t)n_rec) * 64; // each plane and state aligned
            CHECK(c->buf->size >= lo && c->buf->size <= hi, "the cache's buffer has %zu bytes; %d attention layers' K/V of %d rows and %d "
                  "states make %zu to %zu", c->buf->size, n_attn, c->n_ctx, n_rec, lo, hi);
            if (verbose) printf("  hybrid cache: %zu bytes for %d rows (%d of %d layers with K/V)\n", c->buf->size, c->n_ctx, n_attn, L);
        }
        const char * path = tmp_path("hybrid-attn.kv");
        CHECK(kvr_session_kv_save(a, path, false) == KVR_OK, "save: %s", kvr_last_error());
        size_t n = 0;
        uint8_t * b = read_all(path, &n);
        const int64_t T = N_PROMPT, row = (int64_t)(c ? c->row_k + c->row_v : 0);
        const int64_t want = 96 + (4 * T + 4) + (8 + 4 * T + 4) + (int64_t)n_attn * (2 * 24 + T * row) +
                             (int64_t)n_rec * (12 + 4 * (c ? c->n_state : 0)) + (4 * (int64_t)n_vocab + 4);
        CHECK(b && (int64_t)n == want && (get32(b + OFF_FLAGS) & KVR_KV_FILE_ATTN_ONLY), "the file has %zu bytes (flags 0x%x), the attention "
              "layers' rows, the states and the logits make %lld", n, b ? get32(b + OFF_FLAGS) : 0, (long long)want);
        // a file of an older kvr: rows (zeros) for the recurrent layers too, no ATTN_ONLY flag; it
        // loads, those rows skipped, and continues as the file of the attention layers does
        set_case("hybrid: an older file with rows for every layer");
        if (b && (int64_t)n == want && c) {
            const int64_t layers_at = 96 + (4 * T + 4) + (8 + 4 * T + 4);
            const size_t chunk = 24 + (size_t)T * c->row_k; // the K and the V chunk alike: same types here
            KVR_ASSERT(c->row_k == c->row_v);
            uint8_t * o = calloc(n + (size_t)n_rec * 2 * chunk, 1);
            size_t at = (size_t)layers_at;
            memcpy(o, b, at);
            put32(o + OFF_FLAGS, get32(o + OFF_FLAGS) & ~(uint32_t)KVR_KV_FILE_ATTN_ONLY);
            mend_header(o);
            size_t from = (size_t)layers_at;
            for (int il = 0; il < L; il++) {
                if (!kvr_layer_recurrent(&m->hp, il)) { // this layer's K and V chunks as they are
                    memcpy(o + at, b + from, 2 * chunk);
                    at += 2 * chunk;
                    from += 2 * chunk;
                    continue;
                }
                for (int kind = 0; kind < 2; kind++, at += chunk) {
                    const uint32_t ch[5] = { (uint32_t)il, 0, (uint32_t)kind, 0, (uint32_t)T };
                    for (int j = 0; j < 5; j++) put32(o + at + 4 * j, ch[j]);
                    put32(o + at + chunk - 4, kvr_crc32c(0, o + at, chunk - 4));
                }
            }
            memcpy(o + at, b + from, n - from);
            at += n - from;
            write_all(tmp_path("hybrid-old.kv"), o, at);
            free(o);
            struct kvr_session * x = new_session(m, 96), * y = new_session(m, 96);
            CHECK(kvr_session_kv_load(x, path) == KVR_OK, "the new file: %s", kvr_last_error());
            CHECK(kvr_session_kv_load(y, tmp_path("hybrid-old.kv")) == KVR_OK, "the older file: %s", kvr_last_error());
            int32_t ix[4], iy[4];
            CHECK(run_greedy(x, 4, ix, la, n_vocab) && run_greedy(y, 4, iy, lb, n_vocab) && !memcmp(ix, iy, sizeof(ix)) &&
                  !memcmp(la, lb, sizeof(float) * (size_t)n_vocab * 4), "the older file continues otherwise than the new one");
            kvr_session_free(x);
            kvr_session_free(y);
        }
        free(b);
        kvr_session_free(a);
    }
    set_case("hybrid: a damaged state is refused");
    {
        struct kvr_session * a = new_session(m, 96);
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL && kvr_session_kv_save(a, tmp_path("hybrid.kv"), false) == KVR_OK,
              "save: %s", kvr_last_error());
        size_t n = 0;
        uint8_t * b = read_all(tmp_path("hybrid.kv"), &n);
        // the last state ends before the logits (n_vocab floats and a CRC): one bit of its data
        const size_t at = n - 4 * (size_t)n_vocab - 4 - 4 - 64;
        if (b && n > at) {
            b[at] ^= 0x10;
            write_all(tmp_path("hybrid-bad.kv"), b, n);
            struct kvr_session * c = new_session(m, 96);
            CHECK(kvr_session_kv_load(c, tmp_path("hybrid-bad.kv")) == KVR_ERR_FORMAT && strstr(kvr_last_error(), "recurrent state of layer 2"),
                  "a flipped bit in the state: %s", kvr_last_error());
            printf("  hybrid damage refused as it should: %s\n", kvr_last_error());
            kvr_session_free(c);
        }
        free(b);
        kvr_session_free(a);
    }
    set_case("hybrid: a failed eval");
    {
        // refused before it computes (past the context): the cache is kept and goes on as before
        struct kvr_session * a = new_session(m, 32), * b = new_session(m, 32);
        int32_t ids[40];
        for (int i = 0; i < 40; i++) ids[i] = prompt[i % N_PROMPT];
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) && kvr_session_eval(b, prompt, N_PROMPT), "prefill: %s", kvr_last_error());
        CHECK(kvr_session_eval(b, ids, 40) == NULL && kvr_session_n_past(b) == N_PROMPT, "40 more tokens in a context of 32: %s",
              kvr_last_error());
        const float * la1 = kvr_session_eval(a, prompt, 4);
        if (la1) memcpy(la, la1, sizeof(float) * (size_t)n_vocab);
        const float * lb1 = kvr_session_eval(b, prompt, 4);
        CHECK(la1 && lb1 && memcmp(la, lb1, sizeof(float) * (size_t)n_vocab) == 0, "after the refused eval the cache differs");
        kvr_session_free(a);
        kvr_session_free(b);
        // interrupted while it computes a second turn on a slow ring: the states had moved, so the
        // cache is forgotten, said so, and the prompt again gives the first turn's logits, bit for bit
        const struct kvr_session_params dp = { .strategy = KVR_STRATEGY_RING_KV, .n_ranks = 2, .n_threads = 1, .n_ctx = 96,
                                               .link_gbps = 0.002, .timeout_s = 60 };
        struct kvr_session * s = kvr_session_new(m, &dp);
        const float * want = s ? kvr_session_eval(s, prompt, N_PROMPT) : NULL;
        if (want) memcpy(la, want, sizeof(float) * (size_t)n_vocab);
        CHECK(want != NULL, "the first turn: %s", kvr_last_error());
        if (want) {
            struct interrupted_eval e = { .s = s, .ids = ids, .n = 40 };
            pthread_t th;
            CHECK(pthread_create(&th, NULL, interrupted_eval_run, &e) == 0, "pthread_create");
            const struct timespec wait = { 0, 150 * 1000 * 1000 }; // the turn takes about 0.7 s: 9 states at 250 kB/s
            nanosleep(&wait, NULL);
            kvr_session_interrupt(s, true);
            pthread_join(th, NULL);
            CHECK(e.logits == NULL && strstr(e.err, "interrupted") && strstr(e.err, "forgotten") && kvr_session_n_past(s) == 0,
                  "the interrupted turn: %s, %d tokens kept", e.logits ? "it ended" : e.err, kvr_session_n_past(s));
            if (verbose) printf("  %s\n", e.err);
            const float * got = kvr_session_eval(s, prompt, N_PROMPT);
            CHECK(got && memcmp(la, got, sizeof(float) * (size_t)n_vocab) == 0, "the prompt after the interrupt differs: %s",
                  got ? "logits" : kvr_last_error());
        }
        kvr_session_free(s);
    }
    set_case("hybrid: streaming, P/D and replication refused");
    {
        const struct kvr_session_params ps[3] = {
            { .n_ranks = 2, .strategy = KVR_STRATEGY_KVR, .kv_stream = tmp_path("hybrid-stream.kv") },
            { .n_ranks = 2, .strategy = KVR_STRATEGY_KVR, .pd = true, .decode_rank = 1 },
            { .n_ranks = 2, .strategy = KVR_STRATEGY_KVR, .replicate = true },
        };
        for (int i = 0; i < 3; i++) {
            struct kvr_session * d = kvr_session_new(m, &ps[i]);
            CHECK(d == NULL && strstr(kvr_last_error(), "recurrent layers"), "params %d: accepted, or '%s'", i, kvr_last_error());
            kvr_session_free(d);
        }
    }
    free(la);
    free(lb);
    free(scratch);
}

//
// streaming during the prefill, and prefill/decode disaggregation
//

static void test_stream_pd(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab, N = 16;
    const enum kvr_strategy strats[] = { KVR_STRATEGY_SINGLE, KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV,
                                         KVR_STRATEGY_RING_Q, KVR_STRATEGY_AUTO };
    const int64_t cache_bytes = 2 * (int64_t)m->hp.n_layer * N_PROMPT * m->hp.head_dim * m->hp.n_head_kv * (int64_t)sizeof(float);
    float * la = malloc(sizeof(float) * (size_t)n_vocab * N), * lb = malloc(sizeof(float) * (size_t)n_vocab * N);
    float * lr = malloc(sizeof(float) * (size_t)n_vocab * N);
    // the reference: one rank
    struct kvr_session * ref = new_dist(m, KVR_STRATEGY_SINGLE, 1);
    int32_t iref[N];
    CHECK(kvr_session_eval(ref, prompt, N_PROMPT) != NULL && dist_greedy(ref, N, iref, lr, n_vocab), "reference");
    kvr_session_free(ref);
    for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
        for (int nr = 1; nr <= 4; nr++) {
            if (strats[si] == KVR_STRATEGY_SINGLE && nr > 1) continue;
            set_case("stream %s x%d: the streamed file equals the saved one", kvr_strategy_name(strats[si]), nr);
            char sp[640], vp[640];
            snprintf(sp, sizeof(sp), "%s", tmp_path("streamed.kv"));
            snprintf(vp, sizeof(vp), "%s", tmp_path("saved.kv"));
            struct kvr_session_params p = { KVR_TEST_F32_CACHE, .strategy = strats[si], .n_ranks = nr, .n_threads = 1, .n_ctx = 96, .timeout_s = 30,
                                         .kv_stream = sp };
            struct kvr_session * a = kvr_session_new(m, &p);
            CHECK(a != NULL, "dist: %s", kvr_last_error());
            if (!a) continue;
            CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
            CHECK(kvr_session_kv_save(a, vp, false) == KVR_OK, "save: %s", kvr_last_error());
            CHECK(same_file(sp, vp), "the streamed file differs from the saved one");
            struct kvr_rank_stats st[8];
            const int ns = kvr_session_stats(a, st, 8);
            int64_t streamed = 0;
            for (int i = 0; i < ns; i++) streamed += st[i].kv_stream_bytes;
            CHECK(streamed == cache_bytes, "%lld bytes streamed, the cache has %lld", (long long)streamed, (long long)cache_bytes);
            // the stream was the first prefill's: a decode step writes nothing
            remove(sp);
            const int32_t tok = 5;
            CHECK(kvr_session_eval(a, &tok, 1) != NULL && access(sp, F_OK) != 0, "a decode step streamed again");
            kvr_session_free(a);
        }
        for (int nr = 2; nr <= 4; nr++) {
            set_case("P/D %s: %d prefill ranks, decode on rank %d", kvr_strategy_name(strats[si]), nr - 1, nr - 1);
            struct kvr_session_params p = { KVR_TEST_F32_CACHE, .strategy = strats[si], .n_ranks = nr, .n_threads = 1, .n_ctx = 96, .timeout_s = 30,
                                         .pd = true, .decode_rank = nr - 1 };
            struct kvr_session * a = kvr_session_new(m, &p);
            CHECK(a != NULL, "dist: %s", kvr_last_error());
            if (!a) continue;
            CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
            struct kvr_rank_stats st[8];
            const int ns = kvr_session_stats(a, st, 8);
            int64_t got = -1;
            for (int i = 0; i < ns; i++) {
                if (st[i].rank == nr - 1) got = st[i].kv_stream_bytes;
                if (st[i].rank == nr - 1) CHECK(st[i].tokens == 0, "the decode rank computed %d prompt tokens", st[i].tokens);
            }
            CHECK(got == cache_bytes, "the decode rank received %lld bytes, the cache has %lld", (long long)got, (long long)cache_bytes);
            int32_t ia[N];
            CHECK(dist_greedy(a, N, ia, la, n_vocab), "decode: %s", kvr_last_error());
            CHECK(memcmp(ia, iref, sizeof(ia)) == 0, "the continuation differs from one rank's");
            double worst = 0;
            for (int i = 0; i < n_vocab * N; i++) worst = fabs(la[i] - lr[i]) > worst ? fabs(la[i] - lr[i]) : worst;
            CHECK(worst <= 1e-4, "logits %g from one rank's", worst);
            // the decode rank holds the whole cache: a save is the chain's whole cache, and for
            // the chain strategies the same run without disaggregation on the prefill ranks gives
            // the same logits bit for bit (the same rows, decoded by one rank over all of them)
            if (!(strats[si] == KVR_STRATEGY_RING_KV || strats[si] == KVR_STRATEGY_RING_Q || strats[si] == KVR_STRATEGY_AUTO)) {
                struct kvr_session * b = new_dist(m, strats[si], nr - 1);
                int32_t ib[N];
                CHECK(kvr_session_eval(b, prompt, N_PROMPT) != NULL && dist_greedy(b, N, ib, lb, n_vocab), "without P/D");
                CHECK(memcmp(la, lb, sizeof(float) * (size_t)n_vocab * N) == 0, "P/D logits differ from the same strategy's on %d ranks", nr - 1);
                kvr_session_free(b);
            }
            char vp[640];
            snprintf(vp, sizeof(vp), "%s", tmp_path("pd.kv"));
            CHECK(kvr_session_kv_save(a, vp, false) == KVR_OK, "save after P/D: %s", kvr_last_error());
            struct kvr_session * s = new_session(m, 96);
            CHECK(kvr_session_kv_load(s, vp) == KVR_OK && kvr_session_n_past(s) == N_PROMPT + N, "the P/D cache into a session");
            kvr_session_free(s);
            kvr_session_free(a);
        }
    }
    set_case("P/D: refused setups");
    struct kvr_session_params p = { KVR_TEST_F32_CACHE, .strategy = KVR_STRATEGY_KVR, .n_ranks = 3, .pd = true, .decode_rank = 1 };
    CHECK(kvr_session_new(m, &p) == NULL && strstr(kvr_last_error(), "last"), "decode rank 1 of 3: %s", kvr_last_error());
    p.n_ranks = 1;
    p.decode_rank = 0;
    CHECK(kvr_session_new(m, &p) == NULL && strstr(kvr_last_error(), "2 ranks"), "P/D on 1 rank: %s", kvr_last_error());
    free(la);
    free(lb);
    free(lr);
}

// A cache over several ranks swapped out and back (host memory, then a file) continues as one
// never swapped, bit for bit; while it is out evals and truncations fail; a swap file replaced by
// another conversation's cache is refused and the cache stays out until its own file is back.
static void test_swap_ranks(const struct kvr_model * m) {
    const enum kvr_strategy strat[] = { KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV };
    const int n_vocab = (int)m->hp.n_vocab;
    enum { N = 6 };
    for (size_t si = 0; si < sizeof(strat) / sizeof(strat[0]); si++) {
        set_case("swap with 3 ranks, %s", kvr_strategy_name(strat[si]));
        const struct kvr_session_params dp = { KVR_TEST_F32_CACHE, .strategy = strat[si], .n_ranks = 3, .n_threads = 1, .n_ctx = 64 };
        struct kvr_session * a = kvr_session_new(m, &dp);
        CHECK(a && kvr_session_eval(a, prompt, N_PROMPT) != NULL, "the reference prefill: %s", kvr_last_error());
        if (!a) continue;
        int32_t ia[N];
        float * la = malloc(sizeof(float) * (size_t)n_vocab * N), * lc = malloc(sizeof(float) * (size_t)n_vocab * N);
        CHECK(run_greedy(a, N, ia, la, n_vocab), "the reference continues");
        for (int k = 0; k < 2; k++) {
            struct kvr_session * c = kvr_session_new(m, &dp);
            CHECK(c && kvr_session_eval(c, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
            if (!c) continue;
            const char * sp = k ? tmp_path("swap-ranks.kv") : NULL;
            CHECK(kvr_session_kv_swap_out(c, sp) == KVR_OK && kvr_session_kv_swapped(c), "swap out: %s", kvr_last_error());
            CHECK(kvr_session_eval(c, prompt, 1) == NULL && strstr(kvr_last_error(), "swapped out"), "eval while out: %s", kvr_last_error());
            CHECK(kvr_session_truncate(c, 2) != KVR_OK && strstr(kvr_last_error(), "swapped out"), "truncate while out: %s", kvr_last_error());
            if (sp) {
                // another conversation's cache in the swap file's place: refused, still out
                char keep[1100];
                snprintf(keep, sizeof(keep), "%s.keep", sp);
                CHECK(rename(sp, keep) == 0, "rename the swap file");
                struct kvr_session * o = kvr_session_new(m, &dp);
                CHECK(o && kvr_session_eval(o, prompt + 1, N_PROMPT - 1) != NULL && kvr_session_kv_save(o, sp, false) == KVR_OK,
                      "another cache: %s", kvr_last_error());
                kvr_session_free(o);
                CHECK(kvr_session_kv_swap_in(c) != KVR_OK && strstr(kvr_last_error(), "other tokens") && kvr_session_kv_swapped(c),
                      "another conversation's swap file taken: %s", kvr_last_error());
                CHECK(rename(keep, sp) == 0, "the swap file back");
            }
            CHECK(kvr_session_kv_swap_in(c) == KVR_OK && !kvr_session_kv_swapped(c), "swap in: %s", kvr_last_error());
            if (sp) CHECK(access(sp, F_OK) != 0, "the swap file is left behind");
            int32_t ic[N];
            CHECK(run_greedy(c, N, ic, lc, n_vocab), "continues after the swap");
            CHECK(memcmp(ia, ic, sizeof(ia)) == 0 && memcmp(la, lc, sizeof(float) * (size_t)n_vocab * N) == 0,
                  "swap to %s: the continuation differs", k ? "a file" : "memory");
            kvr_session_free(c);
        }
        free(la);
        free(lc);
        kvr_session_free(a);
    }
}

static void test_interrupt(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab;
    set_case("interrupt before an eval");
    struct kvr_session * ref = new_session(m, 64), * s = new_session(m, 64);
    const float * want = kvr_session_eval(ref, prompt, N_PROMPT);
    kvr_session_interrupt(s, true);
    CHECK(kvr_session_eval(s, prompt, N_PROMPT) == NULL && strstr(kvr_last_error(), "interrupted"), "the eval ran: %s",
          kvr_last_error());
    CHECK(kvr_session_n_past(s) == 0 && kvr_session_logits(s) == NULL, "the interrupted eval left %d tokens", kvr_session_n_past(s));
    kvr_session_interrupt(s, true);
    kvr_session_interrupt(s, false); // withdrawn before an eval took it
    const float * got = kvr_session_eval(s, prompt, N_PROMPT);
    CHECK(want && got && memcmp(want, got, sizeof(float) * (size_t)n_vocab) == 0, "the next eval differs: %s", kvr_last_error());
    kvr_session_free(s);
    kvr_session_free(ref);

    set_case("interrupt during a prefill on 3 ranks");
    enum { T = 192 };
    int32_t ids[T];
    for (int i = 0; i < T; i++) ids[i] = prompt[i % N_PROMPT];
    // about 0.1 s a layer's hop: the prefill lasts a second or more, each wait a fraction of it
    const struct kvr_session_params dp = { KVR_TEST_F32_CACHE, .strategy = KVR_STRATEGY_KVR, .n_ranks = 3, .n_threads = 1, .n_ctx = 256,
                                           .link_gbps = 0.004 };
    ref = kvr_session_new(m, &dp);
    double t0 = kvr_time_ms();
    want = ref ? kvr_session_eval(ref, ids, T) : NULL;
    const double full_ms = kvr_time_ms() - t0;
    CHECK(want != NULL, "the uninterrupted prefill: %s", kvr_last_error());
    s = kvr_session_new(m, &dp);
    if (!want || !s) {
        kvr_session_free(s);
        kvr_session_free(ref);
        return;
    }
    struct interrupted_eval e = { .s = s, .ids = ids, .n = T };
    pthread_t th;
    t0 = kvr_time_ms();
    CHECK(pthread_create(&th, NULL, interrupted_eval_run, &e) == 0, "pthread_create");
    const struct timespec wait = { (time_t)(full_ms / 8e3), (long)(fmod(full_ms / 8, 1e3) * 1e6) };
    nanosleep(&wait, NULL);
    kvr_session_interrupt(s, true);
    pthread_join(th, NULL);
    const double ms = kvr_time_ms() - t0;
    CHECK(e.logits == NULL && strstr(e.err, "interrupted"), "the prefill was not interrupted: %s", e.logits ? "it ended" : e.err);
    CHECK(ms < full_ms / 2, "interrupted after %.0f ms of a %.0f ms prefill", ms, full_ms);
    CHECK(kvr_session_n_past(s) == 0, "the interrupted prefill left %d tokens", kvr_session_n_past(s));
    got = kvr_session_eval(s, ids, T);
    CHECK(got && memcmp(want, got, sizeof(float) * (size_t)n_vocab) == 0, "the prefill after the interrupt differs: %s",
          got ? "logits" : kvr_last_error());
    if (verbose) printf("  interrupted after %.0f ms of a %.0f ms prefill\n", ms, full_ms);
    kvr_session_free(s);
    kvr_session_free(ref);
}

//
// files: the one writer (kvr_file_create/commit) under the ways a path can be attacked or raced
//

struct saver {
    struct kvr_session * s;
    const char         * path;
    pthread_barrier_t  * go;
    int                  rc;
    char                 err[512];
};

static void * saver_thread(void * arg) {
    struct saver * sv = arg;
    pthread_barrier_wait(sv->go);
    sv->rc = kvr_session_kv_save(sv->s, sv->path, false);
    snprintf(sv->err, sizeof(sv->err), "%s", sv->rc == KVR_OK ? "" : kvr_last_error());
    return NULL;
}

//
// ranks: how many a prompt gives work to (kvr_useful_ranks), and what a session refuses
//

static void test_useful_ranks(const struct kvr_model * m) {
    set_case("ranks: kvr_useful_ranks gives the most ranks that each get a token");
    const enum kvr_strategy strats[] = { KVR_STRATEGY_SINGLE, KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV,
                                         KVR_STRATEGY_RING_Q, KVR_STRATEGY_AUTO };
    int wrong = 0;
    char first[256] = "";
    for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
        const enum kvr_strategy st = strats[si];
        const bool ring = st == KVR_STRATEGY_RING_KV || st == KVR_STRATEGY_RING_Q || st == KVR_STRATEGY_AUTO;
        for (int T = 1; T <= 40; T++) {
            for (int n = 1; n <= 24; n++) {
                const int u = kvr_useful_ranks(st, T, n, false);
                // k ranks all get a token of T: the split's own counts
                bool fits[25] = { false };
                for (int k = 1; k <= n; k++) {
                    if (st == KVR_STRATEGY_SINGLE) fits[k] = k == 1;
                    else if (!ring) fits[k] = k <= T;
                    else {
                        fits[k] = true;
                        for (int r = 0; r < k; r++) fits[k] &= kvr_ring_shard(T, 0, k, r, NULL) > 0;
                    }
                }
                int want = 1;
                for (int k = 1; k <= n; k++) if (fits[k]) want = k;
                const int pd = kvr_useful_ranks(st, T, n + 1, true);
                if ((u != want || pd != want + 1) && wrong++ == 0) {
                    snprintf(first, sizeof(first), "%s T=%d n=%d: %d (P/D %d), want %d", kvr_strategy_name(st), T, n, u, pd, want);
                }
            }
        }
    }
    CHECK(wrong == 0, "%d counts differ from the splits' (first: %s)", wrong, first);
    // the finding's case, and the rings' counts that are not monotonic in the prompt
    CHECK(kvr_useful_ranks(KVR_STRATEGY_RING_KV, 4, 64, false) == 4, "ring-kv, 4 tokens, 64 ranks: %d", kvr_useful_ranks(KVR_STRATEGY_RING_KV, 4, 64, false));
    CHECK(kvr_useful_ranks(KVR_STRATEGY_RING_KV, 5, 4, false) == 3, "ring-kv, 5 tokens, 4 ranks: %d", kvr_useful_ranks(KVR_STRATEGY_RING_KV, 5, 4, false));
    CHECK(kvr_useful_ranks(KVR_STRATEGY_KVR, 3, 9, true) == 4, "kvr P/D, 3 tokens, 9 ranks: %d", kvr_useful_ranks(KVR_STRATEGY_KVR, 3, 9, true));

    set_case("ranks: a session of more ranks than its context can give a token is refused");
    struct kvr_session_params p = { .strategy = KVR_STRATEGY_RING_KV, .n_ranks = 64, .n_threads = 1, .n_ctx = 16 };
    struct kvr_session * s = kvr_session_new(m, &p);
    CHECK(!s && strstr(kvr_last_error(), "64 ranks: a context of 16 tokens gives ring-kv work to at most 16"), "ring-kv x64, n_ctx 16: %s",
          s ? "accepted" : kvr_last_error());
    kvr_session_free(s);
    p = (struct kvr_session_params) { .strategy = KVR_STRATEGY_KVR, .n_ranks = 6, .n_threads = 1, .n_ctx = 4, .pd = true, .decode_rank = 5 };
    s = kvr_session_new(m, &p);
    CHECK(!s && strstr(kvr_last_error(), "6 ranks: a context of 4 tokens gives kvr work to at most 5"), "kvr P/D x6, n_ctx 4: %s",
          s ? "accepted" : kvr_last_error());
    kvr_session_free(s);
    // as many as the context fills; single (the last rank alone) and a given split are theirs
    set_case("ranks: what a session accepts");
    const int part[5] = { 4, 0, 0, 0, 0 };
    const struct kvr_session_params ok[] = {
        { .strategy = KVR_STRATEGY_RING_KV, .n_ranks = 16, .n_threads = 1, .n_ctx = 16 },
        { .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 5, .n_threads = 1, .n_ctx = 4 },
        { .strategy = KVR_STRATEGY_KVR, .n_ranks = 5, .n_threads = 1, .n_ctx = 4, .partition = part },
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        s = kvr_session_new(m, &ok[i]);
        CHECK(s != NULL, "%s x%d, n_ctx %d: %s", kvr_strategy_name(ok[i].strategy), ok[i].n_ranks, ok[i].n_ctx, kvr_last_error());
        kvr_session_free(s);
    }
}

// does path name something (lstat: a link itself)?
static bool exists(const char * path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

static bool has_text(const char * path, const char * text) {
    size_t n = 0;
    uint8_t * b = read_all(path, &n);
    const bool same = b && n == strlen(text) && memcmp(b, text, n) == 0;
    free(b);
    return same;
}

// A writer killed before its commit leaves its temporary; the next writer of the target removes
// it, and nothing else: not a live writer's, not a link or a hard link planted under such a name
// (nor what they point to), not a directory or a FIFO, not a name of another form.
static void test_dead_writers(void) {
    set_case("files: a killed writer's temporary is removed by the next writer of the path, nothing else is");
    char target[640], victim[640], victim2[700];
    snprintf(target, sizeof(target), "%s", tmp_path("dead.kv"));
    snprintf(victim, sizeof(victim), "%s", tmp_path("victim-dead.txt"));
    snprintf(victim2, sizeof(victim2), "%s", tmp_path("victim-dead2.txt"));
    write_all(victim, "victim one\n", 11);
    write_all(victim2, "victim two\n", 11);
    int fds[2];
    CHECK(pipe(fds) == 0, "pipe: %s", strerror(errno));
    const pid_t pid = fork();
    if (pid == 0) { // the writer that dies half way: its temporary's name to the parent, then SIGKILL
        close(fds[0]);
        struct kvr_file * kf;
        if (kvr_file_create(&kf, target) != KVR_OK) _exit(1);
        fputs("half a file", kvr_file_stream(kf));
        fflush(kvr_file_stream(kf));
        const char * t = kvr_file_temp_path(kf);
        if (write(fds[1], t, strlen(t)) != (ssize_t)strlen(t)) _exit(1);
        close(fds[1]);
        raise(SIGKILL);
        _exit(1);
    }
    close(fds[1]);
    char dead[700] = "";
    const ssize_t nr = read(fds[0], dead, sizeof(dead) - 1);
    close(fds[0]);
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
          "the writer did not die by SIGKILL (status %d)", status);
    dead[nr > 0 ? nr : 0] = 0;
    CHECK(nr > 0 && exists(dead), "the killed writer left no temporary ('%s')", dead);

    // the names of temporaries that are not a dead writer's own file
    char link_tmp[700], hard_tmp[700], dir_tmp[700], fifo_tmp[700], upper[700], plain[700], longer[700];
    snprintf(link_tmp, sizeof(link_tmp), "%s.aaaaaaaaaaaa.part", target);
    snprintf(hard_tmp, sizeof(hard_tmp), "%s.bbbbbbbbbbbb.part", target);
    snprintf(dir_tmp, sizeof(dir_tmp), "%s.cccccccccccc.part", target);
    snprintf(fifo_tmp, sizeof(fifo_tmp), "%s.ffffffffffff.part", target);
    snprintf(upper, sizeof(upper), "%s.DDDDDDDDDDDD.part", target);
    snprintf(plain, sizeof(plain), "%s.part", target);
    snprintf(longer, sizeof(longer), "%s.eeeeeeeeeeee.part.x", target);
    CHECK(symlink(victim, link_tmp) == 0, "symlink: %s", strerror(errno));
    CHECK(link(victim2, hard_tmp) == 0, "link: %s", strerror(errno));
    CHECK(mkdir(dir_tmp, 0700) == 0, "mkdir: %s", strerror(errno));
    CHECK(mkfifo(fifo_tmp, 0600) == 0, "mkfifo: %s", strerror(errno));
    write_all(upper, "x", 1);
    write_all(plain, "x", 1);
    write_all(longer, "x", 1);

    struct kvr_file * live, * next;
    CHECK(kvr_file_create(&live, target) == KVR_OK, "a live writer: %s", kvr_last_error());
    fputs("the live writer's file", kvr_file_stream(live));
    CHECK(kvr_file_create(&next, target) == KVR_OK, "the next writer: %s", kvr_last_error());
    fputs("the next writer's file", kvr_file_stream(next));
    CHECK(!exists(dead), "the killed writer's temporary is still there: %s", dead);
    CHECK(exists(kvr_file_temp_path(live)), "a live writer's temporary was removed");
    CHECK(kvr_file_commit(next) == KVR_OK && has_text(target, "the next writer's file"), "the next writer's commit: %s", kvr_last_error());
    CHECK(kvr_file_commit(live) == KVR_OK && has_text(target, "the live writer's file"), "the live writer's commit: %s", kvr_last_error());
    struct stat st;
    CHECK(lstat(link_tmp, &st) == 0 && S_ISLNK(st.st_mode) && has_text(victim, "victim one\n"), "the planted link or its target was touched");
    CHECK(lstat(hard_tmp, &st) == 0 && st.st_nlink == 2 && has_text(victim2, "victim two\n"), "the planted hard link or its file was touched");
    CHECK(lstat(dir_tmp, &st) == 0 && S_ISDIR(st.st_mode), "the directory named like a temporary was removed");
    CHECK(lstat(fifo_tmp, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO named like a temporary was removed");
    CHECK(exists(upper) && exists(plain) && exists(longer), "a name of another form was removed");
    // dead.kv itself, the 4 planted entries, the 3 names of other forms
    CHECK(count_prefixed("dead.kv") == 8, "%d entries named dead.kv*, want 8", count_prefixed("dead.kv"));
}

static void test_files(const struct kvr_model * m) {
    set_case("files: a link planted at PATH.part redirects no save and no stream");
    const char victim_text[] = "the victim's own bytes\n";
    char victim[640], target[640], part[700];
    snprintf(victim, sizeof(victim), "%s", tmp_path("victim.txt"));
    snprintf(target, sizeof(target), "%s", tmp_path("planted.kv"));
    snprintf(part, sizeof(part), "%s.part", target);
    write_all(victim, victim_text, sizeof(victim_text) - 1);
    CHECK(symlink(victim, part) == 0, "symlink: %s", strerror(errno));
    struct kvr_session * a = new_session(m, 64);
    CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
    CHECK(kvr_session_kv_save(a, target, false) == KVR_OK, "save: %s", kvr_last_error());
    size_t n = 0;
    uint8_t * v = read_all(victim, &n);
    CHECK(v && n == sizeof(victim_text) - 1 && memcmp(v, victim_text, n) == 0, "the save wrote through the link into its target");
    free(v);
    struct kvr_session * b = new_session(m, 64);
    CHECK(kvr_session_kv_load(b, target) == KVR_OK && kvr_session_n_past(b) == N_PROMPT, "the saved file: %s", kvr_last_error());
    kvr_session_free(b);
    {   // --kv-stream writes through the same writer
        char stream[640], spart[700];
        snprintf(stream, sizeof(stream), "%s", tmp_path("planted-stream.kv"));
        snprintf(spart, sizeof(spart), "%s.part", stream);
        CHECK(symlink(victim, spart) == 0, "symlink: %s", strerror(errno));
        struct kvr_session * st = kvr_session_new(m, &(struct kvr_session_params) { KVR_TEST_F32_CACHE, .n_ctx = 64, .n_threads = 1, .kv_stream = stream });
        CHECK(st && kvr_session_eval(st, prompt, N_PROMPT) != NULL, "streamed prefill: %s", kvr_last_error());
        kvr_session_free(st);
        v = read_all(victim, &n);
        CHECK(v && n == sizeof(victim_text) - 1 && memcmp(v, victim_text, n) == 0, "the stream wrote through the link into its target");
        free(v);
        b = new_session(m, 64);
        CHECK(kvr_session_kv_load(b, stream) == KVR_OK, "the streamed file: %s", kvr_last_error());
        kvr_session_free(b);
    }
    CHECK(count_prefixed("planted.kv.") == 1 && count_prefixed("planted-stream.kv.") == 1,
          "temporaries left: %d and %d entries besides the planted links", count_prefixed("planted.kv.") - 1,
          count_prefixed("planted-stream.kv.") - 1);

    set_case("files: 4 savers of one path at once, 30 times");
    enum { N_SAVERS = 4, N_TRIALS = 30 };
    char race[640];
    snprintf(race, sizeof(race), "%s", tmp_path("race.kv"));
    struct kvr_session * ss[N_SAVERS];
    for (int i = 0; i < N_SAVERS; i++) {
        ss[i] = new_session(m, 64);
        CHECK(kvr_session_eval(ss[i], prompt, N_PROMPT - i) != NULL, "prefill %d: %s", i, kvr_last_error());
    }
    int failed_saves = 0, bad_files = 0;
    char first_err[512] = "";
    for (int t = 0; t < N_TRIALS; t++) {
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, N_SAVERS);
        pthread_t th[N_SAVERS];
        struct saver sv[N_SAVERS];
        for (int i = 0; i < N_SAVERS; i++) {
            sv[i] = (struct saver) { .s = ss[i], .path = race, .go = &go };
            pthread_create(&th[i], NULL, saver_thread, &sv[i]);
        }
        for (int i = 0; i < N_SAVERS; i++) {
            pthread_join(th[i], NULL);
            if (sv[i].rc != KVR_OK && failed_saves++ == 0) snprintf(first_err, sizeof(first_err), "%s", sv[i].err);
        }
        pthread_barrier_destroy(&go);
        b = new_session(m, 64);
        if (kvr_session_kv_load(b, race) != KVR_OK && bad_files++ == 0 && !first_err[0]) {
            snprintf(first_err, sizeof(first_err), "%s", kvr_last_error());
        }
        kvr_session_free(b);
    }
    CHECK(failed_saves == 0, "%d of %d saves failed (first: %s)", failed_saves, N_SAVERS * N_TRIALS, first_err);
    CHECK(bad_files == 0, "%d of %d files left by the savers do not load (first: %s)", bad_files, N_TRIALS, first_err);
    CHECK(count_prefixed("race.kv") == 1, "%d temporaries left", count_prefixed("race.kv") - 1);
    for (int i = 0; i < N_SAVERS; i++) kvr_session_free(ss[i]);

    set_case("files: a save onto a full disk fails and leaves the old file");
    size_t n_old = 0;
    uint8_t * old = read_all(target, &n_old);
    struct rlimit rl, small;
    struct sigaction ign = { .sa_handler = SIG_IGN }, was;
    sigaction(SIGXFSZ, &ign, &was); // a write past the limit then fails with EFBIG instead of killing
    getrlimit(RLIMIT_FSIZE, &rl);
    small = rl;
    small.rlim_cur = 4096;
    CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0, "setrlimit: %s", strerror(errno));
    const int rc = kvr_session_kv_save(a, target, false);
    const int err = errno;
    setrlimit(RLIMIT_FSIZE, &rl);
    sigaction(SIGXFSZ, &was, NULL);
    CHECK(rc == KVR_ERR_IO && strstr(kvr_last_error(), "planted.kv"), "a save past the disk's end: %d, %s (errno %s)", rc, kvr_last_error(),
          strerror(err));
    v = read_all(target, &n);
    CHECK(old && v && n == n_old && memcmp(v, old, n) == 0, "the old file changed");
    CHECK(count_prefixed("planted.kv.") == 1, "the temporary is left behind");
    free(old);
    free(v);
    kvr_session_free(a);
    test_dead_writers();
}

// A file of another cache type than the session's loads converted: an F32 session's file into an
// F16 and a BF16 session (every row rounded to that type, as a store would), and an F16 session's
// file into an F32 one (every row widened exactly); each continues with a decode step. The files
// hold the rows in their session's type: the F16 file's layers are half the F32 one's.
static void test_other_type(const struct kvr_model * m) {
    const int kv_dim = (int)(m->hp.head_dim * m->hp.n_head_kv), L = (int)m->hp.n_layer;
    static const enum kvr_cache_type from[3] = { KVR_CACHE_F32, KVR_CACHE_F32, KVR_CACHE_F16 };
    static const enum kvr_cache_type into[3] = { KVR_CACHE_F16, KVR_CACHE_BF16, KVR_CACHE_F32 };
    int64_t size[KVR_CACHE_TYPE_COUNT] = { 0 };
    for (int c = 0; c < 3; c++) {
        set_case("a %s file into a %s session", kvr_cache_type_name(from[c]), kvr_cache_type_name(into[c]));
        struct kvr_session * a = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = 64, .n_threads = 1,
                                                     .cache_type_k = from[c], .cache_type_v = from[c] });
        struct kvr_session * b = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = 64, .n_threads = 1,
                                                     .cache_type_k = into[c], .cache_type_v = into[c] });
        CHECK(a && b, "sessions: %s", kvr_last_error());
        if (!a || !b) { kvr_session_free(a); kvr_session_free(b); continue; }
        const char * path = tmp_path("typed.kv");
        CHECK(kvr_session_eval(a, prompt, N_PROMPT) != NULL && kvr_session_kv_save(a, path, false) == KVR_OK, "save: %s", kvr_last_error());
        size_t n = 0;
        free(read_all(path, &n));
        size[from[c]] = (int64_t)n;
        CHECK(kvr_session_kv_load(b, path) == KVR_OK, "load: %s", kvr_last_error());
        CHECK(kvr_session_n_past(b) == N_PROMPT, "%d tokens after the load", kvr_session_n_past(b));
        const struct kvr_kv_cache * ca = one_cache(a), * cb = one_cache(b);
        float * x = malloc(sizeof(float) * (size_t)kv_dim * N_PROMPT), * y = malloc(sizeof(float) * (size_t)kv_dim * N_PROMPT);
        uint8_t * raw = malloc(4 * (size_t)kv_dim * N_PROMPT), * want = malloc(4 * (size_t)kv_dim * N_PROMPT);
        bool same = true;
        for (int il = 0; il < L; il++) {
            for (int kind = 0; kind < 2; kind++) {
                kvr_kv_cache_get_rows(kvr_session_backend(a, 0), ca, il, 0, N_PROMPT, kind ? NULL : raw, kind ? raw : NULL);
                kvr_kv_rows_to_float(kind ? ca->type_v : ca->type_k, raw, x, N_PROMPT, kv_dim);
                // what b must hold: a's rows in b's type
                kvr_kv_rows_from_float(kind ? cb->type_v : cb->type_k, x, want, N_PROMPT, kv_dim);
                kvr_kv_cache_get_rows(kvr_session_backend(b, 0), cb, il, 0, N_PROMPT, kind ? NULL : raw, kind ? raw : NULL);
                same = same && memcmp(raw, want, (kind ? cb->row_v : cb->row_k) * N_PROMPT) == 0;
                kvr_kv_rows_to_float(kind ? cb->type_v : cb->type_k, raw, y, N_PROMPT, kv_dim);
            }
        }
        CHECK(same, "the loaded rows are not the file's rows in the session's type");
        const int32_t tok = 5;
        CHECK(kvr_session_eval(b, &tok, 1) != NULL, "a decode step after the load: %s", kvr_last_error());
        free(x); free(y); free(raw); free(want);
        kvr_session_free(a);
        kvr_session_free(b);
    }
    set_case("a typed file's size");
    // the header, tokens, shard table and logits are the same; the rows are half as many bytes
    const int64_t rows32 = (int64_t)L * 2 * N_PROMPT * kv_dim * 4;
    CHECK(size[KVR_CACHE_F32] - size[KVR_CACHE_F16] == rows32 / 2, "F32 file %lld bytes, F16 %lld: %lld apart, %lld expected",
          (long long)size[KVR_CACHE_F32], (long long)size[KVR_CACHE_F16], (long long)(size[KVR_CACHE_F32] - size[KVR_CACHE_F16]), (long long)(rows32 / 2));
}

// tiny-phi3 (original context 4096): a cache saved in a context of 4096 (short factors) is refused
// by a session of 8192 (long ones) and loads into one of 1024; one saved at 8192 is refused at 4096
// and loads at 4097 (rounded up to 4352, past 4096: long); a replication log likewise
static void test_rope_factors(const struct kvr_model * m) {
    const int ctx[4] = { 4096, 8192, 1024, 4097 };
    struct kvr_session * s[4];
    for (int i = 0; i < 4; i++) s[i] = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = ctx[i], .n_threads = 1 });
    set_case("tiny-phi3: a cache of short LongRoPE factors into a context of long ones");
    CHECK(s[0] && s[1] && s[2] && s[3], "sessions: %s", kvr_last_error());
    if (!s[0] || !s[1] || !s[2] || !s[3]) { for (int i = 0; i < 4; i++) kvr_session_free(s[i]); return; }
    CHECK(!kvr_model_rope_long(m, 4096) && kvr_model_rope_long(m, 4097) && kvr_model_rope_long(m, 8192), "the factors' choice by context");
    const char * short_path = tmp_path("phi3-4096.kv"), * long_path = tmp_path("phi3-8192.kv");
    CHECK(kvr_session_eval(s[0], prompt, N_PROMPT) && kvr_session_kv_save(s[0], short_path, false) == KVR_OK, "save at 4096: %s",
          kvr_last_error());
    CHECK(kvr_session_eval(s[1], prompt, N_PROMPT) && kvr_session_kv_save(s[1], long_path, false) == KVR_OK, "save at 8192: %s",
          kvr_last_error());
    // the two caches do differ: the same prompt's last logits under either set of factors
    const float * la = kvr_session_logits(s[0]), * lb = kvr_session_logits(s[1]);
    CHECK(la && lb && memcmp(la, lb, sizeof(float) * m->hp.n_vocab) != 0, "the factors change nothing");
    kvr_session_truncate(s[1], 0);
    int rc = kvr_session_kv_load(s[1], short_path);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "phi3-4096.kv: the cache's keys took phi3's short LongRoPE factors (a context of at "
          "most 4096 tokens); this session's context of 8192 tokens takes the long ones") && kvr_session_n_past(s[1]) == 0,
          "short into long: %d %s", rc, kvr_last_error());
    CHECK(kvr_session_kv_load(s[2], short_path) == KVR_OK && kvr_session_n_past(s[2]) == N_PROMPT, "short into 1024: %s", kvr_last_error());
    set_case("tiny-phi3: a cache of long LongRoPE factors into a context of short ones");
    kvr_session_truncate(s[0], 0);
    rc = kvr_session_kv_load(s[0], long_path);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "the cache's keys took phi3's long LongRoPE factors (a context past 4096 tokens); "
          "this session's context of 4096 tokens takes the short ones") && kvr_session_n_past(s[0]) == 0, "long into short: %d %s", rc,
          kvr_last_error());
    CHECK(kvr_session_kv_load(s[3], long_path) == KVR_OK && kvr_session_n_past(s[3]) == N_PROMPT, "long into 4097: %s", kvr_last_error());
    for (int i = 0; i < 4; i++) kvr_session_free(s[i]);
    set_case("tiny-phi3: a replication log of short LongRoPE factors resumed in a context of long ones");
    const char * dir = tmp_path("phi3-logs");
    struct kvr_session * w = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = 4096, .n_threads = 1, .replicate_dir = dir });
    CHECK(w && kvr_session_eval(w, prompt, N_PROMPT), "logged run: %s", kvr_last_error());
    kvr_session_free(w);
    struct kvr_session * r = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = 8192, .n_threads = 1 });
    struct kvr_resume_info ri;
    rc = r ? kvr_session_resume(r, dir, prompt, N_PROMPT, &ri) : KVR_OK;
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "rank-0.kvlog: the log's keys took phi3's short LongRoPE factors") &&
          kvr_session_n_past(r) == 0, "resume: %d %s", rc, kvr_last_error());
    kvr_session_free(r);
    r = kvr_session_new(m, &(struct kvr_session_params) { .n_ctx = 2048, .n_threads = 1 });
    CHECK(r && kvr_session_resume(r, dir, prompt, N_PROMPT, &ri) == KVR_OK && kvr_session_n_past(r) == N_PROMPT, "resume at 2048: %s",
          kvr_last_error());
    kvr_session_free(r);
}

int main(int argc, char ** argv) {
    const char * shared = "../shared";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) verbose = true;
        else shared = argv[i];
    }
    snprintf(tmp_dir, sizeof(tmp_dir), "%s/kvr-test-kvcache-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmp_dir)) { perror("mkdtemp"); return 2; }
    test_crc();
    char path[1024], other[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared);
    snprintf(other, sizeof(other), "%s/reference/tiny-llama-Q8_0.gguf", shared);
    struct kvr_model * m = access(path, R_OK) == 0 ? kvr_model_load(path, NULL) : NULL;
    if (!m) {
        skip("%s is missing: the model cases are skipped", path);
    } else {
        test_session(m);
        test_shards(m);
        test_malformed(m, access(other, R_OK) == 0 ? other : NULL);
        test_weights(m, path);
        test_dist(m);
        test_swap_ranks(m);
        test_interrupt(m);
        test_stream_pd(m);
        test_files(m);
        test_useful_ranks(m);
        test_other_type(m);
        kvr_model_free(m);
    }
    snprintf(path, sizeof(path), "%s/reference/archs-next/tiny-qwen35.gguf", shared);
    struct kvr_model * hybrid = access(path, R_OK) == 0 ? kvr_model_load(path, NULL) : NULL;
    if (!hybrid) skip("%s is missing: the hybrid cases are skipped", path);
    else test_hybrid(hybrid);
    kvr_model_free(hybrid);
    snprintf(path, sizeof(path), "%s/reference/archs-next/tiny-phi3.gguf", shared);
    struct kvr_model * phi3 = access(path, R_OK) == 0 ? kvr_model_load(path, NULL) : NULL;
    if (!phi3) skip("%s is missing: the LongRoPE cases are skipped", path);
    else test_rope_factors(phi3);
    kvr_model_free(phi3);
    char cmd[700];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp_dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp_dir);
    return check_summary("kvcache");
}
