// tests/test-load.c - loading refuses what it cannot run, with messages that say where:
//   - kvr_error_prefix, the one way to put a path or a flag in front of the last error, on
//     contexts short, long and longer than the message buffer;
//   - the messages of kvr_gguf_open and kvr_model_load for files at paths of ~20 to ~4000 bytes,
//     compared character for character with "<path>: <what the reader says without a path>"
//     (formatting the error buffer into itself, as kvr_error("%s: %s", path, kvr_last_error())
//     did, garbles exactly these);
//   - suspicious hyper-parameters (NaN, zero, negative or infinite epsilons, RoPE bases and scaling
//     factors; zero counts; head counts that do not divide) refused at load, naming the key;
//   - BOS and unknown-token ids outside the vocabulary refused, naming the key and the value.
// The model variants are copies of SHARED/models/stories260K.gguf with a key changed; without
// that file those cases are skipped.
//
//   test-load [SHARED]      (default ../shared)

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

//
// kvr_error_prefix
//

static void test_prefix(void) {
    int rc = kvr_error(KVR_ERR_IO, "inner %d", 7);
    CHECK(rc == KVR_ERR_IO, "kvr_error returns its code");
    rc = kvr_error_prefix(KVR_ERR_FORMAT, "ctx %s", "a.gguf");
    CHECK(rc == KVR_ERR_FORMAT, "kvr_error_prefix returns its code, got %d", rc);
    CHECK(strcmp(kvr_last_error(), "ctx a.gguf: inner 7") == 0, "'%s'", kvr_last_error());
    kvr_error_prefix(KVR_ERR_FORMAT, "%s", "outer");
    CHECK(strcmp(kvr_last_error(), "outer: ctx a.gguf: inner 7") == 0, "prefixed twice: '%s'", kvr_last_error());
    kvr_error(KVR_ERR_IO, "%s", "");
    kvr_error_prefix(KVR_ERR_IO, "p");
    CHECK(strcmp(kvr_last_error(), "p: ") == 0, "an empty error: '%s'", kvr_last_error());

    // contexts around and beyond the buffer: the result is a prefix of "<context>: <inner>",
    // as long as fits, and never garbled
    static const size_t lens[] = { 1, 100, 1000, 4000, 8000, 8185, 8190, 8191, 9000, 20000 };
    char * ctx = malloc(20001);
    char * want = malloc(20100);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        for (size_t k = 0; k < lens[i]; k++) ctx[k] = (char)('a' + k % 26);
        ctx[lens[i]] = 0;
        kvr_error(KVR_ERR_IO, "the inner message (%d)", 42);
        kvr_error_prefix(KVR_ERR_IO, "%s", ctx);
        snprintf(want, 20100, "%s: the inner message (42)", ctx);
        const size_t got = strlen(kvr_last_error()), full = strlen(want);
        const size_t exp = full < 8191 ? full : 8191;
        CHECK(got == exp && strncmp(kvr_last_error(), want, exp) == 0,
              "context of %zu bytes: %zu bytes of message, want the first %zu of '%.40s...'", lens[i], got, exp, want);
    }
    free(ctx);
    free(want);
}

//
// paths of several lengths
//

static char base_dir[512];

// base_dir/ddd.../ddd.../NAME with a total length near len (directories made on the way); NULL
// if it cannot be made
static char * long_path(size_t len, const char * name) {
    char * p = malloc(len + 512);
    snprintf(p, len + 512, "%s", base_dir);
    int level = 0;
    while (strlen(p) + 1 + strlen(name) + 200 < len) {
        size_t n = strlen(p);
        p[n++] = '/';
        for (int k = 0; k < 199; k++) p[n++] = (char)('0' + level % 10);
        p[n] = 0;
        level++;
        if (mkdir(p, 0700) != 0 && errno != EEXIST) { free(p); return NULL; }
    }
    size_t n = strlen(p);
    snprintf(p + n, len + 512 - n, "/%s", name);
    return p;
}

