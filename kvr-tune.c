// kvr-tune.c - load balancing for KV-Runahead and the cost model behind it: hardware profiles
// (built in, read from files, or measured on this machine by a micro-benchmark of kvr's own
// ops), model shapes (presets or a loaded GGUF), a simulator of every rank's timeline for each
// strategy with the counters a real run reports, the paper's lower bounds, the partition search
// (golden-section for 2 ranks, the paper's hierarchical grid search beyond), and partition
// lookup tables with linear interpolation (KVR-P). The public part is kvr.h's "tuning".
//
// Reading order: kvr_tune_simulate (sim_* per strategy, over attn_pairs and op costs) ->
// kvr_tune_search (search_golden, search_grid) -> kvr_tune_table_* -> kvr_tune_calibrate.

#define _GNU_SOURCE
#if defined(__GNUC__) && !defined(__clang__) && !defined(typeof)
#define typeof __typeof__ // stb_ds spells it so; strict C11 has only the GNU spelling
#endif
#include <stb/stb_ds.h>   // the implementation lives in kvr.c

#include "kvr.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static double maxd(double a, double b) { return a > b ? a : b; }

//
// hardware profiles
//

// The A100 numbers: FP16 dense peak 312 TFLOP/s, 1.555 TB/s (40 GB part). The efficiencies are
// fitted to the paper's own single-GPU Llama 7B TTFTs (Table 3: 1k 0.10 s, 2k 0.24, 4k 0.65,
// 8k 1.95, 12k 3.95 s), which follow a*C + b*C^2 with a = 81 us/token (projections and FFN:
// 53% of peak) and b = 20.3 ns/token^2 (HF eager dense attention, score matrix in memory: 8.3%).
// H100 SXM: 989 TFLOP/s, 3.35 TB/s, NVLink 450 GB/s per direction; same framework efficiencies.
// cpu: the shape of kvr's CPU kernel (kvr.c's ATTN_ROWS query rows, the heads sharing a KV head
// packed together, by ATTN_BK keys; f32; causal; one link per pair as the local transport
// emulates) with the round speeds of one core of a small x86 machine; --calibrate measures them.
#define GPU_PROFILE(NAME, FLOPS, MEM, LINK, LAT)                                                        \
    { .name = NAME, .matmul_flops = FLOPS, .matmul_eff = 0.53, .attn_flops = FLOPS, .attn_eff = 0.083,  \
      .mem_bw = MEM, .link_bw = LINK, .link_latency = LAT, .links = KVR_TUNE_LINKS_PORT, .elem_bytes = 2, \
      .weight_bytes = 2.0, .attn_tile_q = 128, .attn_tile_k = 128, .attn_tile_group = 0,                \
      .attn_mode = KVR_ATTN_DENSE, .layer_overhead = 0.0, .attn_pair_s = 0.0, .solo_speedup = 1.0 }
static const struct kvr_tune_profile builtin_profiles[] = {
    GPU_PROFILE("a100-nvlink", 312e12, 1.555e12, 300e9, 10e-6),
    GPU_PROFILE("a100-10g",    312e12, 1.555e12,  10e9, 25e-6),
    GPU_PROFILE("h100-nvlink", 989e12, 3.35e12,  450e9, 10e-6),
    { .name = "cpu", .matmul_flops = 4e10, .matmul_eff = 1.0, .attn_flops = 5e10, .attn_eff = 1.0, .mem_bw = 1e10,
      .link_bw = 5e9, .link_latency = 10e-6, .links = KVR_TUNE_LINKS_PAIR, .elem_bytes = 4, .weight_bytes = 4.0,
      .attn_tile_q = 256, .attn_tile_k = 256, .attn_tile_group = 1, .attn_mode = KVR_ATTN_CAUSAL, .layer_overhead = 0.0,
      .attn_pair_s = 15e-9, .solo_speedup = 1.0 },
};
#undef GPU_PROFILE
#define N_BUILTIN_PROFILES ((int)(sizeof(builtin_profiles) / sizeof(builtin_profiles[0])))

int kvr_tune_profile_builtin(const char * name, struct kvr_tune_profile * out) {
    for (int i = 0; i < N_BUILTIN_PROFILES; i++) {
        if (strcmp(name, builtin_profiles[i].name) == 0) {
            *out = builtin_profiles[i];
            return KVR_OK;
        }
    }
    return kvr_error(KVR_ERR_ARG, "unknown hardware profile '%s' (built in: a100-nvlink, a100-10g, h100-nvlink, cpu; or a file)", name);
}

// the keys of a profile file, in the order they are written
enum pkey { PK_NAME, PK_MM_FLOPS, PK_MM_EFF, PK_AT_FLOPS, PK_AT_EFF, PK_MEM_BW, PK_LINK_BW, PK_LINK_LAT,
            PK_LINKS, PK_ELEM, PK_WEIGHT, PK_TILE_Q, PK_TILE_K, PK_TILE_GROUP, PK_ATTN_MODE, PK_OVERHEAD, PK_PAIR, PK_SOLO,
            PK_MM_WEIGHT, PK_COUNT };
static const char * const pkey_names[PK_COUNT] = {
    "name", "matmul_flops", "matmul_eff", "attn_flops", "attn_eff", "mem_bw", "link_bw", "link_latency",
    "links", "elem_bytes", "weight_bytes", "attn_tile_q", "attn_tile_k", "attn_tile_group", "attn_mode", "layer_overhead", "attn_pair_s",
    "solo_speedup", "matmul_weight_s",
};
static const char * const pkey_help[PK_COUNT] = {
    "profile name",
    "FLOP/s peak of one rank on projection/FFN matmuls",
    "fraction of that peak reached on prefill shapes",
    "FLOP/s peak on attention (4*head_dim FLOPs per query-key pair and head)",
    "fraction of that peak the attention kernel reaches",
    "bytes/s of a rank's memory (weights, elementwise ops)",
    "bytes/s of one link direction (inf: free)",
    "seconds added to every message",
    "port: one egress/ingress port per rank; pair: a link per pair of ranks",
    "bytes per activation and K/V element (2: fp16, 4: f32)",
    "bytes per weight element for presets",
    "attention tile: query rows (tokens, or token-heads with attn_tile_group 1)",
    "attention tile: keys (causal mode skips tiles whose keys all follow their queries)",
    "1: a tile packs the query heads sharing a KV head (attn_tile_q/group tokens); 0: tokens",
    "causal or dense: the kernel's default mode",
    "seconds per layer and rank no op accounts for",
    "seconds per query-key pair and head besides its FLOPs (softmax: exp, max, sum)",
    "ranks sharing one machine: a rank alone computes this much faster (1: own devices)",
    "seconds per weight element a matmul call spends besides its FLOPs, whatever its tokens (packing)",
};

static char * trim(char * s) {
    while (isspace((unsigned char)*s)) s++;
    char * e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

static int parse_double(const char * s, double * out) {
    if (!strcmp(s, "inf") || !strcmp(s, "infinity")) { *out = INFINITY; return 0; }
    char * end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int parse_int(const char * s, int * out) {
    char * end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < -2147483647L || v > 2147483647L) return -1;
    *out = (int)v;
    return 0;
}

static int profile_check(const struct kvr_tune_profile * p, const char * where) {
    if (!(p->matmul_flops > 0) || !(p->attn_flops > 0) || !(p->mem_bw > 0) || !(p->link_bw > 0)) {
        return kvr_error(KVR_ERR_ARG, "%s: matmul_flops, attn_flops, mem_bw and link_bw must be positive", where);
    }
    if (!(p->matmul_eff > 0 && p->matmul_eff <= 1) || !(p->attn_eff > 0 && p->attn_eff <= 1)) {
        return kvr_error(KVR_ERR_ARG, "%s: matmul_eff and attn_eff must be in (0, 1]", where);
    }
    if (!(p->solo_speedup >= 1)) return kvr_error(KVR_ERR_ARG, "%s: solo_speedup must be >= 1", where);
    if (!(p->matmul_weight_s >= 0)) return kvr_error(KVR_ERR_ARG, "%s: matmul_weight_s must be >= 0", where);
    if (!(p->link_latency >= 0) || !(p->layer_overhead >= 0) || !(p->attn_pair_s >= 0) || !(p->weight_bytes > 0) || p->elem_bytes <= 0 ||
        p->attn_tile_q <= 0 || p->attn_tile_k <= 0 || (p->attn_tile_group != 0 && p->attn_tile_group != 1)) {
        return kvr_error(KVR_ERR_ARG, "%s: latency and overhead must be >= 0; element sizes and tiles positive", where);
    }
    return KVR_OK;
}

int kvr_tune_profile_load(const char * path, struct kvr_tune_profile * out) {
    FILE * f = kvr_file_read(path); // a regular file, opened without waiting on a FIFO
    if (!f) return kvr_error_prefix(KVR_ERR_IO, "cannot open hardware profile '%s'", path);
    struct kvr_tune_profile p;
    kvr_tune_profile_builtin("cpu", &p);
    snprintf(p.name, sizeof(p.name), "%s", path);
    char line[512];
    int ln = 0, rc = KVR_OK;
    while (rc == KVR_OK && fgets(line, sizeof(line), f)) {
        ln++;
        char * hash = strchr(line, '#');
        if (hash) *hash = 0;
        char * s = trim(line);
        if (!*s) continue;
        char * val = s;
        while (*val && !isspace((unsigned char)*val)) val++;
        if (*val) *val++ = 0;
        val = trim(val);
        int k = 0;
        while (k < PK_COUNT && strcmp(s, pkey_names[k]) != 0) k++;
        if (k == PK_COUNT) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: unknown key '%s'", path, ln, s);
            break;
        }
        double d = 0.0;
        int i = 0;
        bool bad = false;
        switch ((enum pkey)k) {
            case PK_NAME:     bad = !*val || strlen(val) >= sizeof(p.name); if (!bad) snprintf(p.name, sizeof(p.name), "%s", val); break;
            case PK_MM_FLOPS: bad = parse_double(val, &d) != 0; p.matmul_flops = d; break;
            case PK_MM_EFF:   bad = parse_double(val, &d) != 0; p.matmul_eff = d; break;
            case PK_AT_FLOPS: bad = parse_double(val, &d) != 0; p.attn_flops = d; break;
            case PK_AT_EFF:   bad = parse_double(val, &d) != 0; p.attn_eff = d; break;
            case PK_MEM_BW:   bad = parse_double(val, &d) != 0; p.mem_bw = d; break;
            case PK_LINK_BW:  bad = parse_double(val, &d) != 0; p.link_bw = d; break;
            case PK_LINK_LAT: bad = parse_double(val, &d) != 0; p.link_latency = d; break;
            case PK_OVERHEAD: bad = parse_double(val, &d) != 0; p.layer_overhead = d; break;
            case PK_PAIR:     bad = parse_double(val, &d) != 0; p.attn_pair_s = d; break;
            case PK_SOLO:     bad = parse_double(val, &d) != 0; p.solo_speedup = d; break;
            case PK_MM_WEIGHT: bad = parse_double(val, &d) != 0; p.matmul_weight_s = d; break;
            case PK_WEIGHT:   bad = parse_double(val, &d) != 0; p.weight_bytes = d; break;
            case PK_ELEM:     bad = parse_int(val, &i) != 0; p.elem_bytes = i; break;
            case PK_TILE_Q:   bad = parse_int(val, &i) != 0; p.attn_tile_q = i; break;
            case PK_TILE_K:   bad = parse_int(val, &i) != 0; p.attn_tile_k = i; break;
            case PK_TILE_GROUP: bad = parse_int(val, &i) != 0 || (i != 0 && i != 1); p.attn_tile_group = i; break;
            case PK_LINKS:
                if (!strcmp(val, "port")) p.links = KVR_TUNE_LINKS_PORT;
                else if (!strcmp(val, "pair")) p.links = KVR_TUNE_LINKS_PAIR;
                else bad = true;
                break;
            case PK_ATTN_MODE:
                if (!strcmp(val, "causal")) p.attn_mode = KVR_ATTN_CAUSAL;
                else if (!strcmp(val, "dense")) p.attn_mode = KVR_ATTN_DENSE;
                else bad = true;
                break;
            case PK_COUNT: break;
        }
        if (bad) rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: bad value '%s' for %s (%s)", path, ln, val, s, pkey_help[k]);
    }
    fclose(f);
    if (rc == KVR_OK) rc = profile_check(&p, path);
    if (rc == KVR_OK) *out = p;
    return rc;
}

