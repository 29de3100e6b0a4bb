/* Guard pages: every input and output buffer of a call placed flush against an inaccessible page (after its
 * last byte, then before its first byte), so that a read or write one element outside it faults, inside BLIS
 * too (which ASan cannot see: it is not instrumented). Every entry point, both weight layouts, shapes with
 * odd hidden sizes and row counts (the edge cases of BLIS's small-matrix kernels), default and small tiles,
 * fp32 and (where the build has oneDNN) bf16 x and weight, with fp32 and with bf16 gradients. Distillation also
 * guards its teacher's x, weight and bias, in both teacher layouts, with a teacher of another hidden size and
 * (every other shape) the other dtype, and runs its train step in row blocks and streaming; top-k distillation
 * guards its teacher's ids and log-probs (ragged, a fully padded token), with and without the tail, and streams
 * too. KTO guards its labels,
 * both kinds of reference log-probs and of KL input (per token and one value for even shapes, per sequence for odd
 * ones).
 * Calls run in forked children, a batch each (test_guarded_buffers); a fault fails the test with the call and shape.
 *
 * ctest runs this suite on the default BLIS kernel set and, as hardening_guard_pages_haswell, with
 * BLIS_ARCH_TYPE=3 (BLIS 0.9's haswell set, the one AMD Zen and Intel AVX2 CPUs get). Debian's BLIS 0.9.0
 * haswell/zen small-matrix sgemm reads one float past the end of A when B is column-major and k is not a
 * multiple of 8 (for m = 1, 4, 7, ... rows); through fusedhead, that is x with the torch [V, H] layout
 * (README.md here, findings). */
#include "hardening_util.h"

#include "bf16.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A mapping with `bytes` usable bytes flush against a PROT_NONE page: after them (tail) or before them. */
typedef struct guarded {
    void *base;
    size_t length;
    void *p;
} guarded;

static void *guard_alloc(guarded *g, size_t bytes, int tail)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t data_pages = (bytes + page - 1) / page + 1;
    g->length = (data_pages + 1) * page;
    char *base = mmap(NULL, g->length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        g->base = g->p = NULL;
        return NULL;
    }
    g->base = base;
    if (tail) {
        mprotect(base + data_pages * page, page, PROT_NONE);
        /* Keep float alignment: bytes is a multiple of 4 (or 8). */
        g->p = base + data_pages * page - bytes;
    } else {
        mprotect(base, page, PROT_NONE);
        g->p = base + page;
    }
    return g->p;
}

static void guard_free(guarded *g)
{
    if (g->base)
        munmap(g->base, g->length);
    memset(g, 0, sizeof *g);
}

typedef struct guard_case {
    hu_call call;
    int64_t n, hidden, vocab;
    fh_layout layout;
    int64_t tile_rows, tile_vocab;
    int tail;
    fh_dtype dtype;      /* of x and weight */
    fh_dtype grad_dtype; /* of dx, dweight and dbias */
    /* Distillation: the teacher (hidden + 2) and the train step's schedule. */
    fh_layout teacher_layout;
    fh_dtype teacher_dtype;
    int streaming; /* a memory budget under which the train step streams (tiles then follow the budget) */
    int kto_per_sequence; /* KTO: the reference log-probs and the KL log-ratios per sequence (else per token, one
                             KL value) */
} guard_case;

enum { G_X, G_W, G_B, G_CW, G_T, G_GRAD, G_LSE, G_LOGP, G_ENT, G_MASK, G_ADV, G_OLD, G_REF, G_SAMP,
       G_PTL, G_OLOGP, G_OLSE, G_OENT, G_ARGMAX, G_DX, G_DW, G_DB, G_SEQ_LOGPS, G_REWARDS, G_TX, G_TW, G_TB,
       G_LABELS, G_REF_SEQ, G_KL, G_KL_RATIOS, G_TOPK_IDS, G_TOPK_LOGPROBS, G_LOGITS, G_SUPPORT_IDS, G_COUNT };

static float *fill(float *p, size_t count, uint64_t *rng, double scale, double offset)
{
    for (size_t i = 0; p && i < count; i++)
        p[i] = (float)(offset + scale * (2.0 * ref_uniform(rng) - 1.0));
    return p;
}

