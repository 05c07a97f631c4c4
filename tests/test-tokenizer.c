// test-tokenizer.c - the tokenizers against llama.cpp's test vectors and reference prompts.
//
// For every vocabulary file SHARED/vocab/ggml-vocab-*.gguf that has .inp/.out vectors, each case
// (the text between "__ggml_vocab_test__" separator lines, split the way llama.cpp's
// test-tokenizer-0 splits them) is tokenized without BOS and without parsing special tokens and
// compared with the expected ids; the expected ids must also detokenize back to the text (byte
// fallback SPM and byte-level BPE are lossless on valid UTF-8; SPM's leading space is dropped as
// llama.cpp's detokenizer does). Then the reference prompts of SHARED/reference, the API's edge
// cases (short buffers, special tokens, invalid UTF-8) and metadata errors on in-memory GGUFs (a
// BOS, EOS, end-of-turn or unknown id outside the vocabulary is one; a padding id is ignored).
//
//   test-tokenizer [SHARED]      (default ../shared)
//
// A missing file is reported as SKIP, never as a pass. Ends with "tokenizer: N passed, M failed[, K skipped]"
// and exits 1 on any failure.

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"
#include "tests/reference.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// printf into a path buffer; false (and an empty path) when it does not fit.
static bool path_fmt(char * out, size_t cap, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t) n >= cap) {
        out[0] = '\0';
        return false;
    }
    return true;
}

// Print s with non-printable bytes escaped.
static void print_escaped(const char * s, size_t n) {
    putchar('\'');
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char) s[i];
        if (c == '\n') printf("\\n");
        else if (c == '\t') printf("\\t");
        else if (c == '\r') printf("\\r");
        else if (c == '\\' || c == '\'') printf("\\%c", c);
        else if (c < 0x20 || c == 0x7F) printf("\\x%02x", c);
        else putchar(c);
    }
    putchar('\'');
}

static void print_ids(const char * label, const int32_t * ids, int n) {
    printf("    %s (%d):", label, n);
    for (int i = 0; i < n; i++) {
        printf(" %d", ids[i]);
    }
    printf("\n");
}

// Parse space/comma separated ids; returns the count.
static int parse_ids(const char * s, int32_t * out, int cap) {
    int n = 0;
    while (*s) {
        while (*s == ' ' || *s == ',' || *s == '\n' || *s == '\r' || *s == '\t') s++;
        if (!*s) break;
        char * end;
        const long v = strtol(s, &end, 10);
        if (end == s) break;
        if (n < cap) out[n] = (int32_t) v;
        n++;
        s = end;
    }
    return n;
}

// Concatenated pieces of ids (special = false) into buf; returns the length (-1 if too long).
static int detokenize(const struct kvr_vocab * v, const int32_t * ids, int n, char * buf, int cap) {
    int len = 0;
    for (int i = 0; i < n; i++) {
        const int k = kvr_token_to_piece(v, ids[i], buf + len, cap - len, false);
        if (k < 0) {
            return -1;
        }
        len += k;
    }
    return len;
}

static struct kvr_vocab * load_vocab(const char * path, struct kvr_gguf ** g) {
    *g = kvr_gguf_open(path);
    if (*g == NULL) {
        return NULL;
    }
    struct kvr_vocab * v = kvr_vocab_load(*g);
    if (v == NULL) {
        kvr_gguf_close(*g);
        *g = NULL;
    }
    return v;
}

#define MAX_IDS 4096

