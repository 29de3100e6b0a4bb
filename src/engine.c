/* Tile loops. Both passes walk vocabulary tiles in the outer loop and token blocks in the inner one:
 * a dweight tile (H x tile_vocab) is finished before moving on, so the H x V accumulator is written
 * once per row block of its own tile and never revisited; dx (N x H, usually the smaller) is the one
 * re-accumulated per vocabulary tile. bf16 gradients that several GEMMs add up go through f32 accumulators
 * (dx_acc, dw_acc) and are rounded once; in row blocks dx is summed per block over the dU chunks (in f32, dx_block,
 * when it is bf16) and dweight is one GEMM per chunk after the last block, over the bf16 dU of every row, written
 * directly. */
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

/* Columns per dU chunk: the plan's in row blocks (fh_plan), one chunk per tile when streaming. */
static int64_t du_chunk(const fh_engine_pass *p, int64_t vb)
{
    return p->plan->row_blocks ? p->plan->du_chunk : vb;
}

/* Every row's bf16 dU in row blocks, chunk c (columns c T .. c T + width - 1 of every row, n x width): the first
 * du_chunks_in_dweight chunks in dweight's memory, the others in the du buffer. */
static uint16_t *du_chunk_at(const fh_engine_pass *p, int64_t c)
{
    const fh_plan *plan = p->plan;
    const int64_t n = p->lin->n, t = plan->du_chunk;
    if (c < plan->du_chunks_in_dweight)
        return (uint16_t *)p->grads->dweight + plan->du_at_element + n * c * t;
    return p->ws->du + n * (c - plan->du_chunks_in_dweight) * t;
}

/* The dU rows of a tile (rows i0.. of the call, from row tile_row of the tile), from column j0 within one chunk, as
 * the gradient GEMMs read them: the f32 tile itself, or (bf16_du) the rows rounded into the du buffer (one tile
 * when streaming), or in row blocks the chunk that holds them. */
static fh_gemm_input du_view(const fh_engine_pass *p, int64_t tile_row, int64_t i0, int64_t vb, int64_t j0)
{
    if (!p->plan->bf16_du)
        return view(p->ws->tile, FH_ELEM_F32, tile_row * vb + j0, vb, 1);
    if (!p->plan->row_blocks)
        return view(p->ws->du, FH_ELEM_BF16, tile_row * vb + j0, vb, 1);
    const int64_t t = p->plan->du_chunk, c = j0 / t, width = min64(t, vb - c * t);
    return view(du_chunk_at(p, c), FH_ELEM_BF16, i0 * width + j0 - c * t, width, 1);
}

/* One GEMM of a pass, made ready (prepare) or run. */
static fh_status multiply(const fh_engine_pass *p, int prepare, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c)
{
    if (prepare)
        return fh_gemm_prepare(p->ws->gemm_cache, &p->ws->scratch, m, n, k, a, b, accumulate, c, p->plan->threads);
    return fh_gemm(*p->ws->gemm_cache, &p->ws->scratch, m, n, k, a, b, accumulate, c, p->plan->threads);
}

/* tile[nb x vb] = X[i0:i0+nb, :] W[:, v0:v0+vb] of lin (the pass's own, or its pair's companion); the transform
 * is applied per row by the caller, while the row is hot in cache. */
static fh_status linear_logits(const fh_engine_pass *p, const fh_linear *lin, int prepare, float *tile, int64_t i0,
                               int64_t nb, int64_t v0, int64_t vb)
{
    const fh_gemm_input x = view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, lin->x_row_stride, 1);
    const fh_gemm_input w = view(lin->weight, elem_type(lin->weight_dtype), v0 * lin->w_stride_vocab,
                                 lin->w_stride_hidden, lin->w_stride_vocab);
    const fh_gemm_output z = f32_output(tile, vb, 1);
    return multiply(p, prepare, nb, vb, lin->hidden, &x, &w, 0, &z);
}

