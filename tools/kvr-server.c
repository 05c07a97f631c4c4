// tools/kvr-server.c - kvr behind an OpenAI-compatible HTTP API (llama-server's endpoints):
// POST /v1/chat/completions and /v1/completions (server-sent events with "stream": true),
// GET /v1/models, /health and /metrics (Prometheus text). What lives here: the HTTP side (one
// thread per connection, run by libmicrohttpd), the request parser and the JSON answers, and the
// scheduler thread that owns the model's slots.
//
// Libraries, both Debian packages: libmicrohttpd (libmicrohttpd-dev) does HTTP/1.1: parsing,
// keep-alive, chunked answers of unknown length (what SSE needs), connection limits and the
// timeout of a client that stops sending; it is GNU's small embeddable server, in Debian for
// decades, and has no dependencies we would not have. jansson (libjansson-dev) reads and writes
// the JSON: it rejects invalid UTF-8 on input and refuses to make it on output (an answer is
// always valid JSON), says where a document is malformed (line, column), and tells integers from
// reals, which a field check needs. cJSON would do the parsing too, but accepts invalid UTF-8 and
// reports only a pointer into the text.
//
// Scheduling (continuous batching): --parallel N slots, each a kvr_session with its own cache.
// The scheduler loops: admit queued requests to idle slots (the slot whose cache holds the longest
// prefix of the prompt: that much is not prefilled again; a slot swapped out to --cache-dir comes
// back first), prefill at most --chunk prompt tokens in all (one slot's next chunk at a time),
// then one decode step for every generating slot in ONE batch (kvr_session_eval_batch: one pass
// over the weights). So a stream waits between two of its tokens at most one chunk's prefill plus
// one batch step: the bound a long prompt puts on running streams. Quantized matmuls take 8-bit
// activations, as kvr-run's (--exact: f32), and a request's logits are then its solo run's bit for
// bit: a matrix in tiles (KVR_FLAG_TILED) meets every count of tokens through one kernel, and the
// others take every token of a batch through the one-token kernels (KVR_MM_ROWS), where no prefill
// piece of a longer prompt is short enough for those (KVR_ROW_TOKENS): a prompt gets kvr-run's bits. With --ranks, a prompt of at least --ranks-min uncached tokens is prefilled instead by a
// thread of its own on local ranks (kvr-run's strategies) beside the batch, and its cache handed
// to the slot through a KV cache file: the streams then wait, once, for that file's load (its
// size: the prompt's rows, no compute), and share the cores with the ranks meanwhile. A client
// that goes away (its socket hung up, or a write failed) cancels its request at the next step; its
// slot is free again. SIGTERM (or SIGINT) stops accepting, lets running requests finish (at most
// --drain seconds) and exits.
//
//   kvr-server -m MODEL.gguf [--host 127.0.0.1] [--port 8080] [-np N] [-c N] [-t N] [--chunk N]
//              [--queue N] [--api-key KEY] [--cache-dir DIR] [--swap-idle S] [--max-body BYTES]
//              [--timeout S] [--drain S] [--chat-template NAME] [--exact] [-v]

#define _GNU_SOURCE
#define KVR_BUILD
#include "kvr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SRV_MAX_STOP 4

enum req_kind { REQ_CHAT, REQ_COMPLETION };
enum req_state { RS_QUEUED, RS_RUNNING, RS_DONE };

// One completion request: made by its connection's thread, run by the scheduler, read back by
// the connection's thread. Fields below `mu` change under srv.mu only.
struct req {
    enum req_kind kind;
    bool          stream;
    int32_t     * prompt;
    int           n_prompt;
    int           max_tokens;     // -1: until the end of the turn or the context
    bool          ignore_eos;     // llama-server's: end-of-generation tokens are never sampled
    struct kvr_sampler_params sp;
    char        * stop[SRV_MAX_STOP];
    int           n_stop;
    size_t        stop_max;       // the longest stop string
    char          id[48];
    long long     created;
    int           fd;             // the client's socket (a hang-up cancels)
    double        t_arrive;
    // under srv.mu
    enum req_state state;
    char        * text;           // the generated text so far (bytes as decoded)
    size_t        len, cap;
    int           n_gen;
    int           n_cached;       // prompt tokens found in a slot's cache
    const char  * finish;         // "stop", "length"
    int           err_status;     // the scheduler failed it: HTTP status and message
    char          err[256];
    bool          cancelled;
    int           refs;
    double        t_first;        // when its first token was out (ms)
    struct req  * next;           // the queue
    // the stream's writer (its connection's thread only)
    size_t        sent;           // text bytes sent as deltas
    int           phase;          // 0 role chunk, 1 deltas, 2 [DONE] sent, 3 end
    char        * out;            // formatted SSE bytes not yet handed to libmicrohttpd
    size_t        out_len, out_off;
};

enum slot_state { SLOT_IDLE, SLOT_PREFILL, SLOT_DECODE, SLOT_HANDOFF };

struct slot {
    int                  id;
    struct kvr_session * s;
    enum slot_state      state;
    struct req         * r;
    int                  n_done;      // prompt tokens in the cache (prefill progress)
    int32_t              pending;     // the sampled token the next decode step feeds
    struct kvr_sampler   smp;
    double               t_idle;      // when it became idle (ms)
    bool                 swapped;     // its cache is in --cache-dir
    int32_t            * toks;        // a copy of the cached tokens (kept while swapped out)
    int                  n_toks;
};

struct srv {
    // options
    const char * model_path, * host, * api_key, * cache_dir, * chat_template;
    int          port, n_slots, n_ctx, n_threads, chunk, queue_max, max_body, verbose;
    int          n_ranks, ranks_min;      // --ranks, --ranks-min: long prompts prefilled on ranks
    enum kvr_strategy strategy;
    bool         q8;                      // quantized matmuls with 8-bit activations (the default; --exact: f32)
    double       timeout_s, drain_s, swap_idle_s, read_timeout_s;
    // the model
    struct kvr_model * model;
    const struct kvr_vocab * vocab;
    const char * family;
    char         model_id[256];
    struct slot * slots;
    int32_t     * eog;            // the end-of-generation tokens (ignore_eos masks them)
    int           n_eog;
    // shared state
    pthread_mutex_t mu;
    pthread_cond_t  work;         // the scheduler waits for requests
    pthread_cond_t  out;          // connection threads wait for output
    struct req    * q_head, * q_tail;
    int             q_len;
    bool            stop, draining;
    int             active_conns;
    int             live_reqs;    // requests made and not yet freed (their answers may be on the way)
    // metrics (under mu)
    long long m_requests, m_errors, m_completions, m_prompt_tokens, m_cached_tokens, m_gen_tokens, m_cancelled;
    double    m_ttft_sum;
    long long m_ttft_count, m_batch_steps, m_batch_tokens, m_swaps_out, m_swaps_in;
    pthread_t sched;
    // the parallel prefill (--ranks): one session of n_ranks local ranks, run by its own thread,
    // whose cache is handed to a slot through a KV cache file (the P/D hand-off)
    struct kvr_session * pf;
    pthread_t       pf_thread;
    pthread_cond_t  pf_cv;
    struct slot   * pf_slot;      // the slot whose prompt it prefills (NULL: idle)
    bool            pf_done;      //   finished: pf_rc, pf_err, the file pf_path
    int             pf_rc;
    char            pf_err[512];
    char            pf_path[4096];
    long long       m_handoffs;
};

static struct srv g_srv;
static volatile sig_atomic_t g_signal;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void abs_deadline(struct timespec * ts, double ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    long long ns = ts->tv_nsec + (long long)(ms * 1e6);
    ts->tv_sec += (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
}

static void logf_v(const char * fmt, ...) {
    if (!g_srv.verbose) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvr-server: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

//
// text: UTF-8 that JSON can carry
//

// The length of the complete UTF-8 sequence at s (n bytes left), 0 if invalid, -1 if cut short.
static int utf8_seq(const unsigned char * s, size_t n) {
    const unsigned c = s[0];
    int len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    if (len == 0 || (len == 2 && c < 0xc2) || (len == 4 && c > 0xf4)) return 0;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return -1;
        if ((s[i] & 0xc0) != 0x80) return 0;
    }
    if (len == 3 && ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] >= 0xa0))) return 0;
    if (len == 4 && ((c == 0xf0 && s[1] < 0x90) || (c == 0xf4 && s[1] >= 0x90))) return 0;
    return len;
}

