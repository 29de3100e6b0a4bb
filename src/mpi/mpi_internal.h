/* The MPI module's internals: the layout object, agreement on errors, per-token statistics across the
 * vocab communicator and gradient reductions. The heads (ce_head.h, grpo_head.h) and the engine do all
 * the math; this module only moves their inputs and outputs between ranks. */
#ifndef FH_MPI_INTERNAL_H
#define FH_MPI_INTERNAL_H

#include "fusedhead_mpi.h"

#include "../engine.h"

#define FH_MPI_PARAM_COUNT 3

struct fh_mpi_layout {
    MPI_Comm vocab, data;           /* our duplicates (MPI_COMM_SELF duplicates when absent) */
    int vocab_rank, vocab_ranks, data_rank, data_ranks;
    int64_t vocab_offset, local_vocab, total_vocab;
    int params[FH_MPI_PARAM_COUNT]; /* indexed by fh_mpi_param */
    MPI_Datatype record;            /* FHM_RECORD doubles: one token's packed statistics */
    MPI_Op merge;                   /* commutative merge of two records */
    void *scratch;                  /* per-token scratch, grown on demand */
    size_t scratch_bytes;
};

/* Fields of a packed statistics record. */
enum { FHM_LSE, FHM_MAX, FHM_Z_TARGET, FHM_SUM_WZ, FHM_SUM_PZ, FHM_ARGMAX, FHM_TARGET_WEIGHT, FHM_RECORD };

/* FH_ERR_MPI with MPI's error string, for a failed MPI call (err != MPI_SUCCESS). */
fh_status fhm_mpi_error(fh_context *ctx, int err, const char *what);

/* Collective over the grid: every rank learns whether any rank failed. Returns st when it is an error,
 * else the largest error of the other ranks (with a message saying so), else FH_ERR_MPI_LAYOUT when n
 * differs across the vocab communicator, else FH_OK. */
fh_status fhm_agree(fh_mpi_layout *L, fh_context *ctx, fh_status st, int64_t n);

/* Agreement on the train step's row blocks, collective over the grid whatever the local status. In:
 * *rows, this rank's row-block height (0: it cannot use row blocks; read only when st is FH_OK). Out: the
 * smallest height over the vocab communicator (its ranks must walk the same blocks: one statistics
 * all-reduce each), or 0 on every rank of the grid when any rank has 0 (the streaming schedule makes
 * other data collectives). Returns st when it is an error, else FH_OK or FH_ERR_MPI. */
fh_status fhm_agree_rows(fh_mpi_layout *L, fh_context *ctx, fh_status st, int64_t *rows);

/* Checks that a call's lin is this rank's shard and that n fits MPI's int counts. Local. */
fh_status fhm_check_shard(const fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin);

/* At least bytes of per-call scratch (64-byte aligned), owned by the layout. */
fh_status fhm_scratch(fh_mpi_layout *L, fh_context *ctx, size_t bytes, void **p);

/* In-place MPI_SUM all-reduce of count elements (chunked past INT_MAX). */
int fhm_allreduce_sum(void *buf, int64_t count, MPI_Datatype type, MPI_Comm comm);

/* Combines per-token statistics over the vocab communicator (nothing to do with one rank). In: this
 * shard's stats as fh_engine_forward (or the row-block pass, to its block hook) leaves them (argmax a
 * shard index; sum_exp still the shard's sum of exps), extra optional: extra[0..n) values to sum
 * (a target's class weight on the rank that holds it) and extra[n] one more summed scalar. Out: the whole
 * vocabulary's lse, z_target, sum_weighted_z, sum_pz, argmax (global index), and the sums in extra.
 * records: scratch of fhm_combine_bytes(n). */
size_t fhm_combine_bytes(int64_t n);
fh_status fhm_combine_stats(fh_mpi_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *stats, double *extra,
                            void *records);

/* Targets local to this rank's shard: t - offset inside it, -1 elsewhere (and where ignored, when
 * ignore is not NULL). */
void fhm_local_targets(const fh_mpi_layout *L, const int64_t *targets, int64_t n, const int64_t *ignore,
                       int64_t *local);

/* Part r of count items split in parts contiguous blocks whose sizes differ by at most one. */
void fhm_split(int64_t count, int parts, int r, int64_t *first, int64_t *size);

/* Sums n doubles over a communicator in place (nothing to do with one rank). */
fh_status fhm_sum(fh_context *ctx, MPI_Comm comm, int ranks, double *values, int n);

/* Gradient outputs as the engine writes them, and what must happen afterwards. */
typedef struct fhm_grads {
    fh_linear_grads user;    /* the caller's */
    fh_linear_grads engine;  /* what the engine writes into */
    int dx_mode, dw_mode;    /* effective fh_mpi_reduction (no reduction over a one-rank communicator) */
    int64_t n, hidden, vocab, w_stride_hidden, w_stride_vocab;
    int64_t dx_first, dx_rows;
    int64_t dw_first, dw_count;
    int dw_dense;
    float *dx_tmp, *dx_recv, *dw_saved, *dw_pack, *db_saved;
} fhm_grads;

/* Checks the caller's gradients for the layout's reductions and allocates what the reductions need.
 * Local; on error nothing is allocated. */
fh_status fhm_grads_begin(const fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin,
                          const fh_linear_grads *user, fhm_grads *g);
/* After the engine: the reductions (collective), then frees. */
fh_status fhm_grads_finish(fh_mpi_layout *L, fh_context *ctx, fhm_grads *g);
/* Frees without reducing (a call that fails its agreement). */
void fhm_grads_free(fhm_grads *g);

#endif
