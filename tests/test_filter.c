/* Gradient filtering (FH_PARAM_GRAD_FILTER_EPS) against the double reference filtered the same way
 * (ref/ref_filter.c: the softmax part of dU replaced by the tail estimate on the columns the call's tiles drop, the
 * target and c w terms kept), at the unfiltered tolerances of tests/cases/ce_case.c: filtering changes what is computed, not how
 * accurately, so any term dropped or applied twice shows. The inputs are peaked (logits of typical size 10), the
 * row tiles 64 rows and eps 1e-3, so that most columns are dropped and a sizeable part kept (about 600 of a row
 * block's 5003, more than one gathered chunk of FH_FILTER_CHUNK): each case asserts that the skipped fraction of
 * the gradient GEMMs' flops is between 5% and 95%, so that both paths run. */
#include "ce_case.h"
#include "ce_harness.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>

static ce_case_spec filter_spec(fh_layout layout, int train_step)
{
    ce_case_spec s;
    ce_case_spec_default(&s);
    s.n = 257;
    s.hidden = 67;
    s.vocab = 5003;
    s.layout = layout;
    s.train_step = train_step;
    s.logit_scale = 10.0;
    s.tile_rows = 64;
    s.tile_vocab = 2048;
    s.grad_filter_eps = 1e-3;
    s.seed = 5;
    return s;
}

/* Runs the spec, asserts it passes against the filtered reference and that filtering skipped between min_skip and
 * max_skip of the gradient GEMMs' flops. */
static void check_skipping(const ce_case_spec *s, const char *label, double min_skip, double max_skip)
{
    fh_filter_stats stats = {0.0, 0.0};
    if (!cp_check_spec_stats(s, label, &stats))
        return;
    const double skipped = stats.skipped_flops / stats.gradient_flops;
    TU_CHECK(skipped >= min_skip && skipped <= max_skip, "%s (eps %g): %.4f of the gradient flops skipped", label,
             s->grad_filter_eps, skipped);
}

/* The same with at most 95% skipped, so that the kept columns' GEMMs run too. */
static void check_filtered(const ce_case_spec *s, const char *label, double min_skip)
{
    check_skipping(s, label, min_skip, 0.95);
}

static void test_fp32_options(void)
{
    for (int layout = 0; layout < 2; layout++)
        for (int train_step = 0; train_step < 2; train_step++) {
            ce_case_spec s = filter_spec((fh_layout)layout, train_step);
            check_filtered(&s, "no options", 0.05);
            s.label_smoothing = 0.1; /* the rank-one c w term */
            s.class_weights = 1;
            s.bias = 1;
            s.ignore_frac = 0.1;
            check_filtered(&s, "label smoothing, class weights, bias, ignored tokens", 0.05);
            s.label_smoothing = 0.0;
            s.class_weights = 0;
            s.z_loss = 1e-3;
            s.reduction = FH_REDUCTION_NONE;
            s.grad_beta = 1.0f;
            check_filtered(&s, "z-loss, reduction none, beta 1", 0.05);
            s.z_loss = 0.0;
            s.softcap = 30.0;
            check_filtered(&s, "softcap (no c term: filtered)", 0.05);
            s.label_smoothing = 0.1;
            check_filtered(&s, "softcap and label smoothing (c w is not rank one: nothing skipped)", 0.0);
            s.label_smoothing = 0.0;
            s.ce_logit_scale = 1.5;
            s.token_scaling = 1;
            check_filtered(&s, "logit_scale 1.5 under softcap 30 (the transform's scale in dz/du), DFT", 0.05);
        }
}

/* Beta 1 with the c term: dweight columns that only the rank-one term reaches are added to, not overwritten. */
static void test_fp32_accumulate_c_term(void)
{
    ce_case_spec s = filter_spec(FH_LAYOUT_VH, 1);
    s.label_smoothing = 0.2;
    s.class_weights = 1;
    s.grad_beta = 1.0f;
    s.grad_filter_eps = 0.01;
    check_filtered(&s, "label smoothing 0.2, beta 1, eps 0.01", 0.3);
    s.train_step = 0;
    check_filtered(&s, "the same, streaming", 0.3);
}

