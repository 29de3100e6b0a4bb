/* GRPO suites: the fused GRPO head (fh_grpo_forward / fh_grpo_backward / fh_grpo_forward_backward) against the
 * double-precision TRL-semantics reference (ref/ref_grpo.h), on problems built here so that masks, advantages,
 * old and reference log-probs and the clip bounds can be chosen by each test.
 *
 *   grpo_reference    every loss_type x importance_sampling_level x {old log-probs or on-policy} x beta {0, 0.04}
 *                     x delta {off, 1.5}; temperature 0.7; tiles 4 x 16 over N = 35, V = 37 (edges on both sides);
 *                     both layouts, bias on half, the train step on a third, grad_output -0.5 and accumulation
 *                     (gradient beta 1) on some.
 *   grpo_masks        all-zero rows (middle and last: their dx rows must be exactly 0, exactly 1 when accumulating
 *                     onto 1; every gp_check asserts this for every mask-0 token), advantages +, -, 0 and -0,
 *                     fractional mask weights (a row summing to 0.75), the shared grpo_case harness's empty last row,
 *                     a fully masked batch (exact zeros), out-of-range ids under the mask (logp exactly 0, results
 *                     bitwise unchanged).
 *   grpo_clip         ratios on both sides of the clip range and exactly on 1 - eps_low, 1 + eps_high and delta:
 *                     on-policy (r == 1 exactly, bounds moved onto 1), and off-policy in fh_grpo_backward with old
 *                     log-probs built so that logp - old is the same exact double on every token of a category.
 *   grpo_shapes       N = B*T and V at tile - 1, tile, tile + 1 (and V = 1), degenerate tiles, temperature != 1,
 *                     entropy_coef != 0, num_items_in_batch and max_completion_length set explicitly.
 *   grpo_determinism  identical runs bitwise identical (fresh contexts, one context reused, a dirty caller
 *                     workspace), split calls vs the train step, ref log-probs ignored when beta == 0.
 *   (grpo_contracts, in test_grpo_contracts.c: statuses, canaries, messages, workspace.)
 *   grpo_metrics      which metrics are NaN for each loss type (and kl when beta == 0), values against the
 *                     reference, exact values where they can be counted by hand.
 *
 * Tolerances (every comparison below uses these, or says why it is exact):
 *   loss            GRPO_LOSS_TOL * max(1, |loss|)   (ref/grpo_case.c: every term is advantage x ratio-like
 *                   factor x normaliser; the fp32 logits put ~1e-6 on each log-prob)
 *   metrics         GRPO_METRIC_TOL absolute, NaN only against NaN. The clip counts are exact as long as no ratio
 *                   sits within the fused-vs-reference log-prob difference of a bound: old log-probs are drawn here
 *                   at least GP_BOUND_GUARD = 1e-3 (in log-ratio) away from every bound, while the log-probs may
 *                   differ by at most GP_TOKEN_TOL (1 + |logp|) < 2e-4 (asserted; ~1e-6 (1 + |logp|) in practice);
 *                   or the ratio sits exactly on the bound in both (grpo_clip).
 *   gradients       GRPO_GRAD_NORM_REL_TOL normwise relative (same engine and fp32 GEMMs as cross-entropy).
 *   per-token       GP_TOKEN_TOL * (1 + |ref|) on per_token_logp, entropy, lse and per_token_loss (see below). */
#include "grpo_case.h"
#include "grpo_convert.h"
#include "ref_grpo.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Per-token values are stored as fp32: the final rounding alone is 2^-24 |v| ~ 6e-8 (1 + |v|). Before it, the
 * logits carry the fp32 GEMM error (H <= 37 products of |x| <= 1 with weights scaled to logits of ~3, divided by
 * temperature >= 0.7): well under 1e-6, and logp = z_y - lse, H = lse - sum p z and lse are 1-Lipschitz in the
 * max-norm of the logits up to a factor 2. per_token_loss multiplies the log-prob error by r |A| (r < 3 here) or
 * by exp(ref - logp) (< 2) times beta. 1e-5 leaves an order of magnitude over all of that (the largest error seen
 * over these suites is ~1e-6). */
#define GP_TOKEN_TOL 1e-5
/* Minimum |log r - log bound| of drawn ratios (see above). */
#define GP_BOUND_GUARD 1e-3

/* ================================================================================================
 * Problems with caller-chosen inputs
 * ============================================================================================== */

typedef struct gp_problem {
    int64_t batch, seq, hidden, vocab;
    fh_layout layout;
    float *x, *weight, *bias; /* bias NULL when off */
    int64_t *ids;
    float *mask, *adv;
    float *old;  /* NULL: on-policy */
    float *ref;  /* always filled; passed to the library only when beta != 0 */
    uint64_t rng;
} gp_problem;

static void *gp_alloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "fh_tests: out of memory\n");
        abort();
    }
    return p;
}

static int64_t gp_n(const gp_problem *p)
{
    return p->batch * p->seq;
}

/* Random head (logits of typical size 3, ce_fill_linear), random ids, masks with a random-length tail of padding
 * per row and the last row empty when B > 1, padding ids out of range (-100) on every other padded position,
 * advantages cycling +, -, 0 over the rows (magnitudes in [0.25, 1.25)), on-policy, ref log-probs unset. */
static void gp_init(gp_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, fh_layout layout, int bias,
                    uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->batch = B;
    p->seq = T;
    p->hidden = H;
    p->vocab = V;
    p->layout = layout;
    const size_t n = (size_t)(B * T);
    p->x = gp_alloc(n * (size_t)H, sizeof(float));
    p->weight = gp_alloc((size_t)(H * V), sizeof(float));
    p->bias = bias ? gp_alloc((size_t)V, sizeof(float)) : NULL;
    p->ids = gp_alloc(n, sizeof(int64_t));
    p->mask = gp_alloc(n, sizeof(float));
    p->adv = gp_alloc((size_t)B, sizeof(float));
    p->ref = gp_alloc(n, sizeof(float));
    p->rng = seed * 7919 + 11;
    ce_fill_linear(&p->rng, (int64_t)n, H, V, 3.0, p->x, p->weight, p->bias);
    for (int64_t b = 0; b < B; b++) {
        const int64_t length = B > 1 && b == B - 1 ? 0 : 1 + (int64_t)(ce_uniform(&p->rng) * (double)T);
        const double magnitude = 0.25 + ce_uniform(&p->rng);
        p->adv[b] = (float)(b % 3 == 0 ? magnitude : b % 3 == 1 ? -magnitude : 0.0);
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            p->mask[i] = t < length ? 1.0f : 0.0f;
            p->ids[i] = (int64_t)(ce_uniform(&p->rng) * (double)V);
            if (t >= length && (t & 1))
                p->ids[i] = -100;
        }
    }
}

/* After a test rewrites the mask: every unmasked token gets an id in [0, V) (padding keeps its ids). */
static void gp_fix_ids(gp_problem *p)
{
    for (int64_t i = 0; i < gp_n(p); i++)
        if (p->mask[i] != 0.0f && (p->ids[i] < 0 || p->ids[i] >= p->vocab))
            p->ids[i] = (int64_t)(ce_uniform(&p->rng) * (double)p->vocab);
}

static void gp_free(gp_problem *p)
{
    void *a[] = {p->x, p->weight, p->bias, p->ids, p->mask, p->adv, p->old, p->ref};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    memset(p, 0, sizeof *p);
}

