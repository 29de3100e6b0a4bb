/* Inputs are drawn so that logits have a controlled typical magnitude (logit_scale), the regime where
 * fp32 GEMM rounding is ~sqrt(H) * 2^-24 relative per logit. Tolerances:
 *   loss: relative 1e-6. Per-token losses carry independent fp32 logit errors of about
 *     sqrt(H) * 6e-8 * |z| (~1e-6 at H = 129, |z| = 3); the mean averages them down, and the double
 *     accumulation adds nothing, so 1e-6 on the reduced loss leaves a margin of 10x or more.
 *   gradients: normwise (Frobenius) relative 1e-5. dU = (p - onehot) scaled, with p = exp(z - lse)
 *     evaluated in fp32 (relative error ~|z - lse| * 6e-8 plus the logit error), then two fp32 GEMMs
 *     whose rounding is ~sqrt(K) * 6e-8 normwise; 1e-5 is ~10x above what these add up to.
 * bf16 cases round x and weight to bf16 first, and the reference computes on those values: products of
 * bf16 values are exact in fp32 and accumulate in fp32, so the loss tolerance is the fp32 one. The gradient
 * GEMMs read dU rounded once to bf16 (what torch's bf16 autograd does). bf16 keeps 8 significant bits, so
 * each element moves by at most its unit roundoff 2^-8 ~ 3.9e-3 relative, and ||dU_bf16 - dU|| <= 2^-8 ||dU||
 * normwise; the GEMMs carry that normwise error into dx and dweight (random rounding errors partly cancel:
 * fh_gradcheck measures 1.3e-3 to 1.8e-3, the higher with label smoothing). CE_BF16_GRAD_NORM_REL_TOL = 4e-3
 * is that 2^-8 bound, 2.2x above the largest measured error. dbias sums the fp32 dU and keeps the fp32
 * tolerance. With FH_PARAM_FP32_DU the gradient GEMMs multiply the f32 dU by the exact f32 values of the bf16
 * inputs, so the fp32 tolerance holds. A gradient written in bf16 is rounded once more at the end: each element
 * moves by at most 2^-8 relative, the norm of the difference by at most 2^-8 of the norm, so that rounding adds
 * CE_BF16_GRAD_NORM_REL_TOL to the tolerance.
 * token_scaling (DFT) multiplies each token's loss and its gradient row by p_y = exp(log p_y), computed from the fp32
 * logits: its relative error is the absolute error of log p_y = z_y - lse, at most 2 max_j |dz_j| with dz the logit
 * error, ~sqrt(H) * 6e-8 * |z| per logit and 3 sigma over a row's thousands: 1.6e-5 at H = 129 and |z| ~ 7.5 (logits
 * of size 3 times logit_scale 2.5; fh_gradcheck measures log p errors up to 2.0e-5 there). The p_y-weighted sum is
 * dominated by the few confident tokens, so these errors are not averaged down as the plain mean's are:
 * CE_DFT_REL_TOL = 4e-5, 2 max |dz| at that size, is added to the loss's and the gradients' tolerances (measured: loss
 * 6.5e-6, gradients 9.2e-6 normwise at that size; 4.6e-7 and 1.9e-6 at |z| ~ 3).
 * entropy: H = lse - sum_j p_j z_j from the same fp32 logits; to first order its error is sum_j p_j (z_j - zbar) dz_j,
 * at most max |dz| times the spread sum_j p_j |z_j - zbar| (zbar = sum p z), which is at most about the logits'
 * standard deviation: ~1.6e-5 x 1.5 at the size above (the softmax is peaked there) and ~5e-6 x 3 at |z| ~ 3.
 * CE_ENTROPY_ABS_TOL = 5e-5 per token is twice that; measured at most 8.4e-6 (fh_gradcheck, fp32 and bf16, with and
 * without softcap and logit_scale). */
#include "ce_case.h"

#include "bf16.h"
#include "ref_ce.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ce_case_spec_default(ce_case_spec *spec)
{
    const ce_case_spec d = {.n = 7, .hidden = 5, .vocab = 11, .layout = FH_LAYOUT_HV, .seed = 1};
    *spec = d;
}

