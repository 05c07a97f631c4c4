// kvr.h - the whole public API of kvr, a small inference runtime for causal language models
// whose headline job is cutting the time to the first token of a long prompt.
//
// Read this file top to bottom as the manual:
//
//   1. errors         every call that can fail on user input returns an error code and leaves a
//                     message naming what was wrong and where in kvr_last_error(); files read
//                     without blocking, and written whole or not at all
//   2. types          element types; the numbering is GGUF's, so a tensor's stored type maps 1:1
//   3. tensors        struct kvr_tensor: ne[4] element counts, nb[4] byte strides, ne[0] fastest
//   4. contexts       arenas that own tensor structs (and optionally their data)
//   5. ops            the op enum and the op constructors; constructors only edit the graph
//   6. graphs         depth-first build from the outputs, liveness-based memory planning, passes
//   7. backends       the registry, buffers, the executor vtable, the comm protocol: how to write one
//   8. GGUF           reader for versions 2 and 3, every metadata type, mmap'ed tensor data; writer
//   9. vocab          SPM and byte-level BPE tokenizers, detokenization, chat templates
//  10. models         load a GGUF model, build the transformer graph of a batch; KV caches and files
//  11. sessions       the one front door: a model on one rank or many (threads, MPI processes,
//                     GPUs), prefill with a strategy, decode, files, swap, failover (kvr-comm.c)
//  12. sampling       greedy, temperature, top-k, top-p; seeded and reproducible
//  13. tuning         partition search, lookup tables, cost model and simulator (kvr-tune.c)
//
// After them, behind KVR_BUILD, an internal part that only kvr's own files see (the eval road,
// transfer schedules, test hooks, the replication-log format, the per-element math).
//
// A prefill, end to end (tools/simple.c is the same thing as a program):
//
//   struct kvr_model   * model = kvr_model_load("model.gguf", NULL);
//   struct kvr_session * sess  = kvr_session_new(model, &(struct kvr_session_params){ .n_ctx = 512 });
//   int32_t ids[512]; int n = kvr_tokenize(kvr_model_vocab(model), "Hello", ids, 512, true, false);
//   const float * logits = kvr_session_eval(sess, ids, n);        // logits of the last token
//
// Conventions: prefix kvr_/KVR_, plain structs (no typedef'd pointers), every enum ends in _COUNT.

#ifndef KVR_H
#define KVR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#ifdef KVR_BUILD
#include <math.h>   // the internal part at the end (see there)
#include <string.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KVR_VERSION "0.1.0"

//
// 1. errors
//

enum kvr_status {
    KVR_OK          =  0,
    KVR_ERR_IO      = -1, // a file could not be opened, mapped or read
    KVR_ERR_FORMAT  = -2, // a file is malformed (the message names the field and the offset)
    KVR_ERR_UNSUPP  = -3, // well-formed but not supported (an architecture, a type, a metadata key)
    KVR_ERR_ARG     = -4, // a bad argument (a flag, a prompt longer than the context, ...)
    KVR_ERR_NOMEM   = -5, // an allocation failed
    KVR_ERR_COMM    = -6, // a peer was lost or timed out
    KVR_ERR_DEVICE  = -7, // a device (GPU) is missing, or a call to it failed
    KVR_ERR_INTERRUPTED = -8, // kvr_session_interrupt stopped the eval (nothing of it was kept)
    KVR_ERR_STATUS_COUNT_ = 9,
};

// The message of the last error on this thread ("" when there was none). Thread-local.
const char * kvr_last_error(void);
// Set the message (printf-style) and return code; used by every module and by the tools.
int          kvr_error(int code, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
// Put context in front of the last error and return code: the message becomes "<context>: <last
// error>", the context printf-style (a path, a flag). This is how a caller adds where an error
// happened; kvr_error("%s: %s", path, kvr_last_error()) would format the message into itself.
int          kvr_error_prefix(int code, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Programmer errors only: never for user input.
#define KVR_ASSERT(x) do { if (!(x)) kvr_abort(__FILE__, __LINE__, #x); } while (0)
void kvr_abort(const char * file, int line, const char * expr);

// Files: every file kvr and its tools read, and every file they write whole, goes through these
// (a replication log, appended to in place, is opened without following links: kvr-comm.c).
//
// kvr_file_read opens a file for reading ("rb") only if it is a regular file, and the open never
// waits: a FIFO with no writer, a terminal or a device is refused at once (KVR_ERR_IO, the path
// and what it is named), not read from or blocked on.
//
// kvr_file_create, then writes to kvr_file_stream, then kvr_file_commit: the bytes go to a new
// temporary file beside the target (a unique name in the target's directory, created with
// O_EXCL | O_NOFOLLOW and the mode fopen would give it, so a link planted under any name is never
// followed), which is flushed, synced and renamed onto the target (and the directory synced).
// The target is then either its old self or the whole new file, never half of one; writers of
// one path at once each leave a whole file (the last rename wins). A failed commit, and
// kvr_file_abort, remove the temporary. The writer holds an flock on its temporary until then, so
// one left by a killed writer is told from a live one's: kvr_file_create removes the target's
// temporaries (PATH.<12 hex>.part) that nobody holds, only regular files of this user with one
// link, never through a link (a file of that name kept as an output of its own counts as one;
// where flock is emulated by per-process locks, as on NFS, two writers of one path in one process
// can take each other's temporary: the commit that lost it fails, the target stays whole).
// Write errors (a full disk) are kept by the stream and reported by the commit. The target must
// be a regular file or not exist yet: a symbolic link, a directory, a device, a FIFO or a socket
// is refused by kvr_file_check_target (KVR_ERR_ARG, naming what it is), which create and commit
// call and tools call before any work.
struct kvr_file;
FILE *       kvr_file_read        (const char * path);
int          kvr_file_check_target(const char * path);
int          kvr_file_create      (struct kvr_file ** out, const char * path);
FILE *       kvr_file_stream      (struct kvr_file * f);
const char * kvr_file_temp_path   (const struct kvr_file * f); // the temporary's name (tests, kvr-gen)
const char * kvr_file_target_path (const struct kvr_file * f); // the path it is renamed onto
int          kvr_file_commit      (struct kvr_file * f);       // frees f
void         kvr_file_abort       (struct kvr_file * f);       // frees f; NULL is ignored
// What a file that is not a regular one is, by its stat st_mode ("a FIFO", "a symbolic link", ...).
const char * kvr_file_kind        (unsigned int st_mode);

//
// 2. types (values are GGUF's ggml_type ids)
//

enum kvr_type {
    KVR_TYPE_F32   = 0,
    KVR_TYPE_F16   = 1,
    KVR_TYPE_Q4_0  = 2,
    KVR_TYPE_Q4_1  = 3,
    KVR_TYPE_Q5_0  = 6,
    KVR_TYPE_Q5_1  = 7,
    KVR_TYPE_Q8_0  = 8,
    KVR_TYPE_Q8_1  = 9,
    KVR_TYPE_Q2_K  = 10,
    KVR_TYPE_Q3_K  = 11,
    KVR_TYPE_Q4_K  = 12,
    KVR_TYPE_Q5_K  = 13,
    KVR_TYPE_Q6_K  = 14,
    KVR_TYPE_Q8_K  = 15,
    KVR_TYPE_I8    = 24,
    KVR_TYPE_I16   = 25,
    KVR_TYPE_I32   = 26,
    KVR_TYPE_I64   = 27,
    KVR_TYPE_F64   = 28,
    KVR_TYPE_BF16  = 30,
    KVR_TYPE_MXFP4 = 39, // OCP microscaling FP4: 32 E2M1 values and one E8M0 exponent (gpt-oss experts)
    KVR_TYPE_COUNT = 40,
};

// Elements per block and bytes per block (1 and the element size for plain types).
// A type kvr does not know has blck_size 0.
int64_t      kvr_blck_size(enum kvr_type type);
size_t       kvr_type_size(enum kvr_type type);
const char * kvr_type_name(enum kvr_type type);     // "f32", "q4_K", ...; "?" if unknown
// Whether rows of this type can be turned into f32 (the matmul and get_rows paths need it).
bool         kvr_type_supported(enum kvr_type type);
// Bytes of a row of ne0 elements (ne0 must be a multiple of the block size).
size_t       kvr_row_size(enum kvr_type type, int64_t ne0);

// Half-precision conversion (IEEE binary16 and bfloat16, round to nearest even).
float    kvr_fp16_to_fp32(uint16_t h);
uint16_t kvr_fp32_to_fp16(float f);
float    kvr_bf16_to_fp32(uint16_t h);
uint16_t kvr_fp32_to_bf16(float f);

// Convert n elements (a multiple of the block size) of a row of `type` to f32.
void kvr_to_float(enum kvr_type type, const void * src, float * dst, int64_t n);
// Convert n f32 elements to `type` (f32, f16, bf16, and the quantized types that kvr-gen writes).
// Returns bytes written, or 0 if the type cannot be written.
size_t kvr_from_float(enum kvr_type type, const float * src, void * dst, int64_t n);

//
// 3. tensors
//

#define KVR_MAX_DIMS      4
#define KVR_MAX_SRC       8
#define KVR_MAX_OP_PARAMS 16
#define KVR_MAX_NAME      64

struct kvr_buffer; // "backends"

enum kvr_tensor_flag {
    KVR_FLAG_INPUT  = 1, // filled by the caller before compute (token ids, positions)
    KVR_FLAG_OUTPUT = 2, // read by the caller after compute: its memory is never reused
    KVR_FLAG_PARAM  = 4, // a weight: data lives in the model's weights buffer
    KVR_FLAG_TILED  = 8, // a weight whose rows lie in tiles of 16 (kvr_model_params.no_tiles): only
                         //   the CPU backend's kernels read it; kvr_model_to_backend gives a device
                         //   the file's rows
};

struct kvr_tensor {
    enum kvr_type type;
    int           op;                     // enum kvr_op
    int           flags;                  // enum kvr_tensor_flag
    int64_t       ne[KVR_MAX_DIMS];       // number of elements, ne[0] fastest
    size_t        nb[KVR_MAX_DIMS];       // stride in bytes: nb[0] = type size, nb[1] = row size, ...

    int32_t       op_params[KVR_MAX_OP_PARAMS]; // op arguments (floats stored bit-wise)
    struct kvr_tensor * src[KVR_MAX_SRC];

    struct kvr_tensor * view_src;         // views share view_src's memory at view_offs
    size_t              view_offs;

    struct kvr_buffer * buffer;           // the buffer data lives in (NULL: a host tensor of a
                                          //   context made with no_alloc = false)
    void * data;                          // the address inside buffer, in its backend's address
                                          //   space (host pointer for the CPU, device pointer for
                                          //   CUDA); NULL until placed. Only backend code
                                          //   dereferences it: see "backends"
    void * extra;                         // backend-private
    int    lane;                          // 0, or 1 + the batch sequence this node serves alone
                                          //   (kvr_pass_batch): a backend may run the nodes of
                                          //   different lanes side by side, one thread each
    const char * why;                     // for nodes a pass inserted: the reason (--dump-graph)
    char   name[KVR_MAX_NAME];
};

int64_t kvr_nelements(const struct kvr_tensor * t);
int64_t kvr_nrows(const struct kvr_tensor * t);   // ne[1]*ne[2]*ne[3]
size_t  kvr_nbytes(const struct kvr_tensor * t);  // extent in bytes, views included
bool    kvr_is_contiguous(const struct kvr_tensor * t);
struct kvr_tensor * kvr_set_name(struct kvr_tensor * t, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
float   kvr_get_f32_1d(const struct kvr_tensor * t, int64_t i); // host tensors (tests)

//
// 4. contexts: an arena of tensor structs; with no_alloc = false also their data
//

struct kvr_context;

struct kvr_context * kvr_init(size_t mem_size, bool no_alloc); // NULL on allocation failure
void                 kvr_free(struct kvr_context * ctx);
size_t               kvr_used_mem(const struct kvr_context * ctx);

struct kvr_tensor * kvr_new_tensor(struct kvr_context * ctx, enum kvr_type type, int n_dims, const int64_t * ne);
struct kvr_tensor * kvr_new_tensor_1d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0);
struct kvr_tensor * kvr_new_tensor_2d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1);
struct kvr_tensor * kvr_new_tensor_3d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1, int64_t ne2);

// Views: the same memory seen with other counts and strides, starting `offset` bytes in.
struct kvr_tensor * kvr_view_1d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, size_t offset);
struct kvr_tensor * kvr_view_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1,
                                size_t nb1, size_t offset);
struct kvr_tensor * kvr_view_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
                                size_t nb1, size_t nb2, size_t offset);
// a contiguous tensor with new counts (same number of elements)
struct kvr_tensor * kvr_reshape_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
struct kvr_tensor * kvr_reshape_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1);

//
// 5. ops
//
// The X-macro is the one list of ops: the enum and the name table are both generated from it,
// so they cannot drift apart.

#define KVR_OPS(X) \
    X(NONE)        /* a leaf: weight, input, cache                                           */ \
    X(VIEW)        /* no compute: another shape over src0's memory                           */ \
    X(GET_ROWS)    /* rows of src0 [n, rows] (any supported type) picked by src1 i32 [T]     */ \
    X(ADD)         /* src0 + src1, src1 broadcast over rows, or one value a row over its row */ \
    X(MUL)         /* src0 * src1, src1 broadcast over rows, or one value a row over its row */ \
    X(SCALE)       /* src0 * s                                                               */ \
    X(RMS_NORM)    /* x / sqrt(mean(x^2) + eps) per row                                      */ \
    X(NORM)        /* (x - mean) / sqrt(var + eps) per row                                   */ \
    X(MUL_MAT)     /* src0 [K, N] (weight, any supported type) x src1 [K, T] f32 -> [N, T]   */ \
    X(MUL_MAT_ID)  /* expert-indexed MUL_MAT: src0 [K, N, E] by the experts src2 routed to   */ \
    X(MOE_ROUTE)   /* the experts of each token and their weights, from router logits        */ \
    X(MOE_SUM)     /* each token's expert outputs summed with their routing weights          */ \
    X(ROPE)        /* rotary embedding at absolute positions src1 i32                        */ \
    X(SILU)        /* x * sigmoid(x)                                                         */ \
    X(GELU)        /* tanh approximation as GGML's CPU path: fp16 in, fp16 table out         */ \
                   /* (op_params[0] 1: the same formula in f32, kvr_gelu_exact)              */ \
    X(SOFTCAP)     /* cap * tanh(x / cap): Gemma 2's final logit soft-capping                */ \
    X(SWIGLU_OAI)  /* gpt-oss's clamped SwiGLU of gate src0 and up src1                      */ \
    X(SIGMOID)     /* 1 / (1 + exp(-x))                                                      */ \
    X(SOFTPLUS)    /* log(1 + exp(x)), x itself above 20 (GGML's)                            */ \
    X(CPY)         /* copy src0 into src1's memory (f32 -> f32/f16); result is a view of src1 */ \
    X(ATTN_BLOCK)  /* high level: causal attention of q over every key up to it. A strategy  */ \
                   /* pass rewrites it; it never reaches a backend                           */ \
    X(KV_STORE)    /* write new K or V rows (src0) into the cache view src1                  */ \
    X(ATTN)        /* attention of q over k/v at absolute positions; output O and LSE        */ \
    X(MERGE_ATTN)  /* combine partial attention outputs by their log-sum-exp                 */ \
    X(ATTN_STATS)  /* per query and head: the max of its scores over keys and sum(e^(s-max)) */ \
    X(ATTN_NORMED) /* ATTN over a block of keys, its probabilities those of a softmax whose  */ \
                   /* max and sum (ATTN_STATS) span every block: rounded as one rank's are   */ \
    X(GDN_BLOCK)   /* high level: a Gated DeltaNet layer's recurrence over this batch, its   */ \
                   /* state left to a strategy pass (which rewrites it); never on a backend  */ \
    X(SSM_CONV)    /* short causal depthwise convolution + SiLU over a carried state         */ \
    X(GDN)         /* the gated delta rule over a carried state, per value head              */ \
    X(SEND)        /* send src0 to a peer rank (asynchronous; completes by the graph's end)  */ \
    X(RECV)        /* receive into src0's memory from a peer (posted when the graph starts)  */ \
    X(ALL_GATHER)  /* every rank's block of rows lands in every rank's copy (src1's memory)  */ \
    X(ALL_TO_ALL)  /* slice s of src0 goes to rank s; slice s of the result comes from s     */

enum kvr_op {
#define KVR_OP_ENUM(name) KVR_OP_##name,
    KVR_OPS(KVR_OP_ENUM)
#undef KVR_OP_ENUM
    KVR_OP_COUNT
};

const char * kvr_op_name(enum kvr_op op);

enum kvr_rope_mode {
    KVR_ROPE_NORM = 0, // rotate adjacent pairs (x[2i], x[2i+1]): llama
    KVR_ROPE_NEOX = 2, // rotate halves (x[i], x[i + n_rot/2]): falcon, gpt-neox (GGML's value)
};

enum kvr_attn_mode {
    KVR_ATTN_CAUSAL = 0, // skip tiles where every key is after every query
    KVR_ATTN_DENSE  = 1, // compute the whole rectangle, then mask (the KV-Runahead paper's setting)
};

struct kvr_tensor * kvr_get_rows (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * ids);
// ADD, MUL: b shaped as a, one row [ne0] broadcast over a's rows, or one value a row ([1, rows of a]:
// a per-token gate, qwen35moe's shared expert) broadcast along its row
struct kvr_tensor * kvr_add      (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b);
struct kvr_tensor * kvr_mul      (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b);
struct kvr_tensor * kvr_scale    (struct kvr_context * ctx, struct kvr_tensor * a, float s);
struct kvr_tensor * kvr_rms_norm (struct kvr_context * ctx, struct kvr_tensor * a, float eps);
struct kvr_tensor * kvr_norm     (struct kvr_context * ctx, struct kvr_tensor * a, float eps);
// w: [K, N] any supported type (rows of K contiguous); x: [K, T, ...] f32 with contiguous rows
// (row stride may be larger than K). result: [N, T, ...] f32.
// The CPU backend sums F32 matrices of at most 2^18 weights in llama.cpp's CPU order (tinyBLAS's
// for two or more rows of x when K % 8 == 0 and N % 4 == 0, ggml_vec_dot_f32's otherwise; see
// struct kvr_backend_params' vec_dot_order), so small models give llama.cpp's bits; larger ones go
// through sgemm. The CUDA backend does not
// follow this rule (its sums are its own at every size).
// op_params[0] KVR_MM_ROWS (kvr_pass_batch sets it, here and on MUL_MAT_ID): every token of x through the kernel one
// decode token uses, whatever their number, so each token's row of the result is what it would be
// alone (a decode batch: one read of the weights for several sequences; CPU backend).
#define KVR_MM_ROWS 1
// Unmarked, with q8_activations, a matmul of at most KVR_ROW_TOKENS tokens takes those decode
// kernels and a longer one the prefill kernels, which sum in another order (a token's bits there do
// not depend on how many tokens came with it): a prompt prefilled in pieces gives a one-piece
// prefill's bits when no piece of it is that short (kvr-server keeps to this; CPU backend).
#define KVR_ROW_TOKENS 4
struct kvr_tensor * kvr_mul_mat  (struct kvr_context * ctx, struct kvr_tensor * w, struct kvr_tensor * x);
// a: [head_dim, n_head, T] f32; pos: [T] i32 absolute positions. Rotates the first n_rot dims:
// pair i turns by the angle freq_scale * pos * freq_base^(-2i/n_rot) / freqs[i], its cosine and
// sine multiplied by attn_factor (1: a plain rotation; Phi-3's LongRoPE scales the rotated dims).
// freqs: optional f32 [n_rot/2] per-pair frequency divisors (Llama 3's rope_freqs.weight, Phi-3's
// rope_factors_short/long), src[2]; NULL divides by 1. op_params: [0] n_rot, [1] mode,
// [2] freq_base, [3] freq_scale, [5] attn_factor (f32 bits; [4] ext_factor 0: see kvr_rope_yarn).
struct kvr_tensor * kvr_rope     (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * pos,
                                  struct kvr_tensor * freqs, int n_rot, enum kvr_rope_mode mode,
                                  float freq_base, float freq_scale, float attn_factor);
// RoPE with YaRN (NeoX or normal pairs): the angle of pair i mixes the interpolated angle
// (freq_scale x the plain one) with the plain one by ramp_i * ext_factor, ramp_i = 1 - clamp((i -
// corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1), and cos and sin are multiplied by attn_factor
// x (1 + 0.1 ln(1/freq_scale)) (ggml's rope_yarn; ext_factor 0: kvr_rope times attn_factor).
// corr_lo/hi: kvr_rope_yarn_corr_dims. op_params [4] ext_factor, [5] attn_factor, [6] corr_lo,
// [7] corr_hi (f32 bits); kvr_rope sets ext_factor 0.
struct kvr_tensor * kvr_rope_yarn(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * pos,
                                  struct kvr_tensor * freqs, int n_rot, enum kvr_rope_mode mode, float freq_base,
                                  float freq_scale, float ext_factor, float attn_factor, float corr_lo, float corr_hi);
// The pairs where YaRN's ramp starts and ends (ggml_rope_yarn_corr_dims): the dims whose wavelength
// makes beta_fast and beta_slow turns over n_ctx_orig positions, floored / ceiled, within [0, n_rot-1].
void kvr_rope_yarn_corr_dims(int n_rot, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                             float * lo, float * hi);
struct kvr_tensor * kvr_silu     (struct kvr_context * ctx, struct kvr_tensor * a);
struct kvr_tensor * kvr_gelu     (struct kvr_context * ctx, struct kvr_tensor * a);
// GELU's tanh approximation computed in f32 (kvr_gelu_tanh), without GGML's fp16 table: what
// llama.cpp's GPU backends compute, and its CPU built without GGML_GELU_FP16 (Gemma 2's reference)
struct kvr_tensor * kvr_gelu_exact(struct kvr_context * ctx, struct kvr_tensor * a);
// cap * tanh(a / cap) elementwise (kvr_softcap_f32), cap > 0; op_params[0] cap (f32 bits)
struct kvr_tensor * kvr_softcap  (struct kvr_context * ctx, struct kvr_tensor * a, float cap);
// gpt-oss's SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha g) * (u + 1)
// (the model hard-codes alpha 1.702 and limit 7). gate and up: the same shape, f32, contiguous.
struct kvr_tensor * kvr_swiglu_oai(struct kvr_context * ctx, struct kvr_tensor * gate, struct kvr_tensor * up,
                                   float alpha, float limit);

// Mixture of experts, as llama.cpp's build_moe_ffn computes it (one token's FFN is the weighted sum
// of the FFNs of the k experts its router picks):
//
//   route = kvr_moe_route(logits [E, T], k, gating)      [2k, T]: weights, then expert ids
//   g     = kvr_mul_mat_id(gate_exps [K, F, E], x [K, T], route, bias [F, E] or NULL)   [F, k, T]
//   u     = kvr_mul_mat_id(up_exps, x, route, bias)        act = silu(g) * u (or kvr_swiglu_oai)
//   d     = kvr_mul_mat_id(down_exps [F, K, E], act [F, k, T], route, bias)             [K, k, T]
//   out   = kvr_moe_sum(d, route)                          [K, T]
//
// How the k experts and their weights come from a token's router logits (bias already added):
enum kvr_moe_gating {
    KVR_MOE_SOFTMAX_TOPK      = 0, // p = softmax over all E; the k largest p; weights p (mixtral-style)
    KVR_MOE_SOFTMAX_TOPK_NORM = 1, //   the same, the weights divided by their sum (>= 6.1e-5): qwen3moe
    KVR_MOE_TOPK_SOFTMAX      = 2, // the k largest logits; weights the softmax over those k: gpt-oss
    KVR_MOE_GATING_COUNT,
};
// route: f32 [2k, T]; row t holds token t's k weights, then its k expert ids (as exact floats, in
// the order of the selection: largest first). op_params [0] k, [1] gating.
struct kvr_tensor * kvr_moe_route(struct kvr_context * ctx, struct kvr_tensor * logits, int k, enum kvr_moe_gating gating);
// y[:, j, t] = w[:, :, e] . x[:, j or 0, t] (+ b[:, e]) with e = token t's j-th expert: x is [K, T]
// (every expert of a token reads the same row) or [K, k, T] (each its own); w [K, N, E] any supported
// type with whole rows per expert. Only the rows of experts some token picked are read: on the CPU
// tokens are grouped by expert and struct kvr_counters' expert_bytes counts the weight bytes read
// (CUDA: a decode step's slots each read their expert's rows; a prompt's slots are grouped by expert
// and each picked expert's matrix goes once through cuBLAS; it counts none). b: optional
// f32 [N, E], src[3]. result [N, k, T] f32.
struct kvr_tensor * kvr_mul_mat_id(struct kvr_context * ctx, struct kvr_tensor * w, struct kvr_tensor * x,
                                   struct kvr_tensor * route, struct kvr_tensor * b);
