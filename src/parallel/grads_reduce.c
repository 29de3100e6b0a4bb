/* Gradient reductions: dx over the vocab group, dweight and dbias over the data group, each
 * all-reduced or reduce-scattered (fh_parallel_reduction). */
#include "parallel_internal.h"

#include "core/context.h"
#include "core/linear.h"
#include "kernels/row_kernels.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* A hidden x vocab view with these strides covers a dense block of exactly hidden * vocab floats. */
static int dense(int64_t hidden, int64_t vocab, int64_t sh, int64_t sv)
{
    return (sv == 1 && (sh == vocab || hidden == 1)) || (sh == 1 && (sv == hidden || vocab == 1));
}

static void pack_view(const fh_linear_grads *u, const fhp_grads *g, float *packed)
{
    const float *dweight = u->dweight;
    for (int64_t k = 0; k < g->hidden; k++)
        for (int64_t j = 0; j < g->vocab; j++)
            packed[k * g->vocab + j] = dweight[k * g->w_stride_hidden + j * g->w_stride_vocab];
}

void fhp_grads_free(fhp_grads *g)
{
    free(g->dx_tmp);
    free(g->dx_recv);
    free(g->dw_saved);
    free(g->dw_pack);
    free(g->db_saved);
    g->dx_tmp = g->dx_recv = g->dw_saved = g->dw_pack = g->db_saved = NULL;
    for (int k = 0; k < 3; k++) {
        free(g->stage[k]);
        g->stage[k] = NULL;
    }
}

static float *allocate(fh_context *ctx, int64_t count, fh_status *st)
{
    if (*st != FH_OK)
        return NULL;
    float *p = malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
    if (!p)
        *st = fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate %lld floats for a gradient reduction",
                      (long long)count);
    return p;
}

/* Points g->user's bf16 gradients that a reduction sums at fp32 staging buffers (beta 0). FH_OK or
 * FH_ERR_OUT_OF_MEMORY (reported). */
static fh_status stage_bf16(fh_context *ctx, const fh_linear *lin, fhp_grads *g)
{
    fh_linear_grads *u = &g->user;
    fh_status st = FH_OK;
    g->target = *u;
    if (u->dx && u->dx_dtype == FH_DTYPE_BF16 && g->dx_mode != FH_PARALLEL_NO_REDUCTION) {
        u->dx = g->stage[0] = allocate(ctx, g->dx_rows * lin->hidden, &st);
        u->dx_row_stride = lin->hidden;
        u->dx_beta = 0.0f;
        u->dx_dtype = FH_DTYPE_F32;
    }
    if (u->dweight && u->dweight_dtype == FH_DTYPE_BF16 && g->dw_mode != FH_PARALLEL_NO_REDUCTION) {
        const int64_t extent = (lin->hidden - 1) * lin->w_stride_hidden + (lin->vocab - 1) * lin->w_stride_vocab + 1;
        u->dweight = g->stage[1] = allocate(ctx, extent, &st);
        u->dweight_beta = 0.0f;
        u->dweight_dtype = FH_DTYPE_F32;
    }
    if (u->dbias && u->dbias_dtype == FH_DTYPE_BF16 && g->dw_mode != FH_PARALLEL_NO_REDUCTION) {
        u->dbias = g->stage[2] = allocate(ctx, lin->vocab, &st);
        u->dbias_beta = 0.0f;
        u->dbias_dtype = FH_DTYPE_F32;
    }
    return st;
}

/* The staged sums rounded into the caller's bf16 gradients: dx's rows, dweight's elements (the reduce-scattered
 * part only), dbias. */
