// test-unicode.c - the Unicode part of kvr (unicode.c, a fragment pasted into kvr.c before the
// vocab code): UTF-8 decoding the way llama.cpp does it (an invalid byte reads as U+FFFD, overlong
// forms and surrogates pass), encoding, the cleaned text llama.cpp tokenizes, the category flags
// and lowercase tables of tests/gen-unicode.py, GPT-2's byte alphabet, and each pre-tokenizer on
// tricky inputs: contractions (case-sensitive in GPT-2, not in Llama 3), digit grouping (Llama 3's
// \p{N}{1,3}, Qwen2's one digit, Falcon's [0-9]{3} after GPT-2), whitespace runs before a word,
// newlines, emoji with ZWJ, CJK, accents, and the DeepSeek lists whose later regexes cut the
// pieces of earlier ones. The expected pieces were checked against the same regexes run by
// another engine (Python's regex module).
//
// Two ways to build it:
//   - with the fragment on the include path (or -DUNICODE_STANDALONE), alone:
//       cc -std=c11 -O2 -Wall -Wextra -Werror -I. -I<dir of unicode.c> tests/test-unicode.c
//     every check above runs against the uni_* functions;
//   - linked with kvr.c (the Makefile's way; the uni_* functions are static in there): the same
//     pre-tokenizer cases go through the public tokenizer instead, for each BPE vocabulary of
//     SHARED/vocab whose tokenizer.ggml.pre has cases here (gpt-2, falcon, starcoder,
//     deepseek-coder). BPE never merges across pre-tokens, so every piece boundary must be a token
//     boundary, and the tokens must spell the text. A missing file is a SKIP, never a pass.
//       test-unicode [SHARED]    (default ../shared)
// Either way the last line is "N passed, M failed" (", K skipped"), and the exit code is 1 on a
// failure.

#if !defined(UNICODE_STANDALONE) && defined(__has_include)
#if __has_include("unicode.c")
#define UNICODE_STANDALONE
#endif
#endif

#ifdef UNICODE_STANDALONE
#include "unicode.c"

#include <stdarg.h>
#include <stdio.h>

// The one kvr function the fragment calls, stubbed: keep the message for the checks.
static char test_err[256];
int kvr_error(int code, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(test_err, sizeof(test_err), fmt, ap);
    va_end(ap);
    return code;
}
static const char * test_last_error(void) { return test_err; }
#else
#include "kvr.h"
#endif

#include <ctype.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail;

#define CHECK(cond, ...) do {                                        \
    if (cond) { n_pass++; } else {                                   \
        n_fail++;                                                    \
        fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        fprintf(stderr, __VA_ARGS__);                                \
        fprintf(stderr, "\n");                                       \
    }                                                                \
} while (0)

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

#ifdef UNICODE_STANDALONE

//
// UTF-8
//

static void test_decode(void) {
    static const struct {
        const char * s;
        size_t       len;
        uint32_t     cpt[4];  // the code points read, in order
        size_t       adv[4];  // bytes each one took
        int          n;
    } cases[] = {
        { "A",                    1, { 0x41 },               { 1 },       1 },
        { "\xc3\xa9",             2, { 0xE9 },               { 2 },       1 },
        { "\xe2\x82\xac",         3, { 0x20AC },             { 3 },       1 },
        { "\xf0\x9f\xa6\x99",     4, { 0x1F999 },            { 4 },       1 },
        { "\x80z",                2, { 0xFFFD, 'z' },        { 1, 1 },    2 }, // lone continuation
        { "\xc3",                 1, { 0xFFFD },             { 1 },       1 }, // cut short at the end
        { "\xe2\x82",             2, { 0xFFFD, 0xFFFD },     { 1, 1 },    2 },
        { "\xe2(\xa1",            3, { 0xFFFD, '(', 0xFFFD },{ 1, 1, 1 }, 3 }, // bad continuation
        { "\xf8\x88\x80\x80",     4, { 0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD }, { 1, 1, 1, 1 }, 4 },
        { "\xff",                 1, { 0xFFFD },             { 1 },       1 },
        { "\xc0\x80",             2, { 0 },                  { 2 },       1 }, // overlong: accepted
        { "\xed\xa0\x80",         3, { 0xD800 },             { 3 },       1 }, // surrogate: accepted
        { "\xf4\x90\x80\x80",     4, { 0x110000 },           { 4 },       1 }, // past U+10FFFF
        { "\xf7\xbf\xbf\xbf",     4, { 0x1FFFFF },           { 4 },       1 },
        { "a\0b",                 3, { 'a', 0, 'b' },        { 1, 1, 1 }, 3 },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t i = 0;
        int    k = 0;
        while (i < cases[c].len && k < 4) {
            const size_t   i0  = i;
            const uint32_t cpt = uni_decode(cases[c].s, cases[c].len, &i);
            CHECK(k < cases[c].n && cpt == cases[c].cpt[k] && i - i0 == cases[c].adv[k],
                  "case %zu, code point %d: U+%04X after %zu bytes", c, k, (unsigned) cpt, i - i0);
            k++;
        }
        CHECK(k == cases[c].n && i == cases[c].len, "case %zu: %d code points", c, k);
    }
}

