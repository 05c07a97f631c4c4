// tools/kvr-tune.c - KV-Runahead's load balancing from the command line: measure this machine
// into a hardware profile (--calibrate), search the TTFT-minimizing partition per rank count and
// prompt length into a lookup table (--search: measured on real prefills, or modeled by the
// simulator), and tabulate simulated TTFTs of the strategies against the paper's lower bounds
// (--simulate, a markdown table on stdout). Progress and diagnostics go to stderr.
//
//   kvr-tune --calibrate -o profile.txt
//   kvr-tune --search -m model.gguf --ranks 2,4 --ctx 256,512 --measured -r 3 -o parts.txt
//   kvr-tune --search --preset llama-7b --profile a100-nvlink --ranks 4,8 --ctx 4k..16k:4k -o parts.txt
//   kvr-tune --simulate --preset llama-7b --profile a100-nvlink --ranks 2,4,8 --ctx 1k..16k --strategy tsp,kvr-e,kvr-s,ring-kv

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "kvr-cli.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_LIST 64

enum mode { MODE_NONE, MODE_CALIBRATE, MODE_SEARCH, MODE_SIMULATE, MODE_SHOW };

// strategies of --simulate: kvr comes in three partitions
enum sim_strat { SS_SINGLE, SS_TSP, SS_KVR_E, SS_KVR_S, SS_KVR_P, SS_RING_KV, SS_RING_Q, SS_COUNT };
static const char * const ss_names[SS_COUNT] = { "single", "tsp", "kvr-e", "kvr-s", "kvr-p", "ring-kv", "ring-q" };

struct args {
    enum mode    mode;
    const char * model;
    const char * preset;
    const char * profile;
    const char * out;
    const char * table;
    const char * show;
    int          ranks[MAX_LIST], n_ranks;
    int          ctx[MAX_LIST], n_ctx;
    int          strat[SS_COUNT], n_strat;
    bool         attn_set;
    enum kvr_attn_mode attn;
    int          cache;          // enum kvr_cache_type, as --cache-type's choices are ordered
    bool         measured;
    int          runs;
    int          threads;
    int          min_stride;
    int          grid_half;
    bool         breakdown;
    double       link_gbps;
};

// a count with an optional k (x1024) suffix
static int parse_count(const char * s, const char * end, int * out) {
    char * e;
    errno = 0;
    if (s == end || *s < '0' || *s > '9') return -1; // strtol would take spaces and signs
    long v = strtol(s, &e, 10);
    if (e == s || errno) return -1;
    if (e < end && (*e == 'k' || *e == 'K')) { v *= 1024; e++; }
    if (e != end || v <= 0 || v > (1L << 24)) return -1;
    *out = (int)v;
    return 0;
}

// "1024,2048", "1k..16k" (doubling), "4k..16k:4k" (step)
static int parse_list(const char * s, int * out, int * n, bool ranges) {
    *n = 0;
    while (*s) {
        const char * comma = strchr(s, ',');
        const char * end = comma ? comma : s + strlen(s);
        const char * dots = strstr(s, "..");
        if (dots && dots < end) {
            if (!ranges) return -1;
            const char * colon = memchr(dots, ':', (size_t)(end - dots));
            int a, b, step = 0;
            if (parse_count(s, dots, &a) || parse_count(dots + 2, colon ? colon : end, &b) || b < a) return -1;
            if (colon && parse_count(colon + 1, end, &step)) return -1;
            for (int64_t v = a; v <= b; v = step ? v + step : v * 2) {
                if (*n == MAX_LIST) return -1;
                out[(*n)++] = (int)v;
            }
        } else {
            if (*n == MAX_LIST || parse_count(s, end, &out[*n])) return -1;
            (*n)++;
        }
        s = comma ? comma + 1 : end;
        if (comma && !*s) return -1; // "1k," ends with an empty entry
    }
    return *n > 0 ? 0 : -1;
}

static int check_args(struct args * a);

