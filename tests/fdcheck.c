#include "fdcheck.h"

#include "rng.h"

#include <math.h>
#include <stdio.h>

uint64_t fd_rng_state;
int fd_failures;

double fd_uniform(double lo, double hi)
{
    return lo + (hi - lo) * ref_uniform(&fd_rng_state);
}

void fd_fill(double *a, int count, double lo, double hi)
{
    for (int k = 0; k < count; k++)
        a[k] = fd_uniform(lo, hi);
}

void fd_expect(int ok, const char *what)
{
    if (!ok) {
        printf("FAIL: %s\n", what);
        fd_failures++;
    }
}

double fd_rel_err(double f, double g, double floor)
{
    double d = fabs(f) > fabs(g) ? fabs(f) : fabs(g);
    if (d < floor)
        d = floor;
    return d > 0.0 ? fabs(f - g) / d : fabs(f - g);
}

double fd_max_abs(const double *a, int count)
{
    double m = 0.0;
    for (int k = 0; k < count; k++)
        if (fabs(a[k]) > m || isnan(a[k]))
            m = isnan(a[k]) ? INFINITY : fabs(a[k]);
    return m;
}

int fd_close_to(double a, double b, double tol)
{
    return fabs(a - b) <= tol * fmax(1.0, fabs(b));
}
