// models/falcon.c - the Falcon graph (7B-style MQA, 40B/180B-style new_decoder_architecture) as
// GGUF stores it: layer norms with bias, a fused QKV projection whose rows are every query head,
// then every key head, then every value head, RoPE on rotated halves (NeoX), a GELU MLP without a
// gate, and attention and MLP side by side off the layer's input:
//
//   x_{l+1} = x_l + attn(attn_norm_2(x_l) or attn_norm(x_l)) + mlp(attn_norm(x_l))
//
// With a second norm (the converter maps ln_attn to attn_norm_2 and ln_mlp to attn_norm), the
// attention reads attn_norm_2 and the MLP attn_norm, as llama.cpp's build_falcon does.
// Compiled as part of kvr.c, over the helpers of models/build.c.

// Whether the file's tensor `name` is one this builder reads; anything else belongs to a variant
// kvr would compute wrongly by ignoring it (a sequential residual's ffn_norm, ...).
static bool falcon_known_tensor(const struct kvr_model * m, const char * name) {
    static const char * const top[] = {
        "token_embd.weight", "output_norm.weight", "output_norm.bias", "output.weight",
    };
    static const char * const per_layer[] = {
        "attn_norm.weight", "attn_norm.bias", "attn_norm_2.weight", "attn_norm_2.bias",
        "attn_qkv.weight", "attn_qkv.bias", "attn_output.weight", "attn_output.bias",
        "ffn_up.weight", "ffn_up.bias", "ffn_down.weight", "ffn_down.bias",
    };
    for (size_t i = 0; i < sizeof(top) / sizeof(top[0]); i++) {
        if (strcmp(name, top[i]) == 0) return true;
    }
    if (strncmp(name, "blk.", 4) != 0 || name[4] < '0' || name[4] > '9') return false;
    char * end = NULL;
    const unsigned long il = strtoul(name + 4, &end, 10);
    if (*end != '.' || il >= m->hp.n_layer) return false;
    for (size_t i = 0; i < sizeof(per_layer) / sizeof(per_layer[0]); i++) {
        if (strcmp(end + 1, per_layer[i]) == 0) return true;
    }
    return false;
}

static int falcon_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_f32(m, "attention.layer_norm_epsilon", &hp->norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_epsilon", hp->norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    hp->rope_mode = KVR_ROPE_NEOX;
    if (kvr_gguf_get_kv(m->gguf, arch_key(m, "attention.clamp_kqv"))) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' (clamping the QKV projection) is not supported",
                         m->path, arch_key(m, "attention.clamp_kqv"));
    }
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) {
        const char * name = m->gguf->tensors[i].name;
        if (!falcon_known_tensor(m, name)) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' is not part of the falcon graph kvr knows "
                             "(parallel attention and MLP, fused QKV); this variant is not supported", m->path, name);
        }
    }

    const int64_t E = hp->n_embd, kv = (int64_t)hp->head_dim * hp->n_head_kv;
    const int64_t QKV = (int64_t)hp->head_dim * hp->n_head + 2 * kv;
    if (load_embeddings(m, true)) return KVR_ERR_FORMAT;
    const int64_t F = hp->n_ff;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        struct kvr_layer * l = &m->layers[il];
        if (model_tensor(m, &l->attn_norm, true, 1, E, 1, "blk.%u.attn_norm.weight", il) ||
            model_tensor(m, &l->attn_norm_b, true, 1, E, 1, "blk.%u.attn_norm.bias", il) ||
            model_tensor(m, &l->attn_norm2, false, 1, E, 1, "blk.%u.attn_norm_2.weight", il) ||
            model_tensor(m, &l->attn_norm2_b, false, 1, E, 1, "blk.%u.attn_norm_2.bias", il) ||
            model_tensor(m, &l->wqkv, true, 2, E, QKV, "blk.%u.attn_qkv.weight", il) ||
            model_tensor(m, &l->bqkv, false, 1, QKV, 1, "blk.%u.attn_qkv.bias", il) ||
            model_tensor(m, &l->wo, true, 2, E, E, "blk.%u.attn_output.weight", il) ||
            model_tensor(m, &l->bo, false, 1, E, 1, "blk.%u.attn_output.bias", il) ||
            model_tensor(m, &l->ffn_up, true, 2, E, F, "blk.%u.ffn_up.weight", il) ||
            model_tensor(m, &l->ffn_up_b, false, 1, F, 1, "blk.%u.ffn_up.bias", il) ||
            model_tensor(m, &l->ffn_down, true, 2, F, E, "blk.%u.ffn_down.weight", il) ||
            model_tensor(m, &l->ffn_down_b, false, 1, E, 1, "blk.%u.ffn_down.bias", il)) {
            return KVR_ERR_FORMAT;
        }
        if (l->attn_norm2_b && !l->attn_norm2) {
            return kvr_error(KVR_ERR_FORMAT, "%s: tensor 'blk.%u.attn_norm_2.bias' without 'blk.%u.attn_norm_2.weight'",
                             m->path, il, il);
        }
    }
    return KVR_OK;
}

