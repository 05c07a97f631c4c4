// kvr-tokenize.c - print the token ids of a text: the tokenizer of a GGUF model or vocab-only file
// (only its tokenizer.* metadata is read), applied to a prompt given on the command line or in a
// file. The ids go to stdout on one line, space-separated, without BOS/EOS unless --bos is given;
// --special turns text like "<s>" into its special token; --pieces prints one "id 'piece'" per line.
//
//   kvr-tokenize -m FILE (-p TEXT | -f FILE) [--bos] [--special] [--pieces]
//
// Exit status: 0 done, 1 the tokenizer failed, 2 bad flags or a file that cannot be read.

#include "kvr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const usage =
    "usage: kvr-tokenize -m FILE (-p TEXT | -f FILE) [--bos] [--special] [--pieces]\n";

static int fail_usage(const char * fmt, const char * arg) {
    fprintf(stderr, "kvr-tokenize: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n%s", usage);
    return 2;
}

// The whole file, zero-terminated, or NULL.
static char * read_text(const char * path) {
    FILE * f = fopen(path, "rb");
    if (f == NULL) {
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char * buf = malloc(cap);
    while (buf != NULL) {
        if (len + 1 >= cap) {
            char * p = realloc(buf, cap * 2);
            if (p == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = p;
            cap *= 2;
        }
        const size_t got = fread(buf + len, 1, cap - len - 1, f);
        if (got == 0) {
            break;
        }
        len += got;
    }
    const bool err = ferror(f) != 0;
    fclose(f);
    if (buf == NULL || err) {
        free(buf);
        return NULL;
    }
    buf[len] = '\0';
    if (strlen(buf) != len) {
        fprintf(stderr, "kvr-tokenize: warning: %s contains a NUL byte; the text ends there\n", path);
    }
    return buf;
}

int main(int argc, char ** argv) {
    const char * model = NULL, * prompt = NULL, * prompt_file = NULL;
    bool bos = false, special = false, pieces = false;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        if ((strcmp(a, "-m") == 0 || strcmp(a, "-p") == 0 || strcmp(a, "-f") == 0) && i + 1 >= argc) {
            return fail_usage("%s needs a value", a);
        }
        if (strcmp(a, "-m") == 0) {
            model = argv[++i];
        } else if (strcmp(a, "-p") == 0) {
            prompt = argv[++i];
        } else if (strcmp(a, "-f") == 0) {
            prompt_file = argv[++i];
        } else if (strcmp(a, "--bos") == 0) {
            bos = true;
        } else if (strcmp(a, "--special") == 0) {
            special = true;
        } else if (strcmp(a, "--pieces") == 0) {
            pieces = true;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage, stdout);
            return 0;
        } else {
            return fail_usage("unknown argument '%s'", a);
        }
    }
    if (model == NULL) {
        return fail_usage("%s", "no model given (-m FILE)");
    }
    if ((prompt == NULL) == (prompt_file == NULL)) {
        return fail_usage("%s", "give the text with exactly one of -p TEXT and -f FILE");
    }

    char * text = NULL;
    if (prompt_file != NULL) {
        text = read_text(prompt_file);
        if (text == NULL) {
            return fail_usage("cannot read the text file '%s'", prompt_file);
        }
    }
    struct kvr_gguf * g = kvr_gguf_open(model);
    if (g == NULL) {
        fprintf(stderr, "kvr-tokenize: %s\n%s", kvr_last_error(), usage);  // the message names the file
        free(text);
        return 2;
    }
    struct kvr_vocab * v = kvr_vocab_load(g);
    if (v == NULL) {
        fprintf(stderr, "kvr-tokenize: %s: %s\n", model, kvr_last_error());
        kvr_gguf_close(g);
        free(text);
        return 1;
    }

    const char * t = text ? text : prompt;
    int rc = 0;
    const int n = kvr_tokenize(v, t, NULL, 0, bos, special);
    int32_t * ids = n > 0 ? malloc((size_t) n * sizeof *ids) : NULL;
    if (n < 0) {
        fprintf(stderr, "kvr-tokenize: %s\n", kvr_last_error());
        rc = 1;
    } else if (n > 0 && (ids == NULL || kvr_tokenize(v, t, ids, n, bos, special) != n)) {
        fprintf(stderr, "kvr-tokenize: %s\n", ids ? kvr_last_error() : "out of memory");
        rc = 1;
    } else if (pieces) {
        for (int i = 0; i < n; i++) {
            char small[256];
            char * buf = small;
            int k = kvr_token_to_piece(v, ids[i], buf, (int) sizeof small, true);
            if (k < 0 && (buf = malloc((size_t) -k)) != NULL) {
                k = kvr_token_to_piece(v, ids[i], buf, -k, true);
            }
            printf("%d '%.*s'\n", ids[i], k > 0 && buf ? k : 0, buf ? buf : "");
            if (buf != small) {
                free(buf);
            }
        }
    } else {
        for (int i = 0; i < n; i++) {
            printf(i ? " %d" : "%d", ids[i]);
        }
        printf("\n");
    }
    free(ids);
    kvr_vocab_free(v);
    kvr_gguf_close(g);
    free(text);
    return rc;
}