static void remove_tree(const char * file) {
    char * p = strdup(file);
    remove(p);
    for (char * s = strrchr(p, '/'); s && (size_t)(s - p) > strlen(base_dir); s = strrchr(p, '/')) {
        *s = 0;
        rmdir(p);
    }
    free(p);
}

// where two messages part (the shorter one's length when one is the start of the other)
static size_t first_diff(const char * a, const char * b) {
    size_t i = 0;
    while (a[i] && a[i] == b[i]) i++;
    return i;
}

static bool write_bytes(const char * path, const void * b, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) return false;
    const bool ok = fwrite(b, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

struct override {
    const char * key;
    enum kvr_gguf_type type;  // UINT32, FLOAT32 or STRING
    double       num;
    const char * str;
};

// A copy of g with up to two keys set to other values (or other types).
static bool write_variant(const struct kvr_gguf * g, const char * path, const struct override * ov, int n_ov) {
    struct kvr_gguf_writer * w = kvr_gguf_writer_new();
    kvr_gguf_copy_kv(w, g, "");
    for (int i = 0; i < n_ov; i++) {
        if (ov[i].type == KVR_GGUF_UINT32) kvr_gguf_set_u32(w, ov[i].key, (uint32_t)ov[i].num);
        else if (ov[i].type == KVR_GGUF_FLOAT32) kvr_gguf_set_f32(w, ov[i].key, (float)ov[i].num);
        else kvr_gguf_set_str(w, ov[i].key, ov[i].str);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct kvr_gguf_tensor * t = &g->tensors[i];
        kvr_gguf_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data);
    }
    const int rc = kvr_gguf_writer_save(w, path);
    kvr_gguf_writer_free(w);
    CHECK(rc == KVR_OK, "writing %s: %s", path, kvr_last_error());
    return rc == KVR_OK;
}

static void test_paths(const struct kvr_gguf * stories) {
    // a GGUF cut short after its header's counts: what the reader says of the bytes alone
    uint8_t bad[24] = { 'G', 'G', 'U', 'F', 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0 };
    CHECK(kvr_gguf_open_mem(bad, sizeof(bad)) == NULL, "a truncated GGUF was accepted");
    char cut[8192], inner[8192];
    snprintf(cut, sizeof(cut), "%s", kvr_last_error());
    CHECK(strstr(cut, "gguf") != NULL, "the reader's message: '%s'", cut);

    static const size_t lens[] = { 20, 300, 1500, 4000 };
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        char * path = long_path(lens[i], "cut.gguf");
        CHECK(path != NULL, "cannot make a path of %zu bytes under %s", lens[i], base_dir);
        if (!path) continue;
        CHECK(write_bytes(path, bad, sizeof(bad)), "writing %s", path);
        char * want = malloc(strlen(path) + strlen(cut) + 3);
        sprintf(want, "%s: %s", path, cut);
        CHECK(kvr_gguf_open(path) == NULL && strcmp(kvr_last_error(), want) == 0,
              "kvr_gguf_open at a path of %zu bytes: the message differs from byte %zu: '%.80s'", strlen(path),
              first_diff(kvr_last_error(), want), kvr_last_error() + first_diff(kvr_last_error(), want));
        CHECK(kvr_model_load(path, NULL) == NULL && strcmp(kvr_last_error(), want) == 0,
              "kvr_model_load at a path of %zu bytes: the message differs from byte %zu: '%.80s'", strlen(path),
              first_diff(kvr_last_error(), want), kvr_last_error() + first_diff(kvr_last_error(), want));
        free(want);
        remove_tree(path);
        free(path);

        if (!stories) continue;
        // a model whose block_count is a float: the model loader puts the path in front of what
        // the typed getter says
        path = long_path(lens[i], "f32-block-count.gguf");
        if (!path) continue;
        const struct override ov = { "llama.block_count", KVR_GGUF_FLOAT32, 5.0, NULL };
        if (write_variant(stories, path, &ov, 1)) {
            struct kvr_gguf * g = kvr_gguf_open(path);
            CHECK(g != NULL, "the variant does not open: %s", kvr_last_error());
            uint32_t u;
            if (g) {
                CHECK(kvr_gguf_get_u32(g, "llama.block_count", &u) != KVR_OK, "a float block_count read as an integer");
                snprintf(inner, sizeof(inner), "%s", kvr_last_error());
                kvr_gguf_close(g);
                CHECK(strstr(inner, "'llama.block_count'") != NULL, "the getter's message names the key: '%s'", inner);
                want = malloc(strlen(path) + strlen(inner) + 3);
                sprintf(want, "%s: %s", path, inner);
                CHECK(kvr_model_load(path, NULL) == NULL && strcmp(kvr_last_error(), want) == 0,
                      "kvr_model_load at a path of %zu bytes: the message differs from byte %zu: '%.80s'", strlen(path),
                      first_diff(kvr_last_error(), want), kvr_last_error() + first_diff(kvr_last_error(), want));
                free(want);
            }
        }
        remove_tree(path);
        free(path);
    }
}

