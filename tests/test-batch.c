// tests/test-batch.c - kvr_session_eval_batch, the continuous batch of kvr-server: one decode
// token of several sessions in one graph must give each session what its own decode gives (the
// same greedy ids, logits within 1e-5), whatever the sessions' lengths, order and number, and the
// same token after a batch as after a solo decode (the cache rows it stored are the right ones).
// Its refusals leave every session as it was: the same session twice, a swapped-out cache, a
// token outside the vocabulary, an interrupt.
//
// Models: SmolLM2-135M-Instruct (models/gguf, or $KVR_SMOLLM2), stories260K (SHARED/models) and six
// tiny architectures of SHARED/reference (windows, soft-caps, experts, sinks, and the hybrids, whose
// recurrent state steps on per session); each is skipped, saying so, where its file is not there.
// SmolLM2 and stories260K run with an F32 cache and with the default F16 one, held to the same bound:
// the F16 cache rounds K, V, the query and the probabilities, which turns a last-bit difference
// before them into a whole F16 step (the batch's small F32 products once summed in another order
// than a solo decode's gave ~3e-3 here). Every model runs twice: exact (f32 activations), and with
// 8-bit activations (kvr-server's and kvr-run's default), where each session's logits must be its
// solo decode's to the last bit (memcmp): the batch's matmuls take each token through the one-token
// kernels. And the batch must be one graph on the first session's backend: the spans the backends
// trace are all there, none on the other sessions' backends (a batch made of solo evals, each on
// its session's backend, would pass the rest).
//
//   test-batch [SHARED]

#define KVR_BUILD
#include "kvr.h"
#include "tests/check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define N_SEQ   5
#define N_STEPS 9

static const char * const prompts[N_SEQ] = {
    "The capital of France is",
    "Once upon a time, there was a little girl who liked to walk in the forest. One day",
    "1, 2, 3,",
    "A",
    "Here is a short poem about the sea and the wind that blows over it:",
};

static float max_diff(const float * a, const float * b, int n) {
    float d = 0.0f;
    for (int i = 0; i < n; i++) {
        const float e = fabsf(a[i] - b[i]);
        if (!(e <= d)) d = e; // a NaN makes it NaN
    }
    return d;
}

#define BATCH_TOL 1e-5f
static enum kvr_cache_type g_cache; // this pass's cache type
static bool g_q8;                   // this pass's arithmetic: 8-bit activations, else exact

// the spans a session's backend traced since the last call (which turns its trace on and clears them)
static int spans_since(const struct kvr_session * s) {
    struct kvr_backend * be = kvr_session_backend(s, 0);
    int n;
    kvr_backend_set_trace(be, true);
    kvr_backend_spans(be, &n, true);
    return n;
}

static struct kvr_session * prefilled(const struct kvr_model * m, const char * text) {
    struct kvr_session * s = kvr_session_new(m, &(struct kvr_session_params){ .n_ctx = 256, .n_threads = 2,
                                                                              .cache_type_k = g_cache, .cache_type_v = g_cache,
                                                                              .q8_activations = g_q8 });
    if (!s) return NULL;
    int32_t ids[256];
    const int n = kvr_tokenize(kvr_model_vocab(m), text, ids, 256, kvr_vocab_add_bos(kvr_model_vocab(m)), false);
    if (n <= 0 || n > 200 || !kvr_session_eval(s, ids, n)) {
        kvr_session_free(s);
        return NULL;
    }
    return s;
}

