/* distill: the fused distillation head (fh_distill_forward, fh_distill_forward_backward) against the double-precision
 * reference ref_distill_linear (ref/ref_distill.h, itself checked by finite differences in ref_distill_fdcheck.c):
 *   - every divergence (forward_kl, reverse_kl, jsd at beta 0.5 and 0.3, jsd at beta 0 and 1) x temperature 1 / 0.7
 *     x weight_hard_loss 0 / 0.4 x reduction mean / sum / none x both schedules of the single-call step (row blocks,
 *     streaming), and fh_distill_forward alone: loss, soft_loss, hard_loss, per_token_loss, dx, dweight, dbias;
 *   - both weight layouts of student and teacher, strided x rows, student and teacher biases, teacher hidden !=
 *     student hidden, targets NULL and ignored tokens, a varied grad_output vector for 'none';
 *   - gradient beta 1 accumulates, beta 0 overwrites NaN; every token ignored: loss 0 and exact zero gradients;
 *   - bf16 student and teacher with fp32 and bf16 gradients, and mixed dtypes (an fp32 head with a bf16 one);
 *   - jsd near its maximum (nearly disjoint p and q), where a naive fp32 gradient cancels (see that test);
 *   - a frozen lm_head shared by student and teacher (EAGLE-1/2's draft head): no dweight, left untouched;
 *   - the workspace query: a caller workspace of exactly that size works, one byte less fails;
 *   - the API contracts: each bad argument's status, a message, untouched outputs and inputs; gradient filtering
 *     has no effect on this head.
 *
 * Inputs: x U(-1, 1), weights scaled so that both heads' logits have standard deviation ~2 (ce_fill_linear), the
 * teacher independent of the student, so that D is a fraction of a nat to a few nats and neither softmax is near
 * uniform, nor (jsd) are p and q nearly disjoint.
 *
 * Tolerances (in brackets the largest values measured over this suite, AVX-512 and portable row kernels alike):
 *   loss, soft_loss, hard_loss: |fused - reference| <= DISTILL_LOSS_TOL max(1, |reference|), 1e-5 [2.8e-7 fp32,
 *     3.8e-7 bf16]. The head forms exps, log-probabilities and (jsd) the log-mixture in fp32 from fp32 logits: each
 *     logit carries the fp32 GEMM's ~sqrt(H) 2^-24 |z| (~1e-6 at H = 24, |z| = 2 / temperature), and log p = z / T -
 *     lse is formed in fp32 at magnitudes up to ~20 (2^-24 x 20 ~ 1e-6); D and the cross-entropy are sums of
 *     p-weighted such terms, so their error is absolute, ~1e-6 at most, whatever D's size: hence max(1, |r|). The
 *     sums are in double, so the reduction adds nothing. 1e-5 (the CE gradient bound rather than CE's 1e-6 loss
 *     bound) because the jsd log-mixture log(beta q + (1 - beta) p) is one more float log-add-exp.
 *   per_token_loss: |f - r| <= DISTILL_TOKEN_TOL (1 + |r|), 1e-5 [3.9e-7]: the same per-token error, plus fp32
 *     storage (2^-24).
 *   dx, dweight, dbias: normwise relative DISTILL_GRAD_TOL = 1e-5 [3.9e-6, jsd at temperature 0.7], CE's bound
 *     (tests/cases/ce_case.c): dU = g (w_s dD/ds / T + w_h (softmax(u) - onehot)) is formed in fp32 from the same fp32
 *     log-probabilities (reverse kl's p (log p - log q - D) and jsd's (1 - beta) p (log p - log m - K) subtract values
 *     of a few units to get less than one: ~1e-6 relative, the most for jsd), then two fp32 GEMMs (~sqrt(K) 2^-24
 *     normwise).
 *   bf16 inputs: x and weight rounded to bf16 for both sides, so the loss keeps the fp32 tolerance (products of bf16
 *     values are exact in fp32); the gradient GEMMs read dU rounded once to bf16, whose unit roundoff 2^-8 bounds the
 *     normwise error: ce_grad_tolerance(DISTILL_GRAD_TOL, 1, grad dtype) = 4e-3 [2.4e-3], and + 2^-8 (8e-3) when the
 *     gradient itself is written in bf16 [3.0e-3], as test_bf16.c and tests/cases/ce_case.c justify; dbias sums the f32 dU
 *     and keeps the fp32 bound [3.3e-6], + 2^-8 in bf16 [2.0e-3]. An fp32 student with a bf16 teacher keeps the fp32
 *     bounds (the teacher's logits are exact fp32 sums of bf16 products).
 * FH_TEST_VERBOSE=1 prints each test's largest errors (and as fractions of the tolerances), FH_TEST_VERBOSE=2 every
 * case's. */
#include "bf16.h"
#include "ce_case.h"
#include "ce_harness.h"
#include "ref_distill.h"
#include "contract_driver.h"
#include "test_util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DISTILL_LOSS_TOL 1e-5
#define DISTILL_TOKEN_TOL 1e-5
#define DISTILL_GRAD_TOL CE_GRAD_NORM_REL_TOL

/* ================================================================================================
 * Drawn cases: inputs, the fused calls, the reference, the comparison
 * ============================================================================================== */

typedef enum schedule {
    ROW_BLOCKS,       /* the default budget and tiles: one row block of every row */
    ROW_BLOCKS_SPLIT, /* FH_PARAM_TILE_ROWS 7 at the default budget: several row blocks */
    STREAMING,        /* tiles of STREAM_ROWS x STREAM_VOCAB under a budget below 8 V bytes (stream_budget) */
    ROW_BLOCKS_ACC    /* bf16: 7-row blocks under a budget of ACC_BUDGET_V x V bytes (acc_bytes), below every row's
                         bf16 dU: each span of blocks adds its dweight into an f32 accumulator */
} schedule;

enum { STREAM_ROWS = 8, STREAM_VOCAB = 64, SPLIT_ROWS = 7, ACC_BUDGET_V = 180 };

/* Streaming is forced by FH_PARAM_MEMORY_BUDGET = 8 V - 1 bytes: a row block of even one row holds the student's
 * and the teacher's V-wide fp32 logits rows (8 V bytes), so it cannot fit, while a STREAM_ROWS x STREAM_VOCAB tile
 * pair (2 x 8 x 64 x 4 = 4 KiB, plus n x 80 bytes of per-row state) can, at the V used with it (1031 fp32, 2053
 * bf16, whose streaming path also keeps f32 accumulators of dx and a dweight tile). run_case checks through the
 * workspace query that the call's plan fits that budget, i.e. that it does not hold two V-wide rows. */

typedef struct dspec {
    int64_t n, hs, ht, vocab;
    fh_layout s_layout, t_layout;
    int s_bias, t_bias;
    int64_t s_pad, t_pad;     /* x_row_stride = hidden + pad */
    fh_dtype dtype;           /* of both heads' x and weight */
    int mixed;                /* 1: the teacher has the other dtype */
    fh_dtype grad_dtype;
    fh_distill_options o;
    int targets;              /* 0: NULL (every token counts); 1: drawn, a fifth of them ignore_index */
    schedule sched;
    int varied_grad;          /* 'none': grad_output U(-1.5, 1.5) per token; else 1 (mean, sum: grad_value) */
    float grad_value;
    float grad_beta;          /* 0: buffers hold NaN; 1: buffers hold the reference gradient, results 2 G */
    int threads;
    int caller_workspace;     /* 1: both calls run in a caller workspace of exactly fh_distill_workspace_size bytes */
    double logit_scale;       /* both heads' logits' standard deviation (ce_fill_linear) */
    int shared_weight;        /* 1: the teacher is the student's own lm_head (EAGLE-1/2's frozen head: its weight,
                                 bias and layout on the teacher's hidden states, ht = hs) and the step asks for no
                                 dweight, which must stay untouched */
    uint64_t seed;
} dspec;

/* The bytes of the top-k selections (0 < top_k < V), which every schedule holds for all n rows: top_k 16-byte
 * entries per row for each head whose top-k is kept (both for jsd's union). */
static int64_t selection_bytes(const dspec *s)
{
    const fh_distill_options *o = &s->o;
    if (o->top_k <= 0 || o->top_k >= s->vocab)
        return 0;
    const int jsd = o->divergence == FH_DIVERGENCE_JSD && o->beta > 0.0 && o->beta < 1.0;
    return s->n * (jsd ? 2 : 1) * o->top_k * 16;
}

static int64_t stream_budget(const dspec *s)
{
    return 8 * s->vocab - 1 + selection_bytes(s);
}

static void spec_default(dspec *s)
{
    memset(s, 0, sizeof *s);
    s->n = 24;
    s->hs = 24;
    s->ht = 17;
    s->vocab = 1031; /* 16 x 64 + 7: the streaming tiles' last column tile is 7 wide */
    s->s_layout = FH_LAYOUT_VH;
    s->t_layout = FH_LAYOUT_HV;
    fh_distill_options_init(&s->o);
    s->targets = 1;
    s->grad_value = 1.0f;
    s->threads = 1;
    s->logit_scale = 2.0;
    s->seed = 1;
}

static const char *divergence_name(const fh_distill_options *o)
{
    static const char *const names[] = {"forward_kl", "reverse_kl", "jsd"};
    return (unsigned)o->divergence <= 2 ? names[o->divergence] : "?";
}

static void describe(const dspec *s, char *buf, size_t size)
{
    static const char *const reductions[] = {"mean", "sum", "none"};
    static const char *const schedules[] = {"row blocks", "row blocks split", "streaming", "row blocks, dweight accumulator"};
    snprintf(buf, size,
             "%s beta=%g top_k=%lld tail=%d T=%g ws=%g wh=%g %s targets=%d | n=%lld Hs=%lld Ht=%lld V=%lld %s/%s "
             "bias=%d/%d pad=%lld/%lld "
             "%s%s grads %s | %s threads=%d g=%g%s beta_g=%g seed=%llu",
             divergence_name(&s->o), s->o.beta, (long long)s->o.top_k, s->o.add_tail, s->o.temperature,
             s->o.weight_soft_loss, s->o.weight_hard_loss,
             reductions[s->o.reduction], s->targets, (long long)s->n, (long long)s->hs, (long long)s->ht,
             (long long)s->vocab, s->s_layout == FH_LAYOUT_HV ? "hv" : "vh", s->t_layout == FH_LAYOUT_HV ? "hv" : "vh",
             s->s_bias, s->t_bias, (long long)s->s_pad, (long long)s->t_pad,
             s->dtype == FH_DTYPE_BF16 ? "bf16" : "f32", s->mixed ? " (teacher the other)" : "",
             s->grad_dtype == FH_DTYPE_BF16 ? "bf16" : "f32",
             schedules[s->sched], s->threads, (double)s->grad_value, s->varied_grad ? " (varied)" : "",
             (double)s->grad_beta, (unsigned long long)s->seed);
}

