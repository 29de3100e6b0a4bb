/* Context: parameters, workspace ownership, last error message. */
#include "context.h"

#include "cpus.h"

#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define FH_WORKSPACE_ALIGN 64

/* Every parameter's name (for messages, as Python spells it), kind and inclusive bounds: one table, so that the
 * integer and the real entry points agree on which parameter is which kind. 0, the default, is inside each. */
static const struct param_spec {
    const char *name;
    int real;              /* set with fh_context_set_real */
    int64_t min, max;      /* integer parameters */
    double real_min, real_max;
} param_specs[FH_PARAM_COUNT] = {
    [FH_PARAM_THREADS] = {"threads", 0, 0, 1024, 0, 0},
    [FH_PARAM_TILE_ROWS] = {"tile_rows", 0, 0, (int64_t)1 << 24, 0, 0},
    [FH_PARAM_TILE_VOCAB] = {"tile_vocab", 0, 0, (int64_t)1 << 30, 0, 0},
    [FH_PARAM_MEMORY_BUDGET] = {"memory_budget", 0, 0, (int64_t)1 << 50, 0, 0},
    [FH_PARAM_CHECK_FINITE] = {"check_finite", 0, 0, 1, 0, 0},
    [FH_PARAM_FP32_DU] = {"fp32_du", 0, 0, 1, 0, 0},
    [FH_PARAM_OVERSUBSCRIBE] = {"oversubscribe", 0, 0, 1, 0, 0},
    [FH_PARAM_GRAD_FILTER_TAIL] = {"grad_filter_tail", 0, FH_FILTER_TAIL_ESTIMATE, FH_FILTER_TAIL_DROP, 0, 0},
    /* [0, 1) as inclusive bounds: the largest double below 1 is the max. */
    [FH_PARAM_GRAD_FILTER_EPS] = {"grad_filter_eps", 1, 0, 0, 0.0, 0x1.fffffffffffffp-1},
    [FH_PARAM_BATCH_INVARIANT] = {"batch_invariant", 0, 0, 1, 0, 0},
};

/* NULL for an unknown parameter or one of the other kind. */
static const struct param_spec *spec_of(fh_param param, int real)
{
    if ((unsigned)param >= FH_PARAM_COUNT || param_specs[param].real != real)
        return NULL;
    return &param_specs[param];
}

/* Why spec_of refused param, on ctx's message. */
static fh_status refuse_param(fh_context *ctx, fh_param param, int real)
{
    if ((unsigned)param >= FH_PARAM_COUNT)
        return fh_fail(ctx, FH_ERR_INVALID_PARAM, "unknown parameter %d", (int)param);
    return fh_fail(ctx, FH_ERR_INVALID_PARAM, "parameter %d (%s) is %s-valued: use %s", (int)param,
                   param_specs[param].name, real ? "integer" : "real",
                   real ? "fh_context_set/fh_context_get" : "fh_context_set_real/fh_context_get_real");
}

fh_status fh_fail(fh_context *ctx, fh_status status, const char *format, ...)
{
    if (ctx) {
        va_list args;
        va_start(args, format);
        vsnprintf(ctx->message, sizeof ctx->message, format, args);
        va_end(args);
    }
    return status;
}

void fh_clear_message(fh_context *ctx)
{
    if (ctx)
        ctx->message[0] = '\0';
}

/* Below about 2^24 multiply-adds (~0.1 ms on one core) a second thread costs more than it saves. */
#define FH_SMALL_PROBLEM_MACS 16777216.0

static int threads_of_large_calls(const fh_context *ctx)
{
    const int64_t t = ctx->params[FH_PARAM_THREADS];
    const int requested = t > 0 ? (int)t : omp_get_max_threads();
    const int cpus = fh_cpus_available();
    return requested > cpus && !ctx->params[FH_PARAM_OVERSUBSCRIBE] ? cpus : requested;
}

