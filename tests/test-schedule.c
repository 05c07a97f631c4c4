// tests/test-schedule.c - the transfer schedule every transport runs (kvr.h: struct
// kvr_schedule): which send pairs with which receive, in which group, in which order. The NCCL
// transport is a thin mapping of it (a group between ncclGroupStart and ncclGroupEnd, operations
// paired by order), so what is checked here over the local transport is what a GPU run relies on.
//
// For every strategy (tsp, kvr even and uneven, ring-kv, ring-q, auto) on 2, 3 and 4 ranks, a
// prefill, a second turn and decode steps run over the local transport (threads of this process)
// and every rank's schedule of each eval is checked:
//
//   pairing   the k-th send from a to b and the k-th receive on b from a have the same tag and
//             size, for every pair (NCCL matches by order, not by tag), and the local transport,
//             which matches by tag, delivered exactly those pairs
//   groups    a ring step's send to the next rank and receive from the previous one are in one
//             group; a KV-Runahead rank's sends of layer l and its receives of layer l+1 are in
//             one group; a collective is one group with a send to and a receive from every peer
//   issue     a group is issued no earlier than the nodes its sends read, no later than the
//             nodes that wait for its receives, and groups are issued in order
//   progress  the ranks' schedules simulated together, each rank's groups one after another, an
//             operation completing only when its partner is in the peer's current group (a send
//             blocks until it is received: the strictest reading of NCCL and MPI): every group
//             of every rank completes, so no rank waits on a receive whose send is queued after a
//             blocking call of the peer
//
// and mutations must be caught: ring groups split into a send group and a receive group
// deadlock in the simulation; two sends to one peer swapped break the pairing; the chain's
// groups split break the grouping check. Every group's receives are of one layer (a wait is for
// what the next node needs, not for later layers).
//
// usage: test-schedule [SHARED_DIR (default ../shared)] [-v] [-p]
//   -v  one line per eval and the reason each mutation was caught
//   -p  print every rank's schedule of every eval
// Prints "schedule: N passed, M failed" (", K skipped"); exits 1 on a failure.

#define KVR_BUILD // kvr.h's internal part: transfer schedules
#include "kvr.h"
#include "tests/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool print; // -p

//
// copies of schedules (a mutation edits a copy; the session keeps its own until the next eval)
//

static struct kvr_schedule sched_copy(const struct kvr_schedule * s) {
    struct kvr_schedule c = *s;
    c.x = malloc(sizeof(*c.x) * (size_t)(s->n + 1));
    c.groups = malloc(sizeof(*c.groups) * (size_t)(2 * s->n_groups + 1)); // room for splitting every group
    c.nodes = malloc(sizeof(*c.nodes) * (size_t)(s->n_nodes + 1));
    c.node_first = malloc(sizeof(int) * (size_t)(s->n_nodes + 1));
    if (!c.x || !c.groups || !c.nodes || !c.node_first) { fprintf(stderr, "out of memory\n"); exit(1); }
    memcpy(c.x, s->x, sizeof(*c.x) * (size_t)s->n);
    memcpy(c.groups, s->groups, sizeof(*c.groups) * (size_t)s->n_groups);
    memcpy(c.nodes, s->nodes, sizeof(*c.nodes) * (size_t)s->n_nodes);
    memcpy(c.node_first, s->node_first, sizeof(int) * (size_t)(s->n_nodes + 1));
    return c;
}

//
// the checks; each returns false with a reason instead of counting, so mutations can use them
//

// partner[r][i]: the (rank, index) the i-th transfer of rank r pairs with by order (-1: none)
struct pairing { int * rank[KVR_TUNE_MAX_RANKS]; int * index[KVR_TUNE_MAX_RANKS]; };

static void pairing_free(struct pairing * p, int N) {
    for (int r = 0; r < N; r++) { free(p->rank[r]); free(p->index[r]); }
}

