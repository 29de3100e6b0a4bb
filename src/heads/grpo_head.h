/* The GRPO head's pieces, for callers that drive the engine themselves (src/mpi/): the checks, the
 * per-token math ([B, T] vectors -> loss, metrics and backward coefficients) and the workspace slots.
 * fh_grpo_forward/backward/forward_backward in grpo.c are these pieces in sequence. */
#ifndef FH_GRPO_HEAD_H
#define FH_GRPO_HEAD_H

#include "logprob_head.h"

/* Workspace slots: the log-prob head's (logprob_head.h), then the per-sequence ones. */
enum {
    FH_GRPO_SLOT_SEQ_COUNT = FH_LOGPROB_SLOTS, /* [B] */
    FH_GRPO_SLOT_SEQ_LOG_RATIO,                /* [B] */
    FH_GRPO_SLOTS
};
_Static_assert(FH_GRPO_SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

typedef struct fh_grpo_head {
    const fh_grpo_batch *bt;
    const fh_grpo_options *o;
    int64_t vocab;             /* the whole vocabulary: ids outside [0, vocab) have logp 0 and no gradient */
    double *seq_count;         /* [B]: max(sum_t m, 1) */
    double *seq_log_ratio;     /* [B]: s_b (sequence level) */
    double mask_sum;           /* sum m over bt's tokens (fh_grpo_head_prepare) */
    double mask_total;         /* max(sum m, 1) over the whole batch (every data-parallel rank's) */
    double batch_total;        /* B of the whole batch */
    double entropy_threshold;  /* top_entropy_quantile's Q over the whole batch; NaN: no entropy mask */
    double kept_total;         /* max(sum e m, 1) over the whole batch, with the entropy mask */
} fh_grpo_head;

typedef struct fh_grpo_head_outputs {
    double *loss;
    fh_grpo_metrics *metrics;
    float *per_token_loss;
    double *g_logp; /* d(grad * loss)/d logp_i, or NULL */
    double *g_entropy;
} fh_grpo_head_outputs;

/* Partial results behind the loss and the metrics over some sequences: sums (added over data-parallel ranks) and
 * maxima (-INFINITY: none; minima kept negated). */
typedef struct fh_grpo_partials {
    struct {
        double loss;          /* the policy + KL part, normalised */
        double kl;            /* sum m kl */
        double entropy;       /* sum m H (NaN when no entropies) */
        double bonus_entropy; /* sum e m H */
        double clip_low, clip_high, clip_region, cispo_clip;
        double phi;           /* sum of VESPO's phi_b */
        double logp_difference, logp_difference_count; /* |old - samp| over tokens with m != 0 */
        double is_ratio, is_ratio_count;
    } sum;
    struct {
        double neg_clip_low_min, clip_high_max, logp_difference_max, neg_is_ratio_min, is_ratio_max;
    } max;
} fh_grpo_partials;

/* Sums over every rank that holds part of the batch (NULL: one process holds it all). */
typedef struct fh_grpo_reducer {
    fh_status (*sum)(void *self, double *values, int n);
    void *self;
} fh_grpo_reducer;

double fh_grpo_epsilon_high(const fh_grpo_options *o);
/* Whether the vLLM importance-sampling correction applies (the batch has the sampler's log-probs and the option is
 * on), and whether a mode is per sequence. */
int fh_grpo_is_correction(const fh_grpo_batch *bt, const fh_grpo_options *o);
int fh_grpo_is_sequence_mode(fh_grpo_vllm_is_mode mode);
/* The dapo / cispo / vespo normaliser N (num_items_in_batch, or the whole batch's max(sum m, 1)). */
double fh_grpo_items(const fh_grpo_head *h);

/* Shape, strides, finiteness (if asked), options and batch; unmasked ids must lie in [0, target_vocab)
 * (target_vocab <= 0: lin->vocab). */
fh_status fh_grpo_check_call(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt,
                             const fh_grpo_options *o, int64_t target_vocab);
fh_status fh_grpo_check_grad_output(fh_context *ctx, const float *grad_output);
/* A backward's saved values: per_token_logp and lse, and entropy when the entropy bonus or mask needs it. */
fh_status fh_grpo_check_saved(fh_context *ctx, const fh_grpo_options *o, const float *per_token_logp,
                              const float *lse, const float *entropy);
/* After the other checks: no output (out's arrays, grads' gradients; either may be NULL) overlaps an input (the
 * batch's arrays; the saved per_token_logp, lse, entropy and grad_output when given; x, weight, bias), another
 * output or the caller's workspace, except per_token_logp exactly over old_per_token_logps (README, Conventions). */
fh_status fh_grpo_check_apart(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt,
                              const float *saved_logp, const float *saved_lse, const float *saved_entropy,
                              const float *grad_output, const fh_grpo_outputs *out, const fh_linear_grads *grads);

/* An engine pass of the head's transform over ids (shard-local ones with vocabulary parallelism); the
 * caller adds stats, or coefs and grads. */
fh_engine_pass fh_grpo_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids,
                            const fh_grpo_options *o);
