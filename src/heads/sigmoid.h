/* The logistic function and its log in double, without overflow: the preference heads' per-sequence math. */
#ifndef FH_SIGMOID_H
#define FH_SIGMOID_H

#include <math.h>

static inline double fh_log_sigmoid(double x)
{
    return x >= 0.0 ? -log1p(exp(-x)) : x - log1p(exp(x));
}

static inline double fh_sigmoid(double x)
{
    return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

#endif
