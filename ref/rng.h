/* The one random number generator of the tests, tools and benchmarks' inputs: deterministic, so that every run of a
 * case draws the same numbers. */
#ifndef FH_REF_RNG_H
#define FH_REF_RNG_H

#include <stdint.h>

/* Uniform in [0, 1) (splitmix64), advancing *state. */
double ref_uniform(uint64_t *state);

#endif
