/* Per-row elementwise kernels: fp32 values, double accumulators. */
#include "tile_kernels.h"

#include <math.h>

void fh_row_transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
{
    const float cap = tf->softcap, scale = tf->inv_temperature;
    if (bias)
        for (int64_t j = 0; j < count; j++)
            z[j] += bias[j];
    if (cap > 0.0f) {
        const float inv_cap = 1.0f / cap;
        for (int64_t j = 0; j < count; j++)
            z[j] = cap * tanhf(z[j] * inv_cap);
    }
    if (scale != 1.0f)
        for (int64_t j = 0; j < count; j++)
            z[j] *= scale;
}

void fh_row_fold(const float *z, int64_t count, int64_t first_column, int64_t target_column,
                 const float *weights, int want_weighted_sum, fh_row_state *state)
{
    float tile_max = -INFINITY;
    int64_t tile_argmax = -1;
    for (int64_t j = 0; j < count; j++)
        if (z[j] > tile_max) {
            tile_max = z[j];
            tile_argmax = j;
        }
    if (target_column >= 0 && target_column < count)
        state->z_target = z[target_column];
    if (want_weighted_sum) {
        double s = 0.0;
        if (weights)
            for (int64_t j = 0; j < count; j++)
                s += (double)weights[j] * z[j];
        else
            for (int64_t j = 0; j < count; j++)
                s += z[j];
        state->sum_weighted_z += s;
    }
    if (tile_argmax < 0) {
        /* Every logit is -inf or NaN: -inf adds nothing to the sum; NaN must propagate. */
        for (int64_t j = 0; j < count; j++)
            if (isnan(z[j]))
                state->sum_exp = NAN;
        return;
    }
    double tile_sum = 0.0;
    for (int64_t j = 0; j < count; j++)
        tile_sum += expf(z[j] - tile_max);
    if (tile_max > state->max) {
        state->sum_exp = state->sum_exp * exp(state->max - (double)tile_max) + tile_sum;
        state->max = tile_max;
        state->argmax = first_column + tile_argmax;
    } else {
        state->sum_exp += tile_sum * exp((double)tile_max - state->max);
    }
}

void fh_row_gradient(float *z, int64_t count, int64_t target_column, const float *weights, double lse,
                     double a, double b, double c, const fh_transform *tf)
{
    const float af = (float)a, cf = (float)c, scale = tf->inv_temperature, cap = tf->softcap;
    /* z = scale * cap * tanh(u / cap), so dz/du = scale * (1 - t^2) with t = z / (scale * cap). */
    const float inv_cap_scaled = cap > 0.0f ? 1.0f / (scale * cap) : 0.0f;
    const int has_target = target_column >= 0 && target_column < count;
    for (int64_t j = 0; j < count; j++) {
        const float zj = z[j];
        const float p = expf((float)((double)zj - lse));
        float dz = af * p + (weights ? cf * weights[j] : cf);
        if (has_target && j == target_column)
            dz += (float)b;
        float dzdu = scale;
        if (cap > 0.0f) {
            const float t = zj * inv_cap_scaled;
            dzdu = scale * (1.0f - t) * (1.0f + t);
        }
        z[j] = dz * dzdu;
    }
}
