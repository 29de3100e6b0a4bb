#include "bf16.h"

#include <stdlib.h>

uint16_t *bf16_round_in_place(float *values, size_t count)
{
    uint16_t *bits = malloc(count ? count * sizeof(uint16_t) : 1);
    if (!bits)
        return NULL;
    for (size_t i = 0; i < count; i++) {
        bits[i] = bf16_from_float(values[i]);
        values[i] = bf16_to_float(bits[i]);
    }
    return bits;
}
