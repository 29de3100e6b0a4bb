/* ref_kto_fdcheck: checks ref_kto_backward against central finite differences of ref_kto_forward, and values worked
 * out by hand, over loss_type {kto, apo_zero_unpaired} x reference {sequence, token} x the KL term {one value,
 * per-sequence log-ratios} (kto only) x weights {1 / 1, 1.5 / 0.7}. Prints one line per case, exits non-zero on any
 * failure.
 *
 * Inputs. B = 6 sequences (labels 1 0 1 1 0 0) of T = 5 tokens, H = 4, V = 7, bias on. Masks have padded tails
 * whose targets are outside [0, V) on every other padded position; sequence 5 is fully masked. Reference log-probs
 * are the policy's at the base point plus noise (sequence: l + U(-1, 1); token: logp + U(-0.5, 0.5)); the KL term is
 * U(0, 1), its log-ratios U(-1, 2) per sequence. beta is 1 (TRL's 0.1 scales every gradient by 1/10 and moves the
 * rounding noise of the difference quotient towards the tolerance; the formulas are the same).
 *
 * Tolerance. As in ref_preference_fdcheck.c: for each gradient entry g (analytic) and f (finite difference) the error
 * is |f - g| / max(|f|, |g|, 1e-2 S), S the largest |g| over dx, dW and dbias of the case, and every case must stay
 * <= 1e-6. Every loss is smooth (sigmoids of affine functions of the log-probs); with h = 1e-6 the truncation error
 * is ~1e-12 and the rounding error eps |L| / h ~ 1e-10 against S ~ 1e-2 .. 1e-1, so the floor resolves every entry
 * well below 1e-6. A wrong formula (a missing mask or weight, a sign, the KL on the wrong side, a gradient through
 * the reference) is off by ~1e-2 of S or more. */
#include "fdcheck.h"
#include "ref_kto.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 6, T = 5, N = B * T, HID = 4, V = 7 };
static const double STEP = 1e-6, TOLERANCE = 1e-6;
/* Hand-worked values: a few operations in double, so within a few ulps. */
static const double HAND_TOL = 1e-14;
static const uint8_t LABELS[B] = {1, 0, 1, 1, 0, 0};

