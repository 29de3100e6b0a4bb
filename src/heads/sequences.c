/* The forward and train step of a head over whole sequences (sequences.h). */
#include "sequences.h"

fh_status fh_check_sequence_rows(fh_context *ctx, const fh_linear *lin, const char *count_name, int64_t count,
                                 int64_t per_count, int64_t seq, const int64_t *cu_seqlens)
{
    int64_t sequences, n;
    if (count < 1 || __builtin_mul_overflow(count, per_count, &sequences))
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "%s = %lld must be >= 1", count_name, (long long)count);
    if (!cu_seqlens) {
        if (seq < 1 || __builtin_mul_overflow(sequences, seq, &n) || n != lin->n)
            return fh_fail(ctx, FH_ERR_INVALID_SIZE, "%s = %lld x seq = %lld must be >= 1 and equal n = %lld",
                           count_name, (long long)count, (long long)seq, (long long)lin->n);
        return FH_OK;
    }
    if (seq != 0)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE,
                       "seq = %lld must be 0 with cu_seqlens: packed sequences have the lengths cu_seqlens gives",
                       (long long)seq);
    if (sequences > lin->n) /* before reading the offsets: S + 1 of them, and each sequence needs a row */
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "%lld packed sequences (%s = %lld) cannot each have a row in n = %lld",
                       (long long)sequences, count_name, (long long)count, (long long)lin->n);
    if (cu_seqlens[0] != 0)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "cu_seqlens[0] = %lld must be 0", (long long)cu_seqlens[0]);
    for (int64_t s = 1; s <= sequences; s++)
        if (cu_seqlens[s] <= cu_seqlens[s - 1])
            return fh_fail(ctx, FH_ERR_INVALID_SIZE,
                           "cu_seqlens[%lld] = %lld must be above cu_seqlens[%lld] = %lld: every sequence has a row",
                           (long long)s, (long long)cu_seqlens[s], (long long)(s - 1), (long long)cu_seqlens[s - 1]);
    if (cu_seqlens[sequences] != lin->n)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "cu_seqlens[%lld] = %lld must equal n = %lld, the packed rows",
                       (long long)sequences, (long long)cu_seqlens[sequences], (long long)lin->n);
    return FH_OK;
}

int64_t fh_sequence_of_row(const int64_t *cu_seqlens, int64_t seq, int64_t sequences, int64_t i)
{
    if (!cu_seqlens)
        return i / seq;
    int64_t low = 0, high = sequences; /* cu_seqlens[low] <= i < cu_seqlens[high] */
    while (high - low > 1) {
        const int64_t mid = low + (high - low) / 2;
        if (cu_seqlens[mid] <= i)
            low = mid;
        else
            high = mid;
    }
    return low;
}

fh_row_groups fh_sequence_groups(int64_t groups, int64_t seq, const int64_t *cu_seqlens, int paired)
{
    const fh_row_groups g = {groups, seq, cu_seqlens, paired};
    return g;
}

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

static fh_status block_coefficients(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const step *s = self;
    (void)stats; /* the same arrays as the workspace's slots, which the head reads */
    s->hd->sequences(s->hd->state, block->first_group, block->end_group, s->grad);
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
    pass.groups = &hd->groups;
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
    const fh_row_groups *g = &hd->groups;
    const fh_train_step_head head = {.group_rows = g->rows * (g->paired ? 2 : 1),
                                     .groups = g->starts ? g : NULL,
                                     .forward_plan = 1,
                                     .streaming_only = hd->streaming_only,
                                     .run = step_run,
                                     .self = &s};
    return fh_engine_train_step(ctx, lin, grads, &head);
}
