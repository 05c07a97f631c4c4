// tools/kvr-bench.c - time-to-first-token benchmarks: sweeps prompt lengths x strategies x
// ranks (x emulated links), runs every point r times, and prints a markdown table (median TTFT,
// min-max, prefill tokens/s, the FLOP rate it implies, speedups against single and tsp), or CSV /
// JSON, and --svg draws it. kvr comes with three partitions: kvr-e (even), kvr-s (the searched
// partition of this length from a kvr-tune table) and kvr-p (interpolated from the table's other
// lengths, as a length never searched would be). --predict puts the simulator's TTFT beside every
// measured one (calibrated here, in-process, for each thread count), --simulate PROFILE fills the
// table from the simulator alone. --sgemm also measures what OpenBLAS sgemm reaches on the
// model's prefill shapes, so the table can say which fraction of that peak the prefill turns into
// useful FLOPs.
//
// --decode N also times N decode steps after each timed prefill (tg N after a prompt of P, each
// step's token the argmax of the last logits) and puts decode tokens/s beside the prefill, with the
// memory-bandwidth floor: what a STREAM-like read of a buffer far larger than the caches reaches
// with the same threads, over the bytes one step must read (every weight matrix once, the KV cache
// rows attention reads). A second table splits a decode step's time: matmuls, attention, the other
// ops, the eval's fixed costs (graph build, planning, placement, starting the threads) and what
// happens outside the eval (the argmax, the driver); a third names the other ops by kind.
//
// Prompts are random token ids (seeded), so no tokenizer work is timed. --backend cuda times the
// GPU instead (make gpu-check's speed table, which puts the GPU's own bounds beside it).

#define _GNU_SOURCE // pthread_setaffinity_np, sched_getaffinity

#include "kvr.h"
#include "kvr-cli.h"

#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdatomic.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void openblas_set_num_threads(int n);

// a strategy as the bench names it: kvr splits into its three partition sources
enum part_src { PART_EVEN, PART_S, PART_P };
struct bstrat {
    char              name[16];
    enum kvr_strategy strat;
    enum part_src     part;
};

struct bench_args {
    const char * model;
    int          ctx[32], n_ctx;
    struct bstrat strat[16];
    int          n_strat;
    int          ranks[16], n_ranks;
    int          threads;        // per rank (0: cores / ranks)
    int          single_threads[4], n_single_threads; // single's thread counts (default: all cores)
    int          reps, warmup;
    uint64_t     seed;
    bool         sgemm;
    struct kvr_cli_arith arith;  // --exact, --q8-act: quantized matmuls' arithmetic (prefill and decode)
    bool         mmap;           // weights left in the file's mapping (kvr_model_params.mmap)
    const char * backend;        // what runs the model (NULL: the CPU)
    bool         replicate;      // --replicate: each rank's new rows also go to its successor's replica
    enum kvr_type kernel_types[KVR_TYPE_COUNT]; // --kernels: the weight types to time (no model)
    int          n_kernel_types;
    int          decode;         // decode steps timed after each prefill (0: none)
    enum kvr_attn_mode attn;
    enum kvr_cache_type caches[KVR_CACHE_TYPE_COUNT]; // --cache-type: the KV cache types to sweep (K and V alike)
    int          n_caches;
    double       links[8];       // emulated link Gbit/s to sweep (0: none)
    int          n_links;
    double       link_noise;
    const char * tables[8];      // kvr-s / kvr-p: one kvr-tune table per link (or one for all)
    int          n_tables;
    bool         predict;        // the simulator's TTFT beside the measured one
    const char * profile;        // --predict with this profile instead of calibrating here
    const char * simulate;       // no runs: the simulator with this profile fills the table
    const char * format;         // md, csv, json
    const char * svg;
};

static const char * const bench_synopsis = "usage: kvr-bench -m MODEL.gguf [options]";

// --kernels LIST: weight type names, or "all" (every type kvr can write)
static int parse_kernel_types(const char * value, void * dst, char * why, size_t cap) {
    struct bench_args * a = dst;
    a->n_kernel_types = 0;
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", value);
    for (char * save = NULL, * tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int t = 0; t < KVR_TYPE_COUNT && a->n_kernel_types < KVR_TYPE_COUNT; t++) {
            if (!kvr_type_supported((enum kvr_type)t) || t == KVR_TYPE_F32) continue;
            if (!strcmp(tok, "all") || !strcmp(tok, kvr_type_name((enum kvr_type)t))) {
                float probe[256] = { 0 };
                uint8_t blk[1024];
                if (kvr_from_float((enum kvr_type)t, probe, blk, 256) == 0) continue; // a type kvr cannot write
                a->kernel_types[a->n_kernel_types++] = (enum kvr_type)t;
                found++;
            }
        }
        if (!found) {
            snprintf(why, cap, "'%s' is not a weight type kvr writes (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K ... q6_K, or all)", tok);
            return -1;
        }
    }
    return 0;
}

// --cache-type LIST: KV cache types (f16, f32, bf16, q8_0), each a series of points
static int parse_caches(const char * value, void * dst, char * why, size_t cap) {
    struct bench_args * a = dst;
    a->n_caches = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", value);
    for (char * save = NULL, * tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        enum kvr_cache_type t;
        if (kvr_cache_type_parse(tok, &t) != KVR_OK || a->n_caches == KVR_CACHE_TYPE_COUNT) {
            snprintf(why, cap, "'%s' is not a KV cache type (f16, f32, bf16, q8_0), or one too many", tok);
            return -1;
        }
        a->caches[a->n_caches++] = t;
    }
    return a->n_caches > 0 ? 0 : (snprintf(why, cap, "no cache type"), -1);
}

static int parse_strategy(const char * tok, struct bstrat * b, char * why, size_t cap) {
    memset(b, 0, sizeof(*b));
    snprintf(b->name, sizeof(b->name), "%s", tok);
    if (!strcmp(tok, "kvr-e") || !strcmp(tok, "kvr")) { b->strat = KVR_STRATEGY_KVR; snprintf(b->name, sizeof(b->name), "kvr-e"); return 0; }
    if (!strcmp(tok, "kvr-s")) { b->strat = KVR_STRATEGY_KVR; b->part = PART_S; return 0; }
    if (!strcmp(tok, "kvr-p")) { b->strat = KVR_STRATEGY_KVR; b->part = PART_P; return 0; }
    if (kvr_strategy_parse(tok, &b->strat) != KVR_OK) {
        snprintf(why, cap, "%s (or kvr-e, kvr-s, kvr-p)", kvr_last_error());
        return -1;
    }
    return 0;
}

// --strategy single,tsp,kvr-s: into a->strat
static int parse_strategies(const char * v, void * dst, char * why, size_t cap) {
    struct bench_args * a = dst;
    char buf[256];
    if (strlen(v) >= sizeof(buf)) { snprintf(why, cap, "too long"); return -1; }
    snprintf(buf, sizeof(buf), "%s", v);
    a->n_strat = 0;
    char * save = NULL;
    for (char * tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (a->n_strat == 16) { snprintf(why, cap, "more than 16 strategies"); return -1; }
        if (parse_strategy(tok, &a->strat[a->n_strat++], why, cap)) return -1;
    }
    if (a->n_strat == 0) { snprintf(why, cap, "no strategy"); return -1; }
    return 0;
}

// --table A.txt,B.txt: files that exist, into a->tables
static int parse_tables(const char * v, void * dst, char * why, size_t cap) {
    struct bench_args * a = dst;
    static char buf[4096];
    if (strlen(v) >= sizeof(buf)) { snprintf(why, cap, "too long"); return -1; }
    snprintf(buf, sizeof(buf), "%s", v);
    a->n_tables = 0;
    char * save = NULL;
    for (char * tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char sub[256];
        if (a->n_tables == 8) { snprintf(why, cap, "more than 8 tables"); return -1; }
        if (kvr_cli_check_in(tok, sub, sizeof(sub))) { snprintf(why, cap, "%.200s: %s", tok, sub); return -1; }
        a->tables[a->n_tables++] = tok;
    }
    if (a->n_tables == 0) { snprintf(why, cap, "no table"); return -1; }
    return 0;
}

// --profile, --simulate: a built-in profile's name or a profile file
static int parse_profile(const char * v, void * dst, char * why, size_t cap) {
    struct kvr_tune_profile p;
    if (kvr_tune_profile_get(v, &p) != KVR_OK) { snprintf(why, cap, "%s", kvr_last_error()); return -1; }
    *(const char **)dst = v;
    return 0;
}