static double *gp_doubles(const float *f, size_t count)
{
    if (!f)
        return NULL;
    double *d = gp_alloc(count, sizeof(double));
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

static size_t gp_windex(const gp_problem *p, int64_t k, int64_t j)
{
    return ce_weight_index(p->layout, p->hidden, p->vocab, k, j);
}

/* Untempered logits u = x W + b in double from the fp32 inputs, [n, V]. */
static double *gp_logits(const gp_problem *p)
{
    const int64_t n = gp_n(p), H = p->hidden, V = p->vocab;
    double *u = gp_alloc((size_t)(n * V), sizeof(double));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < V; j++) {
            double acc = p->bias ? p->bias[j] : 0.0;
            for (int64_t k = 0; k < H; k++)
                acc += (double)p->x[i * H + k] * p->weight[gp_windex(p, k, j)];
            u[i * V + j] = acc;
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

static int gp_isnan(double v)
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

/* Old log-probs = reference logp + row offset U(-0.6, 0.6) + token noise U(-0.4, 0.4): ratios in ~[0.37, 2.7] at
 * the token level and spread at the sequence level too. Redrawn until no unmasked token ratio and no sequence
 * ratio (all rows, empty ones included) is within GP_BOUND_GUARD of a bound of `o`. */
static void gp_set_old(gp_problem *p, const fh_grpo_options *o)
{
    const int64_t B = p->batch, T = p->seq, n = gp_n(p);
    double *logp = gp_alloc((size_t)n, sizeof(double)), bounds[4];
    const int nb = gp_bounds(o, bounds);
    gp_reference_logp(p, o->temperature, logp);
    free(p->old);
    p->old = gp_alloc((size_t)n, sizeof(float));
    for (int64_t b = 0; b < B; b++) {
        int attempts = 0, ok = 0;
        while (!ok && attempts++ < 1000) {
            const double offset = 1.2 * (ce_uniform(&p->rng) - 0.5);
            double acc = 0.0, count = 0.0;
            ok = 1;
            for (int64_t t = 0; t < T; t++) {
                const int64_t i = b * T + t;
                double lr;
                int tries = 0;
                do {
                    p->old[i] = (float)(logp[i] - offset - 0.8 * (ce_uniform(&p->rng) - 0.5));
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

/* Reference log-probs = reference logp +- U(0.3, 0.7), random sign: kl terms on both sides. |ref - logp| >= 0.3
 * keeps the KL gradient coefficient beta (1 - exp(ref - logp)) well conditioned: it is ~ -(ref - logp), so a
 * log-prob error e (the fp32 logits give e ~ 5e-7) moves it by e / |ref - logp| relative; ref - logp of ~0.01 (as
 * U(-0.4, 0.4) draws sometimes give) would make that 5e-5 on the token, and a KL-dominated gradient (ratios
 * clipped) would then drift towards GRPO_GRAD_NORM_REL_TOL through conditioning, not through a fault (worst seen
 * over grpo_shapes with U(-0.4, 0.4): 4.7e-6 normwise; with this draw: < 3e-6). */
static void gp_set_ref(gp_problem *p, double temperature)
{
    const int64_t n = gp_n(p);
    double *logp = gp_alloc((size_t)n, sizeof(double));
    gp_reference_logp(p, temperature, logp);
    for (int64_t i = 0; i < n; i++) {
        const double u = ce_uniform(&p->rng);
        p->ref[i] = (float)(logp[i] + (u < 0.5 ? -1.0 : 1.0) * (0.3 + 0.8 * fabs(u - 0.5)));
    }
    free(logp);
}

static fh_grpo_batch gp_batch(const gp_problem *p, const fh_grpo_options *o)
{
    const fh_grpo_batch b = {p->batch, p->seq, p->ids, p->mask, p->adv, p->old, o->beta != 0.0 ? p->ref : NULL};
    return b;
}

static void gp_linear(const gp_problem *p, fh_linear *lin)
{
    const fh_status st = fh_linear_init(lin, gp_n(p), p->hidden, p->vocab, p->x, p->weight, p->layout, p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init: %d", (int)st);
}

/* ================================================================================================
 * Fused runs
 * ============================================================================================== */

typedef struct gp_config {
    int threads;
    int64_t tile_rows, tile_vocab; /* 0: library default */
    int train_step;                /* 1: fh_grpo_forward_backward; 0: fh_grpo_forward + fh_grpo_backward */
    float grad_output;             /* 0 means 1 */
    float grad_beta;               /* 0: gradients overwrite NaN-filled buffers; 1: accumulate onto 1.0 */
} gp_config;

typedef struct gp_fused {
    double loss;
    fh_grpo_metrics metrics;
    float *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias;
} gp_fused;

/* Two threads, on the library's default tiles (one tile per pass for these small problems). The engine's
 * threading is covered at length by the cross-entropy suites and the GRPO head is serial, so the GRPO suites use
 * two threads sparingly, and with as few parallel regions as possible: on an oversubscribed 2-core machine every
 * OpenMP barrier can wait a scheduler slice for a descheduled thread (seen: seconds per call with 1 x 1 tiles). */
static void gp_two_threads(gp_config *c)
{
    c->threads = 2;
    c->tile_rows = 0;
    c->tile_vocab = 0;
}

static float gp_grad_output(const gp_config *c)
{
    return c->grad_output != 0.0f ? c->grad_output : 1.0f;
}

static fh_context *gp_context(const gp_config *c)
{
    const tu_config cfg = {.threads = c->threads, .tile_rows = c->tile_rows, .tile_vocab = c->tile_vocab};
    return tu_context(&cfg);
}

static void gp_fused_alloc(const gp_problem *p, float grad_beta, gp_fused *f)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(f, 0, sizeof *f);
    f->logp = gp_alloc(n, sizeof(float));
    f->per_token_loss = gp_alloc(n, sizeof(float));
    f->entropy = gp_alloc(n, sizeof(float));
    f->lse = gp_alloc(n, sizeof(float));
    f->dx = gp_alloc(n * h, sizeof(float));
    f->dweight = gp_alloc(h * v, sizeof(float));
    f->dbias = p->bias ? gp_alloc(v, sizeof(float)) : NULL;
    /* Outputs a call forgets to write show up as NaN; gradient beta 0 must overwrite NaN. */
    const float fill = grad_beta != 0.0f ? 1.0f : NAN;
    for (size_t i = 0; i < n; i++)
        f->logp[i] = f->per_token_loss[i] = f->entropy[i] = f->lse[i] = NAN;
    for (size_t i = 0; i < n * h; i++)
        f->dx[i] = fill;
    for (size_t i = 0; i < h * v; i++)
        f->dweight[i] = fill;
    for (size_t j = 0; f->dbias && j < v; j++)
        f->dbias[j] = fill;
    f->loss = NAN;
    const fh_grpo_metrics m = {NAN, NAN, NAN, NAN, NAN, NAN};
    f->metrics = m;
    f->metrics.kl = -1.0; /* a value every call must replace (with NaN when beta == 0) */
}

static void gp_fused_free(gp_fused *f)
{
    void *a[] = {f->logp, f->per_token_loss, f->entropy, f->lse, f->dx, f->dweight, f->dbias};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    memset(f, 0, sizeof *f);
}

/* Forward + backward (or the train step) on ctx. The backward gets what the forward saved (entropy only when
 * entropy_coef != 0: "else it may be NULL"). */
static fh_status gp_run_fused_on(fh_context *ctx, const gp_problem *p, const fh_grpo_options *o, const gp_config *c,
                                 gp_fused *f)
{
    gp_fused_alloc(p, c->grad_beta, f);
    fh_linear lin;
    gp_linear(p, &lin);
    const fh_grpo_batch batch = gp_batch(p, o);
    fh_grpo_outputs out = {&f->loss, &f->metrics, f->logp, f->per_token_loss, f->entropy, f->lse};
    fh_linear_grads g = {f->dx, p->hidden, c->grad_beta, f->dweight, c->grad_beta, f->dbias, c->grad_beta};
    const float grad = gp_grad_output(c);
    if (c->train_step)
        return fh_grpo_forward_backward(ctx, &lin, &batch, o, &grad, &out, &g);
    fh_status st = fh_grpo_forward(ctx, &lin, &batch, o, &out);
    if (st == FH_OK)
        st = fh_grpo_backward(ctx, &lin, &batch, o, f->logp, f->lse, o->entropy_coef != 0.0 ? f->entropy : NULL,
                              &grad, &g);
    return st;
}

static fh_status gp_run_fused(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, gp_fused *f)
{
    fh_context *ctx = gp_context(c);
    const fh_status st = gp_run_fused_on(ctx, p, o, c, f);
    fh_context_destroy(ctx);
    return st;
}

/* ================================================================================================
 * Reference runs
 * ============================================================================================== */

typedef struct gp_reference {
    double loss;
    fh_grpo_metrics metrics;
    double *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias; /* dweight in the problem's layout */
} gp_reference;

typedef struct gp_ref_arrays {
    double *x, *w, *b, *mask, *adv, *old, *ref;
} gp_ref_arrays;

static ref_grpo_problem gp_ref_problem(const gp_problem *p, const fh_grpo_options *o, gp_ref_arrays *a)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    a->x = gp_doubles(p->x, n * h);
    a->w = gp_alloc(h * v, sizeof(double));
    for (int64_t k = 0; k < p->hidden; k++)
        for (int64_t j = 0; j < p->vocab; j++)
            a->w[k * p->vocab + j] = p->weight[gp_windex(p, k, j)];
    a->b = gp_doubles(p->bias, v);
    a->mask = gp_doubles(p->mask, n);
    a->adv = gp_doubles(p->adv, (size_t)p->batch);
    a->old = gp_doubles(p->old, n);
    a->ref = o->beta != 0.0 ? gp_doubles(p->ref, n) : NULL;
    const ref_grpo_problem rp = {p->batch, p->seq, p->hidden, p->vocab, a->x, a->w, a->b, p->ids,
                                 a->mask, a->adv, a->old, a->ref, NULL};
    return rp;
}

static void gp_ref_arrays_free(gp_ref_arrays *a)
{
    free(a->x), free(a->w), free(a->b), free(a->mask), free(a->adv), free(a->old), free(a->ref);
}

/* dx, dweight (in the problem's layout) and dbias from dU [n, V]; grad_beta added (what the fused run
 * accumulates onto). */
static void gp_grads_from_du(const gp_problem *p, const double *du, double grad_beta, double *dx, double *dweight,
                             double *dbias)
{
    const int64_t n = gp_n(p), H = p->hidden, V = p->vocab;
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < H; k++) {
            double acc = 0.0;
            for (int64_t j = 0; j < V; j++)
                acc += du[i * V + j] * p->weight[gp_windex(p, k, j)];
            dx[i * H + k] = acc + grad_beta;
        }
    for (int64_t k = 0; k < H; k++)
        for (int64_t j = 0; j < V; j++) {
            double acc = 0.0;
            for (int64_t i = 0; i < n; i++)
                acc += p->x[i * H + k] * du[i * V + j];
            dweight[gp_windex(p, k, j)] = acc + grad_beta;
        }
    for (int64_t j = 0; dbias && j < V; j++) {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++)
            acc += du[i * V + j];
        dbias[j] = acc + grad_beta;
    }
}

/* ref_grpo_forward / ref_grpo_backward, plus the lse of the tempered logits. */
static void gp_run_reference(const gp_problem *p, const fh_grpo_options *o, double grad_output, double grad_beta,
                             gp_reference *r)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(r, 0, sizeof *r);
    gp_ref_arrays a;
    const ref_grpo_problem rp = gp_ref_problem(p, o, &a);
    const ref_grpo_options ro = grpo_ref_options(o);
    r->logp = gp_alloc(n, sizeof(double));
    r->per_token_loss = gp_alloc(n, sizeof(double));
    r->entropy = gp_alloc(n, sizeof(double));
    r->lse = gp_alloc(n, sizeof(double));
    r->dx = gp_alloc(n * h, sizeof(double));
    r->dweight = gp_alloc(h * v, sizeof(double));
    r->dbias = p->bias ? gp_alloc(v, sizeof(double)) : NULL;
    ref_grpo_result res = {0};
    res.logp = r->logp;
    res.per_token_loss = r->per_token_loss;
    res.entropy = r->entropy;
    int rc = ref_grpo_forward(&rp, &ro, &res);
    r->loss = res.loss;
    r->metrics = grpo_fh_metrics(&res.metrics);
    double *dw = gp_alloc(h * v, sizeof(double));
    rc |= ref_grpo_backward(&rp, &ro, grad_output, r->dx, dw, r->dbias);
    TU_CHECK(rc == 0, "the reference failed: %d", rc);
    for (int64_t k = 0; k < p->hidden; k++)
        for (int64_t j = 0; j < p->vocab; j++)
            r->dweight[gp_windex(p, k, j)] = dw[k * p->vocab + j] + grad_beta;
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

static void gp_reference_free(gp_reference *r)
{
    void *a[] = {r->logp, r->per_token_loss, r->entropy, r->lse, r->dx, r->dweight, r->dbias};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
    memset(r, 0, sizeof *r);
}

/* The reference gradient of grad * loss given the per-token log-probs the head sees (as fh_grpo_backward takes
 * them): ref_grpo_head's coefficients from these logp, then ref_grpo_row_grad on the double logits. dx, dweight
 * (layout), dbias each [.] caller-allocated, dbias may be NULL. */
static void gp_reference_backward_from_logp(const gp_problem *p, const fh_grpo_options *o, const float *logp_f,
                                            const float *entropy_f, double grad, double *dx, double *dweight,
                                            double *dbias)
{
    const int64_t n = gp_n(p), V = p->vocab;
    double *logp = gp_doubles(logp_f, (size_t)n), *entropy = gp_doubles(entropy_f, (size_t)n);
    double *mask = gp_doubles(p->mask, (size_t)n), *adv = gp_doubles(p->adv, (size_t)p->batch);
    double *old = gp_doubles(p->old, (size_t)n), *ref = o->beta != 0.0 ? gp_doubles(p->ref, (size_t)n) : NULL;
    double *gl = gp_alloc((size_t)n, sizeof(double)), *ge = gp_alloc((size_t)n, sizeof(double));
    const ref_grpo_tokens tk = {p->batch, p->seq, logp, entropy, mask, adv, old, ref, NULL};
    const ref_grpo_options ro = grpo_ref_options(o);
    const int rc = ref_grpo_head(&tk, &ro, grad, NULL, gl, ge);
    TU_CHECK(rc == 0, "ref_grpo_head: %d", rc);
    double *u = gp_logits(p), *du = gp_alloc((size_t)(n * V), sizeof(double));
    for (int64_t i = 0; i < n; i++)
        ref_grpo_row_grad(u + i * V, V, o->temperature, p->ids[i], gl[i], ge[i], du + i * V);
    gp_grads_from_du(p, du, 0.0, dx, dweight, dbias);
    void *a[] = {logp, entropy, mask, adv, old, ref, gl, ge, u, du};
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

/* Normwise relative difference (absolute when the reference is zero); NaN anywhere gives NaN. */
static double gp_norm_rel(const float *f, const double *r, size_t count)
{
    double sd = 0.0, sr = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = (double)f[i] - r[i];
        sd += e * e;
        sr += r[i] * r[i];
    }
    return sr > 0.0 ? sqrt(sd) / sqrt(sr) : sqrt(sd);
}

static double gp_metric_diff(double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0.0 : INFINITY;
    return fabs(a - b);
}

static double gp_metrics_diff(const fh_grpo_metrics *a, const fh_grpo_metrics *b)
{
    const double d[6] = {gp_metric_diff(a->kl, b->kl),
                         gp_metric_diff(a->entropy, b->entropy),
                         gp_metric_diff(a->clip_ratio_low_mean, b->clip_ratio_low_mean),
                         gp_metric_diff(a->clip_ratio_high_mean, b->clip_ratio_high_mean),
                         gp_metric_diff(a->clip_ratio_region_mean, b->clip_ratio_region_mean),
                         gp_metric_diff(a->cispo_clip_ratio, b->cispo_clip_ratio)};
    double m = 0.0;
    for (int k = 0; k < 6; k++)
        m = d[k] > m ? d[k] : m;
    return m;
}

typedef struct gp_diff {
    double loss, loss_tol, metrics;
    double logp, entropy, lse, per_token_loss;
    double dx, dweight, dbias;
    int64_t masked_rows_touched; /* dx rows of mask-0 tokens that are not exactly the prefill (0 or 1) */
} gp_diff;

static void gp_measure(const gp_problem *p, const gp_fused *f, const gp_reference *r, float grad_beta, gp_diff *d)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    memset(d, 0, sizeof *d);
    d->loss = fabs(f->loss - r->loss);
    if (isnan(f->loss) || isnan(r->loss))
        d->loss = NAN;
    d->loss_tol = GRPO_LOSS_TOL * fmax(1.0, fabs(r->loss));
    d->metrics = gp_metrics_diff(&f->metrics, &r->metrics);
    d->logp = gp_token_diff(f->logp, r->logp, n);
    d->entropy = gp_token_diff(f->entropy, r->entropy, n);
    d->lse = gp_token_diff(f->lse, r->lse, n);
    d->per_token_loss = gp_token_diff(f->per_token_loss, r->per_token_loss, n);
    d->dx = gp_norm_rel(f->dx, r->dx, n * h);
    d->dweight = gp_norm_rel(f->dweight, r->dweight, h * v);
    if (f->dbias)
        d->dbias = gp_norm_rel(f->dbias, r->dbias, v);
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
           d->dx <= GRPO_GRAD_NORM_REL_TOL && d->dweight <= GRPO_GRAD_NORM_REL_TOL &&
           d->dbias <= GRPO_GRAD_NORM_REL_TOL && d->masked_rows_touched == 0;
}

static const char *gp_loss_name(fh_grpo_loss_type t)
{
    static const char *names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"};
    return (unsigned)t < TU_COUNT(names) ? names[t] : "?";
}

static void gp_describe(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, char *buf, size_t size)
{
    snprintf(buf, size,
             "B=%lld T=%lld H=%lld V=%lld %s bias=%d | %s %s old=%d beta=%g delta=%g eps=(%g,%g) temp=%g ent=%g "
             "nib=%g mcl=%lld | tiles=%lldx%lld threads=%d step=%d g=%g gbeta=%g",
             (long long)p->batch, (long long)p->seq, (long long)p->hidden, (long long)p->vocab,
             p->layout == FH_LAYOUT_HV ? "hv" : "vh", p->bias != NULL, gp_loss_name(o->loss_type),
             o->importance_sampling_level == FH_GRPO_IS_SEQUENCE ? "sequence" : "token", p->old != NULL, o->beta,
             o->delta, o->epsilon_low, o->epsilon_high, o->temperature, o->entropy_coef, o->num_items_in_batch,
             (long long)o->max_completion_length, (long long)c->tile_rows, (long long)c->tile_vocab, c->threads,
             c->train_step, (double)gp_grad_output(c), (double)c->grad_beta);
}

/* Largest differences seen (printed with FH_TEST_VERBOSE=1, to check the tolerances' margins). */
static gp_diff gp_worst;

static void gp_track(const gp_diff *d)
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

static void gp_print_worst(const char *suite)
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

/* Fused vs reference with every tolerance of the header comment; asserts, and returns 1 on pass. */
static int gp_check(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, const char *label)
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
        gp_measure(p, &f, &r, c->grad_beta, &d);
        gp_track(&d);
        pass = gp_diff_pass(&d);
        TU_CHECK(pass,
                 "%s [%s]: loss %.17g vs %.17g (diff %.2e, tol %.2e); metrics %.2e (tol %g); logp %.2e entropy %.2e "
                 "lse %.2e per_token_loss %.2e (tol %g); dx %.2e dweight %.2e dbias %.2e (tol %g); %lld masked dx "
                 "rows not exactly %g",
                 label, desc, f.loss, r.loss, d.loss, d.loss_tol, d.metrics, GRPO_METRIC_TOL, d.logp, d.entropy,
                 d.lse, d.per_token_loss, GP_TOKEN_TOL, d.dx, d.dweight, d.dbias, GRPO_GRAD_NORM_REL_TOL,
                 (long long)d.masked_rows_touched, (double)c->grad_beta);
        gp_reference_free(&r);
    }
    gp_fused_free(&f);
    return pass;
}

static void gp_options(fh_grpo_options *o, fh_grpo_loss_type type, fh_grpo_is_level level)
{
    fh_grpo_options_init(o);
    o->loss_type = type;
    o->importance_sampling_level = level;
}

/* A deterministic pseudo-random choice for case k (one time in `one_in`), so that the options spread over a
 * matrix by its counter do not line up with the matrix's own loops (as k & 1 would with the innermost one). */
static int gp_pick(int k, unsigned salt, unsigned one_in)
{
    uint64_t h = ((uint64_t)(unsigned)k + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)salt * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h % one_in == 0;
}

static const fh_grpo_loss_type gp_all_losses[] = {FH_GRPO_LOSS_GRPO,  FH_GRPO_LOSS_BNPO,  FH_GRPO_LOSS_DR_GRPO,
                                                  FH_GRPO_LOSS_DAPO,  FH_GRPO_LOSS_CISPO, FH_GRPO_LOSS_SAPO};
static const fh_grpo_is_level gp_all_levels[] = {FH_GRPO_IS_TOKEN, FH_GRPO_IS_SEQUENCE};

/* ================================================================================================
 * grpo_reference: the full option matrix
 * ============================================================================================== */

/* 6 loss types x 2 levels x {old, on-policy} x beta {0, 0.04} x delta {off, 1.5} = 96 problems, each checked
 * with separate calls and about a third also with the train step; layout (half), bias (half), eps_high 0.28
 * (half of the clipped cases), 2 threads (1/40, gp_two_threads), grad_output -0.5 (1/5) and gradient
 * accumulation (1/6) spread over the matrix by gp_pick. B = 5 rows with advantages +, -, 0, + and the last row
 * empty; T = 7 (N = 35 = 8 x 4 + 3 rows: a 3-row edge tile); V = 37 = 2 x 16 + 5 (a 5-column edge tile); H = 11;
 * temperature 0.7; DAPO-style eps_high 0.28 on the clipped types. Tolerances: gp_check (header comment). */
static void test_option_matrix(void)
{
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int old = 0; old <= 1; old++)
                for (int with_beta = 0; with_beta <= 1; with_beta++)
                    for (int with_delta = 0; with_delta <= 1; with_delta++, k++) {
                        fh_grpo_options o;
                        gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                        o.temperature = 0.7;
                        o.beta = with_beta ? 0.04 : 0.0;
                        o.delta = with_delta ? 1.5 : NAN;
                        if (lt < 4 && gp_pick(k, 1, 2))
                            o.epsilon_high = 0.28;
                        gp_problem p;
                        gp_init(&p, 5, 7, 11, 37, gp_pick(k, 2, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, gp_pick(k, 3, 2),
                                1000 + (uint64_t)k);
                        gp_set_ref(&p, o.temperature);
                        if (old)
                            gp_set_old(&p, &o);
                        gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16};
                        if (gp_pick(k, 4, 40))
                            gp_two_threads(&c);
                        c.grad_output = gp_pick(k, 5, 5) ? -0.5f : 1.0f;
                        c.grad_beta = gp_pick(k, 6, 6) ? 1.0f : 0.0f;
                        gp_check(&p, &o, &c, "option matrix");
                        if (gp_pick(k, 7, 3)) {
                            c.train_step = 1;
                            gp_check(&p, &o, &c, "option matrix, train step");
                        }
                        gp_free(&p);
                    }
    gp_print_worst("grpo_reference");
}

