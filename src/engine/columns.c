/* A head over a few vocabulary columns per row (a support), with no tile: each entry's logit is one dot product of
 * the row of x with the weight's column, and the backward adds each entry's dU into its row of dx and its column of
 * dweight. The work is split over threads by entries, rows (forward, dx), columns (dweight) or hidden indices (the
 * [H, V] layout's dx) whole, so that every sum runs in one order whatever the thread count.
 *
 * In the [H, V] layout a column's elements lie a row of the weight apart, each on a cache line of its own: gathering
 * columns one at a time reads H lines per entry (a single call took 2.47 s there against 0.09 s in the [V, H] layout,
 * one thread, N = 1024, H = 1024, V = 32768, |S| = 64). There the passes sort the entries by column and sweep the
 * weight's rows over steps of them, LANES hidden indices at a time, so that the weight is read as a GEMM reads it
 * (0.33 s); each logit keeps dot's sixteen partial sums (lane h % 16, h ascending), so the logits are the same bits in
 * both layouts, and dweight's columns sum their entries in the same order. */
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

enum {
    LANES = 16, /* dot's partial sums: a cache line of fp32 */
    RUN = 256,  /* entries of one step of an [H, V] sweep (their partial sums: 16 KiB) */
    SPAN = 1024 /* columns of one step of an [H, V] sweep (LANES weight rows over them, transposed: 64 KiB) */
};

/* The sixteen partial sums of a dot product, added pairwise. */
static float lanes_sum(float *part)
{
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++)
            part[l] += part[l + width];
    return part[0];
}

/* a . b over h in fp32, as a GEMM sums: sixteen interleaved partial sums (independent, so the compiler keeps them in
 * vector registers without reordering any one sum), added pairwise at the end. */
