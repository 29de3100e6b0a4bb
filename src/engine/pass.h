/* Inside the engine: a pass as its loops run it, with where its gradients go resolved once (fh_sinks), and the
 * products on those sinks that the streaming passes (streaming.c), the row blocks (row_blocks.c) and gradient
 * filtering (filter/) share. */
#ifndef FH_ENGINE_PASS_H
#define FH_ENGINE_PASS_H

#include "engine.h"

#include "gemm/gemm.h"

/* Where the dx GEMMs write. */
typedef enum fh_dx_sink {
    FH_DX_DIRECT,      /* dx itself */
    FH_DX_ACCUMULATOR, /* a streamed bf16 dx: the f32 dx_acc (n x H), rounded after the last vocabulary tile */
    FH_DX_BLOCK        /* a bf16 dx in row blocks summed over several GEMMs (filtered ones, or one per dU chunk): the
                          f32 dx_block, rounded at the block's end */
} fh_dx_sink;

/* Where the dweight GEMMs write. */
typedef enum fh_dweight_sink {
    FH_DWEIGHT_DIRECT,       /* dweight itself */
    FH_DWEIGHT_ACCUMULATOR,  /* a streamed bf16 dweight: the f32 dw_acc of a vocabulary tile, rounded after its last
                                row tile */
    FH_DWEIGHT_AFTER_BLOCKS  /* row blocks keep every row's dU (bf16_du, f32_du_chunks): dweight is one GEMM per dU
                                chunk over every row after the last block */
} fh_dweight_sink;

typedef struct fh_sinks {
    fh_dx_sink dx;
    fh_dweight_sink dweight;
    int by_vocab;      /* dweight runs along the vocabulary (w_stride_vocab <= w_stride_hidden); its accumulator and
                          filtering's gathered chunks are laid out the same way, so that rounding or scattering them
                          into dweight reads and writes in order */
    int dw_overwrites; /* a dweight column that holds nothing of this call yet is written, not added to (beta 0, or
                          an accumulator) */
} fh_sinks;

typedef struct fh_pass {
    fh_engine_pass in; /* as the head described it (in.ws aside: ws below) */
    fh_workspace ws;   /* the plan's workspace, its tile in dweight's memory where the plan put it there */
    fh_sinks sinks;
    int filter;        /* gradient filtering: a gradient pass of a plan with filter_eps > 0 */
} fh_pass;

/* The pass of `in`, its sinks resolved. */
void fh_pass_begin(fh_pass *p, const fh_engine_pass *in);

static inline int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Column of row i's target within the tile starting at v0; -1 when there is none in [0, V). */
static inline int64_t target_column(const int64_t *targets, int64_t i, int64_t vocab, int64_t v0)
{
    if (!targets || targets[i] < 0 || targets[i] >= vocab)
        return -1;
    return targets[i] - v0;
}

static inline fh_elem_type elem_type(fh_dtype dtype)
{
    return dtype == FH_DTYPE_BF16 ? FH_ELEM_BF16 : FH_ELEM_F32;
}

static inline size_t elem_size(fh_elem_type type)
{
    return type == FH_ELEM_BF16 ? sizeof(uint16_t) : sizeof(float);
}

/* A view of the matrix at base whose first element is `offset` elements in. */
static inline fh_gemm_input view(const void *base, fh_elem_type type, int64_t offset, int64_t row_stride,
                                 int64_t col_stride)
{
    const fh_gemm_input v = {(const char *)base + (size_t)offset * elem_size(type), row_stride, col_stride, type};
    return v;
}

static inline fh_gemm_output f32_output(float *data, int64_t row_stride, int64_t col_stride)
{
    const fh_gemm_output v = {data, row_stride, col_stride, FH_ELEM_F32};
    return v;
}

/* A row block as the passes walk it (row_blocks.c): one segment of rows, or two (paired groups: one in each half);
 * segment s is rows first[s] .. first[s] + rows[s] - 1, from tile row tile_row[s]. */
