/* Tile loops. Both passes walk vocabulary tiles in the outer loop and token blocks in the inner one:
 * a dweight tile (H x tile_vocab) is finished before moving on, so the H x V accumulator is written
 * once per row block of its own tile and never revisited; dx (N x H, usually the smaller) is the one
 * re-accumulated per vocabulary tile. bf16 gradients that several GEMMs add up go through f32 accumulators
 * (dx_acc, dw_acc) and are rounded once; in row blocks each is one GEMM (dx per block over the whole
 * vocabulary, dweight after the last block over the bf16 dU of every row) and written directly. */
#include "engine.h"

#include "gemm/gemm.h"

#include <math.h>
#include <omp.h>

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Column of row i's target within the tile starting at v0; -1 when there is none in [0, V). */
static int64_t target_column(const int64_t *targets, int64_t i, int64_t vocab, int64_t v0)
{
    if (!targets || targets[i] < 0 || targets[i] >= vocab)
        return -1;
    return targets[i] - v0;
}

static fh_elem_type elem_type(fh_dtype dtype)
{
    return dtype == FH_DTYPE_BF16 ? FH_ELEM_BF16 : FH_ELEM_F32;
}

static size_t elem_size(fh_elem_type type)
{
    return type == FH_ELEM_BF16 ? sizeof(uint16_t) : sizeof(float);
}

/* A view of the matrix at base whose first element is `offset` elements in. */
static fh_gemm_input view(const void *base, fh_elem_type type, int64_t offset, int64_t row_stride, int64_t col_stride)
{
    const fh_gemm_input v = {(const char *)base + (size_t)offset * elem_size(type), row_stride, col_stride, type};
    return v;
}

static fh_gemm_output f32_output(float *data, int64_t row_stride, int64_t col_stride)
{
    const fh_gemm_output v = {data, row_stride, col_stride, FH_ELEM_F32};
    return v;
}

/* The dU rows of a tile (rows i0.. of the call, from row tile_row of the tile) as the gradient GEMMs read
 * them: the f32 tile itself, or (bf16_du) the rows rounded into the du buffer, which holds one tile when
 * streaming and every row of the call in row blocks. */
static fh_gemm_input du_view(const fh_engine_pass *p, int64_t tile_row, int64_t i0, int64_t vb)
{
    if (p->plan->bf16_du)
        return view(p->ws->du, FH_ELEM_BF16, (p->plan->row_blocks ? i0 : tile_row) * vb, vb, 1);
    return view(p->ws->tile, FH_ELEM_F32, tile_row * vb, vb, 1);
}

static uint16_t *du_row(const fh_engine_pass *p, int64_t i0, int64_t r, int64_t vb)
{
    return p->ws->du + ((p->plan->row_blocks ? i0 : 0) + r) * vb;
}

/* One GEMM of a pass, made ready (prepare) or run. */
static fh_status multiply(const fh_engine_pass *p, int prepare, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c)
{
    if (prepare)
        return fh_gemm_prepare(p->ws->gemm_cache, m, n, k, a, b, accumulate, c, p->plan->threads);
    return fh_gemm(*p->ws->gemm_cache, m, n, k, a, b, accumulate, c, p->plan->threads);
}

/* tile[nb x vb] = X[i0:i0+nb, :] W[:, v0:v0+vb]; the transform is applied per row by the caller, while
 * the row is hot in cache. */
static fh_status compute_logits(const fh_engine_pass *p, int prepare, float *tile, int64_t i0, int64_t nb,
                                int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->lin;
    const fh_gemm_input x = view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, lin->x_row_stride, 1);
    const fh_gemm_input w = view(lin->weight, elem_type(lin->weight_dtype), v0 * lin->w_stride_vocab,
                                 lin->w_stride_hidden, lin->w_stride_vocab);
    const fh_gemm_output z = f32_output(tile, vb, 1);
    return multiply(p, prepare, nb, vb, lin->hidden, &x, &w, 0, &z);
}

/* A bf16 gradient accumulated over several GEMMs goes through an f32 accumulator, rounded at the end. */
static int dx_accumulated(const fh_engine_pass *p)
{
    return p->grads->dx_dtype == FH_DTYPE_BF16 && !p->plan->row_blocks;
}