/* bf16: dU rounded to bf16 and gathered in chunks padded to powers of two (oneDNN primitives made ready up front);
 * in row blocks dx goes through its f32 block buffer and dweight is one product over every row after the blocks,
 * dropping only the columns that every row block drops. */
static void test_bf16(void)
{
    for (int layout = 0; layout < 2; layout++)
        for (int train_step = 0; train_step < 2; train_step++)
            for (int grads = 0; grads < 2; grads++) {
                ce_case_spec s = filter_spec((fh_layout)layout, train_step);
                s.dtype = FH_DTYPE_BF16;
                s.grad_dtype = grads ? FH_DTYPE_BF16 : FH_DTYPE_F32;
                check_filtered(&s, "bf16", 0.05);
                s.label_smoothing = 0.1;
                s.class_weights = 1;
                s.grad_beta = 1.0f;
                check_filtered(&s, "bf16, label smoothing, class weights, beta 1", 0.05);
            }
    ce_case_spec s = filter_spec(FH_LAYOUT_HV, 1);
    s.dtype = FH_DTYPE_BF16;
    s.fp32_du = 1; /* streams, with f32 GEMMs on gathered f32 copies of the bf16 weight */
    s.label_smoothing = 0.1;
    check_filtered(&s, "bf16 inputs, fp32 dU", 0.05);
}

/* Tiles that keep every column run the unfiltered GEMMs in place, beside tiles that keep some (a small vocabulary
 * and a moderate eps give both: about half the tiles here): dweight columns then written by one and added to by the other, in both schedules,
 * fp32 and bf16; and an eps below every entry keeps every tile whole. */
static void test_all_kept_tiles(void)
{
    for (int dtype = 0; dtype < 2; dtype++)
        for (int train_step = 0; train_step < 2; train_step++) {
            ce_case_spec s = filter_spec(FH_LAYOUT_VH, train_step);
            s.dtype = dtype ? FH_DTYPE_BF16 : FH_DTYPE_F32;
            s.vocab = 7;
            s.logit_scale = 3.0;
            s.tile_rows = 4;
            s.grad_filter_eps = 0.05;
            /* 7.6% skipped, 3.8% in bf16 row blocks (dweight after the blocks drops a column only where every
             * block did) */
            check_filtered(&s, dtype ? "bf16, some tiles whole, some filtered" : "some tiles whole, some filtered",
                           0.02);
            s.grad_filter_eps = 1e-30;
            check_filtered(&s, dtype ? "bf16, eps below every entry" : "eps below every entry", 0.0);
        }
}

/* The tail estimate (the default) and FH_FILTER_TAIL_DROP, each against the reference filtered the same way, with
 * a heavy tail (logits of typical size 2, eps 0.03: most of a row's softmax mass is in the skipped columns), so
 * that an estimate off by a factor shows beyond the tolerances: in bf16 row blocks, estimating the columns every
 * block skipped from the last block's magnitudes alone gives a dweight 1.2e-2 off against 3.0e-3 (tolerance 8e-3).
 * Both schedules, fp32 and bf16 (row blocks with dweight after the blocks); the estimate with and without the
 * c w term. Half filter_spec's rows, in 32-row tiles (five row blocks), to keep it short under the sanitizers. */
static void test_tail(void)
{
    for (int dtype = 0; dtype < 2; dtype++)
        for (int train_step = 0; train_step < 2; train_step++) {
            ce_case_spec s = filter_spec(FH_LAYOUT_VH, train_step);
            s.n = 129;
            s.tile_rows = 32;
            s.dtype = s.grad_dtype = dtype ? FH_DTYPE_BF16 : FH_DTYPE_F32;
            s.logit_scale = 2.0;
            s.grad_filter_eps = 0.03;
            s.grad_filter_tail = FH_FILTER_TAIL_DROP;
            check_skipping(&s, "heavy tail, dropped", 0.5, 0.995);
            s.grad_filter_tail = FH_FILTER_TAIL_ESTIMATE;
            check_skipping(&s, "heavy tail, estimated", 0.5, 0.995);
            s.label_smoothing = 0.1;
            s.layout = FH_LAYOUT_HV;
            check_skipping(&s, "heavy tail, estimated, c w term, [H, V]", 0.5, 0.995);
        }
}

