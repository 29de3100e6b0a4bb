/* ref_preference_fdcheck: checks ref_preference_backward against central finite differences of
 * ref_preference_forward, and values worked out by hand, over dpo {sigmoid, hinge, ipo, robust} x reference
 * {none, sequence, token} x rpo_alpha {0, 0.5}, cpo {sigmoid, hinge, ipo} x cpo_alpha {0, 1}, simpo x cpo_alpha
 * {0, 1} and orpo; label smoothing 0.1 on half of the sigmoid and robust cases (dpo at TRL v0.28's semantics); and
 * dpo at TRL's current semantics: each of its 15 loss types alone (beta 0.5) and three weighted lists (MPO's
 * sigmoid + bco_pair + sft; aot + aot_unpaired + nca_pair; ipo + sigmoid_norm + discopop + apo_down with a negative
 * weight). Prints one line per case, exits non-zero on any failure.
 *
 *   gcc -std=c11 -Wall -Wextra -O2 -Iref ref/ref_linear.c ref/ref_grpo.c ref/ref_preference.c \
 *       tests/ref_preference_fdcheck.c -lm -o ref_preference_fdcheck
 *
 * Inputs. B = 3 pairs of T = 5 tokens, H = 4, V = 7, bias on. Masks have padded tails whose targets are outside
 * [0, V) on every other padded position; the rejected sequence of pair 2 is fully masked except for orpo, where
 * an empty sequence has l = 0 and log(1 - e^0) = -inf. Reference log-probs are the policy's at the base point plus
 * noise (sequence: the aggregated l plus U(-1, 1); token: each logp plus U(-0.5, 0.5)).
 *
 * Smoothness. Every loss is smooth in the logits except hinge at beta u = 1, where relu switches: the case checks
 * that every pair's beta u (the reward margin) is at least 0.02 from 1, while a step of 1e-6 moves it by about
 * 1e-6 beta T. ORPO needs c, r < 0, which averaged log-probs of non-empty sequences are.
 *
 * Tolerance. As in ref_grpo_fdcheck.c: for each gradient entry g (analytic) and f (finite difference) the error is
 * |f - g| / max(|f|, |g|, 1e-2 S), S the largest |g| over dx, dW and dbias of the case, and every case must stay
 * <= 1e-6. Central differences with h = 1e-6 in double have truncation error h^2 |L'''| / 6 ~ 1e-12 (logits O(1),
 * the loss's third derivatives O(1) for these betas) and rounding error ~ eps |L| / h: the largest loss here is
 * ipo's (u - 1 / (2 beta))^2 ~ 35, i.e. ~ 8e-9 absolute on the difference quotient against S ~ 2 - 5 there; the
 * other losses are O(1) with S 0.04 - 0.6 (SimPO at its paper's beta 2: at beta 0.1 its S is 0.014 and the noise
 * reaches 6e-7 of the floor). So the floor 1e-2 S resolves every entry to < 1e-6 and most far better (the largest
 * printed error is 1.9e-7). A wrong formula (a missing mask, a wrong average or sign, the NLL on the wrong half, a
 * gradient through the reference) is off by at least ~1e-2 of S, four orders above the tolerance. */
#include "fdcheck.h"
#include "ref_preference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 3, T = 5, S = 2 * B, N = S * T, HID = 4, V = 7 };
static const double STEP = 1e-6, TOLERANCE = 1e-6, HINGE_GUARD = 0.02;
/* Hand-worked values: a few operations in double, so within a few ulps. */
static const double HAND_TOL = 1e-14;

static const char *loss_name[] = {"dpo", "orpo", "simpo", "cpo"};
static const char *type_name[] = {"sigmoid",  "hinge",    "ipo",       "robust", "exo_pair",
                                  "nca_pair", "bco_pair", "sppo_hard", "aot",    "aot_unpaired",
                                  "apo_zero", "apo_down", "discopop",  "sft",    "sigmoid_norm"};
static const char *ref_name[] = {"none", "seq", "token"};

