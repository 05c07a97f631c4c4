// tools/kvr-cli.h - the command-line contract every kvr tool shares: one table of flags per tool,
// one parser for all of them. A flag is one table entry (its spellings, its kind, where its value
// goes, its range, its line of -h), so -h is printed from the table and cannot drift from what is
// parsed. The contract, checked before a tool does any work:
//   - a number is a whole decimal number or a finite real inside the flag's range; NaN, infinities,
//     overflow, trailing junk and empty values are refused with a message naming the flag and value;
//   - an input file must exist, be a regular file and be readable (a FIFO, a device or a directory
//     is refused: nothing blocks on it or reads it endlessly); an output file must be creatable
//     where it is going (its directory writable) and be a regular file or nothing yet (a symbolic
//     link, a device, a FIFO or a directory is refused, as kvr_file_check_target does), and it
//     must not be one of the run's input files (the same st_dev/st_ino: a model or a prompt is
//     never written over), so a run never fails at its end for a path it was given at its start;
//   - exit status 2 for every bad flag, value, path or combination (kvr_cli_fail), 0 after -h.
//   - a flag marked once (the model, the prompt) given twice is refused, not silently replaced.
// --list-flags prints the table one flag a line ("NAME ALT KIND LO HI OPEN") for tests and shell
// completion. Prompt text (kvr-run, kvr-tokenize) is checked here too: UTF-8 without NUL bytes,
// in a file and in -p after its escapes.
//
// It is a header of static functions because the Makefile makes a program of every tools/*.c.
// Nothing here is part of the library: embedders parse their own options.

#ifndef KVR_CLI_H
#define KVR_CLI_H

#include "kvr.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum kvr_cli_kind {
    KVR_CLI_SECTION, // no flag: a heading in -h (help is the heading)
    KVR_CLI_SWITCH,  // bool *: set, takes no value
    KVR_CLI_INT,     // int *: a decimal integer in [lo, hi] (with k_suffix, 4k = 4096)
    KVR_CLI_U64,     // uint64_t *: a decimal integer from 0 to 2^64-1 (seeds)
    KVR_CLI_REAL,    // double *: a finite number in the range
    KVR_CLI_FLOAT,   // float *: the same, stored as a float
    KVR_CLI_TEXT,    // const char **: any text, not empty unless empty_ok
    KVR_CLI_IN,      // const char **: a file that exists and can be read now
    KVR_CLI_OUT,     // const char **: a file this run will write: creatable now
    KVR_CLI_DIR,     // const char **: a directory this run writes in: one that exists, or can be made now
    KVR_CLI_CHOICE,  // int *: the index of the value in choices ("causal|dense")
    KVR_CLI_INTS,    // struct kvr_cli_ints *: comma-separated INT values, each in the range
    KVR_CLI_REALS,   // struct kvr_cli_reals *: comma-separated REAL values, each in the range
    KVR_CLI_CUSTOM,  // parse(value, dst, why, cap): 0, or nonzero with why filled in
};

#define KVR_CLI_LO_OPEN 1 // the range excludes lo itself
#define KVR_CLI_HI_OPEN 2 // the range excludes hi itself
#define KVR_CLI_MAX_LIST 64

struct kvr_cli_ints  { int n; int    v[KVR_CLI_MAX_LIST]; };
struct kvr_cli_reals { int n; double v[KVR_CLI_MAX_LIST]; };

struct kvr_cli_flag {
    const char        * name;    // "-n", "--temp"
    const char        * alt;     // another spelling ("--n-predict") or NULL
    enum kvr_cli_kind   kind;
    void              * dst;     // where the value goes (see the kinds)
    const char        * meta;    // the value's name in -h: N, X, FILE, LIST
    const char        * help;    // its -h text; each '\n' starts an indented continuation line
    double              lo, hi;  // INT, REAL, FLOAT and list entries: the range (HUGE_VAL: unbounded)
    int                 open;    // KVR_CLI_LO_OPEN | KVR_CLI_HI_OPEN
    int                 max_n;   // lists: most entries (0: KVR_CLI_MAX_LIST)
    bool                k_suffix; // INT, INTS: a k suffix multiplies by 1024
    bool                empty_ok; // TEXT: "" is a value
    bool                numeric;  // CUSTOM: the value is made of numbers (tests feed it NaN)
    const char        * choices;  // CHOICE: "a|b|c"
    int              (* parse)(const char * value, void * dst, char * why, size_t cap); // CUSTOM
    bool              * given;    // set to true when the flag appears (NULL: not tracked)
    bool                once;     // given twice is an error (the model, the prompt: a second one
                                  //   would silently replace the first)
};

