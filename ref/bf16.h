/* bf16 values for the tests and tools: the reference computes in double on the bf16-valued inputs the
 * library multiplies, so a bf16 case is the fp32 case with its inputs rounded first. */
#ifndef FH_REF_BF16_H
#define FH_REF_BF16_H

#include <stddef.h>
#include <stdint.h>

/* The bf16 bits nearest to f (ties to even; NaN stays NaN). */
uint16_t bf16_from_float(float f);
float bf16_to_float(uint16_t bits);

/* Rounds values[0..count) to bf16 in place and returns their bits (malloc'd; the caller frees them), or NULL
 * when out of memory. */
uint16_t *bf16_round_in_place(float *values, size_t count);

#endif
