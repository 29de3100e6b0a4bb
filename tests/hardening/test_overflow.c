/* Overflow and nonsense shapes with pointers to tiny buffers: validation must reject them before touching
 * memory. Every call runs in a forked child (a crash fails one assertion, not the suite) with outputs
 * pre-filled with a canary; the child reports the status and whether any output changed.
 *
 * The rule tested, beyond the pairwise size products and element offsets that the library checks: a view
 * whose last element lies more than PTRDIFF_MAX bytes from its base describes no object that can exist
 * (C objects are smaller than PTRDIFF_MAX bytes), and computing `base + offset` for it overflows the
 * pointer arithmetic, so it must be rejected with FH_ERR_SIZE_OVERFLOW like an offset that overflows
 * int64. For fp32 views that is an element offset above PTRDIFF_MAX / 4 = 2^61 - 1. */
#include "hardening_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define P2(k) ((int64_t)1 << (k))

enum { TINY = 64 };

/* Tiny inputs and outputs shared by the children (each child has its own copy). */
static float tiny_x[TINY], tiny_w[TINY], tiny_b[TINY], tiny_mask[TINY], tiny_adv[TINY], tiny_logps[TINY];
static float tiny_grad[TINY], tiny_lse[TINY];
static int64_t tiny_targets[TINY];

typedef struct shape_case {
    const char *name;
    int64_t n, hidden, vocab;
    int64_t x_row_stride, w_stride_hidden, w_stride_vocab; /* 0: contiguous HV */
    int64_t dx_row_stride;                                  /* 0: hidden */
    int64_t batch, seq;                                     /* GRPO; 0: batch 1, seq n */
    unsigned expected;                                      /* bit per acceptable status */
    int grads_only;                                         /* the broken part is dx: calls with gradients */
} shape_case;

#define ST(s) (1u << (s))

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
    /* GRPO and preference only: batch * seq (pairs * seq). An overflowing product cannot equal n; the library reports the mismatch. */
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

/* Exit code: 50 + status when every output is untouched, 100 + status when one was written. */
static int child(void *arg)
{
    const child_args *a = arg;
    const shape_case *c = a->c;
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK || fh_context_set(ctx, FH_PARAM_THREADS, 1) != FH_OK)
        return 2;
    fh_linear lin;
    linear_of(c, &lin);
    hu_outputs o;
    hu_outputs_alloc(&o, 4, 4, 4, 1);
    hu_outputs_fill(&o, TU_CANARY);
    fh_linear_grads g = {.dx = o.dx, .dx_row_stride = c->dx_row_stride ? c->dx_row_stride : c->hidden, .dx_beta = 0.0f, .dweight = o.dweight, .dweight_beta = 0.0f, .dbias = o.dbias, .dbias_beta = 0.0f};
    fh_ce_options ce;
    fh_ce_options_init(&ce);
    fh_grpo_options go;
    fh_grpo_options_init(&go);
    const fh_grpo_batch batch = {c->batch ? c->batch : 1, c->batch ? c->seq : c->n, tiny_targets, tiny_mask,
                                 tiny_adv, tiny_logps, tiny_logps};
    fh_ce_outputs ce_out = {&o.loss, &o.z_loss, o.per_token_loss, o.logp, o.lse, o.argmax};
    fh_grpo_outputs grpo_out = {&o.loss, &o.metrics, o.logp, o.per_token_loss, o.entropy, o.lse};
    /* A preference batch: the same sequences as one pair when no batch is given. */
    const fh_preference_batch pairs = {c->batch ? c->batch : 1, c->batch ? c->seq : c->n / 2, tiny_targets, tiny_mask,
                                       NULL, NULL};
    fh_preference_options po;
    fh_preference_options_init(&po);
    fh_preference_outputs pref_out = {&o.loss, &o.preference_metrics, o.sequence_logps, o.rewards, o.logp};
    size_t bytes = 0xA5A5A5A5u;
    fh_status st;
    if (a->query) {
        st = a->call >= HU_PREFERENCE_FORWARD ? fh_preference_workspace_size(ctx, &lin, &bytes)
             : hu_call_on_sequences(a->call) ? fh_grpo_workspace_size(ctx, &lin, &bytes)
             : a->call == HU_CE_TRAIN_STEP ? fh_ce_forward_backward_workspace_size(ctx, &lin, &ce, &bytes)
                                           : fh_ce_workspace_size(ctx, &lin, &ce, &bytes);
        if (st != FH_OK && bytes != 0xA5A5A5A5u)
            return 100 + (int)st;
        return 50 + (int)st;
    }
    switch (a->call) {
    case HU_CE_FORWARD: st = fh_ce_forward(ctx, &lin, tiny_targets, &ce, &ce_out); break;
    case HU_CE_BACKWARD: st = fh_ce_backward(ctx, &lin, tiny_targets, &ce, tiny_lse, tiny_grad, &g); break;
    case HU_CE_TRAIN_STEP: st = fh_ce_forward_backward(ctx, &lin, tiny_targets, &ce, tiny_grad, &ce_out, &g); break;
    case HU_GRPO_FORWARD: st = fh_grpo_forward(ctx, &lin, &batch, &go, &grpo_out); break;
    case HU_GRPO_BACKWARD:
        st = fh_grpo_backward(ctx, &lin, &batch, &go, tiny_logps, tiny_lse, tiny_logps, tiny_grad, &g);
        break;
    case HU_GRPO_TRAIN_STEP: st = fh_grpo_forward_backward(ctx, &lin, &batch, &go, tiny_grad, &grpo_out, &g); break;
    case HU_PREFERENCE_FORWARD: st = fh_preference_forward(ctx, &lin, &pairs, &po, &pref_out); break;
    default: st = fh_preference_forward_backward(ctx, &lin, &pairs, &po, tiny_grad, &pref_out, &g); break;
    }
    const int untouched = hu_outputs_untouched(&o, TU_CANARY);
    return (untouched ? 50 : 100) + (int)st;
}

