/*
 * fusedhead_mpi: the fused losses of fusedhead.h across MPI ranks (libfusedhead_mpi; link it and
 * libfusedhead, both are needed: contexts, fh_linear and the options come from the core library).
 *
 * Two kinds of parallelism, alone or together (a 2-D grid):
 *   - vocab-parallel: the ranks of a "vocab" communicator hold the same tokens (hidden states, targets,
 *     masks...) and each holds a contiguous shard of the lm_head's vocabulary, in rank order (rank 0 the
 *     first columns; shards may be uneven). Per-token statistics (max, sum of exps, target logit and the
 *     sums that label smoothing and the entropy need) are combined across the communicator; every
 *     rank then computes its own shard of dweight/dbias and its partial dhidden, which is summed across
 *     the communicator (all-reduce, or reduce-scatter over token rows).
 *   - data-parallel: the ranks of a "data" communicator hold different tokens and the same vocabulary
 *     shard; the normalisers (non-ignored token count and class-weight sum, GRPO's mask count and batch
 *     size) and the loss are summed across it, and dweight/dbias are all-reduced (or reduce-scattered).
 * Every call returns what the single-process call of fusedhead.h returns on the whole problem (all
 * tokens of the data communicator, the whole vocabulary): the loss and metrics on every rank; per-token
 * outputs for this rank's tokens; gradients as chosen with fh_mpi_layout_set.
 *
 * Conventions (beyond fusedhead.h's)
 *   - Every fh_mpi_* call taking a layout is collective over its communicators: every rank of the grid
 *     calls it, with the same options. If any rank fails its checks, every rank returns an error (its
 *     own status, or else the largest status of the others) and no output is modified: a rank whose
 *     argument is bad (a NULL context, lin, options, targets or batch included) still joins the others'
 *     agreement before it returns. A NULL layout is the exception: it holds the communicators, so that
 *     rank returns FH_ERR_NULL_POINTER alone and the others wait for it.
 *   - Options and shapes are compared across the ranks by their exact encodings: values that differ in
 *     any bit (-0.0 and 0.0, NaNs of other payloads) give FH_ERR_MPI_MISMATCH on every rank.
 *   - In a call, lin describes this rank: lin->n its tokens (the same on every rank of the vocab
 *     communicator), lin->vocab its shard's size (as given to fh_mpi_layout_create), lin->weight and
 *     lin->bias its shard. fh_ce_options.class_weights is this rank's shard of the weights ([lin->vocab]).
 *     Targets and completion ids are global vocabulary indices.
 *   - MPI must be initialised by the caller, with at least MPI_THREAD_FUNNELED when contexts use more
 *     than one thread (only the calling thread makes MPI calls).
 *   - Results agree with the single process to rounding (per-token statistics are combined in double),
 *     but the summation order differs, so they are not bit-identical to it.
 *   - bf16 inputs and gradients as in fusedhead.h; a bf16 gradient that is summed across ranks is reduced in
 *     an fp32 buffer of its size (allocated per call) and rounded once after the sum.
 */
#ifndef FUSEDHEAD_MPI_H
#define FUSEDHEAD_MPI_H

#include <mpi.h>

#include "fusedhead.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(FH_BUILDING_MPI_LIBRARY)
#define FH_MPI_API __attribute__((visibility("default")))
#else
#define FH_MPI_API
#endif

/* This module's status codes, FH_ERR_MPI, FH_ERR_MPI_LAYOUT and FH_ERR_MPI_MISMATCH, are in fusedhead.h's fh_status (60..69), and
 * fh_status_string describes them. */

/* ---------------------------------------------------------------------------------------------
 * Layout: the communicators and this rank's vocabulary shard.
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_mpi_layout fh_mpi_layout;

/* Collective over vocab_comm, then data_comm. Either may be MPI_COMM_NULL (or MPI_COMM_SELF): no
 * parallelism of that kind. Both are duplicated (the caller's communicators may be freed afterwards).
 * local_vocab: this rank's shard size (>= 1); the shard's offset is the sum of the sizes of the lower
 * ranks of vocab_comm. Ranks of data_comm must hold the same shard (else FH_ERR_MPI_LAYOUT). With both
 * communicators, they must form a grid: every data_comm is made of one rank of each vocab_comm. A NULL
 * layout or a local_vocab < 1 on any rank fails every rank (FH_ERR_NULL_POINTER, FH_ERR_INVALID_SIZE). */
FH_MPI_API fh_status fh_mpi_layout_create(MPI_Comm vocab_comm, MPI_Comm data_comm, int64_t local_vocab,
                                          fh_mpi_layout **layout);

/* Convenience: splits comm into a grid of vocab_ranks-wide vocab communicators (consecutive ranks, as
 * Megatron's tensor-parallel groups) and size/vocab_ranks-wide data communicators (FH_ERR_MPI_LAYOUT if
 * vocab_ranks does not divide the size, or differs across the ranks). Collective over comm; a NULL layout on
 * any rank fails every rank. */
