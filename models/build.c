// models/build.c - the helper layer the architectures' recipes are written in, in the manner of
// llama.cpp's build_norm / build_ffn / build_attn: a recipe (models/llama.c, ...) says which
// pieces a layer has and in what order, the helpers here say how each piece becomes ops.
//
//   load_layer_attn / load_layer_ffn   find and shape-check a layer's weights
//   load_rows                          rows of a fused weight as a weight of its own (no copy)
//   load_rope_freqs                    Llama 3's per-pair RoPE frequency divisors, if present
//   load_rope_longrope                 Phi-3's short and long LongRoPE divisors, if present
//   load_swa_layers                    which layers have a sliding window, their window and RoPE base
//   cb                                 names a node "blk.<il>.<name>" (or "<name>" for il < 0)
//   build_norm                         RMS or layer norm x weight (+ bias)
//   build_rope                         RoPE with the model's mode, the layer's base and scale, the
//                                      model's per-pair frequency factors (Llama 3; Phi-3's short or
//                                      long ones by the context) and its attention factor, or YaRN
//   build_qkv                          separate Q/K/V projections (+ biases), as heads
//   build_attn                         q/k norms, RoPE, the ATTN_BLOCK a strategy pass rewrites
//                                      (with the layer's window and sinks and the model's score
//                                      soft-capping), the output projection (+ bias)
//   build_ffn                          gated (act(gate x) * up x) or plain (act(up x)) FFN
//   load_moe_hparams / load_layer_moe  a mixture of experts' counts, its router and expert tensors
//   build_moe                          route, the experts' gated FFNs (MUL_MAT_ID), their weighted sum
//   build_last_rows                    in the last layer, only the rows whose logits are wanted
//   build_output                       final norm and the output matrix
//
// Compiled as part of kvr.c (included before the recipes), so it uses kvr.c's internal helpers.

// What every recipe builds with.
struct mb {
    const struct kvr_model   * m;
    const struct kvr_hparams * hp;
    const struct kvr_build   * b;
    struct kvr_context       * ctx;
    int64_t                    T;     // tokens of this batch
};

static struct mb mb_init(const struct kvr_model * m, const struct kvr_build * b) {
    return (struct mb) { .m = m, .hp = &m->hp, .b = b, .ctx = b->ctx, .T = b->n_tokens };
}

enum mb_norm { MB_NORM_RMS, MB_NORM_LAYER };
enum mb_act  { MB_ACT_SILU, MB_ACT_GELU, MB_ACT_GELU_EXACT, MB_ACT_SWIGLU_OAI };

//
// loading
//

// What a layer's attention must have beyond the norm and the four projections: the others are
// loaded when the file has them and left NULL when it does not.
enum {
    NEED_QKV_BIAS  = 1, // attn_q/k/v.bias (qwen2)
    NEED_QK_NORM   = 2, // attn_q_norm/attn_k_norm.weight [head_dim] (qwen3, gemma3)
    NEED_POST_NORM = 4, // post_attention_norm/post_ffw_norm.weight (gemma3)
};

// A layer with separate Q/K/V projections (llama, qwen, gemma). Q is head_dim*n_head wide, which
// need not be n_embd (qwen3, gemma3).
static int load_layer_attn(struct kvr_model * m, uint32_t il, unsigned need) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = hp->n_embd, D = hp->head_dim, q = D * hp->n_head, kv = D * hp->n_head_kv;
    const bool bias = need & NEED_QKV_BIAS, qkn = need & NEED_QK_NORM, post = need & NEED_POST_NORM;
    if (model_tensor(m, &l->attn_norm, true, 1, E, 1, "blk.%u.attn_norm.weight", il) ||
        model_tensor(m, &l->wq, true, 2, E, q, "blk.%u.attn_q.weight", il) ||
        model_tensor(m, &l->wk, true, 2, E, kv, "blk.%u.attn_k.weight", il) ||
        model_tensor(m, &l->wv, true, 2, E, kv, "blk.%u.attn_v.weight", il) ||
        model_tensor(m, &l->wo, true, 2, q, E, "blk.%u.attn_output.weight", il) ||
        model_tensor(m, &l->bq, bias, 1, q, 1, "blk.%u.attn_q.bias", il) ||
        model_tensor(m, &l->bk, bias, 1, kv, 1, "blk.%u.attn_k.bias", il) ||
        model_tensor(m, &l->bv, bias, 1, kv, 1, "blk.%u.attn_v.bias", il) ||
        model_tensor(m, &l->bo, false, 1, E, 1, "blk.%u.attn_output.bias", il) ||
        model_tensor(m, &l->attn_q_norm, qkn, 1, D, 1, "blk.%u.attn_q_norm.weight", il) ||
        model_tensor(m, &l->attn_k_norm, qkn, 1, D, 1, "blk.%u.attn_k_norm.weight", il) ||
        model_tensor(m, &l->attn_post_norm, post, 1, E, 1, "blk.%u.post_attention_norm.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    if (!l->attn_q_norm != !l->attn_k_norm) {
        return kvr_error(KVR_ERR_FORMAT, "%s: layer %u has only one of attn_q_norm and attn_k_norm", m->path, il);
    }
    return KVR_OK;
}

