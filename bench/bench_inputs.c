#include "bench_inputs.h"

#include "bf16.h"

#include <math.h>
#include <stdlib.h>

float *bench_filled(size_t count, float scale, unsigned seed)
{
    float *p = malloc(count * sizeof(float));
    for (size_t i = 0; p && i < count; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = scale * ((float)(seed >> 8) / 16777216.0f - 0.5f);
    }
    return p;
}

int bench_inputs_make(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in)
{
    const size_t nh = (size_t)n * hidden, hv = (size_t)hidden * vocab;
    in->x = bench_filled(nh, 2.0f, 1);
    /* x ~ U(-1, 1), w ~ U(-a, a) with a = sqrt(3 / H): logits of standard deviation ~1. */
    in->w = bench_filled(hv, 2.0f * sqrtf(3.0f / (float)hidden), 2);
    in->dx = bench_filled(nh, 1.0f, 3);
    in->dw = bench_filled(hv, 1.0f, 4);
    in->lse = bench_filled((size_t)n, 1.0f, 5);
    in->targets = malloc((size_t)n * sizeof(int64_t));
    in->x_bf16 = in->w_bf16 = NULL;
    if (!in->x || !in->w || !in->dx || !in->dw || !in->lse || !in->targets) {
        bench_inputs_free(in);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        in->targets[i] = (i * 7919) % vocab;
    return 0;
}

void bench_inputs_free(bench_inputs *in)
{
    free(in->x), free(in->w), free(in->dx), free(in->dw), free(in->lse), free(in->targets);
    free(in->x_bf16), free(in->w_bf16);
    in->x = in->w = in->dx = in->dw = in->lse = NULL;
    in->targets = NULL;
    in->x_bf16 = in->w_bf16 = NULL;
}

static uint16_t *bf16_copy(const float *f, size_t count)
{
    uint16_t *h = malloc(count * sizeof(uint16_t));
    for (size_t i = 0; h && i < count; i++)
        h[i] = bf16_from_float(f[i]);
    return h;
}

int bench_inputs_add_bf16(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in)
{
    in->x_bf16 = bf16_copy(in->x, (size_t)n * (size_t)hidden);
    in->w_bf16 = bf16_copy(in->w, (size_t)hidden * (size_t)vocab);
    return in->x_bf16 && in->w_bf16 ? 0 : -1;
}
