/* The gradient GEMMs of the columns a tile keeps, on those columns gathered. */
#include "filter_internal.h"

#include <string.h>

/* ---- Gathered GEMMs of gradient filtering ----
 * Filtering runs the gradient GEMMs on the kept columns only, FH_FILTER_CHUNK at a time: their dU (an f32 tile's
 * rows compacted in place, the kept columns first; a bf16 dU gathered into gathered_du, rows x width, as the bf16
 * rows of every block stay whole for dweight after the blocks), their weight rows gathered into gathered_w
 * (width x H) and their dweight out of gathered_dw (H x width, along dweight's contiguous direction), in the
 * element type of dU. A bf16
 * chunk is padded with zeros to a power of two of at least 32 columns, so that the oneDNN primitives have few
 * shapes, all made ready up front; BLIS takes any. */
int64_t fh_filter_gathered_width(const fh_pass *p, int64_t count)
{
    if (!p->in.plan->bf16_du)
        return count;
    int64_t width = 32;
    while (width < count)
        width *= 2;
    return width;
}

static fh_elem_type du_type(const fh_pass *p)
{
    return p->in.plan->bf16_du ? FH_ELEM_BF16 : FH_ELEM_F32;
}

/* dx rows i0.. (+)= the kept dU (nb x width) times the gathered weight rows: filtered dx GEMMs always add (dx is
 * zeroed before the first). */
static fh_status gathered_dx(const fh_pass *p, int prepare, int64_t i0, int64_t nb, int64_t width,
                             const fh_gemm_input *du)
{
    const fh_gemm_input wt = view(p->ws.filter.gathered_w, du_type(p), 0, p->in.lin->hidden, 1);
    return fh_pass_dx_product(p, prepare, i0, nb, width, du, &wt, 1);
}

/* Element (k, c) of gathered_dw, a chunk of width columns: laid out as dweight runs, so that it is scattered in
 * order. */
float *fh_gathered_dw_at(const fh_pass *p, int64_t k, int64_t c, int64_t width)
{
    return p->ws.filter.gathered_dw + (p->sinks.by_vocab ? k * width + c : c * p->in.lin->hidden + k);
}

/* gathered_dw (+)= X[i0:i0+nb, :]^T times the kept dU. */
fh_status fh_filter_gathered_dweight(const fh_pass *p, int prepare, int64_t i0, int64_t nb, int64_t width,
                                  const fh_gemm_input *du, int accumulate)
{
    const fh_gemm_input xt = fh_pass_x_transposed(p, i0);
    const int by_vocab = p->sinks.by_vocab;
    const fh_gemm_output dw = f32_output(p->ws.filter.gathered_dw, by_vocab ? width : 1, by_vocab ? 1 : p->in.lin->hidden);
    return fh_pass_multiply(p, prepare, p->in.lin->hidden, width, nb, &xt, du, accumulate, &dw);
}

/* Every gathered bf16 GEMM shape of a row tile of nb rows (BLIS makes nothing ready). */
fh_status fh_filter_prepare(const fh_pass *p, int64_t nb)
{
    const fh_linear_grads *grads = p->in.grads;
    fh_status st = FH_OK;
    for (int64_t width = fh_filter_gathered_width(p, 1); p->in.plan->bf16_du && width <= FH_FILTER_CHUNK && st == FH_OK;
         width *= 2) {
        const fh_gemm_input du = view(p->ws.filter.gathered_du, FH_ELEM_BF16, 0, width, 1);
        if (grads->dx)
            st = gathered_dx(p, 1, 0, nb, width, &du);
        /* After bf16 row blocks, dweight's chunks add up the row blocks' products. */
        const int after_blocks = p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS;
        for (int accumulate = 0; accumulate <= after_blocks && grads->dweight && st == FH_OK; accumulate++)
            st = fh_filter_gathered_dweight(p, 1, 0, nb, width, &du, accumulate);
    }
    return st;
}

/* The kept dU of a bf16 chunk: columns[0..count) of the nb bf16 rows at du (stride vb) gathered into gathered_du,
 * zeros up to width. */
fh_gemm_input fh_filter_gather_du(const fh_pass *p, const uint16_t *du, int64_t vb, int64_t nb,
                               const int64_t *columns, int64_t count, int64_t width)
{
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        uint16_t *dst = (uint16_t *)p->ws.filter.gathered_du + r * width;
        const uint16_t *src = du + r * vb;
        for (int64_t c = 0; c < count; c++)
            dst[c] = src[columns[c]];
        memset(dst + count, 0, (size_t)(width - count) * sizeof *dst);
    }
    return view(p->ws.filter.gathered_du, FH_ELEM_BF16, 0, width, 1);
}

