/* kto: the fused KTO head (fh_kto_forward, fh_kto_forward_backward) against the double-precision TRL-semantics
 * reference (ref/ref_kto.h):
 *   - both loss types, reference per sequence and per token, the KL term as a value and as log-ratios, unequal
 *     weights, in both schedules of the single-call step (tests/cases/kto_case.c has the inputs and the tolerances);
 *   - grad_output scaling; gradient accumulation (beta 1);
 *   - edge batches (one-sided labels, every token masked, fractional mask weights, a negative KL mean) against the
 *     reference, and the metrics' NaN pattern;
 *   - the API contracts: each bad argument's own status with every output untouched and a message naming it, the
 *     workspace query, the option defaults, optional outputs. */
#include "ce_case.h"
#include "contract_driver.h"
#include "kto_case.h"
#include "preference_case.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Drawn inputs (kto_case): fused vs reference, scaling, accumulation
 * ============================================================================================== */

static void describe(const kto_case_spec *s, char *buf, size_t size)
{
    static const char *const types[] = {"kto", "apo_zero_unpaired"}, *const refs[] = {"sequence", "token"};
    static const char *const kls[] = {"value", "logratios", "none"};
    const fh_kto_options *o = &s->options;
    snprintf(buf, size,
             "%s ref=%s kl=%s beta=%g w=%g/%g | B=%lld T=%lld H=%lld V=%lld %s bias=%d | tiles=%lldx%lld threads=%d "
             "g=%g seed=%llu",
             types[o->loss_type], refs[s->ref], kls[s->kl], o->beta, o->desirable_weight, o->undesirable_weight,
             (long long)s->batch, (long long)s->seq, (long long)s->hidden, (long long)s->vocab,
             s->layout == FH_LAYOUT_HV ? "hv" : "vh", s->bias, (long long)s->tile_rows, (long long)s->tile_vocab,
             s->threads, (double)s->grad_output, (unsigned long long)s->seed);
}

/* B = 9 sequences of T = 7 tokens (n = 63), H = 11, V = 37 = 2 x 16 + 5 (a 5-column edge tile). Row blocks: tile_rows
 * 21 holds three sequences (several blocks of whole sequences); streaming: tile_rows 5 < T. Layout and bias alternate
 * with the seed. */
enum { ROW_BLOCK_ROWS = 21, STREAMING_ROWS = 5 };
static void small_spec(kto_case_spec *s, int variant, int streaming, uint64_t seed)
{
    kto_case_spec_default(s);
    s->batch = 9;
    s->seq = 7;
    s->hidden = 11;
    s->vocab = 37;
    s->threads = 1;
    s->tile_rows = streaming ? STREAMING_ROWS : ROW_BLOCK_ROWS;
    s->tile_vocab = 16;
    s->seed = seed;
    s->layout = seed & 1 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
    s->bias = (int)((seed >> 1) & 1);
    /* variant: bit 0 the loss type, bit 1 the reference mode, bit 2 the KL input (kto) */
    s->options.loss_type = variant & 1 ? FH_KTO_LOSS_APO_ZERO_UNPAIRED : FH_KTO_LOSS_KTO;
    s->ref = variant & 2 ? KTO_REF_TOKEN : KTO_REF_SEQUENCE;
    s->kl = variant & 1 ? KTO_KL_NONE : variant & 4 ? KTO_KL_LOGRATIOS : KTO_KL_VALUE;
}
enum { VARIANTS = 8 };

/* Runs a case; asserts FH_OK and every tolerance of kto_case.c; returns 1 when c holds a run to inspect (the caller
 * frees it then). */