/* One linear head: values (bf16-valued for bf16), what the library reads, the reference's doubles. */
typedef struct head {
    int64_t hidden, pad;
    fh_layout layout;
    float *x, *weight, *bias; /* x [n, hidden] contiguous, weight in layout */
    void *x_view;             /* x at row stride hidden + pad: floats or bf16 bits */
    uint16_t *weight_bf16;
    double *rx, *rw, *rb;     /* the reference's: rw [hidden, V] */
    fh_linear lin;
    ref_linear ref;
} head;

static void head_make(head *h, uint64_t *rng, int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, int bias,
                      int64_t pad, fh_dtype dtype, double logit_scale)
{
    memset(h, 0, sizeof *h);
    h->hidden = hidden;
    h->pad = pad;
    h->layout = layout;
    const size_t nh = (size_t)(n * hidden), hv = (size_t)(hidden * vocab);
    h->x = tu_alloc(nh, sizeof(float));
    h->weight = tu_alloc(hv, sizeof(float));
    h->bias = bias ? tu_alloc((size_t)vocab, sizeof(float)) : NULL;
    ce_fill_linear(rng, n, hidden, vocab, logit_scale, h->x, h->weight, h->bias);
    const int64_t stride = hidden + pad;
    const void *w = h->weight;
    if (dtype == FH_DTYPE_BF16) {
        free(bf16_round_in_place(h->x, nh));
        h->weight_bf16 = bf16_round_in_place(h->weight, hv);
        uint16_t *xv = tu_alloc((size_t)(n * stride), sizeof(uint16_t));
        for (int64_t i = 0; i < n * stride; i++)
            xv[i] = 0x7fc0; /* NaN in the padding: never read */
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < hidden; k++)
                xv[i * stride + k] = bf16_from_float(h->x[i * hidden + k]);
        h->x_view = xv;
        w = h->weight_bf16;
    } else {
        float *xv = tu_alloc((size_t)(n * stride), sizeof(float));
        for (int64_t i = 0; i < n * stride; i++)
            xv[i] = NAN;
        for (int64_t i = 0; i < n; i++)
            memcpy(xv + i * stride, h->x + i * hidden, (size_t)hidden * sizeof(float));
        h->x_view = xv;
    }
    fh_linear_init(&h->lin, n, hidden, vocab, h->x_view, w, layout, h->bias);
    h->lin.x_row_stride = stride;
    h->lin.x_dtype = h->lin.weight_dtype = dtype;
    h->rx = tu_doubles(h->x, nh);
    h->rw = ce_weight_to_reference(layout, hidden, vocab, h->weight);
    h->rb = tu_doubles(h->bias, (size_t)vocab);
    const ref_linear r = {n, hidden, vocab, h->rx, h->rw, h->rb};
    h->ref = r;
}

static void head_free(head *h)
{
    void *p[] = {h->x, h->weight, h->bias, h->x_view, h->weight_bf16, h->rx, h->rw, h->rb};
    for (size_t k = 0; k < TU_COUNT(p); k++)
        free(p[k]);
    memset(h, 0, sizeof *h);
}

/* What one fused call writes. */
typedef struct fused {
    double loss, soft, hard;
    float *per_token;
    float *dx, *dweight, *dbias; /* the step's (fp32 values of bf16 gradients) */
} fused;

typedef struct dcase {
    dspec spec;
    head s, t;
    int64_t *targets;
    float *grad_output; /* [n] (one value used for mean and sum) */
    fused forward, step;
    double ref_loss, ref_soft, ref_hard;
    double *ref_per_token, *ref_dx, *ref_dweight, *ref_dbias; /* dweight in the student's layout */
} dcase;

typedef struct ddiff {
    double loss, per_token, dx, dweight, dbias; /* loss: the worst of loss, soft, hard over both calls */
    double grad_tol, dbias_tol;
    int64_t ignored_rows_touched; /* dx rows of ignored tokens that are not exactly 0 (beta 0) */
    int schedule_ok;              /* streaming: the workspace query fits the budget and holds no two V-wide rows */
} ddiff;

static ref_distill_options ref_options(const fh_distill_options *o)
{
    const ref_distill_options r = {(ref_divergence)o->divergence, o->beta, o->temperature, o->weight_soft_loss,
                                   o->weight_hard_loss, o->ignore_index, (int)o->reduction, o->top_k, o->add_tail};
    return r;
}

static fh_context *case_context(const dspec *s)
{
    switch (s->sched) {
    case ROW_BLOCKS_SPLIT:
        return tu_context(s->threads, SPLIT_ROWS, 0, 0);
    case STREAMING:
        return tu_context(s->threads, STREAM_ROWS, STREAM_VOCAB, stream_budget(s));
    case ROW_BLOCKS_ACC:
        return tu_context(s->threads, SPLIT_ROWS, 0, ACC_BUDGET_V * s->vocab);
    default:
        return tu_context(s->threads, 0, 0, 0);
    }
}

static void alloc_fused(const dspec *s, fused *f)
{
    f->per_token = tu_alloc((size_t)s->n, sizeof(float));
    tu_fill_canary(f->per_token, (size_t)s->n * sizeof(float));
}

/* The reference's gradients as fp32 (the buffers' prior contents for beta 1). */
static void fill_prior(const dcase *c, float *dx, float *dw, float *db)
{
    const dspec *s = &c->spec;
    const size_t nh = (size_t)(s->n * s->hs), hv = (size_t)(s->hs * s->vocab);
    for (size_t i = 0; i < nh; i++)
        dx[i] = (float)c->ref_dx[i];
    for (size_t i = 0; i < hv; i++)
        dw[i] = (float)c->ref_dweight[i];
    for (size_t j = 0; db && j < (size_t)s->vocab; j++)
        db[j] = (float)c->ref_dbias[j];
}

static fh_status run_fused(dcase *c)
{
    const dspec *s = &c->spec;
    fh_context *ctx = case_context(s);
    if (!ctx)
        return FH_ERR_OUT_OF_MEMORY;
    void *workspace = NULL;
    if (s->caller_workspace) {
        size_t bytes = 0;
        const fh_status q = fh_distill_workspace_size(ctx, &c->s.lin, &c->t.lin, &c->spec.o, &bytes);
        workspace = q == FH_OK ? tu_alloc(bytes, 1) : NULL;
        if (q != FH_OK || fh_context_set_workspace(ctx, workspace, bytes) != FH_OK) {
            fh_context_destroy(ctx);
            free(workspace);
            return q != FH_OK ? q : FH_ERR_NULL_POINTER;
        }
    }
    alloc_fused(s, &c->forward);
    fh_distill_outputs out = {&c->forward.loss, &c->forward.soft, &c->forward.hard, c->forward.per_token};
    const int64_t *targets = s->targets ? c->targets : NULL;
    fh_status st = fh_distill_forward(ctx, &c->s.lin, &c->t.lin, targets, &s->o, &out);
    if (st == FH_OK) {
        alloc_fused(s, &c->step);
        const size_t n = (size_t)s->n, h = (size_t)s->hs, v = (size_t)s->vocab;
        ce_alloc_grads(n, h, v, s->s_bias, s->grad_beta, &c->step.dx, &c->step.dweight, &c->step.dbias);
        if (s->grad_beta != 0.0f)
            fill_prior(c, c->step.dx, c->step.dweight, c->step.dbias);
        ce_grads_io io;
        ce_grads_io_begin(&io, s->grad_dtype, n, h, v, s->grad_beta, c->step.dx, c->step.dweight, c->step.dbias);
        if (s->shared_weight)
            io.grads.dweight = NULL; /* frozen */
        out = (fh_distill_outputs){&c->step.loss, &c->step.soft, &c->step.hard, c->step.per_token};
        st = fh_distill_forward_backward(ctx, &c->s.lin, &c->t.lin, targets, &s->o, c->grad_output, &out,
                                         &io.grads);
        ce_grads_io_finish(&io);
    }
    fh_context_destroy(ctx);
    free(workspace);
    return st;
}

static int run_reference(dcase *c)
{
    const dspec *s = &c->spec;
    const size_t n = (size_t)s->n, h = (size_t)s->hs, v = (size_t)s->vocab;
    const ref_distill_options o = ref_options(&s->o);
    double *g = tu_doubles(c->grad_output, n), *dw = tu_alloc(h * v, sizeof(double));
    c->ref_per_token = tu_alloc(n, sizeof(double));
    c->ref_dx = tu_alloc(n * h, sizeof(double));
    c->ref_dweight = tu_alloc(h * v, sizeof(double));
    c->ref_dbias = s->s_bias ? tu_alloc(v, sizeof(double)) : NULL;
    ref_distill_result r = {0};
    r.per_token_loss = c->ref_per_token;
    const int rc = ref_distill_linear(&c->s.ref, &c->t.ref, s->targets ? c->targets : NULL, &o, g, &r, c->ref_dx, dw,
                                      c->ref_dbias);
    ce_weight_from_reference(s->s_layout, s->hs, s->vocab, dw, c->ref_dweight);
    c->ref_loss = r.loss;
    c->ref_soft = r.soft_loss;
    c->ref_hard = r.hard_loss;
    free(g), free(dw);
    return rc;
}

static void make_inputs(const dspec *s, dcase *c)
{
    uint64_t rng = s->seed * 104729 + 3;
    head_make(&c->s, &rng, s->n, s->hs, s->vocab, s->s_layout, s->s_bias, s->s_pad, s->dtype, s->logit_scale);
    const fh_dtype t_dtype = s->mixed ? (s->dtype == FH_DTYPE_BF16 ? FH_DTYPE_F32 : FH_DTYPE_BF16) : s->dtype;
    head_make(&c->t, &rng, s->n, s->ht, s->vocab, s->t_layout, s->t_bias, s->t_pad, t_dtype, s->logit_scale);
    if (s->shared_weight) {
        c->t.lin.weight = c->s.lin.weight;
        c->t.lin.w_stride_hidden = c->s.lin.w_stride_hidden;
        c->t.lin.w_stride_vocab = c->s.lin.w_stride_vocab;
        c->t.lin.bias = c->s.lin.bias;
        c->t.ref.weight = c->s.rw;
        c->t.ref.bias = c->s.rb;
    }
    c->targets = tu_alloc((size_t)s->n, sizeof(int64_t));
    for (int64_t i = 0; i < s->n; i++) {
        c->targets[i] = (int64_t)(ref_uniform(&rng) * (double)s->vocab);
        if (ref_uniform(&rng) < 0.2)
            c->targets[i] = s->o.ignore_index;
    }
    c->targets[0] = s->vocab - 1; /* the last column (the edge tile's) counts */
    c->grad_output = tu_alloc((size_t)s->n, sizeof(float));
    for (int64_t i = 0; i < s->n; i++)
        c->grad_output[i] = s->varied_grad ? (float)(3.0 * ref_uniform(&rng) - 1.5) : s->grad_value;
}

