// kvr-comm.c - ranks: the transports (threads of one process, MPI processes), the endpoint kvr's
// comm protocol calls for communication nodes, the strategy passes that rewrite a rank's graph
// (tsp, KV-Runahead, ring pass-KV, ring pass-Q, the ring decode), and the driver that runs one
// eval on every rank: kvr_session_eval. Which backend runs a rank is a name in the params: this file
// sees backends only through kvr.h's seam (buffers, the eval road, optional counters and spans).
//
// Reading order: kvr_session_eval -> plan_eval (who holds which tokens) -> rank_eval (the rank's
// inputs, then the eval road kvr_eval_run with rank_pass) -> pass_* -> comm_exec (the transfers).
// After the driver, DejaVu: streaming the cache (to a file, or P/D to the decode rank), the
// replication logs and their format, replicas and failover recovery, the test hooks, saving,
// restoring and resuming. It enters the road only through the dejavu_* hooks declared before the
// endpoint; with none of it enabled they do nothing.

#define _GNU_SOURCE
#define KVR_BUILD   // kvr.h's internal part: the eval road, schedules, test hooks, replication logs
#include "kvr.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_MPI
#include <mpi.h>
#endif
#ifdef KVR_NCCL
#ifndef KVR_CUDA
#error "the NCCL transport is part of the CUDA build (make KVR_CUDA=1): it needs kvr_backend_cuda_stream"
#endif
#include <cuda_runtime.h>
#include <nccl.h>
#endif

//
// strategies and sharding
//

static const char * const strategy_names[KVR_STRATEGY_COUNT] = {
    "single", "tsp", "kvr", "ring-kv", "ring-q", "auto",
};

const char * kvr_strategy_name(enum kvr_strategy s) {
    return (unsigned)s < KVR_STRATEGY_COUNT ? strategy_names[s] : "?";
}

int kvr_strategy_parse(const char * name, enum kvr_strategy * out) {
    for (int i = 0; i < KVR_STRATEGY_COUNT; i++) {
        if (strcmp(name, strategy_names[i]) == 0) {
            *out = (enum kvr_strategy)i;
            return KVR_OK;
        }
    }
    return kvr_error(KVR_ERR_ARG, "unknown strategy '%s' (single, tsp, kvr, ring-kv, ring-q, auto)", name);
}

static const char * const cache_type_names[KVR_CACHE_TYPE_COUNT] = { "f16", "f32", "bf16", "q8_0" };
static const enum kvr_type cache_type_elems[KVR_CACHE_TYPE_COUNT] = { KVR_TYPE_F16, KVR_TYPE_F32, KVR_TYPE_BF16, KVR_TYPE_Q8_0 };

const char * kvr_cache_type_name(enum kvr_cache_type t) {
    return (unsigned)t < KVR_CACHE_TYPE_COUNT ? cache_type_names[t] : "?";
}

int kvr_cache_type_parse(const char * name, enum kvr_cache_type * out) {
    for (int i = 0; i < KVR_CACHE_TYPE_COUNT; i++) {
        if (strcmp(name, cache_type_names[i]) == 0) {
            *out = (enum kvr_cache_type)i;
            return KVR_OK;
        }
    }
    return kvr_error(KVR_ERR_ARG, "unknown cache type '%s' (f16, f32, bf16, q8_0)", name);
}

enum kvr_type kvr_cache_type_elem(enum kvr_cache_type t) {
    KVR_ASSERT((unsigned)t < KVR_CACHE_TYPE_COUNT);
    return cache_type_elems[t];
}

// chunk c of 2n chunks over T tokens: [T*c/(2n), T*(c+1)/(2n))
static int chunk_begin(int T, int n_chunks, int c) {
    return (int)((int64_t)T * c / n_chunks);
}

int kvr_ring_shard(int T, int P, int n_ranks, int rank, int32_t * pos) {
    const int nc = 2 * n_ranks;
    const int chunks[2] = { rank, nc - 1 - rank };
    int n = 0;
    for (int k = 0; k < 2; k++) {
        for (int t = chunk_begin(T, nc, chunks[k]); t < chunk_begin(T, nc, chunks[k] + 1); t++) {
            if (pos) pos[n] = P + t;
            n++;
        }
    }
    return n;
}

// A rank is useful to a prefill when the split gives it a token: one with none only relays (a
// ring step or a chain hop of transfers every layer) and holds a cache for nothing. Decode asks
// for no more: a chain decodes on its last rank alone, and a ring computes every new token on
// every rank (only the attention is split over the shards), so a rank past those the prompt fills
// adds a forward pass a step rather than sharing one. Rings are not held to 2N chunks of a token
// each (T >= 2N): a rank with one empty chunk still computes its other one alongside the rest.
int kvr_useful_ranks(enum kvr_strategy s, int T, int n_ranks, bool pd) {
    const int n = pd ? n_ranks - 1 : n_ranks;
    if (n < 1) return n_ranks;
    int u = 1;
    if (s == KVR_STRATEGY_TSP || s == KVR_STRATEGY_KVR) {
        u = T < n ? T : n;
    } else if (s != KVR_STRATEGY_SINGLE) { // the ring's shards: not monotonic in the count (T=4 fills 4 ranks, T=5 only 3)
        for (u = n; u > 1; u--) {
            int r = 0;
            while (r < u && kvr_ring_shard(T, 0, u, r, NULL) > 0) r++;
            if (r == u) break;
        }
    }
    if (u < 1) u = 1;
    return pd ? u + 1 : u;
}

enum kvr_strategy kvr_auto_pick(int T, int P, int n_ranks, int n_head, int n_head_kv, int head_dim,
                                enum kvr_cache_type type_k, enum kvr_cache_type type_v,
                                double flops, double bw, char * why, size_t cap) {
    // D cancels in both sides of the inequalities; it only sizes a row of the cache's types
    KVR_ASSERT((unsigned)type_k < KVR_CACHE_TYPE_COUNT && (unsigned)type_v < KVR_CACHE_TYPE_COUNT && head_dim > 0);
    const enum kvr_type tk = kvr_cache_type_elem(type_k), tv = kvr_cache_type_elem(type_v);
    const double e_kv = (double)(kvr_row_size(tk, head_dim) + kvr_row_size(tv, head_dim)) / (2.0 * head_dim);
    const double e_q = sizeof(float);
    const double N = n_ranks;
    const double t_min = N * flops * n_head_kv * e_kv / (2.0 * n_head * bw);
    const double miss = (double)T / (double)(T + P);
    const double miss_min = 2.0 * n_head_kv * e_kv / (n_head * e_q) - 4.0 * T * bw / (N * flops * e_q);
    const enum kvr_strategy pick = (T >= t_min || miss >= miss_min) ? KVR_STRATEGY_RING_KV : KVR_STRATEGY_RING_Q;
    if (why) {
        snprintf(why, cap, "auto: %s (Algorithm 5: T=%d >= %.0f is %s; T/(T+P)=%.4f >= 2*NKV*e_kv/(NH*e_q) - 4*T*BW/(N*C*e_q) = %.4f is %s;"
                 " N=%d NH=%d NKV=%d C=%.3g FLOP/s BW=%.3g B/s e_kv=%.4g (%s K, %s V) e_q=4)",
                 kvr_strategy_name(pick), T, t_min, T >= t_min ? "true" : "false", miss, miss_min,
                 miss >= miss_min ? "true" : "false", n_ranks, n_head, n_head_kv, flops, bw, e_kv, kvr_cache_type_name(type_k),
                 kvr_cache_type_name(type_v));
    }
    return pick;
}

//
// transports: isend / irecv / wait with a deadline; a failed rank tells the others
//

struct tr_req {
    void *       buf;
    size_t       n;
    int          me, peer, tag;
    bool         is_send;
    bool         done;
    double       ready_at;  // link emulation: the data may not be used before this time (ms)
    double       t_post;
    int          seq;       // its index in the rank's schedule (-1: outside it, the logits)
    int          group;     //   and the schedule's group it was issued in (NCCL waits for the group)
    bool         posted;    // handed to the transport (and not yet given up)
    int          match_rank, match_seq; // local: the peer's request it was delivered with
#ifdef KVR_MPI
    MPI_Request  mpi;
#endif
};

struct transport {
    int  (*isend)(struct transport * t, struct tr_req * r);
    int  (*irecv)(struct transport * t, struct tr_req * r);
    // KVR_OK when done; KVR_ERR_COMM on timeout or when another rank failed (message set)
    int  (*wait) (struct transport * t, struct tr_req * r, double deadline_ms, double timeout_s);
    void (*fail) (struct transport * t, int rank, const char * msg);
    void (*cancel)(struct transport * t, struct tr_req * r); // the request will never be waited for
    void (*idle) (struct transport * t, double deadline_ms); // sleep until then or a failure
    void (*free) (struct transport * t);
    int          n_ranks;
    double       link_gbps;
    double       link_latency_us;
    // optional (NULL: every operation stands alone): the operations posted between these two
    // calls are one group of the schedule (NCCL: ncclGroupStart/End)
    int  (*group_begin)(struct transport * t, int rank, int group);
    int  (*group_end)  (struct transport * t, int rank, int group);
    // receives match by tag (local, MPI): each is posted as soon as its memory is known (the
    // graph's start), not with its group, so a peer's sends are taken even while this rank is
    // stopped in a wait; NCCL pairs by order and posts a group's receives with its sends
    bool early_recv;
    // optional (NULL: memcpy): a collective's own part, within the rank's memory (NCCL: device)
    int  (*copy)(struct transport * t, int rank, void * dst, const void * src, size_t n);
};

static int wait_error(const struct tr_req * r, double timeout_s) {
    const int tag = r->tag;
    if (tag >= 0 && kvr_tag_kind(tag) == KVR_TAG_LOGITS) { // outside the schedule: no layer, no step
        const char * what = kvr_tag_step(tag) ? "the step to resume from" : "the logits";
        if (r->is_send) return kvr_error(KVR_ERR_COMM, "rank %d: timed out after %.1f s waiting for rank %d to take %s", r->me, timeout_s, r->peer, what);
        return kvr_error(KVR_ERR_COMM, "rank %d: timed out after %.1f s waiting for %s from rank %d", r->me, timeout_s, what, r->peer);
    }
    if (r->is_send) {
        return kvr_error(KVR_ERR_COMM, "rank %d: timed out after %.1f s waiting for rank %d to take %s of layer %d (step %d)",
                         r->me, timeout_s, r->peer, kvr_tag_kind_name(kvr_tag_kind(tag)), kvr_tag_layer(tag), kvr_tag_step(tag));
    }
    return kvr_error(KVR_ERR_COMM, "rank %d: timed out after %.1f s waiting for %s of layer %d (step %d) from rank %d",
                     r->me, timeout_s, kvr_tag_kind_name(kvr_tag_kind(tag)), kvr_tag_layer(tag), kvr_tag_step(tag), r->peer);
}

// the local transport: ranks are threads; a send is matched with a posted receive and copied
// once, straight from the sender's memory into the receiver's (the sender keeps its memory
// alive until the graph ends, so a send that finds no receive yet just waits to be taken)

struct local_world {
    struct transport   tr;
    pthread_mutex_t    mu;
    pthread_cond_t     cv;
    struct tr_req   ** sends;   // unmatched sends
    int                n_sends, cap_sends;
    struct tr_req   ** recvs;   // unmatched receives
    int                n_recvs, cap_recvs;
    double           * link_free; // [src*n + dst]: when the emulated link is free again (ms)
    double             noise;     // slowdown of the noisy pair (1: none)
    int                noisy_a;   // the noisy pair of this eval: noisy_a and noisy_a+1 (mod n)
    uint64_t           noise_rng;
    int              * wait_peer; // [rank]: whom a rank is blocked on now (-1: nobody), and for what
    int              * wait_tag;  //   (a timeout follows this chain to the rank that stopped)
    bool               failed;
    char               fail_msg[512];
    int                stopped;   // the rank the first timeout's chain ended at, waiting for nobody
    double             t_stopped; //   (-1: none), and since when at least (its peer's wait began)
};

static void req_list_add(struct tr_req *** list, int * n, int * cap, struct tr_req * r) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 16;
        *list = realloc(*list, sizeof(**list) * (size_t)*cap);
        KVR_ASSERT(*list != NULL);
    }
    (*list)[(*n)++] = r;
}

static void req_list_del(struct tr_req ** list, int * n, int i) {
    memmove(&list[i], &list[i + 1], sizeof(*list) * (size_t)(*n - i - 1));
    (*n)--;
}

// called with the lock held: copy and complete both sides
static int local_deliver(struct local_world * w, struct tr_req * s, struct tr_req * r) {
    if (s->n != r->n) {
        return kvr_error(KVR_ERR_COMM, "rank %d: %s of layer %d from rank %d has %zu bytes, expected %zu (the ranks disagree on the plan)",
                         r->me, kvr_tag_kind_name(kvr_tag_kind(r->tag)), kvr_tag_layer(r->tag), s->me, s->n, r->n);
    }
    if (s->n) memcpy(r->buf, s->buf, s->n);
    double ready = kvr_time_ms();
    if (w->tr.link_gbps > 0 || w->tr.link_latency_us > 0) {
        // the link serializes transfers between one pair; the copy itself stands for no time
        double * busy = &w->link_free[s->me * w->tr.n_ranks + r->me];
        double start = s->t_post > *busy ? s->t_post : *busy;
        double xfer = w->tr.link_gbps > 0 ? (double)s->n * 8.0 / (w->tr.link_gbps * 1e9) * 1e3 : 0.0;
        const int n = w->tr.n_ranks, b = (w->noisy_a + 1) % n;
        if (w->noise > 1.0 && n > 1 && ((s->me == w->noisy_a && r->me == b) || (s->me == b && r->me == w->noisy_a))) {
            xfer *= w->noise;
        }
        *busy = start + xfer;
        ready = start + xfer + w->tr.link_latency_us * 1e-3;
    }
    s->ready_at = r->ready_at = ready;
    s->done = r->done = true;
    s->match_rank = r->me;
    s->match_seq  = r->seq;
    r->match_rank = s->me;
    r->match_seq  = s->seq;
    pthread_cond_broadcast(&w->cv);
    return KVR_OK;
}

static int local_isend(struct transport * t, struct tr_req * r) {
    struct local_world * w = (struct local_world *)t;
    int rc = KVR_OK;
    pthread_mutex_lock(&w->mu);
    r->t_post = kvr_time_ms();
    int i = 0;
    for (; i < w->n_recvs; i++) {
        struct tr_req * q = w->recvs[i];
        if (q->peer == r->me && q->me == r->peer && q->tag == r->tag) break;
    }
    if (i < w->n_recvs) {
        struct tr_req * q = w->recvs[i];
        req_list_del(w->recvs, &w->n_recvs, i);
        rc = local_deliver(w, r, q);
    } else {
        req_list_add(&w->sends, &w->n_sends, &w->cap_sends, r);
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

static int local_irecv(struct transport * t, struct tr_req * r) {
    struct local_world * w = (struct local_world *)t;
    int rc = KVR_OK;
    pthread_mutex_lock(&w->mu);
    r->t_post = kvr_time_ms();
    int i = 0;
    for (; i < w->n_sends; i++) {
        struct tr_req * s = w->sends[i];
        if (s->me == r->peer && s->peer == r->me && s->tag == r->tag) break;
    }
    if (i < w->n_sends) {
        struct tr_req * s = w->sends[i];
        req_list_del(w->sends, &w->n_sends, i);
        rc = local_deliver(w, s, r);
    } else {
        req_list_add(&w->recvs, &w->n_recvs, &w->cap_recvs, r);
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

static void local_forget(struct local_world * w, struct tr_req * r) {
    for (int i = 0; i < w->n_sends; i++) if (w->sends[i] == r) { req_list_del(w->sends, &w->n_sends, i); return; }
    for (int i = 0; i < w->n_recvs; i++) if (w->recvs[i] == r) { req_list_del(w->recvs, &w->n_recvs, i); return; }
}

// called with the lock held, after r timed out: who is the peer waiting for, and so on
static void local_explain(struct local_world * w, const struct tr_req * r, char * buf, size_t cap) {
    buf[0] = 0;
    int p = r->peer, hops = 0;
    size_t n = 0;
    while (p >= 0 && p < w->tr.n_ranks && w->wait_peer[p] >= 0 && hops < w->tr.n_ranks && n < cap) {
        const int q = w->wait_peer[p], tag = w->wait_tag[p];
        n += (size_t)snprintf(buf + n, cap - n, "; rank %d is itself waiting for %s of layer %d (step %d) from rank %d",
                              p, kvr_tag_kind_name(kvr_tag_kind(tag)), kvr_tag_layer(tag), kvr_tag_step(tag), q);
        p = q;
        hops++;
    }
    if (hops > 0 && n < cap && p >= 0 && p < w->tr.n_ranks && w->wait_peer[p] < 0) {
        snprintf(buf + n, cap - n, "; rank %d waits for nobody: it stopped", p);
    }
}

// called with the lock held, at the eval's first timeout (on r, whose wait began at t_wait): the
// rank at the end of the chain of waits from r's peer, when it waits for nobody, is the one that
// stopped (a stalled thread, or one stuck in its compute); a chain that comes back to r's rank is
// a cycle, and no rank is blamed. --replicate declares that rank lost (dejavu_ranks_joined).
static void local_find_stopped(struct local_world * w, const struct tr_req * r, double t_wait) {
    int p = r->peer;
    for (int hops = 0; p >= 0 && p < w->tr.n_ranks && w->wait_peer[p] >= 0 && hops <= w->tr.n_ranks; hops++) p = w->wait_peer[p];
    if (p >= 0 && p < w->tr.n_ranks && p != r->me && w->wait_peer[p] < 0) {
        w->stopped = p;
        w->t_stopped = t_wait;
    }
}

// the driver's wait for a rank's thread timed out (join_ranks): that rank stopped, unless a
// transfer's timeout found one first
static void local_mark_stopped(struct transport * t, int rank, double since) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    if (w->stopped < 0) {
        w->stopped = rank;
        w->t_stopped = since;
    }
    pthread_mutex_unlock(&w->mu);
}

// the rank the eval's first timeout found stopped (-1: none) and since when at least
static int local_stopped(struct transport * t, double * since) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    const int p = w->stopped;
    *since = w->t_stopped;
    pthread_mutex_unlock(&w->mu);
    return p;
}

static int local_wait(struct transport * t, struct tr_req * r, double deadline, double timeout_s) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    if (r->tag >= 0 && !r->is_send) {
        w->wait_peer[r->me] = r->peer;
        w->wait_tag[r->me] = r->tag;
    }
    while (!r->done && !w->failed) {
        double now = kvr_time_ms();
        if (now >= deadline) break;
        double until = deadline < now + 100.0 ? deadline : now + 100.0;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double add = until - now;
        ts.tv_sec  += (time_t)(add / 1e3);
        ts.tv_nsec += (long)(fmod(add, 1e3) * 1e6);
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    int rc = KVR_OK;
    if (!r->done) {
        local_forget(w, r); // the peer must not copy into memory we are about to give up
        if (w->failed) {
            rc = kvr_error(KVR_ERR_COMM, "rank %d: aborted: %s", r->me, w->fail_msg);
        } else {
            if (r->tag >= 0 && w->stopped < 0) local_find_stopped(w, r, deadline - 1e3 * timeout_s);
            char chain[512];
            local_explain(w, r, chain, sizeof(chain));
            wait_error(r, timeout_s);
            char msg[1024];
            snprintf(msg, sizeof(msg), "%s", kvr_last_error());
            rc = kvr_error(KVR_ERR_COMM, "%s%s", msg, chain);
        }
    }
    // a rank that gave up still points at its peer until the eval ends (local_reset): between
    // its timeout and its fail() another rank's timeout may walk the chain, and must pass
    // through it to the rank that stopped rather than blame it for waiting for nobody
    if (r->tag >= 0 && !r->is_send && (rc == KVR_OK || w->failed)) w->wait_peer[r->me] = -1;
    const double ready = r->ready_at;
    pthread_mutex_unlock(&w->mu);
    if (rc == KVR_OK && !r->is_send) {
        // the emulated link's delay counts against the deadline as a real link's would: a link
        // too slow for the timeout (--link-gbps 1e-9) fails the run instead of stalling it
        const double now = kvr_time_ms(), until = ready < deadline ? ready : deadline;
        for (double left = until - now; left > 0; left = until - kvr_time_ms()) {
            usleep((useconds_t)(left < 1e5 ? left * 1e3 : 1e8)); // usleep takes at most ~71 min
        }
        if (ready > deadline) {
            wait_error(r, timeout_s);
            char msg[1024];
            snprintf(msg, sizeof(msg), "%s", kvr_last_error());
            rc = kvr_error(KVR_ERR_COMM, "%s (the emulated link delivers it %.3g s after the deadline)", msg, (ready - deadline) / 1e3);
        }
    }
    return rc;
}

static void local_cancel(struct transport * t, struct tr_req * r) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    local_forget(w, r);
    pthread_mutex_unlock(&w->mu);
}

static void local_idle(struct transport * t, double deadline) {
    struct tr_req never = { .tag = -1 };
    local_wait(t, &never, deadline, 0);
}

static void local_fail(struct transport * t, int rank, const char * msg) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    if (!w->failed) {
        w->failed = true;
        snprintf(w->fail_msg, sizeof(w->fail_msg), "%s", msg);
    }
    (void)rank;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void local_free(struct transport * t) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->sends);
    free(w->recvs);
    free(w->link_free);
    free(w->wait_peer);
    free(w->wait_tag);
    free(w);
}

static struct transport * local_new(int n_ranks, double gbps, double latency_us, double noise, uint64_t seed) {
    struct local_world * w = calloc(1, sizeof(*w));
    KVR_ASSERT(w != NULL);
    w->noise = noise;
    w->noise_rng = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->link_free = calloc((size_t)n_ranks * (size_t)n_ranks, sizeof(double));
    w->wait_peer = malloc(sizeof(int) * (size_t)n_ranks);
    w->wait_tag  = calloc((size_t)n_ranks, sizeof(int));
    for (int i = 0; i < n_ranks; i++) w->wait_peer[i] = -1;
    w->stopped = -1;
    w->tr = (struct transport) { .isend = local_isend, .irecv = local_irecv, .wait = local_wait, .fail = local_fail, .cancel = local_cancel,
                                 .idle = local_idle, .free = local_free, .n_ranks = n_ranks, .link_gbps = gbps, .link_latency_us = latency_us,
                                 .early_recv = true };
    return &w->tr;
}

// starting a new eval forgets an earlier failure
static void local_reset(struct transport * t) {
    struct local_world * w = (struct local_world *)t;
    pthread_mutex_lock(&w->mu);
    w->failed = false;
    w->fail_msg[0] = 0;
    w->stopped = -1;
    w->n_sends = w->n_recvs = 0;
    for (int i = 0; i < w->tr.n_ranks; i++) w->wait_peer[i] = -1;
    for (int i = 0; i < w->tr.n_ranks * w->tr.n_ranks; i++) w->link_free[i] = 0.0;
    if (w->noise > 1.0) { // xorshift: a new noisy pair every eval
        w->noise_rng ^= w->noise_rng << 13;
        w->noise_rng ^= w->noise_rng >> 7;
        w->noise_rng ^= w->noise_rng << 17;
        w->noisy_a = (int)(w->noise_rng % (uint64_t)w->tr.n_ranks);
    }
    pthread_mutex_unlock(&w->mu);
}

#ifdef KVR_MPI
// the MPI transport: ranks are processes. A failure cannot be undone: the rank that sees it
// prints the message and aborts the job, which ends every other rank with it. The abort's error
// code is what mpirun exits with: 1, a run that failed once started (kvr-run's, the README's).
#define MPI_FAIL_EXIT 1

static int mpi_isend(struct transport * t, struct tr_req * r) {
    (void)t;
    KVR_ASSERT(r->n <= (size_t)INT_MAX);
    r->t_post = kvr_time_ms();
    int rc = MPI_Isend(r->buf, (int)r->n, MPI_BYTE, r->peer, r->tag, MPI_COMM_WORLD, &r->mpi);
    return rc == MPI_SUCCESS ? KVR_OK : kvr_error(KVR_ERR_COMM, "rank %d: MPI_Isend to rank %d failed (%d)", r->me, r->peer, rc);
}

static int mpi_irecv(struct transport * t, struct tr_req * r) {
    (void)t;
    KVR_ASSERT(r->n <= (size_t)INT_MAX);
    r->t_post = kvr_time_ms();
    int rc = MPI_Irecv(r->buf, (int)r->n, MPI_BYTE, r->peer, r->tag, MPI_COMM_WORLD, &r->mpi);
    return rc == MPI_SUCCESS ? KVR_OK : kvr_error(KVR_ERR_COMM, "rank %d: MPI_Irecv from rank %d failed (%d)", r->me, r->peer, rc);
}

static int mpi_wait(struct transport * t, struct tr_req * r, double deadline, double timeout_s) {
    (void)t;
    for (int spins = 0; ; spins++) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Test(&r->mpi, &flag, &st) != MPI_SUCCESS) {
            return kvr_error(KVR_ERR_COMM, "rank %d: MPI_Test failed", r->me);
        }
        if (flag) {
            if (!r->is_send) {
                int count = 0;
                MPI_Get_count(&st, MPI_BYTE, &count);
                if ((size_t)count != r->n) {
                    return kvr_error(KVR_ERR_COMM, "rank %d: %s of layer %d from rank %d has %d bytes, expected %zu (the ranks disagree on the plan)",
                                     r->me, kvr_tag_kind_name(kvr_tag_kind(r->tag)), kvr_tag_layer(r->tag), r->peer, count, r->n);
                }
            }
            r->done = true;
            return KVR_OK;
        }
        if (kvr_time_ms() >= deadline) return wait_error(r, timeout_s);
        if (spins > 1000) usleep(50);
    }
}

static void mpi_fail(struct transport * t, int rank, const char * msg) {
    (void)t;
    (void)rank; // the message names it
    fprintf(stderr, "kvr: %s\n", msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, MPI_FAIL_EXIT);
}

static void mpi_cancel(struct transport * t, struct tr_req * r) {
    (void)t;
    if (!r->done) {
        MPI_Cancel(&r->mpi);
        MPI_Request_free(&r->mpi);
    }
}

static void mpi_idle(struct transport * t, double deadline) {
    (void)t;
    while (kvr_time_ms() < deadline) usleep(10000);
}

static void mpi_finalize(void) {
    int done = 0;
    MPI_Finalized(&done);
    if (done) return;
    MPI_Barrier(MPI_COMM_WORLD); // nobody leaves while a peer may still talk to it
    MPI_Finalize();
}

static void mpi_free(struct transport * t) {
    free(t);
}
#endif

#ifdef KVR_NCCL
// the NCCL transport: ranks are GPUs. A thin mapping of the schedule: each group of it becomes
// ncclGroupStart, an ncclSend or ncclRecv per transfer, ncclGroupEnd, on the rank's
// communication stream; that stream first waits for an event recorded on the compute stream (so
// what a send reads exists, and a receive does not land in memory still being read), and an
// event recorded after the group is what a wait polls; the compute stream then waits for it too.
// NCCL pairs a rank's sends to a peer with the peer's receives in order, which the schedule
// guarantees (tests/test-schedule.c).
//
// Communicators are non-blocking (ncclConfig_t.blocking = 0): no NCCL call can hang the host.
// Every wait polls the group's event and ncclCommGetAsyncError against the deadline; past it the
// communicator is aborted (ncclCommAbort) and the error names peer, layer and transfer as the
// other transports' do. NCCL cannot withdraw one operation, so a transfer given up (after a
// failure) aborts the communicator: like MPI, a failed session is not used again.
//
// Two launch shapes: one process drives every rank's GPU (rank i on device i, a thread each, the
// communicators made together from one unique id), or one process per GPU under mpirun (the
// unique id broadcast over MPI, ncclCommInitRankConfig in each; the logits travel over MPI).

struct nccl_rank {
    int          rank;          // global
    int          device;
    ncclComm_t   comm;
    bool         live;          // comm was made (and not yet aborted or destroyed)
    cudaStream_t stream;        // transfers
    cudaStream_t compute;       // the backend's compute stream (kvr_backend_cuda_stream)
    cudaEvent_t  ready;         // recorded on compute before a group
    cudaEvent_t * done;         // per group: recorded on stream after it
    int          n_done;
    int          wait_peer, wait_tag; // whom this rank is blocked on now (-1: nobody)
};

struct nccl_world {
    struct transport   tr;
    struct nccl_rank * r;       // the ranks of this process
    int                n_local;
    int                first;   // global rank of r[0]
    bool               mpi;     // one process per GPU: a failure ends the job (MPI_Abort)
    double             timeout_s;
    pthread_mutex_t    mu;
    bool               failed;
    char               fail_msg[512];
    int                stopped;   // the rank the first timeout's chain ended at, waiting for nobody
    double             t_stopped; //   (-1: none), and since when at least (its peer's wait began)
};

static struct nccl_rank * nccl_rank_of(struct transport * t, int rank) {
    struct nccl_world * w = (struct nccl_world *)t;
    KVR_ASSERT(rank >= w->first && rank < w->first + w->n_local);
    return &w->r[rank - w->first];
}

static int nccl_fail_call(const struct nccl_rank * nr, const char * call, ncclResult_t e) {
    const char * last = nr->live ? ncclGetLastError(nr->comm) : NULL;
    return kvr_error(KVR_ERR_COMM, "rank %d (cuda:%d): %s failed: %s%s%s", nr->rank, nr->device, call, ncclGetErrorString(e),
                     last && last[0] ? ": " : "", last ? last : "");
}

static int cuda_fail_call(const struct nccl_rank * nr, const char * call, cudaError_t e) {
    return kvr_error(KVR_ERR_DEVICE, "rank %d (cuda:%d): %s failed: %s (%s)", nr->rank, nr->device, call, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define NCCL_TRY(nr, call) do { const ncclResult_t e_ = (call); \
    if (e_ != ncclSuccess && e_ != ncclInProgress) return nccl_fail_call(nr, #call, e_); } while (0)
#define CUDA_TRY(nr, call) do { const cudaError_t e_ = (call); \
    if (e_ != cudaSuccess) return cuda_fail_call(nr, #call, e_); } while (0)

static void nccl_abort(struct nccl_rank * nr) {
    if (!nr->live) return;
    ncclCommAbort(nr->comm);
    nr->live = false;
}

// A non-blocking communicator may still be working on the last call (ncclInProgress): poll it
// until it is done, fails, or the deadline passes.
static int nccl_settle(struct nccl_rank * nr, const char * what, double deadline, double timeout_s) {
    for (int polls = 0;; polls++) {
        ncclResult_t st = ncclSuccess;
        const ncclResult_t e = ncclCommGetAsyncError(nr->comm, &st);
        if (e != ncclSuccess) return nccl_fail_call(nr, "ncclCommGetAsyncError", e);
        if (st == ncclSuccess) return KVR_OK;
        if (st != ncclInProgress) {
            const int rc = nccl_fail_call(nr, what, st);
            nccl_abort(nr);
            return rc;
        }
        if (kvr_time_ms() >= deadline) {
            nccl_abort(nr);
            return kvr_error(KVR_ERR_COMM, "rank %d (cuda:%d): %s did not finish within %.1f s", nr->rank, nr->device, what, timeout_s);
        }
        if (polls > 64) usleep(polls > 4096 ? 1000 : 20);
    }
}

static bool nccl_failed(struct nccl_world * w, char * msg, size_t cap) {
    pthread_mutex_lock(&w->mu);
    const bool f = w->failed;
    if (f && msg) snprintf(msg, cap, "%s", w->fail_msg);
    pthread_mutex_unlock(&w->mu);
    return f;
}

static int nccl_group_begin(struct transport * t, int rank, int group) {
    struct nccl_rank * nr = nccl_rank_of(t, rank);
    if (!nr->live) return kvr_error(KVR_ERR_COMM, "rank %d: the NCCL communicator was aborted by an earlier failure", rank);
    CUDA_TRY(nr, cudaSetDevice(nr->device));
    if (group >= nr->n_done) {
        const int n = group + 64;
        nr->done = realloc(nr->done, sizeof(*nr->done) * (size_t)n);
        KVR_ASSERT(nr->done != NULL);
        for (; nr->n_done < n; nr->n_done++) CUDA_TRY(nr, cudaEventCreateWithFlags(&nr->done[nr->n_done], cudaEventDisableTiming));
    }
    // the group starts once everything queued on the compute stream so far is done
    CUDA_TRY(nr, cudaEventRecord(nr->ready, nr->compute));
    CUDA_TRY(nr, cudaStreamWaitEvent(nr->stream, nr->ready, 0));
    NCCL_TRY(nr, ncclGroupStart());
    return KVR_OK;
}

static int nccl_isend(struct transport * t, struct tr_req * r) {
    struct nccl_rank * nr = nccl_rank_of(t, r->me);
    r->t_post = kvr_time_ms();
    NCCL_TRY(nr, ncclSend(r->buf, r->n, ncclInt8, r->peer, nr->comm, nr->stream));
    return KVR_OK;
}

static int nccl_irecv(struct transport * t, struct tr_req * r) {
    struct nccl_rank * nr = nccl_rank_of(t, r->me);
    r->t_post = kvr_time_ms();
    NCCL_TRY(nr, ncclRecv(r->buf, r->n, ncclInt8, r->peer, nr->comm, nr->stream));
    return KVR_OK;
}

static int nccl_group_end(struct transport * t, int rank, int group) {
    struct nccl_world * w = (struct nccl_world *)t;
    struct nccl_rank * nr = nccl_rank_of(t, rank);
    const ncclResult_t e = ncclGroupEnd();
    if (e != ncclSuccess && e != ncclInProgress) return nccl_fail_call(nr, "ncclGroupEnd", e);
    if (e == ncclInProgress) { // the launch itself is still going on
        int rc = nccl_settle(nr, "ncclGroupEnd", kvr_time_ms() + 1e3 * w->timeout_s, w->timeout_s);
        if (rc != KVR_OK) return rc;
    }
    CUDA_TRY(nr, cudaEventRecord(nr->done[group], nr->stream));
    return KVR_OK;
}

// who the ranks of this process wait for: a timeout names the chain to the rank that stopped
static void nccl_explain(struct nccl_world * w, const struct tr_req * r, char * buf, size_t cap) {
    buf[0] = 0;
    size_t n = 0;
    int p = r->peer;
    for (int hops = 0; hops < w->n_local && n < cap; hops++) {
        if (p < w->first || p >= w->first + w->n_local || w->r[p - w->first].wait_peer < 0) break;
        const struct nccl_rank * q = &w->r[p - w->first];
        n += (size_t)snprintf(buf + n, cap - n, "; rank %d is itself waiting for %s of layer %d (step %d) from rank %d", p,
                              kvr_tag_kind_name(kvr_tag_kind(q->wait_tag)), kvr_tag_layer(q->wait_tag), kvr_tag_step(q->wait_tag), q->wait_peer);
        p = q->wait_peer;
    }
}

static int nccl_wait(struct transport * t, struct tr_req * r, double deadline, double timeout_s) {
    struct nccl_world * w = (struct nccl_world *)t;
    struct nccl_rank * nr = nccl_rank_of(t, r->me);
    if (!nr->live) return kvr_error(KVR_ERR_COMM, "rank %d: the NCCL communicator was aborted by an earlier failure", r->me);
    KVR_ASSERT(r->group >= 0 && r->group < nr->n_done);
    const cudaEvent_t ev = nr->done[r->group];
    if (!r->is_send) { nr->wait_peer = r->peer; nr->wait_tag = r->tag; }
    int rc = KVR_OK;
    char msg[512];
    for (int polls = 0;; polls++) {
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) { rc = cuda_fail_call(nr, "cudaEventQuery", e); break; }
        ncclResult_t st = ncclSuccess;
        const ncclResult_t e2 = ncclCommGetAsyncError(nr->comm, &st);
        if (e2 != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
            rc = nccl_fail_call(nr, "a transfer", e2 != ncclSuccess ? e2 : st);
            break;
        }
        if (nccl_failed(w, msg, sizeof(msg))) { rc = kvr_error(KVR_ERR_COMM, "rank %d: aborted: %s", r->me, msg); break; }
        if (kvr_time_ms() >= deadline) {
            char chain[512];
            nccl_explain(w, r, chain, sizeof(chain));
            wait_error(r, timeout_s);
            snprintf(msg, sizeof(msg), "%s", kvr_last_error());
            rc = kvr_error(KVR_ERR_COMM, "%s%s", msg, chain);
            break;
        }
        if (polls > 64) usleep(polls > 4096 ? 1000 : 20);
    }
    if (!r->is_send) nr->wait_peer = -1;
    if (rc != KVR_OK) {
        nccl_abort(nr); // its streams may hold transfers that will never match
        return rc;
    }
    // what reads the received data runs on the compute stream: after the transfer
    if (!r->is_send) CUDA_TRY(nr, cudaStreamWaitEvent(nr->compute, ev, 0));
    r->done = true;
    return KVR_OK;
}

static void nccl_fail(struct transport * t, int rank, const char * msg) {
    struct nccl_world * w = (struct nccl_world *)t;
    pthread_mutex_lock(&w->mu);
    if (!w->failed) {
        w->failed = true;
        snprintf(w->fail_msg, sizeof(w->fail_msg), "%s", msg);
    }
    pthread_mutex_unlock(&w->mu);
#ifdef KVR_MPI
    if (w->mpi) { // as the MPI transport: the message, then every process ends
        fprintf(stderr, "kvr: %s\n", msg);
        fflush(stderr);
        nccl_abort(nccl_rank_of(t, rank));
        MPI_Abort(MPI_COMM_WORLD, MPI_FAIL_EXIT);
    }
#else
    (void)rank;
#endif
}

// NCCL cannot withdraw one transfer: a rank that gives one up gives up its communicator
static void nccl_cancel(struct transport * t, struct tr_req * r) {
    if (!r->done) nccl_abort(nccl_rank_of(t, r->me));
}

static void nccl_idle(struct transport * t, double deadline) {
    struct nccl_world * w = (struct nccl_world *)t;
    while (kvr_time_ms() < deadline && !nccl_failed(w, NULL, 0)) usleep(10000);
}

// a collective's own part: a device-to-device copy on the compute stream
static int nccl_copy(struct transport * t, int rank, void * dst, const void * src, size_t n) {
    struct nccl_rank * nr = nccl_rank_of(t, rank);
    CUDA_TRY(nr, cudaSetDevice(nr->device));
    CUDA_TRY(nr, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, nr->compute));
    return KVR_OK;
}

// the end of a session: communicators finalized (flushed) then destroyed, or aborted when that
// does not finish in time
static void nccl_free(struct transport * t) {
    struct nccl_world * w = (struct nccl_world *)t;
    for (int i = 0; i < w->n_local; i++) {
        struct nccl_rank * nr = &w->r[i];
        cudaSetDevice(nr->device);
        if (nr->live) {
            const ncclResult_t e = ncclCommFinalize(nr->comm);
            if ((e == ncclSuccess || e == ncclInProgress) &&
                nccl_settle(nr, "ncclCommFinalize", kvr_time_ms() + 1e3 * w->timeout_s, w->timeout_s) == KVR_OK) {
                ncclCommDestroy(nr->comm);
                nr->live = false;
            }
            nccl_abort(nr);
        }
        for (int k = 0; k < nr->n_done; k++) cudaEventDestroy(nr->done[k]);
        free(nr->done);
        if (nr->ready) cudaEventDestroy(nr->ready);
        if (nr->stream) cudaStreamDestroy(nr->stream);
    }
    pthread_mutex_destroy(&w->mu);
    free(w->r);
    free(w);
}

// The communicators of the ranks [first, first+n_local) of n_ranks, on the given devices: made
// together in one group (one process, one unique id) or one per process (id from rank 0).
// Everything waits at most timeout_s; NULL + error on failure.
static struct transport * nccl_new(int n_ranks, int first, int n_local, const int * devices, ncclUniqueId id, bool mpi,
                                   double timeout_s) {
    struct nccl_world * w = calloc(1, sizeof(*w));
    KVR_ASSERT(w != NULL);
    w->tr = (struct transport) { .isend = nccl_isend, .irecv = nccl_irecv, .wait = nccl_wait, .fail = nccl_fail,
                                 .cancel = nccl_cancel, .idle = nccl_idle, .free = nccl_free, .n_ranks = n_ranks,
                                 .group_begin = nccl_group_begin, .group_end = nccl_group_end, .copy = nccl_copy };
    w->r = calloc((size_t)n_local, sizeof(*w->r));
    KVR_ASSERT(w->r != NULL);
    w->n_local = n_local;
    w->first = first;
    w->mpi = mpi;
    w->timeout_s = timeout_s;
    pthread_mutex_init(&w->mu, NULL);
    int rc = KVR_OK;
    for (int i = 0; i < n_local && rc == KVR_OK; i++) {
        struct nccl_rank * nr = &w->r[i];
        nr->rank = first + i;
        nr->device = devices[i];
        nr->wait_peer = -1;
        cudaError_t e = cudaSetDevice(nr->device);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&nr->stream, cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&nr->ready, cudaEventDisableTiming);
        if (e != cudaSuccess) rc = cuda_fail_call(nr, "setting up the communication stream", e);
    }
    if (rc == KVR_OK) {
        // non-blocking communicators: initialisation returns at once and is polled below
        ncclResult_t e = ncclGroupStart();
        for (int i = 0; i < n_local && e == ncclSuccess; i++) {
            struct nccl_rank * nr = &w->r[i];
            ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
            cfg.blocking = 0;
            if (cudaSetDevice(nr->device) != cudaSuccess) break;
            e = ncclCommInitRankConfig(&nr->comm, n_ranks, id, nr->rank, &cfg);
            if (e == ncclInProgress) e = ncclSuccess;
            if (e == ncclSuccess) nr->live = true;
        }
        const ncclResult_t e2 = ncclGroupEnd();
        if (e == ncclSuccess && e2 != ncclInProgress) e = e2;
        if (e != ncclSuccess) rc = nccl_fail_call(&w->r[0], "ncclCommInitRankConfig", e);
    }
    const double deadline = kvr_time_ms() + 1e3 * timeout_s;
    for (int i = 0; i < n_local && rc == KVR_OK; i++) {
        rc = nccl_settle(&w->r[i], "NCCL communicator initialisation (are all ranks started? NCCL_DEBUG=INFO tells more)",
                         deadline, timeout_s);
    }
    if (rc != KVR_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", kvr_last_error());
        for (int i = 0; i < n_local; i++) nccl_abort(&w->r[i]);
        nccl_free(&w->tr);
        kvr_error(KVR_ERR_COMM, "%s", msg);
        return NULL;
    }
    return &w->tr;
}

// the compute stream of a local rank, from its CUDA backend
static void nccl_set_compute(struct transport * t, int rank, void * stream) {
    nccl_rank_of(t, rank)->compute = (cudaStream_t)stream;
}
#endif // KVR_NCCL

//
// the schedule: which transfers a rank's graph asks for, grouped and ordered (see kvr.h)
//

#define PEER_STREAM  (-2) // a SEND to this peer goes to the rank's stream, not to a rank
#define PEER_LOG     (-3) // and to this one, to the rank's replication log
#define PEER_KILL    (-4) // a SEND to this peer is the test hook KVR_TEST_KILL: the rank is lost there
#define PEER_REPLICA (-5) // a SEND to this peer copies rows into the rank's replica on its successor
#define STREAM_STEP  200  // the tag steps of a cache streamed to the decode rank (P/D): 200 and 201

// a SEND to a pseudo-peer (PEER_STREAM and the ones below it) stays in this process: it hands rows
// to the rank's file stream, its replication log or its replica, or is the kill hook (all of them
// DejaVu's, dejavu_comm_exec); no transfer, no peer, not in the schedule
static bool node_is_dejavu(const struct kvr_tensor * t) {
    return t->op == KVR_OP_SEND && t->op_params[0] <= PEER_STREAM;
}

static bool node_is_xfer(const struct kvr_tensor * t) {
    return (t->op == KVR_OP_SEND && !node_is_dejavu(t)) || t->op == KVR_OP_RECV || t->op == KVR_OP_ALL_GATHER || t->op == KVR_OP_ALL_TO_ALL;
}

static void sched_add(struct kvr_schedule * s, int * cap, int node, bool send, int peer, int tag, int64_t off, int64_t bytes, int64_t rows) {
    if (s->n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        s->x = realloc(s->x, sizeof(*s->x) * (size_t)*cap);
        KVR_ASSERT(s->x != NULL);
    }
    s->x[s->n++] = (struct kvr_xfer) { .group = s->n_groups, .node = node, .peer = peer, .tag = tag, .send = send,
                                       .bytes = bytes, .off = off, .rows = rows, .match_rank = -1, .match_index = -1 };
}

// the transfers of one node, appended in the order a transport is handed them
static int sched_node(struct kvr_schedule * s, int * cap, int k, int n_peers) {
    const struct kvr_tensor * t = s->nodes[k].t;
    const int me = s->rank, N = s->n_ranks, tag = t->op_params[1];
    if ((t->op == KVR_OP_SEND || t->op == KVR_OP_RECV) && (t->op_params[0] < 0 || t->op_params[0] >= n_peers || t->op_params[0] == me)) {
        return kvr_error(KVR_ERR_ARG, "rank %d: node '%s' (%s) names peer %d of %d ranks", me, t->name, kvr_op_name(t->op), t->op_params[0], n_peers);
    }
    switch (t->op) {
        case KVR_OP_SEND:
            sched_add(s, cap, k, true, t->op_params[0], tag, 0, (int64_t)kvr_nbytes(t->src[0]), kvr_nrows(t->src[0]));
            break;
        case KVR_OP_RECV:
            sched_add(s, cap, k, false, t->op_params[0], tag, 0, (int64_t)kvr_nbytes(t), kvr_nrows(t));
            break;
        case KVR_OP_ALL_GATHER: { // rank q owns rows [total*q/N, total*(q+1)/N)
            int64_t total;
            memcpy(&total, &t->op_params[3], sizeof(total));
            const int64_t row = (int64_t)t->nb[1];
            for (int q = 0; q < N; q++) {
                const int64_t r0 = total * q / N, r1 = total * (q + 1) / N;
                if (q != me) sched_add(s, cap, k, false, q, tag, r0 * row, (r1 - r0) * row, r1 - r0);
            }
            for (int q = 0; q < N; q++) {
                if (q != me) sched_add(s, cap, k, true, q, tag, 0, (int64_t)kvr_nbytes(t->src[0]), t->src[0]->ne[1]);
            }
        } break;
        case KVR_OP_ALL_TO_ALL: { // slice q of the source goes to rank q; slice q of the result comes from it
            int64_t total;
            memcpy(&total, &t->op_params[3], sizeof(total));
            const int64_t row = (int64_t)t->nb[1], slice = (int64_t)t->nb[2];
            const int mine = kvr_ring_shard((int)total, 0, N, me, NULL);
            for (int q = 0; q < N; q++) {
                if (q != me) sched_add(s, cap, k, false, q, tag, q * slice, mine * row, mine);
            }
            for (int q = 0; q < N; q++) {
                if (q == me) continue;
                const int rows = kvr_ring_shard((int)total, 0, N, q, NULL);
                sched_add(s, cap, k, true, q, tag, q * slice, rows * row, rows);
            }
        } break;
        default:
            KVR_ASSERT(!"not a communication node");
    }
    return KVR_OK;
}

static void sched_group(struct kvr_schedule * s, int * cap, int first, int issue) {
    if (s->n_groups == *cap) {
        *cap = *cap ? 2 * *cap : 32;
        s->groups = realloc(s->groups, sizeof(*s->groups) * (size_t)*cap);
        KVR_ASSERT(s->groups != NULL);
    }
    s->groups[s->n_groups++] = (struct kvr_xfer_group) { first, s->n - first, issue };
}

void kvr_schedule_free(struct kvr_schedule * s) {
    free(s->nodes);
    free(s->node_first);
    free(s->x);
    free(s->groups);
    memset(s, 0, sizeof(*s));
}

// n_ranks take part in collectives; sends and receives may name any of n_peers >= n_ranks (a P/D
// prefill: the prefill ranks' collectives, and the decode rank the cache goes to)
static int schedule_build(struct kvr_schedule * s, const struct kvr_graph * g, int rank, int n_ranks, int n_peers) {
    kvr_schedule_free(s);
    s->rank = rank;
    s->n_ranks = n_ranks;
    int m = 0;
    for (int i = 0; i < g->n_nodes; i++) m += node_is_xfer(g->nodes[i]);
    s->nodes = malloc(sizeof(*s->nodes) * (size_t)(m ? m : 1));
    s->node_first = malloc(sizeof(int) * (size_t)(m + 1));
    KVR_ASSERT(s->nodes && s->node_first);
    bool computed = false;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (!node_is_xfer(t)) {
            computed |= t->op != KVR_OP_NONE && t->op != KVR_OP_VIEW && !node_is_dejavu(t);
            continue;
        }
        struct kvr_xfer_node * xn = &s->nodes[s->n_nodes++];
        xn->t = t;
        xn->op = t->op;
        xn->after_compute = computed;
        computed = false;
        snprintf(xn->name, sizeof(xn->name), "%s", t->name);
    }
    int cap = 0, cap_groups = 0, last_issue = -1;
    for (int k = 0; k < m;) {
        const int first = s->n;
        const enum kvr_op op = s->nodes[k].op;
        int issue, j = k;
        if (op == KVR_OP_ALL_GATHER || op == KVR_OP_ALL_TO_ALL) {
            issue = j++; // what it sends exists when the rank reaches it
        } else {
            // a run: nodes of one kind with no computing node between them
            while (j < m && s->nodes[j].op == KVR_OP_SEND && (j == k || !s->nodes[j].after_compute)) j++;
            // a send run is issued at its last send; receives alone go with the group before
            issue = j > k ? j - 1 : last_issue;
            const int r0 = j;
            while (j < m && s->nodes[j].op == KVR_OP_RECV && (j == r0 || !s->nodes[j].after_compute)) j++;
        }
        for (; k < j; k++) {
            s->node_first[k] = s->n;
            int rc = sched_node(s, &cap, k, n_peers);
            if (rc != KVR_OK) {
                kvr_schedule_free(s);
                return rc;
            }
        }
        sched_group(s, &cap_groups, first, issue);
        last_issue = issue;
    }
    s->node_first[m] = s->n;
    return KVR_OK;
}

int kvr_schedule_build(struct kvr_schedule * s, const struct kvr_graph * g, int rank, int n_ranks) {
    return schedule_build(s, g, rank, n_ranks, n_ranks);
}

void kvr_schedule_print(const struct kvr_schedule * s, FILE * f) {
    for (int gi = 0; gi < s->n_groups; gi++) {
        const struct kvr_xfer_group * g = &s->groups[gi];
        fprintf(f, "rank %d group %d (issued at %s):", s->rank, gi, g->issue < 0 ? "the start" : s->nodes[g->issue].name);
        for (int i = g->first; i < g->first + g->n; i++) {
            const struct kvr_xfer * x = &s->x[i];
            fprintf(f, "%s %s %s l%d s%d %s %d (%lld B)", i > g->first ? "," : "", x->send ? "send" : "recv",
                    kvr_tag_kind_name(kvr_tag_kind(x->tag)), kvr_tag_layer(x->tag), kvr_tag_step(x->tag),
                    x->send ? "->" : "<-", x->peer, (long long)x->bytes);
        }
        fprintf(f, "\n");
    }
}

//
// DejaVu's hooks into the road: the rest of this file up to the driver is the prefill road alone;
// streaming, replication logs, replicas, recovery and the test hooks live in the DejaVu sections
// after the driver and enter the road only here (each hook is a no-op when nothing is enabled)
//

struct rank_comm;
struct dist_rank;
struct pass_ctx;
struct kv_stream;
struct kv_log;
struct replica;
static int  dejavu_eval_begin(struct kvr_session * d, const int32_t * tokens, int n);
static bool dejavu_rank_wants_pass(const struct kvr_session * d, const struct dist_rank * dr, int n);
static void dejavu_rank_nodes(struct pass_ctx * pc, struct kvr_graph * g);
static void dejavu_receive_graph(struct kvr_session * d, struct dist_rank * dr, struct kvr_context * ctx, struct kvr_graph * g);
static int  dejavu_comm_exec(struct rank_comm * c, const struct kvr_tensor * node);
static int  comm_stall(struct rank_comm * c, int tag);
static int  dejavu_rank_done(struct dist_rank * dr, const struct kvr_eval * ev);
static void dejavu_ranks_joined(struct kvr_session * d, bool all_ok);
static int  dejavu_eval_end(struct kvr_session * d, int rc);
static int  dejavu_eval_commit(struct kvr_session * d, const int32_t * tokens, int n);
static bool dejavu_failover(struct kvr_session * d, const float * lg, int n, double * t_lost);
static int  dejavu_new(struct kvr_session * d);
static void dejavu_free(struct kvr_session * d);
static void dejavu_reset(struct kvr_session * d);
static void dist_rank_free(struct dist_rank * dr); // beside the recovery, which replaces ranks

//
// the endpoint kvr_backend_graph_compute calls: runs the schedule of one rank's graph on its
// transport, on the memory kvr hands over (host memory, a device backend's staged; device
// pointers only for a transport that moves them itself: NCCL sets device_ptrs)
//

// DejaVu's and the test hooks' part of a rank's endpoint: what this eval hands its pseudo-peer
// nodes to, and where the hooks stop the rank (set by the DejaVu sections; NULL / -1: off). The
// road reads only whether a hook stopped the rank (killed, stalled): a failure's root cause.
struct rank_dejavu {
    struct kv_stream * stream;      // this eval streams the cache to a file (NULL: no)
    struct kv_log    * log;         // this eval's rows go to the rank's replication log (NULL: no)
    struct replica   * replica_out; // this eval's new rows go there (--replicate; NULL: none)
    int                stall_layer; // test hook (-1: off)
    bool               stall_deaf;  //   a local rank's thread that does not come back when told to stop
    bool               stalled;
    int                kill_layer;  // test hook KVR_TEST_KILL: the layer this eval loses the rank at (-1: off)
    int                kill_point;  //   which point of the session's list
    char               kill_what[128]; //   where, in words
    bool               killed;      //   it fired: this rank is lost
    double             t_killed;    //   when (the kill or stall hook stopped it)
    bool               own_process; // the rank is this process (MPI): a kill ends the process
};

struct rank_comm {
    struct kvr_comm    base;
    struct transport * tr;
    double             timeout_s;
    struct kvr_schedule sched;      // this graph's transfers (kept after it for kvr_session_schedule)
    struct tr_req    * reqs;        // one per transfer of sched
    void            ** node_mem;    // per comm node: its memory (RECV: where the data lands, once posted)
    const void      ** node_src;    //   and what it sends (once the rank reached it)
    int                next_group;  // the first group not issued yet
    int                next_node;   // the comm node the backend runs next
    int                timeout_peer; // the peer a wait of the last eval timed out on (-1: none)
    int                timeout_tag;  //   the transfer
    bool               timeout_send; //   and whether it was this rank's send
    struct kvr_rank_stats st;
    struct rank_dejavu dv;
};

static bool tag_is_kv(int tag) {
    return kvr_tag_kind(tag) == KVR_TAG_K || kvr_tag_kind(tag) == KVR_TAG_V;
}

static int comm_fail(struct rank_comm * c, int rc) {
    c->tr->fail(c->tr, c->base.rank, kvr_last_error());
    return rc;
}

static int comm_wait(struct rank_comm * c, struct tr_req * r) {
    const double t0 = kvr_time_ms();
    int rc = c->tr->wait(c->tr, r, t0 + c->timeout_s * 1e3, c->timeout_s);
    c->st.wait_ms += kvr_time_ms() - t0;
    if (rc != KVR_OK && strstr(kvr_last_error(), "timed out") && c->timeout_peer < 0 && !c->dv.killed) {
        c->timeout_peer = r->peer;
        c->timeout_tag = r->tag;
        c->timeout_send = r->is_send;
    }
    return rc;
}


// hand transfer i of the schedule to the transport
static int comm_post(struct rank_comm * c, int i) {
    const struct kvr_xfer * x = &c->sched.x[i];
    struct tr_req * r = &c->reqs[i];
    uint8_t * mem = x->send ? (uint8_t *)c->node_src[x->node] : (uint8_t *)c->node_mem[x->node];
    *r = (struct tr_req) { .buf = mem + x->off, .n = (size_t)x->bytes, .me = c->base.rank, .peer = x->peer, .tag = x->tag,
                           .is_send = x->send, .seq = i, .group = x->group, .posted = true, .match_rank = -1, .match_seq = -1 };
    if (!x->send) return c->tr->irecv(c->tr, r);
    c->st.bytes_sent += x->bytes;
    if (tag_is_kv(x->tag)) c->st.kv_rows_sent += x->rows;
    if (kvr_tag_kind(x->tag) == KVR_TAG_STATE) c->st.state_bytes_sent += x->bytes;
    if (kvr_tag_step(x->tag) >= STREAM_STEP) c->st.kv_stream_bytes += x->bytes; // P/D: to the decode rank
    return c->tr->isend(c->tr, r);
}

// Hand the transport every group that is due once the rank reached comm node `at` (-1: the
// graph's start). A group whose receives have no memory yet waits for their post.
static int comm_issue(struct rank_comm * c, int at) {
    const struct kvr_schedule * s = &c->sched;
    while (c->next_group < s->n_groups && s->groups[c->next_group].issue <= at) {
        const int gi = c->next_group;
        const struct kvr_xfer_group * g = &s->groups[gi];
        for (int i = g->first; i < g->first + g->n; i++) {
            const struct kvr_xfer * x = &s->x[i];
            if (x->send ? !c->node_src[x->node] : !c->node_mem[x->node]) {
                KVR_ASSERT(at < 0 && !x->send && "a transfer is due before its node's memory is known");
                return KVR_OK;
            }
        }
        int rc = c->tr->group_begin ? c->tr->group_begin(c->tr, c->base.rank, gi) : KVR_OK;
        const bool begun = rc == KVR_OK;
        for (int i = g->first; i < g->first + g->n && rc == KVR_OK; i++) {
            if (!c->reqs[i].posted) rc = comm_post(c, i);
        }
        if (begun && c->tr->group_end) { // a group that began ends, even after a failed post
            const int rc2 = c->tr->group_end(c->tr, c->base.rank, gi);
            if (rc == KVR_OK) rc = rc2;
        }
        c->next_group++;
        if (rc != KVR_OK) return rc;
    }
    return KVR_OK;
}

static int comm_copy(struct rank_comm * c, void * dst, const void * src, size_t n) {
    if (c->tr->copy) return c->tr->copy(c->tr, c->base.rank, dst, src, n);
    if (n) memcpy(dst, src, n);
    return KVR_OK;
}

// graph start (before the backend posts its receives): the schedule of this graph
static int rank_comm_begin(struct rank_comm * c, const struct kvr_graph * g) {
    int rc = schedule_build(&c->sched, g, c->base.rank, c->base.n_ranks, c->tr->n_ranks);
    if (rc != KVR_OK) return rc;
    const size_t n = (size_t)(c->sched.n ? c->sched.n : 1), m = (size_t)(c->sched.n_nodes ? c->sched.n_nodes : 1);
    free(c->reqs);
    free(c->node_mem);
    free(c->node_src);
    c->reqs = calloc(n, sizeof(*c->reqs));
    c->node_mem = calloc(m, sizeof(*c->node_mem));
    c->node_src = calloc(m, sizeof(*c->node_src));
    KVR_ASSERT(c->reqs && c->node_mem && c->node_src);
    c->next_group = 0;
    c->next_node = 0;
    return KVR_OK;
}

static int comm_begin(struct kvr_comm * base, const struct kvr_graph * g) {
    struct rank_comm * c = (struct rank_comm *)base;
    int rc = rank_comm_begin(c, g);
    return rc == KVR_OK ? rc : comm_fail(c, rc);
}

// the comm node index of node: the backend runs them in order, and posts receives in order
static int comm_node_index(const struct rank_comm * c, const struct kvr_tensor * node, int from) {
    const struct kvr_schedule * s = &c->sched;
    for (int k = from; k < s->n_nodes; k++) if (s->nodes[k].t == node) return k;
    for (int k = 0; k < from && k < s->n_nodes; k++) if (s->nodes[k].t == node) return k;
    KVR_ASSERT(!"a communication node that is not in the rank's schedule");
    return -1;
}

static int comm_post_recv(struct kvr_comm * base, const struct kvr_tensor * node, void * dst) {
    struct rank_comm * c = (struct rank_comm *)base;
    const int k = comm_node_index(c, node, 0);
    c->node_mem[k] = dst;
    int rc = KVR_OK;
    if (c->tr->early_recv) {
        for (int i = c->sched.node_first[k]; i < c->sched.node_first[k + 1] && rc == KVR_OK; i++) rc = comm_post(c, i);
    }
    if (rc == KVR_OK) rc = comm_issue(c, -1);
    return rc == KVR_OK ? rc : comm_fail(c, rc);
}

// dst and src are host memory the backend seam hands over (the tensors' own or staged copies)
static int comm_exec(struct kvr_comm * base, const struct kvr_tensor * node, void * dst_mem, const void * src_mem) {
    struct rank_comm * c = (struct rank_comm *)base;
    const struct kvr_schedule * s = &c->sched;
    if (node_is_dejavu(node)) return dejavu_comm_exec(c, node); // rows handed on in this process, or a test hook
    int rc = comm_stall(c, node->op_params[1]);
    if (rc != KVR_OK) return rc; // a stalled rank says nothing more to anyone
    const int k = comm_node_index(c, node, c->next_node);
    c->next_node = k + 1;
    if (node->op != KVR_OP_RECV) {
        c->node_src[k] = src_mem;
        if (node->op != KVR_OP_SEND) c->node_mem[k] = dst_mem;
    }
    // a collective's own rows (all-gather) or slice (all-to-all) stay on the rank
    const int me = base->rank, N = base->n_ranks;
    int64_t total = 0;
    if (node->op == KVR_OP_ALL_GATHER || node->op == KVR_OP_ALL_TO_ALL) memcpy(&total, &node->op_params[3], sizeof(total));
    if (node->op == KVR_OP_ALL_GATHER) {
        const size_t row = node->nb[1];
        const int64_t r0 = total * me / N, r1 = total * (me + 1) / N;
        uint8_t * dst = (uint8_t *)dst_mem + r0 * row;
        KVR_ASSERT(node->src[0]->ne[1] == r1 - r0);
        if (r1 > r0 && (const uint8_t *)src_mem != dst) rc = comm_copy(c, dst, src_mem, (size_t)(r1 - r0) * row);
    } else if (node->op == KVR_OP_ALL_TO_ALL) {
        const size_t off = (size_t)me * node->nb[2];
        const int mine = kvr_ring_shard((int)total, 0, N, me, NULL);
        rc = comm_copy(c, (uint8_t *)dst_mem + off, (const uint8_t *)src_mem + off, (size_t)mine * node->nb[1]);
    }
    if (rc == KVR_OK) rc = comm_issue(c, k);
    // this node's receives are what the nodes after it read
    for (int i = s->node_first[k]; i < s->node_first[k + 1] && rc == KVR_OK; i++) {
        if (s->x[i].send) continue;
        rc = comm_wait(c, &c->reqs[i]);
        if (rc != KVR_OK) break;
        c->st.bytes_recv += s->x[i].bytes;
        if (tag_is_kv(s->x[i].tag)) c->st.kv_rows_recv += s->x[i].rows;
        if (kvr_tag_kind(s->x[i].tag) == KVR_TAG_STATE) c->st.state_bytes_recv += s->x[i].bytes;
        if (kvr_tag_step(s->x[i].tag) >= STREAM_STEP) c->st.kv_stream_bytes += s->x[i].bytes; // P/D: the decode rank's
    }
    return rc == KVR_OK ? rc : comm_fail(c, rc);
}

static int comm_finish(struct kvr_comm * base) {
    struct rank_comm * c = (struct rank_comm *)base;
    struct kvr_schedule * s = &c->sched;
    int rc = KVR_OK;
    for (int i = 0; i < s->n; i++) {
        struct tr_req * r = &c->reqs[i];
        if (!r->posted) continue;
        // (a rank the kill hook stopped still lets its peers take what it had sent, as data on the
        // wire reaches a peer after the sender died; it says nothing when they do not)
        if (r->is_send && !r->done && rc == KVR_OK && !c->dv.stalled) rc = comm_wait(c, r);
        // after a failure some transfers were never waited for: the peer must not touch them
        if (!r->done) c->tr->cancel(c->tr, r);
        r->posted = false;
        s->x[i].match_rank = r->match_rank;
        s->x[i].match_index = r->match_seq;
    }
    if (rc != KVR_OK && !c->dv.killed) comm_fail(c, rc);
    return rc;
}

static struct rank_comm * rank_comm_new(struct transport * tr, int rank, int n_ranks, double timeout_s) {
    struct rank_comm * c = calloc(1, sizeof(*c));
    KVR_ASSERT(c != NULL);
    c->base.iface   = (struct kvr_comm_i) { comm_begin, comm_post_recv, comm_exec, comm_finish };
    c->base.rank    = rank;
    c->base.n_ranks = n_ranks;
    c->base.context = c;
    c->tr           = tr;
    c->timeout_s    = timeout_s;
    c->dv.stall_layer  = -1;
    c->dv.kill_layer   = -1;
    c->timeout_peer = -1;
    return c;
}

static void rank_comm_free(struct rank_comm * c) {
    if (!c) return;
    kvr_schedule_free(&c->sched);
    free(c->reqs);
    free(c->node_mem);
    free(c->node_src);
    free(c);
}

//
// the plan of one eval: which rank computes which new tokens
//

enum layout {
    LAYOUT_CHAIN = 0, // single, tsp, kvr: the last rank ends with the whole cache
    LAYOUT_RING  = 1, // ring-kv, ring-q, auto: the cache stays sharded
};

struct eval_plan {
    enum kvr_strategy strat;     // what runs: never auto
    int               T, P, N;   // N: the ranks the strategy runs on (P/D: all but the decode rank)
    int               n_alloc;   // entries of cnt and pos (every rank)
    bool              pd;        // a P/D prefill: the decode rank receives the cache as it is made
    int             * cnt;       // new tokens per rank
    int32_t        ** pos;       // their absolute positions
    int               owner;     // the rank whose logits are returned
    int               store;     // ring decode: the rank that keeps the new token's K/V
    bool              active[256];
};

struct dist_rank {
    int                   rank;
    int                   id;         // the rank it was started as (KVR_TEST_KILL names that)
    bool                  lost;       // the test hook KVR_TEST_KILL stopped it: it computes no more
    atomic_int          * interrupt;  // the session's (kvr_session_interrupt)
    bool                  interrupted;//   seen by this rank in the running eval
    bool                  fail_peers; //   then its transport is failed (local ranks: peers stop waiting)
    struct kvr_kv_cache * cache;
    int32_t             * cache_pos;  // absolute position of every cache row
    int                   n_rows;
    struct kvr_backend  * be;
    struct kvr_model    * model;      // the weights on be
    struct rank_comm    * comm;
    struct kvr_buffer   * buf;        // activations, kept from eval to eval
    struct kvr_eval_reuse * reuse;    // the single pass's decode graph, kept between tokens
    struct kvr_eval_reuse * batch_reuse; // the graph of the decode batches this session led (its
                                      //   first), kept between steps while the batch stays the same
    float               * batch_logits; //   and their logits (batch_cap sessions' worth): a step's
    int                   batch_cap;      //   new buffer would be fresh pages every step
    float               * logits;
    struct kvr_span     * spans;      // every eval's spans, times relative to the session's start
    int                   n_spans, cap_spans;
    char                * graph_text; // --dump-graph output of the last eval
    size_t                graph_len;
    int                   rc;
    char                  err[1024];
    bool                  computed;   // the last eval reached its graph's compute (a recurrent state may have moved)
    int                   made;       // the rows the last eval made here (positions: the plan's pos[rank])
    int                   made_row0;  //   at cache rows [made_row0, made_row0 + made)
    struct {
        struct replica  * held;       // --replicate: the replica of its ring predecessor's rows
        struct kv_log   * log;        // its replication log (replicate_dir; NULL: none open)
    } dv;                             // DejaVu's part
};

// DejaVu's part of a session (file streaming, replication logs, replicas, failover recovery, resume)
// and the test hooks' (KVR_TEST_KILL): state the prefill road does not touch; DejaVu enters the
// road through the dejavu_* hooks
struct dejavu {
    struct kv_stream       * stream;      // the running eval's file stream (NULL: none)
    bool                     streamed;    // kv_stream: the first prefill has streamed its cache
    int64_t                  stream_bytes;// what the last stream wrote to its file
    bool                     logs_open;   // replicate_dir: the local ranks' logs are open
    int                      log_step;    //   the step the next eval is in them
    bool                     log_skip;    //   the next eval is one the logs hold already (a resume's last token)
    bool                     logging;     //   the running eval's rows go to them
    int32_t                * resume_prompt; // kvr_session_resume's info->prompt
    struct kvr_test_hooks    test;        // the params' hooks (stall; kill points copied below)
    struct kvr_test_kill     kill[16];    // the test hook's points (KVR_TEST_KILL)
    bool                     kill_fired[16];
    int                      n_kill;
    bool                     decode;      // the running eval is a decode step (the kill hook counts them)
    int                      n_steps;     // decode steps (one-token evals after a cached token) so far
    bool                     recomputing; // a recovery re-evaluates tokens no copy held (not a decode step)
    double                   failover_restore_ms; // the last recovery: rebuilding the ranks from the copies
    double                   t_recover;   //   when it started
};

// The caches of this process's ranks swapped out of the backends' memory: to host memory (every
// local rank's rows of every layer, K and V) or to a cache file (path).
struct dist_swap {
    bool     out;
    char   * path;   // the file (NULL: host memory)
    void  ** k;      // [n_local * n_layer]: rank i's rows of layer il at [i * n_layer + il], as the
    void  ** v;      //   cache stores them (its types); NULL for a recurrent layer
    float ** state;  // [n_local]: rank i's recurrent states (states_get; NULL without)
};

struct kvr_session {
    const struct kvr_model * m;
    struct kvr_session_params   p;
    enum layout              layout;
    int                      n_ranks;
    int                      n_local;     // ranks in this process
    int                      node_rank;   // under mpirun: this process's index among its node's (else 0)
    struct dist_rank       * ranks;       // n_local of them
    int                    * rows;        // cache rows of every rank (all processes keep it)
    struct transport       * tr;
    struct transport       * host_tr;     // ranks in other processes: the logits travel over it (MPI)
    int                      n_past;
    int                      n_decode;    // ring decode steps so far (the round-robin store)
    enum kvr_strategy        last;
    float                  * logits;
    double                   t_base;
    int                    * partition;   // resolved counts for the kvr chain
    struct eval_plan         plan;
    const int32_t          * tokens;
    int32_t                * seq;         // every token in the cache, in order (what a saved file names)
    int                      seq_cap;
    bool                     has_logits;  // logits are the last token's (an eval or a load since the reset)
    int                      n_ctx;       // cache rows of every rank
    atomic_int               interrupt;   // kvr_session_interrupt: stop the running or next eval
    struct dist_swap         swap;        // the caches, while swapped out (kvr_session_kv_swap_out)
    struct dejavu            dv;
    bool                     wedged;      // a rank's thread did not stop when told: it may still run,
                                          //   so nothing is freed and no eval runs (join_ranks)
    enum kvr_type            type_k, type_v; // the caches' types (kvr_session_params.cache_type_k/_v)
};

static void plan_free(struct eval_plan * pl) {
    if (pl->pos) {
        for (int r = 0; r < pl->n_alloc; r++) free(pl->pos[r]);
    }
    free(pl->pos);
    free(pl->cnt);
    memset(pl, 0, sizeof(*pl));
}

// contiguous split of [P, P+T) with counts per rank
static void plan_contiguous(struct eval_plan * pl, const int * counts) {
    int s = 0;
    for (int r = 0; r < pl->N; r++) {
        pl->cnt[r] = counts[r];
        pl->pos[r] = malloc(sizeof(int32_t) * (size_t)(counts[r] ? counts[r] : 1));
        for (int i = 0; i < counts[r]; i++) pl->pos[r][i] = pl->P + s + i;
        s += counts[r];
        if (counts[r]) pl->owner = r;
    }
}

static int resolve_partition(struct kvr_session * d, int T, int * counts, int N) { // N: the prefill's ranks
    if (d->p.partition) {
        int sum = 0;
        for (int r = 0; r < N; r++) {
            if (d->p.partition[r] < 0) return kvr_error(KVR_ERR_ARG, "partition: rank %d has a negative count", r);
            sum += d->p.partition[r];
            counts[r] = d->p.partition[r];
        }
        if (sum != T) return kvr_error(KVR_ERR_ARG, "partition: the counts add up to %d, but the prompt has %d tokens", sum, T);
        return KVR_OK;
    }
    if (d->p.fractions) {
        double cum = 0.0;
        int prev = 0;
        for (int r = 0; r < N; r++) {
            if (!(d->p.fractions[r] >= 0.0)) return kvr_error(KVR_ERR_ARG, "partition: fraction %d is negative", r);
            cum += d->p.fractions[r];
            int e = r == N - 1 ? T : (int)lround(cum * T);
            if (e > T) e = T;
            if (e < prev) e = prev;
            counts[r] = e - prev;
            prev = e;
        }
        if (fabs(cum - 1.0) > 1e-3) return kvr_error(KVR_ERR_ARG, "partition: the fractions add up to %g, not 1", cum);
        return KVR_OK;
    }
    for (int r = 0; r < N; r++) counts[r] = (int)((int64_t)T * (r + 1) / N - (int64_t)T * r / N);
    return KVR_OK;
}

static bool strategy_is_ring(enum kvr_strategy s) {
    return s == KVR_STRATEGY_RING_KV || s == KVR_STRATEGY_RING_Q || s == KVR_STRATEGY_AUTO;
}

static int plan_eval(struct kvr_session * d, int T) {
    struct eval_plan * pl = &d->plan;
    plan_free(pl);
    // P/D: the first prefill runs on every rank but the decode rank (the last), which receives
    pl->pd = d->p.pd && d->n_past == 0;
    const int N = pl->pd ? d->n_ranks - 1 : d->n_ranks;
    pl->T = T;
    pl->P = d->n_past;
    pl->N = N;
    pl->n_alloc = d->n_ranks;
    pl->cnt = calloc((size_t)d->n_ranks, sizeof(int));
    pl->pos = calloc((size_t)d->n_ranks, sizeof(int32_t *));
    pl->store = -1;
    int * counts = calloc((size_t)N, sizeof(int));
    int rc = KVR_OK;
    if (pl->pd) pl->pos[d->n_ranks - 1] = malloc(sizeof(int32_t));
    if (pl->pd ? !strategy_is_ring(d->p.strategy) : d->layout == LAYOUT_CHAIN) {
        if (pl->P == 0 && N > 1 && d->p.strategy != KVR_STRATEGY_SINGLE) {
            pl->strat = d->p.strategy;
            if (pl->strat == KVR_STRATEGY_KVR) {
                rc = resolve_partition(d, T, counts, N);
            } else { // tsp: the even split ALL_GATHER assumes
                for (int r = 0; r < N; r++) counts[r] = (int)((int64_t)T * (r + 1) / N - (int64_t)T * r / N);
            }
        } else { // single, or a later eval: the last rank holds the whole cache
            pl->strat = KVR_STRATEGY_SINGLE;
            counts[N - 1] = T;
        }
        if (rc == KVR_OK) plan_contiguous(pl, counts);
        for (int r = 0; r < N; r++) pl->active[r] = pl->strat != KVR_STRATEGY_SINGLE || r == N - 1;
    } else {
        for (int r = 0; r < N; r++) pl->active[r] = true;
        if (T == 1 && pl->P > 0) {
            // decode: every rank computes the token; one keeps its K/V (round robin)
            pl->strat = KVR_STRATEGY_RING_Q;
            pl->store = d->n_decode % N;
            pl->owner = 0;
            for (int r = 0; r < N; r++) {
                pl->cnt[r] = 1;
                pl->pos[r] = malloc(sizeof(int32_t));
                pl->pos[r][0] = pl->P;
            }
        } else {
            pl->strat = d->p.strategy;
            if (pl->strat == KVR_STRATEGY_AUTO) {
                const struct kvr_hparams * hp = &d->m->hp;
                char why[512];
                const double bw = d->p.auto_bw > 0 ? d->p.auto_bw : d->p.link_gbps > 0 ? d->p.link_gbps * 1e9 / 8 : 1e10;
                pl->strat = kvr_auto_pick(T, pl->P, N, (int)hp->n_head, (int)hp->n_head_kv, (int)hp->head_dim, d->p.cache_type_k,
                                          d->p.cache_type_v, d->p.auto_flops > 0 ? d->p.auto_flops : 1e11, bw, why, sizeof(why));
                if (d->p.log && kvr_session_rank(d) == 0) fprintf(d->p.log, "%s\n", why);
            }
            for (int r = 0; r < N; r++) {
                pl->cnt[r] = kvr_ring_shard(T, pl->P, N, r, NULL);
                pl->pos[r] = malloc(sizeof(int32_t) * (size_t)(pl->cnt[r] ? pl->cnt[r] : 1));
                kvr_ring_shard(T, pl->P, N, r, pl->pos[r]);
                // the last token sits at the end of chunk 2N-1, which rank 0 holds
                if (pl->cnt[r] && pl->pos[r][pl->cnt[r] - 1] == pl->P + T - 1) pl->owner = r;
            }
        }
    }
    if (pl->pd) pl->active[d->n_ranks - 1] = true;
    free(counts);
    return rc;
}

//
// the passes: each rewrites every ATTN_BLOCK of one rank's graph and lists the nodes that must
// run even when no output depends on them (cache stores, sends, collectives)
//

struct pass_ctx {
    struct kvr_session     * d;
    struct dist_rank    * dr;
    struct kvr_context  * ctx;
    struct eval_plan    * pl;
    int                   rank, N;
    int                   n_old;     // cache rows before this eval
    struct kvr_tensor   * kpos;      // positions of this rank's cache rows after the store
    struct kvr_tensor  ** sinks;
    int                   n_sinks, cap_sinks;
    struct kvr_tensor  ** step_pos;  // ring: positions received at step j (first_attn), reused
    int                   first_attn; // the first layer with attention (a hybrid's may not be 0)
    bool                  receiver;  // P/D's decode rank: receives the cache, builds no model
    int                   n_final;   // cache rows this rank holds after the eval
    float                 scale;     // of the ATTN_BLOCK being rewritten: its score scale,
    float                 softcap;   //   its scores' soft-capping (0: none),
    int                   window;    //   its sliding window (0: none)
    struct kvr_tensor   * attn_sinks;//   and its attention sinks (NULL: none; kvr_attn_sinks)
    struct kvr_tensor  ** late;      // sinks that go after every other (the ring's state broadcasts)
    int                   n_late;
};

// t into the sinks at index at (the ones from there on move up one)
static void sinks_put(struct pass_ctx * pc, int at, struct kvr_tensor * t) {
    if (pc->n_sinks == pc->cap_sinks) {
        pc->cap_sinks = pc->cap_sinks ? 2 * pc->cap_sinks : 64;
        pc->sinks = realloc(pc->sinks, sizeof(*pc->sinks) * (size_t)pc->cap_sinks);
        KVR_ASSERT(pc->sinks != NULL);
    }
    memmove(&pc->sinks[at + 1], &pc->sinks[at], sizeof(*pc->sinks) * (size_t)(pc->n_sinks - at));
    pc->sinks[at] = t;
    pc->n_sinks++;
}

static struct kvr_tensor * sink(struct pass_ctx * pc, struct kvr_tensor * t, const char * why) {
    sinks_put(pc, pc->n_sinks, t);
    t->why = why;
    return t;
}

// rows [r0, r0+n) of a cache tensor as [kv_dim, n]
static struct kvr_tensor * cache_rows(struct pass_ctx * pc, struct kvr_tensor * c, int r0, int n) {
    return kvr_view_2d(pc->ctx, c, c->ne[0], n, c->nb[1], (size_t)r0 * c->nb[1]);
}

// a [kv_dim, n] block seen as [head_dim, n_head_kv, n] for attention
static struct kvr_tensor * as_heads(struct pass_ctx * pc, struct kvr_tensor * t) {
    const struct kvr_hparams * hp = &pc->d->m->hp;
    return kvr_view_3d(pc->ctx, t, hp->head_dim, hp->n_head_kv, t->ne[1], kvr_row_size(t->type, hp->head_dim), t->nb[1], 0);
}

// new rows of this eval into this rank's cache; returns the V store (which depends on the K store)
static struct kvr_tensor * store_new(struct pass_ctx * pc, int il, struct kvr_tensor * k, struct kvr_tensor * v, int row0) {
    struct kvr_kv_cache * c = pc->dr->cache;
    const int n = (int)k->ne[2];
    struct kvr_tensor * ks = kvr_kv_store(pc->ctx, kvr_reshape_2d(pc->ctx, k, c->kv_dim, n), cache_rows(pc, c->k[il], row0, n));
    struct kvr_tensor * vs = kvr_kv_store(pc->ctx, kvr_reshape_2d(pc->ctx, v, c->kv_dim, n), cache_rows(pc, c->v[il], row0, n));
    kvr_set_name(ks, "blk.%d.k_store", il);
    kvr_set_name(vs, "blk.%d.v_store", il);
    vs->src[2] = ks;
    sink(pc, ks, "store this rank's new K rows in its cache");
    sink(pc, vs, "store this rank's new V rows in its cache");
    return vs;
}

// merge partial attentions in groups the node's source slots allow; the layer's attention sinks
// (kept out of the partials) join the last merge, so they count once
static struct kvr_tensor * merge_all(struct pass_ctx * pc, struct kvr_tensor ** parts, int n, int n_head, int il) {
    struct kvr_tensor * acc = parts[0];
    const int slots = pc->attn_sinks ? KVR_MAX_SRC - 1 : KVR_MAX_SRC;
    int i = 1;
    bool merged = false; // with sinks there is a merge (of parts[0] alone, if need be) to hold them
    while (i < n || (!merged && pc->attn_sinks)) {
        struct kvr_tensor * grp[KVR_MAX_SRC];
        int g = 0;
        grp[g++] = acc;
        while (g < slots && i < n) grp[g++] = parts[i++];
        merged = true;
        acc = kvr_set_name(kvr_merge_attn(pc->ctx, grp, g, n_head), "blk.%d.attn_merge", il);
        acc->why = "merge the partial attentions by their log-sum-exp";
    }
    if (pc->attn_sinks) {
        kvr_attn_sinks(acc, pc->attn_sinks);
        acc->why = "merge the partial attentions by their log-sum-exp, with the attention sinks";
    }
    return acc;
}

static void pass_tsp(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    struct kvr_kv_cache * c = pc->dr->cache;
    const int T = pc->pl->T, n = (int)k->ne[2], r0 = (int)((int64_t)T * pc->rank / pc->N);
    KVR_ASSERT(r0 + n == (int)((int64_t)T * (pc->rank + 1) / pc->N)); // the all-gather's own rows
    // the rank's own rows go into its cache first, in the cache's type, which is what the
    // all-gather then sends from there (the other ranks' rows arrive in that type too)
    struct kvr_tensor * vst = store_new(pc, il, k, v, r0), * kst = vst->src[2];
    struct kvr_tensor * ks = kvr_all_gather(pc->ctx, kst, cache_rows(pc, c->k[il], 0, T), pc->N, T, kvr_tag(il, KVR_TAG_K, 0));
    struct kvr_tensor * vs = kvr_all_gather(pc->ctx, vst, cache_rows(pc, c->v[il], 0, T), pc->N, T, kvr_tag(il, KVR_TAG_V, 0));
    kvr_set_name(ks, "blk.%d.k_gather", il);
    kvr_set_name(vs, "blk.%d.v_gather", il);
    vs->src[2] = ks;
    sink(pc, ks, "tsp: every rank's K rows into every rank's cache");
    sink(pc, vs, "tsp: every rank's V rows into every rank's cache");
    struct kvr_tensor * a = kvr_attn(pc->ctx, q, as_heads(pc, cache_rows(pc, c->k[il], 0, T)), as_heads(pc, cache_rows(pc, c->v[il], 0, T)),
                                     pos, pc->kpos, vs, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
    kvr_attn_kernel_as(a, T, (int64_t)pc->pl->P + T); // the single pass's kernel: its bits, query by query
    kvr_replace_node(t, kvr_attn_sinks(a, pc->attn_sinks), "tsp: attention over the gathered cache");
}

static void pass_kvr(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    struct kvr_kv_cache * c = pc->dr->cache;
    const int r = pc->rank, W = pc->window;
    int s = 0;
    for (int i = 0; i < r; i++) s += pc->pl->cnt[i];
    const int e = s + pc->pl->cnt[r];
    // a sliding-window layer hands down only the rows the next rank's queries can see: the last
    // W-1 before its slice (rank r+1 computes the same bound from s_{r+1} = e_r)
    const int lo_in = W > 0 && s - W + 1 > 0 ? s - W + 1 : 0, lo_out = W > 0 && e - W + 1 > 0 ? e - W + 1 : 0;
    struct kvr_tensor * vs = store_new(pc, il, k, v, s);
    struct kvr_tensor * ks = vs->src[2];
    if (r > 0 && s > lo_in) {
        // the cache of the earlier tokens this rank needs comes down the chain from rank r-1
        struct kvr_tensor * rk = kvr_recv(pc->ctx, cache_rows(pc, c->k[il], lo_in, s - lo_in), r - 1, kvr_tag(il, KVR_TAG_K, 0));
        struct kvr_tensor * rv = kvr_recv(pc->ctx, cache_rows(pc, c->v[il], lo_in, s - lo_in), r - 1, kvr_tag(il, KVR_TAG_V, 0));
        kvr_set_name(rk, "blk.%d.k_recv", il);
        kvr_set_name(rv, "blk.%d.v_recv", il);
        rk->why = rv->why = W ? "kvr: K/V of the window's tokens before s_r from rank r-1" : "kvr: K/V of tokens [0, s_r) from rank r-1";
        ks->src[2] = rk;
        ks->src[3] = rv;
    }
    if (r < pc->N - 1 && e > lo_out) {
        struct kvr_tensor * sk = kvr_send(pc->ctx, cache_rows(pc, c->k[il], lo_out, e - lo_out), r + 1, kvr_tag(il, KVR_TAG_K, 0));
        struct kvr_tensor * sv = kvr_send(pc->ctx, cache_rows(pc, c->v[il], lo_out, e - lo_out), r + 1, kvr_tag(il, KVR_TAG_V, 0));
        sk->src[1] = vs;
        sv->src[1] = vs;
        kvr_set_name(sk, "blk.%d.k_send", il);
        kvr_set_name(sv, "blk.%d.v_send", il);
        sink(pc, sk, W ? "kvr: K of the window's tokens before e_r on to rank r+1" : "kvr: K of tokens [0, e_r) on to rank r+1");
        sink(pc, sv, W ? "kvr: V of the window's tokens before e_r on to rank r+1" : "kvr: V of tokens [0, e_r) on to rank r+1");
    }
    struct kvr_tensor * kp = kvr_view_1d(pc->ctx, pc->kpos, e - lo_in, (size_t)lo_in * sizeof(int32_t));
    struct kvr_tensor * a = kvr_attn(pc->ctx, q, as_heads(pc, cache_rows(pc, c->k[il], lo_in, e - lo_in)),
                                     as_heads(pc, cache_rows(pc, c->v[il], lo_in, e - lo_in)), pos, kp, vs, pc->scale, pc->softcap, W,
                                     pc->d->p.attn_mode);
    kvr_attn_kernel_as(a, pc->pl->T, (int64_t)pc->pl->P + pc->pl->T); // the single pass's kernel: its bits, query by query
    kvr_replace_node(t, kvr_attn_sinks(a, pc->attn_sinks), W ? "kvr: sliding-window attention over cache [s_r-W+1, e_r)" : "kvr: attention over cache [0, e_r)");
}

// an input buffer a receive is posted into: allocated before the graph runs
static struct kvr_tensor * recv_buf(struct pass_ctx * pc, enum kvr_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    struct kvr_tensor * b = kvr_new_tensor_3d(pc->ctx, type, ne0, ne1, ne2);
    b->flags |= KVR_FLAG_INPUT;
    kvr_set_name(b, "receive buffer");
    return b;
}

// With an F16 or BF16 V one rank's ATTN rounds each probability to that type after normalising it
// over every key (where it runs llama.cpp's arithmetic: kvr_attn_cpu_exact of the eval's new
// tokens over every key, which every decode step up to 16k of context takes); partials that each
// normalise over their own block round at other scales, and merged by log-sum-exp they land 4e-3
// to 7e-3 from one rank's logits (tiny-llama3, 64 tokens). The rings then find each query's max
// and sum over every block first (ATTN_STATS, folded block by block or shared by an all-gather)
// and round at that scale (ATTN_NORMED), whose partials MERGE_ATTN merges as before. Longer
// prompts keep ATTN's partials (ring-kv's first prompt gathers instead: ring_gather): one rank's
// tiled kernel rounds running, unnormalised weights a tile at a time, which no split of the keys
// reproduces, and ATTN_NORMED is made for small shapes.
// Q8_0 K runs the online kernel, which rounds nothing; a backend that runs neither op (CUDA: its
// ATTN rounds tiles of unnormalised weights) keeps ATTN. It is the exact arithmetic's: a ring decode
// pays about twice one rank's attention for it (the scores twice, one all-gather a layer), which 8-bit
// activations (q8_activations, kvr-run's default), whose logits are 1e-2 away anyway, do not buy.
static bool ring_exact(const struct pass_ctx * pc) {
    if (pc->d->p.q8_activations) return false;
    const struct kvr_kv_cache * c = pc->dr->cache;
    if (c->type_k == KVR_TYPE_Q8_0 || (c->type_v != KVR_TYPE_F16 && c->type_v != KVR_TYPE_BF16)) return false;
    if (!kvr_attn_cpu_exact(pc->pl->T, (int64_t)pc->pl->P + pc->pl->T)) return false;
    const struct kvr_tensor stats = { .op = KVR_OP_ATTN_STATS }, normed = { .op = KVR_OP_ATTN_NORMED };
    return kvr_backend_supports_op(pc->dr->be, &stats) && kvr_backend_supports_op(pc->dr->be, &normed);
}

// The partial of a ring's block (ring_exact): ATTN_NORMED over k/v with the statistics st of every
// block; the layer's attention sinks join its denominator (MERGE_ATTN adds them to the output).
static struct kvr_tensor * normed_part(struct pass_ctx * pc, struct kvr_tensor * q, struct kvr_tensor * k, struct kvr_tensor * v,
                                       struct kvr_tensor * qpos, struct kvr_tensor * kpos, struct kvr_tensor * st,
                                       struct kvr_tensor * dep) {
    return kvr_attn_normed(pc->ctx, q, k, v, qpos, kpos, st, pc->attn_sinks, dep, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
}

static struct kvr_tensor * stats_part(struct pass_ctx * pc, struct kvr_tensor * q, struct kvr_tensor * k, struct kvr_tensor * qpos,
                                      struct kvr_tensor * kpos, struct kvr_tensor * prev, struct kvr_tensor * dep) {
    return kvr_attn_stats(pc->ctx, q, k, qpos, kpos, prev, dep, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
}

// Ring-KV with a sliding window W: which rows of rank s's block travel on hop j (from rank s+j-1
// to rank s+j): those some query of the ranks still ahead, s+j .. s+N-1, can see, as one range
// [*a, *b) of the block (its cache rows: the old ones, then this eval's new ones, in position
// order). Sender and receiver compute it alike from the plan. A row at p is seen by a query at q
// iff p <= q < p+W. Old rows are all before the first new position P; their own positions are not
// kept here, so they travel whenever the window of some query ahead reaches back before P. The
// ranges shrink hop by hop (fewer ranks ahead), so each hop sends a slice of what it received.
static void ring_kv_rows(const struct pass_ctx * pc, int s, int j, int * a, int * b) {
    const struct eval_plan * pl = pc->pl;
    const int N = pc->N, W = pc->window, n_old = pc->d->rows[s], n_new = pl->cnt[s];
    *a = 0;
    *b = n_old + n_new;
    if (W <= 0) return;
    int first = -1, last = -1;           // the needed new rows
    int32_t q_min = INT32_MAX;           // the earliest query ahead
    for (int h = j; h < N; h++) {
        const int r = (s + h) % N, nq = pl->cnt[r];
        const int32_t * qp = pl->pos[r]; // sorted
        if (nq > 0 && qp[0] < q_min) q_min = qp[0];
        for (int i = 0; i < n_new; i++) {
            const int32_t p = pl->pos[s][i];
            int lo = 0, hi = nq;         // the first query at or after p
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (qp[mid] < p) lo = mid + 1; else hi = mid;
            }
            if (lo < nq && (int64_t)qp[lo] - p < W) {
                if (first < 0 || i < first) first = i;
                if (i > last) last = i;
            }
        }
    }
    const bool old = n_old > 0 && q_min != INT32_MAX && (int64_t)q_min - W + 1 < pl->P;
    *a = old ? 0 : first >= 0 ? n_old + first : 0;
    *b = first >= 0 ? n_old + last + 1 : old ? n_old : *a;
}

// Under 8-bit activations the attention's output is rounded to 8 bits before the output
// projection, which turns the last bits that merging partials by log-sum-exp changes into whole
// 8-bit steps (0.6 to 0.9 of a logit on SmolLM2 at 395 tokens). In the exact arithmetic an F16 or
// BF16 V past ring_exact's shapes meets one rank's tiled kernel, whose roundings of running weights
// no split of the keys reproduces (4e-3 to 9e-3 of a logit). There each ring-kv rank of a first
// prompt keeps the blocks that pass by and attends once over them all, put back in position order,
// with one rank's kernel (kvr_attn_kernel_as): one rank's bits, the transfers the ring's, the
// attention after the last block rather than beside the transfers.
bool kvr_ring_kv_gathers(enum kvr_type type_k, enum kvr_type type_v, bool q8_activations, int T, int P, int window) {
    if (P != 0 || window != 0) return false;
    const bool rounds = type_k != KVR_TYPE_Q8_0 && (type_v == KVR_TYPE_F16 || type_v == KVR_TYPE_BF16);
    return q8_activations || (rounds && !kvr_attn_cpu_exact(T, T));
}

// kvr_ring_kv_gathers on this rank's backend: a backend that cannot copy typed rows (CUDA) keeps
// the partials.
static bool ring_gather(const struct pass_ctx * pc) {
    const struct kvr_kv_cache * c = pc->dr->cache;
    if (pc->n_old != 0 || !kvr_ring_kv_gathers(c->type_k, c->type_v, pc->d->p.q8_activations, pc->pl->T, pc->pl->P, pc->window)) return false;
    struct kvr_tensor rk = { .type = c->type_k, .ne = { c->kv_dim, 1, 1, 1 } }, rv = { .type = c->type_v, .ne = { c->kv_dim, 1, 1, 1 } };
    struct kvr_tensor ck = { .op = KVR_OP_CPY, .type = c->type_k, .ne = { c->kv_dim, 1, 1, 1 }, .src = { &rk } };
    struct kvr_tensor cv = { .op = KVR_OP_CPY, .type = c->type_v, .ne = { c->kv_dim, 1, 1, 1 }, .src = { &rv } };
    return kvr_backend_supports_op(pc->dr->be, &ck) && kvr_backend_supports_op(pc->dr->be, &cv);
}

// ring_gather: the blocks blk_k/v/p[j] of steps 0..N-1 (rank (i-j) mod N's rows, in its positions'
// order) copied to the rows of their positions, then the attention over all T of them.
static struct kvr_tensor * ring_gather_attn(struct pass_ctx * pc, int il, struct kvr_tensor * q, struct kvr_tensor * qpos,
                                            struct kvr_tensor * const * blk_k, struct kvr_tensor * const * blk_v,
                                            struct kvr_tensor * const * blk_p, struct kvr_tensor * dep) {
    struct kvr_kv_cache * c = pc->dr->cache;
    const int T = pc->pl->T, N = pc->N, i = pc->rank;
    struct kvr_tensor * fk = kvr_set_name(kvr_new_tensor_2d(pc->ctx, c->type_k, c->kv_dim, T), "blk.%d.k_gathered", il);
    struct kvr_tensor * fv = kvr_set_name(kvr_new_tensor_2d(pc->ctx, c->type_v, c->kv_dim, T), "blk.%d.v_gathered", il);
    struct kvr_tensor * fp = kvr_set_name(kvr_new_tensor_1d(pc->ctx, KVR_TYPE_I32, T), "blk.%d.kpos_gathered", il);
    struct kvr_tensor * prev = dep;
    for (int j = 0; j < N; j++) {
        const int src = (i - j + N) % N, n = pc->pl->cnt[src];
        const int32_t * pos = pc->pl->pos[src];
        KVR_ASSERT(blk_k[j]->ne[1] == n);
        for (int r = 0; r < n;) { // each run of consecutive positions: one copy
            int e = r + 1;
            while (e < n && pos[e] == pos[e - 1] + 1) e++;
            struct kvr_tensor * from[3] = { kvr_view_2d(pc->ctx, blk_k[j], c->kv_dim, e - r, blk_k[j]->nb[1], (size_t)r * blk_k[j]->nb[1]),
                                            kvr_view_2d(pc->ctx, blk_v[j], c->kv_dim, e - r, blk_v[j]->nb[1], (size_t)r * blk_v[j]->nb[1]),
                                            kvr_view_1d(pc->ctx, blk_p[j], e - r, (size_t)r * sizeof(int32_t)) };
            struct kvr_tensor * to[3] = { kvr_view_2d(pc->ctx, fk, c->kv_dim, e - r, fk->nb[1], (size_t)pos[r] * fk->nb[1]),
                                          kvr_view_2d(pc->ctx, fv, c->kv_dim, e - r, fv->nb[1], (size_t)pos[r] * fv->nb[1]),
                                          kvr_view_1d(pc->ctx, fp, e - r, (size_t)pos[r] * sizeof(int32_t)) };
            for (int x = 0; x < 3; x++) {
                struct kvr_tensor * cp = kvr_cpy(pc->ctx, from[x], to[x]);
                cp->src[2] = prev; // the copies in order, the attention after the last
                cp->why = "ring-kv: a block's rows to their positions";
                prev = cp;
            }
            r = e;
        }
    }
    // the gathered rows seen whole, after every copy
    struct kvr_tensor * k_all = kvr_view_2d(pc->ctx, fk, c->kv_dim, T, fk->nb[1], 0), * v_all = kvr_view_2d(pc->ctx, fv, c->kv_dim, T, fv->nb[1], 0);
    struct kvr_tensor * p_all = kvr_view_1d(pc->ctx, fp, T, 0);
    k_all->src[1] = v_all->src[1] = p_all->src[1] = prev;
    struct kvr_tensor * a = kvr_attn(pc->ctx, q, as_heads(pc, k_all), as_heads(pc, v_all), qpos, p_all, prev, pc->scale, pc->softcap, 0,
                                     pc->d->p.attn_mode);
    kvr_attn_kernel_as(a, T, T);
    return kvr_attn_sinks(a, pc->attn_sinks);
}

static void pass_ring_kv(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    struct kvr_kv_cache * c = pc->dr->cache;
    const int i = pc->rank, N = pc->N, n_i = pc->n_old + (int)k->ne[2];
    const int next = (i + 1) % N, prev = (i + N - 1) % N;
    const int H = (int)q->ne[1];
    struct kvr_tensor * vs = store_new(pc, il, k, v, pc->n_old);
    struct kvr_tensor * parts[256];
    struct kvr_tensor * bk = cache_rows(pc, c->k[il], 0, n_i), * bv = cache_rows(pc, c->v[il], 0, n_i), * bp = pc->kpos;
    // exact: parts[] are each block's statistics, folded into the ones before (ATTN_STATS's prev);
    // the blocks stay (receive buffers are never reused) for the partials once the last is in;
    // gather: no partials, the blocks gathered once the last is in
    const bool exact = ring_exact(pc), gather = ring_gather(pc);
    KVR_ASSERT(!(exact && gather)); // exact: prompts kvr_attn_cpu_exact takes; gather: past them, or 8-bit
    struct kvr_tensor * blk_k[256], * blk_v[256], * blk_p[256];
    blk_k[0] = bk;
    blk_v[0] = bv;
    blk_p[0] = bp;
    if (gather) {
        parts[0] = NULL;
    } else if (exact) {
        parts[0] = stats_part(pc, q, as_heads(pc, bk), pos, bp, NULL, vs);
        kvr_set_name(parts[0], "blk.%d.attn_stats0", il);
        parts[0]->why = "ring-kv: softmax statistics over this rank's own K";
    } else {
        parts[0] = kvr_attn(pc->ctx, q, as_heads(pc, bk), as_heads(pc, bv), pos, bp, vs, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
        kvr_set_name(parts[0], "blk.%d.attn_part0", il);
        parts[0]->why = "ring-kv: partial attention over this rank's own K/V";
    }
    int held = 0; // the block held now is rows [held, ...) of its origin's block
    for (int j = 1; j < N; j++) {
        // step j: pass on (the part still needed of) the block held at step j-1, take the block of
        // rank (i-j) mod N
        int a, b;
        ring_kv_rows(pc, (i - j + 1 + N) % N, j, &a, &b);
        KVR_ASSERT(a == b || (a >= held && b - held <= bk->ne[1]));
        const size_t off = a < b ? (size_t)(a - held) * bk->nb[1] : 0;
        struct kvr_tensor * sk = kvr_send(pc->ctx, kvr_view_2d(pc->ctx, bk, bk->ne[0], b - a, bk->nb[1], off), next, kvr_tag(il, KVR_TAG_K, j));
        struct kvr_tensor * sv = kvr_send(pc->ctx, kvr_view_2d(pc->ctx, bv, bv->ne[0], b - a, bv->nb[1], off), next, kvr_tag(il, KVR_TAG_V, j));
        sk->src[1] = vs;
        sv->src[1] = vs;
        kvr_set_name(sk, "blk.%d.k_send%d", il, j);
        kvr_set_name(sv, "blk.%d.v_send%d", il, j);
        sink(pc, sk, pc->window ? "ring-kv: the K rows the ranks ahead can see, on to the next rank" : "ring-kv: K block on to the next rank");
        sink(pc, sv, pc->window ? "ring-kv: the V rows the ranks ahead can see, on to the next rank" : "ring-kv: V block on to the next rank");
        if (il == pc->first_attn) {
            struct kvr_tensor * sp = kvr_send(pc->ctx, bp, next, kvr_tag(0, KVR_TAG_KPOS, j));
            kvr_set_name(sp, "kpos_send%d", j);
            sink(pc, sp, "ring-kv: positions of the whole K/V block (once, all layers share them)");
        }
        // the executor runs nodes in order: the attention over the block held now goes between
        // this send and the next receive, so the transfer overlaps it (not in the last layer of
        // a rank without the output: nothing reads those partials)
        if (!gather && (il < (int)pc->d->m->hp.n_layer - 1 || pc->rank == pc->pl->owner)) {
            sink(pc, parts[j - 1], exact ? "ring-kv: softmax statistics of the block held at this step, folded"
                                         : "ring-kv: partial attention over the block held at this step");
        }
        const int src = (i + N - j) % N;
        const int rows = pc->d->rows[src] + pc->pl->cnt[src];
        ring_kv_rows(pc, src, j, &a, &b);
        held = a;
        bk = kvr_recv(pc->ctx, recv_buf(pc, c->type_k, c->kv_dim, b - a, 1), prev, kvr_tag(il, KVR_TAG_K, j));
        bv = kvr_recv(pc->ctx, recv_buf(pc, c->type_v, c->kv_dim, b - a, 1), prev, kvr_tag(il, KVR_TAG_V, j));
        kvr_set_name(bk, "blk.%d.k_recv%d", il, j);
        kvr_set_name(bv, "blk.%d.v_recv%d", il, j);
        // every block that is sent is received, even where only the output would need it
        sink(pc, bk, "ring-kv: K block of rank (i-j) mod N from the previous rank");
        sink(pc, bv, "ring-kv: V block of rank (i-j) mod N from the previous rank");
        if (il == pc->first_attn) {
            pc->step_pos[j] = kvr_recv(pc->ctx, recv_buf(pc, KVR_TYPE_I32, rows, 1, 1), prev, kvr_tag(0, KVR_TAG_KPOS, j));
            kvr_set_name(pc->step_pos[j], "kpos_recv%d", j);
            sink(pc, pc->step_pos[j], "ring-kv: positions of the K/V block of step j");
        }
        bp = pc->step_pos[j];
        struct kvr_tensor * kp = a == 0 && b == rows ? bp : kvr_view_1d(pc->ctx, bp, b - a, (size_t)a * sizeof(int32_t));
        blk_k[j] = bk;
        blk_v[j] = bv;
        blk_p[j] = kp;
        if (gather) continue;
        if (exact) {
            parts[j] = stats_part(pc, q, as_heads(pc, bk), pos, kp, parts[j - 1], NULL);
            kvr_set_name(parts[j], "blk.%d.attn_stats%d", il, j);
            parts[j]->why = "ring-kv: softmax statistics of the visiting K block, folded";
            continue;
        }
        parts[j] = kvr_attn(pc->ctx, q, as_heads(pc, bk), as_heads(pc, bv), pos, kp, NULL, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
        kvr_set_name(parts[j], "blk.%d.attn_part%d", il, j);
        parts[j]->why = "ring-kv: partial attention over the visiting K/V block";
    }
    if (gather) {
        kvr_replace_node(t, ring_gather_attn(pc, il, q, pos, blk_k, blk_v, blk_p, vs), "ring-kv: attention over every block, gathered in position order");
        return;
    }
    if (exact) { // every block's statistics are in: the partials, rounded at the whole softmax's scale
        struct kvr_tensor * st = parts[N - 1];
        for (int j = 0; j < N; j++) {
            parts[j] = normed_part(pc, q, as_heads(pc, blk_k[j]), as_heads(pc, blk_v[j]), pos, blk_p[j], st, j == 0 ? vs : NULL);
            kvr_set_name(parts[j], "blk.%d.attn_part%d", il, j);
            parts[j]->why = "ring-kv: partial attention over a K/V block, its probabilities those of the whole softmax";
        }
    }
    kvr_replace_node(t, merge_all(pc, parts, N, H, il), "ring-kv: partials merged by log-sum-exp");
}

static void pass_ring_q(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    struct kvr_kv_cache * c = pc->dr->cache;
    const int i = pc->rank, N = pc->N, n_i = pc->n_old + (int)k->ne[2];
    const int next = (i + 1) % N, prev = (i + N - 1) % N;
    const int H = (int)q->ne[1], D = (int)q->ne[0], row = D * H + H;
    struct kvr_tensor * vs = store_new(pc, il, k, v, pc->n_old);
    struct kvr_tensor * kl = as_heads(pc, cache_rows(pc, c->k[il], 0, n_i)), * vl = as_heads(pc, cache_rows(pc, c->v[il], 0, n_i));
    int rows_max = 0;
    for (int s = 0; s < N; s++) rows_max = pc->pl->cnt[s] > rows_max ? pc->pl->cnt[s] : rows_max;
    // partial outputs for every rank's queries, slice s for rank s, sent home by one all-to-all
    struct kvr_tensor * stack = kvr_new_tensor_3d(pc->ctx, KVR_TYPE_F32, row, rows_max, N);
    struct kvr_tensor * last = NULL;
    struct kvr_tensor * bq = q, * bp = pos;
    struct kvr_tensor * prev_cp = NULL;
    // exact (ring_exact): the steps compute each visiting query's statistics over this rank's K, in
    // slice s of sst; one all-gather hands every rank's sst to every rank, where a query's slices of
    // all of them fold into its whole softmax's; then the partials, from the queries kept
    const bool exact = ring_exact(pc);
    const int srow = 2 * H;
    struct kvr_tensor * sst = exact ? kvr_new_tensor_3d(pc->ctx, KVR_TYPE_F32, srow, rows_max, N) : NULL;
    struct kvr_tensor * step_q[256], * step_p[256];
    for (int j = 0; j < N; j++) {
        const int s = (i + N - j) % N, cs = pc->pl->cnt[s];
        if (j > 0) {
            struct kvr_tensor * sq = kvr_send(pc->ctx, bq, next, kvr_tag(il, KVR_TAG_Q, j));
            kvr_set_name(sq, "blk.%d.q_send%d", il, j);
            sink(pc, sq, "ring-q: queries on to the next rank");
            if (il == pc->first_attn) {
                struct kvr_tensor * sp = kvr_send(pc->ctx, bp, next, kvr_tag(0, KVR_TAG_QPOS, j));
                kvr_set_name(sp, "qpos_send%d", j);
                sink(pc, sp, "ring-q: positions of the queries (once, all layers share them)");
            }
            // the partial of the queries held now runs between this send and the next receive
            if (prev_cp) sink(pc, prev_cp, exact ? "ring-q: softmax statistics of the queries held at this step"
                                                 : "ring-q: partial attention of the queries held at this step");
            bq = kvr_recv(pc->ctx, recv_buf(pc, KVR_TYPE_F32, D, H, cs), prev, kvr_tag(il, KVR_TAG_Q, j));
            kvr_set_name(bq, "blk.%d.q_recv%d", il, j);
            sink(pc, bq, "ring-q: queries of rank (i-j) mod N from the previous rank");
            if (il == pc->first_attn) {
                pc->step_pos[j] = kvr_recv(pc->ctx, recv_buf(pc, KVR_TYPE_I32, cs, 1, 1), prev, kvr_tag(0, KVR_TAG_QPOS, j));
                kvr_set_name(pc->step_pos[j], "qpos_recv%d", j);
                sink(pc, pc->step_pos[j], "ring-q: positions of the visiting queries");
            }
            bp = pc->step_pos[j];
        }
        step_q[j] = bq;
        step_p[j] = bp;
        if (exact) {
            struct kvr_tensor * sp = stats_part(pc, bq, kl, bp, pc->kpos, NULL, vs);
            kvr_set_name(sp, "blk.%d.attn_stats%d", il, j);
            sp->why = "ring-q: softmax statistics of the visiting queries over this rank's K";
            prev_cp = NULL;
            if (cs > 0) {
                struct kvr_tensor * cp = kvr_cpy(pc->ctx, sp, kvr_view_2d(pc->ctx, sst, srow, cs, sst->nb[1], (size_t)s * sst->nb[2]));
                cp->src[2] = last;
                last = cp;
                prev_cp = cp;
            }
            continue;
        }
        struct kvr_tensor * part = kvr_attn(pc->ctx, bq, kl, vl, bp, pc->kpos, vs, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
        kvr_set_name(part, "blk.%d.attn_part%d", il, j);
        part->why = "ring-q: partial attention of the visiting queries over this rank's K/V";
        prev_cp = NULL;
        if (cs > 0) {
            struct kvr_tensor * dst = kvr_view_2d(pc->ctx, stack, row, cs, stack->nb[1], (size_t)s * stack->nb[2]);
            struct kvr_tensor * cp = kvr_cpy(pc->ctx, part, dst);
            cp->src[2] = last;
            last = cp;
            prev_cp = cp;
        }
    }
    if (exact) {
        const int64_t len = (int64_t)srow * rows_max * N;
        struct kvr_tensor * all = recv_buf(pc, KVR_TYPE_F32, len, N, 1);
        struct kvr_tensor * g = kvr_all_gather(pc->ctx, kvr_reshape_2d(pc->ctx, sst, len, 1), kvr_view_2d(pc->ctx, all, len, N, all->nb[1], 0),
                                               N, N, kvr_tag(il, KVR_TAG_STATS, 0));
        g->src[2] = last; // after every slice is in
        kvr_set_name(g, "blk.%d.stats_gather", il);
        sink(pc, g, "ring-q: every rank's softmax statistics of every query, to every rank");
        last = NULL;
        for (int j = 0; j < N; j++) {
            const int s = (i + N - j) % N, cs = pc->pl->cnt[s];
            if (cs == 0) continue;
            // the statistics of rank s's queries over the K/V of each rank r: [srow, cs, N]
            struct kvr_tensor * st = kvr_view_3d(pc->ctx, g, srow, cs, N, sst->nb[1], g->nb[1], (size_t)s * sst->nb[2]);
            struct kvr_tensor * part = normed_part(pc, step_q[j], kl, vl, step_p[j], pc->kpos, st, vs);
            kvr_set_name(part, "blk.%d.attn_part%d", il, j);
            part->why = "ring-q: partial attention of the visiting queries over this rank's K/V, its probabilities those of the whole softmax";
            struct kvr_tensor * cp = kvr_cpy(pc->ctx, part, kvr_view_2d(pc->ctx, stack, row, cs, stack->nb[1], (size_t)s * stack->nb[2]));
            cp->src[2] = last;
            last = cp;
        }
    }
    struct kvr_tensor * a2a = kvr_all_to_all(pc->ctx, stack, N, pc->pl->T, kvr_tag(il, KVR_TAG_PARTIAL, 0));
    a2a->src[1] = last;
    kvr_set_name(a2a, "blk.%d.partials", il);
    sink(pc, a2a, "ring-q: partial outputs back to the ranks that own the queries");
    struct kvr_tensor * parts[256];
    const int ci = pc->pl->cnt[i];
    for (int s = 0; s < N; s++) {
        parts[s] = kvr_view_2d(pc->ctx, a2a, row, ci, a2a->nb[1], (size_t)s * a2a->nb[2]);
    }
    kvr_replace_node(t, merge_all(pc, parts, N, H, il), "ring-q: partials merged by log-sum-exp");
}

// decode over a sharded cache: every rank computes the token, attends over its own shard, and
// the partials are gathered by every rank and merged
static void pass_ring_decode(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    struct kvr_kv_cache * c = pc->dr->cache;
    const int N = pc->N, H = (int)q->ne[1], row = (int)q->ne[0] * H + H;
    const bool keep = pc->rank == pc->pl->store;
    const int n_i = pc->n_old + (keep ? 1 : 0);
    struct kvr_tensor * vs = keep ? store_new(pc, il, k, v, pc->n_old) : NULL;
    struct kvr_tensor * ks = as_heads(pc, cache_rows(pc, c->k[il], 0, n_i)), * vls = as_heads(pc, cache_rows(pc, c->v[il], 0, n_i));
    struct kvr_tensor * part;
    if (ring_exact(pc)) { // every shard's statistics to every rank first: 2 floats a head
        struct kvr_tensor * sp = kvr_set_name(stats_part(pc, q, ks, pos, pc->kpos, NULL, vs), "blk.%d.attn_stats", il);
        sp->why = "ring decode: softmax statistics of the token over this rank's shard";
        struct kvr_tensor * all = recv_buf(pc, KVR_TYPE_F32, 2 * H, N, 1);
        struct kvr_tensor * gs = kvr_all_gather(pc->ctx, sp, kvr_view_2d(pc->ctx, all, 2 * H, N, all->nb[1], 0), N, N,
                                                kvr_tag(il, KVR_TAG_STATS, 0));
        kvr_set_name(gs, "blk.%d.stats_gather", il);
        sink(pc, gs, "ring decode: every rank's softmax statistics to every rank");
        struct kvr_tensor * st = kvr_view_3d(pc->ctx, gs, 2 * H, 1, N, gs->nb[1], gs->nb[1], 0);
        part = normed_part(pc, q, ks, vls, pos, pc->kpos, st, vs);
        part->why = "ring decode: partial attention of the token over this rank's shard, its probabilities those of the whole softmax";
    } else {
        part = kvr_attn(pc->ctx, q, ks, vls, pos, pc->kpos, vs, pc->scale, pc->softcap, pc->window, pc->d->p.attn_mode);
        part->why = "ring decode: partial attention of the token over this rank's shard";
    }
    kvr_set_name(part, "blk.%d.attn_part", il);
    struct kvr_tensor * all = recv_buf(pc, KVR_TYPE_F32, row, N, 1);
    struct kvr_tensor * g = kvr_all_gather(pc->ctx, part, kvr_view_2d(pc->ctx, all, row, N, all->nb[1], 0), N, N,
                                           kvr_tag(il, KVR_TAG_PARTIAL, 0));
    kvr_set_name(g, "blk.%d.partials", il);
    sink(pc, g, "ring decode: every rank's partial to every rank");
    struct kvr_tensor * parts[256];
    for (int s = 0; s < N; s++) parts[s] = kvr_view_2d(pc->ctx, g, row, 1, g->nb[1], (size_t)s * g->nb[1]);
    kvr_replace_node(t, merge_all(pc, parts, N, H, il), "ring decode: partials merged by log-sum-exp");
}

//
// recurrent layers (Gated DeltaNet): no K/V rows travel, the state does, along the tokens' order.
// A chain rank (tsp, kvr) receives the state after tokens [0, s_r) from rank r-1 into its cache,
// runs its tokens on and hands the state after [0, e_r) to rank r+1: the last rank ends with it.
// The ring's 2N chunks run in token order too: chunk c's rank takes the state from chunk c-1's
// (rank c for c < N, 2N-1-c after; empty chunks are passed over), and the last chunk's rank hands
// the final state to every rank, which all keep it: a ring decode runs the token on every rank
// from its own copy, and the next ring prefill starts from the first chunk's rank's copy. Each
// hop moves one state, whatever the prompt's length.
//

static int ring_chunk_rank(int N, int c) { return c < N ? c : 2 * N - 1 - c; }
static int ring_chunk_size(int T, int N, int c) { return chunk_begin(T, 2 * N, c + 1) - chunk_begin(T, 2 * N, c); }

// a state in transit: an input buffer of the graph, placed before it runs and never reused
static struct kvr_tensor * state_buf(struct pass_ctx * pc) {
    return kvr_set_name(recv_buf(pc, KVR_TYPE_F32, pc->dr->cache->n_state, 1, 1), "state buffer");
}

// What the block's readers read instead of it: a view of the segment's output o, so that o stays
// the one node that runs the recurrence (the state's sends depend on it); with no tokens here, an
// empty view.
static void gdn_replace(struct pass_ctx * pc, struct kvr_tensor * t, struct kvr_tensor * o, const char * why) {
    struct kvr_tensor * src = o ? o : t->src[0];
    kvr_replace_node(t, kvr_view_3d(pc->ctx, src, t->ne[0], t->ne[1], t->ne[2], t->ne[0] * sizeof(float),
                                    t->ne[0] * t->ne[1] * sizeof(float), 0), why);
}

// a send of state to peer once the node after has run (the segment that made it)
static struct kvr_tensor * state_send(struct pass_ctx * pc, struct kvr_tensor * st, struct kvr_tensor * after, int peer, int tag) {
    struct kvr_tensor * s = kvr_send(pc->ctx, st, peer, tag);
    s->src[1] = after;
    return kvr_set_name(s, "blk.%d.state_send", kvr_tag_layer(tag));
}

static void pass_gdn_chain(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    struct kvr_tensor * st = pc->dr->cache->state[il];
    const int r = pc->rank, n = (int)t->ne[2];
    KVR_ASSERT(pc->pl->P == 0 && "a chain runs on several ranks for a first prefill only");
    int s = 0;
    for (int q = 0; q < r; q++) s += pc->pl->cnt[q];
    struct kvr_tensor * got = NULL;
    if (s > 0) {
        got = kvr_set_name(kvr_recv(pc->ctx, st, r - 1, kvr_tag(il, KVR_TAG_STATE, 0)), "blk.%d.state_recv", il);
        got->why = "chain: the recurrent state after tokens [0, s_r) from rank r-1, into this rank's cache";
    }
    struct kvr_tensor * o = n > 0 ? kvr_gdn_segment(pc->ctx, t, 0, n, st, s == 0, got) : NULL;
    // a rank without tokens hands the state on, or keeps it: the last rank holds the whole cache
    if (!o && got) sink(pc, got, "chain: the recurrent state after tokens [0, s_r) from rank r-1, into this rank's cache");
    if (r < pc->N - 1 && s + n > 0) {
        sink(pc, state_send(pc, st, o ? o : got, r + 1, kvr_tag(il, KVR_TAG_STATE, 0)),
             "chain: the recurrent state after tokens [0, e_r) on to rank r+1");
    }
    gdn_replace(pc, t, o, s == 0 ? "chain: the recurrence from the zero state" : "chain: the recurrence on from rank r-1's state");
}

static void pass_gdn_ring(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    const struct eval_plan * pl = pc->pl;
    struct kvr_kv_cache * cache = pc->dr->cache;
    const int N = pc->N, r = pc->rank, T = pl->T, nc = 2 * N;
    KVR_ASSERT(nc <= STREAM_STEP && "the state's tags number the chunks");
    int first = -1, last = -1;
    for (int c = 0; c < nc; c++) {
        if (ring_chunk_size(T, N, c) == 0) continue;
        if (first < 0) first = c;
        last = c;
    }
    struct kvr_tensor * part[2] = { NULL, NULL }, * buf = NULL, * prev = NULL;
    int t0 = 0;
    for (int k = 0; k < 2; k++) {
        const int c = k == 0 ? r : nc - 1 - r, n = ring_chunk_size(T, N, c);
        if (n == 0) continue;
        int pc_ = c - 1, nc_ = c + 1; // the chunks before and after it that hold tokens
        while (pc_ >= 0 && ring_chunk_size(T, N, pc_) == 0) pc_--;
        while (nc_ < nc && ring_chunk_size(T, N, nc_) == 0) nc_++;
        struct kvr_tensor * dep = NULL;
        if (pc_ < 0) { // the sequence's first new tokens: on from this rank's copy (or from zero)
            buf = state_buf(pc);
            if (pl->P > 0) dep = kvr_cpy(pc->ctx, cache->state[il], buf);
        } else if (ring_chunk_rank(N, pc_) == r) { // the chunk before is this rank's too
            dep = prev;
        } else {
            buf = state_buf(pc);
            dep = kvr_set_name(kvr_recv(pc->ctx, buf, ring_chunk_rank(N, pc_), kvr_tag(il, KVR_TAG_STATE, c)), "blk.%d.state_recv", il);
            dep->why = "ring: the recurrent state before this chunk from the rank of the chunk before";
        }
        struct kvr_tensor * o = kvr_gdn_segment(pc->ctx, t, t0, n, buf, pc_ < 0 && pl->P == 0, dep);
        if (nc_ < nc && ring_chunk_rank(N, nc_) != r) {
            sink(pc, state_send(pc, buf, o, ring_chunk_rank(N, nc_), kvr_tag(il, KVR_TAG_STATE, nc_)),
                 "ring: the recurrent state after this chunk on to the rank of the next one");
        }
        if (nc_ == nc) { // the last chunk: its state is every rank's
            struct kvr_tensor * keep = kvr_cpy(pc->ctx, buf, cache->state[il]);
            keep->src[2] = o;
            sink(pc, keep, "ring: the final recurrent state into this rank's cache");
            for (int q = 0; q < N; q++) {
                if (q != r) sink(pc, state_send(pc, buf, o, q, kvr_tag(il, KVR_TAG_STATE, 0)), "ring: the final recurrent state to every rank");
            }
        }
        part[k] = o;
        prev = o;
        t0 += n;
    }
    if (ring_chunk_rank(N, last) != r) {
        struct kvr_tensor * got = kvr_recv(pc->ctx, cache->state[il], ring_chunk_rank(N, last), kvr_tag(il, KVR_TAG_STATE, 0));
        kvr_set_name(got, "blk.%d.state_final", il);
        got->why = "ring: the final recurrent state from the last chunk's rank, into this rank's cache";
        pc->late = realloc(pc->late, sizeof(*pc->late) * (size_t)(pc->n_late + 1));
        KVR_ASSERT(pc->late != NULL);
        pc->late[pc->n_late++] = got;
    }
    if (!part[0] || !part[1]) {
        gdn_replace(pc, t, part[0] ? part[0] : part[1], "ring: the recurrence over this rank's chunk");
        return;
    }
    // both chunks: their outputs side by side, as the batch's rows are
    const int64_t w = t->ne[0] * t->ne[1], n0 = part[0]->ne[2];
    struct kvr_tensor * rows = kvr_set_name(recv_buf(pc, KVR_TYPE_F32, w, t->ne[2], 1), "gdn rows");
    const size_t row = (size_t)w * sizeof(float);
    struct kvr_tensor * ca = kvr_cpy(pc->ctx, kvr_reshape_2d(pc->ctx, part[0], w, n0), kvr_view_2d(pc->ctx, rows, w, n0, row, 0));
    struct kvr_tensor * cb = kvr_cpy(pc->ctx, kvr_reshape_2d(pc->ctx, part[1], w, t->ne[2] - n0),
                                     kvr_view_2d(pc->ctx, rows, w, t->ne[2] - n0, row, (size_t)n0 * row));
    cb->src[2] = ca;
    struct kvr_tensor * all = kvr_view_3d(pc->ctx, rows, t->ne[0], t->ne[1], t->ne[2], t->ne[0] * sizeof(float), row, 0);
    all->src[1] = cb;
    kvr_replace_node(t, all, "ring: the recurrence over this rank's two chunks, each on from the chunk before");
}

// a ring decode: every rank runs the token on from its own copy of the state
static void pass_gdn_decode(struct pass_ctx * pc, struct kvr_tensor * t, int il) {
    kvr_replace_node(t, kvr_gdn_segment(pc->ctx, t, 0, t->ne[2], pc->dr->cache->state[il], false, NULL),
                     "ring decode: the token on from this rank's copy of the recurrent state");
}

static void run_pass(struct pass_ctx * pc, struct kvr_graph * g) {
    const int n_nodes = g->n_nodes;
    struct kvr_tensor ** blocks = malloc(sizeof(*blocks) * (size_t)(n_nodes ? n_nodes : 1));
    int nb = 0;
    for (int i = 0; i < n_nodes; i++) {
        if (g->nodes[i]->op == KVR_OP_ATTN_BLOCK || g->nodes[i]->op == KVR_OP_GDN_BLOCK) blocks[nb++] = g->nodes[i];
    }
    const bool decode = pc->pl->store >= 0;
    pc->first_attn = -1;
    for (int b = 0; b < nb && pc->first_attn < 0; b++) {
        if (blocks[b]->op == KVR_OP_ATTN_BLOCK) pc->first_attn = blocks[b]->op_params[0];
    }
    for (int b = 0; b < nb; b++) {
        struct kvr_tensor * t = blocks[b];
        const int il = t->op_params[0];
        if (t->op == KVR_OP_GDN_BLOCK) {
            switch (pc->pl->strat) {
                case KVR_STRATEGY_TSP:
                case KVR_STRATEGY_KVR:     pass_gdn_chain(pc, t, il); break;
                case KVR_STRATEGY_RING_KV:
                case KVR_STRATEGY_RING_Q:  if (decode) pass_gdn_decode(pc, t, il); else pass_gdn_ring(pc, t, il); break;
                default:                   KVR_ASSERT(!"no pass for this strategy");
            }
            continue;
        }
        pc->scale      = kvr_attn_block_scale(t);
        pc->softcap    = kvr_attn_block_softcap(t);
        pc->window     = kvr_attn_block_window(t);
        pc->attn_sinks = kvr_attn_sinks_of(t);
        switch (pc->pl->strat) {
            case KVR_STRATEGY_TSP:     pass_tsp(pc, t, il); break;
            case KVR_STRATEGY_KVR:     pass_kvr(pc, t, il); break;
            case KVR_STRATEGY_RING_KV: pass_ring_kv(pc, t, il); break;
            case KVR_STRATEGY_RING_Q:  if (decode) pass_ring_decode(pc, t, il); else pass_ring_q(pc, t, il); break;
            default:                   KVR_ASSERT(!"no pass for this strategy");
        }
    }
    free(blocks);
}

//
// one rank's eval: its inputs and its pass, through the eval road
//

// The node after which layer il's rows of this rank's cache are final: the V store (which runs
// after the K store and the receives of kvr's prefix) or tsp's V gather; NULL when this rank
// stores nothing in that layer (a ring decode's ranks but the store rank).
static struct kvr_tensor * layer_final_find(struct pass_ctx * pc, struct kvr_graph * g, int il) {
    char a[64], b[64];
    snprintf(a, sizeof(a), "blk.%d.v_store", il);
    snprintf(b, sizeof(b), "blk.%d.v_gather", il);
    for (int i = 0; i < pc->n_sinks; i++) { // tsp stores its own rows, then gathers everyone's: the gather
        if (!strcmp(pc->sinks[i]->name, b)) return pc->sinks[i];
    }
    for (int i = 0; i < pc->n_sinks; i++) {
        if (!strcmp(pc->sinks[i]->name, a)) return pc->sinks[i];
    }
    for (int i = 0; i < g->n_nodes; i++) { // the single pass: reached from the attention
        if (!strcmp(g->nodes[i]->name, a) || !strcmp(g->nodes[i]->name, b)) return g->nodes[i];
    }
    return NULL;
}

// The single pass lists no sinks (everything hangs off the output): its layers' final stores
// become sinks, in layer order, so that "right after layer il's store" is a place in the
// executor's order for every strategy. Same nodes, same values: only independent nodes may move.
static void stores_as_sinks(struct pass_ctx * pc, struct kvr_graph * g) {
    for (int il = 0; il < pc->dr->cache->n_layer; il++) {
        struct kvr_tensor * t = layer_final_find(pc, g, il);
        bool listed = false;
        for (int i = 0; i < pc->n_sinks && t; i++) listed |= pc->sinks[i] == t;
        if (t && !listed) sinks_put(pc, pc->n_sinks, t);
    }
}

// The backends' question before each node (struct kvr_backend.interrupted): the session's flag.
// A rank's first sight of it becomes its error and, for local ranks, a failed transport, so that
// peers waiting on it stop at once instead of timing out.
static bool rank_interrupted(void * user) {
    struct dist_rank * dr = user;
    if (!atomic_load(dr->interrupt)) return false;
    if (!dr->interrupted) {
        dr->interrupted = true;
        kvr_error(KVR_ERR_INTERRUPTED, "rank %d: interrupted", dr->rank);
        if (dr->fail_peers) comm_fail(dr->comm, KVR_ERR_INTERRUPTED);
    } else {
        kvr_error(KVR_ERR_INTERRUPTED, "rank %d: interrupted", dr->rank);
    }
    return true;
}

// A rank's cache holds the rows the rank has and grows, doubling up to the session's context, when
// an eval, a load or a recovery needs more: a rank that holds a ring shard, a chain's prefix or
// nothing takes that much memory, not a whole context each (the rows move through host memory
// once per doubling; a moved cache also rebuilds a kept decode graph, keyed on it).
#define RANK_CACHE_MIN 256

// Every recurrent layer's state of a rank's cache, n_layer * n_state floats (a layer without
// state: untouched), out through its backend and back in.
static void states_get(const struct dist_rank * dr, float * out) {
    const struct kvr_kv_cache * c = dr->cache;
    for (int il = 0; il < c->n_layer && c->state; il++) {
        if (c->state[il]) kvr_kv_cache_get_state(dr->be, c, il, out + (size_t)il * (size_t)c->n_state);
    }
}

static void states_set(struct dist_rank * dr, const float * in) {
    struct kvr_kv_cache * c = dr->cache;
    for (int il = 0; il < c->n_layer && c->state; il++) {
        if (c->state[il]) kvr_kv_cache_set_state(dr->be, c, il, in + (size_t)il * (size_t)c->n_state);
    }
}

static size_t states_floats(const struct kvr_session * d) {
    return (size_t)d->m->hp.n_layer * (size_t)kvr_hp_state_floats(&d->m->hp);
}

// Rows of a cache as f32 (what the KV file reader and writer and a recovery's replica rows take),
// turned from and into the cache's types through a host copy of the stored rows.
static void cache_get_f32(struct kvr_backend * be, const struct kvr_kv_cache * c, int il, int row0, int n, float * k, float * v) {
    if (n <= 0) return;
    void * tmp = kvr_malloc((c->row_k > c->row_v ? c->row_k : c->row_v) * (size_t)n);
    if (k) {
        kvr_kv_cache_get_rows(be, c, il, row0, n, tmp, NULL);
        kvr_kv_rows_to_float(c->type_k, tmp, k, n, c->kv_dim);
    }
    if (v) {
        kvr_kv_cache_get_rows(be, c, il, row0, n, NULL, tmp);
        kvr_kv_rows_to_float(c->type_v, tmp, v, n, c->kv_dim);
    }
    free(tmp);
}

static void cache_set_f32(struct kvr_backend * be, struct kvr_kv_cache * c, int il, int row0, int n, const float * k, const float * v) {
    if (n <= 0) return;
    void * tmp = kvr_malloc((c->row_k > c->row_v ? c->row_k : c->row_v) * (size_t)n);
    if (k) {
        kvr_kv_rows_from_float(c->type_k, k, tmp, n, c->kv_dim);
        kvr_kv_cache_set_rows(be, c, il, row0, n, tmp, NULL);
    }
    if (v) {
        kvr_kv_rows_from_float(c->type_v, v, tmp, n, c->kv_dim);
        kvr_kv_cache_set_rows(be, c, il, row0, n, NULL, tmp);
    }
    free(tmp);
}

static int rank_reserve(struct kvr_session * d, struct dist_rank * dr, int rows) {
    if (rows <= dr->cache->n_ctx) return KVR_OK;
    if (rows > d->n_ctx) {
        return kvr_error(KVR_ERR_ARG, "rank %d: %d rows exceed its context of %d (raise -c)", dr->rank, rows, d->n_ctx);
    }
    int cap = dr->cache->n_ctx > 0 ? dr->cache->n_ctx : RANK_CACHE_MIN;
    while (cap < rows) cap *= 2;
    if (cap > d->n_ctx) cap = d->n_ctx;
    struct kvr_kv_cache * c = kvr_kv_cache_new(&d->m->hp, cap, d->type_k, d->type_v, dr->be);
    if (!c) return KVR_ERR_NOMEM;
    void * k = malloc(c->row_k * (size_t)(dr->n_rows + 1)), * v = malloc(c->row_v * (size_t)(dr->n_rows + 1));
    KVR_ASSERT(k && v);
    for (int il = 0; il < c->n_layer && dr->n_rows > 0; il++) {
        if (!c->k[il]) continue; // a recurrent layer: its state goes along below
        kvr_kv_cache_get_rows(dr->be, dr->cache, il, 0, dr->n_rows, k, v);
        kvr_kv_cache_set_rows(dr->be, c, il, 0, dr->n_rows, k, v);
    }
    free(k);
    free(v);
    float * st = c->n_state ? malloc(sizeof(float) * states_floats(d)) : NULL;
    if (st) states_get(dr, st); // the recurrent states go along
    kvr_kv_cache_free(dr->cache);
    dr->cache = c;
    if (st) states_set(dr, st);
    free(st);
    return KVR_OK;
}

static int rank_fail(struct dist_rank * dr, int rc) {
    dr->rc = rc;
    snprintf(dr->err, sizeof(dr->err), "%s", kvr_last_error());
    return rc;
}

// The eval road calls this between the model's graph and the memory plan.
static void rank_pass(void * user, struct kvr_pass_args * a) {
    struct pass_ctx * pc = user;
    pc->ctx  = a->ctx;
    pc->kpos = a->kpos;
    if (pc->receiver) { // P/D's decode rank: its graph is the receives alone
        dejavu_receive_graph(pc->d, pc->dr, a->ctx, a->g);
        return;
    }
    if (pc->pl->strat == KVR_STRATEGY_SINGLE) {
        kvr_pass_single(a->ctx, a->g, pc->dr->cache, pc->n_old, a->kpos, pc->d->p.attn_mode);
        stores_as_sinks(pc, a->g);
    } else {
        run_pass(pc, a->g);
        for (int i = 0; i < pc->n_late; i++) sinks_put(pc, pc->n_sinks, pc->late[i]);
    }
    dejavu_rank_nodes(pc, a->g); // what streams, logs or replicates each layer's final rows
    // sinks first, in layer order: a send then runs as soon as what it sends exists, not after
    // the whole model (a peer may be waiting for it to go on)
    a->sinks   = pc->sinks;
    a->n_sinks = pc->n_sinks;
}

// Rank r's stats of the eval ev it ran (c new tokens, from t0 on): the backend's counters beside
// the transfers' figures its comm counted. Attention pairs are reported per layer: divided by the
// layers whose attention ran here (a rank without the output skips the last layer's).
static void rank_stats_of(struct dist_rank * dr, const struct kvr_eval * ev, const struct kvr_model * m, int r, int c, double t0) {
    const struct kvr_counters * cn = &ev->counters;
    struct kvr_rank_stats * st = &dr->comm->st;
    const int attn_layers = ev->n_attn_layers, n_layer = (int)m->hp.n_layer;
    st->rank = r;
    st->tokens = c;
    st->attn_dot_dense  = attn_layers ? cn->attn_dot_dense / attn_layers : 0;
    st->attn_dot_causal = attn_layers ? cn->attn_dot_causal / attn_layers : 0;
    st->matmul_ms = cn->op_ms[KVR_OP_MUL_MAT] + cn->op_ms[KVR_OP_MUL_MAT_ID];
    st->expert_bytes = cn->expert_bytes;
    st->attn_ms = cn->op_ms[KVR_OP_ATTN] + cn->op_ms[KVR_OP_ATTN_STATS] + cn->op_ms[KVR_OP_ATTN_NORMED];
    st->compute_ms = 0.0;
    memcpy(st->op_ms, cn->op_ms, sizeof(st->op_ms));
    for (int k = 0; k < KVR_OP_COUNT; k++) {
        const bool comm = k == KVR_OP_SEND || k == KVR_OP_RECV || k == KVR_OP_ALL_GATHER || k == KVR_OP_ALL_TO_ALL;
        if (!comm) st->compute_ms += cn->op_ms[k]; // the transfers' nodes wait: wait_ms
    }
    // rows are per layer that moves them: a recurrent layer moves its state instead
    const int kv_layers = n_layer - (int)m->hp.n_recurrent > 0 ? n_layer - (int)m->hp.n_recurrent : 1;
    st->kv_rows_sent /= kv_layers;
    st->kv_rows_recv /= kv_layers;
    st->ttft_ms = kvr_time_ms() - t0;
}

static int rank_eval(struct kvr_session * d, struct dist_rank * dr) {
    const struct kvr_model * m = d->m;
    struct eval_plan * pl = &d->plan;
    const int r = dr->rank, c = pl->cnt[r];
    const double t0 = kvr_time_ms();
    dr->rc = KVR_OK;
    dr->computed = false;
    dr->err[0] = 0;
    memset(&dr->comm->st, 0, sizeof(dr->comm->st));
    dr->comm->timeout_peer = -1;
    // a P/D prefill's collectives are among the prefill ranks
    dr->comm->base.n_ranks = pl->pd ? pl->N : d->n_ranks;
    const bool receiver = pl->pd && r == d->n_ranks - 1;

    const bool ring = d->layout == LAYOUT_RING;
    const bool chain = pl->strat == KVR_STRATEGY_TSP || pl->strat == KVR_STRATEGY_KVR;
    const bool keep = !ring || pl->store < 0 || pl->store == r; // does this rank store the new rows?
    const int n_old = dr->n_rows, n_new = receiver ? pl->T : keep ? c : 0;
    // the rows this eval makes here (the replication log's): the P/D receiver makes none
    dr->made = receiver ? 0 : n_new;
    dr->made_row0 = chain && c ? pl->pos[r][0] : n_old;
    if (n_old + n_new > d->n_ctx) {
        return rank_fail(dr, kvr_error(KVR_ERR_ARG, "rank %d: %d cached + %d new rows exceed its context of %d (raise -c)",
                                       r, n_old, n_new, d->n_ctx));
    }
    const int n_layer = (int)m->hp.n_layer;
    // the cache rows this rank attends over after its store; tsp's cover the whole prompt
    int e_r = 0; // kvr: the end of this rank's slice
    for (int q = 0; q <= r; q++) e_r += pl->cnt[q];
    const int n_kpos = pl->strat == KVR_STRATEGY_TSP ? pl->T : pl->strat == KVR_STRATEGY_KVR ? e_r : n_old + n_new;
    // the rows this rank holds after the eval: tsp and kvr ranks keep the prefix they saw
    const int n_final = chain ? n_kpos : n_old + n_new;
    const int rc_reserve = rank_reserve(d, dr, n_final > n_old + n_new ? n_final : n_old + n_new);
    if (rc_reserve != KVR_OK) return rank_fail(dr, rc_reserve);
    // the inputs: this rank's tokens, and the positions of its cache rows after the eval
    int32_t * toks = malloc(sizeof(int32_t) * (size_t)(c + 1));
    int32_t * kpos = malloc(sizeof(int32_t) * (size_t)(n_kpos + 1));
    KVR_ASSERT(toks && kpos);
    for (int i = 0; i < c; i++) toks[i] = d->tokens[pl->pos[r][i] - pl->P];
    for (int i = 0; i < n_new; i++) dr->cache_pos[n_old + i] = receiver ? i : pl->pos[r][i];
    for (int i = 0; i < n_kpos && !receiver; i++) kpos[i] = chain ? i : dr->cache_pos[i];

    struct pass_ctx pc = { .d = d, .dr = dr, .pl = pl, .rank = r, .N = pl->N, .n_old = n_old,
                           .receiver = receiver, .n_final = n_final };
    struct kvr_tensor * step_pos[256] = { 0 };
    pc.step_pos = step_pos;
    FILE * graph_out = NULL;
    if (d->p.graph_out) {
        graph_out = open_memstream(&dr->graph_text, &dr->graph_len);
        if (graph_out) fprintf(graph_out, "rank %d (%s, %d tokens):\n", r, kvr_strategy_name(pl->strat), c);
    }
    char name[32];
    snprintf(name, sizeof(name), "rank %d", r);
    struct kvr_eval ev = {
        .model      = dr->model,
        .backend    = dr->be,
        .cache      = dr->cache,
        .tokens     = toks,
        .pos        = pl->pos[r],
        .n_tokens   = c,
        .kpos       = kpos,
        .n_kpos     = n_kpos,
        .n_past     = n_old,
        .n_outputs  = !receiver && r == pl->owner ? 1 : 0,
        .n_ctx      = d->n_ctx, // the sequence's context, not this rank's cache (grown as needed)
        .attn_mode  = d->p.attn_mode,
        // the plain single pass goes by the road's own (NULL); a strategy, or nodes DejaVu adds
        // after a layer's rows (dejavu_rank_nodes), need the rank's pass
        .pass       = pl->strat == KVR_STRATEGY_SINGLE && !receiver && !dejavu_rank_wants_pass(d, dr, c) ? NULL : rank_pass,
        .pass_user  = &pc,
        .no_model   = receiver,
        .graph_size = n_layer * (64 + 24 * pl->N) + 256,
        .graph_out  = graph_out,
        .capture    = d->p.capture,
        .name       = name,
        .compute    = &dr->buf,
        .logits     = dr->logits,
        .reuse      = dr->reuse, // the road alone decides whether this eval may run it (eval_reusable)
    };
    dr->computed = true;
    int rc = kvr_eval_run(&ev);
    if (rc == KVR_OK) rc = dejavu_rank_done(dr, &ev); // a decode token's rows, which no node handed on
    if (graph_out) fclose(graph_out);
    free(pc.sinks);
    free(pc.late);
    free(toks);
    free(kpos);
    if (rc == KVR_OK) {
        if (pl->strat == KVR_STRATEGY_TSP || pl->strat == KVR_STRATEGY_KVR) {
            for (int i = 0; i < n_final; i++) dr->cache_pos[i] = i;
        }
        dr->n_rows = n_final;
    }
    rank_stats_of(dr, &ev, m, r, c, t0);
    if (d->p.trace) {
        int ns;
        const struct kvr_span * sp = kvr_backend_spans(dr->be, &ns, false);
        for (int i = 0; i < ns; i++) {
            if (dr->n_spans == dr->cap_spans) {
                dr->cap_spans = dr->cap_spans ? 2 * dr->cap_spans : 256;
                dr->spans = realloc(dr->spans, sizeof(*dr->spans) * (size_t)dr->cap_spans);
                KVR_ASSERT(dr->spans != NULL);
            }
            dr->spans[dr->n_spans] = sp[i];
            dr->spans[dr->n_spans].t0 -= d->t_base;
            dr->spans[dr->n_spans].t1 -= d->t_base;
            dr->n_spans++;
        }
        kvr_backend_spans(dr->be, &ns, true);
    }
    return rc == KVR_OK ? rc : rank_fail(dr, rc);
}

static void * rank_thread(void * arg) {
    void ** a = arg;
    rank_eval(a[0], a[1]);
    return NULL;
}

// The driver's wait for the ranks' threads, a wait like the ranks' own: once one came back, the
// rest have the timeout to follow (as an MPI rank waits for the owner's logits). Past it the
// eval fails (the transport wakes every waiting rank; a local rank still out is the one that
// stopped) and they have another timeout to come back. A thread that does not is left running:
// the session is wedged (it frees nothing and runs no eval). KVR_OK, or KVR_ERR_COMM with msg set.
static int join_ranks(struct kvr_session * d, pthread_t * th, bool * started, char * msg, size_t cap) {
    const double t_out = 1e3 * d->p.timeout_s;
    double t_back = -1.0, t_told = -1.0; // when the first thread came back; when the rest were told to stop
    int left = 0, rc = KVR_OK;
    for (int i = 0; i < d->n_local; i++) left += started[i];
    while (left > 0) {
        for (int i = 0; i < d->n_local; i++) {
            if (!started[i]) continue;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            if (pthread_timedjoin_np(th[i], NULL, &ts) != 0) continue;
            started[i] = false;
            left--;
            if (t_back < 0) t_back = kvr_time_ms();
        }
        const double now = kvr_time_ms();
        if (left == 0 || t_back < 0) continue;
        if (t_told < 0 && now >= t_back + t_out) {
            int first = -1;
            for (int i = 0; i < d->n_local && first < 0; i++) if (started[i]) first = i;
            rc = kvr_error(KVR_ERR_COMM, "rank %d: timed out after %.1f s: it did not finish the eval after another rank did (%d rank%s still out)",
                           d->ranks[first].rank, d->p.timeout_s, left, left > 1 ? "s" : "");
            snprintf(msg, cap, "%s", kvr_last_error());
            if (d->p.comm == KVR_COMM_LOCAL) local_mark_stopped(d->tr, d->ranks[first].rank, t_back);
            d->tr->fail(d->tr, d->ranks[first].rank, msg);
            t_told = now;
        } else if (t_told >= 0 && now >= t_told + t_out) {
            for (int i = 0; i < d->n_local; i++) {
                if (!started[i]) continue;
                pthread_detach(th[i]);
                started[i] = false;
                rc = kvr_error(KVR_ERR_COMM, "rank %d did not stop within %.1f s of being told to: its thread still runs, so the session "
                               "cannot go on (nothing of it is freed)", d->ranks[i].rank, d->p.timeout_s);
                snprintf(msg, cap, "%s", kvr_last_error());
            }
            d->wedged = true;
            left = 0;
        }
    }
    return rc;
}

//
// the driver
//

#ifdef KVR_MPI
// MPI started once per process (it cannot be started twice: it ends with the process, not the
// session); d->n_ranks and *my_rank from MPI_COMM_WORLD; the MPI transport
static struct transport * mpi_start(struct kvr_session * d, int * my_rank) {
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        atexit(mpi_finalize);
    }
    MPI_Comm_size(MPI_COMM_WORLD, &d->n_ranks);
    MPI_Comm_rank(MPI_COMM_WORLD, my_rank);
    // the index among the processes of this node picks the GPU (kvr_rank_gpu), never the global rank
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, *my_rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &d->node_rank);
    MPI_Comm_free(&node);
    void * ub = NULL;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    if (flag && *(int *)ub < kvr_tag((int)d->m->hp.n_layer, KVR_TAG_KIND_COUNT, 255)) {
        kvr_error(KVR_ERR_UNSUPP, "MPI_TAG_UB %d is too small for %u layers", *(int *)ub, d->m->hp.n_layer);
        return NULL;
    }
    struct transport * t = calloc(1, sizeof(*t));
    KVR_ASSERT(t != NULL);
    *t = (struct transport) { .isend = mpi_isend, .irecv = mpi_irecv, .wait = mpi_wait, .fail = mpi_fail, .cancel = mpi_cancel,
                              .idle = mpi_idle, .free = mpi_free, .n_ranks = d->n_ranks, .early_recv = true };
    return t;
}
#endif

#ifdef KVR_NCCL
// The NCCL ranks of this process. Started by mpirun (OpenMPI, MPICH's Hydra, PMIx): one rank, on
// the GPU of its index among the node's processes, the unique id from rank 0 over MPI. Else this
// process drives n_ranks GPUs, rank i on the i-th from --device (both by kvr_rank_gpu).
static int nccl_start(struct kvr_session * d, int * my_rank) {
    int n_dev = 0;
    const cudaError_t e = cudaGetDeviceCount(&n_dev);
    char no_dev[256] = "";
    if (e != cudaSuccess || n_dev == 0) {
        snprintf(no_dev, sizeof(no_dev), "--comm nccl: no CUDA device (cudaGetDeviceCount: %s): every NCCL rank needs a GPU",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    const bool under_mpirun = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
    if (under_mpirun) {
#ifdef KVR_MPI
        d->host_tr = mpi_start(d, my_rank);
        if (!d->host_tr) return KVR_ERR_UNSUPP;
        // every process takes part in the broadcast, even one that cannot go on: the others
        // then fail in the communicator's initialisation, within the timeout
        struct { int ok; ncclUniqueId id; } boot;
        memset(&boot, 0, sizeof(boot));
        if (*my_rank == 0) boot.ok = ncclGetUniqueId(&boot.id) == ncclSuccess;
        MPI_Bcast(&boot, (int)sizeof(boot), MPI_BYTE, 0, MPI_COMM_WORLD);
        if (!boot.ok) return kvr_error(KVR_ERR_COMM, "rank %d: rank 0 could not make the NCCL unique id (NCCL_DEBUG=INFO tells why)", *my_rank);
        if (no_dev[0]) return kvr_error(KVR_ERR_DEVICE, "rank %d: %s", *my_rank, no_dev);
        // more processes on a node than GPUs each sees is right when the launcher shows each its
        // own (CUDA_VISIBLE_DEVICES per rank: every one takes its device 0); two ranks really on
        // one GPU are refused by NCCL's initialisation, whose error names them
        int device = kvr_rank_gpu(d->node_rank, d->p.device, n_dev);
        d->n_local = 1;
        d->tr = nccl_new(d->n_ranks, *my_rank, 1, &device, boot.id, true, d->p.timeout_s);
        return d->tr ? KVR_OK : KVR_ERR_COMM;
#else
        return kvr_error(KVR_ERR_UNSUPP, "--comm nccl under mpirun needs a build with MPI as well (make KVR_CUDA=1 KVR_MPI=1)");
#endif
    }
    if (no_dev[0]) return kvr_error(KVR_ERR_DEVICE, "%s", no_dev);
    const int n = d->p.n_ranks > 0 ? d->p.n_ranks : 1;
    if (n > n_dev) { // NCCL runs one rank a GPU
        return kvr_error(KVR_ERR_DEVICE, "--comm nccl: %d ranks need %d GPUs; this process sees %d", n, n, n_dev);
    }
    if (n > 256) return kvr_error(KVR_ERR_ARG, "%d ranks: at most 256 are supported", n);
    int devices[256];
    for (int i = 0; i < n; i++) devices[i] = kvr_rank_gpu(i, d->p.device, n_dev);
    ncclUniqueId id;
    const ncclResult_t e2 = ncclGetUniqueId(&id);
    if (e2 != ncclSuccess) return kvr_error(KVR_ERR_COMM, "--comm nccl: ncclGetUniqueId failed: %s", ncclGetErrorString(e2));
    d->n_ranks = d->n_local = n;
    *my_rank = 0;
    d->tr = nccl_new(n, 0, n, devices, id, false, d->p.timeout_s);
    return d->tr ? KVR_OK : KVR_ERR_COMM;
}
#endif

struct kvr_session * kvr_session_new(const struct kvr_model * m, const struct kvr_session_params * p) {
    static const struct kvr_session_params defaults = { 0 }; // one local rank on the CPU, the single pass
    if (!p) p = &defaults;
    struct kvr_session * d = calloc(1, sizeof(*d));
    KVR_ASSERT(d != NULL);
    d->m = m;
    d->p = *p;
    d->t_base = kvr_time_ms();
    if (d->p.timeout_s <= 0) d->p.timeout_s = 60.0;
    if ((unsigned)p->strategy >= KVR_STRATEGY_COUNT) {
        kvr_error(KVR_ERR_ARG, "unknown strategy %d", (int)p->strategy);
        free(d);
        return NULL;
    }
    const enum kvr_cache_type ct[2] = { p->cache_type_k, p->cache_type_v };
    for (int i = 0; i < 2; i++) {
        if ((unsigned)ct[i] >= KVR_CACHE_TYPE_COUNT) {
            kvr_error(KVR_ERR_ARG, "unknown %s cache type %d", i ? "V" : "K", (int)ct[i]);
            free(d);
            return NULL;
        }
        const int64_t blk = kvr_blck_size(kvr_cache_type_elem(ct[i]));
        if (m->hp.head_dim % blk != 0) {
            kvr_error(KVR_ERR_UNSUPP, "a %s cache of type %s needs a head size that is a multiple of %lld; this model's is %u "
                      "(as llama.cpp, which refuses it too): use f16, bf16 or f32", i ? "V" : "K",
                      kvr_cache_type_name(ct[i]), (long long)blk, (unsigned)m->hp.head_dim);
            free(d);
            return NULL;
        }
    }
    d->type_k = kvr_cache_type_elem(ct[0]);
    d->type_v = kvr_cache_type_elem(ct[1]);
    d->layout = strategy_is_ring(p->strategy) && !p->pd ? LAYOUT_RING : LAYOUT_CHAIN; // P/D decodes on one rank
    if (m->hp.n_recurrent > 0 && (p->pd || p->kv_stream || p->replicate || p->replicate_dir)) {
        // those move cache rows layer by layer as they are made; a recurrent layer's state is
        // final only at its eval's end, and none of them carries it yet
        kvr_error(KVR_ERR_UNSUPP, "%s: %s is not supported for a model with recurrent layers (%s, %u of %u layers): their "
                  "state does not travel with it yet", m->path, p->pd ? "prefill/decode disaggregation" : p->kv_stream ?
                  "streaming the cache (kv_stream)" : p->replicate ? "replication (replicate)" : "replication logs (replicate_dir)",
                  m->hp.arch_name, m->hp.n_recurrent, m->hp.n_layer);
        free(d);
        return NULL;
    }
    // a stream's or a log's header holds the model's fingerprint, whose hashes read every weight
    // (seconds for a large model): made now, before any peer waits on this process with a timeout
    if (p->kv_stream || p->replicate_dir) (void)kvr_model_weights_hash(m);
    int my_rank = 0;
    if (p->comm == KVR_COMM_MPI) {
#ifdef KVR_MPI
        d->tr = d->host_tr = mpi_start(d, &my_rank);
        if (!d->tr) {
            free(d);
            return NULL;
        }
        d->n_local = 1;
#else
        kvr_error(KVR_ERR_UNSUPP, "this build has no MPI transport (build with make KVR_MPI=1)");
        free(d);
        return NULL;
#endif
    } else if (p->comm == KVR_COMM_NCCL) {
#ifdef KVR_NCCL
        if (nccl_start(d, &my_rank) != KVR_OK) {
            if (d->host_tr) d->host_tr->free(d->host_tr);
            free(d);
            return NULL;
        }
#else
        kvr_error(KVR_ERR_UNSUPP, "this build has no NCCL transport (build with make KVR_CUDA=1)");
        free(d);
        return NULL;
#endif
    } else {
        d->n_ranks = p->n_ranks > 0 ? p->n_ranks : 1;
        d->n_local = d->n_ranks;
        if (p->link_noise > 1.0 && p->link_gbps <= 0) {
            kvr_error(KVR_ERR_ARG, "a noisy link (%g times slower) needs an emulated bandwidth (link_gbps)", p->link_noise);
            free(d);
            return NULL;
        }
        d->tr = local_new(d->n_ranks, p->link_gbps, p->link_latency_us, p->link_noise, p->link_seed);
    }
    if (d->n_ranks <= 256 && p->pd && (d->n_ranks < 2 || p->decode_rank != d->n_ranks - 1 || p->kv_stream)) {
        kvr_error(KVR_ERR_ARG, d->n_ranks < 2 ? "prefill/decode disaggregation needs 2 ranks or more, not %d" :
                  p->kv_stream ? "prefill/decode disaggregation streams to the decode rank, not to a file (%d ranks)" :
                  "the decode rank must be the last of the %d ranks", d->n_ranks);
        d->tr->free(d->tr);
        free(d);
        return NULL;
    }
    if (d->n_ranks > STREAM_STEP / 2 && m->hp.n_recurrent > 0 && strategy_is_ring(p->strategy)) {
        // the recurrent states' transfer tags number the ring's 2N chunks below the streams' steps
        kvr_error(KVR_ERR_UNSUPP, "%s: a ring of %d ranks over a model with recurrent layers: at most %d", m->path, d->n_ranks,
                  STREAM_STEP / 2);
        d->tr->free(d->tr);
        free(d);
        return NULL;
    }
    if (d->n_ranks > 256) {
        kvr_error(KVR_ERR_ARG, "%d ranks: at most 256 are supported", d->n_ranks);
        d->tr->free(d->tr);
        free(d);
        return NULL;
    }
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : (int)(m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096);
    if (n_ctx <= 0) n_ctx = 2048;
    // Refused: ranks that no prompt the context can hold gives a token (kvr_useful_ranks). A
    // shorter prompt than the ranks need only leaves some idle (the results are the same): an
    // application that knows its prompt asks kvr_useful_ranks first, as kvr-run does. single keeps
    // its meaning (the last rank alone, P/D's one prefill rank), and a given partition its split.
    const int useful = kvr_useful_ranks(p->strategy, n_ctx, d->n_ranks, p->pd);
    if (p->strategy != KVR_STRATEGY_SINGLE && !p->partition && !p->fractions && useful < d->n_ranks) {
        kvr_error(KVR_ERR_ARG, "%d ranks: a context of %d tokens gives %s work to at most %d (a rank must get a token of the prompt)",
                  d->n_ranks, n_ctx, kvr_strategy_name(p->strategy), useful);
        if (d->host_tr && d->host_tr != d->tr) d->host_tr->free(d->host_tr);
        d->tr->free(d->tr);
        free(d);
        return NULL;
    }
    if (dejavu_new(d) != KVR_OK) { // --replicate and the kill hook's points, checked against this session
        if (d->host_tr && d->host_tr != d->tr) d->host_tr->free(d->host_tr);
        d->tr->free(d->tr);
        free(d);
        return NULL;
    }
    d->n_ctx = n_ctx;
    int n_threads = p->n_threads;
    if (n_threads <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = (int)(cores > 0 ? cores : 1) / (p->comm == KVR_COMM_LOCAL ? d->n_ranks : 1);
        if (n_threads < 1) n_threads = 1;
    }
    d->rows = calloc((size_t)d->n_ranks, sizeof(int));
    d->ranks = calloc((size_t)d->n_local, sizeof(struct dist_rank));
    d->logits = calloc(m->hp.n_vocab, sizeof(float));
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        dr->rank = dr->id = my_rank + i; // local: 0 + i; one rank a process: the process's
        // the GPU: this rank's index on its node from the first one asked for (kvr_rank_gpu)
        int device = p->device, node_rank = p->comm == KVR_COMM_LOCAL ? dr->rank : d->node_rank;
#ifdef KVR_NCCL
        if (p->comm == KVR_COMM_NCCL) { // chosen by nccl_start by the same rule
            device = nccl_rank_of(d->tr, dr->rank)->device;
            node_rank = 0;
        }
#endif
        const struct kvr_backend_params bp = { .n_threads = n_threads, .device = device, .node_rank = node_rank,
                                               .q8_activations = p->q8_activations, .vec_dot_order = p->vec_dot_order,
                                               .avx512_order = p->avx512_order,
                                               .trace = p->trace, .node_times = p->node_times };
        dr->be = kvr_backend_new(p->backend ? p->backend : "cpu", &bp);
        dr->model = dr->be ? kvr_model_to_backend(m, dr->be) : NULL;
        dr->cache = dr->model ? kvr_kv_cache_new(&m->hp, n_ctx < RANK_CACHE_MIN ? n_ctx : RANK_CACHE_MIN, d->type_k, d->type_v, dr->be) : NULL;
        if (!dr->cache) {
            kvr_session_free(d);
            return NULL;
        }
        dr->cache_pos = calloc((size_t)n_ctx, sizeof(int32_t));
#ifdef KVR_NCCL
        if (p->comm == KVR_COMM_NCCL) { // NCCL moves device memory: the rank's transfers follow its compute stream
            void * stream = kvr_backend_cuda_stream(dr->be);
            if (!stream) {
                kvr_error(KVR_ERR_ARG, "--comm nccl moves GPU memory: it needs the CUDA backend (--backend cuda)");
                kvr_session_free(d);
                return NULL;
            }
            nccl_set_compute(d->tr, dr->rank, stream);
        }
#endif
        dr->comm = rank_comm_new(d->tr, dr->rank, d->n_ranks, d->p.timeout_s);
        dr->comm->base.device_ptrs = p->comm == KVR_COMM_NCCL; // NCCL moves device memory itself: nothing staged
        dr->comm->dv.own_process = d->host_tr != NULL; // one rank a process (MPI, NCCL under mpirun)
        kvr_backend_set_comm(dr->be, &dr->comm->base);
        dr->interrupt = &d->interrupt;
        dr->fail_peers = p->comm == KVR_COMM_LOCAL; // MPI: a failed transport aborts the job
        dr->be->interrupted = rank_interrupted;
        dr->be->interrupted_user = dr;
        dr->logits = calloc(m->hp.n_vocab, sizeof(float));
        dr->reuse = kvr_eval_reuse_new();
        dr->batch_reuse = kvr_eval_reuse_new();
    }
    d->last = p->strategy;
    return d;
}

static void swap_drop(struct kvr_session * d);

void kvr_session_free(struct kvr_session * d) {
    if (!d || d->wedged) return; // a thread that did not stop may still use all of it
    swap_drop(d);
    dejavu_free(d);
    for (int i = 0; i < d->n_local; i++) dist_rank_free(&d->ranks[i]);
    free(d->ranks);
    free(d->rows);
    free(d->logits);
    free(d->seq);
    plan_free(&d->plan);
    if (d->host_tr && d->host_tr != d->tr) d->host_tr->free(d->host_tr);
    if (d->tr) d->tr->free(d->tr);
    free(d);
}

void kvr_session_interrupt(struct kvr_session * d, bool on) {
    atomic_store(&d->interrupt, on ? 1 : 0);
}

void kvr_session_reset(struct kvr_session * d) {
    d->n_past = 0;
    d->has_logits = false;
    d->n_decode = 0;
    for (int r = 0; r < d->n_ranks; r++) d->rows[r] = 0;
    for (int i = 0; i < d->n_local; i++) d->ranks[i].n_rows = 0;
    dejavu_reset(d);
}

int kvr_session_rank(const struct kvr_session * d) { return d->ranks[0].rank; }
int kvr_session_n_ranks(const struct kvr_session * d) { return d->n_ranks; }
int kvr_session_n_past(const struct kvr_session * d) { return d->n_past; }
int kvr_session_n_ctx(const struct kvr_session * d) { return d->n_ctx; }

struct kvr_backend * kvr_session_backend(const struct kvr_session * d, int rank) {
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].rank == rank) return d->ranks[i].be;
    }
    return NULL;
}
enum kvr_strategy kvr_session_last_strategy(const struct kvr_session * d) { return d->last; }

int kvr_session_stats(const struct kvr_session * d, struct kvr_rank_stats * out, int cap) {
    int n = 0;
    for (int i = 0; i < d->n_local && n < cap; i++) {
        if (!d->plan.active[d->ranks[i].rank]) continue;
        out[n] = d->ranks[i].comm->st;
        const struct kvr_eval_reuse * r[2] = { d->ranks[i].reuse, d->ranks[i].batch_reuse };
        out[n].graphs_built = out[n].graphs_reused = 0;
        for (int k = 0; k < 2; k++) {
            out[n].graphs_built  += r[k] ? r[k]->builds : 0;
            out[n].graphs_reused += r[k] ? r[k]->reuses : 0;
        }
        n++;
    }
    return n;
}

const struct kvr_schedule * kvr_session_schedule(const struct kvr_session * d, int rank) {
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].rank == rank) return d->ranks[i].comm->sched.nodes ? &d->ranks[i].comm->sched : NULL;
    }
    return NULL;
}

int kvr_session_cache(const struct kvr_session * d, int rank, const int32_t ** pos, const struct kvr_kv_cache ** cache) {
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].rank != rank) continue;
        *pos = d->ranks[i].cache_pos;
        *cache = d->ranks[i].cache;
        return d->ranks[i].n_rows;
    }
    return -1;
}

static void seq_reserve(struct kvr_session * d, int n) {
    if (n <= d->seq_cap) return;
    d->seq_cap = n > 2 * d->seq_cap ? n : 2 * d->seq_cap;
    d->seq = realloc(d->seq, sizeof(int32_t) * (size_t)d->seq_cap);
    KVR_ASSERT(d->seq != NULL);
}

static const float * dist_eval_once(struct kvr_session * d, const int32_t * tokens, int n) {
    const struct kvr_model * m = d->m;
    if (n <= 0) {
        kvr_error(KVR_ERR_ARG, "eval: no tokens");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->hp.n_vocab) {
            kvr_error(KVR_ERR_ARG, "eval: token %d at index %d is outside the vocabulary of %u", tokens[i], i, m->hp.n_vocab);
            return NULL;
        }
    }
    if (d->wedged) {
        kvr_error(KVR_ERR_COMM, "eval: a rank's thread of an earlier eval did not stop: the session cannot go on");
        return NULL;
    }
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].lost) {
            kvr_error(KVR_ERR_COMM, "rank %d was lost in an earlier eval (%s); nothing was recovered", d->ranks[i].rank,
                      d->ranks[i].comm->dv.kill_what);
            return NULL;
        }
    }
    if (atomic_exchange(&d->interrupt, 0)) { // asked for between two evals: this one does not start
        kvr_error(KVR_ERR_INTERRUPTED, "eval: interrupted");
        return NULL;
    }
    if (plan_eval(d, n) != KVR_OK) return NULL;
    struct eval_plan * pl = &d->plan;
    d->tokens = tokens;
    d->last = pl->strat;
    if (d->p.comm == KVR_COMM_LOCAL) local_reset(d->tr);
    if (dejavu_eval_begin(d, tokens, n) != KVR_OK) return NULL;

    // a failed eval keeps none of its rows, on the ranks that finished theirs too (a ring decode's
    // storing rank may finish while another is stopped): their counts before it, restored then
    int n_rows_before[256];
    for (int i = 0; i < d->n_local; i++) n_rows_before[i] = d->ranks[i].n_rows;
    // local: one thread per active rank; MPI: this process's rank, if active
    pthread_t th[256];
    void * args[256][2];
    bool started[256] = { false };
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        dr->rc = KVR_OK;
        dr->interrupted = false;
        if (!pl->active[dr->rank]) {
            kvr_schedule_free(&dr->comm->sched); // it ran nothing this eval
            continue;
        }
        if (d->n_local == 1) {
            rank_eval(d, dr);
            continue;
        }
        args[i][0] = d;
        args[i][1] = dr;
        if (pthread_create(&th[i], NULL, rank_thread, args[i]) != 0) {
            dr->rc = kvr_error(KVR_ERR_NOMEM, "cannot start the thread of rank %d", dr->rank);
            snprintf(dr->err, sizeof(dr->err), "%s", kvr_last_error());
            d->tr->fail(d->tr, dr->rank, dr->err);
            continue;
        }
        started[i] = true;
    }
    char join_err[1024] = "";
    const int join_rc = join_ranks(d, th, started, join_err, sizeof(join_err));
    if (d->wedged) { // the thread may still write its rank's state: nothing of it is read
        kvr_error(join_rc, "%s", join_err);
        return NULL;
    }
    bool all_ok = join_rc == KVR_OK;
    for (int i = 0; i < d->n_local; i++) all_ok &= d->ranks[i].rc == KVR_OK;
    dejavu_ranks_joined(d, all_ok);
    if (d->p.graph_out) {
        for (int i = 0; i < d->n_local; i++) {
            struct dist_rank * dr = &d->ranks[i];
            if (dr->graph_text) fwrite(dr->graph_text, 1, dr->graph_len, d->p.graph_out);
            free(dr->graph_text);
            dr->graph_text = NULL;
        }
        d->p.graph_out = NULL;
    }
    // report the root cause: a timeout on a peer that did not time out itself (it was lost or
    // stalled) beats a timeout on a peer that was waiting too, which beats the echo of another
    // rank's failure; a rank that the test hook stopped speaks last. Among timeouts of one kind,
    // the earliest layer names where the peer stopped (a later one was only queued behind it),
    // and a receive that never came beats a send that was never taken.
    const char * err = NULL;
    int rc = KVR_OK, best = -1, best_layer = INT_MAX;
    bool best_send = true;
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        if (dr->rc == KVR_OK) continue;
        int score = 1;
        const int peer = dr->comm->dv.killed ? -1 : dr->comm->timeout_peer;
        if (dr->comm->dv.killed) {
            score = 0;
        } else if (peer >= 0) {
            bool peer_timed_out = false;
            for (int j = 0; j < d->n_local; j++) {
                if (d->ranks[j].rank == peer) peer_timed_out = d->ranks[j].comm->timeout_peer >= 0;
            }
            score = peer_timed_out ? 3 : 4;
        } else if (strstr(dr->err, "aborted:")) {
            score = 2;
        } else if (dr->comm->dv.stalled) {
            score = 0;
        }
        const int layer = peer >= 0 ? kvr_tag_layer(dr->comm->timeout_tag) : INT_MAX;
        const bool send = peer >= 0 && dr->comm->timeout_send;
        if (score > best || (score == best && (layer < best_layer || (layer == best_layer && best_send && !send)))) {
            best = score;
            best_layer = layer;
            best_send = send;
            err = dr->err;
            rc = dr->rc;
        }
    }
    if (join_rc != KVR_OK && best < 3) { // no transfer's timeout found the stopped rank: the driver's did
        rc = join_rc;
        err = join_err;
    }
    bool interrupted = false;
    for (int i = 0; i < d->n_local; i++) interrupted |= d->ranks[i].interrupted;
    if (interrupted) { // the interrupt, not the peers it stopped, is what happened
        atomic_store(&d->interrupt, 0);
        rc = KVR_ERR_INTERRUPTED;
        err = "eval: interrupted";
    }
    if (rc != KVR_OK) {
        for (int i = 0; i < d->n_local; i++) d->ranks[i].n_rows = n_rows_before[i];
        // recurrent layers update their state in place as the eval runs: once a rank computed,
        // the states are no longer those of the cached tokens, so none of them is kept
        bool moved = false;
        for (int i = 0; i < d->n_local; i++) moved |= d->ranks[i].computed;
        const int lost = m->hp.n_recurrent > 0 && moved ? d->n_past : 0;
        if (lost) kvr_error(rc, "%s (the recurrent layers' states had moved on: the %d cached tokens are forgotten)", err, lost);
        else kvr_error(rc, "%s", err);
        dejavu_eval_end(d, rc);
        if (lost) kvr_session_reset(d);
        return NULL;
    }
    // logits: local ranks share memory; MPI ranks get them from the owner
    const float * logits = NULL;
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].rank == pl->owner) logits = d->ranks[i].logits;
    }
#ifdef KVR_MPI
    if (d->host_tr) { // ranks in several processes: the owner sends its logits to every other one
        struct transport * ht = d->host_tr;
        const int me = d->ranks[0].rank;
        const size_t bytes = sizeof(float) * m->hp.n_vocab;
        const int tag = kvr_tag(0, KVR_TAG_LOGITS, 0);
        // the stall hook's layer n_layer: the owner stops before its logits go out
        if (me == pl->owner) comm_stall(d->ranks[0].comm, kvr_tag((int)m->hp.n_layer, KVR_TAG_LOGITS, 0));
        // every wait ends within the timeout, this one too: a receiver that finished its part
        // early waits at most that long for the owner to finish the prefill alone (a longer
        // stretch of compute needs a longer --comm-timeout), so a stopped owner is found then
        const double t0 = kvr_time_ms(), limit = d->p.timeout_s;
        struct tr_req * reqs = calloc((size_t)d->n_ranks, sizeof(*reqs));
        KVR_ASSERT(reqs != NULL);
        int rc2 = KVR_OK, n_req = 0;
        for (int q = 0; q < d->n_ranks && rc2 == KVR_OK; q++) {
            const bool send = me == pl->owner;
            if (q == me || (!send && q != pl->owner)) continue;
            struct tr_req * r = &reqs[n_req++];
            *r = (struct tr_req) { .buf = send ? (void *)logits : d->logits, .n = bytes, .me = me, .peer = q, .tag = tag,
                                   .is_send = send, .seq = -1 };
            rc2 = send ? ht->isend(ht, r) : ht->irecv(ht, r);
        }
        for (int i = 0; i < n_req && rc2 == KVR_OK; i++) rc2 = ht->wait(ht, &reqs[i], t0 + 1e3 * limit, limit);
        if (me == pl->owner) d->ranks[0].comm->st.bytes_sent += (int64_t)bytes * (d->n_ranks - 1);
        d->ranks[0].comm->st.wait_ms += kvr_time_ms() - t0;
        free(reqs);
        if (me != pl->owner) logits = d->logits;
        if (rc2 != KVR_OK) {
            ht->fail(ht, me, kvr_last_error());
            dejavu_eval_end(d, rc2);
            return NULL;
        }
    }
#endif
    KVR_ASSERT(logits != NULL);
    if (logits != d->logits) memcpy(d->logits, logits, sizeof(float) * m->hp.n_vocab);
    if (dejavu_eval_end(d, KVR_OK) != KVR_OK) return NULL;
    // every process keeps every rank's row count (the ring needs the block sizes)
    for (int r = 0; r < d->n_ranks; r++) {
        if (pl->pd) { // the decode rank holds the whole cache; the prefill ranks' rows are never read again
            d->rows[r] = r == d->n_ranks - 1 ? n : 0;
        } else if (pl->strat == KVR_STRATEGY_TSP || (pl->strat == KVR_STRATEGY_KVR)) {
            int e = 0;
            for (int q = 0; q <= r; q++) e += pl->cnt[q];
            d->rows[r] = pl->strat == KVR_STRATEGY_TSP ? pl->T : e;
        } else if (pl->strat == KVR_STRATEGY_SINGLE) {
            if (r == d->n_ranks - 1) d->rows[r] += n;
        } else if (pl->store >= 0) {
            if (r == pl->store) d->rows[r] += 1;
        } else {
            d->rows[r] += pl->cnt[r];
        }
    }
    if (pl->store >= 0) d->n_decode++;
    seq_reserve(d, d->n_past + n);
    memcpy(d->seq + d->n_past, tokens, sizeof(int32_t) * (size_t)n);
    d->n_past += n;
    d->has_logits = true;
    if (dejavu_eval_commit(d, tokens, n) != KVR_OK) return NULL;
    return d->logits;
}

// One eval; with --replicate, a rank lost in it is recovered from (dejavu_failover) and the eval
// runs again on the survivors, as often as ranks are lost and recovery is possible.
const float * kvr_session_eval(struct kvr_session * d, const int32_t * tokens, int n) {
    if (d->swap.out) {
        kvr_error(KVR_ERR_ARG, "eval: the cache is swapped out (kvr_session_kv_swap_in first)");
        return NULL;
    }
    double t_lost = -1.0; // when a rank was lost in this eval (-1: none yet)
    const float * lg;
    do {
        lg = dist_eval_once(d, tokens, n);
    } while (dejavu_failover(d, lg, n, &t_lost));
    return lg;
}

// The continuous batch (kvr_session_eval_batch): one decode token of every session in one graph
// on the first session's backend, each token's attention over its own session's cache
// (kvr_pass_batch). The sessions are plain ones (one local rank of the chain layout, nothing of
// DejaVu on), so nothing but their cache, rows, tokens and logits changes, as in a single eval.
// The first session keeps the batch's graph (its batch_reuse) while the same sessions come in the
// same order and no token crosses its KVR_REUSE_ROWS: a server's steady state builds none.

// Why session i of a batch cannot take part (NULL: it can).
static const char * batch_refusal(struct kvr_session * const * s, int n, int i) {
    const struct kvr_session * d = s[i];
    if (d->m != s[0]->m) return "it is of another model than session 0";
    if (d->p.comm != KVR_COMM_LOCAL || d->n_ranks != 1 || d->layout != LAYOUT_CHAIN || d->p.pd) return "it is not one local rank of the single pass";
    if (d->p.replicate || d->p.replicate_dir || d->p.kv_stream || d->p.capture || d->p.test || d->p.graph_out) {
        return "it replicates, logs, streams, captures, dumps its graph or runs test hooks (batches do none of these)";
    }
    if (d->swap.out) return "its cache is swapped out (kvr_session_kv_swap_in first)";
    if (d->wedged || d->ranks[0].lost) return "an earlier eval left it unable to go on";
    if (strcmp(kvr_backend_name(d->ranks[0].be), kvr_backend_name(s[0]->ranks[0].be)) != 0) return "its backend is not session 0's kind";
    if (d->n_past + 1 > d->n_ctx) return "its context is full";
    for (int j = 0; j < i; j++) {
        if (s[j] == d) return "it is in the batch twice";
    }
    (void)n;
    return NULL;
}

int kvr_session_eval_batch(struct kvr_session * const * s, const int32_t * tokens, int n) {
    if (n <= 0 || !s || !tokens) return kvr_error(KVR_ERR_ARG, "eval batch: no sessions");
    if (n > KVR_BATCH_MAX) return kvr_error(KVR_ERR_ARG, "eval batch: %d sessions, at most %d", n, KVR_BATCH_MAX);
    const struct kvr_model * m = s[0]->m;
    for (int i = 0; i < n; i++) {
        const char * why = s[i] ? batch_refusal(s, n, i) : "it is NULL";
        if (why) return kvr_error(KVR_ERR_ARG, "eval batch: session %d cannot be batched: %s", i, why);
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->hp.n_vocab) {
            return kvr_error(KVR_ERR_ARG, "eval batch: token %d of session %d is outside the vocabulary of %u", tokens[i], i, m->hp.n_vocab);
        }
    }
    for (int i = 0; i < n; i++) {
        if (atomic_exchange(&s[i]->interrupt, 0)) return kvr_error(KVR_ERR_INTERRUPTED, "eval batch: session %d: interrupted", i);
    }
    // room for the new row in every cache first: a grown cache is a new buffer the graph must name
    for (int i = 0; i < n; i++) {
        const int rc = rank_reserve(s[i], &s[i]->ranks[0], s[i]->ranks[0].n_rows + 1);
        if (rc != KVR_OK) return kvr_error_prefix(rc, "eval batch: session %d", i);
    }
    // each token's attention reads the rows a solo decode's kept graph reads (kvr_eval_reuse: the
    // next multiple of KVR_REUSE_ROWS, where no layer has a sliding window), so both compute alike
    bool windows = false;
    for (uint32_t il = 0; il < m->hp.n_layer; il++) windows |= m->layers[il].window > 0;
    struct kvr_kv_cache ** caches = kvr_malloc(sizeof(*caches) * (size_t)n);
    int * n_past = kvr_malloc(sizeof(int) * 2 * (size_t)n), * n_kv = n_past + n;
    int32_t * pos = kvr_malloc(sizeof(int32_t) * (size_t)n);
    int n_kpos = 0;
    for (int i = 0; i < n; i++) {
        caches[i] = s[i]->ranks[0].cache;
        n_past[i] = s[i]->ranks[0].n_rows;
        pos[i] = s[i]->n_past;
        n_kv[i] = windows ? n_past[i] + 1 : (n_past[i] / KVR_REUSE_ROWS + 1) * KVR_REUSE_ROWS;
        if (n_kv[i] > caches[i]->n_ctx) n_kv[i] = caches[i]->n_ctx;
        n_kpos += n_kv[i];
    }
    int32_t * kpos = kvr_malloc(sizeof(int32_t) * (size_t)n_kpos);
    for (int i = 0, at = 0; i < n; i++) {
        const struct dist_rank * dr = &s[i]->ranks[0];
        memcpy(kpos + at, dr->cache_pos, sizeof(int32_t) * (size_t)dr->n_rows);
        kpos[at + dr->n_rows] = pos[i];
        for (int j = dr->n_rows + 1; j < n_kv[i]; j++) kpos[at + j] = INT32_MAX;
        at += n_kv[i];
    }
    struct dist_rank * dr0 = &s[0]->ranks[0];
    if (dr0->batch_cap < n) {
        float * grown = realloc(dr0->batch_logits, sizeof(float) * m->hp.n_vocab * (size_t)n);
        if (!grown) {
            free(caches); free(n_past); free(pos); free(kpos);
            return kvr_error(KVR_ERR_NOMEM, "eval batch: cannot allocate the logits of %d sessions", n);
        }
        dr0->batch_logits = grown;
        dr0->batch_cap = n;
    }
    float * logits = dr0->batch_logits;
    const struct kvr_eval_batch eb = { .n = n, .caches = caches, .n_past = n_past, .n_kv = n_kv };
    local_reset(s[0]->tr);
    const double t0 = kvr_time_ms();
    memset(&dr0->comm->st, 0, sizeof(dr0->comm->st)); // session 0's stats: the batch's
    dr0->interrupted = false;
    struct kvr_eval ev = {
        .model      = dr0->model,
        .backend    = dr0->be,
        .cache      = dr0->cache,
        .tokens     = tokens,
        .pos        = pos,
        .n_tokens   = n,
        .kpos       = kpos,
        .n_kpos     = n_kpos,
        .n_outputs  = n,
        .attn_mode  = s[0]->p.attn_mode,
        .batch      = &eb,
        .reuse      = dr0->batch_reuse, // kept while the same sessions come in the same order
        .graph_size = (int)m->hp.n_layer * (48 + 16 * n) + 256,
        .name       = "eval batch",
        .compute    = &dr0->buf,
        .logits     = logits,
    };
    int rc = kvr_eval_run(&ev);
    rank_stats_of(dr0, &ev, m, 0, n, t0);
    if (rc != KVR_OK && dr0->interrupted) {
        atomic_store(&s[0]->interrupt, 0);
        rc = kvr_error(KVR_ERR_INTERRUPTED, "eval batch: interrupted");
    }
    if (rc != KVR_OK && m->hp.n_recurrent > 0) {
        // the recurrent layers may have moved every session's state on in place: as a single eval
        // that fails, each session forgets its cached tokens rather than keep states that no
        // longer belong to them
        char why[512];
        snprintf(why, sizeof(why), "%s", kvr_last_error());
        for (int i = 0; i < n; i++) kvr_session_reset(s[i]);
        rc = kvr_error(rc, "%s (the recurrent layers' states may have moved on: the %d sessions' cached tokens are forgotten)", why, n);
    }
    if (rc == KVR_OK) {
        for (int i = 0; i < n; i++) {
            struct kvr_session * d = s[i];
            struct dist_rank * dr = &d->ranks[0];
            dr->cache_pos[dr->n_rows++] = pos[i];
            d->rows[0] += 1;
            d->last = KVR_STRATEGY_SINGLE;
            memcpy(d->logits, logits + (size_t)i * m->hp.n_vocab, sizeof(float) * m->hp.n_vocab);
            seq_reserve(d, d->n_past + 1);
            d->seq[d->n_past++] = tokens[i];
            d->has_logits = true;
        }
    }
    free(caches);
    free(n_past);
    free(pos);
    free(kpos);
    return rc;
}

//
// DejaVu: the cache beyond the prefill (DESIGN.md, "KV streaming and failover"): streamed while it
// is made (to a file, or to the decode rank: P/D), appended to per-rank replication logs, kept as
// replicas on the ring successor, recovered from after a rank is lost, saved, restored and resumed;
// and the test hooks that lose or stall a rank (KVR_TEST_KILL, the stall hook). None of it is on
// the prefill road: it enters through these hooks, called at fixed points of the road, each a
// no-op when nothing of it is enabled (their section, "the hooks", follows DejaVu's parts):
//
//   dist_eval_once  dejavu_eval_begin   before the ranks start: arm the hooks, open streams and logs
//   rank_eval       dejavu_rank_wants_pass  whether the single pass needs the rank's pass (nodes)
//   rank_pass       dejavu_rank_nodes   the nodes that take each layer's final rows (P/D's
//                   dejavu_receive_graph    decode rank: its whole graph)
//   comm_exec       dejavu_comm_exec    those nodes run: rows to the stream, the log, the replica
//                   comm_stall          the stall hook, before a rank's transfer (and in
//                                       dist_eval_once, before an MPI owner's logits)
//   rank_eval       dejavu_rank_done    after the eval: a decode token's rows, which no node took
//   dist_eval_once  dejavu_ranks_joined the ranks are back: lost ranks, replicas' chunks
//                   dejavu_eval_end     the stream is finished (or dropped), a lost rank named
//                   dejavu_eval_commit  the eval counts: the logs' commits
//   kvr_session_eval   dejavu_failover     a lost rank: recover and run the eval again (--replicate)
//   kvr_session_new, _free, _reset: dejavu_new (its parameters checked), dejavu_free, dejavu_reset
//

//
// streaming a prefill's cache to a file while it runs (DejaVu's layer-by-layer streaming): a
// rank's stream node of layer il runs right after that layer's rows are final, copies them out
// in one buffer per K and V (buffered copies: one transfer per layer, not one per row) and hands
// them to a writer thread, which writes the file in order behind the compute of the next layers
//

struct kv_stream {
    struct kvr_kv_writer * w;
    int              n_layer, n_shards;
    int              shard_of[256];  // rank -> its shard in the file (-1: streams nothing)
    float         ** k;              // [il * n_shards + shard]: rows handed over, not written yet
    float         ** v;
    int              next;           // the next (il * n_shards + shard) to write
    bool             stop;           // the eval failed: write nothing more
    int              rc;
    char             err[1024];
    int64_t          bytes;
    double           timeout_s;
    pthread_t        th;
    pthread_mutex_t  mu;
    pthread_cond_t   cv;
};

static void * stream_thread(void * arg) {
    struct kv_stream * st = arg;
    const int total = st->n_layer * st->n_shards;
    pthread_mutex_lock(&st->mu);
    while (st->next < total && !st->stop) {
        const int i = st->next;
        if (!st->k[i]) {
            // the ranks hand layers over as they compute; a lost rank ends the eval, which stops us
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&st->cv, &st->mu, &ts);
            continue;
        }
        pthread_mutex_unlock(&st->mu);
        const int rc = kvr_kv_writer_layer(st->w, i / st->n_shards, i % st->n_shards, st->k[i], st->v[i]);
        pthread_mutex_lock(&st->mu);
        free(st->k[i]);
        free(st->v[i]);
        st->k[i] = st->v[i] = NULL;
        st->next++;
        if (rc != KVR_OK) {
            st->rc = rc;
            snprintf(st->err, sizeof(st->err), "%s", kvr_last_error());
            st->stop = true;
        }
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

// open the file and start the writer; lay names the shards (their ranks in shard_of)
static int stream_open(struct kv_stream ** out, const char * path, const struct kvr_model * m, const struct kvr_kv_layout * lay,
                       const int * shard_ranks, double timeout_s) {
    struct kv_stream * st = calloc(1, sizeof(*st));
    KVR_ASSERT(st != NULL);
    int rc = kvr_kv_writer_open(&st->w, path, m, lay);
    if (rc != KVR_OK) {
        free(st);
        return rc;
    }
    st->n_layer = (int)m->hp.n_layer;
    st->n_shards = lay->n_shards;
    st->timeout_s = timeout_s;
    for (int r = 0; r < 256; r++) st->shard_of[r] = -1;
    for (int s = 0; s < lay->n_shards; s++) st->shard_of[shard_ranks[s]] = s;
    st->k = calloc((size_t)st->n_layer * st->n_shards, sizeof(float *));
    st->v = calloc((size_t)st->n_layer * st->n_shards, sizeof(float *));
    KVR_ASSERT(st->k && st->v);
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    if (pthread_create(&st->th, NULL, stream_thread, st) != 0) {
        kvr_kv_writer_abort(st->w);
        free(st->k);
        free(st->v);
        free(st);
        return kvr_error(KVR_ERR_NOMEM, "%s: cannot start the stream's writer thread", path);
    }
    *out = st;
    return KVR_OK;
}

// a view of a cache's rows (in its type), through the backend (the cache may be device memory), as f32
static void tensor_get_f32(const struct kvr_tensor * t, float * out) {
    const size_t nb = kvr_nbytes(t);
    if (t->type == KVR_TYPE_F32) {
        kvr_backend_tensor_get(t, out, 0, nb);
        return;
    }
    void * tmp = kvr_malloc(nb ? nb : 1);
    kvr_backend_tensor_get(t, tmp, 0, nb);
    kvr_kv_rows_to_float(t->type, tmp, out, (int)t->ne[1], (int)t->ne[0]);
    free(tmp);
}

// a rank's rows of layer il (k and v: views of its cache) into the stream
static int stream_put(struct kv_stream * st, int rank, int il, const struct kvr_tensor * k, const struct kvr_tensor * v) {
    const int s = st->shard_of[rank];
    KVR_ASSERT(s >= 0 && il >= 0 && il < st->n_layer);
    const size_t nb = sizeof(float) * (size_t)kvr_nelements(k); // the file's rows are f32
    float * kb = malloc(nb ? nb : 1), * vb = malloc(nb ? nb : 1);
    if (!kb || !vb) {
        free(kb);
        free(vb);
        return kvr_error(KVR_ERR_NOMEM, "stream: cannot buffer %zu KiB of layer %d", nb >> 9, il);
    }
    tensor_get_f32(k, kb);
    tensor_get_f32(v, vb);
    pthread_mutex_lock(&st->mu);
    st->k[il * st->n_shards + s] = kb;
    st->v[il * st->n_shards + s] = vb;
    st->bytes += 2 * (int64_t)nb;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return KVR_OK;
}

// the eval's end: ok, wait for the writer and finish the file with the logits; else drop it
static int stream_close(struct kv_stream * st, bool ok, const float * logits) {
    pthread_mutex_lock(&st->mu);
    if (!ok) st->stop = true;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->th, NULL);
    int rc = st->rc;
    if (rc != KVR_OK) kvr_error(rc, "%s", st->err);
    if (ok && rc == KVR_OK) {
        KVR_ASSERT(st->next == st->n_layer * st->n_shards);
        rc = kvr_kv_writer_close(st->w, logits);
    } else {
        kvr_kv_writer_abort(st->w);
    }
    for (int i = 0; i < st->n_layer * st->n_shards; i++) {
        free(st->k[i]);
        free(st->v[i]);
    }
    free(st->k);
    free(st->v);
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    free(st);
    return rc;
}

// The stream of a first prefill: the file kvr_session_kv_save would write after it (the chain's
// last rank's whole cache, or every ring shard gathered, or under MPI this rank's PATH.R)
static int stream_start(struct kvr_session * d, const int32_t * tokens, int n, struct kv_stream ** out) {
    const struct eval_plan * pl = &d->plan;
    const bool ring = strategy_is_ring(pl->strat);
    struct kvr_kv_shard sh[256];
    int shard_ranks[256], n_sh = 0;
    int32_t * seq = malloc(sizeof(int32_t) * (size_t)n);
    KVR_ASSERT(seq != NULL);
    for (int i = 0; i < n; i++) seq[i] = i;
    for (int i = 0; i < d->n_local; i++) {
        const int r = d->ranks[i].rank;
        if (ring) {
            sh[n_sh] = (struct kvr_kv_shard) { .rank = r, .n_rows = pl->cnt[r], .pos = pl->pos[r] };
            shard_ranks[n_sh++] = r;
        } else if (r == pl->owner) {
            sh[n_sh] = (struct kvr_kv_shard) { .rank = 0, .n_rows = n, .pos = seq };
            shard_ranks[n_sh++] = r;
        }
    }
    int rc = KVR_OK;
    if (n_sh > 0) {
        const struct kvr_kv_layout lay = { .n_tokens = n, .tokens = tokens, .n_ranks = ring ? d->n_ranks : 1, .n_shards = n_sh,
                                           .shards = sh, .logits = true, .type_k = d->type_k, .type_v = d->type_v,
                                           .rope_long = kvr_model_rope_long(d->m, d->n_ctx) };
        char p[4096];
        if (ring && n_sh != d->n_ranks) kvr_session_kv_shard_path(d->p.kv_stream, d->ranks[0].rank, p, sizeof(p));
        else snprintf(p, sizeof(p), "%s", d->p.kv_stream);
        rc = stream_open(out, p, d->m, &lay, shard_ranks, d->p.timeout_s);
    }
    free(seq);
    for (int i = 0; i < d->n_local; i++) d->ranks[i].comm->dv.stream = rc == KVR_OK ? *out : NULL;
    return rc;
}

//
// the replication log's format (kvr.h, "Replication logs"): the writer appends one record a call
// with one writev(2), so a process killed at any instant leaves whole records and at most one cut
// short; the reader keeps the acknowledged steps and says where and why the rest was left. The
// header's bytes 16..64 and 84..92 are the cache file's model fingerprint (kvr.c writes and checks them).
//

static void put_u32(uint8_t * p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get_u32(const uint8_t * p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

#define KVL_OFF_RANK   64
#define KVL_OFF_RANKS  68
#define KVL_OFF_STRAT  72
#define KVL_OFF_PROMPT 76
#define KVL_OFF_CRC    92

struct kvr_kv_log {
    int       fd;
    char    * path;
    int       n_layer, kv_dim;
    enum kvr_type type_k, type_v; // the rows' types
    size_t    row_k, row_v;       //   and their bytes
    uint32_t  crc;        // the chain: the last record's CRC
    int64_t   bytes;
    int       rc;         // the first write error, kept
};

// all of iov to fd, resuming after short writes and signals
static int kvl_writev(struct kvr_kv_log * w, struct iovec * iov, int n) {
    if (w->rc != KVR_OK) return w->rc;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (int64_t)iov[i].iov_len;
    while (n > 0) {
        const ssize_t got = writev(w->fd, iov, n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            w->rc = kvr_error(KVR_ERR_IO, "%s: cannot append to the replication log at offset %lld: %s", w->path,
                              (long long)w->bytes, got < 0 ? strerror(errno) : "nothing written");
            return w->rc;
        }
        size_t left = (size_t)got;
        while (n > 0 && left >= iov[0].iov_len) {
            left -= iov[0].iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov[0].iov_base = (uint8_t *)iov[0].iov_base + left;
            iov[0].iov_len -= left;
        }
    }
    w->bytes += total;
    return KVR_OK;
}

// A log is appended to where it is, so it cannot be written beside and renamed as the cache files
// are. Where a log could be planted (a directory others write in), it must not be a door: a
// symbolic link is not followed (O_NOFOLLOW), anything but a regular file with one name is refused
// (a FIFO, a device, a hard link to another file), and a new log is emptied only after that check.
static int kvl_open(struct kvr_kv_log ** out, const char * path, const struct kvr_model * m, enum kvr_type type_k, enum kvr_type type_v,
                    bool create) {
    *out = NULL;
    struct stat st;
    if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        return kvr_error(KVR_ERR_ARG, "%s: %s, not a regular file: a replication log is a file of its own", path,
                         S_ISLNK(st.st_mode) ? "a symbolic link" : S_ISDIR(st.st_mode) ? "a directory" : "a special file");
    }
    const int fd = open(path, O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (create ? O_CREAT : 0), 0644);
    if (fd < 0) {
        return kvr_error(errno == ELOOP ? KVR_ERR_ARG : KVR_ERR_IO, "%s: cannot write the replication log: %s", path,
                         errno == ELOOP ? "a symbolic link" : strerror(errno));
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
        close(fd);
        return kvr_error(KVR_ERR_ARG, "%s: %s: a replication log is a file of its own", path,
                         S_ISREG(st.st_mode) ? "a file of more than one name (a hard link)" : "not a regular file");
    }
    if (create && ftruncate(fd, 0) != 0) {
        const int rc = kvr_error(KVR_ERR_IO, "%s: cannot write the replication log: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    struct kvr_kv_log * w = kvr_calloc(1, sizeof(*w));
    w->fd = fd;
    w->path = strdup(path);
    w->n_layer = (int)m->hp.n_layer;
    w->kv_dim = (int)(m->hp.head_dim * m->hp.n_head_kv);
    w->type_k = type_k;
    w->type_v = type_v;
    w->row_k = kvr_row_size(type_k, w->kv_dim);
    w->row_v = kvr_row_size(type_v, w->kv_dim);
    *out = w;
    return KVR_OK;
}

// the directory entry of a new file is durable only once its directory is synced
static void kvl_sync_dir(const char * path) {
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char * slash = strrchr(dir, '/');
    if (slash == dir) slash[1] = 0;
    else if (slash) *slash = 0;
    else snprintf(dir, sizeof(dir), ".");
    const int fd = open(dir, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int kvr_kv_log_create(struct kvr_kv_log ** out, const char * path, const struct kvr_model * m, const struct kvr_kv_log_head * h) {
    *out = NULL;
    if (h->n_ranks < 1 || h->n_ranks > 256 || h->rank < 0 || h->rank >= h->n_ranks || h->n_prompt < 0 || h->n_prompt > (1 << 24) ||
        h->strategy < 0 || h->strategy >= KVR_STRATEGY_COUNT || (h->flags & ~(uint32_t)(KVR_KV_LOG_BASE | KVR_KV_LOG_ROPE_LONG)) ||
        ((h->flags & KVR_KV_LOG_ROPE_LONG) && !m->rope_long)) {
        return kvr_error(KVR_ERR_ARG, "%s: a log of rank %d of %d ranks, strategy %d, %d prompt tokens cannot be written", path,
                         h->rank, h->n_ranks, h->strategy, h->n_prompt);
    }
    struct kvr_kv_log * w;
    int rc = kvl_open(&w, path, m, h->type_k, h->type_v, true);
    if (rc != KVR_OK) return rc;
    uint8_t hd[KVR_KV_LOG_HEADER] = { 0 };
    memcpy(hd, "KVRKVLOG", 8);
    put_u32(hd + 8, KVR_KV_LOG_VERSION);
    put_u32(hd + 12, h->flags);
    kvr_kv_fingerprint_put(m, h->type_k, h->type_v, hd);
    put_u32(hd + KVL_OFF_RANK, (uint32_t)h->rank);
    put_u32(hd + KVL_OFF_RANKS, (uint32_t)h->n_ranks);
    put_u32(hd + KVL_OFF_STRAT, (uint32_t)h->strategy);
    put_u32(hd + KVL_OFF_PROMPT, (uint32_t)h->n_prompt);
    put_u32(hd + KVL_OFF_CRC, kvr_crc32c(0, hd, KVL_OFF_CRC));
    uint8_t * tok = kvr_malloc(4 * (size_t)h->n_prompt + 4);
    for (int i = 0; i < h->n_prompt; i++) put_u32(tok + 4 * i, (uint32_t)h->prompt[i]);
    w->crc = kvr_crc32c(0, tok, 4 * (size_t)h->n_prompt);
    put_u32(tok + 4 * h->n_prompt, w->crc);
    struct iovec iov[2] = { { hd, sizeof(hd) }, { tok, 4 * (size_t)h->n_prompt + 4 } };
    rc = kvl_writev(w, iov, 2);
    free(tok);
    if (rc == KVR_OK) kvl_sync_dir(path);
    if (rc != KVR_OK) {
        kvr_kv_log_close(w);
        return rc;
    }
    *out = w;
    return KVR_OK;
}

int kvr_kv_log_append(struct kvr_kv_log ** out, const char * path, const struct kvr_model * m, const struct kvr_kv_log_data * d) {
    struct kvr_kv_log * w;
    int rc = kvl_open(&w, path, m, d->type_k, d->type_v, false);
    if (rc != KVR_OK) return rc;
    // what follows the acknowledged prefix (a step cut short, damage) goes; the new steps follow it
    if (ftruncate(w->fd, (off_t)d->good) != 0 || lseek(w->fd, (off_t)d->good, SEEK_SET) != (off_t)d->good) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot cut the replication log back to offset %lld: %s", path, (long long)d->good, strerror(errno));
        kvr_kv_log_close(w);
        *out = NULL;
        return rc;
    }
    w->crc = d->good_crc;
    w->bytes = d->good;
    *out = w;
    return KVR_OK;
}

int kvr_kv_log_rows(struct kvr_kv_log * w, int step, int il, int n_rows, const void * k, const void * v) {
    KVR_ASSERT(step >= 0 && il >= 0 && il < w->n_layer && n_rows > 0);
    uint8_t hd[16], tail[4];
    put_u32(hd, KVR_KV_LOG_ROWS);
    put_u32(hd + 4, (uint32_t)step);
    put_u32(hd + 8, (uint32_t)il);
    put_u32(hd + 12, (uint32_t)n_rows);
    const size_t nk = w->row_k * (size_t)n_rows, nv = w->row_v * (size_t)n_rows;
    const uint32_t crc = kvr_crc32c(kvr_crc32c(kvr_crc32c(w->crc, hd, sizeof(hd)), k, nk), v, nv);
    put_u32(tail, crc);
    struct iovec iov[4] = { { hd, sizeof(hd) }, { (void *)k, nk }, { (void *)v, nv }, { tail, 4 } };
    const int rc = kvl_writev(w, iov, 4);
    if (rc == KVR_OK) w->crc = crc;
    return rc;
}

int kvr_kv_log_commit(struct kvr_kv_log * w, int step, const int32_t * tokens, int n_tokens, const int32_t * pos, int n_rows) {
    KVR_ASSERT(step >= 0 && n_tokens >= 0 && n_rows >= 0);
    const size_t n = 16 + 4 * ((size_t)n_tokens + (size_t)n_rows) + 4;
    uint8_t * b = kvr_malloc(n);
    put_u32(b, KVR_KV_LOG_COMMIT);
    put_u32(b + 4, (uint32_t)step);
    put_u32(b + 8, (uint32_t)n_tokens);
    put_u32(b + 12, (uint32_t)n_rows);
    for (int i = 0; i < n_tokens; i++) put_u32(b + 16 + 4 * i, (uint32_t)tokens[i]);
    for (int i = 0; i < n_rows; i++) put_u32(b + 16 + 4 * ((size_t)n_tokens + i), (uint32_t)pos[i]);
    const uint32_t crc = kvr_crc32c(w->crc, b, n - 4);
    put_u32(b + n - 4, crc);
    struct iovec iov = { b, n };
    const int rc = kvl_writev(w, &iov, 1);
    free(b);
    if (rc == KVR_OK) w->crc = crc;
    return rc;
}

int kvr_kv_log_sync(struct kvr_kv_log * w) {
    if (w->rc != KVR_OK) return w->rc;
    if (fdatasync(w->fd) != 0) w->rc = kvr_error(KVR_ERR_IO, "%s: cannot sync the replication log: %s", w->path, strerror(errno));
    return w->rc;
}

int64_t kvr_kv_log_bytes(const struct kvr_kv_log * w) { return w->bytes; }

int kvr_kv_log_close(struct kvr_kv_log * w) {
    if (!w) return KVR_OK;
    int rc = kvr_kv_log_sync(w);
    if (close(w->fd) != 0 && rc == KVR_OK) rc = kvr_error(KVR_ERR_IO, "%s: cannot close the replication log: %s", w->path, strerror(errno));
    free(w->path);
    free(w);
    return rc;
}

void kvr_kv_log_free(struct kvr_kv_log_data * d) {
    if (!d) return;
    for (int s = 0; d->steps && s < d->n_steps; s++) {
        free(d->steps[s].k);
        free(d->steps[s].v);
    }
    free(d->steps);
    free(d->prompt);
    free(d->mem);
    free(d);
}

// the records after the header: every acknowledged step into d; the first damage ends the reading
static void kvl_parse_records(struct kvr_kv_log_data * d, const uint8_t * b, int64_t size, int64_t off, uint32_t crc,
                              const struct kvr_model * m) {
    const int L = d->n_layer;
    uint8_t ** k = kvr_calloc((size_t)L, sizeof(uint8_t *)), ** v = kvr_calloc((size_t)L, sizeof(uint8_t *));
    int layers = 0, rows = 0, cap = 0;     // the step being read: its ROWS records so far
    int64_t step_off = off;
    d->good = off;
    d->good_crc = crc;
    for (;;) {
        if (off == size) {
            if (layers > 0) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: step %d has the rows of %d of %d layers and no commit: cut short "
                         "while it ran", (long long)step_off, d->n_steps, layers, L);
            }
            break;
        }
        if (size - off < 16) {
            snprintf(d->damage, sizeof(d->damage), "offset %lld: cut short: a record needs at least 20 bytes, the file ends after %lld",
                     (long long)off, (long long)(size - off));
            break;
        }
        const uint32_t type = get_u32(b + off), step = get_u32(b + off + 4);
        if (type != KVR_KV_LOG_ROWS && type != KVR_KV_LOG_COMMIT) {
            snprintf(d->damage, sizeof(d->damage), "offset %lld: record type %u (1 rows, 2 commit expected): the log is damaged",
                     (long long)off, type);
            break;
        }
        if (step != (uint32_t)d->n_steps) {
            snprintf(d->damage, sizeof(d->damage), "offset %lld: a record of step %u where step %d was expected: the log is damaged",
                     (long long)off, step, d->n_steps);
            break;
        }
        const uint32_t a = get_u32(b + off + 8), c = get_u32(b + off + 12);
        int64_t need;
        char what[128];
        if (type == KVR_KV_LOG_ROWS) {
            snprintf(what, sizeof(what), "the rows of step %u, layer %u", step, a);
            if (a == 0 && layers > 0) layers = rows = 0; // the step ran again (its eval failed before its commit)
            if (a >= (uint32_t)L) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: %s: the model has %d layers: the log is damaged", (long long)off,
                         what, L);
                break;
            }
            if (a != (uint32_t)layers || c == 0 || c > (1u << 24) || (layers > 0 && c != (uint32_t)rows)) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: %s: %u rows of layer %u where layer %d%s was expected: the log is damaged",
                         (long long)off, what, c, a, layers, layers > 0 ? " with as many rows as layer 0" : "");
                break;
            }
            need = 16 + (int64_t)(d->row_k + d->row_v) * c + 4;
        } else {
            snprintf(what, sizeof(what), "the commit of step %u", step);
            if (a > (1u << 24) || c > (1u << 24)) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: %s: %u tokens, %u rows: out of range: the log is damaged",
                         (long long)off, what, a, c);
                break;
            }
            need = 16 + 4 * ((int64_t)a + c) + 4;
        }
        if (size - off < need) {
            snprintf(d->damage, sizeof(d->damage), "offset %lld: cut short: %s needs %lld bytes, the file ends after %lld", (long long)off,
                     what, (long long)need, (long long)(size - off));
            break;
        }
        const uint32_t got = get_u32(b + off + need - 4), want = kvr_crc32c(crc, b + off, (size_t)need - 4);
        if (got != want) {
            snprintf(d->damage, sizeof(d->damage), "offset %lld: the CRC32C of %s is 0x%08x, the data gives 0x%08x: the log is damaged",
                     (long long)(off + need - 4), what, got, want);
            break;
        }
        if (type == KVR_KV_LOG_ROWS) {
            k[layers] = (uint8_t *)(b + off + 16);
            v[layers] = (uint8_t *)(b + off + 16 + d->row_k * c);
            rows = (int)c;
            layers++;
        } else {
            const uint8_t * t = b + off + 16;
            const char * bad = NULL;
            int32_t bad_v = 0;
            int64_t bad_at = 0;
            if (layers != (c ? L : 0) || (c && (uint32_t)rows != c)) bad = "rows";
            for (uint32_t i = 0; !bad && i < a; i++) {
                bad_v = (int32_t)get_u32(t + 4 * i);
                bad_at = off + 16 + 4 * i;
                if (bad_v < 0 || (uint32_t)bad_v >= m->hp.n_vocab) bad = "a token outside the vocabulary";
            }
            for (uint32_t i = 0; !bad && i < c; i++) {
                bad_v = (int32_t)get_u32(t + 4 * ((size_t)a + i));
                bad_at = off + 16 + 4 * ((int64_t)a + i);
                if (bad_v < 0 || bad_v >= (1 << 24)) bad = "a position out of range";
            }
            if (bad && !strcmp(bad, "rows")) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: %s: %u rows, but %d layers of %d rows precede it: the log is damaged",
                         (long long)off, what, c, layers, rows);
                break;
            }
            if (bad) {
                snprintf(d->damage, sizeof(d->damage), "offset %lld: %s: %s (%d): the log is damaged", (long long)bad_at, what, bad, bad_v);
                break;
            }
            if (d->n_steps == cap) {
                cap = cap ? 2 * cap : 16;
                d->steps = realloc(d->steps, sizeof(*d->steps) * (size_t)cap);
                KVR_ASSERT(d->steps != NULL);
            }
            struct kvr_kv_log_step * s = &d->steps[d->n_steps++];
            *s = (struct kvr_kv_log_step) { .step = (int)step, .n_tokens = (int)a, .tokens = (int32_t *)t, .n_rows = (int)c,
                                            .pos = (int32_t *)(t + 4 * (size_t)a), .end = off + need, .crc = want };
            // the values are little-endian in the file; the reader's host is too (kvr writes rows as they are)
            if (c) {
                s->k = k;
                s->v = v;
                k = kvr_calloc((size_t)L, sizeof(uint8_t *));
                v = kvr_calloc((size_t)L, sizeof(uint8_t *));
            }
            layers = rows = 0;
            d->good = off + need;
            d->good_crc = want;
        }
        crc = want;
        off += need;
        if (type == KVR_KV_LOG_COMMIT) step_off = off;
    }
    free(k);
    free(v);
}

int kvr_kv_log_read(const char * path, const struct kvr_model * m, struct kvr_kv_log_data ** out) {
    *out = NULL;
    FILE * f = kvr_file_read(path); // a regular file, opened without waiting on a FIFO
    if (!f) return KVR_ERR_IO;
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        fclose(f);
        return kvr_error(KVR_ERR_IO, "%s: cannot open the replication log: %s", path, strerror(errno));
    }
    struct kvr_kv_log_data * d = kvr_calloc(1, sizeof(*d));
    uint8_t * b = d->mem = kvr_malloc((size_t)st.st_size + 4);
    const size_t got = st.st_size ? fread(b, 1, (size_t)st.st_size, f) : 0;
    const bool io = ferror(f);
    fclose(f);
    int rc = KVR_OK;
    // a log cut back by its writer while it was read is read as far as it went (what is cut is
    // past the step every reader takes)
    const int64_t size = (int64_t)got;
    if (io) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot read the replication log: %s", path, strerror(errno));
    } else if (size < 8 || memcmp(b, "KVRKVLOG", 8) != 0) {
        rc = size == 0 ? kvr_error(KVR_ERR_FORMAT, "%s: empty file: not a kvr replication log", path)
                       : kvr_error(KVR_ERR_FORMAT, "%s: offset 0: not a kvr replication log (magic \"KVRKVLOG\" expected)", path);
    } else if (size < 12 || get_u32(b + 8) > KVR_KV_LOG_VERSION) {
        rc = size < 12 ? kvr_error(KVR_ERR_FORMAT, "%s: truncated: the header needs %d bytes, the file ends after %lld", path,
                                   KVR_KV_LOG_HEADER, (long long)size)
                       : kvr_error(KVR_ERR_UNSUPP, "%s: offset 8: version %u is newer than this kvr reads (%d)", path, get_u32(b + 8),
                                   KVR_KV_LOG_VERSION);
    } else if (get_u32(b + 8) == 1) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version 1 is older than this kvr reads (%d): its fingerprint does not cover "
                       "the weights' bytes and the tokenizer, so the model it was made with cannot be told", path, KVR_KV_LOG_VERSION);
    } else if (get_u32(b + 8) == 2) {
        // its rows are f32 whatever the cache was: reading them as such would do, but continuing
        // the log would append rows of the cache's type behind a header that says none
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version 2 is older than this kvr reads (%d): its rows are f32 and it records no "
                       "cache type; resume it with the kvr that wrote it, or run the prompt again", path, KVR_KV_LOG_VERSION);
    } else if (get_u32(b + 8) != KVR_KV_LOG_VERSION) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version %u is not a kvr log version", path, get_u32(b + 8));
    } else if (size < KVR_KV_LOG_HEADER) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: truncated: the header needs %d bytes, the file ends after %lld", path, KVR_KV_LOG_HEADER,
                       (long long)size);
    } else if (get_u32(b + KVL_OFF_CRC) != kvr_crc32c(0, b, KVL_OFF_CRC)) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %d: the header's CRC32C is 0x%08x, the header gives 0x%08x: the header is damaged",
                       path, KVL_OFF_CRC, get_u32(b + KVL_OFF_CRC), kvr_crc32c(0, b, KVL_OFF_CRC));
    } else if (get_u32(b + 12) & ~(uint32_t)(KVR_KV_LOG_BASE | KVR_KV_LOG_ROPE_LONG)) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 12: flags 0x%x have bits this version does not know", path, get_u32(b + 12));
    } else if ((get_u32(b + 12) & KVR_KV_LOG_ROPE_LONG) && !m->rope_long) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 12: the log's keys took long LongRoPE factors (flag 0x%x), the model %s has none",
                       path, KVR_KV_LOG_ROPE_LONG, m->path);
    }
    if (rc == KVR_OK) rc = kvr_kv_fingerprint_check(path, b, m, "log", &d->type_k, &d->type_v);
    if (rc == KVR_OK) {
        d->flags    = get_u32(b + 12);
        d->rank     = (int)get_u32(b + KVL_OFF_RANK);
        d->n_ranks  = (int)get_u32(b + KVL_OFF_RANKS);
        d->strategy = (int)get_u32(b + KVL_OFF_STRAT);
        d->n_prompt = (int)get_u32(b + KVL_OFF_PROMPT);
        d->n_layer  = (int)m->hp.n_layer;
        d->kv_dim   = (int)(m->hp.head_dim * m->hp.n_head_kv);
        d->row_k    = kvr_row_size(d->type_k, d->kv_dim);
        d->row_v    = kvr_row_size(d->type_v, d->kv_dim);
        const struct { int off; uint32_t v, hi; } lim[] = {
            { KVL_OFF_RANKS, (uint32_t)d->n_ranks, 256 }, { KVL_OFF_RANK, (uint32_t)d->rank, (uint32_t)d->n_ranks - 1 },
            { KVL_OFF_STRAT, (uint32_t)d->strategy, KVR_STRATEGY_COUNT - 1 }, { KVL_OFF_PROMPT, (uint32_t)d->n_prompt, 1u << 24 },
        };
        static const char * const names[] = { "ranks", "rank", "strategy", "prompt tokens" };
        for (int i = 0; i < 4 && rc == KVR_OK; i++) {
            if (lim[i].v > lim[i].hi || (i == 0 && lim[i].v == 0)) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %d: %s %u is out of range (%u to %u)", path, lim[i].off, names[i], lim[i].v,
                               i == 0 ? 1u : 0u, lim[i].hi);
            }
        }
        if (rc == KVR_OK && get_u32(b + 80)) rc = kvr_error(KVR_ERR_FORMAT, "%s: offset 80: reserved field is %u, 0 expected", path, get_u32(b + 80));
    }
    const int64_t tok_end = KVR_KV_LOG_HEADER + 4 * (int64_t)d->n_prompt;
    if (rc == KVR_OK && size < tok_end + 4) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: truncated: the prompt's %d tokens at offset %d need %lld bytes, the file ends after %lld", path,
                       d->n_prompt, KVR_KV_LOG_HEADER, (long long)(4 * (int64_t)d->n_prompt + 4), (long long)(size - KVR_KV_LOG_HEADER));
    }
    uint32_t crc = 0;
    if (rc == KVR_OK) {
        crc = kvr_crc32c(0, b + KVR_KV_LOG_HEADER, 4 * (size_t)d->n_prompt);
        if (get_u32(b + tok_end) != crc) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: the CRC32C of the prompt's tokens is 0x%08x, the data gives 0x%08x: the log is damaged",
                           path, (long long)tok_end, get_u32(b + tok_end), crc);
        }
    }
    if (rc == KVR_OK) {
        d->prompt = kvr_malloc(4 * (size_t)d->n_prompt + 4);
        for (int i = 0; i < d->n_prompt && rc == KVR_OK; i++) {
            d->prompt[i] = (int32_t)get_u32(b + KVR_KV_LOG_HEADER + 4 * i);
            if (d->prompt[i] < 0 || (uint32_t)d->prompt[i] >= m->hp.n_vocab) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %d: prompt token %d is %d, outside the vocabulary of %u", path,
                               KVR_KV_LOG_HEADER + 4 * i, i, d->prompt[i], m->hp.n_vocab);
            }
        }
    }
    if (rc != KVR_OK) {
        kvr_kv_log_free(d);
        return rc;
    }
    d->bytes = size;
    kvl_parse_records(d, b, size, tok_end + 4, crc, m);
    *out = d;
    return KVR_OK;
}

//
// replication logs (kvr_session_params.replicate_dir): each rank appends to DIR/rank-R.kvlog the rows
// it made in an eval, each layer's as soon as they are final (a log node right after the layer's
// store copies them out, as the file stream's does), and after the eval a commit with its tokens.
// A writer thread per log writes behind the compute; after a commit it syncs (fdatasync) unless
// another commit is already queued (group commit), so an acknowledged step is on the disk. The
// compute waits only when more than LOG_QUEUE_MAX bytes or LOG_QUEUE_STEPS commits are queued
// (for at most the timeout): a process that dies loses at most that many steps the writer had
// not reached, which a resume then recomputes.
//

#define LOG_QUEUE_MAX   ((int64_t)64 << 20)
#define LOG_QUEUE_STEPS 4

struct log_item {
    struct log_item * next;
    int               commit;    // 0: a layer's rows, 1: the step's commit
    int               step, il, n_rows, n_tokens;
    void            * k, * v;    // rows: n_rows rows each, in the log's types
    int32_t         * tokens;    // commit: the step's tokens, then the rows' positions
    int64_t           bytes;
};

struct kv_log {
    struct kvr_kv_log * w;
    char                path[4096];
    struct log_item   * head, * tail;
    int64_t             queued;      // bytes in the queue
    int                 commits;     // commits in the queue
    int                 step;        // the step the rank's log nodes of this eval belong to
    bool                stop;
    int                 rc;
    char                err[1024];
    double              timeout_s;
    pthread_t           th;
    pthread_mutex_t     mu;
    pthread_cond_t      cv;          // items came, or stop
    pthread_cond_t      room;        // the queue shrank
};

static void * log_thread(void * arg) {
    struct kv_log * lg = arg;
    pthread_mutex_lock(&lg->mu);
    for (;;) {
        if (!lg->head) {
            if (lg->stop) break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&lg->cv, &lg->mu, &ts);
            continue;
        }
        struct log_item * it = lg->head;
        lg->head = it->next;
        if (!lg->head) lg->tail = NULL;
        lg->queued -= it->bytes;
        lg->commits -= it->commit;
        const bool failed = lg->rc != KVR_OK;
        pthread_cond_broadcast(&lg->room);
        pthread_mutex_unlock(&lg->mu);
        int rc = KVR_OK;
        if (failed) {
            // the log stopped at its first error: write nothing after it
        } else if (!it->commit) {
            rc = kvr_kv_log_rows(lg->w, it->step, it->il, it->n_rows, it->k, it->v);
        } else {
            rc = kvr_kv_log_commit(lg->w, it->step, it->tokens, it->n_tokens, it->tokens + it->n_tokens, it->n_rows);
        }
        pthread_mutex_lock(&lg->mu);
        const bool sync = rc == KVR_OK && !failed && it->commit && lg->commits == 0;
        pthread_mutex_unlock(&lg->mu);
        if (sync) rc = kvr_kv_log_sync(lg->w); // off the compute's path; covers every commit written since the last
        pthread_mutex_lock(&lg->mu);
        if (rc != KVR_OK && lg->rc == KVR_OK) {
            lg->rc = rc;
            snprintf(lg->err, sizeof(lg->err), "%s", kvr_last_error());
        }
        free(it->k);
        free(it->v);
        free(it->tokens);
        free(it);
    }
    pthread_mutex_unlock(&lg->mu);
    return NULL;
}

static bool log_full(const struct kv_log * lg, const struct log_item * it) {
    return lg->queued > 0 && (lg->queued + it->bytes > LOG_QUEUE_MAX || lg->commits + it->commit > LOG_QUEUE_STEPS);
}

// queue an item; waits while the writer is more than LOG_QUEUE_MAX behind (at most the timeout)
static int log_queue(struct kv_log * lg, struct log_item * it) {
    pthread_mutex_lock(&lg->mu);
    const double deadline = kvr_time_ms() + 1e3 * lg->timeout_s;
    while (log_full(lg, it) && lg->rc == KVR_OK && kvr_time_ms() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&lg->room, &lg->mu, &ts);
    }
    int rc = lg->rc;
    if (rc != KVR_OK) {
        kvr_error(rc, "%s", lg->err);
    } else if (log_full(lg, it)) {
        rc = kvr_error(KVR_ERR_IO, "%s: the replication log's writer is %d steps and %lld MiB behind after %.1f s: the disk is too slow",
                       lg->path, lg->commits, (long long)(lg->queued >> 20), lg->timeout_s);
    } else {
        if (lg->tail) lg->tail->next = it;
        else lg->head = it;
        lg->tail = it;
        lg->queued += it->bytes;
        lg->commits += it->commit;
        pthread_cond_signal(&lg->cv);
        it = NULL;
    }
    pthread_mutex_unlock(&lg->mu);
    if (it) {
        free(it->k);
        free(it->v);
        free(it->tokens);
        free(it);
    }
    return rc;
}

// a layer's rows of this rank, in the cache's (the log's) types: k and v views of its cache, or
// (k NULL) the rows read from cache c on backend be, row0 on
static int log_put_rows(struct kv_log * lg, int step, int il, int n_rows, const struct kvr_tensor * k, const struct kvr_tensor * v,
                        struct kvr_backend * be, const struct kvr_kv_cache * c, int row0) {
    const size_t nk = lg->w->row_k * (size_t)n_rows, nv = lg->w->row_v * (size_t)n_rows;
    struct log_item * it = calloc(1, sizeof(*it));
    KVR_ASSERT(it != NULL);
    it->k = malloc(nk);
    it->v = malloc(nv);
    if (!it->k || !it->v) {
        free(it->k);
        free(it->v);
        free(it);
        return kvr_error(KVR_ERR_NOMEM, "%s: cannot buffer %zu KiB of layer %d", lg->path, (nk + nv) >> 10, il);
    }
    if (k) {
        KVR_ASSERT(k->type == lg->w->type_k && v->type == lg->w->type_v && kvr_nbytes(k) == nk && kvr_nbytes(v) == nv);
        kvr_backend_tensor_get(k, it->k, 0, nk);
        kvr_backend_tensor_get(v, it->v, 0, nv);
    } else {
        KVR_ASSERT(c->type_k == lg->w->type_k && c->type_v == lg->w->type_v);
        kvr_kv_cache_get_rows(be, c, il, row0, n_rows, it->k, it->v);
    }
    it->step = step;
    it->il = il;
    it->n_rows = n_rows;
    it->bytes = (int64_t)(nk + nv);
    return log_queue(lg, it);
}

static int log_put_commit(struct kv_log * lg, int step, const int32_t * tokens, int n_tokens, const int32_t * pos, int n_rows) {
    struct log_item * it = calloc(1, sizeof(*it));
    KVR_ASSERT(it != NULL);
    it->commit = 1;
    it->step = step;
    it->n_tokens = n_tokens;
    it->n_rows = n_rows;
    it->tokens = malloc(sizeof(int32_t) * ((size_t)n_tokens + (size_t)n_rows + 1));
    KVR_ASSERT(it->tokens != NULL);
    if (n_tokens) memcpy(it->tokens, tokens, sizeof(int32_t) * (size_t)n_tokens);
    if (n_rows) memcpy(it->tokens + n_tokens, pos, sizeof(int32_t) * (size_t)n_rows);
    it->bytes = 4 * ((int64_t)n_tokens + n_rows);
    return log_queue(lg, it);
}

// start the writer of an open log (w: created or opened for appending)
static struct kv_log * log_start(struct kvr_kv_log * w, const char * path, double timeout_s) {
    struct kv_log * lg = calloc(1, sizeof(*lg));
    KVR_ASSERT(lg != NULL);
    lg->w = w;
    snprintf(lg->path, sizeof(lg->path), "%s", path);
    lg->timeout_s = timeout_s;
    pthread_mutex_init(&lg->mu, NULL);
    pthread_cond_init(&lg->cv, NULL);
    pthread_cond_init(&lg->room, NULL);
    if (pthread_create(&lg->th, NULL, log_thread, lg) != 0) {
        pthread_mutex_destroy(&lg->mu);
        pthread_cond_destroy(&lg->cv);
        pthread_cond_destroy(&lg->room);
        kvr_kv_log_close(w);
        free(lg);
        kvr_error(KVR_ERR_NOMEM, "%s: cannot start the replication log's writer thread", path);
        return NULL;
    }
    return lg;
}

// write what is queued, sync, close; the first error of the log (KVR_OK if none)
static int log_stop(struct kv_log * lg) {
    if (!lg) return KVR_OK;
    pthread_mutex_lock(&lg->mu);
    lg->stop = true;
    pthread_cond_signal(&lg->cv);
    pthread_mutex_unlock(&lg->mu);
    pthread_join(lg->th, NULL);
    int rc = lg->rc;
    if (rc != KVR_OK) kvr_error(rc, "%s", lg->err);
    const int rc2 = kvr_kv_log_close(lg->w);
    if (rc == KVR_OK) rc = rc2;
    pthread_mutex_destroy(&lg->mu);
    pthread_cond_destroy(&lg->cv);
    pthread_cond_destroy(&lg->room);
    free(lg);
    return rc;
}

// DIR/rank-R.kvlog
void kvr_session_log_path(const char * dir, int rank, char * out, size_t cap) {
    snprintf(out, cap, "%s/rank-%d.kvlog", dir, rank);
}

// Close every local rank's log (what is queued is written and synced first); the next eval starts
// new ones. A reset, a truncation or a load changes the cache in ways no step describes.
static int replog_restart(struct kvr_session * d) {
    int rc = KVR_OK;
    for (int i = 0; d->ranks && i < d->n_local; i++) { // (a session kvr_session_new gave up on is freed too)
        const int rc2 = log_stop(d->ranks[i].dv.log);
        if (rc == KVR_OK) rc = rc2;
        d->ranks[i].dv.log = NULL;
        if (d->ranks[i].comm) d->ranks[i].comm->dv.log = NULL;
    }
    d->dv.logs_open = false;
    d->dv.log_skip = false;
    return rc;
}

// Before an eval with replicate_dir and no log open: a new log per local rank. A session that holds
// tokens already (a load, a truncation, a resume into another directory) starts it with a base
// step: every row the rank holds and every token; the eval is then the log's step 1.
static int replog_start(struct kvr_session * d, const int32_t * tokens, int n) {
    const char * dir = d->p.replicate_dir;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        return kvr_error(KVR_ERR_IO, "--replicate-dir %s: cannot create the directory: %s", dir, strerror(errno));
    }
    struct stat st; // the logs go into this directory itself, not where a link planted there points
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        return kvr_error(KVR_ERR_ARG, "--replicate-dir %s: %s", dir, S_ISLNK(st.st_mode) ? "a symbolic link, not a directory" : "not a directory");
    }
    const bool base = d->n_past > 0;
    const int n_layer = (int)d->m->hp.n_layer;
    int rc = KVR_OK;
    for (int i = 0; i < d->n_local && rc == KVR_OK; i++) {
        struct dist_rank * dr = &d->ranks[i];
        char path[4096];
        kvr_session_log_path(dir, dr->rank, path, sizeof(path));
        const struct kvr_kv_log_head h = { .rank = dr->rank, .n_ranks = d->n_ranks, .strategy = (int)d->p.strategy,
                                           .n_prompt = base ? d->n_past : n, .prompt = base ? d->seq : tokens,
                                           .flags = (base ? KVR_KV_LOG_BASE : 0) |
                                                    (kvr_model_rope_long(d->m, d->n_ctx) ? KVR_KV_LOG_ROPE_LONG : 0),
                                           .type_k = d->type_k, .type_v = d->type_v };
        struct kvr_kv_log * w;
        rc = kvr_kv_log_create(&w, path, d->m, &h);
        if (rc != KVR_OK) break;
        dr->dv.log = log_start(w, path, d->p.timeout_s);
        if (!dr->dv.log) {
            rc = KVR_ERR_NOMEM;
            break;
        }
        if (!base) continue;
        const int nr = dr->n_rows;
        for (int il = 0; il < n_layer && rc == KVR_OK && nr > 0; il++) rc = log_put_rows(dr->dv.log, 0, il, nr, NULL, NULL, dr->be, dr->cache, 0);
        if (rc == KVR_OK) rc = log_put_commit(dr->dv.log, 0, d->seq, d->n_past, dr->cache_pos, nr);
    }
    if (rc != KVR_OK) {
        char keep[1024];
        snprintf(keep, sizeof(keep), "%s", kvr_last_error());
        replog_restart(d);
        return kvr_error(rc, "%s", keep);
    }
    d->dv.logs_open = true;
    d->dv.log_step = base ? 1 : 0;
    return KVR_OK;
}

// After an eval went well: each local rank's commit of the step (the rows it made, none when it
// made none or did not take part)
static int replog_commit(struct kvr_session * d, const int32_t * tokens, int n) {
    int rc = KVR_OK;
    for (int i = 0; i < d->n_local && rc == KVR_OK; i++) {
        struct dist_rank * dr = &d->ranks[i];
        const int made = d->plan.active[dr->rank] ? dr->made : 0;
        rc = log_put_commit(dr->dv.log, d->dv.log_step, tokens, n, d->plan.pos[dr->rank], made);
    }
    d->dv.log_step++;
    return rc;
}

//
// replicas (--replicate, DejaVu's KV replication): every rank's new cache rows, layer by layer,
// go to a replica its ring successor holds in host memory. A rank's node of layer il runs right
// after the layer's final store and copies the eval's new rows of that layer into the replica
// (one tensor_get each of K and V, on the rank's comm path); the holder's thread then checks them
// (a CRC32C per layer and kind) and acknowledges the layer. The driver commits the eval's chunk
// only once every layer is acknowledged and the eval succeeded, so a replica's committed rows
// never hold half a step; a failed eval's partial chunk is dropped. Recovery reads only committed
// chunks whose CRCs still match.
//

struct replica {
    int               n_layer, kv_dim;
    int               n_rows, cap;   // committed rows, rows allocated per layer
    int32_t         * pos;           // [cap]: their positions (the pending chunk's after them)
    enum kvr_type     type_k, type_v;// the cache's types: rows are kept as the cache stores them
    size_t            row_k, row_v;  //   bytes of a row
    uint8_t        ** k, ** v;       // [n_layer][cap * row_k or row_v]
    int               n_chunks, cap_chunks;
    int             * chunk_row0;    // committed chunks: rows [row0, row0 + n), each eval's
    int             * chunk_n;
    uint32_t        * chunk_crc;     //   [chunk * n_layer * 2 + il * 2 + (K: 0, V: 1)]
    int               pend_n;        // the running eval's chunk: rows [n_rows, n_rows + pend_n)
    bool            * acked;         // [n_layer]: that layer's rows are in and checked
    uint32_t        * pend_crc;      // [n_layer * 2]
    bool              behind;        // a chunk was never acknowledged: nothing more is committed
    int             * queue;         // layers put, waiting for the holder's check
    int               q_head, q_tail;
    bool              stop;
    pthread_t         th;
    pthread_mutex_t   mu;
    pthread_cond_t    cv;
};

static void replica_crc(const struct replica * rp, int il, int row0, int n, uint32_t * ck, uint32_t * cv) {
    *ck = kvr_crc32c(0, rp->k[il] + (size_t)row0 * rp->row_k, (size_t)n * rp->row_k);
    *cv = kvr_crc32c(0, rp->v[il] + (size_t)row0 * rp->row_v, (size_t)n * rp->row_v);
}

// the holder's side: check each layer the sender put in, then acknowledge it
static void * replica_thread(void * arg) {
    struct replica * rp = arg;
    pthread_mutex_lock(&rp->mu);
    while (!rp->stop) {
        if (rp->q_head == rp->q_tail) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
            continue;
        }
        const int il = rp->queue[rp->q_head];
        const int row0 = rp->n_rows, n = rp->pend_n;
        pthread_mutex_unlock(&rp->mu);
        uint32_t ck, cv;
        replica_crc(rp, il, row0, n, &ck, &cv);
        pthread_mutex_lock(&rp->mu);
        rp->pend_crc[il * 2] = ck;
        rp->pend_crc[il * 2 + 1] = cv;
        rp->acked[il] = true;
        rp->q_head++;
        pthread_cond_broadcast(&rp->cv);
    }
    pthread_mutex_unlock(&rp->mu);
    return NULL;
}

static struct replica * replica_new(int n_layer, const struct kvr_kv_cache * c) {
    struct replica * rp = calloc(1, sizeof(*rp));
    KVR_ASSERT(rp != NULL);
    rp->n_layer = n_layer;
    rp->kv_dim = c->kv_dim;
    rp->type_k = c->type_k;
    rp->type_v = c->type_v;
    rp->row_k = c->row_k;
    rp->row_v = c->row_v;
    rp->k = calloc((size_t)n_layer, sizeof(uint8_t *));
    rp->v = calloc((size_t)n_layer, sizeof(uint8_t *));
    rp->acked = calloc((size_t)n_layer, sizeof(bool));
    rp->pend_crc = calloc((size_t)n_layer * 2, sizeof(uint32_t));
    rp->queue = calloc((size_t)n_layer, sizeof(int));
    KVR_ASSERT(rp->k && rp->v && rp->acked && rp->pend_crc && rp->queue);
    pthread_mutex_init(&rp->mu, NULL);
    pthread_cond_init(&rp->cv, NULL);
    if (pthread_create(&rp->th, NULL, replica_thread, rp) != 0) {
        pthread_mutex_destroy(&rp->mu);
        pthread_cond_destroy(&rp->cv);
        free(rp->k); free(rp->v); free(rp->acked); free(rp->pend_crc); free(rp->queue);
        free(rp);
        kvr_error(KVR_ERR_NOMEM, "--replicate: cannot start a replica's thread");
        return NULL;
    }
    return rp;
}

static void replica_free(struct replica * rp) {
    if (!rp) return;
    pthread_mutex_lock(&rp->mu);
    rp->stop = true;
    pthread_cond_broadcast(&rp->cv);
    pthread_mutex_unlock(&rp->mu);
    pthread_join(rp->th, NULL);
    pthread_mutex_destroy(&rp->mu);
    pthread_cond_destroy(&rp->cv);
    for (int il = 0; il < rp->n_layer; il++) { free(rp->k[il]); free(rp->v[il]); }
    free(rp->k); free(rp->v); free(rp->pos);
    free(rp->chunk_row0); free(rp->chunk_n); free(rp->chunk_crc);
    free(rp->acked); free(rp->pend_crc); free(rp->queue);
    free(rp);
}

// room for n more rows (between evals: the holder's thread is idle)
static void replica_reserve(struct replica * rp, int n) {
    if (rp->n_rows + n <= rp->cap) return;
    int cap = rp->cap ? 2 * rp->cap : 64;
    while (cap < rp->n_rows + n) cap *= 2;
    for (int il = 0; il < rp->n_layer; il++) {
        rp->k[il] = realloc(rp->k[il], rp->row_k * (size_t)cap);
        rp->v[il] = realloc(rp->v[il], rp->row_v * (size_t)cap);
        KVR_ASSERT(rp->k[il] && rp->v[il]);
    }
    rp->pos = realloc(rp->pos, sizeof(int32_t) * (size_t)cap);
    KVR_ASSERT(rp->pos != NULL);
    rp->cap = cap;
}

// an eval starts: its chunk of n rows at these positions will come layer by layer
static void replica_begin(struct replica * rp, int n, const int32_t * pos) {
    replica_reserve(rp, n);
    memcpy(rp->pos + rp->n_rows, pos, sizeof(int32_t) * (size_t)n);
    rp->pend_n = rp->behind ? 0 : n;
    rp->q_head = rp->q_tail = 0;
    for (int il = 0; il < rp->n_layer; il++) rp->acked[il] = false;
}

// layer il of the chunk is in: the holder checks it
static void replica_queue(struct replica * rp, int il) {
    pthread_mutex_lock(&rp->mu);
    rp->queue[rp->q_tail++] = il;
    pthread_cond_broadcast(&rp->cv);
    pthread_mutex_unlock(&rp->mu);
}

// the sender's node: the eval's new rows of layer il (k, v: views of the rank's cache) into the
// replica, through the backend (the cache may be device memory); the holder checks them
static void replica_put(struct replica * rp, int il, const struct kvr_tensor * k, const struct kvr_tensor * v) {
    if (rp->pend_n == 0) return; // behind: it takes nothing until it is seeded again
    KVR_ASSERT(k->ne[1] == rp->pend_n && il >= 0 && il < rp->n_layer);
    KVR_ASSERT(k->type == rp->type_k && v->type == rp->type_v);
    kvr_backend_tensor_get(k, rp->k[il] + (size_t)rp->n_rows * rp->row_k, 0, kvr_nbytes(k));
    kvr_backend_tensor_get(v, rp->v[il] + (size_t)rp->n_rows * rp->row_v, 0, kvr_nbytes(v));
    replica_queue(rp, il);
}

// A decoded token of the plain single pass (its kept graph has no replica nodes): its rows of
// every layer after the eval, one small transfer per layer and kind, straight into the replica
static void replica_put_rows(struct replica * rp, struct kvr_backend * be, const struct kvr_kv_cache * c, int row0, int n) {
    if (rp->pend_n == 0) return;
    KVR_ASSERT(n == rp->pend_n);
    for (int il = 0; il < rp->n_layer; il++) {
        kvr_kv_cache_get_rows(be, c, il, row0, n, rp->k[il] + (size_t)rp->n_rows * rp->row_k, rp->v[il] + (size_t)rp->n_rows * rp->row_v);
        replica_queue(rp, il);
    }
}

// wait (at most timeout_s) until the holder checked everything put so far; false on timeout
static bool replica_drain(struct replica * rp, double timeout_s) {
    const double deadline = kvr_time_ms() + 1e3 * timeout_s;
    pthread_mutex_lock(&rp->mu);
    while (rp->q_head < rp->q_tail && kvr_time_ms() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
    }
    const bool ok = rp->q_head == rp->q_tail;
    pthread_mutex_unlock(&rp->mu);
    return ok;
}

static void replica_add_chunk(struct replica * rp, int n, const uint32_t * crc) {
    if (rp->n_chunks == rp->cap_chunks) {
        rp->cap_chunks = rp->cap_chunks ? 2 * rp->cap_chunks : 16;
        rp->chunk_row0 = realloc(rp->chunk_row0, sizeof(int) * (size_t)rp->cap_chunks);
        rp->chunk_n = realloc(rp->chunk_n, sizeof(int) * (size_t)rp->cap_chunks);
        rp->chunk_crc = realloc(rp->chunk_crc, sizeof(uint32_t) * (size_t)rp->cap_chunks * (size_t)rp->n_layer * 2);
        KVR_ASSERT(rp->chunk_row0 && rp->chunk_n && rp->chunk_crc);
    }
    rp->chunk_row0[rp->n_chunks] = rp->n_rows;
    rp->chunk_n[rp->n_chunks] = n;
    memcpy(rp->chunk_crc + (size_t)rp->n_chunks * (size_t)rp->n_layer * 2, crc, sizeof(uint32_t) * (size_t)rp->n_layer * 2);
    rp->n_chunks++;
    rp->n_rows += n;
}

// the eval's end: commit its chunk when it succeeded and every layer was acknowledged, else drop
// it (and a chunk that is not acknowledged in time leaves the replica behind). KVR_OK, or
// KVR_ERR_COMM when the replica fell behind.
static int replica_end(struct replica * rp, bool ok, double timeout_s) {
    const bool drained = replica_drain(rp, timeout_s);
    pthread_mutex_lock(&rp->mu);
    const int n = rp->pend_n;
    bool whole = drained;
    for (int il = 0; il < rp->n_layer && whole; il++) whole = rp->acked[il];
    if (!drained) rp->stop = true; // a thread that is stuck: it takes nothing more either
    pthread_mutex_unlock(&rp->mu);
    rp->pend_n = 0;
    if (!ok || n == 0) return KVR_OK;
    if (!whole) {
        rp->behind = true;
        return kvr_error(KVR_ERR_COMM, "the replica's chunk of %d rows was not acknowledged within %.1f s: it is behind from row %d",
                         n, timeout_s, rp->n_rows);
    }
    replica_add_chunk(rp, n, rp->pend_crc);
    return KVR_OK;
}

// A replica holding exactly these rows (a rank's whole cache) as one committed chunk: after a
// recovery changed what a rank holds or who holds its replica
static void replica_seed(struct replica * rp, struct kvr_backend * be, const struct kvr_kv_cache * c, const int32_t * pos, int n) {
    rp->n_rows = rp->n_chunks = rp->pend_n = 0;
    rp->behind = false;
    if (n == 0) return;
    replica_reserve(rp, n);
    memcpy(rp->pos, pos, sizeof(int32_t) * (size_t)n);
    uint32_t * crc = malloc(sizeof(uint32_t) * (size_t)rp->n_layer * 2);
    KVR_ASSERT(crc != NULL);
    for (int il = 0; il < rp->n_layer; il++) {
        kvr_kv_cache_get_rows(be, c, il, 0, n, rp->k[il], rp->v[il]);
        replica_crc(rp, il, 0, n, &crc[il * 2], &crc[il * 2 + 1]);
    }
    replica_add_chunk(rp, n, crc);
    free(crc);
}

// Which committed rows can be trusted: ok[row] for rows [0, n_rows); a chunk whose data no longer
// gives its CRC is refused whole (every layer: a position needs all of them). Returns the
// refused chunks' count and describes the first in why.
static int replica_check(const struct replica * rp, bool * ok, char * why, size_t cap) {
    int bad = 0;
    for (int ch = 0; ch < rp->n_chunks; ch++) {
        const int r0 = rp->chunk_row0[ch], n = rp->chunk_n[ch];
        bool good = true;
        for (int il = 0; il < rp->n_layer && good; il++) {
            uint32_t ck, cv;
            replica_crc(rp, il, r0, n, &ck, &cv);
            const uint32_t * want = rp->chunk_crc + ((size_t)ch * (size_t)rp->n_layer + (size_t)il) * 2;
            if (ck != want[0] || cv != want[1]) {
                good = false;
                if (bad == 0) {
                    snprintf(why, cap, "chunk %d (rows %d..%d, positions %d..%d), layer %d %s: CRC32C 0x%08x, the data gives 0x%08x",
                             ch, r0, r0 + n - 1, rp->pos[r0], rp->pos[r0 + n - 1], il, ck != want[0] ? "K" : "V",
                             ck != want[0] ? want[0] : want[1], ck != want[0] ? ck : cv);
                }
            }
        }
        bad += !good;
        for (int i = r0; i < r0 + n; i++) ok[i] = good;
    }
    return bad;
}

//
// replication and recovery of local ranks (--replicate): the driver's side
//

static void dist_log(struct kvr_session * d, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void dist_log(struct kvr_session * d, const char * fmt, ...) {
    if (!d->p.log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(d->p.log, "failover: ");
    vfprintf(d->p.log, fmt, ap);
    fprintf(d->p.log, "\n");
    va_end(ap);
}

// the replica of rank i's rows: on its ring successor (made when first needed; none on one rank)
static struct replica * replica_of(struct kvr_session * d, int i) {
    if (d->n_local < 2) return NULL;
    struct dist_rank * h = &d->ranks[(i + 1) % d->n_local];
    if (!h->dv.held) h->dv.held = replica_new((int)d->m->hp.n_layer, h->cache);
    return h->dv.held;
}

// every replica holds its rank's whole cache again (after a load, a truncation, a recompute)
static void replicas_seed_all(struct kvr_session * d) {
    if (!d->p.replicate) return;
    for (int i = 0; i < d->n_local; i++) {
        struct replica * rp = replica_of(d, i);
        const struct dist_rank * dr = &d->ranks[i];
        if (rp) replica_seed(rp, dr->be, dr->cache, dr->cache_pos, dr->n_rows);
    }
}

// an eval starts: where each rank's new rows go (the plan says how many, at which positions)
static void replicas_begin(struct kvr_session * d) {
    const struct eval_plan * pl = &d->plan;
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        struct replica * rp = d->p.replicate ? replica_of(d, i) : NULL;
        dr->comm->dv.replica_out = NULL;
        if (!rp) continue;
        const int r = dr->rank;
        const int n = !pl->active[r] ? 0 : pl->store >= 0 ? (r == pl->store) : pl->cnt[r];
        replica_begin(rp, n, pl->pos[r]);
        if (n > 0) dr->comm->dv.replica_out = rp;
    }
}

// the eval's end: commit (ok) or drop every replica's chunk; a replica that fell behind is said
static void replicas_end(struct kvr_session * d, bool ok) {
    if (!d->p.replicate) return;
    for (int i = 0; i < d->n_local; i++) {
        struct replica * rp = d->n_local > 1 ? d->ranks[(i + 1) % d->n_local].dv.held : NULL;
        if (rp && replica_end(rp, ok, d->p.timeout_s) != KVR_OK) {
            dist_log(d, "the replica of rank %d on rank %d: %s; a loss of rank %d recomputes what it lacks", i, (i + 1) % d->n_local,
                     kvr_last_error(), i);
        }
    }
}

int kvr_session_test_replica(struct kvr_session * d, int rank, int row, bool cut) {
    if (!d->p.replicate || rank < 0 || rank >= d->n_local || d->n_local < 2 || !d->ranks[(rank + 1) % d->n_local].dv.held) {
        return kvr_error(KVR_ERR_ARG, "no replica of rank %d (--replicate off, or fewer than 2 ranks)", rank);
    }
    struct replica * rp = d->ranks[(rank + 1) % d->n_local].dv.held;
    if (row < 0 || row >= rp->n_rows) return kvr_error(KVR_ERR_ARG, "the replica of rank %d holds %d rows, not row %d", rank, rp->n_rows, row);
    if (!cut) {
        uint32_t bits;
        memcpy(&bits, rp->k[0] + (size_t)row * rp->row_k, sizeof(bits));
        bits ^= 1u << 7;
        memcpy(rp->k[0] + (size_t)row * rp->row_k, &bits, sizeof(bits));
        return KVR_OK;
    }
    int ch = 0;
    while (ch < rp->n_chunks && rp->chunk_row0[ch] + rp->chunk_n[ch] <= row) ch++;
    if (ch < rp->n_chunks) rp->n_rows = rp->chunk_row0[ch]; // chunks are consecutive rows
    rp->n_chunks = ch;
    rp->behind = true;
    return KVR_OK;
}

// where a position's rows can be read from: a survivor's cache or a replica a survivor holds
struct row_src {
    int  rank;  // -1: nowhere
    int  row;
    bool rep;   // the replica ranks[rank].dv.held, else ranks[rank]'s cache
};

static void src_read(const struct kvr_session * d, const struct row_src * s, int il, int n, float * k, float * v) {
    const struct dist_rank * dr = &d->ranks[s->rank];
    if (!s->rep) {
        cache_get_f32(dr->be, dr->cache, il, s->row, n, k, v);
        return;
    }
    const struct replica * rp = dr->dv.held;
    kvr_kv_rows_to_float(rp->type_k, rp->k[il] + (size_t)s->row * rp->row_k, k, n, rp->kv_dim);
    kvr_kv_rows_to_float(rp->type_v, rp->v[il] + (size_t)s->row * rp->row_v, v, n, rp->kv_dim);
}

// Write positions [keep, p0) into rank t's cache rows keep.. (chain), reading each run of
// consecutive rows of one source with one transfer per layer
static void place_rows(struct kvr_session * d, int t, const struct row_src * src, int keep, int p0) {
    struct dist_rank * T = &d->ranks[t];
    const int n = p0 - keep, kv = T->cache->kv_dim;
    T->n_rows = p0; // rows a failed eval wrote past p0 (a rank that finished its part) are dropped
    if (n <= 0) return;
    float * k = malloc(sizeof(float) * (size_t)n * (size_t)kv), * v = malloc(sizeof(float) * (size_t)n * (size_t)kv);
    KVR_ASSERT(k && v);
    for (int il = 0; il < (int)d->m->hp.n_layer; il++) {
        if (!T->cache->k[il]) continue; // recurrent: no rows
        for (int p = keep; p < p0;) {
            int len = 1;
            while (p + len < p0 && src[p + len].rank == src[p].rank && src[p + len].rep == src[p].rep && src[p + len].row == src[p].row + len) len++;
            src_read(d, &src[p], il, len, k + (size_t)(p - keep) * kv, v + (size_t)(p - keep) * kv);
            p += len;
        }
        cache_set_f32(T->be, T->cache, il, keep, n, k, v);
    }
    for (int p = keep; p < p0; p++) T->cache_pos[p] = p;
    T->n_rows = p0;
    free(k);
    free(v);
}

static void dist_rank_free(struct dist_rank * dr) {
    kvr_eval_reuse_free(dr->reuse);
    kvr_eval_reuse_free(dr->batch_reuse);
    free(dr->batch_logits);
    kvr_kv_cache_free(dr->cache);
    free(dr->cache_pos);
    kvr_buffer_free(dr->buf);
    kvr_model_free(dr->model);
    kvr_backend_free(dr->be);
    rank_comm_free(dr->comm);
    replica_free(dr->dv.held);
    free(dr->logits);
    free(dr->spans);
    free(dr->graph_text);
}

// A local rank was lost in the eval that just failed (cause: its error). Rebuild the session on the
// survivors from their caches and the replicas they hold, recompute what no copy holds, so the
// eval can run again. KVR_OK, or an error saying why not (the session is then left as it was).
static int dist_recover(struct kvr_session * d, const char * cause) {
    const double t0 = kvr_time_ms();
    const int N = d->n_ranks, n_past = d->n_past, n_layer = (int)d->m->hp.n_layer;
    int x = -1, n_lost = 0;
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].lost) { x = i; n_lost++; }
    }
    if (n_lost > 1) return kvr_error(KVR_ERR_COMM, "%s; %d ranks were lost in one step: not recovered (each replica lives on one successor)", cause, n_lost);
    if (N < 2) return kvr_error(KVR_ERR_COMM, "%s; no rank is left to go on", cause);
    const int succ = (x + 1) % N, pred = (x + N - 1) % N;
    const bool ring = d->layout == LAYOUT_RING;
    struct dist_rank * dx = &d->ranks[x];
    dist_log(d, "rank %d of %d was lost (%s)", x, N, cause);

    // 1. every position's source: a survivor's cache first, else a replica chunk whose CRCs hold
    const int t = ring ? succ : (x == N - 1 ? N - 2 : N - 1); // the rank that takes over
    struct row_src * src = malloc(sizeof(*src) * (size_t)(n_past + 1));
    KVR_ASSERT(src != NULL);
    for (int p = 0; p < n_past; p++) src[p] = (struct row_src) { -1, 0, false };
    for (int k = 0; k < N; k++) {
        const int i = (t + k) % N; // the taker's own rows first
        if (i == x) continue;
        for (int j = 0; j < d->ranks[i].n_rows; j++) {
            const int p = d->ranks[i].cache_pos[j];
            if (p < n_past && src[p].rank < 0) src[p] = (struct row_src) { i, j, false };
        }
    }
    for (int i = 0; i < N; i++) {
        const struct replica * rp = d->ranks[i].dv.held;
        if (i == x || !rp || rp->n_rows == 0) continue;
        bool * ok = malloc(sizeof(bool) * (size_t)rp->n_rows);
        KVR_ASSERT(ok != NULL);
        char why[256];
        const int bad = replica_check(rp, ok, why, sizeof(why));
        if (bad) dist_log(d, "the replica of rank %d on rank %d: %s: refused (%d chunk%s)", (i + N - 1) % N, i, why, bad, bad > 1 ? "s" : "");
        for (int j = 0; j < rp->n_rows; j++) {
            const int p = rp->pos[j];
            if (ok[j] && p < n_past && src[p].rank < 0) src[p] = (struct row_src) { i, j, true };
        }
        free(ok);
    }
    // what must be there afterwards: the chain's taker holds every position; a ring the lost
    // shard's (the survivors keep theirs). p0: the first position that no copy holds.
    int p0 = n_past;
    if (ring) {
        for (int j = 0; j < dx->n_rows; j++) {
            if (src[dx->cache_pos[j]].rank < 0 && dx->cache_pos[j] < p0) p0 = dx->cache_pos[j];
        }
    } else {
        for (int p = 0; p < p0; p++) {
            if (src[p].rank < 0) p0 = p;
        }
    }
    // what comes from where: replicas, other survivors' caches (a chain's prefixes)
    int n_rep = 0, n_copy = 0;
    for (int p = 0; p < p0; p++) {
        const bool need = ring ? false : src[p].rank != t;
        if (need) { n_rep += src[p].rep; n_copy += !src[p].rep; }
    }
    for (int j = 0; ring && j < dx->n_rows; j++) {
        if (dx->cache_pos[j] < p0) n_rep++;
    }
    struct dist_rank * T = &d->ranks[t];
    int keep_t = 0; // the taker's own rows kept (positions < p0, a prefix)
    while (keep_t < T->n_rows && T->cache_pos[keep_t] < p0) keep_t++;
    if ((ring ? keep_t + n_rep : p0) > d->n_ctx || rank_reserve(d, T, ring ? keep_t + n_rep : p0) != KVR_OK) {
        free(src);
        return kvr_error(KVR_ERR_ARG, "%s; rank %d cannot take over rank %d's rows: %d rows exceed its context of %d (raise -c)", cause, t, x,
                         ring ? keep_t + n_rep : p0, d->n_ctx);
    }

    // 2. the rows into the taker (everything read before anything is written)
    if (!ring) {
        place_rows(d, t, src, keep_t, p0);
    } else {
        const int nm = keep_t + n_rep, kv = T->cache->kv_dim;
        int32_t * mpos = malloc(sizeof(int32_t) * (size_t)(nm + 1));
        float * a = malloc(sizeof(float) * (size_t)(keep_t + 1) * kv), * av = malloc(sizeof(float) * (size_t)(keep_t + 1) * kv);
        float * mk = malloc(sizeof(float) * (size_t)(nm + 1) * kv), * mv = malloc(sizeof(float) * (size_t)(nm + 1) * kv);
        KVR_ASSERT(mpos && a && av && mk && mv);
        // both shards are in increasing positions: merge them (the taker's row i, or the lost
        // shard's position p from its source)
        int m = 0;
        for (int i = 0, j = 0; i < keep_t || (j < dx->n_rows && dx->cache_pos[j] < p0);) {
            const bool mine = i < keep_t && (j >= dx->n_rows || dx->cache_pos[j] >= p0 || T->cache_pos[i] < dx->cache_pos[j]);
            mpos[m++] = mine ? T->cache_pos[i++] : dx->cache_pos[j++];
        }
        KVR_ASSERT(m == nm);
        for (int il = 0; il < n_layer; il++) {
            if (!T->cache->k[il]) continue; // recurrent: no rows
            if (keep_t) cache_get_f32(T->be, T->cache, il, 0, keep_t, a, av);
            for (int q = 0, i = 0; q < nm; q++) {
                if (i < keep_t && T->cache_pos[i] == mpos[q]) {
                    memcpy(mk + (size_t)q * kv, a + (size_t)i * kv, sizeof(float) * kv);
                    memcpy(mv + (size_t)q * kv, av + (size_t)i * kv, sizeof(float) * kv);
                    i++;
                } else {
                    src_read(d, &src[mpos[q]], il, 1, mk + (size_t)q * kv, mv + (size_t)q * kv);
                }
            }
            cache_set_f32(T->be, T->cache, il, 0, nm, mk, mv);
        }
        memcpy(T->cache_pos, mpos, sizeof(int32_t) * (size_t)nm);
        T->n_rows = nm;
        free(mpos); free(a); free(av); free(mk); free(mv);
    }
    free(src);
    for (int i = 0; i < N; i++) { // everyone else keeps the positions before p0
        if (i == t || i == x) continue;
        int k = 0;
        while (k < d->ranks[i].n_rows && d->ranks[i].cache_pos[k] < p0) k++;
        d->ranks[i].n_rows = k;
    }

    // 3. the session without the lost rank: survivors renumbered in ring order, a new transport; the
    // replication logs (--replicate-dir) start again for the ranks there are now
    replog_restart(d);
    struct dist_rank gone = *dx;
    memmove(&d->ranks[x], &d->ranks[x + 1], sizeof(*d->ranks) * (size_t)(N - 1 - x));
    dist_rank_free(&gone); // with the replica it held (its predecessor's rows)
    const int M = N - 1;
    struct transport * tr = local_new(M, d->p.link_gbps, d->p.link_latency_us, d->p.link_noise, d->p.link_seed);
    d->tr->free(d->tr);
    d->tr = tr;
    d->n_ranks = d->n_local = M;
    for (int i = 0; i < M; i++) {
        struct dist_rank * dr = &d->ranks[i];
        dr->rank = i;
        dr->comm->base.rank = i;
        dr->comm->base.n_ranks = M;
        dr->comm->tr = tr;
        d->rows[i] = dr->n_rows;
    }
    // the rank set changed: state kept per rank outside the ranks starts again from here
    if (d->p.partition || d->p.fractions) {
        d->p.partition = NULL;
        d->p.fractions = NULL;
        dist_log(d, "the kvr partition was for %d ranks: an even split from now on", N);
    }
    const int nt = t > x ? t - 1 : t, np = pred > x ? pred - 1 : pred;
    // the taker's successor held the lost rank's rows (now in the taker) or the taker's: either way
    // it now holds the taker's whole cache; the lost rank's predecessor's replica died with it
    if (M == 1) {
        replica_free(d->ranks[0].dv.held);
        d->ranks[0].dv.held = NULL;
    } else if (p0 < n_past) {
        replicas_seed_all(d);
    } else {
        for (int k = 0; k < 2; k++) {
            const int i = k ? np : nt;
            struct replica * rp = replica_of(d, i);
            if (rp) replica_seed(rp, d->ranks[i].be, d->ranks[i].cache, d->ranks[i].cache_pos, d->ranks[i].n_rows);
        }
    }
    d->dv.failover_restore_ms = kvr_time_ms() - t0;
    if (n_past == 0) {
        dist_log(d, "nothing was cached before this eval: nothing to restore");
    } else if (n_rep + n_copy == 0 && p0 < n_past) {
        dist_log(d, "nothing of rank %d's could be restored before position %d", x, p0);
    } else if (n_rep + n_copy == 0) {
        dist_log(d, "nothing of rank %d's was needed: rank %d holds every row", x, t);
    } else if (n_copy) {
        dist_log(d, "restored rank %d's rows into rank %d: %d from replicas (CRC32C checked), %d from the other ranks' caches, in %.1f ms",
                 x, t, n_rep, n_copy, d->dv.failover_restore_ms);
    } else {
        dist_log(d, "restored rank %d's %d rows from its replica on rank %d (CRC32C checked) into rank %d in %.1f ms", x, n_rep, succ, t,
                 d->dv.failover_restore_ms);
    }
    dist_log(d, "%d rank%s go on, renumbered 0..%d in ring order%s", M, M > 1 ? "s" : "", M - 1,
             M == 1 ? " (replication stops: no successor is left)" : "");

    // 4. what no copy held: recomputed, as a prompt of those tokens after the ones kept
    if (p0 < n_past) {
        d->n_past = p0;
        d->has_logits = false;
        const int n = n_past - p0;
        int32_t * toks = malloc(sizeof(int32_t) * (size_t)n);
        KVR_ASSERT(toks != NULL);
        memcpy(toks, d->seq + p0, sizeof(int32_t) * (size_t)n);
        const double t1 = kvr_time_ms();
        d->dv.recomputing = true;
        const float * lg = kvr_session_eval(d, toks, n);
        d->dv.recomputing = false;
        free(toks);
        if (!lg) return KVR_ERR_COMM;
        dist_log(d, "recomputed tokens [%d, %d) (no copy held position %d) in %.0f ms", p0, n_past, p0, kvr_time_ms() - t1);
    } else if (n_past > 0) {
        dist_log(d, "recomputed nothing (every position of the cache had a copy)");
    }
    return KVR_OK;
}

//
// the nodes DejaVu puts in a rank's graph: each right after the node that makes a layer's rows
// final, so that they run as soon as the rows are there, overlapping the layers that follow
//

// Put each layer's nodes add[il*4 .. il*4+n_add[il]) into the sinks right after the sink they
// depend on, after[il] (or, when that is no sink, in layer order at the end): they run as soon as
// the layer's rows are there.
static void sinks_after_layers(struct pass_ctx * pc, struct kvr_tensor ** add, const int * n_add, struct kvr_tensor ** after,
                               int n_layer) {
    struct kvr_tensor ** sinks = malloc(sizeof(*sinks) * (size_t)(pc->n_sinks + 4 * n_layer));
    int n = 0;
    bool * done = calloc((size_t)n_layer, sizeof(bool));
    KVR_ASSERT(sinks && done);
    for (int i = 0; i < pc->n_sinks; i++) {
        sinks[n++] = pc->sinks[i];
        for (int il = 0; il < n_layer; il++) {
            if (after[il] != pc->sinks[i] || done[il]) continue;
            for (int k = 0; k < n_add[il]; k++) sinks[n++] = add[il * 4 + k];
            done[il] = true;
        }
    }
    for (int il = 0; il < n_layer; il++) {
        for (int k = 0; !done[il] && k < n_add[il]; k++) sinks[n++] = add[il * 4 + k];
    }
    free(pc->sinks);
    pc->sinks = sinks;
    pc->n_sinks = pc->cap_sinks = n;
    free(done);
}

static struct kvr_tensor * layer_final(struct pass_ctx * pc, struct kvr_graph * g, int il) {
    struct kvr_tensor * t = layer_final_find(pc, g, il);
    KVR_ASSERT(t != NULL && "no store of this layer");
    return t;
}

// Put t in the sinks right after layer il's final node (before what an earlier call put there),
// so it runs as soon as the layer's rows are final. A rank that stores nothing in the layer (ring
// decode): after the last sink of that layer.
static struct kvr_tensor * sink_after_layer(struct pass_ctx * pc, struct kvr_graph * g, int il, struct kvr_tensor * t, const char * why) {
    const struct kvr_tensor * after = layer_final_find(pc, g, il);
    char prefix[32];
    const int np = snprintf(prefix, sizeof(prefix), "blk.%d.", il);
    int at = -1;
    for (int i = 0; i < pc->n_sinks; i++) {
        if (after ? pc->sinks[i] == after : strncmp(pc->sinks[i]->name, prefix, (size_t)np) == 0) at = i;
        if (after && at >= 0) break;
    }
    KVR_ASSERT(at >= 0 && "no sink of this layer to put the node after");
    struct kvr_tensor * anchor = pc->sinks[at];
    sinks_put(pc, at + 1, t);
    t->why = why;
    return anchor;
}

// --replicate: per layer, right after its rows are final, this eval's new rows of the rank go to
// its replica on the ring successor (replica_put), overlapping the layers that follow
static void add_replica_nodes(struct pass_ctx * pc, struct kvr_graph * g) {
    if (!pc->dr->comm->dv.replica_out) return;
    struct kvr_kv_cache * c = pc->dr->cache;
    const int row0 = pc->dr->made_row0, n = pc->dr->made; // the rows this eval made on this rank
    KVR_ASSERT(n == pc->dr->comm->dv.replica_out->pend_n || pc->dr->comm->dv.replica_out->pend_n == 0);
    if (n == 0) return;
    for (int il = 0; il < c->n_layer; il++) {
        struct kvr_tensor * t = kvr_send(pc->ctx, cache_rows(pc, c->k[il], row0, n), PEER_REPLICA, kvr_tag(il, KVR_TAG_K, 0));
        t->src[1] = cache_rows(pc, c->v[il], row0, n);
        kvr_set_name(t, "blk.%d.kv_replica", il);
        t->src[2] = sink_after_layer(pc, g, il, t, "replicate: this layer's new K/V rows to the replica on the ring successor");
    }
}

// The test hook's node, where this eval loses the rank (struct kvr_test_kill): right after the
// layer's final store, before the layer's transfers and what streams or replicates its rows
static void add_kill_node(struct pass_ctx * pc, struct kvr_graph * g) {
    const int il = pc->dr->comm->dv.kill_layer;
    if (il < 0) return;
    struct kvr_tensor * t = kvr_send(pc->ctx, cache_rows(pc, pc->dr->cache->k[il], 0, 1), PEER_KILL, kvr_tag(il, KVR_TAG_K, 0));
    kvr_set_name(t, "blk.%d.kill", il);
    t->src[1] = sink_after_layer(pc, g, il, t, "test hook KVR_TEST_KILL: this rank is lost here"); // and after it
}

// Streaming the cache while the prefill runs: per layer, right after its rows are final, a node
// that hands rows [0, n_rows) of this rank's cache to the file stream, or (P/D) sends them to the
// decode rank: the chain's rank with the whole cache sends it at once, a ring rank its two chunks,
// each to its place. Each goes in the sinks list right after the layer's final store, so it runs
// as soon as the layer's rows are there, before the layer's attention, overlapping what follows.
static void add_stream_nodes(struct pass_ctx * pc, struct kvr_graph * g, int n_rows) {
    struct eval_plan * pl = pc->pl;
    struct kvr_kv_cache * c = pc->dr->cache;
    const int n_layer = c->n_layer, r = pc->rank;
    const bool ring = strategy_is_ring(pl->strat);
    if (!ring && r != pl->owner) return; // the chain's last rank holds everything
    if (n_rows == 0) return;
    struct kvr_tensor ** add = calloc((size_t)n_layer * 4, sizeof(*add));
    struct kvr_tensor ** after = calloc((size_t)n_layer, sizeof(*after));
    int * n_add = calloc((size_t)n_layer, sizeof(int));
    KVR_ASSERT(add && after && n_add);
    for (int il = 0; il < n_layer; il++) {
        struct kvr_tensor * dep = after[il] = layer_final(pc, g, il);
        if (!pl->pd) {
            struct kvr_tensor * t = kvr_send(pc->ctx, cache_rows(pc, c->k[il], 0, n_rows), PEER_STREAM, kvr_tag(il, KVR_TAG_K, 0));
            t->src[1] = cache_rows(pc, c->v[il], 0, n_rows);
            t->src[2] = dep;
            kvr_set_name(t, "blk.%d.kv_stream", il);
            t->why = "stream: this layer's final K/V rows to the file, behind the compute";
            add[il * 4 + n_add[il]++] = t;
            continue;
        }
        // P/D: ring ranks hold chunks r and 2N-1-r of the prompt; the chain's rank all of it
        const int D = pc->d->n_ranks - 1, nc = 2 * pl->N;
        const int len[2] = { ring ? chunk_begin(pl->T, nc, r + 1) - chunk_begin(pl->T, nc, r) : n_rows,
                             ring ? chunk_begin(pl->T, nc, nc - r) - chunk_begin(pl->T, nc, nc - 1 - r) : 0 };
        for (int j = 0, row0 = 0; j < 2; row0 += len[j], j++) {
            if (len[j] == 0) continue;
            for (int kind = 0; kind < 2; kind++) {
                struct kvr_tensor * t = kvr_send(pc->ctx, cache_rows(pc, (kind ? c->v : c->k)[il], row0, len[j]), D,
                                                 kvr_tag(il, kind ? KVR_TAG_V : KVR_TAG_K, STREAM_STEP + j));
                t->src[1] = dep;
                kvr_set_name(t, "blk.%d.%s_to_decode%d", il, kind ? "v" : "k", j);
                t->why = "P/D: this layer's final K/V rows to the decode rank, while the prefill goes on";
                add[il * 4 + n_add[il]++] = t;
            }
        }
    }
    sinks_after_layers(pc, add, n_add, after, n_layer);
    free(add);
    free(after);
    free(n_add);
}

// Replication log (--replicate-dir): per layer, right after its rows are final, a node that hands
// the rows this eval made on this rank (cache rows [row0, row0+n)) to the rank's log.
static void add_log_nodes(struct pass_ctx * pc, struct kvr_graph * g, int row0, int n) {
    struct kvr_kv_cache * c = pc->dr->cache;
    const int n_layer = c->n_layer;
    if (n == 0) return;
    struct kvr_tensor ** add = calloc((size_t)n_layer * 4, sizeof(*add));
    struct kvr_tensor ** after = calloc((size_t)n_layer, sizeof(*after));
    int * n_add = calloc((size_t)n_layer, sizeof(int));
    KVR_ASSERT(add && after && n_add);
    for (int il = 0; il < n_layer; il++) {
        struct kvr_tensor * t = kvr_send(pc->ctx, cache_rows(pc, c->k[il], row0, n), PEER_LOG, kvr_tag(il, KVR_TAG_K, 0));
        t->src[1] = cache_rows(pc, c->v[il], row0, n);
        t->src[2] = after[il] = layer_final(pc, g, il);
        kvr_set_name(t, "blk.%d.kv_log", il);
        t->why = "replication log: the rows this rank made in this layer, to its log behind the compute";
        add[il * 4 + n_add[il]++] = t;
    }
    sinks_after_layers(pc, add, n_add, after, n_layer);
    free(add);
    free(after);
    free(n_add);
}

// The decode rank's part of a P/D prefill: a graph of receives only, each layer's K and V rows
// straight into its cache at their positions, in the order the prefill ranks send them.
static void dejavu_receive_graph(struct kvr_session * d, struct dist_rank * dr, struct kvr_context * ctx, struct kvr_graph * g) {
    struct eval_plan * pl = &d->plan;
    struct kvr_kv_cache * c = dr->cache;
    const bool ring = strategy_is_ring(pl->strat);
    const int nc = 2 * pl->N;
    for (int il = 0; il < c->n_layer; il++) {
        for (int q = 0; q < (ring ? pl->N : 1); q++) {
            for (int j = 0; j < (ring ? 2 : 1); j++) {
                const int ch = j ? nc - 1 - q : q;
                const int b = ring ? chunk_begin(pl->T, nc, ch) : 0, e = ring ? chunk_begin(pl->T, nc, ch + 1) : pl->T;
                if (e == b) continue;
                for (int kind = 0; kind < 2; kind++) {
                    struct kvr_tensor * ct = (kind ? c->v : c->k)[il];
                    struct kvr_tensor * view = kvr_view_2d(ctx, ct, c->kv_dim, e - b, ct->nb[1], (size_t)b * ct->nb[1]);
                    struct kvr_tensor * t = kvr_recv(ctx, view, ring ? q : pl->owner, kvr_tag(il, kind ? KVR_TAG_V : KVR_TAG_K, STREAM_STEP + j));
                    kvr_set_name(t, "blk.%d.%s_from_prefill%d", il, kind ? "v" : "k", ring ? q : pl->owner);
                    t->why = "P/D: the decode rank's cache, layer by layer from the prefill";
                    kvr_graph_expand(g, t);
                }
            }
        }
    }
}

//
// the test hooks: KVR_TEST_KILL loses a rank at a point of an eval (struct kvr_test_kill in kvr.h),
// the stall hook stops one before a transfer (struct kvr_test_hooks)
//

// KVR_TEST_KILL: "RANK:prefill:LAYER" or "RANK:decode:STEP", several separated by commas
int kvr_test_kill_parse(const char * value, struct kvr_test_kill * out, int cap) {
    int n = 0;
    const char * s = value;
    for (;;) {
        char * end;
        errno = 0;
        const long rank = strtol(s, &end, 10); // digits only: strtol would take a sign or spaces
        const bool rank_ok = *s >= '0' && *s <= '9' && errno == 0 && rank <= INT_MAX;
        s = end;
        const bool decode = !strncmp(s, ":decode:", 8);
        const bool prefill = !strncmp(s, ":prefill:", 9);
        if (!rank_ok || (!decode && !prefill)) break;
        s += decode ? 8 : 9;
        errno = 0;
        const long at = strtol(s, &end, 10);
        if (*s < '0' || *s > '9' || errno != 0 || at > INT_MAX || (*end != ',' && *end != 0)) break;
        if (n == cap) {
            kvr_error(KVR_ERR_ARG, "KVR_TEST_KILL='%.100s': more than %d points", value, cap);
            return -1;
        }
        out[n++] = (struct kvr_test_kill) { .rank = (int)rank, .decode = decode, .at = (int)at };
        if (*end == 0) return n;
        s = end + 1;
    }
    kvr_error(KVR_ERR_ARG, "KVR_TEST_KILL='%.100s': want RANK:prefill:LAYER or RANK:decode:STEP, several separated by commas "
              "(the test hook that loses a rank)", value);
    return -1;
}

// the stall hook: this rank stops before its first transfer at or after the layer, as a lost
// process would. A rank that is a process of its own stops for real (SIGSTOP, as `kill -STOP`
// would: only a SIGCONT or the job's end moves it); a local rank's thread comes back only when
// another rank gave up (or after two timeouts), and is then declared lost (--replicate).
static int comm_stall(struct rank_comm * c, int tag) {
    if (c->dv.stall_layer < 0 || kvr_tag_layer(tag) < c->dv.stall_layer) return KVR_OK;
    if (!c->dv.stalled) {
        c->dv.stalled = true;
        c->dv.t_killed = kvr_time_ms();
        if (c->dv.own_process) {
            fprintf(stderr, "kvr: rank %d: stopped by the stall test hook at layer %d (SIGSTOP)\n", c->base.rank, kvr_tag_layer(tag));
            fflush(stderr);
            raise(SIGSTOP);
        } else if (c->dv.stall_deaf) {
            // deaf to the transport's wake: back only after the driver gave up on it (three
            // timeouts), as a thread stuck in a kernel or a library call would be
            const double until = kvr_time_ms() + 5e3 * c->timeout_s;
            while (kvr_time_ms() < until) nanosleep(&(struct timespec) { .tv_nsec = 10 * 1000000L }, NULL);
        } else {
            c->tr->idle(c->tr, kvr_time_ms() + 2e3 * c->timeout_s);
        }
    }
    return kvr_error(KVR_ERR_COMM, "rank %d: stopped by the stall test hook at layer %d", c->base.rank, kvr_tag_layer(tag));
}

// The one place the test hook KVR_TEST_KILL acts (struct kvr_test_kill in kvr.h): the rank is lost
// here. A rank that is a process of its own dies at once, as a crashed one would. A local rank's
// thread stops without a word to its peers (no transport fail(): its transfers are withdrawn at
// the graph's end as a stalled rank's are), so whoever waits on it times out as on a lost process.
static int test_kill(struct rank_comm * c) {
    if (c->dv.own_process) {
        fprintf(stderr, "kvr: rank %d: killed by the test hook KVR_TEST_KILL at %s\n", c->base.rank, c->dv.kill_what);
        fflush(stderr);
        raise(SIGKILL);
    }
    c->dv.killed = true;
    c->dv.t_killed = kvr_time_ms();
    return kvr_error(KVR_ERR_COMM, "rank %d: lost: stopped by the test hook KVR_TEST_KILL at %s", c->base.rank, c->dv.kill_what);
}

// The kill hook's points that fall in this eval (struct kvr_test_kill): each rank concerned
// stops at its layer; one that computes nothing in this eval is lost now (as a heartbeat would
// find it before the eval), which fails the eval.
static int test_kill_arm(struct kvr_session * d, bool decode) {
    const struct eval_plan * pl = &d->plan;
    for (int i = 0; i < d->n_local; i++) d->ranks[i].comm->dv.kill_layer = d->ranks[i].comm->dv.kill_point = -1;
    for (int k = 0; k < d->dv.n_kill; k++) {
        const struct kvr_test_kill * kp = &d->dv.kill[k];
        if (d->dv.kill_fired[k] || kp->decode != decode || (decode && kp->at != d->dv.n_steps)) continue;
        struct dist_rank * dr = NULL;
        for (int i = 0; i < d->n_local; i++) {
            if (d->ranks[i].id == kp->rank) dr = &d->ranks[i];
        }
        if (!dr || dr->comm->dv.kill_point >= 0) continue;
        struct rank_comm * c = dr->comm;
        const bool idle = !pl->active[dr->rank] || (pl->pd && dr->rank == d->n_ranks - 1);
        c->dv.kill_point = k;
        c->dv.kill_layer = decode ? (int)d->m->hp.n_layer / 2 : kp->at;
        if (idle) {
            if (decode) snprintf(c->dv.kill_what, sizeof(c->dv.kill_what), "the start of decode step %d (it computes nothing in it)", kp->at);
            else snprintf(c->dv.kill_what, sizeof(c->dv.kill_what), "the start of the prefill (it computes nothing in it)");
            d->dv.kill_fired[k] = true;
            dr->lost = true;
            return test_kill(c);
        }
        if (decode) snprintf(c->dv.kill_what, sizeof(c->dv.kill_what), "layer %d of decode step %d", c->dv.kill_layer, kp->at);
        else snprintf(c->dv.kill_what, sizeof(c->dv.kill_what), "layer %d of the prefill", c->dv.kill_layer);
    }
    return KVR_OK;
}

//
// the hooks
//

// Before an eval's ranks start (after its plan): the hooks armed for this eval, the stream of a
// first prefill, the logs opened and told this eval's step, the replicas told its chunk.
static int dejavu_eval_begin(struct kvr_session * d, const int32_t * tokens, int n) {
    d->dv.decode = n == 1 && d->n_past > 0 && !d->dv.recomputing;
    for (int i = 0; i < d->n_local; i++) {
        struct rank_comm * c = d->ranks[i].comm;
        c->dv.stalled = false;
        // the rank as started: after a recovery renumbered the survivors, nobody else stalls
        const struct kvr_test_hooks * h = &d->dv.test;
        const bool now = !h->stall_decode || (d->dv.decode && d->dv.n_steps == h->stall_step);
        c->dv.stall_layer = h->stall && now && d->ranks[i].id == h->stall_rank ? h->stall_layer : -1;
        c->dv.stall_deaf = h->stall_deaf;
    }
    int rc = test_kill_arm(d, d->dv.decode);
    if (rc != KVR_OK) return rc;
    d->dv.stream = NULL;
    if (d->p.kv_stream && !d->dv.streamed && d->n_past == 0) {
        rc = stream_start(d, tokens, n, &d->dv.stream);
        if (rc != KVR_OK) return rc;
    }
    if (d->p.replicate_dir && !d->dv.logs_open) {
        rc = replog_start(d, tokens, n);
        if (rc != KVR_OK) {
            if (d->dv.stream) stream_close(d->dv.stream, false, NULL);
            d->dv.stream = NULL;
            for (int i = 0; i < d->n_local; i++) d->ranks[i].comm->dv.stream = NULL;
            return rc;
        }
    }
    // the logs: every rank's rows of this eval (unless they hold them already), then the commits
    d->dv.logging = d->dv.logs_open && !d->dv.log_skip;
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        dr->comm->dv.log = d->dv.logging ? dr->dv.log : NULL;
        if (dr->dv.log) dr->dv.log->step = d->dv.log_step;
    }
    if (d->p.replicate) replicas_begin(d);
    return KVR_OK;
}

// Whether a rank's eval of n tokens needs nodes after its layers' stores (its pass runs then,
// also for the single strategy). A prompt's rows go to the replication log by the log's nodes, a
// decoded token's after the eval (dejavu_rank_done), so that its graph is kept, and so do a
// replica's (--replicate); a rank the kill hook stops in this eval: the hook is a node.
static bool dejavu_rank_wants_pass(const struct kvr_session * d, const struct dist_rank * dr, int n) {
    const struct rank_dejavu * dv = &dr->comm->dv;
    return dv->stream || d->plan.pd || (dv->log && n > 1) || (dv->replica_out && n > 1) || dv->kill_layer >= 0;
}

// After the strategy's pass of a rank: the nodes that hand each layer's final rows on
static void dejavu_rank_nodes(struct pass_ctx * pc, struct kvr_graph * g) {
    if (pc->dr->comm->dv.stream || pc->pl->pd) add_stream_nodes(pc, g, pc->n_final);
    if (pc->dr->comm->dv.log) add_log_nodes(pc, g, pc->dr->made_row0, pc->dr->made);
    add_replica_nodes(pc, g);
    add_kill_node(pc, g); // last: it goes before everything else put after the layer's store
}

// A pseudo-peer's node (node_is_dejavu) runs: K in src[0], V in src[1]
static int dejavu_comm_exec(struct rank_comm * c, const struct kvr_tensor * node) {
    const int peer = node->op_params[0], il = kvr_tag_layer(node->op_params[1]);
    if (peer == PEER_KILL) return test_kill(c);
    if (peer == PEER_REPLICA) {
        c->st.replica_bytes += (int64_t)(kvr_nbytes(node->src[0]) + kvr_nbytes(node->src[1]));
        replica_put(c->dv.replica_out, il, node->src[0], node->src[1]);
        return KVR_OK;
    }
    if (peer == PEER_LOG) {
        const int rc = log_put_rows(c->dv.log, c->dv.log->step, il, (int)node->src[0]->ne[1], node->src[0], node->src[1], NULL, NULL, 0);
        return rc == KVR_OK ? rc : comm_fail(c, rc);
    }
    // to the file stream, no peer
    c->st.kv_stream_bytes += (int64_t)(kvr_nbytes(node->src[0]) + kvr_nbytes(node->src[1])); // the rows in the file's (the cache's) types
    const int rc = stream_put(c->dv.stream, c->base.rank, il, node->src[0], node->src[1]);
    return rc == KVR_OK ? rc : comm_fail(c, rc);
}

// After a rank's eval went well without its pass (a decode token of the single pass, its graph
// kept): its new rows to the replica and the log, which no node took
static int dejavu_rank_done(struct dist_rank * dr, const struct kvr_eval * ev) {
    struct rank_dejavu * dv = &dr->comm->dv;
    const int n_layer = dr->cache->n_layer;
    if (ev->pass || dr->made == 0) return KVR_OK;
    if (dv->replica_out) {
        replica_put_rows(dv->replica_out, dr->be, dr->cache, dr->made_row0, dr->made);
        dr->comm->st.replica_bytes += (int64_t)(dr->cache->row_k + dr->cache->row_v) * dr->made * n_layer;
    }
    if (!dv->log) return KVR_OK;
    // one decoded token's rows, one small transfer per layer, to the log's writer
    int rc = KVR_OK;
    for (int il = 0; il < n_layer && rc == KVR_OK; il++) rc = log_put_rows(dv->log, dv->log->step, il, dr->made, NULL, NULL, dr->be, dr->cache, dr->made_row0);
    if (rc != KVR_OK) dr->comm->tr->fail(dr->comm->tr, dr->rank, kvr_last_error());
    return rc;
}

// Every rank of the eval is back: a rank the kill hook stopped is lost, and so (--replicate) is a
// rank that stopped answering: the one the first timeout's chain of waits ended at (local ranks;
// its thread is back, so nothing of it runs any more and its state can go). The replicas' chunks
// are committed (all_ok) or dropped, and the stream and the logs were this eval's alone.
static void dejavu_ranks_joined(struct kvr_session * d, bool all_ok) {
    bool killed = false;
    for (int i = 0; i < d->n_local; i++) {
        struct rank_comm * c = d->ranks[i].comm;
        if (c->dv.killed) d->ranks[i].lost = d->dv.kill_fired[c->dv.kill_point] = killed = true;
    }
    double since = 0.0;
    const int stopped = d->p.replicate && !all_ok && !killed && d->p.comm == KVR_COMM_LOCAL ? local_stopped(d->tr, &since) : -1;
    for (int i = 0; i < d->n_local && stopped >= 0; i++) {
        struct dist_rank * dr = &d->ranks[i];
        if (dr->rank != stopped || dr->rc == KVR_OK) continue; // one that finished its part stopped nothing
        struct rank_comm * c = dr->comm;
        dr->lost = true;
        if (!c->dv.stalled) c->dv.t_killed = since; // the stall hook knows when it stopped
        snprintf(c->dv.kill_what, sizeof(c->dv.kill_what), "it answered nobody for %.1f s (--comm-timeout)%s", d->p.timeout_s,
                 c->dv.stalled ? ": the stall test hook stopped it" : "");
        dist_log(d, "rank %d: %s; declared lost", dr->rank, c->dv.kill_what);
    }
    replicas_end(d, all_ok);
    for (int i = 0; i < d->n_local; i++) {
        d->ranks[i].comm->dv.stream = NULL;
        d->ranks[i].comm->dv.log = NULL;
    }
}

// The eval's end, before it counts: rc KVR_OK finishes the stream's file with the logits; an
// error (the message set) drops it, keeping the message, and names a rank the kill hook stopped
// when the message does not (timeouts that race, ring ranks all waiting at once, may leave the
// lost rank unnamed).
static int dejavu_eval_end(struct kvr_session * d, int rc) {
    struct kv_stream * st = d->dv.stream;
    d->dv.stream = NULL;
    if (rc == KVR_OK) {
        if (!st) return KVR_OK;
        d->dv.streamed = true;
        d->dv.stream_bytes = st->bytes;
        return stream_close(st, true, d->logits);
    }
    char err[1024];
    snprintf(err, sizeof(err), "%s", kvr_last_error());
    for (int i = 0; i < d->n_local; i++) {
        const struct dist_rank * dr = &d->ranks[i];
        char a[48], b[48], c[64];
        snprintf(a, sizeof(a), "from rank %d", dr->rank);
        snprintf(b, sizeof(b), "for rank %d to take", dr->rank);
        snprintf(c, sizeof(c), "rank %d: lost", dr->rank);
        if (!dr->lost || strstr(err, a) || strstr(err, b) || strstr(err, c)) continue;
        char msg[2048];
        snprintf(msg, sizeof(msg), "%s", kvr_last_error());
        if (dr->comm->dv.killed) {
            kvr_error(rc, "%s; rank %d was lost there (stopped by the test hook KVR_TEST_KILL at %s)", msg, dr->rank, dr->comm->dv.kill_what);
        } else {
            kvr_error(rc, "%s; rank %d was lost there (%s)", msg, dr->rank, dr->comm->dv.kill_what);
        }
    }
    if (st) {
        char keep[1024];
        snprintf(keep, sizeof(keep), "%s", kvr_last_error());
        stream_close(st, false, NULL);
        kvr_error(rc, "%s", keep);
    }
    return rc;
}

// The eval counted (its tokens are the session's): the decode steps the kill hook counts, and each
// local rank's commit of the step in its log
static int dejavu_eval_commit(struct kvr_session * d, const int32_t * tokens, int n) {
    if (d->dv.decode) d->dv.n_steps++;
    if (d->dv.logging) {
        const int rc = replog_commit(d, tokens, n);
        if (rc != KVR_OK) return rc;
    }
    d->dv.log_skip = false;
    return KVR_OK;
}

// An eval ended (lg: its logits, NULL when it failed). A rank lost in it, with --replicate: the
// session is recovered (dist_recover) and true says to run the eval again on the survivors; *t_lost
// keeps when the first loss happened, for the log's line once the eval went on.
static bool dejavu_failover(struct kvr_session * d, const float * lg, int n, double * t_lost) {
    if (lg) {
        if (*t_lost >= 0) {
            dist_log(d, "the eval went on: its result came %.0f ms after the loss (found after %.0f ms, restored in %.1f ms)",
                     kvr_time_ms() - *t_lost, d->dv.t_recover - *t_lost, d->dv.failover_restore_ms);
        }
        return false;
    }
    bool any = false;
    for (int i = 0; i < d->n_local; i++) any |= d->ranks[i].lost;
    if (!any || !d->p.replicate) return false;
    if (*t_lost < 0) {
        for (int i = 0; i < d->n_local; i++) {
            if (d->ranks[i].lost) *t_lost = d->ranks[i].comm->dv.t_killed;
        }
    }
    char cause[1024];
    snprintf(cause, sizeof(cause), "%s", kvr_last_error());
    d->dv.t_recover = kvr_time_ms();
    if (dist_recover(d, cause) != KVR_OK) return false;
    dist_log(d, "the failed eval (%d token%s) runs again on %d rank%s", n, n > 1 ? "s" : "", d->n_ranks, d->n_ranks > 1 ? "s" : "");
    return true;
}

// kvr_session_new: --replicate and the kill hook's points, checked against the session (a point that
// could never fire is a mistake); KVR_ERR_ARG with the message set
static int dejavu_new(struct kvr_session * d) {
    const struct kvr_session_params * p = &d->p;
    if (p->replicate && (p->comm != KVR_COMM_LOCAL || d->n_ranks < 2 || p->pd)) {
        return kvr_error(KVR_ERR_ARG, p->comm != KVR_COMM_LOCAL ? "--replicate keeps each rank's replica in its successor's memory in this process "
                         "(local ranks); across processes use --replicate-dir" : p->pd ? "--replicate does not go with --decode-rank"
                         : "--replicate keeps each rank's rows on the next rank: it needs 2 ranks or more, not %d", d->n_ranks);
    }
    const int cap = (int)(sizeof(d->dv.kill) / sizeof(d->dv.kill[0]));
    if (p->test) d->dv.test = *p->test;
    d->dv.test.kill = NULL; // the points are copied into dv.kill
    const int n_kill = p->test ? p->test->n_kill : 0;
    if (n_kill > cap || n_kill < 0) return kvr_error(KVR_ERR_ARG, "KVR_TEST_KILL: %d points, at most %d", n_kill, cap);
    for (int i = 0; i < n_kill; i++) {
        const struct kvr_test_kill * k = &p->test->kill[i];
        if (k->rank < 0 || k->rank >= d->n_ranks) {
            return kvr_error(KVR_ERR_ARG, "KVR_TEST_KILL: rank %d is not one of the %d ranks", k->rank, d->n_ranks);
        }
        if (k->at < 0 || (!k->decode && k->at >= (int)d->m->hp.n_layer)) {
            return kvr_error(KVR_ERR_ARG, "KVR_TEST_KILL: %s %d is out of range (the model has %u layers)",
                             k->decode ? "decode step" : "layer", k->at, d->m->hp.n_layer);
        }
        d->dv.kill[d->dv.n_kill++] = *k;
    }
    return KVR_OK;
}

// kvr_session_free: what the logs have queued is written and synced
static void dejavu_free(struct kvr_session * d) {
    replog_restart(d);
    free(d->dv.resume_prompt);
}

// kvr_session_reset (the ranks hold nothing now): the logs start again with the next eval, the
// replicas hold nothing
static void dejavu_reset(struct kvr_session * d) {
    replog_restart(d);
    replicas_seed_all(d);
}

//
// saving and restoring the cache (the file of kvr.c's section 15): tsp, kvr and single continue
// on the last rank, which holds the whole cache, so that is what they save and restore; the ring
// strategies save every rank's shard (gathered to one file, or each rank its own) and restore
// each to its rank with the ring's next decode shard, so a continued run is the same bit for bit
//

const int32_t * kvr_session_tokens(const struct kvr_session * d) { return d->seq; }
const float * kvr_session_logits(const struct kvr_session * d) { return d->has_logits ? d->logits : NULL; }

static struct dist_rank * dist_local(struct kvr_session * d, int rank) {
    for (int i = 0; i < d->n_local; i++) {
        if (d->ranks[i].rank == rank) return &d->ranks[i];
    }
    return NULL;
}

void kvr_session_kv_shard_path(const char * path, int rank, char * out, size_t cap) {
    snprintf(out, cap, "%s.%d", path, rank);
}

// write shards [0, n) of lay, whose rows live in the caches of ranks dr[s] (rows 0..n_rows-1)
static int dist_write(struct kvr_session * d, const char * path, const struct kvr_kv_layout * lay, struct dist_rank ** dr) {
    struct kvr_kv_writer * w;
    int rc = kvr_kv_writer_open(&w, path, d->m, lay);
    if (rc != KVR_OK) return rc;
    int max_rows = 1;
    for (int s = 0; s < lay->n_shards; s++) max_rows = lay->shards[s].n_rows > max_rows ? lay->shards[s].n_rows : max_rows;
    const size_t bytes = sizeof(float) * (size_t)dr[0]->cache->kv_dim * (size_t)max_rows;
    float * k = malloc(bytes), * v = malloc(bytes);
    KVR_ASSERT(k && v);
    for (int il = 0; il < (int)d->m->hp.n_layer && rc == KVR_OK; il++) {
        if (kvr_layer_recurrent(&d->m->hp, il)) continue; // no K and V: its state follows the layers
        for (int s = 0; s < lay->n_shards && rc == KVR_OK; s++) {
            cache_get_f32(dr[s]->be, dr[s]->cache, il, 0, lay->shards[s].n_rows, k, v);
            rc = kvr_kv_writer_layer(w, il, s, k, v);
        }
    }
    // every shard's rank holds the same states: the first one's
    float * st = dr[0]->cache->n_state ? malloc(sizeof(float) * (size_t)dr[0]->cache->n_state) : NULL;
    for (int il = 0; il < (int)d->m->hp.n_layer && st && rc == KVR_OK; il++) {
        if (!kvr_layer_recurrent(&d->m->hp, il)) continue;
        kvr_kv_cache_get_state(dr[0]->be, dr[0]->cache, il, st);
        rc = kvr_kv_writer_state(w, il, st);
    }
    free(st);
    if (rc == KVR_OK) rc = kvr_kv_writer_close(w, d->logits);
    else kvr_kv_writer_abort(w);
    free(k);
    free(v);
    return rc;
}

int kvr_session_kv_save(struct kvr_session * d, const char * path, bool per_rank) {
    if (d->swap.out) return kvr_error(KVR_ERR_ARG, "%s: the cache is swapped out (kvr_session_kv_swap_in first)", path);
    const int N = d->n_ranks;
    struct kvr_kv_layout lay = { .n_tokens = d->n_past, .tokens = d->seq, .logits = d->has_logits, .type_k = d->type_k,
                                 .type_v = d->type_v, .rope_long = kvr_model_rope_long(d->m, d->n_ctx) };
    if (d->layout == LAYOUT_CHAIN) {
        struct dist_rank * dr = dist_local(d, N - 1);
        if (!dr) return KVR_OK; // MPI: the process of the last rank writes the file
        KVR_ASSERT(dr->n_rows == d->n_past);
        const struct kvr_kv_shard sh = { .rank = 0, .n_rows = dr->n_rows, .pos = dr->cache_pos };
        lay.n_ranks = lay.n_shards = 1;
        lay.shards = &sh;
        return dist_write(d, path, &lay, &dr);
    }
    struct kvr_kv_shard * sh = calloc((size_t)N, sizeof(*sh));
    struct dist_rank ** drs = calloc((size_t)N, sizeof(*drs));
    KVR_ASSERT(sh && drs);
    for (int i = 0; i < d->n_local; i++) {
        const int r = d->ranks[i].rank;
        sh[r] = (struct kvr_kv_shard) { .rank = r, .n_rows = d->ranks[i].n_rows, .pos = d->ranks[i].cache_pos };
        drs[r] = &d->ranks[i];
    }
    lay.n_ranks = N;
    lay.ring_next = d->n_decode % N;
    int rc = KVR_OK;
    // a save replaces the earlier one under PATH in either form (the load prefers PATH)
    char p[4096];
    if (!per_rank && d->n_local == N) {
        lay.n_shards = N;
        lay.shards = sh;
        rc = dist_write(d, path, &lay, drs);
        for (int r = 0; r < N && rc == KVR_OK; r++) {
            kvr_session_kv_shard_path(path, r, p, sizeof(p));
            remove(p);
        }
    } else {
        remove(path);
        lay.n_shards = 1;
        for (int i = 0; i < d->n_local && rc == KVR_OK; i++) {
            const int r = d->ranks[i].rank;
            kvr_session_kv_shard_path(path, r, p, sizeof(p));
            lay.shards = &sh[r];
            rc = dist_write(d, p, &lay, &drs[r]);
        }
    }
    free(sh);
    free(drs);
    return rc;
}

// the rows of positions pos[0..n) of a layer from a whole or gathered file (NULL: not there)
static void file_rows_at(const struct kvr_kv_file * f, int il, const int32_t * where, int n, float * k, float * v,
                         int32_t * slot) {
    // slot: scratch of n_tokens entries, the (shard << 24 | row) of each position
    for (int s = 0; s < f->n_shards; s++) {
        for (int i = 0; i < f->shards[s].n_rows; i++) slot[f->shards[s].pos[i]] = s << 24 | i;
    }
    const size_t row = sizeof(float) * (size_t)f->kv_dim;
    for (int j = 0; j < n; j++) {
        const int s = slot[where[j]] >> 24, i = slot[where[j]] & 0xffffff;
        memcpy(k + (size_t)j * f->kv_dim, f->shards[s].k[il] + (size_t)i * f->kv_dim, row);
        memcpy(v + (size_t)j * f->kv_dim, f->shards[s].v[il] + (size_t)i * f->kv_dim, row);
    }
}

static int dist_restore(struct kvr_session * d, struct kvr_kv_file * const * fs, bool per_rank, bool shards_fit, const char * path);

// A cache's keys rotated with one set of Phi-3's LongRoPE factors (file_long: the long ones) are
// not those of a session whose context takes the other set: KVR_ERR_ARG naming both
static int rope_factors_check(const struct kvr_session * d, const char * path, const char * what, bool file_long) {
    const bool want = kvr_model_rope_long(d->m, d->n_ctx);
    if (file_long == want) return KVR_OK;
    const unsigned orig = d->m->hp.rope_n_ctx_orig;
    return kvr_error(KVR_ERR_ARG, "%s: the %s's keys took %s's %s LongRoPE factors (a context %s %u tokens); this session's context of %d "
                     "tokens takes the %s ones, so its keys would differ: use a context %s %u tokens, or compute the prompt again", path, what,
                     d->m->hp.arch_name, file_long ? "long" : "short", file_long ? "past" : "of at most", orig, d->n_ctx,
                     want ? "long" : "short", file_long ? "past" : "of at most", orig);
}

int kvr_session_kv_load(struct kvr_session * d, const char * path) {
    if (d->swap.out) return kvr_error(KVR_ERR_ARG, "%s: the cache is swapped out (kvr_session_kv_swap_in first)", path);
    const int N = d->n_ranks;
    char p[4096];
    // the files: PATH (whole, or every shard gathered), or each rank's PATH.R
    struct kvr_kv_file ** fs = calloc((size_t)N, sizeof(*fs));
    KVR_ASSERT(fs != NULL);
    int rc = KVR_OK;
    kvr_session_kv_shard_path(path, 0, p, sizeof(p));
    const bool per_rank = access(path, F_OK) != 0 && access(p, F_OK) == 0;
    if (per_rank) {
        for (int r = 0; r < N && rc == KVR_OK; r++) {
            kvr_session_kv_shard_path(path, r, p, sizeof(p));
            rc = kvr_kv_file_read(p, d->m, &fs[r]);
            if (rc != KVR_OK) break;
            const struct kvr_kv_file * f = fs[r];
            if (f->n_ranks != N || f->n_shards != 1 || f->shards[0].rank != r || f->n_tokens != fs[0]->n_tokens ||
                memcmp(f->tokens, fs[0]->tokens, sizeof(int32_t) * (size_t)f->n_tokens) != 0) {
                rc = kvr_error(KVR_ERR_ARG, "%s: the shard of rank %d of %d ranks (%d tokens) does not fit rank %d of these %d ranks "
                               "(%d tokens in %s.0)", p, f->shards[0].rank, f->n_ranks, f->n_tokens, r, N, fs[0]->n_tokens, path);
            }
        }
    } else {
        rc = kvr_kv_file_read(path, d->m, &fs[0]);
        if (rc == KVR_OK && fs[0]->n_shards != fs[0]->n_ranks) {
                rc = kvr_error(KVR_ERR_ARG, "%s: holds the shard of rank %d of a cache over %d ranks; load every rank's file (%s.R)",
                               path, fs[0]->shards[0].rank, fs[0]->n_ranks, path);
        }
    }
    for (int r = 0; r < (per_rank ? N : 1) && rc == KVR_OK; r++) {
        if (!per_rank) snprintf(p, sizeof(p), "%s", path);
        else kvr_session_kv_shard_path(path, r, p, sizeof(p));
        rc = rope_factors_check(d, p, "cache", fs[r]->flags & KVR_KV_FILE_ROPE_LONG);
    }
    if (rc == KVR_OK && per_rank && d->layout != LAYOUT_RING && N > 1) {
        rc = kvr_error(KVR_ERR_ARG, "%s.R: a ring cache saved rank by rank loads into a ring strategy of %d ranks; this one is %s",
                       path, N, kvr_strategy_name(d->p.strategy));
    }
    if (rc == KVR_OK) rc = dist_restore(d, fs, per_rank, true, path);
    for (int r = 0; r < N; r++) kvr_kv_file_free(fs[r]);
    free(fs);
    return rc;
}

// The caches from checked files: fs[0] a whole or gathered cache (per_rank false), or fs[r] the
// shard of rank r. A ring cache of as many ranks keeps its shards (when shards_fit); anything else
// goes to the chain's last rank, or is split as a prefill of its tokens would be. Nothing changes
// before everything fits; path names the files in errors.
static int dist_restore(struct kvr_session * d, struct kvr_kv_file * const * fs, bool per_rank, bool shards_fit, const char * path) {
    const int N = d->n_ranks;
    int rc = KVR_OK;
    const struct kvr_kv_file * f0 = fs[0];
    const int n = f0 ? f0->n_tokens : 0;
    // where every rank's rows go: the same shards (a ring file of this many ranks), else the
    // chain's last rank or a fresh ring split of the positions
    const bool same_shards = d->layout == LAYOUT_RING && (per_rank || (shards_fit && f0->n_ranks == N && f0->n_shards == N));
    int * rows = calloc((size_t)N, sizeof(int));
    int32_t ** pos = calloc((size_t)N, sizeof(int32_t *));
    for (int r = 0; r < N && rc == KVR_OK; r++) {
        if (same_shards) {
            const struct kvr_kv_file_shard * sh = per_rank ? &fs[r]->shards[0] : &f0->shards[r];
            rows[r] = sh->n_rows;
            pos[r] = malloc(sizeof(int32_t) * (size_t)(rows[r] + 1));
            memcpy(pos[r], sh->pos, sizeof(int32_t) * (size_t)rows[r]);
        } else if (d->layout == LAYOUT_RING) {
            rows[r] = kvr_ring_shard(n, 0, N, r, NULL);
            pos[r] = malloc(sizeof(int32_t) * (size_t)(rows[r] + 1));
            kvr_ring_shard(n, 0, N, r, pos[r]);
        } else {
            rows[r] = r == N - 1 ? n : 0;
            pos[r] = malloc(sizeof(int32_t) * (size_t)(rows[r] + 1));
            for (int i = 0; i < rows[r]; i++) pos[r][i] = i;
        }
        struct dist_rank * dr = dist_local(d, r);
        if (dr && rows[r] > d->n_ctx) {
            rc = kvr_error(KVR_ERR_ARG, "%s: rank %d would hold %d rows, more than its context of %d (raise -c)", path, r, rows[r],
                           d->n_ctx);
        }
    }
    for (int r = 0; r < N && rc == KVR_OK; r++) { // room for them (the rows already held stay)
        struct dist_rank * dr = dist_local(d, r);
        if (dr) rc = rank_reserve(d, dr, rows[r]);
    }
    // everything checked: now the caches
    if (rc == KVR_OK) {
        replog_restart(d); // the next eval's logs start with what is restored
        const size_t bytes = sizeof(float) * (size_t)f0->kv_dim * (size_t)(n + 1);
        float * k = malloc(bytes), * v = malloc(bytes);
        int32_t * slot = malloc(sizeof(int32_t) * (size_t)(n + 1));
        KVR_ASSERT(k && v && slot);
        for (int i = 0; i < d->n_local; i++) {
            struct dist_rank * dr = &d->ranks[i];
            const int r = dr->rank;
            const struct kvr_kv_file * f = per_rank ? fs[r] : f0;
            for (int il = 0; il < (int)d->m->hp.n_layer; il++) {
                if (!dr->cache->k[il]) continue; // recurrent: its state below
                if (per_rank) {
                    cache_set_f32(dr->be, dr->cache, il, 0, rows[r], f->shards[0].k[il], f->shards[0].v[il]);
                } else {
                    file_rows_at(f, il, pos[r], rows[r], k, v, slot);
                    cache_set_f32(dr->be, dr->cache, il, 0, rows[r], k, v);
                }
            }
            for (int il = 0; il < (int)d->m->hp.n_layer && f->state; il++) { // every rank's copy of the states
                if (f->state[il]) kvr_kv_cache_set_state(dr->be, dr->cache, il, f->state[il]);
            }
            memcpy(dr->cache_pos, pos[r], sizeof(int32_t) * (size_t)rows[r]);
            dr->n_rows = rows[r];
        }
        free(k);
        free(v);
        free(slot);
        memcpy(d->rows, rows, sizeof(int) * (size_t)N);
        seq_reserve(d, n + 1);
        memcpy(d->seq, f0->tokens, sizeof(int32_t) * (size_t)n);
        d->n_past = n;
        d->n_decode = same_shards ? f0->ring_next : 0;
        d->has_logits = f0->logits != NULL;
        if (f0->logits) memcpy(d->logits, f0->logits, sizeof(float) * d->m->hp.n_vocab);
        replicas_seed_all(d);
    }
    for (int r = 0; r < N; r++) free(pos[r]);
    free(pos);
    free(rows);
    return rc;
}

//
// resuming from the replication logs (kvr_session_resume): every rank's log is read and checked, the
// last step every log acknowledged is taken, the rows of the steps up to it are gathered into the
// layout of a gathered cache file and restored as kvr_session_kv_load restores one, all but the last
// token's, which is evaluated again for its logits (the logs hold no logits)
//

static void resume_note(const struct kvr_session * d, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void resume_note(const struct kvr_session * d, const char * fmt, ...) {
    if (!d->p.log || kvr_session_rank(d) != 0) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(d->p.log, "resume: ");
    vfprintf(d->p.log, fmt, ap);
    fprintf(d->p.log, "\n");
    va_end(ap);
}

// Ranks in several processes (MPI) agree on the step taken: each sends what it found to every other
// and takes the least. It is also the point after which every process has read every log, so one
// that goes on to cut its log back or append to it changes nothing another is still reading.
static int resume_agree(struct kvr_session * d, int * S) {
#ifdef KVR_MPI
    struct transport * ht = d->host_tr;
    if (!ht || d->n_local == d->n_ranks) return KVR_OK;
    const int me = d->ranks[0].rank, N = d->n_ranks, tag = kvr_tag(0, KVR_TAG_LOGITS, 1);
    int32_t mine = *S;
    int32_t * theirs = calloc((size_t)N, sizeof(int32_t));
    struct tr_req * reqs = calloc(2 * (size_t)N, sizeof(*reqs));
    KVR_ASSERT(theirs && reqs);
    // another process may still be reading logs: at most the timeout, as every wait
    const double limit = d->p.timeout_s, t0 = kvr_time_ms();
    int rc = KVR_OK, n = 0;
    for (int q = 0; q < N && rc == KVR_OK; q++) {
        if (q == me) continue;
        reqs[n] = (struct tr_req) { .buf = &mine, .n = 4, .me = me, .peer = q, .tag = tag, .is_send = true, .seq = -1 };
        rc = ht->isend(ht, &reqs[n++]);
        if (rc != KVR_OK) break;
        reqs[n] = (struct tr_req) { .buf = &theirs[q], .n = 4, .me = me, .peer = q, .tag = tag, .seq = -1 };
        rc = ht->irecv(ht, &reqs[n++]);
    }
    for (int i = 0; i < n && rc == KVR_OK; i++) rc = ht->wait(ht, &reqs[i], t0 + 1e3 * limit, limit);
    for (int q = 0; q < N && rc == KVR_OK; q++) {
        if (q != me && theirs[q] < *S) *S = theirs[q];
    }
    if (rc != KVR_OK) ht->fail(ht, me, kvr_last_error());
    free(theirs);
    free(reqs);
    return rc;
#else
    (void)d;
    (void)S;
    return KVR_OK;
#endif
}

static bool same_dir(const char * a, const char * b) {
    struct stat sa, sb;
    if (stat(a, &sa) != 0 || stat(b, &sb) != 0) return strcmp(a, b) == 0;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The logs' rows of steps [0, S] as a gathered cache of their ranks, without the row of the last
// position (evaluated again); *holder: the rank that held it
static int resume_gather(struct kvr_kv_log_data ** L, int NL, int S, const char * dir, struct kvr_kv_file * f, int * holder) {
    int n = 0;
    for (int s = 0; s <= S; s++) n += L[0]->steps[s].n_tokens;
    const int last = n - 1, n_layer = L[0]->n_layer, kv_dim = L[0]->kv_dim;
    f->n_tokens = last;
    f->tokens = malloc(sizeof(int32_t) * (size_t)(n + 1));
    f->n_ranks = f->n_shards = NL;
    f->n_layer = n_layer;
    f->kv_dim = kv_dim;
    f->chunk_rows = 1;
    f->shards = calloc((size_t)NL, sizeof(*f->shards));
    uint8_t * seen = calloc((size_t)n + 1, 1);
    KVR_ASSERT(f->tokens && f->shards && seen);
    for (int s = 0, t = 0; s <= S; t += L[0]->steps[s].n_tokens, s++) {
        memcpy(f->tokens + t, L[0]->steps[s].tokens, sizeof(int32_t) * (size_t)L[0]->steps[s].n_tokens);
    }
    *holder = -1;
    int rc = KVR_OK;
    char path[4096];
    for (int r = 0; r < NL && rc == KVR_OK; r++) {
        struct kvr_kv_file_shard * sh = &f->shards[r];
        kvr_session_log_path(dir, r, path, sizeof(path));
        sh->rank = r;
        int cnt = 0;
        for (int s = 0; s <= S; s++) cnt += L[r]->steps[s].n_rows;
        sh->pos = malloc(sizeof(int32_t) * (size_t)(cnt + 1));
        sh->k = calloc((size_t)n_layer, sizeof(float *));
        sh->v = calloc((size_t)n_layer, sizeof(float *));
        KVR_ASSERT(sh->pos && sh->k && sh->v);
        for (int il = 0; il < n_layer; il++) {
            sh->k[il] = malloc(sizeof(float) * (size_t)kv_dim * (size_t)(cnt + 1));
            sh->v[il] = malloc(sizeof(float) * (size_t)kv_dim * (size_t)(cnt + 1));
            KVR_ASSERT(sh->k[il] && sh->v[il]);
        }
        for (int s = 0; s <= S && rc == KVR_OK; s++) {
            const struct kvr_kv_log_step * st = &L[r]->steps[s];
            for (int i = 0; i < st->n_rows && rc == KVR_OK; i++) {
                const int32_t p = st->pos[i];
                if (p >= n || seen[p] || (sh->n_rows > 0 && p <= sh->pos[sh->n_rows - 1])) {
                    rc = kvr_error(KVR_ERR_FORMAT, "%s: step %d holds a row at position %d, %s", path, s, p,
                                   p >= n ? "past the tokens of the steps" : seen[p] ? "which another row holds too" : "before an earlier one");
                    break;
                }
                seen[p] = 1;
                if (p == last) {
                    *holder = r;
                    continue;
                }
                // as f32, the form a cache file's rows take too: the restore turns them back into
                // the cache's types, the same bytes where the log's types are the cache's
                const struct kvr_kv_log_data * x = L[r];
                for (int il = 0; il < n_layer; il++) {
                    kvr_kv_rows_to_float(x->type_k, st->k[il] + (size_t)i * x->row_k, sh->k[il] + (size_t)sh->n_rows * kv_dim, 1, kv_dim);
                    kvr_kv_rows_to_float(x->type_v, st->v[il] + (size_t)i * x->row_v, sh->v[il] + (size_t)sh->n_rows * kv_dim, 1, kv_dim);
                }
                sh->pos[sh->n_rows++] = p;
            }
        }
    }
    for (int p = 0; p < n && rc == KVR_OK; p++) {
        if (!seen[p]) rc = kvr_error(KVR_ERR_FORMAT, "%s: no rank's log holds the row at position %d of the %d tokens of steps 0..%d", dir, p, n, S);
    }
    free(seen);
    return rc;
}

int kvr_session_resume(struct kvr_session * d, const char * dir, const int32_t * prompt, int n_prompt, struct kvr_resume_info * info) {
    memset(info, 0, sizeof(*info));
    info->step = -1;
    if (d->swap.out) return kvr_error(KVR_ERR_ARG, "--resume %s: the cache is swapped out (kvr_session_kv_swap_in first)", dir);
    char path[4096], path0[4096];
    kvr_session_log_path(dir, 0, path0, sizeof(path0));
    struct kvr_kv_log_data * L0 = NULL;
    int rc = kvr_kv_log_read(path0, d->m, &L0);
    if (rc == KVR_ERR_IO && access(path0, F_OK) != 0) {
        return kvr_error(KVR_ERR_IO, "--resume %s: no replication logs there (%s: %s)", dir, path0, strerror(errno));
    }
    if (rc == KVR_ERR_ARG) return rc; // another model: refused
    if (rc != KVR_OK) {
        // rank 0's log is unreadable: nothing can be taken from the logs; the prompt is computed
        resume_note(d, "%s: nothing restored, the prompt is computed again", kvr_last_error());
        return KVR_OK;
    }
    const int NL = L0->n_ranks;
    struct kvr_kv_log_data ** L = calloc((size_t)NL, sizeof(*L));
    KVR_ASSERT(L != NULL);
    L[0] = L0;
    int S = L0->n_steps - 1;
    for (int r = 1; r < NL && rc == KVR_OK; r++) {
        kvr_session_log_path(dir, r, path, sizeof(path));
        rc = kvr_kv_log_read(path, d->m, &L[r]);
        if (rc == KVR_ERR_ARG) break;
        if (rc != KVR_OK) {
            resume_note(d, "%s: rank %d acknowledged nothing that can be read", kvr_last_error(), r);
            rc = KVR_OK;
            S = -1;
            continue;
        }
        const struct kvr_kv_log_data * x = L[r];
        const struct { int off; int a, b; const char * name; } same[] = {
            { 64, x->rank, r, "rank" }, { 68, x->n_ranks, NL, "ranks" }, { 72, x->strategy, L0->strategy, "strategy" },
            { 12, (int)x->flags, (int)L0->flags, "flags" }, { 76, x->n_prompt, L0->n_prompt, "prompt tokens" },
            { 32, (int)(x->type_k | x->type_v << 16), (int)(L0->type_k | L0->type_v << 16), "cache type field" },
        };
        for (int i = 0; i < 6 && rc == KVR_OK; i++) {
            if (same[i].a != same[i].b) {
                rc = kvr_error(KVR_ERR_ARG, "%s: offset %d: %s %d, but %s has %d (%s): logs of different runs in %s", path, same[i].off,
                               same[i].name, same[i].a, i == 0 ? "its name" : path0, same[i].b, i == 0 ? "rank-R.kvlog" : "rank 0's log", dir);
            }
        }
        for (int i = 0; i < x->n_prompt && rc == KVR_OK; i++) {
            if (x->prompt[i] != L0->prompt[i]) {
                rc = kvr_error(KVR_ERR_ARG, "%s: offset %d: prompt token %d is %d, %s has %d: logs of different runs in %s", path,
                               KVR_KV_LOG_HEADER + 4 * i, i, x->prompt[i], path0, L0->prompt[i], dir);
            }
        }
        if (x->n_steps - 1 < S) S = x->n_steps - 1;
    }
    if (rc == KVR_OK) rc = rope_factors_check(d, path0, "log", L0->flags & KVR_KV_LOG_ROPE_LONG);
    // this run's prompt: the logs' (of a log that began with a prompt), or where the logs began
    // with a base, the start of what they hold
    for (int i = 0; rc == KVR_OK && prompt && i < (n_prompt < L0->n_prompt ? n_prompt : L0->n_prompt); i++) {
        if (prompt[i] != L0->prompt[i]) {
            rc = kvr_error(KVR_ERR_ARG, "%s: offset %d: the logs are of another prompt: its token %d is %d, this run's prompt has %d", path0,
                           KVR_KV_LOG_HEADER + 4 * i, i, L0->prompt[i], prompt[i]);
        }
    }
    if (rc == KVR_OK && prompt && !(L0->flags & KVR_KV_LOG_BASE) && n_prompt != L0->n_prompt) {
        rc = kvr_error(KVR_ERR_ARG, "%s: offset 76: the logs are of another prompt: prompt tokens %d, this run's prompt has %d", path0,
                       L0->n_prompt, n_prompt);
    }
    // the steps every log holds must be the same steps
    for (int r = 1; r < NL && rc == KVR_OK; r++) {
        for (int s = 0; L[r] && s <= S && rc == KVR_OK; s++) {
            const struct kvr_kv_log_step * a = &L[0]->steps[s], * b = &L[r]->steps[s];
            if (a->n_tokens != b->n_tokens || memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n_tokens) != 0) {
                kvr_session_log_path(dir, r, path, sizeof(path));
                rc = kvr_error(KVR_ERR_ARG, "%s: the tokens of step %d differ from %s's: logs of different runs in %s", path, s, path0, dir);
            }
        }
    }
    // appending to the logs read: the same ranks and strategy, so each rank's log goes on as it was
    const bool append = rc == KVR_OK && d->p.replicate_dir && same_dir(d->p.replicate_dir, dir);
    if (append && (NL != d->n_ranks || L0->strategy != (int)d->p.strategy)) {
        rc = kvr_error(KVR_ERR_ARG, "--replicate-dir %s: the logs there are of %d ranks (%s); this run has %d (%s): they cannot go on "
                       "there, give --replicate-dir another directory", dir, NL, kvr_strategy_name((enum kvr_strategy)L0->strategy),
                       d->n_ranks, kvr_strategy_name(d->p.strategy));
    }
    const bool converted = rc == KVR_OK && (L0->type_k != d->type_k || L0->type_v != d->type_v);
    if (append && converted) {
        rc = kvr_error(KVR_ERR_ARG, "--replicate-dir %s: the logs there hold %s K and %s V rows; this run's cache is %s and %s: they "
                       "cannot go on there (their rows would change type), give --replicate-dir another directory", dir,
                       kvr_type_name(L0->type_k), kvr_type_name(L0->type_v), kvr_type_name(d->type_k), kvr_type_name(d->type_v));
    }
    if (converted && rc == KVR_OK) {
        resume_note(d, "%s: the logs hold %s K and %s V rows, this session's cache is %s and %s: the rows are converted", dir,
                    kvr_type_name(L0->type_k), kvr_type_name(L0->type_v), kvr_type_name(d->type_k), kvr_type_name(d->type_v));
    }
    if (rc == KVR_OK) rc = resume_agree(d, &S);
    struct kvr_kv_file f = { 0 };
    int holder = -1;
    if (rc == KVR_OK) {
        d->dv.resume_prompt = realloc(d->dv.resume_prompt, sizeof(int32_t) * (size_t)(L0->n_prompt + 1));
        KVR_ASSERT(d->dv.resume_prompt != NULL);
        memcpy(d->dv.resume_prompt, L0->prompt, sizeof(int32_t) * (size_t)L0->n_prompt);
        info->prompt = d->dv.resume_prompt;
        info->n_prompt = L0->n_prompt;
        info->n_ranks = NL;
        info->strategy = (enum kvr_strategy)L0->strategy;
        for (int r = 0; r < NL; r++) {
            if (!L[r]) continue;
            info->bytes += L[r]->bytes;
            kvr_session_log_path(dir, r, path, sizeof(path));
            if (L[r]->damage[0] && L[r]->n_steps) resume_note(d, "%s: %s: its steps 0..%d are whole", path, L[r]->damage, L[r]->n_steps - 1);
            if (L[r]->damage[0] && !L[r]->n_steps) resume_note(d, "%s: %s: none of its steps is whole", path, L[r]->damage);
            if (L[r]->n_steps - 1 > S) {
                info->recomputed += L[r]->n_steps - 1 - S;
                if (S >= 0) {
                    resume_note(d, "%s: steps %d..%d are past the last step every rank acknowledged (%d): recomputed", path, S + 1,
                                L[r]->n_steps - 1, S);
                } else {
                    resume_note(d, "%s: steps 0..%d are whole, but not every rank acknowledged step 0: recomputed", path, L[r]->n_steps - 1);
                }
            }
        }
        if (S >= 0) rc = resume_gather(L, NL, S, dir, &f, &holder);
    }
    if (rc == KVR_OK && S >= 0) {
        // the row of the last token goes back where it was when the shards are kept (ring_next)
        f.ring_next = holder >= 0 && holder < NL ? holder : 0;
        const bool ring_log = strategy_is_ring((enum kvr_strategy)L0->strategy);
        rc = dist_restore(d, (struct kvr_kv_file * const[]) { &f }, false, ring_log, dir);
    }
    if (rc == KVR_OK && append && S >= 0) {
        // each log cut back to the end of step S and continued (with no step acknowledged, the
        // prefill starts new logs)
        for (int i = 0; i < d->n_local && rc == KVR_OK; i++) {
            struct dist_rank * dr = &d->ranks[i];
            struct kvr_kv_log_data * x = L[dr->rank];
            x->good = x->steps[S].end;
            x->good_crc = x->steps[S].crc;
            kvr_session_log_path(dir, dr->rank, path, sizeof(path));
            struct kvr_kv_log * w;
            rc = kvr_kv_log_append(&w, path, d->m, x);
            if (rc == KVR_OK) {
                dr->dv.log = log_start(w, path, d->p.timeout_s);
                if (!dr->dv.log) rc = KVR_ERR_NOMEM;
            }
        }
        if (rc == KVR_OK) {
            d->dv.logs_open = true;
            d->dv.log_step = S + 1;
            d->dv.log_skip = true; // the last token's eval below is step S's, which the logs hold
        } else if (rc != KVR_OK) {
            char keep[1024];
            snprintf(keep, sizeof(keep), "%s", kvr_last_error());
            replog_restart(d);
            kvr_error(rc, "%s", keep);
        }
    }
    const int n = f.n_tokens + 1;
    if (rc == KVR_OK && S >= 0) {
        // the last token again, for its logits: the eval the first run made of it
        const int32_t last = f.tokens[n - 1];
        if (!kvr_session_eval(d, &last, 1)) rc = kvr_error(KVR_ERR_COMM, "--resume %s: evaluating the last restored token: %s", dir, kvr_last_error());
    }
    if (rc == KVR_OK && S >= 0) {
        info->step = S;
        info->n_tokens = n;
        resume_note(d, "%s: restored %d tokens (steps 0..%d of %d ranks, %s) onto %d ranks (%s); the last one evaluated again for its logits",
                    dir, n, S, NL, kvr_strategy_name(info->strategy), d->n_ranks, kvr_strategy_name(d->p.strategy));
    } else if (rc == KVR_OK) {
        resume_note(d, "%s: no step that every rank acknowledged: nothing restored, the prompt is computed again", dir);
    }
    if (f.shards) {
        for (int r = 0; r < f.n_shards; r++) {
            for (int il = 0; il < f.n_layer; il++) {
                free(f.shards[r].k[il]);
                free(f.shards[r].v[il]);
            }
            free(f.shards[r].k);
            free(f.shards[r].v);
            free(f.shards[r].pos);
        }
        free(f.shards);
    }
    free(f.tokens);
    for (int r = 0; r < NL; r++) kvr_kv_log_free(L[r]);
    free(L);
    return rc;
}

int kvr_session_truncate(struct kvr_session * d, int n) {
    if (d->swap.out) return kvr_error(KVR_ERR_ARG, "truncate: the cache is swapped out (kvr_session_kv_swap_in first)");
    if (n < 0 || n > d->n_past) return kvr_error(KVR_ERR_ARG, "truncate: %d tokens, but the cache holds %d", n, d->n_past);
    if (n == d->n_past) return KVR_OK;
    if (n > 0 && d->m->hp.n_recurrent > 0) {
        // a recurrent layer keeps the state after the last token only: no earlier one is known
        return kvr_error(KVR_ERR_UNSUPP, "truncate: %s's %u recurrent layers keep their state after the last of the %d tokens only; "
                         "the cache can keep all of them or none, not %d", d->m->hp.arch_name, d->m->hp.n_recurrent, d->n_past, n);
    }
    if (d->layout == LAYOUT_RING && d->n_local != d->n_ranks) {
        return kvr_error(KVR_ERR_UNSUPP, "truncate: a ring cache spread over processes (every process would need every shard's rows)");
    }
    replog_restart(d); // the next eval's logs start with what is kept
    // a rank's rows are in increasing positions: the ones kept are a prefix
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        int k = 0;
        while (k < dr->n_rows && dr->cache_pos[k] < n) k++;
        dr->n_rows = k;
        if (d->layout == LAYOUT_RING) d->rows[dr->rank] = k;
    }
    if (d->layout == LAYOUT_CHAIN) {
        for (int r = 0; r < d->n_ranks; r++) d->rows[r] = d->rows[r] < n ? d->rows[r] : n;
    }
    d->n_past = n;
    d->has_logits = false;
    replicas_seed_all(d); // a replica's chunks end where the ranks' rows now end
    return KVR_OK;
}

int kvr_session_write_trace(const struct kvr_session * d, const char * path) {
    struct kvr_file * kf;
    if (kvr_file_create(&kf, path) != KVR_OK) return KVR_ERR_IO;
    FILE * f = kvr_file_stream(kf);
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    bool first = true;
    for (int i = 0; i < d->n_local; i++) {
        const struct dist_rank * dr = &d->ranks[i];
        fprintf(f, "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"name\":\"rank %d\"}}",
                first ? "" : ",\n", dr->rank, dr->rank);
        first = false;
        for (int k = 0; k < dr->n_spans; k++) {
            const struct kvr_span * s = &dr->spans[k];
            fprintf(f, ",\n{\"name\":\"");
            for (const char * c = s->name; *c; c++) { // names are ours, but keep the JSON valid
                if (*c == '"' || *c == '\\') fputc('\\', f);
                fputc(*c, f);
            }
            fprintf(f, "\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}",
                    s->cat == 'c' ? "comm" : "compute", dr->rank, s->t0 * 1e3, (s->t1 - s->t0) * 1e3);
        }
    }
    fprintf(f, "\n]}\n");
    return kvr_file_commit(kf) != KVR_OK ? KVR_ERR_IO : KVR_OK;
}

//
// swapping the caches out of the backends' memory and back (a server's idle conversations)
//

bool kvr_session_kv_swapped(const struct kvr_session * d) { return d->swap.out; }

static void swap_drop(struct kvr_session * d) {
    const int n = d->n_local * (int)d->m->hp.n_layer;
    for (int i = 0; d->swap.k && i < n; i++) {
        free(d->swap.k[i]);
        free(d->swap.v[i]);
    }
    free(d->swap.k);
    free(d->swap.v);
    for (int i = 0; d->swap.state && i < d->n_local; i++) free(d->swap.state[i]);
    free(d->swap.state);
    if (d->swap.path) remove(d->swap.path);
    free(d->swap.path);
    memset(&d->swap, 0, sizeof(d->swap));
}

int kvr_session_kv_swap_out(struct kvr_session * d, const char * path) {
    if (d->swap.out) return kvr_error(KVR_ERR_ARG, "swap out: the cache is swapped out already");
    const int n_layer = (int)d->m->hp.n_layer;
    if (path) {
        // the file of kvr_session_kv_save, read back by kvr_session_kv_load
        if (d->n_local != d->n_ranks) {
            return kvr_error(KVR_ERR_UNSUPP, "swap out to %s: ranks in other processes would each need the file; swap to host memory "
                             "(no path)", path);
        }
        const int rc = kvr_session_kv_save(d, path, false);
        if (rc != KVR_OK) return rc;
        d->swap.path = malloc(strlen(path) + 1);
        KVR_ASSERT(d->swap.path != NULL);
        strcpy(d->swap.path, path);
    } else {
        d->swap.k = calloc((size_t)(d->n_local * n_layer), sizeof(void *));
        d->swap.v = calloc((size_t)(d->n_local * n_layer), sizeof(void *));
        KVR_ASSERT(d->swap.k && d->swap.v);
        for (int i = 0; i < d->n_local; i++) {
            const struct dist_rank * dr = &d->ranks[i];
            const size_t bk = dr->cache->row_k * (size_t)dr->n_rows, bv = dr->cache->row_v * (size_t)dr->n_rows;
            for (int il = 0; il < n_layer; il++) {
                if (!dr->cache->k[il]) continue; // recurrent: its state below
                void ** k = &d->swap.k[i * n_layer + il], ** v = &d->swap.v[i * n_layer + il];
                *k = malloc(bk ? bk : 1);
                *v = malloc(bv ? bv : 1);
                if (!*k || !*v) {
                    swap_drop(d);
                    return kvr_error(KVR_ERR_NOMEM, "swap out: cannot allocate %zu MiB of host memory for rank %d's cache",
                                     ((bk + bv) * (size_t)n_layer) >> 20, dr->rank);
                }
                kvr_kv_cache_get_rows(dr->be, dr->cache, il, 0, dr->n_rows, *k, *v);
            }
        }
        if (d->m->hp.n_recurrent > 0) {
            d->swap.state = calloc((size_t)d->n_local, sizeof(float *));
            KVR_ASSERT(d->swap.state != NULL);
            for (int i = 0; i < d->n_local; i++) {
                d->swap.state[i] = malloc(sizeof(float) * states_floats(d));
                if (!d->swap.state[i]) {
                    swap_drop(d);
                    return kvr_error(KVR_ERR_NOMEM, "swap out: cannot allocate host memory for rank %d's recurrent states", d->ranks[i].rank);
                }
                states_get(&d->ranks[i], d->swap.state[i]);
            }
        }
    }
    for (int i = 0; i < d->n_local; i++) {
        kvr_kv_cache_free(d->ranks[i].cache);
        d->ranks[i].cache = NULL;
    }
    d->swap.out = true;
    return KVR_OK;
}

int kvr_session_kv_swap_in(struct kvr_session * d) {
    if (!d->swap.out) return kvr_error(KVR_ERR_ARG, "swap in: the cache is not swapped out");
    const int n_layer = (int)d->m->hp.n_layer;
    for (int i = 0; i < d->n_local; i++) {
        struct dist_rank * dr = &d->ranks[i];
        const int cap = dr->n_rows > RANK_CACHE_MIN ? dr->n_rows : RANK_CACHE_MIN; // grows again as needed
        dr->cache = kvr_kv_cache_new(&d->m->hp, cap < d->n_ctx ? cap : d->n_ctx, d->type_k, d->type_v, dr->be);
        if (!dr->cache) { // still swapped out: nothing is lost, another try may find the memory
            for (int j = 0; j < i; j++) {
                kvr_kv_cache_free(d->ranks[j].cache);
                d->ranks[j].cache = NULL;
            }
            return KVR_ERR_NOMEM;
        }
    }
    int rc = KVR_OK;
    d->swap.out = false;
    if (d->swap.path) {
        // it must still hold this conversation (its first file is read for that before the load,
        // which checks every file whole as any cache file and changes nothing on an error)
        const char * first = d->swap.path;
        struct kvr_kv_file * f;
        rc = kvr_kv_file_read(first, d->m, &f);
        if (rc == KVR_OK) {
            if (f->n_tokens != d->n_past || memcmp(f->tokens, d->seq, sizeof(int32_t) * (size_t)d->n_past) != 0) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s: the swap file holds %d other tokens than the %d of the cache swapped out",
                               first, f->n_tokens, d->n_past);
            }
            kvr_kv_file_free(f);
        }
        if (rc == KVR_OK) rc = kvr_session_kv_load(d, d->swap.path);
    } else {
        for (int i = 0; i < d->n_local; i++) {
            struct dist_rank * dr = &d->ranks[i];
            for (int il = 0; il < n_layer; il++) {
                if (!dr->cache->k[il]) continue;
                kvr_kv_cache_set_rows(dr->be, dr->cache, il, 0, dr->n_rows, d->swap.k[i * n_layer + il], d->swap.v[i * n_layer + il]);
            }
            if (d->swap.state) states_set(dr, d->swap.state[i]);
        }
    }
    if (rc != KVR_OK) { // still swapped out: the file stays for another try
        for (int i = 0; i < d->n_local; i++) {
            kvr_kv_cache_free(d->ranks[i].cache);
            d->ranks[i].cache = NULL;
        }
        d->swap.out = true;
        return rc;
    }
    swap_drop(d);
    return KVR_OK;
}
