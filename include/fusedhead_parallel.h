/*
 * fusedhead_parallel: the fused losses of fusedhead.h across ranks (in libfusedhead), over collectives the caller
 * provides (fh_collectives: an all-reduce and an all-gather on the caller's group of ranks). fusedhead_mpi.h makes
 * them over MPI communicators; the Python package makes them over torch.distributed process groups and over mpi4py.
 *
 * Two kinds of parallelism, alone or together (a 2-D grid):
 *   - vocab-parallel: the ranks of a "vocab" group hold the same tokens (hidden states, targets, masks...) and each
 *     holds a contiguous shard of the lm_head's vocabulary, in rank order (rank 0 the first columns; shards may be
 *     uneven). Per-token statistics (max, sum of exps, target logit and the sums that label smoothing and the
 *     entropy need) are combined across the group; every rank then computes its own shard of dweight/dbias and its
 *     partial dhidden, which is summed across the group (all-reduce, or reduce-scatter over token rows).
 *   - data-parallel: the ranks of a "data" group hold different tokens and the same vocabulary shard; the
 *     normalisers (non-ignored token count and class-weight sum, GRPO's mask count and batch size) and the loss are
 *     summed across it, and dweight/dbias are all-reduced (or reduce-scattered).
 * Every call returns what the single-process call of fusedhead.h returns on the whole problem (all tokens of the
 * data group, the whole vocabulary): the loss and metrics on every rank; per-token outputs for this rank's tokens;
 * gradients as chosen with fh_parallel_layout_set.
 *
 * What moves per call (n: this rank's tokens): the agreement (a few hundred bytes), one all-gather of 56-byte
 * per-token records over the vocab group (FH_PARALLEL_STATS_PACKED; per row block in the single-call step), a few
 * doubles of normalisers over the data group, then the gradients: dx (n x H floats) over the vocab group and
 * dweight / dbias (the shard) over the data group, unless FH_PARALLEL_NO_REDUCTION leaves them to the caller.
 *
 * Conventions (beyond fusedhead.h's)
 *   - Every call taking a layout is collective over its groups: every rank of the grid calls it, with the same
 *     options. If any rank fails its checks, every rank returns an error (its own status, or else the largest
 *     status of the others) and no output is modified: a rank whose argument is bad (a NULL context, lin, options,
 *     targets or batch included) still joins the others' agreement before it returns. A NULL layout is the
 *     exception: it holds the groups, so that rank returns FH_ERR_NULL_POINTER alone and the others wait for it.
 *   - Options and shapes are compared across the ranks by their exact encodings: values that differ in any bit
 *     (-0.0 and 0.0, NaNs of other payloads) give FH_ERR_MPI_MISMATCH on every rank. A collective that fails
 *     gives FH_ERR_MPI with the collectives' description of the failure (FH_ERR_MPI and FH_ERR_MPI_LAYOUT name
 *     any collectives, MPI's or not: the names are older than this header).
 *   - In a call, lin describes this rank: lin->n its tokens (the same on every rank of the vocab group),
 *     lin->vocab its shard's size (as given to fh_parallel_layout_create), lin->weight and lin->bias its shard.
 *     fh_ce_options.class_weights is this rank's shard of the weights ([lin->vocab]). Targets and completion ids
 *     are global vocabulary indices.
 *   - Collectives are made by the thread that makes the fusedhead call, never by the context's worker threads.
 *   - Results agree with the single process to rounding (per-token statistics are combined in double), but the
 *     summation order differs, so they are not bit-identical to it.
 *   - bf16 inputs and gradients as in fusedhead.h; a bf16 gradient that is summed across ranks is reduced in an
 *     fp32 buffer of its size (allocated per call) and rounded once after the sum.
 */
#ifndef FUSEDHEAD_PARALLEL_H
#define FUSEDHEAD_PARALLEL_H

#include "fusedhead.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Collectives: a group of ranks and the operations the parallel heads make over it. Every rank of a group makes
 * the same calls in the same order. Each function returns 0 on success, else a nonzero code of the caller's,
 * which describe (when not NULL) turns into text for the context's message.
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_collective_type {
    FH_COLLECTIVE_FLOAT = 0,  /* float */
    FH_COLLECTIVE_DOUBLE = 1, /* double */
    FH_COLLECTIVE_INT64 = 2   /* int64_t */
} fh_collective_type;

