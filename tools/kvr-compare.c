// tools/kvr-compare.c - a backend, a strategy and a rank count checked against the CPU reference:
// the same prompt is prefilled once on the CPU by one rank (the reference) and once as asked;
// the named intermediates of every layer (by default each layer's attention result and its
// output) are gathered from every rank by the absolute positions of their rows and compared by
// NMSE; then the last prompt token's logits (largest absolute difference), then -n greedy steps
// fed the reference's tokens, whose top-1 tokens must agree. Exit 1 when the logits differ by
// more than --tol (a default per backend and weight type) or a step disagrees; 2 for a bad
// command line, a file or a backend that cannot be had (no CUDA device: the message says so).
//
// This is what a user with a GPU runs first: kvr-compare -m model.gguf -p "..." --backend cuda.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "kvr-cli.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define CMP_MAX_NAMES 16

struct cmp_args {
    const char * model;
    const char * prompt;
    const char * tokens;
    const char * backend;        // a registered backend's name (NULL: cpu)
    int          device;
    int          strategy;       // enum kvr_strategy, as the choices are ordered
    int          n_ranks;
    int          n_steps;
    double       tol;
    bool         tol_set;
    const char * names;
    int          n_threads;
    int          n_ctx;
    int          attn_mode;      // enum kvr_attn_mode, as --attn's choices are ordered
    struct kvr_cli_cache cache;  // --cache-type, -ctk, -ctv: both runs'
    bool         verbose;
};

// One run's intermediates: per (layer, name), a row of ne0 floats per prompt position.
struct cmp_capture {
    pthread_mutex_t mu;
    bool            on;          // the prefill only: decode steps add nothing
    int             n_layer, n_names, n_pos;
    const char    * names[CMP_MAX_NAMES];
    int64_t       * width;       // [layer][name]: row length (0: never seen)
    float        ** rows;        // [layer][name]: n_pos rows
    uint8_t      ** seen;        // [layer][name]: n_pos flags
    int             n_read_errors;
};

static void capture_got(void * user, const struct kvr_tensor * t, int layer, int name, const int32_t * pos, int n_pos) {
    struct cmp_capture * c = user;
    if (layer < 0 || layer >= c->n_layer || name < 0 || name >= c->n_names || t->type != KVR_TYPE_F32) return;
    pthread_mutex_lock(&c->mu);
    if (c->on) {
        const int k = layer * c->n_names + name;
        if (!c->rows[k]) {
            c->width[k] = t->ne[0];
            c->rows[k] = calloc((size_t)c->n_pos * (size_t)t->ne[0], sizeof(float));
            c->seen[k] = calloc((size_t)c->n_pos, 1);
        }
        const int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        if (t->ne[0] != c->width[k] || rows > n_pos || t->nb[0] != sizeof(float)) {
            c->n_read_errors++;
        } else {
            // one read of the whole tensor when its rows are packed (a device copies it in one go)
            const size_t row_bytes = (size_t)c->width[k] * sizeof(float);
            float * all = kvr_is_contiguous(t) ? malloc(row_bytes * (size_t)rows) : NULL;
            if (all) kvr_backend_tensor_get(t, all, 0, row_bytes * (size_t)rows);
            for (int64_t r = 0; r < rows; r++) {
                // a pruned tensor (the last layer of the rank with the logits) holds the last rows
                const int32_t p = pos[n_pos - rows + r];
                if (p < 0 || p >= c->n_pos) continue;
                float * dst = c->rows[k] + (size_t)p * (size_t)c->width[k];
                if (all) {
                    memcpy(dst, all + (size_t)r * (size_t)c->width[k], row_bytes);
                } else {
                    const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
                    kvr_backend_tensor_get(t, dst, (size_t)i1 * t->nb[1] + (size_t)i2 * t->nb[2] + (size_t)i3 * t->nb[3], row_bytes);
                }
                c->seen[k][p] = 1;
            }
            free(all);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static void capture_init(struct cmp_capture * c, int n_layer, int n_pos, const char * const * names, int n_names) {
    memset(c, 0, sizeof(*c));
    pthread_mutex_init(&c->mu, NULL);
    c->on = true;
    c->n_layer = n_layer;
    c->n_pos = n_pos;
    c->n_names = n_names;
    for (int i = 0; i < n_names; i++) c->names[i] = names[i];
    c->width = calloc((size_t)(n_layer * n_names), sizeof(int64_t));
    c->rows = calloc((size_t)(n_layer * n_names), sizeof(float *));
    c->seen = calloc((size_t)(n_layer * n_names), sizeof(uint8_t *));
}

static void capture_free(struct cmp_capture * c) {
    for (int k = 0; k < c->n_layer * c->n_names; k++) {
        free(c->rows[k]);
        free(c->seen[k]);
    }
    free(c->width);
    free(c->rows);
    free(c->seen);
    pthread_mutex_destroy(&c->mu);
}

// "1,2,3" -> ids; returns the count, or -1 after a message
static int parse_ids(const char * s, int32_t ** out) {
    int n = 0, cap = 64;
    int32_t * ids = malloc(sizeof(int32_t) * (size_t)cap);
    for (const char * p = s; *p;) {
        char * end;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "kvr-compare: --tokens: bad token id at character %d of '%s'\n", (int)(p - s) + 1, s);
            free(ids);
            return -1;
        }
        if (n == cap) ids = realloc(ids, sizeof(int32_t) * (size_t)(cap *= 2));
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "kvr-compare: --tokens: no token ids in '%s'\n", s);
        free(ids);
        return -1;
    }
    *out = ids;
    return n;
}

