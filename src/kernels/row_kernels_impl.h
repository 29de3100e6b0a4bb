/* The sets of row kernels behind row_kernels.h, and the scalar helpers they share. Each set's file defines one table
 * and nothing else that is visible outside it: row_kernels_portable.c (always), row_kernels_avx2.c
 * (FH_HAVE_AVX2_KERNELS: built with -mavx2 -mfma) and row_kernels_avx512.c (FH_HAVE_AVX512_KERNELS: -mavx512f
 * -mavx512dq -mfma). row_kernels.c chooses one at run time. A new kernel: its function type in row_kernels.h, a
 * field and an entry of FH_ROW_KERNEL_TABLE here, a static function of that name in each set's file, a wrapper in
 * row_kernels.c. */
#ifndef FH_ROW_KERNELS_IMPL_H
#define FH_ROW_KERNELS_IMPL_H

#include "filter_row_kernels.h"
#include "row_kernels.h"

typedef struct fh_row_kernel_set {
    const char *name; /* what fh_row_kernels_name returns while this set runs */
    fh_row_transform_fn *transform;
    fh_row_fold_fn *fold;
    fh_row_gradient_fn *gradient;
    fh_row_pair_max_fn *pair_max;
    fh_row_exp_sums_fn *exp_sums;
    fh_row_jsd_sums_fn *jsd_sums;
    fh_row_pair_gradient_fn *pair_gradient;
    fh_row_softmax_pair_fn *softmax_pair;
    fh_row_compact_fn *compact;
    fh_row_add_columns_fn *add_columns;
    fh_row_to_bf16_fn *to_bf16;
} fh_row_kernel_set;

/* A set's table, in the file that defines its kernels as static functions of these names. */
#define FH_ROW_KERNEL_TABLE(table, set_name)                                                                    \
    const fh_row_kernel_set table = {.name = set_name,                                                         \
                                     .transform = transform,                                                   \
                                     .fold = fold,                                                             \
                                     .gradient = gradient,                                                     \
                                     .pair_max = pair_max,                                                     \
                                     .exp_sums = exp_sums,                                                     \
                                     .jsd_sums = jsd_sums,                                                     \
                                     .pair_gradient = pair_gradient,                                           \
                                     .softmax_pair = softmax_pair,                                             \
                                     .compact = compact,                                                       \
                                     .add_columns = add_columns,                                               \
                                     .to_bf16 = to_bf16}

extern const fh_row_kernel_set fh_row_kernels_portable;
#ifdef FH_HAVE_AVX2_KERNELS
extern const fh_row_kernel_set fh_row_kernels_avx2;
#endif
#ifdef FH_HAVE_AVX512_KERNELS
extern const fh_row_kernel_set fh_row_kernels_avx512;
#endif

/* The set that the functions of row_kernels.h run (chosen at the first call of any of them). */
const fh_row_kernel_set *fh_row_kernels_in_use(void);

/* Merges a tile's maximum, its argmax (absolute column), sum of exp(z - tile_max) and sum of
 * z exp(z - tile_max) into state. */
void fh_row_merge(fh_fold_state *state, float tile_max, int64_t tile_argmax, double tile_sum, double tile_sum_z);

/* dz/du of the transform at transformed value z. */
float fh_dz_du(float z, const fh_transform *tf);

#endif
