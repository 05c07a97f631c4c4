// tests/test-tune.c - the tuning module (kvr-tune.c): the partition search finds the known optimum
// of synthetic objectives within one minimum stride, partition tables round-trip and interpolate
// as the paper's example does (8k and 12k breakdowns -> 10k gives their average), profiles and
// presets load and reject bad input with a message, the simulator keeps the papers' invariants,
// and its per-rank counters equal those of a real kvr_session prefill of the same plan
// (stories260K from SHARED_DIR/models; skipped, never passed, when the file is missing).
//
// usage: test-tune [SHARED_DIR]      (default ../shared)
// Prints a line per failed check (-v: every check) and "tune: N passed, M failed[, K skipped]".

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"
#include "tests/check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// a scratch file path under $TMPDIR (or /tmp), removed at the end
static char g_tmp[8][512];
static int  g_n_tmp;
static const char * tmp_path(const char * tag) {
    const char * dir = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof(tmpl), "%s/test-tune-%s-XXXXXX", dir && *dir ? dir : "/tmp", tag);
    int fd = mkstemp(tmpl);
    if (fd < 0) return NULL;
    close(fd);
    char * p = g_tmp[g_n_tmp++ % 8];
    snprintf(p, 512, "%s", tmpl);
    return p;
}

static void write_file(const char * path, const char * text) {
    FILE * f = fopen(path, "w");
    if (f) { fputs(text, f); fclose(f); }
}

//
// search on synthetic objectives
//

struct synth {
    int    kind;          // 0: bowl around target boundaries; 1: max_r w_r*c_r; 2: max_r (b_r^2 - b_{r-1}^2)
    int    T;
    double target[KVR_TUNE_MAX_RANKS + 1]; // bowl: boundaries b_1..b_{N-1}
    double w[KVR_TUNE_MAX_RANKS];
    int    evals;
};

static double synth_obj(const int * c, int n, void * user) {
    struct synth * s = user;
    s->evals++;
    double v = 0.0, b = 0.0, prev = 0.0;
    for (int r = 0; r < n; r++) {
        b += c[r];
        switch (s->kind) {
            case 0: if (r < n - 1) v += (b - s->target[r + 1]) * (b - s->target[r + 1]) * (1.0 + 0.3 * r); break;
            case 1: v = fmax(v, s->w[r] * c[r]); break;
            case 2: v = fmax(v, b * b - prev * prev); break;
        }
        prev = b;
    }
    return v;
}

// fails on its fifth call, as a measured prefill whose rank times out would
static double failing_obj(const int * c, int n, void * user) {
    struct synth * s = user;
    if (++s->evals == 5) return kvr_error(KVR_ERR_COMM, "rank 2 fell over");
    return synth_obj(c, n, user);
}

// every boundary of got within tol tokens of want (boundaries b_1..b_{N-1})
static bool near_bounds(const int * got, const double * want, int n, double tol, char * msg, size_t cap) {
    int b = 0, o = 0;
    bool ok = true;
    msg[0] = 0;
    for (int r = 0; r < n - 1; r++) {
        b += got[r];
        if (fabs(b - want[r + 1]) > tol) ok = false;
        o += snprintf(msg + o, cap - (size_t)o, "%s%d/%.1f", r ? " " : "", b, want[r + 1]);
    }
    return ok;
}