// The default tolerance of the last token's logits: what the backend's arithmetic leaves. CPU
// runs of other strategies and rank counts share every kernel (only summation orders move), so
// 1e-3; CUDA multiplies F32 weights in f32 (cuBLAS, another order) and every other type against
// activations rounded to F16 (BF16 for BF16 weights), which moves logits by a few hundredths to
// tenths. These CUDA values are estimates: they have not been measured on a GPU. An F16 or BF16
// V cache rounds the softmax's probabilities to that type after normalizing them over the keys
// (llama.cpp's arithmetic); the ring strategies normalize over a block's keys and merge, so their
// probabilities round elsewhere: 2e-2 (measured 5.6e-3 on stories260K, 7.5e-3 on tiny-llama3).
static double default_tol(const char * backend, enum kvr_type wtype, enum kvr_cache_type cv, enum kvr_strategy s) {
    const bool ring = s == KVR_STRATEGY_RING_KV || s == KVR_STRATEGY_RING_Q || s == KVR_STRATEGY_AUTO;
    if (!backend || strcmp(backend, "cpu") == 0) return ring && (cv == KVR_CACHE_F16 || cv == KVR_CACHE_BF16) ? 2e-2 : 1e-3;
    switch (wtype) {
        case KVR_TYPE_F32:  return 2e-2;
        case KVR_TYPE_BF16: return 0.5;
        default:            return 0.25;
    }
}

// the type that most of the weights are stored in (the FFN's)
static enum kvr_type weight_type(const struct kvr_model * m) {
    const struct kvr_layer * l = &m->layers[0];
    const struct kvr_tensor * w = l->ffn_down ? l->ffn_down : l->ffn_up ? l->ffn_up : l->wo;
    return w ? w->type : KVR_TYPE_F32;
}

// One run: a prefill of the prompt, then n_steps tokens: feed[s], or with make_feed the run's own
// greedy choice, written to feed[s] (the reference makes the tokens the checked run is fed).
// logits receives (1 + n_steps) rows of n_vocab.
struct cmp_run {
    const char        * label;
    const char        * backend;
    int                 device;
    enum kvr_strategy   strategy;
    int                 n_ranks;
    struct cmp_capture  cap;
    float             * logits;
};

