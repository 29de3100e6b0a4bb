#include "grpo_harness.h"

#include "ce_case.h"
#include "grpo_convert.h"
#include "ref_grpo.h"
#include "ref_linear.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Problems with caller-chosen inputs
 * ============================================================================================== */

int64_t gp_n(const gp_problem *p)
{
    return p->batch * p->seq;
}

void gp_init(gp_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, fh_layout layout, int bias,
             uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->batch = B;
    p->seq = T;
    p->hidden = H;
    p->vocab = V;
    p->layout = layout;
    const size_t n = (size_t)(B * T);
    p->x = tu_alloc(n * (size_t)H, sizeof(float));
    p->weight = tu_alloc((size_t)(H * V), sizeof(float));
    p->bias = bias ? tu_alloc((size_t)V, sizeof(float)) : NULL;
    p->ids = tu_alloc(n, sizeof(int64_t));
    p->mask = tu_alloc(n, sizeof(float));
    p->adv = tu_alloc((size_t)B, sizeof(float));
    p->ref = tu_alloc(n, sizeof(float));
    p->rng = seed * 7919 + 11;
    ce_fill_linear(&p->rng, (int64_t)n, H, V, 3.0, p->x, p->weight, p->bias);
    for (int64_t b = 0; b < B; b++) {
        const int64_t length = B > 1 && b == B - 1 ? 0 : 1 + (int64_t)(ref_uniform(&p->rng) * (double)T);
        const double magnitude = 0.25 + ref_uniform(&p->rng);
        p->adv[b] = (float)(b % 3 == 0 ? magnitude : b % 3 == 1 ? -magnitude : 0.0);
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            p->mask[i] = t < length ? 1.0f : 0.0f;
            p->ids[i] = (int64_t)(ref_uniform(&p->rng) * (double)V);
            if (t >= length && (t & 1))
                p->ids[i] = -100;
        }
    }
}

void gp_fix_ids(gp_problem *p)
{
    for (int64_t i = 0; i < gp_n(p); i++)
        if (p->mask[i] != 0.0f && (p->ids[i] < 0 || p->ids[i] >= p->vocab))
            p->ids[i] = (int64_t)(ref_uniform(&p->rng) * (double)p->vocab);
}

void gp_free(gp_problem *p)
{
    void *a[] = {p->x, p->weight, p->bias, p->ids, p->mask, p->adv, p->old, p->ref, p->samp};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    memset(p, 0, sizeof *p);
}

/* The problem's inputs in double for the reference, the weight in its canonical [H, V] layout; what a problem
 * does not have stays NULL. */
typedef struct gp_ref_arrays {
    double *x, *w, *b, *mask, *adv, *old, *ref, *samp;
} gp_ref_arrays;

static void gp_ref_arrays_free(gp_ref_arrays *a)
{
    free(a->x), free(a->w), free(a->b), free(a->mask), free(a->adv), free(a->old), free(a->ref), free(a->samp);
}

/* The problem's linear layer in double (x, w, b filled in a). */
static ref_linear gp_ref_linear(const gp_problem *p, gp_ref_arrays *a)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    a->x = tu_doubles(p->x, n * h);
    a->w = ce_weight_to_reference(p->layout, p->hidden, p->vocab, p->weight);
    a->b = tu_doubles(p->bias, v);
    const ref_linear lin = {gp_n(p), p->hidden, p->vocab, a->x, a->w, a->b};
    return lin;
}

/* Untempered logits u = x W + b in double from the fp32 inputs, [n, V]. */
static double *gp_logits(const gp_problem *p)
{
    gp_ref_arrays a = {0};
    const ref_linear lin = gp_ref_linear(p, &a);
    double *u = ref_linear_logits(&lin);
    gp_ref_arrays_free(&a);
    if (!u) {
        fprintf(stderr, "out of memory\n");
        abort();
    }
    return u;
}

