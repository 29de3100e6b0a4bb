/* preference: the fused preference head (fh_preference_forward, fh_preference_forward_backward) against the
 * double-precision TRL-semantics reference (ref/ref_preference.h):
 *   - every loss with every loss_type TRL gives it (dpo at TRL v0.28's semantics), reference modes, NLL weights and
 *     label smoothing, in both schedules of the single-call step (tests/cases/preference_case.c has the inputs and the
 *     tolerances); dpo at TRL's current semantics: each of its 15 loss types alone and weighted lists, both
 *     schedules, its metrics (entropy, token accuracy, means over no token), its refusals;
 *   - the two schedules against each other; grad_output scaling; gradient accumulation (beta 1);
 *   - edge masks (every token masked, a whole half masked, fractional weights) and the metrics' NaN pattern;
 *   - the API contracts: each bad argument's own status with every output untouched and a message naming it, the
 *     workspace query, the option defaults, optional outputs, masked out-of-range targets. */
#include "ce_case.h"
#include "preference_case.h"
#include "contract_driver.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Drawn inputs (preference_case): fused vs reference, schedules, scaling, accumulation
 * ============================================================================================== */

/* Every loss with every loss_type TRL gives it. */
static const struct {
    fh_preference_loss loss;
    fh_preference_loss_type type;
} variants[] = {
    {FH_PREFERENCE_DPO, FH_PREFERENCE_SIGMOID}, {FH_PREFERENCE_DPO, FH_PREFERENCE_HINGE},
    {FH_PREFERENCE_DPO, FH_PREFERENCE_IPO},     {FH_PREFERENCE_DPO, FH_PREFERENCE_ROBUST},
    {FH_PREFERENCE_CPO, FH_PREFERENCE_SIGMOID}, {FH_PREFERENCE_CPO, FH_PREFERENCE_HINGE},
    {FH_PREFERENCE_CPO, FH_PREFERENCE_IPO},     {FH_PREFERENCE_SIMPO, FH_PREFERENCE_SIGMOID},
    {FH_PREFERENCE_ORPO, FH_PREFERENCE_SIGMOID},
};

static void describe(const preference_case_spec *s, char *buf, size_t size)
{
    static const char *const losses[] = {"dpo", "orpo", "simpo", "cpo"};
    static const char *const types[] = {"sigmoid",  "hinge",    "ipo",       "robust", "exo_pair",
                                        "nca_pair", "bco_pair", "sppo_hard", "aot",    "aot_unpaired",
                                        "apo_zero", "apo_down", "discopop",  "sft",    "sigmoid_norm"};
    static const char *const refs[] = {"none", "sequence", "token"};
    const fh_preference_options *o = &s->options;
    char list[256] = "";
    for (int k = 0; k < (o->loss_type_count ? o->loss_type_count : 1); k++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s*%g", k ? "," : "",
                 types[o->loss_type_count ? o->loss_types[k] : o->loss_type],
                 o->loss_type_count ? o->loss_weights[k] : 1.0);
    snprintf(buf, size,
             "%s(%s)/%s ref=%s beta=%g ls=%g gamma=%g rpo=%g cpo=%g | B=%lld T=%lld H=%lld V=%lld %s bias=%d | "
             "tiles=%lldx%lld threads=%d g=%g seed=%llu",
             losses[o->loss], o->dpo_semantics == FH_PREFERENCE_TRL_0_28 ? "trl 0.28" : "trl now", list, refs[s->ref],
             o->beta, o->label_smoothing, o->simpo_gamma,
             o->rpo_alpha, o->cpo_alpha, (long long)s->pairs, (long long)s->seq, (long long)s->hidden,
             (long long)s->vocab, s->layout == FH_LAYOUT_HV ? "hv" : "vh", s->bias, (long long)s->tile_rows,
             (long long)s->tile_vocab, s->threads, (double)s->grad_output, (unsigned long long)s->seed);
}

/* B = 5 pairs of T = 7 tokens (n = 70), H = 11, V = 37 = 2 x 16 + 5 (a 5-column edge tile). Row blocks: tile_rows
 * 28 holds two pairs (blocks of whole pairs, more than one block); streaming: tile_rows 6 < 2 T = 14. Layout and
 * bias alternate with the seed. */
enum { ROW_BLOCK_ROWS = 28, STREAMING_ROWS = 6 };
static void small_spec(preference_case_spec *s, size_t variant, int streaming, uint64_t seed)
{
    preference_case_spec_default(s);
    s->pairs = 5;
    s->seq = 7;
    s->hidden = 11;
    s->vocab = 37;
    s->threads = 1;
    s->tile_rows = streaming ? STREAMING_ROWS : ROW_BLOCK_ROWS;
    s->tile_vocab = 16;
    s->seed = seed;
    s->layout = seed & 1 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
    s->bias = (int)((seed >> 1) & 1);
    s->options.loss = variants[variant].loss;
    s->options.loss_type = variants[variant].type;
    s->options.dpo_semantics = FH_PREFERENCE_TRL_0_28; /* the variants' dpo */
    if (s->options.loss == FH_PREFERENCE_SIMPO) { /* the SimPO paper's scale */
        s->options.beta = 2.0;
        s->options.simpo_gamma = 1.0;
    }
}

/* Largest differences seen, as fractions of their tolerances (printed with FH_TEST_VERBOSE=1). */
static double worst[4]; /* loss, metrics, per-sequence/token outputs, gradients */

static void print_worst(const char *what)
{
    const char *v = getenv("FH_TEST_VERBOSE");
    if (v && strcmp(v, "1") == 0)
        fprintf(stderr,
                "\n[preference %s] worst fraction of tolerance: loss %.2e metrics %.2e outputs %.2e grads %.2e\n",
                what, worst[0], worst[1], worst[2], worst[3]);
    memset(worst, 0, sizeof worst);
}

static void track(const preference_diff *d)
{
    const double f[4] = {d->loss / d->loss_tolerance, d->metrics / PREFERENCE_METRIC_TOL,
                         fmax(d->sequence_logps, fmax(d->rewards, d->logp)) / PREFERENCE_TOKEN_TOL,
                         fmax(d->dx, d->dweight) / d->grad_tolerance};
    for (int k = 0; k < 4; k++)
        worst[k] = f[k] > worst[k] ? f[k] : worst[k];
}

/* Runs a case; asserts FH_OK and every tolerance of preference_case.c; returns 1 when c holds a run to inspect
 * (the caller frees it then). */
static int run_case(const preference_case_spec *s, const char *label, preference_case *c)
{
    char desc[512];
    describe(s, desc, sizeof desc);
    preference_diff d;
    const fh_status st = preference_case_run(s, c, &d);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, desc, (int)st, fh_status_string(st));
    if (st != FH_OK) {
        preference_case_free(c);
        return 0;
    }
    track(&d);
    TU_CHECK(preference_diff_pass(&d),
             "%s [%s]: loss %.17g vs %.17g (diff %.2e, tol %.2e); metrics %.2e (tol %g; nll %g vs %g); "
             "sequence_logps %.2e rewards %.2e logp %.2e (tol %g); dx %.2e dweight %.2e dbias %.2e (tol %g); %lld "
             "masked dx rows not 0",
             label, desc, c->step.loss, c->ref_loss, d.loss, d.loss_tolerance, d.metrics, PREFERENCE_METRIC_TOL,
             c->step.metrics.nll_loss, c->ref_metrics.nll_loss, d.sequence_logps, d.rewards, d.logp,
             PREFERENCE_TOKEN_TOL, d.dx, d.dweight, d.dbias, d.grad_tolerance, (long long)d.masked_rows_touched);
    return 1;
}

static void check_case(const preference_case_spec *s, const char *label)
{
    preference_case c;
    if (run_case(s, label, &c))
        preference_case_free(&c);
}

/* Every variant x reference mode (dpo: none, sequence, token) x NLL weight (rpo_alpha 0 / 0.5, cpo_alpha 0 / 1;
 * orpo: a second draw) x schedule = 66 problems; label smoothing (0.1, robust 0.2) on half of the sigmoid and
 * robust ones, beta 0.5 on a third of the non-simpo ones, grad_output -0.7 on a fifth, two threads with the default
 * tiles (row blocks) on a few. Tolerances: tests/cases/preference_case.c. */