static int run_once(const struct cmp_args * a, const struct kvr_model * model, struct cmp_run * r, const int32_t * ids,
                    int n_prompt, int32_t * feed, bool make_feed, int n_steps, int n_ctx) {
    const int n_vocab = (int)model->hp.n_vocab;
    struct kvr_capture cap = {
        .names = r->cap.names, .n_names = r->cap.n_names, .got = capture_got, .user = &r->cap,
    };
    struct kvr_session_params dp = {
        .strategy = r->strategy, .comm = KVR_COMM_LOCAL, .n_ranks = r->n_ranks, .n_threads = a->n_threads,
        .n_ctx = n_ctx, .attn_mode = (enum kvr_attn_mode)a->attn_mode, .backend = r->backend, .device = r->device,
        .capture = &cap, .cache_type_k = kvr_cli_cache_k(&a->cache), .cache_type_v = kvr_cli_cache_v(&a->cache),
    };
    struct kvr_session * d = kvr_session_new(model, &dp);
    if (!d) {
        fprintf(stderr, "kvr-compare: %s: %s\n", r->label, kvr_last_error());
        return 2;
    }
    const float * lg = kvr_session_eval(d, ids, n_prompt);
    int rc = KVR_OK;
    if (!lg) {
        fprintf(stderr, "kvr-compare: %s: the prefill failed: %s\n", r->label, kvr_last_error());
        rc = 1;
    } else {
        memcpy(r->logits, lg, sizeof(float) * (size_t)n_vocab);
        r->cap.on = false;
        for (int s = 0; s < n_steps && rc == KVR_OK; s++) {
            if (make_feed) feed[s] = kvr_argmax(r->logits + (size_t)s * (size_t)n_vocab, n_vocab);
            lg = kvr_session_eval(d, &feed[s], 1);
            if (!lg) {
                fprintf(stderr, "kvr-compare: %s: step %d failed: %s\n", r->label, s + 1, kvr_last_error());
                rc = 1;
                break;
            }
            memcpy(r->logits + (size_t)(s + 1) * (size_t)n_vocab, lg, sizeof(float) * (size_t)n_vocab);
        }
    }
    kvr_session_free(d);
    return rc;
}