/* The pass's logits tile, and with a pair the companion's beside it (in the companion tile, at the same place). */
static fh_status compute_logits(const fh_engine_pass *p, int prepare, float *tile, int64_t i0, int64_t nb,
                                int64_t v0, int64_t vb)
{
    fh_status st = linear_logits(p, p->lin, prepare, tile, i0, nb, v0, vb);
    if (st == FH_OK && p->pair)
        st = linear_logits(p, p->pair->companion, prepare, p->ws->companion_tile + (tile - p->ws->tile), i0, nb, v0,
                           vb);
    return st;
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

/* A bf16 dx of a row block summed over several GEMMs (filtered ones, or one per dU chunk) is formed in f32
 * (dx_block) and rounded once at the block's end. */
static int dx_in_block(const fh_engine_pass *p)
{
    return p->ws->dx_block && p->grads->dx_dtype == FH_DTYPE_BF16;
}

/* dx[i0:i0+nb, :] (+)= du (nb x len) wt (len x H), into the f32 accumulator of a bf16 dx or into dx itself. */
static fh_status dx_product(const fh_engine_pass *p, int prepare, int64_t i0, int64_t nb, int64_t len,
                            const fh_gemm_input *du, const fh_gemm_input *wt, int accumulate)
{
    const fh_linear_grads *grads = p->grads;
    const int64_t h = p->lin->hidden;
    if (dx_accumulated(p) || dx_in_block(p)) {
        const fh_gemm_output acc = f32_output(dx_in_block(p) ? p->ws->dx_block : p->ws->dx_acc + i0 * h, h, 1);
        return multiply(p, prepare, nb, h, len, du, wt, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dx_dtype);
    const fh_gemm_output dx = {(char *)grads->dx + (size_t)(i0 * grads->dx_row_stride) * elem_size(type),
                               grads->dx_row_stride, 1, type};
    return multiply(p, prepare, nb, h, len, du, wt, accumulate || grads->dx_beta != 0.0f, &dx);
}

/* dx[i0:i0+nb, :] (+)= dU[:, j0:j0+len] W[:, v0+j0:v0+j0+len]^T, dU the nb x vb rows of the tile from tile_row.
 * accumulate: a later tile of the call. */
static fh_status add_dx(const fh_engine_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                        int64_t vb, int64_t j0, int64_t len, int accumulate)
{
    const fh_linear *lin = p->lin;
    const fh_gemm_input du = du_view(p, tile_row, i0, vb, j0);
    /* fp32_dz: w32 holds the tile's columns row-major, H x vb. */
    const fh_gemm_input wt = p->plan->fp32_dz ? view(p->ws->w32, FH_ELEM_F32, j0, 1, vb)
                                              : view(lin->weight, elem_type(lin->weight_dtype),
                                                     (v0 + j0) * lin->w_stride_vocab, lin->w_stride_vocab,
                                                     lin->w_stride_hidden);
    return dx_product(p, prepare, i0, nb, len, &du, &wt, accumulate);
}

/* X[i0:i0+nb, :]^T as the dweight GEMM reads it (fp32_dz: x32 holds the tile's rows, nb x H). */
static fh_gemm_input x_transposed(const fh_engine_pass *p, int64_t i0)
{
    const fh_linear *lin = p->lin;
    return p->plan->fp32_dz ? view(p->ws->x32, FH_ELEM_F32, 0, 1, lin->hidden)
                            : view(lin->x, elem_type(lin->x_dtype), i0 * lin->x_row_stride, 1, lin->x_row_stride);
}

/* dweight[:, v0+j0:v0+j0+len] (+)= X[i0:i0+nb, :]^T dU[:, j0:j0+len] (tile rows from tile_row). accumulate: a
 * later row tile of the call. */
static fh_status add_dweight(const fh_engine_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb,
                             int64_t v0, int64_t vb, int64_t j0, int64_t len, int accumulate)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const int64_t h = lin->hidden;
    const fh_gemm_input xt = x_transposed(p, i0);
    const fh_gemm_input du = du_view(p, tile_row, i0, vb, j0);
    if (dweight_accumulated(p)) {
        const int by_vocab = dw_acc_by_vocab(lin);
        const fh_gemm_output acc = f32_output(p->ws->dw_acc + (by_vocab ? j0 : j0 * h), by_vocab ? vb : 1,
                                              by_vocab ? 1 : h);
        return multiply(p, prepare, h, len, nb, &xt, &du, accumulate, &acc);
    }
    const fh_elem_type type = elem_type(grads->dweight_dtype);
    const fh_gemm_output dw = {(char *)grads->dweight + (size_t)((v0 + j0) * lin->w_stride_vocab) * elem_size(type),
                               lin->w_stride_hidden, lin->w_stride_vocab, type};
    return multiply(p, prepare, h, len, nb, &xt, &du, accumulate || grads->dweight_beta != 0.0f, &dw);
}

/* dweight after bf16 row blocks (dweight_after_blocks): one GEMM over every row per dU chunk, in vocabulary order, so
 * that a chunk kept in dweight's memory is read before the GEMMs write that far; made ready (prepare) or run. */
static fh_status dweight_by_chunks(const fh_engine_pass *p, int prepare)
{
    const int64_t vocab = p->lin->vocab, t = du_chunk(p, vocab);
    fh_status st = FH_OK;
    for (int64_t j0 = 0; j0 < vocab && st == FH_OK; j0 += t)
        st = add_dweight(p, prepare, 0, 0, p->lin->n, 0, vocab, j0, min64(t, vocab - j0), 0);
    return st;
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

static int filtering(const fh_engine_pass *p)
{
    return p->plan->filter_eps > 0.0;
}

/* ---- Gathered GEMMs of gradient filtering ----
 * Filtering runs the gradient GEMMs on the kept columns only, FH_FILTER_CHUNK at a time: their dU (an f32 tile's
 * rows compacted in place, the kept columns first; a bf16 dU gathered into gathered_du, rows x width, as the bf16
 * rows of every block stay whole for dweight after the blocks), their weight rows gathered into gathered_w
 * (width x H) and their dweight out of gathered_dw (H x width, along dweight's contiguous direction), in the
 * element type of dU. A bf16
 * chunk is padded with zeros to a power of two of at least 32 columns, so that the oneDNN primitives have few
 * shapes, all made ready up front; BLIS takes any. */
static int64_t gathered_width(const fh_engine_pass *p, int64_t count)
{
    if (!p->plan->bf16_du)
        return count;
    int64_t width = 32;
    while (width < count)
        width *= 2;
    return width;
}

static fh_elem_type du_type(const fh_engine_pass *p)
{
    return p->plan->bf16_du ? FH_ELEM_BF16 : FH_ELEM_F32;
}

/* dx rows i0.. (+)= the kept dU (nb x width) times the gathered weight rows: filtered dx GEMMs always add (dx is
 * zeroed before the first). */
static fh_status gathered_dx(const fh_engine_pass *p, int prepare, int64_t i0, int64_t nb, int64_t width,
                             const fh_gemm_input *du)
{
    const fh_gemm_input wt = view(p->ws->gathered_w, du_type(p), 0, p->lin->hidden, 1);
    return dx_product(p, prepare, i0, nb, width, du, &wt, 1);
}

/* Element (k, c) of gathered_dw, a chunk of width columns: laid out as dweight runs, so that it is scattered in
 * order. */
static float *gathered_dw_at(const fh_engine_pass *p, int64_t k, int64_t c, int64_t width)
{
    return p->ws->gathered_dw + (dw_acc_by_vocab(p->lin) ? k * width + c : c * p->lin->hidden + k);
}

/* gathered_dw (+)= X[i0:i0+nb, :]^T times the kept dU. */
static fh_status gathered_dweight(const fh_engine_pass *p, int prepare, int64_t i0, int64_t nb, int64_t width,
                                  const fh_gemm_input *du, int accumulate)
{
    const fh_gemm_input xt = x_transposed(p, i0);
    const int by_vocab = dw_acc_by_vocab(p->lin);
    const fh_gemm_output dw = f32_output(p->ws->gathered_dw, by_vocab ? width : 1, by_vocab ? 1 : p->lin->hidden);
    return multiply(p, prepare, p->lin->hidden, width, nb, &xt, du, accumulate, &dw);
}

/* Every gathered bf16 GEMM shape of a row tile of nb rows (BLIS makes nothing ready). */
static fh_status prepare_gathered(const fh_engine_pass *p, int64_t nb)
{
    const fh_linear_grads *grads = p->grads;
    fh_status st = FH_OK;
    for (int64_t width = gathered_width(p, 1); p->plan->bf16_du && width <= FH_FILTER_CHUNK && st == FH_OK;
         width *= 2) {
        const fh_gemm_input du = view(p->ws->gathered_du, FH_ELEM_BF16, 0, width, 1);
        if (grads->dx)
            st = gathered_dx(p, 1, 0, nb, width, &du);
        /* After bf16 row blocks, dweight's chunks add up the row blocks' products. */
        for (int accumulate = 0; accumulate <= dweight_after_blocks(p) && grads->dweight && st == FH_OK; accumulate++)
            st = gathered_dweight(p, 1, 0, nb, width, &du, accumulate);
    }
    return st;
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
    for (int h = 0; h < 2; h++) {
        if (grads && filtering(p) && st == FH_OK)
            st = prepare_gathered(p, heights[h]);
        for (int w = 0; w < 2; w++) {
            st = st == FH_OK ? compute_logits(p, 1, p->ws->tile, 0, heights[h], 0, widths[w]) : st;
            /* The tile's first dU chunk and its last, maybe narrower, one. Filtering runs these too where it keeps
             * every column (all_kept_gemms). */
            const int64_t t = du_chunk(p, widths[w]), firsts[2] = {0, (widths[w] - 1) / t * t};
            for (int k = 0; k < 2; k++)
                for (int accumulate = 0; grads && accumulate < 2; accumulate++) {
                    const int64_t len = min64(t, widths[w] - firsts[k]);
                    if (st == FH_OK && grads->dx)
                        st = add_dx(p, 1, 0, 0, heights[h], 0, widths[w], firsts[k], len, accumulate);
                    if (st == FH_OK && grads->dweight && !dweight_after_blocks(p))
                        st = add_dweight(p, 1, 0, 0, heights[h], 0, widths[w], firsts[k], len, accumulate);
                }
        }
    }
    if (st == FH_OK && grads && grads->dweight && dweight_after_blocks(p))
        st = dweight_by_chunks(p, 1);
    return st;
}

/* out (+)= acc, rounded once to bf16: rows of cols contiguous elements, at acc_stride and out_stride. */
static void round_into_bf16(const float *acc, int64_t acc_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                            int64_t cols, int accumulate, int threads)
{
    (void)threads; /* read by OpenMP only (the fuzz build has none) */
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

/* The companion's row beside a row of the pass's tile. */
static float *companion_row(const fh_engine_pass *p, const float *row)
{
    return p->ws->companion_tile + (row - p->ws->tile);
}

/* Both rows of a tile row (columns v0..v0 + vb - 1) made ready for the pair's kernels: lin's transformed, the
 * companion's with its bias added (the kernels scale both). */
static void pair_rows(const fh_engine_pass *p, float *row, int64_t v0, int64_t vb)
{
    static const fh_transform identity = {0.0f, 1.0f};
    const fh_linear *c = p->pair->companion;
    fh_row_transform(row, vb, p->lin->bias ? p->lin->bias + v0 : NULL, &p->tf);
    fh_row_transform(companion_row(p, row), vb, c->bias ? c->bias + v0 : NULL, &identity);
}

/* Folds rows [i0, i0 + nb) of a forward tile (columns v0 .. v0 + vb - 1) into p->stats, or with a pair through its
 * kernels' pass `pass`. Until the pass ends, the lse array holds the running max and sum_pz's the running sum of
 * z exp(z - max). */
static void fold_tile(const fh_engine_pass *p, int pass, float *tile, int64_t i0, int64_t nb, int64_t v0, int64_t vb)
{
    const fh_token_stats *stats = p->stats;
    const int64_t vocab = p->lin->vocab;
    if (p->pair) {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t r = 0; r < nb; r++) {
            float *row = tile + r * vb;
            pair_rows(p, row, v0, vb);
            p->pair->fold(p->pair->self, pass, i0 + r, row, companion_row(p, row), vb, v0);
        }
        return;
    }
    double *const running_max = stats->lse, *const running_sum_z_exp = stats->sum_pz;
    const fh_fold_request request = {p->class_weights ? p->class_weights + v0 : NULL, stats->sum_weighted_z != NULL,
                                     running_sum_z_exp != NULL, 0, NULL};
    const float *bias = p->lin->bias ? p->lin->bias + v0 : NULL;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        const int64_t i = i0 + r;
        fh_row_transform(tile + r * vb, vb, bias, &p->tf);
        fh_fold_state st = {running_max[i], stats->sum_exp[i], stats->z_target[i],
                            stats->sum_weighted_z ? stats->sum_weighted_z[i] : 0.0,
                            running_sum_z_exp ? running_sum_z_exp[i] : 0.0, stats->argmax ? stats->argmax[i] : 0};
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

/* Before the first tile: every row's running statistics at their start (a pair's head sets its own). */
static void begin_statistics(const fh_engine_pass *p)
{
    const fh_token_stats *stats = p->stats;
    const fh_fold_state initial = fh_fold_state_initial();
    if (p->pair)
        return;
    for (int64_t i = 0; i < p->lin->n; i++) {
        stats->lse[i] = initial.max;
        stats->sum_exp[i] = 0.0;
        stats->z_target[i] = 0.0;
        if (stats->sum_weighted_z)
            stats->sum_weighted_z[i] = 0.0;
        if (stats->sum_pz)
            stats->sum_pz[i] = 0.0;
        if (stats->argmax)
            stats->argmax[i] = 0;
    }
}

/* After the last tile of pass `pass`: the final statistics, or the pair's end of that pass for every row. */
static void finish_statistics(const fh_engine_pass *p, int pass)
{
    const fh_token_stats *stats = p->stats;
    const int64_t n = p->lin->n;
    if (p->pair) {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t i = 0; i < n; i++)
            p->pair->finish(p->pair->self, pass, i);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const double running_max = stats->lse[i];
        stats->lse[i] = running_max + log(stats->sum_exp[i]);
        if (stats->sum_pz)
            stats->sum_pz[i] /= stats->sum_exp[i];
    }
}

fh_status fh_engine_forward(const fh_engine_pass *p)
{
    const fh_status prepared = fh_engine_prepare(p);
    if (prepared != FH_OK)
        return prepared;
    const int64_t n = p->lin->n, vocab = p->lin->vocab;
    const int passes = p->pair ? p->pair->passes : 1;
    begin_statistics(p);
    for (int pass = 0; pass < passes; pass++) {
        for (int64_t v0 = 0; v0 < vocab; v0 += p->plan->tile_vocab) {
            const int64_t vb = min64(p->plan->tile_vocab, vocab - v0);
            for (int64_t i0 = 0; i0 < n; i0 += p->plan->tile_rows) {
                const int64_t nb = min64(p->plan->tile_rows, n - i0);
                const fh_status gemm = compute_logits(p, 0, p->ws->tile, i0, nb, v0, vb);
                if (gemm != FH_OK)
                    return gemm;
                fold_tile(p, pass, p->ws->tile, i0, nb, v0, vb);
            }
        }
        finish_statistics(p, pass);
    }
    return FH_OK;
}

static fh_coef coef_of(const fh_coef_arrays *coefs, int64_t i)
{
    const fh_coef k = {coefs->lse[i], coefs->a[i], coefs->b[i], coefs->c[i], coefs->e ? coefs->e[i] : 0.0,
                       coefs->sum_pz ? coefs->sum_pz[i] : 0.0, 0.0};
    return k;
}

/* With bf16_du, row r (of the rows at i0) of the tile's dU rounded into its place in the du buffer or its
 * chunks, inside the row loop while it is hot. */
static void round_du_row(const fh_engine_pass *p, const float *row, int64_t i0, int64_t r, int64_t vb)
{
    if (!p->plan->bf16_du)
        return;
    if (!p->plan->row_blocks) {
        fh_row_to_bf16(row, vb, p->ws->du + r * vb);
        return;
    }
    const int64_t t = p->plan->du_chunk;
    for (int64_t c = 0; c * t < vb; c++) {
        const int64_t width = min64(t, vb - c * t);
        fh_row_to_bf16(row + c * t, width, du_chunk_at(p, c) + (i0 + r) * width);
    }
}

/* ---- Gradient filtering (fh_context_set_grad_filter_eps) ----
 * dU = a p + e p (z - sum_pz) + c w + b [j = target] (times dz/du). While a row's dU is formed, gradient_and_marks
 * marks the columns where |dU| reaches eps times the row's scale, and the row's target column. A column of a tile
 * that no row of it marked is skipped by the dx and dweight GEMMs, which run on the kept columns gathered (above); its
 * softmax terms are replaced by the tail estimate r_i nu_j / S (or dropped: FH_FILTER_TAIL_DROP), and its c w
 * term, rank one without a softcap (dz/du = 1/T), is applied exactly as dx_i += c_i / T sum_j w_j W[:, j] and
 * dW[:, j] += w_j / T sum_i c_i x_i over the skipped columns; both go through skipped_term (below). dweight
 * columns honour beta through the `used` flags: a column is written (zeroed first when beta is 0 or it is an
 * accumulator) before anything is added to it, and columns nothing reached are zeroed at the end. */

/* The scale of row k's softmax terms, against which filtering measures them: max(|a|, |b|, |e|). A mean over N
 * tokens makes every dU of the order of 1/N, so an absolute eps would skip everything at a large N; relative to
 * the row's scale, |dU_j| < eps means p_j dz/du < eps in CE (a = -b), as Cut Cross-Entropy measures p. */
static double row_scale(const fh_coef *k)
{
    const double a = fabs(k->a), b = fabs(k->b), e = fabs(k->e);
    return a > b ? (a > e ? a : e) : (b > e ? b : e);
}

/* The marks of segment `segment` made by the calling thread: each thread of the row loop marks its own, so that
 * no two threads write one byte; keep_columns merges them. */
static uint8_t *thread_marks(const fh_engine_pass *p, int segment)
{
    const int64_t cols = p->plan->tile_vocab;
    return p->ws->marks + ((int64_t)segment * p->plan->threads + omp_get_thread_num()) * cols;
}

/* The calling thread's profile of segment `segment` for the tail estimate: the magnitudes of its rows' entries
 * below their thresholds, per column (f32, cleared by tail_profile). */
static float *thread_profile(const fh_engine_pass *p, int segment)
{
    const int64_t cols = p->plan->tile_vocab;
    return p->ws->tail_nu + ((int64_t)segment * p->plan->threads + omp_get_thread_num()) * cols;
}

/* Overwrites row tile_row (transformed logits, or their exps with coef->p_scale; columns of the tile's class weights
 * `weights`) with its dU. When filtering, records the row's c and marks the columns to keep as the dU is formed
 * (fh_row_marking), before any rounding; for the tail estimate, in the same pass, the sum of the row's softmax terms
 * below its threshold (tail_rows, less the kept columns' share later) and their magnitudes into the thread's
 * profile. A row of scale 0 has no softmax terms and marks nothing. */
static void gradient_and_marks(const fh_engine_pass *p, float *row, int64_t tile_row, int segment, int64_t vb,
                               int64_t target, const float *weights, const fh_coef *k)
{
    const fh_workspace *ws = p->ws;
    const int tail = p->plan->tail_estimate;
    const double threshold = p->plan->filter_eps * row_scale(k);
    fh_row_marking marking = {0.0f, 0.0f, NULL, NULL, 0.0};
    if (filtering(p)) {
        ws->row_c[tile_row] = k->c;
        if (tail) {
            ws->tail_rows[tile_row] = 0.0;
            ws->row_least[tile_row] = 0.0f;
        }
        if (threshold > 0.0) {
            /* The least float >= threshold: |dU| < threshold in double is |dU| < it in float. */
            marking.threshold = (float)threshold;
            if (marking.threshold < threshold)
                marking.threshold = nextafterf(marking.threshold, INFINITY);
            marking.c = (float)(k->c * p->tf.inv_temperature);
            marking.marks = thread_marks(p, segment);
            marking.nu = tail ? thread_profile(p, segment) : NULL;
        }
    }
    fh_row_gradient(row, vb, target, weights, k, &p->tf, marking.marks ? &marking : NULL);
    if (!marking.marks)
        return;
    if (tail) {
        ws->row_least[tile_row] = marking.threshold;
        ws->tail_rows[tile_row] = marking.tail;
    }
    if (target >= 0 && target < vb)
        marking.marks[target] = 1;
}

/* The tile's keep flags from the marks of segment `segment` (every column when unfiltered), the marks cleared for
 * the next tile; the kept columns listed in order. Returns their number. */
static int64_t keep_columns(const fh_engine_pass *p, int segment, int64_t vb, int unfiltered)
{
    const int64_t cols = p->plan->tile_vocab;
    const int threads = p->plan->threads;
    uint8_t *marks = p->ws->marks + (int64_t)segment * threads * cols, *keep = p->ws->keep;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < vb; j++) {
        uint8_t kept = (uint8_t)unfiltered;
        for (int t = 0; t < threads; t++) {
            kept |= marks[t * cols + j];
            marks[t * cols + j] = 0;
        }
        keep[j] = kept;
    }
    int64_t count = 0;
    for (int64_t j = 0; j < vb; j++)
        if (keep[j])
            p->ws->kept[count++] = j;
    return count;
}

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

/* The kept dU of a bf16 chunk: columns[0..count) of the nb bf16 rows at du (stride vb) gathered into gathered_du,
 * zeros up to width. */
static fh_gemm_input gather_du(const fh_engine_pass *p, const uint16_t *du, int64_t vb, int64_t nb,
                               const int64_t *columns, int64_t count, int64_t width)
{
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        uint16_t *dst = (uint16_t *)p->ws->gathered_du + r * width;
        const uint16_t *src = du + r * vb;
        for (int64_t c = 0; c < count; c++)
            dst[c] = src[columns[c]];
        memset(dst + count, 0, (size_t)(width - count) * sizeof *dst);
    }
    return view(p->ws->gathered_du, FH_ELEM_BF16, 0, width, 1);
}