/* The reference's log-probs (double) of the tempered logits; 0 for out-of-range ids. */
static void gp_reference_logp(const gp_problem *p, double temperature, double *logp)
{
    const int64_t n = gp_n(p), V = p->vocab;
    double *u = gp_logits(p);
    for (int64_t i = 0; i < n; i++) {
        double m = -INFINITY, s = 0.0;
        for (int64_t j = 0; j < V; j++)
            m = fmax(m, u[i * V + j] / temperature);
        for (int64_t j = 0; j < V; j++)
            s += exp(u[i * V + j] / temperature - m);
        const int64_t id = p->ids[i];
        logp[i] = id >= 0 && id < V ? u[i * V + id] / temperature - (m + log(s)) : 0.0;
    }
    free(u);
}

static double gp_epsilon_high(const fh_grpo_options *o)
{
    return isnan(o->epsilon_high) ? o->epsilon_low : o->epsilon_high;
}

/* Every ratio value where a loss or a metric is discontinuous under these options: 1 - eps_low, 1 + eps_high,
 * delta (when on) and cispo's absolute cap eps_high. */
static int gp_bounds(const fh_grpo_options *o, double *bounds)
{
    int k = 0;
    bounds[k++] = 1.0 - o->epsilon_low;
    bounds[k++] = 1.0 + gp_epsilon_high(o);
    bounds[k++] = gp_epsilon_high(o);
    if (o->delta > 0.0)
        bounds[k++] = o->delta;
    return k;
}

int gp_isnan(double v)
{
    return isnan(v) ? 1 : 0;
}

static int gp_near_bound(double log_ratio, const double *bounds, int count)
{
    for (int k = 0; k < count; k++)
        if (bounds[k] > 0.0 && fabs(log_ratio - log(bounds[k])) < GP_BOUND_GUARD)
            return 1;
    return 0;
}

void gp_set_old(gp_problem *p, const fh_grpo_options *o)
{
    const int64_t B = p->batch, T = p->seq, n = gp_n(p);
    double *logp = tu_alloc((size_t)n, sizeof(double)), bounds[4];
    const int nb = gp_bounds(o, bounds);
    gp_reference_logp(p, o->temperature, logp);
    free(p->old);
    p->old = tu_alloc((size_t)n, sizeof(float));
    for (int64_t b = 0; b < B; b++) {
        int attempts = 0, ok = 0;
        while (!ok && attempts++ < 1000) {
            const double offset = 1.2 * (ref_uniform(&p->rng) - 0.5);
            double acc = 0.0, count = 0.0;
            ok = 1;
            for (int64_t t = 0; t < T; t++) {
                const int64_t i = b * T + t;
                double lr;
                int tries = 0;
                do {
                    p->old[i] = (float)(logp[i] - offset - 0.8 * (ref_uniform(&p->rng) - 0.5));
                    lr = logp[i] - (double)p->old[i];
                } while (p->mask[i] != 0.0f && gp_near_bound(lr, bounds, nb) && ++tries < 1000);
                acc += lr * p->mask[i];
                count += p->mask[i];
            }
            ok = !gp_near_bound(acc / fmax(count, 1.0), bounds, nb);
        }
        TU_CHECK(ok, "could not draw old log-probs away from the bounds");
    }
    free(logp);
}

void gp_set_sampling(gp_problem *p, double temperature, double spread)
{
    const int64_t n = gp_n(p);
    double *logp = NULL;
    if (!p->old) {
        logp = tu_alloc((size_t)n, sizeof(double));
        gp_reference_logp(p, temperature, logp);
    }
    free(p->samp);
    p->samp = tu_alloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p->samp[i] = (float)((p->old ? (double)p->old[i] : logp[i]) + spread * (2.0 * ref_uniform(&p->rng) - 1.0));
    free(logp);
}

void gp_set_ref(gp_problem *p, double temperature)
{
    const int64_t n = gp_n(p);
    double *logp = tu_alloc((size_t)n, sizeof(double));
    gp_reference_logp(p, temperature, logp);
    for (int64_t i = 0; i < n; i++) {
        const double u = ref_uniform(&p->rng);
        p->ref[i] = (float)(logp[i] + (u < 0.5 ? -1.0 : 1.0) * (0.3 + 0.8 * fabs(u - 0.5)));
    }
    free(logp);
}

