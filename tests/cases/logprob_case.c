/* One log-prob check (logprob_case.h).
 *
 * Tolerances. Values: logp, entropy and lse are formed in double from fp32 logits u whose GEMM rounding is about
 * eps_f32 sqrt(H) |u| (~1.5e-6 at |u| ~ 3, H = 67); s = u logit_scale / temperature carries that error times
 * logit_scale / temperature, and so do logp, H and lse. The tolerance is LOGPROB_VALUE_TOL (1e-5, about 2.5x the
 * largest error seen per unit of that factor: 4.4e-6, at temperature 0.3) times max(1, logit_scale / temperature). bf16 inputs are exact bf16 values
 * multiplied in f32 as in fp32, but the convert path and oneDNN sum in another order: LOGPROB_BF16_VALUE_TOL. Gradients: the normwise relative error of dx, dweight and dbias, as cross-entropy's
 * (CE_GRAD_NORM_REL_TOL, with ce_grad_tolerance's allowance when dU or the gradient is rounded to bf16): the
 * coefficients are the same kind of fp32 softmax terms as CE's. Over a support (fh_logprob_support_*) the same
 * tolerances, without the bf16 allowances: its logits are dot products summed in double and its dU stays f32, so a
 * bf16 case differs from the reference only by fp32 roundings, as an fp32 one. */
#include "logprob_case.h"

#include "bf16.h"
#include "ce_case.h"
#include "ref_logprob.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void logprob_case_spec_default(logprob_case_spec *spec)
{
    memset(spec, 0, sizeof *spec);
    spec->n = 97;
    spec->hidden = 67;
    spec->vocab = 3001;
    spec->layout = FH_LAYOUT_VH;
    spec->bias = 1;
    spec->ignore_frac = 0.2;
    fh_logprob_options_init(&spec->options);
    spec->g_entropy = spec->g_lse = 1;
    spec->threads = 2;
    spec->seed = 1;
}

static void *xcalloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p)
        abort(); /* test code: running out of memory is a broken test machine */
    return p;
}

static double *to_double(const float *f, size_t count)
{
    double *d = xcalloc(count, sizeof(double));
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

/* A random support per row: a counted row's target and distinct others (an ignored row's any ids, CSR possibly
 * none); in CSR 1 .. support_size ids per row, padded support_size entries with up to a third -1 among them; a
 * support_size of V is the whole vocabulary in each row. */
static void make_support(const logprob_case_spec *s, uint64_t *rng, logprob_case *in)
{
    const size_t n = (size_t)s->n, v = (size_t)s->vocab, k = (size_t)s->support_size;
    const int padded = s->support == LOGPROB_SUPPORT_PADDED;
    in->support_mask = xcalloc(n * v, 1);
    in->support_ids = xcalloc(n * k, sizeof(int64_t));
    in->support_offsets = padded ? NULL : xcalloc(n + 1, sizeof(int64_t));
    size_t e = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char *mask = in->support_mask + i * v;
        const int counted = in->targets[i] != s->options.ignore_index;
        size_t ids = padded || k == v ? k : (size_t)(ref_uniform(rng) * (double)k) + (counted ? 1 : 0);
        if (ids > k)
            ids = k;
        const size_t padding = padded && k > 1 && k < v ? (size_t)(ref_uniform(rng) * (double)(k / 3 + 1)) : 0;
        /* the first `ids - padding` of a shuffled vocabulary with the target moved first, at a random place */
        size_t listed = 0;
        if (counted && ids - padding > 0) {
            mask[in->targets[i]] = 1;
            listed = 1;
        }
        while (listed < ids - padding) {
            const size_t j = (size_t)(ref_uniform(rng) * (double)v);
            if (!mask[j]) {
                mask[j] = 1;
                listed++;
            }
        }
        const size_t first = padded ? i * k : e;
        size_t at = first;
        for (size_t j = 0; j < v; j++)
            if (mask[j])
                in->support_ids[at++] = (int64_t)j;
        while (at < first + ids)
            in->support_ids[at++] = -1;
        /* a shuffle, so that neither the target nor the padding sits at a fixed place */
        for (size_t a = ids; a > 1; a--) {
            const size_t b = (size_t)(ref_uniform(rng) * (double)a);
            const int64_t t = in->support_ids[first + a - 1];
            in->support_ids[first + a - 1] = in->support_ids[first + b];
            in->support_ids[first + b] = t;
        }
        e += ids;
        if (!padded)
            in->support_offsets[i + 1] = (int64_t)e;
        if (!counted)
            memset(mask, 0, v); /* the reference reads no support of an ignored row */
    }
}