static void test_reference_matrix(void)
{
    int k = 0;
    for (size_t v = 0; v < TU_COUNT(variants); v++) {
        const fh_preference_loss loss = variants[v].loss;
        const fh_preference_loss_type type = variants[v].type;
        for (int ref = 0; ref < (loss == FH_PREFERENCE_DPO ? 3 : 1); ref++)
            for (int alpha = 0; alpha < 2; alpha++)
                for (int streaming = 0; streaming < 2; streaming++, k++) {
                    preference_case_spec s;
                    small_spec(&s, v, streaming, 100 + (uint64_t)k);
                    s.ref = (preference_ref_mode)ref;
                    if (loss == FH_PREFERENCE_DPO)
                        s.options.rpo_alpha = alpha ? 0.5 : 0.0;
                    else if (loss != FH_PREFERENCE_ORPO)
                        s.options.cpo_alpha = alpha ? 1.0 : 0.0;
                    if ((type == FH_PREFERENCE_SIGMOID || type == FH_PREFERENCE_ROBUST) && (k / 2) % 2)
                        s.options.label_smoothing = type == FH_PREFERENCE_ROBUST ? 0.2 : 0.1;
                    if (loss != FH_PREFERENCE_SIMPO && k % 3 == 1)
                        s.options.beta = 0.5;
                    if (k % 5 == 3)
                        s.grad_output = -0.7f;
                    if (!streaming && k % 16 == 6) {
                        s.threads = 2;
                        s.tile_rows = s.tile_vocab = 0;
                    }
                    check_case(&s, "reference matrix");
                }
    }
    print_worst("reference matrix");
}

/* Both schedules on a larger vocabulary (V = 1031 over tiles of 256 columns) and several row blocks of three
 * pairs: B = 8 pairs of T = 12 (n = 192), tile_rows 72 (blocks of 3, 3 and 2 pairs) or 20 (< 2 T: streaming). */
static void test_reference_larger(void)
{
    for (size_t v = 0; v < TU_COUNT(variants); v++)
        for (int streaming = 0; streaming < 2; streaming++) {
            preference_case_spec s;
            small_spec(&s, v, streaming, 300 + v);
            s.pairs = 8;
            s.seq = 12;
            s.hidden = 29;
            s.vocab = 1031;
            s.tile_vocab = 256;
            s.tile_rows = streaming ? 20 : 72;
            s.ref = variants[v].loss == FH_PREFERENCE_DPO ? (preference_ref_mode)(1 + v % 2) : PREFERENCE_REF_NONE;
            s.options.rpo_alpha = 0.25;
            check_case(&s, "larger");
        }
    print_worst("larger");
}

/* Row blocks vs streaming on the same inputs (every variant, bias on, dpo with per-token reference log-probs).
 *   - fh_preference_forward and the streaming step run the same streaming forward (same tiles, statistics and head
 *     in double): their outputs are bitwise identical.
 *   - The row blocks' forward sees the same fp32 logits but forms each p_j = exp(z_j - max) in fp32 under a
 *     different running maximum, so lse may move by 2^-24 per schedule and a token's log-prob by ~1.2e-7 in
 *     double; the stored fp32 log-probs, sequence log-probs and rewards may then round to neighbouring floats (one
 *     ulp: at most 2^-23 = 1.2e-7 of 1 + |v|). SCHEDULE_OUTPUT_TOL = 3e-7 of max(1, |v|) (loss, metrics) or
 *     1 + |v| (outputs) covers both (observed: 1.0e-7, one ulp of a log-prob near -8).
 *   - Gradients: dZ inherits the 1e-7 relative change of p, and the gradient GEMMs sum in other orders (dweight per
 *     block of 2 pairs vs per tile of 6 rows): sqrt(K) 2^-24 with K <= 70 is 5e-7. SCHEDULE_GRAD_TOL = 2e-6
 *     normwise (observed: 1.2e-7), five times tighter than the reference comparison: a pair split between blocks
 *     or a block hook run on the wrong rows moves a whole pair's gradient and cannot pass. */
#define SCHEDULE_OUTPUT_TOL 3e-7
#define SCHEDULE_GRAD_TOL 2e-6

/* |a - b| / max(1, |b|), NaN equal to NaN and NaN against a number infinite. */
static double rel(double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0.0 : INFINITY;
    return fabs(a - b) / fmax(1.0, fabs(b));
}

/* The largest difference of two calls' outputs: rel() over the loss and the metrics, |a - b| / (1 + |b|) over the
 * per-sequence and per-token outputs. */
static double outputs_diff(const preference_fused_outputs *a, const preference_fused_outputs *b, int64_t pairs,
                           int64_t seq)
{
    const double ma[] = {a->loss, a->metrics.rewards_chosen, a->metrics.rewards_rejected, a->metrics.rewards_accuracies,
                         a->metrics.rewards_margins, a->metrics.logps_chosen, a->metrics.logps_rejected,
                         a->metrics.logits_chosen, a->metrics.logits_rejected, a->metrics.nll_loss,
                         a->metrics.log_odds_ratio, a->metrics.log_odds_chosen};
    const double mb[] = {b->loss, b->metrics.rewards_chosen, b->metrics.rewards_rejected, b->metrics.rewards_accuracies,
                         b->metrics.rewards_margins, b->metrics.logps_chosen, b->metrics.logps_rejected,
                         b->metrics.logits_chosen, b->metrics.logits_rejected, b->metrics.nll_loss,
                         b->metrics.log_odds_ratio, b->metrics.log_odds_chosen};
    double m = 0.0;
    for (size_t k = 0; k < TU_COUNT(ma); k++)
        m = fmax(m, rel(ma[k], mb[k]));
    const struct {
        const float *x, *y;
        int64_t count;
    } arrays[] = {{a->sequence_logps, b->sequence_logps, 2 * pairs},
                  {a->rewards, b->rewards, 2 * pairs},
                  {a->logp, b->logp, 2 * pairs * seq}};
    for (size_t k = 0; k < TU_COUNT(arrays); k++)
        for (int64_t i = 0; i < arrays[k].count; i++)
            m = fmax(m, fabs((double)arrays[k].x[i] - arrays[k].y[i]) / (1.0 + fabs(arrays[k].y[i])));
    return m;
}

/* Normwise relative difference of two runs' gradients (the larger of dx, dweight and dbias). */
static double grads_diff(const preference_case *a, const float *dx, const float *dweight, const float *dbias)
{
    const size_t n = (size_t)(2 * a->spec.pairs * a->spec.seq), h = (size_t)a->spec.hidden, v = (size_t)a->spec.vocab;
    double *x = tu_doubles(dx, n * h), *w = tu_doubles(dweight, h * v), *b = tu_doubles(dbias, v);
    double e = fmax(ce_compare(a->dx, x, n * h).norm_rel, ce_compare(a->dweight, w, h * v).norm_rel);
    if (a->dbias)
        e = fmax(e, ce_compare(a->dbias, b, v).norm_rel);
    free(x), free(w), free(b);
    return e;
}

static void test_schedules_agree(void)
{
    for (size_t v = 0; v < TU_COUNT(variants); v++) {
        preference_case c[2];
        int ok = 1;
        for (int streaming = 0; streaming < 2; streaming++) {
            preference_case_spec s;
            small_spec(&s, v, streaming, 400 + v);
            s.ref = variants[v].loss == FH_PREFERENCE_DPO ? PREFERENCE_REF_TOKEN : PREFERENCE_REF_NONE;
            s.bias = 1;
            ok &= run_case(&s, "schedules", &c[streaming]);
        }
        if (!ok)
            continue;
        const int64_t B = c[0].spec.pairs, T = c[0].spec.seq;
        char desc[512];
        describe(&c[0].spec, desc, sizeof desc);
        const preference_fused_outputs *sf = &c[1].forward, *ss = &c[1].step;
        int same = sf->loss == ss->loss && memcmp(&sf->metrics, &ss->metrics, sizeof sf->metrics) == 0;
        same &= memcmp(sf->sequence_logps, ss->sequence_logps, (size_t)(2 * B) * sizeof(float)) == 0;
        same &= memcmp(sf->rewards, ss->rewards, (size_t)(2 * B) * sizeof(float)) == 0;
        same &= memcmp(sf->logp, ss->logp, (size_t)(2 * B * T) * sizeof(float)) == 0;
        TU_CHECK(same, "[%s]: fh_preference_forward and the streaming step's outputs differ", desc);
        const double eo = outputs_diff(&c[0].step, ss, B, T), eg = grads_diff(&c[0], c[1].dx, c[1].dweight, c[1].dbias);
        TU_CHECK(eo <= SCHEDULE_OUTPUT_TOL && eg <= SCHEDULE_GRAD_TOL,
                 "[%s]: row blocks vs streaming: outputs %.2e (tol %g), gradients %.2e (tol %g)", desc, eo,
                 SCHEDULE_OUTPUT_TOL, eg, SCHEDULE_GRAD_TOL);
        preference_case_free(&c[0]);
        preference_case_free(&c[1]);
    }
}

/* grad_output scales the gradients and nothing else. A power of two g scales every coefficient, dZ element
 * (fp32 or bf16) and GEMM product exactly, with no subnormal in reach at these magnitudes, so g = -0.5 and 4 give
 * exactly g times the g = 1 gradients, in both schedules. (Other values are checked against the reference in the
 * matrix: -0.7.) */