// One vocabulary file and its .inp/.out vectors.
static void test_vocab_file(const char * dir, const char * name) {
    char path[1024], inp_path[1100], out_path[1100];
    path_fmt(path, sizeof path, "%s/%s", dir, name);
    path_fmt(inp_path, sizeof inp_path, "%s.inp", path);
    path_fmt(out_path, sizeof out_path, "%s.out", path);
    if (!file_exists(path) || !file_exists(inp_path) || !file_exists(out_path)) {
        skip("%s: %s not found", name, !file_exists(path) ? path : !file_exists(inp_path) ? inp_path : out_path);
        return;
    }
    struct kvr_gguf * g;
    struct kvr_vocab * v = load_vocab(path, &g);
    if (v == NULL) {
        CHECK(false, "%s: cannot load the vocabulary: %s", name, kvr_last_error());
        return;
    }
    size_t inp_n;
    char * inp = read_file(inp_path, &inp_n);
    char * out = read_file(out_path, NULL);

    // the cases: text up to each "\n__ggml_vocab_test__\n"; the expected ids: one line each
    static const char sep[] = "\n__ggml_vocab_test__\n";
    const size_t sep_n = sizeof sep - 1;
    int n_cases = 0, n_ok = 0, n_rt_ok = 0, n_shown = 0;
    char * line = out;
    size_t pos = 0;
    int32_t * expect = malloc(MAX_IDS * sizeof *expect);
    int32_t * got = malloc(MAX_IDS * sizeof *got);
    char * text_buf = malloc(1 << 16);
    bool count_mismatch = false;
    while (pos < inp_n) {
        const char * next = strstr(inp + pos, sep);
        const size_t len = next ? (size_t) (next - (inp + pos)) : inp_n - pos;
        char * text = malloc(len + 1);
        memcpy(text, inp + pos, len);
        text[len] = '\0';
        pos = next ? (size_t) (next - inp) + sep_n : inp_n;

        if (line == NULL || *line == '\0') {
            count_mismatch = true;
            free(text);
            break;
        }
        char * eol = strchr(line, '\n');
        if (eol) *eol = '\0';
        const int ne = parse_ids(line, expect, MAX_IDS);
        line = eol ? eol + 1 : line + strlen(line);
        n_cases++;

        const int ng = kvr_tokenize(v, text, got, MAX_IDS, false, false);
        bool ok = ng == ne && ng <= MAX_IDS;
        for (int i = 0; ok && i < ng; i++) {
            ok = got[i] == expect[i];
        }
        n_ok += ok;
        CHECK(ok, "%s: case %d", name, n_cases);
        if (!ok && n_shown < 5) {
            n_shown++;
            printf("    input: ");
            print_escaped(text, len);
            printf("\n");
            print_ids("expected", expect, ne);
            if (ng < 0) {
                printf("    got error %d: %s\n", ng, kvr_last_error());
            } else {
                print_ids("got     ", got, ng < MAX_IDS ? ng : MAX_IDS);
            }
        }

        // the expected ids detokenize to the text
        int dn = detokenize(v, expect, ne < MAX_IDS ? ne : MAX_IDS, text_buf, 1 << 16);
        const char * dec = text_buf;
        if (dn > 0 && kvr_vocab_kind(v) == KVR_VOCAB_SPM && dec[0] == ' ') {
            dec++;
            dn--;
        }
        const bool rt = dn == (int) len && memcmp(dec, text, len) == 0;
        n_rt_ok += rt;
        CHECK(rt, "%s: case %d does not detokenize back", name, n_cases);
        if (!rt && n_shown < 5) {
            n_shown++;
            printf("    input:       ");
            print_escaped(text, len);
            printf("\n    detokenized: ");
            if (dn >= 0) print_escaped(dec, (size_t) dn);
            printf("\n");
        }
        free(text);
    }
    if (line != NULL && *line != '\0') {
        count_mismatch = true;
    }
    CHECK(!count_mismatch && n_cases > 0, "%s: %d cases in .inp but not as many lines in .out", name, n_cases);
    printf("%-40s %s: %d/%d cases, %d/%d detokenize back\n", name,
           kvr_vocab_kind(v) == KVR_VOCAB_SPM ? "SPM" : "BPE", n_ok, n_cases, n_rt_ok, n_cases);
    free(expect);
    free(got);
    free(text_buf);
    free(inp);
    free(out);
    kvr_vocab_free(v);
    kvr_gguf_close(g);
}

