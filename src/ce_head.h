/* The cross-entropy head's pieces, for callers that drive the engine themselves (src/mpi/): the checks,
 * the per-token math (statistics -> loss, statistics -> backward coefficients) and the workspace layout.
 * fh_ce_forward/backward/forward_backward in ce.c are these pieces in sequence. */
#ifndef FH_CE_HEAD_H
#define FH_CE_HEAD_H

#include "engine.h"

/* Denominators of the mean: sum of the targets' class weights (cross-entropy part) and the count of
 * non-ignored tokens (z-loss part), both over non-ignored tokens. */
typedef struct fh_ce_norms {
    double weight_sum;         /* sum_i w_{y_i} */
    double count;
    double class_weight_total; /* sum_j w_j (V without class weights), for label smoothing */
} fh_ce_norms;

/* Everything the per-token math needs. */
typedef struct fh_ce_head {
    const fh_linear *lin;
    const int64_t *targets;        /* as the caller gave them (ignore_index tells ignored tokens) */
    const fh_ce_options *o;
    fh_ce_norms nm;
    const float *grad_output;      /* NULL in a forward-only call */
    int64_t grad_count;            /* 1 for mean/sum, n for none */
    double vocab;                  /* V of the label-smoothing term (the whole vocabulary) */
    const double *target_weights;  /* [n] w_{y_i}, or NULL: looked up in o->class_weights (1 without) */
} fh_ce_head;

/* Shape, strides, finiteness (if asked) and options; targets must lie in [0, target_vocab) unless ignored
 * (target_vocab <= 0: lin->vocab). */
fh_status fh_ce_check_call(fh_context *ctx, const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                           int64_t target_vocab);
fh_status fh_ce_check_outputs(fh_context *ctx, const fh_ce_options *o, const fh_ce_outputs *out);
fh_status fh_ce_check_backward_inputs(fh_context *ctx, const fh_linear *lin, const fh_ce_options *o,
                                      const float *grad_output, const fh_linear_grads *grads);

/* The single-process head: vocab = lin->vocab, norms over lin's tokens and vocabulary. */
fh_ce_head fh_ce_head_of(const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                         const float *grad_output);
/* Norms over h->lin's tokens (through h->target_weights when set) and h->lin's vocabulary columns. */
fh_ce_norms fh_ce_local_norms(const fh_ce_head *h);

fh_transform fh_ce_transform(const fh_ce_options *o);
/* Class weights as the engine needs them: only the label-smoothing terms use w_j. */
const float *fh_ce_engine_weights(const fh_ce_options *o);

/* fh_coef_source callback (self: const fh_ce_head *). */
void fh_ce_row_coefs(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k);

/* Per-token outputs from final statistics; returns the unreduced totals (cross-entropy, z-loss). */
void fh_ce_write_token_outputs(const fh_ce_head *h, const fh_token_stats *stats, fh_ce_outputs *out,
                               double totals[2]);
/* Reduces the totals (mean: divided by the head's norms) into out->loss and out->z_loss. */
void fh_ce_write_loss(const fh_ce_head *h, const double totals[2], fh_ce_outputs *out);

/* Workspace: the plan's buffer, carved. */
fh_status fh_ce_acquire(fh_context *ctx, const fh_linear *lin, const fh_plan *plan, fh_workspace *ws);
/* Row blocks when they fit the budget (*row_blocks = 1), else the streaming backward's plan. */
fh_status fh_ce_plan_train_step(fh_context *ctx, const fh_linear *lin, fh_plan *plan, int *row_blocks);
/* Statistics arrays in the workspace (token arrays 0..4). */
fh_token_stats fh_ce_stats_in(const fh_workspace *ws, const fh_ce_options *o, const fh_ce_outputs *out);
/* Backward coefficients for every row into token arrays 0..3, from lse (float or double). */
fh_coef_arrays fh_ce_coefs_in(const fh_workspace *ws, const fh_ce_head *h, const float *lse_float,
                            const double *lse_double);

#endif