// The grid search is local: on a max of pieces where lowering the largest needs every later
// boundary to move by a different amount (the b^2 chain with 5+ ranks), no move of the grid
// improves and it stops short. These cases are ones it must solve; on simulated TTFTs it lands
// within 0.4% of a long random polish (llama-7b, 16k tokens, 4 and 8 ranks).
static void test_search(void) {
    struct { int kind, N, T, stride; } cases[] = {
        { 0, 2, 1000, 1 }, { 0, 2, 1000, 8 }, { 0, 3, 1000, 4 }, { 0, 4, 1000, 4 }, { 0, 5, 2000, 16 },
        { 1, 2, 1200, 1 }, { 1, 2, 1200, 16 }, { 1, 3, 1200, 4 }, { 1, 4, 1200, 4 }, { 1, 4, 12000, 32 },
        { 2, 2, 1000, 1 }, { 2, 3, 3000, 8 }, { 2, 4, 4096, 16 }, { 1, 5, 6000, 16 },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const int N = cases[i].N, T = cases[i].T, S = cases[i].stride;
        struct synth sy = { .kind = cases[i].kind, .T = T };
        double want[KVR_TUNE_MAX_RANKS + 1] = { 0 };
        if (sy.kind == 0) {
            // an off-lattice optimum well away from the even split
            for (int r = 1; r < N; r++) want[r] = sy.target[r] = T * (0.6 * r / N + 0.4 * (double)r * r / ((double)N * N)) + 3.7;
        } else if (sy.kind == 1) {
            // rank r costs w_r per token: the best split gives c_r proportional to 1/w_r
            double inv = 0.0;
            for (int r = 0; r < N; r++) { sy.w[r] = 1.0 + r; inv += 1.0 / sy.w[r]; }
            for (int r = 1; r < N; r++) want[r] = want[r - 1] + T / sy.w[r - 1] / inv;
        } else {
            // equal causal attention work per rank: b_r = T*sqrt(r/N)
            for (int r = 1; r < N; r++) want[r] = T * sqrt((double)r / N);
        }
        struct kvr_tune_search_params p = { .n_ranks = N, .n_tokens = T, .min_stride = S, .objective = synth_obj, .user = &sy };
        struct kvr_tune_search_result res;
        int rc = kvr_tune_search(&p, &res);
        char msg[512] = "";
        const bool ok = rc == KVR_OK && near_bounds(res.counts, want, N, S, msg, sizeof(msg));
        CHECK(ok, "search: %s objective, %d ranks, %d tokens, stride %d: boundaries got/want %s (%lld evaluations)%s%s",
              sy.kind == 0 ? "bowl" : sy.kind == 1 ? "chain w*c" : "chain b^2", N, T, S, msg, (long long)res.n_evals,
              rc ? ": " : "", rc ? kvr_last_error() : "");
        if (rc == KVR_OK) CHECK(res.n_evals == sy.evals, "search: %lld distinct evaluations reported, %d made", (long long)res.n_evals, sy.evals);
    }
    // a start point is honored, and an objective's failure stops the search with its reason
    {
        struct synth sy = { .kind = 1, .T = 1200, .w = { 1, 2, 3, 4 } };
        const int start[4] = { 500, 300, 250, 150 };
        struct kvr_tune_search_params p = { .n_ranks = 4, .n_tokens = 1200, .min_stride = 4, .start = start, .objective = synth_obj, .user = &sy };
        struct kvr_tune_search_result res;
        CHECK(kvr_tune_search(&p, &res) == KVR_OK && abs(res.counts[0] - 576) <= 4 && abs(res.counts[3] - 144) <= 4,
              "search: from a start point: %d %d %d %d (want 576 288 192 144)", res.counts[0], res.counts[1], res.counts[2], res.counts[3]);
        p.objective = failing_obj;
        sy.evals = 0;
        CHECK(kvr_tune_search(&p, &res) == KVR_ERR_ARG && strstr(kvr_last_error(), "objective failed") && strstr(kvr_last_error(), "rank 2 fell over"),
              "search: a failing objective stops it with its reason: %s", kvr_last_error());
    }
    // errors are reported, not asserted
    struct synth sy = { .kind = 0, .T = 3 };
    struct kvr_tune_search_params p = { .n_ranks = 4, .n_tokens = 3, .objective = synth_obj, .user = &sy };
    struct kvr_tune_search_result res;
    CHECK(kvr_tune_search(&p, &res) == KVR_ERR_ARG && strstr(kvr_last_error(), "3 tokens"),
          "search: 3 tokens over 4 ranks is an error: %s", kvr_last_error());
    p = (struct kvr_tune_search_params) { .n_ranks = 12, .n_tokens = 100000, .objective = synth_obj, .user = &sy };
    CHECK(kvr_tune_search(&p, &res) == KVR_ERR_ARG && strstr(kvr_last_error(), "grid"),
          "search: a 5^11 grid is refused up front: %s", kvr_last_error());
}

//
// partition tables
//