// How many bytes of s[0, n) end on a character boundary (a sequence cut at the end waits).
static size_t utf8_complete(const char * s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const int l = utf8_seq((const unsigned char *)s + i, n - i);
        if (l < 0) break;
        i += l > 0 ? (size_t)l : 1;
    }
    return i;
}

// A JSON string of s[0, n), invalid bytes as U+FFFD (a model may end on half a character).
static json_t * json_text(const char * s, size_t n) {
    char * b = malloc(3 * n + 1);
    if (!b) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const int l = utf8_seq((const unsigned char *)s + i, n - i);
        if (l > 0) {
            memcpy(b + o, s + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else {
            memcpy(b + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    json_t * j = json_stringn(b, o);
    free(b);
    return j;
}

//
// requests: references, the queue
//

static void req_unref_locked(struct req * r) {
    if (--r->refs > 0) return;
    g_srv.live_reqs--;
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->text);
    free(r->out);
    free(r);
}

static void req_text_add(struct req * r, const char * s, size_t n) {
    if (r->len + n + 1 > r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 256;
        while (cap < r->len + n + 1) cap *= 2;
        char * t = realloc(r->text, cap);
        KVR_ASSERT(t != NULL);
        r->text = t;
        r->cap = cap;
    }
    memcpy(r->text + r->len, s, n);
    r->len += n;
    r->text[r->len] = 0;
}

// Where the first stop string starts in the text (SIZE_MAX: none).
static size_t req_stop_at(const struct req * r) {
    size_t best = SIZE_MAX;
    for (int i = 0; i < r->n_stop; i++) {
        const char * p = r->len ? memmem(r->text, r->len, r->stop[i], strlen(r->stop[i])) : NULL;
        if (p && (size_t)(p - r->text) < best) best = (size_t)(p - r->text);
    }
    return best;
}

// The text a stream may send now: not a tail that could still become a stop string, not half a
// character.
static size_t req_safe_len(const struct req * r) {
    size_t n = r->len;
    if (r->state != RS_DONE) {
        for (int i = 0; i < r->n_stop; i++) {
            const size_t sl = strlen(r->stop[i]);
            for (size_t k = sl - 1; k > 0; k--) { // the longest tail that is a start of stop i
                if (k <= r->len && memcmp(r->text + r->len - k, r->stop[i], k) == 0) {
                    if (r->len - k < n) n = r->len - k;
                    break;
                }
            }
        }
        n = utf8_complete(r->text, n);
    }
    return n;
}

//
// the scheduler
//

static void slot_finish_locked(struct slot * sl, const char * finish) {
    struct req * r = sl->r;
    r->finish = finish;
    r->state = RS_DONE;
    req_unref_locked(r);
    sl->r = NULL;
    sl->state = SLOT_IDLE;
    sl->t_idle = now_ms();
    kvr_sampler_free(&sl->smp);
    pthread_cond_broadcast(&g_srv.out);
}

static void slot_fail_locked(struct slot * sl, int status, const char * msg) {
    struct req * r = sl->r;
    r->err_status = status;
    snprintf(r->err, sizeof(r->err), "%.250s", msg);
    g_srv.m_errors++;
    slot_finish_locked(sl, "error");
}

// A token the slot sampled: its text out to the request; true when the request ends with it. The
// caller wakes the connections (g_srv.out) once for all the tokens of a step: a broadcast a token
// would wake every stream's thread once for each of them.
static bool slot_emit_locked(struct slot * sl, int32_t id) {
    struct req * r = sl->r;
    if (r->n_gen == 0) {
        r->t_first = now_ms();
        g_srv.m_ttft_sum += (r->t_first - r->t_arrive) / 1e3;
        g_srv.m_ttft_count++;
    }
    if (kvr_vocab_is_eog(g_srv.vocab, id)) {
        slot_finish_locked(sl, "stop");
        return true;
    }
    r->n_gen++;
    g_srv.m_gen_tokens++;
    char buf[256];
    int n = kvr_token_to_piece(g_srv.vocab, id, buf, sizeof(buf), false);
    if (n > 0) {
        req_text_add(r, buf, (size_t)n);
    } else if (n < 0) { // a piece longer than buf
        char * big = malloc((size_t)-n);
        if (big && (n = kvr_token_to_piece(g_srv.vocab, id, big, -n, false)) > 0) req_text_add(r, big, (size_t)n);
        free(big);
    }
    const size_t at = req_stop_at(r);
    if (at != SIZE_MAX) {
        r->len = at;
        r->text[at] = 0;
        slot_finish_locked(sl, "stop");
        return true;
    }
    if ((r->max_tokens >= 0 && r->n_gen >= r->max_tokens) || kvr_session_n_past(sl->s) + 1 > g_srv.n_ctx) {
        slot_finish_locked(sl, "length");
        return true;
    }
    sl->pending = id;
    return false;
}

static void slot_keep_tokens(struct slot * sl) {
    const int n = kvr_session_n_past(sl->s);
    int32_t * t = realloc(sl->toks, sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    KVR_ASSERT(t != NULL);
    sl->toks = t;
    if (n > 0) memcpy(t, kvr_session_tokens(sl->s), sizeof(int32_t) * (size_t)n);
    sl->n_toks = n;
}

static int common_prefix(const int32_t * a, int na, const int32_t * b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

static void slot_swap_path(const struct slot * sl, char * out, size_t cap) {
    snprintf(out, cap, "%s/slot-%d.kvc", g_srv.cache_dir, sl->id);
}

// Queued requests to idle slots, each to the slot that holds the longest prefix of its prompt
// (ties: the one idle longest). Called with mu held; the sessions are the scheduler's alone.
static void admit_locked(void) {
    while (g_srv.q_head) {
        struct req * r = g_srv.q_head;
        if (r->cancelled) {
            g_srv.q_head = r->next;
            if (!g_srv.q_head) g_srv.q_tail = NULL;
            g_srv.q_len--;
            r->state = RS_DONE;
            r->finish = "cancelled";
            req_unref_locked(r);
            continue;
        }
        struct slot * best = NULL;
        int best_len = -1;
        for (int i = 0; i < g_srv.n_slots; i++) {
            struct slot * sl = &g_srv.slots[i];
            if (sl->state != SLOT_IDLE) continue;
            const int l = common_prefix(sl->toks, sl->n_toks, r->prompt, r->n_prompt);
            if (l > best_len || (l == best_len && sl->t_idle < best->t_idle)) {
                best = sl;
                best_len = l;
            }
        }
        if (!best) return;
        g_srv.q_head = r->next;
        if (!g_srv.q_head) g_srv.q_tail = NULL;
        g_srv.q_len--;
        r->state = RS_RUNNING;
        best->r = r;
        best->state = SLOT_PREFILL;
        // at least the prompt's last token is evaluated again: its logits start the reply; with
        // 8-bit activations at least a whole piece (prefill_piece) of a longer prompt, so that the
        // bits are a one-piece prefill's (kvr-run's)
        int keep = best_len < r->n_prompt ? best_len : r->n_prompt - 1;
        if (g_srv.q8 && r->n_prompt > KVR_ROW_TOKENS && r->n_prompt - keep <= KVR_ROW_TOKENS) {
            keep = r->n_prompt - (KVR_ROW_TOKENS + 1);
        }
        if (best->swapped) {
            if (kvr_session_kv_swap_in(best->s) == KVR_OK) {
                g_srv.m_swaps_in++;
            } else { // a damaged or missing file: start from nothing (the slot goes on)
                fprintf(stderr, "kvr-server: slot %d: swap in: %s; its cache is dropped\n", best->id, kvr_last_error());
                kvr_session_reset(best->s);
                keep = 0;
            }
            best->swapped = false;
        }
        if (keep < kvr_session_n_past(best->s) && kvr_session_truncate(best->s, keep) != KVR_OK) {
            kvr_session_reset(best->s);
            keep = 0;
        }
        // a long prompt with little of it cached goes to the ranks while the pf session is free
        if (g_srv.pf && !g_srv.pf_slot && r->n_prompt - keep >= g_srv.ranks_min) {
            kvr_session_reset(best->s);
            keep = 0;
            best->state = SLOT_HANDOFF;
            g_srv.pf_slot = best;
            g_srv.pf_done = false;
            pthread_cond_signal(&g_srv.pf_cv);
        }
        best->n_done = keep;
        r->n_cached = keep;
        g_srv.m_prompt_tokens += r->n_prompt;
        g_srv.m_cached_tokens += keep;
        kvr_sampler_init(&best->smp, &r->sp);
        logf_v("slot %d: request %s, %d prompt tokens, %d cached", best->id, r->id, r->n_prompt, keep);
    }
}

// The parallel prefill's thread: a prompt on the ranks, its cache saved for the slot to load.
static void * pf_main(void * arg) {
    (void)arg;
    struct srv * S = &g_srv;
    pthread_mutex_lock(&S->mu);
    while (!S->stop) {
        if (!S->pf_slot || S->pf_done) {
            struct timespec ts;
            abs_deadline(&ts, 100.0);
            pthread_cond_timedwait(&S->pf_cv, &S->mu, &ts);
            continue;
        }
        struct req * r = S->pf_slot->r; // the slot keeps it while the hand-off runs
        pthread_mutex_unlock(&S->mu);
        const double t0 = now_ms();
        kvr_session_reset(S->pf);
        int rc = kvr_session_eval(S->pf, r->prompt, r->n_prompt) ? KVR_OK : KVR_ERR_ARG;
        if (rc == KVR_OK) rc = kvr_session_kv_save(S->pf, S->pf_path, false);
        pthread_mutex_lock(&S->mu);
        S->pf_rc = rc;
        snprintf(S->pf_err, sizeof(S->pf_err), "%s", rc == KVR_OK ? "" : kvr_last_error());
        S->pf_done = true;
        logf_v("request %s: %d prompt tokens prefilled on %d ranks (%s) in %.0f ms", r->id, r->n_prompt, S->n_ranks,
               kvr_strategy_name(S->strategy), now_ms() - t0);
        pthread_cond_signal(&S->work);
    }
    pthread_mutex_unlock(&S->mu);
    return NULL;
}

// The slot's next token from logits (ignore_eos: with every end-of-generation token masked).
static int32_t slot_sample(struct slot * sl, const float * logits, int n_vocab, float * scratch) {
    if (!sl->r->ignore_eos) return kvr_sample(&sl->smp, logits, n_vocab);
    memcpy(scratch, logits, sizeof(float) * (size_t)n_vocab);
    for (int i = 0; i < g_srv.n_eog; i++) scratch[g_srv.eog[i]] = -INFINITY;
    return kvr_sample(&sl->smp, scratch, n_vocab);
}

// The hand-off's end (mu held): the ranks' cache into the slot, which then decodes (or fails).
static void handoff_finish_locked(float * scratch, int n_vocab) {
    struct srv * S = &g_srv;
    struct slot * sl = S->pf_slot;
    int rc = S->pf_rc;
    char err[600];
    snprintf(err, sizeof(err), "%.500s", S->pf_err);
    if (rc == KVR_OK && !sl->r->cancelled) {
        rc = kvr_session_kv_load(sl->s, S->pf_path);
        if (rc != KVR_OK) snprintf(err, sizeof(err), "%.500s", kvr_last_error());
    }
    unlink(S->pf_path);
    kvr_session_interrupt(S->pf, false); // one asked for after its eval ended must not stop the next
    S->pf_slot = NULL;
    S->pf_done = false;
    if (sl->r->cancelled) {
        S->m_cancelled++;
        kvr_session_reset(sl->s);
        slot_keep_tokens(sl);
        slot_finish_locked(sl, "cancelled");
        return;
    }
    if (rc != KVR_OK) {
        char msg[700];
        snprintf(msg, sizeof(msg), "prefill on %d ranks failed: %s", S->n_ranks, err);
        kvr_session_reset(sl->s);
        slot_keep_tokens(sl);
        slot_fail_locked(sl, 500, msg);
        return;
    }
    S->m_handoffs++;
    sl->n_done = sl->r->n_prompt;
    sl->state = SLOT_DECODE;
    const int32_t id = slot_sample(sl, kvr_session_logits(sl->s), n_vocab, scratch);
    if (slot_emit_locked(sl, id)) slot_keep_tokens(sl);
    pthread_cond_broadcast(&g_srv.out);
}

// The tokens of a slot's next prefill piece, `rest` of its prompt left and `budget` of this step's
// --chunk: at most the budget; 0 to wait for the next step. With 8-bit activations a piece of at
// most KVR_ROW_TOKENS tokens takes the decode kernels, which sum otherwise than the prefill ones:
// so no piece of a longer rest is that short (the last one is left longer, a short budget waits
// for a whole step), and each token gets kvr-run's bits, whose prefill is one piece. A --chunk
// under 2 (KVR_ROW_TOKENS + 1) may still end a long prompt with a short piece.
static int prefill_piece(int rest, int budget) {
    int n = rest < budget ? rest : budget;
    if (!g_srv.q8 || n == rest) return n;
    if (rest - n <= KVR_ROW_TOKENS) n = rest - (KVR_ROW_TOKENS + 1);
    if (n <= KVR_ROW_TOKENS) return budget < g_srv.chunk ? 0 : budget;
    return n;
}

static void * sched_main(void * arg) {
    (void)arg;
    struct srv * S = &g_srv;
    struct kvr_session ** group = malloc(sizeof(*group) * (size_t)S->n_slots);
    struct slot ** gslot = malloc(sizeof(*gslot) * (size_t)S->n_slots);
    int32_t * gtok = malloc(sizeof(int32_t) * (size_t)S->n_slots);
    int * grc = malloc(sizeof(int) * (size_t)S->n_slots); // each slot's decode: KVR_OK or an error
    KVR_ASSERT(group && gslot && gtok && grc);
    const int n_vocab = kvr_vocab_n_tokens(S->vocab);
    float * scratch = malloc(sizeof(float) * (size_t)n_vocab);
    KVR_ASSERT(scratch != NULL);
    pthread_mutex_lock(&S->mu);
    while (!S->stop) {
        // a finished hand-off goes on in its slot; a cancelled one stops the ranks
        if (S->pf_slot && S->pf_done) handoff_finish_locked(scratch, n_vocab);
        if (S->pf_slot && S->pf_slot->r->cancelled) kvr_session_interrupt(S->pf, true);
        // cancelled requests free their slots
        for (int i = 0; i < S->n_slots; i++) {
            struct slot * sl = &S->slots[i];
            if (sl->state != SLOT_IDLE && sl->state != SLOT_HANDOFF && sl->r->cancelled) {
                logf_v("slot %d: request %s cancelled (its client went away)", sl->id, sl->r->id);
                S->m_cancelled++;
                slot_keep_tokens(sl);
                slot_finish_locked(sl, "cancelled");
            }
        }
        admit_locked();
        bool busy = false, work = false;
        for (int i = 0; i < S->n_slots; i++) {
            busy |= S->slots[i].state != SLOT_IDLE;
            work |= S->slots[i].state == SLOT_PREFILL || S->slots[i].state == SLOT_DECODE;
        }
        if (busy && !work) { // only a hand-off runs: wait for it
            struct timespec ts;
            abs_deadline(&ts, 100.0);
            pthread_cond_timedwait(&S->work, &S->mu, &ts);
            continue;
        }
        if (!busy) {
            // idle slots' caches out to files after --swap-idle seconds
            if (S->cache_dir) {
                for (int i = 0; i < S->n_slots; i++) {
                    struct slot * sl = &S->slots[i];
                    if (sl->swapped || sl->n_toks == 0 || now_ms() - sl->t_idle < S->swap_idle_s * 1e3) continue;
                    char path[4096];
                    slot_swap_path(sl, path, sizeof(path));
                    if (kvr_session_kv_swap_out(sl->s, path) == KVR_OK) {
                        sl->swapped = true;
                        S->m_swaps_out++;
                        logf_v("slot %d: %d cached tokens swapped out to %s", sl->id, sl->n_toks, path);
                    } else {
                        fprintf(stderr, "kvr-server: slot %d: swap out: %s\n", sl->id, kvr_last_error());
                    }
                }
            }
            struct timespec ts;
            abs_deadline(&ts, 100.0);
            pthread_cond_timedwait(&S->work, &S->mu, &ts);
            continue;
        }
        pthread_mutex_unlock(&S->mu);

        // prefill: at most --chunk prompt tokens this step, a slot's next chunk at a time
        int budget = S->chunk;
        for (int i = 0; i < S->n_slots && budget > 0; i++) {
            struct slot * sl = &S->slots[i];
            if (sl->state != SLOT_PREFILL) continue;
            struct req * r = sl->r; // the slot's reference keeps it
            const int n = prefill_piece(r->n_prompt - sl->n_done, budget);
            if (n == 0) continue;
            const float * lg = kvr_session_eval(sl->s, r->prompt + sl->n_done, n);
            pthread_mutex_lock(&S->mu);
            if (!lg) {
                char msg[256];
                snprintf(msg, sizeof(msg), "prefill failed: %s", kvr_last_error());
                kvr_session_reset(sl->s);
                slot_keep_tokens(sl);
                slot_fail_locked(sl, 500, msg);
            } else {
                budget -= n;
                sl->n_done += n;
                if (sl->n_done == r->n_prompt) {
                    sl->state = SLOT_DECODE;
                    const int32_t id = slot_sample(sl, lg, n_vocab, scratch);
                    if (slot_emit_locked(sl, id)) slot_keep_tokens(sl);
                    pthread_cond_broadcast(&S->out);
                }
            }
            pthread_mutex_unlock(&S->mu);
        }

        // decode: the next token of every generating slot, in one batch
        int n = 0;
        for (int i = 0; i < S->n_slots; i++) {
            struct slot * sl = &S->slots[i];
            if (sl->state != SLOT_DECODE) continue;
            gslot[n] = sl;
            group[n] = sl->s;
            gtok[n] = sl->pending;
            n++;
        }
        if (n > 0) {
            // one sequence alone goes through its session's kept decode graph (the same result)
            if (n > 1) {
                const int rc = kvr_session_eval_batch(group, gtok, n);
                for (int j = 0; j < n; j++) grc[j] = rc;
            } else {
                for (int j = 0; j < n; j++) grc[j] = kvr_session_eval(group[j], &gtok[j], 1) ? KVR_OK : KVR_ERR_ARG;
            }
            pthread_mutex_lock(&S->mu);
            S->m_batch_steps++;
            S->m_batch_tokens += n;
            for (int j = 0; j < n; j++) {
                struct slot * sl = gslot[j];
                if (grc[j] != KVR_OK) {
                    char msg[256];
                    snprintf(msg, sizeof(msg), "decode failed: %s", kvr_last_error());
                    slot_keep_tokens(sl);
                    slot_fail_locked(sl, 500, msg);
                    continue;
                }
                const int32_t id = slot_sample(sl, kvr_session_logits(sl->s), n_vocab, scratch);
                if (slot_emit_locked(sl, id)) slot_keep_tokens(sl);
            }
            pthread_cond_broadcast(&S->out);
            pthread_mutex_unlock(&S->mu);
        }
        pthread_mutex_lock(&S->mu);
    }
    pthread_mutex_unlock(&S->mu);
    free(group);
    free(gslot);
    free(grc);
    free(gtok);
    free(scratch);
    return NULL;
}

//
// HTTP: answers
//

static enum MHD_Result send_text(struct MHD_Connection * c, unsigned status, const char * type, char * body, size_t n) {
    struct MHD_Response * resp = MHD_create_response_from_buffer(n, body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", type);
    const enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection * c, unsigned status, json_t * j) {
    char * s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!s) return MHD_NO;
    return send_text(c, status, "application/json", s, strlen(s));
}

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}}.
static enum MHD_Result send_error(struct MHD_Connection * c, unsigned status, const char * param, const char * fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum MHD_Result send_error(struct MHD_Connection * c, unsigned status, const char * param, const char * fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    const char * type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error" :
                        status == 503 ? "server_overloaded" : status >= 500 ? "server_error" : "invalid_request_error";
    pthread_mutex_lock(&g_srv.mu);
    g_srv.m_errors++;
    pthread_mutex_unlock(&g_srv.mu);
    json_t * e = json_pack("{s:{s:o,s:s,s:o,s:i}}", "error", "message", json_text(msg, strlen(msg)), "type", type,
                           "param", param ? json_string(param) : json_null(), "code", (int)status);
    return send_json(c, status, e);
}

static json_t * usage_json(const struct req * r) {
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", r->n_prompt, "completion_tokens", r->n_gen,
                     "total_tokens", r->n_prompt + r->n_gen, "prompt_tokens_details", "cached_tokens", r->n_cached);
}

// The whole answer of a finished request (mu held).
static json_t * answer_json(const struct req * r) {
    json_t * text = json_text(r->text ? r->text : "", r->len);
    json_t * choice = r->kind == REQ_CHAT
        ? json_pack("{s:i,s:{s:s,s:o},s:s,s:n}", "index", 0, "message", "role", "assistant", "content", text,
                    "finish_reason", r->finish, "logprobs")
        : json_pack("{s:i,s:o,s:s,s:n}", "index", 0, "text", text, "finish_reason", r->finish, "logprobs");
    return json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o}", "id", r->id,
                     "object", r->kind == REQ_CHAT ? "chat.completion" : "text_completion", "created", (json_int_t)r->created,
                     "model", g_srv.model_id, "choices", choice, "usage", usage_json(r));
}

// One SSE event of a stream: a delta of text (NULL: the role chunk) or, with finish, the last one.
static char * sse_chunk(const struct req * r, const char * delta, size_t n, const char * finish) {
    json_t * choice;
    if (r->kind == REQ_CHAT) {
        json_t * d = finish ? json_object() : delta ? json_pack("{s:o}", "content", json_text(delta, n))
                                                    : json_pack("{s:s,s:s}", "role", "assistant", "content", "");
        choice = json_pack("{s:i,s:o,s:o,s:n}", "index", 0, "delta", d, "finish_reason", finish ? json_string(finish) : json_null(),
                           "logprobs");
    } else {
        choice = json_pack("{s:i,s:o,s:o,s:n}", "index", 0, "text", json_text(delta ? delta : "", delta ? n : 0),
                           "finish_reason", finish ? json_string(finish) : json_null(), "logprobs");
    }
    json_t * j = json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", r->id,
                           "object", r->kind == REQ_CHAT ? "chat.completion.chunk" : "text_completion",
                           "created", (json_int_t)r->created, "model", g_srv.model_id, "choices", choice);
    if (finish) json_object_set_new(j, "usage", usage_json(r));
    char * s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!s) return NULL;
    char * out = NULL;
    if (asprintf(&out, "data: %s\n\n", s) < 0) out = NULL;
    free(s);
    return out;
}

