// tests/test-backend.c - the backend seam of kvr.h's "backends": the registry and backends by name,
// buffers and the tensors placed in them (in and out through the backend), the weights on a backend
// (kvr_model_to_backend: zero-copy on the CPU), and the comm protocol kvr_backend_graph_compute
// runs around any backend's graph_compute. The protocol is driven here by a backend written for
// the test, "dev", whose memory a transport cannot address (its buffers say host = false), as a
// GPU's: every comm node's memory must then reach the transport staged through tensor_get and
// come back through tensor_set, receives must be posted before the backend starts, sends
// finished after it ends, and the first error must stop the graph and be the one reported.
// Last, kvr_rank_gpu (the GPU of a rank) over launch shapes: one process driving several ranks,
// one rank a process with every GPU of the node visible or one GPU each (CUDA_VISIBLE_DEVICES per
// rank), several nodes with block and round-robin placement. And kvr_blas_core_for: which
// OpenBLAS core type a CPU should name when its OpenBLAS does not know it.
//
// usage: test-backend [SHARED_DIR (default ../shared)]

#include "kvr.h"
#include "tests/check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

//
// "dev": memory of its own (malloc'd, but declared not host), a graph_compute that runs only
// communication nodes, and counts of what crossed the seam
//

struct dev {
    int  n_set, n_get;          // tensor_set / tensor_get calls
    int  started;               // graph_compute calls
    char log[256];              // the order of events: 'b' begin, 'p' post_recv, 'c' compute starts, 'x' exec, 'f' finish
};

static void dev_log(struct dev * d, char c) {
    size_t n = strlen(d->log);
    if (n + 1 < sizeof(d->log)) { d->log[n] = c; d->log[n + 1] = 0; }
}

static const char * dev_name(struct kvr_backend * be) { (void)be; return "dev"; }
static void dev_free(struct kvr_backend * be) { free(be); }
static bool dev_supports_op(struct kvr_backend * be, const struct kvr_tensor * t) {
    (void)be;
    return t->op == KVR_OP_SEND || t->op == KVR_OP_RECV || t->op == KVR_OP_ALL_GATHER || t->op == KVR_OP_ALL_TO_ALL;
}
static int dev_buf_alloc(struct kvr_backend * be, struct kvr_buffer * buf) {
    (void)be;
    buf->base = aligned_alloc(64, (buf->size + 63) / 64 * 64 + 64);
    buf->host = false; // a transport may not touch it
    buf->owned = true;
    return buf->base ? KVR_OK : kvr_error(KVR_ERR_NOMEM, "dev: out of memory");
}
static int dev_buf_from_host(struct kvr_backend * be, struct kvr_buffer * buf, const void * host) {
    int rc = dev_buf_alloc(be, buf); // "upload" once
    if (rc == KVR_OK) memcpy(buf->base, host, buf->size);
    return rc;
}
static void dev_buf_free(struct kvr_backend * be, struct kvr_buffer * buf) { (void)be; free(buf->base); }
static void dev_buf_clear(struct kvr_backend * be, struct kvr_buffer * buf, uint8_t v) { (void)be; memset(buf->base, v, buf->size); }
static void dev_tensor_set(struct kvr_backend * be, struct kvr_tensor * t, const void * src, size_t off, size_t n) {
    ((struct dev *)be->context)->n_set++;
    memcpy((uint8_t *)t->data + off, src, n);
}
static void dev_tensor_get(struct kvr_backend * be, const struct kvr_tensor * t, void * dst, size_t off, size_t n) {
    ((struct dev *)be->context)->n_get++;
    memcpy(dst, (const uint8_t *)t->data + off, n);
}
static int dev_graph_compute(struct kvr_backend * be, struct kvr_graph * g) {
    struct dev * d = be->context;
    d->started++;
    dev_log(d, 'c');
    for (int i = 0; i < g->n_nodes; i++) {
        struct kvr_tensor * t = g->nodes[i];
        if (t->op == KVR_OP_NONE || t->op == KVR_OP_VIEW) continue;
        if (!dev_supports_op(be, t)) return kvr_error(KVR_ERR_UNSUPP, "dev: cannot run %s", kvr_op_name(t->op));
        int rc = kvr_backend_comm_node(be, t);
        if (rc != KVR_OK) return rc;
    }
    return KVR_OK;
}
static int dev_synchronize(struct kvr_backend * be) { (void)be; return KVR_OK; }

