// tests/check.h - the harness of every C test program (and of tests/test-cuda-host.cu, which nvcc
// compiles as C++): the pass/fail/skip counters, the name of the case being checked, CHECK, skip()
// and the summary line. A program includes it once; everything here is static to that program.
//
// A failed check prints one line, the same in every program:
//
//     FAIL file:line: [case] message          ("[case] " only while a case is set)
//
// on stderr, after flushing stdout, so that it lands where it happened in a log holding both. The
// last line a program prints is check_summary's "NAME: N passed, M failed[, K skipped]", the line
// tests/run-tests.sh adds up (a skip is a check that could not run: it never counts as passed).
// A program that counts cases rather than checks (test-ops, test-gguf) keeps n_pass and n_fail
// as case counts and still prints through check_summary.

#ifndef KVR_TESTS_CHECK_H
#define KVR_TESTS_CHECK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#if defined(__GNUC__)
#define HARNESS_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define HARNESS_UNUSED       __attribute__((unused)) // not every program uses every piece
#else
#define HARNESS_PRINTF(f, a)
#define HARNESS_UNUSED
#endif

HARNESS_UNUSED static int  n_pass, n_fail, n_skip;
HARNESS_UNUSED static bool verbose;      // -v: each case's name as set_case starts it
HARNESS_UNUSED static bool print_passes; // every passing check too, as "ok   file:line: ..." on stdout
HARNESS_UNUSED static char g_case[256];  // the case being checked ("": none)

static inline void check_report(bool ok, const char * file, int line, const char * fmt, ...) HARNESS_PRINTF(4, 5);
static inline void check_report(bool ok, const char * file, int line, const char * fmt, ...) {
    FILE * out = ok ? stdout : stderr;
    fflush(stdout);
    fprintf(out, "%s %s:%d: ", ok ? "ok  " : "FAIL", file, line);
    if (g_case[0]) fprintf(out, "[%s] ", g_case);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fprintf(out, "\n");
}

// CHECK(cond, fmt, ...): counts one check; the message (printf-style) is formatted only when it is
// printed, so its arguments may be costly or valid only on failure.
#define CHECK(cond, ...) do {                                                          \
    if (cond) {                                                                        \
        n_pass++;                                                                      \
        if (print_passes) check_report(true, __FILE__, __LINE__, __VA_ARGS__);         \
    } else {                                                                           \
        n_fail++;                                                                      \
        check_report(false, __FILE__, __LINE__, __VA_ARGS__);                          \
    }                                                                                  \
} while (0)

// The case the next checks belong to (printed as it starts under -v); its name is in their failures.
static inline void set_case(const char * fmt, ...) HARNESS_PRINTF(1, 2);
static inline void set_case(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_case, sizeof(g_case), fmt, ap);
    va_end(ap);
    if (verbose) printf("case %s\n", g_case);
}

// Something that could not be checked here (a missing file, a build that leaves it out): counted,
// and said on a line of its own, "SKIP what: why".
static inline void skip(const char * fmt, ...) HARNESS_PRINTF(1, 2);
static inline void skip(const char * fmt, ...) {
    n_skip++;
    va_list ap;
    va_start(ap, fmt);
    printf("SKIP ");
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

// The summary line; returns the exit status: 1 when a check failed, else 0.
static inline int check_summary(const char * name) {
    printf("%s: %d passed, %d failed", name, n_pass, n_fail);
    if (n_skip) printf(", %d skipped", n_skip);
    printf("\n");
    fflush(stdout);
    return n_fail ? 1 : 0;
}

#endif // KVR_TESTS_CHECK_H
