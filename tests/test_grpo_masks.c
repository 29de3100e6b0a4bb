/* grpo_masks: all-zero rows (middle and last: their dx rows must be exactly 0, exactly 1 when accumulating onto
 * 1; every gp_check asserts this for every mask-0 token), advantages +, -, 0 and -0, fractional mask weights (a
 * row summing to 0.75), the shared grpo_case harness's empty last row, a fully masked batch (exact zeros),
 * out-of-range ids under the mask (logp exactly 0, results bitwise unchanged). Tolerances: grpo_harness.h. */
#include "grpo_harness.h"

#include <math.h>
#include <string.h>

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

/* The shared harness (tests/cases/grpo_case, also behind fh_gradcheck) at B = 3, T = 9, H = 11, V = 37, tiles 4 x 16: it
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
                    const int clipped = gp_clipped(o.loss_type), cispo = o.loss_type == FH_GRPO_LOSS_CISPO;
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
                    /* nanmin / nanmax over rows that are all empty: NaN at the token level (0 / 0 per row); the
                     * rows' flags, 0 (r = 1), at the sequence level */
                    TU_CHECK(clipped && lv == 1 ? m->clip_ratio_low_min == 0.0 && m->clip_ratio_high_max == 0.0
                                                : isnan(m->clip_ratio_low_min) && isnan(m->clip_ratio_high_max),
                             "%s level %zu: low_min %g high_max %g", name, lv, m->clip_ratio_low_min,
                             m->clip_ratio_high_max);
                    TU_CHECK(m->policy_loss == 0.0 && m->entropy_coef == 0.1,
                             "%s: policy_loss %g entropy_coef %g, expected 0 and 0.1", name, m->policy_loss,
                             m->entropy_coef);
                    TU_CHECK(o.loss_type == FH_GRPO_LOSS_VESPO ? m->vespo_phi_seq_mean == 1.0
                                                                : isnan(m->vespo_phi_seq_mean),
                             "%s: vespo/phi_seq_mean %g (on-policy: phi = 1 on every row)", name,
                             m->vespo_phi_seq_mean);
                    const double cispo_expected = lv == 1 ? 1.0 / 3.0 : 0.0;
                    TU_CHECK(cispo ? m->cispo_clip_ratio == cispo_expected : isnan(m->cispo_clip_ratio),
                             "%s level %zu: cispo_clip_ratio %g", name, lv, m->cispo_clip_ratio);
                }
                gp_fused_free(&f);
                gp_free(&p);
            }
}

/* Out-of-range ids under the mask: per_token_logp is exactly 0 there, and the loss, metrics and gradients are
 * bitwise those of the same problem with in-range ids at those positions (a masked token contributes nothing, under
 * luspo too since TRL 1.16.0 masks before its reduction). */
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

static const tu_test tests[] = {
    {"empty rows, advantage signs, fractional masks", test_empty_rows_and_advantage_signs},
    {"grpo_case harness: empty last row, exact zero dx", test_grpo_case_empty_last_row},
    {"fully masked batch: exact zeros", test_fully_masked_batch},
    {"out-of-range ids under the mask", test_masked_out_of_range_ids},
};
const tu_suite suite_grpo_masks = {tests, TU_COUNT(tests)};