/* The tail estimate's row sums count every entry of a row below its threshold (gradient_and_marks); those of its kept
 * columns are not skipped, so they come off. A row's threshold and c w term, as gradient_and_marks used them. */
typedef struct row_tail {
    float least, c;
} row_tail;

static row_tail row_tail_of(const fh_pass *p, int64_t tile_row)
{
    const row_tail t = {p->ws.filter.row_least[tile_row], (float)(p->ws.filter.row_c[tile_row] * p->in.tf.inv_temperature)};
    return t;
}

/* The nb rows of the f32 tile from tile_row (vb columns, class weights `weights`): with move, their kept
 * columns[0..kept) moved to their front, in order, so that the GEMMs read them in place (an f32 dU); with the tail
 * estimate, the kept columns' share taken off each row's sum (also without move: a bf16 dU's f32 rows read in
 * place). */
void fh_filter_compact_rows(const fh_pass *p, int64_t tile_row, int64_t nb, int64_t vb, int64_t kept,
                         const float *weights, int move)
{
    const int tail = p->in.plan->tail_estimate;
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        const row_tail t = tail ? row_tail_of(p, tile_row + r) : (row_tail){0.0f, 0.0f};
        float *row = p->ws.tile + (tile_row + r) * vb;
        const float *next = r + 1 < nb ? row + vb : NULL;
        const double share = fh_row_compact(row, p->ws.filter.kept_columns, kept, move, t.least, t.c, weights, next);
        if (tail)
            p->ws.filter.tail_rows[tile_row + r] -= share;
    }
}

/* gathered_w = the weight's columns v0 + columns[0..count) of the tile as rows of H, in dU's element type (with
 * fp32_du, from w32, the tile's columns already in f32), zeros up to width. */
static void gather_weight(const fh_pass *p, int64_t v0, int64_t vb, const int64_t *columns, int64_t count,
                          int64_t width)
{
    const fh_linear *lin = p->in.lin;
    const int64_t h = lin->hidden;
    const size_t row_bytes = (size_t)h * elem_size(du_type(p));
    memset((char *)p->ws.filter.gathered_w + (size_t)count * row_bytes, 0, (size_t)(width - count) * row_bytes);
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t c = 0; c < count; c++) {
        const int64_t j = columns[c];
        if (p->in.plan->bf16_du) {
            uint16_t *dst = (uint16_t *)p->ws.filter.gathered_w + c * h;
            const uint16_t *src = (const uint16_t *)lin->weight + (v0 + j) * lin->w_stride_vocab;
            for (int64_t k = 0; k < h; k++)
                dst[k] = src[k * lin->w_stride_hidden];
        } else if (p->in.plan->fp32_du) {
            float *dst = (float *)p->ws.filter.gathered_w + c * h;
            for (int64_t k = 0; k < h; k++)
                dst[k] = p->ws.w32[k * vb + j];
        } else {
            float *dst = (float *)p->ws.filter.gathered_w + c * h;
            const float *src = (const float *)lin->weight + (v0 + j) * lin->w_stride_vocab;
            for (int64_t k = 0; k < h; k++)
                dst[k] = src[k * lin->w_stride_hidden];
        }
    }
}

/* dweight (k, tile column j) += value, or = value when the column is not used yet and overwritten. */
static void dw_add(const fh_pass *p, int64_t k, int64_t j, int64_t v0, int64_t vb, float value)
{
    float *d = fh_dw_f32(p, k, j, v0, vb);
    *d = p->ws.filter.dw_holds[j] || !p->sinks.dw_overwrites ? *d + value : value;
}

/* A chunk of gathered_dw (its columns[0..count), `width` wide) and where it goes: a tile (v0, vb) of dweight or its
 * accumulator (scatter_dweight), or after bf16 row blocks dweight itself (fh_filter_store_gathered_dweight). */
typedef struct gathered_chunk {
    const fh_pass *p;
    int64_t v0, vb, width;
} gathered_chunk;

static void scatter_run(const void *self, const fh_run *run)
{
    const gathered_chunk *g = self;
    for (int64_t e = 0; e < run->length; e++) {
        const int64_t k = fh_run_k(run, e);
        dw_add(g->p, k, fh_run_j(run, e), g->v0, g->vb, *fh_gathered_dw_at(g->p, k, fh_run_c(run, e), g->width));
    }
}

/* dweight's kept columns += gathered_dw (columns[0..count) of the tile of width `width`), along dweight's
 * contiguous direction; then they are used. */
static void scatter_dweight(const fh_pass *p, int64_t v0, int64_t vb, const int64_t *columns, int64_t count,
                            int64_t width)
{
    const gathered_chunk chunk = {p, v0, vb, width};
    fh_walk(p->in.plan->threads, p->in.lin->hidden, p->sinks.by_vocab, 0, count, columns, scatter_run, &chunk);
    for (int64_t c = 0; c < count; c++)
        p->ws.filter.dw_holds[columns[c]] = 1;
}

