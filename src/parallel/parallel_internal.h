/* The parallel heads' internals (include/fusedhead_parallel.h). The heads (ce_head.h, grpo_head.h) and the engine
 * do all the math; this layer only moves their inputs and outputs between ranks, through the caller's collectives.
 * Files, bottom to top: collectives.c (errors, sums, maxima, splits over a group), stats_reduce.c (per-token
 * statistics across the vocab group), layout.c (the fh_parallel_layout object: groups, shard, parameters, scratch),
 * grads_reduce.c (gradient reductions), call.c (what every entry point shares), ce.c, logprob.c, logprob_support.c,
 * grpo.c and kto.c (the entry points). */
#ifndef FH_PARALLEL_INTERNAL_H
#define FH_PARALLEL_INTERNAL_H

#include "fusedhead_parallel.h"

#include "engine/engine.h"

#define FH_PARALLEL_PARAM_COUNT 3

/* The public fh_parallel_layout: a grid of vocab x data groups and this rank's vocabulary shard. */
struct fh_parallel_layout {
    fh_collectives vocab, data; /* the caller's (owned: released at destroy), or one-rank groups */
    int vocab_rank, vocab_ranks, data_rank, data_ranks;
    int64_t vocab_offset, local_vocab, total_vocab;
    int params[FH_PARALLEL_PARAM_COUNT]; /* indexed by fh_parallel_param */
    void *scratch;                       /* per-call scratch, grown on demand */
    size_t scratch_bytes;
};

/* ---- collectives.c --------------------------------------------------------------------------- */

/* A group of one rank: every collective leaves the data as it is (an all-gather copies). */
void fhp_one_rank(fh_collectives *group);

/* group->reduce_scatter, or an all-reduce of the whole buffer and a copy of this rank's block when it has none. */
int fhp_reduce_scatter(const fh_collectives *group, float *buffer, float *receive, const int64_t *counts);

/* FH_ERR_MPI with the group's description of code, for a failed collective (code != 0). */
fh_status fhp_group_error(fh_context *ctx, const fh_collectives *group, int code, const char *what);

/* Sums n doubles over a group in place (nothing to do with one rank). */
fh_status fhp_sum(fh_context *ctx, const fh_collectives *group, double *values, int64_t n);
/* The same with element-wise maxima. */
fh_status fhp_max(fh_context *ctx, const fh_collectives *group, double *values, int64_t n);

/* Part r of count items split in parts contiguous blocks whose sizes differ by at most one. */
void fhp_split(int64_t count, int parts, int r, int64_t *first, int64_t *size);

/* ---- stats_reduce.c -------------------------------------------------------------------------- */

/* Fields of a packed statistics record. */
enum { FHP_LSE, FHP_MAX, FHP_Z_TARGET, FHP_SUM_WZ, FHP_SUM_PZ, FHP_ARGMAX, FHP_TARGET_WEIGHT, FHP_RECORD };

/* Combines per-token statistics over the vocab group (nothing to do with one rank). In: this
 * shard's stats as fh_engine_forward (or the row-block pass, to its block hook) leaves them (argmax a
 * shard index; sum_exp still the shard's sum of exps), extra optional: extra[0..n) values to sum (a
 * target's class weight on the rank that holds it) and extra[n] one more summed scalar. Out: the whole
 * vocabulary's lse, z_target, sum_weighted_z, sum_pz, argmax (global index), and the sums in extra.
 * records: scratch of fhp_combine_bytes(L, n). */
size_t fhp_combine_bytes(const fh_parallel_layout *L, int64_t n);
fh_status fhp_combine_stats(fh_parallel_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *stats,
                            double *extra, void *records);

/* ---- layout.c -------------------------------------------------------------------------------- */

/* Checks that a call's lin is this rank's shard and that n fits the collectives' int counts. Local. */
fh_status fhp_check_shard(const fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin);

/* At least bytes of per-call scratch (64-byte aligned), owned by the layout. */
fh_status fhp_scratch(fh_parallel_layout *L, fh_context *ctx, size_t bytes, void **p);

/* Targets local to this rank's shard: t - offset inside it, -1 elsewhere (and where ignored, when
 * ignore is not NULL). */
