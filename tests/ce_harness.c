#include "ce_harness.h"

#include "bf16.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *reduction_name(fh_reduction r)
{
    return r == FH_REDUCTION_MEAN ? "mean" : r == FH_REDUCTION_SUM ? "sum" : r == FH_REDUCTION_NONE ? "none" : "?";
}

void cp_format_spec(const ce_case_spec *s, char *buf, size_t size)
{
    snprintf(buf, size,
             "n=%lld h=%lld v=%lld layout=%s bias=%d ignore=%g ls=%g cw=%d softcap=%g z=%g red=%s threads=%d "
             "seed=%llu scale=%g tiles=%lldx%lld beta=%g train_step=%d budget=%lld logit_scale=%g "
             "token_scaling=%d entropy=%d dtype=%s",
             (long long)s->n, (long long)s->hidden, (long long)s->vocab, s->layout == FH_LAYOUT_HV ? "hv" : "vh",
             s->bias, s->ignore_frac, s->label_smoothing, s->class_weights, s->softcap, s->z_loss,
             reduction_name(s->reduction), s->threads, (unsigned long long)s->seed, s->logit_scale,
             (long long)s->tile_rows, (long long)s->tile_vocab, (double)s->grad_beta, s->train_step,
             (long long)s->budget, s->ce_logit_scale, s->token_scaling, s->entropy,
             s->dtype == FH_DTYPE_BF16 ? "bf16" : "f32");
}

void cp_format_metrics(const ce_metrics *m, char *buf, size_t size)
{
    snprintf(buf, size,
             "rel_loss=%.3e (tol %g) dx_norm_rel=%.3e dw_norm_rel=%.3e db_norm_rel=%.3e (tol %g) "
             "argmax_mismatches=%lld correct_mismatch=%lld entropy_max_abs=%.3e (tol %g)",
             m->rel_diff_loss, m->loss_rel_tol, m->dhidden_norm_rel, m->dweight_norm_rel, m->dbias_norm_rel,
             m->grad_norm_rel_tol, (long long)m->argmax_mismatches, (long long)m->correct_mismatch,
             m->entropy_max_abs, m->entropy_tol);
}

int cp_check_spec(const ce_case_spec *spec, const char *label)
{
    return cp_check_spec_stats(spec, label, NULL);
}

int cp_check_spec_stats(const ce_case_spec *spec, const char *label, fh_filter_stats *filter_stats)
{
    ce_case c;
    ce_metrics m;
    char s[512], ms[512];
    cp_format_spec(spec, s, sizeof s);
    const fh_status st = ce_case_run(spec, &c, &m);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, s, (int)st, fh_status_string(st));
    int pass = 0;
    if (st == FH_OK) {
        pass = ce_metrics_pass(&m);
        cp_format_metrics(&m, ms, sizeof ms);
        TU_CHECK(pass, "%s [%s]: fused vs reference: %s", label, s, ms);
        if (filter_stats)
            *filter_stats = c.filter_stats;
    }
    ce_case_free(&c);
    return pass;
}

/* ---- problems ---- */

void cp_problem_init(cp_problem *p, int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, int flags)
{
    memset(p, 0, sizeof *p);
    p->n = n;
    p->hidden = hidden;
    p->vocab = vocab;
    p->layout = layout;
    p->x = tu_alloc((size_t)(n * hidden), sizeof(float));
    p->weight = tu_alloc((size_t)(hidden * vocab), sizeof(float));
    p->bias = flags & CP_BIAS ? tu_alloc((size_t)vocab, sizeof(float)) : NULL;
    p->class_weights = flags & CP_CLASS_WEIGHTS ? tu_alloc((size_t)vocab, sizeof(float)) : NULL;
    p->targets = tu_alloc((size_t)n, sizeof(int64_t));
    p->grad_output = tu_alloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p->grad_output[i] = 1.0f;
    for (int64_t j = 0; p->class_weights && j < vocab; j++)
        p->class_weights[j] = 1.0f;
    fh_ce_options_init(&p->options);
    p->options.class_weights = p->class_weights;
}

size_t cp_weight_index(const cp_problem *p, int64_t k, int64_t v)
{
    return (size_t)(p->layout == FH_LAYOUT_HV ? k * p->vocab + v : v * p->hidden + k);
}

void cp_problem_randomize(cp_problem *p, uint64_t seed, double logit_scale)
{
    uint64_t rng = seed * 104729 + 3;
    const int64_t n = p->n, h = p->hidden, v = p->vocab;
    for (int64_t i = 0; i < n * h; i++)
        p->x[i] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    /* x ~ U(-1, 1) has variance 1/3; w ~ U(-a, a) has variance a^2/3: a = 3 scale / sqrt(h) gives logits
     * with standard deviation ~scale. */
    const double a = logit_scale * 3.0 / sqrt((double)h);
    for (int64_t i = 0; i < h * v; i++)
        p->weight[i] = (float)((2.0 * ref_uniform(&rng) - 1.0) * a);
    for (int64_t j = 0; p->bias && j < v; j++)
        p->bias[j] = (float)(ref_uniform(&rng) - 0.5);
    for (int64_t j = 0; p->class_weights && j < v; j++)
        p->class_weights[j] = (float)(0.5 + ref_uniform(&rng));
    for (int64_t i = 0; i < n; i++) {
        p->targets[i] = (int64_t)(ref_uniform(&rng) * (double)v);
        /* |g| in [0.25, 1), either sign: element 0 serves mean and sum, all of them 'none'. */
        const double u = ref_uniform(&rng);
        p->grad_output[i] = (float)((u < 0.5 ? -1.0 : 1.0) * (0.25 + 1.5 * fabs(u - 0.5)));
    }
}

