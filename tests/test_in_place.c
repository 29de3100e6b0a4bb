/* The in-place forms the README allows, on both train-step schedules (row blocks, and streaming under a budget that
 * holds only streaming tiles): an output over the input it replaces gives bitwise the results of separate buffers.
 *   - CE, reduction none: per_token_loss over grad_output (a caller's upstream gradient buffer reused);
 *   - GRPO: per_token_logp over old_per_token_logps (the PPO pattern: the next step's old log-probs). */
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

enum { N = 48, H = 16, V = 2000, B = 6, T = 8 };

/* A context for a schedule: 0 the default (row blocks), 1 streaming (4 x 16 tiles, a budget of their size). */
static fh_context *schedule_context(int streaming, const fh_linear *lin, int grpo)
{
    fh_context *ctx = tu_context(2, streaming ? 4 : 0, streaming ? 16 : 0, 0);
    if (streaming) {
        size_t bytes = 0;
        fh_ce_options o;
        fh_ce_options_init(&o);
        o.reduction = FH_REDUCTION_NONE;
        const fh_status st = grpo ? fh_grpo_workspace_size(ctx, lin, &bytes) : fh_ce_workspace_size(ctx, lin, &o, &bytes);
        TU_CHECK(st == FH_OK && fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, (int64_t)bytes) == FH_OK,
                 "streaming budget");
    }
    return ctx;
}

static void inputs(float *x, float *w, uint64_t seed)
{
    uint64_t rng = seed;
    tu_fill_uniform(x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(w, (size_t)V * H, &rng, -0.5, 0.5);
}

static void test_ce_per_token_loss_over_grad_output(void)
{
    float *x = tu_alloc(N * H, 4), *w = tu_alloc((size_t)V * H, 4);
    inputs(x, w, 41);
    int64_t targets[N];
    float upstream[N];
    for (int i = 0; i < N; i++) {
        targets[i] = (i * 37) % V;
        upstream[i] = 0.5f + (float)i / N;
    }
    targets[3] = -100;
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.reduction = FH_REDUCTION_NONE;
    o.label_smoothing = 0.1;
    for (int streaming = 0; streaming < 2; streaming++) {
        fh_context *ctx = schedule_context(streaming, &lin, 0);
        float ptl[2][N], dx[2][N * H], shared[N];
        float *dw[2] = {tu_alloc((size_t)V * H, 4), tu_alloc((size_t)V * H, 4)};
        double loss[2];
        memcpy(shared, upstream, sizeof shared);
        for (int in_place = 0; in_place < 2; in_place++) {
            fh_ce_outputs out = {&loss[in_place], NULL, in_place ? shared : ptl[0], NULL, NULL, NULL, NULL, NULL};
            fh_linear_grads g = {.dx = dx[in_place], .dx_row_stride = H, .dweight = dw[in_place]};
            const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &o, in_place ? shared : upstream, &out, &g);
            TU_CHECK(st == FH_OK, "schedule %d, in place %d: status %d", streaming, in_place, (int)st);
        }
        TU_CHECK(memcmp(shared, ptl[0], sizeof shared) == 0 && loss[0] == loss[1] &&
                     memcmp(dx[0], dx[1], sizeof dx[0]) == 0 && memcmp(dw[0], dw[1], (size_t)V * H * 4) == 0,
                 "%s: per_token_loss over grad_output differs from separate buffers (loss %.9g vs %.9g)",
                 streaming ? "streaming" : "row blocks", loss[1], loss[0]);
        free(dw[0]);
        free(dw[1]);
        fh_context_destroy(ctx);
    }
    free(x);
    free(w);
}

static void test_grpo_per_token_logp_over_old(void)
{
    float *x = tu_alloc(N * H, 4), *w = tu_alloc((size_t)V * H, 4);
    inputs(x, w, 43);
    int64_t ids[N];
    float mask[N], adv[B], old[N];
    uint64_t rng = 44;
    tu_fill_uniform(old, N, &rng, -7.9, -7.3); /* near log(1 / V): ratios near 1 */
    for (int i = 0; i < N; i++) {
        ids[i] = (i * 53) % V;
        mask[i] = i % T < T - 1 ? 1.0f : 0.0f;
    }
    for (int b = 0; b < B; b++)
        adv[b] = (float)b - 2.5f;
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
    fh_grpo_options o;
    fh_grpo_options_init(&o);
    o.importance_sampling_level = FH_GRPO_IS_SEQUENCE; /* the sequence's mean log ratio reads every old log-prob */
    const float grad = 1.0f;
    for (int streaming = 0; streaming < 2; streaming++) {
        fh_context *ctx = schedule_context(streaming, &lin, 1);
        float logp[N], shared[N], dx[2][N * H];
        float *dw[2] = {tu_alloc((size_t)V * H, 4), tu_alloc((size_t)V * H, 4)};
        double loss[2];
        memcpy(shared, old, sizeof shared);
        for (int in_place = 0; in_place < 2; in_place++) {
            const fh_grpo_batch batch = {B, T, ids, mask, adv, in_place ? shared : old, NULL, NULL, NULL, NULL};
            fh_grpo_outputs out = {&loss[in_place], NULL, in_place ? shared : logp, NULL, NULL, NULL};
            fh_linear_grads g = {.dx = dx[in_place], .dx_row_stride = H, .dweight = dw[in_place]};
            const fh_status st = fh_grpo_forward_backward(ctx, &lin, &batch, &o, &grad, &out, &g);
            TU_CHECK(st == FH_OK, "schedule %d, in place %d: status %d", streaming, in_place, (int)st);
        }
        TU_CHECK(memcmp(shared, logp, sizeof logp) == 0 && loss[0] == loss[1] &&
                     memcmp(dx[0], dx[1], sizeof dx[0]) == 0 && memcmp(dw[0], dw[1], (size_t)V * H * 4) == 0,
                 "%s: per_token_logp over old_per_token_logps differs from separate buffers (loss %.9g vs %.9g)",
                 streaming ? "streaming" : "row blocks", loss[1], loss[0]);
        free(dw[0]);
        free(dw[1]);
        fh_context_destroy(ctx);
    }
    free(x);
    free(w);
}

static const tu_test tests[] = {
    {"CE none: per_token_loss over grad_output, both schedules", test_ce_per_token_loss_over_grad_output},
    {"GRPO: per_token_logp over old_per_token_logps, both schedules", test_grpo_per_token_logp_over_old},
};
const tu_suite suite_in_place = {tests, TU_COUNT(tests)};