struct kvr_cli {
    const char                * prog;     // "kvr-run": every message starts with it
    const char                * synopsis; // the usage line(s), "usage: ..."
    const char                * about;    // -h: a paragraph under the synopsis (NULL: none)
    const struct kvr_cli_flag * flags;
    int                         n_flags;
    const char                * epilog;   // -h: text after the flags (NULL: none)
};

//
// messages
//

// A bad command line: "prog: message", the synopsis, and status 2 to return from main.
static inline int kvr_cli_fail(const struct kvr_cli * cli, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static inline int kvr_cli_fail(const struct kvr_cli * cli, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cli->prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n%s\n(%s -h for every option)\n", cli->synopsis, cli->prog);
    return 2;
}

static inline const char * kvr_cli_kind_name(const struct kvr_cli_flag * f) {
    switch (f->kind) {
        case KVR_CLI_SECTION: return "section";
        case KVR_CLI_SWITCH:  return "switch";
        case KVR_CLI_INT:     return "int";
        case KVR_CLI_U64:     return "u64";
        case KVR_CLI_REAL:
        case KVR_CLI_FLOAT:   return "real";
        case KVR_CLI_TEXT:    return "text";
        case KVR_CLI_IN:      return "in";
        case KVR_CLI_OUT:     return "out";
        case KVR_CLI_DIR:     return "dir";
        case KVR_CLI_CHOICE:  return "choice";
        case KVR_CLI_INTS:    return "ints";
        case KVR_CLI_REALS:   return "reals";
        case KVR_CLI_CUSTOM:  return f->numeric ? "custom-num" : "custom";
    }
    return "?";
}

// "from 1 to 256", "above 0 and at most 1", "at least 0"
static inline void kvr_cli_range(const struct kvr_cli_flag * f, char * buf, size_t cap) {
    if (f->kind == KVR_CLI_INT || f->kind == KVR_CLI_INTS) {
        snprintf(buf, cap, "an integer from %.0f to %.0f", f->lo, f->hi);
        return;
    }
    char lo[48] = "", hi[48] = "";
    if (f->lo > -HUGE_VAL) snprintf(lo, sizeof(lo), "%s %.10g", f->open & KVR_CLI_LO_OPEN ? "above" : "at least", f->lo);
    if (f->hi < HUGE_VAL) snprintf(hi, sizeof(hi), "%s %.10g", f->open & KVR_CLI_HI_OPEN ? "below" : "at most", f->hi);
    snprintf(buf, cap, "%s%s%s", lo, lo[0] && hi[0] ? " and " : "", hi);
}

// -h: the synopsis, the paragraph, one line per flag (help continued on indented lines)
static inline void kvr_cli_usage(const struct kvr_cli * cli, FILE * out) {
    fprintf(out, "%s\n", cli->synopsis);
    if (cli->about) fprintf(out, "\n%s\n", cli->about);
    fprintf(out, "\n");
    const int col = 24;
    for (int i = 0; i <= cli->n_flags; i++) {
        const struct kvr_cli_flag * f = i < cli->n_flags ? &cli->flags[i] : NULL;
        if (f && f->kind == KVR_CLI_SECTION) {
            fprintf(out, "%s\n", f->help);
            continue;
        }
        char left[96];
        if (f) {
            snprintf(left, sizeof(left), "  %s%s%s%s%s", f->name, f->alt ? ", " : "", f->alt ? f->alt : "",
                     f->meta ? " " : "", f->meta ? f->meta : "");
        } else {
            snprintf(left, sizeof(left), "  -h, --help");
        }
        const char * help = f ? f->help : "this text";
        const int n = (int)strlen(left);
        fprintf(out, "%s%*s", left, n < col ? col - n : 2, "");
        for (const char * p = help; *p; p++) {
            fputc(*p, out);
            if (*p == '\n') fprintf(out, "%*s", col, "");
        }
        fputc('\n', out);
    }
    if (cli->epilog) fprintf(out, "\n%s\n", cli->epilog);
}

// --list-flags: "NAME ALT KIND LO HI OPEN" a line ("-" for none); the bounds of kinds without
// a range are "-" too
static inline void kvr_cli_list(const struct kvr_cli * cli, FILE * out) {
    for (int i = 0; i < cli->n_flags; i++) {
        const struct kvr_cli_flag * f = &cli->flags[i];
        if (f->kind == KVR_CLI_SECTION) continue;
        const bool ranged = f->kind == KVR_CLI_INT || f->kind == KVR_CLI_REAL || f->kind == KVR_CLI_FLOAT ||
                            f->kind == KVR_CLI_INTS || f->kind == KVR_CLI_REALS || (f->kind == KVR_CLI_CUSTOM && f->numeric);
        if (ranged) {
            fprintf(out, "%s %s %s %.17g %.17g %d\n", f->name, f->alt ? f->alt : "-", kvr_cli_kind_name(f), f->lo, f->hi, f->open);
        } else {
            fprintf(out, "%s %s %s - - 0\n", f->name, f->alt ? f->alt : "-", kvr_cli_kind_name(f));
        }
    }
}

//
// values
//

// A decimal integer in [lo, hi]: no sign games, no spaces, no fractions, no trailing junk.
static inline int kvr_cli_parse_int(const char * s, bool k_suffix, double lo, double hi, long long * out, char * why, size_t cap) {
    if (!*s) { snprintf(why, cap, "an empty value; want an integer from %.0f to %.0f", lo, hi); return -1; }
    char * end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    const bool overflow = errno == ERANGE;
    if (end == s || s[0] == ' ' || s[0] == '\t' || s[0] == '\n') {
        snprintf(why, cap, "not an integer; want one from %.0f to %.0f", lo, hi);
        return -1;
    }
    bool big = overflow;
    if (k_suffix && (*end == 'k' || *end == 'K')) {
        if (v > LLONG_MAX / 1024 || v < LLONG_MIN / 1024) big = true; else v *= 1024;
        end++;
    }
    if (*end) { snprintf(why, cap, "not an integer; want one from %.0f to %.0f", lo, hi); return -1; }
    if (big || (double)v < lo || (double)v > hi) { snprintf(why, cap, "out of range; want an integer from %.0f to %.0f", lo, hi); return -1; }
    *out = v;
    return 0;
}

static inline bool kvr_cli_in_range(const struct kvr_cli_flag * f, double v) {
    const bool lo_ok = f->open & KVR_CLI_LO_OPEN ? v > f->lo : v >= f->lo;
    const bool hi_ok = f->open & KVR_CLI_HI_OPEN ? v < f->hi : v <= f->hi;
    return lo_ok && hi_ok;
}

// A finite real in the flag's range; "nan", "inf", "1e999" and "0x" junk are refused.
static inline int kvr_cli_parse_real(const struct kvr_cli_flag * f, const char * s, double * out, char * why, size_t cap) {
    char range[128];
    kvr_cli_range(f, range, sizeof(range));
    if (!*s) { snprintf(why, cap, "an empty value; want a number %s", range); return -1; }
    char * end;
    errno = 0;
    const double v = strtod(s, &end);
    if (end == s || *end || s[0] == ' ' || s[0] == '\t' || s[0] == '\n') {
        snprintf(why, cap, "not a number; want one %s", range);
        return -1;
    }
    if (isnan(v) || isinf(v) || (errno == ERANGE && fabs(v) > 1.0)) {
        snprintf(why, cap, "not a finite number; want one %s", range);
        return -1;
    }
    if (!kvr_cli_in_range(f, v)) { snprintf(why, cap, "out of range; want a number %s", range); return -1; }
    *out = v;
    return 0;
}

// An input file: exists, is a regular file (stat only: a FIFO is never opened here), can be read.
// The library's opens (kvr_file_read) refuse the same without blocking, should it change since.
static inline int kvr_cli_check_in(const char * path, char * why, size_t cap) {
    struct stat st;
    if (!*path) { snprintf(why, cap, "an empty path"); return -1; }
    if (stat(path, &st) != 0) { snprintf(why, cap, "cannot open: %s", strerror(errno)); return -1; }
    if (!S_ISREG(st.st_mode)) { snprintf(why, cap, "is %s, not a regular file", kvr_file_kind(st.st_mode)); return -1; }
    if (access(path, R_OK) != 0) { snprintf(why, cap, "cannot read: %s", strerror(errno)); return -1; }
    return 0;
}

// An input that may not exist yet (--kv-load's FILE with FILE.R beside it): if it is there, as
// kvr_cli_check_in.
static inline int kvr_cli_check_in_if_there(const char * path, char * why, size_t cap) {
    struct stat st;
    if (*path && stat(path, &st) != 0 && errno == ENOENT) return 0;
    return kvr_cli_check_in(path, why, cap);
}

// An output file: a regular file that can be written, or nothing yet, in a directory where new
// files can be made (every output is written beside its path, then renamed onto it:
// kvr_file_create). A symbolic link is refused whatever it points to. Nothing is created or
// truncated: a run that fails before its end leaves an earlier file of that name as it was.
static inline int kvr_cli_check_out(const char * path, char * why, size_t cap) {
    struct stat st;
    if (!*path) { snprintf(why, cap, "an empty path"); return -1; }
    if (lstat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode)) {
            snprintf(why, cap, "is %s, not a regular file: outputs are written beside their path, then renamed onto it",
                     kvr_file_kind(st.st_mode));
            return -1;
        }
        if (access(path, W_OK) != 0) { snprintf(why, cap, "cannot write: %s", strerror(errno)); return -1; }
    } else if (errno != ENOENT) {
        snprintf(why, cap, "cannot write: %s", strerror(errno));
        return -1;
    }
    const char * slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof(dir), ".");
    else if (slash == path) snprintf(dir, sizeof(dir), "/");
    else snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) { snprintf(why, cap, "cannot write: no directory %.200s", dir); return -1; }
    if (access(dir, W_OK | X_OK) != 0) { snprintf(why, cap, "cannot write in %.200s: %s", dir, strerror(errno)); return -1; }
    return 0;
}

