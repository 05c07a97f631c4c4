// tools/kvr-run.c - the model runner: load a GGUF model, tokenize a prompt, prefill it, then
// decode with the chosen sampler, streaming text to stdout. Flags follow llama.cpp's habits.
// stdout carries only text (the prompt, then the continuation); everything else goes to
// stderr, which ends with one machine-readable timing line. The flags are one table (RUN_FLAGS,
// parsed by tools/kvr-cli.h); every value, path and combination is checked, and the prompt
// measured against the context, before the prompt is echoed: exit 2 for those, 1 for a run that
// fails once started.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "kvr-cli.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    int          attn_mode;      // enum kvr_attn_mode, as --attn's choices are ordered
    // parallel prefill
    int          n_ranks;
    enum kvr_strategy strategy;
    int          comm;           // enum kvr_comm_kind, as --comm's choices are ordered
    bool         comm_set;
    const char * partition;
    int          n_part;         // entries of a --partition list (0: even or table:)
    double       timeout_s;
    const char * trace;
    double       link_gbps;
    double       link_latency_us;
    double       link_noise;
};

static int parse_strategy(const char * v, void * dst, char * why, size_t cap) {
    if (kvr_strategy_parse(v, dst) == KVR_OK) return 0;
    snprintf(why, cap, "%s", kvr_last_error());
    return -1;
}

static const char * const run_synopsis = "usage: kvr-run -m MODEL.gguf (-p TEXT | -f FILE | --tokens 1,2,3) [options]";

// Entries of --partition: token counts or fractions, each a finite number >= 0. Returns the
// count of entries (at most cap) or -1 with why filled in.
static int partition_entries(const char * s, double * v, int cap, bool * frac, char * why, size_t why_cap) {
    const struct kvr_cli_flag entry = { .kind = KVR_CLI_REAL, .lo = 0, .hi = 1e9 };
    *frac = strchr(s, '.') != NULL;
    int n = 0;
    for (const char * p = s; ; ) {
        const char * comma = strchr(p, ',');
        const size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[64], sub[200];
        if (n == cap) { snprintf(why, why_cap, "more than %d entries", cap); return -1; }
        if (len >= sizeof(item)) { snprintf(why, why_cap, "entry %d is too long", n + 1); return -1; }
        memcpy(item, p, len);
        item[len] = 0;
        if (kvr_cli_parse_real(&entry, item, &v[n], sub, sizeof(sub))) { snprintf(why, why_cap, "entry %d '%s': %.150s", n + 1, item, sub); return -1; }
        if (v[n] != floor(v[n])) *frac = true;
        n++;
        if (!comma) break;
        p = comma + 1;
    }
    return n;
}