int fh_threads(const fh_context *ctx, const fh_linear *lin)
{
    const double macs = (double)lin->n * (double)lin->hidden * (double)lin->vocab;
    if (ctx->params[FH_PARAM_THREADS] == 0 && macs < FH_SMALL_PROBLEM_MACS)
        return 1;
    return threads_of_large_calls(ctx);
}

FH_API fh_status fh_context_threads(const fh_context *ctx, int *threads)
{
    if (!ctx || !threads)
        return FH_ERR_NULL_POINTER;
    *threads = threads_of_large_calls(ctx);
    return FH_OK;
}

int64_t fh_budget_bytes(const fh_context *ctx)
{
    const int64_t b = ctx->params[FH_PARAM_MEMORY_BUDGET];
    return (b > 0 ? b : FH_DEFAULT_MEMORY_BUDGET) - (int64_t)ctx->budget_held;
}

/* The context's own workspace goes (contents are dead between calls). */
static void drop_workspace(fh_context *ctx)
{
    free(ctx->workspace);
    ctx->workspace = NULL;
    ctx->workspace_bytes = 0;
}

void fh_budget_hold(fh_context *ctx, size_t bytes)
{
    ctx->budget_held += bytes;
    if (!ctx->workspace_is_callers && (int64_t)ctx->workspace_bytes > fh_budget_bytes(ctx))
        drop_workspace(ctx);
}

void fh_budget_release(fh_context *ctx, size_t bytes)
{
    ctx->budget_held -= bytes;
}

/* Why this thread's last fh_context_create failed: there is no context to hold it. */
static _Thread_local char creation_message[FH_MESSAGE_CAPACITY + 32];

FH_API fh_status fh_context_create(fh_context **ctx)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_context *c = calloc(1, sizeof *c);
    if (!c)
        return FH_ERR_OUT_OF_MEMORY;
    creation_message[0] = '\0';
    if (getenv("FH_WISDOM")) {
        const fh_status st = fh_context_load_wisdom(c, NULL);
        if (st != FH_OK) {
            snprintf(creation_message, sizeof creation_message, "fh_context_create: %s", c->message);
            free(c);
            return st;
        }
    }
    *ctx = c;
    return FH_OK;
}

FH_API fh_status fh_context_destroy(fh_context *ctx)
{
    if (ctx) {
        if (!ctx->workspace_is_callers)
            free(ctx->workspace);
        if (ctx->gemm_cache)
            ctx->gemm_cache_destroy(ctx->gemm_cache);
        free(ctx);
    }
    return FH_OK;
}

FH_API fh_status fh_param_bounds(fh_param param, int64_t *min_value, int64_t *max_value)
{
    if (!min_value || !max_value)
        return FH_ERR_NULL_POINTER;
    const struct param_spec *spec = spec_of(param, 0);
    if (!spec)
        return FH_ERR_INVALID_PARAM;
    *min_value = spec->min;
    *max_value = spec->max;
    return FH_OK;
}

FH_API fh_status fh_param_real_bounds(fh_param param, double *min_value, double *max_value)
{
    if (!min_value || !max_value)
        return FH_ERR_NULL_POINTER;
    const struct param_spec *spec = spec_of(param, 1);
    if (!spec)
        return FH_ERR_INVALID_PARAM;
    *min_value = spec->real_min;
    *max_value = spec->real_max;
    return FH_OK;
}

FH_API fh_status fh_context_set(fh_context *ctx, fh_param param, int64_t value)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    const struct param_spec *spec = spec_of(param, 0);
    if (!spec)
        return refuse_param(ctx, param, 0);
    if (value < spec->min || value > spec->max)
        return fh_fail(ctx, FH_ERR_INVALID_PARAM_VALUE, "parameter %d (%s): %lld is outside [%lld, %lld]", (int)param,
                       spec->name, (long long)value, (long long)spec->min, (long long)spec->max);
    /* The filter tail keeps its typed field, which the plan reads. */
    if (param == FH_PARAM_GRAD_FILTER_TAIL)
        ctx->grad_filter_tail = (fh_filter_tail)value;
    else
        ctx->params[param] = value;
    return FH_OK;
}