static void test_table(void) {
    const char * path = tmp_path("table");
    if (!path) { CHECK(false, "table: no temporary file"); return; }
    struct kvr_tune_table t = { 0 };
    snprintf(t.profile, sizeof(t.profile), "a100-nvlink");
    // the paper's Fig. 10 setting: Llama 7B on 4 GPUs, breakdowns at 8k and 12k whose average is
    // the 10k partition it reports, [0.350, 0.255, 0.210, 0.185]
    const struct kvr_tune_entry e8  = { "llama-7b", 4, 8192,  { 0.330, 0.260, 0.220, 0.190 }, 0.41 };
    const struct kvr_tune_entry e12 = { "llama-7b", 4, 12288, { 0.370, 0.250, 0.200, 0.180 }, 0.76 };
    const struct kvr_tune_entry e2  = { "llama-7b", 2, 8192,  { 0.58, 0.42 }, 0 };
    const struct kvr_tune_entry ef  = { "falcon-7b", 4, 4096, { 0.4, 0.3, 0.2, 0.1 }, 0.21 };
    int rc = kvr_tune_table_add(&t, &e12);
    rc |= kvr_tune_table_add(&t, &ef);
    rc |= kvr_tune_table_add(&t, &e8);
    rc |= kvr_tune_table_add(&t, &e2);
    rc |= kvr_tune_table_add(&t, &e8); // replaces, does not duplicate
    CHECK(rc == KVR_OK && t.n_entries == 4, "table: 4 entries after 5 adds (one replaced): %d", t.n_entries);
    rc = kvr_tune_table_save(&t, path);
    struct kvr_tune_table u = { 0 };
    if (rc == KVR_OK) rc = kvr_tune_table_load(path, &u);
    bool same = rc == KVR_OK && u.n_entries == t.n_entries && !strcmp(u.profile, t.profile);
    for (int i = 0; same && i < t.n_entries; i++) {
        const struct kvr_tune_entry * a = &t.entries[i], * b = &u.entries[i];
        same = !strcmp(a->model, b->model) && a->n_ranks == b->n_ranks && a->n_tokens == b->n_tokens && fabs(a->ttft - b->ttft) < 1e-9;
        for (int r = 0; same && r < a->n_ranks; r++) same = fabs(a->fractions[r] - b->fractions[r]) < 1e-6;
    }
    CHECK(same, "table: save + load round-trips every entry%s%s", rc ? ": " : "", rc ? kvr_last_error() : "");

    double f[KVR_TUNE_MAX_RANKS];
    const double want10[4] = { 0.350, 0.255, 0.210, 0.185 };
    rc = kvr_tune_table_partition(path, "llama-7b", 4, 10240, f);
    bool ok = rc == KVR_OK;
    for (int r = 0; ok && r < 4; r++) ok = fabs(f[r] - want10[r]) < 1e-9;
    CHECK(ok, "table: KVR-P at 10k from 8k and 12k is the paper's [0.350 0.255 0.210 0.185]: [%.4f %.4f %.4f %.4f]",
          f[0], f[1], f[2], f[3]);
    rc = kvr_tune_table_partition(path, "llama-7b", 4, 9216, f); // a quarter of the way
    ok = rc == KVR_OK;
    for (int r = 0; ok && r < 4; r++) ok = fabs(f[r] - (0.75 * e8.fractions[r] + 0.25 * e12.fractions[r])) < 1e-9;
    CHECK(ok, "table: KVR-P at 9k is 3/4 of 8k + 1/4 of 12k");
    rc = kvr_tune_table_partition(path, "llama-7b", 4, 2048, f);
    ok = rc == KVR_OK;
    for (int r = 0; ok && r < 4; r++) ok = fabs(f[r] - e8.fractions[r]) < 1e-9;
    CHECK(ok, "table: below the shortest entry the shortest's partition holds");
    rc = kvr_tune_table_partition(path, "llama-7b", 4, 65536, f);
    ok = rc == KVR_OK;
    for (int r = 0; ok && r < 4; r++) ok = fabs(f[r] - e12.fractions[r]) < 1e-9;
    CHECK(ok, "table: above the longest entry the longest's partition holds");
    rc = kvr_tune_table_partition(path, "llama-7b", 2, 8192, f);
    CHECK(rc == KVR_OK && fabs(f[0] - 0.58) < 1e-9, "table: an exact length returns its entry");
    rc = kvr_tune_table_partition(path, "llama-7b", 8, 8192, f);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "8 ranks") && strstr(kvr_last_error(), "llama-7b/4"),
          "table: a missing rank count names what the table has: %s", kvr_last_error());
    rc = kvr_tune_table_partition(path, NULL, 4, 8192, f);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "several"), "table: no model name with two models is an error: %s", kvr_last_error());
    kvr_tune_table_free(&u);
    kvr_tune_table_free(&t);

    // malformed files: the message names the line
    struct { const char * text; const char * want; } bad[] = {
        { "llama-7b 2 1024 0.5 0.5\n", ":1: expected the header" },
        { "profile x\nllama-7b 2 1024 0.5\n", ":2: field 5" },
        { "profile x\n# comment\nllama-7b 2 1024 0.5 0.6\n", ":3: the fractions add up" },
        { "profile x\nllama-7b two 1024 0.5 0.5\n", ":2: field 2 (ranks)" },
        { "profile x\nllama-7b 2 1024 0.5 0.5 extra\n", ":2: unexpected 'extra'" },
        { "profile x\nm 2 1024 0.5 0.5\nm 2 1024 0.4 0.6\n", ":3: repeats model m, 2 ranks, 1024 tokens of line 2" },
        { "# nothing\n", "no 'profile NAME' header" },
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        write_file(path, bad[i].text);
        struct kvr_tune_table v;
        rc = kvr_tune_table_load(path, &v);
        CHECK(rc == KVR_ERR_FORMAT && strstr(kvr_last_error(), bad[i].want), "table: malformed file %zu rejected: %s", i, kvr_last_error());
    }
    CHECK(kvr_tune_table_partition("/nonexistent/table.txt", "m", 2, 10, f) == KVR_ERR_IO, "table: a missing file is KVR_ERR_IO");
}

//
// profiles and presets
//

static bool same_profile(const struct kvr_tune_profile * a, const struct kvr_tune_profile * b) {
    return !strcmp(a->name, b->name) && a->matmul_flops == b->matmul_flops && a->matmul_eff == b->matmul_eff &&
           a->attn_flops == b->attn_flops && a->attn_eff == b->attn_eff && a->mem_bw == b->mem_bw && a->link_bw == b->link_bw &&
           a->link_latency == b->link_latency && a->links == b->links && a->elem_bytes == b->elem_bytes &&
           a->weight_bytes == b->weight_bytes && a->attn_tile_q == b->attn_tile_q && a->attn_tile_k == b->attn_tile_k && a->attn_tile_group == b->attn_tile_group &&
           a->attn_mode == b->attn_mode && a->layer_overhead == b->layer_overhead && a->attn_pair_s == b->attn_pair_s &&
           a->solo_speedup == b->solo_speedup && a->matmul_weight_s == b->matmul_weight_s;
}