static int parse_args(int argc, char ** argv, struct bench_args * a) {
    *a = (struct bench_args) { .reps = 3, .warmup = 1, .seed = 1, .format = "md", .caches = { KVR_CACHE_F16 }, .n_caches = 1 };
    parse_strategy("single", &a->strat[0], NULL, 0); a->n_strat = 1;
    struct kvr_cli_ints ctx = { 2, { 512, 2048 } }, ranks = { 1, { 2 } }, single = { 0, { 0 } };
    struct kvr_cli_reals links = { 1, { 0 } };
    int format = 0, attn = 0;
    const struct kvr_cli_flag flags[] = {
        { .name = "-m", .kind = KVR_CLI_IN, .dst = &a->model, .meta = "FILE", .once = true, .help = "model (GGUF)" },
        { .name = "--ctx", .kind = KVR_CLI_INTS, .dst = &ctx, .meta = "LIST", .lo = 1, .hi = 1 << 24, .k_suffix = true, .max_n = 32,
          .help = "prompt lengths (default 512,2048; k suffix allowed: 1k,4k)" },
        { .name = "--strategy", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "LIST", .parse = parse_strategies,
          .help = "single,tsp,kvr (= kvr-e, even),kvr-s,kvr-p,ring-kv,ring-q,auto (default single)" },
        { .name = "--table", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "LIST", .parse = parse_tables,
          .help = "kvr-tune --search tables for kvr-s (the entry of this very length) and kvr-p\n(interpolated from the other lengths only); one per --link-gbps value, or one" },
        { .name = "--ranks", .kind = KVR_CLI_INTS, .dst = &ranks, .meta = "LIST", .lo = 1, .hi = 16, .max_n = 16,
          .help = "rank counts for the parallel strategies (default 2)" },
        { .name = "-t", .kind = KVR_CLI_INT, .dst = &a->threads, .meta = "N", .lo = 1, .hi = KVR_MAX_THREADS, .help = "threads per rank (default: cores / ranks)" },
        { .name = "--single-threads", .kind = KVR_CLI_INTS, .dst = &single, .meta = "L", .lo = 1, .hi = KVR_MAX_THREADS, .max_n = 4,
          .help = "single's thread counts, e.g. 2,1 (default: all cores)" },
        { .name = "-r", .kind = KVR_CLI_INT, .dst = &a->reps, .meta = "N", .lo = 1, .hi = 1000, .help = "runs per point (default 3); the table shows the median and the range" },
        { .name = "--backend", .kind = KVR_CLI_CUSTOM, .dst = &a->backend, .meta = "NAME", .parse = kvr_cli_backend,
          .help = "what runs the model (default cpu; make gpu-check times cuda); another backend than\nthe CPU has no host memory-bandwidth floor: its column stays 0" },
        { .name = "--warmup", .kind = KVR_CLI_INT, .dst = &a->warmup, .meta = "N", .lo = 0, .hi = 100, .help = "untimed prefills before each point's runs (default 1)" },
        { .name = "--attn", .kind = KVR_CLI_CHOICE, .dst = &attn, .meta = "causal|dense", .choices = "causal|dense", .help = "attention kernel mode (default causal)" },
        { .name = "--cache-type", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "LIST", .parse = parse_caches,
          .help = "KV cache types to sweep, K and V alike: f16,f32,bf16,q8_0 (default f16); each\nis its own series (the simulator's bytes follow it too)" },
        { .name = "--link-gbps", .kind = KVR_CLI_REALS, .dst = &links, .meta = "LIST", .lo = 0, .hi = 1e6, .max_n = 8,
          .help = "emulated links between ranks to sweep, 0 for none (default 0)" },
        { .name = "--link-noise", .kind = KVR_CLI_REAL, .dst = &a->link_noise, .meta = "X", .lo = 1, .hi = 1e6,
          .help = "with a link: one random neighbour pair per run is X times slower" },
        { .name = "--predict", .kind = KVR_CLI_SWITCH, .dst = &a->predict,
          .help = "also the simulator's TTFT of every point, calibrated here on the model's shapes\nfor each ranks x threads (kvr-tune --calibrate), with the point's emulated link" },
        { .name = "--profile", .kind = KVR_CLI_CUSTOM, .dst = &a->profile, .meta = "FILE", .parse = parse_profile,
          .help = "--predict with this hardware profile instead" },
        { .name = "--simulate", .kind = KVR_CLI_CUSTOM, .dst = &a->simulate, .meta = "P", .parse = parse_profile,
          .help = "run nothing: the simulator with profile P (a file or a built-in name) fills the table" },
        { .name = "--svg", .kind = KVR_CLI_OUT, .dst = &a->svg, .meta = "FILE", .help = "draw TTFT against prompt length, one line per strategy (and ranks, link)" },
        { .name = "--mmap", .kind = KVR_CLI_SWITCH, .dst = &a->mmap,
          .help = "leave the weights where the file is mapped (no copy, pages shared with other\nprocesses, rows as the file has them) instead of reading them into memory of 2 MiB\npages, the quantized matrices in tiles of 16 rows, which the kernels read faster" },
        KVR_CLI_ARITH_FLAGS(&a->arith),
        { .name = "--replicate", .kind = KVR_CLI_SWITCH, .dst = &a->replicate,
          .help = "ranks: every rank's new cache rows also go to a replica in its ring\nsuccessor's memory, as kvr-run --replicate (what failover costs)" },
        { .name = "--sgemm", .kind = KVR_CLI_SWITCH, .dst = &a->sgemm, .help = "also measure OpenBLAS sgemm on the model's shapes and report the fraction" },
        { .name = "--decode", .kind = KVR_CLI_INT, .dst = &a->decode, .meta = "N", .lo = 0, .hi = 1 << 20,
          .help = "also time N decode steps after each prefill (tg N after a prompt of P): decode\ntok/s beside prefill, the memory-bandwidth floor, where a step's time goes" },
        { .name = "--kernels", .kind = KVR_CLI_CUSTOM, .dst = a, .meta = "TYPES", .parse = parse_kernel_types,
          .help = "no model: time the decode matmul kernels of these weight types (f16,q8_0,q4_0,...\nor all), in and out of cache, with 1 thread and -t (default: all cores)" },
        { .name = "-o", .kind = KVR_CLI_CHOICE, .dst = &format, .meta = "md|csv|json", .choices = "md|csv|json", .help = "output format (default md)" },
        { .name = "--seed", .kind = KVR_CLI_U64, .dst = &a->seed, .meta = "N", .help = "prompt token seed (default 1)" },
    };
    const struct kvr_cli cli = { "kvr-bench", bench_synopsis, NULL, flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) return rc;
    a->n_ctx = ctx.n;
    memcpy(a->ctx, ctx.v, sizeof(int) * (size_t)ctx.n);
    a->n_ranks = ranks.n;
    memcpy(a->ranks, ranks.v, sizeof(int) * (size_t)ranks.n);
    a->n_single_threads = single.n;
    memcpy(a->single_threads, single.v, sizeof(int) * (size_t)single.n);
    a->n_links = links.n;
    memcpy(a->links, links.v, sizeof(double) * (size_t)links.n);
    a->format = format == 0 ? "md" : format == 1 ? "csv" : "json";
    a->attn = (enum kvr_attn_mode)attn;
    if (a->profile) a->predict = true;
    if (!a->model && a->n_kernel_types == 0) return kvr_cli_fail(&cli, "no model: give -m FILE (or --kernels TYPES)");
    if (kvr_cli_arith_check(&cli, &a->arith)) return 2;
    for (int s = 0; s < a->n_strat; s++) {
        if (a->strat[s].part != PART_EVEN && a->n_tables == 0) {
            return kvr_cli_fail(&cli, "%s takes its partitions from a table: give --table FILE (kvr-tune --search writes one)", a->strat[s].name);
        }
    }
    if (a->n_tables > 1 && a->n_tables != a->n_links) {
        return kvr_cli_fail(&cli, "--table has %d files for %d --link-gbps values: give one, or one per link", a->n_tables, a->n_links);
    }
    if (a->simulate && a->predict) {
        return kvr_cli_fail(&cli, "--simulate runs nothing, so there is nothing to --predict beside");
    }
    if (a->link_noise > 0) {
        bool link = false;
        for (int i = 0; i < a->n_links; i++) link = link || a->links[i] > 0;
        if (!link) return kvr_cli_fail(&cli, "--link-noise slows an emulated link: give --link-gbps too");
    }
    return 0;
}