static const char * const tune_synopsis =
    "usage: kvr-tune --calibrate [-m MODEL.gguf | --preset NAME] [--ranks N] [-t THREADS] [-o FILE] [--attn causal|dense]\n"
    "       kvr-tune --search (-m MODEL.gguf | --preset NAME) --ranks N[,N...] --ctx LIST\n"
    "                (--measured [-r RUNS] [-t THREADS] | --profile FILE|NAME) [--min-stride S] -o TABLE\n"
    "       kvr-tune --simulate (-m MODEL.gguf | --preset NAME) --profile FILE|NAME --ranks N[,N...] --ctx LIST\n"
    "                [--strategy LIST] [--table FILE] [--breakdown]\n"
    "       kvr-tune --show-profile NAME [-o FILE]";

static int usage_error(const char * fmt, const char * what) {
    fprintf(stderr, "kvr-tune: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n%s\n(kvr-tune -h for every option)\n", tune_synopsis);
    return 2;
}

static int parse_ctx(const char * v, void * dst, char * why, size_t cap) {
    struct args * a = dst;
    if (parse_list(v, a->ctx, &a->n_ctx, true)) {
        snprintf(why, cap, "bad list (e.g. 1024,2048 or 1k..16k or 4k..16k:4k; lengths from 1 to 16M, at most %d)", MAX_LIST);
        return -1;
    }
    return 0;
}

static int parse_strategies(const char * v, void * dst, char * why, size_t cap) {
    struct args * a = dst;
    char buf[256];
    if (strlen(v) >= sizeof(buf)) { snprintf(why, cap, "too long"); return -1; }
    snprintf(buf, sizeof(buf), "%s", v);
    a->n_strat = 0;
    char * save = NULL;
    for (char * t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k = 0;
        if (!strcmp(t, "kvr")) t = "kvr-e";
        while (k < SS_COUNT && strcmp(t, ss_names[k])) k++;
        if (k == SS_COUNT) { snprintf(why, cap, "unknown '%.100s' (single, tsp, kvr-e, kvr-s, kvr-p, ring-kv, ring-q)", t); return -1; }
        if (a->n_strat < SS_COUNT) a->strat[a->n_strat++] = k;
    }
    if (a->n_strat == 0) { snprintf(why, cap, "no strategy"); return -1; }
    return 0;
}

static int parse_profile(const char * v, void * dst, char * why, size_t cap) {
    struct kvr_tune_profile p;
    if (kvr_tune_profile_get(v, &p) != KVR_OK) { snprintf(why, cap, "%s", kvr_last_error()); return -1; }
    *(const char **)dst = v;
    return 0;
}

