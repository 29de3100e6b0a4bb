/* packed: GRPO, preference and KTO over packed sequences (cu_seqlens) against the same heads over the [B, T] rows
 * of the same sequences, padded (fusedhead.h, "Packed sequences"):
 *   - the sequences drawn with lengths 1 .. T (one of T), masked tokens inside some, random hidden states and ids
 *     outside [0, V) in the padding; every loss type whose per-sequence math differs, fp32 and bf16, the forward
 *     alone and the single call, in row blocks of 20 and 40 rows (whole packed sequences per block, so the blocks'
 *     boundaries vary), on the default tiles with two threads, and streaming (a block that cannot hold the longest
 *     sequence); batch-invariant contexts bit for bit, default ones within the tolerances `match` states;
 *   - ORPO's and CPO's logits means are TRL's over every position of the padded batch (padding included): not
 *     compared;
 *   - the refusals: offsets not from 0, not increasing, not ending at n, seq not 0, dr_grpo with no
 *     max_completion_length; outputs untouched. */
#include "bf16.h"
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { H = 13, V = 53, T = 9, MAX_SEQUENCES = 8 };

/* dweight and dbias of the packed call against the padded one's: the same terms summed in another grouping of rows
 * (fp32, at most 60 rows of terms of size ~1): a few ulps of the norm. */
#define SUMMATION_TOL 2e-6

/* The sequences, padded and packed. */
typedef struct batch {
    int64_t sequences, n;             /* n: packed rows */
    int64_t cu[MAX_SEQUENCES + 1];
    int64_t padded_row[MAX_SEQUENCES * T]; /* packed row k is padded row padded_row[k] */
    float x[MAX_SEQUENCES * T * H], weight[H * V], bias[V];
    float packed_x[MAX_SEQUENCES * T * H];
    uint16_t *x_bf16, *weight_bf16, *packed_x_bf16;
    int64_t ids[MAX_SEQUENCES * T], packed_ids[MAX_SEQUENCES * T];
    float mask[MAX_SEQUENCES * T], packed_mask[MAX_SEQUENCES * T];
    float token_a[MAX_SEQUENCES * T], packed_token_a[MAX_SEQUENCES * T]; /* old log-probs, reference log-probs */
    float token_b[MAX_SEQUENCES * T], packed_token_b[MAX_SEQUENCES * T]; /* sampling or reference log-probs */
    float per_sequence[MAX_SEQUENCES];                                     /* advantages, or reference l */
    uint8_t labels[MAX_SEQUENCES];
} batch;

static uint64_t next(uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return *rng >> 33;
}

/* Draws `sequences` sequences (lengths 1 .. T, the first of T), with ids outside [0, V) and mask 0 in the padding
 * and a masked token inside some; bf16 rounds x and the weight first. */
static void draw(batch *b, int64_t sequences, uint64_t seed, int bf16)
{
    memset(b, 0, sizeof *b);
    uint64_t rng = seed;
    b->sequences = sequences;
    tu_fill_uniform(b->x, (size_t)(sequences * T * H), &rng, -1.0, 1.0);
    tu_fill_uniform(b->weight, H * V, &rng, -0.6, 0.6);
    tu_fill_uniform(b->bias, V, &rng, -0.3, 0.3);
    tu_fill_uniform(b->token_a, (size_t)(sequences * T), &rng, -3.0, -0.5);
    tu_fill_uniform(b->token_b, (size_t)(sequences * T), &rng, -3.0, -0.5);
    tu_fill_uniform(b->per_sequence, (size_t)sequences, &rng, -1.5, 1.5);
    if (bf16) {
        b->x_bf16 = bf16_round_in_place(b->x, (size_t)(sequences * T * H));
        b->weight_bf16 = bf16_round_in_place(b->weight, H * V);
    }
    for (int64_t s = 0; s < sequences; s++) {
        const int64_t length = s == 0 ? T : 1 + (int64_t)(next(&rng) % T);
        b->labels[s] = (uint8_t)(next(&rng) & 1);
        b->cu[s + 1] = b->cu[s] + length;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = s * T + t;
            const int inside = t < length;
            b->ids[i] = inside ? (int64_t)(next(&rng) % V) : -100;
            b->mask[i] = inside && !(length > 3 && t == 1) ? 1.0f : 0.0f;
            if (inside)
                b->padded_row[b->cu[s] + t] = i;
        }
    }
    b->n = b->cu[sequences];
    for (int64_t k = 0; k < b->n; k++) {
        const int64_t i = b->padded_row[k];
        memcpy(b->packed_x + k * H, b->x + i * H, H * sizeof(float));
        b->packed_ids[k] = b->ids[i];
        b->packed_mask[k] = b->mask[i];
        b->packed_token_a[k] = b->token_a[i];
        b->packed_token_b[k] = b->token_b[i];
    }
    if (bf16) {
        b->packed_x_bf16 = tu_alloc((size_t)(b->n * H), sizeof(uint16_t));
        for (int64_t k = 0; k < b->n * H; k++)
            b->packed_x_bf16[k] = bf16_from_float(b->packed_x[k]);
    }
}

