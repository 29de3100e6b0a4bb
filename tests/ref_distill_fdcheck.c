/* ref_distill_fdcheck: checks ref_distill_linear's student gradients against central finite differences of its
 * loss, and values worked out by hand, over divergence {forward_kl, reverse_kl, jsd beta 0.5, jsd beta 0.3, jsd
 * beta 0, jsd beta 1} x temperature {1, 0.7, 2} x {soft only without targets, soft only with ignored targets,
 * soft 0.6 + hard 0.4} x reduction {mean, sum, none}; then top-k (TRL's iw_opd generalized_jsd_loss): every
 * divergence x top_k {1, 3, 5} x tail or not x temperature {1, 0.7}, the targets' mode and the reduction rotating
 * (top_k 1 without the tail is exactly 0 for the KLs, as TRL's: checked as such). Prints one line per case, exits
 * non-zero on any failure.
 *
 *   gcc -std=c11 -Wall -Wextra -O2 -Iref ref/ref_linear.c ref/ref_distill.c tests/ref_distill_fdcheck.c -lm \
 *       -o ref_distill_fdcheck
 *
 * Inputs. N = 6 tokens, student hidden 5, teacher hidden 7, V = 11, both with a bias; weights U(-1.5, 1.5) so the
 * logits spread over a few units and neither softmax is near uniform. Tokens 1 and 4 have target ignore_index
 * wherever targets are given. none differentiates sum_i g_i l_i with a non-uniform g of mixed signs; mean and sum
 * differentiate 1.3 loss.
 *
 * The teacher is a constant (the head gets no teacher gradient, so there is nothing to check there); the cases
 * only check that the loss moves with the teacher (token 0's hidden state): the teacher is live in every case.
 *
 * Tolerance. As in ref_preference_fdcheck.c: for each gradient entry g (analytic) and f (finite difference) the
 * error is |f - g| / max(|f|, |g|, 1e-2 S), S the largest |g| over dx, dW and dbias of the case (0.015 - 3.9
 * here), and every case must stay <= 1e-6. The step balances the two errors of central differences in double:
 * truncation h^2 |L'''| / 6 (logits O(1); the third derivatives grow like 1 / T^3 at T = 0.7) and rounding
 * ~ eps |L| / h, amplified where S is small (T = 2 flattens both softmaxes). Measured largest errors over all
 * cases: 2.2e-7 at h = 1e-4 (truncation, falls as h^2), 2.9e-7 at h = 1e-6 (rounding, grows as 1 / h), 3.4e-8 at
 * the h = 1e-5 used here (reverse KL, T = 2, mean, S = 0.1). A wrong formula (a missing 1 / T, the mixture's
 * weights swapped, the reverse KL without its -D, the hard part on tempered logits, an ignored token counted) is
 * off by at least ~1e-2 of S, over four orders above the tolerance. */
#include "fdcheck.h"
#include "ref_distill.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 6, HS = 5, HT = 7, V = 11 };
static const double STEP = 1e-5, TOLERANCE = 1e-6;
static const int64_t IGNORE = -100;

/* One problem: both heads' parameters, the targets (or none) and the upstream gradient. */
typedef struct problem {
    double xs[N * HS], ws[HS * V], bs[V], xt[N * HT], wt[HT * V], bt[V];
    int64_t targets[N];
    const int64_t *tg; /* targets or NULL */
    double grad[N];    /* grad[0] for mean and sum */
} problem;

static void make_problem(problem *p, uint64_t seed)
{
    fd_rng_state = seed;
    fd_fill(p->xs, N * HS, -1.0, 1.0);
    fd_fill(p->ws, HS * V, -1.5, 1.5);
    fd_fill(p->bs, V, -0.5, 0.5);
    fd_fill(p->xt, N * HT, -1.0, 1.0);
    fd_fill(p->wt, HT * V, -1.5, 1.5);
    fd_fill(p->bt, V, -0.5, 0.5);
    for (int i = 0; i < N; i++)
        p->targets[i] = i == 1 || i == 4 ? IGNORE : (int64_t)(fd_uniform(0.0, 1.0) * V) % V;
    p->tg = p->targets;
    static const double g_none[N] = {0.7, -1.1, 1.9, 0.4, 1.3, -0.6};
    memcpy(p->grad, g_none, sizeof g_none);
}