int kvr_tune_profile_save(const struct kvr_tune_profile * p, const char * path) {
    struct kvr_file * kf; // written beside path, renamed onto it whole
    if (kvr_file_create(&kf, path) != KVR_OK) return kvr_error_prefix(KVR_ERR_IO, "cannot write hardware profile '%s'", path);
    FILE * f = kvr_file_stream(kf);
    fprintf(f, "# kvr-tune hardware profile: what one rank can do and what connects the ranks\n");
    const double dv[PK_COUNT] = {
        [PK_MM_FLOPS] = p->matmul_flops, [PK_MM_EFF] = p->matmul_eff, [PK_AT_FLOPS] = p->attn_flops,
        [PK_AT_EFF] = p->attn_eff, [PK_MEM_BW] = p->mem_bw, [PK_LINK_BW] = p->link_bw,
        [PK_LINK_LAT] = p->link_latency, [PK_WEIGHT] = p->weight_bytes, [PK_OVERHEAD] = p->layer_overhead,
        [PK_PAIR] = p->attn_pair_s, [PK_SOLO] = p->solo_speedup, [PK_MM_WEIGHT] = p->matmul_weight_s,
    };
    for (int k = 0; k < PK_COUNT; k++) {
        char v[80];
        switch ((enum pkey)k) {
            case PK_NAME:      snprintf(v, sizeof(v), "%s", p->name); break;
            case PK_LINKS:     snprintf(v, sizeof(v), "%s", p->links == KVR_TUNE_LINKS_PAIR ? "pair" : "port"); break;
            case PK_ATTN_MODE: snprintf(v, sizeof(v), "%s", p->attn_mode == KVR_ATTN_DENSE ? "dense" : "causal"); break;
            case PK_ELEM:      snprintf(v, sizeof(v), "%d", p->elem_bytes); break;
            case PK_TILE_Q:    snprintf(v, sizeof(v), "%d", p->attn_tile_q); break;
            case PK_TILE_K:    snprintf(v, sizeof(v), "%d", p->attn_tile_k); break;
            case PK_TILE_GROUP: snprintf(v, sizeof(v), "%d", p->attn_tile_group); break;
            default:           if (isinf(dv[k])) snprintf(v, sizeof(v), "inf"); else snprintf(v, sizeof(v), "%.9g", dv[k]); break;
        }
        fprintf(f, "%-15s %-16s # %s\n", pkey_names[k], v, pkey_help[k]);
    }
    if (kvr_file_commit(kf) != KVR_OK) return kvr_error_prefix(KVR_ERR_IO, "cannot write hardware profile '%s'", path);
    return KVR_OK;
}

int kvr_tune_profile_get(const char * name_or_path, struct kvr_tune_profile * out) {
    for (int i = 0; i < N_BUILTIN_PROFILES; i++) {
        if (!strcmp(name_or_path, builtin_profiles[i].name)) return kvr_tune_profile_builtin(name_or_path, out);
    }
    FILE * f = kvr_file_read(name_or_path);
    if (!f) {
        return kvr_error(KVR_ERR_ARG, "'%s' is neither a built-in profile (a100-nvlink, a100-10g, h100-nvlink, cpu) nor a readable file",
                         name_or_path);
    }
    fclose(f);
    return kvr_tune_profile_load(name_or_path, out);
}

//
// model shapes
//

struct preset { const char * name; int n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ffn_mats; };
static const struct preset presets[] = {
    { "llama-7b",       32, 4096, 32, 32, 128, 11008, 32000, 3 },
    { "llama-13b",      40, 5120, 40, 40, 128, 13824, 32000, 3 },
    { "falcon-7b",      32, 4544, 71,  1,  64, 18176, 65024, 2 },
    { "tinyllama-1.1b", 22, 2048, 32,  4,  64,  5632, 32000, 3 },
};

int kvr_tune_model_preset(const char * name, struct kvr_tune_model * out) {
    for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        const struct preset * p = &presets[i];
        const size_t n = strlen(p->name);
        if (strncmp(name, p->name, n) != 0 || (name[n] && name[n] != '-')) continue;
        struct kvr_tune_model m = { .n_layer = p->n_layer, .n_embd = p->n_embd, .n_head = p->n_head,
                                    .n_head_kv = p->n_head_kv, .head_dim = p->head_dim, .n_ff = p->n_ff,
                                    .n_vocab = p->n_vocab, .n_ffn_mats = p->n_ffn_mats };
        const char * var = name[n] ? name + n + 1 : "";
        int kv = 0;
        if (!*var) {
        } else if (!strcmp(var, "mha")) {
            m.n_head_kv = m.n_head;
        } else if (!strcmp(var, "mqa")) {
            m.n_head_kv = 1;
        } else if (!strncmp(var, "gqa", 3) && parse_int(var + 3, &kv) == 0 && kv > 0 && m.n_head % kv == 0) {
            m.n_head_kv = kv;
        } else {
            return kvr_error(KVR_ERR_ARG, "preset '%s': unknown variant '%s' (mha, mqa, or gqaN with N dividing %d heads)",
                             name, var, m.n_head);
        }
        snprintf(m.name, sizeof(m.name), "%s", name);
        *out = m;
        return KVR_OK;
    }
    return kvr_error(KVR_ERR_ARG, "unknown model preset '%s' (llama-7b, llama-13b, falcon-7b, tinyllama-1.1b; "
                     "suffix -mha, -mqa or -gqaN for another attention)", name);
}

int kvr_tune_model_from(const struct kvr_model * mdl, struct kvr_tune_model * out) {
    const struct kvr_hparams * hp = &mdl->hp;
    struct kvr_tune_model m = { .n_layer = (int)hp->n_layer, .n_embd = (int)hp->n_embd, .n_head = (int)hp->n_head,
                                .n_head_kv = (int)hp->n_head_kv, .head_dim = (int)hp->head_dim, .n_ff = (int)hp->n_ff,
                                .n_vocab = (int)hp->n_vocab, .n_ffn_mats = 3 };
    if (m.n_layer <= 0 || m.n_head <= 0 || m.n_head_kv <= 0 || m.head_dim <= 0) {
        return kvr_error(KVR_ERR_ARG, "model '%s' has no layers or heads", mdl->path);
    }
    m.n_recurrent = (int)hp->n_recurrent;
    memcpy(m.recurrent, hp->recurrent, sizeof(m.recurrent));
    m.state_floats = (double)kvr_hp_state_floats(hp);
    m.rec_floats = (double)hp->ssm_dt_rank * hp->ssm_d_state * hp->ssm_d_state;
    // bytes per weight element, from the matrices of the first layer as stored
    double bytes = 0.0, elems = 0.0;
    if (mdl->layers) {
        const struct kvr_layer * l = &mdl->layers[0];
        const struct kvr_tensor * w[] = { l->wq, l->wk, l->wv, l->wqkv, l->wo, l->ffn_gate, l->ffn_up, l->ffn_down,
                                           l->ffn_gate_exps, l->ffn_up_exps, l->ffn_down_exps };
        for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++) {
            if (!w[i]) continue;
            bytes += (double)kvr_row_size(w[i]->type, w[i]->ne[0]) * (double)kvr_nrows(w[i]);
            elems += (double)kvr_nelements(w[i]);
        }
        if (!l->ffn_gate && !l->ffn_gate_exps) m.n_ffn_mats = 2;
    }
    // a mixture of experts: a token's FFN is its n_expert_used experts' and the shared expert's
    // (FLOPs per token)
    if (hp->n_expert) m.n_ff = (int)(hp->n_expert_used * hp->n_ff_exp + hp->n_ff_shexp);
    m.weight_bytes = elems > 0 ? bytes / elems : 0.0;
    // the table key: the file name (general.name is often just the architecture, "llama")
    char name[sizeof(mdl->path)];
    const char * base = strrchr(mdl->path, '/');
    base = base ? base + 1 : mdl->path;
    snprintf(name, sizeof(name), "%s", base);
    char * dot = strstr(name, ".gguf");
    if (dot && dot[5] == 0) *dot = 0;
    // a table line is split on white space
    for (char * c = name; *c; c++) if (isspace((unsigned char)*c) || *c == '#') *c = '-';
    if (!name[0]) snprintf(name, sizeof(name), "model");
    const size_t len = strlen(name) < sizeof(m.name) - 1 ? strlen(name) : sizeof(m.name) - 1;
    memcpy(m.name, name, len);
    m.name[len] = 0;
    *out = m;
    return KVR_OK;
}

//
// the simulator
//

// A rank's positions (queries or keys) in index order, as up to two ascending runs: contiguous
// slices (single, tsp, kvr) have one, the ring's load-balanced shards two.
struct runs {
    int n;
    int start[2];
    int len[2];
};

static int runs_total(const struct runs * r) {
    int t = 0;
    for (int i = 0; i < r->n; i++) t += r->len[i];
    return t;
}

static struct runs runs_range(int start, int len) {
    struct runs r = { .n = len > 0 ? 1 : 0, .start = { start, 0 }, .len = { len, 0 } };
    return r;
}

// tokens of chunk c of the ring's 2N (kvr_ring_shard's split)
static int chunk_tokens(int T, int N, int c) {
    return (int)((int64_t)T * (c + 1) / (2 * N)) - (int)((int64_t)T * c / (2 * N));
}

// the ring shard of rank i: chunks i and 2N-1-i of 2N (kvr_ring_shard's split)
static struct runs runs_ring(int T, int N, int i) {
    struct runs r = { 0 };
    const int nc = 2 * N, ch[2] = { i, nc - 1 - i };
    for (int k = 0; k < 2; k++) {
        const int b = (int)((int64_t)T * ch[k] / nc), e = (int)((int64_t)T * (ch[k] + 1) / nc);
        if (e > b) { r.start[r.n] = b; r.len[r.n] = e - b; r.n++; }
    }
    return r;
}

// position of the element at index i
static int runs_pos(const struct runs * r, int i) {
    return i < r->len[0] ? r->start[0] + i : r->start[1] + (i - r->len[0]);
}

// how many elements with index in [j0, j1) have position <= p
static int64_t runs_count_le(const struct runs * r, int j0, int j1, int p) {
    int64_t n = 0;
    int base = 0;
    for (int k = 0; k < r->n; k++) {
        int upto = p - r->start[k] + 1; // elements of this run at or before p
        upto = upto < 0 ? 0 : upto > r->len[k] ? r->len[k] : upto;
        const int a = j0 > base ? j0 : base, b = j1 < base + upto ? j1 : base + upto;
        if (b > a) n += b - a;
        base += r->len[k];
    }
    return n;
}

// sum over positions p in [p0, p1] of clamp(p - k0 + 1, 0, nk): the keys [k0, k0+nk) each sees
static int64_t sum_visible(int64_t p0, int64_t p1, int64_t k0, int64_t nk) {
    if (p1 < p0 || nk <= 0) return 0;
    int64_t s = 0;
    // ramp: k0 <= p < k0+nk sees p-k0+1
    int64_t a = p0 > k0 ? p0 : k0, b = p1 < k0 + nk - 1 ? p1 : k0 + nk - 1;
    if (b >= a) s += ((a - k0 + 1) + (b - k0 + 1)) * (b - a + 1) / 2;
    // flat: p >= k0+nk sees all
    int64_t c = p0 > k0 + nk ? p0 : k0 + nk;
    if (p1 >= c) s += (p1 - c + 1) * nk;
    return s;
}

// The pairs kvr's attention kernel computes for queries q over keys k (per head), tile by tile
// as cpu_op_attn walks them: dense counts whole computed tiles, causal the pairs with key <= query.
// In causal mode a tile whose first key follows its last query is skipped.
static void attn_pairs(const struct runs * q, const struct runs * k, int bq, int bk, enum kvr_attn_mode mode,
                       int64_t * dense, int64_t * causal) {
    const int Tq = runs_total(q), Tk = runs_total(k);
    int64_t d = 0, c = 0;
    if (Tq == 0 || Tk == 0) { *dense = 0; *causal = 0; return; }
    if (k->n == 1) {
        // one run of keys: whole rows of tiles in O(1)
        const int64_t k0 = k->start[0], nkt = (Tk + bk - 1) / bk;
        for (int i0 = 0; i0 < Tq; i0 += bq) {
            const int n = i0 + bq <= Tq ? bq : Tq - i0;
            const int64_t qmax = runs_pos(q, i0 + n - 1);
            int64_t ncomp = nkt;
            if (mode == KVR_ATTN_CAUSAL) ncomp = qmax < k0 ? 0 : ((qmax - k0) / bk + 1 < nkt ? (qmax - k0) / bk + 1 : nkt);
            const int64_t keys = ncomp * bk < Tk ? ncomp * bk : Tk;
            d += (int64_t)n * keys;
        }
        for (int i = 0; i < q->n; i++) c += sum_visible(q->start[i], q->start[i] + q->len[i] - 1, k0, Tk);
    } else {
        for (int i0 = 0; i0 < Tq; i0 += bq) {
            const int n = i0 + bq <= Tq ? bq : Tq - i0;
            const int qmin = runs_pos(q, i0), qmax = runs_pos(q, i0 + n - 1);
            for (int j0 = 0; j0 < Tk; j0 += bk) {
                const int m = j0 + bk <= Tk ? bk : Tk - j0;
                const int kmin = runs_pos(k, j0), kmax = runs_pos(k, j0 + m - 1);
                if (mode == KVR_ATTN_CAUSAL && kmin > qmax) continue;
                d += (int64_t)n * m;
                if (kmax <= qmin) { c += (int64_t)n * m; continue; }
                for (int i = i0; i < i0 + n; i++) c += runs_count_le(k, j0, j0 + m, runs_pos(q, i));
            }
        }
    }
    *dense = d;
    *causal = c;
}

