/* The engine: streams vocabulary tiles of Z = transform(X W + bias) through the GEMM layer and either folds them into
 * per-token statistics (forward) or turns them into dU (the gradient with respect to X W + bias) from per-token
 * coefficients and accumulates the gradient GEMMs (backward); for a head over a few columns per row (a support), one
 * dot product per entry instead of tiles (columns.c). Heads never touch tiles; the engine knows no loss. */
#ifndef FH_ENGINE_H
#define FH_ENGINE_H

#include "plan/plan.h"
#include "kernels/row_kernels.h"

/* The logits as they are: no cap, scale 1 (fh_transform). */
#define FH_IDENTITY_TRANSFORM {.softcap = 0.0f, .inv_temperature = 1.0f}

/* s = softcap(logit_scale u) / temperature as the engine's transform: c tanh(m u / c) = m (c / m) tanh(u / (c / m)),
 * so the transform caps at c / m and scales by m / T (rounded once to fp32 each). Every head's transform is one of
 * these (cross-entropy's at temperature 1, GRPO's without softcap and scale) or the identity. */
fh_transform fh_engine_transform_of(double temperature, double softcap, double logit_scale);
/* The same after checking the three values are usable in fp32 (FH_ERR_INVALID_TEMPERATURE, FH_ERR_INVALID_SOFTCAP,
 * FH_ERR_INVALID_LOGIT_SCALE); tf is written on success. */
fh_status fh_engine_transform(fh_context *ctx, double temperature, double softcap, double logit_scale,
                              fh_transform *tf);

/* Per-token statistics of the transformed logits rows, as arrays of n; optional ones may be NULL. */
typedef struct fh_token_stats {
    double *lse;             /* log sum_j exp(z_j); holds the running max while fh_engine_forward streams */
    double *z_target;        /* z at targets[i] when 0 <= targets[i] < V (else 0) */
    double *sum_weighted_z;  /* optional: sum_j w_j z_j (w = class_weights, or 1) */
    double *sum_pz;          /* optional: sum_j p_j z_j, so that the entropy is lse - sum_pz; holds the
                                running sum of z exp(z - max) while fh_engine_forward streams */
    double *sum_exp;         /* sum_j exp(z_j - max): the running sum while streaming, kept after */
    int64_t *argmax;         /* optional: lowest index of the largest z */
} fh_token_stats;

/* One row's final statistics, as a head sees them. */
typedef struct fh_final_stats {
    double lse, z_target, sum_weighted_z, sum_pz;
} fh_final_stats;

/* Every row's backward coefficients (fh_coef), as arrays of n; e and sum_pz may be NULL (e = 0). */
typedef struct fh_coef_arrays {
    const double *lse;
    const double *a;
    const double *b;
    const double *c;
    const double *e;
    const double *sum_pz;
} fh_coef_arrays;

/* Rows that a train step's row block keeps together (a sequence, a preference pair): group g is rows
 * first(g) .. first(g + 1) - 1, where first(g) = starts[g] (packed sequences of their own lengths), or g * rows when
 * starts is NULL. Paired: 2 count groups, and group g goes with group count + g (a pair's chosen and rejected
 * sequences), so a block holds the same groups of both halves, as two segments. */
typedef struct fh_row_groups {
    int64_t count;         /* groups (pairs when paired) */
    int64_t rows;          /* each group's rows when starts is NULL */
    const int64_t *starts; /* [count + 1], or [2 count + 1] when paired: non-decreasing, starts[0] = 0, the last n */
    int paired;
} fh_row_groups;

static inline int64_t fh_group_first(const fh_row_groups *g, int64_t group)
{
    return g->starts ? g->starts[group] : group * g->rows;
}

/* The groups a row block holds (fh_coef_source.block): groups first_group .. end_group - 1 (of each half when
 * paired), whose rows (the first half's) are first_row .. first_row + rows - 1; without groups, 0 and 0. */
typedef struct fh_row_block {
    int64_t first_row, rows;
    int64_t first_group, end_group;
} fh_row_block;

/* Supplies a row's backward coefficients once its statistics are final (single-call train step). row is
 * called concurrently for different rows: it may only write row i's results. block, optional, is called
 * once per row block, on the calling thread, after every row of the block is folded and before any row's
 * coefficients: stats views the block's rows (arrays start at its first row) as fh_engine_forward leaves them
 * (lse, sum_pz final over lin's columns, sum_exp the sum of exps), and block may replace them, e.g. with
 * statistics combined across vocabulary shards, or compute what the rows' coefficients need from the whole block
 * (a sequence's mean); a status other than FH_OK stops the pass. */
