// tools/kvr-run.c - the model runner: load a GGUF model, tokenize a prompt, prefill it, then
// decode with the chosen sampler, streaming text to stdout. Flags follow llama.cpp's habits.
// stdout carries only text (the prompt, then the continuation); everything else goes to
// stderr, which ends with one machine-readable timing line.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct run_args {
    const char * model;
    const char * prompt;
    const char * prompt_file;
    const char * tokens;
    const char * dump_logits;
    int          n_predict;
    int          n_threads;
    int          n_ctx;
    float        temp;
    int          top_k;
    float        top_p;
    uint64_t     seed;
    bool         seed_set;
    bool         verbose;
    bool         dump_graph;
    bool         q8_act;
    bool         stats;
    bool         strategy_set;
    enum kvr_attn_mode attn_mode;
    // parallel prefill
    int          n_ranks;
    enum kvr_strategy strategy;
    enum kvr_comm_kind comm;
    bool         comm_set;
    const char * partition;
    double       timeout_s;
    const char * trace;
    double       link_gbps;
    double       link_latency_us;
    double       link_noise;
};

static void usage(FILE * f) {
    fprintf(f,
        "usage: kvr-run -m MODEL.gguf (-p TEXT | -f FILE | --tokens 1,2,3) [options]\n"
        "  -m FILE            model (GGUF)\n"
        "  -p TEXT            prompt text\n"
        "  -f FILE            read the prompt from a file\n"
        "  --tokens LIST      prompt as comma-separated token ids (no BOS is added)\n"
        "  -n N               tokens to generate (default 128; 0 runs the prefill only)\n"
        "  -t N               threads (default: all cores)\n"
        "  -c N               context length (default: the model's, at most 4096)\n"
        "  --temp X           temperature (default 0.8; 0 is greedy)\n"
        "  --top-k N          keep the N most likely tokens (default 40; 0: all)\n"
        "  --top-p X          nucleus sampling (default 0.95; 1: off)\n"
        "  --seed N           sampling seed (default: random, printed with -v)\n"
        "  --attn causal|dense  attention kernel mode (default causal)\n"
        "  --dump-logits FILE the last prompt token's logits, one per line\n"
        "  --dump-graph       print every rank's rewritten graph of the prefill on stderr\n"
        "  --q8-act           Q4_K weights: prefill with 8-bit activations and integer products, as\n"
        "                     llama.cpp does (faster; logits move up to ~0.1 from the exact math)\n"
        "  -v                 prompt and generated ids, model shape, seed on stderr\n"
        "parallel prefill:\n"
        "  --ranks N          ranks (default 1; under mpirun: the MPI size)\n"
        "  --strategy S       single|tsp|kvr|ring-kv|ring-q|auto (default: single for 1 rank, kvr otherwise)\n"
        "  --partition P      kvr: even, token counts (5,3,2,1), fractions (0.4,0.3,0.2,0.1), or\n"
        "                     table:FILE (KVR-P: interpolated from a kvr-tune --search table)\n"
        "  --comm local|mpi   ranks as threads of this process or as MPI processes (default local;\n"
        "                     mpi when started by mpirun in a KVR_MPI=1 build)\n"
        "  -t N               threads per rank\n"
        "  --comm-timeout S   seconds any transfer may wait before the run fails (default 60)\n"
        "  --link-gbps X      local: emulate a link of X Gbit/s between ranks\n"
        "  --link-latency-us X  local: emulated latency per transfer\n"
        "  --link-noise X     local: each prefill, a random pair of neighbours gets an X times slower link\n"
        "  --stats            one JSON object of counters per rank on stderr after the prefill\n"
        "  --trace FILE       Chrome trace JSON of every rank's layers and transfers (Perfetto)\n"
        "  -h, --help         this text\n");
}