typedef enum fh_collective_op { FH_COLLECTIVE_SUM = 0, FH_COLLECTIVE_MAX = 1, FH_COLLECTIVE_MIN = 2 } fh_collective_op;

typedef struct fh_collectives {
    void *handle; /* the caller's: passed to every function */
    int rank;     /* this rank in the group, 0 <= rank < size */
    int size;     /* the group's ranks */
    /* buffer[0..count) becomes the element-wise op over the ranks' buffers (in place). */
    int (*allreduce)(void *handle, void *buffer, int64_t count, fh_collective_type type, fh_collective_op op);
    /* receive[r * bytes .. (r + 1) * bytes) becomes rank r's send[0..bytes), on every rank. */
    int (*allgather)(void *handle, const void *send, void *receive, int64_t bytes);
    /* Optional (NULL: an all-reduce, then a copy). The float sum of every rank's buffer, split into size blocks of
     * counts[r] elements in rank order: rank r's block into receive (which may be buffer: then at its start). */
    int (*reduce_scatter)(void *handle, float *buffer, float *receive, const int64_t *counts);
    /* Optional: what code means, into text[0..size). */
    void (*describe)(void *handle, int code, char *text, size_t size);
    /* Optional: called by fh_parallel_layout_destroy (a layout that was created owns its groups' handles). */
    void (*release)(void *handle);
} fh_collectives;

/* ---------------------------------------------------------------------------------------------
 * Layout: the groups and this rank's vocabulary shard.
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_parallel_layout fh_parallel_layout;

/* Collective over vocab, then data (each copied into the layout). Either may be NULL: no parallelism of that kind.
 * local_vocab: this rank's shard size (>= 1); the shard's offset is the sum of the sizes of the lower ranks of
 * vocab. Ranks of data must hold the same shard (else FH_ERR_MPI_LAYOUT). With both groups, they must form a grid:
 * every data group is made of one rank of each vocab group. A NULL layout or a local_vocab < 1 on any rank fails
 * every rank (FH_ERR_NULL_POINTER, FH_ERR_INVALID_SIZE). A group without its allreduce or allgather
 * (FH_ERR_NULL_POINTER), or whose rank is not in [0, size), fails this rank alone, before any collective
 * (FH_ERR_MPI_LAYOUT). On success the layout owns the handles (their release runs at
 * fh_parallel_layout_destroy); on failure the caller still does. */
FH_API fh_status fh_parallel_layout_create(const fh_collectives *vocab, const fh_collectives *data,
                                           int64_t local_vocab, fh_parallel_layout **layout);

/* Frees the layout and releases its groups' handles (fh_collectives.release; collective when that is, as MPI's
 * MPI_Comm_free). NULL is accepted. */
FH_API fh_status fh_parallel_layout_destroy(fh_parallel_layout *layout);

typedef struct fh_parallel_layout_info {
    int vocab_rank, vocab_ranks;     /* this rank in the vocab group, its size */
    int data_rank, data_ranks;
    int64_t vocab_offset;            /* first global vocabulary index of this rank's shard */
    int64_t local_vocab;             /* the shard's size */
    int64_t total_vocab;             /* V, the sum of the shards */
} fh_parallel_layout_info;

FH_API fh_status fh_parallel_layout_query(const fh_parallel_layout *layout, fh_parallel_layout_info *info);

typedef enum fh_parallel_param {
    FH_PARALLEL_PARAM_STATS_COLLECTIVE = 0, /* how the vocab group combines per-token statistics */
    FH_PARALLEL_PARAM_DX_REDUCTION = 1,     /* what dx holds after a backward (vocab group) */
    FH_PARALLEL_PARAM_DWEIGHT_REDUCTION = 2 /* what dweight and dbias hold after a backward (data group) */
} fh_parallel_param;

typedef enum fh_parallel_stats_collective {
    FH_PARALLEL_STATS_PACKED = 0,       /* default: one all-gather of packed records (lse, max, target logit, weighted
                                      sum, sum p z, argmax, target weight), merged on every rank in rank order */
    FH_PARALLEL_STATS_MAX_THEN_SUM = 1  /* all-reduces of built-in ops: the maxima of lse (and of the largest logits,
                                      then the lowest index among the ranks holding it, with argmax), then the sums
                                      of the rescaled statistics */
} fh_parallel_stats_collective;