static struct kvr_backend * dev_new(struct dev * d) {
    struct kvr_backend * be = calloc(1, sizeof(*be));
    be->iface = (struct kvr_backend_i) {
        .name = dev_name, .free = dev_free, .supports_op = dev_supports_op,
        .buf_alloc = dev_buf_alloc, .buf_from_host = dev_buf_from_host, .buf_free = dev_buf_free,
        .buf_clear = dev_buf_clear, .tensor_set = dev_tensor_set, .tensor_get = dev_tensor_get,
        .graph_compute = dev_graph_compute, .synchronize = dev_synchronize,
    };
    be->context = d;
    return be;
}

//
// a loopback endpoint of rank 0 of 2: what rank 1 "sends" is a fixed pattern; what rank 0 sends
// is kept for the test to look at
//

struct loop {
    struct kvr_comm   base;
    struct dev      * d;
    const void      * post_dst[8];   // where each posted receive will land
    int               n_post;
    float             sent[64];      // the last SEND's bytes, as the transport saw them
    const void      * send_src;      // and their address
    int               fail_at;       // exec number that fails (0: none)
    int               n_exec;
    int               finish_rc;
};

static int loop_begin(struct kvr_comm * c, const struct kvr_graph * g) {
    struct loop * l = (struct loop *)c;
    dev_log(l->d, 'b');
    return g->n_nodes > 0 ? KVR_OK : kvr_error(KVR_ERR_ARG, "loop: an empty graph");
}

static int loop_post_recv(struct kvr_comm * c, const struct kvr_tensor * node, void * dst) {
    struct loop * l = (struct loop *)c;
    (void)node;
    dev_log(l->d, 'p');
    if (l->n_post < 8) l->post_dst[l->n_post++] = dst;
    return KVR_OK;
}

static int loop_exec(struct kvr_comm * c, const struct kvr_tensor * node, void * dst, const void * src) {
    struct loop * l = (struct loop *)c;
    dev_log(l->d, 'x');
    if (++l->n_exec == l->fail_at) return kvr_error(KVR_ERR_COMM, "loop: transfer %d lost", l->n_exec);
    const size_t row = node->nb[1];
    switch (node->op) {
        case KVR_OP_SEND:
            memcpy(l->sent, src, kvr_nbytes(node->src[0]));
            l->send_src = src;
            break;
        case KVR_OP_RECV: { // rank 1's rows: 100, 101, ...
            float * f = dst;
            for (int64_t i = 0; i < kvr_nelements(node); i++) f[i] = 100.0f + (float)i;
        } break;
        case KVR_OP_ALL_GATHER: // rows [0, 2) are rank 0's (src), rows [2, 4) rank 1's
            memcpy(dst, src, 2 * row);
            for (int64_t i = 0; i < 2 * node->ne[0]; i++) ((float *)dst)[2 * node->ne[0] + i] = -1.0f - (float)i;
            break;
        default:
            return kvr_error(KVR_ERR_ARG, "loop: %s not expected", kvr_op_name(node->op));
    }
    return KVR_OK;
}

static int loop_finish(struct kvr_comm * c) {
    struct loop * l = (struct loop *)c;
    dev_log(l->d, 'f');
    return l->finish_rc ? kvr_error(l->finish_rc, "loop: finish failed too") : KVR_OK;
}

// The graph: a [4, 2] tensor is sent to rank 1; rank 1's [4, 2] rows are received into the first
// rows of a [4, 4] tensor; a [4, 2] block is all-gathered into another [4, 4].
struct comm_graph {
    struct kvr_context * ctx;
    struct kvr_graph   * g;
    struct kvr_tensor  * a, * recv_into, * recv, * gsrc, * gdst, * gather;
    struct kvr_buffer  * buf, * nodes;
};