static void test_encode(void) {
    char buf[4];
    CHECK(uni_encode('A', buf) == 1 && buf[0] == 'A', "A");
    CHECK(uni_encode(0xE9, buf) == 2 && memcmp(buf, "\xc3\xa9", 2) == 0, "U+00E9");
    CHECK(uni_encode(0x20AC, buf) == 3 && memcmp(buf, "\xe2\x82\xac", 3) == 0, "U+20AC");
    CHECK(uni_encode(0x1F999, buf) == 4 && memcmp(buf, "\xf0\x9f\xa6\x99", 4) == 0, "U+1F999");
    CHECK(uni_encode(0xD800, buf) == 3 && memcmp(buf, "\xed\xa0\x80", 3) == 0, "surrogate");
    CHECK(uni_encode(0x110000, buf) == 0, "past U+10FFFF");

    // every code point goes through encode and decode unchanged
    int bad = 0;
    for (uint32_t cpt = 0; cpt < 0x110000; cpt++) {
        const int n = uni_encode(cpt, buf);
        size_t i = 0;
        if (n < 1 || uni_decode(buf, (size_t) n, &i) != cpt || i != (size_t) n) {
            bad++;
        }
    }
    CHECK(bad == 0, "%d code points do not round-trip", bad);
}

static void test_clean(void) {
    static const struct { const char * in; size_t len; const char * out; } cases[] = {
        { "plain ascii",           11, "plain ascii" },
        { "F\xc3\xbchrer \xf0\x9f\xa6\x99", 12, "F\xc3\xbchrer \xf0\x9f\xa6\x99" },
        { "a\xff" "b",              3, "a\xef\xbf\xbd" "b" },
        { "\xe2\x82",               2, "\xef\xbf\xbd\xef\xbf\xbd" },
        { "\xc1\xbf",               2, "\x7f" },                      // overlong: shortest form
        { "\xf4\x90\x80\x80",       4, "\xef\xbf\xbd" },              // past U+10FFFF
        { "",                       0, "" },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t n = 99;
        char * s = uni_utf8_clean(cases[c].in, cases[c].len, &n);
        CHECK(s && n == strlen(cases[c].out) && memcmp(s, cases[c].out, n) == 0 && s[n] == '\0',
              "case %zu: %zu bytes", c, n);
        free(s);
    }
}

//
// Tables
//