// A prompt of SHARED/reference tokenized as llama.cpp did (BOS as the metadata says).
static void test_reference(const char * shared, const char * model, const char * prompt_text, const char * prompt_file,
                           const char * tokens_file) {
    char path[1024], tpath[1024], ppath[1024];
    path_fmt(path, sizeof path, "%s/%s", shared, model);
    path_fmt(tpath, sizeof tpath, "%s/reference/%s", shared, tokens_file);
    if (prompt_file) {
        path_fmt(ppath, sizeof ppath, "%s/reference/%s", shared, prompt_file);
    }
    if (!file_exists(path) || !file_exists(tpath) || (prompt_file && !file_exists(ppath))) {
        skip("reference %s: its files are not in %s", tokens_file, shared);
        return;
    }
    struct kvr_gguf * g;
    struct kvr_vocab * v = load_vocab(path, &g);
    if (v == NULL) {
        CHECK(false, "reference %s: cannot load %s: %s", tokens_file, path, kvr_last_error());
        return;
    }
    char * prompt = prompt_file ? read_file(ppath, NULL) : NULL;
    if (prompt) {  // the file ends with a newline that is not part of the prompt
        size_t n = strlen(prompt);
        if (n > 0 && prompt[n - 1] == '\n') prompt[n - 1] = '\0';
    }
    char * tok_text = read_file(tpath, NULL);
    int32_t expect[512], got[512];
    const int ne = parse_ids(tok_text, expect, 512);
    const int ng = kvr_tokenize(v, prompt ? prompt : prompt_text, got, 512, kvr_vocab_add_bos(v), false);
    bool ok = ng == ne;
    for (int i = 0; ok && i < ng; i++) {
        ok = got[i] == expect[i];
    }
    CHECK(ok, "reference %s", tokens_file);
    if (!ok) {
        print_ids("expected", expect, ne);
        print_ids("got     ", got, ng > 0 ? ng : 0);
    } else {
        printf("reference %-30s %d tokens match\n", tokens_file, ng);
    }
    free(prompt);
    free(tok_text);
    kvr_vocab_free(v);
    kvr_gguf_close(g);
}