static int run_case(const kto_case_spec *s, const char *label, kto_case *c)
{
    char desc[512];
    describe(s, desc, sizeof desc);
    kto_diff d;
    const fh_status st = kto_case_run(s, c, &d);
    TU_CHECK(st == FH_OK, "%s [%s]: status %d (%s)", label, desc, (int)st, fh_status_string(st));
    if (st != FH_OK) {
        kto_case_free(c);
        return 0;
    }
    TU_CHECK(kto_diff_pass(&d),
             "%s [%s]: loss %.17g vs %.17g (diff %.2e, tol %.2e); metrics %.2e (tol %g); sequence_logps %.2e rewards "
             "%.2e logp %.2e (tol %g); dx %.2e dweight %.2e dbias %.2e (tol %g); %lld masked dx rows not 0",
             label, desc, c->step.loss, c->ref_loss, d.loss, d.loss_tolerance, d.metrics, KTO_METRIC_TOL,
             d.sequence_logps, d.rewards, d.logp, KTO_TOKEN_TOL, d.dx, d.dweight, d.dbias, d.grad_tolerance,
             (long long)d.masked_rows_touched);
    return 1;
}

/* Every loss type x reference mode x KL input (kto) x schedule, with weights 1 / 1 and 1.4 / 0.6, beta 0.1 and 1,
 * grad_output -0.7 on some, two threads on the default tiles (one row block) for a few. Tolerances: kto_case.c. */
static void test_reference_matrix(void)
{
    for (int v = 0; v < VARIANTS; v++) {
        if ((v & 1) && (v & 4))
            continue; /* apo_zero_unpaired takes no KL input */
        for (int streaming = 0; streaming < 2; streaming++) {
            kto_case_spec s;
            small_spec(&s, v, streaming, (uint64_t)(100 + 2 * v + streaming));
            if ((v + streaming) & 1) {
                s.options.desirable_weight = 1.4;
                s.options.undesirable_weight = 0.6;
            }
            if (v & 2)
                s.options.beta = 1.0;
            if (v % 3 == 0)
                s.grad_output = -0.7f;
            kto_case c;
            if (run_case(&s, "matrix", &c))
                kto_case_free(&c);
        }
        kto_case_spec s;
        small_spec(&s, v, 0, (uint64_t)(300 + v));
        s.threads = 2;
        s.tile_rows = s.tile_vocab = 0;
        kto_case c;
        if (run_case(&s, "two threads, default tiles", &c))
            kto_case_free(&c);
    }
}

/* grad_output scales the gradients and nothing else: a power of two scales every coefficient, dZ element and GEMM
 * product exactly (no subnormal in reach here), so g = -0.5 and 4 give exactly g times the g = 1 gradients. */
static void test_grad_output_scaling(void)
{
    static const float scales[] = {-0.5f, 4.0f};
    for (int streaming = 0; streaming < 2; streaming++) {
        kto_case_spec s;
        small_spec(&s, 4, streaming, 500);
        s.bias = 1;
        kto_case c;
        if (!run_case(&s, "scaling", &c))
            continue;
        const size_t n = (size_t)(s.batch * s.seq), h = (size_t)s.hidden, v = (size_t)s.vocab;
        float *dx = tu_alloc(n * h, sizeof(float)), *dw = tu_alloc(h * v, sizeof(float)), *db = tu_alloc(v, sizeof(float));
        for (size_t k = 0; k < TU_COUNT(scales); k++) {
            const fh_status st = kto_case_step(&c, scales[k], 0.0f, dx, dw, db);
            TU_CHECK(st == FH_OK, "streaming %d, g = %g: status %d", streaming, (double)scales[k], (int)st);
            size_t wrong = 0;
            for (size_t i = 0; i < n * h; i++)
                wrong += dx[i] != scales[k] * c.dx[i];
            for (size_t i = 0; i < h * v; i++)
                wrong += dw[i] != scales[k] * c.dweight[i];
            for (size_t j = 0; j < v; j++)
                wrong += db[j] != scales[k] * c.dbias[j];
            TU_CHECK(wrong == 0, "streaming %d, g = %g: %zu gradient elements are not exactly g times those of g = 1",
                     streaming, (double)scales[k], wrong);
        }
        free(dx), free(dw), free(db);
        kto_case_free(&c);
    }
}

/* Gradient beta 1 adds to what the buffers hold: a second identical call onto the first one's gradients G gives 2 G
 * up to the second call's own fp32 rounding (test_preference.c's ACCUMULATE_TOL reasoning: 1e-6 normwise; a beta
 * treated as 0 is off by 50%). */