static void *xcalloc(size_t count, size_t size)
{
    return calloc(count ? count : 1, size);
}

static double *to_double(const float *f, size_t count)
{
    double *d = xcalloc(count, sizeof *d);
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

size_t ce_weight_index(fh_layout layout, int64_t hidden, int64_t vocab, int64_t k, int64_t j)
{
    return (size_t)(layout == FH_LAYOUT_HV ? k * vocab + j : j * hidden + k);
}

double *ce_weight_to_reference(fh_layout layout, int64_t hidden, int64_t vocab, const float *weight)
{
    double *w = xcalloc((size_t)(hidden * vocab), sizeof(double));
    for (int64_t k = 0; k < hidden; k++)
        for (int64_t j = 0; j < vocab; j++)
            w[k * vocab + j] = weight[ce_weight_index(layout, hidden, vocab, k, j)];
    return w;
}

void ce_weight_from_reference(fh_layout layout, int64_t hidden, int64_t vocab, const double *reference, double *out)
{
    for (int64_t k = 0; k < hidden; k++)
        for (int64_t j = 0; j < vocab; j++)
            out[ce_weight_index(layout, hidden, vocab, k, j)] = reference[k * vocab + j];
}

static size_t widx(const ce_case_spec *s, int64_t k, int64_t v)
{
    return ce_weight_index(s->layout, s->hidden, s->vocab, k, v);
}

void ce_fill_linear(uint64_t *rng, int64_t n, int64_t h, int64_t v, double logit_scale, float *x, float *weight,
                    float *bias)
{
    for (int64_t i = 0; i < n * h; i++)
        x[i] = (float)(2.0 * ref_uniform(rng) - 1.0);
    /* x_k ~ U(-1,1) has variance 1/3 and w ~ U(-a, a) has a^2/3: a = 3 scale / sqrt(h) gives std ~scale. */
    const double a = 3.0 * logit_scale / sqrt((double)h);
    for (int64_t i = 0; i < h * v; i++)
        weight[i] = (float)((2.0 * ref_uniform(rng) - 1.0) * a);
    for (int64_t j = 0; bias && j < v; j++)
        bias[j] = (float)(ref_uniform(rng) - 0.5);
}

void ce_alloc_grads(size_t n, size_t h, size_t v, int has_bias, float beta, float **dx, float **dweight,
                    float **dbias)
{
    const float fill = beta != 0.0f ? 1.0f : NAN;
    float **const buffers[3] = {dx, dweight, dbias};
    const size_t counts[3] = {n * h, h * v, has_bias ? v : 0};
    for (int k = 0; k < 3; k++) {
        *buffers[k] = k == 2 && !has_bias ? NULL : xcalloc(counts[k], sizeof(float));
        for (size_t i = 0; *buffers[k] && i < counts[k]; i++)
            (*buffers[k])[i] = fill;
    }
}

double ce_loss_tolerance(int token_scaling)
{
    return CE_LOSS_REL_TOL + (token_scaling ? CE_DFT_REL_TOL : 0.0);
}

double ce_fp32_grad_tolerance(int token_scaling)
{
    return CE_GRAD_NORM_REL_TOL + (token_scaling ? CE_DFT_REL_TOL : 0.0);
}

double ce_grad_tolerance(double fp32_tol, int du_rounded, fh_dtype grad_dtype)
{
    return (du_rounded ? CE_BF16_GRAD_NORM_REL_TOL : fp32_tol) +
           (grad_dtype == FH_DTYPE_BF16 ? CE_BF16_GRAD_NORM_REL_TOL : 0.0);
}

void ce_grads_io_begin(ce_grads_io *io, fh_dtype dtype, size_t n, size_t h, size_t v, float beta, float *dx,
                       float *dweight, float *dbias)
{
    memset(io, 0, sizeof *io);
    float *const values[3] = {dx, dweight, dbias};
    const size_t counts[3] = {n * h, h * v, v};
    void *given[3];
    for (int k = 0; k < 3; k++) {
        io->values[k] = values[k];
        io->counts[k] = counts[k];
        given[k] = values[k];
        if (dtype == FH_DTYPE_BF16 && values[k]) {
            io->bits[k] = xcalloc(counts[k], sizeof(uint16_t));
            for (size_t i = 0; i < counts[k]; i++)
                io->bits[k][i] = bf16_from_float(values[k][i]);
            given[k] = io->bits[k];
        }
    }
    const fh_linear_grads g = {.dx = given[0], .dx_row_stride = (int64_t)h, .dx_beta = beta, .dweight = given[1],
                               .dweight_beta = beta, .dbias = given[2], .dbias_beta = beta, .dx_dtype = dtype,
                               .dweight_dtype = dtype, .dbias_dtype = dtype};
    io->grads = g;
}

void ce_grads_io_finish(ce_grads_io *io)
{
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; io->bits[k] && i < io->counts[k]; i++)
            io->values[k][i] = bf16_to_float(io->bits[k][i]);
        free(io->bits[k]);
        io->bits[k] = NULL;
    }
}