static void test_grad_output_scaling(void)
{
    static const float scales[] = {-0.5f, 4.0f};
    for (size_t v = 0; v < TU_COUNT(variants); v++)
        for (int streaming = 0; streaming < 2; streaming++) {
            preference_case_spec s;
            small_spec(&s, v, streaming, 500 + v);
            s.bias = 1;
            preference_case c;
            if (!run_case(&s, "scaling", &c))
                continue;
            char desc[512];
            describe(&s, desc, sizeof desc);
            const size_t n = (size_t)(2 * s.pairs * s.seq), h = (size_t)s.hidden, vv = (size_t)s.vocab;
            float *dx = tu_alloc(n * h, sizeof(float)), *dw = tu_alloc(h * vv, sizeof(float));
            float *db = tu_alloc(vv, sizeof(float));
            for (size_t k = 0; k < TU_COUNT(scales); k++) {
                const fh_status st = preference_case_step(&c, scales[k], 0.0f, dx, dw, db);
                TU_CHECK(st == FH_OK, "[%s] g = %g: status %d", desc, (double)scales[k], (int)st);
                size_t wrong = 0;
                for (size_t i = 0; i < n * h; i++)
                    wrong += dx[i] != scales[k] * c.dx[i];
                for (size_t i = 0; i < h * vv; i++)
                    wrong += dw[i] != scales[k] * c.dweight[i];
                for (size_t j = 0; j < vv; j++)
                    wrong += db[j] != scales[k] * c.dbias[j];
                TU_CHECK(wrong == 0, "[%s] g = %g: %zu gradient elements are not exactly g times those of g = 1", desc,
                         (double)scales[k], wrong);
            }
            free(dx), free(dw), free(db);
            preference_case_free(&c);
        }
}

/* Gradient beta 1 adds to what the buffers hold: accumulating a second identical call onto the first one's
 * gradients G gives 2 G. Each element is G plus the call's own fp32 sum of per-block (or per-tile) partial
 * results, rounded in another order than G was: a few 2^-24 of the partials' magnitudes, which the mask-weighted
 * partials of these shapes keep within a small multiple of |G| (observed: 1.0e-7). ACCUMULATE_TOL = 1e-6 normwise
 * against 2 G; a beta treated as 0 is off by 50%, a doubled accumulation by 50% too. */
#define ACCUMULATE_TOL 1e-6
static void test_accumulation(void)
{
    for (size_t v = 0; v < TU_COUNT(variants); v++)
        for (int streaming = 0; streaming < 2; streaming++) {
            preference_case_spec s;
            small_spec(&s, v, streaming, 600 + v);
            s.bias = 1;
            s.ref = variants[v].loss == FH_PREFERENCE_DPO ? PREFERENCE_REF_SEQUENCE : PREFERENCE_REF_NONE;
            preference_case c;
            if (!run_case(&s, "accumulation", &c))
                continue;
            char desc[512];
            describe(&s, desc, sizeof desc);
            const size_t n = (size_t)(2 * s.pairs * s.seq), h = (size_t)s.hidden, vv = (size_t)s.vocab;
            float *dx = tu_alloc(n * h, sizeof(float)), *dw = tu_alloc(h * vv, sizeof(float));
            float *db = tu_alloc(vv, sizeof(float));
            memcpy(dx, c.dx, n * h * sizeof(float));
            memcpy(dw, c.dweight, h * vv * sizeof(float));
            memcpy(db, c.dbias, vv * sizeof(float));
            const fh_status st = preference_case_step(&c, s.grad_output, 1.0f, dx, dw, db);
            TU_CHECK(st == FH_OK, "[%s]: status %d", desc, (int)st);
            for (size_t i = 0; i < n * h; i++)
                dx[i] *= 0.5f; /* exact: compare G with half the accumulated sum */
            for (size_t i = 0; i < h * vv; i++)
                dw[i] *= 0.5f;
            for (size_t j = 0; j < vv; j++)
                db[j] *= 0.5f;
            const double e = grads_diff(&c, dx, dw, db);
            TU_CHECK(e <= ACCUMULATE_TOL, "[%s]: beta 1 onto G gives 2 G within %.2e normwise (tol %g)", desc, e,
                     ACCUMULATE_TOL);
            free(dx), free(dw), free(db);
            preference_case_free(&c);
        }
}

/* ================================================================================================
 * A hand-built batch: edge masks against the reference, the metrics' NaN pattern, the API contracts
 * ============================================================================================== */

enum { B = 2, T = 3, S = 2 * B, N = S * T, H = 4, V = 7 };

/* Everything a call writes, in one block so that one memcmp covers it. */
typedef struct outputs {
    double loss;
    fh_preference_metrics metrics;
    float sequence_logps[S], rewards[S], logp[N];
    float dx[N * H], dweight[H * V], dbias[V];
} outputs;

/* Everything a call reads. */
typedef struct inputs {
    float x[N * H], weight[H * V], bias[V];
    int64_t targets[N];
    float mask[N], ref_logps[S], ref_per_token_logps[N], grad_output[1];
} inputs;

typedef struct fixture {
    fh_context *ctx;
    inputs in;
    outputs out;
    fh_linear lin;
    fh_preference_batch batch;
    fh_preference_options options;
    fh_preference_outputs pout;
    fh_linear_grads grads;
    /* what gets passed */
    fh_context *call_ctx;
    const fh_linear *call_lin;
    const fh_preference_batch *call_batch;
    const fh_preference_options *call_options;
    fh_preference_outputs *call_out;
    const float *call_grad_output;
    fh_linear_grads *call_grads;
} fixture;

/* A valid dpo call (TRL v0.28's) that uses every input: bias, sequence reference log-probs, label smoothing 0.1,
 * rpo_alpha 0.5;
 * the last token of each rejected sequence masked, the very last with target -100. Outputs hold the canary. */
static void fixture_init(void *fixture_)
{
    fixture *f = fixture_;
    memset(f, 0, sizeof *f);
    TU_CHECK(fh_context_create(&f->ctx) == FH_OK, "fh_context_create");
    uint64_t rng = 9191;
    tu_fill_uniform(f->in.x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.weight, H * V, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.bias, V, &rng, -0.5, 0.5);
    tu_fill_uniform(f->in.ref_logps, S, &rng, -7.0, -5.0);
    tu_fill_uniform(f->in.ref_per_token_logps, N, &rng, -2.5, -1.5);
    for (int i = 0; i < N; i++) {
        f->in.targets[i] = (int64_t)(ref_uniform(&rng) * V);
        f->in.mask[i] = i >= B * T && i % T == T - 1 ? 0.0f : 1.0f;
    }
    f->in.targets[N - 1] = -100;
    f->in.grad_output[0] = 1.0f;
    fh_linear_init(&f->lin, N, H, V, f->in.x, f->in.weight, FH_LAYOUT_HV, f->in.bias);
    const fh_preference_batch batch = {B, T, f->in.targets, f->in.mask, f->in.ref_logps, NULL, NULL};
    f->batch = batch;
    fh_preference_options_init(&f->options);
    f->options.dpo_semantics = FH_PREFERENCE_TRL_0_28;
    f->options.label_smoothing = 0.1;
    f->options.rpo_alpha = 0.5;
    const fh_preference_outputs po = {&f->out.loss, &f->out.metrics, f->out.sequence_logps, f->out.rewards,
                                      f->out.logp};
    f->pout = po;
    const fh_linear_grads g = {.dx = f->out.dx, .dx_row_stride = H, .dweight = f->out.dweight, .dbias = f->out.dbias};
    f->grads = g;
    tu_fill_canary(&f->out, sizeof f->out);
    f->call_ctx = f->ctx;
    f->call_lin = &f->lin;
    f->call_batch = &f->batch;
    f->call_options = &f->options;
    f->call_out = &f->pout;
    f->call_grad_output = f->in.grad_output;
    f->call_grads = &f->grads;
}

/* A loss other than dpo, without the fixture's reference log-probs (which only dpo takes). */
static void fixture_loss(fixture *f, fh_preference_loss loss, fh_preference_loss_type type)
{
    f->options.loss = loss;
    f->options.loss_type = type;
    if (loss != FH_PREFERENCE_DPO)
        f->batch.ref_logps = f->batch.ref_per_token_logps = NULL;
}

enum { FWD = 1, STEP = 2, BOTH = 3 };

static fh_status call(void *fixture_, int which)
{
    const fixture *f = fixture_;
    if (which == FWD)
        return fh_preference_forward(f->call_ctx, f->call_lin, f->call_batch, f->call_options, f->call_out);
    return fh_preference_forward_backward(f->call_ctx, f->call_lin, f->call_batch, f->call_options,
                                          f->call_grad_output, f->call_out, f->call_grads);
}

