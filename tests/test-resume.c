// tests/test-resume.c - replication logs and restarts (kvr.h "Replication logs", kvr_session_params
// .replicate_dir, kvr_session_resume), on stories260K from the shared directory:
//
//   format    a log written record by record reads back as written; cut at every byte of its last
//             step, a flipped bit in each kind of record, a step that ran again: the acknowledged
//             prefix is kept and the damage named; header damage, a newer version, another model
//             refused; a log continued after its acknowledged prefix reads whole; a symbolic link
//             or a hard link where a log is created or continued is refused, its target left as
//             it was; a FIFO is refused at once, not waited on; a --replicate-dir that is a
//             symbolic link is refused
//   killed    a child process runs a prompt and greedy steps with replicate_dir and kills itself
//             (SIGKILL) after step k; a new session resumes from the logs: the tokens restored are the
//             clean run's, and the continuation gives the clean run's ids (single, tsp, kvr,
//             ring-kv, ring-q on 1..3 ranks); after a clean stop, every step is restored and the
//             continued logits equal the clean run's bit for bit
//   damage    a log with a bad CRC in step j, a log cut short in step j: resumed from step j-1,
//             with a "resume: " note naming the file and what was wrong; the text is the clean one
//   fewer     logs of ring-kv x3 resumed on ring-q x2, kvr x2 and one rank: the clean ids
//   refused   another model, another prompt, logs of two runs in one directory, no logs at all:
//             refused with the file and the field named; nothing restored
//   typed     an F16 cache's log holds f16 rows (its type field says so); resumed into an F16
//             session the cache saved is the first session's byte for byte; into an F32 one the
//             rows are converted with a note, and appending to the F16 logs is refused; a type
//             field naming no cache type is refused
//   again     resumed into the same directory (replicate_dir = the resumed one), killed again,
//             resumed again: the clean ids
//
// usage: test-resume [SHARED_DIR (default ../shared)] [-v]
// Prints "resume: N passed, M failed" (", K skipped"); exits 1 on a failure.

#define _POSIX_C_SOURCE 200809L

#define KVR_BUILD // kvr.h's internal part: the replication logs' reader
#include "kvr.h"
#include "tests/check.h"

// An F32 KV cache (the default is F16): these tests compare the rows logs hold as f32.
#define KVR_TEST_F32_CACHE .cache_type_k = KVR_CACHE_F32, .cache_type_v = KVR_CACHE_F32

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char         tmp_dir[512];