typedef struct fh_block {
    int segments;
    int64_t first[2], rows[2], tile_row[2];
    int64_t first_group, end_group; /* with groups; else 0 */
    int64_t next;                   /* where the next block starts: a row, or with groups a group */
} fh_block;

/* The pass's first row block into b (start 1), or the one after b; 0 when there is none. Blocks of plan->tile_rows
 * rows (the last one shorter), or with groups as many whole groups as fit tile_rows (at least one). */
int fh_block_next(const fh_pass *p, fh_block *b, int start);
/* dw_block_acc: whether block b starts a new span of dU after span_rows rows (a paired block stands alone, each
 * segment its own span; else a span stops at plan->du_rows). */
int fh_span_ends_before(const fh_pass *p, const fh_block *b, int64_t span_rows);

static inline int64_t fh_block_rows(const fh_block *b)
{
    return b->rows[0] + (b->segments > 1 ? b->rows[1] : 0);
}

/* The segment of the block's tile row r. */
static inline int fh_block_segment(const fh_block *b, int64_t r)
{
    return b->segments > 1 && r >= b->tile_row[1];
}

/* ---- sinks.c ---- */

/* One run of a walk over an H-row matrix (fh_walk): `length` elements from (k, j), along the vocabulary (columns
 * j + e, or with a column list columns[c + e]) or down hidden (rows k + e of column j, list entry c). */
typedef struct fh_run {
    int64_t k, j, c, length;
    int along_vocab;
    const int64_t *columns;
} fh_run;

static inline int64_t fh_run_k(const fh_run *run, int64_t e)
{
    return run->along_vocab ? run->k : run->k + e;
}

static inline int64_t fh_run_j(const fh_run *run, int64_t e)
{
    return !run->along_vocab ? run->j : run->columns ? run->columns[run->c + e] : run->j + e;
}

/* The list entry of element e (with a column list). */
static inline int64_t fh_run_c(const fh_run *run, int64_t e)
{
    return run->along_vocab ? run->c + e : run->c;
}

typedef void fh_run_fn(const void *self, const fh_run *run);

/* Walks columns j0 .. j0 + count - 1 (or, with columns, the list columns[0..count)) of every row k < hidden of a
 * matrix whose contiguous direction is the vocabulary (along_vocab: a run per row) or hidden (a run per column), the
 * runs spread over threads: every walk over dweight, its accumulator or filtering's chunks reads and writes in order
 * through this. body is called concurrently for different runs. */
void fh_walk(int threads, int64_t hidden, int along_vocab, int64_t j0, int64_t count, const int64_t *columns,
             fh_run_fn *body, const void *self);

/* out[e step] (+ itself when accumulate) = values[e] for e < count, in out's dtype: f32 added in f32, bf16 rounded
 * once (a contiguous run through the rounding kernel). The one store into a gradient that honours beta and bf16. */
static inline void fh_store(void *out, fh_dtype dtype, int64_t step, const float *values, int64_t count, int accumulate)
{
    if (dtype == FH_DTYPE_BF16 && step == 1) {
        fh_row_add_to_bf16(values, count, accumulate, out);
        return;
    }
    for (int64_t e = 0; e < count; e++) {
        if (dtype == FH_DTYPE_BF16) {
            fh_row_add_to_bf16(values + e, 1, accumulate, (uint16_t *)out + e * step);
        } else {
            float *d = (float *)out + e * step;
            *d = accumulate ? *d + values[e] : values[e];
        }
    }
}

int64_t fh_du_chunk(const fh_pass *p, int64_t vb);
fh_gemm_input fh_du_view(const fh_pass *p, int64_t tile_row, int64_t i0, int64_t vb, int64_t j0);
void fh_round_du_row(const fh_pass *p, const float *row, int64_t tile_row, int64_t i0, int64_t r, int64_t vb);
/* f32_du_chunks, whose blocks compute their logits straight into the chunks: chunk c's row i (its rows follow at the
 * chunk's width), and row i of every chunk loaded into a V-wide row or stored from it. */