/* Non-default SAPO temperatures, epsilon_low != epsilon_high, delta inside the clip range (1.1 < 1 + 0.3) and
 * below it (0.7 < 1 - 0.35: c1 = min(r, delta) then drives the low clip), larger and smaller advantages: the same
 * comparison. */
static void test_option_values(void)
{
    static const struct {
        double eps_low, eps_high, tau_pos, tau_neg, adv_scale, delta;
    } variants[] = {{0.2, NAN, 1.0, 1.05, 1.0, NAN}, {0.1, 0.3, 0.5, 2.0, 3.0, 1.1}, {0.35, 0.05, 3.0, 0.25, 0.5, 0.7}};
    int k = 0;
    for (size_t vi = 0; vi < TU_COUNT(variants); vi++)
        for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
            for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.temperature = 0.7;
                o.epsilon_low = variants[vi].eps_low;
                o.epsilon_high = variants[vi].eps_high;
                o.sapo_temperature_pos = variants[vi].tau_pos;
                o.sapo_temperature_neg = variants[vi].tau_neg;
                o.delta = variants[vi].delta;
                o.beta = gp_pick(k, 11, 2) ? 0.04 : 0.0;
                gp_problem p;
                gp_init(&p, 4, 6, 9, 23, gp_pick(k, 12, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1, 2000 + (uint64_t)k);
                for (int64_t b = 0; b < p.batch; b++)
                    p.adv[b] *= (float)variants[vi].adv_scale;
                gp_set_ref(&p, o.temperature);
                gp_set_old(&p, &o);
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = gp_pick(k, 13, 3)};
                gp_check(&p, &o, &c, "option values");
                gp_free(&p);
            }
    gp_print_worst("grpo_reference (values)");
}