// The FFN norm and matrices: gated (gate, up, down) or plain (up, down), with optional biases.
static int load_layer_ffn(struct kvr_model * m, uint32_t il, bool gated, unsigned need) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = hp->n_embd, F = hp->n_ff;
    if (model_tensor(m, &l->ffn_norm, true, 1, E, 1, "blk.%u.ffn_norm.weight", il) ||
        (gated && model_tensor(m, &l->ffn_gate, true, 2, E, F, "blk.%u.ffn_gate.weight", il)) ||
        model_tensor(m, &l->ffn_up, true, 2, E, F, "blk.%u.ffn_up.weight", il) ||
        model_tensor(m, &l->ffn_down, true, 2, F, E, "blk.%u.ffn_down.weight", il) ||
        model_tensor(m, &l->ffn_post_norm, need & NEED_POST_NORM, 1, E, 1, "blk.%u.post_ffw_norm.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

// Rows [row0, row0 + n) of the loaded weight fused [ne0, rows] as a weight [ne0, n] of its own,
// named `name`: a tensor over the same bytes of the file (whole rows: whole quant blocks), so a
// fused projection (Phi-3's attn_qkv, its gate-up ffn_up) is split with no copy and each part is
// an ordinary matrix product.
static struct kvr_tensor * load_rows(struct kvr_model * m, const struct kvr_tensor * fused, int64_t row0, int64_t n,
                                     const char * name, int il) {
    const struct kvr_gguf_tensor * gt = kvr_gguf_get_tensor(m->gguf, fused->name); // where the file has it
    KVR_ASSERT(gt && fused->buffer == m->weights && row0 >= 0 && n > 0 && row0 + n <= fused->ne[1]);
    if (fused->flags & KVR_FLAG_TILED) { // the parts are rows of the file's layout: the fused weight goes back to it
        KVR_ASSERT(!m->parent);
        kvr_weight_untile((struct kvr_tensor *)fused);
        for (int i = 0; i < m->n_tiled; i++) {
            if (m->tiled[i] == gt->offset) m->tiled[i--] = m->tiled[--m->n_tiled];
        }
    }
    const int64_t ne[2] = { fused->ne[0], n };
    struct kvr_tensor * t = kvr_new_tensor(m->ctx, fused->type, 2, ne);
    kvr_buffer_place(m->weights, t, gt->offset + (size_t)row0 * fused->nb[1]);
    t->flags = KVR_FLAG_PARAM;
    snprintf(t->name, sizeof(t->name), "blk.%d.%s", il, name);
    return t;
}

// Llama 3.1+: rope_freqs.weight, the per-pair divisors of RoPE's frequencies (f32 [n_rot/2]);
// every layer uses them (build_rope)
static int load_rope_freqs(struct kvr_model * m) {
    if (model_tensor(m, &m->rope_freqs, false, 1, m->hp.n_rot / 2, 1, "rope_freqs.weight")) return KVR_ERR_FORMAT;
    if (m->rope_freqs && m->rope_freqs->type != KVR_TYPE_F32) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: tensor 'rope_freqs.weight' has type %s; kvr reads it as f32 only",
                         m->path, kvr_type_name(m->rope_freqs->type));
    }
    return KVR_OK;
}

