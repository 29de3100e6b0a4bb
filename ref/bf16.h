/* bf16 values for the tests, tools and benchmarks: the reference computes in double on the bf16-valued inputs the
 * library multiplies, so a bf16 case is the fp32 case with its inputs rounded first. */
#ifndef FH_REF_BF16_H
#define FH_REF_BF16_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The bf16 bits nearest to f (ties to even; NaN stays NaN). Inline: the materialized baseline rounds every
 * logit's gradient with it. */
static inline uint16_t bf16_from_float(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rounds values[0..count) to bf16 in place and returns their bits (malloc'd; the caller frees them), or NULL
 * when out of memory. */
uint16_t *bf16_round_in_place(float *values, size_t count);

#endif