//
// suspicious hyper-parameters
//

struct bad_case {
    const char    * what;
    struct override ov[2];
    int             n_ov;
    const char    * named;   // the key the message must name
};

static void test_values(const struct kvr_gguf * stories) {
    char path[600];
    snprintf(path, sizeof(path), "%s/variant.gguf", base_dir);
    // the copy as it is loads: the refusals below are the changed key's
    if (write_variant(stories, path, NULL, 0)) {
        struct kvr_model * m = kvr_model_load(path, NULL);
        CHECK(m != NULL, "the unchanged copy does not load: %s", kvr_last_error());
        kvr_model_free(m);
    }
    const char * eps = "llama.attention.layer_norm_rms_epsilon", * base = "llama.rope.freq_base";
    const char * heads = "llama.attention.head_count", * kv = "llama.attention.head_count_kv";
    const struct bad_case cases[] = {
        { "NaN epsilon", { { eps, KVR_GGUF_FLOAT32, NAN, NULL } }, 1, eps },
        { "zero epsilon", { { eps, KVR_GGUF_FLOAT32, 0.0, NULL } }, 1, eps },
        { "negative epsilon", { { eps, KVR_GGUF_FLOAT32, -1e-5, NULL } }, 1, eps },
        { "infinite epsilon", { { eps, KVR_GGUF_FLOAT32, INFINITY, NULL } }, 1, eps },
        { "zero RoPE base", { { base, KVR_GGUF_FLOAT32, 0.0, NULL } }, 1, base },
        { "NaN RoPE base", { { base, KVR_GGUF_FLOAT32, NAN, NULL } }, 1, base },
        { "negative RoPE base", { { base, KVR_GGUF_FLOAT32, -10000.0, NULL } }, 1, base },
        { "infinite RoPE scaling factor", { { "llama.rope.scaling.type", KVR_GGUF_STRING, 0, "linear" },
                                            { "llama.rope.scaling.factor", KVR_GGUF_FLOAT32, INFINITY, NULL } }, 2, "llama.rope.scaling.factor" },
        { "NaN RoPE scaling factor", { { "llama.rope.scaling.type", KVR_GGUF_STRING, 0, "linear" },
                                       { "llama.rope.scaling.factor", KVR_GGUF_FLOAT32, NAN, NULL } }, 2, "llama.rope.scaling.factor" },
        { "3 KV heads for 8 heads", { { kv, KVR_GGUF_UINT32, 3, NULL } }, 1, kv },
        { "16 KV heads for 8 heads", { { kv, KVR_GGUF_UINT32, 16, NULL } }, 1, kv },
        { "zero KV heads", { { kv, KVR_GGUF_UINT32, 0, NULL } }, 1, kv },
        { "7 heads for a width of 64", { { heads, KVR_GGUF_UINT32, 7, NULL } }, 1, heads },
        { "zero layers", { { "llama.block_count", KVR_GGUF_UINT32, 0, NULL } }, 1, "llama.block_count" },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct bad_case * c = &cases[i];
        if (!write_variant(stories, path, c->ov, c->n_ov)) continue;
        struct kvr_model * m = kvr_model_load(path, NULL);
        char quoted[128];
        snprintf(quoted, sizeof(quoted), "'%s'", c->named);
        CHECK(m == NULL && strstr(kvr_last_error(), quoted) && strncmp(kvr_last_error(), path, strlen(path)) == 0,
              "%s: %s; the message '%s' should start with the path and name %s", c->what, m ? "loaded" : "refused",
              m ? "" : kvr_last_error(), quoted);
        kvr_model_free(m);
    }
    // token ids outside the vocabulary of 512: refused, where the default would stand in for them
    // without a word (a BOS that add_bos puts before every prompt, an unknown-token id)
    const struct override ids[] = { { "tokenizer.ggml.bos_token_id", KVR_GGUF_UINT32, 512, NULL },
                                    { "tokenizer.ggml.unknown_token_id", KVR_GGUF_UINT32, 70000, NULL } };
    for (int i = 0; i < 2; i++) {
        if (!write_variant(stories, path, &ids[i], 1)) continue;
        struct kvr_model * m = kvr_model_load(path, NULL);
        char want[160];
        snprintf(want, sizeof(want), "%s = %.0f is not a token of this vocabulary (ids 0 to 511)", ids[i].key, ids[i].num);
        CHECK(m == NULL && strstr(kvr_last_error(), want) && strncmp(kvr_last_error(), path, strlen(path)) == 0,
              "%s out of range: %s '%s'", ids[i].key, m ? "loaded" : "refused", m ? "" : kvr_last_error());
        kvr_model_free(m);
    }
    remove(path);
}

