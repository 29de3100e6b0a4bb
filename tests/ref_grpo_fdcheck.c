/* ref_grpo_fdcheck: checks ref_grpo_backward against central finite differences of ref_grpo_forward, and values
 * that can be worked out by hand (TRL's quirks: metric denominators, luspo's per-sequence sums, vespo's gamma
 * weight, the importance-sampling modes and their metrics, the off-policy and top-entropy masks, torch.quantile,
 * the entropy bonus's normalisers, the refused option combinations). Finite differences over every loss_type up
 * to sapo x importance-sampling level x {old logps given, on-policy} x {beta 0, 0.04} x {no delta, delta 1.5}
 * (the entropy bonus in TRL's and the per-token form on a quarter of them each), then luspo, vespo and the options
 * TRL added up to f2cd5771 (sampling log-probs with each vLLM importance-sampling mode, truncated or masked, with
 * one or both bounds, and without the correction; the off-policy mask from the sampling or the old log-probs;
 * top_entropy_quantile 0 to 0.6; the bias-corrected KL; padded ids outside the vocabulary) in the combinations of
 * new_rows, each at every level, with and without old log-probs. Prints one line per case, exits non-zero on any
 * failure.
 *
 *   gcc -std=c11 -Wall -Wextra -O2 -Iref -Iinclude ref/ref_linear.c ref/ref_filter.c ref/ref_grpo.c \
 *       tests/ref_grpo_fdcheck.c -lm -o ref_grpo_fdcheck
 *
 * Stop-gradients. TRL's gradient is not the derivative of its forward value: the on-policy old logp, cispo's
 * clamped ratio, GSPO-token's sg(.) terms, vespo's phi (@torch.no_grad), the off-policy mask (from
 * per_token_logps.detach()), the importance-sampling ratio (computed at generation time; from sg(logp) here when
 * there are no old log-probs) are detached, and the top-entropy mask is a comparison. The finite differences
 * therefore differentiate the forward with every sg(.) frozen at the base point (ref_grpo_problem.sg_logp = logp
 * and sg_entropy = entropy at the base point); that function equals TRL's loss at the base point (asserted,
 * bitwise) and its derivative there is TRL's autograd gradient. The analytic side runs with the anchors NULL, as a
 * user would.
 *
 * Smoothness. The loss is piecewise smooth: clamp and min switch at r = 1 - eps_low, 1 + eps_high and delta.
 * The old logps are logp - (D_b + e) with D_b the log of a ratio in one of five regions (0.65, 0.95, 1.1, 1.4,
 * 1.8: below the clip range, inside on both sides of 1, between 1 + eps_high and delta, above delta) and
 * |e| < 0.04, so every token ratio and every sequence ratio stays at least ~0.03 from every switch point,
 * while a step of 1e-6 in one parameter moves a logp by about 1e-6. On-policy the ratio is 1 + O(1e-6), inside
 * the clip range, where both operands of min are the same smooth function.
 *
 * Tolerance. For each gradient entry g (analytic) and f (finite difference) the error is
 * |f - g| / max(|f|, |g|, 1e-2 * S), S the largest |g| over dx, dW and dbias of the case; the printed value is
 * the largest over the entries, and every case must stay <= 1e-6. Why: central differences with h = 1e-6 in
 * double have truncation error h^2 |L'''| / 6 ~ 1e-13 (logits O(1), temperature 0.7: third derivatives are
 * O(1)) and rounding error ~ eps * (size of the terms summed into L) / h. The loss is a difference of O(1)
 * terms (ratios times advantages), which puts that noise near 1e-16 / 1e-6 ~ 1e-10 absolute (3e-10 is the
 * largest seen over all cases). The gradients here have S between 2e-3 (masks and clipping leaving little) and
 * 43 (vespo's phi at a large sequence ratio), so an entry of at least 1e-2 * S is resolved to ~1e-7 relative
 * or better (2.5e-7 is the largest seen, at S = 1.7e-3); smaller entries (near-zero ones, e.g. where clipping
 * removes most of a column's gradient) cannot be resolved to 1e-6 relative with this step and are held
 * instead to 1e-8 * S absolute through the floor. A correct backward lands at ~1e-7 at worst, so 1e-6 leaves
 * an order of magnitude of slack, while a wrong formula (a missing mask or 1/temperature, a wrong normaliser,
 * a gradient through a detached term, a clamp that does not block) is off by at least ~1e-2 of S (the entropy
 * bonus and the KL, the smallest terms, are of that size), four orders above the tolerance. */
#include "fdcheck.h"
#include "ref_grpo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 3, T = 5, HID = 4, V = 7, N = B * T };
static const double TEMPERATURE = 0.7, STEP = 1e-6, TOLERANCE = 1e-6;

static const char *loss_name[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};
static const char *level_name[] = {"token", "sequence", "seq_token"};
static const char *is_mode_name[] = {"tok_trunc", "tok_mask", "seq_trunc", "seq_mask"};

