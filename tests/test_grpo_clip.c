/* grpo_clip: ratios on both sides of the clip range and exactly on 1 - eps_low, 1 + eps_high and delta:
 * on-policy (r == 1 exactly, bounds moved onto 1), and off-policy in fh_grpo_backward with old log-probs built
 * so that logp - old is the same exact double on every token of a category. Tolerances: grpo_harness.h. */
#include "ce_case.h"
#include "grpo_harness.h"
#include "ref_grpo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Relative normwise distance between two reference gradients (to show that a test can tell them apart). */
static double gp_rel_distance(const double *a, const double *b, size_t count)
{
    double sd = 0.0, sb = 0.0;
    for (size_t i = 0; i < count; i++) {
        sd += (a[i] - b[i]) * (a[i] - b[i]);
        sb += b[i] * b[i];
    }
    return sb > 0.0 ? sqrt(sd / sb) : sqrt(sd);
}

/* dx of the reference (ref_grpo_backward) under options o. */
static double *gp_reference_dx(const gp_problem *p, const fh_grpo_options *o)
{
    gp_reference r;
    gp_run_reference(p, o, 1.0, 0.0, &r);
    double *dx = r.dx;
    r.dx = NULL;
    gp_reference_free(&r);
    return dx;
}

/* On-policy, r == 1 exactly in both the library (logp - logp = 0, exp(0) = 1; at the sequence level a masked sum
 * of zeros) and the reference (logp - sg(logp)). Moving a bound onto 1 puts every token on it:
 *   eps_low = 0:  c2 = clamp(1, 1, 1 + eps_high) sits on its lower bound; A < 0 picks it (tie with c1 = r).
 *   eps_high = 0: c2 sits on its upper bound; A > 0 picks it.
 *   delta = 1:    c1 = min(r, 1) sits on its bound.
 * torch passes the gradient at a clamp's bound and splits min()'s ties in halves: with c1 == c2 == r both halves
 * carry dr, so the whole gradient flows. (The tie rule cannot be seen on its own: whenever c1 == c2 with A != 0
 * both operands have the same derivative, so giving a tie to one side is an equivalent program; it matters only
 * together with the clamp rule.) A library treating a bound as open would make the clamped operand constant there
 * and lose half (tie split) or all of the gradient on the rows whose A picks it: each variant also checks that the
 * reference with the bound moved 1e-9 past r (the open-interval answer) differs from the closed one by far more
 * than the tolerance, so the comparison has teeth. Clip metrics count strict inequalities: exactly 0 here (compared with the
 * reference's 0 within GRPO_METRIC_TOL, no guard needed since r is exactly 1 in both). */