void fhp_local_targets(const fh_parallel_layout *L, const int64_t *targets, int64_t n, const int64_t *ignore,
                       int64_t *local);

/* ---- grads_reduce.c -------------------------------------------------------------------------- */

/* Gradient outputs as the engine writes them, and what must happen afterwards. */
typedef struct fhp_grads {
    fh_linear_grads user;    /* the caller's */
    fh_linear_grads engine;  /* what the engine writes into */
    int dx_mode, dw_mode;    /* effective fh_parallel_reduction (no reduction over a one-rank group) */
    int64_t n, hidden, vocab, w_stride_hidden, w_stride_vocab;
    int64_t dx_first, dx_rows;
    int64_t dw_first, dw_count;
    int dw_dense;
    float *dx_tmp, *dx_recv, *dw_saved, *dw_pack, *db_saved;
    /* bf16 gradients that a reduction sums are reduced in fp32 staging buffers (user then points at them, beta
     * 0) and rounded once into the caller's (target) at the end, its beta adding the old value in f32. */
    fh_linear_grads target;
    float *stage[3]; /* dx (dx_rows x hidden), dweight (the weight's strides), dbias; NULL: not staged */
} fhp_grads;

/* Checks the caller's gradients for the layout's reductions and allocates what the reductions need.
 * Local; on error nothing is allocated. */
fh_status fhp_grads_begin(const fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                          const fh_linear_grads *user, fhp_grads *g);
/* After the engine: the reductions (collective), then frees. */
fh_status fhp_grads_finish(fh_parallel_layout *L, fh_context *ctx, fhp_grads *g);
/* Frees without reducing (a call that fails). Safe on a zeroed or already freed fhp_grads. */
void fhp_grads_free(fhp_grads *g);

/* ---- call.c ---------------------------------------------------------------------------------- */

/* What every fh_parallel_* call shares. A call runs: fhp_call_start, the head's local checks,
 * fhp_call_scratch, (fhp_grads_begin on g), planning, fhp_call_prepare; then fhp_call_agree, which every
 * rank reaches whatever failed locally; then the passes; a backward call ends in fhp_call_finish. */
/* What every rank of a call must agree on, as named values, compared by fhp_call_agree on their exact encodings (a
 * real's bits: -0.0 is not 0.0, NaNs of other payloads differ): the entry point, shapes, dtypes, options, which
 * gradients are asked for, the layout's reductions. */
#define FHP_CONFIG_MAX 32
enum { FHP_INTEGER, FHP_DOUBLE, FHP_FLOAT }; /* how a value's bits are shown in a message */
typedef struct fhp_config {
    int count;
    const char *names[FHP_CONFIG_MAX];
    uint64_t bits[FHP_CONFIG_MAX];
    unsigned char kind[FHP_CONFIG_MAX];
    unsigned char vocab_only[FHP_CONFIG_MAX]; /* compared across the vocab group only */
} fhp_config;

/* The entry points, as the configuration names them. */
enum {
    FHP_CE_FORWARD,
    FHP_CE_BACKWARD,
    FHP_CE_TRAIN_STEP,
    FHP_GRPO_FORWARD,
    FHP_GRPO_BACKWARD,
    FHP_GRPO_TRAIN_STEP,
    FHP_LOGPROB_FORWARD,
    FHP_LOGPROB_BACKWARD,
    FHP_LOGPROB_TRAIN_STEP,
    FHP_KTO_FORWARD,
    FHP_KTO_TRAIN_STEP,
    FHP_LOGPROB_SUPPORT_FORWARD,
    FHP_LOGPROB_SUPPORT_BACKWARD,
    FHP_LOGPROB_SUPPORT_TRAIN_STEP
};

/* The head's engine pass over plan and ws, on the call's lin and engine ids, without gradients (head: the head's
 * own call, which holds its fhp_call). */
typedef fh_engine_pass (*fhp_pass_fn)(const void *head, const fh_plan *plan, const fh_workspace *ws);

