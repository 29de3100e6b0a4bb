/* Portable row kernels (fp32 values, double accumulators), the helpers shared with the AVX-512 ones, and
 * the run-time choice between them: AVX-512 when the CPU has it, unless FH_DISABLE_AVX512 is set in the
 * environment (tests use it to cover both). */
#include "row_kernels_impl.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

fh_fold_state fh_fold_state_initial(void)
{
    const fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
    return st;
}

void fh_row_merge(fh_fold_state *state, float tile_max, int64_t tile_argmax, double tile_sum, double tile_sum_z)
{
    if (tile_max > state->max) {
        const double rescale = exp(state->max - (double)tile_max);
        state->sum_exp = state->sum_exp * rescale + tile_sum;
        state->sum_z_exp = state->sum_z_exp * rescale + tile_sum_z;
        state->max = tile_max;
        state->argmax = tile_argmax;
    } else {
        const double rescale = exp((double)tile_max - state->max);
        state->sum_exp += tile_sum * rescale;
        state->sum_z_exp += tile_sum_z * rescale;
    }
}

float fh_dz_du(float z, const fh_transform *tf)
{
    if (!(tf->softcap > 0.0f))
        return tf->inv_temperature;
    /* z = scale * cap * tanh(u / cap), so dz/du = scale * (1 - t^2) with t = z / (scale * cap). */
    const float t = z / (tf->inv_temperature * tf->softcap);
    return tf->inv_temperature * (1.0f - t) * (1.0f + t);
}

void fh_row_transform_portable(float *z, int64_t count, const float *bias, const fh_transform *tf)
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

void fh_row_fold_portable(float *z, int64_t count, int64_t first_column, int64_t target_column,
                          const fh_fold_request *request, fh_fold_state *state)
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

void fh_row_gradient_portable(float *z, int64_t count, int64_t target_column, const float *weights,
                              const fh_coef *coef, const fh_transform *tf, fh_row_marking *marking)
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

void fh_row_pair_max_portable(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    float mz = -INFINITY, mc = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        mz = fmaxf(mz, z[j]);
        mc = fmaxf(mc, cz[j]);
    }
    *max_z = mz;
    *max_cz = mc;
}

void fh_row_exp_sums_portable(const float *a, const float *b, int64_t count, float scale, float shift,
                              double sums[2])
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

void fh_row_jsd_sums_portable(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[2])
{
    double sum_d = 0.0, sum_k = 0.0;
    for (int64_t j = 0; j < count; j++) {
        const float ls = r->inv_t * z[j] - r->lse_s, lt = r->inv_t * cz[j] - r->lse_t;
        const float p = expf(ls), q = expf(lt);
        float sp, spn;
        softplus_pair(r->log_odds + lt - ls, &sp, &spn);
        sum_d -= r->beta * q * spn + (1.0f - r->beta) * p * sp;
        sum_k += p * sp;
    }
    sums[0] += sum_d;
    sums[1] += sum_k;
}

void fh_row_pair_gradient_portable(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    const float g_soft = r->g_soft * r->inv_t;
    for (int64_t j = 0; j < count; j++) {
        const float ls = r->inv_t * z[j] - r->lse_s, lt = r->inv_t * cz[j] - r->lse_t, p = expf(ls);
        float soft;
        switch (r->divergence) {
        case FH_PAIR_FORWARD_KL: soft = p - expf(lt); break;
        case FH_PAIR_REVERSE_KL: soft = p * (ls - lt - r->d); break;
        default: {
            float sp, spn;
            softplus_pair(r->log_odds + lt - ls, &sp, &spn);
            soft = (1.0f - r->beta) * p * (r->k - sp);
            break;
        }
        }
        const float hard = r->g_hard != 0.0f ? r->g_hard * expf(z[j] - r->lse_u) : 0.0f;
        z[j] = g_soft * soft + hard;
    }
}

typedef struct kernel_set {
    void (*transform)(float *, int64_t, const float *, const fh_transform *);
    void (*fold)(float *, int64_t, int64_t, int64_t, const fh_fold_request *, fh_fold_state *);
    void (*gradient)(float *, int64_t, int64_t, const float *, const fh_coef *, const fh_transform *,
                     fh_row_marking *);
    void (*pair_max)(const float *, const float *, int64_t, float *, float *);
    void (*exp_sums)(const float *, const float *, int64_t, float, float, double[2]);
    void (*jsd_sums)(const float *, const float *, int64_t, const fh_pair_row *, double[2]);
    void (*pair_gradient)(float *, const float *, int64_t, const fh_pair_row *);
    void (*to_bf16)(const void *, int64_t, void *);
    double (*compact)(float *, const int64_t *, int64_t, int, float, float, const float *, const float *);
    void (*add_columns)(double *, int64_t, const void *, int, int64_t, const double *, int64_t);
} kernel_set;

