// models/qwen35.c - Qwen3.5 (dense) as GGUF stores it (llama.cpp's qwen35 graph): Gated DeltaNet
// layers, which carry a recurrent state instead of K/V rows, beside gated full-attention layers.
// Layer il is a full-attention one iff (il+1) % full_attention_interval == 0 (default 4), unless
// the file lists attention.recurrent_layers (one flag per layer), which llama.cpp prefers.
//
//   h  = x + mixer(rms(x) attn_norm)
//   x' = h + ffn(rms(h) post_attention_norm)        (post_attention_norm is the FFN's pre-norm)
//
// full attention: attn_q gives per head q (head_dim) then a gate (head_dim); q/k RMS norms; RoPE
//   on rotated halves over the first rope.dimension_count dims (llama.cpp's IMROPE, whose sections
//   give a text token the same position in every pair kvr rotates: the loader checks that);
//   out = attn_output(attn(q, k, v) * sigmoid(gate))
// Gated DeltaNet: qkv = attn_qkv x (q | k | v), z = attn_gate x, beta = sigmoid(ssm_beta x),
//   g = softplus(ssm_alpha x + ssm_dt.bias) * ssm_a; the GDN_BLOCK (short convolution, L2 norms,
//   the gated delta rule; its state is the strategy pass's); per value head o = rms(o) ssm_norm
//   * silu(z); out = ssm_out o
//
// Norm weights are used as stored (the converter already added Qwen's 1 to them; ssm_norm has
// none). qwen35moe is this graph with a mixture-of-experts FFN: qwen35_load_layers and
// qwen35_graph take the FFN's loader and builder. Compiled as part of kvr.c, over models/build.c.
//
// qwen35moe (Qwen3.5-MoE, llama.cpp's qwen35moe graph): every FFN is
//   moe(x) + sigmoid(ffn_gate_inp_shexp . x) * down_shexp(silu(gate_shexp x) * up_shexp x)
// routed as qwen3moe (softmax over the experts, the top k, renormalised: llama.cpp passes true for
// this architecture and the file has no key for it); the shared expert's gate is one value a token.

typedef int (*qwen35_ffn_load_fn)(struct kvr_model * m, uint32_t il);
typedef struct kvr_tensor * (*qwen35_ffn_build_fn)(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * x, int il);

// which layers are recurrent: attention.recurrent_layers (bools or integers, one per layer), else
// every layer but each full_attention_interval-th
static int qwen35_layer_kinds(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    const char * key = arch_key(m, "attention.recurrent_layers");
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(m->gguf, key);
    memset(hp->recurrent, 0, sizeof(hp->recurrent));
    if (kv) {
        const bool ints = kv->arr_type == KVR_GGUF_INT32 || kv->arr_type == KVR_GGUF_UINT32;
        if (kv->type != KVR_GGUF_ARRAY || (kv->arr_type != KVR_GGUF_BOOL && !ints) || kv->n != hp->n_layer) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is not an array of %u bools (one per layer)", m->path, key, hp->n_layer);
        }
        for (uint32_t il = 0; il < hp->n_layer; il++) {
            const bool r = ints ? ((const int32_t *)kv->data)[il] != 0 : ((const uint8_t *)kv->data)[il] != 0;
            if (r) hp->recurrent[il >> 6] |= (uint64_t)1 << (il & 63);
        }
    } else {
        uint32_t n = 4;
        if (hp_u32(m, "full_attention_interval", &n, false, 4)) return KVR_ERR_FORMAT;
        if (n == 0) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = 0 (every n-th layer is full attention: n >= 1)",
                             m->path, arch_key(m, "full_attention_interval"));
        }
        for (uint32_t il = 0; il < hp->n_layer; il++) {
            if ((il + 1) % n != 0) hp->recurrent[il >> 6] |= (uint64_t)1 << (il & 63);
        }
    }
    hp->n_recurrent = 0;
    for (uint32_t il = 0; il < hp->n_layer; il++) hp->n_recurrent += kvr_layer_recurrent(hp, (int)il);
    return KVR_OK;
}

