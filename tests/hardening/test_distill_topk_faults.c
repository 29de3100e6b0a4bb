/* distill_topk_faults: the top-k distillation calls (fh_distill_topk_forward, fh_distill_topk_forward_backward) under
 * faults, on a problem with ignored tokens (the rows that count are compacted: more allocations), ragged teacher rows
 * and a fully padded token, in row blocks and under a budget that makes the train step stream:
 *   - every allocation the library makes, failed in turn: FH_ERR_OUT_OF_MEMORY with a message that says so, outputs
 *     untouched, the context still usable (a retry gives the same results), nothing left allocated after destroy;
 *   - every buffer (x, weight, bias, targets, the teacher's ids and log-probs, grad_output, per-token losses, dx,
 *     dweight, dbias) flush against an inaccessible page, after its last byte and before its first, fp32 and bf16,
 *     each call in a forked child: no read or write outside a buffer;
 *   - bitwise repeatability: fresh and reused (dirty) contexts, 1 and 2 threads.
 * The other hardening suites enumerate their entry points through hardening_util's hu_call; these calls have a suite
 * of their own. */
#include "alloc_hook.h"
#include "hardening_util.h"

#include "bf16.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

enum { N = 24, H = 16, V = 257, K = 7, MAX_STEPS = 64 };

/* A row block holds min(N, 256) = N rows of V floats (4 N V bytes): half of that streams, with 8 x 64 tiles. */
static const int64_t STREAM_BUDGET = 2 * N * V;

typedef struct inputs {
    float *x, *weight, *bias, *logprobs, *grad;
    uint16_t *x_bf16, *weight_bf16;
    int64_t *targets, *ids;
} inputs;

typedef struct outputs {
    double loss, soft, hard;
    float *per_token, *dx, *dweight, *dbias;
} outputs;

/* What a call reads and writes, its sizes in bytes (the guard pages' buffers, in this order). */
enum { B_X, B_WEIGHT, B_BIAS, B_TARGETS, B_IDS, B_LOGPROBS, B_GRAD, B_PER_TOKEN, B_DX, B_DWEIGHT, B_DBIAS, BUFFERS };

static size_t buffer_bytes(int b, fh_dtype dtype)
{
    const size_t xw = dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
    static const size_t counts[BUFFERS] = {N * H, H * V, V, N, N * K, N * K, N, N, N * H, H * V, V};
    return counts[b] * (b == B_X || b == B_WEIGHT ? xw : b == B_TARGETS || b == B_IDS ? sizeof(int64_t)
                                                                                       : sizeof(float));
}

/* Token 3's entries all padded, the last two of tokens 1, 4, 7, ...; with `ignored`, tokens 2, 7, 12, ... ignored
 * (the rows that count are then compacted: the kernels read copies), else every token counts (they read the
 * caller's arrays; the last token's entries are all valid, so that they are read up to the last byte). */
static void fill_inputs(inputs *in, fh_dtype dtype, int ignored)
{
    uint64_t rng = 977;
    ce_fill_linear(&rng, N, H, V, 3.0, in->x, in->weight, in->bias);
    if (dtype == FH_DTYPE_BF16) {
        for (int j = 0; j < N * H; j++)
            in->x_bf16[j] = bf16_from_float(in->x[j]);
        for (int j = 0; j < H * V; j++)
            in->weight_bf16[j] = bf16_from_float(in->weight[j]);
    }
    for (int64_t i = 0; i < N; i++) {
        in->targets[i] = ignored && i % 5 == 2 ? -100 : (i * 37) % V;
        in->grad[i] = (float)(0.5 + 0.05 * (double)i);
        const int64_t padded = i == 3 ? K : i % 3 == 1 ? 2 : 0;
        for (int64_t e = 0; e < K; e++) {
            in->ids[i * K + e] = e >= K - padded ? 0 : (i * 13 + e * 29) % V;
            in->logprobs[i * K + e] = e >= K - padded ? -INFINITY : (float)(-1.0 - 0.4 * (double)e);
        }
    }
}