// The command line into a, every value and combination checked: 0 to run, 2 on a bad command
// line (message printed), -1 after -h.
static int parse_args(int argc, char ** argv, struct run_args * a) {
    *a = (struct run_args) { .n_predict = 128, .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .n_ranks = 1 };
    // The flags, one entry each: what -h prints and what the parser takes. Adding a flag is adding
    // its field to run_args and its line here (tools/kvr-cli.h has the kinds and ranges).
    const struct kvr_cli_flag flags[] = {
        { .name = "-m", .alt = "--model", .kind = KVR_CLI_IN, .dst = &a->model, .meta = "FILE", .help = "model (GGUF)" },
        { .name = "-p", .alt = "--prompt", .kind = KVR_CLI_TEXT, .dst = &a->prompt, .meta = "TEXT", .empty_ok = true, .help = "prompt text" },
        { .name = "-f", .alt = "--file", .kind = KVR_CLI_IN, .dst = &a->prompt_file, .meta = "FILE",
          .help = "read the prompt from a file (UTF-8 text: a NUL byte or invalid UTF-8 is an error)" },
        { .name = "--tokens", .kind = KVR_CLI_TEXT, .dst = &a->tokens, .meta = "LIST", .help = "prompt as comma-separated token ids (no BOS is added)" },
        { .name = "-n", .alt = "--n-predict", .kind = KVR_CLI_INT, .dst = &a->n_predict, .meta = "N", .lo = 0, .hi = 1 << 20,
          .help = "tokens to generate (default 128; 0 runs the prefill only)" },
        { .name = "-t", .alt = "--threads", .kind = KVR_CLI_INT, .dst = &a->n_threads, .meta = "N", .lo = 1, .hi = KVR_MAX_THREADS,
          .help = "threads (default: all cores); with --ranks, threads per rank\n(default: cores / ranks)" },
        { .name = "-c", .alt = "--ctx-size", .kind = KVR_CLI_INT, .dst = &a->n_ctx, .meta = "N", .lo = 0, .hi = 1 << 24,
          .help = "context length (default 0: the model's trained context, at most 4096); a prompt that\n"
                  "does not fit is refused; above the trained context a warning (RoPE extrapolation)" },
        { .name = "--temp", .kind = KVR_CLI_FLOAT, .dst = &a->temp, .meta = "X", .lo = 0, .hi = 100, .help = "temperature (default 0.8; 0 is greedy)" },
        { .name = "--top-k", .kind = KVR_CLI_INT, .dst = &a->top_k, .meta = "N", .lo = 0, .hi = 1 << 30, .help = "keep the N most likely tokens (default 40; 0: all)" },
        { .name = "--top-p", .kind = KVR_CLI_FLOAT, .dst = &a->top_p, .meta = "X", .lo = 0, .hi = 1, .open = KVR_CLI_LO_OPEN,
          .help = "nucleus sampling (default 0.95; 1: off)" },
        { .name = "--seed", .kind = KVR_CLI_U64, .dst = &a->seed, .meta = "N", .given = &a->seed_set, .help = "sampling seed (default: random, printed with -v)" },
        { .name = "--attn", .kind = KVR_CLI_CHOICE, .dst = &a->attn_mode, .meta = "causal|dense", .choices = "causal|dense",
          .help = "attention kernel mode (default causal)" },
        { .name = "--dump-logits", .kind = KVR_CLI_OUT, .dst = &a->dump_logits, .meta = "FILE", .help = "the last prompt token's logits, one per line" },
        { .name = "--dump-graph", .kind = KVR_CLI_SWITCH, .dst = &a->dump_graph, .help = "print every rank's rewritten graph of the prefill on stderr" },
        { .name = "--q8-act", .kind = KVR_CLI_SWITCH, .dst = &a->q8_act,
          .help = "Q4_K weights: prefill with 8-bit activations and integer products, as\n"
                  "llama.cpp does (faster; logits move up to ~0.1 from the exact math)" },
        { .name = "-v", .alt = "--verbose", .kind = KVR_CLI_SWITCH, .dst = &a->verbose, .help = "prompt and generated ids, model shape, seed on stderr" },
        { .kind = KVR_CLI_SECTION, .help = "parallel prefill:" },
        { .name = "--ranks", .kind = KVR_CLI_INT, .dst = &a->n_ranks, .meta = "N", .lo = 1, .hi = 256,
          .help = "ranks (default 1; under mpirun: the MPI size)" },
        { .name = "--strategy", .kind = KVR_CLI_CUSTOM, .dst = &a->strategy, .meta = "S", .parse = parse_strategy, .given = &a->strategy_set,
          .help = "single|tsp|kvr|ring-kv|ring-q|auto (default: single for 1 rank, kvr otherwise)" },
        { .name = "--partition", .kind = KVR_CLI_TEXT, .dst = &a->partition, .meta = "P",
          .help = "kvr only: even, token counts (5,3,2,1), fractions (0.4,0.3,0.2,0.1), or\n"
                  "table:FILE (KVR-P: interpolated from a kvr-tune --search table)" },
        { .name = "--comm", .kind = KVR_CLI_CHOICE, .dst = &a->comm, .meta = "local|mpi|nccl", .choices = "local|mpi|nccl",
          .given = &a->comm_set,
          .help = "ranks as threads of this process, MPI processes, or GPUs over NCCL (default\n"
                  "local; mpi when started by mpirun in a KVR_MPI=1 build; nccl: make KVR_CUDA=1,\n"
                  "--backend cuda, --ranks N GPUs of this process, or one process per GPU under\n"
                  "mpirun in a build with KVR_MPI=1 too)" },
        { .name = "--comm-timeout", .kind = KVR_CLI_REAL, .dst = &a->timeout_s, .meta = "S", .lo = 0, .hi = 86400, .open = KVR_CLI_LO_OPEN,
          .help = "seconds any transfer may wait before the run fails (default 60)" },
        { .name = "--link-gbps", .kind = KVR_CLI_REAL, .dst = &a->link_gbps, .meta = "X", .lo = 0, .hi = 1e6,
          .help = "local: emulate a link of X Gbit/s between ranks (0: none)" },
        { .name = "--link-latency-us", .kind = KVR_CLI_REAL, .dst = &a->link_latency_us, .meta = "X", .lo = 0, .hi = 1e7,
          .help = "local: emulated latency per transfer" },
        { .name = "--link-noise", .kind = KVR_CLI_REAL, .dst = &a->link_noise, .meta = "X", .lo = 1, .hi = 1e6,
          .help = "local, with --link-gbps: each prefill, a random pair of neighbours\ngets an X times slower link" },
        { .name = "--stats", .kind = KVR_CLI_SWITCH, .dst = &a->stats, .help = "one JSON object of counters per rank on stderr after the prefill" },
        { .name = "--trace", .kind = KVR_CLI_OUT, .dst = &a->trace, .meta = "FILE", .help = "Chrome trace JSON of every rank's layers and transfers (Perfetto)" },
    };
    const struct kvr_cli cli = { "kvr-run", run_synopsis, NULL, flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) return rc;
    if (!a->model) return kvr_cli_fail(&cli, "no model: give -m FILE");
    if (!!a->prompt + !!a->prompt_file + !!a->tokens != 1) return kvr_cli_fail(&cli, "give exactly one of -p, -f and --tokens");
    if (a->prompt && kvr_cli_check_text("kvr-run", "-p", a->prompt, strlen(a->prompt))) return 2;
    if (!a->comm_set && getenv("OMPI_COMM_WORLD_SIZE")) a->comm = KVR_COMM_MPI; // started by mpirun
    if (!a->strategy_set) a->strategy = a->n_ranks > 1 || a->comm != KVR_COMM_LOCAL ? KVR_STRATEGY_KVR : KVR_STRATEGY_SINGLE;
    if (a->partition && a->strategy != KVR_STRATEGY_KVR) {
        return kvr_cli_fail(&cli, "--partition splits the prompt for --strategy kvr; %s takes no partition", kvr_strategy_name(a->strategy));
    }
    if (a->partition && strncmp(a->partition, "table:", 6) == 0) {
        char why[256];
        if (kvr_cli_check_in(a->partition + 6, why, sizeof(why))) return kvr_cli_fail(&cli, "--partition %s: %s", a->partition, why);
    } else if (a->partition && strcmp(a->partition, "even") != 0) {
        double v[257];
        bool frac;
        char why[256];
        const int n = partition_entries(a->partition, v, 257, &frac, why, sizeof(why));
        if (n < 0) return kvr_cli_fail(&cli, "--partition '%.200s': %s", a->partition, why);
        a->n_part = n;
        if (a->comm == KVR_COMM_LOCAL && n != a->n_ranks) {
            return kvr_cli_fail(&cli, "--partition has %d entries for %d ranks", n, a->n_ranks);
        }
        double sum = 0;
        for (int i = 0; i < n; i++) sum += v[i];
        if (frac && fabs(sum - 1.0) > 1e-3) return kvr_cli_fail(&cli, "--partition: the fractions add up to %g, not 1", sum);
    }
    if ((a->link_gbps > 0 || a->link_latency_us > 0 || a->link_noise > 0) && a->comm != KVR_COMM_LOCAL) {
        return kvr_cli_fail(&cli, "--link-gbps, --link-latency-us and --link-noise emulate links between local ranks (--comm local)");
    }
    if (a->link_noise > 0 && !(a->link_gbps > 0)) return kvr_cli_fail(&cli, "--link-noise slows an emulated link: give --link-gbps too");
    if (a->tokens) {
        int32_t * ids = NULL;
        if (parse_tokens(a->tokens, &ids) < 0) return 2;
        free(ids);
    }
    const char * stall = getenv("KVR_TEST_STALL");
    int sr, sl;
    char tail;
    if (stall && sscanf(stall, "%d:%d%c", &sr, &sl, &tail) != 2) {
        return kvr_cli_fail(&cli, "KVR_TEST_STALL='%.100s': want RANK:LAYER (the test hook that stalls a rank)", stall);
    }
    return 0;
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

// The whole run; main() below, and the CLI fuzz target calls it in-process (tests/fuzz-cli.c), so
// every path returns (no exit) and frees what it took.
int kvr_run_main(int argc, char ** argv);
int kvr_run_main(int argc, char ** argv) {
    struct run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;

    // the prompt file before the model: a bad file costs nothing to find
    char * text = NULL;
    if (a.prompt_file && kvr_cli_read_text("kvr-run", a.prompt_file, &text, NULL)) return 2;
    struct kvr_model * model = kvr_model_load(a.model, NULL);
    if (!model) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        free(text);
        return 2;
    }
    const struct kvr_vocab * vocab = kvr_model_vocab(model);
    const struct kvr_hparams * hp = &model->hp;
    if (a.verbose) {
        char desc[512];
        kvr_model_describe(model, desc, sizeof(desc));
        fprintf(stderr, "model: %s\n", desc);
    }

    int32_t * ids = NULL;
    int * counts = NULL;
    double * fracs = NULL;
    struct kvr_dist * dist = NULL;
    int32_t * gen = NULL;
    bool smp_init = false;
    struct kvr_sampler smp;
    int n_prompt = 0;
    rc = 2; // until the prefill starts, every failure is the command line's or the files'
    if (a.tokens) {
        n_prompt = parse_tokens(a.tokens, &ids);
        if (n_prompt < 0) goto done;
        for (int i = 0; i < n_prompt; i++) {
            if (ids[i] >= (int32_t)hp->n_vocab) {
                fprintf(stderr, "kvr-run: --tokens: id %d (entry %d) is not in the vocabulary of %u tokens\n", ids[i], i + 1, hp->n_vocab);
                goto done;
            }
        }
    } else {
        if (!text) text = strdup(a.prompt);
        const bool bos = kvr_vocab_add_bos(vocab);
        int need = kvr_tokenize(vocab, text, NULL, 0, bos, false);
        if (need < 0) {
            fprintf(stderr, "kvr-run: cannot tokenize the prompt: %s\n", kvr_last_error());
            goto done;
        }
        ids = malloc(sizeof(int32_t) * (size_t)(need + 1));
        n_prompt = kvr_tokenize(vocab, text, ids, need + 1, bos, false);
    }
    if (n_prompt == 0) {
        fprintf(stderr, "kvr-run: the prompt has no tokens\n");
        goto done;
    }
    if (a.verbose) print_ids("prompt ids", ids, n_prompt);

    // the context: the model's trained one unless -c says otherwise, capped as -h says
    const int n_train = hp->n_ctx_train > 0 ? (int)(hp->n_ctx_train < (1u << 24) ? hp->n_ctx_train : (1u << 24)) : 4096;
    const int n_ctx = a.n_ctx > 0 ? a.n_ctx : n_train < 4096 ? n_train : 4096;
    if (n_prompt > n_ctx) {
        fprintf(stderr, "kvr-run: the prompt has %d tokens, more than the context of %d (%s; the model was trained on %d)\n",
                n_prompt, n_ctx, a.n_ctx > 0 ? "-c" : "the default", n_train);
        goto done;
    }
    if (n_prompt + a.n_predict > n_ctx) {
        fprintf(stderr, "kvr-run: %d prompt tokens + %d to generate exceed the context of %d (raise -c or lower -n)\n",
                n_prompt, a.n_predict, n_ctx);
        goto done;
    }
    if (a.n_ctx > n_train) {
        fprintf(stderr, "kvr-run: warning: -c %d is above the %d tokens the model was trained on: positions past them are\n"
                "  beyond what its RoPE saw in training, and the text may degrade there\n", a.n_ctx, n_train);
    }
    {   // every local rank holds a cache of n_ctx positions: refuse what the machine cannot hold
        const double kv_bytes = 2.0 * hp->n_layer * (double)hp->head_dim * hp->n_head_kv * n_ctx * sizeof(float);
        const int local = a.comm == KVR_COMM_LOCAL ? a.n_ranks : 1;
        const double mem = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
        if (mem > 0 && kv_bytes * local > mem) {
            fprintf(stderr, "kvr-run: a context of %d needs %.1f GiB of KV cache (%d rank%s x %.1f GiB); this machine has %.1f GiB\n",
                    n_ctx, kv_bytes * local / 1073741824.0, local, local > 1 ? "s" : "", kv_bytes / 1073741824.0, mem / 1073741824.0);
            goto done;
        }
    }
    if (a.partition && strncmp(a.partition, "table:", 6) == 0) {
        // KVR-P: fractions interpolated from a lookup table written by kvr-tune --search
        struct kvr_tune_model tm;
        fracs = calloc((size_t)a.n_ranks, sizeof(double));
        if (kvr_tune_model_from(model, &tm) != KVR_OK ||
            kvr_tune_table_partition(a.partition + 6, tm.name, a.n_ranks, n_prompt, fracs) != KVR_OK) {
            fprintf(stderr, "kvr-run: --partition %s: %s\n", a.partition, kvr_last_error());
            goto done;
        }
        if (a.verbose) {
            fprintf(stderr, "partition (KVR-P from %s, model %s):", a.partition + 6, tm.name);
            for (int i = 0; i < a.n_ranks; i++) fprintf(stderr, " %.4f", fracs[i]);
            fprintf(stderr, "\n");
        }
    } else if (a.partition && strcmp(a.partition, "even") != 0) {
        // checked by parse_args: finite entries >= 0, one per local rank, fractions adding up to 1
        double v[257];
        bool frac;
        char why[256];
        const int n = partition_entries(a.partition, v, 257, &frac, why, sizeof(why));
        KVR_ASSERT(n > 0);
        if (frac) {
            fracs = malloc(sizeof(double) * (size_t)n);
            memcpy(fracs, v, sizeof(double) * (size_t)n);
        } else {
            counts = malloc(sizeof(int) * (size_t)n);
            int sum = 0;
            for (int i = 0; i < n; i++) sum += counts[i] = (int)v[i];
            if (sum != n_prompt) {
                fprintf(stderr, "kvr-run: --partition: the counts add up to %d, but the prompt has %d tokens\n", sum, n_prompt);
                goto done;
            }
        }
    }
    struct kvr_dist_params dp = {
        .strategy = a.strategy, .comm = (enum kvr_comm_kind)a.comm, .n_ranks = a.n_ranks, .n_threads = a.n_threads, .n_ctx = n_ctx,
        .partition = counts, .fractions = fracs, .attn_mode = (enum kvr_attn_mode)a.attn_mode, .timeout_s = a.timeout_s,
        .link_gbps = a.link_gbps, .link_latency_us = a.link_latency_us,
        .link_noise = a.link_noise, .link_seed = a.seed_set ? a.seed : 1, .trace = a.trace != NULL,
        .graph_out = a.dump_graph ? stderr : NULL, .q8_activations = a.q8_act,
        .log = a.verbose ? stderr : NULL,
    };
    if (getenv("KVR_TEST_STALL")) { // test hook: "rank:layer" stops that rank before that layer's transfers (checked by parse_args)
        dp.stall = sscanf(getenv("KVR_TEST_STALL"), "%d:%d", &dp.stall_rank, &dp.stall_layer) == 2;
    }
    dist = kvr_dist_new(model, &dp);
    if (!dist) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        goto done;
    }
    if ((counts || fracs) && a.comm != KVR_COMM_LOCAL) {
        // under MPI the rank count is the communicator's, known only now (and still before any work)
        if (a.n_part > 0 && a.n_part != kvr_dist_n_ranks(dist)) {
            fprintf(stderr, "kvr-run: --partition has %d entries for %d ranks\n", a.n_part, kvr_dist_n_ranks(dist));
            goto done;
        }
    }
    // under MPI every rank runs this program; rank 0 speaks for all
    const bool speaker = kvr_dist_rank(dist) == 0;

    if (!a.seed_set) a.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (a.verbose && speaker) fprintf(stderr, "seed: %llu\n", (unsigned long long)a.seed);
    kvr_sampler_init(&smp, &(struct kvr_sampler_params) { a.temp, a.top_k, a.top_p, a.seed });
    smp_init = true;

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

    rc = 0;
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
    gen = malloc(sizeof(int32_t) * (size_t)(a.n_predict + 1));
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
done:
    if (dist && a.trace && kvr_dist_write_trace(dist, a.trace) != KVR_OK) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        if (rc == 0) rc = 1;
    }
    if (smp_init) kvr_sampler_free(&smp);
    kvr_dist_free(dist);
    free(gen);
    free(counts);
    free(fracs);
    kvr_model_free(model);
    free(text);
    free(ids);
    return rc;
}

#ifndef KVR_RUN_NO_MAIN
int main(int argc, char ** argv) {
    return kvr_run_main(argc, argv);
}
#endif