/* x or w in `dtype`: the fill's values, as bf16 bits in place for bf16. */
static void *fill_operand(guarded *g, size_t count, const guard_case *c, fh_dtype dtype, uint64_t *rng)
{
    if (dtype != FH_DTYPE_BF16)
        return fill(guard_alloc(g, count * 4, c->tail), count, rng, 1.0, 0.0);
    uint16_t *h = guard_alloc(g, count * 2, c->tail);
    for (size_t i = 0; h && i < count; i++)
        h[i] = bf16_from_float((float)(2.0 * ref_uniform(rng) - 1.0));
    return h;
}

/* In the child: 0 when the call returned FH_OK, 1 otherwise; a fault kills it. */
static int guarded_call(void *arg)
{
    const guard_case *c = arg;
    const int64_t n = c->n, h = c->hidden, v = c->vocab;
    const size_t un = (size_t)n, uh = (size_t)h, uv = (size_t)v;
    guarded g[G_COUNT];
    memset(g, 0, sizeof g);
    uint64_t rng = (uint64_t)(n * 1000 + h * 10 + v);
    const void *x = fill_operand(&g[G_X], un * uh, c, c->dtype, &rng);
    const void *w = fill_operand(&g[G_W], uh * uv, c, c->dtype, &rng);
    const int64_t th = h + 2;
    const void *tx = fill_operand(&g[G_TX], un * (size_t)th, c, c->teacher_dtype, &rng);
    const void *tw = fill_operand(&g[G_TW], (size_t)th * uv, c, c->teacher_dtype, &rng);
    const float *tb = fill(guard_alloc(&g[G_TB], uv * 4, c->tail), uv, &rng, 0.5, 0.0);
    float *b = fill(guard_alloc(&g[G_B], uv * 4, c->tail), uv, &rng, 0.5, 0.0);
    float *cw = fill(guard_alloc(&g[G_CW], uv * 4, c->tail), uv, &rng, 0.5, 1.0);
    int64_t *t = guard_alloc(&g[G_T], un * 8, c->tail);
    float *grad = fill(guard_alloc(&g[G_GRAD], un * 4, c->tail), un, &rng, 0.5, 1.0);
    float *lse = fill(guard_alloc(&g[G_LSE], un * 4, c->tail), un, &rng, 0.5, 5.0);
    float *logp = fill(guard_alloc(&g[G_LOGP], un * 4, c->tail), un, &rng, 0.5, -4.0);
    float *ent = fill(guard_alloc(&g[G_ENT], un * 4, c->tail), un, &rng, 0.5, 3.0);
    float *mask = guard_alloc(&g[G_MASK], un * 4, c->tail);
    float *adv = fill(guard_alloc(&g[G_ADV], 4, c->tail), 1, &rng, 1.0, 0.0);
    float *old = fill(guard_alloc(&g[G_OLD], un * 4, c->tail), un, &rng, 0.4, -4.0);
    float *ref = fill(guard_alloc(&g[G_REF], un * 4, c->tail), un, &rng, 0.4, -4.0);
    float *samp = fill(guard_alloc(&g[G_SAMP], un * 4, c->tail), un, &rng, 0.4, -4.0);
    float *ptl = guard_alloc(&g[G_PTL], un * 4, c->tail), *ologp = guard_alloc(&g[G_OLOGP], un * 4, c->tail);
    float *olse = guard_alloc(&g[G_OLSE], un * 4, c->tail), *oent = guard_alloc(&g[G_OENT], un * 4, c->tail);
    int64_t *argmax = guard_alloc(&g[G_ARGMAX], un * 8, c->tail);
    const size_t grad_size = c->grad_dtype == FH_DTYPE_BF16 ? 2 : 4; /* the guard sits after the last element */
    void *dx = guard_alloc(&g[G_DX], un * uh * grad_size, c->tail), *dw = guard_alloc(&g[G_DW], uh * uv * grad_size, c->tail);
    void *db = guard_alloc(&g[G_DB], uv * grad_size, c->tail);
    /* Preference calls: the n tokens as one pair of n / 2 (n odd: a pair of n / 2 and the last token unused is
     * not a preference batch, so those shapes skip them). */
    const int preference = hu_call_is_preference(c->call);
    if (preference && n % 2)
        return 0;
    /* KTO: two sequences of n / 2 (odd n: n sequences of one token), desirable and undesirable in turn. */
    const int64_t kto_batch = n % 2 ? n : 2, kto_seq = n / kto_batch;
    const size_t sequences = hu_call_is_kto(c->call) ? (size_t)kto_batch : 2;
    float *seq_logps = guard_alloc(&g[G_SEQ_LOGPS], sequences * 4, c->tail);
    float *rewards = guard_alloc(&g[G_REWARDS], sequences * 4, c->tail);
    uint8_t *labels = guard_alloc(&g[G_LABELS], (size_t)kto_batch, c->tail);
    float *ref_seq = fill(guard_alloc(&g[G_REF_SEQ], (size_t)kto_batch * 4, c->tail), (size_t)kto_batch, &rng, 2.0,
                          -4.0 * (double)kto_seq);
    float *kl = fill(guard_alloc(&g[G_KL], 4, c->tail), 1, &rng, 0.2, 0.2);
    float *kl_ratios = fill(guard_alloc(&g[G_KL_RATIOS], (size_t)kto_batch * 4, c->tail), (size_t)kto_batch, &rng, 0.5, 0.1);
    int64_t *topk_ids = guard_alloc(&g[G_TOPK_IDS], un * HU_TOPK_K * 8, c->tail);
    int64_t *support_ids = guard_alloc(&g[G_SUPPORT_IDS], un * HU_SUPPORT_K * 8, c->tail);
    float *topk_logprobs = guard_alloc(&g[G_TOPK_LOGPROBS], un * HU_TOPK_K * 4, c->tail);
    /* The log-probs' kept logits: written by the forward that keeps them, read by the backward from them. */
    float *logits = fill(guard_alloc(&g[G_LOGITS], un * uv * 4, c->tail), un * uv, &rng, 2.0, 0.0);
    for (int k = 0; k < G_COUNT; k++)
        if (!g[k].p)
            return 2;
    for (int64_t i = 0; i < n; i++) {
        t[i] = i % 5 == 3 ? -100 : (int64_t)(ref_uniform(&rng) * (double)v);
        mask[i] = i % 4 == 3 ? 0.0f : 1.0f;
    }
    for (int64_t s = 0; s < kto_batch; s++)
        labels[s] = s % 2 == 0;
    /* The top-k teacher as hu_grpo_problem's: the last two entries of tokens 1, 4, 7, ... padded, token 3's all
     * (the last token's are valid, so that they are read up to the last byte). */
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < HU_TOPK_K; e++) {
            const int pad = e >= HU_TOPK_K - (i == 3 ? HU_TOPK_K : i % 3 == 1 ? 2 : 0);
            topk_ids[i * HU_TOPK_K + e] = pad ? 0 : (int64_t)(ref_uniform(&rng) * (double)v);
            topk_logprobs[i * HU_TOPK_K + e] = pad ? -INFINITY : (float)(-1.0 - 0.4 * (double)e);
        }
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return 2;
    fh_context_set(ctx, FH_PARAM_THREADS, 1);
    fh_context_set(ctx, FH_PARAM_TILE_ROWS, c->tile_rows);
    fh_context_set(ctx, FH_PARAM_TILE_VOCAB, c->tile_vocab);
    fh_context_set(ctx, FH_PARAM_CHECK_FINITE, 1); /* the finite scan reads every view too */
    fh_linear lin;
    fh_linear_init(&lin, n, h, v, x, w, c->layout, b);
    lin.x_dtype = lin.weight_dtype = c->dtype;
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.class_weights = cw;
    o.label_smoothing = 0.1;
    o.z_loss = 1e-4;
    o.softcap = 20.0;
    double loss, z_loss;
    fh_grpo_metrics metrics;
    fh_ce_outputs ce_out = {&loss, &z_loss, ptl, ologp, olse, argmax, NULL, NULL};
    fh_grpo_outputs grpo_out = {&loss, &metrics, ologp, ptl, oent, olse};
    fh_linear_grads grads = {.dx = dx, .dx_row_stride = h, .dweight = dw, .dbias = db, .dx_dtype = c->grad_dtype,
                             .dweight_dtype = c->grad_dtype, .dbias_dtype = c->grad_dtype};
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    lo.temperature = 0.8;
    lo.softcap = 20.0;
    fh_logprob_outputs logprob_out = {ologp, oent, olse};
    fh_grpo_options go;
    fh_grpo_options_init(&go);
    go.beta = 0.04;
    go.entropy_coef = 0.01;
    go.off_policy_mask_threshold = 0.0; /* reads the sampler's log-probs, as the importance-sampling correction does */
    const fh_grpo_batch batch = {1, n, t, mask, adv, old, ref, samp, NULL, NULL};
    fh_preference_options po;
    fh_preference_options_init(&po);
    po.loss_type_count = 2; /* TRL's current DPO with its NLL term (sft), as rpo_alpha was */
    po.loss_types[0] = FH_PREFERENCE_SIGMOID, po.loss_weights[0] = 1.0;
    po.loss_types[1] = FH_PREFERENCE_SFT, po.loss_weights[1] = 0.5;
    const fh_preference_batch pairs = {1, n / 2, t, mask, NULL, ref, NULL};
    fh_preference_metrics pref_metrics;
    fh_preference_outputs pref_out = {&loss, &pref_metrics, seq_logps, rewards, ologp};
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    ko.undesirable_weight = 1.5;
    const int kto_per_sequence = c->kto_per_sequence;
    const fh_kto_batch kto = {kto_batch,
                              kto_seq,
                              t,
                              mask,
                              labels,
                              kto_per_sequence ? ref_seq : NULL,
                              kto_per_sequence ? NULL : ref,
                              kto_per_sequence ? NULL : kl,
                              kto_per_sequence ? kl_ratios : NULL, NULL};
    fh_kto_metrics kto_metrics;
    fh_kto_outputs kto_out = {&loss, &kto_metrics, seq_logps, rewards, ologp};
    /* Distillation: jsd with the hard loss; reduction 'none' (every grad_output read) with the guard before the
     * buffers, mean after them. */
    fh_linear teacher;
    fh_linear_init(&teacher, n, th, v, tx, tw, c->teacher_layout, tb);
    teacher.x_dtype = teacher.weight_dtype = c->teacher_dtype;
    fh_distill_options dopt;
    fh_distill_options_init(&dopt);
    dopt.beta = 0.3;
    dopt.temperature = 2.0;
    dopt.weight_hard_loss = 0.4;
    dopt.reduction = c->tail ? FH_REDUCTION_MEAN : FH_REDUCTION_NONE;
    double soft_loss, hard_loss;
    fh_distill_outputs distill_out = {&loss, &soft_loss, &hard_loss, ptl};
    /* Top-k distillation: the same reductions and hard loss, with and without the tail (odd and even n). */
    const fh_topk_teacher topk = {HU_TOPK_K, topk_ids, topk_logprobs};
    fh_distill_topk_options topt;
    fh_distill_topk_options_init(&topt);
    topt.add_tail = (int)(n % 2);
    topt.temperature = 0.7;
    topt.weight_hard_loss = 0.3;
    topt.reduction = dopt.reduction;
    if (c->streaming) {
        const int64_t budget = hu_distill_streaming_budget(&lin, hu_call_is_distill(c->call) ? &teacher : NULL, 1);
        if (budget <= 0 || fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, budget) != FH_OK)
            return 3;
    }
    for (int64_t i = 0; i < n && hu_call_on_sequences(c->call); i++)
        t[i] = i % 5 == 3 ? -100 : t[i] < 0 ? 0 : t[i];
    for (int64_t i = 0; i < n && hu_call_on_sequences(c->call); i++)
        if (t[i] < 0)
            mask[i] = 0.0f;
    hu_support_fill(support_ids, t, n, v);
    const fh_support support = {support_ids, NULL, HU_SUPPORT_K};
    fh_status st = FH_ERR_NULL_POINTER; /* set by the switch below, which has every head call */