static void make_inputs(const ce_case_spec *s, ce_case *c)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 7919 + 17;
    const double scale = s->logit_scale > 0.0 ? s->logit_scale : 3.0;
    c->x = xcalloc(n * h, sizeof(float));
    c->weight = xcalloc(h * v, sizeof(float));
    c->targets = xcalloc(n, sizeof(int64_t));
    c->grad_output = xcalloc(n, sizeof(float));
    if (s->bias)
        c->bias = xcalloc(v, sizeof(float));
    ce_fill_linear(&rng, s->n, s->hidden, s->vocab, scale, c->x, c->weight, c->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        c->x_bf16 = bf16_round_in_place(c->x, n * h);
        c->weight_bf16 = bf16_round_in_place(c->weight, h * v);
    }
    if (s->class_weights) {
        c->class_weights = xcalloc(v, sizeof(float));
        for (size_t j = 0; j < v; j++)
            c->class_weights[j] = (float)(0.5 + ref_uniform(&rng));
    }
    for (size_t i = 0; i < n; i++) {
        c->targets[i] = (int64_t)(ref_uniform(&rng) * (double)v);
        if (ref_uniform(&rng) < s->ignore_frac)
            c->targets[i] = -100;
    }
    for (size_t i = 0; i < n; i++)
        c->grad_output[i] = (float)(s->reduction == FH_REDUCTION_NONE ? 2.0 * ref_uniform(&rng) - 1.0 : 0.75);
}

static double ce_logit_scale_of(const ce_case_spec *s)
{
    return s->ce_logit_scale > 0.0 ? s->ce_logit_scale : 1.0;
}

fh_status ce_case_context(const ce_case_settings *settings, fh_context **ctx)
{
    const fh_status st = fh_context_create(ctx);
    if (st != FH_OK)
        return st;
    fh_context_set(*ctx, FH_PARAM_THREADS, settings->threads);
    fh_context_set(*ctx, FH_PARAM_TILE_ROWS, settings->tile_rows);
    fh_context_set(*ctx, FH_PARAM_TILE_VOCAB, settings->tile_vocab);
    fh_context_set(*ctx, FH_PARAM_MEMORY_BUDGET, settings->budget);
    fh_context_set(*ctx, FH_PARAM_FP32_DU, settings->fp32_du);
    fh_context_set_real(*ctx, FH_PARAM_GRAD_FILTER_EPS, settings->grad_filter_eps);
    fh_context_set(*ctx, FH_PARAM_GRAD_FILTER_TAIL, settings->grad_filter_tail);
    return FH_OK;
}

fh_linear ce_case_linear(int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, fh_dtype dtype, const float *x,
                         const uint16_t *x_bf16, const float *weight, const uint16_t *weight_bf16, const float *bias)
{
    const int bf16 = dtype == FH_DTYPE_BF16;
    fh_linear lin;
    fh_linear_init(&lin, n, hidden, vocab, bf16 ? (const void *)x_bf16 : x, bf16 ? (const void *)weight_bf16 : weight,
                   layout, bias);
    lin.x_dtype = lin.weight_dtype = dtype;
    return lin;
}