static void test_flags(void) {
    static const struct { uint32_t cpt; unsigned flags; } cases[] = {
        { 'A',     UNI_LETTER },
        { 'z',     UNI_LETTER },
        { '7',     UNI_NUMBER },
        { ' ',     UNI_SEPARATOR | UNI_WHITESPACE },
        { '\n',    UNI_CONTROL | UNI_WHITESPACE },
        { '\v',    UNI_CONTROL | UNI_WHITESPACE },
        { 0x1C,    UNI_CONTROL },                    // not White_Space (isspace would say so)
        { '!',     UNI_PUNCTUATION },
        { '_',     UNI_PUNCTUATION },
        { '$',     UNI_SYMBOL },
        { '~',     UNI_SYMBOL },
        { 0x00,    UNI_CONTROL },
        { 0x85,    UNI_CONTROL | UNI_WHITESPACE },
        { 0xA0,    UNI_SEPARATOR | UNI_WHITESPACE },
        { 0xAD,    UNI_CONTROL },                    // soft hyphen, Cf
        { 0xB2,    UNI_NUMBER },                     // superscript two, No
        { 0xB5,    UNI_LETTER },
        { 0xD7,    UNI_SYMBOL },
        { 0x0301,  UNI_ACCENT_MARK },
        { 0x0378,  UNI_UNDEFINED },
        { 0x0660,  UNI_NUMBER },                     // Arabic-Indic zero
        { 0x1680,  UNI_SEPARATOR | UNI_WHITESPACE },
        { 0x1C89,  UNI_UNDEFINED },                  // assigned only in Unicode 16 (llama.cpp: 15.1)
        { 0x200B,  UNI_CONTROL },                    // zero width space: Cf, not White_Space
        { 0x200D,  UNI_CONTROL },
        { 0x2028,  UNI_SEPARATOR | UNI_WHITESPACE },
        { 0x2166,  UNI_NUMBER },                     // Roman numeral seven, Nl
        { 0x3000,  UNI_SEPARATOR | UNI_WHITESPACE },
        { 0x3002,  UNI_PUNCTUATION },
        { 0x4E00,  UNI_LETTER },
        { 0xAC00,  UNI_LETTER },
        { 0xD800,  UNI_CONTROL },                    // Cs
        { 0xE000,  UNI_CONTROL },                    // Co
        { 0xFE0F,  UNI_ACCENT_MARK },                // variation selector, Mn
        { 0xFFFD,  UNI_SYMBOL },
        { 0xFF5E,  UNI_SYMBOL },
        { 0x11F00, UNI_ACCENT_MARK },                // Kawi, Unicode 15.0
        { 0x1F680, UNI_SYMBOL },
        { 0x2EBF0, UNI_LETTER },                     // CJK extension I, Unicode 15.1
        { 0x10FFFF, UNI_UNDEFINED },
        { 0x110000, UNI_UNDEFINED },
        { 0xFFFFFFFF, UNI_UNDEFINED },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        CHECK(uni_flags(cases[c].cpt) == cases[c].flags, "U+%04X: flags 0x%03X, want 0x%03X",
              (unsigned) cases[c].cpt, uni_flags(cases[c].cpt), cases[c].flags);
    }

    // one category bit each, and White_Space is exactly its 25 code points
    int bad = 0, n_ws = 0;
    for (uint32_t cpt = 0; cpt < 0x110000; cpt++) {
        const unsigned f = uni_flags(cpt), cat = f & 0xFF;
        if (cat == 0 || (cat & (cat - 1)) != 0 || (f & ~0x1FFu)) {
            bad++;
        }
        n_ws += (f & UNI_WHITESPACE) != 0;
    }
    CHECK(bad == 0, "%d code points without exactly one category", bad);
    CHECK(n_ws == 25, "%d whitespace code points", n_ws);

    // ASCII against <ctype.h> in the C locale
    bad = 0;
    for (int c = 0; c < 128; c++) {
        const unsigned f = uni_flags((uint32_t) c);
        bad += !!isalpha(c) != !!(f & UNI_LETTER);
        bad += !!isdigit(c) != !!(f & UNI_NUMBER);
        bad += !!isspace(c) != !!(f & UNI_WHITESPACE);
        bad += !!ispunct(c) != !!(f & (UNI_PUNCTUATION | UNI_SYMBOL));
        bad += !!iscntrl(c) != !!(f & UNI_CONTROL);
    }
    CHECK(bad == 0, "%d ASCII disagreements with ctype", bad);
}