static double loss_err(double f, double r)
{
    const double e = fabs(f - r) / fmax(1.0, fabs(r));
    return isnan(e) ? INFINITY : e;
}

static double token_err(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)f[i] - r[i]) / (1.0 + fabs(r[i]));
        m = e > m || isnan(e) ? (isnan(e) ? INFINITY : e) : m;
    }
    return m;
}

/* Normwise relative difference of a gradient from `scale` times the reference (a NaN anywhere: infinite). */
static double grad_err(const float *f, const double *r, size_t count, double scale)
{
    double *rs = tu_alloc(count, sizeof(double));
    for (size_t i = 0; i < count; i++)
        rs[i] = scale * r[i];
    const double e = ce_compare(f, rs, count).norm_rel;
    free(rs);
    return isnan(e) ? INFINITY : e;
}

static double outputs_err(const dcase *c, const fused *f)
{
    return fmax(loss_err(f->loss, c->ref_loss), fmax(loss_err(f->soft, c->ref_soft), loss_err(f->hard, c->ref_hard)));
}

/* The workspace the step's schedule asks for under the case's context (streaming: it must fit the budget and be
 * below 8 V bytes, which a row block of one row of both heads' logits exceeds). */
static int check_schedule(const dcase *c)
{
    const dspec *s = &c->spec;
    if (s->sched != STREAMING)
        return 1;
    fh_context *ctx = case_context(s);
    size_t bytes = 0;
    const fh_status st = fh_distill_workspace_size(ctx, &c->s.lin, &c->t.lin, &c->spec.o, &bytes);
    fh_context_destroy(ctx);
    return st == FH_OK && bytes <= (size_t)stream_budget(s) && bytes < (size_t)(8 * s->vocab + selection_bytes(s));
}

static void measure(const dcase *c, ddiff *d)
{
    const dspec *s = &c->spec;
    const size_t n = (size_t)s->n, h = (size_t)s->hs, v = (size_t)s->vocab;
    memset(d, 0, sizeof *d);
    d->grad_tol = ce_grad_tolerance(DISTILL_GRAD_TOL, s->dtype == FH_DTYPE_BF16, s->grad_dtype);
    d->dbias_tol = ce_grad_tolerance(DISTILL_GRAD_TOL, 0, s->grad_dtype);
    d->loss = fmax(outputs_err(c, &c->forward), outputs_err(c, &c->step));
    d->per_token = fmax(token_err(c->forward.per_token, c->ref_per_token, n),
                        token_err(c->step.per_token, c->ref_per_token, n));
    const double scale = s->grad_beta != 0.0f ? 2.0 : 1.0;
    d->dx = grad_err(c->step.dx, c->ref_dx, n * h, scale);
    d->dweight = grad_err(c->step.dweight, c->ref_dweight, h * v, scale);
    if (s->shared_weight) { /* frozen: the NaN the buffer started with, untouched */
        d->dweight = 0.0;
        for (size_t i = 0; i < h * v; i++)
            d->dweight = isnan(c->step.dweight[i]) ? d->dweight : INFINITY;
    }
    if (c->step.dbias)
        d->dbias = grad_err(c->step.dbias, c->ref_dbias, v, scale);
    for (size_t i = 0; s->grad_beta == 0.0f && s->targets && i < n; i++) {
        int touched = 0;
        for (size_t k = 0; c->targets[i] == s->o.ignore_index && k < h; k++)
            touched |= c->step.dx[i * h + k] != 0.0f;
        d->ignored_rows_touched += touched;
    }
    d->schedule_ok = check_schedule(c);
}

static int diff_pass(const ddiff *d)
{
    return d->loss <= DISTILL_LOSS_TOL && d->per_token <= DISTILL_TOKEN_TOL && d->dx <= d->grad_tol &&
           d->dweight <= d->grad_tol && d->dbias <= d->dbias_tol && d->ignored_rows_touched == 0 && d->schedule_ok;
}

static void case_free(dcase *c)
{
    head_free(&c->s);
    head_free(&c->t);
    void *p[] = {c->targets, c->grad_output, c->forward.per_token, c->step.per_token, c->step.dx, c->step.dweight,
                 c->step.dbias, c->ref_per_token, c->ref_dx, c->ref_dweight, c->ref_dbias};
    for (size_t k = 0; k < TU_COUNT(p); k++)
        free(p[k]);
    memset(c, 0, sizeof *c);
}

/* Largest errors seen, as fractions of their tolerances (FH_TEST_VERBOSE=1 prints them), and as raw values. */
static double worst_fraction[4], worst_raw[5]; /* loss, per-token, dx/dweight, dbias; raw adds nothing else */

static void track(const ddiff *d)
{
    const double f[4] = {d->loss / DISTILL_LOSS_TOL, d->per_token / DISTILL_TOKEN_TOL,
                         fmax(d->dx, d->dweight) / d->grad_tol, d->dbias / d->dbias_tol};
    const double raw[5] = {d->loss, d->per_token, d->dx, d->dweight, d->dbias};
    for (int k = 0; k < 4; k++)
        worst_fraction[k] = fmax(worst_fraction[k], f[k]);
    for (int k = 0; k < 5; k++)
        worst_raw[k] = fmax(worst_raw[k], raw[k]);
}

static void print_worst(const char *what)
{
    const char *v = getenv("FH_TEST_VERBOSE");
    if (v && v[0] != '0')
        fprintf(stderr,
                "\n[distill %s] worst: loss %.2e per-token %.2e dx %.2e dweight %.2e dbias %.2e; as fractions of the "
                "tolerances: loss %.2f per-token %.2f grads %.2f dbias %.2f\n",
                what, worst_raw[0], worst_raw[1], worst_raw[2], worst_raw[3], worst_raw[4], worst_fraction[0],
                worst_fraction[1], worst_fraction[2], worst_fraction[3]);
    memset(worst_fraction, 0, sizeof worst_fraction);
    memset(worst_raw, 0, sizeof worst_raw);
}

/* Runs a case: asserts FH_OK, the reference's success and every tolerance. Returns 1 with c holding the run (the
 * caller frees it), 0 after a failure to run. */
static int run_case(const dspec *s, const char *label, dcase *c)
{
    char desc[512];
    describe(s, desc, sizeof desc);
    memset(c, 0, sizeof *c);
    c->spec = *s;
    make_inputs(s, c);
    int rc = 0;
    if (s->grad_beta != 0.0f)
        rc = run_reference(c); /* the prior gradients are the reference's */
    const fh_status st = run_fused(c);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, desc, (int)st, fh_status_string(st));
    if (st != FH_OK) {
        case_free(c);
        return 0;
    }
    if (s->grad_beta == 0.0f)
        rc = run_reference(c);
    TU_CHECK(rc == 0, "%s [%s]: the reference failed (%d)", label, desc, rc);
    ddiff d;
    measure(c, &d);
    track(&d);
    const char *verbose = getenv("FH_TEST_VERBOSE");
    if (verbose && strcmp(verbose, "2") == 0)
        fprintf(stderr, "\n  %s [%s]: loss %.2e per-token %.2e dx %.2e dweight %.2e dbias %.2e", label, desc, d.loss,
                d.per_token, d.dx, d.dweight, d.dbias);
    TU_CHECK(diff_pass(&d),
             "%s [%s]: loss %.17g vs %.17g, soft %.17g vs %.17g, hard %.17g vs %.17g (worst %.2e, forward %.17g; tol "
             "%g); per-token %.2e (tol %g); dx %.2e dweight %.2e (tol %g) dbias %.2e (tol %g); %lld ignored dx rows "
             "not 0; streaming plan %s",
             label, desc, c->step.loss, c->ref_loss, c->step.soft, c->ref_soft, c->step.hard, c->ref_hard, d.loss,
             c->forward.loss, DISTILL_LOSS_TOL, d.per_token, DISTILL_TOKEN_TOL, d.dx, d.dweight, d.grad_tol, d.dbias,
             d.dbias_tol, (long long)d.ignored_rows_touched, d.schedule_ok ? "ok" : "does not fit / holds a row block");
    return 1;
}

static void check_case(const dspec *s, const char *label)
{
    dcase c;
    if (run_case(s, label, &c))
        case_free(&c);
}

/* The divergences: forward_kl, reverse_kl, jsd at 0.5 (the default) and 0.3, jsd at beta 0 and 1 (TRL's ends: the
 * forward and reverse KLs). */
static const struct {
    fh_divergence divergence;
    double beta;
} divergences[] = {
    {FH_DIVERGENCE_FORWARD_KL, 0.5}, {FH_DIVERGENCE_REVERSE_KL, 0.5}, {FH_DIVERGENCE_JSD, 0.5},
    {FH_DIVERGENCE_JSD, 0.3},        {FH_DIVERGENCE_JSD, 0.0},        {FH_DIVERGENCE_JSD, 1.0},
};

/* A matrix's case k: divergences[dv], temperature 0.7 (cold) or 1, the hard loss beside the soft one (hard) or not,
 * the reduction, and along k the rotating inputs: layouts of both heads, biases of both, strided x rows, targets NULL
 * on half of the soft-only cases (the others ignore a fifth of the tokens), grad_output 1 / -0.7 for mean and sum and
 * a varied vector for none, several row blocks (FH_PARAM_TILE_ROWS 7) on half of the row-block cases. */