static void unstage_bf16(const fhp_grads *g)
{
    const fh_linear_grads *t = &g->target;
    for (int64_t i = 0; g->stage[0] && i < g->dx_rows; i++)
        fh_row_add_to_bf16(g->stage[0] + i * g->hidden, g->hidden, t->dx_beta != 0.0f,
                           (uint16_t *)t->dx + i * t->dx_row_stride);
    if (g->stage[1] && g->dw_mode == FH_PARALLEL_REDUCE_SCATTER)
        fh_row_add_to_bf16(g->stage[1] + g->dw_first, g->dw_count, t->dweight_beta != 0.0f,
                           (uint16_t *)t->dweight + g->dw_first);
    else if (g->stage[1])
        for (int64_t k = 0; k < g->hidden; k++)
            for (int64_t j = 0; j < g->vocab; j++) {
                const int64_t at = k * g->w_stride_hidden + j * g->w_stride_vocab;
                fh_row_add_to_bf16(g->stage[1] + at, 1, t->dweight_beta != 0.0f, (uint16_t *)t->dweight + at);
            }
    if (g->stage[2])
        fh_row_add_to_bf16(g->stage[2], g->vocab, t->dbias_beta != 0.0f, t->dbias);
}

fh_status fhp_grads_begin(const fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                          const fh_linear_grads *given, fhp_grads *g)
{
    memset(g, 0, sizeof *g);
    if (!given)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_linear_grads description is NULL");
    g->user = *given;
    const fh_linear_grads *user = &g->user;
    g->n = lin->n;
    g->hidden = lin->hidden;
    g->vocab = lin->vocab;
    g->w_stride_hidden = lin->w_stride_hidden;
    g->w_stride_vocab = lin->w_stride_vocab;
    /* A gradient not asked for is not reduced (every rank leaves it out: the agreement step checks that). */
    g->dx_mode = L->vocab_ranks > 1 && user->dx ? L->params[FH_PARALLEL_PARAM_DX_REDUCTION] : FH_PARALLEL_NO_REDUCTION;
    g->dw_mode = L->data_ranks > 1 && (user->dweight || user->dbias) ? L->params[FH_PARALLEL_PARAM_DWEIGHT_REDUCTION]
                                                                     : FH_PARALLEL_NO_REDUCTION;
    /* The core checks (betas, bias), with dx checked for the rows it will hold. */
    fh_linear_grads without_dx = *user;
    without_dx.dx = NULL;
    fh_status st = fh_check_grads(ctx, lin, &without_dx);
    if (st != FH_OK)
        return st;
    g->dx_first = 0;
    g->dx_rows = lin->n;
    if (user->dx && g->dx_mode == FH_PARALLEL_REDUCE_SCATTER)
        fh_parallel_dx_rows(L, lin->n, &g->dx_first, &g->dx_rows);
    if (user->dx && g->dx_rows > 0) {
        fh_linear rows = *lin;
        rows.n = g->dx_rows;
        const fh_linear_grads only_dx = {.dx = user->dx, .dx_row_stride = user->dx_row_stride,
                                         .dx_beta = user->dx_beta, .dx_dtype = user->dx_dtype};
        st = fh_check_grads(ctx, &rows, &only_dx);
        /* The rows it holds, against x, the weight, the bias and the workspace (the head checked the rest). */
        const fh_buffer dx = fh_view_buffer("dx", user->dx, g->dx_rows, lin->hidden, user->dx_row_stride, 1,
                                            user->dx_dtype);
        if (st == FH_OK)
            st = fh_check_apart(ctx, lin, NULL, &dx, 1, NULL, 0);
        if (st != FH_OK)
            return st;
    }
    st = stage_bf16(ctx, lin, g);
    if (st != FH_OK) {
        fhp_grads_free(g);
        return st;
    }
    g->engine = *user;
    const int64_t nh = lin->n * lin->hidden; /* fh_check_linear checked the product */
    if (user->dx && g->dx_mode == FH_PARALLEL_REDUCE_SCATTER && (g->dx_rows + 1) * lin->hidden >= INT_MAX)
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "dx blocks exceed the collectives' int counts");
    /* dx over the vocab group. */
    if (user->dx && g->dx_mode == FH_PARALLEL_ALLREDUCE &&
        !(user->dx_beta == 0.0f && user->dx_row_stride == lin->hidden)) {
        g->dx_tmp = allocate(ctx, nh, &st);
        g->engine.dx = g->dx_tmp;
    } else if (user->dx && g->dx_mode == FH_PARALLEL_REDUCE_SCATTER) {
        g->dx_tmp = allocate(ctx, nh, &st);
        g->engine.dx = g->dx_tmp;
        if (!(user->dx_beta == 0.0f && user->dx_row_stride == lin->hidden))
            g->dx_recv = allocate(ctx, g->dx_rows * lin->hidden, &st);
    }
    if (g->engine.dx != user->dx) {
        g->engine.dx_row_stride = lin->hidden;
        g->engine.dx_beta = 0.0f;
    }
    /* dweight and dbias over the data group. */
    const int64_t elements = lin->hidden * lin->vocab;
    g->dw_dense = dense(lin->hidden, lin->vocab, lin->w_stride_hidden, lin->w_stride_vocab);
    if (user->dweight && g->dw_mode != FH_PARALLEL_NO_REDUCTION) {
        g->engine.dweight_beta = 0.0f;
        if (g->dw_mode == FH_PARALLEL_REDUCE_SCATTER) {
            if (!g->dw_dense)
                st = fh_fail(ctx, FH_ERR_INVALID_STRIDE,
                             "reduce-scattered dweight needs a dense shard (weight strides %lld, %lld for %lld x %lld)",
                             (long long)lin->w_stride_hidden, (long long)lin->w_stride_vocab, (long long)lin->hidden,
                             (long long)lin->vocab);
            else if (elements >= INT_MAX)
                st = fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "reduce-scattered dweight exceeds the collectives' int counts");
            if (st == FH_OK)
                fh_parallel_dweight_part(L, lin->hidden, &g->dw_first, &g->dw_count);
            if (user->dweight_beta != 0.0f && st == FH_OK) {
                g->dw_saved = allocate(ctx, g->dw_count, &st);
                if (st == FH_OK) /* the part in storage order: the block starts at the pointer */
                    memcpy(g->dw_saved, (const float *)user->dweight + g->dw_first,
                           (size_t)g->dw_count * sizeof(float));
            }
        } else {
            if (!g->dw_dense)
                g->dw_pack = allocate(ctx, elements, &st);
            if (user->dweight_beta != 0.0f) {
                g->dw_saved = allocate(ctx, elements, &st);
                if (st == FH_OK)
                    pack_view(user, g, g->dw_saved);
            }
        }
    }
    if (user->dbias && g->dw_mode != FH_PARALLEL_NO_REDUCTION) {
        g->engine.dbias_beta = 0.0f;
        if (user->dbias_beta != 0.0f) {
            g->db_saved = allocate(ctx, lin->vocab, &st);
            if (st == FH_OK)
                memcpy(g->db_saved, user->dbias, (size_t)lin->vocab * sizeof(float));
        }
    }
    if (st != FH_OK)
        fhp_grads_free(g);
    return st;
}