static void test_tolower(void) {
    static const uint32_t cases[][2] = {
        { 'A', 'a' }, { 'Z', 'z' }, { 'a', 'a' }, { '0', '0' }, { '[', '[' },
        { 0xC0, 0xE0 }, { 0xD7, 0xD7 }, { 0xDE, 0xFE }, { 0xDF, 0xDF },
        { 0x0100, 0x0101 }, { 0x0101, 0x0101 }, { 0x012E, 0x012F },
        { 0x0130, 'i' },       // capital I with dot: the first code point of "i\u0307"
        { 0x0178, 0xFF }, { 0x01C4, 0x01C6 }, { 0x01C5, 0x01C6 },
        { 0x03A3, 0x03C3 }, { 0x03C2, 0x03C2 }, { 0x0410, 0x0430 }, { 0x1E9E, 0xDF },
        { 0x2126, 0x03C9 }, { 0x212A, 'k' }, { 0x24B6, 0x24D0 }, { 0xFF21, 0xFF41 },
        { 0x10400, 0x10428 }, { 0x1E900, 0x1E922 }, { 0x1F600, 0x1F600 }, { 0x110000, 0x110000 },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        CHECK(uni_tolower(cases[c][0]) == cases[c][1], "U+%04X -> U+%04X, want U+%04X",
              (unsigned) cases[c][0], (unsigned) uni_tolower(cases[c][0]), (unsigned) cases[c][1]);
    }
    // Llama 3's (?i:'s|'t|...) lowercases; llama.cpp's Qwen2 form spells '[sS]: the same only if
    // no non-ASCII code point lowercases into those letters
    int bad = 0;
    for (uint32_t cpt = 0x80; cpt < 0x110000; cpt++) {
        const uint32_t low = uni_tolower(cpt);
        bad += low < 0x80 && strchr("stmdrevl", (int) low) && low;
    }
    CHECK(bad == 0, "%d non-ASCII code points lowercase into a contraction letter", bad);
}

static void test_bytes(void) {
    CHECK(uni_byte_to_cpt(' ') == 0x120, "space -> U+%04X", (unsigned) uni_byte_to_cpt(' '));
    CHECK(uni_byte_to_cpt('\n') == 0x10A, "newline -> U+%04X", (unsigned) uni_byte_to_cpt('\n'));
    CHECK(uni_byte_to_cpt(0) == 0x100, "0 -> U+%04X", (unsigned) uni_byte_to_cpt(0));
    CHECK(uni_byte_to_cpt(0x7F) == 0x121, "0x7F -> U+%04X", (unsigned) uni_byte_to_cpt(0x7F));
    CHECK(uni_byte_to_cpt(0xA0) == 0x142, "0xA0 -> U+%04X", (unsigned) uni_byte_to_cpt(0xA0));
    CHECK(uni_byte_to_cpt(0xAD) == 0x143, "0xAD -> U+%04X", (unsigned) uni_byte_to_cpt(0xAD));
    CHECK(uni_byte_to_cpt('a') == 'a' && uni_byte_to_cpt(0xE9) == 0xE9, "printable bytes");
    CHECK(uni_cpt_to_byte(0x144) == -1 && uni_cpt_to_byte(' ') == -1 && uni_cpt_to_byte(0x20AC) == -1,
          "code points outside the alphabet");
    int bad = 0;
    uint8_t seen[0x144] = { 0 };
    for (int b = 0; b < 256; b++) {
        const uint32_t cpt = uni_byte_to_cpt((uint8_t) b);
        if (cpt >= 0x144 || seen[cpt]++ || uni_cpt_to_byte(cpt) != b) {
            bad++;
        }
    }
    CHECK(bad == 0, "%d bytes do not map one to one", bad);
}

//
// Pre-tokenizers
//

// Run one case; len is strlen(text) unless the text holds a NUL.
static void check_pieces(const char * pre, const char * text, size_t len, const char * const * want, const char * what) {
    struct uni_span * sp = NULL;
    const int n = uni_pretokenize(pre, text, len, &sp);
    int n_want = 0;
    while (want[n_want]) n_want++;
    bool ok = n == n_want && sp;
    for (int k = 0; ok && k < n; k++) {
        ok = sp[k].len == strlen(want[k]) && memcmp(text + sp[k].off, want[k], sp[k].len) == 0;
    }
    CHECK(ok, "%s %s: %d pieces, want %d", pre, what, n, n_want);
    if (!ok && n >= 0) {
        for (int k = 0; k < n; k++) {
            fprintf(stderr, "    got [%.*s]\n", (int) sp[k].len, text + sp[k].off);
        }
    }
    free(sp);
}