static void matrix_spec(dspec *s, uint64_t seed, size_t dv, int cold, int hard, fh_reduction reduction, int k,
                        int streaming)
{
    spec_default(s);
    s->seed = seed;
    s->o.divergence = divergences[dv].divergence;
    s->o.beta = divergences[dv].beta;
    s->o.temperature = cold ? 0.7 : 1.0;
    s->o.weight_soft_loss = hard ? 0.6 : 1.0;
    s->o.weight_hard_loss = hard ? 0.4 : 0.0;
    s->o.reduction = reduction;
    s->targets = hard || (k / 2) % 2;
    s->varied_grad = reduction == FH_REDUCTION_NONE;
    s->grad_value = k % 3 == 1 ? -0.7f : 1.0f;
    s->sched = streaming ? STREAMING : (k / 2) % 2 ? ROW_BLOCKS_SPLIT : ROW_BLOCKS;
    s->s_layout = (k / 2) % 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
    s->t_layout = (k / 4) % 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
    s->s_bias = (k / 3) % 2;
    s->t_bias = (k / 5) % 2;
    s->s_pad = k % 4 == 0 ? 3 : 0;
    s->t_pad = k % 6 == 0 ? 5 : 0;
}

/* Every divergence x temperature 1 / 0.7 x (weight_soft 1, weight_hard 0) / (0.6, 0.4) x mean / sum / none x row
 * blocks / streaming: 144 cases, the other inputs rotating (matrix_spec), two threads on two (one per schedule). */
static void test_reference_matrix(void)
{
    int k = 0;
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int temp = 0; temp < 2; temp++)
            for (int hard = 0; hard < 2; hard++)
                for (int red = 0; red < 3; red++)
                    for (int streaming = 0; streaming < 2; streaming++, k++) {
                        dspec s;
                        matrix_spec(&s, 100 + (uint64_t)k, dv, temp, hard, (fh_reduction)red, k, streaming);
                        if (k == 5 || k == 100)
                            s.threads = 2;
                        check_case(&s, "reference matrix");
                    }
    print_worst("reference matrix");
}

/* Both layouts of student and teacher, each with strided x rows (pads 3 and 5), biases on both and on neither,
 * student hidden 24 with teacher hidden 17, 24 and 40, in all three schedules; jsd 0.3 at temperature 0.7 with the
 * hard loss (every term live). */
static void test_layouts_and_shapes(void)
{
    static const int64_t teacher_hidden[] = {17, 24, 40};
    int k = 0;
    for (int sl = 0; sl < 2; sl++)
        for (int tl = 0; tl < 2; tl++)
            for (int sched = 0; sched < 3; sched++, k++) {
        dspec s;
                spec_default(&s);
                s.seed = 200 + (uint64_t)k;
                s.o.divergence = FH_DIVERGENCE_JSD;
                s.o.beta = 0.3;
                s.o.temperature = 0.7;
                s.o.weight_soft_loss = 0.6;
                s.o.weight_hard_loss = 0.4;
                s.s_layout = (fh_layout)sl;
                s.t_layout = (fh_layout)tl;
                s.s_pad = 3;
                s.t_pad = 5;
                s.s_bias = s.t_bias = k % 2;
                s.ht = teacher_hidden[k % 3];
                s.sched = (schedule)sched;
                check_case(&s, "layouts");
            }
    print_worst("layouts");
}

/* Self-distillation through one frozen lm_head (EAGLE-1/2's draft head: the draft's hidden states and the target's
 * through the target's own weight; SpecForge trains no lm_head then): the teacher's weight and bias are the student's
 * memory, no dweight is asked for (it stays untouched) and the loss, per-token losses, dx and dbias match the
 * reference with the teacher's weight equal to the student's. Every divergence, both layouts, all schedules, fp32 and
 * bf16. */
static void test_frozen_shared_weight(void)
{
    int k = 0;
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int layout = 0; layout < 2; layout++)
            for (int sched = 0; sched < 3; sched++, k++) {
                dspec s;
                spec_default(&s);
                s.seed = 900 + (uint64_t)k;
                s.shared_weight = 1;
                s.ht = s.hs;
                s.s_layout = s.t_layout = (fh_layout)layout;
                s.s_bias = k % 2;
                s.o.divergence = divergences[dv].divergence;
                s.o.beta = divergences[dv].beta;
                s.o.temperature = 0.7;
                s.o.weight_hard_loss = k % 3 == 0 ? 0.4 : 0.0;
                s.sched = (schedule)sched;
                s.dtype = k % 4 == 3 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
                check_case(&s, "frozen shared weight");
            }
    print_worst("frozen shared weight");
}

/* Gradient beta 1 adds onto what the buffers hold: they start at the reference gradient G (rounded to the gradient
 * dtype) and must end at 2 G, within the case's own tolerance: the result is G + G (1 + e) rounded, |e| within the
 * tolerance normwise, so |result - 2 G| / |2 G| <= (e + the prior's rounding) / 2 + one final rounding, below the
 * tolerance (fp32: 2^-24; bf16 gradients: 2^-8, which ce_grad_tolerance adds). Beta 0 overwrites NaN: every other
 * test starts from NaN-filled buffers (ce_alloc_grads). Every divergence, both schedules. */
static void test_accumulation(void)
{
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int streaming = 0; streaming < 2; streaming++) {
            dspec s;
            spec_default(&s);
            s.seed = 300 + dv * 2 + (uint64_t)streaming;
            s.o.divergence = divergences[dv].divergence;
            s.o.beta = divergences[dv].beta;
            s.o.temperature = 0.7;
            s.o.weight_soft_loss = 0.6;
            s.o.weight_hard_loss = 0.4;
            s.s_bias = 1;
            s.grad_beta = 1.0f;
            s.sched = streaming ? STREAMING : ROW_BLOCKS;
            check_case(&s, "beta 1");
        }
    print_worst("beta 1");
}

/* Every token ignored: loss, soft_loss, hard_loss and every per-token loss exactly 0 (a mean over no token is 0,
 * documented), and every gradient exactly 0 (every row's coefficient is 0, so dU is 0 and the GEMMs sum zeros),
 * overwriting NaN; for each divergence, reduction and schedule, fh_distill_forward too. */
static void test_all_ignored(void)
{
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int red = 0; red < 3; red++)
            for (int sched = 0; sched < 3; sched++) {
        dspec s;
                spec_default(&s);
                s.seed = 400 + (uint64_t)(dv * 9 + (size_t)red * 3 + (size_t)sched);
                s.n = 9;
                s.o.divergence = divergences[dv].divergence;
                s.o.beta = divergences[dv].beta;
                s.o.reduction = (fh_reduction)red;
                s.o.weight_hard_loss = sched == 1 ? 0.4 : 0.0;
                s.s_bias = 1;
                s.sched = (schedule)sched;
                s.varied_grad = red == FH_REDUCTION_NONE;
                char desc[512];
                describe(&s, desc, sizeof desc);
                dcase c;
                memset(&c, 0, sizeof c);
                c.spec = s;
                make_inputs(&s, &c);
                for (int64_t i = 0; i < s.n; i++)
                    c.targets[i] = s.o.ignore_index;
                const fh_status st = run_fused(&c);
                TU_CHECK(st == FH_OK, "all ignored [%s]: status %d", desc, (int)st);
                if (st == FH_OK) {
                    const size_t n = (size_t)s.n, h = (size_t)s.hs, v = (size_t)s.vocab;
                    const fused *f[2] = {&c.forward, &c.step};
                    for (int k = 0; k < 2; k++)
                        TU_CHECK(f[k]->loss == 0.0 && f[k]->soft == 0.0 && f[k]->hard == 0.0 &&
                                     tu_all_equal_f(f[k]->per_token, n, 0.0f),
                                 "all ignored [%s], %s: loss %g soft %g hard %g, or a per-token loss not 0", desc,
                                 k ? "step" : "forward", f[k]->loss, f[k]->soft, f[k]->hard);
                    TU_CHECK(tu_all_equal_f(c.step.dx, n * h, 0.0f) && tu_all_equal_f(c.step.dweight, h * v, 0.0f) &&
                                 tu_all_equal_f(c.step.dbias, v, 0.0f),
                             "all ignored [%s]: a gradient is not exactly 0", desc);
                    TU_CHECK(run_reference(&c) == 0 && c.ref_loss == 0.0 && tu_max_abs_d(c.ref_dx, n * h) == 0.0,
                             "all ignored [%s]: the reference disagrees (loss %g)", desc, c.ref_loss);
                }
                case_free(&c);
            }
}

/* jsd near its maximum. With independent heads whose logits spread widely (standard deviation 3, temperature 0.7 or
 * 0.5), p and q barely overlap and D approaches its bound -beta log beta - (1 - beta) log(1 - beta). There
 * log p - log m is ~ -log(1 - beta) wherever p is not negligible, and the gradient (1 - beta) p (log p - log m - K)
 * written that way is a difference of nearly equal values of size ~1: formed in fp32 it was off by 1e-5 to 1e-4
 * normwise here (2e-3 for a single row). In such rows the kernels form it as (1 - beta) p (sum p sp - sp) with
 * sp = softplus(log(beta / (1 - beta)) + log q - log p), small where the distributions do not overlap and exact to
 * fp32 (fh_row_pair_gradient picks that form per row), so the usual tolerances hold: this test checks them in that
 * regime, both schedules and kernel sets alike, and that D is within 20% of its bound (the regime is the one
 * described). */
static void test_jsd_near_saturation(void)
{
    static const double temperatures[] = {0.7, 0.5};
    static const double betas[] = {0.5, 0.3};
    double worst = 0.0;
    int k = 0;
    for (size_t ti = 0; ti < TU_COUNT(temperatures); ti++)
        for (size_t bi = 0; bi < TU_COUNT(betas); bi++)
            for (int streaming = 0; streaming < 2; streaming++, k++) {
        dspec s;
                spec_default(&s);
                s.seed = 600 + (uint64_t)k;
                s.logit_scale = 3.0;
                s.targets = 0;
                s.o.divergence = FH_DIVERGENCE_JSD;
                s.o.beta = betas[bi];
                s.o.temperature = temperatures[ti];
                s.sched = streaming ? STREAMING : ROW_BLOCKS;
                char desc[512];
                describe(&s, desc, sizeof desc);
                dcase c;
                memset(&c, 0, sizeof c);
                c.spec = s;
                make_inputs(&s, &c);
                const fh_status st = run_fused(&c);
                TU_CHECK(st == FH_OK, "jsd near saturation [%s]: status %d", desc, (int)st);
                if (st != FH_OK || run_reference(&c) != 0) {
                    case_free(&c);
                    continue;
                }
                const size_t n = (size_t)s.n, h = (size_t)s.hs, v = (size_t)s.vocab;
                const double rel = fmax(grad_err(c.step.dx, c.ref_dx, n * h, 1.0),
                                        grad_err(c.step.dweight, c.ref_dweight, h * v, 1.0));
                const double bound = -s.o.beta * log(s.o.beta) - (1.0 - s.o.beta) * log1p(-s.o.beta);
                const double loss = fmax(outputs_err(&c, &c.forward), outputs_err(&c, &c.step));
                const double tokens = fmax(token_err(c.forward.per_token, c.ref_per_token, n),
                                           token_err(c.step.per_token, c.ref_per_token, n));
                TU_CHECK(rel <= DISTILL_GRAD_TOL && loss <= DISTILL_LOSS_TOL && tokens <= DISTILL_TOKEN_TOL &&
                             c.ref_loss > 0.8 * bound,
                         "jsd near saturation [%s]: D %.6f of its bound %.6f; gradient error %.2e (tol %g); loss "
                         "%.2e, per-token %.2e",
                         desc, c.ref_loss, bound, rel, DISTILL_GRAD_TOL, loss, tokens);
                worst = fmax(worst, rel);
                case_free(&c);
            }
    const char *verbose = getenv("FH_TEST_VERBOSE");
    if (verbose && verbose[0] != '0')
        fprintf(stderr, "\n[distill jsd near saturation] gradient error %.2e\n", worst);
}