static int dweight_accumulated(const fh_engine_pass *p)
{
    return p->grads->dweight_dtype == FH_DTYPE_BF16 && !p->plan->row_blocks;
}

/* The weight tile's accumulator runs along the weight's contiguous direction, so that rounding it into
 * dweight reads and writes in order. */
static int dw_acc_by_vocab(const fh_linear *lin)
{
    return lin->w_stride_vocab <= lin->w_stride_hidden;
}

/* dx[i0:i0+nb, :] (+)= dU W[:, v0:v0+vb]^T, dU the nb x vb rows of the tile from tile_row. accumulate: a
 * later tile of the call. */
static fh_status add_dx(const fh_engine_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                        int64_t vb, int accumulate)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const int64_t h = lin->hidden;
    const fh_gemm_input du = du_view(p, tile_row, i0, vb);
    /* fp32_dz: w32 holds the tile's columns row-major, H x vb. */
    const fh_gemm_input wt = p->plan->fp32_dz ? view(p->ws->w32, FH_ELEM_F32, 0, 1, vb)
                                              : view(lin->weight, elem_type(lin->weight_dtype), v0 * lin->w_stride_vocab,
                                                     lin->w_stride_vocab, lin->w_stride_hidden);
    if (dx_accumulated(p)) {
        const fh_gemm_output acc = f32_output(p->ws->dx_acc + i0 * h, h, 1);
        return multiply(p, prepare, nb, h, vb, &du, &wt, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dx_dtype);
    const fh_gemm_output dx = {(char *)grads->dx + (size_t)(i0 * grads->dx_row_stride) * elem_size(type),
                               grads->dx_row_stride, 1, type};
    return multiply(p, prepare, nb, h, vb, &du, &wt, accumulate || grads->dx_beta != 0.0f, &dx);
}

/* dweight[:, v0:v0+vb] (+)= X[i0:i0+nb, :]^T dU (tile rows from tile_row). accumulate: a later row tile of
 * the call. */
static fh_status add_dweight(const fh_engine_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb,
                             int64_t v0, int64_t vb, int accumulate)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const int64_t h = lin->hidden;
    /* fp32_dz: x32 holds the tile's rows, nb x H. */
    const fh_gemm_input xt = p->plan->fp32_dz
                                 ? view(p->ws->x32, FH_ELEM_F32, 0, 1, h)
                                 : view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, 1, lin->x_row_stride);
    const fh_gemm_input du = du_view(p, tile_row, i0, vb);
    if (dweight_accumulated(p)) {
        const int by_vocab = dw_acc_by_vocab(lin);
        const fh_gemm_output acc = f32_output(p->ws->dw_acc, by_vocab ? vb : 1, by_vocab ? 1 : h);
        return multiply(p, prepare, h, vb, nb, &xt, &du, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dweight_dtype);
    const fh_gemm_output dw = {(char *)grads->dweight + (size_t)(v0 * lin->w_stride_vocab) * elem_size(type),
                               lin->w_stride_hidden, lin->w_stride_vocab, type};
    return multiply(p, prepare, h, vb, nb, &xt, &du, accumulate || grads->dweight_beta != 0.0f, &dw);
}

/* Row blocks of paired rows are two segments, one in each half of the rows: their height and the rows they
 * walk. Every other pass has one segment over all n rows. */
static int64_t block_segments(const fh_engine_pass *p)
{
    return p->paired_rows ? 2 : 1;
}

static int64_t block_segment_rows(const fh_engine_pass *p)
{
    return p->plan->tile_rows / block_segments(p);
}

static int64_t block_span(const fh_engine_pass *p)
{
    return p->paired_rows ? p->paired_rows : p->lin->n;
}

/* bf16 row blocks keep every row's dU, and dweight is one GEMM over all of them after the last block. */
static int dweight_after_blocks(const fh_engine_pass *p)
{
    return p->plan->row_blocks && p->plan->bf16_du;
}

