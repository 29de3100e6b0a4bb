/* Inputs: logits with standard deviation ~3; completion masks with a random-length tail of padding per
 * sequence and one all-zero sequence (when B > 1); advantages of both signs and one exactly zero; padding
 * ids out of range on half the padded positions; old log-probs = current log-probs (from the reference)
 * plus U(-0.4, 0.4), so ratios fall on both sides of the clip range; reference log-probs likewise; with
 * sampling_logps, the sampler's log-probs = the old ones (the current ones on-policy) plus U(-0.15, 0.15), so the
 * importance-sampling ratios fall on both sides of bounds near 1.
 * Tolerances:
 *   loss: absolute 1e-6 * max(1, |loss|). Every term is advantage x (ratio, sigmoid or clamped ratio, or
 *     for cispo a log-prob of size log V) x normaliser; fp32 logits put ~sqrt(H) 6e-8 |z| ~ 1e-6 on each
 *     log-prob, which averages down over the tokens.
 *   metrics: absolute 1e-5 (kl and entropy carry the fp32 log-prob error; clip ratios are counts and
 *     match exactly unless a ratio sits within ~1e-6 of a bound, which these random draws avoid; so do
 *     clip_ratio/low_min and high_max; policy_loss is the loss before the bonus; the sampling metrics are
 *     functions of the inputs alone when old log-probs are given, else of the log-probs, like kl; the masks'
 *     decisions (off-policy, top-entropy, importance-sampling bounds) flip only for a value within ~1e-6 of its
 *     threshold, which these draws do not come near: the seeds are fixed, so a flip would fail every run).
 *   the detached factors exponential in a row's sum of log-probs (vespo's phi; on-policy, the sequence modes'
 *     importance-sampling ratio) amplify the log-prob error instead of averaging it: grpo_slack (grpo_case.h)
 *     derives the first-order effect from the measured per-token differences and every comparison adds twice it
 *     (worst seen with it: 0.61 of the loss tolerance over the grpo_trl_* gradchecks, 0.44 over the grpo_trl
 *     suite).
 *   gradients: normwise relative 1e-5, as for cross-entropy (same engine, same fp32 GEMMs); bf16 cases
 *     round dU to bf16 for the gradient GEMMs as cross-entropy does, and share its bf16 tolerance. */
#include "grpo_case.h"

#include "bf16.h"
#include "ce_case.h"
#include "grpo_convert.h"
#include "ref_grpo.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void grpo_case_spec_default(grpo_case_spec *spec)
{
    memset(spec, 0, sizeof *spec);
    spec->batch = 3;
    spec->seq = 47;
    spec->hidden = 67;
    spec->vocab = 5003;
    spec->layout = FH_LAYOUT_VH;
    fh_grpo_options_init(&spec->options);
    spec->old_logps = 1;
    spec->seed = 1;
    spec->grad_output = 1.0f;
}

static void *zalloc(size_t count, size_t size)
{
    return calloc(count ? count : 1, size);
}