/* ================================================================================================
 * grpo_masks: empty rows, advantage signs, mask weights
 * ============================================================================================== */

/* Rows: full (A > 0), padded (A < 0), EMPTY (A > 0), padded (A == 0), padded (A == -0), EMPTY last row (A < 0).
 * Fractional variant: weights 0.5, 2 and 1, and row 3 summing to 0.75 (below the clamp at 1).
 * All loss types and levels, with and without old log-probs, overwrite and accumulate, split and train step.
 * Every dx row of a mask-0 token must be exactly 0 (or exactly 1 when accumulating onto 1): asserted by gp_check
 * (masked_rows_touched), on top of the reference comparison. */
static void make_mask_problem(gp_problem *p, uint64_t seed, int fractional)
{
    gp_init(p, 6, 5, 7, 19, FH_LAYOUT_VH, 1, seed);
    static const float adv[6] = {0.9f, -0.7f, 1.1f, 0.0f, -0.0f, -1.3f};
    static const int length[6] = {5, 3, 0, 2, 4, 0};
    for (int64_t b = 0; b < p->batch; b++) {
        p->adv[b] = adv[b];
        for (int64_t t = 0; t < p->seq; t++)
            p->mask[b * p->seq + t] = t < length[b] ? 1.0f : 0.0f;
    }
    if (fractional) { /* "any finite value >= 0 weighs the token" */
        for (int64_t i = 0; i < gp_n(p); i++)
            if (p->mask[i] != 0.0f)
                p->mask[i] = (i % 3 == 0) ? 0.5f : (i % 3 == 1) ? 2.0f : 1.0f;
        /* Row 3 weighs 0.75 in all: its count max(sum_t m, 1) is the clamp's 1, not the sum. */
        p->mask[3 * p->seq] = 0.25f;
        p->mask[3 * p->seq + 1] = 0.5f;
    }
    gp_fix_ids(p);
}

static void test_empty_rows_and_advantage_signs(void)
{
    int k = 0;
    for (int fractional = 0; fractional <= 1; fractional++)
        for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
            for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
                for (int old = 0; old <= 1; old++, k++) {
                    fh_grpo_options o;
                    gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                    o.temperature = 0.7;
                    o.beta = gp_pick(k, 21, 2) ? 0.04 : 0.0;
                    o.entropy_coef = gp_pick(k, 22, 2) ? 0.05 : 0.0;
                    gp_problem p;
                    make_mask_problem(&p, 3000 + (uint64_t)k, fractional);
                    gp_set_ref(&p, o.temperature);
                    if (old)
                        gp_set_old(&p, &o);
                    for (int variant = 0; variant < 2; variant++) {
                        gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = variant,
                                       .grad_beta = (float)gp_pick(k, 23, 2)};
                        if (gp_pick(k, 24, 24))
                            gp_two_threads(&c);
                        gp_check(&p, &o, &c, fractional ? "fractional masks" : "empty rows, advantage signs");
                    }
                    gp_free(&p);
                }
    gp_print_worst("grpo_masks");
}

/* The shared harness (ref/grpo_case, also behind fh_gradcheck) at B = 3, T = 9, H = 11, V = 37, tiles 4 x 16: it
 * leaves the last row empty, so that row's dx rows must be exactly 0 (beta-0 overwrite of NaN-filled buffers), and
 * its own tolerances must pass (grpo_metrics_pass: GRPO_LOSS_TOL, GRPO_METRIC_TOL, GRPO_GRAD_NORM_REL_TOL). */
static void test_grpo_case_empty_last_row(void)
{
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int step = 0; step <= 1; step++, k++) {
                grpo_case_spec spec;
                grpo_case_spec_default(&spec);
                spec.seq = 9;
                spec.hidden = 11;
                spec.vocab = 37;
                spec.layout = gp_pick(k, 31, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH;
                spec.bias = gp_pick(k, 32, 2);
                spec.options.loss_type = gp_all_losses[lt];
                spec.options.importance_sampling_level = gp_all_levels[lv];
                spec.options.temperature = 0.7;
                spec.options.beta = gp_pick(k, 33, 2) ? 0.04 : 0.0;
                spec.train_step = step;
                spec.threads = 1;
                spec.tile_rows = 4;
                spec.tile_vocab = 16;
                spec.seed = 3300 + (uint64_t)k;
                grpo_case c;
                grpo_metrics_diff d;
                const fh_status st = grpo_case_run(&spec, &c, &d);
                const char *name = gp_loss_name(spec.options.loss_type);
                TU_CHECK(st == FH_OK, "grpo_case %s level %zu step %d: status %d", name, lv, step, (int)st);
                if (st == FH_OK) {
                    const int64_t T = spec.seq, H = spec.hidden, last = spec.batch - 1;
                    int empty = 1;
                    for (int64_t t = 0; t < T; t++)
                        empty &= c.mask[last * T + t] == 0.0f;
                    TU_CHECK(empty, "grpo_case no longer leaves the last row empty");
                    TU_CHECK(tu_all_equal_f(c.dx + last * T * H, (size_t)(T * H), 0.0f),
                             "grpo_case %s level %zu step %d: dx rows of the empty last row not exactly 0", name, lv,
                             step);
                    TU_CHECK(grpo_metrics_pass(&d),
                             "grpo_case %s level %zu step %d: loss %.2e (tol %.2e) metrics %.2e dx %.2e dweight %.2e "
                             "dbias %.2e",
                             name, lv, step, d.abs_diff_loss, d.loss_tolerance, d.metrics_max_abs, d.dhidden_norm_rel,
                             d.dweight_norm_rel, d.dbias_norm_rel);
                }
                grpo_case_free(&c);
            }
}

/* Every token masked (all ids out of range too): the loss, every gradient and every metric that exists are
 * exactly 0 (sums of zeros divided by max(., 1)); clip ratios 0 at both levels (on-policy r == 1), except
 * cispo_clip_ratio at the sequence level, which counts every row (masked or not) with r = 1 > eps_high = 0.2 and
 * A > 0: exactly 1/3 here (advantages +, -, 0). */
static void test_fully_masked_batch(void)
{
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int step = 0; step <= 1; step++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.beta = 0.04;
                o.entropy_coef = 0.1;
                gp_problem p;
                gp_init(&p, 3, 4, 5, 17, FH_LAYOUT_HV, 1, 3100 + lt);
                for (int64_t i = 0; i < gp_n(&p); i++) {
                    p.mask[i] = 0.0f;
                    p.ids[i] = i & 1 ? -100 : 17; /* out of range on both sides: accepted under the mask */
                    p.ref[i] = -1.0f;
                }
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
                gp_fused f;
                const fh_status st = gp_run_fused(&p, &o, &c, &f);
                const size_t n = (size_t)gp_n(&p), h = (size_t)p.hidden, v = (size_t)p.vocab;
                const char *name = gp_loss_name(o.loss_type);
                TU_CHECK(st == FH_OK, "%s level %d: status %d", name, (int)o.importance_sampling_level, (int)st);
                if (st == FH_OK) {
                    const fh_grpo_metrics *m = &f.metrics;
                    const int clipped = lt < 4, cispo = o.loss_type == FH_GRPO_LOSS_CISPO;
                    TU_CHECK(f.loss == 0.0, "%s: loss %g, expected exactly 0", name, f.loss);
                    TU_CHECK(tu_all_equal_f(f.dx, n * h, 0.0f) && tu_all_equal_f(f.dweight, h * v, 0.0f) &&
                                 tu_all_equal_f(f.dbias, v, 0.0f),
                             "%s level %d step %d: gradients not exactly 0", name, (int)o.importance_sampling_level,
                             step);
                    TU_CHECK(tu_all_equal_f(f.logp, n, 0.0f), "%s: per_token_logp of out-of-range ids not 0", name);
                    TU_CHECK(m->kl == 0.0 && m->entropy == 0.0, "%s: kl %g entropy %g, expected 0", name, m->kl,
                             m->entropy);
                    TU_CHECK(clipped ? m->clip_ratio_low_mean == 0.0 && m->clip_ratio_high_mean == 0.0 &&
                                           m->clip_ratio_region_mean == 0.0
                                     : isnan(m->clip_ratio_low_mean) && isnan(m->clip_ratio_high_mean) &&
                                           isnan(m->clip_ratio_region_mean),
                             "%s: clip ratios %g %g %g", name, m->clip_ratio_low_mean, m->clip_ratio_high_mean,
                             m->clip_ratio_region_mean);
                    const double cispo_expected = lv == 1 ? 1.0 / 3.0 : 0.0;
                    TU_CHECK(cispo ? m->cispo_clip_ratio == cispo_expected : isnan(m->cispo_clip_ratio),
                             "%s level %zu: cispo_clip_ratio %g", name, lv, m->cispo_clip_ratio);
                }
                gp_fused_free(&f);
                gp_free(&p);
            }
}

/* Out-of-range ids under the mask: per_token_logp is exactly 0 there, and the loss, metrics and gradients are
 * bitwise those of the same problem with in-range ids at those positions (a masked token contributes nothing). */
