/* Plain triple loops in a fixed order, summing k (forward) or the long axis (backward) innermost: the results
 * every fused comparison and finite-difference check is measured against, so the order must not change. */
#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

double *ref_linear_logits(const ref_linear *lin)
{
    const int64_t n = lin->n, h = lin->hidden, v = lin->vocab;
    double *u = malloc(sizeof(double) * (size_t)(n * v));
    if (!u)
        return NULL;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < v; j++) {
            double acc = lin->bias ? lin->bias[j] : 0.0;
            for (int64_t k = 0; k < h; k++)
                acc += lin->x[i * h + k] * lin->weight[k * v + j];
            u[i * v + j] = acc;
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
        for (int64_t k = 0; k < h; k++)
            for (int64_t j = 0; j < v; j++) {
                double acc = 0.0;
                for (int64_t i = 0; i < n; i++)
                    acc += lin->x[i * h + k] * du[i * v + j];
                dweight[k * v + j] = acc;
            }
    if (dbias)
        for (int64_t j = 0; j < v; j++) {
            double acc = 0.0;
            for (int64_t i = 0; i < n; i++)
                acc += du[i * v + j];
            dbias[j] = acc;
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