static void test_on_policy_bounds(void)
{
    static const struct {
        const char *name;
        double eps_low, eps_high, delta;
        double open_eps_low, open_eps_high, open_delta; /* the bound moved just past r = 1 */
    } variants[] = {
        {"eps_low = 0 (r on 1 - eps_low)", 0.0, 0.2, NAN, -1e-9, 0.2, NAN},
        {"eps_high = 0 (r on 1 + eps_high)", 0.2, 0.0, NAN, 0.2, -1e-9, NAN},
        {"delta = 1 (r on delta)", 0.2, 0.2, 1.0, 0.2, 0.2, 1.0 - 1e-9},
        {"eps_low = eps_high = 0, delta = 1", 0.0, 0.0, 1.0, -1e-9, -1e-9, 1.0 - 1e-9},
    };
    static const fh_grpo_loss_type clipped[] = {FH_GRPO_LOSS_GRPO, FH_GRPO_LOSS_BNPO, FH_GRPO_LOSS_DR_GRPO,
                                                FH_GRPO_LOSS_DAPO, FH_GRPO_LOSS_LUSPO};
    int k = 0;
    for (size_t vi = 0; vi < TU_COUNT(variants); vi++) {
        for (size_t lt = 0; lt < TU_COUNT(clipped); lt++)
            for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
                for (int with_beta = 0; with_beta <= 1; with_beta++, k++) {
                    fh_grpo_options o;
                    gp_options(&o, clipped[lt], gp_all_levels[lv]);
                    o.temperature = 0.7;
                    o.epsilon_low = variants[vi].eps_low;
                    o.epsilon_high = variants[vi].eps_high;
                    o.delta = variants[vi].delta;
                    o.beta = with_beta ? 0.04 : 0.0;
                    gp_problem p;
                    gp_init(&p, 5, 6, 8, 21, gp_pick(k, 41, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, gp_pick(k, 42, 2),
                            4000 + (uint64_t)k);
                    gp_set_ref(&p, o.temperature);
                    for (int step = 0; step <= 1; step++) {
                        const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
                        gp_check(&p, &o, &c, variants[vi].name);
                    }
                    gp_free(&p);
                }
        /* Teeth: closed bound vs the open-interval answer, reference only (the library rejects eps < 0). */
        fh_grpo_options closed, open;
        gp_options(&closed, FH_GRPO_LOSS_GRPO, FH_GRPO_IS_TOKEN);
        closed.epsilon_low = variants[vi].eps_low;
        closed.epsilon_high = variants[vi].eps_high;
        closed.delta = variants[vi].delta;
        open = closed;
        open.epsilon_low = variants[vi].open_eps_low;
        open.epsilon_high = variants[vi].open_eps_high;
        open.delta = variants[vi].open_delta;
        gp_problem p;
        gp_init(&p, 5, 6, 8, 21, FH_LAYOUT_VH, 0, 4900 + vi);
        double *a = gp_reference_dx(&p, &closed), *b = gp_reference_dx(&p, &open);
        const double dist = gp_rel_distance(b, a, (size_t)(gp_n(&p) * p.hidden));
        TU_CHECK(dist > 1e3 * GRPO_GRAD_NORM_REL_TOL, "%s: the open-bound gradient differs by only %.2e",
                 variants[vi].name, dist);
        free(a);
        free(b);
        gp_free(&p);
    }
    /* cispo's cap eps_high = 1 with r = 1: min(r, 1) on its bound (detached: the value is 1 either way) and
     * cispo_clip_ratio counts r > eps_high strictly: compared with the reference (both 0 here). */
    for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
        for (int step = 0; step <= 1; step++) {
            fh_grpo_options o;
            gp_options(&o, FH_GRPO_LOSS_CISPO, gp_all_levels[lv]);
            o.epsilon_high = 1.0;
            gp_problem p;
            gp_init(&p, 5, 6, 8, 21, FH_LAYOUT_VH, 1, 4800 + lv);
            const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = step};
            gp_check(&p, &o, &c, "cispo cap on r = 1");
            gp_fused f;
            if (gp_run_fused(&p, &o, &c, &f) == FH_OK)
                TU_CHECK(f.metrics.cispo_clip_ratio == 0.0, "cispo_clip_ratio %g with r == eps_high",
                         f.metrics.cispo_clip_ratio);
            gp_fused_free(&f);
            gp_free(&p);
        }
    gp_print_worst("grpo_clip (on-policy)");
}

/* Off-policy, exactly on the bounds, in fh_grpo_backward (whose head sees the fp32 per_token_logp the forward
 * saved, so the test controls logp - old exactly): every token gets a category with an exact log-ratio d (a
 * multiple of 2^-10), old = logp - d in fp32 when that is exact (else the token is put inside, d = 0). Then
 * r = exp(d) is the same double in the library and in the reference head fed the same fp32 log-probs, and the
 * bounds are built from those very doubles: 1 - eps_low == exp(D_LO) and 1 + eps_high == exp(D_HI) exactly
 * (1 - (1 - r) and 1 + (r - 1) are exact for r in [0.5, 2]), delta == exp(D_DELTA).
 * Categories: below 1 - eps_low, on it, inside (r < 1 and r == 1), on 1 + eps_high, between it and delta, on
 * delta, above delta. Token level: category (b + t) mod 8 and A of alternating signs over rows. Sequence level:
 * one category per row (all its tokens share d, so s_b == d exactly), both signs of A for each.
 * Reference: ref_grpo_head's coefficients on the same fp32 log-probs, ref_grpo_row_grad on the double logits.
 * Tolerance GRPO_GRAD_NORM_REL_TOL; teeth: moving the three bounds 1e-9 past their tokens changes the reference
 * gradient by more than 1000x that. */
enum { CAT_BELOW_LO, CAT_ON_LO, CAT_INSIDE, CAT_ONE, CAT_ON_HI, CAT_BETWEEN, CAT_ON_DELTA, CAT_ABOVE, CAT_COUNT };
#define D_LO (-0.25)
#define D_HI 0.1875
#define D_DELTA 0.375

static double category_log_ratio(int cat)
{
    static const double d[CAT_COUNT] = {D_LO - 0.25, D_LO, -0.125, 0.0, D_HI, (D_HI + D_DELTA) / 2, D_DELTA,
                                        D_DELTA + 0.25};
    return d[cat];
}