static const char *call_name(int which)
{
    return which == FWD ? "fh_preference_forward" : "fh_preference_forward_backward";
}

#define OUT(name, member, calls, kind) CD_OUTPUT(fixture, name, member, calls, kind)
static const cd_output parts[] = {
    OUT("loss", loss, BOTH, CD_F64),
    OUT("metrics", metrics, BOTH, CD_BYTES), /* NaN where TRL logs nothing */
    OUT("sequence_logps", sequence_logps, BOTH, CD_F32),
    OUT("rewards", rewards, BOTH, CD_F32),
    OUT("per_token_logp", logp, BOTH, CD_F32),
    OUT("dx", dx, STEP, CD_F32),
    OUT("dweight", dweight, STEP, CD_F32),
    OUT("dbias", dbias, STEP, CD_F32),
};
#undef OUT
static const cd_api api = {CD_FIXTURE(fixture), .init = fixture_init, .call = call, .call_name = call_name,
                           .all = BOTH, .parts = parts, .part_count = TU_COUNT(parts)};

/* The fixture's call (the single-call step) against the reference on the same inputs, with preference_case's
 * tolerances (tests/cases/preference_case.c): loss, metrics (NaN only against NaN), per-sequence and per-token outputs,
 * gradients normwise. */
static void check_fixture(fixture *f, const char *label)
{
    const fh_status st = call(f, STEP);
    TU_CHECK(st == FH_OK, "%s: status %d (%s)", label, (int)st, fh_status_string(st));
    if (st != FH_OK)
        return;
    double *x = tu_doubles(f->in.x, N * H), *w = tu_doubles(f->in.weight, H * V), *b = tu_doubles(f->in.bias, V);
    double *mask = tu_doubles(f->in.mask, N), *ref = tu_doubles(f->batch.ref_logps, S);
    double *ref_tok = tu_doubles(f->batch.ref_per_token_logps, N);
    const ref_preference_problem p = {B, T, H, V, x, w, b, f->in.targets, mask, ref, ref_tok};
    const ref_preference_options o = preference_ref_options(&f->options);
    double seq[S], rewards[S], logp[N], dx[N * H], dw[H * V], db[V];
    ref_preference_result r = {0};
    r.sequence_logps = seq;
    r.rewards = rewards;
    r.logp = logp;
    int rc = ref_preference_forward(&p, &o, &r);
    rc |= ref_preference_backward(&p, &o, f->in.grad_output[0], dx, dw, db);
    TU_CHECK(rc == 0, "%s: the reference failed (%d)", label, rc);
    const fh_preference_metrics rm = preference_fh_metrics(&r.metrics);
    const double loss = fabs(f->out.loss - r.loss), metrics = preference_metrics_diff(&f->out.metrics, &rm);
    const double per_sequence = fmax(preference_token_diff(f->out.sequence_logps, seq, S),
                                fmax(preference_token_diff(f->out.rewards, rewards, S),
                                     preference_token_diff(f->out.logp, logp, N)));
    const double grads =
        fmax(ce_compare(f->out.dx, dx, N * H).norm_rel,
             fmax(ce_compare(f->out.dweight, dw, H * V).norm_rel, ce_compare(f->out.dbias, db, V).norm_rel));
    TU_CHECK(loss <= PREFERENCE_LOSS_TOL * fmax(1.0, fabs(r.loss)) && metrics <= PREFERENCE_METRIC_TOL &&
                 per_sequence <= PREFERENCE_TOKEN_TOL && grads <= PREFERENCE_GRAD_NORM_REL_TOL,
             "%s: loss %.17g vs %.17g; metrics %.2e (nll %g vs %g, logits %g/%g vs %g/%g); outputs %.2e; "
             "gradients %.2e",
             label, f->out.loss, r.loss, metrics, f->out.metrics.nll_loss, rm.nll_loss, f->out.metrics.logits_chosen,
             f->out.metrics.logits_rejected, rm.logits_chosen, rm.logits_rejected, per_sequence, grads);
    void *a[] = {x, w, b, mask, ref, ref_tok};
    for (size_t k = 0; k < TU_COUNT(a); k++)
        free(a[k]);
}

/* Masks at their edges, each against the reference:
 *   - every token masked: l = 0 for every sequence, NLL 0 (its denominator clamps to 1), both logits means NaN
 *     (the mean of nothing), the loss finite, and every gradient exactly 0 (every coefficient is 0);
 *   - the rejected half masked: logits/rejected NaN, logits/chosen a number; a chosen sequence masked;
 *   - fractional weights 0.25 .. 2 ("any finite value >= 0 weighs the token"), with per-token reference
 *     log-probs, for every loss and for ipo's averages. */
static void test_edge_masks(void)
{
    fixture f;
    fixture_init(&f);
    for (int i = 0; i < N; i++)
        f.in.mask[i] = 0.0f;
    check_fixture(&f, "every token masked");
    TU_CHECK(isfinite(f.out.loss) && isnan(f.out.metrics.logits_chosen) && isnan(f.out.metrics.logits_rejected) &&
                 f.out.metrics.nll_loss == 0.0,
             "every token masked: loss %g, logits %g %g, nll %g", f.out.loss, f.out.metrics.logits_chosen,
             f.out.metrics.logits_rejected, f.out.metrics.nll_loss);
    TU_CHECK(tu_all_equal_f(f.out.dx, N * H, 0.0f) && tu_all_equal_f(f.out.dweight, H * V, 0.0f) &&
                 tu_all_equal_f(f.out.dbias, V, 0.0f),
             "every token masked: a gradient is not exactly 0");
    fh_context_destroy(f.ctx);

    fixture_init(&f);
    for (int i = B * T; i < N; i++)
        f.in.mask[i] = 0.0f;
    check_fixture(&f, "rejected half masked");
    TU_CHECK(isnan(f.out.metrics.logits_rejected) && !isnan(f.out.metrics.logits_chosen),
             "rejected half masked: logits %g %g", f.out.metrics.logits_chosen, f.out.metrics.logits_rejected);
    for (int t = 0; t < T; t++)
        f.in.mask[t] = 0.0f;
    f.in.mask[B * T] = 1.0f;
    check_fixture(&f, "a chosen sequence masked");
    fh_context_destroy(f.ctx);

    static const float weights[N] = {0.25f, 2.0f, 1.0f, 0.5f, 0.0f, 1.5f, 1.0f, 0.75f, 0.0f, 2.0f, 0.5f, 0.0f};
    for (size_t v = 0; v < TU_COUNT(variants); v++) {
        fixture_init(&f);
        memcpy(f.in.mask, weights, sizeof weights);
        f.batch.ref_logps = NULL;
        f.batch.ref_per_token_logps = f.in.ref_per_token_logps;
        fixture_loss(&f, variants[v].loss, variants[v].type);
        char label[64];
        snprintf(label, sizeof label, "fractional mask, variant %zu", v);
        check_fixture(&f, label);
        fh_context_destroy(f.ctx);
    }
}

/* An empty sequence (every token masked), chosen or rejected, for every loss: ORPO's odds of a mean log-prob over no
 * token are undefined (TRL divides 0 by 0 there), so ORPO refuses the batch with FH_ERR_INVALID_MASK naming the
 * sequence and writes nothing; every other loss gives a finite loss and finite gradients that match the reference
 * (the empty sequence's log-prob is 0: a sum over no token, or that sum over its count clamped to 1). */
static void test_empty_sequences(void)
{
    for (size_t v = 0; v < TU_COUNT(variants); v++)
        for (int half = 0; half < 2; half++) {
            fixture f;
            fixture_init(&f);
            fixture_loss(&f, variants[v].loss, variants[v].type);
            const int sequence = half * B + 1; /* the second pair's chosen or rejected sequence */
            for (int t = 0; t < T; t++)
                f.in.mask[sequence * T + t] = 0.0f;
            char label[96];
            snprintf(label, sizeof label, "variant %zu, an empty %s sequence", v, half ? "rejected" : "chosen");
            if (variants[v].loss == FH_PREFERENCE_ORPO) {
                outputs before;
                memcpy(&before, &f.out, sizeof before);
                for (int which = FWD; which <= STEP; which++) {
                    const fh_status st = call(&f, which);
                    const char *msg = "";
                    fh_context_message(f.ctx, &msg);
                    char named[32];
                    snprintf(named, sizeof named, "sequence %d ", sequence);
                    TU_CHECK(st == FH_ERR_INVALID_MASK && strstr(msg, named) && strstr(msg, "no unmasked"),
                             "%s, %s: status %d, message '%s'", label, call_name(which), (int)st, msg);
                    TU_CHECK(memcmp(&before, &f.out, sizeof before) == 0, "%s, %s: outputs written", label,
                             call_name(which));
                }
            } else {
                check_fixture(&f, label);
                TU_CHECK(isfinite(f.out.loss) && tu_all_finite_f(f.out.dx, N * H) &&
                             tu_all_finite_f(f.out.dweight, H * V) && tu_all_finite_f(f.out.dbias, V),
                         "%s: loss %g, or a gradient not finite", label, f.out.loss);
            }
            fh_context_destroy(f.ctx);
        }
}