/* The message of ctx's last failure names word. */
static int message_names(const fh_context *ctx, const char *word)
{
    const char *msg = NULL;
    return fh_context_message(ctx, &msg) == FH_OK && msg && tu_mentions(msg, word);
}

/* The two settings go through the one parameter interface: eps (real) through fh_context_set_real, the tail
 * (integer) through fh_context_set. Each refuses the other kind's entry points, values outside its bounds and NaN,
 * and keeps what it had. */
static void test_params(void)
{
    fh_context *ctx = tu_context(1, 0, 0, 0);
    const fh_param eps_param = FH_PARAM_GRAD_FILTER_EPS, tail_param = FH_PARAM_GRAD_FILTER_TAIL;
    double lo = -1.0, hi = -1.0, eps = -1.0;
    TU_CHECK(fh_param_real_bounds(eps_param, &lo, &hi) == FH_OK && lo == 0.0 && hi == nextafter(1.0, 0.0),
             "eps bounds [%g, %.17g]: [0, 1) as the largest double below 1", lo, hi);
    TU_CHECK(fh_context_get_real(ctx, eps_param, &eps) == FH_OK && eps == 0.0, "eps is 0 (off) by default: %g", eps);
    TU_CHECK(fh_context_set_real(ctx, eps_param, hi) == FH_OK && fh_context_set_real(ctx, eps_param, lo) == FH_OK,
             "both bounds are taken");
    TU_CHECK(fh_context_set_real(ctx, eps_param, 0x1p-12) == FH_OK, "2^-12 is taken");
    TU_CHECK(fh_context_get_real(ctx, eps_param, &eps) == FH_OK && eps == 0x1p-12, "and read back: %g", eps);
    const double bad[] = {-1e-9, -INFINITY, 1.0, 1.5, INFINITY, NAN};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        TU_CHECK(fh_context_set_real(ctx, eps_param, bad[k]) == FH_ERR_INVALID_PARAM_VALUE, "eps %g is refused",
                 bad[k]);
        TU_CHECK(message_names(ctx, "grad_filter_eps"), "eps %g: the message names the parameter", bad[k]);
        TU_CHECK(fh_context_get_real(ctx, eps_param, &eps) == FH_OK && eps == 0x1p-12,
                 "a refused eps %g leaves 2^-12: %g", bad[k], eps);
    }

    fh_filter_tail tail_values[2] = {FH_FILTER_TAIL_ESTIMATE, FH_FILTER_TAIL_DROP};
    int64_t ilo = -1, ihi = -1, tail = -1;
    TU_CHECK(fh_param_bounds(tail_param, &ilo, &ihi) == FH_OK && ilo == tail_values[0] && ihi == tail_values[1],
             "tail bounds [%lld, %lld]: the enum's range", (long long)ilo, (long long)ihi);
    TU_CHECK(fh_context_get(ctx, tail_param, &tail) == FH_OK && tail == FH_FILTER_TAIL_ESTIMATE,
             "the tail is estimated by default");
    TU_CHECK(fh_context_set(ctx, tail_param, 2) == FH_ERR_INVALID_PARAM_VALUE &&
                 fh_context_set(ctx, tail_param, -1) == FH_ERR_INVALID_PARAM_VALUE,
             "an unknown tail mode is refused");
    TU_CHECK(message_names(ctx, "grad_filter_tail"), "the message names the parameter");
    TU_CHECK(fh_context_get(ctx, tail_param, &tail) == FH_OK && tail == FH_FILTER_TAIL_ESTIMATE,
             "and leaves the mode as it was");
    TU_CHECK(fh_context_set(ctx, tail_param, FH_FILTER_TAIL_DROP) == FH_OK &&
                 fh_context_get(ctx, tail_param, &tail) == FH_OK && tail == FH_FILTER_TAIL_DROP,
             "FH_FILTER_TAIL_DROP is taken and read back");

    /* The wrong kind is FH_ERR_INVALID_PARAM, says which entry point to use, and changes nothing. */
    int64_t ivalue = 77;
    double dvalue = 77.0;
    TU_CHECK(fh_context_set(ctx, eps_param, 0) == FH_ERR_INVALID_PARAM, "fh_context_set on eps");
    TU_CHECK(message_names(ctx, "real-valued") && message_names(ctx, "fh_context_set_real"),
             "the message says eps is real-valued and names fh_context_set_real");
    TU_CHECK(fh_context_get(ctx, eps_param, &ivalue) == FH_ERR_INVALID_PARAM && ivalue == 77, "fh_context_get on eps");
    TU_CHECK(fh_param_bounds(eps_param, &ilo, &ihi) == FH_ERR_INVALID_PARAM, "fh_param_bounds on eps");
    const fh_param integers[] = {tail_param, FH_PARAM_THREADS, FH_PARAM_OVERSUBSCRIBE, FH_PARAM_BATCH_INVARIANT};
    for (size_t k = 0; k < sizeof integers / sizeof integers[0]; k++) {
        TU_CHECK(fh_context_set_real(ctx, integers[k], 0.0) == FH_ERR_INVALID_PARAM, "set_real on %d",
                 (int)integers[k]);
        TU_CHECK(message_names(ctx, "integer-valued"), "param %d: the message says it is integer-valued",
                 (int)integers[k]);
        TU_CHECK(fh_context_get_real(ctx, integers[k], &dvalue) == FH_ERR_INVALID_PARAM && dvalue == 77.0,
                 "get_real on %d", (int)integers[k]);
        TU_CHECK(fh_param_real_bounds(integers[k], &lo, &hi) == FH_ERR_INVALID_PARAM, "real bounds of %d",
                 (int)integers[k]);
    }
    const fh_param unknown[] = {(fh_param)(FH_PARAM_BATCH_INVARIANT + 1), (fh_param)-1, (fh_param)1000}; /* past the last */
    for (size_t k = 0; k < sizeof unknown / sizeof unknown[0]; k++)
        TU_CHECK(fh_context_set_real(ctx, unknown[k], 0.0) == FH_ERR_INVALID_PARAM &&
                     fh_context_get_real(ctx, unknown[k], &dvalue) == FH_ERR_INVALID_PARAM &&
                     fh_param_real_bounds(unknown[k], &lo, &hi) == FH_ERR_INVALID_PARAM,
                 "unknown parameter %d", (int)unknown[k]);
    TU_CHECK(fh_context_get_real(ctx, eps_param, &eps) == FH_OK && eps == 0x1p-12 &&
                 fh_context_get(ctx, tail_param, &tail) == FH_OK && tail == FH_FILTER_TAIL_DROP,
             "the wrong kind changed nothing: eps %g, tail %lld", eps, (long long)tail);

    TU_CHECK(fh_context_set_real(NULL, eps_param, 0.0) == FH_ERR_NULL_POINTER &&
                 fh_context_get_real(NULL, eps_param, &eps) == FH_ERR_NULL_POINTER &&
                 fh_context_get_real(ctx, eps_param, NULL) == FH_ERR_NULL_POINTER,
             "NULL context or value");
    TU_CHECK(fh_param_real_bounds(eps_param, NULL, &hi) == FH_ERR_NULL_POINTER &&
                 fh_param_real_bounds(eps_param, &lo, NULL) == FH_ERR_NULL_POINTER,
             "NULL bounds");
    fh_context_destroy(ctx);
}