static void test_masked_out_of_range_ids(void)
{
    static const int64_t bad_ids[] = {-1, -100, 19, INT64_MAX, INT64_MIN};
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int step = 0; step <= 1; step++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.beta = 0.04;
                gp_problem p;
                make_mask_problem(&p, 3200 + lt, 0);
                for (int64_t i = 0; i < gp_n(&p); i++)
                    if (p.mask[i] == 0.0f)
                        p.ids[i] = i % 19; /* in range */
                gp_set_ref(&p, o.temperature);
                gp_set_old(&p, &o);
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
                gp_fused in_range, out_of_range;
                const fh_status s1 = gp_run_fused(&p, &o, &c, &in_range);
                size_t k = 0;
                for (int64_t i = 0; i < gp_n(&p); i++)
                    if (p.mask[i] == 0.0f)
                        p.ids[i] = bad_ids[k++ % TU_COUNT(bad_ids)];
                const fh_status s2 = gp_run_fused(&p, &o, &c, &out_of_range);
                const char *name = gp_loss_name(o.loss_type);
                TU_CHECK(s1 == FH_OK && s2 == FH_OK, "%s: status %d, %d", name, (int)s1, (int)s2);
                if (s1 == FH_OK && s2 == FH_OK) {
                    const size_t n = (size_t)gp_n(&p), h = (size_t)p.hidden, v = (size_t)p.vocab;
                    int zero_logp = 1;
                    for (size_t i = 0; i < n; i++)
                        if (p.ids[i] < 0 || p.ids[i] >= p.vocab)
                            zero_logp &= out_of_range.logp[i] == 0.0f;
                    TU_CHECK(zero_logp, "%s: per_token_logp not exactly 0 at out-of-range ids", name);
                    TU_CHECK(memcmp(&in_range.loss, &out_of_range.loss, sizeof(double)) == 0 &&
                                 memcmp(&in_range.metrics, &out_of_range.metrics, sizeof(fh_grpo_metrics)) == 0,
                             "%s level %d step %d: loss/metrics changed by masked ids (%.17g vs %.17g)", name,
                             (int)o.importance_sampling_level, step, in_range.loss, out_of_range.loss);
                    TU_CHECK(memcmp(in_range.dx, out_of_range.dx, n * h * sizeof(float)) == 0 &&
                                 memcmp(in_range.dweight, out_of_range.dweight, h * v * sizeof(float)) == 0 &&
                                 memcmp(in_range.dbias, out_of_range.dbias, v * sizeof(float)) == 0,
                             "%s level %d step %d: gradients changed by masked ids", name,
                             (int)o.importance_sampling_level, step);
                }
                gp_fused_free(&in_range);
                gp_fused_free(&out_of_range);
                gp_free(&p);
            }
}

/* ================================================================================================
 * grpo_clip: ratios on both sides of the clip range and exactly on its bounds
 * ============================================================================================== */

/* Relative normwise distance between two reference gradients (to show that a test can tell them apart). */
static double gp_rel_distance(const double *a, const double *b, size_t count)
{
    double sd = 0.0, sb = 0.0;
    for (size_t i = 0; i < count; i++) {
        sd += (a[i] - b[i]) * (a[i] - b[i]);
        sb += b[i] * b[i];
    }
    return sb > 0.0 ? sqrt(sd / sb) : sqrt(sd);
}

/* dx of the reference (ref_grpo_backward) under options o. */
static double *gp_reference_dx(const gp_problem *p, const fh_grpo_options *o)
{
    gp_reference r;
    gp_run_reference(p, o, 1.0, 0.0, &r);
    double *dx = r.dx;
    r.dx = NULL;
    gp_reference_free(&r);
    return dx;
}

/* On-policy, r == 1 exactly in both the library (logp - logp = 0, exp(0) = 1; at the sequence level a masked sum
 * of zeros) and the reference (logp - sg(logp)). Moving a bound onto 1 puts every token on it:
 *   eps_low = 0:  c2 = clamp(1, 1, 1 + eps_high) sits on its lower bound; A < 0 picks it (tie with c1 = r).
 *   eps_high = 0: c2 sits on its upper bound; A > 0 picks it.
 *   delta = 1:    c1 = min(r, 1) sits on its bound.
 * torch passes the gradient at a clamp's bound and splits min()'s ties in halves: with c1 == c2 == r both halves
 * carry dr, so the whole gradient flows. (The tie rule cannot be seen on its own: whenever c1 == c2 with A != 0
 * both operands have the same derivative, so giving a tie to one side is an equivalent program; it matters only
 * together with the clamp rule.) A library treating a bound as open would make the clamped operand constant there
 * and lose half (tie split) or all of the gradient on the rows whose A picks it: each variant also checks that the
 * reference with the bound moved 1e-9 past r (the open-interval answer) differs from the closed one by far more
 * than the tolerance, so the comparison has teeth. Clip metrics count strict inequalities: exactly 0 here (compared with the
 * reference's 0 within GRPO_METRIC_TOL, no guard needed since r is exactly 1 in both). */
static void test_on_policy_bounds(void)
{
    static const struct {
        const char *name;
        double eps_low, eps_high, delta;
        double open_eps_low, open_eps_high, open_delta; /* the bound moved just past r = 1 */
    } variants[] = {
        {"eps_low = 0 (r on 1 - eps_low)", 0.0, 0.2, NAN, -1e-9, 0.2, NAN},
        {"eps_high = 0 (r on 1 + eps_high)", 0.2, 0.0, NAN, 0.2, -1e-9, NAN},
        {"delta = 1 (r on delta)", 0.2, 0.2, 1.0, 0.2, 0.2, 1.0 - 1e-9},
        {"eps_low = eps_high = 0, delta = 1", 0.0, 0.0, 1.0, -1e-9, -1e-9, 1.0 - 1e-9},
    };
    static const fh_grpo_loss_type clipped[] = {FH_GRPO_LOSS_GRPO, FH_GRPO_LOSS_BNPO, FH_GRPO_LOSS_DR_GRPO,
                                                FH_GRPO_LOSS_DAPO};
    int k = 0;
    for (size_t vi = 0; vi < TU_COUNT(variants); vi++) {
        for (size_t lt = 0; lt < TU_COUNT(clipped); lt++)
            for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
                for (int with_beta = 0; with_beta <= 1; with_beta++, k++) {
                    fh_grpo_options o;
                    gp_options(&o, clipped[lt], gp_all_levels[lv]);
                    o.temperature = 0.7;
                    o.epsilon_low = variants[vi].eps_low;
                    o.epsilon_high = variants[vi].eps_high;
                    o.delta = variants[vi].delta;
                    o.beta = with_beta ? 0.04 : 0.0;
                    gp_problem p;
                    gp_init(&p, 5, 6, 8, 21, gp_pick(k, 41, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, gp_pick(k, 42, 2),
                            4000 + (uint64_t)k);
                    gp_set_ref(&p, o.temperature);
                    for (int step = 0; step <= 1; step++) {
                        const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
                        gp_check(&p, &o, &c, variants[vi].name);
                    }
                    gp_free(&p);
                }
        /* Teeth: closed bound vs the open-interval answer, reference only (the library rejects eps < 0). */
        fh_grpo_options closed, open;
        gp_options(&closed, FH_GRPO_LOSS_GRPO, FH_GRPO_IS_TOKEN);
        closed.epsilon_low = variants[vi].eps_low;
        closed.epsilon_high = variants[vi].eps_high;
        closed.delta = variants[vi].delta;
        open = closed;
        open.epsilon_low = variants[vi].open_eps_low;
        open.epsilon_high = variants[vi].open_eps_high;
        open.delta = variants[vi].open_delta;
        gp_problem p;
        gp_init(&p, 5, 6, 8, 21, FH_LAYOUT_VH, 0, 4900 + vi);
        double *a = gp_reference_dx(&p, &closed), *b = gp_reference_dx(&p, &open);
        const double dist = gp_rel_distance(b, a, (size_t)(gp_n(&p) * p.hidden));
        TU_CHECK(dist > 1e3 * GRPO_GRAD_NORM_REL_TOL, "%s: the open-bound gradient differs by only %.2e",
                 variants[vi].name, dist);
        free(a);
        free(b);
        gp_free(&p);
    }
    /* cispo's cap eps_high = 1 with r = 1: min(r, 1) on its bound (detached: the value is 1 either way) and
     * cispo_clip_ratio counts r > eps_high strictly: compared with the reference (both 0 here). */
    for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
        for (int step = 0; step <= 1; step++) {
            fh_grpo_options o;
            gp_options(&o, FH_GRPO_LOSS_CISPO, gp_all_levels[lv]);
            o.epsilon_high = 1.0;
            gp_problem p;
            gp_init(&p, 5, 6, 8, 21, FH_LAYOUT_VH, 1, 4800 + lv);
            const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
            gp_check(&p, &o, &c, "cispo cap on r = 1");
            gp_fused f;
            if (gp_run_fused(&p, &o, &c, &f) == FH_OK)
                TU_CHECK(f.metrics.cispo_clip_ratio == 0.0, "cispo_clip_ratio %g with r == eps_high",
                         f.metrics.cispo_clip_ratio);
            gp_fused_free(&f);
            gp_free(&p);
        }
    gp_print_worst("grpo_clip (on-policy)");
}

/* Off-policy, exactly on the bounds, in fh_grpo_backward (whose head sees the fp32 per_token_logp the forward
 * saved, so the test controls logp - old exactly): every token gets a category with an exact log-ratio d (a
 * multiple of 2^-10), old = logp - d in fp32 when that is exact (else the token is put inside, d = 0). Then
 * r = exp(d) is the same double in the library and in the reference head fed the same fp32 log-probs, and the
 * bounds are built from those very doubles: 1 - eps_low == exp(D_LO) and 1 + eps_high == exp(D_HI) exactly
 * (1 - (1 - r) and 1 + (r - 1) are exact for r in [0.5, 2]), delta == exp(D_DELTA).
 * Categories: below 1 - eps_low, on it, inside (r < 1 and r == 1), on 1 + eps_high, between it and delta, on
 * delta, above delta. Token level: category (b + t) mod 8 and A of alternating signs over rows. Sequence level:
 * one category per row (all its tokens share d, so s_b == d exactly), both signs of A for each.
 * Reference: ref_grpo_head's coefficients on the same fp32 log-probs, ref_grpo_row_grad on the double logits.
 * Tolerance GRPO_GRAD_NORM_REL_TOL; teeth: moving the three bounds 1e-9 past their tokens changes the reference
 * gradient by more than 1000x that. */
enum { CAT_BELOW_LO, CAT_ON_LO, CAT_INSIDE, CAT_ONE, CAT_ON_HI, CAT_BETWEEN, CAT_ON_DELTA, CAT_ABOVE, CAT_COUNT };
#define D_LO (-0.25)
#define D_HI 0.1875
#define D_DELTA 0.375

static double category_log_ratio(int cat)
{
    static const double d[CAT_COUNT] = {D_LO - 0.25, D_LO, -0.125, 0.0, D_HI, (D_HI + D_DELTA) / 2, D_DELTA,
                                        D_DELTA + 0.25};
    return d[cat];
}

/* Sets p->old from the fp32 log-probs and counts the unmasked tokens (token level) or rows (sequence level) that
 * landed exactly on each category, by sign of A (on[cat][A < 0]). */
static int exact_category(int sequence_level, int64_t b, int64_t t)
{
    return sequence_level ? (int)((b / 8) % CAT_COUNT) : (int)((b + t) % CAT_COUNT);
}

static void set_exact_old(gp_problem *p, const float *logp, int sequence_level, int on[CAT_COUNT][2])
{
    const int64_t B = p->batch, T = p->seq;
    free(p->old);
    p->old = gp_alloc((size_t)gp_n(p), sizeof(float));
    memset(on, 0, sizeof(int) * CAT_COUNT * 2);
    for (int64_t b = 0; b < B; b++) {
        int row_exact = 1;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const int cat = exact_category(sequence_level, b, t);
            const double d = category_log_ratio(cat);
            p->old[i] = (float)((double)logp[i] - d);
            const int exact = (double)logp[i] - (double)p->old[i] == d;
            if (!exact)
                p->old[i] = logp[i]; /* inside: d = 0 */
            row_exact &= exact;
            if (!sequence_level && exact && p->mask[i] != 0.0f)
                on[cat][p->adv[b] < 0.0f]++;
        }
        if (sequence_level && !row_exact) /* the whole row inside, so that s_b stays exact */
            for (int64_t t = 0; t < T; t++)
                p->old[b * T + t] = logp[b * T + t];
        if (sequence_level && row_exact)
            on[exact_category(1, b, 0)][p->adv[b] < 0.0f]++;
    }
}