static fh_status run_call(fh_context *ctx, const inputs *in, fh_dtype dtype, int step, int add_tail, outputs *o)
{
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, dtype == FH_DTYPE_BF16 ? (const void *)in->x_bf16 : in->x,
                   dtype == FH_DTYPE_BF16 ? (const void *)in->weight_bf16 : in->weight, FH_LAYOUT_VH, in->bias);
    lin.x_dtype = lin.weight_dtype = dtype;
    fh_distill_topk_options opt;
    fh_distill_topk_options_init(&opt);
    opt.add_tail = add_tail;
    opt.temperature = 0.7;
    opt.weight_hard_loss = 0.3;
    opt.reduction = FH_REDUCTION_NONE; /* every grad_output read */
    const fh_topk_teacher teacher = {K, in->ids, in->logprobs};
    fh_distill_outputs out = {&o->loss, &o->soft, &o->hard, o->per_token};
    if (!step)
        return fh_distill_topk_forward(ctx, &lin, &teacher, in->targets, &opt, &out);
    fh_linear_grads g = {.dx = o->dx, .dx_row_stride = H, .dweight = o->dweight, .dbias = o->dbias};
    return fh_distill_topk_forward_backward(ctx, &lin, &teacher, in->targets, &opt, in->grad, &out, &g);
}

static void inputs_alloc(inputs *in)
{
    in->x = tu_alloc(N * H, sizeof(float));
    in->weight = tu_alloc(H * V, sizeof(float));
    in->bias = tu_alloc(V, sizeof(float));
    in->logprobs = tu_alloc(N * K, sizeof(float));
    in->grad = tu_alloc(N, sizeof(float));
    in->x_bf16 = tu_alloc(N * H, sizeof(uint16_t));
    in->weight_bf16 = tu_alloc(H * V, sizeof(uint16_t));
    in->targets = tu_alloc(N, sizeof(int64_t));
    in->ids = tu_alloc(N * K, sizeof(int64_t));
}

static void inputs_free(inputs *in)
{
    void *p[] = {in->x, in->weight, in->bias, in->logprobs, in->grad, in->x_bf16, in->weight_bf16, in->targets,
                 in->ids};
    for (size_t k = 0; k < TU_COUNT(p); k++)
        free(p[k]);
}

static void outputs_alloc(outputs *o)
{
    o->per_token = tu_alloc(N, sizeof(float));
    o->dx = tu_alloc(N * H, sizeof(float));
    o->dweight = tu_alloc(H * V, sizeof(float));
    o->dbias = tu_alloc(V, sizeof(float));
}

static void outputs_free(outputs *o)
{
    free(o->per_token);
    free(o->dx);
    free(o->dweight);
    free(o->dbias);
}

static void outputs_fill(outputs *o, unsigned char byte)
{
    memset(&o->loss, byte, sizeof o->loss);
    memset(&o->soft, byte, sizeof o->soft);
    memset(&o->hard, byte, sizeof o->hard);
    memset(o->per_token, byte, N * sizeof(float));
    memset(o->dx, byte, N * H * sizeof(float));
    memset(o->dweight, byte, H * V * sizeof(float));
    memset(o->dbias, byte, V * sizeof(float));
}

/* The first output that differs bytewise, or NULL. */
static const char *outputs_diff(const outputs *a, const outputs *b)
{
    if (memcmp(&a->loss, &b->loss, sizeof a->loss) || memcmp(&a->soft, &b->soft, sizeof a->soft) ||
        memcmp(&a->hard, &b->hard, sizeof a->hard))
        return "the loss";
    if (memcmp(a->per_token, b->per_token, N * sizeof(float)))
        return "per_token_loss";
    if (memcmp(a->dx, b->dx, N * H * sizeof(float)))
        return "dx";
    if (memcmp(a->dweight, b->dweight, H * V * sizeof(float)))
        return "dweight";
    return memcmp(a->dbias, b->dbias, V * sizeof(float)) ? "dbias" : NULL;
}

static int untouched(const outputs *o)
{
    outputs canary;
    outputs_alloc(&canary);
    outputs_fill(&canary, TU_CANARY);
    const int same = outputs_diff(o, &canary) == NULL;
    outputs_free(&canary);
    return same;
}

static fh_context *context(int threads, int streaming)
{
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return NULL;
    fh_context_set(ctx, FH_PARAM_THREADS, threads);
    if (streaming) {
        fh_context_set(ctx, FH_PARAM_TILE_ROWS, 8);
        fh_context_set(ctx, FH_PARAM_TILE_VOCAB, 64);
        fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, STREAM_BUDGET);
    }
    return ctx;
}

static const char *const schedules[] = {"row blocks", "streaming"};
static const char *const calls[] = {"fh_distill_topk_forward", "fh_distill_topk_forward_backward"};