/* Sets p->old from the fp32 log-probs and counts the unmasked tokens (token level) or rows (sequence level) that
 * landed exactly on each category, by sign of A (on[cat][A < 0]). */
static int exact_category(int sequence_level, int64_t b, int64_t t)
{
    return sequence_level ? (int)((b / 8) % CAT_COUNT) : (int)((b + t) % CAT_COUNT);
}

static void set_exact_old(gp_problem *p, const float *logp, int sequence_level, int on[CAT_COUNT][2])
{
    const int64_t B = p->batch, T = p->seq;
    free(p->old);
    p->old = tu_alloc((size_t)gp_n(p), sizeof(float));
    memset(on, 0, sizeof(int) * CAT_COUNT * 2);
    for (int64_t b = 0; b < B; b++) {
        int row_exact = 1;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const int cat = exact_category(sequence_level, b, t);
            const double d = category_log_ratio(cat);
            p->old[i] = (float)((double)logp[i] - d);
            const int exact = (double)logp[i] - (double)p->old[i] == d;
            if (!exact)
                p->old[i] = logp[i]; /* inside: d = 0 */
            row_exact &= exact;
            if (!sequence_level && exact && p->mask[i] != 0.0f)
                on[cat][p->adv[b] < 0.0f]++;
        }
        if (sequence_level && !row_exact) /* the whole row inside, so that s_b stays exact */
            for (int64_t t = 0; t < T; t++)
                p->old[b * T + t] = logp[b * T + t];
        if (sequence_level && row_exact)
            on[exact_category(1, b, 0)][p->adv[b] < 0.0f]++;
    }
}

