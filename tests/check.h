// tests/check.h - what the C test programs of the KV-cache, resume and failover areas share: the
// pass/fail/skip counters, the name of the case being checked, and CHECK(cond, fmt, ...), which
// counts a check and, when it fails, prints the file, the line, the case and the message. Each
// program includes it once (everything is static to that program); its summary line is its own.

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

static int  n_pass, n_fail, n_skip;
static bool verbose;          // -v: each case's name as it starts
static char g_case[256];

#define CHECK(cond, ...) do {                                              \
    if (cond) { n_pass++; } else {                                         \
        n_fail++;                                                          \
        fprintf(stderr, "FAIL %s:%d: [%s] ", __FILE__, __LINE__, g_case);  \
        fprintf(stderr, __VA_ARGS__);                                      \
        fprintf(stderr, "\n");                                             \
    }                                                                      \
} while (0)

static void set_case(const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static void set_case(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_case, sizeof(g_case), fmt, ap);
    va_end(ap);
    if (verbose) printf("case %s\n", g_case);
}