static int bad_arg(const char * fmt, const char * what) {
    fprintf(stderr, "kvr-run: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    usage(stderr);
    return 2;
}

static bool parse_int(const char * s, long lo, long hi, int * out) {
    char * end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

static bool parse_float(const char * s, float * out) {
    char * end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end) return false;
    *out = v;
    return true;
}

static int parse_args(int argc, char ** argv, struct run_args * a) {
    *a = (struct run_args) { .n_predict = 128, .temp = 0.8f, .top_k = 40, .top_p = 0.95f };
    for (int i = 1; i < argc; i++) {
        const char * f = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = true;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) { usage(stdout); exit(0); }
        else if (!strcmp(f, "-v") || !strcmp(f, "--verbose")) { a->verbose = true; takes = false; }
        else if (!strcmp(f, "--dump-graph")) { a->dump_graph = true; takes = false; }
        else if (!strcmp(f, "--q8-act")) { a->q8_act = true; takes = false; }
        else if (!strcmp(f, "--stats")) { a->stats = true; takes = false; }
        else if (!v) return bad_arg("flag %s needs a value", f);
        else if (!strcmp(f, "-m") || !strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "-p") || !strcmp(f, "--prompt")) a->prompt = v;
        else if (!strcmp(f, "-f") || !strcmp(f, "--file")) a->prompt_file = v;
        else if (!strcmp(f, "--tokens")) a->tokens = v;
        else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
        else if (!strcmp(f, "-n") || !strcmp(f, "--n-predict")) { if (!parse_int(v, 0, 1 << 20, &a->n_predict)) return bad_arg("bad -n value '%s'", v); }
        else if (!strcmp(f, "-t") || !strcmp(f, "--threads")) { if (!parse_int(v, 1, KVR_MAX_THREADS, &a->n_threads)) return bad_arg("bad -t value '%s'", v); }
        else if (!strcmp(f, "-c") || !strcmp(f, "--ctx-size")) { if (!parse_int(v, 1, 1 << 24, &a->n_ctx)) return bad_arg("bad -c value '%s'", v); }
        else if (!strcmp(f, "--temp")) { if (!parse_float(v, &a->temp) || a->temp < 0) return bad_arg("bad --temp value '%s'", v); }
        else if (!strcmp(f, "--top-k")) { if (!parse_int(v, 0, 1 << 30, &a->top_k)) return bad_arg("bad --top-k value '%s'", v); }
        else if (!strcmp(f, "--top-p")) { if (!parse_float(v, &a->top_p) || a->top_p <= 0 || a->top_p > 1) return bad_arg("bad --top-p value '%s'", v); }
        else if (!strcmp(f, "--seed")) {
            char * end;
            errno = 0;
            a->seed = strtoull(v, &end, 10);
            if (errno || end == v || *end) return bad_arg("bad --seed value '%s'", v);
            a->seed_set = true;
        }
        else if (!strcmp(f, "--ranks")) { if (!parse_int(v, 1, 256, &a->n_ranks)) return bad_arg("bad --ranks value '%s' (1 to 256)", v); }
        else if (!strcmp(f, "--strategy")) { if (kvr_strategy_parse(v, &a->strategy)) return bad_arg("%s", kvr_last_error()); a->strategy_set = true; }
        else if (!strcmp(f, "--partition")) a->partition = v;
        else if (!strcmp(f, "--trace")) a->trace = v;
        else if (!strcmp(f, "--comm")) {
            if (!strcmp(v, "local")) a->comm = KVR_COMM_LOCAL;
            else if (!strcmp(v, "mpi")) a->comm = KVR_COMM_MPI;
            else return bad_arg("bad --comm value '%s' (local or mpi)", v);
            a->comm_set = true;
        }
        else if (!strcmp(f, "--comm-timeout")) { float x; if (!parse_float(v, &x) || x <= 0) return bad_arg("bad --comm-timeout value '%s'", v); a->timeout_s = x; }
        else if (!strcmp(f, "--link-gbps")) { float x; if (!parse_float(v, &x) || x < 0) return bad_arg("bad --link-gbps value '%s'", v); a->link_gbps = x; }
        else if (!strcmp(f, "--link-noise")) { float x; if (!parse_float(v, &x) || x < 1) return bad_arg("bad --link-noise value '%s' (a slowdown factor >= 1)", v); a->link_noise = x; }
        else if (!strcmp(f, "--link-latency-us")) { float x; if (!parse_float(v, &x) || x < 0) return bad_arg("bad --link-latency-us value '%s'", v); a->link_latency_us = x; }
        else if (!strcmp(f, "--attn")) {
            if (!strcmp(v, "causal")) a->attn_mode = KVR_ATTN_CAUSAL;
            else if (!strcmp(v, "dense")) a->attn_mode = KVR_ATTN_DENSE;
            else return bad_arg("bad --attn value '%s' (causal or dense)", v);
        }
        else return bad_arg("unknown flag %s", f);
        if (takes) i++;
    }
    if (!a->model) return bad_arg("%s", "no model: give -m FILE");
    if (!a->comm_set && getenv("OMPI_COMM_WORLD_SIZE")) a->comm = KVR_COMM_MPI; // started by mpirun
    if (a->n_ranks == 0) a->n_ranks = 1;
    if (!a->strategy_set) a->strategy = a->n_ranks > 1 || a->comm == KVR_COMM_MPI ? KVR_STRATEGY_KVR : KVR_STRATEGY_SINGLE;
    if (!!a->prompt + !!a->prompt_file + !!a->tokens != 1) return bad_arg("%s", "give exactly one of -p, -f and --tokens");
    return 0;
}