static void make_inputs(const logprob_case_spec *s, logprob_case *in)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 7919 + 29;
    in->x = xcalloc(n * h, sizeof(float));
    in->weight = xcalloc(h * v, sizeof(float));
    in->bias = s->bias ? xcalloc(v, sizeof(float)) : NULL;
    ce_fill_linear(&rng, s->n, s->hidden, s->vocab, s->data_scale > 0.0 ? s->data_scale : 3.0, in->x, in->weight,
                   in->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        in->x_bf16 = bf16_round_in_place(in->x, n * h);
        in->weight_bf16 = bf16_round_in_place(in->weight, h * v);
    }
    in->targets = xcalloc(n, sizeof(int64_t));
    for (size_t i = 0; i < n; i++) {
        in->targets[i] = (int64_t)(ref_uniform(&rng) * (double)v);
        if (ref_uniform(&rng) < s->ignore_frac)
            in->targets[i] = s->options.ignore_index;
    }
    if (s->support != LOGPROB_FULL_VOCAB)
        make_support(s, &rng, in);
    const int given[3] = {1, s->g_entropy, s->g_lse};
    for (int k = 0; k < 3; k++) {
        in->g[k] = given[k] ? xcalloc(n, sizeof(float)) : NULL;
        for (size_t i = 0; in->g[k] && i < n; i++)
            in->g[k][i] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    }
}

void logprob_case_free(logprob_case *c)
{
    void *const arrays[] = {c->x,      c->weight,   c->bias,     c->g[0],         c->g[1],         c->g[2],
                            c->x_bf16, c->weight_bf16, c->targets, c->values,    c->grads[0],     c->grads[1],
                            c->grads[2], c->ref_values, c->ref_grads[0], c->ref_grads[1], c->ref_grads[2],
                            c->support_ids, c->support_offsets, c->support_mask};
    for (size_t k = 0; k < sizeof arrays / sizeof arrays[0]; k++)
        free(arrays[k]);
    memset(c, 0, sizeof *c);
}

