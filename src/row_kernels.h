/* Elementwise work on one row of a logits tile. Tile rows are independent, so callers thread over
 * rows; every function is deterministic for a given row. */
#ifndef FH_ROW_KERNELS_H
#define FH_ROW_KERNELS_H

#include <stdint.h>
#include <string.h>

/* Elementwise transform of the raw logits u: z = cap(u) * inv_temperature, cap(u) = c tanh(u / c)
 * when softcap c > 0, else u. */
typedef struct fh_transform {
    float softcap;
    float inv_temperature;
} fh_transform;

/* One row's backward coefficients: dZ_j = a p_j + b [j = y] + c w_j + e p_j (z_j - sum_pz), with
 * p = softmax(z) = exp(z - lse); then dU = dZ * dz/du. */
typedef struct fh_coef {
    double lse, a, b, c, e, sum_pz;
} fh_coef;

/* Running statistics of one token across tiles. */
typedef struct fh_fold_state {
    double max;
    double sum_exp;        /* sum of exp(z - max) */
    double z_target;
    double sum_weighted_z;
    double sum_z_exp;      /* sum of z exp(z - max), for sum_j p_j z_j */
    int64_t argmax;
} fh_fold_state;

/* What a fold accumulates besides max, sum of exps, target logit and argmax. */
typedef struct fh_fold_request {
    const float *weights;  /* class weights for sum_weighted_z, or NULL (all 1) */
    int weighted_sum;      /* update sum_weighted_z */
    int entropy;           /* update sum_z_exp */
} fh_fold_request;

/* A fresh state: max -inf, sums 0. */
fh_fold_state fh_fold_state_initial(void);

/* The implementation (AVX-512 or portable) is chosen once, at the first call of any function below. */

/* "avx512" or "portable". */
const char *fh_row_kernels_name(void);

/* z[j] = transform(z[j] + bias[j]) for j < count; bias may be NULL. */
void fh_row_transform(float *z, int64_t count, const float *bias, const fh_transform *tf);

/* Folds count transformed logits (vocabulary columns first_column..) into state. target_column is
 * relative to the row (outside [0, count) when the target is not in this tile). */
void fh_row_fold(const float *z, int64_t count, int64_t first_column, int64_t target_column,
                 const fh_fold_request *request, fh_fold_state *state);

/* Overwrites transformed logits z with dU = (a p + c w + e p (z - sum_pz) + b [j = target]) * dz/du,
 * p = exp(z - lse); weights may be NULL (all 1). (The target's b term is added after the loop:
 * (x + b) d and x d + b d differ only in rounding.) */
void fh_row_gradient(float *z, int64_t count, int64_t target_column, const float *weights,
                     const fh_coef *coef, const fh_transform *tf);

/* out[b] = max |z[j]| over the columns j of block b (blocks of `block` columns, the last one shorter), for every
 * block of the count columns; a NaN counts as larger than any number. */
void fh_row_block_max_abs(const float *z, int64_t count, int64_t block, float *out);

/* dst[j] = src[j] rounded to the nearest bf16 (ties to even; NaN stays NaN), for j < count. dst may be src's own
 * memory (a row narrowed in place into its first half). */
void fh_row_to_bf16(const void *src, int64_t count, void *dst);

/* dst[j] = src[j] (+ dst[j] when accumulate, added in f32) rounded once to bf16, for j < count. */
void fh_row_add_to_bf16(const float *src, int64_t count, int accumulate, uint16_t *dst);

/* The f32 value of bf16 bits (exact). */
static inline float fh_bf16_to_f32(uint16_t bits)
{
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

#endif