fh_status fh_engine_prepare(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const int64_t rows = block_segment_rows(p), span = block_span(p), cols = p->plan->tile_vocab;
    /* Full tiles and the edge ones; gradients first written and then accumulated. */
    const int64_t heights[2] = {rows, span % rows ? span % rows : rows};
    const int64_t widths[2] = {cols, lin->vocab % cols ? lin->vocab % cols : cols};
    fh_status st = FH_OK;
    for (int h = 0; h < 2; h++)
        for (int w = 0; w < 2; w++) {
            st = st == FH_OK ? compute_logits(p, 1, p->ws->tile, 0, heights[h], 0, widths[w]) : st;
            for (int accumulate = 0; grads && accumulate < 2; accumulate++) {
                if (st == FH_OK && grads->dx)
                    st = add_dx(p, 1, 0, 0, heights[h], 0, widths[w], accumulate);
                if (st == FH_OK && grads->dweight && !dweight_after_blocks(p))
                    st = add_dweight(p, 1, 0, 0, heights[h], 0, widths[w], accumulate);
            }
        }
    if (st == FH_OK && grads && grads->dweight && dweight_after_blocks(p))
        st = add_dweight(p, 1, 0, 0, lin->n, 0, lin->vocab, 0);
    return st;
}

/* out (+)= acc, rounded once to bf16: rows of cols contiguous elements, at acc_stride and out_stride. */
static void round_into_bf16(const float *acc, int64_t acc_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                            int64_t cols, int accumulate, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        fh_row_add_to_bf16(acc + r * acc_stride, cols, accumulate, out + r * out_stride);
}

/* The f32 accumulators of a streaming pass rounded into bf16 gradients: dweight's tile (v0, vb) after its
 * last row tile, dx after the last vocabulary tile. */
static void finish_dweight_tile(const fh_engine_pass *p, int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->lin;
    const int accumulate = p->grads->dweight_beta != 0.0f;
    uint16_t *out = (uint16_t *)p->grads->dweight + v0 * lin->w_stride_vocab;
    const int64_t h = lin->hidden;
    const int by_vocab = dw_acc_by_vocab(lin);
    if (lin->w_stride_vocab == 1) /* acc H x vb row-major; out rows along the vocabulary */
        round_into_bf16(p->ws->dw_acc, vb, out, lin->w_stride_hidden, h, vb, accumulate, p->plan->threads);
    else if (lin->w_stride_hidden == 1) /* acc column-major; out rows along hidden */
        round_into_bf16(p->ws->dw_acc, h, out, lin->w_stride_vocab, vb, h, accumulate, p->plan->threads);
    else /* neither stride is 1: element by element */
        for (int64_t j = 0; j < vb; j++)
            for (int64_t k = 0; k < h; k++)
                fh_row_add_to_bf16(p->ws->dw_acc + (by_vocab ? k * vb + j : j * h + k), 1, accumulate,
                                   out + j * lin->w_stride_vocab + k * lin->w_stride_hidden);
}

static void finish_dx(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    round_into_bf16(p->ws->dx_acc, lin->hidden, p->grads->dx, p->grads->dx_row_stride, lin->n, lin->hidden,
                    p->grads->dx_beta != 0.0f, p->plan->threads);
}

/* fp32_dz: the f32 copies of the weight tile's columns (per vocabulary tile) and of the x rows (per tile). */
static void copy_weight_columns(const fh_engine_pass *p, int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->lin;
    const uint16_t *w = lin->weight;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t k = 0; k < lin->hidden; k++)
        for (int64_t j = 0; j < vb; j++)
            p->ws->w32[k * vb + j] = fh_bf16_to_f32(w[k * lin->w_stride_hidden + (v0 + j) * lin->w_stride_vocab]);
}

static void copy_x_rows(const fh_engine_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear *lin = p->lin;
    const uint16_t *x = lin->x;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++)
        for (int64_t k = 0; k < lin->hidden; k++)
            p->ws->x32[r * lin->hidden + k] = fh_bf16_to_f32(x[(i0 + r) * lin->x_row_stride + k]);
}

