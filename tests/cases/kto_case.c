/* Inputs: logits with standard deviation ~3 (ce_fill_linear), so that a token's log-prob is ~ -log V - 3 and a
 * summed sequence log-prob runs to a few hundred; each sequence has a random length in [1, T] and, when B > 1, the
 * last one is fully masked; half the padded positions hold targets outside [0, V) (-100 and V + t). Labels: sequence
 * 0 desirable, 1 undesirable, the others drawn. Reference log-probs are the policy's plus noise with a per-sequence
 * offset (sequence ones l + U(-10, 10); per-token ones logp + U(-0.4, 0.4) + U(-1, 1) per sequence), and the KL
 * term U(0, 2) (or log-ratios U(-1, 3), whose mean lands near 1), so that beta (r - kl) spreads over a few units
 * around 0 where the sigmoids have slope (with beta 0.1; larger betas saturate some sequences, as training does).
 *
 * Tolerances (fh_gradcheck's ctest cases and the kto suite):
 *   loss: absolute KTO_LOSS_TOL = 1e-6 of max(1, |loss|). A fused log-prob carries the fp32 logits' error, ~1e-7 of
 *     |logp|; a sequence log-prob sums up to T of them, and a sequence's loss moves by its slope, at most
 *     w beta / 4, times that error (~1e-6 beta w here), then the mean over B.
 *   metrics: KTO_METRIC_TOL = 1e-5 of max(1, |value|): rewards and log-probs are means of the sequence log-probs
 *     above, the logits means and the entropy average fp32 logits' functions; kl is an input's mean.
 *   per-sequence and per-token outputs: KTO_TOKEN_TOL = 1e-5 of 1 + |value| (the preference head's reasoning,
 *     tests/cases/preference_case.c: fp32 storage, log-probs 1-Lipschitz in the logits' error).
 *   gradients: normwise relative KTO_GRAD_NORM_REL_TOL = 1e-5, as cross-entropy, GRPO and the preference losses
 *     (same engine and fp32 GEMMs; dZ = g (onehot - p) with g the sequence's slope, whose own error is the slope's
 *     derivative times r's ~1e-6); bf16 cases take cross-entropy's bf16 tolerances (ce_grad_tolerance). */
#include "kto_case.h"

#include "bf16.h"
#include "ce_case.h"
#include "preference_case.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kto_case_spec_default(kto_case_spec *spec)
{
    memset(spec, 0, sizeof *spec);
    spec->batch = 8;
    spec->seq = 23;
    spec->hidden = 67;
    spec->vocab = 5003;
    spec->layout = FH_LAYOUT_VH;
    fh_kto_options_init(&spec->options);
    spec->seed = 1;
    spec->grad_output = 1.0f;
}

fh_kto_metrics kto_fh_metrics(const ref_kto_metrics *m)
{
    const fh_kto_metrics f = {m->kl,           m->rewards_chosen, m->rewards_rejected, m->rewards_margins,
                              m->logps_chosen, m->logps_rejected, m->logits_chosen,    m->logits_rejected,
                              m->entropy};
    return f;
}

double kto_metrics_diff(const fh_kto_metrics *f, const fh_kto_metrics *r)
{
    const double pairs[][2] = {{f->kl, r->kl},
                               {f->rewards_chosen, r->rewards_chosen},
                               {f->rewards_rejected, r->rewards_rejected},
                               {f->rewards_margins, r->rewards_margins},
                               {f->logps_chosen, r->logps_chosen},
                               {f->logps_rejected, r->logps_rejected},
                               {f->logits_chosen, r->logits_chosen},
                               {f->logits_rejected, r->logits_rejected},
                               {f->entropy, r->entropy}};
    double m = 0.0;
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++)
        m = fmax(m, preference_value_diff(pairs[k][0], pairs[k][1]));
    return m;
}

static int64_t case_n(const kto_case_spec *s)
{
    return s->batch * s->seq;
}

fh_kto_batch kto_case_batch(const kto_case *c)
{
    const fh_kto_batch b = {c->spec.batch,       c->spec.seq,          c->targets, c->mask, c->labels,
                            c->ref_logps,        c->ref_per_token_logps, c->kl,    c->kl_logratios, NULL};
    return b;
}