static double *doubles(const float *f, size_t count)
{
    if (!f)
        return NULL;
    double *d = zalloc(count, sizeof *d);
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

/* The reference problem in double with the canonical [H, V] weight. Arrays owned by the caller. */
typedef struct ref_inputs {
    double *x, *w, *b, *mask, *adv, *old, *ref, *samp;
} ref_inputs;

static ref_grpo_problem ref_problem(const grpo_case *c, ref_inputs *in)
{
    const grpo_case_spec *s = &c->spec;
    const size_t n = (size_t)(s->batch * s->seq), h = (size_t)s->hidden, v = (size_t)s->vocab;
    in->x = doubles(c->x, n * h);
    in->w = ce_weight_to_reference(s->layout, s->hidden, s->vocab, c->weight);
    in->b = doubles(c->bias, v);
    in->mask = doubles(c->mask, n);
    in->adv = doubles(c->advantages, (size_t)s->batch);
    in->old = doubles(c->old_logps, n);
    in->ref = doubles(c->ref_logps, n);
    in->samp = doubles(c->sampling_logps, n);
    const ref_grpo_problem p = {s->batch, s->seq, s->hidden, s->vocab, in->x,    in->w, in->b, c->ids,
                                in->mask,  in->adv, in->old,   in->ref,   NULL, in->samp, NULL};
    return p;
}

static void ref_inputs_free(ref_inputs *in)
{
    free(in->x), free(in->w), free(in->b), free(in->mask), free(in->adv), free(in->old), free(in->ref);
    free(in->samp);
}

static void make_inputs(const grpo_case_spec *s, grpo_case *c)
{
    const int64_t B = s->batch, T = s->seq, n = B * T;
    const size_t h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 104729 + 3;
    c->x = zalloc((size_t)n * h, sizeof(float));
    c->weight = zalloc(h * v, sizeof(float));
    c->bias = s->bias ? zalloc(v, sizeof(float)) : NULL;
    ce_fill_linear(&rng, n, s->hidden, s->vocab, s->logit_scale > 0.0 ? s->logit_scale : 3.0, c->x, c->weight,
                   c->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        c->x_bf16 = bf16_round_in_place(c->x, (size_t)n * (size_t)s->hidden);
        c->weight_bf16 = bf16_round_in_place(c->weight, (size_t)s->hidden * (size_t)s->vocab);
    }
    c->ids = zalloc((size_t)n, sizeof(int64_t));
    c->mask = zalloc((size_t)n, sizeof(float));
    c->advantages = zalloc((size_t)B, sizeof(float));
    for (int64_t b = 0; b < B; b++) {
        const int64_t length = B > 1 && b == B - 1 ? 0 : 1 + (int64_t)(ref_uniform(&rng) * (double)T);
        c->advantages[b] = b == 0 ? 0.0f : (float)(2.0 * ref_uniform(&rng) - 1.0);
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            c->mask[i] = t < length ? 1.0f : 0.0f;
            c->ids[i] = (int64_t)(ref_uniform(&rng) * (double)s->vocab);
            if (t >= length && ref_uniform(&rng) < 0.5)
                c->ids[i] = -100; /* padding id outside the vocabulary */
        }
    }
    if (B > 2)
        c->advantages[1] = -fabsf(c->advantages[1]) - 0.1f; /* make sure both signs occur */
    /* Old and reference log-probs near the current ones: the reference's on-policy logp plus noise. */
    ref_inputs in;
    const ref_grpo_problem p = ref_problem(c, &in);
    ref_grpo_options o;
    ref_grpo_options_default(&o); /* the log-probs only: no option that needs more inputs */
    o.temperature = s->options.temperature;
    double *logp = zalloc((size_t)n, sizeof(double));
    ref_grpo_result r = {0};
    r.logp = logp;
    ref_grpo_forward(&p, &o, &r);
    ref_inputs_free(&in);
    c->ref_logps = zalloc((size_t)n, sizeof(float));
    c->old_logps = s->old_logps ? zalloc((size_t)n, sizeof(float)) : NULL;
    for (int64_t i = 0; i < n; i++) {
        c->ref_logps[i] = (float)(logp[i] + 0.8 * (ref_uniform(&rng) - 0.5));
        if (c->old_logps)
            c->old_logps[i] = (float)(logp[i] + 0.8 * (ref_uniform(&rng) - 0.5));
    }
    c->sampling_logps = s->sampling_logps ? zalloc((size_t)n, sizeof(float)) : NULL;
    for (int64_t i = 0; c->sampling_logps && i < n; i++)
        c->sampling_logps[i] = (float)((c->old_logps ? (double)c->old_logps[i] : logp[i]) +
                                       0.3 * (ref_uniform(&rng) - 0.5));
    free(logp);
}

