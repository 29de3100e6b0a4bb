/* grpo_metrics: which metrics are NaN for each loss type (and kl when beta == 0), values against the reference,
 * exact values where they can be counted by hand. Tolerances: grpo_harness.h. */
#include "grpo_harness.h"

#include <math.h>

/* For each loss type, level, beta, old/on-policy and delta (off; 1.5 above the clip range; 1.1 inside it, where
 * the clip flags must use c1 = min(r, delta) and not r; 0.7 below 1 - eps_low):
 *   - NaN exactly where TRL logs nothing: kl when beta == 0, the five clip metrics (low/high/region mean, low_min,
 *     high_max) outside the clipped family (luspo in it), cispo_clip_ratio outside cispo, vespo/phi_seq_mean
 *     outside vespo, policy_loss and entropy_coef without the entropy bonus, the sampling metrics without sampler
 *     log-probs, entropy never (the new metrics' values: grpo_trl);
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
                    const int clipped = gp_clipped(o.loss_type), cispo = o.loss_type == FH_GRPO_LOSS_CISPO;
                    const int vespo = o.loss_type == FH_GRPO_LOSS_VESPO;
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
                    TU_CHECK(gp_isnan(m->clip_ratio_low_min) != clipped && gp_isnan(m->clip_ratio_high_max) != clipped,
                             "[%s]: low_min %g high_max %g", desc, m->clip_ratio_low_min, m->clip_ratio_high_max);
                    TU_CHECK(isnan(m->policy_loss) && isnan(m->entropy_coef), "[%s]: policy_loss %g entropy_coef %g "
                             "without the entropy bonus", desc, m->policy_loss, m->entropy_coef);
                    TU_CHECK(gp_isnan(m->vespo_phi_seq_mean) != vespo, "[%s]: vespo/phi_seq_mean %g", desc,
                             m->vespo_phi_seq_mean);
                    TU_CHECK(isnan(m->sampling_logp_difference_mean) && isnan(m->sampling_logp_difference_max) &&
                                 isnan(m->importance_sampling_ratio_min) && isnan(m->importance_sampling_ratio_mean) &&
                                 isnan(m->importance_sampling_ratio_max),
                             "[%s]: sampling metrics without sampler log-probs", desc);
                    gp_reference r;
                    gp_run_reference(&p, &o, 1.0, 0.0, &r);
                    const grpo_slack slack = gp_slack(&p, &o, &f, &r);
                    const double diff = gp_metrics_diff_slack(m, &r.metrics, &slack);
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

static const tu_test tests[] = {
    {"NaN pattern and values per loss type", test_metrics},
};
const tu_suite suite_grpo_metrics = {tests, TU_COUNT(tests)};