typedef enum fh_parallel_reduction {
    FH_PARALLEL_ALLREDUCE = 0,      /* default: the sum over the group, on every rank */
    FH_PARALLEL_REDUCE_SCATTER = 1, /* dx: this rank's block of token rows only (fh_parallel_dx_rows); dx points at
                                  the block's first row. dweight: this rank's part (fh_parallel_dweight_part) of
                                  the dense storage of its shard; the rest of the buffer is overwritten with
                                  scratch. dbias is still all-reduced. */
    FH_PARALLEL_NO_REDUCTION = 2    /* this rank's contribution only: the caller reduces (e.g. in its own buckets) */
} fh_parallel_reduction;

/* Not collective: every rank of the grid should set the same values. */
FH_API fh_status fh_parallel_layout_set(fh_parallel_layout *layout, fh_parallel_param param, int value);
FH_API fh_status fh_parallel_layout_get(const fh_parallel_layout *layout, fh_parallel_param param, int *value);

/* The token rows [*first, *first + *count) of an n-row dx that this rank receives with
 * FH_PARALLEL_REDUCE_SCATTER: contiguous blocks in vocab-rank order, sizes differing by at most one. */
FH_API fh_status fh_parallel_dx_rows(const fh_parallel_layout *layout, int64_t n, int64_t *first, int64_t *count);

/* The elements [*first, *first + *count) of the dense storage of this rank's dweight shard (hidden x
 * local_vocab elements, in memory order from the lowest address) that it receives with
 * FH_PARALLEL_REDUCE_SCATTER: contiguous parts in data-rank order, sizes differing by at most one. */
FH_API fh_status fh_parallel_dweight_part(const fh_parallel_layout *layout, int64_t hidden, int64_t *first,
                                          int64_t *count);

/* ---------------------------------------------------------------------------------------------
 * Cross-entropy: fh_ce_* of fusedhead.h across the layout. Label smoothing averages over the whole
 * vocabulary (eps / V, V the sum of the shards, with sum_j w_j over every shard): not Megatron's
 * per-shard mean. Outputs: loss and z_loss over every token of the data group (mean: divided by
 * its global norms); per-token outputs for lin's tokens; lse the global log-sum-exp; argmax a global
 * vocabulary index. grad_output: one value, or lin->n values for 'none'.
 * ------------------------------------------------------------------------------------------- */
FH_API fh_status fh_parallel_ce_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                        const int64_t *targets, const fh_ce_options *options, fh_ce_outputs *out);

FH_API fh_status fh_parallel_ce_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                         const int64_t *targets, const fh_ce_options *options, const float *lse,
                                         const float *grad_output, fh_linear_grads *grads);

/* fusedhead's row-block train step on this rank's shard (6 N H V / vocab ranks flops): per block of rows,
 * the shard's logits, their statistics combined across the vocab group (one all-reduce of the
 * block's rows), then dU and both gradient GEMMs. The ranks of a vocab group walk the same blocks,
 * the lowest of the heights their budgets plan. If any rank of the grid cannot plan a row block, every
 * rank streams: forward, the statistics' all-reduce, backward (8 N H V / vocab ranks flops). A failed
 * collective during the pass returns FH_ERR_MPI with the gradients partly accumulated. */
FH_API fh_status fh_parallel_ce_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                 const int64_t *targets, const fh_ce_options *options,
                                                 const float *grad_output, fh_ce_outputs *out,
                                                 fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * Log-probs: fh_logprob_* of fusedhead.h across the layout. Every output and upstream gradient is per token (this
 * rank's tokens); with vocabulary parallelism each rank's outputs are the whole vocabulary's. The single call runs in
 * row blocks with one statistics all-reduce per block when every rank of the grid can, else it streams.
 * ------------------------------------------------------------------------------------------- */
FH_API fh_status fh_parallel_logprob_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                             const int64_t *targets, const fh_logprob_options *options,
                                             fh_logprob_outputs *out);

FH_API fh_status fh_parallel_logprob_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                              const int64_t *targets, const fh_logprob_options *options,
                                              const float *lse, const float *entropy, const float *g_logp,
                                              const float *g_entropy, const float *g_lse, fh_linear_grads *grads);