/* The tail estimate's row sums count every entry of a row below its threshold (gradient_and_marks); those of its kept
 * columns are not skipped, so they come off. A row's threshold and c w term, as gradient_and_marks used them. */
typedef struct row_tail {
    float least, c;
} row_tail;

static row_tail row_tail_of(const fh_engine_pass *p, int64_t tile_row)
{
    const row_tail t = {p->ws->row_least[tile_row], (float)(p->ws->row_c[tile_row] * p->tf.inv_temperature)};
    return t;
}

/* The nb rows of the f32 tile from tile_row (vb columns, class weights `weights`): with move, their kept
 * columns[0..kept) moved to their front, in order, so that the GEMMs read them in place (an f32 dU); with the tail
 * estimate, the kept columns' share taken off each row's sum (also without move: a bf16 dU's f32 rows read in
 * place). */
static void compact_rows(const fh_engine_pass *p, int64_t tile_row, int64_t nb, int64_t vb, int64_t kept,
                         const float *weights, int move)
{
    const int tail = p->plan->tail_estimate;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        const row_tail t = tail ? row_tail_of(p, tile_row + r) : (row_tail){0.0f, 0.0f};
        float *row = p->ws->tile + (tile_row + r) * vb;
        const float *next = r + 1 < nb ? row + vb : NULL;
        const double share = fh_row_compact(row, p->ws->kept, kept, move, t.least, t.c, weights, next);
        if (tail)
            p->ws->tail_rows[tile_row + r] -= share;
    }
}

