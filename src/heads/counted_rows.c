/* The rows that count, compacted (counted_rows.h). */
#include "counted_rows.h"

#include "kernels/row_kernels.h"

#include <stdlib.h>
#include <string.h>

static size_t x_elem(const fh_linear *lin)
{
    return lin->x_dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
}

size_t fh_counted_rows_x_row_bytes(const fh_linear *lin)
{
    return (size_t)lin->hidden * x_elem(lin);
}

fh_linear fh_counted_rows_linear(const fh_counted_rows *c, const fh_linear *lin, void *x)
{
    const size_t row_bytes = fh_counted_rows_x_row_bytes(lin), stride_bytes = (size_t)lin->x_row_stride * x_elem(lin);
    for (int64_t k = 0; k < c->count; k++)
        memcpy((char *)x + (size_t)k * row_bytes, (const char *)lin->x + (size_t)c->rows[k] * stride_bytes, row_bytes);
    fh_linear compacted = *lin;
    compacted.n = c->count;
    compacted.x = x;
    compacted.x_row_stride = lin->hidden;
    return compacted;
}

/* Frees what begin allocated and gives its share of the budget back (safe on an inactive c). */
static void counted_rows_free(fh_context *ctx, fh_counted_rows *c)
{
    free(c->rows);
    free(c->x);
    free(c->dx);
    free(c->scratch);
    fh_budget_release(ctx, c->held);
    memset(c, 0, sizeof *c);
}

/* Compacts lin and grads to the rows whose target is not ignore_index when fh_counted_rows_run's conditions hold,
 * else leaves c inactive; c->scratch holds scratch_row_bytes per counted row. The copies are held against the budget
 * before they are allocated (the kept workspace may go first). FH_ERR_OUT_OF_MEMORY (on ctx) leaves nothing
 * allocated or held. */
static fh_status counted_rows_begin(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                    const int64_t *targets, int64_t ignore_index, int filtered,
                                    size_t scratch_row_bytes, fh_counted_rows *c)
{
    memset(c, 0, sizeof *c);
    c->n = lin->n;
    for (int64_t i = 0; i < lin->n; i++)
        c->count += targets[i] != ignore_index;
    if (c->count == 0 || c->count == lin->n || ctx->workspace_is_callers || (filtered && ctx->grad_filter_eps > 0.0))
        return FH_OK;
    const int64_t h = lin->hidden;
    const size_t row_bytes = fh_counted_rows_x_row_bytes(lin), count = (size_t)c->count;
    size_t dx_row_bytes = 0, per_row, bytes;
    if ((grads && grads->dx && __builtin_mul_overflow((size_t)h, sizeof(float), &dx_row_bytes)) ||
        __builtin_add_overflow(row_bytes, dx_row_bytes, &per_row) ||
        __builtin_add_overflow(per_row, sizeof(int64_t) + scratch_row_bytes, &per_row) ||
        __builtin_mul_overflow(count, per_row, &bytes) || bytes >= (size_t)(fh_budget_bytes(ctx) / 2))
        return FH_OK;
    fh_budget_hold(ctx, bytes + 1);
    c->held = bytes + 1;
    c->rows = malloc(count * sizeof(int64_t));
    c->x = malloc(count * row_bytes);
    c->dx = dx_row_bytes ? malloc(count * dx_row_bytes) : NULL;
    c->scratch = malloc(count * scratch_row_bytes + 1);
    if (!c->rows || !c->x || (dx_row_bytes && !c->dx) || !c->scratch) {
        counted_rows_free(ctx, c);
        return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "cannot allocate the %lld counted rows' hidden states and dx",
                       (long long)count);
    }
    int64_t k = 0;
    for (int64_t i = 0; i < lin->n; i++)
        if (targets[i] != ignore_index)
            c->rows[k++] = i;
    c->lin = fh_counted_rows_linear(c, lin, c->x);
    if (grads) {
        /* An fp32 dx that accumulates starts from its old rows, so that the GEMMs add onto them as they would in
         * place; a bf16 one is summed in f32 from 0 and rounded once with its old value, as the engine does. */
        const int add_onto = grads->dx && grads->dx_dtype == FH_DTYPE_F32 && grads->dx_beta != 0.0f;
        for (k = 0; add_onto && k < c->count; k++)
            memcpy(c->dx + k * h, (const float *)grads->dx + c->rows[k] * grads->dx_row_stride,
                   (size_t)h * sizeof(float));
        c->grads = *grads;
        c->grads.dx = c->dx;
        c->grads.dx_row_stride = h;
        c->grads.dx_beta = add_onto ? 1.0f : 0.0f;
        c->grads.dx_dtype = FH_DTYPE_F32;
    }
    c->active = 1;
    return FH_OK;
}

