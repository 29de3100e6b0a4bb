/* grpo_trl: the options TRL's GRPOTrainer gained up to f2cd5771 (fusedhead.h) against the reference (ref_grpo, which
 * ref_grpo_fdcheck checks by finite differences and hand-worked values): the vLLM importance-sampling correction in
 * each mode with one or two bounds, the off-policy mask from the sampler's or the old log-probs, the top-entropy
 * mask, the bias-corrected KL, luspo and vespo, the entropy bonus over the kept tokens; every loss type at
 * both levels, with and without old log-probs, in split calls and in the train step (row blocks of whole sequences
 * or streaming); hand-worked values of the new metrics; the top-entropy threshold at an exact order statistic.
 * Tolerances: grpo_harness.h (vespo's conditioning slack: grpo_case.h). */
#include "grpo_harness.h"

#include <math.h>
#include <string.h>

/* One set of the new options (spread over the matrix below by gp_pick). */
static void trl_option_set(fh_grpo_options *o, gp_problem *p, int k)
{
    static const fh_grpo_vllm_is_mode modes[4] = {FH_GRPO_VLLM_IS_TOKEN_TRUNCATE, FH_GRPO_VLLM_IS_TOKEN_MASK,
                                                  FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE, FH_GRPO_VLLM_IS_SEQUENCE_MASK};
    /* the bounds: both, the lower only (mask modes: a truncate mode with min only clamps from below), the upper
     * only; token ratios e^+-0.15 and sequence ones about e^+-0.3 fall on both sides of 0.9 / 1.1 and 0.8 / 1.25 */
    static const double token_bounds[3][2] = {{0.9, 1.1}, {0.95, NAN}, {NAN, 1.05}};
    static const double sequence_bounds[3][2] = {{0.8, 1.25}, {0.9, NAN}, {NAN, 1.1}};
    const int sampling = !gp_pick(k, 71, 4);
    if (sampling) {
        gp_set_sampling(p, o->temperature, 0.15);
        o->vllm_importance_sampling_correction = !gp_pick(k, 72, 6);
        fh_grpo_vllm_is_mode mode = modes[k % 4];
        if (o->loss_type == FH_GRPO_LOSS_VESPO && mode >= FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE)
            mode = (fh_grpo_vllm_is_mode)(mode - 2); /* TRL: vespo takes the token modes only */
        o->vllm_importance_sampling_mode = mode;
        const int b = (k / 4) % 3, seq = mode >= FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
        o->vllm_importance_sampling_clip_min = seq ? sequence_bounds[b][0] : token_bounds[b][0];
        o->vllm_importance_sampling_clip_max = seq ? sequence_bounds[b][1] : token_bounds[b][1];
    }
    if (gp_pick(k, 73, 2))
        o->off_policy_mask_threshold = gp_pick(k, 74, 2) ? 0.0 : 0.05;
    if (gp_pick(k, 75, 3))
        o->top_entropy_quantile = gp_pick(k, 76, 2) ? 0.4 : 0.75;
    o->beta = gp_pick(k, 77, 3) ? 0.0 : 0.04;
    o->use_bias_correction_kl = o->beta != 0.0 && gp_pick(k, 78, 2);
    if (gp_pick(k, 79, 2)) {
        o->entropy_coef = gp_pick(k, 80, 2) ? 0.05 : -0.03;
        o->num_items_in_batch = gp_pick(k, 81, 2) ? 0.0 : 23.0;
    }
    if (o->loss_type == FH_GRPO_LOSS_VESPO && gp_pick(k, 82, 2)) {
        o->vespo_k_pos = 1.5;
        o->vespo_lambda_pos = 0.5;
        o->vespo_k_neg = 4.0;
        o->vespo_lambda_neg = -1.0; /* TRL clamps it to 1e-4 */
    }
}

/* 8 loss types x 2 levels x {old, on-policy} x 4 draws of trl_option_set = 128 problems, each in split calls
 * and in the train step, with tile_rows 4 (< T: streaming) or 14 (two sequences of 7: row blocks of whole
 * sequences, unless the top-entropy mask makes it stream). B = 5 (advantages +, -, 0, +, and the last row empty),
 * T = 7, H = 11, V = 37 (tile edges on both sides), temperature 0.7. Tolerances: gp_check. */
