/* A head over a few vocabulary columns per row (a support), with no tile: each entry's logit is one dot product of
 * the row of x with the weight's column, and the backward adds each entry's dU into its row of dx and its column of
 * dweight. The work is split over threads by entries, rows (forward, dx) or columns (dweight) whole, so that every
 * sum runs in one order whatever the thread count. */
#include "pass.h"

#include <string.h>

/* The offset of column j of the [H, V] weight view, and of dweight's (its strides); its elements are w_stride_hidden
 * apart. */
static int64_t column_offset(const fh_linear *lin, int64_t column)
{
    return column * lin->w_stride_vocab;
}

/* x's row i in f32: the row itself (fp32), or its widened copy in buffer (bf16). */
static const float *x_row_f32(const fh_linear *lin, int64_t i, float *buffer)
{
    if (lin->x_dtype != FH_DTYPE_BF16)
        return (const float *)lin->x + i * lin->x_row_stride;
    const uint16_t *bits = (const uint16_t *)lin->x + i * lin->x_row_stride;
    for (int64_t k = 0; k < lin->hidden; k++)
        buffer[k] = fh_bf16_to_f32(bits[k]);
    return buffer;
}

/* The weight's column j in f32 and contiguous: the column itself (fp32, FH_LAYOUT_VH), or its widened or gathered
 * copy in buffer. */
static const float *column_f32(const fh_linear *lin, int64_t column, float *buffer)
{
    const int64_t at = column_offset(lin, column), step = lin->w_stride_hidden;
    if (lin->weight_dtype != FH_DTYPE_BF16) {
        const float *w = (const float *)lin->weight + at;
        if (step == 1)
            return w;
        for (int64_t k = 0; k < lin->hidden; k++)
            buffer[k] = w[k * step];
        return buffer;
    }
    const uint16_t *bits = (const uint16_t *)lin->weight + at;
    for (int64_t k = 0; k < lin->hidden; k++)
        buffer[k] = fh_bf16_to_f32(bits[k * step]);
    return buffer;
}

/* a . b over h in fp32, as a GEMM sums: sixteen interleaved partial sums (independent, so the compiler keeps them in
 * vector registers without reordering any one sum), added pairwise at the end. */
static float dot(const float *a, const float *b, int64_t h)
{
    enum { LANES = 16 };
    float part[LANES] = {0.0f};
    int64_t k = 0;
    for (; k + LANES <= h; k += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += a[k + l] * b[k + l];
    for (; k < h; k++)
        part[k % LANES] += a[k] * b[k];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++)
            part[l] += part[l + width];
    return part[0];
}

/* sum += g a over h. */
static void add_scaled(float *sum, float g, const float *a, int64_t h)
{
    for (int64_t k = 0; k < h; k++)
        sum[k] += g * a[k];
}

/* The first of count items (cumulative entries start[0..count], start[count] the total) of part t of parts, each
 * part about as many entries: a binary search for the first item whose entries start at or after t / parts of
 * them. */
static int64_t part_begin(const int64_t *start, int64_t count, int64_t t, int64_t parts)
{
    const int64_t target = (int64_t)((double)start[count] * (double)t / (double)parts);
    int64_t lo = 0, hi = count;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (start[mid] < target)
            lo = mid + 1;
        else
            hi = mid;
    }
    return t == 0 ? 0 : t == parts ? count : lo;
}

void fh_engine_column_logits(const fh_linear *lin, const fh_row_columns *c, fh_transform tf, int threads,
                             float *scratch, float *z)
{
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *row = scratch + (size_t)t * 2 * (size_t)lin->hidden, *column = row + lin->hidden;
        for (int64_t i = part_begin(c->begin, lin->n, t, threads); i < part_begin(c->begin, lin->n, t + 1, threads);
             i++) {
            const int64_t e0 = c->begin[i], count = c->begin[i + 1] - e0;
            if (count == 0)
                continue;
            const float *x = x_row_f32(lin, i, row);
            for (int64_t e = 0; e < count; e++) {
                const int64_t id = c->ids[e0 + e];
                z[e0 + e] = dot(x, column_f32(lin, id, column), lin->hidden) + (lin->bias ? lin->bias[id] : 0.0f);
            }
            fh_row_transform(z + e0, count, NULL, &tf);
        }
    }
}

size_t fh_engine_column_scratch_floats(const fh_linear *lin, int64_t entries, int threads)
{
    /* per thread, two rows of H floats (x's row and a column, or a sum and a row); then the entries sorted by column:
     * the columns' starts (V + 1 int64), each entry's row (int64) and dU. */
    return (size_t)threads * 2 * (size_t)lin->hidden + 2 * ((size_t)lin->vocab + 1) + 3 * (size_t)entries;
}

/* Zeros where a gradient of beta 0 gets nothing from the entries: all of dweight and dbias (the entries' columns
 * are then added to), along dweight's contiguous direction. */