static bool check_pairing(const struct kvr_schedule * s, int N, struct pairing * p, char * why, size_t cap) {
    for (int r = 0; r < N; r++) {
        p->rank[r] = malloc(sizeof(int) * (size_t)(s[r].n + 1));
        p->index[r] = malloc(sizeof(int) * (size_t)(s[r].n + 1));
        for (int i = 0; i < s[r].n; i++) p->rank[r][i] = p->index[r][i] = -1;
    }
    for (int a = 0; a < N; a++) {
        for (int b = 0; b < N; b++) {
            if (a == b) continue;
            int i = 0, j = 0;
            for (;;) { // the next send a -> b and the next receive on b from a
                while (i < s[a].n && !(s[a].x[i].send && s[a].x[i].peer == b)) i++;
                while (j < s[b].n && !(!s[b].x[j].send && s[b].x[j].peer == a)) j++;
                if (i == s[a].n && j == s[b].n) break;
                if (i == s[a].n || j == s[b].n) {
                    snprintf(why, cap, "rank %d sends rank %d a transfer more or fewer than rank %d receives from it", a, b, b);
                    return false;
                }
                const struct kvr_xfer * x = &s[a].x[i], * y = &s[b].x[j];
                if (x->tag != y->tag || x->bytes != y->bytes) {
                    snprintf(why, cap, "rank %d's send #%d to rank %d (%s l%d s%d, %lld B) meets rank %d's receive #%d (%s l%d s%d, %lld B)",
                             a, i, b, kvr_tag_kind_name(kvr_tag_kind(x->tag)), kvr_tag_layer(x->tag), kvr_tag_step(x->tag),
                             (long long)x->bytes, b, j, kvr_tag_kind_name(kvr_tag_kind(y->tag)), kvr_tag_layer(y->tag),
                             kvr_tag_step(y->tag), (long long)y->bytes);
                    return false;
                }
                p->rank[a][i] = b; p->index[a][i] = j;
                p->rank[b][j] = a; p->index[b][j] = i;
                i++; j++;
            }
        }
    }
    return true;
}

// what the local transport did (it matches by tag) is what order pairing says
static bool check_matches(const struct kvr_schedule * s, int N, const struct pairing * p, char * why, size_t cap) {
    for (int r = 0; r < N; r++) {
        for (int i = 0; i < s[r].n; i++) {
            const struct kvr_xfer * x = &s[r].x[i];
            if (x->match_rank != p->rank[r][i] || x->match_index != p->index[r][i]) {
                snprintf(why, cap, "rank %d's transfer #%d (%s %s l%d) was delivered with rank %d's #%d, order pairs it with rank %d's #%d",
                         r, i, x->send ? "send" : "recv", kvr_tag_kind_name(kvr_tag_kind(x->tag)), kvr_tag_layer(x->tag),
                         x->match_rank, x->match_index, p->rank[r][i], p->index[r][i]);
                return false;
            }
        }
    }
    return true;
}

static bool check_issue(const struct kvr_schedule * s, char * why, size_t cap) {
    int prev = -1;
    for (int g = 0; g < s->n_groups; g++) {
        const struct kvr_xfer_group * gr = &s->groups[g];
        if (gr->issue < prev) {
            snprintf(why, cap, "rank %d: group %d is issued at node %d, before group %d (node %d)", s->rank, g, gr->issue, g - 1, prev);
            return false;
        }
        prev = gr->issue;
        for (int i = gr->first; i < gr->first + gr->n; i++) {
            const struct kvr_xfer * x = &s->x[i];
            const bool coll = s->nodes[x->node].op == KVR_OP_ALL_GATHER || s->nodes[x->node].op == KVR_OP_ALL_TO_ALL;
            if (x->group != g) { snprintf(why, cap, "rank %d: transfer %d says group %d, sits in %d", s->rank, i, x->group, g); return false; }
            if (x->send && x->node > gr->issue) {
                snprintf(why, cap, "rank %d: group %d sends node %d's data at node %d, before it exists", s->rank, g, x->node, gr->issue);
                return false;
            }
            if (!x->send && (coll ? x->node < gr->issue : x->node <= gr->issue)) {
                snprintf(why, cap, "rank %d: group %d posts node %d's receive at node %d, after it is waited for", s->rank, g, x->node, gr->issue);
                return false;
            }
        }
    }
    return true;
}

