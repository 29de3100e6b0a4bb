/* dweight after filtered bf16 row blocks: the GEMMs of the columns some block kept, over every row, and the rank-one
 * terms of the columns every block skipped, rounded once. */
#include "filter_internal.h"

/* bf16 row blocks: dweight after the last block, over every row, for the columns that some row block kept (in
 * gathered chunks, the rows in the blocks' segments so that the GEMM shapes are those made ready); every other
 * column gets only its rank-one terms (0 without them), rounded once, as beta says. */
static fh_status filtered_dweight_after_blocks(const fh_pass *p)
{
    const fh_linear *lin = p->in.lin;
    const int64_t n = lin->n, h = lin->hidden, vocab = lin->vocab;
    double *v = p->ws.filter.vectors;
    int any_c = 0;
    for (int64_t k = 0; k < h; k++)
        any_c |= v[TERM_G_ALL_C * h + k] != 0.0;
    /* The columns every block skipped: the c w term, and the tail estimate with every block's magnitudes. */
    fh_skipped_term terms[2];
    int terms_count = 0;
    if (any_c)
        terms[terms_count++] = (fh_skipped_term){NULL, p->in.class_weights, NULL, p->in.tf.inv_temperature, NULL, NULL,
                                              v + TERM_G_ALL_C * h};
    if (p->in.plan->tail_estimate && v[TERM_VECTORS * h] > 0.0)
        terms[terms_count++] = (fh_skipped_term){NULL, NULL, p->ws.filter.tail_columns + vocab, 1.0 / v[TERM_VECTORS * h],
                                              NULL, NULL, v + TERM_G_ALL_TAIL * h};
    int64_t kept = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (p->ws.filter.dw_holds[j])
            p->ws.filter.kept_columns[kept++] = j;
    /* Every column kept: the unfiltered GEMM over every row. */
    fh_status st = kept == vocab ? fh_pass_dweight_by_chunks(p, 0) : FH_OK;
    for (int64_t c0 = 0; c0 < kept && kept < vocab && st == FH_OK; c0 += FH_FILTER_CHUNK) {
        const int64_t *columns = p->ws.filter.kept_columns + c0;
        const int64_t count = min64(FH_FILTER_CHUNK, kept - c0), width = fh_filter_gathered_width(p, count);
        int accumulate = 0;
        fh_block b;
        for (int more = fh_block_next(p, &b, 1); more && st == FH_OK; more = fh_block_next(p, &b, 0))
            for (int s = 0; s < b.segments && st == FH_OK; s++) {
                const int64_t first = b.first[s], nb = b.rows[s];
                if (nb == 0)
                    continue;
                const fh_gemm_input du = fh_filter_gather_du(p, p->ws.du + first * vocab, vocab, nb, columns, count, width);
                st = fh_filter_gathered_dweight(p, 0, first, nb, width, &du, accumulate);
                accumulate = 1;
            }
        if (st == FH_OK)
            fh_filter_store_gathered_dweight(p, columns, count, width);
    }
    for (int64_t j0 = 0; j0 < vocab && st == FH_OK;) {
        int64_t j1 = j0 + 1;
        while (j1 < vocab && p->ws.filter.dw_holds[j1] == p->ws.filter.dw_holds[j0])
            j1++;
        if (!p->ws.filter.dw_holds[j0])
            fh_skipped_dweight_columns(p, j0, j1, terms, terms_count);
        j0 = j1;
    }
    p->ws.filter_stats->gradient_flops += 2.0 * (double)n * (double)h * (double)vocab;
    p->ws.filter_stats->skipped_flops += 2.0 * (double)n * (double)h * (double)(vocab - kept);
    return st;
}

fh_status fh_filter_blocks_end(const fh_pass *p)
{
    if (!p->in.grads->dweight)
        return FH_OK;
    if (p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS)
        return filtered_dweight_after_blocks(p);
    fh_filter_finish_columns(p, 0, p->in.lin->vocab);
    return FH_OK;
}
