// tests/fuzz-cli.c - libFuzzer over kvr-run's argument vector, run in-process (tools/kvr-run.c is
// included with KVR_RUN_NO_MAIN, so its kvr_run_main is called once per input). The input bytes
// choose, in order: the KVR_TEST_STALL hook (none, a rank and layer to stall, or a malformed
// value), where the prompt comes from, then up to 16 flags from kvr-run's own flag table (read
// through --list-flags at start, so flags added later are fuzzed too) with values drawn for the
// flag's kind: small values inside its range, its bounds and the numbers just past them, NaN,
// infinities, overflowing and malformed numbers, empty strings, paths that are missing,
// directories, empty or not text, and raw bytes from the input.
//
// Valid values are kept small and the comm timeout given first is 0.2 s (valid ones from the
// input are at most 2 s), so an accepted command line runs for a few seconds at most (on a
// machine so loaded that it does not, raise -timeout): a run that outlasts libFuzzer's -timeout is a hang, which
// is exactly what a stalled rank with an infinite or NaN timeout used to produce. A return code
// other than 0, 1 or 2, a crash, a sanitizer report or a leak is a failure too.
//
//   make build/fuzz-cli && KVR_FUZZ_MODEL=../shared/models/stories260K.gguf KVR_FUZZ_CLI_SEEDS=DIR \
//       build/fuzz-cli -max_total_time=60 -timeout=60 -close_fd_mask=3 DIR
// (KVR_FUZZ_CLI_SEEDS writes a seed corpus into DIR first; make fuzz-cli and make test do this.)

#define _XOPEN_SOURCE 700 // nftw
#define KVR_RUN_NO_MAIN
#include "tools/kvr-run.c"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>

#define MAX_FLAGS 128
#define MAX_ARGS  64

struct fflag {
    char   name[48];
    char   kind[16];
    double lo, hi;
    int    open;
    bool   ranged;
};

static struct fflag flags[MAX_FLAGS];
static int          n_flags;
static char         dir[512];
static char         model[1024];
static char         p_text[600], p_nul[600], p_bad[600], p_empty[600], p_table[600], p_out[600], p_missing[600];

static void write_file(const char * path, const char * bytes, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "fuzz-cli: cannot write %s\n", path);
        abort();
    }
}

// kvr-run --list-flags, captured from its stdout
static void read_flags(void) {
    fflush(stdout);
    FILE * tmp = tmpfile();
    const int saved = dup(1);
    if (!tmp || saved < 0 || dup2(fileno(tmp), 1) < 0) { fprintf(stderr, "fuzz-cli: cannot capture stdout\n"); abort(); }
    char * av[] = { "kvr-run", "--list-flags", NULL };
    const int rc = kvr_run_main(2, av);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    rewind(tmp);
    char line[256];
    while (rc == 0 && n_flags < MAX_FLAGS && fgets(line, sizeof(line), tmp)) {
        struct fflag * f = &flags[n_flags];
        char alt[48], lo[64], hi[64];
        if (sscanf(line, "%47s %47s %15s %63s %63s %d", f->name, alt, f->kind, lo, hi, &f->open) != 6) continue;
        f->ranged = strcmp(lo, "-") != 0;
        f->lo = f->ranged ? strtod(lo, NULL) : 0;
        f->hi = f->ranged ? strtod(hi, NULL) : 0;
        n_flags++;
    }
    fclose(tmp);
    if (rc != 0 || n_flags < 10) { fprintf(stderr, "fuzz-cli: kvr-run --list-flags gave %d flags (rc %d)\n", n_flags, rc); abort(); }
}

static void write_seeds(const char * d);