static fh_status run_fused(const ce_case_spec *s, ce_case *c)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    const ce_case_settings settings = {s->threads,  s->tile_rows,       s->tile_vocab,       s->budget,
                                       s->fp32_du, s->grad_filter_eps, s->grad_filter_tail};
    fh_context *ctx = NULL;
    fh_status st = ce_case_context(&settings, &ctx);
    if (st != FH_OK)
        return st;
    const fh_linear lin = ce_case_linear(s->n, s->hidden, s->vocab, s->layout, s->dtype, c->x, c->x_bf16, c->weight,
                                   c->weight_bf16, c->bias);
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.reduction = s->reduction;
    o.label_smoothing = s->label_smoothing;
    o.class_weights = c->class_weights;
    o.softcap = s->softcap;
    o.z_loss = s->z_loss;
    o.logit_scale = ce_logit_scale_of(s);
    o.token_scaling = s->token_scaling;
    c->per_token_loss = xcalloc(n, sizeof(float));
    c->logp = xcalloc(n, sizeof(float));
    c->lse = xcalloc(n, sizeof(float));
    c->argmax = xcalloc(n, sizeof(int64_t));
    c->entropy = s->entropy ? xcalloc(n, sizeof(float)) : NULL;
    fh_ce_outputs out = {&c->loss, &c->z_loss, c->per_token_loss, c->logp, c->lse, c->argmax, c->entropy,
                         &c->correct};
    ce_alloc_grads(n, h, v, c->bias != NULL, s->grad_beta, &c->dx, &c->dweight, &c->dbias);
    ce_grads_io io;
    ce_grads_io_begin(&io, s->grad_dtype, n, h, v, s->grad_beta, c->dx, c->dweight, c->dbias);
    if (s->train_step) {
        st = fh_ce_forward_backward(ctx, &lin, c->targets, &o, c->grad_output, &out, &io.grads);
    } else {
        st = fh_ce_forward(ctx, &lin, c->targets, &o, &out);
        if (st == FH_OK)
            st = fh_ce_backward(ctx, &lin, c->targets, &o, c->lse, c->grad_output, &io.grads);
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

/* The tiles of the fused backward, for the reference's filter: the library's row blocks (balanced heights; bf16
 * ones of at most 256 rows, with dweight after the blocks) over the whole vocabulary, or its streaming tiles
 * (default 1024 rows x 2048 columns). The default budget holds them for the cases the tests run. */
static ref_filter filter_of(const ce_case_spec *s)
{
    const int bf16_du = s->dtype == FH_DTYPE_BF16 && !s->fp32_du, row_blocks = s->train_step && !s->fp32_du;
    ref_filter f = {s->grad_filter_eps, 0, row_blocks && bf16_du, s->softcap > 0.0, 0,
                    s->grad_filter_tail == FH_FILTER_TAIL_DROP};
    if (row_blocks) {
        const int64_t rows = min64(s->n, s->tile_rows > 0 ? s->tile_rows : bf16_du ? 256 : s->n);
        const int64_t blocks = (s->n + rows - 1) / rows;
        f.tile_rows = (s->n + blocks - 1) / blocks;
    } else {
        f.tile_rows = min64(s->n, s->tile_rows > 0 ? s->tile_rows : 1024);
        f.tile_vocab = s->tile_vocab > 0 ? s->tile_vocab : 2048;
    }
    return f;
}

/* The reference's options for a spec's case (ignore_index -100, as the library's default). */
static ref_ce_options ce_reference_options(const ce_case_spec *s, const double *class_weights, const ref_filter *filter)
{
    const ref_ce_options o = {.ignore_index = -100,
                              .reduction = (int)s->reduction,
                              .label_smoothing = s->label_smoothing,
                              .class_weights = class_weights,
                              .softcap = s->softcap,
                              .z_loss = s->z_loss,
                              .logit_scale = ce_logit_scale_of(s),
                              .token_scaling = s->token_scaling,
                              .filter = filter};
    return o;
}

static void run_reference(const ce_case_spec *s, ce_case *c)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    double *x = to_double(c->x, n * h), *w = ce_weight_to_reference(s->layout, s->hidden, s->vocab, c->weight);
    double *b = c->bias ? to_double(c->bias, v) : NULL;
    double *cw = c->class_weights ? to_double(c->class_weights, v) : NULL;
    double *g = to_double(c->grad_output, n);
    const ref_linear lin = {s->n, s->hidden, s->vocab, x, w, b};
    const ref_filter filter = filter_of(s);
    const ref_ce_options o = ce_reference_options(s, cw, s->grad_filter_eps > 0.0 ? &filter : NULL);
    c->ref_per_token_loss = xcalloc(n, sizeof(double));
    c->ref_logp = xcalloc(n, sizeof(double));
    c->ref_lse = xcalloc(n, sizeof(double));
    c->ref_entropy = xcalloc(n, sizeof(double));
    c->ref_argmax = xcalloc(n, sizeof(int64_t));
    ref_ce_result r = {0, 0, c->ref_per_token_loss, c->ref_logp, c->ref_lse, c->ref_entropy, c->ref_argmax, 0};
    ref_ce_forward(&lin, c->targets, &o, &r);
    c->ref_loss = r.loss;
    c->ref_z_loss = r.z_loss;
    c->ref_correct = r.correct;
    c->ref_dx = xcalloc(n * h, sizeof(double));
    double *dw_canonical = xcalloc(h * v, sizeof(double));
    c->ref_dbias = b ? xcalloc(v, sizeof(double)) : NULL;
    ref_ce_backward(&lin, c->targets, &o, g, c->ref_dx, dw_canonical, c->ref_dbias);
    c->ref_dweight = xcalloc(h * v, sizeof(double));
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, dw_canonical, c->ref_dweight);
    /* beta 1 accumulated onto 1.0 everywhere. */
    if (s->grad_beta != 0.0f) {
        for (size_t i = 0; i < n * h; i++)
            c->ref_dx[i] += 1.0;
        for (size_t i = 0; i < h * v; i++)
            c->ref_dweight[i] += 1.0;
        for (size_t j = 0; c->ref_dbias && j < v; j++)
            c->ref_dbias[j] += 1.0;
    }
    free(dw_canonical);
    free(x);
    free(w);
    free(b);
    free(cw);
    free(g);
}