static void comm_graph_make(struct comm_graph * cg, struct kvr_backend * be) {
    cg->ctx = kvr_init(1 << 20, true);
    cg->a         = kvr_new_tensor_2d(cg->ctx, KVR_TYPE_F32, 4, 2);
    cg->recv_into = kvr_new_tensor_2d(cg->ctx, KVR_TYPE_F32, 4, 4);
    cg->gsrc      = kvr_new_tensor_2d(cg->ctx, KVR_TYPE_F32, 4, 2);
    cg->gdst      = kvr_new_tensor_2d(cg->ctx, KVR_TYPE_F32, 4, 4);
    cg->buf = kvr_backend_alloc_buffer(be, 4 * 1024);
    kvr_buffer_place(cg->buf, cg->a, 0);
    kvr_buffer_place(cg->buf, cg->recv_into, 1024);
    kvr_buffer_place(cg->buf, cg->gsrc, 2048);
    kvr_buffer_place(cg->buf, cg->gdst, 3072);
    kvr_buffer_clear(cg->buf, 0);
    const float av[8] = { 1, 2, 3, 4, 5, 6, 7, 8 }, gv[8] = { 10, 11, 12, 13, 14, 15, 16, 17 };
    kvr_backend_tensor_set(cg->a, av, 0, sizeof(av));
    kvr_backend_tensor_set(cg->gsrc, gv, 0, sizeof(gv));
    struct kvr_tensor * send = kvr_send(cg->ctx, cg->a, 1, kvr_tag(0, KVR_TAG_K, 0));
    cg->recv = kvr_recv(cg->ctx, kvr_view_2d(cg->ctx, cg->recv_into, 4, 2, cg->recv_into->nb[1], 0), 1, kvr_tag(0, KVR_TAG_V, 0));
    cg->gather = kvr_all_gather(cg->ctx, cg->gsrc, cg->gdst, 2, 4, kvr_tag(1, KVR_TAG_K, 0));
    cg->g = kvr_graph_new(cg->ctx, 64);
    kvr_graph_expand(cg->g, send);
    kvr_graph_expand(cg->g, cg->recv);
    kvr_graph_expand(cg->g, cg->gather);
    // the nodes' own memory (the SEND's result) comes from the plan, as an eval's would
    cg->nodes = kvr_backend_alloc_buffer(be, kvr_graph_plan(cg->g));
    kvr_graph_place(cg->g, cg->nodes);
}

static void comm_graph_free(struct comm_graph * cg) {
    kvr_buffer_free(cg->buf);
    kvr_buffer_free(cg->nodes);
    kvr_free(cg->ctx);
}

static void loop_init(struct loop * l, struct dev * d) {
    memset(l, 0, sizeof(*l));
    l->base.iface = (struct kvr_comm_i) { .begin = loop_begin, .post_recv = loop_post_recv, .exec = loop_exec, .finish = loop_finish };
    l->base.rank = 0;
    l->base.n_ranks = 2;
    l->base.context = l;
    l->d = d;
}