fh_grpo_batch gp_batch(const gp_problem *p, const fh_grpo_options *o)
{
    const fh_grpo_batch b = {p->batch, p->seq, p->ids, p->mask, p->adv, p->old, o->beta != 0.0 ? p->ref : NULL,
                             p->samp, NULL, NULL};
    return b;
}

void gp_linear(const gp_problem *p, fh_linear *lin)
{
    const fh_status st = fh_linear_init(lin, gp_n(p), p->hidden, p->vocab, p->x, p->weight, p->layout, p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init: %d", (int)st);
}

/* ================================================================================================
 * Fused runs
 * ============================================================================================== */

void gp_two_threads(gp_config *c)
{
    c->threads = 2;
    c->tile_rows = 0;
    c->tile_vocab = 0;
}

static float gp_grad_output(const gp_config *c)
{
    return c->grad_output != 0.0f ? c->grad_output : 1.0f;
}

fh_context *gp_context(const gp_config *c)
{
    return tu_context(c->threads, c->tile_rows, c->tile_vocab, 0);
}

void gp_fused_alloc(const gp_problem *p, float grad_beta, gp_fused *f)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(f, 0, sizeof *f);
    f->logp = tu_alloc(n, sizeof(float));
    f->per_token_loss = tu_alloc(n, sizeof(float));
    f->entropy = tu_alloc(n, sizeof(float));
    f->lse = tu_alloc(n, sizeof(float));
    /* Outputs a call forgets to write show up as NaN. */
    for (size_t i = 0; i < n; i++)
        f->logp[i] = f->per_token_loss[i] = f->entropy[i] = f->lse[i] = NAN;
    ce_alloc_grads(n, h, v, p->bias != NULL, grad_beta, &f->dx, &f->dweight, &f->dbias);
    f->loss = NAN;
    double fields[GRPO_METRIC_COUNT]; /* fh_grpo_metrics is GRPO_METRIC_COUNT doubles (grpo_convert.c) */
    for (int k = 0; k < GRPO_METRIC_COUNT; k++)
        fields[k] = -1.0; /* a value every call must replace (with NaN where TRL logs nothing) */
    memcpy(&f->metrics, fields, sizeof f->metrics);
}

void gp_fused_free(gp_fused *f)
{
    void *a[] = {f->logp, f->per_token_loss, f->entropy, f->lse, f->dx, f->dweight, f->dbias};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    memset(f, 0, sizeof *f);
}

int gp_needs_entropy(const fh_grpo_options *o)
{
    return o->entropy_coef != 0.0 || o->top_entropy_quantile < 1.0;
}

fh_status gp_run_fused_on(fh_context *ctx, const gp_problem *p, const fh_grpo_options *o, const gp_config *c,
                          gp_fused *f)
{
    gp_fused_alloc(p, c->grad_beta, f);
    fh_linear lin;
    gp_linear(p, &lin);
    const fh_grpo_batch batch = gp_batch(p, o);
    fh_grpo_outputs out = {&f->loss, &f->metrics, f->logp, f->per_token_loss, f->entropy, f->lse};
    fh_linear_grads g = {.dx = f->dx, .dx_row_stride = p->hidden, .dx_beta = c->grad_beta, .dweight = f->dweight, .dweight_beta = c->grad_beta, .dbias = f->dbias, .dbias_beta = c->grad_beta};
    const float grad = gp_grad_output(c);
    if (c->train_step)
        return fh_grpo_forward_backward(ctx, &lin, &batch, o, &grad, &out, &g);
    fh_status st = fh_grpo_forward(ctx, &lin, &batch, o, &out);
    if (st == FH_OK)
        st = fh_grpo_backward(ctx, &lin, &batch, o, f->logp, f->lse,
                              gp_needs_entropy(o) ? f->entropy : NULL, &grad, &g);
    return st;
}