static ref_preference_result forward_or_die(const ref_preference_problem *p, const ref_preference_options *o,
                                            double *seq_logps, double *rewards, double *logp)
{
    ref_preference_result r;
    memset(&r, 0, sizeof r);
    r.sequence_logps = seq_logps;
    r.rewards = rewards;
    r.logp = logp;
    if (ref_preference_forward(p, o, &r)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    return r;
}

/* Max error of the analytic gradient g against central differences over every entry of param. */
static double fd_tensor(const ref_preference_problem *p, const ref_preference_options *o, double *param,
                        const double *g, int count, double floor)
{
    double worst = 0.0;
    for (int k = 0; k < count; k++) {
        const double keep = param[k];
        param[k] = keep + STEP;
        const double up = forward_or_die(p, o, NULL, NULL, NULL).loss;
        param[k] = keep - STEP;
        const double down = forward_or_die(p, o, NULL, NULL, NULL).loss;
        param[k] = keep;
        const double e = fd_rel_err((up - down) / (2.0 * STEP), g[k], floor);
        if (e > worst || isnan(e))
            worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

enum { REF_NONE, REF_SEQUENCE, REF_TOKEN };

static void fd_case(int index, const ref_preference_options *o, int ref_mode)
{
    fd_rng_state = 0x9A1F0000ull + (uint64_t)index * 7919u;
    double x[N * HID], w[HID * V], bias[V], mask[N], ref_seq[S], ref_tok[N], logp0[N], l0[S], rewards[S];
    int64_t targets[N];
    fd_fill(x, N * HID, -1.0, 1.0);
    fd_fill(w, HID * V, -1.2, 1.2);
    fd_fill(bias, V, -0.5, 0.5);
    /* Sequence lengths, chosen then rejected; the last rejected one is empty unless the loss is orpo. */
    static const int lengths[2][S] = {{5, 3, 4, 4, 5, 0}, {4, 5, 2, 3, 4, 0}};
    for (int s = 0; s < S; s++) {
        int length = lengths[index % 2][s];
        if (length == 0 && o->loss == REF_PREFERENCE_ORPO)
            length = 2;
        for (int t = 0; t < T; t++) {
            const int i = s * T + t;
            mask[i] = t < length ? 1.0 : 0.0;
            targets[i] = (int64_t)(fd_uniform(0.0, 1.0) * V) % V;
            if (t >= length && (t & 1))
                targets[i] = t == 1 ? -100 : V + t; /* padding outside the vocabulary */
        }
    }
    ref_preference_problem p = {B, T, HID, V, x, w, bias, targets, mask, NULL, NULL};
    forward_or_die(&p, o, l0, NULL, logp0);
    for (int s = 0; s < S; s++)
        ref_seq[s] = l0[s] + fd_uniform(-1.0, 1.0);
    for (int i = 0; i < N; i++)
        ref_tok[i] = logp0[i] + fd_uniform(-0.5, 0.5);
    p.ref_logps = ref_mode == REF_SEQUENCE ? ref_seq : NULL;
    p.ref_per_token_logps = ref_mode == REF_TOKEN ? ref_tok : NULL;

    const ref_preference_result r0 = forward_or_die(&p, o, NULL, rewards, NULL);
    int hinge = o->loss_type == REF_PREFERENCE_HINGE;
    for (int k = 0; k < o->count; k++)
        hinge |= o->types[k] == REF_PREFERENCE_HINGE;
    if (hinge)
        for (int b = 0; b < B; b++)
            fd_expect(fabs(1.0 - (rewards[b] - rewards[B + b])) >= HINGE_GUARD, "a hinge pair sits at its kink");
    fd_expect(isfinite(r0.loss), "the loss is not finite");

    double dx[N * HID], dw[HID * V], db[V];
    if (ref_preference_backward(&p, o, 1.0, dx, dw, db)) {
        printf("FAIL: backward returned an error\n");
        exit(2);
    }
    /* Padded tokens' hidden states get exactly nothing. */
    int padded_zero = 1;
    for (int i = 0; i < N; i++)
        for (int k = 0; k < HID; k++)
            padded_zero &= mask[i] != 0.0 || dx[i * HID + k] == 0.0;
    fd_expect(padded_zero, "dx of a padded token is not exactly 0");

    const double scale = fmax(fd_max_abs(dx, N * HID), fmax(fd_max_abs(dw, HID * V), fd_max_abs(db, V)));
    const double floor = 1e-2 * scale;
    const double ex = fd_tensor(&p, o, x, dx, N * HID, floor);
    const double ew = fd_tensor(&p, o, w, dw, HID * V, floor);
    const double eb = fd_tensor(&p, o, bias, db, V, floor);
    const double worst = fmax(ex, fmax(ew, eb));
    char types[160] = "";
    for (int k = 0; k < (o->count ? o->count : 1); k++)
        snprintf(types + strlen(types), sizeof types - strlen(types), "%s%s", k ? "," : "",
                 type_name[o->count ? o->types[k] : o->loss_type]);
    printf("%3d %-5s %-4s %-26s ref=%-5s ls=%-4g rpo=%-3g cpo=%-3g  loss=%9.4f |g|max=%.2e  rel dx=%.1e dW=%.1e "
           "db=%.1e  %s\n",
           index, loss_name[o->loss], o->loss == REF_PREFERENCE_DPO && o->dpo_semantics == REF_PREFERENCE_TRL_CURRENT
                                          ? "now"
                                          : o->loss == REF_PREFERENCE_DPO ? "0.28" : "",
           types, ref_name[ref_mode], o->label_smoothing, o->rpo_alpha, o->cpo_alpha, r0.loss, scale, ex, ew, eb,
           worst <= TOLERANCE ? "ok" : "FAIL");
    if (!(worst <= TOLERANCE))
        fd_failures++;
}

/* TRL v0.28's DPO (the cases and hand checks written for it; cpo, simpo and orpo ignore the semantics). */
static void legacy_defaults(ref_preference_options *o)
{
    ref_preference_options_default(o);
    o->dpo_semantics = REF_PREFERENCE_TRL_0_28;
}

/* Hand-worked values. One pair of T = 2 tokens: chosen logp (-1, -2), rejected (-3, -1), every mask 1, so
 * c = -3, r = -4 summed and -1.5, -2 averaged. */
static const double logp[4] = {-1.0, -2.0, -3.0, -1.0}, ones[4] = {1, 1, 1, 1};

/* A result writing the pair's l and rewards into seq and rewards. */
static ref_preference_result hand_result(double *seq, double *rewards)
{
    ref_preference_result r;
    memset(&r, 0, sizeof r);
    r.sequence_logps = seq;
    r.rewards = rewards;
    return r;
}

static void hand_checks(void)
{
    ref_preference_tokens tk = {1, 2, logp, ones, NULL, NULL, NULL, NULL, NULL};
    ref_preference_options o;
    legacy_defaults(&o);
    double g[4], seq[2], rewards[2];
    ref_preference_result r = hand_result(seq, rewards);

    /* dpo sigmoid, reference-free: u = 1, loss = log(1 + e^-0.1), d/dc = -beta sig(-beta) on both chosen tokens,
     * the opposite on the rejected ones; rewards beta l; no NLL term: nll_loss NaN; no logits: NaN. */
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, g) == 0, "head failed");
    const double d = -0.1 / (1.0 + exp(0.1));
    fd_expect(fd_close_to(r.loss, log1p(exp(-0.1)), HAND_TOL), "hand: dpo sigmoid loss");
    fd_expect(fd_close_to(g[0], d, HAND_TOL) && g[1] == g[0] && fd_close_to(g[2], -d, HAND_TOL) && g[3] == g[2], "hand: dpo sigmoid g_logp");
    fd_expect(seq[0] == -3.0 && seq[1] == -4.0 && fd_close_to(rewards[0], -0.3, HAND_TOL) && fd_close_to(rewards[1], -0.4, HAND_TOL),
           "hand: summed l and rewards");
    fd_expect(r.metrics.rewards_accuracies == 1.0 && fd_close_to(r.metrics.rewards_margins, 0.1, HAND_TOL) &&
               r.metrics.logps_chosen == -3.0 && r.metrics.logps_rejected == -4.0,
           "hand: reward metrics");
    fd_expect(isnan(r.metrics.nll_loss) && isnan(r.metrics.logits_chosen) && isnan(r.metrics.log_odds_ratio) &&
               isnan(r.metrics.log_odds_chosen),
           "hand: absent metrics are NaN");

    /* rpo_alpha 0.5: NLL = 1.5 (mean of the chosen tokens' -logp), loss += 0.75, chosen g_logp -= 0.5 / 2. */
    o.rpo_alpha = 0.5;
    ref_preference_head(&tk, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, log1p(exp(-0.1)) + 0.75, HAND_TOL) && r.metrics.nll_loss == 1.5, "hand: rpo loss and nll");
    fd_expect(fd_close_to(g[0], d - 0.25, HAND_TOL) && fd_close_to(g[2], -d, HAND_TOL), "hand: rpo g_logp");

    /* A sequence reference: u = (c - (-2)) - (r - (-4)) = -1; rewards beta (l - ref). The same reference per token
     * (chosen -1, -1; rejected -2, -2) gives the same loss and rewards. */
    const double ref_seq[2] = {-2.0, -4.0}, ref_tok[4] = {-1.0, -1.0, -2.0, -2.0};
    o.rpo_alpha = 0.0;
    tk.ref_logps = ref_seq;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    const double loss_seq = r.loss;
    fd_expect(fd_close_to(loss_seq, log1p(exp(0.1)), HAND_TOL) && fd_close_to(rewards[0], -0.1, HAND_TOL) && fd_close_to(rewards[1], 0.0, HAND_TOL),
           "hand: dpo with reference log-probs");
    tk.ref_logps = NULL;
    tk.ref_per_token_logps = ref_tok;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    fd_expect(r.loss == loss_seq && fd_close_to(rewards[0], -0.1, HAND_TOL), "hand: per-token reference aggregated like l");

    /* ipo averages, with the reference too: u = (-1.5 + 1) - (-2 + 2) = -0.5; loss (u - 5)^2; d/dc = 2 (u - 5)
     * spread as 1/2 per token. */
    o.loss_type = REF_PREFERENCE_IPO;
    ref_preference_head(&tk, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, 30.25, HAND_TOL) && seq[0] == -1.5 && fd_close_to(g[0], -5.5, HAND_TOL) && fd_close_to(g[3], 5.5, HAND_TOL),
           "hand: dpo ipo");
    tk.ref_per_token_logps = NULL;

    /* hinge: u = 1, beta u = 0.1 < 1: loss 0.9, d/dc = -beta; with beta 2, beta u = 2 > 1: loss 0 and no gradient. */
    o.loss_type = REF_PREFERENCE_HINGE;
    ref_preference_head(&tk, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, 0.9, HAND_TOL) && fd_close_to(g[0], -0.1, HAND_TOL), "hand: hinge active");
    o.beta = 2.0;
    ref_preference_head(&tk, &o, 1.0, &r, g);
    fd_expect(r.loss == 0.0 && g[0] == 0.0 && g[2] == 0.0, "hand: hinge inactive");

    /* robust with ls 0: the sigmoid loss. */
    legacy_defaults(&o);
    o.loss_type = REF_PREFERENCE_ROBUST;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    fd_expect(fd_close_to(r.loss, log1p(exp(-0.1)), HAND_TOL), "hand: robust at ls 0 is sigmoid");

    /* simpo (averaged): u = 0.5 - 0.5 / 0.1 = -4.5; loss -log sig(-0.45) + NLL (cpo_alpha 1). */
    o.loss = REF_PREFERENCE_SIMPO;
    o.loss_type = REF_PREFERENCE_SIGMOID;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    fd_expect(fd_close_to(r.loss, log1p(exp(0.45)) + 1.5, HAND_TOL) && r.metrics.nll_loss == 1.5 && fd_close_to(rewards[0], -0.15, HAND_TOL),
           "hand: simpo");

    /* orpo (averaged): o = 0.5 - (log(1 - e^-1.5) - log(1 - e^-2)); loss = NLL - beta log sig(o). */
    o.loss = REF_PREFERENCE_ORPO;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    const double odds = 0.5 - (log(1.0 - exp(-1.5)) - log(1.0 - exp(-2.0)));
    fd_expect(fd_close_to(r.metrics.log_odds_chosen, odds, HAND_TOL) &&
               fd_close_to(r.metrics.log_odds_ratio, -log1p(exp(-odds)), HAND_TOL) &&
               fd_close_to(r.loss, 1.5 + 0.1 * log1p(exp(-odds)), HAND_TOL),
           "hand: orpo");

    /* Every token masked: l = 0 (no 0 / 0), NLL 0, logits means NaN; the loss is finite for dpo. */
    const double zeros[4] = {0, 0, 0, 0}, means[4] = {0.5, 0.5, 0.5, 0.5};
    ref_preference_tokens empty = {1, 2, logp, zeros, NULL, NULL, means, NULL, NULL};
    legacy_defaults(&o);
    o.rpo_alpha = 1.0;
    ref_preference_head(&empty, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, log(2.0), HAND_TOL) && r.metrics.nll_loss == 0.0 && isnan(r.metrics.logits_chosen) &&
               g[0] == 0.0 && g[3] == 0.0,
           "hand: every token masked");
    /* The logits means: mask-weighted over the half's tokens. */
    const double half_mask[4] = {1, 0, 1, 1}, spread[4] = {1.0, 7.0, 2.0, 4.0};
    ref_preference_tokens weighted = {1, 2, logp, half_mask, NULL, NULL, spread, NULL, NULL};
    ref_preference_head(&weighted, &o, 1.0, &r, NULL);
    fd_expect(r.metrics.logits_chosen == 1.0 && r.metrics.logits_rejected == 3.0, "hand: logits means");

    /* Invalid arguments. */
    const struct {
        const char *what;
        ref_preference_loss loss;
        ref_preference_loss_type type;
        double beta, ls;
    } bad[] = {
        {"robust for cpo", REF_PREFERENCE_CPO, REF_PREFERENCE_ROBUST, 0.1, 0.0},
        {"hinge for simpo", REF_PREFERENCE_SIMPO, REF_PREFERENCE_HINGE, 0.1, 0.0},
        {"ipo for orpo", REF_PREFERENCE_ORPO, REF_PREFERENCE_IPO, 0.1, 0.0},
        {"beta 0", REF_PREFERENCE_DPO, REF_PREFERENCE_SIGMOID, 0.0, 0.0},
        {"beta NaN", REF_PREFERENCE_DPO, REF_PREFERENCE_SIGMOID, NAN, 0.0},
        {"label_smoothing 0.5 for robust", REF_PREFERENCE_DPO, REF_PREFERENCE_ROBUST, 0.1, 0.5},
        {"label_smoothing 0.6", REF_PREFERENCE_DPO, REF_PREFERENCE_SIGMOID, 0.1, 0.6},
        {"label_smoothing -0.1", REF_PREFERENCE_DPO, REF_PREFERENCE_SIGMOID, 0.1, -0.1},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        legacy_defaults(&o);
        o.loss = bad[k].loss;
        o.loss_type = bad[k].type;
        o.beta = bad[k].beta;
        o.label_smoothing = bad[k].ls;
        fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, bad[k].what);
    }
    legacy_defaults(&o);
    o.label_smoothing = 0.5;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == 0, "label_smoothing 0.5 for sigmoid is accepted");
    tk.ref_logps = ref_seq;
    tk.ref_per_token_logps = ref_tok;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "both reference arrays are rejected");
    tk.ref_per_token_logps = NULL;
    o.loss = REF_PREFERENCE_CPO;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "a reference for cpo is rejected");
}

