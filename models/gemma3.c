// models/gemma3.c - the Gemma 3 graph as GGUF stores it (llama.cpp's build_gemma3_iswa):
//
//   x  = embd(tokens) * sqrt(n_embd)
//   h  = x + post_attn_norm(wo(attn(rope(q_norm(wq rms(x))), rope(k_norm(wk rms(x))), wv rms(x))))
//   x' = h + post_ffw_norm(down(gelu(gate rms(h)) * up rms(h)))
//
// Local layers attend over a sliding window (attention.sliding_window: a query sees itself and the
// window-1 positions before it) with RoPE base rope.freq_base_swa (10000 when absent, as llama.cpp)
// and no RoPE scaling; global layers see every earlier key with rope.freq_base and the file's
// scaling. Which layers are global: attention.sliding_window_pattern, a period n (every n-th layer,
// il % n == n-1; default 6) or one bool per layer (true: local). RoPE on rotated halves (NeoX).
// Norm weights are used as stored: the converter already wrote Gemma's (1 + w). Scores are scaled
// by 1/sqrt(head_dim) (the 27B model, 62 layers: 1/sqrt(n_embd/n_head)), as Gemma's reference code.
// GELU is GGML's tanh approximation through its fp16 table (kvr_gelu), so the logits are
// llama.cpp's. Final logit softcapping (Gemma 2's) is refused: Gemma 3 files do not have it.
// Compiled as part of kvr.c, over the helpers of models/build.c.

static int gemma3_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &hp->norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", hp->norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    hp->rope_mode = KVR_ROPE_NEOX;
    float softcap = 0.0f, base_swa = 10000.0f;
    if (hp_f32(m, "final_logit_softcapping", &softcap, false, 0.0f) ||
        hp_u32(m, "attention.sliding_window", &hp->n_swa, false, 0) ||
        hp_f32(m, "rope.freq_base_swa", &base_swa, false, 10000.0f) ||
        hp_positive(m, "rope.freq_base_swa", base_swa)) {
        return KVR_ERR_FORMAT;
    }
    if (softcap != 0.0f) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = %g (final logit softcapping) is not supported",
                         m->path, arch_key(m, "final_logit_softcapping"), softcap);
    }
    if (hp->n_swa > 0) {
        const int rc = load_swa_layers(m, 6, base_swa, true);
        if (rc) return rc;
    }
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        if (load_layer_attn(m, il, NEED_QK_NORM | NEED_POST_NORM) || load_layer_ffn(m, il, true, NEED_POST_NORM)) {
            return KVR_ERR_FORMAT;
        }
    }
    return KVR_OK;
}

// Gemma 2 (models/gemma2.c) is this graph with the exact GELU (act), no q/k norms in its files, and
// the scores and logits soft-capped (build_attn and build_output read the model's caps). The 27B
// model of each (n_layer_27b layers) scales its scores by 1/sqrt(n_embd/n_head).
static struct kvr_tensor * gemma_build(const struct kvr_model * m, const struct kvr_build * b, enum mb_act act,
                                       uint32_t n_layer_27b) {
    struct mb g = mb_init(m, b);
    const struct kvr_hparams * hp = &m->hp;
    const float scale = 1.0f / sqrtf(hp->n_layer == n_layer_27b ? (float)(hp->n_embd / hp->n_head) : (float)hp->head_dim);
    struct kvr_tensor * x = cb(kvr_scale(g.ctx, build_inp_embd(&g), sqrtf((float)hp->n_embd)), "inp_scaled", -1), * q, * k, * v;
    for (int il = 0; il < (int)hp->n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = build_norm(&g, x, l->attn_norm, NULL, MB_NORM_RMS, "attn_norm", il);
        build_qkv(&g, l, h, il, &q, &k, &v);
        h = build_last_rows(&g, build_attn(&g, l, q, k, v, scale, il), il);
        h = build_norm(&g, h, l->attn_post_norm, NULL, MB_NORM_RMS, "attn_post_norm", il);
        x = cb(kvr_add(g.ctx, build_last_rows(&g, x, il), h), "attn_resid", il);

        h = build_norm(&g, x, l->ffn_norm, NULL, MB_NORM_RMS, "ffn_norm", il);
        h = build_ffn(&g, h, l->ffn_up, NULL, l->ffn_gate, l->ffn_down, NULL, act, il);
        h = build_norm(&g, h, l->ffn_post_norm, NULL, MB_NORM_RMS, "ffn_post_norm", il);
        x = cb(kvr_add(g.ctx, x, h), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}

static struct kvr_tensor * gemma3_build(const struct kvr_model * m, const struct kvr_build * b) {
    return gemma_build(m, b, MB_ACT_GELU, 62);
}