void fh_counted_rows_gather(const fh_counted_rows *c, const void *all, size_t elem, void *counted)
{
    for (int64_t k = 0; k < c->count; k++)
        memcpy((char *)counted + (size_t)k * elem, (const char *)all + (size_t)c->rows[k] * elem, elem);
}

void fh_counted_rows_scatter(const fh_counted_rows *c, const void *counted, size_t elem, const void *fill, void *all)
{
    for (int64_t i = 0, k = 0; i < c->n; i++) {
        const int counts = k < c->count && c->rows[k] == i;
        memcpy((char *)all + (size_t)i * elem, counts ? (const char *)counted + (size_t)(k++) * elem : fill, elem);
    }
}

/* The compacted call's per-row float arrays, laid out in the scratch after the compacted targets (which this gathers
 * first): counted[k] is NULL where the call's array is, else count floats; the inputs gathered. Returns the compacted
 * targets. */
static int64_t *compacted_arrays(const fh_counted_rows *c, const int64_t *targets, const float *const *in,
                                 int inputs, float *const *out, int outputs, float **counted)
{
    int64_t *const counted_targets = c->scratch;
    float *const base = (float *)(counted_targets + c->count);
    fh_counted_rows_gather(c, targets, sizeof(int64_t), counted_targets);
    for (int k = 0; k < inputs + outputs; k++) {
        const int given = k < inputs ? in[k] != NULL : out[k - inputs] != NULL;
        counted[k] = given ? base + k * c->count : NULL;
        if (given && k < inputs)
            fh_counted_rows_gather(c, in[k], sizeof(float), counted[k]);
    }
    return counted_targets;
}

/* Each output array out[k] (not NULL) from counted[inputs + k], 0 in the rows that do not count. */
static void scatter_outputs(const fh_counted_rows *c, float *const *out, int inputs, int outputs,
                            float *const *counted)
{
    const float zero = 0.0f;
    for (int k = 0; k < outputs; k++)
        if (out[k])
            fh_counted_rows_scatter(c, counted[inputs + k], sizeof(float), &zero, out[k]);
}

/* The compacted call's dx rows into the caller's dx (grads, as given to begin). */
static void write_dx(const fh_counted_rows *c, const fh_linear_grads *grads)
{
    if (!grads || !grads->dx)
        return;
    const int64_t h = c->lin.hidden;
    const int accumulate = grads->dx_beta != 0.0f, bf16 = grads->dx_dtype == FH_DTYPE_BF16;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t i = 0, k = 0; i < c->n; i++) {
        char *row = (char *)grads->dx + (size_t)(i * grads->dx_row_stride) * elem;
        if (k < c->count && c->rows[k] == i) {
            const float *values = c->dx + k++ * h;
            if (bf16)
                fh_row_add_to_bf16(values, h, accumulate, (uint16_t *)row);
            else
                memcpy(row, values, (size_t)h * sizeof(float)); /* the old value is in already */
        } else if (!accumulate) {
            memset(row, 0, (size_t)h * elem); /* +0.0 in fp32 and in bf16 bits */
        }
    }
}

fh_status fh_counted_rows_run(fh_context *ctx, const fh_counted_call *call)
{
    const size_t arrays_row_bytes = sizeof(int64_t) + (size_t)(call->inputs + call->outputs) * sizeof(float);
    fh_counted_rows rows;
    fh_status st = call->targets ? counted_rows_begin(ctx, call->lin, call->grads, call->targets, call->ignore_index,
                                                      call->filtered, arrays_row_bytes + call->extra_row_bytes, &rows)
                                 : FH_OK;
    if (st != FH_OK || !call->targets || !rows.active)
        return st == FH_OK ? call->whole(ctx, call->self) : st;
    float *arrays[FH_COUNTED_ARRAYS];
    const int64_t *targets = compacted_arrays(&rows, call->targets, call->in, call->inputs, call->out, call->outputs,
                                              arrays);
    void *extra = (char *)rows.scratch + (size_t)rows.count * arrays_row_bytes;
    st = call->counted(ctx, call->self, &rows, targets, arrays, extra);
    if (st == FH_OK) {
        scatter_outputs(&rows, call->out, call->inputs, call->outputs, arrays);
        write_dx(&rows, call->grads);
    }
    counted_rows_free(ctx, &rows);
    if (st != FH_ERR_BUDGET_TOO_SMALL)
        return st;
    /* The copies' share of the budget left the compacted call too little (a plan fails before writing anything):
     * the whole problem may fit the whole budget. */
    fh_clear_message(ctx);
    return call->whole(ctx, call->self);
}
