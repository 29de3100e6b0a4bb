/* The MPI module's internals. The heads (ce_head.h, grpo_head.h) and the engine do all the math; this
 * module only moves their inputs and outputs between ranks. Files, bottom to top: comm.c (errors, sums,
 * splits), stats_reduce.c (per-token statistics across the vocab communicator), grid.c (the
 * fh_mpi_layout object: communicators, shard, parameters, scratch), grads_reduce.c (gradient reductions),
 * call.c (what every entry point shares), ce_mpi.c, logprob_mpi.c, grpo_mpi.c and kto_mpi.c (the entry points). */
#ifndef FH_MPI_INTERNAL_H
#define FH_MPI_INTERNAL_H

#include "fusedhead_mpi.h"

#include "engine/engine.h"
#include "group.h"

#define FH_MPI_PARAM_COUNT 3

/* The public fh_mpi_layout: a grid of vocab x data communicators and this rank's vocabulary shard. */
struct fh_mpi_layout {
    MPI_Comm vocab_comm, data_comm; /* our duplicates (MPI_COMM_SELF duplicates when absent) */
    fh_group vocab, data;           /* the collectives over them (group.h); every file but comm.c and grid.c uses these */
    int vocab_rank, vocab_ranks, data_rank, data_ranks;
    int64_t vocab_offset, local_vocab, total_vocab;
    int params[FH_MPI_PARAM_COUNT]; /* indexed by fh_mpi_param */
    void *scratch;                  /* per-call scratch, grown on demand */
    size_t scratch_bytes;
};

/* ---- comm.c ---------------------------------------------------------------------------------- */

/* The group of the ranks of *comm (group.h), its collectives MPI's; comm must outlive it. */
void fhm_group_over(MPI_Comm *comm, fh_group *group);

/* FH_ERR_MPI with the group's description of code, for a failed collective (code != 0). */
fh_status fhm_group_error(fh_context *ctx, const fh_group *group, int code, const char *what);

/* Sums n doubles over a group in place (nothing to do with one rank). */
fh_status fhm_sum(fh_context *ctx, const fh_group *group, double *values, int64_t n);
/* The same with element-wise maxima. */
fh_status fhm_max(fh_context *ctx, const fh_group *group, double *values, int64_t n);

/* Part r of count items split in parts contiguous blocks whose sizes differ by at most one. */
void fhm_split(int64_t count, int parts, int r, int64_t *first, int64_t *size);

/* ---- stats_reduce.c -------------------------------------------------------------------------- */

/* Fields of a packed statistics record. */
enum { FHM_LSE, FHM_MAX, FHM_Z_TARGET, FHM_SUM_WZ, FHM_SUM_PZ, FHM_ARGMAX, FHM_TARGET_WEIGHT, FHM_RECORD };

/* Combines per-token statistics over the vocab communicator (nothing to do with one rank). In: this
 * shard's stats as fh_engine_forward (or the row-block pass, to its block hook) leaves them (argmax a
 * shard index; sum_exp still the shard's sum of exps), extra optional: extra[0..n) values to sum (a
 * target's class weight on the rank that holds it) and extra[n] one more summed scalar. Out: the whole
 * vocabulary's lse, z_target, sum_weighted_z, sum_pz, argmax (global index), and the sums in extra.
 * records: scratch of fhm_combine_bytes(L, n). */
size_t fhm_combine_bytes(const fh_mpi_layout *L, int64_t n);
fh_status fhm_combine_stats(fh_mpi_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *stats,
                            double *extra, void *records);

/* ---- grid.c ---------------------------------------------------------------------------------- */

/* Checks that a call's lin is this rank's shard and that n fits MPI's int counts. Local. */
fh_status fhm_check_shard(const fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin);

/* At least bytes of per-call scratch (64-byte aligned), owned by the layout. */
fh_status fhm_scratch(fh_mpi_layout *L, fh_context *ctx, size_t bytes, void **p);

/* Targets local to this rank's shard: t - offset inside it, -1 elsewhere (and where ignored, when
 * ignore is not NULL). */
void fhm_local_targets(const fh_mpi_layout *L, const int64_t *targets, int64_t n, const int64_t *ignore,
                       int64_t *local);

/* ---- grads_reduce.c -------------------------------------------------------------------------- */

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
    /* bf16 gradients that a reduction sums are reduced in fp32 staging buffers (user then points at them, beta
     * 0) and rounded once into the caller's (target) at the end, its beta adding the old value in f32. */
    fh_linear_grads target;
    float *stage[3]; /* dx (dx_rows x hidden), dweight (the weight's strides), dbias; NULL: not staged */
} fhm_grads;

/* Checks the caller's gradients for the layout's reductions and allocates what the reductions need.
 * Local; on error nothing is allocated. */
fh_status fhm_grads_begin(const fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin,
                          const fh_linear_grads *user, fhm_grads *g);
/* After the engine: the reductions (collective), then frees. */
fh_status fhm_grads_finish(fh_mpi_layout *L, fh_context *ctx, fhm_grads *g);
/* Frees without reducing (a call that fails). Safe on a zeroed or already freed fhm_grads. */
void fhm_grads_free(fhm_grads *g);

/* ---- call.c ---------------------------------------------------------------------------------- */

/* What every fh_mpi_* call shares. A call runs: fhm_call_start, the head's local checks,
 * fhm_call_scratch, (fhm_grads_begin on g), planning, fhm_call_prepare; then fhm_call_agree, which every
 * rank reaches whatever failed locally; then the passes; a backward call ends in fhm_call_finish. */
/* What every rank of a call must agree on, as named values, compared by fhm_call_agree on their exact encodings (a
 * real's bits: -0.0 is not 0.0, NaNs of other payloads differ): the entry point, shapes, dtypes, options, which
 * gradients are asked for, the layout's reductions. */
