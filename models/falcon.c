// models/falcon.c - the Falcon graph (7B-style MQA, 40B/180B-style new_decoder_architecture) as
// GGUF stores it: layer norms with bias, a fused QKV projection whose rows are every query head,
// then every key head, then every value head, RoPE on rotated halves (NeoX), a GELU MLP without a
// gate, and attention and MLP side by side off the layer's input:
//
//   x_{l+1} = x_l + attn(attn_norm_2(x_l) or attn_norm(x_l)) + mlp(attn_norm(x_l))
//
// With a second norm (the converter maps ln_attn to attn_norm_2 and ln_mlp to attn_norm), the
// attention reads attn_norm_2 and the MLP attn_norm, as llama.cpp's build_falcon does.
// Compiled as part of kvr.c (included in its section 16, before the table of architectures), so it
// uses kvr.c's internal helpers.

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
    if (hp_f32(m, "attention.layer_norm_epsilon", &hp->norm_eps, true, 0.0f)) return KVR_ERR_FORMAT;
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

// Layer norm with its affine part: norm(x) * w (+ b). Names "<stem>_ln", "<stem>_normed",
// "<stem>_normed_b", with stem "blk.N.attn", "blk.N.attn2" or "out".
static struct kvr_tensor * falcon_layer_norm(struct kvr_context * ctx, struct kvr_tensor * x, struct kvr_tensor * w,
                                             struct kvr_tensor * b, float eps, const char * stem) {
    struct kvr_tensor * h = kvr_set_name(kvr_norm(ctx, x, eps), "%s_ln", stem);
    h = kvr_set_name(kvr_mul(ctx, h, w), "%s_normed", stem);
    if (b) h = kvr_set_name(kvr_add(ctx, h, b), "%s_normed_b", stem);
    return h;
}

// the last n of the T rows of a [ne0, T] tensor
static struct kvr_tensor * falcon_last_rows(struct kvr_context * ctx, struct kvr_tensor * t, int64_t T, int64_t n) {
    return kvr_view_2d(ctx, t, t->ne[0], n, t->nb[1], (size_t)(T - n) * t->nb[1]);
}

static struct kvr_tensor * falcon_build(const struct kvr_model * m, const struct kvr_build * b) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_context * ctx = b->ctx;
    const int64_t T = b->n_tokens, D = hp->head_dim, H = hp->n_head, Hkv = hp->n_head_kv;
    const size_t  fs = sizeof(float);
    char stem[32];

    struct kvr_tensor * x = kvr_set_name(kvr_get_rows(ctx, m->tok_embd, b->tokens), "inp_embd");
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        snprintf(stem, sizeof(stem), "blk.%u.attn", il);
        struct kvr_tensor * h_mlp = falcon_layer_norm(ctx, x, l->attn_norm, l->attn_norm_b, hp->norm_eps, stem);
        struct kvr_tensor * h_att = h_mlp;
        if (l->attn_norm2) {
            snprintf(stem, sizeof(stem), "blk.%u.attn2", il);
            h_att = falcon_layer_norm(ctx, x, l->attn_norm2, l->attn_norm2_b, hp->norm_eps, stem);
        }

        // fused projection: rows [0, E) are the queries, then kv_dim rows of keys, then of values
        struct kvr_tensor * qkv = kvr_set_name(kvr_mul_mat(ctx, l->wqkv, h_att), "blk.%u.qkv", il);
        if (l->bqkv) qkv = kvr_set_name(kvr_add(ctx, qkv, l->bqkv), "blk.%u.qkv_b", il);
        struct kvr_tensor * q = kvr_set_name(kvr_view_3d(ctx, qkv, D, H, T, D * fs, qkv->nb[1], 0), "blk.%u.q", il);
        struct kvr_tensor * k = kvr_set_name(kvr_view_3d(ctx, qkv, D, Hkv, T, D * fs, qkv->nb[1], (size_t)(D * H) * fs),
                                             "blk.%u.k", il);
        struct kvr_tensor * v = kvr_set_name(kvr_view_3d(ctx, qkv, D, Hkv, T, D * fs, qkv->nb[1], (size_t)(D * (H + Hkv)) * fs),
                                             "blk.%u.v", il);
        q = kvr_set_name(kvr_rope(ctx, q, b->pos, (int)hp->n_rot, hp->rope_mode, hp->rope_freq_base, hp->rope_freq_scale),
                         "blk.%u.q_rope", il);
        k = kvr_set_name(kvr_rope(ctx, k, b->pos, (int)hp->n_rot, hp->rope_mode, hp->rope_freq_base, hp->rope_freq_scale),
                         "blk.%u.k_rope", il);
        v = kvr_set_name(kvr_cont(ctx, v), "blk.%u.v_cont", il); // the strategy passes reshape k and v

        struct kvr_tensor * a = kvr_set_name(kvr_attn_block(ctx, q, k, v, b->pos, (int)il), "blk.%u.attn", il);
        struct kvr_tensor * o = kvr_set_name(kvr_mul_mat(ctx, l->wo, kvr_attn_out(ctx, a, (int)H)), "blk.%u.attn_proj", il);
        if (l->bo) o = kvr_set_name(kvr_add(ctx, o, l->bo), "blk.%u.attn_proj_b", il);

        if (il == hp->n_layer - 1 && b->n_outputs > 0 && b->n_outputs < T) {
            // only the rows whose logits are wanted go through the last MLP and residual
            const int64_t n = b->n_outputs;
            o     = falcon_last_rows(ctx, o, T, n);
            x     = falcon_last_rows(ctx, x, T, n);
            h_mlp = falcon_last_rows(ctx, h_mlp, T, n);
        }

        struct kvr_tensor * up = kvr_set_name(kvr_mul_mat(ctx, l->ffn_up, h_mlp), "blk.%u.ffn_up", il);
        if (l->ffn_up_b) up = kvr_set_name(kvr_add(ctx, up, l->ffn_up_b), "blk.%u.ffn_up_b", il);
        up = kvr_set_name(kvr_gelu(ctx, up), "blk.%u.ffn_gelu", il);
        struct kvr_tensor * down = kvr_set_name(kvr_mul_mat(ctx, l->ffn_down, up), "blk.%u.ffn_down", il);
        if (l->ffn_down_b) down = kvr_set_name(kvr_add(ctx, down, l->ffn_down_b), "blk.%u.ffn_down_b", il);

        // the order of llama.cpp's sums: (mlp + attn) + x
        struct kvr_tensor * s = kvr_set_name(kvr_add(ctx, down, o), "blk.%u.ffn_attn", il);
        x = kvr_set_name(kvr_add(ctx, s, x), "blk.%u.out", il);
    }
    if (b->n_outputs == 0) return x;
    x = falcon_layer_norm(ctx, x, m->output_norm, m->output_norm_b, hp->norm_eps, "out");
    return kvr_set_name(kvr_mul_mat(ctx, m->output, x), "logits");
}