// Where the weights live: read into memory of 2 MiB pages by default (where the kernel gives
// madvise'd memory transparent huge pages), left in the file's mapping with .mmap. Either way every
// byte of the data section, as the file has it, and the two loads compute the same logits.
static void test_weights_memory(const char * path) {
    struct kvr_model * mr = kvr_model_load(path, NULL);
    struct kvr_model * mm = kvr_model_load(path, &(struct kvr_model_params){ .mmap = true });
    CHECK(mr && mm, "%s does not load (read %s, mapped %s): %s", path, mr ? "ok" : "failed", mm ? "ok" : "failed", kvr_last_error());
    if (mr && mm) {
        FILE * f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
        char line[256] = "";
        const bool thp = f && fgets(line, sizeof(line), f) && (strstr(line, "[always]") || strstr(line, "[madvise]"));
        if (f) fclose(f);
        const size_t n = mr->weights->size, huge = (size_t)2 << 20;
        CHECK(mm->weights_read == 0, "--mmap: the weights were read into %zu bytes", mm->weights_read);
        CHECK(thp ? mr->weights_read >= n && mr->weights_read % huge == 0 && (uintptr_t)mr->weights->base % huge == 0
                  : mr->weights_read == 0,
              "default load (huge pages %s here): %zu bytes read for %zu of weights at %p", thp ? "on" : "off", mr->weights_read, n, mr->weights->base);
        // the file's data section, read here with stdio
        uint8_t * want = malloc(n);
        FILE * g = fopen(path, "rb");
        const bool got = want && g && fseek(g, (long)mr->gguf->data_offset, SEEK_SET) == 0 && fread(want, 1, n, g) == n;
        if (g) fclose(g);
        CHECK(got && memcmp(want, mr->weights->base, n) == 0 && memcmp(want, mm->weights->base, n) == 0,
              "the weights in memory differ from the file's %zu bytes of data", n);
        free(want);
        float lr[64], lm[64];
        const float * er = NULL, * em = NULL;
        struct kvr_session * sr = kvr_session_new(mr, &(struct kvr_session_params){ .n_ctx = 16, .n_threads = 1 });
        struct kvr_session * sm = kvr_session_new(mm, &(struct kvr_session_params){ .n_ctx = 16, .n_threads = 1 });
        const int32_t toks[3] = { 1, 403, 407 };
        if (sr && sm && (er = kvr_session_eval(sr, toks, 3)) != NULL) memcpy(lr, er, sizeof(lr));
        if (sr && sm && (em = kvr_session_eval(sm, toks, 3)) != NULL) memcpy(lm, em, sizeof(lm));
        CHECK(er && em && memcmp(lr, lm, sizeof(lr)) == 0, "read and mapped weights: the logits differ (%s)", er && em ? "both ran" : kvr_last_error());
        kvr_session_free(sr);
        kvr_session_free(sm);
    }
    kvr_model_free(mr);
    kvr_model_free(mm);
}

