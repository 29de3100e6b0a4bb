/* Elementwise work on one row of a logits tile. Tile rows are independent, so callers thread over
 * rows; every function is deterministic for a given row. */
#ifndef FH_TILE_KERNELS_H
#define FH_TILE_KERNELS_H

#include "engine.h"

/* Running statistics of one token across tiles. */
typedef struct fh_row_state {
    double max;
    double sum_exp;        /* sum of exp(z - max) */
    double z_target;
    double sum_weighted_z;
    int64_t argmax;
} fh_row_state;

/* Chooses the implementation (AVX-512 or portable) once; call before threads use the kernels. */
void fh_row_kernels_select(void);
/* "avx512" or "portable". */
const char *fh_row_kernels_name(void);

/* z[j] = transform(z[j] + bias[j]) for j < count; bias may be NULL. */
void fh_row_transform(float *z, int64_t count, const float *bias, const fh_transform *tf);

/* Folds count transformed logits (vocabulary columns first_column..) into state. target_column is
 * relative to the row (outside [0, count) when the target is not in this tile). weights may be NULL
 * (all 1); sum_weighted_z is only updated when want_weighted_sum. */
void fh_row_fold(const float *z, int64_t count, int64_t first_column, int64_t target_column,
                 const float *weights, int want_weighted_sum, fh_row_state *state);

/* Overwrites transformed logits z with dU = (a p + c w + b [j = target]) * dz/du, p = exp(z - lse).
 * (The target's b term is added after the loop: (x + b) d and x d + b d differ only in rounding.) */
void fh_row_gradient(float *z, int64_t count, int64_t target_column, const float *weights, double lse,
                     double a, double b, double c, const fh_transform *tf);

#endif
