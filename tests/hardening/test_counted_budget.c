/* counted_budget: the memory budget holds when ignored rows are compacted (issue 41, item 7). Cross-entropy,
 * log-prob and distillation calls (full-vocabulary and top-k) with half their rows ignored gather the other rows'
 * hidden states, dx and per-row arrays (src/heads/counted_rows.c); those copies count against FH_PARAM_MEMORY_BUDGET
 * with the context's workspace. Each call runs on a context whose workspace an earlier call with every row counted
 * has grown to what the budget holds (a training loop's steady state), under a budget whose half holds the copies
 * (compacted) and one whose half does not (the whole problem runs). What libfusedhead holds at once (the allocation
 * hook's peak of live bytes: workspace, copies, the context itself) must stay within the budget plus the context.
 * Before the copies counted, every train step here held the kept workspace and the copies together: 0.2 to 0.8 MiB
 * over its 2 or 4 MiB budget. FH_HARDENING_VERBOSE=1 prints each call's peak. */
#include "alloc_hook.h"
#include "hardening_util.h"

#include <stdio.h>
#include <stdlib.h>

enum { N = 2048, H = 128, HT = 96, V = 2048, K = 8 };

typedef enum call { CE_TRAIN_STEP, CE_FORWARD, LOGPROB_TRAIN_STEP, DISTILL_TRAIN_STEP, TOPK_TRAIN_STEP, CALLS } call;
static const char *const call_names[CALLS] = {"CE train step", "CE forward ('none')", "log-prob train step",
                                              "distillation train step", "top-k distillation train step"};

typedef struct problem {
    float *x, *weight, *teacher_x, *teacher_weight, *logprobs, *grad;
    int64_t *all, *half, *ids; /* targets: every row counted, the first half of every 64 rows ignored */
    float *per_token, *logp, *dx, *dweight;
} problem;

static void problem_make(problem *p)
{
    uint64_t rng = 41;
    p->x = tu_alloc(N * H, sizeof(float));
    p->weight = tu_alloc(H * V, sizeof(float));
    p->teacher_x = tu_alloc(N * HT, sizeof(float));
    p->teacher_weight = tu_alloc(HT * V, sizeof(float));
    p->logprobs = tu_alloc(N * K, sizeof(float));
    p->grad = tu_alloc(N, sizeof(float));
    p->all = tu_alloc(N, sizeof(int64_t));
    p->half = tu_alloc(N, sizeof(int64_t));
    p->ids = tu_alloc(N * K, sizeof(int64_t));
    p->per_token = tu_alloc(N, sizeof(float));
    p->logp = tu_alloc(N, sizeof(float));
    p->dx = tu_alloc(N * H, sizeof(float));
    p->dweight = tu_alloc(H * V, sizeof(float));
    tu_fill_uniform(p->x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(p->weight, H * V, &rng, -0.1, 0.1);
    tu_fill_uniform(p->teacher_x, N * HT, &rng, -1.0, 1.0);
    tu_fill_uniform(p->teacher_weight, HT * V, &rng, -0.1, 0.1);
    tu_fill_uniform(p->logprobs, N * K, &rng, -9.0, -3.0);
    tu_fill_uniform(p->grad, N, &rng, 0.5, 1.0);
    for (int64_t i = 0; i < N; i++) {
        p->all[i] = (i * 7919) % V;
        p->half[i] = i % 64 < 32 ? -100 : p->all[i];
        for (int64_t j = 0; j < K; j++)
            p->ids[i * K + j] = (p->all[i] + j * 97) % V;
    }
}

static void problem_free(problem *p)
{
    free(p->x);
    free(p->weight);
    free(p->teacher_x);
    free(p->teacher_weight);
    free(p->logprobs);
    free(p->grad);
    free(p->all);
    free(p->half);
    free(p->ids);
    free(p->per_token);
    free(p->logp);
    free(p->dx);
    free(p->dweight);
}

static fh_status run(fh_context *ctx, problem *p, call c, const int64_t *targets)
{
    fh_linear lin, teacher;
    fh_linear_init(&lin, N, H, V, p->x, p->weight, FH_LAYOUT_HV, NULL);
    fh_linear_init(&teacher, N, HT, V, p->teacher_x, p->teacher_weight, FH_LAYOUT_VH, NULL);
    fh_linear_grads grads = {.dx = p->dx, .dx_row_stride = H, .dweight = p->dweight};
    double loss = 0.0;
    const float one = 1.0f;
    switch (c) {
    case CE_TRAIN_STEP:
    case CE_FORWARD: {
        fh_ce_options o;
        fh_ce_options_init(&o);
        fh_ce_outputs out = {.loss = &loss, .per_token_logp = p->logp};
        if (c == CE_TRAIN_STEP)
            return fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &grads);
        o.reduction = FH_REDUCTION_NONE;
        out.per_token_loss = p->per_token;
        return fh_ce_forward(ctx, &lin, targets, &o, &out);
    }
    case LOGPROB_TRAIN_STEP: {
        fh_logprob_options o;
        fh_logprob_options_init(&o);
        fh_logprob_outputs out = {.logp = p->logp};
        return fh_logprob_forward_backward(ctx, &lin, targets, &o, p->grad, NULL, NULL, &out, &grads);
    }
    case DISTILL_TRAIN_STEP: {
        fh_distill_options o;
        fh_distill_options_init(&o);
        fh_distill_outputs out = {.loss = &loss};
        return fh_distill_forward_backward(ctx, &lin, &teacher, targets, &o, &one, &out, &grads);
    }
    default: {
        fh_distill_topk_options o;
        fh_distill_topk_options_init(&o);
        const fh_topk_teacher t = {K, p->ids, p->logprobs};
        fh_distill_outputs out = {.loss = &loss};
        return fh_distill_topk_forward_backward(ctx, &lin, &t, targets, &o, &one, &out, &grads);
    }
    }
}