/* The statistics of the last call. */
static void test_contract(void)
{
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_filter_stats stats;
    TU_CHECK(fh_context_filter_stats(ctx, NULL) == FH_ERR_NULL_POINTER, "NULL stats");
    TU_CHECK(fh_context_filter_stats(ctx, &stats) == FH_OK && stats.gradient_flops == 0.0 && stats.skipped_flops == 0.0,
             "a fresh context has done no work");

    /* eps 0: the dense work of the split backward (4 N H V) and of the train step, nothing skipped; a forward
     * resets the counts to 0. */
    enum { N = 33, H = 16, V = 700 };
    cp_problem p;
    cp_problem_init(&p, N, H, V, FH_LAYOUT_HV, 0);
    cp_problem_randomize(&p, 3, 3.0);
    TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0.0) == FH_OK, "eps 0");
    for (int train_step = 0; train_step < 2; train_step++) {
        const cp_config cfg = {1, 0, 0, 0, 0.0f, train_step};
        cp_fused f;
        TU_CHECK(cp_run_fused_on(ctx, &p, &cfg, &f) == FH_OK, "call");
        fh_context_filter_stats(ctx, &stats);
        TU_CHECK(stats.gradient_flops == 4.0 * N * H * V && stats.skipped_flops == 0.0,
                 "train step %d: %g gradient flops (expected %g), %g skipped", train_step, stats.gradient_flops,
                 4.0 * N * H * V, stats.skipped_flops);
        cp_fused_free(&f);
    }
    fh_linear lin;
    cp_problem_linear(&p, &lin);
    double loss;
    fh_ce_outputs out = {.loss = &loss};
    TU_CHECK(fh_ce_forward(ctx, &lin, p.targets, &p.options, &out) == FH_OK, "forward");
    fh_context_filter_stats(ctx, &stats);
    TU_CHECK(stats.gradient_flops == 0.0, "a forward has no gradient work: %g", stats.gradient_flops);
    cp_problem_free(&p);
    fh_context_destroy(ctx);
}