// per-rank op costs of one layer for a number of tokens
struct tok_costs {
    double embed;   // token embeddings (once)
    double pre_kv;  // norm, K and V projections, RoPE of K: what the cache store waits for
    double store;   // K and V rows into the cache
    double q;       // Q projection and its RoPE
    double oproj;   // out-projection and the residual
    double ffn;     // FFN norm, FFN, residual
    double ffn1;    // the same for one token (the owner's last layer keeps only the last row)
    double logits;  // final norm and output row of one token (the owner, once)
    double rec;     // a recurrent layer's recurrence over the tokens: each token reads and writes the
                    //   state about four times (decay, k, update, q), token after token
};

static bool sim_recurrent(const struct kvr_tune_model * m, int l) {
    return m->n_recurrent > 0 && ((m->recurrent[l >> 6] >> (l & 63)) & 1);
}

static double elem_time(const struct kvr_tune_profile * hw, double n) {
    return n * hw->elem_bytes / hw->mem_bw;
}

// a matmul is bound by its FLOPs (plus what a call costs per weight whatever its tokens) or by
// streaming its weights and activations
static double mm_time(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, double T, double K, double N) {
    if (T <= 0) return 0.0;
    const double wb = m->weight_bytes > 0 ? m->weight_bytes : hw->weight_bytes;
    const double flops = 2.0 * T * K * N / (hw->matmul_flops * hw->matmul_eff) + K * N * hw->matmul_weight_s;
    const double bytes = (K * N * wb + T * (K + N) * hw->elem_bytes) / hw->mem_bw;
    return maxd(flops, bytes);
}

static double ffn_time(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, double T) {
    if (T <= 0) return 0.0;
    return elem_time(hw, T * (7.0 * m->n_embd + 5.0 * m->n_ff)) + m->n_ffn_mats * mm_time(m, hw, T, m->n_embd, m->n_ff);
}

// kvb: bytes per element of the cache's type, which the store writes
static void token_costs(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, int tokens, double kvb, struct tok_costs * c) {
    const double T = tokens, E = m->n_embd;
    const double qd = (double)m->n_head * m->head_dim, kvd = (double)m->n_head_kv * m->head_dim;
    memset(c, 0, sizeof(*c));
    c->logits = elem_time(hw, 4 * E) + mm_time(m, hw, 1, E, m->n_vocab);
    c->ffn1   = ffn_time(m, hw, 1);
    if (tokens <= 0) return;
    c->embed  = elem_time(hw, 2 * T * E);
    c->pre_kv = elem_time(hw, T * (4 * E + 2 * kvd)) + 2 * mm_time(m, hw, T, E, kvd);
    c->store  = elem_time(hw, 2 * T * kvd) + 2 * T * kvd * kvb / hw->mem_bw; // activations in, rows out in the cache's type
    c->q      = mm_time(m, hw, T, E, qd) + elem_time(hw, 2 * T * qd);
    c->oproj  = mm_time(m, hw, T, qd, E) + elem_time(hw, 3 * T * E);
    c->ffn    = ffn_time(m, hw, T);
    c->rec    = elem_time(hw, 4 * T * m->rec_floats);
}

// tokens per query tile: a GQA-packing kernel fills its rows with the heads of fewer tokens
static int tile_tokens(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw) {
    const int group = m->n_head / m->n_head_kv;
    if (!hw->attn_tile_group) return hw->attn_tile_q;
    return group >= hw->attn_tile_q ? 1 : hw->attn_tile_q / group;
}

static double attn_time(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, int64_t pairs) {
    return (double)pairs * m->n_head * (4.0 * m->head_dim / (hw->attn_flops * hw->attn_eff) + hw->attn_pair_s);
}

// the wires: a message from a to b starts when it is issued and its wire(s) are free, occupies
// them for bytes/bw, and arrives latency later (kvr's local transport emulates a link the same way)
struct links {
    const struct kvr_tune_profile * hw;
    int      n;
    double   egress[KVR_TUNE_MAX_RANKS], ingress[KVR_TUNE_MAX_RANKS];
    double * pair;  // [a*n + b]
};

static double link_xfer(struct links * L, struct kvr_tune_sim * out, int a, int b, double issue, double bytes) {
    double start = issue;
    double * pf = L->hw->links == KVR_TUNE_LINKS_PAIR ? &L->pair[a * L->n + b] : NULL;
    if (pf) start = maxd(start, *pf);
    else start = maxd(start, maxd(L->egress[a], L->ingress[b]));
    const double end = start + bytes / L->hw->link_bw;
    if (pf) *pf = end;
    else L->egress[a] = L->ingress[b] = end;
    const double dur = end - start + L->hw->link_latency;
    out->ranks[a].comm += dur;
    out->ranks[b].comm += dur;
    return end + L->hw->link_latency;
}

// a rank's clock: idle until t
static void wait_until(struct kvr_tune_rank * r, double * cur, double t) {
    if (t > *cur) { r->wait += t - *cur; *cur = t; }
}

// When ranks share one machine (solo_speedup > 1) a rank computes faster while the others wait.
// Who waits when is what the simulation finds out, so it runs to a fixed point: each pass times
// a rank's work against the other ranks' busy intervals of the pass before (the first pass: all
// of them busy all the time, the profile's rates as calibrated with every rank running).
struct busy {
    double * t;     // [start, end) pairs, in time order
    int      n, cap;
};

static void busy_add(struct busy * b, double t0, double t1) {
    if (t1 <= t0) return;
    if (b->n > 0 && b->t[2 * b->n - 1] >= t0) { b->t[2 * b->n - 1] = t1; return; } // adjoining: extend
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 256;
        b->t = realloc(b->t, sizeof(double) * 2 * (size_t)b->cap);
        KVR_ASSERT(b->t != NULL);
    }
    b->t[2 * b->n] = t0;
    b->t[2 * b->n + 1] = t1;
    b->n++;
}

// is b busy at t; *next gets the next time that answer may change
static bool busy_at(const struct busy * b, double t, double * next) {
    int lo = 0, hi = b->n; // the first interval that ends after t
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (b->t[2 * mid + 1] <= t) lo = mid + 1; else hi = mid;
    }
    if (lo == b->n) { *next = INFINITY; return false; }
    if (b->t[2 * lo] <= t) { *next = b->t[2 * lo + 1]; return true; }
    *next = b->t[2 * lo];
    return false;
}

struct sim {
    const struct kvr_tune_model   * m;
    const struct kvr_tune_profile * hw;
    const struct kvr_tune_plan    * plan;
    struct kvr_tune_sim           * out;
    struct links                    L;
    int                             N, T, owner;
    int                             cnt[KVR_TUNE_MAX_RANKS];
    struct tok_costs                tc[KVR_TUNE_MAX_RANKS];
    double                          cur[KVR_TUNE_MAX_RANKS];
    double                          kvd;     // K (or V) elements per token
    double                          kvb;     //   and bytes per element of them on the wire (the cache's type)
    double                          solo;    // the profile's solo_speedup (1: no sharing)
    bool                            first;   // the first pass: every other rank counts as busy
    struct busy                     prev[KVR_TUNE_MAX_RANKS], now[KVR_TUNE_MAX_RANKS];
};

// passes of the fixed point when ranks share a machine (each pass moves the busy intervals less)
#define SIM_PASSES 4

// rank r computes work that takes dt with every rank busy (attention: counted in its attn too)
static void run_op(struct sim * S, int r, double dt, bool attn) {
    struct kvr_tune_rank * R = &S->out->ranks[r];
    double * cur = &S->cur[r];
    double t = *cur;
    if (S->solo <= 1.0 || S->first || S->N == 1) {
        t += dt;
    } else {
        double left = dt;
        while (left > 0) {
            bool others = false;
            double change = INFINITY;
            for (int q = 0; q < S->N; q++) {
                if (q == r) continue;
                double nx;
                others = busy_at(&S->prev[q], t, &nx) || others;
                if (nx < change) change = nx;
            }
            const double rate = others ? 1.0 : S->solo;
            if (!(change > t) || t + left / rate <= change) { t += left / rate; break; }
            left -= (change - t) * rate;
            t = change;
        }
    }
    busy_add(&S->now[r], *cur, t);
    R->compute += t - *cur;
    if (attn) R->attn += t - *cur;
    *cur = t;
}

static void run_for(struct sim * S, int r, double dt) { run_op(S, r, dt, false); }

// What a rank runs of layer l after its attention inputs. The graph is pruned from its outputs:
// a rank that does not produce the logits has nothing that needs its last layer's attention
// output (only the K/V stores and transfers are kept), and the owner's last FFN runs for the last
// token only. So the last layer is partial, for the time and for the counters alike.
static bool layer_full(const struct sim * S, int r, int l) {
    return l < S->m->n_layer - 1 || r == S->owner;
}
static double layer_post(const struct sim * S, int r, int l) {
    return S->tc[r].oproj + (l < S->m->n_layer - 1 ? S->tc[r].ffn : S->tc[r].ffn1);
}
// attention pairs as kvr_session reports them: per layer whose attention ran on the rank (none ran
// on a rank without the output when the model has a single layer)
static int64_t per_layer(int64_t x, int layers_run) {
    return layers_run > 0 ? x : 0;
}

// the layers whose attention runs on a rank: the attention layers (a hybrid's recurrent ones have
// none), less the last layer on a rank without the output
static int attn_layers_run(const struct sim * S, bool all) {
    const int L = S->m->n_layer;
    return L - S->m->n_recurrent - (!all && !sim_recurrent(S->m, L - 1) ? 1 : 0);
}

// single, tsp, kvr: contiguous slices; rank r attends over keys [0, kend(r))
static void sim_chain(struct sim * S) {
    const struct kvr_tune_plan * P = S->plan;
    const int N = S->N, L = S->m->n_layer;
    const bool tsp = P->strategy == KVR_STRATEGY_TSP;
    int s[KVR_TUNE_MAX_RANKS];
    double at[KVR_TUNE_MAX_RANKS];
    for (int r = 0, acc = 0; r < N; r++) {
        struct kvr_tune_rank * R = &S->out->ranks[r];
        s[r] = acc;
        acc += S->cnt[r];
        const int kend = tsp ? S->T : acc;
        struct runs q = runs_range(s[r], S->cnt[r]), k = runs_range(0, kend);
        int64_t d, c;
        attn_pairs(&q, &k, tile_tokens(S->m, S->hw), S->hw->attn_tile_k, P->attn_mode, &d, &c);
        at[r] = attn_time(S->m, S->hw, d); // the kernel's time follows what it computes
        const int ran = attn_layers_run(S, r == S->owner);
        R->attn_dot_dense = per_layer(d, ran);
        R->attn_dot_causal = per_layer(c, ran);
        if (tsp) {
            R->kv_rows_sent = 2LL * (N - 1) * S->cnt[r];
            R->kv_rows_recv = 2LL * (S->T - S->cnt[r]);
        } else if (P->strategy == KVR_STRATEGY_KVR) {
            R->kv_rows_sent = r < N - 1 && acc > 0 ? 2LL * acc : 0;
            R->kv_rows_recv = r > 0 && s[r] > 0 ? 2LL * s[r] : 0;
        }
        const int La = L - S->m->n_recurrent; // layers with attention and K/V rows
        R->bytes_sent = (int64_t)(R->kv_rows_sent * S->kvd * S->kvb) * La;
        R->bytes_recv = (int64_t)(R->kv_rows_recv * S->kvd * S->kvb) * La;
        // the recurrent layers: one state from r-1 and one on to r+1 (a rank without tokens relays it)
        const int64_t sb = (int64_t)(S->m->state_floats * 4) * S->m->n_recurrent;
        if (N > 1 && r < N - 1 && acc > 0) R->bytes_sent += sb;
        if (N > 1 && r > 0 && s[r] > 0) R->bytes_recv += sb;
        run_for(S, r, S->tc[r].embed);
    }
    for (int l = 0; l < L; l++) {
        if (sim_recurrent(S->m, l)) {
            // the chain of states, tsp's too: rank r's recurrence starts when r-1's has ended and
            // its state arrived; the projections before it overlap the wait
            double arrive = 0.0;
            for (int r = 0; r < N; r++) {
                struct kvr_tune_rank * R = &S->out->ranks[r];
                run_for(S, r, S->hw->layer_overhead + S->tc[r].pre_kv + S->tc[r].q);
                if (r > 0 && s[r] > 0) wait_until(R, &S->cur[r], arrive);
                run_for(S, r, S->tc[r].rec);
                if (r < N - 1 && s[r] + S->cnt[r] > 0) arrive = link_xfer(&S->L, S->out, r, r + 1, S->cur[r], S->m->state_floats * 4);
                if (layer_full(S, r, l)) run_for(S, r, layer_post(S, r, l));
            }
            continue;
        }
        if (tsp) {
            for (int r = 0; r < N; r++) run_for(S, r, S->hw->layer_overhead + S->tc[r].pre_kv);
            // two collectives, K then V: every rank sends its rows to every other as soon as it
            // reaches the collective, and leaves it when every peer's rows have arrived
            for (int phase = 0; phase < 2; phase++) {
                int order[KVR_TUNE_MAX_RANKS];
                double done[KVR_TUNE_MAX_RANKS];
                for (int r = 0; r < N; r++) { order[r] = r; done[r] = S->cur[r]; }
                for (int i = 1; i < N; i++) { // by issue time: the wires serve messages first come
                    const int o = order[i];
                    int j = i;
                    while (j > 0 && S->cur[order[j - 1]] > S->cur[o]) { order[j] = order[j - 1]; j--; }
                    order[j] = o;
                }
                for (int i = 0; i < N; i++) {
                    const int a = order[i];
                    for (int b = 0; b < N; b++) {
                        if (b == a) continue;
                        done[b] = maxd(done[b], link_xfer(&S->L, S->out, a, b, S->cur[a], S->cnt[a] * S->kvd * S->kvb));
                    }
                }
                for (int r = 0; r < N; r++) wait_until(&S->out->ranks[r], &S->cur[r], done[r]);
            }
            for (int r = 0; r < N; r++) {
                run_for(S, r, S->tc[r].store);
                if (layer_full(S, r, l)) {
                    run_for(S, r, S->tc[r].q);
                    run_op(S, r, at[r], true);
                    run_for(S, r, layer_post(S, r, l));
                }
            }
        } else {
            // the chain: rank r's store of layer l waits for [0, s_r) of layer l from r-1, which
            // sent it right after its own store of layer l (ranks in order: r-1 is done first)
            double arrive = 0.0;
            for (int r = 0; r < N; r++) {
                struct kvr_tune_rank * R = &S->out->ranks[r];
                double * cur = &S->cur[r];
                run_for(S, r, S->hw->layer_overhead + S->tc[r].pre_kv);
                if (r > 0 && s[r] > 0) wait_until(R, cur, arrive);
                run_for(S, r, S->tc[r].store);
                const int e = s[r] + S->cnt[r];
                if (r < N - 1 && e > 0) arrive = link_xfer(&S->L, S->out, r, r + 1, *cur, 2.0 * e * S->kvd * S->kvb);
                if (layer_full(S, r, l)) {
                    run_for(S, r, S->tc[r].q);
                    run_op(S, r, at[r], true);
                    run_for(S, r, layer_post(S, r, l));
                }
            }
        }
    }
}

