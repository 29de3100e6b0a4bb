/* The rank-one terms that stand in for the columns a tile skips (fh_skipped_term): their H-vectors and their
 * dweight values. */
#include "filter_internal.h"

#include <omp.h>

static float x_at(const fh_linear *lin, int64_t i, int64_t k)
{
    const int64_t at = i * lin->x_row_stride + k;
    return lin->x_dtype == FH_DTYPE_BF16 ? fh_bf16_to_f32(((const uint16_t *)lin->x)[at]) : ((const float *)lin->x)[at];
}

/* Element (k, j) of the [H, V] weight view. */
static float w_at(const fh_linear *lin, int64_t k, int64_t j)
{
    const int64_t at = k * lin->w_stride_hidden + j * lin->w_stride_vocab;
    return lin->weight_dtype == FH_DTYPE_BF16 ? fh_bf16_to_f32(((const uint16_t *)lin->weight)[at])
                                              : ((const float *)lin->weight)[at];
}

static double column_factor(const fh_skipped_term *t, int64_t j)
{
    return t->scale * (t->profile ? t->profile[j] : t->weights ? (double)t->weights[j] : 1.0);
}

/* The terms' dweight values are formed a run of at most TERMS_RUN elements at a time. */
enum { TERMS_RUN = 256 };

/* values[e] (e < m) = dweight's value of the terms (1 or 2 of them) at (k, j + e) along the vocabulary, or at
 * (k + e, j) down a column (its factors then taken once): the sum over the terms of column(j) g[k], or g_all[k]
 * with all_blocks. */
static void terms_run(const fh_skipped_term *terms, int count, int64_t k, int64_t j, int along_vocab, int64_t m,
                      int all_blocks, float *values)
{
    const double *g[2];
    double factor[2] = {0.0, 0.0}; /* a second factor of 0 with a single term */
    for (int t = 0; t < 2; t++) {
        const fh_skipped_term *term = &terms[t < count ? t : 0];
        g[t] = all_blocks ? term->g_all : term->g;
        if (t < count && !along_vocab)
            factor[t] = column_factor(term, j);
    }
    if (along_vocab)
        for (int64_t e = 0; e < m; e++) {
            double value = 0.0;
            for (int t = 0; t < count; t++)
                value += column_factor(&terms[t], j + e) * g[t][k];
            values[e] = (float)value;
        }
    else
        for (int64_t e = 0; e < m; e++)
            values[e] = (float)(factor[0] * g[0][k + e] + factor[1] * g[1][k + e]);
}

/* Each term's s over the tile's skipped columns, from each term's column factors (0 for a kept column). Each thread
 * owns a range of H and walks the weight along its contiguous direction. */
void fh_skipped_weight_sums(const fh_pass *p, int64_t v0, int64_t vb, const fh_skipped_term *terms, int count)
{
    const fh_linear *lin = p->in.lin;
    const uint8_t *keep = p->ws.filter.kept_flag;
    double *factors = p->ws.filter.factors; /* count x vb */
    const int hidden_inner = lin->w_stride_hidden <= lin->w_stride_vocab;
    const int bf16 = lin->weight_dtype == FH_DTYPE_BF16;
#pragma omp parallel num_threads(p->in.plan->threads)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < vb; j++)
            for (int t = 0; t < count; t++)
                factors[t * vb + j] = keep[j] ? 0.0 : column_factor(&terms[t], j);
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t k0 = lin->hidden * me / parts, k1 = lin->hidden * (me + 1) / parts;
        for (int t = 0; t < count; t++)
            for (int64_t k = k0; k < k1; k++)
                terms[t].s[k] = 0.0;
        if (hidden_inner && lin->w_stride_hidden == 1) { /* columns of contiguous elements: the row kernel */
            const int64_t at = v0 * lin->w_stride_vocab + k0;
            const void *w = bf16 ? (const void *)((const uint16_t *)lin->weight + at)
                                 : (const void *)((const float *)lin->weight + at);
            for (int t = 0; t < count; t++)
                fh_row_add_columns(terms[t].s + k0, k1 - k0, w, bf16, lin->w_stride_vocab, factors + t * vb, vb);
        } else if (hidden_inner) {
            for (int64_t j = 0; j < vb; j++)
                for (int t = 0; t < count; t++)
                    for (int64_t k = k0; factors[t * vb + j] != 0.0 && k < k1; k++)
                        terms[t].s[k] += factors[t * vb + j] * w_at(lin, k, v0 + j);
        } else {
            for (int64_t k = k0; k < k1; k++)
                for (int64_t j = 0; j < vb; j++)
                    for (int t = 0; t < count; t++)
                        if (factors[t * vb + j] != 0.0)
                            terms[t].s[k] += factors[t * vb + j] * w_at(lin, k, v0 + j);
        }
    }
}

/* g (+)= sum over the nb rows from i0 of rows[r] x_i; each thread owns a range of H. */
void fh_weighted_rows(const fh_pass *p, const double *rows, int64_t i0, int64_t nb, int accumulate,
                          double *g)
{
#pragma omp parallel num_threads(p->in.plan->threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t k0 = p->in.lin->hidden * me / parts, k1 = p->in.lin->hidden * (me + 1) / parts;
        for (int64_t k = k0; !accumulate && k < k1; k++)
            g[k] = 0.0;
        for (int64_t r = 0; r < nb; r++)
            for (int64_t k = k0; k < k1; k++)
                g[k] += rows[r] * x_at(p->in.lin, i0 + r, k);
    }
}