// A directory to write in: it exists and can be written, or its parent can be (it is made later).
// Not a symbolic link: what is written goes into the directory named, not where a link points.
static inline int kvr_cli_check_dir(const char * path, char * why, size_t cap) {
    struct stat st;
    if (!*path) { snprintf(why, cap, "an empty path"); return -1; }
    if (lstat(path, &st) == 0) {
        if (S_ISLNK(st.st_mode)) { snprintf(why, cap, "is a symbolic link, not a directory"); return -1; }
        if (!S_ISDIR(st.st_mode)) { snprintf(why, cap, "is not a directory"); return -1; }
        if (access(path, W_OK | X_OK) != 0) { snprintf(why, cap, "cannot write in it: %s", strerror(errno)); return -1; }
        return 0;
    }
    if (errno != ENOENT) { snprintf(why, cap, "cannot use it: %s", strerror(errno)); return -1; }
    return kvr_cli_check_out(path, why, cap); // a new directory: its parent must take it
}

// One value into its flag's destination, or -1 with why filled in.
static inline int kvr_cli_value(const struct kvr_cli_flag * f, const char * v, char * why, size_t cap) {
    switch (f->kind) {
        case KVR_CLI_INT: {
            long long x;
            if (kvr_cli_parse_int(v, f->k_suffix, f->lo, f->hi, &x, why, cap)) return -1;
            *(int *)f->dst = (int)x;
            return 0;
        }
        case KVR_CLI_U64: {
            char * end;
            errno = 0;
            const unsigned long long x = strtoull(v, &end, 10);
            if (!*v || end == v || *end || v[0] < '0' || v[0] > '9') { snprintf(why, cap, "not an integer from 0 to 2^64-1"); return -1; }
            if (errno == ERANGE) { snprintf(why, cap, "out of range; want an integer from 0 to 2^64-1"); return -1; }
            *(uint64_t *)f->dst = (uint64_t)x;
            return 0;
        }
        case KVR_CLI_REAL:
        case KVR_CLI_FLOAT: {
            double x;
            if (kvr_cli_parse_real(f, v, &x, why, cap)) return -1;
            if (f->kind == KVR_CLI_REAL) *(double *)f->dst = x; else *(float *)f->dst = (float)x;
            return 0;
        }
        case KVR_CLI_TEXT:
            if (!*v && !f->empty_ok) { snprintf(why, cap, "an empty value"); return -1; }
            *(const char **)f->dst = v;
            return 0;
        case KVR_CLI_IN:
            if (kvr_cli_check_in(v, why, cap)) return -1;
            *(const char **)f->dst = v;
            return 0;
        case KVR_CLI_OUT:
            if (kvr_cli_check_out(v, why, cap)) return -1;
            *(const char **)f->dst = v;
            return 0;
        case KVR_CLI_DIR:
            if (kvr_cli_check_dir(v, why, cap)) return -1;
            *(const char **)f->dst = v;
            return 0;
        case KVR_CLI_CHOICE: {
            int k = 0;
            for (const char * c = f->choices; ; k++) {
                const char * bar = strchr(c, '|');
                const size_t n = bar ? (size_t)(bar - c) : strlen(c);
                if (strlen(v) == n && strncmp(v, c, n) == 0) { *(int *)f->dst = k; return 0; }
                if (!bar) break;
                c = bar + 1;
            }
            snprintf(why, cap, "not one of %s", f->choices);
            return -1;
        }
        case KVR_CLI_INTS:
        case KVR_CLI_REALS: {
            const int max_n = f->max_n > 0 && f->max_n < KVR_CLI_MAX_LIST ? f->max_n : KVR_CLI_MAX_LIST;
            int n = 0;
            const char * p = v;
            for (;;) {
                const char * comma = strchr(p, ',');
                const size_t len = comma ? (size_t)(comma - p) : strlen(p);
                char item[64];
                if (len >= sizeof(item)) { snprintf(why, cap, "entry %d is too long", n + 1); return -1; }
                memcpy(item, p, len);
                item[len] = 0;
                if (n == max_n) { snprintf(why, cap, "more than %d entries", max_n); return -1; }
                char sub[200];
                if (f->kind == KVR_CLI_INTS) {
                    long long x;
                    if (kvr_cli_parse_int(item, f->k_suffix, f->lo, f->hi, &x, sub, sizeof(sub))) { snprintf(why, cap, "entry %d '%s': %.150s", n + 1, item, sub); return -1; }
                    ((struct kvr_cli_ints *)f->dst)->v[n++] = (int)x;
                } else {
                    double x;
                    if (kvr_cli_parse_real(f, item, &x, sub, sizeof(sub))) { snprintf(why, cap, "entry %d '%s': %.150s", n + 1, item, sub); return -1; }
                    ((struct kvr_cli_reals *)f->dst)->v[n++] = x;
                }
                if (!comma) break;
                p = comma + 1;
            }
            if (f->kind == KVR_CLI_INTS) ((struct kvr_cli_ints *)f->dst)->n = n; else ((struct kvr_cli_reals *)f->dst)->n = n;
            return 0;
        }
        case KVR_CLI_CUSTOM:
            why[0] = 0;
            if (f->parse(v, f->dst, why, cap) != 0) {
                if (!why[0]) snprintf(why, cap, "not a valid value");
                return -1;
            }
            return 0;
        case KVR_CLI_SECTION:
        case KVR_CLI_SWITCH:
            break;
    }
    KVR_ASSERT(!"a flag kind without a value");
    return -1;
}