/* gathered_w = the weight's columns v0 + columns[0..count) of the tile as rows of H, in dU's element type (with
 * fp32_dz, from w32, the tile's columns already in f32), zeros up to width. */
static void gather_weight(const fh_engine_pass *p, int64_t v0, int64_t vb, const int64_t *columns, int64_t count,
                          int64_t width)
{
    const fh_linear *lin = p->lin;
    const int64_t h = lin->hidden;
    const size_t row_bytes = (size_t)h * elem_size(du_type(p));
    memset((char *)p->ws->gathered_w + (size_t)count * row_bytes, 0, (size_t)(width - count) * row_bytes);
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t c = 0; c < count; c++) {
        const int64_t j = columns[c];
        if (p->plan->bf16_du) {
            uint16_t *dst = (uint16_t *)p->ws->gathered_w + c * h;
            const uint16_t *src = (const uint16_t *)lin->weight + (v0 + j) * lin->w_stride_vocab;
            for (int64_t k = 0; k < h; k++)
                dst[k] = src[k * lin->w_stride_hidden];
        } else if (p->plan->fp32_dz) {
            float *dst = (float *)p->ws->gathered_w + c * h;
            for (int64_t k = 0; k < h; k++)
                dst[k] = p->ws->w32[k * vb + j];
        } else {
            float *dst = (float *)p->ws->gathered_w + c * h;
            const float *src = (const float *)lin->weight + (v0 + j) * lin->w_stride_vocab;
            for (int64_t k = 0; k < h; k++)
                dst[k] = src[k * lin->w_stride_hidden];
        }
    }
}

/* Where the exact terms of row i (of the segment at i0) add into dx: f32 in every filtered case (dx_acc for a
 * streamed bf16 dx, dx_block for a bf16 dx in row blocks, else the fp32 dx). */
static float *dx_row_f32(const fh_engine_pass *p, int64_t i, int64_t i0)
{
    const int64_t h = p->lin->hidden;
    if (dx_accumulated(p))
        return p->ws->dx_acc + i * h;
    if (dx_in_block(p))
        return p->ws->dx_block + (i - i0) * h;
    return (float *)p->grads->dx + i * p->grads->dx_row_stride;
}

/* Where they add into dweight (k, tile column jt), unless dweight_after_blocks: dw_acc for a streamed bf16
 * dweight, else the fp32 dweight. */
static float *dw_f32(const fh_engine_pass *p, int64_t k, int64_t jt, int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->lin;
    if (dweight_accumulated(p))
        return p->ws->dw_acc + (dw_acc_by_vocab(lin) ? k * vb + jt : jt * lin->hidden + k);
    return (float *)p->grads->dweight + k * lin->w_stride_hidden + (v0 + jt) * lin->w_stride_vocab;
}

/* dw_f32 (k, j) = dw_f32 (0, 0) + k * stride_k + j * stride_j. */
static void dw_strides(const fh_engine_pass *p, int64_t vb, int64_t *stride_k, int64_t *stride_j)
{
    const fh_linear *lin = p->lin;
    const int accumulator = dweight_accumulated(p), by_vocab = dw_acc_by_vocab(lin);
    *stride_k = accumulator ? (by_vocab ? vb : 1) : lin->w_stride_hidden;
    *stride_j = accumulator ? (by_vocab ? 1 : lin->hidden) : lin->w_stride_vocab;
}

/* Whether a dweight column that holds nothing of this call yet is written rather than added to: an accumulator,
 * or beta 0. The `used` flags say which columns hold something. */
static int dw_overwrites(const fh_engine_pass *p)
{
    return dweight_accumulated(p) || p->grads->dweight_beta == 0.0f;
}