/* The fused values (logp, entropy, lse: 3 n floats) and gradients (dx, dweight, dbias as ce_alloc_grads). */
static fh_status run_fused(const logprob_case_spec *s, const logprob_case *in, float *values, float *const grads[3])
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    const ce_case_settings settings = {s->threads, s->tile_rows, s->tile_vocab, s->budget, s->fp32_du, 0.0,
                                       FH_FILTER_TAIL_ESTIMATE};
    fh_context *ctx = NULL;
    fh_status st = ce_case_context(&settings, &ctx);
    if (st != FH_OK)
        return st;
    const fh_linear lin = ce_case_linear(s->n, s->hidden, s->vocab, s->layout, s->dtype, in->x, in->x_bf16, in->weight,
                                   in->weight_bf16, in->bias);
    fh_logprob_outputs out = {values, values + n, values + 2 * n};
    ce_grads_io io;
    ce_grads_io_begin(&io, s->grad_dtype, n, h, v, s->grad_beta, grads[0], grads[1], grads[2]);
    const fh_support support = {in->support_ids, in->support_offsets, s->support_size};
    if (s->support != LOGPROB_FULL_VOCAB && s->train_step) {
        st = fh_logprob_support_forward_backward(ctx, &lin, in->targets, &support, &s->options, in->g[0], in->g[1],
                                                 in->g[2], &out, &io.grads);
    } else if (s->support != LOGPROB_FULL_VOCAB) {
        st = fh_logprob_support_forward(ctx, &lin, in->targets, &support, &s->options, &out);
        if (st == FH_OK)
            st = fh_logprob_support_backward(ctx, &lin, in->targets, &support, &s->options, out.lse, out.entropy,
                                             in->g[0], in->g[1], in->g[2], &io.grads);
    } else if (s->train_step) {
        st = fh_logprob_forward_backward(ctx, &lin, in->targets, &s->options, in->g[0], in->g[1], in->g[2], &out,
                                         &io.grads);
    } else if (s->keep_logits) {
        /* NaN everywhere first: the backward reads finite logits only if the forward wrote every row. */
        float *kept = xcalloc(n * v, sizeof(float));
        for (size_t e = 0; e < n * v; e++)
            kept[e] = NAN;
        st = fh_logprob_forward_keep(ctx, &lin, in->targets, &s->options, &out, kept);
        if (st == FH_OK)
            st = fh_logprob_backward_kept(ctx, &lin, in->targets, &s->options, kept, out.lse, out.entropy, in->g[0],
                                          in->g[1], in->g[2], &io.grads);
        free(kept);
    } else {
        st = fh_logprob_forward(ctx, &lin, in->targets, &s->options, &out);
        if (st == FH_OK)
            st = fh_logprob_backward(ctx, &lin, in->targets, &s->options, out.lse, out.entropy, in->g[0], in->g[1],
                                     in->g[2], &io.grads);
    }
    ce_grads_io_finish(&io);
    fh_context_destroy(ctx);
    return st;
}

/* The reference's values (3 n doubles) and gradients (dweight in the weight's layout; beta 1 adds onto 1.0). */
static void run_reference(const logprob_case_spec *s, const logprob_case *in, double *values, double *const grads[3])
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    double *x = to_double(in->x, n * h), *w = ce_weight_to_reference(s->layout, s->hidden, s->vocab, in->weight);
    double *b = in->bias ? to_double(in->bias, v) : NULL, *dw = xcalloc(h * v, sizeof(double));
    double *g[3];
    for (int k = 0; k < 3; k++)
        g[k] = in->g[k] ? to_double(in->g[k], n) : NULL;
    const ref_linear lin = {s->n, s->hidden, s->vocab, x, w, b};
    const ref_logprob_options o = {s->options.ignore_index, s->options.temperature, s->options.softcap,
                                   s->options.logit_scale};
    const ref_logprob_grads rg = {g[0], g[1], g[2]};
    if (ref_logprob_support(&lin, in->targets, in->support_mask, &o, values, values + n, values + 2 * n, &rg, grads[0],
                            dw, grads[2]) != 0)
        abort();
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, dw, grads[1]);
    const size_t counts[3] = {n * h, h * v, b ? v : 0};
    for (int k = 0; k < 3 && s->grad_beta != 0.0f; k++)
        for (size_t i = 0; i < counts[k]; i++)
            grads[k][i] += 1.0;
    free(x);
    free(w);
    free(b);
    free(dw);
    for (int k = 0; k < 3; k++)
        free(g[k]);
}