/* A bf16 case of divergences[dv] (V = 2053), with bf16 gradients when gd. */
static void bf16_spec(dspec *s, uint64_t seed, size_t dv, int gd)
{
    spec_default(s);
    s->seed = seed;
    s->vocab = 2053;
    s->dtype = FH_DTYPE_BF16;
    s->grad_dtype = gd ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    s->o.divergence = divergences[dv].divergence;
    s->o.beta = divergences[dv].beta;
}

/* bf16 student and teacher (raw bf16 bits; the reference on the bf16-valued inputs), fp32 and bf16 gradients, every
 * divergence, row blocks (default budget) and streaming, temperature 0.7 and the hard loss on alternate cases, the
 * tolerances of the header comment. V = 2053 (= 32 x 64 + 5) so that the streaming budget below 8 V also holds
 * the bf16 path's f32 accumulators. */
static void test_bf16(void)
{
    int k = 0;
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int gd = 0; gd < 2; gd++)
            for (int streaming = 0; streaming < 2; streaming++, k++) {
                dspec s;
                bf16_spec(&s, 500 + (uint64_t)k, dv, gd);
                const int hard = gd ^ streaming ^ (int)(dv & 1);
                s.o.temperature = streaming ^ (int)((dv >> 1) & 1) ? 0.7 : 1.0;
                s.o.weight_soft_loss = hard ? 0.6 : 1.0;
                s.o.weight_hard_loss = hard ? 0.4 : 0.0;
                s.o.reduction = (fh_reduction)((dv + (size_t)gd + (size_t)streaming) % 3);
                s.varied_grad = s.o.reduction == FH_REDUCTION_NONE;
                s.s_layout = k % 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
                s.t_layout = (k / 3) % 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
                s.s_bias = 1;
                s.t_bias = k % 2;
                s.s_pad = k % 4 == 1 ? 3 : 0;
                s.sched = streaming ? STREAMING : ROW_BLOCKS;
                check_case(&s, "bf16");
            }
    /* Every row's bf16 dU beyond the budget: at N = 120 (96 counted), H = 16, V = 2053, 7-row blocks (both heads'
     * fp32 logits and the bf16 dU, 10 V bytes a row) in spans whose dweight adds into the f32 accumulator (4 H V),
     * 134 V and more of a 180 V budget that the 248 V of every row's dU beside a block exceed; each divergence, fp32
     * and bf16 gradients, against the reference at the tolerances of the header comment. */
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int gd = 0; gd < 2; gd++) {
            dspec s;
            bf16_spec(&s, 540 + 2 * (uint64_t)dv + (uint64_t)gd, dv, gd);
            s.n = 120;
            s.hs = 16;
            s.s_bias = 1;
            s.o.weight_hard_loss = gd ? 0.4 : 0.0;
            s.sched = ROW_BLOCKS_ACC;
            check_case(&s, "bf16, dweight accumulator");
        }
    /* beta 1 onto bf16 gradients, in both schedules. */
    for (int streaming = 0; streaming < 2; streaming++) {
        dspec s;
        spec_default(&s);
        s.seed = 550 + (uint64_t)streaming;
        s.vocab = 2053;
        s.dtype = s.grad_dtype = FH_DTYPE_BF16;
        s.s_bias = 1;
        s.o.weight_hard_loss = 0.4;
        s.grad_beta = 1.0f;
        s.sched = streaming ? STREAMING : ROW_BLOCKS;
        check_case(&s, "bf16 beta 1");
    }
    /* Mixed dtypes (each head's x and weight agree, the heads need not): an fp32 student with a bf16 teacher keeps
     * the fp32 tolerances (the teacher's logits are exact products of bf16 values summed in fp32), a bf16 student
     * with an fp32 teacher the bf16 ones. */
    for (int student_bf16 = 0; student_bf16 < 2; student_bf16++)
        for (int streaming = 0; streaming < 2; streaming++) {
            dspec s;
            spec_default(&s);
            s.seed = 560 + (uint64_t)(2 * student_bf16 + streaming);
            s.vocab = 2053;
            s.dtype = student_bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
            s.mixed = 1;
            s.s_bias = s.t_bias = 1;
            s.o.temperature = 0.7;
            s.o.weight_soft_loss = 0.6;
            s.o.weight_hard_loss = 0.4;
            s.o.divergence = streaming ? FH_DIVERGENCE_REVERSE_KL : FH_DIVERGENCE_JSD;
            s.sched = streaming ? STREAMING : ROW_BLOCKS;
            check_case(&s, "mixed dtypes");
        }
    print_worst("bf16");
}

/* Top-k (TRL 1.16.0's IWOPDTrainer.generalized_jsd_loss with top_k and add_tail): every divergence x top_k 1, 20,
 * 256 x with and without the tail x row blocks / streaming, at V = 1031 (256 a quarter of it; jsd's union up to
 * half), the other inputs rotating as in the reference matrix (temperature, hard loss, reduction, layouts, biases,
 * ignored tokens, two threads, a caller's workspace of the queried size); then bf16 (V = 2053) with fp32 and bf16
 * gradients. The tolerances are the head's own: the selection reads the fp32 logits as the reference reads double
 * ones (a tie within the GEMM's rounding at the k-th place would choose another column; these draws have none), and
 * the divergence over the support is formed in double from those fp32 logits, so the loss keeps the full head's
 * bound and dU its fp32 rounding. */
static void test_topk(void)
{
    static const int64_t ks[] = {1, 20, 256};
    int k = 0;
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (size_t ki = 0; ki < TU_COUNT(ks); ki++)
            for (int tail = 0; tail < 2; tail++)
                for (int streaming = 0; streaming < 2; streaming++, k++) {
                    dspec s;
                    matrix_spec(&s, 1000 + (uint64_t)k, dv, k % 3 == 1, k % 4 == 2, (fh_reduction)(k % 3), k,
                                streaming);
                    s.o.top_k = ks[ki];
                    s.o.add_tail = tail;
                    s.caller_workspace = k % 5 == 3;
                    if (k % 17 == 5)
                        s.threads = 2;
                    check_case(&s, "top-k");
                }
    k = 0;
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++)
        for (int gd = 0; gd < 2; gd++, k++) {
            dspec s;
            bf16_spec(&s, 1100 + (uint64_t)k, dv, gd);
            s.o.top_k = 20;
            s.o.add_tail = k % 2;
            s.o.temperature = k % 3 == 0 ? 0.7 : 1.0;
            s.s_bias = 1;
            s.sched = k % 4 < 2 ? ROW_BLOCKS : STREAMING;
            check_case(&s, "top-k bf16");
        }
    print_worst("top-k");
}

/* top_k of V or more is the whole vocabulary (TRL's `student_logits.size(-1) > top_k` test): the same bits as
 * top_k 0, every divergence, with the tail asked for (it is not added). */
static void test_topk_whole_vocabulary(void)
{
    for (size_t dv = 0; dv < TU_COUNT(divergences); dv++) {
        dspec s;
        spec_default(&s);
        s.seed = 1200 + (uint64_t)dv;
        s.o.divergence = divergences[dv].divergence;
        s.o.beta = divergences[dv].beta;
        dcase whole, wide;
        if (!run_case(&s, "top_k 0", &whole))
            continue;
        s.o.top_k = s.vocab;
        if (run_case(&s, "top_k V", &wide)) {
            const size_t n = (size_t)s.n, h = (size_t)s.hs, v = (size_t)s.vocab;
            TU_CHECK(whole.step.loss == wide.step.loss &&
                         !memcmp(whole.step.per_token, wide.step.per_token, n * sizeof(float)) &&
                         !memcmp(whole.step.dx, wide.step.dx, n * h * sizeof(float)) &&
                         !memcmp(whole.step.dweight, wide.step.dweight, h * v * sizeof(float)),
                     "%s: top_k = V is not the whole vocabulary bit for bit", divergence_name(&s.o));
            case_free(&wide);
        }
        case_free(&whole);
    }
}

/* ================================================================================================
 * A hand-built problem: the workspace and the API contracts
 * ============================================================================================== */

enum { N = 6, HS = 4, HT = 5, V = 7 };

/* Everything a call writes, in one block so that one memcmp covers it. */
typedef struct outputs {
    double loss, soft, hard;
    float per_token[N];
    float dx[N * HS], dweight[HS * V], dbias[V];
} outputs;

/* Everything a call reads. */
typedef struct inputs {
    float xs[N * HS], ws[HS * V], bs[V], xt[N * HT], wt[V * HT], bt[V];
    int64_t targets[N];
    float grad_output[N];
} inputs;

typedef struct fixture {
    fh_context *ctx;
    inputs in;
    outputs out;
    fh_linear student, teacher;
    fh_distill_options options;
    fh_distill_outputs dout;
    fh_linear_grads grads;
    /* what gets passed */
    fh_context *call_ctx;
    const fh_linear *call_student, *call_teacher;
    const int64_t *call_targets;
    const fh_distill_options *call_options;
    fh_distill_outputs *call_out;
    const float *call_grad_output;
    fh_linear_grads *call_grads;
} fixture;

/* A valid call that uses every input: jsd 0.5, temperature 0.7, weight_hard_loss 0.4 (soft 0.6), 'none' with a
 * grad_output per token, both biases, the teacher [V, H] with its own hidden size; token 2 ignored. Outputs hold
 * the canary. */