/* dweight (k, tile column j) += value, or = value when the column is not used yet and overwritten. */
static void dw_add(const fh_engine_pass *p, int64_t k, int64_t j, int64_t v0, int64_t vb, float value)
{
    float *d = dw_f32(p, k, j, v0, vb);
    *d = p->ws->used[j] || !dw_overwrites(p) ? *d + value : value;
}

/* dweight's kept columns += gathered_dw (columns[0..count) of the tile of width `width`), along dweight's
 * contiguous direction; then they are used. */
static void scatter_dweight(const fh_engine_pass *p, int64_t v0, int64_t vb, const int64_t *columns, int64_t count,
                            int64_t width)
{
    const int64_t h = p->lin->hidden;
    if (dw_acc_by_vocab(p->lin)) {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t k = 0; k < h; k++)
            for (int64_t c = 0; c < count; c++)
                dw_add(p, k, columns[c], v0, vb, *gathered_dw_at(p, k, c, width));
    } else {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t c = 0; c < count; c++)
            for (int64_t k = 0; k < h; k++)
                dw_add(p, k, columns[c], v0, vb, *gathered_dw_at(p, k, c, width));
    }
    for (int64_t c = 0; c < count; c++)
        p->ws->used[columns[c]] = 1;
}

/* The dx (with_dx) and (unless after the blocks) dweight GEMMs of the kept columns of a tile's rows, a chunk at a
 * time. */
static fh_status kept_column_gemms(const fh_engine_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                                   int64_t vb, int64_t kept, int with_dx)
{
    const int dweight = p->grads->dweight && !dweight_after_blocks(p);
    if (!p->plan->bf16_du && kept < vb)
        compact_rows(p, tile_row, nb, vb, kept, p->class_weights ? p->class_weights + v0 : NULL, 1);
    fh_status st = FH_OK;
    for (int64_t c0 = 0; c0 < kept && st == FH_OK; c0 += FH_FILTER_CHUNK) {
        const int64_t *columns = p->ws->kept + c0;
        const int64_t count = min64(FH_FILTER_CHUNK, kept - c0), width = gathered_width(p, count);
        const fh_gemm_input du = p->plan->bf16_du
                                     ? gather_du(p, p->ws->du + (p->plan->row_blocks ? i0 : tile_row) * vb, vb, nb,
                                                 columns, count, width)
                                     : view(p->ws->tile, FH_ELEM_F32, tile_row * vb + c0, vb, 1);
        if (p->grads->dx && with_dx) {
            gather_weight(p, v0, vb, columns, count, width);
            st = gathered_dx(p, 0, i0, nb, width, &du);
        }
        if (st == FH_OK && dweight) {
            st = gathered_dweight(p, 0, i0, nb, width, &du, 0);
            if (st == FH_OK)
                scatter_dweight(p, v0, vb, columns, count, width);
        }
    }
    return st;
}

/* A tile that keeps every column runs the unfiltered GEMMs in place (nothing to gather): dx adds (it was zeroed),
 * dweight is written or added to as its columns' used flags say, or gathered when they differ. */
static fh_status all_kept_gemms(const fh_engine_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                                int64_t vb)
{
    fh_status st = p->grads->dx ? add_dx(p, 0, tile_row, i0, nb, v0, vb, 0, vb, 1) : FH_OK;
    if (st != FH_OK || !p->grads->dweight || dweight_after_blocks(p))
        return st;
    int64_t used = 0;
    for (int64_t j = 0; j < vb; j++)
        used += p->ws->used[j];
    if (used != 0 && used != vb)
        return kept_column_gemms(p, tile_row, i0, nb, v0, vb, vb, 0);
    st = add_dweight(p, 0, tile_row, i0, nb, v0, vb, 0, vb, used == vb || !dw_overwrites(p));
    memset(p->ws->used, 1, (size_t)vb);
    return st;
}

/* A rank-one term that filtering applies over a tile's skipped columns: dU_ij ~ rows[r] column(j), with column(j)
 * = scale * (profile ? profile[j] : weights ? weights[j] : 1). The c w term is exact (rows c, the class weights
 * over T); the tail estimate replaces the skipped softmax terms (rows r, the profile nu over S). Its H-vectors:
 * s = sum over the skipped columns of column(j) W[:, v0 + j] (dx_i += rows[r] s), g = sum over the tile's rows of
 * rows[r] x_i (dweight_j += column(j) g), and g_all, g summed over every row block (after bf16 row blocks). */
typedef struct skipped_term {
    const double *rows;
    const float *weights;
    const double *profile;
    double scale;
    double *s, *g, *g_all;
} skipped_term;

static double column_factor(const skipped_term *t, int64_t j)
{
    return t->scale * (t->profile ? t->profile[j] : t->weights ? (double)t->weights[j] : 1.0);
}

/* The terms' dweight values are formed a run of at most TERMS_RUN elements at a time. */
enum { TERMS_RUN = 256 };

/* values[e] (e < m) = dweight's value of the terms (1 or 2 of them) at (k, j + e) along the vocabulary, or at
 * (k + e, j) down a column (its factors then taken once): the sum over the terms of column(j) g[k], or g_all[k]
 * with all_blocks. */
static void terms_run(const skipped_term *terms, int count, int64_t k, int64_t j, int along_vocab, int64_t m,
                      int all_blocks, float *values)
{
    const double *g[2];
    double factor[2] = {0.0, 0.0}; /* a second factor of 0 with a single term */
    for (int t = 0; t < 2; t++) {
        const skipped_term *term = &terms[t < count ? t : 0];
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
static void skipped_weight_sums(const fh_engine_pass *p, int64_t v0, int64_t vb, const skipped_term *terms, int count)
{
    const fh_linear *lin = p->lin;
    const uint8_t *keep = p->ws->keep;
    double *factors = p->ws->factors; /* count x vb */
    const int hidden_inner = lin->w_stride_hidden <= lin->w_stride_vocab;
    const int bf16 = lin->weight_dtype == FH_DTYPE_BF16;
#pragma omp parallel num_threads(p->plan->threads)
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
static void weighted_rows(const fh_engine_pass *p, const double *rows, int64_t i0, int64_t nb, int accumulate,
                          double *g)
{
#pragma omp parallel num_threads(p->plan->threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t k0 = p->lin->hidden * me / parts, k1 = p->lin->hidden * (me + 1) / parts;
        for (int64_t k = k0; !accumulate && k < k1; k++)
            g[k] = 0.0;
        for (int64_t r = 0; r < nb; r++)
            for (int64_t k = k0; k < k1; k++)
                g[k] += rows[r] * x_at(p->lin, i0 + r, k);
    }
}

/* dweight's skipped columns j of the tile += sum of the terms' column(j) g, along dweight's contiguous direction
 * (or = when the column holds nothing yet and is overwritten); then they are used. */
static void skipped_columns_term(const fh_engine_pass *p, int64_t v0, int64_t vb, const skipped_term *terms,
                                 int count)
{
    const int64_t h = p->lin->hidden;
    const uint8_t *keep = p->ws->keep, *used = p->ws->used;
    const int overwrites = dw_overwrites(p);
    float *base = dw_f32(p, 0, 0, v0, vb);
    int64_t stride_k, stride_j;
    dw_strides(p, vb, &stride_k, &stride_j);
    /* runs along the contiguous direction: each row k over the tile, or each skipped column over H */
    const int by_vocab = dw_acc_by_vocab(p->lin);
    const int64_t runs = by_vocab ? h : vb, length = by_vocab ? vb : h;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < runs; r++) {
        float values[TERMS_RUN];
        for (int64_t e0 = 0; e0 < length && (by_vocab || !keep[r]); e0 += TERMS_RUN) {
            const int64_t m = min64(TERMS_RUN, length - e0), k = by_vocab ? r : e0, j = by_vocab ? e0 : r;
            terms_run(terms, count, k, j, by_vocab, m, 0, values);
            for (int64_t e = 0; e < m; e++) {
                const int64_t ke = by_vocab ? k : k + e, je = by_vocab ? j + e : j;
                float *d = base + ke * stride_k + je * stride_j;
                if (!keep[je])
                    *d = used[je] || !overwrites ? *d + values[e] : values[e];
            }
        }
    }
    for (int64_t j = 0; j < vb; j++)
        p->ws->used[j] |= !keep[j];
}

/* The tail estimate's column factors of a tile (vb columns) marked as segment `segment`: each skipped column's
 * sum nu of its rows' magnitudes (tail_columns; 0 for a kept column), from the threads' profiles, which are
 * cleared for the next tile. Returns S, the sum of every nu. Each thread owns a range of columns. */
static double tail_profile(const fh_engine_pass *p, int segment, int64_t vb)
{
    const fh_workspace *ws = p->ws;
    const int threads = p->plan->threads;
    const int64_t cols = p->plan->tile_vocab;
    float *profiles = ws->tail_nu + (int64_t)segment * threads * cols;
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t j0 = vb * me / parts, j1 = vb * (me + 1) / parts;
        for (int64_t j = j0; j < j1; j++) {
            double sum = 0.0;
            for (int t = 0; t < threads; t++) {
                sum += profiles[t * cols + j];
                profiles[t * cols + j] = 0.0f;
            }
            ws->tail_columns[j] = ws->keep[j] ? 0.0 : sum;
            total += ws->tail_columns[j];
        }
    }
    return total;
}