/* The reference problem in double with the canonical [H, V] weight; the arrays are the caller's to free. */
typedef struct ref_inputs {
    double *x, *w, *b, *mask, *ref, *ref_tok, *kl, *kl_logratios;
} ref_inputs;

static ref_kto_problem ref_problem(const kto_case *c, ref_inputs *in)
{
    const kto_case_spec *s = &c->spec;
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden, B = (size_t)s->batch;
    in->x = ce_doubles(c->x, n * h);
    in->w = ce_weight_to_reference(s->layout, s->hidden, s->vocab, c->weight);
    in->b = ce_doubles(c->bias, (size_t)s->vocab);
    in->mask = ce_doubles(c->mask, n);
    in->ref = ce_doubles(c->ref_logps, B);
    in->ref_tok = ce_doubles(c->ref_per_token_logps, n);
    in->kl = ce_doubles(c->kl, 1);
    in->kl_logratios = ce_doubles(c->kl_logratios, B);
    const ref_kto_problem p = {s->batch, s->seq,    s->hidden,   s->vocab, in->x,  in->w,   in->b,
                               c->targets, in->mask, c->labels, in->ref,  in->ref_tok, in->kl, in->kl_logratios};
    return p;
}

static void ref_inputs_free(ref_inputs *in)
{
    double *p[] = {in->x, in->w, in->b, in->mask, in->ref, in->ref_tok, in->kl, in->kl_logratios};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

static ref_kto_options ref_options(const fh_kto_options *o)
{
    const ref_kto_options r = {(ref_kto_loss_type)o->loss_type, o->beta, o->desirable_weight, o->undesirable_weight};
    return r;
}

/* The policy's sequence log-probs and token log-probs (the references are drawn around them). */
static void policy_logps(const kto_case *c, double *l, double *logp)
{
    const kto_case_spec *s = &c->spec;
    const int64_t B = s->batch, T = s->seq;
    ref_inputs in;
    ref_kto_problem p = ref_problem(c, &in);
    /* any valid reference and KL inputs: only l and logp are read */
    double *zero = ce_zalloc((size_t)B, sizeof(double)), kl = 0.0;
    p.ref_logps = zero;
    p.ref_per_token_logps = NULL;
    p.kl = s->options.loss_type == FH_KTO_LOSS_KTO ? &kl : NULL;
    p.kl_logratios = NULL;
    const ref_kto_options o = ref_options(&s->options);
    ref_kto_result r = {0};
    r.sequence_logps = l;
    r.logp = logp;
    if (ref_kto_forward(&p, &o, &r) != 0)
        memset(logp, 0, sizeof(double) * (size_t)(B * T)), memset(l, 0, sizeof(double) * (size_t)B);
    free(zero);
    ref_inputs_free(&in);
}

static void make_inputs(const kto_case_spec *s, kto_case *c)
{
    const int64_t B = s->batch, T = s->seq, n = case_n(s);
    const size_t h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 15485863 + 11;
    c->x = ce_zalloc((size_t)n * h, sizeof(float));
    c->weight = ce_zalloc(h * v, sizeof(float));
    c->bias = s->bias ? ce_zalloc(v, sizeof(float)) : NULL;
    ce_fill_linear(&rng, n, s->hidden, s->vocab, 3.0, c->x, c->weight, c->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        c->x_bf16 = bf16_round_in_place(c->x, (size_t)n * h);
        c->weight_bf16 = bf16_round_in_place(c->weight, h * v);
    }
    c->targets = ce_zalloc((size_t)n, sizeof(int64_t));
    c->mask = ce_zalloc((size_t)n, sizeof(float));
    c->labels = ce_zalloc((size_t)B, 1);
    for (int64_t b = 0; b < B; b++) {
        const int64_t length = B > 1 && b == B - 1 ? 0 : 1 + (int64_t)(ref_uniform(&rng) * (double)T);
        c->labels[b] = b == 0 ? 1 : b == 1 ? 0 : ref_uniform(&rng) < 0.5;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            c->mask[i] = t < length ? 1.0f : 0.0f;
            c->targets[i] = (int64_t)(ref_uniform(&rng) * (double)s->vocab);
            if (t >= length && ref_uniform(&rng) < 0.5)
                c->targets[i] = t & 1 ? -100 : s->vocab + t;
        }
    }
    double *l = ce_zalloc((size_t)B, sizeof(double)), *logp = ce_zalloc((size_t)n, sizeof(double));
    policy_logps(c, l, logp);
    if (s->ref == KTO_REF_SEQUENCE) {
        c->ref_logps = ce_zalloc((size_t)B, sizeof(float));
        for (int64_t b = 0; b < B; b++)
            c->ref_logps[b] = (float)(l[b] + 10.0 * (2.0 * ref_uniform(&rng) - 1.0));
    } else {
        c->ref_per_token_logps = ce_zalloc((size_t)n, sizeof(float));
        for (int64_t b = 0; b < B; b++) {
            const double offset = 2.0 * ref_uniform(&rng) - 1.0;
            for (int64_t t = 0; t < T; t++)
                c->ref_per_token_logps[b * T + t] = (float)(logp[b * T + t] + offset + 0.8 * (ref_uniform(&rng) - 0.5));
        }
    }
    free(l), free(logp);
    if (s->options.loss_type == FH_KTO_LOSS_KTO && s->kl == KTO_KL_VALUE) {
        c->kl = ce_zalloc(1, sizeof(float));
        c->kl[0] = (float)(2.0 * ref_uniform(&rng));
    } else if (s->options.loss_type == FH_KTO_LOSS_KTO) {
        c->kl_logratios = ce_zalloc((size_t)B, sizeof(float));
        for (int64_t b = 0; b < B; b++)
            c->kl_logratios[b] = (float)(4.0 * ref_uniform(&rng) - 1.0);
    }
}