FH_MPI_API fh_status fh_mpi_layout_create_grid(MPI_Comm comm, int vocab_ranks, int64_t local_vocab,
                                               fh_mpi_layout **layout);

/* fh_mpi_layout_create with the communicators' Fortran handles (MPI_Comm_c2f; mpi4py's Comm.py2f()): an integer
 * whatever the MPI's C handle type, so that callers without MPI's C header (Python's ctypes) can pass them. */
FH_MPI_API fh_status fh_mpi_layout_create_fortran(MPI_Fint vocab_comm, MPI_Fint data_comm, int64_t local_vocab,
                                                  fh_mpi_layout **layout);

/* Frees the layout and its communicators (collective: MPI_Comm_free). NULL is accepted. */
FH_MPI_API fh_status fh_mpi_layout_destroy(fh_mpi_layout *layout);

typedef struct fh_mpi_layout_info {
    int vocab_rank, vocab_ranks;     /* this rank in the vocab communicator, its size */
    int data_rank, data_ranks;
    int64_t vocab_offset;            /* first global vocabulary index of this rank's shard */
    int64_t local_vocab;             /* the shard's size */
    int64_t total_vocab;             /* V, the sum of the shards */
} fh_mpi_layout_info;

FH_MPI_API fh_status fh_mpi_layout_query(const fh_mpi_layout *layout, fh_mpi_layout_info *info);

typedef enum fh_mpi_param {
    FH_MPI_PARAM_STATS_COLLECTIVE = 0, /* how the vocab communicator combines per-token statistics */
    FH_MPI_PARAM_DX_REDUCTION = 1,     /* what dx holds after a backward (vocab communicator) */
    FH_MPI_PARAM_DWEIGHT_REDUCTION = 2 /* what dweight and dbias hold after a backward (data communicator) */
} fh_mpi_param;

typedef enum fh_mpi_stats_collective {
    FH_MPI_STATS_PACKED = 0,       /* default: one all-gather of packed records (lse, max, target logit, weighted
                                      sum, sum p z, argmax, target weight), merged on every rank in rank order */
    FH_MPI_STATS_MAX_THEN_SUM = 1  /* all-reduces of built-in ops: the maxima of lse (and of the largest logits,
                                      then the lowest index among the ranks holding it, with argmax), then the sums
                                      of the rescaled statistics */
} fh_mpi_stats_collective;

typedef enum fh_mpi_reduction {
    FH_MPI_ALLREDUCE = 0,      /* default: the sum over the communicator, on every rank */
    FH_MPI_REDUCE_SCATTER = 1, /* dx: this rank's block of token rows only (fh_mpi_dx_rows); dx points at
                                  the block's first row. dweight: this rank's part (fh_mpi_dweight_part) of
                                  the dense storage of its shard; the rest of the buffer is overwritten with
                                  scratch. dbias is still all-reduced. */
    FH_MPI_NO_REDUCTION = 2    /* this rank's contribution only: the caller reduces (e.g. in its own buckets) */
} fh_mpi_reduction;

/* Not collective: every rank of the grid should set the same values. */
FH_MPI_API fh_status fh_mpi_layout_set(fh_mpi_layout *layout, fh_mpi_param param, int value);
FH_MPI_API fh_status fh_mpi_layout_get(const fh_mpi_layout *layout, fh_mpi_param param, int *value);

/* The token rows [*first, *first + *count) of an n-row dx that this rank receives with
 * FH_MPI_REDUCE_SCATTER: contiguous blocks in vocab-rank order, sizes differing by at most one. */
FH_MPI_API fh_status fh_mpi_dx_rows(const fh_mpi_layout *layout, int64_t n, int64_t *first, int64_t *count);

/* The elements [*first, *first + *count) of the dense storage of this rank's dweight shard (hidden x
 * local_vocab elements, in memory order from the lowest address) that it receives with
 * FH_MPI_REDUCE_SCATTER: contiguous parts in data-rank order, sizes differing by at most one. */
FH_MPI_API fh_status fh_mpi_dweight_part(const fh_mpi_layout *layout, int64_t hidden, int64_t *first,
                                         int64_t *count);

/* ---------------------------------------------------------------------------------------------
 * Cross-entropy: fh_ce_* of fusedhead.h across the layout. Label smoothing averages over the whole
 * vocabulary (eps / V, V the sum of the shards, with sum_j w_j over every shard): not Megatron's
 * per-shard mean. Outputs: loss and z_loss over every token of the data communicator (mean: divided by
 * its global norms); per-token outputs for lin's tokens; lse the global log-sum-exp; argmax a global
 * vocabulary index. grad_output: one value, or lin->n values for 'none'.
 * ------------------------------------------------------------------------------------------- */
FH_MPI_API fh_status fh_mpi_ce_forward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                       const int64_t *targets, const fh_ce_options *options, fh_ce_outputs *out);