static void test_allocation_failures(void)
{
    if (ah_init() != 0) {
        TU_CHECK(0, "the allocation hooks are not in effect (malloc is not interposed)");
        return;
    }
    inputs in;
    inputs_alloc(&in);
    fill_inputs(&in, FH_DTYPE_F32, 1);
    outputs expected, got;
    outputs_alloc(&expected);
    outputs_alloc(&got);
    for (int streaming = 0; streaming < 2; streaming++)
        for (int step = 0; step < 2; step++) {
            char label[96];
            snprintf(label, sizeof label, "%s, %s", calls[step], schedules[streaming]);
            fh_context *ctx = context(2, streaming);
            outputs_fill(&expected, TU_CANARY);
            TU_CHECK(ctx && run_call(ctx, &in, FH_DTYPE_F32, step, 1, &expected) == FH_OK, "%s: warm-up", label);
            fh_context_destroy(ctx);
            ah_reset(AH_LIBRARY);
            ctx = context(2, streaming);
            outputs_fill(&got, TU_CANARY);
            fh_status st = ctx ? run_call(ctx, &in, FH_DTYPE_F32, step, 1, &got) : FH_ERR_OUT_OF_MEMORY;
            fh_context_destroy(ctx);
            const long total = ah_counted();
            /* The context, its workspace and the compacted rows: the ignored tokens make the compaction allocate. */
            TU_CHECK(st == FH_OK && total >= 3, "%s: counting run: status %d, %ld library allocations", label,
                     (int)st, total);
            long k;
            for (k = 0; k < MAX_STEPS; k++) {
                ah_arm(k, AH_LIBRARY);
                ctx = context(2, streaming);
                if (!ctx) {
                    ah_disarm();
                    continue;
                }
                outputs_fill(&got, TU_CANARY);
                st = run_call(ctx, &in, FH_DTYPE_F32, step, 1, &got);
                const long injected = ah_failures();
                ah_disarm();
                if (injected == 0) {
                    TU_CHECK(st == FH_OK && outputs_diff(&got, &expected) == NULL, "%s: k = %ld: status %d, results",
                             label, k, (int)st);
                    fh_context_destroy(ctx);
                    break;
                }
                const char *message = "";
                fh_context_message(ctx, &message);
                TU_CHECK(st == FH_ERR_OUT_OF_MEMORY && tu_mentions(message, "allocate"),
                         "%s: k = %ld: status %d (%s), expected FH_ERR_OUT_OF_MEMORY", label, k, (int)st, message);
                TU_CHECK(untouched(&got), "%s: k = %ld: a failed call wrote an output", label, k);
                outputs_fill(&got, TU_CANARY);
                st = run_call(ctx, &in, FH_DTYPE_F32, step, 1, &got);
                TU_CHECK(st == FH_OK && outputs_diff(&got, &expected) == NULL, "%s: k = %ld: the retry: status %d",
                         label, k, (int)st);
                fh_context_destroy(ctx);
                TU_CHECK(ah_live_library_blocks() == 0, "%s: k = %ld: %ld library blocks live after destroy", label,
                         k, ah_live_library_blocks());
            }
            TU_CHECK(k == total, "%s: %ld injection steps for %ld library allocations", label, k, total);
        }
    outputs_free(&expected);
    outputs_free(&got);
    inputs_free(&in);
}

/* ---- Guard pages ---- */

typedef struct guarded {
    void *base;
    size_t length;
} guarded;

/* `bytes` usable bytes flush against a PROT_NONE page, after them (tail) or before them. */
static void *guard_alloc(guarded *g, size_t bytes, int tail)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), data_pages = (bytes + page - 1) / page + 1;
    g->length = (data_pages + 1) * page;
    char *base = mmap(NULL, g->length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        g->base = NULL;
        return NULL;
    }
    g->base = base;
    mprotect(tail ? base + data_pages * page : base, page, PROT_NONE);
    return tail ? base + data_pages * page - bytes : base + page;
}

typedef struct guard_case {
    fh_dtype dtype;
    int step, streaming, add_tail, tail, ignored;
} guard_case;

