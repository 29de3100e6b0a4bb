/* The portable row kernels: C at the library's base ISA (SSE2 on x86-64), fp32 values and double accumulators, libm's
 * expf, tanhf and log1pf. The reference the vector sets are tested against, and what runs on any CPU. */
#include "row_kernels_impl.h"

#include <math.h>
#include <string.h>

static void transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
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

static void fold(float *z, int64_t count, int64_t first_column, int64_t target_column, const fh_fold_request *request,
                 fh_fold_state *state)
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
    if (request->weighted_sum) {
        const float *w = request->weights;
        double s = 0.0;
        for (int64_t j = 0; j < count; j++)
            s += (double)(w ? w[j] * z[j] : z[j]);
        state->sum_weighted_z += s;
    }
    for (int64_t j = 0; j < count; j++)
        if (isnan(z[j])) {
            state->sum_exp = state->sum_z_exp = NAN;
            return;
        }
    if (tile_argmax < 0) { /* every logit is -inf: nothing to add */
        if (request->store_exps)
            memset(z, 0, (size_t)count * sizeof(float));
        return;
    }
    double tile_sum = 0.0, tile_sum_z = 0.0;
    for (int64_t j = 0; j < count; j++) {
        const float e = expf(z[j] - tile_max);
        tile_sum += e;
        if (request->entropy)
            tile_sum_z += (double)e * z[j];
        if (request->store_exps)
            z[j] = e;
    }
    fh_row_merge(state, tile_max, first_column + tile_argmax, tile_sum, tile_sum_z);
}

static void gradient(float *z, int64_t count, int64_t target_column, const float *weights, const fh_coef *coef,
                     const fh_transform *tf, fh_row_marking *marking)
{
    const float a = (float)coef->a, c = (float)coef->c, e = (float)coef->e, sum_pz = (float)coef->sum_pz;
    const int has_target = target_column >= 0 && target_column < count;
    const float b_term = has_target ? (float)coef->b * fh_dz_du(z[target_column], tf) : 0.0f;
    const float p_scale = (float)coef->p_scale;
    uint32_t least = 0;
    if (marking) {
        memcpy(&least, &marking->threshold, sizeof least);
        marking->tail = 0.0;
    }
    for (int64_t j = 0; j < count; j++) {
        const float p = coef->p_scale != 0.0 ? z[j] * p_scale : expf((float)((double)z[j] - coef->lse));
        const float w = weights ? weights[j] : 1.0f;
        const float dz = a * p + c * w + e * p * (z[j] - sum_pz);
        float du = dz * fh_dz_du(z[j], tf);
        if (j == target_column)
            du += b_term;
        z[j] = du;
        if (!marking)
            continue;
        /* On the bits, |dU| is an AND and the comparison an integer one (non-negative floats order as their bits do,
         * and a NaN's bits exceed infinity's). */
        uint32_t bits;
        memcpy(&bits, &du, sizeof bits);
        if ((bits & 0x7fffffffu) >= least)
            marking->marks[j] = 1;
        else if (marking->nu) {
            const float m = du - marking->c * w;
            marking->tail += m;
            marking->nu[j] += fabsf(m);
        }
    }
}

static void pair_max(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    float mz = -INFINITY, mc = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        mz = fmaxf(mz, z[j]);
        mc = fmaxf(mc, cz[j]);
    }
    *max_z = mz;
    *max_cz = mc;
}

static void exp_sums(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2])
{
    double sum = 0.0, cross = 0.0;
    for (int64_t j = 0; j < count; j++) {
        const float e = expf(scale * a[j] - shift);
        sum += e;
        if (b)
            cross += e * (scale * a[j] - scale * b[j]);
    }
    sums[0] += sum;
    sums[1] += cross;
}

/* softplus(x) = log(1 + e^x) and softplus(-x), without overflow. */
static void softplus_pair(float x, float *plus, float *minus)
{
    const float tail = log1pf(expf(-fabsf(x)));
    *plus = fmaxf(x, 0.0f) + tail;
    *minus = fmaxf(-x, 0.0f) + tail;
}

/* jsd's lp = log(m / p), lq = log(m / q) and sp = lp - log(1 - beta) at column j (fh_row_jsd_sums). */
static void jsd_logs(const float *z, const float *cz, int64_t j, const fh_pair_row *r, float *lp, float *lq, float *sp)
{
    const float delta = r->inv_t * (cz[j] - z[j]) - r->lse_t_minus_s;
    if (fabsf(delta) < 1.0f) {
        const float e = expm1f(delta);
        *lp = log1pf(r->beta * e);
        *lq = *lp - delta; /* log(m / q) = log(m / p) - delta, both O(delta): no cancellation of note */
        *sp = *lp - r->log_1m_beta;
    } else {
        float spn;
        softplus_pair(r->log_odds + delta, sp, &spn);
        *lp = r->log_1m_beta + *sp;
        *lq = r->log_beta + spn;
    }
}

