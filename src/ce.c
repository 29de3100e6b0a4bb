/* Cross-entropy head: option checks, per-token statistics -> loss, and loss -> backward coefficients.
 * Never touches tiles or BLIS; the engine does. */
#include "blis_kernels.h"
#include "engine.h"
#include "linear.h"

#include <math.h>

FH_API fh_status fh_ce_options_init(fh_ce_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_ce_options defaults = {-100, FH_REDUCTION_MEAN, 0.0, NULL, 0.0, 0.0};
    *options = defaults;
    return FH_OK;
}

static fh_status check_options(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                               const fh_ce_options *o)
{
    if (!targets || !o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !targets ? "targets" : "options");
    if (o->reduction != FH_REDUCTION_MEAN && o->reduction != FH_REDUCTION_SUM && o->reduction != FH_REDUCTION_NONE)
        return fh_fail(ctx, FH_ERR_INVALID_REDUCTION, "reduction = %d is not mean (0), sum (1) or none (2)",
                       (int)o->reduction);
    if (!(o->label_smoothing >= 0.0 && o->label_smoothing <= 1.0))
        return fh_fail(ctx, FH_ERR_INVALID_LABEL_SMOOTHING, "label_smoothing = %g is outside [0, 1]",
                       o->label_smoothing);
    if (!(o->softcap >= 0.0 && isfinite(o->softcap)))
        return fh_fail(ctx, FH_ERR_INVALID_SOFTCAP, "softcap = %g must be finite and >= 0 (0 disables)",
                       o->softcap);
    if (!(o->z_loss >= 0.0 && isfinite(o->z_loss)))
        return fh_fail(ctx, FH_ERR_INVALID_Z_LOSS, "z_loss = %g must be finite and >= 0 (0 disables)", o->z_loss);
    if (o->class_weights)
        for (int64_t j = 0; j < lin->vocab; j++)
            if (!(o->class_weights[j] >= 0.0f && isfinite(o->class_weights[j])))
                return fh_fail(ctx, FH_ERR_INVALID_CLASS_WEIGHT, "class_weights[%lld] = %g must be finite and >= 0",
                               (long long)j, (double)o->class_weights[j]);
    for (int64_t i = 0; i < lin->n; i++)
        if (targets[i] != o->ignore_index && (targets[i] < 0 || targets[i] >= lin->vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                           "targets[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld)", (long long)i,
                           (long long)targets[i], (long long)lin->vocab, (long long)o->ignore_index);
    return FH_OK;
}

static fh_status check_call(fh_context *ctx, const fh_linear *lin, const int64_t *targets, const fh_ce_options *o)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    fh_status st = fh_check_linear(ctx, lin);
    if (st == FH_OK)
        st = check_options(ctx, lin, targets, o);
    return st;
}

static fh_transform transform_of(const fh_ce_options *o)
{
    const fh_transform tf = {(float)o->softcap, 1.0f};
    return tf;
}

/* Denominators of the mean: sum of the targets' class weights (cross-entropy part) and the count of
 * non-ignored tokens (z-loss part), both over non-ignored tokens. */
typedef struct ce_norms {
    double weight_sum; /* sum_i w_{y_i} */
    double count;
    double class_weight_total; /* sum_j w_j (V without class weights), for label smoothing */
} ce_norms;

static ce_norms norms_of(const fh_linear *lin, const int64_t *targets, const fh_ce_options *o)
{
    ce_norms nm = {0.0, 0.0, 0.0};
    for (int64_t i = 0; i < lin->n; i++)
        if (targets[i] != o->ignore_index) {
            nm.count += 1.0;
            nm.weight_sum += o->class_weights ? o->class_weights[targets[i]] : 1.0;
        }
    if (o->class_weights)
        for (int64_t j = 0; j < lin->vocab; j++)
            nm.class_weight_total += o->class_weights[j];
    else
        nm.class_weight_total = (double)lin->vocab;
    return nm;
}

/* A mean over an empty set (every token ignored, or every target weighted 0) is defined as 0 with
 * zero gradients, never NaN (torch returns NaN there). */
static double safe_inverse(double x)
{
    return x > 0.0 ? 1.0 / x : 0.0;
}

static fh_status prepare(fh_context *ctx, const fh_linear *lin, fh_plan *plan, fh_workspace *ws)
{
    fh_status st = fh_plan_make(ctx, lin->n, lin->vocab, plan);
    void *base = NULL;
    if (st == FH_OK)
        st = fh_acquire_workspace(ctx, plan->bytes, &base);
    if (st == FH_OK) {
        *ws = fh_workspace_carve(plan, base, lin->n);
        fh_blis_ensure_selected();
    }
    return st;
}

FH_API fh_status fh_ce_workspace_size(const fh_context *ctx, const fh_linear *lin, const fh_ce_options *options,
                                      size_t *bytes)
{
    if (!ctx || !bytes || !options)
        return FH_ERR_NULL_POINTER;
    fh_context scratch = *ctx; /* the query is pure: messages go to a copy */
    fh_status st = fh_check_linear(&scratch, lin);
    fh_plan plan;
    if (st == FH_OK)
        st = fh_plan_make(&scratch, lin->n, lin->vocab, &plan);
    if (st == FH_OK)
        *bytes = plan.bytes;
    return st;
}