static int parse_args(int argc, char ** argv, struct args * a) {
    *a = (struct args) { .runs = 3 };
    bool calibrate = false, search = false, simulate = false;
    struct kvr_cli_ints ranks = { 0, { 0 } };
    int attn = 0;
    const struct kvr_cli_flag flags[] = {
        { .name = "--calibrate", .kind = KVR_CLI_SWITCH, .dst = &calibrate,
          .help = "time kvr's matmul and attention (on the model's shapes if one is given) as N ranks\n(default 1) of THREADS threads (default 1) see them, all running at once; a memcpy\nand a thread hand-off; write the profile (default: stdout)" },
        { .name = "--search", .kind = KVR_CLI_SWITCH, .dst = &search,
          .help = "KVR-S: golden-section for 2 ranks, hierarchical grid search beyond; one table\nline per rank count and length (an existing TABLE of the same profile is updated)" },
        { .name = "--simulate", .kind = KVR_CLI_SWITCH, .dst = &simulate,
          .help = "TTFT of each strategy by the cost model, with TTFT*(p) (Eq. 3) and TTFT(p) (KVR-S,\nfree communication), as a markdown table" },
        { .name = "--show-profile", .kind = KVR_CLI_TEXT, .dst = &a->show, .meta = "N",
          .help = "print a built-in profile as a file (a100-nvlink, a100-10g, h100-nvlink, cpu)" },
        { .name = "-m", .kind = KVR_CLI_IN, .dst = &a->model, .meta = "FILE", .once = true, .help = "model (GGUF): its shapes, and for --measured the model that runs" },
        { .name = "--preset", .kind = KVR_CLI_TEXT, .dst = &a->preset, .meta = "NAME", .help = "llama-7b, llama-13b, falcon-7b, tinyllama-1.1b [-mha|-mqa|-gqaN]" },
        { .name = "--profile", .kind = KVR_CLI_CUSTOM, .dst = &a->profile, .meta = "P", .parse = parse_profile, .help = "a built-in profile name or a profile file" },
        { .name = "--ranks", .kind = KVR_CLI_INTS, .dst = &ranks, .meta = "LIST", .lo = 1, .hi = KVR_TUNE_MAX_RANKS, .help = "rank counts, e.g. 2,4,8" },
        { .name = "--ctx", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "LIST", .parse = parse_ctx, .numeric = true, .lo = 1, .hi = 1 << 24,
          .help = "prompt lengths: 1024,2048, 1k..16k (doubling), 4k..16k:4k (step); k = 1024" },
        { .name = "--strategy", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "LIST", .parse = parse_strategies,
          .help = "single,tsp,kvr-e,kvr-s,kvr-p,ring-kv,ring-q (default tsp,kvr-e,kvr-s,ring-kv);\nkvr-p interpolates --table" },
        { .name = "--table", .kind = KVR_CLI_IN, .dst = &a->table, .meta = "FILE", .help = "--simulate: the table kvr-p interpolates" },
        { .name = "--attn", .kind = KVR_CLI_CHOICE, .dst = &attn, .meta = "MODE", .choices = "causal|dense", .given = &a->attn_set,
          .help = "causal or dense (default: the profile's kernel; --measured: causal)" },
        { .name = "--cache-type", .kind = KVR_CLI_CHOICE, .dst = &a->cache, .meta = KVR_CLI_CACHE_CHOICES, .choices = KVR_CLI_CACHE_CHOICES,
          .help = "the KV cache's type, K and V (default f16): the bytes the simulator moves, and\nthe --measured runs' cache" },
        { .name = "--measured", .kind = KVR_CLI_SWITCH, .dst = &a->measured,
          .help = "the objective is real prefills (kvr_session, strategy kvr), median of RUNS (default 3)" },
        { .name = "-r", .kind = KVR_CLI_INT, .dst = &a->runs, .meta = "RUNS", .lo = 1, .hi = 1000000, .help = "runs per measured point (default 3)" },
        { .name = "-t", .kind = KVR_CLI_INT, .dst = &a->threads, .meta = "N", .lo = 1, .hi = KVR_MAX_THREADS, .help = "threads per rank when measuring (default: cores / ranks)" },
        { .name = "--min-stride", .kind = KVR_CLI_INT, .dst = &a->min_stride, .meta = "S", .lo = 1, .hi = 1000000,
          .help = "finest partition step in tokens (default: ctx/64 measured, ctx/512 modeled)" },
        { .name = "--grid-half", .kind = KVR_CLI_INT, .dst = &a->grid_half, .meta = "K", .lo = 1, .hi = 1000000,
          .help = "grid points per boundary and level: 2K+1 (default 2: the paper's 5)" },
        { .name = "--breakdown", .kind = KVR_CLI_SWITCH, .dst = &a->breakdown,
          .help = "--simulate: also every rank's finish, compute (and of it attention), comm, wait" },
        { .name = "--link-gbps", .kind = KVR_CLI_REAL, .dst = &a->link_gbps, .meta = "G", .lo = 0, .hi = 1e6, .open = KVR_CLI_LO_OPEN,
          .help = "--search, --simulate: the profile's link at G Gbit/s (kvr-bench / kvr-run --link-gbps)" },
        { .name = "-o", .kind = KVR_CLI_OUT, .dst = &a->out, .meta = "FILE", .help = "output file" },
    };
    const struct kvr_cli cli = { "kvr-tune", tune_synopsis, NULL, flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) return rc;
    a->n_ranks = ranks.n;
    memcpy(a->ranks, ranks.v, sizeof(int) * (size_t)ranks.n);
    a->attn = (enum kvr_attn_mode)attn;
    if (calibrate + search + simulate + !!a->show > 1) {
        return usage_error("%s", "one thing at a time: --calibrate, --search, --simulate or --show-profile");
    }
    a->mode = calibrate ? MODE_CALIBRATE : search ? MODE_SEARCH : simulate ? MODE_SIMULATE : a->show ? MODE_SHOW : MODE_NONE;
    return check_args(a);
}