/* dbias = sum of columns, with beta: 0 overwrites without reading; a bf16 dbias is rounded from fp32. */
static void write_bias_gradient(const fh_linear_grads *grads, const double *column, int64_t v0, int64_t count)
{
    const int accumulate = grads->dbias_beta != 0.0f;
    for (int64_t j = 0; j < count; j++) {
        if (grads->dbias_dtype == FH_DTYPE_BF16) {
            const float sum = (float)column[j];
            fh_row_add_to_bf16(&sum, 1, accumulate, (uint16_t *)grads->dbias + v0 + j);
        } else {
            float *d = (float *)grads->dbias + v0 + j;
            *d = (float)(accumulate ? *d + column[j] : column[j]);
        }
    }
}

/* column[j] += sum_r tile[r][j]; each thread owns a contiguous range of columns and walks rows in order,
 * so sums are deterministic and the inner loop is unit-stride. */
static void add_column_sums(const float *tile, int64_t rows, int64_t cols, double *column, int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = cols * me / parts, end = cols * (me + 1) / parts;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = begin; j < end; j++)
                column[j] += tile[r * cols + j];
    }
}

fh_status fh_engine_forward(const fh_engine_pass *p)
{
    const fh_status prepared = fh_engine_prepare(p);
    if (prepared != FH_OK)
        return prepared;
    const fh_linear *lin = p->lin;
    const fh_token_stats *stats = p->stats;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int threads = p->plan->threads;
    /* Until the end, lse's array holds the running max and sum_pz's the running sum of z exp(z - max). */
    double *const running_max = stats->lse, *const running_sum_z_exp = stats->sum_pz;
    const fh_fold_state initial = fh_fold_state_initial();
    for (int64_t i = 0; i < n; i++) {
        running_max[i] = initial.max;
        stats->sum_exp[i] = 0.0;
        stats->z_target[i] = 0.0;
        if (stats->sum_weighted_z)
            stats->sum_weighted_z[i] = 0.0;
        if (running_sum_z_exp)
            running_sum_z_exp[i] = 0.0;
        if (stats->argmax)
            stats->argmax[i] = 0;
    }
    for (int64_t v0 = 0; v0 < vocab; v0 += p->plan->tile_vocab) {
        const int64_t vb = min64(p->plan->tile_vocab, vocab - v0);
        const fh_fold_request request = {p->class_weights ? p->class_weights + v0 : NULL,
                                         stats->sum_weighted_z != NULL, running_sum_z_exp != NULL};
        const float *bias = lin->bias ? lin->bias + v0 : NULL;
        for (int64_t i0 = 0; i0 < n; i0 += p->plan->tile_rows) {
            const int64_t nb = min64(p->plan->tile_rows, n - i0);
            float *tile = p->ws->tile;
            const fh_status gemm = compute_logits(p, 0, tile, i0, nb, v0, vb);
            if (gemm != FH_OK)
                return gemm;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < nb; r++) {
                const int64_t i = i0 + r;
                fh_row_transform(tile + r * vb, vb, bias, &p->tf);
                fh_fold_state st = {running_max[i], stats->sum_exp[i], stats->z_target[i],
                                    stats->sum_weighted_z ? stats->sum_weighted_z[i] : 0.0,
                                    running_sum_z_exp ? running_sum_z_exp[i] : 0.0,
                                    stats->argmax ? stats->argmax[i] : 0};
                fh_row_fold(tile + r * vb, vb, v0, target_column(p->targets, i, vocab, v0), &request, &st);
                running_max[i] = st.max;
                stats->sum_exp[i] = st.sum_exp;
                stats->z_target[i] = st.z_target;
                if (stats->sum_weighted_z)
                    stats->sum_weighted_z[i] = st.sum_weighted_z;
                if (running_sum_z_exp)
                    running_sum_z_exp[i] = st.sum_z_exp;
                if (stats->argmax)
                    stats->argmax[i] = st.argmax;
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        stats->lse[i] = running_max[i] + log(stats->sum_exp[i]);
        if (stats->sum_pz)
            stats->sum_pz[i] = running_sum_z_exp[i] / stats->sum_exp[i];
    }
    return FH_OK;
}

static fh_coef coef_of(const fh_coef_arrays *coefs, int64_t i)
{
    const fh_coef k = {coefs->lse[i], coefs->a[i], coefs->b[i], coefs->c[i], coefs->e ? coefs->e[i] : 0.0,
                       coefs->sum_pz ? coefs->sum_pz[i] : 0.0};
    return k;
}

/* With bf16_du, row r of the tile's dU rounded into the du buffer, inside the row loop while it is hot. */
static void round_du_row(const fh_engine_pass *p, const float *row, int64_t i0, int64_t r, int64_t vb)
{
    if (p->plan->bf16_du)
        fh_row_to_bf16(row, vb, du_row(p, i0, r, vb));
}

/* The gradient GEMMs of a dU tile's rows from tile_row: dx is first written at v0 = 0, dweight at i0 = 0 (or,
 * after bf16 row blocks, once over every row). */
static fh_status add_gradients(const fh_engine_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                               int64_t vb)
{
    const fh_linear_grads *grads = p->grads;
    fh_status st = FH_OK;
    if (p->plan->fp32_dz)
        copy_x_rows(p, i0, nb);
    if (grads->dx)
        st = add_dx(p, 0, tile_row, i0, nb, v0, vb, v0 > 0);
    if (st == FH_OK && grads->dweight && !dweight_after_blocks(p))
        st = add_dweight(p, 0, tile_row, i0, nb, v0, vb, i0 > 0);
    return st;
}

fh_status fh_engine_backward(const fh_engine_pass *p)
{
    const fh_status prepared = fh_engine_prepare(p);
    if (prepared != FH_OK)
        return prepared;
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int threads = p->plan->threads;
    double *column = p->ws->column;
    for (int64_t v0 = 0; v0 < vocab; v0 += p->plan->tile_vocab) {
        const int64_t vb = min64(p->plan->tile_vocab, vocab - v0);
        const float *weights = p->class_weights ? p->class_weights + v0 : NULL;
        const float *bias = lin->bias ? lin->bias + v0 : NULL;
        if (grads->dbias)
            for (int64_t j = 0; j < vb; j++)
                column[j] = 0.0;
        if (p->plan->fp32_dz)
            copy_weight_columns(p, v0, vb);
        for (int64_t i0 = 0; i0 < n; i0 += p->plan->tile_rows) {
            const int64_t nb = min64(p->plan->tile_rows, n - i0);
            float *tile = p->ws->tile;
            fh_status st = compute_logits(p, 0, tile, i0, nb, v0, vb);
            if (st != FH_OK)
                return st;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < nb; r++) {
                const int64_t i = i0 + r;
                const fh_coef k = coef_of(p->coefs, i);
                fh_row_transform(tile + r * vb, vb, bias, &p->tf);
                fh_row_gradient(tile + r * vb, vb, target_column(p->targets, i, vocab, v0), weights, &k, &p->tf);
                round_du_row(p, tile + r * vb, i0, r, vb);
            }
            if (grads->dbias)
                add_column_sums(tile, nb, vb, column, threads);
            st = add_gradients(p, 0, i0, nb, v0, vb);
            if (st != FH_OK)
                return st;
        }
        if (grads->dweight && dweight_accumulated(p))
            finish_dweight_tile(p, v0, vb);
        if (grads->dbias)
            write_bias_gradient(grads, column, v0, vb);
    }
    if (grads->dx && dx_accumulated(p))
        finish_dx(p);
    return FH_OK;
}

