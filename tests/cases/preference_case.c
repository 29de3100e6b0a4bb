/* Inputs: logits with standard deviation ~3 (ce_fill_linear), so that a token's log-prob is ~ -log V - 3 and
 * a summed sequence log-prob runs to a few hundred; each pair's chosen sequence has a random length in [1, T] and
 * its rejected one that length +- 3 (clamped), so that the margins c - r stay within a few tokens' log-probs and
 * the losses sit where they have slope; the last pair's rejected sequence is fully masked when B > 1 (except
 * for orpo, whose log(1 - e^l) is -inf at l = 0); half the padded positions hold targets outside [0, V) (-100
 * and V + t). Reference log-probs (dpo) are the policy's plus noise with a per-sequence offset, so that beta u
 * spreads over a few units on both sides of 0 and of hinge's kink at 1: sequence ones l + U(-10, 10) (summed) or
 * U(-1, 1) (averaged), per-token ones logp + U(-0.4, 0.4) + U(-1, 1) per sequence.
 * Pairs are redrawn (the chosen sequence's targets) until |1 - beta u| >= PREFERENCE_KINK_GUARD under hinge and
 * |reward margin| >= PREFERENCE_KINK_GUARD: the fused and reference margins then lie on the same side of relu's
 * kink and of the accuracy's comparison (they differ by beta times the margin's error, ~1e-6; see the loss
 * tolerance). With aot or aot_unpaired listed, also until no two pairs' sorted values (c - r and ref_c - ref_r, or
 * cs and rs) lie within the guard of each other, so that both sides sort the pairs alike.
 *
 * Tolerances (fh_gradcheck's ctest cases and the preference suite; the worst fraction of each seen over them is in
 * brackets):
 *   loss: absolute PREFERENCE_LOSS_TOL = 1e-6 of max(1, |loss|) [0.12]. A fused log-prob carries the fp32 logits'
 *     error, ~1e-7 of |logp| here; a sequence log-prob sums up to T of them (partly cancelling), and a pair's loss
 *     moves by its slope times its margin's error: |slope| <= beta for sigmoid, robust (/(1 - 2 ls)), hinge and
 *     orpo's log-odds term, 2 |u - 1 / (2 beta)| <= 2 sqrt(loss) for ipo (on averaged log-probs); the NLL is a mean
 *     of log-probs. The worst case, dpo ipo at loss ~25, is 1.2e-7 of |loss|. TRL's current DPO types
 *     (ctest preference_trl_*) [0.10]: their slopes are beta times sigmoids, or, for the quadratic ipo and
 *     sppo_hard, 2 sqrt(term) (sppo_hard on summed log-ratios reaches loss ~100, at 0.28 of the tolerance).
 *   metrics: PREFERENCE_METRIC_TOL = 1e-5 of max(1, |value|) [0.013]: rewards and log-probs are (means of) the
 *     sequence log-probs above, the logits means average fp32 logits; accuracies are counts, exact thanks to the
 *     guard.
 *   per-sequence and per-token outputs: PREFERENCE_TOKEN_TOL = 1e-5 of 1 + |value| [0.05] (GP_TOKEN_TOL's reasoning,
 *     tests/grpo_harness.h: fp32 storage, log-probs 1-Lipschitz in the logits' error).
 *   gradients: normwise relative PREFERENCE_GRAD_NORM_REL_TOL = 1e-5 [0.044], as cross-entropy and GRPO (same
 *     engine and fp32 GEMMs; dZ = g (onehot - p) with g from the pair's slope, whose own error is the slope's
 *     derivative times the margin's ~1e-6); bf16 cases take cross-entropy's bf16 tolerances (ce_grad_tolerance,
 *     tests/cases/ce_case.c) [0.54: 2.2e-3 against 4e-3; with bf16 gradients 2.3e-3 against 8e-3, as cross-entropy's; TRL's
 *     current DPO types and lists 0.44]. */
#include "preference_case.h"

