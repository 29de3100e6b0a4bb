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

/* The compacted call's per-row float arrays, laid out in the scratch after the compacted targets (which this gathers
 * first): counted[k] is NULL where the call's array is, else count floats. The first `inputs` arrays are the call's
 * inputs (in[k]), gathered; the next `outputs` its outputs (out[k - inputs]), which the call writes. Returns the
 * compacted targets. */
int64_t *fh_counted_rows_arrays(const fh_counted_rows *c, const int64_t *targets, const float *const *in, int inputs,
                                float *const *out, int outputs, float **counted);
/* Each output array out[k] (not NULL) from counted[inputs + k], 0 in the rows that do not count. */
void fh_counted_rows_scatter_outputs(const fh_counted_rows *c, float *const *out, int inputs, int outputs,
                                     float *const *counted);

/* After the compacted call succeeded: its dx rows into the caller's dx (grads, as given to begin: its beta and dtype
 * honoured); the other rows 0 with beta 0, untouched with beta 1. */
void fh_counted_rows_write_dx(const fh_counted_rows *c, const fh_linear_grads *grads);
/* Frees what begin allocated (safe on an inactive c). */
void fh_counted_rows_free(fh_counted_rows *c);

#endif