// the groups each strategy promises
static bool check_groups(const struct kvr_schedule * s, enum kvr_strategy strat, bool decode, char * why, size_t cap) {
    const int me = s->rank, N = s->n_ranks, next = (me + 1) % N, prev = (me + N - 1) % N;
    // a group's receives are of one layer: a wait for one of them is no longer than it needs to be
    for (int g = 0; g < s->n_groups; g++) {
        int layer = -1;
        for (int i = s->groups[g].first; i < s->groups[g].first + s->groups[g].n; i++) {
            const struct kvr_xfer * x = &s->x[i];
            if (x->send) continue;
            if (layer >= 0 && kvr_tag_layer(x->tag) != layer) {
                snprintf(why, cap, "rank %d: group %d receives layers %d and %d", me, g, layer, kvr_tag_layer(x->tag));
                return false;
            }
            layer = kvr_tag_layer(x->tag);
        }
    }
    for (int i = 0; i < s->n; i++) {
        const struct kvr_xfer * x = &s->x[i];
        const enum kvr_op op = s->nodes[x->node].op;
        if (op == KVR_OP_ALL_GATHER || op == KVR_OP_ALL_TO_ALL) {
            // one group: the node's transfers and nothing else, a send and a receive per peer
            const struct kvr_xfer_group * g = &s->groups[x->group];
            int sends[KVR_TUNE_MAX_RANKS] = { 0 }, recvs[KVR_TUNE_MAX_RANKS] = { 0 };
            for (int j = g->first; j < g->first + g->n; j++) {
                if (s->x[j].node != x->node) { snprintf(why, cap, "rank %d: collective node %d shares group %d", me, x->node, x->group); return false; }
                (s->x[j].send ? sends : recvs)[s->x[j].peer]++;
            }
            for (int q = 0; q < N; q++) {
                if (q != me && (sends[q] != 1 || recvs[q] != 1)) {
                    snprintf(why, cap, "rank %d: collective group %d has %d sends to and %d receives from rank %d", me, x->group, sends[q], recvs[q], q);
                    return false;
                }
            }
            continue;
        }
        if (!x->send) continue;
        const int kind = kvr_tag_kind(x->tag), layer = kvr_tag_layer(x->tag), step = kvr_tag_step(x->tag);
        int want_tag = -1, want_peer = -1;
        if ((strat == KVR_STRATEGY_RING_KV || strat == KVR_STRATEGY_RING_Q) && !decode) {
            // a ring step: the receive of the same step from the previous rank
            if (x->peer != next) { snprintf(why, cap, "rank %d: ring send to %d, not the next rank %d", me, x->peer, next); return false; }
            want_tag = x->tag;
            want_peer = prev;
        } else if (strat == KVR_STRATEGY_KVR && me > 0 && kind == KVR_TAG_K) {
            // the chain: the receive of the next layer, when this rank receives one
            want_tag = kvr_tag(layer + 1, KVR_TAG_K, step);
            want_peer = prev;
            bool any = false;
            for (int j = 0; j < s->n; j++) any |= !s->x[j].send && s->x[j].tag == want_tag && s->x[j].peer == prev;
            if (!any) continue;
        } else {
            continue;
        }
        bool together = false;
        const struct kvr_xfer_group * g = &s->groups[x->group];
        for (int j = g->first; j < g->first + g->n; j++) {
            together |= !s->x[j].send && s->x[j].tag == want_tag && s->x[j].peer == want_peer;
        }
        if (!together) {
            snprintf(why, cap, "rank %d: the send of %s l%d s%d to rank %d is not in one group with the receive of %s l%d s%d from rank %d",
                     me, kvr_tag_kind_name(kind), layer, step, x->peer, kvr_tag_kind_name(kvr_tag_kind(want_tag)),
                     kvr_tag_layer(want_tag), kvr_tag_step(want_tag), want_peer);
            return false;
        }
    }
    return true;
}

