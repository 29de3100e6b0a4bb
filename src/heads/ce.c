/* Cross-entropy head: option checks, per-token statistics -> loss, and loss -> backward coefficients.
 * Never touches tiles or GEMMs; the engine does. */
#include "ce_head.h"

#include "counted_rows.h"
#include "core/linear.h"

#include <math.h>

FH_API fh_status fh_ce_options_init(fh_ce_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_ce_options defaults = {-100, FH_REDUCTION_MEAN, 0.0, NULL, 0.0, 0.0, 1.0, 0};
    *options = defaults;
    return FH_OK;
}

static fh_status check_options(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                               const fh_ce_options *o, int64_t target_vocab)
{
    if (!targets || !o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !targets ? "targets" : "options");
    if (o->reduction != FH_REDUCTION_MEAN && o->reduction != FH_REDUCTION_SUM && o->reduction != FH_REDUCTION_NONE)
        return fh_fail(ctx, FH_ERR_INVALID_REDUCTION, "reduction = %d is not mean (0), sum (1) or none (2)",
                       (int)o->reduction);
    if (!(o->label_smoothing >= 0.0 && o->label_smoothing <= 1.0))
        return fh_fail(ctx, FH_ERR_INVALID_LABEL_SMOOTHING, "label_smoothing = %g is outside [0, 1]",
                       o->label_smoothing);
    /* The cap and the scale are applied in fp32, as the engine's transform (fh_ce_pass): each must be a normal float,
     * or it would silently become inf (NaN logits) or 0 (no cap). */
    fh_transform tf;
    const fh_status st = fh_engine_transform(ctx, 1.0, o->softcap, o->logit_scale, &tf);
    if (st != FH_OK)
        return st;
    if (!(o->z_loss >= 0.0 && isfinite(o->z_loss)))
        return fh_fail(ctx, FH_ERR_INVALID_Z_LOSS, "z_loss = %g must be finite and >= 0 (0 disables)", o->z_loss);
    if (target_vocab <= 0)
        target_vocab = lin->vocab;
    if (o->class_weights)
        for (int64_t j = 0; j < lin->vocab; j++)
            if (!(o->class_weights[j] >= 0.0f && isfinite(o->class_weights[j])))
                return fh_fail(ctx, FH_ERR_INVALID_CLASS_WEIGHT, "class_weights[%lld] = %g must be finite and >= 0",
                               (long long)j, (double)o->class_weights[j]);
    return fh_check_targets(ctx, targets, lin->n, o->ignore_index, target_vocab);
}

fh_status fh_ce_check_call(fh_context *ctx, const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                           int64_t target_vocab)
{
    const fh_status st = fh_check_call(ctx, lin);
    return st == FH_OK ? check_options(ctx, lin, targets, o, target_vocab) : st;
}

fh_engine_pass fh_ce_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *targets,
                          const fh_ce_options *o)
{
    const fh_engine_pass p = {.plan = plan,
                              .ws = ws,
                              .lin = lin,
                              .tf = fh_engine_transform_of(1.0, o->softcap, o->logit_scale),
                              .targets = targets,
                              .class_weights = o->label_smoothing > 0.0 ? o->class_weights : NULL};
    return p;
}

static double target_weight(const fh_ce_head *h, int64_t i)
{
    if (h->target_weights)
        return h->target_weights[i];
    return h->o->class_weights ? h->o->class_weights[h->targets[i]] : 1.0;
}

