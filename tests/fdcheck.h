/* What the finite-difference checks of the reference (ref_*_fdcheck.c, one program each) share: their random inputs,
 * the failure count that becomes the exit status, and the error measures. */
#ifndef FH_FDCHECK_H
#define FH_FDCHECK_H

#include <stdint.h>

/* The state fd_uniform draws from; a check seeds it per case, so that each case's inputs stand alone. */
extern uint64_t fd_rng_state;

/* Uniform in [lo, hi) (ref_uniform on fd_rng_state). */
double fd_uniform(double lo, double hi);

/* a[k] = fd_uniform(lo, hi) for k < count, in order. */
void fd_fill(double *a, int count, double lo, double hi);

/* Failed expectations so far; a check exits nonzero when there is one. */
extern int fd_failures;

/* Counts a failure and prints `what` unless ok. */
void fd_expect(int ok, const char *what);

/* |f - g| relative to the larger magnitude, and to no less than floor (absolute when both are 0). */
double fd_rel_err(double f, double g, double floor);

/* The largest |a[k]|; infinity where an entry is NaN, so that a NaN gradient cannot pass as small. */
double fd_max_abs(const double *a, int count);

/* a within tol of b, relative to max(1, |b|): a hand-worked value. */
int fd_close_to(double a, double b, double tol);

#endif
