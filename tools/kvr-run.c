// tools/kvr-run.c - the model runner: load a GGUF model, tokenize a prompt, prefill it, then
// decode with the chosen sampler, streaming text to stdout. Flags follow llama.cpp's habits.
// stdout carries only text (the prompt, then the continuation); everything else goes to
// stderr, which ends with one machine-readable timing line. The flags are one table (RUN_FLAGS,
// parsed by tools/kvr-cli.h); every value, path and combination is checked, and the prompt
// measured against the context, before the prompt is echoed: exit 2 for those, 1 for a run that
// fails once started. With -cnv it is a chat instead (run_conversation): user turns from stdin,
// the model's chat template applied (its markers are special tokens, what the user typed is text:
// kvr_tokenize_markup), each turn prefilled on top of the cache the earlier ones left, the
// replies streamed to stdout.

#define _POSIX_C_SOURCE 200809L

#define KVR_BUILD // kvr.h's internal part: the test hooks KVR_TEST_KILL and KVR_TEST_STALL
#include "kvr.h"
#include "kvr-cli.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// "1,2,3" -> ids; returns the count or -1 with a message
// Ctrl-C (SIGINT) and SIGTERM: the first stops the run at the next token or layer (the session's
// interrupt), after which it saves what it was asked to save and exits 128 + the signal (130, 143)
// with a line saying so; a second ends the process at once. In a chat the first ends the reply.
static volatile sig_atomic_t run_signal;
static struct kvr_session * volatile run_session;

#ifndef KVR_RUN_NO_MAIN // main() installs it (the CLI fuzz target runs kvr_run_main without it)
static void on_signal(int sig) {
    if (run_signal) _exit(128 + sig);
    run_signal = sig;
    if (run_session) kvr_session_interrupt(run_session, true);
}
#endif

// The line an interrupted run ends with; its exit status.
static int interrupted(const char * where) {
    fprintf(stderr, "\nkvr-run: %s %s\n", run_signal == SIGTERM ? "SIGTERM" : "interrupted (Ctrl-C)", where);
    return 128 + run_signal;
}

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
    bool         no_special;   // -p/-f text: "<|im_start|>" stays text instead of the special token
    bool         special_in_turns; // -cnv: the same text in a user turn or --system is the special token
    bool         no_escape;    // -p (and chat input): keep "\n" as two characters
    bool         conversation; // -cnv
    bool         ignore_eos;   // --ignore-eos: end-of-generation tokens are never sampled
    const char * system;       // --system: the chat's system message
    const char * chat_template;// --chat-template: a family name (or a template text)
    bool         n_predict_set;
    int          n_predict;
    int          n_threads;
    int          n_ctx;
    float        temp;
    int          top_k;
    float        top_p;
    uint64_t     seed;
    bool         seed_set;
    bool         verbose;
    bool         replicate;    // --replicate
    struct kvr_test_kill kill[16]; // the test hook KVR_TEST_KILL, parsed once by parse_args
    int          n_kill;
    bool         dump_graph;
    struct kvr_cli_arith arith; // --exact, --q8-act
    bool         mmap;         // --mmap: weights left in the file's mapping
    bool         vec_dot_order;
    bool         avx512_order;
    const char * backend;      // a registered backend's name (NULL: cpu)
    int          device;       // cuda: the (first rank's) GPU
    bool         stats;
    bool         strategy_set;
    int          attn_mode;      // enum kvr_attn_mode, as --attn's choices are ordered
    struct kvr_cli_cache cache;  // --cache-type, -ctk, -ctv
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
    // the KV cache on disk and on the wire
    const char * kv_save;
    const char * kv_load;
    const char * session;
    const char * kv_stream;
    int          decode_rank;
    bool         pd;             // --decode-rank given
    // restarts
    const char * replicate_dir;
    const char * resume;
};

static int parse_strategy(const char * v, void * dst, char * why, size_t cap) {
    if (kvr_strategy_parse(v, dst) == KVR_OK) return 0;
    snprintf(why, cap, "%s", kvr_last_error());
    return -1;
}