static void release(batch *b)
{
    free(b->x_bf16);
    free(b->weight_bf16);
    free(b->packed_x_bf16);
}

static fh_linear linear_of(const batch *b, int packed)
{
    fh_linear lin;
    const int bf16 = b->x_bf16 != NULL;
    const void *x = bf16 ? (packed ? (const void *)b->packed_x_bf16 : b->x_bf16) : packed ? b->packed_x : b->x;
    fh_linear_init(&lin, packed ? b->n : b->sequences * T, H, V, x, bf16 ? (const void *)b->weight_bf16 : b->weight,
                   FH_LAYOUT_VH, b->bias);
    if (bf16)
        lin.x_dtype = lin.weight_dtype = FH_DTYPE_BF16;
    return lin;
}

/* A call's gradients: fp32, or bf16 dx and dweight (bf16 inputs). */
typedef struct gradients {
    float dx[MAX_SEQUENCES * T * H], dweight[H * V], dbias[V];
    uint16_t dx16[MAX_SEQUENCES * T * H], dweight16[H * V];
    fh_linear_grads g;
} gradients;

static void gradients_init(gradients *d, int bf16)
{
    memset(d, 0, sizeof *d);
    tu_fill_canary(d->dx, sizeof d->dx);
    d->g.dx = bf16 ? (void *)d->dx16 : d->dx;
    d->g.dx_row_stride = H;
    d->g.dweight = bf16 ? (void *)d->dweight16 : d->dweight;
    d->g.dbias = d->dbias;
    d->g.dx_dtype = d->g.dweight_dtype = bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
}

static void widen(const gradients *d, int bf16, float *dweight)
{
    for (int64_t k = 0; k < H * V; k++)
        dweight[k] = bf16 ? bf16_to_float(d->dweight16[k]) : d->dweight[k];
}

/* How the packed call's results are held to the padded call's. Batch-invariant contexts: per-token outputs, dx
 * rows, per-sequence outputs, loss and metrics bit for bit (a row's logits and dx do not depend on the other rows,
 * and each per-sequence value is the same sum of the same terms in the same order: the padding adds exact zeros).
 * Default contexts pick their tiles, and the bf16 convert path its k panel, by n (docs/correctness.md, "Batch
 * invariance"), so a row's fp32 sums may be added in another order: per-token outputs within 1e-5 (values of size
 * ~1 to 10 from fp32 logits of a few ulps' difference), per-sequence values, loss and metrics within 1e-6
 * relative, dx within 1e-5 of its norm (bf16: 4e-3, one bf16 ulp). dweight and dbias always sum over other row
 * blocks: within SUMMATION_TOL of their norm (fp32, at most 60 rows of terms of size ~1; bf16 rounded once more:
 * 4e-3). */
typedef struct match {
    int exact;
    const char *what;
} match;

/* Row k of the packed per-row float array (width values each) against the padded array's row padded_row[k]. */
static int same_rows(const match *m, const batch *b, const float *packed, const float *padded, int64_t width)
{
    for (int64_t k = 0; k < b->n; k++)
        for (int64_t e = 0; e < width; e++) {
            const float p = packed[k * width + e], q = padded[b->padded_row[k] * width + e];
            if (m->exact ? memcmp(&p, &q, sizeof p) != 0 : !(fabsf(p - q) <= 1e-5f))
                return 0;
        }
    return 1;
}

static int same_value(const match *m, double a, double b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return m->exact ? a == b : fabs(a - b) <= 1e-6 * fmax(1.0, fabs(b));
}

