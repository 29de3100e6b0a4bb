/* Overflow and nonsense shapes with pointers to tiny buffers: validation must reject them before touching
 * memory. Every call runs in a forked child (a crash fails one assertion, not the suite) with outputs
 * pre-filled with a canary; the child reports the status and whether any output changed.
 *
 * The rule tested, beyond the pairwise size products and element offsets that the library checks: a view
 * whose last element lies more than PTRDIFF_MAX bytes from its base describes no object that can exist
 * (C objects are smaller than PTRDIFF_MAX bytes), and computing `base + offset` for it overflows the
 * pointer arithmetic, so it must be rejected with FH_ERR_SIZE_OVERFLOW like an offset that overflows
 * int64. For fp32 views that is an element offset above PTRDIFF_MAX / 4 = 2^61 - 1.
 *
 * Distillation and top-k distillation: the student gets every case above (distillation's teacher the same view,
 * top-k's one entry per token); then distillation's teacher alone gets
 * broken sizes, products, strides, dtypes and pointers (its status, and a message naming the teacher), a
 * teacher whose n or V differs from the student's (FH_ERR_TEACHER_MISMATCH), and the calls get every refused
 * option and input (temperature, beta, loss weights, divergence, reduction, targets, outputs, grad_output,
 * gradients): each with its status, a message that names what is wrong, and every output untouched. */
#include "hardening_util.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define P2(k) ((int64_t)1 << (k))

enum { TINY = 64 };

/* Tiny inputs and outputs shared by the children (each child has its own copy). */
static float tiny_x[TINY], tiny_w[TINY], tiny_b[TINY], tiny_mask[TINY], tiny_adv[TINY], tiny_logps[TINY];
static float tiny_grad[TINY], tiny_lse[TINY], tiny_logits[TINY];
static int64_t tiny_targets[TINY];
static uint8_t tiny_labels[TINY];

typedef struct shape_case {
    const char *name;
    int64_t n, hidden, vocab;
    int64_t x_row_stride, w_stride_hidden, w_stride_vocab; /* 0: contiguous HV */
    int64_t dx_row_stride;                                  /* 0: hidden */
    int64_t batch, seq;                                     /* GRPO; 0: batch 1, seq n */
    uint64_t expected;                                      /* bit per acceptable status */
    int grads_only;                                         /* the broken part is dx: calls with gradients */
} shape_case;

#define ST(s) (UINT64_C(1) << (s))

/* A child's exit code: CODE_STATUS + the call's status (every status is below 64), CODE_WRITTEN more when a failed
 * call wrote an output, CODE_UNNAMED more (teacher cases) when its message does not name the teacher; below
 * CODE_STATUS the child itself failed (1, or a sanitizer's report). */
enum { CODE_STATUS = 2, CODE_WRITTEN = 64, CODE_UNNAMED = 128 };

static const shape_case cases[] = {
    {"n * vocab overflows", P2(32), 1, P2(32), 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"hidden * vocab overflows", 1, P2(32), P2(32), 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"n * hidden overflows", P2(32), P2(32), 1, 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"every size INT64_MAX", INT64_MAX, INT64_MAX, INT64_MAX, 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"n = INT64_MAX, hidden = vocab = 2", INT64_MAX, 2, 2, 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"n = 0", 0, 4, 4, 0, 0, 0, 0, 0, 0, ST(FH_ERR_INVALID_SIZE), 0},
    {"n = INT64_MIN", INT64_MIN, 4, 4, 4, 0, 0, 0, 0, 0, ST(FH_ERR_INVALID_SIZE), 0},
    {"hidden = INT64_MIN", 2, INT64_MIN, 4, 4, 0, 0, 0, 0, 0, ST(FH_ERR_INVALID_SIZE), 0},
    {"vocab = -2^40", 2, 4, -P2(40), 0, 1, 1, 0, 0, 0, ST(FH_ERR_INVALID_SIZE), 0},
    {"x_row_stride * (n - 1) overflows", 4, 2, 2, INT64_MAX / 2, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"x_row_stride = INT64_MIN", 3, 2, 2, INT64_MIN, 0, 0, 0, 0, 0, ST(FH_ERR_INVALID_STRIDE), 0},
    {"x last offset 2^61 (bytes overflow ptrdiff_t)", 2, 1, 1, P2(61), 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"x_row_stride = INT64_MAX / 2, n = 3 (bytes wrap to -8)", 3, 2, 2, INT64_MAX / 2, 0, 0, 0, 0, 0,
     ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"x last offset 2^62 + 5 (bytes wrap to 20)", 2, 1, 1, P2(62) + 5, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"w_stride_hidden * (hidden - 1) overflows", 1, 4, 1, 4, INT64_MAX / 2, 1, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"weight last offset: sum of the two overflows", 1, 2, 2, 2, 6 * P2(60), 3 * P2(60), 0, 0, 0,
     ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"w_stride_vocab = 2^62 (bytes wrap to 0)", 1, 1, 2, 1, 2, P2(62), 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"w_stride_vocab = INT64_MIN", 1, 2, 2, 2, 2, INT64_MIN, 0, 0, 0, ST(FH_ERR_INVALID_STRIDE), 0},
    {"dx_row_stride * (n - 1) overflows", 4, 1, 1, 1, 0, 0, INT64_MAX / 2, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 1},
    {"dx last offset 2^61 (bytes overflow ptrdiff_t)", 2, 1, 1, 1, 0, 0, P2(61), 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 1},
    {"dx_row_stride = 2^62 + 1 (bytes wrap to 4)", 2, 1, 1, 1, 0, 0, P2(62) + 1, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 1},
    {"dx_row_stride = INT64_MIN", 2, 1, 1, 1, 0, 0, INT64_MIN, 0, 0, ST(FH_ERR_INVALID_STRIDE), 1},
    /* GRPO, preference and KTO only: batch * seq (pairs * seq). An overflowing product cannot equal n; the library reports the mismatch. */
    /* Per-token arrays (targets, ids, outputs, the workspace's doubles) of n x 8 bytes: every pairwise product and
     * x's view fit, their bytes do not (issue 41). */
    {"n = 2^60: n x 8 bytes overflow ptrdiff_t", P2(60), 1, 1, 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"n = 2^61: n x 8 bytes overflow 64 bits", P2(61), 1, 1, 0, 0, 0, 0, 0, 0, ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"batch * seq overflows", 4, 1, 1, 0, 0, 0, 0, P2(32), P2(32) + 1, ST(FH_ERR_INVALID_SIZE) | ST(FH_ERR_SIZE_OVERFLOW), 0},
    {"batch = -1, seq = -4 (product = n)", 4, 1, 1, 0, 0, 0, 0, -1, -4, ST(FH_ERR_INVALID_SIZE), 0},
    {"batch = INT64_MIN, seq = -1", 4, 1, 1, 0, 0, 0, 0, INT64_MIN, -1, ST(FH_ERR_INVALID_SIZE), 0},
};