#define FHM_CONFIG_MAX 32
enum { FHM_INTEGER, FHM_DOUBLE, FHM_FLOAT }; /* how a value's bits are shown in a message */
typedef struct fhm_config {
    int count;
    const char *names[FHM_CONFIG_MAX];
    uint64_t bits[FHM_CONFIG_MAX];
    unsigned char kind[FHM_CONFIG_MAX];
    unsigned char vocab_only[FHM_CONFIG_MAX]; /* compared across the vocab communicator only */
} fhm_config;

/* The entry points, as the configuration names them. */
enum {
    FHM_CE_FORWARD,
    FHM_CE_BACKWARD,
    FHM_CE_TRAIN_STEP,
    FHM_GRPO_FORWARD,
    FHM_GRPO_BACKWARD,
    FHM_GRPO_TRAIN_STEP,
    FHM_LOGPROB_FORWARD,
    FHM_LOGPROB_BACKWARD,
    FHM_LOGPROB_TRAIN_STEP,
    FHM_KTO_FORWARD,
    FHM_KTO_TRAIN_STEP
};

/* The head's engine pass over plan and ws, on the call's lin and engine ids, without gradients (head: the head's
 * own call, which holds its fhm_call). */
typedef fh_engine_pass (*fhm_pass_fn)(const void *head, const fh_plan *plan, const fh_workspace *ws);

typedef struct fhm_call {
    fh_mpi_layout *L;          /* NULL when the caller passed a NULL layout */
    fh_context *ctx;
    const fh_linear *lin;
    const int64_t *engine_ids; /* shard-local with vocab parallelism (fhm_call_shard_ids), else the caller's */
    int64_t *local;            /* [n] scratch for the shard-local ids */
    void *head_scratch;        /* the head's share of the scratch */
    void *records;             /* fhm_combine_bytes(L, n) of scratch */
    fhm_grads g;               /* the gradients' reductions (backward calls) */
    fhm_config config;         /* filled before fhm_call_agree */
    fhm_pass_fn pass;          /* the head's pass, and its call */
    const void *head;
} fhm_call;

/* Adds a value to the call's configuration (fhm_config). */
void fhm_call_config(fhm_call *c, const char *name, int64_t value);
void fhm_call_config_real(fhm_call *c, const char *name, double value);
void fhm_call_config_float(fhm_call *c, const char *name, float value);
/* A shape that the ranks of a vocab communicator share (they hold the same tokens) and data ranks need not. */
void fhm_call_config_vocab(fhm_call *c, const char *name, int64_t value);
/* Which gradients the call asks for, and their dtypes. */
void fhm_call_config_grads(fhm_call *c, const fh_linear_grads *grads);

/* FH_ERR_NULL_POINTER when ctx or L is NULL, else FH_OK. With a NULL ctx (and a layout) the call still joins the
 * agreement, so that every rank returns an error; with a NULL L no collective runs (it names the communicators). `entry` names the entry point, the first value of the configuration, which then
 * holds the layout's reductions and lin's hidden size, vocabulary, dtypes and bias. */
fh_status fhm_call_start(fhm_call *c, fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin, int entry,
                         fhm_pass_fn pass, const void *head);

/* After the head's checks: the shard check, then the per-call scratch with head_bytes for the head; the
 * engine's ids are the caller's ids until fhm_call_shard_ids. Local. */
fh_status fhm_call_scratch(fhm_call *c, const int64_t *ids, size_t head_bytes);

/* Local, before fhm_call_agree: the engine GEMMs of the head's passes over plans[k] and ws[k] made ready
 * (fh_engine_prepare), the last with the gradients grads (or none), so that a GEMM provider's failure (bf16: oneDNN
 * out of memory) is agreed on like any other error and no rank's pass fails once the collectives have started.
 * Returns st when it is an error. */
fh_status fhm_call_prepare(fhm_call *c, fh_status st, const fh_plan *plans, const fh_workspace *ws, int count,
                           const fh_linear_grads *grads);

/* Collective over the grid: every rank learns whether any rank failed. Returns st when it is an error,
 * else the largest error of the other ranks (with a message saying so), else FH_ERR_MPI_LAYOUT when n
 * differs across the vocab communicator, else FH_OK. On failure the gradient buffers are freed. */
fh_status fhm_call_agree(fhm_call *c, fh_status st);

/* The single-call step's schedule, collective over the grid whatever the local status. row_blocks: whether
 * this rank planned row blocks (plans[0], when st is FH_OK). The ranks agree on the smallest height over the
 * vocab communicator (its ranks must walk the same blocks: one statistics all-reduce each), or on streaming
 * everywhere when any rank of the grid cannot (the streaming schedule makes other data collectives); then the
 * workspace (plans[0] lowered to that height, or plans[0..1] the streaming passes), fhm_call_prepare with the
 * call's engine gradients, and fhm_call_agree. *rows: the agreed height, 0 for streaming. */
fh_status fhm_call_schedule(fhm_call *c, fh_status st, int row_blocks, fh_plan plans[2], fh_workspace ws[2],
                            int64_t *rows);

/* A row block's shard statistics become the whole vocabulary's: one all-reduce over the vocab communicator when the
 * vocabulary is split. */
fh_status fhm_call_combine_block(const fhm_call *c, int64_t rows, const fh_token_stats *stats);

/* After agreement: the engine's ids become shard-local when the vocabulary is split (ignore: the id
 * that is never local, or NULL). */
void fhm_call_shard_ids(fhm_call *c, const int64_t *ids, const int64_t *ignore);

/* The end of a backward call: the gradient reductions when st is FH_OK, else only the frees. */
fh_status fhm_call_finish(fhm_call *c, fh_status st);

#endif