/* rows x cols into a strided destination: dst = beta dst + src. */
static void write_rows(float *dst, int64_t stride, float beta, const float *src, int64_t rows, int64_t cols)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < cols; k++)
            dst[i * stride + k] = beta != 0.0f ? dst[i * stride + k] + src[i * cols + k] : src[i * cols + k];
}

/* The float sum of buffer[0..count) over the group, in place (nothing to do with one rank). */
static int sum_floats(const fh_collectives *group, float *buffer, int64_t count)
{
    return group->size == 1 ? 0
                            : group->allreduce(group->handle, buffer, count, FH_COLLECTIVE_FLOAT, FH_COLLECTIVE_SUM);
}

/* The reduce-scatter counts of total elements over the group's ranks (fhp_split's blocks of units of `unit`
 * elements), or NULL (out of memory). */
static int64_t *scatter_counts(const fh_collectives *group, int64_t units, int64_t unit)
{
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)group->size);
    for (int r = 0; counts && r < group->size; r++) {
        int64_t first, size;
        fhp_split(units, group->size, r, &first, &size);
        counts[r] = size * unit;
    }
    return counts;
}

static fh_status reduce_dx(fh_parallel_layout *L, fh_context *ctx, fhp_grads *g)
{
    const fh_linear_grads *u = &g->user;
    const int64_t h = g->hidden;
    int err = 0;
    if (g->dx_mode == FH_PARALLEL_ALLREDUCE) {
        err = sum_floats(&L->vocab, g->engine.dx, g->n * h);
        if (err == 0 && g->engine.dx != u->dx)
            write_rows(u->dx, u->dx_row_stride, u->dx_beta, g->dx_tmp, g->n, h);
    } else if (g->dx_mode == FH_PARALLEL_REDUCE_SCATTER) {
        int64_t *counts = scatter_counts(&L->vocab, g->n, h);
        if (!counts)
            return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate reduce-scatter counts");
        float *recv = g->dx_recv ? g->dx_recv : u->dx;
        err = fhp_reduce_scatter(&L->vocab, g->dx_tmp, g->dx_rows > 0 ? recv : g->dx_tmp, counts);
        free(counts);
        if (err == 0 && g->dx_recv)
            write_rows(u->dx, u->dx_row_stride, u->dx_beta, g->dx_recv, g->dx_rows, h);
    }
    return err == 0 ? FH_OK : fhp_group_error(ctx, &L->vocab, err, "the dx reduction");
}