static void jsd_sums(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[3])
{
    double sum_d = 0.0, sum_k = 0.0, sum_k_sp = 0.0;
    for (int64_t j = 0; j < count; j++) {
        const float p = expf(r->inv_t * z[j] - r->lse_s), q = expf(r->inv_t * cz[j] - r->lse_t);
        float lp, lq, sp;
        jsd_logs(z, cz, j, r, &lp, &lq, &sp);
        sum_d -= r->beta * q * lq + (1.0f - r->beta) * p * lp;
        sum_k += p * lp;
        sum_k_sp += p * sp;
    }
    sums[0] += sum_d;
    sums[1] += sum_k;
    sums[2] += sum_k_sp;
}

static void pair_gradient(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    const float g_soft = r->g_soft * r->inv_t;
    for (int64_t j = 0; j < count; j++) {
        const float ls = r->inv_t * z[j] - r->lse_s, lt = r->inv_t * cz[j] - r->lse_t, p = expf(ls);
        float soft;
        switch (r->divergence) {
        case FH_PAIR_FORWARD_KL: soft = p - expf(lt); break;
        case FH_PAIR_REVERSE_KL: soft = p * (ls - lt - r->d); break;
        default: {
            float lp, lq, sp;
            jsd_logs(z, cz, j, r, &lp, &lq, &sp);
            soft = (1.0f - r->beta) * p * (r->k - (r->k_of_softplus ? sp : lp));
            break;
        }
        }
        const float hard = r->g_hard != 0.0f ? r->g_hard * expf(z[j] - r->lse_u) : 0.0f;
        z[j] = g_soft * soft + hard;
    }
}

static void softmax_pair(float *z, int64_t count, const fh_softmax_pair *r)
{
    for (int64_t j = 0; j < count; j++) {
        const float u = z[j], scaled = r->scale * u;
        const float second = r->b != 0.0f ? r->b * expf(u - r->shift_b) : 0.0f;
        z[j] = r->a * expf(scaled - r->shift_a) + second;
    }
}

/* Chunks go through local arrays and memcpy, so that narrowing in place is defined: chunk c is written over bytes
 * that chunks up to c / 2 were read from. The compiler's vectorisation of this loop (SSE2 at the library's base ISA)
 * left it at 12% of a filtered bf16 train step on the trained head's batch; the AVX-512 version takes 3.5%. */
static void to_bf16(const void *src, int64_t count, void *dst)
{
    enum { CHUNK = 64 };
    for (int64_t j0 = 0; j0 < count; j0 += CHUNK) {
        const int64_t m = count - j0 < CHUNK ? count - j0 : CHUNK;
        uint32_t bits[CHUNK];
        uint16_t out[CHUNK];
        memcpy(bits, (const char *)src + j0 * (int64_t)sizeof(float), (size_t)m * sizeof(float));
        for (int64_t j = 0; j < m; j++) {
            const int is_nan = (bits[j] & 0x7fffffffu) > 0x7f800000u;
            const uint32_t rounded = (bits[j] + 0x7fffu + ((bits[j] >> 16) & 1u)) >> 16;
            out[j] = (uint16_t)(is_nan ? (bits[j] >> 16) | 0x40u : rounded);
        }
        memcpy((char *)dst + j0 * (int64_t)sizeof(uint16_t), out, (size_t)m * sizeof(uint16_t));
    }
}

static double compact(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                      const float *weights, const float *next)
{
    (void)next; /* left to the hardware */
    double sum = 0.0;
    for (int64_t k = 0; k < count; k++) {
        const int64_t j = columns[k];
        const float v = z[j];
        if (fabsf(v) < threshold)
            sum += v - c * (weights ? weights[j] : 1.0f);
        if (move)
            z[k] = v;
    }
    return sum;
}

static void add_columns(double *sums, int64_t count, const void *w, int bf16, int64_t stride, const double *factors,
                        int64_t columns)
{
    for (int64_t j = 0; j < columns; j++)
        for (int64_t k = 0; factors[j] != 0.0 && k < count; k++) {
            const int64_t at = j * stride + k;
            sums[k] += factors[j] * (bf16 ? fh_bf16_to_f32(((const uint16_t *)w)[at]) : ((const float *)w)[at]);
        }
}

FH_ROW_KERNEL_TABLE(fh_row_kernels_portable, "portable");