typedef struct fhp_call {
    fh_parallel_layout *L;          /* NULL when the caller passed a NULL layout */
    fh_context *ctx;
    const fh_linear *lin;
    const int64_t *engine_ids; /* shard-local with vocab parallelism (fhp_call_shard_ids), else the caller's */
    int64_t *local;            /* [n] scratch for the shard-local ids */
    void *head_scratch;        /* the head's share of the scratch */
    void *records;             /* fhp_combine_bytes(L, n) of scratch */
    fhp_grads g;               /* the gradients' reductions (backward calls) */
    fhp_config config;         /* filled before fhp_call_agree */
    fhp_pass_fn pass;          /* the head's pass, and its call */
    const void *head;
} fhp_call;

/* Adds a value to the call's configuration (fhp_config). */
void fhp_call_config(fhp_call *c, const char *name, int64_t value);
void fhp_call_config_real(fhp_call *c, const char *name, double value);
void fhp_call_config_float(fhp_call *c, const char *name, float value);
/* A shape that the ranks of a vocab group share (they hold the same tokens) and data ranks need not. */
void fhp_call_config_vocab(fhp_call *c, const char *name, int64_t value);
/* Which gradients the call asks for, and their dtypes. */
void fhp_call_config_grads(fhp_call *c, const fh_linear_grads *grads);
/* The log-prob options the ranks must share (logprob.c; the support's calls too). */
void fhp_call_config_logprob(fhp_call *c, const fh_logprob_options *o);

/* FH_ERR_NULL_POINTER when ctx or L is NULL, else FH_OK. With a NULL ctx (and a layout) the call still joins the
 * agreement, so that every rank returns an error; with a NULL L no collective runs (it names the groups). `entry`
 * names the entry point, the first value of the configuration, which then holds the layout's reductions and lin's
 * hidden size, vocabulary, dtypes and bias. */
fh_status fhp_call_start(fhp_call *c, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin, int entry,
                         fhp_pass_fn pass, const void *head);

/* After the head's checks: the shard check, then the per-call scratch with head_bytes for the head; the
 * engine's ids are the caller's ids until fhp_call_shard_ids. Local. */
fh_status fhp_call_scratch(fhp_call *c, const int64_t *ids, size_t head_bytes);

/* Local, before fhp_call_agree: the engine GEMMs of the head's passes over plans[k] and ws[k] made ready
 * (fh_engine_prepare), the last with the gradients grads (or none), so that a GEMM provider's failure (bf16: oneDNN
 * out of memory) is agreed on like any other error and no rank's pass fails once the collectives have started.
 * Returns st when it is an error. */
fh_status fhp_call_prepare(fhp_call *c, fh_status st, const fh_plan *plans, const fh_workspace *ws, int count,
                           const fh_linear_grads *grads);

/* Collective over the grid: every rank learns whether any rank failed. Returns st when it is an error,
 * else the largest error of the other ranks (with a message saying so), else FH_ERR_MPI_LAYOUT when n
 * differs across the vocab group, else FH_OK. On failure the gradient buffers are freed. */
fh_status fhp_call_agree(fhp_call *c, fh_status st);

/* The single-call step's schedule, collective over the grid whatever the local status. row_blocks: whether
 * this rank planned row blocks (plans[0], when st is FH_OK). The ranks agree on the smallest height over the
 * vocab group (its ranks must walk the same blocks: one statistics all-reduce each), or on streaming
 * everywhere when any rank of the grid cannot (the streaming schedule makes other data collectives); then the
 * workspace (plans[0] lowered to that height, or plans[0..1] the streaming passes), fhp_call_prepare with the
 * call's engine gradients, and fhp_call_agree. *rows: the agreed height, 0 for streaming. */
fh_status fhp_call_schedule(fhp_call *c, fh_status st, int row_blocks, fh_plan plans[2], fh_workspace ws[2],
                            int64_t *rows);

/* A row block's shard statistics become the whole vocabulary's: one all-reduce over the vocab group when the
 * vocabulary is split. */
fh_status fhp_call_combine_block(const fhp_call *c, int64_t rows, const fh_token_stats *stats);

/* After agreement: the engine's ids become shard-local when the vocabulary is split (ignore: the id
 * that is never local, or NULL). */
void fhp_call_shard_ids(fhp_call *c, const int64_t *ids, const int64_t *ignore);

/* The end of a backward call: the gradient reductions when st is FH_OK, else only the frees. */
fh_status fhp_call_finish(fhp_call *c, fh_status st);

#endif