static void check_model(const char * name, const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        skip("%s: %s is not there", name, path);
        return;
    }
    fclose(f);
    struct kvr_model * m = kvr_model_load(path, NULL);
    CHECK(m != NULL, "%s: load: %s", name, kvr_last_error());
    if (!m) return;
    const int n_vocab = (int)m->hp.n_vocab;
    struct kvr_session * batch[N_SEQ], * solo[N_SEQ];
    bool made = true;
    for (int i = 0; i < N_SEQ; i++) {
        batch[i] = prefilled(m, prompts[i]);
        solo[i] = prefilled(m, prompts[i]);
        made &= batch[i] && solo[i];
    }
    CHECK(made, "%s: sessions prefilled: %s", name, kvr_last_error());
    if (!made) goto out;

    // the batches of each step: all five, then fewer in another order, one alone, and so on
    static const int members[N_STEPS][N_SEQ + 1] = {
        { 5, 0, 1, 2, 3, 4 }, { 5, 0, 1, 2, 3, 4 }, { 3, 4, 2, 0 }, { 3, 4, 2, 0 }, { 1, 3 }, { 5, 4, 3, 2, 1, 0 },
        { 2, 1, 0 }, { 2, 1, 0 }, { 5, 2, 0, 4, 1, 3 },
    };
    // a step with the sessions of the step before, in the same order, runs the graph its first
    // session kept (no layer with a sliding window: those build every step, as a solo decode does)
    bool windows = false;
    for (uint32_t il = 0; il < m->hp.n_layer; il++) windows |= m->layers[il].window > 0;
    for (int step = 0; step < N_STEPS; step++) {
        set_case("%s step %d", name, step);
        const int n = members[step][0];
        struct kvr_session * group[N_SEQ];
        int32_t toks[N_SEQ];
        for (int j = 0; j < n; j++) {
            const int i = members[step][1 + j];
            group[j] = batch[i];
            toks[j] = kvr_argmax(kvr_session_logits(batch[i]), n_vocab);
            const int32_t solo_tok = kvr_argmax(kvr_session_logits(solo[i]), n_vocab);
            CHECK(toks[j] == solo_tok, "sequence %d: the batch's next id %d, solo's %d", i, toks[j], solo_tok);
        }
        for (int j = 0; j < n; j++) spans_since(group[j]);
        struct kvr_rank_stats st0, st1;
        kvr_session_stats(group[0], &st0, 1);
        const int rc = kvr_session_eval_batch(group, toks, n);
        CHECK(rc == KVR_OK, "a batch of %d: %s", n, kvr_last_error());
        if (rc != KVR_OK) break;
        kvr_session_stats(group[0], &st1, 1);
        // session 0's stats are the batch's: its tokens, its graph's times
        CHECK(st1.tokens == n && st1.matmul_ms > 0 && st1.attn_ms > 0 && st1.matmul_ms + st1.attn_ms <= st1.compute_ms &&
              st1.compute_ms <= st1.ttft_ms, "session 0's stats after a batch of %d: %d tokens, matmul %g ms, attention %g ms, "
              "compute %g ms, eval %g ms", n, st1.tokens, st1.matmul_ms, st1.attn_ms, st1.compute_ms, st1.ttft_ms);
        const bool again = step > 0 && memcmp(members[step], members[step - 1], sizeof(members[step])) == 0;
        const int64_t built = st1.graphs_built - st0.graphs_built, reused = st1.graphs_reused - st0.graphs_reused;
        if (windows) {
            CHECK(built == 0 && reused == 0, "sliding windows: no graph kept (%lld built, %lld reused)", (long long)built, (long long)reused);
        } else {
            CHECK(built == !again && reused == again, "%s: %lld graphs built, %lld reused", again ? "the sessions of the step before" :
                  "other sessions than the step before", (long long)built, (long long)reused);
        }
        const int batch_spans = spans_since(group[0]);
        int others = 0;
        for (int j = 1; j < n; j++) others += spans_since(group[j]);
        for (int j = 0; j < n; j++) {
            const int i = members[step][1 + j];
            const float * lg = kvr_session_eval(solo[i], &toks[j], 1);

            CHECK(lg != NULL, "sequence %d solo: %s", i, kvr_last_error());
            if (!lg) continue;
            const float d = max_diff(kvr_session_logits(batch[i]), lg, n_vocab);
            if (g_q8) {
                CHECK(memcmp(kvr_session_logits(batch[i]), lg, sizeof(float) * (size_t)n_vocab) == 0,
                      "sequence %d: logits differ from its solo decode's bits (by up to %g)", i, (double)d);
            } else {
                CHECK(d <= BATCH_TOL, "sequence %d: logits differ by %g from its solo decode", i, (double)d);
            }
            CHECK(kvr_session_n_past(batch[i]) == kvr_session_n_past(solo[i]), "sequence %d: n_past %d, solo %d", i,
                  kvr_session_n_past(batch[i]), kvr_session_n_past(solo[i]));
            CHECK(memcmp(kvr_session_tokens(batch[i]), kvr_session_tokens(solo[i]), sizeof(int32_t) * (size_t)kvr_session_n_past(solo[i])) == 0,
                  "sequence %d: the cached tokens are the solo decode's", i);
        }
        CHECK(batch_spans > 0 && others == 0, "one graph: %d spans on the first session's backend, %d on the others'",
              batch_spans, others);
    }

    // refusals: nothing changes
    set_case("%s refusals", name);
    int past[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) past[i] = kvr_session_n_past(batch[i]);
    struct kvr_session * twice[2] = { batch[0], batch[0] };
    int32_t two[2] = { 1, 2 };
    CHECK(kvr_session_eval_batch(twice, two, 2) == KVR_ERR_ARG && strstr(kvr_last_error(), "twice"),
          "the same session twice is refused: %s", kvr_last_error());
    struct kvr_session * pair[2] = { batch[1], batch[2] };
    int32_t bad[2] = { 1, n_vocab };
    CHECK(kvr_session_eval_batch(pair, bad, 2) == KVR_ERR_ARG && strstr(kvr_last_error(), "vocabulary"),
          "a token outside the vocabulary is refused: %s", kvr_last_error());
    CHECK(kvr_session_eval_batch(pair, two, 0) == KVR_ERR_ARG, "an empty batch is refused");
    CHECK(kvr_session_kv_swap_out(batch[2], NULL) == KVR_OK, "swap out: %s", kvr_last_error());
    CHECK(kvr_session_eval_batch(pair, two, 2) == KVR_ERR_ARG && strstr(kvr_last_error(), "swapped"),
          "a swapped-out session is refused: %s", kvr_last_error());
    CHECK(kvr_session_kv_swap_in(batch[2]) == KVR_OK, "swap in: %s", kvr_last_error());
    kvr_session_interrupt(batch[2], true);
    CHECK(kvr_session_eval_batch(pair, two, 2) == KVR_ERR_INTERRUPTED, "an interrupt stops the batch: %s", kvr_last_error());
    for (int i = 0; i < N_SEQ; i++) {
        CHECK(kvr_session_n_past(batch[i]) == past[i], "session %d: n_past %d after the refusals, %d before", i,
              kvr_session_n_past(batch[i]), past[i]);
    }
    // and the batch goes on after them, as the solo decodes do
    {
        int32_t toks[2] = { kvr_argmax(kvr_session_logits(batch[1]), n_vocab), kvr_argmax(kvr_session_logits(batch[2]), n_vocab) };
        CHECK(kvr_session_eval_batch(pair, toks, 2) == KVR_OK, "a batch after the refusals: %s", kvr_last_error());
        for (int j = 0; j < 2; j++) {
            const float * lg = kvr_session_eval(solo[1 + j], &toks[j], 1);
            const float d = lg ? max_diff(kvr_session_logits(batch[1 + j]), lg, n_vocab) : INFINITY;
            CHECK(g_q8 ? d == 0.0f : d <= BATCH_TOL, "sequence %d after the refusals: logits differ by %g", 1 + j, (double)d);
        }
    }