static void test_profiles(void) {
    const char * names[] = { "a100-nvlink", "a100-10g", "h100-nvlink", "cpu" };
    const char * path = tmp_path("profile");
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        struct kvr_tune_profile p, q;
        int rc = kvr_tune_profile_builtin(names[i], &p);
        if (rc == KVR_OK && path) rc = kvr_tune_profile_save(&p, path);
        if (rc == KVR_OK && path) rc = kvr_tune_profile_load(path, &q);
        CHECK(rc == KVR_OK && same_profile(&p, &q), "profile %s: built in, saved and loaded back unchanged", names[i]);
        // the shipped files (tools/profiles/, when the test runs from the project root)
        char ship[256];
        snprintf(ship, sizeof(ship), "tools/profiles/%s.txt", names[i]);
        if (access(ship, R_OK) == 0) {
            rc = kvr_tune_profile_load(ship, &q);
            CHECK(rc == KVR_OK && same_profile(&p, &q), "profile %s: %s equals the built-in", names[i], ship);
        }
    }
    struct kvr_tune_profile p;
    CHECK(kvr_tune_profile_get("v100-nvlink", &p) == KVR_ERR_ARG && strstr(kvr_last_error(), "v100-nvlink"),
          "profile: an unknown name is an error naming it: %s", kvr_last_error());
    if (path) {
        write_file(path, "name x\nmatmul_flops 1e12\nlink_bw fast\n");
        CHECK(kvr_tune_profile_load(path, &p) == KVR_ERR_FORMAT && strstr(kvr_last_error(), ":3: bad value 'fast' for link_bw"),
              "profile: a bad value names line and key: %s", kvr_last_error());
        write_file(path, "name x\nmatmul_flop 1e12\n");
        CHECK(kvr_tune_profile_load(path, &p) == KVR_ERR_FORMAT && strstr(kvr_last_error(), ":2: unknown key 'matmul_flop'"),
              "profile: an unknown key names line and key: %s", kvr_last_error());
        write_file(path, "name x\nmatmul_eff 1.5\n");
        CHECK(kvr_tune_profile_load(path, &p) == KVR_ERR_ARG && strstr(kvr_last_error(), "matmul_eff"),
              "profile: an efficiency above 1 is refused: %s", kvr_last_error());
        write_file(path, "# only a comment\nname slow-net\nlink_bw 1e9\nlink_latency 5e-5\n");
        CHECK(kvr_tune_profile_load(path, &p) == KVR_OK && p.link_bw == 1e9 && p.attn_tile_k == 256 && !strcmp(p.name, "slow-net"),
              "profile: keys not in the file keep the cpu profile's values");
    }

    struct kvr_tune_model m;
    CHECK(kvr_tune_model_preset("llama-7b", &m) == KVR_OK && m.n_layer == 32 && m.n_head_kv == 32 && m.n_ffn_mats == 3,
          "preset llama-7b: 32 layers, MHA");
    CHECK(kvr_tune_model_preset("llama-7b-gqa8", &m) == KVR_OK && m.n_head_kv == 8 && !strcmp(m.name, "llama-7b-gqa8"), "preset llama-7b-gqa8: 8 KV heads");
    CHECK(kvr_tune_model_preset("llama-7b-mqa", &m) == KVR_OK && m.n_head_kv == 1, "preset llama-7b-mqa: 1 KV head");
    CHECK(kvr_tune_model_preset("falcon-7b", &m) == KVR_OK && m.n_head == 71 && m.n_head_kv == 1 && m.n_ffn_mats == 2, "preset falcon-7b: MQA");
    CHECK(kvr_tune_model_preset("tinyllama-1.1b", &m) == KVR_OK && m.n_head_kv == 4, "preset tinyllama-1.1b: GQA 32/4");
    CHECK(kvr_tune_model_preset("llama-7b-gqa5", &m) == KVR_ERR_ARG && strstr(kvr_last_error(), "gqa5"),
          "preset: a KV head count not dividing the heads is refused: %s", kvr_last_error());
    CHECK(kvr_tune_model_preset("gpt-2", &m) == KVR_ERR_ARG && strstr(kvr_last_error(), "gpt-2"), "preset: an unknown name is refused");
}

//
// simulator invariants
//