static void fixture_init(void *fixture_)
{
    fixture *f = fixture_;
    memset(f, 0, sizeof *f);
    TU_CHECK(fh_context_create(&f->ctx) == FH_OK, "fh_context_create");
    uint64_t rng = 4242;
    tu_fill_uniform(f->in.xs, N * HS, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.ws, HS * V, &rng, -1.5, 1.5);
    tu_fill_uniform(f->in.bs, V, &rng, -0.5, 0.5);
    tu_fill_uniform(f->in.xt, N * HT, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.wt, V * HT, &rng, -1.5, 1.5);
    tu_fill_uniform(f->in.bt, V, &rng, -0.5, 0.5);
    tu_fill_uniform(f->in.grad_output, N, &rng, -1.5, 1.5);
    for (int i = 0; i < N; i++)
        f->in.targets[i] = (int64_t)(ref_uniform(&rng) * V);
    f->in.targets[2] = -100;
    fh_linear_init(&f->student, N, HS, V, f->in.xs, f->in.ws, FH_LAYOUT_HV, f->in.bs);
    fh_linear_init(&f->teacher, N, HT, V, f->in.xt, f->in.wt, FH_LAYOUT_VH, f->in.bt);
    fh_distill_options_init(&f->options);
    f->options.temperature = 0.7;
    f->options.weight_soft_loss = 0.6;
    f->options.weight_hard_loss = 0.4;
    f->options.reduction = FH_REDUCTION_NONE;
    const fh_distill_outputs o = {&f->out.loss, &f->out.soft, &f->out.hard, f->out.per_token};
    f->dout = o;
    const fh_linear_grads g = {.dx = f->out.dx, .dx_row_stride = HS, .dweight = f->out.dweight, .dbias = f->out.dbias};
    f->grads = g;
    tu_fill_canary(&f->out, sizeof f->out);
    f->call_ctx = f->ctx;
    f->call_student = &f->student;
    f->call_teacher = &f->teacher;
    f->call_targets = f->in.targets;
    f->call_options = &f->options;
    f->call_out = &f->dout;
    f->call_grad_output = f->in.grad_output;
    f->call_grads = &f->grads;
}

enum { FWD = 1, STEP = 2, BOTH = 3 };

static fh_status call(void *fixture_, int which)
{
    const fixture *f = fixture_;
    if (which == FWD)
        return fh_distill_forward(f->call_ctx, f->call_student, f->call_teacher, f->call_targets, f->call_options,
                                  f->call_out);
    return fh_distill_forward_backward(f->call_ctx, f->call_student, f->call_teacher, f->call_targets, f->call_options,
                                       f->call_grad_output, f->call_out, f->call_grads);
}

static const char *call_name(int which)
{
    return which == FWD ? "fh_distill_forward" : "fh_distill_forward_backward";
}

#define OUT(name, member, calls, kind) CD_OUTPUT(fixture, name, member, calls, kind)
static const cd_output parts[] = {
    OUT("loss", loss, BOTH, CD_F64),
    OUT("soft_loss", soft, BOTH, CD_F64),
    OUT("hard_loss", hard, BOTH, CD_F64),
    OUT("per_token_loss", per_token, BOTH, CD_F32),
    OUT("dx", dx, STEP, CD_F32),
    OUT("dweight", dweight, STEP, CD_F32),
    OUT("dbias", dbias, STEP, CD_F32),
};
#undef OUT
static const cd_api api = {CD_FIXTURE(fixture), .init = fixture_init, .call = call, .call_name = call_name,
                           .all = BOTH, .parts = parts, .part_count = TU_COUNT(parts)};

/* The fixture's step against the reference, at the drawn cases' tolerances. */
static void check_fixture(fixture *f, const char *label)
{
    const fh_status st = call(f, STEP);
    TU_CHECK(st == FH_OK, "%s: status %d (%s)", label, (int)st, fh_status_string(st));
    if (st != FH_OK)
        return;
    double *xs = tu_doubles(f->in.xs, N * HS), *ws = tu_doubles(f->in.ws, HS * V), *bs = tu_doubles(f->in.bs, V);
    double *xt = tu_doubles(f->in.xt, N * HT), *bt = tu_doubles(f->in.bt, V);
    double *wt = ce_weight_to_reference(FH_LAYOUT_VH, HT, V, f->in.wt), *g = tu_doubles(f->in.grad_output, N);
    const ref_linear rs = {N, HS, V, xs, ws, f->student.bias ? bs : NULL};
    const ref_linear rt = {N, HT, V, xt, wt, f->teacher.bias ? bt : NULL};
    const ref_distill_options o = ref_options(&f->options);
    double per_token[N], dx[N * HS], dw[HS * V], db[V];
    ref_distill_result r = {0};
    r.per_token_loss = per_token;
    const int rc = ref_distill_linear(&rs, &rt, f->call_targets, &o, g, &r, dx, dw, f->student.bias ? db : NULL);
    TU_CHECK(rc == 0, "%s: the reference failed (%d)", label, rc);
    const double loss = fmax(loss_err(f->out.loss, r.loss), fmax(loss_err(f->out.soft, r.soft_loss),
                                                                 loss_err(f->out.hard, r.hard_loss)));
    const double tokens = token_err(f->out.per_token, per_token, N);
    double grads = fmax(grad_err(f->out.dx, dx, N * HS, 1.0), grad_err(f->out.dweight, dw, HS * V, 1.0));
    if (f->student.bias)
        grads = fmax(grads, grad_err(f->out.dbias, db, V, 1.0));
    TU_CHECK(loss <= DISTILL_LOSS_TOL && tokens <= DISTILL_TOKEN_TOL && grads <= DISTILL_GRAD_TOL,
             "%s: loss %.17g vs %.17g (worst of loss/soft/hard %.2e), per-token %.2e, gradients %.2e", label,
             f->out.loss, r.loss, loss, tokens, grads);
    void *a[] = {xs, ws, bs, xt, wt, bt, g};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
}

/* ---- the invalid arguments ---- */
#define MUTATION(fn, body) \
    static void fn(void *fixture_) { fixture *f = fixture_; body; }
MUTATION(null_ctx, f->call_ctx = NULL)
MUTATION(null_student, f->call_student = NULL)
MUTATION(null_teacher, f->call_teacher = NULL)
MUTATION(null_student_x, f->student.x = NULL)
MUTATION(null_teacher_weight, f->teacher.weight = NULL)
MUTATION(null_options, f->call_options = NULL)
MUTATION(null_outputs, f->call_out = NULL)
MUTATION(null_grad_output, f->call_grad_output = NULL)
MUTATION(null_grads, f->call_grads = NULL)
MUTATION(teacher_n_smaller, f->teacher.n = N - 1)
MUTATION(teacher_n_larger, f->student.n = N - 1)
MUTATION(teacher_vocab_smaller, f->teacher.vocab = V - 1)
MUTATION(teacher_vocab_larger, f->student.vocab = V - 1)
MUTATION(teacher_stride_short, f->teacher.x_row_stride = HT - 1)
MUTATION(beta_negative, f->options.beta = -0.1)
MUTATION(beta_above_one, f->options.beta = 1.0 + 1e-9)
MUTATION(beta_nan, f->options.beta = NAN)
MUTATION(beta_nan_forward_kl, (f->options.divergence = FH_DIVERGENCE_FORWARD_KL, f->options.beta = NAN))
MUTATION(weight_soft_negative, f->options.weight_soft_loss = -0.5)
MUTATION(weight_soft_nan, f->options.weight_soft_loss = NAN)
MUTATION(weight_soft_inf, f->options.weight_soft_loss = INFINITY)
MUTATION(weight_hard_negative, f->options.weight_hard_loss = -1e-3)
MUTATION(weight_hard_inf, f->options.weight_hard_loss = INFINITY)
MUTATION(weight_hard_nan, f->options.weight_hard_loss = NAN)
MUTATION(divergence_three, f->options.divergence = (fh_divergence)3)
MUTATION(divergence_negative, f->options.divergence = (fh_divergence)-1)
MUTATION(temperature_zero, f->options.temperature = 0.0)
MUTATION(temperature_negative, f->options.temperature = -0.7)
MUTATION(temperature_nan, f->options.temperature = NAN)
MUTATION(temperature_inf, f->options.temperature = INFINITY)
MUTATION(temperature_tiny, f->options.temperature = 1e-300) /* 1 / temperature is not an fp32 value */
MUTATION(reduction_three, f->options.reduction = (fh_reduction)3)
MUTATION(reduction_negative, f->options.reduction = (fh_reduction)-1)
MUTATION(targets_null_with_hard, f->call_targets = NULL)
MUTATION(target_equals_vocab, f->in.targets[3] = V)
MUTATION(target_minus_one, f->in.targets[0] = -1)
MUTATION(target_out_of_range_soft_only, (f->options.weight_hard_loss = 0.0, f->in.targets[5] = V + 10))
MUTATION(none_without_per_token, f->dout.per_token_loss = NULL)
MUTATION(grad_output_nan, f->in.grad_output[4] = NAN)
MUTATION(grad_output_inf, f->in.grad_output[0] = -INFINITY)
MUTATION(grad_output_mean_nan, (f->options.reduction = FH_REDUCTION_MEAN, f->in.grad_output[0] = NAN))
MUTATION(dx_beta_half, f->grads.dx_beta = 0.5f)
MUTATION(dbias_without_bias, f->student.bias = NULL)
MUTATION(budget_one, fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, 1))
MUTATION(nonfinite_teacher_checked, (fh_context_set(f->ctx, FH_PARAM_CHECK_FINITE, 1), f->in.wt[3] = INFINITY))
MUTATION(nonfinite_student_checked, (fh_context_set(f->ctx, FH_PARAM_CHECK_FINITE, 1), f->in.xs[1] = NAN))
/* Outputs over inputs (README, Conventions: FH_ERR_OVERLAPPING_BUFFERS). */
MUTATION(per_token_over_teacher_x, f->dout.per_token_loss = f->in.xt)
MUTATION(dx_over_targets, f->grads.dx = (float *)f->in.targets)