// Every rank runs its groups one after another; an operation completes when its partner sits in
// the partner rank's current group; a group is done when all its operations are. Does every
// rank get through all its groups?
static bool simulate(const struct kvr_schedule * s, int N, const struct pairing * p, char * why, size_t cap) {
    int cur[KVR_TUNE_MAX_RANKS] = { 0 };
    bool * done[KVR_TUNE_MAX_RANKS];
    for (int r = 0; r < N; r++) done[r] = calloc((size_t)s[r].n + 1, 1);
    bool progress = true;
    while (progress) {
        progress = false;
        for (int r = 0; r < N; r++) {
            if (cur[r] == s[r].n_groups) continue;
            const struct kvr_xfer_group * g = &s[r].groups[cur[r]];
            bool all = true;
            for (int i = g->first; i < g->first + g->n; i++) {
                if (done[r][i]) continue;
                const int q = p->rank[r][i], j = p->index[r][i];
                if (q >= 0 && cur[q] < s[q].n_groups && s[q].x[j].group == cur[q]) {
                    done[r][i] = done[q][j] = true;
                    progress = true;
                } else {
                    all = false;
                }
            }
            if (all) { cur[r]++; progress = true; }
        }
    }
    bool ok = true;
    size_t n = 0;
    for (int r = 0; r < N; r++) {
        if (cur[r] == s[r].n_groups) continue;
        const struct kvr_xfer_group * g = &s[r].groups[cur[r]];
        int i = g->first;
        while (i < g->first + g->n && done[r][i]) i++;
        const struct kvr_xfer * x = &s[r].x[i];
        if (n < cap) n += (size_t)snprintf(why + n, cap - n, "%srank %d stuck in group %d/%d on %s %s l%d s%d %s %d", ok ? "" : "; ", r, cur[r],
                                           s[r].n_groups, x->send ? "send" : "recv", kvr_tag_kind_name(kvr_tag_kind(x->tag)),
                                           kvr_tag_layer(x->tag), kvr_tag_step(x->tag), x->send ? "to" : "from", x->peer);
        ok = false;
    }
    for (int r = 0; r < N; r++) free(done[r]);
    return ok;
}

//
// mutations
//

// every group with sends and receives becomes a group of its sends, then one of its receives
static void split_groups(struct kvr_schedule * s) {
    struct kvr_xfer_group * out = malloc(sizeof(*out) * (size_t)(2 * s->n_groups + 1));
    int n = 0;
    for (int g = 0; g < s->n_groups; g++) {
        const struct kvr_xfer_group gr = s->groups[g];
        int ns = 0; // sends come first in a group the rules make (the send run, then the receives)
        while (ns < gr.n && s->x[gr.first + ns].send) ns++;
        const bool split = ns > 0 && ns < gr.n && s->nodes[s->x[gr.first].node].op == KVR_OP_SEND;
        if (split) out[n++] = (struct kvr_xfer_group) { gr.first, ns, gr.issue };
        out[n++] = split ? (struct kvr_xfer_group) { gr.first + ns, gr.n - ns, gr.issue } : gr;
    }
    for (int g = 0; g < n; g++) {
        for (int i = out[g].first; i < out[g].first + out[g].n; i++) s->x[i].group = g;
    }
    memcpy(s->groups, out, sizeof(*out) * (size_t)n);
    s->n_groups = n;
    free(out);
}

