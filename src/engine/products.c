/* The GEMM products of a pass on its sinks: the logits tiles (and a companion head's), dx and dweight from dU, the
 * bf16 roundings and copies around them, the bias gradient's column sums. Gradient filtering builds on these
 * (filter/); the loops reach both through gradients.c. */
#include "pass.h"

#include <omp.h>

/* One GEMM of a pass, made ready (prepare) or run. */
fh_status fh_pass_multiply(const fh_pass *p, int prepare, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c)
{
    const fh_gemm_order order = p->in.plan->gemm_order;
    if (prepare)
        return fh_gemm_prepare(p->ws.gemm_cache, &p->ws.scratch, order, m, n, k, a, b, accumulate, c,
                               p->in.plan->threads);
    return fh_gemm(*p->ws.gemm_cache, &p->ws.scratch, order, m, n, k, a, b, accumulate, c, p->in.plan->threads);
}

/* tile[nb x vb] = X[i0:i0+nb, :] W[:, v0:v0+vb] of lin (the pass's own, or its pair's companion); the transform
 * is applied per row by the caller, while the row is hot in cache. */
static fh_status linear_logits(const fh_pass *p, const fh_linear *lin, int prepare, float *tile, int64_t i0,
                               int64_t nb, int64_t v0, int64_t vb)
{
    const fh_gemm_input x = view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, lin->x_row_stride, 1);
    const fh_gemm_input w = view(lin->weight, elem_type(lin->weight_dtype), v0 * lin->w_stride_vocab,
                                 lin->w_stride_hidden, lin->w_stride_vocab);
    const fh_gemm_output z = f32_output(tile, vb, 1);
    return fh_pass_multiply(p, prepare, nb, vb, lin->hidden, &x, &w, 0, &z);
}

/* The pass's logits tile, and with a pair the companion's beside it (in the companion tile, at the same place). */
fh_status fh_pass_logits(const fh_pass *p, int prepare, float *tile, int64_t i0, int64_t nb,
                                int64_t v0, int64_t vb)
{
    fh_status st = linear_logits(p, p->in.lin, prepare, tile, i0, nb, v0, vb);
    if (st == FH_OK && p->in.pair && p->in.pair->companion)
        st = linear_logits(p, p->in.pair->companion, prepare, p->ws.companion_tile + (tile - p->ws.tile), i0, nb, v0,
                           vb);
    return st;
}

/* dx[i0:i0+nb, :] (+)= du (nb x len) wt (len x H), into the f32 accumulator of a bf16 dx or into dx itself. */
fh_status fh_pass_dx_product(const fh_pass *p, int prepare, int64_t i0, int64_t nb, int64_t len,
                            const fh_gemm_input *du, const fh_gemm_input *wt, int accumulate)
{
    const fh_linear_grads *grads = p->in.grads;
    const int64_t h = p->in.lin->hidden;
    if (p->sinks.dx == FH_DX_ACCUMULATOR || p->sinks.dx == FH_DX_BLOCK) {
        const fh_gemm_output acc = f32_output(p->sinks.dx == FH_DX_BLOCK ? p->ws.dx_block : p->ws.dx_acc + i0 * h, h, 1);
        return fh_pass_multiply(p, prepare, nb, h, len, du, wt, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dx_dtype);
    const fh_gemm_output dx = {(char *)grads->dx + (size_t)(i0 * grads->dx_row_stride) * elem_size(type),
                               grads->dx_row_stride, 1, type};
    return fh_pass_multiply(p, prepare, nb, h, len, du, wt, accumulate || grads->dx_beta != 0.0f, &dx);
}

/* dx[i0:i0+nb, :] (+)= dU[:, j0:j0+len] W[:, v0+j0:v0+j0+len]^T, dU the nb x vb rows of the tile from tile_row.
 * accumulate: a later tile of the call. */
fh_status fh_pass_add_dx(const fh_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                        int64_t vb, int64_t j0, int64_t len, int accumulate)
{
    const fh_linear *lin = p->in.lin;
    const fh_gemm_input du = fh_du_view(p, tile_row, i0, vb, j0);
    /* fp32_du: w32 holds the tile's columns row-major, H x vb. */
    const fh_gemm_input wt = p->in.plan->fp32_du ? view(p->ws.w32, FH_ELEM_F32, j0, 1, vb)
                                              : view(lin->weight, elem_type(lin->weight_dtype),
                                                     (v0 + j0) * lin->w_stride_vocab, lin->w_stride_vocab,
                                                     lin->w_stride_hidden);
    return fh_pass_dx_product(p, prepare, i0, nb, len, &du, &wt, accumulate);
}

/* X[i0:i0+nb, :]^T as the dweight GEMM reads it (fp32_du: x32 holds the tile's rows, nb x H). */
fh_gemm_input fh_pass_x_transposed(const fh_pass *p, int64_t i0)
{
    const fh_linear *lin = p->in.lin;
    return p->in.plan->fp32_du ? view(p->ws.x32, FH_ELEM_F32, 0, 1, lin->hidden)
                            : view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, 1, lin->x_row_stride);
}

