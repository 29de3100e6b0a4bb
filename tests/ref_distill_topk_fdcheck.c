/* ref_distill_topk_fdcheck: checks ref_distill_topk_linear's student gradients against central finite differences of
 * its loss, and values known without it, over add_tail {0, 1} x temperature {1, 0.7} x {soft only without targets,
 * soft with ignored targets, soft 0.6 + hard 0.4} x reduction {mean, sum, none} x k {1, 4, 11}. Prints one line per
 * case, exits non-zero on any failure.
 *
 * Inputs. N = 6 tokens, hidden 5, V = 11, a bias; weights U(-1.5, 1.5). The teacher's log-probs are a random
 * log-softmax over V tempered at 1 / 0.6, its top-k ids in order (so the top-k mass is below 1 unless k = V); token 2
 * has its last entry padded (-inf, id 0 unread), token 3 every entry padded (contributes 0, is counted), token 5 a
 * repeated id (each entry its own support element). Tokens 1 and 4 are ignored where targets are given.
 *
 * Tolerance. As ref_distill_fdcheck.c: for analytic g and finite difference f the error is |f - g| / max(|f|, |g|,
 * 1e-2 S), S the largest |g| of the case, and every case must stay <= 1e-6; h = 1e-5 balances truncation (h^2) and
 * rounding (eps / h) in double. A wrong formula (the tail's term missing, the renormalisation's term missing, 1 / T
 * missing) is off by ~1e-2 S or more. Measured worst: 1.2e-8 over the 96 cases (k = 1 without the tail in the soft
 * modes is identically 0 and left to the known values).
 *
 * Known values: k = 1 without the tail gives D = 0 exactly and a zero soft gradient; with k = V and distinct ids,
 * without the tail, D is the full forward KL(q || p) of ref_distill_head with the teacher's logits; the padded token 3
 * adds 0. */
#include "fdcheck.h"
#include "ref_distill_topk.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 6, H = 5, V = 11 };
static const double STEP = 1e-5, TOLERANCE = 1e-6;
static const int64_t IGNORE = -100;

typedef struct problem {
    double x[N * H], w[H * V], b[V], teacher_logits[N * V];
    int64_t ids[N * V], targets[N];
    double logprobs[N * V];
    ref_topk_teacher t;
    const int64_t *tg;
    double grad[N];
} problem;

/* Token i's teacher: log_softmax(logits / 0.6) over V, the k largest in order. */
static void make_problem(problem *p, uint64_t seed, int64_t k)
{
    fd_rng_state = seed;
    fd_fill(p->x, N * H, -1.0, 1.0);
    fd_fill(p->w, H * V, -1.5, 1.5);
    fd_fill(p->b, V, -0.5, 0.5);
    for (int i = 0; i < N; i++) {
        double *l = p->teacher_logits + i * V, lp[V];
        fd_fill(l, V, -2.0, 2.0);
        double scaled[V];
        for (int j = 0; j < V; j++)
            scaled[j] = l[j] / 0.6;
        const double s = ref_linear_row_lse(scaled, V);
        int used[V] = {0};
        for (int j = 0; j < V; j++)
            lp[j] = scaled[j] - s;
        for (int64_t e = 0; e < k; e++) { /* the e-th largest */
            int best = -1;
            for (int j = 0; j < V; j++)
                if (!used[j] && (best < 0 || lp[j] > lp[best]))
                    best = j;
            used[best] = 1;
            p->ids[i * k + e] = best;
            p->logprobs[i * k + e] = lp[best];
        }
        p->targets[i] = i == 1 || i == 4 ? IGNORE : (int64_t)(fd_uniform(0.0, 1.0) * V) % V;
    }
    if (k > 1) {
        p->logprobs[2 * k + k - 1] = -INFINITY;
        p->ids[2 * k + k - 1] = 0;
        p->ids[5 * k + 1] = p->ids[5 * k];
    }
    for (int64_t e = 0; e < k; e++)
        p->logprobs[3 * k + e] = -INFINITY, p->ids[3 * k + e] = -7; /* unread */
    const ref_topk_teacher t = {k, p->ids, p->logprobs};
    p->t = t;
    p->tg = p->targets;
    static const double g_none[N] = {0.7, -1.1, 1.9, 0.4, 1.3, -0.6};
    memcpy(p->grad, g_none, sizeof g_none);
}

static const double *grad_of(const problem *p, const ref_distill_topk_options *o)
{
    static const double one = 1.3;
    return o->reduction == 2 ? p->grad : &one;
}