static const char * const run_synopsis = "usage: kvr-run -m MODEL.gguf (-p TEXT | -f FILE | --tokens 1,2,3) [options]\n"
                                        "       kvr-run -m MODEL.gguf -cnv [--system TEXT] [-p TEXT | -f FILE] [options]";

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
    char backend_help[1024];
    const struct kvr_cli_flag flags[] = {
        { .name = "-m", .alt = "--model", .kind = KVR_CLI_IN, .dst = &a->model, .meta = "FILE", .once = true, .help = "model (GGUF)" },
        { .name = "-p", .alt = "--prompt", .kind = KVR_CLI_TEXT, .dst = &a->prompt, .meta = "TEXT", .empty_ok = true, .once = true,
          .help = "prompt text" },
        { .name = "-f", .alt = "--file", .kind = KVR_CLI_IN, .dst = &a->prompt_file, .meta = "FILE", .once = true,
          .help = "read the prompt from a file (UTF-8 text: a NUL byte or invalid UTF-8 is an error)" },
        { .name = "--tokens", .kind = KVR_CLI_TEXT, .dst = &a->tokens, .meta = "LIST", .help = "prompt as comma-separated token ids (no BOS is added)" },
        { .name = "--no-special", .kind = KVR_CLI_SWITCH, .dst = &a->no_special,
          .help = "special tokens written in the prompt (\"<|im_start|>\", \"<s>\") stay plain text\n"
                  "(default: they are the special tokens, as in llama.cpp; -cnv: text already)" },
        { .name = "--no-escape", .kind = KVR_CLI_SWITCH, .dst = &a->no_escape,
          .help = "-p TEXT (and chat input) as it is (default: \\n \\r \\t \\' \\\" \\\\ \\xHH become\n"
                  "the characters, as in llama.cpp; a -f file is always read as it is)" },
        { .name = "-n", .alt = "--n-predict", .kind = KVR_CLI_INT, .dst = &a->n_predict, .meta = "N", .lo = 0, .hi = 1 << 20, .given = &a->n_predict_set,
          .help = "tokens to generate (default 128; 0 runs the prefill only); -cnv: the most a reply\n"
                  "may have (default: until its end of turn)" },
        { .name = "--ignore-eos", .kind = KVR_CLI_SWITCH, .dst = &a->ignore_eos,
          .help = "never sample an end-of-generation token: always -n tokens (as llama.cpp's flag;\nnot with -cnv, whose replies end there)" },
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
        KVR_CLI_CACHE_FLAGS(&a->cache),
        { .name = "--dump-logits", .kind = KVR_CLI_OUT, .dst = &a->dump_logits, .meta = "FILE", .help = "the last prompt token's logits, one per line" },
        { .name = "--dump-graph", .kind = KVR_CLI_SWITCH, .dst = &a->dump_graph, .help = "print every rank's rewritten graph of the prefill on stderr" },
        { .name = "--mmap", .kind = KVR_CLI_SWITCH, .dst = &a->mmap,
          .help = "leave the weights where the file is mapped (no copy, pages shared with other\nprocesses, rows as the file has them) instead of reading them into memory of 2 MiB\npages, the quantized matrices in tiles of 16 rows, which the kernels read faster" },
        KVR_CLI_ARITH_FLAGS(&a->arith),
        { .name = "--vec-dot-order", .kind = KVR_CLI_SWITCH, .dst = &a->vec_dot_order,
          .help = "small F32 sums in the order of a llama.cpp built without GGML_LLAMAFILE\n"
                  "(its last bits; default: its default build's)" },
        { .name = "--avx512-order", .kind = KVR_CLI_SWITCH, .dst = &a->avx512_order,
          .help = "those sums and the small attention's softmax as a llama.cpp built for AVX-512\n"
                  "sums them, 16 lanes at a time (its last bits; default: AVX2's 8 lanes), and\n"
                  "SiLU and every matmul not on 8-bit activations, on the weights' F32 twin (slower)" },
        { .name = "--backend", .kind = KVR_CLI_CUSTOM, .dst = &a->backend, .meta = "NAME", .parse = kvr_cli_backend,
          .help = kvr_cli_backend_help(backend_help, sizeof(backend_help), "what runs the model (default cpu), one of:") },
        { .name = "--device", .kind = KVR_CLI_INT, .dst = &a->device, .meta = "N", .lo = 0, .hi = 1023,
          .help = "cuda: the GPU (default 0); with --ranks, rank r runs on GPU N + r modulo the GPUs" },
        { .name = "-v", .alt = "--verbose", .kind = KVR_CLI_SWITCH, .dst = &a->verbose, .help = "prompt and generated ids, model shape, seed on stderr" },
        { .kind = KVR_CLI_SECTION, .help = "chat:" },
        { .name = "-cnv", .alt = "--conversation", .kind = KVR_CLI_SWITCH, .dst = &a->conversation,
          .help = "a chat: user turns from stdin (-p/-f: the first one), the model's chat template\n"
                  "applied, each turn prefilled on top of the earlier ones; a reply ends at its\n"
                  "end of turn; /exit or the end of the input ends the chat" },
        { .name = "--system", .kind = KVR_CLI_TEXT, .dst = &a->system, .meta = "TEXT",
          .help = "-cnv: the system message (prefilled before the first turn)" },
        { .name = "--chat-template", .kind = KVR_CLI_TEXT, .dst = &a->chat_template, .meta = "NAME",
          .help = "-cnv: the template family instead of the file's (chatml, llama3, gemma, ...;\n"
                  "an unknown name lists them all)" },
        { .name = "--special-in-turns", .kind = KVR_CLI_SWITCH, .dst = &a->special_in_turns,
          .help = "-cnv: special-token text typed in a turn or --system (\"<|im_end|>\") becomes\n"
                  "the control token (default: it stays text, so a turn cannot end itself and open\n"
                  "another; only the template's own markers are special tokens)" },
        { .kind = KVR_CLI_SECTION, .help = "parallel prefill:" },
        { .name = "--ranks", .kind = KVR_CLI_INT, .dst = &a->n_ranks, .meta = "N", .lo = 1, .hi = 256,
          .help = "ranks (default 1; under mpirun: the MPI size); more than the prompt\n"
                  "gives a token each are capped (mpirun: refused)" },
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
        { .name = "--replicate", .kind = KVR_CLI_SWITCH, .dst = &a->replicate,
          .help = "local ranks: every rank's new cache rows also go to a replica in its ring\n"
                  "successor's memory, layer by layer as they are made; a rank lost during the\n"
                  "run is then recovered from (its rows restored, the step run again on the\n"
                  "others) instead of ending it; -v says what was lost, restored, recomputed" },
        { .name = "--stats", .kind = KVR_CLI_SWITCH, .dst = &a->stats, .help = "one JSON object of counters per rank on stderr after the prefill" },
        { .name = "--trace", .kind = KVR_CLI_OUT, .dst = &a->trace, .meta = "FILE", .help = "Chrome trace JSON of every rank's layers and transfers (Perfetto)" },
        { .kind = KVR_CLI_SECTION, .help = "KV cache files and streaming:" },
        { .name = "--kv-save", .kind = KVR_CLI_OUT, .dst = &a->kv_save, .meta = "FILE",
          .help = "save the cache and its tokens after the prompt, and again after the\n"
                  "generation (ring strategies: every rank's shard in FILE; under MPI each\n"
                  "rank's in FILE.R)" },
        { .name = "--kv-load", .kind = KVR_CLI_TEXT, .dst = &a->kv_load, .meta = "FILE",
          .help = "restore a saved cache (FILE, or every rank's FILE.R), append the prompt\n"
                  "if one is given (no BOS), continue" },
        { .name = "--session", .kind = KVR_CLI_OUT, .dst = &a->session, .meta = "FILE",
          .help = "llama.cpp's prompt cache: restore FILE if it exists, reuse the longest\n"
                  "common prefix of its tokens and the prompt, prefill the rest, save at the end" },
        { .name = "--kv-stream", .kind = KVR_CLI_OUT, .dst = &a->kv_stream, .meta = "FILE",
          .help = "write the prompt's cache to FILE layer by layer while the prefill runs\n"
                  "(the file --kv-save writes after it)" },
        { .name = "--decode-rank", .kind = KVR_CLI_INT, .dst = &a->decode_rank, .meta = "D", .lo = 0, .hi = 255, .given = &a->pd,
          .help = "prefill/decode disaggregation: rank D (the last) only decodes; the others\n"
                  "run the prefill and stream the cache to it layer by layer as they compute" },
        { .kind = KVR_CLI_SECTION, .help = "Restarts:" },
        { .name = "--replicate-dir", .kind = KVR_CLI_DIR, .dst = &a->replicate_dir, .meta = "DIR",
          .help = "every rank appends the KV rows it makes (prefill and each decode step)\n"
                  "and the tokens to DIR/rank-R.kvlog, synced behind the compute, so that\n"
                  "a run that lost a process can be resumed (--resume DIR)" },
        { .name = "--resume", .kind = KVR_CLI_TEXT, .dst = &a->resume, .meta = "DIR",
          .help = "restart from the logs of --replicate-dir DIR (the same or fewer ranks):\n"
                  "restore what every rank acknowledged, print the text up to there and\n"
                  "go on (-p: must be the logs' prompt; without it the logs' prompt)" },
    };
    const struct kvr_cli cli = { "kvr-run", run_synopsis, NULL, flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) return rc;
    if (!a->model) return kvr_cli_fail(&cli, "no model: give -m FILE");
    if (a->conversation) {
        if (a->tokens) return kvr_cli_fail(&cli, "-cnv takes text turns: --tokens does not go with it");
        if (a->prompt && a->prompt_file) return kvr_cli_fail(&cli, "-cnv: give at most one of -p and -f (the first user turn)");
        if (a->no_special && a->special_in_turns) return kvr_cli_fail(&cli, "-cnv: --no-special and --special-in-turns contradict each other");
        if (a->n_predict_set && a->n_predict == 0) return kvr_cli_fail(&cli, "-cnv: -n is the most tokens a reply may have: at least 1");
        if (a->dump_logits) return kvr_cli_fail(&cli, "-cnv: --dump-logits writes one prompt's logits; it does not go with a chat");
        if (a->partition && strcmp(a->partition, "even") != 0 && (strncmp(a->partition, "table:", 6) == 0 || !strchr(a->partition, '.'))) {
            return kvr_cli_fail(&cli, "-cnv: --partition %s depends on one prompt's length; a chat takes even or fractions (0.6,0.4)", a->partition);
        }
    } else {
        if (a->system) return kvr_cli_fail(&cli, "--system is for a chat: add -cnv");
        if (a->chat_template) return kvr_cli_fail(&cli, "--chat-template is for a chat: add -cnv");
        if (a->special_in_turns) return kvr_cli_fail(&cli, "--special-in-turns is for a chat: add -cnv (a prompt's special tokens: the default, --no-special)");
        if (a->kv_load && a->session) return kvr_cli_fail(&cli, "--kv-load and --session exclude each other (--session loads its file itself)");
        if (a->resume && (a->kv_load || a->session)) return kvr_cli_fail(&cli, "--resume restores the cache itself: not with --kv-load or --session");
        if (!!a->prompt + !!a->prompt_file + !!a->tokens > 1 || (!a->kv_load && !a->resume && !a->prompt && !a->prompt_file && !a->tokens)) {
            return kvr_cli_fail(&cli, a->kv_load || a->resume ? "give at most one of -p, -f and --tokens" : "give exactly one of -p, -f and --tokens (or -cnv for a chat)");
        }
    }
    if (a->conversation && a->ignore_eos) return kvr_cli_fail(&cli, "-cnv: --ignore-eos would never end a reply");
    if (kvr_cli_arith_check(&cli, &a->arith)) return 2;
    if (a->conversation && (a->kv_save || a->kv_load || a->session || a->kv_stream || a->pd || a->replicate_dir || a->resume)) {
        return kvr_cli_fail(&cli, "-cnv: --kv-save, --kv-load, --session, --kv-stream, --decode-rank, --replicate-dir and --resume are for one prompt's run");
    }
    if (a->prompt && kvr_cli_check_prompt("kvr-run", a->prompt, !a->no_escape)) return 2;
    char why[512];
    if (a->kv_load && kvr_cli_check_in_if_there(a->kv_load, why, sizeof(why))) { // else its FILE.R shards
        return kvr_cli_fail(&cli, "--kv-load '%.200s': %s", a->kv_load, why);
    }
    if (!a->comm_set && getenv("OMPI_COMM_WORLD_SIZE")) a->comm = KVR_COMM_MPI; // started by mpirun
    // under MPI the rank count is the communicator's: kvr_session_new checks the decode rank there
    if (a->pd && a->comm == KVR_COMM_LOCAL && a->decode_rank != a->n_ranks - 1) {
        return kvr_cli_fail(&cli, "--decode-rank %d: the decode rank is the last of the %d ranks", a->decode_rank, a->n_ranks);
    }
    if (a->pd && a->kv_stream) return kvr_cli_fail(&cli, "--decode-rank streams the cache to the decode rank; --kv-stream to a file: one of them");
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
        const int n_prefill = a->pd ? a->n_ranks - 1 : a->n_ranks; // P/D: the decode rank takes no share
        if (a->comm == KVR_COMM_LOCAL && n != n_prefill) {
            return kvr_cli_fail(&cli, "--partition has %d entries for %d %sranks", n, n_prefill, a->pd ? "prefill " : "");
        }
        double sum = 0;
        for (int i = 0; i < n; i++) sum += v[i];
        if (frac && fabs(sum - 1.0) > 1e-3) return kvr_cli_fail(&cli, "--partition: the fractions add up to %g, not 1", sum);
    }
    if (a->conversation && (a->comm == KVR_COMM_MPI || getenv("OMPI_COMM_WORLD_SIZE"))) {
        return kvr_cli_fail(&cli, "-cnv reads the terminal in one process: it does not run under mpirun or --comm mpi (use local ranks: --ranks N)");
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
    const char * kill = getenv("KVR_TEST_KILL");
    a->n_kill = kill ? kvr_test_kill_parse(kill, a->kill, 16) : 0;
    if (a->n_kill < 0) return kvr_cli_fail(&cli, "%s", kvr_last_error());
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

static void print_stats(const struct kvr_session * d) {
    struct kvr_rank_stats st[256];
    const int n = kvr_session_stats(d, st, 256);
    for (int i = 0; i < n; i++) {
        fprintf(stderr, "{\"rank\":%d,\"strategy\":\"%s\",\"tokens\":%d,\"attn_dot_dense\":%lld,\"attn_dot_causal\":%lld,"
                "\"kv_rows_sent\":%lld,\"kv_rows_recv\":%lld,\"bytes_sent\":%lld,\"bytes_recv\":%lld,"
                "\"wait_ms\":%.3f,\"ttft_ms\":%.3f,\"matmul_ms\":%.3f,\"attn_ms\":%.3f,\"compute_ms\":%.3f,"
                "\"kv_stream_bytes\":%lld,\"replica_bytes\":%lld,\"expert_bytes\":%lld,\"state_bytes_sent\":%lld,\"state_bytes_recv\":%lld}\n",
                st[i].rank, kvr_strategy_name(kvr_session_last_strategy(d)), st[i].tokens, (long long)st[i].attn_dot_dense,
                (long long)st[i].attn_dot_causal, (long long)st[i].kv_rows_sent, (long long)st[i].kv_rows_recv,
                (long long)st[i].bytes_sent, (long long)st[i].bytes_recv, st[i].wait_ms, st[i].ttft_ms,
                st[i].matmul_ms, st[i].attn_ms, st[i].compute_ms, (long long)st[i].kv_stream_bytes,
                (long long)st[i].replica_bytes, (long long)st[i].expert_bytes, (long long)st[i].state_bytes_sent,
                (long long)st[i].state_bytes_recv);
    }
}

static void print_ids(const char * label, const int32_t * ids, int n) {
    fprintf(stderr, "%s: ", label);
    for (int i = 0; i < n; i++) fprintf(stderr, "%s%d", i ? "," : "", ids[i]);
    fprintf(stderr, "\n");
}

// text -> a new array of ids (its count in *n), or NULL with a message naming what failed. With
// markup (a chat's rendering), control tokens only where it marks the template's own text.
static int32_t * tokenize_text(const struct kvr_vocab * vocab, const char * text, const bool * markup, bool bos, bool special,
                               int * n) {
    const int need = markup ? kvr_tokenize_markup(vocab, text, markup, NULL, 0, bos) : kvr_tokenize(vocab, text, NULL, 0, bos, special);
    if (need < 0) {
        fprintf(stderr, "kvr-run: cannot tokenize the text: %s\n", kvr_last_error());
        return NULL;
    }
    int32_t * ids = malloc(sizeof(int32_t) * (size_t)(need + 1));
    if (!ids || (markup ? kvr_tokenize_markup(vocab, text, markup, ids, need + 1, bos)
                        : kvr_tokenize(vocab, text, ids, need + 1, bos, special)) != need) {
        fprintf(stderr, "kvr-run: cannot tokenize the text: %s\n", ids ? kvr_last_error() : "out of memory");
        free(ids);
        return NULL;
    }
    *n = need;
    return ids;
}

//
// conversation mode
//

// A growing string (always zero-terminated once anything was added). An allocation that fails
// leaves it as it was and sets oom, which the chat checks after each step.
struct text {
    char * s;
    size_t len, cap;
    bool   oom;
};

static void text_add(struct text * t, const char * s, size_t n) {
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 256;
        while (cap < t->len + n + 1) cap *= 2;
        char * p = realloc(t->s, cap);
        if (!p) { t->oom = true; return; }
        t->s = p;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = '\0';
}

static void text_set(struct text * t, const char * s) {
    t->len = 0;
    text_add(t, s, strlen(s));
}

// The text of a token (special: control tokens as their text), added to t; false if it has none.
static void text_add_piece(struct text * t, const struct kvr_vocab * v, int32_t id, bool special) {
    char small[256];
    int n = kvr_token_to_piece(v, id, small, (int) sizeof small, special);
    if (n < 0) {
        char * big = malloc((size_t) -n);
        if (big && (n = kvr_token_to_piece(v, id, big, -n, special)) > 0) text_add(t, big, (size_t) n);
        free(big);
    } else if (n > 0) {
        text_add(t, small, (size_t) n);
    }
}

// One user turn from stdin, without its newline; a line ending in '\' goes on on the next line
// (as in llama.cpp's console). NULL at the end of the input.
static char * read_turn(bool tty) {
    if (tty) {
        fputs("> ", stdout);
        fflush(stdout);
    }
    struct text t = { 0 };
    char * line = NULL;
    size_t cap = 0;
    ssize_t n;
    bool any = false;
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        any = true;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
        if (n > 0 && line[n - 1] == '\\') {
            text_add(&t, line, (size_t) n - 1);
            text_add(&t, "\n", 1);
            continue;
        }
        text_add(&t, line, (size_t) n);
        break;
    }
    free(line);
    if (!any || t.oom) { // the end of the input (or no memory to hold the line: the chat ends)
        if (t.oom) fprintf(stderr, "kvr-run: out of memory for the input line\n");
        free(t.s);
        return NULL;
    }
    return t.s ? t.s : strdup("");
}