// Whether the client's side of the socket hung up.
static bool client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

static ssize_t stream_reader(void * cls, uint64_t pos, char * buf, size_t max) {
    (void)pos;
    struct req * r = cls;
    if (r->out_off < r->out_len) { // what did not fit last time
        const size_t n = r->out_len - r->out_off < max ? r->out_len - r->out_off : max;
        memcpy(buf, r->out + r->out_off, n);
        r->out_off += n;
        return (ssize_t)n;
    }
    if (r->phase == 3) return MHD_CONTENT_READER_END_OF_STREAM;
    char * ev = NULL;
    const double t_end = now_ms() + g_srv.timeout_s * 1e3;
    pthread_mutex_lock(&g_srv.mu);
    for (;;) {
        if (r->phase == 0) {
            r->phase = 1;
            if (r->kind == REQ_CHAT) { ev = sse_chunk(r, NULL, 0, NULL); break; }
        }
        if (r->phase == 2) {
            ev = strdup("data: [DONE]\n\n");
            r->phase = 3;
            break;
        }
        if (r->state == RS_DONE && r->err_status) {
            json_t * e = json_pack("{s:{s:s,s:s}}", "error", "message", r->err, "type", "server_error");
            char * s = json_dumps(e, JSON_COMPACT);
            json_decref(e);
            if (s && asprintf(&ev, "data: %s\n\n", s) < 0) ev = NULL;
            free(s);
            r->phase = 2;
            break;
        }
        const size_t safe = req_safe_len(r);
        if (safe > r->sent) {
            ev = sse_chunk(r, r->text + r->sent, safe - r->sent, NULL);
            r->sent = safe;
            break;
        }
        if (r->state == RS_DONE) {
            ev = sse_chunk(r, NULL, 0, r->finish ? r->finish : "stop");
            r->phase = 2;
            break;
        }
        if (client_gone(r->fd) || now_ms() > t_end || g_srv.stop) {
            r->cancelled = true;
            pthread_cond_signal(&g_srv.work);
            pthread_mutex_unlock(&g_srv.mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        struct timespec ts;
        abs_deadline(&ts, 50.0);
        pthread_cond_timedwait(&g_srv.out, &g_srv.mu, &ts);
    }
    pthread_mutex_unlock(&g_srv.mu);
    if (!ev) return MHD_CONTENT_READER_END_WITH_ERROR;
    free(r->out);
    r->out = ev;
    r->out_len = strlen(ev);
    r->out_off = 0;
    const size_t n = r->out_len < max ? r->out_len : max;
    memcpy(buf, r->out, n);
    r->out_off = n;
    return (ssize_t)n;
}

static void stream_free(void * cls) {
    struct req * r = cls;
    pthread_mutex_lock(&g_srv.mu);
    if (r->state != RS_DONE) r->cancelled = true;
    pthread_cond_signal(&g_srv.work);
    req_unref_locked(r);
    pthread_mutex_unlock(&g_srv.mu);
}

//
// HTTP: requests
//

struct conn {
    char * body;
    size_t len;
    bool   too_big;
};

// The request's fields, checked; NULL after an error answer was queued (*ret).
static struct req * parse_request(struct MHD_Connection * c, enum req_kind kind, const struct conn * cn, enum MHD_Result * ret) {
    json_error_t jerr;
    json_t * root = json_loadb(cn->body ? cn->body : "", cn->len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        *ret = send_error(c, 400, NULL, "the body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
        return NULL;
    }
    struct req * r = calloc(1, sizeof(*r));
    KVR_ASSERT(r != NULL);
    r->kind = kind;
    r->max_tokens = -1;
    r->sp.temp = 1.0f;
    r->sp.top_p = 1.0f;
    r->sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)r << 16);
    r->refs = 1;
    r->fd = -1;
    pthread_mutex_lock(&g_srv.mu);
    g_srv.live_reqs++;
    pthread_mutex_unlock(&g_srv.mu);
    const char * bad = NULL;      // the field that is wrong
    char why[512] = "";
#define BAD(field, ...) do { bad = field; snprintf(why, sizeof(why), __VA_ARGS__); goto fail; } while (0)
    if (!json_is_object(root)) BAD(NULL, "the body must be a JSON object");
    json_t * v;
    if ((v = json_object_get(root, "stream")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) BAD("stream", "'stream' must be true or false");
        r->stream = json_is_true(v);
    }
    v = json_object_get(root, "max_tokens");
    if (!v || json_is_null(v)) v = json_object_get(root, "max_completion_tokens");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1 << 24) {
            BAD("max_tokens", "'max_tokens' must be an integer from 1 to %d", 1 << 24);
        }
        r->max_tokens = (int)json_integer_value(v);
    }
    if ((v = json_object_get(root, "temperature")) && !json_is_null(v)) {
        if (!json_is_number(v) || json_number_value(v) < 0 || json_number_value(v) > 2) BAD("temperature", "'temperature' must be a number from 0 to 2");
        r->sp.temp = (float)json_number_value(v);
    }
    if ((v = json_object_get(root, "top_p")) && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > 1) BAD("top_p", "'top_p' must be a number in (0, 1]");
        r->sp.top_p = (float)json_number_value(v);
    }
    if ((v = json_object_get(root, "top_k")) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1 << 24) BAD("top_k", "'top_k' must be an integer >= 0");
        r->sp.top_k = (int)json_integer_value(v);
    }
    if ((v = json_object_get(root, "seed")) && !json_is_null(v)) {
        if (!json_is_integer(v)) BAD("seed", "'seed' must be an integer");
        r->sp.seed = (uint64_t)json_integer_value(v);
    }
    if ((v = json_object_get(root, "ignore_eos")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) BAD("ignore_eos", "'ignore_eos' must be true or false");
        r->ignore_eos = json_is_true(v);
    }
    if ((v = json_object_get(root, "n")) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) != 1) BAD("n", "'n' must be 1 (one choice per request)");
    }
    if ((v = json_object_get(root, "stop")) && !json_is_null(v)) {
        if (json_is_string(v)) {
            if (json_string_length(v) == 0) BAD("stop", "a stop string must not be empty");
            r->stop[r->n_stop++] = strdup(json_string_value(v));
        } else if (json_is_array(v) && json_array_size(v) <= SRV_MAX_STOP) {
            size_t i;
            json_t * e;
            json_array_foreach(v, i, e) {
                if (!json_is_string(e) || json_string_length(e) == 0) BAD("stop", "'stop' must hold non-empty strings");
                r->stop[r->n_stop++] = strdup(json_string_value(e));
            }
        } else {
            BAD("stop", "'stop' must be a string or an array of at most %d strings", SRV_MAX_STOP);
        }
    }
    // the prompt's tokens
    int n = -1;
    if (kind == REQ_CHAT) {
        json_t * msgs = json_object_get(root, "messages");
        if (!json_is_array(msgs) || json_array_size(msgs) == 0) BAD("messages", "'messages' must be a non-empty array");
        const size_t nm = json_array_size(msgs);
        if (nm > 4096) BAD("messages", "at most 4096 messages");
        struct kvr_chat_message * cm = calloc(nm, sizeof(*cm));
        char ** owned = calloc(nm, sizeof(char *));
        KVR_ASSERT(cm && owned);
        for (size_t i = 0; i < nm && !bad; i++) {
            json_t * m = json_array_get(msgs, i);
            json_t * role = json_object_get(m, "role"), * content = json_object_get(m, "content");
            if (!json_is_object(m) || !json_is_string(role)) {
                bad = "messages";
                snprintf(why, sizeof(why), "messages[%zu] must be an object with a string 'role'", i);
                break;
            }
            const char * rs = json_string_value(role);
            if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "developer")) {
                bad = "messages";
                snprintf(why, sizeof(why), "messages[%zu].role '%.40s' is not system, developer, user or assistant", i, rs);
                break;
            }
            cm[i].role = strcmp(rs, "developer") == 0 ? "system" : rs;
            if (json_is_string(content)) {
                cm[i].content = json_string_value(content);
            } else if (json_is_array(content)) { // parts: the text ones, joined
                size_t len = 0, k;
                json_t * part;
                json_array_foreach(content, k, part) {
                    json_t * t = json_object_get(part, "text");
                    if (!json_is_string(t)) { bad = "messages"; break; }
                    len += json_string_length(t);
                }
                if (bad) { snprintf(why, sizeof(why), "messages[%zu].content: only text parts are supported", i); break; }
                owned[i] = calloc(len + 1, 1);
                KVR_ASSERT(owned[i] != NULL);
                json_array_foreach(content, k, part) strcat(owned[i], json_string_value(json_object_get(part, "text")));
                cm[i].content = owned[i];
            } else {
                bad = "messages";
                snprintf(why, sizeof(why), "messages[%zu].content must be a string or an array of text parts", i);
                break;
            }
        }
        if (!bad) {
            n = kvr_chat_tokenize(g_srv.vocab, g_srv.family, cm, (int)nm, true, kvr_vocab_add_bos(g_srv.vocab), false, NULL, 0);
            if (n > 0 && n < g_srv.n_ctx) {
                r->prompt = malloc(sizeof(int32_t) * (size_t)n);
                KVR_ASSERT(r->prompt != NULL);
                if (kvr_chat_tokenize(g_srv.vocab, g_srv.family, cm, (int)nm, true, kvr_vocab_add_bos(g_srv.vocab), false, r->prompt, n) != n) n = -1;
            } else if (n < 0) {
                bad = "messages";
                snprintf(why, sizeof(why), "the messages cannot be rendered: %s", kvr_last_error());
            }
        }
        for (size_t i = 0; i < nm; i++) free(owned[i]);
        free(owned);
        free(cm);
        if (bad) goto fail;
    } else {
        json_t * p = json_object_get(root, "prompt");
        if (json_is_array(p) && json_array_size(p) == 1) p = json_array_get(p, 0);
        if (!json_is_string(p)) BAD("prompt", "'prompt' must be a string (or an array of one string)");
        const char * text = json_string_value(p);
        if (strlen(text) != json_string_length(p)) BAD("prompt", "'prompt' must not hold a NUL character");
        n = kvr_tokenize(g_srv.vocab, text, NULL, 0, kvr_vocab_add_bos(g_srv.vocab), true);
        if (n > 0 && n < g_srv.n_ctx) {
            r->prompt = malloc(sizeof(int32_t) * (size_t)n);
            KVR_ASSERT(r->prompt != NULL);
            if (kvr_tokenize(g_srv.vocab, text, r->prompt, n, kvr_vocab_add_bos(g_srv.vocab), true) != n) n = -1;
        }
    }
    if (n == 0) BAD(kind == REQ_CHAT ? "messages" : "prompt", "the prompt is empty");
    if (n < 0) BAD(kind == REQ_CHAT ? "messages" : "prompt", "the prompt cannot be tokenized: %s", kvr_last_error());
    if (n >= g_srv.n_ctx) {
        BAD(kind == REQ_CHAT ? "messages" : "prompt", "the prompt has %d tokens; the context holds %d (one more is needed for the reply)", n, g_srv.n_ctx);
    }
    r->n_prompt = n;