// out[:, t] = sum over j in order of w_jt y[:, j, t]: y [N, k, T], route as above. result [N, T]
struct kvr_tensor * kvr_moe_sum(struct kvr_context * ctx, struct kvr_tensor * y, struct kvr_tensor * route);
struct kvr_tensor * kvr_sigmoid  (struct kvr_context * ctx, struct kvr_tensor * a);
struct kvr_tensor * kvr_softplus (struct kvr_context * ctx, struct kvr_tensor * a);
// a (f32) into b (f32, f16, bf16 or q8_0: converted), or rows of a into rows of b of the same type
// and row length (any type: the bytes as they are; CPU backend)
struct kvr_tensor * kvr_cpy      (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b);
// a contiguous f32 copy of a (for instance of a strided view into a fused QKV projection)
struct kvr_tensor * kvr_cont     (struct kvr_context * ctx, struct kvr_tensor * a);

// High-level attention of layer il: q [head_dim, n_head, T], k/v [head_dim, n_head_kv, T] of the
// same tokens, at positions pos [T], scores scaled by scale and soft-capped by softcap (0: not;
// see kvr_attn), each query seeing the keys of the last `window` positions up to its own (0: every
// earlier key). The strategy pass (kvr_pass_single, or those of kvr-comm.c) replaces it by cache
// writes, transfers and ATTN nodes; it reads op_params [0] il, [1] window, [2] scale, [3] softcap
// (f32 bits).
struct kvr_tensor * kvr_attn_block(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                   struct kvr_tensor * v, struct kvr_tensor * pos, int il, float scale, float softcap,
                                   int window);
float kvr_attn_block_scale(const struct kvr_tensor * block);
float kvr_attn_block_softcap(const struct kvr_tensor * block);
int   kvr_attn_block_window(const struct kvr_tensor * block);
// Attention sinks (gpt-oss): sinks f32 [n_head], head h's logit s_h joins the softmax's denominator
// and adds no value: p_j = e^(a_j - m) / (sum_j e^(a_j - m) + e^(s_h - m)), m = max(max_j a_j, s_h),
// s_h not scaled. Set on an ATTN_BLOCK (src[4]; a strategy pass hands it on), on an ATTN (src[6]: its
// output and LSE then include the sink), or on a MERGE_ATTN of n parts (src[n]: added to the merged
// result). Partials that are merged must not have it: the sink is counted once, where the softmax
// over every key is complete. Returns t; kvr_attn_sinks_of reads it back (NULL: none).
struct kvr_tensor * kvr_attn_sinks(struct kvr_tensor * t, struct kvr_tensor * sinks);
struct kvr_tensor * kvr_attn_sinks_of(const struct kvr_tensor * t);

// Store new rows into a cache view: a [kv_dim, T] f32, dst a view [kv_dim, T] of the cache.
// The result is dst itself seen as a node, so readers of the cache can depend on the store.
struct kvr_tensor * kvr_kv_store (struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * dst);

// Attention with an online softmax, tiled.
//   q    [head_dim, n_head,    Tq] f32 (rows may be strided)
//   k, v [head_dim, n_head_kv, Tk] f32 (n_head % n_head_kv == 0: MHA, GQA, MQA)
//   qpos [Tq] i32, kpos [Tk] i32: absolute positions; key j is seen by query i iff
//        kpos[j] <= qpos[i] and, with window > 0, qpos[i] - kpos[j] < window (sliding-window
//        attention as llama.cpp's standard SWA: a query sees itself and the window-1 keys before it).
//        Masking from positions, not indices, is what keeps every strategy and sharding correct.
//   dep  optional: a node that must run first (the KV_STORE that filled k and v)
//   scale multiplies q.k; softcap > 0 then caps each score s to softcap * tanh(s / softcap)
//        before the mask and the softmax (Gemma 2's attention logit soft-capping; kvr_softcap_f32),
//        0 leaves it; window: 0 for full causal attention
// op_params (a device kernel reads the same): [0] mode, [1] n_head, [2] scale (f32 bits), [3] window,
// [4] softcap (f32 bits), [5] the CPU kernel (kvr_attn_kernel_as; 0: by its own shape).
// In causal mode a tile is skipped when every key is after every query or, with a window, more
// than window-1 positions before every query; the counters count the pairs the mask lets through.
// result: [head_dim*n_head + n_head, Tq] f32: per query row, the output of each head, then the
// natural log of each head's softmax denominator (log-sum-exp of the scaled scores) that a later
// MERGE_ATTN needs. A row whose keys are all masked has O = 0 and LSE = -INFINITY.
// Small shapes on the CPU (Tq * Tk <= 2^14 scores per head) are computed in llama.cpp's
// arithmetic with flash attention off (KQ dots, soft_max with GGML's expf and sums, then KQV dots
// over the keys, each in GGML's order; kvr.c: cpu_op_attn_exact), so the small references agree
// to the last bits; larger ones use the tiled online softmax. The CUDA backend's ATTN kernel is
// tiled at every size (its results agree to rounding, not to llama.cpp's bits).
struct kvr_tensor * kvr_attn(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                             struct kvr_tensor * v, struct kvr_tensor * qpos, struct kvr_tensor * kpos,
                             struct kvr_tensor * dep, float scale, float softcap, int window, enum kvr_attn_mode mode);
// Whether the CPU runs an ATTN of Tq queries over Tk keys in llama.cpp's arithmetic (the small
// shapes above), not tiled: where it rounds F16/BF16 probabilities after normalising them.
bool kvr_attn_cpu_exact(int64_t Tq, int64_t Tk);
// An ATTN that is a rank's part of what one ATTN of tq queries over tk keys computes in the single
// pass (the rank's queries, each over the keys it sees, from the first) takes the CPU kernel that
// one would take, not the one its own shape picks: every query's row then has the single pass's
// bits. Returns attn.
struct kvr_tensor * kvr_attn_kernel_as(struct kvr_tensor * attn, int64_t tq, int64_t tk);
// Merge n partial ATTN results of the same queries (same layout as kvr_attn's result):
// O = sum_i exp(lse_i - lse) O_i, lse = log(sum_i exp(lse_i)). Empty partials (lse -inf) drop out.
struct kvr_tensor * kvr_merge_attn(struct kvr_context * ctx, struct kvr_tensor ** parts, int n, int n_head);
// The softmax of a query spread over blocks of keys (the ring strategies), with an F16 or BF16 V:
// one rank's ATTN rounds each probability to V's type after normalising it over every key, so a
// block's rounding needs the max and the sum of the whole softmax before it, not the block's own.
//   kvr_attn_stats: [2*n_head, Tq] f32: per query row, each head's max score over the keys of k it
//     sees ([h]; -INFINITY where none), then the sum of e^(score - max) over them ([n_head + h], in
//     double, stored f32; 0 where none). prev (optional, src[2]): [2*n_head, Tq, n] statistics of
//     other keys, folded in (the max of all, each sum scaled to it). Arguments and op_params as
//     kvr_attn's (no v, no sinks).
//   kvr_attn_normed: kvr_attn's result for the block k/v, from probabilities normalised by the
//     statistics of every key: stats [2*n_head, Tq, n] holds n ATTN_STATS results (of disjoint
//     blocks, this one among them) that fold into the max M and the sum S of the whole softmax
//     (sinks, optional: each head's sink logit joins M and S, as kvr_attn_sinks'). Key j's
//     probability is p_j = e^(s_j - M) * (float)(1/S), rounded to V's type where V is F16 or BF16
//     (the query to K's, as kvr_attn), and O_b = sum_j p_j v_j. The result is what MERGE_ATTN
//     merges: O_b * S / S_b and the block's log-sum-exp M + log(S_b), S_b = sum_j e^(s_j - M) over
//     the block's visible keys; merged (with the sinks on the merge), the output is sum_b O_b: the
//     probabilities one rank's ATTN over every key takes, to the float rounding of the sums (a
//     row that sees no key of the block: O 0, LSE -inf, as ATTN). The CPU backend runs both (F32,
//     F16 or BF16 K and V; every score by its own dot, in the order of the exact ATTN kernel: made
//     for the shapes kvr_attn_cpu_exact takes, not for long prompts); CUDA runs neither (its ATTN
//     rounds tiles of unnormalised weights).
struct kvr_tensor * kvr_attn_stats(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                   struct kvr_tensor * qpos, struct kvr_tensor * kpos, struct kvr_tensor * prev,
                                   struct kvr_tensor * dep, float scale, float softcap, int window, enum kvr_attn_mode mode);
struct kvr_tensor * kvr_attn_normed(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                    struct kvr_tensor * v, struct kvr_tensor * qpos, struct kvr_tensor * kpos,
                                    struct kvr_tensor * stats, struct kvr_tensor * sinks, struct kvr_tensor * dep,
                                    float scale, float softcap, int window, enum kvr_attn_mode mode);
// The output part of an ATTN or MERGE_ATTN result: a view [head_dim*n_head, Tq].
struct kvr_tensor * kvr_attn_out(struct kvr_context * ctx, struct kvr_tensor * attn, int n_head);

// Gated DeltaNet, the linear-attention layers of Qwen3.5 (llama.cpp's qwen35 graph). Such a layer
// keeps a state instead of K/V rows: the last d_conv-1 inputs of its convolution, then one
// d_k x d_v matrix per value head (kvr_gdn_state_floats). The shapes of one layer:
struct kvr_gdn_shape {
    int   il;       // the layer
    int   d_conv;   // convolution kernel size (ssm.conv_kernel)
    int   n_k, d_k; // key heads (ssm.group_count) and their size (ssm.state_size)
    int   n_v, d_v; // value heads (ssm.time_step_rank) and their size (d_k: llama.cpp requires it)
    float eps;      // of the L2 norms of q and k
};
// High-level recurrence of layer sh->il over this batch, what the model's graph holds; a strategy
// pass rewrites it into kvr_gdn_segment's nodes over the state it chooses, as ATTN_BLOCK.
//   x     [C, T] f32: each token's mixed projection q | k | v, C = 2*n_k*d_k + n_v*d_v (rows may be strided)
//   conv  [d_conv, C] f32: the depthwise convolution (ssm_conv1d)
//   g     [n_v, T] f32: each value head's log decay, softplus(alpha + dt_bias) * ssm_a (negative)
//   beta  [n_v, T] f32: each value head's write strength, sigmoid(W_beta x)
// result: the output o [d_v, n_v, T] of every value head.
struct kvr_tensor * kvr_gdn_block(struct kvr_context * ctx, struct kvr_tensor * x, struct kvr_tensor * conv,
                                  struct kvr_tensor * g, struct kvr_tensor * beta, const struct kvr_gdn_shape * sh);
void    kvr_gdn_block_shape(const struct kvr_tensor * block, struct kvr_gdn_shape * sh);
int64_t kvr_gdn_state_floats(const struct kvr_gdn_shape * sh);
// Tokens [t0, t0+n) of a GDN_BLOCK as nodes over state [kvr_gdn_state_floats] f32, updated in
// place: before, the state after token t0-1 (fresh: the zero state of an empty sequence, whatever
// state holds); after, the state after token t0+n-1. dep (optional): a node that must run first
// (the receive that filled state, or the segment before on the same state). Returns o
// [d_v, n_v, n] (the GDN node, after the SSM_CONV node it reads); readers of the new state depend on it.
struct kvr_tensor * kvr_gdn_segment(struct kvr_context * ctx, const struct kvr_tensor * block, int64_t t0, int64_t n,
                                    struct kvr_tensor * state, bool fresh, struct kvr_tensor * dep);
// The two kernels of a segment, each updating its part of the state in place (src[2] / src[5]):
// SSM_CONV: x [C, T] (rows may be strided), w [d_conv, C], state [(d_conv-1)*C] f32 (channel c's
//   last d_conv-1 inputs at [c*(d_conv-1)], oldest first). result [C, T]:
//   silu(sum_k w[k, c] * x[t-d_conv+1+k, c]), the inputs before t = 0 taken from the state.
// GDN: q, k [d_k, n_k, T], v [d_v, n_v, T] (rows may be strided), g, beta [n_v, T], state
//   [n_v * d_v * d_k] f32 (head h's matrix S at [h*d_v*d_k], stored transposed: S[i][j] at [j*d_k + i]).
//   Value head h uses key head h % n_k (llama.cpp's converter orders the value heads so). q and k
//   are L2-normalised first (x / sqrt(sum x^2 + eps)); then per token S = e^g S, d = beta (v - S^T k),
//   S += k d^T, o = S^T q / sqrt(d_k). result [d_v, n_v, T].
// op_params: SSM_CONV [0] fresh; GDN [0] fresh, [1] eps (f32 bits). SSM_CONV's src[3] may hold a
// node it must run after (kvr_gdn_segment's dep).
struct kvr_tensor * kvr_ssm_conv(struct kvr_context * ctx, struct kvr_tensor * x, struct kvr_tensor * w,
                                 struct kvr_tensor * state, bool fresh);
struct kvr_tensor * kvr_gdn(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k, struct kvr_tensor * v,
                            struct kvr_tensor * g, struct kvr_tensor * beta, struct kvr_tensor * state, float eps, bool fresh);

// Communication nodes (executed through the backend's struct kvr_comm; see "backends" and "sessions").
// tag: what the message is (layer, kind, step): kvr_tag() packs it, and errors name it.
//   send:       src goes to rank peer. Its memory is kept alive until the graph ends.
//   recv:       dst (a view, e.g. of the cache) is filled from rank peer; the result is dst as a
//               node, so readers depend on the receive. Posted as soon as the graph starts.
//   all_gather: dst [n, total] gets the rows of every rank; rank q owns rows
//               [total*q/n_ranks, total*(q+1)/n_ranks) and contributes src [n, its rows].
//   all_to_all: src [n, rows_max, n_ranks]: slice s (its first rows_of(s) rows) goes to rank s;
//               the result [n, rows_max, n_ranks] holds in slice s the first rows_of(me) rows
//               from rank s. rows_of(s) = ring_rows(total, n_ranks, s) (kvr_ring_shard).
struct kvr_tensor * kvr_send      (struct kvr_context * ctx, struct kvr_tensor * src, int peer, int tag);
struct kvr_tensor * kvr_recv      (struct kvr_context * ctx, struct kvr_tensor * dst, int peer, int tag);
struct kvr_tensor * kvr_all_gather(struct kvr_context * ctx, struct kvr_tensor * src, struct kvr_tensor * dst,
                                   int n_ranks, int64_t total, int tag);
struct kvr_tensor * kvr_all_to_all(struct kvr_context * ctx, struct kvr_tensor * src, int n_ranks, int64_t total, int tag);

enum kvr_tag_kind {
    KVR_TAG_K = 0, KVR_TAG_V, KVR_TAG_KPOS, KVR_TAG_Q, KVR_TAG_QPOS, KVR_TAG_PARTIAL, KVR_TAG_LOGITS,
    KVR_TAG_STATE, // a recurrent layer's state (kvr_kv_cache.state) handed on
    KVR_TAG_STATS, // softmax statistics (ATTN_STATS) a ring shares before it rounds probabilities
    KVR_TAG_KIND_COUNT,
};
static inline int kvr_tag(int layer, enum kvr_tag_kind kind, int step) { return (layer << 12) | ((int)kind << 8) | (step & 0xff); }
static inline int kvr_tag_layer(int tag) { return tag >> 12; }
static inline int kvr_tag_kind(int tag)  { return (tag >> 8) & 0xf; }
static inline int kvr_tag_step(int tag)  { return tag & 0xff; }
const char * kvr_tag_kind_name(int kind); // "K", "V", "key positions", ...

//
// 6. graphs
//

struct kvr_graph {
    int                  n_nodes;
    int                  n_leafs;
    int                  size;
    struct kvr_tensor ** nodes;  // in execution order (a depth-first post-order from the outputs)
    struct kvr_tensor ** leafs;
    void *               plan;   // memory plan between kvr_graph_plan and kvr_graph_place
    struct kvr_context * ctx;    // where the graph lives (the memory of kvr_graph_compute_cpu too)
};

// A graph with room for `size` nodes and `size` leafs, allocated in ctx.
struct kvr_graph * kvr_graph_new(struct kvr_context * ctx, int size);
// Add t and everything it depends on (depth first, each tensor once).
void               kvr_graph_expand(struct kvr_graph * g, struct kvr_tensor * t);
void               kvr_graph_reset(struct kvr_graph * g);
void               kvr_graph_print(const struct kvr_graph * g, FILE * f); // one line per node, with causes
struct kvr_tensor * kvr_graph_get(const struct kvr_graph * g, const char * name); // node or leaf by name

// Plan memory for every node and input without data: a node's buffer is reused once its last
// reader has run (outputs and inputs keep theirs). Returns the bytes needed.
size_t kvr_graph_plan(struct kvr_graph * g);
// Place every planned tensor inside buf (of at least kvr_graph_plan() bytes, usually from
// kvr_backend_alloc_buffer): data = base + offset, buffer = buf; views follow their owners.
// buf NULL only drops the plan (after an allocation failed).
void   kvr_graph_place(struct kvr_graph * g, struct kvr_buffer * buf);

// What a strategy pass does to a node: `node` becomes `by` (op, sources, shape) and keeps its
// name, flags and placed memory, so its readers need no rewiring; why says what the pass did.
void kvr_replace_node(struct kvr_tensor * node, const struct kvr_tensor * by, const char * why);

// A pass rewrites nodes in place and adds new ones that only the outputs reach; it ends by
// rebuilding the graph from its outputs (the nodes nothing else in it reads).
void kvr_graph_rebuild(struct kvr_graph * g);
//
// The single-rank strategy: every ATTN_BLOCK becomes KV_STORE(k), KV_STORE(v) into the cache at
// positions [n_past, n_past + T) and ATTN(q, cache[0 : n_past + T]). kpos must hold 0..n_past+T-1.
// Every GDN_BLOCK becomes its recurrence over the layer's state in the cache (from the zero state
// when n_past is 0), updated in place.
struct kvr_kv_cache;
void kvr_pass_single(struct kvr_context * ctx, struct kvr_graph * g, struct kvr_kv_cache * cache,
                     int n_past, struct kvr_tensor * kpos, enum kvr_attn_mode mode);
// The batch of T sequences (kvr_session_eval_batch): token b is the next one of sequence b, whose
// n_past[b] rows are in caches[b]. Every ATTN_BLOCK becomes, per token, the single pass over its
// own cache: its K/V stored at row n_past[b], attention over rows [0, n_kv[b]) (n_kv[b] > n_past[b];
// rows past the token carry position INT32_MAX in kpos, which the causal mask hides: the layout of
// a solo decode's kept graph), the T outputs side by side. kpos holds each sequence's n_kv[b] row
// positions in turn. Every GDN_BLOCK becomes, per token, one step of the recurrence on from its own
// cache's state (from the zero state where n_past[b] is 0), updated in place.
void kvr_pass_batch(struct kvr_context * ctx, struct kvr_graph * g, struct kvr_kv_cache * const * caches,
                    const int * n_past, const int * n_kv, struct kvr_tensor * kpos, enum kvr_attn_mode mode);

//
// 7. backends
//
// A backend runs graphs and owns the memory they run in: the weights (kvr_model_to_backend), the
// KV cache (kvr_kv_cache_new) and the activations of each eval (kvr_graph_plan + kvr_graph_place)
// live in its buffers. A tensor knows its buffer; its data is an address inside that buffer in
// the backend's address space. Outside a backend nothing reads or writes through data of a
// backend tensor: inputs go in with kvr_backend_tensor_set, outputs come out with
// kvr_backend_tensor_get (tests/check-seam.sh greps kvr-comm.c, models/, tools/ and the
// non-backend sections of kvr.c for it).
//
// Writing a backend (the CPU backend in kvr.c is the reference; kvr-cuda.cu the second one):
//
//  1. Fill a struct kvr_backend_i and return a struct kvr_backend from a constructor that takes
//     struct kvr_backend_params (options only one backend has are fields there, read once when
//     it is made: the CPU's q8_activations); add one line for it to the registry in kvr.c
//     kvr.c's "backends" section (its constructor NULL in builds without the flag that compiles it, as KVR_CUDA)
//     and its object to the Makefile. kvr_backend_new, the tools' --backend and test-ops -b then
//     take it.
//  2. Memory. buf_alloc gets buf->size and sets buf->base (64-byte aligned at least) and
//     buf->context, buf->host (base is memory this process can address: CPU) and buf->owned.
//     buf_from_host places bytes of host memory that outlive the buffer (the model file's data
//     section): the CPU wraps the pointer (zero-copy, owned false), a device uploads them once.
//     buf_clear sets every byte. tensor_set/tensor_get copy n bytes at byte off of a tensor's
//     data from/to host memory and are complete when they return. kvr fills buf->backend and
//     does the placement (data = base + offset) itself.
//  3. graph_compute runs g->nodes in order (leafs and VIEW nodes need nothing). kvr has checked
//     that no ATTN_BLOCK is left, that every node is placed and that every tensor lives in a
//     buffer of this backend or in host memory (no buffer, or a buffer with host set): a backend
//     that cannot read host memory says so with an error. supports_op says which nodes it can run.
//  4. Communication nodes (SEND, RECV, ALL_GATHER, ALL_TO_ALL) are not the backend's: when it
//     reaches one, it completes every node before it, calls kvr_backend_comm_node(be, node), and
//     stops with that code at the first one that does not return KVR_OK. The rest of the protocol
//     is one routine in kvr.c, kvr_backend_graph_compute, the same for every backend: it posts
//     every RECV before graph_compute starts (transfers overlap the compute before them), and
//     after graph_compute ends, however it ended, completes or cancels every outstanding send and
//     receive; the first error is the one returned.
//  5. Transports (local threads, MPI) move host memory. A comm node whose memory is host (buffer
//     host) is handed to the transport as it is: the local transport copies once, sender to
//     receiver. Otherwise kvr stages it in host scratch it owns for the graph: tensor_get before a
//     send (kept until the sends complete), tensor_set after a receive lands. So a device backend
//     runs every strategy over the existing transports with no code of its own; a transport that
//     moves device memory itself (NCCL) sets kvr_comm.device_ptrs and receives data unstaged.
//  6. Optional entries (NULL when the backend has none; the kvr_backend_* wrappers then do
//     nothing or report nothing): set_threads, set_trace + spans (one span per layer and per
//     transfer, for --trace), counters (struct kvr_counters, for --stats and the papers' checks).
//     Only what every backend could mean is a slot; a knob of one backend is a params field.
//  7. synchronize waits for everything queued and returns the first error of the device.

struct kvr_backend;
struct kvr_comm;
struct kvr_span;
struct kvr_counters;

struct kvr_buffer {
    struct kvr_backend * backend;  // NULL: plain host memory of this process (kvr_graph_compute_cpu)
    void *               base;     // in the backend's address space
    size_t               size;     // bytes
    bool                 host;     // base is host memory this process can read and write
    bool                 owned;    // freeing the buffer frees the memory (false: wrapped)
    void *               context;  // the backend's
};

struct kvr_backend_i {
    const char * (*name)         (struct kvr_backend * be);
    void         (*free)         (struct kvr_backend * be);
    bool         (*supports_op)  (struct kvr_backend * be, const struct kvr_tensor * op);
    int          (*buf_alloc)    (struct kvr_backend * be, struct kvr_buffer * buf);
    int          (*buf_from_host)(struct kvr_backend * be, struct kvr_buffer * buf, const void * host);
    void         (*buf_free)     (struct kvr_backend * be, struct kvr_buffer * buf);
    void         (*buf_clear)    (struct kvr_backend * be, struct kvr_buffer * buf, uint8_t value);
    void         (*tensor_set)   (struct kvr_backend * be, struct kvr_tensor * t, const void * src, size_t off, size_t n);
    void         (*tensor_get)   (struct kvr_backend * be, const struct kvr_tensor * t, void * dst, size_t off, size_t n);
    int          (*graph_compute)(struct kvr_backend * be, struct kvr_graph * g);
    int          (*synchronize)  (struct kvr_backend * be);
    // optional
    void         (*set_threads)       (struct kvr_backend * be, int n_threads);
    void         (*set_trace)         (struct kvr_backend * be, bool on);
    const struct kvr_span * (*spans)  (struct kvr_backend * be, int * n, bool reset);
    void         (*counters)          (struct kvr_backend * be, struct kvr_counters * out, bool reset);
};

struct kvr_backend {
    struct kvr_backend_i iface;
    void *               context;  // the backend's
    struct kvr_comm *    comm;     // the rank's endpoint for comm nodes (kvr_backend_set_comm)
    void *               run;      // kvr's state of the graph being computed; backends leave it alone
    // Asked before each node (kvr_backend_interrupted): true stops the graph there, the compute
    // returning KVR_ERR_INTERRUPTED (the session's interrupt; NULL: never)
    bool              (* interrupted)(void * user);
    void *               interrupted_user;
};

#define KVR_MAX_THREADS 256