static fh_status reduce_dweight(fh_parallel_layout *L, fh_context *ctx, fhp_grads *g)
{
    const fh_linear_grads *u = &g->user;
    float *const dweight = u->dweight, *const dbias = u->dbias;
    const int64_t elements = g->hidden * g->vocab;
    int err = 0;
    if (dweight && g->dw_mode == FH_PARALLEL_ALLREDUCE) {
        if (g->dw_dense) {
            err = sum_floats(&L->data, dweight, elements);
        } else {
            pack_view(u, g, g->dw_pack);
            err = sum_floats(&L->data, g->dw_pack, elements);
            for (int64_t k = 0; err == 0 && k < g->hidden; k++)
                for (int64_t j = 0; j < g->vocab; j++)
                    dweight[k * g->w_stride_hidden + j * g->w_stride_vocab] = g->dw_pack[k * g->vocab + j];
        }
        if (err == 0 && g->dw_saved)
            for (int64_t k = 0; k < g->hidden; k++)
                for (int64_t j = 0; j < g->vocab; j++)
                    dweight[k * g->w_stride_hidden + j * g->w_stride_vocab] += g->dw_saved[k * g->vocab + j];
    } else if (dweight && g->dw_mode == FH_PARALLEL_REDUCE_SCATTER) {
        int64_t *counts = scatter_counts(&L->data, elements, 1);
        if (!counts)
            return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate reduce-scatter counts");
        /* In place: the part arrives at the start of the block; move it to its own place. */
        err = fhp_reduce_scatter(&L->data, dweight, dweight, counts);
        free(counts);
        if (err == 0 && g->dw_first > 0)
            memmove(dweight + g->dw_first, dweight, (size_t)g->dw_count * sizeof(float));
        if (err == 0 && g->dw_saved)
            for (int64_t t = 0; t < g->dw_count; t++)
                dweight[g->dw_first + t] += g->dw_saved[t];
    }
    if (err == 0 && dbias && g->dw_mode != FH_PARALLEL_NO_REDUCTION) {
        err = sum_floats(&L->data, dbias, g->vocab);
        if (err == 0 && g->db_saved)
            for (int64_t j = 0; j < g->vocab; j++)
                dbias[j] += g->db_saved[j];
    }
    return err == 0 ? FH_OK : fhp_group_error(ctx, &L->data, err, "the dweight reduction");
}

fh_status fhp_grads_finish(fh_parallel_layout *L, fh_context *ctx, fhp_grads *g)
{
    fh_status st = reduce_dx(L, ctx, g);
    const fh_status st2 = reduce_dweight(L, ctx, g);
    if (st == FH_OK && st2 == FH_OK)
        unstage_bf16(g);
    fhp_grads_free(g);
    return st != FH_OK ? st : st2;
}