static void test_off_policy_exact_bounds(void)
{
    const double r_lo = exp(D_LO), r_hi = exp(D_HI), r_delta = exp(D_DELTA);
    double teeth = INFINITY;
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int variant = 0; variant < 4; variant++, k++) {
                const int with_delta = variant & 1, with_beta = variant >> 1;
                const int sequence_level = gp_all_levels[lv] == FH_GRPO_IS_SEQUENCE;
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.temperature = 0.7;
                o.epsilon_low = 1.0 - r_lo;
                /* cispo's eps_high is an absolute cap on r: put it on the same tokens. */
                o.epsilon_high = o.loss_type == FH_GRPO_LOSS_CISPO ? r_hi : r_hi - 1.0;
                o.delta = with_delta ? r_delta : NAN;
                o.beta = with_beta ? 0.04 : 0.0;
                o.entropy_coef = gp_pick(k, 51, 3) ? 0.05 : 0.0;
                TU_CHECK(1.0 - o.epsilon_low == r_lo &&
                             (o.loss_type == FH_GRPO_LOSS_CISPO || 1.0 + o.epsilon_high == r_hi),
                         "bounds not exact");
                /* Sequence level: 8 full rows of 3 per category (4 per sign of A). Token level: 8 rows of 16, the
                 * category cycling along each row (8 tokens per category and sign), every 7th token masked. */
                const int64_t B = sequence_level ? 8 * CAT_COUNT : 8, T = sequence_level ? 3 : 16;
                gp_problem p;
                gp_init(&p, B, T, 8, 19, gp_pick(k, 52, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1, 5000 + (uint64_t)k);
                for (int64_t b = 0; b < B; b++) {
                    p.adv[b] = (float)((b & 1 ? -1.0 : 1.0) * (0.5 + 0.05 * (double)b));
                    for (int64_t t = 0; t < T; t++)
                        p.mask[b * T + t] = sequence_level || (b * T + t) % 7 != 6 ? 1.0f : 0.0f;
                }
                gp_fix_ids(&p);
                gp_set_ref(&p, o.temperature);
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16};
                fh_context *ctx = gp_context(&c);
                fh_linear lin;
                gp_linear(&p, &lin);
                gp_fused f;
                gp_fused_alloc(&p, 0.0f, &f);
                /* The forward's saved per-token values (run on-policy: they do not depend on old). */
                const fh_grpo_batch fb = gp_batch(&p, &o);
                fh_grpo_outputs out = {&f.loss, &f.metrics, f.logp, f.per_token_loss, f.entropy, f.lse};
                fh_status st = fh_grpo_forward(ctx, &lin, &fb, &o, &out);
                int on[CAT_COUNT][2];
                set_exact_old(&p, f.logp, sequence_level, on);
                /* Precondition: tokens (rows) exactly on each bound, on the side of A where the bound carries the
                 * gradient (A < 0 on 1 - eps_low and on delta, A > 0 on 1 + eps_high), and the other side too. */
                TU_CHECK(on[CAT_ON_LO][1] && on[CAT_ON_HI][0] && on[CAT_ON_DELTA][1] && on[CAT_ON_LO][0] &&
                             on[CAT_ON_HI][1] && on[CAT_ON_DELTA][0],
                         "too few tokens exactly on the bounds: lo %d/%d hi %d/%d delta %d/%d", on[CAT_ON_LO][0],
                         on[CAT_ON_LO][1], on[CAT_ON_HI][0], on[CAT_ON_HI][1], on[CAT_ON_DELTA][0],
                         on[CAT_ON_DELTA][1]);
                const fh_grpo_batch bb = gp_batch(&p, &o);
                const float grad = gp_pick(k, 53, 2) ? -0.75f : 1.0f;
                fh_linear_grads g = {f.dx, p.hidden, 0.0f, f.dweight, 0.0f, f.dbias, 0.0f};
                if (st == FH_OK)
                    st = fh_grpo_backward(ctx, &lin, &bb, &o, f.logp, f.lse, f.entropy, &grad, &g);
                char desc[512];
                gp_describe(&p, &o, &c, desc, sizeof desc);
                TU_CHECK(st == FH_OK, "exact bounds [%s]: status %d", desc, (int)st);
                const size_t n = (size_t)gp_n(&p), h = (size_t)p.hidden, v = (size_t)p.vocab;
                double *dx = gp_alloc(n * h, sizeof(double)), *dw = gp_alloc(h * v, sizeof(double));
                double *db = gp_alloc(v, sizeof(double));
                gp_reference_backward_from_logp(&p, &o, f.logp, f.entropy, grad, dx, dw, db);
                if (st == FH_OK) {
                    const double ex = gp_norm_rel(f.dx, dx, n * h), ew = gp_norm_rel(f.dweight, dw, h * v),
                                 eb = gp_norm_rel(f.dbias, db, v);
                    TU_CHECK(ex <= GRPO_GRAD_NORM_REL_TOL && ew <= GRPO_GRAD_NORM_REL_TOL &&
                                 eb <= GRPO_GRAD_NORM_REL_TOL,
                             "exact bounds [%s]: dx %.2e dweight %.2e dbias %.2e (tol %g)", desc, ex, ew, eb,
                             GRPO_GRAD_NORM_REL_TOL);
                    const gp_diff d = {.dx = ex, .dweight = ew, .dbias = eb};
                    gp_track(&d);
                }
                /* Teeth (clipped family, where the bounds carry gradient): the open-interval answer. */
                if (lt < 4) {
                    fh_grpo_options open = o;
                    open.epsilon_low = o.epsilon_low - 1e-9;
                    open.epsilon_high = o.epsilon_high - 1e-9;
                    open.delta = with_delta ? o.delta - 1e-9 : NAN;
                    double *dx_open = gp_alloc(n * h, sizeof(double)), *dw_open = gp_alloc(h * v, sizeof(double));
                    gp_reference_backward_from_logp(&p, &open, f.logp, f.entropy, grad, dx_open, dw_open, NULL);
                    free(dw_open);
                    const double dist = gp_rel_distance(dx_open, dx, n * h);
                    TU_CHECK(dist > 1e3 * GRPO_GRAD_NORM_REL_TOL, "exact bounds [%s]: open bounds differ by only %.2e",
                             desc, dist);
                    teeth = fmin(teeth, dist);
                    free(dx_open);
                }
                free(dx), free(dw), free(db);
                gp_fused_free(&f);
                fh_context_destroy(ctx);
                gp_free(&p);
            }    const char *verbose = getenv("FH_TEST_VERBOSE");
    if (verbose && strcmp(verbose, "1") == 0)
        fprintf(stderr, "\n[grpo_clip (exact bounds)] smallest open-vs-closed distance %.2e\n", teeth);
    gp_print_worst("grpo_clip (exact bounds)");
}

/* ================================================================================================
 * grpo_shapes: tile edges and the remaining options
 * ============================================================================================== */

enum { SHAPE_TILE_ROWS = 8, SHAPE_TILE_VOCAB = 16 };

/* N = B*T in {7, 8, 9, 15, 16, 17} (tile_rows 8 - 1, 8, 8 + 1, 16 - 1, 16, 16 + 1, with B = 1 or T = 1 among the
 * factorizations) x V in {1, 15, 16, 17, 33} (tile_vocab 16: -1, 0, +1, 2 tiles + 1; V = 1: logp = 0, entropy 0,
 * zero gradients), each over all six loss types, one thread; level, call style, old log-probs, beta, delta,
 * layout, bias and grad_output (1, -0.5, 2) picked per case by gp_pick. Every case has temperature != 1 (0.7 or 1.3),
 * entropy_coef != 0 (+-0.05), num_items_in_batch set (5.5 or 40) and max_completion_length set (T + 3).
 * Tolerances: gp_check. */
static void test_tile_edges(void)
{
    static const int64_t shapes[][2] = {{1, 7}, {7, 1}, {2, 4}, {1, 8}, {3, 3}, {9, 1},
                                        {3, 5}, {4, 4}, {1, 16}, {17, 1}, {2, 8}};
    static const int64_t vocabs[] = {1, 15, 16, 17, 33};
    int k = 0;
    for (size_t s = 0; s < TU_COUNT(shapes); s++)
        for (size_t vi = 0; vi < TU_COUNT(vocabs); vi++)
            for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[gp_pick(k, 61, 2)]);
                o.temperature = gp_pick(k, 62, 2) ? 0.7 : 1.3;
                /* |entropy_coef| 0.05: the bonus's gradient -c p_j (z_j - sum p z) carries the fp32 logit error
                 * (~5e-7 absolute) against z_j - sum p z, which is small on peaked rows; when the bonus dominates
                 * (c = -0.2 over a one-token batch whose policy term nib = 40 shrinks) that conditioning alone
                 * gave 6.3e-6 normwise, too close to GRPO_GRAD_NORM_REL_TOL; at 0.05 the worst is < 3.3e-6. */
                o.entropy_coef = gp_pick(k, 63, 3) ? -0.05 : 0.05;
                o.num_items_in_batch = gp_pick(k, 64, 2) ? 5.5 : 40.0;
                o.max_completion_length = shapes[s][1] + 3;
                o.beta = gp_pick(k, 65, 2) ? 0.04 : 0.0;
                o.delta = gp_pick(k, 66, 3) ? 1.5 : NAN;
                gp_problem p;
                gp_init(&p, shapes[s][0], shapes[s][1], 9, vocabs[vi], gp_pick(k, 67, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH,
                        !gp_pick(k, 68, 3), 6000 + (uint64_t)k);
                gp_set_ref(&p, o.temperature);
                if (!gp_pick(k, 69, 4))
                    gp_set_old(&p, &o);
                const gp_config c = {.threads = 1, .tile_rows = SHAPE_TILE_ROWS,
                                     .tile_vocab = SHAPE_TILE_VOCAB, .train_step = gp_pick(k, 71, 2),
                                     .grad_output = gp_pick(k, 72, 3) ? -0.5f : gp_pick(k, 73, 2) ? 2.0f : 1.0f};
                gp_check(&p, &o, &c, "tile edges");
                gp_free(&p);
            }
    gp_print_worst("grpo_shapes");
}