static ref_kto_result forward_or_die(const ref_kto_problem *p, const ref_kto_options *o, double *seq_logps,
                                     double *logp)
{
    ref_kto_result r;
    memset(&r, 0, sizeof r);
    r.sequence_logps = seq_logps;
    r.logp = logp;
    if (ref_kto_forward(p, o, &r)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    return r;
}

/* Max error of the analytic gradient g against central differences over every entry of param. */
static double fd_tensor(const ref_kto_problem *p, const ref_kto_options *o, double *param, const double *g, int count,
                        double floor)
{
    double worst = 0.0;
    for (int k = 0; k < count; k++) {
        const double keep = param[k];
        param[k] = keep + STEP;
        const double up = forward_or_die(p, o, NULL, NULL).loss;
        param[k] = keep - STEP;
        const double down = forward_or_die(p, o, NULL, NULL).loss;
        param[k] = keep;
        const double f = (up - down) / (2.0 * STEP);
        const double e = fabs(f - g[k]) / fmax(fmax(fabs(f), fabs(g[k])), floor);
        worst = isnan(e) ? INFINITY : fmax(worst, e);
    }
    return worst;
}

static void fd_case(int index, const ref_kto_options *o, int token_ref, int kl_logratios)
{
    fd_rng_state = 0x4B70000ull + (uint64_t)index * 7919u;
    double x[N * HID], w[HID * V], bias[V], mask[N], ref_seq[B], ref_tok[N], logp0[N], l0[B], kl, klr[B];
    int64_t targets[N];
    fd_fill(x, N * HID, -1.0, 1.0);
    fd_fill(w, HID * V, -1.2, 1.2);
    fd_fill(bias, V, -0.5, 0.5);
    static const int lengths[B] = {5, 3, 4, 2, 5, 0};
    for (int s = 0; s < B; s++)
        for (int t = 0; t < T; t++) {
            const int i = s * T + t;
            mask[i] = t < lengths[s] ? 1.0 : 0.0;
            targets[i] = (int64_t)(fd_uniform(0.0, 1.0) * V) % V;
            if (t >= lengths[s] && (t & 1))
                targets[i] = t == 1 ? -100 : V + t; /* padding outside the vocabulary */
        }
    kl = fd_uniform(0.0, 1.0);
    fd_fill(klr, B, -1.0, 2.0);
    const int kto = o->loss_type == REF_KTO_LOSS_KTO;
    ref_kto_problem p = {B,    T,     HID,  V,    x,    w, bias, targets, mask, LABELS, ref_seq, NULL,
                         kto && !kl_logratios ? &kl : NULL, kto && kl_logratios ? klr : NULL};
    forward_or_die(&p, o, l0, logp0);
    for (int s = 0; s < B; s++)
        ref_seq[s] = l0[s] + fd_uniform(-1.0, 1.0);
    for (int i = 0; i < N; i++)
        ref_tok[i] = logp0[i] + fd_uniform(-0.5, 0.5);
    p.ref_logps = token_ref ? NULL : ref_seq;
    p.ref_per_token_logps = token_ref ? ref_tok : NULL;
    const ref_kto_result r0 = forward_or_die(&p, o, NULL, NULL);
    fd_expect(isfinite(r0.loss), "the loss is not finite");

    double dx[N * HID], dw[HID * V], db[V];
    if (ref_kto_backward(&p, o, 1.0, dx, dw, db)) {
        printf("FAIL: backward returned an error\n");
        exit(2);
    }
    int padded_zero = 1; /* padded tokens' hidden states get exactly nothing */
    for (int i = 0; i < N; i++)
        for (int k = 0; k < HID; k++)
            padded_zero &= mask[i] != 0.0 || dx[i * HID + k] == 0.0;
    fd_expect(padded_zero, "dx of a padded token is not exactly 0");
    const double scale = fmax(fd_max_abs(dx, N * HID), fmax(fd_max_abs(dw, HID * V), fd_max_abs(db, V)));
    const double ex = fd_tensor(&p, o, x, dx, N * HID, 1e-2 * scale);
    const double ew = fd_tensor(&p, o, w, dw, HID * V, 1e-2 * scale);
    const double eb = fd_tensor(&p, o, bias, db, V, 1e-2 * scale);
    const double worst = fmax(ex, fmax(ew, eb));
    printf("%3d %-17s ref=%-5s kl=%-9s w=%g/%g  loss=%8.5f |g|max=%.2e  rel dx=%.1e dW=%.1e db=%.1e  %s\n", index,
           kto ? "kto" : "apo_zero_unpaired", token_ref ? "token" : "seq",
           !kto ? "none" : kl_logratios ? "logratios" : "value", o->desirable_weight, o->undesirable_weight, r0.loss,
           scale, ex, ew, eb, worst <= TOLERANCE ? "ok" : "FAIL");
    if (!(worst <= TOLERANCE))
        fd_failures++;
}

static double sig(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* Hand-worked values. A desirable sequence with logp (-1, -2) and an undesirable one with (-3, -1), every mask 1:
 * l = -3, -4; reference -2, -5: r = -1, 1; beta 1. */
static void hand_checks(void)
{
    const double logp[4] = {-1.0, -2.0, -3.0, -1.0}, ones[4] = {1, 1, 1, 1}, ref[2] = {-2.0, -5.0};
    const double ref_tok[4] = {-1.0, -1.0, -2.0, -3.0}, means[4] = {1.0, 2.0, 3.0, 5.0}, ent[4] = {1, 2, 3, 4};
    const uint8_t labels[2] = {1, 0};
    const double kl = 0.5, klr[2] = {-1.0, -3.0};
    ref_kto_tokens tk = {1 + 1, 2, logp, ones, labels, ref, NULL, &kl, NULL, means, ent};
    ref_kto_options o = {REF_KTO_LOSS_KTO, 1.0, 1.0, 1.0};
    ref_kto_result r;
    memset(&r, 0, sizeof r);
    double g[4], seq[2], rewards[2];
    r.sequence_logps = seq;
    r.rewards = rewards;

    /* kto, kl 0.5: desirable 1 - sig(-1 - 0.5), undesirable 1 - sig(0.5 - 1); d/dr: -sig(-1.5) sig(1.5) and
     * +sig(-0.5) sig(0.5), halved by the mean over B = 2, on every token. */
    fd_expect(ref_kto_head(&tk, &o, 1.0, &r, g) == 0, "head failed");
    fd_expect(fd_close_to(r.loss, (1.0 - sig(-1.5) + 1.0 - sig(-0.5)) / 2.0, HAND_TOL), "hand: kto loss");
    fd_expect(fd_close_to(g[0], -sig(-1.5) * sig(1.5) / 2.0, HAND_TOL) && g[1] == g[0] && fd_close_to(g[2], sig(-0.5) * sig(0.5) / 2.0, HAND_TOL) &&
               g[3] == g[2],
           "hand: kto g_logp");
    fd_expect(seq[0] == -3.0 && seq[1] == -4.0 && rewards[0] == -1.0 && rewards[1] == 1.0, "hand: l and rewards");
    fd_expect(r.metrics.kl == 0.5 && r.metrics.rewards_chosen == -1.0 && r.metrics.rewards_rejected == 1.0 &&
               r.metrics.rewards_margins == -2.0 && r.metrics.logps_chosen == -3.0 && r.metrics.logps_rejected == -4.0,
           "hand: reward metrics");
    fd_expect(r.metrics.logits_chosen == 1.5 && r.metrics.logits_rejected == 4.0 && r.metrics.entropy == 2.5,
           "hand: logits and entropy metrics");

    /* The same reference per token; log-ratios with a negative mean: kl clamped to 0. */
    tk.ref_logps = NULL;
    tk.ref_per_token_logps = ref_tok;
    tk.kl = NULL;
    tk.kl_logratios = klr;
    ref_kto_head(&tk, &o, 1.0, &r, NULL);
    fd_expect(r.metrics.kl == 0.0 && rewards[0] == -1.0 && fd_close_to(r.loss, (1.0 - sig(-1.0) + 1.0 - sig(-1.0)) / 2.0, HAND_TOL),
           "hand: per-token reference, clamped kl");

    /* apo_zero_unpaired, weights 2 / 0.5, grad_output 3: (2 (1 - sig(-1)) + 0.5 sig(1)) / 2. */
    o.loss_type = REF_KTO_LOSS_APO_ZERO_UNPAIRED;
    o.desirable_weight = 2.0;
    o.undesirable_weight = 0.5;
    tk.kl_logratios = NULL;
    ref_kto_head(&tk, &o, 3.0, &r, g);
    fd_expect(fd_close_to(r.loss, (2.0 * (1.0 - sig(-1.0)) + 0.5 * sig(1.0)) / 2.0, HAND_TOL) && r.metrics.kl == 0.0,
           "hand: apo_zero_unpaired loss");
    fd_expect(fd_close_to(g[0], -3.0 * 2.0 * sig(-1.0) * sig(1.0) / 2.0, HAND_TOL) &&
               fd_close_to(g[3], 3.0 * 0.5 * sig(1.0) * sig(-1.0) / 2.0, HAND_TOL),
           "hand: apo_zero_unpaired g_logp");

    /* Only desirable sequences: the rejected metrics and the margin are NaN (TRL logs none). No tokens: logits
     * NaN, entropy 0. */
    const uint8_t both_desirable[2] = {1, 1};
    const double zeros[4] = {0, 0, 0, 0};
    ref_kto_tokens one_sided = {2, 2, logp, zeros, both_desirable, ref, NULL, NULL, NULL, means, ent};
    ref_kto_head(&one_sided, &o, 1.0, &r, g);
    fd_expect(isnan(r.metrics.rewards_rejected) && isnan(r.metrics.logps_rejected) && isnan(r.metrics.rewards_margins) &&
               isnan(r.metrics.logits_chosen) && isnan(r.metrics.logits_rejected) && r.metrics.entropy == 0.0 &&
               g[0] == 0.0,
           "hand: one-sided batch without tokens");

    /* Invalid arguments. */
    o.loss_type = REF_KTO_LOSS_KTO;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "kto without a KL input is rejected");
    one_sided.kl = &kl;
    one_sided.kl_logratios = klr;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "both KL inputs are rejected");
    o.loss_type = REF_KTO_LOSS_APO_ZERO_UNPAIRED;
    one_sided.kl_logratios = NULL;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "a KL input for apo_zero_unpaired is rejected");
    one_sided.kl = NULL;
    one_sided.ref_logps = NULL;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "no reference is rejected");
    one_sided.ref_logps = ref;
    o.beta = 0.0;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "beta 0 is rejected");
    o.beta = 1.0;
    const uint8_t bad_labels[2] = {1, 2};
    one_sided.labels = bad_labels;
    fd_expect(ref_kto_head(&one_sided, &o, 1.0, &r, NULL) == -2, "a label 2 is rejected");
}

int main(void)
{
    hand_checks();
    printf("hand-worked checks: %s\n", fd_failures ? "FAIL" : "ok");
    int index = 0;
    for (int type = REF_KTO_LOSS_KTO; type <= REF_KTO_LOSS_APO_ZERO_UNPAIRED; type++)
        for (int token_ref = 0; token_ref < 2; token_ref++)
            for (int kl_logratios = 0; kl_logratios < (type == REF_KTO_LOSS_KTO ? 2 : 1); kl_logratios++)
                for (int weighted = 0; weighted < 2; weighted++) {
                    const ref_kto_options o = {(ref_kto_loss_type)type, 1.0, weighted ? 1.5 : 1.0,
                                               weighted ? 0.7 : 1.0};
                    fd_case(index++, &o, token_ref, kl_logratios);
                }
    printf("%d finite-difference cases, %d failures\n", index, fd_failures);
    return fd_failures ? 1 : 0;
}