/* Relative error with a zero reference defined as the absolute error (all-ignored cases). */
static double relative(double err, double ref)
{
    return ref > 0.0 ? err / ref : err;
}

ce_diff ce_compare(const float *fused, const double *reference, size_t count)
{
    double max_abs = 0.0, max_ref = 0.0, sq_diff = 0.0, sq_ref = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)fused[i] - reference[i]);
        max_abs = e > max_abs || isnan(e) ? e : max_abs;
        max_ref = fabs(reference[i]) > max_ref ? fabs(reference[i]) : max_ref;
        sq_diff += e * e;
        sq_ref += reference[i] * reference[i];
    }
    const ce_diff d = {max_abs, relative(max_abs, max_ref), relative(sqrt(sq_diff), sqrt(sq_ref))};
    return d;
}

void ce_measure_argmax(const ce_argmax_check *k, ce_metrics *m)
{
    int64_t correct = 0;
    for (int64_t i = 0; i < k->n; i++) {
        const int64_t a = k->argmax[i], r = k->ref_argmax[i];
        if (a < 0 || a >= k->vocab)
            m->argmax_mismatches++;
        else if (a != r) {
            const double za = k->logit(k->self, i, a), zr = k->logit(k->self, i, r);
            if (za < zr - 1e-5 * (1.0 + fabs(zr)))
                m->argmax_mismatches++;
        }
        correct += k->targets[i] != k->ignore_index && a == k->targets[i];
    }
    m->correct_mismatch = llabs(k->correct - correct);
}

/* The reference logit (i, j) of a case (self), for judging near-ties of the argmax. */
static double logit_in_double(const void *self, int64_t i, int64_t j)
{
    const ce_case *c = self;
    const ce_case_spec *s = &c->spec;
    double u = c->bias ? c->bias[j] : 0.0;
    for (int64_t k = 0; k < s->hidden; k++)
        u += (double)c->x[i * s->hidden + k] * c->weight[widx(s, k, j)];
    const ref_ce_options o = ce_reference_options(s, NULL, NULL);
    return ref_ce_transform(&o, u, NULL);
}