// ring pass-KV and pass-Q over the load-balanced shards; per layer N steps
static void sim_ring(struct sim * S) {
    const struct kvr_tune_plan * P = S->plan;
    const int N = S->N, L = S->m->n_layer, T = S->T;
    const bool passq = P->strategy == KVR_STRATEGY_RING_Q;
    const double eb = S->hw->elem_bytes;
    const double qd = (double)S->m->n_head * S->m->head_dim, H = S->m->n_head;
    struct runs sh[KVR_TUNE_MAX_RANKS];
    for (int i = 0; i < N; i++) sh[i] = runs_ring(T, N, i);
    // at step j rank i attends: pass-KV its queries over the block of rank (i-j) mod N;
    // pass-Q the queries of rank (i-j) mod N over its own block
    double * at = calloc((size_t)N * N, sizeof(double));
    double * ready = calloc((size_t)N * N, sizeof(double)); // [i*N + j]: step j's block is at rank i
    KVR_ASSERT(at && ready);
    // pass-KV that gathers (kvr_ring_kv_gathers, in the exact arithmetic the simulator times): each
    // rank keeps the blocks and, once the last is in, attends with its queries over every key at once
    const enum kvr_type ct = kvr_cache_type_elem(P->cache_type);
    const bool gather = !passq && kvr_ring_kv_gathers(ct, ct, false, T, 0, 0);
    const struct runs all = runs_range(0, T);
    for (int i = 0; i < N; i++) {
        struct kvr_tune_rank * R = &S->out->ranks[i];
        int64_t dsum = 0, csum = 0;
        for (int j = 0; j < N; j++) {
            const int src = (i + N - j) % N;
            int64_t d = 0, c = 0;
            if (gather) {
                if (j == N - 1) attn_pairs(&sh[i], &all, tile_tokens(S->m, S->hw), S->hw->attn_tile_k, P->attn_mode, &d, &c);
            } else {
                attn_pairs(passq ? &sh[src] : &sh[i], passq ? &sh[i] : &sh[src], tile_tokens(S->m, S->hw), S->hw->attn_tile_k,
                           P->attn_mode, &d, &c);
            }
            dsum += d;
            csum += c;
            at[i * N + j] = attn_time(S->m, S->hw, d);
        }
        // pass-Q: the all-to-all needs every partial, so every rank attends in every layer
        const int ran = attn_layers_run(S, passq || i == S->owner);
        R->attn_dot_dense = per_layer(dsum, ran);
        R->attn_dot_causal = per_layer(csum, ran);
        const int La = L - S->m->n_recurrent; // the K/V (or Q) traffic is the attention layers'
        const bool hybrid = S->m->n_recurrent > 0;
        // what crosses the wires (the totals kvr_rank_stats keeps, positions included)
        for (int j = 1; j < N; j++) {
            const int sent = S->cnt[(i + N - j + 1) % N], got = S->cnt[(i + N - j) % N];
            if (passq) {
                R->bytes_sent += (int64_t)(sent * qd * eb) * La + 4LL * sent;
                R->bytes_recv += (int64_t)(got * qd * eb) * La + 4LL * got;
            } else {
                R->kv_rows_sent += 2LL * sent;
                R->kv_rows_recv += 2LL * got;
                R->bytes_sent += (int64_t)(2.0 * sent * S->kvd * S->kvb) * La + 4LL * sent;
                R->bytes_recv += (int64_t)(2.0 * got * S->kvd * S->kvb) * La + 4LL * got;
            }
        }
        if (passq) {
            const double row = qd * eb + H * 4; // outputs, then one f32 log-sum-exp per head
            for (int s = 0; s < N; s++) {
                if (s == i) continue;
                R->bytes_sent += (int64_t)(S->cnt[s] * row) * La;
                R->bytes_recv += (int64_t)(S->cnt[i] * row) * La;
            }
        }
        if (hybrid) {
            // the states: chunk c's rank hands its state to chunk c+1's (kvr-comm.c's pass_gdn_ring,
            // empty chunks passed over), then the last chunk's rank to every other rank
            const int64_t sb = (int64_t)(S->m->state_floats * 4) * S->m->n_recurrent;
            int prev = -1, last = -1;
            for (int c = 0; c < 2 * N; c++) {
                if (chunk_tokens(T, N, c) == 0) continue;
                const int h = c < N ? c : 2 * N - 1 - c;
                if (prev >= 0 && prev != h) {
                    if (prev == i) R->bytes_sent += sb;
                    if (h == i) R->bytes_recv += sb;
                }
                prev = last = h;
            }
            if (last == i) R->bytes_sent += sb * (N - 1);
            else if (last >= 0) R->bytes_recv += sb;
        }
        run_for(S, i, S->tc[i].embed);
    }
    for (int l = 0; l < L; l++) {
        if (sim_recurrent(S->m, l)) {
            // the 2N chunks in token order, each rank's recurrence over its chunk after the state
            // of the chunk before arrived; the final state's copies to every rank are off the path
            for (int i = 0; i < N; i++) run_for(S, i, S->hw->layer_overhead + S->tc[i].pre_kv + S->tc[i].q);
            double arrive = 0.0;
            int prev = -1;
            for (int c = 0; c < 2 * N; c++) {
                const int n = chunk_tokens(T, N, c), h = c < N ? c : 2 * N - 1 - c;
                if (n == 0) continue;
                if (prev >= 0 && prev != h) wait_until(&S->out->ranks[h], &S->cur[h], arrive);
                run_for(S, h, S->tc[h].rec * n / (S->cnt[h] > 0 ? S->cnt[h] : 1));
                arrive = S->cur[h];
                const int nx = c + 1 < 2 * N ? c + 1 : -1;
                if (nx >= 0) {
                    const int hn = nx < N ? nx : 2 * N - 1 - nx;
                    if (hn != h) arrive = link_xfer(&S->L, S->out, h, hn, S->cur[h], S->m->state_floats * 4);
                }
                prev = h;
            }
            for (int i = 0; i < N; i++) {
                if (layer_full(S, i, l)) run_for(S, i, layer_post(S, i, l));
            }
            continue;
        }
        for (int i = 0; i < N; i++) {
            run_for(S, i, S->hw->layer_overhead + S->tc[i].pre_kv + S->tc[i].store + (passq ? S->tc[i].q : 0.0));
            ready[i * N + 0] = S->cur[i];
        }
        // step j: every rank passes on the block it holds since step j-1 (its own at step 1)
        for (int j = 1; j < N; j++) {
            for (int i = 0; i < N; i++) {
                const int next = (i + 1) % N, rows = S->cnt[(i + N - j + 1) % N];
                const double bytes = passq ? rows * qd * eb : 2.0 * rows * S->kvd * S->kvb;
                ready[next * N + j] = link_xfer(&S->L, S->out, i, next, ready[i * N + j - 1], bytes);
            }
        }
        double done[KVR_TUNE_MAX_RANKS];
        for (int i = 0; i < N; i++) {
            struct kvr_tune_rank * R = &S->out->ranks[i];
            double * cur = &S->cur[i];
            if (passq || layer_full(S, i, l)) {
                if (!passq) run_for(S, i, S->tc[i].q);
                // each step's attention overlaps the next block's transfer
                for (int j = 0; j < N; j++) {
                    wait_until(R, cur, ready[i * N + j]);
                    run_op(S, i, at[i * N + j], true);
                }
            } else {
                wait_until(R, cur, ready[i * N + N - 1]); // it still forwards every block
            }
            done[i] = *cur;
        }
        if (passq) {
            // partial outputs go home by an all-to-all on the critical path
            const double row = qd * eb + H * 4;
            double arrive[KVR_TUNE_MAX_RANKS];
            for (int i = 0; i < N; i++) arrive[i] = done[i];
            for (int i = 0; i < N; i++) {
                for (int s = 0; s < N; s++) {
                    if (s != i) arrive[s] = maxd(arrive[s], link_xfer(&S->L, S->out, i, s, done[i], S->cnt[s] * row));
                }
            }
            for (int i = 0; i < N; i++) wait_until(&S->out->ranks[i], &S->cur[i], arrive[i]);
        }
        for (int i = 0; i < N; i++) {
            if (!layer_full(S, i, l)) continue;
            // merge N partials (read each, write one), then the rest of the layer
            const double merge = elem_time(S->hw, (N + 1.0) * S->cnt[i] * (qd + H));
            run_for(S, i, merge + layer_post(S, i, l));
        }
    }
    free(at);
    free(ready);
}