static fh_status run_fused(const grpo_case_spec *s, grpo_case *c)
{
    const size_t n = (size_t)(s->batch * s->seq), h = (size_t)s->hidden, v = (size_t)s->vocab;
    const ce_case_settings settings = {s->threads,  s->tile_rows,       s->tile_vocab,      s->budget,
                                       s->fp32_du,  s->grad_filter_eps, s->grad_filter_tail};
    fh_context *ctx = NULL;
    fh_status st = ce_case_context(&settings, &ctx);
    if (st != FH_OK)
        return st;
    const fh_linear lin = ce_case_linear((int64_t)n, s->hidden, s->vocab, s->layout, s->dtype, c->x, c->x_bf16, c->weight,
                                   c->weight_bf16, c->bias);
    const fh_grpo_batch batch = {s->batch,     s->seq,       c->ids,
                                 c->mask,      c->advantages, c->old_logps,
                                 s->options.beta != 0.0 ? c->ref_logps : NULL, c->sampling_logps, NULL, NULL};
    c->logp = zalloc(n, sizeof(float));
    c->per_token_loss = zalloc(n, sizeof(float));
    c->entropy = zalloc(n, sizeof(float));
    c->lse = zalloc(n, sizeof(float));
    c->dx = zalloc(n * h, sizeof(float));
    c->dweight = zalloc(h * v, sizeof(float));
    c->dbias = c->bias ? zalloc(v, sizeof(float)) : NULL;
    /* beta 0 must overwrite NaN garbage. */
    for (size_t i = 0; i < n * h; i++)
        c->dx[i] = NAN;
    for (size_t i = 0; i < h * v; i++)
        c->dweight[i] = NAN;
    for (size_t j = 0; c->dbias && j < v; j++)
        c->dbias[j] = NAN;
    fh_grpo_outputs out = {&c->loss, &c->metrics, c->logp, c->per_token_loss, c->entropy, c->lse};
    ce_grads_io io;
    ce_grads_io_begin(&io, s->grad_dtype, n, h, v, 0.0f, c->dx, c->dweight, c->dbias);
    if (s->train_step) {
        st = fh_grpo_forward_backward(ctx, &lin, &batch, &s->options, &s->grad_output, &out, &io.grads);
    } else {
        st = fh_grpo_forward(ctx, &lin, &batch, &s->options, &out);
        if (st == FH_OK)
            st = fh_grpo_backward(ctx, &lin, &batch, &s->options, c->logp, c->lse, c->entropy, &s->grad_output,
                                  &io.grads);
    }
    ce_grads_io_finish(&io);
    fh_context_filter_stats(ctx, &c->filter_stats);
    fh_context_destroy(ctx);
    return st;
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* The tiles of the fused backward, for the reference's filter: the train step's row blocks of whole sequences
 * (plan.c: at most tile_rows rows, or 256 / one sequence in bf16, balanced over the sequences; bf16 ones keep
 * dweight for after the blocks) over the whole vocabulary, else the streaming tiles (default 1024 rows x 2048
 * columns), in which a train step also runs when not one sequence fits. The default budget holds them for the
 * cases the tests run. */
static ref_filter filter_of(const grpo_case_spec *s)
{
    const int64_t n = s->batch * s->seq;
    const int bf16_du = s->dtype == FH_DTYPE_BF16 && !s->fp32_du;
    ref_filter f = {s->grad_filter_eps, min64(n, s->tile_rows > 0 ? s->tile_rows : 1024), 0, 0,
                    s->tile_vocab > 0 ? s->tile_vocab : 2048, s->grad_filter_tail == FH_FILTER_TAIL_DROP};
    if (!s->train_step || s->fp32_du)
        return f;
    const int64_t rows = min64(n, s->tile_rows > 0 ? s->tile_rows : bf16_du ? (s->seq > 256 ? s->seq : 256) : n);
    const int64_t fit = rows / s->seq;
    if (fit < 1)
        return f;
    const int64_t blocks = (s->batch + fit - 1) / fit;
    f.tile_rows = (s->batch + blocks - 1) / blocks * s->seq;
    f.tile_vocab = 0;
    f.dweight_after_blocks = bf16_du;
    return f;
}

/* Where the reference writes them. */
static void grpo_ref_detail_attach(const grpo_ref_detail *d, ref_grpo_result *r)
{
    r->policy_term = d->policy_term;
    r->is_ratio = d->is_ratio;
    r->vespo_phi = d->vespo_phi;
    r->vespo_log_w = d->vespo_log_w;
    r->loss_weight = d->loss_weight;
}

static void run_reference(const grpo_case_spec *s, grpo_case *c)
{
    const size_t n = (size_t)(s->batch * s->seq), h = (size_t)s->hidden, v = (size_t)s->vocab;
    ref_inputs in;
    ref_grpo_problem p = ref_problem(c, &in);
    if (s->options.beta == 0.0)
        p.ref_logp = NULL;
    const ref_filter filter = filter_of(s);
    ref_grpo_options o = grpo_ref_options(&s->options);
    o.filter = s->grad_filter_eps > 0.0 ? &filter : NULL;
    c->ref_logp = zalloc(n, sizeof(double));
    c->ref_per_token_loss = zalloc(n, sizeof(double));
    c->ref_entropy = zalloc(n, sizeof(double));
    ref_grpo_result r = {0};
    r.logp = c->ref_logp;
    r.per_token_loss = c->ref_per_token_loss;
    r.entropy = c->ref_entropy;
    grpo_ref_detail_alloc(&c->ref_detail, n);
    grpo_ref_detail_attach(&c->ref_detail, &r);
    ref_grpo_forward(&p, &o, &r);
    c->ref_loss = r.loss;
    c->ref_metrics = grpo_fh_metrics(&r.metrics);
    double *dw = zalloc(h * v, sizeof(double));
    c->ref_dx = zalloc(n * h, sizeof(double));
    c->ref_dbias = c->bias ? zalloc(v, sizeof(double)) : NULL;
    ref_grpo_backward(&p, &o, s->grad_output, c->ref_dx, dw, c->ref_dbias);
    c->ref_dweight = zalloc(h * v, sizeof(double));
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, dw, c->ref_dweight);
    free(dw);
    ref_inputs_free(&in);
}