static void test_sim_model(void) {
    struct kvr_tune_model m;
    struct kvr_tune_profile hw;
    kvr_tune_model_preset("llama-7b", &m);
    kvr_tune_profile_builtin("a100-nvlink", &hw);
    static struct kvr_tune_sim s1, st, se, sk;
    const int C = 16384, p = 4;
    struct kvr_tune_plan pl = { .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 1, .n_tokens = C, .attn_mode = KVR_ATTN_DENSE };
    int rc = kvr_tune_simulate(&m, &hw, &pl, &s1);
    pl = (struct kvr_tune_plan) { .strategy = KVR_STRATEGY_TSP, .n_ranks = p, .n_tokens = C, .attn_mode = KVR_ATTN_DENSE };
    rc |= kvr_tune_simulate(&m, &hw, &pl, &st);
    pl.strategy = KVR_STRATEGY_KVR;
    rc |= kvr_tune_simulate(&m, &hw, &pl, &se);
    CHECK(rc == KVR_OK, "sim: single, tsp, kvr-e of llama-7b 16k on 4 A100s run");
    // the paper's traffic: KV-Runahead moves (p-1)C/2 K/V entries, TSP (p-1)C
    int64_t kvr_rows = 0, tsp_rows = 0;
    for (int r = 0; r < p; r++) { kvr_rows += se.ranks[r].kv_rows_sent; tsp_rows += st.ranks[r].kv_rows_sent; }
    CHECK(kvr_rows == (int64_t)(p - 1) * C && tsp_rows == 2 * (int64_t)(p - 1) * C,
          "sim: K/V rows sent: kvr %lld = (p-1)C, tsp %lld = 2(p-1)C (K and V count one row each)", (long long)kvr_rows, (long long)tsp_rows);
    // dense single-rank attention: the whole C x C rectangle
    CHECK(s1.ranks[0].attn_dot_dense == (int64_t)C * C && s1.ranks[0].attn_dot_causal == (int64_t)C * (C + 1) / 2,
          "sim: single dense attention computes C^2 pairs, needs C(C+1)/2");
    CHECK(s1.ttft > 1.0 && se.ttft < st.ttft && st.ttft < s1.ttft, "sim: 16k on 4 GPUs: single %.2f s > tsp %.2f s > kvr-e %.2f s",
          s1.ttft, st.ttft, se.ttft);
    for (int r = 0; r < p; r++) {
        const struct kvr_tune_rank * R = &se.ranks[r];
        CHECK(fabs(R->compute + R->wait - R->finish) < 1e-9 * R->finish, "sim: kvr rank %d: compute %.4f + wait %.4f = finish %.4f",
              r, R->compute, R->wait, R->finish);
    }
    struct kvr_tune_bounds b;
    rc = kvr_tune_bounds(&m, &hw, p, C, KVR_ATTN_DENSE, 64, &b);
    CHECK(rc == KVR_OK && fabs(b.ttft_star - s1.ttft / 2 * (1.0 / p + 1.0 / (p * p))) < 1e-12,
          "sim: TTFT*(4) = TTFT(1)/2 (1/4 + 1/16) = %.3f s (Eq. 3)", b.ttft_star);
    struct kvr_tune_sim_objective o = { &m, &hw, C, KVR_ATTN_DENSE, KVR_CACHE_F16 };
    struct kvr_tune_search_params sp = { .n_ranks = p, .n_tokens = C, .min_stride = 64, .objective = kvr_tune_objective_sim, .user = &o };
    struct kvr_tune_search_result res;
    rc = kvr_tune_search(&sp, &res);
    CHECK(rc == KVR_OK && res.cost < se.ttft && b.ttft_free <= res.cost + 1e-12 && b.ttft_star <= b.ttft_free,
          "sim: TTFT*(p) %.3f <= TTFT(p) %.3f <= KVR-S %.3f < KVR-E %.3f < TSP %.3f", b.ttft_star, b.ttft_free, res.cost, se.ttft, st.ttft);
    CHECK(res.counts[0] > res.counts[1] && res.counts[1] > res.counts[2] && res.counts[2] > res.counts[3],
          "sim: KVR-S gives earlier ranks more tokens: %d %d %d %d", res.counts[0], res.counts[1], res.counts[2], res.counts[3]);
    // a slower link only makes everything later
    struct kvr_tune_profile slow = hw;
    slow.link_bw = 10e9;
    pl.counts = res.counts;
    rc = kvr_tune_simulate(&m, &slow, &pl, &sk);
    CHECK(rc == KVR_OK && sk.ttft >= res.cost, "sim: the same partition at 10 GB/s: %.3f s >= %.3f s", sk.ttft, res.cost);
    // ranks sharing a machine (solo_speedup s): a rank that computes while the others wait runs
    // s times faster. TSP's even split leaves the earlier ranks idle at every all-gather, so its
    // last rank gains, but by less than s; single (one rank) does not change; the counters do not
    {
        struct kvr_tune_model tm;
        struct kvr_tune_profile cpu, shared;
        kvr_tune_model_preset("tinyllama-1.1b", &tm);
        kvr_tune_profile_builtin("cpu", &cpu);
        shared = cpu;
        shared.solo_speedup = 1.5;
        static struct kvr_tune_sim a, c, one_a, one_c;
        struct kvr_tune_plan tp = { .strategy = KVR_STRATEGY_TSP, .n_ranks = 2, .n_tokens = 8192, .attn_mode = KVR_ATTN_CAUSAL };
        rc = kvr_tune_simulate(&tm, &cpu, &tp, &a) | kvr_tune_simulate(&tm, &shared, &tp, &c);
        CHECK(rc == KVR_OK && c.ttft < a.ttft && c.ttft > a.ttft / 1.5 && c.ranks[0].wait < a.ranks[0].wait,
              "sim: solo_speedup 1.5, tsp 8k on 2 ranks: %.2f s < %.2f s, > %.2f s; rank 0 waits %.2f s < %.2f s", c.ttft, a.ttft,
              a.ttft / 1.5, c.ranks[0].wait, a.ranks[0].wait);
        CHECK(a.ranks[1].attn_dot_dense == c.ranks[1].attn_dot_dense && a.ranks[0].kv_rows_sent == c.ranks[0].kv_rows_sent,
              "sim: solo_speedup changes times, not counters");
        tp = (struct kvr_tune_plan) { .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 1, .n_tokens = 8192, .attn_mode = KVR_ATTN_CAUSAL };
        rc = kvr_tune_simulate(&tm, &cpu, &tp, &one_a) | kvr_tune_simulate(&tm, &shared, &tp, &one_c);
        CHECK(rc == KVR_OK && one_a.ttft == one_c.ttft, "sim: one rank has nobody to share with: %.3f s = %.3f s", one_a.ttft, one_c.ttft);
        // matmul_weight_s is a cost per matmul call, whatever its tokens: single's TTFT grows by
        // the same seconds at 1k and at 8k tokens (each layer's matmuls run once either way)
        struct kvr_tune_profile packing = cpu;
        packing.matmul_weight_s = 1e-10;
        static struct kvr_tune_sim p8, a1, p1;
        tp.n_tokens = 1024;
        rc = kvr_tune_simulate(&tm, &packing, &tp, &p1) | kvr_tune_simulate(&tm, &cpu, &tp, &a1);
        tp.n_tokens = 8192;
        rc |= kvr_tune_simulate(&tm, &packing, &tp, &p8);
        const double d1 = p1.ttft - a1.ttft, d8 = p8.ttft - one_a.ttft;
        CHECK(rc == KVR_OK && d1 > 0 && fabs(d8 - d1) <= 1e-9 * p8.ttft,
              "sim: matmul_weight_s 0.1 ns adds %.6f s at 1k and %.6f s at 8k", d1, d8);
    }
    // the attention share of each rank's compute (what --stats's attn_ms is compared with): twice
    // the attention rate halves it and leaves the rest alone, for the chain (tsp) and the ring
    {
        static struct kvr_tune_sim a[2][2];
        const enum kvr_strategy strat[2] = { KVR_STRATEGY_TSP, KVR_STRATEGY_RING_KV };
        struct kvr_tune_profile fast = hw;
        fast.attn_flops *= 2;
        int rcs = KVR_OK;
        bool ok = true;
        for (int i = 0; i < 2; i++) {
            struct kvr_tune_plan ap = { .strategy = strat[i], .n_ranks = p, .n_tokens = C, .attn_mode = KVR_ATTN_CAUSAL };
            rcs |= kvr_tune_simulate(&m, &hw, &ap, &a[i][0]);
            rcs |= kvr_tune_simulate(&m, &fast, &ap, &a[i][1]);
            for (int r = 0; r < p && rcs == KVR_OK; r++) {
                const struct kvr_tune_rank * x = &a[i][0].ranks[r], * y = &a[i][1].ranks[r];
                ok = ok && x->attn > 0 && x->attn < x->compute && fabs(y->attn - x->attn / 2) <= 1e-9 * x->attn &&
                     fabs((y->compute - y->attn) - (x->compute - x->attn)) <= 1e-9 * x->compute;
            }
        }
        CHECK(rcs == KVR_OK && ok, "sim: per rank, attention is part of compute and scales with 1/attn_flops alone (tsp, ring-kv)");
    }
    // bad plans are errors
    int bad[4] = { 100, 100, 100, 100 };
    pl.counts = bad;
    CHECK(kvr_tune_simulate(&m, &hw, &pl, &sk) == KVR_ERR_ARG && strstr(kvr_last_error(), "add up"),
          "sim: counts that do not add up are refused: %s", kvr_last_error());
    pl = (struct kvr_tune_plan) { .strategy = KVR_STRATEGY_AUTO, .n_ranks = 2, .n_tokens = 100 };
    CHECK(kvr_tune_simulate(&m, &hw, &pl, &sk) == KVR_ERR_ARG, "sim: auto is refused: %s", kvr_last_error());
}