/* Two structs of doubles hold the same numbers (NaN where the other has NaN). */
static int same_doubles(const match *m, const void *a, const void *b, size_t bytes)
{
    const double *x = a, *y = b;
    for (size_t k = 0; k < bytes / sizeof(double); k++)
        if (!same_value(m, x[k], y[k]))
            return 0;
    return 1;
}

static int same_floats(const match *m, const float *a, const float *b, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        if (!same_value(m, a[k], b[k]))
            return 0;
    return 1;
}

/* The gradients of a packed call against the padded one's. */
static void check_gradients(const match *m, const batch *b, const gradients *packed, const gradients *padded, int bf16)
{
    float dx_packed[MAX_SEQUENCES * T * H] = {0}, dx_padded[MAX_SEQUENCES * T * H] = {0};
    int64_t rows_same = 1;
    for (int64_t k = 0; k < b->n; k++) {
        const int64_t i = b->padded_row[k];
        if (m->exact)
            rows_same &= bf16 ? memcmp(packed->dx16 + k * H, padded->dx16 + i * H, H * sizeof(uint16_t)) == 0
                              : memcmp(packed->dx + k * H, padded->dx + i * H, H * sizeof(float)) == 0;
        for (int64_t e = 0; e < H; e++) {
            dx_packed[k * H + e] = bf16 ? bf16_to_float(packed->dx16[k * H + e]) : packed->dx[k * H + e];
            dx_padded[k * H + e] = bf16 ? bf16_to_float(padded->dx16[i * H + e]) : padded->dx[i * H + e];
        }
    }
    const double dx = tu_norm_rel_f(dx_packed, dx_padded, (size_t)(b->n * H));
    TU_CHECK(rows_same && dx <= (bf16 ? 4e-3 : 1e-5), "%s: dx rows %s (%.3g apart)", m->what,
             rows_same ? "close" : "not the same bits", dx);
    float dw_packed[H * V], dw_padded[H * V];
    widen(packed, bf16, dw_packed);
    widen(padded, bf16, dw_padded);
    const double dw = tu_norm_rel_f(dw_packed, dw_padded, H * V), db = tu_norm_rel_f(packed->dbias, padded->dbias, V);
    TU_CHECK(dw <= (bf16 ? 4e-3 : SUMMATION_TOL) && db <= SUMMATION_TOL, "%s: dweight %.3g, dbias %.3g apart", m->what,
             dw, db);
}

/* The contexts the cases run on, batch-invariant (exact) ones first: blocks of 12 rows (whole sequences of up to 9
 * rows each, so the blocks' boundaries vary; a padded pair takes 18), of 40, the default tiles on two threads; then default contexts: the
 * default tiles on two threads, and tile_rows 5 (the longest sequence does not fit: streaming). */
enum { SCHEDULES = 5 };
static fh_context *schedule(int k, match *m)
{
    static const int64_t rows[SCHEDULES] = {20, 40, 0, 0, 5};
    const int two_threads = k == 2 || k == 3;
    fh_context *ctx = tu_context(two_threads ? 2 : 1, rows[k], two_threads ? 0 : 16, 0);
    m->exact = k < 3;
    if (m->exact)
        TU_CHECK(fh_context_set(ctx, FH_PARAM_BATCH_INVARIANT, 1) == FH_OK, "batch-invariant mode");
    return ctx;
}

/* The context's last message. */
static const char *message(const fh_context *ctx)
{
    const char *m = "";
    fh_context_message(ctx, &m);
    return m ? m : "";
}



/* What a call gave, as compare() reads it. */
typedef struct results {
    double loss;
    const void *metrics;
    size_t metrics_bytes;
    const float *sequence[2]; /* per-sequence outputs, or NULL */
    const float *token[4];    /* per-token outputs, or NULL */
    const gradients *d;       /* or NULL (a forward) */
} results;

