#include "test_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tu_check(int ok, unsigned line, const char *file, const char *func, const char *format, ...)
{
    if (ok) {
        CU_assertImplementation(CU_TRUE, line, "", file, func, CU_FALSE);
        return;
    }
    char text[1536];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof text, format, args);
    va_end(args);
    CU_assertImplementation(CU_FALSE, line, text, file, func, CU_FALSE);
}

static const char *reduction_name(fh_reduction r)
{
    return r == FH_REDUCTION_MEAN ? "mean" : r == FH_REDUCTION_SUM ? "sum" : r == FH_REDUCTION_NONE ? "none" : "?";
}

void tu_format_spec(const ce_case_spec *s, char *buf, size_t size)
{
    snprintf(buf, size,
             "n=%lld h=%lld v=%lld layout=%s bias=%d ignore=%g ls=%g cw=%d softcap=%g z=%g red=%s threads=%d "
             "seed=%llu scale=%g tiles=%lldx%lld beta=%g train_step=%d budget=%lld",
             (long long)s->n, (long long)s->hidden, (long long)s->vocab, s->layout == FH_LAYOUT_HV ? "hv" : "vh",
             s->bias, s->ignore_frac, s->label_smoothing, s->class_weights, s->softcap, s->z_loss,
             reduction_name(s->reduction), s->threads, (unsigned long long)s->seed, s->logit_scale,
             (long long)s->tile_rows, (long long)s->tile_vocab, (double)s->grad_beta, s->train_step,
             (long long)s->budget);
}

void tu_format_metrics(const ce_metrics *m, char *buf, size_t size)
{
    snprintf(buf, size,
             "rel_loss=%.3e (tol %g) dx_norm_rel=%.3e dw_norm_rel=%.3e db_norm_rel=%.3e (tol %g) "
             "argmax_mismatches=%lld",
             m->rel_diff_loss, CE_LOSS_REL_TOL, m->dhidden_norm_rel, m->dweight_norm_rel, m->dbias_norm_rel,
             CE_GRAD_NORM_REL_TOL, (long long)m->argmax_mismatches);
}

int tu_check_spec(const ce_case_spec *spec, const char *label)
{
    ce_case c;
    ce_metrics m;
    char s[512], ms[512];
    tu_format_spec(spec, s, sizeof s);
    const fh_status st = ce_case_run(spec, &c, &m);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, s, (int)st, fh_status_string(st));
    int pass = 0;
    if (st == FH_OK) {
        pass = ce_metrics_pass(&m);
        tu_format_metrics(&m, ms, sizeof ms);
        TU_CHECK(pass, "%s [%s]: fused vs reference: %s", label, s, ms);
    }
    ce_case_free(&c);
    return pass;
}

/* ---- problems ---- */

static void *zalloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "fh_tests: out of memory\n");
        abort();
    }
    return p;
}

void tu_problem_init(tu_problem *p, int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, int flags)
{
    memset(p, 0, sizeof *p);
    p->n = n;
    p->hidden = hidden;
    p->vocab = vocab;
    p->layout = layout;
    p->x = zalloc((size_t)(n * hidden), sizeof(float));
    p->weight = zalloc((size_t)(hidden * vocab), sizeof(float));
    p->bias = flags & TU_BIAS ? zalloc((size_t)vocab, sizeof(float)) : NULL;
    p->class_weights = flags & TU_CLASS_WEIGHTS ? zalloc((size_t)vocab, sizeof(float)) : NULL;
    p->targets = zalloc((size_t)n, sizeof(int64_t));
    p->grad_output = zalloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p->grad_output[i] = 1.0f;
    for (int64_t j = 0; p->class_weights && j < vocab; j++)
        p->class_weights[j] = 1.0f;
    fh_ce_options_init(&p->options);
    p->options.class_weights = p->class_weights;
}

size_t tu_weight_index(const tu_problem *p, int64_t k, int64_t v)
{
    return (size_t)(p->layout == FH_LAYOUT_HV ? k * p->vocab + v : v * p->hidden + k);
}