static char * read_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvr-run: %s: cannot open: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char * buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (n + 1 == cap) buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    if (!buf) return NULL;
    buf[n] = 0;
    return buf;
}

// "1,2,3" -> ids; returns the count or -1 with a message
static int parse_tokens(const char * s, int32_t ** out) {
    int n = 0, cap = 64;
    int32_t * ids = malloc(sizeof(int32_t) * (size_t)cap);
    const char * p = s;
    while (*p) {
        char * end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "kvr-run: --tokens: bad token id at character %d of '%s'\n", (int)(p - s) + 1, s);
            free(ids);
            return -1;
        }
        if (n == cap) ids = realloc(ids, sizeof(int32_t) * (size_t)(cap *= 2));
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "kvr-run: --tokens: no token ids in '%s'\n", s);
        free(ids);
        return -1;
    }
    *out = ids;
    return n;
}

static void print_piece(const struct kvr_vocab * v, int32_t id, bool * first) {
    char buf[256];
    int n = kvr_token_to_piece(v, id, buf, sizeof(buf), false);
    if (n <= 0) return;
    const char * s = buf;
    // SPM prompts start with the space the tokenizer added in front: drop it when printing
    if (*first && kvr_vocab_kind(v) == KVR_VOCAB_SPM && buf[0] == ' ') { s++; n--; }
    *first = false;
    fwrite(s, 1, (size_t)n, stdout);
}

// "5,3,2,1" (token counts) or "0.4,0.3,0.2,0.1" (fractions), one entry per rank
static int parse_partition(const char * s, int n_ranks, int ** counts, double ** fracs) {
    double * v = calloc((size_t)n_ranks + 1, sizeof(double));
    bool frac = strchr(s, '.') != NULL;
    int n = 0;
    const char * p = s;
    while (*p) {
        char * end;
        errno = 0;
        double x = strtod(p, &end);
        if (errno || end == p || x < 0 || (*end && *end != ',') || n == n_ranks + 1) {
            fprintf(stderr, "kvr-run: --partition: bad entry at character %d of '%s'\n", (int)(p - s) + 1, s);
            free(v);
            return -1;
        }
        if (!frac && x != (double)(long)x) frac = true;
        v[n++] = x;
        p = *end ? end + 1 : end;
    }
    if (n != n_ranks) {
        fprintf(stderr, "kvr-run: --partition has %d entries for %d ranks\n", n, n_ranks);
        free(v);
        return -1;
    }
    if (frac) {
        *fracs = v;
    } else {
        *counts = calloc((size_t)n_ranks, sizeof(int));
        for (int i = 0; i < n_ranks; i++) (*counts)[i] = (int)v[i];
        free(v);
    }
    return 0;
}

static void print_stats(const struct kvr_dist * d) {
    struct kvr_rank_stats st[256];
    const int n = kvr_dist_stats(d, st, 256);
    for (int i = 0; i < n; i++) {
        fprintf(stderr, "{\"rank\":%d,\"strategy\":\"%s\",\"tokens\":%d,\"attn_dot_dense\":%lld,\"attn_dot_causal\":%lld,"
                "\"kv_rows_sent\":%lld,\"kv_rows_recv\":%lld,\"bytes_sent\":%lld,\"bytes_recv\":%lld,"
                "\"wait_ms\":%.3f,\"ttft_ms\":%.3f,\"matmul_ms\":%.3f,\"attn_ms\":%.3f,\"compute_ms\":%.3f}\n",
                st[i].rank, kvr_strategy_name(kvr_dist_last_strategy(d)), st[i].tokens, (long long)st[i].attn_dot_dense,
                (long long)st[i].attn_dot_causal, (long long)st[i].kv_rows_sent, (long long)st[i].kv_rows_recv,
                (long long)st[i].bytes_sent, (long long)st[i].bytes_recv, st[i].wait_ms, st[i].ttft_ms,
                st[i].matmul_ms, st[i].attn_ms, st[i].compute_ms);
    }
}