// IMROPE's sections: pair i (of n_rot/2) takes the section (i % sum) % 3 while that is below 3 times
// the section's size, else the 4th one. A text token has one position in the first three and 0 in
// the 4th, so kvr's rope (one position) is llama.cpp's iff no rotated pair falls in the 4th.
static int qwen35_rope_sections(struct kvr_model * m) {
    const struct kvr_hparams * hp = &m->hp;
    const char * key = arch_key(m, "rope.dimension_sections");
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(m->gguf, key);
    if (!kv) return KVR_OK; // no sections: plain NeoX
    if (kv->type != KVR_GGUF_ARRAY || (kv->arr_type != KVR_GGUF_INT32 && kv->arr_type != KVR_GGUF_UINT32) || kv->n < 3 || kv->n > 4) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is not an array of 3 or 4 integers", m->path, key);
    }
    int32_t sec[4] = { 0, 0, 0, 0 };
    memcpy(sec, kv->data, (size_t)kv->n * sizeof(int32_t));
    const int32_t sum = sec[0] + sec[1] + sec[2] + sec[3];
    for (uint32_t i = 0; i < hp->n_rot / 2; i++) {
        const int32_t s = sum > 0 ? (int32_t)i % sum : 0;
        const bool text = (s % 3 == 0 && s < 3 * sec[0]) || (s % 3 == 1 && s < 3 * sec[1]) || (s % 3 == 2 && s < 3 * sec[2]);
        if (!text) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = [%d, %d, %d, %d] rotates pair %u by the 4th (vision) position; "
                             "kvr rotates text tokens only", m->path, key, sec[0], sec[1], sec[2], sec[3], i);
        }
    }
    return KVR_OK;
}

// a small weight the GDN kernels and the elementwise ops read as f32
static int qwen35_f32(struct kvr_model * m, const struct kvr_tensor * t) {
    if (t->type == KVR_TYPE_F32) return KVR_OK;
    return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s; kvr reads it as f32 only", m->path, t->name, kvr_type_name(t->type));
}

static int qwen35_load_gdn(struct kvr_model * m, uint32_t il) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = hp->n_embd, d = hp->ssm_d_state, nk = hp->ssm_n_group, nv = hp->ssm_dt_rank;
    const int64_t C = 2 * nk * d + nv * d;
    if (model_tensor(m, &l->wqkv, true, 2, E, C, "blk.%u.attn_qkv.weight", il) ||
        model_tensor(m, &l->ssm_gate, true, 2, E, nv * d, "blk.%u.attn_gate.weight", il) ||
        model_tensor(m, &l->ssm_conv1d, true, 2, hp->ssm_d_conv, C, "blk.%u.ssm_conv1d.weight", il) ||
        model_tensor(m, &l->ssm_dt_b, true, 1, nv, 1, "blk.%u.ssm_dt.bias", il) ||
        model_tensor(m, &l->ssm_a, true, 1, nv, 1, "blk.%u.ssm_a", il) ||
        model_tensor(m, &l->ssm_beta, true, 2, E, nv, "blk.%u.ssm_beta.weight", il) ||
        model_tensor(m, &l->ssm_alpha, true, 2, E, nv, "blk.%u.ssm_alpha.weight", il) ||
        model_tensor(m, &l->ssm_norm, true, 1, d, 1, "blk.%u.ssm_norm.weight", il) ||
        model_tensor(m, &l->ssm_out, true, 2, nv * d, E, "blk.%u.ssm_out.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    if (qwen35_f32(m, l->ssm_conv1d) || qwen35_f32(m, l->ssm_dt_b) || qwen35_f32(m, l->ssm_a) || qwen35_f32(m, l->ssm_norm)) {
        return KVR_ERR_UNSUPP;
    }
    return KVR_OK;
}

