/* Row blocks of whole sequences (sequences.h). */
#include "sequences.h"

static fh_status block_coefficients(const void *self, int64_t first_row, int64_t rows, const fh_token_stats *stats)
{
    const fh_sequence_coefs *c = self;
    (void)stats; /* the same arrays as the workspace's slots, which the head reads */
    c->sequences(c->self, first_row / c->seq, (first_row + rows) / c->seq);
    return FH_OK;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    const fh_sequence_coefs *c = self;
    (void)stats;
    c->row(c->self, i, k);
}

fh_status fh_sequence_row_blocks(fh_engine_pass *pass, const fh_sequence_coefs *coefs)
{
    const fh_coef_source source = {row_coefficients, block_coefficients, coefs};
    pass->source = &source;
    return fh_engine_row_blocks(pass);
}
