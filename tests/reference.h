// tests/reference.h - the readers of the files llama.cpp's outputs were saved in
// (SHARED/reference, see its README; also the tokenizer test vectors beside the vocabularies):
// NAME.tokens and NAME.greedy hold token ids, NAME.logits one float a line, NAME.prompt and the
// test vectors text. test-models and test-tokenizer include it; everything here is static to
// the program that includes it.

#ifndef KVR_TESTS_REFERENCE_H
#define KVR_TESTS_REFERENCE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// Whether the file can be opened for reading (a missing reference is a skip, not a failure).
static inline bool file_exists(const char * path) {
    FILE * f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

// The whole file, zero-terminated (the caller frees it), or NULL; *n its size (0 for NULL) when n
// is not NULL.
static inline char * read_file(const char * path, size_t * n) {
    if (n) *n = 0;
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char * buf = malloc(cap);
    for (;;) {
        if (buf && len + 1 >= cap) {
            cap *= 2;
            char * grown = realloc(buf, cap);
            if (!grown) free(buf);
            buf = grown;
        }
        if (!buf) break;
        const size_t got = fread(buf + len, 1, cap - len - 1, f);
        if (got == 0) break;
        len += got;
    }
    fclose(f);
    if (!buf) return NULL;
    buf[len] = '\0';
    if (n) *n = len;
    return buf;
}

// Non-negative integers separated by anything else (commas, spaces, newlines): the count read
// (at most cap), -1 when the file cannot be opened.
static inline int read_ids(const char * path, int32_t * out, int cap) {
    FILE * f = fopen(path, "r");
    if (!f) return -1;
    int n = 0, c;
    long v = 0;
    bool in_num = false;
    while ((c = fgetc(f)) != EOF) {
        if (c >= '0' && c <= '9') {
            v = v * 10 + (c - '0');
            in_num = true;
        } else {
            if (in_num && n < cap) out[n++] = (int32_t) v;
            v = 0;
            in_num = false;
        }
    }
    if (in_num && n < cap) out[n++] = (int32_t) v;
    fclose(f);
    return n;
}

// Floats separated by white space: the count read (at most cap), -1 when the file cannot be opened.
static inline int read_floats(const char * path, float * out, int cap) {
    FILE * f = fopen(path, "r");
    if (!f) return -1;
    int n = 0;
    float x;
    while (n < cap && fscanf(f, "%f", &x) == 1) out[n++] = x;
    fclose(f);
    return n;
}

#endif // KVR_TESTS_REFERENCE_H
