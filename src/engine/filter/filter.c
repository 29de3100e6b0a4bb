/* Gradient filtering's hooks (filter.h): marking the columns a tile keeps, the filtered gradients of a tile, and the
 * dweight columns nothing reached. */
#include "filter_internal.h"

#include <math.h>
#include <omp.h>

/* ---- Gradient filtering (FH_PARAM_GRAD_FILTER_EPS) ----
 * dU = a p + e p (z - sum_pz) + c w + b [j = target] (times dz/du). While a row's dU is formed, gradient_and_marks
 * marks the columns where |dU| reaches eps times the row's scale, and the row's target column. A column of a tile
 * that no row of it marked is skipped by the dx and dweight GEMMs, which run on the kept columns gathered (above); its
 * softmax terms are replaced by the tail estimate r_i nu_j / S (or dropped: FH_FILTER_TAIL_DROP), and its c w
 * term, rank one without a softcap (dz/du = 1/T), is applied exactly as dx_i += c_i / T sum_j w_j W[:, j] and
 * dW[:, j] += w_j / T sum_i c_i x_i over the skipped columns; both go through fh_skipped_term (below). dweight
 * columns honour beta through the `dw_holds` flags: a column is written (zeroed first when beta is 0 or it is an
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
static uint8_t *thread_marks(const fh_pass *p, int segment)
{
    const int64_t cols = p->in.plan->tile_vocab;
    return p->ws.filter.thread_marks + ((int64_t)segment * p->in.plan->threads + omp_get_thread_num()) * cols;
}

/* The calling thread's profile of segment `segment` for the tail estimate: the magnitudes of its rows' entries
 * below their thresholds, per column (f32, cleared by tail_profile). */
static float *thread_profile(const fh_pass *p, int segment)
{
    const int64_t cols = p->in.plan->tile_vocab;
    return p->ws.filter.tail_nu + ((int64_t)segment * p->in.plan->threads + omp_get_thread_num()) * cols;
}

/* Overwrites row tile_row (transformed logits, or their exps with coef->p_scale; columns of the tile's class weights
 * `weights`) with its dU. When filtering, records the row's c and marks the columns to keep as the dU is formed
 * (fh_row_marking), before any rounding; for the tail estimate, in the same pass, the sum of the row's softmax terms
 * below its threshold (tail_rows, less the kept columns' share later) and their magnitudes into the thread's
 * profile. A row of scale 0 has no softmax terms and marks nothing. */
void fh_filter_row_gradient(const fh_pass *p, float *row, int64_t tile_row, int segment, int64_t vb,
                               int64_t target, const float *weights, const fh_coef *k)
{
    const fh_workspace *ws = &p->ws;
    const int tail = p->in.plan->tail_estimate;
    const double threshold = p->in.plan->filter_eps * row_scale(k);
    fh_row_marking marking = {0.0f, 0.0f, NULL, NULL, 0.0};
    ws->filter.row_c[tile_row] = k->c;
    if (tail) {
        ws->filter.tail_rows[tile_row] = 0.0;
        ws->filter.row_least[tile_row] = 0.0f;
    }
    if (threshold > 0.0) {
        /* The least float >= threshold: |dU| < threshold in double is |dU| < it in float. */
        marking.threshold = (float)threshold;
        if (marking.threshold < threshold)
            marking.threshold = nextafterf(marking.threshold, INFINITY);
        marking.c = (float)(k->c * p->in.tf.inv_temperature);
        marking.marks = thread_marks(p, segment);
        marking.nu = tail ? thread_profile(p, segment) : NULL;
    }
    fh_row_gradient(row, vb, target, weights, k, &p->in.tf, marking.marks ? &marking : NULL);
    if (!marking.marks)
        return;
    if (tail) {
        ws->filter.row_least[tile_row] = marking.threshold;
        ws->filter.tail_rows[tile_row] = marking.tail;
    }
    if (target >= 0 && target < vb)
        marking.marks[target] = 1;
}

/* The tile's kept_flag from the thread marks of segment `segment` (every column when unfiltered), the marks cleared for
 * the next tile; the kept columns listed in order. Returns their number. */
static int64_t keep_columns(const fh_pass *p, int segment, int64_t vb, int unfiltered)
{
    const int64_t cols = p->in.plan->tile_vocab;
    const int threads = p->in.plan->threads;
    uint8_t *marks = p->ws.filter.thread_marks + (int64_t)segment * threads * cols, *keep = p->ws.filter.kept_flag;
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
            p->ws.filter.kept_columns[count++] = j;
    return count;
}