#include "bf16.h"
#include "ce_case.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void preference_case_spec_default(preference_case_spec *spec)
{
    memset(spec, 0, sizeof *spec);
    spec->pairs = 4;
    spec->seq = 23;
    spec->hidden = 67;
    spec->vocab = 5003;
    spec->layout = FH_LAYOUT_VH;
    fh_preference_options_init(&spec->options);
    spec->seed = 1;
    spec->grad_output = 1.0f;
}

ref_preference_options preference_ref_options(const fh_preference_options *o)
{
    ref_preference_options r = {(ref_preference_loss)o->loss, (ref_preference_loss_type)o->loss_type, o->beta,
                                o->label_smoothing, o->simpo_gamma, o->rpo_alpha, o->cpo_alpha,
                                (ref_preference_dpo_semantics)o->dpo_semantics, o->loss_type_count, {0}, {0},
                                o->discopop_tau};
    for (int k = 0; k < o->loss_type_count && k < FH_PREFERENCE_MAX_LOSS_TYPES; k++) {
        r.types[k] = (ref_preference_loss_type)o->loss_types[k];
        r.weights[k] = o->loss_weights[k];
    }
    return r;
}

fh_preference_metrics preference_fh_metrics(const ref_preference_metrics *m)
{
    const fh_preference_metrics f = {m->rewards_chosen, m->rewards_rejected, m->rewards_accuracies,
                                     m->rewards_margins, m->logps_chosen, m->logps_rejected, m->logits_chosen,
                                     m->logits_rejected, m->nll_loss, m->log_odds_ratio, m->log_odds_chosen,
                                     m->entropy, m->mean_token_accuracy};
    return f;
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

static int64_t case_n(const preference_case_spec *s)
{
    return 2 * s->pairs * s->seq;
}

/* The reference problem in double with the canonical [H, V] weight; the arrays are the caller's to free. */
typedef struct ref_inputs {
    double *x, *w, *b, *mask, *ref, *ref_tok;
} ref_inputs;

static ref_preference_problem ref_problem(const preference_case *c, ref_inputs *in)
{
    const preference_case_spec *s = &c->spec;
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden;
    in->x = doubles(c->x, n * h);
    in->w = ce_weight_to_reference(s->layout, s->hidden, s->vocab, c->weight);
    in->b = doubles(c->bias, (size_t)s->vocab);
    in->mask = doubles(c->mask, n);
    in->ref = doubles(c->ref_logps, (size_t)(2 * s->pairs));
    in->ref_tok = doubles(c->ref_per_token_logps, n);
    const ref_preference_problem p = {s->pairs, s->seq, s->hidden, s->vocab, in->x, in->w, in->b, c->targets,
                                      in->mask, in->ref, in->ref_tok};
    return p;
}

static void ref_inputs_free(ref_inputs *in)
{
    free(in->x), free(in->w), free(in->b), free(in->mask), free(in->ref), free(in->ref_tok);
}

/* The reference's forward on the case's current inputs: l and rewards [2B], logp [2B T] (each may be NULL).
 * Returns ref_preference_forward's status (-2 for options the library rejects too). */
static int reference_values(const preference_case *c, double *l, double *rewards, double *logp)
{
    ref_inputs in;
    const ref_preference_problem p = ref_problem(c, &in);
    const ref_preference_options o = preference_ref_options(&c->spec.options);
    ref_preference_result r = {0};
    r.sequence_logps = l;
    r.rewards = rewards;
    r.logp = logp;
    const int rc = ref_preference_forward(&p, &o, &r);
    ref_inputs_free(&in);
    return rc;
}

/* Sequence s: `length` unmasked tokens with targets in [0, V), then padding, half of it outside [0, V). */
static void draw_sequence(const preference_case_spec *s, preference_case *c, uint64_t *rng, int64_t seq_index,
                          int64_t length)
{
    for (int64_t t = 0; t < s->seq; t++) {
        const int64_t i = seq_index * s->seq + t;
        c->mask[i] = t < length ? 1.0f : 0.0f;
        c->targets[i] = (int64_t)(ref_uniform(rng) * (double)s->vocab);
        if (t >= length && ref_uniform(rng) < 0.5)
            c->targets[i] = t & 1 ? -100 : s->vocab + t;
    }
}

/* Reference log-probs around the policy's (header comment). */
static void draw_references(const preference_case_spec *s, preference_case *c, uint64_t *rng)
{
    const int64_t S = 2 * s->pairs, T = s->seq, n = S * T;
    if (s->ref == PREFERENCE_REF_NONE)
        return;
    double *l = zalloc((size_t)S, sizeof(double)), *logp = zalloc((size_t)n, sizeof(double));
    free(c->ref_logps);
    free(c->ref_per_token_logps);
    c->ref_logps = c->ref_per_token_logps = NULL;
    reference_values(c, l, NULL, logp);
    const ref_preference_options o = preference_ref_options(&s->options);
    const double spread = ref_preference_averaged(&o) ? 1.0 : 10.0;
    if (s->ref == PREFERENCE_REF_SEQUENCE) {
        c->ref_logps = zalloc((size_t)S, sizeof(float));
        for (int64_t q = 0; q < S; q++)
            c->ref_logps[q] = (float)(l[q] + spread * (2.0 * ref_uniform(rng) - 1.0));
    } else {
        c->ref_per_token_logps = zalloc((size_t)n, sizeof(float));
        for (int64_t q = 0; q < S; q++) {
            const double offset = 2.0 * ref_uniform(rng) - 1.0;
            for (int64_t t = 0; t < T; t++)
                c->ref_per_token_logps[q * T + t] = (float)(logp[q * T + t] + offset + 0.8 * (ref_uniform(rng) - 0.5));
        }
    }
    free(l), free(logp);
}

/* 1 when the options' loss type (or list, TRL's current dpo) names type. */
static int lists_type(const fh_preference_options *o, fh_preference_loss_type type)
{
    int found = o->loss_type_count == 0 && o->loss_type == type;
    for (int k = 0; k < o->loss_type_count && k < FH_PREFERENCE_MAX_LOSS_TYPES; k++)
        found |= o->loss_types[k] == type;
    return found;
}

/* Pairs whose reward margin beta u (dpo, cpo) sits within the guard of 0, or of hinge's kink. */
static int near_kink(const preference_case_spec *s, double margin)
{
    return fabs(margin) < PREFERENCE_KINK_GUARD ||
           (lists_type(&s->options, FH_PREFERENCE_HINGE) && fabs(1.0 - margin) < PREFERENCE_KINK_GUARD);
}

/* aot and aot_unpaired sort the pairs by c - r and ref_c - ref_r, or by cs and rs: pair b's keys within the guard
 * of another pair's, where fused and reference values could sort differently (and the gradient jumps). */
static int near_sort_tie(const preference_case_spec *s, const double *l, const double *rewards, int64_t b)
{
    const int aot = lists_type(&s->options, FH_PREFERENCE_AOT), unpaired = lists_type(&s->options, FH_PREFERENCE_AOT_UNPAIRED);
    const int64_t B = s->pairs;
    const double beta = s->options.beta;
    for (int64_t j = 0; j < B && (aot || unpaired); j++) {
        const double lr_b = l[b] - l[B + b], lr_j = l[j] - l[B + j];
        const double ref_b = lr_b - (rewards[b] - rewards[B + b]) / beta, ref_j = lr_j - (rewards[j] - rewards[B + j]) / beta;
        const double near = PREFERENCE_KINK_GUARD;
        if (j != b && ((aot && (fabs(lr_b - lr_j) < near || fabs(ref_b - ref_j) < near)) ||
                       (unpaired && (fabs(rewards[b] - rewards[j]) < near * beta ||
                                     fabs(rewards[B + b] - rewards[B + j]) < near * beta))))
            return 1;
    }
    return 0;
}

static void make_inputs(const preference_case_spec *s, preference_case *c)
{
    const int64_t B = s->pairs, T = s->seq, n = case_n(s);
    const size_t h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 15485863 + 5;
    c->x = zalloc((size_t)n * h, sizeof(float));
    c->weight = zalloc(h * v, sizeof(float));
    c->bias = s->bias ? zalloc(v, sizeof(float)) : NULL;
    ce_fill_linear(&rng, n, s->hidden, s->vocab, 3.0, c->x, c->weight, c->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        c->x_bf16 = bf16_round_in_place(c->x, (size_t)n * h);
        c->weight_bf16 = bf16_round_in_place(c->weight, h * v);
    }
    c->targets = zalloc((size_t)n, sizeof(int64_t));
    c->mask = zalloc((size_t)n, sizeof(float));
    int64_t *lengths = zalloc((size_t)B, sizeof(int64_t));
    for (int64_t b = 0; b < B; b++) {
        const int64_t chosen = 1 + (int64_t)(ref_uniform(&rng) * (double)T);
        int64_t rejected = chosen + (int64_t)(ref_uniform(&rng) * 7.0) - 3;
        rejected = rejected < 1 ? 1 : rejected > T ? T : rejected;
        if (B > 1 && b == B - 1 && s->options.loss != FH_PREFERENCE_ORPO)
            rejected = 0;
        lengths[b] = chosen;
        draw_sequence(s, c, &rng, b, chosen);
        draw_sequence(s, c, &rng, B + b, rejected);
    }
    double *rewards = zalloc((size_t)(2 * B), sizeof(double)), *l = zalloc((size_t)(2 * B), sizeof(double));
    for (int attempt = 0; attempt < 100; attempt++) {
        draw_references(s, c, &rng);
        if (reference_values(c, l, rewards, NULL) != 0)
            break; /* invalid options: the library's call will say so */
        int redrawn = 0;
        for (int64_t b = 0; b < B; b++)
            if (near_kink(s, rewards[b] - rewards[B + b]) || near_sort_tie(s, l, rewards, b)) {
                draw_sequence(s, c, &rng, b, lengths[b]);
                redrawn = 1;
            }
        if (!redrawn)
            break;
    }
    free(rewards);
    free(l);
    free(lengths);
}

static fh_linear case_linear(const preference_case *c)
{
    const preference_case_spec *s = &c->spec;
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    fh_linear lin;
    fh_linear_init(&lin, case_n(s), s->hidden, s->vocab, bf16 ? (const void *)c->x_bf16 : c->x,
                   bf16 ? (const void *)c->weight_bf16 : c->weight, s->layout, c->bias);
    lin.x_dtype = lin.weight_dtype = s->dtype;
    return lin;
}

static fh_context *case_context(const preference_case_spec *s)
{
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return NULL;
    fh_context_set(ctx, FH_PARAM_THREADS, s->threads);
    fh_context_set(ctx, FH_PARAM_TILE_ROWS, s->tile_rows);
    fh_context_set(ctx, FH_PARAM_TILE_VOCAB, s->tile_vocab);
    fh_context_set(ctx, FH_PARAM_FP32_DU, s->fp32_du);
    return ctx;
}

/* fh_preference_forward_backward on ctx: fp32 values of the spec's grad_dtype gradients in dx, dweight, dbias. */
static fh_status fused_step(const preference_case *c, fh_context *ctx, float grad_output, float grad_beta,
                            fh_preference_outputs *out, float *dx, float *dweight, float *dbias)
{
    const preference_case_spec *s = &c->spec;
    const fh_linear lin = case_linear(c);
    const fh_preference_batch batch = {s->pairs, s->seq, c->targets, c->mask, c->ref_logps, c->ref_per_token_logps, NULL};
    ce_grads_io io;
    ce_grads_io_begin(&io, s->grad_dtype, (size_t)case_n(s), (size_t)s->hidden, (size_t)s->vocab, grad_beta, dx,
                      dweight, dbias);
    const fh_status st = fh_preference_forward_backward(ctx, &lin, &batch, &s->options, &grad_output, out, &io.grads);
    ce_grads_io_finish(&io);
    return st;
}

fh_status preference_case_step(const preference_case *c, float grad_output, float grad_beta, float *dx,
                               float *dweight, float *dbias)
{
    fh_context *ctx = case_context(&c->spec);
    if (!ctx)
        return FH_ERR_OUT_OF_MEMORY;
    fh_preference_outputs none = {NULL, NULL, NULL, NULL, NULL};
    const fh_status st = fused_step(c, ctx, grad_output, grad_beta, &none, dx, dweight, dbias);
    fh_context_destroy(ctx);
    return st;
}

static fh_preference_outputs outputs_of(const preference_case_spec *s, preference_fused_outputs *f)
{
    f->sequence_logps = zalloc((size_t)(2 * s->pairs), sizeof(float));
    f->rewards = zalloc((size_t)(2 * s->pairs), sizeof(float));
    f->logp = zalloc((size_t)case_n(s), sizeof(float));
    const fh_preference_outputs out = {&f->loss, &f->metrics, f->sequence_logps, f->rewards, f->logp};
    return out;
}

static fh_status run_fused(const preference_case_spec *s, preference_case *c)
{
    fh_context *ctx = case_context(s);
    if (!ctx)
        return FH_ERR_OUT_OF_MEMORY;
    const fh_linear lin = case_linear(c);
    const fh_preference_batch batch = {s->pairs, s->seq, c->targets, c->mask, c->ref_logps, c->ref_per_token_logps, NULL};
    fh_preference_outputs out = outputs_of(s, &c->forward);
    fh_status st = fh_preference_forward(ctx, &lin, &batch, &s->options, &out);
    if (st == FH_OK) {
        out = outputs_of(s, &c->step);
        /* gradient beta 0 must overwrite the NaN garbage ce_alloc_grads leaves */
        ce_alloc_grads((size_t)case_n(s), (size_t)s->hidden, (size_t)s->vocab, s->bias, 0.0f, &c->dx, &c->dweight,
                       &c->dbias);
        st = fused_step(c, ctx, s->grad_output, 0.0f, &out, c->dx, c->dweight, c->dbias);
    }
    fh_context_destroy(ctx);
    return st;
}

static void run_reference(const preference_case_spec *s, preference_case *c)
{
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden, v = (size_t)s->vocab;
    ref_inputs in;
    const ref_preference_problem p = ref_problem(c, &in);
    const ref_preference_options o = preference_ref_options(&s->options);
    c->ref_sequence_logps = zalloc((size_t)(2 * s->pairs), sizeof(double));
    c->ref_rewards = zalloc((size_t)(2 * s->pairs), sizeof(double));
    c->ref_logp = zalloc(n, sizeof(double));
    ref_preference_result r = {0};
    r.sequence_logps = c->ref_sequence_logps;
    r.rewards = c->ref_rewards;
    r.logp = c->ref_logp;
    ref_preference_forward(&p, &o, &r);
    c->ref_loss = r.loss;
    c->ref_metrics = preference_fh_metrics(&r.metrics);
    double *dw = zalloc(h * v, sizeof(double));
    c->ref_dx = zalloc(n * h, sizeof(double));
    c->ref_dbias = c->bias ? zalloc(v, sizeof(double)) : NULL;
    ref_preference_backward(&p, &o, s->grad_output, c->ref_dx, dw, c->ref_dbias);
    c->ref_dweight = zalloc(h * v, sizeof(double));
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, dw, c->ref_dweight);
    free(dw);
    ref_inputs_free(&in);
}