static double objective(const problem *p, const ref_distill_topk_options *o)
{
    const ref_linear s = {N, H, V, p->x, p->w, p->b};
    double per[N];
    ref_distill_result r = {0.0, 0.0, 0.0, per};
    if (ref_distill_topk_linear(&s, &p->t, p->tg, o, NULL, &r, NULL, NULL, NULL)) {
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

static double worst_case_error;

/* Max over param's entries of the error of g against central differences. */
static double fd_tensor(problem *p, const ref_distill_topk_options *o, double *param, const double *g, int count,
                        double floor)
{
    double worst = 0.0;
    for (int j = 0; j < count; j++) {
        const double keep = param[j];
        param[j] = keep + STEP;
        const double up = objective(p, o);
        param[j] = keep - STEP;
        const double down = objective(p, o);
        param[j] = keep;
        const double f = (up - down) / (2.0 * STEP);
        double d = fmax(fmax(fabs(f), fabs(g[j])), floor);
        const double e = fabs(f - g[j]) / d;
        worst = isnan(e) || e > worst ? (isnan(e) ? INFINITY : e) : worst;
    }
    return worst;
}

static void fd_case(int index, const ref_distill_topk_options *o, int mode, int64_t k)
{
    problem p;
    make_problem(&p, 0x70C4000ull + (uint64_t)index * 7919u, k);
    if (mode == 0)
        p.tg = NULL;
    const ref_linear s = {N, H, V, p.x, p.w, p.b};
    double per[N], dx[N * H], dw[H * V], db[V];
    ref_distill_result r = {0.0, 0.0, 0.0, per};
    if (ref_distill_topk_linear(&s, &p.t, p.tg, o, grad_of(&p, o), &r, dx, dw, db)) {
        printf("FAIL: forward-backward returned an error\n");
        exit(2);
    }
    fd_expect(isfinite(r.loss), "the loss is not finite");
    fd_expect(o->weight_hard_loss != 0.0 || per[3] == 0.0, "the token without a valid entry has a soft loss");
    double scale = 0.0;
    for (int j = 0; j < N * H; j++)
        scale = fmax(scale, fabs(dx[j]));
    for (int j = 0; j < H * V; j++)
        scale = fmax(scale, fabs(dw[j]));
    for (int j = 0; j < V; j++)
        scale = fmax(scale, fabs(db[j]));
    const double floor = 1e-2 * scale;
    double e = fd_tensor(&p, o, p.x, dx, N * H, floor);
    e = fmax(e, fd_tensor(&p, o, p.w, dw, H * V, floor));
    e = fmax(e, fd_tensor(&p, o, p.b, db, V, floor));
    static const char *red[] = {"mean", "sum", "none"}, *modes[] = {"soft", "soft+ign", "soft+hard"};
    printf("tail %d T %.1f %-9s %-4s k %2lld: loss %+.6f  max rel err %.2e  (S %.3g)\n", o->add_tail, o->temperature,
           modes[mode], red[o->reduction], (long long)k, r.loss, e, scale);
    fd_expect(e <= TOLERANCE, "a gradient disagrees with finite differences");
    worst_case_error = fmax(worst_case_error, e);
}

/* k = 1 without the tail: D = 0 exactly, soft gradient 0. k = V with distinct ids, no tail: the full forward KL. */
static void known_values(void)
{
    ref_distill_topk_options o;
    ref_distill_topk_options_default(&o);
    o.add_tail = 0;
    problem p;
    make_problem(&p, 0xABCull, 1);
    const ref_linear s = {N, H, V, p.x, p.w, p.b};
    double dx[N * H], per[N];
    ref_distill_result r = {0.0, 0.0, 0.0, per};
    const double one = 1.0;
    fd_expect(ref_distill_topk_linear(&s, &p.t, NULL, &o, &one, &r, dx, NULL, NULL) == 0 && r.loss == 0.0,
           "k = 1 without the tail is not exactly 0");
    int zero = 1;
    for (int j = 0; j < N * H; j++)
        zero &= dx[j] == 0.0;
    fd_expect(zero, "k = 1 without the tail has a gradient");

    for (int reps = 0; reps < 2; reps++) {
        o.temperature = reps ? 0.7 : 1.0;
        make_problem(&p, 0xDEFull + (uint64_t)reps, V);
        /* Distinct ids and no padding: the teacher's full log-softmax at temperature 0.6. */
        for (int i = 0; i < N; i++)
            for (int j = 0; j < V; j++) {
                p.ids[i * V + j] = j;
                double scaled[V];
                for (int c = 0; c < V; c++)
                    scaled[c] = p.teacher_logits[i * V + c] / 0.6;
                p.logprobs[i * V + j] = scaled[j] - ref_linear_row_lse(scaled, V);
            }
        ref_distill_result topk = {0.0, 0.0, 0.0, NULL}, full = {0.0, 0.0, 0.0, NULL};
        double teacher_logits[N * V];
        for (int j = 0; j < N * V; j++)
            teacher_logits[j] = p.teacher_logits[j] / 0.6 * o.temperature; /* ref_distill tempers both */
        double *u = ref_linear_logits(&s);
        ref_distill_options fo;
        ref_distill_options_default(&fo);
        fo.divergence = REF_DIVERGENCE_FORWARD_KL;
        fo.temperature = o.temperature;
        fd_expect(u && ref_distill_topk_head(N, V, u, &p.t, NULL, &o, NULL, &topk, NULL) == 0 &&
                   ref_distill_head(N, V, u, teacher_logits, NULL, &fo, NULL, &full, NULL) == 0 &&
                   fabs(topk.loss - full.loss) <= 1e-13 * fmax(1.0, full.loss),
               "k = V without the tail is not the full forward KL");
        printf("k = V, no tail, T %.1f: %.15f vs the full forward KL %.15f\n", o.temperature, topk.loss, full.loss);
        free(u);
    }
}

int main(void)
{
    known_values();
    const double temperatures[] = {1.0, 0.7};
    const int64_t ks[] = {1, 4, V};
    int index = 0;
    for (int tail = 0; tail < 2; tail++)
        for (int ti = 0; ti < 2; ti++)
            for (int mode = 0; mode < 3; mode++)
                for (int red = 0; red < 3; red++)
                    for (int ki = 0; ki < 3; ki++) {
                        ref_distill_topk_options o;
                        ref_distill_topk_options_default(&o);
                        o.add_tail = tail;
                        o.temperature = temperatures[ti];
                        o.reduction = red;
                        if (mode == 2)
                            o.weight_soft_loss = 0.6, o.weight_hard_loss = 0.4;
                        if (mode != 2 && ks[ki] == 1 && !tail)
                            continue; /* identically 0: known_values */
                        fd_case(index++, &o, mode, ks[ki]);
                    }
    printf("%d cases, worst relative error %.2e (tolerance %.0e): %s\n", index, worst_case_error, TOLERANCE,
           fd_failures ? "FAIL" : "ok");
    return fd_failures ? 1 : 0;
}