out:
    for (int i = 0; i < N_SEQ; i++) {
        kvr_session_free(batch[i]);
        kvr_session_free(solo[i]);
    }
    kvr_model_free(m);
    set_case("%s", "");
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    const char * smol = getenv("KVR_SMOLLM2");
    if (!smol || !*smol) smol = "models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf";
    char path[4096];
    for (int q8 = 0; q8 < 2; q8++) {
        g_q8 = q8;
        char name[128];
        for (int pass = 0; pass < 2; pass++) {
            g_cache = pass ? KVR_CACHE_F16 : KVR_CACHE_F32;
            snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared);
            snprintf(name, sizeof(name), "SmolLM2%s%s", pass ? " (F16 cache)" : "", q8 ? " q8" : "");
            check_model(name, smol);
            snprintf(name, sizeof(name), "stories260K%s%s", pass ? " (F16 cache)" : "", q8 ? " q8" : "");
            check_model(name, path);
        }
        // more architectures, F16 (default) cache: sliding windows and soft-capping (gemma3, gemma2),
        // experts (qwen3moe; gpt-oss with sinks and windows), and the hybrids, whose Gated DeltaNet
        // layers step each session's own recurrent state (qwen35, qwen35moe)
        g_cache = KVR_CACHE_F16;
        static const char * const more[] = { "archs/tiny-gemma3", "archs-next/tiny-gemma2", "archs-next/tiny-qwen3moe",
                                             "archs-next/tiny-gptoss", "archs-next/tiny-qwen35", "archs-next/tiny-qwen35moe" };
        for (size_t h = 0; h < sizeof(more) / sizeof(more[0]); h++) {
            snprintf(path, sizeof(path), "%s/reference/%s.gguf", shared, more[h]);
            snprintf(name, sizeof(name), "%s%s", strchr(more[h], '/') + 1, q8 ? " q8" : "");
            check_model(name, path);
        }
    }
    return check_summary("test-batch");
}