// At most max bytes of s on one line that cannot drive a terminal: newlines as \n, control bytes
// (C0, DEL, and C1 as UTF-8 writes them) as \xHH.
static void put_escaped(FILE * f, const char * s, size_t max) {
    const unsigned char * u = (const unsigned char *) s;
    for (size_t i = 0; i < max && u[i]; i++) {
        if (u[i] == '\n') {
            fputs("\\n", f);
        } else if (u[i] < 0x20 || u[i] == 0x7f || (u[i] == 0xc2 && u[i + 1] >= 0x80 && u[i + 1] < 0xa0)) {
            fprintf(f, "\\x%02x", u[i]);
        } else if (i > 0 && u[i - 1] == 0xc2 && u[i] >= 0x80 && u[i] < 0xa0) {
            fprintf(f, "\\x%02x", u[i]);
        } else {
            fputc(u[i], f);
        }
    }
}

// The conversation rendered by a template family into a new string; with markup, also which of
// its bytes are the template's own (a new array in *markup).
static char * chat_render(const char * family, const struct kvr_chat_message * msgs, int n, bool add_assistant, bool ** markup) {
    const int len = kvr_chat_apply(family, msgs, n, add_assistant, NULL, 0);
    char * buf = len >= 0 ? malloc((size_t) len + 1) : NULL;
    bool * mk = len >= 0 && markup ? malloc((size_t) len + 1) : NULL;
    if (!buf || (markup && !mk) ||
        (markup ? kvr_chat_apply_markup(family, msgs, n, add_assistant, buf, mk, len + 1)
                : kvr_chat_apply(family, msgs, n, add_assistant, buf, len + 1)) != len) {
        fprintf(stderr, "kvr-run: cannot render the chat: %s\n", len < 0 ? kvr_last_error() : "out of memory");
        free(buf);
        free(mk);
        return NULL;
    }
    if (markup) *markup = mk;
    return buf;
}