static void test_protocol(bool device_ptrs) {
    struct dev d = { 0 };
    struct kvr_backend * be = dev_new(&d);
    struct loop l;
    loop_init(&l, &d);
    l.base.device_ptrs = device_ptrs;
    kvr_backend_set_comm(be, &l.base);
    struct comm_graph cg;
    comm_graph_make(&cg, be);
    d.n_set = d.n_get = 0;
    const int rc = kvr_backend_graph_compute(be, cg.g);
    const char * how = device_ptrs ? "device pointers" : "staged";
    CHECK(rc == KVR_OK, "%s: graph_compute returned %d (%s)", how, rc, kvr_last_error());
    // the order: every receive posted before the backend starts, the sends finished after it
    CHECK(strcmp(d.log, "bpcxxxf") == 0, "%s: events %s, expected bpcxxxf (begin, post, compute, 3 transfers, finish)", how, d.log);
    if (device_ptrs) {
        CHECK(l.post_dst[0] == cg.recv->data, "device pointers: the receive was not posted into the tensor's own memory");
        CHECK(l.send_src == cg.a->data, "device pointers: the send did not read the tensor's own memory");
        CHECK(d.n_set == 0 && d.n_get == 0, "device pointers: %d tensor_set and %d tensor_get calls, expected none", d.n_set, d.n_get);
    } else {
        CHECK(l.post_dst[0] != NULL && l.post_dst[0] != cg.recv->data, "staged: the receive was posted into device memory");
        CHECK(l.send_src != cg.a->data, "staged: the transport was handed device memory to send");
        // SEND: its source; ALL_GATHER: its source out, its result in; RECV: its result in
        CHECK(d.n_get == 2 && d.n_set == 2, "staged: %d tensor_get and %d tensor_set calls, expected 2 and 2", d.n_get, d.n_set);
    }
    for (int i = 0; i < 8; i++) CHECK(l.sent[i] == (float)(i + 1), "%s: sent element %d is %g, expected %d", how, i, l.sent[i], i + 1);
    float got[16];
    kvr_backend_tensor_get(cg.recv_into, got, 0, sizeof(got));
    for (int i = 0; i < 16; i++) {
        const float want = i < 8 ? 100.0f + (float)i : 0.0f;
        CHECK(got[i] == want, "%s: received tensor element %d is %g, expected %g", how, i, got[i], want);
    }
    kvr_backend_tensor_get(cg.gdst, got, 0, sizeof(got));
    for (int i = 0; i < 16; i++) {
        const float want = i < 8 ? 10.0f + (float)i : -1.0f - (float)(i - 8);
        CHECK(got[i] == want, "%s: gathered element %d is %g, expected %g", how, i, got[i], want);
    }
    comm_graph_free(&cg);
    kvr_backend_free(be);
}

// the first error stops the graph, finish still runs, and the first error is the one reported
static void test_first_error(void) {
    struct dev d = { 0 };
    struct kvr_backend * be = dev_new(&d);
    struct loop l;
    loop_init(&l, &d);
    l.fail_at = 2;
    l.finish_rc = KVR_ERR_IO;
    kvr_backend_set_comm(be, &l.base);
    struct comm_graph cg;
    comm_graph_make(&cg, be);
    const int rc = kvr_backend_graph_compute(be, cg.g);
    CHECK(rc == KVR_ERR_COMM, "first error: returned %d, expected KVR_ERR_COMM (%d)", rc, KVR_ERR_COMM);
    CHECK(strstr(kvr_last_error(), "transfer 2 lost") != NULL, "first error: message '%s' is not the first error's", kvr_last_error());
    CHECK(strcmp(d.log, "bpcxxf") == 0, "first error: events %s, expected bpcxxf (stop after the failed transfer, then finish)", d.log);
    // no communicator at all: an error naming the node, no crash
    kvr_backend_set_comm(be, NULL);
    const int rc2 = kvr_backend_graph_compute(be, cg.g);
    CHECK(rc2 == KVR_ERR_ARG && strstr(kvr_last_error(), "communicator"), "no communicator: %d (%s)", rc2, kvr_last_error());
    comm_graph_free(&cg);
    kvr_backend_free(be);
}

// a node reading another backend's device memory is refused before anything runs
static void test_foreign_memory(void) {
    struct dev d = { 0 };
    struct kvr_backend * dev = dev_new(&d);
    struct kvr_backend * cpu = kvr_backend_cpu_new(1);
    struct kvr_context * ctx = kvr_init(1 << 20, true);
    struct kvr_tensor * x = kvr_new_tensor_1d(ctx, KVR_TYPE_F32, 16);
    struct kvr_buffer * dbuf = kvr_backend_alloc_buffer(dev, kvr_nbytes(x));
    kvr_buffer_place(dbuf, x, 0);
    struct kvr_tensor * y = kvr_scale(ctx, x, 2.0f);
    y->flags |= KVR_FLAG_OUTPUT;
    struct kvr_graph * g = kvr_graph_new(ctx, 8);
    kvr_graph_expand(g, y);
    struct kvr_buffer * cbuf = kvr_backend_alloc_buffer(cpu, kvr_graph_plan(g));
    kvr_graph_place(g, cbuf);
    CHECK(y->buffer == cbuf, "place: the node's buffer is not the one it was placed in");
    const int rc = kvr_backend_graph_compute(cpu, g);
    CHECK(rc == KVR_ERR_ARG && strstr(kvr_last_error(), "another backend"), "foreign memory: %d (%s)", rc, kvr_last_error());
    kvr_buffer_free(cbuf);
    kvr_buffer_free(dbuf);
    kvr_free(ctx);
    kvr_backend_free(cpu);
    kvr_backend_free(dev);
}

