/* Where a pass's loops meet gradient filtering: making the GEMMs ready, a row's dU and a tile's gradient GEMMs, each
 * handed to filtering (filter/filter.h) when the pass filters, else run on the products (products.c). */
#include "pass.h"

#include "filter/filter.h"

fh_status fh_pass_prepare(const fh_pass *p)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const int64_t rows = block_segment_rows(p), span = block_span(p), cols = p->in.plan->tile_vocab;
    /* Full tiles and the edge ones; gradients first written and then accumulated. */
    const int64_t heights[2] = {rows, span % rows ? span % rows : rows};
    const int64_t widths[2] = {cols, lin->vocab % cols ? lin->vocab % cols : cols};
    fh_status st = FH_OK;
    for (int h = 0; h < 2; h++) {
        if (grads && p->filter && st == FH_OK)
            st = fh_filter_prepare(p, heights[h]);
        for (int w = 0; w < 2; w++) {
            st = st == FH_OK ? fh_pass_logits(p, 1, p->ws.tile, 0, heights[h], 0, widths[w]) : st;
            /* The tile's first dU chunk and its last, maybe narrower, one. Filtering runs these too where it keeps
             * every column (all_kept_gemms). */
            const int64_t t = fh_du_chunk(p, widths[w]), firsts[2] = {0, (widths[w] - 1) / t * t};
            for (int k = 0; k < 2; k++)
                for (int accumulate = 0; grads && accumulate < 2; accumulate++) {
                    const int64_t len = min64(t, widths[w] - firsts[k]);
                    if (st == FH_OK && grads->dx)
                        st = fh_pass_add_dx(p, 1, 0, 0, heights[h], 0, widths[w], firsts[k], len, accumulate);
                    if (st == FH_OK && grads->dweight && p->sinks.dweight != FH_DWEIGHT_AFTER_BLOCKS)
                        st = fh_pass_add_dweight(p, 1, 0, 0, heights[h], 0, widths[w], firsts[k], len, accumulate);
                }
        }
    }
    if (st == FH_OK && grads && grads->dweight && p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS)
        st = fh_pass_dweight_by_chunks(p, 1);
    return st;
}

fh_status fh_engine_prepare(const fh_engine_pass *in)
{
    fh_pass p;
    fh_pass_begin(&p, in);
    return fh_pass_prepare(&p);
}

/* Overwrites row tile_row (transformed logits, or their exps with k->p_scale) with its dU; a filtered pass also marks
 * the columns to keep on the way. */
void fh_pass_row_gradient(const fh_pass *p, float *row, int64_t tile_row, int segment, int64_t vb, int64_t target,
                          const float *weights, const fh_coef *k)
{
    if (p->filter)
        fh_filter_row_gradient(p, row, tile_row, segment, vb, target, weights, k);
    else
        fh_row_gradient(row, vb, target, weights, k, &p->in.tf, NULL);
}

/* The gradient GEMMs of a dU tile's rows from tile_row (marked as segment `segment`): dx is first written at
 * v0 = 0, dweight at i0 = 0 (or, after bf16 row blocks, once over every row). Filtered when eps > 0. */
fh_status fh_pass_gradients(const fh_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb,
                               int64_t v0, int64_t vb)
{
    if (p->filter)
        return fh_filter_gradients(p, segment, tile_row, i0, nb, v0, vb);
    const fh_linear_grads *grads = p->in.grads;
    const int gemms = (grads->dx != NULL) + (grads->dweight && p->sinks.dweight != FH_DWEIGHT_AFTER_BLOCKS);
    p->ws.filter_stats->gradient_flops += 2.0 * (double)nb * (double)p->in.lin->hidden * (double)vb * gemms;
    fh_status st = FH_OK;
    if (p->in.plan->fp32_du)
        fh_copy_x_rows(p, i0, nb);
    const int64_t t = fh_du_chunk(p, vb);
    for (int64_t j0 = 0; grads->dx && j0 < vb && st == FH_OK; j0 += t)
        st = fh_pass_add_dx(p, 0, tile_row, i0, nb, v0, vb, j0, min64(t, vb - j0), v0 > 0 || j0 > 0);
    if (st == FH_OK && grads->dweight && p->sinks.dweight != FH_DWEIGHT_AFTER_BLOCKS)
        st = fh_pass_add_dweight(p, 0, tile_row, i0, nb, v0, vb, 0, vb, i0 > 0);
    return st;
}