/* The filtered gradient GEMMs of a dU tile's rows from tile_row (rows i0.., columns v0.., marked as segment
 * `segment`), and the rank-one terms of the columns they skip. The dx it adds to holds this call's earlier terms
 * (zeroed at the pass's start, or at the block's when in row blocks). */
static fh_status filtered_gradients(const fh_engine_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb,
                                    int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const fh_workspace *ws = p->ws;
    const int64_t h = lin->hidden;
    const int after = dweight_after_blocks(p);
    int any_c = 0;
    for (int64_t r = 0; r < nb; r++)
        any_c |= ws->row_c[tile_row + r] != 0.0;
    const int unfiltered = any_c && p->tf.softcap > 0.0f; /* c w is not rank one under a softcap */
    const int64_t kept = keep_columns(p, segment, vb, unfiltered), skipped_columns = vb - kept;
    for (int64_t c = 0; after && c < kept; c++)
        ws->used[ws->kept[c]] = 1; /* the dweight GEMM after the blocks needs this column */
    const int gemms = (grads->dx != NULL) + (grads->dweight && !after);
    ws->filter_stats->gradient_flops += 2.0 * (double)nb * (double)h * (double)vb * gemms;
    ws->filter_stats->skipped_flops += 2.0 * (double)nb * (double)h * (double)skipped_columns * gemms;
    /* The tail's row sums lose their kept columns' share when an f32 tile is compacted for the GEMMs, else here. */
    const double tail_total = p->plan->tail_estimate ? tail_profile(p, segment, vb) : 0.0;
    if (tail_total > 0.0 && p->plan->bf16_du)
        compact_rows(p, tile_row, nb, vb, kept, p->class_weights ? p->class_weights + v0 : NULL, 0);
    if (p->plan->fp32_dz)
        copy_x_rows(p, i0, nb);
    const fh_status st = kept == vb ? all_kept_gemms(p, tile_row, i0, nb, v0, vb)
                                    : kept_column_gemms(p, tile_row, i0, nb, v0, vb, kept, 1);
    double *v = ws->vectors;
    skipped_term terms[2];
    int count = 0;
    if (any_c)
        terms[count++] = (skipped_term){ws->row_c + tile_row, p->class_weights ? p->class_weights + v0 : NULL, NULL,
                                        p->tf.inv_temperature, v + TERM_S_C * h, v + TERM_G_C * h,
                                        v + TERM_G_ALL_C * h};
    if (tail_total > 0.0)
        terms[count++] = (skipped_term){ws->tail_rows + tile_row, NULL, ws->tail_columns, 1.0 / tail_total,
                                        v + TERM_S_TAIL * h, v + TERM_G_TAIL * h, v + TERM_G_ALL_TAIL * h};
    if (st != FH_OK || count == 0)
        return st;
    if (grads->dweight && after) {
        /* for the columns that every row block skips */
        for (int t = 0; t < count; t++)
            weighted_rows(p, terms[t].rows, i0, nb, 1, terms[t].g_all);
        if (tail_total > 0.0) {
            double *total = ws->tail_columns + p->plan->tile_vocab; /* every block's (tile_vocab = vocab = vb) */
            for (int64_t j = 0; j < vb; j++)
                total[j] += ws->tail_columns[j];
            v[TERM_VECTORS * h] += tail_total;
        }
    }
    if (skipped_columns == 0)
        return FH_OK;
    if (grads->dx) {
        skipped_weight_sums(p, v0, vb, terms, count);
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t r = 0; r < nb; r++) {
            float *dx = dx_row_f32(p, i0 + r, i0);
            for (int64_t k = 0; k < h; k++) {
                double value = 0.0;
                for (int t = 0; t < count; t++)
                    value += terms[t].rows[r] * terms[t].s[k];
                dx[k] += (float)value;
            }
        }
    }
    if (grads->dweight && !after) {
        for (int t = 0; t < count; t++)
            weighted_rows(p, terms[t].rows, i0, nb, 0, terms[t].g);
        skipped_columns_term(p, v0, vb, terms, count);
    }
    return FH_OK;
}

/* Before a filtered pass: no column marked or used yet, the rank-one sums of the row blocks at zero, dx zeroed
 * where the GEMMs and terms add into it (its accumulator, or an fp32 dx with beta 0). */
static void filter_begin(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    memset(p->ws->marks, 0, 2 * (size_t)p->plan->threads * (size_t)p->plan->tile_vocab);
    memset(p->ws->used, 0, (size_t)p->plan->tile_vocab);
    memset(p->ws->vectors, 0, (TERM_VECTORS * (size_t)lin->hidden + 1) * sizeof(double));
    if (p->plan->tail_estimate) {
        memset(p->ws->tail_nu, 0, 2 * (size_t)p->plan->threads * (size_t)p->plan->tile_vocab * sizeof(float));
        if (dweight_after_blocks(p))
            memset(p->ws->tail_columns + p->plan->tile_vocab, 0, (size_t)p->plan->tile_vocab * sizeof(double));
    }
    if (!grads->dx || p->plan->row_blocks)
        return;
    if (dx_accumulated(p))
        memset(p->ws->dx_acc, 0, (size_t)(lin->n * lin->hidden) * sizeof(float));
    else if (grads->dx_beta == 0.0f)
        for (int64_t i = 0; i < lin->n; i++)
            memset((float *)grads->dx + i * grads->dx_row_stride, 0, (size_t)lin->hidden * sizeof(float));
}

/* Zeroes columns [j0, j1) of an H-row matrix of elem_size-byte elements, element (k, j) at
 * base + k * stride_k + j * stride_j elements: memsets along its contiguous direction. */
static void zero_columns(const fh_engine_pass *p, char *base, size_t elem_size, int64_t stride_k, int64_t stride_j,
                         int64_t j0, int64_t j1)
{
    const int64_t h = p->lin->hidden;
    if (stride_j == 1) {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t k = 0; k < h; k++)
            memset(base + (size_t)(k * stride_k + j0) * elem_size, 0, (size_t)(j1 - j0) * elem_size);
    } else if (stride_k == 1) {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t j = j0; j < j1; j++)
            memset(base + (size_t)(j * stride_j) * elem_size, 0, (size_t)h * elem_size);
    } else
        for (int64_t j = j0; j < j1; j++)
            for (int64_t k = 0; k < h; k++)
                memset(base + (size_t)(k * stride_k + j * stride_j) * elem_size, 0, elem_size);
}

/* dweight's columns of a tile (v0, vb) that nothing reached: zeroed when overwritten (beta 0, an accumulator),
 * a run of them at a time. */