struct chat {
    const struct run_args  * a;
    const struct kvr_vocab * vocab;
    struct kvr_session        * dist;
    const char             * family;  // the template family
    int                      n_ctx;
    struct kvr_chat_message * msgs;   // contents owned here
    int                      n_msgs, cap_msgs;
    struct text              cached;  // the text the cache holds (and the pending token)
    bool                     bos;     // the first prefill still has to add BOS
    int32_t                  pending; // the reply's last token: sampled and shown, not yet evaluated
    bool                     closed;  // the last reply ended with its end-of-turn token
    int                      turn;
};

// Add a message; false (with a message) when memory runs out.
static bool chat_add(struct chat * c, const char * role, const char * content) {
    if (c->n_msgs == c->cap_msgs) {
        const int cap = c->cap_msgs ? 2 * c->cap_msgs : 16;
        struct kvr_chat_message * m = realloc(c->msgs, sizeof(*m) * (size_t) cap);
        if (!m) { fprintf(stderr, "kvr-run: out of memory for the chat\n"); return false; }
        c->msgs = m;
        c->cap_msgs = cap;
    }
    char * copy = strdup(content);
    if (!copy) { fprintf(stderr, "kvr-run: out of memory for the chat\n"); return false; }
    c->msgs[c->n_msgs++] = (struct kvr_chat_message) { role, copy };
    return true;
}

// Prefill what the conversation adds since the cache's text: the pending token, then the rest
// of the rendering. The rendering of the conversation so far normally starts with the cache's text
// (the reply as generated, its end-of-turn token as the template writes it). Where the template
// changed the reply (trimmed it) or the model ended its turn with another token, this does what
// llama.cpp's chat does: the new message's rendering after that of the conversation before it, a
// newline first where that rendering ends with one (the newline after the end-of-turn token), and
// the end-of-turn token first if the reply was cut off. Returns the last token's logits, or NULL
// with *rc set (1: the context is full or the prefill failed, 2: bad input; 0: nothing to add).
// The new text is tokenized with kvr_tokenize_markup: special tokens come from the template's own
// markers only, unless --special-in-turns.
static const float * chat_prefill(struct chat * c, int * rc) {
    bool * full_mk = NULL;
    char * full = chat_render(c->family, c->msgs, c->n_msgs, c->msgs[c->n_msgs - 1].role[0] == 'u', &full_mk);
    if (!full) { *rc = 2; return NULL; }
    size_t start = c->cached.len; // the new text: full from start, after a newline where nl
    bool nl = false;
    int32_t head[2];
    int n_head = 0;
    if (c->pending >= 0) head[n_head++] = c->pending;
    if (c->cached.len == 0 || strncmp(full, c->cached.s, c->cached.len) == 0) {
        start = c->cached.len;
    } else {
        if (c->a->verbose) {
            size_t at = 0;
            while (at < c->cached.len && full[at] == c->cached.s[at]) at++;
            fprintf(stderr, "turn %d: the template writes the conversation otherwise than the cache holds it from byte %zu (\"",
                    c->turn, at);
            put_escaped(stderr, full + at, 20);
            fputs("\" vs \"", stderr);
            put_escaped(stderr, c->cached.s + at, 20);
            fputs("\"): llama.cpp's rule for the new turn\n", stderr);
        }
        char * past = chat_render(c->family, c->msgs, c->n_msgs - 1, false, NULL);
        if (!past) { free(full); free(full_mk); *rc = 2; return NULL; }
        const size_t pl = strlen(past);
        if (!c->closed) {
            const int32_t eot = kvr_vocab_eot(c->vocab) >= 0 ? kvr_vocab_eot(c->vocab) : kvr_vocab_eos(c->vocab);
            if (eot >= 0) head[n_head++] = eot;
        }
        nl = pl > 0 && past[pl - 1] == '\n';
        start = strncmp(full, past, pl) == 0 ? pl : 0;
        free(past);
    }
    const size_t rest = strlen(full) - start;
    char * delta = malloc(nl + rest + 1);
    bool * delta_mk = malloc(nl + rest + 1);
    if (!delta || !delta_mk) {
        fprintf(stderr, "kvr-run: out of memory for the chat\n");
        free(full); free(full_mk); free(delta); free(delta_mk); *rc = 1; return NULL;
    }
    delta[0] = '\n';
    delta_mk[0] = true; // the template's newline after an end of turn
    memcpy(delta + nl, full + start, rest + 1);
    memcpy(delta_mk + nl, full_mk + start, rest);
    free(full_mk);
    int n_text = 0;
    int32_t * text_ids = tokenize_text(c->vocab, delta, c->a->special_in_turns ? NULL : delta_mk, c->bos, true, &n_text);
    free(delta_mk);
    if (!text_ids) { free(full); free(delta); *rc = 2; return NULL; }
    const int n = n_head + n_text;
    int32_t * ids = malloc(sizeof(int32_t) * (size_t) (n > 0 ? n : 1));
    if (!ids) {
        fprintf(stderr, "kvr-run: out of memory for the chat\n");
        free(text_ids); free(full); free(delta); *rc = 1; return NULL;
    }
    memcpy(ids, head, sizeof(int32_t) * (size_t) n_head);
    memcpy(ids + n_head, text_ids, sizeof(int32_t) * (size_t) n_text);
    free(text_ids);
    const float * logits = NULL;
    const int n_past = kvr_session_n_past(c->dist);
    if (n == 0) {
        *rc = 0; // nothing to add (a system message that the family writes into the first user turn)
    } else if (n_past + n > c->n_ctx) {
        *rc = 1;
        fprintf(stderr, "kvr-run: the context is full: %d of %d tokens used, this turn needs %d more; the chat ends here (raise -c)\n",
                n_past, c->n_ctx, n);
    } else {
        if (c->a->verbose) print_ids("turn ids", ids, n);
        const double t0 = kvr_time_ms();
        logits = kvr_session_eval(c->dist, ids, n);
        if (c->a->stats) print_stats(c->dist);
        if (!logits) {
            *rc = 1;
            fprintf(stderr, "kvr-run: prefill of turn %d failed: %s\n", c->turn, kvr_last_error());
        } else {
            if (c->a->verbose) {
                fprintf(stderr, "turn %d: %d tokens prefilled on top of %d (%s) in %.1f ms\n", c->turn, n, n_past,
                        kvr_strategy_name(kvr_session_last_strategy(c->dist)), kvr_time_ms() - t0);
            }
            c->bos = false;
            c->pending = -1;
            text_set(&c->cached, full);
            if (c->cached.oom) { fprintf(stderr, "kvr-run: out of memory for the chat\n"); *rc = 1; logits = NULL; }
        }
    }
    free(ids);
    free(full);
    free(delta);
    return logits;
}