/* The tail estimate's column factors of a tile (vb columns) marked as segment `segment`: each skipped column's
 * sum nu of its rows' magnitudes (tail_columns; 0 for a kept column), from the threads' profiles, which are
 * cleared for the next tile. Returns S, the sum of every nu. Each thread owns a range of columns. */
static double tail_profile(const fh_pass *p, int segment, int64_t vb)
{
    const fh_workspace *ws = &p->ws;
    const int threads = p->in.plan->threads;
    const int64_t cols = p->in.plan->tile_vocab;
    float *profiles = ws->filter.tail_nu + (int64_t)segment * threads * cols;
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
            ws->filter.tail_columns[j] = ws->filter.kept_flag[j] ? 0.0 : sum;
            total += ws->filter.tail_columns[j];
        }
    }
    return total;
}

/* The filtered gradient GEMMs of a dU tile's rows from tile_row (rows i0.., columns v0.., marked as segment
 * `segment`), and the rank-one terms of the columns they skip. The dx it adds to holds this call's earlier terms
 * (zeroed at the pass's start, or at the block's when in row blocks). */
fh_status fh_filter_gradients(const fh_pass *p, int segment, int64_t tile_row, int64_t i0, int64_t nb,
                                    int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const fh_workspace *ws = &p->ws;
    const int64_t h = lin->hidden;
    const int after = p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS;
    int any_c = 0;
    for (int64_t r = 0; r < nb; r++)
        any_c |= ws->filter.row_c[tile_row + r] != 0.0;
    const int unfiltered = any_c && p->in.tf.softcap > 0.0f; /* c w is not rank one under a softcap */
    const int64_t kept = keep_columns(p, segment, vb, unfiltered), skipped_columns = vb - kept;
    for (int64_t c = 0; after && c < kept; c++)
        ws->filter.dw_holds[ws->filter.kept_columns[c]] = 1; /* the dweight GEMM after the blocks needs this column */
    const int gemms = (grads->dx != NULL) + (grads->dweight && !after);
    ws->filter_stats->gradient_flops += 2.0 * (double)nb * (double)h * (double)vb * gemms;
    ws->filter_stats->skipped_flops += 2.0 * (double)nb * (double)h * (double)skipped_columns * gemms;
    /* The tail's row sums lose their kept columns' share when an f32 tile is compacted for the GEMMs, else here. */
    const double tail_total = p->in.plan->tail_estimate ? tail_profile(p, segment, vb) : 0.0;
    if (tail_total > 0.0 && p->in.plan->bf16_du)
        fh_filter_compact_rows(p, tile_row, nb, vb, kept, p->in.class_weights ? p->in.class_weights + v0 : NULL, 0);
    if (p->in.plan->fp32_du)
        fh_copy_x_rows(p, i0, nb);
    const fh_status st = kept == vb ? fh_filter_all_kept_gemms(p, tile_row, i0, nb, v0, vb)
                                    : fh_filter_kept_gemms(p, tile_row, i0, nb, v0, vb, kept, 1);
    double *v = ws->filter.vectors;
    fh_skipped_term terms[2];
    int count = 0;
    if (any_c)
        terms[count++] = (fh_skipped_term){ws->filter.row_c + tile_row, p->in.class_weights ? p->in.class_weights + v0 : NULL, NULL,
                                        p->in.tf.inv_temperature, v + TERM_S_C * h, v + TERM_G_C * h,
                                        v + TERM_G_ALL_C * h};
    if (tail_total > 0.0)
        terms[count++] = (fh_skipped_term){ws->filter.tail_rows + tile_row, NULL, ws->filter.tail_columns, 1.0 / tail_total,
                                        v + TERM_S_TAIL * h, v + TERM_G_TAIL * h, v + TERM_G_ALL_TAIL * h};
    if (st != FH_OK || count == 0)
        return st;
    if (grads->dweight && after) {
        /* for the columns that every row block skips */
        for (int t = 0; t < count; t++)
            fh_weighted_rows(p, terms[t].rows, i0, nb, 1, terms[t].g_all);
        if (tail_total > 0.0) {
            double *total = ws->filter.tail_columns + p->in.plan->tile_vocab; /* every block's (tile_vocab = vocab = vb) */
            for (int64_t j = 0; j < vb; j++)
                total[j] += ws->filter.tail_columns[j];
            v[TERM_VECTORS * h] += tail_total;
        }
    }
    if (skipped_columns == 0)
        return FH_OK;
    if (grads->dx) {
        fh_skipped_weight_sums(p, v0, vb, terms, count);
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
        for (int64_t r = 0; r < nb; r++) {
            float *dx = fh_dx_row_f32(p, i0 + r, i0);
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
            fh_weighted_rows(p, terms[t].rows, i0, nb, 0, terms[t].g);
        fh_skipped_columns_term(p, v0, vb, terms, count);
    }
    return FH_OK;
}

/* Before a filtered pass: no column marked or used yet, the rank-one sums of the row blocks at zero, dx zeroed
 * where the GEMMs and terms add into it (its accumulator, or an fp32 dx with beta 0). */
void fh_filter_begin(const fh_pass *p)
{
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    memset(p->ws.filter.thread_marks, 0, 2 * (size_t)p->in.plan->threads * (size_t)p->in.plan->tile_vocab);
    memset(p->ws.filter.dw_holds, 0, (size_t)p->in.plan->tile_vocab);
    memset(p->ws.filter.vectors, 0, (TERM_VECTORS * (size_t)lin->hidden + 1) * sizeof(double));
    if (p->in.plan->tail_estimate) {
        memset(p->ws.filter.tail_nu, 0, 2 * (size_t)p->in.plan->threads * (size_t)p->in.plan->tile_vocab * sizeof(float));
        if (p->sinks.dweight == FH_DWEIGHT_AFTER_BLOCKS)
            memset(p->ws.filter.tail_columns + p->in.plan->tile_vocab, 0, (size_t)p->in.plan->tile_vocab * sizeof(double));
    }
    if (!grads->dx || p->in.plan->row_blocks)
        return;
    if (p->sinks.dx == FH_DX_ACCUMULATOR)
        memset(p->ws.dx_acc, 0, (size_t)(lin->n * lin->hidden) * sizeof(float));
    else if (grads->dx_beta == 0.0f)
        for (int64_t i = 0; i < lin->n; i++)
            memset((float *)grads->dx + i * grads->dx_row_stride, 0, (size_t)lin->hidden * sizeof(float));
}

/* dweight's columns of a tile (v0, vb) that nothing reached: zeroed when overwritten (beta 0, an accumulator),
 * a run of them at a time. */
void fh_filter_finish_columns(const fh_pass *p, int64_t v0, int64_t vb)
{
    const uint8_t *used = p->ws.filter.dw_holds;
    int64_t stride_k, stride_j;
    fh_dw_strides(p, vb, &stride_k, &stride_j);
    for (int64_t j0 = 0; j0 < vb && p->sinks.dw_overwrites;) {
        int64_t j1 = j0 + 1;
        while (j1 < vb && used[j1] == used[j0])
            j1++;
        if (!used[j0])
            fh_zero_columns(p, (char *)fh_dw_f32(p, 0, 0, v0, vb), sizeof(float), stride_k, stride_j, j0, j1);
        j0 = j1;
    }
    memset(p->ws.filter.dw_holds, 0, (size_t)vb);
}

/* A filtered row block's dx rows (segment at i0): zeroed before its GEMMs and terms add into them (the f32
 * dx_block of a bf16 dx, or an fp32 dx with beta 0); dx_block rounded into dx after. */
void fh_filter_block_begin(const fh_pass *p, int64_t i0, int64_t nb)
{
    const fh_linear_grads *grads = p->in.grads;
    const int64_t h = p->in.lin->hidden;
    if (!grads->dx)
        return;
    if (p->sinks.dx == FH_DX_BLOCK)
        memset(p->ws.dx_block, 0, (size_t)(nb * h) * sizeof(float));
    else if (grads->dx_beta == 0.0f)
        for (int64_t i = i0; i < i0 + nb; i++)
            memset((float *)grads->dx + i * grads->dx_row_stride, 0, (size_t)h * sizeof(float));
}

void fh_filter_tile_end(const fh_pass *p, int64_t v0, int64_t vb)
{
    if (p->in.grads->dweight)
        fh_filter_finish_columns(p, v0, vb);
}