static void compare(const match *m, const batch *b, const results *packed, const results *padded)
{
    TU_CHECK(same_value(m, packed->loss, padded->loss), "%s: loss %.17g against %.17g", m->what, packed->loss,
             padded->loss);
    TU_CHECK(same_doubles(m, packed->metrics, padded->metrics, packed->metrics_bytes), "%s: metrics differ", m->what);
    for (int k = 0; k < 2 && packed->sequence[k]; k++)
        TU_CHECK(same_floats(m, packed->sequence[k], padded->sequence[k], b->sequences),
                 "%s: per-sequence output %d differs", m->what, k);
    for (int k = 0; k < 4 && packed->token[k]; k++)
        TU_CHECK(same_rows(m, b, packed->token[k], padded->token[k], 1), "%s: per-token output %d differs", m->what, k);
    if (packed->d)
        check_gradients(m, b, packed->d, padded->d, b->x_bf16 != NULL);
}

/* One head's calls as the schedules run them: call() fills a run of the head (run: its own struct), results() views
 * it, adjust (or NULL) sets what the packed call cannot match (ORPO's and CPO's padded logits means) to the padded
 * call's. */
typedef struct head_calls {
    const char *name;
    const void *options;
    fh_status (*call)(fh_context *ctx, const batch *b, const void *options, int packed, int single, void *run);
    results (*results)(const void *run, int single);
    void (*adjust)(void *packed, const void *padded);
} head_calls;

/* The head's forward and single call on every schedule, packed against padded (two runs: packed, padded). */
static void run_schedules(const batch *b, const head_calls *h, void *packed, void *padded)
{
    for (int k = 0; k < SCHEDULES; k++)
        for (int single = 0; single < 2; single++) {
            char what[160];
            snprintf(what, sizeof what, "%s %s schedule %d %s", h->name, b->x_bf16 ? "bf16" : "fp32", k,
                     single ? "forward_backward" : "forward");
            match m = {0, what};
            fh_context *ctx = schedule(k, &m);
            const fh_status st_padded = h->call(ctx, b, h->options, 0, single, padded);
            const fh_status st_packed = h->call(ctx, b, h->options, 1, single, packed);
            TU_CHECK(st_padded == FH_OK && st_packed == FH_OK, "%s: status %d / %d (%s)", what, (int)st_padded,
                     (int)st_packed, message(ctx));
            if (h->adjust)
                h->adjust(packed, padded);
            const results p = h->results(packed, single), q = h->results(padded, single);
            compare(&m, b, &p, &q);
            fh_context_destroy(ctx);
        }
}

/* ---- GRPO ---------------------------------------------------------------------------------------- */

typedef struct grpo_run {
    double loss;
    fh_grpo_metrics metrics;
    float logp[MAX_SEQUENCES * T], per_token_loss[MAX_SEQUENCES * T], entropy[MAX_SEQUENCES * T];
    float lse[MAX_SEQUENCES * T];
    gradients d;
} grpo_run;

static fh_status grpo_call(fh_context *ctx, const batch *b, const void *options, int packed, int single, void *run)
{
    grpo_run *r = run;
    const fh_linear lin = linear_of(b, packed);
    const fh_grpo_batch bt = {b->sequences,
                              packed ? 0 : T,
                              packed ? b->packed_ids : b->ids,
                              packed ? b->packed_mask : b->mask,
                              b->per_sequence,
                              packed ? b->packed_token_a : b->token_a,
                              packed ? b->packed_token_b : b->token_b,
                              packed ? b->packed_token_b : b->token_b,
                              NULL,
                              packed ? b->cu : NULL};
    fh_grpo_outputs out = {&r->loss, &r->metrics, r->logp, r->per_token_loss, r->entropy, r->lse};
    gradients_init(&r->d, b->x_bf16 != NULL);
    const float grad = 1.0f;
    return single ? fh_grpo_forward_backward(ctx, &lin, &bt, options, &grad, &out, &r->d.g)
                  : fh_grpo_forward(ctx, &lin, &bt, options, &out);
}

static results grpo_results(const void *run, int single)
{
    const grpo_run *r = run;
    const results v = {r->loss, &r->metrics, sizeof r->metrics, {NULL, NULL},
                       {r->logp, r->entropy, r->lse, r->per_token_loss}, single ? &r->d : NULL};
    return v;
}

/* Every normalisation (per sequence, over the batch, dr_grpo's constant, a sequence's sum), the sequence-level
 * ratio, the sequence-mode importance sampling and the off-policy mask (per-sequence sums of the sampler's log-probs),
 * vespo's per-sequence weight, the entropy bonus, and a KL term. */