static int cmp_double(const void * x, const void * y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

// useful FLOPs of a prefill of T tokens: the projections and the FFN of every token, the
// attention pairs causality needs (QK and PV), and the logits of the last token
static double prefill_flops(const struct kvr_hparams * hp, int T) {
    const double E = hp->n_embd, kv = (double)hp->head_dim * hp->n_head_kv, F = hp->n_ff;
    const double per_tok = hp->arch == KVR_ARCH_FALCON ? 2.0 * (E * (E + 2 * kv) + E * E + 2 * E * F)
                                                       : 2.0 * (2 * E * E + 2 * E * kv + 3 * E * F);
    const double pairs = (double)T * (T + 1) / 2.0;
    const double attn = 4.0 * pairs * hp->head_dim * hp->n_head;
    return hp->n_layer * (per_tok * T + attn) + 2.0 * E * hp->n_vocab;
}

// what sgemm reaches on the biggest prefill shapes (x W^T with T rows), best of 3: each of the
// `threads` threads runs single-threaded sgemm on its share of the weight rows at the same time,
// which is how kvr's matmul (and OpenBLAS's own threading) splits the work
struct sgemm_job {
    int T, N, K;
    const float * X, * W;
    float * Y;
};

static void * sgemm_thread(void * arg) {
    const struct sgemm_job * j = arg;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T, j->N, j->K, 1.0f, j->X, j->K, j->W, j->K, 0.0f, j->Y, j->N);
    return NULL;
}

static double sgemm_peak(const struct kvr_hparams * hp, int T, int threads) {
    const int shapes[2][2] = { { (int)hp->n_ff, (int)hp->n_embd }, { (int)hp->n_embd, (int)hp->n_ff } };
    double best = 0.0;
    openblas_set_num_threads(1);
    for (int s = 0; s < 2; s++) {
        const int N = shapes[s][0], K = shapes[s][1];
        float * X = malloc(sizeof(float) * (size_t)T * K);
        float * W = malloc(sizeof(float) * (size_t)N * K);
        float * Y = malloc(sizeof(float) * (size_t)T * N);
        for (size_t i = 0; i < (size_t)T * K; i++) X[i] = (float)((i * 7919) % 1000) * 1e-3f;
        for (size_t i = 0; i < (size_t)N * K; i++) W[i] = (float)((i * 104729) % 1000) * 1e-3f;
        for (int r = 0; r < 3; r++) {
            pthread_t th[64];
            struct sgemm_job jobs[64];
            const int nt = threads < 64 ? threads : 64;
            for (int t = 0; t < nt; t++) { // each thread writes its own block of rows (touched first)
                const int n0 = N * t / nt, n1 = N * (t + 1) / nt;
                jobs[t] = (struct sgemm_job) { T, n1 - n0, K, X, W + (size_t)n0 * K, calloc((size_t)T * (n1 - n0), sizeof(float)) };
            }
            double t0 = kvr_time_ms();
            for (int t = 0; t < nt; t++) pthread_create(&th[t], NULL, sgemm_thread, &jobs[t]);
            for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
            double gf = 2.0 * T * N * K / ((kvr_time_ms() - t0) * 1e6);
            for (int t = 0; t < nt; t++) free(jobs[t].Y);
            if (gf > best) best = gf;
        }
        free(X); free(W); free(Y);
    }
    return best;
}

// The memory-bandwidth floor of a decode step, which must read every weight once: GB/s of a plain
// read of a 256 MiB buffer (8x the largest cache here) by `threads` threads at once, each summing
// its contiguous share with 8 independent vector adds (far more add throughput than any memory
// delivers, so the read is all that is timed). What makes it a number to trust:
//   - each thread first writes the pages it will read (page faults and first-touch placement happen
//     before the clock starts) and reads them once untimed;
//   - threads are pinned one per CPU (while there are enough CPUs): the floor is what the memory
//     delivers to that many cores, and an unpinned pass that the scheduler happens to stack on one
//     core measures the scheduler instead (kvr's own threads are not pinned: on a busy machine the
//     decode can fall short of the floor for that reason, never exceed it for it);
//   - the threads stay alive across passes and start each pass together (a spin on a counter, no
//     thread creation inside the timing), and a pass ends when the slowest thread ends;
//   - at least 20 passes and at least 1 s of them (--kernels), or for a decode point at least 20
//     passes and 0.3 s before each of its runs and after the last (the machine's memory speed here
//     moves with other tenants' load from minute to minute: a floor read after all the runs can
//     meet another machine than they did); the floor is the best pass (an upper bound on what a
//     read of this size reaches), and the median and worst pass are kept so the spread shows.
//     The decode table gives the decode against both: a pass takes a few ms and a decode run
//     seconds, and the best pass of a few hundred is 5-16% above their median here, an outlier no
//     run of seconds sustains; "of its median pass" is the like-for-like figure, the best pass the
//     strict one. The buffer exists only while it is read, never beside the model during a run.
// The buffer is in the pages the weights are in: 2 MiB pages (transparent huge pages, advised) when
// the model's weights were read into such memory (kvr_model_params.mmap off, the default), 4 KiB
// pages for a file mapping (--mmap) and for --kernels' buffers. (Here a read in 2 MiB pages is
// ~15% faster: the floor rises with the weights.)
#define STREAM_BYTES ((size_t)256 << 20)
#define FLOOR_MS_BETWEEN_RUNS 300.0 // a decode point's floor: this long (and >= 20 passes) before each run and after the last
#define FLOOR_MAX_PASSES 8192

struct stream_bw {
    double best, median, worst; // GB/s of a pass
    int    passes;
    bool   pinned;
};

struct stream_shared {
    _Atomic int go;       // the pass the helper threads may start (-1: stop)
    _Atomic int done;     // helper threads finished with the current pass
};

struct stream_job {
    struct stream_shared * sh;
    float       * p;
    size_t        n;
    int           cpu;      // pin to this CPU (-1: not pinned)
    bool          pinned;
    float         sum;
};

static float stream_sum(const float * p, size_t n) {
    float s[8][8] = { { 0 } }; // 8 independent 8-wide sums: the compiler keeps them in vector registers
    for (size_t i = 0; i + 64 <= n; i += 64) {
        for (int k = 0; k < 8; k++) {
            for (int l = 0; l < 8; l++) s[k][l] += p[i + 8 * k + l];
        }
    }
    float t = 0;
    for (int k = 0; k < 8; k++) for (int l = 0; l < 8; l++) t += s[k][l];
    return t;
}

static void stream_prepare(struct stream_job * j) {
    if (j->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(j->cpu, &set);
        j->pinned = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
    }
    for (size_t i = 0; i < j->n; i++) j->p[i] = (float)(i & 7); // this thread's pages, touched here
    j->sum = stream_sum(j->p, j->n);                              // and read once, untimed
}

// A helper thread: its share of every pass the calling thread starts (which reads share 0 itself).
static void * stream_thread(void * arg) {
    struct stream_job * j = arg;
    stream_prepare(j);
    atomic_fetch_add(&j->sh->done, 1);
    for (int pass = 1;; pass++) {
        int go;
        while ((go = atomic_load(&j->sh->go)) != pass && go >= 0) { }
        if (go < 0) break;
        j->sum += stream_sum(j->p, j->n);
        atomic_fetch_add(&j->sh->done, 1);
    }
    return NULL;
}

