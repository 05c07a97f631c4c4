// models/llama.c - the Llama graph (Llama 1/2/3, Mistral, TinyLlama, SmolLM2 shapes; MHA, GQA, MQA)
// as GGUF stores it: RMS norms, RoPE on adjacent pairs (Llama 3.1+: with the per-pair frequency
// divisors of rope_freqs.weight), SwiGLU FFN, optional Q/K/V biases, optional tied output.
// Qwen 2 and 3 (models/qwen.c) are this graph with other pieces required.
//
//   h = x + wo(attn(rope(wq rms(x)), rope(wk rms(x)), wv rms(x)))
//   x' = h + down(silu(gate rms(h)) * up rms(h))
//
// Compiled as part of kvr.c, over the helpers of models/build.c. Attention is left as ATTN_BLOCK
// nodes: the strategy pass decides where keys and values live.

static int llama_load(struct kvr_model * m) {
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &m->hp.norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", m->hp.norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    m->hp.rope_mode = KVR_ROPE_NORM;
    if (load_embeddings(m, false) || load_rope_freqs(m)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        if (load_layer_attn(m, il, 0) || load_layer_ffn(m, il, true, 0)) return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static struct kvr_tensor * llama_build(const struct kvr_model * m, const struct kvr_build * b) {
    struct mb g = mb_init(m, b);
    const float scale = 1.0f / sqrtf((float)m->hp.head_dim);
    struct kvr_tensor * x = build_inp_embd(&g), * q, * k, * v;
    for (int il = 0; il < (int)m->hp.n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = build_norm(&g, x, l->attn_norm, NULL, MB_NORM_RMS, "attn_norm", il);
        build_qkv(&g, l, h, il, &q, &k, &v);
        h = build_last_rows(&g, build_attn(&g, l, q, k, v, scale, il), il);
        x = cb(kvr_add(g.ctx, build_last_rows(&g, x, il), h), "attn_resid", il);

        h = build_norm(&g, x, l->ffn_norm, NULL, MB_NORM_RMS, "ffn_norm", il);
        h = build_ffn(&g, h, l->ffn_up, NULL, l->ffn_gate, l->ffn_down, NULL, MB_ACT_SILU, il);
        x = cb(kvr_add(g.ctx, x, h), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}