static void measure(const ce_case_spec *s, const ce_case *c, ce_metrics *m)
{
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    memset(m, 0, sizeof *m);
    const double fp32_tol = ce_fp32_grad_tolerance(s->token_scaling);
    m->loss_rel_tol = ce_loss_tolerance(s->token_scaling);
    m->grad_norm_rel_tol = ce_grad_tolerance(fp32_tol, s->dtype == FH_DTYPE_BF16 && !s->fp32_du, s->grad_dtype);
    m->dbias_norm_rel_tol = ce_grad_tolerance(fp32_tol, 0, s->grad_dtype);
    m->abs_diff_loss = fabs(c->loss - c->ref_loss);
    m->rel_diff_loss = relative(m->abs_diff_loss, fabs(c->ref_loss));
    m->abs_diff_z_loss = fabs(c->z_loss - c->ref_z_loss);
    m->per_token_loss_max_abs = ce_compare(c->per_token_loss, c->ref_per_token_loss, n).max_abs;
    m->logp_max_abs = ce_compare(c->logp, c->ref_logp, n).max_abs;
    m->lse_max_abs = ce_compare(c->lse, c->ref_lse, n).max_abs;
    const ce_diff dx = ce_compare(c->dx, c->ref_dx, n * h), dw = ce_compare(c->dweight, c->ref_dweight, h * v);
    m->dhidden_max_abs = dx.max_abs;
    m->dhidden_max_rel = dx.max_rel;
    m->dhidden_norm_rel = dx.norm_rel;
    m->dweight_max_abs = dw.max_abs;
    m->dweight_max_rel = dw.max_rel;
    m->dweight_norm_rel = dw.norm_rel;
    if (c->dbias)
        m->dbias_norm_rel = ce_compare(c->dbias, c->ref_dbias, v).norm_rel;
    const ce_argmax_check k = {s->n, s->vocab, -100, c->targets, c->argmax, c->ref_argmax, c->correct,
                               logit_in_double, c};
    ce_measure_argmax(&k, m);
    m->entropy_tol = CE_ENTROPY_ABS_TOL;
    if (c->entropy)
        m->entropy_max_abs = ce_compare(c->entropy, c->ref_entropy, n).max_abs;
}

int ce_metrics_pass(const ce_metrics *m)
{
    return m->rel_diff_loss <= m->loss_rel_tol && m->dhidden_norm_rel <= m->grad_norm_rel_tol &&
           m->dweight_norm_rel <= m->grad_norm_rel_tol && m->dbias_norm_rel <= m->dbias_norm_rel_tol &&
           m->argmax_mismatches == 0 && m->correct_mismatch == 0 && m->entropy_max_abs <= m->entropy_tol;
}

fh_status ce_case_run(const ce_case_spec *spec, ce_case *c, ce_metrics *m)
{
    memset(c, 0, sizeof *c);
    c->spec = *spec;
    make_inputs(spec, c);
    const fh_status st = run_fused(spec, c);
    if (st != FH_OK)
        return st;
    run_reference(spec, c);
    measure(spec, c, m);
    return FH_OK;
}

void ce_case_free(ce_case *c)
{
    void *p[] = {c->x, c->weight, c->bias, c->class_weights, c->grad_output, c->targets, c->per_token_loss,
                 c->logp, c->lse, c->entropy, c->dx, c->dweight, c->dbias, c->argmax, c->ref_per_token_loss,
                 c->ref_logp, c->ref_lse, c->ref_entropy, c->ref_dx, c->ref_dweight, c->ref_dbias, c->ref_argmax,
                 c->x_bf16, c->weight_bf16};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    memset(c, 0, sizeof *c);
}

void *ce_zalloc(size_t count, size_t size)
{
    return calloc(count ? count : 1, size);
}

double *ce_doubles(const float *f, size_t count)
{
    if (!f)
        return NULL;
    double *d = ce_zalloc(count, sizeof *d);
    for (size_t i = 0; i < count && d; i++)
        d[i] = f[i];
    return d;
}