typedef struct fh_coef_source {
    void (*row)(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *coef);
    fh_status (*block)(const void *self, const fh_row_block *block, const fh_token_stats *stats);
    const void *self;
} fh_coef_source;

/* A second linear head over the same rows and vocabulary (a distillation teacher): the engine computes its logits
 * tile beside lin's (its bias added, no transform), and the head's kernels, which see both rows, take the place of
 * the statistics fold and of the coefficient form. Every function is called concurrently for different rows and
 * may only touch row i's state. A head may run its own kernels over lin's tile alone: companion NULL (cz NULL). */
typedef struct fh_pair_kernels {
    const fh_linear *companion; /* n and vocab as lin's, or NULL */
    int passes;                 /* forward passes over every row (a statistic that needs another's final value) */
    /* Folds columns first_column .. first_column + count - 1 of row i (z: lin's transformed logits, cz: the
     * companion's) in forward pass `pass`. */
    void (*fold)(const void *self, int pass, int64_t i, const float *z, const float *cz, int64_t count,
                 int64_t first_column);
    /* Ends forward pass `pass` of row i, once each of its columns is folded. */
    void (*finish)(const void *self, int pass, int64_t i);
    /* Overwrites z (row i's columns first_column..) with dU, once every pass is finished. */
    void (*gradient)(const void *self, int64_t i, float *z, const float *cz, int64_t count, int64_t first_column);
    const void *self;
} fh_pair_kernels;

/* One pass of the engine: the plan (tiles, threads) and its workspace, what the logits are made of, and
 * what the pass reads or writes. Each function below names the fields it uses. */
typedef struct fh_engine_pass {
    const fh_plan *plan;
    const fh_workspace *ws;
    const fh_linear *lin;
    fh_transform tf;
    const int64_t *targets;       /* z_target's and b's column per row; outside [0, V): none */
    const float *class_weights;   /* w of sum_weighted_z and of the c term, or NULL (all 1) */
    const fh_token_stats *stats;  /* forward, row blocks: written */
    const fh_coef_arrays *coefs;  /* backward */
    const fh_coef_source *source; /* row blocks */
    const fh_linear_grads *grads; /* backward, row blocks */
    const fh_row_groups *groups;  /* row blocks: NULL, or the groups each block holds whole */
    const fh_pair_kernels *pair;  /* or NULL; with a pair the plan is a pair plan (fh_plan_pair_*), stats, coefs
                                     and source are unused, the passes walk both heads' tiles, and
                                     fh_engine_forward runs every pass of the pair's kernels */
    /* Kept logits (no pair): rows of lin->vocab floats, x W before bias and transform, row kept_rows[i] (NULL: i)
     * for lin's row i. fh_engine_forward stores each tile's there (keep); fh_engine_backward reads its tiles from
     * there (kept) instead of recomputing them: two GEMMs instead of three. */
    float *keep;
    const float *kept;
    const int64_t *kept_rows;
} fh_engine_pass;

/* Every pass makes its GEMMs ready first (fh_gemm_prepare), so that it fails, if it does (FH_ERR_OUT_OF_MEMORY or
 * FH_ERR_GEMM_FAILED from the bf16 provider), before it writes any output. A caller that runs a forward and then a backward
 * pass with the same plan calls this with the backward's pass (grads set) before the forward. */
fh_status fh_engine_prepare(const fh_engine_pass *p);

/* Fills p->stats. */
fh_status fh_engine_forward(const fh_engine_pass *p);

/* Accumulates p->grads from p->coefs. */
fh_status fh_engine_backward(const fh_engine_pass *p);

/* z_target[i] = row i's transformed logit at its target (0 where targets[i] is outside [0, V)), each from one dot
 * product of x's row and the weight's column in double, rounded to fp32 as the GEMM's logit is, then transformed
 * like a tile (2 N H flops, no tile): for a backward that needs the target's probability before its first tile.
 * Uses plan (threads), lin, tf and targets. */
void fh_engine_target_logits(const fh_engine_pass *p, double *z_target);

