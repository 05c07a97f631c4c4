// tools/simple.c - the smallest embedding of kvr: load a model, tokenize a prompt, prefill it
// and print 16 greedy tokens. It uses kvr.h alone and builds from kvr.c (the model, its graph and
// the CPU) and kvr-comm.c (the session: one rank here) alone:
//
//   cc -O2 -I. tools/simple.c kvr.c kvr-comm.c -lopenblas -lm -lpthread -o simple
//   ./simple model.gguf "Once upon a time"

#include "kvr.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT\n", argv[0]);
        return 2;
    }
    struct kvr_model * model = kvr_model_load(argv[1], NULL);
    if (!model) {
        fprintf(stderr, "simple: %s\n", kvr_last_error());
        return 1;
    }
    const struct kvr_vocab * vocab = kvr_model_vocab(model);

    int32_t ids[512];
    const int n = kvr_tokenize(vocab, argv[2], ids, 512, kvr_vocab_add_bos(vocab), false);
    if (n <= 0 || n > 512 - 16) {
        fprintf(stderr, "simple: the prompt must have 1 to %d tokens\n", 512 - 16);
        kvr_model_free(model);
        return 1;
    }

    struct kvr_session * sess = kvr_session_new(model, &(struct kvr_session_params) { .n_ctx = 512 });
    const float * logits = sess ? kvr_session_eval(sess, ids, n) : NULL; // the prefill
    printf("%s", argv[2]);
    for (int i = 0; i < 16 && logits; i++) {
        int32_t id = kvr_argmax(logits, kvr_vocab_n_tokens(vocab));   // greedy
        if (kvr_vocab_is_eog(vocab, id)) break;
        char piece[128];
        int len = kvr_token_to_piece(vocab, id, piece, sizeof(piece), false);
        if (len > 0) printf("%.*s", len, piece);
        logits = kvr_session_eval(sess, &id, 1);                      // one decode step
    }
    printf("\n");
    if (!logits) fprintf(stderr, "simple: %s\n", kvr_last_error());
    kvr_session_free(sess);
    kvr_model_free(model);
    return logits ? 0 : 1;
}