// Reads the buffer pass after pass, at least 20 passes and at least min_ms of them, and appends each
// pass's GB/s to g (n of them so far, room for max); the helper threads and the buffer live only
// for the call. Returns the new count; *pinned says whether every thread was pinned.
static int stream_read_passes(int threads, bool huge, double min_ms, double * g, int n, int max, bool * pinned) {
    const size_t nf = STREAM_BYTES / sizeof(float), align = (size_t)2 << 20;
    uint8_t * raw = mmap(NULL, STREAM_BYTES + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return n;
    float * buf = (float *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    madvise(buf, STREAM_BYTES, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    const int nt = threads < 64 ? threads : 64;
    cpu_set_t allowed;
    int cpus[64], n_cpus = 0;
    const bool have_mask = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
    if (have_mask) {
        for (int c = 0; c < CPU_SETSIZE && n_cpus < 64; c++) if (CPU_ISSET(c, &allowed)) cpus[n_cpus++] = c;
    }
    struct stream_shared sh = { 0, 0 };
    struct stream_job jobs[64];
    pthread_t th[64];
    for (int t = 0; t < nt; t++) jobs[t] = (struct stream_job) { &sh, buf + nf * t / nt, nf * (t + 1) / nt - nf * t / nt, nt <= n_cpus ? cpus[t] : -1, false, 0 };
    int helpers = 0;
    for (int t = 1; t < nt; t++, helpers++) {
        if (pthread_create(&th[t], NULL, stream_thread, &jobs[t]) != 0) break;
    }
    stream_prepare(&jobs[0]); // this thread reads share 0 (pinned until the end, then given its CPUs back)
    // a helper that cannot finish a pass in 10 s (it never should) ends the measurement instead of hanging it
    bool ok = helpers == nt - 1;
    for (double t0 = kvr_time_ms(); ok && atomic_load(&sh.done) < helpers;) ok = kvr_time_ms() - t0 < 10000.0;
    const double t_start = kvr_time_ms();
    for (int pass = 1, np = 0; ok && n < max && (np < 20 || kvr_time_ms() - t_start < min_ms); pass++, np++) {
        atomic_store(&sh.done, 0);
        const double t0 = kvr_time_ms();
        atomic_store(&sh.go, pass);
        jobs[0].sum += stream_sum(jobs[0].p, jobs[0].n);
        while (atomic_load(&sh.done) < helpers && (ok = kvr_time_ms() - t0 < 10000.0)) { }
        if (ok) g[n++] = (double)STREAM_BYTES / ((kvr_time_ms() - t0) * 1e6);
    }
    atomic_store(&sh.go, -1);
    float check = 0;
    *pinned = true;
    for (int t = 0; t <= helpers; t++) {
        if (t > 0) pthread_join(th[t], NULL);
        check += jobs[t].sum;
        *pinned = *pinned && jobs[t].pinned;
    }
    if (have_mask) pthread_setaffinity_np(pthread_self(), sizeof(allowed), &allowed);
    if (check < 0) fprintf(stderr, "kvr-bench: stream read: impossible sum\n"); // keeps the reads
    munmap(raw, STREAM_BYTES + align);
    return n;
}

// best, median and worst of n passes (sorts g)
static struct stream_bw stream_summary(double * g, int n, bool pinned) {
    struct stream_bw bw = { 0 };
    if (n == 0) return bw;
    qsort(g, (size_t)n, sizeof(double), cmp_double);
    bw.best = g[n - 1];
    bw.median = g[n / 2];
    bw.worst = g[0];
    bw.passes = n;
    bw.pinned = pinned;
    return bw;
}

static struct stream_bw stream_read_gbps(int threads, bool huge) {
    static double g[4096];
    bool pinned = false;
    const int n = stream_read_passes(threads, huge, 1000.0, g, 0, 4096, &pinned);
    return stream_summary(g, n, pinned);
}

// --kernels: the decode matmul kernels alone, per weight type, no model. One matmul of a K x N
// matrix of the type (K = 2048, tinyllama-1.1b's width) with one token, as a decode step runs it,
// on the CPU backend with 1 thread and with `threads`:
//   - in cache: N rows making 256 KiB a thread (each thread's rows stay in its 1 MiB L2 here), the
//     same matmul 16 times a graph: the kernel's own speed, GB/s of weights a thread in CPU time
//     (which another process on the machine hardly changes) and the wall-clock GB/s;
//   - out of cache: 256 MiB of weights, one matmul a graph: GB/s in wall time (what a decode step
//     gets; compare it with the floor) and a thread's GB/s in CPU time.
// The weights are 64 rows quantized from normal values, repeated: the memory does not care.
struct kern_time {
    double gbps_wall, gbps_cpu; // GB/s of weights: wall, and per thread of CPU time
};

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Times `copies` matmuls of one K x N matrix of `type` a graph, at least min_runs graphs and min_ms.
static int kern_run(enum kvr_type type, int64_t K, int64_t N, int copies, int threads, bool q8_act, int min_runs, double min_ms, struct kern_time * out) {
    const size_t rb = kvr_row_size(type, K), wbytes = rb * (size_t)N;
    uint8_t * wh = malloc(wbytes);
    float * row = malloc(sizeof(float) * (size_t)K), * xh = malloc(sizeof(float) * (size_t)K);
    struct kvr_context * ctx = kvr_init((size_t)1 << 20, true);
    if (!wh || !row || !xh || !ctx) {
        free(wh); free(row); free(xh);
        if (ctx) kvr_free(ctx);
        return kvr_error(KVR_ERR_NOMEM, "kernels: no memory for %zu MiB of %s weights", wbytes >> 20, kvr_type_name(type));
    }
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int64_t n = 0; n < N; n++) {
        if (n >= 64) {
            memcpy(wh + (size_t)n * rb, wh + (size_t)(n % 64) * rb, rb);
            continue;
        }
        for (int64_t k = 0; k < K; k++) { // sums of 4 uniforms: roughly normal, spread 0.05
            double u = 0;
            for (int j = 0; j < 4; j++) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; u += (double)(r >> 11) / 9007199254740992.0; }
            row[k] = (float)((u - 2.0) * 0.085);
        }
        kvr_from_float(type, row, wh + (size_t)n * rb, K);
    }
    for (int64_t k = 0; k < K; k++) xh[k] = (float)(((k * 37) % 101) - 50) / 25.0f;
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, type, K, N);
    struct kvr_tensor * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, 1);
    struct kvr_graph * g = kvr_graph_new(ctx, 2 * copies + 8);
    for (int c = 0; c < copies; c++) {
        struct kvr_tensor * y = kvr_mul_mat(ctx, w, x);
        y->flags |= KVR_FLAG_OUTPUT;
        kvr_graph_expand(g, y);
    }
    struct kvr_backend * be = kvr_backend_new("cpu", &(struct kvr_backend_params) { .n_threads = threads, .q8_activations = q8_act });
    struct kvr_buffer * buf = be ? kvr_backend_alloc_buffer(be, kvr_graph_plan(g)) : NULL;
    int rc = buf ? KVR_OK : KVR_ERR_NOMEM;
    if (buf) {
        kvr_graph_place(g, buf); // the weights and x are the graph's inputs: in the buffer too
        kvr_backend_tensor_set(w, wh, 0, wbytes);
        kvr_backend_tensor_set(x, xh, 0, sizeof(float) * (size_t)K);
        rc = kvr_backend_graph_compute(be, g); // warm: the threads, the caches
        int runs = 0;
        const double t0 = kvr_time_ms(), c0 = cpu_seconds();
        while (rc == KVR_OK && (runs < min_runs || kvr_time_ms() - t0 < min_ms)) {
            rc = kvr_backend_graph_compute(be, g);
            runs++;
        }
        const double ms = kvr_time_ms() - t0, cpu = cpu_seconds() - c0;
        const double bytes = (double)wbytes * copies * runs;
        out->gbps_wall = bytes / (ms * 1e6);
        out->gbps_cpu = bytes / (cpu * 1e9); // the CPU time of all threads: GB/s a thread
    }
    if (buf) kvr_buffer_free(buf);
    if (be) kvr_backend_free(be);
    kvr_free(ctx);
    free(wh); free(row); free(xh);
    return rc;
}