int kvr_tune_simulate(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw,
                      const struct kvr_tune_plan * plan, struct kvr_tune_sim * out) {
    const int N = plan->strategy == KVR_STRATEGY_SINGLE ? 1 : plan->n_ranks, T = plan->n_tokens;
    if (N < 1 || N > KVR_TUNE_MAX_RANKS) return kvr_error(KVR_ERR_ARG, "simulate: %d ranks (1..%d)", plan->n_ranks, KVR_TUNE_MAX_RANKS);
    if (T < 1) return kvr_error(KVR_ERR_ARG, "simulate: a prompt of %d tokens", T);
    if (m->n_layer < 1 || m->n_head < 1 || m->n_head_kv < 1 || m->head_dim < 1 || m->n_embd < 1) {
        return kvr_error(KVR_ERR_ARG, "simulate: model '%s' has no layers or heads", m->name);
    }
    if (plan->strategy == KVR_STRATEGY_AUTO || (unsigned)plan->strategy >= KVR_STRATEGY_COUNT) {
        return kvr_error(KVR_ERR_ARG, "simulate: strategy '%s' (single, tsp, kvr, ring-kv, ring-q)", kvr_strategy_name(plan->strategy));
    }
    struct sim * S = calloc(1, sizeof(*S));
    if (!S) return kvr_error(KVR_ERR_NOMEM, "simulate: out of memory");
    S->m = m; S->hw = hw; S->plan = plan; S->out = out; S->N = N; S->T = T;
    S->kvd = (double)m->n_head_kv * m->head_dim;
    if ((unsigned)plan->cache_type >= KVR_CACHE_TYPE_COUNT) {
        free(S);
        return kvr_error(KVR_ERR_ARG, "simulate: cache type %d", (int)plan->cache_type);
    }
    // the bytes of a row of the cache's type: Q8_0 is 34 bytes a block of 32
    const enum kvr_type ct = kvr_cache_type_elem(plan->cache_type);
    S->kvb = (double)kvr_type_size(ct) / (double)kvr_blck_size(ct);
    S->L = (struct links) { .hw = hw, .n = N };
    if (hw->links == KVR_TUNE_LINKS_PAIR) {
        S->L.pair = calloc((size_t)N * N, sizeof(double));
        KVR_ASSERT(S->L.pair != NULL);
    }
    int rc = KVR_OK;
    const bool ring = plan->strategy == KVR_STRATEGY_RING_KV || plan->strategy == KVR_STRATEGY_RING_Q;
    if (plan->strategy == KVR_STRATEGY_KVR && plan->counts) {
        int sum = 0;
        for (int r = 0; r < N; r++) {
            if (plan->counts[r] < 0) { rc = kvr_error(KVR_ERR_ARG, "simulate: rank %d has a negative count", r); break; }
            sum += plan->counts[r];
            S->cnt[r] = plan->counts[r];
        }
        if (rc == KVR_OK && sum != T) rc = kvr_error(KVR_ERR_ARG, "simulate: the counts add up to %d, not %d tokens", sum, T);
    } else if (ring) {
        for (int r = 0; r < N; r++) S->cnt[r] = kvr_ring_shard(T, 0, N, r, NULL);
    } else { // single, tsp, kvr-e: the even split kvr_session makes
        for (int r = 0; r < N; r++) S->cnt[r] = (int)((int64_t)T * (r + 1) / N - (int64_t)T * r / N);
    }
    if (rc == KVR_OK) {
        // who computes the logits: the last rank with tokens, or in the ring the holder of the
        // last position (chunk 2N-1: rank 0)
        for (int r = 0; r < N; r++) {
            const struct runs sh = runs_ring(T, N, r);
            if (ring ? sh.n > 0 && runs_pos(&sh, runs_total(&sh) - 1) == T - 1 : S->cnt[r] > 0) S->owner = r;
        }
        for (int r = 0; r < N; r++) token_costs(m, hw, S->cnt[r], S->kvb, &S->tc[r]);
        S->solo = hw->solo_speedup > 1.0 ? hw->solo_speedup : 1.0;
        const int passes = S->solo > 1.0 && N > 1 ? SIM_PASSES : 1;
        for (int pass = 0; pass < passes; pass++) {
            S->first = pass == 0;
            memset(out, 0, sizeof(*out));
            out->n_ranks = N;
            for (int r = 0; r < N; r++) {
                out->ranks[r].rank = r;
                out->ranks[r].tokens = S->cnt[r];
                S->cur[r] = 0.0;
                S->L.egress[r] = S->L.ingress[r] = 0.0;
                struct busy b = S->prev[r]; // the pass before becomes prev, its storage is reused
                S->prev[r] = S->now[r];
                S->now[r] = b;
                S->now[r].n = 0;
            }
            if (S->L.pair) memset(S->L.pair, 0, sizeof(double) * (size_t)N * N);
            if (ring) sim_ring(S);
            else sim_chain(S);
            run_for(S, S->owner, S->tc[S->owner].logits);
        }
        for (int r = 0; r < N; r++) out->ranks[r].finish = S->cur[r];
        out->owner = S->owner;
        out->ttft = S->cur[S->owner];
    }
    for (int r = 0; r < N; r++) { free(S->prev[r].t); free(S->now[r].t); }
    free(S->L.pair);
    free(S);
    return rc;
}

double kvr_tune_objective_sim(const int * counts, int n_ranks, void * user) {
    const struct kvr_tune_sim_objective * o = user;
    const struct kvr_tune_plan plan = { .strategy = KVR_STRATEGY_KVR, .n_ranks = n_ranks, .n_tokens = o->n_tokens,
                                        .counts = counts, .attn_mode = o->attn_mode, .cache_type = o->cache_type };
    struct kvr_tune_sim * sim = malloc(sizeof(*sim));
    if (!sim) return kvr_error(KVR_ERR_NOMEM, "simulate: out of memory");
    double t = kvr_tune_simulate(o->model, o->hw, &plan, sim) == KVR_OK ? sim->ttft : -1.0;
    free(sim);
    return t;
}

//
// the search
//

struct memo_key { int c[KVR_TUNE_MAX_RANKS]; };
struct memo_ent { struct memo_key key; double value; };

struct searcher {
    const struct kvr_tune_search_params * p;
    struct memo_ent * memo;          // stb_ds hash map: a partition is evaluated once
    int      N, T, min_tokens;
    int64_t  n_evals, max_evals, total_est;
    double   t0, last_print;
    double   best;
    int      best_counts[KVR_TUNE_MAX_RANKS];
    int      level, n_levels, stride;
    int      rc;
};

// a line every 2 s, and at the end of each level once the search has run 2 s: short searches stay quiet
static void search_progress(struct searcher * s, bool force) {
    if (!s->p->progress) return;
    const double now = kvr_time_ms();
    if (now - s->t0 < 2000.0 || (!force && now - s->last_print < 2000.0)) return;
    s->last_print = now;
    const double el = (now - s->t0) / 1e3;
    const int64_t total = s->total_est > s->n_evals ? s->total_est : s->n_evals;
    const double eta = s->n_evals > 0 ? el / (double)s->n_evals * (double)(total - s->n_evals) : 0.0;
    char part[512];
    int o = 0;
    for (int r = 0; r < s->N && o < (int)sizeof(part) - 16; r++) {
        o += snprintf(part + o, sizeof(part) - (size_t)o, "%s%d", r ? "," : "", s->best_counts[r]);
    }
    fprintf(s->p->progress, "kvr-tune: %s%slevel %d/%d stride %d: %lld/%lld evaluations, best %.6g at [%s], %.1f s, ETA %.0f s\n",
            s->p->label ? s->p->label : "", s->p->label ? ": " : "", s->level, s->n_levels, s->stride,
            (long long)s->n_evals, (long long)total, s->best, part, el, eta);
    fflush(s->p->progress);
}

// the objective at counts (memoized); +inf after an error, which s->rc keeps
static double search_eval(struct searcher * s, const int * counts) {
    if (s->rc != KVR_OK) return INFINITY;
    struct memo_key key;
    memset(&key, 0, sizeof(key));
    memcpy(key.c, counts, sizeof(int) * (size_t)s->N);
    ptrdiff_t i = hmgeti(s->memo, key);
    if (i >= 0) return s->memo[i].value;
    if (s->n_evals >= s->max_evals) {
        s->rc = kvr_error(KVR_ERR_ARG, "search: stopped after max_evals = %lld evaluations", (long long)s->max_evals);
        return INFINITY;
    }
    const double v = s->p->objective(counts, s->N, s->p->user);
    s->n_evals++;
    if (!(v >= 0.0)) { // negative or NaN: the objective failed, and said why
        char why[1024];
        snprintf(why, sizeof(why), "%s", kvr_last_error());
        char part[256];
        int o = 0;
        for (int r = 0; r < s->N && o < (int)sizeof(part) - 16; r++) o += snprintf(part + o, sizeof(part) - (size_t)o, "%s%d", r ? "," : "", counts[r]);
        s->rc = kvr_error(KVR_ERR_ARG, "search: the objective failed at [%s] (returned %g): %s", part, v, why[0] ? why : "no reason given");
        return INFINITY;
    }
    hmput(s->memo, key, v);
    if (v < s->best) {
        s->best = v;
        memcpy(s->best_counts, counts, sizeof(int) * (size_t)s->N);
    }
    search_progress(s, false);
    return v;
}

// 2 ranks: golden-section search of the split on the lattice lo + k*stride (TTFT is unimodal in
// it: more for rank 0 shortens rank 1's attention but delays its cache)
static double golden_at(struct searcher * s, int k) {
    const int c[2] = { s->min_tokens + k * s->stride, s->T - (s->min_tokens + k * s->stride) };
    return search_eval(s, c);
}

static void search_golden(struct searcher * s) {
    const int K = (s->T - 2 * s->min_tokens) / s->stride; // lattice points 0..K
    int a = 0, b = K;
    s->total_est = (int64_t)(log((double)K + 1.0) / log(1.618034)) + 4;
    const double inv_phi = 0.6180339887498949;
    while (b - a > 3 && s->rc == KVR_OK) {
        int x1 = b - (int)lround((b - a) * inv_phi), x2 = a + (int)lround((b - a) * inv_phi);
        if (x1 <= a) x1 = a + 1;
        if (x2 >= b) x2 = b - 1;
        if (x1 >= x2) x1 = x2 - 1;
        const double f1 = golden_at(s, x1), f2 = golden_at(s, x2);
        if (f1 <= f2) b = x2;
        else a = x1;
    }
    for (int k = a; k <= b && s->rc == KVR_OK; k++) golden_at(s, k);
}

// more ranks: the paper's hierarchical grid search over the boundaries b_1 < ... < b_{N-1}:
// every combination of offsets -K..K strides around the center, re-centered at the same stride
// while the best lies on the grid's edge, then the stride halves down to min_stride, where it
// repeats until the center is the best of its neighborhood. It is a local search: where lowering
// the worst rank needs every later boundary to move by a different amount (a max of pieces with
// 5+ ranks), no grid move improves and it stops short; on simulated TTFTs it lands within 0.4%
// of a long random polish (llama-7b, 16k tokens, 4 and 8 ranks).
static void search_grid(struct searcher * s, const int * start, int min_stride, int K) {
    const int N = s->N, D = N - 1;
    int center[KVR_TUNE_MAX_RANKS + 1], b[KVR_TUNE_MAX_RANKS + 1], c[KVR_TUNE_MAX_RANKS], off[KVR_TUNE_MAX_RANKS];
    center[0] = 0;
    for (int r = 0; r < N; r++) center[r + 1] = center[r] + start[r];
    int64_t G = 1;
    for (int d = 0; d < D; d++) G *= 2 * K + 1;
    s->total_est = G * s->n_levels;
    for (int S = s->stride, guard = 0; s->rc == KVR_OK; guard++) {
        s->stride = S;
        bool on_edge = false, moved = false;
        // the center first, so that ties keep it
        for (int d = 0; d < D; d++) off[d] = 0;
        int best_off[KVR_TUNE_MAX_RANKS] = { 0 };
        double best = INFINITY;
        for (int64_t g = -1; g < G && s->rc == KVR_OK; g++) {
            if (g >= 0) { // odometer over the offsets, digit d in -K..K
                int64_t x = g;
                for (int d = 0; d < D; d++) { off[d] = (int)(x % (2 * K + 1)) - K; x /= 2 * K + 1; }
            }
            bool ok = true;
            b[0] = 0;
            b[N] = s->T;
            for (int d = 0; d < D; d++) b[d + 1] = center[d + 1] + off[d] * S;
            for (int r = 0; r < N && ok; r++) {
                c[r] = b[r + 1] - b[r];
                ok = c[r] >= s->min_tokens;
            }
            if (!ok) continue;
            const double v = search_eval(s, c);
            if (v < best) {
                best = v;
                memcpy(best_off, off, sizeof(int) * (size_t)D);
            }
        }
        for (int d = 0; d < D; d++) {
            if (best_off[d]) moved = true;
            if (best_off[d] == K || best_off[d] == -K) on_edge = true;
            center[d + 1] += best_off[d] * S;
        }
        search_progress(s, true);
        if (guard > 4 * s->T) break; // cannot happen with a finite lattice; never loop forever
        if (on_edge && S > min_stride) { s->total_est += G; continue; }
        if (S == min_stride) {
            if (moved) { s->total_est += G; continue; }
            break;
        }
        S = S / 2 < min_stride ? min_stride : S / 2;
        s->level++;
    }
}