void tu_problem_randomize(tu_problem *p, uint64_t seed, double logit_scale)
{
    uint64_t rng = seed * 104729 + 3;
    const int64_t n = p->n, h = p->hidden, v = p->vocab;
    for (int64_t i = 0; i < n * h; i++)
        p->x[i] = (float)(2.0 * ce_uniform(&rng) - 1.0);
    /* x ~ U(-1, 1) has variance 1/3; w ~ U(-a, a) has variance a^2/3: a = 3 scale / sqrt(h) gives logits
     * with standard deviation ~scale. */
    const double a = logit_scale * 3.0 / sqrt((double)h);
    for (int64_t i = 0; i < h * v; i++)
        p->weight[i] = (float)((2.0 * ce_uniform(&rng) - 1.0) * a);
    for (int64_t j = 0; p->bias && j < v; j++)
        p->bias[j] = (float)(ce_uniform(&rng) - 0.5);
    for (int64_t j = 0; p->class_weights && j < v; j++)
        p->class_weights[j] = (float)(0.5 + ce_uniform(&rng));
    for (int64_t i = 0; i < n; i++) {
        p->targets[i] = (int64_t)(ce_uniform(&rng) * (double)v);
        /* |g| in [0.25, 1), either sign: element 0 serves mean and sum, all of them 'none'. */
        const double u = ce_uniform(&rng);
        p->grad_output[i] = (float)((u < 0.5 ? -1.0 : 1.0) * (0.25 + 1.5 * fabs(u - 0.5)));
    }
}

void tu_problem_from_logits(tu_problem *p, int64_t n, int64_t vocab, fh_layout layout, const float *logits)
{
    tu_problem_init(p, n, n, vocab, layout, 0);
    for (int64_t i = 0; i < n; i++) {
        p->x[i * n + i] = 1.0f;
        for (int64_t j = 0; j < vocab; j++)
            p->weight[tu_weight_index(p, i, j)] = logits[i * vocab + j];
    }
}

void tu_problem_free(tu_problem *p)
{
    free(p->x);
    free(p->weight);
    free(p->bias);
    free(p->class_weights);
    free(p->targets);
    free(p->grad_output);
    memset(p, 0, sizeof *p);
}