static int run_kernels(const struct bench_args * a, int threads) {
    const int64_t K = 2048;
    const struct stream_bw floor = stream_read_gbps(threads, false);
    printf("decode matmul kernels: one token times a %lld-wide matrix; GB/s of weights%s\n\n", (long long)K,
           kvr_cli_q8(&a->arith) ? "; 8-bit activations, integer products (the default; --exact: f32)" : "; exact (f32 activations, --exact)");
    printf("| type | bytes/weight | threads | in cache: GB/s a thread (CPU time) | in cache: GB/s (wall) | out of cache: GB/s (wall) | out of cache: GB/s a thread (CPU time) | of the floor |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    int rc = KVR_OK;
    for (int i = 0; i < a->n_kernel_types && rc == KVR_OK; i++) {
        const enum kvr_type type = a->kernel_types[i];
        const size_t rb = kvr_row_size(type, K);
        const int tl[2] = { 1, threads };
        for (int j = 0; j < (threads > 1 ? 2 : 1) && rc == KVR_OK; j++) {
            const int nt = tl[j];
            struct kern_time in = { 0 }, out = { 0 };
            const int64_t n_in = (int64_t)(((size_t)256 << 10) * (size_t)nt / rb), n_out = (int64_t)(STREAM_BYTES / rb);
            rc = kern_run(type, K, n_in > 0 ? n_in : 1, 16, nt, kvr_cli_q8(&a->arith), 20, 300.0, &in);
            if (rc == KVR_OK) rc = kern_run(type, K, n_out, 1, nt, kvr_cli_q8(&a->arith), 5, 500.0, &out);
            if (rc != KVR_OK) break;
            const double floor_gbps = nt == threads ? floor.best : 0.0;
            printf("| %s | %.4f | %d | %.1f | %.1f | %.1f | %.1f |", kvr_type_name(type), (double)rb / (double)K, nt, in.gbps_cpu, in.gbps_wall, out.gbps_wall, out.gbps_cpu);
            if (floor_gbps > 0) printf(" %.0f%% |\n", 100.0 * out.gbps_wall / floor_gbps);
            else printf(" - |\n");
            fflush(stdout);
        }
    }
    if (rc != KVR_OK) {
        fprintf(stderr, "kvr-bench: %s\n", kvr_last_error());
        return 1;
    }
    printf("\nmemory-bandwidth floor with %d thread%s: %.1f GB/s (best of %d passes over %zu MiB; median %.1f, worst %.1f)%s\n", threads, threads > 1 ? "s" : "",
           floor.best, floor.passes, STREAM_BYTES >> 20, floor.median, floor.worst, floor.pinned ? ", threads pinned one per CPU" : "");
    return 0;
}

// Bytes one decode step reads: every weight matrix once (the token embedding only when it is also
// the output matrix: otherwise one row of it; a mixture of experts' 3-D expert tensors only for the
// experts the token picks, n_expert_used of n_expert), and the K and V rows of every layer attention
// reads at n_kv cached tokens (in the cache's type).
static double decode_bytes(const struct kvr_model * m, double n_kv, enum kvr_cache_type ct) {
    const struct kvr_gguf * g = m->gguf;
    const bool tied = kvr_gguf_get_tensor(g, "output.weight") == NULL;
    double bytes = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        if (!tied && !strcmp(g->tensors[i].name, "token_embd.weight")) continue;
        const bool experts = m->hp.n_expert > 0 && g->tensors[i].n_dims == 3 && g->tensors[i].ne[2] == m->hp.n_expert;
        bytes += (double)g->tensors[i].size * (experts ? (double)m->hp.n_expert_used / m->hp.n_expert : 1.0);
    }
    const double kv_dim = (double)m->hp.head_dim * m->hp.n_head_kv;
    const enum kvr_type t = kvr_cache_type_elem(ct);
    // the attention layers' K and V (a hybrid model's recurrent layers hold none)
    const double kv_layers = (double)m->hp.n_layer - m->hp.n_recurrent;
    return bytes + n_kv * kv_layers * 2.0 * kv_dim * (double)kvr_type_size(t) / (double)kvr_blck_size(t);
}

// where a decode step's time goes, ms per step (averages over the timed steps)
struct step_split {
    double wall, eval, matmul, attn, ops;
    double op[KVR_OP_COUNT];  // per op kind (ops is their sum)
};

struct point {
    const char * name;        // the bench's strategy name (kvr-e, kvr-s, ...)
    enum kvr_strategy strat;
    enum part_src part;
    int    ranks, threads, ctx;
    double link;
    enum kvr_cache_type cache; // the KV cache's type
    double fractions[16];     // kvr-s / kvr-p: each rank's share
    bool   has_fractions;
    double med, lo, hi;       // TTFT ms
    double pred;              // the simulator's TTFT ms (0: not asked)
    double flops;
    double dec_med, dec_lo, dec_hi; // decode tok/s (--decode)
    struct step_split split;        // of the median run's decode steps
    struct stream_bw floor;         // the bandwidth floor of this point's threads, read between its runs
    double floor_tok_s;             // decode tok/s at the floor's best pass
    double floor_med_tok_s;         // the same at its median pass
    bool   ok;
    char   err[256];
};

static bool same_series(const struct point * a, const struct point * b) {
    return !strcmp(a->name, b->name) && a->ranks == b->ranks && a->threads == b->threads && a->link == b->link && a->cache == b->cache;
}

// The other ops of a decode step by kind: every kind that takes 1% of the step or more, largest
// first, the rest in one line, so that no class of op above 5% hides in "other ops".
static void print_op_split(const struct point * pts, int np) {
    printf("\nthe other ops of a decode step by kind (ms per token, the median run; kinds under 1%% of the step summed):\n\n");
    printf("| strategy | ranks | prompt | op | ms | of the step |\n|---|---|---|---|---|---|\n");
    for (int i = 0; i < np; i++) {
        const struct point * p = &pts[i];
        if (!p->ok || p->split.wall <= 0) continue;
        const struct step_split * s = &p->split;
        bool shown[KVR_OP_COUNT] = { false };
        shown[KVR_OP_MUL_MAT] = shown[KVR_OP_ATTN] = true;
        double rest = 0;
        for (;;) {
            int best = -1;
            for (int k = 0; k < KVR_OP_COUNT; k++) {
                if (!shown[k] && (best < 0 || s->op[k] > s->op[best])) best = k;
            }
            if (best < 0) break;
            shown[best] = true;
            if (s->op[best] >= 0.01 * s->wall) {
                printf("| %s | %d | %d | %s | %.3f | %.1f%% |\n", p->name, p->ranks, p->ctx, kvr_op_name((enum kvr_op)best), s->op[best],
                       100.0 * s->op[best] / s->wall);
            } else {
                rest += s->op[best];
            }
        }
        printf("| %s | %d | %d | (the rest) | %.3f | %.1f%% |\n", p->name, p->ranks, p->ctx, rest, 100.0 * rest / s->wall);
    }
}

// TTFT (ms) against prompt length, one polyline per (strategy, ranks, link), with axes, ticks,
// labels and a legend. Plain SVG 1.1: it opens in any browser.
static int write_svg(const char * path, const struct point * pts, int np, const char * title) {
    struct kvr_file * kf; // written beside path, renamed onto it whole
    if (kvr_file_create(&kf, path) != KVR_OK) {
        fprintf(stderr, "kvr-bench: %s\n", kvr_last_error());
        return -1;
    }
    FILE * f = kvr_file_stream(kf);
    const double W = 760, H = 460, L = 80, R = 200, T = 50, B = 60;
    double xmax = 1, ymax = 1;
    for (int i = 0; i < np; i++) {
        if (!pts[i].ok) continue;
        if (pts[i].ctx > xmax) xmax = pts[i].ctx;
        if (pts[i].med > ymax) ymax = pts[i].med;
    }
    ymax *= 1.1;
    static const char * colors[] = { "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf" };
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n", W, H, W, H);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(f, "<text x=\"%.0f\" y=\"25\" font-size=\"14\">TTFT against prompt length</text>\n", L);
    fprintf(f, "<text x=\"%.0f\" y=\"40\" font-size=\"10\" fill=\"#555\">", L);
    for (const char * c = title; *c; c++) {
        if (*c == '<') fputs("&lt;", f); else if (*c == '&') fputs("&amp;", f); else fputc(*c, f);
    }
    fprintf(f, "</text>\n");
    const double x0 = L, x1 = W - R, y0 = H - B, y1 = T;
    fprintf(f, "<g id=\"axes\" stroke=\"black\"><line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\"/>"
               "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\"/></g>\n", x0, y0, x1, y0, x0, y0, x0, y1);
    for (int k = 0; k <= 5; k++) {
        const double xv = xmax * k / 5, yv = ymax * k / 5;
        const double xp = x0 + (x1 - x0) * k / 5, yp = y0 - (y0 - y1) * k / 5;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"black\"/><text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%.0f</text>\n",
                xp, y0, xp, y0 + 5, xp, y0 + 20, xv);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.0f</text>\n",
                x0, yp, x1, yp, x0 - 8, yp + 4, yv);
    }
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">prompt tokens</text>\n", (x0 + x1) / 2, H - 15);
    fprintf(f, "<text x=\"20\" y=\"%.0f\" text-anchor=\"middle\" transform=\"rotate(-90 20 %.0f)\">TTFT (ms)</text>\n", (y0 + y1) / 2, (y0 + y1) / 2);
    int series = 0;
    bool done[1024] = { false };
    for (int i = 0; i < np; i++) {
        if (done[i] || !pts[i].ok) continue;
        const char * col = colors[series % 8];
        char label[96];
        int o = snprintf(label, sizeof(label), "%s x%d", pts[i].name, pts[i].ranks);
        if (pts[i].ranks == 1) o += snprintf(label + o, sizeof(label) - (size_t)o, " (%d thread%s)", pts[i].threads, pts[i].threads > 1 ? "s" : "");
        if (pts[i].link > 0) snprintf(label + o, sizeof(label) - (size_t)o, " %g Gb/s", pts[i].link);
        fprintf(f, "<g class=\"series\" data-strategy=\"%s\"><polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"",
                pts[i].name, col);
        for (int j = i; j < np; j++) {
            if (!same_series(&pts[i], &pts[j]) || !pts[j].ok) continue;
            done[j] = true;
            fprintf(f, "%.1f,%.1f ", x0 + (x1 - x0) * pts[j].ctx / xmax, y0 - (y0 - y1) * pts[j].med / ymax);
        }
        fprintf(f, "\"/>\n");
        fprintf(f, "<line x1=\"%.0f\" y1=\"%d\" x2=\"%.0f\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"/><text x=\"%.0f\" y=\"%d\">%s</text></g>\n",
                x1 + 15, 60 + 18 * series, x1 + 40, 60 + 18 * series, col, x1 + 45, 64 + 18 * series, label);
        series++;
    }
    fprintf(f, "</svg>\n");
    if (kvr_file_commit(kf) != KVR_OK) {
        fprintf(stderr, "kvr-bench: %s\n", kvr_last_error());
        return -1;
    }
    return 0;
}

