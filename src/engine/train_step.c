/* The single-call train step's plan and workspace, the same for every head, and a per-token head's calls by kind
 * (engine.h). */
#include "engine.h"

/* The rows of the tallest group (a pair's two groups together). */
static int64_t tallest_group(const fh_row_groups *g)
{
    int64_t tallest = 0;
    for (int64_t k = 0; k < g->count; k++) {
        int64_t rows = fh_group_first(g, k + 1) - fh_group_first(g, k);
        if (g->paired)
            rows += fh_group_first(g, g->count + k + 1) - fh_group_first(g, g->count + k);
        tallest = rows > tallest ? rows : tallest;
    }
    return tallest;
}

fh_status fh_engine_train_step(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                               const fh_train_step_head *head)
{
    fh_plan plans[2];
    fh_workspace ws[2];
    int row_blocks = 0;
    fh_status st = head->streaming_only ? FH_OK
                   : head->companion ? fh_plan_pair_train_step(ctx, lin, head->companion, head->head_row_bytes, grads,
                                                             &plans[0], &row_blocks, ctx)
                   : head->groups ? fh_plan_train_step_groups(ctx, lin, grads, tallest_group(head->groups), 0, &plans[0],
                                                              &row_blocks)
                   : head->group_rows > 1
                       ? fh_plan_train_step_groups(ctx, lin, grads, head->group_rows, 1, &plans[0], &row_blocks)
                       : fh_plan_train_step(ctx, lin, grads, &plans[0], &row_blocks, ctx);
    if (st != FH_OK)
        return st;
    if (row_blocks || !head->forward_plan) {
        st = fh_workspace_acquire(ctx, lin->n, &plans[0], 1, &ws[0]);
        plans[1] = plans[0];
        ws[1] = ws[0];
    } else {
        st = fh_prepare_streaming(ctx, lin, plans, ws);
    }
    if (st != FH_OK)
        return st;
    return fh_gemm_failure(ctx, head->run(head->self, row_blocks, plans, ws, grads));
}

fh_status fh_engine_run_call(fh_context *ctx, fh_call kind, const fh_head_calls *calls, const fh_linear *lin,
                             const fh_linear_grads *grads, const void *self)
{
    if (kind == FH_CALL_TRAIN_STEP) {
        const fh_train_step_head head = {.group_rows = 1, .run = calls->step, .self = self};
        return fh_engine_train_step(ctx, lin, grads, &head);
    }
    fh_plan plan;
    fh_workspace ws;
    const fh_status st = fh_prepare_pass(ctx, lin, kind, &plan, &ws);
    if (st != FH_OK)
        return st;
    return fh_gemm_failure(ctx, (kind == FH_CALL_FORWARD ? calls->forward : calls->backward)(self, &plan, &ws));
}
