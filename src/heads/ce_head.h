/* The cross-entropy head's pieces, for callers that drive the engine themselves (src/mpi/): the checks,
 * the per-token math (statistics -> loss, statistics -> backward coefficients) and the workspace slots.
 * fh_ce_forward/backward/forward_backward in ce.c are these pieces in sequence. */
#ifndef FH_CE_HEAD_H
#define FH_CE_HEAD_H

#include "engine/engine.h"

/* Workspace slots: the forward's statistics, then (backward) the coefficients in the same slots. */
enum {
    FH_CE_SLOT_LSE,
    FH_CE_SLOT_Z_TARGET_THEN_A,
    FH_CE_SLOT_SUM_WZ_THEN_B,
    FH_CE_SLOT_SUM_EXP_THEN_C,
    FH_CE_SLOT_ARGMAX,
    FH_CE_SLOT_SUM_PZ,
    FH_CE_SLOTS
};
_Static_assert(FH_CE_SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

/* Denominators of the mean: sum of the targets' class weights (cross-entropy part) and the count of
 * non-ignored tokens (z-loss part), both over non-ignored tokens. */
typedef struct fh_ce_norms {
    double weight_sum;         /* sum_i w_{y_i} */
    double count;
    double class_weight_total; /* sum_j w_j (V without class weights), for label smoothing */
} fh_ce_norms;

/* The unreduced totals of a call's tokens: cross-entropy, z-loss, and the count of tokens whose argmax is their
 * target (a double, so that MPI sums it with the others; exact below 2^53). */
enum { FH_CE_TOTAL_CE, FH_CE_TOTAL_Z, FH_CE_TOTAL_CORRECT, FH_CE_TOTALS };

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
/* After the other checks: no output (out's arrays, grads' gradients; either may be NULL) overlaps an input (targets,
 * class weights, lse and grad_output when given, x, weight, bias), another output or the caller's workspace, except
 * per_token_loss exactly over grad_output with reduction none (README, Conventions). */
fh_status fh_ce_check_apart(fh_context *ctx, const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                            const float *lse, const float *grad_output, const fh_ce_outputs *out,
                            const fh_linear_grads *grads);
fh_status fh_ce_check_backward_inputs(fh_context *ctx, const fh_linear *lin, const fh_ce_options *o,
                                      const float *grad_output, const fh_linear_grads *grads);

/* The single-process head: vocab = lin->vocab, norms over lin's tokens and vocabulary. */
fh_ce_head fh_ce_head_of(const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                         const float *grad_output);
/* Norms over h->lin's tokens (through h->target_weights when set) and h->lin's vocabulary columns. */
fh_ce_norms fh_ce_local_norms(const fh_ce_head *h);

/* An engine pass of the head's transform (logit_scale m and softcap c as the engine's {cap c / m, scale m}: m c/m
 * tanh(u / (c/m)) = c tanh(m u / c)) and class weights (only the label-smoothing terms use w_j) over targets
 * (shard-local ones with vocabulary parallelism); the caller adds stats, coefs, source, grads. */
fh_engine_pass fh_ce_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *targets,
                          const fh_ce_options *o);

/* fh_coef_source callback (self: const fh_ce_head *). Reads stats->lse, and stats->z_target with token_scaling. */
void fh_ce_row_coefs(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k);

/* Per-token outputs from final statistics; returns the unreduced totals (FH_CE_TOTAL_*). */
void fh_ce_write_token_outputs(const fh_ce_head *h, const fh_token_stats *stats, fh_ce_outputs *out,
                               double totals[FH_CE_TOTALS]);
/* Reduces the totals (mean: divided by the head's norms) into out->loss, out->z_loss and out->correct. */
void fh_ce_write_loss(const fh_ce_head *h, const double totals[FH_CE_TOTALS], fh_ce_outputs *out);

/* Statistics arrays in the workspace's slots: sum_weighted_z only with label smoothing, sum_pz only for the entropy
 * output, argmax only for the argmax or correct outputs. */
fh_token_stats fh_ce_stats_in(const fh_workspace *ws, const fh_ce_options *o, const fh_ce_outputs *out);
/* The split backward's target logits (token_scaling only: the coefficients need p_y = exp(z_y - lse) before the
 * first tile), into the workspace's z_target slot, where fh_ce_coefs_in reads them; NULL without token_scaling. */
double *fh_ce_target_logits_in(const fh_workspace *ws, const fh_ce_options *o, const fh_engine_pass *pass);
/* Backward coefficients for every row into the workspace's slots, from the caller's lse and, with token_scaling,
 * the target logits of fh_ce_target_logits_in (each row's read before its coefficients overwrite them). */
fh_coef_arrays fh_ce_coefs_in(const fh_workspace *ws, const fh_ce_head *h, const float *lse,
                              const double *z_target);
/* The streaming train step's token outputs (totals as fh_ce_write_token_outputs) and backward coefficients (as
 * fh_ce_coefs_in, from stats->lse), row by row, each row read whole before any of its outputs is written: an output
 * may replace an input of its row (per_token_loss over grad_output, reduction none) on every schedule. The
 * coefficients overwrite ws's statistics slots. */
fh_coef_arrays fh_ce_outputs_and_coefs(const fh_workspace *ws, const fh_ce_head *h, const fh_token_stats *stats,
                                       fh_ce_outputs *out, double totals[FH_CE_TOTALS]);

#endif