void cp_problem_from_logits(cp_problem *p, int64_t n, int64_t vocab, fh_layout layout, const float *logits)
{
    cp_problem_init(p, n, n, vocab, layout, 0);
    for (int64_t i = 0; i < n; i++) {
        p->x[i * n + i] = 1.0f;
        for (int64_t j = 0; j < vocab; j++)
            p->weight[cp_weight_index(p, i, j)] = logits[i * vocab + j];
    }
}

void cp_problem_free(cp_problem *p)
{
    free(p->x);
    free(p->weight);
    free(p->bias);
    free(p->class_weights);
    free(p->targets);
    free(p->grad_output);
    free(p->x_bf16);
    free(p->weight_bf16);
    memset(p, 0, sizeof *p);
}

void cp_problem_use_bf16(cp_problem *p)
{
    p->x_bf16 = bf16_round_in_place(p->x, (size_t)(p->n * p->hidden));
    p->weight_bf16 = bf16_round_in_place(p->weight, (size_t)(p->hidden * p->vocab));
    TU_CHECK(p->x_bf16 && p->weight_bf16, "bf16 copies: out of memory");
}

void cp_problem_linear(const cp_problem *p, fh_linear *lin)
{
    const int bf16 = p->x_bf16 != NULL;
    const fh_status st = fh_linear_init(lin, p->n, p->hidden, p->vocab, bf16 ? (const void *)p->x_bf16 : p->x,
                                        bf16 ? (const void *)p->weight_bf16 : p->weight, p->layout, p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init: %d", (int)st);
    lin->x_dtype = lin->weight_dtype = bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
}

fh_context *cp_context(const cp_config *cfg)
{
    return tu_context(cfg->threads, cfg->tile_rows, cfg->tile_vocab, cfg->memory_budget);
}

fh_status cp_run_fused_on(fh_context *ctx, const cp_problem *p, const cp_config *cfg, cp_fused *f)
{
    const float grad_beta = cfg->grad_beta;
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(f, 0, sizeof *f);
    f->per_token_loss = tu_alloc(n, sizeof(float));
    f->logp = tu_alloc(n, sizeof(float));
    f->lse = tu_alloc(n, sizeof(float));
    f->argmax = tu_alloc(n, sizeof(int64_t));
    ce_alloc_grads(n, h, v, p->bias != NULL, grad_beta, &f->dx, &f->dweight, &f->dbias);
    fh_linear lin;
    cp_problem_linear(p, &lin);
    fh_ce_outputs out = {&f->loss, &f->z_loss, f->per_token_loss, f->logp, f->lse, f->argmax, NULL, &f->correct};
    fh_linear_grads g = {.dx = f->dx, .dx_row_stride = p->hidden, .dx_beta = grad_beta, .dweight = f->dweight, .dweight_beta = grad_beta, .dbias = f->dbias, .dbias_beta = grad_beta};
    if (cfg->train_step)
        return fh_ce_forward_backward(ctx, &lin, p->targets, &p->options, p->grad_output, &out, &g);
    const fh_status st = fh_ce_forward(ctx, &lin, p->targets, &p->options, &out);
    if (st != FH_OK)
        return st;
    return fh_ce_backward(ctx, &lin, p->targets, &p->options, f->lse, p->grad_output, &g);
}

fh_status cp_run_fused(const cp_problem *p, const cp_config *cfg, cp_fused *f)
{
    fh_context *ctx = cp_context(cfg);
    const fh_status st = cp_run_fused_on(ctx, p, cfg, f);
    fh_context_destroy(ctx);
    return st;
}

void cp_fused_free(cp_fused *f)
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

/* The problem's options as the reference takes them (class weights in double: cw). */
static ref_ce_options reference_options(const cp_problem *p, const double *cw)
{
    const fh_ce_options *f = &p->options;
    const ref_ce_options o = {.ignore_index = f->ignore_index,
                              .reduction = (int)f->reduction,
                              .label_smoothing = f->label_smoothing,
                              .class_weights = cw,
                              .softcap = f->softcap,
                              .z_loss = f->z_loss,
                              .logit_scale = f->logit_scale,
                              .token_scaling = f->token_scaling};
    return o;
}

void cp_run_reference(const cp_problem *p, float grad_beta, cp_reference *r)
{
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(r, 0, sizeof *r);
    double *x = tu_doubles(p->x, n * h), *w = ce_weight_to_reference(p->layout, p->hidden, p->vocab, p->weight);
    double *b = tu_doubles(p->bias, v), *cw = tu_doubles(p->class_weights, v), *g = tu_doubles(p->grad_output, n);
    const ref_linear lin = {p->n, p->hidden, p->vocab, x, w, b};
    const ref_ce_options o = reference_options(p, cw);
    r->per_token_loss = tu_alloc(n, sizeof(double));
    r->logp = tu_alloc(n, sizeof(double));
    r->lse = tu_alloc(n, sizeof(double));
    r->argmax = tu_alloc(n, sizeof(int64_t));
    ref_ce_result res = {0, 0, r->per_token_loss, r->logp, r->lse, NULL, r->argmax, 0};
    int rc = ref_ce_forward(&lin, p->targets, &o, &res);
    r->loss = res.loss;
    r->z_loss = res.z_loss;
    r->correct = res.correct;
    r->dx = tu_alloc(n * h, sizeof(double));
    r->dbias = b ? tu_alloc(v, sizeof(double)) : NULL;
    double *dw = tu_alloc(h * v, sizeof(double));
    rc |= ref_ce_backward(&lin, p->targets, &o, g, r->dx, dw, r->dbias);
    TU_CHECK(rc == 0, "the reference ran out of memory");
    r->dweight = tu_alloc(h * v, sizeof(double));
    ce_weight_from_reference(p->layout, p->hidden, p->vocab, dw, r->dweight);
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

void cp_reference_free(cp_reference *r)
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

int cp_run_fused_and_reference(const cp_problem *p, const cp_config *cfg, const char *label, cp_fused *f,
                               cp_reference *r)
{
    const fh_status st = cp_run_fused(p, cfg, f);
    TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
    if (st != FH_OK) {
        cp_fused_free(f);
        return 0;
    }
    cp_run_reference(p, cfg->grad_beta, r);
    return 1;
}

double cp_logit(const cp_problem *p, int64_t i, int64_t j)
{
    double u = p->bias ? p->bias[j] : 0.0;
    for (int64_t k = 0; k < p->hidden; k++)
        u += (double)p->x[i * p->hidden + k] * p->weight[cp_weight_index(p, k, j)];
    const ref_ce_options o = reference_options(p, NULL);
    return ref_ce_transform(&o, u, NULL);
}

static double problem_logit(const void *self, int64_t i, int64_t j)
{
    return cp_logit(self, i, j);
}

void cp_measure(const cp_problem *p, const cp_fused *f, const cp_reference *r, ce_metrics *m)
{
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(m, 0, sizeof *m);
    /* the harness's problems are fp32 */
    m->loss_rel_tol = ce_loss_tolerance(p->options.token_scaling);
    m->grad_norm_rel_tol = m->dbias_norm_rel_tol = ce_fp32_grad_tolerance(p->options.token_scaling);
    m->abs_diff_loss = fabs(f->loss - r->loss);
    m->rel_diff_loss = fabs(r->loss) > 0.0 ? m->abs_diff_loss / fabs(r->loss) : m->abs_diff_loss;
    if (isnan(f->loss))
        m->rel_diff_loss = NAN;
    m->abs_diff_z_loss = fabs(f->z_loss - r->z_loss);
    m->per_token_loss_max_abs = tu_max_abs_diff(f->per_token_loss, r->per_token_loss, n);
    m->logp_max_abs = tu_max_abs_diff(f->logp, r->logp, n);
    m->lse_max_abs = tu_max_abs_diff(f->lse, r->lse, n);
    m->dhidden_max_abs = tu_max_abs_diff(f->dx, r->dx, n * h);
    m->dhidden_norm_rel = ce_compare(f->dx, r->dx, n * h).norm_rel;
    m->dweight_max_abs = tu_max_abs_diff(f->dweight, r->dweight, h * v);
    m->dweight_norm_rel = ce_compare(f->dweight, r->dweight, h * v).norm_rel;
    if (f->dbias)
        m->dbias_norm_rel = ce_compare(f->dbias, r->dbias, v).norm_rel;
    const ce_argmax_check k = {p->n, p->vocab, p->options.ignore_index, p->targets, f->argmax, r->argmax, f->correct,
                               problem_logit, p};
    ce_measure_argmax(&k, m);
}

int cp_check_against_reference(const cp_problem *p, const cp_config *cfg, const char *label)
{
    cp_fused f;
    cp_reference r;
    ce_metrics m;
    char ms[512];
    const fh_status st = cp_run_fused(p, cfg, &f);
    const char *how = cfg->train_step ? " [train step]" : "";
    TU_CHECK(st == FH_OK, "%s%s: status %d (%s)", label, how, (int)st, fh_status_string(st));
    int pass = 0;
    if (st == FH_OK) {
        cp_run_reference(p, cfg->grad_beta, &r);
        cp_measure(p, &f, &r, &m);
        pass = ce_metrics_pass(&m);
        cp_format_metrics(&m, ms, sizeof ms);
        TU_CHECK(pass, "%s%s: fused vs reference: %s", label, how, ms);
        cp_reference_free(&r);
    }
    cp_fused_free(&f);
    return pass;
}