double preference_value_diff(double f, double r)
{
    if (isnan(f) || isnan(r))
        return isnan(f) && isnan(r) ? 0.0 : INFINITY;
    return fabs(f - r) / fmax(1.0, fabs(r));
}

double preference_metrics_diff(const fh_preference_metrics *f, const fh_preference_metrics *r)
{
    const double pairs[][2] = {{f->rewards_chosen, r->rewards_chosen},
                               {f->rewards_rejected, r->rewards_rejected},
                               {f->rewards_accuracies, r->rewards_accuracies},
                               {f->rewards_margins, r->rewards_margins},
                               {f->logps_chosen, r->logps_chosen},
                               {f->logps_rejected, r->logps_rejected},
                               {f->logits_chosen, r->logits_chosen},
                               {f->logits_rejected, r->logits_rejected},
                               {f->nll_loss, r->nll_loss},
                               {f->log_odds_ratio, r->log_odds_ratio},
                               {f->log_odds_chosen, r->log_odds_chosen},
                               {f->entropy, r->entropy},
                               {f->mean_token_accuracy, r->mean_token_accuracy}};
    double m = 0.0;
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++)
        m = fmax(m, preference_value_diff(pairs[k][0], pairs[k][1]));
    return m;
}

double preference_token_diff(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count && !isnan(m); i++) {
        const double e = fabs((double)f[i] - r[i]) / (1.0 + fabs(r[i]));
        m = e > m || isnan(e) ? e : m;
    }
    return m;
}

