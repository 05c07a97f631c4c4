// test-unicode.c - the BPE pre-tokenizers of kvr's tokenizer, through the public kvr_tokenize:
// tricky inputs for each pre-tokenizer (contractions, case-sensitive in GPT-2 and not in Llama 3;
// digit grouping, Llama 3's \p{N}{1,3}, Qwen2's one digit, Falcon's [0-9]{3} after GPT-2;
// whitespace runs before a word; newlines; emoji with ZWJ; CJK; accents; the DeepSeek lists whose
// later regexes cut the pieces of earlier ones), for each BPE vocabulary of SHARED/vocab whose
// tokenizer.ggml.pre has cases here (gpt-2, falcon, starcoder, deepseek-coder). The expected
// pieces were checked against the same regexes run by another engine (Python's regex module).
// BPE never merges across pre-tokens, so every piece boundary must be a token boundary, and the
// tokens must spell the text. A missing file is a SKIP, never a pass.
//
//   test-unicode [SHARED]    (default ../shared)
//
// The last line is "unicode: N passed, M failed[, K skipped]"; the exit code is 1 on a failure.

#include "kvr.h"
#include "tests/check.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

//
// The pre-tokenizer cases: a tokenizer.ggml.pre value, a text, and its pieces
//

struct pre_case {
    const char * pre;
    const char * text;
    const char * pieces[40];   // NULL-terminated
};

