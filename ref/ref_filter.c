#include "ref_filter.h"

#include "fusedhead.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static int is_target(const int64_t *targets, int64_t i, int64_t j)
{
    return targets[i] == j;
}

/* 1 when rows [i0, i1) x columns [j0, j1) of du, targets left out, are all below eps (and the tile may be
 * filtered at all). */
static int dropped(const ref_filter *f, int64_t vocab, const int64_t *targets, const ref_filter_input *in, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1)
{
    for (int64_t i = i0; i < i1; i++) {
        if (f->softcap && in->row_c[i] != 0.0)
            return 0;
        for (int64_t j = j0; j < j1 && in->row_scale[i] != 0.0; j++)
            if (!is_target(targets, i, j) && !(fabs(in->du[i * vocab + j]) < f->eps * in->row_scale[i]))
                return 0;
    }
    return 1;
}

static void drop_softmax_part(int64_t vocab, const int64_t *targets, const double *soft, double *out, int64_t i0,
                              int64_t i1, int64_t j0, int64_t j1)
{
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++)
            if (!is_target(targets, i, j))
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
    const int64_t width = FH_GRAD_FILTER_COLUMNS;
    for (int64_t v0 = 0; v0 < vocab; v0 += f->tile_vocab) {
        const int64_t v1 = min64(v0 + f->tile_vocab, vocab);
        for (int64_t j0 = v0; j0 < v1; j0 += width) {
            const int64_t j1 = min64(j0 + width, v1);
            int everywhere = 1; /* dropped by every row tile */
            for (int64_t i0 = 0; i0 < n; i0 += f->tile_rows) {
                const int64_t i1 = min64(i0 + f->tile_rows, n);
                const int drop = dropped(f, vocab, targets, in, i0, i1, j0, j1);
                everywhere &= drop;
                if (drop) {
                    drop_softmax_part(vocab, targets, soft, du_dx, i0, i1, j0, j1);
                    if (!f->dweight_after_blocks)
                        drop_softmax_part(vocab, targets, soft, du_dw, i0, i1, j0, j1);
                }
            }
            for (int64_t i = 0; i < n && everywhere; i++)
                everywhere = targets[i] < j0 || targets[i] >= j1;
            if (f->dweight_after_blocks && everywhere)
                drop_softmax_part(vocab, targets, soft, du_dw, 0, n, j0, j1);
        }
    }
}