/* The metrics TRL does not log are NaN, as fusedhead.h states: nll_loss for dpo without rpo_alpha (cpo and simpo
 * log 0 with cpo_alpha 0, as TRL's CPOTrainer; orpo always has the term), log_odds_ratio and log_odds_chosen
 * except for orpo; every other metric is a number (both halves have tokens here). The values against the
 * reference. */
static void test_metric_nan_pattern(void)
{
    for (size_t v = 0; v < TU_COUNT(variants); v++)
        for (int alpha = 0; alpha < 2; alpha++) {
            fixture f;
            fixture_init(&f);
            fixture_loss(&f, variants[v].loss, variants[v].type);
            f.options.rpo_alpha = f.options.cpo_alpha = alpha ? 0.5 : 0.0;
            const int orpo = variants[v].loss == FH_PREFERENCE_ORPO;
            char label[96];
            snprintf(label, sizeof label, "NaN pattern, variant %zu, alpha %g", v, alpha ? 0.5 : 0.0);
            check_fixture(&f, label);
            const fh_preference_metrics *m = &f.out.metrics;
            const double numbers[] = {m->rewards_chosen, m->rewards_rejected, m->rewards_accuracies,
                                      m->rewards_margins, m->logps_chosen, m->logps_rejected, m->logits_chosen,
                                      m->logits_rejected};
            int finite = 1;
            for (size_t k = 0; k < TU_COUNT(numbers); k++)
                finite &= isfinite(numbers[k]) != 0;
            TU_CHECK(finite, "%s: a logged metric is not a number", label);
            const int dpo = variants[v].loss == FH_PREFERENCE_DPO;
            TU_CHECK(isnan(m->nll_loss) == (!alpha && dpo) && (alpha || dpo || orpo || m->nll_loss == 0.0),
                     "%s: nll_loss %g (NaN for dpo without rpo_alpha, 0 for cpo/simpo without cpo_alpha)", label,
                     m->nll_loss);
            TU_CHECK(isnan(m->log_odds_ratio) == !orpo && isnan(m->log_odds_chosen) == !orpo,
                     "%s: log_odds_ratio %g log_odds_chosen %g (orpo only)", label, m->log_odds_ratio,
                     m->log_odds_chosen);
            fh_context_destroy(f.ctx);
        }
}

/* ---- the invalid arguments ---- */
#define MUTATION(fn, body) \
    static void fn(void *fixture_) { fixture *f = fixture_; body; }
MUTATION(null_ctx, f->call_ctx = NULL)
MUTATION(null_lin, f->call_lin = NULL)
MUTATION(null_x, f->lin.x = NULL)
MUTATION(null_batch, f->call_batch = NULL)
MUTATION(null_targets, f->batch.targets = NULL)
MUTATION(null_mask, f->batch.mask = NULL)
MUTATION(null_options, f->call_options = NULL)
MUTATION(null_outputs, f->call_out = NULL)
MUTATION(null_grad_output, f->call_grad_output = NULL)
MUTATION(null_grads, f->call_grads = NULL)
MUTATION(pairs_too_large, f->batch.pairs = B + 1)
MUTATION(seq_too_small, f->batch.seq = T - 1)
MUTATION(pairs_counts_sequences, f->batch.pairs = S) /* 2 x 2B x T = 2n */
MUTATION(seq_counts_both_halves, f->batch.seq = 2 * T) /* 2 x B x 2T = 2n */
MUTATION(pairs_zero, f->batch.pairs = 0)
MUTATION(seq_negative, f->batch.seq = -T)
MUTATION(pairs_seq_overflow, (f->batch.pairs = INT64_MAX / 4, f->batch.seq = 3))
MUTATION(n_zero, f->lin.n = 0)
MUTATION(x_stride_short, f->lin.x_row_stride = H - 1)
MUTATION(mask_negative, f->in.mask[2] = -1.0f)
MUTATION(mask_nan, f->in.mask[0] = NAN)
MUTATION(mask_inf, f->in.mask[N - 1] = INFINITY) /* at a masked position: the value itself is checked */
MUTATION(mask_tiny_negative, f->in.mask[3] = -FLT_TRUE_MIN)
MUTATION(target_equals_vocab, f->in.targets[1] = V)
MUTATION(target_minus_one, f->in.targets[B * T] = -1) /* in the rejected half */
MUTATION(masked_target_unmasked, f->in.mask[N - 1] = 1.0f) /* the -100 at the masked position becomes live */
MUTATION(loss_four, f->options.loss = (fh_preference_loss)4)
MUTATION(loss_negative, f->options.loss = (fh_preference_loss)-1)
MUTATION(loss_type_four, f->options.loss_type = (fh_preference_loss_type)4)
MUTATION(loss_type_negative, f->options.loss_type = (fh_preference_loss_type)-1)
MUTATION(cpo_robust, fixture_loss(f, FH_PREFERENCE_CPO, FH_PREFERENCE_ROBUST))
MUTATION(simpo_hinge, fixture_loss(f, FH_PREFERENCE_SIMPO, FH_PREFERENCE_HINGE))
MUTATION(simpo_ipo, fixture_loss(f, FH_PREFERENCE_SIMPO, FH_PREFERENCE_IPO))
MUTATION(orpo_hinge, fixture_loss(f, FH_PREFERENCE_ORPO, FH_PREFERENCE_HINGE))
MUTATION(orpo_robust, fixture_loss(f, FH_PREFERENCE_ORPO, FH_PREFERENCE_ROBUST))
MUTATION(beta_zero, f->options.beta = 0.0)
MUTATION(beta_negative, f->options.beta = -0.1)
MUTATION(beta_nan, f->options.beta = NAN)
MUTATION(beta_inf, f->options.beta = INFINITY)
MUTATION(ls_negative, f->options.label_smoothing = -0.01)
MUTATION(ls_above_half, f->options.label_smoothing = 0.51)
MUTATION(ls_nan, f->options.label_smoothing = NAN)
MUTATION(ls_half_robust, (f->options.loss_type = FH_PREFERENCE_ROBUST, f->options.label_smoothing = 0.5))
MUTATION(simpo_gamma_nan, (fixture_loss(f, FH_PREFERENCE_SIMPO, FH_PREFERENCE_SIGMOID), f->options.simpo_gamma = NAN))
MUTATION(simpo_gamma_inf,
         (fixture_loss(f, FH_PREFERENCE_SIMPO, FH_PREFERENCE_SIGMOID), f->options.simpo_gamma = INFINITY))
MUTATION(rpo_alpha_nan, f->options.rpo_alpha = NAN)
MUTATION(rpo_alpha_inf, f->options.rpo_alpha = -INFINITY)
MUTATION(cpo_alpha_nan, (fixture_loss(f, FH_PREFERENCE_CPO, FH_PREFERENCE_SIGMOID), f->options.cpo_alpha = NAN))
MUTATION(both_references, f->batch.ref_per_token_logps = f->in.ref_per_token_logps)
MUTATION(reference_for_cpo, f->options.loss = FH_PREFERENCE_CPO)
MUTATION(token_reference_for_orpo,
         (f->batch.ref_logps = NULL, f->batch.ref_per_token_logps = f->in.ref_per_token_logps,
          f->options.loss = FH_PREFERENCE_ORPO))
MUTATION(reference_for_simpo, f->options.loss = FH_PREFERENCE_SIMPO)
MUTATION(grad_output_nan, f->in.grad_output[0] = NAN)
MUTATION(grad_output_inf, f->in.grad_output[0] = -INFINITY)
MUTATION(dx_beta_half, f->grads.dx_beta = 0.5f)
MUTATION(dweight_beta_nan, f->grads.dweight_beta = NAN)
MUTATION(dx_stride_short, f->grads.dx_row_stride = H - 1)
MUTATION(dbias_without_bias, f->lin.bias = NULL)
MUTATION(budget_one, fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, 1))
MUTATION(nonfinite_x_checked, (fh_context_set(f->ctx, FH_PARAM_CHECK_FINITE, 1), f->in.x[5] = NAN))
/* Outputs over inputs (README, Conventions: FH_ERR_OVERLAPPING_BUFFERS). */
MUTATION(logp_over_mask, f->pout.per_token_logp = f->in.mask)
MUTATION(dweight_over_ref_logps, f->grads.dweight = f->in.ref_logps)