static const struct pre_case pre_cases[] = {
    { "gpt-2",         "Hello world",
      { "Hello", " world", NULL } },
    { "gpt-2",         "   Hello",
      { "  ", " Hello", NULL } },
    { "gpt-2",         "I've been 'told he's there, 'RE you sure? 'M not sure I'll",
      { "I", "'ve", " been", " '", "told", " he", "'s", " there", ",", " '", "RE", " you", " sure", "?", " '", "M", " not", " sure", " I", "'ll", NULL } },
    { "gpt-2",         " 3333333 3.3 3..3",
      { " 3333333", " 3", ".", "3", " 3", "..", "3", NULL } },
    { "gpt-2",         "\n\n\n",
      { "\n\n\n", NULL } },
    { "gpt-2",         " \t\n x",
      { " \t\n", " x", NULL } },
    { "gpt-2",         "x ",
      { "x", " ", NULL } },
    { "gpt-2",         "x  ",
      { "x", "  ", NULL } },
    { "gpt-2",         "\xf0\x9f\x9a\x80 (normal) \xf0\x9f\x98\xb6\xe2\x80\x8d\xf0\x9f\x8c\xab\xef\xb8\x8f (multiple emojis concatenated) \xe2\x9c\x85",
      { "\xf0\x9f\x9a\x80", " (", "normal", ")", " \xf0\x9f\x98\xb6\xe2\x80\x8d\xf0\x9f\x8c\xab\xef\xb8\x8f", " (", "multiple", " emojis", " concatenated", ")", " \xe2\x9c\x85", NULL } },
    { "gpt-2",         "C\xe1\xbb\xad""a Vi\xe1\xbb\x87t F\xc3\xbchrer",
      { "C\xe1\xbb\xad""a", " Vi\xe1\xbb\x87t", " F\xc3\xbchrer", NULL } },
    { "gpt-2",         "\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8""apple\xe5\xb7\xa5\xe4\xbd\x9c""1314151\xe5\xa4\xa9\xef\xbd\x9e",
      { "\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8""apple\xe5\xb7\xa5\xe4\xbd\x9c", "1314151", "\xe5\xa4\xa9", "\xef\xbd\x9e", NULL } },
    { "gpt-2",         "''''''```````\"\"\"\"......!!!!!!??????",
      { "''''''```````\"\"\"\"......!!!!!!??????", NULL } },
    { "gpt-2",         "\xc2\xa0\xc2\xa0x\xe3\x80\x80y",
      { "\xc2\xa0", "\xc2\xa0", "x", "\xe3\x80\x80", "y", NULL } },
    { "llama-bpe",     "I've 'RE 'Ve 'll 'LL",
      { "I", "'ve", " '", "RE", " '", "Ve", " '", "ll", " '", "LL", NULL } },
    { "llama-bpe",     "3333333 1234567890",
      { "333", "333", "3", " ", "123", "456", "789", "0", NULL } },
    { "llama-bpe",     "Hello\n\n  world",
      { "Hello", "\n\n", " ", " world", NULL } },
    { "llama-bpe",     "a  \n\n b",
      { "a", "  \n\n", " b", NULL } },
    { "llama-bpe",     "(hello\tworld ,x",
      { "(hello", "\tworld", " ,", "x", NULL } },
    { "llama-bpe",     "x!!!\n\ny ?\r\n",
      { "x", "!!!\n\n", "y", " ?\r\n", NULL } },
    { "llama-bpe",     "  \t x",
      { "  \t", " x", NULL } },
    { "llama-bpe",     "C\xe1\xbb\xad""a Vi\xe1\xbb\x87t \xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8""apple\xe5\xb7\xa5\xe4\xbd\x9c""1314151\xe5\xa4\xa9\xef\xbd\x9e",
      { "C\xe1\xbb\xad""a", " Vi\xe1\xbb\x87t", " \xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8""apple\xe5\xb7\xa5\xe4\xbd\x9c", "131", "415", "1", "\xe5\xa4\xa9", "\xef\xbd\x9e", NULL } },
    { "llama-bpe",     "x ",
      { "x", " ", NULL } },
    { "qwen2",         "3333 x'Ve 12",
      { "3", "3", "3", "3", " x", "'Ve", " ", "1", "2", NULL } },
    { "qwen2",         "Hello\n\n  world!!\n",
      { "Hello", "\n\n", " ", " world", "!!\n", NULL } },
    { "falcon",        "Hello, y'all! 3333333 33",
      { "Hello", ",", " y", "'", "all", "!", " ", "333", "333", "3", " 33", NULL } },
    { "falcon",        "$100 + 2^10 = 1024|x`y`~",
      { "$", "100", " ", "+", " 2", "^", "10", " ", "=", " ", "102", "4", "|", "x", "`", "y", "`~", NULL } },
    { "falcon",        "3.3 3..3 3...3",
      { "3", ".", "3", " 3", "..", "3", " 3", "...", "3", NULL } },
    { "default",       "$100 + 2^10 = 1024|x`y`~",
      { "$", "100", " ", "+", " ", "2", "^", "10", " ", "=", " ", "102", "4", "|", "x", "`", "y", "`", "~", NULL } },
    { "default",       "Hello, y'all! 3333333 \xc2\xb2\xc2\xb3\xc2\xbd",
      { "Hello", ",", " y", "'", "all", "!", " ", "333", "333", "3", " ", "\xc2\xb2\xc2\xb3\xc2\xbd", NULL } },
    { "starcoder",     "w048 7tuijk dsdfhu",
      { "w", "0", "4", "8", " ", "7", "tuijk", " dsdfhu", NULL } },
    { "starcoder",     " 3333 \xc2\xb2x",
      { " ", "3", "3", "3", "3", " ", "\xc2\xb2", "x", NULL } },
    { "deepseek-coder", "Hello\nworld",
      { "Hello", "\n", "world", NULL } },
    { "deepseek-coder", "  \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c 123",
      { " ", " ", "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", " ", "1", "2", "3", NULL } },
    { "deepseek-coder", "a\r\nb  foo(bar); x",
      { "a", "\r", "\n", "b", " ", " foo", "(", "bar", ");", " x", NULL } },
    { "deepseek-coder", "C\xe1\xbb\xad""a Vi\xe1\xbb\x87t \xef\xbc\x93",
      { "C", "\xe1\xbb\xad", "a", " Vi", "\xe1\xbb\x87", "t", " ", "\xef\xbc\x93", NULL } },
    { "deepseek-llm",  "Hello, world!  ",
      { "Hello", ",", " world", "!", "  ", NULL } },
    { "deepseek-llm",  "caf\xc3\xa9 3000 \xef\xbc\x95 \xce\xa9mega",
      { "caf", "\xc3\xa9", " ", "3000", " ", "\xef\xbc\x95", " \xce\xa9", "mega", NULL } },
    { "deepseek-llm",  "x\xe3\x80\x80\xe3\x80\x82\xef\xbc\x81y",
      { "x", "\xe3\x80\x80", "\xe3\x80\x82", "\xef\xbc\x81", "y", NULL } },
    { "deepseek-llm",  "\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8""apple\xe5\xb7\xa5\xe4\xbd\x9c""1314151\xe5\xa4\xa9\xef\xbd\x9e\n  ",
      { "\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8", "apple", "\xe5\xb7\xa5\xe4\xbd\x9c", "1314151", "\xe5\xa4\xa9", "\xef\xbd\x9e", "\n", "  ", NULL } },
    { "deepseek-llm",  "\xce\xb1\xce\xb2\xce\xb3 \xc7\x85 \xca\x94x",
      { "\xce\xb1\xce\xb2\xce\xb3", " \xc7\x85", " \xca\x94", "x", NULL } },
    { "poro-chat",     "Hello, world! (a|b)  x\xe2\x80\xa6y\xe3\x80\x82 z12",
      { "Hello", ",", " world", "! (", "a", "|", "b", ") ", " x", "\xe2\x80\xa6", "y", "\xe3\x80\x82", " z12", NULL } },
    { "viking",        "abc123 def, 45.6 \xe0\xa5\xa7\xe0\xa5\xa8",
      { "abc", "1", "2", "3", " def", ",", " ", "4", "5", ".", "6", " ", "\xe0\xa5\xa7", "\xe0\xa5\xa8", NULL } },
    // invalid bytes: each one reads as U+FFFD, a symbol
    { "gpt-2",         "a\xff" "b",
      { "a", "\xff", "b", NULL } },
    { "llama-bpe",     "x\xff\xfe" "y\n",
      { "x", "\xff\xfe", "y", "\n", NULL } },
    // empty text
    { "gpt-2",         "", { NULL } },
    { "deepseek-llm",  "", { NULL } },
};