static void test_budget_holds(void)
{
    if (ah_init() != 0) {
        TU_CHECK(0, "the allocation hooks are not in effect (malloc is not interposed)");
        return;
    }
    const int verbose = getenv("FH_HARDENING_VERBOSE") != NULL;
    problem p;
    problem_make(&p);
    /* Half of 2 MiB does not hold the train step's copies (1024 rows of x and dx: 1 MiB and their per-row arrays);
     * half of 4 MiB does. */
    const int64_t budgets[] = {(int64_t)2 << 20, (int64_t)4 << 20};
    for (size_t b = 0; b < TU_COUNT(budgets); b++)
        for (call c = 0; c < CALLS; c++) {
            const size_t before = ah_live_library_bytes();
            fh_context *ctx = tu_context(1, 0, 0, budgets[b]);
            const size_t context_bytes = ah_live_library_bytes() - before;
            fh_status st = run(ctx, &p, c, p.all); /* the workspace as large as the budget makes it */
            ah_reset_peak();
            if (st == FH_OK)
                st = run(ctx, &p, c, p.half);
            const size_t peak = ah_peak_library_bytes() - before;
            const char *message = "";
            fh_context_message(ctx, &message);
            TU_CHECK(st == FH_OK, "%s, budget %lld: status %d (%s)", call_names[c], (long long)budgets[b], (int)st,
                     message);
            TU_CHECK(peak <= (size_t)budgets[b] + context_bytes,
                     "%s, budget %lld: the library held %zu bytes at once, %zu over the budget and the context (%zu)",
                     call_names[c], (long long)budgets[b], peak, peak - (size_t)budgets[b] - context_bytes,
                     context_bytes);
            if (verbose)
                printf("  %s, budget %lld: peak %zu bytes (context %zu)\n", call_names[c], (long long)budgets[b], peak,
                       context_bytes);
            fh_context_destroy(ctx);
        }
    problem_free(&p);
}

static const tu_test tests[] = {
    {"CE, log-prob and distillation calls with half the rows ignored stay within the memory budget",
     test_budget_holds},
};
const tu_suite suite_counted_budget = {tests, TU_COUNT(tests)};
