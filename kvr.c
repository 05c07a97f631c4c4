// kvr.c - the single-rank runtime: a GGUF model loaded, its graph built and run on the CPU (and the
// seam every other backend plugs into). The architecture recipes live in models/*.c and are
// compiled as part of this file (section "models"); the session, the front door every prefill and
// decode goes through, is kvr-comm.c's, so an application embeds kvr.h, kvr.c (+ models/) and
// kvr-comm.c. The sections come in dependency order (each uses only those above it), not in
// kvr.h's; other files cite both by name:
//
//    1. errors                      the thread's last error message; files read and written whole
//    2. half precision              fp16 and bf16 conversions
//    3. types                       block sizes and names of every element type
//    4. quantized types             GGML's block layouts, dequantization, the reference quantizers
//    5. row conversion              any supported type to f32 and back, one dispatch
//    6. tensors and contexts        arenas of tensor structs, views, reshapes
//    7. ops                         constructors: they record an op and its sources, nothing more
//    8. graphs                      build, memory planning, the single-rank strategy pass
//    9. backends                    buffers, tensors in and out, the comm protocol, backends by name
//   10. CPU kernels                 plain reference kernels (KVR_REF=1), then the fast ones; one dispatch switch
//   11. CPU backend                 the thread pool walking a graph, the vtable, counters and spans
//   12. GGUF reader                 every count, length and offset checked before use
//   13. GGUF writer                 metadata and tensors out (kvr-gen, tests)
//   14. tokenizers                  SPM and byte-level BPE, exactly as llama.cpp's; chat templates
//   15. KV cache                    per-layer K and V of a session or rank
//   16. KV cache files              the cache on disk (a writer fed layer by layer, a reader that checks all)
//   17. models                      hyper-parameters, weights, the architectures' recipes (models/)
//   18. eval road                   one batch through a model on a backend: every rank's eval
//   19. sampling                    greedy, temperature, top-k, top-p
//   20. appendix: generated tables  the Unicode classes the BPE pre-tokenizers need
//
// Reading order for one prefill: kvr_session_eval (kvr-comm.c) -> rank_eval (kvr-comm.c) ->
// kvr_eval_run (18) -> kvr_model_build (17, models/llama.c) -> kvr_pass_single (8) -> kvr_graph_plan (8) ->
// kvr_backend_graph_compute (9, the comm protocol) -> cpu_graph_compute (11) -> cpu_compute_node
// (10) -> cpu_op_* (10), or ref_* (10) under KVR_REF=1.

#define _GNU_SOURCE
#define STB_DS_IMPLEMENTATION
#if defined(__GNUC__) && !defined(__clang__) && !defined(typeof)
#define typeof __typeof__ // stb_ds spells it so; strict C11 has only the GNU spelling
#endif
#include <stb/stb_ds.h>

#define KVR_BUILD   // kvr.h's internal section: the shared per-element math
#include "kvr.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#ifdef __linux__
#include <sys/random.h>
#endif
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// OpenBLAS exposes these; we set it to 1 so each of our threads runs its own sgemm on its slice,
// and ask which kernels it picked (kvr_blas_reexec).
extern void   openblas_set_num_threads(int n);
extern char * openblas_get_corename(void);

//
// 1. errors
//

// Room for a message naming a path of PATH_MAX bytes and what was wrong in it.
static _Thread_local char kvr_errbuf[8192];

const char * kvr_last_error(void) {
    return kvr_errbuf;
}

int kvr_error(int code, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvr_errbuf, sizeof(kvr_errbuf), fmt, ap);
    va_end(ap);
    return code;
}

int kvr_error_prefix(int code, const char * fmt, ...) {
    char last[sizeof(kvr_errbuf)];
    snprintf(last, sizeof(last), "%s", kvr_errbuf);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(kvr_errbuf, sizeof(kvr_errbuf), fmt, ap);
    va_end(ap);
    // then ": " and as much of the old message as fits (a too long context keeps its start)
    size_t at = n < 0 ? 0 : (size_t)n < sizeof(kvr_errbuf) ? (size_t)n : sizeof(kvr_errbuf) - 1;
    const char * tail[2] = { ": ", last };
    for (int k = 0; k < 2; k++) {
        const size_t len = strlen(tail[k]), room = sizeof(kvr_errbuf) - 1 - at;
        const size_t c = len < room ? len : room;
        memcpy(kvr_errbuf + at, tail[k], c);
        at += c;
    }
    kvr_errbuf[at] = 0;
    return code;
}

void kvr_abort(const char * file, int line, const char * expr) {
    fprintf(stderr, "kvr: %s:%d: assertion failed: %s\n", file, line, expr);
    fflush(stderr);
    abort();
}

double kvr_time_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

void * kvr_malloc(size_t n) {
    void * p = malloc(n ? n : 1);
    KVR_ASSERT(p != NULL && "out of memory");
    return p;
}

void * kvr_calloc(size_t n, size_t sz) {
    void * p = calloc(n ? n : 1, sz ? sz : 1);
    KVR_ASSERT(p != NULL && "out of memory");
    return p;
}

// files (kvr.h, after "errors"): the one way in for reading and the one way out for writing

const char * kvr_file_kind(unsigned int st_mode) {
    const mode_t mode = (mode_t)st_mode;
    if (S_ISLNK(mode))  return "a symbolic link";
    if (S_ISDIR(mode))  return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode))  return "a character device";
    if (S_ISBLK(mode))  return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "a special file";
}

FILE * kvr_file_read(const char * path) {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever if none
    // comes; the fstat then refuses it (and anything else that is not a plain file)
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        kvr_error(KVR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st = { 0 };
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        kvr_error(KVR_ERR_IO, "%s: %s, not a regular file: only files are read", path, kvr_file_kind(st.st_mode));
        close(fd);
        return NULL;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    FILE * f = fdopen(fd, "rb");
    if (!f) {
        kvr_error(KVR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

int kvr_file_check_target(const char * path) {
    struct stat st;
    if (!*path) return kvr_error(KVR_ERR_ARG, "an empty path cannot be written");
    // lstat: a link is refused itself, whatever it points to (the rename would replace the link,
    // a writer that followed it would write where its planter chose)
    if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        return kvr_error(KVR_ERR_ARG, "%s: %s, not a regular file: a file is written beside it, then renamed onto its path",
                         path, kvr_file_kind(st.st_mode));
    }
    return KVR_OK;
}

struct kvr_file {
    FILE * f;
    char * path;
    char * temp;
};

// a name nobody can guess ahead (O_EXCL makes a taken one safe; this makes one unlikely)
static uint64_t file_nonce(void) {
    static atomic_uint_fast64_t counter;
    uint64_t x = 0;
#ifdef __linux__
    if (getrandom(&x, sizeof(x), GRND_NONBLOCK) != (ssize_t)sizeof(x)) x = 0;
#endif
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    x ^= (uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 30 ^ (uint64_t)getpid() << 40;
    x += (uint64_t)atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull; // splitmix64's finish
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Is name BASE.<12 lowercase hex>.part, a temporary kvr_file_create makes for the target BASE?
static bool file_is_temp_of(const char * name, const char * base, size_t base_len) {
    if (strncmp(name, base, base_len) != 0 || name[base_len] != '.') return false;
    const char * h = name + base_len + 1;
    for (int i = 0; i < 12; i++) {
        if (!((h[i] >= '0' && h[i] <= '9') || (h[i] >= 'a' && h[i] <= 'f'))) return false;
    }
    return strcmp(h + 12, ".part") == 0;
}

// A writer holds an exclusive flock on its temporary from just after creating it until the
// rename or the removal: a temporary nobody holds is a dead writer's (killed before its commit or
// abort) and is removed here, before a new writer of the same target makes its own, so they do not
// pile up. Only what this user would have made is touched: a regular file it owns with one link,
// opened without following a link (a planted link, or a hard link to another file, stays), locked
// without waiting, and unlinked only while it still is the entry that was opened. A live writer
// that has not locked its new temporary yet may lose it here; it sees that and makes another
// (kvr_file_create). Best effort: whatever fails leaves the entry where it is.
static void file_sweep_temps(const char * path) {
    const char * slash = strrchr(path, '/');
    const char * base = slash ? slash + 1 : path;
    const size_t base_len = strlen(base);
    char dir[PATH_MAX];
    if (!slash) snprintf(dir, sizeof(dir), ".");
    else if (slash == path) snprintf(dir, sizeof(dir), "/");
    else if ((size_t)(slash - path) < sizeof(dir)) snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    else return;
    const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;
    const int lfd = dup(dfd); // closedir closes the one it reads
    DIR * dp = lfd >= 0 ? fdopendir(lfd) : NULL;
    if (!dp) {
        if (lfd >= 0) close(lfd);
        close(dfd);
        return;
    }
    const uid_t me = geteuid();
    for (struct dirent * e; (e = readdir(dp)) != NULL; ) {
        if (!file_is_temp_of(e->d_name, base, base_len)) continue;
        struct stat st, now;
        // nothing but this user's regular files is even opened (an open of a device can act)
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != me) continue;
        const int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0) continue;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == me && st.st_nlink == 1 &&
            flock(fd, LOCK_EX | LOCK_NB) == 0 &&
            fstatat(dfd, e->d_name, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
            unlinkat(dfd, e->d_name, 0);
        }
        close(fd); // drops the lock
    }
    closedir(dp);
    close(dfd);
}

int kvr_file_create(struct kvr_file ** out, const char * path) {
    *out = NULL;
    int rc = kvr_file_check_target(path);
    if (rc != KVR_OK) return rc;
    file_sweep_temps(path);
    const size_t cap = strlen(path) + 32;
    char * temp = kvr_malloc(cap);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 100; tries++) {
        snprintf(temp, cap, "%s.%012" PRIx64 ".part", path, file_nonce() & UINT64_C(0xffffffffffff));
        fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (fd < 0 && errno != EEXIST) break;
        if (fd < 0) continue;
        // held until the rename or the removal: a sweep by another writer passes this one over. A
        // sweep that came between the open and the lock unlinked it: then another name
        // (on a filesystem without flock no sweep can lock it either, so it is kept)
        struct stat st;
        const bool taken = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        if (taken || (fstat(fd, &st) == 0 && st.st_nlink == 0)) {
            close(fd);
            fd = -1;
        }
    }
    FILE * f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot create a file beside it to write: %s", path, strerror(errno));
        if (fd >= 0) {
            close(fd);
            unlink(temp);
        }
        free(temp);
        return rc;
    }
    struct kvr_file * kf = kvr_calloc(1, sizeof(*kf));
    kf->f = f;
    kf->path = strdup(path);
    kf->temp = temp;
    KVR_ASSERT(kf->path != NULL);
    *out = kf;
    return KVR_OK;
}

FILE * kvr_file_stream(struct kvr_file * f) { return f->f; }

const char * kvr_file_temp_path(const struct kvr_file * f) { return f->temp; }

const char * kvr_file_target_path(const struct kvr_file * f) { return f->path; }

void kvr_file_abort(struct kvr_file * f) {
    if (!f) return;
    unlink(f->temp); // while the lock is held: no sweep can have removed it, nor another writer taken its name
    if (f->f) fclose(f->f);
    free(f->path);
    free(f->temp);
    free(f);
}

// a renamed file's new name is durable once its directory is synced
static void file_sync_dir(const char * path) {
    const char * slash = strrchr(path, '/');
    char dir[PATH_MAX];
    if (!slash) snprintf(dir, sizeof(dir), ".");
    else if (slash == path) snprintf(dir, sizeof(dir), "/");
    else snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int kvr_file_commit(struct kvr_file * f) {
    int rc = KVR_OK;
    errno = 0;
    // a write that failed earlier (a full disk) left the stream's error flag set: errno then
    // still names why, unless the flush failed again and says it anew
    if (fflush(f->f) != 0 || ferror(f->f)) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot write: %s", f->path, strerror(errno ? errno : EIO));
    } else if (fsync(fileno(f->f)) != 0) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot sync to disk: %s", f->path, strerror(errno));
    }
    if (rc == KVR_OK) rc = kvr_file_check_target(f->path);
    // renamed while its lock is held (the stream open): a sweep never takes a temporary about to be renamed
    if (rc == KVR_OK && rename(f->temp, f->path) != 0) {
        rc = kvr_error(KVR_ERR_IO, "%s: cannot rename %s onto it: %s", f->path, f->temp, strerror(errno));
    }
    if (rc != KVR_OK) {
        kvr_file_abort(f);
        return rc;
    }
    fclose(f->f); // flushed and synced above: nothing is left for the close to lose
    file_sync_dir(f->path);
    free(f->path);
    free(f->temp);
    free(f);
    return KVR_OK;
}

//
// 2. half precision
//

// The conversions themselves are kvr.h's internal KVR_HD functions (the CUDA kernels run the same).
float    kvr_fp16_to_fp32(uint16_t h) { return kvr_half_to_f32(h); }
uint16_t kvr_fp32_to_fp16(float f)    { return kvr_f32_to_half(f); }
float    kvr_bf16_to_fp32(uint16_t h) { return kvr_bfloat_to_f32(h); }
uint16_t kvr_fp32_to_bf16(float f)    { return kvr_f32_to_bfloat(f); }

//
// 3. types
//

struct type_traits {
    const char * name;
    int64_t      blck_size;
    size_t       type_size;
};

// Every type GGUF files use that kvr knows the block layout of. Block sizes and bytes per block
// are GGML's; the quantized layouts themselves live in the quantization section below.
static const struct type_traits type_traits[KVR_TYPE_COUNT] = {
    [KVR_TYPE_F32]  = { "f32",  1,   4   },
    [KVR_TYPE_F16]  = { "f16",  1,   2   },
    [KVR_TYPE_Q4_0] = { "q4_0", 32,  18  },
    [KVR_TYPE_Q4_1] = { "q4_1", 32,  20  },
    [KVR_TYPE_Q5_0] = { "q5_0", 32,  22  },
    [KVR_TYPE_Q5_1] = { "q5_1", 32,  24  },
    [KVR_TYPE_Q8_0] = { "q8_0", 32,  34  },
    [KVR_TYPE_Q8_1] = { "q8_1", 32,  36  },
    [KVR_TYPE_Q2_K] = { "q2_K", 256, 84  },
    [KVR_TYPE_Q3_K] = { "q3_K", 256, 110 },
    [KVR_TYPE_Q4_K] = { "q4_K", 256, 144 },
    [KVR_TYPE_Q5_K] = { "q5_K", 256, 176 },
    [KVR_TYPE_Q6_K] = { "q6_K", 256, 210 },
    [KVR_TYPE_Q8_K] = { "q8_K", 256, 292 },
    [KVR_TYPE_I8]   = { "i8",   1,   1   },
    [KVR_TYPE_I16]  = { "i16",  1,   2   },
    [KVR_TYPE_I32]  = { "i32",  1,   4   },
    [KVR_TYPE_I64]  = { "i64",  1,   8   },
    [KVR_TYPE_F64]  = { "f64",  1,   8   },
    [KVR_TYPE_BF16] = { "bf16", 1,   2   },
    [KVR_TYPE_MXFP4] = { "mxfp4", 32, 17 },
};

static bool type_known(enum kvr_type t) {
    return (unsigned)t < KVR_TYPE_COUNT && type_traits[t].blck_size > 0;
}

int64_t kvr_blck_size(enum kvr_type t) { return type_known(t) ? type_traits[t].blck_size : 0; }
size_t  kvr_type_size(enum kvr_type t) { return type_known(t) ? type_traits[t].type_size : 0; }
const char * kvr_type_name(enum kvr_type t) { return type_known(t) ? type_traits[t].name : "?"; }

size_t kvr_row_size(enum kvr_type t, int64_t ne0) {
    KVR_ASSERT(type_known(t) && ne0 % type_traits[t].blck_size == 0);
    return (size_t)(ne0 / type_traits[t].blck_size) * type_traits[t].type_size;
}

// The bytes of a tensor of a known type and shape ne (each >= 0, ne[0] whole blocks) into *out;
// false where a product overflows (blocks times the block's bytes, then times each further
// dimension): a file's shape must not wrap to a small size that passes its bounds checks.
static bool tensor_bytes(enum kvr_type type, const int64_t ne[KVR_MAX_DIMS], size_t * out) {
    const uint64_t block = type_traits[type].type_size;
    uint64_t bytes = (uint64_t)(ne[0] / type_traits[type].blck_size);
    if (block && bytes > SIZE_MAX / block) return false;
    bytes *= block;
    for (int d = 1; d < KVR_MAX_DIMS; d++) {
        if (ne[d] > 0 && bytes > SIZE_MAX / (uint64_t)ne[d]) return false;
        bytes *= (uint64_t)ne[d];
    }
    *out = (size_t)bytes;
    return true;
}

//
// 4. quantized types: block layouts and their conversion to f32
//

// GGML's block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, the k-quants Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, Q8_K, and MXFP4. Their byte layouts and the dequantization of one block live in kvr.h's internal
// section (struct kvr_block_*, kvr_dequant_*: plain loops with fixed trip counts), shared with the
// CUDA kernels; here they run over rows, each per-block function inlined into a loop the compiler
// vectorizes (a matmul dequantizes each weight row once and reuses it over every token). Then the
// reference quantizers for the types kvr writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), which
// reproduce ggml's *_ref quantizers decision for decision so that the files we write read the
// same in llama.cpp; and one table, quant_traits_table, that the type functions below dispatch
// to through quant_get().
//
// Layouts and math follow ggml (ggml-common.h, ggml-quants.c); the code is our own.
// Dequantization multiplies in the same order as ggml so results are bit-identical to ggml built
// with the same contraction flags.

static inline void q_set_half(uint8_t * p, float f) {
    const uint16_t h = kvr_fp32_to_fp16(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

//
// dequantization of rows
//

#define Q_TO_FLOAT(name, QK) \
    static void q_to_float_##name(const void * src, float * restrict dst, int64_t n) { \
        const struct kvr_block_##name * restrict b = src; \
        for (int64_t i = 0; i < n/(QK); i++, dst += (QK)) kvr_dequant_##name(b + i, dst); \
    }
Q_TO_FLOAT(q4_0, KVR_QK)
Q_TO_FLOAT(q4_1, KVR_QK)
Q_TO_FLOAT(q5_0, KVR_QK)
Q_TO_FLOAT(q5_1, KVR_QK)
Q_TO_FLOAT(q8_0, KVR_QK)
Q_TO_FLOAT(q8_1, KVR_QK)
Q_TO_FLOAT(q2_K, KVR_QK_K)
Q_TO_FLOAT(q3_K, KVR_QK_K)
Q_TO_FLOAT(q4_K, KVR_QK_K)
Q_TO_FLOAT(q5_K, KVR_QK_K)
Q_TO_FLOAT(q6_K, KVR_QK_K)
Q_TO_FLOAT(q8_K, KVR_QK_K)
Q_TO_FLOAT(mxfp4, KVR_QK)
#undef Q_TO_FLOAT

//
// quantization (ggml's reference quantizers, the ones llama.cpp uses without an importance matrix)
//

static inline float q_maxf(float a, float b) { return a > b ? a : b; }

// Round to nearest, ties to even, for |f| < 2^22: adding 1.5*2^23 leaves the integer in the
// mantissa. Same rounding as ggml's helper, so quantizer decisions match bit for bit.
static inline int q_nearest_int(float f) {
    const float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int q_clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static size_t q_from_float_q8_0(const float * x, void * dst, int64_t n) {
    struct kvr_block_q8_0 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        float amax = 0.0f;
        for (int j = 0; j < KVR_QK; j++) {
            amax = q_maxf(amax, fabsf(x[j]));
        }
        const float d  = amax / 127;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        for (int j = 0; j < KVR_QK; j++) {
            y->qs[j] = (int8_t)roundf(x[j]*id);
        }
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_q8_0);
}

// MXFP4 as ggml's reference quantizer: the exponent puts the block's largest magnitude in [4, 8)
// times 2^(e-128) (8 is the largest doubled value but 12), then each value takes the code of the
// nearest representable value, the first of equals (so +0 before -0, as ggml's search).
static size_t q_from_float_mxfp4(const float * x, void * dst, int64_t n) {
    struct kvr_block_mxfp4 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        float amax = 0.0f;
        for (int j = 0; j < KVR_QK; j++) amax = q_maxf(amax, fabsf(x[j]));
        y->e = amax > 0.0f ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0;
        const float d = kvr_e8m0_half(y->e);
        for (int j = 0; j < KVR_QK; j++) {
            int best = 0;
            float err = fabsf((float)kvr_mxfp4_value(0) * d - x[j]);
            for (int c = 1; c < 16; c++) {
                const float e = fabsf((float)kvr_mxfp4_value(c) * d - x[j]);
                if (e < err) { best = c; err = e; }
            }
            if (j < KVR_QK/2) y->qs[j] = (uint8_t)best;
            else              y->qs[j - KVR_QK/2] |= (uint8_t)(best << 4);
        }
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_mxfp4);
}

// The value of largest magnitude, with its sign (the first one on ties).
static inline float q_signed_absmax(const float * x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max  = x[j];
        }
    }
    return max;
}

static size_t q_from_float_q4_0(const float * x, void * dst, int64_t n) {
    struct kvr_block_q4_0 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        // the extreme value maps to -8, so the full range [-8, 7] is used on the wider side
        const float d  = q_signed_absmax(x, KVR_QK) / -8;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        for (int j = 0; j < KVR_QK/2; j++) {
            // truncation of v + 8.5 (v >= -8) is rounding half up; 16 clamps to 15
            const int q0 = (int8_t)(x[j]*id + 8.5f);
            const int q1 = (int8_t)(x[j + KVR_QK/2]*id + 8.5f);
            y->qs[j] = (uint8_t)((q0 < 15 ? q0 : 15) | ((q1 < 15 ? q1 : 15) << 4));
        }
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_q4_0);
}

static inline void q_minmax(const float * x, int n, float * mn, float * mx) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < n; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo; *mx = hi;
}

static size_t q_from_float_q4_1(const float * x, void * dst, int64_t n) {
    struct kvr_block_q4_1 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        float mn, mx;
        q_minmax(x, KVR_QK, &mn, &mx);
        const float d  = (mx - mn) / 15;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        q_set_half(y->m, mn);
        for (int j = 0; j < KVR_QK/2; j++) {
            const int q0 = (int8_t)((x[j] - mn)*id + 0.5f);
            const int q1 = (int8_t)((x[j + KVR_QK/2] - mn)*id + 0.5f);
            y->qs[j] = (uint8_t)((q0 < 15 ? q0 : 15) | ((q1 < 15 ? q1 : 15) << 4));
        }
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_q4_1);
}

static inline void q_store_u32le(uint8_t * p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

static size_t q_from_float_q5_0(const float * x, void * dst, int64_t n) {
    struct kvr_block_q5_0 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        const float d  = q_signed_absmax(x, KVR_QK) / -16;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        uint32_t qh = 0;
        for (int j = 0; j < KVR_QK/2; j++) {
            int q0 = (int8_t)(x[j]*id + 16.5f);
            int q1 = (int8_t)(x[j + KVR_QK/2]*id + 16.5f);
            q0 = q0 < 31 ? q0 : 31;
            q1 = q1 < 31 ? q1 : 31;
            y->qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + KVR_QK/2);
        }
        q_store_u32le(y->qh, qh);
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_q5_0);
}

static size_t q_from_float_q5_1(const float * x, void * dst, int64_t n) {
    struct kvr_block_q5_1 * y = dst;
    for (int64_t i = 0; i < n/KVR_QK; i++, y++, x += KVR_QK) {
        float mn, mx;
        q_minmax(x, KVR_QK, &mn, &mx);
        const float d  = (mx - mn) / 31;
        const float id = d != 0.0f ? 1.0f/d : 0.0f;
        q_set_half(y->d, d);
        q_set_half(y->m, mn);
        uint32_t qh = 0;
        for (int j = 0; j < KVR_QK/2; j++) {
            const int q0 = (uint8_t)((x[j] - mn)*id + 0.5f);
            const int q1 = (uint8_t)((x[j + KVR_QK/2] - mn)*id + 0.5f);
            y->qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= (uint32_t)((q0 >> 4) & 1) << j;
            qh |= (uint32_t)((q1 >> 4) & 1) << (j + KVR_QK/2);
        }
        q_store_u32le(y->qh, qh);
    }
    return (size_t)(n/KVR_QK) * sizeof(struct kvr_block_q5_1);
}

// Fit x ~ scale*L - min (L in 0..nmax, min >= 0) minimizing the weighted squared error: start from
// the full range, then try nstep+1 other grids and keep the best least-squares fit (ggml's
// make_qkx2_quants with use_mad = false). Returns the scale; *the_min gets the min.
static float quant_fit_scale_min(int n, int nmax, const float * x, const float * w, uint8_t * L,
                                 float * the_min, uint8_t * Laux, float rmin, float rdelta, int nstep) {
    float mn = x[0], mx = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx == mn) {
        memset(L, 0, (size_t)n);
        *the_min = -mn;
        return 0.0f;
    }
    float iscale = nmax/(mx - mn);
    float scale  = 1/iscale;
    float best_err = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)q_clampi(q_nearest_int(iscale*(x[i] - mn)), 0, nmax);
        float diff = scale * L[i] + mn - x[i];
        diff = diff * diff;
        best_err += w[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta*is + nmax)/(mx - mn);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = q_clampi(q_nearest_int(iscale*(x[i] - mn)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l  += w[i]*l;
            sum_l2 += w[i]*l*l;
            sum_xl += w[i]*l*x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l)/D;
            float this_min   = (sum_l2 * sum_x - sum_l * sum_xl)/D;
            if (this_min > 0) {
                this_min   = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                err += w[i] * diff;
            }
            if (err < best_err) {
                memcpy(L, Laux, (size_t)n);
                best_err = err;
                scale    = this_scale;
                mn       = this_min;
            }
        }
    }
    *the_min = -mn;
    return scale;
}

// One super-block of Q4_K or Q5_K (nmax 15 or 31): per sub-block of 32 a fitted scale and min,
// both stored as 6-bit multiples of the block's d and dmin (packed into scales[12] as
// kvr_k4_scales reads them), then every element requantized against the rounded scales. L gets
// the 256 quants; the caller packs them in its type's layout.
static void q_fit_k_super(const float * x, int nmax, uint8_t d[2], uint8_t dmin[2], uint8_t scales[12], uint8_t L[KVR_QK_K]) {
    uint8_t Laux[32];
    float   w[32], sc[8], mins[8];
    float   max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float * xs = x + 32*j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        const float av_x = sqrtf(sum_x2/32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        sc[j] = quant_fit_scale_min(32, nmax, xs, w, L + 32*j, &mins[j], Laux, nmax == 15 ? -1.0f : -0.5f, 0.1f, nmax == 15 ? 20 : 15);
        if (sc[j]   > max_scale) max_scale = sc[j];
        if (mins[j] > max_min)   max_min   = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f/max_scale : 0.f;
    const float inv_min   = max_min   > 0 ? 63.f/max_min   : 0.f;
    memset(scales, 0, 12);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)q_nearest_int(inv_scale*sc[j]);
        uint8_t lm = (uint8_t)q_nearest_int(inv_min*mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            scales[j]     = ls;
            scales[j + 4] = lm;
        } else {
            scales[j + 4]  = (uint8_t)((ls & 0x0f) | ((lm & 0x0f) << 4));
            scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
            scales[j]     |= (uint8_t)((lm >> 4) << 6);
        }
    }
    q_set_half(d,    max_scale/63.f);
    q_set_half(dmin, max_min/63.f);
    // requantize against the rounded scales that will actually be stored
    float dl[8], ml[8];
    kvr_k4_scales_f(scales, kvr_q_half(d), kvr_q_half(dmin), dl, ml);
    for (int j = 0; j < 8; j++) {
        if (dl[j] == 0.0f) continue;
        for (int l = 0; l < 32; l++) {
            L[32*j + l] = (uint8_t)q_clampi(q_nearest_int((x[32*j + l] + ml[j])/dl[j]), 0, nmax);
        }
    }
}

static size_t q_from_float_q4_K(const float * x, void * dst, int64_t n) {
    struct kvr_block_q4_K * y = dst;
    for (int64_t i = 0; i < n/KVR_QK_K; i++, y++, x += KVR_QK_K) {
        uint8_t L[KVR_QK_K];
        q_fit_k_super(x, 15, y->d, y->dmin, y->scales, L);
        for (int g = 0; g < 4; g++) {
            for (int l = 0; l < 32; l++) {
                y->qs[32*g + l] = (uint8_t)(L[64*g + l] | (L[64*g + 32 + l] << 4));
            }
        }
    }
    return (size_t)(n/KVR_QK_K) * sizeof(struct kvr_block_q4_K);
}

// Q5_K: Q4_K's low nibbles, and the 5th bit of sub-block j's element l in bit j of qh[l].
static size_t q_from_float_q5_K(const float * x, void * dst, int64_t n) {
    struct kvr_block_q5_K * y = dst;
    for (int64_t i = 0; i < n/KVR_QK_K; i++, y++, x += KVR_QK_K) {
        uint8_t L[KVR_QK_K];
        q_fit_k_super(x, 31, y->d, y->dmin, y->scales, L);
        memset(y->qh, 0, sizeof y->qh);
        for (int g = 0; g < 4; g++) {
            for (int l = 0; l < 32; l++) {
                const uint8_t a = L[64*g + l], b = L[64*g + 32 + l];
                y->qs[32*g + l] = (uint8_t)((a & 0x0f) | ((b & 0x0f) << 4));
                y->qh[l] |= (uint8_t)(((a >> 4) << (2*g)) | ((b >> 4) << (2*g + 1)));
            }
        }
    }
    return (size_t)(n/KVR_QK_K) * sizeof(struct kvr_block_q5_K);
}

// Symmetric fit x ~ scale*(L - nmax), L in 0..2*nmax-1, weighted by x^2: the naive scale and 18
// perturbations of it, keeping the best least-squares one (ggml's make_qx_quants, rmse_type 1).
static float quant_fit_scale_sym(int n, int nmax, const float * x, int8_t * L) {
    const float max = q_signed_absmax(x, n);
    if (fabsf(max) < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i]*x[i];
        sumlx += w*x[i]*l;
        suml2 += w*l*l;
    }
    float scale = suml2 != 0.0f ? sumlx/suml2 : 0.0f;
    float best  = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f*is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i]*x[i];
            sumlx += w*x[i]*l;
            suml2 += w*l*l;
        }
        if (suml2 > 0 && sumlx*sumlx > best*suml2) {
            for (int i = 0; i < n; i++) {
                L[i] = (int8_t)(nmax + q_clampi(q_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            }
            scale = sumlx/suml2;
            best  = scale*sumlx;
        }
    }
    return scale;
}

static size_t q_from_float_q6_K(const float * x, void * dst, int64_t n) {
    struct kvr_block_q6_K * y = dst;
    for (int64_t i = 0; i < n/KVR_QK_K; i++, y++, x += KVR_QK_K) {
        int8_t L[KVR_QK_K];
        float  scales[16];
        float  max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            scales[ib] = quant_fit_scale_sym(16, 32, x + 16*ib, L + 16*ib);
            if (fabsf(scales[ib]) > max_abs_scale) {
                max_abs_scale = fabsf(scales[ib]);
                max_scale     = scales[ib];
            }
        }
        if (max_abs_scale < 1e-15f) {
            memset(y, 0, sizeof *y);
            continue;
        }
        const float iscale = -128.f/max_scale;
        q_set_half(y->d, 1/iscale);
        for (int ib = 0; ib < 16; ib++) {
            const int l = q_nearest_int(iscale*scales[ib]);
            y->scales[ib] = (int8_t)(l < 127 ? l : 127);
        }
        const float dh = kvr_q_half(y->d);
        for (int j = 0; j < 16; j++) {
            const float d = dh * y->scales[j];
            if (d == 0.0f) continue;
            for (int l = 0; l < 16; l++) {
                L[16*j + l] = (int8_t)(q_clampi(q_nearest_int(x[16*j + l]/d), -32, 31) + 32);
            }
        }
        for (int h = 0; h < 2; h++) {
            const int8_t * Lh = L + 128*h;
            uint8_t * ql = y->ql + 64*h;
            uint8_t * qh = y->qh + 32*h;
            for (int l = 0; l < 32; l++) {
                ql[l]      = (uint8_t)((Lh[l]      & 0x0f) | ((Lh[l + 64] & 0x0f) << 4));
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0x0f) | ((Lh[l + 96] & 0x0f) << 4));
                qh[l]      = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) |
                                       ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
            }
        }
    }
    return (size_t)(n/KVR_QK_K) * sizeof(struct kvr_block_q6_K);
}

//
// the table the row conversions (section "row conversion") dispatch through
//

static const struct quant_traits {
    enum kvr_type type;
    const char *  name;       // as ggml_type_name
    int64_t       blck_size;  // elements per block
    size_t        type_size;  // bytes per block
    void   (*to_float)  (const void * src, float * dst, int64_t n);   // n: a multiple of blck_size
    size_t (*from_float)(const float * src, void * dst, int64_t n);   // NULL: kvr does not write it
} quant_traits_table[] = {
    { KVR_TYPE_Q4_0, "q4_0", KVR_QK,   sizeof(struct kvr_block_q4_0), q_to_float_q4_0, q_from_float_q4_0 },
    { KVR_TYPE_Q4_1, "q4_1", KVR_QK,   sizeof(struct kvr_block_q4_1), q_to_float_q4_1, q_from_float_q4_1 },
    { KVR_TYPE_Q5_0, "q5_0", KVR_QK,   sizeof(struct kvr_block_q5_0), q_to_float_q5_0, q_from_float_q5_0 },
    { KVR_TYPE_Q5_1, "q5_1", KVR_QK,   sizeof(struct kvr_block_q5_1), q_to_float_q5_1, q_from_float_q5_1 },
    { KVR_TYPE_Q8_0, "q8_0", KVR_QK,   sizeof(struct kvr_block_q8_0), q_to_float_q8_0, q_from_float_q8_0 },
    { KVR_TYPE_Q8_1, "q8_1", KVR_QK,   sizeof(struct kvr_block_q8_1), q_to_float_q8_1, NULL },
    { KVR_TYPE_Q2_K, "q2_K", KVR_QK_K, sizeof(struct kvr_block_q2_K), q_to_float_q2_K, NULL },
    { KVR_TYPE_Q3_K, "q3_K", KVR_QK_K, sizeof(struct kvr_block_q3_K), q_to_float_q3_K, NULL },
    { KVR_TYPE_Q4_K, "q4_K", KVR_QK_K, sizeof(struct kvr_block_q4_K), q_to_float_q4_K, q_from_float_q4_K },
    { KVR_TYPE_Q5_K, "q5_K", KVR_QK_K, sizeof(struct kvr_block_q5_K), q_to_float_q5_K, q_from_float_q5_K },
    { KVR_TYPE_Q6_K, "q6_K", KVR_QK_K, sizeof(struct kvr_block_q6_K), q_to_float_q6_K, q_from_float_q6_K },
    { KVR_TYPE_Q8_K, "q8_K", KVR_QK_K, sizeof(struct kvr_block_q8_K), q_to_float_q8_K, NULL },
    { KVR_TYPE_MXFP4, "mxfp4", KVR_QK, sizeof(struct kvr_block_mxfp4), q_to_float_mxfp4, q_from_float_mxfp4 },
};

// The traits of a quantized type; NULL for the plain types (f32, f16, bf16, integers) and unknowns.
static const struct quant_traits * quant_get(enum kvr_type t) {
    for (size_t i = 0; i < sizeof quant_traits_table / sizeof quant_traits_table[0]; i++) {
        if (quant_traits_table[i].type == t) {
            return &quant_traits_table[i];
        }
    }
    return NULL;
}

// The hooks kvr.c's type functions call (it declares them with its to_float_fn / from_float_fn
// typedefs, which name these same function pointer types).
static void (*quant_to_float_fn(enum kvr_type t))(const void * src, float * dst, int64_t n) {
    const struct quant_traits * q = quant_get(t);
    return q ? q->to_float : NULL;
}

static size_t (*quant_from_float_fn(enum kvr_type t))(const float * src, void * dst, int64_t n) {
    const struct quant_traits * q = quant_get(t);
    return q ? q->from_float : NULL;
}


//
// 5. row conversion: any supported type to f32 and back
//

typedef void   (*to_float_fn)  (const void * src, float * dst, int64_t n);
typedef size_t (*from_float_fn)(const float * src, void * dst, int64_t n);

static void f32_to_float(const void * src, float * dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

// F16 weights are converted block by block inside every matmul: the conversion must run at
// memory speed. x86 with F16C converts 8 at a time (the same bits as kvr_half_to_f32, which does
// the tail); elsewhere a 256 KiB table of kvr_half_to_f32 built once does it.
#if defined(__F16C__)
static void f16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    }
    for (; i < n; i++) {
        dst[i] = kvr_half_to_f32(s[i]);
    }
}
#else
static float f16_table[1 << 16];
static pthread_once_t f16_table_once = PTHREAD_ONCE_INIT;
static void f16_table_init(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) f16_table[i] = kvr_half_to_f32((uint16_t)i);
}
static void f16_to_float(const void * src, float * dst, int64_t n) {
    pthread_once(&f16_table_once, f16_table_init);
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = f16_table[s[i]];
    }
}
#endif

static void bf16_to_float(const void * src, float * dst, int64_t n) {
    const uint16_t * s = src;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = kvr_bfloat_to_f32(s[i]);
    }
}

static size_t f32_from_float(const float * src, void * dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
    return (size_t)n * 4;
}

static size_t f16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) {
        d[i] = kvr_f32_to_half(src[i]);
    }
    return (size_t)n * 2;
}

static size_t bf16_from_float(const float * src, void * dst, int64_t n) {
    uint16_t * d = dst;
    for (int64_t i = 0; i < n; i++) {
        d[i] = kvr_f32_to_bfloat(src[i]);
    }
    return (size_t)n * 2;
}


static to_float_fn type_to_float(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return f32_to_float;
        case KVR_TYPE_F16:  return f16_to_float;
        case KVR_TYPE_BF16: return bf16_to_float;
        default:            return quant_to_float_fn(t);
    }
}

static from_float_fn type_from_float(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return f32_from_float;
        case KVR_TYPE_F16:  return f16_from_float;
        case KVR_TYPE_BF16: return bf16_from_float;
        default:            return quant_from_float_fn(t);
    }
}

bool kvr_type_supported(enum kvr_type t) {
    return type_known(t) && type_to_float(t) != NULL;
}

void kvr_to_float(enum kvr_type t, const void * src, float * dst, int64_t n) {
    to_float_fn f = type_to_float(t);
    KVR_ASSERT(f != NULL && n % kvr_blck_size(t) == 0);
    f(src, dst, n);
}

size_t kvr_from_float(enum kvr_type t, const float * src, void * dst, int64_t n) {
    from_float_fn f = type_known(t) ? type_from_float(t) : NULL;
    if (!f || n % kvr_blck_size(t) != 0) {
        return 0;
    }
    return f(src, dst, n);
}

//
// 6. tensors and contexts
//

struct kvr_context {
    uint8_t * mem;
    size_t    size;
    size_t    used;
    bool      no_alloc;
    void   ** bufs;     // stb_ds array of buffers freed with the context
};

struct kvr_context * kvr_init(size_t mem_size, bool no_alloc) {
    struct kvr_context * ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        return NULL;
    }
    ctx->mem = malloc(mem_size);
    if (!ctx->mem) {
        free(ctx);
        return NULL;
    }
    ctx->size     = mem_size;
    ctx->no_alloc = no_alloc;
    return ctx;
}

void kvr_free(struct kvr_context * ctx) {
    if (ctx) {
        for (ptrdiff_t i = 0; i < arrlen(ctx->bufs); i++) free(ctx->bufs[i]);
        arrfree(ctx->bufs);
        free(ctx->mem);
        free(ctx);
    }
}

size_t kvr_used_mem(const struct kvr_context * ctx) {
    return ctx->used;
}

static void * ctx_alloc(struct kvr_context * ctx, size_t n) {
    const size_t align = 64;
    size_t off = (ctx->used + align - 1) & ~(align - 1);
    // The arena is sized by the caller from the model shape; running out is our bug.
    KVR_ASSERT(off + n <= ctx->size && "context arena too small");
    ctx->used = off + n;
    return ctx->mem + off;
}

int64_t kvr_nelements(const struct kvr_tensor * t) {
    return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
}

int64_t kvr_nrows(const struct kvr_tensor * t) {
    return t->ne[1] * t->ne[2] * t->ne[3];
}

size_t kvr_nbytes(const struct kvr_tensor * t) {
    size_t n = kvr_row_size(t->type, t->ne[0]);
    for (int i = 1; i < KVR_MAX_DIMS; i++) {
        if (t->ne[i] == 0) {
            return 0;
        }
        n += (size_t)(t->ne[i] - 1) * t->nb[i];
    }
    return n;
}

bool kvr_is_contiguous(const struct kvr_tensor * t) {
    size_t next = kvr_row_size(t->type, t->ne[0]);
    if (t->nb[0] != kvr_type_size(t->type)) {
        return false;
    }
    for (int i = 1; i < KVR_MAX_DIMS; i++) {
        if (t->ne[i] != 1 && t->nb[i] != next) {
            return false;
        }
        next = t->nb[i] * t->ne[i];
    }
    return true;
}

struct kvr_tensor * kvr_set_name(struct kvr_tensor * t, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    return t;
}

float kvr_get_f32_1d(const struct kvr_tensor * t, int64_t i) {
    KVR_ASSERT(t->data && t->type == KVR_TYPE_F32 && kvr_is_contiguous(t));
    return ((const float *)t->data)[i];
}

static struct kvr_tensor * new_tensor_impl(struct kvr_context * ctx, enum kvr_type type, int n_dims,
                                           const int64_t * ne, struct kvr_tensor * view_src, size_t view_offs) {
    KVR_ASSERT(type_known(type) && n_dims >= 1 && n_dims <= KVR_MAX_DIMS);
    struct kvr_tensor * t = ctx_alloc(ctx, sizeof(struct kvr_tensor));
    memset(t, 0, sizeof(*t));
    t->type = type;
    for (int i = 0; i < KVR_MAX_DIMS; i++) {
        t->ne[i] = i < n_dims ? ne[i] : 1;
    }
    KVR_ASSERT(t->ne[0] % type_traits[type].blck_size == 0);
    t->nb[0] = type_traits[type].type_size;
    t->nb[1] = kvr_row_size(type, t->ne[0]);
    for (int i = 2; i < KVR_MAX_DIMS; i++) {
        t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    }
    if (view_src) {
        if (view_src->view_src) { // views of views point at the owner of the memory
            view_offs += view_src->view_offs;
            view_src   = view_src->view_src;
        }
        t->view_src  = view_src;
        t->view_offs = view_offs;
        t->buffer    = view_src->buffer;
        t->data      = view_src->data ? (uint8_t *)view_src->data + view_offs : NULL;
    } else if (!ctx->no_alloc) {
        t->data = ctx_alloc(ctx, t->nb[3] * (size_t)t->ne[3]);
    }
    return t;
}

struct kvr_tensor * kvr_new_tensor(struct kvr_context * ctx, enum kvr_type type, int n_dims, const int64_t * ne) {
    return new_tensor_impl(ctx, type, n_dims, ne, NULL, 0);
}

struct kvr_tensor * kvr_new_tensor_1d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0) {
    return kvr_new_tensor(ctx, type, 1, &ne0);
}

struct kvr_tensor * kvr_new_tensor_2d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1) {
    const int64_t ne[2] = { ne0, ne1 };
    return kvr_new_tensor(ctx, type, 2, ne);
}

struct kvr_tensor * kvr_new_tensor_3d(struct kvr_context * ctx, enum kvr_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    const int64_t ne[3] = { ne0, ne1, ne2 };
    return kvr_new_tensor(ctx, type, 3, ne);
}

static struct kvr_tensor * view_impl(struct kvr_context * ctx, struct kvr_tensor * a, int n_dims,
                                     const int64_t * ne, const size_t * nb, size_t offset) {
    struct kvr_tensor * t = new_tensor_impl(ctx, a->type, n_dims, ne, a, offset);
    for (int i = 1; i < n_dims; i++) {
        t->nb[i] = nb[i];
    }
    for (int i = n_dims; i < KVR_MAX_DIMS; i++) {
        t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
    }
    t->op     = KVR_OP_VIEW;
    t->src[0] = a;
    snprintf(t->name, sizeof(t->name), "%.50s (view)", a->name);
    return t;
}

struct kvr_tensor * kvr_view_1d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, size_t offset) {
    return view_impl(ctx, a, 1, &ne0, NULL, offset);
}

struct kvr_tensor * kvr_view_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1,
                                size_t nb1, size_t offset) {
    const int64_t ne[2] = { ne0, ne1 };
    const size_t  nb[2] = { 0, nb1 };
    return view_impl(ctx, a, 2, ne, nb, offset);
}

struct kvr_tensor * kvr_view_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
                                size_t nb1, size_t nb2, size_t offset) {
    const int64_t ne[3] = { ne0, ne1, ne2 };
    const size_t  nb[3] = { 0, nb1, nb2 };
    return view_impl(ctx, a, 3, ne, nb, offset);
}

struct kvr_tensor * kvr_reshape_3d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2) {
    KVR_ASSERT(kvr_is_contiguous(a) && ne0 * ne1 * ne2 == kvr_nelements(a));
    const int64_t ne[3] = { ne0, ne1, ne2 };
    const size_t  nb[3] = { 0, kvr_row_size(a->type, ne0), kvr_row_size(a->type, ne0) * (size_t)ne1 };
    return view_impl(ctx, a, 3, ne, nb, 0);
}

struct kvr_tensor * kvr_reshape_2d(struct kvr_context * ctx, struct kvr_tensor * a, int64_t ne0, int64_t ne1) {
    KVR_ASSERT(kvr_is_contiguous(a) && ne0 * ne1 == kvr_nelements(a));
    const int64_t ne[2] = { ne0, ne1 };
    const size_t  nb[2] = { 0, kvr_row_size(a->type, ne0) };
    return view_impl(ctx, a, 2, ne, nb, 0);
}

//
// 7. ops: constructors only record the op and its arguments; nothing is computed here
//

static const char * const op_names[KVR_OP_COUNT] = {
#define KVR_OP_NAME(name) #name,
    KVR_OPS(KVR_OP_NAME)
#undef KVR_OP_NAME
};

const char * kvr_op_name(enum kvr_op op) {
    return (unsigned)op < KVR_OP_COUNT ? op_names[op] : "?";
}

// the tensor that owns t's memory (views point at it)
static struct kvr_tensor * mem_owner(struct kvr_tensor * t) {
    return t->view_src ? t->view_src : t;
}

static void set_param_f32(struct kvr_tensor * t, int i, float v) { memcpy(&t->op_params[i], &v, 4); }
static float get_param_f32(const struct kvr_tensor * t, int i) { float v; memcpy(&v, &t->op_params[i], 4); return v; }

static struct kvr_tensor * new_node(struct kvr_context * ctx, enum kvr_op op, enum kvr_type type,
                                    int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    const int64_t ne[4] = { ne0, ne1, ne2, ne3 };
    struct kvr_tensor * t = new_tensor_impl(ctx, type, 4, ne, NULL, 0);
    t->op = op;
    return t;
}

static struct kvr_tensor * new_node_like(struct kvr_context * ctx, enum kvr_op op, const struct kvr_tensor * a) {
    return new_node(ctx, op, KVR_TYPE_F32, a->ne[0], a->ne[1], a->ne[2], a->ne[3]);
}

struct kvr_tensor * kvr_get_rows(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * ids) {
    KVR_ASSERT(ids->type == KVR_TYPE_I32 && ids->ne[1] == 1 && a->ne[2] == 1);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_GET_ROWS, KVR_TYPE_F32, a->ne[0], ids->ne[0], 1, 1);
    t->src[0] = a;
    t->src[1] = ids;
    return t;
}

static struct kvr_tensor * binary_op(struct kvr_context * ctx, enum kvr_op op, struct kvr_tensor * a, struct kvr_tensor * b) {
    KVR_ASSERT(a->type == KVR_TYPE_F32 && b->type == KVR_TYPE_F32);
    KVR_ASSERT((a->ne[0] == b->ne[0] && (kvr_nrows(b) == 1 || kvr_nrows(b) == kvr_nrows(a))) ||
               (b->ne[0] == 1 && kvr_nrows(b) == kvr_nrows(a))); // one value a row: along its row
    struct kvr_tensor * t = new_node_like(ctx, op, a);
    t->src[0] = a;
    t->src[1] = b;
    return t;
}

struct kvr_tensor * kvr_add(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    return binary_op(ctx, KVR_OP_ADD, a, b);
}

struct kvr_tensor * kvr_mul(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    return binary_op(ctx, KVR_OP_MUL, a, b);
}

static struct kvr_tensor * unary_op(struct kvr_context * ctx, enum kvr_op op, struct kvr_tensor * a) {
    KVR_ASSERT(a->type == KVR_TYPE_F32);
    struct kvr_tensor * t = new_node_like(ctx, op, a);
    t->src[0] = a;
    return t;
}

struct kvr_tensor * kvr_scale(struct kvr_context * ctx, struct kvr_tensor * a, float s) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_SCALE, a);
    set_param_f32(t, 0, s);
    return t;
}

struct kvr_tensor * kvr_rms_norm(struct kvr_context * ctx, struct kvr_tensor * a, float eps) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_RMS_NORM, a);
    set_param_f32(t, 0, eps);
    return t;
}

struct kvr_tensor * kvr_norm(struct kvr_context * ctx, struct kvr_tensor * a, float eps) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_NORM, a);
    set_param_f32(t, 0, eps);
    return t;
}

struct kvr_tensor * kvr_silu(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_SILU, a);
}

struct kvr_tensor * kvr_gelu(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_GELU, a);
}

struct kvr_tensor * kvr_gelu_exact(struct kvr_context * ctx, struct kvr_tensor * a) {
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_GELU, a);
    t->op_params[0] = 1;
    return t;
}

struct kvr_tensor * kvr_softcap(struct kvr_context * ctx, struct kvr_tensor * a, float cap) {
    KVR_ASSERT(cap > 0.0f);
    struct kvr_tensor * t = unary_op(ctx, KVR_OP_SOFTCAP, a);
    set_param_f32(t, 0, cap);
    return t;
}

struct kvr_tensor * kvr_sigmoid(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_SIGMOID, a);
}

struct kvr_tensor * kvr_softplus(struct kvr_context * ctx, struct kvr_tensor * a) {
    return unary_op(ctx, KVR_OP_SOFTPLUS, a);
}

struct kvr_tensor * kvr_mul_mat(struct kvr_context * ctx, struct kvr_tensor * w, struct kvr_tensor * x) {
    KVR_ASSERT(w->ne[0] == x->ne[0] && w->ne[2] == 1 && w->ne[3] == 1);
    KVR_ASSERT(x->type == KVR_TYPE_F32 && x->nb[0] == sizeof(float));
    KVR_ASSERT(w->nb[0] == kvr_type_size(w->type));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MUL_MAT, KVR_TYPE_F32, w->ne[1], x->ne[1], x->ne[2], x->ne[3]);
    t->src[0] = w;
    t->src[1] = x;
    return t;
}

struct kvr_tensor * kvr_rope(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * pos,
                             struct kvr_tensor * freqs, int n_rot, enum kvr_rope_mode mode, float freq_base, float freq_scale,
                             float attn_factor) {
    KVR_ASSERT(a->type == KVR_TYPE_F32 && pos->type == KVR_TYPE_I32 && pos->ne[0] == a->ne[2]);
    KVR_ASSERT(n_rot > 0 && n_rot % 2 == 0 && n_rot <= a->ne[0]);
    KVR_ASSERT(!freqs || (freqs->type == KVR_TYPE_F32 && kvr_nelements(freqs) >= n_rot / 2));
    struct kvr_tensor * t = new_node_like(ctx, KVR_OP_ROPE, a);
    t->src[0] = a;
    t->src[1] = pos;
    t->src[2] = freqs;
    t->op_params[0] = n_rot;
    t->op_params[1] = mode;
    set_param_f32(t, 2, freq_base);
    set_param_f32(t, 3, freq_scale);
    set_param_f32(t, 4, 0.0f); // no YaRN (kvr_rope_yarn)
    set_param_f32(t, 5, attn_factor);
    return t;
}

struct kvr_tensor * kvr_rope_yarn(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * pos,
                                  struct kvr_tensor * freqs, int n_rot, enum kvr_rope_mode mode, float freq_base,
                                  float freq_scale, float ext_factor, float attn_factor, float corr_lo, float corr_hi) {
    struct kvr_tensor * t = kvr_rope(ctx, a, pos, freqs, n_rot, mode, freq_base, freq_scale, attn_factor);
    set_param_f32(t, 4, ext_factor);
    set_param_f32(t, 6, corr_lo);
    set_param_f32(t, 7, corr_hi);
    return t;
}

// the dim whose wavelength turns n_turns times over n_ctx_orig positions (ggml's corr_dim)
static float rope_yarn_corr_dim(int n_rot, int n_ctx_orig, float n_turns, float freq_base) {
    return (float)n_rot * logf((float)n_ctx_orig / (n_turns * 2 * (float)M_PI)) / (2 * logf(freq_base));
}

void kvr_rope_yarn_corr_dims(int n_rot, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                             float * lo, float * hi) {
    const float a = floorf(rope_yarn_corr_dim(n_rot, n_ctx_orig, beta_fast, freq_base));
    const float b = ceilf(rope_yarn_corr_dim(n_rot, n_ctx_orig, beta_slow, freq_base));
    *lo = a > 0.0f ? a : 0.0f;
    *hi = b < (float)(n_rot - 1) ? b : (float)(n_rot - 1);
}

struct kvr_tensor * kvr_swiglu_oai(struct kvr_context * ctx, struct kvr_tensor * gate, struct kvr_tensor * up,
                                   float alpha, float limit) {
    KVR_ASSERT(gate->type == KVR_TYPE_F32 && up->type == KVR_TYPE_F32);
    KVR_ASSERT(kvr_nelements(gate) == kvr_nelements(up) && kvr_is_contiguous(gate) && kvr_is_contiguous(up));
    struct kvr_tensor * t = new_node_like(ctx, KVR_OP_SWIGLU_OAI, gate);
    t->src[0] = gate;
    t->src[1] = up;
    set_param_f32(t, 0, alpha);
    set_param_f32(t, 1, limit);
    return t;
}

struct kvr_tensor * kvr_moe_route(struct kvr_context * ctx, struct kvr_tensor * logits, int k, enum kvr_moe_gating gating) {
    KVR_ASSERT(logits->type == KVR_TYPE_F32 && logits->nb[0] == sizeof(float) && logits->ne[2] == 1 && logits->ne[3] == 1);
    KVR_ASSERT(k >= 1 && k <= logits->ne[0] && (unsigned)gating < KVR_MOE_GATING_COUNT);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MOE_ROUTE, KVR_TYPE_F32, 2 * k, logits->ne[1], 1, 1);
    t->src[0] = logits;
    t->op_params[0] = k;
    t->op_params[1] = gating;
    return t;
}

struct kvr_tensor * kvr_mul_mat_id(struct kvr_context * ctx, struct kvr_tensor * w, struct kvr_tensor * x,
                                   struct kvr_tensor * route, struct kvr_tensor * b) {
    const int64_t k = route->ne[0] / 2, T = route->ne[1];
    KVR_ASSERT(route->op == KVR_OP_MOE_ROUTE || (route->type == KVR_TYPE_F32 && route->ne[0] % 2 == 0));
    KVR_ASSERT(w->ne[0] == x->ne[0] && w->ne[3] == 1 && w->nb[0] == kvr_type_size(w->type));
    KVR_ASSERT(x->type == KVR_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[3] == 1);
    // x: [K, T] (one row a token) or [K, k, T] (one row per token and expert)
    KVR_ASSERT((x->ne[1] == T && x->ne[2] == 1) || (x->ne[1] == k && x->ne[2] == T));
    KVR_ASSERT(!b || (b->type == KVR_TYPE_F32 && b->ne[0] == w->ne[1] && b->ne[1] == w->ne[2]));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MUL_MAT_ID, KVR_TYPE_F32, w->ne[1], k, T, 1);
    t->src[0] = w;
    t->src[1] = x;
    t->src[2] = route;
    t->src[3] = b;
    return t;
}

struct kvr_tensor * kvr_moe_sum(struct kvr_context * ctx, struct kvr_tensor * y, struct kvr_tensor * route) {
    KVR_ASSERT(y->type == KVR_TYPE_F32 && y->ne[1] * 2 == route->ne[0] && y->ne[2] == route->ne[1]);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MOE_SUM, KVR_TYPE_F32, y->ne[0], y->ne[2], 1, 1);
    t->src[0] = y;
    t->src[1] = route;
    return t;
}

struct kvr_tensor * kvr_cpy(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * b) {
    KVR_ASSERT(kvr_nelements(a) == kvr_nelements(b) && (a->type == KVR_TYPE_F32 || (a->type == b->type && a->ne[0] == b->ne[0])));
    KVR_ASSERT(a->type != KVR_TYPE_F32 || b->type == KVR_TYPE_F32 || b->type == KVR_TYPE_F16 || b->type == KVR_TYPE_BF16 || b->type == KVR_TYPE_Q8_0);
    KVR_ASSERT(b->type != KVR_TYPE_Q8_0 || (a->ne[0] == b->ne[0] && b->ne[0] % 32 == 0)); // whole blocks per row
    const int64_t ne[4] = { b->ne[0], b->ne[1], b->ne[2], b->ne[3] };
    struct kvr_tensor * t = new_tensor_impl(ctx, b->type, 4, ne, b, 0);
    memcpy(t->nb, b->nb, sizeof(t->nb));
    t->op     = KVR_OP_CPY;
    t->src[0] = a;
    t->src[1] = b;
    return t;
}

struct kvr_tensor * kvr_cont(struct kvr_context * ctx, struct kvr_tensor * a) {
    KVR_ASSERT(a->type == KVR_TYPE_F32);
    struct kvr_tensor * t = new_node_like(ctx, KVR_OP_CPY, a);
    t->src[0] = a;
    return t;
}

struct kvr_tensor * kvr_kv_store(struct kvr_context * ctx, struct kvr_tensor * a, struct kvr_tensor * dst) {
    struct kvr_tensor * t = kvr_cpy(ctx, a, dst);
    t->op = KVR_OP_KV_STORE;
    return t;
}

struct kvr_tensor * kvr_attn_block(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                   struct kvr_tensor * v, struct kvr_tensor * pos, int il, float scale, float softcap,
                                   int window) {
    KVR_ASSERT(q->ne[2] == k->ne[2] && k->ne[2] == v->ne[2] && pos->ne[0] == q->ne[2]);
    KVR_ASSERT(q->ne[0] == k->ne[0] && k->ne[0] == v->ne[0] && k->ne[1] == v->ne[1]);
    KVR_ASSERT(q->ne[1] % k->ne[1] == 0);
    const int64_t n_head = q->ne[1];
    struct kvr_tensor * t = new_node(ctx, KVR_OP_ATTN_BLOCK, KVR_TYPE_F32, q->ne[0] * n_head + n_head, q->ne[2], 1, 1);
    t->src[0] = q;
    t->src[1] = k;
    t->src[2] = v;
    t->src[3] = pos;
    t->op_params[0] = il;
    t->op_params[1] = window > 0 ? window : 0;
    set_param_f32(t, 2, scale);
    set_param_f32(t, 3, softcap > 0.0f ? softcap : 0.0f);
    return t;
}

float kvr_attn_block_scale(const struct kvr_tensor * block)   { return get_param_f32(block, 2); }
float kvr_attn_block_softcap(const struct kvr_tensor * block) { return get_param_f32(block, 3); }

// where an op keeps its sinks: ATTN_BLOCK src[4], ATTN src[6], MERGE_ATTN of n parts src[n]
static int attn_sinks_slot(const struct kvr_tensor * t) {
    switch (t->op) {
        case KVR_OP_ATTN_BLOCK: return 4;
        case KVR_OP_ATTN:       return 6;
        case KVR_OP_MERGE_ATTN: return t->op_params[0];
        default:                KVR_ASSERT(!"attention sinks belong to ATTN_BLOCK, ATTN or MERGE_ATTN"); return 0;
    }
}

struct kvr_tensor * kvr_attn_sinks(struct kvr_tensor * t, struct kvr_tensor * sinks) {
    const int slot = attn_sinks_slot(t);
    KVR_ASSERT(slot < KVR_MAX_SRC);
    KVR_ASSERT(!sinks || (sinks->type == KVR_TYPE_F32 && kvr_nelements(sinks) >= (t->op == KVR_OP_ATTN_BLOCK ? t->src[0]->ne[1] : t->op_params[1])));
    t->src[slot] = sinks;
    return t;
}

struct kvr_tensor * kvr_attn_sinks_of(const struct kvr_tensor * t) {
    const int slot = attn_sinks_slot(t);
    return slot < KVR_MAX_SRC ? t->src[slot] : NULL;
}
int   kvr_attn_block_window(const struct kvr_tensor * block)  { return block->op_params[1]; }

// the types a KV cache (and so attention's K and V) may have: kvr_cache_type's
static bool kv_cache_type_ok(enum kvr_type t) {
    return t == KVR_TYPE_F32 || t == KVR_TYPE_F16 || t == KVR_TYPE_BF16 || t == KVR_TYPE_Q8_0;
}

// ATTN and its relatives (ATTN_STATS, ATTN_NORMED): the same sources and op_params, rows of ne0
static struct kvr_tensor * attn_node(struct kvr_context * ctx, enum kvr_op op, int64_t ne0, struct kvr_tensor * q,
                                     struct kvr_tensor * k, struct kvr_tensor * v, struct kvr_tensor * qpos,
                                     struct kvr_tensor * kpos, struct kvr_tensor * dep, float scale, float softcap, int window,
                                     enum kvr_attn_mode mode) {
    KVR_ASSERT(q->type == KVR_TYPE_F32 && kv_cache_type_ok(k->type) && kv_cache_type_ok(v->type));
    KVR_ASSERT(q->ne[0] == k->ne[0] && k->ne[0] == v->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2]);
    KVR_ASSERT(q->ne[1] % k->ne[1] == 0 && q->nb[0] == 4 && k->nb[0] == kvr_type_size(k->type) && v->nb[0] == kvr_type_size(v->type));
    KVR_ASSERT(k->nb[1] == kvr_row_size(k->type, k->ne[0]) && v->nb[1] == kvr_row_size(v->type, v->ne[0])); // a head's row is whole
    KVR_ASSERT(qpos->type == KVR_TYPE_I32 && kpos->type == KVR_TYPE_I32);
    KVR_ASSERT(qpos->ne[0] == q->ne[2] && kpos->ne[0] == k->ne[2]);
    const int64_t n_head = q->ne[1];
    struct kvr_tensor * t = new_node(ctx, op, KVR_TYPE_F32, ne0, q->ne[2], 1, 1);
    t->src[0] = q;
    t->src[1] = k;
    t->src[2] = v;
    t->src[3] = qpos;
    t->src[4] = kpos;
    t->src[5] = dep;
    t->op_params[0] = mode;
    t->op_params[1] = (int32_t)n_head;
    set_param_f32(t, 2, scale);
    t->op_params[3] = window > 0 ? window : 0;
    set_param_f32(t, 4, softcap > 0.0f ? softcap : 0.0f);
    return t;
}

struct kvr_tensor * kvr_attn(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                             struct kvr_tensor * v, struct kvr_tensor * qpos, struct kvr_tensor * kpos,
                             struct kvr_tensor * dep, float scale, float softcap, int window, enum kvr_attn_mode mode) {
    return attn_node(ctx, KVR_OP_ATTN, q->ne[0] * q->ne[1] + q->ne[1], q, k, v, qpos, kpos, dep, scale, softcap, window, mode);
}

struct kvr_tensor * kvr_merge_attn(struct kvr_context * ctx, struct kvr_tensor ** parts, int n, int n_head) {
    KVR_ASSERT(n >= 1 && n <= KVR_MAX_SRC);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_MERGE_ATTN, KVR_TYPE_F32, parts[0]->ne[0], parts[0]->ne[1], 1, 1);
    for (int i = 0; i < n; i++) {
        KVR_ASSERT(parts[i]->ne[0] == parts[0]->ne[0] && parts[i]->ne[1] == parts[0]->ne[1]);
        t->src[i] = parts[i];
    }
    t->op_params[0] = n;
    t->op_params[1] = n_head;
    return t;
}

struct kvr_tensor * kvr_attn_stats(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                   struct kvr_tensor * qpos, struct kvr_tensor * kpos, struct kvr_tensor * prev,
                                   struct kvr_tensor * dep, float scale, float softcap, int window, enum kvr_attn_mode mode) {
    KVR_ASSERT(!prev || (prev->type == KVR_TYPE_F32 && prev->ne[0] == 2 * q->ne[1] && prev->ne[1] == q->ne[2] &&
                         prev->ne[3] == 1 && prev->nb[0] == sizeof(float)));
    // ATTN's checks and parameters, with k standing in for the values it does not read
    struct kvr_tensor * t = attn_node(ctx, KVR_OP_ATTN_STATS, 2 * q->ne[1], q, k, k, qpos, kpos, dep, scale, softcap, window, mode);
    t->src[2] = prev;
    return t;
}

struct kvr_tensor * kvr_attn_normed(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k,
                                    struct kvr_tensor * v, struct kvr_tensor * qpos, struct kvr_tensor * kpos,
                                    struct kvr_tensor * stats, struct kvr_tensor * sinks, struct kvr_tensor * dep,
                                    float scale, float softcap, int window, enum kvr_attn_mode mode) {
    KVR_ASSERT(k->type != KVR_TYPE_Q8_0 && v->type != KVR_TYPE_Q8_0);
    KVR_ASSERT(stats->type == KVR_TYPE_F32 && stats->ne[0] == 2 * q->ne[1] && stats->ne[1] == q->ne[2] && stats->ne[3] == 1);
    KVR_ASSERT(stats->nb[0] == sizeof(float));
    KVR_ASSERT(!sinks || (sinks->type == KVR_TYPE_F32 && kvr_nelements(sinks) >= q->ne[1]));
    struct kvr_tensor * t = attn_node(ctx, KVR_OP_ATTN_NORMED, q->ne[0] * q->ne[1] + q->ne[1], q, k, v, qpos, kpos, dep, scale,
                                      softcap, window, mode);
    t->src[6] = sinks;
    t->src[7] = stats;
    return t;
}

struct kvr_tensor * kvr_attn_out(struct kvr_context * ctx, struct kvr_tensor * attn, int n_head) {
    return kvr_view_2d(ctx, attn, attn->ne[0] - n_head, attn->ne[1], attn->nb[1], 0);
}

int64_t kvr_gdn_state_floats(const struct kvr_gdn_shape * sh) {
    const int64_t C = 2 * (int64_t)sh->n_k * sh->d_k + (int64_t)sh->n_v * sh->d_v;
    return (int64_t)(sh->d_conv - 1) * C + (int64_t)sh->n_v * sh->d_v * sh->d_k;
}

struct kvr_tensor * kvr_gdn_block(struct kvr_context * ctx, struct kvr_tensor * x, struct kvr_tensor * conv,
                                  struct kvr_tensor * g, struct kvr_tensor * beta, const struct kvr_gdn_shape * sh) {
    const int64_t C = 2 * (int64_t)sh->n_k * sh->d_k + (int64_t)sh->n_v * sh->d_v, T = x->ne[1];
    KVR_ASSERT(x->type == KVR_TYPE_F32 && x->ne[0] == C && x->nb[0] == sizeof(float) && x->ne[2] == 1);
    KVR_ASSERT(conv->type == KVR_TYPE_F32 && conv->ne[0] == sh->d_conv && conv->ne[1] == C);
    KVR_ASSERT(g->ne[0] == sh->n_v && g->ne[1] == T && beta->ne[0] == sh->n_v && beta->ne[1] == T);
    KVR_ASSERT(sh->n_v % sh->n_k == 0 && sh->d_k == sh->d_v && sh->d_conv >= 1);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_GDN_BLOCK, KVR_TYPE_F32, sh->d_v, sh->n_v, T, 1);
    t->src[0] = x;
    t->src[1] = conv;
    t->src[2] = g;
    t->src[3] = beta;
    const int32_t p[6] = { sh->il, sh->d_conv, sh->n_k, sh->d_k, sh->n_v, sh->d_v };
    memcpy(t->op_params, p, sizeof(p));
    set_param_f32(t, 6, sh->eps);
    return t;
}

void kvr_gdn_block_shape(const struct kvr_tensor * block, struct kvr_gdn_shape * sh) {
    KVR_ASSERT(block->op == KVR_OP_GDN_BLOCK);
    const int32_t * p = block->op_params;
    *sh = (struct kvr_gdn_shape){ .il = p[0], .d_conv = p[1], .n_k = p[2], .d_k = p[3], .n_v = p[4], .d_v = p[5],
                                  .eps = get_param_f32(block, 6) };
}

struct kvr_tensor * kvr_ssm_conv(struct kvr_context * ctx, struct kvr_tensor * x, struct kvr_tensor * w,
                                 struct kvr_tensor * state, bool fresh) {
    const int64_t C = x->ne[0], K = w->ne[0];
    KVR_ASSERT(x->type == KVR_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    KVR_ASSERT(w->type == KVR_TYPE_F32 && w->ne[1] == C && w->nb[0] == sizeof(float));
    KVR_ASSERT(state->type == KVR_TYPE_F32 && kvr_is_contiguous(state) && kvr_nelements(state) == (K - 1) * C);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_SSM_CONV, KVR_TYPE_F32, C, x->ne[1], 1, 1);
    t->src[0] = x;
    t->src[1] = w;
    t->src[2] = state;
    t->op_params[0] = fresh;
    return t;
}

struct kvr_tensor * kvr_gdn(struct kvr_context * ctx, struct kvr_tensor * q, struct kvr_tensor * k, struct kvr_tensor * v,
                            struct kvr_tensor * g, struct kvr_tensor * beta, struct kvr_tensor * state, float eps, bool fresh) {
    const int64_t Dk = q->ne[0], Hk = q->ne[1], Dv = v->ne[0], Hv = v->ne[1], T = v->ne[2];
    KVR_ASSERT(q->type == KVR_TYPE_F32 && k->type == KVR_TYPE_F32 && v->type == KVR_TYPE_F32);
    KVR_ASSERT(q->nb[0] == 4 && k->nb[0] == 4 && v->nb[0] == 4 && g->nb[0] == 4 && beta->nb[0] == 4);
    KVR_ASSERT(k->ne[0] == Dk && k->ne[1] == Hk && q->ne[2] == T && k->ne[2] == T && Hv % Hk == 0);
    KVR_ASSERT(g->ne[0] == Hv && g->ne[1] == T && beta->ne[0] == Hv && beta->ne[1] == T);
    KVR_ASSERT(state->type == KVR_TYPE_F32 && kvr_is_contiguous(state) && kvr_nelements(state) == Hv * Dv * Dk);
    struct kvr_tensor * t = new_node(ctx, KVR_OP_GDN, KVR_TYPE_F32, Dv, Hv, T, 1);
    t->src[0] = q;
    t->src[1] = k;
    t->src[2] = v;
    t->src[3] = g;
    t->src[4] = beta;
    t->src[5] = state;
    t->op_params[0] = fresh;
    set_param_f32(t, 1, eps);
    return t;
}

struct kvr_tensor * kvr_gdn_segment(struct kvr_context * ctx, const struct kvr_tensor * block, int64_t t0, int64_t n,
                                    struct kvr_tensor * state, bool fresh, struct kvr_tensor * dep) {
    struct kvr_gdn_shape sh;
    kvr_gdn_block_shape(block, &sh);
    struct kvr_tensor * x = block->src[0], * g = block->src[2], * beta = block->src[3];
    const int64_t C = x->ne[0], nc = (int64_t)(sh.d_conv - 1) * C;
    KVR_ASSERT(t0 >= 0 && n >= 1 && t0 + n <= x->ne[1] && kvr_nelements(state) == kvr_gdn_state_floats(&sh));
    struct kvr_tensor * xs = kvr_view_2d(ctx, x, C, n, x->nb[1], (size_t)t0 * x->nb[1]);
    struct kvr_tensor * cs = kvr_view_1d(ctx, state, nc, 0);
    struct kvr_tensor * ss = kvr_view_1d(ctx, state, kvr_gdn_state_floats(&sh) - nc, (size_t)nc * sizeof(float));
    struct kvr_tensor * c = kvr_set_name(kvr_ssm_conv(ctx, xs, block->src[1], cs, fresh), "blk.%d.ssm_conv", sh.il);
    c->src[3] = dep;
    const size_t fk = (size_t)sh.d_k * sizeof(float);
    struct kvr_tensor * q = kvr_view_3d(ctx, c, sh.d_k, sh.n_k, n, fk, c->nb[1], 0);
    struct kvr_tensor * k = kvr_view_3d(ctx, c, sh.d_k, sh.n_k, n, fk, c->nb[1], (size_t)sh.n_k * fk);
    struct kvr_tensor * v = kvr_view_3d(ctx, c, sh.d_v, sh.n_v, n, (size_t)sh.d_v * sizeof(float), c->nb[1], 2 * (size_t)sh.n_k * fk);
    struct kvr_tensor * gs = kvr_view_2d(ctx, g, sh.n_v, n, g->nb[1], (size_t)t0 * g->nb[1]);
    struct kvr_tensor * bs = kvr_view_2d(ctx, beta, sh.n_v, n, beta->nb[1], (size_t)t0 * beta->nb[1]);
    return kvr_set_name(kvr_gdn(ctx, q, k, v, gs, bs, ss, sh.eps, fresh), "blk.%d.gdn", sh.il);
}

static const char * const tag_kind_names[KVR_TAG_KIND_COUNT] = {
    "K", "V", "key positions", "Q", "query positions", "partial attention", "logits", "recurrent state",
    "softmax statistics",
};

const char * kvr_tag_kind_name(int kind) {
    return kind >= 0 && kind < KVR_TAG_KIND_COUNT ? tag_kind_names[kind] : "?";
}

// Memory a transfer reads must outlive the graph (sends complete at its end): never reuse it.
static void keep_alive(struct kvr_tensor * t) {
    mem_owner(t)->flags |= KVR_FLAG_OUTPUT;
}

struct kvr_tensor * kvr_send(struct kvr_context * ctx, struct kvr_tensor * src, int peer, int tag) {
    KVR_ASSERT(kvr_is_contiguous(src));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_SEND, KVR_TYPE_I32, 1, 1, 1, 1);
    t->src[0] = src;
    t->op_params[0] = peer;
    t->op_params[1] = tag;
    keep_alive(src);
    return t;
}

struct kvr_tensor * kvr_recv(struct kvr_context * ctx, struct kvr_tensor * dst, int peer, int tag) {
    const int64_t ne[4] = { dst->ne[0], dst->ne[1], dst->ne[2], dst->ne[3] };
    struct kvr_tensor * t = new_tensor_impl(ctx, dst->type, 4, ne, dst, 0);
    memcpy(t->nb, dst->nb, sizeof(t->nb));
    t->op     = KVR_OP_RECV;
    t->src[0] = dst;
    t->op_params[0] = peer;
    t->op_params[1] = tag;
    return t;
}

struct kvr_tensor * kvr_all_gather(struct kvr_context * ctx, struct kvr_tensor * src, struct kvr_tensor * dst,
                                   int n_ranks, int64_t total, int tag) {
    KVR_ASSERT(src->ne[0] == dst->ne[0] && dst->ne[1] == total && src->type == dst->type);
    struct kvr_tensor * t = kvr_recv(ctx, dst, -1, tag);
    t->op     = KVR_OP_ALL_GATHER;
    t->src[0] = src;
    t->src[1] = dst;
    t->op_params[2] = n_ranks;
    memcpy(&t->op_params[3], &total, sizeof(total));
    keep_alive(src);
    return t;
}

struct kvr_tensor * kvr_all_to_all(struct kvr_context * ctx, struct kvr_tensor * src, int n_ranks, int64_t total, int tag) {
    KVR_ASSERT(src->ne[2] == n_ranks && kvr_is_contiguous(src));
    struct kvr_tensor * t = new_node(ctx, KVR_OP_ALL_TO_ALL, src->type, src->ne[0], src->ne[1], src->ne[2], 1);
    t->src[0] = src;
    t->flags |= KVR_FLAG_INPUT; // placed before the graph runs, never reused
    t->op_params[1] = tag;
    t->op_params[2] = n_ranks;
    memcpy(&t->op_params[3], &total, sizeof(total));
    keep_alive(src);
    return t;
}

//
// 8. graphs
//

struct kvr_graph * kvr_graph_new(struct kvr_context * ctx, int size) {
    struct kvr_graph * g = ctx_alloc(ctx, sizeof(struct kvr_graph));
    g->size    = size;
    g->ctx     = ctx;
    g->plan    = NULL;
    g->n_nodes = 0;
    g->n_leafs = 0;
    g->nodes   = ctx_alloc(ctx, sizeof(struct kvr_tensor *) * (size_t)size);
    g->leafs   = ctx_alloc(ctx, sizeof(struct kvr_tensor *) * (size_t)size);
    return g;
}

void kvr_graph_reset(struct kvr_graph * g) {
    g->n_nodes = 0;
    g->n_leafs = 0;
}

// The set of tensors a depth-first build has seen. Marks cannot live in the tensors: weights
// are shared by every rank's graph, and ranks build their graphs at the same time. (stb_ds's
// hash of a pointer shifts a signed int, which UBSan reports; open addressing is a few lines.)
struct ptr_set {
    const void ** keys;
    size_t        cap, n;
};

static size_t ptr_hash(const void * p, size_t cap) {
    return (size_t)(((uintptr_t)p >> 4) * 0x9e3779b97f4a7c15ull) & (cap - 1);
}

static bool ptr_set_insert(struct ptr_set * s, const void * p) { // false if p was there
    if (2 * (s->n + 1) > s->cap) {
        struct ptr_set bigger = { kvr_calloc(s->cap ? 2 * s->cap : 1024, sizeof(void *)), s->cap ? 2 * s->cap : 1024, 0 };
        for (size_t i = 0; i < s->cap; i++) {
            if (s->keys[i]) ptr_set_insert(&bigger, s->keys[i]);
        }
        free(s->keys);
        *s = bigger;
    }
    size_t i = ptr_hash(p, s->cap);
    while (s->keys[i]) {
        if (s->keys[i] == p) return false;
        i = (i + 1) & (s->cap - 1);
    }
    s->keys[i] = p;
    s->n++;
    return true;
}

static void graph_visit(struct kvr_graph * g, struct ptr_set * seen, struct kvr_tensor * t) {
    if (!ptr_set_insert(seen, t)) {
        return;
    }
    for (int i = 0; i < KVR_MAX_SRC; i++) {
        if (t->src[i]) {
            graph_visit(g, seen, t->src[i]);
        }
    }
    if (t->op == KVR_OP_NONE) {
        KVR_ASSERT(g->n_leafs < g->size && "graph too small");
        g->leafs[g->n_leafs++] = t;
    } else {
        KVR_ASSERT(g->n_nodes < g->size && "graph too small");
        g->nodes[g->n_nodes++] = t;
    }
}

void kvr_graph_expand(struct kvr_graph * g, struct kvr_tensor * t) {
    // what earlier expansions added is seen already, so a second output shares their nodes
    struct ptr_set seen = { 0 };
    for (int i = 0; i < g->n_nodes; i++) ptr_set_insert(&seen, g->nodes[i]);
    for (int i = 0; i < g->n_leafs; i++) ptr_set_insert(&seen, g->leafs[i]);
    graph_visit(g, &seen, t);
    free(seen.keys);
}

void kvr_graph_rebuild(struct kvr_graph * g) {
    // the outputs are the nodes nothing in the graph reads; expand them again, in their order
    struct ptr_set used = { 0 };
    for (int i = 0; i < g->n_nodes; i++) {
        for (int j = 0; j < KVR_MAX_SRC; j++) {
            if (g->nodes[i]->src[j]) ptr_set_insert(&used, g->nodes[i]->src[j]);
        }
    }
    int n_out = 0;
    struct kvr_tensor ** outs = kvr_malloc(sizeof(*outs) * (size_t)(g->n_nodes + 1));
    for (int i = 0; i < g->n_nodes; i++) {
        if (ptr_set_insert(&used, g->nodes[i])) outs[n_out++] = g->nodes[i];
    }
    free(used.keys);
    kvr_graph_reset(g);
    for (int i = 0; i < n_out; i++) kvr_graph_expand(g, outs[i]);
    free(outs);
}

struct kvr_tensor * kvr_graph_get(const struct kvr_graph * g, const char * name) {
    for (int i = 0; i < g->n_nodes; i++) {
        if (strcmp(g->nodes[i]->name, name) == 0) return g->nodes[i];
    }
    for (int i = 0; i < g->n_leafs; i++) {
        if (strcmp(g->leafs[i]->name, name) == 0) return g->leafs[i];
    }
    return NULL;
}

void kvr_graph_print(const struct kvr_graph * g, FILE * f) {
    fprintf(f, "graph: %d nodes, %d leafs\n", g->n_nodes, g->n_leafs);
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        fprintf(f, "  %4d %-11s [%5" PRId64 ",%5" PRId64 ",%4" PRId64 ",%2" PRId64 "] %-5s %-32s",
                i, kvr_op_name(t->op), t->ne[0], t->ne[1], t->ne[2], t->ne[3], kvr_type_name(t->type), t->name);
        for (int j = 0; j < KVR_MAX_SRC && t->src[j]; j++) {
            fprintf(f, "%s%s", j ? ", " : " <- ", t->src[j]->name);
        }
        if (t->why) {
            fprintf(f, "  # %s", t->why);
        }
        fputc('\n', f);
    }
}

//
// memory planning: one buffer per graph, a node's bytes reused after its last reader ran
//

struct plan_entry {
    struct kvr_tensor * key;
    size_t              offs;
    int                 readers;
};

struct plan_block {
    size_t offs, size;
};

struct plan_state {
    struct plan_entry * map;    // sorted by tensor address, looked up by bisection
    int                 n_map;
    struct plan_block * free;   // stb_ds array, sorted by offset
    size_t              top;    // high-water mark
};

#define PLAN_ALIGN 64

static int plan_cmp(const void * a, const void * b) {
    const uintptr_t x = (uintptr_t)((const struct plan_entry *)a)->key, y = (uintptr_t)((const struct plan_entry *)b)->key;
    return x < y ? -1 : x > y;
}

static struct plan_entry * plan_find(struct plan_state * ps, const struct kvr_tensor * t) {
    struct plan_entry key = { (struct kvr_tensor *)t, 0, 0 };
    return bsearch(&key, ps->map, (size_t)ps->n_map, sizeof(key), plan_cmp);
}

static size_t plan_alloc(struct plan_state * ps, size_t size) {
    size = (size + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    int best = -1;
    for (int i = 0; i < (int)arrlen(ps->free); i++) { // best fit: the smallest block that fits
        if (ps->free[i].size >= size && (best < 0 || ps->free[i].size < ps->free[best].size)) {
            best = i;
        }
    }
    if (best >= 0) {
        size_t offs = ps->free[best].offs;
        ps->free[best].offs += size;
        ps->free[best].size -= size;
        if (ps->free[best].size == 0) {
            arrdel(ps->free, best);
        }
        return offs;
    }
    // grow: if the last free block ends at the top, extend it
    int n = (int)arrlen(ps->free);
    if (n > 0 && ps->free[n - 1].offs + ps->free[n - 1].size == ps->top) {
        size_t offs = ps->free[n - 1].offs;
        ps->top = offs + size;
        arrdel(ps->free, n - 1);
        return offs;
    }
    size_t offs = ps->top;
    ps->top += size;
    return offs;
}

static void plan_release(struct plan_state * ps, size_t offs, size_t size) {
    size = (size + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    int i = 0;
    while (i < (int)arrlen(ps->free) && ps->free[i].offs < offs) i++;
    struct plan_block b = { offs, size };
    arrins(ps->free, i, b);
    // merge with the next and the previous block
    if (i + 1 < (int)arrlen(ps->free) && ps->free[i].offs + ps->free[i].size == ps->free[i + 1].offs) {
        ps->free[i].size += ps->free[i + 1].size;
        arrdel(ps->free, i + 1);
    }
    if (i > 0 && ps->free[i - 1].offs + ps->free[i - 1].size == ps->free[i].offs) {
        ps->free[i - 1].size += ps->free[i].size;
        arrdel(ps->free, i);
    }
}

static bool needs_alloc(const struct kvr_tensor * t) {
    return t->data == NULL && t->view_src == NULL;
}

// a planned buffer that is never released: inputs (and receive buffers) and outputs
static bool plan_pinned(const struct kvr_tensor * t) {
    return (t->flags & (KVR_FLAG_INPUT | KVR_FLAG_OUTPUT)) != 0;
}

size_t kvr_graph_plan(struct kvr_graph * g) {
    struct plan_state ps = { 0 };
    // a view read as an output keeps its owner's memory too
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->view_src && (t->flags & KVR_FLAG_OUTPUT)) t->view_src->flags |= KVR_FLAG_OUTPUT;
    }
    ps.map = kvr_malloc(sizeof(struct plan_entry) * (size_t)(g->n_nodes + g->n_leafs + 1));
    for (int i = 0; i < g->n_leafs; i++) {
        if (needs_alloc(g->leafs[i])) ps.map[ps.n_map++] = (struct plan_entry) { g->leafs[i], 0, 0 };
    }
    for (int i = 0; i < g->n_nodes; i++) {
        if (needs_alloc(g->nodes[i])) ps.map[ps.n_map++] = (struct plan_entry) { g->nodes[i], 0, 0 };
    }
    qsort(ps.map, (size_t)ps.n_map, sizeof(struct plan_entry), plan_cmp);
    // inputs (leafs without data, receive buffers) are placed first and never released
    for (int i = 0; i < g->n_leafs; i++) {
        struct kvr_tensor * t = g->leafs[i];
        if (needs_alloc(t)) plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (needs_alloc(t) && (t->flags & KVR_FLAG_INPUT)) plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
    }
    // count the readers of every planned buffer
    for (int i = 0; i < g->n_nodes; i++) {
        for (int j = 0; j < KVR_MAX_SRC; j++) {
            struct kvr_tensor * s = g->nodes[i]->src[j];
            struct plan_entry * e = s ? plan_find(&ps, mem_owner(s)) : NULL;
            if (e) e->readers++;
        }
    }
    // A run of nodes in lanes (kvr_tensor.lane) may run side by side, so memory its nodes free is
    // held until the run ends: a later node of the run must not write where an earlier one of
    // another lane may still read.
    size_t * held = NULL; // offset, size pairs
    bool in_run = false;
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (in_run && t->lane == 0 && t->op != KVR_OP_NONE && t->op != KVR_OP_VIEW) {
            for (ptrdiff_t k = 0; k < arrlen(held); k += 2) plan_release(&ps, held[k], held[k + 1]);
            arrsetlen(held, 0);
            in_run = false;
        }
        in_run |= t->lane > 0;
        if (needs_alloc(t) && !(t->flags & KVR_FLAG_INPUT)) {
            plan_find(&ps, t)->offs = plan_alloc(&ps, kvr_nbytes(t));
        }
        for (int j = 0; j < KVR_MAX_SRC; j++) {
            struct kvr_tensor * s = t->src[j];
            if (!s) continue;
            struct kvr_tensor * o = mem_owner(s);
            struct plan_entry * e = plan_find(&ps, o);
            if (!e || o->op == KVR_OP_NONE || plan_pinned(o)) continue;
            // a tensor read twice by the same node is counted twice above; release once at zero
            if (--e->readers == 0) {
                if (in_run) {
                    arrput(held, e->offs);
                    arrput(held, kvr_nbytes(o));
                } else {
                    plan_release(&ps, e->offs, kvr_nbytes(o));
                }
            }
        }
    }
    arrfree(held);
    arrfree(ps.free);
    if (g->plan) free(g->plan);
    // keep the placements for kvr_graph_place: a count, then the entries
    struct plan_entry * keep = kvr_malloc(sizeof(struct plan_entry) * (size_t)(ps.n_map + 1));
    keep[0].offs = (size_t)ps.n_map;
    memcpy(keep + 1, ps.map, sizeof(struct plan_entry) * (size_t)ps.n_map);
    free(ps.map);
    g->plan = keep;
    return ps.top ? ps.top : PLAN_ALIGN;
}

void kvr_graph_place(struct kvr_graph * g, struct kvr_buffer * buf) {
    KVR_ASSERT(g->plan != NULL && (!buf || ((uintptr_t)buf->base % PLAN_ALIGN) == 0));
    struct plan_entry * map = g->plan;
    const size_t n = map[0].offs;
    for (size_t i = 1; buf && i <= n; i++) {
        map[i].key->data   = (uint8_t *)buf->base + map[i].offs;
        map[i].key->buffer = buf;
    }
    for (int i = 0; buf && i < g->n_nodes; i++) { // views see their owner's memory
        struct kvr_tensor * t = g->nodes[i];
        if (t->view_src) {
            t->data   = (uint8_t *)t->view_src->data + t->view_offs;
            t->buffer = t->view_src->buffer;
        }
    }
    free(g->plan);
    g->plan = NULL;
}

// Moves a placed view to another offset within its owner: a kept decode graph's stores
// (kvr_eval_reuse) write each token's row of the cache.
static void graph_view_move(struct kvr_tensor * t, size_t offs) {
    KVR_ASSERT(t->view_src && t->view_src->data);
    t->view_offs = offs;
    t->data = (uint8_t *)t->view_src->data + offs;
}

void kvr_replace_node(struct kvr_tensor * node, const struct kvr_tensor * by, const char * why) {
    char name[KVR_MAX_NAME];
    snprintf(name, sizeof(name), "%s", node->name[0] ? node->name : "attn");
    const int flags = node->flags;
    void * data = node->data;
    struct kvr_buffer * buffer = node->buffer;
    *node = *by;
    snprintf(node->name, sizeof(node->name), "%s", name);
    node->flags = flags | by->flags;
    if (data) { // the caller placed it: keep it
        node->data   = data;
        node->buffer = buffer;
    }
    node->why = why;
}

//
// the single-rank strategy pass: ATTN_BLOCK -> KV_STORE + KV_STORE + ATTN over the cache
//

// One ATTN_BLOCK t of the single pass: its T tokens' K/V stored at cache rows [n_past, n_past+T),
// then t becomes their attention over the cache (kpos: the positions of rows 0..n_past+T-1).
static void pass_single_block(struct kvr_context * ctx, struct kvr_tensor * t, struct kvr_kv_cache * cache,
                              int n_past, struct kvr_tensor * kpos, enum kvr_attn_mode mode) {
    struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
    const int il = t->op_params[0];
    const int64_t D = k->ne[0], Hkv = k->ne[1], T = k->ne[2];
    KVR_ASSERT(D * Hkv == cache->kv_dim && n_past + T <= cache->n_ctx && kpos->ne[0] == n_past + T);
    struct kvr_tensor * kc = cache->k[il], * vc = cache->v[il];
    KVR_ASSERT(kc && vc); // an attention layer's
    const size_t row = kc->nb[1], vrow = vc->nb[1]; // K and V may be of different types
    struct kvr_tensor * k_dst = kvr_view_2d(ctx, kc, cache->kv_dim, T, row, (size_t)n_past * row);
    struct kvr_tensor * v_dst = kvr_view_2d(ctx, vc, cache->kv_dim, T, vrow, (size_t)n_past * vrow);
    struct kvr_tensor * k_new = kvr_reshape_2d(ctx, k, cache->kv_dim, T);
    struct kvr_tensor * v_new = kvr_reshape_2d(ctx, v, cache->kv_dim, T);
    struct kvr_tensor * ks = kvr_set_name(kvr_kv_store(ctx, k_new, k_dst), "blk.%d.k_store", il);
    struct kvr_tensor * vs = kvr_set_name(kvr_kv_store(ctx, v_new, v_dst), "blk.%d.v_store", il);
    ks->why = vs->why = "single: append this batch's K/V at [n_past, n_past+T)";
    // the ATTN reads the cache through views that depend on both stores
    vs->src[2] = ks;
    // a sliding-window layer reads only the rows its first query can still see
    const int W = kvr_attn_block_window(t);
    const int64_t lo = W > 0 && n_past - W + 1 > 0 ? n_past - W + 1 : 0, n = n_past + T - lo;
    struct kvr_tensor * kall = kvr_view_3d(ctx, kc, D, Hkv, n, kvr_row_size(kc->type, D), row, (size_t)lo * row);
    struct kvr_tensor * vall = kvr_view_3d(ctx, vc, D, Hkv, n, kvr_row_size(vc->type, D), vrow, (size_t)lo * vrow);
    struct kvr_tensor * kp = lo ? kvr_view_1d(ctx, kpos, n, (size_t)lo * sizeof(int32_t)) : kpos;
    struct kvr_tensor * a = kvr_attn_sinks(kvr_attn(ctx, q, kall, vall, pos, kp, vs, kvr_attn_block_scale(t),
                                                    kvr_attn_block_softcap(t), W, mode),
                                           kvr_attn_sinks_of(t));
    // turn the ATTN_BLOCK node itself into the ATTN, so its readers need no rewiring
    kvr_replace_node(t, a, W ? "single: sliding-window attention over the cache rows its window reaches"
                             : "single: causal attention over cache[0, n_past+T)");
}

void kvr_pass_single(struct kvr_context * ctx, struct kvr_graph * g, struct kvr_kv_cache * cache,
                     int n_past, struct kvr_tensor * kpos, enum kvr_attn_mode mode) {
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_ATTN_BLOCK) pass_single_block(ctx, t, cache, n_past, kpos, mode);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op != KVR_OP_GDN_BLOCK) continue;
        struct kvr_tensor * st = cache->state ? cache->state[t->op_params[0]] : NULL;
        KVR_ASSERT(st != NULL && "a recurrent layer's cache has its state");
        kvr_replace_node(t, kvr_gdn_segment(ctx, t, 0, t->ne[2], st, n_past == 0, NULL),
                         n_past == 0 ? "single: the recurrence from the zero state; the cache's state becomes its end"
                                     : "single: the recurrence on from the cache's state, updated in place");
    }
    kvr_graph_rebuild(g); // the stores are reachable only through the rewritten nodes
}

// The batch of several sequences: token b of every ATTN_BLOCK is sequence b's next token. Each
// token's attention is the single pass's over its own cache (a one-token block of its own,
// rewritten by pass_single_block) over the rows the kept decode graph of a solo decode reads
// (kvr_eval_reuse), so a batch computes what solo decodes compute; the outputs are copied into the
// columns of one [C, T] tensor, and the ATTN_BLOCK becomes a view of it, so its readers need no
// rewiring.
void kvr_pass_batch(struct kvr_context * ctx, struct kvr_graph * g, struct kvr_kv_cache * const * caches,
                    const int * n_past, const int * n_kv, struct kvr_tensor * kpos, enum kvr_attn_mode mode) {
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op != KVR_OP_ATTN_BLOCK) continue;
        struct kvr_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * pos = t->src[3];
        const int il = t->op_params[0];
        const int64_t T = q->ne[2], C = t->ne[0];
        struct kvr_tensor * out = kvr_set_name(kvr_new_tensor_2d(ctx, KVR_TYPE_F32, C, T), "blk.%d.attn_batch", il);
        struct kvr_tensor * prev = NULL;
        int64_t k0 = 0; // sequence b's key positions start here in kpos
        for (int64_t b = 0; b < T; b++) {
            struct kvr_tensor * qb = kvr_view_3d(ctx, q, q->ne[0], q->ne[1], 1, q->nb[1], q->nb[2], (size_t)b * q->nb[2]);
            struct kvr_tensor * kb = kvr_view_3d(ctx, k, k->ne[0], k->ne[1], 1, k->nb[1], k->nb[2], (size_t)b * k->nb[2]);
            struct kvr_tensor * vb = kvr_view_3d(ctx, v, v->ne[0], v->ne[1], 1, v->nb[1], v->nb[2], (size_t)b * v->nb[2]);
            struct kvr_tensor * pb = kvr_view_1d(ctx, pos, 1, (size_t)b * sizeof(int32_t));
            KVR_ASSERT(n_kv[b] > n_past[b] && n_kv[b] <= caches[b]->n_ctx);
            struct kvr_tensor * kp = kvr_view_1d(ctx, kpos, n_kv[b], (size_t)k0 * sizeof(int32_t));
            k0 += n_kv[b];
            struct kvr_tensor * blk = kvr_attn_sinks(kvr_attn_block(ctx, qb, kb, vb, pb, il, kvr_attn_block_scale(t),
                                                                    kvr_attn_block_softcap(t), kvr_attn_block_window(t)),
                                                     kvr_attn_sinks_of(t));
            kvr_set_name(blk, "blk.%d.attn_seq%d", il, (int)b);
            // as the kept decode graph: attention over n_kv rows, the stores moved to row n_past
            pass_single_block(ctx, blk, caches[b], n_kv[b] - 1, kp, mode);
            struct kvr_tensor * vs = blk->src[5], * ks = vs->src[2];
            KVR_ASSERT(vs->op == KVR_OP_KV_STORE && ks->op == KVR_OP_KV_STORE);
            struct kvr_tensor * moved[4] = { ks, ks->src[1], vs, vs->src[1] };
            for (int j = 0; j < 4; j++) moved[j]->view_offs = (size_t)n_past[b] * moved[j]->nb[1];
            struct kvr_tensor * col = kvr_view_2d(ctx, out, C, 1, out->nb[1], (size_t)b * out->nb[1]);
            struct kvr_tensor * cp = kvr_cpy(ctx, blk, col);
            cp->src[2] = prev; // the copies run in order, each before the view that reads them all
            cp->why = "batch: this sequence's attention into its column";
            // the sequence's stores, attention and copy read only the layer's Q, K, V and its own
            // cache, and write only its own rows and column: its lane (the copies' order is no
            // data dependency), so a backend runs the sequences side by side
            ks->lane = vs->lane = blk->lane = cp->lane = (int)b + 1;
            prev = cp;
        }
        KVR_ASSERT(k0 == kpos->ne[0]);
        struct kvr_tensor * all = kvr_view_2d(ctx, out, C, T, out->nb[1], 0);
        all->src[1] = prev;
        kvr_replace_node(t, all, "batch: every sequence's attention over its own cache, one column each");
    }
    // a recurrent layer: token b's step of the recurrence on from sequence b's own state (conv
    // window and delta-rule matrix, updated in place), the solo decode's one-token segment
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op != KVR_OP_GDN_BLOCK) continue;
        const int il = t->op_params[0];
        const int64_t T = t->ne[2];
        struct kvr_tensor * out = kvr_set_name(kvr_new_tensor_3d(ctx, KVR_TYPE_F32, t->ne[0], t->ne[1], T), "blk.%d.gdn_batch", il);
        struct kvr_tensor * prev = NULL;
        for (int64_t b = 0; b < T; b++) {
            struct kvr_tensor * st = caches[b]->state ? caches[b]->state[il] : NULL;
            KVR_ASSERT(st != NULL && "a recurrent layer's cache has its state");
            struct kvr_tensor * seg = kvr_gdn_segment(ctx, t, b, 1, st, n_past[b] == 0, NULL);
            struct kvr_tensor * col = kvr_view_3d(ctx, out, t->ne[0], t->ne[1], 1, out->nb[1], out->nb[2], (size_t)b * out->nb[2]);
            struct kvr_tensor * cp = kvr_cpy(ctx, seg, col);
            cp->src[2] = prev;
            cp->why = "batch: this sequence's recurrence step into its column";
            prev = cp;
        }
        struct kvr_tensor * all = kvr_view_3d(ctx, out, t->ne[0], t->ne[1], T, out->nb[1], out->nb[2], 0);
        all->src[1] = prev;
        kvr_replace_node(t, all, "batch: every sequence's recurrence on from its own state, one column each");
    }
    // every token through the kernels one token's decode uses: the same sums, however many tokens
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->op == KVR_OP_MUL_MAT || g->nodes[i]->op == KVR_OP_MUL_MAT_ID) g->nodes[i]->op_params[0] = KVR_MM_ROWS;
    }
    kvr_graph_rebuild(g);
}

//
// 9. backends: buffers, tensors in and out, the comm protocol every backend runs under, and the
// registry with the constructor by name (kvr.h's "backends" is the manual). Besides the allocator
// ("tensors and contexts", "graphs") and the CPU sections ("CPU kernels", "CPU backend") this is the only code that uses a tensor's
// data: to copy host tensors and to hand host memory to a transport.
//

static bool node_is_noop(const struct kvr_tensor * t) {
    return t->op == KVR_OP_NONE || t->op == KVR_OP_VIEW;
}

static bool node_is_comm(const struct kvr_tensor * t) {
    return t->op == KVR_OP_SEND || t->op == KVR_OP_RECV || t->op == KVR_OP_ALL_GATHER || t->op == KVR_OP_ALL_TO_ALL;
}

// Host memory: a tensor of a no_alloc = false context (no buffer), or one in a host buffer.
static bool tensor_is_host(const struct kvr_tensor * t) {
    return !t->buffer || t->buffer->host;
}

static struct kvr_buffer * buffer_new(struct kvr_backend * be, size_t size) {
    struct kvr_buffer * buf = kvr_calloc(1, sizeof(*buf));
    buf->backend = be;
    buf->size    = size;
    return buf;
}

struct kvr_buffer * kvr_backend_alloc_buffer(struct kvr_backend * be, size_t size) {
    struct kvr_buffer * buf = buffer_new(be, size);
    if (be->iface.buf_alloc(be, buf) != KVR_OK) { // the backend said why
        free(buf);
        return NULL;
    }
    KVR_ASSERT(buf->base != NULL && (uintptr_t)buf->base % PLAN_ALIGN == 0);
    return buf;
}

struct kvr_buffer * kvr_backend_buffer_from_host(struct kvr_backend * be, const void * host, size_t size) {
    struct kvr_buffer * buf = buffer_new(be, size);
    if (be->iface.buf_from_host(be, buf, host) != KVR_OK) {
        free(buf);
        return NULL;
    }
    return buf;
}

void kvr_buffer_free(struct kvr_buffer * buf) {
    if (!buf) return;
    if (buf->backend) buf->backend->iface.buf_free(buf->backend, buf);
    else if (buf->owned) free(buf->base);
    free(buf);
}

void kvr_buffer_clear(struct kvr_buffer * buf, uint8_t value) {
    if (buf->backend) buf->backend->iface.buf_clear(buf->backend, buf, value);
    else memset(buf->base, value, buf->size);
}

void kvr_buffer_place(struct kvr_buffer * buf, struct kvr_tensor * t, size_t offs) {
    KVR_ASSERT(!t->view_src && !t->data && offs + kvr_nbytes(t) <= buf->size);
    t->buffer = buf;
    t->data   = (uint8_t *)buf->base + offs;
}

void kvr_backend_tensor_set(struct kvr_tensor * t, const void * src, size_t off, size_t n) {
    KVR_ASSERT(t->data != NULL && off + n <= kvr_nbytes(t));
    if (t->buffer && t->buffer->backend) t->buffer->backend->iface.tensor_set(t->buffer->backend, t, src, off, n);
    else if (n) memcpy((uint8_t *)t->data + off, src, n);
}

void kvr_backend_tensor_get(const struct kvr_tensor * t, void * dst, size_t off, size_t n) {
    KVR_ASSERT(t->data != NULL && off + n <= kvr_nbytes(t));
    if (t->buffer && t->buffer->backend) t->buffer->backend->iface.tensor_get(t->buffer->backend, t, dst, off, n);
    else if (n) memcpy(dst, (const uint8_t *)t->data + off, n);
}

// The comm protocol. Transports take host memory: a node's own when it is host (or when the
// transport moves backend memory itself), else a staged copy that lives until the graph ends.
struct comm_stage {
    const struct kvr_tensor * node;
    void *                    host;
};

struct comm_run {
    struct comm_stage * recv;     // stb_ds array: staged RECV destinations, posted at graph start
    void **             scratch;  // stb_ds array: every staged copy, freed when the graph ends
};

static void * comm_host(struct kvr_backend * be, struct comm_run * run, const struct kvr_tensor * t, bool fill) {
    if (tensor_is_host(t) || be->comm->device_ptrs) return t->data;
    KVR_ASSERT(kvr_is_contiguous(t)); // comm nodes move whole rows of contiguous tensors
    void * host = kvr_calloc(1, kvr_nbytes(t));
    arrput(run->scratch, host);
    if (fill) kvr_backend_tensor_get(t, host, 0, kvr_nbytes(t));
    return host;
}

// graph start: the endpoint sees the graph, then every receive is posted, so transfers overlap
// the compute before them
static int comm_begin(struct kvr_backend * be, struct comm_run * run, struct kvr_graph * g) {
    if (be->comm && be->comm->iface.begin) {
        int rc = be->comm->iface.begin(be->comm, g);
        if (rc != KVR_OK) return rc;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op != KVR_OP_RECV) continue;
        if (!be->comm) return kvr_error(KVR_ERR_ARG, "graph node '%s' (RECV) needs a communicator", t->name);
        void * dst = comm_host(be, run, t, false);
        if (dst != t->data) arrput(run->recv, ((struct comm_stage) { t, dst }));
        int rc = be->comm->iface.post_recv(be->comm, t, dst);
        if (rc != KVR_OK) return rc;
    }
    return KVR_OK;
}

int kvr_backend_comm_node(struct kvr_backend * be, struct kvr_tensor * node) {
    struct comm_run * run = be->run;
    KVR_ASSERT(run != NULL && node_is_comm(node) && "kvr_backend_comm_node outside kvr_backend_graph_compute");
    if (!be->comm) return kvr_error(KVR_ERR_ARG, "graph node '%s' (%s) needs a communicator", node->name, kvr_op_name(node->op));
    void * dst = NULL;
    const void * src = NULL;
    if (node->op == KVR_OP_RECV) {
        dst = node->data;
        for (ptrdiff_t i = 0; i < arrlen(run->recv); i++) {
            if (run->recv[i].node == node) dst = run->recv[i].host;
        }
    } else {
        src = comm_host(be, run, node->src[0], true);
        if (node->op != KVR_OP_SEND) dst = comm_host(be, run, node, false);
    }
    int rc = be->comm->iface.exec(be->comm, node, dst, src);
    if (rc == KVR_OK && dst && dst != node->data) kvr_backend_tensor_set(node, dst, 0, kvr_nbytes(node));
    return rc;
}

// graph end, however it ended: outstanding sends complete (or time out), receives never waited
// for are cancelled; the first error is the one reported
static int comm_end(struct kvr_backend * be, struct comm_run * run, int rc) {
    if (be->comm) {
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
        int rc2 = be->comm->iface.finish(be->comm);
        if (rc != KVR_OK) kvr_error(rc, "%s", msg);
        else rc = rc2;
    }
    for (ptrdiff_t i = 0; i < arrlen(run->scratch); i++) free(run->scratch[i]);
    arrfree(run->scratch);
    arrfree(run->recv);
    return rc;
}

// a node may use its backend's memory and host memory (whose backend can read that is its business)
static int check_buffer(struct kvr_backend * be, const struct kvr_tensor * node, const struct kvr_tensor * t) {
    if (tensor_is_host(t) || t->buffer->backend == be) return KVR_OK;
    return kvr_error(KVR_ERR_ARG, "graph node '%s' uses '%s', which lives in a buffer of another backend (%s, not this %s)",
                     node->name, t->name, kvr_backend_name(t->buffer->backend), kvr_backend_name(be));
}

int kvr_backend_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_ATTN_BLOCK || t->op == KVR_OP_GDN_BLOCK) {
            return kvr_error(KVR_ERR_ARG, "graph node '%s' is an %s: run a strategy pass first", t->name, kvr_op_name(t->op));
        }
        if (!node_is_noop(t) && !t->data) {
            return kvr_error(KVR_ERR_ARG, "graph node '%s' has no memory: plan and place the graph first", t->name);
        }
        int rc = check_buffer(be, t, t);
        for (int j = 0; j < KVR_MAX_SRC && rc == KVR_OK; j++) {
            if (t->src[j]) rc = check_buffer(be, t, t->src[j]);
        }
        if (rc != KVR_OK) return rc;
    }
    KVR_ASSERT(be->run == NULL && "one graph at a time on a backend");
    struct comm_run run = { 0 };
    be->run = &run;
    int rc = comm_begin(be, &run, g);
    if (rc == KVR_OK) rc = be->iface.graph_compute(be, g);
    rc = comm_end(be, &run, rc);
    be->run = NULL;
    return rc;
}

// The registry (kvr.h, "The registry"). A backend compiled only behind a build flag has its
// constructor here only in builds with that flag, NULL otherwise (CUDA_BACKEND_NEW), and
// kvr_backend_new says how to get it. Adding a backend is one line in the table (and, behind a
// flag, a name like CUDA_BACKEND_NEW for its constructor).
static struct kvr_backend * cpu_backend_new(const struct kvr_backend_params * p); // "CPU backend"
#ifdef KVR_CUDA
#define CUDA_BACKEND_NEW kvr_backend_cuda_new
#else
#define CUDA_BACKEND_NEW NULL
#endif

static const struct kvr_backend_info backend_registry[] = {
    { "cpu",  "this machine's cores (the reference of every check)", NULL,   NULL,              cpu_backend_new  },
    { "cuda", "NVIDIA GPUs, one a rank",                             "CUDA", "make KVR_CUDA=1", CUDA_BACKEND_NEW },
};

int kvr_backend_count(void) {
    return (int)(sizeof(backend_registry) / sizeof(backend_registry[0]));
}

const struct kvr_backend_info * kvr_backend_registered(int i) {
    KVR_ASSERT(i >= 0 && i < kvr_backend_count());
    return &backend_registry[i];
}

const struct kvr_backend_info * kvr_backend_find(const char * name) {
    for (int i = 0; name && i < kvr_backend_count(); i++) {
        if (strcmp(backend_registry[i].name, name) == 0) return &backend_registry[i];
    }
    return NULL;
}

char * kvr_backend_names(char * buf, size_t cap, const char * sep) {
    size_t n = 0;
    if (cap) buf[0] = 0;
    for (int i = 0; i < kvr_backend_count() && n < cap; i++) {
        const int w = snprintf(buf + n, cap - n, "%s%s", i ? sep : "", backend_registry[i].name);
        if (w < 0) break;
        n += (size_t)w;
    }
    return buf;
}

int kvr_rank_gpu(int node_rank, int first, int visible) {
    if (visible < 1) return -1;
    const int64_t i = (int64_t)(first > 0 ? first : 0) + (node_rank > 0 ? node_rank : 0);
    return (int)(i % visible);
}

struct kvr_backend * kvr_backend_new(const char * name, const struct kvr_backend_params * p) {
    const struct kvr_backend_params def = { 0 };
    if (!p) p = &def;
    if (!name) name = "cpu";
    const struct kvr_backend_info * info = kvr_backend_find(name);
    if (!info) {
        char names[256];
        kvr_error(KVR_ERR_ARG, "unknown backend '%.100s' (known: %s)", name, kvr_backend_names(names, sizeof(names), ", "));
        return NULL;
    }
    if (!info->make) {
        kvr_error(KVR_ERR_UNSUPP, "backend '%s': kvr was built without %s (build with %s)", info->name,
                  info->needs ? info->needs : "it", info->build ? info->build : "its build flag");
        return NULL;
    }
    struct kvr_backend * be = info->make(p);
    if (be) kvr_backend_set_trace(be, p->trace);
    return be;
}

void kvr_backend_free(struct kvr_backend * be) {
    if (be) be->iface.free(be);
}

const char * kvr_backend_name(struct kvr_backend * be) {
    return be->iface.name(be);
}

bool kvr_backend_supports_op(struct kvr_backend * be, const struct kvr_tensor * op) {
    return be->iface.supports_op(be, op);
}

int kvr_backend_synchronize(struct kvr_backend * be) {
    return be->iface.synchronize(be);
}

void kvr_backend_set_comm(struct kvr_backend * be, struct kvr_comm * comm) {
    be->comm = comm;
}

bool kvr_backend_interrupted(struct kvr_backend * be) {
    return be->interrupted && be->interrupted(be->interrupted_user);
}

void kvr_backend_set_threads(struct kvr_backend * be, int n_threads) {
    if (be->iface.set_threads) be->iface.set_threads(be, n_threads);
}

void kvr_backend_set_trace(struct kvr_backend * be, bool on) {
    if (be->iface.set_trace) be->iface.set_trace(be, on);
}

const struct kvr_span * kvr_backend_spans(struct kvr_backend * be, int * n, bool reset) {
    *n = 0;
    return be->iface.spans ? be->iface.spans(be, n, reset) : NULL;
}

bool kvr_backend_counters(struct kvr_backend * be, struct kvr_counters * out, bool reset) {
    struct kvr_counters tmp;
    if (!out) out = &tmp;
    memset(out, 0, sizeof(*out));
    if (!be->iface.counters) return false;
    be->iface.counters(be, out, reset);
    return true;
}

//
// 10. CPU kernels. Each takes the thread's (ith, nth) and does its share of the rows; the executor
// (next section) runs them on its pool of threads, with a barrier between nodes. First the plain
// reference kernels (ref_*), then every op's kernel (cpu_op_*): where that has fast paths (SIMD,
// BLAS, tiles, decode rows, llama.cpp's summation orders, 8-bit activations), each is one named
// function and cpu_op_* picks one. cpu_compute_node, at the end, runs the reference kernel of an
// op when the backend was made with them (KVR_REF=1), else its cpu_op_*.
//

// The rows of a decode matmul handed out a chunk at a time: each thread takes the next chunk until
// none is left, so a thread the machine runs late (another process on its core) computes fewer
// rows instead of keeping the others waiting at the barrier after the node. Which thread computes
// a row does not change its value.
struct mm_chunks {
    atomic_int * next;   // the node's counter, 0 when the graph starts
    int64_t      rows;   // rows a chunk
};

// The rows [*r0, *r1) of the next chunk of n rows; false when every chunk is taken.
static bool mm_chunk_next(const struct mm_chunks * c, int64_t n, int64_t * r0, int64_t * r1) {
    const int64_t k = atomic_fetch_add_explicit(c->next, 1, memory_order_relaxed);
    if (k * c->rows >= n) return false;
    *r0 = k * c->rows;
    *r1 = *r0 + c->rows < n ? *r0 + c->rows : n;
    return true;
}

// Rows a chunk: about four chunks a thread, a multiple of g (8 or 16: the integer kernels' row
// groups). A chunk is then at least tens of KiB of weights in the shapes decode meets, against one
// atomic increment; a thread stalled in its last chunk holds the others up by an eighth of the node
// at most (2 threads), not by its whole half.
static int64_t mm_chunk_rows(int64_t n, int nth, int64_t g) {
    const int64_t rows = (n + 4 * nth - 1) / (4 * nth);
    return (rows + g - 1) / g * g;
}

// A thread's 8-bit activations of one matmul input kept for the next matmul of the same input: a
// decode step's q, k and v (and gate and up) read one normed vector, which each thread would
// otherwise quantize again for every weight (and every thread for every token). Keyed by the input
// tensor (not its address: the planner reuses memory within a graph) and the graph's run, and by
// the activations' form (Q8_K, or Q8_0 blocks with the weight type's offset folded in). A prompt's
// (up to QX_MM_TOKENS tokens: one chunk) is kept too, where it fits QX_ACACHE_MAX: the buffer grows
// to the largest asked for, by its thread.
#define QX_ACACHE_MAX ((size_t)16 << 20)
struct qx_act_cache {
    uint8_t    * buf;  // cap bytes
    size_t       cap;
    const void * key;  // the input tensor cached, or NULL
    uint64_t     run;
    int64_t      K, T;
    int          form;
};

// A thread's cosines and sines of its last RoPE node's rows, for the next RoPE node at the same
// positions with the same parameters: every layer's q and k rotate by the same angles, and the
// cosf/sinf of a few tokens cost more than the rotations. Keyed as struct qx_act_cache is (the
// positions' tensor and the graph's run), and by every parameter the angles depend on.
#define ROPE_CACHE_FLOATS 16384
struct rope_cache {
    float      * cs;   // ROPE_CACHE_FLOATS: per token, n_rot/2 pairs (cos, sin)
    const void * pos;  // the positions' tensor, or NULL
    const void * ff;   // the frequency factors' tensor, or NULL
    uint64_t     run;
    int64_t      r0, r1;
    float        par[7]; // freq_base, freq_scale, ext_factor, mscale, corr_lo, corr_hi, n_rot
};

struct cpu_params {
    int     ith, nth;
    atomic_int * chunk; // the node's chunk counter (struct mm_chunks)
    float * wdata;     // this thread's scratch (weight blocks converted to f32, score tiles)
    size_t  wsize;     // floats
    struct kvr_counters * counters; // this thread's, summed after the graph
    bool    q8_act;    // prefill matmuls over Q4_K quantize the activations (integer path)
    bool    vec_dot;   // small F32 sums of a batch in ggml_vec_dot_f32's order, not tinyBLAS's
    bool    lanes16;   // those sums in an AVX-512 build's 16 lanes, not AVX2's 8 (avx512_order)
    bool    ref;       // the reference kernels, not the fast ones (KVR_REF=1: see below)
    struct qx_act_cache * acache; // this thread's (NULL: none)
    struct rope_cache   * rcache; // this thread's
    uint64_t run;      // the graph's number (cpu_backend.runs): what the caches above are valid for
};


// Attention tiles (kvr.h's KVR_ATTN_ROWS, KVR_ATTN_BK, kvr_attn_tile_tokens: the CUDA kernel uses
// the same). The query heads that share one KV head (GQA/MQA) are processed together, so each key
// tile is multiplied by up to KVR_ATTN_ROWS query rows at once (one sgemm) and read once per group
// instead of once per head. A query tile is KVR_ATTN_ROWS / group tokens. An AVX-512 build computes
// in smaller blocks of its own (cpu_op_attn_lanes) and still counts in these tiles, so the counters
// (and the simulator calibrated on them) do not depend on the build.


static inline void row_range(int64_t n, int ith, int nth, int64_t * r0, int64_t * r1) {
    *r0 = n * ith / nth;
    *r1 = n * (ith + 1) / nth;
}

// address of row (i1, i2, i3) of t
static inline void * row_ptr(const struct kvr_tensor * t, int64_t i1, int64_t i2, int64_t i3) {
    return (uint8_t *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

// Weights in tiles (KVR_FLAG_TILED, made at load: kvr_weight_tile): the 16 rows 16g..16g+15 of a 2D
// matrix keep their bytes (16 rows from g * 16 * nb[1] on), block by block: block b of the 16 rows
// lies where the file has the 16 rows' bytes b * 16 * block bytes on, its fields in the file's
// order, each the 16 rows' values of that field: a 2-byte field (an fp16 d, dmin or m) as 16 values,
// row i's at 2i; a field of 4m bytes (quants, high bits, scales) as m vectors of 64 bytes, bytes
// 4i..4i+3 of vector j being row i's bytes 4j..4j+3 of the field. One load then holds 4 bytes of
// each of 16 rows, the integer kernels' operand (qx_tile_dot, qx_tile_k45, qx_tile_k6). Q8_0's quants have the
// sign bit flipped (q + 128: the unsigned operand of VNNI). Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K
// and Q6_K: the types of llama-quantize's Q4_K_M .. Q8_0 mixtures but Q2_K and Q3_K.
#define KVR_TILE_ROWS 16

// The builds with the kernels that read tiles (qx_tile_dot, in 512-bit vectors): AVX-512BW, VL and
// VNNI. They are also the builds of the other 512-bit integer kernels (QX_L512).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QX_TILES 1
#else
#define QX_TILES 0
#endif

// A tiled type's block: its fields' sizes in bytes, in the file's order (a 0 ends the list), and
// which field's bytes the tiles flip (Q8_0's quants; -1: none).
struct tile_fmt {
    uint8_t size[6];
    int     flip;
};

static bool tile_fmt_of(enum kvr_type t, struct tile_fmt * f) {
    switch (t) {
        case KVR_TYPE_Q4_0: *f = (struct tile_fmt){ { 2, 16 }, -1 }; return true;        // d, qs
        case KVR_TYPE_Q4_1: *f = (struct tile_fmt){ { 2, 2, 16 }, -1 }; return true;     // d, m, qs
        case KVR_TYPE_Q5_0: *f = (struct tile_fmt){ { 2, 4, 16 }, -1 }; return true;     // d, qh, qs
        case KVR_TYPE_Q5_1: *f = (struct tile_fmt){ { 2, 2, 4, 16 }, -1 }; return true;  // d, m, qh, qs
        case KVR_TYPE_Q8_0: *f = (struct tile_fmt){ { 2, 32 }, 1 }; return true;         // d, qs
        case KVR_TYPE_Q4_K: *f = (struct tile_fmt){ { 2, 2, 12, 128 }, -1 }; return true; // d, dmin, scales, qs
        case KVR_TYPE_Q5_K: *f = (struct tile_fmt){ { 2, 2, 12, 32, 128 }, -1 }; return true; // d, dmin, scales, qh, qs
        case KVR_TYPE_Q6_K: *f = (struct tile_fmt){ { 128, 64, 16, 2 }, -1 }; return true; // ql, qh, scales, d
        default: return false;
    }
}

static bool tile_type(enum kvr_type t) {
    struct tile_fmt f;
    return tile_fmt_of(t, &f);
}

#if QX_TILES
// Field k's offset in the tiled block of a type (16 times its offset in the file's block).
static size_t tile_field(enum kvr_type t, int k) {
    struct tile_fmt f;
    KVR_ASSERT(tile_fmt_of(t, &f));
    size_t o = 0;
    for (int j = 0; j < k; j++) o += KVR_TILE_ROWS * (size_t)f.size[j];
    return o;
}
#endif

// Row i's field of `size` bytes between the file's block (blk) and the tiled block's field (tf),
// either way, 4 bytes at a time; flip XORs each byte with 0x80.
static void tile_field_copy(uint8_t * blk, uint8_t * tf, int i, int size, bool flip, bool to_tile) {
    if (size == 2) {
        if (to_tile) memcpy(tf + 2 * i, blk, 2);
        else         memcpy(blk, tf + 2 * i, 2);
        return;
    }
    for (int j = 0; j < size; j += 4) {
        uint8_t * tp = tf + 16 * j + 4 * i; // vector j / 4, row i's lane
        uint32_t v;
        memcpy(&v, to_tile ? blk + j : tp, 4);
        if (flip) v ^= 0x80808080u;
        memcpy(to_tile ? tp : blk + j, &v, 4);
    }
}

// Block b of row n of a tiled matrix (data, rows of row_bytes), in the file's layout, into blk.
static void tile_block_get(enum kvr_type t, const uint8_t * data, size_t row_bytes, int64_t n, int64_t b, uint8_t * blk) {
    struct tile_fmt f;
    KVR_ASSERT(tile_fmt_of(t, &f));
    const size_t bs = kvr_row_size(t, kvr_blck_size(t));
    uint8_t * tb = (uint8_t *)data + (size_t)(n / KVR_TILE_ROWS) * KVR_TILE_ROWS * row_bytes + (size_t)b * KVR_TILE_ROWS * bs;
    for (int k = 0; k < 6 && f.size[k]; k++) {
        tile_field_copy(blk, tb, (int)(n % KVR_TILE_ROWS), f.size[k], k == f.flip, false);
        blk += f.size[k];
        tb += KVR_TILE_ROWS * (size_t)f.size[k];
    }
}

// The 16 rows at base (row_bytes each, nb blocks) into tiles, in place; tmp: 16 * row_bytes.
static void tile_rows(enum kvr_type t, uint8_t * base, size_t row_bytes, int64_t nb, uint8_t * tmp) {
    struct tile_fmt f;
    KVR_ASSERT(tile_fmt_of(t, &f));
    const size_t bs = kvr_row_size(t, kvr_blck_size(t));
    memcpy(tmp, base, KVR_TILE_ROWS * row_bytes);
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < KVR_TILE_ROWS; i++) {
            uint8_t * blk = tmp + (size_t)i * row_bytes + (size_t)b * bs, * tb = base + (size_t)b * KVR_TILE_ROWS * bs;
            for (int k = 0; k < 6 && f.size[k]; k++) {
                tile_field_copy(blk, tb, i, f.size[k], k == f.flip, true);
                blk += f.size[k];
                tb += KVR_TILE_ROWS * (size_t)f.size[k];
            }
        }
    }
}

// The inverse of tile_rows: 16 rows of tiles at base back to the file's rows, in place.
static void untile_rows(enum kvr_type t, uint8_t * base, size_t row_bytes, int64_t nb, uint8_t * tmp) {
    const size_t bs = kvr_row_size(t, kvr_blck_size(t));
    memcpy(tmp, base, KVR_TILE_ROWS * row_bytes);
    for (int i = 0; i < KVR_TILE_ROWS; i++) {
        for (int64_t b = 0; b < nb; b++) tile_block_get(t, tmp, row_bytes, i, b, base + (size_t)i * row_bytes + (size_t)b * bs);
    }
}

// Whether this build tiles weight w (kvr_weight_tile).
static bool weight_tiles(const struct kvr_tensor * w) {
    return QX_TILES && tile_type(w->type) && w->ne[2] == 1 && w->ne[3] == 1 && w->ne[1] % KVR_TILE_ROWS == 0 &&
           !(w->flags & KVR_FLAG_TILED);
}

bool kvr_weight_tile(struct kvr_tensor * w) {
    if (!weight_tiles(w)) return false;
    KVR_ASSERT(w->data && tensor_is_host(w) && !w->view_src);
    uint8_t * tmp = kvr_malloc(KVR_TILE_ROWS * w->nb[1]);
    for (int64_t r = 0; r < w->ne[1]; r += KVR_TILE_ROWS) {
        tile_rows(w->type, (uint8_t *)w->data + (size_t)r * w->nb[1], w->nb[1], w->ne[0] / kvr_blck_size(w->type), tmp);
    }
    free(tmp);
    w->flags |= KVR_FLAG_TILED;
    return true;
}

void kvr_weight_untile(struct kvr_tensor * w) {
    if (!(w->flags & KVR_FLAG_TILED)) return;
    uint8_t * tmp = kvr_malloc(KVR_TILE_ROWS * w->nb[1]);
    for (int64_t r = 0; r < w->ne[1]; r += KVR_TILE_ROWS) {
        untile_rows(w->type, (uint8_t *)w->data + (size_t)r * w->nb[1], w->nb[1], w->ne[0] / kvr_blck_size(w->type), tmp);
    }
    free(tmp);
    w->flags &= ~KVR_FLAG_TILED;
}

// Row n of weight w (2D) as f32: from the file's row, or gathered block by block from its tiles.
static void w_row_f32(const struct kvr_tensor * w, int64_t n, float * out) {
    const to_float_fn to_float = type_to_float(w->type);
    if (!(w->flags & KVR_FLAG_TILED)) {
        to_float((const uint8_t *)w->data + n * w->nb[1], out, w->ne[0]);
        return;
    }
    uint8_t blk[256]; // the largest tiled block
    const int64_t bk = kvr_blck_size(w->type);
    KVR_ASSERT(kvr_row_size(w->type, bk) <= sizeof(blk));
    for (int64_t b = 0; b < w->ne[0] / bk; b++) {
        tile_block_get(w->type, w->data, w->nb[1], n, b, blk);
        to_float(blk, out + b * bk, bk);
    }
}

// Row n of weight w (2D) in the file's layout: where it is, or (tiled) gathered into buf (nb[1] bytes).
static const void * w_row(const struct kvr_tensor * w, int64_t n, void * buf) {
    if (!(w->flags & KVR_FLAG_TILED)) return (const uint8_t *)w->data + n * w->nb[1];
    const int64_t bk = kvr_blck_size(w->type);
    const size_t bs = kvr_row_size(w->type, bk);
    for (int64_t b = 0; b < w->ne[0] / bk; b++) tile_block_get(w->type, w->data, w->nb[1], n, b, (uint8_t *)buf + b * bs);
    return buf;
}

// the flat row index r of t as (i1, i2, i3)
static inline void * row_ptr_flat(const struct kvr_tensor * t, int64_t r) {
    const int64_t i1 = r % t->ne[1];
    const int64_t i2 = (r / t->ne[1]) % t->ne[2];
    const int64_t i3 = r / (t->ne[1] * t->ne[2]);
    return row_ptr(t, i1, i2, i3);
}

// The keys of an ATTN node: trailing rows at position INT32_MAX are no keys but the padding of a
// kept decode graph (kvr_eval_reuse); they are neither computed nor counted, so a kept graph
// computes exactly what a graph built for this token's keys would.
static int64_t attn_keys(const int32_t * kpos, int64_t Tk) {
    while (Tk > 0 && kpos[Tk - 1] == INT32_MAX) Tk--;
    return Tk;
}

// The counters of an ATTN node (struct kvr_counters) for one tile of bt queries: the query-key
// pairs the tiled kernel computes (KV head 0's tiles, tiles skipped by kvr_attn_tile not counted)
// and those causality needs. The kernels that do not run the tiles (the exact one, the reference
// one) count through it, so the counters are the same whichever kernel runs.
static void attn_count_tile(int mode, const int32_t * qpos, int64_t bt, const int32_t * kpos, int64_t Tk, int64_t W,
                            int64_t * dense, int64_t * causal) {
    int32_t qmin = INT32_MAX, qmax = INT32_MIN;
    for (int64_t i = 0; i < bt; i++) {
        if (qpos[i] < qmin) qmin = qpos[i];
        if (qpos[i] > qmax) qmax = qpos[i];
    }
    for (int64_t j0 = 0; j0 < Tk; j0 += KVR_ATTN_BK) {
        const int64_t bk = (j0 + KVR_ATTN_BK <= Tk) ? KVR_ATTN_BK : Tk - j0;
        int32_t kmin = INT32_MAX, kmax = INT32_MIN;
        for (int64_t j = 0; j < bk; j++) {
            if (kpos[j0 + j] < kmin) kmin = kpos[j0 + j];
            if (kpos[j0 + j] > kmax) kmax = kpos[j0 + j];
        }
        const int tile = kvr_attn_tile(mode, qmin, qmax, kmin, kmax, W);
        if (tile == 0) continue;
        *dense += bt * bk;
        for (int64_t i = 0; i < bt; i++) {
            if (tile == 1) { *causal += bk; continue; }
            for (int64_t j = 0; j < bk; j++) *causal += kvr_attn_visible(qpos[i], kpos[j0 + j], W);
        }
    }
}

// The same for all Tq queries in tiles of BT.
static void attn_count(int mode, const int32_t * qpos, int64_t Tq, int64_t BT, const int32_t * kpos, int64_t Tk,
                       int64_t W, int64_t * dense, int64_t * causal) {
    for (int64_t i0 = 0; i0 < Tq; i0 += BT) {
        attn_count_tile(mode, qpos + i0, (i0 + BT <= Tq) ? BT : Tq - i0, kpos, Tk, W, dense, causal);
    }
}

// K and V in a cache's type (kvr.h's kvr_cache_type). Every kernel reads them where they lie, a row
// (one head of one key) at a time, turned into f32 in a few floats of scratch: no converted copy
// of the cache is made. The query meets K as llama.cpp's products do (kvr_kv_operand_round: F16
// and BF16 round it to that type; Q8_0 quantizes it to Q8_0, which the kernels that dot in f32
// see dequantized).
static bool attn_typed(const struct kvr_tensor * dst) {
    return dst->src[1]->type != KVR_TYPE_F32 || dst->src[2]->type != KVR_TYPE_F32;
}

// Floats of scratch a typed attention takes beside a kernel's own: a key tile and a value tile in
// f32 (the tiled kernel), or a rounded query, a converted key row and value row, the quantized
// query and the online softmax's output row (the others).
static size_t attn_typed_floats(int64_t D) {
    return (size_t)(2 * KVR_ATTN_BK * D + 5 * D + 64);
}

// Floats of scratch ATTN_STATS or ATTN_NORMED takes (their kernels follow MERGE_ATTN's): G queries
// as K's type makes them, a key (or value) row, G output rows, the G rows of scores, and each
// head's max, sums (double) and 1/sum.
static size_t attn_part_floats(const struct kvr_tensor * t) {
    const int64_t D = t->src[0]->ne[0], G = t->src[0]->ne[1] / t->src[1]->ne[1], Tk = t->src[1]->ne[2];
    return (size_t)(2 * G * D + D + G * Tk + 6 * G + 64);
}

#if defined(__AVX2__)
// A cache row a few keys ahead, asked for now: a decode's rows are a stride apart (the other KV
// heads between them), and the loads of each would wait for memory
static inline void attn_prefetch(const void * row, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}
#endif

static inline const void * attn_kv_row(const struct kvr_tensor * t, int64_t g, int64_t j) {
    return (const uint8_t *)t->data + g * t->nb[1] + j * t->nb[2];
}

static void attn_row_f32(enum kvr_type type, const void * row, float * out, int64_t D) {
    type_to_float(type)(row, out, D);
}

// Values rounded to an F16 or BF16 cache's type in place (kvr_kv_operand_round): the tiled kernel's
// probabilities, a tile at a time; F16C does 8 at once (round to nearest even, as kvr_f32_to_half).
static void attn_round_to(enum kvr_type type, float * x, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; type == KVR_TYPE_F16 && i + 8 <= n; i += 8) {
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
    }
#endif
    for (; i < n; i++) x[i] = kvr_kv_operand_round(type, x[i]);
}

// A query row as a product with keys of this type sees it (f32 here).
static void attn_q_as(enum kvr_type type, const float * q, float * out, int64_t D) {
    if (type == KVR_TYPE_Q8_0) {
        for (int64_t b = 0; b < D / 32; b++) {
            struct kvr_block_q8_0 blk;
            kvr_kv_quant_q8_0(q + 32 * b, &blk);
            kvr_dequant_q8_0(&blk, out + 32 * b);
        }
        return;
    }
    memcpy(out, q, sizeof(float) * (size_t)D);
    attn_round_to(type, out, D);
}

//
// The reference kernels. Every op whose kernel below has a fast path (SIMD, BLAS, tiles, decode
// rows, llama.cpp's summation orders, 8-bit activations) has one here too: a plain loop in the
// obvious order, no SIMD, no BLAS, sums in double, weights converted to f32 a row at a time by
// their type's own conversion (section 5). A CPU backend runs these instead of the fast kernels
// when KVR_REF=1 is in the environment as it is made, or when kvr_backend_params.ref_kernels is
// set: the fast paths are checked against them (test-ops, test-quant), and they are what to
// switch to when a fast path is in doubt. Their own rounding is far below a fast path's, so the
// two differ by the fast path's summation order alone (and by the fp16 steps GELU can turn that
// into). GET_ROWS, ADD, MUL, ROPE, CPY, KV_STORE, MERGE_ATTN, MOE_ROUTE, MOE_SUM and SWIGLU_OAI
// have one kernel each, already plain, which both modes run. Threads split rows (or query rows)
// as the fast kernels do.
//

static void ref_unary(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const float s = get_param_f32(dst, 0);
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        for (int64_t i = 0; i < n; i++) {
            switch (dst->op) {
                case KVR_OP_SCALE: y[i] = x[i] * s;                                 break;
                case KVR_OP_SILU:  y[i] = (float)(x[i] / (1.0 + exp(-(double)x[i]))); break;
                case KVR_OP_GELU: // GGML's fp16 GELU is the op, or its f32 formula (kvr_gelu_exact)
                    y[i] = dst->op_params[0] ? kvr_gelu_tanh(x[i]) : kvr_gelu_ggml(x[i], NULL);
                    break;
                case KVR_OP_SOFTCAP: y[i] = (float)(s * tanh((double)x[i] / s)); break;
                case KVR_OP_SIGMOID:  y[i] = (float)(1.0 / (1.0 + exp(-(double)x[i]))); break;
                case KVR_OP_SOFTPLUS: y[i] = x[i] > 20.0f ? x[i] : (float)log1p(exp((double)x[i])); break;
                default:           KVR_ASSERT(!"not a unary op");
            }
        }
    }
}

static void ref_norm(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const double eps = get_param_f32(dst, 0);
    const bool rms = dst->op == KVR_OP_RMS_NORM;
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        double mean = 0.0, var = 0.0;
        if (!rms) {
            for (int64_t i = 0; i < n; i++) mean += x[i];
            mean /= (double)n;
        }
        for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
        const double scale = 1.0 / sqrt(var / (double)n + eps);
        for (int64_t i = 0; i < n; i++) y[i] = (float)((x[i] - mean) * scale);
    }
}

static bool ref_quantized(enum kvr_type t) {
    return kvr_blck_size(t) > 1;
}

// Tokens of activations the 8-bit reference quantizes at a time (its scratch holds them).
#define REF_Q8_TOKENS 16

// Floats of scratch a reference MUL_MAT takes: one weight row, and with 8-bit activations
// REF_Q8_TOKENS tokens' quants (as floats) with a scale and Q8_1's s per block of 32.
static size_t ref_mul_mat_floats(int64_t K, bool q8) {
    return (size_t)K + (q8 ? (size_t)REF_Q8_TOKENS * (size_t)(K + 2 * (K / KVR_QK)) + (size_t)K : 0);
}

// One token's activations rounded to 8 bits by ggml's rules, as the integer path below does
// (kvr_backend_params.q8_activations): per block of 32 for the legacy types (Q8_0: d = amax/127
// rounded to fp16, q = x * 127/amax rounded half to even; Q8_1's s = d * sum(q) rounded to
// fp16), per super-block of 256 for the k-quants (Q8_K: the value of largest magnitude, the first
// if tied, maps to -127, d = 1/scale in f32). q holds the quants, d the scale of each 32 values,
// s the s of each block of 32.
static void ref_quantize_act(enum kvr_type t, const float * x, int64_t K, float * q, float * d, float * s) {
    if (kvr_blck_size(t) == KVR_QK_K) { // the k-quants
        for (int64_t b = 0; b < K; b += KVR_QK_K) {
            float amax = 0.0f, max = 0.0f;
            for (int64_t j = 0; j < KVR_QK_K; j++) {
                if (fabsf(x[b + j]) > amax) { amax = fabsf(x[b + j]); max = x[b + j]; }
            }
            const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
            for (int64_t j = 0; j < KVR_QK_K; j++) {
                const float v = nearbyintf(iscale * x[b + j]);
                q[b + j] = v > 127.0f ? 127.0f : v;
            }
            for (int64_t j = 0; j < KVR_QK_K / KVR_QK; j++) {
                d[b / KVR_QK + j] = amax != 0.0f ? 1.0f / iscale : 0.0f;
                s[b / KVR_QK + j] = 0.0f;
            }
        }
    } else {
        for (int64_t b = 0; b < K; b += KVR_QK) {
            float amax = 0.0f;
            for (int64_t j = 0; j < KVR_QK; j++) amax = fabsf(x[b + j]) > amax ? fabsf(x[b + j]) : amax;
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            float sum = 0.0f;
            for (int64_t j = 0; j < KVR_QK; j++) {
                q[b + j] = nearbyintf(x[b + j] * id);
                sum += q[b + j];
            }
            d[b / KVR_QK] = kvr_half_to_f32(kvr_f32_to_half(amax / 127.0f));
            s[b / KVR_QK] = kvr_half_to_f32(kvr_f32_to_half(amax / 127.0f * sum));
        }
    }
}

// The min of block b of a Q4_1 or Q5_1 row (0 for the other types): those meet Q8_1's s, as in
// ggml's vec_dot (d d_a sum(q q_a) + m s), not the activations' own sum.
static float ref_block_min(enum kvr_type t, const void * row, int64_t b) {
    if (t == KVR_TYPE_Q4_1) return kvr_q_half(((const struct kvr_block_q4_1 *)row)[b].m);
    if (t == KVR_TYPE_Q5_1) return kvr_q_half(((const struct kvr_block_q5_1 *)row)[b].m);
    return 0.0f;
}

// Y[t][n] = W[n] . X[t] with 8-bit activations (see ref_quantize_act), every product exact in
// double: a block contributes d_a * sum(w q_a) (Q4_1/Q5_1: d_a * sum((w - m) q_a) + m s).
static void ref_mul_mat_q8(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], T = x->ne[1] * x->ne[2] * x->ne[3], nb = K / KVR_QK;
    KVR_ASSERT(ref_mul_mat_floats(K, true) <= p->wsize);
    const to_float_fn to_float = type_to_float(w->type);
    float * row = p->wdata, * q = row + K, * d = q + REF_Q8_TOKENS * K, * s = d + REF_Q8_TOKENS * nb;
    float * gather = s + REF_Q8_TOKENS * nb; // a tiled row in the file's layout (at most 4 bytes a value)
    int64_t n0, n1;
    row_range(N, p->ith, p->nth, &n0, &n1);
    for (int64_t t0 = 0; t0 < T && n1 > n0; t0 += REF_Q8_TOKENS) {
        const int64_t nt = T - t0 < REF_Q8_TOKENS ? T - t0 : REF_Q8_TOKENS;
        for (int64_t t = 0; t < nt; t++) {
            ref_quantize_act(w->type, row_ptr_flat(x, t0 + t), K, q + t * K, d + t * nb, s + t * nb);
        }
        for (int64_t n = n0; n < n1; n++) {
            const void * wr = w_row(w, n, gather);
            to_float(wr, row, K);
            for (int64_t t = 0; t < nt; t++) {
                double sum = 0.0;
                for (int64_t b = 0; b < nb; b++) {
                    const double m = ref_block_min(w->type, wr, b);
                    double blk = 0.0;
                    for (int64_t j = b * KVR_QK; j < (b + 1) * KVR_QK; j++) blk += (row[j] - m) * q[t * K + j];
                    sum += blk * d[t * nb + b] + m * s[t * nb + b];
                }
                ((float *)dst->data)[(t0 + t) * N + n] = (float)sum;
            }
        }
    }
    p->counters->matmul_flops += 2 * K * (n1 - n0) * T;
}

// Y[t][n] = W[n] . X[t]: each weight row converted to f32 once, then one dot per token.
static void ref_mul_mat(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1];
    KVR_ASSERT(kvr_is_contiguous(dst));
    if (p->q8_act && ref_quantized(w->type)) {
        ref_mul_mat_q8(p, dst);
        return;
    }
    const int64_t K = w->ne[0], N = w->ne[1], T = x->ne[1] * x->ne[2] * x->ne[3];
    KVR_ASSERT(ref_mul_mat_floats(K, false) <= p->wsize);
    float * row = p->wdata;
    int64_t n0, n1;
    row_range(N, p->ith, p->nth, &n0, &n1);
    for (int64_t n = n0; n < n1; n++) {
        w_row_f32(w, n, row);
        for (int64_t t = 0; t < T; t++) {
            const float * xt = row_ptr_flat(x, t);
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) sum += (double)row[k] * xt[k];
            ((float *)dst->data)[t * N + n] = (float)sum;
        }
    }
    p->counters->matmul_flops += 2 * K * (n1 - n0) * T;
}

// Floats of scratch a reference ATTN takes: a row of scores and an output row, in double; a typed
// cache's query, key and value rows in f32 beside them.
static size_t ref_attn_floats(int64_t D, int64_t Tk) {
    return 2 * (size_t)(Tk + D) + 3 * (size_t)D;
}

// Every (query token, head) on its own: the scores of the keys it sees, their softmax, the
// weighted sum of the values, and the log-sum-exp of the scores (kvr.h's ATTN). A row that sees
// no key has output 0 and log-sum-exp -inf. A typed cache: the query as the keys' type makes it
// (attn_q_as), keys and values turned to f32, and for F16/BF16 values the normalized
// probabilities rounded to that type (llama.cpp's mul_mat of V with them); sums still in double.
static void ref_attn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const double scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4);
    const int64_t W = dst->op_params[3];
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], G = H / k->ne[1];
    const int64_t Tk = attn_keys(kpos, k->ne[2]);
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL; // kvr_attn_sinks
    KVR_ASSERT(ref_attn_floats(D, Tk) <= p->wsize);
    double * sc = (double *)p->wdata, * o = sc + Tk;
    float * qx = (float *)(o + D), * kx = qx + D, * vx = kx + D;
    int64_t r0, r1;
    row_range(Tq * H, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i = r / H, h = r % H, g = h / G;
        const float * qr = row_ptr(q, h, i, 0);
        float * out = row_ptr(dst, i, 0, 0);
        if (k->type != KVR_TYPE_F32) {
            attn_q_as(k->type, qr, qx, D);
            qr = qx;
        }
        double mx = -INFINITY;
        for (int64_t j = 0; j < Tk; j++) {
            sc[j] = -INFINITY;
            if (!kvr_attn_visible(qpos[i], kpos[j], W)) continue;
            attn_row_f32(k->type, attn_kv_row(k, g, j), kx, D);
            double dot = 0.0;
            for (int64_t e = 0; e < D; e++) dot += (double)qr[e] * kx[e];
            sc[j] = cap > 0.0 ? cap * tanh(dot * scale / cap) : dot * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        // a sink is one more term of the denominator, with no value
        if (sink && sink[h] > mx) mx = sink[h];
        double sum = sink ? exp((double)sink[h] - mx) : 0.0;
        for (int64_t j = 0; j < Tk && mx > -INFINITY; j++) {
            if (sc[j] != -INFINITY) sum += exp(sc[j] - mx);
        }
        for (int64_t e = 0; e < D; e++) o[e] = 0.0;
        for (int64_t j = 0; j < Tk && mx > -INFINITY; j++) {
            if (sc[j] == -INFINITY) continue;
            double pj = exp(sc[j] - mx) / sum;
            if (v->type != KVR_TYPE_F32) pj = kvr_kv_operand_round(v->type, (float)pj);
            attn_row_f32(v->type, attn_kv_row(v, g, j), vx, D);
            for (int64_t e = 0; e < D; e++) o[e] += pj * vx[e];
        }
        for (int64_t e = 0; e < D; e++) out[h * D + e] = sum > 0.0 ? (float)o[e] : 0.0f;
        out[D * H + h] = sum > 0.0 ? (float)(mx + log(sum)) : -INFINITY;
    }
    if (p->ith == 0) {
        attn_count(dst->op_params[0], qpos, Tq, kvr_attn_tile_tokens(G), kpos, Tk, W,
                   &p->counters->attn_dot_dense, &p->counters->attn_dot_causal);
    }
}

// MoE: token t's j-th expert (a MOE_ROUTE row holds k weights, then k expert ids)
static inline int64_t moe_expert(const struct kvr_tensor * route, int64_t t, int64_t j) {
    return (int64_t)((const float *)row_ptr(route, t, 0, 0))[route->ne[0] / 2 + j];
}

static inline float moe_weight(const struct kvr_tensor * route, int64_t t, int64_t j) {
    return ((const float *)row_ptr(route, t, 0, 0))[j];
}

// the row of x that token t's j-th expert reads: x [K, T] shared by a token's experts, or [K, k, T]
// (T = 1: [K, 1] or [K, k, 1], the same where k = 1)
static inline const float * moe_x_row(const struct kvr_tensor * x, int64_t T, int64_t t, int64_t j) {
    return x->ne[2] == 1 && x->ne[1] == T ? row_ptr(x, t, 0, 0) : row_ptr(x, j, t, 0);
}

// Floats of scratch a reference MUL_MAT_ID takes: a weight row, and with 8-bit activations one
// token's quants with a scale and s per block of 32.
static size_t ref_mul_mat_id_floats(int64_t K, bool q8) {
    return (size_t)K + (q8 ? (size_t)(K + 2 * (K / KVR_QK)) : 0);
}

// Every (token, expert) pair on its own: y[n, j, t] = W_e[n] . x (+ b[n, e]), in double; the
// 8-bit activations as ref_mul_mat_q8 quantizes them, where asked for.
static void ref_mul_mat_id(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1], * route = dst->src[2], * b = dst->src[3];
    const int64_t K = w->ne[0], N = w->ne[1], E = w->ne[2], k = dst->ne[1], T = dst->ne[2], nb = K / KVR_QK;
    const bool q8 = p->q8_act && ref_quantized(w->type);
    KVR_ASSERT(ref_mul_mat_id_floats(K, q8) <= p->wsize);
    const to_float_fn to_float = type_to_float(w->type);
    float * row = p->wdata, * q = row + K, * d = q + K, * sc = d + nb;
    int64_t r0, r1;
    row_range(T * k, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / k, j = r % k, e = moe_expert(route, t, j);
        KVR_ASSERT(e >= 0 && e < E);
        const float * xt = moe_x_row(x, T, t, j);
        if (q8) ref_quantize_act(w->type, xt, K, q, d, sc);
        float * y = row_ptr(dst, j, t, 0);
        for (int64_t n = 0; n < N; n++) {
            const void * wr = row_ptr(w, n, e, 0);
            to_float(wr, row, K);
            double sum = 0.0;
            if (q8) {
                for (int64_t bi = 0; bi < nb; bi++) {
                    const double m = ref_block_min(w->type, wr, bi);
                    double blk = 0.0;
                    for (int64_t i = bi * KVR_QK; i < (bi + 1) * KVR_QK; i++) blk += (row[i] - m) * q[i];
                    sum += blk * d[bi] + m * sc[bi];
                }
            } else {
                for (int64_t i = 0; i < K; i++) sum += (double)row[i] * xt[i];
            }
            y[n] = (float)sum + (b ? ((const float *)row_ptr(b, e, 0, 0))[n] : 0.0f);
        }
        p->counters->matmul_flops += 2 * K * N;
    }
    // the bytes of the experts some token picked, once each (what the fast kernel reads)
    if (p->ith == 0) {
        for (int64_t e = 0; e < E; e++) {
            bool used = false;
            for (int64_t r = 0; r < T * k && !used; r++) used = moe_expert(route, r / k, r % k) == e;
            if (used) p->counters->expert_bytes += N * (int64_t)w->nb[1];
        }
    }
}

// SSM_CONV in double: each channel's taps over its history, then SiLU.
static void ref_ssm_conv(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * x = dst->src[0], * w = dst->src[1];
    float * state = dst->src[2]->data;
    const int64_t C = x->ne[0], T = x->ne[1], K = w->ne[0];
    const bool fresh = dst->op_params[0];
    int64_t c0, c1;
    row_range(C, p->ith, p->nth, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        const float * wc = row_ptr(w, c, 0, 0);
        float * st = state + c * (K - 1);
        for (int64_t t = 0; t < T; t++) {
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const int64_t j = t - (K - 1) + k; // the input's token; < 0: from the state
                const float xv = j >= 0 ? ((const float *)row_ptr(x, j, 0, 0))[c] : fresh ? 0.0f : st[K - 1 + j];
                sum += (double)wc[k] * xv;
            }
            ((float *)row_ptr(dst, t, 0, 0))[c] = (float)(sum / (1.0 + exp(-sum)));
        }
        // the last K-1 inputs, the newest last (with fewer than K-1 tokens, some of the old ones)
        for (int64_t i = 0; i < K - 1; i++) {
            const int64_t j = T - (K - 1) + i;
            st[i] = j >= 0 ? ((const float *)row_ptr(x, j, 0, 0))[c] : fresh ? 0.0f : st[i + T];
        }
    }
}

// GDN in double: every value head on its own, its state as floats between tokens (as stored).
static void ref_gdn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * g = dst->src[3], * b = dst->src[4];
    float * state = dst->src[5]->data;
    const int64_t Dk = q->ne[0], Hk = q->ne[1], Dv = v->ne[0], Hv = v->ne[1], T = v->ne[2];
    const double eps = get_param_f32(dst, 1), scale = 1.0 / sqrt((double)Dk);
    KVR_ASSERT((size_t)(4 * Dk) <= p->wsize);
    double * qn = (double *)p->wdata, * kn = qn + Dk;
    int64_t h0, h1;
    row_range(Hv, p->ith, p->nth, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) {
        float * S = state + h * Dv * Dk;
        if (dst->op_params[0]) memset(S, 0, sizeof(float) * (size_t)(Dv * Dk));
        for (int64_t t = 0; t < T; t++) {
            const float * qr = row_ptr(q, h % Hk, t, 0), * kr = row_ptr(k, h % Hk, t, 0), * vr = row_ptr(v, h, t, 0);
            double sq = 0.0, sk = 0.0;
            for (int64_t i = 0; i < Dk; i++) {
                sq += (double)qr[i] * qr[i];
                sk += (double)kr[i] * kr[i];
            }
            for (int64_t i = 0; i < Dk; i++) {
                qn[i] = qr[i] / sqrt(sq + eps);
                kn[i] = kr[i] / sqrt(sk + eps);
            }
            const double eg = exp((double)((const float *)row_ptr(g, t, 0, 0))[h]);
            const double beta = ((const float *)row_ptr(b, t, 0, 0))[h];
            float * o = row_ptr(dst, h, t, 0);
            for (int64_t j = 0; j < Dv; j++) {
                float * s = S + j * Dk;
                double kd = 0.0, od = 0.0;
                for (int64_t i = 0; i < Dk; i++) kd += eg * s[i] * kn[i];
                const double d = beta * (vr[j] - kd);
                for (int64_t i = 0; i < Dk; i++) {
                    s[i] = (float)(eg * s[i] + kn[i] * d);
                    od += (double)s[i] * qn[i];
                }
                o[j] = (float)(od * scale);
            }
        }
    }
}

// Floats of scratch every thread needs to run g's nodes through the reference kernels.
static size_t ref_scratch_floats(const struct kvr_graph * g, bool q8_act) {
    size_t need = 1024;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        size_t n = 0;
        if (t->op == KVR_OP_MUL_MAT) n = ref_mul_mat_floats(t->src[0]->ne[0], q8_act && ref_quantized(t->src[0]->type));
        if (t->op == KVR_OP_ATTN)    n = ref_attn_floats(t->src[0]->ne[0], t->src[1]->ne[2]);
        if (t->op == KVR_OP_MUL_MAT_ID) n = ref_mul_mat_id_floats(t->src[0]->ne[0], q8_act && ref_quantized(t->src[0]->type));
        if (t->op == KVR_OP_GDN)     n = 4 * (size_t)t->src[0]->ne[0];
        if (t->op == KVR_OP_ATTN_STATS || t->op == KVR_OP_ATTN_NORMED) n = attn_part_floats(t);
        if (n > need) need = n;
    }
    return need;
}

static void cpu_op_get_rows(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * ids = dst->src[1];
    int64_t r0, r1;
    row_range(ids->ne[0], p->ith, p->nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        const int32_t id = ((const int32_t *)ids->data)[i];
        KVR_ASSERT(id >= 0 && id < a->ne[1]); // token ids are checked against n_vocab at eval
        w_row_f32(a, id, row_ptr(dst, i, 0, 0)); // (a row of the file's, or gathered from tiles)
    }
}

// z = x + y or x * y element by element, y[0] for every element where one is true: the plain
// loop's values. z may be x or y (in place); GCC's -O2 leaves such loops scalar (vectorizing them
// needs a check that the arrays do not overlap), so the vectors are spelled out here.
static void vec_binary(bool add, const float * x, const float * y, bool one, float * z, int64_t n) {
    const float y0 = one ? y[0] : 0.0f; // read before z, which may be y, is written
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 y1 = _mm512_set1_ps(y0);
    for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_loadu_ps(x + i), b = one ? y1 : _mm512_loadu_ps(y + i);
        _mm512_storeu_ps(z + i, add ? _mm512_add_ps(a, b) : _mm512_mul_ps(a, b));
    }
#elif defined(__AVX__)
    const __m256 y1 = _mm256_set1_ps(y0);
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = one ? y1 : _mm256_loadu_ps(y + i);
        _mm256_storeu_ps(z + i, add ? _mm256_add_ps(a, b) : _mm256_mul_ps(a, b));
    }
#endif
    for (; i < n; i++) {
        const float b = one ? y0 : y[i];
        z[i] = add ? x[i] + b : x[i] * b;
    }
}

static void cpu_op_binary(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t n = a->ne[0];
    const bool bcast = kvr_nrows(b) == 1 && b->ne[0] == n;
    const bool scalar = b->ne[0] != n; // b holds one value a row (binary_op: ne0 1, a's rows)
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        const float * y = bcast ? (const float *)b->data : (const float *)row_ptr_flat(b, r);
        vec_binary(dst->op == KVR_OP_ADD, x, y, scalar, row_ptr_flat(dst, r), n);
    }
}

// exp of many values, the hot spot of the softmax and of SiLU. With AVX2+FMA: 8 at a time,
// n = round(x*log2(e)), r = x - n*ln2 in two parts (Cody-Waite), Cephes' degree-6 polynomial for
// e^r (about 1 ulp), scaled by 2^n through the exponent bits; x below -87.3 (and -inf) gives 0.
// its constants, which exp512 shares (16 lanes, the same steps)
#define EXP_LO     -87.3365478515625f
#define EXP_HI     88.3762626647949f
#define EXP_LOG2E  1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0     1.9875691500e-4f
#define EXP_P1     1.3981999507e-3f
#define EXP_P2     8.3334519073e-3f
#define EXP_P3     4.1665795894e-2f
#define EXP_P4     1.6666665459e-1f
#define EXP_P5     5.0000001201e-1f
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp256(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}
#endif

#if defined(__AVX512F__)
// e^x of 16 values, exp256's steps and constants; x below -87.3 (and -inf) gives 0 (the same
// bits as exp256, lane for lane).
static inline __m512 exp512(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}
#endif

#if !defined(__AVX512F__) // the sgemm-tiled attention's (AVX-512 builds run cpu_op_attn_lanes)
// s[j] = exp(s[j] - m); returns the sum (in f32, in order of 8-lane partial sums)
static float vec_exp_sub_sum(float * s, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static float vec_max(const float * s, int64_t n) {
    int64_t j = 0;
    float mx = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
#endif
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}
#endif

static float expf_ggml16(float x); // the attention's (below)

// SiLU as a llama.cpp built for AVX-512 computes it (kvr_backend_params.avx512_order), in its SILU
// and SWIGLU alike: x / (1 + ggml_v_expf(0 - x)) 16 lanes at a time, one value at a time here (the
// same operations: the same bits), and past the last multiple of 16 x / (1 + expf(-x)) with libm's
// expf (ggml_silu_f32).
static void vec_silu_ggml16(const float * x, float * y, int64_t n) {
    const int64_t nv = n & ~(int64_t)15;
    for (int64_t i = 0; i < nv; i++) y[i] = x[i] / (1.0f + expf_ggml16(0.0f - x[i]));
    for (int64_t i = nv; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
}

static void vec_silu(const float * x, float * y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) { // the 8-lane loop's operations, 16 at a time: the same bits
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(y + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
}

// GELU as GGML computes it on the CPU (kvr.h's kvr_gelu_ggml: fp16 in, fp16 out, the tails
// passed through), with the fp16 results of all 65536 inputs looked up in a table built once from
// kvr_gelu_half, as GGML does. The CUDA backend keeps a copy of the same table.
static uint16_t gelu_table[1 << 16];
static pthread_once_t gelu_table_once = PTHREAD_ONCE_INIT;

static void gelu_table_init(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) gelu_table[i] = kvr_gelu_half((uint16_t)i);
}

// kvr_gelu_ggml over n values with the table, 16 at a time where AVX-512 converts to and from fp16
// (round to nearest even, subnormals kept: kvr_f32_to_half's and kvr_half_to_f32's bits; a NaN's
// payload may differ, which the table's entry for it does not see) and the rest one by one.
static void vec_gelu_ggml(const float * x, float * y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        uint16_t h[16];
        _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (int k = 0; k < 16; k++) h[k] = gelu_table[h[k]];
        __m512 g = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        g = _mm512_mask_mov_ps(g, _mm512_cmp_ps_mask(v, _mm512_set1_ps(10.0f), _CMP_GE_OQ), v);
        g = _mm512_mask_mov_ps(g, _mm512_cmp_ps_mask(v, _mm512_set1_ps(-10.0f), _CMP_LE_OQ), _mm512_setzero_ps());
        _mm512_storeu_ps(y + i, g);
    }
#endif
    for (; i < n; i++) y[i] = kvr_gelu_ggml(x[i], gelu_table);
}

static void cpu_op_unary(const struct cpu_params * p, struct kvr_tensor * dst) {
    if (dst->op == KVR_OP_GELU && !dst->op_params[0]) pthread_once(&gelu_table_once, gelu_table_init);
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const float s = get_param_f32(dst, 0);
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        switch (dst->op) {
            case KVR_OP_SCALE:
                for (int64_t i = 0; i < n; i++) y[i] = x[i] * s;
                break;
            case KVR_OP_SILU:
                if (p->lanes16) vec_silu_ggml16(x, y, n);
                else            vec_silu(x, y, n);
                break;
            case KVR_OP_GELU:
                if (dst->op_params[0]) for (int64_t i = 0; i < n; i++) y[i] = kvr_gelu_tanh(x[i]);
                else                   vec_gelu_ggml(x, y, n);
                break;
            case KVR_OP_SOFTCAP:
                for (int64_t i = 0; i < n; i++) y[i] = kvr_softcap_f32(x[i], s);
                break;
            case KVR_OP_SIGMOID:
                for (int64_t i = 0; i < n; i++) y[i] = kvr_sigmoid_f32(x[i]);
                break;
            case KVR_OP_SOFTPLUS:
                for (int64_t i = 0; i < n; i++) y[i] = kvr_softplus_f32(x[i]);
                break;
            default:
                KVR_ASSERT(!"not a unary op");
        }
    }
}

#define RMS_NORM_ROWS 8

static void cpu_op_norm(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    const float eps = get_param_f32(dst, 0);
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    // RMS_NORM: each row's sum of squares in double, element after element, as GGML does, so long
    // rows agree with llama.cpp to the last bits. One such chain waits on each add's latency; the
    // sums of RMS_NORM_ROWS rows run side by side, each still in its own order.
    for (int64_t r = r0; dst->op == KVR_OP_RMS_NORM && r < r1; r += RMS_NORM_ROWS) {
        const int64_t nr = r1 - r < RMS_NORM_ROWS ? r1 - r : RMS_NORM_ROWS;
        const float * x[RMS_NORM_ROWS];
        double sum[RMS_NORM_ROWS];
        for (int64_t k = 0; k < RMS_NORM_ROWS; k++) {
            x[k] = row_ptr_flat(a, r + (k < nr ? k : 0));
            sum[k] = 0.0;
        }
        if (nr == RMS_NORM_ROWS) {
            for (int64_t i = 0; i < n; i++) {
                for (int64_t k = 0; k < RMS_NORM_ROWS; k++) sum[k] += (double)(x[k][i] * x[k][i]);
            }
        } else { // fewer rows (a decode's one, a batch's few): 4 side by side, then each alone
            int64_t k = 0;
            for (; k + 4 <= nr; k += 4) {
                double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
                const float * x0 = x[k], * x1 = x[k + 1], * x2 = x[k + 2], * x3 = x[k + 3];
                for (int64_t i = 0; i < n; i++) {
                    s0 += (double)(x0[i] * x0[i]);
                    s1 += (double)(x1[i] * x1[i]);
                    s2 += (double)(x2[i] * x2[i]);
                    s3 += (double)(x3[i] * x3[i]);
                }
                sum[k] = s0;
                sum[k + 1] = s1;
                sum[k + 2] = s2;
                sum[k + 3] = s3;
            }
            for (; k < nr; k++) {
                for (int64_t i = 0; i < n; i++) sum[k] += (double)(x[k][i] * x[k][i]);
            }
        }
        for (int64_t k = 0; k < nr; k++) {
            const float scale = 1.0f / sqrtf((float)(sum[k] / n) + eps);
            vec_binary(false, x[k], &scale, true, row_ptr_flat(dst, r + k), n);
        }
    }
    for (int64_t r = r0; dst->op == KVR_OP_NORM && r < r1; r++) {
        const float * x = row_ptr_flat(a, r);
        float * y = row_ptr_flat(dst, r);
        {
            // GGML's order: the mean is a float division of the rounded sum; the squares are
            // summed in float by groups of 8 lanes (lane i with i+4, then (0+2)+(1+3)) and the
            // group sums in double, the tail one by one
            double sum = 0.0;
            for (int64_t i = 0; i < n; i++) sum += (double)x[i];
            const float mean = (float)sum / (float)n;
            double var = 0.0;
            int64_t i = 0;
            for (; i + 7 < n; i += 8) {
                float sq[8];
                for (int j = 0; j < 8; j++) {
                    const float d = x[i + j] - mean;
                    y[i + j] = d;
                    sq[j] = d * d;
                }
                const float a0 = sq[0] + sq[4], a1 = sq[1] + sq[5], a2 = sq[2] + sq[6], a3 = sq[3] + sq[7];
                var += (double)((a0 + a2) + (a1 + a3));
            }
            for (; i < n; i++) {
                const float d = x[i] - mean;
                y[i] = d;
                var += (double)(d * d);
            }
            const float scale = 1.0f / sqrtf((float)(var / n) + eps);
            for (int64_t k = 0; k < n; k++) y[k] *= scale;
        }
    }
}

//
// the integer path (kvr_backend_params' q8_activations): 8-bit activations, integer products
//
// What llama.cpp's CPU backend does for every quantized matmul, here only where a caller asks for
// it, for prefill and decode alike: each token's activations are quantized once per matmul by
// ggml's rule for the weight type's partner (Q8_0 blocks of 32 for Q4_0, Q5_0 and Q8_0; Q8_1, which
// also carries d * sum(q), for Q4_1 and Q5_1; Q8_K super-blocks of 256 with sums per 16 for the
// k-quants), the weights' quants are multiplied by them in 8/16/32-bit integers, and the scales are
// applied once per block (legacy types) or super-block (k-quants). Exact in its integers, it differs
// from the exact path only by the rounding of the activations (logits move by up to ~0.1); the exact
// path stays the default and the one the outside references check.
//
// Why it is faster: AVX2's vpmaddubsw does 32 byte products per instruction against 8 f32 FMAs,
// and a 4-bit weight needs no conversion to float. Every type is seen through one form, so two
// kernels serve them all: per chunk of 32 elements, 32 bytes of quants in element order (unsigned
// 0..2^bits-1, or signed for the 8-bit types), and per block
//   legacy, 32 values:          x = d (q - off) + m       off 8 (Q4_0), 16 (Q5_0); m of Q4_1/Q5_1
//   k-quants, 256 in runs of 16: x = d sc_r q - dmin mn_r  (Q3_K, Q6_K: mn_r = off sc_r, dmin = d)
// The offsets and mins meet the activations' sums (one per block or per run of 16), never the
// products. Decode (a few tokens) takes each row once in its stored form and unpacks a block in
// registers for all of its tokens (qx_row_*); a prefill first interleaves 8 rows (qx_*_x8: lane i of
// every vector is row i), so 4 bytes of a token broadcast to all lanes feed 8 rows at once, and each
// interleaved block serves 4 tokens from registers and every token of the chunk from L2.

// A token's activations over one legacy block, by ggml's x86 rule for Q8_0 and Q8_1: d = amax/127
// rounded to fp16, q = x * (127/amax) rounded half to even, s = d * sum(q) rounded to fp16 (Q8_1's,
// what Q4_1/Q5_1 multiply their min by); sum is sum(q) itself, which takes the offsets of Q4_0/Q5_0
// off the integer sums exactly, as ggml's q - 8 does.
struct qx_q8 {
    int8_t  qs[KVR_QK];
    float   d, s;
    int32_t sum, pad;
};

// A token's activations over one super-block, by ggml's rule for Q8_K (quantize_row_q8_K_ref, which
// x86 runs): the value of largest magnitude (the first, if tied) maps to -127, the rest round half to
// even at that scale, d in f32; bsum holds the sums of each 16 quants.
struct qx_q8K {
    float   d;
    int16_t bsum[16];
    int8_t  qs[KVR_QK_K];
};

static bool qx_is_k(enum kvr_type t) {
    return t == KVR_TYPE_Q2_K || t == KVR_TYPE_Q3_K || t == KVR_TYPE_Q4_K || t == KVR_TYPE_Q5_K ||
           t == KVR_TYPE_Q6_K || t == KVR_TYPE_Q8_K;
}

static bool qx_is_legacy(enum kvr_type t) {
    return t == KVR_TYPE_Q4_0 || t == KVR_TYPE_Q4_1 || t == KVR_TYPE_Q5_0 || t == KVR_TYPE_Q5_1 ||
           t == KVR_TYPE_Q8_0 || t == KVR_TYPE_Q8_1;
}

// Bytes of one token's quantized activations over K values.
static size_t qx_act_bytes(enum kvr_type t, int64_t K) {
    return qx_is_k(t) ? (size_t)(K / KVR_QK_K) * sizeof(struct qx_q8K) : (size_t)(K / KVR_QK) * sizeof(struct qx_q8);
}

static float qx_round_half(float v) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); // the same rounding, one instruction each way
#else
    return kvr_half_to_f32(kvr_f32_to_half(v));
#endif
}

static void qx_quantize_q8(const float * restrict x, struct qx_q8 * restrict y, int64_t n) {
    for (int64_t b = 0; b < n / KVR_QK; b++, x += KVR_QK, y++) {
        float amax = 0.0f;
        int32_t sum = 0;
#if defined(__AVX512F__)
        // the AVX2 steps below in two 16-lane vectors: a max and an integer sum are the same in any order
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        _mm_storeu_si128((__m128i *)y->qs, _mm512_cvtepi32_epi8(q0)); // |q| <= 127: no saturation to need
        _mm_storeu_si128((__m128i *)(y->qs + 16), _mm512_cvtepi32_epi8(q1));
#elif defined(__AVX2__)
        __m256 v[4];
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 vm = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i hs = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0x4e));
        hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0xb1));
        sum = _mm_cvtsi128_si32(hs);
        // packs interleave the 128-bit lanes: 4-byte groups come out as 0,2,4,6,1,3,5,7
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)y->qs, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int j = 0; j < KVR_QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < KVR_QK; j++) {
            const int v = (int)nearbyintf(x[j] * id);
            y->qs[j] = (int8_t)v;
            sum += v;
        }
#endif
        const float d = amax / 127.0f;
        y->d = qx_round_half(d);
        y->s = qx_round_half(d * (float)sum);
        y->sum = sum;
        y->pad = 0;
    }
}

static void qx_quantize_q8K(const float * restrict x, struct qx_q8K * restrict y, int64_t n) {
    for (int64_t b = 0; b < n / KVR_QK_K; b++, x += KVR_QK_K, y++) {
        float amax = 0.0f;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 vm = _mm256_setzero_ps();
        for (int j = 0; j < KVR_QK_K; j += 8) vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
#else
        for (int j = 0; j < KVR_QK_K; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
#endif
        if (amax == 0.0f) {
            memset(y, 0, sizeof(*y));
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < KVR_QK_K; j++) {
            if (fabsf(x[j]) == amax) { max = x[j]; break; }
        }
        const float iscale = -127.0f / max;
#if defined(__AVX2__)
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int sb = 0; sb < 8; sb++) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_mul_ps(vs, _mm256_loadu_ps(x + 32 * sb + 8 * k));
                q[k] = _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            }
            for (int hh = 0; hh < 2; hh++) {
                const __m256i s = _mm256_add_epi32(q[2 * hh], q[2 * hh + 1]);
                __m128i hs = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0x4e));
                hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0xb1));
                y->bsum[2 * sb + hh] = (int16_t)_mm_cvtsi128_si32(hs);
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(y->qs + 32 * sb), _mm256_permutevar8x32_epi32(p, order));
        }
#else
        for (int j = 0; j < KVR_QK_K; j++) {
            const int v = q_nearest_int(iscale * x[j]);
            y->qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int r = 0; r < 16; r++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y->qs[16 * r + j];
            y->bsum[r] = (int16_t)sum;
        }
#endif
        y->d = 1.0f / iscale;
    }
}

// One token's activations for weights of type t: K values into act (qx_act_bytes).
static void qx_quantize(enum kvr_type t, const float * x, void * act, int64_t K) {
    if (qx_is_k(t)) qx_quantize_q8K(x, act, K);
    else            qx_quantize_q8(x, act, K);
}

// The canonical form of the types' blocks (see above). Everything here is inlined into kernels
// made for one type, so the switches over the type fold away.
#define QX_INLINE static inline __attribute__((always_inline, unused))
// The token loops of the kernels are unrolled, so that each token's sums live in registers (-O2
// alone leaves the arrays of vectors in memory).
#define QX_UNROLL _Pragma("GCC unroll 8")

QX_INLINE size_t qx_block_bytes(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q4_0: return sizeof(struct kvr_block_q4_0);
        case KVR_TYPE_Q4_1: return sizeof(struct kvr_block_q4_1);
        case KVR_TYPE_Q5_0: return sizeof(struct kvr_block_q5_0);
        case KVR_TYPE_Q5_1: return sizeof(struct kvr_block_q5_1);
        case KVR_TYPE_Q8_0: return sizeof(struct kvr_block_q8_0);
        case KVR_TYPE_Q8_1: return sizeof(struct kvr_block_q8_1);
        case KVR_TYPE_Q2_K: return sizeof(struct kvr_block_q2_K);
        case KVR_TYPE_Q3_K: return sizeof(struct kvr_block_q3_K);
        case KVR_TYPE_Q4_K: return sizeof(struct kvr_block_q4_K);
        case KVR_TYPE_Q5_K: return sizeof(struct kvr_block_q5_K);
        case KVR_TYPE_Q6_K: return sizeof(struct kvr_block_q6_K);
        default:            return sizeof(struct kvr_block_q8_K);
    }
}

// the 8-bit types' quants are signed (the kernels multiply |q| by the activations with q's sign)
QX_INLINE bool qx_signed(enum kvr_type t) {
    return t == KVR_TYPE_Q8_0 || t == KVR_TYPE_Q8_1 || t == KVR_TYPE_Q8_K;
}

// the legacy offset: x = d (q - off)
QX_INLINE int qx_offset(enum kvr_type t) {
    return t == KVR_TYPE_Q4_0 ? 8 : t == KVR_TYPE_Q5_0 ? 16 : 0;
}

// the legacy types with a min (x = d q + m)
QX_INLINE bool qx_has_min(enum kvr_type t) {
    return t == KVR_TYPE_Q4_1 || t == KVR_TYPE_Q5_1;
}

// an fp16 scale (F16C converts it in one instruction)
QX_INLINE float qx_half(const uint8_t * p) {
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
#else
    return kvr_q_half(p);
#endif
}

// A legacy block's d and m (0 without a min).
QX_INLINE void qx_legacy_dm(enum kvr_type t, const uint8_t * blk, float * d, float * m) {
    *d = qx_half(blk); // d is every legacy block's first field
    *m = t == KVR_TYPE_Q4_1 ? qx_half(((const struct kvr_block_q4_1 *)blk)->m)
       : t == KVR_TYPE_Q5_1 ? qx_half(((const struct kvr_block_q5_1 *)blk)->m) : 0.0f;
}

// A super-block's scales: x = d sc[r] q - dmin mn[r] over run r of 16 values.
struct qx_sc {
    float   d, dmin;
    int16_t sc[16], mn[16];
};

QX_INLINE void qx_k_scales(enum kvr_type t, const uint8_t * blk, struct qx_sc * s) {
    switch (t) {
        case KVR_TYPE_Q2_K: {
            const struct kvr_block_q2_K * b = (const void *)blk;
            s->d = qx_half(b->d);
            s->dmin = qx_half(b->dmin);
            for (int r = 0; r < 16; r++) {
                s->sc[r] = (int16_t)(b->scales[r] & 0x0f);
                s->mn[r] = (int16_t)(b->scales[r] >> 4);
            }
            break;
        }
        case KVR_TYPE_Q3_K: {
            const struct kvr_block_q3_K * b = (const void *)blk;
            int sc[16];
            kvr_q3_scales(b->scales, sc);
            s->d = s->dmin = qx_half(b->d);
            for (int r = 0; r < 16; r++) {
                s->sc[r] = (int16_t)(sc[r] - 32);
                s->mn[r] = (int16_t)(4 * (sc[r] - 32));
            }
            break;
        }
        case KVR_TYPE_Q4_K:
        case KVR_TYPE_Q5_K: {
            // the two types share d, dmin and the 12 bytes of scales at the start of a block
            const struct kvr_block_q4_K * b = (const void *)blk;
            int sc[8], mn[8];
            kvr_k4_scales(b->scales, sc, mn);
            s->d = qx_half(b->d);
            s->dmin = qx_half(b->dmin);
            for (int r = 0; r < 16; r++) {
                s->sc[r] = (int16_t)sc[r / 2];
                s->mn[r] = (int16_t)mn[r / 2];
            }
            break;
        }
        case KVR_TYPE_Q6_K: {
            const struct kvr_block_q6_K * b = (const void *)blk;
            s->d = s->dmin = qx_half(b->d);
            for (int r = 0; r < 16; r++) {
                s->sc[r] = (int16_t)b->scales[r];
                s->mn[r] = (int16_t)(32 * b->scales[r]);
            }
            break;
        }
        default: { // Q8_K
            const struct kvr_block_q8_K * b = (const void *)blk;
            s->d = kvr_f32_of_bits(kvr_q_u32le(b->d));
            s->dmin = 0.0f;
            for (int r = 0; r < 16; r++) {
                s->sc[r] = 1;
                s->mn[r] = 0;
            }
            break;
        }
    }
}

// Q3_K and Q6_K: the mins are an offset times the scales (dmin = d), subtracted in integers
QX_INLINE bool qx_k_offset(enum kvr_type t) {
    return t == KVR_TYPE_Q3_K || t == KVR_TYPE_Q6_K;
}

// Flush period of the 8-row kernels: how many 4-byte groups of products an int16 lane may sum
// before it goes to int32 (F * 2 * qmax * 127 <= 32767, and no run of one scale is split: runs are 4
// groups for the per-16 types, 8 for Q4_K; a legacy block is 8).
QX_INLINE int qx_flush(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q4_0: case KVR_TYPE_Q4_1: case KVR_TYPE_Q4_K: return 8; // 8 * 2 * 15 * 127 = 30480
        case KVR_TYPE_Q6_K:                                         return 2; // 2 * 2 * 63 * 127 = 32004
        case KVR_TYPE_Q8_0: case KVR_TYPE_Q8_1: case KVR_TYPE_Q8_K: return 1; // 2 * 128 * 127 = 32512
        default:                                                    return 4; // 5 bits: 31496; Q2_K/Q3_K: per-16 runs
    }
}

// Tokens a pass of the decode kernels over a row: a decode batch (KVR_MM_ROWS) goes through them
// this many at a time (their sums then live in registers), each token summed as one token alone.
#define QX_BATCH_GROUP 4

// 512-bit vectors with AVX-512BW, VL and VNNI: the prompt kernels' 8 rows side by side, and the
// decode kernels' pairs of tokens side by side
#define QX_L512 QX_TILES

// Bytes of a single token's activations in the arrays of the legacy decode kernel (struct qx_t1,
// below), a whole number of cache lines, so that each token's arrays start on one.
static size_t qx_t1_bytes(int64_t nb) {
    return ((size_t)nb * (KVR_QK + 3 * 4) + 63) & ~(size_t)63;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// Byte l of the result: val where bit `bit` of byte l of v is set, else 0.
static inline __m256i qx_bit(__m256i v, int bit, int val) {
    const __m256i m = _mm256_set1_epi8((char)(1 << bit));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(v, m), _mm256_set1_epi8((char)val)); // the bits as a mask register
#else
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, m), m), _mm256_set1_epi8((char)val));
#endif
}

// Byte l of the result: 0x10 if bit l of bits is set (the 5th bit of Q5_0/Q5_1 element l).
static inline __m256i qx_bits32(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10)); // the 32 bits are a byte mask as they are
#else
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
#endif
}

// The 16 bytes of a legacy block's nibbles as its 32 quants (low nibbles: elements 0..15).
static inline __m256i qx_nibbles(const uint8_t * qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

static inline __m256i qx_shr(__m256i v, int n, int mask) { // the bytes of v >> n, & mask
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8((char)mask));
}

// The quants of elements 32j..32j+31 of a block, in element order (j = 0 for the legacy types).
QX_INLINE __m256i qx_chunk(enum kvr_type t, const uint8_t * blk, int j) {
    switch (t) {
        case KVR_TYPE_Q4_0: return qx_nibbles(((const struct kvr_block_q4_0 *)blk)->qs);
        case KVR_TYPE_Q4_1: return qx_nibbles(((const struct kvr_block_q4_1 *)blk)->qs);
        case KVR_TYPE_Q5_0: {
            const struct kvr_block_q5_0 * b = (const void *)blk;
            return _mm256_or_si256(qx_nibbles(b->qs), qx_bits32(kvr_q_u32le(b->qh)));
        }
        case KVR_TYPE_Q5_1: {
            const struct kvr_block_q5_1 * b = (const void *)blk;
            return _mm256_or_si256(qx_nibbles(b->qs), qx_bits32(kvr_q_u32le(b->qh)));
        }
        case KVR_TYPE_Q8_0: return _mm256_loadu_si256((const __m256i *)((const struct kvr_block_q8_0 *)blk)->qs);
        case KVR_TYPE_Q8_1: return _mm256_loadu_si256((const __m256i *)((const struct kvr_block_q8_1 *)blk)->qs);
        case KVR_TYPE_Q2_K: {
            // element 128h + 32k + l: bits 2k, 2k+1 of qs[32h + l]
            const struct kvr_block_q2_K * b = (const void *)blk;
            return qx_shr(_mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 4))), 2 * (j % 4), 3);
        }
        case KVR_TYPE_Q3_K: {
            // as Q2_K, plus 4 where bit j of hmask[l] is set
            const struct kvr_block_q3_K * b = (const void *)blk;
            const __m256i lo = qx_shr(_mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 4))), 2 * (j % 4), 3);
            return _mm256_or_si256(lo, qx_bit(_mm256_loadu_si256((const __m256i *)b->hmask), j, 4));
        }
        case KVR_TYPE_Q4_K: {
            // qs[32c..32c+31]: chunk 2c in the low nibbles, 2c+1 in the high ones
            const struct kvr_block_q4_K * b = (const void *)blk;
            return qx_shr(_mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 2))), 4 * (j % 2), 0x0f);
        }
        case KVR_TYPE_Q5_K: {
            const struct kvr_block_q5_K * b = (const void *)blk;
            const __m256i lo = qx_shr(_mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 2))), 4 * (j % 2), 0x0f);
            return _mm256_or_si256(lo, qx_bit(_mm256_loadu_si256((const __m256i *)b->qh), j, 16));
        }
        case KVR_TYPE_Q6_K: {
            // element 128h + 32k + l: low 4 bits from ql[64h + 32(k&1) + l] (high nibble if k >= 2),
            // high 2 from qh[32h + l] >> 2k
            const struct kvr_block_q6_K * b = (const void *)blk;
            const int h = j / 4, k = j % 4;
            const __m256i lo = qx_shr(_mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (k & 1))), 4 * (k / 2), 0x0f);
            const __m256i hi = qx_shr(_mm256_loadu_si256((const __m256i *)(b->qh + 32 * h)), 2 * k, 3);
            return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
        default: // Q8_K
            return _mm256_loadu_si256((const __m256i *)(((const struct kvr_block_q8_K *)blk)->qs + 32 * j));
    }
}

// Q4_K/Q5_K's 12 bytes of scales as bytes: the 8 scales, then the 8 mins (see kvr_k4_scales), in
// vector instructions: dword 0 holds scales 0-3 (low 6 bits of bytes 0-3), 1 scales 4-7 (low
// nibbles of bytes 8-11, bits 6-7 of bytes 0-3 above them), 2 mins 0-3 (bytes 4-7), 3 mins 4-7
// (high nibbles of bytes 8-11, bits 6-7 of bytes 4-7). Reads 16 bytes: the block's quants follow.
static inline __m128i qx_k4_scales(const uint8_t * s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m128i w01 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), w2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2));
    const __m128i lo = _mm_and_si128(w01, _mm_set1_epi8(0x3f));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(w2, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi8(0x0f)),
                                    _mm_and_si128(_mm_srli_epi32(w01, 2), _mm_set1_epi8(0x30)));
    return _mm_blend_epi32(lo, hi, 0xa);
}

// A super-block's scales in registers: lane r of sc and mn (16 int16 lanes) is run r's.
QX_INLINE void qx_k_scales_v(enum kvr_type t, const uint8_t * blk, float * d, float * dmin, __m256i * sc, __m256i * mn) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    switch (t) {
        case KVR_TYPE_Q2_K: {
            const struct kvr_block_q2_K * b = (const void *)blk;
            const __m128i v = _mm_loadu_si128((const __m128i *)b->scales);
            *d = qx_half(b->d);
            *dmin = qx_half(b->dmin);
            *sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
            *mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4));
            break;
        }
        case KVR_TYPE_Q3_K: {
            // scale j: low 4 bits in nibble j/8 of byte j%8, high 2 at bit 2(j/4) of byte 8 + j%4
            const struct kvr_block_q3_K * b = (const void *)blk;
            const __m128i v = _mm_loadl_epi64((const __m128i *)b->scales);
            const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
            const __m128i hb = _mm_set1_epi32((int)kvr_q_u32le(b->scales + 8));
            const __m128i hi = _mm_and_si128(_mm_srlv_epi32(hb, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
            *d = *dmin = qx_half(b->d);
            *sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)));
            *mn = _mm256_slli_epi16(*sc, 2);
            break;
        }
        case KVR_TYPE_Q4_K:
        case KVR_TYPE_Q5_K: {
            const struct kvr_block_q4_K * b = (const void *)blk;
            const __m128i sm = qx_k4_scales(b->scales);
            *d = qx_half(b->d);
            *dmin = qx_half(b->dmin);
            *sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm, sm)); // a scale of 32 serves two runs
            *mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
            break;
        }
        case KVR_TYPE_Q6_K: {
            const struct kvr_block_q6_K * b = (const void *)blk;
            *d = *dmin = qx_half(b->d);
            *sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
            *mn = _mm256_slli_epi16(*sc, 5);
            break;
        }
        default: { // Q8_K
            const struct kvr_block_q8_K * b = (const void *)blk;
            *d = kvr_f32_of_bits(kvr_q_u32le(b->d));
            *dmin = 0.0f;
            *sc = _mm256_set1_epi16(1);
            *mn = _mm256_setzero_si256();
            break;
        }
    }
}

// acc + the sums of 4 products of u's unsigned bytes and s's signed ones, per 32-bit lane: one
// instruction with VNNI (AVX512-VNNI with VL, or AVX-VNNI), else vpmaddubsw then vpmaddwd. The
// same integers either way wherever the kernels use it: vpmaddubsw's int16 pairs never saturate
// there (|q| <= 31 against |y| <= 127, or the 8-bit types' |q| <= 128 against signed y: at most
// 2 * 128 * 127 = 32512).
static inline __m256i qx_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define QX_VNNI 1
#else
#define QX_VNNI 0
#endif

static inline float qx_hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// A single token's activations for the decode kernel of the legacy types (qx_row_t1), as arrays:
// the quants, then each block's d, s and sum (struct qx_q8's fields), so 8 blocks' scales are one
// load. For the 4-bit types, the quants of each two blocks 2p, 2p+1 (of the first nb - nb % 8) trade
// halves: block 2p's 32 bytes hold both blocks' elements 0..15 (what the low nibbles of the two
// blocks' bytes, loaded as one vector, multiply), block 2p+1's their elements 16..31.
struct qx_t1 {
    const int8_t  * qs;
    const float   * d, * s;
    const int32_t * sum;
    const uint8_t * pair; // QX_L512, Q4_0/Q4_1: this token's and the next one's arrays side by side
                          //   (qx_t2_init; NULL: none, the token goes alone)
};

// Two tokens' arrays side by side for the 4-bit types' first nb - nb % 8 blocks (QX_L512): per 8
// blocks, the 8 chunks of 32 quants the kernel loads (y + 64 pr, y + 64 pr + 32), each the first
// token's then the second's (64 bytes), then their d, s and sum, 8 of the first and 8 of the second.
#define QX_T2_GROUP (8 * 64 + 3 * 64)
static size_t qx_t2_bytes(int64_t nb) {
    return ((size_t)(nb / 8) * QX_T2_GROUP + 63) & ~(size_t)63;
}

static void qx_t2_init(const struct qx_t1 * a, const struct qx_t1 * b, int64_t nb, uint8_t * mem) {
    for (int64_t b8 = 0; b8 < nb / 8; b8++) {
        uint8_t * g = mem + (size_t)b8 * QX_T2_GROUP;
        for (int c = 0; c < 8; c++) {
            memcpy(g + 64 * c, a->qs + KVR_QK * 8 * b8 + 32 * c, 32);
            memcpy(g + 64 * c + 32, b->qs + KVR_QK * 8 * b8 + 32 * c, 32);
        }
        const void * src[3][2] = { { a->d + 8 * b8, b->d + 8 * b8 }, { a->s + 8 * b8, b->s + 8 * b8 }, { a->sum + 8 * b8, b->sum + 8 * b8 } };
        for (int f = 0; f < 3; f++) {
            memcpy(g + 512 + 64 * f, src[f][0], 32);
            memcpy(g + 512 + 64 * f + 32, src[f][1], 32);
        }
    }
}

// How far ahead of its reads a decode kernel prefetches its row, in bytes: `kvr-bench --kernels
// q4_0,q8_0 --q8-act` out of cache with 2 threads took Q8_0 from 25 to 34 GB/s at 1024 (256: 28,
// 512: 32, 2048 and 4096: 27-29) and Q4_0 from 24 to 28-30, where its arithmetic is the limit.
#define QX_PREFETCH 1024

QX_INLINE bool qx_pairs(enum kvr_type t) {
    return t == KVR_TYPE_Q4_0 || t == KVR_TYPE_Q4_1;
}

// The arrays of one token at mem (qx_t1_bytes(nb) bytes), as qx_t1_init leaves them.
static struct qx_t1 qx_t1_at(void * mem, int64_t nb) {
    int8_t * qs = mem;
    float * d = (float *)(qs + nb * KVR_QK), * s = d + nb;
    return (struct qx_t1){ qs, d, s, (const int32_t *)(s + nb), NULL };
}

static void qx_t1_init(enum kvr_type type, const struct qx_q8 * a, int64_t nb, void * mem) {
    int8_t * qs = mem;
    float * d = (float *)(qs + nb * KVR_QK), * s = d + nb;
    int32_t * sum = (int32_t *)(s + nb);
    const int64_t np = qx_pairs(type) ? nb - nb % 8 : 0;
    for (int64_t b = 0; b < nb; b++) {
        if (b < np) { // pairs: block b's half h goes to half b & 1 of block (b & ~1) + h
            const int64_t p = b & ~(int64_t)1;
            memcpy(qs + KVR_QK * p + 16 * (b & 1), a[b].qs, 16);
            memcpy(qs + KVR_QK * (p + 1) + 16 * (b & 1), a[b].qs + 16, 16);
        } else {
            memcpy(qs + KVR_QK * b, a[b].qs, KVR_QK);
        }
        d[b] = a[b].d;
        s[b] = a[b].s;
        sum[b] = a[b].sum;
    }
}

// eight fp16 fields bs bytes apart as 8 floats
static inline __m256 qx_half8(const uint8_t * p, size_t bs) {
    // assembled in registers: eight 2-byte stores read back as one load would stall
    uint64_t u[2] = { 0, 0 };
    QX_UNROLL
    for (int k = 0; k < 8; k++) {
        uint16_t h;
        memcpy(&h, p + k * bs, 2);
        u[k / 4] |= (uint64_t)h << (16 * (k % 4));
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)u[1], (long long)u[0]));
}

#if QX_L512
// _mm256_hadd_epi32 in each 256-bit half: per 128-bit lane a0+a1, a2+a3, b0+b1, b2+b3
static inline __m512i qx_hadd512(__m512i a, __m512i b) {
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0))),
                            _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1))));
}
#endif

// row . token t over nb legacy blocks for nt tokens (1..QX_BATCH_GROUP; a[t]: token t's arrays),
// 8 blocks a step: their integer sums meet in one vector (horizontal adds), so the scales, offsets
// and mins go 8 at a time from the qx_t1 arrays, and the 4-bit types take two blocks' nibbles per
// vector. One token is a decode; more are a decode batch (KVR_MM_ROWS), where the row's loads,
// nibbles, high bits and fp16 scales are taken once for all of them and each token then runs the
// very operations one token alone runs, in the same order: out[t] is the one-token result to the
// last bit. The integers are sum(q y) - off sum(y) per block, exact; the f32 sums go in 8 lanes,
// one horizontal sum, then the last nb % 8 blocks in element order.
QX_INLINE void qx_row_t1(enum kvr_type type, int nt, const uint8_t * row, int64_t nb, const struct qx_t1 * a, float * out) {
    const size_t bs = qx_block_bytes(type);
    const bool sgn = qx_signed(type);
    const int off = qx_offset(type);
    const size_t qs_off = type == KVR_TYPE_Q4_0 ? offsetof(struct kvr_block_q4_0, qs) : offsetof(struct kvr_block_q4_1, qs);
    const size_t m_off = type == KVR_TYPE_Q4_1 ? offsetof(struct kvr_block_q4_1, m) : offsetof(struct kvr_block_q5_1, m);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    (void)ones; // not with VNNI
    __m256 acc[QX_BATCH_GROUP], accm[QX_BATCH_GROUP];
    QX_UNROLL
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    const int64_t n8 = nb - nb % 8;
#if QX_L512
    // two tokens side by side (a[t].pair, qx_t2_init) for the 4-bit types: one 512-bit vector holds
    // both tokens' integer sums and float steps, each half lane for lane what the token alone runs
    const bool two = qx_pairs(type) && nt >= 2;
    const int t_alone = two ? nt - nt % 2 : 0;
    __m512 acc2[QX_BATCH_GROUP / 2], accm2[QX_BATCH_GROUP / 2];
    QX_UNROLL
    for (int tp = 0; tp < QX_BATCH_GROUP / 2; tp++) acc2[tp] = accm2[tp] = _mm512_setzero_ps();
#else
    const int t_alone = 0;
#endif
    for (int64_t b = 0; b < n8; b += 8) {
        const uint8_t * blk = row + (size_t)b * bs;
        // software prefetch QX_PREFETCH bytes ahead (into the next rows at a row's end): the one
        // stream of a thread keeps more lines in flight than the hardware prefetchers alone
        for (size_t o = 0; o < 8 * bs; o += 64) _mm_prefetch((const char *)blk + QX_PREFETCH + o, _MM_HINT_T0);
#if defined(__AVX512VL__) && defined(__AVX512BW__)
        // the 8 blocks' first 4 bytes in one gather: d (and the min m right after it, Q4_1/Q5_1)
        const __m256i dm = _mm256_i32gather_epi32((const int *)blk, _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                                                         _mm256_set1_epi32((int)bs)), 1);
        const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
        const __m256 mw = qx_has_min(type) ? _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16))) : _mm256_setzero_ps();
        (void)m_off;
#else
        const __m256 dw = qx_half8(blk, bs);
        const __m256 mw = qx_has_min(type) ? qx_half8(blk + m_off, bs) : _mm256_setzero_ps();
#endif
        __m256i h[QX_BATCH_GROUP];
#if QX_L512
        if (two) {
            const __m512i m4x = _mm512_set1_epi8(0x0f);
            __m512i lo2[4], hi2[4];
            QX_UNROLL
            for (int pr = 0; pr < 4; pr++) { // both 256-bit halves: block 2pr's quants, then 2pr+1's
                const uint8_t * x0 = blk + 2 * pr * bs;
                const __m512i w = _mm512_mask_blend_epi32(0xF0F0, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x0 + qs_off))),
                                                          _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x0 + bs + qs_off))));
                lo2[pr] = _mm512_and_si512(w, m4x);
                hi2[pr] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4x);
            }
            const __m512 dw2 = _mm512_insertf32x8(_mm512_castps256_ps512(dw), dw, 1);
            const __m512 mw2 = _mm512_insertf32x8(_mm512_castps256_ps512(mw), mw, 1);
            const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
            QX_UNROLL
            for (int tp = 0; tp + 1 < nt; tp += 2) {
                const uint8_t * g = a[tp].pair + (size_t)(b / 8) * QX_T2_GROUP;
                __m512i P[4];
                QX_UNROLL
                for (int pr = 0; pr < 4; pr++) {
                    P[pr] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo2[pr], _mm512_loadu_si512(g + 128 * pr)),
                                                hi2[pr], _mm512_loadu_si512(g + 128 * pr + 64));
                }
                __m512i h2 = _mm512_permutexvar_epi32(order, qx_hadd512(qx_hadd512(P[0], P[1]), qx_hadd512(P[2], P[3])));
                if (off) h2 = _mm512_sub_epi32(h2, _mm512_slli_epi32(_mm512_loadu_si512(g + 512 + 128), off == 8 ? 3 : 4));
                acc2[tp / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h2), _mm512_mul_ps(dw2, _mm512_loadu_ps((const float *)(g + 512))), acc2[tp / 2]);
                if (qx_has_min(type)) accm2[tp / 2] = _mm512_fmadd_ps(mw2, _mm512_loadu_ps((const float *)(g + 512 + 64)), accm2[tp / 2]);
            }
            if (t_alone == nt) continue;
        }
#endif
        // the tokens from t_alone on, one at a time (with pairs: the last of an odd count)
        if (qx_pairs(type)) {
            __m256i lo[4], hi[4];
            QX_UNROLL
            for (int pr = 0; pr < 4; pr++) {
                const uint8_t * x0 = blk + 2 * pr * bs;
                const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x0 + qs_off))),
                                                          _mm_loadu_si128((const __m128i *)(x0 + bs + qs_off)), 1);
                lo[pr] = _mm256_and_si256(w, m4);
                hi[pr] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            }
            QX_UNROLL
            for (int t = t_alone; t < nt; t++) {
                const int8_t * y = a[t].qs + KVR_QK * b;
#if defined(QX_VNNI)
                // int32 lanes 0-3: block 2pr's sums of 8 products, 4-7: block 2pr+1's; three
                // horizontal adds leave the sums of blocks 0 2 4 6 | 1 3 5 7, put in order
                __m256i P[4];
                QX_UNROLL
                for (int pr = 0; pr < 4; pr++) {
                    P[pr] = qx_dpbusd(qx_dpbusd(_mm256_setzero_si256(), lo[pr], _mm256_loadu_si256((const __m256i *)(y + 64 * pr))),
                                      hi[pr], _mm256_loadu_si256((const __m256i *)(y + 64 * pr + 32)));
                }
                h[t] = _mm256_hadd_epi32(_mm256_hadd_epi32(P[0], P[1]), _mm256_hadd_epi32(P[2], P[3]));
                h[t] = _mm256_permutevar8x32_epi32(h[t], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
                __m256i P[4];
                QX_UNROLL
                for (int pr = 0; pr < 4; pr++) { // int16 lanes 0-7: block 2pr, 8-15: block 2pr+1
                    P[pr] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[pr], _mm256_loadu_si256((const __m256i *)(y + 64 * pr))),
                                             _mm256_maddubs_epi16(hi[pr], _mm256_loadu_si256((const __m256i *)(y + 64 * pr + 32))));
                }
                // two int16 pairwise adds (a lane then sums 16 products: |lane| <= 16 * 15 * 127 =
                // 30480 < 2^15; ggml's activations are within +-127), then to int32: the sums of
                // blocks 0 2 4 6 | 1 3 5 7, put in order
                h[t] = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(P[0], P[1]), _mm256_hadd_epi16(P[2], P[3])), ones);
                h[t] = _mm256_permutevar8x32_epi32(h[t], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
            }
        } else {
            __m256i q[8];
            QX_UNROLL
            for (int k = 0; k < 8; k++) q[k] = qx_chunk(type, blk + k * bs, 0);
            QX_UNROLL
            for (int t = t_alone; t < nt; t++) {
                const int8_t * y = a[t].qs + KVR_QK * b;
                __m256i p[8];
                QX_UNROLL
                for (int k = 0; k < 8; k++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(y + KVR_QK * k));
                    if (sgn) v = _mm256_sign_epi8(v, q[k]);
                    p[k] = qx_dpbusd(_mm256_setzero_si256(), sgn ? _mm256_sign_epi8(q[k], q[k]) : q[k], v);
                }
                // X: blocks 0-3, the sums of their lanes 0-3 | of 4-7; Y: blocks 4-7 the same
                const __m256i X = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                const __m256i Y = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
                h[t] = _mm256_add_epi32(_mm256_permute2x128_si256(X, Y, 0x20), _mm256_permute2x128_si256(X, Y, 0x31));
            }
        }
        QX_UNROLL
        for (int t = t_alone; t < nt; t++) {
            // the offsets of Q4_0/Q5_0 leave each block's integer sum exactly (ggml's q - 8 / q - 16)
            if (off) h[t] = _mm256_sub_epi32(h[t], _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(a[t].sum + b)), off == 8 ? 3 : 4));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[t]), _mm256_mul_ps(dw, _mm256_loadu_ps(a[t].d + b)), acc[t]);
            if (qx_has_min(type)) accm[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a[t].s + b), accm[t]);
        }
    }
#if QX_L512
    for (int tp = 0; two && tp + 1 < nt; tp += 2) {
        acc[tp] = _mm512_castps512_ps256(acc2[tp / 2]);
        acc[tp + 1] = _mm512_extractf32x8_ps(acc2[tp / 2], 1);
        accm[tp] = _mm512_castps512_ps256(accm2[tp / 2]);
        accm[tp + 1] = _mm512_extractf32x8_ps(accm2[tp / 2], 1);
    }
#endif
    // the sums stay in registers through the tail: a store to out (a float *) could alias row, so
    // the compiler would reload after every block
    float sum[QX_BATCH_GROUP];
    QX_UNROLL
    for (int t = 0; t < nt; t++) sum[t] = qx_hsum(_mm256_add_ps(acc[t], accm[t]));
    // the last nb % 8 blocks one at a time (in element order)
    for (int64_t b = n8; b < nb; b++) {
        const uint8_t * blk = row + (size_t)b * bs;
        float d, m;
        qx_legacy_dm(type, blk, &d, &m);
        const __m256i q = qx_chunk(type, blk, 0);
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(a[t].qs + KVR_QK * b));
            if (sgn) v = _mm256_sign_epi8(v, q);
            __m256i p = qx_dpbusd(_mm256_setzero_si256(), sgn ? _mm256_sign_epi8(q, q) : q, v);
            if (off) p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(off * a[t].sum[b])));
            sum[t] += qx_hsum(_mm256_cvtepi32_ps(p)) * (d * a[t].d[b]) + m * a[t].s[b];
        }
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) out[t] = sum[t];
}

// A type's legacy kernel for 1..QX_BATCH_GROUP tokens, each count its own unrolled copy.
typedef void (*qx_t1_fn)(const uint8_t * row, int64_t nb, const struct qx_t1 * a, int nt, float * out);
#define QX_T1(name, T)                                                                                      \
    static void qx_row_t1_##name(const uint8_t * row, int64_t nb, const struct qx_t1 * a, int nt, float * out) { \
        switch (nt) {                                                                                       \
            case 1:  qx_row_t1(T, 1, row, nb, a, out); break;                                               \
            case 2:  qx_row_t1(T, 2, row, nb, a, out); break;                                               \
            case 3:  qx_row_t1(T, 3, row, nb, a, out); break;                                               \
            default: qx_row_t1(T, 4, row, nb, a, out); break;                                               \
        }                                                                                                   \
    }
QX_T1(q4_0, KVR_TYPE_Q4_0) QX_T1(q4_1, KVR_TYPE_Q4_1) QX_T1(q5_0, KVR_TYPE_Q5_0) QX_T1(q5_1, KVR_TYPE_Q5_1)
QX_T1(q8_0, KVR_TYPE_Q8_0) QX_T1(q8_1, KVR_TYPE_Q8_1)
#undef QX_T1

static qx_t1_fn qx_t1_kernel(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q4_0: return qx_row_t1_q4_0;
        case KVR_TYPE_Q4_1: return qx_row_t1_q4_1;
        case KVR_TYPE_Q5_0: return qx_row_t1_q5_0;
        case KVR_TYPE_Q5_1: return qx_row_t1_q5_1;
        case KVR_TYPE_Q8_0: return qx_row_t1_q8_0;
        default:            return qx_row_t1_q8_1;
    }
}

// row . token t over nb Q4_K super-blocks for nt tokens (1..QX_BATCH_GROUP: a decode, or a decode
// batch's tokens, each summed as one token alone is, to the last bit; see qx_row_t1): the k-quants'
// kernel (qx_row_k) cut to what Q4_K needs, one scale per 32 values: d and dmin converted together,
// the mins met by the activations' sums of 32 in 128-bit integers, the 8 scales widened once into
// both halves of a vector, from which each 32 values take theirs by an in-lane shuffle. In cache
// 5-7% faster than qx_row_k with one token.
QX_INLINE void qx_row_q4_K(int nt, const uint8_t * row, int64_t nb, const struct qx_q8K * const a[QX_BATCH_GROUP], float * out) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[QX_BATCH_GROUP];
    __m128 accm[QX_BATCH_GROUP];
    QX_UNROLL
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        accm[t] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const struct kvr_block_q4_K * x = (const void *)(row + (size_t)b * sizeof(struct kvr_block_q4_K));
        for (size_t o = 0; o < sizeof(*x); o += 64) _mm_prefetch((const char *)x + QX_PREFETCH + o, _MM_HINT_T0);
        const __m128i sm = qx_k4_scales(x->scales);
        uint32_t dm;
        memcpy(&dm, x->d, 4); // d, then dmin (fp16 each)
        const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        const __m128i mn = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        __m128 dd[QX_BATCH_GROUP];
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            const struct qx_q8K * y = a[t] + b;
            dd[t] = _mm_mul_ps(dmf, _mm_set1_ps(y->d));
            // the mins: over the 8 runs of 32, mn_j times the activations' sum over run j
            const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y->bsum), _mm_loadu_si128((const __m128i *)(y->bsum + 8)));
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn, bs)), _mm_shuffle_ps(dd[t], dd[t], 0x55), accm[t]);
        }
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm)); // int16 lane j (and 8 + j): scale j
        __m256i sumi[QX_BATCH_GROUP];
        QX_UNROLL
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        QX_UNROLL
        for (int c = 0; c < 4; c++) { // 64 values: the low nibbles of 32 bytes are run 2c, the high ones 2c + 1
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i slo = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(4 * c | (4 * c + 1) << 8)));
            const __m256i shi = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)((4 * c + 2) | (4 * c + 3) << 8)));
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(a[t][b].qs + 64 * c)));
                const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a[t][b].qs + 64 * c + 32)));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(plo, slo), _mm256_madd_epi16(phi, shi)));
            }
        }
        QX_UNROLL
        for (int t = 0; t < nt; t++) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(_mm_cvtss_f32(dd[t])), acc[t]);
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) out[t] = qx_hsum(acc[t]) - qx_hsum(_mm256_zextps128_ps256(accm[t]));
}

// out[t] = row . token t over nb super-blocks, for nt (1..QX_BATCH_GROUP) tokens; each token's
// operations are the same whatever nt, so a decode batch's tokens get their one-token sums.
QX_INLINE void qx_row_k(enum kvr_type type, int nt, const uint8_t * row, int64_t nb,
                        const struct qx_q8K * const a[4], float out[4]) {
    const size_t bs = qx_block_bytes(type);
    const bool sgn = qx_signed(type);
    __m256 acc[4], accm[4];
    QX_UNROLL
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * blk = row + (size_t)b * bs;
        float d, dmin;
        __m256i scv, mn;
        qx_k_scales_v(type, blk, &d, &dmin, &scv, &mn);
        for (size_t o = 0; o < bs; o += 64) _mm_prefetch((const char *)blk + QX_PREFETCH + o, _MM_HINT_T0);
        __m256i sumi[4];
        QX_UNROLL
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        // runs 0-7's scales in both 128-bit halves, and runs 8-15's: a chunk's pair of scales is then
        // one shuffle within the halves (no lane crossing per chunk)
        const __m256i sc_lo = _mm256_permute2x128_si256(scv, scv, 0x00), sc_hi = _mm256_permute2x128_si256(scv, scv, 0x11);
        QX_UNROLL // the shifts and shuffles of each chunk become constants; loads shared by chunks merge
        for (int j = 0; j < 8; j++) {
            const __m256i q = qx_chunk(type, blk, j);
            const __m256i qa = sgn ? _mm256_sign_epi8(q, q) : q;
            // lanes 0..7 of a product (elements 0..15 of the chunk) are run 2j, lanes 8..15 run 2j+1
            const int r0 = (2 * j) % 8, r1 = (2 * j + 1) % 8;
            const __m256i sc = _mm256_shuffle_epi8(j < 4 ? sc_lo : sc_hi,
                                                   _mm256_setr_m128i(_mm_set1_epi16((short)(2 * r0 | (2 * r0 + 1) << 8)),
                                                                     _mm_set1_epi16((short)(2 * r1 | (2 * r1 + 1) << 8))));
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                __m256i y = _mm256_loadu_si256((const __m256i *)(a[t][b].qs + 32 * j));
                if (sgn) y = _mm256_sign_epi8(y, q);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, y), sc));
            }
        }
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            const struct qx_q8K * ab = a[t] + b;
            if (qx_k_offset(type)) {
                // Q3_K/Q6_K: the offset leaves the integer sum exactly, as ggml's q - 4 / q - 32
                sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)ab->bsum)));
            } else if (type != KVR_TYPE_Q8_K) {
                const __m256i ms = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)ab->bsum));
                accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmin * ab->d), accm[t]);
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(d * ab->d), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) out[t] = qx_hsum(acc[t]) - qx_hsum(accm[t]);
}

// A k-quant type's kernel for 1..QX_BATCH_GROUP tokens, each count its own unrolled copy.
typedef void (*qx_k_fn)(const uint8_t * row, int64_t nb, const struct qx_q8K * const a[QX_BATCH_GROUP], int nt, float * out);
#define QX_KN_CALL(T, n) (T == KVR_TYPE_Q4_K ? qx_row_q4_K(n, row, nb, a, out) : qx_row_k(T, n, row, nb, a, out))
#define QX_KN(name, T)                                                                                      \
    static void qx_row_kn_##name(const uint8_t * row, int64_t nb, const struct qx_q8K * const a[QX_BATCH_GROUP], int nt, float * out) { \
        switch (nt) {                                                                                       \
            case 1:  QX_KN_CALL(T, 1); break;                                                               \
            case 2:  QX_KN_CALL(T, 2); break;                                                               \
            case 3:  QX_KN_CALL(T, 3); break;                                                               \
            default: QX_KN_CALL(T, 4); break;                                                               \
        }                                                                                                   \
    }
QX_KN(q2_K, KVR_TYPE_Q2_K) QX_KN(q3_K, KVR_TYPE_Q3_K) QX_KN(q4_K, KVR_TYPE_Q4_K) QX_KN(q5_K, KVR_TYPE_Q5_K)
QX_KN(q6_K, KVR_TYPE_Q6_K) QX_KN(q8_K, KVR_TYPE_Q8_K)
#undef QX_KN
#undef QX_KN_CALL

static qx_k_fn qx_k_kernel(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q2_K: return qx_row_kn_q2_K;
        case KVR_TYPE_Q3_K: return qx_row_kn_q3_K;
        case KVR_TYPE_Q4_K: return qx_row_kn_q4_K;
        case KVR_TYPE_Q5_K: return qx_row_kn_q5_K;
        case KVR_TYPE_Q6_K: return qx_row_kn_q6_K;
        default:            return qx_row_kn_q8_K;
    }
}

#else

// Without AVX2: the same integers, one element at a time.
static int qx_quant_c(enum kvr_type t, const uint8_t * blk, int e) {
    switch (t) {
        case KVR_TYPE_Q4_0: { const struct kvr_block_q4_0 * b = (const void *)blk; return (b->qs[e % 16] >> (4 * (e / 16))) & 15; }
        case KVR_TYPE_Q4_1: { const struct kvr_block_q4_1 * b = (const void *)blk; return (b->qs[e % 16] >> (4 * (e / 16))) & 15; }
        case KVR_TYPE_Q5_0: {
            const struct kvr_block_q5_0 * b = (const void *)blk;
            return ((b->qs[e % 16] >> (4 * (e / 16))) & 15) | (int)((kvr_q_u32le(b->qh) >> e) & 1) << 4;
        }
        case KVR_TYPE_Q5_1: {
            const struct kvr_block_q5_1 * b = (const void *)blk;
            return ((b->qs[e % 16] >> (4 * (e / 16))) & 15) | (int)((kvr_q_u32le(b->qh) >> e) & 1) << 4;
        }
        case KVR_TYPE_Q8_0: return ((const struct kvr_block_q8_0 *)blk)->qs[e];
        case KVR_TYPE_Q8_1: return ((const struct kvr_block_q8_1 *)blk)->qs[e];
        case KVR_TYPE_Q2_K: {
            const struct kvr_block_q2_K * b = (const void *)blk;
            return (b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        }
        case KVR_TYPE_Q3_K: {
            const struct kvr_block_q3_K * b = (const void *)blk;
            return ((b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3) | ((b->hmask[e % 32] >> (e / 32)) & 1) << 2;
        }
        case KVR_TYPE_Q4_K: {
            const struct kvr_block_q4_K * b = (const void *)blk;
            return (b->qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 15;
        }
        case KVR_TYPE_Q5_K: {
            const struct kvr_block_q5_K * b = (const void *)blk;
            return ((b->qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 15) | ((b->qh[e % 32] >> (e / 32)) & 1) << 4;
        }
        case KVR_TYPE_Q6_K: {
            const struct kvr_block_q6_K * b = (const void *)blk;
            const int h = e / 128, k = (e % 128) / 32, l = e % 32;
            return ((b->ql[64 * h + 32 * (k & 1) + l] >> (4 * (k / 2))) & 15) | ((b->qh[32 * h + l] >> (2 * k)) & 3) << 4;
        }
        default: return ((const struct kvr_block_q8_K *)blk)->qs[e];
    }
}

static void qx_row_c(enum kvr_type type, int nt, const uint8_t * row, int64_t nb, const void * const a[4], float out[4]) {
    const size_t bs = qx_block_bytes(type);
    QX_UNROLL
    for (int t = 0; t < nt; t++) out[t] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * blk = row + (size_t)b * bs;
        if (qx_is_k(type)) {
            struct qx_sc s;
            qx_k_scales(type, blk, &s);
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                const struct qx_q8K * ab = (const struct qx_q8K *)a[t] + b;
                int32_t sumi = 0, summ = 0;
                for (int r = 0; r < 16; r++) {
                    int32_t p = 0;
                    for (int l = 0; l < 16; l++) p += qx_quant_c(type, blk, 16 * r + l) * ab->qs[16 * r + l];
                    sumi += s.sc[r] * p;
                    summ += s.mn[r] * ab->bsum[r];
                }
                out[t] += (float)sumi * (s.d * ab->d) - (float)summ * (s.dmin * ab->d);
            }
        } else {
            float d, m;
            qx_legacy_dm(type, blk, &d, &m);
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                const struct qx_q8 * ab = (const struct qx_q8 *)a[t] + b;
                int32_t p = 0;
                for (int e = 0; e < KVR_QK; e++) p += qx_quant_c(type, blk, e) * ab->qs[e];
                out[t] += (float)(p - qx_offset(type) * ab->sum) * (d * ab->d) + (qx_has_min(type) ? m * ab->s : 0.0f);
            }
        }
    }
}

#endif

// A type's prefill kernels: the interleave of a tile of rows (8, or 16 for the 512-bit K-quant
// kernel) and the tile kernel (below), which meets 4 tokens at a time.
#define QX_TILE_MAX 16
struct qx_x8_fns {
    void (*interleave)(const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows, int64_t nb, void * out);
    void (*dot)(const void * w, const void * const a[4], int64_t nb, float out[4][QX_TILE_MAX]);
    size_t tile_bytes; // of one interleaved block of the tile's rows
    int    rows;       // a tile's rows
};

// Rows a block of qx_mul_rows: each group of tokens of a decode batch passes over a block's rows
// while they are in the nearest caches (16 rows of 576 Q4_1 values: 5.6 KiB).
#define QX_BATCH_ROWS 16

// Bytes of scratch qx_mul_rows needs for T tokens over K values: their activations, and for the
// legacy types each token's arrays of the decode kernel (struct qx_t1) from a cache line on.
static size_t qx_rows_bytes(enum kvr_type t, int64_t K, int64_t T) {
    size_t arrays = qx_is_legacy(t) ? (size_t)T * qx_t1_bytes(K / KVR_QK) + 64 : 0;
#if QX_L512
    if (qx_pairs(t)) arrays += (size_t)(T / 2) * qx_t2_bytes(K / KVR_QK); // their pairs
#endif
    return (size_t)T * qx_act_bytes(t, K) + arrays;
}

// Y[t][n] = W[n] . X[t] for rows n0..n1 (chunks: the chunks of rows 0..n1 this thread takes) and
// all T tokens: decode, a decode batch, and the prefill path of the types without 8-row kernels.
// Each row is read from memory once; the tokens meet each block of QX_BATCH_ROWS rows
// QX_BATCH_GROUP at a time, every token through the operations of the one-token kernel, so that
// each token's row of Y is what it would be alone, to the last bit, however many tokens came
// with it. scratch: qx_rows_bytes(type, K, T). Returns the rows it computed.
static int64_t qx_mul_rows(enum kvr_type type, const void * W, size_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                           const struct mm_chunks * chunks, const float * X, int64_t ldx, int64_t T, float * Y, int64_t ldy,
                           void * scratch) {
    const size_t ab = qx_act_bytes(type, K);
    const int64_t nb = K / kvr_blck_size(type), N = n1;
    uint8_t * act = scratch;
    for (int64_t t = 0; t < T; t++) qx_quantize(type, X + t * ldx, act + (size_t)t * ab, K);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    // the legacy types: each token's activations as the arrays of their kernel (8 blocks a step)
    const bool legacy = qx_is_legacy(type);
    const size_t t1 = qx_t1_bytes(nb);
    uint8_t * arrays = (uint8_t *)(((uintptr_t)(act + (size_t)T * ab) + 63) & ~(uintptr_t)63);
    for (int64_t t = 0; legacy && t < T; t++) qx_t1_init(type, (const struct qx_q8 *)(act + (size_t)t * ab), nb, arrays + (size_t)t * t1);
    // QX_L512: the 4-bit types' tokens 2p and 2p + 1 side by side (qx_row_t1 takes them together)
    uint8_t * pairs = arrays + (size_t)T * t1;
    const size_t t2 = qx_t2_bytes(nb);
    const bool paired = QX_L512 && qx_pairs(type) && T >= 2;
    for (int64_t t = 0; paired && t + 1 < T; t += 2) {
        const struct qx_t1 x = qx_t1_at(arrays + (size_t)t * t1, nb), y = qx_t1_at(arrays + (size_t)(t + 1) * t1, nb);
        qx_t2_init(&x, &y, nb, pairs + (size_t)(t / 2) * t2);
    }
    const qx_t1_fn fl = legacy ? qx_t1_kernel(type) : NULL;
    const qx_k_fn fk = legacy ? NULL : qx_k_kernel(type);
#endif
    int64_t done = 0;
    bool once = true;
    while (chunks ? mm_chunk_next(chunks, N, &n0, &n1) : once) {
        once = false;
        done += n1 > n0 ? n1 - n0 : 0;
        for (int64_t r0 = n0; r0 < n1; r0 += QX_BATCH_ROWS) {
            const int64_t r1 = n1 - r0 < QX_BATCH_ROWS ? n1 : r0 + QX_BATCH_ROWS;
            for (int64_t t0 = 0; t0 < T; t0 += QX_BATCH_GROUP) {
                const int nt = T - t0 < QX_BATCH_GROUP ? (int)(T - t0) : QX_BATCH_GROUP;
                float out[QX_BATCH_GROUP];
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
                struct qx_t1 g1[QX_BATCH_GROUP];
                const struct qx_q8K * gk[QX_BATCH_GROUP];
                for (int k = 0; k < QX_BATCH_GROUP; k++) {
                    const int64_t t = t0 + (k < nt ? k : nt - 1);
                    if (legacy) g1[k] = qx_t1_at(arrays + (size_t)t * t1, nb);
                    else        gk[k] = (const struct qx_q8K *)(act + (size_t)t * ab);
                    // a pair starts at an even token of the group (QX_BATCH_GROUP is even)
                    if (legacy && paired && k % 2 == 0 && k + 1 < nt) g1[k].pair = pairs + (size_t)((t0 + k) / 2) * t2;
                }
#else
                const void * g[QX_BATCH_GROUP];
                for (int k = 0; k < QX_BATCH_GROUP; k++) g[k] = act + (size_t)(t0 + (k < nt ? k : nt - 1)) * ab;
#endif
                for (int64_t n = r0; n < r1; n++) {
                    const uint8_t * row = (const uint8_t *)W + (size_t)n * row_bytes;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
                    if (legacy) fl(row, nb, g1, nt, out);
                    else        fk(row, nb, gk, nt, out);
#else
                    qx_row_c(type, nt, row, nb, g, out);
#endif
                    for (int k = 0; k < nt; k++) Y[(t0 + k) * ldy + n] = out[k];
                }
            }
        }
    }
    return done;
}

// The 8-row kernels in 512-bit vectors (QX_L512, defined with the decode kernels): each vector of
// weights holds 8 bytes of each of the 8 rows, so 32 bytes are 4 loads and each token's 8 bytes one
// broadcast; 16 int32 lanes, two a row, summed pairwise once a block or run. In half the
// instructions of the 256-bit kernels, whose sums of 4 bytes a lane need 8 vectors for 32 bytes.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// One legacy block (32 values) of QX_L_ROWS rows, interleaved: 16 rows of 4 bytes a vector in the
// 512-bit kernel, as the K-quants' (a block's int32 sums then need no pairing of lanes, and one
// conversion and one FMA a token serve 16 rows).
#if QX_L512
#define QX_L_ROWS 16
struct qx_l_x8 {
    float   d[16], m[16];    // row i's scale and min (0 without one)
    uint8_t q[8][64];        // group g: bytes 4i..4i+3 are row i's quants 4g..4g+3 plus qx_x8_off
};
#else
#define QX_L_ROWS 8
struct qx_l_x8 {
    float   d[8], m[8];      // row i's scale and min (0 without one)
    uint8_t q[8][32];        // group g: bytes 4i..4i+3 are row i's quants 4g..4g+3 (|q| for the 8-bit types)
    uint8_t s[8][32];        // the 8-bit types: the quants themselves, whose signs the products take
};
#endif

// One super-block (256 values) of QX_K_ROWS rows, interleaved. The 512-bit kernel takes 16 rows,
// 4 bytes of each a vector: a vector of products is one lane a row, so each run's vpmulld by the
// scales and each pair of runs' mins serve 16 rows (with 8 rows of 8 bytes, two lanes a row, they
// served 8 and were a third of the kernel's multiplier port).
#if QX_L512
#define QX_K_ROWS 16
struct qx_k_tile {
    float   d[16], dmin[16];
    int32_t sc[16][16];      // run r (16 values): lane i is row i's scale
    int32_t mn[8][16];       // runs 2p, 2p+1: lane i is row i's two mins, int16 each (run 2p low)
    uint8_t q[8][8][64];     // chunk j, group g: bytes 4i..4i+3 are row i's quants 32j+4g..+3
};
// Q4_K's tile keeps the nibbles packed as the file has them: half the bytes to interleave and no
// unpacking (a short prompt's interleave costs as much as its products). The kernel takes a run's
// low nibbles as q & 0x0f and the next run's high ones as q & 0xf0, 16 times the quant: the low
// runs' scales are stored times 16 too, and the super-block's sum divided by 16 (exact: every
// product is a multiple of 16, and 16 times the largest sum, 8 * 63 * 32 * 15 * 128 * 16, < 2^31).
struct qx_q4k_tile {
    float   d[16], dmin[16];
    int32_t sc[8][16];       // run r (32 values): lane i is row i's scale, times 16 for even r
    int32_t mn[8][16];       // as qx_k_tile's
    uint8_t q[4][8][64];     // runs 2k and 2k+1, group g: bytes 4i..4i+3 are row i's qs bytes 32k+4g..+3
};
#else
#define QX_K_ROWS 8
struct qx_k_tile {
    float   d[8], dmin[8];
    int16_t sc[16][16];      // run r: lanes 2i and 2i+1 hold row i's scale
    int16_t mn[8][16];       // runs 2p, 2p+1: lanes 2i, 2i+1 hold row i's mins of the two
    uint8_t q[8][8][32];     // chunk j, group g: bytes 4i..4i+3 are row i's quants 32j+4g..+3
};
#endif

// out[g] = the g-th 4-byte group of v[0], ..., v[7]: an 8x8 transpose of 32-bit elements
static inline void qx_transpose8x32(const __m256i v[8], uint8_t out[8][32]) {
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k]     = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]); // r0g0 r1g0 r0g1 r1g1 | g4 g5
        a[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]); // g2 g3 | g6 g7
    }
    for (int k = 0; k < 2; k++) {
        for (int h = 0; h < 2; h++) {
            b[4 * k + 2 * h]     = _mm256_unpacklo_epi64(a[4 * k + h], a[4 * k + 2 + h]);
            b[4 * k + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * k + h], a[4 * k + 2 + h]);
        }
    }
    // b[0..3]: rows 0-3 of groups (0,4), (1,5), (2,6), (3,7); b[4..7]: rows 4-7 of the same
    for (int g = 0; g < 4; g++) {
        _mm256_storeu_si256((__m256i *)out[g],     _mm256_permute2x128_si256(b[g], b[4 + g], 0x20));
        _mm256_storeu_si256((__m256i *)out[g + 4], _mm256_permute2x128_si256(b[g], b[4 + g], 0x31));
    }
}

#if QX_L512
// What the 512-bit kernel adds to a legacy type's quants to make them unsigned bytes (VNNI
// multiplies unsigned by signed bytes): the 8-bit types' sign bit flipped, q + 128; the products
// then lose off * (the token's sum) a block, which starts each block's int32 sums.
QX_INLINE int qx_x8_off(enum kvr_type t) {
    return qx_signed(t) ? 128 : qx_offset(t);
}

// The blocks of rows past the end of a matrix: zero quants and scales (longer than any legacy block).
static const uint8_t qx_zero_block[64];

// The fp16 fields at offset off of 8 blocks, as 8 floats.
static inline __m256 qx_half8p(const uint8_t * const blk[8], size_t off) {
    uint64_t u[2] = { 0, 0 };
    QX_UNROLL
    for (int k = 0; k < 8; k++) {
        uint16_t h;
        memcpy(&h, blk[k] + off, 2);
        u[k / 4] |= (uint64_t)h << (16 * (k % 4));
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)u[1], (long long)u[0]));
}

// The 32-bit elements of 8 vectors transposed: out[g] gets element g of v[0], ..., v[7].
static inline void qx_transpose8x32v(const __m256i v[8], __m256i out[8]) {
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k]     = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        for (int h = 0; h < 2; h++) {
            b[4 * k + 2 * h]     = _mm256_unpacklo_epi64(a[4 * k + h], a[4 * k + 2 + h]);
            b[4 * k + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * k + h], a[4 * k + 2 + h]);
        }
    }
    for (int g = 0; g < 4; g++) {
        out[g]     = _mm256_permute2x128_si256(b[g], b[4 + g], 0x20);
        out[g + 4] = _mm256_permute2x128_si256(b[g], b[4 + g], 0x31);
    }
}

// The legacy kernel's start of each block's sums, -off * sum, into the blocks' pad fields (n of
// them): one broadcast a block and token in the kernel instead of five instructions.
static void qx_x8_prepare(enum kvr_type type, struct qx_q8 * a, int64_t n) {
    const int off = qx_x8_off(type);
    for (int64_t i = 0; i < n; i++) a[i].pad = -off * a[i].sum;
}

// Rows r0..r0+15 of a legacy matrix (rows at or past n_rows are zero) into nb interleaved blocks.
QX_INLINE void qx_interleave_legacy(enum kvr_type type, const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows,
                                    int64_t nb, struct qx_l_x8 * restrict out) {
    const size_t bs = qx_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        struct qx_l_x8 * o = out + b;
        for (int h = 0; h < 2; h++) {
            const uint8_t * blk[8];
            for (int i = 0; i < 8; i++) {
                const int64_t r = r0 + 8 * h + i;
                blk[i] = r < n_rows ? w + (size_t)r * row_bytes + (size_t)b * bs : qx_zero_block;
                if (r < n_rows) _mm_prefetch((const char *)blk[i] + 16 * row_bytes, _MM_HINT_T0); // the next tile's block
            }
            __m256i v[8], t[8];
            for (int i = 0; i < 8; i++) {
                v[i] = qx_chunk(type, blk[i], 0);
                if (qx_signed(type)) v[i] = _mm256_xor_si256(v[i], _mm256_set1_epi8((char)0x80));
            }
            qx_transpose8x32v(v, t);
            for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)&o->q[g][32 * h], t[g]);
            // d is every legacy block's first field, m (Q4_1, Q5_1) its second; a type without m never reads it
            _mm256_storeu_ps(o->d + 8 * h, qx_half8p(blk, 0));
            if (qx_has_min(type)) _mm256_storeu_ps(o->m + 8 * h, qx_half8p(blk, 2));
        }
    }
}
#else
// Rows r0..r0+7 of a legacy matrix (rows at or past n_rows are zero) into nb interleaved blocks.
QX_INLINE void qx_interleave_legacy(enum kvr_type type, const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows,
                                    int64_t nb, struct qx_l_x8 * restrict out) {
    const size_t bs = qx_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        struct qx_l_x8 * o = out + b;
        __m256i v[8], va[8];
        for (int i = 0; i < 8; i++) {
            if (r0 + i >= n_rows) {
                v[i] = va[i] = _mm256_setzero_si256();
                o->d[i] = o->m[i] = 0.0f;
                continue;
            }
            const uint8_t * blk = w + (size_t)(r0 + i) * row_bytes + (size_t)b * bs;
            qx_legacy_dm(type, blk, &o->d[i], &o->m[i]);
            v[i] = qx_chunk(type, blk, 0);
            va[i] = qx_signed(type) ? _mm256_sign_epi8(v[i], v[i]) : v[i];
        }
        qx_transpose8x32(va, o->q);
        if (qx_signed(type)) qx_transpose8x32(v, o->s);
    }
}

#endif

#if QX_L512
// 32 bytes at off of each of 16 rows (zeros for a NULL row) transposed: vector g holds bytes
// off+4g..off+4g+3 of row i at 4i.
static inline void qx_t16(const uint8_t * const row[16], size_t off, __m512i out[8]) {
    __m256i v[8], lo[8], hi[8];
    for (int i = 0; i < 8; i++) v[i] = row[i] ? _mm256_loadu_si256((const __m256i *)(row[i] + off)) : _mm256_setzero_si256();
    qx_transpose8x32v(v, lo);
    for (int i = 0; i < 8; i++) v[i] = row[8 + i] ? _mm256_loadu_si256((const __m256i *)(row[8 + i] + off)) : _mm256_setzero_si256();
    qx_transpose8x32v(v, hi);
    for (int g = 0; g < 8; g++) out[g] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[g]), hi[g], 1);
}

// The bytes of v shifted left by n (right for n < 0), 16 bits at a time: bits that cross into the
// next byte are masked off by the caller.
static inline __m512i qx_shl16(__m512i v, int n) {
    return n >= 0 ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(n)) : _mm512_srl_epi16(v, _mm_cvtsi32_si128(-n));
}

// The start of super-block b of 16 rows r0..r0+15 (rows at or past n_rows are NULL in blk): each
// row's block, the next tile's same blocks prefetched (16 rows on: a tile starts on rows the stream
// prefetchers have not seen; a 16-token prompt of a 1B Q4_K_M: the interleave took 1.32-1.41 of the
// tile kernel's time with each row's next KiB prefetched, 1.05-1.06 so; 32 rows on, the next
// block's, measured no better), d and dmin, the mins as the tiles keep them, and the scales
// transposed: lane i of sc[h][p] is row 8h + i's runs (of 16) 2p, low half, and 2p + 1.
QX_INLINE void qx_k16_head(enum kvr_type type, const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows, int64_t b,
                      const uint8_t * blk[16], float d[16], float dmin[16], int32_t mn[8][16], __m256i sc[2][8]) {
    const size_t bs = qx_block_bytes(type);
    __m256i s[16], m[16];
    for (int i = 0; i < 16; i++) {
        blk[i] = r0 + i < n_rows ? w + (size_t)(r0 + i) * row_bytes + (size_t)b * bs : NULL;
        for (size_t at = 0; blk[i] && at < bs; at += 64) _mm_prefetch((const char *)blk[i] + 16 * row_bytes + at, _MM_HINT_T0);
        s[i] = m[i] = _mm256_setzero_si256();
        d[i] = dmin[i] = 0.0f;
        if (blk[i]) qx_k_scales_v(type, blk[i], &d[i], &dmin[i], &s[i], &m[i]);
    }
    for (int h = 0; h < 2; h++) {
        __m256i t[8];
        qx_transpose8x32v(s + 8 * h, sc[h]);
        qx_transpose8x32v(m + 8 * h, t);
        for (int p = 0; p < 8; p++) _mm256_storeu_si256((__m256i *)&mn[p][8 * h], t[p]);
    }
}

// qx_interleave_k's quants for Q5_K and Q6_K, unpacked after the transpose: the packed bytes of 16
// rows are transposed once (a third fewer bytes than the quants) and each vector unpacks 16 rows at
// a time; each byte's quant comes from the same position of its source, so the bytes are qx_chunk's.
static void qx_interleave_q56(enum kvr_type type, const uint8_t * const blk[16], struct qx_k_tile * restrict o) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i h[8], l[8];
    if (type == KVR_TYPE_Q5_K) { // element 64k + 32s + l: nibble s of qs[32k + l], 5th bit: bit 2k + s of qh[l]
        qx_t16(blk, offsetof(struct kvr_block_q5_K, qh), h);
        for (int k = 0; k < 4; k++) {
            qx_t16(blk, offsetof(struct kvr_block_q5_K, qs) + 32 * (size_t)k, l);
            for (int s = 0; s < 2; s++) {
                const int j = 2 * k + s;
                for (int g = 0; g < 8; g++) {
                    const __m512i lo = _mm512_and_si512(s ? _mm512_srli_epi16(l[g], 4) : l[g], m4);
                    const __m512i hi = _mm512_and_si512(qx_shl16(h[g], 4 - j), _mm512_set1_epi8(0x10));
                    _mm512_storeu_si512(o->q[j][g], _mm512_or_si512(lo, hi));
                }
            }
        }
        return;
    }
    KVR_ASSERT(type == KVR_TYPE_Q6_K);
    for (int hh = 0; hh < 2; hh++) { // element 128h + 32k + l: ql[64h + 32(k&1) + l] (high nibble if k >= 2), qh[32h + l] >> 2k
        qx_t16(blk, offsetof(struct kvr_block_q6_K, qh) + 32 * (size_t)hh, h);
        for (int k1 = 0; k1 < 2; k1++) {
            qx_t16(blk, offsetof(struct kvr_block_q6_K, ql) + 64 * (size_t)hh + 32 * (size_t)k1, l);
            for (int k2 = 0; k2 < 2; k2++) {
                const int k = 2 * k2 + k1;
                for (int g = 0; g < 8; g++) {
                    const __m512i lo = _mm512_and_si512(k2 ? _mm512_srli_epi16(l[g], 4) : l[g], m4);
                    const __m512i hi = _mm512_and_si512(qx_shl16(h[g], 4 - 2 * k), _mm512_set1_epi8(0x30));
                    _mm512_storeu_si512(o->q[4 * hh + k][g], _mm512_or_si512(lo, hi));
                }
            }
        }
    }
}

QX_INLINE void qx_interleave_k(enum kvr_type type, const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows,
                               int64_t nb, struct qx_k_tile * restrict out) {
    for (int64_t b = 0; b < nb; b++) {
        struct qx_k_tile * o = out + b;
        const uint8_t * blk[16];
        __m256i sc[2][8];
        qx_k16_head(type, w, row_bytes, r0, n_rows, b, blk, o->d, o->dmin, o->mn, sc);
        for (int h = 0; h < 2; h++) {
            for (int p = 0; p < 8; p++) {
                _mm256_storeu_si256((__m256i *)&o->sc[2 * p][8 * h], _mm256_srai_epi32(_mm256_slli_epi32(sc[h][p], 16), 16));
                _mm256_storeu_si256((__m256i *)&o->sc[2 * p + 1][8 * h], _mm256_srai_epi32(sc[h][p], 16));
            }
        }
        if (type == KVR_TYPE_Q5_K || type == KVR_TYPE_Q6_K) {
            qx_interleave_q56(type, blk, o);
            continue;
        }
        for (int j = 0; j < 8; j++) {
            for (int h = 0; h < 2; h++) {
                __m256i v[8], t[8];
                for (int i = 0; i < 8; i++) v[i] = blk[8 * h + i] ? qx_chunk(type, blk[8 * h + i], j) : _mm256_setzero_si256();
                qx_transpose8x32v(v, t);
                for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)&o->q[j][g][32 * h], t[g]);
            }
        }
    }
}

// Rows r0..r0+15 of a Q4_K matrix (rows at or past n_rows are zero) into nb packed tiles.
static void qx_interleave_q4k(const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows, int64_t nb,
                              struct qx_q4k_tile * restrict out) {
    for (int64_t b = 0; b < nb; b++) {
        struct qx_q4k_tile * o = out + b;
        const uint8_t * blk[16];
        __m256i sc[2][8];
        qx_k16_head(KVR_TYPE_Q4_K, w, row_bytes, r0, n_rows, b, blk, o->d, o->dmin, o->mn, sc);
        // runs of 16 2p and 2p + 1 share run p of 32's scale
        for (int h = 0; h < 2; h++) {
            for (int p = 0; p < 8; p++) {
                const __m256i s = _mm256_srai_epi32(_mm256_slli_epi32(sc[h][p], 16), 16);
                _mm256_storeu_si256((__m256i *)&o->sc[p][8 * h], p % 2 ? s : _mm256_slli_epi32(s, 4));
            }
        }
        for (int k = 0; k < 4; k++) {
            __m512i t[8];
            qx_t16(blk, offsetof(struct kvr_block_q4_K, qs) + 32 * (size_t)k, t);
            for (int g = 0; g < 8; g++) _mm512_storeu_si512(o->q[k][g], t[g]);
        }
    }
}
#else
QX_INLINE void qx_interleave_k(enum kvr_type type, const uint8_t * w, size_t row_bytes, int64_t r0, int64_t n_rows,
                               int64_t nb, struct qx_k_tile * restrict out) {
    const size_t bs = qx_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        struct qx_k_tile * o = out + b;
        const uint8_t * blk[8];
        for (int i = 0; i < 8; i++) {
            blk[i] = r0 + i < n_rows ? w + (size_t)(r0 + i) * row_bytes + (size_t)b * bs : NULL;
            struct qx_sc s = { 0 };
            if (blk[i]) qx_k_scales(type, blk[i], &s);
            o->d[i] = s.d;
            o->dmin[i] = s.dmin;
            for (int r = 0; r < 16; r++) o->sc[r][2 * i] = o->sc[r][2 * i + 1] = s.sc[r];
            for (int p = 0; p < 8; p++) {
                o->mn[p][2 * i]     = s.mn[2 * p];
                o->mn[p][2 * i + 1] = s.mn[2 * p + 1];
            }
        }
        for (int j = 0; j < 8; j++) {
            __m256i v[8];
            for (int i = 0; i < 8; i++) v[i] = blk[i] ? qx_chunk(type, blk[i], j) : _mm256_setzero_si256();
            qx_transpose8x32(v, o->q[j]);
        }
    }
}
#endif

// 4 bytes of a token's quants, in every lane
static inline __m256i qx_bcast4(const int8_t * q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

#if QX_L512
// out[t][i] = row i . token t over nb interleaved legacy blocks of 16 rows, for 4 tokens: the same
// integers (a block's sum exact in int32) and the same float operations as the 256-bit kernel's.
QX_INLINE void qx_x8_legacy(enum kvr_type type, const struct qx_l_x8 * restrict w, const void * const act[4],
                            int64_t nb, float out[4][QX_TILE_MAX]) {
    const struct qx_q8 * const a[4] = { act[0], act[1], act[2], act[3] };
    const int off = qx_x8_off(type);
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct qx_l_x8 * restrict wb = w + b;
        __m512i s32[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = off ? _mm512_set1_epi32(a[t][b].pad) : _mm512_setzero_si512(); // -off * sum
        QX_UNROLL
        for (int g = 0; g < 8; g++) {
            const __m512i wq = _mm512_loadu_si512(wb->q[g]);
            QX_UNROLL
            for (int t = 0; t < 4; t++) {
                int32_t y;
                memcpy(&y, a[t][b].qs + 4 * g, 4);
                s32[t] = _mm512_dpbusd_epi32(s32[t], wq, _mm512_set1_epi32(y));
            }
        }
        const __m512 dw = _mm512_loadu_ps(wb->d);
        QX_UNROLL
        for (int t = 0; t < 4; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[t]), _mm512_mul_ps(dw, _mm512_set1_ps(a[t][b].d)), acc[t]);
            if (qx_has_min(type)) acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(wb->m), _mm512_set1_ps(a[t][b].s), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < 4; t++) _mm512_storeu_ps(out[t], acc[t]);
}

// vpshufb indices that put byte b of each 32-bit lane into the lane's 4 bytes
static const uint8_t qx_byte_of_lane[4][64] = {
#define QX_BL(b) { 0+b,0+b,0+b,0+b, 4+b,4+b,4+b,4+b, 8+b,8+b,8+b,8+b, 12+b,12+b,12+b,12+b, \
                   0+b,0+b,0+b,0+b, 4+b,4+b,4+b,4+b, 8+b,8+b,8+b,8+b, 12+b,12+b,12+b,12+b, \
                   0+b,0+b,0+b,0+b, 4+b,4+b,4+b,4+b, 8+b,8+b,8+b,8+b, 12+b,12+b,12+b,12+b, \
                   0+b,0+b,0+b,0+b, 4+b,4+b,4+b,4+b, 8+b,8+b,8+b,8+b, 12+b,12+b,12+b,12+b }
    QX_BL(0), QX_BL(1), QX_BL(2), QX_BL(3)
#undef QX_BL
};

// out[t][i] = row i . token t over nb blocks of a tiled matrix (KVR_FLAG_TILED) for the nt tokens
// a[0..nt): the integers and float steps of qx_x8_legacy, each token alone in its accumulators, so
// a token's result does not depend on nt or on the tokens beside it, and a tiled matrix gives the
// bits the interleaved prompt kernel gives the file's rows. The 4-bit types keep their nibbles
// packed: a vector's low nibbles are elements 4j..4j+3 of each row, its high ones, taken as
// q & 0xf0 (16 times the quant), elements 16+4j..16+4j+3, whose sum goes apart and is divided by 16
// (exact) before it joins. The 5-bit types add each nibble's 5th bit from the rows' qh. The next
// blocks are prefetched QX_PREFETCH bytes ahead: a tile is one stream of memory, as a row is.
QX_INLINE void qx_tile_dot(enum kvr_type type, int nt, const uint8_t * restrict w, const struct qx_q8 * const a[4],
                           int64_t nb, float out[4][QX_TILE_MAX]) {
    // the fields (tile_fmt_of): d first, then m (Q4_1, Q5_1), qh (Q5_0, Q5_1), the quants last
    const bool q8 = type == KVR_TYPE_Q8_0, q5 = type == KVR_TYPE_Q5_0 || type == KVR_TYPE_Q5_1;
    const int nf = 2 + qx_has_min(type) + q5;
    const size_t tb = KVR_TILE_ROWS * qx_block_bytes(type), qo = tile_field(type, nf - 1), mo = tile_field(type, 1);
    const size_t qho = tile_field(type, nf - 2);
    const int off = qx_x8_off(type);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m4h = _mm512_set1_epi8((char)0xf0), c16 = _mm512_set1_epi8(16);
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * restrict tp = w + (size_t)b * tb;
        for (size_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)tp + QX_PREFETCH + o, _MM_HINT_T0);
        __m512i s32[4], hi32[4];
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            s32[t] = off ? _mm512_set1_epi32(a[t][b].pad) : _mm512_setzero_si512(); // -off * sum
            hi32[t] = _mm512_setzero_si512();
        }
        if (q8) {
            QX_UNROLL
            for (int g = 0; g < 8; g++) {
                const __m512i wq = _mm512_loadu_si512(tp + qo + 64 * g);
                QX_UNROLL
                for (int t = 0; t < nt; t++) {
                    int32_t y;
                    memcpy(&y, a[t][b].qs + 4 * g, 4);
                    s32[t] = _mm512_dpbusd_epi32(s32[t], wq, _mm512_set1_epi32(y));
                }
            }
        } else if (q5) {
            // the 5th bits: byte k of lane i of vector j (element 4j + k, and 16 + 4j + k) takes bit
            // 4j + k (16 + 4j + k) of row i's qh: its byte broadcast to the lane's 4 bytes, tested
            // against bit k of the nibble, adds 16
            const __m512i qh = _mm512_loadu_si512(tp + qho);
            QX_UNROLL
            for (int j = 0; j < 4; j++) {
                const __m512i wq = _mm512_loadu_si512(tp + qo + 64 * j);
                const __m512i bit = _mm512_set1_epi32(j % 2 ? (int)0x80402010 : 0x08040201);
                const __mmask64 hl = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, _mm512_loadu_si512(qx_byte_of_lane[j / 2])), bit);
                const __mmask64 hh = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, _mm512_loadu_si512(qx_byte_of_lane[2 + j / 2])), bit);
                const __m512i lo = _mm512_mask_add_epi8(_mm512_and_si512(wq, m4), hl, _mm512_and_si512(wq, m4), c16);
                const __m512i hi4 = _mm512_and_si512(_mm512_srli_epi16(wq, 4), m4);
                const __m512i hi = _mm512_mask_add_epi8(hi4, hh, hi4, c16);
                QX_UNROLL
                for (int t = 0; t < nt; t++) {
                    int32_t yl, yh;
                    memcpy(&yl, a[t][b].qs + 4 * j, 4);
                    memcpy(&yh, a[t][b].qs + 16 + 4 * j, 4);
                    s32[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s32[t], lo, _mm512_set1_epi32(yl)), hi, _mm512_set1_epi32(yh));
                }
            }
        } else {
            QX_UNROLL
            for (int j = 0; j < 4; j++) {
                const __m512i wq = _mm512_loadu_si512(tp + qo + 64 * j);
                const __m512i lo = _mm512_and_si512(wq, m4), hi = _mm512_and_si512(wq, m4h);
                QX_UNROLL
                for (int t = 0; t < nt; t++) {
                    int32_t yl, yh;
                    memcpy(&yl, a[t][b].qs + 4 * j, 4);
                    memcpy(&yh, a[t][b].qs + 16 + 4 * j, 4);
                    s32[t] = _mm512_dpbusd_epi32(s32[t], lo, _mm512_set1_epi32(yl));
                    hi32[t] = _mm512_dpbusd_epi32(hi32[t], hi, _mm512_set1_epi32(yh));
                }
            }
            QX_UNROLL
            for (int t = 0; t < nt; t++) s32[t] = _mm512_add_epi32(s32[t], _mm512_srai_epi32(hi32[t], 4));
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tp));
        const __m512 mw = qx_has_min(type) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tp + mo))) : _mm512_setzero_ps();
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[t]), _mm512_mul_ps(dw, _mm512_set1_ps(a[t][b].d)), acc[t]);
            if (qx_has_min(type)) acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[t][b].s), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(out[t], acc[t]);
}

// The 6-bit scales and mins of runs 0..7 (of 32) of 16 rows from their 12 scale bytes as a Q4_K
// or Q5_K tile keeps them (3 vectors at s: bytes 4v..4v+3 of row i at 64v + 4i): kvr_k4_scales'
// rule in the lanes, run j < 4 from bytes j and j + 4, the others from the low or high nibble of
// byte j + 4 and the top 2 bits of byte j - 4 or j.
static inline void qx_tile_k4_scales(const uint8_t * s, __m512i sc[8], __m512i mn[8]) {
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3);
    const __m512i v0 = _mm512_loadu_si512(s), v1 = _mm512_loadu_si512(s + 64), v2 = _mm512_loadu_si512(s + 128);
    QX_UNROLL
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm512_and_si512(_mm512_srli_epi32(v0, 8 * j), m6);
        mn[j] = _mm512_and_si512(_mm512_srli_epi32(v1, 8 * j), m6);
        sc[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 8 * j), m4),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v0, 8 * j + 6), m2), 4));
        mn[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 8 * j + 4), m4),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v1, 8 * j + 6), m2), 4));
    }
}

// Q6_K's tile: run r's (of 16) int8 scale of the 16 rows, sign-extended (byte r % 4 of vector r / 4 of sv).
static inline __m512i qx_tile_k6_scale(const __m512i sv[4], int r) {
    return _mm512_srai_epi32(_mm512_slli_epi32(sv[r / 4], 24 - 8 * (r % 4)), 24);
}

// Q6_K's tile: the quants of elements 128h + 32s + 4g..+3 of the 16 rows (unsigned, 0..63), from the
// low nibbles (ql) and the 2 high bits (qh) of the tile at tp.
static inline __m512i qx_tile_k6_quants(const uint8_t * tp, int h, int s, int g) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    const __m512i l = _mm512_loadu_si512(tp + 64 * (16 * h + 8 * (s % 2) + g));
    const __m512i hb = _mm512_loadu_si512(tp + 2048 + 64 * (8 * h + g));
    return _mm512_or_si512(_mm512_and_si512(s / 2 ? _mm512_srli_epi16(l, 4) : l, m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * s), m2), 4));
}

// Q5_K's tile: the quants of elements 64k + 32s + 4g..+3 of the 16 rows (0..31): the nibble of qs
// (vector 8k + g) and bit 2k + s of qh (vector g) as the 5th.
static inline __m512i qx_tile_k5_quants(const uint8_t * qs, const uint8_t * qh, int k, int s, int g) {
    const __m512i q = _mm512_loadu_si512(qs + 64 * (8 * k + g)), h = _mm512_loadu_si512(qh + 64 * g);
    return _mm512_or_si512(_mm512_and_si512(s ? _mm512_srli_epi16(q, 4) : q, _mm512_set1_epi8(0x0f)),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * k + s), _mm512_set1_epi8(1)), 4));
}

// qx_tile_dot for Q4_K's and Q5_K's tiles (fields d, dmin, the 12 scale bytes, Q5_K's qh, qs): per
// super-block the 16 rows' 6-bit scales and mins come out of the scale bytes in the lanes
// (kvr_k4_scales' rule), and then the integers and float steps are the interleaved prompt
// kernels': Q4_K qx_x8_q4k's (a run's low nibbles times 16 times its scale, the next run's high
// nibbles, q & 0xf0, times its scale, the sum divided by 16), Q5_K qx_x8_k's (5-bit quants, each
// run times its scale); the mins by vpdpwssd with the token's sums of 16 (qx_k16_end's). So a
// tiled matrix gives the prompt kernel's bits, and a token its bits alone or with others.
QX_INLINE void qx_tile_k45(bool q5, int nt, const uint8_t * restrict w, const struct qx_q8K * const a[4], int64_t nb,
                           float out[4][QX_TILE_MAX]) {
    // d at 0, dmin at 32, the scale bytes at 64, Q5_K's qh (8 vectors) at 256, the quants after
    const size_t tb = KVR_TILE_ROWS * (q5 ? sizeof(struct kvr_block_q5_K) : sizeof(struct kvr_block_q4_K));
    const size_t so = 64, ho = 256, qo = q5 ? 256 + 512 : 256;
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8((char)0xf0);
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * restrict tp = w + (size_t)b * tb;
        for (size_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)tp + QX_PREFETCH + o, _MM_HINT_T0);
        __m512i sc[8], mn[8];
        qx_tile_k4_scales(tp + so, sc, mn);
        __m512i s32[4], m32[4];
        QX_UNROLL
        for (int t = 0; t < nt; t++) s32[t] = m32[t] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            __m512i pl[4], ph[4];
            QX_UNROLL
            for (int t = 0; t < nt; t++) pl[t] = ph[t] = _mm512_setzero_si512();
            QX_UNROLL
            for (int g = 0; g < 8; g++) {
                const __m512i q = _mm512_loadu_si512(tp + qo + 64 * (8 * k + g));
                // Q5_K: each quant whole, its 5th bit from qh (no 16x)
                const __m512i ql = q5 ? qx_tile_k5_quants(tp + qo, tp + ho, k, 0, g) : _mm512_and_si512(q, lo);
                const __m512i qh = q5 ? qx_tile_k5_quants(tp + qo, tp + ho, k, 1, g) : _mm512_and_si512(q, hi);
                QX_UNROLL
                for (int t = 0; t < nt; t++) {
                    int32_t yl, yh;
                    memcpy(&yl, a[t][b].qs + 64 * k + 4 * g, 4);
                    memcpy(&yh, a[t][b].qs + 64 * k + 32 + 4 * g, 4);
                    pl[t] = _mm512_dpbusd_epi32(pl[t], ql, _mm512_set1_epi32(yl));
                    ph[t] = _mm512_dpbusd_epi32(ph[t], qh, _mm512_set1_epi32(yh));
                }
            }
            const __m512i sl = q5 ? sc[2 * k] : _mm512_slli_epi32(sc[2 * k], 4), sh = sc[2 * k + 1];
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                s32[t] = _mm512_add_epi32(s32[t], _mm512_add_epi32(_mm512_mullo_epi32(pl[t], sl), _mm512_mullo_epi32(ph[t], sh)));
            }
        }
        // the mins: runs of 16 2pp and 2pp + 1 share run pp of 32's min
        QX_UNROLL
        for (int pp = 0; pp < 8; pp++) {
            const __m512i v = _mm512_or_si512(mn[pp], _mm512_slli_epi32(mn[pp], 16));
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                int32_t s;
                memcpy(&s, a[t][b].bsum + 2 * pp, 4);
                m32[t] = _mm512_dpwssd_epi32(m32[t], v, _mm512_set1_epi32(s));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tp));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tp + 32)));
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            const __m512 da = _mm512_set1_ps(a[t][b].d);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q5 ? s32[t] : _mm512_srai_epi32(s32[t], 4)), _mm512_mul_ps(dw, da), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m32[t]), _mm512_mul_ps(dm, da), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(out[t], acc[t]);
}

// qx_tile_dot for Q6_K's tiles (fields ql, qh, the 16 int8 scales, d): element 128h + 32s + l of a
// row is nibble s / 2 of ql[64h + 32 (s % 2) + l] with bits 2s, 2s + 1 of qh[32h + l] above it
// (ggml's layout), unpacked in the registers 16 rows at a time; then qx_x8_k's integers (each run
// of 16 times its scale) and qx_k16_end's float steps (the offset 32 as mins of 32 times the
// scale): the interleaved prompt kernel's bits, and a token's bits alone or with others.
QX_INLINE void qx_tile_k6(int nt, const uint8_t * restrict w, const struct qx_q8K * const a[4], int64_t nb,
                          float out[4][QX_TILE_MAX]) {
    const size_t tb = KVR_TILE_ROWS * sizeof(struct kvr_block_q6_K), so = 3072, dof = 3328; // ql at 0, qh at 2048
    const __m512i low16 = _mm512_set1_epi32(0xffff);
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * restrict tp = w + (size_t)b * tb;
        for (size_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)tp + QX_PREFETCH + o, _MM_HINT_T0);
        __m512i sv[4];
        QX_UNROLL
        for (int v = 0; v < 4; v++) sv[v] = _mm512_loadu_si512(tp + so + 64 * v);
        __m512i s32[4], m32[4];
        QX_UNROLL
        for (int t = 0; t < nt; t++) s32[t] = m32[t] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 4; s++) {
                __m512i p[2][4]; // the two runs of 16 of elements 128h + 32s ..
                QX_UNROLL
                for (int t = 0; t < nt; t++) p[0][t] = p[1][t] = _mm512_setzero_si512();
                QX_UNROLL
                for (int g = 0; g < 8; g++) {
                    const __m512i q = qx_tile_k6_quants(tp, h, s, g);
                    QX_UNROLL
                    for (int t = 0; t < nt; t++) {
                        int32_t y;
                        memcpy(&y, a[t][b].qs + 128 * h + 32 * s + 4 * g, 4);
                        p[g / 4][t] = _mm512_dpbusd_epi32(p[g / 4][t], q, _mm512_set1_epi32(y));
                    }
                }
                QX_UNROLL
                for (int u = 0; u < 2; u++) {
                    const __m512i sc = qx_tile_k6_scale(sv, 8 * h + 2 * s + u);
                    QX_UNROLL
                    for (int t = 0; t < nt; t++) s32[t] = _mm512_add_epi32(s32[t], _mm512_mullo_epi32(p[u][t], sc));
                }
            }
        }
        // the offset: 32 times each run's scale, as int16 pairs of runs 2pp, 2pp + 1, against the token's sums of 16
        QX_UNROLL
        for (int pp = 0; pp < 8; pp++) {
            const __m512i v = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(qx_tile_k6_scale(sv, 2 * pp), 5), low16),
                                              _mm512_slli_epi32(qx_tile_k6_scale(sv, 2 * pp + 1), 21));
            QX_UNROLL
            for (int t = 0; t < nt; t++) {
                int32_t x;
                memcpy(&x, a[t][b].bsum + 2 * pp, 4);
                m32[t] = _mm512_dpwssd_epi32(m32[t], v, _mm512_set1_epi32(x));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tp + dof)));
        QX_UNROLL
        for (int t = 0; t < nt; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s32[t], m32[t])), _mm512_mul_ps(dw, _mm512_set1_ps(a[t][b].d)), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(out[t], acc[t]);
}

// A tiled type's kernel for 1..4 tokens (their activations: struct qx_q8, or qx_q8K for the
// K-quants), each count its own unrolled copy.
typedef void (*qx_tile_fn)(const uint8_t * w, const void * const a[4], int nt, int64_t nb, float out[4][QX_TILE_MAX]);
#define QX_TILE_FN(name, T)                                                                                   \
    static void qx_tile_##name(const uint8_t * w, const void * const act[4], int nt, int64_t nb,             \
                               float out[4][QX_TILE_MAX]) {                                                   \
        const struct qx_q8 * const a[4] = { act[0], act[1], act[2], act[3] };                                 \
        switch (nt) {                                                                                         \
            case 1:  qx_tile_dot(T, 1, w, a, nb, out); break;                                                 \
            case 2:  qx_tile_dot(T, 2, w, a, nb, out); break;                                                 \
            case 3:  qx_tile_dot(T, 3, w, a, nb, out); break;                                                 \
            default: qx_tile_dot(T, 4, w, a, nb, out); break;                                                 \
        }                                                                                                     \
    }
#define QX_TILE_KFN(name, kernel)                                                                             \
    static void qx_tile_##name(const uint8_t * w, const void * const act[4], int nt, int64_t nb,             \
                               float out[4][QX_TILE_MAX]) {                                                   \
        const struct qx_q8K * const a[4] = { act[0], act[1], act[2], act[3] };                                \
        switch (nt) {                                                                                         \
            case 1:  kernel(1, w, a, nb, out); break;                                                         \
            case 2:  kernel(2, w, a, nb, out); break;                                                         \
            case 3:  kernel(3, w, a, nb, out); break;                                                         \
            default: kernel(4, w, a, nb, out); break;                                                         \
        }                                                                                                     \
    }
#define qx_tile_k4(nt, w, a, nb, out) qx_tile_k45(false, nt, w, a, nb, out)
#define qx_tile_k5(nt, w, a, nb, out) qx_tile_k45(true, nt, w, a, nb, out)
QX_TILE_KFN(q4_K, qx_tile_k4) QX_TILE_KFN(q5_K, qx_tile_k5) QX_TILE_KFN(q6_K, qx_tile_k6)
#undef qx_tile_k4
#undef qx_tile_k5
#undef QX_TILE_KFN
QX_TILE_FN(q4_0, KVR_TYPE_Q4_0) QX_TILE_FN(q4_1, KVR_TYPE_Q4_1) QX_TILE_FN(q5_0, KVR_TYPE_Q5_0) QX_TILE_FN(q5_1, KVR_TYPE_Q5_1)
QX_TILE_FN(q8_0, KVR_TYPE_Q8_0)
#undef QX_TILE_FN

// A K-quant tile's super-block b into the interleaved prompt kernels' form (struct qx_q4k_tile for
// Q4_K, qx_k_tile for Q5_K and Q6_K), the scales decoded and the quants unpacked once, as the tile
// kernels do for every 4 tokens: a long prompt's tokens then meet the prompt kernel (the same
// integers and float steps, so the same bits) instead of unpacking a tile again every 4 tokens.
static void qx_tile_unpack_k(enum kvr_type type, const uint8_t * restrict tile, int64_t b, void * restrict out) {
    const __m512i low16 = _mm512_set1_epi32(0xffff);
    if (type == KVR_TYPE_Q6_K) {
        const uint8_t * tp = tile + (size_t)b * KVR_TILE_ROWS * sizeof(struct kvr_block_q6_K);
        struct qx_k_tile * o = out;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tp + 3328)));
        _mm512_storeu_ps(o->d, d);
        _mm512_storeu_ps(o->dmin, d);
        __m512i sv[4];
        for (int v = 0; v < 4; v++) sv[v] = _mm512_loadu_si512(tp + 3072 + 64 * v);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512(o->sc[r], qx_tile_k6_scale(sv, r));
        for (int pp = 0; pp < 8; pp++) {
            _mm512_storeu_si512(o->mn[pp], _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(qx_tile_k6_scale(sv, 2 * pp), 5), low16),
                                                           _mm512_slli_epi32(qx_tile_k6_scale(sv, 2 * pp + 1), 21)));
        }
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 4; s++) {
                for (int g = 0; g < 8; g++) _mm512_storeu_si512(o->q[4 * h + s][g], qx_tile_k6_quants(tp, h, s, g));
            }
        }
        return;
    }
    const bool q5 = type == KVR_TYPE_Q5_K;
    const size_t tb = KVR_TILE_ROWS * (q5 ? sizeof(struct kvr_block_q5_K) : sizeof(struct kvr_block_q4_K)), qo = q5 ? 768 : 256;
    const uint8_t * tp = tile + (size_t)b * tb;
    __m512i sc[8], mn[8];
    qx_tile_k4_scales(tp + 64, sc, mn);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tp)), dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tp + 32)));
    float * od = q5 ? ((struct qx_k_tile *)out)->d : ((struct qx_q4k_tile *)out)->d;
    float * odm = q5 ? ((struct qx_k_tile *)out)->dmin : ((struct qx_q4k_tile *)out)->dmin;
    int32_t (*omn)[16] = q5 ? ((struct qx_k_tile *)out)->mn : ((struct qx_q4k_tile *)out)->mn;
    _mm512_storeu_ps(od, d);
    _mm512_storeu_ps(odm, dmin);
    for (int pp = 0; pp < 8; pp++) _mm512_storeu_si512(omn[pp], _mm512_or_si512(mn[pp], _mm512_slli_epi32(mn[pp], 16)));
    if (!q5) {
        struct qx_q4k_tile * o = out;
        for (int r = 0; r < 8; r++) _mm512_storeu_si512(o->sc[r], r % 2 ? sc[r] : _mm512_slli_epi32(sc[r], 4));
        memcpy(o->q, tp + qo, sizeof(o->q));
        return;
    }
    struct qx_k_tile * o = out;
    for (int r = 0; r < 16; r++) _mm512_storeu_si512(o->sc[r], sc[r / 2]);
    for (int k = 0; k < 4; k++) {
        for (int g = 0; g < 8; g++) {
            for (int s = 0; s < 2; s++) _mm512_storeu_si512(o->q[2 * k + s][g], qx_tile_k5_quants(tp + qo, tp + 256, k, s, g));
        }
    }
}

static qx_tile_fn qx_tile_kernel(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q4_0: return qx_tile_q4_0;
        case KVR_TYPE_Q4_1: return qx_tile_q4_1;
        case KVR_TYPE_Q5_0: return qx_tile_q5_0;
        case KVR_TYPE_Q5_1: return qx_tile_q5_1;
        case KVR_TYPE_Q8_0: return qx_tile_q8_0;
        case KVR_TYPE_Q4_K: return qx_tile_q4_K;
        case KVR_TYPE_Q5_K: return qx_tile_q5_K;
        case KVR_TYPE_Q6_K: return qx_tile_q6_K;
        default:            KVR_ASSERT(!"a tiled type"); return NULL;
    }
}

#else
// out[t][i] = row i . token t over nb interleaved legacy blocks, for 4 tokens.
QX_INLINE void qx_x8_legacy(enum kvr_type type, const struct qx_l_x8 * restrict w, const void * const act[4],
                            int64_t nb, float out[4][QX_TILE_MAX]) {
    const struct qx_q8 * const a[4] = { act[0], act[1], act[2], act[3] };
    const int F = qx_flush(type), off = qx_offset(type);
    const bool sgn = qx_signed(type);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct qx_l_x8 * restrict wb = w + b;
        __m256i s32[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = _mm256_setzero_si256();
        if (QX_VNNI) { // each group's products straight into the int32 sums: no int16 stage to flush
            for (int g = 0; g < 8; g++) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)wb->q[g]);
                const __m256i ws = sgn ? _mm256_loadu_si256((const __m256i *)wb->s[g]) : wq;
                QX_UNROLL
                for (int t = 0; t < 4; t++) {
                    __m256i y = qx_bcast4(a[t][b].qs + 4 * g);
                    if (sgn) y = _mm256_sign_epi8(y, ws);
                    s32[t] = qx_dpbusd(s32[t], wq, y);
                }
            }
        } else for (int g0 = 0; g0 < 8; g0 += F) {
            __m256i p[4];
            QX_UNROLL
            for (int t = 0; t < 4; t++) p[t] = _mm256_setzero_si256();
            for (int g = g0; g < g0 + F; g++) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)wb->q[g]);
                const __m256i ws = sgn ? _mm256_loadu_si256((const __m256i *)wb->s[g]) : wq;
                QX_UNROLL
                for (int t = 0; t < 4; t++) {
                    __m256i y = qx_bcast4(a[t][b].qs + 4 * g);
                    if (sgn) y = _mm256_sign_epi8(y, ws);
                    p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(wq, y));
                }
            }
            QX_UNROLL
            for (int t = 0; t < 4; t++) s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(p[t], ones));
        }
        const __m256 dw = _mm256_loadu_ps(wb->d);
        QX_UNROLL
        for (int t = 0; t < 4; t++) {
            const struct qx_q8 * ab = a[t] + b;
            __m256i si = s32[t];
            if (off) si = _mm256_sub_epi32(si, _mm256_set1_epi32(off * ab->sum));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, _mm256_set1_ps(ab->d)), acc[t]);
            if (qx_has_min(type)) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(wb->m), _mm256_set1_ps(ab->s), acc[t]);
        }
    }
    QX_UNROLL
    for (int t = 0; t < 4; t++) _mm256_storeu_ps(out[t], acc[t]);
}

#endif

#if QX_L512
// Values a scale of the type covers: a run (16; 32 for Q4_K and Q5_K, whose runs pair up).
QX_INLINE int qx_k_run(enum kvr_type t) {
    return t == KVR_TYPE_Q4_K || t == KVR_TYPE_Q5_K ? 32 : 16;
}

// A super-block's end in the 512-bit K kernels: the mins, sum_r mn_r * (the token's sum of run r)
// (two runs a product), then each token's sums s32 and mins into acc.
QX_INLINE void qx_k16_end(enum kvr_type type, const int32_t mn[8][16], const float * d, const float * dmin,
                          const struct qx_q8K * const a[4], int64_t b, const __m512i s32[4], __m512 acc[4]) {
    __m512i m[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) m[t] = _mm512_setzero_si512();
    for (int pp = 0; pp < 8; pp++) {
        const __m512i v = _mm512_loadu_si512(mn[pp]);
        QX_UNROLL
        for (int t = 0; t < 4; t++) {
            int32_t s;
            memcpy(&s, a[t][b].bsum + 2 * pp, 4);
            m[t] = _mm512_dpwssd_epi32(m[t], v, _mm512_set1_epi32(s));
        }
    }
    const __m512 dw = _mm512_loadu_ps(d), dm = _mm512_loadu_ps(dmin);
    QX_UNROLL
    for (int t = 0; t < 4; t++) {
        const __m512 da = _mm512_set1_ps(a[t][b].d);
        if (qx_k_offset(type)) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s32[t], m[t])), _mm512_mul_ps(dw, da), acc[t]);
        } else {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[t]), _mm512_mul_ps(dw, da), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m[t]), _mm512_mul_ps(dm, da), acc[t]);
        }
    }
}

// out[t][i] = row i . token t over nb interleaved super-blocks of 16 rows, for 4 tokens: each run's
// products summed in int32 (VNNI), times the run's scale (vpmulld), its mins as int16 pairs
// (vpdpwssd): the same integers and float operations as the 256-bit kernel's.
QX_INLINE void qx_x8_k(enum kvr_type type, const struct qx_k_tile * restrict w, const void * const act[4],
                       int64_t nb, float out[4][QX_TILE_MAX]) {
    const struct qx_q8K * const a[4] = { act[0], act[1], act[2], act[3] };
    const int G = qx_k_run(type) / 4; // groups of 4 bytes a run
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct qx_k_tile * restrict wb = w + b;
        __m512i s32[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            QX_UNROLL
            for (int g0 = 0; g0 < 8; g0 += G) {
                __m512i p[4];
                QX_UNROLL
                for (int t = 0; t < 4; t++) p[t] = _mm512_setzero_si512();
                QX_UNROLL
                for (int g = g0; g < g0 + G; g++) {
                    const __m512i wq = _mm512_loadu_si512(wb->q[j][g]);
                    QX_UNROLL
                    for (int t = 0; t < 4; t++) {
                        int32_t y;
                        memcpy(&y, a[t][b].qs + 32 * j + 4 * g, 4);
                        p[t] = _mm512_dpbusd_epi32(p[t], wq, _mm512_set1_epi32(y));
                    }
                }
                const __m512i sc = _mm512_loadu_si512(wb->sc[2 * j + g0 / 4]);
                QX_UNROLL
                for (int t = 0; t < 4; t++) s32[t] = _mm512_add_epi32(s32[t], _mm512_mullo_epi32(p[t], sc));
            }
        }
        qx_k16_end(type, wb->mn, wb->d, wb->dmin, a, b, s32, acc);
    }
    QX_UNROLL
    for (int t = 0; t < 4; t++) _mm512_storeu_ps(out[t], acc[t]);
}

// qx_x8_k over packed Q4_K tiles (struct qx_q4k_tile): the same integers, so the same floats.
static void qx_x8_q4k(const struct qx_q4k_tile * restrict w, const void * const act[4], int64_t nb,
                      float out[4][QX_TILE_MAX]) {
    const struct qx_q8K * const a[4] = { act[0], act[1], act[2], act[3] };
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8((char)0xf0);
    __m512 acc[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct qx_q4k_tile * restrict wb = w + b;
        __m512i s32[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            __m512i pl[4], ph[4];
            QX_UNROLL
            for (int t = 0; t < 4; t++) pl[t] = ph[t] = _mm512_setzero_si512();
            QX_UNROLL
            for (int g = 0; g < 8; g++) {
                const __m512i q = _mm512_loadu_si512(wb->q[k][g]);
                const __m512i ql = _mm512_and_si512(q, lo), qh = _mm512_and_si512(q, hi);
                QX_UNROLL
                for (int t = 0; t < 4; t++) {
                    int32_t yl, yh;
                    memcpy(&yl, a[t][b].qs + 64 * k + 4 * g, 4);
                    memcpy(&yh, a[t][b].qs + 64 * k + 32 + 4 * g, 4);
                    pl[t] = _mm512_dpbusd_epi32(pl[t], ql, _mm512_set1_epi32(yl));
                    ph[t] = _mm512_dpbusd_epi32(ph[t], qh, _mm512_set1_epi32(yh));
                }
            }
            const __m512i sl = _mm512_loadu_si512(wb->sc[2 * k]), sh = _mm512_loadu_si512(wb->sc[2 * k + 1]);
            QX_UNROLL
            for (int t = 0; t < 4; t++) {
                s32[t] = _mm512_add_epi32(s32[t], _mm512_add_epi32(_mm512_mullo_epi32(pl[t], sl), _mm512_mullo_epi32(ph[t], sh)));
            }
        }
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = _mm512_srai_epi32(s32[t], 4);
        qx_k16_end(KVR_TYPE_Q4_K, wb->mn, wb->d, wb->dmin, a, b, s32, acc);
    }
    QX_UNROLL
    for (int t = 0; t < 4; t++) _mm512_storeu_ps(out[t], acc[t]);
}
#else
// out[t][i] = row i . token t over nb interleaved super-blocks, for 4 tokens: 4 int16 sums of a
// flush and 4 int32 sums of a super-block take 8 of AVX2's 16 registers; each weight vector loaded
// serves all 4 tokens.
QX_INLINE void qx_x8_k(enum kvr_type type, const struct qx_k_tile * restrict w, const void * const act[4],
                       int64_t nb, float out[4][QX_TILE_MAX]) {
    const struct qx_q8K * const a[4] = { act[0], act[1], act[2], act[3] };
    const int F = qx_flush(type);
    __m256 acc[4];
    QX_UNROLL
    for (int t = 0; t < 4; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const struct qx_k_tile * restrict wb = w + b;
        __m256i s32[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) s32[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            for (int g0 = 0; g0 < 8; g0 += F) {
                __m256i p[4];
                QX_UNROLL
                for (int t = 0; t < 4; t++) p[t] = _mm256_setzero_si256();
                for (int g = g0; g < g0 + F; g++) {
                    const __m256i wq = _mm256_loadu_si256((const __m256i *)wb->q[j][g]);
                    QX_UNROLL
                    for (int t = 0; t < 4; t++) p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(wq, qx_bcast4(a[t][b].qs + 32 * j + 4 * g)));
                }
                const __m256i sc = _mm256_loadu_si256((const __m256i *)wb->sc[2 * j + g0 / 4]);
                QX_UNROLL
                for (int t = 0; t < 4; t++) s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(p[t], sc));
            }
        }
        // the mins: sum_r mn_r * (the token's sum of run r), two runs a madd
        __m256i m[4];
        QX_UNROLL
        for (int t = 0; t < 4; t++) m[t] = _mm256_setzero_si256();
        for (int pp = 0; pp < 8; pp++) {
            const __m256i mn = _mm256_loadu_si256((const __m256i *)wb->mn[pp]);
            QX_UNROLL
            for (int t = 0; t < 4; t++) {
                int32_t v;
                memcpy(&v, a[t][b].bsum + 2 * pp, 4);
                m[t] = _mm256_add_epi32(m[t], _mm256_madd_epi16(mn, _mm256_set1_epi32(v)));
            }
        }
        const __m256 dw = _mm256_loadu_ps(wb->d), dm = _mm256_loadu_ps(wb->dmin);
        QX_UNROLL
        for (int t = 0; t < 4; t++) {
            const __m256 da = _mm256_set1_ps(a[t][b].d);
            if (qx_k_offset(type)) {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s32[t], m[t])), _mm256_mul_ps(dw, da), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[t]), _mm256_mul_ps(dw, da), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m[t]), _mm256_mul_ps(dm, da), acc[t]);
            }
        }
    }
    QX_UNROLL
    for (int t = 0; t < 4; t++) _mm256_storeu_ps(out[t], acc[t]);
}
#endif

// One type's interleave and 8-row kernel, as functions (the kernels above are inlined into them).
#define QX_X8_FNS(name, T, kind) \
    static void qx_il_##name(const uint8_t * w, size_t rb, int64_t r0, int64_t n, int64_t nb, void * out) { \
        qx_interleave_##kind(T, w, rb, r0, n, nb, out); \
    } \
    static void qx_dot_##name(const void * w, const void * const a[4], int64_t nb, float out[4][QX_TILE_MAX]) { \
        qx_x8_##kind(T, w, a, nb, out); \
    }
QX_X8_FNS(q4_0, KVR_TYPE_Q4_0, legacy) QX_X8_FNS(q4_1, KVR_TYPE_Q4_1, legacy) QX_X8_FNS(q5_0, KVR_TYPE_Q5_0, legacy)
QX_X8_FNS(q5_1, KVR_TYPE_Q5_1, legacy) QX_X8_FNS(q8_0, KVR_TYPE_Q8_0, legacy) QX_X8_FNS(q8_1, KVR_TYPE_Q8_1, legacy)
QX_X8_FNS(q2_K, KVR_TYPE_Q2_K, k) QX_X8_FNS(q3_K, KVR_TYPE_Q3_K, k) QX_X8_FNS(q5_K, KVR_TYPE_Q5_K, k)
QX_X8_FNS(q6_K, KVR_TYPE_Q6_K, k)
#undef QX_X8_FNS
#if QX_L512
static void qx_il_q4_K(const uint8_t * w, size_t rb, int64_t r0, int64_t n, int64_t nb, void * out) {
    qx_interleave_q4k(w, rb, r0, n, nb, out);
}
static void qx_dot_q4_K(const void * w, const void * const a[4], int64_t nb, float out[4][QX_TILE_MAX]) {
    qx_x8_q4k(w, a, nb, out);
}
#define QX_Q4_K_TILE sizeof(struct qx_q4k_tile)
#else
static void qx_il_q4_K(const uint8_t * w, size_t rb, int64_t r0, int64_t n, int64_t nb, void * out) {
    qx_interleave_k(KVR_TYPE_Q4_K, w, rb, r0, n, nb, out);
}
static void qx_dot_q4_K(const void * w, const void * const a[4], int64_t nb, float out[4][QX_TILE_MAX]) {
    qx_x8_k(KVR_TYPE_Q4_K, w, a, nb, out);
}
#define QX_Q4_K_TILE sizeof(struct qx_k_tile)
#endif

// The 8-row kernels of a type; false for a type without (Q8_K: its products go row by row).
static bool qx_x8_get(enum kvr_type t, struct qx_x8_fns * f) {
    switch (t) {
#define QX_CASE(T, name, ...) case T: *f = (struct qx_x8_fns){ qx_il_##name, qx_dot_##name, __VA_ARGS__ }; return true; // bytes, rows
#define QX_L sizeof(struct qx_l_x8), QX_L_ROWS
#define QX_K sizeof(struct qx_k_tile), QX_K_ROWS
        QX_CASE(KVR_TYPE_Q4_0, q4_0, QX_L) QX_CASE(KVR_TYPE_Q4_1, q4_1, QX_L) QX_CASE(KVR_TYPE_Q5_0, q5_0, QX_L)
        QX_CASE(KVR_TYPE_Q5_1, q5_1, QX_L) QX_CASE(KVR_TYPE_Q8_0, q8_0, QX_L) QX_CASE(KVR_TYPE_Q8_1, q8_1, QX_L)
        QX_CASE(KVR_TYPE_Q2_K, q2_K, QX_K) QX_CASE(KVR_TYPE_Q3_K, q3_K, QX_K) QX_CASE(KVR_TYPE_Q4_K, q4_K, QX_Q4_K_TILE, QX_K_ROWS)
        QX_CASE(KVR_TYPE_Q5_K, q5_K, QX_K) QX_CASE(KVR_TYPE_Q6_K, q6_K, QX_K)
#undef QX_L
#undef QX_K
#undef QX_CASE
        default: return false;
    }
}

#else

static bool qx_x8_get(enum kvr_type t, struct qx_x8_fns * f) {
    (void)t;
    *f = (struct qx_x8_fns){ NULL, NULL, 0, 8 };
    return false;
}

#endif

// Rows per interleaved block: two tiles of 16 rows (four of 8), tens of KiB per 1024 values of K, so a block stays in
// L2 while every token of the chunk passes over it. Tokens are quantized a chunk at a time (a few
// MiB), so the scratch stays bounded however long the prompt.
#define QX_MM_ROWS   32
#define QX_MM_TOKENS 512
#define QX_ROW_TOKENS KVR_ROW_TOKENS // up to this many tokens go row by row (decode: each row read once)

// Which way the integer path multiplies T tokens: row by row (decode: each row read once) or
// through 8 interleaved rows (prefill).
static bool qx_uses_x8(enum kvr_type t, int64_t T) {
    struct qx_x8_fns f;
    return T > QX_ROW_TOKENS && qx_x8_get(t, &f);
}

// Bytes of scratch the integer path needs for a matmul of T tokens over K values.
static size_t qx_scratch_bytes(enum kvr_type t, int64_t K, int64_t T) {
    struct qx_x8_fns f;
    if (!qx_uses_x8(t, T)) return qx_rows_bytes(t, K, T < QX_ROW_TOKENS ? T : QX_ROW_TOKENS);
    qx_x8_get(t, &f);
    const int64_t nb = K / kvr_blck_size(t);
    return (size_t)QX_MM_TOKENS * qx_act_bytes(t, K) + (size_t)(QX_MM_ROWS / f.rows * nb) * f.tile_bytes;
}

#if QX_L512
// Y[t][n] = W[n] . X[t] over a tiled matrix (KVR_FLAG_TILED; N a multiple of 16) for all T tokens,
// rows by chunks of whole tiles (struct mm_chunks): decode, a decode batch and a prompt alike. The
// tokens go a chunk of QX_MM_TOKENS at a time (quantized by each thread: the scratch holds one
// chunk's activations), and each tile meets every 4 of them while it is in the nearest caches.
// scratch: min(T, QX_MM_TOKENS) tokens' activations. A single chunk of the graph tensor xkey (NULL:
// none) is quantized into the thread's cache ac instead, or found there (struct qx_act_cache).
// Returns the rows this thread computed (on average over the tokens).
#define QX_TILE_UNPACK_TOKENS 8 // a K-quant tile met by this many tokens is unpacked once (qx_tile_unpack_k)

static int64_t qx_mul_tiles(enum kvr_type type, const uint8_t * W, size_t row_bytes, int64_t K, int64_t N,
                            const struct mm_chunks * chunks, const float * X, int64_t ldx, int64_t T, float * Y, int64_t ldy,
                            void * scratch, size_t scratch_bytes, struct qx_act_cache * ac, const void * xkey, uint64_t run) {
    const int64_t nb = K / kvr_blck_size(type);
    const size_t ab = qx_act_bytes(type, K);
    const size_t act_bytes = (size_t)(T < QX_MM_TOKENS ? T : QX_MM_TOKENS) * ab;
    KVR_ASSERT(N % KVR_TILE_ROWS == 0 && chunks->rows % KVR_TILE_ROWS == 0 && act_bytes <= scratch_bytes);
    const qx_tile_fn f = qx_tile_kernel(type);
    uint8_t * act = scratch;
    int64_t quantized = -1, done = 0;
    // one chunk of tokens from a graph's tensor: its activations from the thread's cache, if they are there
    const int form = qx_is_k(type) ? -1 : qx_x8_off(type);
    bool cached = ac && xkey && T <= QX_MM_TOKENS && act_bytes <= QX_ACACHE_MAX;
    if (cached && act_bytes > ac->cap) {
        free(ac->buf);
        ac->buf = malloc(act_bytes);
        ac->cap = ac->buf ? act_bytes : 0;
        ac->key = NULL;
        cached = ac->buf != NULL; // without it, the scratch as before
    }
    if (cached) {
        act = ac->buf;
        if (ac->key == xkey && ac->run == run && ac->K == K && ac->T == T && ac->form == form) quantized = 0;
    }
    // the prompt kernel of a K-quant (qx_tile_unpack_k) and its tile's bytes after the activations,
    // where the scratch has room (a prompt's has; a decode batch's may not)
    struct qx_x8_fns px = { 0 };
    if (qx_is_k(type)) qx_x8_get(type, &px);
    uint8_t * px_tile = (uint8_t *)scratch + act_bytes;
    const bool px_room = px.dot && act_bytes + (size_t)nb * px.tile_bytes <= scratch_bytes;
    // work item k: rows chunk k % per of token chunk k / per
    const int64_t per = (N + chunks->rows - 1) / chunks->rows, items = per * ((T + QX_MM_TOKENS - 1) / QX_MM_TOKENS);
    for (;;) {
        const int64_t k = atomic_fetch_add_explicit(chunks->next, 1, memory_order_relaxed);
        if (k >= items) break;
        const int64_t c0 = k / per * QX_MM_TOKENS, nt = T - c0 < QX_MM_TOKENS ? T - c0 : QX_MM_TOKENS;
        const int64_t m0 = k % per * chunks->rows, m1 = m0 + chunks->rows < N ? m0 + chunks->rows : N;
        if (quantized != c0) {
            for (int64_t t = 0; t < nt; t++) qx_quantize(type, X + (c0 + t) * ldx, act + (size_t)t * ab, K);
            if (qx_is_legacy(type)) qx_x8_prepare(type, (struct qx_q8 *)act, nt * nb);
            quantized = c0;
            if (cached) *ac = (struct qx_act_cache){ ac->buf, ac->cap, xkey, run, K, T, form };
        }
        done += (m1 - m0) * nt;
        for (int64_t r = m0; r < m1; r += KVR_TILE_ROWS) {
            const uint8_t * tile = W + (size_t)r * row_bytes;
            // a K-quant tile that many tokens meet: unpacked once into the prompt kernel's form
            const bool unpack = px_room && nt >= QX_TILE_UNPACK_TOKENS;
            for (int64_t b = 0; unpack && b < nb; b++) qx_tile_unpack_k(type, tile, b, px_tile + (size_t)b * px.tile_bytes);
            for (int64_t t = 0; t < nt; t += 4) {
                const int n = nt - t >= 4 ? 4 : (int)(nt - t);
                const void * a[4];
                for (int j = 0; j < 4; j++) a[j] = act + (size_t)(t + (j < n ? j : n - 1)) * ab;
                float out[4][QX_TILE_MAX];
                if (unpack) px.dot(px_tile, a, nb, out);
                else        f(tile, a, n, nb, out);
                for (int j = 0; j < n; j++) memcpy(Y + (c0 + t + j) * ldy + r, out[j], KVR_TILE_ROWS * sizeof(float));
            }
        }
    }
    return done / T;
}
#endif

// Y[t][n] = sum_k W[n][k] X[t][k] for rows n0..n1 of W (K values a row, row_bytes apart) and all T
// tokens, with 8-bit activations. Row by row for a few tokens; otherwise, per chunk of tokens:
// quantize them, then for each block of 32 rows interleave it once and let every 4 tokens meet
// every tile (8 or 16 rows) of the block. With chunks (tile kernels only), the rows n0..n1 go a chunk at a time
// to whichever thread asks next (struct mm_chunks), each chunk of tokens in turn: a thread the
// machine runs late computes fewer rows instead of keeping the others waiting at the node's
// barrier. Returns the rows this thread computed (on average over the tokens).
static int64_t qx_mul_mat(enum kvr_type type, const void * W, size_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                          const struct mm_chunks * chunks, const float * X, int64_t ldx, int64_t T, float * Y, int64_t ldy,
                          void * scratch, size_t scratch_bytes) {
    if (n1 <= n0) return 0;
    KVR_ASSERT(qx_scratch_bytes(type, K, T) <= scratch_bytes);
    struct qx_x8_fns f;
    if (!qx_uses_x8(type, T)) {
        KVR_ASSERT(chunks == NULL);
        // without 8-row kernels, a long prompt goes through in chunks of the scratch's tokens
        for (int64_t c0 = 0; c0 < T; c0 += QX_ROW_TOKENS) {
            const int64_t nt = T - c0 < QX_ROW_TOKENS ? T - c0 : QX_ROW_TOKENS;
            qx_mul_rows(type, W, row_bytes, K, n0, n1, NULL, X + c0 * ldx, ldx, nt, Y + c0 * ldy, ldy, scratch);
        }
        return n1 - n0;
    }
    qx_x8_get(type, &f);
    const int64_t nb = K / kvr_blck_size(type);
    const size_t ab = qx_act_bytes(type, K);
    uint8_t * act = scratch;
    uint8_t * wx = act + QX_MM_TOKENS * ab;
    // work item k: rows chunk k % per of token chunk k / per (one item a token chunk without chunks)
    const int64_t per = chunks ? (n1 - n0 + chunks->rows - 1) / chunks->rows : 1;
    const int64_t items = per * ((T + QX_MM_TOKENS - 1) / QX_MM_TOKENS);
    int64_t quantized = -1, done = 0;
    for (int64_t k = 0; k < items; k++) {
        if (chunks) {
            const int64_t next = atomic_fetch_add_explicit(chunks->next, 1, memory_order_relaxed);
            if (next >= items) break;
            k = next;
        }
        const int64_t c0 = k / per * QX_MM_TOKENS, nt = T - c0 < QX_MM_TOKENS ? T - c0 : QX_MM_TOKENS;
        const int64_t m0 = chunks ? n0 + k % per * chunks->rows : n0;
        const int64_t m1 = chunks && m0 + chunks->rows < n1 ? m0 + chunks->rows : n1;
        if (quantized != c0) {
            for (int64_t t = 0; t < nt; t++) qx_quantize(type, X + (c0 + t) * ldx, act + (size_t)t * ab, K);
#if QX_L512
            if (qx_is_legacy(type)) qx_x8_prepare(type, (struct qx_q8 *)act, nt * nb);
#endif
            quantized = c0;
        }
        done += (m1 - m0) * nt;
        for (int64_t r0 = m0; r0 < m1; r0 += QX_MM_ROWS) {
            const int64_t R = f.rows, groups = (m1 - r0 + R - 1) / R < QX_MM_ROWS / R ? (m1 - r0 + R - 1) / R : QX_MM_ROWS / R;
            for (int64_t gi = 0; gi < groups; gi++) {
                f.interleave(W, row_bytes, r0 + R * gi, m1, nb, wx + (size_t)(gi * nb) * f.tile_bytes);
            }
            for (int64_t t = 0; t < nt; t += 4) {
                const int n = nt - t >= 4 ? 4 : (int)(nt - t);
                const void * a[4];
                for (int j = 0; j < 4; j++) a[j] = act + (size_t)(t + (j < n ? j : n - 1)) * ab; // a short tile repeats its last token
                for (int64_t gi = 0; gi < groups; gi++) {
                    float out[4][QX_TILE_MAX];
                    f.dot(wx + (size_t)(gi * nb) * f.tile_bytes, a, nb, out);
                    const int64_t r = r0 + R * gi, rows = m1 - r < R ? m1 - r : R;
                    for (int j = 0; j < n; j++) memcpy(Y + (c0 + t + j) * ldy + r, out[j], (size_t)rows * sizeof(float));
                }
            }
        }
    }
    return done / T;
}


// Bytes of weight rows converted to f32 per sgemm call. A prefill converts a thread's whole
// share at once (up to 32 MiB): every sgemm call packs all of the activations again, so few big
// calls beat many small ones. Decode (a few rows) converts 1 MiB at a time, which stays in cache
// between the conversion and the product.
#define MM_BLOCK_BYTES_PREFILL ((size_t)32 << 20)
#define MM_BLOCK_BYTES_DECODE  ((size_t)1 << 20)
#define MM_PREFILL_ROWS 32

// F32 matrices of at most this many weights (1 MiB) are multiplied by one dot product per output
// instead of sgemm. For such small products sgemm's packing is a large share of the work anyway,
// and the dots sum in GGML's order (dot_f32_ggml), so small models (the outside references in
// ../shared/reference among them, made by llama.cpp's CPU backend) agree with llama.cpp to the
// last bits instead of to ~1e-6: which matters where an fp16 rounding (GELU's table) turns a
// last-bit difference into a whole fp16 step.
#define MM_DOT_MAX_WEIGHTS ((int64_t)1 << 18)

// ggml_vec_dot_f32's AVX2 reduction of its four 8-lane sums (0+2, 1+3, then the two, the 128-bit
// halves, two horizontal adds), and the same of its 32 sums kept as floats
#if defined(__AVX2__) && defined(__FMA__)
static inline float dot_ggml_reduce(__m256 s0, __m256 s1, __m256 s2, __m256 s3) {
    s0 = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#else
static inline float dot_ggml_reduce32(const float acc[32]) {
    float l[8];
    for (int j = 0; j < 8; j++) l[j] = (acc[j] + acc[16 + j]) + (acc[8 + j] + acc[24 + j]);
    const float h0 = l[0] + l[4], h1 = l[1] + l[5], h2 = l[2] + l[6], h3 = l[3] + l[7];
    return (h0 + h1) + (h2 + h3);
}
#endif

// x.y summed as ggml_vec_dot_f32 sums on AVX2: four 8-lane FMA accumulators over blocks of 32,
// added pairwise (0+2, 1+3, then the two), the 128-bit halves added, two horizontal adds, then the
// tail (n mod 32) one product at a time in float.
static float dot_f32_ggml(const float * x, const float * y, int64_t n) {
    const int64_t np = n & ~(int64_t)31;
    float sum;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < np; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i),      _mm256_loadu_ps(y + i),      s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8),  _mm256_loadu_ps(y + i + 8),  s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), s3);
    }
    sum = dot_ggml_reduce(s0, s1, s2, s3);
#else
    float acc[32] = { 0 };
    for (int64_t i = 0; i < np; i += 32) {
        for (int j = 0; j < 32; j++) acc[j] = fmaf(x[i + j], y[i + j], acc[j]);
    }
    sum = dot_ggml_reduce32(acc);
#endif
    for (int64_t i = np; i < n; i++) sum += x[i] * y[i];
    return sum;
}

// dot_f32_ggml(x, the f32 values of the F16 row y, n), bit for bit: the row widened in registers
// (an F16 cache's key row in the exact attention, without a converted copy).
static float dot_f32_f16_ggml(const float * x, const uint16_t * y, int64_t n) {
    const int64_t np = n & ~(int64_t)31;
    float sum;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVR_H8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < np; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i),      KVR_H8(y + i),      s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8),  KVR_H8(y + i + 8),  s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), KVR_H8(y + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), KVR_H8(y + i + 24), s3);
    }
#undef KVR_H8
    sum = dot_ggml_reduce(s0, s1, s2, s3);
#else
    float acc[32] = { 0 };
    for (int64_t i = 0; i < np; i += 32) {
        for (int j = 0; j < 32; j++) acc[j] = fmaf(x[i + j], kvr_half_to_f32(y[i + j]), acc[j]);
    }
    sum = dot_ggml_reduce32(acc);
#endif
    for (int64_t i = np; i < n; i++) sum += x[i] * kvr_half_to_f32(y[i]);
    return sum;
}

// Matrix-vector products for decode (a few tokens): each weight row is read once, in its stored
// form; a block is widened to f32 in registers and multiplied with the f32 activations, so there is
// no dequantize pass over memory and no sgemm packing of one row. The products stay exact (f32
// activations times the weights' exact values, f32 sums): no activation is rounded to 8 bits. A
// block's scale multiplies its sum of products (d * sum(q x)), and a block's offset (the min of
// Q4_1, Q5_1, Q2_K, Q4_K, Q5_K, or the -8/-32 of Q4_0/Q6_K) multiplies the sum of the activations
// under it, which every row shares and the token computes once (mv_act): the same value as
// dequantize-then-dot in exact arithmetic, rounded in another order (within ~1e-7 relative).
//
// One token costs a few operations per weight, so the kernels are written to the operation:
//   - One row at a time, read front to back: one sequential stream, which the hardware prefetchers
//     follow best. Four rows side by side (each load of x serving four rows) were 15% faster in
//     cache but 35-45% slower from memory, where decode reads its weights, and software prefetch
//     did not win that back. A row keeps two or more FMA chains (one would wait on their latency).
//   - The 4-bit and 6-bit types take their quants without shuffles: a 32-bit lane of packed quants
//     holds 8 nibbles (or 4 bytes), and nibble k is masked in place, (lane & 0xf << 4k). The token's
//     activations are stored once in that lane order (mv_act.xp), scaled by a power of two per k
//     (exact), so a row costs one and and one FMA per 8 weights, plus one shift per lane.
//   - What the masked lane is read as: on CPUs whose FMAs take subnormal operands at full speed
//     (probed once, mv_den_fast: AMD Zen does; other cores may take a microcode assist each time)
//     the bits are used as they are, as the subnormal float q 2^(4k-149), with no conversion at
//     all; elsewhere they are converted (cvtdq2ps, q 16^k). Either way the FMA multiplies the
//     quant's exact value by an exact power-of-two multiple of x. In the first form the token's x
//     is brought below 1 by 2^-e (e the exponent of its largest |x|) and scaled up by 2^126 before
//     the products, so every product q x 2^(-23-e) and every sum of them is a normal float, and
//     the row's sum is scaled back at the end (mv_act.unscale); only activations 2^103 times
//     smaller than the token's largest lose bits, far below the sum's rounding.
//   - Offsets and mins ride along as the first term of a block's chain (mv_act.xo), so they cost
//     no extra instruction.

#define MV_MAX_TOKENS 4   // up to this many tokens a matmul goes row by row (the row stays in L1)
#define MV_BATCH_TOKENS 8 // KVR_MM_ROWS (a decode batch): this many tokens a pass over the rows

struct mv_act {
    const float * x;    // K activations
    const float * s16;  // the sum of each 16 of them
    const float * s32;  // the sum of each 32
    const float * xp;   // Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K: x in the order of the lanes' quants, scaled (mv_act_init)
    const float * xo;   // Q4_0, Q4_1, Q5_0, Q5_1, Q6_K: the sums of x under each lane's quants, scaled as xp
    float unscale;      // what those kernels' sums are multiplied by at the end
    bool  den;          // quants read as subnormal floats (see above), not converted
};

// Floats of scratch one token's mv_act takes for K values.
static size_t mv_act_floats(int64_t K) {
    return (size_t)(K / 16 + K / 32 + (K + 32) + (K / 4 + 8) + 64);
}

typedef float (*mv_row_fn)(const void * row, const struct mv_act * a, int64_t K);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// Whether FMAs with subnormal operands run as fast as with normal ones here: the same 4096 FMAs
// timed both ways, best of 5 (an assist costs ~100x, so the answer is never close).
static bool mv_den_ok;
static pthread_once_t mv_den_once = PTHREAD_ONCE_INIT;

static void mv_den_probe(void) {
    static volatile int32_t bits[2] = { 5, 0x40a00000 }; // 5 * 2^-149 (subnormal) and 5.0f
    double best[2] = { 1e30, 1e30 };
    for (int trial = 0; trial < 5; trial++) {
        for (int m = 0; m < 2; m++) {
            const __m256 q = _mm256_castsi256_ps(_mm256_set1_epi32(bits[m])), x = _mm256_set1_ps(0x1p100f);
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            const double t0 = kvr_time_ms();
            for (int i = 0; i < 128; i++) {
                s0 = _mm256_fmadd_ps(q, x, s0);
                s1 = _mm256_fmadd_ps(q, x, s1);
                s2 = _mm256_fmadd_ps(q, x, s2);
                s3 = _mm256_fmadd_ps(q, x, s3);
            }
            const double t = kvr_time_ms() - t0;
            float out[8];
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
            bits[1] = out[0] > 0.0f ? 0x40a00000 : 0x40a00001; // keeps the sums alive; stays 5.0f
            if (t < best[m]) best[m] = t;
        }
    }
    mv_den_ok = best[0] < 2.0 * best[1] + 1e-4;
}

static bool mv_den_fast(void) {
    pthread_once(&mv_den_once, mv_den_probe);
    return mv_den_ok;
}

static inline float mv_hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline float mv_half(const uint8_t * p) {
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
}

// [h0 x4, h1 x4] from the fp16 at p0 and p1 (p1 NULL: 0)
static inline __m256 mv_half_pair(const uint8_t * p0, const uint8_t * p1) {
    const uint32_t h = (uint32_t)(p0[0] | p0[1] << 8) | (p1 ? (uint32_t)(p1[0] | p1[1] << 8) << 16 : 0u);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Nibble k of each 32-bit lane of v as a float, in mv_act's scale. den: the caller has shifted v
// down by 16 for k >= 4 (a nibble at bit 20 or above would reach the exponent).
static inline __m256 mv_nib(__m256i v, int k, const bool den) {
    if (den) return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf << (4 * (k & 3)))));
    return _mm256_cvtepi32_ps(k == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(0xf << (4 * k))));
}

// Byte j of each 32-bit lane of v as a float, in mv_act's scale (den: v shifted down by 16 for j >= 2).
static inline __m256 mv_byte(__m256i v, int j, const bool den) {
    if (den) return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xff << (8 * (j & 1)))));
    return _mm256_cvtepi32_ps(j == 3 ? _mm256_srli_epi32(v, 24) : _mm256_and_si256(v, _mm256_set1_epi32(0xff << (8 * j))));
}

// t[j] for j = 0..3: lane i < 4 is lo[4i + j], lane 4 + i is hi[4i + j] (hi NULL: 0). The order of
// the activations under the lanes' quants: a 4x4 transpose in each 128-bit half.
static inline void mv_gather4(const float * lo, const float * hi, __m256 t[4]) {
    __m256 r[4];
    for (int i = 0; i < 4; i++) {
        const __m128 l = _mm_loadu_ps(lo + 4 * i);
        r[i] = hi ? _mm256_insertf128_ps(_mm256_castps128_ps256(l), _mm_loadu_ps(hi + 4 * i), 1) : _mm256_setr_m128(l, _mm_setzero_ps());
    }
    const __m256 a = _mm256_unpacklo_ps(r[0], r[1]), b = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 c = _mm256_unpacklo_ps(r[2], r[3]), d = _mm256_unpackhi_ps(r[2], r[3]);
    t[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(c)));
    t[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(c)));
    t[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b), _mm256_castps_pd(d)));
    t[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b), _mm256_castps_pd(d)));
}

// The scales of the lane orders: what nibble k's (bytes: byte j's) activations are multiplied by,
// pre then sc[k] (two exact steps: one power of two could be out of range), and what the sums are
// multiplied by at the end.
static void mv_scales(const float * x, int64_t K, bool den, bool bytes, float * pre, float sc[8], float * unscale) {
    if (!den) {
        // converted: nibble k is q 16^k (the top one shifted down: q), byte j is q 2^8j (j = 3: q)
        for (int k = 0; k < 8; k++) sc[k] = bytes ? (k >= 3 ? 1.0f : ldexpf(1.0f, -8 * k)) : (k == 7 ? 1.0f : ldexpf(1.0f, -4 * k));
        *pre = *unscale = 1.0f;
        return;
    }
    // subnormal: nibble k is q 2^(4 (k & 3) - 149), byte j is q 2^(8 (j & 1) - 149)
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    for (; i < K; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    int e = 0;
    if (amax > 0.0f && amax <= FLT_MAX) frexpf(amax, &e); // amax < 2^e
    e = e > 104 ? 104 : e < -126 ? -126 : e;
    *pre = ldexpf(1.0f, -e);
    for (int k = 0; k < 8; k++) sc[k] = ldexpf(1.0f, 126 - (bytes ? 8 * (k & 1) : 4 * (k & 3)));
    *unscale = ldexpf(1.0f, 23 + e);
}

static void mv_act_init(struct mv_act * a, enum kvr_type type, const float * x, int64_t K, float * scratch, bool den) {
    float * s16 = scratch, * s32 = scratch + K / 16, * xp = s32 + K / 32, * xo = xp + K + 32;
    for (int64_t i = 0; i < K / 16; i++) s16[i] = mv_hsum(_mm256_add_ps(_mm256_loadu_ps(x + 16 * i), _mm256_loadu_ps(x + 16 * i + 8)));
    for (int64_t i = 0; i < K / 32; i++) s32[i] = s16[2 * i] + s16[2 * i + 1];
    *a = (struct mv_act) { x, s16, s32, NULL, NULL, 1.0f, den };
    const bool q4 = type == KVR_TYPE_Q4_0 || type == KVR_TYPE_Q4_1;
    const bool q5 = type == KVR_TYPE_Q5_0 || type == KVR_TYPE_Q5_1;
    if (!q4 && !q5 && type != KVR_TYPE_Q4_K && type != KVR_TYPE_Q6_K) return;
    float pre, sc[8];
    mv_scales(x, K, den, type == KVR_TYPE_Q6_K || q5, &pre, sc, &a->unscale);
    const __m256 vpre = _mm256_set1_ps(pre);
    const float so = 1.0f / a->unscale; // a power of two: exact
    __m256 t[4];
    if (q4) {
        // two blocks a step: lanes 0-3 hold block 2p's quant bytes 4i..4i+3, lanes 4-7 block 2p+1's;
        // nibble k of byte j is element j + 16 (k odd) of its block; xo: each block's sum / 4 in its lanes
        const int64_t nb = K / KVR_QK;
        for (int64_t p = 0; 2 * p < nb; p++) {
            const bool two = 2 * p + 1 < nb;
            for (int h = 0; h < 2; h++) {
                mv_gather4(x + 64 * p + 16 * h, two ? x + 64 * p + 32 + 16 * h : NULL, t);
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(xp + 64 * p + 8 * (2 * j + h), _mm256_mul_ps(_mm256_mul_ps(t[j], vpre), _mm256_set1_ps(sc[2 * j + h])));
            }
            _mm256_storeu_ps(xo + 8 * p, _mm256_setr_m128(_mm_set1_ps(s32[2 * p] * 0.25f * so), _mm_set1_ps(two ? s32[2 * p + 1] * 0.25f * so : 0.0f)));
        }
        a->xo = xo;
    } else if (type == KVR_TYPE_Q4_K) {
        // 32 quant bytes a step (64 values): nibble k of lane i is element 32 (k & 1) + 4i + k/2
        for (int64_t c = 0; c < K / 64; c++) {
            for (int h = 0; h < 2; h++) {
                mv_gather4(x + 64 * c + 32 * h, x + 64 * c + 32 * h + 16, t);
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(xp + 64 * c + 8 * (2 * j + h), _mm256_mul_ps(_mm256_mul_ps(t[j], vpre), _mm256_set1_ps(sc[2 * j + h])));
            }
        }
    } else {
        // Q6_K, Q5_0, Q5_1: 32 bytes of quants a step: byte j of lane i is element 4i + j. Q6_K: lanes
        // 0-3 are the first 16 elements (one scale), 4-7 the next; xo: their sums times -32/4 (the
        // offset). Q5: one block; xo: its sum / 8 in every lane (times -16 or the min, in the kernel)
        for (int64_t m = 0; m < K / 32; m++) {
            mv_gather4(x + 32 * m, x + 32 * m + 16, t);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(xp + 32 * m + 8 * j, _mm256_mul_ps(_mm256_mul_ps(t[j], vpre), _mm256_set1_ps(sc[j])));
            _mm256_storeu_ps(xo + 8 * m, q5 ? _mm256_set1_ps(s32[m] * 0.125f * so)
                                            : _mm256_setr_m128(_mm_set1_ps(-8.0f * s16[2 * m] * so), _mm_set1_ps(-8.0f * s16[2 * m + 1] * so)));
        }
        a->xo = xo;
    }
    a->xp = xp;
}

// 8 int8 (the low 8 bytes of v) as 8 floats
static inline __m256 mv_i8x8(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// The products of 32 int8 quants (q, in element order) with x[0..31], summed to 8 lanes as two
// independent chains: the 16 products of the low half in a, of the high half in b.
static inline void mv_dot16x2(__m256i q, const float * x, __m256 * a, __m256 * b) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    *a = _mm256_fmadd_ps(mv_i8x8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8),
                         _mm256_mul_ps(mv_i8x8(lo), _mm256_loadu_ps(x)));
    *b = _mm256_fmadd_ps(mv_i8x8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24),
                         _mm256_mul_ps(mv_i8x8(hi), _mm256_loadu_ps(x + 16)));
}

static inline __m256 mv_dot32(__m256i q, const float * x) {
    __m256 a, b;
    mv_dot16x2(q, x, &a, &b);
    return _mm256_add_ps(a, b);
}

// The 16 bytes of a legacy block's nibbles as its 32 quants in element order (low nibbles are
// elements 0..15, high nibbles 16..31).
static inline __m256i mv_nibbles32(const uint8_t * qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

// Byte j of the result: 0x10 if bit j of bits is set (the 5th bit of Q5_0/Q5_1 element j).
static inline __m256i mv_bit4_32(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

// A kernel in two copies, den a constant in each (the quants read as subnormal floats, or converted).
#define MV_ROW_DEN(name, kernel) \
    static float mv_row_##name(const void * row, const struct mv_act * a, int64_t K) { \
        return a->den ? kernel(row, a, K, true) : kernel(row, a, K, false); \
    }
// The _0 and _1 types of a legacy pair (Q4, Q5) from one kernel mv_<base>(row, a, K, min, den):
// min, the _1 types' block minimum, a constant in each
#define MV_ROW_PAIR(base) \
    static float mv_row_##base##_0(const void * row, const struct mv_act * a, int64_t K) { \
        return a->den ? mv_##base(row, a, K, false, true) : mv_##base(row, a, K, false, false); \
    } \
    static float mv_row_##base##_1(const void * row, const struct mv_act * a, int64_t K) { \
        return a->den ? mv_##base(row, a, K, true, true) : mv_##base(row, a, K, true, false); \
    }

// One step of Q4_0 / Q4_1 (min): the pair of blocks i, i + 1 (two false: block i alone). Two
// chains (even and odd nibbles): one chain of 8 FMAs would wait on their latency.
static inline __attribute__((always_inline)) __m256 mv_q4_step(const uint8_t * row, const struct mv_act * a, int64_t i,
                                                                const bool two, const bool min, const bool den, __m256 acc) {
    const size_t bs = min ? sizeof(struct kvr_block_q4_1) : sizeof(struct kvr_block_q4_0);
    const uint8_t * b = row + (size_t)i * bs, * q = b + (min ? 4 : 2);
    const float * xp = a->xp + 32 * i;
    const __m256 xo = _mm256_loadu_ps(a->xo + 4 * i);
    const __m128i lo = _mm_loadu_si128((const __m128i *)q);
    __m256i v = two ? _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128((const __m128i *)(q + bs)), 1)
                    : _mm256_zextsi128_si256(lo);
    __m256 s[2] = { min ? _mm256_setzero_ps() : _mm256_mul_ps(xo, _mm256_set1_ps(-8.0f)), _mm256_setzero_ps() }; // Q4_0: q - 8
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        if (den && k == 4) v = _mm256_srli_epi32(v, 16);
        s[k & 1] = _mm256_fmadd_ps(mv_nib(v, k, den), _mm256_loadu_ps(xp + 8 * k), s[k & 1]);
    }
    acc = _mm256_fmadd_ps(_mm256_add_ps(s[0], s[1]), mv_half_pair(b, two ? b + bs : NULL), acc);
    return min ? _mm256_fmadd_ps(mv_half_pair(b + 2, two ? b + bs + 2 : NULL), xo, acc) : acc;
}

static inline __attribute__((always_inline)) float mv_q4(const uint8_t * row, const struct mv_act * a, int64_t K, const bool min, const bool den) {
    const int64_t nb = K / KVR_QK;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < nb; i += 2) acc = mv_q4_step(row, a, i, true, min, den, acc);
    if (i < nb) acc = mv_q4_step(row, a, i, false, min, den, acc);
    return mv_hsum(acc) * a->unscale;
}

MV_ROW_PAIR(q4)

// mv_q4 of one row for T <= MV_BATCH_TOKENS tokens at once (a decode batch): the row's nibbles and
// scales are unpacked once and used by every token, and each token's sums are made by the same
// operations in the same order as mv_q4_step's (the same bits as T calls of mv_q4), so batching
// saves the unpacking, not the arithmetic a token's result is made of.
static inline __attribute__((always_inline)) void mv_q4_tokens(const uint8_t * row, const struct mv_act * a, int64_t T, int64_t K,
                                                                const bool min, const bool den, float * y, int64_t ldy) {
    const size_t bs = min ? sizeof(struct kvr_block_q4_1) : sizeof(struct kvr_block_q4_0);
    const int64_t nb = K / KVR_QK;
    __m256 acc[MV_BATCH_TOKENS];
    const float * xps[MV_BATCH_TOKENS], * xos[MV_BATCH_TOKENS];
    for (int64_t t = 0; t < T; t++) {
        acc[t] = _mm256_setzero_ps();
        xps[t] = a[t].xp;
        xos[t] = a[t].xo;
    }
    for (int64_t i = 0; i < nb; i += 2) {
        const bool two = i + 1 < nb;
        const uint8_t * b = row + (size_t)i * bs, * q = b + (min ? 4 : 2);
        const __m128i lo = _mm_loadu_si128((const __m128i *)q);
        __m256i v = two ? _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128((const __m128i *)(q + bs)), 1)
                        : _mm256_zextsi128_si256(lo);
        __m256 nib[8];
        for (int k = 0; k < 8; k++) {
            if (den && k == 4) v = _mm256_srli_epi32(v, 16);
            nib[k] = mv_nib(v, k, den);
        }
        const __m256 d = mv_half_pair(b, two ? b + bs : NULL);
        const __m256 m = min ? mv_half_pair(b + 2, two ? b + bs + 2 : NULL) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int64_t t = 0; t < T; t++) {
            const float * xp = xps[t] + 32 * i;
            const __m256 xo = _mm256_loadu_ps(xos[t] + 4 * i);
            __m256 s2[2] = { min ? _mm256_setzero_ps() : _mm256_mul_ps(xo, _mm256_set1_ps(-8.0f)), _mm256_setzero_ps() };
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) s2[k & 1] = _mm256_fmadd_ps(nib[k], _mm256_loadu_ps(xp + 8 * k), s2[k & 1]);
            acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s2[0], s2[1]), d, acc[t]);
            if (min) acc[t] = _mm256_fmadd_ps(m, xo, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) y[t * ldy] = mv_hsum(acc[t]) * a[t].unscale;
}

// A row for several tokens at once (mv_mul with T > 1), for the types that have such a kernel.
// The token count is made a constant of each copy, so the accumulators stay in registers.
typedef void (* mv_tokens_fn)(const void * row, const struct mv_act * a, int64_t T, int64_t K, float * y, int64_t ldy);
#define MV_TOKENS_T(f, T, ...) \
    switch (T) { \
        case 2: f(2, __VA_ARGS__); break; case 3: f(3, __VA_ARGS__); break; case 4: f(4, __VA_ARGS__); break; \
        case 5: f(5, __VA_ARGS__); break; case 6: f(6, __VA_ARGS__); break; case 7: f(7, __VA_ARGS__); break; \
        default: KVR_ASSERT(T == 8); f(8, __VA_ARGS__); break; \
    }
#define MV_Q4_CALL(T, row, a, K, min, den, y, ldy) mv_q4_tokens(row, a, T, K, min, den, y, ldy)
#define MV_TOKENS(name, min) \
    static void mv_tokens_##name(const void * row, const struct mv_act * a, int64_t T, int64_t K, float * y, int64_t ldy) { \
        if (a->den) { MV_TOKENS_T(MV_Q4_CALL, T, row, a, K, min, true, y, ldy) } \
        else        { MV_TOKENS_T(MV_Q4_CALL, T, row, a, K, min, false, y, ldy) } \
    }
MV_TOKENS(q4_0, false)
MV_TOKENS(q4_1, true)
#undef MV_TOKENS
#undef MV_Q4_CALL

// mv_q8_blocks for several tokens: each block's bytes converted once, each token's sums as there.
static inline __attribute__((always_inline)) void mv_q8_tokens(const uint8_t * b, size_t bs, size_t qo, const struct mv_act * a,
                                                                int64_t T, int64_t nb, float * y, int64_t ldy) {
    __m256 acc[MV_BATCH_TOKENS][2];
    const float * xs[MV_BATCH_TOKENS];
    for (int64_t t = 0; t < T; t++) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        xs[t] = a[t].x;
    }
    for (int64_t i = 0; i < nb; i++, b += bs) {
        __m256 w[4];
        for (int j = 0; j < 4; j++) w[j] = mv_i8x8(_mm_loadl_epi64((const __m128i *)(b + qo + 8 * j)));
        const __m256 d = _mm256_set1_ps(mv_half(b));
#pragma GCC unroll 8
        for (int64_t t = 0; t < T; t++) {
            const float * x = xs[t] + i * KVR_QK;
            __m256 s2 = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
            for (int j = 1; j < 4; j++) s2 = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), s2);
            acc[t][i & 1] = _mm256_fmadd_ps(s2, d, acc[t][i & 1]);
        }
    }
    for (int64_t t = 0; t < T; t++) y[t * ldy] = mv_hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

// Q5_0 (x = d (q - 16)) and Q5_1 (min: x = d q + m): a block's 32 quants built as bytes in element
// order (nibbles, and the 5th bit from qh), then read as Q6_K reads its bytes (mv_byte, lanes in
// mv_act's byte order): no widening of int8 to floats, which the shuffle port could not keep up with.
// The -16 rides as the chain's start, the min in a second accumulator; blocks alternate two chains.
static inline __attribute__((always_inline)) float mv_q5(const uint8_t * row, const struct mv_act * a, int64_t K, const bool min,
                                                          const bool den) {
    const size_t bs = min ? sizeof(struct kvr_block_q5_1) : sizeof(struct kvr_block_q5_0);
    const size_t qo = min ? offsetof(struct kvr_block_q5_1, qs) : offsetof(struct kvr_block_q5_0, qs);
    const size_t ho = min ? offsetof(struct kvr_block_q5_1, qh) : offsetof(struct kvr_block_q5_0, qh);
    __m256 acc[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() }, macc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / KVR_QK; i++) {
        const uint8_t * b = row + (size_t)i * bs;
        __m256i q = _mm256_or_si256(mv_nibbles32(b + qo), mv_bit4_32(kvr_q_u32le(b + ho)));
        const __m256 xo = _mm256_loadu_ps(a->xo + 8 * i);
        const float * xp = a->xp + 32 * i;
        __m256 s = min ? _mm256_setzero_ps() : _mm256_mul_ps(xo, _mm256_set1_ps(-16.0f));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            if (den && j == 2) q = _mm256_srli_epi32(q, 16);
            s = _mm256_fmadd_ps(mv_byte(q, j, den), _mm256_loadu_ps(xp + 8 * j), s);
        }
        acc[i & 1] = _mm256_fmadd_ps(s, _mm256_set1_ps(mv_half(b)), acc[i & 1]);
        if (min) macc = _mm256_fmadd_ps(xo, _mm256_set1_ps(mv_half(b + 2)), macc);
    }
    return mv_hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), macc)) * a->unscale;
}

MV_ROW_PAIR(q5)

// Q8_0 and Q8_1 differ only in Q8_1's extra sum, which a product with f32 activations does not
// need: both are (d, 32 quants) blocks, bs bytes apart, the quants at qo. Sign-extended and
// converted (a signed byte has no subnormal form); two blocks a step, one chain each.
static float mv_q8_blocks(const uint8_t * b, size_t bs, size_t qo, const float * x, int64_t nb) {
    __m256 acc[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
    for (int64_t i = 0; i < nb; i++, b += bs, x += KVR_QK) {
        __m256 s = _mm256_mul_ps(mv_i8x8(_mm_loadl_epi64((const __m128i *)(b + qo))), _mm256_loadu_ps(x));
#pragma GCC unroll 4
        for (int j = 1; j < 4; j++) s = _mm256_fmadd_ps(mv_i8x8(_mm_loadl_epi64((const __m128i *)(b + qo + 8 * j))), _mm256_loadu_ps(x + 8 * j), s);
        acc[i & 1] = _mm256_fmadd_ps(s, _mm256_set1_ps(mv_half(b)), acc[i & 1]); // d: each block's first field
    }
    return mv_hsum(_mm256_add_ps(acc[0], acc[1]));
}

static float mv_row_q8_0(const void * row, const struct mv_act * a, int64_t K) {
    return mv_q8_blocks(row, sizeof(struct kvr_block_q8_0), offsetof(struct kvr_block_q8_0, qs), a->x, K / KVR_QK);
}

#define MV_Q8_CALL(T, row, a, K, y, ldy) \
    mv_q8_tokens(row, sizeof(struct kvr_block_q8_0), offsetof(struct kvr_block_q8_0, qs), a, T, (K) / KVR_QK, y, ldy)
static void mv_tokens_q8_0(const void * row, const struct mv_act * a, int64_t T, int64_t K, float * y, int64_t ldy) {
    MV_TOKENS_T(MV_Q8_CALL, T, row, a, K, y, ldy)
}
#undef MV_Q8_CALL
#undef MV_TOKENS_T

static mv_tokens_fn mv_tokens_kernel(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_Q4_0: return mv_tokens_q4_0;
        case KVR_TYPE_Q4_1: return mv_tokens_q4_1;
        case KVR_TYPE_Q8_0: return mv_tokens_q8_0;
        default:            return NULL;
    }
}

static float mv_row_q8_1(const void * row, const struct mv_act * a, int64_t K) {
    return mv_q8_blocks(row, sizeof(struct kvr_block_q8_1), offsetof(struct kvr_block_q8_1, qs), a->x, K / KVR_QK);
}

static float mv_row_q8_K(const void * row, const struct mv_act * a, int64_t K) {
    const struct kvr_block_q8_K * b = row;
    const float * x = a->x;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        float d;
        memcpy(&d, b[i].d, sizeof d);
        __m256 p = _mm256_setzero_ps();
        for (int j = 0; j < KVR_QK_K / 32; j++, x += 32) {
            p = _mm256_add_ps(p, mv_dot32(_mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * j)), x));
        }
        acc = _mm256_fmadd_ps(p, _mm256_set1_ps(d), acc);
    }
    return mv_hsum(acc);
}

// Q2_K: element 128h + 32k + l is bits 2k..2k+1 of qs[32h + l]; run r = e/16 has scale
// d * (scales[r] & 15) and min dmin * (scales[r] >> 4).
static float mv_row_q2_K(const void * row, const struct mv_act * a, int64_t K) {
    const struct kvr_block_q2_K * b = row;
    const __m256i m2 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        const float d = mv_half(b[i].d), dmin = mv_half(b[i].dmin);
        const float * x = a->x + KVR_QK_K * i;
        const float * s16 = a->s16 + 16 * i;
        float m = 0.0f;
        for (int r = 0; r < 16; r++) m += (float)(b[i].scales[r] >> 4) * s16[r];
        mins += dmin * m;
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * h));
            #pragma GCC unroll 8
            for (int k = 0; k < 4; k++) {
                const int r = 8 * h + 2 * k;
                const __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * k)), m2);
                __m256 pa, pb;
                mv_dot16x2(q, x + 128 * h + 32 * k, &pa, &pb);
                acc = _mm256_fmadd_ps(pa, _mm256_set1_ps(d * (float)(b[i].scales[r] & 0x0f)), acc);
                acc = _mm256_fmadd_ps(pb, _mm256_set1_ps(d * (float)(b[i].scales[r + 1] & 0x0f)), acc);
            }
        }
    }
    return mv_hsum(acc) - mins;
}

// Q3_K: as Q2_K's planes, plus the 3rd bit (bit 4h + k of hmask[l]); quants are q - 4.
static float mv_row_q3_K(const void * row, const struct mv_act * a, int64_t K) {
    const struct kvr_block_q3_K * b = row;
    const __m256i m2 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        const float d = mv_half(b[i].d);
        int sc[16];
        kvr_q3_scales(b[i].scales, sc);
        const float * x = a->x + KVR_QK_K * i;
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b[i].hmask);
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * h));
            #pragma GCC unroll 8
            for (int k = 0; k < 4; k++) {
                const int r = 8 * h + 2 * k;
                const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + k)));
                const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four);
                const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * k)), m2);
                __m256 pa, pb;
                mv_dot16x2(_mm256_sub_epi8(_mm256_or_si256(lo, hi), four), x + 128 * h + 32 * k, &pa, &pb);
                acc = _mm256_fmadd_ps(pa, _mm256_set1_ps(d * (float)(sc[r] - 32)), acc);
                acc = _mm256_fmadd_ps(pb, _mm256_set1_ps(d * (float)(sc[r + 1] - 32)), acc);
            }
        }
    }
    return mv_hsum(acc);
}

// Q4_K's 8 scales and 8 mins as bytes: sc in the low 8 bytes, mins in the high 8 (the 12-byte
// layout of kvr_k4_scales, four at a time).
static inline __m128i mv_k4_scales(const uint8_t * s) {
    const uint32_t w0 = kvr_q_u32le(s), w1 = kvr_q_u32le(s + 4), w2 = kvr_q_u32le(s + 8);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi);
}

// Q4_K: x = d sc_j q - dmin m_j per sub-block j of 32; quant bytes 32c..32c+31 hold sub-block 2c
// in the low nibbles and 2c+1 in the high ones: the even and odd nibbles of a lane, two chains.
static inline __attribute__((always_inline)) float mv_q4_K(const void * row, const struct mv_act * a, int64_t K, const bool den) {
    const struct kvr_block_q4_K * b = row;
    __m256 acc = _mm256_setzero_ps();
    const __m256 us = _mm256_set1_ps(1.0f / a->unscale);
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        const __m128i sm = mv_k4_scales(b[i].scales);
        const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(mv_half(b[i].d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        acc = _mm256_fnmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(mv_half(b[i].dmin))), _mm256_mul_ps(_mm256_loadu_ps(a->s32 + 8 * i), us), acc);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const float * xp = a->xp + KVR_QK_K * i + 64 * c;
            __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * c));
            __m256 s[2];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                if (den && k == 4) v = _mm256_srli_epi32(v, 16);
                // the chains start with an FMA on 0, not a multiply: multiplies take subnormal operands slowly here
                s[k & 1] = _mm256_fmadd_ps(mv_nib(v, k, den), _mm256_loadu_ps(xp + 8 * k), k < 2 ? _mm256_setzero_ps() : s[k & 1]);
            }
            acc = _mm256_fmadd_ps(s[0], _mm256_permutevar8x32_ps(dsc, _mm256_set1_epi32(2 * c)), acc);
            acc = _mm256_fmadd_ps(s[1], _mm256_permutevar8x32_ps(dsc, _mm256_set1_epi32(2 * c + 1)), acc);
        }
    }
    return mv_hsum(acc) * a->unscale;
}

MV_ROW_DEN(q4_K, mv_q4_K)

// Q5_K: Q4_K plus the 5th bit of sub-block j's element l in bit j of qh[l].
static float mv_row_q5_K(const void * row, const struct mv_act * a, int64_t K) {
    const struct kvr_block_q5_K * b = row;
    const __m256i m4 = _mm256_set1_epi8(0x0f), b4 = _mm256_set1_epi8(0x10);
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        int sc[8], mn[8];
        kvr_k4_scales(b[i].scales, sc, mn);
        const float d = mv_half(b[i].d), dmin = mv_half(b[i].dmin);
        const float * x = a->x + KVR_QK_K * i;
        const float * s32 = a->s32 + 8 * i;
        float m = 0.0f;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) m += (float)mn[j] * s32[j];
        mins += dmin * m;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)b[i].qh);
        #pragma GCC unroll 8
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * c));
            const __m256i s0 = _mm256_set1_epi8((char)(1 << (2 * c))), s1 = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
            const __m256i h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, s0), s0), b4);
            const __m256i h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, s1), s1), b4);
            const __m256 p0 = mv_dot32(_mm256_or_si256(_mm256_and_si256(v, m4), h0), x + 64 * c);
            const __m256 p1 = mv_dot32(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1), x + 64 * c + 32);
            acc = _mm256_fmadd_ps(p0, _mm256_set1_ps(d * (float)sc[2 * c]), acc);
            acc = _mm256_fmadd_ps(p1, _mm256_set1_ps(d * (float)sc[2 * c + 1]), acc);
        }
    }
    return mv_hsum(acc) - mins;
}

// Q6_K: per half h, quarter k of 32 elements: low 4 bits from ql (bytes 64h + 32(k&1), high
// nibble if k >= 2), high 2 bits from qh[32h + l] >> 2k; quants are q - 32 (the -32 rides in xo),
// scales per 16: lanes 0-3 of a quarter hold its first 16 elements, lanes 4-7 the next. Two
// quarters a step, one chain each.
static inline __attribute__((always_inline)) float mv_q6_K(const void * row, const struct mv_act * a, int64_t K, const bool den) {
    const struct kvr_block_q6_K * b = row;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3 << 4);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / KVR_QK_K; i++) {
        const __m256 d = _mm256_set1_ps(mv_half(b[i].d));
        const __m128i sc = _mm_loadu_si128((const __m128i *)b[i].scales);
        const __m256 dsc[2] = { _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))) };
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int64_t m = 8 * i + 4 * h + k; // the quarter's 32 elements
                const float * xp = a->xp + 32 * m;
                const __m256i l = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h + 32 * (k & 1)));
                const __m256i lo = _mm256_and_si256(k >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
                const __m256i hi = _mm256_and_si256(k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2)
                                                    : k == 2 ? qh : _mm256_srli_epi16(qh, 2), m2);
                __m256i q = _mm256_or_si256(lo, hi);
                __m256 s = _mm256_loadu_ps(a->xo + 8 * m);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    if (den && j == 2) q = _mm256_srli_epi32(q, 16);
                    s = _mm256_fmadd_ps(mv_byte(q, j, den), _mm256_loadu_ps(xp + 8 * j), s);
                }
                const __m256i idx = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1);
                acc = _mm256_fmadd_ps(s, _mm256_permutevar8x32_ps(dsc[h], idx), acc);
            }
        }
    }
    return mv_hsum(acc) * a->unscale;
}

MV_ROW_DEN(q6_K, mv_q6_K)

// F16 and BF16: four 8-lane FMA chains (chain j takes the elements 32i + 8j .. 32i + 8j + 7), 64
// elements a step with both of the step's two cache lines prefetched QX_PREFETCH bytes ahead. The
// prefetch is what makes these kernels read at the memory's speed: a step is ~10 instructions a
// cache line (against ~3 for a plain read), so the out-of-order window reaches far fewer lines
// ahead, and with the hardware prefetcher alone the read stayed 9-18% below a plain one (2 threads
// over 2 GB in tinyllama's matmul shapes, one program alternating the two: 32.4 against 35.7 GB/s,
// 34.9 against 42.6 when the memory was faster); with it, 95-96% of a plain read.
#define MV_16BIT_ROW(name, cvt8, scalar) \
    static float mv_row_##name(const void * row, const struct mv_act * a, int64_t K) { \
        const uint16_t * w = row; \
        const float * x = a->x; \
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0; \
        int64_t i = 0; \
        for (; i + 64 <= K; i += 64) { \
            _mm_prefetch((const char *)(w + i) + QX_PREFETCH, _MM_HINT_T0); \
            _mm_prefetch((const char *)(w + i) + QX_PREFETCH + 64, _MM_HINT_T0); \
            _Pragma("GCC unroll 2") \
            for (int h = 0; h < 64; h += 32) { \
                s0 = _mm256_fmadd_ps(cvt8(w + i + h),      _mm256_loadu_ps(x + i + h),      s0); \
                s1 = _mm256_fmadd_ps(cvt8(w + i + h + 8),  _mm256_loadu_ps(x + i + h + 8),  s1); \
                s2 = _mm256_fmadd_ps(cvt8(w + i + h + 16), _mm256_loadu_ps(x + i + h + 16), s2); \
                s3 = _mm256_fmadd_ps(cvt8(w + i + h + 24), _mm256_loadu_ps(x + i + h + 24), s3); \
            } \
        } \
        for (; i + 32 <= K; i += 32) { \
            s0 = _mm256_fmadd_ps(cvt8(w + i),      _mm256_loadu_ps(x + i),      s0); \
            s1 = _mm256_fmadd_ps(cvt8(w + i + 8),  _mm256_loadu_ps(x + i + 8),  s1); \
            s2 = _mm256_fmadd_ps(cvt8(w + i + 16), _mm256_loadu_ps(x + i + 16), s2); \
            s3 = _mm256_fmadd_ps(cvt8(w + i + 24), _mm256_loadu_ps(x + i + 24), s3); \
        } \
        float sum = mv_hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))); \
        for (; i < K; i++) sum += scalar(w[i]) * x[i]; \
        return sum; \
    }

static inline __m256 mv_f16x8(const uint16_t * w) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
}

static inline __m256 mv_bf16x8(const uint16_t * w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

MV_16BIT_ROW(f16, mv_f16x8, _cvtsh_ss)
MV_16BIT_ROW(bf16, mv_bf16x8, kvr_bf16_to_fp32)
#undef MV_16BIT_ROW

#else

static bool mv_den_fast(void) {
    return false;
}

static void mv_act_init(struct mv_act * a, enum kvr_type type, const float * x, int64_t K, float * scratch, bool den) {
    (void)type; (void)K; (void)scratch;
    *a = (struct mv_act) { x, NULL, NULL, NULL, NULL, 1.0f, den };
}

// Without AVX2: a block at a time converted to f32 on the stack (it stays in L1) and dotted; the
// row is still read once.
static float mv_row_blocks(enum kvr_type t, const void * row, const struct mv_act * a, int64_t K) {
    const to_float_fn to_float = type_to_float(t);
    const int64_t n_b = kvr_blck_size(t) > 1 ? kvr_blck_size(t) : 256;
    float tmp[256];
    float sum = 0.0f;
    for (int64_t i = 0; i < K; i += n_b) {
        const int64_t n = K - i < n_b ? K - i : n_b;
        to_float((const uint8_t *)row + kvr_row_size(t, i), tmp, n);
        for (int64_t j = 0; j < n; j++) sum += tmp[j] * a->x[i + j];
    }
    return sum;
}

#define MV_ROW(name, type) \
    static float mv_row_##name(const void * row, const struct mv_act * a, int64_t K) { return mv_row_blocks(type, row, a, K); }
MV_ROW(q4_0, KVR_TYPE_Q4_0) MV_ROW(q4_1, KVR_TYPE_Q4_1) MV_ROW(q5_0, KVR_TYPE_Q5_0) MV_ROW(q5_1, KVR_TYPE_Q5_1)
MV_ROW(q8_0, KVR_TYPE_Q8_0) MV_ROW(q8_1, KVR_TYPE_Q8_1) MV_ROW(q8_K, KVR_TYPE_Q8_K) MV_ROW(q2_K, KVR_TYPE_Q2_K)
MV_ROW(q3_K, KVR_TYPE_Q3_K) MV_ROW(q4_K, KVR_TYPE_Q4_K) MV_ROW(q5_K, KVR_TYPE_Q5_K) MV_ROW(q6_K, KVR_TYPE_Q6_K)
MV_ROW(f16, KVR_TYPE_F16)   MV_ROW(bf16, KVR_TYPE_BF16)
#undef MV_ROW

typedef void (* mv_tokens_fn)(const void * row, const struct mv_act * a, int64_t T, int64_t K, float * y, int64_t ldy);
static mv_tokens_fn mv_tokens_kernel(enum kvr_type t) {
    (void)t;
    return NULL;
}

#endif

static float mv_row_f32(const void * row, const struct mv_act * a, int64_t K) {
    return dot_f32_ggml(row, a->x, K);
}

// The row kernel of a weight type; NULL for a type no matmul takes.
static mv_row_fn mv_row_kernel(enum kvr_type t) {
    switch (t) {
        case KVR_TYPE_F32:  return mv_row_f32;
        case KVR_TYPE_F16:  return mv_row_f16;
        case KVR_TYPE_BF16: return mv_row_bf16;
        case KVR_TYPE_Q4_0: return mv_row_q4_0;
        case KVR_TYPE_Q4_1: return mv_row_q4_1;
        case KVR_TYPE_Q5_0: return mv_row_q5_0;
        case KVR_TYPE_Q5_1: return mv_row_q5_1;
        case KVR_TYPE_Q8_0: return mv_row_q8_0;
        case KVR_TYPE_Q8_1: return mv_row_q8_1;
        case KVR_TYPE_Q2_K: return mv_row_q2_K;
        case KVR_TYPE_Q3_K: return mv_row_q3_K;
        case KVR_TYPE_Q4_K: return mv_row_q4_K;
        case KVR_TYPE_Q5_K: return mv_row_q5_K;
        case KVR_TYPE_Q6_K: return mv_row_q6_K;
        case KVR_TYPE_Q8_K: return mv_row_q8_K;
        default:            return NULL;
    }
}

// Y[t][n] = W[n] . X[t] for the chunks of the N rows this thread takes and T <= MV_MAX_TOKENS
// tokens; scratch holds T * mv_act_floats(K) floats. Returns the rows it computed.
static int64_t mv_mul(enum kvr_type type, const void * W, size_t row_bytes, int64_t K, int64_t N, const struct mm_chunks * chunks,
                      int64_t r0, int64_t r1, const float * X, int64_t ldx, int64_t T, float * Y, int64_t ldy, float * scratch) {
    const mv_row_fn row_fn = mv_row_kernel(type);
    KVR_ASSERT(row_fn && T <= MV_BATCH_TOKENS);
    const bool den = mv_den_fast();
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    // quants read as subnormal floats would read as 0 under denormals-are-zero (which an
    // application built with -ffast-math sets): it is off while the kernels run
    const unsigned csr = _mm_getcsr();
    if (den && (csr & 0x0040u)) _mm_setcsr(csr & ~0x0040u);
#endif
    struct mv_act act[MV_BATCH_TOKENS];
    for (int64_t t = 0; t < T; t++) mv_act_init(&act[t], type, X + t * ldx, K, scratch + (size_t)t * mv_act_floats(K), den);
    const mv_tokens_fn tokens_fn = T > 1 ? mv_tokens_kernel(type) : NULL;
    int64_t n0 = r0, n1 = r1, done = 0;
    bool once = true;
    while (chunks ? mm_chunk_next(chunks, N, &n0, &n1) : once) {
        once = false;
        for (int64_t n = n0; n < n1; n++) {
            const void * row = (const uint8_t *)W + (size_t)n * row_bytes;
            if (tokens_fn) tokens_fn(row, act, T, K, Y + n, ldy);
            else for (int64_t t = 0; t < T; t++) Y[t * ldy + n] = row_fn(row, &act[t], K);
        }
        done += n1 - n0;
    }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (den && (csr & 0x0040u)) _mm_setcsr(csr);
#endif
    return done;
}

// x.y summed as llama.cpp's CPU backend (built with GGML_LLAMAFILE, its default) sums the F32
// matmuls of a batch (two or more tokens, n % 8 == 0, the output's rows a multiple of 4): the
// tinyBLAS kernel of its llamafile sgemm on AVX2, one 8-lane FMA accumulator (lane i gets products i, i+8, ...), then its horizontal sum:
// the 128-bit halves added, then (lane 0 + lane 2) + (lane 1 + lane 3).
static float dot_f32_tinyblas(const float * x, const float * y, int64_t n) {
    float h[4];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    _mm_storeu_ps(h, _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc)));
#else
    float acc[8] = { 0 };
    for (int64_t i = 0; i < n; i += 8) {
        for (int j = 0; j < 8; j++) acc[j] = fmaf(x[i + j], y[i + j], acc[j]);
    }
    for (int j = 0; j < 4; j++) h[j] = acc[j + 4] + acc[j];
#endif
    return (h[0] + h[2]) + (h[1] + h[3]);
}

// The sums above as a llama.cpp built for AVX-512 makes them (kvr_backend_params.avx512_order):
// 16-lane vectors. _mm512_reduce_add_ps's tree first: the 256-bit halves added, then the 128-bit
// halves, then (lane 0 + lane 2) + (lane 1 + lane 3).
static float reduce_add16(const float * a) {
    float h[8], q[4];
    for (int j = 0; j < 8; j++) h[j] = a[8 + j] + a[j];
    for (int j = 0; j < 4; j++) q[j] = h[4 + j] + h[j];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

#if defined(__AVX512F__)
// reduce_add16 on a register
static inline float hsum16(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 h = _mm256_add_ps(hi, _mm512_castps512_ps256(v));
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    float f[4];
    _mm_storeu_ps(f, q);
    return (f[0] + f[2]) + (f[1] + f[3]);
}
#endif

// ggml_vec_dot_f32 with 16-lane vectors: four accumulators over blocks of 64, added (0+2, 1+3),
// then the two, reduced as above, then the tail past the last 64 one product at a time in float,
// as GCC 12 -O3 compiles its loop (the build that made the kv/ references: its object code sums
// the tail's products 16, then 8 at a time, each rounded and then added in order, and the last
// n % 8 by fused multiply-adds).
static float dot_f32_ggml16(const float * x, const float * y, int64_t n) {
    const int64_t np = n & ~(int64_t)63;
#if defined(__AVX512F__)
    __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
    for (int64_t i = 0; i < np; i += 64) {
        for (int r = 0; r < 4; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * r), _mm512_loadu_ps(y + i + 16 * r), acc[r]);
    }
    float sum = hsum16(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
#else
    float acc[4][16] = { { 0 } };
    for (int64_t i = 0; i < np; i += 64) {
        for (int r = 0; r < 4; r++) {
            for (int j = 0; j < 16; j++) acc[r][j] = fmaf(x[i + 16 * r + j], y[i + 16 * r + j], acc[r][j]);
        }
    }
    for (int j = 0; j < 16; j++) acc[0][j] = (acc[0][j] + acc[2][j]) + (acc[1][j] + acc[3][j]);
    float sum = reduce_add16(acc[0]);
#endif
    const int64_t nf = n - (n - np) % 8;
    for (int64_t i = np; i < nf; i++) sum += x[i] * y[i];
    for (int64_t i = nf; i < n; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
}

// tinyBLAS with 16-lane vectors: one accumulator (lane i gets products i, i+16, ...), reduced as above.
static float dot_f32_tinyblas16(const float * x, const float * y, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
    return hsum16(acc);
#else
    float acc[16] = { 0 };
    for (int64_t i = 0; i < n; i += 16) {
        for (int j = 0; j < 16; j++) acc[j] = fmaf(x[i + j], y[i + j], acc[j]);
    }
    return reduce_add16(acc);
#endif
}

// Which of the two orders llama.cpp's CPU backend sums a small F32 matmul in: tinyBLAS's for a
// batch (T >= 2 rows of x) when its kernel takes the shape (K a multiple of its lanes, N % 4 == 0), otherwise
// ggml_vec_dot_f32's (a single token, as in decoding, or another shape). A llama.cpp built
// without GGML_LLAMAFILE sums everything in the second (vec_dot: the CPU's vec_dot_order).
static bool mm_tinyblas_order(int64_t K, int64_t N, int64_t T, const struct cpu_params * p) {
    return !p->vec_dot && T >= 2 && K % (p->lanes16 ? 16 : 8) == 0 && N % 4 == 0;
}

typedef float (* dot_f32_fn)(const float *, const float *, int64_t);

// The dot of one output of such a product, in the order of the build the backend follows.
static dot_f32_fn mm_dot_order(int64_t K, int64_t N, int64_t T, const struct cpu_params * p) {
    if (mm_tinyblas_order(K, N, T, p)) return p->lanes16 ? dot_f32_tinyblas16 : dot_f32_tinyblas;
    return p->lanes16 ? dot_f32_ggml16 : dot_f32_ggml;
}

static size_t mm_block_bytes(int64_t T) {
    return T >= MM_PREFILL_ROWS ? MM_BLOCK_BYTES_PREFILL : MM_BLOCK_BYTES_DECODE;
}

// The integer path (quantized activations, qx_mul_mat) when asked for: every quantized weight type,
// decode and prefill.
static bool mm_uses_q8(const struct kvr_tensor * w, bool q8_act) {
    return q8_act && (qx_is_legacy(w->type) || qx_is_k(w->type));
}

// A MUL_MAT as its fast paths see it: Y[t][n] = W[n] . X[t] for n < N, t < T, the rows of X lda
// floats apart, Y contiguous. Each path below does this thread's share of the rows and returns how
// many; cpu_op_mul_mat picks one.
struct mm_args {
    const struct kvr_tensor * w;
    int64_t       K, N, T;
    const float * X;
    int           lda;
    float       * Y;
    bool          by_rows; // a decode batch (KVR_MM_ROWS): every token through the row kernels
    const void  * xkey;    // the graph tensor X is (its activations may be cached: struct qx_act_cache), or NULL
};

// 8-bit activations and integer products, when asked for (kvr_backend_params.q8_activations): what
// llama.cpp's CPU backend computes, and faster than the exact paths. Threads take the rows by
// chunks, in groups of 8 for a prefill (the kernel's interleave); each quantizes all the tokens,
// which costs less than interleaving every row twice would. A decode batch (by_rows) takes the row
// kernels whatever its size: each token gets what its solo decode gets.
static int64_t mm_q8(const struct cpu_params * p, const struct mm_args * m) {
    int64_t r0, r1;
#if QX_L512
    if (m->w->flags & KVR_FLAG_TILED) { // every count of tokens: rows by chunks of whole tiles
        const struct mm_chunks c = { p->chunk, mm_chunk_rows(m->N, p->nth, KVR_TILE_ROWS) };
        return qx_mul_tiles(m->w->type, m->w->data, m->w->nb[1], m->K, m->N, &c, m->X, m->lda, m->T, m->Y, m->N, p->wdata,
                            p->wsize * sizeof(float), p->acache, m->xkey, p->run);
    }
#endif
    if (m->T <= QX_ROW_TOKENS || m->by_rows) { // decode: rows by chunks (struct mm_chunks)
        KVR_ASSERT(qx_rows_bytes(m->w->type, m->K, m->T) <= p->wsize * sizeof(float));
        const struct mm_chunks c = { p->chunk, mm_chunk_rows(m->N, p->nth, 8) };
        return qx_mul_rows(m->w->type, m->w->data, m->w->nb[1], m->K, 0, m->N, &c, m->X, m->lda, m->T, m->Y, m->N, p->wdata);
    }
    struct qx_x8_fns f;
    if (qx_uses_x8(m->w->type, m->T) && qx_x8_get(m->w->type, &f)) { // rows by chunks (struct mm_chunks), whole tiles
        const struct mm_chunks c = { p->chunk, mm_chunk_rows(m->N, p->nth, f.rows) };
        return qx_mul_mat(m->w->type, m->w->data, m->w->nb[1], m->K, 0, m->N, &c, m->X, m->lda, m->T, m->Y, m->N, p->wdata,
                          p->wsize * sizeof(float));
    }
    row_range(m->N, p->ith, p->nth, &r0, &r1);
    return qx_mul_mat(m->w->type, m->w->data, m->w->nb[1], m->K, r0, r1, NULL, m->X, m->lda, m->T, m->Y, m->N, p->wdata,
                      p->wsize * sizeof(float));
}

// Small F32 matrices (decode too): one dot per output in llama.cpp's order (mm_tinyblas_order),
// so that small models give its last bits (see MM_DOT_MAX_WEIGHTS). A decode batch (by_rows) sums
// each token as one token alone is summed.
static int64_t mm_dot_llama(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    // a decode batch (by_rows) sums every token in the order a one-token product uses, so that each
    // token gets what its solo decode gets to the last bit
    const int64_t T_order = m->by_rows ? 1 : m->T;
    const dot_f32_fn dot = mm_dot_order(m->K, m->N, T_order, p);
    for (int64_t t = 0; t < m->T; t++) {
        const float * xt = m->X + t * m->lda;
        for (int64_t n = n0; n < n1; n++) {
            m->Y[t * m->N + n] = dot((const float *)((const uint8_t *)m->w->data + n * m->w->nb[1]), xt, m->K);
        }
    }
    return n1 - n0;
}

// A batch in tinyBLAS's 16-lane order (avx512_order, exact arithmetic): what a llama.cpp built for
// AVX-512 computes for an F32 matmul of two or more tokens that its llamafile sgemm takes
// (mm_tinyblas_order), and for a quantized file what it computes on the file's dequantized F32
// twin. Every output is dot_f32_tinyblas16's sum to the bit (one 16-lane FMA chain, then
// reduce_add16's tree); only the loads are shared. A tile of MM_TB_ROWS weight rows by
// MM_TB_TOKENS tokens keeps its 24 accumulators in registers (zmm: 32), so each 16 floats of a row
// or a token are loaded once a tile, not once an output. The rows go through scratch in f32
// MM_TB_BLOCK at a time (F32: read in place) and every token tile walks them while they sit in L2.
// It serves this ordering mode only (no blocking over the tokens beyond that).
#define MM_TB_ROWS   4
#define MM_TB_TOKENS 6
#define MM_TB_BLOCK  16

#if defined(__AVX512F__)
// Y[j][i] (j < rn tokens, i < rm rows) for rm, rn constants of each copy (mm_tb_tile)
static inline __attribute__((always_inline)) void mm_tb_tile_n(const float * W, int64_t ldw, const float * X, int64_t ldx, float * Y,
                                                                 int64_t ldy, int64_t K, const int rm, const int rn) {
    __m512 acc[MM_TB_TOKENS][MM_TB_ROWS];
#pragma GCC unroll 6
    for (int j = 0; j < rn; j++) {
#pragma GCC unroll 4
        for (int i = 0; i < rm; i++) acc[j][i] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 16) {
        __m512 w[MM_TB_ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < rm; i++) w[i] = _mm512_loadu_ps(W + i * ldw + k);
#pragma GCC unroll 6
        for (int j = 0; j < rn; j++) {
            const __m512 x = _mm512_loadu_ps(X + j * ldx + k);
#pragma GCC unroll 4
            for (int i = 0; i < rm; i++) acc[j][i] = _mm512_fmadd_ps(w[i], x, acc[j][i]);
        }
    }
    for (int j = 0; j < rn; j++) {
        for (int i = 0; i < rm; i++) Y[j * ldy + i] = hsum16(acc[j][i]);
    }
}
#endif

// One tile: rm (MM_TB_ROWS or 1) rows of W, rn (1..MM_TB_TOKENS) tokens of X, into Y[j * ldy + i].
static void mm_tb_tile(const float * W, int64_t ldw, const float * X, int64_t ldx, float * Y, int64_t ldy, int64_t K, int rm,
                       int rn) {
    KVR_ASSERT((rm == MM_TB_ROWS || rm == 1) && rn >= 1 && rn <= MM_TB_TOKENS && K % 16 == 0);
#if defined(__AVX512F__)
#define MM_TB_CASE(r, c) case (r) * 8 + (c): mm_tb_tile_n(W, ldw, X, ldx, Y, ldy, K, r, c); break;
    switch (rm * 8 + rn) {
        MM_TB_CASE(MM_TB_ROWS, 1) MM_TB_CASE(MM_TB_ROWS, 2) MM_TB_CASE(MM_TB_ROWS, 3)
        MM_TB_CASE(MM_TB_ROWS, 4) MM_TB_CASE(MM_TB_ROWS, 5) MM_TB_CASE(MM_TB_ROWS, 6)
        MM_TB_CASE(1, 1) MM_TB_CASE(1, 2) MM_TB_CASE(1, 3) MM_TB_CASE(1, 4) MM_TB_CASE(1, 5) MM_TB_CASE(1, 6)
        default: KVR_ASSERT(false);
    }
#undef MM_TB_CASE
#else
    for (int j = 0; j < rn; j++) {
        for (int i = 0; i < rm; i++) Y[j * ldy + i] = dot_f32_tinyblas16(W + i * ldw, X + j * ldx, K);
    }
#endif
}

static int64_t mm_tinyblas16(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    const int64_t K = m->K;
    const bool f32 = m->w->type == KVR_TYPE_F32;
    const to_float_fn to_float = type_to_float(m->w->type);
    // the scratch holds two rows at least (mm_scratch_floats)
    const int64_t block = f32 ? MM_TB_BLOCK : (int64_t)p->wsize / K < MM_TB_BLOCK ? (int64_t)p->wsize / K : MM_TB_BLOCK;
    KVR_ASSERT(to_float && block >= 1);
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t nb = n1 - b0 < block ? n1 - b0 : block;
        const float * W = p->wdata;
        int64_t ldw = K;
        if (f32) {
            W = (const float *)((const uint8_t *)m->w->data + b0 * m->w->nb[1]);
            ldw = (int64_t)(m->w->nb[1] / sizeof(float));
        } else {
            for (int64_t r = 0; r < nb; r++) w_row_f32(m->w, b0 + r, p->wdata + r * K);
        }
        for (int64_t t0 = 0; t0 < m->T; t0 += MM_TB_TOKENS) {
            const int rn = m->T - t0 < MM_TB_TOKENS ? (int)(m->T - t0) : MM_TB_TOKENS;
            for (int64_t r = 0; r < nb;) {
                const int rm = nb - r >= MM_TB_ROWS ? MM_TB_ROWS : 1;
                mm_tb_tile(W + r * ldw, ldw, m->X + t0 * m->lda, m->lda, m->Y + t0 * m->N + b0 + r, m->N, K, rm, rn);
                r += rm;
            }
        }
    }
    return n1 - n0;
}

// avx512_order's other products over weights of another type than F32 (F32: mm_dot_llama): each
// row in f32 (the dequantized twin's), then one dot an output in the order mm_dot_llama takes
// (ggml_vec_dot_f32's on 16 lanes: a single token, a decode batch's tokens each as alone, shapes
// tinyBLAS does not take).
static int64_t mm_dot_converted(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    const dot_f32_fn dot = mm_dot_order(m->K, m->N, m->by_rows ? 1 : m->T, p);
    const to_float_fn to_float = type_to_float(m->w->type);
    KVR_ASSERT(to_float && (size_t)m->K <= p->wsize);
    for (int64_t n = n0; n < n1; n++) {
        w_row_f32(m->w, n, p->wdata);
        for (int64_t t = 0; t < m->T; t++) m->Y[t * m->N + n] = dot(p->wdata, m->X + t * m->lda, m->K);
    }
    return n1 - n0;
}

// Decode (a few tokens): every weight row read once in its stored form, no conversion pass over
// memory and no sgemm packing of one row (see mv_mul).
static int64_t mm_decode(const struct cpu_params * p, const struct mm_args * m) {
    // up to one pass of tokens over the rows (MV_MAX_TOKENS; a decode batch, KVR_MM_ROWS:
    // MV_BATCH_TOKENS, the row kernels' group there): the rows by chunks (struct mm_chunks); a
    // larger batch a group at a time over this thread's share of the rows
    const int64_t G = m->T > MV_MAX_TOKENS ? MV_BATCH_TOKENS : MV_MAX_TOKENS;
    if (m->T <= G) {
        KVR_ASSERT((size_t)m->T * mv_act_floats(m->K) <= p->wsize);
        const struct mm_chunks c = { p->chunk, mm_chunk_rows(m->N, p->nth, 8) };
        return mv_mul(m->w->type, m->w->data, m->w->nb[1], m->K, m->N, &c, 0, 0, m->X, m->lda, m->T, m->Y, m->N, p->wdata);
    }
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    for (int64_t t0 = 0; t0 < m->T; t0 += G) {
        const int64_t T = m->T - t0 < G ? m->T - t0 : G;
        KVR_ASSERT((size_t)T * mv_act_floats(m->K) <= p->wsize);
        mv_mul(m->w->type, m->w->data, m->w->nb[1], m->K, m->N, NULL, n0, n1, m->X + t0 * m->lda, m->lda, T, m->Y + t0 * m->N,
               m->N, p->wdata);
    }
    return n1 - n0;
}

// Short prompts (MV_MAX_TOKENS < T < MM_PREFILL_ROWS: a chat turn): each weight row converted to f32
// once into this thread's scratch (it stays in L1/L2), then dotted with 8 tokens at a time, one
// 8-lane FMA chain a token, the row's 8 floats loaded once for the 8. For so few tokens sgemm's
// packing of both operands costs more than the products (about 20 GFLOP/s a thread at 8-16 tokens
// against 50-100 here, busy machine); rows by chunks (struct mm_chunks), as decode.
#define MM_FEW_TOKENS 8

static int64_t mm_few_tokens(const struct cpu_params * p, const struct mm_args * m) {
    const int64_t K = m->K, T = m->T;
    KVR_ASSERT((size_t)K <= p->wsize && K % 8 == 0);
    float * row = p->wdata;
    const struct mm_chunks c = { p->chunk, mm_chunk_rows(m->N, p->nth, 8) };
    int64_t n0, n1, done = 0;
    while (mm_chunk_next(&c, m->N, &n0, &n1)) {
        for (int64_t n = n0; n < n1; n++) {
            w_row_f32(m->w, n, row);
            for (int64_t t0 = 0; t0 < T; t0 += MM_FEW_TOKENS) {
                const int nt = T - t0 < MM_FEW_TOKENS ? (int)(T - t0) : MM_FEW_TOKENS;
                const float * x[MM_FEW_TOKENS];
                for (int j = 0; j < MM_FEW_TOKENS; j++) x[j] = m->X + (t0 + (j < nt ? j : nt - 1)) * m->lda; // a short group repeats its last token
                float out[MM_FEW_TOKENS];
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
                __m256 acc[MM_FEW_TOKENS];
                for (int j = 0; j < MM_FEW_TOKENS; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t k = 0; k < K; k += 8) {
                    const __m256 w = _mm256_loadu_ps(row + k);
#pragma GCC unroll 8
                    for (int j = 0; j < MM_FEW_TOKENS; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k), acc[j]);
                }
                for (int j = 0; j < MM_FEW_TOKENS; j++) out[j] = mv_hsum(acc[j]);
#else
                for (int j = 0; j < MM_FEW_TOKENS; j++) {
                    float a = 0.0f;
                    for (int64_t k = 0; k < K; k++) a = fmaf(row[k], x[j][k], a);
                    out[j] = a;
                }
#endif
                for (int j = 0; j < nt; j++) m->Y[(t0 + j) * m->N + n] = out[j];
            }
        }
        done += n1 - n0;
    }
    return done;
}

// F32 prefill: sgemm straight from the weights.
static int64_t mm_sgemm_f32(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    const float * W = (const float *)((const uint8_t *)m->w->data + n0 * m->w->nb[1]);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m->T, (int)(n1 - n0), (int)m->K,
                1.0f, m->X, m->lda, W, (int)(m->w->nb[1] / sizeof(float)), 0.0f, m->Y + n0, (int)m->N);
    return n1 - n0;
}

// The other types' prefill: rows converted to f32 a block at a time (mm_block_bytes), then sgemm
// on each block.
static int64_t mm_sgemm_converted(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    const int64_t K = m->K;
    int64_t rows = (int64_t)(mm_block_bytes(m->T) / ((size_t)K * sizeof(float)));
    if (rows < 1) rows = 1;
    if ((size_t)(rows * K) > p->wsize) rows = (int64_t)p->wsize / K;
    KVR_ASSERT(rows >= 1);
    for (int64_t b0 = n0; b0 < n1; b0 += rows) {
        const int64_t nb = b0 + rows <= n1 ? rows : n1 - b0;
        for (int64_t r = 0; r < nb; r++) {
            w_row_f32(m->w, b0 + r, p->wdata + r * K);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m->T, (int)nb, (int)K,
                    1.0f, m->X, m->lda, p->wdata, (int)K, 0.0f, m->Y + b0, (int)m->N);
    }
    return n1 - n0;
}

// The fast MUL_MAT: one of the paths above (ref_mul_mat is the plain one). The order matters: the
// integer path only when asked for; small F32 in llama.cpp's order even for decode; then decode
// rows for every type that has a row kernel; sgemm for the rest.
// MXFP4 with 8-bit activations, as llama.cpp's CPU backend multiplies it: each token's 32 values
// of a block rounded to Q8_0 (qx_quantize_q8), then per block d_a 2^(e-128) times the integer sum
// of the doubled E2M1 values and the quants (ggml_vec_dot_mxfp4_q8_0). Tokens a chunk at a time.
#define MM_MXFP4_TOKENS 16

static size_t mm_mxfp4_q8_bytes(int64_t K) {
    return (size_t)MM_MXFP4_TOKENS * (size_t)(K / KVR_QK) * sizeof(struct qx_q8);
}

static int64_t mm_mxfp4_q8(const struct cpu_params * p, const struct mm_args * m) {
    int64_t n0, n1;
    row_range(m->N, p->ith, p->nth, &n0, &n1);
    if (n1 <= n0) return 0;
    const int64_t nb = m->K / KVR_QK;
    KVR_ASSERT(mm_mxfp4_q8_bytes(m->K) <= p->wsize * sizeof(float));
    struct qx_q8 * act = (struct qx_q8 *)p->wdata;
    for (int64_t t0 = 0; t0 < m->T; t0 += MM_MXFP4_TOKENS) {
        const int64_t nt = m->T - t0 < MM_MXFP4_TOKENS ? m->T - t0 : MM_MXFP4_TOKENS;
        for (int64_t t = 0; t < nt; t++) qx_quantize_q8(m->X + (t0 + t) * m->lda, act + t * nb, m->K);
        for (int64_t n = n0; n < n1; n++) {
            const struct kvr_block_mxfp4 * wb = (const struct kvr_block_mxfp4 *)((const uint8_t *)m->w->data + n * m->w->nb[1]);
            for (int64_t t = 0; t < nt; t++) {
                const struct qx_q8 * a = act + t * nb;
                float sum = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int lo = 0, hi = 0;
                    for (int j = 0; j < KVR_QK/2; j++) {
                        lo += a[b].qs[j]            * kvr_mxfp4_value(wb[b].qs[j] & 0x0f);
                        hi += a[b].qs[j + KVR_QK/2] * kvr_mxfp4_value(wb[b].qs[j] >>   4);
                    }
                    sum += a[b].d * kvr_e8m0_half(wb[b].e) * (float)(lo + hi);
                }
                m->Y[(t0 + t) * m->N + n] = sum;
            }
        }
    }
    return n1 - n0;
}

// One of the paths above for a MUL_MAT (or one expert of a MUL_MAT_ID): this thread's rows; how many.
static int64_t mm_run(const struct cpu_params * p, const struct mm_args * m) {
    const enum kvr_type t = m->w->type;
    if (mm_uses_q8(m->w, p->q8_act))                        return mm_q8(p, m);
    if (p->q8_act && t == KVR_TYPE_MXFP4)                   return mm_mxfp4_q8(p, m);
    // avx512_order (exact arithmetic): every product as a llama.cpp built for AVX-512 sums it on
    // the weights' F32 twin (the kv/ references' bits): slower than the paths below
    if (p->lanes16 && type_to_float(t)) {
        if (!m->by_rows && mm_tinyblas_order(m->K, m->N, m->T, p)) return mm_tinyblas16(p, m);
        return t == KVR_TYPE_F32 ? mm_dot_llama(p, m) : mm_dot_converted(p, m);
    }
    if (t == KVR_TYPE_F32 && m->K * m->N <= MM_DOT_MAX_WEIGHTS) return mm_dot_llama(p, m);
    if ((m->T <= MV_MAX_TOKENS || m->by_rows) && mv_row_kernel(t) && !(m->w->flags & KVR_FLAG_TILED)) return mm_decode(p, m);
    if (m->T < MM_PREFILL_ROWS && t != KVR_TYPE_F32 && m->K % 8 == 0) return mm_few_tokens(p, m);
    if (t == KVR_TYPE_F32)                                  return mm_sgemm_f32(p, m);
    return mm_sgemm_converted(p, m);
}

static void cpu_op_mul_mat(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1];
    const int64_t T = x->ne[1] * x->ne[2] * x->ne[3];
    // rows of x must be evenly strided to hand them to sgemm as one matrix
    KVR_ASSERT(x->ne[2] == 1 || x->nb[2] == x->nb[1] * (size_t)x->ne[1]);
    KVR_ASSERT(x->ne[3] == 1 || x->nb[3] == x->nb[2] * (size_t)x->ne[2]);
    KVR_ASSERT(kvr_is_contiguous(dst));
    const struct mm_args m = { w, K, N, T, x->data, (int)(x->nb[1] / sizeof(float)), dst->data, dst->op_params[0] == KVR_MM_ROWS, x };
    p->counters->matmul_flops += 2 * K * mm_run(p, &m) * T;
}

// The scratch floats of a matmul of [K, N] weights of type `type` by T tokens on one of n_threads
// threads (what mm_run's paths use of p->wdata).
static size_t mm_scratch_floats(enum kvr_type type, int64_t K, int64_t N, int64_t T, int n_threads, bool q8_act, bool by_rows) {
    int64_t rows = (N + n_threads - 1) / n_threads;
    const int64_t cap = (int64_t)(mm_block_bytes(T) / ((size_t)K * sizeof(float)));
    if (rows > cap) rows = cap > 0 ? cap : 1;
    size_t n = type == KVR_TYPE_F32 ? 0 : (size_t)(rows * K);
    if ((size_t)K * 2 > n) n = (size_t)K * 2;
    if (q8_act && (qx_is_legacy(type) || qx_is_k(type))) {
        n = (by_rows ? qx_rows_bytes(type, K, T) : qx_scratch_bytes(type, K, T)) / sizeof(float) + 1;
    }
    if (q8_act && type == KVR_TYPE_MXFP4 && mm_mxfp4_q8_bytes(K) / sizeof(float) + 1 > n) n = mm_mxfp4_q8_bytes(K) / sizeof(float) + 1;
    // the row kernels take a decode batch MV_BATCH_TOKENS tokens a pass
    const int64_t Tr = T <= MV_MAX_TOKENS ? T : T < MV_BATCH_TOKENS ? T : MV_BATCH_TOKENS;
    if ((T <= MV_MAX_TOKENS || by_rows) && (size_t)Tr * mv_act_floats(K) > n) n = (size_t)Tr * mv_act_floats(K);
    return n;
}

// MUL_MAT_ID: tokens grouped by expert. Each thread takes a slice of the rows of every expert;
// for each expert some token picked it gathers those tokens' rows of x, multiplies its slice of
// the expert's matrix by them through mm_run (the MUL_MAT paths, one thread's worth), and puts the
// products (+ bias) where the tokens' slots are. The rows of experts no token picked are not read.
// Small products sum in ggml_vec_dot_f32's order over the rows converted to f32 (mul_mat_id takes
// no tinyBLAS path in llama.cpp), so small MoE models give its bits, quantized experts those of
// their dequantized twin.
static size_t mm_id_scratch_floats(const struct kvr_tensor * node, int n_threads, bool q8_act) {
    const struct kvr_tensor * w = node->src[0];
    const int64_t K = w->ne[0], N = w->ne[1], T = node->ne[2];
    const int64_t rows = (N + n_threads - 1) / n_threads;
    // an expert meets 1..T tokens, and the paths' scratch is not monotone in the tokens (one token
    // of the integer path keeps a decode layout of its own; a few use the row path)
    const bool by_rows = node->op_params[0] == KVR_MM_ROWS;
    size_t kernel = mm_scratch_floats(w->type, K, rows, T, 1, q8_act, by_rows);
    for (int64_t t = 1; t < T && t <= QX_ROW_TOKENS + 1; t++) {
        const size_t n = mm_scratch_floats(w->type, K, rows, t, 1, q8_act, by_rows);
        if (n > kernel) kernel = n;
    }
    return (size_t)(T + T * K + T * rows + K) + kernel;
}

static void cpu_op_mul_mat_id(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * w = dst->src[0], * x = dst->src[1], * route = dst->src[2], * b = dst->src[3];
    const int64_t K = w->ne[0], N = w->ne[1], E = w->ne[2], k = dst->ne[1], T = dst->ne[2];
    int64_t n0, n1;
    row_range(N, p->ith, p->nth, &n0, &n1);
    const int64_t rows = n1 - n0;
    if (rows <= 0) return;
    int32_t * slot = (int32_t *)p->wdata;      // [T] the (token, j) slots of one expert
    float * X = p->wdata + T;                  // [n_e, K] their rows of x
    float * Y = X + T * K;                     // [n_e, rows] the products
    float * row = Y + T * rows;                // [K] one weight row in f32
    struct cpu_params q = *p;                  // one thread's worth of mm_run, on this slice
    atomic_int q_chunk;                        // its chunks of rows (struct mm_chunks): its own
    q.chunk = &q_chunk;
    q.ith = 0;
    q.nth = 1;
    q.vec_dot = true;
    q.wdata = row + K;
    KVR_ASSERT((size_t)(T + T * K + T * rows + K) <= p->wsize);
    q.wsize = p->wsize - (size_t)(T + T * K + T * rows + K);
    const to_float_fn to_float = type_to_float(w->type);
    const bool dots = !(p->q8_act && (ref_quantized(w->type))) && K * rows <= MM_DOT_MAX_WEIGHTS;
    for (int64_t e = 0; e < E; e++) {
        int64_t n_e = 0;
        for (int64_t t = 0; t < T; t++) {
            for (int64_t j = 0; j < k; j++) {
                const int64_t id = moe_expert(route, t, j);
                KVR_ASSERT(id >= 0 && id < E);
                if (id == e) slot[n_e++] = (int32_t)(t * k + j);
            }
        }
        if (n_e == 0) continue;
        KVR_ASSERT(n_e <= T);
        for (int64_t s = 0; s < n_e; s++) memcpy(X + s * K, moe_x_row(x, T, slot[s] / k, slot[s] % k), (size_t)K * sizeof(float));
        const uint8_t * we = (const uint8_t *)w->data + e * w->nb[2] + n0 * w->nb[1];
        if (dots) {
            for (int64_t r = 0; r < rows; r++) {
                to_float(we + r * w->nb[1], row, K);
                for (int64_t s = 0; s < n_e; s++) Y[s * rows + r] = dot_f32_ggml(row, X + s * K, K);
            }
        } else {
            struct kvr_tensor ws = *w;         // this thread's rows of expert e as a matrix
            ws.data  = (void *)we;
            ws.ne[1] = rows;
            ws.ne[2] = 1;
            const struct mm_args m = { &ws, K, rows, n_e, X, (int)K, Y, dst->op_params[0] == KVR_MM_ROWS, NULL };
            atomic_store_explicit(&q_chunk, 0, memory_order_relaxed);
            mm_run(&q, &m);
        }
        for (int64_t s = 0; s < n_e; s++) {
            float * y = (float *)row_ptr(dst, slot[s] % k, slot[s] / k, 0) + n0;
            const float * bias = b ? (const float *)row_ptr(b, e, 0, 0) + n0 : NULL;
            for (int64_t r = 0; r < rows; r++) y[r] = bias ? Y[s * rows + r] + bias[r] : Y[s * rows + r];
        }
        p->counters->matmul_flops += 2 * K * rows * n_e;
        p->counters->expert_bytes += rows * (int64_t)w->nb[1];
    }
}

// Router: each token's k experts and their weights (kvr_moe_route). The softmax is ggml's soft_max
// (max, then expf, the sum in double, times its inverse); the top k are taken largest first, the
// first index among equals.
static void cpu_op_moe_route(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t E = a->ne[0], k = dst->op_params[0];
    const int gating = dst->op_params[1];
    int64_t r0, r1;
    row_range(a->ne[1], p->ith, p->nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        const float * x = row_ptr(a, t, 0, 0);
        float * out = row_ptr(dst, t, 0, 0), * w = out, * ids = out + k;
        float mx = -INFINITY, inv = 1.0f;
        if (gating != KVR_MOE_TOPK_SOFTMAX) {
            for (int64_t e = 0; e < E; e++) mx = x[e] > mx ? x[e] : mx;
            double sum = 0.0;
            for (int64_t e = 0; e < E; e++) sum += (double)expf(x[e] - mx);
            inv = (float)(1.0 / sum);
        }
        // the score the experts are ranked by: the probability, or the logit itself
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float best_v = -INFINITY;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int64_t i = 0; i < j && !taken; i++) taken = (int64_t)ids[i] == e;
                if (taken) continue;
                const float v = gating == KVR_MOE_TOPK_SOFTMAX ? x[e] : expf(x[e] - mx) * inv;
                if (best < 0 || v > best_v) { best = e; best_v = v; }
            }
            ids[j] = (float)best;
            w[j] = best_v;
        }
        if (gating == KVR_MOE_TOPK_SOFTMAX) { // softmax over the k selected logits
            float m = -INFINITY;
            for (int64_t j = 0; j < k; j++) m = w[j] > m ? w[j] : m;
            double sum = 0.0;
            for (int64_t j = 0; j < k; j++) { w[j] = expf(w[j] - m); sum += w[j]; }
            const float is = (float)(1.0 / sum);
            for (int64_t j = 0; j < k; j++) w[j] *= is;
        } else if (gating == KVR_MOE_SOFTMAX_TOPK_NORM) {
            double sum = 0.0;
            for (int64_t j = 0; j < k; j++) sum += w[j];
            // llama.cpp clamps the sum at the smallest normal fp16 so that it never divides by 0
            const float s = (float)sum < 6.103515625e-5f ? 6.103515625e-5f : (float)sum;
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        }
    }
}

static void cpu_op_moe_sum(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * y = dst->src[0], * route = dst->src[1];
    const int64_t N = y->ne[0], k = y->ne[1];
    int64_t r0, r1;
    row_range(dst->ne[1], p->ith, p->nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        float * out = row_ptr(dst, t, 0, 0);
        // each product rounded, then added in order of j: llama.cpp's mul, then its chain of adds
        const float w0 = moe_weight(route, t, 0);
        const float * y0 = row_ptr(y, 0, t, 0);
        for (int64_t n = 0; n < N; n++) out[n] = y0[n] * w0;
        for (int64_t j = 1; j < k; j++) {
            const float wj = moe_weight(route, t, j);
            const float * yj = row_ptr(y, j, t, 0);
            for (int64_t n = 0; n < N; n++) {
                const float v = yj[n] * wj;
                out[n] += v;
            }
        }
    }
}

static void cpu_op_swiglu_oai(const struct cpu_params * p, struct kvr_tensor * dst) {
    const float * g = dst->src[0]->data, * u = dst->src[1]->data;
    float * y = dst->data;
    const float alpha = get_param_f32(dst, 0), limit = get_param_f32(dst, 1);
    int64_t i0, i1;
    row_range(kvr_nelements(dst), p->ith, p->nth, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        const float a = g[i] < limit ? g[i] : limit;
        const float b = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        y[i] = a / (1.0f + expf(alpha * (-a))) * (b + 1.0f);
    }
}

static void cpu_op_rope(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0], * pos = dst->src[1];
    const float * ff = dst->src[2] ? (const float *)dst->src[2]->data : NULL; // per-pair divisors
    const int n_rot = dst->op_params[0];
    const int mode = dst->op_params[1];
    const float freq_base = get_param_f32(dst, 2), freq_scale = get_param_f32(dst, 3);
    const float ext_factor = get_param_f32(dst, 4), mscale = get_param_f32(dst, 5);
    const float corr_lo = get_param_f32(dst, 6), corr_hi = get_param_f32(dst, 7);
    const int64_t D = a->ne[0], H = a->ne[1], T = a->ne[2];
    // theta_i = pos * base^(-2i/n_rot), stepped by repeated multiplication as GGML does (this loop
    // is kvr_rope_theta for every pair at once); then divided by the pair's frequency factor and
    // scaled, with YaRN's ramp where the node has it, in GGML's order (rope_yarn: kvr_rope_yarn_cs)
    const float theta_scale = kvr_rope_theta_scale(freq_base, n_rot);
    int64_t r0, r1;
    row_range(T, p->ith, p->nth, &r0, &r1);
    float cs_row[2 * 512];
    KVR_ASSERT(n_rot <= 1024);
    // the angles of rows r0..r1 from the thread's cache where the last RoPE node made them
    struct rope_cache * rc = p->rcache;
    const float par[7] = { freq_base, freq_scale, ext_factor, mscale, corr_lo, corr_hi, (float)n_rot };
    const bool cache = (r1 - r0) * n_rot <= ROPE_CACHE_FLOATS;
    const bool hit = cache && rc->pos == pos && rc->ff == dst->src[2] && rc->run == p->run && rc->r0 == r0 && rc->r1 == r1 &&
                     memcmp(rc->par, par, sizeof(par)) == 0;
    for (int64_t t = r0; t < r1; t++) {
        float * cs = cache ? rc->cs + (t - r0) * n_rot : cs_row;
        float theta = (float)((const int32_t *)pos->data)[t];
        for (int i = 0; !hit && i < n_rot / 2; i++) {
            kvr_rope_yarn_cs(ff ? theta / ff[i] : theta, freq_scale, ext_factor, mscale, corr_lo, corr_hi, i,
                             &cs[2 * i], &cs[2 * i + 1]);
            theta *= theta_scale;
        }
        for (int64_t h = 0; h < H; h++) {
            const float * x = row_ptr(a, h, t, 0);
            float * y = row_ptr(dst, h, t, 0);
            int i = 0;
#if defined(__AVX512F__)
            // kvr_rope_rotate on 8 adjacent pairs (16 split halves) at once, the same operations:
            // -(x1 s) as x1 times s with its sign flipped (exactly the same value, zeros included)
            const __m512i flip_even = _mm512_set1_epi64((long long)0x80000000u);
            for (; mode == KVR_ROPE_NORM && i + 8 <= n_rot / 2; i += 8) {
                // y = x0 (c, s) + x1 (-s, c), pair by pair
                const __m512 v = _mm512_loadu_ps(x + 2 * i), c = _mm512_loadu_ps(cs + 2 * i);
                const __m512 sn = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_permute_ps(c, 0xb1)), flip_even));
                _mm512_storeu_ps(y + 2 * i, _mm512_fmadd_ps(_mm512_moveldup_ps(v), c, _mm512_mul_ps(_mm512_movehdup_ps(v), sn)));
            }
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
            const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
            for (; mode == KVR_ROPE_NEOX && i + 16 <= n_rot / 2; i += 16) {
                const __m512 c0 = _mm512_loadu_ps(cs + 2 * i), c1 = _mm512_loadu_ps(cs + 2 * i + 16);
                const __m512 c = _mm512_permutex2var_ps(c0, even, c1), sv = _mm512_permutex2var_ps(c0, odd, c1);
                const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + n_rot / 2);
                const __m512 nx1s = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(x1, sv)), sign));
                _mm512_storeu_ps(y + i, _mm512_fmadd_ps(x0, c, nx1s));
                _mm512_storeu_ps(y + i + n_rot / 2, _mm512_fmadd_ps(x0, sv, _mm512_mul_ps(x1, c)));
            }
#endif
            for (; i < n_rot / 2; i++) {
                int i0, i1;
                kvr_rope_dims(mode, n_rot, i, &i0, &i1);
                kvr_rope_rotate(x[i0], x[i1], cs[2 * i], cs[2 * i + 1], &y[i0], &y[i1]);
            }
            for (int64_t i = n_rot; i < D; i++) y[i] = x[i];
        }
    }
    if (cache && !hit) {
        rc->pos = pos;
        rc->ff = dst->src[2];
        rc->run = p->run;
        rc->r0 = r0;
        rc->r1 = r1;
        memcpy(rc->par, par, sizeof(par));
    }
}

static void cpu_op_cpy(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * a = dst->src[0];
    const int64_t n = a->ne[0];
    int64_t r0, r1;
    row_range(kvr_nrows(a), p->ith, p->nth, &r0, &r1);
    if (a->type == dst->type && a->type != KVR_TYPE_F32) { // rows of a typed tensor, as they are
        for (int64_t r = r0; r < r1; r++) memcpy(row_ptr_flat(dst, r), row_ptr_flat(a, r), kvr_row_size(a->type, n));
        return;
    }
    // dst may have another shape with the same element count: copy element by element when the
    // row lengths differ, row by row (the common case: cache stores) when they match
    if (dst->ne[0] == n) {
        for (int64_t r = r0; r < r1; r++) {
            const float * x = row_ptr_flat(a, r);
            void * y = row_ptr_flat(dst, r);
            switch (dst->type) {
                case KVR_TYPE_F32:  memcpy(y, x, (size_t)n * sizeof(float)); break;
                case KVR_TYPE_F16:  f16_from_float(x, y, n);  break;
                case KVR_TYPE_BF16: bf16_from_float(x, y, n); break;
                case KVR_TYPE_Q8_0:
                    for (int64_t b = 0; b < n / 32; b++) kvr_kv_quant_q8_0(x + 32 * b, (struct kvr_block_q8_0 *)y + b);
                    break;
                default: KVR_ASSERT(!"cpy: no such destination type");
            }
        }
    } else {
        KVR_ASSERT(dst->type == KVR_TYPE_F32 || dst->type == KVR_TYPE_F16);
        KVR_ASSERT(kvr_is_contiguous(dst));
        for (int64_t r = r0; r < r1; r++) {
            const float * x = row_ptr_flat(a, r);
            if (dst->type == KVR_TYPE_F32) memcpy((float *)dst->data + r * n, x, (size_t)n * sizeof(float));
            else f16_from_float(x, (uint16_t *)dst->data + r * n, n);
        }
    }
}

// Attention of small shapes in llama.cpp's arithmetic (flash attention off, F32 cache), so the
// small references agree to the last bits: KQ = mul_mat(K, Q) is one ggml_vec_dot_f32 per score,
// soft_max_ext scales the scores, masks them, subtracts the row max, takes ggml_v_expf of 8 keys
// at a time (their float sum, as its horizontal add, summed in double), multiplies by 1/sum; then
// KQV = mul_mat(V^T, KQ) is one dot over the keys per output value, in tinyBLAS's order for a batch
// and ggml_vec_dot_f32's for one query (mm_tinyblas_order). Key j stands for the cache cell j
// llama.cpp would use (a prompt on an empty cache puts token j there), and the keys are padded with
// masked ones to a multiple of 32, as llama.cpp's KV view is padded: masked keys add exact zeros.
// Above this many scores per head the tiled kernel below runs (same math, its own summation).
#define KVR_ATTN_EXACT_MAX_SCORES ((int64_t)1 << 14)

static bool attn_exact(int64_t Tq, int64_t Tk) {
    return Tq * Tk <= KVR_ATTN_EXACT_MAX_SCORES;
}

// What an ATTN node of Tq queries over Tk keys runs: as its shape says, or as kvr_attn_kernel_as set
static bool attn_node_exact(const struct kvr_tensor * t, int64_t Tq, int64_t Tk) {
    return t->op_params[5] ? t->op_params[5] == 1 : attn_exact(Tq, Tk);
}

struct kvr_tensor * kvr_attn_kernel_as(struct kvr_tensor * t, int64_t tq, int64_t tk) {
    KVR_ASSERT(t->op == KVR_OP_ATTN);
    t->op_params[5] = attn_exact(tq, tk) ? 1 : 2;
    return t;
}

bool kvr_attn_cpu_exact(int64_t Tq, int64_t Tk) {
    return attn_exact(Tq, Tk);
}

static int64_t attn_exact_keys(int64_t Tk) {
    return (Tk + 31) & ~(int64_t)31;
}

// expf as ggml_v_expf computes it on AVX2 (range reduction by 2^n with n = round(x/ln2), ln2 in
// two parts, a degree-5 polynomial, and the scaling done in two steps where 2^n leaves the normal
// range), one value at a time: the fused steps are fmaf, so the bits are the same on any machine.
static float expf_ggml(float x) {
    const float shift = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, shift);
    const float n = z - shift;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = kvr_bits_of_f32(z) << 23;
    const float k = kvr_f32_of_bits(e + kvr_bits_of_f32(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, 0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = kvr_f32_of_bits(g + 0x7f000000u), s2 = kvr_f32_of_bits(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

#if defined(__AVX2__) && defined(__FMA__)
// expf_ggml of 8 values: the same operations lane by lane (fnmadd is the fmaf of -n), so the same
// bits; *slow has bit l set where lane l needs the scaling past 2^126 (|n| > 126), which this
// leaves to the scalar function.
static inline __m256 expf_ggml8(__m256 x, int * slow) {
    const __m256 shift = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), shift);
    const __m256 n = _mm256_sub_ps(z, shift);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(z), 23),
                                                          _mm256_castps_si256(_mm256_set1_ps(1.0f))));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                                                     _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
                                     u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
    *slow = _mm256_movemask_ps(_mm256_cmp_ps(an, _mm256_set1_ps(126.0f), _CMP_NLE_UQ)); // !(|n| <= 126), NaN too
    return _mm256_fmadd_ps(j, k, k);
}
#endif

// expf as ggml_v_expf computes it on AVX-512 (kvr_backend_params.avx512_order): the same range
// reduction and polynomial, but the polynomial's last step adds the 1 itself and 2^n scales the
// result exactly (_mm512_scalef_ps); |n| > 192 gives 0 or infinity.
static float expf_ggml16(float x) {
    const float shift = 0x1.8p23f;
    const float n = fmaf(x, 0x1.715476p+0f, shift) - shift;
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    return ldexpf(j, (int)n);
}

// out[d] = dot_f32_ggml(P, V^T row d, Tkp) for every d, bit for bit, without transposing V: that
// dot keeps 32 running sums, element j going to sum j % 32 by a fused multiply-add in the order of
// j, then adds them up in a fixed tree. Here the 32 sums of every d are kept at once (A[c][d], c =
// j % 32, in L1) and each key's row of V, read in order where it lies, is one multiply-add over d;
// the padding keys (j >= Tk) multiply zeros as the transposed copy's zeros would. The same
// operations on the same values in the same order: the same bits, without the transpose (which
// cost more than the rest at a few thousand keys: its writes stride over D rows).
// A typed cache's value row (vtype not F32) is turned into f32 in vx (D floats) first.
static void attn_exact_pv(const float * P, const uint8_t * V, size_t ldv, enum kvr_type vtype, int64_t Tk, int64_t Tkp, int64_t D,
                          float * A, float * vx, float * out) {
    // the sums a key reaches: with fewer than 32 keys (an F16 cache's, no padding key weighted) the
    // sums from Tk on stay +0 and are neither cleared nor read: x + +0 is x for every x a sum can
    // be (one that starts at +0 is never -0), so the tree below gives the same bits without them
    int64_t rows = 32;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (vtype == KVR_TYPE_F16 && Tk < 32) {
        rows = Tk;
        for (int64_t j = Tk; j < Tkp; j++) rows = P[j] != 0.0f ? 32 : rows;
    }
#endif
    for (int64_t i = 0; i < rows * D; i++) A[i] = 0.0f;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    // an F16 cache's row widened in registers (the same values attn_row_f32 would store)
    for (int64_t j = 0; vtype == KVR_TYPE_F16 && j < Tk; j++) {
        const uint16_t * vh = (const uint16_t *)(V + j * ldv);
        float * a = A + (j % 32) * D;
        const __m256 pj = _mm256_set1_ps(P[j]);
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vh + d)));
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pj, vv, _mm256_loadu_ps(a + d)));
        }
        for (; d < D; d++) a[d] = fmaf(P[j], kvr_half_to_f32(vh[d]), a[d]);
    }
    // padding: P[j] times zeros, which leaves a sum as it is where P[j] is 0 (a sum that starts at
    // +0 never becomes -0), as it is for every key past Tk (the softmax gives them 0)
    for (int64_t j = Tk; vtype == KVR_TYPE_F16 && j < Tkp; j++) {
        if (P[j] == 0.0f) continue;
        float * a = A + (j % 32) * D;
        for (int64_t d = 0; d < D; d++) a[d] = fmaf(P[j], 0.0f, a[d]);
    }
    for (int64_t j = 0; vtype != KVR_TYPE_F16 && j < Tkp; j++) {
#else
    for (int64_t j = 0; j < Tkp; j++) {
#endif
        const float * vj = j < Tk ? (const float *)(V + j * ldv) : NULL;
        if (vj && vtype != KVR_TYPE_F32) {
            attn_row_f32(vtype, vj, vx, D);
            vj = vx;
        }
        float * a = A + (j % 32) * D;
        int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 pj = _mm256_set1_ps(P[j]);
        for (; d + 8 <= D; d += 8) {
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pj, vj ? _mm256_loadu_ps(vj + d) : _mm256_setzero_ps(), _mm256_loadu_ps(a + d)));
        }
#endif
        for (; d < D; d++) a[d] = fmaf(P[j], vj ? vj[d] : 0.0f, a[d]);
    }
    int64_t d = 0;
#if defined(__AVX2__)
    // the same sums in the same order for 8 values of d at once (each lane one d)
#define KVR_A8(c) ((c) < rows ? _mm256_loadu_ps(A + (c) * D + d) : _mm256_setzero_ps())
    for (; d + 8 <= D; d += 8) {
        __m256 l[8];
        for (int c = 0; c < 8; c++) {
            l[c] = _mm256_add_ps(_mm256_add_ps(KVR_A8(c), KVR_A8(16 + c)), _mm256_add_ps(KVR_A8(8 + c), KVR_A8(24 + c)));
        }
#undef KVR_A8
        const __m256 h0 = _mm256_add_ps(l[0], l[4]), h1 = _mm256_add_ps(l[1], l[5]), h2 = _mm256_add_ps(l[2], l[6]), h3 = _mm256_add_ps(l[3], l[7]);
        _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_add_ps(h0, h1), _mm256_add_ps(h2, h3)));
    }
#endif
    for (; d < D; d++) {
        float l[8];
#define KVR_A1(c) ((c) < rows ? A[(c) * D + d] : 0.0f)
        for (int c = 0; c < 8; c++) l[c] = (KVR_A1(c) + KVR_A1(16 + c)) + (KVR_A1(8 + c) + KVR_A1(24 + c));
#undef KVR_A1
        const float h0 = l[0] + l[4], h1 = l[1] + l[5], h2 = l[2] + l[6], h3 = l[3] + l[7];
        out[d] = (h0 + h1) + (h2 + h3);
    }
}

static void cpu_op_attn_exact(const struct cpu_params * p, struct kvr_tensor * dst, int64_t Tk) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const int mode = dst->op_params[0];
    const float scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4);
    const int64_t W = dst->op_params[3];
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1];
    const int64_t G = H / Hkv, BT = kvr_attn_tile_tokens(G), n_qt = (Tq + BT - 1) / BT;
    const int64_t row_len = dst->ne[0], Tkp = attn_exact_keys(Tk);
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL; // kvr_attn_sinks
    const dot_f32_fn dot_kv = mm_dot_order(Tkp, D, Tq, p);
    // KQ: one ggml_vec_dot per score (an F32 cache: Q, a permuted view, is no operand tinyBLAS takes);
    // an F16 cache's product converts Q to F16 first, a contiguous copy, which tinyBLAS takes
    const dot_f32_fn dot_kq = mm_dot_order(D, Tkp, k->type == KVR_TYPE_F16 ? Tq : 1, p);
    // In ggml_vec_dot_f32's order (one query, or --vec-dot-order) the values need no transpose:
    // see attn_exact_pv. tinyBLAS's order dots rows of V^T: this KV head's values transposed (and
    // turned to f32 on the way for a typed cache).
    const bool by_rows = dot_kv == dot_f32_ggml;
    float * VT = p->wdata;                     // [D, Tkp] V^T, or [32, D] attn_exact_pv's sums
    float * P = VT + D * Tkp;                  // [Tkp] one row's probabilities
    KVR_ASSERT((size_t)((D + 1) * Tkp) <= p->wsize); // Tkp >= 32 where a key is seen: room for A too
    // a typed cache (an F16 or BF16 one; Q8_0 runs cpu_op_attn_online): a rounded query, a key row, a value row
    float * X = p->wdata + p->wsize - attn_typed_floats(D), * qx = X, * kx = X + D, * vx = X + 2 * D;
    KVR_ASSERT(!attn_typed(dst) || (size_t)((D + 1) * Tkp) + attn_typed_floats(D) <= p->wsize);

    int64_t dot_dense = 0, dot_causal = 0;
    // the work items: a KV head (V^T is made once for its G query heads) or a query head, of a
    // tile of queries; the counters are the tiled kernel's (what its tiles would compute)
    const int64_t n_heads = by_rows ? H : Hkv;
    // by query head, a thread takes a run of heads: those of one KV head read its rows from memory
    // once and from its cache after (strided, every thread would read every KV head's rows)
    int64_t it0 = p->ith, it1 = n_heads * n_qt, step = p->nth;
    if (by_rows) {
        row_range(n_heads * n_qt, p->ith, p->nth, &it0, &it1);
        step = 1;
    }
    for (int64_t item = it0; item < it1; item += step) {
        const int64_t hi = item % n_heads, qt = item / n_heads;
        const int64_t g = by_rows ? hi / G : hi;
        const int64_t h0 = by_rows ? hi : g * G, h1 = by_rows ? hi + 1 : (g + 1) * G;
        const bool lead = !by_rows || hi % G == 0 || item == it0; // the first of its KV head's query heads here
        (void)lead; // (a prefetch of the AVX2 build's)
        const int64_t i0 = qt * BT, bt = (i0 + BT <= Tq) ? BT : Tq - i0;
        if (hi == 0) attn_count_tile(mode, qpos + i0, bt, kpos, Tk, W, &dot_dense, &dot_causal);
#if defined(__AVX2__)
        for (int64_t j = 0; lead && j < 8 && j < Tk; j++) attn_prefetch(attn_kv_row(k, g, j), (size_t)k->nb[0] * (size_t)D); // the first keys
#endif
        for (int64_t j = 0; !by_rows && j < Tkp; j++) {
            const float * vj = j < Tk ? (const float *)attn_kv_row(v, g, j) : NULL;
            if (vj && v->type != KVR_TYPE_F32) {
                attn_row_f32(v->type, vj, kx, D);
                vj = kx;
            }
            for (int64_t d = 0; d < D; d++) VT[d * Tkp + j] = vj ? vj[d] : 0.0f;
        }
        for (int64_t i = i0; i < i0 + bt; i++) {
            const int32_t qp = qpos[i];
            for (int64_t h = h0; h < h1; h++) {
                const float * qr = (const float *)((const uint8_t *)q->data + h * q->nb[1] + i * q->nb[2]);
                float * out = (float *)dst->data + i * row_len;
                if (k->type != KVR_TYPE_F32) { // llama.cpp's mul_mat(K, Q) with F16 K: Q in F16
                    attn_q_as(k->type, qr, qx, D);
                    qr = qx;
                }
                float mx = -INFINITY;
                for (int64_t j = 0; j < Tkp; j++) {
                    P[j] = -INFINITY;
                    if (j >= Tk || !kvr_attn_visible(qp, kpos[j], W)) continue;
                    const float * kj = (const float *)attn_kv_row(k, g, j);
#if defined(__AVX2__)
                    // the KV head's first query head brings its rows in; the others find them in cache
                    // (and the value rows, which the products read after the softmax)
                    if (lead && h == h0 && j + 8 < Tk) attn_prefetch(attn_kv_row(k, g, j + 8), (size_t)k->nb[0] * (size_t)D);
                    if (lead && h == h0 && by_rows) attn_prefetch(attn_kv_row(v, g, j), (size_t)v->nb[0] * (size_t)D);
#endif
                    float sc;
                    if (k->type == KVR_TYPE_F16 && dot_kq == dot_f32_ggml) {
                        sc = dot_f32_f16_ggml(qr, (const uint16_t *)kj, D);
                    } else {
                        if (k->type != KVR_TYPE_F32) {
                            attn_row_f32(k->type, kj, kx, D);
                            kj = kx;
                        }
                        sc = dot_kq(qr, kj, D);
                    }
                    P[j] = kvr_softcap_f32(sc * scale, cap);
                    if (P[j] > mx) mx = P[j];
                }
                if (mx == -INFINITY) { // no key visible: O = 0, LSE = -inf (or the sink's logit)
                    for (int64_t d = 0; d < D; d++) out[h * D + d] = 0.0f;
                    out[D * H + h] = sink ? sink[h] : -INFINITY;
                    continue;
                }
                // a sink joins the max and the denominator, as ggml's soft_max with sinks
                if (sink && sink[h] > mx) mx = sink[h];
                double sum = 0.0;
                for (int64_t j0 = 0; j0 < Tkp && p->lanes16; j0 += 16) { // Tkp: a multiple of 32
                    float e[16];
                    for (int l = 0; l < 16; l++) e[l] = P[j0 + l] == -INFINITY ? 0.0f : expf_ggml16(P[j0 + l] - mx);
                    sum += (double)reduce_add16(e);
                    memcpy(P + j0, e, sizeof(e));
                }
                for (int64_t j0 = 0; j0 < Tkp && !p->lanes16; j0 += 8) {
                    float e[8];
                    int slow = 1;
#if defined(__AVX2__) && defined(__FMA__)
                    const __m256 pv = _mm256_loadu_ps(P + j0), masked = _mm256_cmp_ps(pv, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
                    const __m256 ev = expf_ggml8(_mm256_sub_ps(pv, _mm256_set1_ps(mx)), &slow);
                    _mm256_storeu_ps(e, _mm256_andnot_ps(masked, ev)); // a masked key (-inf) gives 0
                    slow &= ~_mm256_movemask_ps(masked);
#endif
                    if (slow) { // a seen key past the fast scaling's range (or no vectors): all 8 one by one
                        for (int l = 0; l < 8; l++) e[l] = P[j0 + l] == -INFINITY ? 0.0f : expf_ggml(P[j0 + l] - mx);
                    }
                    float h4[4];
                    for (int l = 0; l < 4; l++) h4[l] = e[l + 4] + e[l];
                    sum += (double)((h4[0] + h4[2]) + (h4[1] + h4[3]));
                    memcpy(P + j0, e, sizeof(e));
                }
                if (sink) sum += (double)expf(sink[h] - mx);
                const float inv = (float)(1.0 / sum);
                for (int64_t j = 0; j < Tkp; j++) P[j] *= inv;
                // mul_mat(V^T, KQ) with F16 V: the probabilities in F16
                if (v->type != KVR_TYPE_F32) attn_round_to(v->type, P, Tkp);
                if (by_rows) {
                    attn_exact_pv(P, (const uint8_t *)v->data + g * v->nb[1], v->nb[2], v->type, Tk, Tkp, D, VT, vx, out + h * D);
                } else {
                    for (int64_t d = 0; d < D; d++) out[h * D + d] = dot_kv(P, VT + d * Tkp, Tkp);
                }
                out[D * H + h] = mx + logf((float)sum);
            }
        }
    }
    p->counters->attn_dot_dense  += dot_dense;
    p->counters->attn_dot_causal += dot_causal;
}

// Attention of small shapes over a Q8_0 cache (K or V) in llama.cpp's arithmetic for it, its CPU
// flash attention (which llama.cpp needs for a quantized V): per (query, head) the query quantized
// to Q8_0 (F16/BF16 keys: rounded to that type), each visible key's score by the Q8_0 dot times
// the scale, an online softmax key by key (a new maximum rescales the sum and the output by expf of
// the step), the value row turned to f32 and added with its weight, the output divided by the sum.
static void cpu_op_attn_online(const struct cpu_params * p, struct kvr_tensor * dst, int64_t Tk) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const float scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4); // cap: soft-capping (0: none)
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL; // kvr_attn_sinks
    const int64_t W = dst->op_params[3];
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], G = H / k->ne[1];
    KVR_ASSERT(attn_typed_floats(D) <= p->wsize);
    float * qx = p->wdata, * kx = qx + D, * vx = kx + D, * acc = vx + D;
    struct kvr_block_q8_0 * qq = (struct kvr_block_q8_0 *)(acc + D); // D/32 blocks: under D floats
    int64_t r0, r1;
    row_range(Tq * H, p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i = r / H, h = r % H, g = h / G;
        const float * qr = row_ptr(q, h, i, 0);
        float * out = row_ptr(dst, i, 0, 0);
        if (k->type == KVR_TYPE_Q8_0) {
            for (int64_t b = 0; b < D / 32; b++) kvr_kv_quant_q8_0(qr + 32 * b, qq + b);
        } else {
            attn_q_as(k->type, qr, qx, D);
        }
        float M = -INFINITY, S = 0.0f;
        for (int64_t e = 0; e < D; e++) acc[e] = 0.0f;
        for (int64_t j = 0; j < Tk; j++) {
            if (!kvr_attn_visible(qpos[i], kpos[j], W)) continue;
            float sc;
            if (k->type == KVR_TYPE_Q8_0) {
                sc = kvr_kv_dot_q8_0(attn_kv_row(k, g, j), qq, (int)D);
            } else {
                attn_row_f32(k->type, attn_kv_row(k, g, j), kx, D);
                sc = 0.0f;
                for (int64_t e = 0; e < D; e++) sc += qx[e] * kx[e];
            }
            sc = kvr_softcap_f32(sc * scale, cap);
            float ms = 1.0f, vs = 1.0f;
            if (sc > M) {
                const float m_old = M;
                M = sc;
                ms = expf(m_old - M);
                for (int64_t e = 0; e < D; e++) acc[e] *= ms;
            } else {
                vs = expf(sc - M);
            }
            attn_row_f32(v->type, attn_kv_row(v, g, j), vx, D);
            for (int64_t e = 0; e < D; e++) acc[e] = fmaf(vx[e], vs, acc[e]); // ggml_vec_mad_f32: fused
            S = fmaf(S, ms, vs); // ggml's S = S*ms + vs, which its build contracts to a fused multiply-add
        }
        if (sink) { // the sink's logit: one more term of the denominator, no value (as ggml's, after the keys)
            float ms = 1.0f, vs = 1.0f;
            if (sink[h] > M) {
                ms = expf(M - sink[h]);
                for (int64_t e = 0; e < D; e++) acc[e] *= ms;
                M = sink[h];
            } else {
                vs = expf(sink[h] - M);
            }
            S = fmaf(S, ms, vs);
        }
        if (S == 0.0f) { // no key visible: O = 0, LSE = -inf
            for (int64_t e = 0; e < D; e++) out[h * D + e] = 0.0f;
            out[D * H + h] = -INFINITY;
            continue;
        }
        const float inv = 1.0f / S;
        for (int64_t e = 0; e < D; e++) out[h * D + e] = acc[e] * inv;
        out[D * H + h] = M + logf(S);
    }
    if (p->ith == 0) {
        attn_count(dst->op_params[0], qpos, Tq, kvr_attn_tile_tokens(G), kpos, Tk, W,
                   &p->counters->attn_dot_dense, &p->counters->attn_dot_causal);
    }
}

#if !defined(__AVX512F__)
// Attention of larger shapes, flash-style: per KV head and tile of queries, the scores of a tile of
// keys by one sgemm, an online softmax (kvr_softmax_*), the output by a second sgemm; tiles no
// query sees are skipped (kvr_attn_tile).
static void cpu_op_attn_tiled(const struct cpu_params * p, struct kvr_tensor * dst, int64_t Tk) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const int mode = dst->op_params[0];
    const float scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4); // cap: soft-capping (0: none)
    const int64_t W = dst->op_params[3];       // sliding window (0: none): key j seen iff qp-W < kp <= qp
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1];
    const int64_t G = H / Hkv;                 // query heads per KV head
    const int64_t BT = kvr_attn_tile_tokens(G);    // tokens per query tile
    const int64_t row_len = dst->ne[0];        // D*H + H
    const int64_t n_qt = (Tq + BT - 1) / BT;
    const int ldk = (int)(k->nb[2] / sizeof(float)); // an f32 cache's (a typed one's tiles: D)
    const int ldv = (int)(v->nb[2] / sizeof(float));
    const int64_t R = BT * G;                  // rows of a tile: (token, head) token-major
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL; // kvr_attn_sinks

    float * Q = p->wdata;                      // [R, D] the tile's queries, gathered
    float * S = Q + R * D;                     // [R, BK] scores, then probabilities
    float * O = S + R * KVR_ATTN_BK;               // [R, D] running output
    float * M = O + R * D;                     // [R] running max
    float * L = M + R;                         // [R] running sum
    KVR_ASSERT((size_t)(R * (2 * D + KVR_ATTN_BK + 2)) <= p->wsize);
    // a typed cache: the tile's keys and values turned to f32 (a tile at a time, never the cache)
    const bool typed = attn_typed(dst);
    float * Kc = p->wdata + p->wsize - attn_typed_floats(D), * Vc = Kc + KVR_ATTN_BK * D;
    KVR_ASSERT(!typed || (size_t)(R * (2 * D + KVR_ATTN_BK + 2)) + attn_typed_floats(D) <= p->wsize);

    int64_t dot_dense = 0, dot_causal = 0;
    // work items are (KV head, query tile), dealt round-robin so causal tiles of all lengths mix
    for (int64_t item = p->ith; item < Hkv * n_qt; item += p->nth) {
        const int64_t g = item % Hkv, qt = item / Hkv;
        const int64_t i0 = qt * BT, bt = (i0 + BT <= Tq) ? BT : Tq - i0, rows = bt * G;
        int32_t qmin = INT32_MAX, qmax = INT32_MIN;
        for (int64_t i = 0; i < bt; i++) {
            if (qpos[i0 + i] < qmin) qmin = qpos[i0 + i];
            if (qpos[i0 + i] > qmax) qmax = qpos[i0 + i];
        }
        for (int64_t i = 0; i < bt; i++) { // the G heads of one token are adjacent in q's rows
            const float * src = (const float *)((const uint8_t *)q->data + (g * G) * q->nb[1] + (i0 + i) * q->nb[2]);
            for (int64_t hh = 0; hh < G; hh++) {
                memcpy(Q + (i * G + hh) * D, (const uint8_t *)src + hh * q->nb[1], sizeof(float) * (size_t)D);
                if (k->type != KVR_TYPE_F32) attn_q_as(k->type, Q + (i * G + hh) * D, Q + (i * G + hh) * D, D);
            }
        }
        for (int64_t r = 0; r < rows; r++) { M[r] = -INFINITY; L[r] = 0.0f; }
        memset(O, 0, sizeof(float) * (size_t)(rows * D));

        for (int64_t j0 = 0; j0 < Tk; j0 += KVR_ATTN_BK) {
            const int64_t bk = (j0 + KVR_ATTN_BK <= Tk) ? KVR_ATTN_BK : Tk - j0;
            int32_t kmin = INT32_MAX, kmax = INT32_MIN;
            for (int64_t j = 0; j < bk; j++) {
                if (kpos[j0 + j] < kmin) kmin = kpos[j0 + j];
                if (kpos[j0 + j] > kmax) kmax = kpos[j0 + j];
            }
            // skipped: every key is after every query, or before the window of every query
            const int tile = kvr_attn_tile(mode, qmin, qmax, kmin, kmax, W);
            if (tile == 0) continue;
            const bool need_mask = tile == 2;
            const float * Kt = (const float *)attn_kv_row(k, g, j0);
            const float * Vt = (const float *)attn_kv_row(v, g, j0);
            int ldkt = ldk, ldvt = ldv;
            if (k->type != KVR_TYPE_F32) {
                for (int64_t j = 0; j < bk; j++) attn_row_f32(k->type, attn_kv_row(k, g, j0 + j), Kc + j * D, D);
                Kt = Kc;
                ldkt = (int)D;
            }
            if (v->type != KVR_TYPE_F32) {
                for (int64_t j = 0; j < bk; j++) attn_row_f32(v->type, attn_kv_row(v, g, j0 + j), Vc + j * D, D);
                Vt = Vc;
                ldvt = (int)D;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)bk, (int)D,
                        scale, Q, (int)D, Kt, ldkt, 0.0f, S, (int)bk);
            if (g == 0) dot_dense += bt * bk;
            for (int64_t r = 0; r < rows; r++) {
                float * s = S + r * bk;
                const int32_t qp = qpos[i0 + r / G];
                int64_t seen = bk;
                if (cap > 0.0f) for (int64_t j = 0; j < bk; j++) s[j] = kvr_softcap_f32(s[j], cap);
                if (need_mask) {
                    seen = 0;
                    for (int64_t j = 0; j < bk; j++) {
                        if (!kvr_attn_visible(qp, kpos[j0 + j], W)) s[j] = -INFINITY;
                        else seen++;
                    }
                }
                if (g == 0 && r % G == 0) dot_causal += seen;
                const float mx = vec_max(s, bk);
                if (mx == -INFINITY) { // nothing visible for this row in this tile
                    memset(s, 0, sizeof(float) * (size_t)bk);
                    continue;
                }
                const float m_new = kvr_softmax_max(M[r], mx);
                const float corr = kvr_softmax_step(&M[r], &L[r], m_new, vec_exp_sub_sum(s, bk, m_new));
                if (corr != 1.0f) {
                    float * o = O + r * D;
                    for (int64_t d = 0; d < D; d++) o[d] *= corr;
                }
            }
            if (v->type == KVR_TYPE_F16 || v->type == KVR_TYPE_BF16) attn_round_to(v->type, S, rows * bk); // the weights in that type
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)D, (int)bk,
                        1.0f, S, (int)bk, Vt, ldvt, 1.0f, O, (int)D);
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = r / G, h = g * G + r % G;
            float * out = (float *)dst->data + (i0 + i) * row_len;
            float * lse = out + D * H + h;
            float inv;
            if (sink) { // the sink's logit as one more key with no value
                const float corr = kvr_softmax_step(&M[r], &L[r], kvr_softmax_max(M[r], sink[h]), 0.0f);
                L[r] += expf(sink[h] - M[r]);
                if (corr != 1.0f) {
                    for (int64_t d = 0; d < D; d++) O[r * D + d] *= corr;
                }
            }
            kvr_softmax_finish(M[r], L[r], &inv, lse); // a row that saw no key: O = 0, LSE = -inf
            if (inv != 0.0f) {
                for (int64_t d = 0; d < D; d++) out[h * D + d] = O[r * D + d] * inv;
            } else {
                for (int64_t d = 0; d < D; d++) out[h * D + d] = 0.0f;
            }
        }
    }
    p->counters->attn_dot_dense  += dot_dense;
    p->counters->attn_dot_causal += dot_causal;
}

#endif

#if defined(__AVX512F__)
// The prefill attention on AVX-512: the tiled kernel's arithmetic (scores of the rounded queries
// times the keys, scaled; an online softmax over blocks of keys; the unnormalized probabilities
// rounded to an F16/BF16 V's type; the output divided by the sum at the end) with the queries in
// the lanes. A work item is one KV head and ATTN_LANES_TOKENS(G) tokens: its R = tokens x G rows
// (token, head) are 16-lane vectors, held transposed (Qt [D][R], the running output Ot [D][R]), so
// the softmax's max, exp, sum and rescaling of a block run down the lanes with no horizontal step,
// and both products are register-tiled FMAs of a broadcast value with 16 rows at once: scores
// St [key][R] = K_block Q^T, then Ot += V_block^T P. K and V are turned into f32 a block of
// ATTN_LANES_BK keys at a time, once for all the G heads and the tokens of the item. A block of
// keys no query of the item sees is skipped (kvr_attn_tile over the item's and the block's
// positions), so a causal diagonal or a sliding window (Gemma 3's 512) computes little more than
// the pairs it needs. Items are taken from the node's counter, the longest (the last queries of a
// causal prompt) first, so a thread that runs late does fewer. Summation order: each score is one
// chain of FMAs over d, each output value one over the keys of a block; the result moves from the
// sgemm's by rounding only (test-ops' FAST_REF tolerances).
#define ATTN_LANES_BK 32
#define ATTN_LANES_RM 4  // rows of a register tile (keys of St, values d of Ot)
#define ATTN_LANES_RN 4  // 16-lane vectors of a register tile (64 query rows)

static int64_t attn_lanes_tokens(int64_t G) {
    return G >= 4 ? 16 : 16 * (4 / G); // R = tokens x G: a multiple of 16, 48 to 64 rows for G <= 4
}

// Floats of scratch the lanes kernel takes (rows R rounded up to 16 lanes).
static size_t attn_lanes_floats(int64_t D, int64_t G) {
    const int64_t R = attn_lanes_tokens(G) * G;
    return (size_t)(R * (2 * D + ATTN_LANES_BK + 4) + 2 * ATTN_LANES_BK * D + 64);
}


// One register tile: for RM rows m and RN vectors n of 16 lanes, over k < K,
//   acc[m][n] = sum_k A[m*am + k*ak] * B[k*ldb + 16n]   (one FMA chain, in the order of k)
// then C[m*ldc + 16n] = acc * s (cs NULL), or C = C * cs[16n] + acc (the running output, rescaled).
static inline __attribute__((always_inline)) void attn_lanes_tile(const int RM, const int RN, int64_t K, const float * A,
                                                                  int64_t am, int64_t ak, const float * B, int64_t ldb,
                                                                  float * C, int64_t ldc, const float * cs, float s) {
    __m512 acc[ATTN_LANES_RM][ATTN_LANES_RN];
#pragma GCC unroll 4
    for (int m = 0; m < RM; m++) {
#pragma GCC unroll 4
        for (int n = 0; n < RN; n++) {
            acc[m][n] = cs ? _mm512_mul_ps(_mm512_loadu_ps(C + m * ldc + 16 * n), _mm512_loadu_ps(cs + 16 * n)) : _mm512_setzero_ps();
        }
    }
    for (int64_t k = 0; k < K; k++) {
        __m512 b[ATTN_LANES_RN];
#pragma GCC unroll 4
        for (int n = 0; n < RN; n++) b[n] = _mm512_loadu_ps(B + k * ldb + 16 * n);
#pragma GCC unroll 4
        for (int m = 0; m < RM; m++) {
            const __m512 a = _mm512_set1_ps(A[m * am + k * ak]);
#pragma GCC unroll 4
            for (int n = 0; n < RN; n++) acc[m][n] = _mm512_fmadd_ps(a, b[n], acc[m][n]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < RM; m++) {
#pragma GCC unroll 4
        for (int n = 0; n < RN; n++) {
            _mm512_storeu_ps(C + m * ldc + 16 * n, cs ? acc[m][n] : _mm512_mul_ps(acc[m][n], _mm512_set1_ps(s)));
        }
    }
}

// C [M][R] (row stride ldc) from A and B as attn_lanes_tile says, for every m < M and all R lanes
// (nv vectors), in register tiles of ATTN_LANES_RM x ATTN_LANES_RN.
static void attn_lanes_gemm(int64_t M, int64_t nv, int64_t K, const float * A, int64_t am, int64_t ak, const float * B,
                            int64_t ldb, float * C, int64_t ldc, const float * cs, float s) {
    for (int64_t v0 = 0; v0 < nv; v0 += ATTN_LANES_RN) {
        const int64_t rn = nv - v0 < ATTN_LANES_RN ? nv - v0 : ATTN_LANES_RN;
        const float * Bv = B + 16 * v0, * csv = cs ? cs + 16 * v0 : NULL;
        float * Cv = C + 16 * v0;
        int64_t m = 0;
        for (; m + ATTN_LANES_RM <= M; m += ATTN_LANES_RM) {
            const float * Am = A + m * am;
            float * Cm = Cv + m * ldc;
            switch (rn) {
                case 1:  attn_lanes_tile(ATTN_LANES_RM, 1, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                case 2:  attn_lanes_tile(ATTN_LANES_RM, 2, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                case 3:  attn_lanes_tile(ATTN_LANES_RM, 3, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                default: attn_lanes_tile(ATTN_LANES_RM, 4, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
            }
        }
        for (; m < M; m++) {
            const float * Am = A + m * am;
            float * Cm = Cv + m * ldc;
            switch (rn) {
                case 1:  attn_lanes_tile(1, 1, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                case 2:  attn_lanes_tile(1, 2, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                case 3:  attn_lanes_tile(1, 3, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
                default: attn_lanes_tile(1, 4, K, Am, am, ak, Bv, ldb, Cm, ldc, csv, s); break;
            }
        }
    }
}

static void cpu_op_attn_lanes(const struct cpu_params * p, struct kvr_tensor * dst, int64_t Tk) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const int mode = dst->op_params[0];
    const float scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4); // cap: soft-capping (0: none)
    const int64_t W = dst->op_params[3];       // sliding window (0: none): key j seen iff qp-W < kp <= qp
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1], G = H / Hkv;
    const int64_t BT = attn_lanes_tokens(G), R = BT * G, nv = R / 16, row_len = dst->ne[0];
    const int64_t n_qt = (Tq + BT - 1) / BT;
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL; // kvr_attn_sinks
    const bool round_p = v->type == KVR_TYPE_F16 || v->type == KVR_TYPE_BF16;
    KVR_ASSERT(R % 16 == 0 && attn_lanes_floats(D, G) <= p->wsize);

    float * Qt = p->wdata;                     // [D][R] the item's queries, rounded as K's type needs
    float * Ot = Qt + D * R;                   // [D][R] running output
    float * St = Ot + D * R;                   // [BK][R] scores, then probabilities
    float * M = St + ATTN_LANES_BK * R;        // [R] running max
    float * L = M + R;                         // [R] running sum
    float * C = L + R;                         // [R] this block's rescaling of Ot
    int32_t * qp = (int32_t *)(C + R);         // [R] each row's position
    float * Kb = (float *)(qp + R);            // [BK][D] the block's keys in f32
    float * Vb = Kb + ATTN_LANES_BK * D;       // [BK][D] its values

    // the counters are the tiled kernel's (kvr.h's tiles), shared among the threads
    const int64_t BTc = kvr_attn_tile_tokens(G);
    for (int64_t i0 = p->ith * BTc; i0 < Tq; i0 += p->nth * BTc) {
        attn_count_tile(mode, qpos + i0, i0 + BTc <= Tq ? BTc : Tq - i0, kpos, Tk, W,
                        &p->counters->attn_dot_dense, &p->counters->attn_dot_causal);
    }
    const struct mm_chunks items = { p->chunk, 1 };
    int64_t item, item1;
    while (mm_chunk_next(&items, Hkv * n_qt, &item, &item1)) {
        const int64_t g = item % Hkv, qt = n_qt - 1 - item / Hkv; // the last (causal: longest) query tiles first
        const int64_t i0 = qt * BT, bt = (i0 + BT <= Tq) ? BT : Tq - i0;
        int32_t qmin = INT32_MAX, qmax = INT32_MIN;
        for (int64_t i = 0; i < bt; i++) {
            if (qpos[i0 + i] < qmin) qmin = qpos[i0 + i];
            if (qpos[i0 + i] > qmax) qmax = qpos[i0 + i];
        }
        // a query row, rounded, spread into Qt's column; the rows past a short last tile are zeros
        // of position 0: lanes of their own, computed and never written out
        float * qx = Kb;
        for (int64_t r = 0; r < R; r++) {
            const int64_t i = r / G, h = g * G + r % G;
            M[r] = -INFINITY;
            L[r] = 0.0f;
            qp[r] = i < bt ? qpos[i0 + i] : 0;
            if (i < bt) {
                memcpy(qx, row_ptr(q, h, i0 + i, 0), sizeof(float) * (size_t)D);
                if (k->type == KVR_TYPE_Q8_0) attn_q_as(k->type, qx, qx, D);
                else if (k->type != KVR_TYPE_F32) attn_round_to(k->type, qx, D);
            } else {
                memset(qx, 0, sizeof(float) * (size_t)D);
            }
            for (int64_t d = 0; d < D; d++) Qt[d * R + r] = qx[d];
        }
        memset(Ot, 0, sizeof(float) * (size_t)(D * R));
        for (int64_t j0 = 0; j0 < Tk; j0 += ATTN_LANES_BK) {
            const int64_t bk = (j0 + ATTN_LANES_BK <= Tk) ? ATTN_LANES_BK : Tk - j0;
            int32_t kmin = INT32_MAX, kmax = INT32_MIN;
            for (int64_t j = 0; j < bk; j++) {
                if (kpos[j0 + j] < kmin) kmin = kpos[j0 + j];
                if (kpos[j0 + j] > kmax) kmax = kpos[j0 + j];
            }
            const int tile = kvr_attn_tile(mode, qmin, qmax, kmin, kmax, W);
            if (tile == 0) continue;
            const bool need_mask = tile == 2;
            for (int64_t j = 0; j < bk; j++) {
                attn_row_f32(k->type, attn_kv_row(k, g, j0 + j), Kb + j * D, D);
                attn_row_f32(v->type, attn_kv_row(v, g, j0 + j), Vb + j * D, D);
            }
            attn_lanes_gemm(bk, nv, D, Kb, D, 1, Qt, R, St, R, NULL, scale);
            if (cap > 0.0f) for (int64_t e = 0; e < bk * R; e++) St[e] = kvr_softcap_f32(St[e], cap);
            for (int64_t c = 0; c < nv; c++) {
                const __m512i qv = _mm512_loadu_si512(qp + 16 * c);
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int64_t j = 0; j < bk; j++) {
                    float * s = St + j * R + 16 * c;
                    __m512 x = _mm512_loadu_ps(s);
                    if (need_mask) {
                        // kp <= qp and, with a window, qp - kp < W (the difference of two int32
                        // with kp <= qp fits an unsigned 32-bit compare)
                        const __m512i kv = _mm512_set1_epi32(kpos[j0 + j]);
                        __mmask16 vis = _mm512_cmple_epi32_mask(kv, qv);
                        if (W > 0) vis = _mm512_mask_cmplt_epu32_mask(vis, _mm512_sub_epi32(qv, kv), _mm512_set1_epi32((int32_t)W));
                        x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis, x);
                        _mm512_storeu_ps(s, x);
                    }
                    mx = _mm512_max_ps(mx, x);
                }
                const __m512 m_old = _mm512_loadu_ps(M + 16 * c);
                const __m512 m_new = _mm512_max_ps(m_old, mx);
                // rows that have seen nothing yet subtract 0: their scores are -inf, e^-inf = 0
                const __mmask16 none = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                const __m512 m_sub = _mm512_mask_mov_ps(m_new, none, _mm512_setzero_ps());
                const __m512 corr = exp512(_mm512_sub_ps(m_old, m_sub)); // 0 while m_old was -inf
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < bk; j++) {
                    float * s = St + j * R + 16 * c;
                    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s), m_sub));
                    sum = _mm512_add_ps(sum, e);
                    if (round_p && v->type == KVR_TYPE_F16) {
                        e = _mm512_cvtph_ps(_mm512_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                    }
                    _mm512_storeu_ps(s, e);
                }
                _mm512_storeu_ps(L + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(L + 16 * c), corr, sum));
                _mm512_storeu_ps(M + 16 * c, m_new);
                _mm512_storeu_ps(C + 16 * c, corr);
            }
            if (round_p && v->type == KVR_TYPE_BF16) attn_round_to(v->type, St, bk * R);
            attn_lanes_gemm(D, nv, bk, Vb, 1, D, St, R, Ot, R, C, 1.0f);
        }
        for (int64_t r = 0; r < bt * G; r++) {
            const int64_t i = r / G, h = g * G + r % G;
            float * out = (float *)dst->data + (i0 + i) * row_len;
            float corr = 1.0f, inv;
            if (sink) { // the sink's logit as one more key with no value
                corr = kvr_softmax_step(&M[r], &L[r], kvr_softmax_max(M[r], sink[h]), 0.0f);
                L[r] += expf(sink[h] - M[r]);
            }
            kvr_softmax_finish(M[r], L[r], &inv, out + D * H + h); // a row that saw no key: O = 0, LSE = -inf
            for (int64_t d = 0; d < D; d++) out[h * D + d] = inv != 0.0f ? Ot[d * R + r] * corr * inv : 0.0f;
        }
    }
}
#endif

// The fast ATTN: small shapes in llama.cpp's arithmetic (their references agree to the last bits),
// larger ones tiled (ref_attn is the plain one).
static void cpu_op_attn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const int64_t Tk = attn_keys(dst->src[4]->data, dst->src[1]->ne[2]);
    const bool q8 = dst->src[1]->type == KVR_TYPE_Q8_0 || dst->src[2]->type == KVR_TYPE_Q8_0;
    if (attn_node_exact(dst, dst->src[0]->ne[2], Tk)) {
        if (q8) cpu_op_attn_online(p, dst, Tk);
        else    cpu_op_attn_exact(p, dst, Tk);
    } else {
#if defined(__AVX512F__)
        cpu_op_attn_lanes(p, dst, Tk);
#else
        cpu_op_attn_tiled(p, dst, Tk);
#endif
    }
}

static void cpu_op_merge_attn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const int n = dst->op_params[0];
    const int64_t H = dst->op_params[1];
    const float * sink = kvr_attn_sinks_of(dst) ? (const float *)kvr_attn_sinks_of(dst)->data : NULL;
    const int64_t row_len = dst->ne[0], D = (row_len - H) / H;
    int64_t r0, r1;
    row_range(dst->ne[1], p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        float * out = row_ptr(dst, r, 0, 0);
        for (int64_t h = 0; h < H; h++) {
            float m = -INFINITY;
            for (int i = 0; i < n; i++) {
                const float l = ((const float *)row_ptr(dst->src[i], r, 0, 0))[D * H + h];
                if (l > m) m = l;
            }
            float * o = out + h * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            if (m == -INFINITY) {
                out[D * H + h] = sink ? sink[h] : -INFINITY;
                continue;
            }
            // the sink, once, where every key's partial is in: one more term of the denominator
            if (sink && sink[h] > m) m = sink[h];
            float sum = sink ? kvr_lse_weight(sink[h], m) : 0.0f;
            for (int i = 0; i < n; i++) {
                const float * part = row_ptr(dst->src[i], r, 0, 0);
                const float w = kvr_lse_weight(part[D * H + h], m);
                if (w == 0.0f) continue; // an empty part
                sum += w;
                for (int64_t d = 0; d < D; d++) o[d] += w * part[h * D + d];
            }
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
            out[D * H + h] = kvr_lse_merged(m, sum);
        }
    }
}

// ATTN_STATS and ATTN_NORMED (kvr.h): a query's softmax spread over blocks of keys, rounded as
// one rank's ATTN rounds it (cpu_op_attn_exact: e^(s - M) by ggml's expf with the max M of every
// key, times (float)(1/S), to V's type). One kernel each, which the reference mode runs too.
// Threads take (query row, KV head) items; each key row is turned to f32 once for the G query
// heads that share it, and their scores over the block are kept ([G, Tk] floats of scratch).

// Query row i's scores with the keys of KV head g, sc[hh * Tk + j] for its heads g*G + hh (-inf
// where the key is hidden); the scores as cpu_op_attn_exact makes them. Returns whether any key is seen.
static bool attn_part_scores(const struct cpu_params * p, const struct kvr_tensor * dst, int64_t i, int64_t g, int64_t Tk,
                             float * qx, float * kx, float * sc) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const float scale = get_param_f32(dst, 2), cap = get_param_f32(dst, 4);
    const int64_t W = dst->op_params[3];
    const int64_t D = q->ne[0], G = q->ne[1] / k->ne[1];
    const dot_f32_fn dot = mm_dot_order(D, attn_exact_keys(Tk), k->type == KVR_TYPE_F16 ? q->ne[2] : 1, p);
    for (int64_t hh = 0; hh < G; hh++) attn_q_as(k->type, row_ptr(q, g * G + hh, i, 0), qx + hh * D, D);
    bool seen = false;
    for (int64_t j = 0; j < Tk; j++) {
        if (!kvr_attn_visible(qpos[i], kpos[j], W)) {
            for (int64_t hh = 0; hh < G; hh++) sc[hh * Tk + j] = -INFINITY;
            continue;
        }
        const float * kj = (const float *)attn_kv_row(k, g, j);
        if (k->type != KVR_TYPE_F32) {
            attn_row_f32(k->type, kj, kx, D);
            kj = kx;
        }
        for (int64_t hh = 0; hh < G; hh++) sc[hh * Tk + j] = kvr_softcap_f32(dot(qx + hh * D, kj, D) * scale, cap);
        seen = true;
    }
    return seen;
}

// Head h of query row i: the statistics (*m, *s) of some keys and the n blocks' of st [2H, Tq, n]
// folded into the max and the sum of them all (a block that saw no key has max -inf and sum 0)
static void attn_stats_fold(const struct kvr_tensor * st, int64_t i, int64_t h, float * m, double * s) {
    const int64_t H = st->ne[0] / 2;
    float mx = *m;
    for (int64_t b = 0; b < st->ne[2]; b++) {
        const float mb = ((const float *)row_ptr(st, i, b, 0))[h];
        mx = mb > mx ? mb : mx;
    }
    double sum = *s > 0.0 ? *s * exp((double)*m - (double)mx) : 0.0;
    for (int64_t b = 0; b < st->ne[2]; b++) {
        const float * sb = row_ptr(st, i, b, 0);
        if (sb[H + h] > 0.0f) sum += (double)sb[H + h] * exp((double)sb[h] - (double)mx);
    }
    *m = mx;
    *s = sum;
}

static void cpu_op_attn_stats(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1];
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1], G = H / Hkv;
    const int64_t Tk = attn_keys(dst->src[4]->data, k->ne[2]);
    float (*const ex)(float) = p->lanes16 ? expf_ggml16 : expf_ggml;
    KVR_ASSERT(attn_part_floats(dst) <= p->wsize);
    float * qx = p->wdata, * kx = qx + G * D, * sc = kx + D;
    for (int64_t item = p->ith; item < Tq * Hkv; item += p->nth) {
        const int64_t i = item / Hkv, g = item % Hkv;
        float * out = row_ptr(dst, i, 0, 0);
        attn_part_scores(p, dst, i, g, Tk, qx, kx, sc);
        for (int64_t hh = 0; hh < G; hh++) {
            const float * s = sc + hh * Tk;
            float m = -INFINITY;
            for (int64_t j = 0; j < Tk; j++) m = s[j] > m ? s[j] : m;
            double sum = 0.0;
            for (int64_t j = 0; j < Tk && m > -INFINITY; j++) sum += s[j] == -INFINITY ? 0.0 : (double)ex(s[j] - m);
            if (dst->src[2]) attn_stats_fold(dst->src[2], i, g * G + hh, &m, &sum);
            out[g * G + hh] = m;
            out[H + g * G + hh] = (float)sum;
        }
    }
}

static void cpu_op_attn_normed(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * st = dst->src[7];
    const int32_t * qpos = dst->src[3]->data, * kpos = dst->src[4]->data;
    const float * sink = dst->src[6] ? (const float *)dst->src[6]->data : NULL;
    const int64_t D = q->ne[0], H = q->ne[1], Tq = q->ne[2], Hkv = k->ne[1], G = H / Hkv;
    const int64_t Tk = attn_keys(kpos, k->ne[2]);
    const bool round = v->type == KVR_TYPE_F16 || v->type == KVR_TYPE_BF16;
    float (*const ex)(float) = p->lanes16 ? expf_ggml16 : expf_ggml;
    KVR_ASSERT(attn_part_floats(dst) <= p->wsize);
    double * S = (double *)p->wdata, * Sb = S + G; // the doubles first: the scratch's alignment is theirs
    float * M = (float *)(Sb + G), * inv = M + G, * qx = inv + G, * kx = qx + G * D, * sc = kx + D, * acc = sc + G * Tk;
    for (int64_t item = p->ith; item < Tq * Hkv; item += p->nth) {
        const int64_t i = item / Hkv, g = item % Hkv;
        float * out = row_ptr(dst, i, 0, 0);
        const bool seen = attn_part_scores(p, dst, i, g, Tk, qx, kx, sc);
        for (int64_t hh = 0; hh < G; hh++) {
            const int64_t h = g * G + hh;
            // the whole softmax's max and sum: the blocks' statistics folded, and the sink (as
            // cpu_op_attn_exact adds it: to the max, then e^(sink - max) to the sum)
            float m = -INFINITY;
            double sum = 0.0;
            attn_stats_fold(st, i, h, &m, &sum);
            if (sink && m > -INFINITY) {
                if (sink[h] > m) {
                    sum *= exp((double)m - (double)sink[h]);
                    m = sink[h];
                }
                sum += (double)expf(sink[h] - m);
            }
            M[hh] = m;
            S[hh] = sum;
            Sb[hh] = 0.0;
            inv[hh] = sum > 0.0 ? (float)(1.0 / sum) : 0.0f;
            for (int64_t e = 0; e < D; e++) acc[hh * D + e] = 0.0f;
        }
        for (int64_t j = 0; j < Tk && seen; j++) {
            if (!kvr_attn_visible(qpos[i], kpos[j], dst->op_params[3])) continue;
            const float * vj = (const float *)attn_kv_row(v, g, j);
            if (v->type != KVR_TYPE_F32) {
                attn_row_f32(v->type, vj, kx, D);
                vj = kx;
            }
            for (int64_t hh = 0; hh < G; hh++) {
                const float s = sc[hh * Tk + j];
                if (s == -INFINITY || M[hh] == -INFINITY) continue;
                const float e = ex(s - M[hh]);
                float w = e * inv[hh];
                if (round) w = kvr_kv_operand_round(v->type, w);
                Sb[hh] += (double)e;
                float * a = acc + hh * D;
                for (int64_t d = 0; d < D; d++) a[d] = fmaf(w, vj[d], a[d]);
            }
        }
        for (int64_t hh = 0; hh < G; hh++) {
            const int64_t h = g * G + hh;
            if (!(Sb[hh] > 0.0)) { // no key of this block seen (or all of them 0 at this scale)
                for (int64_t d = 0; d < D; d++) out[h * D + d] = 0.0f;
                out[D * H + h] = -INFINITY;
                continue;
            }
            // MERGE_ATTN weighs this block by S_b / S: the output it takes is O_b * S / S_b
            const float f = (float)(S[hh] / Sb[hh]);
            for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[hh * D + d] * f;
            out[D * H + h] = (float)((double)M[hh] + log(Sb[hh]));
        }
    }
    if (p->ith == 0) {
        attn_count(dst->op_params[0], qpos, Tq, kvr_attn_tile_tokens(G), kpos, Tk, dst->op_params[3],
                   &p->counters->attn_dot_dense, &p->counters->attn_dot_causal);
    }
}

// SSM_CONV: threads take channels; each channel's window of K inputs slides over its history
// (the state, or zeros when fresh) and then the batch, summed in GGML's order (oldest tap first,
// f32), then SiLU; the last K-1 inputs become the channel's state.
static void cpu_op_ssm_conv(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * x = dst->src[0], * w = dst->src[1];
    float * state = dst->src[2]->data;
    const int64_t C = x->ne[0], T = x->ne[1], K = w->ne[0];
    KVR_ASSERT(K >= 1 && K <= KVR_SSM_CONV_MAX_K);
    const bool fresh = dst->op_params[0];
    int64_t c0, c1;
    row_range(C, p->ith, p->nth, &c0, &c1);
    for (int64_t c = c0; c < c1; c++) {
        const float * wc = row_ptr(w, c, 0, 0);
        float * st = state + c * (K - 1);
        float win[KVR_SSM_CONV_MAX_K];
        for (int64_t i = 0; i < K - 1; i++) win[i] = fresh ? 0.0f : st[i];
        for (int64_t t = 0; t < T; t++) {
            win[K - 1] = ((const float *)row_ptr(x, t, 0, 0))[c];
            ((float *)row_ptr(dst, t, 0, 0))[c] = kvr_ssm_conv_out(win, wc, (int)K);
            memmove(win, win + 1, sizeof(float) * (size_t)(K - 1));
        }
        memcpy(st, win, sizeof(float) * (size_t)(K - 1));
    }
}

// One row of a head's state through one token: kvr.h's kvr_gdn_row, with AVX2 8 lanes at a time
// (the sums in 8 partial sums, as GGML's vector dots make them: another order than the scalar one).
static float gdn_row(float * s, const float * k, const float * q, int n, float eg, float beta, float v) {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0) {
        const __m256 g8 = _mm256_set1_ps(eg);
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + i), g8);
            _mm256_storeu_ps(s + i, x);
            acc = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), acc);
        }
        const __m256 d8 = _mm256_set1_ps((v - mv_hsum(acc)) * beta);
        acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            const __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), d8, _mm256_loadu_ps(s + i));
            _mm256_storeu_ps(s + i, x);
            acc = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + i), acc);
        }
        return mv_hsum(acc);
    }
#endif
    return kvr_gdn_row(s, k, q, n, eg, beta, v);
}

// GDN: threads take value heads; a head's state stays in place while its tokens go through it
// row by row (gdn_row), q and k L2-normalised into the scratch first. The recurrent form, token by
// token, as llama.cpp's CPU op: its work is O(T) and a small part of a layer's (Qwen3.5-0.8B's
// shapes: about 1% of the projections' FLOPs), so the chunked form brings the CPU nothing.
static void cpu_op_gdn(const struct cpu_params * p, struct kvr_tensor * dst) {
    const struct kvr_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * g = dst->src[3], * b = dst->src[4];
    float * state = dst->src[5]->data;
    const int64_t Dk = q->ne[0], Hk = q->ne[1], Dv = v->ne[0], Hv = v->ne[1], T = v->ne[2];
    const float eps = get_param_f32(dst, 1), scale = 1.0f / sqrtf((float)Dv);
    KVR_ASSERT((size_t)(2 * Dk) <= p->wsize);
    float * qn = p->wdata, * kn = qn + Dk;
    int64_t h0, h1;
    row_range(Hv, p->ith, p->nth, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) {
        float * S = state + h * Dv * Dk;
        if (dst->op_params[0]) memset(S, 0, sizeof(float) * (size_t)(Dv * Dk));
        for (int64_t t = 0; t < T; t++) {
            kvr_gdn_l2_norm(row_ptr(q, h % Hk, t, 0), qn, (int)Dk, eps);
            kvr_gdn_l2_norm(row_ptr(k, h % Hk, t, 0), kn, (int)Dk, eps);
            const float eg = expf(((const float *)row_ptr(g, t, 0, 0))[h]), beta = ((const float *)row_ptr(b, t, 0, 0))[h];
            const float * vr = row_ptr(v, h, t, 0);
            float * o = row_ptr(dst, h, t, 0);
            for (int64_t j = 0; j < Dv; j++) o[j] = gdn_row(S + j * Dk, kn, qn, (int)Dk, eg, beta, vr[j]) * scale;
        }
    }
}

// The one dispatch point of the CPU backend: an op's reference kernel when they are asked for
// (p->ref), else its fast one.
static void cpu_compute_node(const struct cpu_params * p, struct kvr_tensor * t) {
    switch ((enum kvr_op)t->op) {
        case KVR_OP_GET_ROWS:   cpu_op_get_rows(p, t);   break;
        case KVR_OP_ADD:
        case KVR_OP_MUL:        cpu_op_binary(p, t);     break;
        case KVR_OP_SCALE:
        case KVR_OP_SILU:
        case KVR_OP_GELU:
        case KVR_OP_SOFTCAP:    if (p->ref) ref_unary(p, t);   else cpu_op_unary(p, t);   break;
        case KVR_OP_SIGMOID:
        case KVR_OP_SOFTPLUS:   if (p->ref) ref_unary(p, t);   else cpu_op_unary(p, t);   break;
        case KVR_OP_SSM_CONV:   if (p->ref) ref_ssm_conv(p, t); else cpu_op_ssm_conv(p, t); break;
        case KVR_OP_GDN:        if (p->ref) ref_gdn(p, t);     else cpu_op_gdn(p, t);     break;
        case KVR_OP_RMS_NORM:
        case KVR_OP_NORM:       if (p->ref) ref_norm(p, t);    else cpu_op_norm(p, t);    break;
        case KVR_OP_MUL_MAT:    if (p->ref) ref_mul_mat(p, t); else cpu_op_mul_mat(p, t); break;
        case KVR_OP_MUL_MAT_ID: if (p->ref) ref_mul_mat_id(p, t); else cpu_op_mul_mat_id(p, t); break;
        case KVR_OP_MOE_ROUTE:  cpu_op_moe_route(p, t);  break;
        case KVR_OP_MOE_SUM:    cpu_op_moe_sum(p, t);    break;
        case KVR_OP_SWIGLU_OAI: cpu_op_swiglu_oai(p, t); break;
        case KVR_OP_ROPE:       cpu_op_rope(p, t);       break;
        case KVR_OP_CPY:
        case KVR_OP_KV_STORE:   cpu_op_cpy(p, t);        break;
        case KVR_OP_ATTN:       if (p->ref) ref_attn(p, t);    else cpu_op_attn(p, t);    break;
        case KVR_OP_MERGE_ATTN: cpu_op_merge_attn(p, t); break;
        case KVR_OP_ATTN_STATS: cpu_op_attn_stats(p, t); break; // one kernel, both modes
        case KVR_OP_ATTN_NORMED: cpu_op_attn_normed(p, t); break;
        case KVR_OP_NONE:
        case KVR_OP_VIEW:                                break;
        case KVR_OP_SEND:
        case KVR_OP_RECV:
        case KVR_OP_ALL_GATHER:
        case KVR_OP_ALL_TO_ALL:
        case KVR_OP_ATTN_BLOCK:
        case KVR_OP_GDN_BLOCK:
        case KVR_OP_COUNT:      KVR_ASSERT(!"op cannot run on the CPU backend");
    }
}

//
// 11. CPU backend: a pool of threads walks the graph together; every node is split by rows
// between them (ith of nth), with a barrier between nodes.
//

struct cpu_backend {
    int                 n_threads;
    pthread_t         * threads;
    pthread_mutex_t     mu;
    pthread_cond_t      cv;
    atomic_int          generation;   // bumped to start a graph; workers wait for a change
    atomic_bool         stop;
    struct kvr_graph  * graph;
    atomic_int          barrier_count;
    atomic_int          barrier_gen;
    atomic_int          barrier_sleepers; // threads asleep on bar_cv (cpu_barrier)
    pthread_mutex_t     bar_mu;
    pthread_cond_t      bar_cv;
    atomic_int          done_count;
    atomic_int        * chunks;       // per node of the graph: its chunk counter (struct mm_chunks)
    int                 chunks_cap;
    float            ** wdata;        // per thread
    size_t              wsize;
    struct qx_act_cache acache[KVR_MAX_THREADS]; // each thread's caches (cpu_params)
    struct rope_cache   rcache[KVR_MAX_THREADS];
    uint64_t            runs;         // graphs computed (the activations caches' clock)
    struct kvr_counters counters;
    struct kvr_counters thread_counters[KVR_MAX_THREADS];
    struct kvr_backend * be;          // the backend this is the context of (for comm nodes)
    atomic_int          status;       // first error of a comm node; every thread stops on it
    bool                trace;
    bool                q8_act;       // kvr_backend_params' q8_activations
    bool                vec_dot;      // kvr_backend_params' vec_dot_order
    bool                lanes16;      // kvr_backend_params' avx512_order
    bool                ref;          // the reference kernels (KVR_REF=1, kvr_backend_params.ref_kernels)
    struct kvr_span   * spans;        // stb_ds array
    int                 span_layer;   // layer of the open compute span (-1: none)
};


// How long a thread spins at a barrier before it sleeps. On a quiet machine the threads of a node
// arrive within microseconds of each other and the spin ends first; a thread that is late by more
// has usually lost its core to another process (a scheduler slice is milliseconds), and a waiter
// that kept spinning, or yielding (the scheduler keeps a yielding thread runnable and gives it its
// share), would hold a core the late thread needs. Asleep, it leaves the core to that thread.
#define CPU_SPIN_US 50.0
// A sleeper wakes at least this often to look again (a wakeup is never lost, see cpu_barrier;
// this bounds the wait on anything else).
#define CPU_SLEEP_SLICE_NS 20000000L

static inline void cpu_relax(void) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_ia32_pause(); // what _mm_pause is, without immintrin.h (included only for the SIMD kernels)
#endif
}

// Wait on cv (with mu held) for at most one slice.
static void cpu_sleep_slice(pthread_cond_t * cv, pthread_mutex_t * mu) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += CPU_SLEEP_SLICE_NS;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(cv, mu, &ts);
}

// The last thread to arrive opens the barrier (a new generation) and wakes the sleepers, if any. A
// waiter spins for CPU_SPIN_US, then counts itself a sleeper and sleeps until the generation moves.
// No wakeup is lost: the waiter counts itself and then reads the generation, the last arriver
// moves the generation and then reads the count (all sequentially consistent), so either the
// waiter sees the new generation or the arriver sees the sleeper and broadcasts under the mutex,
// which it cannot take before the waiter is asleep on the condition.
static void cpu_barrier(struct cpu_backend * cb) {
    if (cb->n_threads == 1) return;
    const int gen = atomic_load(&cb->barrier_gen);
    if (atomic_fetch_add(&cb->barrier_count, 1) == cb->n_threads - 1) {
        atomic_store(&cb->barrier_count, 0);
        atomic_fetch_add(&cb->barrier_gen, 1);
        if (atomic_load(&cb->barrier_sleepers) > 0) {
            pthread_mutex_lock(&cb->bar_mu);
            pthread_cond_broadcast(&cb->bar_cv);
            pthread_mutex_unlock(&cb->bar_mu);
        }
        return;
    }
    const double until = kvr_time_ms() + CPU_SPIN_US / 1000.0;
    for (int spins = 1; atomic_load(&cb->barrier_gen) == gen; spins++) {
        cpu_relax();
        if (spins % 64 == 0 && kvr_time_ms() > until) break;
    }
    if (atomic_load(&cb->barrier_gen) != gen) return;
    pthread_mutex_lock(&cb->bar_mu);
    atomic_fetch_add(&cb->barrier_sleepers, 1);
    while (atomic_load(&cb->barrier_gen) == gen) cpu_sleep_slice(&cb->bar_cv, &cb->bar_mu);
    atomic_fetch_sub(&cb->barrier_sleepers, 1);
    pthread_mutex_unlock(&cb->bar_mu);
}

// the layer a node belongs to, from its name ("blk.12.ffn_up"), or -1
static int node_layer(const struct kvr_tensor * t) {
    if (strncmp(t->name, "blk.", 4) != 0) return -1;
    return atoi(t->name + 4);
}

static void trace_node(struct cpu_backend * cb, const struct kvr_tensor * t, double t0, double t1) {
    if (node_is_comm(t)) {
        struct kvr_span sp = { .t0 = t0, .t1 = t1, .cat = 'c' };
        const int tag = t->op_params[1];
        const char * kind = kvr_tag_kind_name(kvr_tag_kind(tag));
        if (t->op == KVR_OP_SEND && t->op_params[0] < 0) { // not to a rank: a stream's sink (kvr-comm.c)
            snprintf(sp.name, sizeof(sp.name), "stream K+V L%d out", kvr_tag_layer(tag));
        } else if (t->op == KVR_OP_SEND || t->op == KVR_OP_RECV) {
            snprintf(sp.name, sizeof(sp.name), "%s %s L%d s%d %s %d", t->op == KVR_OP_SEND ? "send" : "recv", kind,
                     kvr_tag_layer(tag), kvr_tag_step(tag), t->op == KVR_OP_SEND ? "to" : "from", t->op_params[0]);
        } else {
            snprintf(sp.name, sizeof(sp.name), "%s %s L%d", t->op == KVR_OP_ALL_GATHER ? "all-gather" : "all-to-all",
                     kind, kvr_tag_layer(tag));
        }
        arrput(cb->spans, sp);
        cb->span_layer = -1;
        return;
    }
    const int il = node_layer(t);
    const int n = (int)arrlen(cb->spans);
    if (il >= 0 && cb->span_layer == il && n > 0 && cb->spans[n - 1].cat == 'l') {
        cb->spans[n - 1].t1 = t1; // extend the open layer span
        return;
    }
    struct kvr_span sp = { .t0 = t0, .t1 = t1, .cat = 'l' };
    if (il >= 0) snprintf(sp.name, sizeof(sp.name), "layer %d", il);
    else snprintf(sp.name, sizeof(sp.name), "%.40s", t->name[0] ? t->name : kvr_op_name(t->op));
    arrput(cb->spans, sp);
    cb->span_layer = il;
}

// A node small enough for one thread (one token's norms, RoPE, residual adds, cache stores):
// thread 0 runs it alone, and a run of such nodes needs no barrier between them, only one after
// its last, before the other threads read what it made. A decode step has about 15 nodes a layer
// and half of them are this small: each barrier saved is a wait for the slowest thread, which on
// a loaded machine may not be running at all. Matmuls and attention always split.
#define CPU_SOLO_ELEMS 16384

static bool node_solo(const struct kvr_tensor * t) {
    return t->lane == 0 && !node_is_noop(t) && !node_is_comm(t) && t->op != KVR_OP_MUL_MAT && t->op != KVR_OP_MUL_MAT_ID &&
           t->op != KVR_OP_ATTN && t->op != KVR_OP_ATTN_STATS && t->op != KVR_OP_ATTN_NORMED && kvr_nelements(t) <= CPU_SOLO_ELEMS;
}

static void cpu_run_graph(struct cpu_backend * cb, int ith) {
    struct kvr_graph * g = cb->graph;
    struct cpu_params p = { ith, cb->n_threads, NULL, cb->wdata[ith], cb->wsize, &cb->thread_counters[ith], cb->q8_act, cb->vec_dot,
                            cb->lanes16, cb->ref, QX_TILES ? &cb->acache[ith] : NULL,
                            &cb->rcache[ith], cb->runs };
    struct cpu_params solo = p; // this thread alone: its own scratch and counters
    solo.ith = 0;
    solo.nth = 1;
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (node_is_noop(t)) continue;
        p.chunk = solo.chunk = &cb->chunks[i];
        const double t0 = ith == 0 ? kvr_time_ms() : 0.0;
        bool barrier = true;
        if (node_is_comm(t)) {
            // transfers run on one thread, every node before them done; the others wait at the barrier
            if (ith == 0) {
                int rc = kvr_backend_comm_node(cb->be, t);
                if (rc != KVR_OK) atomic_store(&cb->status, rc);
            }
        } else if (cb->n_threads > 1 && t->lane > 0) {
            // a run of nodes in lanes (a decode batch's sequences, kvr_pass_batch): thread
            // (lane - 1) mod n runs a lane's nodes alone, in order, and the lanes go side by side,
            // one barrier after the run; one sequence's attention split over the threads would
            // cost a barrier each and leave a thread idle where the KV heads do not divide evenly
            if ((t->lane - 1) % cb->n_threads == ith) cpu_compute_node(&solo, t);
            int j = i + 1;
            while (j < g->n_nodes && node_is_noop(g->nodes[j])) j++;
            barrier = j == g->n_nodes || g->nodes[j]->lane == 0;
        } else if (cb->n_threads > 1 && node_solo(t)) {
            if (ith == 0) cpu_compute_node(&solo, t);
            int j = i + 1;
            while (j < g->n_nodes && node_is_noop(g->nodes[j])) j++;
            barrier = j == g->n_nodes || !node_solo(g->nodes[j]);
        } else {
            // the session's interrupt, asked at nodes every thread meets at a barrier after (so
            // all of them see the status there and stop together); ith 0 skips its share
            if (ith == 0 && kvr_backend_interrupted(cb->be)) atomic_store(&cb->status, KVR_ERR_INTERRUPTED);
            else cpu_compute_node(&p, t);
        }
        if (barrier) cpu_barrier(cb);
        if (ith == 0) {
            const double t1 = kvr_time_ms();
            p.counters->op_ms[t->op] += t1 - t0;
            if (cb->trace) trace_node(cb, t, t0, t1);
        }
        if (atomic_load(&cb->status) != KVR_OK) break;
    }
}

// Between graphs a worker polls for the next one for up to CPU_POLL_MS before it sleeps on the
// condition variable: decode runs one small graph per token, and the time between two (the
// sampler, the inputs) is mostly shorter than waking a sleeping thread takes. It polls with the
// CPU's pause, not by yielding: a yielding thread stays runnable and keeps its share of a core
// that the thread preparing the next graph may need on a busy machine.
#define CPU_POLL_MS 1.0

static void * cpu_worker(void * arg) {
    struct cpu_backend * cb = ((void **)arg)[0];
    const int ith = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    int seen = 0;
    for (;;) {
        const double until = kvr_time_ms() + CPU_POLL_MS;
        for (int spins = 1; atomic_load(&cb->generation) == seen && !atomic_load(&cb->stop); spins++) {
            cpu_relax();
            if (spins % 64 == 0 && kvr_time_ms() > until) break;
        }
        pthread_mutex_lock(&cb->mu);
        while (atomic_load(&cb->generation) == seen && !atomic_load(&cb->stop)) {
            cpu_sleep_slice(&cb->cv, &cb->mu);
        }
        if (atomic_load(&cb->stop)) {
            pthread_mutex_unlock(&cb->mu);
            return NULL;
        }
        seen = atomic_load(&cb->generation);
        pthread_mutex_unlock(&cb->mu);
        cpu_run_graph(cb, ith);
        atomic_fetch_add(&cb->done_count, 1);
    }
}
static size_t cpu_scratch_floats(const struct kvr_graph * g, int n_threads, bool q8_act) {
    // matmul converts up to MM_BLOCK_BYTES of weight rows at a time; attention keeps a query
    // tile, a score tile and an output tile
    size_t need = 1 << 16;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_MUL_MAT) {
            const struct kvr_tensor * w = t->src[0];
            const int64_t T = t->src[1]->ne[1] * t->src[1]->ne[2] * t->src[1]->ne[3];
            const size_t n = mm_scratch_floats(w->type, w->ne[0], w->ne[1], T, n_threads, q8_act, t->op_params[0] == KVR_MM_ROWS);
            if (n > need) need = n;
        }
        if (t->op == KVR_OP_GET_ROWS && (size_t)t->src[0]->ne[0] * 2 > need) need = (size_t)t->src[0]->ne[0] * 2;
        if (t->op == KVR_OP_MUL_MAT_ID) {
            const size_t n = mm_id_scratch_floats(t, n_threads, q8_act);
            if (n > need) need = n;
        }
        if (t->op == KVR_OP_GDN && (size_t)(2 * t->src[0]->ne[0]) > need) need = (size_t)(2 * t->src[0]->ne[0]);
        if ((t->op == KVR_OP_ATTN_STATS || t->op == KVR_OP_ATTN_NORMED) && attn_part_floats(t) > need) need = attn_part_floats(t);
        if (t->op == KVR_OP_ATTN) {
            const int64_t D = t->src[0]->ne[0], G = t->src[0]->ne[1] / t->src[1]->ne[1];
            const size_t rows = (size_t)(kvr_attn_tile_tokens(G) * G);
            size_t n = rows * (size_t)(2 * D + KVR_ATTN_BK + 2) + 1024;
            const int64_t Tq = t->src[0]->ne[2], Tk = t->src[1]->ne[2];
            if (attn_node_exact(t, Tq, Tk) && (size_t)((D + 1) * attn_exact_keys(Tk)) > n) n = (size_t)((D + 1) * attn_exact_keys(Tk));
            if (attn_typed(t)) n += attn_typed_floats(D);
#if defined(__AVX512F__)
            if (attn_lanes_floats(D, G) > n) n = attn_lanes_floats(D, G);
#endif
            if (n > need) need = n;
        }
    }
    return need;
}

static void cpu_ensure_scratch(struct cpu_backend * cb, size_t floats) {
    if (floats <= cb->wsize) return;
    for (int i = 0; i < cb->n_threads; i++) {
        free(cb->wdata[i]);
        cb->wdata[i] = kvr_malloc(floats * sizeof(float));
    }
    cb->wsize = floats;
}

static int cpu_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    struct cpu_backend * cb = be->context;
    // kvr_backend_graph_compute checked the graph and posted its receives; what the CPU adds:
    // every tensor a node touches must be host memory
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        for (int j = -1; j < KVR_MAX_SRC; j++) {
            const struct kvr_tensor * s = j < 0 ? t : t->src[j];
            if (s && !node_is_noop(t) && !tensor_is_host(s)) {
                return kvr_error(KVR_ERR_ARG, "the CPU backend cannot run node '%s': '%s' is in %s memory", t->name, s->name,
                                 kvr_backend_name(s->buffer->backend));
            }
            // a weight in tiles is read by the matmul and get-rows kernels only
            KVR_ASSERT(j != 0 || !s || !(s->flags & KVR_FLAG_TILED) || t->op == KVR_OP_MUL_MAT || t->op == KVR_OP_GET_ROWS);
        }
    }
    cpu_ensure_scratch(cb, cb->ref ? ref_scratch_floats(g, cb->q8_act) : cpu_scratch_floats(g, cb->n_threads, cb->q8_act));
    const double t0 = kvr_time_ms();
    atomic_store(&cb->status, KVR_OK);
    cb->span_layer = -1;
    cb->graph = g;
    if (g->n_nodes > cb->chunks_cap) {
        free(cb->chunks);
        cb->chunks = kvr_malloc(sizeof(atomic_int) * (size_t)g->n_nodes);
        cb->chunks_cap = g->n_nodes;
    }
    // before the workers start (the generation's bump publishes it)
    for (int i = 0; i < g->n_nodes; i++) atomic_init(&cb->chunks[i], 0);
    cb->runs++;
    if (cb->n_threads > 1) {
        atomic_store(&cb->done_count, 0);
        pthread_mutex_lock(&cb->mu);
        atomic_fetch_add(&cb->generation, 1);
        pthread_cond_broadcast(&cb->cv);
        pthread_mutex_unlock(&cb->mu);
    }
    cpu_run_graph(cb, 0);
    while (cb->n_threads > 1 && atomic_load(&cb->done_count) < cb->n_threads - 1) {
        sched_yield();
    }
    cb->graph = NULL;
    for (int i = 0; i < cb->n_threads; i++) {
        cb->counters.attn_dot_dense  += cb->thread_counters[i].attn_dot_dense;
        cb->counters.attn_dot_causal += cb->thread_counters[i].attn_dot_causal;
        cb->counters.matmul_flops    += cb->thread_counters[i].matmul_flops;
        cb->counters.expert_bytes    += cb->thread_counters[i].expert_bytes;
        for (int k = 0; k < KVR_OP_COUNT; k++) cb->counters.op_ms[k] += cb->thread_counters[i].op_ms[k];
        memset(&cb->thread_counters[i], 0, sizeof(cb->thread_counters[i]));
    }
    cb->counters.compute_ms += kvr_time_ms() - t0;
    return atomic_load(&cb->status);
}

static const char * cpu_name(struct kvr_backend * be) { (void)be; return "cpu"; }

static bool cpu_supports_op(struct kvr_backend * be, const struct kvr_tensor * t) {
    (void)be;
    switch (t->op) {
        case KVR_OP_ATTN_BLOCK:
        case KVR_OP_GDN_BLOCK:  return false;
        case KVR_OP_MUL_MAT:
        case KVR_OP_GET_ROWS:   return kvr_type_supported(t->src[0]->type);
        default:                return (unsigned)t->op < KVR_OP_COUNT;
    }
}

static int cpu_buf_alloc(struct kvr_backend * be, struct kvr_buffer * buf) {
    (void)be;
    if (posix_memalign(&buf->base, PLAN_ALIGN, buf->size ? buf->size : PLAN_ALIGN) != 0) {
        buf->base = NULL;
        return kvr_error(KVR_ERR_NOMEM, "cpu: cannot allocate a buffer of %zu MiB", buf->size >> 20);
    }
    buf->host  = true;
    buf->owned = true;
    return KVR_OK;
}

// host memory is the CPU's own: the weights stay in the file mapping, zero-copy
static int cpu_buf_from_host(struct kvr_backend * be, struct kvr_buffer * buf, const void * host) {
    (void)be;
    buf->base  = (void *)host;
    buf->host  = true;
    buf->owned = false;
    return KVR_OK;
}

static void cpu_buf_free(struct kvr_backend * be, struct kvr_buffer * buf) {
    (void)be;
    if (buf->owned) free(buf->base);
}

static void cpu_buf_clear(struct kvr_backend * be, struct kvr_buffer * buf, uint8_t value) {
    (void)be;
    memset(buf->base, value, buf->size);
}

static void cpu_tensor_set(struct kvr_backend * be, struct kvr_tensor * t, const void * src, size_t off, size_t n) {
    (void)be;
    if (n) memcpy((uint8_t *)t->data + off, src, n);
}

static void cpu_tensor_get(struct kvr_backend * be, const struct kvr_tensor * t, void * dst, size_t off, size_t n) {
    (void)be;
    if (n) memcpy(dst, (const uint8_t *)t->data + off, n);
}

static int cpu_synchronize(struct kvr_backend * be) { (void)be; return KVR_OK; } // every call returns done

static void cpu_stop_threads(struct cpu_backend * cb) {
    if (cb->n_threads <= 1) return;
    pthread_mutex_lock(&cb->mu);
    atomic_store(&cb->stop, true);
    pthread_cond_broadcast(&cb->cv);
    pthread_mutex_unlock(&cb->mu);
    for (int i = 1; i < cb->n_threads; i++) {
        pthread_join(cb->threads[i], NULL);
    }
    atomic_store(&cb->stop, false);
}

static void cpu_start_threads(struct cpu_backend * cb, int n_threads) {
    cb->n_threads = n_threads;
    cb->threads = realloc(cb->threads, sizeof(pthread_t) * (size_t)n_threads);
    cb->wdata   = realloc(cb->wdata, sizeof(float *) * (size_t)n_threads);
    KVR_ASSERT(cb->threads && cb->wdata);
    for (int i = 0; i < n_threads; i++) {
        cb->wdata[i] = kvr_malloc(cb->wsize * sizeof(float));
        cb->acache[i] = (struct qx_act_cache){ .buf = NULL };
        cb->rcache[i] = (struct rope_cache){ .cs = kvr_malloc(ROPE_CACHE_FLOATS * sizeof(float)) };
    }
    atomic_store(&cb->generation, 0);
    for (int i = 1; i < n_threads; i++) {
        void ** arg = kvr_malloc(2 * sizeof(void *));
        arg[0] = cb;
        arg[1] = (void *)(intptr_t)i;
        int rc = pthread_create(&cb->threads[i], NULL, cpu_worker, arg);
        KVR_ASSERT(rc == 0);
    }
}

static void cpu_free(struct kvr_backend * be) {
    struct cpu_backend * cb = be->context;
    cpu_stop_threads(cb);
    for (int i = 0; i < cb->n_threads; i++) {
        free(cb->wdata[i]);
        free(cb->acache[i].buf);
        free(cb->rcache[i].cs);
    }
    free(cb->wdata);
    free(cb->threads);
    free(cb->chunks);
    arrfree(cb->spans);
    pthread_mutex_destroy(&cb->mu);
    pthread_cond_destroy(&cb->cv);
    pthread_mutex_destroy(&cb->bar_mu);
    pthread_cond_destroy(&cb->bar_cv);
    free(cb);
    free(be);
}

static void cpu_set_threads(struct kvr_backend * be, int n_threads) {
    struct cpu_backend * cb = be->context;
    if (n_threads > KVR_MAX_THREADS) n_threads = KVR_MAX_THREADS;
    if (n_threads <= 0 || n_threads == cb->n_threads) return;
    cpu_stop_threads(cb);
    for (int i = 0; i < cb->n_threads; i++) {
        free(cb->wdata[i]);
        free(cb->acache[i].buf);
        free(cb->rcache[i].cs);
    }
    cpu_start_threads(cb, n_threads);
}

static void cpu_set_trace(struct kvr_backend * be, bool on) {
    ((struct cpu_backend *)be->context)->trace = on;
}

static const struct kvr_span * cpu_spans(struct kvr_backend * be, int * n, bool reset) {
    struct cpu_backend * cb = be->context;
    *n = (int)arrlen(cb->spans);
    if (reset) arrsetlen(cb->spans, 0);
    return cb->spans;
}

static void cpu_counters(struct kvr_backend * be, struct kvr_counters * out, bool reset) {
    struct cpu_backend * cb = be->context;
    *out = cb->counters;
    if (reset) memset(&cb->counters, 0, sizeof(cb->counters));
}

// KVR_REF=1 (any value but empty or 0) in the environment: every CPU backend made from then on
// runs the reference kernels (section "CPU kernels").
const char * kvr_blas_core_for(const char * core, bool avx512, bool avx2_fma) {
    // OpenBLAS's core types whose kernels use AVX2 (or AVX-512); anything else, "Prescott",
    // "Core2", "Nehalem", "Sandybridge", an unknown name, leaves vector units of this CPU idle
    static const char * const vector[] = { "haswell", "skylakex", "cooperlake", "sapphirerapids", "zen", "excavator",
                                           "steamroller", "atom", "cortex", "neoverse", "armv8", "power", "loongson" };
    if (!core) return NULL;
    for (size_t i = 0; i < sizeof(vector) / sizeof(vector[0]); i++)
        if (strncasecmp(core, vector[i], strlen(vector[i])) == 0) return NULL;
    return avx512 ? "SkylakeX" : avx2_fma ? "Haswell" : NULL;
}

void kvr_blas_reexec(char ** argv) {
#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
    if (getenv("OPENBLAS_CORETYPE") || !argv || !argv[0]) return;
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char * want = kvr_blas_core_for(openblas_get_corename(), avx512, avx2_fma);
    if (!want || setenv("OPENBLAS_CORETYPE", want, 1) != 0) return;
    fflush(NULL);
    execv("/proc/self/exe", argv);
    // the program goes on as it is; the variable stays set, so nothing below tries again
#else
    (void)argv;
#endif
}

static bool cpu_ref_from_env(void) {
    const char * v = getenv("KVR_REF");
    return v && v[0] && strcmp(v, "0") != 0;
}

static struct kvr_backend * cpu_backend_make(int n_threads, bool ref) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > KVR_MAX_THREADS) n_threads = KVR_MAX_THREADS;
    // each of our threads runs its own single-threaded sgemm on its share of the rows
    openblas_set_num_threads(1);
    struct cpu_backend * cb = kvr_calloc(1, sizeof(*cb));
    pthread_mutex_init(&cb->mu, NULL);
    pthread_cond_init(&cb->cv, NULL);
    pthread_mutex_init(&cb->bar_mu, NULL);
    pthread_cond_init(&cb->bar_cv, NULL);
    cb->wsize = 1 << 16;
    cb->ref   = ref || cpu_ref_from_env();
    cpu_start_threads(cb, n_threads);
    struct kvr_backend * be = kvr_calloc(1, sizeof(*be));
    be->iface = (struct kvr_backend_i) {
        .name               = cpu_name,
        .free               = cpu_free,
        .supports_op        = cpu_supports_op,
        .buf_alloc          = cpu_buf_alloc,
        .buf_from_host      = cpu_buf_from_host,
        .buf_free           = cpu_buf_free,
        .buf_clear          = cpu_buf_clear,
        .tensor_set         = cpu_tensor_set,
        .tensor_get         = cpu_tensor_get,
        .graph_compute      = cpu_graph_compute,
        .synchronize        = cpu_synchronize,
        .set_threads        = cpu_set_threads,
        .set_trace          = cpu_set_trace,
        .spans              = cpu_spans,
        .counters           = cpu_counters,
    };
    be->context = cb;
    cb->be      = be;
    return be;
}

// The registry's constructor (section "backends"): the CPU's own options are read here, once.
static struct kvr_backend * cpu_backend_new(const struct kvr_backend_params * p) {
    struct kvr_backend * be = cpu_backend_make(p->n_threads, p->ref_kernels);
    struct cpu_backend * cb = be->context;
    cb->q8_act  = p->q8_activations;
    cb->vec_dot = p->vec_dot_order;
    cb->lanes16 = p->avx512_order;
    return be;
}

struct kvr_backend * kvr_backend_cpu_new(int n_threads) {
    return cpu_backend_make(n_threads, false);
}

int kvr_graph_compute_cpu(struct kvr_graph * g, int n_threads) {
    size_t size = kvr_graph_plan(g);
    void * mem = NULL;
    if (posix_memalign(&mem, PLAN_ALIGN, size) != 0) {
        kvr_graph_place(g, NULL);
        return kvr_error(KVR_ERR_NOMEM, "cannot allocate %zu bytes for the graph", size);
    }
    // a host buffer (no backend): the caller reads the outputs through the nodes' data after the
    // backend is gone, so the memory and its buffer live as long as the graph's context
    struct kvr_buffer * buf = buffer_new(NULL, size);
    buf->base = mem;
    buf->host = true;
    arrput(g->ctx->bufs, mem);
    arrput(g->ctx->bufs, buf);
    kvr_graph_place(g, buf);
    struct kvr_backend * be = kvr_backend_cpu_new(n_threads);
    int rc = kvr_backend_graph_compute(be, g);
    kvr_backend_free(be);
    return rc;
}


//
// 12. GGUF reader. Every count, length, offset and extent is checked against the bytes that are
// actually there before it is used, so a malformed file is an error naming the field and its
// offset — never a crash, a hang or a giant allocation.
//

static const size_t gguf_type_size[KVR_GGUF_TYPE_COUNT] = {
    [KVR_GGUF_UINT8] = 1, [KVR_GGUF_INT8] = 1, [KVR_GGUF_UINT16] = 2, [KVR_GGUF_INT16] = 2,
    [KVR_GGUF_UINT32] = 4, [KVR_GGUF_INT32] = 4, [KVR_GGUF_FLOAT32] = 4, [KVR_GGUF_BOOL] = 1,
    [KVR_GGUF_STRING] = 0, [KVR_GGUF_ARRAY] = 0, [KVR_GGUF_UINT64] = 8, [KVR_GGUF_INT64] = 8,
    [KVR_GGUF_FLOAT64] = 8,
};

static const char * const gguf_type_names[KVR_GGUF_TYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

const char * kvr_gguf_type_name(enum kvr_gguf_type t) {
    return (unsigned)t < KVR_GGUF_TYPE_COUNT ? gguf_type_names[t] : "?";
}

struct gguf_rd {
    const uint8_t * p;
    size_t          size;
    size_t          off;
};

static int gguf_fail(const struct gguf_rd * r, const char * what, const char * why) {
    return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: %s", what, r->off, why);
}

static int gguf_bytes(struct gguf_rd * r, void * dst, size_t n, const char * what) {
    if (n > r->size - r->off) {
        return gguf_fail(r, what, "file ends inside it (truncated)");
    }
    memcpy(dst, r->p + r->off, n);
    r->off += n;
    return KVR_OK;
}

static int gguf_u32(struct gguf_rd * r, uint32_t * v, const char * what) { return gguf_bytes(r, v, 4, what); }
static int gguf_u64(struct gguf_rd * r, uint64_t * v, const char * what) { return gguf_bytes(r, v, 8, what); }

static int gguf_string(struct gguf_rd * r, struct kvr_gguf_str * s, const char * what) {
    uint64_t len = 0;
    if (gguf_u64(r, &len, what)) return KVR_ERR_FORMAT;
    if (len > r->size - r->off) {
        r->off -= 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: length %" PRIu64 " runs past the end of the file (%zu bytes left)",
                         what, r->off, len, r->size - r->off - 8);
    }
    s->len = len;
    s->s   = (const char *)r->p + r->off;
    r->off += len;
    return KVR_OK;
}

static bool gguf_str_eq(const struct kvr_gguf_str * s, const char * z) {
    size_t n = strlen(z);
    return s->len == n && memcmp(s->s, z, n) == 0;
}

static int gguf_value(struct gguf_rd * r, struct kvr_gguf_kv * kv, char * what) {
    if (kv->type == KVR_GGUF_STRING) {
        kv->strs = kvr_malloc(sizeof(struct kvr_gguf_str));
        kv->n = 1;
        return gguf_string(r, kv->strs, what);
    }
    if (kv->type != KVR_GGUF_ARRAY) {
        size_t sz = gguf_type_size[kv->type];
        if (sz > r->size - r->off) return gguf_fail(r, what, "file ends inside the value (truncated)");
        kv->n    = 1;
        kv->data = r->p + r->off;
        r->off  += sz;
        return KVR_OK;
    }
    uint32_t at = 0;
    if (gguf_u32(r, &at, what)) return KVR_ERR_FORMAT;
    if (at >= KVR_GGUF_TYPE_COUNT || at == KVR_GGUF_ARRAY) {
        r->off -= 4;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array element type %u is %s", what, r->off, at,
                         at == KVR_GGUF_ARRAY ? "an array (nested arrays are not supported)" : "unknown");
    }
    kv->arr_type = (enum kvr_gguf_type)at;
    uint64_t n = 0;
    if (gguf_u64(r, &n, what)) return KVR_ERR_FORMAT;
    const size_t left = r->size - r->off;
    if (at == KVR_GGUF_STRING) {
        if (n > left / 8) { // each string is at least its 8-byte length
            r->off -= 8;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array of %" PRIu64 " strings cannot fit in the %zu bytes left",
                             what, r->off, n, left);
        }
        kv->n = n;
        kv->strs = kvr_malloc(sizeof(struct kvr_gguf_str) * (size_t)n);
        for (uint64_t i = 0; i < n; i++) {
            if (gguf_string(r, &kv->strs[i], what)) return KVR_ERR_FORMAT;
        }
        return KVR_OK;
    }
    const size_t sz = gguf_type_size[at];
    if (n > left / sz) {
        r->off -= 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: array of %" PRIu64 " %s values needs more than the %zu bytes left",
                         what, r->off, n, gguf_type_names[at], left);
    }
    kv->n    = n;
    kv->data = r->p + r->off;
    r->off  += (size_t)n * sz;
    return KVR_OK;
}

void kvr_gguf_close(struct kvr_gguf * g) {
    if (!g) return;
    for (uint64_t i = 0; g->kv && i < g->n_kv; i++) free(g->kv[i].strs);
    free(g->kv);
    free(g->tensors);
    if (g->mapped) munmap((void *)g->base, g->size);
    free(g);
}

static int gguf_cmp_offset(const void * a, const void * b) {
    const struct kvr_gguf_tensor * x = *(struct kvr_gguf_tensor * const *)a, * y = *(struct kvr_gguf_tensor * const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int gguf_parse(struct kvr_gguf * g) {
    struct gguf_rd r = { g->base, g->size, 0 };
    char magic[4] = { 0 };
    if (gguf_bytes(&r, magic, 4, "magic")) return KVR_ERR_FORMAT;
    if (memcmp(magic, "GGUF", 4) != 0) {
        r.off = 0;
        return gguf_fail(&r, "magic", "not a GGUF file (the first 4 bytes are not \"GGUF\")");
    }
    if (gguf_u32(&r, &g->version, "version")) return KVR_ERR_FORMAT;
    if (g->version != 2 && g->version != 3) {
        r.off -= 4;
        return kvr_error(KVR_ERR_FORMAT, "gguf: version at offset %zu: version %u is not supported (2 and 3 are)", r.off, g->version);
    }
    if (gguf_u64(&r, &g->n_tensors, "tensor count")) return KVR_ERR_FORMAT;
    if (gguf_u64(&r, &g->n_kv, "metadata count")) return KVR_ERR_FORMAT;
    // the smallest key-value pair is 13 bytes and the smallest tensor info 28
    if (g->n_tensors > (r.size - r.off) / 28) {
        r.off = 8;
        return kvr_error(KVR_ERR_FORMAT, "gguf: tensor count at offset 8: %" PRIu64 " tensors cannot fit in a %zu-byte file", g->n_tensors, r.size);
    }
    if (g->n_kv > (r.size - r.off) / 13) {
        r.off = 16;
        return kvr_error(KVR_ERR_FORMAT, "gguf: metadata count at offset 16: %" PRIu64 " entries cannot fit in a %zu-byte file", g->n_kv, r.size);
    }
    g->kv = kvr_calloc((size_t)g->n_kv, sizeof(struct kvr_gguf_kv));
    g->alignment = 32;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct kvr_gguf_kv * kv = &g->kv[i];
        char what[160];
        snprintf(what, sizeof(what), "key of metadata entry %" PRIu64, i);
        if (gguf_string(&r, &kv->key, what)) return KVR_ERR_FORMAT;
        snprintf(what, sizeof(what), "metadata '%.*s'", (int)(kv->key.len < 100 ? kv->key.len : 100), kv->key.s);
        if (kv->key.len == 0) return gguf_fail(&r, what, "empty key");
        for (uint64_t j = 0; j < i; j++) {
            if (g->kv[j].key.len == kv->key.len && memcmp(g->kv[j].key.s, kv->key.s, kv->key.len) == 0) {
                return gguf_fail(&r, what, "duplicate key");
            }
        }
        uint32_t type = 0;
        if (gguf_u32(&r, &type, what)) return KVR_ERR_FORMAT;
        if (type >= KVR_GGUF_TYPE_COUNT) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: unknown value type %u", what, r.off, type);
        }
        kv->type = (enum kvr_gguf_type)type;
        if (gguf_value(&r, kv, what)) return KVR_ERR_FORMAT;
        if (gguf_str_eq(&kv->key, "general.alignment")) {
            uint32_t a;
            if (kv->type != KVR_GGUF_UINT32) return gguf_fail(&r, what, "must be a u32");
            memcpy(&a, kv->data, 4);
            if (a == 0 || (a & (a - 1)) != 0) return gguf_fail(&r, what, "must be a power of two");
            g->alignment = a;
        }
    }
    g->tensors = kvr_calloc((size_t)g->n_tensors, sizeof(struct kvr_gguf_tensor));
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct kvr_gguf_tensor * t = &g->tensors[i];
        char what[160];
        snprintf(what, sizeof(what), "name of tensor %" PRIu64, i);
        struct kvr_gguf_str name;
        if (gguf_string(&r, &name, what)) return KVR_ERR_FORMAT;
        if (name.len == 0 || name.len >= KVR_MAX_NAME) {
            return gguf_fail(&r, what, name.len ? "longer than 63 bytes" : "empty");
        }
        memcpy(t->name, name.s, name.len);
        t->name[name.len] = 0;
        if (strlen(t->name) != name.len) return gguf_fail(&r, what, "contains a NUL byte");
        for (uint64_t j = 0; j < i; j++) {
            if (strcmp(g->tensors[j].name, t->name) == 0) return gguf_fail(&r, what, "duplicate tensor name");
        }
        snprintf(what, sizeof(what), "tensor '%s'", t->name);
        uint32_t n_dims = 0;
        if (gguf_u32(&r, &n_dims, what)) return KVR_ERR_FORMAT;
        if (n_dims < 1 || n_dims > KVR_MAX_DIMS) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: %u dimensions (1 to 4 are allowed)", what, r.off, n_dims);
        }
        t->n_dims = (int)n_dims;
        int64_t nel = 1;
        for (int d = 0; d < KVR_MAX_DIMS; d++) {
            uint64_t ne = 1;
            if (d < (int)n_dims && gguf_u64(&r, &ne, what)) return KVR_ERR_FORMAT;
            if (ne > (uint64_t)INT64_MAX || (ne > 0 && nel > INT64_MAX / (int64_t)ne)) {
                return gguf_fail(&r, what, "element count overflows");
            }
            t->ne[d] = (int64_t)ne;
            nel *= (int64_t)ne;
        }
        uint32_t type = 0;
        if (gguf_u32(&r, &type, what)) return KVR_ERR_FORMAT;
        if (!type_known((enum kvr_type)type)) {
            r.off -= 4;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: unknown tensor type %u", what, r.off, type);
        }
        t->type = (enum kvr_type)type;
        if (t->ne[0] % type_traits[type].blck_size != 0) {
            return gguf_fail(&r, what, "first dimension is not a multiple of the type's block size");
        }
        if (!tensor_bytes(t->type, t->ne, &t->size)) return gguf_fail(&r, what, "byte size overflows");
        if (gguf_u64(&r, &t->offset, what)) return KVR_ERR_FORMAT;
        if (t->offset % g->alignment != 0) {
            r.off -= 8;
            return kvr_error(KVR_ERR_FORMAT, "gguf: %s at offset %zu: data offset %" PRIu64 " is not a multiple of the alignment %zu",
                             what, r.off, t->offset, g->alignment);
        }
    }
    // the data section starts at the next multiple of the alignment
    size_t data = r.off;
    if (data % g->alignment) data += g->alignment - data % g->alignment;
    if (g->n_tensors > 0 && data > g->size) {
        r.off = g->size;
        return gguf_fail(&r, "padding before the tensor data", "file ends before the data section (truncated)");
    }
    // a file without tensors ends with its metadata: there is no padded data section
    g->data_offset = g->n_tensors ? data : r.off;
    const size_t avail = g->size - (data < g->size ? data : g->size);
    struct kvr_gguf_tensor ** order = kvr_malloc(sizeof(*order) * (size_t)(g->n_tensors ? g->n_tensors : 1));
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct kvr_gguf_tensor * t = &g->tensors[i];
        if (t->offset > avail || t->size > avail - t->offset) {
            free(order);
            return kvr_error(KVR_ERR_FORMAT, "gguf: tensor '%s' data at offset %zu: %zu bytes at data offset %" PRIu64 " run past the end of the file (%zu data bytes)",
                             t->name, data + (size_t)(t->offset < avail ? t->offset : avail), t->size, t->offset, avail);
        }
        t->data = g->base + data + t->offset;
        order[i] = t;
    }
    qsort(order, (size_t)g->n_tensors, sizeof(*order), gguf_cmp_offset);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        if (order[i - 1]->offset + order[i - 1]->size > order[i]->offset) {
            int rc = kvr_error(KVR_ERR_FORMAT, "gguf: tensor '%s' data at offset %zu: overlaps tensor '%s'",
                               order[i]->name, data + (size_t)order[i]->offset, order[i - 1]->name);
            free(order);
            return rc;
        }
    }
    free(order);
    return KVR_OK;
}

struct kvr_gguf * kvr_gguf_open_mem(const void * buf, size_t size) {
    struct kvr_gguf * g = kvr_calloc(1, sizeof(*g));
    g->base = buf;
    g->size = size;
    if (gguf_parse(g) != KVR_OK) {
        kvr_gguf_close(g);
        return NULL;
    }
    return g;
}

struct kvr_gguf * kvr_gguf_open(const char * path) {
    FILE * f = kvr_file_read(path); // a regular file, opened without waiting on a FIFO
    if (!f) return NULL;
    const int fd = fileno(f);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        kvr_error(KVR_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        fclose(f);
        return NULL;
    }
    if (st.st_size < 4) {
        fclose(f);
        kvr_error(KVR_ERR_FORMAT, "%s: gguf: magic at offset 0: file is %lld bytes, too short to be GGUF", path, (long long)st.st_size);
        return NULL;
    }
    // MAP_POPULATE: the pages are mapped now, at load, instead of faulting one by one inside the
    // first prefill's matmuls (where they would count against the time to the first token)
    void * p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    fclose(f);
    if (p == MAP_FAILED) {
        kvr_error(KVR_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
        return NULL;
    }
    struct kvr_gguf * g = kvr_calloc(1, sizeof(*g));
    g->base   = p;
    g->size   = (size_t)st.st_size;
    g->mapped = true;
    if (gguf_parse(g) != KVR_OK) {
        kvr_error_prefix(KVR_ERR_FORMAT, "%s", path);
        kvr_gguf_close(g);
        return NULL;
    }
    return g;
}

int64_t kvr_gguf_find_key(const struct kvr_gguf * g, const char * key) {
    for (uint64_t i = 0; i < g->n_kv; i++) {
        if (gguf_str_eq(&g->kv[i].key, key)) return (int64_t)i;
    }
    return -1;
}

const struct kvr_gguf_kv * kvr_gguf_get_kv(const struct kvr_gguf * g, const char * key) {
    int64_t i = kvr_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

const struct kvr_gguf_tensor * kvr_gguf_get_tensor(const struct kvr_gguf * g, const char * name) {
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        if (strcmp(g->tensors[i].name, name) == 0) return &g->tensors[i];
    }
    return NULL;
}

static int gguf_get_int(const struct kvr_gguf * g, const char * key, int64_t * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    switch (kv->type) {
        case KVR_GGUF_UINT8:  { uint8_t  v; memcpy(&v, kv->data, 1); *out = v; } break;
        case KVR_GGUF_INT8:   { int8_t   v; memcpy(&v, kv->data, 1); *out = v; } break;
        case KVR_GGUF_UINT16: { uint16_t v; memcpy(&v, kv->data, 2); *out = v; } break;
        case KVR_GGUF_INT16:  { int16_t  v; memcpy(&v, kv->data, 2); *out = v; } break;
        case KVR_GGUF_UINT32: { uint32_t v; memcpy(&v, kv->data, 4); *out = v; } break;
        case KVR_GGUF_INT32:  { int32_t  v; memcpy(&v, kv->data, 4); *out = v; } break;
        case KVR_GGUF_INT64:  { int64_t  v; memcpy(&v, kv->data, 8); *out = v; } break;
        case KVR_GGUF_UINT64: {
            uint64_t v; memcpy(&v, kv->data, 8);
            if (v > INT64_MAX) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' = %" PRIu64 " is out of range", key, v);
            *out = (int64_t)v;
        } break;
        default:
            return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected an integer", key, kvr_gguf_type_name(kv->type));
    }
    return KVR_OK;
}

int kvr_gguf_get_u32(const struct kvr_gguf * g, const char * key, uint32_t * out) {
    int64_t v = 0;
    int rc = gguf_get_int(g, key, &v);
    if (rc) return rc;
    if (v < 0 || v > UINT32_MAX) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' = %" PRId64 " is out of range", key, v);
    *out = (uint32_t)v;
    return KVR_OK;
}

int kvr_gguf_get_f32(const struct kvr_gguf * g, const char * key, float * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type == KVR_GGUF_FLOAT32) { memcpy(out, kv->data, 4); return KVR_OK; }
    if (kv->type == KVR_GGUF_FLOAT64) { double d; memcpy(&d, kv->data, 8); *out = (float)d; return KVR_OK; }
    return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a float", key, kvr_gguf_type_name(kv->type));
}

int kvr_gguf_get_bool(const struct kvr_gguf * g, const char * key, bool * out) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type != KVR_GGUF_BOOL) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a bool", key, kvr_gguf_type_name(kv->type));
    *out = *(const uint8_t *)kv->data != 0;
    return KVR_OK;
}

int kvr_gguf_get_str(const struct kvr_gguf * g, const char * key, char * out, size_t cap) {
    if (cap == 0) return kvr_error(KVR_ERR_ARG, "gguf: no room to copy metadata '%s'", key);
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (!kv) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is missing", key);
    if (kv->type != KVR_GGUF_STRING) return kvr_error(KVR_ERR_FORMAT, "gguf: metadata '%s' is a %s, expected a string", key, kvr_gguf_type_name(kv->type));
    size_t n = kv->strs[0].len < cap - 1 ? (size_t)kv->strs[0].len : cap - 1;
    memcpy(out, kv->strs[0].s, n);
    out[n] = 0;
    return KVR_OK;
}

//
// 13. GGUF writer (kvr.h's "GGUF", "A writer"): metadata entries of every type, tensor infos, and a
// save that streams tensor data from the callers' buffers.
//
// Values are serialized when they are set (the bytes that follow the type tag in the file), so
// save is a plain walk. Files are GGUF version 3 with the data section and every tensor aligned
// to 32 bytes (or to general.alignment, when a caller or kvr_gguf_copy_kv set one). Each tensor is
// padded to the alignment, the last one too, as llama.cpp writes them.
//
// Tensor data is never copied: the pointer given to kvr_gguf_add_tensor is written out by save.
// A NULL data pointer reserves the tensor's bytes without writing them (a hole that reads as
// zeros): kvr-gen fills such tensors afterwards, one at a time, so a model larger than memory
// can be generated.
//
// Mistakes in what is added (an unknown type, a row that is not whole blocks, a name too long or
// used twice, an array of arrays) are remembered and reported by kvr_gguf_writer_save.
//

#define GW_VERSION           3u
#define GW_DEFAULT_ALIGNMENT 32u

struct gw_kv {
    char *             key;      // malloc'ed, zero-terminated
    enum kvr_gguf_type type;     // a scalar type or KVR_GGUF_ARRAY
    enum kvr_gguf_type arr_type; // for arrays
    uint64_t           n;        // array length (1 for scalars)
    uint8_t *          val;      // stb_ds array: the serialized value (after the type tags)
};

struct gw_tensor {
    char          name[KVR_MAX_NAME];
    int           n_dims;
    int64_t       ne[KVR_MAX_DIMS];
    enum kvr_type type;
    size_t        size;   // bytes, unpadded
    uint64_t      offset; // in the data section, set by save
    const void *  data;   // NULL: reserve the bytes only
};

struct gw_name { char * key; int value; };

struct kvr_gguf_writer {
    struct gw_kv     * kv;       // stb_ds array, in the order first set
    struct gw_tensor * tensors;  // stb_ds array, in the order added
    struct gw_name   * names;    // stb_ds string hash: tensor names already used
    int                err;      // the first mistake, reported by save
    char               errmsg[256];
};

static size_t gw_scalar_size(enum kvr_gguf_type t) {
    // the reader's table: strings and arrays have no fixed size (0)
    return (unsigned)t < KVR_GGUF_TYPE_COUNT ? gguf_type_size[t] : 0;
}

// Remember the first mistake; the later ones are usually its consequences.
static void gw_fail(struct kvr_gguf_writer * w, const char * what, const char * name, size_t len) {
    if (w->err) {
        return;
    }
    w->err = KVR_ERR_ARG;
    if (len > 100) {
        len = 100;
    }
    snprintf(w->errmsg, sizeof(w->errmsg), "gguf writer: %s '%.*s'", what, (int) len, name);
}

// GGUF is little-endian; kvr runs on little-endian hosts only, so values are copied as they are.
static void gw_put(uint8_t ** buf, const void * src, size_t n) {
    if (n == 0) {
        return;
    }
    uint8_t * dst = arraddnptr(*buf, n);
    memcpy(dst, src, n);
}

static void gw_put_u32(uint8_t ** buf, uint32_t v) { gw_put(buf, &v, sizeof(v)); }
static void gw_put_u64(uint8_t ** buf, uint64_t v) { gw_put(buf, &v, sizeof(v)); }

static void gw_put_str(uint8_t ** buf, const char * s, uint64_t len) {
    gw_put_u64(buf, len);
    gw_put(buf, s, (size_t) len);
}

// The entry of key (created at the end if new, emptied if it exists: a key is written once,
// llama.cpp rejects files with duplicate keys).
static struct gw_kv * gw_kv_slot(struct kvr_gguf_writer * w, const char * key, size_t key_len) {
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        if (strlen(w->kv[i].key) == key_len && memcmp(w->kv[i].key, key, key_len) == 0) {
            arrsetlen(w->kv[i].val, 0);
            return &w->kv[i];
        }
    }
    char * k = malloc(key_len + 1);
    KVR_ASSERT(k != NULL);
    memcpy(k, key, key_len);
    k[key_len] = '\0';
    struct gw_kv kv = { .key = k, .type = KVR_GGUF_UINT8, .arr_type = KVR_GGUF_UINT8, .n = 1, .val = NULL };
    arrput(w->kv, kv);
    return &arrlast(w->kv);
}

static void gw_set_scalar(struct kvr_gguf_writer * w, const char * key, size_t key_len,
                          enum kvr_gguf_type type, const void * v) {
    struct gw_kv * kv = gw_kv_slot(w, key, key_len);
    kv->type = type;
    kv->n    = 1;
    gw_put(&kv->val, v, gw_scalar_size(type));
}

static void gw_set_arr(struct kvr_gguf_writer * w, const char * key, size_t key_len,
                       enum kvr_gguf_type elem_type, const void * data, uint64_t n) {
    const size_t es = gw_scalar_size(elem_type);
    if (es == 0) {
        gw_fail(w, "arrays of strings go through kvr_gguf_set_arr_str, arrays of arrays are not supported:", key, key_len);
        return;
    }
    KVR_ASSERT(n == 0 || data != NULL);
    KVR_ASSERT(n <= SIZE_MAX / es);
    struct gw_kv * kv = gw_kv_slot(w, key, key_len);
    kv->type     = KVR_GGUF_ARRAY;
    kv->arr_type = elem_type;
    kv->n        = n;
    gw_put(&kv->val, data, (size_t) n * es);
}

struct kvr_gguf_writer * kvr_gguf_writer_new(void) {
    struct kvr_gguf_writer * w = calloc(1, sizeof(*w));
    if (!w) {
        kvr_error(KVR_ERR_NOMEM, "gguf writer: out of memory");
        return NULL;
    }
    sh_new_strdup(w->names);
    return w;
}

void kvr_gguf_writer_free(struct kvr_gguf_writer * w) {
    if (!w) {
        return;
    }
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        free(w->kv[i].key);
        arrfree(w->kv[i].val);
    }
    arrfree(w->kv);
    arrfree(w->tensors);
    shfree(w->names);
    free(w);
}

void kvr_gguf_set_u32(struct kvr_gguf_writer * w, const char * key, uint32_t v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_UINT32, &v);
}

void kvr_gguf_set_i32(struct kvr_gguf_writer * w, const char * key, int32_t v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_INT32, &v);
}

void kvr_gguf_set_f32(struct kvr_gguf_writer * w, const char * key, float v) {
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_FLOAT32, &v);
}

void kvr_gguf_set_bool(struct kvr_gguf_writer * w, const char * key, bool v) {
    const uint8_t b = v ? 1 : 0;
    gw_set_scalar(w, key, strlen(key), KVR_GGUF_BOOL, &b);
}

void kvr_gguf_set_str(struct kvr_gguf_writer * w, const char * key, const char * v) {
    struct gw_kv * kv = gw_kv_slot(w, key, strlen(key));
    kv->type = KVR_GGUF_STRING;
    kv->n    = 1;
    gw_put_str(&kv->val, v, strlen(v));
}

void kvr_gguf_set_arr(struct kvr_gguf_writer * w, const char * key, enum kvr_gguf_type elem_type,
                      const void * data, uint64_t n) {
    gw_set_arr(w, key, strlen(key), elem_type, data, n);
}

void kvr_gguf_set_arr_str(struct kvr_gguf_writer * w, const char * key, const char * const * strs,
                          const uint64_t * lens, uint64_t n) {
    KVR_ASSERT(n == 0 || strs != NULL);
    struct gw_kv * kv = gw_kv_slot(w, key, strlen(key));
    kv->type     = KVR_GGUF_ARRAY;
    kv->arr_type = KVR_GGUF_STRING;
    kv->n        = n;
    for (uint64_t i = 0; i < n; i++) {
        gw_put_str(&kv->val, strs[i], lens ? lens[i] : strlen(strs[i]));
    }
}

void kvr_gguf_copy_kv(struct kvr_gguf_writer * w, const struct kvr_gguf * src, const char * prefix) {
    const size_t plen = strlen(prefix);
    for (uint64_t i = 0; i < src->n_kv; i++) {
        const struct kvr_gguf_kv * e = &src->kv[i];
        const char * key     = e->key.s;
        const size_t key_len = (size_t) e->key.len;
        if (key_len < plen || memcmp(key, prefix, plen) != 0) {
            continue;
        }
        if (e->type == KVR_GGUF_STRING) {
            struct gw_kv * kv = gw_kv_slot(w, key, key_len);
            kv->type = KVR_GGUF_STRING;
            kv->n    = 1;
            gw_put_str(&kv->val, e->strs[0].s, e->strs[0].len);
        } else if (e->type == KVR_GGUF_ARRAY && e->arr_type == KVR_GGUF_STRING) {
            struct gw_kv * kv = gw_kv_slot(w, key, key_len);
            kv->type     = KVR_GGUF_ARRAY;
            kv->arr_type = KVR_GGUF_STRING;
            kv->n        = e->n;
            for (uint64_t j = 0; j < e->n; j++) {
                gw_put_str(&kv->val, e->strs[j].s, e->strs[j].len);
            }
        } else if (e->type == KVR_GGUF_ARRAY) {
            gw_set_arr(w, key, key_len, e->arr_type, e->data, e->n);
        } else if (gw_scalar_size(e->type) != 0) {
            gw_set_scalar(w, key, key_len, e->type, e->data);
        } else {
            gw_fail(w, "cannot copy the value type of key", key, key_len);
        }
    }
}

void kvr_gguf_add_tensor(struct kvr_gguf_writer * w, const char * name, enum kvr_type type, int n_dims,
                         const int64_t * ne, const void * data) {
    const size_t name_len = strlen(name);
    if (name_len >= KVR_MAX_NAME) {
        gw_fail(w, "tensor name too long:", name, name_len);
        return;
    }
    if (shgeti(w->names, name) >= 0) {
        gw_fail(w, "duplicate tensor name", name, name_len);
        return;
    }
    if (n_dims < 1 || n_dims > KVR_MAX_DIMS) {
        gw_fail(w, "bad number of dimensions of tensor", name, name_len);
        return;
    }
    const int64_t blck = kvr_blck_size(type);
    if (blck <= 0) {
        gw_fail(w, "unknown type of tensor", name, name_len);
        return;
    }
    struct gw_tensor t = { .n_dims = n_dims, .type = type, .data = data };
    memcpy(t.name, name, name_len + 1);
    int64_t rows = 1;
    for (int i = 0; i < KVR_MAX_DIMS; i++) {
        t.ne[i] = i < n_dims ? ne[i] : 1;
        if (t.ne[i] < 0 || (i > 0 && t.ne[i] > 0 && rows > INT64_MAX / t.ne[i])) {
            gw_fail(w, "bad shape of tensor", name, name_len);
            return;
        }
        if (i > 0) {
            rows *= t.ne[i];
        }
    }
    if (t.ne[0] % blck != 0) {
        gw_fail(w, "row length is not a whole number of blocks in tensor", name, name_len);
        return;
    }
    if (!tensor_bytes(type, t.ne, &t.size)) {
        gw_fail(w, "tensor too large:", name, name_len);
        return;
    }
    arrput(w->tensors, t);
    shput(w->names, name, 1);
}

static size_t gw_pad(size_t x, size_t align) {
    return (x + align - 1) / align * align;
}

// The alignment of the data section: general.alignment when set, else GGUF's default.
static size_t gw_alignment(const struct kvr_gguf_writer * w) {
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        if (strcmp(w->kv[i].key, "general.alignment") == 0 && w->kv[i].type == KVR_GGUF_UINT32) {
            uint32_t a;
            memcpy(&a, w->kv[i].val, sizeof(a));
            return a;
        }
    }
    return GW_DEFAULT_ALIGNMENT;
}

static const uint8_t gw_zeros[256];

// Writes out and counts; the first failure sticks (checked once, at the end of each part).
struct gw_out {
    FILE *   f;
    uint64_t pos;  // where the next byte goes
    uint64_t end;  // the end of what was written (pos is past it after a trailing hole)
    bool     ok;
};

static void gw_write(struct gw_out * o, const void * p, size_t n) {
    if (o->ok && n > 0 && fwrite(p, 1, n, o->f) != n) {
        o->ok = false;
    }
    o->pos += n;
    o->end  = o->pos;
}

static void gw_write_pad(struct gw_out * o, size_t align) {
    size_t n = (size_t) (gw_pad((size_t) o->pos, align) - o->pos);
    while (n > 0) {
        const size_t k = n < sizeof(gw_zeros) ? n : sizeof(gw_zeros);
        gw_write(o, gw_zeros, k);
        n -= k;
    }
}

// Leave n bytes unwritten (a hole if the file system makes one; zeros either way).
static void gw_skip(struct gw_out * o, uint64_t n) {
    if (n == 0) {
        return;
    }
    if (o->ok && (o->pos + n > (uint64_t) LONG_MAX || fseek(o->f, (long) (o->pos + n), SEEK_SET) != 0)) {
        o->ok = false;
    }
    o->pos += n;
}

int kvr_gguf_writer_save(struct kvr_gguf_writer * w, const char * path) {
    struct kvr_file * kf;
    const int frc = kvr_file_create(&kf, path); // whole or not at all, never through a planted link
    if (frc != KVR_OK) return frc;
    const int rc = kvr_gguf_writer_write(w, kf);
    if (rc != KVR_OK) {
        kvr_file_abort(kf);
        return rc;
    }
    return kvr_file_commit(kf);
}

int kvr_gguf_writer_write(struct kvr_gguf_writer * w, struct kvr_file * kf) {
    const char * path = kvr_file_target_path(kf);
    if (w->err) {
        return kvr_error(w->err, "%s (writing %s)", w->errmsg, path);
    }
    const size_t align = gw_alignment(w);
    if (align == 0 || (align & (align - 1)) != 0) {
        return kvr_error(KVR_ERR_ARG, "gguf writer: general.alignment %zu is not a power of two (writing %s)", align, path);
    }

    const ptrdiff_t n_tensors = arrlen(w->tensors);
    uint64_t offset = 0;
    for (ptrdiff_t i = 0; i < n_tensors; i++) {
        w->tensors[i].offset = offset;
        offset += gw_pad(w->tensors[i].size, align);
    }

    FILE * f = kvr_file_stream(kf);
    struct gw_out o = { .f = f, .pos = 0, .end = 0, .ok = true };

    // header and metadata: small, gathered in one buffer
    uint8_t * head = NULL;
    gw_put(&head, "GGUF", 4);
    gw_put_u32(&head, GW_VERSION);
    gw_put_u64(&head, (uint64_t) n_tensors);
    gw_put_u64(&head, (uint64_t) arrlen(w->kv));
    for (ptrdiff_t i = 0; i < arrlen(w->kv); i++) {
        const struct gw_kv * kv = &w->kv[i];
        gw_put_str(&head, kv->key, strlen(kv->key));
        gw_put_u32(&head, (uint32_t) kv->type);
        if (kv->type == KVR_GGUF_ARRAY) {
            gw_put_u32(&head, (uint32_t) kv->arr_type);
            gw_put_u64(&head, kv->n);
        }
        gw_put(&head, kv->val, (size_t) arrlen(kv->val));
    }
    for (ptrdiff_t i = 0; i < n_tensors; i++) {
        const struct gw_tensor * t = &w->tensors[i];
        gw_put_str(&head, t->name, strlen(t->name));
        gw_put_u32(&head, (uint32_t) t->n_dims);
        for (int d = 0; d < t->n_dims; d++) {
            gw_put_u64(&head, (uint64_t) t->ne[d]);
        }
        gw_put_u32(&head, (uint32_t) t->type);
        gw_put_u64(&head, t->offset);
    }
    gw_write(&o, head, (size_t) arrlen(head));
    arrfree(head);
    gw_write_pad(&o, align);

    // tensor data, straight from the callers' buffers
    for (ptrdiff_t i = 0; i < n_tensors && o.ok; i++) {
        const struct gw_tensor * t = &w->tensors[i];
        if (t->data) {
            gw_write(&o, t->data, t->size);
            gw_write_pad(&o, align);
        } else {
            gw_skip(&o, gw_pad(t->size, align));
        }
    }
    // a trailing hole does not make the file longer: end it with a written byte
    if (o.ok && o.end < o.pos) {
        if (fseek(f, (long) (o.pos - 1), SEEK_SET) != 0 || fwrite(gw_zeros, 1, 1, f) != 1) {
            o.ok = false;
        }
    }

    if (!o.ok) {
        const int e = errno;
        return kvr_error(KVR_ERR_IO, "cannot write %s: %s", path, e ? strerror(e) : "write error");
    }
    return KVR_OK;
}

//
// 14. tokenizers (kvr.h's "vocab"): loading a vocabulary from GGUF metadata, SPM
// (tokenizer.ggml.model = "llama") and byte-level BPE (= "gpt2") tokenization, and detokenization
// of single tokens. Both reproduce llama.cpp's (llama-vocab.cpp, unicode.cpp) token for token:
// special and user-defined tokens are split out of the text first, then SPM merges UTF-8
// characters by score with byte fallback, while BPE pre-tokenizes with the regexes of
// tokenizer.ggml.pre (written here as hand matchers over code points, over the generated Unicode
// category table of the appendix) and merges bytes by the rank of tokenizer.ggml.merges.
//
// Non-API names are static and start with vocab_, spm_ or bpe_. Hash maps are stb_ds string maps;
// lookups use the thread-safe getter so a const vocab can be shared by threads.
//

// UTF-8 and code point classes. The flags of a code point come from the generated table at the
// end of this file (vocab_cpt_flags); tests/gen-unicode.py makes the table with these same bits
// and checks that they are defined here as it assigns them.
#define VOCAB_CPT_NUMBER       0x01 // Nd Nl No
#define VOCAB_CPT_LETTER       0x02 // Lu Ll Lt Lm Lo
#define VOCAB_CPT_SEPARATOR    0x04 // Zs Zl Zp
#define VOCAB_CPT_MARK         0x08 // Mn Mc Me
#define VOCAB_CPT_PUNCT        0x10 // Pc Pd Ps Pe Pi Pf Po
#define VOCAB_CPT_SYMBOL       0x20 // Sm Sc Sk So
#define VOCAB_CPT_CONTROL      0x40 // Cc Cf Cs Co Cn
#define VOCAB_CPT_WHITESPACE   0x80 // White_Space

static int vocab_cpt_flags(uint32_t cp); // the appendix: a binary search over generated ranges

// Bytes of the UTF-8 sequence a lead byte announces (continuation bytes count as 1), as llama.cpp.
static size_t vocab_utf8_len(unsigned char c) {
    static const unsigned char len[16] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4 };
    return len[c >> 4];
}

// Decode one code point at s[*pos] (n bytes in all). Invalid or truncated sequences give U+FFFD
// and consume one byte, as llama.cpp's unicode_cpts_from_utf8.
static uint32_t vocab_utf8_decode(const unsigned char * s, size_t n, size_t * pos) {
    const size_t i = *pos;
    const unsigned char c = s[i];
    if (c < 0x80) {
        *pos = i + 1;
        return c;
    }
    if ((c & 0xE0) == 0xC0 && i + 1 < n && (s[i + 1] & 0xC0) == 0x80) {
        *pos = i + 2;
        return ((uint32_t) (c & 0x1F) << 6) | (s[i + 1] & 0x3F);
    }
    if ((c & 0xF0) == 0xE0 && i + 2 < n && (s[i + 1] & 0xC0) == 0x80 && (s[i + 2] & 0xC0) == 0x80) {
        *pos = i + 3;
        return ((uint32_t) (c & 0x0F) << 12) | ((uint32_t) (s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
    }
    if ((c & 0xF8) == 0xF0 && i + 3 < n && (s[i + 1] & 0xC0) == 0x80 && (s[i + 2] & 0xC0) == 0x80 &&
        (s[i + 3] & 0xC0) == 0x80) {
        const uint32_t cp = ((uint32_t) (c & 0x07) << 18) | ((uint32_t) (s[i + 1] & 0x3F) << 12) |
                            ((uint32_t) (s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
        if (cp <= 0x10FFFF) {
            *pos = i + 4;
            return cp;
        }
    }
    *pos = i + 1;
    return 0xFFFD;
}

// Encode cp (<= U+10FFFF) as UTF-8 into out (4 bytes of room); returns the length.
static size_t vocab_utf8_encode(uint32_t cp, char * out) {
    if (cp < 0x80) {
        out[0] = (char) cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char) (0xC0 | (cp >> 6));
        out[1] = (char) (0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char) (0xE0 | (cp >> 12));
        out[1] = (char) (0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char) (0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char) (0xF0 | (cp >> 18));
    out[1] = (char) (0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char) (0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char) (0x80 | (cp & 0x3F));
    return 4;
}

//
// the vocabulary
//

// Token attributes, bit flags as llama.cpp keeps them (tokenizer.ggml.token_type maps onto them).
enum vocab_attr {
    VOCAB_ATTR_UNDEFINED    = 0,
    VOCAB_ATTR_UNKNOWN      = 1 << 0,
    VOCAB_ATTR_UNUSED       = 1 << 1,
    VOCAB_ATTR_NORMAL       = 1 << 2,
    VOCAB_ATTR_CONTROL      = 1 << 3,
    VOCAB_ATTR_USER_DEFINED = 1 << 4,
    VOCAB_ATTR_BYTE         = 1 << 5,
    VOCAB_ATTR_LSTRIP       = 1 << 6,  // split out of text: eat the whitespace before it
    VOCAB_ATTR_RSTRIP       = 1 << 7,  // and after it
};

// The BPE pre-tokenizers (tokenizer.ggml.pre picks one).
enum vocab_pre {
    VOCAB_PRE_DEFAULT = 0,
    VOCAB_PRE_GPT2,
    VOCAB_PRE_FALCON,
    VOCAB_PRE_STARCODER,
    VOCAB_PRE_LLAMA3,
    VOCAB_PRE_DBRX,          // the llama3 regex without ignore_merges
    VOCAB_PRE_CHATGLM4,      // the llama3 regex, no BOS
    VOCAB_PRE_QWEN2,
    VOCAB_PRE_QWEN35,        // qwen2 with the combining marks (\p{M}) inside words
    VOCAB_PRE_DEEPSEEK_CODER,
    VOCAB_PRE_DEEPSEEK_LLM,
    VOCAB_PRE_PORO,
    VOCAB_PRE_VIKING,
    VOCAB_PRE_COUNT,
};

struct vocab_token {
    const char * text;   // zero-terminated, in kvr_vocab.text_arena
    uint32_t     len;
    float        score;
    int          attr;   // enum vocab_attr bits
};

struct vocab_str_map {   // stb_ds string map: text -> id or rank
    char *  key;
    int32_t value;
};

struct kvr_vocab {
    enum kvr_vocab_kind kind;
    enum vocab_pre      pre;
    int                 n_tokens;
    struct vocab_token * tokens;
    char               * text_arena;
    struct vocab_str_map * token_map;   // token text -> id

    struct vocab_str_map * merge_map;   // BPE: "left right" -> rank
    char                 * merge_arena;

    int32_t bos, eos, eot, eom, unk, pad, fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;
    bool    add_bos, add_eos, add_space_prefix, ignore_merges;

    int32_t * special;      // control, user-defined and unknown tokens, longest text first
    int       n_special;
    int32_t * eog;          // end-of-generation ids
    int       n_eog;

    int32_t  spm_byte_id[256];   // SPM: the token of a raw byte (<0xXX> or the byte itself), -1: none
    uint16_t bpe_byte_cp[256];   // BPE: GPT-2's byte -> code point map
    int16_t  bpe_cp_byte[324];   // and back (-1: not a byte's code point)

    char     * piece_arena;      // each token's text as output (special = true; stb_ds array)
    uint32_t * piece_off;
    uint32_t * piece_len;

    char     * chat_template;    // tokenizer.chat_template, zero-terminated (NULL: none)
};

// Id of the zero-terminated text, -1 if it is not a token. Read-only on the map (thread-safe).
static int32_t vocab_map_find(struct vocab_str_map * map, const char * key) {
    if (map == NULL) {
        return -1;
    }
    ptrdiff_t i = -1;
    stbds_hmget_key_ts(map, sizeof *map, (void *) key, sizeof map->key, &i, STBDS_HM_STRING);
    return i >= 0 ? map[i].value : -1;
}

// A growable byte buffer for building lookup keys.
struct vocab_buf {
    char * p;
    size_t cap;
};

static bool vocab_buf_reserve(struct vocab_buf * b, size_t n) {
    if (n <= b->cap) {
        return true;
    }
    size_t cap = b->cap ? b->cap : 64;
    while (cap < n) {
        cap *= 2;
    }
    char * p = realloc(b->p, cap);
    if (p == NULL) {
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

// Id of the n bytes at s (need not be zero-terminated); -1 if none or out of memory.
static int32_t vocab_find(const struct kvr_vocab * v, struct vocab_buf * key, const char * s, size_t n) {
    if (!vocab_buf_reserve(key, n + 1)) {
        return -1;
    }
    memcpy(key->p, s, n);
    key->p[n] = '\0';
    return vocab_map_find(v->token_map, key->p);
}

//
// loading
//

// An optional string key: *s/*n point into the mapping (not zero-terminated); *s = NULL if absent.
static int vocab_get_str(const struct kvr_gguf * g, const char * key, const char ** s, size_t * n) {
    *s = NULL;
    *n = 0;
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (kv == NULL) {
        return KVR_OK;
    }
    if (kv->type != KVR_GGUF_STRING || kv->strs == NULL) {
        return kvr_error(KVR_ERR_FORMAT, "%s: expected a string, found %s", key, kvr_gguf_type_name(kv->type));
    }
    *s = kv->strs[0].s;
    *n = (size_t) kv->strs[0].len;
    return KVR_OK;
}

// An optional array key of one of two element types; *out = NULL if absent.
static int vocab_get_arr(const struct kvr_gguf * g, const char * key, enum kvr_gguf_type t0, enum kvr_gguf_type t1,
                         const struct kvr_gguf_kv ** out) {
    *out = NULL;
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (kv == NULL) {
        return KVR_OK;
    }
    if (kv->type != KVR_GGUF_ARRAY || (kv->arr_type != t0 && kv->arr_type != t1)) {
        return kvr_error(KVR_ERR_FORMAT, "%s: expected an array of %s, found %s%s%s", key, kvr_gguf_type_name(t0),
                         kvr_gguf_type_name(kv->type), kv->type == KVR_GGUF_ARRAY ? " of " : "",
                         kv->type == KVR_GGUF_ARRAY ? kvr_gguf_type_name(kv->arr_type) : "");
    }
    if (kv->arr_type == KVR_GGUF_STRING ? kv->strs == NULL && kv->n > 0 : kv->data == NULL && kv->n > 0) {
        return kvr_error(KVR_ERR_FORMAT, "%s: array without data", key);
    }
    *out = kv;
    return KVR_OK;
}

// An optional token id key: keeps *id when absent. Out of range, llama.cpp warns and keeps the
// default: for the ids that shape the text (strict: BOS, EOS, end of turn, unknown) that default
// is another token than the file meant, and the output changes without a word, so the file is
// refused; ids kvr never writes or reads (padding, FIM) are ignored as llama.cpp does.
static int vocab_get_id(const struct kvr_gguf * g, const char * key, int n_tokens, bool strict, int32_t * id) {
    const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, key);
    if (kv == NULL) {
        return KVR_OK;
    }
    if (kv->type == KVR_GGUF_ARRAY || kv->data == NULL) {
        return kvr_error(KVR_ERR_FORMAT, "%s: expected an integer token id, found %s", key, kvr_gguf_type_name(kv->type));
    }
    int64_t val;
    switch (kv->type) {
        case KVR_GGUF_UINT8:  { uint8_t  x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_INT8:   { int8_t   x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_UINT16: { uint16_t x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_INT16:  { int16_t  x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_UINT32: { uint32_t x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_INT32:  { int32_t  x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        case KVR_GGUF_UINT64: { uint64_t x; memcpy(&x, kv->data, sizeof x); val = x > INT64_MAX ? INT64_MAX : (int64_t) x; } break;
        case KVR_GGUF_INT64:  { int64_t  x; memcpy(&x, kv->data, sizeof x); val = x; } break;
        default:
            return kvr_error(KVR_ERR_FORMAT, "%s: expected an integer token id, found %s", key,
                             kvr_gguf_type_name(kv->type));
    }
    if (val >= 0 && val < n_tokens) {
        *id = (int32_t) val;
    } else if (strict) {
        return kvr_error(KVR_ERR_FORMAT, "%s = %" PRId64 " is not a token of this vocabulary (ids 0 to %d): "
                         "kvr would have to guess which token the file means", key, val, n_tokens - 1);
    }
    return KVR_OK;
}

// An optional boolean key: keeps *out when absent.
static int vocab_get_flag(const struct kvr_gguf * g, const char * key, bool * out) {
    if (kvr_gguf_get_kv(g, key) == NULL) {
        return KVR_OK;
    }
    return kvr_gguf_get_bool(g, key, out);
}

static bool vocab_str_eq(const char * s, size_t n, const char * lit) {
    return n == strlen(lit) && memcmp(s, lit, n) == 0;
}

// tokenizer.ggml.pre -> pre-tokenizer (the names llama.cpp gives each regex set we implement).
static const struct {
    const char *   name;
    enum vocab_pre pre;
} vocab_pre_names[] = {
    { "default",        VOCAB_PRE_DEFAULT        },
    { "llama3",         VOCAB_PRE_LLAMA3         }, { "llama-v3",       VOCAB_PRE_LLAMA3 },
    { "llama-bpe",      VOCAB_PRE_LLAMA3         }, { "falcon3",        VOCAB_PRE_LLAMA3 },
    { "falcon-h1",      VOCAB_PRE_LLAMA3         }, { "pixtral",        VOCAB_PRE_LLAMA3 },
    { "midm-2.0",       VOCAB_PRE_LLAMA3         }, { "lfm2",           VOCAB_PRE_LLAMA3 },
    { "dbrx",           VOCAB_PRE_DBRX           }, { "smaug-bpe",      VOCAB_PRE_DBRX   },
    { "glm4",           VOCAB_PRE_CHATGLM4       }, { "chatglm-bpe",    VOCAB_PRE_CHATGLM4 },
    { "deepseek-llm",   VOCAB_PRE_DEEPSEEK_LLM   },
    { "deepseek-coder", VOCAB_PRE_DEEPSEEK_CODER },
    { "falcon",         VOCAB_PRE_FALCON         },
    { "starcoder",      VOCAB_PRE_STARCODER      }, { "refact",         VOCAB_PRE_STARCODER },
    { "command-r",      VOCAB_PRE_STARCODER      }, { "smollm",         VOCAB_PRE_STARCODER },
    { "codeshell",      VOCAB_PRE_STARCODER      }, { "exaone",         VOCAB_PRE_STARCODER },
    { "minerva-7b",     VOCAB_PRE_STARCODER      },
    { "gpt-2",          VOCAB_PRE_GPT2           }, { "phi-2",          VOCAB_PRE_GPT2 },
    { "mpt",            VOCAB_PRE_GPT2           }, { "olmo",           VOCAB_PRE_GPT2 },
    { "jais",           VOCAB_PRE_GPT2           }, { "jina-es",        VOCAB_PRE_GPT2 },
    { "jina-de",        VOCAB_PRE_GPT2           }, { "jina-v1-en",     VOCAB_PRE_GPT2 },
    { "jina-v2-es",     VOCAB_PRE_GPT2           }, { "jina-v2-de",     VOCAB_PRE_GPT2 },
    { "jina-v2-code",   VOCAB_PRE_GPT2           }, { "roberta-bpe",    VOCAB_PRE_GPT2 },
    { "gigachat",       VOCAB_PRE_GPT2           }, { "exaone4",        VOCAB_PRE_GPT2 },
    { "qwen2",          VOCAB_PRE_QWEN2          }, { "deepseek-r1-qwen", VOCAB_PRE_QWEN2 },
    { "stablelm2",      VOCAB_PRE_QWEN2          }, { "megrez",         VOCAB_PRE_QWEN2 },
    { "kormo",          VOCAB_PRE_QWEN2          }, { "f2llmv2",        VOCAB_PRE_QWEN2 },
    { "hunyuan",        VOCAB_PRE_QWEN2          }, { "solar-open",     VOCAB_PRE_QWEN2 },
    { "qwen35",         VOCAB_PRE_QWEN35         },
    { "poro-chat",      VOCAB_PRE_PORO           }, { "bloom",          VOCAB_PRE_PORO },
    { "gpt3-finnish",   VOCAB_PRE_PORO           }, { "viking",         VOCAB_PRE_VIKING },
};

// Texts llama.cpp recognizes as special when the metadata does not name them.
static const char * const vocab_eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "[EOT]", "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>", "<end_of_utterance>", NULL,
};
static const char * const vocab_eom_texts[]     = { "<|eom_id|>", NULL };
static const char * const vocab_fim_pre_texts[] = {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>", "<PRE>",
    "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL,
};
static const char * const vocab_fim_suf_texts[] = {
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>", "<SUF>",
    "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL,
};
static const char * const vocab_fim_mid_texts[] = {
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>", "<MID>",
    "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL,
};
static const char * const vocab_fim_pad_texts[] = { "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL };
static const char * const vocab_fim_rep_texts[] = {
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL,
};
static const char * const vocab_fim_sep_texts[] = { "<|file_sep|>", NULL };
static const char * const vocab_eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<turn|>", "<|tool_response>", "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>", "[e~[", NULL,
};

// The id of a text, -1 if it is no token.
static int32_t vocab_id_of(const struct kvr_vocab * v, const char * text) {
    return vocab_map_find(v->token_map, text);
}

static bool vocab_is_eog_text(const struct kvr_vocab * v, const char * text, int32_t * id) {
    for (int i = 0; i < v->n_eog; i++) {
        if (strcmp(v->tokens[v->eog[i]].text, text) == 0) {
            *id = v->eog[i];
            return true;
        }
    }
    return false;
}

static void vocab_remove_eog(struct kvr_vocab * v, int32_t id) {
    for (int i = 0; i < v->n_eog; i++) {
        if (v->eog[i] == id) {
            stbds_arrdel(v->eog, i);
            v->n_eog--;
            return;
        }
    }
}

// A string key's value (zero-terminated, cut to cap - 1; "" when absent or not a string).
static void vocab_str_or_empty(const struct kvr_gguf * g, const char * key, char * out, size_t cap) {
    const char * s;
    size_t n;
    out[0] = '\0';
    if (vocab_get_str(g, key, &s, &n) == KVR_OK && s != NULL) {
        n = n < cap - 1 ? n : cap - 1;
        memcpy(out, s, n);
        out[n] = '\0';
    }
}

static bool vocab_text_in(const struct vocab_token * t, const char * const * list) {
    for (; *list != NULL; list++) {
        if (strcmp(t->text, *list) == 0) {
            return true;
        }
    }
    return false;
}

// When *id is unset: the lowest id whose text is in list becomes it, and is made a control token.
static void vocab_detect(struct kvr_vocab * v, int32_t * id, const char * const * list) {
    if (*id >= 0) {
        return;
    }
    for (int i = 0; i < v->n_tokens; i++) {
        if (vocab_text_in(&v->tokens[i], list)) {
            *id = i;
            v->tokens[i].attr |= VOCAB_ATTR_CONTROL;
            return;
        }
    }
}

static void vocab_add_eog(struct kvr_vocab * v, int32_t id) {
    if (id < 0) {
        return;
    }
    for (int i = 0; i < v->n_eog; i++) {
        if (v->eog[i] == id) {
            return;
        }
    }
    stbds_arrput(v->eog, id);
    v->n_eog = (int) stbds_arrlen(v->eog);
}

struct vocab_len_id {
    uint32_t len;
    int32_t  id;
};

static int vocab_cmp_len_desc(const void * a, const void * b) {
    const struct vocab_len_id * x = a;
    const struct vocab_len_id * y = b;
    if (x->len != y->len) {
        return x->len > y->len ? -1 : 1;
    }
    return x->id < y->id ? -1 : x->id > y->id;
}

static int vocab_hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Append n bytes to the stb_ds array *a.
static void vocab_append(char ** a, const void * p, size_t n) {
    if (n > 0) {
        memcpy(stbds_arraddnptr(*a, n), p, n);
    }
}

// Append the output text of a token with special = true (llama.cpp's token_to_piece) to *a.
static void vocab_make_piece(const struct kvr_vocab * v, int32_t id, char ** a) {
    const struct vocab_token * t = &v->tokens[id];
    if (t->attr & (VOCAB_ATTR_UNKNOWN | VOCAB_ATTR_CONTROL | VOCAB_ATTR_USER_DEFINED)) {
        vocab_append(a, t->text, t->len);
        return;
    }
    if (t->attr & VOCAB_ATTR_NORMAL) {
        if (v->kind == KVR_VOCAB_SPM) {  // U+2581 "▁" -> " "
            for (uint32_t i = 0; i < t->len;) {
                if (i + 2 < t->len && memcmp(t->text + i, "\xE2\x96\x81", 3) == 0) {
                    vocab_append(a, " ", 1);
                    i += 3;
                } else {
                    vocab_append(a, t->text + i, 1);
                    i++;
                }
            }
            return;
        }
        // byte-level BPE: each code point stands for one byte
        size_t pos = 0;
        while (pos < t->len) {
            const uint32_t cp = vocab_utf8_decode((const unsigned char *) t->text, t->len, &pos);
            if (cp < 324 && v->bpe_cp_byte[cp] >= 0) {
                const char byte = (char) v->bpe_cp_byte[cp];
                vocab_append(a, &byte, 1);
            } else {  // llama.cpp's marker for a code point that stands for no byte
                char utf8[4], hex[3];
                const size_t k = vocab_utf8_encode(cp, utf8);
                vocab_append(a, "[UNK_BYTE_0x", 12);
                for (size_t j = 0; j < k; j++) {
                    snprintf(hex, sizeof hex, "%02x", (unsigned char) utf8[j]);
                    vocab_append(a, hex, 2);
                }
                vocab_append(a, t->text, t->len);
                vocab_append(a, "]", 1);
            }
        }
        return;
    }
    if (t->attr & VOCAB_ATTR_BYTE) {  // "<0xXX>"
        const int hi = t->len >= 5 ? vocab_hex(t->text[3]) : -1;
        const int lo = t->len >= 5 ? vocab_hex(t->text[4]) : -1;
        const char byte = (char) (hi >= 0 && lo >= 0 ? hi * 16 + lo : 0);
        vocab_append(a, &byte, 1);
    }
}

static int vocab_load_impl(struct kvr_vocab * v, const struct kvr_gguf * g) {
    int rc;

    // kind and pre-tokenizer
    const char * model;
    size_t       model_len;
    if ((rc = vocab_get_str(g, "tokenizer.ggml.model", &model, &model_len)) != KVR_OK) {
        return rc;
    }
    if (model == NULL) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.model: missing (the file has no tokenizer)");
    }
    if (vocab_str_eq(model, model_len, "llama")) {
        v->kind = KVR_VOCAB_SPM;
    } else if (vocab_str_eq(model, model_len, "gpt2")) {
        v->kind = KVR_VOCAB_BPE;
    } else {
        return kvr_error(KVR_ERR_UNSUPP, "tokenizer.ggml.model = '%.*s' is not supported (\"llama\" and \"gpt2\" are)",
                         (int) (model_len > 64 ? 64 : model_len), model);
    }

    const char * pre;
    size_t       pre_len;
    if ((rc = vocab_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len)) != KVR_OK) {
        return rc;
    }
    v->pre = VOCAB_PRE_DEFAULT;
    if (v->kind == KVR_VOCAB_BPE && pre != NULL) {
        bool found = false;
        for (size_t i = 0; i < sizeof vocab_pre_names / sizeof vocab_pre_names[0]; i++) {
            if (vocab_str_eq(pre, pre_len, vocab_pre_names[i].name)) {
                v->pre = vocab_pre_names[i].pre;
                found = true;
                break;
            }
        }
        if (!found) {
            return kvr_error(KVR_ERR_UNSUPP, "tokenizer.ggml.pre = '%.*s': this pre-tokenizer is not supported",
                             (int) (pre_len > 64 ? 64 : pre_len), pre);
        }
    }

    // defaults by kind, as llama.cpp
    if (v->kind == KVR_VOCAB_SPM) {
        v->bos = 1; v->eos = 2; v->unk = 0;
        v->add_bos = true;
        v->add_space_prefix = true;
    } else {
        v->bos = 11; v->eos = 11; v->unk = -1;
        v->add_bos = v->pre == VOCAB_PRE_LLAMA3;
        v->ignore_merges = v->pre == VOCAB_PRE_LLAMA3;
        v->add_space_prefix = false;
        if (v->pre == VOCAB_PRE_CHATGLM4) {
            v->bos = -1;
        }
    }
    v->add_eos = false;
    v->eot = v->eom = v->pad = v->fim_pre = v->fim_suf = v->fim_mid = v->fim_pad = v->fim_rep = v->fim_sep = -1;
    if ((rc = vocab_get_flag(g, "tokenizer.ggml.add_space_prefix", &v->add_space_prefix)) != KVR_OK) {
        return rc;
    }

    // tokens, scores, types
    const struct kvr_gguf_kv * toks, * scores, * types;
    if ((rc = vocab_get_arr(g, "tokenizer.ggml.tokens", KVR_GGUF_STRING, KVR_GGUF_STRING, &toks)) != KVR_OK) {
        return rc;
    }
    if (toks == NULL) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.tokens: missing");
    }
    if (toks->n == 0 || toks->n > INT32_MAX / 2) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.tokens: %llu tokens", (unsigned long long) toks->n);
    }
    const int n = (int) toks->n;
    if ((rc = vocab_get_arr(g, "tokenizer.ggml.scores", KVR_GGUF_FLOAT32, KVR_GGUF_INT32, &scores)) != KVR_OK) {
        return rc;
    }
    if (scores != NULL && scores->n < (uint64_t) n) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.scores: %llu scores for %d tokens",
                         (unsigned long long) scores->n, n);
    }
    if ((rc = vocab_get_arr(g, "tokenizer.ggml.token_type", KVR_GGUF_INT32, KVR_GGUF_INT32, &types)) != KVR_OK) {
        return rc;
    }
    if (types != NULL && types->n < (uint64_t) n) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.token_type: %llu types for %d tokens",
                         (unsigned long long) types->n, n);
    }

    // texts are cut at a zero byte and an empty text becomes "[EMPTY_<id>]", as llama.cpp
    size_t arena = 0;
    for (int i = 0; i < n; i++) {
        const struct kvr_gguf_str * s = &toks->strs[i];
        const char * z = s->len ? memchr(s->s, 0, (size_t) s->len) : NULL;
        const size_t len = z ? (size_t) (z - s->s) : (size_t) s->len;
        arena += (len ? len : 24) + 1;
    }
    v->n_tokens = n;
    v->tokens = calloc((size_t) n, sizeof *v->tokens);
    v->text_arena = malloc(arena);
    if (v->tokens == NULL || v->text_arena == NULL) {
        return kvr_error(KVR_ERR_NOMEM, "tokenizer.ggml.tokens: out of memory for %d tokens", n);
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const struct kvr_gguf_str * s = &toks->strs[i];
        const char * z = s->len ? memchr(s->s, 0, (size_t) s->len) : NULL;
        size_t len = z ? (size_t) (z - s->s) : (size_t) s->len;
        char * dst = v->text_arena + off;
        if (len == 0) {
            len = (size_t) snprintf(dst, 24, "[EMPTY_%d]", i);
        } else {
            memcpy(dst, s->s, len);
            dst[len] = '\0';
        }
        off += len + 1;
        struct vocab_token * t = &v->tokens[i];
        t->text = dst;
        t->len = (uint32_t) len;
        t->score = 0.0f;
        if (scores != NULL) {
            if (scores->arr_type == KVR_GGUF_FLOAT32) {
                memcpy(&t->score, (const char *) scores->data + 4 * (size_t) i, 4);
            } else {
                int32_t x;
                memcpy(&x, (const char *) scores->data + 4 * (size_t) i, 4);
                t->score = (float) x;
            }
        }
        t->attr = VOCAB_ATTR_NORMAL;
        if (types != NULL) {
            int32_t tt;
            memcpy(&tt, (const char *) types->data + 4 * (size_t) i, 4);
            switch (tt) {
                case KVR_TOKEN_NORMAL:       t->attr = VOCAB_ATTR_NORMAL;       break;
                case KVR_TOKEN_UNKNOWN:      t->attr = VOCAB_ATTR_UNKNOWN;      break;
                case KVR_TOKEN_CONTROL:      t->attr = VOCAB_ATTR_CONTROL;      break;
                case KVR_TOKEN_USER_DEFINED: t->attr = VOCAB_ATTR_USER_DEFINED; break;
                case KVR_TOKEN_UNUSED:       t->attr = VOCAB_ATTR_UNUSED;       break;
                case KVR_TOKEN_BYTE:         t->attr = VOCAB_ATTR_BYTE;         break;
                default:                     t->attr = VOCAB_ATTR_UNDEFINED;    break;
            }
        }
        const int32_t dup = vocab_map_find(v->token_map, dst);
        if (dup >= 0) {
            return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.tokens: duplicate token '%.64s' at ids %d and %d",
                             dst, dup, i);
        }
        stbds_shput(v->token_map, dst, i);
    }

    // BPE merges: "left right", ranked by their order (the first of duplicates counts)
    if (v->kind == KVR_VOCAB_BPE) {
        const struct kvr_gguf_kv * merges;
        if ((rc = vocab_get_arr(g, "tokenizer.ggml.merges", KVR_GGUF_STRING, KVR_GGUF_STRING, &merges)) != KVR_OK) {
            return rc;
        }
        if (merges == NULL) {
            return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.merges: missing (a gpt2 tokenizer needs its merges)");
        }
        if (merges->n > INT32_MAX) {
            return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.merges: %llu merges", (unsigned long long) merges->n);
        }
        size_t bytes = 0;
        for (uint64_t i = 0; i < merges->n; i++) {
            bytes += (size_t) merges->strs[i].len + 1;
        }
        v->merge_arena = malloc(bytes ? bytes : 1);
        if (v->merge_arena == NULL) {
            return kvr_error(KVR_ERR_NOMEM, "tokenizer.ggml.merges: out of memory");
        }
        off = 0;
        for (uint64_t i = 0; i < merges->n; i++) {
            const struct kvr_gguf_str * s = &merges->strs[i];
            const char * z = s->len ? memchr(s->s, 0, (size_t) s->len) : NULL;
            const size_t len = z ? (size_t) (z - s->s) : (size_t) s->len;
            if (len < 2 || memchr(s->s + 1, ' ', len - 1) == NULL) {
                continue;  // no "left right" pair: it can never apply
            }
            char * dst = v->merge_arena + off;
            memcpy(dst, s->s, len);
            dst[len] = '\0';
            off += len + 1;
            if (vocab_map_find(v->merge_map, dst) < 0) {
                stbds_shput(v->merge_map, dst, (int32_t) i);
            }
        }
    }

    // special token ids and flags
    static const struct { const char * key; size_t off; bool strict; } ids[] = {
        { "tokenizer.ggml.bos_token_id",       offsetof(struct kvr_vocab, bos),     true  },
        { "tokenizer.ggml.eos_token_id",       offsetof(struct kvr_vocab, eos),     true  },
        { "tokenizer.ggml.eot_token_id",       offsetof(struct kvr_vocab, eot),     true  },
        { "tokenizer.ggml.eom_token_id",       offsetof(struct kvr_vocab, eom),     true  },
        { "tokenizer.ggml.unknown_token_id",   offsetof(struct kvr_vocab, unk),     true  },
        { "tokenizer.ggml.padding_token_id",   offsetof(struct kvr_vocab, pad),     false },
        { "tokenizer.ggml.fim_pre_token_id",   offsetof(struct kvr_vocab, fim_pre), false },
        { "tokenizer.ggml.fim_suf_token_id",   offsetof(struct kvr_vocab, fim_suf), false },
        { "tokenizer.ggml.fim_mid_token_id",   offsetof(struct kvr_vocab, fim_mid), false },
        { "tokenizer.ggml.fim_pad_token_id",   offsetof(struct kvr_vocab, fim_pad), false },
        { "tokenizer.ggml.fim_rep_token_id",   offsetof(struct kvr_vocab, fim_rep), false },
        { "tokenizer.ggml.fim_sep_token_id",   offsetof(struct kvr_vocab, fim_sep), false },
        { "tokenizer.ggml.prefix_token_id",    offsetof(struct kvr_vocab, fim_pre), false },  // deprecated names
        { "tokenizer.ggml.suffix_token_id",    offsetof(struct kvr_vocab, fim_suf), false },
        { "tokenizer.ggml.middle_token_id",    offsetof(struct kvr_vocab, fim_mid), false },
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        int32_t * id = (int32_t *) ((char *) v + ids[i].off);
        if (*id >= n) {
            *id = -1;  // a default outside this vocabulary
        }
        if ((rc = vocab_get_id(g, ids[i].key, n, ids[i].strict, id)) != KVR_OK) {
            return rc;
        }
    }
    if ((rc = vocab_get_flag(g, "tokenizer.ggml.add_bos_token", &v->add_bos)) != KVR_OK ||
        (rc = vocab_get_flag(g, "tokenizer.ggml.add_eos_token", &v->add_eos)) != KVR_OK) {
        return rc;
    }
    if (v->add_bos && v->bos < 0) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set");
    }
    if (v->add_eos && v->eos < 0) {
        return kvr_error(KVR_ERR_FORMAT, "tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set");
    }

    // special tokens recognized by their text, unused control tokens, end of generation
    vocab_detect(v, &v->eot, vocab_eot_texts);
    vocab_detect(v, &v->eom, vocab_eom_texts);
    vocab_detect(v, &v->fim_pre, vocab_fim_pre_texts);
    vocab_detect(v, &v->fim_suf, vocab_fim_suf_texts);
    vocab_detect(v, &v->fim_mid, vocab_fim_mid_texts);
    vocab_detect(v, &v->fim_pad, vocab_fim_pad_texts);
    vocab_detect(v, &v->fim_rep, vocab_fim_rep_texts);
    vocab_detect(v, &v->fim_sep, vocab_fim_sep_texts);
    for (int i = 0; i < n; i++) {
        struct vocab_token * t = &v->tokens[i];
        if ((t->attr & VOCAB_ATTR_CONTROL) && strstr(t->text, "unused") != NULL) {
            t->attr |= VOCAB_ATTR_UNUSED;
        }
    }
    vocab_add_eog(v, v->fim_pad);
    vocab_add_eog(v, v->fim_rep);
    vocab_add_eog(v, v->fim_sep);
    for (int i = 0; i < n; i++) {
        if (vocab_text_in(&v->tokens[i], vocab_eog_texts)) {
            vocab_add_eog(v, i);
            v->tokens[i].attr |= VOCAB_ATTR_CONTROL;
        }
    }
    static const char * const gpt_oss_user_defined[] = { "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", NULL };
    for (int i = 0; i < n; i++) {
        if (vocab_text_in(&v->tokens[i], gpt_oss_user_defined)) {
            v->tokens[i].attr = VOCAB_ATTR_USER_DEFINED;
        }
    }
    vocab_add_eog(v, v->eos);
    vocab_add_eog(v, v->eot);
    vocab_add_eog(v, v->eom);
    {   // llama.cpp's workarounds: "<|end|>" does not end harmony/solar-open turns; "</s>" is normal
        // text next to gemma4's or plamo's own end markers
        int32_t end_id, s_id, x;
        const bool call = vocab_is_eog_text(v, "<|call|>", &x) || vocab_is_eog_text(v, "<|calls|>", &x);
        if (vocab_is_eog_text(v, "<|end|>", &end_id) && call &&
            (vocab_is_eog_text(v, "<|return|>", &x) || vocab_is_eog_text(v, "<|flush|>", &x))) {
            vocab_remove_eog(v, end_id);
            v->tokens[end_id].attr = VOCAB_ATTR_USER_DEFINED;
        }
        if (vocab_is_eog_text(v, "</s>", &s_id) &&
            (vocab_is_eog_text(v, "<|tool_response>", &x) || vocab_is_eog_text(v, "<|plamo:eos|>", &x))) {
            vocab_remove_eog(v, s_id);
            v->tokens[s_id].attr = VOCAB_ATTR_NORMAL;
        }
    }

    // the tokens split out of the text before tokenizing, longest first
    struct vocab_len_id * sp = NULL;
    for (int i = 0; i < n; i++) {
        if (v->tokens[i].attr & (VOCAB_ATTR_CONTROL | VOCAB_ATTR_USER_DEFINED | VOCAB_ATTR_UNKNOWN)) {
            struct vocab_len_id e = { v->tokens[i].len, i };
            stbds_arrput(sp, e);
        }
    }
    v->n_special = (int) stbds_arrlen(sp);
    if (v->n_special > 0) {
        qsort(sp, (size_t) v->n_special, sizeof *sp, vocab_cmp_len_desc);
        v->special = malloc((size_t) v->n_special * sizeof *v->special);
        if (v->special == NULL) {
            stbds_arrfree(sp);
            return kvr_error(KVR_ERR_NOMEM, "vocab: out of memory");
        }
        for (int i = 0; i < v->n_special; i++) {
            v->special[i] = sp[i].id;
        }
    }
    stbds_arrfree(sp);

    // whitespace eaten around some special tokens: llama.cpp decides it by the model's name
    {
        char name[512], pre_name[128], arch[128];
        vocab_str_or_empty(g, "general.name", name, sizeof name);
        vocab_str_or_empty(g, "tokenizer.ggml.pre", pre_name, sizeof pre_name);
        vocab_str_or_empty(g, "general.architecture", arch, sizeof arch);
        for (char * c = name; *c; c++) {
            *c = (char) (*c >= 'A' && *c <= 'Z' ? *c + 32 : *c);
        }
        int32_t id;
        if (strstr(pre_name, "jina-v2-de") || strstr(pre_name, "jina-v2-es") || strstr(pre_name, "jina-v2-code") ||
            strstr(arch, "nomic-bert-moe") || strstr(arch, "jina-bert-v3")) {
            if ((id = vocab_id_of(v, "<mask>")) >= 0) v->tokens[id].attr |= VOCAB_ATTR_LSTRIP;
        } else if (strstr(name, "phi-3") || strstr(name, "phi3")) {
            for (int i = 0; i < v->n_special; i++) {
                v->tokens[v->special[i]].attr |= VOCAB_ATTR_RSTRIP;
            }
            if ((id = vocab_id_of(v, "</s>")) >= 0) v->tokens[id].attr |= VOCAB_ATTR_RSTRIP;
            if ((id = vocab_id_of(v, "<unk>")) >= 0) v->tokens[id].attr &= ~VOCAB_ATTR_RSTRIP;
            if ((id = vocab_id_of(v, "<s>")) >= 0) v->tokens[id].attr &= ~VOCAB_ATTR_RSTRIP;
            if ((id = vocab_id_of(v, "<|endoftext|>")) >= 0) v->tokens[id].attr &= ~VOCAB_ATTR_RSTRIP;
        } else if (strstr(name, "modern-bert")) {
            if ((id = vocab_id_of(v, "[MASK]")) >= 0) v->tokens[id].attr |= VOCAB_ATTR_LSTRIP;
        }
    }

    // bytes
    for (int b = 0; b < 256; b++) {
        char key[8];
        snprintf(key, sizeof key, "<0x%02X>", b);
        int32_t id = vocab_map_find(v->token_map, key);
        if (id < 0 && b != 0) {
            key[0] = (char) b;
            key[1] = '\0';
            id = vocab_map_find(v->token_map, key);
        }
        v->spm_byte_id[b] = id;
    }
    {
        int k = 0;
        for (int b = 0; b < 256; b++) {
            const bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            v->bpe_byte_cp[b] = (uint16_t) (self ? b : 256 + k++);
        }
        for (int c = 0; c < 324; c++) {
            v->bpe_cp_byte[c] = -1;
        }
        for (int b = 0; b < 256; b++) {
            v->bpe_cp_byte[v->bpe_byte_cp[b]] = (int16_t) b;
        }
    }

    // the chat template (Jinja text; kvr_chat_apply recognises its family)
    {
        const char * t;
        size_t tn;
        if ((rc = vocab_get_str(g, "tokenizer.chat_template", &t, &tn)) != KVR_OK) {
            return rc;
        }
        if (t != NULL) {
            if ((v->chat_template = malloc(tn + 1)) == NULL) {
                return kvr_error(KVR_ERR_NOMEM, "vocab: out of memory for the chat template");
            }
            memcpy(v->chat_template, t, tn);
            v->chat_template[tn] = '\0';
        }
    }

    // pieces (the text each token prints with special = true)
    v->piece_off = malloc((size_t) n * sizeof *v->piece_off);
    v->piece_len = malloc((size_t) n * sizeof *v->piece_len);
    if (v->piece_off == NULL || v->piece_len == NULL) {
        return kvr_error(KVR_ERR_NOMEM, "vocab: out of memory for token pieces");
    }
    for (int i = 0; i < n; i++) {
        const size_t start = stbds_arrlenu(v->piece_arena);
        vocab_make_piece(v, i, &v->piece_arena);
        const size_t end = stbds_arrlenu(v->piece_arena);
        if (end > UINT32_MAX) {
            return kvr_error(KVR_ERR_UNSUPP, "tokenizer.ggml.tokens: token texts too large (%zu bytes)", end);
        }
        v->piece_off[i] = (uint32_t) start;
        v->piece_len[i] = (uint32_t) (end - start);
    }
    return KVR_OK;
}

struct kvr_vocab * kvr_vocab_load(const struct kvr_gguf * g) {
    if (g == NULL) {
        kvr_error(KVR_ERR_ARG, "kvr_vocab_load: no GGUF given");
        return NULL;
    }
    struct kvr_vocab * v = calloc(1, sizeof *v);
    if (v == NULL) {
        kvr_error(KVR_ERR_NOMEM, "kvr_vocab_load: out of memory");
        return NULL;
    }
    if (vocab_load_impl(v, g) != KVR_OK) {
        kvr_vocab_free(v);
        return NULL;
    }
    return v;
}

void kvr_vocab_free(struct kvr_vocab * v) {
    if (v == NULL) {
        return;
    }
    stbds_shfree(v->token_map);
    stbds_shfree(v->merge_map);
    stbds_arrfree(v->eog);
    free(v->tokens);
    free(v->text_arena);
    free(v->merge_arena);
    free(v->special);
    stbds_arrfree(v->piece_arena);
    free(v->piece_off);
    free(v->piece_len);
    free(v->chat_template);
    free(v);
}

int kvr_vocab_n_tokens(const struct kvr_vocab * v) { return v ? v->n_tokens : 0; }
enum kvr_vocab_kind kvr_vocab_kind(const struct kvr_vocab * v) { return v ? v->kind : KVR_VOCAB_NONE; }
int32_t kvr_vocab_bos(const struct kvr_vocab * v) { return v ? v->bos : -1; }
int32_t kvr_vocab_eos(const struct kvr_vocab * v) { return v ? v->eos : -1; }
bool kvr_vocab_add_bos(const struct kvr_vocab * v) { return v ? v->add_bos : false; }
int32_t kvr_vocab_eot(const struct kvr_vocab * v) { return v ? v->eot : -1; }
const char * kvr_vocab_chat_template(const struct kvr_vocab * v) { return v ? v->chat_template : NULL; }

bool kvr_vocab_is_eog(const struct kvr_vocab * v, int32_t id) {
    if (v == NULL || id < 0) {
        return false;
    }
    for (int i = 0; i < v->n_eog; i++) {
        if (v->eog[i] == id) {
            return true;
        }
    }
    return false;
}

int kvr_token_to_piece(const struct kvr_vocab * v, int32_t id, char * buf, int cap, bool special) {
    if (v == NULL || id < 0 || id >= v->n_tokens) {
        kvr_error(KVR_ERR_ARG, "kvr_token_to_piece: token id %d is outside the vocabulary (%d tokens)", (int) id,
                  v ? v->n_tokens : 0);
        return 0;
    }
    if (!special && (v->tokens[id].attr & (VOCAB_ATTR_UNKNOWN | VOCAB_ATTR_CONTROL))) {
        return 0;
    }
    const int len = (int) v->piece_len[id];
    if (cap < len || (buf == NULL && len > 0)) {
        return -len;
    }
    if (len > 0) {
        memcpy(buf, v->piece_arena + v->piece_off[id], (size_t) len);
    }
    return len;
}


//
// tokenization: scratch shared by both tokenizers
//

struct spm_symbol {
    int          prev, next;  // neighbours in the chain, -1 at the ends
    const char * text;
    size_t       n;           // bytes; 0 once merged into the left neighbour
};

struct spm_bigram {
    float  score;
    int    left, right;
    size_t size;              // bytes of left + right when queued (stale if they changed)
};

struct bpe_bigram {
    int32_t rank;
    int     left, right;
    size_t  size;
};

struct vocab_frag {           // a piece of the input: a special token, or text
    int32_t id;               // -1: text [off, off + len)
    size_t  off, len;
};

struct vocab_scratch {
    struct vocab_buf    key;     // lookup keys
    struct vocab_buf    text;    // SPM: the escaped fragment; BPE: one byte-encoded word
    struct vocab_buf    utf8;    // BPE: one word in UTF-8
    uint32_t          * cps;     // BPE: code points of the fragment (stb_ds arrays from here on)
    uint8_t           * flags;   // and their VOCAB_CPT_* flags
    size_t            * lens;    // word lengths in code points
    size_t            * lens2;
    struct spm_symbol * sym;     // symbols (both tokenizers use the same layout)
    struct spm_bigram * spm_heap;
    struct bpe_bigram * bpe_heap;
    struct vocab_frag * frags;
    struct vocab_frag * frags2;
    int32_t           * ids;     // the output
};

static void vocab_scratch_free(struct vocab_scratch * s) {
    free(s->key.p);
    free(s->text.p);
    free(s->utf8.p);
    stbds_arrfree(s->cps);
    stbds_arrfree(s->flags);
    stbds_arrfree(s->lens);
    stbds_arrfree(s->lens2);
    stbds_arrfree(s->sym);
    stbds_arrfree(s->spm_heap);
    stbds_arrfree(s->bpe_heap);
    stbds_arrfree(s->frags);
    stbds_arrfree(s->frags2);
    stbds_arrfree(s->ids);
}

// Split symbols [0, n) of s->sym (text, n set) into a chain.
static void vocab_chain(struct spm_symbol * sym, int n) {
    for (int i = 0; i < n; i++) {
        sym[i].prev = i - 1;
        sym[i].next = i + 1 < n ? i + 1 : -1;
    }
}

// Append the UTF-8 characters of s[0, n) as symbols (llama.cpp's split: the lead byte decides).
static int vocab_split_chars(struct vocab_scratch * sc, const char * s, size_t n) {
    stbds_arrsetlen(sc->sym, 0);
    size_t off = 0;
    while (off < n) {
        size_t len = vocab_utf8_len((unsigned char) s[off]);
        if (len > n - off) {
            len = n - off;
        }
        struct spm_symbol sym = { 0, 0, s + off, len };
        stbds_arrput(sc->sym, sym);
        off += len;
    }
    const int count = (int) stbds_arrlen(sc->sym);
    vocab_chain(sc->sym, count);
    return count;
}

//
// special tokens: split them out of the text (llama.cpp's tokenizer_st_partition)
//

static const char * vocab_memmem(const char * h, size_t hn, const char * nd, size_t nn) {
    if (nn == 0 || nn > hn) {
        return NULL;
    }
    const char * end = h + (hn - nn) + 1;
    for (const char * p = h; p < end;) {
        p = memchr(p, nd[0], (size_t) (end - p));
        if (p == NULL) {
            return NULL;
        }
        if (memcmp(p, nd, nn) == 0) {
            return p;
        }
        p++;
    }
    return NULL;
}

// C's isspace in the "C" locale (what llama.cpp strips around tokens).
static bool vocab_is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

// Whether markup[at, at + n) is all true.
static bool vocab_all_markup(const bool * markup, size_t at, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (!markup[at + i]) return false;
    }
    return true;
}

// Leaves the fragments of text[0, n) in sc->frags. User-defined tokens are always split out;
// control and unknown ones with parse_special, and then, where markup is given, only where their
// text lies wholly in bytes it marks: a chat template's own markers, never what a user wrote.
static void vocab_partition(const struct kvr_vocab * v, const char * text, size_t n, bool parse_special,
                            const bool * markup, struct vocab_scratch * sc) {
    stbds_arrsetlen(sc->frags, 0);
    if (n == 0) {
        return;
    }
    struct vocab_frag all = { -1, 0, n };
    stbds_arrput(sc->frags, all);
    for (int k = 0; k < v->n_special; k++) {
        const int32_t id = v->special[k];
        const struct vocab_token * t = &v->tokens[id];
        const bool gated = (t->attr & (VOCAB_ATTR_CONTROL | VOCAB_ATTR_UNKNOWN)) != 0;
        if (gated && !parse_special) {
            continue;
        }
        stbds_arrsetlen(sc->frags2, 0);
        const int nf = (int) stbds_arrlen(sc->frags);
        for (int f = 0; f < nf; f++) {
            const struct vocab_frag fr = sc->frags[f];
            if (fr.id >= 0) {
                stbds_arrput(sc->frags2, fr);
                continue;
            }
            size_t off = fr.off, from = fr.off; // the fragment's rest starts at off; the search at from
            const size_t end = fr.off + fr.len;
            const char * p;
            while (from < end && (p = vocab_memmem(text + from, end - from, t->text, t->len)) != NULL) {
                const size_t at = (size_t) (p - text);
                if (gated && markup && !vocab_all_markup(markup, at, t->len)) {
                    from = at + 1; // the text of a control token, written by a user: it stays text
                    continue;
                }
                size_t left_end = at;
                if (t->attr & VOCAB_ATTR_LSTRIP) {
                    while (left_end > off && vocab_is_space(text[left_end - 1])) left_end--;
                }
                if (left_end > off) {
                    struct vocab_frag left = { -1, off, left_end - off };
                    stbds_arrput(sc->frags2, left);
                }
                struct vocab_frag tok = { id, at, t->len };
                stbds_arrput(sc->frags2, tok);
                off = at + t->len;
                if (t->attr & VOCAB_ATTR_RSTRIP) {
                    while (off < end && vocab_is_space(text[off])) off++;
                }
                from = off;
            }
            if (off < end) {
                struct vocab_frag right = { -1, off, end - off };
                stbds_arrput(sc->frags2, right);
            }
        }
        struct vocab_frag * tmp = sc->frags;
        sc->frags = sc->frags2;
        sc->frags2 = tmp;
    }
}

//
// SPM (llama.cpp's llm_tokenizer_spm): merge the best-scoring adjacent pair that is a token until
// none is left; characters that are no token come out as byte tokens.
//

// The merge queues of both tokenizers: a binary heap over a stb_ds array of small elements,
// ordered by first(a, b), "a comes out before b".
typedef bool (*vocab_heap_first_fn)(const void * a, const void * b);

static void vocab_heap_swap(uint8_t * a, uint8_t * b, size_t size) {
    uint8_t t[32];
    memcpy(t, a, size);
    memcpy(a, b, size);
    memcpy(b, t, size);
}

// the last of n elements was just appended: move it up to its place
static void vocab_heap_sift_up(void * base, size_t n, size_t size, vocab_heap_first_fn first) {
    uint8_t * h = base;
    for (size_t i = n - 1; i > 0; ) {
        const size_t parent = (i - 1) / 2;
        if (!first(h + i * size, h + parent * size)) break;
        vocab_heap_swap(h + i * size, h + parent * size, size);
        i = parent;
    }
}

// copy the first of n elements to out and restore the heap over the n-1 that remain (the
// caller shortens its array)
static void vocab_heap_pop(void * base, size_t n, size_t size, vocab_heap_first_fn first, void * out) {
    uint8_t * h = base;
    memcpy(out, h, size);
    n--;
    if (n == 0) return;
    memcpy(h, h + n * size, size);
    for (size_t i = 0; ; ) {
        const size_t l = 2 * i + 1, r = l + 1;
        size_t best = i;
        if (l < n && first(h + l * size, h + best * size)) best = l;
        if (r < n && first(h + r * size, h + best * size)) best = r;
        if (best == i) break;
        vocab_heap_swap(h + i * size, h + best * size, size);
        i = best;
    }
}

// Whether a comes out of the queue before b: higher score, then the leftmost.
static bool spm_bigram_first(const void * pa, const void * pb) {
    const struct spm_bigram * a = pa, * b = pb;
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void spm_heap_push(struct vocab_scratch * sc, struct spm_bigram b) {
    static_assert(sizeof(struct spm_bigram) <= 32, "vocab_heap_swap's buffer");
    stbds_arrput(sc->spm_heap, b);
    vocab_heap_sift_up(sc->spm_heap, stbds_arrlenu(sc->spm_heap), sizeof(b), spm_bigram_first);
}

static struct spm_bigram spm_heap_pop(struct vocab_scratch * sc) {
    struct spm_bigram top;
    const size_t n = stbds_arrlenu(sc->spm_heap);
    vocab_heap_pop(sc->spm_heap, n, sizeof(top), spm_bigram_first, &top);
    stbds_arrsetlen(sc->spm_heap, n - 1);
    return top;
}

static void spm_try_add(const struct kvr_vocab * v, struct vocab_scratch * sc, int left, int right) {
    if (left < 0 || right < 0) {
        return;
    }
    const struct spm_symbol * l = &sc->sym[left];
    const struct spm_symbol * r = &sc->sym[right];
    const int32_t id = vocab_find(v, &sc->key, l->text, l->n + r->n);
    if (id < 0) {
        return;
    }
    struct spm_bigram b = { v->tokens[id].score, left, right, l->n + r->n };
    spm_heap_push(sc, b);
}

// Tokenize one text fragment; prefix: put a space before it (add_space_prefix).
static int spm_tokenize(const struct kvr_vocab * v, const char * s, size_t n, bool prefix, struct vocab_scratch * sc) {
    // spaces become U+2581 "▁"
    size_t spaces = prefix ? 1 : 0;
    for (size_t i = 0; i < n; i++) {
        spaces += s[i] == ' ';
    }
    if (!vocab_buf_reserve(&sc->text, n + 2 * spaces + 1)) {
        return kvr_error(KVR_ERR_NOMEM, "kvr_tokenize: out of memory");
    }
    char * t = sc->text.p;
    size_t tn = 0;
    if (prefix) {
        memcpy(t, "\xE2\x96\x81", 3);
        tn = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(t + tn, "\xE2\x96\x81", 3);
            tn += 3;
        } else {
            t[tn++] = s[i];
        }
    }
    if (tn == 0) {
        return KVR_OK;
    }

    const int nsym = vocab_split_chars(sc, t, tn);
    stbds_arrsetlen(sc->spm_heap, 0);
    for (int i = 1; i < nsym; i++) {
        spm_try_add(v, sc, i - 1, i);
    }
    while (stbds_arrlen(sc->spm_heap) > 0) {
        const struct spm_bigram b = spm_heap_pop(sc);
        struct spm_symbol * l = &sc->sym[b.left];
        struct spm_symbol * r = &sc->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) {
            continue;  // one of them was merged since
        }
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) {
            sc->sym[r->next].prev = b.left;
        }
        spm_try_add(v, sc, l->prev, b.left);
        spm_try_add(v, sc, b.left, l->next);
    }

    for (int i = 0; i != -1; i = sc->sym[i].next) {
        const struct spm_symbol * sym = &sc->sym[i];
        const int32_t id = vocab_find(v, &sc->key, sym->text, sym->n);
        if (id >= 0) {
            stbds_arrput(sc->ids, id);
            continue;
        }
        for (size_t j = 0; j < sym->n; j++) {  // byte fallback
            const unsigned char byte = (unsigned char) sym->text[j];
            int32_t bid = v->spm_byte_id[byte];
            if (bid < 0) {
                bid = v->unk;
            }
            if (bid < 0) {
                return kvr_error(KVR_ERR_UNSUPP, "kvr_tokenize: byte 0x%02X has no token and the vocab has no <unk>", byte);
            }
            stbds_arrput(sc->ids, bid);
        }
    }
    return KVR_OK;
}

//
// BPE pre-tokenization. llama.cpp splits the text with a list of regexes, each applied to every
// piece the previous one left (matches and the gaps between them both become pieces). The gpt2 and
// llama3 regexes have hand-written splitters there (ported below); the others run through
// std::regex, whose leftmost-first semantics the bpe_m_* matchers reproduce at one position each.
//

struct bpe_chunk {
    const uint32_t * cps;
    const uint8_t  * fl;
    size_t           ini, end;   // the piece being split
};

#define BPE_OUT_OF_RANGE 0xFFFFFFFFu

static inline uint32_t bpe_cp(const struct bpe_chunk * c, size_t pos) {
    return pos >= c->ini && pos < c->end ? c->cps[pos] : BPE_OUT_OF_RANGE;
}

static inline int bpe_fl(const struct bpe_chunk * c, size_t pos) {
    return pos >= c->ini && pos < c->end ? c->fl[pos] : 0;
}

// Record a piece ending at end (empty pieces are dropped).
static void bpe_emit(size_t ** out, size_t * prev_end, size_t end) {
    if (end > *prev_end) {
        stbds_arrput(*out, end - *prev_end);
    }
    *prev_end = end;
}

#define BPE_WLN (VOCAB_CPT_WHITESPACE | VOCAB_CPT_LETTER | VOCAB_CPT_NUMBER)

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
static void bpe_split_gpt2(const struct bpe_chunk * c, size_t ** out) {
    size_t prev = c->ini;
    for (size_t pos = c->ini; pos < c->end;) {
        const uint32_t cpt = c->cps[pos];
        const int flags = c->fl[pos];
        if (cpt == '\'' && pos + 1 < c->end) {
            const uint32_t n1 = c->cps[pos + 1];
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
                pos += 2;
                bpe_emit(out, &prev, pos);
                continue;
            }
            if (pos + 2 < c->end) {
                const uint32_t n2 = c->cps[pos + 2];
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    pos += 3;
                    bpe_emit(out, &prev, pos);
                    continue;
                }
            }
        }
        const int f2 = cpt == ' ' ? bpe_fl(c, pos + 1) : flags;
        if (f2 & VOCAB_CPT_LETTER) {
            pos += cpt == ' ';
            while (bpe_fl(c, pos) & VOCAB_CPT_LETTER) pos++;
            bpe_emit(out, &prev, pos);
            continue;
        }
        if (f2 & VOCAB_CPT_NUMBER) {
            pos += cpt == ' ';
            while (bpe_fl(c, pos) & VOCAB_CPT_NUMBER) pos++;
            bpe_emit(out, &prev, pos);
            continue;
        }
        if (!(f2 & BPE_WLN) && f2 != 0) {
            pos += cpt == ' ';
            while (!(bpe_fl(c, pos) & BPE_WLN) && bpe_fl(c, pos) != 0) pos++;
            bpe_emit(out, &prev, pos);
            continue;
        }
        size_t nws = 0;
        while (bpe_fl(c, pos + nws) & VOCAB_CPT_WHITESPACE) nws++;
        if (nws > 1 && pos + nws < c->end) {  // \s+(?!\S): leave the last one to the next piece
            pos += nws - 1;
            bpe_emit(out, &prev, pos);
            continue;
        }
        if (nws > 0) {
            pos += nws;
            bpe_emit(out, &prev, pos);
            continue;
        }
        pos++;
        bpe_emit(out, &prev, pos);
    }
}

static inline uint32_t bpe_lower_ascii(uint32_t cp) {
    return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// (llama3: max_digits 3; qwen2: 1). letters is the class of \p{L}+ (qwen35 adds the marks, \p{M}).
static void bpe_split_llama3(const struct bpe_chunk * c, size_t max_digits, int letters, size_t ** out) {
    const int wln = VOCAB_CPT_WHITESPACE | letters | VOCAB_CPT_NUMBER;
    size_t prev = c->ini;
    for (size_t pos = c->ini; pos < c->end;) {
        const uint32_t cpt = c->cps[pos];
        const int flags = c->fl[pos];
        if (cpt == '\'' && pos + 1 < c->end) {
            const uint32_t n1 = bpe_lower_ascii(c->cps[pos + 1]);
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
                pos += 2;
                bpe_emit(out, &prev, pos);
                continue;
            }
            if (pos + 2 < c->end) {
                const uint32_t n2 = bpe_lower_ascii(c->cps[pos + 2]);
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    pos += 3;
                    bpe_emit(out, &prev, pos);
                    continue;
                }
            }
        }
        if (!(cpt == '\r' || cpt == '\n' || (flags & VOCAB_CPT_NUMBER))) {
            if ((flags & letters) || (bpe_fl(c, pos + 1) & letters)) {
                pos++;
                while (bpe_fl(c, pos) & letters) pos++;
                bpe_emit(out, &prev, pos);
                continue;
            }
        }
        if (flags & VOCAB_CPT_NUMBER) {
            size_t ini = pos;
            while (bpe_fl(c, pos) & VOCAB_CPT_NUMBER) {
                if (++pos - ini >= max_digits) {
                    bpe_emit(out, &prev, pos);
                    ini = pos;
                }
            }
            bpe_emit(out, &prev, pos);
            continue;
        }
        const int f2 = cpt == ' ' ? bpe_fl(c, pos + 1) : flags;
        if (!(f2 & wln) && flags != 0) {
            pos += cpt == ' ';
            while (!(bpe_fl(c, pos) & wln) && bpe_fl(c, pos) != 0) pos++;
            while (bpe_cp(c, pos) == '\r' || bpe_cp(c, pos) == '\n') pos++;
            bpe_emit(out, &prev, pos);
            continue;
        }
        size_t nws = 0, last_rn = 0;
        while (bpe_fl(c, pos + nws) & VOCAB_CPT_WHITESPACE) {
            const uint32_t c2 = c->cps[pos + nws];
            if (c2 == '\r' || c2 == '\n') {
                last_rn = pos + nws + 1;
            }
            nws++;
        }
        if (last_rn > 0) {  // \s*[\r\n]+
            pos = last_rn;
            bpe_emit(out, &prev, pos);
            continue;
        }
        if (nws > 1 && pos + nws < c->end) {
            pos += nws - 1;
            bpe_emit(out, &prev, pos);
            continue;
        }
        if (nws > 0) {
            pos += nws;
            bpe_emit(out, &prev, pos);
            continue;
        }
        pos++;
        bpe_emit(out, &prev, pos);
    }
}

// \s+$ (deepseek-llm): the trailing whitespace of the piece.
static void bpe_split_ws_end(const struct bpe_chunk * c, size_t ** out) {
    size_t prev = c->ini;
    size_t t = c->end;
    while (t > c->ini && (c->fl[t - 1] & VOCAB_CPT_WHITESPACE)) t--;
    bpe_emit(out, &prev, t);
    bpe_emit(out, &prev, c->end);
}

// A regex as a matcher: the length of its match starting at pos (0: none).
typedef size_t (*bpe_match_fn)(const struct bpe_chunk * c, size_t pos);

static void bpe_split_match(const struct bpe_chunk * c, bpe_match_fn match, size_t ** out) {
    size_t prev = c->ini;
    for (size_t pos = c->ini; pos < c->end;) {
        const size_t n = match(c, pos);
        if (n == 0) {
            pos++;
            continue;
        }
        bpe_emit(out, &prev, pos);  // the gap before the match
        pos += n;
        bpe_emit(out, &prev, pos);
    }
    bpe_emit(out, &prev, c->end);
}

// Classes that std::wregex sees on the raw code points, where llama.cpp first replaces every
// non-ASCII whitespace by U+000B: such code points never fall in a literal range.
static inline uint32_t bpe_wchar(const struct bpe_chunk * c, size_t pos) {
    const uint32_t cp = bpe_cp(c, pos);
    return cp != BPE_OUT_OF_RANGE && cp >= 0x80 && (c->fl[pos] & VOCAB_CPT_WHITESPACE) ? 0x0B : cp;
}

static bool bpe_in_ranges(uint32_t cp, const uint32_t (*r)[2], size_t n) {
    size_t lo = 0, hi = n;  // ranges sorted and disjoint
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (cp < r[mid][0]) {
            hi = mid;
        } else if (cp > r[mid][1]) {
            lo = mid + 1;
        } else {
            return true;
        }
    }
    return false;
}

static bool bpe_is_falcon_punct(const struct bpe_chunk * c, size_t pos) {  // [\p{P}\$\+<=>\^~\|`]
    const uint32_t cp = bpe_cp(c, pos);
    return (bpe_fl(c, pos) & VOCAB_CPT_PUNCT) ||
           (cp < 0x80 && cp != 0 && strchr("$+<=>^~|`", (int) cp) != NULL);
}

static bool bpe_is_default_punct(const struct bpe_chunk * c, size_t pos) {  // [\p{P}\$\+<=>\^~\|]
    const uint32_t cp = bpe_cp(c, pos);
    return (bpe_fl(c, pos) & VOCAB_CPT_PUNCT) ||
           (cp < 0x80 && cp != 0 && strchr("$+<=>^~|", (int) cp) != NULL);
}

static size_t bpe_m_punct_falcon(const struct bpe_chunk * c, size_t pos) {  // [\p{P}\$\+<=>\^~\|`]+
    size_t n = 0;
    while (bpe_is_falcon_punct(c, pos + n)) n++;
    return n;
}

static size_t bpe_m_punct_default(const struct bpe_chunk * c, size_t pos) {  // [\p{P}\$\+<=>\^~\|]+
    size_t n = 0;
    while (bpe_is_default_punct(c, pos + n)) n++;
    return n;
}

static size_t bpe_m_numbers(const struct bpe_chunk * c, size_t pos) {  // \p{N}+
    size_t n = 0;
    while (bpe_fl(c, pos + n) & VOCAB_CPT_NUMBER) n++;
    return n;
}

static size_t bpe_m_number(const struct bpe_chunk * c, size_t pos) {  // \p{N}
    return (bpe_fl(c, pos) & VOCAB_CPT_NUMBER) ? 1 : 0;
}

static size_t bpe_m_digits3(const struct bpe_chunk * c, size_t pos) {  // [0-9][0-9][0-9]
    for (size_t i = 0; i < 3; i++) {
        const uint32_t cp = bpe_cp(c, pos + i);
        if (cp < '0' || cp > '9') {
            return 0;
        }
    }
    return 3;
}

static size_t bpe_m_newline(const struct bpe_chunk * c, size_t pos) {  // [\r\n]
    const uint32_t cp = bpe_cp(c, pos);
    return cp == '\r' || cp == '\n' ? 1 : 0;
}

// \s?X+ for a class X that holds no whitespace: the count of X from pos + skip.
static size_t bpe_ws_opt_run(const struct bpe_chunk * c, size_t pos, bool (*in)(const struct bpe_chunk *, size_t)) {
    size_t start = pos;
    if ((bpe_fl(c, pos) & VOCAB_CPT_WHITESPACE) && in(c, pos + 1)) {
        start = pos + 1;
    }
    size_t n = start;
    while (in(c, n)) n++;
    return n > start ? n - pos : 0;
}

static bool bpe_is_letter(const struct bpe_chunk * c, size_t pos) { return bpe_fl(c, pos) & VOCAB_CPT_LETTER; }
static bool bpe_is_punct(const struct bpe_chunk * c, size_t pos)  { return bpe_fl(c, pos) & VOCAB_CPT_PUNCT; }

static size_t bpe_m_ws_letters(const struct bpe_chunk * c, size_t pos) {  // \s?\p{L}+
    return bpe_ws_opt_run(c, pos, bpe_is_letter);
}

static size_t bpe_m_ws_punct(const struct bpe_chunk * c, size_t pos) {  // \s?\p{P}+
    return bpe_ws_opt_run(c, pos, bpe_is_punct);
}

static bool bpe_is_cjk(const struct bpe_chunk * c, size_t pos) {  // [一-龥ࠀ-一가-퟿]
    const uint32_t cp = bpe_wchar(c, pos);
    return (cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x0800 && cp <= 0x4E00) || (cp >= 0xAC00 && cp <= 0xD7FF);
}

static size_t bpe_m_cjk(const struct bpe_chunk * c, size_t pos) {  // [一-龥ࠀ-一가-퟿]+
    size_t n = 0;
    while (bpe_is_cjk(c, pos + n)) n++;
    return n;
}

// deepseek-llm's letter class: the cased letters (Lu, Ll, Lt) of its regex, written out as ranges.
static const uint32_t bpe_dsl_letters[][2] = {
    {0x00041, 0x0005A}, {0x00061, 0x0007A}, {0x000B5, 0x000B5}, {0x000C0, 0x000D6}, {0x000D8, 0x000F6},
    {0x000F8, 0x001BA}, {0x001BC, 0x001BF}, {0x001C4, 0x00293}, {0x00295, 0x002AF}, {0x00370, 0x00373},
    {0x00376, 0x00377}, {0x0037B, 0x0037D}, {0x0037F, 0x0037F}, {0x00386, 0x00386}, {0x00388, 0x0038A},
    {0x0038C, 0x0038C}, {0x0038E, 0x003A1}, {0x003A3, 0x003F5}, {0x003F7, 0x00481}, {0x0048A, 0x0052F},
    {0x00531, 0x00556}, {0x010A0, 0x010C5}, {0x013A0, 0x013F5}, {0x013F8, 0x013FD}, {0x01C90, 0x01CBA},
    {0x01CBD, 0x01CBF}, {0x01D00, 0x01D2B}, {0x01D6B, 0x01D77}, {0x01D79, 0x01D9A}, {0x01E00, 0x01F15},
    {0x01F18, 0x01F1D}, {0x01F20, 0x01F45}, {0x01F48, 0x01F4D}, {0x01F50, 0x01F57}, {0x01F59, 0x01F59},
    {0x01F5B, 0x01F5B}, {0x01F5D, 0x01F5D}, {0x01F5F, 0x01F7D}, {0x01F80, 0x01FB4}, {0x01FB6, 0x01FBC},
    {0x01FBE, 0x01FBE}, {0x01FC2, 0x01FC4}, {0x01FC6, 0x01FCC}, {0x01FD0, 0x01FD3}, {0x01FD6, 0x01FDB},
    {0x01FE0, 0x01FEC}, {0x01FF2, 0x01FF4}, {0x01FF6, 0x01FFC}, {0x02102, 0x02102}, {0x02107, 0x02107},
    {0x0210A, 0x02113}, {0x02115, 0x02115}, {0x02119, 0x0211D}, {0x02124, 0x02124}, {0x02126, 0x02126},
    {0x02128, 0x02128}, {0x0212A, 0x0212D}, {0x0212F, 0x02134}, {0x02139, 0x02139}, {0x0213C, 0x0213F},
    {0x02145, 0x02149}, {0x0214E, 0x0214E}, {0x02183, 0x02184}, {0x02C00, 0x02C7B}, {0x02C7E, 0x02CE4},
    {0x02CEB, 0x02CEE}, {0x02CF2, 0x02CF3}, {0x0A640, 0x0A66D}, {0x0A680, 0x0A69B}, {0x0A722, 0x0A76F},
    {0x0A771, 0x0A787}, {0x0A78B, 0x0A78E}, {0x0AB70, 0x0ABBF}, {0x0FB00, 0x0FB06}, {0x0FB13, 0x0FB17},
    {0x0FF21, 0x0FF3A}, {0x0FF41, 0x0FF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

static bool bpe_is_dsl_letter(const struct bpe_chunk * c, size_t pos) {
    return bpe_in_ranges(bpe_wchar(c, pos), bpe_dsl_letters, sizeof bpe_dsl_letters / sizeof bpe_dsl_letters[0]);
}

static bool bpe_is_dsl_punct(const struct bpe_chunk * c, size_t pos) {  // [!-/:-~！-／：-～‘-‟　-。]
    const uint32_t cp = bpe_wchar(c, pos);
    return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x7E) || (cp >= 0xFF01 && cp <= 0xFF0F) ||
           (cp >= 0xFF1A && cp <= 0xFF5E) || (cp >= 0x2018 && cp <= 0x201F) || (cp >= 0x3000 && cp <= 0x3002);
}

static size_t bpe_m_dsl_letters(const struct bpe_chunk * c, size_t pos) {
    return bpe_ws_opt_run(c, pos, bpe_is_dsl_letter);
}

static size_t bpe_m_dsl_punct(const struct bpe_chunk * c, size_t pos) {
    return bpe_ws_opt_run(c, pos, bpe_is_dsl_punct);
}

static bool bpe_is_poro(const struct bpe_chunk * c, size_t pos) {  // [^(\s|.,!?…。，、।۔،)]
    const uint32_t cp = bpe_wchar(c, pos);
    if (cp == BPE_OUT_OF_RANGE || (bpe_fl(c, pos) & VOCAB_CPT_WHITESPACE)) {
        return false;
    }
    switch (cp) {
        case '(': case ')': case '|': case '.': case ',': case '!': case '?':
        case 0x2026: case 0x3002: case 0xFF0C: case 0x3001: case 0x0964: case 0x06D4: case 0x060C:
            return false;
        default:
            return true;
    }
}

static size_t bpe_m_poro(const struct bpe_chunk * c, size_t pos) {  // " ?[^(\s|.,!?…。，、।۔،)]+"
    size_t start = pos;
    if (bpe_cp(c, pos) == ' ' && bpe_is_poro(c, pos + 1)) {
        start = pos + 1;
    }
    size_t n = start;
    while (bpe_is_poro(c, n)) n++;
    return n > start ? n - pos : 0;
}

enum bpe_step_kind {
    BPE_STEP_END = 0,
    BPE_STEP_GPT2,
    BPE_STEP_LLAMA3,
    BPE_STEP_QWEN2,
    BPE_STEP_QWEN35,
    BPE_STEP_WS_END,
    BPE_STEP_MATCH,
};

struct bpe_step {
    enum bpe_step_kind kind;
    bpe_match_fn       match;
};

// The regexes of each pre-tokenizer, in llama.cpp's order (llm_tokenizer_bpe).
static const struct bpe_step bpe_pre_steps[VOCAB_PRE_COUNT][6] = {
    [VOCAB_PRE_DEFAULT] = {
        { BPE_STEP_MATCH, bpe_m_punct_default }, { BPE_STEP_GPT2, NULL },
        { BPE_STEP_MATCH, bpe_m_numbers }, { BPE_STEP_MATCH, bpe_m_digits3 },
    },
    [VOCAB_PRE_GPT2]      = { { BPE_STEP_GPT2, NULL } },
    [VOCAB_PRE_FALCON]    = {
        { BPE_STEP_MATCH, bpe_m_punct_falcon }, { BPE_STEP_GPT2, NULL }, { BPE_STEP_MATCH, bpe_m_digits3 },
    },
    [VOCAB_PRE_STARCODER] = { { BPE_STEP_MATCH, bpe_m_number }, { BPE_STEP_GPT2, NULL } },
    [VOCAB_PRE_LLAMA3]    = { { BPE_STEP_LLAMA3, NULL } },
    [VOCAB_PRE_DBRX]      = { { BPE_STEP_LLAMA3, NULL } },
    [VOCAB_PRE_CHATGLM4]  = { { BPE_STEP_LLAMA3, NULL } },
    [VOCAB_PRE_QWEN2]     = { { BPE_STEP_QWEN2, NULL } },
    [VOCAB_PRE_QWEN35]    = { { BPE_STEP_QWEN35, NULL } },
    [VOCAB_PRE_DEEPSEEK_CODER] = {
        { BPE_STEP_MATCH, bpe_m_newline }, { BPE_STEP_MATCH, bpe_m_ws_letters }, { BPE_STEP_MATCH, bpe_m_ws_punct },
        { BPE_STEP_MATCH, bpe_m_cjk }, { BPE_STEP_MATCH, bpe_m_number },
    },
    [VOCAB_PRE_DEEPSEEK_LLM] = {
        { BPE_STEP_MATCH, bpe_m_newline }, { BPE_STEP_MATCH, bpe_m_dsl_letters }, { BPE_STEP_MATCH, bpe_m_dsl_punct },
        { BPE_STEP_WS_END, NULL }, { BPE_STEP_MATCH, bpe_m_cjk }, { BPE_STEP_MATCH, bpe_m_numbers },
    },
    [VOCAB_PRE_PORO]      = { { BPE_STEP_MATCH, bpe_m_poro } },
    [VOCAB_PRE_VIKING]    = { { BPE_STEP_MATCH, bpe_m_poro }, { BPE_STEP_MATCH, bpe_m_number } },
};

// Split sc->cps into words: leaves their lengths (in code points) in sc->lens.
static void bpe_pretokenize(const struct kvr_vocab * v, struct vocab_scratch * sc) {
    const size_t n = stbds_arrlenu(sc->cps);
    stbds_arrsetlen(sc->lens, 0);
    if (n == 0) {
        return;
    }
    stbds_arrput(sc->lens, n);
    const struct bpe_step * steps = bpe_pre_steps[v->pre];
    for (int s = 0; s < 6 && steps[s].kind != BPE_STEP_END; s++) {
        stbds_arrsetlen(sc->lens2, 0);
        struct bpe_chunk c = { sc->cps, sc->flags, 0, 0 };
        const size_t nl = stbds_arrlenu(sc->lens);
        for (size_t i = 0; i < nl; i++) {
            c.ini = c.end;
            c.end = c.ini + sc->lens[i];
            switch (steps[s].kind) {
                case BPE_STEP_GPT2:   bpe_split_gpt2(&c, &sc->lens2);      break;
                case BPE_STEP_LLAMA3: bpe_split_llama3(&c, 3, VOCAB_CPT_LETTER, &sc->lens2); break;
                case BPE_STEP_QWEN2:  bpe_split_llama3(&c, 1, VOCAB_CPT_LETTER, &sc->lens2); break;
                case BPE_STEP_QWEN35: bpe_split_llama3(&c, 1, VOCAB_CPT_LETTER | VOCAB_CPT_MARK, &sc->lens2); break;
                case BPE_STEP_WS_END: bpe_split_ws_end(&c, &sc->lens2);    break;
                case BPE_STEP_MATCH:  bpe_split_match(&c, steps[s].match, &sc->lens2); break;
                case BPE_STEP_END:    break;
            }
        }
        size_t * tmp = sc->lens;
        sc->lens = sc->lens2;
        sc->lens2 = tmp;
    }
}

//
// BPE merges (llama.cpp's llm_tokenizer_bpe_session): within a word, merge the adjacent pair of
// lowest rank until none is left.
//

static bool bpe_bigram_first(const void * pa, const void * pb) {
    const struct bpe_bigram * a = pa, * b = pb;
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void bpe_heap_push(struct vocab_scratch * sc, struct bpe_bigram b) {
    static_assert(sizeof(struct bpe_bigram) <= 32, "vocab_heap_swap's buffer");
    stbds_arrput(sc->bpe_heap, b);
    vocab_heap_sift_up(sc->bpe_heap, stbds_arrlenu(sc->bpe_heap), sizeof(b), bpe_bigram_first);
}

static struct bpe_bigram bpe_heap_pop(struct vocab_scratch * sc) {
    struct bpe_bigram top;
    const size_t n = stbds_arrlenu(sc->bpe_heap);
    vocab_heap_pop(sc->bpe_heap, n, sizeof(top), bpe_bigram_first, &top);
    stbds_arrsetlen(sc->bpe_heap, n - 1);
    return top;
}

static void bpe_try_add(const struct kvr_vocab * v, struct vocab_scratch * sc, int left, int right) {
    if (left < 0 || right < 0) {
        return;
    }
    const struct spm_symbol * l = &sc->sym[left];
    const struct spm_symbol * r = &sc->sym[right];
    if (!vocab_buf_reserve(&sc->key, l->n + r->n + 2)) {
        return;
    }
    memcpy(sc->key.p, l->text, l->n);
    sc->key.p[l->n] = ' ';
    memcpy(sc->key.p + l->n + 1, r->text, r->n);
    sc->key.p[l->n + 1 + r->n] = '\0';
    const int32_t rank = vocab_map_find(v->merge_map, sc->key.p);
    if (rank < 0) {
        return;
    }
    struct bpe_bigram b = { rank, left, right, l->n + r->n };
    bpe_heap_push(sc, b);
}

// Tokenize one byte-encoded word w[0, n).
static void bpe_word(const struct kvr_vocab * v, const char * w, size_t n, struct vocab_scratch * sc) {
    if (v->ignore_merges) {
        const int32_t id = vocab_find(v, &sc->key, w, n);
        if (id >= 0) {
            stbds_arrput(sc->ids, id);
            return;
        }
    }
    const int nsym = vocab_split_chars(sc, w, n);
    stbds_arrsetlen(sc->bpe_heap, 0);
    for (int i = 1; i < nsym; i++) {
        bpe_try_add(v, sc, i - 1, i);
    }
    while (stbds_arrlen(sc->bpe_heap) > 0) {
        const struct bpe_bigram b = bpe_heap_pop(sc);
        struct spm_symbol * l = &sc->sym[b.left];
        struct spm_symbol * r = &sc->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) {
            continue;  // outdated
        }
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) {
            sc->sym[r->next].prev = b.left;
        }
        bpe_try_add(v, sc, l->prev, b.left);
        bpe_try_add(v, sc, b.left, l->next);
    }
    for (int i = 0; i != -1 && nsym > 0; i = sc->sym[i].next) {
        const struct spm_symbol * sym = &sc->sym[i];
        const int32_t id = vocab_find(v, &sc->key, sym->text, sym->n);
        if (id >= 0) {
            stbds_arrput(sc->ids, id);
            continue;
        }
        for (size_t j = 0; j < sym->n; j++) {  // as llama.cpp: each raw byte that is a token
            const int32_t bid = vocab_find(v, &sc->key, sym->text + j, 1);
            if (bid >= 0) {
                stbds_arrput(sc->ids, bid);
            }
        }
    }
}

static int bpe_tokenize(const struct kvr_vocab * v, const char * s, size_t n, struct vocab_scratch * sc) {
    stbds_arrsetlen(sc->cps, 0);
    stbds_arrsetlen(sc->flags, 0);
    for (size_t pos = 0; pos < n;) {
        const uint32_t cp = vocab_utf8_decode((const unsigned char *) s, n, &pos);
        stbds_arrput(sc->cps, cp);
        stbds_arrput(sc->flags, (uint8_t) vocab_cpt_flags(cp));
    }
    bpe_pretokenize(v, sc);

    size_t start = 0;
    const size_t nw = stbds_arrlenu(sc->lens);
    for (size_t w = 0; w < nw; w++) {
        const size_t len = sc->lens[w];
        // the word in UTF-8, then each byte as its GPT-2 code point
        if (!vocab_buf_reserve(&sc->utf8, 4 * len) || !vocab_buf_reserve(&sc->text, 8 * len + 1)) {
            return kvr_error(KVR_ERR_NOMEM, "kvr_tokenize: out of memory");
        }
        size_t un = 0;
        for (size_t i = start; i < start + len; i++) {
            un += vocab_utf8_encode(sc->cps[i], sc->utf8.p + un);
        }
        size_t tn = 0;
        for (size_t i = 0; i < un; i++) {
            tn += vocab_utf8_encode(v->bpe_byte_cp[(unsigned char) sc->utf8.p[i]], sc->text.p + tn);
        }
        bpe_word(v, sc->text.p, tn, sc);
        start += len;
    }
    return KVR_OK;
}

//
// the entry point
//

// kvr_tokenize and kvr_tokenize_markup: markup NULL, or where control tokens may be recognised
static int vocab_tokenize(const struct kvr_vocab * v, const char * text, const bool * markup, int32_t * out, int n_max,
                          bool add_bos, bool parse_special) {
    if (v == NULL || text == NULL || n_max < 0 || (out == NULL && n_max > 0)) {
        return kvr_error(KVR_ERR_ARG, "kvr_tokenize: bad arguments (vocab %p, text %p, out %p, n_max %d)",
                         (const void *) v, (const void *) text, (void *) out, n_max);
    }
    struct vocab_scratch sc;
    memset(&sc, 0, sizeof sc);
    int rc = KVR_OK;
    if (add_bos) {
        if (v->bos < 0) {
            return kvr_error(KVR_ERR_ARG, "kvr_tokenize: BOS asked for, but the vocabulary has no BOS token");
        }
        stbds_arrput(sc.ids, v->bos);
    }
    const size_t n = strlen(text);
    vocab_partition(v, text, n, parse_special, markup, &sc);
    bool prev_special = true;  // SPM: a space goes before the first text and any text after a special token
    const int nf = (int) stbds_arrlen(sc.frags);
    for (int f = 0; f < nf && rc == KVR_OK; f++) {
        const struct vocab_frag fr = sc.frags[f];
        if (fr.id >= 0) {
            stbds_arrput(sc.ids, fr.id);
            prev_special = true;
            continue;
        }
        if (v->kind == KVR_VOCAB_SPM) {
            rc = spm_tokenize(v, text + fr.off, fr.len, v->add_space_prefix && prev_special, &sc);
        } else {
            rc = bpe_tokenize(v, text + fr.off, fr.len, &sc);
        }
        prev_special = false;
    }
    if (rc == KVR_OK) {
        const size_t total = stbds_arrlenu(sc.ids);
        if (total > INT_MAX) {
            rc = kvr_error(KVR_ERR_ARG, "kvr_tokenize: %zu tokens are more than an int counts", total);
        } else {
            const size_t k = total < (size_t) n_max ? total : (size_t) n_max;
            if (k > 0) {
                memcpy(out, sc.ids, k * sizeof *out);
            }
            rc = (int) total;
        }
    }
    vocab_scratch_free(&sc);
    return rc;
}

int kvr_tokenize(const struct kvr_vocab * v, const char * text, int32_t * out, int n_max, bool add_bos,
                 bool parse_special) {
    return vocab_tokenize(v, text, NULL, out, n_max, add_bos, parse_special);
}

int kvr_tokenize_markup(const struct kvr_vocab * v, const char * text, const bool * markup, int32_t * out, int n_max,
                        bool add_bos) {
    if (markup == NULL) {
        return kvr_error(KVR_ERR_ARG, "kvr_tokenize_markup: no markup array");
    }
    return vocab_tokenize(v, text, markup, out, n_max, add_bos, true);
}

size_t kvr_unescape(char * s) {
    char * out = s;
    for (const char * p = s; *p; p++) {
        if (p[0] != '\\' || p[1] == '\0') {
            *out++ = *p;
            continue;
        }
        const char c = *++p;
        const int hi = c == 'x' ? vocab_hex(p[1]) : -1;
        const int lo = hi >= 0 ? vocab_hex(p[2]) : -1;
        if (c == 'n') {
            *out++ = '\n';
        } else if (c == 'r') {
            *out++ = '\r';
        } else if (c == 't') {
            *out++ = '\t';
        } else if (c == '\'' || c == '"' || c == '\\') {
            *out++ = c;
        } else if (lo >= 0) {
            *out++ = (char) (hi * 16 + lo);
            p += 2;
        } else {
            *out++ = '\\';
            *out++ = c;
        }
    }
    *out = '\0';
    return (size_t) (out - s);
}

//
// chat templates
//
// A GGUF file carries its chat template as Jinja text (tokenizer.chat_template). kvr runs no
// Jinja: like llama.cpp's built-in table, it tells the common families apart by substrings only
// they contain, then renders a conversation with a few lines of its own per family. The rules of
// each family (its markers, which contents are trimmed, where a system message goes when the
// family has none) are the ones llama.cpp's table applies, so a prompt kvr renders is the prompt
// llama.cpp renders from the same file.

// The families kvr renders: enum constant and the name --chat-template takes (llama.cpp's).
#define KVR_CHAT_TEMPLATES(X) \
    X(CHATML,            "chatml")            \
    X(LLAMA2,            "llama2")            \
    X(LLAMA2_SYS,        "llama2-sys")        \
    X(LLAMA2_SYS_BOS,    "llama2-sys-bos")    \
    X(LLAMA2_SYS_STRIP,  "llama2-sys-strip")  \
    X(MISTRAL_V1,        "mistral-v1")        \
    X(MISTRAL_V3,        "mistral-v3")        \
    X(MISTRAL_V3_TEKKEN, "mistral-v3-tekken") \
    X(MISTRAL_V7,        "mistral-v7")        \
    X(MISTRAL_V7_TEKKEN, "mistral-v7-tekken") \
    X(PHI3,              "phi3")              \
    X(PHI4,              "phi4")              \
    X(FALCON3,           "falcon3")           \
    X(ZEPHYR,            "zephyr")            \
    X(MONARCH,           "monarch")           \
    X(GEMMA,             "gemma")             \
    X(ORION,             "orion")             \
    X(OPENCHAT,          "openchat")          \
    X(VICUNA,            "vicuna")            \
    X(VICUNA_ORCA,       "vicuna-orca")       \
    X(DEEPSEEK,          "deepseek")          \
    X(DEEPSEEK2,         "deepseek2")         \
    X(DEEPSEEK3,         "deepseek3")         \
    X(COMMAND_R,         "command-r")         \
    X(LLAMA3,            "llama3")            \
    X(CHATGLM3,          "chatglm3")          \
    X(CHATGLM4,          "chatglm4")          \
    X(GLMEDGE,           "glmedge")           \
    X(MINICPM,           "minicpm")           \
    X(EXAONE3,           "exaone3")           \
    X(EXAONE4,           "exaone4")           \
    X(GRANITE,           "granite")           \
    X(MEGREZ,            "megrez")            \
    X(LLAMA4,            "llama4")            \
    X(SMOLVLM,           "smolvlm")           \
    X(GPT_OSS,           "gpt-oss")           \
    X(KIMI_K2,           "kimi-k2")           \
    X(SEED_OSS,          "seed_oss")          \
    X(SOLAR_OPEN,        "solar-open")

enum chat_tmpl {
#define CHAT_ENUM(e, name) CHAT_##e,
    KVR_CHAT_TEMPLATES(CHAT_ENUM)
#undef CHAT_ENUM
    CHAT_TMPL_COUNT,
    // families llama.cpp's table knows and kvr does not render: detected, so that their text
    // is refused by its name instead of being taken for a family it only resembles
    CHAT_NOT_RENDERED,
    CHAT_UNKNOWN,
};

static const char * const chat_tmpl_names[CHAT_TMPL_COUNT] = {
#define CHAT_NAME(e, name) name,
    KVR_CHAT_TEMPLATES(CHAT_NAME)
#undef CHAT_NAME
};

const char * kvr_chat_template_names(void) {
    static char names[1024];
    if (names[0] == '\0') {
        size_t n = 0;
        for (int i = 0; i < CHAT_TMPL_COUNT; i++) {
            n += (size_t) snprintf(names + n, sizeof names - n, "%s%s", i ? ", " : "", chat_tmpl_names[i]);
        }
    }
    return names;
}

static bool chat_has(const char * tmpl, const char * s) {
    return strstr(tmpl, s) != NULL;
}

// The family of a template text, tried in llama.cpp's order (earlier tests win: a Phi 4 template
// also contains ChatML's marker). *other names a family kvr does not render.
static enum chat_tmpl chat_detect(const char * t, const char ** other) {
    for (int i = 0; i < CHAT_TMPL_COUNT; i++) {
        if (strcmp(t, chat_tmpl_names[i]) == 0) {
            return (enum chat_tmpl) i;
        }
    }
    *other = NULL;
#define NOT_RENDERED(name) (*other = (name), CHAT_NOT_RENDERED)
    if (chat_has(t, "<|im_start|>")) {
        return chat_has(t, "<|im_sep|>") ? CHAT_PHI4
             : chat_has(t, "<end_of_utterance>") ? CHAT_SMOLVLM   // <|im_start|> is its BOS only
             : CHAT_CHATML;                                       // ChatML, Qwen 2/2.5/3, SmolLM2, ...
    }
    if (strncmp(t, "mistral", 7) == 0 || chat_has(t, "[INST]")) {
        if (chat_has(t, "[SYSTEM_PROMPT]")) {
            return CHAT_MISTRAL_V7;
        }
        if (chat_has(t, "' [INST] ' + system_message") || chat_has(t, "[AVAILABLE_TOOLS]")) {
            return chat_has(t, " [INST]") ? CHAT_MISTRAL_V1 : chat_has(t, "\"[INST]\"") ? CHAT_MISTRAL_V3_TEKKEN : CHAT_MISTRAL_V3;
        }
        // Llama 2 and the templates made after it
        return chat_has(t, "content.strip()") ? CHAT_LLAMA2_SYS_STRIP
             : chat_has(t, "bos_token + '[INST]") ? CHAT_LLAMA2_SYS_BOS
             : chat_has(t, "<<SYS>>") ? CHAT_LLAMA2_SYS
             : CHAT_LLAMA2;
    }
    if (chat_has(t, "<|assistant|>") && chat_has(t, "<|end|>")) return CHAT_PHI3;
    if (chat_has(t, "[gMASK]<sop>")) return CHAT_CHATGLM4;
    if (chat_has(t, "<|assistant|>") && chat_has(t, "<|user|>")) {
        if (chat_has(t, "<|tool_declare|>")) return NOT_RENDERED("exaone-moe");
        return chat_has(t, "</s>") ? CHAT_FALCON3 : CHAT_GLMEDGE;
    }
    if (chat_has(t, "<|{{ item['role'] }}|>") && chat_has(t, "<|begin_of_image|>")) return CHAT_GLMEDGE;
    if (chat_has(t, "<|user|>") && chat_has(t, "<|endoftext|>")) return CHAT_ZEPHYR;
    if (chat_has(t, "bos_token + message['role']")) return CHAT_MONARCH;
    if (chat_has(t, "<start_of_turn>")) return CHAT_GEMMA;                  // Gemma 1, 2 and 3
    if (chat_has(t, "'\\n\\nAssistant: ' + eos_token")) return CHAT_ORION;
    if (chat_has(t, "GPT4 Correct ")) return CHAT_OPENCHAT;
    if (chat_has(t, "USER: ") && chat_has(t, "ASSISTANT: ")) return chat_has(t, "SYSTEM: ") ? CHAT_VICUNA_ORCA : CHAT_VICUNA;
    if (chat_has(t, "### Instruction:") && chat_has(t, "<|EOT|>")) return CHAT_DEEPSEEK;
    if (chat_has(t, "<|START_OF_TURN_TOKEN|>") && chat_has(t, "<|USER_TOKEN|>")) return CHAT_COMMAND_R;
    if (chat_has(t, "<|start_header_id|>") && chat_has(t, "<|end_header_id|>")) return CHAT_LLAMA3;
    if (chat_has(t, "[gMASK]sop")) return CHAT_CHATGLM3;
    if (chat_has(t, "<\xe7\x94\xa8\xe6\x88\xb7>")) return CHAT_MINICPM;    // "<用户>"
    if (chat_has(t, "'Assistant: ' + message['content'] + eos_token")) return CHAT_DEEPSEEK2;
    if (chat_has(t, "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>") && chat_has(t, "<\xef\xbd\x9c" "User\xef\xbd\x9c>") &&
        chat_has(t, "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>")) {
        return CHAT_DEEPSEEK3;                                               // fullwidth bars, "▁"
    }
    if (chat_has(t, "[|system|]") && chat_has(t, "[|assistant|]") && chat_has(t, "[|endofturn|]")) {
        return chat_has(t, "[|tool|]") ? CHAT_EXAONE4 : CHAT_EXAONE3;
    }
    if (chat_has(t, "rwkv-world") || chat_has(t, "{{- 'User: ' + message['content']|trim + '\\n\\n' -}}")) return NOT_RENDERED("rwkv-world");
    if (chat_has(t, "<|start_of_role|>")) {
        if (chat_has(t, "<tool_call>") || chat_has(t, "<tools>")) {
            return NOT_RENDERED(chat_has(t, "g4_default_system_message") ? "granite-4.0" : "granite-4.1");
        }
        return CHAT_GRANITE;
    }
    if (chat_has(t, "message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]")) {
        return NOT_RENDERED("gigachat");
    }
    if (chat_has(t, "<|role_start|>")) return CHAT_MEGREZ;
    if (chat_has(t, " \xd0\x90\xd1\x81\xd1\x81\xd0\xb8\xd1\x81\xd1\x82\xd0\xb5\xd0\xbd\xd1\x82:")) return NOT_RENDERED("yandex");
    if (chat_has(t, "<role>ASSISTANT</role>")) return NOT_RENDERED("bailing");
    if (chat_has(t, "<|header_start|>") && chat_has(t, "<|header_end|>")) return CHAT_LLAMA4;
    if (chat_has(t, "<|endofuserprompt|>")) return NOT_RENDERED("dots1");
    if (chat_has(t, "<|extra_0|>") && chat_has(t, "<|extra_4|>")) return NOT_RENDERED("hunyuan-moe");
    if (chat_has(t, "<|start|>") && chat_has(t, "<|channel|>")) return CHAT_GPT_OSS;
    if (chat_has(t, "<\xef\xbd\x9chy_Assistant\xef\xbd\x9c>")) return NOT_RENDERED("hunyuan");
    if (chat_has(t, "<|im_assistant|>assistant<|im_middle|>")) return CHAT_KIMI_K2;
    if (chat_has(t, "<seed:bos>")) return CHAT_SEED_OSS;
    if (chat_has(t, "'Assistant: '  + message['content'] + '<|separator|>")) return NOT_RENDERED("grok-2");
    if (chat_has(t, "[unused9]\xe7\xb3\xbb\xe7\xbb\x9f\xef\xbc\x9a[unused10]")) return NOT_RENDERED("pangu-embedded");
    if (chat_has(t, "<|begin|>") && chat_has(t, "<|end|>") && chat_has(t, "<|content|>")) return CHAT_SOLAR_OPEN;
#undef NOT_RENDERED
    return CHAT_UNKNOWN;
}

// The family or KVR_ERR_UNSUPP naming an excerpt of the text and the names kvr knows.
static int chat_resolve(const char * tmpl, enum chat_tmpl * out) {
    if (tmpl == NULL || tmpl[0] == '\0') {
        return kvr_error(KVR_ERR_ARG, "no chat template given (known: %s)", kvr_chat_template_names());
    }
    const char * other = NULL;
    const enum chat_tmpl t = chat_detect(tmpl, &other);
    if (t < CHAT_TMPL_COUNT) {
        *out = t;
        return KVR_OK;
    }
    // an excerpt on one line that cannot drive a terminal: the first 80 bytes, cut at a character,
    // newlines as \n, control bytes (C0, DEL, C1) and bytes that are no UTF-8 as \xHH
    char ex[400];
    size_t n = 0, i = 0;
    const size_t tl = strlen(tmpl);
    while (tmpl[i] && i < 80) {
        size_t next = i;
        const uint32_t cp = vocab_utf8_decode((const unsigned char *) tmpl, tl, &next);
        const bool bad = cp == 0xFFFD && next == i + 1;
        if (cp == '\n') {
            n += (size_t) snprintf(ex + n, sizeof ex - n, "\\n");
        } else if (bad || cp < 0x20 || (cp >= 0x7f && cp < 0xa0)) {
            for (size_t k = i; k < next; k++) n += (size_t) snprintf(ex + n, sizeof ex - n, "\\x%02x", (unsigned char) tmpl[k]);
        } else {
            memcpy(ex + n, tmpl + i, next - i);
            n += next - i;
        }
        i = next;
    }
    ex[n] = '\0';
    const char * more = tmpl[i] ? "..." : "";
    if (t == CHAT_NOT_RENDERED) {
        return kvr_error(KVR_ERR_UNSUPP, "chat template \"%s%s\" is llama.cpp's '%s', which kvr does not render "
                         "(known: %s; --chat-template NAME picks one)", ex, more, other, kvr_chat_template_names());
    }
    return kvr_error(KVR_ERR_UNSUPP, "unknown chat template \"%s%s\" (known: %s; --chat-template NAME picks one)",
                     ex, more, kvr_chat_template_names());
}

const char * kvr_chat_template_detect(const char * tmpl) {
    enum chat_tmpl t;
    return chat_resolve(tmpl, &t) == KVR_OK ? chat_tmpl_names[t] : NULL;
}

// The text being rendered: every byte is counted, the ones that fit are written.
// Whose each byte is goes to markup (when not NULL): the template's own (chat_put) or a message's
// role or content (chat_text, chat_put_trim), which kvr_chat_tokenize keeps from becoming
// control tokens.
struct chat_out {
    char * buf;
    bool * markup;
    size_t cap;
    size_t len;
};

static void chat_putn(struct chat_out * o, const char * s, size_t n, bool markup) {
    for (size_t i = 0; i < n; i++, o->len++) {
        if (o->len < o->cap) {
            o->buf[o->len] = s[i];
            if (o->markup) o->markup[o->len] = markup;
        }
    }
}

// the template's markup
static void chat_put(struct chat_out * o, const char * s) {
    chat_putn(o, s, strlen(s), true);
}

// a message's role or content
static void chat_text(struct chat_out * o, const char * s) {
    chat_putn(o, s, strlen(s), false);
}

// a message's content without the white space (C's isspace) at both ends, as llama.cpp's trim()
static void chat_put_trim(struct chat_out * o, const char * s) {
    size_t a = 0, b = strlen(s);
    while (a < b && vocab_is_space(s[a])) a++;
    while (b > a && vocab_is_space(s[b - 1])) b--;
    chat_putn(o, s + a, b - a, false);
}

static bool chat_is(const struct kvr_chat_message * m, const char * role) {
    return strcmp(m->role, role) == 0;
}

// The system messages among msgs[0, n), run together (each trimmed with trim): whether that
// wrote anything.
static bool chat_put_system(struct chat_out * o, const struct kvr_chat_message * msgs, int n, bool trim) {
    const size_t len0 = o->len;
    for (int i = 0; i < n; i++) {
        if (chat_is(&msgs[i], "system")) {
            if (trim) chat_put_trim(o, msgs[i].content); else chat_text(o, msgs[i].content);
        }
    }
    return o->len > len0;
}

// The families that write every message alike: pre, the role, mid, the content, post; then, to open
// the assistant's turn, ass.
struct chat_wrap {
    const char * pre, * mid, * post, * ass;
};

static void chat_put_wrapped(struct chat_out * o, const struct chat_wrap * w, const struct kvr_chat_message * msgs, int n,
                             bool add_ass) {
    for (int i = 0; i < n; i++) {
        chat_put(o, w->pre); chat_text(o, msgs[i].role); chat_put(o, w->mid); chat_text(o, msgs[i].content); chat_put(o, w->post);
    }
    if (add_ass) chat_put(o, w->ass);
}

static void chat_render(enum chat_tmpl t, const struct kvr_chat_message * msgs, int n, bool add_ass, struct chat_out * o) {
    switch (t) {
    case CHAT_CHATML:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n" }, msgs, n, add_ass);
        break;
    case CHAT_MISTRAL_V7:
    case CHAT_MISTRAL_V7_TEKKEN: {
        const char * sp = t == CHAT_MISTRAL_V7 ? " " : "";
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                chat_put(o, "[SYSTEM_PROMPT]"); chat_put(o, sp); chat_text(o, msgs[i].content); chat_put(o, "[/SYSTEM_PROMPT]");
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, "[INST]"); chat_put(o, sp); chat_text(o, msgs[i].content); chat_put(o, "[/INST]");
            } else {
                chat_put(o, sp); chat_text(o, msgs[i].content); chat_put(o, "</s>");
            }
        }
        break;
    }
    case CHAT_MISTRAL_V1:
    case CHAT_MISTRAL_V3:
    case CHAT_MISTRAL_V3_TEKKEN: {
        const char * lead = t == CHAT_MISTRAL_V1 ? " " : "";
        const char * trail = t == CHAT_MISTRAL_V3_TEKKEN ? "" : " ";
        bool in_turn = false;
        for (int i = 0; i < n; i++) {
            if (!in_turn) {
                chat_put(o, lead); chat_put(o, "[INST]"); chat_put(o, trail);
                in_turn = true;
            }
            if (chat_is(&msgs[i], "system")) {
                chat_text(o, msgs[i].content); chat_put(o, "\n\n");
            } else if (chat_is(&msgs[i], "user")) {
                chat_text(o, msgs[i].content); chat_put(o, lead); chat_put(o, "[/INST]");
            } else {
                chat_put(o, trail);
                if (t == CHAT_MISTRAL_V3) chat_put_trim(o, msgs[i].content); else chat_text(o, msgs[i].content);
                chat_put(o, "</s>");
                in_turn = false;
            }
        }
        break;
    }
    case CHAT_LLAMA2:
    case CHAT_LLAMA2_SYS:
    case CHAT_LLAMA2_SYS_BOS:
    case CHAT_LLAMA2_SYS_STRIP: {
        // the first [INST] follows the BOS the tokenizer adds; later turns open their own
        bool in_turn = true;
        chat_put(o, "[INST] ");
        for (int i = 0; i < n; i++) {
            if (!in_turn) {
                chat_put(o, t == CHAT_LLAMA2_SYS_BOS ? "<s>[INST] " : "[INST] ");
                in_turn = true;
            }
            const char * c = msgs[i].content;
            void (*put)(struct chat_out *, const char *) = t == CHAT_LLAMA2_SYS_STRIP ? chat_put_trim : chat_text;
            if (chat_is(&msgs[i], "system")) {
                if (t == CHAT_LLAMA2) { // no system prompt in the format: it opens the first turn
                    put(o, c); chat_put(o, "\n");
                } else {
                    chat_put(o, "<<SYS>>\n"); put(o, c); chat_put(o, "\n<</SYS>>\n\n");
                }
            } else if (chat_is(&msgs[i], "user")) {
                put(o, c); chat_put(o, " [/INST]");
            } else {
                put(o, c); chat_put(o, "</s>");
                in_turn = false;
            }
        }
        break;
    }
    case CHAT_PHI3:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|", "|>\n", "<|end|>\n", "<|assistant|>\n" }, msgs, n, add_ass);
        break;
    case CHAT_PHI4:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>" },
                         msgs, n, add_ass);
        break;
    case CHAT_FALCON3:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|", "|>\n", "\n", "<|assistant|>\n" }, msgs, n, add_ass);
        break;
    case CHAT_ZEPHYR:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|", "|>\n", "<|endoftext|>\n", "<|assistant|>\n" }, msgs, n, add_ass);
        break;
    case CHAT_MONARCH: // every message but the first opens with BOS
        for (int i = 0; i < n; i++) {
            if (i > 0) chat_put(o, "<s>");
            chat_text(o, msgs[i].role); chat_put(o, "\n"); chat_text(o, msgs[i].content); chat_put(o, "</s>\n");
        }
        if (add_ass) chat_put(o, "<s>assistant\n");
        break;
    case CHAT_GEMMA: {
        // no system role: the system texts (trimmed, run together) open the next user turn; the
        // assistant is "model"
        int sys = -1; // the first system message not written yet
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                if (sys < 0) sys = i;
                continue;
            }
            const bool model = chat_is(&msgs[i], "assistant");
            chat_put(o, "<start_of_turn>"); chat_text(o, model ? "model" : msgs[i].role); chat_put(o, "\n");
            if (sys >= 0 && !model) {
                if (chat_put_system(o, msgs + sys, i - sys, true)) chat_put(o, "\n\n");
                sys = -1;
            }
            chat_put_trim(o, msgs[i].content); chat_put(o, "<end_of_turn>\n");
        }
        if (add_ass) chat_put(o, "<start_of_turn>model\n");
        break;
    }
    case CHAT_ORION: { // no system role either: the system texts open the next user turn
        int sys = -1;
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                if (sys < 0) sys = i;
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, "Human: ");
                if (sys >= 0) {
                    if (chat_put_system(o, msgs + sys, i - sys, false)) chat_put(o, "\n\n");
                    sys = -1;
                }
                chat_text(o, msgs[i].content); chat_put(o, "\n\nAssistant: </s>");
            } else {
                chat_text(o, msgs[i].content); chat_put(o, "</s>");
            }
        }
        break;
    }
    case CHAT_OPENCHAT:
        for (int i = 0; i < n; i++) {
            if (!chat_is(&msgs[i], "system")) {
                const char c = msgs[i].role[0];
                const char first[2] = { c >= 'a' && c <= 'z' ? (char) (c - 'a' + 'A') : c, 0 };
                chat_put(o, "GPT4 Correct "); chat_text(o, first); chat_text(o, msgs[i].role[0] ? msgs[i].role + 1 : ""); chat_put(o, ": ");
            }
            chat_text(o, msgs[i].content); chat_put(o, "<|end_of_turn|>");
        }
        if (add_ass) chat_put(o, "GPT4 Correct Assistant:");
        break;
    case CHAT_VICUNA:
    case CHAT_VICUNA_ORCA:
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                if (t == CHAT_VICUNA_ORCA) { chat_put(o, "SYSTEM: "); chat_text(o, msgs[i].content); chat_put(o, "\n"); }
                else { chat_text(o, msgs[i].content); chat_put(o, "\n\n"); }
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, "USER: "); chat_text(o, msgs[i].content); chat_put(o, "\n");
            } else if (chat_is(&msgs[i], "assistant")) {
                chat_put(o, "ASSISTANT: "); chat_text(o, msgs[i].content); chat_put(o, "</s>\n");
            }
        }
        if (add_ass) chat_put(o, "ASSISTANT:");
        break;
    case CHAT_DEEPSEEK:
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                chat_text(o, msgs[i].content);
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, "### Instruction:\n"); chat_text(o, msgs[i].content); chat_put(o, "\n");
            } else if (chat_is(&msgs[i], "assistant")) {
                chat_put(o, "### Response:\n"); chat_text(o, msgs[i].content); chat_put(o, "\n<|EOT|>\n");
            }
        }
        if (add_ass) chat_put(o, "### Response:\n");
        break;
    case CHAT_DEEPSEEK2:
    case CHAT_DEEPSEEK3: {
        const bool v3 = t == CHAT_DEEPSEEK3;
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                chat_text(o, msgs[i].content); chat_put(o, "\n\n");
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, v3 ? "<\xef\xbd\x9cUser\xef\xbd\x9c>" : "User: "); chat_text(o, msgs[i].content);
                if (!v3) chat_put(o, "\n\n");
            } else if (chat_is(&msgs[i], "assistant")) {
                chat_put(o, v3 ? "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>" : "Assistant: "); chat_text(o, msgs[i].content);
                chat_put(o, "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>");
            }
        }
        if (add_ass) chat_put(o, v3 ? "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>" : "Assistant:");
        break;
    }
    case CHAT_COMMAND_R:
        for (int i = 0; i < n; i++) {
            const char * tok = chat_is(&msgs[i], "system") ? "<|SYSTEM_TOKEN|>" : chat_is(&msgs[i], "user") ? "<|USER_TOKEN|>"
                             : chat_is(&msgs[i], "assistant") ? "<|CHATBOT_TOKEN|>" : NULL;
            if (tok) {
                chat_put(o, "<|START_OF_TURN_TOKEN|>"); chat_put(o, tok); chat_put_trim(o, msgs[i].content); chat_put(o, "<|END_OF_TURN_TOKEN|>");
            }
        }
        if (add_ass) chat_put(o, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>");
        break;
    case CHAT_LLAMA3:
    case CHAT_LLAMA4: {
        const bool v4 = t == CHAT_LLAMA4;
        const char * open = v4 ? "<|header_start|>" : "<|start_header_id|>";
        const char * close = v4 ? "<|header_end|>\n\n" : "<|end_header_id|>\n\n";
        for (int i = 0; i < n; i++) {
            chat_put(o, open); chat_text(o, msgs[i].role); chat_put(o, close);
            chat_put_trim(o, msgs[i].content); chat_put(o, v4 ? "<|eot|>" : "<|eot_id|>");
        }
        if (add_ass) { chat_put(o, open); chat_put(o, "assistant"); chat_put(o, close); }
        break;
    }
    case CHAT_CHATGLM3:
    case CHAT_CHATGLM4:
    case CHAT_GLMEDGE:
        if (t != CHAT_GLMEDGE) chat_put(o, t == CHAT_CHATGLM3 ? "[gMASK]sop" : "[gMASK]<sop>");
        for (int i = 0; i < n; i++) {
            chat_put(o, "<|"); chat_text(o, msgs[i].role); chat_put(o, t == CHAT_CHATGLM3 ? "|>\n " : "|>\n"); chat_text(o, msgs[i].content);
        }
        if (add_ass) chat_put(o, t == CHAT_CHATGLM4 ? "<|assistant|>\n" : "<|assistant|>");
        break;
    case CHAT_MINICPM:
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "user")) {
                chat_put(o, "<\xe7\x94\xa8\xe6\x88\xb7>"); chat_put_trim(o, msgs[i].content); chat_put(o, "<AI>");
            } else {
                chat_put_trim(o, msgs[i].content);
            }
        }
        break;
    case CHAT_EXAONE3:
    case CHAT_EXAONE4:
        for (int i = 0; i < n; i++) {
            const bool tool = t == CHAT_EXAONE4 && chat_is(&msgs[i], "tool");
            if (chat_is(&msgs[i], "system") || chat_is(&msgs[i], "assistant") || tool) {
                chat_put(o, "[|"); chat_text(o, msgs[i].role); chat_put(o, "|]"); chat_put_trim(o, msgs[i].content); chat_put(o, "[|endofturn|]\n");
            } else if (chat_is(&msgs[i], "user")) {
                chat_put(o, "[|user|]"); chat_put_trim(o, msgs[i].content); chat_put(o, "\n");
            }
        }
        if (add_ass) chat_put(o, "[|assistant|]");
        break;
    case CHAT_GRANITE:
        for (int i = 0; i < n; i++) {
            chat_put(o, "<|start_of_role|>"); chat_text(o, msgs[i].role); chat_put(o, "<|end_of_role|>");
            if (chat_is(&msgs[i], "assistant_tool_call")) chat_put(o, "<|tool_call|>");
            chat_text(o, msgs[i].content); chat_put(o, "<|end_of_text|>\n");
        }
        if (add_ass) chat_put(o, "<|start_of_role|>assistant<|end_of_role|>");
        break;
    case CHAT_MEGREZ:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|role_start|>", "<|role_end|>", "<|turn_end|>", "<|role_start|>assistant<|role_end|>" },
                         msgs, n, add_ass);
        break;
    case CHAT_SMOLVLM:
        chat_put(o, "<|im_start|>");
        for (int i = 0; i < n; i++) {
            if (chat_is(&msgs[i], "system")) {
                chat_text(o, msgs[i].content); chat_put(o, "\n\n");
            } else {
                chat_put(o, chat_is(&msgs[i], "user") ? "User: " : "Assistant: "); chat_text(o, msgs[i].content); chat_put(o, "<end_of_utterance>\n");
            }
        }
        if (add_ass) chat_put(o, "Assistant:");
        break;
    case CHAT_GPT_OSS:
        for (int i = 0; i < n; i++) {
            chat_put(o, "<|start|>"); chat_text(o, msgs[i].role); chat_put(o, "<|message|>"); chat_text(o, msgs[i].content);
            chat_put(o, chat_is(&msgs[i], "assistant") ? "<|return|>" : "<|end|>");
        }
        if (add_ass) chat_put(o, "<|start|>assistant");
        break;
    case CHAT_KIMI_K2:
        for (int i = 0; i < n; i++) {
            const char * head = chat_is(&msgs[i], "system") ? "<|im_system|>system<|im_middle|>"
                              : chat_is(&msgs[i], "user") ? "<|im_user|>user<|im_middle|>"
                              : chat_is(&msgs[i], "assistant") ? "<|im_assistant|>assistant<|im_middle|>"
                              : chat_is(&msgs[i], "tool") ? "<|im_system|>tool<|im_middle|>" : "";
            chat_put(o, head); chat_text(o, msgs[i].content); chat_put(o, "<|im_end|>");
        }
        if (add_ass) chat_put(o, "<|im_assistant|>assistant<|im_middle|>");
        break;
    case CHAT_SEED_OSS:
        for (int i = 0; i < n; i++) {
            chat_put(o, "<seed:bos>"); chat_text(o, msgs[i].role); chat_put(o, "\n");
            if (chat_is(&msgs[i], "assistant")) chat_put_trim(o, msgs[i].content); else chat_text(o, msgs[i].content);
            chat_put(o, "<seed:eos>");
        }
        if (add_ass) chat_put(o, "<seed:bos>assistant\n");
        break;
    case CHAT_SOLAR_OPEN:
        chat_put_wrapped(o, &(struct chat_wrap) { "<|begin|>", "<|content|>", "<|end|>", "<|begin|>assistant" }, msgs, n, add_ass);
        break;
    case CHAT_TMPL_COUNT:
    case CHAT_NOT_RENDERED:
    case CHAT_UNKNOWN:
        KVR_ASSERT(false); // chat_resolve lets only rendered families through
    }
}

// kvr_chat_apply, and with markup not NULL kvr_chat_apply_markup
static int chat_apply(const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs, bool add_assistant,
                      char * buf, bool * markup, int cap) {
    enum chat_tmpl t;
    const int rc = chat_resolve(tmpl, &t);
    if (rc != KVR_OK) {
        return rc;
    }
    if (n_msgs < 0 || (n_msgs > 0 && msgs == NULL) || cap < 0 || (cap > 0 && buf == NULL)) {
        return kvr_error(KVR_ERR_ARG, "kvr_chat_apply: bad arguments (%d messages at %p, buffer %p of %d bytes)",
                         n_msgs, (const void *) msgs, (void *) buf, cap);
    }
    for (int i = 0; i < n_msgs; i++) {
        if (msgs[i].role == NULL || msgs[i].content == NULL) {
            return kvr_error(KVR_ERR_ARG, "kvr_chat_apply: message %d has no %s", i, msgs[i].role ? "content" : "role");
        }
    }
    struct chat_out o = { buf, markup, (size_t) cap, 0 };
    chat_render(t, msgs, n_msgs, add_assistant, &o);
    if (o.len > INT32_MAX - 1) {
        return kvr_error(KVR_ERR_ARG, "kvr_chat_apply: the rendered conversation is longer than 2 GiB");
    }
    if (o.len < o.cap) {
        buf[o.len] = '\0';
        if (markup) markup[o.len] = false;
    }
    return (int) o.len;
}

int kvr_chat_apply(const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs, bool add_assistant,
                   char * buf, int cap) {
    return chat_apply(tmpl, msgs, n_msgs, add_assistant, buf, NULL, cap);
}

int kvr_chat_apply_markup(const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs, bool add_assistant,
                          char * buf, bool * markup, int cap) {
    if (cap > 0 && markup == NULL) {
        return kvr_error(KVR_ERR_ARG, "kvr_chat_apply_markup: a buffer of %d bytes and no markup array", cap);
    }
    return chat_apply(tmpl, msgs, n_msgs, add_assistant, buf, markup, cap);
}

int kvr_chat_tokenize(const struct kvr_vocab * v, const char * tmpl, const struct kvr_chat_message * msgs, int n_msgs,
                      bool add_assistant, bool add_bos, bool special_in_msgs, int32_t * out, int n_max) {
    const int len = kvr_chat_apply_markup(tmpl, msgs, n_msgs, add_assistant, NULL, NULL, 0);
    if (len < 0) {
        return len;
    }
    char * text = malloc((size_t) len + 1);
    bool * markup = malloc((size_t) len + 1);
    int rc;
    if (text == NULL || markup == NULL) {
        rc = kvr_error(KVR_ERR_NOMEM, "kvr_chat_tokenize: out of memory for %d bytes of conversation", len);
    } else if ((rc = kvr_chat_apply_markup(tmpl, msgs, n_msgs, add_assistant, text, markup, len + 1)) >= 0) {
        rc = special_in_msgs ? kvr_tokenize(v, text, out, n_max, add_bos, true)
                             : kvr_tokenize_markup(v, text, markup, out, n_max, add_bos);
    }
    free(text);
    free(markup);
    return rc;
}

//
// 15. KV cache
//

int64_t kvr_hp_state_floats(const struct kvr_hparams * hp) {
    if (hp->n_recurrent == 0) return 0;
    const struct kvr_gdn_shape sh = {
        .d_conv = (int)hp->ssm_d_conv, .n_k = (int)hp->ssm_n_group, .d_k = (int)hp->ssm_d_state,
        .n_v = (int)hp->ssm_dt_rank, .d_v = (int)hp->ssm_d_state,
    };
    return kvr_gdn_state_floats(&sh);
}

struct kvr_kv_cache * kvr_kv_cache_new(const struct kvr_hparams * hp, int n_ctx, enum kvr_type type_k,
                                       enum kvr_type type_v, struct kvr_backend * be) {
    const int kv_dim = (int)(hp->head_dim * hp->n_head_kv);
    KVR_ASSERT(kv_cache_type_ok(type_k) && kv_cache_type_ok(type_v));
    KVR_ASSERT(hp->head_dim % kvr_blck_size(type_k) == 0 && hp->head_dim % kvr_blck_size(type_v) == 0);
    const size_t row_k = kvr_row_size(type_k, kv_dim), row_v = kvr_row_size(type_v, kv_dim);
    const size_t row_max = row_k > row_v ? row_k : row_v;
    // the attention layers' K and V in one buffer, each at an aligned offset, then the recurrent
    // layers' states (a recurrent layer has no K and V: its planes are NULL)
    const size_t one = (row_max * (size_t)n_ctx + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    const int64_t n_state = kvr_hp_state_floats(hp);
    const size_t one_state = ((size_t)n_state * sizeof(float) + PLAN_ALIGN - 1) & ~(size_t)(PLAN_ALIGN - 1);
    const size_t n_attn = hp->n_layer - hp->n_recurrent;
    const size_t bytes = (size_t)2 * n_attn * one + (size_t)hp->n_recurrent * one_state;
    static _Atomic uint64_t serials;
    struct kvr_kv_cache * c = kvr_calloc(1, sizeof(*c));
    c->serial = atomic_fetch_add(&serials, 1) + 1;
    c->ctx = kvr_init((size_t)(3 * hp->n_layer + 4) * (sizeof(struct kvr_tensor) + 128), true);
    c->buf = c->ctx ? kvr_backend_alloc_buffer(be, bytes) : NULL;
    if (!c->buf) {
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", c->ctx ? kvr_errbuf : "out of memory");
        kvr_free(c->ctx);
        free(c);
        kvr_error(KVR_ERR_NOMEM, "cannot allocate a KV cache of %zu MiB (%d positions): %s", bytes >> 20, n_ctx, msg);
        return NULL;
    }
    c->n_layer = (int)hp->n_layer;
    c->n_ctx   = n_ctx;
    c->kv_dim  = kv_dim;
    c->type_k  = type_k;
    c->type_v  = type_v;
    c->row_k   = row_k;
    c->row_v   = row_v;
    c->k = kvr_calloc(hp->n_layer, sizeof(struct kvr_tensor *));
    c->v = kvr_calloc(hp->n_layer, sizeof(struct kvr_tensor *));
    size_t at = 0;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        if (kvr_layer_recurrent(hp, (int)il)) continue;
        c->k[il] = kvr_set_name(kvr_new_tensor_2d(c->ctx, type_k, kv_dim, n_ctx), "cache_k.%u", il);
        c->v[il] = kvr_set_name(kvr_new_tensor_2d(c->ctx, type_v, kv_dim, n_ctx), "cache_v.%u", il);
        kvr_buffer_place(c->buf, c->k[il], at);
        kvr_buffer_place(c->buf, c->v[il], at + one);
        at += 2 * one;
    }
    KVR_ASSERT(at == 2 * n_attn * one);
    c->n_state = n_state;
    c->state = n_state ? kvr_calloc(hp->n_layer, sizeof(struct kvr_tensor *)) : NULL;
    for (uint32_t il = 0; il < hp->n_layer && n_state; il++) {
        if (!kvr_layer_recurrent(hp, (int)il)) continue;
        c->state[il] = kvr_set_name(kvr_new_tensor_1d(c->ctx, KVR_TYPE_F32, n_state), "cache_state.%u", il);
        kvr_buffer_place(c->buf, c->state[il], at);
        at += one_state;
    }
    // cleared now, so the first prefill does not pay for faulting the cache's pages in
    kvr_buffer_clear(c->buf, 0);
    return c;
}

void kvr_kv_cache_free(struct kvr_kv_cache * c) {
    if (!c) return;
    kvr_buffer_free(c->buf);
    kvr_free(c->ctx);
    free(c->k);
    free(c->v);
    free(c->state);
    free(c);
}

// rows [row0, row0+n) of a layer are contiguous in K and in V: one transfer each, never one per row
void kvr_kv_cache_get_rows(struct kvr_backend * be, const struct kvr_kv_cache * c, int il, int row0, int n,
                           void * k, void * v) {
    KVR_ASSERT(il >= 0 && il < c->n_layer && row0 >= 0 && n >= 0 && row0 + n <= c->n_ctx);
    KVR_ASSERT(c->buf->backend == be && "the cache lives on another backend");
    KVR_ASSERT(c->k[il] && "a recurrent layer has no K and V rows");
    if (k) kvr_backend_tensor_get(c->k[il], k, c->row_k * (size_t)row0, c->row_k * (size_t)n);
    if (v) kvr_backend_tensor_get(c->v[il], v, c->row_v * (size_t)row0, c->row_v * (size_t)n);
}

void kvr_kv_cache_set_rows(struct kvr_backend * be, struct kvr_kv_cache * c, int il, int row0, int n,
                           const void * k, const void * v) {
    KVR_ASSERT(il >= 0 && il < c->n_layer && row0 >= 0 && n >= 0 && row0 + n <= c->n_ctx);
    KVR_ASSERT(c->buf->backend == be && "the cache lives on another backend");
    KVR_ASSERT(c->k[il] && "a recurrent layer has no K and V rows");
    if (k) kvr_backend_tensor_set(c->k[il], k, c->row_k * (size_t)row0, c->row_k * (size_t)n);
    if (v) kvr_backend_tensor_set(c->v[il], v, c->row_v * (size_t)row0, c->row_v * (size_t)n);
}

void kvr_kv_cache_get_state(struct kvr_backend * be, const struct kvr_kv_cache * c, int il, float * out) {
    KVR_ASSERT(il >= 0 && il < c->n_layer && c->state && c->state[il] && c->buf->backend == be);
    kvr_backend_tensor_get(c->state[il], out, 0, sizeof(float) * (size_t)c->n_state);
}

void kvr_kv_cache_set_state(struct kvr_backend * be, struct kvr_kv_cache * c, int il, const float * in) {
    KVR_ASSERT(il >= 0 && il < c->n_layer && c->state && c->state[il] && c->buf->backend == be);
    kvr_backend_tensor_set(c->state[il], in, 0, sizeof(float) * (size_t)c->n_state);
}

void kvr_kv_rows_to_float(enum kvr_type type, const void * rows, float * out, int n_rows, int kv_dim) {
    kvr_to_float(type, rows, out, (int64_t)n_rows * kv_dim);
}

void kvr_kv_rows_from_float(enum kvr_type type, const float * x, void * rows, int n_rows, int kv_dim) {
    const int64_t n = (int64_t)n_rows * kv_dim;
    KVR_ASSERT(kv_cache_type_ok(type));
    if (type == KVR_TYPE_Q8_0) {
        for (int64_t b = 0; b < n / 32; b++) kvr_kv_quant_q8_0(x + 32 * b, (struct kvr_block_q8_0 *)rows + b);
    } else {
        type_from_float(type)(x, rows, n);
    }
}

//
// 16. KV cache files (kvr.h, "KV cache files"): the writer a save or a stream feeds layer by layer,
// and the reader that checks every field, CRC and position before anything reaches a cache (the
// replication logs, which share the header's model fingerprint, are kvr-comm.c's)
//

// CRC32C, reflected polynomial 0x82F63B78, eight table lookups per 8 bytes (slice-by-8): a
// 2k-token cache of a 1B model is ~90 MB, which a byte at a time would take long to check
static uint32_t crc32c_table[8][256];
static pthread_once_t crc32c_once = PTHREAD_ONCE_INIT;

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) crc32c_table[t][i] = (crc32c_table[t - 1][i] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][i] & 0xff];
    }
}

uint32_t kvr_crc32c(uint32_t crc, const void * data, size_t n) {
    pthread_once(&crc32c_once, crc32c_init);
    const uint8_t * p = data;
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = crc32c_table[7][lo & 0xff] ^ crc32c_table[6][(lo >> 8) & 0xff] ^ crc32c_table[5][(lo >> 16) & 0xff] ^
              crc32c_table[4][lo >> 24] ^ crc32c_table[3][hi & 0xff] ^ crc32c_table[2][(hi >> 8) & 0xff] ^
              crc32c_table[1][(hi >> 16) & 0xff] ^ crc32c_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc32c_table[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

// kvr_hash64: four lanes of 8-byte words, each step bijective in its lane (xor the word, multiply
// by an odd constant, rotate), so a change confined to one lane always changes the result; the
// lanes run in parallel in the CPU, so that memory, not the arithmetic, sets the pace (it runs at
// about memcpy's speed). The tail and the length go into the last fold, then an avalanche spreads
// every bit over the result.
#define H64_K1 0x9e3779b97f4a7c15ull
#define H64_K2 0xd6e8feb86659fd93ull

static inline uint64_t h64_step(uint64_t s, uint64_t w) {
    s = (s ^ w) * H64_K1;
    return s << 31 | s >> 33;
}

uint64_t kvr_hash64(uint64_t seed, const void * data, size_t n) {
    const uint8_t * p = data;
    uint64_t l[4] = { seed, seed ^ H64_K2, seed + H64_K1, ~seed };
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32);
        for (int j = 0; j < 4; j++) l[j] = h64_step(l[j], w[j]);
    }
    uint64_t t[4] = { 0 };
    if (n > i) memcpy(t, p + i, n - i);
    uint64_t h = seed ^ (uint64_t)n * H64_K2;
    for (int j = 0; j < 4; j++) h = h64_step(h, l[j] ^ t[j] * H64_K2);
    h ^= h >> 33;
    h *= H64_K2;
    h ^= h >> 29;
    h *= H64_K1;
    return h ^ h >> 32;
}

// The keys of the tokenizer that decide which text the ids in a cache stand for (not the chat
// template nor the BOS/EOS ids: they change what a new prompt becomes, not what a cached id means).
static const char * const vocab_hash_keys[] = {
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
};

static uint64_t vocab_hash(const struct kvr_gguf * g) {
    uint64_t h = kvr_hash64(0, "kvr tokenizer", 13);
    for (size_t k = 0; k < sizeof(vocab_hash_keys) / sizeof(vocab_hash_keys[0]); k++) {
        const struct kvr_gguf_kv * kv = kvr_gguf_get_kv(g, vocab_hash_keys[k]);
        h = kvr_hash64(h, vocab_hash_keys[k], strlen(vocab_hash_keys[k]) + 1);
        if (!kv) continue; // absent: the name alone went in
        const enum kvr_gguf_type et = kv->type == KVR_GGUF_ARRAY ? kv->arr_type : kv->type;
        const uint64_t f[3] = { (uint64_t)kv->type, (uint64_t)et, kv->n };
        h = kvr_hash64(h, f, sizeof(f));
        if (et == KVR_GGUF_STRING) {
            for (uint64_t j = 0; j < kv->n; j++) {
                h = kvr_hash64(h, &kv->strs[j].len, sizeof(kv->strs[j].len));
                h = kvr_hash64(h, kv->strs[j].s, kv->strs[j].len);
            }
        } else {
            h = kvr_hash64(h, kv->data, (size_t)kv->n * gguf_type_size[et]);
        }
    }
    return h;
}

// The tensors' metadata, then the whole data section (padding too) from the model's host copy.
static uint64_t weights_hash(const struct kvr_model * m) {
    uint64_t h = kvr_hash64(0, "kvr weights", 11);
    const struct kvr_gguf * g = m->gguf;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct kvr_gguf_tensor * t = &g->tensors[i];
        const uint64_t f[7] = { (uint64_t)t->n_dims, (uint64_t)t->ne[0], (uint64_t)t->ne[1], (uint64_t)t->ne[2],
                                (uint64_t)t->ne[3], (uint64_t)t->type, t->offset };
        h = kvr_hash64(h, t->name, strlen(t->name) + 1);
        h = kvr_hash64(h, f, sizeof(f));
    }
    // tiled weights (KVR_FLAG_TILED) hash as the file has them: from its mapping, whose pages the
    // process then gives back again (weights_read)
    const uint8_t * d = m->weights && m->n_tiled == 0 ? (const uint8_t *)m->weights->base : g->base + g->data_offset;
    h = kvr_hash64(h, d, g->size - g->data_offset);
    if (m->n_tiled > 0 && g->mapped) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        const uintptr_t d0 = ((uintptr_t)d + page - 1) & ~(uintptr_t)(page - 1), d1 = ((uintptr_t)g->base + g->size) & ~(uintptr_t)(page - 1);
        if (d1 > d0) madvise((void *)d0, d1 - d0, MADV_DONTNEED);
    }
    return h;
}

// Made on the first call, under one lock for every model: saves and loads are rare, and ranks
// of one session may ask at once. A copy on a backend (kvr_model_to_backend) asks the model it
// was made from, whose weights are in host memory.
static pthread_mutex_t fp_mu = PTHREAD_MUTEX_INITIALIZER;

static const uint64_t * model_fp_hashes(const struct kvr_model * m) {
    while (m->parent) m = m->parent;
    struct kvr_model * mm = (struct kvr_model *)m; // the cache of a model that is const to its users
    pthread_mutex_lock(&fp_mu);
    if (!mm->fp_done) {
        mm->fp_hash[0] = weights_hash(m);
        mm->fp_hash[1] = vocab_hash(m->gguf);
        mm->fp_done = true;
    }
    pthread_mutex_unlock(&fp_mu);
    return mm->fp_hash;
}

uint64_t kvr_model_weights_hash(const struct kvr_model * m) { return model_fp_hashes(m)[0]; }
uint64_t kvr_model_vocab_hash(const struct kvr_model * m) { return model_fp_hashes(m)[1]; }

static void put_u32(uint8_t * p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint32_t get_u32(const uint8_t * p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static float u32_as_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_as_u32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// the header's fields, in file order from offset 16
enum {
    KVH_ARCH, KVH_LAYERS, KVH_HEADS_KV, KVH_HEAD_DIM, KVH_TYPE, KVH_ROT, KVH_ROPE_MODE, KVH_ROPE_BASE, KVH_ROPE_SCALE,
    KVH_VOCAB, KVH_HASH_LO, KVH_HASH_HI, KVH_TOKENS, KVH_RANKS, KVH_SHARDS, KVH_CHUNK, KVH_RING_NEXT, KVH_TOK_LO,
    KVH_TOK_HI, KVH_CRC, KVH_COUNT,
};
static const char * const kvh_names[KVH_COUNT] = {
    "architecture", "layers", "KV heads", "head size", "cache type", "RoPE dims", "RoPE mode", "RoPE base",
    "RoPE scale", "vocabulary size", "weights hash", "weights hash", "tokens", "ranks", "shards", "rows per chunk",
    "ring's next shard", "tokenizer hash", "tokenizer hash", "header CRC32C",
};
#define KVH_OFFSET(f) (16 + 4 * (f))

// the fingerprint of a model as the header holds it (f32 fields bit-wise)
static void kv_fingerprint(const struct kvr_model * m, uint32_t * fp) {
    const struct kvr_hparams * hp = &m->hp;
    fp[KVH_ARCH]       = (uint32_t)hp->arch;
    fp[KVH_LAYERS]     = hp->n_layer;
    fp[KVH_HEADS_KV]   = hp->n_head_kv;
    fp[KVH_HEAD_DIM]   = hp->head_dim;
    fp[KVH_TYPE]       = 0;            // the rows' types: not the model's (its writer puts them)
    fp[KVH_ROT]        = hp->n_rot;
    fp[KVH_ROPE_MODE]  = (uint32_t)hp->rope_mode;
    fp[KVH_ROPE_BASE]  = f32_as_u32(hp->rope_freq_base);
    fp[KVH_ROPE_SCALE] = f32_as_u32(hp->rope_freq_scale);
    fp[KVH_VOCAB]      = hp->n_vocab;
    const uint64_t * h = model_fp_hashes(m);
    fp[KVH_HASH_LO]    = (uint32_t)h[0];
    fp[KVH_HASH_HI]    = (uint32_t)(h[0] >> 32);
    fp[KVH_TOK_LO]     = (uint32_t)h[1];
    fp[KVH_TOK_HI]     = (uint32_t)(h[1] >> 32);
}

// the fingerprint's fields: the model's shape, then the weights and tokenizer hashes
static const int kvh_fp_fields[] = {
    KVH_ARCH, KVH_LAYERS, KVH_HEADS_KV, KVH_HEAD_DIM, KVH_ROT, KVH_ROPE_MODE, KVH_ROPE_BASE, KVH_ROPE_SCALE,
    KVH_VOCAB, KVH_HASH_LO, KVH_HASH_HI, KVH_TOK_LO, KVH_TOK_HI,
};
#define KVH_FP_COUNT ((int)(sizeof(kvh_fp_fields) / sizeof(kvh_fp_fields[0])))

// A header's fingerprint (bytes 16..64 and 84..92, the cache file's and the log's alike) against the model:
// KVR_ERR_ARG naming the first field that differs, what the file has and what the model has.
static int kv_check_model(const char * path, const uint8_t * h, const struct kvr_model * m, const char * what) {
    uint32_t fp[KVH_COUNT] = { 0 }, hv[KVH_COUNT];
    kv_fingerprint(m, fp);
    for (int i = 0; i < KVH_COUNT; i++) hv[i] = get_u32(h + KVH_OFFSET(i));
    for (int fi = 0; fi < KVH_FP_COUNT; fi++) {
        int i = kvh_fp_fields[fi];
        if (hv[i] == fp[i]) continue;
        char a[64], b[64];
        const char * why = "";
        if (i == KVH_ROPE_BASE || i == KVH_ROPE_SCALE) {
            snprintf(a, sizeof(a), "%g", u32_as_f32(hv[i]));
            snprintf(b, sizeof(b), "%g", u32_as_f32(fp[i]));
        } else if (i == KVH_HASH_LO || i == KVH_HASH_HI || i == KVH_TOK_LO || i == KVH_TOK_HI) {
            const bool w = i == KVH_HASH_LO || i == KVH_HASH_HI;
            i = w ? KVH_HASH_LO : KVH_TOK_LO;
            snprintf(a, sizeof(a), "%016llx", (unsigned long long)hv[i] | (unsigned long long)hv[i + 1] << 32);
            snprintf(b, sizeof(b), "%016llx", (unsigned long long)fp[i] | (unsigned long long)fp[i + 1] << 32);
            why = w ? " (the weights differ: another model of the same shape, or the file was changed)"
                    : " (the tokenizer differs: the cached ids mean other text)";
        } else {
            snprintf(a, sizeof(a), "%u", hv[i]);
            snprintf(b, sizeof(b), "%u", fp[i]);
        }
        return kvr_error(KVR_ERR_ARG, "%s: offset %d: the %s is of another model: %s %s, the model %s has %s%s",
                         path, KVH_OFFSET(i), what, kvh_names[i], a, m->path, b, why);
    }
    return KVR_OK;
}

// the rows' types of a header's field at 32: K's in the low 16 bits, V's in the high ones, each a
// KV cache type whose blocks fit the head size
static int kv_types_read(const char * path, const uint8_t * h, const struct kvr_model * m, enum kvr_type * type_k, enum kvr_type * type_v) {
    const uint32_t f = get_u32(h + KVH_OFFSET(KVH_TYPE));
    for (int kind = 0; kind < 2; kind++) {
        const uint32_t t = kind ? f >> 16 : f & 0xffff;
        if (t >= KVR_TYPE_COUNT || !kv_cache_type_ok((enum kvr_type)t) || m->hp.head_dim % kvr_blck_size((enum kvr_type)t) != 0) {
            return kvr_error(KVR_ERR_FORMAT, "%s: offset %d: the cache type field 0x%08x gives %s type %u (%s), not a KV cache type "
                             "(f32, f16, bf16, q8_0) for a head size of %u", path, KVH_OFFSET(KVH_TYPE), f, kind ? "V" : "K",
                             t, t < KVR_TYPE_COUNT ? kvr_type_name((enum kvr_type)t) : "?", m->hp.head_dim);
        }
    }
    *type_k = (enum kvr_type)(f & 0xffff);
    *type_v = (enum kvr_type)(f >> 16);
    return KVR_OK;
}

// the fingerprint for the replication logs' header (kvr-comm.c), which shares bytes 16..64 and 84..92
void kvr_kv_fingerprint_put(const struct kvr_model * m, enum kvr_type type_k, enum kvr_type type_v, uint8_t * h) {
    KVR_ASSERT(kv_cache_type_ok(type_k) && kv_cache_type_ok(type_v));
    uint32_t fp[KVH_COUNT] = { 0 };
    kv_fingerprint(m, fp);
    for (int fi = 0; fi < KVH_FP_COUNT; fi++) put_u32(h + KVH_OFFSET(kvh_fp_fields[fi]), fp[kvh_fp_fields[fi]]);
    put_u32(h + KVH_OFFSET(KVH_TYPE), (uint32_t)type_k | (uint32_t)type_v << 16);
}

int kvr_kv_fingerprint_check(const char * path, const uint8_t * h, const struct kvr_model * m, const char * what,
                             enum kvr_type * type_k, enum kvr_type * type_v) {
    const int rc = kv_check_model(path, h, m, what);
    return rc != KVR_OK ? rc : kv_types_read(path, h, m, type_k, type_v);
}

struct kvr_kv_writer {
    struct kvr_file * file;
    FILE    * f;          // its stream
    char    * path;
    int       n_layer, kv_dim, n_shards, chunk_rows;
    enum kvr_type type_k, type_v; // the rows' types in the file (kvr_kv_writer_layer takes f32)
    size_t    row_k, row_v;
    void    * buf;        //   a shard's rows of one kind in that type
    int     * rows;       // per shard
    int       next_layer, next_shard;
    const struct kvr_hparams * hp; // which layers are recurrent
    int       next_state;          // the recurrent layer whose state comes next (n_layer: done)
    bool      logits;
    int       n_vocab;
    int64_t   bytes;
    int       rc;         // the first write error, kept until close
};

static int kvw_write(struct kvr_kv_writer * w, const void * data, size_t n) {
    if (w->rc != KVR_OK) return w->rc;
    if (n && fwrite(data, 1, n, w->f) != n) {
        w->rc = kvr_error(KVR_ERR_IO, "%s: cannot write the KV cache at offset %lld: %s", w->path, (long long)w->bytes, strerror(errno));
        return w->rc;
    }
    w->bytes += (int64_t)n;
    return KVR_OK;
}

static int kvw_write_crc(struct kvr_kv_writer * w, uint32_t crc) {
    uint8_t b[4];
    put_u32(b, crc);
    return kvw_write(w, b, 4);
}

// i32 values little-endian; returns the CRC continued over them
static uint32_t kvw_write_i32s(struct kvr_kv_writer * w, const int32_t * v, int n, uint32_t crc) {
    uint8_t buf[4096];
    for (int i = 0; i < n; ) {
        int k = 0;
        for (; k < (int)sizeof(buf) / 4 && i < n; k++, i++) put_u32(buf + 4 * k, (uint32_t)v[i]);
        crc = kvr_crc32c(crc, buf, 4 * (size_t)k);
        kvw_write(w, buf, 4 * (size_t)k);
    }
    return crc;
}

int kvr_kv_writer_open(struct kvr_kv_writer ** out, const char * path, const struct kvr_model * m,
                       const struct kvr_kv_layout * lay) {
    *out = NULL;
    const int kv_dim = (int)(m->hp.head_dim * m->hp.n_head_kv);
    KVR_ASSERT(kv_cache_type_ok(lay->type_k) && kv_cache_type_ok(lay->type_v)); // a session's cache types
    if (lay->n_tokens < 0 || lay->n_ranks < 1 || lay->n_ranks > 256 || (lay->n_shards != 1 && lay->n_shards != lay->n_ranks) ||
        lay->ring_next < 0 || lay->ring_next >= lay->n_ranks) {
        return kvr_error(KVR_ERR_ARG, "%s: a cache of %d tokens as %d of %d shards (ring next %d) cannot be written",
                         path, lay->n_tokens, lay->n_shards, lay->n_ranks, lay->ring_next);
    }
    // The file is written beside its destination and renamed onto it at the end (kvr_file_create),
    // so a reader never sees half a cache; only a regular file, or nothing yet, may be the
    // destination (as root, --kv-save /dev/null once turned the device into a regular file).
    struct kvr_file * file;
    const int frc = kvr_file_create(&file, path);
    if (frc != KVR_OK) return frc;
    struct kvr_kv_writer * w = kvr_calloc(1, sizeof(*w));
    w->file = file;
    w->f = kvr_file_stream(file);
    w->path = strdup(path);
    setvbuf(w->f, NULL, _IOFBF, 1 << 20);
    w->n_layer  = (int)m->hp.n_layer;
    w->kv_dim   = kv_dim;
    w->n_shards = lay->n_shards;
    w->type_k = lay->type_k;
    w->type_v = lay->type_v;
    w->row_k  = kvr_row_size(lay->type_k, kv_dim);
    w->row_v  = kvr_row_size(lay->type_v, kv_dim);
    w->chunk_rows = lay->chunk_rows > 0 ? lay->chunk_rows : (int)((1 << 20) / (w->row_k > w->row_v ? w->row_k : w->row_v));
    if (w->chunk_rows < 1) w->chunk_rows = 1;
    w->logits   = lay->logits;
    w->n_vocab  = (int)m->hp.n_vocab;
    w->rows     = kvr_calloc((size_t)lay->n_shards, sizeof(int));
    w->hp       = &m->hp;
    w->next_state = 0;
    while (w->next_state < w->n_layer && !kvr_layer_recurrent(w->hp, w->next_state)) w->next_state++;
    w->next_layer = 0; // the first attention layer: a recurrent one has no K and V
    while (w->next_layer < w->n_layer && kvr_layer_recurrent(w->hp, w->next_layer)) w->next_layer++;

    uint8_t h[KVR_KV_FILE_HEADER] = { 0 };
    memcpy(h, "KVRCACHE", 8);
    put_u32(h + 8, KVR_KV_FILE_VERSION);
    KVR_ASSERT(!lay->rope_long || m->rope_long);
    put_u32(h + 12, (lay->logits ? KVR_KV_FILE_LOGITS : 0) | (m->hp.n_recurrent ? KVR_KV_FILE_STATE | KVR_KV_FILE_ATTN_ONLY : 0) |
                    (lay->rope_long ? KVR_KV_FILE_ROPE_LONG : 0));
    uint32_t fp[KVH_COUNT] = { 0 };
    kv_fingerprint(m, fp);
    fp[KVH_TOKENS]    = (uint32_t)lay->n_tokens;
    fp[KVH_RANKS]     = (uint32_t)lay->n_ranks;
    fp[KVH_SHARDS]    = (uint32_t)lay->n_shards;
    fp[KVH_CHUNK]     = (uint32_t)w->chunk_rows;
    fp[KVH_RING_NEXT] = (uint32_t)lay->ring_next;
    fp[KVH_TYPE]      = (uint32_t)lay->type_k | (uint32_t)lay->type_v << 16;
    int max_rows = 1;
    for (int s = 0; s < lay->n_shards; s++) max_rows = lay->shards[s].n_rows > max_rows ? lay->shards[s].n_rows : max_rows;
    w->buf = kvr_malloc((w->row_k > w->row_v ? w->row_k : w->row_v) * (size_t)max_rows);
    for (int i = 0; i < KVH_CRC; i++) put_u32(h + KVH_OFFSET(i), fp[i]);
    put_u32(h + KVH_OFFSET(KVH_CRC), kvr_crc32c(0, h, KVH_OFFSET(KVH_CRC)));
    kvw_write(w, h, sizeof(h));

    kvw_write_crc(w, kvw_write_i32s(w, lay->tokens, lay->n_tokens, 0));

    uint32_t crc = 0;
    for (int s = 0; s < lay->n_shards; s++) {
        const int32_t pair[2] = { lay->shards[s].rank, lay->shards[s].n_rows };
        crc = kvw_write_i32s(w, pair, 2, crc);
        w->rows[s] = lay->shards[s].n_rows;
    }
    for (int s = 0; s < lay->n_shards; s++) crc = kvw_write_i32s(w, lay->shards[s].pos, lay->shards[s].n_rows, crc);
    kvw_write_crc(w, crc);
    if (w->rc != KVR_OK) {
        const int rc = w->rc;
        kvr_kv_writer_abort(w);
        return rc;
    }
    *out = w;
    return KVR_OK;
}

static void kvw_rows(struct kvr_kv_writer * w, int il, int shard, int kind, const float * f) {
    const int n = w->rows[shard];
    const size_t row = kind ? w->row_v : w->row_k;
    const uint8_t * x = w->buf;
    kvr_kv_rows_from_float(kind ? w->type_v : w->type_k, f, w->buf, n, w->kv_dim);
    for (int r0 = 0; r0 < n; r0 += w->chunk_rows) {
        const int c = n - r0 < w->chunk_rows ? n - r0 : w->chunk_rows;
        uint8_t ch[20];
        put_u32(ch, (uint32_t)il);
        put_u32(ch + 4, (uint32_t)shard);
        put_u32(ch + 8, (uint32_t)kind);
        put_u32(ch + 12, (uint32_t)r0);
        put_u32(ch + 16, (uint32_t)c);
        const uint8_t * data = x + (size_t)r0 * row;
        const size_t nb = (size_t)c * row;
        kvw_write(w, ch, sizeof(ch));
        kvw_write(w, data, nb);
        kvw_write_crc(w, kvr_crc32c(kvr_crc32c(0, ch, sizeof(ch)), data, nb));
    }
}

int kvr_kv_writer_layer(struct kvr_kv_writer * w, int il, int shard, const float * k, const float * v) {
    KVR_ASSERT(il == w->next_layer && shard == w->next_shard); // layers in order, shards in order
    kvw_rows(w, il, shard, 0, k);
    kvw_rows(w, il, shard, 1, v);
    if (++w->next_shard == w->n_shards) {
        w->next_shard = 0;
        do w->next_layer++; while (w->next_layer < w->n_layer && kvr_layer_recurrent(w->hp, w->next_layer));
    }
    return w->rc;
}

int kvr_kv_writer_state(struct kvr_kv_writer * w, int il, const float * state) {
    KVR_ASSERT(w->next_layer == w->n_layer && il == w->next_state); // after the layers, recurrent ones in order
    uint8_t ch[8];
    const int64_t n = kvr_hp_state_floats(w->hp);
    put_u32(ch, (uint32_t)il);
    put_u32(ch + 4, (uint32_t)n);
    kvw_write(w, ch, sizeof(ch));
    kvw_write(w, state, sizeof(float) * (size_t)n);
    kvw_write_crc(w, kvr_crc32c(kvr_crc32c(0, ch, sizeof(ch)), state, sizeof(float) * (size_t)n));
    do w->next_state++; while (w->next_state < w->n_layer && !kvr_layer_recurrent(w->hp, w->next_state));
    return w->rc;
}

int64_t kvr_kv_writer_bytes(const struct kvr_kv_writer * w) { return w->bytes; }

void kvr_kv_writer_abort(struct kvr_kv_writer * w) {
    if (!w) return;
    kvr_file_abort(w->file);
    free(w->buf);
    free(w->rows);
    free(w->path);
    free(w);
}

int kvr_kv_writer_close(struct kvr_kv_writer * w, const float * logits) {
    KVR_ASSERT(w->next_layer == w->n_layer && w->next_state >= w->n_layer); // every layer and state written
    KVR_ASSERT(!w->logits || logits != NULL);
    if (w->logits) {
        const size_t nb = sizeof(float) * (size_t)w->n_vocab;
        kvw_write(w, logits, nb);
        kvw_write_crc(w, kvr_crc32c(0, logits, nb));
    }
    int rc = w->rc;
    if (rc == KVR_OK) {
        rc = kvr_file_commit(w->file); // frees the file either way
        w->file = NULL;
    }
    kvr_kv_writer_abort(w);
    return rc;
}

// the reader: one pass over the file, every byte checked before anything is returned

struct kvr_reader {
    FILE       * f;
    const char * path;
    int64_t      off;
};

// n bytes or a "truncated" error naming what was being read and where
static int kvrd_read(struct kvr_reader * r, void * dst, size_t n, const char * what) {
    const size_t got = n ? fread(dst, 1, n, r->f) : 0;
    if (got != n) {
        if (ferror(r->f)) return kvr_error(KVR_ERR_IO, "%s: cannot read %s at offset %lld: %s", r->path, what, (long long)r->off, strerror(errno));
        return kvr_error(KVR_ERR_FORMAT, "%s: truncated: %s at offset %lld needs %zu bytes, the file ends after %zu",
                         r->path, what, (long long)r->off, n, got);
    }
    r->off += (int64_t)n;
    return KVR_OK;
}

static int kvrd_crc(struct kvr_reader * r, uint32_t want, const char * what) {
    uint8_t b[4];
    const int64_t at = r->off;
    int rc = kvrd_read(r, b, 4, what);
    if (rc != KVR_OK) return rc;
    if (get_u32(b) != want) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: the CRC32C of %s is 0x%08x, the data gives 0x%08x: the file is damaged",
                         r->path, (long long)at, what, get_u32(b), want);
    }
    return KVR_OK;
}

static int kvrd_i32s(struct kvr_reader * r, int32_t * v, int n, uint32_t * crc, const char * what) {
    uint8_t buf[4096];
    for (int i = 0; i < n; ) {
        const int k = n - i < (int)sizeof(buf) / 4 ? n - i : (int)sizeof(buf) / 4;
        int rc = kvrd_read(r, buf, 4 * (size_t)k, what);
        if (rc != KVR_OK) return rc;
        *crc = kvr_crc32c(*crc, buf, 4 * (size_t)k);
        for (int j = 0; j < k; j++) v[i + j] = (int32_t)get_u32(buf + 4 * j);
        i += k;
    }
    return KVR_OK;
}

void kvr_kv_file_free(struct kvr_kv_file * f) {
    if (!f) return;
    for (int s = 0; f->shards && s < f->n_shards; s++) {
        struct kvr_kv_file_shard * sh = &f->shards[s];
        for (int il = 0; il < f->n_layer; il++) {
            if (sh->k) free(sh->k[il]);
            if (sh->v) free(sh->v[il]);
        }
        free(sh->k);
        free(sh->v);
        free(sh->pos);
    }
    free(f->shards);
    for (int il = 0; f->state && il < f->n_layer; il++) free(f->state[il]);
    free(f->state);
    free(f->tokens);
    free(f->logits);
    free(f);
}

static int kv_file_parse(struct kvr_reader * r, const struct kvr_model * m, struct kvr_kv_file * f) {
    const char * path = r->path;
    uint8_t h[KVR_KV_FILE_HEADER];
    const size_t got = fread(h, 1, sizeof(h), r->f);
    if (got < 8 || memcmp(h, "KVRCACHE", 8) != 0) {
        if (got < 8 && ferror(r->f)) return kvr_error(KVR_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
        if (got == 0) return kvr_error(KVR_ERR_FORMAT, "%s: empty file: not a kvr cache file", path);
        if (got < 8 && memcmp(h, "KVRCACHE", got) == 0) {
            return kvr_error(KVR_ERR_FORMAT, "%s: truncated: the magic at offset 0 needs 8 bytes, the file ends after %zu", path, got);
        }
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 0: not a kvr cache file (magic \"KVRCACHE\" expected)", path);
    }
    if (got < 12) return kvr_error(KVR_ERR_FORMAT, "%s: truncated: the header at offset 0 needs %d bytes, the file ends after %zu", path, KVR_KV_FILE_HEADER, got);
    const uint32_t version = get_u32(h + 8);
    if (version > KVR_KV_FILE_VERSION) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: offset 8: version %u is newer than this kvr reads (%d)", path, version, KVR_KV_FILE_VERSION);
    }
    if (version == 1) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version 1 is older than this kvr reads (%d): its fingerprint does not "
                         "cover the weights' bytes and the tokenizer, so the model it was made with cannot be told; save it again",
                         path, KVR_KV_FILE_VERSION);
    }
    if (version == 2) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version 2 is older than this kvr reads (%d): it was written before KV "
                         "caches had a type (its rows are f32, no cache type is recorded); save it again", path, KVR_KV_FILE_VERSION);
    }
    if (version != KVR_KV_FILE_VERSION) return kvr_error(KVR_ERR_FORMAT, "%s: offset 8: version %u is not a kvr cache version", path, version);
    if (got < sizeof(h)) {
        return kvr_error(KVR_ERR_FORMAT, "%s: truncated: the header at offset 0 needs %d bytes, the file ends after %zu", path, KVR_KV_FILE_HEADER, got);
    }
    r->off = sizeof(h);
    const uint32_t crc = kvr_crc32c(0, h, KVH_OFFSET(KVH_CRC));
    if (get_u32(h + KVH_OFFSET(KVH_CRC)) != crc) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset %d: the header's CRC32C is 0x%08x, the header gives 0x%08x: the header is damaged",
                         path, KVH_OFFSET(KVH_CRC), get_u32(h + KVH_OFFSET(KVH_CRC)), crc);
    }
    f->flags = get_u32(h + 12);
    const uint32_t known = KVR_KV_FILE_LOGITS | KVR_KV_FILE_STATE | KVR_KV_FILE_ROPE_LONG | KVR_KV_FILE_ATTN_ONLY;
    if (f->flags & ~known) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 12: flags 0x%x have bits this version does not know (0x%x)", path, f->flags,
                         f->flags & ~known);
    }
    if ((f->flags & KVR_KV_FILE_ROPE_LONG) && !m->rope_long) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 12: the file's keys took long LongRoPE factors (flag 0x%x), the model %s has none",
                         path, KVR_KV_FILE_ROPE_LONG, m->path);
    }
    if (!(f->flags & KVR_KV_FILE_STATE) != !m->hp.n_recurrent) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset 12: the file %s recurrent states, the model %s has %u recurrent layers", path,
                         f->flags & KVR_KV_FILE_STATE ? "holds" : "holds no", m->path, m->hp.n_recurrent);
    }
    uint32_t hv[KVH_COUNT];
    for (int i = 0; i < KVH_COUNT; i++) hv[i] = get_u32(h + KVH_OFFSET(i));
    int rc = kv_check_model(path, h, m, "cache");
    if (rc != KVR_OK) return rc;
    rc = kv_types_read(path, h, m, &f->type_k, &f->type_v);
    if (rc != KVR_OK) return rc;
    const uint32_t lim[][2] = { { KVH_TOKENS, 1u << 24 }, { KVH_RANKS, 256 }, { KVH_CHUNK, 1u << 24 } };
    for (size_t i = 0; i < sizeof(lim) / sizeof(lim[0]); i++) {
        const int fi = (int)lim[i][0];
        if (hv[fi] > lim[i][1] || (fi != KVH_TOKENS && hv[fi] == 0)) {
            return kvr_error(KVR_ERR_FORMAT, "%s: offset %d: %s %u is out of range (%s%u)", path, KVH_OFFSET(fi), kvh_names[fi],
                             hv[fi], fi == KVH_TOKENS ? "at most " : "1 to ", lim[i][1]);
        }
    }
    if (hv[KVH_SHARDS] != 1 && hv[KVH_SHARDS] != hv[KVH_RANKS]) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset %d: %u shards of a cache over %u ranks (1 or %u expected)", path,
                         KVH_OFFSET(KVH_SHARDS), hv[KVH_SHARDS], hv[KVH_RANKS], hv[KVH_RANKS]);
    }
    if (hv[KVH_RING_NEXT] >= hv[KVH_RANKS]) {
        return kvr_error(KVR_ERR_FORMAT, "%s: offset %d: the ring's next shard %u is not one of %u ranks", path,
                         KVH_OFFSET(KVH_RING_NEXT), hv[KVH_RING_NEXT], hv[KVH_RANKS]);
    }
    f->n_tokens   = (int)hv[KVH_TOKENS];
    f->n_ranks    = (int)hv[KVH_RANKS];
    f->n_shards   = (int)hv[KVH_SHARDS];
    f->chunk_rows = (int)hv[KVH_CHUNK];
    f->ring_next  = (int)hv[KVH_RING_NEXT];
    f->n_layer    = (int)m->hp.n_layer;
    f->kv_dim     = (int)(m->hp.head_dim * m->hp.n_head_kv);

    // tokens
    f->tokens = kvr_malloc(sizeof(int32_t) * (size_t)f->n_tokens);
    const int64_t tok_off = r->off;
    uint32_t c = 0;
    rc = kvrd_i32s(r, f->tokens, f->n_tokens, &c, "the token ids");
    if (rc == KVR_OK) rc = kvrd_crc(r, c, "the token ids");
    if (rc != KVR_OK) return rc;
    for (int i = 0; i < f->n_tokens; i++) {
        if (f->tokens[i] < 0 || (uint32_t)f->tokens[i] >= m->hp.n_vocab) {
            return kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: token %d is %d, outside the vocabulary of %u", path,
                             (long long)(tok_off + 4 * i), i, f->tokens[i], m->hp.n_vocab);
        }
    }

    // shard table and positions: read (the row counts bounded first, they size the reads), the
    // CRC (damage is named as damage), then the values
    const int64_t tab_off = r->off;
    int32_t * tab = kvr_malloc(sizeof(int32_t) * 2 * (size_t)f->n_shards);
    c = 0;
    rc = kvrd_i32s(r, tab, 2 * f->n_shards, &c, "the shard table");
    f->shards = kvr_calloc((size_t)f->n_shards, sizeof(*f->shards));
    for (int s = 0; s < f->n_shards && rc == KVR_OK; s++) {
        f->shards[s].rank = tab[2 * s];
        if (tab[2 * s + 1] < 0 || tab[2 * s + 1] > f->n_tokens) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: shard %d has %d rows, the cache %d tokens", path,
                           (long long)(tab_off + 8 * s + 4), s, tab[2 * s + 1], f->n_tokens);
        }
    }
    int64_t * pos_off = kvr_calloc((size_t)f->n_shards, sizeof(int64_t));
    for (int s = 0; s < f->n_shards && rc == KVR_OK; s++) {
        struct kvr_kv_file_shard * sh = &f->shards[s];
        pos_off[s] = r->off;
        sh->pos = kvr_malloc(sizeof(int32_t) * (size_t)tab[2 * s + 1]);
        rc = kvrd_i32s(r, sh->pos, tab[2 * s + 1], &c, "the row positions");
        if (rc == KVR_OK) sh->n_rows = tab[2 * s + 1];
    }
    free(tab);
    if (rc == KVR_OK) rc = kvrd_crc(r, c, "the shard table");
    int64_t total_rows = 0;
    for (int s = 0; s < f->n_shards && rc == KVR_OK; s++) {
        const struct kvr_kv_file_shard * sh = &f->shards[s];
        if (sh->rank < 0 || sh->rank >= f->n_ranks || (f->n_shards > 1 && sh->rank != s)) {
            rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: shard %d has rank %d (%s)", path, (long long)(tab_off + 8 * s), s,
                           sh->rank, f->n_shards > 1 ? "its index expected" : "not one of the cache's ranks");
        }
        total_rows += sh->n_rows;
    }
    if (rc == KVR_OK && f->n_shards == f->n_ranks && total_rows != f->n_tokens) {
        rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: the shards hold %lld rows, the cache %d tokens", path,
                       (long long)tab_off, (long long)total_rows, f->n_tokens);
    }
    uint8_t * seen = kvr_calloc((size_t)f->n_tokens + 1, 1);
    for (int s = 0; s < f->n_shards && rc == KVR_OK; s++) {
        const struct kvr_kv_file_shard * sh = &f->shards[s];
        for (int i = 0; i < sh->n_rows && rc == KVR_OK; i++) {
            const int32_t p = sh->pos[i];
            if (p < 0 || p >= f->n_tokens || (i > 0 && p <= sh->pos[i - 1]) || seen[p]) {
                rc = kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: row %d of shard %d is at position %d (%s)", path,
                               (long long)(pos_off[s] + 4 * i), i, s, p,
                               p < 0 || p >= f->n_tokens ? "outside the cache's tokens" : seen[p] ? "a position held twice" : "positions must increase");
            } else {
                seen[p] = 1;
            }
        }
    }
    free(seen);
    free(pos_off);
    if (rc != KVR_OK) return rc;

    // the layers whose rows the file holds: every one, or (ATTN_ONLY) the attention layers; the
    // rows of a recurrent layer an older file holds are read and dropped
    const bool attn_only = f->flags & KVR_KV_FILE_ATTN_ONLY;
    const int64_t file_layers = f->n_layer - (attn_only ? (int64_t)m->hp.n_recurrent : 0);
    // the size the rest must have: refuse a truncated or overlong file before reading its rows
    int64_t need = r->off;
    for (int s = 0; s < f->n_shards; s++) {
        const int64_t n = f->shards[s].n_rows, chunks = (n + f->chunk_rows - 1) / f->chunk_rows;
        need += file_layers * (2 * chunks * 24 + n * (int64_t)(kvr_row_size(f->type_k, f->kv_dim) + kvr_row_size(f->type_v, f->kv_dim)));
    }
    if (f->flags & KVR_KV_FILE_LOGITS) need += 4 * (int64_t)m->hp.n_vocab + 4;
    f->n_state = kvr_hp_state_floats(&m->hp);
    if (f->flags & KVR_KV_FILE_STATE) need += (int64_t)m->hp.n_recurrent * (12 + 4 * f->n_state);
    struct stat st;
    if (fstat(fileno(r->f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size != need) {
        return kvr_error(KVR_ERR_FORMAT, "%s: %s: the file has %lld bytes, its header and shard table make %lld", path,
                         st.st_size < need ? "truncated" : "trailing bytes", (long long)st.st_size, (long long)need);
    }

    // the rows, chunk by chunk
    for (int s = 0; s < f->n_shards; s++) {
        f->shards[s].k = kvr_calloc((size_t)f->n_layer, sizeof(float *));
        f->shards[s].v = kvr_calloc((size_t)f->n_layer, sizeof(float *));
    }
    for (int il = 0; il < f->n_layer; il++) {
        const bool recurrent = kvr_layer_recurrent(&m->hp, il);
        if (recurrent && attn_only) continue;
        for (int s = 0; s < f->n_shards; s++) {
            struct kvr_kv_file_shard * sh = &f->shards[s];
            for (int kind = 0; kind < 2; kind++) {
                float * x = kvr_malloc(sizeof(float) * (size_t)f->kv_dim * (size_t)sh->n_rows);
                (kind ? sh->v : sh->k)[il] = x;
                const enum kvr_type type = kind ? f->type_v : f->type_k;
                const size_t row = kvr_row_size(type, f->kv_dim);
                uint8_t * raw = kvr_malloc(row * (size_t)(f->chunk_rows < sh->n_rows ? f->chunk_rows : sh->n_rows) + 1);
                for (int r0 = 0; r0 < sh->n_rows; r0 += f->chunk_rows) {
                    const int n = sh->n_rows - r0 < f->chunk_rows ? sh->n_rows - r0 : f->chunk_rows;
                    const int64_t at = r->off;
                    uint8_t ch[20];
                    char what[96];
                    snprintf(what, sizeof(what), "the chunk of layer %d, shard %d, %s rows [%d, %d)", il, s, kind ? "V" : "K", r0, r0 + n);
                    rc = kvrd_read(r, ch, sizeof(ch), what);
                    if (rc != KVR_OK) { free(raw); return rc; }
                    const uint32_t want[5] = { (uint32_t)il, (uint32_t)s, (uint32_t)kind, (uint32_t)r0, (uint32_t)n };
                    static const char * const field[5] = { "layer", "shard", "kind (0 K, 1 V)", "first row", "rows" };
                    for (int j = 0; j < 5; j++) {
                        if (get_u32(ch + 4 * j) != want[j]) {
                            free(raw);
                            return kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: %s: %s is %u, %u expected", path, (long long)(at + 4 * j),
                                             what, field[j], get_u32(ch + 4 * j), want[j]);
                        }
                    }
                    const size_t nb = row * (size_t)n;
                    rc = kvrd_read(r, raw, nb, what);
                    if (rc == KVR_OK) rc = kvrd_crc(r, kvr_crc32c(kvr_crc32c(0, ch, sizeof(ch)), raw, nb), what);
                    if (rc != KVR_OK) { free(raw); return rc; }
                    kvr_kv_rows_to_float(type, raw, x + (size_t)r0 * f->kv_dim, n, f->kv_dim);
                }
                free(raw);
                if (recurrent) { // checked, and no cache has a place for them
                    free(x);
                    (kind ? sh->v : sh->k)[il] = NULL;
                }
            }
        }
    }
    if (f->flags & KVR_KV_FILE_STATE) f->state = kvr_calloc((size_t)f->n_layer, sizeof(float *));
    for (int il = 0; il < f->n_layer && (f->flags & KVR_KV_FILE_STATE); il++) {
        if (!kvr_layer_recurrent(&m->hp, il)) continue;
        const int64_t at = r->off;
        uint8_t ch[8];
        char what[64];
        snprintf(what, sizeof(what), "the recurrent state of layer %d", il);
        rc = kvrd_read(r, ch, sizeof(ch), what);
        if (rc != KVR_OK) return rc;
        if (get_u32(ch) != (uint32_t)il || get_u32(ch + 4) != (uint32_t)f->n_state) {
            return kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: %s: layer %u of %u floats, layer %d of %lld expected", path,
                             (long long)at, what, get_u32(ch), get_u32(ch + 4), il, (long long)f->n_state);
        }
        f->state[il] = kvr_malloc(sizeof(float) * (size_t)f->n_state);
        const size_t nb = sizeof(float) * (size_t)f->n_state;
        rc = kvrd_read(r, f->state[il], nb, what);
        if (rc == KVR_OK) rc = kvrd_crc(r, kvr_crc32c(kvr_crc32c(0, ch, sizeof(ch)), f->state[il], nb), what);
        if (rc != KVR_OK) return rc;
    }
    if (f->flags & KVR_KV_FILE_LOGITS) {
        f->logits = kvr_malloc(sizeof(float) * m->hp.n_vocab);
        const size_t nb = sizeof(float) * m->hp.n_vocab;
        rc = kvrd_read(r, f->logits, nb, "the logits");
        if (rc == KVR_OK) rc = kvrd_crc(r, kvr_crc32c(0, f->logits, nb), "the logits");
        if (rc != KVR_OK) return rc;
    }
    if (fgetc(r->f) != EOF) return kvr_error(KVR_ERR_FORMAT, "%s: offset %lld: trailing bytes after the cache", path, (long long)r->off);
    f->bytes = r->off;
    return KVR_OK;
}

int kvr_kv_file_read(const char * path, const struct kvr_model * m, struct kvr_kv_file ** out) {
    *out = NULL;
    struct kvr_reader r = { .f = kvr_file_read(path), .path = path };
    if (!r.f) return KVR_ERR_IO;
    setvbuf(r.f, NULL, _IOFBF, 1 << 20);
    struct kvr_kv_file * f = kvr_calloc(1, sizeof(*f));
    const int rc = kv_file_parse(&r, m, f);
    fclose(r.f);
    if (rc != KVR_OK) {
        f->n_shards = f->shards ? f->n_shards : 0;
        kvr_kv_file_free(f);
        return rc;
    }
    *out = f;
    return KVR_OK;
}

//
// 17. models: hyper-parameters and weights from GGUF, then the architectures' recipes
//

// room for the weight tensor structs of a model (24 a layer: no architecture has more)
static size_t model_ctx_size(const struct kvr_model * m) {
    return (size_t)(m->hp.n_layer * 24 + 16) * (sizeof(struct kvr_tensor) + 64);
}

struct arch_info {
    const char * name;
    enum kvr_arch arch;
    int (*load)(struct kvr_model * m);                                           // tensors + arch-specific hparams
    struct kvr_tensor * (*build)(const struct kvr_model * m, const struct kvr_build * b);
};



// "%s.key" of the model's architecture
static const char * arch_key(const struct kvr_model * m, const char * suffix) {
    static _Thread_local char buf[128];
    snprintf(buf, sizeof(buf), "%s.%s", m->hp.arch_name, suffix);
    return buf;
}

static int hp_u32(const struct kvr_model * m, const char * suffix, uint32_t * out, bool required, uint32_t def) {
    const char * key = arch_key(m, suffix);
    if (!kvr_gguf_get_kv(m->gguf, key)) {
        if (required) return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing", m->path, key);
        *out = def;
        return KVR_OK;
    }
    if (kvr_gguf_get_u32(m->gguf, key, out)) return kvr_error_prefix(KVR_ERR_FORMAT, "%s", m->path);
    return KVR_OK;
}

static int hp_f32(const struct kvr_model * m, const char * suffix, float * out, bool required, float def) {
    const char * key = arch_key(m, suffix);
    if (!kvr_gguf_get_kv(m->gguf, key)) {
        if (required) return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' is missing", m->path, key);
        *out = def;
        return KVR_OK;
    }
    if (kvr_gguf_get_f32(m->gguf, key, out)) return kvr_error_prefix(KVR_ERR_FORMAT, "%s", m->path);
    return KVR_OK;
}

// A value that must be a positive finite number (an epsilon, a RoPE base, a scaling factor): NaN,
// zero, negatives and infinities run without a word but compute nonsense, so they are refused here.
static int hp_positive(const struct kvr_model * m, const char * suffix, float v) {
    if (v > 0.0f && isfinite(v)) return KVR_OK;
    return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %g must be a positive finite number", m->path, arch_key(m, suffix), (double)v);
}

// The hyper-parameters every architecture shares.
static int load_common_hparams(struct kvr_model * m) {
    struct kvr_hparams * hp = &m->hp;
    if (hp_u32(m, "context_length", &hp->n_ctx_train, false, 2048) ||
        hp_u32(m, "embedding_length", &hp->n_embd, true, 0) ||
        hp_u32(m, "block_count", &hp->n_layer, true, 0) ||
        hp_u32(m, "feed_forward_length", &hp->n_ff, false, 0) ||
        hp_u32(m, "attention.head_count", &hp->n_head, true, 0)) {
        return KVR_ERR_FORMAT;
    }
    if (hp_u32(m, "attention.head_count_kv", &hp->n_head_kv, false, hp->n_head)) return KVR_ERR_FORMAT;
    // each count on its own, then how they divide, so the message names the key that is off
    const struct { const char * suffix; uint32_t v, max; } counts[] = {
        { "embedding_length", hp->n_embd, 1u << 20 }, { "block_count", hp->n_layer, 4096 },
        { "attention.head_count", hp->n_head, 4096 }, { "attention.head_count_kv", hp->n_head_kv, 4096 },
    };
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        if (counts[i].v == 0 || counts[i].v > counts[i].max) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not a count from 1 to %u", m->path,
                             arch_key(m, counts[i].suffix), counts[i].v, counts[i].max);
        }
    }
    // the head size may come from attention.key_length instead (qwen3, gemma3); else it divides the width
    if (hp->n_embd % hp->n_head != 0 && !kvr_gguf_get_kv(m->gguf, arch_key(m, "attention.key_length"))) {
        char heads[128];
        snprintf(heads, sizeof(heads), "%s", arch_key(m, "attention.head_count"));
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not a multiple of '%s' = %u", m->path,
                         arch_key(m, "embedding_length"), hp->n_embd, heads, hp->n_head);
    }
    if (hp->n_head_kv > hp->n_head || hp->n_head % hp->n_head_kv != 0) {
        char heads[128];
        snprintf(heads, sizeof(heads), "%s", arch_key(m, "attention.head_count"));
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u does not divide '%s' = %u (each KV head serves a whole group of query heads)",
                         m->path, arch_key(m, "attention.head_count_kv"), hp->n_head_kv, heads, hp->n_head);
    }
    // the head size may differ from n_embd/n_head (qwen3, gemma3): Q is then head_dim*n_head wide
    uint32_t v_len = 0;
    if (hp_u32(m, "attention.key_length", &hp->head_dim, false, hp->n_embd / hp->n_head) ||
        hp_u32(m, "attention.value_length", &v_len, false, hp->head_dim)) {
        return KVR_ERR_FORMAT;
    }
    if (hp->head_dim == 0 || hp->head_dim > 4096 || v_len != hp->head_dim) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = %u with '%s' = %u: kvr needs keys and values of one head size (1 to 4096)",
                         m->path, arch_key(m, "attention.key_length"), hp->head_dim, arch_key(m, "attention.value_length"), v_len);
    }
    if (hp_u32(m, "rope.dimension_count", &hp->n_rot, false, hp->head_dim)) return KVR_ERR_FORMAT;
    if (hp->n_rot == 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0 || hp->n_rot > 1024) {
        return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = %u is not an even number up to the head size %u",
                         m->path, arch_key(m, "rope.dimension_count"), hp->n_rot, hp->head_dim);
    }
    if (hp_f32(m, "rope.freq_base", &hp->rope_freq_base, false, 10000.0f) ||
        hp_positive(m, "rope.freq_base", hp->rope_freq_base)) {
        return KVR_ERR_FORMAT;
    }
    hp->rope_freq_scale = 1.0f;
    // LongRoPE's converter writes the factor its cosines and sines are scaled by, and the context
    // its short factors were made for (Phi-3); llama.cpp reads both for every architecture
    if (hp_f32(m, "rope.scaling.attn_factor", &hp->rope_attn_factor, false, 1.0f) ||
        hp_positive(m, "rope.scaling.attn_factor", hp->rope_attn_factor) ||
        hp_u32(m, "rope.scaling.original_context_length", &hp->rope_n_ctx_orig, false, hp->n_ctx_train)) {
        return KVR_ERR_FORMAT;
    }
    hp->rope_ext_factor = 0.0f;
    char stype[32] = "none";
    const char * key = arch_key(m, "rope.scaling.type");
    if (kvr_gguf_get_kv(m->gguf, key) && kvr_gguf_get_str(m->gguf, key, stype, sizeof(stype))) {
        return kvr_error_prefix(KVR_ERR_FORMAT, "%s", m->path);
    }
    if (strcmp(stype, "linear") == 0) {
        float factor;
        if (hp_f32(m, "rope.scaling.factor", &factor, true, 1.0f)) return KVR_ERR_FORMAT;
        if (hp_positive(m, "rope.scaling.factor", factor)) return KVR_ERR_FORMAT;
        hp->rope_freq_scale = 1.0f / factor;
    } else if (strcmp(stype, "yarn") == 0) {
        // llama.cpp's YaRN: ext_factor 1; the attention factor it passes to the rope is its
        // get_mscale(factor) times the cancelling 1/(1 + 0.1 ln factor) (the rope multiplies
        // that back) times rope.scaling.attn_factor; beta_fast 32 and beta_slow 1 (kvr_rope_yarn_corr_dims)
        float factor, attn = 1.0f, log_mul = 0.0f;
        if (hp_f32(m, "rope.scaling.factor", &factor, true, 1.0f) || hp_positive(m, "rope.scaling.factor", factor) ||
            hp_u32(m, "rope.scaling.original_context_length", &hp->rope_n_ctx_orig, false, hp->n_ctx_train) ||
            hp_f32(m, "rope.scaling.attn_factor", &attn, false, 1.0f) || hp_positive(m, "rope.scaling.attn_factor", attn) ||
            hp_f32(m, "rope.scaling.yarn_log_multiplier", &log_mul, false, 0.0f)) {
            return KVR_ERR_FORMAT;
        }
        if (log_mul != 0.0f) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = %g (DeepSeek's YaRN magnitude) is not supported", m->path,
                             arch_key(m, "rope.scaling.yarn_log_multiplier"), (double)log_mul);
        }
        if (hp->rope_n_ctx_orig == 0) {
            return kvr_error(KVR_ERR_FORMAT, "%s: metadata '%s' = 0 is not a context length", m->path,
                             arch_key(m, "rope.scaling.original_context_length"));
        }
        hp->rope_freq_scale = 1.0f / factor;
        hp->rope_ext_factor = 1.0f;
        const float f = 1.0f / hp->rope_freq_scale;
        const float ms = f <= 1.0f ? 1.0f : fmaf(0.1f, logf(f), 1.0f);
        hp->rope_attn_factor = ms * (1.0f / fmaf(0.1f, logf(f), 1.0f)) * attn;
    } else if (strcmp(stype, "none") != 0) {
        // (Llama 3.1+'s scaling comes as the tensor rope_freqs.weight, not as a type: the converter
        // writes none, and llama.cpp refuses a type it does not know, as here)
        return kvr_error(KVR_ERR_UNSUPP, "%s: metadata '%s' = '%s' is not supported (none, linear and yarn are; Llama 3.1's "
                         "scaling is read from the tensor rope_freqs.weight)", m->path, arch_key(m, "rope.scaling.type"), stype);
    }
    return KVR_OK;
}

// A weight found in the file (gt, of the shape its caller checked) as a tensor of the model: its type
// one kvr computes with, placed at its offset in the weights' buffer.
static int model_tensor_place(struct kvr_model * m, const struct kvr_gguf_tensor * gt, const char * name, struct kvr_tensor ** out) {
    if (!kvr_type_supported(gt->type)) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' has type %s, which kvr cannot compute with yet",
                         m->path, name, kvr_type_name(gt->type));
    }
    struct kvr_tensor * t = kvr_new_tensor(m->ctx, gt->type, gt->n_dims, gt->ne);
    kvr_buffer_place(m->weights, t, gt->offset);
    t->flags = KVR_FLAG_PARAM;
    snprintf(t->name, sizeof(t->name), "%s", name);
    if (m->tiles && weight_tiles(t)) {
        // (a tensor may be placed twice, as tied embeddings are: its bytes are tiled once)
        const struct kvr_model * owner = m->parent ? m->parent : m;
        bool tiled = false;
        for (int i = 0; i < owner->n_tiled && !tiled; i++) tiled = owner->tiled[i] == gt->offset;
        if (!tiled && !m->parent) {
            size_t * offs = realloc(m->tiled, sizeof(size_t) * (size_t)(m->n_tiled + 1));
            if (!offs) return kvr_error(KVR_ERR_NOMEM, "%s: no memory to tile tensor '%s'", m->path, name);
            m->tiled = offs;
            m->tiled[m->n_tiled++] = gt->offset;
            tiled = kvr_weight_tile(t);
            KVR_ASSERT(tiled);
        }
        if (tiled) t->flags |= KVR_FLAG_TILED;
    }
    *out = t;
    return KVR_OK;
}

// Find a weight by name and check its shape; optional weights may be absent (NULL, OK).
static int model_tensor(struct kvr_model * m, struct kvr_tensor ** out, bool required, int n_dims,
                        int64_t ne0, int64_t ne1, const char * fmt, ...) {
    char name[KVR_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    *out = NULL;
    const struct kvr_gguf_tensor * gt = kvr_gguf_get_tensor(m->gguf, name);
    if (!gt) {
        return required ? kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' is missing", m->path, name) : KVR_OK;
    }
    const int64_t want[2] = { ne0, ne1 };
    bool ok = gt->n_dims == n_dims || (n_dims == 2 && gt->n_dims == 1 && ne1 == 1);
    for (int d = 0; d < 2 && ok; d++) ok = (d < n_dims ? gt->ne[d] == want[d] : gt->ne[d] == 1);
    ok = ok && gt->ne[2] == 1 && gt->ne[3] == 1;
    if (!ok) {
        return kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64 ", %" PRId64 "]",
                         m->path, name, gt->ne[0], gt->ne[1], gt->ne[2], gt->ne[3], ne0, ne1);
    }
    return model_tensor_place(m, gt, name, out);
}

// The same for a 3-D weight [ne0, ne1, ne2] (a mixture of experts' stacked matrices).
static int model_tensor_3d(struct kvr_model * m, struct kvr_tensor ** out, bool required, int64_t ne0, int64_t ne1,
                           int64_t ne2, const char * fmt, ...) {
    char name[KVR_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    *out = NULL;
    const struct kvr_gguf_tensor * gt = kvr_gguf_get_tensor(m->gguf, name);
    if (!gt) {
        return required ? kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' is missing", m->path, name) : KVR_OK;
    }
    if (gt->n_dims != 3 || gt->ne[0] != ne0 || gt->ne[1] != ne1 || gt->ne[2] != ne2) {
        return kvr_error(KVR_ERR_FORMAT, "%s: tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64 ", %" PRId64 ", %" PRId64 "]",
                         m->path, name, gt->ne[0], gt->ne[1], gt->ne[2], gt->ne[3], ne0, ne1, ne2);
    }
    return model_tensor_place(m, gt, name, out);
}

// What every architecture's file has around its layers: the token embedding, the final norm
// (with a bias where norm_bias), the output matrix (tied to the embedding when absent), and the
// FFN width, taken from blk.0.ffn_up.weight when the metadata lacks it.
static int load_embeddings(struct kvr_model * m, bool norm_bias) {
    struct kvr_hparams * hp = &m->hp;
    const int64_t E = hp->n_embd, V = hp->n_vocab;
    if (model_tensor(m, &m->tok_embd, true, 2, E, V, "token_embd.weight") ||
        model_tensor(m, &m->output_norm, true, 1, E, 1, "output_norm.weight") ||
        (norm_bias && model_tensor(m, &m->output_norm_b, true, 1, E, 1, "output_norm.bias")) ||
        model_tensor(m, &m->output, false, 2, E, V, "output.weight")) {
        return KVR_ERR_FORMAT;
    }
    if (!m->output) m->output = m->tok_embd; // tied embeddings
    if (hp->n_ff == 0) {
        const struct kvr_gguf_tensor * t = kvr_gguf_get_tensor(m->gguf, "blk.0.ffn_up.weight");
        hp->n_ff = t ? (uint32_t)t->ne[1] : 0;
    }
    return KVR_OK;
}

//
// architectures: each models/<arch>.c defines <arch>_load and <arch>_build
//

#include "models/build.c"
#include "models/llama.c"
#include "models/qwen.c"
#include "models/falcon.c"
#include "models/gemma3.c"
#include "models/phi3.c"
#include "models/gemma2.c"
#include "models/moe.c"
#include "models/qwen35.c"

static const struct arch_info arch_table[KVR_ARCH_COUNT] = {
    [KVR_ARCH_LLAMA]  = { "llama",  KVR_ARCH_LLAMA,  llama_load,  llama_build  },
    [KVR_ARCH_FALCON] = { "falcon", KVR_ARCH_FALCON, falcon_load, falcon_build },
    [KVR_ARCH_QWEN2]  = { "qwen2",  KVR_ARCH_QWEN2,  qwen2_load,  llama_build  },
    [KVR_ARCH_QWEN3]  = { "qwen3",  KVR_ARCH_QWEN3,  qwen3_load,  llama_build  },
    [KVR_ARCH_GEMMA3] = { "gemma3", KVR_ARCH_GEMMA3, gemma3_load, gemma3_build },
    [KVR_ARCH_PHI3]   = { "phi3",   KVR_ARCH_PHI3,   phi3_load,   llama_build  },
    [KVR_ARCH_GEMMA2] = { "gemma2", KVR_ARCH_GEMMA2, gemma2_load, gemma2_build },
    [KVR_ARCH_QWEN3MOE] = { "qwen3moe", KVR_ARCH_QWEN3MOE, qwen3moe_load, qwen3moe_build },
    [KVR_ARCH_GPTOSS]   = { "gpt-oss",  KVR_ARCH_GPTOSS,   gptoss_load,   gptoss_build   },
    [KVR_ARCH_QWEN35] = { "qwen35", KVR_ARCH_QWEN35, qwen35_load, qwen35_build },
    [KVR_ARCH_QWEN35MOE] = { "qwen35moe", KVR_ARCH_QWEN35MOE, qwen35moe_load, qwen35moe_build },
};

// The weight tensors of a model whose hyper-parameters are read, placed in m->weights (at their
// offsets in the file's data section), and the recipe's per-layer settings. A loaded model and a
// model on a backend (kvr_model_to_backend) both come from here, so they hold the same weights.
static int model_load_weights(struct kvr_model * m) {
    m->ctx = kvr_init(model_ctx_size(m), true);
    m->layers = kvr_calloc(m->hp.n_layer, sizeof(struct kvr_layer));
    if (!m->ctx) return kvr_error(KVR_ERR_NOMEM, "%s: cannot allocate the weights' tensor structs", m->path);
    for (uint32_t il = 0; il < m->hp.n_layer; il++) { // a recipe's load changes what differs per layer
        m->layers[il].rope_base  = m->hp.rope_freq_base;
        m->layers[il].rope_scale = m->hp.rope_freq_scale;
    }
    int rc = arch_table[m->hp.arch].load(m);
    if (rc != KVR_OK) return rc;
    if (!m->rope_freqs && kvr_gguf_get_tensor(m->gguf, "rope_freqs.weight")) {
        return kvr_error(KVR_ERR_UNSUPP, "%s: tensor 'rope_freqs.weight' (per-pair RoPE frequency factors) is not part of the %s graph kvr knows",
                         m->path, m->hp.arch_name);
    }
    static const char * const longrope[2] = { "rope_factors_short.weight", "rope_factors_long.weight" };
    for (int i = 0; i < 2 && !m->rope_long; i++) {
        if (kvr_gguf_get_tensor(m->gguf, longrope[i])) {
            return kvr_error(KVR_ERR_UNSUPP, "%s: tensor '%s' (LongRoPE frequency factors) is not part of the %s graph kvr knows",
                             m->path, longrope[i], m->hp.arch_name);
        }
    }
    return KVR_OK;
}

// Whether this kernel gives madvise'd anonymous memory transparent huge pages ("always" or "madvise"
// selected in /sys/kernel/mm/transparent_hugepage/enabled).
static bool thp_available(void) {
    FILE * f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    char line[256] = "";
    const bool ok = fgets(line, sizeof(line), f) && (strstr(line, "[always]") || strstr(line, "[madvise]"));
    fclose(f);
    return ok;
}

// The data section of g's file copied into anonymous memory advised for 2 MiB pages: a decode
// step reads every weight once, and with 4 KiB pages of the file's mapping it also walks a page
// table for every 4 KiB and its prefetchers stop at each page's end. On the machine of the README's
// table, with 2 threads: a plain read of 512 MiB 35 GB/s in 4 KiB pages, 41 in 2 MiB pages; Q8_0
// decode +12%. *bytes: the length mapped (a multiple of 2 MiB). The copy is made from the mapping
// (already populated), whose pages of the data section are then dropped from this process (the page
// cache keeps them; reading the mapping again would bring them back from the file).
static void * weights_read(const struct kvr_gguf * g, const char * path, size_t * bytes) {
    const size_t huge = (size_t)2 << 20, n = g->size - g->data_offset, len = (n + huge - 1) / huge * huge;
    uint8_t * raw = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        kvr_error(KVR_ERR_NOMEM, "%s: no memory for the weights (%zu MiB): %s", path, n >> 20, strerror(errno));
        return NULL;
    }
    // a start on a 2 MiB boundary: the rest of the over-allocation goes back
    uint8_t * p = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + len + huge > p + len) munmap(p + len, (size_t)(raw + len + huge - (p + len)));
    madvise(p, len, MADV_HUGEPAGE); // advice: without it the copy still works, in 4 KiB pages
    memcpy(p, g->base + g->data_offset, n);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const uintptr_t d0 = ((uintptr_t)g->base + g->data_offset + page - 1) & ~(uintptr_t)(page - 1);
    const uintptr_t d1 = ((uintptr_t)g->base + g->size) & ~(uintptr_t)(page - 1);
    if (g->mapped && d1 > d0) madvise((void *)d0, d1 - d0, MADV_DONTNEED);
    *bytes = len;
    return p;
}

struct kvr_model * kvr_model_load(const char * path, const struct kvr_model_params * params) {
    struct kvr_model * m = kvr_calloc(1, sizeof(*m));
    snprintf(m->path, sizeof(m->path), "%s", path);
    m->gguf = kvr_gguf_open(path);
    if (!m->gguf) goto fail;
    m->vocab = kvr_vocab_load(m->gguf);
    if (!m->vocab) {
        kvr_error_prefix(KVR_ERR_FORMAT, "%s", path);
        goto fail;
    }
    if (params && params->vocab_only) return m;
    if (kvr_gguf_get_str(m->gguf, "general.architecture", m->hp.arch_name, sizeof(m->hp.arch_name))) {
        kvr_error_prefix(KVR_ERR_FORMAT, "%s", path);
        goto fail;
    }
    const struct arch_info * ai = NULL;
    char known[128] = "";
    for (int i = 0; i < KVR_ARCH_COUNT; i++) {
        if (!arch_table[i].name) continue;
        if (strcmp(arch_table[i].name, m->hp.arch_name) == 0) ai = &arch_table[i];
        snprintf(known + strlen(known), sizeof(known) - strlen(known), "%s%s", known[0] ? ", " : "", arch_table[i].name);
    }
    if (!ai) {
        kvr_error(KVR_ERR_UNSUPP, "%s: architecture '%s' (general.architecture) is not supported (known: %s)", path, m->hp.arch_name, known);
        goto fail;
    }
    m->hp.arch = ai->arch;
    if (load_common_hparams(m)) goto fail;
    m->hp.n_vocab = (uint32_t)kvr_vocab_n_tokens(m->vocab);
    // the weights: a host buffer over the file's data section, read into memory of 2 MiB pages or
    // left where the file is mapped (params->mmap, or a kernel without transparent huge pages)
    const size_t n_data = m->gguf->size - m->gguf->data_offset;
    m->weights = buffer_new(NULL, n_data);
    m->weights->base = (void *)(m->gguf->base + m->gguf->data_offset);
    m->weights->host = true;
    if (!(params && params->mmap) && n_data > 0 && thp_available()) {
        void * p = weights_read(m->gguf, path, &m->weights_read);
        if (!p) goto fail;
        m->weights->base = p;
    }
    // tiles (kvr_model_params.no_tiles) in memory of our own, for the CPU's kernels that read them
    m->tiles = QX_TILES && m->weights_read && !(params && params->no_tiles);
    if (model_load_weights(m)) goto fail;
    return m;
fail:
    kvr_model_free(m);
    return NULL;
}

// m's weights with every tiled one back in the file's rows, into plain (m->weights->size bytes);
// false when out of memory.
static bool model_untile(const struct kvr_model * m, uint8_t * plain) {
    memcpy(plain, m->weights->base, m->weights->size);
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) {
        const struct kvr_gguf_tensor * gt = &m->gguf->tensors[i];
        bool tiled = false;
        for (int j = 0; j < m->n_tiled && !tiled; j++) tiled = m->tiled[j] == gt->offset;
        if (!tiled) continue;
        const size_t rb = kvr_row_size(gt->type, gt->ne[0]);
        uint8_t * tmp = malloc(KVR_TILE_ROWS * rb);
        if (!tmp) return false;
        for (int64_t r = 0; r < gt->ne[1]; r += KVR_TILE_ROWS) {
            untile_rows(gt->type, plain + gt->offset + (size_t)r * rb, rb, gt->ne[0] / kvr_blck_size(gt->type), tmp);
        }
        free(tmp);
    }
    return true;
}

struct kvr_model * kvr_model_to_backend(const struct kvr_model * m, struct kvr_backend * be) {
    KVR_ASSERT(m->ctx && !m->parent && "a loaded model, not a vocabulary or a copy");
    struct kvr_model * w = kvr_calloc(1, sizeof(*w));
    memcpy(&w->hp, &m->hp, sizeof(m->hp)); // padding too: compared whole below
    w->gguf   = m->gguf;
    w->vocab  = m->vocab;
    w->parent = m;
    snprintf(w->path, sizeof(w->path), "%s", m->path);
    // the CPU wraps the tiled weights as they are; a device gets the file's rows (its kernels read no tiles)
    w->tiles = m->tiles && be->iface.buf_from_host == cpu_buf_from_host;
    uint8_t * plain = NULL;
    if (m->n_tiled > 0 && !w->tiles) {
        plain = malloc(m->weights->size);
        if (!plain || !model_untile(m, plain)) {
            free(plain);
            free(w);
            kvr_error(KVR_ERR_NOMEM, "%s: no memory for a copy of the weights' rows (%zu MiB)", m->path, m->weights->size >> 20);
            return NULL;
        }
    }
    w->weights = kvr_backend_buffer_from_host(be, plain ? plain : m->weights->base, m->weights->size);
    free(plain);
    if (!w->weights) {
        char msg[sizeof(kvr_errbuf)];
        snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
        free(w);
        kvr_error(KVR_ERR_NOMEM, "%s: cannot place the weights (%zu MiB) on backend %s: %s", m->path,
                  m->weights->size >> 20, kvr_backend_name(be), msg);
        return NULL;
    }
    // the recipe's load again, placing in the backend's buffer: m loaded the same file without
    // error, and a load reads only the file, so this one succeeds with the same result
    const int rc = model_load_weights(w);
    KVR_ASSERT(rc == KVR_OK && memcmp(&w->hp, &m->hp, sizeof(m->hp)) == 0);
    return w;
}

void kvr_model_free(struct kvr_model * m) {
    if (!m) return;
    if (!m->parent) { // a copy borrows the file and the vocabulary
        free(m->tiled);
        kvr_vocab_free(m->vocab);
        kvr_gguf_close(m->gguf);
        if (m->weights_read) munmap(m->weights->base, m->weights_read);
    }
    kvr_buffer_free(m->weights);
    kvr_free(m->ctx);
    free(m->layers);
    free(m);
}

const struct kvr_vocab * kvr_model_vocab(const struct kvr_model * m) {
    return m->vocab;
}

void kvr_model_describe(const struct kvr_model * m, char * buf, size_t cap) {
    const struct kvr_hparams * hp = &m->hp;
    size_t bytes = 0;
    int64_t params = 0;
    enum kvr_type wtype = KVR_TYPE_F32;
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) {
        const struct kvr_gguf_tensor * t = &m->gguf->tensors[i];
        bytes  += t->size;
        params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (t->n_dims == 2) wtype = t->type;
    }
    int n = snprintf(buf, cap, "%s: %u layers, width %u, %u heads (%u kv), ffn %u, vocab %u, %.2fM params, %s weights, %.1f MiB",
                     hp->arch_name, hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->n_ff, hp->n_vocab,
                     params / 1e6, kvr_type_name(wtype), bytes / 1048576.0);
    uint32_t n_local = 0;
    for (uint32_t il = 0; il < hp->n_layer; il++) n_local += m->layers && m->layers[il].window > 0;
    if (n >= 0 && (size_t)n < cap && hp->head_dim * hp->n_head != hp->n_embd) {
        n += snprintf(buf + n, cap - (size_t)n, ", head size %u", hp->head_dim);
    }
    if (n >= 0 && (size_t)n < cap && n_local) {
        n += snprintf(buf + n, cap - (size_t)n, ", sliding window %u on %u of %u layers", hp->n_swa, n_local, hp->n_layer);
    }
    if (n >= 0 && (size_t)n < cap && hp->n_expert) {
        n += snprintf(buf + n, cap - (size_t)n, ", %u experts (%u a token, ffn %u)", hp->n_expert, hp->n_expert_used, hp->n_ff_exp);
    }
    if (n >= 0 && (size_t)n < cap && hp->n_ff_shexp) {
        n += snprintf(buf + n, cap - (size_t)n, ", a shared expert (ffn %u)", hp->n_ff_shexp);
    }
    if (n >= 0 && (size_t)n < cap && hp->rope_ext_factor != 0.0f) {
        n += snprintf(buf + n, cap - (size_t)n, ", YaRN x%g", (double)(1.0f / hp->rope_freq_scale));
    }
    const int n_tiled = m->tiles ? (m->parent ? m->parent->n_tiled : m->n_tiled) : 0;
    if (n >= 0 && (size_t)n < cap && n_tiled) {
        n += snprintf(buf + n, cap - (size_t)n, ", %d matrices in tiles", n_tiled);
    }
    if (n >= 0 && (size_t)n < cap && hp->n_recurrent) {
        n += snprintf(buf + n, cap - (size_t)n, ", %u of %u layers Gated DeltaNet (state %lld floats each)", hp->n_recurrent,
                      hp->n_layer, (long long)kvr_hp_state_floats(hp));
    }
    if (n >= 0 && (size_t)n < cap && m->rope_freqs) n += snprintf(buf + n, cap - (size_t)n, ", RoPE frequency factors");
    if (n >= 0 && (size_t)n < cap && m->rope_long) n += snprintf(buf + n, cap - (size_t)n, ", LongRoPE factors");
    if (n >= 0 && (size_t)n < cap && hp->attn_softcap > 0.0f) {
        snprintf(buf + n, cap - (size_t)n, ", soft-capped scores (%g) and logits (%g)", hp->attn_softcap, hp->final_softcap);
    }
}

struct kvr_tensor * kvr_model_build(const struct kvr_model * m, const struct kvr_build * b) {
    return arch_table[m->hp.arch].build(m, b);
}

//
// 18. eval road: one batch of tokens through a model on a backend, what every rank of a session
// runs for each prefill and decode step (kvr-comm.c's rank_eval fills in struct kvr_eval)
//

// Enough room in a graph context for the tensor structs of a forward pass of graph_size nodes.
static size_t graph_ctx_size(int graph_size) {
    return (size_t)graph_size * (3 * sizeof(struct kvr_tensor) + 3 * sizeof(void *)) + (1 << 20);
}

struct kvr_eval_reuse * kvr_eval_reuse_new(void) {
    return kvr_calloc(1, sizeof(struct kvr_eval_reuse));
}

static void eval_reuse_drop(struct kvr_eval_reuse * r) {
    kvr_free(r->ctx);
    free(r->stores);
    free(r->store_seq);
    free(r->windows);
    free(r->kpos_host);
    free(r->cache_serials);
    free(r->cache_bufs);
    free(r->cache_bases);
    free(r->seq_kv);
    const int64_t builds = r->builds, reuses = r->reuses;
    memset(r, 0, sizeof(*r));
    r->builds = builds;
    r->reuses = reuses;
}

void kvr_eval_reuse_free(struct kvr_eval_reuse * r) {
    if (!r) return;
    eval_reuse_drop(r);
    free(r);
}

// The model's graph of n tokens over n_kpos cache rows into g: its inputs (tokens, positions, the
// keys' positions) made and flagged, the output flagged when logits are wanted.
static struct kvr_tensor * eval_model_build(const struct kvr_eval * ev, struct kvr_context * ctx, struct kvr_graph * g,
                                            int n, int n_kpos, struct kvr_build * b, struct kvr_tensor ** kpos) {
    memset(b, 0, sizeof(*b));
    b->ctx       = ctx;
    b->n_tokens  = n;
    b->n_outputs = ev->n_outputs;
    b->n_ctx     = ev->n_ctx > 0 ? ev->n_ctx : ev->cache ? ev->cache->n_ctx : 0;
    b->tokens    = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, n), "tokens");
    b->pos       = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, n), "pos");
    *kpos        = kvr_set_name(kvr_new_tensor_1d(ctx, KVR_TYPE_I32, n_kpos), "kpos");
    b->tokens->flags |= KVR_FLAG_INPUT;
    b->pos->flags    |= KVR_FLAG_INPUT;
    (*kpos)->flags   |= KVR_FLAG_INPUT;
    struct kvr_tensor * out = kvr_model_build(ev->model, b);
    if (ev->n_outputs) out->flags |= KVR_FLAG_OUTPUT;
    kvr_graph_expand(g, out);
    return out;
}

// The layers whose attention runs in g (attention pairs are counted per layer).
static int eval_attn_layers(const struct kvr_graph * g) {
    bool seen[4096] = { false };
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct kvr_tensor * t = g->nodes[i];
        if ((t->op != KVR_OP_ATTN && t->op != KVR_OP_ATTN_NORMED) || strncmp(t->name, "blk.", 4) != 0) continue;
        const int il = atoi(t->name + 4);
        if (il >= 0 && il < 4096 && !seen[il]) { seen[il] = true; n++; }
    }
    return n;
}

// The caller's compute buffer, grown through the backend to hold need bytes of g's activations;
// on failure g's plan is freed and the error names what for.
static int eval_compute_buffer(struct kvr_eval * ev, struct kvr_graph * g, size_t need, const char * what) {
    if (*ev->compute && (*ev->compute)->size >= need) return KVR_OK;
    kvr_buffer_free(*ev->compute);
    *ev->compute = kvr_backend_alloc_buffer(ev->backend, need);
    if (*ev->compute) return KVR_OK;
    char msg[sizeof(kvr_errbuf)];
    snprintf(msg, sizeof(msg), "%s", kvr_errbuf);
    kvr_graph_place(g, NULL); // frees the plan
    return kvr_error(KVR_ERR_NOMEM, "%s: cannot allocate %zu MiB of activations for %s: %s",
                     ev->name ? ev->name : "eval", need >> 20, what, msg);
}

// Whether an eval is one token of the plain single pass (see kvr_eval_reuse in kvr.h).
static bool eval_reusable(const struct kvr_eval * ev) {
    if (!ev->reuse || ev->pass || ev->no_model || ev->graph_out || ev->capture) return false;
    const struct kvr_eval_batch * bt = ev->batch;
    if (bt ? ev->n_tokens != bt->n : ev->n_tokens != 1 || ev->n_kpos != ev->n_past + 1) return false;
    // a recurrent layer's first token starts from the zero state, which a kept graph does not
    for (int b = 0; b < (bt ? bt->n : 1); b++) {
        if ((bt ? bt->n_past[b] : ev->n_past) == 0 && ev->model->hp.n_recurrent > 0) return false;
    }
    // a batch's sliding windows (its caller reads exactly the rows each token sees) are built every step
    for (uint32_t il = 0; bt && il < ev->model->hp.n_layer; il++) {
        if (ev->model->layers[il].window > 0) return false;
    }
    return true;
}

// The sequences of an eval: the single pass's one, or a decode batch's.
static int eval_seqs(const struct kvr_eval * ev) {
    return ev->batch ? ev->batch->n : 1;
}

static struct kvr_kv_cache * eval_seq_cache(const struct kvr_eval * ev, int b) {
    return ev->batch ? ev->batch->caches[b] : ev->cache;
}

// Build and plan the kept graph for seq_kv[b] cache rows of each sequence: the single pass (or the
// batch's) as if each token sat at row seq_kv[b] - 1 of its cache (attention over every row of
// the layout); the stores are moved per token.
static int eval_reuse_build(struct kvr_eval * ev, const int * seq_kv) {
    struct kvr_eval_reuse * r = ev->reuse;
    const struct kvr_model * m = ev->model;
    const char * name = ev->name ? ev->name : "eval";
    const int ns = eval_seqs(ev);
    eval_reuse_drop(r);
    int n_kv = 0;
    for (int i = 0; i < ns; i++) n_kv += seq_kv[i];
    const int gsize = ev->graph_size > 0 ? ev->graph_size : (int)(m->hp.n_layer * 48 + 64);
    r->ctx = kvr_init(graph_ctx_size(gsize), true);
    if (!r->ctx) return kvr_error(KVR_ERR_NOMEM, "%s: cannot allocate the graph context", name);
    struct kvr_build b;
    r->g   = kvr_graph_new(r->ctx, gsize);
    r->out = eval_model_build(ev, r->ctx, r->g, ev->n_tokens, n_kv, &b, &r->kpos);
    r->tokens = b.tokens;
    r->pos    = b.pos;
    if (ev->batch) {
        kvr_pass_batch(r->ctx, r->g, ev->batch->caches, ev->batch->n_past, seq_kv, r->kpos, ev->attn_mode);
    } else {
        kvr_pass_single(r->ctx, r->g, ev->cache, n_kv - 1, r->kpos, ev->attn_mode);
    }
    for (int i = 0; i < r->g->n_nodes; i++) {
        struct kvr_tensor * t = r->g->nodes[i];
        if (t->op != KVR_OP_KV_STORE) continue;
        r->stores = realloc(r->stores, sizeof(*r->stores) * (size_t)(r->n_stores + 2));
        r->store_seq = realloc(r->store_seq, sizeof(int) * (size_t)(r->n_stores + 2));
        KVR_ASSERT(r->stores && r->store_seq && t->view_src && t->src[1]->view_src == t->view_src);
        int seq = -1; // the sequence whose cache the store writes
        for (int j = 0; j < ns && seq < 0; j++) {
            if (t->view_src->buffer == eval_seq_cache(ev, j)->buf) seq = j;
        }
        KVR_ASSERT(seq >= 0 && "a store writes one of the eval's caches");
        r->store_seq[r->n_stores] = r->store_seq[r->n_stores + 1] = seq;
        r->stores[r->n_stores++] = t;
        r->stores[r->n_stores++] = t->src[1];
    }
    // the sliding windows shorter than the layout: K, V and positions views of W rows (built at
    // row n_kv - W), moved with each token
    for (int i = 0; !ev->batch && i < r->g->n_nodes; i++) {
        struct kvr_tensor * t = r->g->nodes[i];
        if (t->op != KVR_OP_ATTN || t->op_params[3] <= 0 || t->op_params[3] >= n_kv) continue;
        KVR_ASSERT(t->src[1]->view_src && t->src[2]->view_src && t->src[4]->view_src && t->src[1]->ne[2] == t->op_params[3]);
        r->windows = realloc(r->windows, sizeof(*r->windows) * (size_t)(r->n_windows + 3));
        KVR_ASSERT(r->windows);
        r->windows[r->n_windows++] = t->src[1];
        r->windows[r->n_windows++] = t->src[2];
        r->windows[r->n_windows++] = t->src[4];
    }
    r->n_attn_layers = eval_attn_layers(r->g);
    const int rc = eval_compute_buffer(ev, r->g, kvr_graph_plan(r->g), ev->batch ? "a decode batch" : "one token");
    if (rc != KVR_OK) {
        eval_reuse_drop(r);
        return rc;
    }
    kvr_graph_place(r->g, *ev->compute);
    r->kpos_host   = kvr_malloc(sizeof(int32_t) * (size_t)n_kv);
    r->cache_serials = kvr_malloc(sizeof(*r->cache_serials) * (size_t)ns);
    r->cache_bufs  = kvr_malloc(sizeof(*r->cache_bufs) * (size_t)ns);
    r->cache_bases = kvr_malloc(sizeof(*r->cache_bases) * (size_t)ns);
    r->seq_kv      = kvr_malloc(sizeof(int) * (size_t)ns);
    for (int i = 0; i < ns; i++) {
        const struct kvr_kv_cache * c = eval_seq_cache(ev, i);
        r->cache_serials[i] = c->serial;
        r->cache_bufs[i]  = c->buf;
        r->cache_bases[i] = c->buf->base;
        r->seq_kv[i]      = seq_kv[i];
    }
    r->n_seq      = ns;
    r->batch      = ev->batch != NULL;
    r->model      = ev->model;
    r->backend    = ev->backend;
    r->buf        = *ev->compute;
    r->buf_base   = (*ev->compute)->base;
    r->buf_size   = (*ev->compute)->size;
    r->n_kv       = n_kv;
    r->n_outputs  = ev->n_outputs;
    r->attn_mode  = ev->attn_mode;
    r->n_ctx      = ev->n_ctx; // the graph's RoPE factors may depend on it (Phi-3)
    r->builds++;
    return KVR_OK;
}

// One token (or a decode batch's tokens) through the kept graph, built first if the layout changed.
static int eval_run_reused(struct kvr_eval * ev) {
    const double t0 = kvr_time_ms();
    struct kvr_eval_reuse * r = ev->reuse;
    const struct kvr_model * m = ev->model;
    const int ns = eval_seqs(ev);
    int one_kv = (ev->n_past / KVR_REUSE_ROWS + 1) * KVR_REUSE_ROWS;
    if (one_kv > ev->cache->n_ctx) one_kv = ev->cache->n_ctx;
    const int * seq_kv = ev->batch ? ev->batch->n_kv : &one_kv;
    bool same = r->ctx && r->n_seq == ns && r->batch == (ev->batch != NULL) && r->model == ev->model && r->backend == ev->backend &&
                r->buf == *ev->compute && r->buf_base == (*ev->compute)->base && r->buf_size == (*ev->compute)->size &&
                r->n_outputs == ev->n_outputs && r->attn_mode == ev->attn_mode && r->n_ctx == ev->n_ctx;
    for (int i = 0; same && i < ns; i++) {
        const struct kvr_kv_cache * c = eval_seq_cache(ev, i);
        same = r->cache_serials[i] == c->serial && r->cache_bufs[i] == c->buf && r->cache_bases[i] == c->buf->base && r->seq_kv[i] == seq_kv[i];
    }
    if (!same) {
        int rc = eval_reuse_build(ev, seq_kv);
        if (rc != KVR_OK) return rc;
    } else {
        r->reuses++;
    }
    // the stores write each sequence's row n_past; rows past it are hidden from its token by their position
    for (int i = 0; i < r->n_stores; i++) {
        const int n_past = ev->batch ? ev->batch->n_past[r->store_seq[i]] : ev->n_past;
        graph_view_move(r->stores[i], (size_t)n_past * r->stores[i]->nb[1]);
    }
    // a window's W rows from the first the token sees (the rows past it hidden by their positions)
    for (int i = 0; i < r->n_windows; i += 3) {
        const int W = (int)r->windows[i]->ne[2], lo = ev->n_past - W + 1 > 0 ? ev->n_past - W + 1 : 0;
        graph_view_move(r->windows[i], (size_t)lo * r->windows[i]->nb[2]);
        graph_view_move(r->windows[i + 1], (size_t)lo * r->windows[i + 1]->nb[2]);
        graph_view_move(r->windows[i + 2], (size_t)lo * sizeof(int32_t));
    }
    KVR_ASSERT(ev->n_kpos <= r->n_kv);
    memcpy(r->kpos_host, ev->kpos, sizeof(int32_t) * (size_t)ev->n_kpos);
    for (int i = ev->n_kpos; i < r->n_kv; i++) r->kpos_host[i] = INT32_MAX;
    kvr_backend_tensor_set(r->tokens, ev->tokens, 0, sizeof(int32_t) * (size_t)ev->n_tokens);
    kvr_backend_tensor_set(r->pos, ev->pos, 0, sizeof(int32_t) * (size_t)ev->n_tokens);
    kvr_backend_tensor_set(r->kpos, r->kpos_host, 0, sizeof(int32_t) * (size_t)r->n_kv);
    ev->n_attn_layers = r->n_attn_layers;
    ev->setup_ms = kvr_time_ms() - t0;
    kvr_backend_counters(ev->backend, NULL, true);
    int rc = kvr_backend_graph_compute(ev->backend, r->g);
    if (rc == KVR_OK) rc = kvr_backend_synchronize(ev->backend);
    if (rc == KVR_OK && ev->n_outputs) {
        const size_t nb = sizeof(float) * m->hp.n_vocab * (size_t)ev->n_outputs;
        kvr_backend_tensor_get(r->out, ev->logits, kvr_nbytes(r->out) - nb, nb);
    }
    kvr_backend_counters(ev->backend, &ev->counters, true);
    return rc;
}

// The graph of the batch on ev->backend: build, pass, rebuild, plan, place, then inputs in,
// compute, outputs out. Everything a backend holds is reached through the seam of section "backends".
// One decode token may instead run a kept graph (ev->reuse, eval_run_reused).
int kvr_eval_run(struct kvr_eval * ev) {
    const struct kvr_model * m = ev->model;
    const char * name = ev->name ? ev->name : "eval";
    const int n = ev->n_tokens;
    ev->n_attn_layers = 0;
    ev->setup_ms = 0.0;
    memset(&ev->counters, 0, sizeof(ev->counters));
    if (eval_reusable(ev)) return eval_run_reused(ev);
    const double t_setup = kvr_time_ms();
    const int gsize = ev->graph_size > 0 ? ev->graph_size : (int)(m->hp.n_layer * 48 + 64);
    struct kvr_context * ctx = kvr_init(graph_ctx_size(gsize), true);
    if (!ctx) return kvr_error(KVR_ERR_NOMEM, "%s: cannot allocate the graph context", name);

    struct kvr_build b = { 0 };
    struct kvr_tensor * kpos = NULL, * out = NULL;
    struct kvr_graph * g = kvr_graph_new(ctx, gsize);
    KVR_ASSERT(!ev->no_model || (ev->pass && !ev->n_outputs));
    if (!ev->no_model) {
        out = eval_model_build(ev, ctx, g, n, ev->n_kpos, &b, &kpos);
    }

    // the pass: the single-rank one, a decode batch's, or the caller's strategy
    if (ev->batch) {
        KVR_ASSERT(!ev->pass && ev->batch->n == n);
        kvr_pass_batch(ctx, g, ev->batch->caches, ev->batch->n_past, ev->batch->n_kv, kpos, ev->attn_mode);
    } else if (!ev->pass) {
        kvr_pass_single(ctx, g, ev->cache, ev->n_past, kpos, ev->attn_mode);
    } else {
        struct kvr_pass_args a = { .ctx = ctx, .g = g, .kpos = kpos };
        ev->pass(ev->pass_user, &a);
        if (a.n_sinks > 0) {
            kvr_graph_reset(g);
            for (int i = 0; i < a.n_sinks; i++) kvr_graph_expand(g, a.sinks[i]);
            if (ev->n_outputs) kvr_graph_expand(g, out);
        }
    }
    if (ev->graph_out) kvr_graph_print(g, ev->graph_out);
    // intermediates asked for: kept as outputs, handed out after the compute
    struct kvr_tensor ** captured = NULL; // stb_ds array
    int * captured_id = NULL;             //   layer * n_names + name
    if (ev->capture) {
        for (int i = 0; i < g->n_nodes; i++) {
            struct kvr_tensor * t = g->nodes[i];
            int il = -1, at = 0;
            if (sscanf(t->name, "blk.%d.%n", &il, &at) != 1 || at == 0) continue;
            for (int k = 0; k < ev->capture->n_names; k++) {
                if (strcmp(t->name + at, ev->capture->names[k]) != 0) continue;
                t->flags |= KVR_FLAG_OUTPUT;
                arrput(captured, t);
                arrput(captured_id, il * ev->capture->n_names + k);
            }
        }
    }
    ev->n_attn_layers = eval_attn_layers(g);

    // memory: the activations in the caller's compute buffer, grown through the backend
    char what[32];
    snprintf(what, sizeof(what), "%d tokens", n);
    const int rc_buf = eval_compute_buffer(ev, g, kvr_graph_plan(g), what);
    if (rc_buf != KVR_OK) {
        arrfree(captured);
        arrfree(captured_id);
        kvr_free(ctx);
        return rc_buf;
    }
    kvr_graph_place(g, *ev->compute);
    ev->setup_ms = kvr_time_ms() - t_setup;

    // inputs in, compute, outputs out
    if (!ev->no_model) {
        // an input no node reads is not placed: the key positions of a rank without the output
        // whose sinks reach no attention (a hybrid model whose last attention is after its sends)
        if (b.tokens->buffer) kvr_backend_tensor_set(b.tokens, ev->tokens, 0, sizeof(int32_t) * (size_t)n);
        if (b.pos->buffer) kvr_backend_tensor_set(b.pos, ev->pos, 0, sizeof(int32_t) * (size_t)n);
        if (kpos->buffer) kvr_backend_tensor_set(kpos, ev->kpos, 0, sizeof(int32_t) * (size_t)ev->n_kpos);
    }
    kvr_backend_counters(ev->backend, NULL, true);
    int rc = kvr_backend_graph_compute(ev->backend, g);
    if (rc == KVR_OK) rc = kvr_backend_synchronize(ev->backend);
    if (rc == KVR_OK && ev->n_outputs) {
        const size_t nb = sizeof(float) * m->hp.n_vocab * (size_t)ev->n_outputs;
        kvr_backend_tensor_get(out, ev->logits, kvr_nbytes(out) - nb, nb);
    }
    for (ptrdiff_t i = 0; rc == KVR_OK && i < arrlen(captured); i++) {
        ev->capture->got(ev->capture->user, captured[i], captured_id[i] / ev->capture->n_names,
                         captured_id[i] % ev->capture->n_names, ev->pos, n);
    }
    if (rc == KVR_OK) rc = kvr_backend_synchronize(ev->backend); // a read of the logits or of an intermediate failed
    arrfree(captured);
    arrfree(captured_id);
    kvr_backend_counters(ev->backend, &ev->counters, true);
    kvr_free(ctx);
    return rc;
}

//
// 19. sampling
//

static uint64_t rng_next(uint64_t * state) { // splitmix64: tiny, seedable, good enough to sample
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kvr_sampler_init(struct kvr_sampler * s, const struct kvr_sampler_params * p) {
    memset(s, 0, sizeof(*s));
    s->p   = *p;
    s->rng = p->seed;
}

void kvr_sampler_free(struct kvr_sampler * s) {
    free(s->probs);
    memset(s, 0, sizeof(*s));
}

// The first index of the largest value; NaNs are passed over, and a NaN at 0 is the answer (as the
// plain loop "if (x[i] > x[best]) best = i" gives). Over a large vocabulary (Gemma's 262k logits) that
// loop costs ~1 ms a token, one element a dependent compare and reload at a time. Here: the maximum
// 8 lanes at a time (a NaN never compares greater, so it never enters), then the first index holding
// it, 8 at a time, which reads the logits again from the cache up to there.
int32_t kvr_argmax(const float * x, int n) {
    if (n <= 1 || x[0] != x[0]) return 0;
    float mx = x[0];
    int i = 1;
#if defined(__AVX2__)
    if (n >= 16) {
        __m256 m = _mm256_set1_ps(x[0]);
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            m = _mm256_blendv_ps(m, v, _mm256_cmp_ps(v, m, _CMP_GT_OQ));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    }
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    int k = 0;
#if defined(__AVX2__)
    const __m256 vm = _mm256_set1_ps(mx);
    for (; k + 8 <= n; k += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), vm, _CMP_EQ_OQ));
        if (hit) return k + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; k < n; k++) {
        if (x[k] == mx) return k;
    }
    KVR_ASSERT(!"the maximum is one of the values");
    return 0;
}

struct prob_id {
    float   p;
    int32_t id;
};

static int cmp_prob_desc(const void * a, const void * b) {
    const struct prob_id * x = a, * y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id - y->id; // ties by id: reproducible
}

void kvr_sampler_skip(struct kvr_sampler * s, int n) {
    for (int i = 0; i < n && s->p.temp > 0.0f; i++) rng_next(&s->rng); // kvr_sample's one draw
}

int32_t kvr_sample(struct kvr_sampler * s, const float * logits, int n_vocab) {
    if (s->p.temp <= 0.0f) return kvr_argmax(logits, n_vocab);
    if (s->n_alloc < n_vocab) {
        free(s->probs);
        s->probs = kvr_malloc(sizeof(struct prob_id) * (size_t)n_vocab);
        s->n_alloc = n_vocab;
    }
    struct prob_id * pi = (struct prob_id *)s->probs;
    const float mx = logits[kvr_argmax(logits, n_vocab)];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) {
        pi[i].p  = expf((logits[i] - mx) / s->p.temp);
        pi[i].id = i;
        sum += pi[i].p;
    }
    for (int i = 0; i < n_vocab; i++) pi[i].p = (float)(pi[i].p / sum);
    qsort(pi, (size_t)n_vocab, sizeof(struct prob_id), cmp_prob_desc);
    int n = n_vocab;
    if (s->p.top_k > 0 && s->p.top_k < n) n = s->p.top_k;
    if (s->p.top_p > 0.0f && s->p.top_p < 1.0f) {
        double cum = 0.0;
        for (int i = 0; i < n; i++) {
            cum += pi[i].p;
            if (cum >= s->p.top_p) { n = i + 1; break; }
        }
    }
    double total = 0.0;
    for (int i = 0; i < n; i++) total += pi[i].p;
    const double u = (double)(rng_next(&s->rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += pi[i].p;
        if (u < cum) return pi[i].id;
    }
    return pi[n - 1].id;
}


//
// 20. appendix: generated tables
//

// Unicode classification of code points (the tokenizers' \p{L}, \p{N}, \s, ...): generated ranges
//

// ---- BEGIN generated by tests/gen-unicode.py (Unicode 15.1.0); do not edit by hand ----
#define VOCAB_UCD_N_RANGES 2255
// (first code point << 8) | flags; a range lasts until the next one starts
static const uint32_t vocab_ucd_ranges[VOCAB_UCD_N_RANGES] = {
    0x00000040, 0x000009C0, 0x00000E40, 0x00002084, 0x00002110, 0x00002420, 0x00002510, 0x00002B20,
    0x00002C10, 0x00003001, 0x00003A10, 0x00003C20, 0x00003F10, 0x00004102, 0x00005B10, 0x00005E20,
    0x00005F10, 0x00006020, 0x00006102, 0x00007B10, 0x00007C20, 0x00007D10, 0x00007E20, 0x00007F40,
    0x000085C0, 0x00008640, 0x0000A084, 0x0000A110, 0x0000A220, 0x0000A710, 0x0000A820, 0x0000AA02,
    0x0000AB10, 0x0000AC20, 0x0000AD40, 0x0000AE20, 0x0000B201, 0x0000B420, 0x0000B502, 0x0000B610,
    0x0000B820, 0x0000B901, 0x0000BA02, 0x0000BB10, 0x0000BC01, 0x0000BF10, 0x0000C002, 0x0000D720,
    0x0000D802, 0x0000F720, 0x0000F802, 0x0002C220, 0x0002C602, 0x0002D220, 0x0002E002, 0x0002E520,
    0x0002EC02, 0x0002ED20, 0x0002EE02, 0x0002EF20, 0x00030008, 0x00037002, 0x00037520, 0x00037602,
    0x00037840, 0x00037A02, 0x00037E10, 0x00037F02, 0x00038040, 0x00038420, 0x00038602, 0x00038710,
    0x00038802, 0x00038B40, 0x00038C02, 0x00038D40, 0x00038E02, 0x0003A240, 0x0003A302, 0x0003F620,
    0x0003F702, 0x00048220, 0x00048308, 0x00048A02, 0x00053040, 0x00053102, 0x00055740, 0x00055902,
    0x00055A10, 0x00056002, 0x00058910, 0x00058B40, 0x00058D20, 0x00059040, 0x00059108, 0x0005BE10,
    0x0005BF08, 0x0005C010, 0x0005C108, 0x0005C310, 0x0005C408, 0x0005C610, 0x0005C708, 0x0005C840,
    0x0005D002, 0x0005EB40, 0x0005EF02, 0x0005F310, 0x0005F540, 0x00060620, 0x00060910, 0x00060B20,
    0x00060C10, 0x00060E20, 0x00061008, 0x00061B10, 0x00061C40, 0x00061D10, 0x00062002, 0x00064B08,
    0x00066001, 0x00066A10, 0x00066E02, 0x00067008, 0x00067102, 0x0006D410, 0x0006D502, 0x0006D608,
    0x0006DD40, 0x0006DE20, 0x0006DF08, 0x0006E502, 0x0006E708, 0x0006E920, 0x0006EA08, 0x0006EE02,
    0x0006F001, 0x0006FA02, 0x0006FD20, 0x0006FF02, 0x00070010, 0x00070E40, 0x00071002, 0x00071108,
    0x00071202, 0x00073008, 0x00074B40, 0x00074D02, 0x0007A608, 0x0007B102, 0x0007B240, 0x0007C001,
    0x0007CA02, 0x0007EB08, 0x0007F402, 0x0007F620, 0x0007F710, 0x0007FA02, 0x0007FB40, 0x0007FD08,
    0x0007FE20, 0x00080002, 0x00081608, 0x00081A02, 0x00081B08, 0x00082402, 0x00082508, 0x00082802,
    0x00082908, 0x00082E40, 0x00083010, 0x00083F40, 0x00084002, 0x00085908, 0x00085C40, 0x00085E10,
    0x00085F40, 0x00086002, 0x00086B40, 0x00087002, 0x00088820, 0x00088902, 0x00088F40, 0x00089808,
    0x0008A002, 0x0008CA08, 0x0008E240, 0x0008E308, 0x00090402, 0x00093A08, 0x00093D02, 0x00093E08,
    0x00095002, 0x00095108, 0x00095802, 0x00096208, 0x00096410, 0x00096601, 0x00097010, 0x00097102,
    0x00098108, 0x00098440, 0x00098502, 0x00098D40, 0x00098F02, 0x00099140, 0x00099302, 0x0009A940,
    0x0009AA02, 0x0009B140, 0x0009B202, 0x0009B340, 0x0009B602, 0x0009BA40, 0x0009BC08, 0x0009BD02,
    0x0009BE08, 0x0009C540, 0x0009C708, 0x0009C940, 0x0009CB08, 0x0009CE02, 0x0009CF40, 0x0009D708,
    0x0009D840, 0x0009DC02, 0x0009DE40, 0x0009DF02, 0x0009E208, 0x0009E440, 0x0009E601, 0x0009F002,
    0x0009F220, 0x0009F401, 0x0009FA20, 0x0009FC02, 0x0009FD10, 0x0009FE08, 0x0009FF40, 0x000A0108,
    0x000A0440, 0x000A0502, 0x000A0B40, 0x000A0F02, 0x000A1140, 0x000A1302, 0x000A2940, 0x000A2A02,
    0x000A3140, 0x000A3202, 0x000A3440, 0x000A3502, 0x000A3740, 0x000A3802, 0x000A3A40, 0x000A3C08,
    0x000A3D40, 0x000A3E08, 0x000A4340, 0x000A4708, 0x000A4940, 0x000A4B08, 0x000A4E40, 0x000A5108,
    0x000A5240, 0x000A5902, 0x000A5D40, 0x000A5E02, 0x000A5F40, 0x000A6601, 0x000A7008, 0x000A7202,
    0x000A7508, 0x000A7610, 0x000A7740, 0x000A8108, 0x000A8440, 0x000A8502, 0x000A8E40, 0x000A8F02,
    0x000A9240, 0x000A9302, 0x000AA940, 0x000AAA02, 0x000AB140, 0x000AB202, 0x000AB440, 0x000AB502,
    0x000ABA40, 0x000ABC08, 0x000ABD02, 0x000ABE08, 0x000AC640, 0x000AC708, 0x000ACA40, 0x000ACB08,
    0x000ACE40, 0x000AD002, 0x000AD140, 0x000AE002, 0x000AE208, 0x000AE440, 0x000AE601, 0x000AF010,
    0x000AF120, 0x000AF240, 0x000AF902, 0x000AFA08, 0x000B0040, 0x000B0108, 0x000B0440, 0x000B0502,
    0x000B0D40, 0x000B0F02, 0x000B1140, 0x000B1302, 0x000B2940, 0x000B2A02, 0x000B3140, 0x000B3202,
    0x000B3440, 0x000B3502, 0x000B3A40, 0x000B3C08, 0x000B3D02, 0x000B3E08, 0x000B4540, 0x000B4708,
    0x000B4940, 0x000B4B08, 0x000B4E40, 0x000B5508, 0x000B5840, 0x000B5C02, 0x000B5E40, 0x000B5F02,
    0x000B6208, 0x000B6440, 0x000B6601, 0x000B7020, 0x000B7102, 0x000B7201, 0x000B7840, 0x000B8208,
    0x000B8302, 0x000B8440, 0x000B8502, 0x000B8B40, 0x000B8E02, 0x000B9140, 0x000B9202, 0x000B9640,
    0x000B9902, 0x000B9B40, 0x000B9C02, 0x000B9D40, 0x000B9E02, 0x000BA040, 0x000BA302, 0x000BA540,
    0x000BA802, 0x000BAB40, 0x000BAE02, 0x000BBA40, 0x000BBE08, 0x000BC340, 0x000BC608, 0x000BC940,
    0x000BCA08, 0x000BCE40, 0x000BD002, 0x000BD140, 0x000BD708, 0x000BD840, 0x000BE601, 0x000BF320,
    0x000BFB40, 0x000C0008, 0x000C0502, 0x000C0D40, 0x000C0E02, 0x000C1140, 0x000C1202, 0x000C2940,
    0x000C2A02, 0x000C3A40, 0x000C3C08, 0x000C3D02, 0x000C3E08, 0x000C4540, 0x000C4608, 0x000C4940,
    0x000C4A08, 0x000C4E40, 0x000C5508, 0x000C5740, 0x000C5802, 0x000C5B40, 0x000C5D02, 0x000C5E40,
    0x000C6002, 0x000C6208, 0x000C6440, 0x000C6601, 0x000C7040, 0x000C7710, 0x000C7801, 0x000C7F20,
    0x000C8002, 0x000C8108, 0x000C8410, 0x000C8502, 0x000C8D40, 0x000C8E02, 0x000C9140, 0x000C9202,
    0x000CA940, 0x000CAA02, 0x000CB440, 0x000CB502, 0x000CBA40, 0x000CBC08, 0x000CBD02, 0x000CBE08,
    0x000CC540, 0x000CC608, 0x000CC940, 0x000CCA08, 0x000CCE40, 0x000CD508, 0x000CD740, 0x000CDD02,
    0x000CDF40, 0x000CE002, 0x000CE208, 0x000CE440, 0x000CE601, 0x000CF040, 0x000CF102, 0x000CF308,
    0x000CF440, 0x000D0008, 0x000D0402, 0x000D0D40, 0x000D0E02, 0x000D1140, 0x000D1202, 0x000D3B08,
    0x000D3D02, 0x000D3E08, 0x000D4540, 0x000D4608, 0x000D4940, 0x000D4A08, 0x000D4E02, 0x000D4F20,
    0x000D5040, 0x000D5402, 0x000D5708, 0x000D5801, 0x000D5F02, 0x000D6208, 0x000D6440, 0x000D6601,
    0x000D7920, 0x000D7A02, 0x000D8040, 0x000D8108, 0x000D8440, 0x000D8502, 0x000D9740, 0x000D9A02,
    0x000DB240, 0x000DB302, 0x000DBC40, 0x000DBD02, 0x000DBE40, 0x000DC002, 0x000DC740, 0x000DCA08,
    0x000DCB40, 0x000DCF08, 0x000DD540, 0x000DD608, 0x000DD740, 0x000DD808, 0x000DE040, 0x000DE601,
    0x000DF040, 0x000DF208, 0x000DF410, 0x000DF540, 0x000E0102, 0x000E3108, 0x000E3202, 0x000E3408,
    0x000E3B40, 0x000E3F20, 0x000E4002, 0x000E4708, 0x000E4F10, 0x000E5001, 0x000E5A10, 0x000E5C40,
    0x000E8102, 0x000E8340, 0x000E8402, 0x000E8540, 0x000E8602, 0x000E8B40, 0x000E8C02, 0x000EA440,
    0x000EA502, 0x000EA640, 0x000EA702, 0x000EB108, 0x000EB202, 0x000EB408, 0x000EBD02, 0x000EBE40,
    0x000EC002, 0x000EC540, 0x000EC602, 0x000EC740, 0x000EC808, 0x000ECF40, 0x000ED001, 0x000EDA40,
    0x000EDC02, 0x000EE040, 0x000F0002, 0x000F0120, 0x000F0410, 0x000F1320, 0x000F1410, 0x000F1520,
    0x000F1808, 0x000F1A20, 0x000F2001, 0x000F3420, 0x000F3508, 0x000F3620, 0x000F3708, 0x000F3820,
    0x000F3908, 0x000F3A10, 0x000F3E08, 0x000F4002, 0x000F4840, 0x000F4902, 0x000F6D40, 0x000F7108,
    0x000F8510, 0x000F8608, 0x000F8802, 0x000F8D08, 0x000F9840, 0x000F9908, 0x000FBD40, 0x000FBE20,
    0x000FC608, 0x000FC720, 0x000FCD40, 0x000FCE20, 0x000FD010, 0x000FD520, 0x000FD910, 0x000FDB40,
    0x00100002, 0x00102B08, 0x00103F02, 0x00104001, 0x00104A10, 0x00105002, 0x00105608, 0x00105A02,
    0x00105E08, 0x00106102, 0x00106208, 0x00106502, 0x00106708, 0x00106E02, 0x00107108, 0x00107502,
    0x00108208, 0x00108E02, 0x00108F08, 0x00109001, 0x00109A08, 0x00109E20, 0x0010A002, 0x0010C640,
    0x0010C702, 0x0010C840, 0x0010CD02, 0x0010CE40, 0x0010D002, 0x0010FB10, 0x0010FC02, 0x00124940,
    0x00124A02, 0x00124E40, 0x00125002, 0x00125740, 0x00125802, 0x00125940, 0x00125A02, 0x00125E40,
    0x00126002, 0x00128940, 0x00128A02, 0x00128E40, 0x00129002, 0x0012B140, 0x0012B202, 0x0012B640,
    0x0012B802, 0x0012BF40, 0x0012C002, 0x0012C140, 0x0012C202, 0x0012C640, 0x0012C802, 0x0012D740,
    0x0012D802, 0x00131140, 0x00131202, 0x00131640, 0x00131802, 0x00135B40, 0x00135D08, 0x00136010,
    0x00136901, 0x00137D40, 0x00138002, 0x00139020, 0x00139A40, 0x0013A002, 0x0013F640, 0x0013F802,
    0x0013FE40, 0x00140010, 0x00140102, 0x00166D20, 0x00166E10, 0x00166F02, 0x00168084, 0x00168102,
    0x00169B10, 0x00169D40, 0x0016A002, 0x0016EB10, 0x0016EE01, 0x0016F102, 0x0016F940, 0x00170002,
    0x00171208, 0x00171640, 0x00171F02, 0x00173208, 0x00173510, 0x00173740, 0x00174002, 0x00175208,
    0x00175440, 0x00176002, 0x00176D40, 0x00176E02, 0x00177140, 0x00177208, 0x00177440, 0x00178002,
    0x0017B408, 0x0017D410, 0x0017D702, 0x0017D810, 0x0017DB20, 0x0017DC02, 0x0017DD08, 0x0017DE40,
    0x0017E001, 0x0017EA40, 0x0017F001, 0x0017FA40, 0x00180010, 0x00180B08, 0x00180E40, 0x00180F08,
    0x00181001, 0x00181A40, 0x00182002, 0x00187940, 0x00188002, 0x00188508, 0x00188702, 0x0018A908,
    0x0018AA02, 0x0018AB40, 0x0018B002, 0x0018F640, 0x00190002, 0x00191F40, 0x00192008, 0x00192C40,
    0x00193008, 0x00193C40, 0x00194020, 0x00194140, 0x00194410, 0x00194601, 0x00195002, 0x00196E40,
    0x00197002, 0x00197540, 0x00198002, 0x0019AC40, 0x0019B002, 0x0019CA40, 0x0019D001, 0x0019DB40,
    0x0019DE20, 0x001A0002, 0x001A1708, 0x001A1C40, 0x001A1E10, 0x001A2002, 0x001A5508, 0x001A5F40,
    0x001A6008, 0x001A7D40, 0x001A7F08, 0x001A8001, 0x001A8A40, 0x001A9001, 0x001A9A40, 0x001AA010,
    0x001AA702, 0x001AA810, 0x001AAE40, 0x001AB008, 0x001ACF40, 0x001B0008, 0x001B0502, 0x001B3408,
    0x001B4502, 0x001B4D40, 0x001B5001, 0x001B5A10, 0x001B6120, 0x001B6B08, 0x001B7420, 0x001B7D10,
    0x001B7F40, 0x001B8008, 0x001B8302, 0x001BA108, 0x001BAE02, 0x001BB001, 0x001BBA02, 0x001BE608,
    0x001BF440, 0x001BFC10, 0x001C0002, 0x001C2408, 0x001C3840, 0x001C3B10, 0x001C4001, 0x001C4A40,
    0x001C4D02, 0x001C5001, 0x001C5A02, 0x001C7E10, 0x001C8002, 0x001C8940, 0x001C9002, 0x001CBB40,
    0x001CBD02, 0x001CC010, 0x001CC840, 0x001CD008, 0x001CD310, 0x001CD408, 0x001CE902, 0x001CED08,
    0x001CEE02, 0x001CF408, 0x001CF502, 0x001CF708, 0x001CFA02, 0x001CFB40, 0x001D0002, 0x001DC008,
    0x001E0002, 0x001F1640, 0x001F1802, 0x001F1E40, 0x001F2002, 0x001F4640, 0x001F4802, 0x001F4E40,
    0x001F5002, 0x001F5840, 0x001F5902, 0x001F5A40, 0x001F5B02, 0x001F5C40, 0x001F5D02, 0x001F5E40,
    0x001F5F02, 0x001F7E40, 0x001F8002, 0x001FB540, 0x001FB602, 0x001FBD20, 0x001FBE02, 0x001FBF20,
    0x001FC202, 0x001FC540, 0x001FC602, 0x001FCD20, 0x001FD002, 0x001FD440, 0x001FD602, 0x001FDC40,
    0x001FDD20, 0x001FE002, 0x001FED20, 0x001FF040, 0x001FF202, 0x001FF540, 0x001FF602, 0x001FFD20,
    0x001FFF40, 0x00200084, 0x00200B40, 0x00201010, 0x00202884, 0x00202A40, 0x00202F84, 0x00203010,
    0x00204420, 0x00204510, 0x00205220, 0x00205310, 0x00205F84, 0x00206040, 0x00207001, 0x00207102,
    0x00207240, 0x00207401, 0x00207A20, 0x00207D10, 0x00207F02, 0x00208001, 0x00208A20, 0x00208D10,
    0x00208F40, 0x00209002, 0x00209D40, 0x0020A020, 0x0020C140, 0x0020D008, 0x0020F140, 0x00210020,
    0x00210202, 0x00210320, 0x00210702, 0x00210820, 0x00210A02, 0x00211420, 0x00211502, 0x00211620,
    0x00211902, 0x00211E20, 0x00212402, 0x00212520, 0x00212602, 0x00212720, 0x00212802, 0x00212920,
    0x00212A02, 0x00212E20, 0x00212F02, 0x00213A20, 0x00213C02, 0x00214020, 0x00214502, 0x00214A20,
    0x00214E02, 0x00214F20, 0x00215001, 0x00218302, 0x00218501, 0x00218A20, 0x00218C40, 0x00219020,
    0x00230810, 0x00230C20, 0x00232910, 0x00232B20, 0x00242740, 0x00244020, 0x00244B40, 0x00246001,
    0x00249C20, 0x0024EA01, 0x00250020, 0x00276810, 0x00277601, 0x00279420, 0x0027C510, 0x0027C720,
    0x0027E610, 0x0027F020, 0x00298310, 0x00299920, 0x0029D810, 0x0029DC20, 0x0029FC10, 0x0029FE20,
    0x002B7440, 0x002B7620, 0x002B9640, 0x002B9720, 0x002C0002, 0x002CE520, 0x002CEB02, 0x002CEF08,
    0x002CF202, 0x002CF440, 0x002CF910, 0x002CFD01, 0x002CFE10, 0x002D0002, 0x002D2640, 0x002D2702,
    0x002D2840, 0x002D2D02, 0x002D2E40, 0x002D3002, 0x002D6840, 0x002D6F02, 0x002D7010, 0x002D7140,
    0x002D7F08, 0x002D8002, 0x002D9740, 0x002DA002, 0x002DA740, 0x002DA802, 0x002DAF40, 0x002DB002,
    0x002DB740, 0x002DB802, 0x002DBF40, 0x002DC002, 0x002DC740, 0x002DC802, 0x002DCF40, 0x002DD002,
    0x002DD740, 0x002DD802, 0x002DDF40, 0x002DE008, 0x002E0010, 0x002E2F02, 0x002E3010, 0x002E5020,
    0x002E5210, 0x002E5E40, 0x002E8020, 0x002E9A40, 0x002E9B20, 0x002EF440, 0x002F0020, 0x002FD640,
    0x002FF020, 0x00300084, 0x00300110, 0x00300420, 0x00300502, 0x00300701, 0x00300810, 0x00301220,
    0x00301410, 0x00302020, 0x00302101, 0x00302A08, 0x00303010, 0x00303102, 0x00303620, 0x00303801,
    0x00303B02, 0x00303D10, 0x00303E20, 0x00304040, 0x00304102, 0x00309740, 0x00309908, 0x00309B20,
    0x00309D02, 0x0030A010, 0x0030A102, 0x0030FB10, 0x0030FC02, 0x00310040, 0x00310502, 0x00313040,
    0x00313102, 0x00318F40, 0x00319020, 0x00319201, 0x00319620, 0x0031A002, 0x0031C020, 0x0031E440,
    0x0031EF20, 0x0031F002, 0x00320020, 0x00321F40, 0x00322001, 0x00322A20, 0x00324801, 0x00325020,
    0x00325101, 0x00326020, 0x00328001, 0x00328A20, 0x0032B101, 0x0032C020, 0x00340002, 0x004DC020,
    0x004E0002, 0x00A48D40, 0x00A49020, 0x00A4C740, 0x00A4D002, 0x00A4FE10, 0x00A50002, 0x00A60D10,
    0x00A61002, 0x00A62001, 0x00A62A02, 0x00A62C40, 0x00A64002, 0x00A66F08, 0x00A67310, 0x00A67408,
    0x00A67E10, 0x00A67F02, 0x00A69E08, 0x00A6A002, 0x00A6E601, 0x00A6F008, 0x00A6F210, 0x00A6F840,
    0x00A70020, 0x00A71702, 0x00A72020, 0x00A72202, 0x00A78920, 0x00A78B02, 0x00A7CB40, 0x00A7D002,
    0x00A7D240, 0x00A7D302, 0x00A7D440, 0x00A7D502, 0x00A7DA40, 0x00A7F202, 0x00A80208, 0x00A80302,
    0x00A80608, 0x00A80702, 0x00A80B08, 0x00A80C02, 0x00A82308, 0x00A82820, 0x00A82C08, 0x00A82D40,
    0x00A83001, 0x00A83620, 0x00A83A40, 0x00A84002, 0x00A87410, 0x00A87840, 0x00A88008, 0x00A88202,
    0x00A8B408, 0x00A8C640, 0x00A8CE10, 0x00A8D001, 0x00A8DA40, 0x00A8E008, 0x00A8F202, 0x00A8F810,
    0x00A8FB02, 0x00A8FC10, 0x00A8FD02, 0x00A8FF08, 0x00A90001, 0x00A90A02, 0x00A92608, 0x00A92E10,
    0x00A93002, 0x00A94708, 0x00A95440, 0x00A95F10, 0x00A96002, 0x00A97D40, 0x00A98008, 0x00A98402,
    0x00A9B308, 0x00A9C110, 0x00A9CE40, 0x00A9CF02, 0x00A9D001, 0x00A9DA40, 0x00A9DE10, 0x00A9E002,
    0x00A9E508, 0x00A9E602, 0x00A9F001, 0x00A9FA02, 0x00A9FF40, 0x00AA0002, 0x00AA2908, 0x00AA3740,
    0x00AA4002, 0x00AA4308, 0x00AA4402, 0x00AA4C08, 0x00AA4E40, 0x00AA5001, 0x00AA5A40, 0x00AA5C10,
    0x00AA6002, 0x00AA7720, 0x00AA7A02, 0x00AA7B08, 0x00AA7E02, 0x00AAB008, 0x00AAB102, 0x00AAB208,
    0x00AAB502, 0x00AAB708, 0x00AAB902, 0x00AABE08, 0x00AAC002, 0x00AAC108, 0x00AAC202, 0x00AAC340,
    0x00AADB02, 0x00AADE10, 0x00AAE002, 0x00AAEB08, 0x00AAF010, 0x00AAF202, 0x00AAF508, 0x00AAF740,
    0x00AB0102, 0x00AB0740, 0x00AB0902, 0x00AB0F40, 0x00AB1102, 0x00AB1740, 0x00AB2002, 0x00AB2740,
    0x00AB2802, 0x00AB2F40, 0x00AB3002, 0x00AB5B20, 0x00AB5C02, 0x00AB6A20, 0x00AB6C40, 0x00AB7002,
    0x00ABE308, 0x00ABEB10, 0x00ABEC08, 0x00ABEE40, 0x00ABF001, 0x00ABFA40, 0x00AC0002, 0x00D7A440,
    0x00D7B002, 0x00D7C740, 0x00D7CB02, 0x00D7FC40, 0x00F90002, 0x00FA6E40, 0x00FA7002, 0x00FADA40,
    0x00FB0002, 0x00FB0740, 0x00FB1302, 0x00FB1840, 0x00FB1D02, 0x00FB1E08, 0x00FB1F02, 0x00FB2920,
    0x00FB2A02, 0x00FB3740, 0x00FB3802, 0x00FB3D40, 0x00FB3E02, 0x00FB3F40, 0x00FB4002, 0x00FB4240,
    0x00FB4302, 0x00FB4540, 0x00FB4602, 0x00FBB220, 0x00FBC340, 0x00FBD302, 0x00FD3E10, 0x00FD4020,
    0x00FD5002, 0x00FD9040, 0x00FD9202, 0x00FDC840, 0x00FDCF20, 0x00FDD040, 0x00FDF002, 0x00FDFC20,
    0x00FE0008, 0x00FE1010, 0x00FE1A40, 0x00FE2008, 0x00FE3010, 0x00FE5340, 0x00FE5410, 0x00FE6220,
    0x00FE6310, 0x00FE6420, 0x00FE6740, 0x00FE6810, 0x00FE6920, 0x00FE6A10, 0x00FE6C40, 0x00FE7002,
    0x00FE7540, 0x00FE7602, 0x00FEFD40, 0x00FF0110, 0x00FF0420, 0x00FF0510, 0x00FF0B20, 0x00FF0C10,
    0x00FF1001, 0x00FF1A10, 0x00FF1C20, 0x00FF1F10, 0x00FF2102, 0x00FF3B10, 0x00FF3E20, 0x00FF3F10,
    0x00FF4020, 0x00FF4102, 0x00FF5B10, 0x00FF5C20, 0x00FF5D10, 0x00FF5E20, 0x00FF5F10, 0x00FF6602,
    0x00FFBF40, 0x00FFC202, 0x00FFC840, 0x00FFCA02, 0x00FFD040, 0x00FFD202, 0x00FFD840, 0x00FFDA02,
    0x00FFDD40, 0x00FFE020, 0x00FFE740, 0x00FFE820, 0x00FFEF40, 0x00FFFC20, 0x00FFFE40, 0x01000002,
    0x01000C40, 0x01000D02, 0x01002740, 0x01002802, 0x01003B40, 0x01003C02, 0x01003E40, 0x01003F02,
    0x01004E40, 0x01005002, 0x01005E40, 0x01008002, 0x0100FB40, 0x01010010, 0x01010340, 0x01010701,
    0x01013440, 0x01013720, 0x01014001, 0x01017920, 0x01018A01, 0x01018C20, 0x01018F40, 0x01019020,
    0x01019D40, 0x0101A020, 0x0101A140, 0x0101D020, 0x0101FD08, 0x0101FE40, 0x01028002, 0x01029D40,
    0x0102A002, 0x0102D140, 0x0102E008, 0x0102E101, 0x0102FC40, 0x01030002, 0x01032001, 0x01032440,
    0x01032D02, 0x01034101, 0x01034202, 0x01034A01, 0x01034B40, 0x01035002, 0x01037608, 0x01037B40,
    0x01038002, 0x01039E40, 0x01039F10, 0x0103A002, 0x0103C440, 0x0103C802, 0x0103D010, 0x0103D101,
    0x0103D640, 0x01040002, 0x01049E40, 0x0104A001, 0x0104AA40, 0x0104B002, 0x0104D440, 0x0104D802,
    0x0104FC40, 0x01050002, 0x01052840, 0x01053002, 0x01056440, 0x01056F10, 0x01057002, 0x01057B40,
    0x01057C02, 0x01058B40, 0x01058C02, 0x01059340, 0x01059402, 0x01059640, 0x01059702, 0x0105A240,
    0x0105A302, 0x0105B240, 0x0105B302, 0x0105BA40, 0x0105BB02, 0x0105BD40, 0x01060002, 0x01073740,
    0x01074002, 0x01075640, 0x01076002, 0x01076840, 0x01078002, 0x01078640, 0x01078702, 0x0107B140,
    0x0107B202, 0x0107BB40, 0x01080002, 0x01080640, 0x01080802, 0x01080940, 0x01080A02, 0x01083640,
    0x01083702, 0x01083940, 0x01083C02, 0x01083D40, 0x01083F02, 0x01085640, 0x01085710, 0x01085801,
    0x01086002, 0x01087720, 0x01087901, 0x01088002, 0x01089F40, 0x0108A701, 0x0108B040, 0x0108E002,
    0x0108F340, 0x0108F402, 0x0108F640, 0x0108FB01, 0x01090002, 0x01091601, 0x01091C40, 0x01091F10,
    0x01092002, 0x01093A40, 0x01093F10, 0x01094040, 0x01098002, 0x0109B840, 0x0109BC01, 0x0109BE02,
    0x0109C001, 0x0109D040, 0x0109D201, 0x010A0002, 0x010A0108, 0x010A0440, 0x010A0508, 0x010A0740,
    0x010A0C08, 0x010A1002, 0x010A1440, 0x010A1502, 0x010A1840, 0x010A1902, 0x010A3640, 0x010A3808,
    0x010A3B40, 0x010A3F08, 0x010A4001, 0x010A4940, 0x010A5010, 0x010A5940, 0x010A6002, 0x010A7D01,
    0x010A7F10, 0x010A8002, 0x010A9D01, 0x010AA040, 0x010AC002, 0x010AC820, 0x010AC902, 0x010AE508,
    0x010AE740, 0x010AEB01, 0x010AF010, 0x010AF740, 0x010B0002, 0x010B3640, 0x010B3910, 0x010B4002,
    0x010B5640, 0x010B5801, 0x010B6002, 0x010B7340, 0x010B7801, 0x010B8002, 0x010B9240, 0x010B9910,
    0x010B9D40, 0x010BA901, 0x010BB040, 0x010C0002, 0x010C4940, 0x010C8002, 0x010CB340, 0x010CC002,
    0x010CF340, 0x010CFA01, 0x010D0002, 0x010D2408, 0x010D2840, 0x010D3001, 0x010D3A40, 0x010E6001,
    0x010E7F40, 0x010E8002, 0x010EAA40, 0x010EAB08, 0x010EAD10, 0x010EAE40, 0x010EB002, 0x010EB240,
    0x010EFD08, 0x010F0002, 0x010F1D01, 0x010F2702, 0x010F2840, 0x010F3002, 0x010F4608, 0x010F5101,
    0x010F5510, 0x010F5A40, 0x010F7002, 0x010F8208, 0x010F8610, 0x010F8A40, 0x010FB002, 0x010FC501,
    0x010FCC40, 0x010FE002, 0x010FF740, 0x01100008, 0x01100302, 0x01103808, 0x01104710, 0x01104E40,
    0x01105201, 0x01107008, 0x01107102, 0x01107308, 0x01107502, 0x01107640, 0x01107F08, 0x01108302,
    0x0110B008, 0x0110BB10, 0x0110BD40, 0x0110BE10, 0x0110C208, 0x0110C340, 0x0110D002, 0x0110E940,
    0x0110F001, 0x0110FA40, 0x01110008, 0x01110302, 0x01112708, 0x01113540, 0x01113601, 0x01114010,
    0x01114402, 0x01114508, 0x01114702, 0x01114840, 0x01115002, 0x01117308, 0x01117410, 0x01117602,
    0x01117740, 0x01118008, 0x01118302, 0x0111B308, 0x0111C102, 0x0111C510, 0x0111C908, 0x0111CD10,
    0x0111CE08, 0x0111D001, 0x0111DA02, 0x0111DB10, 0x0111DC02, 0x0111DD10, 0x0111E040, 0x0111E101,
    0x0111F540, 0x01120002, 0x01121240, 0x01121302, 0x01122C08, 0x01123810, 0x01123E08, 0x01123F02,
    0x01124108, 0x01124240, 0x01128002, 0x01128740, 0x01128802, 0x01128940, 0x01128A02, 0x01128E40,
    0x01128F02, 0x01129E40, 0x01129F02, 0x0112A910, 0x0112AA40, 0x0112B002, 0x0112DF08, 0x0112EB40,
    0x0112F001, 0x0112FA40, 0x01130008, 0x01130440, 0x01130502, 0x01130D40, 0x01130F02, 0x01131140,
    0x01131302, 0x01132940, 0x01132A02, 0x01133140, 0x01133202, 0x01133440, 0x01133502, 0x01133A40,
    0x01133B08, 0x01133D02, 0x01133E08, 0x01134540, 0x01134708, 0x01134940, 0x01134B08, 0x01134E40,
    0x01135002, 0x01135140, 0x01135708, 0x01135840, 0x01135D02, 0x01136208, 0x01136440, 0x01136608,
    0x01136D40, 0x01137008, 0x01137540, 0x01140002, 0x01143508, 0x01144702, 0x01144B10, 0x01145001,
    0x01145A10, 0x01145C40, 0x01145D10, 0x01145E08, 0x01145F02, 0x01146240, 0x01148002, 0x0114B008,
    0x0114C402, 0x0114C610, 0x0114C702, 0x0114C840, 0x0114D001, 0x0114DA40, 0x01158002, 0x0115AF08,
    0x0115B640, 0x0115B808, 0x0115C110, 0x0115D802, 0x0115DC08, 0x0115DE40, 0x01160002, 0x01163008,
    0x01164110, 0x01164402, 0x01164540, 0x01165001, 0x01165A40, 0x01166010, 0x01166D40, 0x01168002,
    0x0116AB08, 0x0116B802, 0x0116B910, 0x0116BA40, 0x0116C001, 0x0116CA40, 0x01170002, 0x01171B40,
    0x01171D08, 0x01172C40, 0x01173001, 0x01173C10, 0x01173F20, 0x01174002, 0x01174740, 0x01180002,
    0x01182C08, 0x01183B10, 0x01183C40, 0x0118A002, 0x0118E001, 0x0118F340, 0x0118FF02, 0x01190740,
    0x01190902, 0x01190A40, 0x01190C02, 0x01191440, 0x01191502, 0x01191740, 0x01191802, 0x01193008,
    0x01193640, 0x01193708, 0x01193940, 0x01193B08, 0x01193F02, 0x01194008, 0x01194102, 0x01194208,
    0x01194410, 0x01194740, 0x01195001, 0x01195A40, 0x0119A002, 0x0119A840, 0x0119AA02, 0x0119D108,
    0x0119D840, 0x0119DA08, 0x0119E102, 0x0119E210, 0x0119E302, 0x0119E408, 0x0119E540, 0x011A0002,
    0x011A0108, 0x011A0B02, 0x011A3308, 0x011A3A02, 0x011A3B08, 0x011A3F10, 0x011A4708, 0x011A4840,
    0x011A5002, 0x011A5108, 0x011A5C02, 0x011A8A08, 0x011A9A10, 0x011A9D02, 0x011A9E10, 0x011AA340,
    0x011AB002, 0x011AF940, 0x011B0010, 0x011B0A40, 0x011C0002, 0x011C0940, 0x011C0A02, 0x011C2F08,
    0x011C3740, 0x011C3808, 0x011C4002, 0x011C4110, 0x011C4640, 0x011C5001, 0x011C6D40, 0x011C7010,
    0x011C7202, 0x011C9040, 0x011C9208, 0x011CA840, 0x011CA908, 0x011CB740, 0x011D0002, 0x011D0740,
    0x011D0802, 0x011D0A40, 0x011D0B02, 0x011D3108, 0x011D3740, 0x011D3A08, 0x011D3B40, 0x011D3C08,
    0x011D3E40, 0x011D3F08, 0x011D4602, 0x011D4708, 0x011D4840, 0x011D5001, 0x011D5A40, 0x011D6002,
    0x011D6640, 0x011D6702, 0x011D6940, 0x011D6A02, 0x011D8A08, 0x011D8F40, 0x011D9008, 0x011D9240,
    0x011D9308, 0x011D9802, 0x011D9940, 0x011DA001, 0x011DAA40, 0x011EE002, 0x011EF308, 0x011EF710,
    0x011EF940, 0x011F0008, 0x011F0202, 0x011F0308, 0x011F0402, 0x011F1140, 0x011F1202, 0x011F3408,
    0x011F3B40, 0x011F3E08, 0x011F4310, 0x011F5001, 0x011F5A40, 0x011FB002, 0x011FB140, 0x011FC001,
    0x011FD520, 0x011FF240, 0x011FFF10, 0x01200002, 0x01239A40, 0x01240001, 0x01246F40, 0x01247010,
    0x01247540, 0x01248002, 0x01254440, 0x012F9002, 0x012FF110, 0x012FF340, 0x01300002, 0x01343040,
    0x01344008, 0x01344102, 0x01344708, 0x01345640, 0x01440002, 0x01464740, 0x01680002, 0x016A3940,
    0x016A4002, 0x016A5F40, 0x016A6001, 0x016A6A40, 0x016A6E10, 0x016A7002, 0x016ABF40, 0x016AC001,
    0x016ACA40, 0x016AD002, 0x016AEE40, 0x016AF008, 0x016AF510, 0x016AF640, 0x016B0002, 0x016B3008,
    0x016B3710, 0x016B3C20, 0x016B4002, 0x016B4410, 0x016B4520, 0x016B4640, 0x016B5001, 0x016B5A40,
    0x016B5B01, 0x016B6240, 0x016B6302, 0x016B7840, 0x016B7D02, 0x016B9040, 0x016E4002, 0x016E8001,
    0x016E9710, 0x016E9B40, 0x016F0002, 0x016F4B40, 0x016F4F08, 0x016F5002, 0x016F5108, 0x016F8840,
    0x016F8F08, 0x016F9302, 0x016FA040, 0x016FE002, 0x016FE210, 0x016FE302, 0x016FE408, 0x016FE540,
    0x016FF008, 0x016FF240, 0x01700002, 0x0187F840, 0x01880002, 0x018CD640, 0x018D0002, 0x018D0940,
    0x01AFF002, 0x01AFF440, 0x01AFF502, 0x01AFFC40, 0x01AFFD02, 0x01AFFF40, 0x01B00002, 0x01B12340,
    0x01B13202, 0x01B13340, 0x01B15002, 0x01B15340, 0x01B15502, 0x01B15640, 0x01B16402, 0x01B16840,
    0x01B17002, 0x01B2FC40, 0x01BC0002, 0x01BC6B40, 0x01BC7002, 0x01BC7D40, 0x01BC8002, 0x01BC8940,
    0x01BC9002, 0x01BC9A40, 0x01BC9C20, 0x01BC9D08, 0x01BC9F10, 0x01BCA040, 0x01CF0008, 0x01CF2E40,
    0x01CF3008, 0x01CF4740, 0x01CF5020, 0x01CFC440, 0x01D00020, 0x01D0F640, 0x01D10020, 0x01D12740,
    0x01D12920, 0x01D16508, 0x01D16A20, 0x01D16D08, 0x01D17340, 0x01D17B08, 0x01D18320, 0x01D18508,
    0x01D18C20, 0x01D1AA08, 0x01D1AE20, 0x01D1EB40, 0x01D20020, 0x01D24208, 0x01D24520, 0x01D24640,
    0x01D2C001, 0x01D2D440, 0x01D2E001, 0x01D2F440, 0x01D30020, 0x01D35740, 0x01D36001, 0x01D37940,
    0x01D40002, 0x01D45540, 0x01D45602, 0x01D49D40, 0x01D49E02, 0x01D4A040, 0x01D4A202, 0x01D4A340,
    0x01D4A502, 0x01D4A740, 0x01D4A902, 0x01D4AD40, 0x01D4AE02, 0x01D4BA40, 0x01D4BB02, 0x01D4BC40,
    0x01D4BD02, 0x01D4C440, 0x01D4C502, 0x01D50640, 0x01D50702, 0x01D50B40, 0x01D50D02, 0x01D51540,
    0x01D51602, 0x01D51D40, 0x01D51E02, 0x01D53A40, 0x01D53B02, 0x01D53F40, 0x01D54002, 0x01D54540,
    0x01D54602, 0x01D54740, 0x01D54A02, 0x01D55140, 0x01D55202, 0x01D6A640, 0x01D6A802, 0x01D6C120,
    0x01D6C202, 0x01D6DB20, 0x01D6DC02, 0x01D6FB20, 0x01D6FC02, 0x01D71520, 0x01D71602, 0x01D73520,
    0x01D73602, 0x01D74F20, 0x01D75002, 0x01D76F20, 0x01D77002, 0x01D78920, 0x01D78A02, 0x01D7A920,
    0x01D7AA02, 0x01D7C320, 0x01D7C402, 0x01D7CC40, 0x01D7CE01, 0x01D80020, 0x01DA0008, 0x01DA3720,
    0x01DA3B08, 0x01DA6D20, 0x01DA7508, 0x01DA7620, 0x01DA8408, 0x01DA8520, 0x01DA8710, 0x01DA8C40,
    0x01DA9B08, 0x01DAA040, 0x01DAA108, 0x01DAB040, 0x01DF0002, 0x01DF1F40, 0x01DF2502, 0x01DF2B40,
    0x01E00008, 0x01E00740, 0x01E00808, 0x01E01940, 0x01E01B08, 0x01E02240, 0x01E02308, 0x01E02540,
    0x01E02608, 0x01E02B40, 0x01E03002, 0x01E06E40, 0x01E08F08, 0x01E09040, 0x01E10002, 0x01E12D40,
    0x01E13008, 0x01E13702, 0x01E13E40, 0x01E14001, 0x01E14A40, 0x01E14E02, 0x01E14F20, 0x01E15040,
    0x01E29002, 0x01E2AE08, 0x01E2AF40, 0x01E2C002, 0x01E2EC08, 0x01E2F001, 0x01E2FA40, 0x01E2FF20,
    0x01E30040, 0x01E4D002, 0x01E4EC08, 0x01E4F001, 0x01E4FA40, 0x01E7E002, 0x01E7E740, 0x01E7E802,
    0x01E7EC40, 0x01E7ED02, 0x01E7EF40, 0x01E7F002, 0x01E7FF40, 0x01E80002, 0x01E8C540, 0x01E8C701,
    0x01E8D008, 0x01E8D740, 0x01E90002, 0x01E94408, 0x01E94B02, 0x01E94C40, 0x01E95001, 0x01E95A40,
    0x01E95E10, 0x01E96040, 0x01EC7101, 0x01ECAC20, 0x01ECAD01, 0x01ECB020, 0x01ECB101, 0x01ECB540,
    0x01ED0101, 0x01ED2E20, 0x01ED2F01, 0x01ED3E40, 0x01EE0002, 0x01EE0440, 0x01EE0502, 0x01EE2040,
    0x01EE2102, 0x01EE2340, 0x01EE2402, 0x01EE2540, 0x01EE2702, 0x01EE2840, 0x01EE2902, 0x01EE3340,
    0x01EE3402, 0x01EE3840, 0x01EE3902, 0x01EE3A40, 0x01EE3B02, 0x01EE3C40, 0x01EE4202, 0x01EE4340,
    0x01EE4702, 0x01EE4840, 0x01EE4902, 0x01EE4A40, 0x01EE4B02, 0x01EE4C40, 0x01EE4D02, 0x01EE5040,
    0x01EE5102, 0x01EE5340, 0x01EE5402, 0x01EE5540, 0x01EE5702, 0x01EE5840, 0x01EE5902, 0x01EE5A40,
    0x01EE5B02, 0x01EE5C40, 0x01EE5D02, 0x01EE5E40, 0x01EE5F02, 0x01EE6040, 0x01EE6102, 0x01EE6340,
    0x01EE6402, 0x01EE6540, 0x01EE6702, 0x01EE6B40, 0x01EE6C02, 0x01EE7340, 0x01EE7402, 0x01EE7840,
    0x01EE7902, 0x01EE7D40, 0x01EE7E02, 0x01EE7F40, 0x01EE8002, 0x01EE8A40, 0x01EE8B02, 0x01EE9C40,
    0x01EEA102, 0x01EEA440, 0x01EEA502, 0x01EEAA40, 0x01EEAB02, 0x01EEBC40, 0x01EEF020, 0x01EEF240,
    0x01F00020, 0x01F02C40, 0x01F03020, 0x01F09440, 0x01F0A020, 0x01F0AF40, 0x01F0B120, 0x01F0C040,
    0x01F0C120, 0x01F0D040, 0x01F0D120, 0x01F0F640, 0x01F10001, 0x01F10D20, 0x01F1AE40, 0x01F1E620,
    0x01F20340, 0x01F21020, 0x01F23C40, 0x01F24020, 0x01F24940, 0x01F25020, 0x01F25240, 0x01F26020,
    0x01F26640, 0x01F30020, 0x01F6D840, 0x01F6DC20, 0x01F6ED40, 0x01F6F020, 0x01F6FD40, 0x01F70020,
    0x01F77740, 0x01F77B20, 0x01F7DA40, 0x01F7E020, 0x01F7EC40, 0x01F7F020, 0x01F7F140, 0x01F80020,
    0x01F80C40, 0x01F81020, 0x01F84840, 0x01F85020, 0x01F85A40, 0x01F86020, 0x01F88840, 0x01F89020,
    0x01F8AE40, 0x01F8B020, 0x01F8B240, 0x01F90020, 0x01FA5440, 0x01FA6020, 0x01FA6E40, 0x01FA7020,
    0x01FA7D40, 0x01FA8020, 0x01FA8940, 0x01FA9020, 0x01FABE40, 0x01FABF20, 0x01FAC640, 0x01FACE20,
    0x01FADC40, 0x01FAE020, 0x01FAE940, 0x01FAF020, 0x01FAF940, 0x01FB0020, 0x01FB9340, 0x01FB9420,
    0x01FBCB40, 0x01FBF001, 0x01FBFA40, 0x02000002, 0x02A6E040, 0x02A70002, 0x02B73A40, 0x02B74002,
    0x02B81E40, 0x02B82002, 0x02CEA240, 0x02CEB002, 0x02EBE140, 0x02EBF002, 0x02EE5E40, 0x02F80002,
    0x02FA1E40, 0x03000002, 0x03134B40, 0x03135002, 0x0323B040, 0x0E010008, 0x0E01F040,
};
// ---- END generated by tests/gen-unicode.py ----

// Flags of a code point (VOCAB_CPT_*); 0 past U+10FFFF.
static int vocab_cpt_flags(uint32_t cp) {
    if (cp >= 0x110000) {
        return 0;
    }
    int lo = 0, hi = VOCAB_UCD_N_RANGES - 1;  // the last entry whose start is <= cp
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if ((vocab_ucd_ranges[mid] >> 8) <= cp) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return (int) (vocab_ucd_ranges[lo] & 0xFF);
}