static inline const struct kvr_cli_flag * kvr_cli_find(const struct kvr_cli * cli, const char * arg) {
    for (int i = 0; i < cli->n_flags; i++) {
        const struct kvr_cli_flag * f = &cli->flags[i];
        if (f->kind == KVR_CLI_SECTION) continue;
        if (!strcmp(arg, f->name) || (f->alt && !strcmp(arg, f->alt))) return f;
    }
    return NULL;
}

// No output may be an input: writing it would destroy what the run reads (the model, the prompt),
// whatever name, hard link or path reaches it (compared by st_dev and st_ino).
static inline int kvr_cli_check_overlap(const struct kvr_cli * cli) {
    for (int i = 0; i < cli->n_flags; i++) {
        const struct kvr_cli_flag * o = &cli->flags[i];
        const char * out = o->kind == KVR_CLI_OUT ? *(const char * const *)o->dst : NULL;
        struct stat so, si;
        if (!out || stat(out, &so) != 0) continue;
        for (int j = 0; j < cli->n_flags; j++) {
            const struct kvr_cli_flag * in = &cli->flags[j];
            const char * inp = in->kind == KVR_CLI_IN ? *(const char * const *)in->dst : NULL;
            if (inp && stat(inp, &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino) {
                return kvr_cli_fail(cli, "%s '%.200s': is the same file as %s '%.200s': it would be written over", o->name, out,
                                    in->name, inp);
            }
        }
    }
    return 0;
}

// Every flag of argv into its destination. Returns 0 to go on, 2 after a message on a bad
// command line, -1 after -h or --list-flags (the caller exits with 0). A flag given twice takes
// the last value, as llama.cpp's do, unless it is marked once.
static inline int kvr_cli_parse(const struct kvr_cli * cli, int argc, char ** argv) {
    int seen_at[256] = { 0 }; // the argv index where each flag came (0: not yet)
    KVR_ASSERT(cli->n_flags <= 256);
    for (int i = 0; i < cli->n_flags; i++) { // a table without ranges is our bug, not the user's
        const struct kvr_cli_flag * f = &cli->flags[i];
        const bool ranged = f->kind == KVR_CLI_INT || f->kind == KVR_CLI_REAL || f->kind == KVR_CLI_FLOAT ||
                            f->kind == KVR_CLI_INTS || f->kind == KVR_CLI_REALS;
        KVR_ASSERT(f->kind == KVR_CLI_SECTION || (f->name && f->help && (f->kind == KVR_CLI_SWITCH || f->dst)));
        KVR_ASSERT(!ranged || (f->lo < f->hi && !isnan(f->lo) && !isnan(f->hi)));
        KVR_ASSERT(f->kind != KVR_CLI_CHOICE || f->choices);
        KVR_ASSERT(f->kind != KVR_CLI_CUSTOM || f->parse);
    }
    for (int i = 1; i < argc; i++) {
        const char * arg = argv[i];
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) { kvr_cli_usage(cli, stdout); return -1; }
        if (!strcmp(arg, "--list-flags")) { kvr_cli_list(cli, stdout); return -1; }
        const struct kvr_cli_flag * f = kvr_cli_find(cli, arg);
        if (!f) {
            if (arg[0] == '-' && arg[1]) return kvr_cli_fail(cli, "unknown flag '%.200s'", arg);
            return kvr_cli_fail(cli, "unexpected argument '%.200s' (every value follows its flag)", arg);
        }
        if (f->given) *f->given = true;
        const int k = (int)(f - cli->flags);
        if (f->once && seen_at[k]) {
            return kvr_cli_fail(cli, "%s is given twice (first %s '%.100s'): give it once", arg, argv[seen_at[k]],
                                seen_at[k] + 1 < argc ? argv[seen_at[k] + 1] : "");
        }
        seen_at[k] = i;
        if (f->kind == KVR_CLI_SWITCH) {
            *(bool *)f->dst = true;
            continue;
        }
        if (i + 1 >= argc) return kvr_cli_fail(cli, "%s needs a value (%s)", arg, f->meta ? f->meta : "a value");
        const char * v = argv[++i];
        char why[512];
        if (kvr_cli_value(f, v, why, sizeof(why)) != 0) return kvr_cli_fail(cli, "%s '%.200s': %s", arg, v, why);
    }
    return kvr_cli_check_overlap(cli);
}