// A rank's endpoint for communication nodes. kvr-comm.c implements it (threads of one process,
// MPI, NCCL); kvr_backend_graph_compute calls it, so kvr.c needs no transport. It sees host
// pointers (staged when the node's memory is not host, unless device_ptrs), never a tensor's data.
struct kvr_comm_i {
    // graph start, first: the graph about to run (kvr-comm.c makes its transfer schedule from it)
    int  (*begin)    (struct kvr_comm * c, const struct kvr_graph * g);
    // graph start, then: a RECV node's kvr_nbytes(node) bytes will land at dst
    int  (*post_recv)(struct kvr_comm * c, const struct kvr_tensor * node, void * dst);
    // in order, every comm node: dst is the node's memory (RECV, ALL_GATHER, ALL_TO_ALL), src its
    // src[0]'s (SEND, ALL_GATHER, ALL_TO_ALL; kept alive until finish); NULL where unused
    int  (*exec)     (struct kvr_comm * c, const struct kvr_tensor * node, void * dst, const void * src);
    // graph end, even after a failure: complete outstanding sends, cancel receives never waited for
    int  (*finish)   (struct kvr_comm * c);
};
struct kvr_comm {
    struct kvr_comm_i iface;
    int               rank;
    int               n_ranks;
    bool              device_ptrs; // the transport moves backend memory itself: never stage
    void *            context;
};

// A trace span: what ran from t0 to t1 (ms) on a rank.
struct kvr_span {
    char   name[48];
    double t0, t1;
    char   cat;      // 'l' layer compute, 'c' communication
};

// Counters a backend keeps (the papers' claims are checked against them; the CPU keeps all).
struct kvr_counters {
    int64_t attn_dot_dense;   // query-key pairs computed (one head, one layer counts 1 per pair)
    int64_t attn_dot_causal;  // query-key pairs causality needs
    int64_t matmul_flops;     // 2*K*N*T per MUL_MAT (MUL_MAT_ID: per token and expert it ran)
    int64_t expert_bytes;     // weight bytes MUL_MAT_ID read: the rows of the experts tokens picked (CPU)
    double  compute_ms;
    double  op_ms[KVR_OP_COUNT]; // wall time per op kind (thread 0's view, barrier included)
};

// What a backend is made with. The fields of one backend are ignored by the others; they are
// fixed for the backend's life (a different setting is a new backend).
struct kvr_backend_params {
    int  n_threads;      // cpu: threads (<= 0: all cores)
    int  device;         // cuda: the first GPU of this node's ranks (see kvr_rank_gpu)
    int  node_rank;      // cuda: this rank's index among the ranks of its node (0: the first)
    // cpu: matmuls over quantized weights (every type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K ...
    // Q6_K, Q8_K), prefill and decode, quantize the activations to 8 bits by llama.cpp's rules
    // (Q8_0/Q8_1 blocks of 32 for the legacy types, Q8_K super-blocks of 256 for the k-quants) and
    // multiply in integers, as llama.cpp's CPU backend does: faster, but the logits move by up to
    // ~0.1 against the exact math of the file, which the default (off) computes: f32 activations
    // times the weights' exact values. F16/BF16/F32 weights always take the exact path. CUDA stays
    // exact. kvr-run and kvr-bench turn it on unless given --exact (per thread the exact path runs
    // every quantized type at about half the speed), and kvr-server too; kvr-compare is exact.
    bool q8_activations;
    // cpu: small F32 matmuls and the KQV of small attention (kvr_mul_mat, kvr_attn) are summed as
    // llama.cpp's CPU backend sums them, which depends on how it was built: with GGML_LLAMAFILE
    // (its default; off here) a batch of two or more tokens goes through tinyBLAS's order; without
    // it (on here) every sum is ggml_vec_dot_f32's. The outside references say which build made
    // them (tiny-falcon-mqa: without; the archs/ and SmolLM2 ones: with). Either way the results
    // are exact to rounding; only the last bits differ.
    bool vec_dot_order;
    // cpu: those sums (and the exact attention kernel's softmax) as a llama.cpp CPU backend built
    // for AVX-512 makes them, 16 lanes at a time, rather than AVX2's 8 (off); and SiLU with its
    // exp, and every matmul not on 8-bit activations (q8_activations), whatever its size and
    // weight type, as that build computes it on the weights' F32 twin (tinyBLAS's order for a
    // batch it takes, ggml_vec_dot_f32's otherwise). Only the last bits differ, but an F16 or
    // Q8_0 cache rounds them into whole steps: the kv/ references were made by an AVX-512 build,
    // the archs/ and SmolLM2 ones by sums in AVX2's order. Slower: its kernels serve this only.
    bool avx512_order;
    bool trace;          // record spans (kvr_backend_spans)
    bool node_times;     // cuda: time every node by events (the counters' op_ms; trace implies it).
                         // Off, a graph without transfers or growing buffers runs as one CUDA graph
    bool ref_kernels;    // cpu: kvr.c's plain reference kernels instead of the fast ones (slow; what
                         // the fast ones are checked against). KVR_REF=1 in the environment when a
                         // CPU backend is made does the same.
};

// The GPU a rank runs on, one rule for every launch (one process driving several ranks, one rank
// a process under mpirun or Slurm, MPI or NCCL): its index among the ranks of its node, counted from
// the first GPU asked for, modulo the GPUs the process sees. A launcher that shows each process one
// GPU (CUDA_VISIBLE_DEVICES per rank, Slurm's --gpus-per-task=1) makes that 0 for every rank; with
// every GPU of a node visible, the node's ranks take its GPUs in turn. Never a global rank: with
// several nodes and round-robin placement that would put two ranks of a node on one GPU. visible
// < 1: -1 (there is no GPU); first < 0 counts as 0.
int kvr_rank_gpu(int node_rank, int first, int visible);

// OpenBLAS older than the CPU (Debian 12's 0.3.21 on a Xeon of 2023 and later) does not know it and
// runs its SSE3 "Prescott" kernels: every sgemm (the exact path's prompts, F16 and F32 weights,
// long prompts' attention without AVX-512) at a third of the speed. It picks its kernels once, as
// it is loaded, and reads OPENBLAS_CORETYPE then. kvr_blas_core_for says which core type to name:
// for OpenBLAS's core name core ("Prescott") on a CPU with AVX-512 (F, BW, DQ, VL) or AVX2 + FMA,
// "SkylakeX" or "Haswell" when core runs kernels without AVX2, else NULL. kvr_blas_reexec is for
// programs, first thing in main: where that gives a type and OPENBLAS_CORETYPE is not set, it sets
// it and executes the program again with argv (Linux; pid, descriptors and arguments kept); it
// returns only when nothing is to be done or the exec failed (then the slow kernels run).
const char * kvr_blas_core_for(const char * core, bool avx512, bool avx2_fma);
void         kvr_blas_reexec(char ** argv);

// The registry: every backend kvr knows, whether this build has it or not, "cpu" first. A tool
// lists these in its help and its errors; kvr_backend_new looks names up here.
struct kvr_backend_info {
    const char * name;   // what kvr_backend_new, the tools' --backend and test-ops -b take
    const char * about;  // one line for a help text
    const char * needs;  // what a build must have for it ("CUDA"); NULL: every build has it
    const char * build;  // how to make such a build ("make KVR_CUDA=1"); NULL with needs
    // the constructor (p is never NULL here); NULL: this build does not have the backend
    struct kvr_backend * (*make)(const struct kvr_backend_params * p);
};
int                             kvr_backend_count(void);
const struct kvr_backend_info * kvr_backend_registered(int i);          // 0 <= i < kvr_backend_count()
const struct kvr_backend_info * kvr_backend_find(const char * name);    // NULL: not registered
// The registered names joined by sep ("cpu|cuda") into buf (cap bytes, always terminated when
// cap > 0); returns buf.
char *                          kvr_backend_names(char * buf, size_t cap, const char * sep);

// A backend by name (NULL: "cpu"), from the registry. A name not registered, or registered but
// not in this build ("cuda" without make KVR_CUDA=1), is an error naming it and the choices or
// the build that has it. p may be NULL (defaults). NULL + kvr_last_error() on failure.
struct kvr_backend * kvr_backend_new(const char * name, const struct kvr_backend_params * p);
// The CPU backend with n_threads and every other option at its default (kvr_backend_new("cpu",
// &params) for the others).
struct kvr_backend * kvr_backend_cpu_new(int n_threads); // n_threads <= 0: all cores
#ifdef KVR_CUDA
struct kvr_backend * kvr_backend_cuda_new(const struct kvr_backend_params * p); // kvr-cuda.cu
// The CUDA backend's compute stream (a cudaStream_t), NULL for another backend: a transport that
// moves device memory itself (NCCL) orders its transfers against it.
void *               kvr_backend_cuda_stream(struct kvr_backend * be);
#endif
void                 kvr_backend_free(struct kvr_backend * be);
const char *         kvr_backend_name(struct kvr_backend * be);
bool                 kvr_backend_supports_op(struct kvr_backend * be, const struct kvr_tensor * op);
// Run a placed graph: the comm protocol of point 4 around the backend's graph_compute.
int                  kvr_backend_graph_compute(struct kvr_backend * be, struct kvr_graph * g);
int                  kvr_backend_synchronize(struct kvr_backend * be);
// What a backend's graph_compute calls for each communication node, in order (point 4).
int                  kvr_backend_comm_node(struct kvr_backend * be, struct kvr_tensor * node);
void                 kvr_backend_set_comm(struct kvr_backend * be, struct kvr_comm * comm);
// What a backend's graph_compute asks before each node: true means stop there and return
// KVR_ERR_INTERRUPTED (kvr_last_error() is set by then). Cheap: one load when nothing is pending.
bool                 kvr_backend_interrupted(struct kvr_backend * be);

// Memory. Buffers are freed by kvr_buffer_free (before their backend).
struct kvr_buffer *  kvr_backend_alloc_buffer(struct kvr_backend * be, size_t size);   // NULL + error
// size bytes of host memory that outlive the buffer, placed in be's memory (CPU: zero-copy)
struct kvr_buffer *  kvr_backend_buffer_from_host(struct kvr_backend * be, const void * host, size_t size);
void                 kvr_buffer_free(struct kvr_buffer * buf);
void                 kvr_buffer_clear(struct kvr_buffer * buf, uint8_t value);
// Place t (not a view, no data yet) at byte offs of buf.
void                 kvr_buffer_place(struct kvr_buffer * buf, struct kvr_tensor * t, size_t offs);
// Copy n bytes at byte off of t's data from / to host memory, through t's backend (host tensors:
// memcpy). The way inputs go in and outputs come out.
void                 kvr_backend_tensor_set(struct kvr_tensor * t, const void * src, size_t off, size_t n);
void                 kvr_backend_tensor_get(const struct kvr_tensor * t, void * dst, size_t off, size_t n);

// Optional entries (point 6); no-ops, or nothing reported, where a backend has none.
void                 kvr_backend_set_threads(struct kvr_backend * be, int n_threads);
// With trace on, every graph records one span per layer and one per communication node.
void                 kvr_backend_set_trace(struct kvr_backend * be, bool on);
// The spans recorded so far (a pointer and a count; *n = 0 without trace); cleared by reset.
const struct kvr_span * kvr_backend_spans(struct kvr_backend * be, int * n, bool reset);
// The counters since the last reset; false (and *out zeroed) if the backend keeps none.
bool                 kvr_backend_counters(struct kvr_backend * be, struct kvr_counters * out, bool reset);

// Run one graph of host tensors on the CPU with n_threads (memory and compute): handy for tests.
int kvr_graph_compute_cpu(struct kvr_graph * g, int n_threads);

//
// 8. GGUF
//

enum kvr_gguf_type {
    KVR_GGUF_UINT8   = 0,
    KVR_GGUF_INT8    = 1,
    KVR_GGUF_UINT16  = 2,
    KVR_GGUF_INT16   = 3,
    KVR_GGUF_UINT32  = 4,
    KVR_GGUF_INT32   = 5,
    KVR_GGUF_FLOAT32 = 6,
    KVR_GGUF_BOOL    = 7,
    KVR_GGUF_STRING  = 8,
    KVR_GGUF_ARRAY   = 9,
    KVR_GGUF_UINT64  = 10,
    KVR_GGUF_INT64   = 11,
    KVR_GGUF_FLOAT64 = 12,
    KVR_GGUF_TYPE_COUNT,
};

struct kvr_gguf_str {
    uint64_t     len;
    const char * s;        // points into the mapping: NOT zero-terminated
};

struct kvr_gguf_kv {
    struct kvr_gguf_str key;
    enum kvr_gguf_type  type;
    enum kvr_gguf_type  arr_type; // for arrays
    uint64_t            n;        // array length (1 for scalars)
    const void *        data;     // scalars and arrays of numbers: the raw little-endian values
    struct kvr_gguf_str * strs;   // strings and arrays of strings
};

struct kvr_gguf_tensor {
    char          name[KVR_MAX_NAME];
    int           n_dims;
    int64_t       ne[KVR_MAX_DIMS];
    enum kvr_type type;
    uint64_t      offset;      // relative to the start of the data section
    size_t        size;        // bytes
    const void *  data;        // inside the mapping
};

struct kvr_gguf {
    uint32_t                 version;
    uint64_t                 n_kv;
    uint64_t                 n_tensors;
    struct kvr_gguf_kv     * kv;
    struct kvr_gguf_tensor * tensors;
    size_t                   alignment;
    size_t                   data_offset; // start of the tensor data section in the file
    const uint8_t          * base;        // the mapping (or buffer)
    size_t                   size;
    bool                     mapped;
};

// Open and validate a GGUF file (mmap). NULL on error, with a message naming the field and offset.
struct kvr_gguf * kvr_gguf_open(const char * path);
// The same over a caller-owned buffer (fuzzing, tests); the buffer must outlive the result.
struct kvr_gguf * kvr_gguf_open_mem(const void * buf, size_t size);
void              kvr_gguf_close(struct kvr_gguf * g);

int64_t                        kvr_gguf_find_key(const struct kvr_gguf * g, const char * key); // -1 if absent
const struct kvr_gguf_kv     * kvr_gguf_get_kv(const struct kvr_gguf * g, const char * key);   // NULL if absent
const struct kvr_gguf_tensor * kvr_gguf_get_tensor(const struct kvr_gguf * g, const char * name);
// Typed getters: return KVR_OK, or an error naming the key if it is missing or of another type.
// Integer getters accept any integer type whose value fits.
int kvr_gguf_get_u32 (const struct kvr_gguf * g, const char * key, uint32_t * out);
int kvr_gguf_get_f32 (const struct kvr_gguf * g, const char * key, float * out);
int kvr_gguf_get_bool(const struct kvr_gguf * g, const char * key, bool * out);
// A string copied into out (zero-terminated, truncated to cap-1).
int kvr_gguf_get_str (const struct kvr_gguf * g, const char * key, char * out, size_t cap);
const char * kvr_gguf_type_name(enum kvr_gguf_type t);

// A writer, used by kvr-gen and the tests. Tensor data is written in the order added.
struct kvr_gguf_writer;
struct kvr_gguf_writer * kvr_gguf_writer_new(void);
void kvr_gguf_writer_free(struct kvr_gguf_writer * w);
void kvr_gguf_set_u32 (struct kvr_gguf_writer * w, const char * key, uint32_t v);
void kvr_gguf_set_i32 (struct kvr_gguf_writer * w, const char * key, int32_t v);
void kvr_gguf_set_f32 (struct kvr_gguf_writer * w, const char * key, float v);
void kvr_gguf_set_bool(struct kvr_gguf_writer * w, const char * key, bool v);
void kvr_gguf_set_str (struct kvr_gguf_writer * w, const char * key, const char * v);
// Arrays: of numbers (raw little-endian values of elem_type) and of strings.
void kvr_gguf_set_arr (struct kvr_gguf_writer * w, const char * key, enum kvr_gguf_type elem_type, const void * data, uint64_t n);
void kvr_gguf_set_arr_str(struct kvr_gguf_writer * w, const char * key, const char * const * strs, const uint64_t * lens, uint64_t n);
// Copy every metadata entry of src whose key starts with prefix (e.g. "tokenizer.").
void kvr_gguf_copy_kv(struct kvr_gguf_writer * w, const struct kvr_gguf * src, const char * prefix);
// data must stay valid until kvr_gguf_writer_save; size must equal the type's row size times rows.
// data NULL reserves the bytes (they read as zeros) for the caller to write in place after saving.
void kvr_gguf_add_tensor(struct kvr_gguf_writer * w, const char * name, enum kvr_type type, int n_dims,
                         const int64_t * ne, const void * data);
int  kvr_gguf_writer_save(struct kvr_gguf_writer * w, const char * path);
// The same bytes into a file being written (kvr_file_create), left open: the caller may write the
// reserved tensors in place through kvr_file_stream, then commits it (or aborts it on an error).
int  kvr_gguf_writer_write(struct kvr_gguf_writer * w, struct kvr_file * kf);

//
// 9. vocab
//

enum kvr_vocab_kind {
    KVR_VOCAB_NONE = 0,
    KVR_VOCAB_SPM  = 1,  // tokenizer.ggml.model = "llama"
    KVR_VOCAB_BPE  = 2,  // tokenizer.ggml.model = "gpt2"
    KVR_VOCAB_KIND_COUNT,
};

enum kvr_token_attr {      // tokenizer.ggml.token_type values
    KVR_TOKEN_NORMAL       = 1,
    KVR_TOKEN_UNKNOWN      = 2,
    KVR_TOKEN_CONTROL      = 3,
    KVR_TOKEN_USER_DEFINED = 4,
    KVR_TOKEN_UNUSED       = 5,
    KVR_TOKEN_BYTE         = 6,
};

struct kvr_vocab;

// Load the tokenizer from a GGUF (a model or a vocab-only file). NULL on error.
struct kvr_vocab * kvr_vocab_load(const struct kvr_gguf * g);
void               kvr_vocab_free(struct kvr_vocab * v);
int                kvr_vocab_n_tokens(const struct kvr_vocab * v);
enum kvr_vocab_kind kvr_vocab_kind(const struct kvr_vocab * v);
int32_t            kvr_vocab_bos(const struct kvr_vocab * v);   // -1 if none
int32_t            kvr_vocab_eos(const struct kvr_vocab * v);
bool               kvr_vocab_add_bos(const struct kvr_vocab * v); // the model's metadata says so
bool               kvr_vocab_is_eog(const struct kvr_vocab * v, int32_t id); // end of generation

// Tokenize text. add_bos: prepend BOS; parse_special: text like "<s>" becomes the control token.
// Returns the number of tokens; if it exceeds n_max, nothing past n_max is written and the
// return is the count needed. Negative on error.
int kvr_tokenize(const struct kvr_vocab * v, const char * text, int32_t * out, int n_max,
                 bool add_bos, bool parse_special);
// kvr_tokenize where control tokens are recognised in part of the text only: "<|im_end|>" is the
// control token where its bytes are all marked in markup[0, strlen(text)), and plain text where any
// is not (user-defined tokens are split out everywhere, as with parse_special off). A chat's
// rendering with the markup kvr_chat_apply_markup gives: the template's markers are special, what
// the messages say is text.
int kvr_tokenize_markup(const struct kvr_vocab * v, const char * text, const bool * markup, int32_t * out,
                        int n_max, bool add_bos);
// The text of one token as it appears in output (byte tokens become their byte, "▁" a space).
// Writes at most cap bytes (no terminator); returns the length, or -needed if cap is too small.
int kvr_token_to_piece(const struct kvr_vocab * v, int32_t id, char * buf, int cap, bool special);
// The escapes llama.cpp's tools turn into characters in a prompt given on the command line, in
// place: \n \r \t \' \" \\ and \xHH (two hex digits); any other backslash stays as it is.
// Returns the length of the result, which is more than its strlen where a \x00 made a NUL byte.
size_t kvr_unescape(char * s);
// The token that ends a turn in a chat (<|im_end|>, <|eot_id|>, <end_of_turn>, ...), -1 if none.
int32_t      kvr_vocab_eot(const struct kvr_vocab * v);
// The file's chat template (tokenizer.chat_template, Jinja text), or NULL when it has none.
const char * kvr_vocab_chat_template(const struct kvr_vocab * v);

//
// Chat templates. kvr runs no Jinja: like llama.cpp's built-in table, it recognises the common
// families of template text by substrings only they contain and renders a conversation by each
// family's rules (llama.cpp's, so both render the same prompt). Families and their names:
//
//   chatml             <|im_start|>role\n...<|im_end|>\n: Qwen 2/2.5/3, SmolLM2, Yi, many more
//   llama3, llama4     <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
//   llama2, llama2-sys, llama2-sys-bos, llama2-sys-strip, mistral-v1, mistral-v3,
//   mistral-v3-tekken, mistral-v7, mistral-v7-tekken    the [INST] ... [/INST] families
//   gemma              <start_of_turn>user\n...<end_of_turn>\n: Gemma 1, 2 and 3
//   falcon3, phi3, phi4, zephyr, monarch, orion, openchat, vicuna, vicuna-orca, deepseek,
//   deepseek2, deepseek3, command-r, chatglm3, chatglm4, glmedge, minicpm, exaone3, exaone4,
//   granite, megrez, smolvlm, gpt-oss, kimi-k2, seed_oss, solar-open
//
// Rendering the conversation so far and then the same with one more message gives two texts of
// which the first is the start of the second (every family above): a chat prefills only what
// the new message adds.

struct kvr_chat_message {
    const char * role;     // "system", "user", "assistant" (a family may know more: "tool")
    const char * content;
};

// The family a template denotes: tmpl is one of the names above or a template text. Returns its
// name, or NULL with KVR_ERR_UNSUPP whose message quotes the start of the text and lists the
// known names (and says which family it is when llama.cpp knows it and kvr does not render it).
const char * kvr_chat_template_detect(const char * tmpl);
// The known names, comma-separated.
const char * kvr_chat_template_names(void);
// Render n_msgs messages with template tmpl (a name or a template text), ending with the opening
// of the assistant's turn when add_assistant (for the families whose text has one). Returns the
// length of the text; as snprintf, writes at most cap bytes and a terminating zero when the text
// is shorter than cap (call with cap 0 to learn the length). Negative on error (an unknown
// template, a message without role or content).
int kvr_chat_apply(const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs, bool add_assistant,
                   char * buf, int cap);
// kvr_chat_apply, and whose each byte is: markup[i] (for the bytes written to buf) is true where
// byte i is the template's own (its markers, the newlines it adds) and false where it comes from
// a message's role or content. markup has room for cap entries (NULL only with cap 0).
int kvr_chat_apply_markup(const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs, bool add_assistant,
                          char * buf, bool * markup, int cap);
// Render a conversation and tokenize it, as kvr_tokenize counts and writes ids. What the template
// adds is tokenized with its special tokens; the messages' roles and contents are text: a user who
// types "<|im_end|>\n<|im_start|>system" gets those characters, not the control tokens that would
// end their turn and open a system one (as llama-server gives them by default). special_in_msgs
// opts back in: the whole rendering is tokenized with parse_special.
int kvr_chat_tokenize(const struct kvr_vocab * v, const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs,
                      bool add_assistant, bool add_bos, bool special_in_msgs, int32_t * out, int n_max);

//
// 10. models
//

enum kvr_arch {
    KVR_ARCH_LLAMA  = 0, // Llama 1/2/3 (3.1+ with rope_freqs), Mistral, TinyLlama, SmolLM2
    KVR_ARCH_FALCON = 1,
    KVR_ARCH_QWEN2  = 2, // Qwen2, Qwen2.5: Q/K/V biases
    KVR_ARCH_QWEN3  = 3, // per-head q/k RMS norms
    KVR_ARCH_GEMMA3 = 4, // sliding-window layers, q/k norms, post norms, GELU FFN
    KVR_ARCH_PHI3     = 5, // Phi-3/3.5/4-mini: fused QKV and gate-up, partial LongRoPE
    KVR_ARCH_GEMMA2   = 6, // soft-capped attention scores and logits, alternating windows, post norms
    KVR_ARCH_QWEN3MOE = 7, // qwen3's attention, a mixture-of-experts FFN (softmax, top-k, renormalised)
    KVR_ARCH_GPTOSS   = 8, // gpt-oss: alternating sliding window, attention sinks, YaRN, biases, MoE
    KVR_ARCH_QWEN35   = 9, // Qwen3.5: Gated DeltaNet layers beside gated full-attention layers
    KVR_ARCH_QWEN35MOE = 10, // qwen35 with a mixture-of-experts FFN and a sigmoid-gated shared expert
    KVR_ARCH_COUNT,
};

struct kvr_hparams {
    enum kvr_arch arch;
    char     arch_name[32];
    uint32_t n_vocab;
    uint32_t n_ctx_train;
    uint32_t n_embd;
    uint32_t n_layer;
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t n_ff;
    uint32_t head_dim;      // n_embd / n_head unless the file says otherwise (attention.key_length)
    uint32_t n_rot;         // dims rotated by RoPE
    float    rope_freq_base;
    float    rope_freq_scale;
    enum kvr_rope_mode rope_mode;
    float    norm_eps;      // rms norm or layer norm epsilon
    uint32_t n_swa;         // the sliding window of the local layers (0: none); see kvr_layer.window
    float    rope_attn_factor; // RoPE's cosines and sines times this (rope.scaling.attn_factor; 1: none)
    uint32_t rope_n_ctx_orig;  // rope.scaling.original_context_length (n_ctx_train when absent): a
                               //   context past it takes Phi-3's rope_factors_long (kvr_build.n_ctx)
    float    rope_ext_factor;  // YaRN's (rope.scaling.type yarn; kvr_rope_yarn): 0 without it
    float    attn_softcap;     // attention scores soft-capped at this (gemma2; 0: not)
    float    final_softcap;    // logits soft-capped at this (gemma2; 0: not)
    // mixture of experts (0 experts: a dense FFN)
    uint32_t n_expert;      // expert_count
    uint32_t n_expert_used; // expert_used_count: experts per token
    uint32_t n_ff_exp;      // expert_feed_forward_length: one expert's FFN width
    uint32_t n_ff_shexp;    // expert_shared_feed_forward_length: the shared expert's width (0: none)
    // Gated DeltaNet layers (qwen35; all 0 in a model without them). Which layers they are:
    // kvr_layer_recurrent. Such a layer keeps a state of kvr_hp_state_floats floats per sequence.
    uint32_t ssm_d_conv;    // ssm.conv_kernel
    uint32_t ssm_d_state;   // ssm.state_size: the size of a key head and of a value head
    uint32_t ssm_n_group;   // ssm.group_count: key heads
    uint32_t ssm_dt_rank;   // ssm.time_step_rank: value heads
    uint32_t n_recurrent;   // how many layers are recurrent
    uint64_t recurrent[64]; // bit il: layer il is a Gated DeltaNet layer (block_count <= 4096)
};