static void test_pretokenize(void) {
    for (size_t c = 0; c < sizeof(pre_cases) / sizeof(pre_cases[0]); c++) {
        char what[32];
        snprintf(what, sizeof(what), "case %zu", c);
        check_pieces(pre_cases[c].pre, pre_cases[c].text, strlen(pre_cases[c].text), pre_cases[c].pieces, what);
    }

    // a NUL is a control character like any other; an overlong NUL too, after its space
    {
        struct uni_span * sp = NULL;
        const int n = uni_pretokenize("gpt-2", "a\0b \xc0\x80", 6, &sp);
        CHECK(n == 4 && sp[1].off == 1 && sp[1].len == 1 && sp[2].off == 2 && sp[3].off == 3 && sp[3].len == 3,
              "NUL: %d pieces", n);
        free(sp);
    }

    // invalid bytes cleaned first: the pieces hold U+FFFD as llama.cpp's do
    {
        size_t n = 0;
        char * s = uni_utf8_clean("a\xff" "b", 3, &n);
        check_pieces("gpt-2", s, n, (const char *[]) { "a", "\xef\xbf\xbd", "b", NULL }, "cleaned");
        free(s);
    }

    // names: aliases llama.cpp maps to the same lists, a missing name, an unknown one
    check_pieces("llama3", "'RE 123456", 10, (const char *[]) { "'RE", " ", "123", "456", NULL }, "alias");
    check_pieces("phi-2", "'RE 123456", 10, (const char *[]) { "'", "RE", " 123456", NULL }, "alias");
    check_pieces(NULL, "a 1234", 6, (const char *[]) { "a", " ", "123", "4", NULL }, "no name");
    check_pieces("", "a 1234", 6, (const char *[]) { "a", " ", "123", "4", NULL }, "empty name");
    {
        struct uni_span * sp = (struct uni_span *) 1;
        const int n = uni_pretokenize("no-such-pre", "abc", 3, &sp);
        CHECK(n == -1 && sp == NULL && strstr(test_last_error(), "'no-such-pre'"),
              "unknown name: %d, '%s'", n, test_last_error());
    }
}

// Pieces are non-empty, in order, and cover the text, on a mix of everything, for every name.
// A long text also shows the work is linear in its length.
static void test_cover(void) {
    static const char * const names[] = {
        "default", "gpt-2", "falcon", "starcoder", "llama-bpe", "qwen2", "deepseek-coder", "deepseek-llm",
        "poro-chat", "viking",
    };
    static const char * const atoms[] = {
        "a", "Z", "'", "'s", "'LL", " ", "  ", "\t", "\n", "\r\n", "7", "123", "!", "$", "`", "~",
        "\xc3\xa9", "\xe4\xb8\xad", "\xea\xb0\x80", "\xf0\x9f\xa6\x99", "\xe2\x80\x8d", "\xcc\x81",
        "\xc2\xa0", "\xe3\x80\x80", "\xef\xbc\x95", "\xff", "\xe2\x82", "\xc2\xb2",
    };
    const size_t n_atoms = sizeof(atoms) / sizeof(atoms[0]);
    const size_t cap = 1 << 20;
    char * text = malloc(cap + 8);
    size_t len = 0;
    uint32_t rng = 12345;
    while (len < cap) {
        rng = rng * 1664525u + 1013904223u;
        const char * a = atoms[(rng >> 8) % n_atoms];
        memcpy(text + len, a, strlen(a));
        len += strlen(a);
    }
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        struct uni_span * sp = NULL;
        const int n = uni_pretokenize(names[k], text, len, &sp);
        bool ok = n > 0 && sp;
        size_t at = 0;
        for (int i = 0; ok && i < n; i++) {
            ok = sp[i].off == at && sp[i].len > 0;
            at += sp[i].len;
        }
        CHECK(ok && at == len, "%s: %d pieces over %zu of %zu bytes", names[k], n, at, len);
        free(sp);
    }
    free(text);
}

int main(void) {
    test_decode();
    test_encode();
    test_clean();
    test_flags();
    test_tolower();
    test_bytes();
    test_pretokenize();
    test_cover();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

#else // linked with kvr.c

static int n_skip;

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
        printf("SKIP %s: %s not found\n", pre, path);
        n_skip++;
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
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}

#endif
