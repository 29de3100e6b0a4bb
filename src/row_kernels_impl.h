/* The implementations behind row_kernels.h: portable C and AVX-512 (chosen once at run time), and the
 * scalar helpers both share. */
#ifndef FH_ROW_KERNELS_IMPL_H
#define FH_ROW_KERNELS_IMPL_H

#include "row_kernels.h"

/* Merges a tile's maximum, its argmax (absolute column), sum of exp(z - tile_max) and sum of
 * z exp(z - tile_max) into state. */
void fh_row_merge(fh_fold_state *state, float tile_max, int64_t tile_argmax, double tile_sum, double tile_sum_z);

/* dz/du of the transform at transformed value z. */
float fh_dz_du(float z, const fh_transform *tf);

void fh_row_transform_portable(float *z, int64_t count, const float *bias, const fh_transform *tf);
void fh_row_fold_portable(float *z, int64_t count, int64_t first_column, int64_t target_column,
                        const fh_fold_request *request, fh_fold_state *state);
void fh_row_gradient_portable(float *z, int64_t count, int64_t target_column, const float *weights,
                              const fh_coef *coef, const fh_transform *tf, fh_row_marking *marking);

void fh_row_pair_max_portable(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz);
void fh_row_exp_sums_portable(const float *a, const float *b, int64_t count, float scale, float shift,
                              double sums[2]);
void fh_row_jsd_sums_portable(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[2]);
void fh_row_pair_gradient_portable(float *z, const float *cz, int64_t count, const fh_pair_row *r);
void fh_row_to_bf16_portable(const void *src, int64_t count, void *dst);
double fh_row_compact_portable(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                               const float *weights, const float *next);
void fh_row_add_columns_portable(double *sums, int64_t count, const void *w, int bf16, int64_t stride,
                                 const double *factors, int64_t columns);

#ifdef FH_HAVE_AVX512_KERNELS
void fh_row_transform_avx512(float *z, int64_t count, const float *bias, const fh_transform *tf);
void fh_row_fold_avx512(float *z, int64_t count, int64_t first_column, int64_t target_column,
                        const fh_fold_request *request, fh_fold_state *state);
void fh_row_gradient_avx512(float *z, int64_t count, int64_t target_column, const float *weights,
                            const fh_coef *coef, const fh_transform *tf, fh_row_marking *marking);
void fh_row_pair_max_avx512(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz);
void fh_row_exp_sums_avx512(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2]);
void fh_row_jsd_sums_avx512(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[2]);
void fh_row_pair_gradient_avx512(float *z, const float *cz, int64_t count, const fh_pair_row *r);
void fh_row_to_bf16_avx512(const void *src, int64_t count, void *dst);
double fh_row_compact_avx512(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                             const float *weights, const float *next);
void fh_row_add_columns_avx512(double *sums, int64_t count, const void *w, int bf16, int64_t stride,
                               const double *factors, int64_t columns);
#endif

#endif