fh_ce_norms fh_ce_local_norms(const fh_ce_head *h)
{
    const fh_linear *lin = h->lin;
    const fh_ce_options *o = h->o;
    fh_ce_norms nm = {0.0, 0.0, 0.0};
    for (int64_t i = 0; i < lin->n; i++)
        if (h->targets[i] != o->ignore_index) {
            nm.count += 1.0;
            nm.weight_sum += target_weight(h, i);
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

static fh_status workspace_query(const fh_context *ctx, const fh_linear *lin, const fh_ce_options *options,
                                 int train_step, const fh_linear_grads *grads, size_t *bytes)
{
    if (!ctx || !bytes || !options)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_bytes(ctx, lin, train_step, grads, bytes);
}

FH_API fh_status fh_ce_workspace_size(const fh_context *ctx, const fh_linear *lin, const fh_ce_options *options,
                                      size_t *bytes)
{
    return workspace_query(ctx, lin, options, 0, NULL, bytes);
}

FH_API fh_status fh_ce_forward_backward_workspace_size(const fh_context *ctx, const fh_linear *lin,
                                                       const fh_ce_options *options, size_t *bytes)
{
    return workspace_query(ctx, lin, options, 1, NULL, bytes);
}

FH_API fh_status fh_ce_forward_backward_workspace_size_with_grads(const fh_context *ctx, const fh_linear *lin,
                                                                  const fh_ce_options *options,
                                                                  const fh_linear_grads *grads, size_t *bytes)
{
    if (!grads)
        return FH_ERR_NULL_POINTER;
    return workspace_query(ctx, lin, options, 1, grads, bytes);
}

fh_ce_head fh_ce_head_of(const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                         const float *grad_output)
{
    fh_ce_head h = {lin, targets, o, {0.0, 0.0, 0.0}, grad_output, o->reduction == FH_REDUCTION_NONE ? lin->n : 1,
                    (double)lin->vocab, NULL};
    h.nm = fh_ce_local_norms(&h);
    return h;
}

/* DFT's factor of a non-ignored token's loss, sg(p_y) = exp(z_y - lse), as Liger-Kernel's use_token_scaling
 * applies it (src/liger_kernel/ops/fused_linear_cross_entropy.py at ead96b61: the whole per-token loss, its
 * label-smoothing and z-loss terms included, and the whole logits-gradient row, by softmax(z)[y] detached) and TRL's
 * SFT loss_type "dft" (trl/trainer/sft_trainer.py dft_loss at f2cd5771: -p.detach() log p); 1 without
 * token_scaling. */
static double token_scale(const fh_ce_options *o, double z_target, double lse)
{
    return o->token_scaling ? exp(z_target - lse) : 1.0;
}

/* d ce_i / d z_j = (1-eps) w_y (p_j - [j=y]) + eps/V (W p_j - w_j),  d zl_i / d z_j = 2 s lse p_j,
 * scaled by the upstream gradient, the mean's denominators and DFT's sg(p_y). */
void fh_ce_row_coefs(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    const fh_ce_head *h = self;
    const fh_ce_options *o = h->o;
    const double lse = stats->lse;
    k->a = k->b = k->c = k->e = 0.0;
    if (h->targets[i] == o->ignore_index)
        return;
    const int mean = o->reduction == FH_REDUCTION_MEAN;
    const double g = h->grad_output[h->grad_count == 1 ? 0 : i] * token_scale(o, stats->z_target, lse);
    const double g_ce = mean ? g * safe_inverse(h->nm.weight_sum) : g;
    const double g_z = mean ? g * safe_inverse(h->nm.count) : g;
    const double eps = o->label_smoothing, vocab = h->vocab, w_y = target_weight(h, i);
    k->a = g_ce * ((1.0 - eps) * w_y + eps * h->nm.class_weight_total / vocab) + g_z * 2.0 * o->z_loss * lse;
    k->b = -g_ce * (1.0 - eps) * w_y;
    k->c = -g_ce * eps / vocab;
}

/* Row i's token outputs from its statistics, its loss terms and its correct prediction added to totals. */
static void token_outputs(const fh_ce_head *h, const fh_token_stats *stats, int64_t i, fh_ce_outputs *out,
                          double totals[FH_CE_TOTALS])
{
    const fh_ce_options *o = h->o;
    const double eps = o->label_smoothing, lse = stats->lse[i];
    const int counted = h->targets[i] != o->ignore_index;
    double ce = 0.0, zl = 0.0, logp = 0.0;
    if (counted) {
        logp = stats->z_target[i] - lse;
        ce = -(1.0 - eps) * target_weight(h, i) * logp;
        if (eps > 0.0)
            ce += eps / h->vocab * (h->nm.class_weight_total * lse - stats->sum_weighted_z[i]);
        zl = o->z_loss * lse * lse;
        const double scale = token_scale(o, stats->z_target[i], lse);
        ce *= scale;
        zl *= scale;
    }
    totals[FH_CE_TOTAL_CE] += ce;
    totals[FH_CE_TOTAL_Z] += zl;
    if (out->per_token_loss)
        out->per_token_loss[i] = (float)(ce + zl);
    if (out->per_token_logp)
        out->per_token_logp[i] = (float)logp;
    if (out->lse)
        out->lse[i] = (float)lse;
    if (out->argmax)
        out->argmax[i] = stats->argmax[i];
    if (out->entropy)
        out->entropy[i] = counted ? (float)(lse - stats->sum_pz[i]) : 0.0f;
    if (out->correct && counted && stats->argmax[i] == h->targets[i])
        totals[FH_CE_TOTAL_CORRECT] += 1.0;
}

static void clear_totals(double totals[FH_CE_TOTALS])
{
    for (int t = 0; t < FH_CE_TOTALS; t++)
        totals[t] = 0.0;
}

void fh_ce_write_token_outputs(const fh_ce_head *h, const fh_token_stats *stats, fh_ce_outputs *out,
                               double totals[FH_CE_TOTALS])
{
    clear_totals(totals);
    for (int64_t i = 0; i < h->lin->n; i++)
        token_outputs(h, stats, i, out, totals);
}

void fh_ce_write_loss(const fh_ce_head *h, const double totals[FH_CE_TOTALS], fh_ce_outputs *out)
{
    double ce_total = totals[FH_CE_TOTAL_CE], z_total = totals[FH_CE_TOTAL_Z];
    if (h->o->reduction == FH_REDUCTION_MEAN) {
        ce_total *= safe_inverse(h->nm.weight_sum);
        z_total *= safe_inverse(h->nm.count);
    }
    if (out->loss)
        *out->loss = ce_total + z_total;
    if (out->z_loss)
        *out->z_loss = z_total;
    if (out->correct)
        *out->correct = (int64_t)totals[FH_CE_TOTAL_CORRECT];
}

/* Per-token losses from the statistics, reduced, written to the requested outputs. */
static void write_outputs(const fh_ce_head *h, const fh_token_stats *stats, fh_ce_outputs *out)
{
    double totals[FH_CE_TOTALS];
    fh_ce_write_token_outputs(h, stats, out, totals);
    fh_ce_write_loss(h, totals, out);
}

fh_status fh_ce_check_outputs(fh_context *ctx, const fh_ce_options *o, const fh_ce_outputs *out)
{
    if (!out)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (o->reduction == FH_REDUCTION_NONE && !out->per_token_loss)
        return fh_fail(ctx, FH_ERR_MISSING_OUTPUT, "reduction 'none' needs per_token_loss");
    return FH_OK;
}

fh_status fh_ce_check_apart(fh_context *ctx, const fh_linear *lin, const int64_t *targets, const fh_ce_options *o,
                            const float *lse, const float *grad_output, const fh_ce_outputs *out,
                            const fh_linear_grads *grads)
{
    const size_t n = (size_t)lin->n, floats = n * sizeof(float);
    const int none = o->reduction == FH_REDUCTION_NONE;
    const int in_place = none && out && grad_output && out->per_token_loss == grad_output;
    const fh_buffer inputs[] = {{"targets", targets, n * sizeof(int64_t)},
                                {"class_weights", o->class_weights, (size_t)lin->vocab * sizeof(float)},
                                {"lse", lse, floats},
                                {"grad_output", in_place ? NULL : grad_output, none ? floats : sizeof(float)}};
    const fh_buffer outputs[] = {{"loss", out ? out->loss : NULL, sizeof(double)},
                                 {"z_loss", out ? out->z_loss : NULL, sizeof(double)},
                                 {"per_token_loss", out ? out->per_token_loss : NULL, floats},
                                 {"per_token_logp", out ? out->per_token_logp : NULL, floats},
                                 {"the lse output", out ? out->lse : NULL, floats},
                                 {"argmax", out ? out->argmax : NULL, n * sizeof(int64_t)},
                                 {"entropy", out ? out->entropy : NULL, floats},
                                 {"correct", out ? out->correct : NULL, sizeof(int64_t)}};
    return fh_check_apart(ctx, lin, grads, outputs, 8, inputs, 4);
}

fh_status fh_ce_check_backward_inputs(fh_context *ctx, const fh_linear *lin, const fh_ce_options *o,
                                      const float *grad_output, const fh_linear_grads *grads)
{
    if (!grad_output)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "grad_output is NULL");
    const fh_status st = fh_check_grads(ctx, lin, grads);
    if (st != FH_OK)
        return st;
    const int64_t count = o->reduction == FH_REDUCTION_NONE ? lin->n : 1;
    for (int64_t i = 0; i < count; i++)
        if (!isfinite(grad_output[i]))
            return fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output[%lld] = %g is not finite", (long long)i,
                           (double)grad_output[i]);
    return FH_OK;
}