static int check_args(struct args * a) {
    if (a->mode == MODE_NONE) return usage_error("%s", "say what to do: --calibrate, --search, --simulate or --show-profile");
    if (a->mode == MODE_SEARCH || a->mode == MODE_SIMULATE) {
        if (!a->model == !a->preset) return usage_error("%s", "give a model: -m MODEL.gguf or --preset NAME (one of them)");
        if (!a->n_ranks) return usage_error("%s", "--ranks is missing");
        if (!a->n_ctx) return usage_error("%s", "--ctx is missing");
    }
    if (a->mode == MODE_SEARCH) {
        if (!a->out) return usage_error("%s", "--search writes a table: -o TABLE is missing");
        if (a->measured == !!a->profile) return usage_error("%s", "--search needs one objective: --measured or --profile");
        if (a->measured && !a->model) return usage_error("%s", "--measured runs a real model: give -m MODEL.gguf");
    }
    if (a->mode == MODE_SIMULATE) {
        if (!a->profile) return usage_error("%s", "--simulate needs --profile FILE|NAME");
        if (a->measured) return usage_error("%s", "--measured belongs to --search");
        if (!a->n_strat) {
            const int def[] = { SS_TSP, SS_KVR_E, SS_KVR_S, SS_RING_KV };
            for (int k = 0; k < 4; k++) a->strat[a->n_strat++] = def[k];
        }
        for (int k = 0; k < a->n_strat; k++) {
            if (a->strat[k] == SS_KVR_P && !a->table) return usage_error("%s", "kvr-p interpolates a table: give --table FILE");
        }
    }
    return 0;
}

static void fmt_part(const int * c, int n, int T, char * buf, size_t cap) {
    int o = 0;
    buf[0] = 0;
    for (int r = 0; r < n && o < (int)cap - 12; r++) o += snprintf(buf + o, cap - (size_t)o, "%s%.3f", r ? "," : "", (double)c[r] / T);
}

//
// --calibrate, --show-profile
//

static int write_profile(const struct kvr_tune_profile * p, const char * out) {
    if (out) {
        if (kvr_tune_profile_save(p, out) != KVR_OK) {
            fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
            return 1;
        }
        fprintf(stderr, "kvr-tune: wrote %s\n", out);
        return 0;
    }
    // stdout: through a scratch file, so the format lives in one place
    const char * dir = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof(tmpl), "%s/kvr-tune-profile-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(tmpl);
    if (fd < 0) { fprintf(stderr, "kvr-tune: cannot create a scratch file: %s\n", strerror(errno)); return 1; }
    close(fd);
    int rc = kvr_tune_profile_save(p, tmpl);
    FILE * f = rc == KVR_OK ? fopen(tmpl, "r") : NULL;
    if (f) {
        char line[512];
        while (fgets(line, sizeof(line), f)) fputs(line, stdout);
        fclose(f);
    }
    remove(tmpl);
    if (rc != KVR_OK) { fprintf(stderr, "kvr-tune: %s\n", kvr_last_error()); return 1; }
    return 0;
}

//
// the model of --search and --simulate
//

struct model_src {
    struct kvr_model      * model;  // -m
    struct kvr_tune_model   tm;
};

static int load_model(const struct args * a, struct model_src * ms) {
    memset(ms, 0, sizeof(*ms));
    if (a->preset) {
        if (kvr_tune_model_preset(a->preset, &ms->tm) != KVR_OK) return usage_error("%s", kvr_last_error());
        return 0;
    }
    ms->model = kvr_model_load(a->model, NULL);
    if (!ms->model || kvr_tune_model_from(ms->model, &ms->tm) != KVR_OK) {
        fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
        return 1;
    }
    return 0;
}