// The partition of a kvr-s / kvr-p point from its table: kvr-s takes the entry of exactly this
// length; kvr-p interpolates between the table's other lengths (this one left out), which is what
// KVR-P does for a length nobody searched.
static int point_fractions(struct point * p, const char * table, const char * model) {
    struct kvr_tune_table t;
    if (kvr_tune_table_load(table, &t) != KVR_OK) {
        snprintf(p->err, sizeof(p->err), "%s", kvr_last_error());
        return -1;
    }
    int rc = 0;
    if (p->part == PART_S) {
        int k = 0;
        while (k < t.n_entries && !(!strcmp(t.entries[k].model, model) && t.entries[k].n_ranks == p->ranks && t.entries[k].n_tokens == p->ctx)) k++;
        if (k == t.n_entries) {
            snprintf(p->err, sizeof(p->err), "%s has no entry for %s, %d ranks, %d tokens (kvr-tune --search -m ... --ranks %d --ctx %d)",
                     table, model, p->ranks, p->ctx, p->ranks, p->ctx);
            rc = -1;
        } else {
            memcpy(p->fractions, t.entries[k].fractions, sizeof(double) * (size_t)p->ranks);
        }
    } else {
        struct kvr_tune_table rest = t;
        rest.entries = malloc(sizeof(*rest.entries) * (size_t)(t.n_entries > 0 ? t.n_entries : 1));
        rest.n_entries = 0;
        for (int k = 0; k < t.n_entries; k++) {
            if (!strcmp(t.entries[k].model, model) && t.entries[k].n_ranks == p->ranks && t.entries[k].n_tokens == p->ctx) continue;
            rest.entries[rest.n_entries++] = t.entries[k];
        }
        if (kvr_tune_table_lookup(&rest, model, p->ranks, p->ctx, p->fractions) != KVR_OK) {
            snprintf(p->err, sizeof(p->err), "%s without its %d-token entry: %s", table, p->ctx, kvr_last_error());
            rc = -1;
        }
        free(rest.entries);
    }
    kvr_tune_table_free(&t);
    p->has_fractions = rc == 0;
    return rc;
}

// The profile a point is predicted with: calibrated here for its ranks and threads (once per
// pair: the ranks run their measurements at the same time, as they share the machine), or the
// one given; with the link the point emulates (pair links, as the local transport).
struct profiles {
    const struct kvr_tune_model * shape;
    enum kvr_attn_mode            attn;
    const char                  * fixed;
    int                           threads[8], ranks[8];
    struct kvr_tune_profile       prof[8];
    int                           n;
};

static int point_profile(struct profiles * P, const struct point * p, struct kvr_tune_profile * out) {
    if (P->fixed) {
        if (kvr_tune_profile_get(P->fixed, out) != KVR_OK) return -1;
    } else {
        int k = 0;
        while (k < P->n && !(P->threads[k] == p->threads && P->ranks[k] == p->ranks)) k++;
        if (k == P->n) {
            if (k == 8) return kvr_error(KVR_ERR_ARG, "more than 8 rank and thread counts to calibrate");
            fprintf(stderr, "kvr-bench: calibrating the simulator for %d rank%s x %d thread%s\n", p->ranks, p->ranks > 1 ? "s" : "",
                    p->threads, p->threads > 1 ? "s" : "");
            if (kvr_tune_calibrate(&P->prof[k], P->attn, P->shape, p->threads, p->ranks, stderr) != KVR_OK) return -1;
            P->threads[k] = p->threads;
            P->ranks[k] = p->ranks;
            P->n++;
        }
        *out = P->prof[k];
    }
    if (p->link > 0) {
        out->link_bw = p->link * 1e9 / 8.0;
        out->links = KVR_TUNE_LINKS_PAIR;
    }
    out->attn_mode = P->attn;
    return 0;
}

static double predict(struct profiles * P, const struct point * p) {
    struct kvr_tune_profile hw;
    if (point_profile(P, p, &hw) != 0) return -1.0;
    int counts[16];
    if (p->has_fractions) kvr_tune_counts_from_fractions(p->fractions, p->ranks, p->ctx, counts);
    struct kvr_tune_plan plan = { .strategy = p->strat, .n_ranks = p->ranks, .n_tokens = p->ctx,
                                  .counts = p->has_fractions ? counts : NULL, .attn_mode = P->attn, .cache_type = p->cache };
    struct kvr_tune_sim sim;
    if (kvr_tune_simulate(P->shape, &hw, &plan, &sim) != KVR_OK) return -1.0;
    return sim.ttft * 1e3;
}