static inline bool kvr_layer_recurrent(const struct kvr_hparams * hp, int il) {
    return (hp->recurrent[il >> 6] >> (il & 63)) & 1;
}
// the state of one recurrent layer, in floats (0 without recurrent layers): the convolution's
// last ssm_d_conv-1 inputs of every channel, then a d x d matrix per value head
int64_t kvr_hp_state_floats(const struct kvr_hparams * hp);

// Tensor pointers only: kvr_model_to_backend copies a layer field by field as an array.
struct kvr_layer {
    struct kvr_tensor * attn_norm, * attn_norm_b;
    struct kvr_tensor * attn_norm2, * attn_norm2_b;   // falcon 40B-style second norm
    struct kvr_tensor * wq, * wk, * wv, * wqkv, * wo;
    struct kvr_tensor * bq, * bk, * bv, * bqkv, * bo;
    struct kvr_tensor * ffn_norm, * ffn_norm_b;
    struct kvr_tensor * ffn_gate, * ffn_up, * ffn_down;
    struct kvr_tensor * ffn_up_b, * ffn_down_b;
    struct kvr_tensor * attn_q_norm, * attn_k_norm;     // per-head RMS norms of Q and K (qwen3, gemma3)
    struct kvr_tensor * attn_post_norm, * ffn_post_norm; // norms of each branch's output (gemma3)
    struct kvr_tensor * attn_sinks;                     // per-head sink logits [n_head] (gpt-oss)
    // mixture of experts: the router [n_embd -> n_expert] and the experts' matrices [in, out, n_expert]
    struct kvr_tensor * ffn_gate_inp, * ffn_gate_inp_b;
    struct kvr_tensor * ffn_gate_exps, * ffn_up_exps, * ffn_down_exps;
    struct kvr_tensor * ffn_gate_exps_b, * ffn_up_exps_b, * ffn_down_exps_b; // [out, n_expert] (gpt-oss)
    // a shared expert every token takes (qwen35moe): its gated FFN, scaled per token by
    // sigmoid(ffn_gate_inp_shexp . x), a vector [n_embd]
    struct kvr_tensor * ffn_gate_inp_shexp, * ffn_gate_shexp, * ffn_up_shexp, * ffn_down_shexp;
    // Gated DeltaNet (qwen35): wqkv is the mixed q|k|v projection, ssm_gate the output gate z
    struct kvr_tensor * ssm_gate, * ssm_conv1d, * ssm_dt_b, * ssm_a, * ssm_beta, * ssm_alpha, * ssm_norm, * ssm_out;
    // what differs between layers of one model (gemma3: local and global layers)
    uint32_t window;        // sliding-window attention: the last `window` positions (0: all)
    float    rope_base, rope_scale;
};

struct kvr_model {
    struct kvr_hparams   hp;
    struct kvr_gguf    * gguf;
    struct kvr_vocab   * vocab;
    struct kvr_context * ctx;        // weight tensor structs
    struct kvr_buffer  * weights;    // where they live: a host buffer (read from the file, or the
                                     //   file mapping) for a loaded model, a backend's buffer for
                                     //   kvr_model_to_backend's
    size_t               weights_read; // bytes of the memory the weights were read into (0: mapped)
    const struct kvr_model * parent; // kvr_model_to_backend: the model whose file and vocab these are
    uint64_t             fp_hash[2];   // the fingerprint's weights and tokenizer hashes, made on first use
    bool                 fp_done;      //   (kvr_model_weights_hash, under a lock; a copy asks its parent)
    bool                 tiles;        // its 2D Q4_0/Q4_1/Q8_0 weights in tiles (KVR_FLAG_TILED): made
                                       //   at load, or the parent's shared by a CPU copy
    size_t             * tiled;        // the data offsets of the weights in tiles (the loaded model's)
    int                  n_tiled;
    struct kvr_tensor  * tok_embd;
    struct kvr_tensor  * output_norm, * output_norm_b;
    struct kvr_tensor  * output;     // tok_embd when the file ties them
    struct kvr_tensor  * rope_freqs; // Llama 3.1+: per-pair RoPE frequency divisors [n_rot/2], or NULL
    struct kvr_tensor  * rope_short, * rope_long; // Phi-3's LongRoPE divisors [n_rot/2] for a context up
                                     //   to hp.rope_n_ctx_orig and past it, or NULL
    struct kvr_layer   * layers;
    char                 path[4096];   // as given to kvr_model_load (PATH_MAX on Linux)
};

struct kvr_model_params {
    bool vocab_only;      // load the tokenizer alone (vocab-only GGUF files)
    bool mmap;            // leave the weights where the file is mapped: no copy, pages shared with other
                          //   processes of the file. Default: read into memory of 2 MiB pages (transparent
                          //   huge pages, where the kernel has them), which decode reads faster
    bool no_tiles;        // keep every weight's rows as the file has them. Default, for weights read into
                          //   memory on a CPU with AVX-512 VNNI: the 2D Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrices of a
                          //   multiple of 16 rows rearranged in place into tiles of 16 rows (KVR_FLAG_TILED),
                          //   which the 8-bit-activation kernels read for decode, batches and prompts
                          //   alike: no per-matmul interleave, and a token gets the same bits alone or
                          //   with others. Same memory; the exact paths convert rows from the tiles
};

struct kvr_model * kvr_model_load(const char * path, const struct kvr_model_params * params);
void               kvr_model_free(struct kvr_model * m);
const struct kvr_vocab * kvr_model_vocab(const struct kvr_model * m);
// One line of the model's shape for logs: arch, layers, width, heads, types, size.
void               kvr_model_describe(const struct kvr_model * m, char * buf, size_t cap);
// The model's weights on a backend: a model that shares m's file, vocabulary and shape, whose
// weight tensors live in one buffer of be made from the file's data section (the CPU wraps the
// mapping, zero-copy; a device uploads it once). Sessions and ranks build their graphs over it.
// Free it with kvr_model_free, before m and be. NULL + kvr_last_error() on failure.
struct kvr_model * kvr_model_to_backend(const struct kvr_model * m, struct kvr_backend * be);
// A host weight rearranged into tiles of 16 rows in place and flagged KVR_FLAG_TILED, as
// kvr_model_load does (kvr_model_params.no_tiles): a 2D Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 matrix of a multiple of
// 16 rows, on a build whose CPU kernels read tiles (AVX-512 VNNI); false, untouched, otherwise.
// kvr_weight_untile puts the file's rows back and clears the flag.
bool kvr_weight_tile(struct kvr_tensor * w);
void kvr_weight_untile(struct kvr_tensor * w);

// What an architecture's builder is given: the tokens of this batch and where their positions are.
struct kvr_build {
    struct kvr_context * ctx;
    struct kvr_tensor  * tokens;   // [T] i32 input
    struct kvr_tensor  * pos;      // [T] i32 input: absolute positions
    int                  n_tokens;
    int                  n_outputs; // logits for the last n_outputs tokens only (0: none)
    int                  n_ctx;     // the sequence's context (the session's): Phi-3's LongRoPE picks its
                                    //   factors by it, as llama.cpp does by its n_ctx
};
// Build the forward graph up to the logits [n_vocab, n_outputs] (or the final hidden state when
// n_outputs is 0). Attention is left as ATTN_BLOCK nodes for a strategy pass to rewrite.
struct kvr_tensor * kvr_model_build(const struct kvr_model * m, const struct kvr_build * b);
// Whether keys rotated in a context of n_ctx tokens take Phi-3's long LongRoPE factors: a model
// with them, n_ctx rounded up to a multiple of 256 past hp.rope_n_ctx_orig (llama.cpp's rule). A
// cache made with one set of factors is not the cache of a context that takes the other.
bool kvr_model_rope_long(const struct kvr_model * m, int n_ctx);

//
// KV cache: contiguous per-layer K and V, [head_dim*n_head_kv, n_ctx] each (attention layers only:
// a hybrid model's recurrent layers keep a state instead), in their types (f32,
// f16, bf16 or q8_0: kvr_cache_type; K and V may differ), in one buffer of a backend. Read rows with
// kvr_backend_tensor_get (the data may be device memory).
//

struct kvr_kv_cache {
    uint64_t             serial;     // no other cache of this process had it (what kept graphs know it by)
    int                  n_layer;
    int                  n_ctx;
    int                  kv_dim;
    enum kvr_type        type_k, type_v;
    size_t               row_k, row_v;  // bytes of one row (kv_dim values) of K and of V
    struct kvr_context * ctx;        // the tensor structs
    struct kvr_buffer  * buf;        // every attention layer's K and V, cleared to zero when made
    struct kvr_tensor ** k;          // per layer (NULL for a recurrent one)
    struct kvr_tensor ** v;
    // recurrent layers (kvr_layer_recurrent): each its state [n_state] f32 in buf (NULL for the
    // others), the state after the last cached token; they have no K and V (k[il], v[il] NULL)
    int64_t              n_state;    // kvr_hp_state_floats (0: no recurrent layer)
    struct kvr_tensor ** state;
};

// type_k, type_v: f32, f16, bf16 or q8_0 (q8_0: kv_dim and the head size multiples of 32; asserted).
struct kvr_kv_cache * kvr_kv_cache_new(const struct kvr_hparams * hp, int n_ctx, enum kvr_type type_k,
                                       enum kvr_type type_v, struct kvr_backend * be);
void                  kvr_kv_cache_free(struct kvr_kv_cache * c);
// Rows [row0, row0 + n) of layer il's K and V (either may be NULL) as stored, in the cache's types
// (n * row_k and n * row_v bytes), through the backend that owns the cache: one contiguous transfer
// for K and one for V. kvr_kv_rows_to_float turns such rows into f32.
struct kvr_backend;
void kvr_kv_cache_get_rows(struct kvr_backend * be, const struct kvr_kv_cache * c, int il, int row0, int n,
                           void * k, void * v);
void kvr_kv_cache_set_rows(struct kvr_backend * be, struct kvr_kv_cache * c, int il, int row0, int n,
                           const void * k, const void * v);
void kvr_kv_rows_to_float(enum kvr_type type, const void * rows, float * out, int n_rows, int kv_dim);
// f32 rows into a cache type, as a cache store does (Q8_0: kvr_kv_quant_q8_0, ggml's rule).
void kvr_kv_rows_from_float(enum kvr_type type, const float * x, void * rows, int n_rows, int kv_dim);
// A recurrent layer's state (n_state floats) out of and into the cache, through its backend.
void kvr_kv_cache_get_state(struct kvr_backend * be, const struct kvr_kv_cache * c, int il, float * out);
void kvr_kv_cache_set_state(struct kvr_backend * be, struct kvr_kv_cache * c, int il, const float * in);

//
// KV cache files: a cache (or the shards of a sharded one) and its tokens, on disk.
//
// What kvr_session_kv_save, kvr_session_kv_save and the streaming sinks write. Little-endian; a file
// is refused whole (nothing is loaded) when anything in it does not match: the message names the
// field, what was found, what was expected, and the offset.
//
//   offset  bytes  field
//        0      8  magic "KVRCACHE"
//        8      4  version (KVR_KV_FILE_VERSION)
//       12      4  flags (enum kvr_kv_file_flag; unknown bits are refused)
//       16     40  the model's fingerprint: architecture, layers, KV heads, head size, then (at 32)
//                  the rows' types (K's type id in the low 16 bits, V's in the high 16: f32, f16,
//                  bf16 or q8_0, the cache's), RoPE dims, RoPE mode, RoPE base (f32), RoPE scale
//                  (f32), vocabulary size, each u32; then (at 56) u64 the weights hash
//                  (kvr_model_weights_hash: every tensor's name, type, shape and offset, and every
//                  byte of the GGUF data section)
//       64     20  tokens, ranks, shards, rows per chunk, the ring's next decode shard (u32 each)
//       84      8  the tokenizer hash (u64, kvr_model_vocab_hash), the fingerprint's last field
//       92      4  CRC32C of bytes [0, 92) (u32)
//       96         tokens: n_tokens i32, then their CRC32C
//                  shards: (rank, rows) u32 pairs, then each shard's row positions (i32), then
//                  one CRC32C over both
//                  layers: layer by layer (the attention layers alone with flag ATTN_ONLY: a recurrent
//                  layer has no K and V), shard by shard, K rows then V rows in chunks of at most
//                  "rows per chunk" rows: (layer, shard, 0 = K | 1 = V, first row, rows) u32,
//                  rows of kv_dim values in K's or V's type, then a CRC32C over the chunk's header
//                  and data
//                  flag STATE: each recurrent layer's state, in layer order: (layer, floats) u32,
//                  the state f32 (kvr_kv_cache.state: the state after the last token), then a
//                  CRC32C over the header and the data; the file of a model with recurrent layers
//                  always has it (one state: every shard's rank holds the same)
//                  flag LOGITS: the last token's logits, n_vocab f32, then their CRC32C
//
// A whole cache has 1 rank and 1 shard whose positions are 0..n_tokens-1. A sharded one (the
// ring strategies) has n ranks and either every shard (gathered to one file; the positions of
// all shards together are 0..n_tokens-1, each once) or one rank's shard (each rank its file).

#define KVR_KV_FILE_VERSION 3 // 2: f32 rows, no cache type; 1: the weights hash covered the tensors' metadata
                              //   only, no tokenizer hash (both refused, saying so)
#define KVR_KV_FILE_HEADER  96

enum kvr_kv_file_flag {
    KVR_KV_FILE_LOGITS = 1, // the logits of the last token follow the layers
    KVR_KV_FILE_STATE  = 2, // the recurrent layers' states follow the layers (an older kvr refuses the bit)
    KVR_KV_FILE_ROPE_LONG = 4, // the keys were rotated with Phi-3's long LongRoPE factors (kvr_model_rope_long
                               //   of the saving session's context): a session whose context takes the
                               //   other set refuses the file, naming both; a model without them refuses the bit
    KVR_KV_FILE_ATTN_ONLY = 8, // the layers section holds the attention layers alone: a hybrid model's
                               //   recurrent layers have no K and V (kvr writes it for every hybrid model;
                               //   a hybrid file without it, with rows of every layer, loads, those skipped)
};

// CRC32C (Castagnoli), the checksum of the file's sections: crc = kvr_crc32c(0, data, n), or
// continued over more data by passing the previous value.
uint32_t kvr_crc32c(uint32_t crc, const void * data, size_t n);
// The hashes in a file's fingerprint. Weights: every tensor's name, type, shape and offset, then
// the data section's bytes (kvr_hash64); tokenizer: tokenizer.ggml.model, pre, tokens, scores,
// token_type and merges, the keys that decide the ids. Both are made once, on a model's first save,
// load or log, and kept: they read every weight byte once, at about the speed of a copy (measured on
// a busy 2-core machine, 2-3.8 GB/s: 27-45 ms for SmolLM2's 92 MiB, 1.0-1.9 s for a 3.7 GiB F32 data
// section; 13-120% of a load's time there), too much to add to every load.
uint64_t kvr_model_weights_hash(const struct kvr_model * m);
uint64_t kvr_model_vocab_hash  (const struct kvr_model * m);
// A 64-bit hash of n bytes, seeded (not a cryptographic one: it tells models apart, it does not
// stand up to someone who writes a cache file to match another model's).
uint64_t kvr_hash64(uint64_t seed, const void * data, size_t n);

// One shard of a cache: its rank and the absolute position of each of its rows.
struct kvr_kv_shard {
    int             rank;
    int             n_rows;
    const int32_t * pos;
};

// What a file will hold, given before its layers are written.
struct kvr_kv_layout {
    int                         n_tokens;   // the sequence the cache is of
    const int32_t             * tokens;
    int                         n_ranks;    // 1: a whole cache; n: shards of a cache over n ranks
    int                         n_shards;   // n_ranks (gathered) or 1 (one rank's shard)
    const struct kvr_kv_shard * shards;
    int                         ring_next;  // the shard that stores the next decoded token (ring decode; 0 else)
    bool                        logits;     // a logits section follows the layers
    int                         chunk_rows; // rows per chunk (0: about 1 MiB of a layer's K or V)
    enum kvr_type               type_k;     // the rows' types in the file (f32, f16, bf16, q8_0: the
    enum kvr_type               type_v;     //   cache's, so its bytes are the cache's own)
    bool                        rope_long;  // the keys took Phi-3's long LongRoPE factors (flag ROPE_LONG)
};

// A file written layer by layer (what streaming during a prefill needs): open writes the header,
// the tokens and the shard table; then kvr_kv_writer_layer for every attention layer (every layer
// but a hybrid model's recurrent ones) in order and within a
// layer every shard in order (k and v: that shard's rows, [kv_dim x n_rows] f32 contiguous, stored in
// the layout's types: a cache's rows read as f32 go back to the same bytes); then
// close writes the logits (when the layout has them) and renames the file into place. Until then
// the file is a temporary beside PATH (kvr_file_create), so a reader never sees half a file under
// PATH; abort removes it.
struct kvr_kv_writer;
int  kvr_kv_writer_open (struct kvr_kv_writer ** out, const char * path, const struct kvr_model * m,
                         const struct kvr_kv_layout * lay);
int  kvr_kv_writer_layer(struct kvr_kv_writer * w, int il, int shard, const float * k, const float * v);
// after the layers, a model with recurrent layers: each one's state (n_state floats), in layer order
int  kvr_kv_writer_state(struct kvr_kv_writer * w, int il, const float * state);
int  kvr_kv_writer_close(struct kvr_kv_writer * w, const float * logits); // frees w
void kvr_kv_writer_abort(struct kvr_kv_writer * w);                        // frees w
// Bytes written so far (the stream's size for --stats).
int64_t kvr_kv_writer_bytes(const struct kvr_kv_writer * w);

// A file read whole and checked against a model: every field, every CRC, the positions.
struct kvr_kv_file_shard {
    int       rank;
    int       n_rows;
    int32_t * pos;
    float  ** k;        // per layer: [kv_dim x n_rows] f32 (the file's rows turned into f32); NULL
    float  ** v;        //   for a recurrent layer
};

struct kvr_kv_file {
    uint32_t                   flags;
    int                        n_tokens;
    int32_t                  * tokens;
    int                        n_ranks;
    int                        n_shards;
    int                        ring_next;
    int                        chunk_rows;
    int                        n_layer;
    int                        kv_dim;
    enum kvr_type              type_k, type_v; // the rows' types in the file
    struct kvr_kv_file_shard * shards;
    float                    * logits;  // n_vocab floats, or NULL without the LOGITS flag
    int64_t                    bytes;   // the file's size
    int64_t                    n_state; // floats of a recurrent layer's state (0: none)
    float                   ** state;   // per layer: a recurrent layer's state, NULL for the others
};

// KVR_ERR_IO (cannot open or read), KVR_ERR_FORMAT (malformed, damaged or truncated, an older
// version, a type field that names no KV cache type), KVR_ERR_UNSUPP (a newer version), KVR_ERR_ARG
// (a cache of another model); nothing is returned then. A file of another cache type than the
// session's loads converted (kvr_session_kv_load: its rows into the session's types, Q8_0 by
// kvr_kv_rows_from_float's rule), as llama.cpp cannot but kvr can: the rows are plain values.
int  kvr_kv_file_read(const char * path, const struct kvr_model * m, struct kvr_kv_file ** out);
void kvr_kv_file_free(struct kvr_kv_file * f);

//
// 11. sessions: the one front door (kvr-comm.c)
//
// A session is one conversation with a model: its KV cache, the tokens in it, the last logits.
// Every prefill and decode step, every file, swap and failover goes through it. By default it is
// one rank on the CPU (kvr_session_new(m, NULL)); the same calls run it on several ranks, threads of
// this process, MPI processes or GPUs, by the params below (n_ranks, strategy, comm, backend).
// Several conversations over one model are several sessions, each with its own cache; batching
// their decode steps into one pass over the weights (a server's continuous batching) is one call
// over several sessions, kvr_session_eval_batch, so the session stays the unit an embedder holds.
//
// A prompt is spread over the ranks; each rank builds the single-rank graph of its own tokens and
// a strategy pass rewrites its ATTN_BLOCK nodes into cache writes, transfers and ATTN nodes:
//
//   single   one rank
//   tsp      even contiguous split; ALL_GATHER of K and V every layer (every rank holds all)
//   kvr      KV-Runahead: contiguous split (even or given); rank r RECVs the cache [0, s_r) from
//            r-1, appends its rows and SENDs [0, e_r) to r+1; the last rank holds everything
//   ring-kv  2N-chunk load-balanced shards (rank i: chunks i and 2N-1-i); K/V blocks travel the
//            ring, partial attention per block, merged by log-sum-exp
//   ring-q   the same shards; queries travel, K/V stay; partial outputs return by ALL_TO_ALL
//   auto     ring-kv or ring-q by the Context Parallelism paper's Algorithm 5 (see kvr_auto_pick)
//
// After a prefill, tsp and kvr continue (decode, later turns) on the last rank, which holds the
// whole cache; ring-kv, ring-q and auto keep the cache sharded: later turns use the ring again
// and decode attends over every shard (each rank computes a partial, ALL_GATHER, merge).
// Under exact arithmetic (no q8_activations) with an F16 or BF16 cache, where one rank rounds each
// probability after normalising it over every key (kvr_attn_cpu_exact: short prompts, every decode step), the rings first find each
// query's softmax max and sum over all the blocks (ATTN_STATS) and round at that scale
// (ATTN_NORMED): ring-kv folds them over its K trip (its transfers stay the same), ring-q
// all-gathers every rank's statistics of every query, and the ring decode its shard's, one
// collective more a layer (2 floats a head a query: KVR_TAG_STATS, counted in bytes_sent).

enum kvr_strategy {
    KVR_STRATEGY_SINGLE = 0,
    KVR_STRATEGY_TSP,
    KVR_STRATEGY_KVR,
    KVR_STRATEGY_RING_KV,
    KVR_STRATEGY_RING_Q,
    KVR_STRATEGY_AUTO,
    KVR_STRATEGY_COUNT,
};

const char * kvr_strategy_name(enum kvr_strategy s);
int          kvr_strategy_parse(const char * name, enum kvr_strategy * out); // KVR_OK or KVR_ERR_ARG

// Load-balanced sharding of T new tokens after P cached ones over n ranks: 2n chunks (sizes
// differ by at most one), rank i takes chunks i and 2n-1-i. Writes rank i's absolute positions
// in order into pos (may be NULL) and returns their count.
int kvr_ring_shard(int T, int P, int n_ranks, int rank, int32_t * pos);
// Whether ring-kv's prefill of T tokens after P cached ones gathers the blocks that pass by and
// attends once over them all in position order (one rank's bits), rather than merging partials:
// a first prompt (P 0) without a sliding window, under 8-bit activations or, in the exact
// arithmetic, with an F16/BF16 V and a K other than Q8_0 past the shapes kvr_attn_cpu_exact takes
// (one rank's rounding there is of running weights, which partials cannot reproduce). On a
// backend that copies typed rows (the CPU's); the simulator (kvr-tune) follows the same rule.
bool kvr_ring_kv_gathers(enum kvr_type type_k, enum kvr_type type_v, bool q8_activations, int T, int P, int window);

// How many of n_ranks ranks a first prefill of T tokens gives work to with strategy s (its even
// split; a given partition is the caller's): the most that each get a token of the prompt. tsp,
// kvr: T; the rings: by their shards (5 tokens fill 3 ranks, not 4); single: 1. pd: n_ranks - 1
// prefill ranks and the decode rank. kvr_session_new refuses more than a context of n_ctx tokens
// could use (KVR_ERR_ARG, but single and a given partition); fewer tokens leave ranks idle.
int kvr_useful_ranks(enum kvr_strategy s, int T, int n_ranks, bool pd);

enum kvr_comm_kind {
    KVR_COMM_LOCAL = 0, // ranks are threads of this process (the default)
    KVR_COMM_MPI   = 1, // ranks are MPI processes (build with make KVR_MPI=1, run under mpirun)
    KVR_COMM_NCCL  = 2, // ranks are GPUs (make KVR_CUDA=1; the CUDA backend): one process drives
                        //   n_ranks GPUs (rank i on device i), or, started by mpirun in a build
                        //   with MPI too, one process per GPU
    KVR_COMM_KIND_COUNT,
};