static void zero_overwritten(const fh_linear *lin, const fh_linear_grads *grads, int threads)
{
    const size_t elem = grads->dweight_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
    if (grads->dweight && grads->dweight_beta == 0.0f) {
        const int by_vocab = lin->w_stride_vocab <= lin->w_stride_hidden;
        const int64_t runs = by_vocab ? lin->hidden : lin->vocab, length = by_vocab ? lin->vocab : lin->hidden;
        const int64_t run_step = by_vocab ? lin->w_stride_hidden : lin->w_stride_vocab;
        const int64_t step = by_vocab ? lin->w_stride_vocab : lin->w_stride_hidden;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < runs; r++) {
            char *at = (char *)grads->dweight + (size_t)(r * run_step) * elem;
            if (step == 1)
                memset(at, 0, (size_t)length * elem);
            else
                for (int64_t e = 0; e < length; e++)
                    memset(at + (size_t)(e * step) * elem, 0, elem);
        }
    }
    if (grads->dbias && grads->dbias_beta == 0.0f)
        memset(grads->dbias, 0, (size_t)lin->vocab * (grads->dbias_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t)
                                                                                           : sizeof(float)));
}

/* dx's rows: row i gets sum_e du[e] W[:, ids[e]] over its entries, in order (rows without entries: 0). */
static void column_dx(const fh_linear *lin, const fh_row_columns *c, const float *du, const fh_linear_grads *grads,
                      int threads, float *scratch)
{
    const int64_t h = lin->hidden;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *sum = scratch + (size_t)t * 2 * (size_t)h, *column = sum + h;
        for (int64_t i = part_begin(c->begin, lin->n, t, threads); i < part_begin(c->begin, lin->n, t + 1, threads);
             i++) {
            memset(sum, 0, (size_t)h * sizeof(float));
            for (int64_t e = c->begin[i]; e < c->begin[i + 1]; e++)
                add_scaled(sum, du[e], column_f32(lin, c->ids[e], column), h);
            const size_t elem = grads->dx_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
            fh_store((char *)grads->dx + (size_t)(i * grads->dx_row_stride) * elem, grads->dx_dtype, 1, sum, h,
                     grads->dx_beta != 0.0f);
        }
    }
}

/* dweight's and dbias's columns: column j gets sum_e du[e] x[row(e)] over the entries naming it, in entry order;
 * the entries sorted by column first (a counting sort, stable). */
static void column_dweight(const fh_linear *lin, const fh_row_columns *c, const float *du,
                           const fh_linear_grads *grads, int threads, float *scratch)
{
    const int64_t h = lin->hidden, v = lin->vocab, entries = c->begin[lin->n];
    int64_t *start = (int64_t *)(scratch + (size_t)threads * 2 * (size_t)h), *row_of = start + v + 1;
    float *du_sorted = (float *)(row_of + entries);
    memset(start, 0, (size_t)(v + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < entries; e++)
        start[c->ids[e] + 1]++;
    for (int64_t j = 0; j < v; j++)
        start[j + 1] += start[j];
    /* row_of's slots are filled in entry order: start[j] moves to the end of column j's, then back. */
    for (int64_t i = 0; i < lin->n; i++)
        for (int64_t e = c->begin[i]; e < c->begin[i + 1]; e++) {
            const int64_t slot = start[c->ids[e]]++;
            row_of[slot] = i;
            du_sorted[slot] = du[e];
        }
    for (int64_t j = v; j > 0; j--)
        start[j] = start[j - 1];
    start[0] = 0;
    const size_t dw_elem = grads->dweight_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
    const size_t db_elem = grads->dbias_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *sum = scratch + (size_t)t * 2 * (size_t)h, *x_f32 = sum + h;
        for (int64_t j = part_begin(start, v, t, threads); j < part_begin(start, v, t + 1, threads); j++) {
            if (start[j] == start[j + 1])
                continue;
            memset(sum, 0, (size_t)h * sizeof(float));
            float bias_sum = 0.0f;
            for (int64_t s = start[j]; s < start[j + 1]; s++) {
                add_scaled(sum, du_sorted[s], x_row_f32(lin, row_of[s], x_f32), h);
                bias_sum += du_sorted[s];
            }
            if (grads->dweight)
                fh_store((char *)grads->dweight + (size_t)column_offset(lin, j) * dw_elem, grads->dweight_dtype,
                         lin->w_stride_hidden, sum, h, 1);
            if (grads->dbias)
                fh_store((char *)grads->dbias + (size_t)j * db_elem, grads->dbias_dtype, 1, &bias_sum, 1, 1);
        }
    }
}

void fh_engine_column_gradients(const fh_linear *lin, const fh_row_columns *c, const float *du,
                                const fh_linear_grads *grads, int threads, float *scratch)
{
    if (grads->dx)
        column_dx(lin, c, du, grads, threads, scratch);
    if (grads->dweight || grads->dbias) {
        zero_overwritten(lin, grads, threads);
        column_dweight(lin, c, du, grads, threads, scratch);
    }
}