/* The per-token outputs (logp, entropy, lse) from the workspace's slots. */
void fh_grpo_write_outputs(const fh_workspace *ws, int64_t n, fh_grpo_outputs *out);

/* The head over the workspace's per-sequence arrays; whole-batch totals are bt's until changed. */
fh_grpo_head fh_grpo_head_in(const fh_workspace *ws, const fh_grpo_batch *bt, const fh_grpo_options *o,
                             int64_t vocab);
/* Per-sequence counts; mask_sum, mask_total and batch_total of bt alone: the mask is all they need. */
void fh_grpo_head_count(fh_grpo_head *h);
/* GSPO log-ratios of sequences [b0, b1) from their tokens' logp. */
void fh_grpo_head_log_ratios(fh_grpo_head *h, const double *logp, int64_t b0, int64_t b1);
/* Both, for the whole batch. */
void fh_grpo_head_prepare(fh_grpo_head *h, const double *logp);
/* With top_entropy_quantile < 1, after fh_grpo_head_count (and the whole-batch totals): the threshold Q over every
 * rank's tokens with m != 0 and the count of the tokens it keeps (a few dozen sums of two values; no entropy is
 * gathered). Needs every token's entropy, so no coefficient can come before it: the single call streams. */
fh_status fh_grpo_head_entropy_threshold(fh_grpo_head *h, const double *entropy, const fh_grpo_reducer *reducer);
/* e_i: whether token i carries the policy term and the entropy bonus (1 without the entropy mask). */
int fh_grpo_entropy_kept(const fh_grpo_head *h, const double *entropy, int64_t i);
/* Per-token outputs and coefficients of sequences [b0, b1) (with the head's whole-batch totals) and their
 * partial sums. */
void fh_grpo_head_evaluate(const fh_grpo_head *h, int64_t b0, int64_t b1, const double *logp, const double *entropy,
                           double grad, const fh_grpo_head_outputs *out, fh_grpo_partials *partials);
/* Loss and metrics from (whole-batch) partial sums. */
void fh_grpo_head_finish(const fh_grpo_head *h, const fh_grpo_partials *p, const fh_grpo_head_outputs *out);
/* The single-call step in row blocks of whole sequences (fh_plan_train_step_groups).
 * fh_grpo_block_coefficients, once a block's rows (whole sequences) have
 * their final statistics in the workspace's slots: their logp and entropy (ids outside [0, vocab) get logp 0),
 * their sequences' GSPO log-ratios, and their g_logp and g_entropy (h's whole-batch totals already counted).
 * fh_grpo_row_coefficients: row i's engine coefficients from those. */
void fh_grpo_block_coefficients(fh_grpo_head *h, const fh_workspace *ws, int64_t vocab, double grad,
                                const fh_row_block *block);
void fh_grpo_row_coefficients(const fh_workspace *ws, int64_t i, fh_coef *k);
/* Head outputs of a backward pass: g_logp and g_entropy into the workspace, the rest to forward_out. */
fh_grpo_head_outputs fh_grpo_backward_outputs(const fh_workspace *ws, fh_grpo_outputs *forward_out);
/* The engine's coefficients from g_logp and g_entropy in the workspace. */
fh_coef_arrays fh_grpo_coefs_in(const fh_workspace *ws, int64_t n);

#endif