// The registry: "cpu" first and built, every name found and unique, every one this build lacks
// saying which build has it (kvr_backend_new and the tools' --backend quote needs and build),
// the list of names whole or cut short but terminated.
static void test_registry(void) {
    const int n = kvr_backend_count();
    CHECK(n >= 2 && strcmp(kvr_backend_registered(0)->name, "cpu") == 0 && kvr_backend_registered(0)->make,
          "the registry starts with a built cpu (%d backends)", n);
    char names[256], err[512];
    kvr_backend_names(names, sizeof(names), "|");
    for (int i = 0; i < n; i++) {
        const struct kvr_backend_info * b = kvr_backend_registered(i);
        CHECK(kvr_backend_find(b->name) == b && b->about && b->about[0], "'%s' is found by its name and has a line", b->name);
        CHECK(strstr(names, b->name) != NULL, "kvr_backend_names (%s) lists '%s'", names, b->name);
        if (b->make) continue;
        CHECK(b->needs && b->build, "'%s', not in this build, says what a build needs for it", b->name);
        struct kvr_backend * be = kvr_backend_new(b->name, NULL);
        snprintf(err, sizeof(err), "%s", kvr_last_error());
        CHECK(!be && strstr(err, b->name) && b->build && strstr(err, b->build), "kvr_backend_new(\"%s\") in this build: %s", b->name, err);
        kvr_backend_free(be);
    }
    CHECK(!kvr_backend_find("tpu") && !kvr_backend_find(NULL) && !kvr_backend_find("CPU"), "unregistered names are not found");
    struct kvr_backend * none = kvr_backend_new("tpu", NULL);
    snprintf(err, sizeof(err), "%s", kvr_last_error());
    for (int i = 0; i < n; i++) {
        CHECK(!none && strstr(err, kvr_backend_registered(i)->name), "the unknown-backend error lists '%s': %s", kvr_backend_registered(i)->name, err);
    }
    char small[3] = { 'x', 'x', 'x' };
    kvr_backend_names(small, sizeof(small), "|");
    CHECK(small[2] == 0 && strncmp(names, small, 2) == 0, "kvr_backend_names cut short: '%s'", small);
}