fh_token_stats fh_ce_stats_in(const fh_workspace *ws, const fh_ce_options *o, const fh_ce_outputs *out)
{
    double *const *slot = ws->slot;
    const fh_token_stats stats = {slot[FH_CE_SLOT_LSE],
                                  slot[FH_CE_SLOT_Z_TARGET_THEN_A],
                                  o->label_smoothing > 0.0 ? slot[FH_CE_SLOT_SUM_WZ_THEN_B] : NULL,
                                  out->entropy ? slot[FH_CE_SLOT_SUM_PZ] : NULL,
                                  slot[FH_CE_SLOT_SUM_EXP_THEN_C],
                                  out->argmax || out->correct ? (int64_t *)slot[FH_CE_SLOT_ARGMAX] : NULL};
    return stats;
}

double *fh_ce_target_logits_in(const fh_workspace *ws, const fh_ce_options *o, const fh_engine_pass *pass)
{
    if (!o->token_scaling)
        return NULL;
    double *z_target = ws->slot[FH_CE_SLOT_Z_TARGET_THEN_A];
    fh_engine_target_logits(pass, z_target);
    return z_target;
}

fh_coef_arrays fh_ce_coefs_in(const fh_workspace *ws, const fh_ce_head *h, const float *lse_in,
                              const double *z_target)
{
    double *lse = ws->slot[FH_CE_SLOT_LSE], *a = ws->slot[FH_CE_SLOT_Z_TARGET_THEN_A],
           *b = ws->slot[FH_CE_SLOT_SUM_WZ_THEN_B], *c = ws->slot[FH_CE_SLOT_SUM_EXP_THEN_C];
    for (int64_t i = 0; i < h->lin->n; i++) {
        lse[i] = lse_in[i];
        const fh_final_stats stats = {lse[i], z_target ? z_target[i] : 0.0, 0.0, 0.0};
        fh_coef k;
        fh_ce_row_coefs(h, i, &stats, &k);
        a[i] = k.a;
        b[i] = k.b;
        c[i] = k.c;
    }
    const fh_coef_arrays coefs = {lse, a, b, c, NULL, NULL};
    return coefs;
}

