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
    void *scratch;         /* count x scratch_row_bytes for the head's per-row arrays (malloc's alignment; int64 ones
                              first) */
} fh_counted_rows;

/* Compacts lin and grads to the rows whose target is not ignore_index when some row is ignored, some counts, the
 * library manages the context's workspace (a caller's workspace is all a call may use) and, for a call whose
 * gradients gradient filtering would thin (filtered), filtering is off (it decides per tile of rows what to skip);
 * else leaves c inactive. With
 * scratch_row_bytes, c->scratch holds that many bytes per counted row for the head's compacted per-row arrays.
 * FH_ERR_OUT_OF_MEMORY (on ctx) leaves nothing allocated. */
fh_status fh_counted_rows_begin(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                const int64_t *targets, int64_t ignore_index, int filtered, size_t scratch_row_bytes,
                                fh_counted_rows *c);

/* counted[k] = all[rows[k]] for per-row values of elem bytes. */
void fh_counted_rows_gather(const fh_counted_rows *c, const void *all, size_t elem, void *counted);
/* all[rows[k]] = counted[k], and *fill in every other row. */
void fh_counted_rows_scatter(const fh_counted_rows *c, const void *counted, size_t elem, const void *fill, void *all);

/* Frees what begin allocated (safe on an inactive c). */
void fh_counted_rows_free(fh_counted_rows *c);

/* The most per-row float arrays a counted call has (inputs and outputs together). */
#define FH_COUNTED_ARRAYS 8

/* What a head gives the counted-rows driver: its problem, its per-row arrays, and its call. */
typedef struct fh_counted_call {
    const fh_linear *lin;         /* the head's linear (a distillation's student), whose rows are compacted */
    const fh_linear_grads *grads; /* or NULL */
    const int64_t *targets;       /* NULL: every row counts */
    int64_t ignore_index;
    int filtered;                 /* gradient filtering may thin grads (fh_counted_rows_begin) */
    const float *const *in;       /* the call's per-row inputs (NULL entries: not given), gathered */
    int inputs;
    float *const *out;            /* its per-row outputs, written by the call, 0 in the rows that do not count */
    int outputs;
    size_t extra_row_bytes;       /* more scratch per counted row for the head's own compacted arrays */
    /* The head's call: on the whole problem (rows NULL), or on the compacted one: rows->lin and rows->grads, the
     * compacted targets, arrays[k] for in[k] then out[k - inputs] (NULL where those are), and extra_row_bytes per
     * counted row at extra (after the float arrays: 8-byte aligned when inputs + outputs is even). */
    fh_status (*run)(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                     float *const *arrays, void *extra);
    const void *self;
} fh_counted_call;

/* Runs call->run on the counted rows when fh_counted_rows_begin compacts them, else on the whole problem; after a
 * compacted call that succeeded, its outputs and its dx rows go back to the caller's (grads' beta and dtype
 * honoured; the other rows 0 with beta 0, untouched with beta 1). */
fh_status fh_counted_rows_run(fh_context *ctx, const fh_counted_call *call);

#endif