// The type K and V are stored in: in every rank's cache, on every transfer between ranks, in
// replicas, replication logs, KV cache files and the P/D stream. F16 is the default (llama.cpp's):
// a zeroed kvr_session_params asks for it. Q8_0 (blocks of 32 values, 34 bytes) needs a head size
// that is a multiple of 32 (as llama.cpp, which refuses a Q8_0 cache otherwise): kvr_session_new
// refuses it with KVR_ERR_UNSUPP naming the type and the head size. Attention reads K and V in
// their type (llama.cpp's arithmetic: an F16/BF16 cache rounds the queries and the softmax
// probabilities to that type, a Q8_0 one quantizes the queries to Q8_0 and runs an online softmax
// over values dequantized to f32). K and V may differ.
enum kvr_cache_type {
    KVR_CACHE_F16 = 0,
    KVR_CACHE_F32,
    KVR_CACHE_BF16,
    KVR_CACHE_Q8_0,
    KVR_CACHE_TYPE_COUNT,
};

const char *  kvr_cache_type_name(enum kvr_cache_type t);                      // "f16", ...; "?" if unknown
int           kvr_cache_type_parse(const char * name, enum kvr_cache_type * out); // KVR_OK or KVR_ERR_ARG
enum kvr_type kvr_cache_type_elem(enum kvr_cache_type t);                      // its tensor type (F16, ...)

// The choice of auto (the CP paper's Algorithm 5, with the bytes of K/V and of Q apart): pass-KV if
// T >= N*C*NKV*e_kv/(2*NH*BW) (the K/V of a ring step cross the link within its attention) or
// T/(T+P) >= 2*NKV*e_kv/(NH*e_q) - 4*T*BW/(N*C*e_q) (the K/V exposed beyond the attention cost less
// than the queries pass-Q sends), else pass-Q. C: attention FLOP/s of one rank, BW: link bytes/s,
// e_kv: bytes per K/V element on the wire (the cache's types, K's and V's averaged: 4 f32, 2 f16
// and bf16, 34/32 q8_0), e_q: bytes per query element (4: ring-q sends f32 queries). With
// e_kv = e_q both rules are the paper's. why (may be NULL) receives the rule with the numbers.
enum kvr_strategy kvr_auto_pick(int T, int P, int n_ranks, int n_head, int n_head_kv, int head_dim,
                                enum kvr_cache_type type_k, enum kvr_cache_type type_v,
                                double flops, double bw, char * why, size_t cap);

// Reading intermediates (tools/kvr-compare): every node named "blk.<layer>.<name>" for a name in
// names is kept as an output of each eval (its memory is not reused) and handed to got() after
// the eval's graph ran, with the absolute positions of the eval's tokens (a node of fewer rows
// holds the last ones: the pruned last layer). got() reads it with kvr_backend_tensor_get; with
// local ranks it is called from their threads, several at once.
struct kvr_capture {
    const char * const * names;
    int                  n_names;
    void              (* got)(void * user, const struct kvr_tensor * t, int layer, int name,
                              const int32_t * pos, int n_pos);
    void               * user;
};

struct kvr_session_params {
    enum kvr_strategy  strategy;
    enum kvr_comm_kind comm;
    int                n_ranks;      // local, NCCL in one process: how many; MPI: from the communicator
    int                n_threads;    // per rank (0: all cores / ranks)
    int                n_ctx;        // per rank cache length (0: the model's, at most 4096)
    const int        * partition;    // kvr: tokens per rank (n_ranks entries), NULL: even
    const double     * fractions;    // kvr: or fractions of the prompt per rank (sum 1)
    enum kvr_attn_mode attn_mode;
    enum kvr_cache_type cache_type_k; // K's and V's type in the cache and on the wire (0: F16)
    enum kvr_cache_type cache_type_v;
    double             timeout_s;    // every wait (0: 60 s)
    double             link_gbps;    // local: emulated link bandwidth (0: none)
    double             link_latency_us;
    double             link_noise;   // local: each eval, one random pair of neighbouring ranks gets
                                     //   a link this many times slower (the KV-Runahead paper's
                                     //   noisy sidecar); needs link_gbps; 0: off
    uint64_t           link_seed;    //   which pairs: seeded, reproducible
    bool               trace;        // record spans for kvr_session_write_trace
    bool               node_times;   // cuda: time every node (kvr_rank_stats' matmul_ms, attn_ms: --stats);
                                     //   off, decode steps run as replayed CUDA graphs, those times 0
    bool               q8_activations; // see struct kvr_backend_params (off: exact)
    bool               vec_dot_order;  // see struct kvr_backend_params (off: llama.cpp's default build)
    bool               avx512_order;   // see struct kvr_backend_params (off: AVX2's 8 lanes)
    const char *       backend;      // every rank's: a registered name (NULL: "cpu"); a rank's GPU is
                                     //   kvr_rank_gpu of its index on its node, from device
    int                device;       // cuda: the first GPU of a node's ranks (0 by default)
    const struct kvr_capture * capture; // intermediates to hand out after each eval (NULL: none)
    bool               replicate;    // local ranks: every rank's new cache rows (each layer right after its
                                     //   store, prefill and decode) go to a replica in its ring successor's
                                     //   host memory, checked (CRC32C) and acknowledged layer by layer; a
                                     //   rank lost in an eval is then recovered from (see kvr_session_eval)
    const struct kvr_test_hooks * test; // kvr's own tests and tools: losing or stalling a rank on
                                     //   purpose (kvr.h's internal part, "test hooks"); NULL: none
    FILE *             graph_out;    // print every rank's rewritten graph of the next eval
    double             auto_flops;   // auto's C (0: 1e11)
    double             auto_bw;      // auto's BW in bytes/s (0: the link, else 1e10)
    FILE *             log;          // auto's choice and rule (NULL: quiet)
    const char *       kv_stream;    // the first prefill streams its cache to this KV cache file, layer by
                                     //   layer while it runs: each layer's rows are copied out as soon as
                                     //   they are final and a thread writes them behind the compute. The
                                     //   file is then what kvr_session_kv_save would write after the prefill
    bool               pd;           // prefill/decode disaggregation: rank decode_rank (the last one) only
    int                decode_rank;  //   decodes; the others run the first prefill with the strategy and
                                     //   stream the cache to it layer by layer while they compute (chain
                                     //   strategies from their last rank, ring ones from every shard); every
                                     //   later eval runs on the decode rank alone
    const char *       replicate_dir;// every rank of this process appends the rows it makes in each eval (each
                                     //   layer's as soon as they are final, prefill and decode) and, once the
                                     //   eval went well, the eval's tokens to its replication log
                                     //   DIR/rank-R.kvlog (kvr_session_log_path), written and synced by a thread
                                     //   behind the compute: what kvr_session_resume restarts from (NULL: none)
};

// Per-rank counters of the last eval (the papers' claims are checked against them). Pairs and
// rows are per KV head and per layer: a dot product of one query and one key of one head in one
// layer counts 1, a transfer of K and V for c tokens of one layer counts 2c rows.
struct kvr_rank_stats {
    int     rank;
    int     tokens;           // new tokens this rank computed
    int64_t attn_dot_dense;   // pairs computed (whole tiles, masked or not)
    int64_t attn_dot_causal;  // pairs causality needs
    int64_t kv_rows_sent;
    int64_t kv_rows_recv;
    int64_t bytes_sent;
    int64_t bytes_recv;
    double  wait_ms;          // blocked in transfers
    double  ttft_ms;          // this rank's eval, start to end
    double  matmul_ms;        // wall time in MUL_MAT nodes (the first thread's view, barriers included)
    int64_t expert_bytes;     // mixture-of-experts weight bytes read (struct kvr_counters' expert_bytes)
    double  attn_ms;          // in ATTN nodes, the same way
    int64_t kv_stream_bytes;  // cache bytes this rank streamed out (--kv-stream, P/D) or, the decode
                              //   rank, received
    double  compute_ms;       // in all the nodes of its graphs but the transfers' (the rest of it: norms,
                              //   RoPE, copies, ...)
    int64_t replica_bytes;    // cache bytes this rank put into its replica on its successor (--replicate)
    int64_t state_bytes_sent; // recurrent layers' states handed on (part of bytes_sent): per layer and
    int64_t state_bytes_recv; //   rank boundary a constant, whatever the prompt's length
    double  op_ms[KVR_OP_COUNT]; // wall time in the nodes of each op kind (the first thread's view, barriers
                              //   included): where compute_ms goes
    // since the session began: decode graphs built and kept ones run again (kvr_eval_reuse), the
    // single pass's and those of the batches this session led (kvr_session_eval_batch's session 0)
    int64_t graphs_built, graphs_reused;
};

struct kvr_session;

struct kvr_session * kvr_session_new(const struct kvr_model * m, const struct kvr_session_params * p); // NULL + error
void              kvr_session_free(struct kvr_session * s);
// Evaluate n new tokens (a prompt, a later turn or one decode token) after those already
// cached; returns the last token's logits in every process, or NULL with kvr_last_error().
// With replicate, a local rank lost during the eval (the test hook KVR_TEST_KILL; one rank at a
// time, while another survives) does not end it: the driver drops it, renumbers the survivors
// 0..N-2 in ring order, puts the lost rank's rows back from its replica (the ring successor takes
// its shard over; a chain's new last rank gets the whole cache from its own rows, the others'
// caches and the replicas), refuses a replica chunk whose CRC32C no longer matches, recomputes
// the tokens from the first position no copy holds (none when the replicas are whole), re-seeds
// the replicas the loss broke, and runs the eval again. Greedy output is that of a run without
// the loss; params.log says which rank was lost, what was restored and what was recomputed.
// A local rank's thread still out a timeout after it was told to stop (two timeouts after the
// first rank came back) is left running: the session is wedged, this eval and every later one
// fail (KVR_ERR_COMM), kvr_session_free frees nothing of it, and the model must stay loaded.
const float *     kvr_session_eval(struct kvr_session * s, const int32_t * tokens, int n);
// One decode token for each of n sessions of one model, in one graph: one pass over the weights
// for all of them (a server's continuous batching). Session i gets tokens[i] as
// kvr_session_eval(s[i], &tokens[i], 1) would give it (the same ids greedy; logits equal to
// rounding exact, to the last bit with q8_activations on the CPU: each token's matmuls take the
// one-token kernels' operations), its logits then in kvr_session_logits(s[i]). Every
// session must be one local rank of the single pass on a backend of session 0's kind, over the same
// model, with nothing of DejaVu (replicate, logs, streams, captures, test hooks) and its cache in;
// at most KVR_BATCH_MAX of them, each once. The batch runs on session 0's backend and threads;
// kvr_session_interrupt of any of them before, or of session 0 during it, stops it. All or nothing:
// on an error (KVR_ERR_ARG naming the session and why) no session has changed. Session 0's
// kvr_session_stats then describe the batch (tokens: n; the times those of its graph).
#define KVR_BATCH_MAX 256
int               kvr_session_eval_batch(struct kvr_session * const * s, const int32_t * tokens, int n);
// Forget every cached token (a new conversation); buffers and threads stay.
void              kvr_session_reset(struct kvr_session * s);
// on: stop the eval that is running, or else the next one, at its next node on every rank of this
// process: it returns NULL with KVR_ERR_INTERRUPTED ("interrupted") and keeps nothing of the batch
// (n_past, the tokens, the logits and the files are those of before it; rows it wrote past the
// cache's end are never read), so the session goes on with the next eval (local ranks; under MPI
// the stopped eval ends the job, as any failed one). The stopped eval takes the request; off
// withdraws one no eval took yet. Safe from a signal handler or another thread (it sets a flag).
// A model with recurrent layers cannot give the batch back once its ranks computed (their states
// move on in place): such a stopped or failed eval forgets every cached token, and its error says so.
void              kvr_session_interrupt(struct kvr_session * s, bool on);
int               kvr_session_rank(const struct kvr_session * s);    // this process's rank (local: 0)
int               kvr_session_n_ranks(const struct kvr_session * s);
int               kvr_session_n_past(const struct kvr_session * s);
enum kvr_strategy kvr_session_last_strategy(const struct kvr_session * s); // what the last eval used
// Stats of the last eval for the ranks of this process (local: all); returns how many.
int               kvr_session_stats(const struct kvr_session * s, struct kvr_rank_stats * out, int cap);
// The rows a rank of this process holds: their absolute positions and the cache. In a layer with
// a sliding window W, rows more than W-1 positions before the rank's last row may be stale: no query
// of that rank sees them, so KV-Runahead hands down only the last W-1 rows of such a layer.
int               kvr_session_cache(const struct kvr_session * s, int rank, const int32_t ** pos,
                                 const struct kvr_kv_cache ** cache);
// Chrome trace JSON of every eval since the start (one track per rank of this process).
int               kvr_session_write_trace(const struct kvr_session * s, const char * path);
// The tokens in the cache (kvr_session_n_past of them) and the last token's logits (NULL after a
// reset or a truncation).
const int32_t *   kvr_session_tokens(const struct kvr_session * s);
const float *     kvr_session_logits(const struct kvr_session * s);
// Keep only the first n tokens of the cache (a ring cache spread over MPI processes cannot; a model
// with recurrent layers keeps all or none: KVR_ERR_UNSUPP, their state is known after the last only).
int               kvr_session_truncate(struct kvr_session * s, int n);
// Save the cache to a KV cache file. tsp, kvr and single hold the whole cache on the last rank:
// one file of one shard, written by the process of that rank. ring-kv, ring-q and auto keep it
// sharded: every rank's shard gathered to one file PATH (ranks of one process), or each rank's
// shard in its own PATH.R (per_rank, and always under MPI), written by the rank's process. The
// save replaces an earlier one at PATH in either form.
int               kvr_session_kv_save(struct kvr_session * s, const char * path, bool per_rank);
// Restore a cache saved by kvr_session_kv_save or kvr_session_kv_save: PATH, or when it does not
// exist every rank's PATH.R. A ring cache of as many ranks goes back to the same shards (and the
// ring's next decode shard): continuing is then bit-identical to never having stopped, as it is
// for the whole cache on the last rank of a chain. Any other cache is split as a prefill of its
// tokens would be. Every file is checked whole first: on an error the session is as it was.
int               kvr_session_kv_load(struct kvr_session * s, const char * path);
// Swap: move the cache out of the backends' memory, to host memory (path NULL) or to a KV cache
// file (what kvr_session_kv_save writes; ranks of one process only), and free it there; swap it back
// in before the next eval (evals, saves, loads and truncations fail while it is out; a swap file is
// checked as any cache file, must hold the tokens swapped out, and is removed once back). Continuing
// after a swap is bit-identical to never having swapped.
int               kvr_session_kv_swap_out(struct kvr_session * s, const char * path);
int               kvr_session_kv_swap_in(struct kvr_session * s);
bool              kvr_session_kv_swapped(const struct kvr_session * s);
// The cache rows of every rank (the context), and the backend of a rank of this process (NULL: not
// one of this process): its rows (kvr_session_cache) are read through it with kvr_kv_cache_get_rows.
int               kvr_session_n_ctx(const struct kvr_session * s);
struct kvr_backend * kvr_session_backend(const struct kvr_session * s, int rank);
// The file of one rank's shard: PATH.R.
void              kvr_session_kv_shard_path(const char * path, int rank, char * out, size_t cap);

// Restarting from the replication logs of a run that stopped (a process was lost): DIR/rank-R.kvlog.
// Every rank's log is read whole and checked; the last step every log acknowledged is taken; the
// rows of the steps up to it are restored into this session's ranks (the same or fewer, any strategy:
// a ring run of as many ranks keeps its shards, anything else is placed as kvr_session_kv_load places
// a gathered cache); the last restored token is evaluated again for its logits (the logs hold
// none), which is the eval the first run made of it when the ranks and strategy are the same. After
// a damaged or cut log the good prefix is used and the rest recomputed by the caller's generation;
// p.log (rank 0) gets a "resume: " line for each such thing. With prompt (may be NULL) the logs must be
// of that prompt. Refused (KVR_ERR_ARG) with the file, offset and field named: logs of another
// model, another prompt, different runs mixed in DIR; KVR_ERR_IO when DIR has no logs. With
// replicate_dir naming DIR too, the logs are cut back to the step taken and go on (the same ranks
// and strategy only); another replicate_dir starts new logs with every restored row.
struct kvr_resume_info {
    int               step;       // the last step every rank acknowledged (-1: none, nothing restored)
    int               n_tokens;   // the tokens restored (kvr_session_tokens), 0 with step -1
    int               n_prompt;   // the logs' first step's tokens: the prompt
    const int32_t   * prompt;     //   (valid until the session is freed)
    int               n_ranks;    // the ranks that wrote the logs
    enum kvr_strategy strategy;   //   and their strategy
    int               recomputed; // steps some log holds past the one taken (or after a damage)
    int64_t           bytes;      // the logs' size
};
int               kvr_session_resume(struct kvr_session * s, const char * dir, const int32_t * prompt, int n_prompt,
                                  struct kvr_resume_info * info);
// DIR/rank-R.kvlog
void              kvr_session_log_path(const char * dir, int rank, char * out, size_t cap);


//
// 12. sampling
//

struct kvr_sampler_params {
    float    temp;    // <= 0: greedy
    int      top_k;   // <= 0: all
    float    top_p;   // >= 1: all
    uint64_t seed;
};

struct kvr_sampler {
    struct kvr_sampler_params p;
    uint64_t rng;
    void   * probs;   // scratch: (probability, id) pairs
    int      n_alloc;
};

void    kvr_sampler_init(struct kvr_sampler * s, const struct kvr_sampler_params * p);
void    kvr_sampler_free(struct kvr_sampler * s);
int32_t kvr_sample(struct kvr_sampler * s, const float * logits, int n_vocab);
int32_t kvr_argmax(const float * x, int n);
// Move the sampler on as n samples would have (one draw each when temp > 0): a run resumed after
// n sampled tokens (kvr_session_resume) then draws what the stopped run would have drawn next.
void    kvr_sampler_skip(struct kvr_sampler * s, int n);

//
// 13. tuning: partition search, lookup table, cost model (kvr-tune.c)
//
// KV-Runahead needs an uneven split of the prompt: early ranks take more tokens (their attention
// is short), later ranks fewer (they wait for the cache and attend over more of it). This section
// finds that split and remembers it:
//
//   search     KVR-S: the partition that minimizes an objective (a measured or a modeled TTFT).
//              2 ranks: golden-section search on the integer split (TTFT is unimodal in it);
//              more: the paper's hierarchical grid search (coarse stride, zoom on the best cell,
//              halve the stride, down to a minimum stride).
//   table      KVR-P: a text file of searched partitions per model / ranks / prompt length, read
//              back and interpolated linearly between the two nearest lengths (clamped outside).
//   model      a cost model and simulator: per-op costs from a hardware profile, model shapes
//              from a GGUF file or a preset, every rank's timeline with the real dependencies of
//              each strategy, the paper's lower bounds, and the same per-rank counters a real
//              kvr_session run reports (struct kvr_rank_stats), so the simulator is checkable.
//
// Finding a table for a model on this machine, then using it:
//
//   kvr-tune --search -m model.gguf --ranks 4 --ctx 1024,2048 --measured -r 3 -o parts.txt
//   kvr-run  -m model.gguf --ranks 4 --strategy kvr --partition table:parts.txt -f prompt.txt
//
// or, in C:
//
//   double frac[4];
//   if (kvr_tune_table_partition("parts.txt", "stories260K", 4, n_prompt, frac) == KVR_OK)
//       params.fractions = frac;                               // struct kvr_session_params
//
// Times in this section are seconds, sizes bytes, rates per second.

#define KVR_TUNE_MAX_RANKS 64   // the search, the table and the simulator handle up to this many

// How transfers share the wires. PORT: a rank has one egress and one ingress port (a GPU's
// NVLink or NIC): its messages to different peers queue behind each other. PAIR: every ordered
// pair of ranks has its own link (kvr's local transport with --link-gbps emulates this).
enum kvr_tune_links {
    KVR_TUNE_LINKS_PORT = 0,
    KVR_TUNE_LINKS_PAIR = 1,
    KVR_TUNE_LINKS_COUNT,
};

// A hardware profile: what one rank can do and what connects the ranks. Text files of
// "key value" lines (tools/profiles/*.txt; '#' starts a comment) or built in by name.
struct kvr_tune_profile {
    char   name[64];
    double matmul_flops;     // peak FLOP/s of one rank on the projection and FFN matmuls
    double matmul_eff;       // the fraction of that peak prefill shapes reach (0..1]
    double attn_flops;       // peak FLOP/s on attention (4*head_dim FLOPs per query-key pair and head)
    double attn_eff;         // the fraction the attention kernel reaches (0..1]
    double mem_bw;           // bytes/s of a rank's memory: a matmul streams its weights at least once;
                             // norms, RoPE, activations and cache stores are charged here
    double link_bw;          // bytes/s of one direction of a link (INFINITY: communication is free)
    double link_latency;     // s added to every message
    enum kvr_tune_links links;
    int    elem_bytes;       // bytes per element of activations on the wire (2: fp16, 4: f32); K/V: the plan's cache type
    double weight_bytes;     // bytes per weight element for presets (a GGUF file brings its own types)
    int    attn_tile_q;      // the attention kernel's tile: in causal mode a tile whose keys all lie
    int    attn_tile_k;      //   after its queries is skipped, so computed pairs come in tiles
    int    attn_tile_group;  // 1: attn_tile_q counts query rows, and the heads sharing a KV head are
                             //   packed into one tile (attn_tile_q / group tokens); 0: tokens
    enum kvr_attn_mode attn_mode; // the mode this kernel runs by default (tools use it unless told)
    double layer_overhead;   // s per layer and rank that no op accounts for (launches, framework)
    double attn_pair_s;      // s per query-key pair and head besides its FLOPs: the softmax's exp, max
                             //   and sum, which small head dims do not hide (0 on the GPU profiles)
    double solo_speedup;     // ranks sharing one machine (local ranks on CPU cores): how much faster a
                             //   rank computes while every other rank waits than while they compute
                             //   too (the rates above are the latter); 1: devices of their own
    double matmul_weight_s;  // s per weight element a matmul call spends besides its FLOPs, whatever
                             //   its token count (sgemm packing the weights): why a long prompt's
                             //   matmuls run faster per FLOP than 512 tokens' (0 on the GPU profiles)
};

// Built-in profiles: "a100-nvlink" and "a100-10g" (the KV-Runahead paper's 8x A100 node at
// 300 GB/s and 10 GB/s; efficiencies fitted to its single-GPU Llama 7B TTFTs, Table 3),
// "h100-nvlink", and "cpu" (kvr's CPU kernel shape with generic speeds; --calibrate measures
// the real ones). Returns KVR_ERR_ARG naming the known profiles if name is not one of them.
int kvr_tune_profile_builtin(const char * name, struct kvr_tune_profile * out);
// Read / write a profile file. Unknown keys and bad values are errors naming file, line and key;
// keys not in the file keep the values of the "cpu" profile.
int kvr_tune_profile_load(const char * path, struct kvr_tune_profile * out);
int kvr_tune_profile_save(const struct kvr_tune_profile * p, const char * path);
// A built-in name, or else a file path.
int kvr_tune_profile_get(const char * name_or_path, struct kvr_tune_profile * out);
// Measure this machine with kvr's own ops for ranks of n_threads threads, n_ranks of them sharing
// it. With a model shape: MUL_MAT of each of its projection and FFN matrices over 512 and 2048
// tokens (weighted as a layer runs them; the two lengths split a call's time into FLOPs and a cost
// per weight, matmul_weight_s) and its ATTN (its head dim and grouping, 512 queries over 2048
// keys), each alone, as the median over rounds spread in time. Without (NULL): small generic
// matmuls and an MHA attention at head dims 64 and 8 (which separates the FLOP rate from the
// softmax's cost per pair). With n_ranks > 1, a layer's op mix is also run by n_ranks copies at
// once, each at a different op: the rates are divided by that slowdown, which becomes
// solo_speedup. Then a large memcpy (memory and, since local ranks copy, the link) and a
// two-thread hand-off (the link latency). Takes seconds; log (may be NULL) gets a line per
// measurement. Peaks are set to what was reached, efficiencies to 1, the rest as in "cpu".
struct kvr_tune_model;
int kvr_tune_calibrate(struct kvr_tune_profile * out, enum kvr_attn_mode mode, const struct kvr_tune_model * shape,
                       int n_threads, int n_ranks, FILE * log);

// The shape of a model as the cost model needs it.
struct kvr_tune_model {
    char   name[64];         // the key of the model in a partition table
    int    n_layer;
    int    n_embd;
    int    n_head;
    int    n_head_kv;        // n_head: MHA; fewer: GQA; 1: MQA
    int    head_dim;
    int    n_ff;
    int    n_vocab;
    int    n_ffn_mats;       // 3: gated FFN (llama: gate, up, down); 2: up, down (falcon)
    double weight_bytes;     // bytes per weight element; 0: the profile's
    // recurrent layers (Gated DeltaNet, qwen35): no attention, a cost linear in the tokens and one
    // state handed on per rank boundary, whatever the prompt's length (all 0: none)
    int    n_recurrent;      // how many; which: bit il of recurrent
    uint64_t recurrent[64];
    double state_floats;     // a layer's state (kvr_hp_state_floats)
    double rec_floats;       // the recurrence's state elements per token (value heads x d_k x d_v)
};