static struct kvr_tensor * falcon_build(const struct kvr_model * m, const struct kvr_build * b) {
    struct mb g = mb_init(m, b);
    const int64_t T = b->n_tokens, D = m->hp.head_dim, H = m->hp.n_head, Hkv = m->hp.n_head_kv;
    const size_t  fs = sizeof(float);
    struct kvr_tensor * x = build_inp_embd(&g);
    for (int il = 0; il < (int)m->hp.n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h_mlp = build_norm(&g, x, l->attn_norm, l->attn_norm_b, MB_NORM_LAYER, "attn_norm", il);
        struct kvr_tensor * h_att = l->attn_norm2 ? build_norm(&g, x, l->attn_norm2, l->attn_norm2_b, MB_NORM_LAYER, "attn_norm_2", il)
                                                  : h_mlp;
        // fused projection: rows [0, D*H) are the queries, then D*Hkv rows of keys, then of values
        struct kvr_tensor * qkv = cb(kvr_mul_mat(g.ctx, l->wqkv, h_att), "qkv", il);
        if (l->bqkv) qkv = cb(kvr_add(g.ctx, qkv, l->bqkv), "qkv_b", il);
        struct kvr_tensor * q = cb(kvr_view_3d(g.ctx, qkv, D, H, T, D * fs, qkv->nb[1], 0), "q", il);
        struct kvr_tensor * k = cb(kvr_view_3d(g.ctx, qkv, D, Hkv, T, D * fs, qkv->nb[1], (size_t)(D * H) * fs), "k", il);
        struct kvr_tensor * v = cb(kvr_view_3d(g.ctx, qkv, D, Hkv, T, D * fs, qkv->nb[1], (size_t)(D * (H + Hkv)) * fs), "v", il);
        v = cb(kvr_cont(g.ctx, v), "v_cont", il); // the strategy passes reshape k and v (k: RoPE's output)
        struct kvr_tensor * o = build_last_rows(&g, build_attn(&g, l, q, k, v, 1.0f / sqrtf((float)D), il), il);

        // the MLP reads the layer's input, beside the attention
        h_mlp = build_last_rows(&g, h_mlp, il);
        struct kvr_tensor * f = build_ffn(&g, h_mlp, l->ffn_up, l->ffn_up_b, NULL, l->ffn_down, l->ffn_down_b, MB_ACT_GELU, il);
        // the order of llama.cpp's sums: (mlp + attn) + x
        x = cb(kvr_add(g.ctx, cb(kvr_add(g.ctx, f, o), "ffn_attn", il), build_last_rows(&g, x, il)), "out", il);
    }
    return build_output(&g, x, MB_NORM_LAYER);
}
