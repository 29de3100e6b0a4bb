/* The log-prob head's pieces: per-token log-probs, entropies and log-sum-exps of a tempered head from the engine's
 * statistics, in workspace slots that the GRPO head (grpo_head.h) shares, since its losses are functions of the
 * same values; and the checks and coefficients of fh_logprob_* (logprob.c), for callers that drive the engine
 * themselves (src/mpi/). */
#ifndef FH_LOGPROB_HEAD_H
#define FH_LOGPROB_HEAD_H

#include "core/linear.h"
#include "engine/engine.h"

/* Workspace slots. The forward's statistics and the per-token values, then (backward) the coefficients: some slots
 * change meaning between the passes, as their names say. */
enum {
    FH_LOGPROB_SLOT_LSE,
    FH_LOGPROB_SLOT_Z_TARGET_THEN_A,
    FH_LOGPROB_SLOT_G_LOGP_AS_B,
    FH_LOGPROB_SLOT_SUM_EXP_THEN_C,
    FH_LOGPROB_SLOT_G_ENTROPY_THEN_E,
    FH_LOGPROB_SLOT_SUM_PZ,
    FH_LOGPROB_SLOT_LOGP,
    FH_LOGPROB_SLOT_ENTROPY,
    FH_LOGPROB_SLOTS
};
_Static_assert(FH_LOGPROB_SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

/* An engine pass of transform tf over ids (shard-local ones with vocabulary parallelism); the caller adds stats, or
 * coefs and grads. */
fh_engine_pass fh_logprob_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids,
                               fh_transform tf);
/* The engine's statistics arrays in the workspace (lse, z_target, sum_exp; sum_pz with entropy: without it the row
 * blocks keep a row's exps for its gradient instead of recomputing them). */
fh_token_stats fh_logprob_stats_in(const fh_workspace *ws, int entropy);
/* logp (0 where the id is outside [0, vocab)) and, with entropy, the entropy of tokens [i0, i1) from the final
 * statistics in the workspace, into its LOGP and ENTROPY slots. */
void fh_logprob_token_values(const fh_workspace *ws, const int64_t *ids, int64_t i0, int64_t i1, int64_t vocab,
                             int entropy);
/* Saved lse and entropy (NULL: 0) into the workspace, with sum_pz = lse - entropy; and logp when given. */
void fh_logprob_load_saved(const fh_workspace *ws, int64_t n, const float *logp, const float *lse,
                           const float *entropy);

/* The outputs of fh_logprob_*, from the workspace's slots; a row for which ignored() holds (targets given, target ==
 * ignore_index) gets 0 in each. */
typedef struct fh_logprob_rows {
    const int64_t *targets; /* or NULL: every row counts */
    int64_t ignore_index;
} fh_logprob_rows;
void fh_logprob_write_outputs(const fh_workspace *ws, int64_t n, fh_logprob_rows rows, float *logp, float *entropy,
                              float *lse);

/* ---- fh_logprob_* ---- */

/* Shape, strides, finiteness (if asked), options (tf written); targets in [0, target_vocab) unless ignored
 * (target_vocab <= 0: lin->vocab). */
fh_status fh_logprob_check_call(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                const fh_logprob_options *o, int64_t target_vocab, fh_transform *tf);

/* The upstream gradients of a backward (each [N] or NULL), finite. */
typedef struct fh_logprob_grads {
    const float *logp, *entropy, *lse;
} fh_logprob_grads;

/* The upstream gradients finite and, for a call with gradients, grads valid (NULL refused); then no output (out's
 * arrays, grads, the logits to keep; any may be NULL) overlaps an input (targets, the saved lse and entropy, g's
 * arrays, the kept logits, x, weight, bias), another output or the caller's workspace. */
fh_status fh_logprob_check_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                    const float *saved_lse, const float *saved_entropy, const fh_logprob_grads *g,
                                    const fh_logprob_outputs *out, int gradients, const fh_linear_grads *grads,
                                    const float *keep, const float *kept);

/* Row i's engine coefficients from its upstream gradients (0 for an ignored row):
 * dZ_j = g_logp ([j = y] - p_j) - g_H p_j (z_j - sum_pz) + g_lse p_j: a = g_lse - g_logp, b = g_logp, e = -g_H. */
