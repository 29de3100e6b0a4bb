/* ref_grpo_fdcheck: checks ref_grpo_backward against central finite differences of ref_grpo_forward, and a
 * few values that can be worked out by hand, over every loss_type x importance-sampling level x {old logps
 * given, on-policy} x {beta 0, 0.04} x {no delta, delta 1.5}. Prints one line per case, exits non-zero on any
 * failure.
 *
 *   gcc -std=c11 -Wall -Wextra -O2 -Iref ref/ref_linear.c ref/ref_grpo.c tests/ref_grpo_fdcheck.c -lm -o ref_grpo_fdcheck
 *
 * Stop-gradients. TRL's gradient is not the derivative of its forward value: the on-policy old logp, cispo's
 * clamped ratio and GSPO-token's sg(.) terms are detached. The finite differences therefore differentiate the
 * forward with every sg(.) frozen at the base point (ref_grpo_problem.sg_logp = logp at the base point); that
 * function equals TRL's loss at the base point and its derivative there is TRL's autograd gradient. The
 * analytic side runs with sg_logp = NULL, as a user would.
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
 * largest seen over all cases). The gradients here have S between 0.05 and 0.6, so an entry of at least
 * 1e-2 * S is resolved to ~1e-7 relative or better; smaller entries (near-zero ones, e.g. where clipping
 * removes most of a column's gradient) cannot be resolved to 1e-6 relative with this step and are held
 * instead to 1e-8 * S absolute through the floor. A correct backward lands at ~1e-7 at worst, so 1e-6 leaves
 * an order of magnitude of slack, while a wrong formula (a missing mask or 1/temperature, a wrong normaliser,
 * a gradient through a detached term, a clamp that does not block) is off by at least ~1e-2 of S (the entropy
 * bonus and the KL, the smallest terms, are of that size), four orders above the tolerance. */
#include "ref_grpo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 3, T = 5, HID = 4, V = 7, N = B * T };
static const double TEMPERATURE = 0.7, STEP = 1e-6, TOLERANCE = 1e-6;