/* dpo at TRL's current semantics: the fixture's call without rpo_alpha, and its own options. */
static void fixture_current(fixture *f)
{
    f->options.dpo_semantics = FH_PREFERENCE_TRL_CURRENT;
    f->options.rpo_alpha = 0.0;
}
MUTATION(semantics_two, f->options.dpo_semantics = (fh_preference_dpo_semantics)2)
MUTATION(rpo_alpha_current, (fixture_current(f), f->options.rpo_alpha = 0.5))
MUTATION(list_too_long, (fixture_current(f), f->options.loss_type_count = FH_PREFERENCE_MAX_LOSS_TYPES + 1))
MUTATION(list_negative, (fixture_current(f), f->options.loss_type_count = -1))
MUTATION(list_at_0_28, (f->options.loss_type_count = 1, f->options.loss_weights[0] = 1.0))
MUTATION(list_for_cpo, (fixture_loss(f, FH_PREFERENCE_CPO, FH_PREFERENCE_SIGMOID), f->options.loss_type_count = 1,
                        f->options.loss_weights[0] = 1.0))
MUTATION(list_type_fifteen, (fixture_current(f), f->options.loss_type_count = 2, f->options.loss_weights[0] = 1.0,
                             f->options.loss_weights[1] = 1.0, f->options.loss_types[1] = (fh_preference_loss_type)15))
MUTATION(list_weight_nan, (fixture_current(f), f->options.loss_type_count = 2, f->options.loss_weights[0] = 1.0,
                           f->options.loss_types[1] = FH_PREFERENCE_SFT, f->options.loss_weights[1] = NAN))
MUTATION(exo_pair_at_0_28, f->options.loss_type = FH_PREFERENCE_EXO_PAIR)
MUTATION(exo_pair_unsmoothed,
         (fixture_current(f), f->options.loss_type = FH_PREFERENCE_EXO_PAIR, f->options.label_smoothing = 0.0))
MUTATION(robust_listed_half, (fixture_current(f), f->options.loss_type_count = 2, f->options.loss_weights[0] = 1.0,
                              f->options.loss_types[1] = FH_PREFERENCE_ROBUST, f->options.loss_weights[1] = 1.0,
                              f->options.label_smoothing = 0.5))
MUTATION(discopop_tau_zero,
         (fixture_current(f), f->options.loss_type = FH_PREFERENCE_DISCOPOP, f->options.discopop_tau = 0.0))
MUTATION(use_weighting, (fixture_current(f), f->options.use_weighting = 1))
MUTATION(use_weighting_at_0_28, f->options.use_weighting = 1)

#define OPTION FH_ERR_INVALID_PREFERENCE_OPTION
static const cd_case bad_cases[] = {
    {"dpo_semantics 2", semantics_two, BOTH, OPTION, "dpo_semantics"},
    {"rpo_alpha at TRL's current semantics", rpo_alpha_current, BOTH, OPTION, "sft"},
    {"loss_type_count 17", list_too_long, BOTH, OPTION, "loss_type_count"},
    {"loss_type_count -1", list_negative, BOTH, OPTION, "loss_type_count"},
    {"a loss_type list at v0.28", list_at_0_28, BOTH, OPTION, "loss_type_count"},
    {"a loss_type list for cpo", list_for_cpo, BOTH, OPTION, "loss_type_count"},
    {"loss_types[1] 15", list_type_fifteen, BOTH, OPTION, "loss_types"},
    {"loss_weights[1] NaN", list_weight_nan, BOTH, OPTION, "loss_weights[1]"},
    {"exo_pair at v0.28", exo_pair_at_0_28, BOTH, OPTION, "exo_pair"},
    {"exo_pair without label smoothing", exo_pair_unsmoothed, BOTH, OPTION, "label_smoothing"},
    {"robust listed, label_smoothing 0.5", robust_listed_half, BOTH, OPTION, "label_smoothing"},
    {"discopop_tau 0", discopop_tau_zero, BOTH, OPTION, "discopop_tau"},
    {"use_weighting (WPO)", use_weighting, BOTH, OPTION, "use_weighting"},
    {"use_weighting (WPO) at v0.28", use_weighting_at_0_28, BOTH, OPTION, "use_weighting"},
    {"NULL context", null_ctx, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, BOTH, FH_ERR_NULL_POINTER, "lin"},
    {"NULL x", null_x, BOTH, FH_ERR_NULL_POINTER, "x"},
    {"NULL batch", null_batch, BOTH, FH_ERR_NULL_POINTER, "fh_preference_batch"},
    {"NULL targets", null_targets, BOTH, FH_ERR_NULL_POINTER, "targets"},
    {"NULL mask", null_mask, BOTH, FH_ERR_NULL_POINTER, "mask"},
    {"NULL options", null_options, BOTH, FH_ERR_NULL_POINTER, "options"},
    {"NULL outputs", null_outputs, BOTH, FH_ERR_NULL_POINTER, "outputs"},
    {"NULL grad_output", null_grad_output, STEP, FH_ERR_NULL_POINTER, "grad_output"},
    {"NULL grads", null_grads, STEP, FH_ERR_NULL_POINTER, "fh_linear_grads"},
    {"2 pairs seq > n", pairs_too_large, BOTH, FH_ERR_INVALID_SIZE, "pairs"},
    {"2 pairs seq < n", seq_too_small, BOTH, FH_ERR_INVALID_SIZE, "seq"},
    {"pairs = number of sequences", pairs_counts_sequences, BOTH, FH_ERR_INVALID_SIZE, "pairs"},
    {"seq = 2T", seq_counts_both_halves, BOTH, FH_ERR_INVALID_SIZE, "seq"},
    {"pairs = 0", pairs_zero, BOTH, FH_ERR_INVALID_SIZE, "pairs"},
    {"seq < 0", seq_negative, BOTH, FH_ERR_INVALID_SIZE, "seq"},
    {"2 pairs seq overflows", pairs_seq_overflow, BOTH, FH_ERR_INVALID_SIZE, "pairs"},
    {"n = 0", n_zero, BOTH, FH_ERR_INVALID_SIZE, "n"},
    {"x_row_stride < hidden", x_stride_short, BOTH, FH_ERR_INVALID_STRIDE, "stride"},
    {"mask -1", mask_negative, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"mask NaN", mask_nan, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"mask inf (masked position)", mask_inf, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"mask -denormal", mask_tiny_negative, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"target = V unmasked", target_equals_vocab, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"target = -1 unmasked (rejected half)", target_minus_one, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"masked -100 target unmasked", masked_target_unmasked, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"loss 4", loss_four, BOTH, OPTION, "loss"},
    {"loss -1", loss_negative, BOTH, OPTION, "loss"},
    {"loss_type 4", loss_type_four, BOTH, OPTION, "loss_type"},
    {"loss_type -1", loss_type_negative, BOTH, OPTION, "loss_type"},
    {"cpo robust", cpo_robust, BOTH, OPTION, "loss_type"},
    {"simpo hinge", simpo_hinge, BOTH, OPTION, "loss_type"},
    {"simpo ipo", simpo_ipo, BOTH, OPTION, "loss_type"},
    {"orpo hinge", orpo_hinge, BOTH, OPTION, "loss_type"},
    {"orpo robust", orpo_robust, BOTH, OPTION, "loss_type"},
    {"beta 0", beta_zero, BOTH, OPTION, "beta"},
    {"beta -0.1", beta_negative, BOTH, OPTION, "beta"},
    {"beta NaN", beta_nan, BOTH, OPTION, "beta"},
    {"beta inf", beta_inf, BOTH, OPTION, "beta"},
    {"label_smoothing -0.01", ls_negative, BOTH, OPTION, "label_smoothing"},
    {"label_smoothing 0.51", ls_above_half, BOTH, OPTION, "label_smoothing"},
    {"label_smoothing NaN", ls_nan, BOTH, OPTION, "label_smoothing"},
    {"label_smoothing 0.5 with robust", ls_half_robust, BOTH, OPTION, "label_smoothing"},
    {"simpo_gamma NaN", simpo_gamma_nan, BOTH, OPTION, "simpo_gamma"},
    {"simpo_gamma inf", simpo_gamma_inf, BOTH, OPTION, "simpo_gamma"},
    {"rpo_alpha NaN", rpo_alpha_nan, BOTH, OPTION, "rpo_alpha"},
    {"rpo_alpha -inf", rpo_alpha_inf, BOTH, OPTION, "rpo_alpha"},
    {"cpo_alpha NaN", cpo_alpha_nan, BOTH, OPTION, "cpo_alpha"},
    {"ref_logps and ref_per_token_logps", both_references, BOTH, OPTION, "ref_logps"},
    {"ref_logps for cpo", reference_for_cpo, BOTH, OPTION, "reference"},
    {"ref_per_token_logps for orpo", token_reference_for_orpo, BOTH, OPTION, "reference"},
    {"ref_logps for simpo", reference_for_simpo, BOTH, OPTION, "reference"},
    {"grad_output NaN", grad_output_nan, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output -inf", grad_output_inf, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"dx_beta 0.5", dx_beta_half, STEP, FH_ERR_INVALID_BETA, "dx_beta"},
    {"dweight_beta NaN", dweight_beta_nan, STEP, FH_ERR_INVALID_BETA, "dweight_beta"},
    {"dx_row_stride < hidden", dx_stride_short, STEP, FH_ERR_INVALID_STRIDE, "dx"},
    {"dbias requested without bias", dbias_without_bias, STEP, FH_ERR_NULL_POINTER, "bias"},
    {"memory budget 1 byte", budget_one, BOTH, FH_ERR_BUDGET_TOO_SMALL, "budget"},
    {"NaN in x with FH_PARAM_CHECK_FINITE", nonfinite_x_checked, BOTH, FH_ERR_NONFINITE_INPUT, NULL},
    {"per_token_logp over the mask", logp_over_mask, BOTH, FH_ERR_OVERLAPPING_BUFFERS, "per_token_logp"},
    {"dweight over ref_logps", dweight_over_ref_logps, STEP, FH_ERR_OVERLAPPING_BUFFERS, "dweight"},
};
#undef OPTION

/* Each invalid argument returns its own documented status from each entry point that takes it, leaves every
 * output bit-identical (the canary) and every input untouched, and the context message names the problem. */
static void test_bad_arguments(void)
{
    cd_run_bad_arguments(&api, bad_cases, TU_COUNT(bad_cases));
}

/* After a success, an error sets a message and the next success clears it; the boundary values label_smoothing
 * 0.5 (sigmoid) and 0 are accepted. */
MUTATION(beta_back_ls_half, (f->options.beta = 0.1, f->options.label_smoothing = 0.5))
MUTATION(ls_zero, f->options.label_smoothing = 0.0)
static const cd_case error_then_success[] = {
    {"beta 0", beta_zero, BOTH, FH_ERR_INVALID_PREFERENCE_OPTION, "beta"},
    {"beta 0.1, label_smoothing 0.5 (sigmoid)", beta_back_ls_half, BOTH, FH_OK, NULL},
    {"label_smoothing 0", ls_zero, BOTH, FH_OK, NULL},
};

static void test_valid_calls(void)
{
    cd_run_valid_calls(&api, error_then_success, TU_COUNT(error_then_success), NULL);
}

/* Targets outside [0, V) under the mask (-1, V, INT64_MIN, INT64_MAX, -100) are accepted, in either half;
 * per_token_logp is 0 there. */
static void test_masked_out_of_range_targets(void)
{
    static const int64_t targets[] = {-1, V, INT64_MIN, INT64_MAX, -100};
    for (size_t k = 0; k < TU_COUNT(targets); k++)
        for (int which = FWD; which <= STEP; which++) {
            fixture f;
            fixture_init(&f);
            f.in.mask[1] = 0.0f; /* a chosen position too */
            f.in.targets[1] = f.in.targets[N - 1] = targets[k];
            const fh_status st = call(&f, which);
            TU_CHECK(st == FH_OK, "%s with masked target %lld: status %d", call_name(which), (long long)targets[k],
                     (int)st);
            TU_CHECK(f.out.logp[1] == 0.0f && f.out.logp[N - 1] == 0.0f, "masked target %lld: per_token_logp %g %g",
                     (long long)targets[k], (double)f.out.logp[1], (double)f.out.logp[N - 1]);
            fh_context_destroy(f.ctx);
        }
}

/* A caller workspace of exactly fh_preference_workspace_size bytes works for both calls; one byte less is refused
 * (contract_driver.h). Budgets: the default (row blocks) and 2 KiB. The query's own refusals are pure. */
static const char *const budgets[] = {"default budget", "budget 2048"};
static void set_budget(void *fixture_, size_t k)
{
    fixture *f = fixture_;
    TU_CHECK(fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, k ? 2048 : 0) == FH_OK, "set budget");
}