typedef struct child_args {
    const shape_case *c;
    hu_call call;
    int query; /* 0: the call; 1: its workspace query */
} child_args;

static void linear_of(const shape_case *c, fh_linear *lin)
{
    fh_linear_init(lin, c->n, c->hidden, c->vocab, tiny_x, tiny_w, FH_LAYOUT_HV, tiny_b);
    if (c->x_row_stride)
        lin->x_row_stride = c->x_row_stride;
    if (c->w_stride_hidden)
        lin->w_stride_hidden = c->w_stride_hidden;
    if (c->w_stride_vocab)
        lin->w_stride_vocab = c->w_stride_vocab;
}

/* Exit code: see CODE_STATUS. */
static int child(void *arg)
{
    const child_args *a = arg;
    const shape_case *c = a->c;
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK || fh_context_set(ctx, FH_PARAM_THREADS, 1) != FH_OK)
        return 1;
    fh_linear lin;
    linear_of(c, &lin);
    hu_outputs o;
    hu_outputs_alloc(&o, 4, 4, 4, 1);
    hu_outputs_fill(&o, TU_CANARY);
    fh_linear_grads g = {.dx = o.dx, .dx_row_stride = c->dx_row_stride ? c->dx_row_stride : c->hidden, .dx_beta = 0.0f, .dweight = o.dweight, .dweight_beta = 0.0f, .dbias = o.dbias, .dbias_beta = 0.0f};
    fh_ce_options ce;
    fh_ce_options_init(&ce);
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    fh_logprob_outputs lp_out = {o.logp, o.entropy, o.lse};
    fh_grpo_options go;
    fh_grpo_options_init(&go);
    const fh_grpo_batch batch = {c->batch ? c->batch : 1, c->batch ? c->seq : c->n, tiny_targets, tiny_mask,
                                 tiny_adv, tiny_logps, tiny_logps, tiny_logps, NULL, NULL};
    fh_ce_outputs ce_out = {&o.loss, &o.z_loss, o.per_token_loss, o.logp, o.lse, o.argmax, NULL, NULL};
    fh_grpo_outputs grpo_out = {&o.loss, &o.metrics, o.logp, o.per_token_loss, o.entropy, o.lse};
    /* A preference batch: the same sequences as one pair when no batch is given. */
    const fh_preference_batch pairs = {c->batch ? c->batch : 1, c->batch ? c->seq : c->n / 2, tiny_targets, tiny_mask,
                                       NULL, NULL, NULL};
    fh_preference_options po;
    fh_preference_options_init(&po);
    fh_preference_outputs pref_out = {&o.loss, &o.preference_metrics, o.sequence_logps, o.rewards, o.logp};
    /* A KTO batch: GRPO's sequences, undesirable, the reference per sequence and the KL value 0. */
    const fh_kto_batch kto_batch = {c->batch ? c->batch : 1, c->batch ? c->seq : c->n, tiny_targets, tiny_mask,
                                    tiny_labels, tiny_logps, NULL, tiny_logps, NULL, NULL};
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    fh_kto_outputs kto_out = {&o.loss, &o.kto_metrics, o.sequence_logps, o.rewards, o.logp};
    /* Distillation: the teacher is the student's view (the student is checked first). */
    fh_distill_options dopt;
    fh_distill_options_init(&dopt);
    fh_distill_outputs distill_out = {&o.loss, &o.soft_loss, &o.hard_loss, o.per_token_loss};
    /* Top-k distillation: one entry per token, in the tiny buffers (the student is checked first). */
    const fh_topk_teacher topk = {1, tiny_targets, tiny_logps};
    /* Log-probs over a support: one padded entry per token, the tiny targets (the linear is checked first). */
    const fh_support support = {tiny_targets, NULL, 1};
    fh_distill_topk_options topt;
    fh_distill_topk_options_init(&topt);
    size_t bytes = 0xA5A5A5A5u;
    fh_status st = FH_ERR_NULL_POINTER; /* set by the switch below, which has every head call */
    if (a->query) {
        st = hu_call_is_distill(a->call)      ? fh_distill_workspace_size(ctx, &lin, &lin, &dopt, &bytes)
             : hu_call_is_distill_topk(a->call) ? fh_distill_topk_workspace_size(ctx, &lin, &bytes)
             : hu_call_is_support(a->call)    ? fh_logprob_support_workspace_size(ctx, &lin, &support, &bytes)
             : hu_call_is_preference(a->call) ? fh_preference_workspace_size(ctx, &lin, &bytes)
             : hu_call_is_kto(a->call)        ? fh_kto_workspace_size(ctx, &lin, &bytes)
             : hu_call_on_sequences(a->call) ? fh_grpo_workspace_size(ctx, &lin, &bytes)
             : a->call >= HU_fh_logprob_forward ? fh_logprob_workspace_size(ctx, &lin, &bytes)
             : a->call == HU_fh_ce_forward_backward ? fh_ce_forward_backward_workspace_size(ctx, &lin, &ce, &bytes)
                                           : fh_ce_workspace_size(ctx, &lin, &ce, &bytes);
        return CODE_STATUS + (int)st + (st != FH_OK && bytes != 0xA5A5A5A5u ? CODE_WRITTEN : 0);
    }
