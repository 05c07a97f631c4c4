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

// (also gpt-oss's, whose default period is 2: even layers local)
static int gemma3_layer_pattern(struct kvr_model * m, bool * local, uint32_t n_default) {
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
        bool * local = kvr_calloc(hp->n_layer, sizeof(bool));
        const int rc = gemma3_layer_pattern(m, local, 6);
        for (uint32_t il = 0; il < hp->n_layer && rc == KVR_OK; il++) {
            if (!local[il]) continue;
            m->layers[il].window     = hp->n_swa;
            m->layers[il].rope_base  = base_swa;
            m->layers[il].rope_scale = 1.0f;
        }
        free(local);
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

static struct kvr_tensor * gemma3_build(const struct kvr_model * m, const struct kvr_build * b) {
    struct mb g = mb_init(m, b);
    const struct kvr_hparams * hp = &m->hp;
    const float scale = 1.0f / sqrtf(hp->n_layer == 62 ? (float)(hp->n_embd / hp->n_head) : (float)hp->head_dim);
    struct kvr_tensor * x = cb(kvr_scale(g.ctx, build_inp_embd(&g), sqrtf((float)hp->n_embd)), "inp_scaled", -1), * q, * k, * v;
    for (int il = 0; il < (int)hp->n_layer; il++) {
        const struct kvr_layer * l = &m->layers[il];
        struct kvr_tensor * h = build_norm(&g, x, l->attn_norm, NULL, MB_NORM_RMS, "attn_norm", il);
        build_qkv(&g, l, h, il, &q, &k, &v);
        h = build_last_rows(&g, build_attn(&g, l, q, k, v, scale, il), il);
        h = build_norm(&g, h, l->attn_post_norm, NULL, MB_NORM_RMS, "attn_post_norm", il);
        x = cb(kvr_add(g.ctx, build_last_rows(&g, x, il), h), "attn_resid", il);

        h = build_norm(&g, x, l->ffn_norm, NULL, MB_NORM_RMS, "ffn_norm", il);
        h = build_ffn(&g, h, l->ffn_up, NULL, l->ffn_gate, l->ffn_down, NULL, MB_ACT_GELU, il);
        h = build_norm(&g, h, l->ffn_post_norm, NULL, MB_NORM_RMS, "ffn_post_norm", il);
        x = cb(kvr_add(g.ctx, x, h), "out", il);
    }
    return build_output(&g, x, MB_NORM_RMS);
}
