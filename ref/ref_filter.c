#include "ref_filter.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* 1 when column j of rows [i0, i1) may be dropped: the tile may be filtered at all, and no row of nonzero scale
 * holds its target there or an entry of |du| at least eps times its scale (rows of scale 0 hold nothing). */
static int dropped(const ref_filter *f, int64_t vocab, const int64_t *targets, const ref_filter_input *in, int64_t i0,
                   int64_t i1, int64_t j)
{
    for (int64_t i = i0; i < i1; i++) {
        if (f->softcap && in->row_c[i] != 0.0)
            return 0;
        if (in->row_scale[i] != 0.0 &&
            (targets[i] == j || !(fabs(in->du[i * vocab + j]) < f->eps * in->row_scale[i])))
            return 0;
    }
    return 1;
}

static void drop_softmax_part(int64_t vocab, const double *soft, double *out, int64_t i0, int64_t i1, int64_t j)
{
    for (int64_t i = i0; i < i1; i++)
        out[i * vocab + j] -= soft[i * vocab + j];
}

void ref_filter_apply(const ref_filter *f, int64_t n, int64_t vocab, const int64_t *targets, const ref_filter_input *in,
                      double *du_dx, double *du_dw)
{
    const size_t bytes = (size_t)(n * vocab) * sizeof(double);
    const double *soft = in->soft;
    memcpy(du_dx, in->du, bytes);
    memcpy(du_dw, in->du, bytes);
    if (f->eps <= 0.0)
        return;
    for (int64_t j = 0; j < vocab; j++) {
        int everywhere = 1; /* dropped by every row tile */
        for (int64_t i0 = 0; i0 < n; i0 += f->tile_rows) {
            const int64_t i1 = min64(i0 + f->tile_rows, n);
            const int drop = dropped(f, vocab, targets, in, i0, i1, j);
            everywhere &= drop;
            if (drop) {
                drop_softmax_part(vocab, soft, du_dx, i0, i1, j);
                if (!f->dweight_after_blocks)
                    drop_softmax_part(vocab, soft, du_dw, i0, i1, j);
            }
        }
        if (f->dweight_after_blocks && everywhere)
            drop_softmax_part(vocab, soft, du_dw, 0, n, j);
    }
}