fh_status gp_run_fused(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, gp_fused *f)
{
    fh_context *ctx = gp_context(c);
    const fh_status st = gp_run_fused_on(ctx, p, o, c, f);
    fh_context_destroy(ctx);
    return st;
}

/* ================================================================================================
 * Reference runs
 * ============================================================================================== */

static ref_grpo_problem gp_ref_problem(const gp_problem *p, const fh_grpo_options *o, gp_ref_arrays *a)
{
    const size_t n = (size_t)gp_n(p);
    gp_ref_linear(p, a);
    a->mask = tu_doubles(p->mask, n);
    a->adv = tu_doubles(p->adv, (size_t)p->batch);
    a->old = tu_doubles(p->old, n);
    a->ref = o->beta != 0.0 ? tu_doubles(p->ref, n) : NULL;
    a->samp = tu_doubles(p->samp, n);
    const ref_grpo_problem rp = {p->batch, p->seq,  p->hidden, p->vocab, a->x, a->w,    a->b, p->ids,
                                 a->mask,  a->adv,  a->old,    a->ref,   NULL, a->samp, NULL};
    return rp;
}

void gp_run_reference(const gp_problem *p, const fh_grpo_options *o, double grad_output, double grad_beta,
                      gp_reference *r)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(r, 0, sizeof *r);
    gp_ref_arrays a;
    const ref_grpo_problem rp = gp_ref_problem(p, o, &a);
    const ref_grpo_options ro = grpo_ref_options(o);
    r->logp = tu_alloc(n, sizeof(double));
    r->per_token_loss = tu_alloc(n, sizeof(double));
    r->entropy = tu_alloc(n, sizeof(double));
    r->lse = tu_alloc(n, sizeof(double));
    r->dx = tu_alloc(n * h, sizeof(double));
    r->dweight = tu_alloc(h * v, sizeof(double));
    r->dbias = p->bias ? tu_alloc(v, sizeof(double)) : NULL;
    grpo_ref_detail_alloc(&r->detail, n);
    ref_grpo_result res = {0};
    res.logp = r->logp;
    res.per_token_loss = r->per_token_loss;
    res.entropy = r->entropy;
    res.policy_term = r->detail.policy_term;
    res.is_ratio = r->detail.is_ratio;
    res.vespo_phi = r->detail.vespo_phi;
    res.vespo_log_w = r->detail.vespo_log_w;
    res.loss_weight = r->detail.loss_weight;
    int rc = ref_grpo_forward(&rp, &ro, &res);
    r->loss = res.loss;
    r->metrics = grpo_fh_metrics(&res.metrics);
    double *dw = tu_alloc(h * v, sizeof(double));
    rc |= ref_grpo_backward(&rp, &ro, grad_output, r->dx, dw, r->dbias);
    TU_CHECK(rc == 0, "the reference failed: %d", rc);
    ce_weight_from_reference(p->layout, p->hidden, p->vocab, dw, r->dweight);
    for (size_t i = 0; i < h * v; i++)
        r->dweight[i] += grad_beta;
    for (size_t i = 0; i < n * h; i++)
        r->dx[i] += grad_beta;
    for (size_t j = 0; r->dbias && j < v; j++)
        r->dbias[j] += grad_beta;
    double *u = gp_logits(p);
    for (size_t i = 0; i < n; i++) {
        double m = -INFINITY, s = 0.0;
        for (size_t j = 0; j < v; j++)
            m = fmax(m, u[i * v + j] / o->temperature);
        for (size_t j = 0; j < v; j++)
            s += exp(u[i * v + j] / o->temperature - m);
        r->lse[i] = m + log(s);
    }
    free(u);
    free(dw);
    gp_ref_arrays_free(&a);
}

void gp_reference_free(gp_reference *r)
{
    void *a[] = {r->logp, r->per_token_loss, r->entropy, r->lse, r->dx, r->dweight, r->dbias};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    grpo_ref_detail_free(&r->detail);
    memset(r, 0, sizeof *r);
}