static fh_linear case_linear(const kto_case *c)
{
    const kto_case_spec *s = &c->spec;
    return ce_case_linear(case_n(s), s->hidden, s->vocab, s->layout, s->dtype, c->x, c->x_bf16, c->weight,
                          c->weight_bf16, c->bias);
}

static fh_context *case_context(const kto_case_spec *s)
{
    const ce_case_settings settings = {.threads = s->threads, .tile_rows = s->tile_rows, .tile_vocab = s->tile_vocab,
                                       .fp32_du = s->fp32_du};
    fh_context *ctx = NULL;
    return ce_case_context(&settings, &ctx) == FH_OK ? ctx : NULL;
}

/* fh_kto_forward_backward on ctx: fp32 values of the spec's grad_dtype gradients in dx, dweight, dbias. */
static fh_status fused_step(const kto_case *c, fh_context *ctx, float grad_output, float grad_beta,
                            fh_kto_outputs *out, float *dx, float *dweight, float *dbias)
{
    const kto_case_spec *s = &c->spec;
    const fh_linear lin = case_linear(c);
    const fh_kto_batch batch = kto_case_batch(c);
    ce_grads_io io;
    ce_grads_io_begin(&io, s->grad_dtype, (size_t)case_n(s), (size_t)s->hidden, (size_t)s->vocab, grad_beta, dx,
                      dweight, dbias);
    const fh_status st = fh_kto_forward_backward(ctx, &lin, &batch, &s->options, &grad_output, out, &io.grads);
    ce_grads_io_finish(&io);
    return st;
}

fh_status kto_case_step(const kto_case *c, float grad_output, float grad_beta, float *dx, float *dweight,
                        float *dbias)
{
    fh_context *ctx = case_context(&c->spec);
    if (!ctx)
        return FH_ERR_OUT_OF_MEMORY;
    fh_kto_outputs none = {NULL, NULL, NULL, NULL, NULL};
    const fh_status st = fused_step(c, ctx, grad_output, grad_beta, &none, dx, dweight, dbias);
    fh_context_destroy(ctx);
    return st;
}

static fh_kto_outputs outputs_of(const kto_case_spec *s, kto_fused_outputs *f)
{
    f->sequence_logps = ce_zalloc((size_t)s->batch, sizeof(float));
    f->rewards = ce_zalloc((size_t)s->batch, sizeof(float));
    f->logp = ce_zalloc((size_t)case_n(s), sizeof(float));
    const fh_kto_outputs out = {&f->loss, &f->metrics, f->sequence_logps, f->rewards, f->logp};
    return out;
}

