// models/qwen.c - Qwen 2 / 2.5 and Qwen 3 as GGUF stores them: the Llama graph of models/llama.c
// with RoPE on rotated halves (NeoX) and, Qwen 2: biases on the Q, K and V projections; Qwen 3:
// per-head RMS norms of Q and K before RoPE (attn_q_norm, attn_k_norm) and a head size of its own
// (attention.key_length: Q is head_dim*n_head wide, not n_embd). What differs is what a layer must
// have; the graph is llama_build's, which applies whichever of those pieces a layer has.
// Compiled as part of kvr.c, over the helpers of models/build.c.

static int qwen_load(struct kvr_model * m, unsigned need) {
    if (hp_f32(m, "attention.layer_norm_rms_epsilon", &m->hp.norm_eps, true, 0.0f) ||
        hp_positive(m, "attention.layer_norm_rms_epsilon", m->hp.norm_eps)) {
        return KVR_ERR_FORMAT;
    }
    m->hp.rope_mode = KVR_ROPE_NEOX;
    if (load_embeddings(m, false)) return KVR_ERR_FORMAT;
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        if (load_layer_attn(m, il, need) || load_layer_ffn(m, il, true, 0)) return KVR_ERR_FORMAT;
    }
    return KVR_OK;
}

static int qwen2_load(struct kvr_model * m) { return qwen_load(m, NEED_QKV_BIAS); }
static int qwen3_load(struct kvr_model * m) { return qwen_load(m, NEED_QK_NORM); }