void gp_reference_backward_from_logp(const gp_problem *p, const fh_grpo_options *o, const float *logp_f,
                                     const float *entropy_f, double grad, double *dx, double *dweight,
                                     double *dbias)
{
    const int64_t n = gp_n(p), V = p->vocab;
    double *logp = tu_doubles(logp_f, (size_t)n), *entropy = tu_doubles(entropy_f, (size_t)n);
    double *mask = tu_doubles(p->mask, (size_t)n), *adv = tu_doubles(p->adv, (size_t)p->batch);
    double *old = tu_doubles(p->old, (size_t)n), *ref = o->beta != 0.0 ? tu_doubles(p->ref, (size_t)n) : NULL;
    double *samp = tu_doubles(p->samp, (size_t)n);
    double *gl = tu_alloc((size_t)n, sizeof(double)), *ge = tu_alloc((size_t)n, sizeof(double));
    const ref_grpo_tokens tk = {p->batch, p->seq, logp, entropy, mask, adv, old, ref, NULL, samp, NULL};
    const ref_grpo_options ro = grpo_ref_options(o);
    const int rc = ref_grpo_head(&tk, &ro, grad, NULL, gl, ge);
    TU_CHECK(rc == 0, "ref_grpo_head: %d", rc);
    double *u = gp_logits(p), *du = tu_alloc((size_t)(n * V), sizeof(double));
    for (int64_t i = 0; i < n; i++)
        ref_grpo_row_grad(u + i * V, V, o->temperature, p->ids[i], gl[i], ge[i], du + i * V);
    gp_ref_arrays la = {0};
    const ref_linear lin = gp_ref_linear(p, &la);
    double *dw = tu_alloc((size_t)(p->hidden * V), sizeof(double));
    ref_linear_backward(&lin, du, dx, dw, dbias);
    ce_weight_from_reference(p->layout, p->hidden, V, dw, dweight);
    gp_ref_arrays_free(&la);
    void *a[] = {logp, entropy, mask, adv, old, ref, samp, gl, ge, u, du, dw};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
}

/* ================================================================================================
 * Comparisons
 * ============================================================================================== */

/* max |f - r| / (1 + |r|); NaN anywhere gives NaN. */
static double gp_token_diff(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)f[i] - r[i]) / (1.0 + fabs(r[i]));
        if (!(e <= m))
            m = e;
        if (isnan(m))
            return m;
    }
    return m;
}

static double gp_metric_diff(double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0.0 : INFINITY;
    return fabs(a - b);
}

double gp_metrics_diff(const fh_grpo_metrics *a, const fh_grpo_metrics *b)
{
    const grpo_slack none = {0.0, 0.0, 0.0, 0.0};
    return gp_metrics_diff_slack(a, b, &none);
}

double gp_metrics_diff_slack(const fh_grpo_metrics *a, const fh_grpo_metrics *b, const grpo_slack *slack)
{
    double va[GRPO_METRIC_COUNT], vb[GRPO_METRIC_COUNT], m = 0.0;
    grpo_metrics_fields(a, va);
    grpo_metrics_fields(b, vb);
    for (int k = 0; k < GRPO_METRIC_COUNT; k++) {
        const double d = fmax(0.0, gp_metric_diff(va[k], vb[k]) - grpo_metric_slack(slack, k));
        m = d > m ? d : m;
    }
    return m;
}

grpo_slack gp_slack(const gp_problem *p, const fh_grpo_options *o, const gp_fused *f, const gp_reference *r)
{
    const fh_grpo_batch batch = gp_batch(p, o);
    return grpo_slack_of(o, &batch, f->logp, r->logp, &r->detail);
}