static void measure_outputs(const preference_case *c, const preference_fused_outputs *f, preference_diff *d)
{
    const size_t S = (size_t)(2 * c->spec.pairs), n = (size_t)case_n(&c->spec);
    const double loss = isnan(f->loss) ? NAN : fabs(f->loss - c->ref_loss);
    d->loss = loss > d->loss || isnan(loss) ? loss : d->loss;
    d->metrics = fmax(d->metrics, preference_metrics_diff(&f->metrics, &c->ref_metrics));
    d->sequence_logps = fmax(d->sequence_logps, preference_token_diff(f->sequence_logps, c->ref_sequence_logps, S));
    d->rewards = fmax(d->rewards, preference_token_diff(f->rewards, c->ref_rewards, S));
    d->logp = fmax(d->logp, preference_token_diff(f->logp, c->ref_logp, n));
}

static void measure(const preference_case_spec *s, const preference_case *c, preference_diff *d)
{
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden, v = (size_t)s->vocab;
    memset(d, 0, sizeof *d);
    d->grad_tolerance =
        ce_grad_tolerance(PREFERENCE_GRAD_NORM_REL_TOL, s->dtype == FH_DTYPE_BF16 && !s->fp32_du, s->grad_dtype);
    d->dbias_tolerance = ce_grad_tolerance(PREFERENCE_GRAD_NORM_REL_TOL, 0, s->grad_dtype);
    d->loss_tolerance = PREFERENCE_LOSS_TOL * fmax(1.0, fabs(c->ref_loss));
    measure_outputs(c, &c->forward, d);
    measure_outputs(c, &c->step, d);
    d->dx = ce_compare(c->dx, c->ref_dx, n * h).norm_rel;
    d->dweight = ce_compare(c->dweight, c->ref_dweight, h * v).norm_rel;
    if (c->dbias)
        d->dbias = ce_compare(c->dbias, c->ref_dbias, v).norm_rel;
    /* A masked token's coefficient is 0: its dZ row is 0 and its dx row exactly 0. */
    for (size_t i = 0; i < n; i++) {
        int touched = 0;
        for (size_t k = 0; c->mask[i] == 0.0f && k < h; k++)
            touched |= c->dx[i * h + k] != 0.0f;
        d->masked_rows_touched += touched;
    }
}

int preference_diff_pass(const preference_diff *d)
{
    return d->loss <= d->loss_tolerance && d->metrics <= PREFERENCE_METRIC_TOL &&
           d->sequence_logps <= PREFERENCE_TOKEN_TOL && d->rewards <= PREFERENCE_TOKEN_TOL &&
           d->logp <= PREFERENCE_TOKEN_TOL && d->dx <= d->grad_tolerance && d->dweight <= d->grad_tolerance &&
           d->dbias <= d->dbias_tolerance && d->masked_rows_touched == 0;
}

fh_status preference_case_run(const preference_case_spec *spec, preference_case *c, preference_diff *d)
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

void preference_case_free(preference_case *c)
{
    void *p[] = {c->x, c->weight, c->bias, c->mask, c->ref_logps, c->ref_per_token_logps, c->x_bf16,
                 c->weight_bf16, c->targets, c->forward.sequence_logps, c->forward.rewards, c->forward.logp,
                 c->step.sequence_logps, c->step.rewards, c->step.logp, c->dx, c->dweight, c->dbias,
                 c->ref_sequence_logps, c->ref_rewards, c->ref_logp, c->ref_dx, c->ref_dweight, c->ref_dbias};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    memset(c, 0, sizeof *c);
}