// Sample and stream the assistant's reply until its end of turn (or -n tokens, or a full context).
static int chat_reply(struct chat * c, struct kvr_sampler * smp, const float * logits) {
    const int n_vocab = kvr_vocab_n_tokens(c->vocab);
    struct text reply = { 0 };
    int rc = 0, n_gen = 0;
    const double t0 = kvr_time_ms();
    c->closed = false;
    for (;;) {
        const int32_t id = kvr_sample(smp, logits, n_vocab);
        n_gen++;
        c->pending = id;
        text_add_piece(&c->cached, c->vocab, id, true);
        if (kvr_vocab_is_eog(c->vocab, id)) {
            c->closed = true;
            break;
        }
        const size_t before = reply.len;
        text_add_piece(&reply, c->vocab, id, false);
        fwrite(reply.s ? reply.s + before : "", 1, reply.len - before, stdout);
        fflush(stdout);
        if (c->a->n_predict_set && n_gen >= c->a->n_predict) break;
        if (run_signal) break; // Ctrl-C ends the reply, not the chat (SIGTERM: the chat too)
        if (kvr_session_n_past(c->dist) + 1 > c->n_ctx) {
            fprintf(stderr, "\nkvr-run: the context is full (%d tokens): the reply stops here and the chat ends (raise -c)\n", c->n_ctx);
            rc = 1;
            break;
        }
        logits = kvr_session_eval(c->dist, &id, 1);
        if (!logits && run_signal) break; // its token stays pending, as after --n-predict
        if (!logits) {
            fprintf(stderr, "\nkvr-run: decode failed: %s\n", kvr_last_error());
            rc = 1;
            break;
        }
        c->pending = -1;
    }
    if (run_signal == SIGINT) { // the reply ended; the chat goes on with a fresh Ctrl-C
        kvr_session_interrupt(c->dist, false);
        run_signal = 0;
        if (c->a->verbose) fprintf(stderr, "\nturn %d: the reply was interrupted\n", c->turn);
    }
    fputc('\n', stdout);
    fflush(stdout);
    if (c->a->verbose) {
        fprintf(stderr, "turn %d: %d tokens in %.1f ms%s\n", c->turn, n_gen, kvr_time_ms() - t0,
                c->closed ? "" : " (no end of turn)");
    }
    if (reply.oom || c->cached.oom) {
        fprintf(stderr, "kvr-run: out of memory for the chat\n");
        rc = 1;
    }
    if (!chat_add(c, "assistant", reply.s ? reply.s : "")) rc = 1;
    free(reply.s);
    return rc;
}

// The chat: an optional system message prefilled first, then user turns (first_user, then
// stdin) each prefilled on top of the cache and answered. Returns the exit status.
static int run_conversation(const struct run_args * a, const struct kvr_model * model, struct kvr_session * dist,
                            struct kvr_sampler * smp, const char * first_user, int n_ctx) {
    const struct kvr_vocab * vocab = kvr_model_vocab(model);
    const char * tmpl = a->chat_template ? a->chat_template : kvr_vocab_chat_template(vocab);
    if (!tmpl) {
        fprintf(stderr, "kvr-run: %s has no chat template (tokenizer.chat_template): chatml is used "
                "(--chat-template NAME picks another)\n", a->model);
        tmpl = "chatml";
    }
    const char * family = kvr_chat_template_detect(tmpl);
    if (!family) {
        fprintf(stderr, "kvr-run: %s: %s\n", a->chat_template ? "--chat-template" : a->model, kvr_last_error());
        return 2;
    }
    if (a->verbose) fprintf(stderr, "chat template: %s%s\n", family, a->chat_template ? "" : " (the file's)");
    const bool tty = isatty(0);
    if (tty) fprintf(stderr, "kvr-run: chat with %s; /exit or end of input (Ctrl-D) ends it\n", a->model);

    struct chat c = {
        .a = a, .vocab = vocab, .dist = dist, .family = family, .n_ctx = n_ctx,
        .bos = kvr_vocab_add_bos(vocab), .pending = -1, .closed = true,
    };
    int rc = 0;
    if (a->system) {
        if (!chat_add(&c, "system", a->system)) { rc = 1; goto out; }
        // what the system message renders to alone goes in now, while the user is still typing
        if (!chat_prefill(&c, &rc) && rc != 0) goto out;
    }
    for (;;) {
        char * user = first_user ? strdup(first_user) : read_turn(tty);
        const bool typed = first_user == NULL;
        first_user = NULL;
        if (!user && run_signal) { rc = interrupted("while waiting for a turn: the chat ends"); break; }
        if (!user) break; // end of input
        if (strcmp(user, "/exit") == 0) {
            free(user);
            break;
        }
        const size_t len = typed && !a->no_escape ? kvr_unescape(user) : strlen(user);
        // a typed line is held to what -p and -f are (UTF-8, no NUL): one that is not is dropped,
        // saying so, and the chat goes on
        if (typed && kvr_cli_check_text("kvr-run", "the line (dropped)", user, len) != 0) {
            free(user);
            continue;
        }
        if (user[0] == '\0') { // nothing said: wait for the next line
            free(user);
            continue;
        }
        c.turn++;
        const bool added = chat_add(&c, "user", user);
        free(user);
        if (!added) { rc = 1; break; }
        const float * logits = chat_prefill(&c, &rc);
        if (!logits) {
            if (run_signal) rc = interrupted("during a turn's prefill: the chat ends");
            else if (rc == 0) { fprintf(stderr, "kvr-run: turn %d renders to no tokens\n", c.turn); rc = 2; }
            break;
        }
        if ((rc = chat_reply(&c, smp, logits)) != 0) break;
        if (run_signal) { rc = interrupted("during a reply: the chat ends"); break; }
    }
out:
    for (int i = 0; i < c.n_msgs; i++) free((void *) c.msgs[i].content);
    free(c.msgs);
    free(c.cached.s);
    return rc;
}

// The whole run; main() below, and the CLI fuzz target calls it in-process (tests/fuzz-cli.c), so
// every path returns (no exit) and frees what it took.
// The token count in a cache file's header (or in PATH.0's, rank 0's shard), to size the checks
// of the context before the session exists; -1 if there is no such file. Nothing else is trusted
// here: the load checks the whole file.
static int kv_file_tokens(const char * path) {
    char p[4096];
    FILE * f = kvr_file_read(path); // not a FIFO: the load refuses what this skips
    if (!f) {
        kvr_session_kv_shard_path(path, 0, p, sizeof(p));
        f = kvr_file_read(p);
    }
    if (!f) return -1;
    uint8_t h[KVR_KV_FILE_HEADER];
    const size_t got = fread(h, 1, sizeof(h), f);
    fclose(f);
    if (got < 68) return 0; // the load names what is wrong
    const uint32_t n = (uint32_t)h[64] | (uint32_t)h[65] << 8 | (uint32_t)h[66] << 16 | (uint32_t)h[67] << 24;
    return n > (1u << 24) ? 0 : (int)n;
}

