/* Plain loops with a fixed order of summation for every element: k ascending for a logit (from its bias, or 0), j
 * ascending for dx, i ascending for dweight and dbias. Those orders are what every fused comparison and
 * finite-difference check is measured against, so they must not change. The loops are nested so that the innermost
 * one walks contiguous rows (an element's sum then advances one term per pass of the loop above it): the same
 * operations in the same order per element, without striding through a whole matrix for each term. */
#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

double *ref_linear_logits(const ref_linear *lin)
{
    const int64_t n = lin->n, h = lin->hidden, v = lin->vocab;
    double *u = malloc(sizeof(double) * (size_t)(n * v));
    if (!u)
        return NULL;
    for (int64_t i = 0; i < n; i++) {
        double *row = u + i * v;
        for (int64_t j = 0; j < v; j++)
            row[j] = lin->bias ? lin->bias[j] : 0.0;
        for (int64_t k = 0; k < h; k++) {
            const double xk = lin->x[i * h + k], *w = lin->weight + k * v;
            for (int64_t j = 0; j < v; j++)
                row[j] += xk * w[j];
        }
    }
    return u;
}

void ref_linear_backward(const ref_linear *lin, const double *du, double *dx, double *dweight, double *dbias)
{
    const int64_t n = lin->n, h = lin->hidden, v = lin->vocab;
    if (dx)
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < h; k++) {
                double acc = 0.0;
                for (int64_t j = 0; j < v; j++)
                    acc += du[i * v + j] * lin->weight[k * v + j];
                dx[i * h + k] = acc;
            }
    if (dweight)
        for (int64_t k = 0; k < h; k++) {
            double *row = dweight + k * v;
            for (int64_t j = 0; j < v; j++)
                row[j] = 0.0;
            for (int64_t i = 0; i < n; i++) {
                const double xk = lin->x[i * h + k], *g = du + i * v;
                for (int64_t j = 0; j < v; j++)
                    row[j] += xk * g[j];
            }
        }
    if (dbias) {
        for (int64_t j = 0; j < v; j++)
            dbias[j] = 0.0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < v; j++)
                dbias[j] += du[i * v + j];
    }
}

double ref_linear_row_lse(const double *u, int64_t vocab)
{
    double m = -INFINITY;
    for (int64_t j = 0; j < vocab; j++)
        if (u[j] > m)
            m = u[j];
    double s = 0.0;
    for (int64_t j = 0; j < vocab; j++)
        s += exp(u[j] - m);
    return m + log(s);
}