void grpo_ref_detail_alloc(grpo_ref_detail *d, size_t n)
{
    d->policy_term = zalloc(n, sizeof(double));
    d->is_ratio = zalloc(n, sizeof(double));
    d->vespo_phi = zalloc(n, sizeof(double));
    d->vespo_log_w = zalloc(n, sizeof(double));
    d->loss_weight = zalloc(n, sizeof(double));
}

void grpo_ref_detail_free(grpo_ref_detail *d)
{
    free(d->policy_term), free(d->is_ratio), free(d->vespo_phi), free(d->vespo_log_w), free(d->loss_weight);
    memset(d, 0, sizeof *d);
}

grpo_slack grpo_slack_of(const fh_grpo_options *o, const fh_grpo_batch *batch, const float *logp,
                         const double *ref_logp, const grpo_ref_detail *d)
{
    grpo_slack v = {0.0, 0.0, 0.0, 0.0};
    const int vespo = o->loss_type == FH_GRPO_LOSS_VESPO;
    const int sequence_is = batch->sampling_per_token_logps && o->vllm_importance_sampling_correction &&
                            !batch->old_per_token_logps &&
                            (o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE ||
                             o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_SEQUENCE_MASK);
    if (!vespo && !sequence_is)
        return v;
    const int64_t B = batch->batch, T = batch->seq;
    const float *mask = batch->completion_mask;
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = b * T;
        const double a = batch->advantages[b];
        double c = 1.0;
        if (vespo) {
            const double k = a >= 0.0 ? o->vespo_k_pos : o->vespo_k_neg;
            const double lam = fmax(a >= 0.0 ? o->vespo_lambda_pos : o->vespo_lambda_neg, 1e-4);
            c = fabs(k - lam * exp(d->vespo_log_w[first]));
        }
        double e = 0.0, policy = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = first + t;
            e += mask[i] * (fabs((double)logp[i] - ref_logp[i]) + ldexp(fabs(ref_logp[i]), -24));
            policy += fabs(d->loss_weight[i] * d->policy_term[i]);
        }
        const double s = c * e;
        v.loss += s * policy;
        if (vespo)
            v.phi_mean += d->vespo_phi[first] * s / (double)B;
        else
            v.is_ratio = fmax(v.is_ratio, d->is_ratio[first] * s);
        if (policy != 0.0)
            v.grad_rel = fmax(v.grad_rel, s);
    }
    return v;
}

double grpo_metric_slack(const grpo_slack *slack, int k)
{
    switch (k) {
    case GRPO_METRIC_POLICY_LOSS: return 2.0 * slack->loss;
    case GRPO_METRIC_VESPO_PHI_SEQ_MEAN: return 2.0 * slack->phi_mean;
    case GRPO_METRIC_IS_RATIO_MIN:
    case GRPO_METRIC_IS_RATIO_MEAN:
    case GRPO_METRIC_IS_RATIO_MAX: return 2.0 * slack->is_ratio;
    default: return 0.0;
    }
}

/* |a - b|, with NaN equal to NaN (a metric TRL does not log) and NaN against a number infinite. */
static double metric_diff(double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0.0 : INFINITY;
    return fabs(a - b);
}

