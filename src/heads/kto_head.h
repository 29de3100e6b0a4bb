/* The KTO head's pieces, for callers that drive the engine themselves (src/mpi/): the checks, the per-sequence math
 * ([B, T] vectors -> losses, metrics and backward coefficients) and the workspace slots. fh_kto_forward and
 * fh_kto_forward_backward in kto.c are these pieces in sequence. */
#ifndef FH_KTO_HEAD_H
#define FH_KTO_HEAD_H

#include "logprob_head.h"

/* Workspace slots: the log-prob head's (logprob_head.h), then sum_j z_j (the logits metrics) and l [B]. */
enum {
    FH_KTO_SLOT_SUM_Z = FH_LOGPROB_SLOTS,
    FH_KTO_SLOT_SEQ_LOGP,
    FH_KTO_SLOTS
};
_Static_assert(FH_KTO_SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

/* Options, batch (targets in [0, target_vocab) where the mask is non-zero; target_vocab <= 0: lin->vocab) and out
 * (not NULL), and that no output overlaps an input; lin's shapes and strides first. */
fh_status fh_kto_check_call(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *bt, const fh_kto_options *o,
                            const fh_kto_outputs *out, int64_t target_vocab);
/* That no output (out's, grads' when not NULL) overlaps an input (grad_output too), another output or the
 * caller's workspace. */
fh_status fh_kto_check_apart(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *bt, const float *grad_output,
                             const fh_kto_outputs *out, const fh_linear_grads *grads);

typedef struct fh_kto_head {
    const fh_kto_batch *bt;
    const fh_kto_options *o;
    const fh_workspace *ws;
    int64_t vocab;      /* the whole vocabulary: ids outside [0, vocab) have logp 0 and no gradient */
    double batch_total; /* the loss's divisor: B, summed over data ranks */
    double kl;          /* the KL term the losses use */
} fh_kto_head;

/* A head on this batch alone (its B, its KL log-ratios' mean). */
fh_kto_head fh_kto_head_in(const fh_workspace *ws, const fh_kto_batch *bt, const fh_kto_options *o, int64_t vocab);
/* What the whole batch's divisor and KL term sum over data ranks: sums[0] the KL log-ratios' sum (0 without them),
 * sums[1] B. */
void fh_kto_head_sums(const fh_kto_head *h, double sums[2]);
/* The divisor and KL term from those sums over every rank. */
void fh_kto_head_set_totals(fh_kto_head *h, const double sums[2]);

/* The engine's statistics arrays (sum_pz and sum_z only with metrics) and a pass over ids (shard-local with
 * vocabulary parallelism). */
fh_token_stats fh_kto_stats_in(const fh_workspace *ws, int metrics);
fh_engine_pass fh_kto_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids);

/* Sequences [s0, s1): their tokens' logp from the final statistics in the workspace, their l, and each token's
 * g_logp = grad d loss / d logp (the G_LOGP_AS_B slot). */
void fh_kto_sequence_coefficients(const fh_kto_head *h, int64_t s0, int64_t s1, double grad);
/* Row i's engine coefficients from its g_logp: dZ_j = g_logp ([j = y] - p_j). */
void fh_kto_row_coefficients(const fh_workspace *ws, int64_t i, fh_coef *k);
/* Every row's, into the workspace's coefficient slots (the streaming backward), after the forward's values. */
fh_coef_arrays fh_kto_coefs_in(const fh_workspace *ws, int64_t n);

/* The loss's and metrics' sums over this rank's sequences (index 0: desirable, 1: undesirable). */
typedef struct fh_kto_partials {
    double loss, count[2], rewards[2], logps[2], z_sum[2], mask_sum[2], entropy_sum;
} fh_kto_partials;
/* The partial sums (the metrics' need the entropies and sum_z in the workspace) and the per-sequence and per-token
 * outputs, from every token's logp in the workspace. */
void fh_kto_head_partials(const fh_kto_head *h, int metrics, fh_kto_partials *p, fh_kto_outputs *out);
/* The loss and metrics from the partial sums over every rank. */
void fh_kto_head_finish(const fh_kto_head *h, const fh_kto_partials *p, fh_kto_outputs *out);

#endif