/* Degenerate and uneven tiles on one problem, and the library's default tiles (and the hidden size at BLIS's
 * micro-kernel edges: H in {1, 8, 17}). */
static void test_tile_configurations(void)
{
    static const int64_t tiles[][2] = {{1, 1}, {3, 5}, {35, 37}, {0, 0}, {2, 1}};
    static const int64_t hiddens[] = {1, 8, 17};
    int k = 0;
    for (size_t ti = 0; ti < TU_COUNT(tiles); ti++)
        for (size_t hi = 0; hi < TU_COUNT(hiddens); hi++)
            for (int step = 0; step <= 1; step++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[k % 6], gp_all_levels[(k / 6) & 1]);
                o.temperature = 1.3;
                o.entropy_coef = 0.05;
                o.beta = 0.04;
                o.num_items_in_batch = 12.0;
                o.max_completion_length = 11;
                gp_problem p;
                gp_init(&p, 5, 7, hiddens[hi], 37, gp_pick(k, 81, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1,
                        6500 + (uint64_t)k);
                gp_set_ref(&p, o.temperature);
                gp_set_old(&p, &o);
                /* 2 threads on the default tiles only (gp_two_threads). */
                const gp_config c = {.threads = 1 + (tiles[ti][0] == 0 && hi == 0 && step == 0),
                                     .tile_rows = tiles[ti][0], .tile_vocab = tiles[ti][1],
                                     .train_step = step};
                gp_check(&p, &o, &c, "tile configuration");
                gp_free(&p);
            }
    gp_print_worst("grpo_shapes (tiles)");
}

/* ================================================================================================
 * grpo_determinism
 * ============================================================================================== */

/* NULL when bitwise identical (the gradients only when `gradients`), else the first differing output. */
static const char *gp_first_difference(const gp_problem *p, const gp_fused *a, const gp_fused *b, int gradients)
{
    const size_t n = (size_t)gp_n(p), h = (size_t)p->hidden, v = (size_t)p->vocab;
    const struct {
        const char *name;
        const void *x, *y;
        size_t bytes;
    } parts[] = {
        {"loss", &a->loss, &b->loss, sizeof a->loss},
        {"metrics", &a->metrics, &b->metrics, sizeof a->metrics},
        {"per_token_logp", a->logp, b->logp, n * sizeof(float)},
        {"per_token_loss", a->per_token_loss, b->per_token_loss, n * sizeof(float)},
        {"entropy", a->entropy, b->entropy, n * sizeof(float)},
        {"lse", a->lse, b->lse, n * sizeof(float)},
        {"dx", a->dx, b->dx, gradients ? n * h * sizeof(float) : 0},
        {"dweight", a->dweight, b->dweight, gradients ? h * v * sizeof(float) : 0},
        {"dbias", a->dbias, b->dbias, gradients && a->dbias ? v * sizeof(float) : 0},
    };
    for (size_t k = 0; k < TU_COUNT(parts); k++)
        if (parts[k].bytes && memcmp(parts[k].x, parts[k].y, parts[k].bytes) != 0)
            return parts[k].name;
    return NULL;
}

static void make_determinism_problem(gp_problem *p, const fh_grpo_options *o, uint64_t seed)
{
    gp_init(p, 4, 9, 13, 53, FH_LAYOUT_VH, 1, seed);
    gp_set_ref(p, o->temperature);
    gp_set_old(p, o);
}

static void determinism_options(fh_grpo_options *o, size_t lt, size_t lv)
{
    gp_options(o, gp_all_losses[lt], gp_all_levels[lv]);
    o->temperature = 0.7;
    o->beta = 0.04;
    o->delta = 1.5;
    o->entropy_coef = 0.05;
}

/* Two runs on fresh contexts, and a third call on the second run's context: bitwise identical, for every loss
 * type and level, split calls and the train step; 2 threads (gp_two_threads) for grpo/token/split and
 * cispo/sequence/train step. */
static void test_repeated_runs(void)
{
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int step = 0; step <= 1; step++) {
                const int two = (lt == 0 && lv == 0 && step == 0) || (lt == 4 && lv == 1 && step == 1);
                fh_grpo_options o;
                determinism_options(&o, lt, lv);
                gp_problem p;
                make_determinism_problem(&p, &o, 7000 + lt * 2 + lv);
                gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16, .train_step = step};
                if (two)
                    gp_two_threads(&c);
                gp_fused a, b, again;
                const fh_status sa = gp_run_fused(&p, &o, &c, &a);
                fh_context *ctx = gp_context(&c);
                const fh_status sb = gp_run_fused_on(ctx, &p, &o, &c, &b);
                const fh_status sc = gp_run_fused_on(ctx, &p, &o, &c, &again);
                fh_context_destroy(ctx);
                TU_CHECK(sa == FH_OK && sb == FH_OK && sc == FH_OK, "status %d %d %d", (int)sa, (int)sb, (int)sc);
                const char *d1 = gp_first_difference(&p, &a, &b, 1), *d2 = gp_first_difference(&p, &a, &again, 1);
                TU_CHECK(!d1 && !d2, "%s level %d step %d threads %d: %s differs between identical runs%s",
                         gp_loss_name(o.loss_type), (int)lv, step, c.threads, d1 ? d1 : d2 ? d2 : "",
                         d1 ? "" : " (repeated call on one context)");
                gp_fused_free(&a);
                gp_fused_free(&b);
                gp_fused_free(&again);
                gp_free(&p);
            }
}

/* A context whose workspace holds a larger, different problem's leftovers, and a caller-owned workspace of
 * exactly fh_grpo_workspace_size bytes filled with garbage: bitwise the fresh context's results. */
static void test_reused_and_caller_workspaces(void)
{
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (int step = 0; step <= 1; step++) {
            const size_t lv = (lt + (size_t)step) & 1;
            fh_grpo_options o, big_o;
            determinism_options(&o, lt, lv);
            determinism_options(&big_o, (lt + 3) % 6, 1 - lv);
            gp_problem p, big;
            make_determinism_problem(&p, &o, 7100 + lt);
            gp_init(&big, 7, 11, 6, 97, FH_LAYOUT_HV, 1, 7200 + lt);
            gp_set_ref(&big, big_o.temperature);
            gp_set_old(&big, &big_o);
            gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16, .train_step = step};
            if (lt == 0 && step == 0)
                gp_two_threads(&c);
            gp_fused fresh, reused, callers, scratch;
            TU_CHECK(gp_run_fused(&p, &o, &c, &fresh) == FH_OK, "fresh run");
            fh_context *ctx = gp_context(&c);
            TU_CHECK(gp_run_fused_on(ctx, &big, &big_o, &c, &scratch) == FH_OK, "other problem");
            TU_CHECK(gp_run_fused_on(ctx, &p, &o, &c, &reused) == FH_OK, "reused context");
            fh_context_destroy(ctx);

            ctx = gp_context(&c);
            fh_linear lin;
            gp_linear(&p, &lin);
            size_t bytes = 0;
            TU_CHECK(fh_grpo_workspace_size(ctx, &lin, &bytes) == FH_OK && bytes > 0, "size query");
            unsigned char *ws = gp_alloc(bytes, 1);
            for (size_t i = 0; i < bytes; i++)
                ws[i] = (unsigned char)(i * 131 + 7);
            TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "set_workspace");
            TU_CHECK(gp_run_fused_on(ctx, &p, &o, &c, &callers) == FH_OK, "caller workspace");
            fh_context_destroy(ctx);
            free(ws);
            const char *d1 = gp_first_difference(&p, &fresh, &reused, 1);
            const char *d2 = gp_first_difference(&p, &fresh, &callers, 1);
            TU_CHECK(!d1, "%s step %d: %s differs on a reused context", gp_loss_name(o.loss_type), step, d1 ? d1 : "");
            TU_CHECK(!d2, "%s step %d: %s differs with a caller workspace", gp_loss_name(o.loss_type), step,
                     d2 ? d2 : "");
            gp_fused_free(&fresh);
            gp_fused_free(&reused);
            gp_fused_free(&callers);
            gp_fused_free(&scratch);
            gp_free(&p);
            gp_free(&big);
        }
}

/* Split calls vs the train step. The forward outputs (loss, metrics, per-token values) come from the same
 * forward pass and head evaluation in double: bitwise identical. The gradients differ only by what the split
 * backward re-reads in fp32: lse, per_token_logp and entropy, each rounded by at most 2^-24 |v| with |v| < 16 here,
 * i.e. < 1e-6 absolute in the exponent of every p_j = exp(z_j - lse) and in every log-ratio, so < 1e-6 relative on
 * dZ. GP_SPLIT_STEP_TOL = 4e-6 normwise leaves 4x (observed: 4.2e-7); far tighter than the 1e-5 against the
 * reference, since both runs share the same fp32 logits. */
#define GP_SPLIT_STEP_TOL 4e-6
static void test_split_vs_train_step(void)
{
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++) {
            fh_grpo_options o;
            determinism_options(&o, lt, lv);
            gp_problem p;
            make_determinism_problem(&p, &o, 7300 + lt * 2 + lv);
            gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16};
            gp_fused split, step;
            const fh_status s1 = gp_run_fused(&p, &o, &c, &split);
            c.train_step = 1;
            const fh_status s2 = gp_run_fused(&p, &o, &c, &step);
            TU_CHECK(s1 == FH_OK && s2 == FH_OK, "status %d %d", (int)s1, (int)s2);
            const char *d = gp_first_difference(&p, &split, &step, 0);
            TU_CHECK(!d, "%s level %d: forward output %s differs between split calls and the train step",
                     gp_loss_name(o.loss_type), (int)lv, d ? d : "");
            const size_t n = (size_t)gp_n(&p), h = (size_t)p.hidden, v = (size_t)p.vocab;
            double *dx = gp_doubles(step.dx, n * h), *dw = gp_doubles(step.dweight, h * v);
            double *db = gp_doubles(step.dbias, v);
            const double ex = gp_norm_rel(split.dx, dx, n * h), ew = gp_norm_rel(split.dweight, dw, h * v),
                         eb = gp_norm_rel(split.dbias, db, v);
            TU_CHECK(ex <= GP_SPLIT_STEP_TOL && ew <= GP_SPLIT_STEP_TOL && eb <= GP_SPLIT_STEP_TOL,
                     "%s level %d: split vs train step gradients dx %.2e dweight %.2e dbias %.2e (tol %g)",
                     gp_loss_name(o.loss_type), (int)lv, ex, ew, eb, GP_SPLIT_STEP_TOL);
            free(dx), free(dw), free(db);
            gp_fused_free(&split);
            gp_fused_free(&step);
            gp_free(&p);
        }
}

/* ref_per_token_logps given with beta == 0 changes nothing (bitwise); so does an entropy buffer handed to
 * fh_grpo_backward when entropy_coef == 0. */