static void finish_dw_columns(const fh_engine_pass *p, int64_t v0, int64_t vb)
{
    const uint8_t *used = p->ws->used;
    int64_t stride_k, stride_j;
    dw_strides(p, vb, &stride_k, &stride_j);
    for (int64_t j0 = 0; j0 < vb && dw_overwrites(p);) {
        int64_t j1 = j0 + 1;
        while (j1 < vb && used[j1] == used[j0])
            j1++;
        if (!used[j0])
            zero_columns(p, (char *)dw_f32(p, 0, 0, v0, vb), sizeof(float), stride_k, stride_j, j0, j1);
        j0 = j1;
    }
    memset(p->ws->used, 0, (size_t)vb);
}

/* dweight's elements at + e step (e < count) (+)= values[e] as beta says, rounded once when bf16 (after bf16 row
 * blocks); a contiguous bf16 run in one call of the rounding kernel. */
static void store_dweight(const fh_engine_pass *p, int64_t at, int64_t step, const float *values, int64_t count)
{
    const fh_linear_grads *grads = p->grads;
    const int accumulate = grads->dweight_beta != 0.0f;
    const int bf16 = grads->dweight_dtype == FH_DTYPE_BF16;
    if (bf16 && step == 1) {
        fh_row_add_to_bf16(values, count, accumulate, (uint16_t *)grads->dweight + at);
        return;
    }
    for (int64_t e = 0; e < count; e++) {
        if (bf16) {
            fh_row_add_to_bf16(values + e, 1, accumulate, (uint16_t *)grads->dweight + at + e * step);
        } else {
            float *d = (float *)grads->dweight + at + e * step;
            *d = accumulate ? *d + values[e] : values[e];
        }
    }
}

/* Columns [j0, j1) of dweight that every row block skipped: only the terms' column(j) g_all (0 without a term),
 * rounded once, as beta says. */
static void skipped_dweight_columns(const fh_engine_pass *p, int64_t j0, int64_t j1, const skipped_term *terms,
                                    int count)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    if (count == 0 && grads->dweight_beta != 0.0f)
        return;
    if (count == 0) {
        zero_columns(p, grads->dweight, elem_size(elem_type(grads->dweight_dtype)), lin->w_stride_hidden,
                     lin->w_stride_vocab, j0, j1);
        return;
    }
    /* runs along dweight's contiguous direction: each row k over [j0, j1), or each column over H */
    const int by_vocab = dw_acc_by_vocab(lin);
    const int64_t runs = by_vocab ? lin->hidden : j1 - j0, length = by_vocab ? j1 - j0 : lin->hidden;
    const int64_t step = by_vocab ? lin->w_stride_vocab : lin->w_stride_hidden;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t r = 0; r < runs; r++) {
        float values[TERMS_RUN];
        for (int64_t e0 = 0; e0 < length; e0 += TERMS_RUN) {
            const int64_t m = min64(TERMS_RUN, length - e0), k = by_vocab ? r : e0, j = by_vocab ? j0 + e0 : j0 + r;
            terms_run(terms, count, k, j, by_vocab, m, 1, values);
            store_dweight(p, k * lin->w_stride_hidden + j * lin->w_stride_vocab, step, values, m);
        }
    }
}

/* dweight's columns[0..count) (+)= gathered_dw (a chunk of width `width`), as beta says (after bf16 row blocks),
 * along dweight's contiguous direction. */
static void store_gathered_dweight(const fh_engine_pass *p, const int64_t *columns, int64_t count, int64_t width)
{
    const fh_linear *lin = p->lin;
    if (dw_acc_by_vocab(lin)) { /* the kept columns of a row k are apart */
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t k = 0; k < lin->hidden; k++)
            for (int64_t c = 0; c < count; c++)
                store_dweight(p, k * lin->w_stride_hidden + columns[c] * lin->w_stride_vocab, 1,
                              gathered_dw_at(p, k, c, width), 1);
    } else {
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
        for (int64_t c = 0; c < count; c++)
            store_dweight(p, columns[c] * lin->w_stride_vocab, lin->w_stride_hidden, gathered_dw_at(p, 0, c, width),
                          lin->hidden);
    }
}

/* bf16 row blocks: dweight after the last block, over every row, for the columns that some row block kept (in
 * gathered chunks, the rows in the blocks' segments so that the GEMM shapes are those made ready); every other
 * column gets only its rank-one terms (0 without them), rounded once, as beta says. */
static fh_status filtered_dweight_after_blocks(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    const int64_t n = lin->n, h = lin->hidden, vocab = lin->vocab;
    const int64_t segments = block_segments(p), height = block_segment_rows(p), span = block_span(p);
    double *v = p->ws->vectors;
    int any_c = 0;
    for (int64_t k = 0; k < h; k++)
        any_c |= v[TERM_G_ALL_C * h + k] != 0.0;
    /* The columns every block skipped: the c w term, and the tail estimate with every block's magnitudes. */
    skipped_term terms[2];
    int terms_count = 0;
    if (any_c)
        terms[terms_count++] = (skipped_term){NULL, p->class_weights, NULL, p->tf.inv_temperature, NULL, NULL,
                                              v + TERM_G_ALL_C * h};
    if (p->plan->tail_estimate && v[TERM_VECTORS * h] > 0.0)
        terms[terms_count++] = (skipped_term){NULL, NULL, p->ws->tail_columns + vocab, 1.0 / v[TERM_VECTORS * h],
                                              NULL, NULL, v + TERM_G_ALL_TAIL * h};
    int64_t kept = 0;
    for (int64_t j = 0; j < vocab; j++)
        if (p->ws->used[j])
            p->ws->kept[kept++] = j;
    /* Every column kept: the unfiltered GEMM over every row. */
    fh_status st = kept == vocab ? dweight_by_chunks(p, 0) : FH_OK;
    for (int64_t c0 = 0; c0 < kept && kept < vocab && st == FH_OK; c0 += FH_FILTER_CHUNK) {
        const int64_t *columns = p->ws->kept + c0;
        const int64_t count = min64(FH_FILTER_CHUNK, kept - c0), width = gathered_width(p, count);
        int accumulate = 0;
        for (int64_t i0 = 0; i0 < span && st == FH_OK; i0 += height)
            for (int64_t s = 0; s < segments && st == FH_OK; s++, accumulate = 1) {
                const int64_t first = s * span + i0, nb = min64(height, span - i0);
                const fh_gemm_input du = gather_du(p, p->ws->du + first * vocab, vocab, nb, columns, count, width);
                st = gathered_dweight(p, 0, first, nb, width, &du, accumulate);
            }
        if (st == FH_OK)
            store_gathered_dweight(p, columns, count, width);
    }
    for (int64_t j0 = 0; j0 < vocab && st == FH_OK;) {
        int64_t j1 = j0 + 1;
        while (j1 < vocab && p->ws->used[j1] == p->ws->used[j0])
            j1++;
        if (!p->ws->used[j0])
            skipped_dweight_columns(p, j0, j1, terms, terms_count);
        j0 = j1;
    }
    p->ws->filter_stats->gradient_flops += 2.0 * (double)n * (double)h * (double)vocab;
    p->ws->filter_stats->skipped_flops += 2.0 * (double)n * (double)h * (double)(vocab - kept);
    return st;
}

/* The gradient GEMMs of a dU tile's rows from tile_row (marked as segment `segment`): dx is first written at
 * v0 = 0, dweight at i0 = 0 (or, after bf16 row blocks, once over every row). Filtered when eps > 0. */