static void test_trl_option_matrix(void)
{
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int old = 0; old <= 1; old++)
                for (int draw = 0; draw < 4; draw++, k++) {
                    fh_grpo_options o;
                    gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                    o.temperature = 0.7;
                    if (gp_clipped(o.loss_type) && gp_pick(k, 83, 2))
                        o.epsilon_high = 0.28;
                    gp_problem p;
                    gp_init(&p, 5, 7, 11, 37, gp_pick(k, 84, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, gp_pick(k, 85, 2),
                            9000 + (uint64_t)k);
                    gp_set_ref(&p, o.temperature);
                    if (old)
                        gp_set_old(&p, &o);
                    trl_option_set(&o, &p, k);
                    gp_config c = {.threads = 1, .tile_rows = gp_pick(k, 86, 2) ? 14 : 4, .tile_vocab = 16};
                    c.grad_output = gp_pick(k, 87, 5) ? -0.5f : 1.0f;
                    c.grad_beta = gp_pick(k, 88, 6) ? 1.0f : 0.0f;
                    gp_check(&p, &o, &c, "TRL options");
                    c.train_step = 1;
                    gp_check(&p, &o, &c, "TRL options, train step");
                    gp_free(&p);
                }
    gp_print_worst("grpo_trl");
}

/* The masks and the importance-sampling ratio act as TRL's code says, checked on the fused outputs directly (the
 * reference comparison above cannot tell a wrong rule both share): per_token_loss is l_i before the mask, so with
 * beta = 0 it is pol_i times the detached factors. Against the same problem with every new option off:
 *   - token_mask with bounds [0.95, 1.05]: l_i = 0 exactly where exp((old - samp) m) is outside, unchanged (bitwise)
 *     where it is inside and m = 0 (ratio 1), scaled by the ratio elsewhere (to 1e-6 relative: fp32 output);
 *   - the off-policy mask: rows with A < 0 whose mean (samp - logp) over the mask exceeds the threshold are 0
 *     exactly, the others unchanged;
 *   - the top-entropy mask: l_i = 0 exactly where m = 0 or H_i m_i < Q, unchanged elsewhere, and it keeps
 *     ceil(q count)-ish tokens: at least one, at most every valid one. */