static void measure(const grpo_case_spec *s, const grpo_case *c, grpo_metrics_diff *d)
{
    const size_t n = (size_t)(s->batch * s->seq), h = (size_t)s->hidden, v = (size_t)s->vocab;
    memset(d, 0, sizeof *d);
    const fh_grpo_batch batch = {s->batch,     s->seq,        c->ids,       c->mask,
                                 c->advantages, c->old_logps, c->ref_logps, c->sampling_logps, NULL, NULL};
    const grpo_slack slack = grpo_slack_of(&s->options, &batch, c->logp, c->ref_logp, &c->ref_detail);
    d->grad_norm_rel_tol =
        ce_grad_tolerance(GRPO_GRAD_NORM_REL_TOL, s->dtype == FH_DTYPE_BF16 && !s->fp32_du, s->grad_dtype) +
        2.0 * slack.grad_rel;
    d->dbias_norm_rel_tol = ce_grad_tolerance(GRPO_GRAD_NORM_REL_TOL, 0, s->grad_dtype) + 2.0 * slack.grad_rel;
    d->abs_diff_loss = fabs(c->loss - c->ref_loss);
    d->loss_tolerance = GRPO_LOSS_TOL * fmax(1.0, fabs(c->ref_loss)) + 2.0 * slack.loss;
    d->logp_max_abs = ce_compare(c->logp, c->ref_logp, n).max_abs;
    d->per_token_loss_max_abs = ce_compare(c->per_token_loss, c->ref_per_token_loss, n).max_abs;
    d->entropy_max_abs = ce_compare(c->entropy, c->ref_entropy, n).max_abs;
    double fused[GRPO_METRIC_COUNT], ref[GRPO_METRIC_COUNT];
    grpo_metrics_fields(&c->metrics, fused);
    grpo_metrics_fields(&c->ref_metrics, ref);
    for (int k = 0; k < GRPO_METRIC_COUNT; k++)
        d->metrics_max_abs =
            fmax(d->metrics_max_abs, fmax(0.0, metric_diff(fused[k], ref[k]) - grpo_metric_slack(&slack, k)));
    const ce_diff dx = ce_compare(c->dx, c->ref_dx, n * h), dw = ce_compare(c->dweight, c->ref_dweight, h * v);
    d->dhidden_max_abs = dx.max_abs;
    d->dhidden_max_rel = dx.max_rel;
    d->dhidden_norm_rel = dx.norm_rel;
    d->dweight_max_abs = dw.max_abs;
    d->dweight_max_rel = dw.max_rel;
    d->dweight_norm_rel = dw.norm_rel;
    if (c->dbias)
        d->dbias_norm_rel = ce_compare(c->dbias, c->ref_dbias, v).norm_rel;
}

int grpo_metrics_pass(const grpo_metrics_diff *d)
{
    return d->abs_diff_loss <= d->loss_tolerance && d->metrics_max_abs <= GRPO_METRIC_TOL &&
           d->dhidden_norm_rel <= d->grad_norm_rel_tol && d->dweight_norm_rel <= d->grad_norm_rel_tol &&
           d->dbias_norm_rel <= d->dbias_norm_rel_tol;
}

fh_status grpo_case_run(const grpo_case_spec *spec, grpo_case *c, grpo_metrics_diff *d)
{
    memset(c, 0, sizeof *c);
    c->spec = *spec;
    make_inputs(spec, c);
    const fh_status st = run_fused(spec, c);
    if (st != FH_OK)
        return st;
    run_reference(spec, c);
    measure(spec, c, d);
    return FH_OK;
}

void grpo_case_free(grpo_case *c)
{
    void *p[] = {c->x, c->weight, c->bias, c->mask, c->advantages, c->old_logps, c->ref_logps, c->ids, c->logp,
                 c->per_token_loss, c->entropy, c->lse, c->dx, c->dweight, c->dbias, c->ref_logp,
                 c->ref_per_token_loss, c->ref_entropy, c->ref_dx, c->ref_dweight, c->ref_dbias, c->x_bf16,
                 c->weight_bf16, c->sampling_logps};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    grpo_ref_detail_free(&c->ref_detail);
    memset(c, 0, sizeof *c);
}