static void test_by_name_and_buffers(void) {
    struct kvr_backend * be = kvr_backend_new(NULL, NULL);
    CHECK(be && strcmp(kvr_backend_name(be), "cpu") == 0, "kvr_backend_new(NULL): %s", be ? kvr_backend_name(be) : kvr_last_error());
    struct kvr_backend * cuda = kvr_backend_new("cuda", NULL);
#ifdef KVR_CUDA
    kvr_backend_free(cuda);
#else
    CHECK(!cuda && strstr(kvr_last_error(), "without CUDA") && strstr(kvr_last_error(), "KVR_CUDA=1"),
          "kvr_backend_new(\"cuda\") in a build without CUDA: %s", cuda ? "a backend" : kvr_last_error());
#endif
    struct kvr_backend * none = kvr_backend_new("tpu", NULL);
    CHECK(!none && strstr(kvr_last_error(), "'tpu'") && strstr(kvr_last_error(), "cpu"), "unknown backend: %s", kvr_last_error());
    if (!be) return;
    struct kvr_counters cn;
    CHECK(kvr_backend_counters(be, &cn, true), "the CPU backend keeps counters");

    struct kvr_buffer * buf = kvr_backend_alloc_buffer(be, 1000);
    CHECK(buf && buf->backend == be && buf->size == 1000 && buf->host && ((uintptr_t)buf->base % 64) == 0,
          "a CPU buffer: backend, size 1000, host memory, 64-byte aligned");
    struct kvr_context * ctx = kvr_init(1 << 16, true);
    struct kvr_tensor * t = kvr_new_tensor_1d(ctx, KVR_TYPE_I32, 10);
    kvr_buffer_place(buf, t, 128);
    CHECK(t->buffer == buf && t->data == (uint8_t *)buf->base + 128, "place: buffer and address");
    struct kvr_tensor * v = kvr_view_1d(ctx, t, 4, 8);
    CHECK(v->buffer == buf, "a view of a placed tensor is in its buffer");
    const int32_t in[10] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };
    int32_t out[10] = { 0 };
    kvr_backend_tensor_set(t, in, 0, sizeof(in));
    kvr_backend_tensor_get(v, out, 0, 4 * sizeof(int32_t));
    CHECK(out[0] == 3 && out[3] == 6, "tensor_get of a view: %d %d, expected 3 6", out[0], out[3]);
    kvr_buffer_clear(buf, 0);
    kvr_backend_tensor_get(t, out, 4, 2 * sizeof(int32_t));
    CHECK(out[0] == 0 && out[1] == 0, "clear: zeros read back");
    kvr_buffer_free(buf);

    // weights from host memory: the CPU backend wraps it, zero-copy
    static const float host[6] = { 0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f };
    struct kvr_buffer * wb = kvr_backend_buffer_from_host(be, host, sizeof(host));
    CHECK(wb && wb->base == (const void *)host && !wb->owned, "buffer_from_host on the CPU is the host memory itself");
    struct kvr_tensor * w = kvr_new_tensor_1d(ctx, KVR_TYPE_F32, 2);
    kvr_buffer_place(wb, w, 2 * sizeof(float));
    float f[2];
    kvr_backend_tensor_get(w, f, 0, sizeof(f));
    CHECK(f[0] == 2.5f && f[1] == 3.5f, "a weight placed at an offset reads %g %g", f[0], f[1]);
    kvr_buffer_free(wb);
    kvr_free(ctx);
    kvr_backend_free(be);
}