#define OPTION FH_ERR_INVALID_DISTILL_OPTION
#define TEMPERATURE FH_ERR_INVALID_TEMPERATURE
static const cd_case bad_cases[] = {
    {"NULL context", null_ctx, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL student", null_student, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL teacher", null_teacher, BOTH, FH_ERR_NULL_POINTER, "teacher"},
    {"NULL student x", null_student_x, BOTH, FH_ERR_NULL_POINTER, "x"},
    {"NULL teacher weight", null_teacher_weight, BOTH, FH_ERR_NULL_POINTER, "teacher"},
    {"NULL options", null_options, BOTH, FH_ERR_NULL_POINTER, "options"},
    {"NULL outputs", null_outputs, BOTH, FH_ERR_NULL_POINTER, "outputs"},
    {"NULL grad_output", null_grad_output, STEP, FH_ERR_NULL_POINTER, "grad_output"},
    {"NULL grads", null_grads, STEP, FH_ERR_NULL_POINTER, "fh_linear_grads"},
    {"teacher n = N - 1", teacher_n_smaller, BOTH, FH_ERR_TEACHER_MISMATCH, "teacher"},
    {"teacher n > student n", teacher_n_larger, BOTH, FH_ERR_TEACHER_MISMATCH, "teacher"},
    {"teacher V = V - 1", teacher_vocab_smaller, BOTH, FH_ERR_TEACHER_MISMATCH, "teacher"},
    {"teacher V > student V", teacher_vocab_larger, BOTH, FH_ERR_TEACHER_MISMATCH, "teacher"},
    {"teacher x_row_stride < hidden", teacher_stride_short, BOTH, FH_ERR_INVALID_STRIDE, "teacher"},
    {"beta -0.1", beta_negative, BOTH, OPTION, "beta"},
    {"beta 1 + 1e-9", beta_above_one, BOTH, OPTION, "beta"},
    {"beta NaN", beta_nan, BOTH, OPTION, "beta"},
    {"beta NaN (forward_kl)", beta_nan_forward_kl, BOTH, OPTION, "beta"},
    {"weight_soft_loss -0.5", weight_soft_negative, BOTH, OPTION, "weight_soft_loss"},
    {"weight_soft_loss NaN", weight_soft_nan, BOTH, OPTION, "weight_soft_loss"},
    {"weight_soft_loss inf", weight_soft_inf, BOTH, OPTION, "weight_soft_loss"},
    {"weight_hard_loss -1e-3", weight_hard_negative, BOTH, OPTION, "weight_hard_loss"},
    {"weight_hard_loss inf", weight_hard_inf, BOTH, OPTION, "weight_hard_loss"},
    {"weight_hard_loss NaN", weight_hard_nan, BOTH, OPTION, "weight_hard_loss"},
    {"divergence 3", divergence_three, BOTH, OPTION, "divergence"},
    {"divergence -1", divergence_negative, BOTH, OPTION, "divergence"},
    {"temperature 0", temperature_zero, BOTH, TEMPERATURE, "temperature"},
    {"temperature -0.7", temperature_negative, BOTH, TEMPERATURE, "temperature"},
    {"temperature NaN", temperature_nan, BOTH, TEMPERATURE, "temperature"},
    {"temperature inf", temperature_inf, BOTH, TEMPERATURE, "temperature"},
    {"temperature 1e-300", temperature_tiny, BOTH, TEMPERATURE, "temperature"},
    {"reduction 3", reduction_three, BOTH, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"reduction -1", reduction_negative, BOTH, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"targets NULL with weight_hard_loss 0.4", targets_null_with_hard, BOTH, FH_ERR_NULL_POINTER, "targets"},
    {"target = V", target_equals_vocab, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"target = -1", target_minus_one, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"target = V + 10, soft only", target_out_of_range_soft_only, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"'none' without per_token_loss", none_without_per_token, BOTH, FH_ERR_MISSING_OUTPUT, "per_token_loss"},
    {"grad_output[4] NaN ('none')", grad_output_nan, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output[0] -inf ('none')", grad_output_inf, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output NaN (mean)", grad_output_mean_nan, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"dx_beta 0.5", dx_beta_half, STEP, FH_ERR_INVALID_BETA, "dx_beta"},
    {"dbias requested without bias", dbias_without_bias, STEP, FH_ERR_NULL_POINTER, "bias"},
    {"memory budget 1 byte", budget_one, BOTH, FH_ERR_BUDGET_TOO_SMALL, "budget"},
    {"inf in the teacher's weight with FH_PARAM_CHECK_FINITE", nonfinite_teacher_checked, BOTH, FH_ERR_NONFINITE_INPUT,
     "teacher"},
    {"NaN in the student's x with FH_PARAM_CHECK_FINITE", nonfinite_student_checked, BOTH, FH_ERR_NONFINITE_INPUT,
     NULL},
    {"per_token_loss over the teacher's x", per_token_over_teacher_x, BOTH, FH_ERR_OVERLAPPING_BUFFERS,
     "per_token_loss"},
    {"dx over targets", dx_over_targets, STEP, FH_ERR_OVERLAPPING_BUFFERS, "dx"},
};
#undef OPTION
#undef TEMPERATURE

/* Each invalid argument returns its own documented status from each entry point that takes it, leaves every output
 * bit-identical (the canary) and every input untouched, and the context message is nonempty and names the
 * problem. */
static void test_bad_arguments(void)
{
    cd_run_bad_arguments(&api, bad_cases, TU_COUNT(bad_cases));
}

/* After a success, an error sets a message and the next success clears it; the boundary values beta 1, beta 0 and
 * weight_soft_loss 0 are accepted. */