/* Transforms row i of the block in place, folds it over lin's columns and stores its final statistics. */
static fh_final_stats fold_row(const fh_engine_pass *p, const fh_fold_request *request, float *row, int64_t i)
{
    const int64_t vocab = p->lin->vocab;
    const fh_token_stats *stats = p->stats;
    fh_row_transform(row, vocab, p->lin->bias, &p->tf);
    fh_fold_state st = fh_fold_state_initial();
    fh_row_fold(row, vocab, 0, target_column(p->targets, i, vocab, 0), request, &st);
    const fh_final_stats result = {st.max + log(st.sum_exp), st.z_target, st.sum_weighted_z,
                                   st.sum_z_exp / st.sum_exp};
    stats->lse[i] = result.lse;
    stats->z_target[i] = result.z_target;
    stats->sum_exp[i] = st.sum_exp;
    if (stats->sum_weighted_z)
        stats->sum_weighted_z[i] = result.sum_weighted_z;
    if (stats->sum_pz)
        stats->sum_pz[i] = result.sum_pz;
    if (stats->argmax)
        stats->argmax[i] = st.argmax;
    return result;
}

/* Row i's statistics as the block hook left them. */
static fh_final_stats stored_stats(const fh_token_stats *s, int64_t i)
{
    const fh_final_stats result = {s->lse[i], s->z_target[i], s->sum_weighted_z ? s->sum_weighted_z[i] : 0.0,
                                   s->sum_pz ? s->sum_pz[i] : 0.0};
    return result;
}