static kernel_set kernels = {fh_row_transform_portable, fh_row_fold_portable,     fh_row_gradient_portable,
                             fh_row_pair_max_portable,  fh_row_exp_sums_portable, fh_row_jsd_sums_portable,
                             fh_row_pair_gradient_portable, fh_row_to_bf16_portable, fh_row_compact_portable,
                             fh_row_add_columns_portable};
static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;

static void choose_kernels(void)
{
#ifdef FH_HAVE_AVX512_KERNELS
    __builtin_cpu_init();
    if (!getenv("FH_DISABLE_AVX512") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        const kernel_set avx512 = {fh_row_transform_avx512, fh_row_fold_avx512,     fh_row_gradient_avx512,
                                   fh_row_pair_max_avx512,  fh_row_exp_sums_avx512, fh_row_jsd_sums_avx512,
                                   fh_row_pair_gradient_avx512, fh_row_to_bf16_avx512, fh_row_compact_avx512,
                                   fh_row_add_columns_avx512};
        kernels = avx512;
    }
#endif
}

/* The chosen set; pthread_once makes the first choice visible to every thread (one atomic load after). */
static const kernel_set *chosen(void)
{
    pthread_once(&kernels_once, choose_kernels);
    return &kernels;
}

const char *fh_row_kernels_name(void)
{
    return chosen()->fold == fh_row_fold_portable ? "portable" : "avx512";
}

void fh_row_transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
{
    chosen()->transform(z, count, bias, tf);
}

void fh_row_fold(float *z, int64_t count, int64_t first_column, int64_t target_column,
                 const fh_fold_request *request, fh_fold_state *state)
{
    chosen()->fold(z, count, first_column, target_column, request, state);
}

void fh_row_gradient(float *z, int64_t count, int64_t target_column, const float *weights, const fh_coef *coef,
                     const fh_transform *tf, fh_row_marking *marking)
{
    chosen()->gradient(z, count, target_column, weights, coef, tf, marking);
}

void fh_row_pair_max(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    chosen()->pair_max(z, cz, count, max_z, max_cz);
}

void fh_row_exp_sums(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2])
{
    chosen()->exp_sums(a, b, count, scale, shift, sums);
}

void fh_row_jsd_sums(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[2])
{
    chosen()->jsd_sums(z, cz, count, r, sums);
}

void fh_row_pair_gradient(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    chosen()->pair_gradient(z, cz, count, r);
}

/* Chunks go through local arrays and memcpy, so that narrowing in place is defined: chunk c is written over bytes
 * that chunks up to c / 2 were read from. The compiler's vectorisation of this loop (SSE2 at the library's base ISA)
 * left it at 12% of a filtered bf16 train step on the trained head's batch; the AVX-512 version takes 3.5%. */
void fh_row_to_bf16_portable(const void *src, int64_t count, void *dst)
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

void fh_row_add_to_bf16(const float *src, int64_t count, int accumulate, uint16_t *dst)
{
    enum { CHUNK = 256 };
    float sums[CHUNK];
    for (int64_t j0 = 0; j0 < count; j0 += CHUNK) {
        const int64_t m = count - j0 < CHUNK ? count - j0 : CHUNK;
        for (int64_t j = 0; j < m; j++)
            sums[j] = src[j0 + j] + (accumulate ? fh_bf16_to_f32(dst[j0 + j]) : 0.0f);
        fh_row_to_bf16(sums, m, dst + j0);
    }
}

void fh_row_to_bf16(const void *src, int64_t count, void *dst)
{
    chosen()->to_bf16(src, count, dst);
}

double fh_row_compact_portable(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
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

double fh_row_compact(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                      const float *weights, const float *next)
{
    return chosen()->compact(z, columns, count, move, threshold, c, weights, next);
}

void fh_row_add_columns_portable(double *sums, int64_t count, const void *w, int bf16, int64_t stride,
                                 const double *factors, int64_t columns)
{
    for (int64_t j = 0; j < columns; j++)
        for (int64_t k = 0; factors[j] != 0.0 && k < count; k++) {
            const int64_t at = j * stride + k;
            sums[k] += factors[j] * (bf16 ? fh_bf16_to_f32(((const uint16_t *)w)[at]) : ((const float *)w)[at]);
        }
}

void fh_row_add_columns(double *sums, int64_t count, const void *w, int bf16, int64_t stride, const double *factors,
                        int64_t columns)
{
    chosen()->add_columns(sums, count, w, bf16, stride, factors, columns);
}