#pragma GCC diagnostic error "-Wswitch" /* every head call guarded: a listed one without a case does not compile */
    switch (c->call) {
    case HU_fh_ce_forward: st = fh_ce_forward(ctx, &lin, t, &o, &ce_out); break;
    case HU_fh_ce_backward: st = fh_ce_backward(ctx, &lin, t, &o, lse, grad, &grads); break;
    case HU_fh_ce_forward_backward: st = fh_ce_forward_backward(ctx, &lin, t, &o, grad, &ce_out, &grads); break;
    case HU_fh_logprob_forward: st = fh_logprob_forward(ctx, &lin, t, &lo, &logprob_out); break;
    case HU_fh_logprob_backward: st = fh_logprob_backward(ctx, &lin, t, &lo, lse, ent, grad, grad, grad, &grads); break;
    case HU_fh_logprob_forward_keep: st = fh_logprob_forward_keep(ctx, &lin, t, &lo, &logprob_out, logits); break;
    case HU_fh_logprob_backward_kept:
        st = fh_logprob_backward_kept(ctx, &lin, t, &lo, logits, lse, ent, grad, grad, grad, &grads);
        break;
    case HU_fh_logprob_forward_backward:
        st = fh_logprob_forward_backward(ctx, &lin, t, &lo, grad, grad, grad, &logprob_out, &grads);
        break;
    case HU_fh_logprob_support_forward:
        st = fh_logprob_support_forward(ctx, &lin, t, &support, &lo, &logprob_out);
        break;
    case HU_fh_logprob_support_backward:
        st = fh_logprob_support_backward(ctx, &lin, t, &support, &lo, lse, ent, grad, grad, grad, &grads);
        break;
    case HU_fh_logprob_support_forward_backward:
        st = fh_logprob_support_forward_backward(ctx, &lin, t, &support, &lo, grad, grad, grad, &logprob_out, &grads);
        break;
    case HU_fh_grpo_forward: st = fh_grpo_forward(ctx, &lin, &batch, &go, &grpo_out); break;
    case HU_fh_grpo_backward: st = fh_grpo_backward(ctx, &lin, &batch, &go, logp, lse, ent, grad, &grads); break;
    case HU_fh_grpo_forward_backward: st = fh_grpo_forward_backward(ctx, &lin, &batch, &go, grad, &grpo_out, &grads); break;
    case HU_fh_preference_forward: st = fh_preference_forward(ctx, &lin, &pairs, &po, &pref_out); break;
    case HU_fh_preference_forward_backward: st = fh_preference_forward_backward(ctx, &lin, &pairs, &po, grad, &pref_out, &grads); break;
    case HU_fh_kto_forward: st = fh_kto_forward(ctx, &lin, &kto, &ko, &kto_out); break;
    case HU_fh_kto_forward_backward: st = fh_kto_forward_backward(ctx, &lin, &kto, &ko, grad, &kto_out, &grads); break;
    case HU_fh_distill_forward: st = fh_distill_forward(ctx, &lin, &teacher, t, &dopt, &distill_out); break;
    case HU_fh_distill_forward_backward:
        st = fh_distill_forward_backward(ctx, &lin, &teacher, t, &dopt, grad, &distill_out, &grads);
        break;
    case HU_fh_distill_topk_forward: st = fh_distill_topk_forward(ctx, &lin, &topk, t, &topt, &distill_out); break;
    case HU_fh_distill_topk_forward_backward:
        st = fh_distill_topk_forward_backward(ctx, &lin, &topk, t, &topt, grad, &distill_out, &grads);
        break;
    }
    fh_context_destroy(ctx);
    for (int k = 0; k < G_COUNT; k++)
        guard_free(&g[k]);
    return st == FH_OK ? 0 : 1;
}