FH_API fh_status fh_parallel_logprob_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                      const int64_t *targets, const fh_logprob_options *options,
                                                      const float *g_logp, const float *g_entropy,
                                                      const float *g_lse, fh_logprob_outputs *out,
                                                      fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * Log-probs over a support: fh_logprob_support_* of fusedhead.h across the layout. The support is the whole
 * vocabulary's (global ids), the same on every rank of a vocab group (which holds the same tokens); each rank
 * computes the entries in its shard, and the shards' statistics are combined per token as the full head's are, so a
 * support may fall in any shards (a row's entries may all be in one). Every output and upstream gradient is per token;
 * dweight and dbias are this rank's shard's (only its support columns non-zero). No tile, no GEMM: each call is one
 * statistics exchange over the vocab group (none for the backward), then the gradient reductions.
 * ------------------------------------------------------------------------------------------- */
FH_API fh_status fh_parallel_logprob_support_forward(fh_context *ctx, fh_parallel_layout *layout,
                                                     const fh_linear *lin, const int64_t *targets,
                                                     const fh_support *support, const fh_logprob_options *options,
                                                     fh_logprob_outputs *out);

FH_API fh_status fh_parallel_logprob_support_backward(fh_context *ctx, fh_parallel_layout *layout,
                                                      const fh_linear *lin, const int64_t *targets,
                                                      const fh_support *support, const fh_logprob_options *options,
                                                      const float *lse, const float *entropy, const float *g_logp,
                                                      const float *g_entropy, const float *g_lse,
                                                      fh_linear_grads *grads);

FH_API fh_status fh_parallel_logprob_support_forward_backward(fh_context *ctx, fh_parallel_layout *layout,
                                                              const fh_linear *lin, const int64_t *targets,
                                                              const fh_support *support,
                                                              const fh_logprob_options *options, const float *g_logp,
                                                              const float *g_entropy, const float *g_lse,
                                                              fh_logprob_outputs *out, fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * GRPO: fh_grpo_* of fusedhead.h across the layout. With data parallelism each rank holds whole
 * sequences (its fh_grpo_batch); the loss is that of the concatenated batch: B is the sum of the ranks'
 * B, the mask count (bnpo, the entropy and KL means, dapo/cispo's default num_items_in_batch) is summed,
 * and a num_items_in_batch > 0 is taken as the global count (as TRL's). max_completion_length <= 0
 * means T, which should then be the same on every rank.
 * ------------------------------------------------------------------------------------------- */
FH_API fh_status fh_parallel_grpo_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                          const fh_grpo_batch *batch, const fh_grpo_options *options,
                                          fh_grpo_outputs *out);

FH_API fh_status fh_parallel_grpo_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                           const fh_grpo_batch *batch, const fh_grpo_options *options,
                                           const float *per_token_logp, const float *lse, const float *entropy,
                                           const float *grad_output, fh_linear_grads *grads);

/* Row blocks of whole sequences, as fh_grpo_forward_backward and with the agreement and the per-block all-reduce
 * of fh_parallel_ce_forward_backward; streams on every rank when any rank of the grid cannot hold one sequence. */
FH_API fh_status fh_parallel_grpo_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                   const fh_grpo_batch *batch, const fh_grpo_options *options,
                                                   const float *grad_output, fh_grpo_outputs *out,
                                                   fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * KTO: fh_kto_* of fusedhead.h across the layout. With data parallelism each rank holds whole sequences (its
 * fh_kto_batch); the loss is that of the concatenated batch: B is the sum of the ranks' B, and kl_logratios are
 * averaged over every rank's sequences before the clamp (TRL's gather); a kl value must be the same on every rank.
 * The metrics are the whole batch's. KTO does not depend on T: data ranks may pad their sequences to different
 * lengths (batch->seq, lin->n); the ranks of a vocab group hold the same tokens, so the same T.
 * ------------------------------------------------------------------------------------------- */
FH_API fh_status fh_parallel_kto_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                         const fh_kto_batch *batch, const fh_kto_options *options, fh_kto_outputs *out);

/* Row blocks of whole sequences, as fh_kto_forward_backward, with the agreement and the per-block all-reduce of
 * fh_parallel_ce_forward_backward; streams on every rank when any rank of the grid cannot hold one sequence. */
FH_API fh_status fh_parallel_kto_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                  const fh_kto_batch *batch, const fh_kto_options *options,
                                                  const float *grad_output, fh_kto_outputs *out,
                                                  fh_linear_grads *grads);

#ifdef __cplusplus
}
#endif
#endif