//
// auto's choice prices K/V at the cache's bytes
//

// Algorithm 5 over a slow link (BW 1e8 B/s, C 1e11 FLOP/s, 2 ranks, 8 heads of 8 K/V heads, head
// size 64): pass-KV hides its rows under the attention from T = N*C*NKV*e_kv/(2*NH*BW) = 1000*e_kv
// tokens on; with a long cached prefix (the miss rate rule false) T = 2900 picks pass-Q for an F32
// cache (4000), pass-KV for F16 and BF16 (2000) and Q8_0 (1062.5), pass-Q for f16 K beside f32 V
// (3000). Counted at 4 bytes an element whatever the cache, every one would be pass-Q.
static void test_auto_pick(void) {
    const struct { enum kvr_cache_type k, v; enum kvr_strategy want; double t_min; } cases[] = {
        { KVR_CACHE_F32, KVR_CACHE_F32, KVR_STRATEGY_RING_Q, 4000 }, { KVR_CACHE_F16, KVR_CACHE_F16, KVR_STRATEGY_RING_KV, 2000 },
        { KVR_CACHE_BF16, KVR_CACHE_BF16, KVR_STRATEGY_RING_KV, 2000 }, { KVR_CACHE_Q8_0, KVR_CACHE_Q8_0, KVR_STRATEGY_RING_KV, 1062.5 },
        { KVR_CACHE_F16, KVR_CACHE_F32, KVR_STRATEGY_RING_Q, 3000 },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char why[512], want[64];
        const enum kvr_strategy got = kvr_auto_pick(2900, 100000, 2, 8, 8, 64, cases[i].k, cases[i].v, 1e11, 1e8, why, sizeof(why));
        snprintf(want, sizeof(want), "T=2900 >= %.0f is", cases[i].t_min);
        CHECK(got == cases[i].want && strstr(why, want), "auto with %s K, %s V: %s, %s expected (%s)", kvr_cache_type_name(cases[i].k),
              kvr_cache_type_name(cases[i].v), kvr_strategy_name(got), kvr_strategy_name(cases[i].want), why);
    }
    // the miss-rate rule alone (T = 200 under both types' T_min, 1000 and 265.6, with 2 of 8 K/V
    // heads): pass-KV when T/(T+P) >= 2*NKV*e_kv/(NH*e_q) - 4*T*BW/(N*C*e_q), f32 0.5 - 0.1, q8_0
    // 0.1328 - 0.1; at T/(T+P) = 0.2 f32 passes the queries, q8_0 its rows
    const enum kvr_strategy f32 = kvr_auto_pick(200, 800, 2, 8, 2, 64, KVR_CACHE_F32, KVR_CACHE_F32, 1e11, 1e8, NULL, 0);
    const enum kvr_strategy q8 = kvr_auto_pick(200, 800, 2, 8, 2, 64, KVR_CACHE_Q8_0, KVR_CACHE_Q8_0, 1e11, 1e8, NULL, 0);
    CHECK(f32 == KVR_STRATEGY_RING_Q && q8 == KVR_STRATEGY_RING_KV, "auto at T/(T+P) = 0.2: f32 %s (ring-q expected), q8_0 %s (ring-kv)",
          kvr_strategy_name(f32), kvr_strategy_name(q8));
}