// two sends to one peer with different tags swap places; false if there are none
static bool swap_sends(struct kvr_schedule * s) {
    for (int i = 0; i + 1 < s->n; i++) {
        struct kvr_xfer * a = &s->x[i], * b = &s->x[i + 1];
        if (a->send && b->send && a->peer == b->peer && a->tag != b->tag && a->bytes > 0 && b->bytes > 0) {
            const struct kvr_xfer t = *a;
            *a = *b;
            *b = t;
            a->group = b->group; // they shared a group; keep the groups as they were
            return true;
        }
    }
    return false;
}

//
// the cases
//

static void check_eval(struct kvr_session * d, enum kvr_strategy strat, bool decode, const char * what) {
    const int N = kvr_session_n_ranks(d);
    struct kvr_schedule s[KVR_TUNE_MAX_RANKS];
    int n_xfers = 0;
    if (strat == KVR_STRATEGY_SINGLE) { // the last rank computes alone; the others ran nothing
        for (int r = 0; r < N; r++) {
            const struct kvr_schedule * sr = kvr_session_schedule(d, r);
            CHECK((sr != NULL) == (r == N - 1), "%s: rank %d %s a schedule", what, r, sr ? "has" : "has no");
            if (sr) n_xfers += sr->n;
        }
        CHECK(n_xfers == 0, "%s: one rank computes, yet %d transfers are scheduled", what, n_xfers);
        return;
    }
    for (int r = 0; r < N; r++) {
        const struct kvr_schedule * sr = kvr_session_schedule(d, r);
        CHECK(sr != NULL && sr->rank == r && sr->n_ranks == N, "%s: rank %d has no schedule", what, r);
        if (!sr) return;
        s[r] = *sr;
        n_xfers += sr->n;
        if (print) {
            printf("%s, %s:\n", g_case, what);
            kvr_schedule_print(sr, stdout);
        }
    }
    CHECK(n_xfers > 0, "%s: no transfers scheduled", what);
    char why[1024] = "";
    struct pairing p;
    memset(&p, 0, sizeof(p));
    const bool paired = check_pairing(s, N, &p, why, sizeof(why));
    CHECK(paired, "%s: pairing: %s", what, why);
    if (paired) {
        bool ok = check_matches(s, N, &p, why, sizeof(why));
        CHECK(ok, "%s: local transport: %s", what, why);
        ok = simulate(s, N, &p, why, sizeof(why));
        CHECK(ok, "%s: progress: %s", what, why);
    }
    for (int r = 0; r < N; r++) {
        bool ok = check_issue(&s[r], why, sizeof(why));
        CHECK(ok, "%s: issue: %s", what, why);
        ok = check_groups(&s[r], strat, decode, why, sizeof(why));
        CHECK(ok, "%s: groups: %s", what, why);
    }
    pairing_free(&p, N);

    // mutations: each must be caught by a check that passed above
    struct kvr_schedule m[KVR_TUNE_MAX_RANKS];
    const bool ring = (strat == KVR_STRATEGY_RING_KV || strat == KVR_STRATEGY_RING_Q) && !decode;
    if (ring || strat == KVR_STRATEGY_KVR) {
        for (int r = 0; r < N; r++) { m[r] = sched_copy(&s[r]); split_groups(&m[r]); }
        memset(&p, 0, sizeof(p));
        bool caught;
        if (ring) { // a ring whose steps send before they receive deadlocks
            caught = check_pairing(m, N, &p, why, sizeof(why)) && !simulate(m, N, &p, why, sizeof(why));
            CHECK(caught, "%s: ring groups split into send and receive groups, yet the simulation progressed", what);
        } else { // the chain still progresses, but its sends and next receives no longer share a group
            caught = false;
            for (int r = 1; r < N - 1; r++) caught |= !check_groups(&m[r], strat, decode, why, sizeof(why));
            if (N > 2) CHECK(caught, "%s: the chain's groups split, yet the grouping check passed", what);
        }
        if (verbose && caught) printf("  mutation caught (%s): %s\n", what, why);
        pairing_free(&p, N);
        for (int r = 0; r < N; r++) kvr_schedule_free(&m[r]);
    }
    for (int r = 0; r < N; r++) m[r] = sched_copy(&s[r]);
    bool swapped = false;
    for (int r = 0; r < N && !swapped; r++) swapped = swap_sends(&m[r]);
    if (swapped) {
        memset(&p, 0, sizeof(p));
        const bool caught = !check_pairing(m, N, &p, why, sizeof(why));
        CHECK(caught, "%s: two sends to one peer swapped, yet the pairing check passed", what);
        if (verbose && caught) printf("  mutation caught (%s): %s\n", what, why);
        pairing_free(&p, N);
    }
    for (int r = 0; r < N; r++) kvr_schedule_free(&m[r]);
    if (verbose) {
        int groups = 0;
        for (int r = 0; r < N; r++) groups += s[r].n_groups;
        printf("ok   %s: %d transfers in %d groups\n", what, n_xfers, groups);
    }
}

