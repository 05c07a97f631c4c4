// kvr-tokenize.c - print the token ids of a text: the tokenizer of a GGUF model or vocab-only file
// (only its tokenizer.* metadata is read), applied to a prompt given on the command line or in a
// file. The ids go to stdout on one line, space-separated, without BOS/EOS unless --bos is given;
// text like "<s>" or "<|im_start|>" becomes its special token unless --no-special is given (as in
// llama.cpp's tools and kvr-run); -p's escapes (\n, \t, ...) become characters unless --no-escape
// is given (a file is read exactly); --pieces prints one "id 'piece'" per line.
//
//   kvr-tokenize -m FILE (-p TEXT | -f FILE) [--bos] [--no-special] [--no-escape] [--pieces]
//
// Exit status: 0 done, 1 out of memory, 2 bad flags, a file that cannot be read, a vocabulary that
// cannot be loaded or used as asked (--bos without a BOS), or text that is not UTF-8 (a NUL byte
// or an invalid sequence, in a file or in -p after its escapes; see tools/kvr-cli.h), as kvr-run.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "kvr-cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    const char * model = NULL, * prompt = NULL, * prompt_file = NULL;
    bool bos = false, special = false, no_special = false, no_escape = false, pieces = false;
    const struct kvr_cli_flag flags[] = {
        { .name = "-m", .kind = KVR_CLI_IN, .dst = &model, .meta = "FILE", .once = true, .help = "a GGUF model or vocab-only file" },
        { .name = "-p", .kind = KVR_CLI_TEXT, .dst = &prompt, .meta = "TEXT", .empty_ok = true, .once = true, .help = "the text" },
        { .name = "-f", .kind = KVR_CLI_IN, .dst = &prompt_file, .meta = "FILE", .once = true,
          .help = "read the text from a file (UTF-8; a NUL byte or invalid UTF-8 is an error, as in kvr-run)" },
        { .name = "--bos", .kind = KVR_CLI_SWITCH, .dst = &bos, .help = "add BOS (and EOS) as the model's tokenizer says" },
        { .name = "--no-special", .kind = KVR_CLI_SWITCH, .dst = &no_special,
          .help = "special tokens written in the text (\"<s>\", \"<|im_start|>\") stay plain text" },
        { .name = "--special", .kind = KVR_CLI_SWITCH, .dst = &special, .help = "parse them (the default; kept for old scripts)" },
        { .name = "--no-escape", .kind = KVR_CLI_SWITCH, .dst = &no_escape,
          .help = "-p TEXT as it is (default: \\n \\r \\t \\' \\\" \\\\ \\xHH become the characters)" },
        { .name = "--pieces", .kind = KVR_CLI_SWITCH, .dst = &pieces, .help = "one \"id 'piece'\" per line" },
    };
    const struct kvr_cli cli = { "kvr-tokenize", "usage: kvr-tokenize -m FILE (-p TEXT | -f FILE) [--bos] [--no-special] [--no-escape] [--pieces]",
                                 NULL, flags, (int)(sizeof(flags) / sizeof(flags[0])), NULL };
    int rc = kvr_cli_parse(&cli, argc, argv);
    if (rc) {
        return rc < 0 ? 0 : rc;
    }
    if (model == NULL) {
        return kvr_cli_fail(&cli, "no model given (-m FILE)");
    }
    if ((prompt == NULL) == (prompt_file == NULL)) {
        return kvr_cli_fail(&cli, "give the text with exactly one of -p TEXT and -f FILE");
    }
    if (special && no_special) {
        return kvr_cli_fail(&cli, "--special and --no-special contradict each other");
    }
    special = !no_special;
    if (prompt != NULL && kvr_cli_check_prompt("kvr-tokenize", prompt, !no_escape) != 0) {
        return 2;
    }

    char * text = NULL;
    if (prompt_file != NULL && kvr_cli_read_text("kvr-tokenize", prompt_file, 0, &text, NULL) != 0) {
        return 2;
    }
    if (prompt != NULL && !no_escape) {
        text = strdup(prompt);
        if (text == NULL) {
            fprintf(stderr, "kvr-tokenize: out of memory\n");
            return 1;
        }
        kvr_unescape(text);
    }
    struct kvr_gguf * g = kvr_gguf_open(model);
    if (g == NULL) {
        fprintf(stderr, "kvr-tokenize: %s\n", kvr_last_error());  // the message names the file
        free(text);
        return 2;
    }
    struct kvr_vocab * v = kvr_vocab_load(g);
    if (v == NULL) { // a file whose vocabulary is malformed is bad input, as in kvr-run
        fprintf(stderr, "kvr-tokenize: %s: %s\n", model, kvr_last_error());
        kvr_gguf_close(g);
        free(text);
        return 2;
    }

    const char * t = text ? text : prompt;
    rc = 0;
    const int n = kvr_tokenize(v, t, NULL, 0, bos, special);
    int32_t * ids = n > 0 ? malloc((size_t) n * sizeof *ids) : NULL;
    if (n < 0) { // --bos with a vocabulary that has none: the input's fault, not the run's
        fprintf(stderr, "kvr-tokenize: %s: %s\n", model, kvr_last_error());
        rc = n == KVR_ERR_NOMEM ? 1 : 2;
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