#undef BAD
    json_decref(root);
    return r;
fail:
    json_decref(root);
    pthread_mutex_lock(&g_srv.mu);
    req_unref_locked(r);
    pthread_mutex_unlock(&g_srv.mu);
    *ret = send_error(c, 400, bad, "%s", why);
    return NULL;
}

static enum MHD_Result handle_completion(struct MHD_Connection * c, enum req_kind kind, struct conn * cn) {
    if (cn->too_big) return send_error(c, 413, NULL, "the body is larger than %d bytes (--max-body)", g_srv.max_body);
    enum MHD_Result ret = MHD_NO;
    struct req * r = parse_request(c, kind, cn, &ret);
    if (!r) return ret;
    static atomic_llong counter;
    snprintf(r->id, sizeof(r->id), "%s-%lld", kind == REQ_CHAT ? "chatcmpl" : "cmpl", (long long)atomic_fetch_add(&counter, 1));
    r->created = (long long)time(NULL);
    r->t_arrive = now_ms();
    // the body is in: from here on the connection waits for us, not for the client (a long prefill
    // must not look like a silent client)
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned int)(g_srv.timeout_s + 60));
    const union MHD_ConnectionInfo * ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;
    pthread_mutex_lock(&g_srv.mu);
    if (g_srv.draining || g_srv.q_len >= g_srv.queue_max) {
        const bool draining = g_srv.draining;
        req_unref_locked(r);
        pthread_mutex_unlock(&g_srv.mu);
        return send_error(c, 503, NULL, draining ? "the server is shutting down" : "the queue is full (%d waiting; --queue)", g_srv.queue_max);
    }
    g_srv.m_completions++;
    r->refs = 2; // the scheduler's, and this connection's
    if (g_srv.q_tail) g_srv.q_tail->next = r;
    else g_srv.q_head = r;
    g_srv.q_tail = r;
    g_srv.q_len++;
    pthread_cond_signal(&g_srv.work);
    if (r->stream) {
        pthread_mutex_unlock(&g_srv.mu);
        struct MHD_Response * resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, r, stream_free);
        if (!resp) {
            stream_free(r);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    // not streamed: wait for the end, watching the client's socket
    const double t_end = now_ms() + g_srv.timeout_s * 1e3;
    while (r->state != RS_DONE) {
        if (client_gone(r->fd) || now_ms() > t_end || g_srv.stop) {
            r->cancelled = true;
            pthread_cond_signal(&g_srv.work);
            const bool late = now_ms() > t_end;
            req_unref_locked(r);
            pthread_mutex_unlock(&g_srv.mu);
            return late ? send_error(c, 503, NULL, "the request took longer than %g s (--timeout)", g_srv.timeout_s) : MHD_NO;
        }
        struct timespec ts;
        abs_deadline(&ts, 50.0);
        pthread_cond_timedwait(&g_srv.out, &g_srv.mu, &ts);
    }
    json_t * ans = r->err_status ? NULL : answer_json(r);
    const int status = r->err_status;
    char err[256];
    snprintf(err, sizeof(err), "%s", r->err);
    req_unref_locked(r);
    pthread_mutex_unlock(&g_srv.mu);
    if (status) return send_error(c, (unsigned)status, NULL, "%s", err);
    return send_json(c, 200, ans);
}