/* With filtering on, the queried workspace handed in by the caller serves the call exactly. */
static void test_queried_workspace(void)
{
    for (int train_step = 0; train_step < 2; train_step++) {
        cp_problem p;
        cp_problem_init(&p, 70, 24, 1500, FH_LAYOUT_VH, CP_BIAS);
        cp_problem_randomize(&p, 8, 10.0);
        fh_context *ctx = tu_context(1, 8, 600, 0);
        TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0.02) == FH_OK, "eps");
        fh_linear lin;
        cp_problem_linear(&p, &lin);
        size_t bytes = 0;
        const fh_status q = train_step ? fh_ce_forward_backward_workspace_size(ctx, &lin, &p.options, &bytes)
                                       : fh_ce_workspace_size(ctx, &lin, &p.options, &bytes);
        TU_CHECK(q == FH_OK, "query");
        void *ws = malloc(bytes);
        TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "caller workspace of %zu bytes", bytes);
        const cp_config cfg = {1, 8, 600, 0, 0.0f, train_step};
        cp_fused f;
        TU_CHECK(cp_run_fused_on(ctx, &p, &cfg, &f) == FH_OK, "train step %d in the queried workspace", train_step);
        cp_fused_free(&f);
        fh_context_destroy(ctx);
        free(ws);
        cp_problem_free(&p);
    }
}

static const tu_test tests[] = {
    {"fp32: every option, both layouts and schedules", test_fp32_options},
    {"fp32: the rank-one term with beta 1", test_fp32_accumulate_c_term},
    {"bf16: both schedules, bf16 gradients, fp32 dU", test_bf16},
    {"tiles that keep every column", test_all_kept_tiles},
    {"the tail estimate and dropping the tail", test_tail},
    {"eps and tail through the parameter interface: bounds, kind, NaN, read back", test_params},
    {"the work statistics", test_contract},
    {"the queried workspace serves filtered calls", test_queried_workspace},
};
const tu_suite suite_filter = {tests, TU_COUNT(tests)};
