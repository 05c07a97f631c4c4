// models/phi3.c - Phi-3, Phi-3.5 and Phi-4-mini as GGUF stores them (llama.cpp's phi3 graph): the
// Llama graph of models/llama.c over fused weights, with LongRoPE.
//
//   h  = x + wo(attn(rope(q), rope(k), v)),  [q | k | v] = attn_qkv rms(x)
//   x' = h + down(silu(g) * u),              [g | u]     = ffn_up rms(h)
//
// attn_qkv holds the rows of Q, then K, then V; ffn_up the rows of the gate, then the up
// projection (2 * feed_forward_length). Each part is a weight of its own over the fused one's
// bytes (load_rows), so the graph is llama_build's. RoPE on rotated halves (NeoX) of the first
// rope.dimension_count dims of each head, divided per pair by rope_factors_short or, in a context
// past rope.scaling.original_context_length, rope_factors_long (build_rope, as llama.cpp picks
// them by its context), with cosines and sines times rope.scaling.attn_factor. Scores scaled by
// 1/sqrt(head_dim). attention.sliding_window is ignored, as llama.cpp ignores it for phi3 (its
// value in Phi-3.5/4-mini files spans every context). Separate attn_q/k/v weights are taken too.
// Compiled as part of kvr.c, over the helpers of models/build.c.

static int phi3_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &hp->norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", hp->norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    // the fused ffn_up is twice this wide, so its width cannot stand in for the key
    if (!kvr_gguf_get_kv(m->gguf, arch_key(m, "feed_forward_length"))) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing", m->path, arch_key(m, "feed_forward_length"));
    }
    hp->rope_mode = KVR_ROPE_NEOX;
    if (load_embeddings(m, false) || load_rope_longrope(m)) return KVR_ERR_FORMAT;
    const int64_t E = hp->n_embd, F = hp->n_ff, q = (int64_t)hp->head_dim * hp->n_head, kv = (int64_t)hp->head_dim * hp->n_head_kv;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        struct kvr_layer * l = &m->layers[il];
        char name[KVR_MAX_NAME];
        snprintf(name, sizeof(name), "blk.%u.attn_qkv.weight", il);
        if (kvr_gguf_get_tensor(m->gguf, name)) {
            if (model_tensor(m, &l->attn_norm, true, 1, E, 1, "blk.%u.attn_norm.weight", il) ||
                model_tensor(m, &l->wqkv, true, 2, E, q + 2 * kv, "%s", name) ||
                model_tensor(m, &l->wo, true, 2, q, E, "blk.%u.attn_output.weight", il)) {
                return KVR_ERR_FORMAT;
            }
            l->wq = load_rows(m, l->wqkv, 0, q, "attn_qkv.weight (q)", (int)il);
            l->wk = load_rows(m, l->wqkv, q, kv, "attn_qkv.weight (k)", (int)il);
            l->wv = load_rows(m, l->wqkv, q + kv, kv, "attn_qkv.weight (v)", (int)il);
        } else {
            char q_name[KVR_MAX_NAME];
            snprintf(q_name, sizeof(q_name), "blk.%u.attn_q.weight", il);
            if (!kvr_gguf_get_tensor(m->gguf, q_name)) {
                return kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' is missing (and there is no '%s')", m->path, name, q_name);
            }
            if (load_layer_attn(m, il, 0)) return KVR_ERR_FORMAT;
        }
        struct kvr_tensor * up = NULL;
        if (model_tensor(m, &l->ffn_norm, true, 1, E, 1, "blk.%u.ffn_norm.weight", il) ||
            model_tensor(m, &up, true, 2, E, 2 * F, "blk.%u.ffn_up.weight", il) ||
            model_tensor(m, &l->ffn_down, true, 2, F, E, "blk.%u.ffn_down.weight", il)) {
            return KVR_ERR_FORMAT;
        }
        l->ffn_gate = load_rows(m, up, 0, F, "ffn_up.weight (gate)", (int)il);
        l->ffn_up   = load_rows(m, up, F, F, "ffn_up.weight (up)", (int)il);
    }
    return KVR_OK;
}