static void test_masks_on_outputs(void)
{
    for (int lv = 0; lv <= 1; lv++) {
        fh_grpo_options base;
        gp_options(&base, FH_GRPO_LOSS_DAPO, gp_all_levels[lv]);
        base.temperature = 0.7;
        gp_problem p;
        gp_init(&p, 6, 8, 9, 41, FH_LAYOUT_VH, 1, 9500 + (uint64_t)lv);
        for (int64_t b = 0; b < p.batch; b++) /* no zero advantage: every valid token's l is non-zero */
            p.adv[b] = b & 1 ? -0.6f : 0.8f;
        gp_set_ref(&p, base.temperature);
        gp_set_old(&p, &base);
        gp_set_sampling(&p, base.temperature, 0.15);
        const gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16};
        const size_t n = (size_t)gp_n(&p);
        fh_grpo_options plain = base;
        plain.vllm_importance_sampling_correction = 0;
        gp_fused f0;
        TU_CHECK(gp_run_fused(&p, &plain, &c, &f0) == FH_OK, "plain run");

        fh_grpo_options is = plain;
        is.vllm_importance_sampling_correction = 1;
        is.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_TOKEN_MASK;
        is.vllm_importance_sampling_clip_min = 0.95;
        is.vllm_importance_sampling_clip_max = 1.05;
        gp_fused f1;
        TU_CHECK(gp_run_fused(&p, &is, &c, &f1) == FH_OK, "token_mask run");
        int zeroed = 0, kept = 0;
        for (size_t i = 0; i < n; i++) {
            const double ratio = exp(((double)p.old[i] - (double)p.samp[i]) * (double)p.mask[i]);
            if (ratio < 0.95 || ratio > 1.05) {
                TU_CHECK(f1.per_token_loss[i] == 0.0f, "level %d token %zu: ratio %g outside, l %g", lv, i, ratio,
                         (double)f1.per_token_loss[i]);
                zeroed++;
            } else if (p.mask[i] == 0.0f) {
                TU_CHECK(f1.per_token_loss[i] == f0.per_token_loss[i], "level %d token %zu: padding changed", lv, i);
            } else {
                TU_CHECK(fabs(f1.per_token_loss[i] - ratio * f0.per_token_loss[i]) <=
                             1e-6 * (1.0 + fabs(f0.per_token_loss[i])),
                         "level %d token %zu: l %g, expected %g x %g", lv, i, (double)f1.per_token_loss[i], ratio,
                         (double)f0.per_token_loss[i]);
                kept++;
            }
        }
        TU_CHECK(zeroed > 0 && kept > 0, "level %d: the draw masks %d and keeps %d tokens", lv, zeroed, kept);

        fh_grpo_options opm = plain;
        opm.off_policy_mask_threshold = 0.0;
        gp_fused f2;
        TU_CHECK(gp_run_fused(&p, &opm, &c, &f2) == FH_OK, "off-policy run");
        int dropped = 0;
        for (int64_t b = 0; b < p.batch; b++) {
            double gap = 0.0, count = 0.0;
            for (int64_t t = 0; t < p.seq; t++) {
                const int64_t i = b * p.seq + t;
                gap += ((double)p.samp[i] - (double)f0.logp[i]) * p.mask[i];
                count += p.mask[i];
            }
            const int drop = p.adv[b] < 0.0f && gap / fmax(count, 1.0) > 0.0;
            dropped += drop;
            for (int64_t t = 0; t < p.seq; t++) {
                const int64_t i = b * p.seq + t;
                TU_CHECK(drop ? f2.per_token_loss[i] == 0.0f : f2.per_token_loss[i] == f0.per_token_loss[i],
                         "level %d row %lld (A %g, mean gap %g): l %g vs %g", lv, (long long)b, (double)p.adv[b],
                         gap / fmax(count, 1.0), (double)f2.per_token_loss[i], (double)f0.per_token_loss[i]);
            }
        }
        TU_CHECK(dropped > 0 || p.batch < 2, "level %d: the draw drops no row", lv);

        fh_grpo_options top = plain;
        top.top_entropy_quantile = 0.3;
        gp_fused f3;
        TU_CHECK(gp_run_fused(&p, &top, &c, &f3) == FH_OK, "top-entropy run");
        double valid = 0.0, carried = 0.0, lowest_kept = INFINITY, highest_dropped = -INFINITY;
        for (size_t i = 0; i < n; i++) {
            if (p.mask[i] == 0.0f) {
                TU_CHECK(f3.per_token_loss[i] == 0.0f, "level %d token %zu: padding carries l %g", lv, i,
                         (double)f3.per_token_loss[i]);
                continue;
            }
            valid += 1.0;
            const int on = f3.per_token_loss[i] != 0.0f;
            if (on) {
                TU_CHECK(f3.per_token_loss[i] == f0.per_token_loss[i], "level %d token %zu: kept l changed", lv, i);
                carried += 1.0;
                lowest_kept = fmin(lowest_kept, f3.entropy[i]);
            } else if (f0.per_token_loss[i] != 0.0f) {
                highest_dropped = fmax(highest_dropped, f3.entropy[i]);
            }
        }
        TU_CHECK(carried >= 1.0 && carried <= valid && highest_dropped < lowest_kept,
                 "level %d: the entropy mask keeps %g of %g tokens, dropped entropies up to %g, kept from %g", lv,
                 carried, valid, highest_dropped, lowest_kept);
        TU_CHECK(fabs(carried - 0.3 * valid) <= 1.0 + 1e-9,
                 "level %d: the top 30%% of %g valid tokens are %g tokens", lv, valid, carried);
        gp_fused_free(&f0);
        gp_fused_free(&f1);
        gp_fused_free(&f2);
        gp_fused_free(&f3);
        gp_free(&p);
    }
}

/* The threshold when the quantile's rank q (n - 1) is an integer in exact arithmetic but not in double: TRL's
 * torch.quantile converts q to the entropies' fp32 and computes the rank there, where 0.3f * 30 rounds to exactly 9:
 * Q is the 10th smallest entropy itself and that token is kept (>=). In double, (1 - 0.7) * 30 =
 * 9.000000000000002 and the lerp can land an ulp above that entropy, dropping the token. 31 valid tokens,
 * top_entropy_quantile 0.7 (TRL: 1 - 0.7 = 0.30000000000000004 in Python, 0.3f in torch), against the reference,
 * which computes the rank as torch does (ref_grpo_quantile). Also n - 1 = 50 with q = 0.7, where the fp32 rank is
 * 15.000001 (above the integer: the 16th entropy is dropped by both). */