// A tool started with stdin, stdout or stderr closed would hand that number to the next file it
// opens, and text meant for stdout would land in a cache being written. Each closed one is held by
// /dev/null opened read-only: a write to it still fails (EBADF), and the tool reports that.
static inline void kvr_cli_hold_std_fds(void) {
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
        const int got = open("/dev/null", O_RDONLY); // the lowest free number: fd itself
        if (got >= 0 && got != fd) close(got);
    }
}

//
// backends
//

// --backend NAME (KVR_CLI_CUSTOM, dst const char **): a name in kvr's registry that this build
// has. Another name is refused with the registered ones; a registered one this build lacks, with
// the build that has it (kvr_backend_new's words), before the tool loads anything.
static inline int kvr_cli_backend(const char * value, void * dst, char * why, size_t cap) {
    const struct kvr_backend_info * b = kvr_backend_find(value);
    if (!b) {
        char names[256];
        snprintf(why, cap, "not a backend kvr knows; want one of %s", kvr_backend_names(names, sizeof(names), "|"));
        return -1;
    }
    if (!b->make) {
        snprintf(why, cap, "kvr was built without %s (build with %s)", b->needs ? b->needs : "it",
                 b->build ? b->build : "its build flag");
        return -1;
    }
    *(const char **)dst = value;
    return 0;
}

