/* The single-call train step in row blocks of tile_rows x V: each block's logits are computed once, folded, turned
 * into dU while hot in cache and multiplied out. In bf16 row blocks dx is summed per block over the dU chunks (in f32,
 * dx_block, when it is bf16) and dweight is one GEMM per chunk after the last block, over the bf16 dU of every row,
 * written directly; where every row's dU does not fit (dw_block_acc), one GEMM per span of blocks into the f32
 * accumulator. fp32 row blocks that keep every row's f32 dU in chunks (f32_du_chunks, at N <= H) compute their
 * logits into those chunks, work on each row in a row of the tile and write dweight the same way after the last
 * block; other fp32 blocks add their own dweight GEMM. */
#include "pass.h"

#include "filter/filter.h"

#include <math.h>
#include <omp.h>

/* Transforms row i of the block in place, folds it over lin's columns and stores its final statistics. */
static fh_final_stats fold_row(const fh_pass *p, const fh_fold_request *request, float *row, int64_t i)
{
    const int64_t vocab = p->in.lin->vocab;
    const fh_token_stats *stats = p->in.stats;
    fh_row_transform(row, vocab, p->in.lin->bias, &p->in.tf);
    fh_fold_state st = fh_fold_state_initial();
    fh_row_fold(row, vocab, 0, target_column(p->in.targets, i, vocab, 0), request, &st);
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

/* Rows of groups g0 .. g1 - 1 in one half (half 1: the paired groups). */
static int64_t group_span(const fh_row_groups *g, int half, int64_t g0, int64_t g1)
{
    const int64_t base = half ? g->count : 0;
    return fh_group_first(g, base + g1) - fh_group_first(g, base + g0);
}

int fh_block_next(const fh_pass *p, fh_block *b, int start)
{
    const fh_row_groups *g = p->in.groups;
    const int64_t height = p->in.plan->tile_rows, at = start ? 0 : b->next;
    if (!g) {
        const int64_t n = p->in.lin->n;
        if (at >= n)
            return 0;
        *b = (fh_block){.segments = 1, .first = {at, 0}, .rows = {min64(height, n - at), 0}, .next = at + height};
        return 1;
    }
    if (at >= g->count)
        return 0;
    /* As many whole groups as fit (the plan made room for the tallest); the first one always. */
    const int halves = g->paired ? 2 : 1;
    int64_t end = at + 1;
    while (end < g->count) {
        int64_t rows = 0;
        for (int h = 0; h < halves; h++)
            rows += group_span(g, h, at, end + 1);
        if (rows > height)
            break;
        end++;
    }
    *b = (fh_block){.segments = halves, .first_group = at, .end_group = end, .next = end};
    for (int h = 0; h < halves; h++) {
        b->first[h] = fh_group_first(g, (h ? g->count : 0) + at);
        b->rows[h] = group_span(g, h, at, end);
        b->tile_row[h] = h ? b->rows[0] : 0;
    }
    return 1;
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
static void gradient_row(const fh_pass *p, float *row, int64_t tile_row, int segment, int64_t i0, int64_t r,
                         const fh_final_stats *stats, int exps)
{
    const int64_t i = i0 + r;
    const int64_t vocab = p->in.lin->vocab, t = target_column(p->in.targets, i, vocab, 0);
    fh_coef k = {stats->lse, 0.0, 0.0, 0.0, 0.0, stats->sum_pz, exps ? 1.0 / p->in.stats->sum_exp[i] : 0.0};
    p->in.source->row(p->in.source->self, i, stats, &k);
    fh_pass_row_gradient(p, row, tile_row, segment, vocab, t, p->in.class_weights, &k);
    fh_round_du_row(p, row, tile_row, i0, r, vocab);
}

static void block_dx_end(const fh_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear_grads *grads = p->in.grads;
    if (grads->dx && p->sinks.dx == FH_DX_BLOCK)
        fh_round_into_bf16(p->ws.dx_block, p->in.lin->hidden, (uint16_t *)grads->dx + i0 * grads->dx_row_stride,
                        grads->dx_row_stride, nb, p->in.lin->hidden, grads->dx_beta != 0.0f, p->in.plan->threads);
}

/* Row r of the segment at i0 (tile row tile_row) with a pair: both rows made ready, every forward pass of the
 * kernels, then its dU. */
static void pair_row_block(const fh_pass *p, float *row, int64_t tile_row, int64_t i0, int64_t r)
{
    const fh_pair_kernels *k = p->in.pair;
    const int64_t i = i0 + r, vocab = p->in.lin->vocab;
    float *crow = fh_companion_row(p, row);
    fh_pair_rows(p, row, 0, vocab);
    for (int pass = 0; pass < k->passes; pass++) {
        k->fold(k->self, pass, i, row, crow, vocab, 0);
        k->finish(k->self, pass, i);
    }
    k->gradient(k->self, i, row, crow, vocab, 0);
    fh_round_du_row(p, row, tile_row, i0, r, vocab);
}

int fh_span_ends_before(const fh_pass *p, const fh_block *b, int64_t span_rows)
{
    return b->segments > 1 || span_rows + fh_block_rows(b) > p->in.plan->du_rows;
}

/* dw_block_acc: the dweight GEMM over rows first .. first + rows - 1, whose dU the du buffer holds from row du_row. */
static fh_status add_span_dweight(const fh_pass *p, int64_t du_row, int64_t first, int64_t rows, int *dweight_holds)
{
    if (rows == 0)
        return FH_OK;
    const int64_t vocab = p->in.lin->vocab;
    p->ws.filter_stats->gradient_flops += 2.0 * (double)rows * (double)p->in.lin->hidden * (double)vocab;
    const fh_status st = fh_pass_add_dweight(p, 0, du_row, first, rows, 0, vocab, 0, vocab, *dweight_holds);
    *dweight_holds = 1;
    return st;
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

/* The block's tile row r: its row of lin, and the segment's first row. */
static int64_t block_row(const fh_block *b, int64_t r, int *segment, int64_t *first)
{
    *segment = fh_block_segment(b, r);
    *first = b->first[*segment];
    return r - b->tile_row[*segment];
}

/* The logits of the segment's rows first .. first + rows - 1, at tile row tile_row; with f32_du_chunks straight into
 * every row's dU chunks, a GEMM per chunk. */
static fh_status segment_logits(const fh_pass *p, float *tile, int64_t tile_row, int64_t first, int64_t rows)
{
    const int64_t vocab = p->in.lin->vocab, t = p->in.plan->du_chunk;
    if (!p->in.plan->f32_du_chunks)
        return fh_pass_logits(p, 0, tile + tile_row * vocab, first, rows, 0, vocab);
    fh_status st = FH_OK;
    for (int64_t j0 = 0; j0 < vocab && st == FH_OK; j0 += t)
        st = fh_pass_logits(p, 0, fh_du_chunk_rows(p, j0 / t, first), first, rows, j0, min64(t, vocab - j0));
    return st;
}

/* The block's tile row r (row i of the call) where the row loops work on it: in the tile, or with f32_du_chunks
 * loaded from the chunks into the calling thread's row of the tile (fh_round_du_row stores it back). */
static float *working_row(const fh_pass *p, float *tile, int64_t r, int64_t i)
{
    const int64_t vocab = p->in.lin->vocab;
    if (!p->in.plan->f32_du_chunks)
        return tile + r * vocab;
    float *row = tile + (int64_t)omp_get_thread_num() * vocab;
    fh_chunk_row_load(p, i, row);
    return row;
}

/* The bias gradient's column sums of the block's dU. */
static void add_block_column_sums(const fh_pass *p, const float *tile, const fh_block *b, double *column)
{
    const int64_t vocab = p->in.lin->vocab, t = p->in.plan->du_chunk;
    const int threads = p->in.plan->threads;
    if (!p->in.plan->f32_du_chunks) {
        fh_add_column_sums(tile, fh_block_rows(b), vocab, column, threads);
        return;
    }
    for (int s = 0; s < b->segments; s++)
        for (int64_t j0 = 0; j0 < vocab; j0 += t)
            fh_add_column_sums(fh_du_chunk_rows(p, j0 / t, b->first[s]), b->rows[s], min64(t, vocab - j0),
                               column + j0, threads);
}

static fh_status row_blocks(fh_pass *p)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const fh_token_stats *stats = p->in.stats;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int threads = p->in.plan->threads;
    /* Each row is folded in one tile; its exps replace it when the gradient needs z no more (fh_coef.p_scale) and
     * no block hook can change its log-sum-exp (a vocabulary-parallel one makes it global). */
    const int entropy = stats && stats->sum_pz;
    const fh_fold_request request = {p->in.class_weights, stats && stats->sum_weighted_z, entropy,
                                     !entropy && !(p->in.tf.softcap > 0.0f) && !p->in.pair && !p->in.source->block, NULL};
    float *tile = p->ws.tile;
    double *column = p->ws.column;
    fh_status st = fh_pass_prepare(p);
    if (st != FH_OK)
        return st;
    if (grads->dbias)
        for (int64_t j = 0; j < vocab; j++)
            column[j] = 0.0;
    if (p->filter)
        fh_filter_begin(p);
    int dweight_holds = 0; /* whether a block's GEMMs wrote dweight yet (a first segment may hold no row) */
    const int spans = grads->dweight && p->in.plan->dw_block_acc;
    uint16_t *const du = p->ws.du; /* spans: each block's dU at its place in the span */
    int64_t span_first = 0, span_rows = 0;
    fh_block b;
    for (int more = fh_block_next(p, &b, 1); more; more = fh_block_next(p, &b, 0)) {
        const int64_t rows = fh_block_rows(&b);
        if (spans && fh_span_ends_before(p, &b, span_rows)) {
            p->ws.du = du;
            st = add_span_dweight(p, 0, span_first, span_rows, &dweight_holds);
            if (st != FH_OK)
                return st;
            span_rows = 0;
        }
        if (spans) {
            span_first = span_rows ? span_first : b.first[0];
            p->ws.du = du + span_rows * vocab;
        }
        for (int s = 0; s < b.segments && st == FH_OK; s++)
            if (b.rows[s] > 0)
                st = segment_logits(p, tile, b.tile_row[s], b.first[s], b.rows[s]);
        if (st != FH_OK)
            return st;
        if (p->in.pair) {
            /* Every pass over both rows, then the gradient, while they are hot in cache. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int segment;
                int64_t first;
                const int64_t k = block_row(&b, r, &segment, &first);
                pair_row_block(p, working_row(p, tile, r, first + k), r, first, k);
            }
        } else if (!p->in.source->block) {
            /* Fold, then the gradient while the row is still hot in cache. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int segment;
                int64_t first;
                const int64_t k = block_row(&b, r, &segment, &first);
                float *row = working_row(p, tile, r, first + k);
                fh_fold_request ahead = request;
                ahead.next = r + 1 < rows && !p->in.plan->f32_du_chunks ? tile + (r + 1) * vocab : NULL;
                const fh_final_stats result = fold_row(p, &ahead, row, first + k);
                gradient_row(p, row, r, segment, first, k, &result, request.store_exps);
            }
        } else {
            /* The hook needs the whole block's statistics before any row's coefficients. */
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int segment;
                int64_t first;
                const int64_t k = block_row(&b, r, &segment, &first);
                float *row = working_row(p, tile, r, first + k);
                fold_row(p, &request, row, first + k);
                if (p->in.plan->f32_du_chunks) /* the transformed logits, for the gradient loop below */
                    fh_chunk_row_store(p, first + k, row);
            }
            const fh_token_stats view = stats_from(stats, b.first[0]);
            const fh_row_block hook = {b.first[0], b.rows[0], b.first_group, b.end_group};
            st = p->in.source->block(p->in.source->self, &hook, &view);
            if (st != FH_OK)
                return st;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int segment;
                int64_t first;
                const int64_t k = block_row(&b, r, &segment, &first);
                const fh_final_stats result = stored_stats(stats, first + k);
                gradient_row(p, working_row(p, tile, r, first + k), r, segment, first, k, &result,
                             request.store_exps);
            }
        }
        if (grads->dbias)
            add_block_column_sums(p, tile, &b, column);
        for (int s = 0; s < b.segments && st == FH_OK; s++) {
            if (b.rows[s] == 0)
                continue;
            if (p->filter)
                fh_filter_block_begin(p, b.first[s], b.rows[s]);
            st = fh_pass_gradients(p, s, b.tile_row[s], b.first[s], b.rows[s], 0, vocab, dweight_holds);
            if (!spans)
                dweight_holds = 1;
            if (st == FH_OK)
                block_dx_end(p, b.first[s], b.rows[s]);
            /* A paired block's segments are two runs of rows: each its own span. */
            if (st == FH_OK && spans && b.segments > 1)
                st = add_span_dweight(p, b.tile_row[s], b.first[s], b.rows[s], &dweight_holds);
        }
        if (st != FH_OK)
            return st;
        span_rows += spans && b.segments == 1 ? rows : 0;
    }
    if (spans) {
        p->ws.du = du;
        st = add_span_dweight(p, 0, span_first, span_rows, &dweight_holds);
    }
    if (st != FH_OK)
        return st;
    if (p->filter)
        st = fh_filter_blocks_end(p);
    else if (grads->dweight && p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS) {
        p->ws.filter_stats->gradient_flops += 2.0 * (double)n * (double)lin->hidden * (double)vocab;
        st = fh_pass_dweight_by_chunks(p, 0);
    } else if (grads->dweight && p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR) {
        fh_round_dweight_accumulator(p, 0, vocab); /* dw_block_acc: every block added in f32 */
    }
    if (st != FH_OK)
        return st;
    if (grads->dbias)
        fh_write_bias_gradient(grads, column, 0, vocab);
    return FH_OK;
}

fh_status fh_engine_row_blocks(const fh_engine_pass *in)
{
    fh_pass p;
    fh_pass_begin(&p, in);
    return row_blocks(&p);
}
