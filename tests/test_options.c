/* Options: each loss option alone and all together, under every reduction, gradient beta 0 (buffers
 * pre-filled with NaN must be overwritten) and 1 (accumulate onto 1.0), both weight layouts, separate
 * forward + backward calls and the single-call train step (row blocks of 8 rows, and its streaming fallback under a
 * small budget for logit_scale and DFT); the entropy and correct-count outputs beside logit_scale and DFT.
 * Tolerances: ce_metrics_pass (justified in tests/cases/ce_case.c; with token_scaling CE_DFT_REL_TOL is added to the loss's
 * and the gradients', the entropy's is CE_ENTROPY_ABS_TOL). */
#include "ce_harness.h"

#include <math.h>
#include <stdio.h>

typedef struct option_set {
    const char *name;
    double ignore_frac, label_smoothing;
    int class_weights;
    double softcap, z_loss, logit_scale; /* logit_scale: the inputs' typical |x W| (ce_case_spec) */
    double ce_logit_scale;               /* fh_ce_options.logit_scale (0: 1) */
    int token_scaling, entropy;
} option_set;

/* softcap 2 with logits of size ~4 puts tanh well into its nonlinear range; z_loss 1e-2 with lse ~ 5
 * makes the z-loss part ~0.25 of a ~3 loss. logit_scale 0.4 flattens logits of size 3 to ~1.2, 2.5 sharpens them to
 * ~7.5, which softcap 4 then caps (m u / c ~ 2). DFT's factors p_y spread over (0, 1) with logits of size 3 on 37
 * classes. */
static const option_set sets[] = {
    {"plain", 0, 0, 0, 0, 0, 3, 0, 0, 0},
    {"ignore_index", 0.3, 0, 0, 0, 0, 3, 0, 0, 0},
    {"label_smoothing", 0, 0.1, 0, 0, 0, 3, 0, 0, 0},
    {"label_smoothing 1", 0, 1.0, 0, 0, 0, 3, 0, 0, 0},
    {"class_weights", 0, 0, 1, 0, 0, 3, 0, 0, 0},
    {"softcap", 0, 0, 0, 2.0, 0, 4, 0, 0, 0},
    {"z_loss", 0, 0, 0, 0, 1e-2, 3, 0, 0, 0},
    {"all options", 0.3, 0.1, 1, 2.0, 1e-2, 4, 0, 0, 0},
    {"logit_scale 0.4, entropy", 0.3, 0, 0, 0, 0, 3, 0.4, 0, 1},
    {"logit_scale 2.5 and softcap 4, entropy", 0, 0, 0, 4.0, 0, 3, 2.5, 0, 1},
    {"token_scaling (DFT)", 0.3, 0, 0, 0, 0, 3, 0, 1, 0},
    {"DFT with every option, entropy", 0.3, 0.1, 1, 2.0, 1e-2, 4, 1.5, 1, 1},
};
enum { PLAIN, IGNORE, SMOOTHING, SMOOTHING_ONE, CLASS_WEIGHTS, SOFTCAP, Z_LOSS, ALL, SCALE, SCALE_SOFTCAP, DFT,
       DFT_ALL };

static ce_case_spec spec_of(const option_set *o, fh_reduction reduction, fh_layout layout, float beta,
                            int train_step, uint64_t seed)
{
    ce_case_spec s;
    ce_case_spec_default(&s);
    s.n = 37;
    s.hidden = 13;
    s.vocab = 37;
    s.tile_rows = 8;
    s.tile_vocab = 16;
    s.bias = 1;
    s.layout = layout;
    s.threads = layout == FH_LAYOUT_HV ? 1 : 2;
    s.reduction = reduction;
    s.grad_beta = beta;
    s.train_step = train_step;
    s.seed = seed;
    s.ignore_frac = o->ignore_frac;
    s.label_smoothing = o->label_smoothing;
    s.class_weights = o->class_weights;
    s.softcap = o->softcap;
    s.z_loss = o->z_loss;
    s.logit_scale = o->logit_scale;
    s.ce_logit_scale = o->ce_logit_scale;
    s.token_scaling = o->token_scaling;
    s.entropy = o->entropy;
    return s;
}

static double reference_loss(const ce_case_spec *s)
{
    ce_case c;
    ce_metrics m;
    const fh_status st = ce_case_run(s, &c, &m);
    const double loss = st == FH_OK ? c.ref_loss : NAN;
    ce_case_free(&c);
    return loss;
}

static void run_set(int index)
{
    const option_set *o = &sets[index];
    const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};
    const float betas[] = {0.0f, 1.0f};
    uint64_t seed = 1000 * (uint64_t)(index + 1);
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (size_t b = 0; b < TU_COUNT(betas); b++)
            for (int variant = 0; variant < 4; variant++) {
                const ce_case_spec s = spec_of(o, reductions[r], (fh_layout)(variant & 1), betas[b], variant >> 1, seed++);
                cp_check_spec(&s, o->name);
            }
    /* Guards the table: the option must move the loss (> 1e-3 relative from the same case with the
     * options off), so that the comparisons above exercise it. */
    if (index != PLAIN) {
        const ce_case_spec with = spec_of(o, FH_REDUCTION_SUM, FH_LAYOUT_HV, 0.0f, 0, 7);
        const option_set off = {"off", 0, 0, 0, 0, 0, o->logit_scale, 0, 0, 0};
        const ce_case_spec without = spec_of(&off, FH_REDUCTION_SUM, FH_LAYOUT_HV, 0.0f, 0, 7);
        const double a = reference_loss(&with), b = reference_loss(&without);
        TU_CHECK(fabs(a - b) > 1e-3 * fabs(b), "%s: the option does not change the loss (%.17g vs %.17g)", o->name,
                 a, b);
    }
}