static fh_status run_fused(const kto_case_spec *s, kto_case *c)
{
    fh_context *ctx = case_context(s);
    if (!ctx)
        return FH_ERR_OUT_OF_MEMORY;
    const fh_linear lin = case_linear(c);
    const fh_kto_batch batch = kto_case_batch(c);
    fh_kto_outputs out = outputs_of(s, &c->forward);
    fh_status st = fh_kto_forward(ctx, &lin, &batch, &s->options, &out);
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

static void run_reference(const kto_case_spec *s, kto_case *c)
{
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden, v = (size_t)s->vocab;
    ref_inputs in;
    const ref_kto_problem p = ref_problem(c, &in);
    const ref_kto_options o = ref_options(&s->options);
    c->ref_sequence_logps = ce_zalloc((size_t)s->batch, sizeof(double));
    c->ref_rewards = ce_zalloc((size_t)s->batch, sizeof(double));
    c->ref_logp = ce_zalloc(n, sizeof(double));
    ref_kto_result r = {0};
    r.sequence_logps = c->ref_sequence_logps;
    r.rewards = c->ref_rewards;
    r.logp = c->ref_logp;
    ref_kto_forward(&p, &o, &r);
    c->ref_loss = r.loss;
    c->ref_metrics = kto_fh_metrics(&r.metrics);
    double *dw = ce_zalloc(h * v, sizeof(double));
    c->ref_dx = ce_zalloc(n * h, sizeof(double));
    c->ref_dbias = c->bias ? ce_zalloc(v, sizeof(double)) : NULL;
    ref_kto_backward(&p, &o, s->grad_output, c->ref_dx, dw, c->ref_dbias);
    c->ref_dweight = ce_zalloc(h * v, sizeof(double));
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, dw, c->ref_dweight);
    free(dw);
    ref_inputs_free(&in);
}

static void measure_outputs(const kto_case *c, const kto_fused_outputs *f, kto_diff *d)
{
    const size_t B = (size_t)c->spec.batch, n = (size_t)case_n(&c->spec);
    const double loss = isnan(f->loss) ? NAN : fabs(f->loss - c->ref_loss);
    d->loss = loss > d->loss || isnan(loss) ? loss : d->loss;
    d->metrics = fmax(d->metrics, kto_metrics_diff(&f->metrics, &c->ref_metrics));
    d->sequence_logps = fmax(d->sequence_logps, preference_token_diff(f->sequence_logps, c->ref_sequence_logps, B));
    d->rewards = fmax(d->rewards, preference_token_diff(f->rewards, c->ref_rewards, B));
    d->logp = fmax(d->logp, preference_token_diff(f->logp, c->ref_logp, n));
}

static void measure(const kto_case_spec *s, const kto_case *c, kto_diff *d)
{
    const size_t n = (size_t)case_n(s), h = (size_t)s->hidden, v = (size_t)s->vocab;
    memset(d, 0, sizeof *d);
    d->grad_tolerance = ce_grad_tolerance(KTO_GRAD_NORM_REL_TOL, s->dtype == FH_DTYPE_BF16 && !s->fp32_du, s->grad_dtype);
    d->dbias_tolerance = ce_grad_tolerance(KTO_GRAD_NORM_REL_TOL, 0, s->grad_dtype);
    d->loss_tolerance = KTO_LOSS_TOL * fmax(1.0, fabs(c->ref_loss));
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

int kto_diff_pass(const kto_diff *d)
{
    return d->loss <= d->loss_tolerance && d->metrics <= KTO_METRIC_TOL && d->sequence_logps <= KTO_TOKEN_TOL &&
           d->rewards <= KTO_TOKEN_TOL && d->logp <= KTO_TOKEN_TOL && d->dx <= d->grad_tolerance &&
           d->dweight <= d->grad_tolerance && d->dbias <= d->dbias_tolerance && d->masked_rows_touched == 0;
}

fh_status kto_case_run(const kto_case_spec *spec, kto_case *c, kto_diff *d)
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

void kto_case_free(kto_case *c)
{
    void *p[] = {c->x,        c->weight,         c->bias,           c->mask,        c->ref_logps,
                 c->ref_per_token_logps, c->kl,  c->kl_logratios,   c->x_bf16,      c->weight_bf16,
                 c->targets,  c->labels,         c->forward.sequence_logps, c->forward.rewards, c->forward.logp,
                 c->step.sequence_logps, c->step.rewards, c->step.logp, c->dx,      c->dweight,
                 c->dbias,    c->ref_sequence_logps, c->ref_rewards, c->ref_logp,   c->ref_dx,
                 c->ref_dweight, c->ref_dbias};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
    memset(c, 0, sizeof *c);
}