// Phi-3: rope_factors_short.weight and rope_factors_long.weight, LongRoPE's per-pair divisors
// (f32 [n_rot/2]) for contexts up to rope.scaling.original_context_length and past it; both or
// neither (build_rope picks one by the context)
static int load_rope_longrope(struct kvr_model * m) {
    static const char * const names[2] = { "rope_factors_short.weight", "rope_factors_long.weight" };
    struct kvr_tensor ** out[2] = { &m->rope_short, &m->rope_long };
    for (int i = 0; i < 2; i++) {
        if (model_tensor(m, out[i], false, 1, m->hp.n_rot / 2, 1, "%s", names[i])) return KVR_ERR_FORMAT;
        if (*out[i] && (*out[i])->type != KVR_TYPE_F32) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s; kvr reads it as f32 only", m->path, names[i],
                             kvr_type_name((*out[i])->type));
        }
    }
    if (!m->rope_short != !m->rope_long) {
        return kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' is missing (LongRoPE needs both '%s' and '%s')", m->path,
                         names[m->rope_short ? 1 : 0], names[0], names[1]);
    }
    return KVR_OK;
}

// Which layers attend over a sliding window (gemma2, gemma3, gpt-oss): attention.sliding_window_pattern as one
// bool per layer (true: local), or a period n (every n-th layer global, il % n == n-1; n_default
// when the key is absent; 0: every layer local), as llama.cpp's load_swa_pattern.
static int load_swa_pattern(struct kvr_model * m, bool * local, uint32_t n_default) {
    const struct kvr_hparams * hp = &m->hp;
    const char * key = arch_key(m, "attention.sliding_window_pattern");
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(m->gguf, key);
    if (kv && kv->type == KVR_GGUF_ARRAY) {
        if (kv->arr_type != KVR_GGUF_BOOL || kv->n != hp->n_layer) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is an array of %" PRIu64 " %s, expected %u bools (one per layer)",
                             m->path, key, kv->n, kvr_gguf_type_name(kv->arr_type), hp->n_layer);
        }
        for (uint32_t il = 0; il < hp->n_layer; il++) local[il] = ((const uint8_t *)kv->data)[il] != 0;
        return KVR_OK;
    }
    uint32_t n = n_default;
    if (hp_u32(m, "attention.sliding_window_pattern", &n, false, n_default)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < hp->n_layer; il++) local[il] = n == 0 || il % n < n - 1;
    return KVR_OK;
}

// The sliding-window (local) layers of load_swa_pattern get the window hp->n_swa and the RoPE base
// base_swa; reset_scale: their RoPE without the global layers' scaling (Gemma's local layers; gpt-oss
// keeps YaRN on them, as llama.cpp).
static int load_swa_layers(struct kvr_model * m, uint32_t n_default, float base_swa, bool reset_scale) {
    bool * local = kvr_calloc(m->hp.n_layer, sizeof(bool));
    const int rc = load_swa_pattern(m, local, n_default);
    for (uint32_t il = 0; il < m->hp.n_layer && rc == KVR_OK; il++) {
        if (!local[il]) continue;
        m->layers[il].window    = m->hp.n_swa;
        m->layers[il].rope_base = base_swa;
        if (reset_scale) m->layers[il].rope_scale = 1.0f;
    }
    free(local);
    return rc;
}

//
// building
//

static struct kvr_tensor * cb(struct kvr_tensor * t, const char * name, int il) {
    return il >= 0 ? kvr_set_name(t, "blk.%d.%s", il, name) : kvr_set_name(t, "%s", name);
}

// norm(x) * w (+ b); the result is named `name`, the bare norm "<name>_raw"
static struct kvr_tensor * build_norm(struct mb * g, struct kvr_tensor * x, struct kvr_tensor * w, struct kvr_tensor * b,
                                      enum mb_norm kind, const char * name, int il) {
    char raw[KVR_MAX_NAME];
    snprintf(raw, sizeof(raw), "%s_raw", name);
    x = kind == MB_NORM_RMS ? kvr_rms_norm(g->ctx, x, g->hp->norm_eps) : kvr_norm(g->ctx, x, g->hp->norm_eps);
    if (!w) return cb(x, name, il);
    x = cb(kvr_mul(g->ctx, cb(x, raw, il), w), name, il);
    return b ? cb(kvr_add(g->ctx, x, b), name, il) : x;
}

// The per-pair frequency divisors of this build: Llama 3's, or Phi-3's LongRoPE ones chosen by the
// context as llama.cpp chooses them (its n_ctx, rounded up to a multiple of 256, past
// original_context_length: the long factors; the prompt's length does not count), or none.
bool kvr_model_rope_long(const struct kvr_model * m, int n_ctx) {
    return m->rope_long && ((int64_t)n_ctx + 255) / 256 * 256 > (int64_t)m->hp.rope_n_ctx_orig;
}