/* Hand-worked values at TRL's current semantics, on hand_checks' pair (c = -3, r = -4 summed, 2 tokens each). */
static void current_hand_checks(void)
{
    ref_preference_tokens tk = {1, 2, logp, ones, NULL, NULL, NULL, NULL, NULL};
    ref_preference_options o;
    ref_preference_options_default(&o);
    double g[4], seq[2], rewards[2];
    ref_preference_result r = hand_result(seq, rewards);

    /* ipo sums its log-probs and divides inside: u = -3/2 - -4/2 = 0.5, loss (0.5 - 5)^2; d/dc = 2 (0.5 - 5) / 2 on
     * each chosen token; l and rewards stay sums (v0.28 averaged them). */
    o.loss_type = REF_PREFERENCE_IPO;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, g) == 0, "current: head failed");
    fd_expect(fd_close_to(r.loss, 20.25, HAND_TOL) && fd_close_to(g[0], -4.5, HAND_TOL) && fd_close_to(g[3], 4.5, HAND_TOL) && seq[0] == -3.0 &&
               fd_close_to(rewards[1], -0.4, HAND_TOL),
           "current: ipo divides inside, l summed");
    /* sigmoid ignores label smoothing now; sft adds the NLL (1.5) with its weight; nll_loss is not logged. */
    o.loss_type = REF_PREFERENCE_SIGMOID;
    o.label_smoothing = 0.1;
    ref_preference_head(&tk, &o, 1.0, &r, NULL);
    fd_expect(fd_close_to(r.loss, log1p(exp(-0.1)), HAND_TOL), "current: sigmoid without label smoothing");
    o.count = 2;
    o.types[0] = REF_PREFERENCE_SIGMOID, o.weights[0] = 2.0;
    o.types[1] = REF_PREFERENCE_SFT, o.weights[1] = 0.5;
    ref_preference_head(&tk, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, 2.0 * log1p(exp(-0.1)) + 0.75, HAND_TOL) && isnan(r.metrics.nll_loss) &&
               fd_close_to(g[0], 2.0 * -0.1 / (1.0 + exp(0.1)) - 0.25, HAND_TOL),
           "current: weighted sigmoid + sft");
    /* entropy over every masked token, accuracy over the chosen half's; 0 over no token, as the logits means. */
    const double entropy[4] = {1.0, 2.0, 3.0, 4.0}, correct[4] = {1.0, 0.0, 1.0, 1.0}, mask[4] = {1, 1, 1, 0};
    const double means[4] = {0.5, 0.5, 0.5, 0.5}, zeros[4] = {0, 0, 0, 0};
    ref_preference_tokens metered = {1, 2, logp, mask, NULL, NULL, means, entropy, correct};
    ref_preference_head(&metered, &o, 1.0, &r, NULL);
    fd_expect(r.metrics.entropy == 2.0 && r.metrics.mean_token_accuracy == 0.5, "current: entropy and token accuracy");
    metered.mask = zeros;
    ref_preference_head(&metered, &o, 1.0, &r, NULL);
    fd_expect(r.metrics.entropy == 0.0 && r.metrics.mean_token_accuracy == 0.0 && r.metrics.logits_chosen == 0.0,
           "current: metrics over no token are 0");

    /* aot sorts: 2 pairs of 1 token, c = (-1, -2), r = (-3, -1), ref_c = 0, ref_r = (-0.2, -0.5). c - r = (2, -1)
     * sorts to (-1, 2) (pairs 1, 0), ref_c - ref_r = (0.2, 0.5) to (0.2, 0.5) (pairs 0, 1): deltas -1.2 and 1.5,
     * where the pairs unsorted would give 1.8 and -1.5. The gradient of position 0 reaches pair 1's c and r. */
    const double logp2[4] = {-1.0, -2.0, -3.0, -1.0}, ref2[4] = {0.0, 0.0, -0.2, -0.5};
    ref_preference_tokens two = {2, 1, logp2, ones, ref2, NULL, NULL, NULL, NULL};
    ref_preference_options_default(&o);
    o.loss_type = REF_PREFERENCE_AOT;
    ref_preference_head(&two, &o, 1.0, &r, g);
    fd_expect(fd_close_to(r.loss, (log1p(exp(0.12)) + log1p(exp(-0.15))) / 2.0, HAND_TOL) &&
               fd_close_to(g[1], -0.05 / (1.0 + exp(-0.12)), HAND_TOL) && fd_close_to(g[3], 0.05 / (1.0 + exp(-0.12)), HAND_TOL) &&
               fd_close_to(g[0], -0.05 / (1.0 + exp(0.15)), HAND_TOL),
           "current: aot sorts over the pairs");

    /* Refused: rpo_alpha (now sft), exo_pair without label smoothing, a list at v0.28 or for cpo, a v0.28 dpo type
     * beyond robust. */
    ref_preference_options_default(&o);
    o.rpo_alpha = 0.5;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "current: rpo_alpha is refused");
    ref_preference_options_default(&o);
    o.loss_type = REF_PREFERENCE_EXO_PAIR;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "current: exo_pair needs label smoothing");
    o.dpo_semantics = REF_PREFERENCE_TRL_0_28;
    o.label_smoothing = 0.1;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "v0.28: no exo_pair");
    o.loss_type = REF_PREFERENCE_SIGMOID;
    o.count = 1;
    o.types[0] = REF_PREFERENCE_SIGMOID, o.weights[0] = 1.0;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "v0.28: no list");
    o.loss = REF_PREFERENCE_CPO;
    fd_expect(ref_preference_head(&tk, &o, 1.0, &r, NULL) == -2, "cpo: no list");
}