static int do_calibrate(const struct args * a) {
    struct model_src ms = { 0 };
    if ((a->model || a->preset) && load_model(a, &ms)) return 1;
    struct kvr_tune_profile p;
    const int rc = kvr_tune_calibrate(&p, a->attn_set ? a->attn : KVR_ATTN_CAUSAL, a->model || a->preset ? &ms.tm : NULL,
                                      a->threads > 0 ? a->threads : 1, a->n_ranks > 0 ? a->ranks[0] : 1, stderr);
    if (ms.model) kvr_model_free(ms.model);
    if (rc != KVR_OK) {
        fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
        return 1;
    }
    return write_profile(&p, a->out);
}

//
// --search
//

struct measured {
    const struct kvr_model * m;
    const int32_t          * tokens;
    int                      T, runs, threads;
    enum kvr_attn_mode       attn;
    enum kvr_cache_type      cache;
};

static int cmp_double(const void * x, const void * y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

// TTFT of a real KV-Runahead prefill with this partition: the median of `runs` evals, each on a
// fresh set of ranks (an eval is a first prefill only on an empty cache)
static double measured_objective(const int * counts, int n_ranks, void * user) {
    const struct measured * ms = user;
    double t[64];
    const int runs = ms->runs < 64 ? ms->runs : 64;
    for (int i = 0; i < runs; i++) {
        struct kvr_session_params p = { .strategy = KVR_STRATEGY_KVR, .n_ranks = n_ranks, .n_threads = ms->threads, .n_ctx = ms->T,
                                     .partition = counts, .attn_mode = ms->attn, .timeout_s = 120,
                                     .cache_type_k = ms->cache, .cache_type_v = ms->cache };
        struct kvr_session * d = kvr_session_new(ms->m, &p);
        if (!d) return -1.0;
        const double t0 = kvr_time_ms();
        const float * logits = kvr_session_eval(d, ms->tokens, ms->T);
        t[i] = (kvr_time_ms() - t0) / 1e3;
        kvr_session_free(d);
        if (!logits) return -1.0;
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return runs % 2 ? t[runs / 2] : 0.5 * (t[runs / 2 - 1] + t[runs / 2]);
}

// --profile, with --link-gbps replacing its link bandwidth (the name says so: tables name it)
static int get_profile(const struct args * a, struct kvr_tune_profile * hw) {
    if (kvr_tune_profile_get(a->profile, hw) != KVR_OK) return KVR_ERR_ARG;
    if (a->link_gbps > 0) {
        hw->link_bw = a->link_gbps * 1e9 / 8.0;
        char name[64];
        snprintf(name, sizeof(name), "%.40s+%glink", hw->name, a->link_gbps);
        snprintf(hw->name, sizeof(hw->name), "%s", name);
    }
    return KVR_OK;
}

static int do_search(const struct args * a) {
    struct model_src ms;
    int rc = load_model(a, &ms);
    if (rc) return rc;
    struct kvr_tune_profile hw;
    const char * profile_name = "measured";
    if (!a->measured) {
        if (get_profile(a, &hw) != KVR_OK) {
            kvr_model_free(ms.model);
            return usage_error("%s", kvr_last_error());
        }
        profile_name = hw.name;
    }
    const enum kvr_attn_mode attn = a->attn_set ? a->attn : a->measured ? KVR_ATTN_CAUSAL : hw.attn_mode;
    // an existing table of the same hardware is updated, one of another is not mixed in
    struct kvr_tune_table table = { 0 };
    if (access(a->out, F_OK) == 0) {
        if (kvr_tune_table_load(a->out, &table) != KVR_OK) {
            fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
            kvr_model_free(ms.model);
            return 1;
        }
        if (strcmp(table.profile, profile_name) != 0) {
            fprintf(stderr, "kvr-tune: %s holds partitions for profile '%s', this search is for '%s': use another file\n",
                    a->out, table.profile, profile_name);
            kvr_tune_table_free(&table);
            kvr_model_free(ms.model);
            return 1;
        }
    }
    snprintf(table.profile, sizeof(table.profile), "%s", profile_name);
    int32_t * tokens = NULL;
    rc = 0;
    for (int ri = 0; ri < a->n_ranks && !rc; ri++) {
        const int N = a->ranks[ri];
        int prev[KVR_TUNE_MAX_RANKS], prev_T = 0;
        for (int ci = 0; ci < a->n_ctx && !rc; ci++) {
            const int T = a->ctx[ci];
            const int stride = a->min_stride ? a->min_stride : (T / (a->measured ? 64 : 512) > 0 ? T / (a->measured ? 64 : 512) : 1);
            struct measured me = { 0 };
            struct kvr_tune_sim_objective mo = { &ms.tm, &hw, T, attn, (enum kvr_cache_type)a->cache };
            if (a->measured) {
                free(tokens);
                tokens = malloc(sizeof(int32_t) * (size_t)T);
                uint64_t seed = 1234567 + (uint64_t)T;
                for (int i = 0; i < T; i++) {
                    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                    tokens[i] = (int32_t)((seed >> 33) % ms.model->hp.n_vocab);
                }
                const long cores = sysconf(_SC_NPROCESSORS_ONLN);
                me = (struct measured) { ms.model, tokens, T, a->runs, a->threads ? a->threads : (int)(cores / N > 0 ? cores / N : 1), attn,
                                         (enum kvr_cache_type)a->cache };
            }
            // the paper's advice: seed a search from the partition found for the previous length
            int start[KVR_TUNE_MAX_RANKS];
            const int * startp = NULL;
            if (prev_T && N > 2) {
                double fr[KVR_TUNE_MAX_RANKS];
                for (int r = 0; r < N; r++) fr[r] = (double)prev[r] / prev_T;
                kvr_tune_counts_from_fractions(fr, N, T, start);
                startp = start;
                for (int r = 0; r < N; r++) if (start[r] < 1) startp = NULL;
            }
            char label[160];
            snprintf(label, sizeof(label), "%s %d ranks %d tokens", ms.tm.name, N, T);
            struct kvr_tune_search_params sp = { .n_ranks = N, .n_tokens = T, .min_stride = stride, .grid_half = a->grid_half,
                                                 .start = startp, .objective = a->measured ? measured_objective : kvr_tune_objective_sim,
                                                 .user = a->measured ? (void *)&me : (void *)&mo, .progress = stderr, .label = label };
            struct kvr_tune_search_result res;
            if (kvr_tune_search(&sp, &res) != KVR_OK) {
                fprintf(stderr, "kvr-tune: %s: %s\n", label, kvr_last_error());
                rc = 1;
                break;
            }
            struct kvr_tune_entry e = { .n_ranks = N, .n_tokens = T, .ttft = res.cost };
            snprintf(e.model, sizeof(e.model), "%s", ms.tm.name);
            for (int r = 0; r < N; r++) e.fractions[r] = (double)res.counts[r] / T;
            char part[600];
            fmt_part(res.counts, N, T, part, sizeof(part));
            fprintf(stderr, "kvr-tune: %s: TTFT %.4f s at [%s] (stride %d, %lld evaluations, %.1f s)\n", label, res.cost, part, stride,
                    (long long)res.n_evals, res.seconds);
            // written after every entry: an interrupted search keeps what it found
            if (kvr_tune_table_add(&table, &e) != KVR_OK || kvr_tune_table_save(&table, a->out) != KVR_OK) {
                fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
                rc = 1;
            }
            memcpy(prev, res.counts, sizeof(int) * (size_t)N);
            prev_T = T;
        }
    }
    if (!rc) fprintf(stderr, "kvr-tune: wrote %s (%d entries)\n", a->out, table.n_entries);
    free(tokens);
    kvr_tune_table_free(&table);
    kvr_model_free(ms.model);
    return rc;
}

//
// --simulate
//

struct row {
    int    N, T, strat;
    struct kvr_tune_sim sim;
    int    counts[KVR_TUNE_MAX_RANKS];
    int    n_counts;
};

static int do_simulate(const struct args * a) {
    struct model_src ms;
    int rc = load_model(a, &ms);
    if (rc) return rc;
    struct kvr_tune_profile hw;
    if (get_profile(a, &hw) != KVR_OK) {
        kvr_model_free(ms.model);
        return usage_error("%s", kvr_last_error());
    }
    struct kvr_tune_table table = { 0 };
    if (a->table && kvr_tune_table_load(a->table, &table) != KVR_OK) {
        fprintf(stderr, "kvr-tune: %s\n", kvr_last_error());
        kvr_model_free(ms.model);
        return 1;
    }
    const enum kvr_attn_mode attn = a->attn_set ? a->attn : hw.attn_mode;
    const struct kvr_tune_model * m = &ms.tm;
    printf("model %s: %d layers, n_embd %d, heads %d/%d (head_dim %d), n_ff %d; profile %s; attention %s\n\n", m->name, m->n_layer,
           m->n_embd, m->n_head, m->n_head_kv, m->head_dim, m->n_ff, hw.name, attn == KVR_ATTN_DENSE ? "dense" : "causal");
    printf("| ranks | ctx | strategy | TTFT (s) | vs TSP | last rank compute / comm / wait (s) | partition |\n");
    printf("|---:|---:|---|---:|---:|---|---|\n");
    struct row * rows = NULL;
    int n_rows = 0;
    for (int ri = 0; ri < a->n_ranks && !rc; ri++) {
        const int N = a->ranks[ri];
        for (int ci = 0; ci < a->n_ctx && !rc; ci++) {
            const int T = a->ctx[ci];
            const int stride = a->min_stride ? a->min_stride : (T / 512 > 0 ? T / 512 : 1);
            double tsp = 0.0;
            int base = n_rows;
            for (int si = 0; si < a->n_strat && !rc; si++) {
                struct row * nr = realloc(rows, sizeof(*rows) * (size_t)(n_rows + 1));
                if (!nr) { fprintf(stderr, "kvr-tune: out of memory\n"); rc = 1; break; }
                rows = nr;
                struct row * w = &rows[n_rows];
                memset(w, 0, sizeof(*w));
                w->N = N; w->T = T; w->strat = a->strat[si];
                struct kvr_tune_plan pl = { .n_ranks = N, .n_tokens = T, .attn_mode = attn, .cache_type = (enum kvr_cache_type)a->cache };
                switch (w->strat) {
                    case SS_SINGLE:  pl.strategy = KVR_STRATEGY_SINGLE; break;
                    case SS_TSP:     pl.strategy = KVR_STRATEGY_TSP; break;
                    case SS_RING_KV: pl.strategy = KVR_STRATEGY_RING_KV; break;
                    case SS_RING_Q:  pl.strategy = KVR_STRATEGY_RING_Q; break;
                    default:         pl.strategy = KVR_STRATEGY_KVR; break;
                }
                if (w->strat == SS_KVR_S) {
                    char label[160];
                    snprintf(label, sizeof(label), "kvr-s %s %d ranks %d tokens", m->name, N, T);
                    struct kvr_tune_sim_objective o = { m, &hw, T, attn, (enum kvr_cache_type)a->cache };
                    struct kvr_tune_search_params sp = { .n_ranks = N, .n_tokens = T, .min_stride = stride, .grid_half = a->grid_half,
                                                         .objective = kvr_tune_objective_sim, .user = &o, .progress = stderr, .label = label };
                    struct kvr_tune_search_result res;
                    if (kvr_tune_search(&sp, &res) != KVR_OK) { fprintf(stderr, "kvr-tune: %s: %s\n", label, kvr_last_error()); rc = 1; break; }
                    memcpy(w->counts, res.counts, sizeof(int) * (size_t)N);
                    pl.counts = w->counts;
                } else if (w->strat == SS_KVR_P) {
                    double fr[KVR_TUNE_MAX_RANKS];
                    if (kvr_tune_table_lookup(&table, m->name, N, T, fr) != KVR_OK) {
                        fprintf(stderr, "kvr-tune: %s: %s\n", a->table, kvr_last_error());
                        rc = 1;
                        break;
                    }
                    kvr_tune_counts_from_fractions(fr, N, T, w->counts);
                    pl.counts = w->counts;
                }
                if (kvr_tune_simulate(m, &hw, &pl, &w->sim) != KVR_OK) {
                    fprintf(stderr, "kvr-tune: simulate %s %d ranks %d tokens: %s\n", ss_names[w->strat], N, T, kvr_last_error());
                    rc = 1;
                    break;
                }
                w->n_counts = w->sim.n_ranks;
                for (int r = 0; r < w->sim.n_ranks; r++) w->counts[r] = w->sim.ranks[r].tokens;
                if (w->strat == SS_TSP) tsp = w->sim.ttft;
                n_rows++;
            }
            if (rc) break;
            for (int i = base; i < n_rows; i++) {
                const struct row * w = &rows[i];
                const struct kvr_tune_rank * o = &w->sim.ranks[w->sim.owner];
                char part[600], vs[32] = "";
                fmt_part(w->counts, w->n_counts, T, part, sizeof(part));
                if (tsp > 0) snprintf(vs, sizeof(vs), "%.2fx", tsp / w->sim.ttft);
                printf("| %d | %d | %s | %.4f | %s | %.4f / %.4f / %.4f | %s |\n", N, T, ss_names[w->strat], w->sim.ttft, vs, o->compute,
                       o->comm, o->wait, part);
            }
            struct kvr_tune_bounds b;
            if (kvr_tune_bounds(m, &hw, N, T, attn, stride, &b) != KVR_OK) {
                fprintf(stderr, "kvr-tune: bounds %d ranks %d tokens: %s\n", N, T, kvr_last_error());
                rc = 1;
                break;
            }
            char part[600], vs[32] = "";
            if (tsp > 0) snprintf(vs, sizeof(vs), "%.2fx", tsp / b.ttft_star);
            printf("| %d | %d | TTFT*(p) Eq.3 | %.4f | %s | | TTFT(1) = %.4f |\n", N, T, b.ttft_star, vs, b.ttft_1);
            fmt_part(b.counts_free, N, T, part, sizeof(part));
            if (tsp > 0) snprintf(vs, sizeof(vs), "%.2fx", tsp / b.ttft_free);
            printf("| %d | %d | TTFT(p) free comm | %.4f | %s | | %s |\n", N, T, b.ttft_free, vs, part);
            fflush(stdout);
        }
    }
    if (!rc && a->breakdown) {
        printf("\n| ranks | ctx | strategy | rank | tokens | finish (s) | compute | of it attention | comm | wait | attn pairs | kv rows sent | kv rows recv |\n");
        printf("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (int i = 0; i < n_rows; i++) {
            const struct row * w = &rows[i];
            for (int r = 0; r < w->sim.n_ranks; r++) {
                const struct kvr_tune_rank * k = &w->sim.ranks[r];
                printf("| %d | %d | %s | %d | %d | %.4f | %.4f | %.4f | %.4f | %.4f | %lld | %lld | %lld |\n", w->N, w->T, ss_names[w->strat],
                       r, k->tokens, k->finish, k->compute, k->attn, k->comm, k->wait, (long long)k->attn_dot_dense, (long long)k->kv_rows_sent,
                       (long long)k->kv_rows_recv);
            }
        }
    }
    free(rows);
    kvr_tune_table_free(&table);
    kvr_model_free(ms.model);
    return rc;
}

int main(int argc, char ** argv) {
    kvr_blas_reexec(argv); // an OpenBLAS older than this CPU: its vector kernels, named before it loads them
    struct args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;
    switch (a.mode) {
        case MODE_CALIBRATE: return do_calibrate(&a);
        case MODE_SEARCH:    return do_search(&a);
        case MODE_SIMULATE:  return do_simulate(&a);
        case MODE_SHOW: {
            struct kvr_tune_profile p;
            if (kvr_tune_profile_builtin(a.show, &p) != KVR_OK) return usage_error("%s", kvr_last_error());
            return write_profile(&p, a.out);
        }
        default: break;
    }
    return 2;
}