int kvr_tune_search(const struct kvr_tune_search_params * p, struct kvr_tune_search_result * out) {
    const int N = p->n_ranks, T = p->n_tokens;
    const int min_tokens = p->min_tokens > 0 ? p->min_tokens : 1, min_stride = p->min_stride > 0 ? p->min_stride : 1;
    const int K = p->grid_half > 0 ? p->grid_half : 2;
    if (N < 1 || N > KVR_TUNE_MAX_RANKS) return kvr_error(KVR_ERR_ARG, "search: %d ranks (1..%d)", N, KVR_TUNE_MAX_RANKS);
    if (!p->objective) return kvr_error(KVR_ERR_ARG, "search: no objective");
    if ((int64_t)min_tokens * N > T) {
        return kvr_error(KVR_ERR_ARG, "search: %d tokens cannot give %d ranks %d each", T, N, min_tokens);
    }
    struct searcher s = { .p = p, .N = N, .T = T, .min_tokens = min_tokens, .best = INFINITY, .rc = KVR_OK,
                          .max_evals = p->max_evals > 0 ? p->max_evals : 10000000, .t0 = kvr_time_ms(), .level = 1 };
    s.last_print = s.t0;
    int start[KVR_TUNE_MAX_RANKS];
    if (p->start) {
        int sum = 0;
        for (int r = 0; r < N; r++) {
            if (p->start[r] < min_tokens) return kvr_error(KVR_ERR_ARG, "search: start gives rank %d fewer than %d tokens", r, min_tokens);
            start[r] = p->start[r];
            sum += start[r];
        }
        if (sum != T) return kvr_error(KVR_ERR_ARG, "search: start counts add up to %d, not %d", sum, T);
    } else {
        for (int r = 0; r < N; r++) start[r] = (int)((int64_t)T * (r + 1) / N - (int64_t)T * r / N);
    }
    if (N == 1) {
        search_eval(&s, start);
    } else if (N == 2) {
        s.stride = min_stride;
        s.n_levels = 1;
        search_golden(&s);
    } else {
        // the first stride: coarse_stride, or one rank's even share over K, as min_stride * 2^k
        const int want = p->coarse_stride > 0 ? p->coarse_stride : T / (N * K);
        int S = min_stride;
        s.n_levels = 1;
        while ((int64_t)S * 2 <= want) { S *= 2; s.n_levels++; }
        s.stride = S;
        double per_level = 1;
        for (int d = 0; d < N - 1; d++) per_level *= 2 * K + 1;
        if (per_level * s.n_levels > (double)s.max_evals) {
            return kvr_error(KVR_ERR_ARG, "search: a grid of %d^%d points over %d levels is more than %lld evaluations "
                             "(fewer ranks, --grid-half 1, or a larger minimum stride)", 2 * K + 1, N - 1, s.n_levels,
                             (long long)s.max_evals);
        }
        search_grid(&s, start, min_stride, K);
    }
    if (N == 2) search_progress(&s, true); // the grid reports at the end of every level
    hmfree(s.memo);
    if (s.rc != KVR_OK) return s.rc;
    if (!isfinite(s.best)) return kvr_error(KVR_ERR_ARG, "search: no partition could be evaluated");
    memset(out, 0, sizeof(*out));
    memcpy(out->counts, s.best_counts, sizeof(int) * (size_t)N);
    out->cost = s.best;
    out->n_evals = s.n_evals;
    out->seconds = (kvr_time_ms() - s.t0) / 1e3;
    return KVR_OK;
}

int kvr_tune_bounds(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, int n_ranks,
                    int n_tokens, enum kvr_attn_mode mode, int min_stride, struct kvr_tune_bounds * out) {
    struct kvr_tune_sim * sim = malloc(sizeof(*sim));
    if (!sim) return kvr_error(KVR_ERR_NOMEM, "bounds: out of memory");
    const struct kvr_tune_plan one = { .strategy = KVR_STRATEGY_SINGLE, .n_ranks = 1, .n_tokens = n_tokens, .attn_mode = mode };
    int rc = kvr_tune_simulate(m, hw, &one, sim);
    const double ttft_1 = sim->ttft;
    free(sim);
    if (rc != KVR_OK) return rc;
    memset(out, 0, sizeof(*out));
    // Eq. (3): TTFT(1) = alpha*C^2 cut as in Fig. 2(d) over p ranks, perfectly balanced
    const double p = n_ranks;
    out->ttft_1 = ttft_1;
    out->ttft_star = ttft_1 / 2.0 * (1.0 / p + 1.0 / (p * p));
    // TTFT(p): KVR-S where communication costs nothing
    struct kvr_tune_profile free_hw = *hw;
    free_hw.link_bw = INFINITY;
    free_hw.link_latency = 0.0;
    struct kvr_tune_sim_objective o = { m, &free_hw, n_tokens, mode, KVR_CACHE_F16 }; // the link is free: bytes do not count
    struct kvr_tune_search_params sp = { .n_ranks = n_ranks, .n_tokens = n_tokens, .min_stride = min_stride,
                                         .objective = kvr_tune_objective_sim, .user = &o };
    struct kvr_tune_search_result res;
    rc = kvr_tune_search(&sp, &res);
    if (rc != KVR_OK) return rc;
    out->ttft_free = res.cost;
    memcpy(out->counts_free, res.counts, sizeof(int) * (size_t)n_ranks);
    return KVR_OK;
}

//
// partition tables
//

static int entry_cmp(const void * a, const void * b) {
    const struct kvr_tune_entry * x = a, * y = b;
    int c = strcmp(x->model, y->model);
    if (c) return c;
    if (x->n_ranks != y->n_ranks) return x->n_ranks < y->n_ranks ? -1 : 1;
    return x->n_tokens < y->n_tokens ? -1 : x->n_tokens > y->n_tokens;
}

static int entry_check(const struct kvr_tune_entry * e, const char * where) {
    if (!e->model[0]) return kvr_error(KVR_ERR_ARG, "%s: an entry without a model name", where);
    for (const char * c = e->model; *c; c++) {
        if (isspace((unsigned char)*c) || *c == '#') return kvr_error(KVR_ERR_ARG, "%s: model name '%s' has a space or '#'", where, e->model);
    }
    if (e->n_ranks < 1 || e->n_ranks > KVR_TUNE_MAX_RANKS) return kvr_error(KVR_ERR_ARG, "%s: %d ranks (1..%d)", where, e->n_ranks, KVR_TUNE_MAX_RANKS);
    if (e->n_tokens < 1) return kvr_error(KVR_ERR_ARG, "%s: a length of %d tokens", where, e->n_tokens);
    double sum = 0.0;
    for (int r = 0; r < e->n_ranks; r++) {
        if (!(e->fractions[r] >= 0.0 && e->fractions[r] <= 1.0)) {
            return kvr_error(KVR_ERR_ARG, "%s: fraction %d is %g (0..1)", where, r, e->fractions[r]);
        }
        sum += e->fractions[r];
    }
    if (fabs(sum - 1.0) > 1e-3) return kvr_error(KVR_ERR_ARG, "%s: the fractions add up to %g, not 1", where, sum);
    return KVR_OK;
}

void kvr_tune_table_free(struct kvr_tune_table * t) {
    free(t->entries);
    memset(t, 0, sizeof(*t));
}

int kvr_tune_table_add(struct kvr_tune_table * t, const struct kvr_tune_entry * e) {
    int rc = entry_check(e, "table entry");
    if (rc != KVR_OK) return rc;
    for (int i = 0; i < t->n_entries; i++) {
        if (entry_cmp(&t->entries[i], e) == 0) {
            t->entries[i] = *e;
            return KVR_OK;
        }
    }
    struct kvr_tune_entry * ne = realloc(t->entries, sizeof(*ne) * (size_t)(t->n_entries + 1));
    if (!ne) return kvr_error(KVR_ERR_NOMEM, "table: out of memory");
    t->entries = ne;
    t->entries[t->n_entries++] = *e;
    qsort(t->entries, (size_t)t->n_entries, sizeof(*t->entries), entry_cmp);
    return KVR_OK;
}

int kvr_tune_table_load(const char * path, struct kvr_tune_table * out) {
    FILE * f = kvr_file_read(path); // a regular file, opened without waiting on a FIFO
    if (!f) return kvr_error_prefix(KVR_ERR_IO, "cannot open partition table '%s'", path);
    struct kvr_tune_table t = { 0 };
    int * lines = NULL; // the line of every entry, for messages about repeats
    char line[8192];
    int ln = 0, rc = KVR_OK;
    while (rc == KVR_OK && fgets(line, sizeof(line), f)) {
        ln++;
        if (!strchr(line, '\n') && !feof(f)) { rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: line too long", path, ln); break; }
        char * hash = strchr(line, '#');
        if (hash) *hash = 0;
        char * s = trim(line);
        if (!*s) continue;
        char * save = NULL;
        char * tok = strtok_r(s, " \t", &save);
        if (!t.profile[0]) {
            char * name = strtok_r(NULL, " \t", &save);
            if (strcmp(tok, "profile") != 0 || !name || strtok_r(NULL, " \t", &save) || strlen(name) >= sizeof(t.profile)) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: expected the header 'profile NAME' before the entries", path, ln);
                break;
            }
            snprintf(t.profile, sizeof(t.profile), "%s", name);
            continue;
        }
        struct kvr_tune_entry e = { 0 };
        if (strlen(tok) >= sizeof(e.model)) { rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: model name too long", path, ln); break; }
        snprintf(e.model, sizeof(e.model), "%s", tok);
        char * rs = strtok_r(NULL, " \t", &save), * ts = strtok_r(NULL, " \t", &save);
        if (!rs || parse_int(rs, &e.n_ranks) || e.n_ranks < 1 || e.n_ranks > KVR_TUNE_MAX_RANKS) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: field 2 (ranks) is '%s' (1..%d)", path, ln, rs ? rs : "", KVR_TUNE_MAX_RANKS);
            break;
        }
        if (!ts || parse_int(ts, &e.n_tokens) || e.n_tokens < 1) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: field 3 (tokens) is '%s'", path, ln, ts ? ts : "");
            break;
        }
        for (int r = 0; r < e.n_ranks && rc == KVR_OK; r++) {
            char * fs = strtok_r(NULL, " \t", &save);
            if (!fs || parse_double(fs, &e.fractions[r])) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: field %d (fraction of rank %d) is '%s'", path, ln, 4 + r, r, fs ? fs : "missing");
            }
        }
        if (rc != KVR_OK) break;
        char * extra = strtok_r(NULL, " \t", &save);
        if (extra && (strncmp(extra, "ttft=", 5) != 0 || parse_double(extra + 5, &e.ttft) || e.ttft < 0)) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: unexpected '%s' after %d fractions (only ttft=SECONDS may follow)", path, ln, extra, e.n_ranks);
            break;
        }
        if (extra && strtok_r(NULL, " \t", &save)) { rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: fields after ttft=", path, ln); break; }
        char where[600];
        snprintf(where, sizeof(where), "%s:%d", path, ln);
        if ((rc = entry_check(&e, where)) != KVR_OK) { rc = KVR_ERR_FORMAT; break; }
        for (int i = 0; i < t.n_entries; i++) {
            if (entry_cmp(&t.entries[i], &e) == 0) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s:%d: repeats model %s, %d ranks, %d tokens of line %d", path, ln, e.model, e.n_ranks,
                               e.n_tokens, lines[i]);
            }
        }
        if (rc != KVR_OK) break;
        struct kvr_tune_entry * ne = realloc(t.entries, sizeof(*ne) * (size_t)(t.n_entries + 1));
        int * nl = realloc(lines, sizeof(int) * (size_t)(t.n_entries + 1));
        if (nl) lines = nl;
        if (!ne || !nl) { free(ne ? ne : t.entries); t.entries = NULL; t.n_entries = 0; rc = kvr_error(KVR_ERR_NOMEM, "table: out of memory"); break; }
        t.entries = ne;
        lines[t.n_entries] = ln;
        t.entries[t.n_entries++] = e;
    }
    fclose(f);
    free(lines);
    if (rc == KVR_OK && !t.profile[0]) rc = kvr_error(KVR_ERR_FORMAT, "%s: no 'profile NAME' header (an empty table?)", path);
    if (rc != KVR_OK) {
        kvr_tune_table_free(&t);
        return rc;
    }
    qsort(t.entries, (size_t)t.n_entries, sizeof(*t.entries), entry_cmp);
    *out = t;
    return KVR_OK;
}

int kvr_tune_table_save(const struct kvr_tune_table * t, const char * path) {
    if (!t->profile[0]) return kvr_error(KVR_ERR_ARG, "table: no profile name to write in '%s'", path);
    for (const char * c = t->profile; *c; c++) {
        if (isspace((unsigned char)*c) || *c == '#') return kvr_error(KVR_ERR_ARG, "table: profile name '%s' has a space or '#'", t->profile);
    }
    struct kvr_file * kf; // written beside path, renamed onto it whole
    if (kvr_file_create(&kf, path) != KVR_OK) return kvr_error_prefix(KVR_ERR_IO, "cannot write partition table '%s'", path);
    FILE * f = kvr_file_stream(kf);
    fprintf(f, "# kvr partition table (kvr-tune): model, ranks, prompt tokens, then each rank's fraction of the\n"
               "# prompt in rank order (KV-Runahead's partition); ttft= is what the search reached, in seconds\n");
    fprintf(f, "profile %s\n", t->profile);
    for (int i = 0; i < t->n_entries; i++) {
        const struct kvr_tune_entry * e = &t->entries[i];
        fprintf(f, "%s %d %d", e->model, e->n_ranks, e->n_tokens);
        for (int r = 0; r < e->n_ranks; r++) fprintf(f, " %.6f", e->fractions[r]);
        if (e->ttft > 0) fprintf(f, " ttft=%.6g", e->ttft);
        fprintf(f, "\n");
    }
    if (kvr_file_commit(kf) != KVR_OK) return kvr_error_prefix(KVR_ERR_IO, "cannot write partition table '%s'", path);
    return KVR_OK;
}

