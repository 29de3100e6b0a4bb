/* The log-prob head in double over materialized logits (formulas in ref_logprob.h). */
#include "ref_logprob.h"

#include <math.h>
#include <stdlib.h>

static double at(const double *g, int64_t i)
{
    return g ? g[i] : 0.0;
}

int ref_logprob(const ref_linear *lin, const int64_t *targets, const ref_logprob_options *o, double *logp,
                double *entropy, double *lse, const ref_logprob_grads *g, double *dx, double *dweight, double *dbias)
{
    return ref_logprob_support(lin, targets, NULL, o, logp, entropy, lse, g, dx, dweight, dbias);
}

int ref_logprob_support(const ref_linear *lin, const int64_t *targets, const unsigned char *support,
                        const ref_logprob_options *o, double *logp, double *entropy, double *lse,
                        const ref_logprob_grads *g, double *dx, double *dweight, double *dbias)
{
    const int64_t n = lin->n, vocab = lin->vocab;
    double *u = ref_linear_logits(lin), *s = malloc((size_t)vocab * sizeof(double));
    if (!u || !s) {
        free(u);
        free(s);
        return -1;
    }
    const double m = o->logit_scale, cap = o->softcap, t = o->temperature;
    for (int64_t i = 0; i < n; i++) {
        double *row = u + i * vocab; /* becomes dL/du */
        const int counted = targets[i] != o->ignore_index;
        const unsigned char *in = support ? support + i * vocab : NULL;
        for (int64_t j = 0; j < vocab; j++)
            s[j] = in && !in[j] ? -INFINITY : (cap > 0.0 ? cap * tanh(m * row[j] / cap) : m * row[j]) / t;
        const double l = ref_linear_row_lse(s, vocab);
        double sum_ps = 0.0;
        for (int64_t j = 0; j < vocab; j++)
            sum_ps += in && !in[j] ? 0.0 : exp(s[j] - l) * s[j];
        const double h = l - sum_ps;
        if (logp)
            logp[i] = counted ? s[targets[i]] - l : 0.0;
        if (entropy)
            entropy[i] = counted ? h : 0.0;
        if (lse)
            lse[i] = counted ? l : 0.0;
        for (int64_t j = 0; g && j < vocab; j++) {
            if (in && !in[j]) {
                row[j] = 0.0;
                continue;
            }
            const double p = exp(s[j] - l);
            const double ds = at(g->logp, i) * ((j == targets[i]) - p) - at(g->entropy, i) * p * (s[j] - l + h) +
                        at(g->lse, i) * p;
            const double th = cap > 0.0 ? tanh(m * row[j] / cap) : 0.0;
            row[j] = counted ? ds * (m / t) * (1.0 - th * th) : 0.0;
        }
    }
    if (g)
        ref_linear_backward(lin, u, dx, dweight, dbias);
    free(u);
    free(s);
    return 0;
}

double ref_logprob_objective(const ref_linear *lin, const int64_t *targets, const ref_logprob_options *o,
                             const ref_logprob_grads *g)
{
    return ref_logprob_support_objective(lin, targets, NULL, o, g);
}

double ref_logprob_support_objective(const ref_linear *lin, const int64_t *targets, const unsigned char *support,
                                     const ref_logprob_options *o, const ref_logprob_grads *g)
{
    const size_t n = (size_t)lin->n;
    double *values = malloc(3 * n * sizeof(double));
    const int failed = !values || ref_logprob_support(lin, targets, support, o, values, values + n, values + 2 * n,
                                                      NULL, NULL, NULL, NULL) != 0;
    if (failed) {
        free(values);
        return NAN;
    }
    double total = 0.0;
    for (size_t i = 0; i < n; i++)
        total += at(g->logp, (int64_t)i) * values[i] + at(g->entropy, (int64_t)i) * values[n + i] +
                 at(g->lse, (int64_t)i) * values[2 * n + i];
    free(values);
    return total;
}