/* The calls that get a streaming budget of their own (hu_distill_streaming_budget). */
static int streams(hu_call call)
{
    return hu_call_is_distill(call) || hu_call_is_distill_topk(call);
}

/* Cases run in forked children, BATCH at a time (a child compiles oneDNN's primitives once for its batch, not once
 * per call: on the oneDNN variants, most of the suite's time), each child writing the index of the case it starts
 * into shared memory: a fault names its case, and the next child resumes after it. */
enum { BATCH = 128 };

typedef struct batch {
    const guard_case *cases;
    size_t first, end;
    volatile size_t *current; /* shared with the parent */
} batch;

static int run_batch(void *arg)
{
    const batch *b = arg;
    for (size_t k = b->first; k < b->end; k++) {
        *b->current = k;
        const int code = guarded_call((void *)&b->cases[k]);
        if (code != 0)
            return code;
    }
    return 0;
}

static void describe_case(const guard_case *c, char *text, size_t size)
{
    const int distill = hu_call_is_distill(c->call);
    snprintf(text, size, "%s %s, layout %s, n=%lld hidden=%lld vocab=%lld, tiles %lld x %lld%s, guard %s%s%s%s",
             c->grad_dtype == FH_DTYPE_BF16 ? "bf16 (bf16 gradients)" : c->dtype == FH_DTYPE_BF16 ? "bf16" : "fp32",
             hu_call_name(c->call), c->layout == FH_LAYOUT_VH ? "VH" : "HV", (long long)c->n, (long long)c->hidden,
             (long long)c->vocab, (long long)c->tile_rows, (long long)c->tile_vocab,
             c->streaming ? " (streaming budget)" : "", c->tail ? "after the last byte" : "before the first byte",
             distill ? ", teacher " : "", distill ? (c->teacher_layout == FH_LAYOUT_VH ? "VH" : "HV") : "",
             distill ? (c->teacher_dtype == FH_DTYPE_BF16 ? " bf16" : " fp32") : "");
}