int kvr_tune_table_lookup(const struct kvr_tune_table * t, const char * model, int n_ranks, int n_tokens,
                          double * fractions_out) {
    if (n_tokens < 1) return kvr_error(KVR_ERR_ARG, "table lookup: a prompt of %d tokens", n_tokens);
    if (!model) {
        for (int i = 0; i < t->n_entries; i++) {
            if (strcmp(t->entries[i].model, t->entries[0].model) != 0) {
                return kvr_error(KVR_ERR_ARG, "table lookup: no model named, and the table has several (%s, %s, ...)",
                                 t->entries[0].model, t->entries[i].model);
            }
        }
        if (t->n_entries == 0) return kvr_error(KVR_ERR_ARG, "table lookup: the table is empty");
        model = t->entries[0].model;
    }
    const struct kvr_tune_entry * lo = NULL, * hi = NULL;
    for (int i = 0; i < t->n_entries; i++) {
        const struct kvr_tune_entry * e = &t->entries[i];
        if (strcmp(e->model, model) != 0 || e->n_ranks != n_ranks) continue;
        if (e->n_tokens <= n_tokens && (!lo || e->n_tokens > lo->n_tokens)) lo = e;
        if (e->n_tokens >= n_tokens && (!hi || e->n_tokens < hi->n_tokens)) hi = e;
    }
    if (!lo && !hi) {
        char have[512] = "";
        int o = 0;
        for (int i = 0; i < t->n_entries && o < (int)sizeof(have) - 80; i++) {
            if (i > 0 && !strcmp(t->entries[i].model, t->entries[i - 1].model) && t->entries[i].n_ranks == t->entries[i - 1].n_ranks) continue;
            o += snprintf(have + o, sizeof(have) - (size_t)o, "%s%s/%d", o ? ", " : "", t->entries[i].model, t->entries[i].n_ranks);
        }
        return kvr_error(KVR_ERR_ARG, "table lookup: no entry for model '%s' with %d ranks (model/ranks in the table: %s)",
                         model, n_ranks, o ? have : "none");
    }
    // outside the known lengths the nearest entry's partition holds; between two, a straight line
    if (!lo) lo = hi;
    if (!hi) hi = lo;
    const double w = hi->n_tokens == lo->n_tokens ? 0.0 : (double)(n_tokens - lo->n_tokens) / (double)(hi->n_tokens - lo->n_tokens);
    double sum = 0.0;
    for (int r = 0; r < n_ranks; r++) {
        fractions_out[r] = (1.0 - w) * lo->fractions[r] + w * hi->fractions[r];
        sum += fractions_out[r];
    }
    for (int r = 0; r < n_ranks; r++) fractions_out[r] /= sum; // both ends sum to 1 within 1e-3
    return KVR_OK;
}

int kvr_tune_table_partition(const char * path, const char * model_name, int n_ranks, int n_tokens,
                             double * fractions_out) {
    struct kvr_tune_table t;
    int rc = kvr_tune_table_load(path, &t);
    if (rc != KVR_OK) return rc;
    rc = kvr_tune_table_lookup(&t, model_name, n_ranks, n_tokens, fractions_out);
    if (rc != KVR_OK) {
        rc = kvr_error_prefix(rc, "%s", path);
    }
    kvr_tune_table_free(&t);
    return rc;
}

void kvr_tune_counts_from_fractions(const double * fractions, int n_ranks, int n_tokens, int * counts) {
    // the rounding of kvr-comm.c's resolve_partition
    double cum = 0.0;
    int prev = 0;
    for (int r = 0; r < n_ranks; r++) {
        cum += fractions[r];
        int e = r == n_ranks - 1 ? n_tokens : (int)lround(cum * n_tokens);
        if (e > n_tokens) e = n_tokens;
        if (e < prev) e = prev;
        counts[r] = e - prev;
        prev = e;
    }
}

//
// calibration: this machine, measured with kvr's own ops on one thread
//

static int cmp_dbl(const void * a, const void * b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double * v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_dbl);
    return v[n / 2];
}

// the median of n runs of a graph on n_threads threads after one to warm up, in seconds: a
// prefill runs for minutes, so the typical speed is the one to model, not the best moment
static double time_graph(struct kvr_graph * g, int n, int n_threads) {
    double t[16];
    if (n > 16) n = 16;
    if (kvr_graph_compute_cpu(g, n_threads) != KVR_OK) return -1.0;
    for (int i = 0; i < n; i++) {
        const double t0 = kvr_time_ms();
        if (kvr_graph_compute_cpu(g, n_threads) != KVR_OK) return -1.0;
        t[i] = (kvr_time_ms() - t0) / 1e3;
    }
    return median(t, n);
}

static void fill_random(struct kvr_tensor * t, uint64_t seed) {
    float * x = t->data;
    const int64_t n = kvr_nelements(t);
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((seed >> 40) & 0xffff) / 65536.0f - 0.5f;
    }
}

struct pingpong {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             turn, n;
};

static void * pong(void * arg) {
    struct pingpong * pp = arg;
    pthread_mutex_lock(&pp->mu);
    for (int i = 0; i < pp->n; i++) {
        while (pp->turn != 1) pthread_cond_wait(&pp->cv, &pp->mu);
        pp->turn = 0;
        pthread_cond_broadcast(&pp->cv);
    }
    pthread_mutex_unlock(&pp->mu);
    return NULL;
}

// One MUL_MAT of weight [K x N] over T tokens, timed; seconds (negative on failure).
static size_t mem_mul_mat(int64_t K, int64_t N, int64_t T) {
    return (size_t)(K * N + K * T + N * T) * sizeof(float) + (64u << 10);
}

static struct kvr_graph * graph_mul_mat(struct kvr_context * ctx, int64_t K, int64_t N, int64_t T, uint64_t seed) {
    struct kvr_tensor * w = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, N), * x = kvr_new_tensor_2d(ctx, KVR_TYPE_F32, K, T);
    fill_random(w, seed);
    fill_random(x, seed + 7);
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, kvr_mul_mat(ctx, w, x));
    return g;
}

static size_t mem_attn(int D, int H, int Hkv, int Tq, int Tk) {
    return ((size_t)D * H * Tq + 2u * D * Hkv * Tk + (size_t)(D + 1) * H * Tq) * sizeof(float) + (size_t)(Tq + Tk) * 4 + (64u << 10);
}

// ATTN of Tq queries (the last of a Tk-token prompt) over all Tk keys, H query heads sharing Hkv
// key/value heads of dimension D
static struct kvr_graph * graph_attn(struct kvr_context * ctx, int D, int H, int Hkv, int Tq, int Tk, enum kvr_attn_mode mode) {
    struct kvr_tensor * q = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, H, Tq);
    struct kvr_tensor * k = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk), * v = kvr_new_tensor_3d(ctx, KVR_TYPE_F32, D, Hkv, Tk);
    struct kvr_tensor * qp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tq), * kp = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, Tk);
    fill_random(q, 11);
    fill_random(k, 12);
    fill_random(v, 13);
    for (int i = 0; i < Tq; i++) ((int32_t *)qp->data)[i] = Tk - Tq + i;
    for (int i = 0; i < Tk; i++) ((int32_t *)kp->data)[i] = i;
    struct kvr_graph * g = kvr_graph_new(ctx, 16);
    kvr_graph_expand(g, kvr_attn(ctx, q, k, v, qp, kp, NULL, 1.0f / sqrtf((float)D), 0.0f, 0, mode));
    return g;
}

#define CAL_ROUNDS 3
#define CAL_LONG   2048 // tokens of the second matmul length

// One measurement, run by several copies at once: n_copies ranks of a local run share the memory
// system and the caches, and a rank measured alone on an idle machine is faster than one that
// runs beside others.
struct cal_job {
    int                kind;           // CAL_MUL_MAT, CAL_ATTN, or CAL_LAYER: every matmul of `shapes`
                                       //   (each as often as a layer runs it) and the ATTN, in turn
    int64_t            K, N, T;        // MUL_MAT
    int                D, H, Hkv, Tq, Tk; // ATTN
    const int64_t   (* shapes)[4];     // LAYER: K, N, T, how many
    int                n_shapes;
    int                rot;            // LAYER: start at this op (copies start at different ones)
    enum kvr_attn_mode mode;
    int                n_threads;
    uint64_t           seed;
    double             t;              // seconds, negative on failure
};
enum { CAL_MUL_MAT, CAL_ATTN, CAL_LAYER };

static void * cal_job_run(void * arg) {
    struct cal_job * j = arg;
    size_t mem = 1u << 20;
    if (j->kind != CAL_MUL_MAT) mem += mem_attn(j->D, j->H, j->Hkv, j->Tq, j->Tk);
    if (j->kind == CAL_MUL_MAT) mem += mem_mul_mat(j->K, j->N, j->T);
    for (int i = 0; j->kind == CAL_LAYER && i < j->n_shapes; i++) mem += mem_mul_mat(j->shapes[i][0], j->shapes[i][1], j->shapes[i][2]);
    struct kvr_context * ctx = kvr_init(mem, false);
    if (!ctx) { kvr_error(KVR_ERR_NOMEM, "calibrate: cannot allocate %zu MiB", mem >> 20); j->t = -1.0; return NULL; }
    if (j->kind == CAL_MUL_MAT) {
        j->t = time_graph(graph_mul_mat(ctx, j->K, j->N, j->T, j->seed), 5, j->n_threads);
    } else if (j->kind == CAL_ATTN) {
        j->t = time_graph(graph_attn(ctx, j->D, j->H, j->Hkv, j->Tq, j->Tk, j->mode), 5, j->n_threads);
    } else {
        struct kvr_graph * g[16];
        int n = 0;
        for (int i = 0; i < j->n_shapes; i++) {
            struct kvr_graph * gm = graph_mul_mat(ctx, j->shapes[i][0], j->shapes[i][1], j->shapes[i][2], j->seed + (uint64_t)i);
            for (int k = 0; k < j->shapes[i][3] && n < 15; k++) g[n++] = gm;
        }
        g[n++] = graph_attn(ctx, j->D, j->H, j->Hkv, j->Tq, j->Tk, j->mode);
        double t[3];
        j->t = 1.0;
        for (int rep = -1; rep < 3 && j->t > 0; rep++) { // one pass to warm up
            const double t0 = kvr_time_ms();
            for (int k = 0; k < n; k++) {
                if (kvr_graph_compute_cpu(g[(k + j->rot) % n], j->n_threads) != KVR_OK) { j->t = -1.0; break; }
            }
            if (rep >= 0) t[rep] = (kvr_time_ms() - t0) / 1e3;
        }
        if (j->t > 0) j->t = median(t, 3);
    }
    kvr_free(ctx);
    return NULL;
}

// the mean time of the copies, in seconds (negative on failure)
static double time_copies(const struct cal_job * job, int n_copies) {
    struct cal_job jobs[KVR_TUNE_MAX_RANKS];
    pthread_t th[KVR_TUNE_MAX_RANKS];
    int started = 1;
    for (int c = 0; c < n_copies; c++) {
        jobs[c] = *job;
        jobs[c].seed += (uint64_t)c * 101;
        if (job->kind == CAL_LAYER) { // the ranks of a run are at different ops at any time
            int n = 1;
            for (int i = 0; i < job->n_shapes; i++) n += (int)job->shapes[i][3];
            jobs[c].rot = c * n / n_copies;
        }
    }
    for (int c = 1; c < n_copies; c++, started++) {
        if (pthread_create(&th[c], NULL, cal_job_run, &jobs[c]) != 0) break;
    }
    cal_job_run(&jobs[0]);
    double sum = 0.0;
    bool ok = started == n_copies;
    for (int c = 0; c < started; c++) {
        if (c > 0) pthread_join(th[c], NULL);
        ok = ok && jobs[c].t > 0;
        sum += jobs[c].t;
    }
    if (started < n_copies) kvr_error(KVR_ERR_NOMEM, "calibrate: cannot start %d threads", n_copies);
    return ok ? sum / n_copies : -1.0;
}

// the median of CAL_ROUNDS rounds of time_copies
static double time_rounds(const struct cal_job * job, int n_copies) {
    double tr[CAL_ROUNDS];
    for (int round = 0; round < CAL_ROUNDS; round++) {
        tr[round] = time_copies(job, n_copies);
        if (tr[round] <= 0) return -1.0;
    }
    return median(tr, CAL_ROUNDS);
}

