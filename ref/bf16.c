#include "bf16.h"

#include <stdlib.h>
#include <string.h>

uint16_t bf16_from_float(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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