int main(int argc, char ** argv) {
    const char * shared = "../shared";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) verbose = true;
        else if (!strcmp(argv[i], "-p")) print = true;
        else shared = argv[i];
    }
    char path[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared);
    struct kvr_model * model = kvr_model_load(path, NULL);
    if (!model) {
        skip("%s: %s", path, kvr_last_error());
        return check_summary("schedule");
    }
    const int V = (int)model->hp.n_vocab;
    enum { T0 = 37, T1 = 9, N_DEC = 2 };
    int32_t toks[T0 + T1 + N_DEC];
    uint64_t st = 0x5eed;
    for (int i = 0; i < T0 + T1 + N_DEC; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        toks[i] = 1 + (int32_t)((st >> 33) % (uint64_t)(V - 1));
    }
    const enum kvr_strategy strats[] = { KVR_STRATEGY_TSP, KVR_STRATEGY_KVR, KVR_STRATEGY_KVR, KVR_STRATEGY_RING_KV,
                                         KVR_STRATEGY_RING_Q, KVR_STRATEGY_AUTO };
    for (int N = 2; N <= 4; N++) {
        for (size_t si = 0; si < sizeof(strats) / sizeof(strats[0]); si++) {
            const enum kvr_strategy strat = strats[si];
            const bool uneven = strat == KVR_STRATEGY_KVR && si == 2;
            int part[4] = { 0 };
            if (uneven) { // a head-heavy split with an empty slice in the middle
                part[0] = T0 / 2;
                for (int r = 2; r < N; r++) part[r] = (T0 - part[0]) / (N - 1);
                part[1] = 0;
                int sum = 0;
                for (int r = 0; r < N; r++) sum += part[r];
                part[N - 1] += T0 - sum;
            }
            struct kvr_session_params dp = { .strategy = strat, .comm = KVR_COMM_LOCAL, .n_ranks = N, .n_threads = 1, .n_ctx = 128,
                                          .timeout_s = 30.0, .partition = uneven ? part : NULL };
            snprintf(g_case, sizeof(g_case), "%s%s, %d ranks", kvr_strategy_name(strat), uneven ? " (uneven)" : "", N);
            struct kvr_session * d = kvr_session_new(model, &dp);
            CHECK(d != NULL, "kvr_session_new: %s", kvr_last_error());
            if (!d) continue;
            const char * what[3] = { "prefill", "second turn", "decode" };
            const int n[3] = { T0, T1, 1 };
            int at = 0;
            for (int e = 0; e < 3 + N_DEC - 1; e++) {
                const int k = e < 3 ? e : 2;
                const float * lg = kvr_session_eval(d, toks + at, n[k]);
                CHECK(lg != NULL, "%s: %s", what[k], kvr_last_error());
                if (!lg) break;
                at += n[k];
                const enum kvr_strategy ran = kvr_session_last_strategy(d);
                check_eval(d, ran, k == 2 && ran == KVR_STRATEGY_RING_Q, what[k]); // a ring's decode: all-gathers
            }
            kvr_session_free(d);
        }
    }
    kvr_model_free(model);
    return check_summary("schedule");
}