static void store_run(const void *self, const fh_run *run)
{
    const gathered_chunk *g = self;
    const fh_linear *lin = g->p->in.lin;
    const fh_linear_grads *grads = g->p->in.grads;
    const size_t bytes = elem_size(elem_type(grads->dweight_dtype));
    const int accumulate = grads->dweight_beta != 0.0f;
    if (!run->along_vocab) { /* a column: contiguous in the chunk */
        char *out = (char *)grads->dweight + (size_t)(run->j * lin->w_stride_vocab) * bytes;
        fh_store(out, grads->dweight_dtype, lin->w_stride_hidden, fh_gathered_dw_at(g->p, 0, run->c, g->width),
                 run->length, accumulate);
        return;
    }
    for (int64_t e = 0; e < run->length; e++) { /* the kept columns of a row k are apart */
        const int64_t at = run->k * lin->w_stride_hidden + fh_run_j(run, e) * lin->w_stride_vocab;
        fh_store((char *)grads->dweight + (size_t)at * bytes, grads->dweight_dtype, 1,
                 fh_gathered_dw_at(g->p, run->k, fh_run_c(run, e), g->width), 1, accumulate);
    }
}

/* dweight's columns[0..count) (+)= gathered_dw (a chunk of width `width`), as beta says (after bf16 row blocks),
 * along dweight's contiguous direction. */
void fh_filter_store_gathered_dweight(const fh_pass *p, const int64_t *columns, int64_t count, int64_t width)
{
    const gathered_chunk chunk = {p, 0, 0, width};
    fh_walk(p->in.plan->threads, p->in.lin->hidden, p->sinks.by_vocab, 0, count, columns, store_run, &chunk);
}

/* The dx (with_dx) and (unless after the blocks) dweight GEMMs of the kept columns of a tile's rows, a chunk at a
 * time. */
fh_status fh_filter_kept_gemms(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                                   int64_t vb, int64_t kept, int with_dx)
{
    const int dweight = p->in.grads->dweight && p->sinks.dweight != FH_DWEIGHT_AFTER_BLOCKS;
    if (!p->in.plan->bf16_du && kept < vb)
        fh_filter_compact_rows(p, tile_row, nb, vb, kept, p->in.class_weights ? p->in.class_weights + v0 : NULL, 1);
    fh_status st = FH_OK;
    for (int64_t c0 = 0; c0 < kept && st == FH_OK; c0 += FH_FILTER_CHUNK) {
        const int64_t *columns = p->ws.filter.kept_columns + c0;
        const int64_t count = min64(FH_FILTER_CHUNK, kept - c0), width = fh_filter_gathered_width(p, count);
        const fh_gemm_input du = p->in.plan->bf16_du
                                     ? fh_filter_gather_du(p, p->ws.du + (p->in.plan->row_blocks ? i0 : tile_row) * vb, vb, nb,
                                                 columns, count, width)
                                     : view(p->ws.tile, FH_ELEM_F32, tile_row * vb + c0, vb, 1);
        if (p->in.grads->dx && with_dx) {
            gather_weight(p, v0, vb, columns, count, width);
            st = gathered_dx(p, 0, i0, nb, width, &du);
        }
        if (st == FH_OK && dweight) {
            st = fh_filter_gathered_dweight(p, 0, i0, nb, width, &du, 0);
            if (st == FH_OK)
                scatter_dweight(p, v0, vb, columns, count, width);
        }
    }
    return st;
}

/* A tile that keeps every column runs the unfiltered GEMMs in place (nothing to gather): dx adds (it was zeroed),
 * dweight is written or added to as its columns' dw_holds flags say, or gathered when they differ. */
fh_status fh_filter_all_kept_gemms(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                                int64_t vb)
{
    fh_status st = p->in.grads->dx ? fh_pass_add_dx(p, 0, tile_row, i0, nb, v0, vb, 0, vb, 1) : FH_OK;
    if (st != FH_OK || !p->in.grads->dweight || p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS)
        return st;
    int64_t used = 0;
    for (int64_t j = 0; j < vb; j++)
        used += p->ws.filter.dw_holds[j];
    if (used != 0 && used != vb)
        return fh_filter_kept_gemms(p, tile_row, i0, nb, v0, vb, vb, 0);
    st = fh_pass_add_dweight(p, 0, tile_row, i0, nb, v0, vb, 0, vb, used == vb || !p->sinks.dw_overwrites);
    memset(p->ws.filter.dw_holds, 1, (size_t)vb);
    return st;
}