static struct kvr_tensor * build_rope_factors(const struct mb * g) {
    if (!g->m->rope_long) return g->m->rope_freqs;
    return kvr_model_rope_long(g->m, g->b->n_ctx) ? g->m->rope_long : g->m->rope_short;
}

// x: [head_dim, heads, T], rotated at the batch's positions with the layer's parameters
static struct kvr_tensor * build_rope(struct mb * g, struct kvr_tensor * x, const char * name, int il) {
    const struct kvr_layer * l = &g->m->layers[il];
    const struct kvr_hparams * hp = g->hp;
    if (hp->rope_ext_factor != 0.0f) { // YaRN: the ramp's dims follow the layer's base, as ggml's rope op does
        float lo, hi;
        kvr_rope_yarn_corr_dims((int)hp->n_rot, (int)hp->rope_n_ctx_orig, l->rope_base, 32.0f, 1.0f, &lo, &hi);
        return cb(kvr_rope_yarn(g->ctx, x, g->b->pos, build_rope_factors(g), (int)hp->n_rot, hp->rope_mode, l->rope_base,
                                l->rope_scale, hp->rope_ext_factor, hp->rope_attn_factor, lo, hi), name, il);
    }
    return cb(kvr_rope(g->ctx, x, g->b->pos, build_rope_factors(g), (int)hp->n_rot, hp->rope_mode, l->rope_base,
                       l->rope_scale, hp->rope_attn_factor),
              name, il);
}

// the separate projections of h, with their biases, as heads: q [D, H, T], k and v [D, Hkv, T]
static void build_qkv(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * h, int il,
                      struct kvr_tensor ** q, struct kvr_tensor ** k, struct kvr_tensor ** v) {
    const int64_t D = g->hp->head_dim, H = g->hp->n_head, Hkv = g->hp->n_head_kv;
    *q = cb(kvr_mul_mat(g->ctx, l->wq, h), "q", il);
    *k = cb(kvr_mul_mat(g->ctx, l->wk, h), "k", il);
    *v = cb(kvr_mul_mat(g->ctx, l->wv, h), "v", il);
    if (l->bq) *q = cb(kvr_add(g->ctx, *q, l->bq), "q_b", il);
    if (l->bk) *k = cb(kvr_add(g->ctx, *k, l->bk), "k_b", il);
    if (l->bv) *v = cb(kvr_add(g->ctx, *v, l->bv), "v_b", il);
    *q = kvr_reshape_3d(g->ctx, *q, D, H, g->T);
    *k = kvr_reshape_3d(g->ctx, *k, D, Hkv, g->T);
    *v = kvr_reshape_3d(g->ctx, *v, D, Hkv, g->T);
}

// The attention of layer il over q, k, v (as heads): the per-head q/k norms where the layer has
// them, RoPE, the ATTN_BLOCK node with the layer's window and the given score scale, then the
// output projection (+ bias). k and v must be contiguous: the strategy passes reshape them.
static struct kvr_tensor * build_attn(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * q,
                                      struct kvr_tensor * k, struct kvr_tensor * v, float scale, int il) {
    if (l->attn_q_norm) q = build_norm(g, q, l->attn_q_norm, NULL, MB_NORM_RMS, "q_norm", il);
    if (l->attn_k_norm) k = build_norm(g, k, l->attn_k_norm, NULL, MB_NORM_RMS, "k_norm", il);
    q = build_rope(g, q, "q_rope", il);
    k = build_rope(g, k, "k_rope", il);
    struct kvr_tensor * a = cb(kvr_attn_sinks(kvr_attn_block(g->ctx, q, k, v, g->b->pos, il, scale, g->hp->attn_softcap,
                                                             (int)l->window), l->attn_sinks),
                               "attn", il);
    struct kvr_tensor * o = cb(kvr_mul_mat(g->ctx, l->wo, kvr_attn_out(g->ctx, a, (int)g->hp->n_head)), "attn_proj", il);
    return l->bo ? cb(kvr_add(g->ctx, o, l->bo), "attn_proj_b", il) : o;
}