/* Loss at the current parameters, every sg(.) (and the entropy mask's entropies) frozen at the anchors. */
static double loss_at(const ref_grpo_problem *base, const ref_grpo_options *o, const double *anchor,
                      const double *entropy_anchor)
{
    ref_grpo_problem p = *base;
    p.sg_logp = anchor;
    p.sg_entropy = entropy_anchor;
    ref_grpo_result r;
    memset(&r, 0, sizeof r);
    if (ref_grpo_forward(&p, o, &r)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    return r.loss;
}

/* Max error of the analytic gradient g against central differences over every entry of param. */
static double fd_tensor(const ref_grpo_problem *p, const ref_grpo_options *o, const double *anchor,
                        const double *entropy_anchor, double *param, const double *g, int count, double floor)
{
    double worst = 0.0;
    for (int k = 0; k < count; k++) {
        const double keep = param[k];
        param[k] = keep + STEP;
        const double up = loss_at(p, o, anchor, entropy_anchor);
        param[k] = keep - STEP;
        const double down = loss_at(p, o, anchor, entropy_anchor);
        param[k] = keep;
        const double e = fd_rel_err((up - down) / (2.0 * STEP), g[k], floor);
        if (e > worst || isnan(e))
            worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

/* One finite-difference case: the base options and the TRL options added at f2cd5771. */
typedef struct fd_config {
    ref_grpo_loss_type lt;
    ref_grpo_is_level lvl;
    int with_old;
    double beta, delta;
    int sampling;           /* sampling log-probs given (the importance-sampling correction applies, if on) */
    int is_mode;            /* -1: correction off; else a ref_grpo_vllm_is_mode */
    double clip_min, clip_max;
    double off_policy;      /* NaN: off */
    double quantile;        /* 1: no entropy mask */
    int bias_kl;
    int entropy;            /* 0: no bonus; 1: TRL's; 2: per token (the issue's) */
    int padded_ids_out;     /* padded positions get the id -100 (log-prob constant 0) */
} fd_config;

static fd_config fd_base(ref_grpo_loss_type lt, ref_grpo_is_level lvl, int with_old, double beta, double delta)
{
    const fd_config c = {lt, lvl, with_old, beta, delta, 0, -1, NAN, NAN, NAN, 1.0, 0, 0, 0};
    return c;
}

static int fd_case(int index, const fd_config *cfg)
{
    const ref_grpo_loss_type lt = cfg->lt;
    fd_rng_state = 0x5EED0000ull + (uint64_t)index * 7919u;
    double x[N * HID], w[HID * V], bias[V], mask[N], adv[B], old[N], ref[N], samp[N], logp0[N], ent0[N];
    int64_t ids[N];
    fd_fill(x, N * HID, -1.0, 1.0);
    fd_fill(w, HID * V, -1.2, 1.2);
    fd_fill(bias, V, -0.5, 0.5);
    for (int k = 0; k < N; k++)
        ids[k] = (int64_t)(fd_uniform(0.0, 1.0) * V) % V;
    /* Row 0 has a padded tail, row 1 is full, row 2 is all padding in even cases and short in odd ones. */
    static const double mask_rows[2][B][T] = {{{1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}, {0, 0, 0, 0, 0}},
                                              {{1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}, {1, 1, 0, 0, 0}}};
    memcpy(mask, mask_rows[index % 2], sizeof mask);
    if (cfg->padded_ids_out)
        for (int k = 0; k < N; k++)
            if (mask[k] == 0.0)
                ids[k] = -100;
    /* Advantages of both signs and zero, permuted over the rows; the full row 1 never gets 0. */
    static const double adv_perms[4][B] = {{0.9, -0.7, 0.0}, {0.0, 0.9, -0.7}, {-0.7, 0.9, 0.0}, {0.0, -0.7, 0.9}};
    memcpy(adv, adv_perms[index % 4], sizeof adv);

    ref_grpo_options o;
    ref_grpo_options_default(&o);
    o.loss_type = lt;
    o.importance_sampling_level = cfg->lvl;
    o.temperature = TEMPERATURE;
    o.beta = cfg->beta;
    o.delta = cfg->delta;
    if (lt == REF_GRPO_LOSS_DAPO || lt == REF_GRPO_LOSS_LUSPO)
        o.epsilon_high = 0.28; /* DAPO's clip-higher */
    if (lt == REF_GRPO_LOSS_CISPO)
        o.epsilon_high = 1.25; /* absolute cap: some ratios above, some below */
    if ((lt == REF_GRPO_LOSS_DAPO || lt == REF_GRPO_LOSS_VESPO || lt == REF_GRPO_LOSS_CISPO) && index % 2)
        o.num_items_in_batch = 12.5;
    if (lt == REF_GRPO_LOSS_DR_GRPO && index % 2)
        o.max_completion_length = 8;
    if (cfg->entropy) {
        o.entropy_coef = 0.05;
        o.entropy_bonus = cfg->entropy == 2 ? REF_GRPO_ENTROPY_PER_TOKEN : REF_GRPO_ENTROPY_TRL;
    }
    o.vllm_importance_sampling_correction = cfg->is_mode >= 0;
    if (cfg->is_mode >= 0)
        o.vllm_importance_sampling_mode = (ref_grpo_vllm_is_mode)cfg->is_mode;
    o.vllm_importance_sampling_clip_min = cfg->clip_min;
    o.vllm_importance_sampling_clip_max = cfg->clip_max;
    o.off_policy_mask_threshold = cfg->off_policy;
    o.top_entropy_quantile = cfg->quantile;
    o.use_bias_correction_kl = cfg->bias_kl;
    if (lt == REF_GRPO_LOSS_VESPO && index % 3 == 1) { /* TRL's other shapes of phi */
        o.vespo_k_pos = 1.5;
        o.vespo_lambda_pos = 0.5;
        o.vespo_k_neg = 4.0;
        o.vespo_lambda_neg = -1.0; /* clamped to 1e-4, as TRL */
    }

    ref_grpo_problem p = {B, T, HID, V, x, w, bias, ids, mask, adv, NULL, NULL, NULL, NULL, NULL};
    ref_grpo_result r0;
    memset(&r0, 0, sizeof r0);
    r0.logp = logp0;
    r0.entropy = ent0;
    ref_grpo_options on_policy;
    ref_grpo_options_default(&on_policy);
    on_policy.temperature = TEMPERATURE;
    if (ref_grpo_forward(&p, &on_policy, &r0)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    /* Rows 0 and 2 go through all five ratio regions; row 1 stays inside the clip range so that no case has
     * its whole gradient clipped away. */
    static const double regions[5] = {0.65, 0.95, 1.1, 1.4, 1.8};
    for (int b = 0; b < B; b++) {
        const double d = log(b == 1 ? regions[1 + index % 2] : regions[(index + 2 * b) % 5]);
        for (int t = 0; t < T; t++)
            old[b * T + t] = logp0[b * T + t] - (d + fd_uniform(-0.04, 0.04));
    }
    for (int k = 0; k < N; k++)
        ref[k] = logp0[k] + fd_uniform(-0.3, 0.3);
    /* The sampler's log-probs near the old ones (the current ones on-policy): token ratios exp(old - samp) in
     * [0.74, 1.35], row sums of up to +-1.5 in the log. */
    for (int k = 0; k < N; k++)
        samp[k] = (cfg->with_old ? old[k] : logp0[k]) + fd_uniform(-0.3, 0.3);
    p.old_logp = cfg->with_old ? old : NULL;
    p.ref_logp = cfg->beta != 0.0 ? ref : NULL;
    p.sampling_logp = cfg->sampling ? samp : NULL;

    double dx[N * HID], dw[HID * V], db[V];
    if (ref_grpo_backward(&p, &o, 1.0, dx, dw, db)) {
        printf("FAIL: backward returned an error\n");
        exit(2);
    }
    /* Every gradient path carries the mask: padded tokens' hidden states get exactly nothing (luspo too, since
     * TRL 1.16.0 masks before its reduction). */
    int padded_zero = 1;
    for (int i = 0; i < N; i++)
        for (int k = 0; k < HID; k++)
            if (mask[i] == 0.0 && dx[i * HID + k] != 0.0)
                padded_zero = 0;
    fd_expect(padded_zero, "dx of a padded token is not exactly 0");

    /* The anchored forward is TRL's forward at the base point. */
    ref_grpo_result plain, anchored;
    memset(&plain, 0, sizeof plain);
    memset(&anchored, 0, sizeof anchored);
    ref_grpo_forward(&p, &o, &plain);
    ref_grpo_problem pa = p;
    pa.sg_logp = logp0;
    pa.sg_entropy = ent0;
    ref_grpo_forward(&pa, &o, &anchored);
    fd_expect(plain.loss == anchored.loss, "the anchored forward differs from the forward at the base point");

    /* On-policy, beta 0, no entropy bonus, no new option: the ratio is 1 and the loss is minus the mean advantage
     * of the non-empty rows (grpo/sapo-style per-row mean: sapo's gate is 4/tau * sigmoid(0) = 2/tau). */
    if (!cfg->with_old && cfg->beta == 0.0 && o.entropy_coef == 0.0 && !cfg->sampling && isnan(cfg->off_policy) &&
        cfg->quantile == 1.0 && (lt == REF_GRPO_LOSS_GRPO || lt == REF_GRPO_LOSS_SAPO)) {
        double expected = 0.0;
        for (int b = 0; b < B; b++) {
            double nb = 0.0;
            for (int t = 0; t < T; t++)
                nb += mask[b * T + t];
            const double tau = adv[b] > 0.0 ? o.sapo_temperature_pos : o.sapo_temperature_neg;
            if (nb > 0.0)
                expected -= (lt == REF_GRPO_LOSS_SAPO ? 2.0 / tau : 1.0) * adv[b] / B;
        }
        fd_expect(fabs(plain.loss - expected) <= 1e-15, "on-policy loss is not -mean(A)");
    }

    const double scale = fmax(fd_max_abs(dx, N * HID), fmax(fd_max_abs(dw, HID * V), fd_max_abs(db, V)));
    const double floor = 1e-2 * scale;
    const double ex = fd_tensor(&p, &o, logp0, ent0, x, dx, N * HID, floor);
    const double ew = fd_tensor(&p, &o, logp0, ent0, w, dw, HID * V, floor);
    const double eb = fd_tensor(&p, &o, logp0, ent0, bias, db, V, floor);
    const double worst = fmax(ex, fmax(ew, eb));
    char name[192], extra[128] = "";
    int len = 0;
    if (cfg->sampling)
        len += snprintf(extra + len, sizeof extra - (size_t)len, " samp%s%s", cfg->is_mode >= 0 ? ":" : ":no-is",
                        cfg->is_mode >= 0 ? is_mode_name[cfg->is_mode] : "");
    if (!isnan(cfg->off_policy))
        len += snprintf(extra + len, sizeof extra - (size_t)len, " opm=%g", cfg->off_policy);
    if (cfg->quantile < 1.0)
        len += snprintf(extra + len, sizeof extra - (size_t)len, " q=%g", cfg->quantile);
    if (cfg->bias_kl)
        len += snprintf(extra + len, sizeof extra - (size_t)len, " bias_kl");
    if (cfg->padded_ids_out)
        snprintf(extra + len, sizeof extra - (size_t)len, " pad-ids-out");
    snprintf(name, sizeof name, "%-7s %-9s %-6s beta=%-4g delta=%-3s ent=%s%s", loss_name[lt], level_name[cfg->lvl],
             cfg->with_old ? "old" : "onpol", cfg->beta, cfg->delta > 0.0 ? "1.5" : "off",
             cfg->entropy == 0 ? "-- " : cfg->entropy == 2 ? "tok" : "trl", extra);
    printf("%3d %s  |g|max=%.2e  rel dx=%.1e dW=%.1e db=%.1e  %s\n", index, name, scale, ex, ew, eb,
           worst <= TOLERANCE ? "ok" : "FAIL");
    if (!(worst <= TOLERANCE))
        fd_failures++;
    return 0;
}

/* Hand-worked values for TRL's quirks: metric denominators, the delta-clamped coef_1 in the clip flags,
 * min's gradient on ties and past the clip bounds. B = 2, T = 3, logp = 0. */
static void hand_checks(void)
{
    const double logp[6] = {0, 0, 0, 0, 0, 0}, mask[6] = {1, 1, 1, 1, 0, 0}, adv[2] = {1.0, -1.0};
    const double old[6] = {-0.5, 0, 0, 0.5, 0, 0}; /* ratios e^0.5 = 1.65 (A > 0), 1, 1 | e^-0.5 = 0.61 (A < 0) */
    ref_grpo_tokens tk = {2, 3, logp, NULL, mask, adv, old, NULL, NULL, NULL, NULL};
    ref_grpo_options o;
    ref_grpo_options_default(&o);
    o.loss_type = REF_GRPO_LOSS_GRPO;
    ref_grpo_result r;
    memset(&r, 0, sizeof r);
    double g[6], gh[6];

    /* Token level grpo: row 0 = (-1.2 - 1 - 1) / 3, row 1 = -min(-0.61, -0.8) = 0.8; loss = mean of rows.
     * Clipped tokens get no gradient, the two r = 1 tokens (min tie) get -A * w = -1/6. */
    fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, g, gh) == 0, "head failed");
    fd_expect(fabs(r.loss - (-3.2 / 3.0 + 0.8) / 2.0) < 1e-15, "hand: token grpo loss");
    fd_expect(g[0] == 0.0 && fabs(g[1] + 1.0 / 6.0) < 1e-16 && fabs(g[2] + 1.0 / 6.0) < 1e-16 && g[3] == 0.0 &&
               g[4] == 0.0 && g[5] == 0.0,
           "hand: token grpo g_logp");
    fd_expect(r.metrics.clip_high_mean == 0.25 && r.metrics.clip_low_mean == 0.25 &&
               r.metrics.clip_region_mean == 0.5,
           "hand: token clip ratios are masked token means");
    fd_expect(isnan(r.metrics.kl) && isnan(r.metrics.entropy) && isnan(r.metrics.cispo_clip_ratio),
           "hand: absent metrics are NaN");

    /* delta = 1.1 clamps coef_1 to 1.1 before the flags: the high clip disappears from the metric. */
    o.delta = 1.1;
    ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL);
    fd_expect(r.metrics.clip_high_mean == 0.0 && r.metrics.clip_low_mean == 0.25, "hand: delta-clamped flags");
    /* and token 0 now takes the c1 branch: -min(1.1, 1.2) = -1.1 with gradient 0 (clamp past delta). */
    fd_expect(fabs(r.loss - (-3.1 / 3.0 + 0.8) / 2.0) < 1e-15, "hand: delta loss");
    o.delta = NAN;

    /* Sequence level: s_0 = 0.5 / 3 (r = 1.18, inside), s_1 = -0.5 (r = 0.61, clipped low, A < 0). The flags
     * are averaged over the B = 2 rows: low = 1/2. Row 1's loss is 0.8 with no gradient; row 0's three tokens
     * share d/ds = -A r_0 / 3 (from the row mean) times mask / n_0. */
    o.importance_sampling_level = REF_GRPO_IS_SEQUENCE;
    ref_grpo_head(&tk, &o, 1.0, &r, g, NULL);
    const double r0 = exp(0.5 / 3.0);
    fd_expect(r.metrics.clip_low_mean == 0.5 && r.metrics.clip_high_mean == 0.0 && r.metrics.clip_region_mean == 0.5,
           "hand: sequence clip ratios are row means");
    fd_expect(fabs(r.loss - (-r0 + 0.8) / 2.0) < 1e-15, "hand: sequence loss");
    fd_expect(fabs(g[0] + r0 / 6.0) < 1e-15 && fabs(g[1] - g[0]) == 0.0 && fabs(g[2] - g[0]) == 0.0 && g[3] == 0.0,
           "hand: sequence g_logp spreads over the row");

    /* GSPO-token: same value, but each token only gets its own share: d/dlogp_t = -A r_0 * w_t = -r_0 / 6. */
    o.importance_sampling_level = REF_GRPO_IS_SEQUENCE_TOKEN;
    ref_grpo_head(&tk, &o, 1.0, &r, g, NULL);
    fd_expect(fabs(r.loss - (-r0 + 0.8) / 2.0) < 1e-15, "hand: sequence_token loss");
    fd_expect(fabs(g[0] + r0 / 6.0) < 1e-15 && g[1] == g[0] && g[2] == g[0], "hand: sequence_token g_logp");

    /* An all-padding batch: every clamp(min=1) guard holds, loss 0, metrics 0 (TRL: 0 / 1). */
    const double none[6] = {0, 0, 0, 0, 0, 0};
    ref_grpo_tokens empty = {2, 3, logp, logp, none, adv, old, NULL, NULL, NULL, NULL};
    for (int lt = REF_GRPO_LOSS_GRPO; lt <= REF_GRPO_LOSS_VESPO; lt++) {
        ref_grpo_options_default(&o);
        o.loss_type = (ref_grpo_loss_type)lt;
        ref_grpo_head(&empty, &o, 1.0, &r, g, gh);
        fd_expect(r.loss == 0.0 && r.metrics.entropy == 0.0, "hand: all-padding loss is 0");
    }

    /* clip_ratio/low_min and high_max: nanmin / nanmax over the rows of the row's masked mean. Token level: row 0
     * has one high flag in 3 tokens, row 1 one low flag in 1 token: low_min = min(0, 1) = 0, high_max = 1/3.
     * Sequence level: the rows' flags (row 0 inside, row 1 low): low_min 0, high_max 0. */
    ref_grpo_options_default(&o);
    o.loss_type = REF_GRPO_LOSS_GRPO;
    ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL);
    fd_expect(r.metrics.clip_low_min == 0.0 && fabs(r.metrics.clip_high_max - 1.0 / 3.0) < 1e-16,
           "hand: token low_min / high_max");
    fd_expect(isnan(r.metrics.policy_loss) && isnan(r.metrics.entropy_coef) && isnan(r.metrics.vespo_phi_seq_mean) &&
               isnan(r.metrics.sampling_logp_diff_mean) && isnan(r.metrics.is_ratio_mean),
           "hand: metrics of options that are off are NaN");
    o.importance_sampling_level = REF_GRPO_IS_SEQUENCE;
    ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL);
    fd_expect(r.metrics.clip_low_min == 0.0 && r.metrics.clip_high_max == 0.0, "hand: sequence low_min / high_max");
    /* An empty row is NaN in masked_seq_mean and skipped: with row 1 empty, both come from row 0 alone. */
    {
        const double mask0[6] = {1, 1, 1, 0, 0, 0};
        ref_grpo_tokens t0 = tk;
        t0.completion_mask = mask0;
        o.importance_sampling_level = REF_GRPO_IS_TOKEN;
        ref_grpo_head(&t0, &o, 1.0, &r, NULL, NULL);
        fd_expect(r.metrics.clip_low_min == 0.0 && fabs(r.metrics.clip_high_max - 1.0 / 3.0) < 1e-16,
               "hand: an empty row is skipped by nanmin / nanmax");
        const double none0[6] = {0, 0, 0, 0, 0, 0};
        t0.completion_mask = none0;
        ref_grpo_head(&t0, &o, 1.0, &r, NULL, NULL);
        fd_expect(isnan(r.metrics.clip_low_min) && isnan(r.metrics.clip_high_max),
               "hand: every row empty: low_min and high_max NaN");
    }

    /* luspo (TRL 1.16.0): (l * m).sum(-1).mean(), each row's masked sum averaged over B. l = (-1.2, -1, -1 | 0.8,
     * 1, 1) (the padded positions of row 1 have r = 1: -min(-1, -1) = 1, masked out): loss = (-3.2 + 0.8) / 2. The
     * r = 1 tokens of row 0 get d/dlogp = -A r / B = -0.5 (a min tie inside the clip range: half to each operand),
     * the padded positions nothing. */
    ref_grpo_options_default(&o);
    o.loss_type = REF_GRPO_LOSS_LUSPO;
    ref_grpo_head(&tk, &o, 1.0, &r, g, NULL);
    fd_expect(fabs(r.loss - (-3.2 + 0.8) / 2.0) < 1e-15, "hand: luspo loss");
    fd_expect(g[0] == 0.0 && fabs(g[1] + 0.5) < 1e-16 && fabs(g[2] + 0.5) < 1e-16 && g[3] == 0.0 && g[4] == 0.0 &&
                  g[5] == 0.0,
              "hand: luspo's g_logp (the padded positions get none)");
    fd_expect(fabs(r.metrics.clip_high_mean - 0.25) < 1e-16 && r.metrics.clip_low_min == 0.0,
           "hand: luspo logs the clip metrics");

    /* vespo: on-policy, log w = 0, phi = e^(lam - lam) = 1: loss = -sum m A logp / N. With old = logp + 0.1 on
     * row 0: log w = -0.3 and phi_0 = exp(3 + 2 (-0.3) - 3 e^-0.3) (A >= 0: k_pos 2, lam_pos 3). */
    {
        const double lp[6] = {-1, -2, -0.5, -1.5, -3, -0.2}, old0[6] = {-0.9, -1.9, -0.4, -1.5, 0, 0};
        ref_grpo_tokens tv = {2, 3, lp, NULL, mask, adv, NULL, NULL, NULL, NULL, NULL};
        ref_grpo_options_default(&o);
        o.loss_type = REF_GRPO_LOSS_VESPO;
        ref_grpo_head(&tv, &o, 1.0, &r, g, NULL);
        fd_expect(fabs(r.loss - 0.5) < 1e-15 && r.metrics.vespo_phi_seq_mean == 1.0, "hand: on-policy vespo");
        fd_expect(g[0] == -0.25 && g[3] == 0.25 && g[4] == 0.0, "hand: on-policy vespo g_logp");
        tv.old_logp = old0;
        ref_grpo_head(&tv, &o, 1.0, &r, g, NULL);
        const double phi0 = exp(3.0 + 2.0 * -0.3 - 3.0 * exp(-0.3));
        fd_expect(fabs(r.metrics.vespo_phi_seq_mean - (phi0 + 1.0) / 2.0) < 1e-14 && fabs(g[0] + phi0 / 4.0) < 1e-15,
               "hand: vespo's gamma weight");
        /* lambda below 1e-4 is clamped: phi = exp(1e-4 + k log w - 1e-4 w) */
        o.vespo_lambda_pos = -2.0;
        ref_grpo_head(&tv, &o, 1.0, &r, g, NULL);
        const double phi1 = exp(1e-4 + 2.0 * -0.3 - 1e-4 * exp(-0.3));
        fd_expect(fabs(g[0] + phi1 / 4.0) < 1e-15, "hand: vespo's lambda clamped to 1e-4");
    }

    /* The vLLM importance-sampling ratio: old - samp = (0.5, -0.5, 0, 1 | masked) gives token ratios
     * (e^0.5, e^-0.5, 1, e), row sums (0, 1). */
    {
        const double samp[6] = {-1.0, 0.5, 0.0, -0.5, 3.0, -3.0};
        ref_grpo_tokens ts = tk;
        ts.sampling_logp = samp;
        double factor[6];
        ref_grpo_result rs;
        memset(&rs, 0, sizeof rs);
        rs.policy_factor = factor;
        ref_grpo_options_default(&o);
        o.loss_type = REF_GRPO_LOSS_GRPO;
        o.vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_TOKEN_TRUNCATE;
        o.vllm_importance_sampling_clip_min = 0.7;
        o.vllm_importance_sampling_clip_max = 2.0;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(fabs(factor[0] - exp(0.5)) < 1e-15 && factor[1] == 0.7 && factor[2] == 1.0 && factor[3] == 2.0 &&
                   factor[4] == 1.0 && factor[5] == 1.0,
               "hand: token_truncate ratios");
        fd_expect(rs.metrics.is_ratio_min == 0.7 && rs.metrics.is_ratio_max == 2.0 &&
                   fabs(rs.metrics.is_ratio_mean - (exp(0.5) + 3.7) / 4.0) < 1e-15 &&
                   rs.metrics.sampling_logp_diff_mean == 0.5 && rs.metrics.sampling_logp_diff_max == 1.0,
               "hand: token-mode sampling metrics over the masked tokens");
        o.vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_TOKEN_MASK;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(fabs(factor[0] - exp(0.5)) < 1e-15 && factor[1] == 0.0 && factor[2] == 1.0 && factor[3] == 0.0,
               "hand: token_mask ratios");
        o.vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[0] == 1.0 && factor[2] == 1.0 && factor[3] == 2.0 && factor[5] == 2.0 &&
                   rs.metrics.is_ratio_min == 1.0 && rs.metrics.is_ratio_max == 2.0 && rs.metrics.is_ratio_mean == 1.5,
               "hand: sequence_truncate ratios and their metrics over the rows");
        o.vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_SEQUENCE_MASK;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[0] == 1.0 && factor[3] == 0.0 && rs.metrics.is_ratio_mean == 0.5,
               "hand: sequence_mask ratios");
        o.vllm_importance_sampling_correction = 0;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[3] == 1.0 && isnan(rs.metrics.is_ratio_mean) && isnan(rs.metrics.sampling_logp_diff_max),
               "hand: correction off: no ratio, no sampling metrics");
        /* Off-policy mask: row 1 (A < 0) has mean(samp - logp) = -0.5: kept at threshold -0.5, dropped below. */
        o.off_policy_mask_threshold = -0.5;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[3] == 1.0 && factor[0] == 1.0, "hand: off-policy mask keeps");
        o.off_policy_mask_threshold = -0.51;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[3] == 0.0 && factor[5] == 0.0 && factor[0] == 1.0, "hand: off-policy mask drops A < 0");
        /* Without sampling log-probs it measures old - sg(logp) = (-0.5, 0, 0 | 0.5): row 1 is dropped at 0.4. */
        ts.sampling_logp = NULL;
        o.off_policy_mask_threshold = 0.4;
        ref_grpo_head(&ts, &o, 1.0, &rs, NULL, NULL);
        fd_expect(factor[3] == 0.0 && factor[0] == 1.0, "hand: off-policy mask from the old log-probs");
    }

    /* torch.quantile (values from torch 1.13 on the fp32 tensor). */
    {
        static const double qs[5] = {0.0, 0.3, 1.0 / 3.0, 0.7, 1.0};
        static const double torch_values[5] = {0.25, 0.90000003576278687, 1.0, 2.0999999046325684, 3.0};
        for (int k = 0; k < 5; k++) {
            double v[7] = {0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 2.5};
            fd_expect(ref_grpo_quantile(v, 7, qs[k]) == torch_values[k], "hand: quantile as torch.quantile");
        }
        double one = 4.0;
        fd_expect(ref_grpo_quantile(&one, 1, 0.3) == 4.0, "hand: quantile of one value");
        /* 1 - 0.7 = 0.30000000000000004 in double, 0.3f in torch: 0.3f * 30 rounds to 9 exactly, and the quantile of
         * 0, 0.1, ..., 3 (as fp32) is the 10th value itself (torch: 0.90000003576278687), kept by >=. At 50 the
         * fp32 rank is 15.000001: torch.quantile(arange(51) * 0.1, 0.3) = 1.5000001192092896. */
        double tenths[51];
        for (int k = 0; k < 31; k++)
            tenths[k] = (float)(0.1f * (float)k);
        fd_expect(ref_grpo_quantile(tenths, 31, 1.0 - 0.7) == (double)(float)(0.1f * 9.0f),
               "hand: the quantile's rank rounds to an integer in fp32");
        for (int k = 0; k < 51; k++)
            tenths[k] = (float)(0.1f * (float)k);
        fd_expect(ref_grpo_quantile(tenths, 51, 1.0 - 0.7) == 1.5000001192092896, "hand: the quantile's fp32 rank");
    }

    /* Top-entropy mask and the entropy bonus's normaliser. H = (0.5, 2, 1, 3 | 9, 9), the quantile at 1 - q = 0.5 of
     * the four valid entropies is 1.5: e = (0, 1, 0, 1 | 0, 0). Every loss type (TRL 1.16.0), dapo with
     * num_items_in_batch = 10 too: bonus = 5 / sum(e m) = 5 / 2. */
    {
        const double H[6] = {0.5, 2.0, 1.0, 3.0, 9.0, 9.0};
        ref_grpo_tokens te = tk;
        te.entropy = H;
        double factor[6], ge[6];
        ref_grpo_result rs;
        memset(&rs, 0, sizeof rs);
        rs.policy_factor = factor;
        ref_grpo_options_default(&o);
        o.top_entropy_quantile = 0.5;
        o.entropy_coef = 0.1;
        o.num_items_in_batch = 10.0;
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, ge);
        fd_expect(factor[0] == 0.0 && factor[1] == 1.0 && factor[2] == 0.0 && factor[3] == 1.0 && factor[4] == 0.0,
               "hand: top-entropy mask");
        fd_expect(fabs(rs.loss - (rs.metrics.policy_loss - 0.1 * 2.5)) < 1e-15 && rs.metrics.entropy_coef == 0.1 &&
                      ge[0] == 0.0 && fabs(ge[1] + 0.05) < 1e-17 && ge[4] == 0.0,
                  "hand: dapo's entropy bonus over sum(e m), not N");
        o.loss_type = REF_GRPO_LOSS_GRPO;
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, ge);
        fd_expect(fabs(rs.loss - (rs.metrics.policy_loss - 0.1 * 2.5)) < 1e-15 && fabs(ge[1] + 0.05) < 1e-17,
               "hand: grpo's entropy bonus over sum(e m)");
        fd_expect(rs.metrics.entropy == 6.5 / 4.0, "hand: the entropy metric ignores the entropy mask");
        o.top_entropy_quantile = 1.0;
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, ge);
        fd_expect(fabs(rs.loss - (rs.metrics.policy_loss - 0.1 * 6.5 / 4.0)) < 1e-15, "hand: masked mean bonus");
        o.top_entropy_quantile = 0.0; /* the largest entropy only */
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, ge);
        fd_expect(factor[3] == 1.0 && factor[1] == 0.0, "hand: quantile 0 keeps the largest");
        /* num_items_in_batch is clamped to >= 1 (TRL): 0.25 normalises as 1 */
        ref_grpo_options_default(&o);
        o.entropy_coef = 0.1;
        o.num_items_in_batch = 0.25;
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, NULL);
        const double quarter = rs.loss;
        o.num_items_in_batch = 1.0;
        ref_grpo_head(&te, &o, 1.0, &rs, NULL, NULL);
        fd_expect(quarter == rs.loss && fabs(rs.loss - (rs.metrics.policy_loss - 0.1 * 6.5 / 4.0)) < 1e-15,
                  "hand: num_items_in_batch clamped to 1 (the bonus over sum m)");
    }

    /* Bias-corrected KL: kl r, the metric too. logp = 0, ref = 0.3: k3 = e^0.3 - 1.3 on every token. */
    {
        const double refl[6] = {0.3, 0.3, 0.3, 0.3, 0.3, 0.3};
        ref_grpo_tokens tb = tk;
        tb.ref_logp = refl;
        ref_grpo_options_default(&o);
        o.loss_type = REF_GRPO_LOSS_GRPO;
        o.beta = 0.1;
        o.use_bias_correction_kl = 1;
        ref_grpo_head(&tb, &o, 1.0, &r, NULL, NULL);
        const double k3 = exp(0.3) - 1.3;
        fd_expect(fabs(r.metrics.kl - k3 * (exp(0.5) + 2.0 + exp(-0.5)) / 4.0) < 1e-15, "hand: bias-corrected kl");
    }

    /* Invalid arguments. */
    {
        const double samp[6] = {0, 0, 0, 0, 0, 0};
        ref_grpo_tokens ts = tk;
        ts.sampling_logp = samp;
        const double qs[3] = {1.5, -0.1, NAN};
        for (int k = 0; k < 3; k++) {
            ref_grpo_options_default(&o);
            o.top_entropy_quantile = qs[k];
            fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "top_entropy_quantile outside [0, 1]");
        }
        ref_grpo_options_default(&o);
        o.top_entropy_quantile = 0.5;
        fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "an entropy mask without entropies is rejected");
        ref_grpo_options_default(&o);
        o.vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_TOKEN_TRUNCATE;
        o.vllm_importance_sampling_clip_max = NAN;
        fd_expect(ref_grpo_head(&ts, &o, 1.0, &r, NULL, NULL) == -2, "truncate without bounds is rejected");
        fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == 0, "... but only where the correction applies");
        ref_grpo_options_default(&o);
        o.vllm_importance_sampling_clip_min = 3.0;
        fd_expect(ref_grpo_head(&ts, &o, 1.0, &r, NULL, NULL) == -2, "clip_min >= clip_max is rejected");
        ref_grpo_options_default(&o);
        o.loss_type = REF_GRPO_LOSS_VESPO;
        fd_expect(ref_grpo_head(&ts, &o, 1.0, &r, NULL, NULL) == -2, "vespo with a sequence mode is rejected");
        o.vllm_importance_sampling_correction = 0;
        fd_expect(ref_grpo_head(&ts, &o, 1.0, &r, NULL, NULL) == 0, "... but not without the correction");
    }
    ref_grpo_options_default(&o);
    o.beta = 0.04;
    fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "beta without ref_logp is rejected");
    ref_grpo_options_default(&o);
    o.entropy_coef = 0.1;
    fd_expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "entropy bonus without entropies is rejected");
}

