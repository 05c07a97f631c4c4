// models/gemma2.c - the Gemma 2 graph as GGUF stores it (llama.cpp's gemma2): Gemma 3's graph
// (models/gemma3.c: embeddings x sqrt(n_embd), post-attention and post-FFN norms on each branch's
// output, local and global layers) with
//
//   score  = attn_logit_softcapping * tanh(q.k * scale / attn_logit_softcapping), then mask, softmax
//   logits = final_logit_softcapping * tanh(out / final_logit_softcapping)
//
// (50 and 30 when the keys are absent, as llama.cpp), no q/k norms, every second layer local
// (attention.sliding_window_pattern, default 2: even layers local; window 4096 when
// attention.sliding_window is absent) with RoPE base rope.freq_base_swa (rope.freq_base when
// absent), and GELU's tanh approximation in f32 (kvr_gelu_exact). llama.cpp's CPU backend computes
// that GELU through its fp16 table instead (as kvr_gelu does for Gemma 3), which moves this
// model's logits by ~5e-3; its GPU backends compute it in f32, as here. Scores are scaled by
// 1/sqrt(head_dim), 1/sqrt(n_embd/n_head) for the 27B model (46 layers), as llama.cpp.
// Compiled as part of kvr.c, over the helpers of models/build.c.

static int gemma2_load(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &hp->norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", hp->norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    hp->rope_mode = KVR_ROPE_NEOX;
    float base_swa = hp->rope_freq_base;
    if (hp_f32(m, "attn_logit_softcapping", &hp->attn_softcap, false, 50.0f) ||
        hp_positive(m, "attn_logit_softcapping", hp->attn_softcap) ||
        hp_f32(m, "final_logit_softcapping", &hp->final_softcap, false, 30.0f) ||
        hp_positive(m, "final_logit_softcapping", hp->final_softcap) ||
        hp_u32(m, "attention.sliding_window", &hp->n_swa, false, 4096) ||
        hp_f32(m, "rope.freq_base_swa", &base_swa, false, hp->rope_freq_base) ||
        hp_positive(m, "rope.freq_base_swa", base_swa)) {
        return KVR_ERR_FORMAT;
    }
    if (hp->n_swa > 0) {
        const int rc = load_swa_layers(m, 2, base_swa, false);
        if (rc) return rc;
    }
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        if (load_layer_attn(m, il, NEED_POST_NORM) || load_layer_ffn(m, il, true, NEED_POST_NORM)) return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static struct kvr_tensor * gemma2_build(const struct kvr_model * m, const struct kvr_build * b) {
    return gemma_build(m, b, MB_ACT_GELU_EXACT, 46);
}