FH_API fh_status fh_ce_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                               const fh_ce_options *options, fh_ce_outputs *out)
{
    fh_status st = check_call(ctx, lin, targets, options);
    if (st != FH_OK)
        return st;
    if (!out)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (options->reduction == FH_REDUCTION_NONE && !out->per_token_loss)
        return fh_fail(ctx, FH_ERR_MISSING_OUTPUT, "reduction 'none' needs per_token_loss");
    fh_plan plan;
    fh_workspace ws;
    if ((st = prepare(ctx, lin, &plan, &ws)) != FH_OK)
        return st;

    const double eps = options->label_smoothing;
    const fh_row_stats stats = {ws.token[0], ws.token[1], eps > 0.0 ? ws.token[2] : NULL, ws.token[3],
                                out->argmax ? (int64_t *)ws.token[4] : NULL};
    const fh_transform tf = transform_of(options);
    fh_engine_forward(ctx, &plan, &ws, lin, &tf, targets, options->class_weights, &stats);

    const ce_norms nm = norms_of(lin, targets, options);
    const double vocab = (double)lin->vocab;
    double ce_total = 0.0, z_total = 0.0;
    for (int64_t i = 0; i < lin->n; i++) {
        const double lse = stats.lse[i];
        double ce = 0.0, zl = 0.0, logp = 0.0;
        if (targets[i] != options->ignore_index) {
            const double w_y = options->class_weights ? options->class_weights[targets[i]] : 1.0;
            logp = stats.z_target[i] - lse;
            ce = -(1.0 - eps) * w_y * logp;
            if (eps > 0.0)
                ce += eps / vocab * (nm.class_weight_total * lse - stats.sum_weighted_z[i]);
            zl = options->z_loss * lse * lse;
        }
        ce_total += ce;
        z_total += zl;
        if (out->per_token_loss)
            out->per_token_loss[i] = (float)(ce + zl);
        if (out->per_token_logp)
            out->per_token_logp[i] = (float)logp;
        if (out->lse)
            out->lse[i] = (float)lse;
        if (out->argmax)
            out->argmax[i] = stats.argmax[i];
    }
    if (options->reduction == FH_REDUCTION_MEAN) {
        ce_total *= safe_inverse(nm.weight_sum);
        z_total *= safe_inverse(nm.count);
    }
    if (out->loss)
        *out->loss = ce_total + z_total;
    if (out->z_loss)
        *out->z_loss = z_total;
    return FH_OK;
}

FH_API fh_status fh_ce_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                const fh_ce_options *options, const float *lse, const float *grad_output,
                                fh_linear_grads *grads)
{
    fh_status st = check_call(ctx, lin, targets, options);
    if (st != FH_OK)
        return st;
    if (!lse || !grad_output)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lse ? "lse" : "grad_output");
    if ((st = fh_check_grads(ctx, lin, grads)) != FH_OK)
        return st;
    const int64_t grad_count = options->reduction == FH_REDUCTION_NONE ? lin->n : 1;
    for (int64_t i = 0; i < grad_count; i++)
        if (!isfinite(grad_output[i]))
            return fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output[%lld] = %g is not finite", (long long)i,
                           (double)grad_output[i]);
    fh_plan plan;
    fh_workspace ws;
    if ((st = prepare(ctx, lin, &plan, &ws)) != FH_OK)
        return st;

    const ce_norms nm = norms_of(lin, targets, options);
    const double eps = options->label_smoothing, vocab = (double)lin->vocab;
    const double ce_scale = options->reduction == FH_REDUCTION_MEAN ? safe_inverse(nm.weight_sum) : 1.0;
    const double z_scale = options->reduction == FH_REDUCTION_MEAN ? safe_inverse(nm.count) : 1.0;
    double *lse_d = ws.token[0], *a = ws.token[1], *b = ws.token[2], *c = ws.token[3];
    for (int64_t i = 0; i < lin->n; i++) {
        lse_d[i] = lse[i];
        a[i] = b[i] = c[i] = 0.0;
        if (targets[i] == options->ignore_index)
            continue;
        const double g = grad_output[grad_count == 1 ? 0 : i];
        const double g_ce = g * ce_scale, g_z = g * z_scale;
        const double w_y = options->class_weights ? options->class_weights[targets[i]] : 1.0;
        /* d ce / d z_j = (1-eps) w_y (p_j - [j=y]) + eps/V (W p_j - w_j);  d zl / d z_j = 2 s lse p_j */
        a[i] = g_ce * ((1.0 - eps) * w_y + eps * nm.class_weight_total / vocab) + g_z * 2.0 * options->z_loss * lse_d[i];
        b[i] = -g_ce * (1.0 - eps) * w_y;
        c[i] = -g_ce * eps / vocab;
    }
    const fh_row_coefs coefs = {lse_d, a, b, c};
    const fh_transform tf = transform_of(options);
    fh_engine_backward(ctx, &plan, &ws, lin, &tf, targets, eps > 0.0 ? options->class_weights : NULL, &coefs,
                       grads);
    return FH_OK;
}