/* dweight[:, v0+j0:v0+j0+len] (+)= X[i0:i0+nb, :]^T dU[:, j0:j0+len] (tile rows from tile_row). accumulate: a
 * later row tile of the call. */
fh_status fh_pass_add_dweight(const fh_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb,
                             int64_t v0, int64_t vb, int64_t j0, int64_t len, int accumulate)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const int64_t h = lin->hidden;
    const fh_gemm_input xt = fh_pass_x_transposed(p, i0);
    const fh_gemm_input du = fh_du_view(p, tile_row, i0, vb, j0);
    if (p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR) {
        const int by_vocab = p->sinks.by_vocab;
        const fh_gemm_output acc = f32_output(p->ws.dw_acc + (by_vocab ? j0 : j0 * h), by_vocab ? vb : 1,
                                              by_vocab ? 1 : h);
        return fh_pass_multiply(p, prepare, h, len, nb, &xt, &du, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dweight_dtype);
    const fh_gemm_output dw = {(char *)grads->dweight + (size_t)((v0 + j0) * lin->w_stride_vocab) * elem_size(type),
                               lin->w_stride_hidden, lin->w_stride_vocab, type};
    return fh_pass_multiply(p, prepare, h, len, nb, &xt, &du, accumulate || grads->dweight_beta != 0.0f, &dw);
}

/* dweight after bf16 row blocks (dweight_after_blocks): one GEMM over every row per dU chunk, in vocabulary order, so
 * that a chunk kept in dweight's memory is read before the GEMMs write that far; made ready (prepare) or run. */
fh_status fh_pass_dweight_by_chunks(const fh_pass *p, int prepare)
{
    const int64_t vocab = p->in.lin->vocab, t = fh_du_chunk(p, vocab);
    fh_status st = FH_OK;
    for (int64_t j0 = 0; j0 < vocab && st == FH_OK; j0 += t)
        st = fh_pass_add_dweight(p, prepare, 0, 0, p->in.lin->n, 0, vocab, j0, min64(t, vocab - j0), 0);
    return st;
}

/* out (+)= acc, rounded once to bf16: rows of cols contiguous elements, at acc_stride and out_stride. */
void fh_round_into_bf16(const float *acc, int64_t acc_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                            int64_t cols, int accumulate, int threads)
{
    (void)threads; /* read by OpenMP only (the fuzz build has none) */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        fh_row_add_to_bf16(acc + r * acc_stride, cols, accumulate, out + r * out_stride);
}

void fh_copy_x_rows(const fh_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear *lin = p->in.lin;
    const uint16_t *x = lin->x;
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++)
        for (int64_t k = 0; k < lin->hidden; k++)
            p->ws.x32[r * lin->hidden + k] = fh_bf16_to_f32(x[(i0 + r) * lin->x_row_stride + k]);
}

/* dbias = sum of columns, with beta: 0 overwrites without reading; a bf16 dbias is rounded from fp32. */
void fh_write_bias_gradient(const fh_linear_grads *grads, const double *column, int64_t v0, int64_t count)
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
void fh_add_column_sums(const float *tile, int64_t rows, int64_t cols, double *column, int threads)
{
    (void)threads; /* read by OpenMP only (the fuzz build has none) */
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = cols * me / parts, end = cols * (me + 1) / parts;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = begin; j < end; j++)
                column[j] += tile[r * cols + j];
    }
}

/* ---- A pair of heads (fh_pair_kernels) ---- */

/* The companion's row beside a row of the pass's tile (NULL without a companion). */
float *fh_companion_row(const fh_pass *p, const float *row)
{
    return p->ws.companion_tile ? p->ws.companion_tile + (row - p->ws.tile) : NULL;
}

/* Both rows of a tile row (columns v0..v0 + vb - 1) made ready for the pair's kernels: lin's transformed, the
 * companion's with its bias added (the kernels scale both). */
void fh_pair_rows(const fh_pass *p, float *row, int64_t v0, int64_t vb)
{
    static const fh_transform identity = FH_IDENTITY_TRANSFORM;
    const fh_linear *c = p->in.pair->companion;
    fh_row_transform(row, vb, p->in.lin->bias ? p->in.lin->bias + v0 : NULL, &p->in.tf);
    if (c)
        fh_row_transform(fh_companion_row(p, row), vb, c->bias ? c->bias + v0 : NULL, &identity);
}