// The -h text of --backend: first (what the flag is for), then a line per registered backend, its
// name and what it is, and for one this build lacks, the build that has it.
static inline const char * kvr_cli_backend_help(char * buf, size_t cap, const char * first) {
    size_t n = (size_t)snprintf(buf, cap, "%s", first);
    for (int i = 0; i < kvr_backend_count() && n < cap; i++) {
        const struct kvr_backend_info * b = kvr_backend_registered(i);
        const int w = snprintf(buf + n, cap - n, "\n  %s: %s%s%s%s", b->name, b->about, b->make ? "" : " (not in this build: ",
                               b->make ? "" : b->build ? b->build : "its build flag", b->make ? "" : ")");
        if (w < 0) break;
        n += (size_t)w;
    }
    return buf;
}

// The KV cache's types (kvr_cache_type): --cache-type T for K and V, -ctk/-ctv (llama.cpp's
// spellings) for one of them; the choices are in kvr_cache_type's order, F16 first (the default).
struct kvr_cli_cache {
    int  all, k, v;
    bool k_set, v_set;
};

#define KVR_CLI_CACHE_CHOICES "f16|f32|bf16|q8_0"
#define KVR_CLI_CACHE_FLAGS(c)                                                                                          \
    { .name = "--cache-type", .kind = KVR_CLI_CHOICE, .dst = &(c)->all, .meta = KVR_CLI_CACHE_CHOICES,                  \
      .choices = KVR_CLI_CACHE_CHOICES,                                                                                 \
      .help = "the KV cache's type, K and V (default f16, as llama.cpp): in memory, on every\n"                         \
              "transfer between ranks, in replicas; q8_0 needs a head size that is a multiple of 32" },                  \
    { .name = "-ctk", .alt = "--cache-type-k", .kind = KVR_CLI_CHOICE, .dst = &(c)->k, .meta = KVR_CLI_CACHE_CHOICES,  \
      .choices = KVR_CLI_CACHE_CHOICES, .given = &(c)->k_set, .help = "K's type alone (default: --cache-type's)" },     \
    { .name = "-ctv", .alt = "--cache-type-v", .kind = KVR_CLI_CHOICE, .dst = &(c)->v, .meta = KVR_CLI_CACHE_CHOICES,  \
      .choices = KVR_CLI_CACHE_CHOICES, .given = &(c)->v_set, .help = "V's type alone (default: --cache-type's)" }