int main(int argc, char ** argv) {
    kvr_blas_reexec(argv); // an OpenBLAS older than this CPU: its vector kernels, named before it loads them
    struct bench_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;
    if (a.n_kernel_types > 0) {
        const long n = sysconf(_SC_NPROCESSORS_ONLN);
        return run_kernels(&a, a.threads > 0 ? a.threads : n > 0 ? (int)n : 1);
    }
    struct kvr_model * m = kvr_model_load(a.model, &(struct kvr_model_params){ .mmap = a.mmap });
    if (!m) { fprintf(stderr, "kvr-bench: %s\n", kvr_last_error()); return 2; }
    char desc[512];
    kvr_model_describe(m, desc, sizeof(desc));
    struct kvr_tune_model shape;
    if (kvr_tune_model_from(m, &shape) != KVR_OK) { fprintf(stderr, "kvr-bench: %s\n", kvr_last_error()); return 2; }
    const long cores = sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1;
    if (a.n_single_threads == 0) { a.single_threads[0] = (int)cores; a.n_single_threads = 1; }
    const enum kvr_attn_mode attn = a.attn;
    struct profiles profs = { .shape = &shape, .attn = attn, .fixed = a.simulate ? a.simulate : a.profile };

    static struct point pts[1024];
    int np = 0;
    for (int c = 0; c < a.n_ctx; c++) {
        const int T = a.ctx[c];
        int32_t * ids = malloc(sizeof(int32_t) * (size_t)T);
        uint64_t x = a.seed * 0x9e3779b97f4a7c15ull + 1;
        for (int i = 0; i < T; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            ids[i] = 3 + (int32_t)(x % (m->hp.n_vocab - 3));
        }
        for (int s = 0; s < a.n_strat; s++) {
            const struct bstrat * bs = &a.strat[s];
            const bool one = bs->strat == KVR_STRATEGY_SINGLE;
            const int n_var = (one ? a.n_single_threads : a.n_ranks * a.n_links) * a.n_caches;
            for (int vi = 0; vi < n_var && np < 1024; vi++) {
                const int ci = vi % a.n_caches, vj = vi / a.n_caches;
                const int ranks = one ? 1 : a.ranks[vj % a.n_ranks], li = one ? 0 : vj / a.n_ranks;
                struct point * p = &pts[np++];
                *p = (struct point) { .name = bs->name, .strat = bs->strat, .part = bs->part, .ranks = ranks, .ctx = T, .ok = true,
                                      .link = one ? 0 : a.links[li], .cache = a.caches[ci] };
                p->threads = one ? a.single_threads[vj] : a.threads > 0 ? a.threads : (int)(cores / ranks > 0 ? cores / ranks : 1);
                p->flops = prefill_flops(&m->hp, T);
                if (ranks > 16) { p->ok = false; snprintf(p->err, sizeof(p->err), "more than 16 ranks"); continue; }
                if (bs->part != PART_EVEN && point_fractions(p, a.tables[a.n_tables > 1 ? li : 0], shape.name) != 0) {
                    p->ok = false;
                    fprintf(stderr, "kvr-bench: %s x%d, %d tokens: %s\n", p->name, p->ranks, T, p->err);
                    continue;
                }
                if (a.predict || a.simulate) {
                    p->pred = predict(&profs, p);
                    if (p->pred < 0) {
                        p->ok = false;
                        snprintf(p->err, sizeof(p->err), "simulator: %s", kvr_last_error());
                        continue;
                    }
                }
                if (a.simulate) {
                    p->med = p->lo = p->hi = p->pred;
                    continue;
                }
                double * t = calloc((size_t)a.reps, sizeof(double));
                double * dt = calloc((size_t)a.reps, sizeof(double));
                struct step_split * sp = calloc((size_t)a.reps, sizeof(struct step_split));
                // one session per point, as llama-bench keeps one context: warm-up prefills, then
                // the timed ones, the cache forgotten in between
                struct kvr_session_params dp = { .strategy = p->strat, .n_ranks = p->ranks, .n_threads = p->threads,
                                              .n_ctx = T + a.decode + 16, .attn_mode = attn, .link_gbps = p->link,
                                              .fractions = p->has_fractions ? p->fractions : NULL,
                                              .link_noise = p->link > 0 ? a.link_noise : 0, .link_seed = 1,
                                              .timeout_s = 3600, .q8_activations = kvr_cli_q8(&a.arith), .replicate = a.replicate,
                                              .backend = a.backend,
                                              .cache_type_k = p->cache, .cache_type_v = p->cache };
                struct kvr_session * d = kvr_session_new(m, &dp);
                if (!d) {
                    p->ok = false;
                    snprintf(p->err, sizeof(p->err), "%s", kvr_last_error());
                }
                for (int w = 0; w < a.warmup && p->ok; w++) {
                    kvr_session_reset(d);
                    if (!kvr_session_eval(d, ids, T)) {
                        p->ok = false;
                        snprintf(p->err, sizeof(p->err), "%s", kvr_last_error());
                    }
                }
                // the floor is read between the runs (before each, and after the last), so that it
                // sees the machine as the runs do: the memory's speed here moves with other tenants
                const bool on_cpu = !a.backend || !strcmp(a.backend, "cpu");
                double * fg = a.decode > 0 && on_cpu ? malloc(sizeof(double) * FLOOR_MAX_PASSES) : NULL;
                int fn = 0;
                bool fpinned = true;
                for (int r = 0; r <= a.reps && p->ok; r++) {
                    if (fg) {
                        bool pin = false;
                        fn = stream_read_passes(p->threads * p->ranks, m->weights_read > 0, FLOOR_MS_BETWEEN_RUNS, fg, fn, FLOOR_MAX_PASSES, &pin);
                        fpinned = fpinned && pin;
                    }
                    if (r == a.reps) break;
                    kvr_session_reset(d);
                    const double t0 = kvr_time_ms();
                    const float * logits = kvr_session_eval(d, ids, T);
                    t[r] = kvr_time_ms() - t0;
                    if (!logits) {
                        p->ok = false;
                        snprintf(p->err, sizeof(p->err), "%s", kvr_last_error());
                    }
                    fprintf(stderr, "kvr-bench: %s x%d (%d thread%s)%s, %s cache, %d tokens, run %d/%d: %.1f ms", p->name, p->ranks, p->threads,
                            p->threads > 1 ? "s" : "", p->link > 0 ? " link" : "", kvr_cache_type_name(p->cache), T, r + 1, a.reps, t[r]);
                    if (p->pred > 0) fprintf(stderr, " (predicted %.1f ms)", p->pred);
                    fputc('\n', stderr);
                    if (a.decode > 0 && p->ok) {
                        // tg N: each step feeds the argmax of the last logits
                        struct step_split s = { 0 };
                        const double d0 = kvr_time_ms();
                        for (int k = 0; k < a.decode && logits; k++) {
                            const int32_t id = kvr_argmax(logits, (int)m->hp.n_vocab);
                            logits = kvr_session_eval(d, &id, 1);
                            struct kvr_rank_stats st[16];
                            const int ns = logits ? kvr_session_stats(d, st, 16) : 0;
                            int w = 0;
                            for (int q = 1; q < ns; q++) if (st[q].ttft_ms > st[w].ttft_ms) w = q;
                            if (ns > 0) {
                                s.eval += st[w].ttft_ms;
                                s.matmul += st[w].matmul_ms;
                                s.attn += st[w].attn_ms;
                                s.ops += st[w].compute_ms;
                                for (int k = 0; k < KVR_OP_COUNT; k++) s.op[k] += st[w].op_ms[k];
                            }
                        }
                        const double ms = kvr_time_ms() - d0;
                        if (!logits) {
                            p->ok = false;
                            snprintf(p->err, sizeof(p->err), "decode: %s", kvr_last_error());
                            break;
                        }
                        dt[r] = a.decode / (ms / 1e3);
                        s.wall = ms;
                        s.wall /= a.decode; s.eval /= a.decode; s.matmul /= a.decode; s.attn /= a.decode; s.ops /= a.decode;
                        for (int k = 0; k < KVR_OP_COUNT; k++) s.op[k] /= a.decode;
                        sp[r] = s;
                        fprintf(stderr, "kvr-bench:   then tg %d: %.1f ms, %.2f tok/s\n", a.decode, ms, dt[r]);
                    }
                }
                kvr_session_free(d);
                if (fg) {
                    p->floor = stream_summary(fg, fn, fpinned);
                    const double bytes = decode_bytes(m, p->ctx + a.decode / 2.0, p->cache);
                    p->floor_tok_s = p->floor.best * 1e9 / bytes;
                    p->floor_med_tok_s = p->floor.median * 1e9 / bytes;
                    free(fg);
                }
                qsort(t, (size_t)a.reps, sizeof(double), cmp_double);
                p->med = t[a.reps / 2];
                p->lo = t[0];
                p->hi = t[a.reps - 1];
                if (a.decode > 0 && p->ok) {
                    // the median run's split, then the tok/s sorted for median and range
                    int mi = 0;
                    double * ds = malloc(sizeof(double) * (size_t)a.reps);
                    memcpy(ds, dt, sizeof(double) * (size_t)a.reps);
                    qsort(ds, (size_t)a.reps, sizeof(double), cmp_double);
                    for (int r = 0; r < a.reps; r++) if (dt[r] == ds[a.reps / 2]) mi = r;
                    p->dec_med = ds[a.reps / 2];
                    p->dec_lo = ds[0];
                    p->dec_hi = ds[a.reps - 1];
                    p->split = sp[mi];
                    free(ds);
                }
                free(t);
                free(dt);
                free(sp);
            }
        }
        free(ids);
    }

    const bool md = !strcmp(a.format, "md"), csv = !strcmp(a.format, "csv");
    const bool pred_col = a.predict && !a.simulate;
    if (md) {
        printf("model: %s%s%s%s\n\n", desc, a.simulate ? "; simulated with profile " : "", a.simulate ? a.simulate : "",
               a.backend && strcmp(a.backend, "cpu") ? "" // another backend computes in its own arithmetic
               : kvr_cli_q8(&a.arith) ? "; 8-bit activations, integer products (the default; --exact: f32)" : "; exact arithmetic (--exact)");
        printf("| strategy | ranks | threads/rank | link | prompt | partition | TTFT ms (%s) | min-max |%s prefill tok/s | GFLOP/s | vs single | vs tsp |",
               a.simulate ? "simulated" : "median", pred_col ? " predicted ms | predicted/measured |" : "");
        if (a.decode > 0) printf(" decode tok/s (tg %d, median) | min-max | ms/token | floor tok/s | of floor (of its median pass) |", a.decode);
        printf(" KV cache |");
        printf("\n|---|---|---|---|---|---|---|---|%s---|---|---|---|%s---|\n", pred_col ? "---|---|" : "", a.decode > 0 ? "---|---|---|---|---|" : "");
    } else if (csv) {
        printf("strategy,ranks,threads,link_gbps,prompt,partition,ttft_ms_median,ttft_ms_min,ttft_ms_max,predicted_ms,tok_s,gflop_s,speedup_single,speedup_tsp,"
               "decode_n,decode_tok_s,decode_tok_s_min,decode_tok_s_max,floor_tok_s,cache_type\n");
    } else {
        printf("[\n");
    }
    for (int i = 0; i < np; i++) {
        const struct point * p = &pts[i];
        double single = 0, tsp = 0;
        for (int j = 0; j < np; j++) { // against the best single and the tsp of the same ranks and link
            if (pts[j].ctx != p->ctx || !pts[j].ok || pts[j].cache != p->cache) continue;
            if (pts[j].strat == KVR_STRATEGY_SINGLE && (single == 0 || pts[j].med < single)) single = pts[j].med;
            if (pts[j].strat == KVR_STRATEGY_TSP && pts[j].ranks == p->ranks && pts[j].link == p->link) tsp = pts[j].med;
        }
        const double toks = p->ctx / (p->med / 1e3), gf = p->flops / (p->med * 1e6);
        char link[32], part[160] = "-";
        if (p->link > 0) snprintf(link, sizeof(link), "%g Gb/s%s", p->link, a.link_noise > 1 ? " noisy" : "");
        else snprintf(link, sizeof(link), "-");
        if (p->has_fractions) {
            int o = 0;
            for (int r = 0; r < p->ranks && o < (int)sizeof(part) - 12; r++) o += snprintf(part + o, sizeof(part) - (size_t)o, "%s%.3f", r ? "/" : "", p->fractions[r]);
        }
        if (!p->ok) {
            if (md) printf("| %s | %d | %d | %s | %d | %s | failed: %s | |%s | | | |%s %s |\n", p->name, p->ranks, p->threads, link, p->ctx, part, p->err, pred_col ? " | |" : "",
                           a.decode > 0 ? " | | | | |" : "", kvr_cache_type_name(p->cache));
            else fprintf(stderr, "kvr-bench: %s x%d %d: %s\n", p->name, p->ranks, p->ctx, p->err);
            continue;
        }
        if (md) {
            printf("| %s | %d | %d | %s | %d | %s | %.1f | %.1f-%.1f |", p->name, p->ranks, p->threads, link, p->ctx, part, p->med, p->lo, p->hi);
            if (pred_col) printf(" %.1f | %.2f |", p->pred, p->pred / p->med);
            printf(" %.1f | %.1f | %.2fx | ", toks, gf, single > 0 ? single / p->med : 0.0);
            if (tsp > 0) printf("%.2fx |", tsp / p->med); else printf("- |");
            if (a.decode > 0) {
                printf(" %.2f | %.2f-%.2f | %.2f | %.1f | %.0f%% (%.0f%%) |", p->dec_med, p->dec_lo, p->dec_hi, 1e3 / p->dec_med, p->floor_tok_s,
                       p->floor_tok_s > 0 ? 100.0 * p->dec_med / p->floor_tok_s : 0.0,
                       p->floor_med_tok_s > 0 ? 100.0 * p->dec_med / p->floor_med_tok_s : 0.0);
            }
            printf(" %s |\n", kvr_cache_type_name(p->cache));
        } else if (csv) {
            printf("%s,%d,%d,%g,%d,%s,%.3f,%.3f,%.3f,%.3f,%.2f,%.2f,%.4f,%.4f,%d,%.3f,%.3f,%.3f,%.3f,%s\n", p->name, p->ranks, p->threads, p->link, p->ctx, part, p->med, p->lo, p->hi,
                   p->pred, toks, gf, single > 0 ? single / p->med : 0.0, tsp > 0 ? tsp / p->med : 0.0,
                   a.decode, p->dec_med, p->dec_lo, p->dec_hi, p->floor_tok_s, kvr_cache_type_name(p->cache));
        } else {
            printf("  {\"strategy\":\"%s\",\"ranks\":%d,\"threads\":%d,\"link_gbps\":%g,\"prompt\":%d,\"partition\":\"%s\",\"ttft_ms\":%.3f,\"min_ms\":%.3f,"
                   "\"max_ms\":%.3f,\"predicted_ms\":%.3f,\"tok_s\":%.2f,\"gflop_s\":%.2f,\"decode_n\":%d,\"decode_tok_s\":%.3f,"
                   "\"decode_tok_s_min\":%.3f,\"decode_tok_s_max\":%.3f,\"floor_tok_s\":%.3f,\"cache_type\":\"%s\"}%s\n",
                   p->name, p->ranks, p->threads, p->link, p->ctx, part, p->med, p->lo, p->hi, p->pred, toks, gf,
                   a.decode, p->dec_med, p->dec_lo, p->dec_hi, p->floor_tok_s, kvr_cache_type_name(p->cache), i + 1 < np ? "," : "");
        }
    }
    if (!md && !csv) printf("]\n");
    if (md && a.decode > 0) {
        printf("\nmemory-bandwidth floor: the best of repeated reads of %zu MiB in %s pages, as the weights, read before each run and after the last (the median and worst pass in brackets):",
               STREAM_BYTES >> 20, m->weights_read > 0 ? "2 MiB" : "4 KiB");
        for (int i = 0, k = 0; i < np; i++) {
            const struct point * p = &pts[i];
            if (!p->ok || p->floor.passes == 0) continue;
            printf("%s %s x%d %d: %.1f GB/s (%.1f, %.1f; %d passes) with %d thread%s%s", k++ ? ";" : "", p->name, p->ranks, p->ctx,
                   p->floor.best, p->floor.median, p->floor.worst, p->floor.passes, p->threads * p->ranks,
                   p->threads * p->ranks > 1 ? "s" : "", p->floor.pinned ? " pinned one per CPU" : " (not pinned)");
        }
        printf("; a step reads %.1f MB at a prompt of %d (weights once, the KV rows attention reads)\n\n",
               decode_bytes(m, a.ctx[0] + a.decode / 2.0, a.caches[0]) / 1e6, a.ctx[0]);
        printf("where a decode step's time goes (ms per token, the median run):\n\n");
        printf("| strategy | ranks | prompt | step | matmuls | attention | other ops | fixed costs of the eval (graph build, plan, place, threads) | outside the eval (argmax, driver) |\n");
        printf("|---|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < np; i++) {
            const struct point * p = &pts[i];
            if (!p->ok) continue;
            const struct step_split * s = &p->split;
            printf("| %s | %d | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", p->name, p->ranks, p->ctx, s->wall, s->matmul, s->attn,
                   s->ops - s->matmul - s->attn, s->eval - s->ops, s->wall - s->eval);
        }
        print_op_split(pts, np);
    }
    if (a.sgemm) {
        for (int c = 0; c < a.n_ctx; c++) {
            const double peak = sgemm_peak(&m->hp, a.ctx[c], (int)cores);
            double best = 0;
            for (int i = 0; i < np; i++) {
                if (pts[i].ctx == a.ctx[c] && pts[i].ok && pts[i].flops / (pts[i].med * 1e6) > best) best = pts[i].flops / (pts[i].med * 1e6);
            }
            printf("%ssgemm peak at %d tokens (%ld threads, the model's FFN shapes): %.1f GFLOP/s; best prefill above: %.1f GFLOP/s = %.0f%% of it\n",
                   md ? "\n" : "", a.ctx[c], cores, peak, best, 100.0 * best / peak);
        }
    }
    if (a.svg && write_svg(a.svg, pts, np, desc) != 0) {
        kvr_model_free(m);
        return 1;
    }
    kvr_model_free(m);
    return 0;
}