static int parse_args(int argc, char ** argv, struct cmp_args * a) {
    *a = (struct cmp_args) { .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 1, .n_steps = 8,
                             .names = "attn,out" };
    bool strategy_set = false;
    char backend_help[1024];
    const struct kvr_cli_flag flags[] = {
        { .name = "-m", .alt = "--model", .kind = KVR_CLI_IN, .dst = &a->model, .meta = "FILE", .once = true, .help = "model (GGUF)" },
        { .name = "-p", .alt = "--prompt", .kind = KVR_CLI_TEXT, .dst = &a->prompt, .meta = "TEXT", .once = true, .help = "prompt text" },
        { .name = "--tokens", .kind = KVR_CLI_TEXT, .dst = &a->tokens, .meta = "LIST", .help = "prompt as comma-separated token ids (no BOS is added)" },
        { .name = "--backend", .kind = KVR_CLI_CUSTOM, .dst = &a->backend, .meta = "NAME", .parse = kvr_cli_backend,
          .help = kvr_cli_backend_help(backend_help, sizeof(backend_help), "the backend checked against the CPU (default cpu), one of:") },
        { .name = "--device", .kind = KVR_CLI_INT, .dst = &a->device, .meta = "N", .lo = 0, .hi = 1023,
          .help = "cuda: the first rank's GPU (rank r: N + r modulo the devices; default 0)" },
        { .name = "--strategy", .kind = KVR_CLI_CHOICE, .dst = &a->strategy, .meta = "S", .given = &strategy_set,
          .choices = "single|tsp|kvr|ring-kv|ring-q|auto", .help = "the checked run's strategy (default: single for 1 rank, kvr otherwise)" },
        { .name = "--ranks", .kind = KVR_CLI_INT, .dst = &a->n_ranks, .meta = "N", .lo = 1, .hi = 64,
          .help = "the checked run's ranks, threads of this process (default 1)" },
        { .name = "-n", .alt = "--steps", .kind = KVR_CLI_INT, .dst = &a->n_steps, .meta = "N", .lo = 0, .hi = 4096,
          .help = "greedy steps after the prompt, both runs fed the reference's tokens (default 8)" },
        { .name = "--tol", .kind = KVR_CLI_REAL, .dst = &a->tol, .meta = "X", .lo = 0, .hi = 1e6, .given = &a->tol_set,
          .help = "largest allowed difference of the last prompt token's logits (default: 1e-3 on\n"
                  "cpu; cuda: 2e-2 for f32 weights, 0.5 for bf16, 0.25 otherwise; 0: any difference fails)" },
        { .name = "--names", .kind = KVR_CLI_TEXT, .dst = &a->names, .meta = "LIST",
          .help = "the intermediates compared, by their names after \"blk.N.\" (default attn,out)" },
        { .name = "-t", .alt = "--threads", .kind = KVR_CLI_INT, .dst = &a->n_threads, .meta = "N", .lo = 1, .hi = KVR_MAX_THREADS,
          .help = "threads per rank (default: cores / ranks)" },
        { .name = "-c", .alt = "--ctx-size", .kind = KVR_CLI_INT, .dst = &a->n_ctx, .meta = "N", .lo = 0, .hi = 1 << 20,
          .help = "context (default: the prompt and the steps)" },
        { .name = "--attn", .kind = KVR_CLI_CHOICE, .dst = &a->attn_mode, .meta = "causal|dense", .choices = "causal|dense",
          .help = "attention kernel mode of both runs (default causal)" },
        KVR_CLI_CACHE_FLAGS(&a->cache),
        { .name = "-v", .alt = "--verbose", .kind = KVR_CLI_SWITCH, .dst = &a->verbose, .help = "every layer's NMSE, not only the worst ones" },
    };
    const struct kvr_cli cli = {
        .prog = "kvr-compare",
        .synopsis = "usage: kvr-compare -m MODEL.gguf (-p TEXT | --tokens LIST) [--backend NAME] [--strategy S --ranks N] [-n STEPS] [--tol X]",
        .about = "Runs the prompt on the CPU with one rank (the reference) and as asked, and compares the\n"
                 "intermediates of every layer (NMSE), the last prompt token's logits and -n greedy steps.\n"
                 "Exit 0: within --tol and every step agrees; 1: not; 2: bad command line, file or backend.",
        .flags = flags,
        .n_flags = (int)(sizeof(flags) / sizeof(flags[0])),
    };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) return rc;
    if (!a->model) return kvr_cli_fail(&cli, "no model: give -m FILE");
    if (!!a->prompt + !!a->tokens != 1) return kvr_cli_fail(&cli, "give exactly one of -p and --tokens");
    if (a->prompt && kvr_cli_check_text("kvr-compare", "-p", a->prompt, strlen(a->prompt))) return 2;
    if (!strategy_set) a->strategy = a->n_ranks > 1 ? KVR_STRATEGY_KVR : KVR_STRATEGY_SINGLE;
    if (a->strategy == KVR_STRATEGY_SINGLE && a->n_ranks > 1) return kvr_cli_fail(&cli, "--strategy single runs one rank, not %d", a->n_ranks);
    if (a->strategy != KVR_STRATEGY_SINGLE && a->n_ranks < 2) return kvr_cli_fail(&cli, "--strategy %s needs --ranks 2 or more", kvr_strategy_name((enum kvr_strategy)a->strategy));
    return 0;
}

