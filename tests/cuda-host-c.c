// tests/cuda-host-c.c - kvr.h's shared per-element functions (its KVR_BUILD section) as the C
// compiler builds them, with the flags of kvr.c, behind plain entry points. tests/test-cuda-host.cu
// calls these and the same functions as nvcc compiles them for the host, and compares the bits.

#define KVR_BUILD
#include "kvr.h"

void     hd_c_dequant_block(enum kvr_type t, const void * row, int64_t i, float * y) { kvr_dequant_block(t, row, i, y); }
float    hd_c_half_to_f32(uint16_t h)   { return kvr_half_to_f32(h); }
uint16_t hd_c_f32_to_half(float f)      { return kvr_f32_to_half(f); }
float    hd_c_bfloat_to_f32(uint16_t h) { return kvr_bfloat_to_f32(h); }
uint16_t hd_c_f32_to_bfloat(float f)    { return kvr_f32_to_bfloat(f); }
uint16_t hd_c_gelu_half(uint16_t h)     { return kvr_gelu_half(h); }
float    hd_c_gelu_ggml(float x)        { return kvr_gelu_ggml(x, NULL); }
float    hd_c_gelu_tanh(float x)        { return kvr_gelu_tanh(x); }
float    hd_c_softcap_f32(float x, float cap) { return kvr_softcap_f32(x, cap); }
float    hd_c_rope_theta_scale(float base, int n_rot)       { return kvr_rope_theta_scale(base, n_rot); }
float    hd_c_rope_theta(int32_t pos, float scale, int i)   { return kvr_rope_theta(pos, scale, i); }
void     hd_c_rope_rotate(float x0, float x1, float c, float s, float * y0, float * y1) { kvr_rope_rotate(x0, x1, c, s, y0, y1); }
float    hd_c_softmax_max(float m, float tile_max)          { return kvr_softmax_max(m, tile_max); }
float    hd_c_softmax_step(float * m, float * l, float m_new, float sum) { return kvr_softmax_step(m, l, m_new, sum); }
void     hd_c_softmax_finish(float m, float l, float * inv, float * lse) { kvr_softmax_finish(m, l, inv, lse); }
float    hd_c_lse_weight(float lse, float m)                { return kvr_lse_weight(lse, m); }
float    hd_c_lse_merged(float m, float sum)                { return kvr_lse_merged(m, sum); }
float    hd_c_rope_angle(float theta, const float * freqs, int i, float freq_scale) { return kvr_rope_angle(theta, freqs, i, freq_scale); }
int      hd_c_attn_tile(int mode, int32_t qmin, int32_t qmax, int32_t kmin, int32_t kmax, int64_t window) {
    return kvr_attn_tile(mode, qmin, qmax, kmin, kmax, window);
}
bool     hd_c_attn_visible(int32_t qp, int32_t kp, int64_t window) { return kvr_attn_visible(qp, kp, window); }
int64_t  hd_c_attn_tile_tokens(int64_t group)               { return kvr_attn_tile_tokens(group); }
void     hd_c_kv_quant_q8_0(const float * x, struct kvr_block_q8_0 * y) { kvr_kv_quant_q8_0(x, y); }
float    hd_c_kv_operand_round(enum kvr_type t, float x)  { return kvr_kv_operand_round(t, x); }
float    hd_c_kv_dot_q8_0(const struct kvr_block_q8_0 * k, const struct kvr_block_q8_0 * q, int n) { return kvr_kv_dot_q8_0(k, q, n); }
float    hd_c_kv_elem(enum kvr_type t, const void * row, int64_t i) { return kvr_kv_elem(t, row, i); }