static void gp_measure(const gp_problem *p, const fh_grpo_options *o, const gp_fused *f, const gp_reference *r,
                       float grad_beta, gp_diff *d)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    const grpo_slack slack = gp_slack(p, o, f, r);
    memset(d, 0, sizeof *d);
    d->loss = fabs(f->loss - r->loss);
    if (isnan(f->loss) || isnan(r->loss))
        d->loss = NAN;
    d->loss_tol = GRPO_LOSS_TOL * fmax(1.0, fabs(r->loss)) + 2.0 * slack.loss;
    d->grad_tol = GRPO_GRAD_NORM_REL_TOL + 2.0 * slack.grad_rel;
    d->metrics = gp_metrics_diff_slack(&f->metrics, &r->metrics, &slack);
    d->logp = gp_token_diff(f->logp, r->logp, n);
    d->entropy = gp_token_diff(f->entropy, r->entropy, n);
    d->lse = gp_token_diff(f->lse, r->lse, n);
    d->per_token_loss = gp_token_diff(f->per_token_loss, r->per_token_loss, n);
    d->dx = ce_compare(f->dx, r->dx, n * h).norm_rel;
    d->dweight = ce_compare(f->dweight, r->dweight, h * v).norm_rel;
    if (f->dbias)
        d->dbias = ce_compare(f->dbias, r->dbias, v).norm_rel;
    /* A token outside the mask has zero coefficients: its dZ row is 0, so its dx row is exactly 0 (overwrite)
     * or exactly the 1.0 it accumulates onto. */
    for (size_t i = 0; i < n; i++)
        if (p->mask[i] == 0.0f && !tu_all_equal_f(f->dx + i * h, h, grad_beta))
            d->masked_rows_touched++;
}

static int gp_diff_pass(const gp_diff *d)
{
    return d->loss <= d->loss_tol && d->metrics <= GRPO_METRIC_TOL && d->logp <= GP_TOKEN_TOL &&
           d->entropy <= GP_TOKEN_TOL && d->lse <= GP_TOKEN_TOL && d->per_token_loss <= GP_TOKEN_TOL &&
           d->dx <= d->grad_tol && d->dweight <= d->grad_tol && d->dbias <= d->grad_tol &&
           d->masked_rows_touched == 0;
}

const char *gp_loss_name(fh_grpo_loss_type t)
{
    static const char *names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};
    return (unsigned)t < TU_COUNT(names) ? names[t] : "?";
}

void gp_describe(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, char *buf, size_t size)
{
    snprintf(buf, size,
             "B=%lld T=%lld H=%lld V=%lld %s bias=%d | %s %s old=%d beta=%g delta=%g eps=(%g,%g) temp=%g ent=%g "
             "nib=%g mcl=%lld q=%g opm=%g bias_kl=%d samp=%d is=%d:%d[%g,%g] vespo=(%g,%g,%g,%g) | tiles=%lldx%lld "
             "threads=%d step=%d g=%g gbeta=%g",
             (long long)p->batch, (long long)p->seq, (long long)p->hidden, (long long)p->vocab,
             p->layout == FH_LAYOUT_HV ? "hv" : "vh", p->bias != NULL, gp_loss_name(o->loss_type),
             o->importance_sampling_level == FH_GRPO_IS_SEQUENCE ? "sequence" : "token", p->old != NULL, o->beta,
             o->delta, o->epsilon_low, o->epsilon_high, o->temperature, o->entropy_coef, o->num_items_in_batch,
             (long long)o->max_completion_length, o->top_entropy_quantile, o->off_policy_mask_threshold,
             o->use_bias_correction_kl, p->samp != NULL, o->vllm_importance_sampling_correction,
             (int)o->vllm_importance_sampling_mode, o->vllm_importance_sampling_clip_min,
             o->vllm_importance_sampling_clip_max, o->vespo_k_pos, o->vespo_lambda_pos, o->vespo_k_neg,
             o->vespo_lambda_neg, (long long)c->tile_rows, (long long)c->tile_vocab, c->threads,
             c->train_step, (double)gp_grad_output(c), (double)c->grad_beta);
}

/* Largest differences seen (printed with FH_TEST_VERBOSE=1, to check the tolerances' margins). */
static gp_diff gp_worst;