// a full-attention layer: attn_q is twice as wide (a gate per head after each head's q)
static int qwen35_load_attn(struct kvr_model * m, uint32_t il) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = hp->n_embd, D = hp->head_dim, q = D * hp->n_head, kv = D * hp->n_head_kv;
    if (model_tensor(m, &l->wq, true, 2, E, 2 * q, "blk.%u.attn_q.weight", il) ||
        model_tensor(m, &l->wk, true, 2, E, kv, "blk.%u.attn_k.weight", il) ||
        model_tensor(m, &l->wv, true, 2, E, kv, "blk.%u.attn_v.weight", il) ||
        model_tensor(m, &l->wo, true, 2, q, E, "blk.%u.attn_output.weight", il) ||
        model_tensor(m, &l->attn_q_norm, true, 1, D, 1, "blk.%u.attn_q_norm.weight", il) ||
        model_tensor(m, &l->attn_k_norm, true, 1, D, 1, "blk.%u.attn_k_norm.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static int qwen35_load_ffn_dense(struct kvr_model * m, uint32_t il) {
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = m->hp.n_embd, F = m->hp.n_ff;
    if (model_tensor(m, &l->ffn_gate, true, 2, E, F, "blk.%u.ffn_gate.weight", il) ||
        model_tensor(m, &l->ffn_up, true, 2, E, F, "blk.%u.ffn_up.weight", il) ||
        model_tensor(m, &l->ffn_down, true, 2, F, E, "blk.%u.ffn_down.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

// the hyper-parameters and every layer's mixer and norms; the FFN's tensors by ffn
static int qwen35_load_layers(struct kvr_model * m, qwen35_ffn_load_fn ffn) {
    struct kvr_hparams * hp = &m->hp;
    uint32_t inner = 0;
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &hp->norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", hp->norm_eps) ||
        hp_u32(m, "ssm.conv_kernel", &hp->ssm_d_conv, true, 0) ||
        hp_u32(m, "ssm.state_size", &hp->ssm_d_state, true, 0) ||
        hp_u32(m, "ssm.group_count", &hp->ssm_n_group, true, 0) ||
        hp_u32(m, "ssm.time_step_rank", &hp->ssm_dt_rank, true, 0) ||
        hp_u32(m, "ssm.inner_size", &inner, true, 0)) {
        return KVR_ERR_FORMAT;
    }
    const struct { const char * suffix; uint32_t v, max; } counts[] = {
        { "ssm.conv_kernel", hp->ssm_d_conv, KVR_SSM_CONV_MAX_K }, { "ssm.state_size", hp->ssm_d_state, 1024 },
        { "ssm.group_count", hp->ssm_n_group, 4096 }, { "ssm.time_step_rank", hp->ssm_dt_rank, 4096 },
    };
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        if (counts[i].v == 0 || counts[i].v > counts[i].max) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not a count from 1 to %u", m->path,
                             arch_key(m, counts[i].suffix), counts[i].v, counts[i].max);
        }
    }
    if (hp->ssm_dt_rank % hp->ssm_n_group != 0 || (uint64_t)inner != (uint64_t)hp->ssm_dt_rank * hp->ssm_d_state) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u, '%s' = %u and '%s' = %u do not fit (value heads a multiple of the "
                         "key heads, inner size = value heads x state size)", m->path, arch_key(m, "ssm.time_step_rank"),
                         hp->ssm_dt_rank, arch_key(m, "ssm.group_count"), hp->ssm_n_group, arch_key(m, "ssm.inner_size"), inner);
    }
    hp->rope_mode = KVR_ROPE_NEOX;
    if (qwen35_layer_kinds(m) || qwen35_rope_sections(m) || load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        struct kvr_layer * l = &m->layers[il];
        if (model_tensor(m, &l->attn_norm, true, 1, hp->n_embd, 1, "blk.%u.attn_norm.weight", il) ||
            model_tensor(m, &l->ffn_norm, true, 1, hp->n_embd, 1, "blk.%u.post_attention_norm.weight", il)) {
            return KVR_ERR_FORMAT;
        }
        const int rc = kvr_layer_recurrent(hp, (int)il) ? qwen35_load_gdn(m, il) : qwen35_load_attn(m, il);
        if (rc != KVR_OK) return rc;
        if (ffn(m, il)) return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static int qwen35_load(struct kvr_model * m) { return qwen35_load_layers(m, qwen35_load_ffn_dense); }

// qwen35moe's FFN: the router and experts (the norm is post_attention_norm, loaded above), and the
// shared expert with its gate vector
static int qwen35moe_load_ffn(struct kvr_model * m, uint32_t il) {
    struct kvr_layer * l = &m->layers[il];
    const int64_t E = m->hp.n_embd, F = m->hp.n_ff_shexp;
    if (load_layer_moe(m, il, false) ||
        model_tensor(m, &l->ffn_gate_inp_shexp, true, 1, E, 1, "blk.%u.ffn_gate_inp_shexp.weight", il) ||
        model_tensor(m, &l->ffn_gate_shexp, true, 2, E, F, "blk.%u.ffn_gate_shexp.weight", il) ||
        model_tensor(m, &l->ffn_up_shexp, true, 2, E, F, "blk.%u.ffn_up_shexp.weight", il) ||
        model_tensor(m, &l->ffn_down_shexp, true, 2, F, E, "blk.%u.ffn_down_shexp.weight", il)) {
        return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

// the gated full attention of layer il over h
static struct kvr_tensor * qwen35_attn(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * h, int il) {
    struct kvr_context * ctx = g->ctx;
    const int64_t D = g->hp->head_dim, H = g->hp->n_head, Hkv = g->hp->n_head_kv;
    const size_t f = sizeof(float);
    struct kvr_tensor * qg = cb(kvr_mul_mat(ctx, l->wq, h), "q_gate", il);
    struct kvr_tensor * q = kvr_view_3d(ctx, qg, D, H, g->T, 2 * D * f, 2 * D * H * f, 0);
    struct kvr_tensor * gate = kvr_view_3d(ctx, qg, D, H, g->T, 2 * D * f, 2 * D * H * f, D * f);
    struct kvr_tensor * k = kvr_reshape_3d(ctx, cb(kvr_mul_mat(ctx, l->wk, h), "k", il), D, Hkv, g->T);
    struct kvr_tensor * v = kvr_reshape_3d(ctx, cb(kvr_mul_mat(ctx, l->wv, h), "v", il), D, Hkv, g->T);
    q = build_rope(g, build_norm(g, q, l->attn_q_norm, NULL, MB_NORM_RMS, "q_norm", il), "q_rope", il);
    k = build_rope(g, build_norm(g, k, l->attn_k_norm, NULL, MB_NORM_RMS, "k_norm", il), "k_rope", il);
    struct kvr_tensor * a = cb(kvr_attn_block(ctx, q, k, v, g->b->pos, il, 1.0f / sqrtf((float)D), 0.0f, 0), "attn", il);
    struct kvr_tensor * sg = kvr_reshape_2d(ctx, cb(kvr_sigmoid(ctx, gate), "attn_gate", il), D * H, g->T);
    a = cb(kvr_mul(ctx, kvr_attn_out(ctx, a, (int)H), sg), "attn_gated", il);
    return cb(kvr_mul_mat(ctx, l->wo, a), "attn_proj", il);
}

// the Gated DeltaNet mixer of layer il over h
static struct kvr_tensor * qwen35_gdn(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * h, int il) {
    struct kvr_context * ctx = g->ctx;
    const struct kvr_hparams * hp = g->hp;
    const struct kvr_gdn_shape sh = {
        .il = il, .d_conv = (int)hp->ssm_d_conv, .n_k = (int)hp->ssm_n_group, .d_k = (int)hp->ssm_d_state,
        .n_v = (int)hp->ssm_dt_rank, .d_v = (int)hp->ssm_d_state, .eps = hp->norm_eps,
    };
    struct kvr_tensor * qkv = cb(kvr_mul_mat(ctx, l->wqkv, h), "qkv_mixed", il);
    struct kvr_tensor * z = cb(kvr_mul_mat(ctx, l->ssm_gate, h), "z", il);
    struct kvr_tensor * beta = cb(kvr_sigmoid(ctx, cb(kvr_mul_mat(ctx, l->ssm_beta, h), "beta_raw", il)), "beta", il);
    struct kvr_tensor * a = cb(kvr_add(ctx, cb(kvr_mul_mat(ctx, l->ssm_alpha, h), "alpha", il), l->ssm_dt_b), "alpha_b", il);
    struct kvr_tensor * decay = cb(kvr_mul(ctx, cb(kvr_softplus(ctx, a), "alpha_softplus", il), l->ssm_a), "decay", il);
    struct kvr_tensor * o = cb(kvr_gdn_block(ctx, qkv, l->ssm_conv1d, decay, beta, &sh), "gdn", il);
    o = build_norm(g, o, l->ssm_norm, NULL, MB_NORM_RMS, "gdn_norm", il);
    z = cb(kvr_silu(ctx, kvr_reshape_3d(ctx, z, sh.d_v, sh.n_v, g->T)), "z_silu", il);
    o = kvr_reshape_2d(ctx, cb(kvr_mul(ctx, o, z), "gdn_gated", il), (int64_t)sh.d_v * sh.n_v, g->T);
    return cb(kvr_mul_mat(ctx, l->ssm_out, o), "gdn_out", il);
}

static struct kvr_tensor * qwen35_ffn_dense(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * x, int il) {
    return build_ffn(g, x, l->ffn_up, NULL, l->ffn_gate, l->ffn_down, NULL, MB_ACT_SILU, il);
}

static struct kvr_tensor * qwen35_graph(const struct kvr_model * m, const struct kvr_build * b, qwen35_ffn_build_fn ffn) {
    struct mb g = mb_init(m, b);
    struct kvr_tensor * x = build_inp_embd(&g);
    for (int il = 0; il < (int)m->hp.n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = build_norm(&g, x, l->attn_norm, NULL, MB_NORM_RMS, "attn_norm", il);
        h = kvr_layer_recurrent(&m->hp, il) ? qwen35_gdn(&g, l, h, il) : qwen35_attn(&g, l, h, il);
        x = cb(kvr_add(g.ctx, build_last_rows(&g, x, il), build_last_rows(&g, h, il)), "attn_resid", il);
        h = build_norm(&g, x, l->ffn_norm, NULL, MB_NORM_RMS, "ffn_norm", il);
        x = cb(kvr_add(g.ctx, x, ffn(&g, l, h, il)), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}

static struct kvr_tensor * qwen35_build(const struct kvr_model * m, const struct kvr_build * b) {
    return qwen35_graph(m, b, qwen35_ffn_dense);
}

// qwen35moe: the shared expert's width, expert_shared_feed_forward_length (llama.cpp's default:
// feed_forward_length, which Qwen3.5-MoE files lack), and the routed experts' counts
static int qwen35moe_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (load_moe_hparams(m) || hp_u32(m, "expert_shared_feed_forward_length", &hp->n_ff_shexp, false, hp->n_ff)) {
        return KVR_ERR_FORMAT;
    }
    if (hp->n_ff_shexp == 0) {
        char ffn[128]; // arch_key's buffer is one: the second key is formatted into it later
        snprintf(ffn, sizeof(ffn), "%s", arch_key(m, "feed_forward_length"));
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing (and '%s' gives no width)", m->path,
                         arch_key(m, "expert_shared_feed_forward_length"), ffn);
    }
    return qwen35_load_layers(m, qwen35moe_load_ffn);
}

// the routed experts' sum plus the shared expert's output times its per-token gate (a [1, T] row
// that MUL spreads along each token's row)
static struct kvr_tensor * qwen35moe_ffn(struct mb * g, const struct kvr_layer * l, struct kvr_tensor * x, int il) {
    struct kvr_context * ctx = g->ctx;
    struct kvr_tensor * moe = build_moe(g, l, x, KVR_MOE_SOFTMAX_TOPK_NORM, MB_ACT_SILU, il);
    struct kvr_tensor * sh = build_ffn(g, x, l->ffn_up_shexp, NULL, l->ffn_gate_shexp, l->ffn_down_shexp, NULL, MB_ACT_SILU, il);
    struct kvr_tensor * gate = cb(kvr_mul_mat(ctx, l->ffn_gate_inp_shexp, x), "shexp_gate", il);
    gate = cb(kvr_sigmoid(ctx, gate), "shexp_gate_sigmoid", il);
    sh = cb(kvr_mul(ctx, sh, gate), "ffn_shexp_gated", il);
    return cb(kvr_add(ctx, moe, sh), "ffn_moe_shexp", il);
}

static struct kvr_tensor * qwen35moe_build(const struct kvr_model * m, const struct kvr_build * b) {
    return qwen35_graph(m, b, qwen35moe_ffn);
}