fh_coef_arrays fh_ce_outputs_and_coefs(const fh_workspace *ws, const fh_ce_head *h, const fh_token_stats *stats,
                                       fh_ce_outputs *out, double totals[FH_CE_TOTALS])
{
    double *a = ws->slot[FH_CE_SLOT_Z_TARGET_THEN_A], *b = ws->slot[FH_CE_SLOT_SUM_WZ_THEN_B],
           *c = ws->slot[FH_CE_SLOT_SUM_EXP_THEN_C];
    clear_totals(totals);
    for (int64_t i = 0; i < h->lin->n; i++) {
        const fh_final_stats final = {stats->lse[i], stats->z_target[i], 0.0, 0.0};
        fh_coef k;
        fh_ce_row_coefs(h, i, &final, &k);
        token_outputs(h, stats, i, out, totals);
        a[i] = k.a;
        b[i] = k.b;
        c[i] = k.c;
    }
    const fh_coef_arrays coefs = {stats->lse, a, b, c, NULL, NULL};
    return coefs;
}

/* One call after its checks: what it computes (kind) and on what; run() takes it on the whole problem, run_counted()
 * on its counted rows. */
typedef struct ce_call {
    fh_call kind; /* FH_CALL_TRAIN_STEP: the single-call train step */
    const fh_linear *lin;
    const int64_t *targets;
    const fh_ce_options *options;
    const float *lse;         /* backward: what the forward saved */
    const float *grad_output; /* backward, train step */
    fh_ce_outputs *out;       /* forward, train step */
    const fh_linear_grads *grads;
} ce_call;