void tu_problem_linear(const tu_problem *p, fh_linear *lin)
{
    const fh_status st = fh_linear_init(lin, p->n, p->hidden, p->vocab, p->x, p->weight, p->layout, p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init: %d", (int)st);
}

fh_context *tu_context(const tu_config *cfg)
{
    fh_context *ctx = NULL;
    fh_status st = fh_context_create(&ctx);
    TU_CHECK(st == FH_OK && ctx, "fh_context_create: %d", (int)st);
    if (!ctx)
        return NULL;
    const struct {
        fh_param param;
        int64_t value;
    } settings[] = {{FH_PARAM_THREADS, cfg->threads},
                    {FH_PARAM_TILE_ROWS, cfg->tile_rows},
                    {FH_PARAM_TILE_VOCAB, cfg->tile_vocab},
                    {FH_PARAM_MEMORY_BUDGET, cfg->memory_budget}};
    for (size_t k = 0; k < TU_COUNT(settings); k++) {
        st = fh_context_set(ctx, settings[k].param, settings[k].value);
        TU_CHECK(st == FH_OK, "fh_context_set(%d, %lld): %d", (int)settings[k].param,
                 (long long)settings[k].value, (int)st);
    }
    return ctx;
}

fh_status tu_run_fused_on(fh_context *ctx, const tu_problem *p, const tu_config *cfg, tu_fused *f)
{
    const float grad_beta = cfg->grad_beta;
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(f, 0, sizeof *f);
    f->per_token_loss = zalloc(n, sizeof(float));
    f->logp = zalloc(n, sizeof(float));
    f->lse = zalloc(n, sizeof(float));
    f->argmax = zalloc(n, sizeof(int64_t));
    f->dx = zalloc(n * h, sizeof(float));
    f->dweight = zalloc(h * v, sizeof(float));
    f->dbias = p->bias ? zalloc(v, sizeof(float)) : NULL;
    const float fill = grad_beta != 0.0f ? 1.0f : NAN;
    for (size_t i = 0; i < n * h; i++)
        f->dx[i] = fill;
    for (size_t i = 0; i < h * v; i++)
        f->dweight[i] = fill;
    for (size_t j = 0; f->dbias && j < v; j++)
        f->dbias[j] = fill;
    fh_linear lin;
    tu_problem_linear(p, &lin);
    fh_ce_outputs out = {&f->loss, &f->z_loss, f->per_token_loss, f->logp, f->lse, f->argmax};
    fh_linear_grads g = {f->dx, p->hidden, grad_beta, f->dweight, grad_beta, f->dbias, grad_beta};
    if (cfg->train_step)
        return fh_ce_forward_backward(ctx, &lin, p->targets, &p->options, p->grad_output, &out, &g);
    const fh_status st = fh_ce_forward(ctx, &lin, p->targets, &p->options, &out);
    if (st != FH_OK)
        return st;
    return fh_ce_backward(ctx, &lin, p->targets, &p->options, f->lse, p->grad_output, &g);
}

fh_status tu_run_fused(const tu_problem *p, const tu_config *cfg, tu_fused *f)
{
    fh_context *ctx = tu_context(cfg);
    const fh_status st = tu_run_fused_on(ctx, p, cfg, f);
    fh_context_destroy(ctx);
    return st;
}

void tu_fused_free(tu_fused *f)
{
    free(f->per_token_loss);
    free(f->logp);
    free(f->lse);
    free(f->argmax);
    free(f->dx);
    free(f->dweight);
    free(f->dbias);
    memset(f, 0, sizeof *f);
}

static double *to_double(const float *a, size_t count)
{
    if (!a)
        return NULL;
    double *d = zalloc(count, sizeof(double));
    for (size_t i = 0; i < count; i++)
        d[i] = a[i];
    return d;
}

void tu_run_reference(const tu_problem *p, float grad_beta, tu_reference *r)
{
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(r, 0, sizeof *r);
    double *x = to_double(p->x, n * h), *w = zalloc(h * v, sizeof(double));
    for (int64_t k = 0; k < p->hidden; k++)
        for (int64_t j = 0; j < p->vocab; j++)
            w[k * p->vocab + j] = p->weight[tu_weight_index(p, k, j)];
    double *b = to_double(p->bias, v), *cw = to_double(p->class_weights, v), *g = to_double(p->grad_output, n);
    const ref_linear lin = {p->n, p->hidden, p->vocab, x, w, b};
    const ref_ce_options o = {p->options.ignore_index, (int)p->options.reduction, p->options.label_smoothing, cw,
                              p->options.softcap, p->options.z_loss};
    r->per_token_loss = zalloc(n, sizeof(double));
    r->logp = zalloc(n, sizeof(double));
    r->lse = zalloc(n, sizeof(double));
    r->argmax = zalloc(n, sizeof(int64_t));
    ref_ce_result res = {0, 0, r->per_token_loss, r->logp, r->lse, r->argmax};
    int rc = ref_ce_forward(&lin, p->targets, &o, &res);
    r->loss = res.loss;
    r->z_loss = res.z_loss;
    r->dx = zalloc(n * h, sizeof(double));
    r->dbias = b ? zalloc(v, sizeof(double)) : NULL;
    double *dw = zalloc(h * v, sizeof(double));
    rc |= ref_ce_backward(&lin, p->targets, &o, g, r->dx, dw, r->dbias);
    TU_CHECK(rc == 0, "the reference ran out of memory");
    r->dweight = zalloc(h * v, sizeof(double));
    for (int64_t k = 0; k < p->hidden; k++)
        for (int64_t j = 0; j < p->vocab; j++)
            r->dweight[tu_weight_index(p, k, j)] = dw[k * p->vocab + j];
    if (grad_beta != 0.0f) {
        for (size_t i = 0; i < n * h; i++)
            r->dx[i] += 1.0;
        for (size_t i = 0; i < h * v; i++)
            r->dweight[i] += 1.0;
        for (size_t j = 0; r->dbias && j < v; j++)
            r->dbias[j] += 1.0;
    }
    free(x);
    free(w);
    free(b);
    free(cw);
    free(g);
    free(dw);
}

void tu_reference_free(tu_reference *r)
{
    free(r->per_token_loss);
    free(r->logp);
    free(r->lse);
    free(r->argmax);
    free(r->dx);
    free(r->dweight);
    free(r->dbias);
    memset(r, 0, sizeof *r);
}

double tu_logit(const tu_problem *p, int64_t i, int64_t j)
{
    double u = p->bias ? p->bias[j] : 0.0;
    for (int64_t k = 0; k < p->hidden; k++)
        u += (double)p->x[i * p->hidden + k] * p->weight[tu_weight_index(p, k, j)];
    const double c = p->options.softcap;
    return c > 0.0 ? c * tanh(u / c) : u;
}

/* Normwise relative difference (absolute when the reference is zero); NaN anywhere gives NaN. */
static double norm_rel(const float *f, const double *r, size_t count)
{
    double sd = 0.0, sr = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = (double)f[i] - r[i];
        sd += e * e;
        sr += r[i] * r[i];
    }
    return sr > 0.0 ? sqrt(sd) / sqrt(sr) : sqrt(sd);
}

