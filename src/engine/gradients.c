/* Where a pass's loops meet gradient filtering: making the GEMMs ready, a row's dU and a tile's gradient GEMMs, each
 * handed to filtering (filter/filter.h) when the pass filters, else run on the products (products.c). */
#include "pass.h"

#include "filter/filter.h"

/* Whether each tile's or block's gradient GEMMs include dweight's (not after bf16 row blocks, nor over spans of them). */
static int block_dweight(const fh_pass *p)
{
    return p->sinks.dweight != FH_DWEIGHT_AFTER_BLOCKS && !p->in.plan->dw_block_acc;
}

/* dw_block_acc: the dweight GEMM over `rows` rows (a span, or a paired block's segment), made ready unless the last
 * one had as many rows. */
static fh_status prepare_span(const fh_pass *p, int64_t rows, int64_t *last)
{
    fh_status st = FH_OK;
    for (int accumulate = 0; rows > 0 && rows != *last && accumulate < 2 && st == FH_OK; accumulate++)
        st = fh_pass_add_dweight(p, 1, 0, 0, rows, 0, p->in.lin->vocab, 0, p->in.lin->vocab, accumulate);
    *last = rows > 0 ? rows : *last;
    return st;
}

/* dw_block_acc: every span's and paired segment's dweight GEMM, walked as row_blocks walks them. */
static fh_status prepare_spans(const fh_pass *p)
{
    fh_status st = FH_OK;
    int64_t span = 0, last = -1;
    fh_block b;
    int more = fh_block_next(p, &b, 1);
    for (;;) {
        if (!more || fh_span_ends_before(p, &b, span)) {
            st = prepare_span(p, span, &last);
            span = 0;
        }
        if (!more || st != FH_OK)
            return st;
        for (int s = 0; b.segments > 1 && s < b.segments && st == FH_OK; s++)
            st = prepare_span(p, b.rows[s], &last);
        span += b.segments == 1 ? fh_block_rows(&b) : 0;
        more = fh_block_next(p, &b, 0);
    }
}

/* The GEMMs of row segments of `height` rows: full tiles and the edge ones; gradients first written and then
 * accumulated. */
static fh_status prepare_height(const fh_pass *p, int64_t height)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const int64_t cols = p->in.plan->tile_vocab;
    const int64_t widths[2] = {cols, lin->vocab % cols ? lin->vocab % cols : cols};
    fh_status st = FH_OK;
    if (grads && p->filter)
        st = fh_filter_prepare(p, height);
    for (int w = 0; w < 2; w++) {
        /* f32_du_chunks computes the logits per dU chunk. */
        const int chunk_logits = p->in.plan->f32_du_chunks;
        st = st == FH_OK && !chunk_logits ? fh_pass_logits(p, 1, p->ws.tile, 0, height, 0, widths[w]) : st;
        /* The tile's first dU chunk and its last, maybe narrower, one. Filtering runs these too where it keeps
         * every column (all_kept_gemms). */
        const int64_t t = fh_du_chunk(p, widths[w]), firsts[2] = {0, (widths[w] - 1) / t * t};
        for (int k = 0; k < 2; k++) {
            const int64_t len = min64(t, widths[w] - firsts[k]);
            st = st == FH_OK && chunk_logits ? fh_pass_logits(p, 1, p->ws.tile, 0, height, 0, len) : st;
            for (int accumulate = 0; grads && accumulate < 2; accumulate++) {
                if (st == FH_OK && grads->dx)
                    st = fh_pass_add_dx(p, 1, 0, 0, height, 0, widths[w], firsts[k], len, accumulate);
                if (st == FH_OK && grads->dweight && block_dweight(p))
                    st = fh_pass_add_dweight(p, 1, 0, 0, height, 0, widths[w], firsts[k], len, accumulate);
            }
        }
    }
    return st;
}

/* Every segment height the pass's blocks have (streaming passes walk blocks of tile_rows too), each once in a row. */
fh_status fh_pass_prepare(const fh_pass *p)
{
    const fh_linear_grads *grads = p->in.grads;
    fh_status st = FH_OK;
    int64_t last = -1;
    fh_block b;
    for (int more = fh_block_next(p, &b, 1); more && st == FH_OK; more = fh_block_next(p, &b, 0))
        for (int s = 0; s < b.segments && st == FH_OK; s++)
            if (b.rows[s] > 0 && b.rows[s] != last) {
                last = b.rows[s];
                st = prepare_height(p, last);
            }
    if (st == FH_OK && grads && grads->dweight && p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS)
        st = fh_pass_dweight_by_chunks(p, 1);
    if (st == FH_OK && grads && grads->dweight && p->in.plan->dw_block_acc)
        st = prepare_spans(p);
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
 * v0 = 0, dweight by the first rows to reach these columns (dweight_holds 0; after bf16 row blocks, once over every
 * row). Filtered when eps > 0 (filtering keeps track per column). */
fh_status fh_pass_gradients(const fh_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb,
                               int64_t v0, int64_t vb, int dweight_holds)
{
    if (p->filter)
        return fh_filter_gradients(p, segment, tile_row, i0, nb, v0, vb);
    const fh_linear_grads *grads = p->in.grads;
    const int gemms = (grads->dx != NULL) + (grads->dweight && block_dweight(p));
    p->ws.filter_stats->gradient_flops += 2.0 * (double)nb * (double)p->in.lin->hidden * (double)vb * gemms;
    fh_status st = FH_OK;
    if (p->in.plan->fp32_du)
        fh_copy_x_rows(p, i0, nb);
    const int64_t t = fh_du_chunk(p, vb);
    for (int64_t j0 = 0; grads->dx && j0 < vb && st == FH_OK; j0 += t)
        st = fh_pass_add_dx(p, 0, tile_row, i0, nb, v0, vb, j0, min64(t, vb - j0), v0 > 0 || j0 > 0);
    if (st == FH_OK && grads->dweight && block_dweight(p))
        st = fh_pass_add_dweight(p, 0, tile_row, i0, nb, v0, vb, 0, vb, dweight_holds);
    return st;
}