MUTATION(temperature_back_beta_one, (f->options.temperature = 0.7, f->options.beta = 1.0))
MUTATION(beta_zero_soft_zero, (f->options.beta = 0.0, f->options.weight_soft_loss = 0.0))
static const cd_case error_then_success[] = {
    {"temperature 0", temperature_zero, BOTH, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature 0.7, beta 1", temperature_back_beta_one, BOTH, FH_OK, NULL},
    {"beta 0, weight_soft_loss 0", beta_zero_soft_zero, BOTH, FH_OK, NULL},
};

static void ignored_token_is_zero(void *fixture_, int which)
{
    const fixture *f = fixture_;
    TU_CHECK(f->out.per_token[2] == 0.0f, "%s: the ignored token's per_token_loss is %g", call_name(which),
             (double)f->out.per_token[2]);
}

/* The unbroken fixture succeeds, matches the reference and writes exactly the outputs its call produces (so that the
 * canary comparisons above can fail); the targets NULL with weight_hard_loss 0 (hard_loss then 0) are accepted; with
 * targets and weight_hard_loss 0, hard_loss is still reported (and matches the reference). */
static void test_valid_calls(void)
{
    cd_run_valid_calls(&api, error_then_success, TU_COUNT(error_then_success), ignored_token_is_zero);
    /* Against the reference: the fixture, its teacher without bias, its student without bias (dbias not asked),
     * weight_hard_loss 0 with targets (hard_loss still reported) and without (hard_loss 0), mean and sum. */
    for (int variant = 0; variant < 6; variant++) {
        fixture f;
        fixture_init(&f);
        char label[64];
        snprintf(label, sizeof label, "fixture variant %d", variant);
        if (variant == 1)
            f.teacher.bias = NULL;
        if (variant == 2) {
            f.student.bias = NULL;
            f.grads.dbias = NULL;
        }
        if (variant >= 3) {
            f.options.weight_hard_loss = 0.0;
            f.options.reduction = variant == 3 ? FH_REDUCTION_MEAN : FH_REDUCTION_SUM;
        }
        if (variant == 5)
            f.call_targets = NULL;
        check_fixture(&f, label);
        if (variant == 3)
            TU_CHECK(f.out.hard > 0.0, "weight_hard_loss 0 with targets: hard_loss %g, expected it reported",
                     f.out.hard);
        if (variant == 5)
            TU_CHECK(f.out.hard == 0.0 && f.out.per_token[2] != 0.0,
                     "targets NULL: hard_loss %g (expected 0), token 2 counted: per_token %g", f.out.hard,
                     (double)f.out.per_token[2]);
        fh_context_destroy(f.ctx);
    }
}

/* A caller workspace of exactly fh_distill_workspace_size bytes works for both calls with nothing written outside
 * it; one byte less fails with FH_ERR_WORKSPACE_TOO_SMALL, untouched outputs and a message naming the workspace.
 * The fixture at the default budget (one row block), and with 2 x 3 tiles (row blocks of 2 rows; the forward streams
 * 3-column tiles); then drawn cases on the streaming schedule (the budget below 8 V bytes), fp32 and bf16, whose
 * exact-size run is checked against the reference. The query's own checks, and its purity. */
static const char *const tilings[] = {"default tiles", "2 x 3 tiles"};
static void set_tiles(void *fixture_, size_t k)
{
    fixture *f = fixture_;
    if (k)
        TU_CHECK(fh_context_set(f->ctx, FH_PARAM_TILE_ROWS, 2) == FH_OK &&
                     fh_context_set(f->ctx, FH_PARAM_TILE_VOCAB, 3) == FH_OK,
                 "set tiles");
}

static fh_status size_query(void *fixture_, int which, size_t *bytes)
{
    const fixture *f = fixture_;
    (void)which; /* one query for both calls */
    return fh_distill_workspace_size(f->call_ctx, f->call_student, f->call_teacher, &f->options, bytes);
}

/* The step in the exact-size workspace against the reference. */
static void step_matches_reference(void *fixture_, int which, const char *label)
{
    if (which == STEP)
        check_fixture(fixture_, label);
}

MUTATION(teacher_n_zero, f->teacher.n = 0)
static const cd_case query_refusals[] = {
    {"NULL context", null_ctx, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL student", null_student, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL teacher", null_teacher, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"teacher n = 0", teacher_n_zero, BOTH, FH_ERR_INVALID_SIZE, NULL},
};

static void test_workspace(void)
{
    static const size_t offsets[] = {0, 1, 8};
    static const cd_workspace w = {offsets, TU_COUNT(offsets), tilings, TU_COUNT(tilings), set_tiles, size_query,
                                   step_matches_reference, query_refusals, TU_COUNT(query_refusals)};
    cd_run_workspace(&api, &w);
    for (int bf16 = 0; bf16 < 2; bf16++) {
        dspec s;
        spec_default(&s);
        s.seed = 700 + (uint64_t)bf16;
        s.sched = STREAMING;
        s.s_bias = 1;
        s.o.weight_hard_loss = 0.4;
        if (bf16) {
            s.vocab = 2053;
            s.dtype = s.grad_dtype = FH_DTYPE_BF16;
        }
        /* one byte less, on the streaming schedule: the step fails before writing anything */
        dcase c;
        memset(&c, 0, sizeof c);
        c.spec = s;
        make_inputs(&s, &c);
        fh_context *ctx = case_context(&s);
        size_t bytes = 0;
        TU_CHECK(fh_distill_workspace_size(ctx, &c.s.lin, &c.t.lin, &s.o, &bytes) == FH_OK &&
                     bytes <= (size_t)stream_budget(&s),
                 "streaming %s: query %zu bytes, budget %lld", bf16 ? "bf16" : "fp32", bytes,
                 (long long)stream_budget(&s));
        unsigned char *block = tu_alloc(bytes, 1);
        fh_context_set_workspace(ctx, block, bytes - 1);
        const size_t nh = (size_t)(s.n * s.hs);
        float *dx = tu_alloc(nh, sizeof(float)), *canary = tu_alloc(nh, sizeof(float));
        tu_fill_canary(dx, nh * sizeof(float));
        tu_fill_canary(canary, nh * sizeof(float));
        double loss = 12345.0;
        fh_distill_outputs out = {&loss, NULL, NULL, NULL};
        fh_linear_grads g = {.dx = dx, .dx_row_stride = s.hs};
        const fh_status st = fh_distill_forward_backward(ctx, &c.s.lin, &c.t.lin, c.targets, &s.o, c.grad_output,
                                                         &out, &g);
        TU_CHECK(st == FH_ERR_WORKSPACE_TOO_SMALL && loss == 12345.0 &&
                     memcmp(dx, canary, nh * sizeof(float)) == 0,
                 "streaming %s, bytes - 1: status %d, outputs %s", bf16 ? "bf16" : "fp32", (int)st,
                 loss == 12345.0 ? "untouched" : "written");
        free(dx), free(canary), free(block);
        fh_context_destroy(ctx);
        case_free(&c);
        /* exactly the size: both calls against the reference */
        s.caller_workspace = 1;
        check_case(&s, "caller workspace, streaming");
    }
    print_worst("workspace");
}

/* Optional outputs ('mean': per_token_loss may be NULL too): every one NULL; then only soft_loss and dweight. */
MUTATION(no_outputs, (f->options.reduction = FH_REDUCTION_MEAN, memset(&f->dout, 0, sizeof f->dout),
                      memset(&f->grads, 0, sizeof f->grads)))
MUTATION(soft_loss_and_dweight, (f->dout.soft_loss = &f->out.soft, f->grads.dweight = f->out.dweight))
static const cd_optional optional_steps[] = {
    {"'mean', every output and gradient NULL", no_outputs, BOTH, {NULL}},
    {"soft_loss and dweight only", soft_loss_and_dweight, BOTH, {"soft_loss", "dweight"}},
};

/* fh_distill_options_init's documented defaults (jsd, beta 0.5, temperature 1, weights 1 and 0, ignore_index -100,
 * mean), NULL; and "any output may be NULL, except per_token_loss for 'none'", "a NULL pointer skips that gradient". */
static void test_options_init_and_optional_outputs(void)
{
    fh_distill_options o;
    memset(&o, 0x5A, sizeof o);
    TU_CHECK(fh_distill_options_init(&o) == FH_OK, "fh_distill_options_init");
    TU_CHECK(o.divergence == FH_DIVERGENCE_JSD && o.beta == 0.5 && o.temperature == 1.0 && o.weight_soft_loss == 1.0 &&
                 o.weight_hard_loss == 0.0 && o.ignore_index == -100 && o.reduction == FH_REDUCTION_MEAN,
             "documented defaults");
    TU_CHECK(fh_distill_options_init(NULL) == FH_ERR_NULL_POINTER, "fh_distill_options_init(NULL)");

    cd_run_optional_outputs(&api, optional_steps, TU_COUNT(optional_steps));
}

/* "Gradient filtering does not apply to this head": with a filter eps set, the step's outputs and gradients are bit
 * for bit those of eps 0, in both schedules (the fixture: row blocks; 2 x 3 tiles under a 1 KiB budget: streaming). */
static void test_grad_filter_ignored(void)
{
    for (int tiled = 0; tiled < 2; tiled++) {
        outputs results[2];
        for (int filtered = 0; filtered < 2; filtered++) {
            fixture f;
            fixture_init(&f);
            if (tiled)
                TU_CHECK(fh_context_set(f.ctx, FH_PARAM_TILE_ROWS, 2) == FH_OK &&
                             fh_context_set(f.ctx, FH_PARAM_TILE_VOCAB, 3) == FH_OK,
                         "set tiles");
            TU_CHECK(fh_context_set_real(f.ctx, FH_PARAM_GRAD_FILTER_EPS, filtered ? 0.5 : 0.0) == FH_OK, "set eps");
            const fh_status st = call(&f, STEP);
            TU_CHECK(st == FH_OK, "eps %g: status %d", filtered ? 0.5 : 0.0, (int)st);
            results[filtered] = f.out;
            fh_context_destroy(f.ctx);
        }
        TU_CHECK(memcmp(&results[0], &results[1], sizeof results[0]) == 0,
                 "%s: gradient filtering changed the distillation step's results", tiled ? "2 x 3 tiles" : "defaults");
    }
}

/* Ignored rows at temperature 0.05, logits to +-160 (s to +-3200): a call that computes every row (a caller's
 * workspace, gradient filtering on the context) gives finite gradients equal to the default context's, which compacts
 * the ignored rows away: no ignored row's gradient is formed from a statistic it does not have (issue 41). dx bit for
 * bit (a row's dx depends on its own logits only), dweight and dbias to fp32 summation order (1e-6 normwise, as the
 * counted-rows comparisons). */
static void test_ignored_rows_cold_temperature(void)
{
    enum { ROWS = 48, HID = 16, COLS = 300 };
    uint64_t rng = 4143;
    float *x = tu_alloc(ROWS * HID, sizeof(float)), *w = tu_alloc(HID * COLS, sizeof(float));
    float *b = tu_alloc(COLS, sizeof(float));
    float *tx = tu_alloc(ROWS * HID, sizeof(float)), *tw = tu_alloc(HID * COLS, sizeof(float));
    tu_fill_uniform(x, ROWS * HID, &rng, -1.0, 1.0);
    tu_fill_uniform(w, HID * COLS, &rng, -0.5, 0.5);
    tu_fill_uniform(b, COLS, &rng, -150.0, 150.0);
    tu_fill_uniform(tx, ROWS * HID, &rng, -1.0, 1.0);
    tu_fill_uniform(tw, HID * COLS, &rng, -10.0, 10.0);
    int64_t targets[ROWS];
    for (int64_t i = 0; i < ROWS; i++)
        targets[i] = i % 3 == 0 ? -100 : (i * 31) % COLS;
    fh_linear student, teacher;
    fh_linear_init(&student, ROWS, HID, COLS, x, w, FH_LAYOUT_VH, b);
    fh_linear_init(&teacher, ROWS, HID, COLS, tx, tw, FH_LAYOUT_VH, NULL);
    fh_distill_options o;
    fh_distill_options_init(&o);
    o.temperature = 0.05;
    o.weight_hard_loss = 0.5;
    static const char *const names[3] = {"the default context", "a caller's workspace", "gradient filtering"};
    const size_t counts[3] = {ROWS * HID, HID * COLS, COLS};
    const float one = 1.0f;
    float *grads[3][3];
    for (int run = 0; run < 3; run++) {
        for (int j = 0; j < 3; j++)
            grads[run][j] = tu_alloc(counts[j], sizeof(float));
        fh_context *ctx = tu_context(2, 0, 0, 0);
        void *workspace = NULL;
        size_t bytes = 0;
        if (run == 1) {
            TU_CHECK(fh_distill_workspace_size(ctx, &student, &teacher, &o, &bytes) == FH_OK, "workspace size");
            workspace = tu_alloc(bytes, 1);
            TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
        }
        if (run == 2)
            TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0x1.0p-28) == FH_OK, "filtering on");
        double loss = 0.0;
        fh_distill_outputs out = {.loss = &loss};
        fh_linear_grads gr = {.dx = grads[run][0], .dx_row_stride = HID, .dweight = grads[run][1],
                              .dbias = grads[run][2]};
        const fh_status st = fh_distill_forward_backward(ctx, &student, &teacher, targets, &o, &one, &out, &gr);
        TU_CHECK(st == FH_OK, "%s: status %d", names[run], (int)st);
        for (int j = 0; j < 3; j++)
            TU_CHECK(tu_all_finite_f(grads[run][j], counts[j]), "%s: gradient %d finite", names[run], j);
        if (run > 0) {
            TU_CHECK(memcmp(grads[run][0], grads[0][0], counts[0] * sizeof(float)) == 0,
                     "%s: dx bit for bit the default context's", names[run]);
            for (int j = 0; j < 3; j++) {
                const double d = tu_norm_rel_f(grads[run][j], grads[0][j], counts[j]);
                TU_CHECK(d <= 1e-6, "%s: gradient %d %.2e normwise from the default context's", names[run], j, d);
            }
        }
        fh_context_destroy(ctx);
        free(workspace);
    }
    for (int run = 0; run < 3; run++)
        for (int j = 0; j < 3; j++)
            free(grads[run][j]);
    free(x);
    free(w);
    free(b);
    free(tx);
    free(tw);
}

static const tu_test tests[] = {
    {"every divergence, temperature, hard weight, reduction vs reference, both schedules", test_reference_matrix},
    {"layouts, strided x, biases, teacher hidden, all schedules", test_layouts_and_shapes},
    {"gradient beta 1 accumulates", test_accumulation},
    {"a frozen lm_head shared by student and teacher (EAGLE-1/2), no dweight", test_frozen_shared_weight},
    {"every token ignored: loss 0, exact zero gradients", test_all_ignored},
    {"jsd near its maximum: gradient error at the terms' fp32 rounding", test_jsd_near_saturation},
    {"bf16 student and teacher, fp32 and bf16 gradients", test_bf16},
    {"top-k supports (TRL's iw_opd): every divergence, k 1 / 20 / 256, tail or not, fp32 and bf16", test_topk},
    {"top_k of V is the whole vocabulary", test_topk_whole_vocabulary},
    {"each bad argument: own status, untouched outputs, message", test_bad_arguments},
    {"valid calls write their outputs; boundaries; message reset", test_valid_calls},
    {"caller workspace: exact size, size - 1; size query", test_workspace},
    {"options init and optional outputs", test_options_init_and_optional_outputs},
    {"gradient filtering does not apply", test_grad_filter_ignored},
    {"ignored rows at temperature 0.05, logits to +-160: finite gradients in every schedule",
     test_ignored_rows_cold_temperature},
};
const tu_suite suite_distill = {tests, TU_COUNT(tests)};