static fh_status size_query(void *fixture_, int which, size_t *bytes)
{
    const fixture *f = fixture_;
    (void)which; /* one query for both calls */
    return fh_preference_workspace_size(f->call_ctx, f->call_lin, bytes);
}

static const cd_case query_refusals[] = {
    {"NULL context", null_ctx, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"n = 0", n_zero, BOTH, FH_ERR_INVALID_SIZE, NULL},
    {"memory budget 1 byte", budget_one, BOTH, FH_ERR_BUDGET_TOO_SMALL, NULL},
};

static void test_workspace(void)
{
    static const size_t offsets[] = {0, 1, 8};
    static const cd_workspace w = {offsets, TU_COUNT(offsets), budgets, TU_COUNT(budgets), set_budget, size_query,
                                   NULL, query_refusals, TU_COUNT(query_refusals)};
    cd_run_workspace(&api, &w);
}

/* Optional outputs: every one NULL; then only the loss and dweight. */
MUTATION(no_outputs, (memset(&f->pout, 0, sizeof f->pout), memset(&f->grads, 0, sizeof f->grads)))
MUTATION(loss_and_dweight, (f->pout.loss = &f->out.loss, f->grads.dweight = f->out.dweight))
static const cd_optional optional_steps[] = {
    {"every output and gradient NULL", no_outputs, BOTH, {NULL}},
    {"the loss and dweight only", loss_and_dweight, BOTH, {"loss", "dweight"}},
};

/* fh_preference_options_init's documented defaults (TRL's), NULL; and "any may be NULL" for the outputs, "a NULL
 * pointer skips that gradient". */
static void test_options_init_and_optional_outputs(void)
{
    fh_preference_options o;
    memset(&o, 0x5A, sizeof o);
    TU_CHECK(fh_preference_options_init(&o) == FH_OK, "fh_preference_options_init");
    TU_CHECK(o.loss == FH_PREFERENCE_DPO && o.loss_type == FH_PREFERENCE_SIGMOID && o.beta == 0.1 &&
                 o.label_smoothing == 0.0 && o.simpo_gamma == 0.5 && o.rpo_alpha == 0.0 && o.cpo_alpha == 1.0 &&
                 o.dpo_semantics == FH_PREFERENCE_TRL_CURRENT && o.loss_type_count == 0 && o.discopop_tau == 0.05 &&
                 o.use_weighting == 0,
             "documented defaults");
    TU_CHECK(fh_preference_options_init(NULL) == FH_ERR_NULL_POINTER, "fh_preference_options_init(NULL)");

    cd_run_optional_outputs(&api, optional_steps, TU_COUNT(optional_steps));
}

/* ---- dpo at TRL's current semantics ---- */

/* Each of TRL's 15 current loss types alone and four weighted lists (MPO's sigmoid + bco_pair + sft; both aot
 * kinds with nca_pair; ipo + sigmoid_norm + discopop + apo_down with a negative weight; every pair-local type at
 * once), x both schedules (aot streams in either), reference per sequence, per token or none in turn, label
 * smoothing 0.1 (robust, exo_pair, aot read it; sigmoid no longer does), beta 0.5 on every third: 38 problems.
 * Tolerances: tests/cases/preference_case.c. */
static void test_current_matrix(void)
{
    static const struct {
        int count;
        fh_preference_loss_type types[12];
        double weights[12];
    } lists[] = {
        {3, {FH_PREFERENCE_SIGMOID, FH_PREFERENCE_BCO_PAIR, FH_PREFERENCE_SFT}, {0.8, 0.2, 1.0}},
        {3, {FH_PREFERENCE_AOT, FH_PREFERENCE_AOT_UNPAIRED, FH_PREFERENCE_NCA_PAIR}, {1.0, 0.5, 0.25}},
        {4, {FH_PREFERENCE_IPO, FH_PREFERENCE_SIGMOID_NORM, FH_PREFERENCE_DISCOPOP, FH_PREFERENCE_APO_DOWN},
         {0.1, 2.0, 1.0, -0.5}},
        {12,
         {FH_PREFERENCE_SIGMOID, FH_PREFERENCE_HINGE, FH_PREFERENCE_IPO, FH_PREFERENCE_ROBUST, FH_PREFERENCE_EXO_PAIR,
          FH_PREFERENCE_NCA_PAIR, FH_PREFERENCE_BCO_PAIR, FH_PREFERENCE_SPPO_HARD, FH_PREFERENCE_APO_ZERO,
          FH_PREFERENCE_APO_DOWN, FH_PREFERENCE_DISCOPOP, FH_PREFERENCE_SIGMOID_NORM},
         {1.0, 0.5, 0.01, 1.0, 1.0, 1.0, 1.0, 0.01, 1.0, 1.0, 1.0, 1.0}},
    };
    int k = 0;
    for (int entry = 0; entry < 15 + (int)TU_COUNT(lists); entry++)
        for (int streaming = 0; streaming < 2; streaming++, k++) {
            preference_case_spec s;
            small_spec(&s, 0, streaming, 700 + (uint64_t)k);
            s.options.dpo_semantics = FH_PREFERENCE_TRL_CURRENT;
            s.options.label_smoothing = 0.1;
            s.ref = (preference_ref_mode)((k / 2) % 3);
            if (k % 3 == 1)
                s.options.beta = 0.5;
            if (entry < 15)
                s.options.loss_type = (fh_preference_loss_type)entry;
            else {
                const int l = entry - 15;
                s.options.loss_type_count = lists[l].count;
                for (int j = 0; j < lists[l].count; j++) {
                    s.options.loss_types[j] = lists[l].types[j];
                    s.options.loss_weights[j] = lists[l].weights[j];
                }
            }
            check_case(&s, "current matrix");
        }
    print_worst("current matrix");
}