static char * tmp_path(const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static char * tmp_path(const char * fmt, ...) {
    static char buf[16][700];
    static int k;
    char * p = buf[k++ % 16];
    char name[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    snprintf(p, 700, "%s/%s", tmp_dir, name);
    return p;
}

static uint8_t * read_all(const char * path, size_t * n) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t * b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

static void write_all(const char * path, const void * b, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    if (n && fwrite(b, 1, n, f) != n) { perror(path); exit(2); }
    fclose(f);
}

static void put32(uint8_t * p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get32(const uint8_t * p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static const int32_t prompt[] = { 1, 403, 407, 261, 378, 6, 8, 391, 153, 289, 327, 372, 260, 284, 320, 261 };
#define N_PROMPT ((int)(sizeof(prompt) / sizeof(prompt[0])))
#define N_GEN 14

//
// format
//

static void on_alarm(int sig) { (void)sig; }

static void test_format(const struct kvr_model * m, const char * other_path) {
    const int L = (int)m->hp.n_layer, kv_dim = (int)(m->hp.head_dim * m->hp.n_head_kv);
    set_case("format: write and read back");
    char path[700];
    snprintf(path, sizeof(path), "%s", tmp_path("fmt.kvlog"));
    const struct kvr_kv_log_head h = { .rank = 1, .n_ranks = 3, .strategy = KVR_STRATEGY_RING_KV, .n_prompt = 5, .prompt = prompt };
    struct kvr_kv_log * w;
    CHECK(kvr_kv_log_create(&w, path, m, &h) == KVR_OK, "create: %s", kvr_last_error());
    const int nf = kv_dim * (L + 4); // rows at k + il (2 of them) and at k + il * kv_dim for every layer
    float * k = malloc(sizeof(float) * (size_t)nf), * v = malloc(sizeof(float) * (size_t)nf);
    for (int i = 0; i < nf; i++) { k[i] = (float)i * 0.5f; v[i] = -(float)i; }
    const int32_t pos0[2] = { 0, 4 }, pos2[1] = { 6 };
    int64_t ends[3];
    // step 0: 2 rows; step 1: none; step 2: 1 row
    for (int il = 0; il < L; il++) CHECK(kvr_kv_log_rows(w, 0, il, 2, k + il, v + il) == KVR_OK, "rows");
    CHECK(kvr_kv_log_commit(w, 0, prompt, 5, pos0, 2) == KVR_OK, "commit 0");
    ends[0] = kvr_kv_log_bytes(w);
    CHECK(kvr_kv_log_commit(w, 1, prompt + 5, 1, NULL, 0) == KVR_OK, "commit 1");
    ends[1] = kvr_kv_log_bytes(w);
    // a step that ran twice: two layers of a first try, then the whole step
    for (int il = 0; il < 2 && il < L; il++) CHECK(kvr_kv_log_rows(w, 2, il, 1, k + 3, v + 3) == KVR_OK, "rows of the failed try");
    for (int il = 0; il < L; il++) CHECK(kvr_kv_log_rows(w, 2, il, 1, k + il * kv_dim, v + il * kv_dim) == KVR_OK, "rows");
    CHECK(kvr_kv_log_commit(w, 2, prompt + 6, 1, pos2, 1) == KVR_OK, "commit 2");
    ends[2] = kvr_kv_log_bytes(w);
    CHECK(kvr_kv_log_close(w) == KVR_OK, "close");
    struct kvr_kv_log_data * d;
    CHECK(kvr_kv_log_read(path, m, &d) == KVR_OK, "read: %s", kvr_last_error());
    if (d) {
        CHECK(d->rank == 1 && d->n_ranks == 3 && d->strategy == KVR_STRATEGY_RING_KV && d->n_prompt == 5 &&
              !memcmp(d->prompt, prompt, 20) && d->flags == 0, "header fields");
        CHECK(d->n_steps == 3 && d->damage[0] == 0 && d->good == ends[2] && d->bytes == ends[2], "steps %d, damage '%s'", d->n_steps, d->damage);
        if (d->n_steps == 3) {
            CHECK(d->steps[0].n_rows == 2 && d->steps[0].pos[1] == 4 && d->steps[0].n_tokens == 5 && d->steps[1].n_rows == 0 &&
                  d->steps[1].tokens[0] == prompt[5] && d->steps[2].n_rows == 1 && d->steps[2].pos[0] == 6, "steps' fields");
            bool same = true;
            for (int il = 0; il < L; il++) {
                same = same && !memcmp(d->steps[0].k[il], k + il, sizeof(float) * (size_t)kv_dim * 2) &&
                       !memcmp(d->steps[0].v[il], v + il, sizeof(float) * (size_t)kv_dim * 2) &&
                       !memcmp(d->steps[2].k[il], k + il * kv_dim, sizeof(float) * (size_t)kv_dim);
            }
            CHECK(same, "rows read back differ (the step that ran again must be its second try)");
            CHECK(d->steps[0].end == ends[0] && d->steps[1].end == ends[1], "step ends");
        }
        kvr_kv_log_free(d);
    }
    size_t n;
    uint8_t * g = read_all(path, &n);
    // cut at every byte of the last step: steps 0 and 1 stay, a note says where it stopped
    set_case("format: cut in the last step");
    int cut_ok = 0, cut_total = 0;
    for (int64_t at = ends[1]; at < ends[2]; at += 1 + (ends[2] - ends[1]) / 97) {
        write_all(tmp_path("cut.kvlog"), g, (size_t)at);
        struct kvr_kv_log_data * c;
        cut_total++;
        if (kvr_kv_log_read(tmp_path("cut.kvlog"), m, &c) == KVR_OK) {
            cut_ok += c->n_steps == 2 && c->good == ends[1] && (at == ends[1] ? c->damage[0] == 0 : c->damage[0] != 0);
            kvr_kv_log_free(c);
        }
    }
    CHECK(cut_ok == cut_total, "%d of %d cuts kept steps 0..1 and named the rest", cut_ok, cut_total);
    // a flipped bit in a rows record, in a commit, in the prompt, in the header
    set_case("format: flipped bits");
    const struct { int64_t at; int steps; const char * expect; int rc; } flips[] = {
        { ends[1] + 16 + 5, 2, "CRC32C of the rows of step 2, layer 0", KVR_OK },
        { ends[0] + 16, 1, "CRC32C of the commit of step 1", KVR_OK },
        { ends[0] + 1, 1, "record type 4098", KVR_OK },
        { KVR_KV_LOG_HEADER + 2, 0, "prompt's tokens", KVR_ERR_FORMAT },
        { 70, 0, "header's CRC32C", KVR_ERR_FORMAT },
    };
    for (size_t i = 0; i < sizeof(flips) / sizeof(flips[0]); i++) {
        uint8_t * b = malloc(n);
        memcpy(b, g, n);
        b[flips[i].at] ^= 0x10;
        write_all(tmp_path("flip.kvlog"), b, n);
        free(b);
        struct kvr_kv_log_data * c = NULL;
        const int rc = kvr_kv_log_read(tmp_path("flip.kvlog"), m, &c);
        if (flips[i].rc == KVR_OK) {
            CHECK(rc == KVR_OK && c->n_steps == flips[i].steps && strstr(c->damage, flips[i].expect), "flip at %lld: %d steps, '%s'",
                  (long long)flips[i].at, c ? c->n_steps : -1, c ? c->damage : kvr_last_error());
        } else {
            CHECK(rc == flips[i].rc && strstr(kvr_last_error(), flips[i].expect) && strstr(kvr_last_error(), "flip.kvlog"),
                  "flip at %lld: %d '%s'", (long long)flips[i].at, rc, kvr_last_error());
        }
        kvr_kv_log_free(c);
    }
    set_case("format: a newer or older version, another model");
    {
        uint8_t * b = malloc(n);
        memcpy(b, g, n);
        put32(b + 8, KVR_KV_LOG_VERSION + 1);
        put32(b + 92, kvr_crc32c(0, b, 92));
        write_all(tmp_path("new.kvlog"), b, n);
        struct kvr_kv_log_data * c = NULL;
        CHECK(kvr_kv_log_read(tmp_path("new.kvlog"), m, &c) == KVR_ERR_UNSUPP && strstr(kvr_last_error(), "offset 8"), "%s", kvr_last_error());
        put32(b + 8, 1);
        put32(b + 92, kvr_crc32c(0, b, 92));
        write_all(tmp_path("old.kvlog"), b, n);
        CHECK(kvr_kv_log_read(tmp_path("old.kvlog"), m, &c) == KVR_ERR_FORMAT &&
              strstr(kvr_last_error(), "offset 8: version 1 is older than this kvr reads (3): its fingerprint does not cover the weights' bytes"),
              "%s", kvr_last_error());
        put32(b + 8, 2);
        put32(b + 92, kvr_crc32c(0, b, 92));
        write_all(tmp_path("old2.kvlog"), b, n);
        CHECK(kvr_kv_log_read(tmp_path("old2.kvlog"), m, &c) == KVR_ERR_FORMAT &&
              strstr(kvr_last_error(), "offset 8: version 2 is older than this kvr reads (3): its rows are f32 and it records no cache type"),
              "%s", kvr_last_error());
        memcpy(b, g, n);
        b[88] ^= 0x20; // the tokenizer hash
        put32(b + 92, kvr_crc32c(0, b, 92));
        write_all(tmp_path("tok.kvlog"), b, n);
        CHECK(kvr_kv_log_read(tmp_path("tok.kvlog"), m, &c) == KVR_ERR_ARG && strstr(kvr_last_error(), "offset 84: the log is of another model: tokenizer hash"),
              "%s", kvr_last_error());
        memcpy(b, g, n);
        put32(b + 20, get32(b + 20) + 1); // layers
        put32(b + 92, kvr_crc32c(0, b, 92));
        write_all(tmp_path("layers.kvlog"), b, n);
        CHECK(kvr_kv_log_read(tmp_path("layers.kvlog"), m, &c) == KVR_ERR_ARG && strstr(kvr_last_error(), "offset 20") &&
              strstr(kvr_last_error(), "another model: layers"), "%s", kvr_last_error());
        free(b);
        if (other_path) {
            struct kvr_model * o = kvr_model_load(other_path, NULL);
            CHECK(o && kvr_kv_log_read(path, o, &c) == KVR_ERR_ARG && strstr(kvr_last_error(), "fmt.kvlog") &&
                  strstr(kvr_last_error(), "another model"), "%s", kvr_last_error());
            kvr_model_free(o);
        }
    }
    // a rows record of a layer past the model's last, its CRC chained right: damage, not a write
    // past the step's per-layer table
    set_case("format: a layer past the model's");
    {
        const size_t rec = 16 + 8 * (size_t)kv_dim + 4;
        uint8_t * b = malloc((size_t)ends[1] + (size_t)(L + 1) * rec);
        memcpy(b, g, (size_t)ends[1]);
        uint32_t crc = get32(b + ends[1] - 4);
        size_t off = (size_t)ends[1];
        for (int il = 0; il <= L; il++, off += rec) {
            put32(b + off, KVR_KV_LOG_ROWS); put32(b + off + 4, 2); put32(b + off + 8, (uint32_t)il); put32(b + off + 12, 1);
            memcpy(b + off + 16, k, 4 * (size_t)kv_dim);
            memcpy(b + off + 16 + 4 * (size_t)kv_dim, v, 4 * (size_t)kv_dim);
            crc = kvr_crc32c(crc, b + off, rec - 4);
            put32(b + off + rec - 4, crc);
        }
        write_all(tmp_path("layer.kvlog"), b, off);
        free(b);
        struct kvr_kv_log_data * c = NULL;
        CHECK(kvr_kv_log_read(tmp_path("layer.kvlog"), m, &c) == KVR_OK && c->n_steps == 2 && strstr(c->damage, "the log is damaged"),
              "%s", c ? c->damage : kvr_last_error());
        if (verbose && c) printf("  -> %s\n", c->damage);
        kvr_kv_log_free(c);
    }
    set_case("format: continued after the acknowledged prefix");
    {
        write_all(tmp_path("cont.kvlog"), g, (size_t)(ends[2] - 7)); // step 2 cut short
        struct kvr_kv_log_data * c = NULL;
        CHECK(kvr_kv_log_read(tmp_path("cont.kvlog"), m, &c) == KVR_OK && c->n_steps == 2, "read");
        if (c) {
            CHECK(kvr_kv_log_append(&w, tmp_path("cont.kvlog"), m, c) == KVR_OK, "append: %s", kvr_last_error());
            kvr_kv_log_free(c);
            c = NULL;
            for (int il = 0; il < L; il++) kvr_kv_log_rows(w, 2, il, 1, k + il * kv_dim, v + il * kv_dim);
            CHECK(kvr_kv_log_commit(w, 2, prompt + 6, 1, pos2, 1) == KVR_OK && kvr_kv_log_close(w) == KVR_OK, "commit, close");
            size_t n2;
            uint8_t * g2 = read_all(tmp_path("cont.kvlog"), &n2);
            // the same bytes up to step 2, then step 2 without the first try this test's log had
            const int64_t tries = (int64_t)(L < 2 ? L : 2) * (16 + 8 * kv_dim + 4);
            CHECK((int64_t)n2 == (int64_t)n - tries && !memcmp(g, g2, (size_t)ends[1]), "the continued log's bytes");
            CHECK(kvr_kv_log_read(tmp_path("cont.kvlog"), m, &c) == KVR_OK && c->n_steps == 3 && !c->damage[0] &&
                  !memcmp(c->steps[2].k[L - 1], k + (L - 1) * kv_dim, sizeof(float) * (size_t)kv_dim), "the continued log reads whole");
            kvr_kv_log_free(c);
            free(g2);
        }
    }
    free(g);
    free(k);
    free(v);

    set_case("format: a planted link, a hard link, a FIFO");
    const char victim_text[] = "not a log\n";
    char victim[700], link_path[700], hard[700], fifo[700];
    snprintf(victim, sizeof(victim), "%s", tmp_path("victim.txt"));
    snprintf(link_path, sizeof(link_path), "%s", tmp_path("link.kvlog"));
    snprintf(hard, sizeof(hard), "%s", tmp_path("hard.kvlog"));
    snprintf(fifo, sizeof(fifo), "%s", tmp_path("fifo.kvlog"));
    write_all(victim, victim_text, sizeof(victim_text) - 1);
    CHECK(symlink(victim, link_path) == 0 && link(victim, hard) == 0, "links: %s", strerror(errno));
    struct kvr_kv_log_data * d0 = NULL;
    CHECK(kvr_kv_log_read(path, m, &d0) == KVR_OK, "read: %s", kvr_last_error());
    const char * targets[2] = { link_path, hard };
    for (int i = 0; i < 2; i++) {
        w = NULL;
        CHECK(kvr_kv_log_create(&w, targets[i], m, &h) != KVR_OK && strstr(kvr_last_error(), targets[i]),
              "a log created through %s: %s", targets[i], kvr_last_error());
        if (w) kvr_kv_log_close(w);
        w = NULL;
        CHECK(d0 && kvr_kv_log_append(&w, targets[i], m, d0) != KVR_OK, "a log continued through %s", targets[i]);
        if (w) kvr_kv_log_close(w);
        uint8_t * vb = read_all(victim, &n);
        CHECK(vb && n == sizeof(victim_text) - 1 && memcmp(vb, victim_text, n) == 0, "%s: the link's target was written", targets[i]);
        free(vb);
    }
    kvr_kv_log_free(d0);
    unlink(fifo);
    if (mkfifo(fifo, 0600) == 0) {
        // an open that waits for a writer would be cut by the alarm, long after the check's bound
        struct sigaction on = { .sa_handler = on_alarm }, was;
        sigaction(SIGALRM, &on, &was);
        alarm(5);
        const double t0 = kvr_time_ms();
        struct kvr_kv_log_data * df = NULL;
        const int rc = kvr_kv_log_read(fifo, m, &df);
        const double ms = kvr_time_ms() - t0;
        alarm(0);
        sigaction(SIGALRM, &was, NULL);
        CHECK(rc != KVR_OK && ms < 2000 && strstr(kvr_last_error(), "FIFO"), "a FIFO read as a log: %.0f ms, %s", ms, kvr_last_error());
        kvr_kv_log_free(df);
    } else {
        CHECK(0, "mkfifo: %s", strerror(errno));
    }
}

//
// runs: a clean one, one killed, resumed
//

static struct kvr_session * new_dist(const struct kvr_model * m, enum kvr_strategy st, int n_ranks, const char * dir, FILE * log) {
    struct kvr_session_params p = { KVR_TEST_F32_CACHE, .strategy = st, .n_ranks = n_ranks, .n_threads = 1, .n_ctx = 64, .timeout_s = 30,
                                 .replicate_dir = dir, .log = log };
    struct kvr_session * d = kvr_session_new(m, &p);
    if (!d) { fprintf(stderr, "kvr_session_new: %s\n", kvr_last_error()); exit(2); }
    return d;
}

// greedy from the session's logits until it holds n_total generated tokens; every step's logits out
static bool greedy_to(struct kvr_session * d, int n_total, int32_t * ids, float * logits, int n_vocab) {
    for (int i = kvr_session_n_past(d) - N_PROMPT; i < n_total; i++) {
        const float * l = kvr_session_logits(d);
        if (!l) return false;
        if (logits) memcpy(logits + (size_t)i * n_vocab, l, sizeof(float) * (size_t)n_vocab);
        ids[i] = kvr_argmax(l, n_vocab);
        if (i + 1 < n_total && !kvr_session_eval(d, &ids[i], 1)) return false;
    }
    return true;
}

// the clean run: N_GEN greedy ids and the logits they came from
static void clean_run(const struct kvr_model * m, enum kvr_strategy st, int nr, int32_t * ids, float * logits) {
    struct kvr_session * d = new_dist(m, st, nr, NULL, NULL);
    if (!kvr_session_eval(d, prompt, N_PROMPT) || !greedy_to(d, N_GEN, ids, logits, (int)m->hp.n_vocab)) {
        fprintf(stderr, "the clean run failed: %s\n", kvr_last_error());
        exit(2);
    }
    kvr_session_free(d);
}

// A child process runs the prompt and k decode steps with the logs in dir, then dies (SIGKILL,
// kill) or stops cleanly (the logs closed); resume_dir: it resumes from there first.
static bool child_run(const struct kvr_model * m, enum kvr_strategy st, int nr, const char * dir, int k, bool kill,
                      const char * resume_dir) {
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0) { perror("fork"); exit(2); }
    if (pid == 0) {
        struct kvr_session * d = new_dist(m, st, nr, dir, NULL);
        struct kvr_resume_info ri;
        if (resume_dir && kvr_session_resume(d, resume_dir, prompt, N_PROMPT, &ri) != KVR_OK) _exit(3);
        if (kvr_session_n_past(d) == 0 && !kvr_session_eval(d, prompt, N_PROMPT)) _exit(4);
        int32_t ids[N_GEN + 1];
        if (!greedy_to(d, k + 1, ids, NULL, (int)m->hp.n_vocab)) _exit(5);
        // k decode steps are done (their evals returned): the point the process dies
        if (kill) raise(SIGKILL);
        kvr_session_free(d);
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    return kill ? WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL : WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// resume from dir into a new session and continue to N_GEN: the ids (and logits when exact) equal
static void resume_and_check(const struct kvr_model * m, enum kvr_strategy st, int nr, const char * dir, const int32_t * ref,
                             const float * ref_logits, int want_step, bool exact, const char * want_note) {
    const int n_vocab = (int)m->hp.n_vocab;
    char * notes = NULL;
    size_t notes_len = 0;
    FILE * log = open_memstream(&notes, &notes_len);
    struct kvr_session * d = new_dist(m, st, nr, NULL, log);
    struct kvr_resume_info ri;
    const int rc = kvr_session_resume(d, dir, prompt, N_PROMPT, &ri);
    fclose(log);
    CHECK(rc == KVR_OK, "resume: %s", kvr_last_error());
    if (want_step >= 0) CHECK(ri.step == want_step, "resumed at step %d, %d expected", ri.step, want_step);
    if (want_note) CHECK(notes && strstr(notes, want_note), "the notes '%s' do not say '%s'", notes ? notes : "", want_note);
    if (verbose && notes) printf("%s", notes);
    free(notes);
    if (rc != KVR_OK) {
        kvr_session_free(d);
        return;
    }
    // what was restored is the clean run's: the prompt and the ids up to the step
    const int n = kvr_session_n_past(d);
    CHECK(ri.step < 0 ? n == 0 : n == ri.n_tokens && n >= N_PROMPT && n <= N_PROMPT + N_GEN, "%d tokens restored at step %d", n, ri.step);
    CHECK(n == 0 || (!memcmp(kvr_session_tokens(d), prompt, sizeof(prompt)) &&
                     !memcmp(kvr_session_tokens(d) + N_PROMPT, ref, sizeof(int32_t) * (size_t)(n - N_PROMPT))), "restored tokens differ");
    if (n == 0) CHECK(kvr_session_eval(d, prompt, N_PROMPT) != NULL, "prefill: %s", kvr_last_error());
    int32_t ids[N_GEN];
    float * lg = calloc((size_t)n_vocab * N_GEN, sizeof(float));
    CHECK(greedy_to(d, N_GEN, ids, lg, n_vocab), "continue: %s", kvr_last_error());
    const int from = n ? n - N_PROMPT : 0;
    CHECK(!memcmp(ids + from, ref + from, sizeof(int32_t) * (size_t)(N_GEN - from)), "the continuation's ids differ from the clean run's");
    if (exact && ri.step >= 1) {
        CHECK(!memcmp(lg + (size_t)from * n_vocab, ref_logits + (size_t)from * n_vocab, sizeof(float) * (size_t)n_vocab * (N_GEN - from)),
              "the continuation's logits differ from the clean run's (not bit-identical)");
    }
    free(lg);
    kvr_session_free(d);
}

static void test_killed(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab;
    const enum kvr_strategy strats[] = { KVR_STRATEGY_SINGLE, KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV, KVR_STRATEGY_RING_Q };
    int32_t ref[N_GEN];
    float * rl = malloc(sizeof(float) * (size_t)n_vocab * N_GEN);
    for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
        for (int nr = 1; nr <= 3; nr++) {
            if ((strats[si] == KVR_STRATEGY_SINGLE) != (nr == 1)) continue;
            clean_run(m, strats[si], nr, ref, rl);
            const char * dir = tmp_path("killed-%s-%d", kvr_strategy_name(strats[si]), nr);
            for (int k = 0; k <= 6; k += 6) {
                set_case("killed: %s x%d, SIGKILL after %d decode steps, resumed", kvr_strategy_name(strats[si]), nr, k);
                CHECK(child_run(m, strats[si], nr, dir, k, true, NULL), "the child did not die of SIGKILL");
                // the writer may not have reached the last steps: any step up to k is right
                resume_and_check(m, strats[si], nr, dir, ref, rl, -1, true, NULL);
            }
            set_case("killed: %s x%d, stopped cleanly after 5 decode steps, resumed", kvr_strategy_name(strats[si]), nr);
            CHECK(child_run(m, strats[si], nr, dir, 5, false, NULL), "the child failed");
            resume_and_check(m, strats[si], nr, dir, ref, rl, 5, true, "restored 21 tokens");
        }
    }
    free(rl);
}

// the byte offset of step j's first record in a log (the end of step j-1)
static int64_t step_start(const struct kvr_model * m, const char * path, int j) {
    struct kvr_kv_log_data * d = NULL;
    if (kvr_kv_log_read(path, m, &d) != KVR_OK || d->n_steps <= j) {
        kvr_kv_log_free(d);
        return -1;
    }
    const int64_t at = j ? d->steps[j - 1].end : d->steps[0].end; // step 0's: its end (not used)
    kvr_kv_log_free(d);
    return at;
}

static void test_damage(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab;
    int32_t ref[N_GEN];
    float * rl = malloc(sizeof(float) * (size_t)n_vocab * N_GEN);
    clean_run(m, KVR_STRATEGY_RING_KV, 3, ref, rl);
    const char * dir = tmp_path("damage");
    // rank 2 stores the decoded token of steps 3 and 6 (round robin from rank 0 at step 1)
    set_case("damage: a bad CRC in rank 2's step 3 rows");
    CHECK(child_run(m, KVR_STRATEGY_RING_KV, 3, dir, 8, false, NULL), "the child failed");
    char p2[700], saved[700];
    kvr_session_log_path(dir, 2, p2, sizeof(p2));
    snprintf(saved, sizeof(saved), "%s", tmp_path("damage-rank2.kvlog"));
    size_t n;
    uint8_t * g = read_all(p2, &n);
    write_all(saved, g, n);
    const int64_t at = step_start(m, p2, 3);
    CHECK(at > 0 && get32(g + at) == KVR_KV_LOG_ROWS, "step 3 of rank 2 starts with rows");
    if (at > 0) {
        g[at + 16 + 3] ^= 0x01;
        write_all(p2, g, n);
        resume_and_check(m, KVR_STRATEGY_RING_KV, 3, dir, ref, rl, 2, true, "rank-2.kvlog: offset");
        resume_and_check(m, KVR_STRATEGY_RING_KV, 3, dir, ref, rl, 2, true, "CRC32C of the rows of step 3, layer 0");
    }
    set_case("damage: rank 0's log cut short in step 4");
    {
        // rank 2's log back whole; rank 0's cut 10 bytes into its step 4
        size_t n2;
        uint8_t * s = read_all(saved, &n2);
        write_all(p2, s, n2);
        free(s);
        char p0[700];
        kvr_session_log_path(dir, 0, p0, sizeof(p0));
        uint8_t * g0 = read_all(p0, &n2);
        const int64_t at4 = step_start(m, p0, 4);
        CHECK(at4 > 0, "step 4 of rank 0");
        if (at4 > 0) {
            write_all(p0, g0, (size_t)at4 + 10);
            resume_and_check(m, KVR_STRATEGY_RING_KV, 3, dir, ref, rl, 3, true, "cut short");
        }
        free(g0);
    }
    free(g);
    free(rl);
}

static void test_fewer(const struct kvr_model * m) {
    int32_t ref[N_GEN];
    clean_run(m, KVR_STRATEGY_RING_KV, 3, ref, NULL);
    const char * dir = tmp_path("fewer");
    CHECK(child_run(m, KVR_STRATEGY_RING_KV, 3, dir, 6, true, NULL), "the child did not die of SIGKILL");
    const struct { enum kvr_strategy st; int nr; } to[] = {
        { KVR_STRATEGY_RING_Q, 2 }, { KVR_STRATEGY_KVR, 2 }, { KVR_STRATEGY_SINGLE, 1 }, { KVR_STRATEGY_RING_KV, 3 },
    };
    for (size_t i = 0; i < sizeof(to) / sizeof(to[0]); i++) {
        set_case("fewer: ring-kv x3's logs resumed on %s x%d", kvr_strategy_name(to[i].st), to[i].nr);
        resume_and_check(m, to[i].st, to[i].nr, dir, ref, NULL, -1, false, NULL);
    }
    // and a chain's logs onto a ring
    clean_run(m, KVR_STRATEGY_KVR, 3, ref, NULL);
    const char * dir2 = tmp_path("fewer-kvr");
    CHECK(child_run(m, KVR_STRATEGY_KVR, 3, dir2, 4, false, NULL), "the child failed");
    set_case("fewer: kvr x3's logs resumed on ring-kv x2 and tsp x3");
    resume_and_check(m, KVR_STRATEGY_RING_KV, 2, dir2, ref, NULL, 4, false, NULL);
    resume_and_check(m, KVR_STRATEGY_TSP, 3, dir2, ref, NULL, 4, false, NULL);
}

// a --replicate-dir that is a symbolic link: the logs would go where its planter chose
static void test_linked_dir(const struct kvr_model * m) {
    set_case("refused: a --replicate-dir that is a symbolic link");
    char real[700], linked[700], log0[800];
    snprintf(real, sizeof(real), "%s", tmp_path("real-dir"));
    snprintf(linked, sizeof(linked), "%s", tmp_path("linked-dir"));
    snprintf(log0, sizeof(log0), "%s/rank-0.kvlog", real);
    CHECK(mkdir(real, 0755) == 0 && symlink(real, linked) == 0, "setup: %s", strerror(errno));
    struct kvr_session * d = new_dist(m, KVR_STRATEGY_SINGLE, 1, linked, NULL);
    CHECK(kvr_session_eval(d, prompt, 5) == NULL && strstr(kvr_last_error(), "symbolic link"), "eval: %s",
          kvr_session_n_past(d) ? "ran" : kvr_last_error());
    CHECK(access(log0, F_OK) != 0, "a log was written through the link");
    kvr_session_free(d);
}

// A log of an F16 cache: its rows are the cache's f16 bytes (the type field says so, a row is
// 2 bytes a value), a resume into an F16 session puts back the very cache (its saved file is the
// first session's byte for byte); into an F32 one it converts, saying so, and does not append to
// the F16 logs; a type field that names no cache type is refused.
static void test_typed(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab, kv_dim = (int)(m->hp.head_dim * m->hp.n_head_kv);
    const char * dir = tmp_path("typed");
    char file_a[700], file_b[700], log0[700];
    snprintf(file_a, sizeof(file_a), "%s", tmp_path("typed-a.kvc"));
    snprintf(file_b, sizeof(file_b), "%s", tmp_path("typed-b.kvc"));
    kvr_session_log_path(dir, 0, log0, sizeof(log0));
    set_case("typed: an F16 log replays to the same cache bytes");
    struct kvr_session_params p = { .cache_type_k = KVR_CACHE_F16, .cache_type_v = KVR_CACHE_F16, .n_ranks = 1, .n_threads = 1,
                                    .n_ctx = 64, .timeout_s = 30, .replicate_dir = dir };
    struct kvr_session * d = kvr_session_new(m, &p);
    int32_t ids[N_GEN];
    const bool ran = d && kvr_session_eval(d, prompt, N_PROMPT) && greedy_to(d, 4, ids, NULL, n_vocab) &&
                     kvr_session_kv_save(d, file_a, false) == KVR_OK;
    CHECK(ran, "the F16 run: %s", kvr_last_error());
    kvr_session_free(d);
    if (!ran) return;
    struct kvr_kv_log_data * L = NULL;
    CHECK(kvr_kv_log_read(log0, m, &L) == KVR_OK, "read: %s", kvr_last_error());
    if (L) {
        CHECK(L->type_k == KVR_TYPE_F16 && L->type_v == KVR_TYPE_F16 && L->row_k == 2 * (size_t)kv_dim && L->row_v == 2 * (size_t)kv_dim,
              "the log's types %s/%s, rows of %zu/%zu bytes (f16, %d expected)", kvr_type_name(L->type_k), kvr_type_name(L->type_v),
              L->row_k, L->row_v, 2 * kv_dim);
        CHECK(L->n_steps == 4 && L->steps[0].n_rows == N_PROMPT, "%d steps, step 0 of %d rows", L->n_steps, L->n_steps ? L->steps[0].n_rows : -1);
    }
    kvr_kv_log_free(L);
    p.replicate_dir = NULL;
    d = kvr_session_new(m, &p);
    struct kvr_resume_info ri;
    CHECK(d && kvr_session_resume(d, dir, prompt, N_PROMPT, &ri) == KVR_OK && ri.step == 3, "resume: %s", kvr_last_error());
    CHECK(d && kvr_session_kv_save(d, file_b, false) == KVR_OK, "save: %s", kvr_last_error());
    kvr_session_free(d);
    size_t na = 0, nb = 0;
    uint8_t * a = read_all(file_a, &na), * b = read_all(file_b, &nb);
    CHECK(a && b && na == nb && !memcmp(a, b, na), "the resumed session's cache file (%zu bytes) differs from the first one's (%zu)", nb, na);
    free(a);
    free(b);

    set_case("typed: an F16 log into an F32 session");
    char * notes = NULL;
    size_t notes_len = 0;
    FILE * log = open_memstream(&notes, &notes_len);
    p.cache_type_k = p.cache_type_v = KVR_CACHE_F32;
    p.log = log;
    d = kvr_session_new(m, &p);
    int rc = d ? kvr_session_resume(d, dir, prompt, N_PROMPT, &ri) : KVR_ERR_ARG;
    fflush(log);
    CHECK(rc == KVR_OK && ri.step == 3 && notes && strstr(notes, "the logs hold f16 K and f16 V rows, this session's cache is f32 and f32: "
          "the rows are converted"), "resume: %d %s; notes '%s'", rc, kvr_last_error(), notes ? notes : "");
    kvr_session_free(d);
    p.replicate_dir = dir; // going on in the F16 logs
    d = kvr_session_new(m, &p);
    rc = d ? kvr_session_resume(d, dir, prompt, N_PROMPT, &ri) : KVR_OK;
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "f16 K and f16 V rows; this run's cache is f32 and f32: they cannot go on there"),
          "appending F32 rows to F16 logs: %d %s", rc, kvr_last_error());
    kvr_session_free(d);
    fclose(log);
    free(notes);

    set_case("typed: a damaged type field");
    size_t n = 0;
    uint8_t * g = read_all(log0, &n);
    const uint32_t bad[] = { KVR_TYPE_F16 | 0xffu << 16, KVR_TYPE_Q4_0 | (uint32_t)KVR_TYPE_F16 << 16, 0x7777 };
    for (int i = 0; g && i < 3; i++) {
        put32(g + 32, bad[i]);
        put32(g + 92, kvr_crc32c(0, g, 92));
        write_all(tmp_path("type.kvlog"), g, n);
        struct kvr_kv_log_data * c = NULL;
        rc = kvr_kv_log_read(tmp_path("type.kvlog"), m, &c);
        CHECK(rc == KVR_ERR_FORMAT && strstr(kvr_last_error(), "type.kvlog: offset 32: the cache type field") &&
              strstr(kvr_last_error(), "not a KV cache type"), "type field 0x%08x: %d %s", bad[i], rc, kvr_last_error());
        kvr_kv_log_free(c);
    }
    free(g);
}

static void test_refused(const struct kvr_model * m, const char * other_path) {
    const char * dir = tmp_path("refused");
    CHECK(child_run(m, KVR_STRATEGY_KVR, 2, dir, 3, false, NULL), "the child failed");
    struct kvr_resume_info ri;
    set_case("refused: another prompt");
    {
        struct kvr_session * d = new_dist(m, KVR_STRATEGY_KVR, 2, NULL, NULL);
        int32_t other[N_PROMPT];
        memcpy(other, prompt, sizeof(other));
        other[5] = 100;
        CHECK(kvr_session_resume(d, dir, other, N_PROMPT, &ri) == KVR_ERR_ARG && strstr(kvr_last_error(), "rank-0.kvlog: offset 116") &&
              strstr(kvr_last_error(), "another prompt") && kvr_session_n_past(d) == 0, "%s", kvr_last_error());
        CHECK(kvr_session_resume(d, dir, prompt, N_PROMPT - 1, &ri) == KVR_ERR_ARG && strstr(kvr_last_error(), "offset 76") &&
              strstr(kvr_last_error(), "prompt tokens 16") && kvr_session_n_past(d) == 0, "%s", kvr_last_error());
        // without a prompt: the logs'
        CHECK(kvr_session_resume(d, dir, NULL, 0, &ri) == KVR_OK && ri.n_prompt == N_PROMPT && !memcmp(ri.prompt, prompt, sizeof(prompt)) &&
              ri.step == 3 && kvr_session_n_past(d) == N_PROMPT + 3, "no prompt: %s", kvr_last_error());
        kvr_session_free(d);
    }
    set_case("refused: another model");
    if (other_path) {
        struct kvr_model * o = kvr_model_load(other_path, NULL);
        struct kvr_session * d = o ? new_dist(o, KVR_STRATEGY_KVR, 2, NULL, NULL) : NULL;
        CHECK(d && kvr_session_resume(d, dir, NULL, 0, &ri) == KVR_ERR_ARG && strstr(kvr_last_error(), "rank-0.kvlog: offset") &&
              strstr(kvr_last_error(), "the log is of another model"), "%s", kvr_last_error());
        kvr_session_free(d);
        kvr_model_free(o);
    } else {
        skip("refused: another model (no tiny-llama-Q8_0.gguf in the shared references)");
    }
    set_case("refused: logs of two runs in one directory, no logs");
    {
        const char * dir3 = tmp_path("refused3");
        CHECK(child_run(m, KVR_STRATEGY_KVR, 3, dir3, 3, false, NULL), "the child failed");
        char a[700], b[700];
        kvr_session_log_path(dir, 1, a, sizeof(a));
        kvr_session_log_path(dir3, 1, b, sizeof(b));
        size_t n;
        uint8_t * g = read_all(b, &n);
        write_all(a, g, n); // rank 1 of 3 ranks among the logs of 2
        free(g);
        struct kvr_session * d = new_dist(m, KVR_STRATEGY_KVR, 2, NULL, NULL);
        CHECK(kvr_session_resume(d, dir, prompt, N_PROMPT, &ri) == KVR_ERR_ARG && strstr(kvr_last_error(), "rank-1.kvlog: offset 68: ranks 3") &&
              kvr_session_n_past(d) == 0, "%s", kvr_last_error());
        CHECK(kvr_session_resume(d, tmp_path("nothing-here"), prompt, N_PROMPT, &ri) == KVR_ERR_IO && strstr(kvr_last_error(), "no replication logs"),
              "%s", kvr_last_error());
        // the same directory for the new logs with other ranks: refused before anything changes
        struct kvr_session * e = new_dist(m, KVR_STRATEGY_KVR, 2, dir3, NULL);
        CHECK(kvr_session_resume(e, dir3, prompt, N_PROMPT, &ri) == KVR_ERR_ARG && strstr(kvr_last_error(), "another directory") &&
              kvr_session_n_past(e) == 0, "%s", kvr_last_error());
        kvr_session_free(e);
        kvr_session_free(d);
    }
}

static void test_again(const struct kvr_model * m) {
    const int n_vocab = (int)m->hp.n_vocab;
    const enum kvr_strategy strats[] = { KVR_STRATEGY_KVR, KVR_STRATEGY_RING_Q };
    int32_t ref[N_GEN];
    float * rl = malloc(sizeof(float) * (size_t)n_vocab * N_GEN);
    for (int si = 0; si < 2; si++) {
        set_case("again: %s x3 killed after 3, resumed into the same logs, killed after 7, resumed", kvr_strategy_name(strats[si]));
        clean_run(m, strats[si], 3, ref, rl);
        const char * dir = tmp_path("again-%d", si);
        CHECK(child_run(m, strats[si], 3, dir, 3, false, NULL), "the first child failed");
        CHECK(child_run(m, strats[si], 3, dir, 7, false, dir), "the second child failed");
        resume_and_check(m, strats[si], 3, dir, ref, rl, 7, true, NULL);
        // and another directory for the new logs: they start with every restored row
        const char * dir2 = tmp_path("again-other-%d", si);
        CHECK(child_run(m, strats[si], 3, dir2, 9, false, dir), "the third child failed");
        resume_and_check(m, strats[si], 3, dir2, ref, rl, 3, true, NULL); // base (step 0), the last token again, 2 steps
    }
    free(rl);
}

int main(int argc, char ** argv) {
    const char * shared = "../shared";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) verbose = true;
        else shared = argv[i];
    }
    snprintf(tmp_dir, sizeof(tmp_dir), "%s/kvr-test-resume-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmp_dir)) { perror("mkdtemp"); return 2; }
    char path[1024], other[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared);
    snprintf(other, sizeof(other), "%s/reference/tiny-llama-Q8_0.gguf", shared);
    struct kvr_model * m = access(path, R_OK) == 0 ? kvr_model_load(path, NULL) : NULL;
    if (!m) {
        skip("%s is missing: the model cases are skipped", path);
    } else {
        const char * o = access(other, R_OK) == 0 ? other : NULL;
        test_format(m, o);
        test_killed(m);
        test_damage(m);
        test_fewer(m);
        test_refused(m, o);
        test_typed(m);
        test_linked_dir(m);
        test_again(m);
        kvr_model_free(m);
    }
    char cmd[700];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp_dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp_dir);
    return check_summary("resume");
}