fh_status logprob_case_run(const logprob_case_spec *s, logprob_case *c, logprob_diff *d)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    memset(c, 0, sizeof *c);
    memset(d, 0, sizeof *d);
    make_inputs(s, c);
    c->values = xcalloc(3 * n, sizeof(float));
    ce_alloc_grads(n, h, v, c->bias != NULL, s->grad_beta, &c->grads[0], &c->grads[1], &c->grads[2]);
    const fh_status st = run_fused(s, c, c->values, c->grads);
    if (st != FH_OK)
        return st;
    const float *values = c->values, *const *grads = (const float *const *)c->grads;
    c->ref_values = xcalloc(3 * n, sizeof(double));
    c->ref_grads[0] = xcalloc(n * h, sizeof(double));
    c->ref_grads[1] = xcalloc(h * v, sizeof(double));
    c->ref_grads[2] = c->bias ? xcalloc(v, sizeof(double)) : NULL;
    run_reference(s, c, c->ref_values, c->ref_grads);
    const double *ref_values = c->ref_values, *const *ref_grads = (const double *const *)c->ref_grads;
    d->logp_max_abs = ce_compare(values, ref_values, n).max_abs;
    d->entropy_max_abs = ce_compare(values + n, ref_values + n, n).max_abs;
    d->lse_max_abs = ce_compare(values + 2 * n, ref_values + 2 * n, n).max_abs;
    const int bf16_sums = s->dtype == FH_DTYPE_BF16 && s->support == LOGPROB_FULL_VOCAB;
    d->value_tol = (bf16_sums ? LOGPROB_BF16_VALUE_TOL : LOGPROB_VALUE_TOL) *
                   fmax(1.0, s->options.logit_scale / s->options.temperature);
    d->dhidden_norm_rel = ce_compare(grads[0], ref_grads[0], n * h).norm_rel;
    d->dweight_norm_rel = ce_compare(grads[1], ref_grads[1], h * v).norm_rel;
    d->dbias_norm_rel = c->bias ? ce_compare(grads[2], ref_grads[2], v).norm_rel : 0.0;
    d->grad_tol =
        ce_grad_tolerance(LOGPROB_GRAD_NORM_REL_TOL, bf16_sums && !s->fp32_du, s->grad_dtype);
    d->dbias_tol = ce_grad_tolerance(LOGPROB_GRAD_NORM_REL_TOL, 0, s->grad_dtype);
    /* Exact, not within tolerance: an ignored row's outputs are written as 0 and its dx row gets no term. */
    d->ignored_outputs_zero = 1;
    for (size_t i = 0; i < n; i++) {
        if (c->targets[i] != s->options.ignore_index)
            continue;
        d->ignored_outputs_zero &= values[i] == 0.0f && values[n + i] == 0.0f && values[2 * n + i] == 0.0f;
        for (size_t k = 0; k < h; k++)
            d->ignored_outputs_zero &= grads[0][i * h + k] == s->grad_beta;
    }
    return FH_OK;
}

void logprob_diff_describe(const logprob_case_spec *s, const logprob_diff *d, char *buffer, size_t size)
{
    static const char *const support_forms[] = {"every id", "a CSR support of up to", "a padded support of"};
    snprintf(buffer, size,
             "T %g, softcap %g, scale %g, %s, %s, g_entropy %d, g_lse %d, dtype %d, grad dtype %d, beta %g, %s %lld: "
             "logp %.2e entropy %.2e lse %.2e (tol %.1e), dx %.2e dW %.2e db %.2e (tol %.1e / %.1e), ignored rows "
             "clean %d",
             s->options.temperature, s->options.softcap, s->options.logit_scale,
             s->layout == FH_LAYOUT_HV ? "hv" : "vh", s->train_step ? "one call" : "forward+backward", s->g_entropy,
             s->g_lse, (int)s->dtype, (int)s->grad_dtype, (double)s->grad_beta, support_forms[s->support],
             (long long)(s->support == LOGPROB_FULL_VOCAB ? s->vocab : s->support_size), d->logp_max_abs,
             d->entropy_max_abs, d->lse_max_abs, d->value_tol, d->dhidden_norm_rel, d->dweight_norm_rel,
             d->dbias_norm_rel, d->grad_tol, d->dbias_tol, d->ignored_outputs_zero);
}

int logprob_diff_pass(const logprob_diff *d)
{
    return d->logp_max_abs <= d->value_tol && d->entropy_max_abs <= d->value_tol && d->lse_max_abs <= d->value_tol &&
           d->dhidden_norm_rel <= d->grad_tol && d->dweight_norm_rel <= d->grad_tol &&
           d->dbias_norm_rel <= d->dbias_tol && d->ignored_outputs_zero;
}