// The API around tokenization on the llama SPM vocabulary and one BPE vocabulary.
static void test_api(const char * dir) {
    char path[1024];
    path_fmt(path, sizeof path, "%s/ggml-vocab-llama-spm.gguf", dir);
    if (!file_exists(path)) {
        skip("api (SPM): %s not found", path);
    } else {
        struct kvr_gguf * g;
        struct kvr_vocab * v = load_vocab(path, &g);
        CHECK(v != NULL, "api: load %s: %s", path, kvr_last_error());
        if (v != NULL) {
            int32_t ids[64];
            // BOS and metadata
            CHECK(kvr_vocab_bos(v) == 1 && kvr_vocab_eos(v) == 2 && kvr_vocab_add_bos(v), "api: SPM bos/eos/add_bos");
            CHECK(kvr_vocab_is_eog(v, 2) && !kvr_vocab_is_eog(v, 1), "api: </s> ends generation, <s> does not");
            CHECK(kvr_vocab_n_tokens(v) == 32000 && kvr_vocab_kind(v) == KVR_VOCAB_SPM, "api: n_tokens, kind");
            int n = kvr_tokenize(v, "Hello world", ids, 64, true, false);
            CHECK(n == 3 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 3186, "api: BOS + 'Hello world' (got %d)", n);
            // a short buffer: the count needed comes back and nothing is written past n_max
            int32_t small[3] = { -7, -7, -7 };
            n = kvr_tokenize(v, "Hello world", small, 2, true, false);
            CHECK(n == 3 && small[0] == 1 && small[1] == 15043 && small[2] == -7, "api: n_max smaller than the count");
            CHECK(kvr_tokenize(v, "Hello", NULL, 0, false, false) == 1, "api: counting with n_max 0");
            CHECK(kvr_tokenize(v, "", ids, 64, false, false) == 0, "api: empty text");
            CHECK(kvr_tokenize(v, "", ids, 64, true, false) == 1 && ids[0] == 1, "api: empty text with BOS");
            CHECK(kvr_tokenize(NULL, "x", ids, 64, false, false) < 0, "api: NULL vocab is an error");
            // special tokens: parsed only on request; text after one gets the space prefix
            n = kvr_tokenize(v, "<s>Hello</s>", ids, 64, false, true);
            CHECK(n == 3 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 2, "api: parse_special '<s>Hello</s>' (got %d)", n);
            n = kvr_tokenize(v, "<s>", ids, 64, false, false);
            bool has_bos = false;
            for (int i = 0; i < n; i++) has_bos |= ids[i] == 1;
            CHECK(n > 1 && !has_bos, "api: '<s>' is plain text without parse_special");
            // pieces
            char buf[64];
            CHECK(kvr_token_to_piece(v, 15043, buf, 64, false) == 6 && memcmp(buf, " Hello", 6) == 0, "api: piece of 15043");
            CHECK(kvr_token_to_piece(v, 15043, buf, 3, false) == -6, "api: short piece buffer gives -needed");
            CHECK(kvr_token_to_piece(v, 1, buf, 64, false) == 0, "api: control token prints nothing");
            CHECK(kvr_token_to_piece(v, 1, buf, 64, true) == 3 && memcmp(buf, "<s>", 3) == 0, "api: control token with special");
            CHECK(kvr_token_to_piece(v, 3 + 0x41, buf, 64, false) == 1 && buf[0] == 'A', "api: byte token <0x41>");
            CHECK(kvr_token_to_piece(v, 32000, buf, 64, true) == 0, "api: id out of range prints nothing");
            // invalid UTF-8 survives through byte fallback (stray continuation bytes are one
            // character each; a lead byte would swallow the next bytes, as in llama.cpp)
            const char bad[] = "a\x80\xbf" "b\xc3";
            n = kvr_tokenize(v, bad, ids, 64, false, false);
            char dec[256];
            int dn = n > 0 ? detokenize(v, ids, n, dec, 256) : -1;
            CHECK(dn == (int) strlen(bad) + 1 && dec[0] == ' ' && memcmp(dec + 1, bad, strlen(bad)) == 0,
                  "api: invalid UTF-8 round trip through byte tokens");
            kvr_vocab_free(v);
            kvr_gguf_close(g);
        }
    }
    path_fmt(path, sizeof path, "%s/ggml-vocab-gpt-2.gguf", dir);
    if (!file_exists(path)) {
        skip("api (BPE): %s not found", path);
        return;
    }
    struct kvr_gguf * g;
    struct kvr_vocab * v = load_vocab(path, &g);
    CHECK(v != NULL, "api: load %s: %s", path, kvr_last_error());
    if (v == NULL) {
        return;
    }
    int32_t ids[64];
    int n = kvr_tokenize(v, "Hello<|endoftext|>", ids, 64, false, true);
    CHECK(n == 2 && ids[0] == 15496 && ids[1] == 50256, "api: BPE parse_special (got %d)", n);
    n = kvr_tokenize(v, "Hello<|endoftext|>", ids, 64, false, false);
    CHECK(n > 2, "api: BPE special text without parse_special (got %d)", n);
    CHECK(kvr_vocab_is_eog(v, 50256) && !kvr_vocab_add_bos(v), "api: BPE eog, add_bos");
    const char bad[] = "x\xff\x80y";
    n = kvr_tokenize(v, bad, ids, 64, false, false);
    CHECK(n > 0, "api: BPE invalid UTF-8 is tokenized (got %d)", n);
    char buf[16];
    CHECK(kvr_token_to_piece(v, 50256, buf, 16, false) == 0, "api: BPE control piece");
    CHECK(kvr_token_to_piece(v, 220, buf, 16, false) == 1 && buf[0] == ' ', "api: BPE piece of 220 is a space");
    kvr_vocab_free(v);
    kvr_gguf_close(g);

    // deepseek-coder: user-defined tokens are split out even without parse_special, but the FIM
    // tokens llama.cpp recognizes by their text ("<｜fim▁hole｜>") are control tokens and are not
    path_fmt(path, sizeof path, "%s/ggml-vocab-deepseek-coder.gguf", dir);
    if (!file_exists(path)) {
        skip("api (user-defined): %s not found", path);
        return;
    }
    v = load_vocab(path, &g);
    CHECK(v != NULL, "api: load %s: %s", path, kvr_last_error());
    if (v == NULL) {
        return;
    }
    static const char hole[] = "a<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>b";
    n = kvr_tokenize(v, "a<pad>b", ids, 64, false, false);
    CHECK(n == 3 && ids[0] == 64 && ids[1] == 32018 && ids[2] == 65, "api: user-defined '<pad>' split out (got %d)", n);
    n = kvr_tokenize(v, hole, ids, 64, false, false);
    CHECK(n == 15 && ids[1] == 27, "api: FIM token kept as text without parse_special (got %d)", n);
    n = kvr_tokenize(v, hole, ids, 64, false, true);
    CHECK(n == 3 && ids[1] == 32015, "api: FIM token with parse_special (got %d)", n);
    n = kvr_tokenize(v, "Hello", ids, 64, kvr_vocab_add_bos(v), false);
    CHECK(n == 2 && ids[0] == 32013 && ids[1] == 17535, "api: deepseek-coder adds its BOS (got %d)", n);
    kvr_vocab_free(v);
    kvr_gguf_close(g);
}