#define ACCUMULATE_TOL 1e-6
static void test_accumulation(void)
{
    for (int streaming = 0; streaming < 2; streaming++) {
        kto_case_spec s;
        small_spec(&s, 2, streaming, 600);
        s.bias = 1;
        kto_case c;
        if (!run_case(&s, "accumulation", &c))
            continue;
        const size_t n = (size_t)(s.batch * s.seq), h = (size_t)s.hidden, v = (size_t)s.vocab;
        float *dx = tu_alloc(n * h, sizeof(float)), *dw = tu_alloc(h * v, sizeof(float)), *db = tu_alloc(v, sizeof(float));
        memcpy(dx, c.dx, n * h * sizeof(float));
        memcpy(dw, c.dweight, h * v * sizeof(float));
        memcpy(db, c.dbias, v * sizeof(float));
        const fh_status st = kto_case_step(&c, s.grad_output, 1.0f, dx, dw, db);
        TU_CHECK(st == FH_OK, "streaming %d: status %d", streaming, (int)st);
        double num = 0.0, den = 0.0;
        const float *acc[3] = {dx, dw, db}, *once[3] = {c.dx, c.dweight, c.dbias};
        const size_t counts[3] = {n * h, h * v, v};
        for (int k = 0; k < 3; k++)
            for (size_t i = 0; i < counts[k]; i++) {
                const double e = 0.5 * (double)acc[k][i] - (double)once[k][i];
                num += e * e;
                den += (double)once[k][i] * once[k][i];
            }
        TU_CHECK(sqrt(num / den) <= ACCUMULATE_TOL, "streaming %d: beta 1 onto G gives 2 G within %.2e (tol %g)",
                 streaming, sqrt(num / den), ACCUMULATE_TOL);
        free(dx), free(dw), free(db);
        kto_case_free(&c);
    }
}

/* ================================================================================================
 * A hand-built batch: edge batches against the reference, the metrics' NaN pattern, the API contracts
 * ============================================================================================== */

enum { B = 4, T = 3, N = B * T, H = 4, V = 7 };

/* Everything a call writes, in one block so that one memcmp covers it. */
typedef struct outputs {
    double loss;
    fh_kto_metrics metrics;
    float sequence_logps[B], rewards[B], logp[N];
    float dx[N * H], dweight[H * V], dbias[V];
} outputs;

/* Everything a call reads. */
typedef struct inputs {
    float x[N * H], weight[H * V], bias[V];
    int64_t targets[N];
    uint8_t labels[B];
    float mask[N], ref_logps[B], ref_per_token_logps[N], kl[1], kl_logratios[B], grad_output[1];
} inputs;

typedef struct fixture {
    fh_context *ctx;
    inputs in;
    outputs out;
    fh_linear lin;
    fh_kto_batch batch;
    fh_kto_options options;
    fh_kto_outputs kout;
    fh_linear_grads grads;
    /* what gets passed */
    fh_context *call_ctx;
    const fh_linear *call_lin;
    const fh_kto_batch *call_batch;
    const fh_kto_options *call_options;
    fh_kto_outputs *call_out;
    const float *call_grad_output;
    fh_linear_grads *call_grads;
} fixture;

/* A valid kto call that uses every input: bias, sequence reference log-probs, the KL value 0.3, weights 1.2 / 0.9,
 * labels 1 0 0 1; the last token of sequences 1 and 3 masked, the very last with target -100. Outputs hold the
 * canary. */