static void test_quantile_rank_as_torch(void)
{
    static const struct {
        int64_t batch, seq, valid;
    } shapes[] = {{4, 10, 31}, {6, 10, 51}};
    int k = 0;
    for (size_t s = 0; s < TU_COUNT(shapes); s++)
        for (int seed = 0; seed < 6; seed++, k++) {
            fh_grpo_options o;
            gp_options(&o, FH_GRPO_LOSS_GRPO, FH_GRPO_IS_TOKEN);
            o.top_entropy_quantile = 0.7;
            o.entropy_coef = 0.05;
            gp_problem p;
            gp_init(&p, shapes[s].batch, shapes[s].seq, 9, 41, FH_LAYOUT_VH, 0, 9700 + (uint64_t)k);
            const int64_t n = gp_n(&p);
            for (int64_t i = 0; i < n; i++)
                p.mask[i] = i < shapes[s].valid ? 1.0f : 0.0f;
            for (int64_t b = 0; b < p.batch; b++)
                p.adv[b] = b & 1 ? -0.5f : 0.75f;
            gp_fix_ids(&p);
            gp_set_ref(&p, o.temperature);
            gp_set_old(&p, &o);
            const gp_config c = {.threads = 1, .tile_rows = 8, .tile_vocab = 16};
            gp_check(&p, &o, &c, "the quantile's rank in fp32 (torch)");
            gp_free(&p);
        }
}

/* The new metrics counted by hand from the fused outputs and the inputs:
 *   - sampling/sampling_logp_difference/{mean,max}: |old - samp| over the tokens with m != 0 (inputs only: exact
 *     up to the order of the mean's sum, 1e-15);
 *   - sampling/importance_sampling_ratio/{min,mean,max}: the ratios (after the mode's bounds) over the tokens with
 *     m != 0 in the token modes, over all B rows (the empty one too) in the sequence modes;
 *   - clip_ratio/low_min, high_max: nanmin / nanmax over rows of the row's masked mean of the flag, from the
 *     fused log-probs' ratios (old log-probs drawn GP_BOUND_GUARD away from the bounds: exact);
 *   - policy_loss = loss + entropy_coef * the bonus (sum m H / max(sum m, 1) for dapo too, whose N = 17 is not
 *     sum m: TRL 1.16.0; the fused entropies: 1e-6), entropy_coef.
 * Every row but the empty last one has a token. */