FH_API fh_status fh_context_get(const fh_context *ctx, fh_param param, int64_t *value)
{
    if (!ctx || !value)
        return FH_ERR_NULL_POINTER;
    if (!spec_of(param, 0))
        return FH_ERR_INVALID_PARAM;
    *value = param == FH_PARAM_GRAD_FILTER_TAIL ? (int64_t)ctx->grad_filter_tail : ctx->params[param];
    return FH_OK;
}

FH_API fh_status fh_context_set_real(fh_context *ctx, fh_param param, double value)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    const struct param_spec *spec = spec_of(param, 1);
    if (!spec)
        return refuse_param(ctx, param, 1);
    /* Written so that NaN fails the test too. */
    if (!(value >= spec->real_min && value <= spec->real_max))
        return fh_fail(ctx, FH_ERR_INVALID_PARAM_VALUE, "parameter %d (%s): %g is outside [%g, %.17g]", (int)param,
                       spec->name, value, spec->real_min, spec->real_max);
    ctx->grad_filter_eps = value; /* the only real parameter */
    return FH_OK;
}

FH_API fh_status fh_context_get_real(const fh_context *ctx, fh_param param, double *value)
{
    if (!ctx || !value)
        return FH_ERR_NULL_POINTER;
    if (!spec_of(param, 1))
        return FH_ERR_INVALID_PARAM;
    *value = ctx->grad_filter_eps;
    return FH_OK;
}

FH_API fh_status fh_context_filter_stats(const fh_context *ctx, fh_filter_stats *stats)
{
    if (!ctx || !stats)
        return FH_ERR_NULL_POINTER;
    *stats = ctx->filter_stats;
    return FH_OK;
}

FH_API fh_status fh_context_message(const fh_context *ctx, const char **message)
{
    if (!message)
        return FH_ERR_NULL_POINTER;
    *message = ctx ? ctx->message : creation_message;
    return FH_OK;
}

FH_API fh_status fh_context_set_workspace(fh_context *ctx, void *workspace, size_t bytes)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    if (!workspace && bytes > 0)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "workspace is NULL but bytes = %zu", bytes);
    if (!ctx->workspace_is_callers)
        free(ctx->workspace);
    ctx->workspace = workspace;
    ctx->workspace_bytes = workspace ? bytes : 0;
    ctx->workspace_is_callers = workspace != NULL;
    return FH_OK;
}

fh_status fh_acquire_workspace(fh_context *ctx, size_t bytes, void **workspace)
{
    if (ctx->workspace_is_callers) {
        if (ctx->workspace_bytes < bytes)
            return fh_fail(ctx, FH_ERR_WORKSPACE_TOO_SMALL,
                           "the caller's workspace has %zu bytes; this call needs %zu",
                           ctx->workspace_bytes, bytes);
        *workspace = ctx->workspace;
        return FH_OK;
    }
    if (ctx->workspace_bytes < bytes) {
        const size_t rounded = (bytes + FH_WORKSPACE_ALIGN - 1) / FH_WORKSPACE_ALIGN * FH_WORKSPACE_ALIGN;
        /* A failed growth keeps the old workspace, unless the two together would pass the budget: then the old one
         * (its contents dead between calls) goes first. */
        if ((int64_t)(ctx->workspace_bytes + rounded) > fh_budget_bytes(ctx))
            drop_workspace(ctx);
        void *fresh = aligned_alloc(FH_WORKSPACE_ALIGN, rounded);
        if (!fresh)
            return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate %zu bytes of workspace", bytes);
        free(ctx->workspace);
        ctx->workspace = fresh;
        ctx->workspace_bytes = rounded;
    }
    *workspace = ctx->workspace;
    return FH_OK;
}