static enum MHD_Result handle_metrics(struct MHD_Connection * c) {
    struct srv * S = &g_srv;
    char * body = NULL;
    size_t len = 0;
    FILE * f = open_memstream(&body, &len);
    if (!f) return MHD_NO;
    pthread_mutex_lock(&S->mu);
    int busy = 0, swapped = 0;
    long long cached = 0;
    for (int i = 0; i < S->n_slots; i++) {
        busy += S->slots[i].state != SLOT_IDLE;
        swapped += S->slots[i].swapped;
        cached += S->slots[i].swapped ? 0 : S->slots[i].n_toks;
    }
    fprintf(f, "# HELP kvr_requests_total HTTP requests received.\n# TYPE kvr_requests_total counter\nkvr_requests_total %lld\n", S->m_requests);
    fprintf(f, "# HELP kvr_request_errors_total Requests answered with an error.\n# TYPE kvr_request_errors_total counter\nkvr_request_errors_total %lld\n", S->m_errors);
    fprintf(f, "# HELP kvr_completions_total Completion requests queued.\n# TYPE kvr_completions_total counter\nkvr_completions_total %lld\n", S->m_completions);
    fprintf(f, "# HELP kvr_cancelled_total Requests whose client went away.\n# TYPE kvr_cancelled_total counter\nkvr_cancelled_total %lld\n", S->m_cancelled);
    fprintf(f, "# HELP kvr_prompt_tokens_total Prompt tokens of admitted requests.\n# TYPE kvr_prompt_tokens_total counter\nkvr_prompt_tokens_total %lld\n", S->m_prompt_tokens);
    fprintf(f, "# HELP kvr_prompt_tokens_cached_total Prompt tokens found in a slot's cache (not prefilled).\n# TYPE kvr_prompt_tokens_cached_total counter\nkvr_prompt_tokens_cached_total %lld\n", S->m_cached_tokens);
    fprintf(f, "# HELP kvr_generated_tokens_total Tokens generated.\n# TYPE kvr_generated_tokens_total counter\nkvr_generated_tokens_total %lld\n", S->m_gen_tokens);
    fprintf(f, "# HELP kvr_time_to_first_token_seconds Arrival to first token.\n# TYPE kvr_time_to_first_token_seconds summary\n"
               "kvr_time_to_first_token_seconds_sum %.6f\nkvr_time_to_first_token_seconds_count %lld\n", S->m_ttft_sum, S->m_ttft_count);
    fprintf(f, "# HELP kvr_batch_steps_total Decode steps (one batch each).\n# TYPE kvr_batch_steps_total counter\nkvr_batch_steps_total %lld\n", S->m_batch_steps);
    fprintf(f, "# HELP kvr_batch_tokens_total Tokens decoded in batches.\n# TYPE kvr_batch_tokens_total counter\nkvr_batch_tokens_total %lld\n", S->m_batch_tokens);
    fprintf(f, "# HELP kvr_queue_depth Requests waiting for a slot.\n# TYPE kvr_queue_depth gauge\nkvr_queue_depth %d\n", S->q_len);
    fprintf(f, "# HELP kvr_slots_busy Slots running a request.\n# TYPE kvr_slots_busy gauge\nkvr_slots_busy %d\n", busy);
    fprintf(f, "# HELP kvr_slots_total Slots (--parallel).\n# TYPE kvr_slots_total gauge\nkvr_slots_total %d\n", S->n_slots);
    fprintf(f, "# HELP kvr_cache_tokens Tokens held in the slots' caches in memory (idle slots' as last kept).\n# TYPE kvr_cache_tokens gauge\nkvr_cache_tokens %lld\n", cached);
    fprintf(f, "# HELP kvr_cache_tokens_capacity Tokens the slots' caches can hold.\n# TYPE kvr_cache_tokens_capacity gauge\nkvr_cache_tokens_capacity %lld\n", (long long)S->n_slots * S->n_ctx);
    fprintf(f, "# HELP kvr_handoffs_total Prompts prefilled on --ranks and handed to a slot.\n# TYPE kvr_handoffs_total counter\nkvr_handoffs_total %lld\n", S->m_handoffs);
    fprintf(f, "# HELP kvr_slots_swapped Idle slots whose cache is in --cache-dir.\n# TYPE kvr_slots_swapped gauge\nkvr_slots_swapped %d\n", swapped);
    fprintf(f, "# HELP kvr_swaps_total Caches swapped out and in.\n# TYPE kvr_swaps_total counter\nkvr_swaps_total{dir=\"out\"} %lld\nkvr_swaps_total{dir=\"in\"} %lld\n", S->m_swaps_out, S->m_swaps_in);
    pthread_mutex_unlock(&S->mu);
    fclose(f);
    return send_text(c, 200, "text/plain; version=0.0.4", body, len);
}

