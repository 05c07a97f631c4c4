// models/llama.c - the Llama family graph (Llama 1/2/3, TinyLlama, Mistral shapes; MHA, GQA, MQA)
// as GGUF stores it: RMS norm, RoPE on adjacent pairs, SwiGLU FFN, optional tied output.
// Compiled as part of kvr.c (included in its section 16, before the table of architectures), so it
// uses kvr.c's internal helpers.
// Attention is left as ATTN_BLOCK nodes: the strategy pass decides where keys and values live.

static int llama_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &hp->norm_eps, true, 0.0f)) return KVR_ERR_FORMAT;
    hp->rope_mode = KVR_ROPE_NORM;
    const int64_t E = hp->n_embd, kv = (int64_t)hp->head_dim * hp->n_head_kv;
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    const int64_t F = hp->n_ff;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        struct kvr_layer * l = &m->layers[il];
        if (model_tensor(m, &l->attn_norm, true, 1, E, 1, "blk.%u.attn_norm.weight", il) ||
            model_tensor(m, &l->wq, true, 2, E, E, "blk.%u.attn_q.weight", il) ||
            model_tensor(m, &l->wk, true, 2, E, kv, "blk.%u.attn_k.weight", il) ||
            model_tensor(m, &l->wv, true, 2, E, kv, "blk.%u.attn_v.weight", il) ||
            model_tensor(m, &l->wo, true, 2, E, E, "blk.%u.attn_output.weight", il) ||
            model_tensor(m, &l->bq, false, 1, E, 1, "blk.%u.attn_q.bias", il) ||
            model_tensor(m, &l->bk, false, 1, kv, 1, "blk.%u.attn_k.bias", il) ||
            model_tensor(m, &l->bv, false, 1, kv, 1, "blk.%u.attn_v.bias", il) ||
            model_tensor(m, &l->ffn_norm, true, 1, E, 1, "blk.%u.ffn_norm.weight", il) ||
            model_tensor(m, &l->ffn_gate, true, 2, E, F, "blk.%u.ffn_gate.weight", il) ||
            model_tensor(m, &l->ffn_up, true, 2, E, F, "blk.%u.ffn_up.weight", il) ||
            model_tensor(m, &l->ffn_down, true, 2, F, E, "blk.%u.ffn_down.weight", il)) {
            return KVR_ERR_FORMAT;
        }
    }
    return KVR_OK;
}

static struct kvr_tensor * llama_build(const struct kvr_model * m, const struct kvr_build * b) {
    const struct kvr_hparams * hp = &m->hp;
    struct kvr_context * ctx = b->ctx;
    const int64_t T = b->n_tokens, D = hp->head_dim, H = hp->n_head, Hkv = hp->n_head_kv;

    struct kvr_tensor * x = kvr_set_name(kvr_get_rows(ctx, m->tok_embd, b->tokens), "inp_embd");
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = kvr_set_name(kvr_rms_norm(ctx, x, hp->norm_eps), "blk.%u.attn_rms", il);
        h = kvr_set_name(kvr_mul(ctx, h, l->attn_norm), "blk.%u.attn_normed", il);

        struct kvr_tensor * q = kvr_set_name(kvr_mul_mat(ctx, l->wq, h), "blk.%u.q", il);
        struct kvr_tensor * k = kvr_set_name(kvr_mul_mat(ctx, l->wk, h), "blk.%u.k", il);
        struct kvr_tensor * v = kvr_set_name(kvr_mul_mat(ctx, l->wv, h), "blk.%u.v", il);
        if (l->bq) q = kvr_set_name(kvr_add(ctx, q, l->bq), "blk.%u.q_b", il);
        if (l->bk) k = kvr_set_name(kvr_add(ctx, k, l->bk), "blk.%u.k_b", il);
        if (l->bv) v = kvr_set_name(kvr_add(ctx, v, l->bv), "blk.%u.v_b", il);
        q = kvr_set_name(kvr_rope(ctx, kvr_reshape_3d(ctx, q, D, H, T), b->pos, (int)hp->n_rot, hp->rope_mode,
                                  hp->rope_freq_base, hp->rope_freq_scale), "blk.%u.q_rope", il);
        k = kvr_set_name(kvr_rope(ctx, kvr_reshape_3d(ctx, k, D, Hkv, T), b->pos, (int)hp->n_rot, hp->rope_mode,
                                  hp->rope_freq_base, hp->rope_freq_scale), "blk.%u.k_rope", il);
        v = kvr_reshape_3d(ctx, v, D, Hkv, T);

        struct kvr_tensor * a = kvr_set_name(kvr_attn_block(ctx, q, k, v, b->pos, (int)il), "blk.%u.attn", il);
        struct kvr_tensor * o = kvr_set_name(kvr_mul_mat(ctx, l->wo, kvr_attn_out(ctx, a, (int)H)), "blk.%u.attn_proj", il);

        if (il == hp->n_layer - 1 && b->n_outputs > 0 && b->n_outputs < T) {
            // only the rows whose logits are wanted go through the last FFN
            const int64_t n = b->n_outputs;
            o = kvr_view_2d(ctx, o, o->ne[0], n, o->nb[1], (size_t)(T - n) * o->nb[1]);
            x = kvr_view_2d(ctx, x, x->ne[0], n, x->nb[1], (size_t)(T - n) * x->nb[1]);
        }
        x = kvr_set_name(kvr_add(ctx, x, o), "blk.%u.attn_resid", il);

        h = kvr_set_name(kvr_rms_norm(ctx, x, hp->norm_eps), "blk.%u.ffn_rms", il);
        h = kvr_set_name(kvr_mul(ctx, h, l->ffn_norm), "blk.%u.ffn_normed", il);
        struct kvr_tensor * gate = kvr_set_name(kvr_silu(ctx, kvr_mul_mat(ctx, l->ffn_gate, h)), "blk.%u.ffn_gate", il);
        struct kvr_tensor * up   = kvr_set_name(kvr_mul_mat(ctx, l->ffn_up, h), "blk.%u.ffn_up", il);
        struct kvr_tensor * down = kvr_set_name(kvr_mul_mat(ctx, l->ffn_down, kvr_mul(ctx, gate, up)), "blk.%u.ffn_down", il);
        x = kvr_set_name(kvr_add(ctx, x, down), "blk.%u.out", il);
    }
    if (b->n_outputs == 0) return x;
    x = kvr_set_name(kvr_rms_norm(ctx, x, hp->norm_eps), "out_rms");
    x = kvr_set_name(kvr_mul(ctx, x, m->output_norm), "out_normed");
    return kvr_set_name(kvr_mul_mat(ctx, m->output, x), "logits");
}