#pragma GCC diagnostic error "-Wswitch" /* every head call tried: a listed one without a case does not compile */
    switch (a->call) {
    case HU_fh_ce_forward: st = fh_ce_forward(ctx, &lin, tiny_targets, &ce, &ce_out); break;
    case HU_fh_ce_backward: st = fh_ce_backward(ctx, &lin, tiny_targets, &ce, tiny_lse, tiny_grad, &g); break;
    case HU_fh_ce_forward_backward: st = fh_ce_forward_backward(ctx, &lin, tiny_targets, &ce, tiny_grad, &ce_out, &g); break;
    case HU_fh_logprob_forward: st = fh_logprob_forward(ctx, &lin, tiny_targets, &lo, &lp_out); break;
    case HU_fh_logprob_backward:
        st = fh_logprob_backward(ctx, &lin, tiny_targets, &lo, tiny_lse, NULL, tiny_grad, NULL, tiny_grad, &g);
        break;
    case HU_fh_logprob_forward_keep: st = fh_logprob_forward_keep(ctx, &lin, tiny_targets, &lo, &lp_out, o.logits); break;
    case HU_fh_logprob_backward_kept:
        st = fh_logprob_backward_kept(ctx, &lin, tiny_targets, &lo, tiny_logits, tiny_lse, NULL, tiny_grad, NULL,
                                      tiny_grad, &g);
        break;
    case HU_fh_logprob_forward_backward:
        st = fh_logprob_forward_backward(ctx, &lin, tiny_targets, &lo, tiny_grad, tiny_grad, NULL, &lp_out, &g);
        break;
    case HU_fh_logprob_support_forward:
        st = fh_logprob_support_forward(ctx, &lin, tiny_targets, &support, &lo, &lp_out);
        break;
    case HU_fh_logprob_support_backward:
        st = fh_logprob_support_backward(ctx, &lin, tiny_targets, &support, &lo, tiny_lse, NULL, tiny_grad, NULL,
                                         tiny_grad, &g);
        break;
    case HU_fh_logprob_support_forward_backward:
        st = fh_logprob_support_forward_backward(ctx, &lin, tiny_targets, &support, &lo, tiny_grad, NULL, NULL,
                                                 &lp_out, &g);
        break;
    case HU_fh_grpo_forward: st = fh_grpo_forward(ctx, &lin, &batch, &go, &grpo_out); break;
    case HU_fh_grpo_backward:
        st = fh_grpo_backward(ctx, &lin, &batch, &go, tiny_logps, tiny_lse, tiny_logps, tiny_grad, &g);
        break;
    case HU_fh_grpo_forward_backward: st = fh_grpo_forward_backward(ctx, &lin, &batch, &go, tiny_grad, &grpo_out, &g); break;
    case HU_fh_preference_forward: st = fh_preference_forward(ctx, &lin, &pairs, &po, &pref_out); break;
    case HU_fh_preference_forward_backward:
        st = fh_preference_forward_backward(ctx, &lin, &pairs, &po, tiny_grad, &pref_out, &g);
        break;
    case HU_fh_kto_forward: st = fh_kto_forward(ctx, &lin, &kto_batch, &ko, &kto_out); break;
    case HU_fh_kto_forward_backward: st = fh_kto_forward_backward(ctx, &lin, &kto_batch, &ko, tiny_grad, &kto_out, &g); break;
    case HU_fh_distill_forward: st = fh_distill_forward(ctx, &lin, &lin, tiny_targets, &dopt, &distill_out); break;
    case HU_fh_distill_forward_backward:
        st = fh_distill_forward_backward(ctx, &lin, &lin, tiny_targets, &dopt, tiny_grad, &distill_out, &g);
        break;
    case HU_fh_distill_topk_forward:
        st = fh_distill_topk_forward(ctx, &lin, &topk, tiny_targets, &topt, &distill_out);
        break;
    case HU_fh_distill_topk_forward_backward:
        st = fh_distill_topk_forward_backward(ctx, &lin, &topk, tiny_targets, &topt, tiny_grad, &distill_out, &g);
        break;
    }
    const int untouched = hu_outputs_untouched(&o, TU_CANARY);
    return CODE_STATUS + (int)st + (untouched ? 0 : CODE_WRITTEN);
}

static void describe(int code, char *buf, size_t size)
{
    const int status = (code - CODE_STATUS) % CODE_WRITTEN;
    if (code >= 1000)
        snprintf(buf, size, "killed by signal %d", code - 1000);
    else if (code < CODE_STATUS)
        snprintf(buf, size, "exit code %d (a sanitizer report?)", code);
    else
        snprintf(buf, size, "status %d (%s)%s", status, fh_status_string((fh_status)status),
                 (code - CODE_STATUS) & CODE_WRITTEN ? " and an output was written" : "");
}

static void test_overflowing_shapes(void)
{
    for (int k = 0; k < 16; k++)
        tiny_mask[k] = 1.0f;
    for (size_t k = 0; k < TU_COUNT(cases); k++) {
        const shape_case *c = &cases[k];
        const int grpo_only = c->batch != 0;
        for (int call = 0; call < HU_CALL_COUNT; call++) {
            /* A batch of sequences: GRPO, preference and KTO calls (neither distillation nor the support calls take
             * one). */
            const int batched = hu_call_on_sequences((hu_call)call) && !hu_call_is_distill((hu_call)call) &&
                                !hu_call_is_distill_topk((hu_call)call) && !hu_call_is_support((hu_call)call);
            if (grpo_only && !batched)
                continue;
            const int has_grads = hu_call_has_grads((hu_call)call);
            if (c->grads_only && !has_grads)
                continue;
            for (int query = 0; query <= 1; query++) {
                /* Workspace queries take no batch and no gradients; one query per kind of call. */
                if (query && (grpo_only || c->grads_only || call == HU_fh_ce_backward || call == HU_fh_logprob_backward ||
                              call == HU_fh_logprob_forward_keep || call == HU_fh_logprob_backward_kept ||
                              call == HU_fh_logprob_forward_backward || call == HU_fh_logprob_support_backward ||
                              call == HU_fh_logprob_support_forward_backward || call == HU_fh_grpo_backward ||
                              call == HU_fh_grpo_forward_backward || call == HU_fh_preference_forward_backward ||
                              call == HU_fh_kto_forward_backward || call == HU_fh_distill_forward_backward ||
                              call == HU_fh_distill_topk_forward_backward))
                    continue;
                child_args a = {c, (hu_call)call, query};
                const int code = hu_run_isolated(child, &a);
                const int ok = code >= CODE_STATUS && code < CODE_STATUS + CODE_WRITTEN &&
                               (c->expected & ST(code - CODE_STATUS));
                char got[96];
                describe(code, got, sizeof got);
                TU_CHECK(ok, "%s, %s%s: %s", c->name, hu_call_name((hu_call)call), query ? " workspace query" : "",
                         got);
            }
        }
    }
}

/* Workspace queries are pure: any shape that passes validation, however large, can be asked about. They
 * must answer SIZE_OVERFLOW when a product overflows, else OK with bytes within the memory budget (the
 * budget caps the workspace) or BUDGET_TOO_SMALL. One child runs the whole sweep. */