static inline enum kvr_cache_type kvr_cli_cache_k(const struct kvr_cli_cache * c) {
    return (enum kvr_cache_type)(c->k_set ? c->k : c->all);
}

static inline enum kvr_cache_type kvr_cli_cache_v(const struct kvr_cli_cache * c) {
    return (enum kvr_cache_type)(c->v_set ? c->v : c->all);
}

//
// the arithmetic of quantized matmuls
//

// kvr-run and kvr-bench multiply quantized weights as llama.cpp's CPU backend does unless told
// --exact: 8-bit activations and integer products (kvr_backend_params.q8_activations). Per thread
// the exact path runs every quantized type's decode rows at about half the speed (kvr-bench
// --kernels) and loses to llama.cpp on the files people download; exact stays what the C API gives
// by default and what kvr-compare and the reference tests check. kvr-server takes the same default
// and --exact (its own parser): a decode batch's tokens go through the one-token kernels, so a
// request's tokens do not depend on the requests decoded beside it. --q8-act names the default.
struct kvr_cli_arith {
    bool q8, exact;
};

#define KVR_CLI_ARITH_FLAGS(c)                                                                                          \
    { .name = "--exact", .kind = KVR_CLI_SWITCH, .dst = &(c)->exact,                                                     \
      .help = "quantized weights in exact arithmetic: f32 activations times the weights' exact\n"                        \
              "values (the CPU reference; about half the speed of the default)" },                                       \
    { .name = "--q8-act", .kind = KVR_CLI_SWITCH, .dst = &(c)->q8,                                                       \
      .help = "the default: every quantized weight type (Q4_0 ... Q8_0, Q2_K ... Q6_K), prefill\n"                      \
              "and decode, 8-bit activations and integer products, as llama.cpp does (logits\n"                           \
              "move from the exact math: ~0.1 on tiny Llamas, ~1 on Gemma 3 270M). CPU only;\n"                           \
              "the CUDA backend stays exact" }

// 0, or 2 after a message when both were given.
static inline int kvr_cli_arith_check(const struct kvr_cli * cli, const struct kvr_cli_arith * c) {
    if (c->q8 && c->exact) return kvr_cli_fail(cli, "--q8-act and --exact exclude each other: give one");
    return 0;
}

static inline bool kvr_cli_q8(const struct kvr_cli_arith * c) {
    return !c->exact;
}

//
// prompt text
//