static fh_status add_gradients(const fh_engine_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb,
                               int64_t v0, int64_t vb)
{
    if (filtering(p))
        return filtered_gradients(p, segment, tile_row, i0, nb, v0, vb);
    const fh_linear_grads *grads = p->grads;
    const int gemms = (grads->dx != NULL) + (grads->dweight && !dweight_after_blocks(p));
    p->ws->filter_stats->gradient_flops += 2.0 * (double)nb * (double)p->lin->hidden * (double)vb * gemms;
    fh_status st = FH_OK;
    if (p->plan->fp32_dz)
        copy_x_rows(p, i0, nb);
    const int64_t t = du_chunk(p, vb);
    for (int64_t j0 = 0; grads->dx && j0 < vb && st == FH_OK; j0 += t)
        st = add_dx(p, 0, tile_row, i0, nb, v0, vb, j0, min64(t, vb - j0), v0 > 0 || j0 > 0);
    if (st == FH_OK && grads->dweight && !dweight_after_blocks(p))
        st = add_dweight(p, 0, tile_row, i0, nb, v0, vb, 0, vb, i0 > 0);
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
    if (filtering(p))
        filter_begin(p);
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
                float *row = tile + r * vb;
                if (p->pair) {
                    pair_rows(p, row, v0, vb);
                    p->pair->gradient(p->pair->self, i, row, companion_row(p, row), vb, v0);
                } else {
                    const fh_coef k = coef_of(p->coefs, i);
                    const int64_t t = target_column(p->targets, i, vocab, v0);
                    fh_row_transform(row, vb, bias, &p->tf);
                    gradient_and_marks(p, row, r, 0, vb, t, weights, &k);
                }
                round_du_row(p, row, i0, r, vb);
            }
            if (grads->dbias)
                add_column_sums(tile, nb, vb, column, threads);
            st = add_gradients(p, 0, 0, i0, nb, v0, vb);
            if (st != FH_OK)
                return st;
        }
        if (grads->dweight && filtering(p))
            finish_dw_columns(p, v0, vb);
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

/* Overwrites row r of the segment at i0 (transformed logits, or their exps when `exps`; tile row tile_row, segment
 * `segment` of the block) with its dU. */
static void gradient_row(const fh_engine_pass *p, float *row, int64_t tile_row, int segment, int64_t i0, int64_t r,
                         const fh_final_stats *stats, int exps)
{
    const int64_t i = i0 + r;
    const int64_t vocab = p->lin->vocab, t = target_column(p->targets, i, vocab, 0);
    fh_coef k = {stats->lse, 0.0, 0.0, 0.0, 0.0, stats->sum_pz, exps ? 1.0 / p->stats->sum_exp[i] : 0.0};
    p->source->row(p->source->self, i, stats, &k);
    gradient_and_marks(p, row, tile_row, segment, vocab, t, p->class_weights, &k);
    round_du_row(p, row, i0, r, vocab);
}

/* A filtered row block's dx rows (segment at i0): zeroed before its GEMMs and terms add into them (the f32
 * dx_block of a bf16 dx, or an fp32 dx with beta 0); dx_block rounded into dx after. */
static void block_dx_begin(const fh_engine_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear_grads *grads = p->grads;
    const int64_t h = p->lin->hidden;
    if (!filtering(p) || !grads->dx)
        return;
    if (dx_in_block(p))
        memset(p->ws->dx_block, 0, (size_t)(nb * h) * sizeof(float));
    else if (grads->dx_beta == 0.0f)
        for (int64_t i = i0; i < i0 + nb; i++)
            memset((float *)grads->dx + i * grads->dx_row_stride, 0, (size_t)h * sizeof(float));
}

static void block_dx_end(const fh_engine_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear_grads *grads = p->grads;
    if (grads->dx && dx_in_block(p))
        round_into_bf16(p->ws->dx_block, p->lin->hidden, (uint16_t *)grads->dx + i0 * grads->dx_row_stride,
                        grads->dx_row_stride, nb, p->lin->hidden, grads->dx_beta != 0.0f, p->plan->threads);
}

/* Row r of the block at i0 with a pair: both rows made ready, every forward pass of the kernels, then its dU. */
static void pair_row_block(const fh_engine_pass *p, float *row, int64_t i0, int64_t r)
{
    const fh_pair_kernels *k = p->pair;
    const int64_t i = i0 + r, vocab = p->lin->vocab;
    float *crow = companion_row(p, row);
    pair_rows(p, row, 0, vocab);
    for (int pass = 0; pass < k->passes; pass++) {
        k->fold(k->self, pass, i, row, crow, vocab, 0);
        k->finish(k->self, pass, i);
    }
    k->gradient(k->self, i, row, crow, vocab, 0);
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

static fh_status row_blocks(const fh_engine_pass *p)
{
    const fh_linear *lin = p->lin;
    const fh_linear_grads *grads = p->grads;
    const fh_token_stats *stats = p->stats;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int64_t segments = block_segments(p), height = block_segment_rows(p), span = block_span(p);
    const int threads = p->plan->threads;
    /* Each row is folded in one tile; its exps replace it when the gradient needs z no more (fh_coef.p_scale) and
     * no block hook can change its log-sum-exp (a vocabulary-parallel one makes it global). */
    const int entropy = stats && stats->sum_pz;
    const fh_fold_request request = {p->class_weights, stats && stats->sum_weighted_z, entropy,
                                     !entropy && !(p->tf.softcap > 0.0f) && !p->pair && !p->source->block, NULL};
    float *tile = p->ws->tile;
    double *column = p->ws->column;
    fh_status st = fh_engine_prepare(p);
    if (st != FH_OK)
        return st;
    if (grads->dbias)
        for (int64_t j = 0; j < vocab; j++)
            column[j] = 0.0;
    if (filtering(p))
        filter_begin(p);
    for (int64_t i0 = 0; i0 < span; i0 += height) {
        /* Segment s holds rows s * span + i0 .. + nb - 1, from tile row s * nb. */
        const int64_t nb = min64(height, span - i0), rows = segments * nb;
        for (int64_t s = 0; s < segments && st == FH_OK; s++)
            st = compute_logits(p, 0, tile + s * nb * vocab, s * span + i0, nb, 0, vocab);
        if (st != FH_OK)
            return st;
        if (p->pair) {
            /* Every pass over both rows, then the gradient, while they are hot in cache. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++)
                pair_row_block(p, tile + r * vocab, i0, r);
        } else if (!p->source->block) {
            /* Fold, then the gradient while the row is still hot in cache. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t first = r / nb * span + i0;
                fh_fold_request ahead = request;
                ahead.next = r + 1 < rows ? tile + (r + 1) * vocab : NULL;
                const fh_final_stats result = fold_row(p, &ahead, tile + r * vocab, first + r % nb);
                gradient_row(p, tile + r * vocab, r, (int)(r / nb), first, r % nb, &result, request.store_exps);
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
                gradient_row(p, tile + r * vocab, r, (int)(r / nb), first, r % nb, &result, request.store_exps);
            }
        }
        if (grads->dbias)
            add_column_sums(tile, rows, vocab, column, threads);
        for (int64_t s = 0; s < segments && st == FH_OK; s++) {
            block_dx_begin(p, s * span + i0, nb);
            st = add_gradients(p, (int)s, s * nb, s * span + i0, nb, 0, vocab);
            if (st == FH_OK)
                block_dx_end(p, s * span + i0, nb);
        }
        if (st != FH_OK)
            return st;
    }
    if (grads->dweight && dweight_after_blocks(p)) {
        if (filtering(p))
            st = filtered_dweight_after_blocks(p);
        else {
            p->ws->filter_stats->gradient_flops += 2.0 * (double)n * (double)lin->hidden * (double)vocab;
            st = dweight_by_chunks(p, 0);
        }
        if (st != FH_OK)
            return st;
    } else if (grads->dweight && filtering(p))
        finish_dw_columns(p, 0, vocab);
    if (grads->dbias)
        write_bias_gradient(grads, column, 0, vocab);
    return FH_OK;
}

/* The logits block sits in dweight's memory when the plan put it there. */
fh_status fh_engine_row_blocks(const fh_engine_pass *p)
{
    if (!p->plan->tile_in_dweight)
        return row_blocks(p);
    fh_workspace ws = *p->ws;
    fh_engine_pass pass = *p;
    ws.tile = (float *)((char *)p->grads->dweight + p->plan->tile_at_byte);
    pass.ws = &ws;
    return row_blocks(&pass);
}
