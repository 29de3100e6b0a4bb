/* The streaming passes. Both walk vocabulary tiles in the outer loop and token blocks in the inner one: a dweight tile
 * (H x tile_vocab) is finished before moving on, so the H x V accumulator is written once per row block of its own
 * tile and never revisited; dx (N x H, usually the smaller) is the one re-accumulated per vocabulary tile. bf16
 * gradients that several GEMMs add up go through f32 accumulators (dx_acc, dw_acc) and are rounded once.
 * Also the target logits a streaming backward may need before its first tile (fh_engine_target_logits). */
#include "pass.h"

#include "filter/filter.h"

#include <math.h>
#include <string.h>

/* The f32 accumulators of a streaming pass rounded into bf16 gradients: dweight's tile (v0, vb) after its
 * last row tile, dx after the last vocabulary tile. */
typedef struct dweight_tile {
    const fh_pass *p;
    int64_t v0, vb;
} dweight_tile;

/* One run of dw_acc (laid out as dweight runs) rounded into dweight. */
static void round_dweight_run(const void *self, const fh_run *run)
{
    const dweight_tile *t = self;
    const fh_linear *lin = t->p->in.lin;
    const fh_linear_grads *grads = t->p->in.grads;
    const float *acc = t->p->ws.dw_acc + (run->along_vocab ? run->k * t->vb + run->j : run->j * lin->hidden + run->k);
    uint16_t *out = (uint16_t *)grads->dweight + (t->v0 + run->j) * lin->w_stride_vocab + run->k * lin->w_stride_hidden;
    fh_store(out, FH_DTYPE_BF16, run->along_vocab ? lin->w_stride_vocab : lin->w_stride_hidden, acc, run->length,
             grads->dweight_beta != 0.0f);
}

void fh_round_dweight_accumulator(const fh_pass *p, int64_t v0, int64_t vb)
{
    const dweight_tile tile = {p, v0, vb};
    fh_walk(p->in.plan->threads, p->in.lin->hidden, p->sinks.by_vocab, 0, vb, NULL, round_dweight_run, &tile);
}

static void finish_dx(const fh_pass *p)
{
    const fh_linear *lin = p->in.lin;
    fh_round_into_bf16(p->ws.dx_acc, lin->hidden, p->in.grads->dx, p->in.grads->dx_row_stride, lin->n, lin->hidden,
                    p->in.grads->dx_beta != 0.0f, p->in.plan->threads);
}

/* fp32_du: the f32 copies of the weight tile's columns (per vocabulary tile) and of the x rows (per tile). */
static void copy_weight_columns(const fh_pass *p, int64_t v0, int64_t vb)
{
    const fh_linear *lin = p->in.lin;
    const uint16_t *w = lin->weight;
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t k = 0; k < lin->hidden; k++)
        for (int64_t j = 0; j < vb; j++)
            p->ws.w32[k * vb + j] = fh_bf16_to_f32(w[k * lin->w_stride_hidden + (v0 + j) * lin->w_stride_vocab]);
}

/* Folds rows [i0, i0 + nb) of a forward tile (columns v0 .. v0 + vb - 1) into p->in.stats, or with a pair through its
 * kernels' pass `pass`. Until the pass ends, the lse array holds the running max and sum_pz's the running sum of
 * z exp(z - max). */