/* In a forked child: every buffer guarded, the call; 0 when it returned FH_OK. */
static int guarded_call(void *arg)
{
    const guard_case *c = arg;
    guarded g[BUFFERS];
    void *p[BUFFERS];
    for (int b = 0; b < BUFFERS; b++)
        if (!(p[b] = guard_alloc(&g[b], buffer_bytes(b, c->dtype), c->tail)))
            return 2;
    /* fill_inputs writes x and the weight in fp32 first: their fp32 values go to scratch for bf16. */
    float *x32 = tu_alloc(N * H, sizeof(float)), *w32 = tu_alloc(H * V, sizeof(float));
    const int bf16 = c->dtype == FH_DTYPE_BF16;
    inputs in = {bf16 ? x32 : p[B_X], bf16 ? w32 : p[B_WEIGHT], p[B_BIAS], p[B_LOGPROBS], p[B_GRAD],
                 bf16 ? p[B_X] : NULL, bf16 ? p[B_WEIGHT] : NULL, p[B_TARGETS], p[B_IDS]};
    fill_inputs(&in, c->dtype, c->ignored);
    outputs o = {0.0, 0.0, 0.0, p[B_PER_TOKEN], p[B_DX], p[B_DWEIGHT], p[B_DBIAS]};
    fh_context *ctx = context(2, c->streaming);
    fh_context_set(ctx, FH_PARAM_CHECK_FINITE, 1); /* the finite scan reads every view too */
    const fh_status st = run_call(ctx, &in, c->dtype, c->step, c->add_tail, &o);
    fh_context_destroy(ctx);
    free(x32);
    free(w32);
    for (int b = 0; b < BUFFERS; b++)
        munmap(g[b].base, g[b].length);
    return st == FH_OK ? 0 : 1;
}

static void test_guard_pages(void)
{
    for (int dtype = 0; dtype < 2; dtype++)
        for (int step = 0; step < 2; step++)
            for (int streaming = 0; streaming < 2; streaming++)
                for (int tail = 0; tail < 2; tail++)
                    for (int ignored = 0; ignored < 2; ignored++) {
                        /* add_tail alternates: both forms read the same entries */
                        const guard_case c = {dtype ? FH_DTYPE_BF16 : FH_DTYPE_F32, step, streaming, (tail + ignored) % 2,
                                              tail, ignored};
                        const int code = hu_run_isolated(guarded_call, (void *)&c);
                        TU_CHECK(code == 0, "%s %s, %s, add_tail %d, %s, guard %s: %s %d", dtype ? "bf16" : "fp32",
                                 calls[step], schedules[streaming], c.add_tail,
                                 ignored ? "ignored tokens (compacted)" : "every token counts",
                                 tail ? "after the last byte" : "before the first byte",
                                 code >= 1000 ? "killed by signal" : "exit code", code >= 1000 ? code - 1000 : code);
                    }
}

/* ---- Repeatability ---- */

static void test_repeatable(void)
{
    inputs in;
    inputs_alloc(&in);
    fill_inputs(&in, FH_DTYPE_F32, 1);
    outputs first, again;
    outputs_alloc(&first);
    outputs_alloc(&again);
    for (int threads = 1; threads <= 2; threads++)
        for (int streaming = 0; streaming < 2; streaming++)
            for (int step = 0; step < 2; step++) {
                fh_context *ctx = context(threads, streaming);
                outputs_fill(&first, 0);
                TU_CHECK(run_call(ctx, &in, FH_DTYPE_F32, step, 1, &first) == FH_OK, "status");
                for (int rep = 0; rep < 3; rep++) {
                    /* A fresh context, then the first one again (its workspace dirty). */
                    fh_context *fresh = rep == 0 ? context(threads, streaming) : NULL;
                    outputs_fill(&again, 0);
                    const fh_status st = run_call(fresh ? fresh : ctx, &in, FH_DTYPE_F32, step, 1, &again);
                    const char *d = outputs_diff(&first, &again);
                    TU_CHECK(st == FH_OK && d == NULL, "%s, %s, %d threads, repetition %d: status %d, %s differs",
                             calls[step], schedules[streaming], threads, rep, (int)st, d ? d : "nothing");
                    fh_context_destroy(fresh);
                }
                fh_context_destroy(ctx);
            }
    outputs_free(&first);
    outputs_free(&again);
    inputs_free(&in);
}

/* The guard pages first: their calls run in forked children, and GNU OpenMP's thread pool, once the parent has
 * started it (any call on 2 threads), does not survive a fork (as test_guard_pages.c, which runs alone). */
static const tu_test tests[] = {
    {"every buffer against an inaccessible page (fp32, bf16; both schedules)", test_guard_pages},
    {"every library allocation failed in turn: status, message, untouched outputs, retry, no leak",
     test_allocation_failures},
    {"bitwise repeatable: fresh and reused contexts, 1 and 2 threads", test_repeatable},
};
const tu_suite suite_distill_topk_faults = {tests, TU_COUNT(tests)};