/* The options TRL added up to f2cd5771, each at every level, with and without old log-probs, in combinations that
 * put every one of them next to luspo and vespo and next to the other loss types (b: beta, ent: entropy bonus,
 * 1 TRL's, 2 per token; is: -2 sampling log-probs without the correction, -1 none, else the mode). */
typedef struct new_row {
    ref_grpo_loss_type lt;
    double beta, delta;
    int is_mode; /* -2: sampling log-probs, correction off; -1: no sampling log-probs */
    double clip_min, clip_max, off_policy, quantile;
    int bias_kl, entropy, padded_ids_out;
} new_row;

static const new_row new_rows[] = {
    {REF_GRPO_LOSS_LUSPO, 0.0, NAN, -1, NAN, NAN, NAN, 1.0, 0, 0, 0},
    {REF_GRPO_LOSS_LUSPO, 0.04, 1.5, -1, NAN, NAN, NAN, 1.0, 0, 1, 1},
    {REF_GRPO_LOSS_LUSPO, 0.04, NAN, REF_GRPO_VLLM_IS_TOKEN_TRUNCATE, 0.9, 1.2, NAN, 1.0, 1, 2, 0},
    {REF_GRPO_LOSS_LUSPO, 0.04, NAN, REF_GRPO_VLLM_IS_SEQUENCE_MASK, 0.5, 3.0, 0.0, 0.5, 0, 1, 1},
    {REF_GRPO_LOSS_VESPO, 0.0, NAN, -1, NAN, NAN, NAN, 1.0, 0, 0, 0},
    {REF_GRPO_LOSS_VESPO, 0.04, NAN, REF_GRPO_VLLM_IS_TOKEN_MASK, 0.8, 1.25, NAN, 1.0, 1, 1, 0},
    {REF_GRPO_LOSS_VESPO, 0.0, NAN, REF_GRPO_VLLM_IS_TOKEN_TRUNCATE, NAN, 1.1, 0.0, 0.4, 0, 1, 1},
    {REF_GRPO_LOSS_GRPO, 0.0, NAN, REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE, 0.5, 2.0, NAN, 0.5, 0, 1, 0},
    {REF_GRPO_LOSS_CISPO, 0.04, NAN, REF_GRPO_VLLM_IS_SEQUENCE_MASK, 0.5, 3.0, 0.0, 1.0, 1, 0, 0},
    {REF_GRPO_LOSS_SAPO, 0.0, NAN, REF_GRPO_VLLM_IS_TOKEN_MASK, NAN, 1.2, NAN, 0.3, 0, 1, 0},
    {REF_GRPO_LOSS_DAPO, 0.0, NAN, -2, NAN, NAN, 0.05, 0.0, 0, 1, 0},
    {REF_GRPO_LOSS_BNPO, 0.04, NAN, -1, NAN, NAN, 0.0, 1.0, 1, 1, 0},
    {REF_GRPO_LOSS_DR_GRPO, 0.04, 1.5, REF_GRPO_VLLM_IS_SEQUENCE_MASK, NAN, 3.0, NAN, 0.6, 1, 1, 0},
    {REF_GRPO_LOSS_GRPO, 0.04, NAN, -1, NAN, NAN, NAN, 1.0, 1, 1, 0},
    {REF_GRPO_LOSS_DAPO, 0.04, 1.5, REF_GRPO_VLLM_IS_TOKEN_TRUNCATE, 0.9, NAN, NAN, 0.5, 1, 2, 0},
};