// the weights on a backend: the CPU's are the mapping itself; a device's are a copy; tied
// embeddings stay one tensor
static void test_model_to_backend(const char * shared) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared);
    struct kvr_model * m = kvr_model_load(path, NULL);
    if (!m) {
        skip("model checks: %s", kvr_last_error());
        return;
    }
    struct kvr_backend * cpu = kvr_backend_cpu_new(1);
    struct kvr_model * w = kvr_model_to_backend(m, cpu);
    CHECK(w != NULL, "kvr_model_to_backend(cpu): %s", kvr_last_error());
    if (w) {
        CHECK(w->tok_embd != m->tok_embd && w->tok_embd->data == m->tok_embd->data && w->tok_embd->buffer->backend == cpu,
              "cpu: the embedding is a tensor of the backend over the same mapped bytes");
        CHECK(w->layers[0].wq && w->layers[0].wq->data == m->layers[0].wq->data, "cpu: layer 0's wq is zero-copy");
        CHECK((w->output == w->tok_embd) == (m->output == m->tok_embd), "cpu: tied embeddings stay tied");
        CHECK(strcmp(w->layers[1].ffn_down->name, m->layers[1].ffn_down->name) == 0, "cpu: names are kept");
        CHECK(w->layers[1].rope_base == m->layers[1].rope_base && w->layers[1].window == m->layers[1].window,
              "cpu: the per-layer settings are the model's");
    }
    struct dev d = { 0 };
    struct kvr_backend * dev = dev_new(&d);
    struct kvr_model * wd = kvr_model_to_backend(m, dev);
    CHECK(wd != NULL, "kvr_model_to_backend(dev): %s", kvr_last_error());
    if (wd) {
        const struct kvr_tensor * a = m->layers[0].wo, * b = wd->layers[0].wo;
        CHECK(b->data != a->data && !b->buffer->host, "dev: the weights were uploaded");
        uint32_t x = 0, y = 1;
        kvr_backend_tensor_get(a, &x, 28, sizeof(x));
        kvr_backend_tensor_get(b, &y, 28, sizeof(y));
        CHECK(x == y, "dev: an uploaded weight reads the same bytes (%08x, %08x)", x, y);
    }
    kvr_model_free(wd);
    kvr_model_free(w);
    // a model whose matrices are in tiles (kvr_model_params.no_tiles): the device gets the file's
    // rows, the whole data section byte for byte, and no tensor of its copy is flagged tiled
    snprintf(path, sizeof(path), "%s/reference/tiny-llama-Q4_0.gguf", shared);
    struct kvr_model * mt = kvr_model_load(path, NULL);
    if (mt && mt->n_tiled > 0) {
        struct kvr_model * wt = kvr_model_to_backend(mt, dev);
        CHECK(wt != NULL, "dev: a tiled model: %s", kvr_last_error());
        const size_t n = mt->weights->size;
        uint8_t * got = malloc(n);
        if (wt && got) {
            struct kvr_context * ctx = kvr_init(1u << 12, true);
            const int64_t ne[1] = { (int64_t)n };
            struct kvr_tensor * all = kvr_new_tensor(ctx, KVR_TYPE_I8, 1, ne);
            kvr_buffer_place(wt->weights, all, 0);
            kvr_backend_tensor_get(all, got, 0, n);
            CHECK(memcmp(got, mt->gguf->base + mt->gguf->data_offset, n) == 0 && !wt->tiles &&
                  !(wt->layers[0].wq->flags & KVR_FLAG_TILED) && (mt->layers[0].wq->flags & KVR_FLAG_TILED),
                  "dev: a tiled model's upload is not the file's rows");
            kvr_free(ctx);
        }
        free(got);
        kvr_model_free(wt);
    } else {
        skip("dev: a tiled model (%s)", mt ? "not tiled here" : kvr_last_error());
    }
    kvr_model_free(mt);
    kvr_backend_free(dev);
    kvr_backend_free(cpu);
    kvr_model_free(m);
}

//
// the GPU of a rank over launch shapes
//

// One launch: `nodes` nodes of `gpus` GPUs, `procs` processes of one rank per node (placed
// round-robin over the nodes, or in blocks), each seeing every GPU of its node or only its own
// (the launcher's CUDA_VISIBLE_DEVICES=node rank, which makes that GPU the process's device 0).
// Every process must get a device it sees; a node's processes must use distinct physical GPUs when
// there are enough, and share them evenly when not.
static void rank_gpu_launch(int nodes, int gpus, int procs, bool round_robin, bool one_each, int first) {
    const int world = nodes * procs;
    int use[16][16] = { { 0 } }; // [node][physical GPU]
    int seen_on_node[16] = { 0 };
    bool in_range = true;
    for (int r = 0; r < world; r++) {
        const int node = round_robin ? r % nodes : r / procs;
        const int node_rank = seen_on_node[node]++; // MPI_Comm_split_type's rank, keyed by world rank
        const int visible = one_each ? 1 : gpus;
        const int dev = kvr_rank_gpu(node_rank, one_each ? 0 : first, visible);
        in_range = in_range && dev >= 0 && dev < visible;
        const int phys = one_each ? node_rank % gpus : dev;
        if (dev >= 0 && dev < visible) use[node][phys]++;
    }
    int worst = 0, least = 1 << 30;
    for (int n = 0; n < nodes; n++) {
        for (int g = 0; g < gpus; g++) {
            worst = use[n][g] > worst ? use[n][g] : worst;
            least = use[n][g] < least ? use[n][g] : least;
        }
    }
    const int want_worst = (procs + gpus - 1) / gpus, want_least = procs / gpus;
    CHECK(in_range && worst == want_worst && least == want_least,
          "%d nodes x %d GPUs, %d processes a node (%s, %s, first %d): a GPU has %d..%d ranks, want %d..%d%s", nodes, gpus,
          procs, round_robin ? "round-robin" : "blocks", one_each ? "one GPU visible each" : "all visible", first, least,
          worst, want_least, want_worst, in_range ? "" : "; a device out of range");
}