// Where s[0..n) stops being UTF-8 text: the offset of the first NUL byte or invalid sequence
// (overlong forms, surrogates and code points above U+10FFFF count as invalid), or n.
static inline size_t kvr_cli_text_error(const char * s, size_t n, bool * nul) {
    const unsigned char * u = (const unsigned char *)s;
    size_t i = 0;
    *nul = false;
    while (i < n) {
        const unsigned c = u[i];
        if (c == 0) { *nul = true; return i; }
        if (c < 0x80) { i++; continue; }
        int len;
        unsigned cp, min;
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; min = 0x80; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; min = 0x800; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return i;
        if (i + (size_t)len > n) return i;
        for (int k = 1; k < len; k++) {
            if ((u[i + k] & 0xc0) != 0x80) return i;
            cp = (cp << 6) | (u[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
        i += (size_t)len;
    }
    return n;
}

// Prompt text is UTF-8 without NUL bytes: a NUL would end the text early without a word, and
// the tokenizers' byte fallback would turn invalid bytes into tokens no model was trained on.
// Returns 0, or 2 after a message naming where (what: the file's name, or "-p").
static inline int kvr_cli_check_text(const char * prog, const char * what, const char * s, size_t n) {
    bool nul;
    const size_t at = kvr_cli_text_error(s, n, &nul);
    if (at == n) return 0;
    int line = 1;
    for (size_t i = 0; i < at; i++) line += s[i] == '\n';
    fprintf(stderr, "%s: %s: %s at byte %zu (line %d): prompts must be UTF-8 text\n", prog, what,
            nul ? "a NUL byte" : "invalid UTF-8", at, line);
    return 2;
}

// -p TEXT, checked as a prompt file is, after its escapes (escapes: kvr_unescape's), so that
// "a\xff" or "a\x00b" is refused as the same bytes in a file are. Returns 0, or 2 after a message.
static inline int kvr_cli_check_prompt(const char * prog, const char * s, bool escapes) {
    if (!escapes) return kvr_cli_check_text(prog, "-p", s, strlen(s));
    const size_t len = strlen(s);
    char * copy = malloc(len + 1);
    if (copy) memcpy(copy, s, len + 1);
    if (!copy) {
        fprintf(stderr, "%s: -p: out of memory\n", prog);
        return 2;
    }
    const size_t n = kvr_unescape(copy);
    const int rc = kvr_cli_check_text(prog, n == len ? "-p" : "-p (its escapes applied)", copy, n);
    free(copy);
    return rc;
}

// The whole of a prompt file, zero-terminated, checked by kvr_cli_check_text. A file of more
// than max bytes (0: no bound) is refused having read at most max + 1 of them, so /dev/zero or a
// huge sparse file costs nothing; only a regular file is read (kvr_file_read: no FIFO waited on).
// Returns 0 with *out (free it), or 2 after a message.
static inline int kvr_cli_read_text(const char * prog, const char * path, size_t max, char ** out, size_t * len) {
    *out = NULL;
    FILE * f = kvr_file_read(path);
    if (!f) {
        fprintf(stderr, "%s: %s\n", prog, kvr_last_error());
        return 2;
    }
    struct stat st;
    if (max && fstat(fileno(f), &st) == 0 && (uint64_t)st.st_size > (uint64_t)max) {
        fprintf(stderr, "%s: %s: %lld bytes, more than the %zu a prompt of this context can take\n", prog, path,
                (long long)st.st_size, max);
        fclose(f);
        return 2;
    }
    size_t cap = 1 << 16, n = 0;
    char * buf = malloc(cap);
    while (buf && (!max || n <= max)) {
        if (n + 1 >= cap) {
            char * p = realloc(buf, cap * 2);
            if (!p) { free(buf); buf = NULL; break; }
            buf = p;
            cap *= 2;
        }
        size_t want = cap - n - 1;
        if (max && want > max + 1 - n) want = max + 1 - n; // one byte past the bound tells
        const size_t got = fread(buf + n, 1, want, f);
        if (got == 0) break;
        n += got;
    }
    const bool err = ferror(f) != 0;
    fclose(f);
    if (buf && max && n > max) {
        fprintf(stderr, "%s: %s: more than the %zu bytes a prompt of this context can take\n", prog, path, max);
        free(buf);
        return 2;
    }
    if (!buf || err) {
        fprintf(stderr, "%s: %s: %s\n", prog, path, buf ? "cannot read" : "out of memory");
        free(buf);
        return 2;
    }
    buf[n] = 0;
    if (kvr_cli_check_text(prog, path, buf, n) != 0) {
        free(buf);
        return 2;
    }
    *out = buf;
    if (len) *len = n;
    return 0;
}

#endif // KVR_CLI_H