//
// the simulator's counters against a real run
//

static void test_counters(const char * shared, const char * rel, const char * want_name) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", shared, rel);
    if (access(path, R_OK) != 0) {
        skip("%s not found: the simulator-vs-run counter checks are skipped", path);
        return;
    }
    struct kvr_model * model = kvr_model_load(path, NULL);
    if (!model) { CHECK(false, "load %s: %s", path, kvr_last_error()); return; }
    struct kvr_tune_model tm;
    struct kvr_tune_profile hw;
    kvr_tune_profile_builtin("cpu", &hw); // the CPU kernel's tiles
    CHECK(kvr_tune_model_from(model, &tm) == KVR_OK && !strcmp(tm.name, want_name) && tm.n_head_kv == (int)model->hp.n_head_kv,
          "model_from: %s shape and table name '%s'", want_name, tm.name);
    const int T = 500; // crosses the kernel's 64-query and 256-key tiles
    int32_t * tokens = malloc(sizeof(int32_t) * T);
    uint64_t seed = 42;
    for (int i = 0; i < T; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        tokens[i] = (int32_t)((seed >> 33) % model->hp.n_vocab);
    }
    struct { enum kvr_strategy s; int N; const double * frac; } cases[] = {
        { KVR_STRATEGY_TSP, 2, NULL }, { KVR_STRATEGY_TSP, 3, NULL }, { KVR_STRATEGY_TSP, 4, NULL },
        { KVR_STRATEGY_KVR, 2, NULL }, { KVR_STRATEGY_KVR, 3, NULL }, { KVR_STRATEGY_KVR, 4, NULL },
        { KVR_STRATEGY_KVR, 2, (const double[]){ 0.61, 0.39 } },
        { KVR_STRATEGY_KVR, 3, (const double[]){ 0.45, 0.33, 0.22 } },
        { KVR_STRATEGY_KVR, 4, (const double[]){ 0.350, 0.255, 0.210, 0.185 } },
        { KVR_STRATEGY_RING_KV, 2, NULL }, { KVR_STRATEGY_RING_KV, 3, NULL }, { KVR_STRATEGY_RING_Q, 3, NULL },
    };
    for (int mc = 0; mc < 4; mc++) { // both attention modes, with an F16 cache (the default) and an F32 one
        const enum kvr_attn_mode am = (mc & 1) ? KVR_ATTN_DENSE : KVR_ATTN_CAUSAL;
        const enum kvr_cache_type ct = mc >= 2 ? KVR_CACHE_F32 : KVR_CACHE_F16;
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
            const int N = cases[i].N;
            int counts[KVR_TUNE_MAX_RANKS];
            if (cases[i].frac) kvr_tune_counts_from_fractions(cases[i].frac, N, T, counts);
            // the run gets token counts, or (2 and 4 ranks) the fractions themselves, so that its
            // rounding of fractions is checked against kvr_tune_counts_from_fractions
            const bool by_frac = cases[i].frac && N != 3;
            struct kvr_session_params dp = { .strategy = cases[i].s, .n_ranks = N, .n_threads = 1, .n_ctx = T,
                                          .partition = cases[i].frac && !by_frac ? counts : NULL,
                                          .fractions = by_frac ? cases[i].frac : NULL, .attn_mode = am, .timeout_s = 30,
                                          .cache_type_k = ct, .cache_type_v = ct };
            char what[128];
            snprintf(what, sizeof(what), "%s: %s %d ranks %s%s, %s cache", want_name, kvr_strategy_name(cases[i].s), N, am == KVR_ATTN_DENSE ? "dense" : "causal",
                     cases[i].frac ? " uneven" : "", kvr_cache_type_name(ct));
            struct kvr_session * d = kvr_session_new(model, &dp);
            const float * logits = d ? kvr_session_eval(d, tokens, T) : NULL;
            if (!logits) {
                CHECK(false, "counters %s: the real run failed: %s", what, kvr_last_error());
                kvr_session_free(d);
                continue;
            }
            struct kvr_rank_stats st[KVR_TUNE_MAX_RANKS];
            const int n = kvr_session_stats(d, st, KVR_TUNE_MAX_RANKS);
            static struct kvr_tune_sim sim;
            const struct kvr_tune_plan pl = { .strategy = cases[i].s, .n_ranks = N, .n_tokens = T,
                                              .counts = cases[i].frac ? counts : NULL, .attn_mode = am, .cache_type = ct };
            int rc = kvr_tune_simulate(&tm, &hw, &pl, &sim);
            bool ok = rc == KVR_OK && n == N && sim.n_ranks == N;
            char diff[512] = "";
            for (int r = 0; ok && r < N; r++) {
                const struct kvr_rank_stats * a = &st[r];
                const struct kvr_tune_rank * b = &sim.ranks[a->rank];
                ok = a->tokens == b->tokens && a->attn_dot_dense == b->attn_dot_dense && a->attn_dot_causal == b->attn_dot_causal &&
                     a->kv_rows_sent == b->kv_rows_sent && a->kv_rows_recv == b->kv_rows_recv;
                if (!ok) {
                    snprintf(diff, sizeof(diff), ": rank %d run/sim tokens %d/%d dense %lld/%lld causal %lld/%lld sent %lld/%lld recv %lld/%lld",
                             a->rank, a->tokens, b->tokens, (long long)a->attn_dot_dense, (long long)b->attn_dot_dense,
                             (long long)a->attn_dot_causal, (long long)b->attn_dot_causal, (long long)a->kv_rows_sent,
                             (long long)b->kv_rows_sent, (long long)a->kv_rows_recv, (long long)b->kv_rows_recv);
                }
            }
            CHECK(ok, "counters %s: the simulator's attn_dot_dense/causal and kv_rows_sent/recv equal the run's%s%s", what,
                  rc ? kvr_last_error() : "", diff);
            // bytes too: the profile's activations are f32 like the run's, K/V in the cache's type
            bool bok = ok;
            for (int r = 0; bok && r < N; r++) {
                bok = st[r].bytes_sent == sim.ranks[st[r].rank].bytes_sent && st[r].bytes_recv == sim.ranks[st[r].rank].bytes_recv;
                if (!bok) {
                    snprintf(diff, sizeof(diff), ": rank %d run/sim sent %lld/%lld recv %lld/%lld", st[r].rank, (long long)st[r].bytes_sent,
                             (long long)sim.ranks[st[r].rank].bytes_sent, (long long)st[r].bytes_recv, (long long)sim.ranks[st[r].rank].bytes_recv);
                }
            }
            CHECK(bok, "counters %s: bytes sent/received equal the run's%s", what, bok ? "" : diff);
            kvr_session_free(d);
        }
    }
    free(tokens);
    kvr_model_free(model);
}

int main(int argc, char ** argv) {
    const char * shared = "../shared";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) print_passes = true;
        else shared = argv[i];
    }
    const double t0 = kvr_time_ms();
    test_search();
    test_table();
    test_profiles();
    test_sim_model();
    test_auto_pick();
    test_counters(shared, "models/stories260K.gguf", "stories260K");          // llama, GQA 8/4
    test_counters(shared, "reference/tiny-falcon-mqa.gguf", "tiny-falcon-mqa"); // falcon, MQA 4/1
    test_counters(shared, "reference/archs-next/tiny-qwen35.gguf", "tiny-qwen35"); // hybrid: 3 recurrent layers, 1 attention
    for (int i = 0; i < g_n_tmp && i < 8; i++) remove(g_tmp[i]);
    printf("test-tune: %.1f s\n", (kvr_time_ms() - t0) / 1e3);
    return check_summary("tune");
}