static fh_status run_forward(const void *self, const fh_plan *plan, const fh_workspace *ws)
{
    const ce_call *c = self;
    const fh_ce_head h = fh_ce_head_of(c->lin, c->targets, c->options, NULL);
    const fh_token_stats stats = fh_ce_stats_in(ws, c->options, c->out);
    fh_engine_pass pass = fh_ce_pass(plan, ws, c->lin, c->targets, c->options);
    pass.stats = &stats;
    const fh_status st = fh_engine_forward(&pass);
    if (st == FH_OK)
        write_outputs(&h, &stats, c->out);
    return st;
}

static fh_status run_backward(const void *self, const fh_plan *plan, const fh_workspace *ws)
{
    const ce_call *c = self;
    const fh_ce_head h = fh_ce_head_of(c->lin, c->targets, c->options, c->grad_output);
    fh_engine_pass pass = fh_ce_pass(plan, ws, c->lin, c->targets, c->options);
    const fh_coef_arrays coefs = fh_ce_coefs_in(ws, &h, c->lse, fh_ce_target_logits_in(ws, c->options, &pass));
    pass.coefs = &coefs;
    pass.grads = c->grads;
    return fh_engine_backward(&pass);
}

static fh_status step_run(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                          const fh_linear_grads *grads)
{
    const ce_call *c = self;
    const fh_ce_head h = fh_ce_head_of(c->lin, c->targets, c->options, c->grad_output);
    const fh_token_stats stats = fh_ce_stats_in(&ws[0], c->options, c->out);
    fh_engine_pass pass = fh_ce_pass(&plans[0], &ws[0], c->lin, c->targets, c->options);
    pass.stats = &stats;
    pass.grads = grads;
    if (row_blocks) {
        const fh_coef_source source = {fh_ce_row_coefs, NULL, &h};
        pass.source = &source;
        const fh_status st = fh_engine_row_blocks(&pass);
        if (st == FH_OK)
            write_outputs(&h, &stats, c->out);
        return st;
    }
    /* Streaming fallback: forward, then backward from the double lse (it stays in its slot); the pass holds
     * grads, so the forward prepares the backward's GEMMs too. */
    const fh_status st = fh_engine_forward(&pass);
    if (st != FH_OK)
        return st;
    double totals[FH_CE_TOTALS];
    const fh_coef_arrays coefs = fh_ce_outputs_and_coefs(&ws[0], &h, &stats, c->out, totals);
    fh_ce_write_loss(&h, totals, c->out);
    pass.coefs = &coefs;
    return fh_engine_backward(&pass);
}

static fh_status run(fh_context *ctx, const void *self)
{
    static const fh_head_calls calls = {run_forward, run_backward, step_run};
    const ce_call *c = self;
    return fh_engine_run_call(ctx, c->kind, &calls, c->lin, c->grads, c);
}