typedef struct skipped_tile {
    const fh_pass *p;
    int64_t v0, vb;
    const fh_skipped_term *terms;
    int count;
} skipped_tile;

static void skipped_term_run(const void *self, const fh_run *run)
{
    const skipped_tile *t = self;
    const fh_pass *p = t->p;
    const uint8_t *keep = p->ws.filter.kept_flag, *used = p->ws.filter.dw_holds;
    const int overwrites = p->sinks.dw_overwrites;
    if (!run->along_vocab && keep[run->j])
        return;
    int64_t stride_k, stride_j;
    fh_dw_strides(p, t->vb, &stride_k, &stride_j);
    const int64_t step = run->along_vocab ? stride_j : stride_k, dj = run->along_vocab;
    float *const first = fh_dw_f32(p, run->k, run->j, t->v0, t->vb);
    float values[TERMS_RUN];
    for (int64_t e0 = 0; e0 < run->length; e0 += TERMS_RUN) {
        const int64_t m = min64(TERMS_RUN, run->length - e0);
        terms_run(t->terms, t->count, fh_run_k(run, e0), fh_run_j(run, e0), run->along_vocab, m, 0, values);
        for (int64_t e = 0; e < m; e++) {
            const int64_t j = run->j + (e0 + e) * dj;
            float *d = first + (e0 + e) * step;
            if (!keep[j])
                *d = used[j] || !overwrites ? *d + values[e] : values[e];
        }
    }
}

/* dweight's skipped columns j of the tile += sum of the terms' column(j) g, along dweight's contiguous direction
 * (or = when the column holds nothing yet and is overwritten); then they are used. */
void fh_skipped_columns_term(const fh_pass *p, int64_t v0, int64_t vb, const fh_skipped_term *terms, int count)
{
    const skipped_tile tile = {p, v0, vb, terms, count};
    fh_walk(p->in.plan->threads, p->in.lin->hidden, p->sinks.by_vocab, 0, vb, NULL, skipped_term_run, &tile);
    for (int64_t j = 0; j < vb; j++)
        p->ws.filter.dw_holds[j] |= !p->ws.filter.kept_flag[j];
}

typedef struct zeroed {
    char *base;
    size_t elem_size;
    int64_t stride_k, stride_j;
} zeroed;

static void zero_run(const void *self, const fh_run *run)
{
    const zeroed *z = self;
    const int64_t step = run->along_vocab ? z->stride_j : z->stride_k;
    char *first = z->base + (size_t)(run->k * z->stride_k + run->j * z->stride_j) * z->elem_size;
    if (step == 1)
        memset(first, 0, (size_t)run->length * z->elem_size);
    else
        for (int64_t e = 0; e < run->length; e++)
            memset(first + (size_t)(e * step) * z->elem_size, 0, z->elem_size);
}

/* Zeroes columns [j0, j1) of an H-row matrix of elem_size-byte elements, element (k, j) at
 * base + k * stride_k + j * stride_j elements: memsets along its contiguous direction. */
void fh_zero_columns(const fh_pass *p, char *base, size_t elem_size, int64_t stride_k, int64_t stride_j, int64_t j0,
                     int64_t j1)
{
    const zeroed z = {base, elem_size, stride_k, stride_j};
    fh_walk(p->in.plan->threads, p->in.lin->hidden, stride_j <= stride_k, j0, j1 - j0, NULL, zero_run, &z);
}

/* The columns every row block skipped: only the terms' column(j) g_all, rounded once, as beta says. */
typedef struct skipped_columns {
    const fh_pass *p;
    const fh_skipped_term *terms;
    int count;
} skipped_columns;

static void skipped_run(const void *self, const fh_run *run)
{
    const skipped_columns *sc = self;
    const fh_linear *lin = sc->p->in.lin;
    const fh_linear_grads *grads = sc->p->in.grads;
    const size_t bytes = elem_size(elem_type(grads->dweight_dtype));
    const int64_t step = run->along_vocab ? lin->w_stride_vocab : lin->w_stride_hidden;
    float values[TERMS_RUN];
    for (int64_t e0 = 0; e0 < run->length; e0 += TERMS_RUN) {
        const int64_t m = min64(TERMS_RUN, run->length - e0), k = fh_run_k(run, e0), j = fh_run_j(run, e0);
        terms_run(sc->terms, sc->count, k, j, run->along_vocab, m, 1, values);
        fh_store((char *)grads->dweight + (size_t)(k * lin->w_stride_hidden + j * lin->w_stride_vocab) * bytes,
                 grads->dweight_dtype, step, values, m, grads->dweight_beta != 0.0f);
    }
}

/* Columns [j0, j1) of dweight that every row block skipped: the terms' values (0 without a term). */
void fh_skipped_dweight_columns(const fh_pass *p, int64_t j0, int64_t j1, const fh_skipped_term *terms, int count)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    if (count == 0 && grads->dweight_beta != 0.0f)
        return;
    if (count == 0) {
        fh_zero_columns(p, grads->dweight, elem_size(elem_type(grads->dweight_dtype)), lin->w_stride_hidden,
                        lin->w_stride_vocab, j0, j1);
        return;
    }
    const skipped_columns sc = {p, terms, count};
    fh_walk(p->in.plan->threads, lin->hidden, p->sinks.by_vocab, j0, j1 - j0, NULL, skipped_run, &sc);
}