static int product_overflows(int64_t a, int64_t b)
{
    int64_t r;
    return __builtin_mul_overflow(a, b, &r);
}

static int query_sweep(void *unused)
{
    (void)unused;
    static const int64_t sizes[] = {1, 2, 1000, P2(20), P2(31), P2(32), P2(40), P2(56), P2(58), P2(60), P2(62),
                                    INT64_MAX};
    static const int64_t budgets[] = {0, 1, 4096, P2(20), P2(28), P2(50)};
    static const int64_t tiles[][2] = {{0, 0}, {1, 1}, {P2(24), P2(30)}};
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return 2;
    fh_ce_options ce;
    fh_ce_options_init(&ce);
    int bad = 0;
    for (size_t a = 0; a < TU_COUNT(sizes); a++)
        for (size_t b = 0; b < TU_COUNT(sizes); b++)
            for (size_t c = 0; c < TU_COUNT(sizes); c++)
                for (size_t d = 0; d < TU_COUNT(budgets); d++)
                    for (size_t t = 0; t < TU_COUNT(tiles); t++) {
                        const int64_t n = sizes[a], h = sizes[b], v = sizes[c];
                        fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, budgets[d]);
                        fh_context_set(ctx, FH_PARAM_TILE_ROWS, tiles[t][0]);
                        fh_context_set(ctx, FH_PARAM_TILE_VOCAB, tiles[t][1]);
                        const int64_t budget = budgets[d] ? budgets[d] : FH_DEFAULT_MEMORY_BUDGET;
                        const int overflow = product_overflows(n, v) || product_overflows(h, v) ||
                                             product_overflows(n, h);
                        for (int layout = 0; layout < 2; layout++) {
                            fh_linear lin;
                            fh_linear_init(&lin, n, h, v, tiny_x, tiny_w, (fh_layout)layout, NULL);
                            for (int kind = 0; kind < 4; kind++) {
                                size_t bytes = 0;
                                /* kind 3: distillation, the teacher of the student's shape in the other layout,
                                 * over top-1024 supports in the [H, V] layout (n rows of 2 x 1024 selections) */
                                fh_linear teacher;
                                fh_linear_init(&teacher, n, h, v, tiny_x, tiny_w, (fh_layout)!layout, NULL);
                                fh_distill_options dopt;
                                fh_distill_options_init(&dopt);
                                dopt.top_k = layout == FH_LAYOUT_HV ? FH_DISTILL_TOPK_MAX_K : 0;
                                const fh_status st =
                                    kind == 0   ? fh_ce_workspace_size(ctx, &lin, &ce, &bytes)
                                    : kind == 1 ? fh_ce_forward_backward_workspace_size(ctx, &lin, &ce, &bytes)
                                    : kind == 2 ? fh_grpo_workspace_size(ctx, &lin, &bytes)
                                                : fh_distill_workspace_size(ctx, &lin, &teacher, &dopt, &bytes);
                                const int ok = overflow ? st == FH_ERR_SIZE_OVERFLOW
                                                        : (st == FH_OK && bytes <= (size_t)budget) ||
                                                              st == FH_ERR_BUDGET_TOO_SMALL ||
                                                              st == FH_ERR_SIZE_OVERFLOW;
                                if (!ok && bad++ < 10)
                                    fprintf(stderr,
                                            "query %d: n=%lld h=%lld v=%lld layout %d budget %lld tiles %lld x %lld: "
                                            "status %d, bytes %zu\n",
                                            kind, (long long)n, (long long)h, (long long)v, layout,
                                            (long long)budgets[d], (long long)tiles[t][0], (long long)tiles[t][1],
                                            (int)st, bytes);
                            }
                        }
                    }
    fh_context_destroy(ctx);
    return bad ? 1 : 0;
}

static void test_workspace_queries_on_huge_shapes(void)
{
    const int code = hu_run_isolated(query_sweep, NULL);
    TU_CHECK(code == 0, "workspace-query sweep: %s (details on stderr)",
             code >= 1000 ? "crashed" : code == 1 ? "wrong answers" : "failed to run");
}

/* ---- Distillation: the teacher's shape, and refused options ---- */

/* The student: n = 2, hidden = 2, vocab = 3, contiguous [H, V], on the tiny buffers. The teacher: hidden 3 unless
 * the case says otherwise, the same n and vocab, on the tiny buffers. */
typedef struct teacher_case {
    const char *name;
    int64_t n, hidden, vocab;                              /* 0: the default (2, 3, 3) */
    int64_t x_row_stride, w_stride_hidden, w_stride_vocab; /* 0: contiguous HV */
    int dtype_x, dtype_w;                                  /* fh_dtype of x and weight */
    int null_what;                                         /* 1: teacher NULL, 2: its x, 3: its weight */
    fh_status expected;
    fh_status expected_query; /* the workspace query's answer */
} teacher_case;

#define TEACHER(name, n, h, v, xs, whs, wvs, st) {name, n, h, v, xs, whs, wvs, 0, 0, 0, st, st}

