/* What the files of gradient filtering share: the gathered GEMMs of kept columns (gathered.c), the rank-one terms of
 * skipped ones (terms.c), and dweight after filtered bf16 row blocks (after_blocks.c). */
#ifndef FH_FILTER_INTERNAL_H
#define FH_FILTER_INTERNAL_H

#include "filter.h"

#include "kernels/filter_row_kernels.h"

/* ---- gathered.c ---- */
int64_t fh_filter_gathered_width(const fh_pass *p, int64_t count);
float *fh_gathered_dw_at(const fh_pass *p, int64_t k, int64_t c, int64_t width);
fh_status fh_filter_gathered_dweight(const fh_pass *p, int prepare, int64_t i0, int64_t nb, int64_t width,
                                     const fh_gemm_input *du, int accumulate);
fh_gemm_input fh_filter_gather_du(const fh_pass *p, const uint16_t *du, int64_t vb, int64_t nb,
                                  const int64_t *columns, int64_t count, int64_t width);
void fh_filter_compact_rows(const fh_pass *p, int64_t tile_row, int64_t nb, int64_t vb, int64_t kept,
                            const float *weights, int move);
fh_status fh_filter_kept_gemms(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0, int64_t vb,
                               int64_t kept, int with_dx);
void fh_filter_store_gathered_dweight(const fh_pass *p, const int64_t *columns, int64_t count, int64_t width);
fh_status fh_filter_all_kept_gemms(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                                   int64_t vb);

/* ---- terms.c ----
 * A rank-one term that filtering applies over a tile's skipped columns: dU_ij ~ rows[r] column(j), with column(j)
 * = scale * (profile ? profile[j] : weights ? weights[j] : 1). The c w term is exact (rows c, the class weights
 * over T); the tail estimate replaces the skipped softmax terms (rows r, the profile nu over S). Its H-vectors:
 * s = sum over the skipped columns of column(j) W[:, v0 + j] (dx_i += rows[r] s), g = sum over the tile's rows of
 * rows[r] x_i (dweight_j += column(j) g), and g_all, g summed over every row block (after bf16 row blocks). */
typedef struct fh_skipped_term {
    const double *rows;
    const float *weights;
    const double *profile;
    double scale;
    double *s, *g, *g_all;
} fh_skipped_term;

void fh_skipped_weight_sums(const fh_pass *p, int64_t v0, int64_t vb, const fh_skipped_term *terms, int count);
void fh_weighted_rows(const fh_pass *p, const double *rows, int64_t i0, int64_t nb, int accumulate, double *g);
void fh_skipped_columns_term(const fh_pass *p, int64_t v0, int64_t vb, const fh_skipped_term *terms, int count);
/* Columns [j0, j1) of dweight that every bf16 row block skipped: the terms' column(j) g_all (0 without a term),
 * rounded once, as beta says. */
void fh_skipped_dweight_columns(const fh_pass *p, int64_t j0, int64_t j1, const fh_skipped_term *terms, int count);
void fh_zero_columns(const fh_pass *p, char *base, size_t elem_size, int64_t stride_k, int64_t stride_j, int64_t j0,
                     int64_t j1);

/* ---- filter.c ---- */
void fh_filter_finish_columns(const fh_pass *p, int64_t v0, int64_t vb);

#endif