static void fixture_init(void *fixture_)
{
    fixture *f = fixture_;
    memset(f, 0, sizeof *f);
    TU_CHECK(fh_context_create(&f->ctx) == FH_OK, "fh_context_create");
    uint64_t rng = 3131;
    tu_fill_uniform(f->in.x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.weight, H * V, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.bias, V, &rng, -0.5, 0.5);
    tu_fill_uniform(f->in.ref_logps, B, &rng, -7.0, -5.0);
    tu_fill_uniform(f->in.ref_per_token_logps, N, &rng, -2.5, -1.5);
    tu_fill_uniform(f->in.kl_logratios, B, &rng, -1.0, 2.0);
    for (int i = 0; i < N; i++) {
        f->in.targets[i] = (int64_t)(ref_uniform(&rng) * V);
        f->in.mask[i] = (i / T) % 2 == 1 && i % T == T - 1 ? 0.0f : 1.0f;
    }
    static const uint8_t labels[B] = {1, 0, 0, 1};
    memcpy(f->in.labels, labels, sizeof labels);
    f->in.targets[N - 1] = -100;
    f->in.kl[0] = 0.3f;
    f->in.grad_output[0] = 1.0f;
    fh_linear_init(&f->lin, N, H, V, f->in.x, f->in.weight, FH_LAYOUT_HV, f->in.bias);
    const fh_kto_batch batch = {B, T, f->in.targets, f->in.mask, f->in.labels, f->in.ref_logps, NULL, f->in.kl, NULL, NULL};
    f->batch = batch;
    fh_kto_options_init(&f->options);
    f->options.desirable_weight = 1.2;
    f->options.undesirable_weight = 0.9;
    const fh_kto_outputs ko = {&f->out.loss, &f->out.metrics, f->out.sequence_logps, f->out.rewards, f->out.logp};
    f->kout = ko;
    const fh_linear_grads g = {.dx = f->out.dx, .dx_row_stride = H, .dweight = f->out.dweight, .dbias = f->out.dbias};
    f->grads = g;
    tu_fill_canary(&f->out, sizeof f->out);
    f->call_ctx = f->ctx;
    f->call_lin = &f->lin;
    f->call_batch = &f->batch;
    f->call_options = &f->options;
    f->call_out = &f->kout;
    f->call_grad_output = f->in.grad_output;
    f->call_grads = &f->grads;
}

enum { FWD = 1, STEP = 2, BOTH = 3 };

static fh_status call(void *fixture_, int which)
{
    const fixture *f = fixture_;
    if (which == FWD)
        return fh_kto_forward(f->call_ctx, f->call_lin, f->call_batch, f->call_options, f->call_out);
    return fh_kto_forward_backward(f->call_ctx, f->call_lin, f->call_batch, f->call_options, f->call_grad_output,
                                   f->call_out, f->call_grads);
}