int main(int argc, char ** argv) {
    kvr_blas_reexec(argv); // an OpenBLAS older than this CPU: its vector kernels, named before it loads them
    struct cmp_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;

    // the intermediates' names
    char names_buf[512];
    snprintf(names_buf, sizeof(names_buf), "%s", a.names);
    const char * names[CMP_MAX_NAMES];
    int n_names = 0;
    for (char * tok = strtok(names_buf, ","); tok; tok = strtok(NULL, ",")) {
        if (n_names == CMP_MAX_NAMES) {
            fprintf(stderr, "kvr-compare: --names: at most %d names\n", CMP_MAX_NAMES);
            return 2;
        }
        names[n_names++] = tok;
    }

    struct kvr_model * model = kvr_model_load(a.model, NULL);
    if (!model) {
        fprintf(stderr, "kvr-compare: %s\n", kvr_last_error());
        return 2;
    }
    const struct kvr_hparams * hp = &model->hp;
    const int n_vocab = (int)hp->n_vocab;
    int32_t * ids = NULL;
    int n_prompt;
    if (a.tokens) {
        n_prompt = parse_ids(a.tokens, &ids);
        for (int i = 0; i < n_prompt; i++) {
            if (ids[i] >= n_vocab) {
                fprintf(stderr, "kvr-compare: --tokens: id %d is not in the vocabulary of %d tokens\n", ids[i], n_vocab);
                n_prompt = -1;
            }
        }
    } else {
        const struct kvr_vocab * vocab = kvr_model_vocab(model);
        const bool bos = kvr_vocab_add_bos(vocab);
        const int need = kvr_tokenize(vocab, a.prompt, NULL, 0, bos, false);
        ids = malloc(sizeof(int32_t) * (size_t)(need > 0 ? need : 1));
        n_prompt = need > 0 ? kvr_tokenize(vocab, a.prompt, ids, need, bos, false) : 0;
        if (n_prompt <= 0) fprintf(stderr, "kvr-compare: the prompt has no tokens\n");
    }
    if (n_prompt <= 0 || n_prompt < a.n_ranks) {
        if (n_prompt > 0) fprintf(stderr, "kvr-compare: %d prompt tokens cannot be split over %d ranks\n", n_prompt, a.n_ranks);
        free(ids);
        kvr_model_free(model);
        return 2;
    }
    const int n_ctx = a.n_ctx > 0 ? a.n_ctx : n_prompt + a.n_steps;
    if (n_prompt + a.n_steps > n_ctx) {
        fprintf(stderr, "kvr-compare: %d prompt tokens + %d steps exceed the context of %d\n", n_prompt, a.n_steps, n_ctx);
        free(ids);
        kvr_model_free(model);
        return 2;
    }
    const char * backend = a.backend ? a.backend : "cpu";
    const double tol = a.tol_set ? a.tol : default_tol(backend, weight_type(model), kvr_cli_cache_v(&a.cache), (enum kvr_strategy)a.strategy);

    struct cmp_run ref = { .label = "reference (cpu, single)", .backend = "cpu", .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 1 };
    struct cmp_run test = { .label = "checked run", .backend = backend, .device = a.device,
                            .strategy = (enum kvr_strategy)a.strategy, .n_ranks = a.n_ranks };
    capture_init(&ref.cap, (int)hp->n_layer, n_prompt, names, n_names);
    capture_init(&test.cap, (int)hp->n_layer, n_prompt, names, n_names);
    ref.logits = malloc(sizeof(float) * (size_t)n_vocab * (size_t)(a.n_steps + 1));
    test.logits = malloc(sizeof(float) * (size_t)n_vocab * (size_t)(a.n_steps + 1));
    int32_t * feed = malloc(sizeof(int32_t) * (size_t)(a.n_steps + 1));

    printf("kvr-compare: %s, %d prompt tokens, %d steps\n", a.model, n_prompt, a.n_steps);
    printf("  reference: cpu, single, 1 rank\n");
    printf("  checked:   %s, %s, %d rank%s\n", backend, kvr_strategy_name(test.strategy), a.n_ranks, a.n_ranks > 1 ? "s" : "");

    // the reference first: its greedy tokens are what both runs are fed
    rc = run_once(&a, model, &ref, ids, n_prompt, feed, true, a.n_steps, n_ctx);
    if (rc == 0) rc = run_once(&a, model, &test, ids, n_prompt, feed, false, a.n_steps, n_ctx);
    if (rc != 0) goto done;

    // the intermediates, layer by layer
    {
        double worst = 0.0;
        int n_cmp = 0, n_missing = 0;
        printf("%-6s %-10s %6s %12s\n", "layer", "name", "rows", "NMSE");
        for (int il = 0; il < (int)hp->n_layer; il++) {
            for (int k = 0; k < n_names; k++) {
                const int idx = il * n_names + k;
                if (!ref.cap.rows[idx] || !test.cap.rows[idx] || ref.cap.width[idx] != test.cap.width[idx]) {
                    n_missing++;
                    continue;
                }
                double num = 0.0, den = 0.0;
                int rows = 0;
                for (int p = 0; p < n_prompt; p++) {
                    if (!ref.cap.seen[idx][p] || !test.cap.seen[idx][p]) continue;
                    rows++;
                    const float * x = ref.cap.rows[idx] + (size_t)p * (size_t)ref.cap.width[idx];
                    const float * y = test.cap.rows[idx] + (size_t)p * (size_t)ref.cap.width[idx];
                    for (int64_t e = 0; e < ref.cap.width[idx]; e++) {
                        // an LSE of -inf (a row that saw no key) must be -inf in both
                        if (isinf(x[e]) || isinf(y[e])) {
                            if (x[e] != y[e]) num = INFINITY;
                            continue;
                        }
                        num += ((double)y[e] - x[e]) * ((double)y[e] - x[e]);
                        den += (double)x[e] * x[e];
                    }
                }
                if (rows == 0) { n_missing++; continue; }
                const double nmse = den > 0 ? num / den : (num > 0 ? INFINITY : 0.0);
                n_cmp++;
                if (nmse > worst || isnan(nmse)) worst = nmse;
                if (a.verbose || il < 2 || il == (int)hp->n_layer - 1 || nmse > 1e-6) {
                    printf("%-6d %-10s %6d %12.3e\n", il, names[k], rows, nmse);
                }
            }
        }
        printf("intermediates: %d compared, worst NMSE %.3e%s", n_cmp, worst, n_missing ? "" : "\n");
        if (n_missing) printf(" (%d layer/name pairs not found in both runs)\n", n_missing);
        if (ref.cap.n_read_errors || test.cap.n_read_errors) {
            printf("intermediates: %d tensors of an unexpected shape were skipped\n", ref.cap.n_read_errors + test.cap.n_read_errors);
        }
    }

    // the logits and the steps
    {
        double maxd = 0.0;
        for (int i = 0; i < n_vocab; i++) {
            const double d = fabs((double)test.logits[i] - ref.logits[i]);
            if (!(d <= maxd)) maxd = d; // NaN counts as the largest
        }
        const int top_r = kvr_argmax(ref.logits, n_vocab), top_t = kvr_argmax(test.logits, n_vocab);
        printf("logits of the last prompt token: max |diff| %.3e (tolerance %.1e), top-1 %d / %d\n", maxd, tol, top_r, top_t);
        int agree = top_r == top_t;
        for (int s = 1; s <= a.n_steps; s++) {
            const float * lr = ref.logits + (size_t)s * (size_t)n_vocab, * lt = test.logits + (size_t)s * (size_t)n_vocab;
            const int r = kvr_argmax(lr, n_vocab), t = kvr_argmax(lt, n_vocab);
            if (r == t) agree++;
            else printf("step %d: top-1 %d in the reference, %d in the checked run\n", s, r, t);
        }
        printf("greedy top-1: %d of %d agree\n", agree, a.n_steps + 1);
        const bool ok = maxd <= tol && agree == a.n_steps + 1;
        printf("kvr-compare: %s\n", ok ? "PASS" : "FAIL");
        rc = ok ? 0 : 1;
    }

done:
    capture_free(&ref.cap);
    capture_free(&test.cap);
    free(ref.logits);
    free(test.logits);
    free(feed);
    free(ids);
    kvr_model_free(model);
    return rc;
}