// Weights in tiles (kvr_model_params.no_tiles): on a build whose CPU kernels read them, a model
// read into memory has its 2D Q4_0 matrices tiled (kvr_model_describe counts them); each one,
// untiled, is the file's bytes, and every other byte is the file's. The fingerprint's weights hash
// is the same tiled, untiled and mapped; untiled and mapped give the same logits to the bit, tiled
// within 1e-4 of them (other kernels' sums) and the same greedy ids. A device copy
// (kvr_model_to_backend) gets the file's rows; a CPU copy shares the tiles.
static void test_tiles(const char * path) {
    struct kvr_model * mt = kvr_model_load(path, NULL);
    struct kvr_model * mu = kvr_model_load(path, &(struct kvr_model_params){ .no_tiles = true });
    struct kvr_model * mm = kvr_model_load(path, &(struct kvr_model_params){ .mmap = true });
    CHECK(mt && mu && mm, "%s does not load: %s", path, kvr_last_error());
    if (!mt || !mu || !mm) goto done;
    if (mt->n_tiled == 0) {
        skip("tiles: %s was not tiled here (no huge pages, or no AVX-512 VNNI build)", path);
        goto done;
    }
    char desc[512];
    kvr_model_describe(mt, desc, sizeof(desc));
    CHECK(mu->n_tiled == 0 && mm->n_tiled == 0 && strstr(desc, "matrices in tiles"), "tiles: %d tiled, %d with no_tiles, %d mapped; '%s'",
          mt->n_tiled, mu->n_tiled, mm->n_tiled, desc);
    const size_t n = mt->weights->size;
    uint8_t * want = malloc(n), * got = malloc(n);
    FILE * g = fopen(path, "rb");
    const bool ok = want && got && g && fseek(g, (long)mt->gguf->data_offset, SEEK_SET) == 0 && fread(want, 1, n, g) == n;
    if (g) fclose(g);
    CHECK(ok, "tiles: cannot read %s", path);
    if (ok) {
        memcpy(got, mt->weights->base, n);
        int untiled = 0;
        struct kvr_context * ctx = kvr_init(1u << 16, true);
        for (uint64_t i = 0; i < mt->gguf->n_tensors; i++) {
            const struct kvr_gguf_tensor * gt = &mt->gguf->tensors[i];
            bool tiled = false;
            for (int j = 0; j < mt->n_tiled; j++) tiled |= mt->tiled[j] == gt->offset;
            if (!tiled) continue;
            struct kvr_tensor * w = kvr_new_tensor(ctx, gt->type, gt->n_dims, gt->ne);
            w->data = got + gt->offset;
            w->flags = KVR_FLAG_PARAM | KVR_FLAG_TILED;
            CHECK(memcmp(got + gt->offset, want + gt->offset, gt->size) != 0, "tiles: '%s' kept the file's bytes", gt->name);
            kvr_weight_untile(w);
            untiled++;
        }
        kvr_free(ctx);
        CHECK(untiled == mt->n_tiled && memcmp(got, want, n) == 0 && memcmp(mu->weights->base, want, n) == 0,
              "tiles: the %d tiled matrices, untiled, and every other byte are not the file's", untiled);
    }
    free(want);
    free(got);
    CHECK(kvr_model_weights_hash(mt) == kvr_model_weights_hash(mu) && kvr_model_weights_hash(mt) == kvr_model_weights_hash(mm),
          "tiles: the weights hash differs tiled, untiled and mapped");
    float lg[3][512];
    const int32_t toks[5] = { 1, 403, 407, 42, 99 };
    struct kvr_model * ms[3] = { mt, mu, mm };
    bool ran = true;
    for (int k = 0; k < 3; k++) {
        struct kvr_session * s = kvr_session_new(ms[k], &(struct kvr_session_params){ .n_ctx = 16, .n_threads = 2, .q8_activations = true });
        const float * e = s ? kvr_session_eval(s, toks, 3) : NULL;
        if (e) e = kvr_session_eval(s, toks + 3, 1); // a decode step
        if (e) memcpy(lg[k], e, sizeof(lg[k]));
        ran &= e != NULL;
        kvr_session_free(s);
    }
    CHECK(ran && mt->hp.n_vocab == 512, "tiles: the three loads' sessions: %s", kvr_last_error());
    if (ran) {
        float worst = 0.0f, big = 0.0f;
        for (int i = 0; i < 512; i++) {
            worst = fmaxf(worst, fabsf(lg[0][i] - lg[1][i]));
            big = fmaxf(big, fabsf(lg[1][i]));
        }
        CHECK(memcmp(lg[1], lg[2], sizeof(lg[1])) == 0, "tiles: untiled and mapped weights: the logits differ");
        CHECK(worst <= 1e-4f * big && kvr_argmax(lg[0], 512) == kvr_argmax(lg[1], 512),
              "tiles: tiled weights' logits %g from the untiled ones' (largest %g), argmax %d and %d", (double)worst, (double)big,
              kvr_argmax(lg[0], 512), kvr_argmax(lg[1], 512));
    }
    struct kvr_backend * cpu = kvr_backend_cpu_new(1);
    struct kvr_model * wc = cpu ? kvr_model_to_backend(mt, cpu) : NULL;
    CHECK(wc && wc->tiles && wc->layers[0].wq->data == mt->layers[0].wq->data &&
          (wc->layers[0].wq->flags & KVR_FLAG_TILED) == (mt->layers[0].wq->flags & KVR_FLAG_TILED) &&
          (mt->layers[0].wq->flags & KVR_FLAG_TILED), "tiles: a CPU copy shares the tiles (%s)", wc ? "made" : kvr_last_error());
    kvr_model_free(wc);
    kvr_backend_free(cpu);
done:
    kvr_model_free(mt);
    kvr_model_free(mu);
    kvr_model_free(mm);
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    const char * tmp = getenv("TMPDIR");
    snprintf(base_dir, sizeof(base_dir), "%s/kvr-test-load-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(base_dir)) {
        fprintf(stderr, "test-load: cannot make a directory %s: %s\n", base_dir, strerror(errno));
        return 1;
    }
    test_prefix();
    char stories_path[1024];
    snprintf(stories_path, sizeof(stories_path), "%s/models/stories260K.gguf", shared);
    struct kvr_gguf * stories = kvr_gguf_open(stories_path);
    if (!stories) {
        skip("%s missing: the model variants are skipped", stories_path);
    }
    test_paths(stories);
    if (stories) test_values(stories);
    if (stories) test_weights_memory(stories_path);
    kvr_gguf_close(stories);
    char tiny_path[1024];
    snprintf(tiny_path, sizeof(tiny_path), "%s/reference/tiny-llama-Q4_0.gguf", shared);
    if (access(tiny_path, R_OK) == 0) test_tiles(tiny_path);
    else skip("%s missing: the tiled weights' load is skipped", tiny_path);
    rmdir(base_dir);
    return check_summary("load");
}