static const char *call_name(int which)
{
    return which == FWD ? "fh_kto_forward" : "fh_kto_forward_backward";
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

/* The fixture's forward and single-call step against the reference on the same inputs, with kto_case's tolerances
 * (tests/cases/kto_case.c); returns the reference's metrics. */
static ref_kto_metrics check_fixture(fixture *f, const char *label)
{
    ref_kto_result r = {0};
    for (int which = FWD; which <= STEP; which++) {
        const fh_status st = call(f, which);
        TU_CHECK(st == FH_OK, "%s, %s: status %d (%s)", label, call_name(which), (int)st, fh_status_string(st));
        if (st != FH_OK)
            return r.metrics;
        double *x = tu_doubles(f->in.x, N * H), *w = tu_doubles(f->in.weight, H * V), *b = tu_doubles(f->in.bias, V);
        double *mask = tu_doubles(f->in.mask, N), *ref = tu_doubles(f->batch.ref_logps, B);
        double *ref_tok = tu_doubles(f->batch.ref_per_token_logps, N), *kl = tu_doubles(f->batch.kl, 1);
        double *klr = tu_doubles(f->batch.kl_logratios, B);
        const ref_kto_problem p = {B, T, H, V, x, w, b, f->in.targets, mask, f->in.labels, ref, ref_tok, kl, klr};
        const ref_kto_options o = {(ref_kto_loss_type)f->options.loss_type, f->options.beta,
                                   f->options.desirable_weight, f->options.undesirable_weight};
        double seq[B], rewards[B], logp[N], dx[N * H], dw[H * V], db[V];
        r.sequence_logps = seq;
        r.rewards = rewards;
        r.logp = logp;
        int rc = ref_kto_forward(&p, &o, &r);
        rc |= ref_kto_backward(&p, &o, f->in.grad_output[0], dx, dw, db);
        TU_CHECK(rc == 0, "%s: the reference failed (%d)", label, rc);
        const fh_kto_metrics rm = kto_fh_metrics(&r.metrics);
        const double loss = fabs(f->out.loss - r.loss), metrics = kto_metrics_diff(&f->out.metrics, &rm);
        const double values = fmax(preference_token_diff(f->out.sequence_logps, seq, B),
                                    fmax(preference_token_diff(f->out.rewards, rewards, B),
                                         preference_token_diff(f->out.logp, logp, N)));
        const double grads =
            which == FWD ? 0.0
                         : fmax(ce_compare(f->out.dx, dx, N * H).norm_rel,
                                fmax(ce_compare(f->out.dweight, dw, H * V).norm_rel,
                                     ce_compare(f->out.dbias, db, V).norm_rel));
        TU_CHECK(loss <= KTO_LOSS_TOL * fmax(1.0, fabs(r.loss)) && metrics <= KTO_METRIC_TOL &&
                     values <= KTO_TOKEN_TOL && grads <= KTO_GRAD_NORM_REL_TOL,
                 "%s, %s: loss %.17g vs %.17g; metrics %.2e; outputs %.2e; gradients %.2e", label, call_name(which),
                 f->out.loss, r.loss, metrics, values, grads);
        void *a[] = {x, w, b, mask, ref, ref_tok, kl, klr};
        for (size_t k = 0; k < TU_COUNT(a); k++)
            free(a[k]);
    }
    return r.metrics;
}

/* Edge batches, each against the reference (forward and step), and the metrics TRL logs for them:
 *   - only desirable sequences: the rejected means and the margin NaN (TRL logs none); only undesirable: the chosen
 *     ones NaN;
 *   - every token masked: l = 0, logits means NaN, entropy 0, every gradient exactly 0;
 *   - fractional mask weights 0.25 .. 2 with per-token reference log-probs;
 *   - KL log-ratios with a negative mean: kl clamped to 0; apo_zero_unpaired: kl 0. */
static void test_edge_batches(void)
{
    fixture f;
    fixture_init(&f);
    memset(f.in.labels, 1, B);
    ref_kto_metrics m = check_fixture(&f, "only desirable");
    TU_CHECK(isnan(f.out.metrics.rewards_rejected) && isnan(f.out.metrics.logps_rejected) &&
                 isnan(f.out.metrics.rewards_margins) && isnan(f.out.metrics.logits_rejected) &&
                 !isnan(f.out.metrics.rewards_chosen) && !isnan(f.out.metrics.logits_chosen) && isnan(m.rewards_margins),
             "only desirable: the NaN pattern");
    memset(f.in.labels, 0, B);
    check_fixture(&f, "only undesirable");
    TU_CHECK(isnan(f.out.metrics.rewards_chosen) && isnan(f.out.metrics.logps_chosen) &&
                 isnan(f.out.metrics.logits_chosen) && !isnan(f.out.metrics.rewards_rejected),
             "only undesirable: the NaN pattern");
    fh_context_destroy(f.ctx);

    fixture_init(&f);
    memset(f.in.mask, 0, sizeof f.in.mask);
    check_fixture(&f, "every token masked");
    size_t nonzero = 0;
    for (size_t i = 0; i < N * H; i++)
        nonzero += f.out.dx[i] != 0.0f;
    for (size_t i = 0; i < H * V; i++)
        nonzero += f.out.dweight[i] != 0.0f;
    for (size_t j = 0; j < V; j++)
        nonzero += f.out.dbias[j] != 0.0f;
    TU_CHECK(nonzero == 0 && f.out.metrics.entropy == 0.0 && isnan(f.out.metrics.logits_chosen) &&
                 f.out.sequence_logps[0] == 0.0f,
             "every token masked: %zu non-zero gradient elements, entropy %g", nonzero, f.out.metrics.entropy);
    fh_context_destroy(f.ctx);

    fixture_init(&f);
    for (int i = 0; i < N; i++)
        f.in.mask[i] = i == N - 1 ? 0.0f : 0.25f * (float)(1 + i % 8); /* the -100 target stays masked */
    f.batch.ref_logps = NULL;
    f.batch.ref_per_token_logps = f.in.ref_per_token_logps;
    check_fixture(&f, "fractional weights, per-token reference");
    fh_context_destroy(f.ctx);

    fixture_init(&f);
    for (int s = 0; s < B; s++)
        f.in.kl_logratios[s] = s == 0 ? 1.0f : -2.0f;
    f.batch.kl = NULL;
    f.batch.kl_logratios = f.in.kl_logratios;
    check_fixture(&f, "negative KL mean");
    TU_CHECK(f.out.metrics.kl == 0.0, "a negative KL mean is clamped to 0: %g", f.out.metrics.kl);
    f.batch.kl_logratios = NULL;
    f.options.loss_type = FH_KTO_LOSS_APO_ZERO_UNPAIRED;
    f.options.beta = 2.0;
    check_fixture(&f, "apo_zero_unpaired");
    TU_CHECK(f.out.metrics.kl == 0.0, "apo_zero_unpaired: kl %g", f.out.metrics.kl);
    fh_context_destroy(f.ctx);
}

/* ---- the invalid arguments ---- */
#define MUTATION(fn, body) \
    static void fn(void *fixture_) { fixture *f = fixture_; body; }
MUTATION(null_ctx, f->call_ctx = NULL)
MUTATION(null_lin, f->call_lin = NULL)
MUTATION(null_batch, f->call_batch = NULL)
MUTATION(null_targets, f->batch.targets = NULL)
MUTATION(null_mask, f->batch.mask = NULL)
MUTATION(null_labels, f->batch.labels = NULL)
MUTATION(null_options, f->call_options = NULL)
MUTATION(null_outputs, f->call_out = NULL)
MUTATION(null_grad_output, f->call_grad_output = NULL)
MUTATION(null_grads, f->call_grads = NULL)
MUTATION(batch_too_large, f->batch.batch = B + 1)
MUTATION(seq_too_small, f->batch.seq = T - 1)
MUTATION(batch_zero, f->batch.batch = 0)
MUTATION(batch_seq_overflow, (f->batch.batch = INT64_MAX / 2, f->batch.seq = 3))
MUTATION(n_zero, f->lin.n = 0)
MUTATION(mask_negative, f->in.mask[2] = -1.0f)
MUTATION(mask_nan, f->in.mask[0] = NAN)
MUTATION(target_equals_vocab, f->in.targets[1] = V)
MUTATION(masked_target_unmasked, f->in.mask[N - 1] = 1.0f) /* the -100 at the masked position becomes live */
MUTATION(label_two, f->in.labels[2] = 2)
MUTATION(loss_type_two, f->options.loss_type = (fh_kto_loss_type)2)
MUTATION(loss_type_negative, f->options.loss_type = (fh_kto_loss_type)-1)
MUTATION(beta_zero, f->options.beta = 0.0)
MUTATION(beta_nan, f->options.beta = NAN)
MUTATION(desirable_weight_negative, f->options.desirable_weight = -1.0)
MUTATION(undesirable_weight_inf, f->options.undesirable_weight = INFINITY)
MUTATION(no_reference, f->batch.ref_logps = NULL)
MUTATION(both_references, f->batch.ref_per_token_logps = f->in.ref_per_token_logps)
MUTATION(no_kl, f->batch.kl = NULL)
MUTATION(both_kl, f->batch.kl_logratios = f->in.kl_logratios)
MUTATION(kl_negative, f->in.kl[0] = -0.1f)
MUTATION(kl_nan, f->in.kl[0] = NAN)
MUTATION(kl_logratio_inf, (f->batch.kl = NULL, f->batch.kl_logratios = f->in.kl_logratios,
                           f->in.kl_logratios[3] = INFINITY))
MUTATION(kl_for_apo, f->options.loss_type = FH_KTO_LOSS_APO_ZERO_UNPAIRED)
MUTATION(grad_output_nan, f->in.grad_output[0] = NAN)
MUTATION(dx_beta_half, f->grads.dx_beta = 0.5f)
MUTATION(dbias_without_bias, f->lin.bias = NULL)
MUTATION(budget_one, fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, 1))
MUTATION(logp_over_mask, f->kout.per_token_logp = f->in.mask)
MUTATION(rewards_over_kl_logratios, (f->batch.kl = NULL, f->batch.kl_logratios = f->in.kl_logratios,
                                     f->kout.rewards = f->in.kl_logratios))