static void fold_tile(const fh_pass *p, int pass, float *tile, int64_t i0, int64_t nb, int64_t v0, int64_t vb)
{
    const fh_token_stats *stats = p->in.stats;
    const int64_t vocab = p->in.lin->vocab;
    if (p->in.pair) {
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
        for (int64_t r = 0; r < nb; r++) {
            float *row = tile + r * vb;
            fh_pair_rows(p, row, v0, vb);
            p->in.pair->fold(p->in.pair->self, pass, i0 + r, row, fh_companion_row(p, row), vb, v0);
        }
        return;
    }
    double *const running_max = stats->lse, *const running_sum_z_exp = stats->sum_pz;
    const fh_fold_request request = {p->in.class_weights ? p->in.class_weights + v0 : NULL, stats->sum_weighted_z != NULL,
                                     running_sum_z_exp != NULL, 0, NULL};
    const float *bias = p->in.lin->bias ? p->in.lin->bias + v0 : NULL;
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        const int64_t i = i0 + r;
        fh_row_transform(tile + r * vb, vb, bias, &p->in.tf);
        fh_fold_state st = {running_max[i], stats->sum_exp[i], stats->z_target[i],
                            stats->sum_weighted_z ? stats->sum_weighted_z[i] : 0.0,
                            running_sum_z_exp ? running_sum_z_exp[i] : 0.0, stats->argmax ? stats->argmax[i] : 0};
        fh_row_fold(tile + r * vb, vb, v0, target_column(p->in.targets, i, vocab, v0), &request, &st);
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

/* Where lin's row i is in kept logits (fh_engine_pass's keep and kept). */
static float *kept_row(const fh_pass *p, const float *kept, int64_t i)
{
    const int64_t row = p->in.kept_rows ? p->in.kept_rows[i] : i;
    return (float *)kept + (size_t)row * (size_t)p->in.lin->vocab;
}

/* A tile's rows i0 .. i0 + nb - 1, columns v0 .. v0 + vb - 1: into the kept logits (to_kept), or from them. */
static void exchange_kept(const fh_pass *p, const float *kept, float *tile, int64_t i0, int64_t nb, int64_t v0,
                          int64_t vb, int to_kept)
{
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
    for (int64_t r = 0; r < nb; r++) {
        float *const at = kept_row(p, kept, i0 + r) + v0;
        memcpy(to_kept ? at : tile + r * vb, to_kept ? tile + r * vb : at, (size_t)vb * sizeof(float));
    }
}

/* Before the first tile: every row's running statistics at their start (a pair's head sets its own). */
static void begin_statistics(const fh_pass *p)
{
    const fh_token_stats *stats = p->in.stats;
    const fh_fold_state initial = fh_fold_state_initial();
    if (p->in.pair)
        return;
    for (int64_t i = 0; i < p->in.lin->n; i++) {
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
static void finish_statistics(const fh_pass *p, int pass)
{
    const fh_token_stats *stats = p->in.stats;
    const int64_t n = p->in.lin->n;
    if (p->in.pair) {
#pragma omp parallel for num_threads(p->in.plan->threads) schedule(static)
        for (int64_t i = 0; i < n; i++)
            p->in.pair->finish(p->in.pair->self, pass, i);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const double running_max = stats->lse[i];
        stats->lse[i] = running_max + log(stats->sum_exp[i]);
        if (stats->sum_pz)
            stats->sum_pz[i] /= stats->sum_exp[i];
    }
}

static fh_status forward(const fh_pass *p)
{
    const fh_status prepared = fh_pass_prepare(p);
    if (prepared != FH_OK)
        return prepared;
    const int64_t n = p->in.lin->n, vocab = p->in.lin->vocab;
    const int passes = p->in.pair ? p->in.pair->passes : 1;
    begin_statistics(p);
    for (int pass = 0; pass < passes; pass++) {
        for (int64_t v0 = 0; v0 < vocab; v0 += p->in.plan->tile_vocab) {
            const int64_t vb = min64(p->in.plan->tile_vocab, vocab - v0);
            for (int64_t i0 = 0; i0 < n; i0 += p->in.plan->tile_rows) {
                const int64_t nb = min64(p->in.plan->tile_rows, n - i0);
                const fh_status gemm = fh_pass_logits(p, 0, p->ws.tile, i0, nb, v0, vb);
                if (gemm != FH_OK)
                    return gemm;
                if (p->in.keep && pass == 0)
                    exchange_kept(p, p->in.keep, p->ws.tile, i0, nb, v0, vb, 1);
                fold_tile(p, pass, p->ws.tile, i0, nb, v0, vb);
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

static fh_status backward(const fh_pass *p)
{
    const fh_status prepared = fh_pass_prepare(p);
    if (prepared != FH_OK)
        return prepared;
    const fh_linear *lin = p->in.lin;
    const fh_linear_grads *grads = p->in.grads;
    const int64_t n = lin->n, vocab = lin->vocab;
    const int threads = p->in.plan->threads;
    double *column = p->ws.column;
    if (p->filter)
        fh_filter_begin(p);
    for (int64_t v0 = 0; v0 < vocab; v0 += p->in.plan->tile_vocab) {
        const int64_t vb = min64(p->in.plan->tile_vocab, vocab - v0);
        const float *weights = p->in.class_weights ? p->in.class_weights + v0 : NULL;
        const float *bias = lin->bias ? lin->bias + v0 : NULL;
        if (grads->dbias)
            for (int64_t j = 0; j < vb; j++)
                column[j] = 0.0;
        if (p->in.plan->fp32_du)
            copy_weight_columns(p, v0, vb);
        for (int64_t i0 = 0; i0 < n; i0 += p->in.plan->tile_rows) {
            const int64_t nb = min64(p->in.plan->tile_rows, n - i0);
            float *tile = p->ws.tile;
            fh_status st = FH_OK;
            if (p->in.kept)
                exchange_kept(p, p->in.kept, tile, i0, nb, v0, vb, 0);
            else
                st = fh_pass_logits(p, 0, tile, i0, nb, v0, vb);
            if (st != FH_OK)
                return st;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t r = 0; r < nb; r++) {
                const int64_t i = i0 + r;
                float *row = tile + r * vb;
                if (p->in.pair) {
                    fh_pair_rows(p, row, v0, vb);
                    p->in.pair->gradient(p->in.pair->self, i, row, fh_companion_row(p, row), vb, v0);
                } else {
                    const fh_coef k = coef_of(p->in.coefs, i);
                    const int64_t t = target_column(p->in.targets, i, vocab, v0);
                    fh_row_transform(row, vb, bias, &p->in.tf);
                    fh_pass_row_gradient(p, row, r, 0, vb, t, weights, &k);
                }
                fh_round_du_row(p, row, r, i0, r, vb);
            }
            if (grads->dbias)
                fh_add_column_sums(tile, nb, vb, column, threads);
            st = fh_pass_gradients(p, 0, 0, i0, nb, v0, vb, i0 > 0);
            if (st != FH_OK)
                return st;
        }
        if (p->filter)
            fh_filter_tile_end(p, v0, vb);
        if (grads->dweight && p->sinks.dweight == FH_DWEIGHT_ACCUMULATOR)
            fh_round_dweight_accumulator(p, v0, vb);
        if (grads->dbias)
            fh_write_bias_gradient(grads, column, v0, vb);
    }
    if (grads->dx && p->sinks.dx == FH_DX_ACCUMULATOR)
        finish_dx(p);
    return FH_OK;
}

/* Element `offset` of fp32 or bf16 storage, widened to double. */
static double element(const void *base, fh_dtype dtype, int64_t offset)
{
    return dtype == FH_DTYPE_BF16 ? (double)fh_bf16_to_f32(((const uint16_t *)base)[offset])
                                  : (double)((const float *)base)[offset];
}

void fh_engine_target_logits(const fh_engine_pass *p, double *z_target)
{
    const fh_linear *lin = p->lin;
#pragma omp parallel for num_threads(p->plan->threads) schedule(static)
    for (int64_t i = 0; i < lin->n; i++) {
        const int64_t y = target_column(p->targets, i, lin->vocab, 0);
        double u = 0.0;
        for (int64_t k = 0; y >= 0 && k < lin->hidden; k++)
            u += element(lin->x, lin->x_dtype, i * lin->x_row_stride + k) *
                 element(lin->weight, lin->weight_dtype, k * lin->w_stride_hidden + y * lin->w_stride_vocab);
        float z = (float)u;
        if (y >= 0)
            fh_row_transform(&z, 1, lin->bias ? lin->bias + y : NULL, &p->tf);
        z_target[i] = y >= 0 ? z : 0.0;
    }
}

fh_status fh_engine_forward(const fh_engine_pass *in)
{
    fh_pass p;
    fh_pass_begin(&p, in);
    return forward(&p);
}

fh_status fh_engine_backward(const fh_engine_pass *in)
{
    fh_pass p;
    fh_pass_begin(&p, in);
    return backward(&p);
}