static void test_guarded_buffers(void)
{
    const char *arch = getenv("BLIS_ARCH_TYPE");
    __builtin_cpu_init();
    if (arch && strcmp(arch, "3") == 0 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        printf("\n    BLIS_ARCH_TYPE=3 (haswell) needs AVX2 and FMA: skipped on this CPU");
        return;
    }
    static const int64_t shapes[][3] = {{1, 7, 61},  {4, 7, 61},  {10, 7, 61}, {13, 9, 17}, {7, 100, 33},
                                        {16, 8, 64}, {3, 1, 1},   {5, 2, 300}, {9, 15, 1},  {31, 129, 40}};
    /* The last entry (both distillations only): the streaming budget, default tiles. */
    static const int64_t tiles[][2] = {{0, 0}, {4, 16}, {3, 7}, {0, 0}};
    /* fp32; bf16 inputs with fp32 gradients; bf16 inputs and gradients. */
    const int dtypes = 3;
    const size_t most = (size_t)dtypes * HU_CALL_COUNT * 2 * 2 * TU_COUNT(shapes) * TU_COUNT(tiles) * 2;
    guard_case *cases = malloc(sizeof *cases * most);
    volatile size_t *current = mmap(NULL, sizeof *current, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    TU_CHECK(cases && current != MAP_FAILED, "the cases' memory");
    if (!cases || current == MAP_FAILED) {
        free(cases);
        return;
    }
    size_t count = 0;
    for (int dtype = 0; dtype < dtypes; dtype++)
        for (int call = 0; call < HU_CALL_COUNT; call++)
            for (int layout = 0; layout < 2; layout++)
                for (int teacher_layout = 0; teacher_layout < (hu_call_is_distill((hu_call)call) ? 2 : 1); teacher_layout++)
                for (size_t s = 0; s < TU_COUNT(shapes); s++)
                    for (size_t t = 0; t < TU_COUNT(tiles) - !streams((hu_call)call); t++)
                        for (int tail = 1; tail >= 0; tail--) {
                            const fh_dtype xw = dtype ? FH_DTYPE_BF16 : FH_DTYPE_F32;
                            /* The teacher: the student's dtype for even shapes, the other one for odd shapes; KTO's
                             * reference and KL per token and one value for even shapes, per sequence for odd ones. */
                            const fh_dtype other = s % 2 == 0 ? xw
                                                   : xw == FH_DTYPE_BF16 ? FH_DTYPE_F32 : FH_DTYPE_BF16;
                            const guard_case c = {(hu_call)call, shapes[s][0], shapes[s][1], shapes[s][2], (fh_layout)layout,
                                                  tiles[t][0], tiles[t][1], tail, xw,
                                                  dtype == 2 ? FH_DTYPE_BF16 : FH_DTYPE_F32, (fh_layout)teacher_layout,
                                                  other, t == 3, (int)(s % 2)};
                            cases[count++] = c;
                        }
    int faults = 0;
    for (size_t first = 0; first < count;) {
        const batch b = {cases, first, first + BATCH < count ? first + BATCH : count, current};
        *current = first;
        const int code = hu_run_isolated(run_batch, (void *)&b);
        if (code == 0) {
            first = b.end;
            continue;
        }
        const size_t failed = *current;
        char what[256];
        describe_case(&cases[failed], what, sizeof what);
        if (faults++ < 40)
            TU_CHECK(0, "%s: %s %d", what, code >= 1000 ? "killed by signal" : "exit code",
                     code >= 1000 ? code - 1000 : code);
        first = failed + 1;
    }
    TU_CHECK(faults == 0, "%d guarded calls failed (first 40 listed)", faults);
    TU_CHECK(count > 5000, "%zu guarded calls", count);
    munmap((void *)current, sizeof *current);
    free(cases);
    fh_kernel_info info;
    if (fh_kernel_query(&info) == FH_OK)
        printf("\n    BLIS kernel set: %s", info.kernel_set);
}

static const tu_test tests[] = {
    {"buffers flush against inaccessible pages", test_guarded_buffers},
};
const tu_suite suite_guard_pages = {tests, TU_COUNT(tests)};