// --kv-load and --session: restore the cache; returns how many of the prompt's tokens are already
// in it (session: the longest common prefix, so only the rest is prefilled), or -1 on an error.
// A prompt that is all in the cache is prefilled from its last token, whose logits are needed.
static int kv_restore(struct kvr_session * d, const struct run_args * a, const int32_t * ids, int n_prompt, bool speaker) {
    const char * path = a->kv_load ? a->kv_load : a->session;
    if (a->session && kv_file_tokens(path) < 0) {
        if (a->verbose && speaker) fprintf(stderr, "session: %s does not exist yet: a new session\n", path);
        return 0;
    }
    if (kvr_session_kv_load(d, path) != KVR_OK) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        return -1;
    }
    const int n_cached = kvr_session_n_past(d);
    if (a->kv_load) {
        if (a->verbose && speaker) fprintf(stderr, "kv-load: restored %d tokens from %s\n", n_cached, path);
        return 0; // the prompt, if any, is appended
    }
    const int32_t * cached = kvr_session_tokens(d);
    int reuse = 0;
    while (reuse < n_cached && reuse < n_prompt && cached[reuse] == ids[reuse]) reuse++;
    const bool logits_fit = reuse == n_prompt && n_cached == n_prompt && kvr_session_logits(d) != NULL;
    if (reuse == n_prompt && !logits_fit) reuse--; // the last prompt token again, for its logits
    int rc = kvr_session_truncate(d, reuse);
    if (rc == KVR_ERR_UNSUPP) { // a cache that cannot be cut there (recurrent layers' states): the prompt again, whole
        if (a->verbose && speaker) fprintf(stderr, "session: %s; prefilling the whole prompt\n", kvr_last_error());
        reuse = 0;
        rc = kvr_session_truncate(d, 0);
    }
    if (rc != KVR_OK) {
        fprintf(stderr, "kvr-run: %s: %s\n", path, kvr_last_error());
        return -1;
    }
    if (a->verbose && speaker) {
        fprintf(stderr, "session: %s holds %d tokens; reused %d of the prompt's %d, prefilling %d\n", path, n_cached, reuse,
                n_prompt, n_prompt - reuse);
    }
    return reuse;
}

static int kv_save(struct kvr_session * d, const char * path) {
    if (kvr_session_kv_save(d, path, false) != KVR_OK) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        return 1;
    }
    return 0;
}

// P/D (--stats, printed by the process that holds the decode rank, after the first decoded token):
// the cache bytes streamed to the decode rank, when the prefill ranks were done (the latest of
// their TTFTs; under MPI, where this process sees no other rank, when the logits arrived), when
// the decode rank had the whole cache, and when the first decoded token was there, all in ms from
// the prefill's start
static void print_pd_stats(const struct kvr_rank_stats * st, int n, int decode_rank, double t_logits, double t_token) {
    const struct kvr_rank_stats * dr = NULL;
    double prefill_end = 0;
    bool others = false;
    for (int i = 0; i < n; i++) {
        if (st[i].rank == decode_rank) { dr = &st[i]; continue; }
        others = true;
        if (st[i].ttft_ms > prefill_end) prefill_end = st[i].ttft_ms;
    }
    if (!dr) return;
    if (!others) prefill_end = t_logits;
    fprintf(stderr, "{\"decode_rank\":%d,\"kv_stream_bytes\":%lld,\"prefill_end_ms\":%.3f,\"stream_end_ms\":%.3f,"
            "\"first_token_ms\":%.3f,\"prefill_end_to_first_token_ms\":%.3f}\n", decode_rank, (long long)dr->kv_stream_bytes,
            prefill_end, dr->ttft_ms, t_token, t_token - prefill_end);
}

// stdout carries the text: a write that failed there (a full disk, a closed descriptor) fails the
// run, said once on stderr; true if so
static bool stdout_failed(void) {
    errno = 0;
    if (fflush(stdout) == 0 && !ferror(stdout)) return false;
    fprintf(stderr, "\nkvr-run: cannot write the text to stdout: %s\n", errno ? strerror(errno) : "a write failed");
    return true;
}

