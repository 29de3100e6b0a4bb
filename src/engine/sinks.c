/* Where a pass's gradients live, resolved once when the pass begins (fh_pass_begin), and the addresses every loop
 * takes from that: the dU chunks of row blocks that keep every row's dU, a dx row or dweight element in f32. */
#include "pass.h"

#include <string.h>

void fh_pass_begin(fh_pass *p, const fh_engine_pass *in)
{
    const fh_plan *plan = in->plan;
    const fh_linear_grads *grads = in->grads;
    p->in = *in;
    p->ws = *in->ws;
    if (plan->tile_in_dweight)
        p->ws.tile = (float *)((char *)grads->dweight + plan->tile_at_byte);
    p->filter = grads && plan->filter_eps > 0.0;
    const int bf16_dx = grads && grads->dx_dtype == FH_DTYPE_BF16;
    const int bf16_dweight = grads && grads->dweight_dtype == FH_DTYPE_BF16;
    p->sinks.dx = bf16_dx && !plan->row_blocks ? FH_DX_ACCUMULATOR
                  : bf16_dx && p->ws.dx_block  ? FH_DX_BLOCK
                                               : FH_DX_DIRECT;
    p->sinks.dweight = plan->row_blocks && (plan->bf16_du || plan->f32_du_chunks) && !plan->dw_block_acc
                           ? FH_DWEIGHT_AFTER_BLOCKS
                       : bf16_dweight && (!plan->row_blocks || plan->dw_block_acc) ? FH_DWEIGHT_ACCUMULATOR
                                                                                    : FH_DWEIGHT_DIRECT;
    p->sinks.by_vocab = in->lin->w_stride_vocab <= in->lin->w_stride_hidden;
    p->sinks.dw_overwrites = p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR || (grads && grads->dweight_beta == 0.0f);
}

/* Columns per dU chunk: the plan's in row blocks (fh_plan), one chunk per tile when streaming. */
int64_t fh_du_chunk(const fh_pass *p, int64_t vb)
{
    return p->in.plan->row_blocks ? p->in.plan->du_chunk : vb;
}

/* Every row's dU in row blocks that keep it (bf16_du, f32_du_chunks), chunk c (columns c T .. c T + width - 1 of
 * every row, n x width): the first du_chunks_in_dweight chunks in dweight's memory, the others in the du buffer. */
static char *du_chunk_at(const fh_pass *p, int64_t c)
{
    const fh_plan *plan = p->in.plan;
    const int64_t n = p->in.lin->n, t = plan->du_chunk;
    const size_t size = plan->f32_du_chunks ? sizeof(float) : sizeof(uint16_t);
    if (c < plan->du_chunks_in_dweight)
        return (char *)p->in.grads->dweight + plan->du_at_byte + (size_t)(n * c * t) * size;
    return (char *)p->ws.du + (size_t)(n * (c - plan->du_chunks_in_dweight) * t) * size;
}

float *fh_du_chunk_rows(const fh_pass *p, int64_t c, int64_t i)
{
    const int64_t width = min64(p->in.plan->du_chunk, p->in.lin->vocab - c * p->in.plan->du_chunk);
    return (float *)du_chunk_at(p, c) + i * width;
}

void fh_chunk_row_load(const fh_pass *p, int64_t i, float *row)
{
    const int64_t vocab = p->in.lin->vocab, t = p->in.plan->du_chunk;
    for (int64_t c = 0; c * t < vocab; c++)
        memcpy(row + c * t, fh_du_chunk_rows(p, c, i), (size_t)min64(t, vocab - c * t) * sizeof(float));
}

void fh_chunk_row_store(const fh_pass *p, int64_t i, const float *row)
{
    const int64_t vocab = p->in.lin->vocab, t = p->in.plan->du_chunk;
    for (int64_t c = 0; c * t < vocab; c++)
        memcpy(fh_du_chunk_rows(p, c, i), row + c * t, (size_t)min64(t, vocab - c * t) * sizeof(float));
}

/* The dU rows of a tile (rows i0.. of the call, from row tile_row of the tile), from column j0 within one chunk, as
 * the gradient GEMMs read them: the f32 tile itself, or (bf16_du) the rows rounded into the du buffer (one tile
 * when streaming), or in row blocks that keep every row's dU the chunk that holds them. */
fh_gemm_input fh_du_view(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t vb, int64_t j0)
{
    const fh_plan *plan = p->in.plan;
    if (!plan->bf16_du && !plan->f32_du_chunks)
        return view(p->ws.tile, FH_ELEM_F32, tile_row * vb + j0, vb, 1);
    if (!plan->row_blocks || plan->dw_block_acc)
        return view(p->ws.du, FH_ELEM_BF16, tile_row * vb + j0, vb, 1);
    const int64_t t = plan->du_chunk, c = j0 / t, width = min64(t, vb - c * t);
    return view(du_chunk_at(p, c), plan->f32_du_chunks ? FH_ELEM_F32 : FH_ELEM_BF16, i0 * width + j0 - c * t, width,
                1);
}

/* With bf16_du, row r (of the rows at i0; tile row tile_row) of the tile's dU rounded into its place, inside the row
 * loop while it is hot: the du buffer's tile row (streaming, and row blocks with dw_block_acc), or every row's
 * chunks (row blocks); with f32_du_chunks stored back into the chunks it was loaded from. */
void fh_round_du_row(const fh_pass *p, const float *row, int64_t tile_row, int64_t i0, int64_t r, int64_t vb)
{
    const fh_plan *plan = p->in.plan;
    if (!plan->bf16_du && !plan->f32_du_chunks)
        return;
    if (!plan->row_blocks || plan->dw_block_acc) {
        fh_row_to_bf16(row, vb, p->ws.du + tile_row * vb);
        return;
    }
    if (plan->f32_du_chunks) {
        fh_chunk_row_store(p, i0 + r, row);
        return;
    }
    const int64_t t = plan->du_chunk;
    for (int64_t c = 0; c * t < vb; c++) {
        const int64_t width = min64(t, vb - c * t);
        fh_row_to_bf16(row + c * t, width, (uint16_t *)du_chunk_at(p, c) + (i0 + r) * width);
    }
}

/* Where the exact terms of row i (of the segment at i0) add into dx: f32 in every filtered case (dx_acc for a
 * streamed bf16 dx, dx_block for a bf16 dx in row blocks, else the fp32 dx). */
float *fh_dx_row_f32(const fh_pass *p, int64_t i, int64_t i0)
{
    const int64_t h = p->in.lin->hidden;
    if (p->sinks.dx == FH_DX_ACCUMULATOR)
        return p->ws.dx_acc + i * h;
    if (p->sinks.dx == FH_DX_BLOCK)
        return p->ws.dx_block + (i - i0) * h;
    return (float *)p->in.grads->dx + i * p->in.grads->dx_row_stride;
}

void fh_walk(int threads, int64_t hidden, int along_vocab, int64_t j0, int64_t count, const int64_t *columns,
             fh_run_fn *body, const void *self)
{
    (void)threads; /* read by OpenMP only (the fuzz build has none) */
    const int64_t runs = along_vocab ? hidden : count;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < runs; r++) {
        const fh_run run = along_vocab ? (fh_run){r, j0, 0, count, 1, columns}
                                       : (fh_run){0, columns ? columns[r] : j0 + r, r, hidden, 0, columns};
        body(self, &run);
    }
}