//
// metadata errors, on GGUF files built in memory
//

struct gbuf {
    unsigned char * p;
    size_t n, cap;
};

static void gb_put(struct gbuf * b, const void * src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void gb_u32(struct gbuf * b, uint32_t x) { gb_put(b, &x, 4); }
static void gb_u64(struct gbuf * b, uint64_t x) { gb_put(b, &x, 8); }
static void gb_str(struct gbuf * b, const char * s) { gb_u64(b, strlen(s)); gb_put(b, s, strlen(s)); }
static void gb_key(struct gbuf * b, const char * key, enum kvr_gguf_type t) { gb_str(b, key); gb_u32(b, (uint32_t) t); }
static void gb_kv_str(struct gbuf * b, const char * key, const char * s) { gb_key(b, key, KVR_GGUF_STRING); gb_str(b, s); }
static void gb_kv_u32(struct gbuf * b, const char * key, uint32_t x) { gb_key(b, key, KVR_GGUF_UINT32); gb_u32(b, x); }
static void gb_kv_strs(struct gbuf * b, const char * key, const char * const * s, int n) {
    gb_key(b, key, KVR_GGUF_ARRAY);
    gb_u32(b, KVR_GGUF_STRING);
    gb_u64(b, (uint64_t) n);
    for (int i = 0; i < n; i++) gb_str(b, s[i]);
}
static void gb_kv_i32s(struct gbuf * b, const char * key, const int32_t * x, int n) {
    gb_key(b, key, KVR_GGUF_ARRAY);
    gb_u32(b, KVR_GGUF_INT32);
    gb_u64(b, (uint64_t) n);
    gb_put(b, x, 4 * (size_t) n);
}

// A GGUF of n_kv entries written by fill().
static struct kvr_vocab * try_meta(int variant, struct kvr_gguf ** g, struct gbuf * b) {
    static const char * const toks[] = { "<unk>", "<s>", "</s>", "a", "b", "ab", "\xe2\x96\x81" };
    static const char * const bpe_toks[] = { "a", "b", "ab", "\xc4\xa0" };
    static const char * const merges[] = { "a b" };
    const int32_t types[] = { 2, 3, 3, 1, 1, 1, 1 };
    b->n = 0;
    gb_put(b, "GGUF", 4);
    gb_u32(b, 3);
    gb_u64(b, 0);
    const size_t n_kv_at = b->n;
    gb_u64(b, 0);
    int n_kv = 0;
    switch (variant) {
        case 0:  // a valid SPM vocabulary
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            gb_kv_i32s(b, "tokenizer.ggml.token_type", types, 7); n_kv++;
            break;
        case 1:  // no tokenizer.ggml.model
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            break;
        case 2:  // tokenizer.ggml.model of the wrong type
            gb_kv_u32(b, "tokenizer.ggml.model", 1); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            break;
        case 3:  // no tokens
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            break;
        case 4:  // token_type shorter than the tokens
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            gb_kv_i32s(b, "tokenizer.ggml.token_type", types, 3); n_kv++;
            break;
        case 5:  // tokens of the wrong type
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            gb_kv_i32s(b, "tokenizer.ggml.tokens", types, 7); n_kv++;
            break;
        case 6:  // gpt2 without merges
            gb_kv_str(b, "tokenizer.ggml.model", "gpt2"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", bpe_toks, 4); n_kv++;
            break;
        case 7:  // an unknown pre-tokenizer
            gb_kv_str(b, "tokenizer.ggml.model", "gpt2"); n_kv++;
            gb_kv_str(b, "tokenizer.ggml.pre", "no-such-pre"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", bpe_toks, 4); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.merges", merges, 1); n_kv++;
            break;
        case 8:  // an unknown model
            gb_kv_str(b, "tokenizer.ggml.model", "t5"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            break;
        case 9:  // add_bos_token of the wrong type
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", toks, 7); n_kv++;
            gb_kv_u32(b, "tokenizer.ggml.add_bos_token", 1); n_kv++;
            break;
        case 10:  // duplicate tokens
            gb_kv_str(b, "tokenizer.ggml.model", "llama"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", (const char * const[]) { "a", "b", "a" }, 3); n_kv++;
            break;
        case 11:  // a valid BPE vocabulary (its default BOS, 11, is past its end: none)
        case 12:  // a BOS id past the end: refused (llama.cpp keeps the default, another token)
        case 13:  // an EOS id one past the end: refused
        case 14:  // a padding id past the end: kvr uses none, ignored as llama.cpp does
            gb_kv_str(b, "tokenizer.ggml.model", "gpt2"); n_kv++;
            gb_kv_str(b, "tokenizer.ggml.pre", "gpt-2"); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.tokens", bpe_toks, 4); n_kv++;
            gb_kv_strs(b, "tokenizer.ggml.merges", merges, 1); n_kv++;
            if (variant == 12) { gb_kv_u32(b, "tokenizer.ggml.bos_token_id", 4000000000u); n_kv++; }
            if (variant == 13) { gb_kv_u32(b, "tokenizer.ggml.eos_token_id", 4); n_kv++; }
            if (variant == 14) { gb_kv_u32(b, "tokenizer.ggml.padding_token_id", 99); n_kv++; }
            break;
    }
    const uint64_t nk = (uint64_t) n_kv;
    memcpy(b->p + n_kv_at, &nk, 8);
    *g = kvr_gguf_open_mem(b->p, b->n);
    if (*g == NULL) {
        return NULL;
    }
    return kvr_vocab_load(*g);
}

static void test_metadata_errors(void) {
    static const struct { int variant; bool ok; const char * what; const char * must_name; } cases[] = {
        { 0,  true,  "valid SPM",                 NULL },
        { 1,  false, "no model key",              "tokenizer.ggml.model" },
        { 2,  false, "model key of wrong type",    "tokenizer.ggml.model" },
        { 3,  false, "no tokens",                 "tokenizer.ggml.tokens" },
        { 4,  false, "short token_type",          "tokenizer.ggml.token_type" },
        { 5,  false, "tokens of wrong type",      "tokenizer.ggml.tokens" },
        { 6,  false, "gpt2 without merges",       "tokenizer.ggml.merges" },
        { 7,  false, "unknown pre-tokenizer",     "tokenizer.ggml.pre" },
        { 8,  false, "unknown model",             "tokenizer.ggml.model" },
        { 9,  false, "add_bos_token wrong type",  "tokenizer.ggml.add_bos_token" },
        { 10, false, "duplicate tokens",          "tokenizer.ggml.tokens" },
        { 11, true,  "valid BPE",                 NULL },
        { 12, false, "BOS id out of range",       "tokenizer.ggml.bos_token_id = 4000000000 is not a token of this vocabulary (ids 0 to 3)" },
        { 13, false, "EOS id out of range",       "tokenizer.ggml.eos_token_id = 4 is not a token" },
        { 14, true,  "padding id out of range",   NULL },
    };
    struct gbuf b = { 0 };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvr_gguf * g = NULL;
        struct kvr_vocab * v = try_meta(cases[i].variant, &g, &b);
        if (cases[i].ok) {
            CHECK(v != NULL, "metadata: %s should load: %s", cases[i].what, kvr_last_error());
            if (v != NULL && cases[i].variant == 0) {
                int32_t ids[16];
                const int n = kvr_tokenize(v, "ab", ids, 16, true, false);
                // "▁ab" is no token and "▁" + "ab" merge no further
                CHECK(n == 3 && ids[0] == 1 && ids[1] == 6 && ids[2] == 5, "metadata: tiny SPM tokenizes 'ab' (got %d)", n);
                CHECK(kvr_tokenize(v, "c", ids, 16, false, false) == 2 && ids[1] == 0,
                      "metadata: a character with no token and no byte tokens becomes <unk>");
            }
            if (v != NULL && cases[i].variant == 11) {
                int32_t ids[16];
                const int n = kvr_tokenize(v, "ab", ids, 16, false, false);
                CHECK(n == 1 && ids[0] == 2, "metadata: tiny BPE merges 'a b' (got %d)", n);
                CHECK(kvr_vocab_bos(v) == -1, "metadata: default BOS 11 is outside 4 tokens");
            }
        } else {
            const char * err = kvr_last_error();
            CHECK(g == NULL || v == NULL, "metadata: %s should fail", cases[i].what);
            CHECK(v != NULL || strstr(err, cases[i].must_name) != NULL, "metadata: %s: the message names %s: '%s'",
                  cases[i].what, cases[i].must_name, err);
        }
        kvr_vocab_free(v);
        kvr_gguf_close(g);
    }
    free(b.p);
}

static int cmp_str(const void * a, const void * b) {
    return strcmp(*(char * const *) a, *(char * const *) b);
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    char dir[1024];
    path_fmt(dir, sizeof dir, "%s/vocab", shared);

    // the vocabularies this test knows, and any other one with vectors
    const char * known[] = {
        "ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf", "ggml-vocab-falcon.gguf",
        "ggml-vocab-starcoder.gguf", "ggml-vocab-deepseek-coder.gguf",
    };
    const int n_known = (int) (sizeof known / sizeof known[0]);
    char * names[256];
    int n_names = 0;
    for (int i = 0; i < n_known; i++) {
        names[n_names++] = strdup(known[i]);
    }
    DIR * d = opendir(dir);
    if (d != NULL) {
        struct dirent * e;
        while ((e = readdir(d)) != NULL && n_names < 256) {
            const size_t len = strlen(e->d_name);
            if (strncmp(e->d_name, "ggml-vocab-", 11) != 0 || len < 5 || strcmp(e->d_name + len - 5, ".gguf") != 0) {
                continue;
            }
            bool seen = false;
            for (int i = 0; i < n_names; i++) seen |= strcmp(names[i], e->d_name) == 0;
            if (!seen) names[n_names++] = strdup(e->d_name);
        }
        closedir(d);
    }
    qsort(names + n_known, (size_t) (n_names - n_known), sizeof names[0], cmp_str);
    for (int i = 0; i < n_names; i++) {
        test_vocab_file(dir, names[i]);
        free(names[i]);
    }

    test_reference(shared, "models/stories260K.gguf", "Once upon a time", NULL, "stories260K.tokens");
    test_reference(shared, "reference/tiny-falcon-mqa.gguf", NULL, "tiny-falcon-mqa.prompt", "tiny-falcon-mqa.tokens");
    test_api(dir);
    test_metadata_errors();

    return check_summary("tokenizer");
}