static uint64_t rng_state;
static double uniform(double lo, double hi) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static const char *loss_name[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"};
static const char *level_name[] = {"token", "sequence", "seq_token"};

static int failures;

static void expect(int ok, const char *what)
{
    if (!ok) {
        printf("FAIL: %s\n", what);
        failures++;
    }
}

static double rel_err(double f, double g, double floor)
{
    double d = fabs(f) > fabs(g) ? fabs(f) : fabs(g);
    if (d < floor)
        d = floor;
    return d > 0.0 ? fabs(f - g) / d : fabs(f - g);
}

/* Loss at the current parameters, every sg(.) frozen at anchor. */
static double loss_at(const ref_grpo_problem *base, const ref_grpo_options *o, const double *anchor)
{
    ref_grpo_problem p = *base;
    p.sg_logp = anchor;
    ref_grpo_result r;
    memset(&r, 0, sizeof r);
    if (ref_grpo_forward(&p, o, &r)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    return r.loss;
}

/* Max error of the analytic gradient g against central differences over every entry of param. */
static double fd_tensor(const ref_grpo_problem *p, const ref_grpo_options *o, const double *anchor, double *param,
                        const double *g, int count, double floor)
{
    double worst = 0.0;
    for (int k = 0; k < count; k++) {
        const double keep = param[k];
        param[k] = keep + STEP;
        const double up = loss_at(p, o, anchor);
        param[k] = keep - STEP;
        const double down = loss_at(p, o, anchor);
        param[k] = keep;
        const double e = rel_err((up - down) / (2.0 * STEP), g[k], floor);
        if (e > worst || isnan(e))
            worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

static double max_abs(const double *a, int count)
{
    double m = 0.0;
    for (int k = 0; k < count; k++)
        if (fabs(a[k]) > m)
            m = fabs(a[k]);
    return m;
}

static int fd_case(int index, ref_grpo_loss_type lt, ref_grpo_is_level lvl, int with_old, double beta, double delta)
{
    rng_state = 0x5EED0000ull + (uint64_t)index * 7919u;
    double x[N * HID], w[HID * V], bias[V], mask[N], adv[B], old[N], ref[N], logp0[N], ent0[N];
    int64_t ids[N];
    for (int k = 0; k < N * HID; k++)
        x[k] = uniform(-1.0, 1.0);
    for (int k = 0; k < HID * V; k++)
        w[k] = uniform(-1.2, 1.2);
    for (int k = 0; k < V; k++)
        bias[k] = uniform(-0.5, 0.5);
    for (int k = 0; k < N; k++)
        ids[k] = (int64_t)(uniform(0.0, 1.0) * V) % V;
    /* Row 0 has a padded tail, row 1 is full, row 2 is all padding in even cases and short in odd ones. */
    static const double mask_rows[2][B][T] = {{{1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}, {0, 0, 0, 0, 0}},
                                              {{1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}, {1, 1, 0, 0, 0}}};
    memcpy(mask, mask_rows[index % 2], sizeof mask);
    /* Advantages of both signs and zero, permuted over the rows; the full row 1 never gets 0. */
    static const double adv_perms[4][B] = {{0.9, -0.7, 0.0}, {0.0, 0.9, -0.7}, {-0.7, 0.9, 0.0}, {0.0, -0.7, 0.9}};
    memcpy(adv, adv_perms[index % 4], sizeof adv);

    ref_grpo_options o;
    ref_grpo_options_default(&o);
    o.loss_type = lt;
    o.importance_sampling_level = lvl;
    o.temperature = TEMPERATURE;
    o.beta = beta;
    o.delta = delta;
    if (lt == REF_GRPO_LOSS_DAPO)
        o.epsilon_high = 0.28; /* DAPO's clip-higher */
    if (lt == REF_GRPO_LOSS_CISPO)
        o.epsilon_high = 1.25; /* absolute cap: some ratios above, some below */
    if (lt == REF_GRPO_LOSS_DAPO && index % 2)
        o.num_items_in_batch = 12.5;
    if (lt == REF_GRPO_LOSS_DR_GRPO && index % 2)
        o.max_completion_length = 8;
    if (index % 4 == 1 || index % 4 == 2) {
        o.entropy_coef = 0.05;
        o.entropy_bonus = index % 4 == 1 ? REF_GRPO_ENTROPY_PER_TOKEN : REF_GRPO_ENTROPY_MASKED_MEAN;
    }

    ref_grpo_problem p = {B, T, HID, V, x, w, bias, ids, mask, adv, NULL, NULL, NULL};
    ref_grpo_result r0;
    memset(&r0, 0, sizeof r0);
    r0.logp = logp0;
    r0.entropy = ent0;
    ref_grpo_options on_policy = o;
    on_policy.beta = 0.0;
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
            old[b * T + t] = logp0[b * T + t] - (d + uniform(-0.04, 0.04));
    }
    for (int k = 0; k < N; k++)
        ref[k] = logp0[k] + uniform(-0.3, 0.3);
    p.old_logp = with_old ? old : NULL;
    p.ref_logp = beta != 0.0 ? ref : NULL;

    double dx[N * HID], dw[HID * V], db[V];
    if (ref_grpo_backward(&p, &o, 1.0, dx, dw, db)) {
        printf("FAIL: backward returned an error\n");
        exit(2);
    }
    /* Every gradient path carries the mask: padded tokens' hidden states get exactly nothing. */
    int padded_zero = 1;
    for (int i = 0; i < N; i++)
        for (int k = 0; k < HID; k++)
            if (mask[i] == 0.0 && dx[i * HID + k] != 0.0)
                padded_zero = 0;
    expect(padded_zero, "dx of a padded token is not exactly 0");

    /* The anchored forward is TRL's forward at the base point. */
    ref_grpo_result plain, anchored;
    memset(&plain, 0, sizeof plain);
    memset(&anchored, 0, sizeof anchored);
    ref_grpo_forward(&p, &o, &plain);
    ref_grpo_problem pa = p;
    pa.sg_logp = logp0;
    ref_grpo_forward(&pa, &o, &anchored);
    expect(plain.loss == anchored.loss, "the anchored forward differs from the forward at the base point");

    /* On-policy, beta 0, no entropy bonus: the ratio is 1 and the loss is minus the mean advantage of the
     * non-empty rows (grpo/sapo-style per-row mean: sapo's gate is 4/tau * sigmoid(0) = 2/tau). */
    if (!with_old && beta == 0.0 && o.entropy_coef == 0.0 &&
        (lt == REF_GRPO_LOSS_GRPO || lt == REF_GRPO_LOSS_SAPO)) {
        double expected = 0.0;
        for (int b = 0; b < B; b++) {
            double nb = 0.0;
            for (int t = 0; t < T; t++)
                nb += mask[b * T + t];
            const double tau = adv[b] > 0.0 ? o.sapo_temperature_pos : o.sapo_temperature_neg;
            if (nb > 0.0)
                expected -= (lt == REF_GRPO_LOSS_SAPO ? 2.0 / tau : 1.0) * adv[b] / B;
        }
        expect(fabs(plain.loss - expected) <= 1e-15, "on-policy loss is not -mean(A)");
    }

    const double scale = fmax(max_abs(dx, N * HID), fmax(max_abs(dw, HID * V), max_abs(db, V)));
    const double floor = 1e-2 * scale;
    const double ex = fd_tensor(&p, &o, logp0, x, dx, N * HID, floor);
    const double ew = fd_tensor(&p, &o, logp0, w, dw, HID * V, floor);
    const double eb = fd_tensor(&p, &o, logp0, bias, db, V, floor);
    const double worst = fmax(ex, fmax(ew, eb));
    char name[96];
    snprintf(name, sizeof name, "%-7s %-9s %-6s beta=%-4g delta=%-3s ent=%s", loss_name[lt], level_name[lvl],
             with_old ? "old" : "onpol", beta, delta > 0.0 ? "1.5" : "off",
             o.entropy_coef == 0.0 ? "--  " : o.entropy_bonus == REF_GRPO_ENTROPY_PER_TOKEN ? "tok " : "mean");
    printf("%3d %s  |g|max=%.2e  rel dx=%.1e dW=%.1e db=%.1e  %s\n", index, name, scale, ex, ew, eb,
           worst <= TOLERANCE ? "ok" : "FAIL");
    if (!(worst <= TOLERANCE))
        failures++;
    return 0;
}

/* Hand-worked values for TRL's quirks: metric denominators, the delta-clamped coef_1 in the clip flags,
 * min's gradient on ties and past the clip bounds. B = 2, T = 3, logp = 0. */
static void hand_checks(void)
{
    const double logp[6] = {0, 0, 0, 0, 0, 0}, mask[6] = {1, 1, 1, 1, 0, 0}, adv[2] = {1.0, -1.0};
    const double old[6] = {-0.5, 0, 0, 0.5, 0, 0}; /* ratios e^0.5 = 1.65 (A > 0), 1, 1 | e^-0.5 = 0.61 (A < 0) */
    ref_grpo_tokens tk = {2, 3, logp, NULL, mask, adv, old, NULL, NULL};
    ref_grpo_options o;
    ref_grpo_options_default(&o);
    ref_grpo_result r;
    memset(&r, 0, sizeof r);
    double g[6], gh[6];

    /* Token level grpo: row 0 = (-1.2 - 1 - 1) / 3, row 1 = -min(-0.61, -0.8) = 0.8; loss = mean of rows.
     * Clipped tokens get no gradient, the two r = 1 tokens (min tie) get -A * w = -1/6. */
    expect(ref_grpo_head(&tk, &o, 1.0, &r, g, gh) == 0, "head failed");
    expect(fabs(r.loss - (-3.2 / 3.0 + 0.8) / 2.0) < 1e-15, "hand: token grpo loss");
    expect(g[0] == 0.0 && fabs(g[1] + 1.0 / 6.0) < 1e-16 && fabs(g[2] + 1.0 / 6.0) < 1e-16 && g[3] == 0.0 &&
               g[4] == 0.0 && g[5] == 0.0,
           "hand: token grpo g_logp");
    expect(r.metrics.clip_high_mean == 0.25 && r.metrics.clip_low_mean == 0.25 &&
               r.metrics.clip_region_mean == 0.5,
           "hand: token clip ratios are masked token means");
    expect(isnan(r.metrics.kl) && isnan(r.metrics.entropy) && isnan(r.metrics.cispo_clip_ratio),
           "hand: absent metrics are NaN");

    /* delta = 1.1 clamps coef_1 to 1.1 before the flags: the high clip disappears from the metric. */
    o.delta = 1.1;
    ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL);
    expect(r.metrics.clip_high_mean == 0.0 && r.metrics.clip_low_mean == 0.25, "hand: delta-clamped flags");
    /* and token 0 now takes the c1 branch: -min(1.1, 1.2) = -1.1 with gradient 0 (clamp past delta). */
    expect(fabs(r.loss - (-3.1 / 3.0 + 0.8) / 2.0) < 1e-15, "hand: delta loss");
    o.delta = NAN;

    /* Sequence level: s_0 = 0.5 / 3 (r = 1.18, inside), s_1 = -0.5 (r = 0.61, clipped low, A < 0). The flags
     * are averaged over the B = 2 rows: low = 1/2. Row 1's loss is 0.8 with no gradient; row 0's three tokens
     * share d/ds = -A r_0 / 3 (from the row mean) times mask / n_0. */
    o.importance_sampling_level = REF_GRPO_IS_SEQUENCE;
    ref_grpo_head(&tk, &o, 1.0, &r, g, NULL);
    const double r0 = exp(0.5 / 3.0);
    expect(r.metrics.clip_low_mean == 0.5 && r.metrics.clip_high_mean == 0.0 && r.metrics.clip_region_mean == 0.5,
           "hand: sequence clip ratios are row means");
    expect(fabs(r.loss - (-r0 + 0.8) / 2.0) < 1e-15, "hand: sequence loss");
    expect(fabs(g[0] + r0 / 6.0) < 1e-15 && fabs(g[1] - g[0]) == 0.0 && fabs(g[2] - g[0]) == 0.0 && g[3] == 0.0,
           "hand: sequence g_logp spreads over the row");

    /* GSPO-token: same value, but each token only gets its own share: d/dlogp_t = -A r_0 * w_t = -r_0 / 6. */
    o.importance_sampling_level = REF_GRPO_IS_SEQUENCE_TOKEN;
    ref_grpo_head(&tk, &o, 1.0, &r, g, NULL);
    expect(fabs(r.loss - (-r0 + 0.8) / 2.0) < 1e-15, "hand: sequence_token loss");
    expect(fabs(g[0] + r0 / 6.0) < 1e-15 && g[1] == g[0] && g[2] == g[0], "hand: sequence_token g_logp");

    /* An all-padding batch: every clamp(min=1) guard holds, loss 0, metrics 0 (TRL: 0 / 1). */
    const double none[6] = {0, 0, 0, 0, 0, 0};
    ref_grpo_tokens empty = {2, 3, logp, logp, none, adv, old, NULL, NULL};
    for (int lt = REF_GRPO_LOSS_GRPO; lt <= REF_GRPO_LOSS_SAPO; lt++) {
        ref_grpo_options_default(&o);
        o.loss_type = (ref_grpo_loss_type)lt;
        ref_grpo_head(&empty, &o, 1.0, &r, g, gh);
        expect(r.loss == 0.0 && r.metrics.entropy == 0.0, "hand: all-padding loss is 0");
    }

    /* Invalid arguments. */
    ref_grpo_options_default(&o);
    o.beta = 0.04;
    expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "beta without ref_logp is rejected");
    ref_grpo_options_default(&o);
    o.entropy_coef = 0.1;
    expect(ref_grpo_head(&tk, &o, 1.0, &r, NULL, NULL) == -2, "entropy bonus without entropies is rejected");
}

int main(void)
{
    static const ref_grpo_is_level levels[3] = {REF_GRPO_IS_TOKEN, REF_GRPO_IS_SEQUENCE, REF_GRPO_IS_SEQUENCE_TOKEN};
    int index = 0, cases = 0;
    hand_checks();
    printf("hand-worked checks: %s\n", failures ? "FAIL" : "ok");
    for (int lt = REF_GRPO_LOSS_GRPO; lt <= REF_GRPO_LOSS_SAPO; lt++)
        for (int l = 0; l < 3; l++)
            for (int with_old = 1; with_old >= 0; with_old--)
                for (int kb = 0; kb < 2; kb++)
                    for (int kd = 0; kd < 2; kd++) {
                        fd_case(index++, (ref_grpo_loss_type)lt, levels[l], with_old, kb ? 0.04 : 0.0,
                                kd ? 1.5 : NAN);
                        cases++;
                    }
    printf("%d finite-difference cases, %d failures\n", cases, failures);
    return failures ? 1 : 0;
}