static void test_rank_gpu(void) {
    CHECK(kvr_rank_gpu(0, 0, 0) == -1 && kvr_rank_gpu(3, 0, -1) == -1, "no GPU visible: -1");
    CHECK(kvr_rank_gpu(0, -5, 4) == 0 && kvr_rank_gpu(-1, 2, 4) == 2, "negative first or rank count as 0");
    // one process, n ranks from GPU `first`: rank i on (first + i) mod visible, distinct while n <= visible
    for (int visible = 1; visible <= 8; visible++) {
        for (int first = 0; first < 10; first++) {
            int hit[8] = { 0 }, dup = 0;
            for (int i = 0; i < visible; i++) {
                const int dev = kvr_rank_gpu(i, first, visible);
                if (dev < 0 || dev >= visible || hit[dev]++) dup++;
            }
            CHECK(dup == 0 && kvr_rank_gpu(0, first, visible) == first % visible,
                  "one process, %d GPUs from %d: %d ranks collide or leave the GPUs", visible, first, dup);
        }
    }
    // one rank a process: every node shape, placement and visibility
    for (int nodes = 1; nodes <= 4; nodes++) {
        for (int gpus = 1; gpus <= 8; gpus *= 2) {
            for (int procs = 1; procs <= 2 * gpus && procs <= 16; procs++) {
                for (int rr = 0; rr < 2; rr++) {
                    rank_gpu_launch(nodes, gpus, procs, rr, false, 0);
                    rank_gpu_launch(nodes, gpus, procs, rr, true, 0);
                    if (gpus > 1) rank_gpu_launch(nodes, gpus, procs, rr, false, 1);
                }
            }
        }
    }
    // (the rule replaced, the global rank modulo the GPUs, fails the round-robin shapes above: on
    // 2 nodes of 2 GPUs it put world ranks 0 and 2, both on node 0, on GPU 0)
}

static void test_blas_core(void) {
    // kernels without AVX2 on a CPU that has it: the type its vector units take
    CHECK(kvr_blas_core_for("Prescott", true, true) && strcmp(kvr_blas_core_for("Prescott", true, true), "SkylakeX") == 0,
          "Prescott on an AVX-512 CPU: SkylakeX");
    CHECK(kvr_blas_core_for("Nehalem", false, true) && strcmp(kvr_blas_core_for("Nehalem", false, true), "Haswell") == 0,
          "Nehalem on an AVX2 CPU: Haswell");
    CHECK(kvr_blas_core_for("Sandybridge", true, true) != NULL && kvr_blas_core_for("Unknown", false, true) != NULL,
          "Sandybridge (AVX, no FMA) and an unknown core on newer CPUs: named");
    // kernels that fit, a CPU without AVX2, or no name: nothing to do
    static const char * const fit[] = { "Haswell", "SkylakeX", "Cooperlake", "SapphireRapids", "Zen", "skylakex" };
    for (size_t i = 0; i < sizeof(fit) / sizeof(fit[0]); i++)
        CHECK(kvr_blas_core_for(fit[i], true, true) == NULL, "%s already runs vector kernels", fit[i]);
    CHECK(kvr_blas_core_for("Prescott", false, false) == NULL, "a CPU without AVX2: Prescott's kernels are its own");
    CHECK(kvr_blas_core_for(NULL, true, true) == NULL, "no core name: nothing");
}

int main(int argc, char ** argv) {
    const char * shared = argc > 1 ? argv[1] : "../shared";
    test_registry();
    test_by_name_and_buffers();
    test_protocol(false);
    test_protocol(true);
    test_first_error();
    test_foreign_memory();
    test_model_to_backend(shared);
    test_rank_gpu();
    test_blas_core();
    return check_summary("backend");
}