void gp_track(const gp_diff *d)
{
#define GP_TRACK(field) gp_worst.field = d->field > gp_worst.field ? d->field : gp_worst.field
    if (d->loss_tol > 0.0 && d->loss / d->loss_tol > gp_worst.loss) /* as a fraction of its tolerance */
        gp_worst.loss = d->loss / d->loss_tol;
    GP_TRACK(metrics);
    GP_TRACK(logp);
    GP_TRACK(entropy);
    GP_TRACK(lse);
    GP_TRACK(per_token_loss);
    GP_TRACK(dx);
    GP_TRACK(dweight);
    GP_TRACK(dbias);
#undef GP_TRACK
}

void gp_print_worst(const char *suite)
{
    const char *v = getenv("FH_TEST_VERBOSE");
    if (v && strcmp(v, "1") == 0)
        fprintf(stderr,
                "\n[%s] worst: loss %.2e of its tolerance, metrics %.2e logp %.2e entropy %.2e lse %.2e ptl %.2e "
                "dx %.2e dw %.2e db %.2e\n",
                suite, gp_worst.loss, gp_worst.metrics, gp_worst.logp, gp_worst.entropy, gp_worst.lse,
                gp_worst.per_token_loss, gp_worst.dx, gp_worst.dweight, gp_worst.dbias);
    memset(&gp_worst, 0, sizeof gp_worst);
}

int gp_check(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, const char *label)
{
    char desc[512];
    gp_describe(p, o, c, desc, sizeof desc);
    gp_fused f;
    const fh_status st = gp_run_fused(p, o, c, &f);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, desc, (int)st, fh_status_string(st));
    int pass = 0;
    if (st == FH_OK) {
        gp_reference r;
        gp_diff d;
        gp_run_reference(p, o, gp_grad_output(c), c->grad_beta, &r);
        gp_measure(p, o, &f, &r, c->grad_beta, &d);
        gp_track(&d);
        pass = gp_diff_pass(&d);
        TU_CHECK(pass,
                 "%s [%s]: loss %.17g vs %.17g (diff %.2e, tol %.2e); metrics %.2e (tol %g); logp %.2e entropy %.2e "
                 "lse %.2e per_token_loss %.2e (tol %g); dx %.2e dweight %.2e dbias %.2e (tol %.3g); %lld masked dx "
                 "rows not exactly %g",
                 label, desc, f.loss, r.loss, d.loss, d.loss_tol, d.metrics, GRPO_METRIC_TOL, d.logp, d.entropy,
                 d.lse, d.per_token_loss, GP_TOKEN_TOL, d.dx, d.dweight, d.dbias, d.grad_tol,
                 (long long)d.masked_rows_touched, (double)c->grad_beta);
        gp_reference_free(&r);
    }
    gp_fused_free(&f);
    return pass;
}

void gp_options(fh_grpo_options *o, fh_grpo_loss_type type, fh_grpo_is_level level)
{
    fh_grpo_options_init(o);
    o->loss_type = type;
    o->importance_sampling_level = level;
}

int gp_clipped(fh_grpo_loss_type t)
{
    return t == FH_GRPO_LOSS_GRPO || t == FH_GRPO_LOSS_BNPO || t == FH_GRPO_LOSS_DR_GRPO || t == FH_GRPO_LOSS_DAPO ||
           t == FH_GRPO_LOSS_LUSPO;
}

int gp_pick(int k, unsigned salt, unsigned one_in)
{
    uint64_t h = ((uint64_t)(unsigned)k + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)salt * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h % one_in == 0;
}

const fh_grpo_loss_type gp_all_losses[GP_LOSS_TYPES] = {
    FH_GRPO_LOSS_GRPO,  FH_GRPO_LOSS_BNPO, FH_GRPO_LOSS_DR_GRPO, FH_GRPO_LOSS_DAPO,
    FH_GRPO_LOSS_CISPO, FH_GRPO_LOSS_SAPO, FH_GRPO_LOSS_LUSPO,   FH_GRPO_LOSS_VESPO};
const fh_grpo_is_level gp_all_levels[GP_IS_LEVELS] = {FH_GRPO_IS_TOKEN, FH_GRPO_IS_SEQUENCE};