static void print_ids(const char * label, const int32_t * ids, int n) {
    fprintf(stderr, "%s: ", label);
    for (int i = 0; i < n; i++) fprintf(stderr, "%s%d", i ? "," : "", ids[i]);
    fprintf(stderr, "\n");
}

int main(int argc, char ** argv) {
    struct run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;

    struct kvr_model * model = kvr_model_load(a.model, NULL);
    if (!model) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        return 2;
    }
    const struct kvr_vocab * vocab = kvr_model_vocab(model);
    if (a.verbose) {
        char desc[512];
        kvr_model_describe(model, desc, sizeof(desc));
        fprintf(stderr, "model: %s\n", desc);
    }

    int32_t * ids = NULL;
    int n_prompt = 0;
    char * text = NULL;
    if (a.tokens) {
        n_prompt = parse_tokens(a.tokens, &ids);
        if (n_prompt < 0) { kvr_model_free(model); return 2; }
    } else {
        text = a.prompt ? strdup(a.prompt) : read_file(a.prompt_file);
        if (!text) { kvr_model_free(model); return 2; }
        const bool bos = kvr_vocab_add_bos(vocab);
        int need = kvr_tokenize(vocab, text, NULL, 0, bos, false);
        if (need < 0) {
            fprintf(stderr, "kvr-run: cannot tokenize the prompt: %s\n", kvr_last_error());
            free(text);
            kvr_model_free(model);
            return 2;
        }
        ids = malloc(sizeof(int32_t) * (size_t)(need + 1));
        n_prompt = kvr_tokenize(vocab, text, ids, need + 1, bos, false);
    }
    if (n_prompt == 0) {
        fprintf(stderr, "kvr-run: the prompt has no tokens\n");
        free(text); free(ids); kvr_model_free(model);
        return 2;
    }
    if (a.verbose) print_ids("prompt ids", ids, n_prompt);

    int n_ctx = a.n_ctx;
    if (n_ctx == 0) {
        // the default context fits the prompt and the continuation
        n_ctx = n_prompt + a.n_predict;
        if (n_ctx < 512) n_ctx = 512;
    }
    if (n_prompt + a.n_predict > n_ctx) {
        fprintf(stderr, "kvr-run: %d prompt tokens + %d to generate exceed the context of %d (raise -c)\n",
                n_prompt, a.n_predict, n_ctx);
        free(text); free(ids); kvr_model_free(model);
        return 2;
    }
    int * counts = NULL;
    double * fracs = NULL;
    if (a.partition && strncmp(a.partition, "table:", 6) == 0) {
        // KVR-P: fractions interpolated from a lookup table written by kvr-tune --search
        struct kvr_tune_model tm;
        fracs = calloc((size_t)a.n_ranks, sizeof(double));
        if (kvr_tune_model_from(model, &tm) != KVR_OK ||
            kvr_tune_table_partition(a.partition + 6, tm.name, a.n_ranks, n_prompt, fracs) != KVR_OK) {
            fprintf(stderr, "kvr-run: --partition %s: %s\n", a.partition, kvr_last_error());
            free(text); free(ids); free(fracs); kvr_model_free(model);
            return 2;
        }
        if (a.verbose) {
            fprintf(stderr, "partition (KVR-P from %s, model %s):", a.partition + 6, tm.name);
            for (int i = 0; i < a.n_ranks; i++) fprintf(stderr, " %.4f", fracs[i]);
            fprintf(stderr, "\n");
        }
    } else if (a.partition && strcmp(a.partition, "even") != 0) {
        if (parse_partition(a.partition, a.n_ranks, &counts, &fracs) != 0) {
            free(text); free(ids); kvr_model_free(model);
            return 2;
        }
    }
    struct kvr_dist_params dp = {
        .strategy = a.strategy, .comm = a.comm, .n_ranks = a.n_ranks, .n_threads = a.n_threads, .n_ctx = n_ctx,
        .partition = counts, .fractions = fracs, .attn_mode = a.attn_mode, .timeout_s = a.timeout_s,
        .link_gbps = a.link_gbps, .link_latency_us = a.link_latency_us,
        .link_noise = a.link_noise, .link_seed = a.seed_set ? a.seed : 1, .trace = a.trace != NULL,
        .graph_out = a.dump_graph ? stderr : NULL, .q8_activations = a.q8_act,
        .log = a.verbose ? stderr : NULL,
    };
    if (getenv("KVR_TEST_STALL")) { // test hook: "rank:layer" stops that rank before that layer's transfers
        dp.stall = sscanf(getenv("KVR_TEST_STALL"), "%d:%d", &dp.stall_rank, &dp.stall_layer) == 2;
    }
    struct kvr_dist * dist = kvr_dist_new(model, &dp);
    if (!dist) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        free(text); free(ids); free(counts); free(fracs); kvr_model_free(model);
        return 2;
    }
    // under MPI every rank runs this program; rank 0 speaks for all
    const bool speaker = kvr_dist_rank(dist) == 0;

    if (!a.seed_set) a.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (a.verbose && speaker) fprintf(stderr, "seed: %llu\n", (unsigned long long)a.seed);
    struct kvr_sampler smp;
    kvr_sampler_init(&smp, &(struct kvr_sampler_params) { a.temp, a.top_k, a.top_p, a.seed });

    // the prompt as text first
    if (!speaker) {
        // quiet
    } else if (text) {
        fputs(text, stdout);
    } else {
        bool first = true;
        for (int i = 0; i < n_prompt; i++) {
            if (ids[i] == kvr_vocab_bos(vocab)) continue;
            print_piece(vocab, ids[i], &first);
        }
    }
    fflush(stdout);

    const double t0 = kvr_time_ms();
    const float * logits = kvr_dist_eval(dist, ids, n_prompt);
    const double t_prefill = kvr_time_ms();
    if (a.stats) print_stats(dist);
    if (!logits) {
        fprintf(stderr, "\nkvr-run: prefill failed: %s\n", kvr_last_error());
        rc = 1;
        goto done;
    }
    const int n_vocab = kvr_vocab_n_tokens(vocab);
    if (a.dump_logits && speaker) {
        FILE * f = fopen(a.dump_logits, "w");
        if (!f) {
            fprintf(stderr, "kvr-run: %s: cannot write: %s\n", a.dump_logits, strerror(errno));
            rc = 2;
            goto done;
        }
        for (int i = 0; i < n_vocab; i++) fprintf(f, "%.9g\n", logits[i]);
        fclose(f);
    }
    double t_first = 0, t_end = 0;
    int n_gen = 0;
    int32_t * gen = malloc(sizeof(int32_t) * (size_t)(a.n_predict + 1));
    if (a.n_predict == 0) t_first = kvr_time_ms();
    bool first_piece = false;
    while (n_gen < a.n_predict) {
        const int32_t id = kvr_sample(&smp, logits, n_vocab);
        if (n_gen == 0) t_first = kvr_time_ms();
        gen[n_gen++] = id;
        if (kvr_vocab_is_eog(vocab, id)) break;
        if (speaker) print_piece(vocab, id, &first_piece);
        fflush(stdout);
        if (n_gen == a.n_predict) break;
        logits = kvr_dist_eval(dist, &id, 1);
        if (!logits) {
            fprintf(stderr, "\nkvr-run: decode failed: %s\n", kvr_last_error());
            rc = 1;
            free(gen);
            goto done;
        }
    }
    t_end = kvr_time_ms();
    if (isatty(1) && speaker) putchar('\n');
    fflush(stdout);
    if (a.verbose && speaker) print_ids("generated ids", gen, n_gen);
    const double ttft = t_first - t0;
    if (speaker) {
        fprintf(stderr, "timing: prompt_tokens=%d ttft_ms=%.3f prefill_tok_s=%.2f decode_ms_per_tok=%.3f\n",
                n_prompt, ttft, n_prompt / ((t_prefill - t0) / 1e3), n_gen > 1 ? (t_end - t_first) / (n_gen - 1) : 0.0);
    }
    free(gen);
done:
    if (a.trace && kvr_dist_write_trace(dist, a.trace) != KVR_OK) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        if (rc == 0) rc = 1;
    }
    kvr_sampler_free(&smp);
    kvr_dist_free(dist);
    free(counts);
    free(fracs);
    kvr_model_free(model);
    free(text);
    free(ids);
    return rc;
}
