/* The forward and train step of a head over whole sequences (sequences.h). */
#include "sequences.h"

/* Streams the forward on plan and ws; leaves the statistics and every sequence's values in the state. */
static fh_status forward_pass(const fh_sequence_head *hd, const fh_plan *plan, const fh_workspace *ws)
{
    const fh_token_stats stats = hd->stats(hd->state);
    fh_engine_pass pass = hd->pass(hd->state, plan, ws);
    pass.stats = &stats;
    const fh_status st = fh_engine_forward(&pass);
    if (st == FH_OK)
        hd->after_forward(hd->state);
    return st;
}

fh_status fh_sequence_forward(fh_context *ctx, const fh_linear *lin, const fh_sequence_head *hd)
{
    fh_plan plan;
    fh_workspace ws;
    fh_status st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    if (st != FH_OK)
        return st;
    hd->begin(hd->state, &ws, 0.0);
    st = forward_pass(hd, &plan, &ws);
    if (st != FH_OK)
        return fh_gemm_failure(ctx, st);
    hd->finish(hd->state);
    return FH_OK;
}

/* The row blocks' hooks (self: a step). */
typedef struct step {
    const fh_sequence_head *hd;
    double grad;
} step;

static fh_status block_coefficients(const void *self, int64_t first_row, int64_t rows, const fh_token_stats *stats)
{
    const step *s = self;
    const int64_t T = s->hd->seq;
    (void)stats; /* the same arrays as the workspace's slots, which the head reads */
    s->hd->sequences(s->hd->state, first_row / T, (first_row + rows) / T, s->grad);
    return FH_OK;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    const step *s = self;
    (void)stats;
    s->hd->row(s->hd->state, i, k);
}

static fh_status block_step(const step *s, const fh_plan *plan, const fh_workspace *ws, const fh_linear_grads *grads)
{
    const fh_sequence_head *hd = s->hd;
    const fh_coef_source source = {row_coefficients, block_coefficients, s};
    const fh_token_stats stats = hd->stats(hd->state);
    fh_engine_pass pass = hd->pass(hd->state, plan, ws);
    pass.stats = &stats;
    pass.grads = grads;
    pass.paired_rows = hd->paired_rows;
    pass.source = &source;
    const fh_status st = fh_engine_row_blocks(&pass);
    if (st == FH_OK)
        hd->after_blocks(hd->state);
    return st;
}

/* Streaming, on the streaming plans (fh_engine_train_step's forward_plan): the backward's GEMMs made ready, the
 * forward, every sequence's coefficients, then the engine's backward. The two workspaces share their slots. */
static fh_status streaming_step(const step *s, const fh_plan plans[2], const fh_workspace ws[2],
                                const fh_linear_grads *grads)
{
    const fh_sequence_head *hd = s->hd;
    fh_engine_pass pass = hd->pass(hd->state, &plans[1], &ws[1]);
    pass.grads = grads;
    fh_status st = fh_engine_prepare(&pass);
    if (st == FH_OK)
        st = forward_pass(hd, &plans[0], &ws[0]);
    if (st != FH_OK)
        return st;
    const fh_coef_arrays coefs = hd->streaming_coefs(hd->state, &ws[1], s->grad);
    pass.coefs = &coefs;
    return fh_engine_backward(&pass);
}

static fh_status step_run(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                          const fh_linear_grads *grads)
{
    const step *s = self;
    s->hd->begin(s->hd->state, &ws[0], s->grad);
    const fh_status st = row_blocks ? block_step(s, &plans[0], &ws[0], grads) : streaming_step(s, plans, ws, grads);
    if (st == FH_OK)
        s->hd->finish(s->hd->state);
    return st;
}

fh_status fh_sequence_train_step(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                 const fh_sequence_head *hd, double grad)
{
    const step s = {hd, grad};
    const fh_train_step_head head = {.group_rows = hd->group_rows,
                                     .forward_plan = 1,
                                     .streaming_only = hd->streaming_only,
                                     .run = step_run,
                                     .self = &s};
    return fh_engine_train_step(ctx, lin, grads, &head);
}