void tu_measure(const tu_problem *p, const tu_fused *f, const tu_reference *r, ce_metrics *m)
{
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(m, 0, sizeof *m);
    m->abs_diff_loss = fabs(f->loss - r->loss);
    m->rel_diff_loss = fabs(r->loss) > 0.0 ? m->abs_diff_loss / fabs(r->loss) : m->abs_diff_loss;
    if (isnan(f->loss))
        m->rel_diff_loss = NAN;
    m->abs_diff_z_loss = fabs(f->z_loss - r->z_loss);
    m->per_token_loss_max_abs = tu_max_abs_diff(f->per_token_loss, r->per_token_loss, n);
    m->logp_max_abs = tu_max_abs_diff(f->logp, r->logp, n);
    m->lse_max_abs = tu_max_abs_diff(f->lse, r->lse, n);
    m->dhidden_max_abs = tu_max_abs_diff(f->dx, r->dx, n * h);
    m->dhidden_norm_rel = norm_rel(f->dx, r->dx, n * h);
    m->dweight_max_abs = tu_max_abs_diff(f->dweight, r->dweight, h * v);
    m->dweight_norm_rel = norm_rel(f->dweight, r->dweight, h * v);
    if (f->dbias)
        m->dbias_norm_rel = norm_rel(f->dbias, r->dbias, v);
    /* Same rule as ce_case: the fused argmax must be maximal up to fp32 rounding of the logits. */
    for (int64_t i = 0; i < p->n; i++) {
        const int64_t a = f->argmax[i], b = r->argmax[i];
        if (a < 0 || a >= p->vocab)
            m->argmax_mismatches++;
        else if (a != b) {
            const double za = tu_logit(p, i, a), zb = tu_logit(p, i, b);
            if (za < zb - 1e-5 * (1.0 + fabs(zb)))
                m->argmax_mismatches++;
        }
    }
}

int tu_check_against_reference(const tu_problem *p, const tu_config *cfg, const char *label)
{
    tu_fused f;
    tu_reference r;
    ce_metrics m;
    char ms[512];
    const fh_status st = tu_run_fused(p, cfg, &f);
    const char *how = cfg->train_step ? " [train step]" : "";
    TU_CHECK(st == FH_OK, "%s%s: status %d (%s)", label, how, (int)st, fh_status_string(st));
    int pass = 0;
    if (st == FH_OK) {
        tu_run_reference(p, cfg->grad_beta, &r);
        tu_measure(p, &f, &r, &m);
        pass = ce_metrics_pass(&m);
        tu_format_metrics(&m, ms, sizeof ms);
        TU_CHECK(pass, "%s%s: fused vs reference: %s", label, how, ms);
        tu_reference_free(&r);
    }
    tu_fused_free(&f);
    return pass;
}

int tu_all_finite_f(const float *a, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

int tu_all_equal_f(const float *a, size_t count, float value)
{
    for (size_t i = 0; i < count; i++)
        if (!(a[i] == value))
            return 0;
    return 1;
}

double tu_max_abs_diff(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)f[i] - r[i]);
        if (e > m || isnan(e))
            m = e;
        if (isnan(m))
            return m;
    }
    return m;
}

double tu_max_abs_d(const double *a, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++)
        m = fabs(a[i]) > m ? fabs(a[i]) : m;
    return m;
}

static int is_alnum(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

int tu_mentions(const char *text, const char *word)
{
    for (const char *s = text; (s = strstr(s, word)) != NULL; s++)
        if (s == text || !is_alnum(s[-1]))
            return 1;
    return 0;
}