/* The call on its counted rows (counted_rows.h) when no output needs an ignored row's logits (the lse and argmax
 * outputs do; the others are 0 there): ignored rows add nothing to the loss, its normalisers or the gradients, so
 * their GEMMs are skipped. Its per-row arrays: the saved lse and the upstream gradient ('none'), then the per-token
 * loss, log-prob and entropy outputs. */
static fh_status run_on(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                        float *const *a, void *extra)
{
    (void)extra;
    const ce_call *c = self;
    fh_ce_outputs counted_out;
    if (c->out) {
        counted_out = *c->out;
        counted_out.per_token_loss = a[2];
        counted_out.per_token_logp = a[3];
        counted_out.entropy = a[4];
    }
    const int per_token = c->options->reduction == FH_REDUCTION_NONE;
    const ce_call counted = {c->kind, &rows->lin, targets, c->options, a[0], per_token ? a[1] : c->grad_output,
                             c->out ? &counted_out : NULL, c->grads ? &rows->grads : NULL};
    return run(ctx, &counted);
}

static fh_status run_counted(fh_context *ctx, const ce_call *c)
{
    fh_ce_outputs *const o = c->out;
    if (o && (o->lse || o->argmax))
        return run(ctx, c);
    const int per_token = c->options->reduction == FH_REDUCTION_NONE;
    const float *const in[] = {c->lse, per_token ? c->grad_output : NULL};
    float *const out[] = {o ? o->per_token_loss : NULL, o ? o->per_token_logp : NULL, o ? o->entropy : NULL};
    const fh_counted_call call = {.lin = c->lin, .grads = c->grads, .filtered = c->grads != NULL,
                                  .targets = c->targets, .ignore_index = c->options->ignore_index,
                                  .in = in, .inputs = 2, .out = out, .outputs = 3,
                                  .whole = run, .counted = run_on, .self = c};
    return fh_counted_rows_run(ctx, &call);
}

FH_API fh_status fh_ce_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                               const fh_ce_options *options, fh_ce_outputs *out)
{
    fh_status st = fh_ce_check_call(ctx, lin, targets, options, 0);
    if (st == FH_OK)
        st = fh_ce_check_outputs(ctx, options, out);
    if (st == FH_OK)
        st = fh_ce_check_apart(ctx, lin, targets, options, NULL, NULL, out, NULL);
    if (st != FH_OK)
        return st;
    const ce_call c = {FH_CALL_FORWARD, lin, targets, options, NULL, NULL, out, NULL};
    return run_counted(ctx, &c);
}

FH_API fh_status fh_ce_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                const fh_ce_options *options, const float *lse, const float *grad_output,
                                fh_linear_grads *grads)
{
    fh_status st = fh_ce_check_call(ctx, lin, targets, options, 0);
    if (st == FH_OK && !lse)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "lse is NULL");
    if (st == FH_OK)
        st = fh_ce_check_backward_inputs(ctx, lin, options, grad_output, grads);
    if (st == FH_OK)
        st = fh_ce_check_apart(ctx, lin, targets, options, lse, grad_output, NULL, grads);
    if (st != FH_OK)
        return st;
    const ce_call c = {FH_CALL_BACKWARD, lin, targets, options, lse, grad_output, NULL, grads};
    return run_counted(ctx, &c);
}

FH_API fh_status fh_ce_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                        const fh_ce_options *options, const float *grad_output,
                                        fh_ce_outputs *out, fh_linear_grads *grads)
{
    fh_status st = fh_ce_check_call(ctx, lin, targets, options, 0);
    if (st == FH_OK)
        st = fh_ce_check_outputs(ctx, options, out);
    if (st == FH_OK)
        st = fh_ce_check_backward_inputs(ctx, lin, options, grad_output, grads);
    if (st == FH_OK)
        st = fh_ce_check_apart(ctx, lin, targets, options, NULL, grad_output, out, grads);
    if (st != FH_OK)
        return st;
    const ce_call c = {FH_CALL_TRAIN_STEP, lin, targets, options, NULL, grad_output, out, grads};
    return run_counted(ctx, &c);
}