/* The current DPOTrainer's means over no token are 0 (logits, entropy, token accuracy), not NaN; nll_loss is not
 * logged; with some tokens the entropy and accuracy match the reference's (check_fixture), and a fully masked batch
 * has exactly zero gradients. */
static void test_current_metrics(void)
{
    fixture f;
    fixture_init(&f);
    fixture_current(&f);
    f.options.loss_type_count = 2;
    f.options.loss_types[0] = FH_PREFERENCE_SIGMOID, f.options.loss_weights[0] = 1.0;
    f.options.loss_types[1] = FH_PREFERENCE_SFT, f.options.loss_weights[1] = 0.5;
    check_fixture(&f, "current: sigmoid + sft");
    const fh_preference_metrics *m = &f.out.metrics;
    TU_CHECK(isnan(m->nll_loss) && m->entropy > 0.0 && m->mean_token_accuracy >= 0.0 && m->mean_token_accuracy <= 1.0,
             "current: nll_loss %g (NaN), entropy %g, accuracy %g", m->nll_loss, m->entropy, m->mean_token_accuracy);
    for (int i = 0; i < N; i++)
        f.in.mask[i] = 0.0f;
    check_fixture(&f, "current: every token masked");
    TU_CHECK(m->logits_chosen == 0.0 && m->logits_rejected == 0.0 && m->entropy == 0.0 &&
                 m->mean_token_accuracy == 0.0 && isfinite(f.out.loss),
             "current, every token masked: logits %g %g, entropy %g, accuracy %g (all 0), loss %g",
             m->logits_chosen, m->logits_rejected, m->entropy, m->mean_token_accuracy, f.out.loss);
    TU_CHECK(tu_all_equal_f(f.out.dx, N * H, 0.0f) && tu_all_equal_f(f.out.dweight, H * V, 0.0f),
             "current, every token masked: a gradient is not exactly 0");
    fh_context_destroy(f.ctx);
    /* Fractional mask weights weigh the entropy, accuracy and logits means as they weigh the log-probs. */
    static const float weights[N] = {0.25f, 2.0f, 1.0f, 0.5f, 0.0f, 1.5f, 1.0f, 0.75f, 0.0f, 2.0f, 0.5f, 0.0f};
    fixture_init(&f);
    fixture_current(&f);
    memcpy(f.in.mask, weights, sizeof weights);
    f.options.loss_type = FH_PREFERENCE_SIGMOID_NORM;
    check_fixture(&f, "current: fractional weights");
    fh_context_destroy(f.ctx);
}

/* aot and aot_unpaired sort every pair's values (a heap sort since issue 41; its O(B log B) is a speed property,
 * timed by no test). Here its order: 4096 pairs of one token each (H = 1, V = 2, w = (1, -1): z = (x, -x)), x and the
 * reference log-probs from a few levels, so most keys tie and the ties must sort by pair index as TRL's stable
 * torch.sort does (ref/ref_preference.c ranks them so). Ties leave the loss unchanged but route each sorted
 * position's gradient to a different pair, so dx tells a wrong tie order apart. Tolerance: 1e-6 relative to the
 * largest reference value; every fused value is one fp32 log-softmax of two logits (relative error ~1e-7) through
 * double sums. */
static void test_aot_sort_order(void)
{
    enum { PAIRS = 4096, ROWS = 2 * PAIRS };
    float *x = tu_alloc(ROWS, sizeof(float)), *mask = tu_alloc(ROWS, sizeof(float)), *ref = tu_alloc(ROWS, sizeof(float));
    float *dx = tu_alloc(ROWS, sizeof(float));
    double *xd = tu_alloc(ROWS, sizeof(double)), *maskd = tu_alloc(ROWS, sizeof(double));
    double *refd = tu_alloc(ROWS, sizeof(double)), *dx_ref = tu_alloc(ROWS, sizeof(double));
    int64_t *targets = tu_alloc(ROWS, sizeof(int64_t));
    const float w[2] = {1.0f, -1.0f};
    const double wd[2] = {1.0, -1.0};
    for (int64_t i = 0; i < ROWS; i++) {
        x[i] = 0.25f * (float)(i * 7 % 5) - 0.5f;
        mask[i] = 1.0f;
        ref[i] = -0.5f * (float)(i * 13 % 3);
        targets[i] = i % 2;
        xd[i] = x[i];
        maskd[i] = 1.0;
        refd[i] = ref[i];
    }
    fh_linear lin;
    fh_linear_init(&lin, ROWS, 1, 2, x, w, FH_LAYOUT_HV, NULL);
    const fh_preference_batch batch = {PAIRS, 1, targets, mask, ref, NULL, NULL};
    const ref_preference_problem problem = {PAIRS, 1, 1, 2, xd, wd, NULL, targets, maskd, refd, NULL};
    for (int unpaired = 0; unpaired <= 1; unpaired++) {
        const char *name = unpaired ? "aot_unpaired" : "aot";
        fh_preference_options o;
        fh_preference_options_init(&o);
        o.loss_type = unpaired ? FH_PREFERENCE_AOT_UNPAIRED : FH_PREFERENCE_AOT;
        const ref_preference_options ro = preference_ref_options(&o);
        fh_context *ctx = tu_context(1, 0, 0, 0);
        double loss = NAN;
        const float one = 1.0f;
        fh_preference_outputs out = {&loss, NULL, NULL, NULL, NULL};
        fh_linear_grads grads = {.dx = dx, .dx_row_stride = 1};
        const fh_status st = fh_preference_forward_backward(ctx, &lin, &batch, &o, &one, &out, &grads);
        ref_preference_result r = {0};
        const int rs = ref_preference_forward(&problem, &ro, &r);
        const int rb = ref_preference_backward(&problem, &ro, 1.0, dx_ref, NULL, NULL);
        TU_CHECK(st == FH_OK && rs == 0 && rb == 0, "%s: status %d, reference %d %d", name, (int)st, rs, rb);
        double scale = 0.0, off = 0.0;
        for (int64_t i = 0; i < ROWS; i++)
            scale = fmax(scale, fabs(dx_ref[i]));
        for (int64_t i = 0; i < ROWS; i++)
            off = fmax(off, fabs((double)dx[i] - dx_ref[i]) / scale);
        TU_CHECK(fabs(loss - r.loss) <= 1e-6 * fabs(r.loss), "%s: loss %.17g vs reference %.17g", name, loss, r.loss);
        TU_CHECK(scale > 0.0 && off <= 1e-6, "%s: dx off the reference by %.2e of its largest value %.3g", name,
                 off, scale);
        fh_context_destroy(ctx);
    }
    free(x);
    free(mask);
    free(ref);
    free(dx);
    free(xd);
    free(maskd);
    free(refd);
    free(dx_ref);
    free(targets);
}

static const tu_test tests[] = {
    {"every loss and loss_type vs reference, both schedules", test_reference_matrix},
    {"larger vocabulary, several row blocks", test_reference_larger},
    {"row blocks vs streaming", test_schedules_agree},
    {"grad_output scales the gradients exactly", test_grad_output_scaling},
    {"gradient beta 1 accumulates", test_accumulation},
    {"edge masks vs reference", test_edge_masks},
    {"an empty sequence: orpo refuses it, every other loss is finite", test_empty_sequences},
    {"metrics NaN where TRL logs nothing", test_metric_nan_pattern},
    {"each bad argument: own status, untouched outputs, message", test_bad_arguments},
    {"valid calls write their outputs; message reset", test_valid_calls},
    {"out-of-range targets under the mask accepted", test_masked_out_of_range_targets},
    {"caller workspace: exact size, size - 1; size query", test_workspace},
    {"options init and optional outputs", test_options_init_and_optional_outputs},
    {"TRL's current DPO: every loss type and lists vs reference, both schedules", test_current_matrix},
    {"TRL's current DPO: metrics over no token, fractional weights", test_current_metrics},
    {"aot's sort: ties by pair index, 4096 pairs vs reference", test_aot_sort_order},
};
const tu_suite suite_preference = {tests, TU_COUNT(tests)};