static void linears(const problem *p, ref_linear *s, ref_linear *t)
{
    const ref_linear ls = {N, HS, V, p->xs, p->ws, p->bs}, lt = {N, HT, V, p->xt, p->wt, p->bt};
    *s = ls;
    *t = lt;
}

static const double *grad_of(const problem *p, const ref_distill_options *o)
{
    static const double one = 1.3;
    return o->reduction == 2 ? p->grad : &one;
}

/* The differentiated scalar: grad loss for mean and sum, sum_i grad_i l_i for none. */
static double objective(const problem *p, const ref_distill_options *o)
{
    ref_linear s, t;
    linears(p, &s, &t);
    double per[N];
    ref_distill_result r = {0.0, 0.0, 0.0, per};
    if (ref_distill_linear(&s, &t, p->tg, o, NULL, &r, NULL, NULL, NULL)) {
        printf("FAIL: forward returned an error\n");
        exit(2);
    }
    if (o->reduction != 2)
        return grad_of(p, o)[0] * r.loss;
    double f = 0.0;
    for (int i = 0; i < N; i++)
        f += p->grad[i] * per[i];
    return f;
}

/* Max error of the analytic gradient g against central differences over every entry of param. */
static double fd_tensor(problem *p, const ref_distill_options *o, double *param, const double *g, int count,
                        double floor)
{
    double worst = 0.0;
    for (int k = 0; k < count; k++) {
        const double keep = param[k];
        param[k] = keep + STEP;
        const double up = objective(p, o);
        param[k] = keep - STEP;
        const double down = objective(p, o);
        param[k] = keep;
        const double e = fd_rel_err((up - down) / (2.0 * STEP), g[k], floor);
        if (e > worst || isnan(e))
            worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

static const char *div_name[] = {"fkl", "rkl", "jsd"};
static const char *red_name[] = {"mean", "sum", "none"};
static const char *mode_name[] = {"soft", "soft+ign", "soft+hard"};

static double worst_case_error;

static void fd_case(int index, const ref_distill_options *o, int mode)
{
    problem p;
    make_problem(&p, 0xD1571000ull + (uint64_t)index * 7919u);
    if (mode == 0)
        p.tg = NULL;
    ref_linear s, t;
    linears(&p, &s, &t);
    double per[N], dx[N * HS], dw[HS * V], db[V];
    ref_distill_result r = {0.0, 0.0, 0.0, per};
    if (ref_distill_linear(&s, &t, p.tg, o, grad_of(&p, o), &r, dx, dw, db)) {
        printf("FAIL: forward-backward returned an error\n");
        exit(2);
    }
    /* A jsd union of one column (both top-1s the same) is 0 without the tail. */
    const int may_vanish = o->top_k == 1 && !o->add_tail;
    fd_expect(isfinite(r.loss) && (r.soft_loss > 0.0 || (may_vanish && r.soft_loss == 0.0)) &&
                  (p.tg ? r.hard_loss > 0.0 : r.hard_loss == 0.0),
              "the loss is not finite, or a part is not positive");
    /* The parts and the per-token losses add up to the loss. */
    double sum = 0.0;
    int counted = 0;
    for (int i = 0; i < N; i++) {
        sum += per[i];
        counted += !p.tg || p.tg[i] != IGNORE;
    }
    fd_expect(fd_close_to(r.loss, o->reduction == 0 ? sum / counted : sum, 1e-14), "the per-token losses do not add up");
    fd_expect(fd_close_to(r.loss, o->weight_soft_loss * r.soft_loss + o->weight_hard_loss * r.hard_loss, 1e-14),
           "the loss is not its weighted parts");
    /* Ignored tokens: per-token loss and hidden-state gradient exactly 0. */
    int ignored_zero = 1;
    for (int i = 0; p.tg && i < N; i++)
        for (int k = 0; k < HS; k++)
            ignored_zero &= p.tg[i] != IGNORE || (dx[i * HS + k] == 0.0 && per[i] == 0.0);
    fd_expect(ignored_zero, "an ignored token has a loss or a dx");
    /* The teacher is live: its hidden states move the loss. */
    const double base = objective(&p, o);
    p.xt[0] += 1e-3;
    fd_expect(fabs(objective(&p, o) - base) > 1e-9 || (may_vanish && r.soft_loss == 0.0),
              "the loss does not depend on the teacher");
    p.xt[0] -= 1e-3;

    const double scale = fmax(fd_max_abs(dx, N * HS), fmax(fd_max_abs(dw, HS * V), fd_max_abs(db, V)));
    const double floor = 1e-2 * scale;
    const double ex = fd_tensor(&p, o, p.xs, dx, N * HS, floor);
    const double ew = fd_tensor(&p, o, p.ws, dw, HS * V, floor);
    const double eb = fd_tensor(&p, o, p.bs, db, V, floor);
    const double worst = fmax(ex, fmax(ew, eb));
    if (worst > worst_case_error)
        worst_case_error = worst;
    printf("%3d %s b=%-3g T=%-3g k=%lld%s %-9s %-4s  loss=%8.4f |g|max=%.2e  rel dx=%.1e dW=%.1e db=%.1e  %s\n",
           index, div_name[o->divergence], o->beta, o->temperature, (long long)o->top_k,
           o->top_k && o->add_tail ? "+tail" : "", mode_name[mode], red_name[o->reduction], r.loss, scale, ex, ew, eb,
           worst <= TOLERANCE ? "ok" : "FAIL");
    if (!(worst <= TOLERANCE))
        fd_failures++;
}

/* jsd at beta 0 and 1 takes the KLs' paths: identical bits, loss and gradient. */
static void beta_ends(void)
{
    problem p;
    make_problem(&p, 0xBE7A0000ull);
    ref_linear s, t;
    linears(&p, &s, &t);
    for (int red = 0; red <= 2; red++)
        for (int end = 0; end <= 1; end++) {
            ref_distill_options a, b;
            ref_distill_options_default(&a);
            a.reduction = red;
            a.temperature = 0.7;
            a.weight_soft_loss = 0.6;
            a.weight_hard_loss = 0.4;
            b = a;
            a.beta = end;
            b.divergence = end ? REF_DIVERGENCE_REVERSE_KL : REF_DIVERGENCE_FORWARD_KL;
            b.beta = 0.5; /* unused by the KLs */
            double pa[N], pb[N], dxa[N * HS], dxb[N * HS], dwa[HS * V], dwb[HS * V];
            ref_distill_result ra = {0.0, 0.0, 0.0, pa}, rb = {0.0, 0.0, 0.0, pb};
            ref_distill_linear(&s, &t, p.tg, &a, grad_of(&p, &a), &ra, dxa, dwa, NULL);
            ref_distill_linear(&s, &t, p.tg, &b, grad_of(&p, &b), &rb, dxb, dwb, NULL);
            fd_expect(ra.loss == rb.loss && ra.soft_loss == rb.soft_loss && !memcmp(pa, pb, sizeof pa) &&
                       !memcmp(dxa, dxb, sizeof dxa) && !memcmp(dwa, dwb, sizeof dwa),
                   end ? "jsd beta 1 is not reverse_kl" : "jsd beta 0 is not forward_kl");
        }
}

/* Teacher logits equal to the student's: every divergence is 0 and at its minimum (zero gradient). */
static void teacher_equals_student(void)
{
    problem p;
    make_problem(&p, 0x5A3E0000ull);
    ref_linear s, t;
    linears(&p, &s, &t);
    static const struct {
        ref_divergence div;
        double beta;
    } divs[] = {{REF_DIVERGENCE_FORWARD_KL, 0.5}, {REF_DIVERGENCE_REVERSE_KL, 0.5}, {REF_DIVERGENCE_JSD, 0.5},
                {REF_DIVERGENCE_JSD, 0.3},        {REF_DIVERGENCE_JSD, 0.0},        {REF_DIVERGENCE_JSD, 1.0}};
    double worst = 0.0;
    for (size_t k = 0; k < sizeof divs / sizeof divs[0]; k++)
        for (int red = 0; red <= 2; red++)
            for (int temp = 0; temp < 2; temp++) {
                ref_distill_options o;
                ref_distill_options_default(&o);
                o.divergence = divs[k].div;
                o.beta = divs[k].beta;
                o.reduction = red;
                o.temperature = temp ? 0.7 : 1.0;
                double per[N], dx[N * HS], dw[HS * V];
                ref_distill_result r = {0.0, 0.0, 0.0, per};
                fd_expect(ref_distill_linear(&s, &s, p.tg, &o, grad_of(&p, &o), &r, dx, dw, NULL) == 0,
                       "teacher == student: error");
                worst = fmax(worst, fmax(fabs(r.loss), fmax(fd_max_abs(per, N), fmax(fd_max_abs(dx, N * HS),
                                                                                  fd_max_abs(dw, HS * V)))));
            }
    /* The KLs are exactly 0 (identical log-probs); jsd's mixture log m = log p up to rounding. */
    printf("teacher == student: largest |loss|, |l_i|, |dx|, |dW| = %.1e\n", worst);
    fd_expect(worst <= 1e-14, "teacher == student: the loss or gradient is not 0");
}

/* Every token ignored: loss, parts, per-token losses and gradients exactly 0, for every reduction. */
static void all_ignored(void)
{
    problem p;
    make_problem(&p, 0x16A0000ull);
    for (int i = 0; i < N; i++)
        p.targets[i] = IGNORE;
    ref_linear s, t;
    linears(&p, &s, &t);
    for (int red = 0; red <= 2; red++) {
        ref_distill_options o;
        ref_distill_options_default(&o);
        o.reduction = red;
        o.weight_hard_loss = 0.4;
        double per[N], dx[N * HS], dw[HS * V], db[V];
        for (int i = 0; i < N; i++)
            per[i] = 1.0;
        ref_distill_result r = {1.0, 1.0, 1.0, per};
        fd_expect(ref_distill_linear(&s, &t, p.tg, &o, grad_of(&p, &o), &r, dx, dw, db) == 0, "all ignored: error");
        fd_expect(r.loss == 0.0 && r.soft_loss == 0.0 && r.hard_loss == 0.0 && fd_max_abs(per, N) == 0.0 &&
                   fd_max_abs(dx, N * HS) == 0.0 && fd_max_abs(dw, HS * V) == 0.0 && fd_max_abs(db, V) == 0.0,
               "all ignored: something is not 0");
    }
}

/* jsd's log-space mixture against the plain probability-space formula on random rows. */
static void jsd_probability_space(void)
{
    fd_rng_state = 0x75D0000ull;
    double worst = 0.0;
    for (int trial = 0; trial < 20; trial++) {
        double us[V], ut[V], p[V], q[V], zs = 0.0, zt = 0.0;
        for (int j = 0; j < V; j++) {
            us[j] = fd_uniform(-3.0, 3.0);
            ut[j] = fd_uniform(-3.0, 3.0);
            zs += exp(us[j]);
            zt += exp(ut[j]);
        }
        const double beta = fd_uniform(0.05, 0.95);
        double d = 0.0;
        for (int j = 0; j < V; j++) {
            p[j] = exp(us[j]) / zs;
            q[j] = exp(ut[j]) / zt;
            const double m = beta * q[j] + (1.0 - beta) * p[j];
            d += beta * q[j] * log(q[j] / m) + (1.0 - beta) * p[j] * log(p[j] / m);
        }
        ref_distill_options o;
        ref_distill_options_default(&o);
        o.beta = beta;
        ref_distill_result r = {0.0, 0.0, 0.0, NULL};
        ref_distill_head(1, V, us, ut, NULL, &o, NULL, &r, NULL);
        worst = fmax(worst, fabs(r.loss - d) / d);
    }
    printf("jsd against its probability-space formula: largest relative difference %.1e\n", worst);
    fd_expect(worst <= 1e-12, "jsd differs from its probability-space formula");
}

/* Hand-worked values. V = 2, one token: student logits (0, 0), so p = (1/2, 1/2); teacher (log 3, 0), so
 * q = (3/4, 1/4); target 0: hard = log 2, gradient of the hard part (p - onehot) = (-1/2, 1/2). */
static void hand_checks(void)
{
    const double us[2] = {0.0, 0.0}, ut[2] = {log(3.0), 0.0}, ut2[2] = {2.0 * log(3.0), 0.0}, one = 1.0;
    const int64_t target = 0;
    ref_distill_options o;
    ref_distill_options_default(&o);
    ref_distill_result r = {0.0, 0.0, 0.0, NULL};
    double g[2];

    /* forward KL = 3/4 log(3/2) + 1/4 log(1/2); d/ds = p - q = (-1/4, 1/4). */
    const double fkl = 0.75 * log(1.5) + 0.25 * log(0.5);
    o.divergence = REF_DIVERGENCE_FORWARD_KL;
    fd_expect(ref_distill_head(1, 2, us, ut, NULL, &o, &one, &r, g) == 0, "hand: head failed");
    fd_expect(fd_close_to(r.loss, fkl, 1e-15) && fd_close_to(g[0], -0.25, 1e-15) && fd_close_to(g[1], 0.25, 1e-15),
           "hand: forward_kl");
    /* Temperature 2 on doubled teacher logits: the same q; p stays uniform; d/du = (1/2) d/ds. */
    o.temperature = 2.0;
    ref_distill_head(1, 2, us, ut2, NULL, &o, &one, &r, g);
    fd_expect(fd_close_to(r.loss, fkl, 1e-15) && fd_close_to(g[0], -0.125, 1e-15), "hand: forward_kl at temperature 2");
    o.temperature = 1.0;

    /* reverse KL = 1/2 log(2/3) + 1/2 log 2; d/ds_j = p_j (log p_j - log q_j - D). */
    const double rkl = 0.5 * log(2.0 / 3.0) + 0.5 * log(2.0);
    o.divergence = REF_DIVERGENCE_REVERSE_KL;
    ref_distill_head(1, 2, us, ut, NULL, &o, &one, &r, g);
    fd_expect(fd_close_to(r.loss, rkl, 1e-15) && fd_close_to(g[0], 0.5 * (log(2.0 / 3.0) - rkl), 1e-15),
           "hand: reverse_kl");

    /* jsd beta 1/2: m = (5/8, 3/8); D = 1/2 (3/4 log(6/5) + 1/4 log(2/3)) + 1/2 (1/2 log(4/5) + 1/2 log(4/3)). */
    const double jsd = 0.5 * (0.75 * log(1.2) + 0.25 * log(2.0 / 3.0)) + 0.5 * (0.5 * log(0.8) + 0.5 * log(4.0 / 3.0));
    o.divergence = REF_DIVERGENCE_JSD;
    ref_distill_head(1, 2, us, ut, NULL, &o, &one, &r, g);
    const double k = 0.5 * log(0.8) + 0.5 * log(4.0 / 3.0);
    fd_expect(fd_close_to(r.loss, jsd, 1e-15) && fd_close_to(g[0], 0.5 * 0.5 * (log(0.8) - k), 1e-15), "hand: jsd");

    /* Soft 0.6 + hard 0.4 with the target: loss = 0.6 jsd + 0.4 log 2; parts before their weights; the hard part
     * is on the untempered logits, so temperature 2 with the doubled teacher changes nothing. */
    o.weight_soft_loss = 0.6;
    o.weight_hard_loss = 0.4;
    o.temperature = 2.0;
    ref_distill_head(1, 2, us, ut2, &target, &o, &one, &r, g);
    fd_expect(fd_close_to(r.loss, 0.6 * jsd + 0.4 * log(2.0), 1e-15) && fd_close_to(r.soft_loss, jsd, 1e-15) &&
               fd_close_to(r.hard_loss, log(2.0), 1e-15) &&
               fd_close_to(g[0], 0.6 * 0.5 * 0.25 * (log(0.8) - k) - 0.4 * 0.5, 1e-15),
           "hand: soft and hard parts");

    /* Underflow: a student probability of e^-1000 = 0 and a teacher logit of -inf add 0, not NaN. */
    const double us3[3] = {0.0, -1000.0, 1.0}, ut3[3] = {0.5, -INFINITY, 0.0};
    for (int div = REF_DIVERGENCE_FORWARD_KL; div <= REF_DIVERGENCE_JSD; div++) {
        double g3[3];
        ref_distill_options_default(&o);
        o.divergence = (ref_divergence)div;
        ref_distill_head(1, 3, us3, ut3, NULL, &o, &one, &r, g3);
        fd_expect(isfinite(r.loss) && r.loss > 0.0 && isfinite(g3[0]) && isfinite(g3[1]) && isfinite(g3[2]) &&
                   g3[1] == 0.0,
               "hand: an underflowed or -inf entry is not a 0 contribution");
    }

    /* Mean over the counted tokens only: two tokens, the second ignored, equals the first alone; none scales each
     * row by its own grad_output. */
    const double us_2[4] = {0.0, 0.0, 3.0, -1.0}, ut_2[4] = {log(3.0), 0.0, 0.0, 0.0}, go[2] = {-2.0, 5.0};
    const int64_t t2[2] = {0, IGNORE};
    double g4[4], per[2];
    ref_distill_options_default(&o);
    o.weight_hard_loss = 0.4;
    ref_distill_head(2, 2, us_2, ut_2, t2, &o, &one, &r, g4);
    fd_expect(fd_close_to(r.loss, jsd + 0.4 * log(2.0), 1e-15) && g4[2] == 0.0 && g4[3] == 0.0, "hand: mean of one");
    o.reduction = 2;
    r.per_token_loss = per;
    ref_distill_head(2, 2, us_2, ut_2, t2, &o, go, &r, g4);
    fd_expect(fd_close_to(per[0], jsd + 0.4 * log(2.0), 1e-15) && per[1] == 0.0 &&
               fd_close_to(g4[0], -2.0 * (0.25 * (log(0.8) - k) - 0.4 * 0.5), 1e-15) && g4[2] == 0.0,
           "hand: none");

    /* Top-1 forward KL with the tail. Student (0, 0, 0): p = 1/3 each; teacher (log 2, 0, 0): q = (1/2, 1/4, 1/4);
     * the support is {0}: xs = (log 1/3, log 2/3), xt = (log 1/2, log 1/2), D = 1/2 log(3/2) + 1/2 log(3/4); by
     * hand through p_0 and 1 - p_0, dD/ds = (-1/6, 1/12, 1/12). Top-k of V or more is the whole vocabulary. */
    {
        const double s3[3] = {0.0, 0.0, 0.0}, t3[3] = {log(2.0), 0.0, 0.0};
        double g3[3], gv[3];
        ref_distill_options_default(&o);
        o.divergence = REF_DIVERGENCE_FORWARD_KL;
        o.top_k = 1;
        ref_distill_head(1, 3, s3, t3, NULL, &o, &one, &r, g3);
        fd_expect(fd_close_to(r.loss, 0.5 * log(1.5) + 0.5 * log(0.75), 1e-15) &&
                      fd_close_to(g3[0], -1.0 / 6.0, 1e-15) && fd_close_to(g3[1], 1.0 / 12.0, 1e-15) &&
                      fd_close_to(g3[2], 1.0 / 12.0, 1e-15),
                  "hand: top-1 forward KL with the tail");
        o.top_k = 0;
        ref_distill_head(1, 3, s3, t3, NULL, &o, &one, &r, gv);
        const double full = r.loss;
        o.top_k = 3;
        ref_distill_head(1, 3, s3, t3, NULL, &o, &one, &r, g3);
        fd_expect(r.loss == full && !memcmp(g3, gv, sizeof g3), "hand: top_k = V is not the whole vocabulary");
    }

    /* Invalid arguments. */
    ref_distill_options_default(&o);
    r.per_token_loss = NULL;
    const int64_t bad_target = 2;
    const struct {
        const char *what;
        double beta, temperature, ws, wh;
        int reduction;
    } bad[] = {
        {"beta 1.5", 1.5, 1.0, 1.0, 0.0, 0},   {"beta -0.1", -0.1, 1.0, 1.0, 0.0, 0},
        {"beta NaN", NAN, 1.0, 1.0, 0.0, 0},   {"temperature 0", 0.5, 0.0, 1.0, 0.0, 0},
        {"weight_soft -1", 0.5, 1.0, -1.0, 0.0, 0}, {"weight_hard NaN", 0.5, 1.0, 1.0, NAN, 0},
        {"reduction 3", 0.5, 1.0, 1.0, 0.0, 3}, {"no targets with weight_hard", 0.5, 1.0, 1.0, 0.4, 0},
    };
    for (size_t k2 = 0; k2 < sizeof bad / sizeof bad[0]; k2++) {
        o.beta = bad[k2].beta;
        o.temperature = bad[k2].temperature;
        o.weight_soft_loss = bad[k2].ws;
        o.weight_hard_loss = bad[k2].wh;
        o.reduction = bad[k2].reduction;
        fd_expect(ref_distill_head(1, 2, us, ut, NULL, &o, &one, &r, NULL) == -2, bad[k2].what);
    }
    ref_distill_options_default(&o);
    fd_expect(ref_distill_head(1, 2, us, ut, &bad_target, &o, &one, &r, NULL) == -2, "a target out of range");
    fd_expect(ref_distill_head(1, 2, us, ut, NULL, &o, NULL, &r, g) == -2, "gradients without grad_output");
    problem p;
    make_problem(&p, 1);
    ref_linear s, t;
    linears(&p, &s, &t);
    t.n = N - 1;
    fd_expect(ref_distill_linear(&s, &t, p.tg, &o, NULL, &r, NULL, NULL, NULL) == -2, "student and teacher n differ");
}

int main(void)
{
    hand_checks();
    beta_ends();
    all_ignored();
    printf("hand-worked checks, beta 0 / 1, all ignored: %s\n", fd_failures ? "FAIL" : "ok");
    teacher_equals_student();
    jsd_probability_space();
    static const struct {
        ref_divergence div;
        double beta;
    } divs[] = {{REF_DIVERGENCE_FORWARD_KL, 0.5}, {REF_DIVERGENCE_REVERSE_KL, 0.5}, {REF_DIVERGENCE_JSD, 0.5},
                {REF_DIVERGENCE_JSD, 0.3},        {REF_DIVERGENCE_JSD, 0.0},        {REF_DIVERGENCE_JSD, 1.0}};
    static const double temperatures[] = {1.0, 0.7, 2.0};
    int index = 0;
    for (size_t d = 0; d < sizeof divs / sizeof divs[0]; d++)
        for (size_t k = 0; k < sizeof temperatures / sizeof temperatures[0]; k++)
            for (int mode = 0; mode < 3; mode++)
                for (int red = 0; red <= 2; red++) {
                    ref_distill_options o;
                    ref_distill_options_default(&o);
                    o.divergence = divs[d].div;
                    o.beta = divs[d].beta;
                    o.temperature = temperatures[k];
                    o.reduction = red;
                    if (mode == 2) {
                        o.weight_soft_loss = 0.6;
                        o.weight_hard_loss = 0.4;
                    }
                    fd_case(index++, &o, mode);
                }
    /* Top-k: the KLs at top_k 1 without the tail are exactly 0 (one renormalised entry on each side); the rest
     * against finite differences. */
    static const int64_t ks[] = {1, 3, 5};
    for (size_t d = 0; d < sizeof divs / sizeof divs[0]; d++)
        for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++)
            for (int tail = 0; tail < 2; tail++)
                for (int temp = 0; temp < 2; temp++) {
                    ref_distill_options o;
                    ref_distill_options_default(&o);
                    o.divergence = divs[d].div;
                    o.beta = divs[d].beta;
                    o.temperature = temp ? 0.7 : 1.0;
                    o.top_k = ks[k];
                    o.add_tail = tail;
                    o.reduction = index % 3;
                    const int mode = (index / 3) % 3;
                    const int kl = o.divergence != REF_DIVERGENCE_JSD || o.beta == 0.0 || o.beta == 1.0;
                    if (ks[k] == 1 && !tail && kl) {
                        problem p;
                        make_problem(&p, 0x70C1ull + (uint64_t)index);
                        ref_linear s, t;
                        linears(&p, &s, &t);
                        double dx[N * HS];
                        ref_distill_result r = {1.0, 1.0, 1.0, NULL};
                        o.weight_hard_loss = 0.0;
                        fd_expect(ref_distill_linear(&s, &t, NULL, &o, grad_of(&p, &o), &r, dx, NULL, NULL) == 0 &&
                                      r.loss == 0.0 && fd_max_abs(dx, N * HS) == 0.0,
                                  "top-1 without the tail: a KL is not exactly 0");
                        index++;
                        continue;
                    }
                    if (mode == 2) {
                        o.weight_soft_loss = 0.6;
                        o.weight_hard_loss = 0.4;
                    }
                    fd_case(index++, &o, mode);
                }
    printf("%d finite-difference cases, largest error %.1e (tolerance %.0e), %d failures\n", index,
           worst_case_error, TOLERANCE, fd_failures);
    return fd_failures ? 1 : 0;
}
