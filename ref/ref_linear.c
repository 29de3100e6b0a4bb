/* Plain loops with a fixed order of summation for every element: k ascending for a logit (from its bias, or 0), j
 * ascending for dx, i ascending for dweight and dbias. Those orders are what every fused comparison and
 * finite-difference check is measured against, so they must not change. The loops are nested so that the innermost
 * one walks contiguous rows (an element's sum then advances one term per pass of the loop above it), over chunks of
 * columns whose share of the matrix read for every row stays in cache: the same operations in the same order per
 * element, without striding through a whole matrix for each term. */
#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

/* Columns per chunk: a 4 KiB piece of each row. */
enum { COLUMNS = 512 };

double *ref_linear_logits(const ref_linear *lin)
{
    const int64_t n = lin->n, h = lin->hidden, v = lin->vocab;
    double *u = malloc(sizeof(double) * (size_t)(n * v));
    if (!u)
        return NULL;
    for (int64_t j0 = 0; j0 < v; j0 += COLUMNS) {
        const int64_t j1 = j0 + COLUMNS < v ? j0 + COLUMNS : v;
        for (int64_t i = 0; i < n; i++) {
            double *row = u + i * v;
            for (int64_t j = j0; j < j1; j++)
                row[j] = lin->bias ? lin->bias[j] : 0.0;
            for (int64_t k = 0; k < h; k++) {
                const double xk = lin->x[i * h + k], *w = lin->weight + k * v;
                for (int64_t j = j0; j < j1; j++)
                    row[j] += xk * w[j];
            }
        }
    }
    return u;
}

void ref_linear_backward(const ref_linear *lin, const double *du, double *dx, double *dweight, double *dbias)
{
    const int64_t n = lin->n, h = lin->hidden, v = lin->vocab;
    /* dx: four of a row's sums at a time, each its own chain of additions (one chain waits on every addition). */
    enum { SUMS = 4 };
    if (dx)
        for (int64_t i = 0; i < n; i++)
            for (int64_t k0 = 0; k0 < h; k0 += SUMS) {
                const int64_t m = h - k0 < SUMS ? h - k0 : SUMS;
                const double *g = du + i * v, *w = lin->weight + k0 * v;
                double acc[SUMS] = {0.0, 0.0, 0.0, 0.0};
                for (int64_t j = 0; j < v; j++)
                    for (int q = 0; q < m; q++)
                        acc[q] += g[j] * w[q * v + j];
                for (int q = 0; q < m; q++)
                    dx[i * h + k0 + q] = acc[q];
            }
    if (dweight)
        for (int64_t j0 = 0; j0 < v; j0 += COLUMNS) {
            const int64_t j1 = j0 + COLUMNS < v ? j0 + COLUMNS : v;
            for (int64_t k = 0; k < h; k++) {
                double *row = dweight + k * v;
                for (int64_t j = j0; j < j1; j++)
                    row[j] = 0.0;
                for (int64_t i = 0; i < n; i++) {
                    const double xk = lin->x[i * h + k], *g = du + i * v;
                    for (int64_t j = j0; j < j1; j++)
                        row[j] += xk * g[j];
                }
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