// down(act(gate x) * up x) when gate is given, else down(act(up x)); biases where given
static struct kvr_tensor * build_ffn(struct mb * g, struct kvr_tensor * x, struct kvr_tensor * up, struct kvr_tensor * up_b,
                                     struct kvr_tensor * gate, struct kvr_tensor * down, struct kvr_tensor * down_b,
                                     enum mb_act act, int il) {
    struct kvr_context * ctx = g->ctx;
    struct kvr_tensor * u = cb(kvr_mul_mat(ctx, up, x), "ffn_up", il);
    if (up_b) u = cb(kvr_add(ctx, u, up_b), "ffn_up_b", il);
    struct kvr_tensor * a = gate ? cb(kvr_mul_mat(ctx, gate, x), "ffn_gate", il) : u;
    a = cb(act == MB_ACT_SILU ? kvr_silu(ctx, a) : act == MB_ACT_GELU ? kvr_gelu(ctx, a) : kvr_gelu_exact(ctx, a),
           act == MB_ACT_SILU ? "ffn_silu" : "ffn_gelu", il);
    if (gate) a = cb(kvr_mul(ctx, a, u), "ffn_gated", il);
    struct kvr_tensor * d = cb(kvr_mul_mat(ctx, down, a), "ffn_down", il);
    return down_b ? cb(kvr_add(ctx, d, down_b), "ffn_down_b", il) : d;
}

// A mixture of experts' counts: expert_count and expert_used_count (required, 1 <= used <= count),
// expert_feed_forward_length (llama.cpp's default when absent: feed_forward_length / used).
static int load_moe_hparams(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_u32(m, "expert_count", &hp->n_expert, true, 0) || hp_u32(m, "expert_used_count", &hp->n_expert_used, true, 0)) {
        return KVR_ERR_FORMAT;
    }
    if (hp->n_expert == 0 || hp->n_expert > 4096) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not a count from 1 to 4096", m->path,
                         arch_key(m, "expert_count"), hp->n_expert);
    }
    if (hp->n_expert_used == 0 || hp->n_expert_used > hp->n_expert) {
        char count[128];
        snprintf(count, sizeof(count), "%s", arch_key(m, "expert_count"));
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not a count from 1 to '%s' = %u", m->path,
                         arch_key(m, "expert_used_count"), hp->n_expert_used, count, hp->n_expert);
    }
    if (hp_u32(m, "expert_feed_forward_length", &hp->n_ff_exp, false, hp->n_ff / hp->n_expert_used)) return KVR_ERR_FORMAT;
    if (hp->n_ff_exp == 0) {
        char ffn[128]; // arch_key's buffer is one: the second key is formatted into it later
        snprintf(ffn, sizeof(ffn), "%s", arch_key(m, "feed_forward_length"));
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing (and '%s' gives no width)", m->path,
                         arch_key(m, "expert_feed_forward_length"), ffn);
    }
    return KVR_OK;
}

// The FFN norm (ffn_norm.weight, or another norm a recipe names: norm NULL keeps it), the router
// ffn_gate_inp [n_embd -> n_expert] and the experts ffn_{gate,up}_exps [n_embd, n_ff_exp, n_expert],
// ffn_down_exps [n_ff_exp, n_embd, n_expert]; with biases (the router's, each expert's: gpt-oss)
// where the file has them.
static int load_layer_moe(struct kvr_model * m, uint32_t il, bool norm) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = hp->n_embd, F = hp->n_ff_exp, X = hp->n_expert;
    if ((norm && model_tensor(m, &l->ffn_norm, true, 1, E, 1, "blk.%u.ffn_norm.weight", il)) ||
        model_tensor(m, &l->ffn_gate_inp, true, 2, E, X, "blk.%u.ffn_gate_inp.weight", il) ||
        model_tensor(m, &l->ffn_gate_inp_b, false, 1, X, 1, "blk.%u.ffn_gate_inp.bias", il) ||
        model_tensor_3d(m, &l->ffn_gate_exps, true, E, F, X, "blk.%u.ffn_gate_exps.weight", il) ||
        model_tensor_3d(m, &l->ffn_up_exps, true, E, F, X, "blk.%u.ffn_up_exps.weight", il) ||
        model_tensor_3d(m, &l->ffn_down_exps, true, F, E, X, "blk.%u.ffn_down_exps.weight", il) ||
        model_tensor(m, &l->ffn_gate_exps_b, false, 2, F, X, "blk.%u.ffn_gate_exps.bias", il) ||
        model_tensor(m, &l->ffn_up_exps_b, false, 2, F, X, "blk.%u.ffn_up_exps.bias", il) ||
        model_tensor(m, &l->ffn_down_exps_b, false, 2, E, X, "blk.%u.ffn_down_exps.bias", il)) {
        return KVR_ERR_FORMAT;
    }
    const struct kvr_tensor * f32[] = { l->ffn_gate_inp_b, l->ffn_gate_exps_b, l->ffn_up_exps_b, l->ffn_down_exps_b };
    for (size_t i = 0; i < sizeof(f32) / sizeof(f32[0]); i++) {
        if (f32[i] && f32[i]->type != KVR_TYPE_F32) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s; kvr reads expert biases as f32 only",
                             m->path, f32[i]->name, kvr_type_name(f32[i]->type));
        }
    }
    return KVR_OK;
}