static void test_grpo(void)
{
    static const struct {
        fh_grpo_loss_type type;
        int sequence_level, is_mode, beta_kl, entropy_bonus;
        const char *name;
    } cases[] = {
        {FH_GRPO_LOSS_DAPO, 0, 0, 0, 0, "dapo"},
        {FH_GRPO_LOSS_GRPO, 0, 0, 1, 1, "grpo kl entropy"},
        {FH_GRPO_LOSS_BNPO, 1, 0, 0, 0, "bnpo gspo"},
        {FH_GRPO_LOSS_DR_GRPO, 0, 1, 0, 0, "dr_grpo sequence-mask"},
        {FH_GRPO_LOSS_LUSPO, 1, 1, 0, 0, "luspo gspo sequence-truncate"},
        {FH_GRPO_LOSS_VESPO, 0, 2, 0, 0, "vespo token-truncate"},
        {FH_GRPO_LOSS_SAPO, 0, 0, 0, 0, "sapo off-policy mask"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        fh_grpo_options o;
        fh_grpo_options_init(&o);
        o.loss_type = cases[c].type;
        o.importance_sampling_level = cases[c].sequence_level ? FH_GRPO_IS_SEQUENCE : FH_GRPO_IS_TOKEN;
        o.max_completion_length = T + 3;
        o.vllm_importance_sampling_correction = cases[c].is_mode != 0;
        o.vllm_importance_sampling_mode = cases[c].is_mode == 1 ? (cases[c].sequence_level ? FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE
                                                                                              : FH_GRPO_VLLM_IS_SEQUENCE_MASK)
                                                                 : FH_GRPO_VLLM_IS_TOKEN_TRUNCATE;
        o.beta = cases[c].beta_kl ? 0.04 : 0.0;
        o.entropy_coef = cases[c].entropy_bonus ? 0.01 : 0.0;
        if (cases[c].type == FH_GRPO_LOSS_SAPO)
            o.off_policy_mask_threshold = 0.5;
        static grpo_run packed, padded;
        const head_calls h = {cases[c].name, &o, grpo_call, grpo_results, NULL};
        for (int bf16 = 0; bf16 < 2; bf16++) {
            batch b;
            draw(&b, 7, 11 + c, bf16);
            run_schedules(&b, &h, &packed, &padded);
            release(&b);
        }
    }
}

/* ---- preference ---------------------------------------------------------------------------------- */

typedef struct preference_run {
    double loss;
    fh_preference_metrics metrics;
    float sequence_logps[MAX_SEQUENCES], rewards[MAX_SEQUENCES], logp[MAX_SEQUENCES * T];
    gradients d;
} preference_run;

static fh_status preference_call(fh_context *ctx, const batch *b, const void *options, int packed, int single,
                                 void *run)
{
    preference_run *r = run;
    const fh_preference_options *o = options;
    const fh_linear lin = linear_of(b, packed);
    const int dpo = o->loss == FH_PREFERENCE_DPO;
    const fh_preference_batch bt = {b->sequences / 2,
                                    packed ? 0 : T,
                                    packed ? b->packed_ids : b->ids,
                                    packed ? b->packed_mask : b->mask,
                                    NULL,
                                    dpo ? (packed ? b->packed_token_a : b->token_a) : NULL,
                                    packed ? b->cu : NULL};
    fh_preference_outputs out = {&r->loss, &r->metrics, r->sequence_logps, r->rewards, r->logp};
    gradients_init(&r->d, b->x_bf16 != NULL);
    const float grad = 1.0f;
    return single ? fh_preference_forward_backward(ctx, &lin, &bt, o, &grad, &out, &r->d.g)
                  : fh_preference_forward(ctx, &lin, &bt, o, &out);
}

static results preference_results(const void *run, int single)
{
    const preference_run *r = run;
    const results v = {r->loss, &r->metrics, sizeof r->metrics, {r->sequence_logps, r->rewards},
                       {r->logp, NULL, NULL, NULL}, single ? &r->d : NULL};
    return v;
}

/* TRL's logits means of ORPO and CPO (SimPO is CPO's) are over every padded position: not the packed ones. */
static void padded_logits(void *packed, const void *padded)
{
    preference_run *p = packed;
    const preference_run *q = padded;
    p->metrics.logits_chosen = q->metrics.logits_chosen;
    p->metrics.logits_rejected = q->metrics.logits_rejected;
}

static void test_preference(void)
{
    static const struct {
        fh_preference_loss loss;
        fh_preference_loss_type type;
        fh_preference_dpo_semantics semantics;
        const char *name;
    } cases[] = {
        {FH_PREFERENCE_DPO, FH_PREFERENCE_SIGMOID, FH_PREFERENCE_TRL_CURRENT, "dpo sigmoid"},
        {FH_PREFERENCE_DPO, FH_PREFERENCE_IPO, FH_PREFERENCE_TRL_CURRENT, "dpo ipo (averaged)"},
        {FH_PREFERENCE_DPO, FH_PREFERENCE_AOT, FH_PREFERENCE_TRL_CURRENT, "dpo aot (streams)"},
        {FH_PREFERENCE_DPO, FH_PREFERENCE_HINGE, FH_PREFERENCE_TRL_0_28, "dpo v0.28 hinge"},
        {FH_PREFERENCE_ORPO, FH_PREFERENCE_SIGMOID, FH_PREFERENCE_TRL_CURRENT, "orpo"},
        {FH_PREFERENCE_SIMPO, FH_PREFERENCE_SIGMOID, FH_PREFERENCE_TRL_CURRENT, "simpo"},
        {FH_PREFERENCE_CPO, FH_PREFERENCE_SIGMOID, FH_PREFERENCE_TRL_CURRENT, "cpo"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            fh_preference_options o;
            fh_preference_options_init(&o);
            o.loss = cases[c].loss;
            o.loss_type = cases[c].type;
            o.dpo_semantics = cases[c].semantics;
            batch b;
            draw(&b, 8, 40 + c, bf16);
            static preference_run packed, padded;
            const head_calls h = {cases[c].name, &o, preference_call, preference_results,
                                  o.loss != FH_PREFERENCE_DPO ? padded_logits : NULL};
            run_schedules(&b, &h, &packed, &padded);
            release(&b);
        }
}

/* ---- KTO ----------------------------------------------------------------------------------------- */

typedef struct kto_run {
    double loss;
    fh_kto_metrics metrics;
    float sequence_logps[MAX_SEQUENCES], rewards[MAX_SEQUENCES], logp[MAX_SEQUENCES * T];
    gradients d;
} kto_run;

static fh_status kto_call(fh_context *ctx, const batch *b, const void *options, int packed, int single, void *run)
{
    kto_run *r = run;
    const fh_kto_options *o = options;
    const fh_linear lin = linear_of(b, packed);
    const int kto = o->loss_type == FH_KTO_LOSS_KTO;
    const fh_kto_batch bt = {b->sequences,
                             packed ? 0 : T,
                             packed ? b->packed_ids : b->ids,
                             packed ? b->packed_mask : b->mask,
                             b->labels,
                             NULL,
                             packed ? b->packed_token_a : b->token_a,
                             NULL,
                             kto ? b->per_sequence : NULL,
                             packed ? b->cu : NULL};
    fh_kto_outputs out = {&r->loss, &r->metrics, r->sequence_logps, r->rewards, r->logp};
    gradients_init(&r->d, b->x_bf16 != NULL);
    const float grad = 1.0f;
    return single ? fh_kto_forward_backward(ctx, &lin, &bt, o, &grad, &out, &r->d.g)
                  : fh_kto_forward(ctx, &lin, &bt, o, &out);
}

static results kto_results(const void *run, int single)
{
    const kto_run *r = run;
    const results v = {r->loss, &r->metrics, sizeof r->metrics, {r->sequence_logps, r->rewards},
                       {r->logp, NULL, NULL, NULL}, single ? &r->d : NULL};
    return v;
}

static void test_kto(void)
{
    for (int type = 0; type < 2; type++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            fh_kto_options o;
            fh_kto_options_init(&o);
            o.loss_type = type ? FH_KTO_LOSS_APO_ZERO_UNPAIRED : FH_KTO_LOSS_KTO;
            o.desirable_weight = 1.3;
            batch b;
            draw(&b, 7, 70 + (uint64_t)type, bf16);
            static kto_run packed, padded;
            const head_calls h = {type ? "kto apo_zero_unpaired" : "kto", &o, kto_call, kto_results, NULL};
            run_schedules(&b, &h, &packed, &padded);
            release(&b);
        }
}

/* ---- refusals ------------------------------------------------------------------------------------ */

/* Each bad packing gets FH_ERR_INVALID_SIZE (dr_grpo's missing constant FH_ERR_INVALID_GRPO_OPTION), a message
 * naming it, and leaves the loss untouched. */
static void test_refusals(void)
{
    batch b;
    draw(&b, 4, 90, 0);
    const fh_linear lin = linear_of(&b, 1);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    static const struct {
        int64_t cu[5], seq;
        int dr_grpo;
        const char *word;
    } bad[] = {
        {{1, 0, 0, 0, 0}, 0, 0, "cu_seqlens[0]"},  /* the offsets start at 1 (fixed below to keep the rest) */
        {{0, 3, 3, 0, 0}, 0, 0, "every sequence"}, /* an empty sequence */
        {{0, 3, 2, 0, 0}, 0, 0, "every sequence"}, /* decreasing */
        {{0, 1, 2, 3, 0}, 0, 0, "must equal n"},   /* ends before n */
        {{0, 0, 0, 0, 0}, T, 0, "seq"},            /* seq given */
        {{0, 0, 0, 0, 0}, 0, 1, "max_completion_length"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        int64_t cu[5];
        memcpy(cu, b.cu, sizeof cu);
        if (c < 4) {
            memcpy(cu, bad[c].cu, sizeof cu);
            if (c == 0)
                cu[1] = b.cu[1], cu[2] = b.cu[2], cu[3] = b.cu[3], cu[4] = b.cu[4];
            if (c == 1 || c == 2)
                cu[3] = b.cu[3], cu[4] = b.cu[4];
            if (c == 3)
                cu[4] = b.n - 1;
        }
        fh_grpo_options o;
        fh_grpo_options_init(&o);
        if (bad[c].dr_grpo)
            o.loss_type = FH_GRPO_LOSS_DR_GRPO;
        const fh_grpo_batch bt = {4, bad[c].seq, b.packed_ids, b.packed_mask, b.per_sequence, NULL, NULL, NULL,
                                  NULL, cu};
        double loss = 12345.0;
        fh_grpo_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL};
        const fh_status st = fh_grpo_forward(ctx, &lin, &bt, &o, &out);
        const fh_status expected = bad[c].dr_grpo ? FH_ERR_INVALID_GRPO_OPTION : FH_ERR_INVALID_SIZE;
        TU_CHECK(st == expected && loss == 12345.0 && strstr(message(ctx), bad[c].word),
                 "bad packing %zu: status %d (%s), loss %g", c, (int)st, message(ctx), loss);
    }
    /* The same offsets go through the preference and KTO checks (one case each). */
    int64_t cu[5] = {0, b.cu[1], b.cu[1], b.cu[3], b.n};
    const fh_preference_batch pb = {2, 0, b.packed_ids, b.packed_mask, NULL, NULL, cu};
    fh_preference_options po;
    fh_preference_options_init(&po);
    double loss = 12345.0;
    fh_preference_outputs pout = {&loss, NULL, NULL, NULL, NULL};
    TU_CHECK(fh_preference_forward(ctx, &lin, &pb, &po, &pout) == FH_ERR_INVALID_SIZE && loss == 12345.0,
             "preference: an empty packed sequence is not refused");
    const fh_kto_batch kb = {4, 0, b.packed_ids, b.packed_mask, b.labels, b.per_sequence, NULL, NULL, NULL, cu};
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    ko.loss_type = FH_KTO_LOSS_APO_ZERO_UNPAIRED;
    fh_kto_outputs kout = {&loss, NULL, NULL, NULL, NULL};
    TU_CHECK(fh_kto_forward(ctx, &lin, &kb, &ko, &kout) == FH_ERR_INVALID_SIZE && loss == 12345.0,
             "kto: an empty packed sequence is not refused");
    fh_context_destroy(ctx);
    release(&b);
}

static const tu_test tests[] = {
    {"grpo: every normalisation and per-sequence value, packed = padded", test_grpo},
    {"preference: dpo (current, v0.28), orpo, simpo, cpo, packed = padded", test_preference},
    {"kto: both loss types, packed = padded", test_kto},
    {"bad packings refused, outputs untouched", test_refusals},
};
const tu_suite suite_packed = {tests, TU_COUNT(tests)};