MUTATION(dweight_over_labels, f->grads.dweight = (float *)f->in.labels)

#define OPTION FH_ERR_INVALID_PREFERENCE_OPTION
static const cd_case bad_cases[] = {
    {"NULL context", null_ctx, BOTH, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, BOTH, FH_ERR_NULL_POINTER, "lin"},
    {"NULL batch", null_batch, BOTH, FH_ERR_NULL_POINTER, "fh_kto_batch"},
    {"NULL targets", null_targets, BOTH, FH_ERR_NULL_POINTER, "targets"},
    {"NULL mask", null_mask, BOTH, FH_ERR_NULL_POINTER, "mask"},
    {"NULL labels", null_labels, BOTH, FH_ERR_NULL_POINTER, "labels"},
    {"NULL options", null_options, BOTH, FH_ERR_NULL_POINTER, "options"},
    {"NULL outputs", null_outputs, BOTH, FH_ERR_NULL_POINTER, "outputs"},
    {"NULL grad_output", null_grad_output, STEP, FH_ERR_NULL_POINTER, "grad_output"},
    {"NULL grads", null_grads, STEP, FH_ERR_NULL_POINTER, "fh_linear_grads"},
    {"batch seq > n", batch_too_large, BOTH, FH_ERR_INVALID_SIZE, "batch"},
    {"batch seq < n", seq_too_small, BOTH, FH_ERR_INVALID_SIZE, "seq"},
    {"batch = 0", batch_zero, BOTH, FH_ERR_INVALID_SIZE, "batch"},
    {"batch seq overflows", batch_seq_overflow, BOTH, FH_ERR_INVALID_SIZE, "batch"},
    {"n = 0", n_zero, BOTH, FH_ERR_INVALID_SIZE, "n"},
    {"mask -1", mask_negative, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"mask NaN", mask_nan, BOTH, FH_ERR_INVALID_MASK, "mask"},
    {"target = V unmasked", target_equals_vocab, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"masked -100 target unmasked", masked_target_unmasked, BOTH, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"label 2", label_two, BOTH, OPTION, "labels"},
    {"loss_type 2", loss_type_two, BOTH, OPTION, "loss_type"},
    {"loss_type -1", loss_type_negative, BOTH, OPTION, "loss_type"},
    {"beta 0", beta_zero, BOTH, OPTION, "beta"},
    {"beta NaN", beta_nan, BOTH, OPTION, "beta"},
    {"desirable_weight -1", desirable_weight_negative, BOTH, OPTION, "desirable_weight"},
    {"undesirable_weight inf", undesirable_weight_inf, BOTH, OPTION, "undesirable_weight"},
    {"no reference", no_reference, BOTH, OPTION, "reference"},
    {"both references", both_references, BOTH, OPTION, "ref_per_token_logps"},
    {"kto without a KL input", no_kl, BOTH, OPTION, "kl"},
    {"kl and kl_logratios", both_kl, BOTH, OPTION, "kl_logratios"},
    {"kl -0.1", kl_negative, BOTH, OPTION, "kl"},
    {"kl NaN", kl_nan, BOTH, OPTION, "kl"},
    {"kl_logratios inf", kl_logratio_inf, BOTH, OPTION, "kl_logratios"},
    {"kl for apo_zero_unpaired", kl_for_apo, BOTH, OPTION, "apo_zero_unpaired"},
    {"grad_output NaN", grad_output_nan, STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"dx_beta 0.5", dx_beta_half, STEP, FH_ERR_INVALID_BETA, "dx_beta"},
    {"dbias requested without bias", dbias_without_bias, STEP, FH_ERR_NULL_POINTER, "bias"},
    {"memory budget 1 byte", budget_one, BOTH, FH_ERR_BUDGET_TOO_SMALL, "budget"},
    {"per_token_logp over the mask", logp_over_mask, BOTH, FH_ERR_OVERLAPPING_BUFFERS, "per_token_logp"},
    {"rewards over kl_logratios", rewards_over_kl_logratios, BOTH, FH_ERR_OVERLAPPING_BUFFERS, "rewards"},
    {"dweight over labels", dweight_over_labels, STEP, FH_ERR_OVERLAPPING_BUFFERS, "dweight"},
};
#undef OPTION