static void test_new_metrics_by_hand(void)
{
    static const fh_grpo_vllm_is_mode modes[4] = {FH_GRPO_VLLM_IS_TOKEN_TRUNCATE, FH_GRPO_VLLM_IS_TOKEN_MASK,
                                                  FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE, FH_GRPO_VLLM_IS_SEQUENCE_MASK};
    for (int m = 0; m < 4; m++)
        for (int lv = 0; lv <= 1; lv++) {
            fh_grpo_options o;
            gp_options(&o, lv ? FH_GRPO_LOSS_LUSPO : FH_GRPO_LOSS_DAPO, gp_all_levels[lv]);
            o.temperature = 0.7;
            o.entropy_coef = 0.02;
            o.num_items_in_batch = 17.0;
            o.vllm_importance_sampling_mode = modes[m];
            const int seq_mode = modes[m] >= FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
            o.vllm_importance_sampling_clip_min = seq_mode ? 0.85 : 0.95;
            o.vllm_importance_sampling_clip_max = seq_mode ? 1.15 : 1.05;
            gp_problem p;
            gp_init(&p, 5, 9, 7, 29, FH_LAYOUT_HV, 1, 9800 + (uint64_t)(m * 2 + lv));
            gp_set_ref(&p, o.temperature);
            gp_set_old(&p, &o);
            gp_set_sampling(&p, o.temperature, 0.15);
            const gp_config c = {.threads = 1, .tile_rows = 9, .tile_vocab = 16, .train_step = m & 1};
            gp_fused f;
            TU_CHECK(gp_run_fused(&p, &o, &c, &f) == FH_OK, "run");
            const int64_t B = p.batch, T = p.seq;
            const double lo = o.vllm_importance_sampling_clip_min, hi = o.vllm_importance_sampling_clip_max;
            const int truncate = modes[m] == FH_GRPO_VLLM_IS_TOKEN_TRUNCATE ||
                                 modes[m] == FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
            double dsum = 0.0, dmax = 0.0, dcount = 0.0, rsum = 0.0, rmin = INFINITY, rmax = -INFINITY, rcount = 0.0;
            double low_min = NAN, high_max = NAN;
            for (int64_t b = 0; b < B; b++) {
                double seq_gap = 0.0, length = 0.0, low = 0.0, high = 0.0, s = 0.0;
                for (int64_t t = 0; t < T; t++) {
                    const int64_t i = b * T + t;
                    const double mi = p.mask[i], gap = (double)p.old[i] - (double)p.samp[i];
                    seq_gap += gap * mi;
                    length += mi;
                    s += ((double)f.logp[i] - (double)p.old[i]) * mi;
                    if (mi != 0.0) {
                        dsum += fabs(gap);
                        dmax = fmax(dmax, fabs(gap));
                        dcount += 1.0;
                    }
                    if (!seq_mode && mi != 0.0) {
                        double r = exp(gap * mi);
                        r = truncate ? fmin(fmax(r, lo), hi) : (r < lo || r > hi ? 0.0 : r);
                        rsum += r, rmin = fmin(rmin, r), rmax = fmax(rmax, r), rcount += 1.0;
                    }
                    const double ratio = exp((double)f.logp[i] - (double)p.old[i]);
                    low += (ratio < 0.8 && p.adv[b] < 0.0f) * mi;
                    high += (ratio > 1.2 && p.adv[b] > 0.0f) * mi;
                }
                if (seq_mode) {
                    double r = exp(seq_gap);
                    r = truncate ? fmin(fmax(r, lo), hi) : (r < lo || r > hi ? 0.0 : r);
                    rsum += r, rmin = fmin(rmin, r), rmax = fmax(rmax, r), rcount += 1.0;
                }
                if (lv) { /* the sequence level: one flag per row from exp(s_b) */
                    const double r = exp(s / fmax(length, 1.0));
                    low = r < 0.8 && p.adv[b] < 0.0f;
                    high = r > 1.2 && p.adv[b] > 0.0f;
                    length = 1.0;
                }
                if (length > 0.0) {
                    low_min = isnan(low_min) ? low / length : fmin(low_min, low / length);
                    high_max = isnan(high_max) ? high / length : fmax(high_max, high / length);
                }
            }
            const fh_grpo_metrics *mt = &f.metrics;
            const char *name = gp_loss_name(o.loss_type);
            TU_CHECK(fabs(mt->sampling_logp_difference_mean - dsum / dcount) <= 1e-15 &&
                         mt->sampling_logp_difference_max == dmax,
                     "%s mode %d: logp difference mean %.17g max %.17g, by hand %.17g %.17g", name, m,
                     mt->sampling_logp_difference_mean, mt->sampling_logp_difference_max, dsum / dcount, dmax);
            TU_CHECK(fabs(mt->importance_sampling_ratio_min - rmin) <= 1e-15 &&
                         fabs(mt->importance_sampling_ratio_max - rmax) <= 1e-15 &&
                         fabs(mt->importance_sampling_ratio_mean - rsum / rcount) <= 1e-15,
                     "%s mode %d: ratio min %.17g mean %.17g max %.17g, by hand %.17g %.17g %.17g", name, m,
                     mt->importance_sampling_ratio_min, mt->importance_sampling_ratio_mean,
                     mt->importance_sampling_ratio_max, rmin, rsum / rcount, rmax);
            TU_CHECK(rmin < rmax, "%s mode %d: the ratios do not spread (%g)", name, m, rmin);
            TU_CHECK(mt->clip_ratio_low_min == low_min && mt->clip_ratio_high_max == high_max,
                     "%s level %d: low_min %.17g high_max %.17g, by hand %.17g %.17g", name, lv, mt->clip_ratio_low_min,
                     mt->clip_ratio_high_max, low_min, high_max);
            double bonus = 0.0;
            for (int64_t i = 0; i < B * T; i++)
                bonus += (double)f.entropy[i] * p.mask[i];
            double msum = 0.0;
            for (int64_t i = 0; i < B * T; i++)
                msum += p.mask[i];
            TU_CHECK(msum != o.num_items_in_batch, "%s: sum m = N = %g cannot tell the normalisers apart", name, msum);
            bonus /= fmax(msum, 1.0);
            TU_CHECK(fabs(mt->policy_loss - (f.loss + o.entropy_coef * bonus)) <= 1e-6 * fmax(1.0, fabs(f.loss)) &&
                         mt->entropy_coef == o.entropy_coef,
                     "%s: policy_loss %.17g, loss %.17g + %g x bonus %.17g; entropy_coef %g", name, mt->policy_loss,
                     f.loss, o.entropy_coef, bonus, mt->entropy_coef);
            gp_fused_free(&f);
            gp_free(&p);
        }
}

static const tu_test tests[] = {
    {"TRL's options x loss type x level x old, split and train step", test_trl_option_matrix},
    {"masks and importance-sampling ratios on the outputs", test_masks_on_outputs},
    {"the top-entropy quantile's rank as torch computes it", test_quantile_rank_as_torch},
    {"the new metrics by hand", test_new_metrics_by_hand},
};
const tu_suite suite_grpo_trl = {tests, TU_COUNT(tests)};
