/* The row kernels of gradient filtering (engine/filter/): noting a row's large columns while its dU is formed
 * (fh_row_gradient's marking), compacting a row to its kept columns, and the weighted sum of the skipped weight
 * columns. Every set implements them beside the others (row_kernels_impl.h). */
#ifndef FH_FILTER_ROW_KERNELS_H
#define FH_FILTER_ROW_KERNELS_H

#include "row_kernels.h"

/* What gradient filtering notes of a row while fh_row_gradient forms its dU (the final values, target term
 * included): marks[j] = 1 where |dU_j| >= threshold (a non-negative float) or dU_j is a NaN, other marks left as they
 * are; with nu, over the other columns, m = dU_j - c w_j (w 1 without weights) in f32: nu[j] += |m|, and tail = the
 * sum of those m (in double): what the tail estimate needs of the softmax terms that filtering may skip. */
struct fh_row_marking {
    float threshold, c;
    uint8_t *marks;
    float *nu;   /* NULL: marks only */
    double tail; /* written */
};

/* Returns the sum, over the values v = z[columns[k]] (k < count, columns increasing) with |v| below threshold, of
 * v - c w[columns[k]] (w 1 without weights): the part of fh_row_marking's tail that the kept columns took (0 with
 * threshold 0). With move, also moves each v to z[k] (columns[k] >= k, so one forward pass does it in place); else
 * z is only read. next: the row to be compacted after this one, whose same columns are prefetched meanwhile, or
 * NULL. */
typedef double fh_row_compact_fn(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                                 const float *weights, const float *next);
fh_row_compact_fn fh_row_compact;

/* sums[k] += sum over j < columns of factors[j] w[j stride + k], in double, for k < count; columns whose factor is 0
 * are not read. w holds floats, or bf16 bits with bf16. A weighted sum of weight columns (a GEMV), whose sums stay in
 * registers while the columns stream past. */
typedef void fh_row_add_columns_fn(double *sums, int64_t count, const void *w, int bf16, int64_t stride,
                                   const double *factors, int64_t columns);
fh_row_add_columns_fn fh_row_add_columns;

#endif
