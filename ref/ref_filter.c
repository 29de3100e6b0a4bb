#include "ref_filter.h"

#include <math.h>
#include <stdint.h>
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

/* The tail estimate's factors of the dropped columns of rows [i0, i1) x columns [v0, v1) (drop flags, indexed
 * by column): each row's sum of soft there into r, each column's sum of |soft| into nu (0 where kept); returns S,
 * the sum of every nu. */
static double tail_factors(int64_t vocab, const double *soft, const uint8_t *drop, int64_t i0, int64_t i1,
                           int64_t v0, int64_t v1, double *r, double *nu)
{
    double total = 0.0;
    for (int64_t j = v0; j < v1; j++)
        nu[j] = 0.0;
    for (int64_t i = i0; i < i1; i++) {
        r[i] = 0.0;
        for (int64_t j = v0; j < v1; j++)
            if (drop[j]) {
                r[i] += soft[i * vocab + j];
                nu[j] += fabs(soft[i * vocab + j]);
            }
    }
    for (int64_t j = v0; j < v1; j++)
        total += nu[j];
    return total;
}

/* out's column j of rows [i0, i1): soft replaced by r_i nu_j / total (left out when total is 0). */
static void replace_softmax_part(int64_t vocab, const double *soft, double *out, int64_t i0, int64_t i1, int64_t j,
                                 const double *r, double nu_j, double total)
{
    for (int64_t i = i0; i < i1; i++)
        out[i * vocab + j] += -soft[i * vocab + j] + (total > 0.0 ? r[i] * nu_j / total : 0.0);
}

int ref_filter_apply(const ref_filter *f, int64_t n, int64_t vocab, const int64_t *targets, const ref_filter_input *in,
                     double *du_dx, double *du_dw)
{
    const size_t bytes = (size_t)(n * vocab) * sizeof(double);
    const double *soft = in->soft;
    memcpy(du_dx, in->du, bytes);
    memcpy(du_dw, in->du, bytes);
    if (f->eps <= 0.0)
        return 0;
    const int64_t tile_vocab = f->tile_vocab > 0 ? f->tile_vocab : vocab;
    uint8_t *drop = calloc((size_t)vocab, 1), *everywhere = malloc((size_t)vocab);
    double *r = calloc((size_t)n, sizeof(double)), *nu = calloc((size_t)vocab, sizeof(double));
    double *nu_all = calloc((size_t)vocab, sizeof(double));
    if (!drop || !everywhere || !r || !nu || !nu_all) {
        free(drop), free(everywhere), free(r), free(nu), free(nu_all);
        return -1;
    }
    memset(everywhere, 1, (size_t)vocab);
    double total_all = 0.0;
    for (int64_t i0 = 0; i0 < n; i0 += f->tile_rows) {
        const int64_t i1 = min64(i0 + f->tile_rows, n);
        for (int64_t v0 = 0; v0 < vocab; v0 += tile_vocab) {
            const int64_t v1 = min64(v0 + tile_vocab, vocab);
            for (int64_t j = v0; j < v1; j++) {
                drop[j] = (uint8_t)dropped(f, vocab, targets, in, i0, i1, j);
                everywhere[j] &= drop[j];
            }
            const double total = f->drop_tail ? 0.0 : tail_factors(vocab, soft, drop, i0, i1, v0, v1, r, nu);
            total_all += total;
            for (int64_t j = v0; j < v1; j++) {
                if (!drop[j])
                    continue;
                nu_all[j] += nu[j];
                replace_softmax_part(vocab, soft, du_dx, i0, i1, j, r, nu[j], total);
                if (!f->dweight_after_blocks)
                    replace_softmax_part(vocab, soft, du_dw, i0, i1, j, r, nu[j], total);
            }
        }
    }
    for (int64_t j = 0; f->dweight_after_blocks && j < vocab; j++)
        if (everywhere[j])
            replace_softmax_part(vocab, soft, du_dw, 0, n, j, r, nu_all[j], total_all);
    free(drop), free(everywhere), free(r), free(nu), free(nu_all);
    return 0;
}