static void test_unused_inputs_ignored(void)
{
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++) {
        fh_grpo_options o;
        determinism_options(&o, lt, lt & 1);
        o.beta = 0.0;
        o.entropy_coef = 0.0;
        gp_problem p;
        make_determinism_problem(&p, &o, 7400 + lt);
        const gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16};
        gp_fused a, b;
        const fh_status sa = gp_run_fused(&p, &o, &c, &a);
        gp_fused_alloc(&p, 0.0f, &b);
        fh_context *ctx = gp_context(&c);
        fh_linear lin;
        gp_linear(&p, &lin);
        fh_grpo_batch batch = gp_batch(&p, &o);
        batch.ref_per_token_logps = p.ref;
        fh_grpo_outputs out = {&b.loss, &b.metrics, b.logp, b.per_token_loss, b.entropy, b.lse};
        fh_linear_grads g = {b.dx, p.hidden, 0.0f, b.dweight, 0.0f, b.dbias, 0.0f};
        const float grad = 1.0f;
        fh_status sb = fh_grpo_forward(ctx, &lin, &batch, &o, &out);
        if (sb == FH_OK)
            sb = fh_grpo_backward(ctx, &lin, &batch, &o, b.logp, b.lse, b.entropy, &grad, &g);
        fh_context_destroy(ctx);
        TU_CHECK(sa == FH_OK && sb == FH_OK, "status %d %d", (int)sa, (int)sb);
        const char *d = gp_first_difference(&p, &a, &b, 1);
        TU_CHECK(!d, "%s: %s changed by unused ref log-probs / entropy", gp_loss_name(o.loss_type), d ? d : "");
        gp_fused_free(&a);
        gp_fused_free(&b);
        gp_free(&p);
    }
}

/* ================================================================================================
 * grpo_metrics
 * ============================================================================================== */

/* For each loss type, level, beta, old/on-policy and delta (off; 1.5 above the clip range; 1.1 inside it, where
 * the clip flags must use c1 = min(r, delta) and not r; 0.7 below 1 - eps_low):
 *   - NaN exactly where TRL logs nothing: kl when beta == 0, the three clip ratios outside the clipped family,
 *     cispo_clip_ratio outside cispo, entropy never;
 *   - the values against the reference (GRPO_METRIC_TOL; old log-probs guarded away from the bounds);
 *   - region == low + high (A's sign makes low and high disjoint; 1e-15 for the two divisions);
 *   - with old log-probs at the token level the clipped family sees both clip sides (the high one unless delta
 *     <= 1 + eps_high caps c1 below it), taking the first of up to ten seeds whose draw has them;
 *   - on-policy (r == 1): clip ratios exactly 0 (unless delta 0.7 puts c1 below 1 - eps_low), and
 *     cispo_clip_ratio (r = 1 > eps_high = 0.2 wherever A > 0) exactly the hand count: the mask-weighted share of
 *     tokens with A > 0 (token level), the share of rows with A > 0 (sequence level: every row counted, as TRL's
 *     mean over the (B, 1) tensor). */
static void test_metrics(void)
{
    static const double deltas[] = {NAN, 1.5, 1.1, 0.7};
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int with_beta = 0; with_beta <= 1; with_beta++)
                for (int old = 0; old <= 1; old++)
                for (size_t di = 0; di < TU_COUNT(deltas); di++, k++) {
                    fh_grpo_options o;
                    gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                    o.temperature = 0.7;
                    o.beta = with_beta ? 0.04 : 0.0;
                    o.delta = deltas[di];
                    const int clipped = lt < 4, cispo = o.loss_type == FH_GRPO_LOSS_CISPO;
                    const int seq = o.importance_sampling_level == FH_GRPO_IS_SEQUENCE;
                    const gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16};
                    gp_problem p;
                    gp_fused f;
                    fh_status st;
                    /* Where both clip sides must show, take the first of a few seeds whose draw has them. */
                    for (uint64_t attempt = 0;; attempt++) {
                        gp_init(&p, 7, 8, 10, 29, FH_LAYOUT_VH, 1, 8000 + (uint64_t)k + 1000 * attempt);
                        gp_set_ref(&p, o.temperature);
                        if (old)
                            gp_set_old(&p, &o);
                        st = gp_run_fused(&p, &o, &c, &f);
                        /* c1 = min(r, delta) cannot exceed 1 + eps_high when delta <= it: no high side then. */
                        const int high_possible = !(o.delta <= 1.2);
                        const int both_sides = f.metrics.clip_ratio_low_mean > 0.0 &&
                                               (f.metrics.clip_ratio_high_mean > 0.0 || !high_possible);
                        if (st != FH_OK || !clipped || !old || seq || both_sides || attempt == 9)
                            break;
                        gp_fused_free(&f);
                        gp_free(&p);
                    }
                    char desc[512];
                    gp_describe(&p, &o, &c, desc, sizeof desc);
                    TU_CHECK(st == FH_OK, "[%s]: status %d", desc, (int)st);
                    if (st != FH_OK) {
                        gp_fused_free(&f);
                        gp_free(&p);
                        continue;
                    }
                    const fh_grpo_metrics *m = &f.metrics;
                    TU_CHECK(gp_isnan(m->kl) != with_beta && !isnan(m->entropy), "[%s]: kl %g entropy %g", desc, m->kl,
                             m->entropy);
                    TU_CHECK(gp_isnan(m->clip_ratio_low_mean) != clipped &&
                                 gp_isnan(m->clip_ratio_high_mean) != clipped &&
                                 gp_isnan(m->clip_ratio_region_mean) != clipped,
                             "[%s]: clip ratios %g %g %g", desc, m->clip_ratio_low_mean, m->clip_ratio_high_mean,
                             m->clip_ratio_region_mean);
                    TU_CHECK(gp_isnan(m->cispo_clip_ratio) != cispo, "[%s]: cispo_clip_ratio %g", desc,
                             m->cispo_clip_ratio);
                    gp_reference r;
                    gp_run_reference(&p, &o, 1.0, 0.0, &r);
                    const double diff = gp_metrics_diff(m, &r.metrics);
                    TU_CHECK(diff <= GRPO_METRIC_TOL,
                             "[%s]: metrics differ by %.2e: kl %g/%g entropy %g/%g low %g/%g high %g/%g region %g/%g "
                             "cispo %g/%g",
                             desc, diff, m->kl, r.metrics.kl, m->entropy, r.metrics.entropy, m->clip_ratio_low_mean,
                             r.metrics.clip_ratio_low_mean, m->clip_ratio_high_mean, r.metrics.clip_ratio_high_mean,
                             m->clip_ratio_region_mean, r.metrics.clip_ratio_region_mean, m->cispo_clip_ratio,
                             r.metrics.cispo_clip_ratio);
                    gp_reference_free(&r);
                    if (clipped) {
                        TU_CHECK(fabs(m->clip_ratio_region_mean - (m->clip_ratio_low_mean + m->clip_ratio_high_mean)) <=
                                     1e-15,
                                 "[%s]: region %g != low %g + high %g", desc, m->clip_ratio_region_mean,
                                 m->clip_ratio_low_mean, m->clip_ratio_high_mean);
                        if (old && !seq)
                            TU_CHECK(m->clip_ratio_low_mean > 0.0 && (m->clip_ratio_high_mean > 0.0 || o.delta <= 1.2),
                                     "[%s]: the draw clips on one side only (low %g, high %g)", desc,
                                     m->clip_ratio_low_mean, m->clip_ratio_high_mean);
                        if (!old && !(o.delta < 0.8)) /* r == 1; delta 0.7 makes c1 = 0.7 < 1 - eps_low */
                            TU_CHECK(m->clip_ratio_low_mean == 0.0 && m->clip_ratio_high_mean == 0.0 &&
                                         m->clip_ratio_region_mean == 0.0,
                                     "[%s]: on-policy clip ratios %g %g %g", desc, m->clip_ratio_low_mean,
                                     m->clip_ratio_high_mean, m->clip_ratio_region_mean);
                    }
                    if (cispo && !old) {
                        double positive = 0.0, total = 0.0;
                        for (int64_t b = 0; b < p.batch; b++) {
                            const double weight = seq ? 1.0 : 0.0;
                            positive += (p.adv[b] > 0.0f) * weight;
                            total += weight;
                            for (int64_t t = 0; !seq && t < p.seq; t++) {
                                positive += (p.adv[b] > 0.0f) * p.mask[b * p.seq + t];
                                total += p.mask[b * p.seq + t];
                            }
                        }
                        const double expected = positive / fmax(total, 1.0);
                        TU_CHECK(m->cispo_clip_ratio == expected, "[%s]: cispo_clip_ratio %.17g, hand count %.17g",
                                 desc, m->cispo_clip_ratio, expected);
                    }
                    gp_fused_free(&f);
                    gp_free(&p);
                }
}

/* ================================================================================================
 * Registration
 * ============================================================================================== */

int tu_register_grpo(void)
{
    static const tu_test reference[] = {
        {"loss_type x level x old x beta x delta vs reference", test_option_matrix},
        {"epsilons, SAPO temperatures, advantage scales", test_option_values},
    };
    static const tu_test masks[] = {
        {"empty rows, advantage signs, fractional masks", test_empty_rows_and_advantage_signs},
        {"grpo_case harness: empty last row, exact zero dx", test_grpo_case_empty_last_row},
        {"fully masked batch: exact zeros", test_fully_masked_batch},
        {"out-of-range ids under the mask", test_masked_out_of_range_ids},
    };
    static const tu_test clip[] = {
        {"on-policy r == 1 on each bound", test_on_policy_bounds},
        {"off-policy ratios exactly on the bounds (backward)", test_off_policy_exact_bounds},
    };
    static const tu_test shapes[] = {
        {"tile edges with temperature, entropy_coef, normalisers", test_tile_edges},
        {"tile configurations and hidden sizes", test_tile_configurations},
    };
    static const tu_test determinism[] = {
        {"identical runs are bitwise identical", test_repeated_runs},
        {"reused context and caller workspace", test_reused_and_caller_workspaces},
        {"split calls vs train step", test_split_vs_train_step},
        {"unused inputs are ignored", test_unused_inputs_ignored},
    };
    static const tu_test metrics[] = {
        {"NaN pattern and values per loss type", test_metrics},
    };
    if (tu_add_suite("grpo_reference", reference, TU_COUNT(reference)) ||
        tu_add_suite("grpo_masks", masks, TU_COUNT(masks)) || tu_add_suite("grpo_clip", clip, TU_COUNT(clip)) ||
        tu_add_suite("grpo_shapes", shapes, TU_COUNT(shapes)) ||
        tu_add_suite("grpo_determinism", determinism, TU_COUNT(determinism)) ||
        tu_add_suite("grpo_metrics", metrics, TU_COUNT(metrics)))
        return -1;
    return 0;
}