/* Each invalid argument returns its own documented status from each entry point that takes it, leaves every output
 * bit-identical (the canary) and every input untouched, and the context message names the problem. */
static void test_bad_arguments(void)
{
    cd_run_bad_arguments(&api, bad_cases, TU_COUNT(bad_cases));
}

/* After a success, an error sets a message and the next success clears it; the boundaries kl 0 and weights 0 are
 * accepted. */
MUTATION(kl_zero_weights_zero,
         (f->options.beta = 0.1, f->in.kl[0] = 0.0f, f->options.desirable_weight = f->options.undesirable_weight = 0.0))
static const cd_case error_then_success[] = {
    {"beta 0", beta_zero, BOTH, FH_ERR_INVALID_PREFERENCE_OPTION, "beta"},
    {"beta 0.1, kl 0, weights 0", kl_zero_weights_zero, BOTH, FH_OK, NULL},
};

static void test_valid_calls(void)
{
    cd_run_valid_calls(&api, error_then_success, TU_COUNT(error_then_success), NULL);
}

/* A caller workspace of exactly fh_kto_workspace_size bytes works for both calls; one byte less is refused
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
    return fh_kto_workspace_size(f->call_ctx, f->call_lin, bytes);
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
MUTATION(no_outputs, (memset(&f->kout, 0, sizeof f->kout), memset(&f->grads, 0, sizeof f->grads)))
MUTATION(loss_and_dweight, (f->kout.loss = &f->out.loss, f->grads.dweight = f->out.dweight))
static const cd_optional optional_steps[] = {
    {"every output and gradient NULL", no_outputs, BOTH, {NULL}},
    {"the loss and dweight only", loss_and_dweight, BOTH, {"loss", "dweight"}},
};

/* fh_kto_options_init's documented defaults (TRL's KTOConfig), NULL; and "any may be NULL" for the outputs. */
static void test_options_init_and_optional_outputs(void)
{
    fh_kto_options o;
    memset(&o, 0x5A, sizeof o);
    TU_CHECK(fh_kto_options_init(&o) == FH_OK, "fh_kto_options_init");
    TU_CHECK(o.loss_type == FH_KTO_LOSS_KTO && o.beta == 0.1 && o.desirable_weight == 1.0 &&
                 o.undesirable_weight == 1.0,
             "documented defaults");
    TU_CHECK(fh_kto_options_init(NULL) == FH_ERR_NULL_POINTER, "fh_kto_options_init(NULL)");
    cd_run_optional_outputs(&api, optional_steps, TU_COUNT(optional_steps));
}

static const tu_test tests[] = {
    {"every loss type, reference and KL input vs reference, both schedules", test_reference_matrix},
    {"grad_output scales the gradients exactly", test_grad_output_scaling},
    {"gradient beta 1 accumulates", test_accumulation},
    {"edge batches vs reference, metrics NaN where TRL logs nothing", test_edge_batches},
    {"each bad argument: own status, untouched outputs, message", test_bad_arguments},
    {"valid calls write their outputs; message reset", test_valid_calls},
    {"caller workspace: exact size, size - 1; size query", test_workspace},
    {"options init and optional outputs", test_options_init_and_optional_outputs},
};
const tu_suite suite_kto = {tests, TU_COUNT(tests)};