int kvr_run_main(int argc, char ** argv);
int kvr_run_main(int argc, char ** argv) {
    clearerr(stdout); // this run's write errors only (the CLI fuzz target calls this again and again)
    struct run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc < 0 ? 0 : rc;

    // the prompt file before the model: a bad file costs nothing to find. It is read up to what
    // the largest context this run can have takes (-c, else at most 4096 tokens) at a generous 64
    // bytes a token: -f /dev/zero or a huge file is refused without reading it whole
    char * text = NULL;
    const size_t max_text = (size_t)(a.n_ctx > 0 ? a.n_ctx : 4096) * 64 + 4096;
    if (a.prompt_file && kvr_cli_read_text("kvr-run", a.prompt_file, max_text, &text, NULL)) return 2;
    struct kvr_model * model = kvr_model_load(a.model, &(struct kvr_model_params){ .mmap = a.mmap });
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
    struct kvr_session * dist = NULL;
    int32_t * gen = NULL, * eog = NULL; // eog: the end-of-generation ids (--ignore-eos)
    float * masked = NULL;               // --ignore-eos: the logits with those at -inf
    int n_eog = 0;
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
        // -p is escape-processed as llama.cpp's CLI does (a -f file is its text exactly); in a
        // chat the text is the first user turn, tokenized with its template later
        if (!text && a.prompt) text = strdup(a.prompt);
        if (text && a.prompt && !a.no_escape) kvr_unescape(text);
        if (!a.conversation && !text) {
            ids = malloc(sizeof(int32_t)); // --kv-load or --resume alone: nothing to append (the logs' prompt)
        } else if (!a.conversation) {
            // appended to a restored cache: no BOS
            ids = tokenize_text(vocab, text, NULL, kvr_vocab_add_bos(vocab) && !a.kv_load, !a.no_special, &n_prompt);
            if (!ids) goto done;
        }
    }
    if (n_prompt == 0 && !a.conversation && !a.kv_load && !a.resume) {
        fprintf(stderr, "kvr-run: the prompt has no tokens\n");
        goto done;
    }
    if (a.verbose && !a.conversation && n_prompt) print_ids("prompt ids", ids, n_prompt);
    // a restored cache counts against the context (a session's covers part of the prompt), and a
    // save after the generation evaluates its last token too
    int n_cached = a.kv_load ? kv_file_tokens(a.kv_load) : 0;
    if (n_cached < 0) n_cached = 0; // the load says the file is missing
    if (a.session && kv_file_tokens(a.session) > n_prompt) n_cached = kv_file_tokens(a.session) - n_prompt;
    const int n_save = (a.kv_save || a.session) && a.n_predict > 0 ? 1 : 0;

    // the context: the model's trained one unless -c says otherwise, capped as -h says
    const int n_train = hp->n_ctx_train > 0 ? (int)(hp->n_ctx_train < (1u << 24) ? hp->n_ctx_train : (1u << 24)) : 4096;
    const int n_ctx = a.n_ctx > 0 ? a.n_ctx : n_train < 4096 ? n_train : 4096;
    if (n_prompt > n_ctx) {
        fprintf(stderr, "kvr-run: the prompt has %d tokens, more than the context of %d (%s; the model was trained on %d)\n",
                n_prompt, n_ctx, a.n_ctx > 0 ? "-c" : "the default", n_train);
        goto done;
    }
    if (!a.conversation && n_cached + n_prompt + a.n_predict + n_save > n_ctx) {
        fprintf(stderr, "kvr-run: %s%d prompt tokens + %d to generate%s exceed the context of %d (raise -c or lower -n)\n",
                n_cached ? "the cached tokens + " : "", n_prompt, a.n_predict, n_save ? " + 1 evaluated for the save" : "", n_ctx);
        goto done;
    }
    if (a.n_ctx > n_train) {
        fprintf(stderr, "kvr-run: warning: -c %d is above the %d tokens the model was trained on: positions past them are\n"
                "  beyond what its RoPE saw in training, and the text may degrade there\n", a.n_ctx, n_train);
    }
    // --ranks past what the prompt can use (kvr_useful_ranks: each rank must get a token of it) is
    // capped, saying so: the text is the same on fewer ranks, so the run goes on rather than
    // ending. The prompt decides when the run starts from an empty cache with it; a chat's turns,
    // a restored cache and resumed logs are bounded by the context only. A given partition is the
    // user's split. Processes under mpirun cannot be capped: too many are refused once the
    // communicator says how many there are (below).
    const bool fresh = !a.conversation && !a.kv_load && !a.resume && !(a.session && kv_file_tokens(a.session) > 0);
    const int t_split = fresh ? n_prompt : n_ctx;
    const bool own_split = a.partition && strcmp(a.partition, "even") != 0;
    char split_what[64];
    snprintf(split_what, sizeof(split_what), fresh ? "a %d-token prompt" : "a context of %d tokens", t_split);
    if (!own_split && kvr_useful_ranks(a.strategy, t_split, a.n_ranks, a.pd) < a.n_ranks) {
        const int u = kvr_useful_ranks(a.strategy, t_split, a.n_ranks, a.pd);
        fprintf(stderr, "kvr-run: --ranks %d: %s gives %s work to %d rank%s%s (each needs a token of it): running %d\n", a.n_ranks,
                split_what, kvr_strategy_name(a.strategy), a.pd ? u - 1 : u, (a.pd ? u - 1 : u) > 1 ? "s" : "",
                a.pd ? " and the decode rank" : "", u);
        a.n_ranks = u;
        if (a.pd) a.decode_rank = u - 1;
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
    const int n_prefill = a.pd ? a.n_ranks - 1 : a.n_ranks; // the ranks a partition splits the prompt over
    if (a.partition && strncmp(a.partition, "table:", 6) == 0) {
        // KVR-P: fractions interpolated from a lookup table written by kvr-tune --search
        struct kvr_tune_model tm;
        fracs = calloc((size_t)n_prefill, sizeof(double));
        if (kvr_tune_model_from(model, &tm) != KVR_OK ||
            kvr_tune_table_partition(a.partition + 6, tm.name, n_prefill, n_prompt, fracs) != KVR_OK) {
            fprintf(stderr, "kvr-run: --partition %s: %s\n", a.partition, kvr_last_error());
            goto done;
        }
        if (a.verbose) {
            fprintf(stderr, "partition (KVR-P from %s, model %s):", a.partition + 6, tm.name);
            for (int i = 0; i < n_prefill; i++) fprintf(stderr, " %.4f", fracs[i]);
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
    // the test hooks: KVR_TEST_KILL (parsed with the arguments) and KVR_TEST_STALL, "rank:layer",
    // which stops that rank before that layer's transfers (checked by parse_args)
    struct kvr_test_hooks hooks = { .kill = a.kill, .n_kill = a.n_kill };
    if (getenv("KVR_TEST_STALL")) {
        hooks.stall = sscanf(getenv("KVR_TEST_STALL"), "%d:%d", &hooks.stall_rank, &hooks.stall_layer) == 2;
    }
    struct kvr_session_params dp = {
        .strategy = a.strategy, .comm = (enum kvr_comm_kind)a.comm, .n_ranks = a.n_ranks, .n_threads = a.n_threads, .n_ctx = n_ctx,
        .partition = counts, .fractions = fracs, .attn_mode = (enum kvr_attn_mode)a.attn_mode, .timeout_s = a.timeout_s,
        .cache_type_k = kvr_cli_cache_k(&a.cache), .cache_type_v = kvr_cli_cache_v(&a.cache),
        .link_gbps = a.link_gbps, .link_latency_us = a.link_latency_us,
        .link_noise = a.link_noise, .link_seed = a.seed_set ? a.seed : 1, .trace = a.trace != NULL, .node_times = a.stats,
        .graph_out = a.dump_graph ? stderr : NULL, .q8_activations = kvr_cli_q8(&a.arith), .vec_dot_order = a.vec_dot_order,
        .avx512_order = a.avx512_order,
        .backend = a.backend, .device = a.device,
        .log = a.verbose ? stderr : NULL,
        .kv_stream = a.kv_stream, .pd = a.pd, .decode_rank = a.decode_rank,
        .replicate_dir = a.replicate_dir,
        .replicate = a.replicate, .test = &hooks,
    };
    dist = kvr_session_new(model, &dp);
    if (!dist) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        goto done;
    }
    run_session = dist;
    if (run_signal) kvr_session_interrupt(dist, true); // a signal while the model loaded
    if ((counts || fracs) && a.comm != KVR_COMM_LOCAL) {
        // under MPI the rank count is the communicator's, known only now (and still before any work)
        if (a.n_part > 0 && a.n_part != kvr_session_n_ranks(dist)) {
            fprintf(stderr, "kvr-run: --partition has %d entries for %d ranks\n", a.n_part, kvr_session_n_ranks(dist));
            goto done;
        }
    }
    // under MPI every rank runs this program; rank 0 speaks for all
    const bool speaker = kvr_session_rank(dist) == 0;
    if (!own_split && kvr_useful_ranks(a.strategy, t_split, kvr_session_n_ranks(dist), a.pd) < kvr_session_n_ranks(dist)) {
        // processes started by mpirun (the local count was capped above): every one refuses alike
        const int u = kvr_useful_ranks(a.strategy, t_split, kvr_session_n_ranks(dist), a.pd);
        if (speaker) {
            fprintf(stderr, "kvr-run: %d processes: %s gives %s work to %d rank%s%s (each needs a token of it): start %d (mpirun -np %d)\n",
                    kvr_session_n_ranks(dist), split_what, kvr_strategy_name(a.strategy), a.pd ? u - 1 : u, (a.pd ? u - 1 : u) > 1 ? "s" : "",
                    a.pd ? " and the decode rank" : "", u, u);
        }
        goto done;
    }

    if (!a.seed_set) a.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (a.verbose && speaker) fprintf(stderr, "seed: %llu\n", (unsigned long long)a.seed);
    kvr_sampler_init(&smp, &(struct kvr_sampler_params) { a.temp, a.top_k, a.top_p, a.seed });
    smp_init = true;
    if (a.conversation) {
        rc = run_conversation(&a, model, dist, &smp, text, n_ctx);
        goto done;
    }
    int reuse = 0, n_resumed = 0;
    if (a.kv_load || a.session) {
        reuse = kv_restore(dist, &a, ids, n_prompt, speaker);
        if (reuse < 0) goto done;
    }
    if (a.resume) {
        // the logs of a run that stopped: what every rank acknowledged is restored, its last
        // token's logits are there, and the text goes on from it
        struct kvr_resume_info ri;
        const double t_resume = kvr_time_ms();
        if (kvr_session_resume(dist, a.resume, n_prompt ? ids : NULL, n_prompt, &ri) != KVR_OK) {
            fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
            goto done;
        }
        if (a.verbose && speaker) {
            fprintf(stderr, "resume: %d tokens back in %.1f ms (%.1f MB of logs read and checked, the last token evaluated again)\n",
                    ri.n_tokens, kvr_time_ms() - t_resume, ri.bytes / 1e6);
        }
        if (n_prompt == 0) { // no prompt given: the logs'
            if (ri.n_prompt == 0) {
                fprintf(stderr, "kvr-run: --resume %s: the logs name no prompt: give it (-p, -f or --tokens)\n", a.resume);
                goto done;
            }
            free(ids);
            ids = malloc(sizeof(int32_t) * (size_t)ri.n_prompt);
            memcpy(ids, ri.prompt, sizeof(int32_t) * (size_t)ri.n_prompt);
            n_prompt = ri.n_prompt;
            if (n_prompt + a.n_predict > n_ctx) {
                fprintf(stderr, "kvr-run: the logs' %d prompt tokens + %d to generate exceed the context of %d (raise -c or lower -n)\n",
                        n_prompt, a.n_predict, n_ctx);
                goto done;
            }
        }
        if (ri.n_tokens >= n_prompt) {
            reuse = n_prompt;
            n_resumed = ri.n_tokens - n_prompt;
        }
    }

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
    if (stdout_failed()) { // nowhere to put the text: no prefill for it
        rc = 1;
        goto done;
    }

    rc = 0;
    const double t0 = kvr_time_ms();
    // only what the cache does not hold yet is prefilled
    const float * logits = n_prompt > reuse ? kvr_session_eval(dist, ids + reuse, n_prompt - reuse) : kvr_session_logits(dist);
    const double t_prefill = kvr_time_ms();
    if (a.stats && n_prompt > reuse) print_stats(dist);
    // P/D: the prefill ranks' and the decode rank's times, for the line after the first decoded token
    static struct kvr_rank_stats pst[256];
    const int n_pst = a.stats && a.pd && n_prompt > reuse ? kvr_session_stats(dist, pst, 256) : 0;
    if (!logits && run_signal) {
        rc = interrupted("during the prefill: nothing of it was kept or saved");
        goto done;
    }
    if (!logits) {
        if (n_prompt > reuse) fprintf(stderr, "\nkvr-run: prefill failed: %s\n", kvr_last_error());
        else fprintf(stderr, "kvr-run: %s holds no logits to continue from: give a prompt\n", a.kv_load);
        rc = n_prompt > reuse ? 1 : 2;
        goto done;
    }
    if (a.kv_save && (rc = kv_save(dist, a.kv_save)) != 0) goto done;
    // as llama.cpp: the prompt's cache is saved as soon as it is made (again after generation)
    if (a.session && n_prompt > reuse && (rc = kv_save(dist, a.session)) != 0) goto done;
    const int n_vocab = kvr_vocab_n_tokens(vocab);
    if (a.dump_logits && speaker) {
        struct kvr_file * kf;
        if (kvr_file_create(&kf, a.dump_logits) != KVR_OK) {
            fprintf(stderr, "kvr-run: --dump-logits: %s\n", kvr_last_error());
            rc = 1;
            goto done;
        }
        FILE * f = kvr_file_stream(kf);
        for (int i = 0; i < n_vocab; i++) fprintf(f, "%.9g\n", logits[i]);
        if (kvr_file_commit(kf) != KVR_OK) { // a full disk: the file is not put in place, the run fails
            fprintf(stderr, "kvr-run: --dump-logits: %s\n", kvr_last_error());
            rc = 1;
            goto done;
        }
    }
    double t_first = 0, t_end = 0;
    int n_gen = 0;
    gen = malloc(sizeof(int32_t) * (size_t)(a.n_predict + 1));
    if (a.ignore_eos) {
        masked = malloc(sizeof(float) * (size_t)n_vocab);
        eog = malloc(sizeof(int32_t) * (size_t)n_vocab);
        for (int i = 0; i < n_vocab; i++) {
            if (kvr_vocab_is_eog(vocab, i)) eog[n_eog++] = i;
        }
    }
    if (a.n_predict == 0) t_first = kvr_time_ms();
    bool first_piece = false;
    // --resume: the tokens the stopped run generated up to the step taken, as it printed them
    for (int i = 0; i < n_resumed && n_gen < a.n_predict; i++) {
        const int32_t id = kvr_session_tokens(dist)[n_prompt + i];
        gen[n_gen++] = id;
        if (speaker) print_piece(vocab, id, &first_piece);
        t_first = kvr_time_ms();
    }
    kvr_sampler_skip(&smp, n_gen);
    fflush(stdout);
    bool pending = false; // the last sampled token is not in the cache yet
    while (n_gen < a.n_predict && !run_signal) {
        if (masked) { // --ignore-eos, as llama.cpp does it: the end-of-generation tokens' logits are -inf
            memcpy(masked, logits, sizeof(float) * (size_t)n_vocab);
            for (int i = 0; i < n_eog; i++) masked[eog[i]] = -INFINITY;
        }
        const int32_t id = kvr_sample(&smp, masked ? masked : logits, n_vocab);
        if (n_gen == 0) t_first = kvr_time_ms();
        gen[n_gen++] = id;
        if (kvr_vocab_is_eog(vocab, id)) break;
        if (speaker) print_piece(vocab, id, &first_piece);
        if (stdout_failed()) {
            rc = 1;
            goto done;
        }
        if (n_gen == a.n_predict) {
            pending = true;
            break;
        }
        logits = kvr_session_eval(dist, &id, 1);
        if (!logits && run_signal) { // the token is printed but not in the cache: it goes in below
            pending = true;
            break;
        }
        if (!logits) {
            fprintf(stderr, "\nkvr-run: decode failed: %s\n", kvr_last_error());
            rc = 1;
            goto done;
        }
        if (n_gen == 1 && n_pst) print_pd_stats(pst, n_pst, a.decode_rank, t_prefill - t0, kvr_time_ms() - t0);
    }
    t_end = kvr_time_ms();
    if (n_save) {
        // the cache then holds every printed token and the logits of what comes next: a run that
        // loads it continues where this one stopped (interrupted too: the request was taken)
        kvr_session_interrupt(dist, false);
        if (pending && !kvr_session_eval(dist, &gen[n_gen - 1], 1)) {
            fprintf(stderr, "\nkvr-run: decode failed: %s\n", kvr_last_error());
            rc = 1;
            goto done;
        }
        if (a.kv_save) rc = kv_save(dist, a.kv_save);
    }
    if (a.session && rc == 0) rc = kv_save(dist, a.session);
    if (isatty(1) && speaker) putchar('\n');
    fflush(stdout);
    if (a.verbose && speaker) print_ids("generated ids", gen, n_gen);
    if (run_signal && rc == 0) {
        char where[96];
        snprintf(where, sizeof(where), "after %d generated token%s%s", n_gen, n_gen == 1 ? "" : "s",
                 n_save ? " (the cache saved as asked)" : "");
        rc = interrupted(where);
    }
    const double ttft = t_first - t0;
    if (speaker) {
        fprintf(stderr, "timing: prompt_tokens=%d ttft_ms=%.3f prefill_tok_s=%.2f decode_ms_per_tok=%.3f\n",
                n_prompt - reuse, ttft, (n_prompt - reuse) / ((t_prefill - t0) / 1e3), n_gen > 1 ? (t_end - t_first) / (n_gen - 1) : 0.0);
    }
done:
    run_session = NULL;
    if (rc == 0 && stdout_failed()) rc = 1;
    if (dist && a.trace && kvr_session_write_trace(dist, a.trace) != KVR_OK) {
        fprintf(stderr, "kvr-run: %s\n", kvr_last_error());
        if (rc == 0) rc = 1;
    }
    if (smp_init) kvr_sampler_free(&smp);
    kvr_session_free(dist);
    free(gen);
    free(eog);
    free(masked);
    free(counts);
    free(fracs);
    kvr_model_free(model);
    free(text);
    free(ids);
    return rc;
}

#ifndef KVR_RUN_NO_MAIN
int main(int argc, char ** argv) {
    kvr_blas_reexec(argv); // an OpenBLAS older than this CPU: its vector kernels, named before it loads them
    // no SA_RESTART: a read of the next chat turn returns at the signal
    struct sigaction sa = { .sa_handler = on_signal };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    kvr_cli_hold_std_fds();
    return kvr_run_main(argc, argv);
}
#endif