static void test_off_policy_exact_bounds(void)
{
    const double r_lo = exp(D_LO), r_hi = exp(D_HI), r_delta = exp(D_DELTA);
    double teeth = INFINITY;
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int variant = 0; variant < 4; variant++, k++) {
                const int with_delta = variant & 1, with_beta = variant >> 1;
                const int sequence_level = gp_all_levels[lv] == FH_GRPO_IS_SEQUENCE;
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.temperature = 0.7;
                o.epsilon_low = 1.0 - r_lo;
                /* cispo's eps_high is an absolute cap on r: put it on the same tokens. */
                o.epsilon_high = o.loss_type == FH_GRPO_LOSS_CISPO ? r_hi : r_hi - 1.0;
                o.delta = with_delta ? r_delta : NAN;
                o.beta = with_beta ? 0.04 : 0.0;
                o.entropy_coef = gp_pick(k, 51, 3) ? 0.05 : 0.0;
                TU_CHECK(1.0 - o.epsilon_low == r_lo &&
                             (o.loss_type == FH_GRPO_LOSS_CISPO || 1.0 + o.epsilon_high == r_hi),
                         "bounds not exact");
                /* Sequence level: 8 full rows of 3 per category (4 per sign of A). Token level: 8 rows of 16, the
                 * category cycling along each row (8 tokens per category and sign), every 7th token masked. */
                const int64_t B = sequence_level ? 8 * CAT_COUNT : 8, T = sequence_level ? 3 : 16;
                gp_problem p;
                gp_init(&p, B, T, 8, 19, gp_pick(k, 52, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1, 5000 + (uint64_t)k);
                for (int64_t b = 0; b < B; b++) {
                    p.adv[b] = (float)((b & 1 ? -1.0 : 1.0) * (0.5 + 0.05 * (double)b));
                    for (int64_t t = 0; t < T; t++)
                        p.mask[b * T + t] = sequence_level || (b * T + t) % 7 != 6 ? 1.0f : 0.0f;
                }
                gp_fix_ids(&p);
                gp_set_ref(&p, o.temperature);
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16};
                fh_context *ctx = gp_context(&c);
                fh_linear lin;
                gp_linear(&p, &lin);
                gp_fused f;
                gp_fused_alloc(&p, 0.0f, &f);
                /* The forward's saved per-token values (run on-policy: they do not depend on old). */
                const fh_grpo_batch fb = gp_batch(&p, &o);
                fh_grpo_outputs out = {&f.loss, &f.metrics, f.logp, f.per_token_loss, f.entropy, f.lse};
                fh_status st = fh_grpo_forward(ctx, &lin, &fb, &o, &out);
                int on[CAT_COUNT][2];
                set_exact_old(&p, f.logp, sequence_level, on);
                /* Precondition: tokens (rows) exactly on each bound, on the side of A where the bound carries the
                 * gradient (A < 0 on 1 - eps_low and on delta, A > 0 on 1 + eps_high), and the other side too. */
                TU_CHECK(on[CAT_ON_LO][1] && on[CAT_ON_HI][0] && on[CAT_ON_DELTA][1] && on[CAT_ON_LO][0] &&
                             on[CAT_ON_HI][1] && on[CAT_ON_DELTA][0],
                         "too few tokens exactly on the bounds: lo %d/%d hi %d/%d delta %d/%d", on[CAT_ON_LO][0],
                         on[CAT_ON_LO][1], on[CAT_ON_HI][0], on[CAT_ON_HI][1], on[CAT_ON_DELTA][0],
                         on[CAT_ON_DELTA][1]);
                const fh_grpo_batch bb = gp_batch(&p, &o);
                const float grad = gp_pick(k, 53, 2) ? -0.75f : 1.0f;
                fh_linear_grads g = {.dx = f.dx, .dx_row_stride = p.hidden, .dx_beta = 0.0f, .dweight = f.dweight, .dweight_beta = 0.0f, .dbias = f.dbias, .dbias_beta = 0.0f};
                if (st == FH_OK)
                    st = fh_grpo_backward(ctx, &lin, &bb, &o, f.logp, f.lse, f.entropy, &grad, &g);
                char desc[512];
                gp_describe(&p, &o, &c, desc, sizeof desc);
                TU_CHECK(st == FH_OK, "exact bounds [%s]: status %d", desc, (int)st);
                const size_t n = (size_t)gp_n(&p), h = (size_t)p.hidden, v = (size_t)p.vocab;
                double *dx = tu_alloc(n * h, sizeof(double)), *dw = tu_alloc(h * v, sizeof(double));
                double *db = tu_alloc(v, sizeof(double));
                gp_reference_backward_from_logp(&p, &o, f.logp, f.entropy, grad, dx, dw, db);
                if (st == FH_OK) {
                    const double ex = ce_compare(f.dx, dx, n * h).norm_rel,
                                 ew = ce_compare(f.dweight, dw, h * v).norm_rel,
                                 eb = ce_compare(f.dbias, db, v).norm_rel;
                    TU_CHECK(ex <= GRPO_GRAD_NORM_REL_TOL && ew <= GRPO_GRAD_NORM_REL_TOL &&
                                 eb <= GRPO_GRAD_NORM_REL_TOL,
                             "exact bounds [%s]: dx %.2e dweight %.2e dbias %.2e (tol %g)", desc, ex, ew, eb,
                             GRPO_GRAD_NORM_REL_TOL);
                    const gp_diff d = {.dx = ex, .dweight = ew, .dbias = eb};
                    gp_track(&d);
                }
                /* Teeth (clipped family, where the bounds carry gradient): the open-interval answer. */
                if (gp_clipped(gp_all_losses[lt])) {
                    fh_grpo_options open = o;
                    open.epsilon_low = o.epsilon_low - 1e-9;
                    open.epsilon_high = o.epsilon_high - 1e-9;
                    open.delta = with_delta ? o.delta - 1e-9 : NAN;
                    double *dx_open = tu_alloc(n * h, sizeof(double)), *dw_open = tu_alloc(h * v, sizeof(double));
                    gp_reference_backward_from_logp(&p, &open, f.logp, f.entropy, grad, dx_open, dw_open, NULL);
                    free(dw_open);
                    const double dist = gp_rel_distance(dx_open, dx, n * h);
                    TU_CHECK(dist > 1e3 * GRPO_GRAD_NORM_REL_TOL, "exact bounds [%s]: open bounds differ by only %.2e",
                             desc, dist);
                    teeth = fmin(teeth, dist);
                    free(dx_open);
                }
                free(dx), free(dw), free(db);
                gp_fused_free(&f);
                fh_context_destroy(ctx);
                gp_free(&p);
            }
    const char *verbose = getenv("FH_TEST_VERBOSE");
    if (verbose && strcmp(verbose, "1") == 0)
        fprintf(stderr, "\n[grpo_clip (exact bounds)] smallest open-vs-closed distance %.2e\n", teeth);
    gp_print_worst("grpo_clip (exact bounds)");
}

static const tu_test tests[] = {
    {"on-policy r == 1 on each bound", test_on_policy_bounds},
    {"off-policy ratios exactly on the bounds (backward)", test_off_policy_exact_bounds},
};
const tu_suite suite_grpo_clip = {tests, TU_COUNT(tests)};