static const teacher_case teacher_cases[] = {
    TEACHER("a valid teacher (control)", 0, 0, 0, 0, 0, 0, FH_OK),
    {"teacher NULL", 0, 0, 0, 0, 0, 0, 0, 0, 1, FH_ERR_NULL_POINTER, FH_ERR_NULL_POINTER},
    {"teacher x NULL", 0, 0, 0, 0, 0, 0, 0, 0, 2, FH_ERR_NULL_POINTER, FH_ERR_NULL_POINTER},
    {"teacher weight NULL", 0, 0, 0, 0, 0, 0, 0, 0, 3, FH_ERR_NULL_POINTER, FH_ERR_NULL_POINTER},
    TEACHER("teacher n = 0", -7, 0, 0, 0, 0, 0, FH_ERR_INVALID_SIZE), /* -7: see teacher_linear */
    TEACHER("teacher n = -1", -1, 0, 0, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher n = INT64_MIN", INT64_MIN, 0, 0, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher hidden = 0", 0, -7, 0, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher hidden = -5", 0, -5, 0, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher hidden = INT64_MIN", 0, INT64_MIN, 0, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher vocab = 0", 0, 0, -7, 0, 0, 0, FH_ERR_INVALID_SIZE),
    TEACHER("teacher vocab = -2^40", 0, 0, -P2(40), 0, 1, 1, FH_ERR_INVALID_SIZE),
    TEACHER("teacher n * vocab overflows", P2(32), 1, P2(32), 1, 0, 0, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher hidden * vocab overflows", 0, P2(62), 0, 0, 0, 0, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher n * hidden overflows", 0, INT64_MAX, 0, 0, 0, 0, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher x_row_stride * (n - 1) overflows", 4, 0, 0, INT64_MAX / 2, 0, 0, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher x last offset 2^61 (bytes overflow ptrdiff_t)", 0, 1, 0, P2(61), 0, 0, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher x_row_stride = INT64_MIN", 0, 0, 0, INT64_MIN, 0, 0, FH_ERR_INVALID_STRIDE),
    TEACHER("teacher x rows overlap (stride 1, hidden 3)", 0, 0, 0, 1, 0, 0, FH_ERR_INVALID_STRIDE),
    TEACHER("teacher w_stride_hidden * (hidden - 1) overflows", 0, 0, 0, 0, INT64_MAX / 2, 1, FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher w_stride_vocab = 2^61 (last offset 2^62 + 2: bytes wrap)", 0, 0, 0, 0, 1, P2(61),
            FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher w_stride_vocab = 2^62 (last offset overflows)", 0, 0, 0, 0, 1, P2(62), FH_ERR_SIZE_OVERFLOW),
    TEACHER("teacher w_stride_vocab = INT64_MIN", 0, 0, 0, 0, 3, INT64_MIN, FH_ERR_INVALID_STRIDE),
    {"teacher x bf16, weight fp32", 0, 0, 0, 0, 0, 0, FH_DTYPE_BF16, FH_DTYPE_F32, 0, FH_ERR_INVALID_DTYPE,
     FH_ERR_INVALID_DTYPE},
    {"teacher dtype 7", 0, 0, 0, 0, 0, 0, 7, 7, 0, FH_ERR_INVALID_DTYPE, FH_ERR_INVALID_DTYPE},
    {"teacher n = 3 (student 2)", 3, 0, 0, 0, 0, 0, 0, 0, 0, FH_ERR_TEACHER_MISMATCH, FH_ERR_TEACHER_MISMATCH},
    {"teacher n = 1 (student 2)", 1, 0, 0, 0, 0, 0, 0, 0, 0, FH_ERR_TEACHER_MISMATCH, FH_ERR_TEACHER_MISMATCH},
    {"teacher vocab = 4 (student 3)", 0, 0, 4, 0, 0, 0, 0, 0, 0, FH_ERR_TEACHER_MISMATCH, FH_ERR_TEACHER_MISMATCH},
    {"teacher vocab = 2 (student 3)", 0, 0, 2, 0, 0, 0, 0, 0, 0, FH_ERR_TEACHER_MISMATCH, FH_ERR_TEACHER_MISMATCH},
};

/* -7 stands for 0 in the case table (0 there means "the default"). */
static int64_t case_size(int64_t value, int64_t fallback)
{
    return value == -7 ? 0 : value ? value : fallback;
}

static void teacher_linear(const teacher_case *c, fh_linear *t)
{
    const int64_t n = case_size(c->n, 2), h = case_size(c->hidden, 3), v = case_size(c->vocab, 3);
    fh_linear_init(t, n, h, v, tiny_x + 8, tiny_w + 8, FH_LAYOUT_HV, tiny_b + 8);
    if (c->x_row_stride)
        t->x_row_stride = c->x_row_stride;
    if (c->w_stride_hidden)
        t->w_stride_hidden = c->w_stride_hidden;
    if (c->w_stride_vocab)
        t->w_stride_vocab = c->w_stride_vocab;
    t->x_dtype = (fh_dtype)c->dtype_x;
    t->weight_dtype = (fh_dtype)c->dtype_w;
    if (c->null_what == 2)
        t->x = NULL;
    if (c->null_what == 3)
        t->weight = NULL;
}

typedef struct teacher_args {
    const teacher_case *c;
    int which; /* 0: fh_distill_forward, 1: fh_distill_forward_backward, 2: fh_distill_workspace_size */
} teacher_args;

/* Exit code: see CODE_STATUS. */
static int teacher_child(void *arg)
{
    const teacher_args *a = arg;
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK || fh_context_set(ctx, FH_PARAM_THREADS, 1) != FH_OK)
        return 1;
    fh_linear student, teacher;
    fh_linear_init(&student, 2, 2, 3, tiny_x, tiny_w, FH_LAYOUT_HV, tiny_b);
    teacher_linear(a->c, &teacher);
    const fh_linear *t = a->c->null_what == 1 ? NULL : &teacher;
    int code;
    if (a->which == 2) {
        size_t bytes = 0xA5A5A5A5u;
        fh_distill_options dopt;
        fh_distill_options_init(&dopt);
        const fh_status st = fh_distill_workspace_size(ctx, &student, t, &dopt, &bytes);
        code = CODE_STATUS + (int)st + (st != FH_OK && bytes != 0xA5A5A5A5u ? CODE_WRITTEN : 0);
    } else {
        hu_outputs o;
        hu_outputs_alloc(&o, 2, 2, 3, 1);
        hu_outputs_fill(&o, TU_CANARY);
        fh_linear_grads g = {.dx = o.dx, .dx_row_stride = 2, .dweight = o.dweight, .dbias = o.dbias};
        fh_distill_options opt;
        fh_distill_options_init(&opt);
        opt.weight_hard_loss = 0.5;
        fh_distill_outputs out = {&o.loss, &o.soft_loss, &o.hard_loss, o.per_token_loss};
        const fh_status st = a->which == 0
                                 ? fh_distill_forward(ctx, &student, t, tiny_targets, &opt, &out)
                                 : fh_distill_forward_backward(ctx, &student, t, tiny_targets, &opt, tiny_grad, &out, &g);
        const char *message = "";
        fh_context_message(ctx, &message);
        code = CODE_STATUS + (int)st;
        if (st != FH_OK && !hu_outputs_untouched(&o, TU_CANARY))
            code += CODE_WRITTEN;
        if (st != FH_OK && !tu_mentions(message, "teacher"))
            code += CODE_UNNAMED;
        hu_outputs_free(&o);
    }
    fh_context_destroy(ctx);
    return code;
}

static void test_distill_teacher_shapes(void)
{
    for (int k = 0; k < 16; k++)
        tiny_x[k] = tiny_w[k] = 0.25f * (float)(k % 5);
    for (size_t k = 0; k < TU_COUNT(teacher_cases); k++)
        for (int which = 0; which < 3; which++) {
            const teacher_case *c = &teacher_cases[k];
            teacher_args a = {c, which};
            const int code = hu_run_isolated(teacher_child, &a);
            const fh_status expected = which == 2 ? c->expected_query : c->expected;
            static const char *names[] = {"fh_distill_forward", "fh_distill_forward_backward",
                                          "fh_distill_workspace_size"};
            if (code < CODE_STATUS || code >= 1000) {
                char got[96];
                describe(code, got, sizeof got);
                TU_CHECK(0, "%s, %s: %s", c->name, names[which], got);
                continue;
            }
            const int unnamed = (code - CODE_STATUS) & CODE_UNNAMED, written = (code - CODE_STATUS) & CODE_WRITTEN;
            const int status = (code - CODE_STATUS) % CODE_WRITTEN;
            TU_CHECK(status == (int)expected, "%s, %s: status %d (%s), expected %d (%s)", c->name, names[which],
                     status, fh_status_string((fh_status)status), (int)expected, fh_status_string(expected));
            TU_CHECK(!written, "%s, %s: the call failed with status %d and wrote an output", c->name, names[which],
                     status);
            TU_CHECK(!unnamed, "%s, %s: status %d, and the message does not name the teacher", c->name,
                     names[which], status);
        }
}

/* Refused options and inputs, on a valid problem (so that a missing check would run the call and write its
 * outputs): each gives its status, a message naming what is wrong, and leaves every output untouched. */
enum { R_TEACHER_NULL, R_OPTIONS_NULL, R_OUTPUTS_NULL, R_CONTEXT_NULL, R_TEMPERATURE, R_BETA, R_WEIGHT_SOFT,
       R_WEIGHT_HARD, R_DIVERGENCE, R_REDUCTION, R_TARGETS_NULL, R_TARGET, R_NONE_WITHOUT_PTL, R_GRAD_OUTPUT,
       R_GRAD_OUTPUT_NULL, R_GRAD_BETA, R_GRAD_DTYPE, R_DBIAS_WITHOUT_BIAS };

typedef struct refused_case {
    const char *name;
    int what;
    double value;
    fh_status expected;
    const char *word;   /* the message must mention it ("" : any nonempty message) */
    int grads_only;     /* only fh_distill_forward_backward reads it */
} refused_case;

static const refused_case refused_cases[] = {
    {"teacher NULL", R_TEACHER_NULL, 0, FH_ERR_NULL_POINTER, "teacher", 0},
    {"options NULL", R_OPTIONS_NULL, 0, FH_ERR_NULL_POINTER, "options", 0},
    {"outputs NULL", R_OUTPUTS_NULL, 0, FH_ERR_NULL_POINTER, "outputs", 0},
    {"context NULL", R_CONTEXT_NULL, 0, FH_ERR_NULL_POINTER, "", 0},
    {"temperature 0", R_TEMPERATURE, 0.0, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature -0", R_TEMPERATURE, -0.0, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature -1", R_TEMPERATURE, -1.0, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature NaN", R_TEMPERATURE, NAN, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature +Inf (1/T = 0)", R_TEMPERATURE, INFINITY, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature -Inf", R_TEMPERATURE, -INFINITY, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature 1e50 (1/T underflows fp32)", R_TEMPERATURE, 1e50, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature 1e46 (1/T rounds to 0 in fp32)", R_TEMPERATURE, 1e46, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature DBL_MAX", R_TEMPERATURE, DBL_MAX, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature 1e-39 (1/T overflows fp32)", R_TEMPERATURE, 1e-39, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"temperature 5e-324", R_TEMPERATURE, 5e-324, FH_ERR_INVALID_TEMPERATURE, "temperature", 0},
    {"beta -0.1", R_BETA, -0.1, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"beta -1e-300", R_BETA, -1e-300, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"beta 1 + 2^-52", R_BETA, 1.0 + 0x1p-52, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"beta 2", R_BETA, 2.0, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"beta NaN", R_BETA, NAN, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"beta +Inf", R_BETA, INFINITY, FH_ERR_INVALID_DISTILL_OPTION, "beta", 0},
    {"weight_soft_loss -1", R_WEIGHT_SOFT, -1.0, FH_ERR_INVALID_DISTILL_OPTION, "weight_soft_loss", 0},
    {"weight_soft_loss NaN", R_WEIGHT_SOFT, NAN, FH_ERR_INVALID_DISTILL_OPTION, "weight_soft_loss", 0},
    {"weight_soft_loss +Inf", R_WEIGHT_SOFT, INFINITY, FH_ERR_INVALID_DISTILL_OPTION, "weight_soft_loss", 0},
    {"weight_soft_loss -Inf", R_WEIGHT_SOFT, -INFINITY, FH_ERR_INVALID_DISTILL_OPTION, "weight_soft_loss", 0},
    {"weight_hard_loss -1e-300", R_WEIGHT_HARD, -1e-300, FH_ERR_INVALID_DISTILL_OPTION, "weight_hard_loss", 0},
    {"weight_hard_loss NaN", R_WEIGHT_HARD, NAN, FH_ERR_INVALID_DISTILL_OPTION, "weight_hard_loss", 0},
    {"weight_hard_loss +Inf", R_WEIGHT_HARD, INFINITY, FH_ERR_INVALID_DISTILL_OPTION, "weight_hard_loss", 0},
    {"divergence 3", R_DIVERGENCE, 3, FH_ERR_INVALID_DISTILL_OPTION, "divergence", 0},
    {"divergence -1", R_DIVERGENCE, -1, FH_ERR_INVALID_DISTILL_OPTION, "divergence", 0},
    {"divergence INT_MIN", R_DIVERGENCE, INT_MIN, FH_ERR_INVALID_DISTILL_OPTION, "divergence", 0},
    {"reduction 3", R_REDUCTION, 3, FH_ERR_INVALID_REDUCTION, "reduction", 0},
    {"reduction -1", R_REDUCTION, -1, FH_ERR_INVALID_REDUCTION, "reduction", 0},
    {"targets NULL with weight_hard_loss 0.4", R_TARGETS_NULL, 0, FH_ERR_NULL_POINTER, "targets", 0},
    {"target = V", R_TARGET, 0, FH_ERR_TARGET_OUT_OF_RANGE, "targets", 0},
    {"target = -1", R_TARGET, -1, FH_ERR_TARGET_OUT_OF_RANGE, "targets", 0},
    {"target = INT64_MIN", R_TARGET, -2, FH_ERR_TARGET_OUT_OF_RANGE, "targets", 0},
    {"target = -100 with ignore_index -1", R_TARGET, -3, FH_ERR_TARGET_OUT_OF_RANGE, "targets", 0},
    {"reduction 'none' without per_token_loss", R_NONE_WITHOUT_PTL, 0, FH_ERR_MISSING_OUTPUT, "per_token_loss", 0},
    {"grad_output NaN (mean)", R_GRAD_OUTPUT, NAN, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output", 1},
    {"grad_output +Inf (mean)", R_GRAD_OUTPUT, INFINITY, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output", 1},
    {"grad_output[last] -Inf (none)", R_GRAD_OUTPUT, -INFINITY, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output", 1},
    {"grad_output NULL", R_GRAD_OUTPUT_NULL, 0, FH_ERR_NULL_POINTER, "grad_output", 1},
    {"dx_beta 0.5", R_GRAD_BETA, 0.5, FH_ERR_INVALID_BETA, "dx_beta", 1},
    {"bf16 dweight of an fp32 student", R_GRAD_DTYPE, 0, FH_ERR_INVALID_DTYPE, "dweight", 1},
    {"dbias of a student without a bias", R_DBIAS_WITHOUT_BIAS, 0, FH_ERR_NULL_POINTER, "dbias", 1},
};

static void test_distill_refused_inputs(void)
{
    enum { B = 2, T = 5, H = 6, V = 40 };
    hu_grpo_problem g;
    hu_grpo_problem_init(&g, B, T, H, V, FH_LAYOUT_HV, 1, 77);
    const int64_t n = B * T;
    for (size_t k = 0; k < TU_COUNT(refused_cases); k++)
        for (int call = HU_fh_distill_forward; call <= HU_fh_distill_forward_backward; call++) {
            const refused_case *c = &refused_cases[k];
            if (c->grads_only && call == HU_fh_distill_forward)
                continue;
            fh_linear student, teacher;
            hu_distill_linears(&g, &student, &teacher);
            fh_distill_options o = g.distill;
            int64_t *targets = malloc(sizeof(int64_t) * (size_t)n);
            memcpy(targets, g.ids, sizeof(int64_t) * (size_t)n);
            float *grad = malloc(sizeof(float) * (size_t)n);
            memcpy(grad, g.distill_grad, sizeof(float) * (size_t)n);
            hu_outputs out;
            hu_outputs_alloc(&out, n, H, V, 1);
            hu_outputs_fill(&out, TU_CANARY);
            fh_distill_outputs dout = {&out.loss, &out.soft_loss, &out.hard_loss, out.per_token_loss};
            fh_linear_grads gr = {.dx = out.dx, .dx_row_stride = H, .dweight = out.dweight, .dbias = out.dbias};
            fh_context *ctx = tu_context(1, 0, 0, 0);
            fh_context *call_ctx = ctx;
            const fh_linear *t = &teacher;
            const fh_distill_options *op = &o;
            fh_distill_outputs *dp = &dout;
            const int64_t *tp = targets;
            const float *gp = grad;
            switch (c->what) {
            case R_TEACHER_NULL: t = NULL; break;
            case R_OPTIONS_NULL: op = NULL; break;
            case R_OUTPUTS_NULL: dp = NULL; break;
            case R_CONTEXT_NULL: call_ctx = NULL; break;
            case R_TEMPERATURE: o.temperature = c->value; break;
            case R_BETA: o.beta = c->value; break;
            case R_WEIGHT_SOFT: o.weight_soft_loss = c->value; break;
            case R_WEIGHT_HARD: o.weight_hard_loss = c->value; break;
            case R_DIVERGENCE: o.divergence = (fh_divergence)(int)c->value; break;
            case R_REDUCTION: o.reduction = (fh_reduction)(int)c->value; break;
            case R_TARGETS_NULL: tp = NULL; break;
            case R_TARGET:
                targets[n - 1] = c->value == 0 ? V : c->value == -1 ? -1 : c->value == -2 ? INT64_MIN : -100;
                if (c->value == -3) {
                    o.ignore_index = -1;
                    for (int64_t i = 0; i < n - 1; i++)
                        targets[i] = targets[i] < 0 ? 0 : targets[i];
                }
                break;
            case R_NONE_WITHOUT_PTL:
                o.reduction = FH_REDUCTION_NONE;
                dout.per_token_loss = NULL;
                break;
            case R_GRAD_OUTPUT:
                if (isinf(c->value) && c->value < 0) {
                    o.reduction = FH_REDUCTION_NONE;
                    grad[n - 1] = (float)c->value;
                } else {
                    grad[0] = (float)c->value;
                }
                break;
            case R_GRAD_OUTPUT_NULL: gp = NULL; break;
            case R_GRAD_BETA: gr.dx_beta = (float)c->value; break;
            case R_GRAD_DTYPE: gr.dweight_dtype = FH_DTYPE_BF16; break;
            default: student.bias = NULL; break; /* R_DBIAS_WITHOUT_BIAS */
            }
            const fh_status st = call == HU_fh_distill_forward
                                     ? fh_distill_forward(call_ctx, &student, t, tp, op, dp)
                                     : fh_distill_forward_backward(call_ctx, &student, t, tp, op, gp, dp, &gr);
            const char *message = "";
            fh_context_message(ctx, &message);
            const char *name = hu_call_name((hu_call)call);
            TU_CHECK(st == c->expected, "%s, %s: status %d (%s), expected %d (%s)", c->name, name, (int)st,
                     fh_status_string(st), (int)c->expected, fh_status_string(c->expected));
            if (c->what != R_CONTEXT_NULL)
                TU_CHECK(message[0] != '\0' && (!c->word[0] || tu_mentions(message, c->word)),
                         "%s, %s: message \"%s\" does not name %s", c->name, name, message, c->word);
            TU_CHECK(hu_outputs_untouched(&out, TU_CANARY), "%s, %s: a refused call wrote an output", c->name, name);
            /* The same context then runs the valid call. */
            TU_CHECK(hu_run(ctx, (hu_call)call, NULL, &g, NULL, &out) == FH_OK, "%s, %s: the valid call after it",
                     c->name, name);
            fh_context_destroy(ctx);
            hu_outputs_free(&out);
            free(targets);
            free(grad);
        }
    hu_grpo_problem_free(&g);
}

/* Limits that are accepted: beta 0 and 1, loss weights 0, temperatures whose inverse is a normal fp32 value,
 * every target ignored (loss 0), and targets NULL without the hard loss. The loss is finite, except that the
 * tiny temperatures are only checked to be accepted. */
static void test_distill_accepted_limits(void)
{
    enum { B = 2, T = 5, H = 6, V = 40 };
    hu_grpo_problem g;
    hu_grpo_problem_init(&g, B, T, H, V, FH_LAYOUT_VH, 0, 78);
    const int64_t n = B * T;
    for (int k = 0; k < 8; k++)
        for (int call = HU_fh_distill_forward; call <= HU_fh_distill_forward_backward; call++) {
            hu_grpo_problem p = g; /* shallow: options only */
            int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
            memcpy(ids, g.ids, sizeof(int64_t) * (size_t)n);
            p.ids = ids;
            static const char *names[] = {"beta 0",        "beta 1",           "both loss weights 0",
                                          "temperature 1e-30", "temperature 1e30", "temperature 3e-39",
                                          "every target ignored", "targets NULL, weight_hard_loss 0"};
            switch (k) {
            case 0: p.distill.beta = 0.0; break;
            case 1: p.distill.beta = 1.0; break;
            case 2: p.distill.weight_soft_loss = p.distill.weight_hard_loss = 0.0; break;
            case 3: p.distill.temperature = 1e-30; break;
            case 4: p.distill.temperature = 1e30; break;
            case 5: p.distill.temperature = 3e-39; break; /* 1/T = 3.3e38 < FLT_MAX */
            case 6:
                for (int64_t i = 0; i < n; i++)
                    ids[i] = -100;
                break;
            default:
                p.distill_no_targets = 1;
                p.distill.weight_hard_loss = 0.0;
                break;
            }
            hu_outputs o;
            hu_outputs_alloc(&o, n, H, V, 0);
            hu_outputs_fill(&o, TU_CANARY);
            fh_context *ctx = tu_context(1, 0, 0, 0);
            const fh_status st = hu_run(ctx, (hu_call)call, NULL, &p, NULL, &o);
            fh_context_destroy(ctx);
            TU_CHECK(st == FH_OK, "%s, %s: status %d", names[k], hu_call_name((hu_call)call), (int)st);
            /* The tiny temperatures are only accepted: what logits / T near fp32's range give is numerics
             * (README.md here, "Open"). */
            const int judged = k != 3 && k != 5;
            const int zero = k == 2 || k == 6;
            if (judged && zero)
                TU_CHECK(o.loss == 0.0 && (call == HU_fh_distill_forward || (tu_all_equal_f(o.dx, (size_t)(n * H), 0.0f) &&
                                                                             tu_all_equal_f(o.dweight, H * V, 0.0f))),
                         "%s, %s: loss %g, expected 0 and zero gradients", names[k], hu_call_name((hu_call)call), o.loss);
            if (judged && !zero)
                TU_CHECK(isfinite(o.loss) && tu_all_finite_f(o.per_token_loss, (size_t)n),
                         "%s, %s: loss %g is not finite", names[k], hu_call_name((hu_call)call), o.loss);
            hu_outputs_free(&o);
            free(ids);
        }
    hu_grpo_problem_free(&g);
}

/* Top-k distillation: the teacher's [n, k] ids and log-probs, whose bytes overflow while n's own products fit (n =
 * 2^54, k = 1024: n k = 2^64; n = 2^50: n k 8 = 2^63; issue 41: they were read past the tiny buffers), both calls. */
typedef struct topk_args {
    int64_t n, k;
    int train_step;
} topk_args;

static int topk_child(void *arg)
{
    const topk_args *a = arg;
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK || fh_context_set(ctx, FH_PARAM_THREADS, 1) != FH_OK)
        return 1;
    fh_linear lin;
    fh_linear_init(&lin, a->n, 1, 2, tiny_x, tiny_w, FH_LAYOUT_HV, NULL);
    hu_outputs o;
    hu_outputs_alloc(&o, 4, 4, 4, 1);
    hu_outputs_fill(&o, TU_CANARY);
    fh_linear_grads g = {.dx = o.dx, .dx_row_stride = 1, .dweight = o.dweight};
    const fh_topk_teacher teacher = {a->k, tiny_targets, tiny_logps};
    fh_distill_topk_options opt;
    fh_distill_topk_options_init(&opt);
    fh_distill_outputs out = {&o.loss, &o.soft_loss, &o.hard_loss, o.per_token_loss};
    const fh_status st = a->train_step
                             ? fh_distill_topk_forward_backward(ctx, &lin, &teacher, NULL, &opt, tiny_grad, &out, &g)
                             : fh_distill_topk_forward(ctx, &lin, &teacher, NULL, &opt, &out);
    return CODE_STATUS + (int)st + (hu_outputs_untouched(&o, TU_CANARY) ? 0 : CODE_WRITTEN);
}

static void test_topk_teacher_sizes(void)
{
    const int64_t shapes[][2] = {{P2(54), 1024}, {P2(50), 1024}, {P2(53), 1024}, {INT64_MAX / 2, 3}};
    for (size_t k = 0; k < TU_COUNT(shapes); k++)
        for (int step = 0; step <= 1; step++) {
            topk_args a = {shapes[k][0], shapes[k][1], step};
            const int code = hu_run_isolated(topk_child, &a);
            char got[96];
            describe(code, got, sizeof got);
            TU_CHECK(code == CODE_STATUS + FH_ERR_SIZE_OVERFLOW, "n = %lld, k = %lld, %s: %s", (long long)a.n,
                     (long long)a.k, step ? "fh_distill_topk_forward_backward" : "fh_distill_topk_forward", got);
        }
}

static const tu_test tests[] = {
    {"overflowing shapes and strides on tiny buffers", test_overflowing_shapes},
    {"top-k distillation: teacher arrays whose bytes overflow", test_topk_teacher_sizes},
    {"workspace queries on huge shapes", test_workspace_queries_on_huge_shapes},
    {"distillation: broken or mismatched teachers", test_distill_teacher_shapes},
    {"distillation: refused options and inputs", test_distill_refused_inputs},
    {"distillation: accepted limits", test_distill_accepted_limits},
};
const tu_suite suite_overflow = {tests, TU_COUNT(tests)};