// Whether s[0, n) is valid UTF-8 (the tokenizer cleans invalid text first: those cases are left out).
static bool utf8_valid(const char * s, size_t n) {
    const unsigned char * u = (const unsigned char *) s;
    for (size_t i = 0; i < n; ) {
        const size_t k = u[i] < 0x80 ? 1 : (u[i] >> 5) == 6 ? 2 : (u[i] >> 4) == 14 ? 3 : (u[i] >> 3) == 30 ? 4 : 0;
        if (k == 0 || k > n - i) {
            return false;
        }
        for (size_t j = 1; j < k; j++) {
            if ((u[i + j] & 0xC0) != 0x80) {
                return false;
            }
        }
        i += k;
    }
    return true;
}

// The cases of one pre-tokenizer through the vocabulary that uses it.
static void test_vocab(const char * shared, const char * pre) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/vocab/ggml-vocab-%s.gguf", shared, pre);
    struct kvr_gguf * g = kvr_gguf_open(path);
    if (!g) {
        skip("%s: %s not found", pre, path);
        return;
    }
    struct kvr_vocab * v = kvr_vocab_load(g);
    CHECK(v != NULL, "%s: %s", path, kvr_last_error());
    for (size_t c = 0; v && c < sizeof(pre_cases) / sizeof(pre_cases[0]); c++) {
        const struct pre_case * pc = &pre_cases[c];
        const size_t len = strlen(pc->text);
        if (strcmp(pc->pre, pre) != 0 || !utf8_valid(pc->text, len)) {
            continue;
        }
        int32_t ids[256];
        size_t  ends[256];   // the byte offset where each token ends
        const int n = kvr_tokenize(v, pc->text, ids, 256, false, false);
        bool ok = n >= 0 && n <= 256;
        size_t at = 0;
        for (int i = 0; ok && i < n; i++) {
            char piece[256];
            const int m = kvr_token_to_piece(v, ids[i], piece, (int) sizeof(piece), false);
            ok = m > 0 && at + (size_t) m <= len && memcmp(pc->text + at, piece, (size_t) m) == 0;
            at += ok ? (size_t) m : 0;
            ends[i] = at;
        }
        CHECK(ok && at == len, "%s case %zu: %d tokens spell %zu of the %zu bytes", pre, c, n, at, len);
        // every piece must end where a token ends
        size_t piece_end = 0;
        int    t = 0, bad = 0;
        for (int k = 0; ok && pc->pieces[k]; k++) {
            piece_end += strlen(pc->pieces[k]);
            while (t < n && ends[t] < piece_end) t++;
            bad += t == n || ends[t] != piece_end;
        }
        CHECK(ok && bad == 0, "%s case %zu: %d pieces end inside a token", pre, c, bad);
    }
    kvr_vocab_free(v);
    kvr_gguf_close(g);
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    static const char * const pres[] = { "gpt-2", "falcon", "starcoder", "deepseek-coder" };
    for (size_t i = 0; i < sizeof(pres) / sizeof(pres[0]); i++) {
        test_vocab(shared, pres[i]);
    }
    return check_summary("unicode");
}