/* TRL's current DPO: each loss type alone (label smoothing 0.1 where a type reads it, reference per sequence or per
 * token in turn, none once), and weighted lists. */
static int current_cases(int index)
{
    ref_preference_options o;
    for (int type = REF_PREFERENCE_SIGMOID; type < REF_PREFERENCE_LOSS_TYPES; type++) {
        ref_preference_options_default(&o);
        o.loss_type = (ref_preference_loss_type)type;
        o.label_smoothing = 0.1;
        o.beta = 0.5; /* at 0.1 discopop's and nca_pair's |g| ~ 1e-2 put the noise floor near the tolerance */
        fd_case(index++, &o, type == REF_PREFERENCE_SIGMOID ? REF_NONE : 1 + type % 2);
    }
    static const struct {
        int count;
        ref_preference_loss_type types[4];
        double weights[4];
    } lists[] = {
        {3, {REF_PREFERENCE_SIGMOID, REF_PREFERENCE_BCO_PAIR, REF_PREFERENCE_SFT}, {0.8, 0.2, 1.0}}, /* MPO */
        {3, {REF_PREFERENCE_AOT, REF_PREFERENCE_AOT_UNPAIRED, REF_PREFERENCE_NCA_PAIR}, {1.0, 0.5, 0.25}},
        {4, {REF_PREFERENCE_IPO, REF_PREFERENCE_SIGMOID_NORM, REF_PREFERENCE_DISCOPOP, REF_PREFERENCE_APO_DOWN},
         {0.1, 2.0, 1.0, -0.5}},
    };
    for (size_t k = 0; k < sizeof lists / sizeof lists[0]; k++) {
        ref_preference_options_default(&o);
        o.count = lists[k].count;
        for (int j = 0; j < o.count; j++)
            o.types[j] = lists[k].types[j], o.weights[j] = lists[k].weights[j];
        o.label_smoothing = 0.05;
        fd_case(index++, &o, 1 + (int)k % 2);
    }
    return index;
}