float *fh_du_chunk_rows(const fh_pass *p, int64_t c, int64_t i);
void fh_chunk_row_load(const fh_pass *p, int64_t i, float *row);
void fh_chunk_row_store(const fh_pass *p, int64_t i, const float *row);
/* dw_acc (dweight's columns v0 .. v0 + vb - 1, f32) rounded once into the bf16 dweight, as beta says (streaming.c). */
void fh_round_dweight_accumulator(const fh_pass *p, int64_t v0, int64_t vb);
float *fh_dx_row_f32(const fh_pass *p, int64_t i, int64_t i0);

/* Where they add into dweight (k, tile column jt), unless dweight_after_blocks: dw_acc for a streamed bf16
 * dweight, else the fp32 dweight. */
static inline float *fh_dw_f32(const fh_pass *p, int64_t k, int64_t jt, int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->in.lin;
    if (p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR)
        return p->ws.dw_acc + (p->sinks.by_vocab ? k * vb + jt : jt * lin->hidden + k);
    return (float *)p->in.grads->dweight + k * lin->w_stride_hidden + (v0 + jt) * lin->w_stride_vocab;
}

/* dw_f32 (k, j) = dw_f32 (0, 0) + k * stride_k + j * stride_j. */
static inline void fh_dw_strides(const fh_pass *p, int64_t vb, int64_t *stride_k, int64_t *stride_j)
{
    const fh_linear *lin = p->in.lin;
    const int accumulator = p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR, by_vocab = p->sinks.by_vocab;
    *stride_k = accumulator ? (by_vocab ? vb : 1) : lin->w_stride_hidden;
    *stride_j = accumulator ? (by_vocab ? 1 : lin->hidden) : lin->w_stride_vocab;
}

/* ---- products.c ---- */
fh_status fh_pass_multiply(const fh_pass *p, int prepare, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                           const fh_gemm_input *b, int accumulate, const fh_gemm_output *c);
fh_status fh_pass_logits(const fh_pass *p, int prepare, float *tile, int64_t i0, int64_t nb, int64_t v0, int64_t vb);
fh_status fh_pass_dx_product(const fh_pass *p, int prepare, int64_t i0, int64_t nb, int64_t len,
                             const fh_gemm_input *du, const fh_gemm_input *wt, int accumulate);
fh_status fh_pass_add_dx(const fh_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                         int64_t vb, int64_t j0, int64_t len, int accumulate);
fh_gemm_input fh_pass_x_transposed(const fh_pass *p, int64_t i0);
fh_status fh_pass_add_dweight(const fh_pass *p, int prepare, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                              int64_t vb, int64_t j0, int64_t len, int accumulate);
fh_status fh_pass_dweight_by_chunks(const fh_pass *p, int prepare);
void fh_round_into_bf16(const float *acc, int64_t acc_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                        int64_t cols, int accumulate, int threads);
void fh_copy_x_rows(const fh_pass *p, int64_t i0, int64_t nb);
void fh_write_bias_gradient(const fh_linear_grads *grads, const double *column, int64_t v0, int64_t count);
void fh_add_column_sums(const float *tile, int64_t rows, int64_t cols, double *column, int threads);
float *fh_companion_row(const fh_pass *p, const float *row);
void fh_pair_rows(const fh_pass *p, float *row, int64_t v0, int64_t vb);

/* ---- gradients.c ---- */
fh_status fh_pass_prepare(const fh_pass *p);
void fh_pass_row_gradient(const fh_pass *p, float *row, int64_t tile_row, int segment, int64_t vb, int64_t target,
                          const float *weights, const fh_coef *k);
fh_status fh_pass_gradients(const fh_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb, int64_t v0,
                            int64_t vb, int dweight_holds);

#endif
