/* Gradient filtering (FH_PARAM_GRAD_FILTER_EPS; docs/filtering.md): the gradient GEMMs of a tile run on the columns
 * that some row of it marks as large, and rank-one terms stand in for the columns they skip. The engine's loops reach
 * it through these hooks only, each called when the pass filters (fh_pass.filter); its buffers are its own rows of
 * the plan's table (plan.c). */
#ifndef FH_FILTER_H
#define FH_FILTER_H

#include "engine/pass.h"

/* Makes ready the gathered GEMMs of a row tile of `rows` rows (fh_pass_prepare). */
fh_status fh_filter_prepare(const fh_pass *p, int64_t rows);

/* Before the first tile of a gradient pass. */
void fh_filter_begin(const fh_pass *p);

/* In place of fh_row_gradient: forms row tile_row's dU (vb columns, marked as segment `segment`) and marks the
 * columns it keeps. */
void fh_filter_row_gradient(const fh_pass *p, float *row, int64_t tile_row, int segment, int64_t vb, int64_t target,
                            const float *weights, const fh_coef *k);

/* In place of the gradient GEMMs of a dU tile's rows (fh_pass_gradients). */
fh_status fh_filter_gradients(const fh_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                              int64_t vb);

/* After the last row tile of a streamed vocabulary tile (v0, vb). */
void fh_filter_tile_end(const fh_pass *p, int64_t v0, int64_t vb);

/* Before a row block's segment (rows i0 .. i0 + nb - 1) adds its gradients. */
void fh_filter_block_begin(const fh_pass *p, int64_t i0, int64_t nb);

/* After the last row block, in place of the unfiltered dweight after the blocks. */
fh_status fh_filter_blocks_end(const fh_pass *p);

#endif