void fh_logprob_coefficients(const fh_logprob_grads *g, fh_logprob_rows rows, int64_t i, fh_coef *k);
/* Every row's, into the workspace's coefficient slots (lse and sum_pz already there). */
fh_coef_arrays fh_logprob_coefs_in(const fh_workspace *ws, int64_t n, const fh_logprob_grads *g,
                                   fh_logprob_rows rows);

/* ---- Log-probs over a support (logprob_support.c): a head's per-token values from its rows' supports ---- */

/* The rows that count: a mask's non-zero ones (GRPO's completion mask), else those whose target is not ignore_index.
 * Each counted row's target must be in its support. */
typedef struct fh_support_rows {
    const int64_t *targets;
    int64_t ignore_index;
    const float *mask; /* or NULL */
} fh_support_rows;

/* A call's support, compacted (the counted rows' entries), its entries' logits, and per-token slots laid out as a
 * plan workspace's (ws.slot only: the log-prob and GRPO heads' slot functions work on it). */
typedef struct fh_support_pass {
    const fh_linear *lin;
    fh_support_rows rows;
    fh_transform tf;
    int threads;
    int64_t *begin, *ids; /* fh_row_columns of the counted rows (the others have none) in lin's columns */
    int64_t *target;      /* [n] each counted row's target entry, relative to its row; -1 for the others (and, on a
                             vocabulary shard, where the target is another shard's) */
    float *z;             /* the entries' transformed logits, then their dU */
    unsigned char *seen;  /* [V] the duplicate check's marks */
    fh_workspace ws;
    float *scratch;       /* the engine's (fh_engine_column_scratch_floats) */
} fh_support_pass;

/* Checks the support (offsets, ids, duplicates, each counted row's target) and that it overlaps none of outputs,
 * grads' gradients or the caller's workspace; acquires the workspace (within the budget) and computes every entry's
 * logit. outputs: the head's, for the overlap check. */
fh_status fh_support_pass_begin(fh_context *ctx, const fh_linear *lin, fh_support_rows rows, const fh_support *support,
                                fh_transform tf, const fh_linear_grads *grads, const fh_buffer *outputs,
                                int output_count, fh_support_pass *p);
/* The same on a vocabulary shard: lin holds columns first_column .. first_column + lin->vocab - 1 of total_vocab; the
 * support's ids are the whole vocabulary's (checked against it, the targets too), and only the entries in the shard
 * are kept, as lin's columns. */
fh_status fh_support_pass_begin_shard(fh_context *ctx, const fh_linear *lin, fh_support_rows rows,
                                      const fh_support *support, int64_t first_column, int64_t total_vocab,
                                      fh_transform tf, const fh_linear_grads *grads, const fh_buffer *outputs,
                                      int output_count, fh_support_pass *p);
/* Each counted row's statistics over its entries, as the engine's forward leaves a shard's (lse: -inf without an
 * entry; z_target 0 where the target is not among them; sum_pz with entropy; sum_exp) in the workspace's slots
 * (fh_logprob_stats_in); returned for combining across shards. */
fh_token_stats fh_support_pass_fold(const fh_support_pass *p, int entropy);
/* From the final statistics: lse, sum_pz, logp and (with entropy) the entropy of each counted row into the LSE,
 * SUM_PZ, LOGP and ENTROPY slots (0 for the other rows). */
void fh_support_pass_finish_values(const fh_support_pass *p, int entropy);
/* Both, on the whole vocabulary. */
void fh_support_pass_values(const fh_support_pass *p, int entropy);
/* The gradients from each counted row's coefficients (coefs' arrays, as the engine's backward takes them). */
void fh_support_pass_gradients(fh_support_pass *p, const fh_coef_arrays *coefs, const fh_linear_grads *grads);
/* Workspace bytes of a pass over this support (pure; FH_ERR_BUDGET_TOO_SMALL past the budget). */
fh_status fh_support_workspace_size(const fh_context *ctx, const fh_linear *lin, const fh_support *support,
                                    size_t *bytes);

#endif