/* Single-call train step over row blocks of at most plan->tile_rows x V (a row-block plan of fh_plan_train_step;
 * with groups, as many whole groups as a block holds, each group fitting one; paired, a segment in each half):
 * fills p->stats like fh_engine_forward and accumulates p->grads like fh_engine_backward, with the
 * coefficients from p->source. Returns FH_OK, or the first failure of p->source->block: the pass stops at
 * that block (earlier blocks' dx and dweight are written, dbias is not; a dweight whose memory the plan uses for
 * the logits block and dU chunks holds those). */
fh_status fh_engine_row_blocks(const fh_engine_pass *p);

/* A head's part of the single-call train step (fh_engine_train_step). */
typedef struct fh_train_step_head {
    int64_t group_rows;         /* rows a row block keeps together (a sequence, a preference pair); 1: any */
    const fh_row_groups *groups; /* or groups of their own lengths (packed sequences): group_rows is then unread */
    const fh_linear *companion; /* the second head of a pair (fh_pair_kernels), or NULL */
    size_t head_row_bytes;      /* with a companion: the head's own per-row state (fh_plan_pair_train_step) */
    int forward_plan;           /* the streaming fallback runs its forward on a plan of its own (fh_plan_streaming)
                                   rather than on the backward's */
    int streaming_only;         /* the streaming passes whatever the budget (coefficients that need every row's
                                   statistics first); needs forward_plan */
    /* The step itself, on the plans and workspaces made for it: with row_blocks, one pass over row blocks on
     * plans[0] and ws[0]; else the streaming fallback, the forward on plans[0] and ws[0], the backward on plans[1] and
     * ws[1] (the same plan and workspace without forward_plan). A GEMM failure it returns is reported on ctx. */
    fh_status (*run)(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                     const fh_linear_grads *grads);
    const void *self;
} fh_train_step_head;

/* The choreography every head's single-call train step shares, once its checks have passed: the train step's plan
 * (row blocks of whole groups, with a companion's tile, or the streaming fallback), the workspace, then head->run. */
fh_status fh_engine_train_step(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                               const fh_train_step_head *head);

/* A per-token head's calls, by kind (fh_call): the streaming forward and backward, each on the plan and workspace
 * made for it (fh_prepare_pass), and the single-call train step's run (fh_train_step_head's, rows in any grouping).
 * Each returns what its passes return. */
typedef struct fh_head_calls {
    fh_status (*forward)(const void *self, const fh_plan *plan, const fh_workspace *ws);
    fh_status (*backward)(const void *self, const fh_plan *plan, const fh_workspace *ws);
    fh_status (*step)(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                      const fh_linear_grads *grads);
} fh_head_calls;

/* Runs the call of kind on lin, the backward and the train step with grads; a GEMM failure is reported on ctx. */
fh_status fh_engine_run_call(fh_context *ctx, fh_call kind, const fh_head_calls *calls, const fh_linear *lin,
                             const fh_linear_grads *grads, const void *self);

/* ---- A head over a few columns per row (columns.c): no tile, one dot product per entry ---- */

/* Row i's entries are e in [begin[i], begin[i + 1]), entry e naming the vocabulary column ids[e] in [0, V). */
typedef struct fh_row_columns {
    const int64_t *begin; /* [n + 1], begin[0] = 0 */
    const int64_t *ids;   /* [begin[n]] */
} fh_row_columns;

/* The floats of scratch the two functions below take (8-byte aligned) for this many entries on threads. */
size_t fh_engine_column_scratch_floats(const fh_linear *lin, int64_t entries, int threads);

/* z[e] = transform(x_i . W[:, ids[e]] + bias[ids[e]]) for every entry e of every row i: the dot product summed in fp32
 * as a GEMM's, then biased and transformed by the row kernels as a tile's logits are. */
void fh_engine_column_logits(const fh_linear *lin, const fh_row_columns *c, fh_transform tf, int threads,
                             float *scratch, float *z);

/* The gradients from du (the loss's gradient with respect to each entry's x W + bias): dx row i = sum over its
 * entries of du[e] W[:, ids[e]] (every row written: rows without entries 0 or, with beta 1, unchanged); dweight's
 * column j = sum over the entries naming j of du[e] x[row of e], dbias[j] their du's sum; betas and dtypes as
 * fh_linear_grads says, each value rounded once. A dweight or dbias of beta 0 is written whole (0 where no entry names
 * a column). */
void fh_engine_column_gradients(const fh_linear *lin, const fh_row_columns *c, const float *du,
                                const fh_linear_grads *grads, int threads, float *scratch);

#endif