FH_MPI_API fh_status fh_mpi_ce_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                        const int64_t *targets, const fh_ce_options *options, const float *lse,
                                        const float *grad_output, fh_linear_grads *grads);

/* fusedhead's row-block train step on this rank's shard (6 N H V / vocab ranks flops): per block of rows,
 * the shard's logits, their statistics combined across the vocab communicator (one all-reduce of the
 * block's rows), then dU and both gradient GEMMs. The ranks of a vocab communicator walk the same blocks,
 * the lowest of the heights their budgets plan. If any rank of the grid cannot plan a row block, every
 * rank streams: forward, the statistics' all-reduce, backward (8 N H V / vocab ranks flops). An MPI
 * failure during the pass returns FH_ERR_MPI with the gradients partly accumulated. */
FH_MPI_API fh_status fh_mpi_ce_forward_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                                const int64_t *targets, const fh_ce_options *options,
                                                const float *grad_output, fh_ce_outputs *out,
                                                fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * Log-probs: fh_logprob_* of fusedhead.h across the layout. Every output and upstream gradient is per token (this
 * rank's tokens); with vocabulary parallelism each rank's outputs are the whole vocabulary's. The single call runs in
 * row blocks with one statistics all-reduce per block when every rank of the grid can, else it streams.
 * ------------------------------------------------------------------------------------------- */
FH_MPI_API fh_status fh_mpi_logprob_forward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                            const int64_t *targets, const fh_logprob_options *options,
                                            fh_logprob_outputs *out);

FH_MPI_API fh_status fh_mpi_logprob_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                             const int64_t *targets, const fh_logprob_options *options,
                                             const float *lse, const float *entropy, const float *g_logp,
                                             const float *g_entropy, const float *g_lse, fh_linear_grads *grads);

FH_MPI_API fh_status fh_mpi_logprob_forward_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                                     const int64_t *targets, const fh_logprob_options *options,
                                                     const float *g_logp, const float *g_entropy,
                                                     const float *g_lse, fh_logprob_outputs *out,
                                                     fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * GRPO: fh_grpo_* of fusedhead.h across the layout. With data parallelism each rank holds whole
 * sequences (its fh_grpo_batch); the loss is that of the concatenated batch: B is the sum of the ranks'
 * B, the mask count (bnpo, the entropy and KL means, dapo/cispo's default num_items_in_batch) is summed,
 * and a num_items_in_batch > 0 is taken as the global count (as TRL's). max_completion_length <= 0
 * means T, which should then be the same on every rank.
 * ------------------------------------------------------------------------------------------- */
FH_MPI_API fh_status fh_mpi_grpo_forward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                         const fh_grpo_batch *batch, const fh_grpo_options *options,
                                         fh_grpo_outputs *out);

FH_MPI_API fh_status fh_mpi_grpo_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                          const fh_grpo_batch *batch, const fh_grpo_options *options,
                                          const float *per_token_logp, const float *lse, const float *entropy,
                                          const float *grad_output, fh_linear_grads *grads);

/* Row blocks of whole sequences, as fh_grpo_forward_backward and with the agreement and the per-block all-reduce
 * of fh_mpi_ce_forward_backward; streams on every rank when any rank of the grid cannot hold one sequence. */
FH_MPI_API fh_status fh_mpi_grpo_forward_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                                  const fh_grpo_batch *batch, const fh_grpo_options *options,
                                                  const float *grad_output, fh_grpo_outputs *out,
                                                  fh_linear_grads *grads);

/* ---------------------------------------------------------------------------------------------
 * KTO: fh_kto_* of fusedhead.h across the layout. With data parallelism each rank holds whole sequences (its
 * fh_kto_batch); the loss is that of the concatenated batch: B is the sum of the ranks' B, and kl_logratios are
 * averaged over every rank's sequences before the clamp (TRL's gather); a kl value must be the same on every rank.
 * The metrics are the whole batch's. KTO does not depend on T: data ranks may pad their sequences to different
 * lengths (batch->seq, lin->n); the ranks of a vocab communicator hold the same tokens, so the same T.
 * ------------------------------------------------------------------------------------------- */
FH_MPI_API fh_status fh_mpi_kto_forward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                        const fh_kto_batch *batch, const fh_kto_options *options, fh_kto_outputs *out);

/* Row blocks of whole sequences, as fh_kto_forward_backward, with the agreement and the per-block all-reduce of
 * fh_mpi_ce_forward_backward; streams on every rank when any rank of the grid cannot hold one sequence. */
FH_MPI_API fh_status fh_mpi_kto_forward_backward(fh_context *ctx, fh_mpi_layout *layout, const fh_linear *lin,
                                                 const fh_kto_batch *batch, const fh_kto_options *options,
                                                 const float *grad_output, fh_kto_outputs *out,
                                                 fh_linear_grads *grads);

#ifdef __cplusplus
}
#endif
#endif