static void describe(int code, char *buf, size_t size)
{
    if (code >= 1000)
        snprintf(buf, size, "killed by signal %d", code - 1000);
    else if (code >= 100)
        snprintf(buf, size, "status %d (%s) and an output was written", code - 100,
                 fh_status_string((fh_status)(code - 100)));
    else if (code >= 50)
        snprintf(buf, size, "status %d (%s)", code - 50, fh_status_string((fh_status)(code - 50)));
    else
        snprintf(buf, size, "exit code %d (a sanitizer report?)", code);
}

static void test_overflowing_shapes(void)
{
    for (int k = 0; k < 16; k++)
        tiny_mask[k] = 1.0f;
    for (size_t k = 0; k < TU_COUNT(cases); k++) {
        const shape_case *c = &cases[k];
        const int grpo_only = c->batch != 0;
        for (int call = 0; call < HU_CALL_COUNT; call++) {
            const int grpo = hu_call_on_sequences((hu_call)call);
            if (grpo_only && !grpo)
                continue;
            const int has_grads = call == HU_CE_BACKWARD || call == HU_CE_TRAIN_STEP || call == HU_GRPO_BACKWARD ||
                                  call == HU_GRPO_TRAIN_STEP || call == HU_PREFERENCE_TRAIN_STEP;
            if (c->grads_only && !has_grads)
                continue;
            for (int query = 0; query <= 1; query++) {
                /* Workspace queries take no batch and no gradients; one query per kind of call. */
                if (query && (grpo_only || c->grads_only || call == HU_CE_BACKWARD || call == HU_GRPO_BACKWARD ||
                              call == HU_GRPO_TRAIN_STEP || call == HU_PREFERENCE_TRAIN_STEP))
                    continue;
                child_args a = {c, (hu_call)call, query};
                const int code = hu_run_isolated(child, &a);
                const int ok = code >= 50 && code < 100 && (c->expected & ST(code - 50));
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
                            for (int kind = 0; kind < 3; kind++) {
                                size_t bytes = 0;
                                const fh_status st = kind == 0 ? fh_ce_workspace_size(ctx, &lin, &ce, &bytes)
                                                     : kind == 1
                                                         ? fh_ce_forward_backward_workspace_size(ctx, &lin, &ce, &bytes)
                                                         : fh_grpo_workspace_size(ctx, &lin, &bytes);
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

static const tu_test tests[] = {
    {"overflowing shapes and strides on tiny buffers", test_overflowing_shapes},
    {"workspace queries on huge shapes", test_workspace_queries_on_huge_shapes},
};
const tu_suite suite_overflow = {tests, TU_COUNT(tests)};