static void test_plain(void) { run_set(PLAIN); }
static void test_ignore_index(void) { run_set(IGNORE); }
static void test_label_smoothing(void) { run_set(SMOOTHING); }
static void test_label_smoothing_one(void) { run_set(SMOOTHING_ONE); }
static void test_class_weights(void) { run_set(CLASS_WEIGHTS); }
static void test_softcap(void) { run_set(SOFTCAP); }
static void test_z_loss(void) { run_set(Z_LOSS); }
static void test_all_options(void) { run_set(ALL); }
static void test_logit_scale(void) { run_set(SCALE); }
static void test_logit_scale_softcap(void) { run_set(SCALE_SOFTCAP); }
static void test_dft(void) { run_set(DFT); }
static void test_dft_all(void) { run_set(DFT_ALL); }

/* The train step's streaming fallback (a 4 KiB budget holds no block of the 37 rows x 37 columns) with logit_scale,
 * DFT and the entropy, under every reduction and both layouts: the fallback's forward, then its backward from the
 * forward's statistics. */
static void test_streaming_fallback(void)
{
    const int sets_in_fallback[] = {SCALE_SOFTCAP, DFT_ALL};
    const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};
    uint64_t seed = 90000;
    for (size_t k = 0; k < TU_COUNT(sets_in_fallback); k++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++)
            for (int layout = 0; layout < 2; layout++) {
                ce_case_spec s = spec_of(&sets[sets_in_fallback[k]], reductions[r], (fh_layout)layout, 0.0f, 1, seed++);
                s.budget = 4096;
                cp_check_spec(&s, "streaming fallback");
            }
}

/* The correct count is the number of tokens, ignored ones aside, whose argmax is their target: on logits chosen so
 * that the count is known (row i's largest logit at column i % 3; targets i % 3 on even rows, (i + 1) % 3 on odd
 * ones, row 4 ignored), through every entry point's schedule and with the argmax output left out. */
static void test_correct_count(void)
{
    enum { N = 9, V = 5 };
    float logits[N * V];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < V; j++)
            logits[i * V + j] = j == i % 3 ? 2.0f : -0.25f * (float)j;
    for (int train_step = 0; train_step < 2; train_step++) {
        cp_problem p;
        cp_problem_from_logits(&p, N, V, FH_LAYOUT_HV, logits);
        for (int i = 0; i < N; i++)
            p.targets[i] = i % 2 == 0 ? i % 3 : (i + 1) % 3;
        p.targets[4] = p.options.ignore_index;
        /* Even rows 0, 2, 6, 8 are right (row 4 is ignored); odd rows are wrong. */
        const int64_t expected = 4;
        const cp_config cfg = {.threads = 2, .train_step = train_step};
        cp_fused f;
        cp_reference r;
        if (cp_run_fused_and_reference(&p, &cfg, "correct count", &f, &r)) {
            TU_CHECK(f.correct == expected && r.correct == expected, "train_step %d: correct %lld, reference %lld, "
                     "expected %lld", train_step, (long long)f.correct, (long long)r.correct, (long long)expected);
            cp_fused_free(&f);
            cp_reference_free(&r);
        }
        /* Only the count asked for: the argmax statistic is folded for it alone. */
        fh_context *ctx = cp_context(&cfg);
        fh_linear lin;
        cp_problem_linear(&p, &lin);
        int64_t correct = -1;
        fh_ce_outputs out = {.correct = &correct};
        TU_CHECK(fh_ce_forward(ctx, &lin, p.targets, &p.options, &out) == FH_OK && correct == expected,
                 "correct alone: %lld, expected %lld", (long long)correct, (long long)expected);
        fh_context_destroy(ctx);
        cp_problem_free(&p);
    }
}

/* Class weights may be 0 (only negative or non-finite ones are invalid): half the classes weighted 0,
 * including some targets, with label smoothing so that the smoothing term sees the zeros too. */
static void test_zero_class_weights(void)
{
    const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};
    for (size_t r = 0; r < TU_COUNT(reductions); r++) {
        cp_problem p;
        cp_problem_init(&p, 21, 6, 33, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
        p.options.reduction = reductions[r];
        p.options.label_smoothing = 0.2;
        cp_problem_randomize(&p, 50 + r, 3.0);
        for (int64_t j = 0; j < p.vocab; j += 2)
            p.class_weights[j] = 0.0f;
        p.targets[0] = 0; /* weight 0 */
        p.targets[1] = 1; /* weight > 0, so that the mean has a denominator */
        for (int train_step = 0; train_step <= 1; train_step++) {
            const cp_config cfg = {.threads = 1, .tile_rows = 8, .tile_vocab = 16, .train_step = train_step};
            cp_check_against_reference(&p, &cfg, "zero class weights");
        }
        cp_problem_free(&p);
    }
}

static const tu_test tests[] = {
    {"plain", test_plain},
    {"ignore_index (30% ignored)", test_ignore_index},
    {"label_smoothing 0.1", test_label_smoothing},
    {"label_smoothing 1", test_label_smoothing_one},
    {"class_weights", test_class_weights},
    {"softcap", test_softcap},
    {"z_loss", test_z_loss},
    {"all options together", test_all_options},
    {"logit_scale 0.4, entropy", test_logit_scale},
    {"logit_scale 2.5 with softcap 4, entropy", test_logit_scale_softcap},
    {"token_scaling (DFT)", test_dft},
    {"DFT with every option, entropy", test_dft_all},
    {"logit_scale, DFT and entropy in the train step's streaming fallback", test_streaming_fallback},
    {"correct count", test_correct_count},
    {"zero class weights", test_zero_class_weights},
};
const tu_suite suite_options = {tests, TU_COUNT(tests)};