// Presets: "llama-7b", "llama-13b", "falcon-7b" (MQA), "tinyllama-1.1b" (GQA 32/4), optionally
// with an attention variant suffix: "-mha", "-mqa", "-gqaN" (N KV heads), e.g. "llama-7b-gqa8".
int kvr_tune_model_preset(const char * name, struct kvr_tune_model * out);
// The shape of a loaded model. Its name is the file name without directory and ".gguf" (what
// tools write into tables and look up with; general.name is often just the architecture).
int kvr_tune_model_from(const struct kvr_model * m, struct kvr_tune_model * out);

// What to simulate: the same choices a kvr_session run makes.
struct kvr_tune_plan {
    enum kvr_strategy  strategy;   // single, tsp, kvr, ring-kv or ring-q (auto: not here)
    int                n_ranks;
    int                n_tokens;   // the prompt (a first prefill: nothing cached)
    const int        * counts;     // kvr: tokens per rank (n_ranks entries, sum n_tokens); NULL: even
    enum kvr_attn_mode attn_mode;
    enum kvr_cache_type cache_type; // K and V on the wire (0: F16, the sessions' default); queries and
                                   //   partial outputs are activations (the profile's elem_bytes)
};

// One rank of a simulated prefill. The counters mean exactly what struct kvr_rank_stats's do:
// per layer, per head; a query-key pair counts 1, K and V of c tokens count 2c rows. With the
// "cpu" profile's tiles the four attn_dot/kv_rows fields equal a real kvr_session run's of the same
// plan (tests/test-tune.c checks it), the pruned last layer of a rank without the logits included.
struct kvr_tune_rank {
    int     rank;
    int     tokens;
    double  finish;            // when its last op ends (its TTFT if it produces the first token)
    double  compute;           // busy computing
    double  attn;              //   of which in attention (kvr_rank_stats's attn_ms, in seconds)
    double  comm;              // link time of the messages it sent and received (overlapped or not)
    double  wait;              // idle, blocked on a transfer (finish = compute + wait)
    int64_t attn_dot_dense;
    int64_t attn_dot_causal;
    int64_t kv_rows_sent;
    int64_t kv_rows_recv;
    int64_t bytes_sent;        // the whole prefill, as kvr_rank_stats counts them (the ring's position
    int64_t bytes_recv;        //   messages included); equal to the run's when elem_bytes is 4 (and the cache types agree)
};

struct kvr_tune_sim {
    double ttft;               // the finish of the rank that computes the last token's logits
    int    owner;              // that rank
    int    n_ranks;
    struct kvr_tune_rank ranks[KVR_TUNE_MAX_RANKS];
};

// Simulate one prefill: every rank's per-layer timeline (projections, transfers with their link
// and latency, attention over the pairs the kernel computes, out-projection and FFN) with the
// dependencies of the strategy: tsp waits for the all-gather; kvr's rank r waits for layer l of
// the cache [0, s_r) from r-1, which sent it as soon as its own store of layer l was done; ring
// steps overlap a block's transfer with the previous block's attention. KVR_ERR_ARG on a bad plan.
int kvr_tune_simulate(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw,
                      const struct kvr_tune_plan * plan, struct kvr_tune_sim * out);

// The search. The objective returns the cost (TTFT in s) of the partition counts[n_ranks], or a
// negative value to stop the search with an error (its message left in kvr_last_error()). Every
// partition is evaluated once (memoized), so a measured objective runs no prefill twice. The
// result lies on the lattice of min_stride; both searches are local, and where lowering the
// slowest rank takes every later boundary moving by a different amount (a max of many pieces),
// the grid can stop short of the optimum: on simulated TTFTs it lands within 0.4% of a long
// random polish (llama-7b, 16k tokens, 4 and 8 ranks).
struct kvr_tune_search_params {
    int          n_ranks;
    int          n_tokens;
    int          min_stride;   // the finest step of a boundary, in tokens (0: 1)
    int          min_tokens;   // every rank gets at least this many tokens (0: 1)
    int          grid_half;    // grid points per boundary and level: 2*grid_half+1 (0: 2, the paper's 5)
    int          coarse_stride;// grid: the first level's stride (0: one rank's even share / grid_half,
                               //   rounded to min_stride times a power of two)
    const int  * start;        // grid: counts to center the first level on (NULL: the even split);
                               //   2 ranks search the whole range
    int64_t      max_evals;    // stop with an error after this many, and refuse up front a grid
                               //   that would need more (0: 10 million)
    double     (*objective)(const int * counts, int n_ranks, void * user);
    void       * user;
    FILE       * progress;     // done/total, best so far and ETA every 2 s and per level (NULL: quiet)
    const char * label;        // prefixes the progress lines ("llama-7b 4 ranks 8192")
};

struct kvr_tune_search_result {
    int     counts[KVR_TUNE_MAX_RANKS];
    double  cost;              // the objective at counts
    int64_t n_evals;           // distinct partitions evaluated
    double  seconds;
};

int kvr_tune_search(const struct kvr_tune_search_params * p, struct kvr_tune_search_result * out);

// The modeled objective: kvr_tune_simulate's TTFT of the kvr strategy. user points to this.
struct kvr_tune_sim_objective {
    const struct kvr_tune_model   * model;
    const struct kvr_tune_profile * hw;
    int                             n_tokens;
    enum kvr_attn_mode              attn_mode;
    enum kvr_cache_type             cache_type; // K/V on the wire (0: F16)
};
double kvr_tune_objective_sim(const int * counts, int n_ranks, void * user);

// The paper's lower bounds for p ranks (its Fig. 8(d)):
//   ttft_1     the single-rank TTFT (simulated)
//   ttft_star  TTFT*(p) = TTFT(1)/2 * (1/p + 1/p^2), Eq. (3): perfect balance of the dense
//              attention map cut as in Fig. 2(d), nothing else costs; TTFT(1) = alpha*C^2
//   ttft_free  TTFT(p): KVR-S with free communication (link_bw infinite, no latency)
struct kvr_tune_bounds {
    double ttft_1;
    double ttft_star;
    double ttft_free;
    int    counts_free[KVR_TUNE_MAX_RANKS]; // the partition that reaches ttft_free
};
int kvr_tune_bounds(const struct kvr_tune_model * m, const struct kvr_tune_profile * hw, int n_ranks,
                    int n_tokens, enum kvr_attn_mode mode, int min_stride, struct kvr_tune_bounds * out);

// Partition tables. The file:
//
//   # kvr partition table: model ranks tokens, then each rank's fraction of the prompt
//   profile a100-nvlink
//   llama-7b 4 8192 0.340000 0.260000 0.215000 0.185000 # ttft 0.4100
//
// "profile NAME" comes first (the hardware the entries were searched on); '#' starts a comment.
struct kvr_tune_entry {
    char   model[64];
    int    n_ranks;
    int    n_tokens;
    double fractions[KVR_TUNE_MAX_RANKS]; // sum 1
    double ttft;                          // what the search reached (0: unknown)
};

struct kvr_tune_table {
    char                    profile[64];
    int                     n_entries;
    struct kvr_tune_entry * entries;      // kept sorted by model, ranks, tokens
};

int  kvr_tune_table_load(const char * path, struct kvr_tune_table * out);   // errors name line and field
int  kvr_tune_table_save(const struct kvr_tune_table * t, const char * path);
// Add an entry, replacing one with the same model, ranks and tokens.
int  kvr_tune_table_add(struct kvr_tune_table * t, const struct kvr_tune_entry * e);
void kvr_tune_table_free(struct kvr_tune_table * t);
// KVR-P: the fractions for n_tokens, linear between the entries of the two nearest lengths for this
// model and rank count (the nearest one's outside them). model NULL: the table's only model.
int  kvr_tune_table_lookup(const struct kvr_tune_table * t, const char * model, int n_ranks, int n_tokens,
                           double * fractions_out);
// Load + lookup + free, for kvr-run --partition table:FILE.
int  kvr_tune_table_partition(const char * path, const char * model_name, int n_ranks, int n_tokens,
                              double * fractions_out);
// Token counts from fractions, rounded as kvr_session rounds them (cumulative, lround), so a
// simulated plan is the plan the run executes.
void kvr_tune_counts_from_fractions(const double * fractions, int n_ranks, int n_tokens, int * counts);

// Milliseconds from a monotonic clock.
double kvr_time_ms(void);

//
// ==================================================================================================
// The internal part: kvr's own files only (kvr.c, kvr-comm.c, kvr-cuda.cu, the tools and tests
// define KVR_BUILD before including this file); programs that embed kvr never see it, and nothing
// in it is a promise: it changes with the code.
//
//   I1. the eval road      one batch through a model on a backend: what every rank's eval runs
//   I2. transfer schedules what a rank's graph asks of a transport, made once for every transport
//   I3. test hooks         losing a rank on purpose, damaging a replica
//   I4. replication logs   the file format of --replicate-dir
//   I5. element math       one element or one block, compiled for the CPU and for the GPU
// ==================================================================================================

#ifdef KVR_BUILD

// malloc and calloc that abort on failure (kvr.c): for our own small structs, where running out of
// memory is not an input error to report
void * kvr_malloc(size_t n);
void * kvr_calloc(size_t n, size_t sz);

//
// I1. the eval road
//
// The eval road: one batch of tokens through a model on a backend, the same function for a
// session (the one-rank case: the single pass) and for every rank of kvr_session_eval (its
// strategy's pass):
//
//   kvr_model_build -> the pass rewrites every ATTN_BLOCK -> the graph is rebuilt from the
//   pass's sinks, then the output -> kvr_graph_plan -> kvr_graph_place in the compute buffer
//   (grown through the backend) -> tokens, positions and key positions set -> the backend
//   computes (comm nodes through its struct kvr_comm) -> logits read.

// What a strategy pass is given, and what it gives back.
struct kvr_pass_args {
    struct kvr_context  * ctx;     // new nodes go here
    struct kvr_graph    * g;       // the model's graph, ATTN_BLOCK nodes still in it
    struct kvr_tensor   * kpos;    // [n_kpos] i32 input: the positions of the cache rows attention reads
    // Nodes that must run though no output reads them (cache stores, sends), in the order they
    // should run: the road rebuilds g from them, then the output. 0: the pass rebuilt g itself.
    // The memory is the pass's; it must stay valid until the road returns.
    struct kvr_tensor  ** sinks;
    int                   n_sinks;
};


// A decode batch (kvr_session_eval_batch): token b of the eval is the next one of sequence b, whose
// attention reads only its own cache (kvr_pass_batch), rows [0, n_kv[b]) with the token's row at
// n_past[b]. The eval's cache is then the activations' owner only (caches[0]).
struct kvr_eval_batch {
    int                    n;        // sequences (= the eval's n_tokens)
    struct kvr_kv_cache ** caches;
    const int            * n_past;   // rows each cache held before the token
    const int            * n_kv;     // rows its attention reads (the eval's kpos: n_kv[0] + n_kv[1] + ...)
};

struct kvr_eval {
    // what to run
    const struct kvr_model * model;     // its weights on backend (kvr_model_to_backend)
    struct kvr_backend     * backend;
    struct kvr_kv_cache    * cache;     // in a buffer of backend
    const int32_t          * tokens;    // n_tokens ids (checked against the vocabulary by the caller)
    const int32_t          * pos;       // their absolute positions
    int                      n_tokens;
    const int32_t          * kpos;      // n_kpos positions of the cache rows attention reads
    int                      n_kpos;
    int                      n_past;    // the single pass: cache rows before this batch
    int                      n_outputs; // n: the logits of the last n tokens (logits: n * n_vocab floats); 0: none
    int                      n_ctx;     // the sequence's context (kvr_build.n_ctx; 0: the cache's rows)
    enum kvr_attn_mode       attn_mode;
    void                  (* pass)(void * user, struct kvr_pass_args * a); // NULL: kvr_pass_single
    const struct kvr_eval_batch * batch; // a decode batch (no pass): kvr_pass_batch (NULL: none)
    bool                     no_model;  // no model graph, no inputs, no outputs: the pass builds the
                                        //   whole graph into a->g (P/D's decode rank only receives)
    void                   * pass_user;
    int                      graph_size; // nodes (and leafs) of the graph (0: enough for the single pass)
    FILE                   * graph_out;  // print the rewritten graph here (NULL: no)
    const struct kvr_capture * capture;  // intermediates to hand out (NULL: none)
    const char             * name;       // prefixes error messages (NULL: "eval")
    struct kvr_buffer     ** compute;    // the activations' buffer: the caller's, grown here as needed
    float                  * logits;     // n_outputs * n_vocab floats, written when all went well
    struct kvr_eval_reuse  * reuse;      // decode graphs kept between evals (NULL: build every eval)
    // what it reports
    int                      n_attn_layers; // layers whose attention ran (counters are per layer)
    struct kvr_counters      counters;      // the backend's counters of this eval (zero if none)
    double                   setup_ms;      // build, pass, plan and place (a reused graph: setting
                                            //   its rows); the rest of the eval is the backend's
};

// Run one eval; KVR_OK or an error code with kvr_last_error() set.
int kvr_eval_run(struct kvr_eval * ev);

// Graph reuse for decode. One token of the single pass (no strategy pass, no capture, no graph
// printed) differs from the next only in its inputs and in the cache row its stores write, so the
// road builds and plans its graph once per layout and reuses it: attention reads the cache rows
// [0, n_kv), n_kv the next multiple of KVR_REUSE_ROWS past the token (at most the context); rows
// not written yet carry position INT32_MAX, which the causal mask hides; every layer's two stores
// are moved to the token's row. A sliding-window layer whose window W is shorter than n_kv reads W
// rows from the first its token can see, moved with the token as the stores are. A new layout is built when the token crosses n_kv, when
// the compute buffer or the cache moved, or when the caller asks for something else. A decode
// batch (kvr_eval.batch) is kept the same way, per sequence: the same sessions in the same order,
// each cache where it was and each n_kv unchanged (its caller rounds them as above).
#define KVR_REUSE_ROWS 256

struct kvr_eval_reuse {
    struct kvr_context     * ctx;        // the kept graph's tensors (NULL: none kept)
    struct kvr_graph       * g;
    struct kvr_tensor      * tokens, * pos, * kpos, * out;
    struct kvr_tensor     ** stores;     // per layer and sequence: the K store, its view, the V store, its view
    int                    * store_seq;  //   and the sequence each belongs to
    int                      n_stores;
    struct kvr_tensor     ** windows;    // per sliding-window layer shorter than n_kv: its ATTN's K, V and key
    int                      n_windows;  //   positions, W rows each (one sequence: the single pass's)
    int32_t                * kpos_host;  // n_kv positions (a batch: every sequence's, one after another)
    // the layout it was built for: per sequence (one, or a batch's) its cache, where that was, and
    // the rows its attention reads
    const struct kvr_model * model;
    struct kvr_backend     * backend;
    int                      n_seq;
    bool                     batch;
    uint64_t               * cache_serials; // each cache (a freed one's memory may come back as another's),
    struct kvr_buffer     ** cache_bufs; //   its buffer then, and its memory (a moved cache: rebuild)
    void                  ** cache_bases;
    int                    * seq_kv;
    struct kvr_buffer      * buf;        // the compute buffer it is placed in
    void                   * buf_base;
    size_t                   buf_size;
    int                      n_kv, n_outputs, n_attn_layers, n_ctx;  // n_kv: the sum over the sequences
    enum kvr_attn_mode       attn_mode;
    // what happened (tests, benchmarks)
    int64_t                  builds, reuses;
};

struct kvr_eval_reuse * kvr_eval_reuse_new(void);
void                    kvr_eval_reuse_free(struct kvr_eval_reuse * r);

//
// I2. transfer schedules
//
// The transfer schedule of one rank's graph: what its strategy asks of a transport. It is made
// from the graph's communication nodes in execution order by code that knows no transport, and
// every transport runs it: NCCL issues each group between ncclGroupStart and ncclGroupEnd; local
// and MPI, which match by tag, post the receives at the graph's start and the sends group by
// group (kvr-comm.c's endpoint is the same code for all three). The rules:
//
//   a run of SEND nodes (no computing node between them) and the run of RECV nodes that comes
//     next make one group: a ring step's send to the next rank and receive from the previous one;
//     in the KV-Runahead chain a rank's sends of layer l and its receives of layer l+1
//   a collective (ALL_GATHER, ALL_TO_ALL) is one group: a send to and a receive from every
//     other rank
//   a run of RECV nodes with no send run before it (the chain's first layer; every layer of its
//     last rank) is a group issued together with the group before it (at the graph's start when
//     there is none), so it is waiting before the data is sent
//
// A group is issued when the rank reaches its issue node (the last send of the run, or the
// collective), so everything a send reads exists; a receive is waited for at its own node; sends
// when the graph ends. Peers pair operations by order, not by tag (NCCL's rule): the k-th send
// from a to b goes with the k-th receive on b from a. Tags name transfers in errors and checks.
struct kvr_xfer {
    int     group;       // the group it is issued in
    int     node;        // its communication node (index into kvr_schedule.nodes)
    int     peer;
    int     tag;
    bool    send;
    int64_t bytes;
    int64_t off;         // byte offset in the node's memory (collectives: the peer's rows or slice)
    int64_t rows;        // rows moved (the K/V row counters of struct kvr_rank_stats)
    int     match_rank;  // after an eval over the local transport: the transfer of the peer it
    int     match_index; //   was delivered to or from (its index there; -1: none)
};

struct kvr_xfer_group {
    int first, n;        // its transfers: x[first .. first+n)
    int issue;           // the communication node at which it is issued (-1: the graph's start)
};

struct kvr_xfer_node {
    const struct kvr_tensor * t;     // the graph's node (valid while the graph lives)
    enum kvr_op               op;    // SEND, RECV, ALL_GATHER or ALL_TO_ALL
    bool                      after_compute; // a computing node runs between it and the comm node before
    char                      name[KVR_MAX_NAME];
};

struct kvr_schedule {
    int                        rank, n_ranks;
    struct kvr_xfer_node     * nodes;      // the graph's communication nodes, in execution order
    int                      * node_first; // [n_nodes + 1]: node k's transfers are x[node_first[k] .. node_first[k+1])
    int                        n_nodes;
    struct kvr_xfer          * x;
    int                        n;
    struct kvr_xfer_group    * groups;
    int                        n_groups;
};

// The schedule of rank's graph g (placed or not); KVR_OK, or an error for a malformed comm node.
int  kvr_schedule_build(struct kvr_schedule * s, const struct kvr_graph * g, int rank, int n_ranks);
void kvr_schedule_free(struct kvr_schedule * s);
// One line per group: its issue node and its transfers ("send K l3 s0 -> 2 (4096 B)").
void kvr_schedule_print(const struct kvr_schedule * s, FILE * f);
// The schedule a rank of this process ran in its last eval (NULL: not a rank of this process,
// or it ran no pass), with the transport's matches where it records them (local).
const struct kvr_schedule * kvr_session_schedule(const struct kvr_session * s, int rank);

//
// I3. test hooks
//
// Test hook KVR_TEST_KILL: a rank is lost at a chosen point, as a process or GPU that fails would
// be. "RANK:prefill:LAYER" loses RANK (the rank as started; MPI: the process's rank) in the first
// prefill (any eval that is not a decode step) right after layer LAYER's rows are final in its
// cache (its K/V store, or tsp's gather), before the layer's other transfers; "RANK:decode:STEP" loses
// it in decode step STEP (0-based count of one-token evals after tokens are cached, since
// kvr_session_new) at layer n_layer/2. Several points, separated by commas, lose several ranks (or
// one rank later: each point fires once). What "lost" means:
//   local ranks (threads): the rank's eval stops there without telling anyone; its transfers are
//     withdrawn, so the peers that wait on it fail with the timeout error a lost process gives;
//     the rank stays lost (later evals fail) unless --replicate recovers from it
//   MPI (and NCCL under mpirun): the process raises SIGKILL there and dies at once
// A rank that computes nothing in the eval its point falls in (during decode every rank of a
// chain but the last; the P/D decode rank during the prefill) is lost when that eval starts.
struct kvr_test_kill {
    int  rank;
    bool decode;   // false: the prefill, at layer `at`; true: decode step `at`
    int  at;
};
// Parse KVR_TEST_KILL's value into out (at most cap points): their count, or -1 with
// kvr_last_error() naming the variable and what is wrong.
int kvr_test_kill_parse(const char * value, struct kvr_test_kill * out, int cap);

// The hooks a session is made with (kvr_session_params.test; copied, checked by kvr_session_new).
struct kvr_test_hooks {
    bool                         stall;       // rank stall_rank (as started) stops before its first
    int                          stall_rank;  //   transfer of layer stall_layer and never sends again,
    int                          stall_layer; //   as a stopped process would (KVR_TEST_STALL=RANK:LAYER in
                                              //   kvr-run; a process of its own: SIGSTOP; layer n_layer:
                                              //   before an MPI owner's logits go out). With --replicate
                                              //   the peers' timeout declares it lost and recovers.
    bool                         stall_decode;  // the stall arms only in decode step stall_step (the
    int                          stall_step;    //   steps KVR_TEST_KILL counts), not from the prefill on
    bool                         stall_deaf;    // a stalled local rank's thread does not come back when
                                                //   told to stop: it sleeps five timeouts, past the three
                                                //   the driver waits (the session is then wedged)
    const struct kvr_test_kill * kill;        // KVR_TEST_KILL: these ranks are lost at these points
    int                          n_kill;
};

// Test hook (--replicate): damage the replica of rank `rank`'s rows as memory or a lost message
// would: flip a bit of row `row` (layer 0, K), or (cut) forget its rows from the chunk holding
// `row` on and every later one (a replica that fell behind). A recovery that needs them refuses
// them and recomputes. KVR_OK, or KVR_ERR_ARG when there is no such replica or row.
int               kvr_session_test_replica(struct kvr_session * s, int rank, int row, bool cut);

//
// I4. replication logs
//
// Replication logs (kvr_session_params.replicate_dir, kvr_session_resume; written and read in kvr-comm.c,
// read by tests/test-resume.c too): one rank's cache rows,
// appended step by step while it computes, so that a run whose process was killed at any instant
// can be resumed from what every rank acknowledged. Little-endian, append-only:
//
//   offset  bytes  field
//        0      8  magic "KVRKVLOG"
//        8      4  version (KVR_KV_LOG_VERSION)
//       12      4  flags (enum kvr_kv_log_flag; unknown bits are refused)
//       16     48  the model's fingerprint and weights hash: the cache file's bytes 16..64, with
//                  (at 32) the rows' types as there: K's type id in the low 16 bits, V's in the
//                  high 16 (f32, f16, bf16 or q8_0: the cache's, so a row is logged as its bytes)
//       64     16  rank, ranks, strategy (enum kvr_strategy), prompt tokens (u32 each)
//       80      4  0 (u32)
//       84      8  the tokenizer hash: the cache file's bytes 84..92
//       92      4  CRC32C of bytes [0, 92)
//       96         the prompt's token ids (i32), then their CRC32C
//                  then records, each starting (type, step) u32:
//                  KVR_KV_LOG_ROWS:   layer, rows (u32); K rows then V rows, rows of kv_dim values
//                                     in K's and V's type (kvr_row_size bytes each)
//                  KVR_KV_LOG_COMMIT: tokens, rows (u32); the step's token ids (i32); the
//                                     absolute positions of the rank's rows of the step (i32)
//                  and a CRC32C over the record seeded with the previous record's CRC (the first
//                  record's with the prompt's): a record moved, repeated or cut breaks the chain
//
// A step is acknowledged when its COMMIT is whole and every layer's ROWS record of the step (one
// per layer when the rank made rows in it, else none) precedes it whole. A rank commits every
// step, also those it made no rows in. A reader keeps the acknowledged steps and ignores what
// follows the last whole COMMIT (a record cut short or with a bad CRC ends the log's good prefix).

// A resume into a session whose cache types are the log's puts the logged bytes back as they were;
// into one of other types it converts the rows (through f32, as a KV file of another type loads)
// and says so in a note, but does not go on appending to those logs (their rows would change type
// mid-file): that is refused, naming both types. Older versions are refused, saying why.
#define KVR_KV_LOG_VERSION 3 // 2: f32 rows, no cache type; 1: the weights hash covered the tensors' metadata
                             //   only, no tokenizer hash
#define KVR_KV_LOG_HEADER  96

enum kvr_kv_log_flag {
    KVR_KV_LOG_BASE = 1, // step 0 holds every row the rank had when the log started (after a load,
                         //   a truncation or a resume into another directory), not a prompt's
    KVR_KV_LOG_ROPE_LONG = 2, // the keys took Phi-3's long LongRoPE factors, as the cache file's flag
};

enum kvr_kv_log_record {
    KVR_KV_LOG_ROWS   = 1,
    KVR_KV_LOG_COMMIT = 2,
};

struct kvr_kv_log_head {
    int             rank, n_ranks, strategy;
    int             n_prompt;  // the tokens of step 0
    const int32_t * prompt;
    uint32_t        flags;
    enum kvr_type   type_k, type_v; // the rows' types (the cache's); zeroed: f32
};

