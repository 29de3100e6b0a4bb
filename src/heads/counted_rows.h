/* The rows that count. A head whose ignored rows contribute nothing (no loss term, no gradient, an output of 0) runs
 * its GEMMs on the other rows only: they are gathered into a compacted problem (lin's counted rows copied into a dense
 * x, their dx computed into dense fp32 rows and scattered back: 0 in the other rows with beta 0, untouched with beta
 * 1), so that masked prompts cost nothing. Every per-row result (a token's loss, log-prob, lse, its dx row) is bit
 * for bit the whole problem's: a row's logits and dx do not depend on the other rows. dweight and dbias sum the same
 * terms without the zeros, grouped by the GEMMs' blocking over fewer rows: equal up to fp32 summation order. */
#ifndef FH_COUNTED_ROWS_H
#define FH_COUNTED_ROWS_H

#include "core/context.h"

typedef struct fh_counted_rows {
    int active;            /* 0: run the call as it is (every row counts, none does, or compaction does not apply) */
    int64_t n, count;      /* rows of the whole problem, rows that count */
    int64_t *rows;         /* [count] the counted rows, ascending */
    void *x;               /* [count, H] their hidden states, in lin's x dtype */
    float *dx;             /* [count, H] their dx in fp32, or NULL */
    fh_linear lin;         /* the compacted problem: lin over x */
    fh_linear_grads grads; /* the caller's gradients, dx replaced by the dense rows */
    void *scratch;         /* the head's per-row arrays for the counted rows (malloc's alignment; int64 ones first) */
    size_t held;           /* bytes held against the budget for all of these (fh_budget_hold) */
} fh_counted_rows;

/* lin's counted rows (c's rows) copied into x, dense (fh_counted_rows_x_row_bytes each): lin over them. */
fh_linear fh_counted_rows_linear(const fh_counted_rows *c, const fh_linear *lin, void *x);
size_t fh_counted_rows_x_row_bytes(const fh_linear *lin);

/* counted[k] = all[rows[k]] for per-row values of elem bytes. */
void fh_counted_rows_gather(const fh_counted_rows *c, const void *all, size_t elem, void *counted);
/* all[rows[k]] = counted[k], and *fill in every other row. */
void fh_counted_rows_scatter(const fh_counted_rows *c, const void *counted, size_t elem, const void *fill, void *all);

/* The most per-row float arrays a counted call has (inputs and outputs together). */
#define FH_COUNTED_ARRAYS 8

/* What a head gives the counted-rows driver: its problem, its per-row arrays, and its call. */
typedef struct fh_counted_call {
    const fh_linear *lin;         /* the head's linear (a distillation's student), whose rows are compacted */
    const fh_linear_grads *grads; /* or NULL */
    const int64_t *targets;       /* NULL: every row counts */
    int64_t ignore_index;
    int filtered;                 /* gradient filtering may thin grads (then nothing is compacted) */
    const float *const *in;       /* the call's per-row inputs (NULL entries: not given), gathered */
    int inputs;
    float *const *out;            /* its per-row outputs, written by the call, 0 in the rows that do not count */
    int outputs;
    size_t extra_row_bytes;       /* more scratch per counted row for the head's own compacted arrays */
    /* The head's call on the whole problem, as self gives it. */
    fh_status (*whole)(fh_context *ctx, const void *self);
    /* The head's call on the compacted problem: rows->lin and rows->grads, the compacted targets, arrays[k] for in[k]
     * then out[k - inputs] (NULL where those are), and extra_row_bytes per counted row at extra (after the float
     * arrays: 8-byte aligned when inputs + outputs is even). */
    fh_status (*counted)(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                         float *const *arrays, void *extra);
    const void *self;
} fh_counted_call;

/* Runs call->counted on the counted rows when some row is ignored and some counts, else call->whole; after a
 * compacted call that succeeded, its outputs and its dx rows go back to the caller's (grads' beta and dtype
 * honoured; the other rows 0 with beta 0, untouched with beta 1). Not compacted: a caller's workspace (all that a
 * call may use), a filtered call with gradient filtering on (it decides per tile of rows what to skip), and copies
 * (the rows' x, fp32 dx, targets and per-row arrays, extra_row_bytes) over half the memory budget. The copies are
 * held against the budget (fh_budget_hold) so that they and the call's workspace stay within it; at most half of
 * it, so that the call's tiles and row blocks keep at least half their size (at most twice the blocks, each one
 * more pass over dweight, small against its GEMMs). A compacted call that the rest of the budget cannot hold
 * (FH_ERR_BUDGET_TOO_SMALL) runs again on the whole problem. FH_ERR_OUT_OF_MEMORY leaves nothing allocated. */
fh_status fh_counted_rows_run(fh_context *ctx, const fh_counted_call *call);

#endif
