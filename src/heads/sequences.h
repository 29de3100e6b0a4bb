/* Heads over whole sequences of T rows (preference pairs, KTO's sequences): a sequence's coefficients need every one
 * of its rows' statistics, so the train step's row blocks hold whole sequences (or whole pairs), and the streaming
 * fallback takes every sequence's coefficients between its forward and its backward. The head gives its state and
 * hooks; the forward and the train step around them are these. */
#ifndef FH_SEQUENCES_H
#define FH_SEQUENCES_H

#include "engine/engine.h"

/* Where a batch's sequences lie among the rows: sequence s is rows fh_sequence_first(s) .. fh_sequence_first(s + 1)
 * - 1, seq apart ([S, T]), or packed at cu_seqlens ([S + 1] offsets). */
static inline int64_t fh_sequence_first(const int64_t *cu_seqlens, int64_t seq, int64_t s)
{
    return cu_seqlens ? cu_seqlens[s] : s * seq;
}

/* The sequence of row i (of `sequences`). */
int64_t fh_sequence_of_row(const int64_t *cu_seqlens, int64_t seq, int64_t sequences, int64_t i);

/* That the batch's count x per_count sequences (count_name: "batch", "2 x pairs") make lin's n rows: count >= 1,
 * and sequences x seq (seq >= 1), or with cu_seqlens, seq 0 and offsets from 0 that increase (every sequence has a
 * row) and end at n (FH_ERR_INVALID_SIZE). */
fh_status fh_check_sequence_rows(fh_context *ctx, const fh_linear *lin, const char *count_name, int64_t count,
                                 int64_t per_count, int64_t seq, const int64_t *cu_seqlens);

/* The train step's row groups: each sequence (paired: pair s is sequences s and pairs + s), groups of seq rows or
 * at cu_seqlens. */
fh_row_groups fh_sequence_groups(int64_t groups, int64_t seq, const int64_t *cu_seqlens, int paired);

typedef struct fh_sequence_head {
    fh_row_groups groups; /* what a row block keeps together: sequences, or pairs of them */
    int streaming_only;  /* the train step streams (coefficients that need every sequence's values first) */
    void *state;         /* the head's own; its hooks take it */
    /* The state over the workspace the forward's statistics go to; grad: the upstream gradient (0: forward). */
    void (*begin)(void *state, const fh_workspace *ws, double grad);
    /* The engine pass over plan and ws (no statistics, no gradients), and the statistics it folds into the state's
     * workspace. */
    fh_engine_pass (*pass)(const void *state, const fh_plan *plan, const fh_workspace *ws);
    fh_token_stats (*stats)(const void *state);
    /* Once the streaming forward's statistics are final: every sequence's values. */
    void (*after_forward)(void *state);
    /* Row blocks: the coefficients of groups g0 .. g1 - 1 once their rows' statistics are final, then row i's;
     * after the last block, what the outputs need of every row. */
    void (*sequences)(void *state, int64_t s0, int64_t s1, double grad);
    void (*row)(const void *state, int64_t i, fh_coef *k);
    void (*after_blocks)(void *state);
    /* Streaming: every sequence's coefficients, as the backward's coefficient arrays in ws (the backward's). */
    fh_coef_arrays (*streaming_coefs)(void *state, const fh_workspace *ws, double grad);
    /* The outputs (loss, metrics, per-sequence and per-token values). */
    void (*finish)(const void *state);
} fh_sequence_head;

/* The forward, once the head's checks have passed: plan and workspace, begin, the streaming forward, finish. */
fh_status fh_sequence_forward(fh_context *ctx, const fh_linear *lin, const fh_sequence_head *head);

/* The single-call train step (fh_engine_train_step) with the upstream gradient grad: row blocks of whole groups, or
 * the streaming fallback on its own forward plan; then finish. */
fh_status fh_sequence_train_step(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                 const fh_sequence_head *head, double grad);

#endif