int main(void)
{
    hand_checks();
    current_hand_checks();
    printf("hand-worked checks: %s\n", fd_failures ? "FAIL" : "ok");
    int index = 0;
    ref_preference_options o;
    for (int type = REF_PREFERENCE_SIGMOID; type <= REF_PREFERENCE_ROBUST; type++)
        for (int ref_mode = REF_NONE; ref_mode <= REF_TOKEN; ref_mode++)
            for (int rpo = 0; rpo < 2; rpo++) {
                legacy_defaults(&o);
                o.loss_type = (ref_preference_loss_type)type;
                o.rpo_alpha = rpo ? 0.5 : 0.0;
                if ((type == REF_PREFERENCE_SIGMOID || type == REF_PREFERENCE_ROBUST) && ((ref_mode + rpo) & 1))
                    o.label_smoothing = 0.1;
                fd_case(index++, &o, ref_mode);
            }
    for (int type = REF_PREFERENCE_SIGMOID; type <= REF_PREFERENCE_IPO; type++)
        for (int alpha = 0; alpha < 2; alpha++) {
            legacy_defaults(&o);
            o.loss = REF_PREFERENCE_CPO;
            o.loss_type = (ref_preference_loss_type)type;
            o.cpo_alpha = alpha;
            o.label_smoothing = type == REF_PREFERENCE_SIGMOID && alpha ? 0.1 : 0.0;
            fd_case(index++, &o, REF_NONE);
        }
    for (int alpha = 0; alpha < 2; alpha++) {
        legacy_defaults(&o);
        o.loss = REF_PREFERENCE_SIMPO;
        o.beta = 2.0; /* the SimPO paper's scale: beta 0.1 leaves |g| ~ 1e-2 and the noise floor near 1e-6 */
        o.simpo_gamma = 1.0;
        o.cpo_alpha = alpha;
        o.label_smoothing = alpha ? 0.1 : 0.0;
        fd_case(index++, &o, REF_NONE);
    }
    legacy_defaults(&o);
    o.loss = REF_PREFERENCE_ORPO;
    fd_case(index++, &o, REF_NONE);
    index = current_cases(index);
    printf("%d finite-difference cases, %d failures\n", index, fd_failures);
    return fd_failures ? 1 : 0;
}