// The writer: each call writes one record with one write(2) (no buffering in the process, so a
// process killed after the call has left the record to the kernel); kvr_kv_log_sync makes what
// was written durable (fdatasync). create truncates PATH; append continues a log that
// kvr_kv_log_read returned, cutting it back to the end of its acknowledged prefix first.
struct kvr_kv_log;
struct kvr_kv_log_data;
int     kvr_kv_log_create(struct kvr_kv_log ** out, const char * path, const struct kvr_model * m,
                          const struct kvr_kv_log_head * h);
int     kvr_kv_log_append(struct kvr_kv_log ** out, const char * path, const struct kvr_model * m,
                          const struct kvr_kv_log_data * d);
int     kvr_kv_log_rows  (struct kvr_kv_log * w, int step, int il, int n_rows, const void * k, const void * v); // in the log's types
int     kvr_kv_log_commit(struct kvr_kv_log * w, int step, const int32_t * tokens, int n_tokens,
                          const int32_t * pos, int n_rows);
int     kvr_kv_log_sync  (struct kvr_kv_log * w);
int     kvr_kv_log_close (struct kvr_kv_log * w); // syncs, closes, frees
int64_t kvr_kv_log_bytes (const struct kvr_kv_log * w);

// What a reader found: the header and the acknowledged steps, with their rows.
struct kvr_kv_log_step {
    int       step;
    int       n_tokens;
    int32_t * tokens;
    int       n_rows;
    int32_t * pos;        // the rows' absolute positions
    uint8_t ** k;         // per layer: n_rows rows of kv_dim values in the log's K type (NULL when
    uint8_t ** v;         //   n_rows is 0); V's likewise
    int64_t   end;        // the offset after the step's COMMIT
    uint32_t  crc;        //   and the chain's CRC there
};

struct kvr_kv_log_data {
    uint32_t                 flags;
    int                      rank, n_ranks, strategy;
    int                      n_prompt;
    int32_t                * prompt;
    int                      n_layer, kv_dim;
    enum kvr_type            type_k, type_v; // the rows' types (header offset 32)
    size_t                   row_k, row_v;   //   and a row's bytes in each
    int                      n_steps;   // acknowledged steps 0 .. n_steps-1
    struct kvr_kv_log_step * steps;
    int64_t                  good;      // where the acknowledged prefix ends (the header's end without steps)
    uint32_t                 good_crc;  //   and the chain's CRC there
    int64_t                  bytes;     // the file's size
    char                     damage[512]; // why the log ends before its last byte ("" if it does not): the
                                          //   offset and what was cut or damaged there
    void                   * mem;       // the file's bytes, which the steps' rows point into
};

// The header is checked whole: KVR_ERR_IO (cannot open), KVR_ERR_FORMAT (not a log, a damaged
// header or prompt, a type field that is no cache type for the model's head size, an older
// version), KVR_ERR_UNSUPP (a newer version), KVR_ERR_ARG (another model: the message names the field); then the records are read up to the first damage, which is no error (see damage).
int  kvr_kv_log_read(const char * path, const struct kvr_model * m, struct kvr_kv_log_data ** out);
void kvr_kv_log_free(struct kvr_kv_log_data * d);

// The model's fingerprint and the rows' types, bytes 16..64 and 84..92 of a cache file's or a log's
// header h: written, or checked (KVR_ERR_ARG naming the first field of another model; KVR_ERR_FORMAT
// for a type field that holds no KV cache type for the model's head size; what: "cache", "log"),
// the types read into *type_k and *type_v
void kvr_kv_fingerprint_put  (const struct kvr_model * m, enum kvr_type type_k, enum kvr_type type_v, uint8_t * h);
int  kvr_kv_fingerprint_check(const char * path, const uint8_t * h, const struct kvr_model * m, const char * what,
                              enum kvr_type * type_k, enum kvr_type * type_v);

//
// I5. element math: one element or one block
//
// What is here is written once and compiled twice: by the C compiler for
// the CPU path and by nvcc for the GPU kernels (KVR_HD is __host__ __device__ there), so every
// test of the CPU path also checks the arithmetic a GPU runs. Kept here: the quant
// block layouts and the dequantization of one block of each type, fp16/bf16 conversion, RoPE's
// angle and the rotation of a pair, GGML's GELU rule (and the exact one), soft-capping, the
// online-softmax step and its finish,
// the log-sum-exp merge, and the attention tiles (which tiles of a causal block are computed).

#if defined(__CUDACC__)
#define KVR_HD       __host__ __device__
#define KVR_RESTRICT __restrict__
#else
#define KVR_HD
#define KVR_RESTRICT restrict
#endif

// float <-> its bits (memcpy on the host, the intrinsic on the device: both are free)
static inline KVR_HD float kvr_f32_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline KVR_HD uint32_t kvr_bits_of_f32(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

// IEEE binary16 -> f32, exact (subnormals normalized, inf and nan kept)
static inline KVR_HD float kvr_half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp  = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { // subnormal: normalize
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400));
            mant &= 0x3ff;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    return kvr_f32_of_bits(bits);
}

// f32 -> IEEE binary16, round to nearest even; overflow gives inf, nan stays nan
static inline KVR_HD uint16_t kvr_f32_to_half(float f) {
    const uint32_t x    = kvr_bits_of_f32(f);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000u) { // inf or nan
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    }
    if (absx >= 0x477ff000u) { // rounds to >= 65520: overflow to inf
        return (uint16_t)(sign | 0x7c00);
    }
    if (absx < 0x38800000u) { // below the smallest normal half: subnormal or zero
        // add the value to 0.5 (as float) so the FPU does round-to-nearest-even for us; no mask:
        // a value that rounds up to 2^-14 becomes the smallest normal (0x400)
        const float a = kvr_f32_of_bits(absx) + 0.5f;
        return (uint16_t)(sign | (kvr_bits_of_f32(a) - 0x3f000000u));
    }
    const uint32_t mant_odd = (absx >> 13) & 1;
    const uint32_t v = absx + 0xc8000fffu + mant_odd; // rebias exponent (-112 << 23), round to nearest even
    return (uint16_t)(sign | (v >> 13));
}

static inline KVR_HD float kvr_bfloat_to_f32(uint16_t h) {
    return kvr_f32_of_bits((uint32_t)h << 16);
}

static inline KVR_HD uint16_t kvr_f32_to_bfloat(float f) {
    const uint32_t x = kvr_bits_of_f32(f);
    if ((x & 0x7fffffff) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 64); // quiet nan
    }
    return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

// Quant blocks. Layouts are GGML's (ggml-common.h); the code is kvr's. Every block is made of
// bytes only, so a block may sit at any address (GGUF views need not be aligned), and the
// half-precision fields are read little-endian by hand. Comments give the element each bit
// belongs to. Dequantization multiplies in ggml's order, so results are ggml's bits.
#define KVR_QK   32   // elements per block of the legacy formats
#define KVR_QK_K 256  // elements per super-block of the k-quants

struct kvr_block_q4_0 {        // x = d * (q - 8)
    uint8_t d[2];              // fp16 scale
    uint8_t qs[KVR_QK/2];      // element j: low nibble of qs[j]; element j+16: high nibble
};
struct kvr_block_q4_1 {        // x = d * q + m
    uint8_t d[2], m[2];        // fp16 scale and min
    uint8_t qs[KVR_QK/2];      // as q4_0
};
struct kvr_block_q5_0 {        // x = d * (q - 16)
    uint8_t d[2];
    uint8_t qh[4];             // bit j of this little-endian u32: the 5th bit of element j
    uint8_t qs[KVR_QK/2];      // low 4 bits as q4_0
};
struct kvr_block_q5_1 {        // x = d * q + m
    uint8_t d[2], m[2];
    uint8_t qh[4];
    uint8_t qs[KVR_QK/2];
};
struct kvr_block_q8_0 {        // x = d * q
    uint8_t d[2];
    int8_t  qs[KVR_QK];
};
struct kvr_block_q8_1 {        // x = d * q (s = d * sum(q) serves dot products only)
    uint8_t d[2], s[2];
    int8_t  qs[KVR_QK];
};
// k-quants: a super-block of 256 elements in sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K).
// The 2-bit planes of Q2_K/Q3_K and the nibbles of Q4_K..Q6_K are laid out in 128- or 64-element
// halves: element e of half h reads byte h*32 + e%32 at bit offset 2*((e%128)/32) (2-bit planes).
struct kvr_block_q2_K {        // x = d*sc * q - dmin*m, q in 0..3
    uint8_t scales[KVR_QK_K/16];   // per 16 elements: low nibble scale, high nibble min
    uint8_t qs[KVR_QK_K/4];
    uint8_t d[2], dmin[2];
};
struct kvr_block_q3_K {        // x = d*(sc - 32) * (q - 4), q in 0..7
    uint8_t hmask[KVR_QK_K/8];     // bit e/32 of hmask[e%32]: the 3rd bit of element e
    uint8_t qs[KVR_QK_K/4];        // low 2 bits, as q2_K
    uint8_t scales[12];            // 16 6-bit scales: low nibbles in bytes 0..7, high pairs in 8..11
    uint8_t d[2];
};
struct kvr_block_q4_K {        // x = d*sc * q - dmin*m, q in 0..15, per 32 elements
    uint8_t d[2], dmin[2];
    uint8_t scales[12];            // 8 6-bit scales and 8 6-bit mins (see kvr_k4_scales)
    uint8_t qs[KVR_QK_K/2];        // element e: byte (e/64)*32 + e%32, high nibble if (e%64) >= 32
};
struct kvr_block_q5_K {        // x = d*sc * q - dmin*m, q in 0..31, per 32 elements
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qh[KVR_QK_K/8];        // bit e/32 of qh[e%32]: the 5th bit of element e
    uint8_t qs[KVR_QK_K/2];        // low 4 bits as q4_K
};
struct kvr_block_q6_K {        // x = d*sc * (q - 32), q in 0..63, per 16 elements
    uint8_t ql[KVR_QK_K/2];        // low 4 bits: half h, quarter k of the half, index l:
                                   //   ql[h*64 + (k&1)*32 + l], high nibble if k >= 2
    uint8_t qh[KVR_QK_K/4];        // high 2 bits: qh[h*32 + l] >> 2*k
    int8_t  scales[KVR_QK_K/16];
    uint8_t d[2];
};
struct kvr_block_q8_K {        // x = d * q (intermediate type of ggml's k-quant dot products)
    uint8_t d[4];                  // f32 scale
    int8_t  qs[KVR_QK_K];
    uint8_t bsums[KVR_QK_K/16*2];  // int16 sums of 16 quants
};

// MXFP4 (OCP microscaling, GGML's layout): 32 values share one E8M0 exponent; each value is a
// 4-bit E2M1 code whose magnitude GGML keeps doubled (0, 1, 2, 3, 4, 6, 8, 12; bit 3 the sign), so
// x = kvalue(code) * 2^(e - 128), exact in f32.
struct kvr_block_mxfp4 {
    uint8_t e;                 // the shared exponent (E8M0: 2^(e - 127))
    uint8_t qs[KVR_QK/2];      // element j: low nibble of qs[j]; element j+16: high nibble
};

#if defined(__cplusplus)
#define KVR_STATIC_ASSERT(x, msg) static_assert(x, msg)
#else
#define KVR_STATIC_ASSERT(x, msg) _Static_assert(x, msg)
#endif
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q4_0) ==  18, "q4_0 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q4_1) ==  20, "q4_1 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q5_0) ==  22, "q5_0 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q5_1) ==  24, "q5_1 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q8_0) ==  34, "q8_0 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q8_1) ==  36, "q8_1 size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q2_K) ==  84, "q2_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q3_K) == 110, "q3_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q4_K) == 144, "q4_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q5_K) == 176, "q5_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q6_K) == 210, "q6_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_q8_K) == 292, "q8_K size");
KVR_STATIC_ASSERT(sizeof(struct kvr_block_mxfp4) == 17, "mxfp4 size");

static inline KVR_HD float kvr_q_half(const uint8_t * p) {
    return kvr_half_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

static inline KVR_HD uint32_t kvr_q_u32le(const uint8_t * p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// One block of each type to f32: y receives kvr_blck_size(type) values. Plain loops with fixed
// trip counts: inlined into the CPU's row loops they vectorize (a matmul dequantizes each weight
// row once and reuses it over every token); a GPU thread runs one block.

static inline KVR_HD void kvr_dequant_q4_0(const struct kvr_block_q4_0 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    for (int j = 0; j < KVR_QK/2; j++) {
        y[j]            = (float)((b->qs[j] & 0x0f) - 8) * d;
        y[j + KVR_QK/2] = (float)((b->qs[j] >>   4) - 8) * d;
    }
}

static inline KVR_HD void kvr_dequant_q4_1(const struct kvr_block_q4_1 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    const float m = kvr_q_half(b->m);
    for (int j = 0; j < KVR_QK/2; j++) {
        y[j]            = (float)(b->qs[j] & 0x0f) * d + m;
        y[j + KVR_QK/2] = (float)(b->qs[j] >>   4) * d + m;
    }
}

static inline KVR_HD void kvr_dequant_q5_0(const struct kvr_block_q5_0 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float    d  = kvr_q_half(b->d);
    const uint32_t qh = kvr_q_u32le(b->qh);
    for (int j = 0; j < KVR_QK/2; j++) {
        // the 5th bit lands at bit 4: from bit j for the low half, bit j+16 for the high half
        const int lo = (b->qs[j] & 0x0f) | (int)(((qh >> j) << 4) & 0x10);
        const int hi = (b->qs[j] >>   4) | (int)((qh >> 12 >> j) & 0x10);
        y[j]            = (float)(lo - 16) * d;
        y[j + KVR_QK/2] = (float)(hi - 16) * d;
    }
}

static inline KVR_HD void kvr_dequant_q5_1(const struct kvr_block_q5_1 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float    d  = kvr_q_half(b->d);
    const float    m  = kvr_q_half(b->m);
    const uint32_t qh = kvr_q_u32le(b->qh);
    for (int j = 0; j < KVR_QK/2; j++) {
        const int lo = (b->qs[j] & 0x0f) | (int)(((qh >> j) << 4) & 0x10);
        const int hi = (b->qs[j] >>   4) | (int)((qh >> 12 >> j) & 0x10);
        y[j]            = (float)lo * d + m;
        y[j + KVR_QK/2] = (float)hi * d + m;
    }
}

static inline KVR_HD void kvr_dequant_q8_0(const struct kvr_block_q8_0 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    for (int j = 0; j < KVR_QK; j++) {
        y[j] = (float)b->qs[j] * d;
    }
}

static inline KVR_HD void kvr_dequant_q8_1(const struct kvr_block_q8_1 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    for (int j = 0; j < KVR_QK; j++) {
        y[j] = (float)b->qs[j] * d;
    }
}

static inline KVR_HD void kvr_dequant_q2_K(const struct kvr_block_q2_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d    = kvr_q_half(b->d);
    const float dmin = kvr_q_half(b->dmin);
    // 16 runs of 16 elements; run r is half r/8, bit plane (r%8)/2, bytes 16*(r%2) .. +15
    for (int r = 0; r < KVR_QK_K/16; r++, y += 16) {
        const uint8_t * KVR_RESTRICT q = b->qs + (r/8)*32 + (r%2)*16;
        const int   shift = 2*((r%8)/2);
        const float dl = d    * (float)(b->scales[r] & 0x0f);
        const float ml = dmin * (float)(b->scales[r] >>   4);
        for (int l = 0; l < 16; l++) {
            y[l] = dl * (float)((q[l] >> shift) & 3) - ml;
        }
    }
}

// Q3_K's 16 scales, 6 bits each, stored as 12 bytes: the low nibble of scale j is byte j (j < 8)
// or the high nibble of byte j-8; its top 2 bits are bits 2*(j/4) of byte 8 + j%4.
static inline KVR_HD void kvr_q3_scales(const uint8_t * s, int sc[16]) {
    for (int j = 0; j < 8; j++) {
        sc[j]     = (s[j] & 0x0f) | (((s[8 + j%4] >> (2*(j/4)))       & 3) << 4);
        sc[j + 8] = (s[j] >>   4) | (((s[8 + j%4] >> (2*((j + 8)/4))) & 3) << 4);
    }
}

static inline KVR_HD void kvr_dequant_q3_K(const struct kvr_block_q3_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    int sc[16];
    kvr_q3_scales(b->scales, sc);
    for (int r = 0; r < KVR_QK_K/16; r++, y += 16) {
        const uint8_t * KVR_RESTRICT q  = b->qs + (r/8)*32 + (r%2)*16;
        const uint8_t * KVR_RESTRICT hm = b->hmask + (r%2)*16;
        const int   shift = 2*((r%8)/2);
        const int   hbit  = r/2;              // element e's high bit is bit e/32 = r/2
        const float dl = d * (float)(sc[r] - 32);
        for (int l = 0; l < 16; l++) {
            // q - 4 when the high bit is clear, q when it is set (no branch)
            const int v = (int)(((q[l] >> shift) & 3) | (((hm[l] >> hbit) & 1) << 2)) - 4;
            y[l] = dl * (float)v;
        }
    }
}

// The 8 scales and 8 mins (6 bits each) of Q4_K and Q5_K in 12 bytes: for j < 4 they are the low
// 6 bits of bytes j and j+4; for j >= 4 the low 4 bits come from byte j+4 (scale: low nibble,
// min: high nibble) and the top 2 bits from the top of bytes j-4 (scale) and j (min).
static inline KVR_HD void kvr_k4_scales(const uint8_t * s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j]     = s[j]     & 63;
        mn[j]     = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j]     >> 6) << 4);
        mn[j + 4] = (s[j + 8] >>   4) | ((s[j + 4] >> 6) << 4);
    }
}

// the same, times the super-block's d and dmin
static inline KVR_HD void kvr_k4_scales_f(const uint8_t * s, float d, float dmin, float dl[8], float ml[8]) {
    int sc[8], mn[8];
    kvr_k4_scales(s, sc, mn);
    for (int j = 0; j < 8; j++) {
        dl[j] = d    * (float)sc[j];
        ml[j] = dmin * (float)mn[j];
    }
}

static inline KVR_HD void kvr_dequant_q4_K(const struct kvr_block_q4_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    float dl[8], ml[8];
    kvr_k4_scales_f(b->scales, kvr_q_half(b->d), kvr_q_half(b->dmin), dl, ml);
    for (int g = 0; g < 4; g++, y += 64) {
        const uint8_t * KVR_RESTRICT q = b->qs + 32*g;
        const float d1 = dl[2*g],     m1 = ml[2*g];
        const float d2 = dl[2*g + 1], m2 = ml[2*g + 1];
        for (int l = 0; l < 32; l++) {
            y[l]      = d1 * (float)(q[l] & 0x0f) - m1;
            y[l + 32] = d2 * (float)(q[l] >>   4) - m2;
        }
    }
}

static inline KVR_HD void kvr_dequant_q5_K(const struct kvr_block_q5_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    float dl[8], ml[8];
    kvr_k4_scales_f(b->scales, kvr_q_half(b->d), kvr_q_half(b->dmin), dl, ml);
    for (int g = 0; g < 4; g++, y += 64) {
        const uint8_t * KVR_RESTRICT q  = b->qs + 32*g;
        const uint8_t * KVR_RESTRICT qh = b->qh;
        const float d1 = dl[2*g],     m1 = ml[2*g];
        const float d2 = dl[2*g + 1], m2 = ml[2*g + 1];
        for (int l = 0; l < 32; l++) {
            const int lo = (q[l] & 0x0f) | (((qh[l] >> (2*g))     & 1) << 4);
            const int hi = (q[l] >>   4) | (((qh[l] >> (2*g + 1)) & 1) << 4);
            y[l]      = d1 * (float)lo - m1;
            y[l + 32] = d2 * (float)hi - m2;
        }
    }
}

