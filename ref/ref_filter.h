/* Gradient filtering as the fused library does it (FH_PARAM_GRAD_FILTER_EPS), emulated on a reference
 * head's dU in double, so that a filtered call is checked against what it should compute rather than against a
 * loose bound. Not part of the installed library. */
#ifndef FH_REF_FILTER_H
#define FH_REF_FILTER_H

#include <stdint.h>

typedef struct ref_filter {
    double eps;                 /* 0: off */
    int64_t tile_rows;          /* the fused call's row tiles (row blocks) */
    int dweight_after_blocks;   /* bf16 row blocks: dweight is one product over every row, so a column is dropped
                                   from it only where every row tile drops it */
    int softcap;                /* a softcap was set: a tile where some row has a nonzero c is not filtered */
    int64_t tile_vocab;         /* the fused call's vocabulary tiles (0: the whole vocabulary) */
    int drop_tail;              /* FH_FILTER_TAIL_DROP: the dropped softmax part is left out, not estimated */
} ref_filter;

/* A reference head's dU and what filtering needs of it, all [n, vocab] or [n]: soft, its softmax part (the a p
 * and entropy terms; du - soft is the target term and the rank-one c w term); row_scale, max(|a|, |b|, |e|) of
 * each row (fusedhead.h); row_c, nonzero where a row has a c w term. */
typedef struct ref_filter_input {
    const double *du, *soft, *row_scale, *row_c;
} ref_filter_input;

/* du_dx and du_dw [n, vocab]: the dU that the filtered dx and dweight products see. A column of a tile (row tile x
 * vocabulary tile) is dropped when no row of it holds its target and every |du| of it is below eps times its row's
 * scale (rows of scale 0 hold nothing to drop). On its dropped columns, soft is removed and, unless drop_tail,
 * replaced by the tail estimate r_i nu_j / S: r_i the sum of row i's soft there, nu_j the sum of column j's |soft|
 * over the tile's rows, S the sum of every nu_j. With dweight_after_blocks, du_dw loses soft only on the columns
 * every row tile drops, where the estimate is r_i nu_j / S with nu_j summed over every row and S over every tile. */
int ref_filter_apply(const ref_filter *f, int64_t n, int64_t vocab, const int64_t *targets, const ref_filter_input *in,
                     double *du_dx, double *du_dw);

#endif