/* Overwrites row r of the block at i0 (transformed logits) with its dU. */
static void gradient_row(const fh_engine_pass *p, float *row, int64_t i0, int64_t r, const fh_final_stats *stats)
{
    const int64_t i = i0 + r;
    const int64_t vocab = p->lin->vocab;
    fh_coef k = {stats->lse, 0.0, 0.0, 0.0, 0.0, stats->sum_pz};
    p->source->row(p->source->self, i, stats, &k);
    fh_row_gradient(row, vocab, target_column(p->targets, i, vocab, 0), p->class_weights, &k, &p->tf);
    round_du_row(p, row, i0, r, vocab);
}

/* The statistics of rows [i0, n) as arrays starting at row i0. */
static fh_token_stats stats_from(const fh_token_stats *s, int64_t i0)
{
    const fh_token_stats view = {s->lse + i0,
                                 s->z_target + i0,
                                 s->sum_weighted_z ? s->sum_weighted_z + i0 : NULL,
                                 s->sum_pz ? s->sum_pz + i0 : NULL,
                                 s->sum_exp + i0,
                                 s->argmax ? s->argmax + i0 : NULL};
    return view;
}

fh_status fh_engine_row_blocks(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const fh_token_stats *stats = p->stats;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int64_t segments = block_segments(p), height = block_segment_rows(p), span = block_span(p);
    const int threads = p->plan->threads;
    const fh_fold_request request = {p->class_weights, stats->sum_weighted_z != NULL, stats->sum_pz != NULL};
    float *tile = p->ws->tile;
    double *column = p->ws->column;
    fh_status st = fh_engine_prepare(p);
    if (st != FH_OK)
        return st;
    if (grads->dbias)
        for (int64_t j = 0; j < vocab; j++)
            column[j] = 0.0;
    for (int64_t i0 = 0; i0 < span; i0 += height) {
        /* Segment s holds rows s * span + i0 .. + nb - 1, from tile row s * nb. */
        const int64_t nb = min64(height, span - i0), rows = segments * nb;
        for (int64_t s = 0; s < segments && st == FH_OK; s++)
            st = compute_logits(p, 0, tile + s * nb * vocab, s * span + i0, nb, 0, vocab);
        if (st != FH_OK)
            return st;
        if (!p->source->block) {
            /* Fold, then the gradient while the row is still hot in cache. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t first = r / nb * span + i0;
                const fh_final_stats result = fold_row(p, &request, tile + r * vocab, first + r % nb);
                gradient_row(p, tile + r * vocab, first, r % nb, &result);
            }
        } else {
            /* The hook needs the whole block's statistics before any row's coefficients. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++)
                fold_row(p, &request, tile + r * vocab, r / nb * span + i0 + r % nb);
            const fh_token_stats block = stats_from(stats, i0);
            st = p->source->block(p->source->self, i0, nb, &block);
            if (st != FH_OK)
                return st;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t first = r / nb * span + i0;
                const fh_final_stats result = stored_stats(stats, first + r % nb);
                gradient_row(p, tile + r * vocab, first, r % nb, &result);
            }
        }
        if (grads->dbias)
            add_column_sums(tile, rows, vocab, column, threads);
        for (int64_t s = 0; s < segments && st == FH_OK; s++)
            st = add_gradients(p, s * nb, s * span + i0, nb, 0, vocab);
        if (st != FH_OK)
            return st;
    }
    if (grads->dweight && dweight_after_blocks(p)) {
        st = add_dweight(p, 0, 0, 0, n, 0, vocab, 0);
        if (st != FH_OK)
            return st;
    }
    if (grads->dbias)
        write_bias_gradient(grads, column, 0, vocab);
    return FH_OK;
}