static enum MHD_Result on_request(void * cls, struct MHD_Connection * c, const char * url, const char * method,
                                  const char * version, const char * upload, size_t * upload_size, void ** con_cls) {
    (void)cls;
    (void)version;
    struct conn * cn = *con_cls;
    if (!cn) {
        cn = calloc(1, sizeof(*cn));
        if (!cn) return MHD_NO;
        *con_cls = cn;
        pthread_mutex_lock(&g_srv.mu);
        g_srv.m_requests++;
        pthread_mutex_unlock(&g_srv.mu);
        return MHD_YES;
    }
    if (*upload_size > 0) { // the body, in pieces; past the limit it is dropped and refused at the end
        if (!cn->too_big && cn->len + *upload_size <= (size_t)g_srv.max_body) {
            char * b = realloc(cn->body, cn->len + *upload_size + 1);
            if (!b) return MHD_NO;
            cn->body = b;
            memcpy(cn->body + cn->len, upload, *upload_size);
            cn->len += *upload_size;
        } else {
            cn->too_big = true;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    const bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
    if (strcmp(url, "/health") == 0) {
        if (!get) return send_error(c, 405, NULL, "%s %s: use GET", method, url);
        return send_json(c, 200, json_pack("{s:s}", "status", "ok"));
    }
    if (strcmp(url, "/metrics") == 0) {
        if (!get) return send_error(c, 405, NULL, "%s %s: use GET", method, url);
        return handle_metrics(c);
    }
    if (g_srv.api_key) {
        const char * auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
        if (!auth || strncmp(auth, "Bearer ", 7) != 0 || strcmp(auth + 7, g_srv.api_key) != 0) {
            return send_error(c, 401, NULL, "invalid or missing API key (Authorization: Bearer KEY)");
        }
    }
    if (strcmp(url, "/v1/models") == 0 || strcmp(url, "/models") == 0) {
        if (!get) return send_error(c, 405, NULL, "%s %s: use GET", method, url);
        return send_json(c, 200, json_pack("{s:s,s:[{s:s,s:s,s:I,s:s}]}", "object", "list", "data", "id", g_srv.model_id,
                                            "object", "model", "created", (json_int_t)time(NULL), "owned_by", "kvr"));
    }
    const bool chat = strcmp(url, "/v1/chat/completions") == 0 || strcmp(url, "/chat/completions") == 0;
    const bool cmpl = strcmp(url, "/v1/completions") == 0 || strcmp(url, "/completions") == 0;
    if (chat || cmpl) {
        if (!post) return send_error(c, 405, NULL, "%s %s: use POST", method, url);
        return handle_completion(c, chat ? REQ_CHAT : REQ_COMPLETION, cn);
    }
    return send_error(c, 404, NULL, "no such endpoint: %s %s", method, url);
}

static void on_completed(void * cls, struct MHD_Connection * c, void ** con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)c;
    (void)toe;
    struct conn * cn = *con_cls;
    if (!cn) return;
    free(cn->body);
    free(cn);
    *con_cls = NULL;
}

static void on_connection(void * cls, struct MHD_Connection * c, void ** socket_ctx, enum MHD_ConnectionNotificationCode code) {
    (void)cls;
    (void)c;
    (void)socket_ctx;
    pthread_mutex_lock(&g_srv.mu);
    g_srv.active_conns += code == MHD_CONNECTION_NOTIFY_STARTED ? 1 : -1;
    pthread_mutex_unlock(&g_srv.mu);
}

//
// main: options, the model and slots, the daemon, the drain
//

static void on_signal(int sig) { g_signal = sig; }

static void usage(FILE * f) {
    fprintf(f,
        "usage: kvr-server -m MODEL.gguf [options]\n"
        "  -m, --model PATH       the GGUF model\n"
        "  --host ADDR            IPv4 address to listen on (default 127.0.0.1)\n"
        "  --port N               TCP port (default 8080; 0: any free one, printed)\n"
        "  -np, --parallel N      slots: requests served at once, decoded in one batch (default 4)\n"
        "  -c, --ctx-size N       context of each slot in tokens (default 4096)\n"
        "  -t, --threads N        CPU threads of a step (default: all cores)\n"
        "  --chunk N              prompt tokens prefilled between two decode steps (default 256)\n"
        "  --ranks N              prefill long prompts on N local ranks beside the batch (default 1: off)\n"
        "  --strategy S           ... with this strategy (kvr-run's: tsp, kvr, ring-kv, ring-q, auto; default kvr)\n"
        "  --ranks-min N          ... when at least N prompt tokens are not cached (default 1024)\n"
        "  --queue N              requests that may wait for a slot; more get 503 (default 64)\n"
        "  --api-key KEY          require Authorization: Bearer KEY on /v1/*\n"
        "  --cache-dir DIR        swap idle slots' caches out to files in DIR\n"
        "  --swap-idle S          ... after S seconds idle (default 10)\n"
        "  --max-body BYTES       largest request body (default 1048576)\n"
        "  --read-timeout S       a client silent this long is dropped (default 30)\n"
        "  --timeout S            longest a request may run (default 600)\n"
        "  --drain S              on SIGTERM, time left to running requests (default 30)\n"
        "  --chat-template NAME   the chat template family instead of the model's\n"
        "  --exact                quantized weights in exact arithmetic: f32 activations times the weights'\n"
        "                         exact values (the CPU reference; about half the speed of the default)\n"
        "  --q8-act               the default, as kvr-run's: 8-bit activations and integer products, as\n"
        "                         llama.cpp does. Either way a request's tokens are those of its solo run\n"
        "  -v, --verbose          log requests and slots on stderr\n");
}

static int parse_int(const char * flag, const char * v, int lo, int hi, int * out) {
    char * end;
    errno = 0;
    const long x = v ? strtol(v, &end, 10) : 0;
    if (!v || errno || *end || end == v || x < lo || x > hi) {
        fprintf(stderr, "kvr-server: %s takes an integer from %d to %d, not '%s'\n", flag, lo, hi, v ? v : "");
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_num(const char * flag, const char * v, double lo, double hi, double * out) {
    char * end;
    const double x = v ? strtod(v, &end) : 0;
    if (!v || *end || end == v || !(x >= lo && x <= hi)) {
        fprintf(stderr, "kvr-server: %s takes a number from %g to %g, not '%s'\n", flag, lo, hi, v ? v : "");
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_args(int argc, char ** argv) {
    struct srv * S = &g_srv;
    S->host = "127.0.0.1";
    S->port = 8080;
    S->n_slots = 4;
    S->n_ctx = 4096;
    S->chunk = 256;
    S->queue_max = 64;
    S->max_body = 1 << 20;
    S->timeout_s = 600;
    S->drain_s = 30;
    S->swap_idle_s = 10;
    S->read_timeout_s = 30;
    S->n_ranks = 1;
    S->ranks_min = 1024;
    S->strategy = KVR_STRATEGY_KVR;
    bool exact_named = false, q8_named = false;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        bool takes = true;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) S->model_path = v;
        else if (!strcmp(a, "--host")) S->host = v;
        else if (!strcmp(a, "--port")) rc = parse_int(a, v, 0, 65535, &S->port);
        else if (!strcmp(a, "-np") || !strcmp(a, "--parallel")) rc = parse_int(a, v, 1, KVR_BATCH_MAX, &S->n_slots);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) rc = parse_int(a, v, 8, 1 << 20, &S->n_ctx);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) rc = parse_int(a, v, 1, KVR_MAX_THREADS, &S->n_threads);
        else if (!strcmp(a, "--chunk")) rc = parse_int(a, v, 1, 1 << 20, &S->chunk);
        else if (!strcmp(a, "--ranks")) rc = parse_int(a, v, 1, 256, &S->n_ranks);
        else if (!strcmp(a, "--ranks-min")) rc = parse_int(a, v, 1, 1 << 20, &S->ranks_min);
        else if (!strcmp(a, "--strategy")) {
            if (!v || kvr_strategy_parse(v, &S->strategy) != KVR_OK) {
                fprintf(stderr, "kvr-server: --strategy: %s\n", v ? kvr_last_error() : "needs a value");
                return -1;
            }
        }
        else if (!strcmp(a, "--queue")) rc = parse_int(a, v, 0, 1 << 20, &S->queue_max);
        else if (!strcmp(a, "--api-key")) S->api_key = v;
        else if (!strcmp(a, "--cache-dir")) S->cache_dir = v;
        else if (!strcmp(a, "--swap-idle")) rc = parse_num(a, v, 0, 1e6, &S->swap_idle_s);
        else if (!strcmp(a, "--max-body")) rc = parse_int(a, v, 1024, 1 << 30, &S->max_body);
        else if (!strcmp(a, "--read-timeout")) rc = parse_num(a, v, 1, 3600, &S->read_timeout_s);
        else if (!strcmp(a, "--timeout")) rc = parse_num(a, v, 1, 1e6, &S->timeout_s);
        else if (!strcmp(a, "--drain")) rc = parse_num(a, v, 0, 3600, &S->drain_s);
        else if (!strcmp(a, "--chat-template")) S->chat_template = v;
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) { S->verbose = 1; takes = false; }
        else if (!strcmp(a, "--q8-act")) { q8_named = true; takes = false; }
        else if (!strcmp(a, "--exact")) { exact_named = true; takes = false; }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); exit(0); }
        else {
            fprintf(stderr, "kvr-server: unknown option '%s'\n", a);
            usage(stderr);
            return -1;
        }
        if (rc) return -1;
        if (takes) {
            if (!v) {
                fprintf(stderr, "kvr-server: %s needs a value\n", a);
                return -1;
            }
            i++;
        }
    }
    if (exact_named && q8_named) {
        fprintf(stderr, "kvr-server: --q8-act and --exact exclude each other: give one\n");
        return -1;
    }
    S->q8 = !exact_named;
    if (!S->model_path) {
        fprintf(stderr, "kvr-server: -m MODEL.gguf is required\n");
        usage(stderr);
        return -1;
    }
    if (S->cache_dir) {
        struct stat st;
        if (stat(S->cache_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            fprintf(stderr, "kvr-server: --cache-dir %s: not a directory\n", S->cache_dir);
            return -1;
        }
    }
    return 0;
}