// our directory and what the runs left in it, at exit
static int remove_one(const char * path, const struct stat * st, int flag, struct FTW * ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_dir(void) {
    nftw(dir, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

int LLVMFuzzerInitialize(int * argc, char *** argv);
int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void)argc; (void)argv;
    const char * m = getenv("KVR_FUZZ_MODEL");
    snprintf(model, sizeof(model), "%s", m && *m ? m : "../shared/models/stories260K.gguf");
    if (access(model, R_OK) != 0) {
        fprintf(stderr, "fuzz-cli: no model at %s (set KVR_FUZZ_MODEL)\n", model);
        abort();
    }
    const char * t = getenv("TMPDIR");
    snprintf(dir, sizeof(dir), "%s/kvr-fuzz-cli-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(dir)) { fprintf(stderr, "fuzz-cli: cannot make %s\n", dir); abort(); }
    atexit(remove_dir);
    snprintf(p_text, sizeof(p_text), "%s/prompt.txt", dir);
    snprintf(p_nul, sizeof(p_nul), "%s/nul.txt", dir);
    snprintf(p_bad, sizeof(p_bad), "%s/bad.txt", dir);
    snprintf(p_empty, sizeof(p_empty), "%s/empty.txt", dir);
    snprintf(p_table, sizeof(p_table), "%s/parts.txt", dir);
    snprintf(p_out, sizeof(p_out), "%s/out.txt", dir);
    snprintf(p_missing, sizeof(p_missing), "%s/no/such/file", dir);
    write_file(p_text, "Once upon a time", 16);
    write_file(p_nul, "Once\0upon", 9);
    write_file(p_bad, "Once \xc3( upon", 11);
    write_file(p_empty, "", 0);
    const char * table = "profile test\nstories260K 2 4 0.6 0.4\nstories260K 2 16 0.5 0.5\nstories260K 3 8 0.4 0.3 0.3\n";
    write_file(p_table, table, strlen(table));
    // -cnv and friends read turns from stdin: at its end there, never at a terminal
    if (!freopen("/dev/null", "r", stdin)) { fprintf(stderr, "fuzz-cli: cannot read /dev/null\n"); abort(); }
    read_flags();
    const char * seeds = getenv("KVR_FUZZ_CLI_SEEDS");
    if (seeds && *seeds) write_seeds(seeds);
    return 0;
}

// the input, consumed a byte at a time (zeros once it runs out)
struct in {
    const uint8_t * p;
    size_t          n;
};

static int take(struct in * in) {
    if (in->n == 0) return -1;
    in->n--;
    return *in->p++;
}

static int take0(struct in * in) {
    const int b = take(in);
    return b < 0 ? 0 : b;
}

static const char * const junk[] = {
    "", "nan", "NaN", "-nan", "inf", "-inf", "infinity", "1e999", "-1e999", "1x", " 1", "1 ", "0x1p-2", "-0", "+1",
    "18446744073709551616", "99999999999999999999999", "-2147483649", "2147483648", "4294967297", ",", "1,,2", "1,",
    "\xff\xfe", "\xc4\x89", "-", "--", "-p", "--ranks", "1e-320", "0.", ".5", "5e-324",
};
static const char * const words[] = {
    "single", "tsp", "kvr", "ring-kv", "ring-q", "auto", "even", "causal", "dense", "local", "mpi", "1,1", "0.5,0.5",
    "2,3", "1,2,2", "0.3,0.3,0.4", "nan,nan", "-1,6", "1e9,1", "0,5", "inf,0", "5", "1,403,407", "1,99999", "0",
    "403,-1", "Once upon a time", "",
};

// A value for flag f into buf (cap bytes), chosen by the input.
static const char * value_for(struct in * in, const struct fflag * f, char * buf, size_t cap) {
    const int b = take0(in);
    if (!strcmp(f->kind, "out") || !strcmp(f->kind, "dir")) { // only paths of our own: junk and raw bytes would be files
                                                                // (or directories) in the cwd
        // (not /dev/null: the KV cache writer puts a file in place by rename, and as root that
        // replaced the device with a regular file once)
        const char * outs[] = { p_out, dir, p_missing, p_table, "", p_text };
        return outs[b % 6];
    }
    if (b >= 240) { // raw bytes from the input
        const int len = take0(in) % 48;
        int k = 0;
        for (; k < len && in->n > 0; k++) {
            const int c = take0(in);
            buf[k] = (char)(c ? c : 'x');
        }
        buf[k] = 0;
        return buf;
    }
    if (b >= 200) return junk[b % (sizeof(junk) / sizeof(junk[0]))];
    const int c = b % 16;
    if (!strcmp(f->kind, "in")) {
        const char * ins[] = { model, p_text, p_nul, p_bad, p_empty, p_table, dir, p_missing, "/dev/null", "" };
        return ins[c % 10];
    }
    if (!strcmp(f->kind, "u64")) {
        const char * us[] = { "0", "1", "42", "-1", "18446744073709551615", "18446744073709551616" };
        return us[c % 6];
    }
    if (f->ranged && (!strcmp(f->kind, "int") || !strcmp(f->kind, "ints") || !strcmp(f->kind, "custom-num"))) {
        // small values inside, the bounds and just past them; never a large valid count (that is
        // work, not a contract question: -n 1048576 -c 16777216 runs for hours by request)
        // (and at most 4: ranks x threads stays at 16 threads, which a loaded 2-core machine runs
        // under ASan in a few seconds)
        double v;
        if (c < 7) v = c < 5 ? c : c - 5;
        else if (c < 10) v = f->lo - (c - 7);
        else if (c < 13) v = f->hi + (c - 10) + 1;
        else v = f->hi * 1e3;
        snprintf(buf, cap, "%.0f", v);
        return buf;
    }
    if (f->ranged) { // reals: the same idea
        const double small[] = { 0, 0.25, 0.5, 1, 2, 1e-9, 1e-300 };
        double v;
        if (c < 7) v = small[c];
        else if (c == 7) v = f->lo;
        else if (c < 10) v = f->lo - (c == 8 ? 1e-9 : 1.0);
        else if (c < 13) v = f->hi + (c == 10 ? 1e-6 : c == 11 ? 1.0 : 1e300);
        else v = -(c - 12);
        snprintf(buf, cap, "%.17g", v);
        return buf;
    }
    return words[b % (sizeof(words) / sizeof(words[0]))];
}

// The value byte that picks junk[k] (value_for reads junk[b % n] for b in [200, 240)).
static uint8_t junk_byte(int k) {
    const int n = (int)(sizeof(junk) / sizeof(junk[0]));
    return (uint8_t)(200 + ((k - 200 % n) % n + n) % n);
}

// KVR_FUZZ_CLI_SEEDS=DIR: seeds there first, one per flag and kind of value, each on two ranks,
// so that a value that turns a wait into a hang is a few mutations away from the start of any
// run, even a short one.
static void write_seeds(const char * d) {
    int ranks = -1;
    for (int i = 0; i < n_flags; i++) if (!strcmp(flags[i].name, "--ranks")) ranks = i;
    const int n_junk = (int)(sizeof(junk) / sizeof(junk[0]));
    int n = 0;
    for (int i = 0; i < n_flags; i++) {
        // numbers: every junk value and the bounds, with a stalled rank (a value that disables a
        // timeout hangs there); other flags: their first few values, without (each stalled run
        // that goes through costs the 0.2 s timeout, and these are many)
        const bool numeric = flags[i].ranged || !strcmp(flags[i].kind, "u64");
        uint8_t vals[64];
        int nv = 0;
        if (numeric) {
            for (int c = 1; c < 16; c += c < 7 ? 3 : 1) vals[nv++] = (uint8_t)c;
            for (int k = 0; k < n_junk && nv < 64; k++) vals[nv++] = junk_byte(k);
        } else {
            for (int c = 0; c < 6; c++) vals[nv++] = (uint8_t)c;
            vals[nv++] = junk_byte(0);
        }
        for (int v = 0; v < nv; v++) {
            uint8_t seed[8];
            int len = 0;
            seed[len++] = numeric ? 130 : 0; // KVR_TEST_STALL=1:1 or none
            seed[len++] = 0;   // -p
            if (ranks >= 0) { seed[len++] = (uint8_t)ranks; seed[len++] = 2; }
            seed[len++] = (uint8_t)i;
            if (strcmp(flags[i].kind, "switch")) seed[len++] = vals[v];
            char path[700];
            snprintf(path, sizeof(path), "%s/seed-%03d-%02d", d, i, v);
            write_file(path, (const char *)seed, (size_t)len);
            n++;
            if (!strcmp(flags[i].kind, "switch")) break;
        }
    }
    fprintf(stderr, "fuzz-cli: %d seeds in %s\n", n, d);
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    struct in in = { data, size };
    static const char * const stalls[] = { "0:0", "1:0", "1:1", "2:3", "0:4", "9:0", "x", "1:", "-1:0", "1:1:1" };
    const int s = take0(&in);
    if (s < 128) unsetenv("KVR_TEST_STALL");
    else setenv("KVR_TEST_STALL", stalls[s % 10], 1);

    // defaults first, so that what the input gives overrides them (a flag's last value wins)
    char * argv[MAX_ARGS + 1];
    int argc = 0;
    argv[argc++] = "kvr-run";
    argv[argc++] = "-m";  argv[argc++] = model;
    argv[argc++] = "-n";  argv[argc++] = "3";
    argv[argc++] = "-t";  argv[argc++] = "1";
    argv[argc++] = "--seed"; argv[argc++] = "1";
    argv[argc++] = "--comm-timeout"; argv[argc++] = "0.2";
    switch (take0(&in) % 4) {
        case 0: argv[argc++] = "-p"; argv[argc++] = "Once upon a time"; break;
        case 1: argv[argc++] = "-f"; argv[argc++] = p_text; break;
        case 2: argv[argc++] = "--tokens"; argv[argc++] = "1,403,407,261"; break;
        default: break; // the input gives the prompt, or gets the error of having none
    }
    static char vals[16][64];
    for (int k = 0; k < 16 && in.n > 0 && argc + 2 <= MAX_ARGS; k++) {
        const int b = take0(&in);
        if (b >= 250) { // something that is not a flag of the table
            const char * stray[] = { "--bogus", "stray", "-", "--list-flagz", "-pp", "" };
            argv[argc++] = (char *)stray[b % 6];
            continue;
        }
        const struct fflag * f = &flags[b % n_flags];
        argv[argc++] = (char *)f->name;
        if (!strcmp(f->kind, "switch")) continue;
        argv[argc++] = (char *)value_for(&in, f, vals[k], sizeof(vals[k]));
    }
    argv[argc] = NULL;
    remove(p_out);
    const int rc = kvr_run_main(argc, argv);
    if (rc != 0 && rc != 1 && rc != 2) {
        fprintf(stderr, "fuzz-cli: kvr-run returned %d for:", rc);
        for (int i = 0; i < argc; i++) fprintf(stderr, " '%s'", argv[i]);
        fprintf(stderr, "\n");
        abort();
    }
    return 0;
}
