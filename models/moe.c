// models/moe.c - the mixture-of-experts architectures as GGUF stores them (llama.cpp's qwen3moe and
// openai-moe graphs): every layer's FFN is a router that picks n_expert_used of n_expert experts per
// token and the weighted sum of those experts' gated FFNs (models/build.c: build_moe).
//
//   qwen3moe   Qwen3-30B-A3B, Qwen3-235B-A22B: Qwen 3's attention (q/k RMS norms, head size from
//              attention.key_length, NeoX RoPE); router softmax over all experts, the top k,
//              their weights renormalised to sum 1 (llama.cpp always renormalises for this
//              architecture: the file has no key for it); experts silu(gate x) * up x.
//
//   gpt-oss    gpt-oss-20b/120b ("gpt-oss" in general.architecture):
//     h  = x + wo(attn(rope(wq rms(x) + bq), rope(wk rms(x) + bk), wv rms(x) + bv) + bo
//     x' = h + moe(rms(h) * post_attention_norm)
//     attention: sliding window on the layers attention.sliding_window_pattern says (default
//       period 2: even layers local), each head's sink logit in the softmax's denominator
//       (attn_sinks), scores scaled by 1/sqrt(n_rot); YaRN RoPE (NeoX) from rope.scaling.*
//     router: the top k of the biased logits, their weights the softmax over those k; experts
//       with biases and the clamped SwiGLU (alpha 1.702, limit 7: llama.cpp's constants)
//
// Compiled as part of kvr.c, over the helpers of models/build.c (and gemma3.c's layer pattern).

static int moe_load_eps(struct kvr_model * m) {
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &m->hp.norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", m->hp.norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static int qwen3moe_load(struct kvr_model * m) {
    if (moe_load_eps(m) || load_moe_hparams(m)) return KVR_ERR_FORMAT;
    m->hp.rope_mode = KVR_ROPE_NEOX;
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        if (load_layer_attn(m, il, NEED_QK_NORM) || load_layer_moe(m, il, true)) return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static struct kvr_tensor * qwen3moe_build(const struct kvr_model * m, const struct kvr_build * b) {
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
        h = build_moe(&g, l, h, KVR_MOE_SOFTMAX_TOPK_NORM, MB_ACT_SILU, il);
        x = cb(kvr_add(g.ctx, x, h), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}

static int gptoss_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (moe_load_eps(m) || load_moe_hparams(m)) return KVR_ERR_FORMAT;
    hp->rope_mode = KVR_ROPE_NEOX;
    float base_swa = hp->rope_freq_base;
    if (hp_u32(m, "attention.sliding_window", &hp->n_swa, true, 0) ||
        hp_f32(m, "rope.freq_base_swa", &base_swa, false, hp->rope_freq_base) ||
        hp_positive(m, "rope.freq_base_swa", base_swa)) {
        return KVR_ERR_FORMAT;
    }
    if (hp->n_swa > 0) { // the local layers keep YaRN, as llama.cpp's
        const int rc = load_swa_layers(m, 2, base_swa, false);
        if (rc) return rc;
    }
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        struct kvr_layer * l = &m->layers[il];
        if (load_layer_attn(m, il, 0) ||
            model_tensor(m, &l->bo, true, 1, hp->n_embd, 1, "blk.%u.attn_output.bias", il) ||
            model_tensor(m, &l->attn_post_norm, true, 1, hp->n_embd, 1, "blk.%u.post_attention_norm.weight", il) ||
            model_tensor(m, &l->attn_sinks, true, 1, hp->n_head, 1, "blk.%u.attn_sinks.weight", il) ||
            load_layer_moe(m, il, false)) {
            return KVR_ERR_FORMAT;
        }
        if (l->attn_sinks->type != KVR_TYPE_F32) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s; kvr reads attention sinks as f32 only",
                             m->path, l->attn_sinks->name, kvr_type_name(l->attn_sinks->type));
        }
    }
    return KVR_OK;
}

static struct kvr_tensor * gptoss_build(const struct kvr_model * m, const struct kvr_build * b) {
    struct mb g = mb_init(m, b);
    const float scale = 1.0f / sqrtf((float)m->hp.n_rot);
    struct kvr_tensor * x = build_inp_embd(&g), * q, * k, * v;
    for (int il = 0; il < (int)m->hp.n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = build_norm(&g, x, l->attn_norm, NULL, MB_NORM_RMS, "attn_norm", il);
        build_qkv(&g, l, h, il, &q, &k, &v);
        h = build_last_rows(&g, build_attn(&g, l, q, k, v, scale, il), il);
        x = cb(kvr_add(g.ctx, build_last_rows(&g, x, il), h), "attn_resid", il);

        // post_attention_norm is the FFN's input norm here
        h = build_norm(&g, x, l->attn_post_norm, NULL, MB_NORM_RMS, "ffn_norm", il);
        h = build_moe(&g, l, h, KVR_MOE_TOPK_SOFTMAX, MB_ACT_SWIGLU_OAI, il);
        x = cb(kvr_add(g.ctx, x, h), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}