static float dot(const float *a, const float *b, int64_t h)
{
    float part[LANES] = {0.0f};
    int64_t k = 0;
    for (; k + LANES <= h; k += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += a[k + l] * b[k + l];
    for (; k < h; k++)
        part[k % LANES] += a[k] * b[k];
    return lanes_sum(part);
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

/* The entries sorted by column, stable (a counting sort): column j's are slots start[j] .. start[j + 1] - 1, slot s
 * holding entry order[s] of row row[s]. */
typedef struct by_column {
    int64_t *start, *order, *row;
} by_column;

/* The weight's rows contiguous ([H, V]) and strided: the layout the sweeps serve. */
static int swept(const fh_linear *lin)
{
    return lin->w_stride_vocab == 1 && lin->w_stride_hidden != 1;
}

/* Thread t's scratch: two rows of H floats (x's row and a column, or a sum and a row); for the [H, V] sweeps a step's
 * partial sums (RUN x LANES), its weight tile (SPAN x LANES) and dx's LANES sums of every row. */
static size_t per_thread_floats(const fh_linear *lin)
{
    return 2 * (size_t)lin->hidden + (swept(lin) ? ((size_t)(RUN + SPAN) + (size_t)lin->n) * LANES : 0);
}

static float *thread_space(const fh_linear *lin, float *scratch, int t)
{
    return scratch + (size_t)t * per_thread_floats(lin);
}

/* After every thread's: space for by_column (V + 1 + 2 entries int64), then du in slot order (entries floats). */
static int64_t *shared_space(const fh_linear *lin, float *scratch, int threads)
{
    return (int64_t *)(scratch + (size_t)threads * per_thread_floats(lin));
}

static by_column sort_by_column(const fh_linear *lin, const fh_row_columns *c, int64_t *space)
{
    const int64_t v = lin->vocab, entries = c->begin[lin->n];
    const by_column b = {space, space + v + 1, space + v + 1 + entries};
    memset(b.start, 0, (size_t)(v + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < entries; e++)
        b.start[c->ids[e] + 1]++;
    for (int64_t j = 0; j < v; j++)
        b.start[j + 1] += b.start[j];
    /* slots are filled in entry order: start[j] moves to the end of column j's, then back */
    for (int64_t i = 0; i < lin->n; i++)
        for (int64_t e = c->begin[i]; e < c->begin[i + 1]; e++) {
            const int64_t slot = b.start[c->ids[e]]++;
            b.order[slot] = e;
            b.row[slot] = i;
        }
    for (int64_t j = v; j > 0; j--)
        b.start[j] = b.start[j - 1];
    b.start[0] = 0;
    return b;
}

/* LANES weight rows k0 .. k0 + width - 1 over columns c0 .. c1 - 1 as f32: element (l, j) at
 * rows.at[l rows.step + j - rows.first]; the weight itself for fp32, bf16 widened into tile. */
typedef struct weight_rows {
    const float *at;
    int64_t step, first;
} weight_rows;

static weight_rows load_rows(const fh_linear *lin, int64_t k0, int64_t width, int64_t c0, int64_t c1, float *tile)
{
    if (lin->weight_dtype != FH_DTYPE_BF16) {
        const weight_rows r = {(const float *)lin->weight + k0 * lin->w_stride_hidden, lin->w_stride_hidden, 0};
        return r;
    }
    for (int64_t l = 0; l < width; l++) {
        const uint16_t *w = (const uint16_t *)lin->weight + (k0 + l) * lin->w_stride_hidden;
        for (int64_t j = c0; j < c1; j++)
            tile[l * (c1 - c0) + j - c0] = fh_bf16_to_f32(w[j]);
    }
    const weight_rows r = {tile, c1 - c0, c0};
    return r;
}

/* x[i][k0 .. k0 + width - 1] as f32: x's own memory (fp32), or widened into v. */
static const float *load_x(const fh_linear *lin, int64_t i, int64_t k0, int64_t width, float *v)
{
    const int64_t at = i * lin->x_row_stride + k0;
    if (lin->x_dtype != FH_DTYPE_BF16)
        return (const float *)lin->x + at;
    for (int64_t l = 0; l < width; l++)
        v[l] = fh_bf16_to_f32(((const uint16_t *)lin->x)[at + l]);
    return v;
}

/* sum[l] += a[l a_step] b[l b_step] for l < width (a step of 0: a scalar); a full width of LANES unrolls. */
static void lanes_add(float *sum, const float *a, int64_t a_step, const float *b, int64_t b_step, int64_t width)
{
    if (width == LANES)
        for (int l = 0; l < LANES; l++)
            sum[l] += a[l * a_step] * b[l * b_step];
    else
        for (int64_t l = 0; l < width; l++)
            sum[l] += a[l * a_step] * b[l * b_step];
}

/* The end of a sweep step from slot s0: at most RUN slots over at most SPAN columns. */
static int64_t step_end(const by_column *b, const fh_row_columns *c, int64_t s0, int64_t end)
{
    const int64_t first = c->ids[b->order[s0]];
    int64_t s1 = s0 + 1;
    while (s1 < end && s1 - s0 < RUN && c->ids[b->order[s1]] - first < SPAN)
        s1++;
    return s1;
}

/* Logits of slots s0 .. s1 - 1 (a sweep step): LANES weight rows at a time over the step's columns, each slot's partial
 * sums in part[(s - s0) LANES + h % LANES], h ascending as dot's. */
static void swept_logits_step(const fh_linear *lin, const by_column *b, const fh_row_columns *c, int64_t s0,
                              int64_t s1, float *part, float *tile, float *z)
{
    const int64_t c0 = c->ids[b->order[s0]], c1 = c->ids[b->order[s1 - 1]] + 1;
    float xv[LANES];
    memset(part, 0, (size_t)(s1 - s0) * LANES * sizeof(float));
    for (int64_t k0 = 0; k0 < lin->hidden; k0 += LANES) {
        const int64_t width = lin->hidden - k0 < LANES ? lin->hidden - k0 : LANES;
        const weight_rows w = load_rows(lin, k0, width, c0, c1, tile);
        for (int64_t s = s0; s < s1; s++) {
            const float *x = load_x(lin, b->row[s], k0, width, xv);
            lanes_add(part + (s - s0) * LANES, x, 1, w.at + c->ids[b->order[s]] - w.first, w.step, width);
        }
    }
    for (int64_t s = s0; s < s1; s++) {
        const int64_t column = c->ids[b->order[s]];
        z[b->order[s]] = lanes_sum(part + (s - s0) * LANES) + (lin->bias ? lin->bias[column] : 0.0f);
    }
}

void fh_engine_column_logits(const fh_linear *lin, const fh_row_columns *c, fh_transform tf, int threads,
                             float *scratch, float *z)
{
    if (swept(lin)) {
        const by_column b = sort_by_column(lin, c, shared_space(lin, scratch, threads));
        const int64_t entries = c->begin[lin->n];
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            float *part = thread_space(lin, scratch, t) + 2 * lin->hidden, *tile = part + (size_t)RUN * LANES;
            const int64_t end = entries * (t + 1) / threads;
            for (int64_t s0 = entries * t / threads, s1; s0 < end; s0 = s1) {
                s1 = step_end(&b, c, s0, end);
                swept_logits_step(lin, &b, c, s0, s1, part, tile, z);
            }
        }
        for (int64_t i = 0; i < lin->n; i++)
            fh_row_transform(z + c->begin[i], c->begin[i + 1] - c->begin[i], NULL, &tf);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *row = thread_space(lin, scratch, t), *column = row + lin->hidden;
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
    /* every thread's (per_thread_floats), then by_column (V + 1 + 2 entries int64) and du in slot order */
    return (size_t)threads * per_thread_floats(lin) + 2 * ((size_t)lin->vocab + 1) + 5 * (size_t)entries;
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
    const size_t elem = grads->dx_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *sum = thread_space(lin, scratch, t), *column = sum + h;
        for (int64_t i = part_begin(c->begin, lin->n, t, threads); i < part_begin(c->begin, lin->n, t + 1, threads);
             i++) {
            memset(sum, 0, (size_t)h * sizeof(float));
            for (int64_t e = c->begin[i]; e < c->begin[i + 1]; e++)
                add_scaled(sum, du[e], column_f32(lin, c->ids[e], column), h);
            fh_store((char *)grads->dx + (size_t)(i * grads->dx_row_stride) * elem, grads->dx_dtype, 1, sum, h,
                     grads->dx_beta != 0.0f);
        }
    }
}

/* The [H, V] layout's dx: the hidden indices in blocks of LANES split over the threads; per block the entries, in
 * column order a sweep step at a time, add du W[k, column] into their row's LANES sums, then each row's block is
 * stored (a row's sum runs over its entries in column order, whatever the other rows). */
static void swept_dx(const fh_linear *lin, const fh_row_columns *c, const by_column *b, const float *du,
                     const fh_linear_grads *grads, int threads, float *scratch)
{
    const int64_t h = lin->hidden, n = lin->n, blocks = (h + LANES - 1) / LANES, entries = c->begin[n];
    const size_t elem = grads->dx_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *tile = thread_space(lin, scratch, t) + 2 * h + (size_t)RUN * LANES, *sums = tile + (size_t)SPAN * LANES;
        for (int64_t block = blocks * t / threads; block < blocks * (t + 1) / threads; block++) {
            const int64_t k0 = block * LANES, width = h - k0 < LANES ? h - k0 : LANES;
            memset(sums, 0, (size_t)n * LANES * sizeof(float));
            for (int64_t s0 = 0, s1; s0 < entries; s0 = s1) {
                s1 = step_end(b, c, s0, entries);
                const weight_rows w =
                    load_rows(lin, k0, width, c->ids[b->order[s0]], c->ids[b->order[s1 - 1]] + 1, tile);
                for (int64_t s = s0; s < s1; s++) {
                    const int64_t e = b->order[s];
                    lanes_add(sums + b->row[s] * LANES, w.at + c->ids[e] - w.first, w.step, du + e, 0, width);
                }
            }
            for (int64_t i = 0; i < n; i++)
                fh_store((char *)grads->dx + (size_t)(i * grads->dx_row_stride + k0) * elem, grads->dx_dtype, 1,
                         sums + i * LANES, width, grads->dx_beta != 0.0f);
        }
    }
}

/* dweight's and dbias's columns: column j gets sum_e du[e] x[row(e)] over the entries naming it, in entry order
 * (du_sorted: du in slot order). In the [H, V] layout each thread sweeps its columns a run of about RUN entries at a
 * time, hidden index by hidden index (each element still the sum of its entries in entry order). */
static void column_dweight(const fh_linear *lin, const by_column *b, const float *du_sorted,
                           const fh_linear_grads *grads, int threads, float *scratch)
{
    const int64_t h = lin->hidden, v = lin->vocab;
    const size_t dw_elem = grads->dweight_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
    const size_t db_elem = grads->dbias_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
    const int sweep = swept(lin);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        float *sum = thread_space(lin, scratch, t), *x_f32 = sum + h;
        const int64_t j_end = part_begin(b->start, v, t + 1, threads);
        for (int64_t j = part_begin(b->start, v, t, threads); j < j_end; j++) {
            if (b->start[j] == b->start[j + 1])
                continue;
            float bias_sum = 0.0f;
            for (int64_t s = b->start[j]; s < b->start[j + 1]; s++)
                bias_sum += du_sorted[s];
            if (grads->dbias)
                fh_store((char *)grads->dbias + (size_t)j * db_elem, grads->dbias_dtype, 1, &bias_sum, 1, 1);
            if (!grads->dweight)
                continue;
            if (sweep) { /* columns j .. j1 - 1: at most RUN entries (or column j's) over at most SPAN columns */
                int64_t j1 = j + 1;
                while (j1 < j_end && j1 - j < SPAN && b->start[j1 + 1] - b->start[j] <= RUN)
                    j1++;
                float *tile = sum + 2 * h + (size_t)RUN * LANES, xv[LANES];
                const int64_t span = j1 - j;
                for (int64_t k0 = 0; k0 < h; k0 += LANES) {
                    const int64_t width = h - k0 < LANES ? h - k0 : LANES;
                    /* each column's LANES sums, then transposed: tile[l span + (jj - j)] */
                    for (int64_t jj = j; jj < j1; jj++) {
                        float acc[LANES] = {0.0f};
                        for (int64_t s = b->start[jj]; s < b->start[jj + 1]; s++)
                            lanes_add(acc, load_x(lin, b->row[s], k0, width, xv), 1, du_sorted + s, 0, width);
                        for (int64_t l = 0; l < width; l++)
                            tile[l * span + (jj - j)] = acc[l];
                    }
                    /* each weight row's runs of columns with entries, one store each */
                    for (int64_t l = 0; l < width; l++)
                        for (int64_t r0 = j, r1; r0 < j1; r0 = r1) {
                            for (r1 = r0; r1 < j1 && b->start[r1] < b->start[r1 + 1]; r1++)
                                ;
                            if (r1 > r0)
                                fh_store((char *)grads->dweight +
                                             (size_t)((k0 + l) * lin->w_stride_hidden + r0) * dw_elem,
                                         grads->dweight_dtype, 1, tile + l * span + (r0 - j), r1 - r0, 1);
                            else
                                r1 = r0 + 1;
                        }
                }
                for (int64_t jj = j + 1; jj < j1 && grads->dbias; jj++) {
                    float bias = 0.0f;
                    for (int64_t s = b->start[jj]; s < b->start[jj + 1]; s++)
                        bias += du_sorted[s];
                    if (b->start[jj] < b->start[jj + 1])
                        fh_store((char *)grads->dbias + (size_t)jj * db_elem, grads->dbias_dtype, 1, &bias, 1, 1);
                }
                j = j1 - 1;
                continue;
            }
            memset(sum, 0, (size_t)h * sizeof(float));
            for (int64_t s = b->start[j]; s < b->start[j + 1]; s++)
                add_scaled(sum, du_sorted[s], x_row_f32(lin, b->row[s], x_f32), h);
            fh_store((char *)grads->dweight + (size_t)column_offset(lin, j) * dw_elem, grads->dweight_dtype,
                     lin->w_stride_hidden, sum, h, 1);
        }
    }
}

void fh_engine_column_gradients(const fh_linear *lin, const fh_row_columns *c, const float *du,
                                const fh_linear_grads *grads, int threads, float *scratch)
{
    const int64_t entries = c->begin[lin->n];
    /* the entries by column: for the [H, V] sweeps and for dweight's columns (a [V, H] dx alone reads rows) */
    const int by_columns = swept(lin) || grads->dweight || grads->dbias;
    const by_column b = by_columns ? sort_by_column(lin, c, shared_space(lin, scratch, threads)) : (by_column){0};
    if (grads->dx && swept(lin))
        swept_dx(lin, c, &b, du, grads, threads, scratch);
    else if (grads->dx)
        column_dx(lin, c, du, grads, threads, scratch);
    if (grads->dweight || grads->dbias) {
        float *du_sorted = (float *)(b.row + entries);
        for (int64_t s = 0; s < entries; s++)
            du_sorted[s] = du[b.order[s]];
        zero_overwritten(lin, grads, threads);
        column_dweight(lin, &b, du_sorted, grads, threads, scratch);
    }
}