static inline KVR_HD void kvr_dequant_q6_K(const struct kvr_block_q6_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_q_half(b->d);
    float ds[16];
    for (int j = 0; j < 16; j++) {
        ds[j] = d * (float)b->scales[j];
    }
    for (int h = 0; h < 2; h++, y += 128) {
        const uint8_t * KVR_RESTRICT ql = b->ql + 64*h;
        const uint8_t * KVR_RESTRICT qh = b->qh + 32*h;
        const float * s = ds + 8*h;
        for (int l = 0; l < 32; l++) {
            const int q1 = ((ql[l]      & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l]      >>   4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >>   4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            const int is = l/16;
            y[l]      = s[is + 0] * (float)q1;
            y[l + 32] = s[is + 2] * (float)q2;
            y[l + 64] = s[is + 4] * (float)q3;
            y[l + 96] = s[is + 6] * (float)q4;
        }
    }
}

static inline KVR_HD void kvr_dequant_q8_K(const struct kvr_block_q8_K * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_f32_of_bits(kvr_q_u32le(b->d));
    for (int j = 0; j < KVR_QK_K; j++) {
        y[j] = d * (float)b->qs[j];
    }
}

// The doubled E2M1 value of a 4-bit MXFP4 code (GGML's kvalues_mxfp4), without a table so that a
// GPU thread computes it too: 0..3 as they are, then 4, 6, 8, 12; bit 3 is the sign.
static inline KVR_HD int kvr_mxfp4_value(int code) {
    const int m = code & 7;
    const int v = m < 4 ? m : (4 + 2 * (m & 1)) << ((m >> 1) & 1);
    return code & 8 ? -v : v;
}

// 2^(e - 128): half the E8M0 scale, as GGML multiplies the doubled values (e < 2: subnormal)
static inline KVR_HD float kvr_e8m0_half(uint8_t e) {
    return kvr_f32_of_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

static inline KVR_HD void kvr_dequant_mxfp4(const struct kvr_block_mxfp4 * KVR_RESTRICT b, float * KVR_RESTRICT y) {
    const float d = kvr_e8m0_half(b->e);
    for (int j = 0; j < KVR_QK/2; j++) {
        y[j]            = (float)kvr_mxfp4_value(b->qs[j] & 0x0f) * d;
        y[j + KVR_QK/2] = (float)kvr_mxfp4_value(b->qs[j] >>   4) * d;
    }
}

// One block of any supported type: block i of a row (a plain type's "block" is one element).
// The GPU's per-block kernels call this; the CPU's row loops call the typed functions directly.
static inline KVR_HD void kvr_dequant_block(enum kvr_type type, const void * row, int64_t i, float * KVR_RESTRICT y) {
    const uint8_t * p = (const uint8_t *)row;
    switch (type) {
        case KVR_TYPE_F32:  y[0] = kvr_f32_of_bits(kvr_q_u32le(p + 4*i)); break;
        case KVR_TYPE_F16:  y[0] = kvr_half_to_f32((uint16_t)(p[2*i] | (p[2*i + 1] << 8))); break;
        case KVR_TYPE_BF16: y[0] = kvr_bfloat_to_f32((uint16_t)(p[2*i] | (p[2*i + 1] << 8))); break;
        case KVR_TYPE_Q4_0: kvr_dequant_q4_0((const struct kvr_block_q4_0 *)p + i, y); break;
        case KVR_TYPE_Q4_1: kvr_dequant_q4_1((const struct kvr_block_q4_1 *)p + i, y); break;
        case KVR_TYPE_Q5_0: kvr_dequant_q5_0((const struct kvr_block_q5_0 *)p + i, y); break;
        case KVR_TYPE_Q5_1: kvr_dequant_q5_1((const struct kvr_block_q5_1 *)p + i, y); break;
        case KVR_TYPE_Q8_0: kvr_dequant_q8_0((const struct kvr_block_q8_0 *)p + i, y); break;
        case KVR_TYPE_Q8_1: kvr_dequant_q8_1((const struct kvr_block_q8_1 *)p + i, y); break;
        case KVR_TYPE_Q2_K: kvr_dequant_q2_K((const struct kvr_block_q2_K *)p + i, y); break;
        case KVR_TYPE_Q3_K: kvr_dequant_q3_K((const struct kvr_block_q3_K *)p + i, y); break;
        case KVR_TYPE_Q4_K: kvr_dequant_q4_K((const struct kvr_block_q4_K *)p + i, y); break;
        case KVR_TYPE_Q5_K: kvr_dequant_q5_K((const struct kvr_block_q5_K *)p + i, y); break;
        case KVR_TYPE_Q6_K: kvr_dequant_q6_K((const struct kvr_block_q6_K *)p + i, y); break;
        case KVR_TYPE_Q8_K: kvr_dequant_q8_K((const struct kvr_block_q8_K *)p + i, y); break;
        case KVR_TYPE_MXFP4: kvr_dequant_mxfp4((const struct kvr_block_mxfp4 *)p + i, y); break;
        default: break; // callers check kvr_type_supported first
    }
}

// Scale and min j of the 8 of a Q4_K or Q5_K block (their d, dmin and scales lie alike), times d
// and dmin: kvr_k4_scales_f's entry j alone.
static inline KVR_HD void kvr_k4_scale1(const struct kvr_block_q4_K * b, int j, float * dl, float * ml) {
    const uint8_t * s = b->scales;
    const int sc = j < 4 ? s[j] & 63     : (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >>   4) | ((s[j]     >> 6) << 4);
    *dl = kvr_q_half(b->d)    * (float)sc;
    *ml = kvr_q_half(b->dmin) * (float)mn;
}

// Eight elements of a row, 8g .. 8g+7, of any supported type, with the bits kvr_dequant_block gives
// them: what one lane of the GPU's matmul kernels holds at a time instead of a whole block (256
// floats of a k-quant in one thread spilled to local memory). Every block size is a multiple of 8,
// so a group never straddles two blocks. tests/test-cuda-host.cu checks it against
// kvr_dequant_block for every type.
static inline KVR_HD void kvr_dequant8(enum kvr_type type, const void * row, int64_t g, float * KVR_RESTRICT y) {
    const uint8_t * p = (const uint8_t *)row;
    switch (type) {
        case KVR_TYPE_F32:
            for (int j = 0; j < 8; j++) y[j] = kvr_f32_of_bits(kvr_q_u32le(p + 4*(8*g + j)));
            break;
        case KVR_TYPE_F16:
        case KVR_TYPE_BF16:
            for (int j = 0; j < 8; j++) {
                const uint8_t * h = p + 2*(8*g + j);
                const uint16_t v = (uint16_t)(h[0] | (h[1] << 8));
                y[j] = type == KVR_TYPE_F16 ? kvr_half_to_f32(v) : kvr_bfloat_to_f32(v);
            }
            break;
        case KVR_TYPE_Q4_0:
        case KVR_TYPE_Q4_1: { // elements e < 16: low nibble of byte e; else high nibble of byte e-16
            const int e0 = 8 * (int)(g % 4);
            const uint8_t * b = p + (g / 4) * (type == KVR_TYPE_Q4_0 ? 18 : 20);
            const float d = kvr_q_half(b);
            const uint8_t * qs = b + (type == KVR_TYPE_Q4_0 ? 2 : 4);
            for (int j = 0; j < 8; j++) {
                const int e = e0 + j;
                const int q = e < 16 ? qs[e] & 0x0f : qs[e - 16] >> 4;
                y[j] = type == KVR_TYPE_Q4_0 ? (float)(q - 8) * d : (float)q * d + kvr_q_half(b + 2);
            }
            break;
        }
        case KVR_TYPE_MXFP4: { // byte 0 the exponent, then Q4_0's nibble order
            const int e0 = 8 * (int)(g % 4);
            const uint8_t * b = p + (g / 4) * 17;
            const float d = kvr_e8m0_half(b[0]);
            for (int j = 0; j < 8; j++) {
                const int e = e0 + j;
                y[j] = (float)kvr_mxfp4_value(e < 16 ? b[1 + e] & 0x0f : b[1 + e - 16] >> 4) * d;
            }
            break;
        }
        case KVR_TYPE_Q5_0:
        case KVR_TYPE_Q5_1: {
            const int e0 = 8 * (int)(g % 4);
            const bool one = type == KVR_TYPE_Q5_1;
            const uint8_t * b = p + (g / 4) * (one ? 24 : 22);
            const float d = kvr_q_half(b);
            const uint32_t qh = kvr_q_u32le(b + (one ? 4 : 2));
            const uint8_t * qs = b + (one ? 8 : 6);
            for (int j = 0; j < 8; j++) {
                const int e = e0 + j;
                const int q = e < 16 ? (qs[e] & 0x0f) | (int)(((qh >> e) << 4) & 0x10)
                                     : (qs[e - 16] >> 4) | (int)((qh >> 12 >> (e - 16)) & 0x10);
                y[j] = one ? (float)q * d + kvr_q_half(b + 2) : (float)(q - 16) * d;
            }
            break;
        }
        case KVR_TYPE_Q8_0:
        case KVR_TYPE_Q8_1: {
            const int e0 = 8 * (int)(g % 4);
            const bool one = type == KVR_TYPE_Q8_1;
            const uint8_t * b = p + (g / 4) * (one ? 36 : 34);
            const float d = kvr_q_half(b);
            const int8_t * qs = (const int8_t *)(b + (one ? 4 : 2));
            for (int j = 0; j < 8; j++) y[j] = (float)qs[e0 + j] * d;
            break;
        }
        case KVR_TYPE_Q2_K: {
            const struct kvr_block_q2_K * b = (const struct kvr_block_q2_K *)p + g / 32;
            const int e0 = 8 * (int)(g % 32), r = e0 / 16, l0 = e0 % 16;
            const uint8_t * q = b->qs + (r/8)*32 + (r%2)*16 + l0;
            const int shift = 2*((r%8)/2);
            const float dl = kvr_q_half(b->d)    * (float)(b->scales[r] & 0x0f);
            const float ml = kvr_q_half(b->dmin) * (float)(b->scales[r] >>   4);
            for (int j = 0; j < 8; j++) y[j] = dl * (float)((q[j] >> shift) & 3) - ml;
            break;
        }
        case KVR_TYPE_Q3_K: {
            const struct kvr_block_q3_K * b = (const struct kvr_block_q3_K *)p + g / 32;
            const int e0 = 8 * (int)(g % 32), r = e0 / 16, l0 = e0 % 16;
            // scale r alone, as kvr_q3_scales packs it
            const int lo = r < 8 ? b->scales[r] & 0x0f : b->scales[r - 8] >> 4;
            const int sc = lo | (((b->scales[8 + r%4] >> (2*(r/4))) & 3) << 4);
            const uint8_t * q  = b->qs + (r/8)*32 + (r%2)*16 + l0;
            const uint8_t * hm = b->hmask + (r%2)*16 + l0;
            const int shift = 2*((r%8)/2), hbit = r/2;
            const float dl = kvr_q_half(b->d) * (float)(sc - 32);
            for (int j = 0; j < 8; j++) {
                const int v = (int)(((q[j] >> shift) & 3) | (((hm[j] >> hbit) & 1) << 2)) - 4;
                y[j] = dl * (float)v;
            }
            break;
        }
        case KVR_TYPE_Q4_K:
        case KVR_TYPE_Q5_K: {
            const bool five = type == KVR_TYPE_Q5_K;
            const uint8_t * b = p + (g / 32) * (five ? 176 : 144);
            const struct kvr_block_q4_K * b4 = (const struct kvr_block_q4_K *)b; // d, dmin, scales: the same places
            const int e0 = 8 * (int)(g % 32), gg = e0 / 64, hi = (e0 % 64) / 32, l0 = e0 % 32;
            float dl, ml;
            kvr_k4_scale1(b4, 2*gg + hi, &dl, &ml);
            if (five) {
                const struct kvr_block_q5_K * b5 = (const struct kvr_block_q5_K *)b;
                const uint8_t * q = b5->qs + 32*gg + l0, * qh = b5->qh + l0;
                for (int j = 0; j < 8; j++) {
                    const int v = hi ? (q[j] >> 4) | (((qh[j] >> (2*gg + 1)) & 1) << 4) : (q[j] & 0x0f) | (((qh[j] >> (2*gg)) & 1) << 4);
                    y[j] = dl * (float)v - ml;
                }
            } else {
                const uint8_t * q = b4->qs + 32*gg + l0;
                for (int j = 0; j < 8; j++) y[j] = dl * (float)(hi ? q[j] >> 4 : q[j] & 0x0f) - ml;
            }
            break;
        }
        case KVR_TYPE_Q6_K: {
            const struct kvr_block_q6_K * b = (const struct kvr_block_q6_K *)p + g / 32;
            const int e0 = 8 * (int)(g % 32), h = e0 / 128, quarter = (e0 % 128) / 32, l0 = e0 % 32;
            const uint8_t * ql = b->ql + 64*h + (quarter % 2) * 32 + l0, * qh = b->qh + 32*h + l0;
            const float ds = kvr_q_half(b->d) * (float)b->scales[8*h + l0/16 + 2*quarter];
            for (int j = 0; j < 8; j++) {
                const int v = ((quarter < 2 ? ql[j] & 0x0f : ql[j] >> 4) | (((qh[j] >> (2*quarter)) & 3) << 4)) - 32;
                y[j] = ds * (float)v;
            }
            break;
        }
        case KVR_TYPE_Q8_K: {
            const struct kvr_block_q8_K * b = (const struct kvr_block_q8_K *)p + g / 32;
            const int e0 = 8 * (int)(g % 32);
            const float d = kvr_f32_of_bits(kvr_q_u32le(b->d));
            for (int j = 0; j < 8; j++) y[j] = d * (float)b->qs[e0 + j];
            break;
        }
        default: break; // callers check kvr_type_supported first
    }
}

// The KV cache's element math (kvr_cache_type), shared by the CPU's stores and attention kernels
// and the GPU's. A Q8_0 block of 32 values by ggml's x86 rule (quantize_row_q8_0, which llama.cpp
// runs both to store a Q8_0 cache and to quantize the queries its flash attention dots with Q8_0
// keys): d = amax/127 rounded to fp16, q = x * (127/amax) rounded half to even.
static inline KVR_HD void kvr_kv_quant_q8_0(const float * KVR_RESTRICT x, struct kvr_block_q8_0 * KVR_RESTRICT y) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const uint16_t d = kvr_f32_to_half(amax / 127.0f);
    y->d[0] = (uint8_t)(d & 0xff);
    y->d[1] = (uint8_t)(d >> 8);
    for (int j = 0; j < 32; j++) y->qs[j] = (int8_t)rintf(x[j] * id);
}

// Element i of a row of a KV cache type (f32, f16, bf16, q8_0) as f32: the GPU's attention loads its
// key and value tiles with it, an element per thread; the CPU turns whole rows (kvr_kv_rows_to_float).
static inline KVR_HD float kvr_kv_elem(enum kvr_type type, const void * row, int64_t i) {
    const uint8_t * p = (const uint8_t *)row;
    switch (type) {
        case KVR_TYPE_F16:  return kvr_half_to_f32((uint16_t)(p[2*i] | (p[2*i + 1] << 8)));
        case KVR_TYPE_BF16: return kvr_bfloat_to_f32((uint16_t)(p[2*i] | (p[2*i + 1] << 8)));
        case KVR_TYPE_Q8_0: {
            const struct kvr_block_q8_0 * b = (const struct kvr_block_q8_0 *)p + i / 32;
            return kvr_q_half(b->d) * (float)b->qs[i % 32];
        }
        default:            return kvr_f32_of_bits(kvr_q_u32le(p + 4*i));
    }
}

// What ggml's CPU matrix product does to the f32 operand it meets an F16 or BF16 cache with (the
// queries against K, the softmax probabilities against V): it converts them to that type first.
// Other types leave x as it is.
static inline KVR_HD float kvr_kv_operand_round(enum kvr_type type, float x) {
    if (type == KVR_TYPE_F16)  return kvr_half_to_f32(kvr_f32_to_half(x));
    if (type == KVR_TYPE_BF16) return kvr_bfloat_to_f32(kvr_f32_to_bfloat(x));
    return x;
}

// The dot product of a Q8_0 row of n values (n a multiple of 32) with a Q8_0-quantized query, in
// ggml's x86 order (vec_dot_q8_0_q8_0 with AVX2): 8 lanes, lane l of block b the exact integer sum
// of q*q over values 4l..4l+3, accumulated over blocks by a fused multiply-add with the block's two
// scales' product, then the lanes added as hsum_float_8 adds them.
static inline KVR_HD float kvr_kv_dot_q8_0(const struct kvr_block_q8_0 * KVR_RESTRICT k,
                                           const struct kvr_block_q8_0 * KVR_RESTRICT q, int n) {
    float acc[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    for (int b = 0; b < n / 32; b++) {
        const float d = kvr_q_half(k[b].d) * kvr_q_half(q[b].d);
        for (int l = 0; l < 8; l++) {
            int32_t si = 0;
            for (int j = 4 * l; j < 4 * l + 4; j++) si += (int32_t)k[b].qs[j] * (int32_t)q[b].qs[j];
            acc[l] = fmaf(d, (float)si, acc[l]);
        }
    }
    float r[4];
    for (int i = 0; i < 4; i++) r[i] = acc[4 + i] + acc[i];
    return (r[0] + r[2]) + (r[1] + r[3]);
}

// RoPE. Pair i of n_rot/2 rotates dims (2i, 2i+1) (normal) or (i, i + n_rot/2) (NeoX) by the
// angle pos * freq_scale * theta_scale^i, theta_scale = freq_base^(-2/n_rot). The power is a
// running product from pos, as GGML steps it (not powf per pair), so angles carry GGML's bits.
static inline KVR_HD float kvr_rope_theta_scale(float freq_base, int n_rot) {
    return powf(freq_base, -2.0f / (float)n_rot);
}

// theta of pair i before freq_scale: the CPU steps it across pairs, a GPU thread loops to its pair
static inline KVR_HD float kvr_rope_theta(int32_t pos, float theta_scale, int i) {
    float theta = (float)pos;
    for (int k = 0; k < i; k++) theta *= theta_scale;
    return theta;
}

static inline KVR_HD void kvr_rope_dims(int mode, int n_rot, int i, int * i0, int * i1) {
    *i0 = mode == KVR_ROPE_NEOX ? i : 2 * i;
    *i1 = mode == KVR_ROPE_NEOX ? i + n_rot / 2 : 2 * i + 1;
}

// the angle of pair i: theta divided by the pair's frequency factor (freqs NULL: none) and scaled,
// in GGML's order (rope_yarn)
static inline KVR_HD float kvr_rope_angle(float theta, const float * freqs, int i, float freq_scale) {
    return (freqs ? theta / freqs[i] : theta) * freq_scale;
}

// cos and sin of pair i (of theta, the angle before freq_scale, divided by the pair's factor),
// with YaRN's ramp between the interpolated and the plain angle where ext_factor is not 0, times
// mscale (and YaRN's magnitude correction): ggml's rope_yarn, its products fused as GCC fuses them
// there. ext_factor 0 and mscale 1 give kvr_rope_angle's angle and plain cos and sin.
static inline KVR_HD void kvr_rope_yarn_cs(float theta, float freq_scale, float ext_factor, float mscale,
                                           float corr_lo, float corr_hi, int i, float * c, float * s) {
    const float interp = freq_scale * theta;
    float angle = interp;
    if (ext_factor != 0.0f) {
        const float y = ((float)i - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo);
        const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
        angle = fmaf(interp, 1.0f - ramp, theta * ramp);
        mscale *= fmaf(0.1f, logf(1.0f / freq_scale), 1.0f);
    }
    *c = cosf(angle) * mscale;
    *s = sinf(angle) * mscale;
}

// (x0, x1) rotated by the angle whose cosine and sine are c and s. The first product of each
// output is fused with the sum, as GCC compiles GGML's rotation (its -ffp-contract=fast, the
// default of the GNU modes llama.cpp builds in), so the rotated values carry llama.cpp's bits.
static inline KVR_HD void kvr_rope_rotate(float x0, float x1, float c, float s, float * y0, float * y1) {
    *y0 = fmaf(x0, c, -(x1 * s));
    *y1 = fmaf(x0, s, x1 * c);
}

// GELU as GGML computes it on the CPU, because llama.cpp's outputs are our reference: the input
// rounded to fp16, the tanh approximation of that rounded to fp16, the tails (x <= -10: 0,
// x >= 10: x) passed through. kvr_gelu_half is the value for one fp16 input; kvr_gelu_ggml takes a
// table of all 65536 of them (the CPU's, or the GPU's copy of it) or NULL to compute the value.
static inline KVR_HD uint16_t kvr_gelu_half(uint16_t h) {
    const float c = 0.79788456080286535588f; // sqrt(2/pi)
    const float v = kvr_half_to_f32(h);
    // 1 + a v^2 as fma(a v, v, 1): GCC contracts GGML's expression so, and the table holds those bits
    return kvr_f32_to_half(0.5f * v * (1.0f + tanhf(c * v * fmaf(0.044715f * v, v, 1.0f))));
}

static inline KVR_HD float kvr_gelu_ggml(float x, const uint16_t * table) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const uint16_t h = kvr_f32_to_half(x);
    return kvr_half_to_f32(table ? table[h] : kvr_gelu_half(h));
}

// The same tanh approximation in f32 with no fp16 step (GGML's ggml_gelu_f32, as GCC contracts it):
// what GGML computes without GGML_GELU_FP16, and its GPU backends.
static inline KVR_HD float kvr_gelu_tanh(float x) {
    const float c = 0.79788456080286535588f; // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * x * fmaf(0.044715f * x, x, 1.0f)));
}

// Soft-capping (Gemma 2's attention scores and logits): cap * tanh(x / cap), in llama.cpp's steps
// (a scale by 1/cap, tanh, a scale by cap); cap <= 0 leaves x as it is.
static inline KVR_HD float kvr_softcap_f32(float x, float cap) {
    return cap > 0.0f ? tanhf(x * (1.0f / cap)) * cap : x;
}

// The online softmax of attention, one row: a running max m and a running sum l of exp(s - m).
// A tile of scores whose max is tile_max moves the max first (kvr_softmax_max); the caller then
// sums exp(s - m_new) over the tile and kvr_softmax_step folds that sum in, returning the factor
// the row's running output must be scaled by (0 while m was still -inf, 1 when the max stayed).
static inline KVR_HD float kvr_softmax_max(float m, float tile_max) {
    return tile_max > m ? tile_max : m;
}

static inline KVR_HD float kvr_softmax_step(float * m, float * l, float m_new, float tile_sum) {
    const float corr = expf(*m - m_new); // 0 when *m is -inf
    *l = *l * corr + tile_sum;
    *m = m_new;
    return corr;
}

// The end of a row: the output is scaled by *inv, and its log-sum-exp is *lse. A row that saw no
// key (l == 0) has output 0 (*inv = 0) and lse -inf.
static inline KVR_HD void kvr_softmax_finish(float m, float l, float * inv, float * lse) {
    if (l > 0.0f) {
        *inv = 1.0f / l;
        *lse = m + logf(l);
    } else {
        *inv = 0.0f;
        *lse = -INFINITY;
    }
}

// Merging partial attention outputs of the same queries: with m the largest partial lse, part i
// weighs exp(lse_i - m) (0 for an empty part); the merged output is sum_i w_i O_i / sum_i w_i and
// the merged lse is m + log(sum_i w_i).
static inline KVR_HD float kvr_lse_weight(float lse_i, float m) {
    return lse_i == -INFINITY ? 0.0f : expf(lse_i - m);
}

static inline KVR_HD float kvr_lse_merged(float m, float sum) {
    return m + logf(sum);
}

// Attention tiles, the same for the CPU and the GPU kernels: the query heads that share one KV
// head (GQA/MQA) are processed together, a query tile is KVR_ATTN_ROWS / group tokens (at least
// one), a key tile KVR_ATTN_BK keys. Key kp is visible to query qp when kp <= qp and, with a
// sliding window (window > 0), qp - kp < window. kvr_attn_tile says what a tile needs from the
// extreme positions of its queries and keys: 0 skip (causal mode: every key after every query, or
// before the window of every query), 1 compute with every key visible, 2 compute and mask.
#define KVR_ATTN_ROWS 256
#define KVR_ATTN_BK   256

static inline KVR_HD int64_t kvr_attn_tile_tokens(int64_t group) {
    return group >= KVR_ATTN_ROWS ? 1 : KVR_ATTN_ROWS / group;
}

static inline KVR_HD bool kvr_attn_visible(int32_t qp, int32_t kp, int64_t window) {
    return kp <= qp && (window <= 0 || (int64_t)qp - kp < window);
}

static inline KVR_HD int kvr_attn_tile(int mode, int32_t qmin, int32_t qmax, int32_t kmin, int32_t kmax, int64_t window) {
    if (mode == KVR_ATTN_CAUSAL && (kmin > qmax || (window > 0 && (int64_t)qmin - kmax >= window))) return 0;
    return kmax > qmin || (window > 0 && (int64_t)qmax - kmin >= window) ? 2 : 1;
}

// Gated DeltaNet (Qwen3.5's linear attention), in GGML's f32 arithmetic: sigmoid and softplus as
// its unary ops, the L2 norm of q and k as llama.cpp forms it (an RMS norm with eps/n, then a
// scale by 1/sqrt(n)), and one step of one row of a head's state.
static inline KVR_HD float kvr_sigmoid_f32(float x)  { return 1.0f / (1.0f + expf(-x)); }
static inline KVR_HD float kvr_softplus_f32(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

// one output of the short convolution: the taps over the window of K inputs, oldest first, summed
// in order (ggml_ssm_conv's f32 sum), then SiLU
#define KVR_SSM_CONV_MAX_K 16
static inline KVR_HD float kvr_ssm_conv_out(const float * win, const float * w, int K) {
    float sum = 0.0f;
    for (int k = 0; k < K; k++) sum += win[k] * w[k];
    return sum / (1.0f + expf(-sum));
}

static inline KVR_HD void kvr_gdn_l2_norm(const float * x, float * y, int n, float eps) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float scale = 1.0f / sqrtf((float)(sum / n) + eps / (float)n), post = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) y[i] = x[i] * scale * post;
}

// Row j of a value head's transposed state (the column S[:, j], n = d_k floats) through one token:
// it decays by eg = e^g, d = beta (v_j - S[:, j].k), S[:, j] += d k; returns S[:, j].q (the output
// before its 1/sqrt(d_k)). The rows of a head are independent: a GPU thread can take one.
static inline KVR_HD float kvr_gdn_row(float * s, const float * k, const float * q, int n, float eg, float beta, float v) {
    float kd = 0.0f;
    for (int i = 0; i < n; i++) {
        s[i] *= eg;
        kd += s[i] * k[i];
    }
    const float d = (v - kd) * beta;
    float o = 0.0f;
    for (int i = 0; i < n; i++) {
        s[i] += k[i] * d;
        o += s[i] * q[i];
    }
    return o;
}

#ifdef KVR_CUDA
// kvr-cuda.cu: the pairs its attention kernel's counters will report for these positions (dense:
// computed, causal: needed; KV head 0, as struct kvr_counters counts them), worked out on the host
// with the kernel's own grid and tile functions. tests/test-cuda-host.cu compares them with the
// CPU kernel's counters.
void kvr_cuda_attn_count(const int32_t * qpos, int64_t Tq, const int32_t * kpos, int64_t Tk, int H, int Hkv,
                         int mode, int64_t window, int64_t * dense, int64_t * causal);
// kvr-cuda.cu: the one-token matmul kernel's warp (k_dot8) run on the host for one weight row of
// type `type` and K elements against T <= 8 tokens (x, row stride ldx): its lanes as an array, its
// shuffles' sums in their order, its wide weight loads when w_vec (the row 16-byte aligned; F16,
// BF16, Q4_K). y[t] is what the kernel writes for token t.
// kvr-cuda.cu: the tensor-core attention kernel (k_fattn) run on the host for head dim D (64, 80,
// 96, 128 or 256): q f32 [Tq][H][D], k and v F16 bits [Tk][Hkv][D], out [Tq][H*D + H] as ATTN's
// result. And the pairs its schedule computes as visible: cover[(h*Tq + i)*Tk + j] (H*Tq*Tk counts).
void kvr_cuda_fattn_emulate(int D, const float * q, const uint16_t * k, const uint16_t * v, const int32_t * qpos,
                            const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int mode, int64_t window, float scale,
                            float * out);
void kvr_cuda_fattn_pairs(int D, const int32_t * qpos, const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int mode,
                          int64_t window, int32_t * cover);
// kvr-cuda.cu: decode attention split over the keys (k_fdec, then k_fdec_merge) run on the host,
// layouts as above (causal); returns the number of splits (0: the kernel does not take this
// shape, out untouched). And split s of n's keys, [*j0, *j1).
int  kvr_cuda_fdec_emulate(int D, const float * q, const uint16_t * k, const uint16_t * v, const int32_t * qpos,
                           const int32_t * kpos, int H, int Hkv, int Tq, int Tk, int64_t window, float scale, float * out);
void kvr_cuda_fdec_split(int64_t Tk, int n, int s, int64_t * j0, int64_t * j1);
void kvr_cuda_dot8_emulate(enum kvr_type type, const void * row, int64_t K, const float * x, int64_t ldx, int T,
                           bool w_vec, float * y);
// kvr-cuda.cu: a prompt's MUL_MAT_ID slots (T tokens, k picks each) sorted by expert from a route
// (rows of ld floats: k weights, then k expert ids): order[r] = t * k + j, expert[r] its expert,
// offsets[e] .. offsets[e + 1] expert e's run (E + 1 entries); a stable sort. KVR_ERR_ARG for an id
// that is not one of the E experts. And the grouped product run on the host with the kernels' index
// arithmetic (gather, one product per expert's run, scatter): w f32 [E][N][K], x as MUL_MAT_ID takes
// it (ne, nb in bytes), route [T][2k], bias f32 [E][N] or NULL, y [T][k][N].
int kvr_cuda_moe_group(const float * route, int64_t ld, int64_t T, int64_t k, int64_t E, int32_t * order, int32_t * expert,
                       int64_t * offsets);
int kvr_cuda_moe_grouped_emulate(const float * w, int64_t K, int64_t N, int64_t E, const float * x, const int64_t x_ne[4],
                                 const int64_t x_nb[4], const float * route, int64_t k, int64_t T, const float * bias,
                                 float * y);
#endif

#endif // KVR_BUILD

#ifdef __cplusplus
}
#endif

#endif // KVR_H