int kvr_tune_calibrate(struct kvr_tune_profile * out, enum kvr_attn_mode mode, const struct kvr_tune_model * shape,
                       int n_threads, int n_ranks, FILE * log) {
    struct kvr_tune_profile p;
    kvr_tune_profile_builtin("cpu", &p);
    if (n_threads < 1) n_threads = 1;
    if (n_ranks < 1) n_ranks = 1;
    if (n_ranks > KVR_TUNE_MAX_RANKS) return kvr_error(KVR_ERR_ARG, "calibrate: at most %d ranks", KVR_TUNE_MAX_RANKS);
    char shape_name[40] = "";
    if (shape) snprintf(shape_name, sizeof(shape_name), "-%.30s", shape->name);
    snprintf(p.name, sizeof(p.name), "calibrated%s-%dx%d", shape_name, n_ranks, n_threads);
    p.attn_mode = mode;
    p.matmul_eff = p.attn_eff = 1.0; // peaks are what was reached
    int rc = KVR_OK;

    // matmuls of prefill shapes. With a model: each projection and FFN matrix of one layer over
    // 512 tokens, weighted as a layer runs them (the simulator has one rate for all of them);
    // without: small generic shapes
    int64_t shapes[8][4]; // K, N, T, how many per layer
    int n_shapes = 0;
    if (shape) {
        const int64_t E = shape->n_embd, qd = (int64_t)shape->n_head * shape->head_dim,
                      kvd = (int64_t)shape->n_head_kv * shape->head_dim, F = shape->n_ff;
        const int64_t s[][4] = { { E, qd, 512, 1 }, { E, kvd, 512, 2 }, { qd, E, 512, 1 },
                                 { E, F, 512, shape->n_ffn_mats - 1 }, { F, E, 512, 1 } };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++) memcpy(shapes[n_shapes++], s[i], sizeof(s[i]));
    } else {
        const int64_t s[][4] = { { 768, 768, 256, 1 }, { 768, 2048, 256, 1 }, { 2048, 768, 128, 1 } };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++) memcpy(shapes[n_shapes++], s[i], sizeof(s[i]));
    }
    // Each op alone first (one rank on the machine); with more ranks the rates are divided by
    // what sharing the machine costs (below). CAL_ROUNDS rounds over all shapes, each shape's
    // median round kept: a burst of load from elsewhere then spoils one round of a shape, not all.
    // With a model, every shape also over CAL_LONG tokens: a matmul call costs a part per weight
    // whatever its tokens (sgemm packs its weights), which the two lengths separate from the
    // per-token FLOPs; 2 threads on 512 tokens run the FFN's down projection ~15% slower per FLOP
    // than on 2048.
    const int n_len = shape ? 2 : 1;
    double rounds[2][8][CAL_ROUNDS];
    for (int round = 0; round < CAL_ROUNDS && rc == KVR_OK; round++) {
        for (int li = 0; li < n_len && rc == KVR_OK; li++) {
            for (int i = 0; i < n_shapes && rc == KVR_OK; i++) {
                const struct cal_job job = { .kind = CAL_MUL_MAT, .K = shapes[i][0], .N = shapes[i][1],
                                             .T = li ? CAL_LONG : shapes[i][2], .n_threads = n_threads, .seed = 1 + (uint64_t)i };
                rounds[li][i][round] = time_copies(&job, 1);
                if (rounds[li][i][round] <= 0) rc = KVR_ERR_ARG;
            }
        }
    }
    double flops = 0.0, secs[2] = { 0.0, 0.0 }, weights = 0.0;
    for (int li = 0; li < n_len && rc == KVR_OK; li++) {
        for (int i = 0; i < n_shapes; i++) {
            const int64_t K = shapes[i][0], N = shapes[i][1], T = li ? CAL_LONG : shapes[i][2], mult = shapes[i][3];
            const double t = median(rounds[li][i], CAL_ROUNDS);
            if (li == 0) {
                flops += 2.0 * K * N * T * mult;
                weights += (double)K * N * mult;
            }
            secs[li] += t * mult;
            if (log) fprintf(log, "calibrate: MUL_MAT [%lld x %lld] x %lld tokens, %d thread%s alone: %.2f ms, %.2f GFLOP/s\n",
                             (long long)K, (long long)N, (long long)T, n_threads, n_threads > 1 ? "s" : "", t * 1e3, 2.0 * K * N * T / t / 1e9);
        }
    }
    if (rc == KVR_OK) {
        p.matmul_flops = flops / secs[0];
        p.matmul_weight_s = 0.0;
        if (shape) {
            // t(T) = T * per_token + weights * matmul_weight_s, through both lengths (the 512 of
            // every shape above is what T0 stands for)
            const double T0 = (double)shapes[0][2], per_token = (secs[1] - secs[0]) / (CAL_LONG - T0);
            const double fixed = secs[0] - T0 * per_token;
            if (per_token > 0 && fixed > 0) {
                p.matmul_flops = flops / T0 / per_token;
                p.matmul_weight_s = fixed / weights;
            }
            if (log) fprintf(log, "calibrate: a layer's matmuls: %.2f ms over %.0f tokens, %.2f ms over %d: %.2f GFLOP/s plus %.3f ns "
                             "per weight and call\n", secs[0] * 1e3, T0, secs[1] * 1e3, CAL_LONG, p.matmul_flops / 1e9,
                             p.matmul_weight_s * 1e9);
        }
    }
    struct cal_job attn_job = { 0 };

    if (shape && rc == KVR_OK) {
        // attention as the model runs it: the last 512 queries of a 2048-token prompt, the model's
        // head dim and grouping (the kernel packs the heads of a KV head into one tile), all of its
        // time charged as FLOPs at this head dim
        const int D = shape->head_dim, Tq = 512, Tk = 2048;
        const struct cal_job job = { .kind = CAL_ATTN, .D = D, .H = shape->n_head, .Hkv = shape->n_head_kv, .Tq = Tq, .Tk = Tk,
                                     .mode = mode, .n_threads = n_threads };
        attn_job = job;
        const double t = time_rounds(&job, 1);
        if (t <= 0) rc = KVR_ERR_ARG;
        else {
            int64_t dense, causal;
            struct runs rq = runs_range(Tk - Tq, Tq), rk = runs_range(0, Tk);
            attn_pairs(&rq, &rk, tile_tokens(shape, &p), p.attn_tile_k, mode, &dense, &causal);
            const double per_pair = t / ((double)dense * shape->n_head);
            p.attn_flops = 4.0 * D / per_pair;
            p.attn_pair_s = 0.0;
            if (log) fprintf(log, "calibrate: ATTN head_dim %d, %d/%d heads, %d queries x %d keys (%s, %lld pairs per head): %.2f ms, "
                             "%.2f ns per pair and head = %.2f GFLOP/s\n", D, shape->n_head, shape->n_head_kv, Tq, Tk,
                             mode == KVR_ATTN_DENSE ? "dense" : "causal", (long long)dense, t * 1e3, per_pair * 1e9, p.attn_flops / 1e9);
        }
    } else if (rc == KVR_OK) {
        // attention without a model: the last 256 queries of a 1024-token prompt over all of it
        // (MHA), at two head dims: time per pair and head = 4*D/attn_flops + attn_pair_s, so the
        // FLOP rate and the softmax's own cost (which a small head dim cannot hide) come apart
        double per_pair[2] = { 0, 0 };
        const int dims[2] = { 64, 8 };
        for (int di = 0; di < 2 && rc == KVR_OK; di++) {
            const int D = dims[di], H = 4, Tq = 256, Tk = 1024;
            const struct cal_job job = { .kind = CAL_ATTN, .D = D, .H = H, .Hkv = H, .Tq = Tq, .Tk = Tk, .mode = mode,
                                         .n_threads = n_threads };
            const double t = time_copies(&job, 1);
            if (di == 0) attn_job = job;
            if (t <= 0) { rc = KVR_ERR_ARG; break; }
            int64_t dense, causal;
            struct runs rq = runs_range(Tk - Tq, Tq), rk = runs_range(0, Tk);
            attn_pairs(&rq, &rk, p.attn_tile_q, p.attn_tile_k, mode, &dense, &causal); // MHA: attn_tile_q tokens a tile
            per_pair[di] = t / ((double)dense * H);
            if (log) fprintf(log, "calibrate: ATTN head_dim %d, %d queries x %d keys (%s, %lld pairs per head): %.2f ms, %.2f ns per pair and head\n",
                             D, Tq, Tk, mode == KVR_ATTN_DENSE ? "dense" : "causal", (long long)dense, t * 1e3, per_pair[di] * 1e9);
        }
        if (rc == KVR_OK) {
            const double slope = (per_pair[0] - per_pair[1]) / (4.0 * (dims[0] - dims[1])); // s per FLOP
            if (slope > 0 && per_pair[1] - slope * 4.0 * dims[1] >= 0) {
                p.attn_flops = 1.0 / slope;
                p.attn_pair_s = per_pair[1] - slope * 4.0 * dims[1];
            } else { // timing noise: all of it FLOPs
                p.attn_flops = 4.0 * dims[0] / per_pair[0];
                p.attn_pair_s = 0.0;
            }
            if (log) fprintf(log, "calibrate: attention %.2f GFLOP/s plus %.2f ns per pair and head\n", p.attn_flops / 1e9, p.attn_pair_s * 1e9);
        }
    }
    if (rc == KVR_OK && n_ranks > 1) {
        // What sharing the machine costs: a layer's mix of ops (its matmuls, then the attention),
        // run alone and by n_ranks copies at once, each copy starting at a different op as the
        // ranks of a run are at different ops at any moment (copies running the same op together
        // would overstate it: two attentions at once contend more than an attention beside an
        // FFN). The rates become those of a rank among busy ranks; the ratio is solo_speedup.
        struct cal_job layer = attn_job;
        layer.kind = CAL_LAYER;
        layer.shapes = (const int64_t (*)[4])shapes;
        layer.n_shapes = n_shapes;
        layer.seed = 1;
        const double alone = time_rounds(&layer, 1), shared = alone > 0 ? time_rounds(&layer, n_ranks) : -1.0;
        if (alone <= 0 || shared <= 0) rc = KVR_ERR_ARG;
        else {
            p.solo_speedup = fmax(1.0, shared / alone);
            p.matmul_flops /= p.solo_speedup;
            p.matmul_weight_s *= p.solo_speedup;
            p.attn_flops /= p.solo_speedup;
            p.attn_pair_s *= p.solo_speedup;
            if (log) fprintf(log, "calibrate: a layer's ops alone %.2f ms, beside %d other rank%s %.2f ms: the rates above / %.3f "
                             "(solo_speedup)\n", alone * 1e3, n_ranks - 1, n_ranks > 2 ? "s" : "", shared * 1e3, p.solo_speedup);
        }
    }
    if (rc != KVR_OK) return kvr_error_prefix(KVR_ERR_ARG, "calibrate: a benchmark graph failed");

    // memory: a copy larger than the caches; local ranks pass messages by the same copy
    const size_t n = 64u << 20;
    char * a = malloc(n), * b = malloc(n);
    if (!a || !b) { free(a); free(b); return kvr_error(KVR_ERR_NOMEM, "calibrate: cannot allocate 128 MiB"); }
    memset(a, 1, n);
    memset(b, 2, n);
    double best = INFINITY;
    for (int i = 0; i < 4; i++) {
        const double t0 = kvr_time_ms();
        memcpy(i & 1 ? a : b, i & 1 ? b : a, n);
        best = fmin(best, (kvr_time_ms() - t0) / 1e3);
    }
    p.mem_bw = 2.0 * (double)n / best; // bytes read plus bytes written
    p.link_bw = (double)n / best;      // a message of n bytes is one copy
    if (log) fprintf(log, "calibrate: memcpy of %zu MiB: %.2f ms, %.2f GB/s\n", n >> 20, best * 1e3, (double)n / best / 1e9);
    free(a);
    free(b);

    // latency: a hand-off between two threads under a mutex, as the local transport does
    struct pingpong pp = { .turn = 0, .n = 2000 };
    pthread_mutex_init(&pp.mu, NULL);
    pthread_cond_init(&pp.cv, NULL);
    pthread_t th;
    if (pthread_create(&th, NULL, pong, &pp) != 0) return kvr_error(KVR_ERR_NOMEM, "calibrate: cannot start a thread");
    const double t0 = kvr_time_ms();
    pthread_mutex_lock(&pp.mu);
    for (int i = 0; i < pp.n; i++) {
        pp.turn = 1;
        pthread_cond_broadcast(&pp.cv);
        while (pp.turn != 0) pthread_cond_wait(&pp.cv, &pp.mu);
    }
    pthread_mutex_unlock(&pp.mu);
    const double rt = (kvr_time_ms() - t0) / 1e3 / pp.n;
    pthread_join(th, NULL);
    pthread_mutex_destroy(&pp.mu);
    pthread_cond_destroy(&pp.cv);
    p.link_latency = rt / 2.0;
    if (log) fprintf(log, "calibrate: thread hand-off: %.1f us one way\n", p.link_latency * 1e6);
    *out = p;
    return KVR_OK;
}