// The mixture of experts of layer il over x [n_embd, T]: the router's logits (+ bias), each token's
// experts and weights by `gating`, the experts' gated FFNs (act(gate x) * up x, + their biases) by
// MUL_MAT_ID (only the picked experts' rows are read), down, and the weighted sum per token.
static struct kvr_tensor * build_moe(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * x,
                                     enum kvr_moe_gating gating, enum mb_act act, int il) {
    struct kvr_context * ctx = g->ctx;
    struct kvr_tensor * logits = cb(kvr_mul_mat(ctx, l->ffn_gate_inp, x), "ffn_moe_logits", il);
    if (l->ffn_gate_inp_b) logits = cb(kvr_add(ctx, logits, l->ffn_gate_inp_b), "ffn_moe_logits_b", il);
    struct kvr_tensor * route = cb(kvr_moe_route(ctx, logits, (int)g->hp->n_expert_used, gating), "ffn_moe_route", il);
    struct kvr_tensor * up = cb(kvr_mul_mat_id(ctx, l->ffn_up_exps, x, route, l->ffn_up_exps_b), "ffn_moe_up", il);
    struct kvr_tensor * gate = cb(kvr_mul_mat_id(ctx, l->ffn_gate_exps, x, route, l->ffn_gate_exps_b), "ffn_moe_gate", il);
    struct kvr_tensor * a;
    if (act == MB_ACT_SWIGLU_OAI) {
        // gpt-oss's constants are in llama.cpp's code, not in the file
        a = cb(kvr_swiglu_oai(ctx, gate, up, 1.702f, 7.0f), "ffn_moe_swiglu", il);
    } else {
        a = act == MB_ACT_SILU ? kvr_silu(ctx, gate) : kvr_gelu(ctx, gate);
        a = cb(kvr_mul(ctx, cb(a, "ffn_moe_act", il), up), "ffn_moe_gated", il);
    }
    struct kvr_tensor * down = cb(kvr_mul_mat_id(ctx, l->ffn_down_exps, a, route, l->ffn_down_exps_b), "ffn_moe_down", il);
    return cb(kvr_moe_sum(ctx, down, route), "ffn_moe_out", il);
}

// In the last layer, after the attention, only the rows whose logits are wanted go on: the last
// n_outputs of the T rows of t [ne0, T]. Elsewhere t itself.
static struct kvr_tensor * build_last_rows(struct mb * g, struct kvr_tensor * t, int il) {
    const int64_t n = g->b->n_outputs;
    if (il != (int)g->hp->n_layer - 1 || n <= 0 || n >= g->T) return t;
    return kvr_view_2d(g->ctx, t, t->ne[0], n, t->nb[1], (size_t)(g->T - n) * t->nb[1]);
}

// the token embeddings of the batch
static struct kvr_tensor * build_inp_embd(struct mb * g) {
    return cb(kvr_get_rows(g->ctx, g->m->tok_embd, g->b->tokens), "inp_embd", -1);
}

// the final norm and the output matrix: the logits [n_vocab, n_outputs], soft-capped where the
// model says (gemma2); with no outputs wanted, the last layer's state itself
static struct kvr_tensor * build_output(struct mb * g, struct kvr_tensor * x, enum mb_norm kind) {
    if (g->b->n_outputs == 0) return x;
    x = build_norm(g, x, g->m->output_norm, g->m->output_norm_b, kind, "out_norm", -1);
    x = cb(kvr_mul_mat(g->ctx, g->m->output, x), "logits", -1);
    return g->hp->final_softcap > 0.0f ? cb(kvr_softcap(g->ctx, x, g->hp->final_softcap), "logits_capped", -1) : x;
}