int main(void)
{
    static const ref_grpo_is_level levels[3] = {REF_GRPO_IS_TOKEN, REF_GRPO_IS_SEQUENCE, REF_GRPO_IS_SEQUENCE_TOKEN};
    int index = 0, cases = 0;
    hand_checks();
    printf("hand-worked checks: %s\n", fd_failures ? "FAIL" : "ok");
    for (int lt = REF_GRPO_LOSS_GRPO; lt <= REF_GRPO_LOSS_SAPO; lt++)
        for (int l = 0; l < 3; l++)
            for (int with_old = 1; with_old >= 0; with_old--)
                for (int kb = 0; kb < 2; kb++)
                    for (int kd = 0; kd < 2; kd++) {
                        fd_config c = fd_base((ref_grpo_loss_type)lt, levels[l], with_old, kb ? 0.04 : 0.0,
                                              kd ? 1.5 : NAN);
                        /* the entropy bonus in both forms on a quarter of the cases each */
                        c.entropy = index % 4 == 1 ? 2 : index % 4 == 2 ? 1 : 0;
                        fd_case(index++, &c);
                        cases++;
                    }
    for (size_t k = 0; k < sizeof new_rows / sizeof new_rows[0]; k++)
        for (int l = 0; l < 3; l++)
            for (int with_old = 1; with_old >= 0; with_old--) {
                const new_row *nr = &new_rows[k];
                fd_config c = fd_base(nr->lt, levels[l], with_old, nr->beta, nr->delta);
                c.sampling = nr->is_mode != -1;
                c.is_mode = nr->is_mode < 0 ? -1 : nr->is_mode;
                c.clip_min = nr->clip_min;
                c.clip_max = nr->clip_max;
                c.off_policy = nr->off_policy;
                c.quantile = nr->quantile;
                c.bias_kl = nr->bias_kl;
                c.entropy = nr->entropy;
                c.padded_ids_out = nr->padded_ids_out;
                fd_case(index++, &c);
                cases++;
            }
    printf("%d finite-difference cases, %d failures\n", cases, fd_failures);
    return fd_failures ? 1 : 0;
}