int main(int argc, char ** argv) {
    kvr_blas_reexec(argv); // an OpenBLAS older than this CPU: its vector kernels, named before it loads them
    struct srv * S = &g_srv;
    if (parse_args(argc, argv) != 0) return 2;
    struct sockaddr_in addr = { .sin_family = AF_INET, .sin_port = htons((uint16_t)S->port) };
    if (inet_pton(AF_INET, S->host, &addr.sin_addr) != 1) {
        fprintf(stderr, "kvr-server: --host %s: not an IPv4 address\n", S->host);
        return 2;
    }
    S->model = kvr_model_load(S->model_path, NULL);
    if (!S->model) {
        fprintf(stderr, "kvr-server: %s: %s\n", S->model_path, kvr_last_error());
        return 1;
    }
    S->vocab = kvr_model_vocab(S->model);
    const char * tmpl = S->chat_template ? S->chat_template : kvr_vocab_chat_template(S->vocab);
    S->family = kvr_chat_template_detect(tmpl ? tmpl : "chatml");
    if (!S->family) {
        fprintf(stderr, "kvr-server: %s: %s\n", S->chat_template ? "--chat-template" : S->model_path, kvr_last_error());
        return 2;
    }
    const int n_vocab = kvr_vocab_n_tokens(S->vocab);
    S->eog = malloc(sizeof(int32_t) * (size_t)n_vocab);
    KVR_ASSERT(S->eog != NULL);
    for (int i = 0; i < n_vocab; i++) {
        if (kvr_vocab_is_eog(S->vocab, i)) S->eog[S->n_eog++] = i;
    }
    const char * base = strrchr(S->model_path, '/');
    snprintf(S->model_id, sizeof(S->model_id), "%s", base ? base + 1 : S->model_path);
    S->slots = calloc((size_t)S->n_slots, sizeof(struct slot));
    KVR_ASSERT(S->slots != NULL);
    for (int i = 0; i < S->n_slots; i++) {
        struct slot * sl = &S->slots[i];
        sl->id = i;
        sl->s = kvr_session_new(S->model, &(struct kvr_session_params){ .n_ctx = S->n_ctx, .n_threads = S->n_threads, .q8_activations = S->q8 });
        if (!sl->s) {
            fprintf(stderr, "kvr-server: slot %d: %s\n", i, kvr_last_error());
            return 1;
        }
    }
    pthread_mutex_init(&S->mu, NULL);
    pthread_cond_init(&S->work, NULL);
    pthread_cond_init(&S->out, NULL);
    pthread_cond_init(&S->pf_cv, NULL);
    if (S->n_ranks > 1) {
        S->pf = kvr_session_new(S->model, &(struct kvr_session_params){ .n_ranks = S->n_ranks, .strategy = S->strategy, .n_ctx = S->n_ctx,
                                                                .q8_activations = S->q8 });
        if (!S->pf) {
            fprintf(stderr, "kvr-server: --ranks %d --strategy %s: %s\n", S->n_ranks, kvr_strategy_name(S->strategy), kvr_last_error());
            return 1;
        }
        const char * dir = S->cache_dir ? S->cache_dir : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(S->pf_path, sizeof(S->pf_path), "%s/kvr-server-%d-handoff.kvc", dir, (int)getpid());
        if (pthread_create(&S->pf_thread, NULL, pf_main, NULL) != 0) {
            fprintf(stderr, "kvr-server: cannot start the prefill thread\n");
            return 1;
        }
    }
    struct sigaction sa = { .sa_handler = on_signal };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (pthread_create(&S->sched, NULL, sched_main, NULL) != 0) {
        fprintf(stderr, "kvr-server: cannot start the scheduler thread\n");
        return 1;
    }
    struct MHD_Daemon * d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_ITC,
        0, NULL, NULL, on_request, NULL,
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)(S->queue_max + S->n_slots + 16),
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)S->read_timeout_s,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL,
        MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "kvr-server: cannot listen on %s:%d: %s\n", S->host, S->port, strerror(errno));
        return 1;
    }
    int port = S->port;
    const union MHD_DaemonInfo * di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    if (di) port = di->port;
    fprintf(stderr, "kvr-server: %s, %d slots of %d tokens, listening on http://%s:%d\n", S->model_id, S->n_slots, S->n_ctx, S->host, port);
    printf("listening on %s:%d\n", S->host, port);
    fflush(stdout);
    while (!g_signal) {
        struct timespec ts = { 0, 100 * 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
    // drain: no new connections or requests; running ones get --drain seconds
    fprintf(stderr, "kvr-server: signal %d: draining\n", (int)g_signal);
    MHD_quiesce_daemon(d);
    pthread_mutex_lock(&S->mu);
    S->draining = true;
    pthread_mutex_unlock(&S->mu);
    // every request answered (a kept-alive idle connection does not hold the exit back beyond a
    // second, which lets the last answers' bytes leave)
    const double t_end = now_ms() + S->drain_s * 1e3;
    double t_idle = -1.0;
    for (;;) {
        pthread_mutex_lock(&S->mu);
        const bool busy = S->live_reqs > 0;
        const bool conns = S->active_conns > 0;
        pthread_mutex_unlock(&S->mu);
        if (!busy && t_idle < 0) t_idle = now_ms();
        if ((!busy && (!conns || now_ms() - t_idle > 1e3)) || now_ms() > t_end) break;
        struct timespec ts = { 0, 50 * 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&S->mu);
    S->stop = true;
    pthread_cond_broadcast(&S->work);
    pthread_cond_broadcast(&S->out);
    pthread_cond_broadcast(&S->pf_cv);
    pthread_mutex_unlock(&S->mu);
    if (S->pf) kvr_session_interrupt(S->pf, true);
    MHD_stop_daemon(d);
    pthread_join(S->sched, NULL);
    if (S->pf) {
        pthread_join(S->pf_thread, NULL);
        kvr_session_free(S->pf);
        unlink(S->pf_path);
    }
    for (int i = 0; i < S->n_slots; i++) {
        struct slot * sl = &S->slots[i];
        if (sl->swapped) { // its file goes with it
            char path[4096];
            slot_swap_path(sl, path, sizeof(path));
            unlink(path);
        }
        if (sl->r) req_unref_locked(sl->r);
        kvr_sampler_free(&sl->smp);
        kvr_session_free(sl->s);
        free(sl->toks);
    }
    while (S->q_head) {
        struct req * r = S->q_head;
        S->q_head = r->next;
        req_unref_locked(r);
    }
    free(S->slots);
    free(S->eog);
    kvr_model_free(S->model);
    fprintf(stderr, "kvr-server: stopped\n");
    return 0;
}
