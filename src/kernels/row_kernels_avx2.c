/* The AVX2 + FMA row kernels (same contracts as row_kernels.h, same algorithms as the AVX-512 set, 8 lanes wide):
 * the table fh_row_kernels_avx2, for CPUs with AVX2 but without AVX-512 (AMD Zen 1-3, Intel client cores). An inline
 * vector exp that returns the AVX-512 set's exp16 bit for bit, and SLEEF's 1-ulp tanh and log1p. Built with -mavx2
 * -mfma only (no AVX-512 instruction: tails go through maskload/maskstore) and only run when the CPU has both.
 *
 * Each kernel's work on 8 columns is a block function, forced inline and called with remaining = LANES in the main
 * loop (where every tail test folds away) and once with the tail's length. */
#include "row_kernels_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <sleef.h>

#define LANES 8
#define BLOCK static inline __attribute__((always_inline))

/* The lanes below remaining (every lane from LANES on), as a maskload/maskstore mask. */
BLOCK __m256i lanes_below(int64_t remaining)
{
    const int n = remaining >= LANES ? LANES : remaining <= 0 ? 0 : (int)remaining;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The bits of movemask for the lanes below remaining. */
BLOCK int lane_bits(int64_t remaining)
{
    return remaining >= LANES ? 0xff : (1 << remaining) - 1;
}

/* 8 floats at p, or the first `remaining` of them and zeros after (nothing read past them). */
BLOCK __m256 load(const float *p, int64_t remaining)
{
    if (remaining >= LANES)
        return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, lanes_below(remaining));
}

/* As load, with `fill` after the first `remaining`. */
BLOCK __m256 load_or(const float *p, int64_t remaining, __m256 fill)
{
    if (remaining >= LANES)
        return _mm256_loadu_ps(p);
    const __m256i m = lanes_below(remaining);
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}

/* The first `remaining` lanes of v to p (nothing written past them). */
BLOCK void store(float *p, __m256 v, int64_t remaining)
{
    if (remaining >= LANES)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, lanes_below(remaining), v);
}

/* v with the lanes from remaining on zeroed. */
BLOCK __m256 keep(__m256 v, int64_t remaining)
{
    if (remaining >= LANES)
        return v;
    return _mm256_and_ps(v, _mm256_castsi256_ps(lanes_below(remaining)));
}

/* exp of 8 floats to within 1 ulp, inline (SLEEF's is a call, across which the callers' accumulators are spilled):
 * row_kernels_avx512.c's exp16 step by step, so the two agree bit for bit. x = n ln2 + r, |r| <= ln2 / 2 (r exact: one
 * fma with the high part of ln2, which has 9 trailing zero bits, then the low part); e^r by its degree-7 Taylor
 * polynomial (truncation 3e-9, below half an ulp). AVX2 has no scalef: 2^n is applied as 2^h 2^(n - h), h = floor(n /
 * 2), both normal floats built from their exponent bits for every n the clamps allow (-159..128); p 2^h is exact
 * (p is within [0.7, 1.5]), so the second product rounds p 2^n once, into the subnormals or to inf as scalef does.
 * The clamps keep n finite (x = -inf gives 0) and, with the NaN as their second operand, let a NaN through (its n is
 * garbage, its product NaN). */
BLOCK __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-110.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

/* The 8 floats' first and last 4 as doubles. */
BLOCK __m256d low_half(__m256 v)
{
    return _mm256_cvtps_pd(_mm256_castps256_ps128(v));
}

BLOCK __m256d high_half(__m256 v)
{
    return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
}

BLOCK void accumulate_double(__m256 v, __m256d *lo, __m256d *hi)
{
    *lo = _mm256_add_pd(*lo, low_half(v));
    *hi = _mm256_add_pd(*hi, high_half(v));
}

/* Sum of the 8 doubles. */
static double sum_as_double(__m256d lo, __m256d hi)
{
    const __m256d s = _mm256_add_pd(lo, hi);
    const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}

/* The largest of the 8 floats (no lane is a NaN). */
static float max_lane(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

BLOCK void transform_block(float *z, const float *bias, int64_t remaining, int capped, int scaled, __m256 cap,
                           __m256 inv_cap, __m256 scale)
{
    __m256 v = load(z, remaining);
    if (bias)
        v = _mm256_add_ps(v, load(bias, remaining));
    if (capped)
        v = _mm256_mul_ps(cap, Sleef_tanhf8_u10avx2(_mm256_mul_ps(v, inv_cap)));
    if (scaled)
        v = _mm256_mul_ps(v, scale);
    store(z, v, remaining);
}

static void transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
{
    const int capped = tf->softcap > 0.0f, scaled = tf->inv_temperature != 1.0f;
    const __m256 cap = _mm256_set1_ps(tf->softcap), inv_cap = _mm256_set1_ps(capped ? 1.0f / tf->softcap : 0.0f);
    const __m256 scale = _mm256_set1_ps(tf->inv_temperature);
    if (!bias && !capped && !scaled)
        return;
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        transform_block(z + j, bias ? bias + j : NULL, LANES, capped, scaled, cap, inv_cap, scale);
    if (j < count)
        transform_block(z + j, bias ? bias + j : NULL, count - j, capped, scaled, cap, inv_cap, scale);
}

/* The first j with z[j] == value, or -1. */
static int64_t first_equal(const float *z, int64_t count, float value)
{
    const __m256 v = _mm256_set1_ps(value);
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + j), v, _CMP_EQ_OQ));
        if (eq)
            return j + __builtin_ctz((unsigned)eq);
    }
    for (; j < count; j++)
        if (z[j] == value)
            return j;
    return -1;
}

BLOCK void weighted_block(const float *z, const float *weights, int64_t remaining, __m256d *lo, __m256d *hi)
{
    __m256 v = load(z, remaining);
    if (weights)
        v = _mm256_mul_ps(v, load(weights, remaining)); /* exact: product of two floats */
    accumulate_double(v, lo, hi);
}

/* exp(z - shift) for 8 columns into the sums (tail lanes: e = 0, and z = 0 for the entropy's product), stored over z
 * with store_exps. */
BLOCK void exp_block(float *z, int64_t remaining, __m256 shift, int entropy, int store_exps, __m256d *lo, __m256d *hi,
                     __m256d *zlo, __m256d *zhi)
{
    const __m256 v = load(z, remaining);
    const __m256 e = keep(exp8(_mm256_sub_ps(v, shift)), remaining);
    accumulate_double(e, lo, hi);
    if (entropy)
        accumulate_double(_mm256_mul_ps(e, v), zlo, zhi);
    if (store_exps)
        store(z, e, remaining);
}

static void fold(float *z, int64_t count, int64_t first_column, int64_t target_column, const fh_fold_request *request,
                 fh_fold_state *state)
{
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    /* The maximum in two chains, NaNs aside (max_ps returns its second operand, the running maximum, for a NaN),
     * and whether any value is a NaN (unordered compares of both loads at once); the argmax after, by a scan for the
     * maximum's first occurrence. */
    __m256 max0 = neg_inf, max1 = neg_inf, unordered = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 2 * LANES <= count; j += 2 * LANES) {
        const __m256 v0 = _mm256_loadu_ps(z + j), v1 = _mm256_loadu_ps(z + j + LANES);
        max0 = _mm256_max_ps(v0, max0);
        max1 = _mm256_max_ps(v1, max1);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    }
    for (; j < count; j += LANES) {
        const __m256 v = load_or(z + j, count - j, neg_inf);
        max0 = _mm256_max_ps(v, max0);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const float tile_max = max_lane(_mm256_max_ps(max0, max1));
    const int any_nan = _mm256_movemask_ps(unordered);

    if (target_column >= 0 && target_column < count)
        state->z_target = z[target_column];
    if (request->weighted_sum) {
        const float *weights = request->weights;
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (j = 0; j + LANES <= count; j += LANES)
            weighted_block(z + j, weights ? weights + j : NULL, LANES, &lo, &hi);
        if (j < count)
            weighted_block(z + j, weights ? weights + j : NULL, count - j, &lo, &hi);
        state->sum_weighted_z += sum_as_double(lo, hi);
    }
    if (any_nan) {
        state->sum_exp = state->sum_z_exp = NAN;
        return;
    }
    if (tile_max == -INFINITY) { /* every logit is -inf (or none): nothing to add */
        if (request->store_exps)
            memset(z, 0, (size_t)count * sizeof(float));
        return;
    }
    const int64_t tile_argmax = first_equal(z, count, tile_max);
    const __m256 shift = _mm256_set1_ps(tile_max);
    const int entropy = request->entropy, store_exps = request->store_exps;
    const float *next = request->next;
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    __m256d zlo = _mm256_setzero_pd(), zhi = _mm256_setzero_pd();
    for (j = 0; j + 2 * LANES <= count; j += 2 * LANES) {
        if (next) /* one cache line of it per 16 exps, so that it comes from L3 or memory in their shadow */
            _mm_prefetch((const char *)(next + j), _MM_HINT_T1);
        exp_block(z + j, LANES, shift, entropy, store_exps, &lo, &hi, &zlo, &zhi);
        exp_block(z + j + LANES, LANES, shift, entropy, store_exps, &lo, &hi, &zlo, &zhi);
    }
    for (; j < count; j += LANES) {
        if (next)
            _mm_prefetch((const char *)(next + j), _MM_HINT_T1);
        exp_block(z + j, count - j, shift, entropy, store_exps, &lo, &hi, &zlo, &zhi);
    }
    fh_row_merge(state, tile_max, first_column + tile_argmax, sum_as_double(lo, hi), sum_as_double(zlo, zhi));
}

/* fh_row_marking's work on the dU of 8 columns from j (the first `remaining`; class weights w): on the bits, |dU| is
 * an AND and the comparison an integer one (non-negative floats order as their bits do, and a NaN's bits exceed
 * infinity's); least_below is the threshold's bits less one (signed compares suffice: |dU|'s bits are below 2^31). */
BLOCK void mark_block(fh_row_marking *mk, __m256 du, __m256 w, int64_t j, int64_t remaining, __m256i least_below,
                      __m256d *lo, __m256d *hi)
{
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(du), _mm256_set1_epi32(0x7fffffff));
    const __m256i at_least = _mm256_cmpgt_epi32(bits, least_below);
    const int valid = lane_bits(remaining), marked = _mm256_movemask_ps(_mm256_castsi256_ps(at_least)) & valid;
    if (marked) {
        /* The lanes' 0 / -1 narrowed to bytes and masked to 0 / 1, ORed into the marks (8 bytes, or the tail's). */
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(at_least), _mm256_extracti128_si256(at_least, 1));
        const __m128i bytes = _mm_and_si128(_mm_packs_epi16(words, words), _mm_set1_epi8(1));
        uint64_t set = (uint64_t)_mm_cvtsi128_si64(bytes), old = 0;
        const size_t n = (size_t)(remaining >= LANES ? LANES : remaining);
        memcpy(&old, mk->marks + j, n);
        set |= old;
        memcpy(mk->marks + j, &set, n);
    }
    if (marked == valid || !mk->nu)
        return;
    /* The other lanes: d = dU - c w, 0 in marked and tail lanes (nu += 0 leaves them as they are). */
    const __m256 below = _mm256_andnot_ps(_mm256_castsi256_ps(at_least), _mm256_castsi256_ps(lanes_below(remaining)));
    const __m256 d = _mm256_and_ps(below, _mm256_sub_ps(du, _mm256_mul_ps(_mm256_set1_ps(mk->c), w)));
    accumulate_double(d, lo, hi);
    float *nu = mk->nu + j;
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), d);
    store(nu, _mm256_add_ps(load(nu, remaining), magnitude), remaining);
}

/* What the gradient's 8-column blocks share. */
typedef struct gradient_constants {
    __m256 lse_hi, lse_lo, a, c, e, sum_pz, p_scale, scale, inv_cap_scaled, b_term;
    __m256i least_below;
    int from_exps, entropy_term, capped;
} gradient_constants;

BLOCK void gradient_block(float *z, const float *weights, int64_t j, int64_t remaining, int64_t target_column,
                          const gradient_constants *k, fh_row_marking *marking, __m256d *lo, __m256d *hi)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 v = load(z + j, remaining);
    const __m256 p = k->from_exps ? _mm256_mul_ps(v, k->p_scale)
                                  : exp8(_mm256_sub_ps(_mm256_sub_ps(v, k->lse_hi), k->lse_lo));
    const __m256 w = weights ? load(weights + j, remaining) : one;
    __m256 dz = _mm256_fmadd_ps(k->a, p, _mm256_mul_ps(k->c, w));
    if (k->entropy_term)
        dz = _mm256_fmadd_ps(_mm256_mul_ps(k->e, p), _mm256_sub_ps(v, k->sum_pz), dz);
    __m256 dzdu = k->scale;
    if (k->capped) {
        const __m256 t = _mm256_mul_ps(v, k->inv_cap_scaled);
        dzdu = _mm256_mul_ps(k->scale, _mm256_mul_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t)));
    }
    __m256 du = _mm256_mul_ps(dz, dzdu);
    if (target_column >= j && target_column < j + LANES) {
        const __m256i at = _mm256_cmpeq_epi32(_mm256_set1_epi32((int)(target_column - j)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        du = _mm256_blendv_ps(du, _mm256_add_ps(du, k->b_term), _mm256_castsi256_ps(at));
    }
    store(z + j, du, remaining);
    if (marking)
        mark_block(marking, du, w, j, remaining, k->least_below, lo, hi);
}

static void gradient(float *z, int64_t count, int64_t target_column, const float *weights, const fh_coef *coef,
                     const fh_transform *tf, fh_row_marking *marking)
{
    /* lse = hi + lo in floats: (z - hi) is exact near the maximum, so p keeps double-like accuracy. */
    const float lse_hi = (float)coef->lse, lse_lo = (float)(coef->lse - (double)lse_hi);
    const float scale = tf->inv_temperature, cap = tf->softcap;
    const int has_target = target_column >= 0 && target_column < count;
    uint32_t least = 0;
    if (marking)
        memcpy(&least, &marking->threshold, sizeof least);
    gradient_constants k;
    k.lse_hi = _mm256_set1_ps(lse_hi);
    k.lse_lo = _mm256_set1_ps(lse_lo);
    k.a = _mm256_set1_ps((float)coef->a);
    k.c = _mm256_set1_ps((float)coef->c);
    k.e = _mm256_set1_ps((float)coef->e);
    k.sum_pz = _mm256_set1_ps((float)coef->sum_pz);
    k.p_scale = _mm256_set1_ps((float)coef->p_scale);
    k.scale = _mm256_set1_ps(scale);
    k.capped = cap > 0.0f;
    k.inv_cap_scaled = _mm256_set1_ps(k.capped ? 1.0f / (scale * cap) : 0.0f);
    k.b_term = _mm256_set1_ps(has_target ? (float)coef->b * fh_dz_du(z[target_column], tf) : 0.0f);
    /* A threshold with the sign bit (-0 and below) marks nothing, as the unsigned comparison of the others would. */
    k.least_below = _mm256_set1_epi32(least > 0x7fffffffu ? 0x7fffffff : (int)least - 1);
    k.from_exps = coef->p_scale != 0.0;
    k.entropy_term = coef->e != 0.0;
    const int64_t target = has_target ? target_column : -LANES;
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        gradient_block(z, weights, j, LANES, target, &k, marking, &lo, &hi);
    if (j < count)
        gradient_block(z, weights, j, count - j, target, &k, marking, &lo, &hi);
    if (marking)
        marking->tail = sum_as_double(lo, hi);
}

static void pair_max(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 mz = neg_inf, mc = neg_inf;
    for (int64_t j = 0; j < count; j += LANES) {
        /* max_ps returns its second operand when either is NaN: the running maximum, so NaNs are skipped. */
        mz = _mm256_max_ps(load_or(z + j, count - j, neg_inf), mz);
        mc = _mm256_max_ps(load_or(cz + j, count - j, neg_inf), mc);
    }
    *max_z = max_lane(mz);
    *max_cz = max_lane(mc);
}

BLOCK void exp_sums_block(const float *a, const float *b, int64_t remaining, __m256 scale, __m256 shift, __m256d *lo,
                          __m256d *hi, __m256d *clo, __m256d *chi)
{
    const __m256 sa = _mm256_mul_ps(scale, load(a, remaining));
    const __m256 e = keep(exp8(_mm256_sub_ps(sa, shift)), remaining);
    accumulate_double(e, lo, hi);
    if (b) {
        const __m256 sb = _mm256_mul_ps(scale, load(b, remaining));
        accumulate_double(_mm256_mul_ps(e, _mm256_sub_ps(sa, sb)), clo, chi);
    }
}

static void exp_sums(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2])
{
    const __m256 vscale = _mm256_set1_ps(scale), vshift = _mm256_set1_ps(shift);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd(), clo = _mm256_setzero_pd(), chi = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        exp_sums_block(a + j, b ? b + j : NULL, LANES, vscale, vshift, &lo, &hi, &clo, &chi);
    if (j < count)
        exp_sums_block(a + j, b ? b + j : NULL, count - j, vscale, vshift, &lo, &hi, &clo, &chi);
    sums[0] += sum_as_double(lo, hi);
    sums[1] += sum_as_double(clo, chi);
}

/* softplus(x) = log(1 + e^x) (plus) and softplus(-x) (minus), without overflow. */
BLOCK void softplus_pair(__m256 x, __m256 *plus, __m256 *minus)
{
    const __m256 zero = _mm256_setzero_ps();
    const __m256 minus_abs = _mm256_min_ps(x, _mm256_sub_ps(zero, x));
    const __m256 tail = Sleef_log1pf8_u10avx2(exp8(minus_abs));
    *plus = _mm256_add_ps(_mm256_max_ps(x, zero), tail);
    *minus = _mm256_add_ps(_mm256_max_ps(_mm256_sub_ps(zero, x), zero), tail);
}

/* Columns j..'s log p and log q: inv_t z - lse_s and inv_t cz - lse_t (tail lanes 0), inv_t z rounded before the
 * subtraction as the lse's own sums round it (fh_row_exp_sums): a fused multiply-subtract would leave log p of the
 * largest entry up to half an ulp of inv_t z above 0 (p = e^32 at inv_t z ~ 1e9). */
BLOCK void log_probs(const fh_pair_row *r, const float *z, const float *cz, int64_t remaining, __m256 *ls, __m256 *lt)
{
    const __m256 it = _mm256_set1_ps(r->inv_t);
    *ls = keep(_mm256_sub_ps(_mm256_mul_ps(it, load(z, remaining)), _mm256_set1_ps(r->lse_s)), remaining);
    *lt = keep(_mm256_sub_ps(_mm256_mul_ps(it, load(cz, remaining)), _mm256_set1_ps(r->lse_t)), remaining);
}

/* jsd's lp, lq and sp of 8 columns (fh_row_jsd_sums): each of the two forms only where a lane needs it. */
BLOCK void jsd_logs(const fh_pair_row *r, const float *z, const float *cz, int64_t remaining, __m256 *lp, __m256 *lq,
                    __m256 *sp)
{
    const __m256 diff = _mm256_sub_ps(load(cz, remaining), load(z, remaining));
    const __m256 delta = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(r->inv_t), diff), _mm256_set1_ps(r->lse_t_minus_s));
    const __m256 log_1m_beta = _mm256_set1_ps(r->log_1m_beta);
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), delta);
    const __m256 near = _mm256_cmp_ps(magnitude, _mm256_set1_ps(1.0f), _CMP_LT_OQ);
    const int near_bits = _mm256_movemask_ps(near);
    *lp = *lq = *sp = _mm256_setzero_ps();
    if (near_bits) {
        const __m256 e = Sleef_expm1f8_u10avx2(delta);
        *lp = Sleef_log1pf8_u10avx2(_mm256_mul_ps(_mm256_set1_ps(r->beta), e));
        *lq = _mm256_sub_ps(*lp, delta);
        *sp = _mm256_sub_ps(*lp, log_1m_beta);
    }
    if (near_bits != 0xff) {
        __m256 far_sp, far_spn;
        softplus_pair(_mm256_add_ps(_mm256_set1_ps(r->log_odds), delta), &far_sp, &far_spn);
        *lp = _mm256_blendv_ps(_mm256_add_ps(log_1m_beta, far_sp), *lp, near);
        *lq = _mm256_blendv_ps(_mm256_add_ps(_mm256_set1_ps(r->log_beta), far_spn), *lq, near);
        *sp = _mm256_blendv_ps(far_sp, *sp, near);
    }
}

BLOCK void jsd_block(const float *z, const float *cz, int64_t remaining, const fh_pair_row *r, __m256d acc[6])
{
    const __m256 beta = _mm256_set1_ps(r->beta), one_m_beta = _mm256_set1_ps(1.0f - r->beta);
    __m256 ls, lt, lp, lq, sp;
    log_probs(r, z, cz, remaining, &ls, &lt);
    const __m256 p = keep(exp8(ls), remaining), q = keep(exp8(lt), remaining);
    jsd_logs(r, z, cz, remaining, &lp, &lq, &sp);
    const __m256 kp = _mm256_mul_ps(p, lp);
    const __m256 d = _mm256_fmadd_ps(_mm256_mul_ps(beta, q), lq, _mm256_mul_ps(one_m_beta, kp));
    accumulate_double(_mm256_sub_ps(_mm256_setzero_ps(), d), &acc[0], &acc[1]);
    accumulate_double(kp, &acc[2], &acc[3]);
    accumulate_double(_mm256_mul_ps(p, sp), &acc[4], &acc[5]);
}

static void jsd_sums(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[3])
{
    __m256d acc[6];
    for (int a = 0; a < 6; a++)
        acc[a] = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        jsd_block(z + j, cz + j, LANES, r, acc);
    if (j < count)
        jsd_block(z + j, cz + j, count - j, r, acc);
    for (int a = 0; a < 3; a++)
        sums[a] += sum_as_double(acc[2 * a], acc[2 * a + 1]);
}

BLOCK void pair_gradient_block(float *z, const float *cz, int64_t remaining, const fh_pair_row *r)
{
    const __m256 g_soft = _mm256_set1_ps(r->g_soft * r->inv_t);
    __m256 ls, lt, soft;
    log_probs(r, z, cz, remaining, &ls, &lt);
    const __m256 p = exp8(ls);
    switch (r->divergence) {
    case FH_PAIR_FORWARD_KL: soft = _mm256_sub_ps(p, exp8(lt)); break;
    case FH_PAIR_REVERSE_KL:
        soft = _mm256_mul_ps(p, _mm256_sub_ps(_mm256_sub_ps(ls, lt), _mm256_set1_ps(r->d)));
        break;
    default: {
        __m256 lp, lq, sp;
        jsd_logs(r, z, cz, remaining, &lp, &lq, &sp);
        const __m256 x = r->k_of_softplus ? sp : lp;
        soft = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(1.0f - r->beta), p), _mm256_sub_ps(_mm256_set1_ps(r->k), x));
        break;
    }
    }
    __m256 du = _mm256_mul_ps(g_soft, soft);
    if (r->g_hard != 0.0f) {
        const __m256 u = load(z, remaining);
        du = _mm256_fmadd_ps(_mm256_set1_ps(r->g_hard), exp8(_mm256_sub_ps(u, _mm256_set1_ps(r->lse_u))), du);
    }
    store(z, du, remaining);
}

static void pair_gradient(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        pair_gradient_block(z + j, cz + j, LANES, r);
    if (j < count)
        pair_gradient_block(z + j, cz + j, count - j, r);
}

BLOCK void softmax_pair_block(float *z, int64_t remaining, const fh_softmax_pair *r)
{
    const __m256 u = load(z, remaining);
    const __m256 second = r->b != 0.0f ? _mm256_mul_ps(_mm256_set1_ps(r->b),
                                                       exp8(_mm256_sub_ps(u, _mm256_set1_ps(r->shift_b))))
                                       : _mm256_setzero_ps();
    const __m256 scaled = _mm256_mul_ps(_mm256_set1_ps(r->scale), u);
    store(z,
          _mm256_fmadd_ps(_mm256_set1_ps(r->a), exp8(_mm256_sub_ps(scaled, _mm256_set1_ps(r->shift_a))), second),
          remaining);
}

static void softmax_pair(float *z, int64_t count, const fh_softmax_pair *r)
{
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        softmax_pair_block(z + j, LANES, r);
    if (j < count)
        softmax_pair_block(z + j, count - j, r);
}

/* The portable rounding (ties to even, NaN kept quiet), 8 at a time on the bits: each step reads 32 bytes at 4 j and
 * writes 16 at 2 j, so that a row narrowed in place never overwrites what it has yet to read. */
static void to_bf16(const void *src, int64_t count, void *dst)
{
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), infinity = _mm256_set1_epi32(0x7f800000);
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(const void *)((const char *)src + 4 * j));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
        const __m256i high = _mm256_srli_epi32(bits, 16);
        const __m256i rounded =
            _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, _mm256_and_si256(high, one))), 16);
        const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
        /* Every lane is below 2^16, so the signed-to-unsigned saturation of packus keeps it. */
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
        _mm_storeu_si128((__m128i *)(void *)((char *)dst + 2 * j), packed);
    }
    if (j < count)
        fh_row_kernels_portable.to_bf16((const char *)src + 4 * j, count - j, (char *)dst + 2 * j);
}

/* 8 floats of base at columns[0..8) (the first `remaining` of them, zeros after): two gathers of 4 by 64-bit index. */
BLOCK __m256 gather_columns(const float *base, const int64_t *columns, int64_t remaining)
{
    if (remaining >= LANES) {
        const __m128 a = _mm256_i64gather_ps(base, _mm256_loadu_si256((const __m256i *)(const void *)columns), 4);
        const __m128 b = _mm256_i64gather_ps(base, _mm256_loadu_si256((const __m256i *)(const void *)(columns + 4)), 4);
        return _mm256_set_m128(b, a);
    }
    const __m256i iota = _mm256_setr_epi64x(0, 1, 2, 3);
    const __m256i m0 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(remaining), iota);
    const __m256i m1 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(remaining - 4), iota);
    const __m256i c0 = _mm256_maskload_epi64((const long long *)(const void *)columns, m0);
    const __m256i c1 = _mm256_maskload_epi64((const long long *)(const void *)(columns + 4), m1);
    /* The gathers' masks: the sign bits of the 32-bit lanes, one per 64-bit index. */
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m128 k0 = _mm256_castps256_ps128(_mm256_castsi256_ps(_mm256_permutevar8x32_epi32(m0, pick)));
    const __m128 k1 = _mm256_castps256_ps128(_mm256_castsi256_ps(_mm256_permutevar8x32_epi32(m1, pick)));
    const __m128 a = _mm256_mask_i64gather_ps(_mm_setzero_ps(), base, c0, k0, 4);
    const __m128 b = _mm256_mask_i64gather_ps(_mm_setzero_ps(), base, c1, k1, 4);
    return _mm256_set_m128(b, a);
}

BLOCK void compact_block(float *z, const int64_t *columns, int64_t k, int64_t remaining, int move, __m256i least,
                         __m256 c, const float *weights, const float *next, __m256d *lo, __m256d *hi)
{
    columns += k;
    const __m256 v = gather_columns(z, columns, remaining);
    if (next) /* one line per 8 columns, as the AVX-512 set's two per 16 */
        _mm_prefetch((const char *)(next + columns[0]), _MM_HINT_T1);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
    /* Signed compares suffice (bits below 2^31); a threshold with the sign bit is a negative least: nothing below. */
    __m256i below = _mm256_cmpgt_epi32(least, bits);
    if (remaining < LANES)
        below = _mm256_and_si256(below, lanes_below(remaining));
    if (!_mm256_testz_si256(below, below)) {
        const __m256 w = weights ? gather_columns(weights, columns, remaining) : _mm256_set1_ps(1.0f);
        accumulate_double(_mm256_and_ps(_mm256_castsi256_ps(below), _mm256_sub_ps(v, _mm256_mul_ps(c, w))), lo, hi);
    }
    if (move)
        store(z + k, v, remaining);
}

/* In place: the gather of z[k..k + 8) reads columns >= k, which no earlier store (below k) has touched. The next
 * row's columns are prefetched to L2 as this row's are read (the rows of a block are read back from L3 or memory). */
static double compact(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                      const float *weights, const float *next)
{
    uint32_t least_bits;
    memcpy(&least_bits, &threshold, sizeof least_bits);
    const __m256i least = _mm256_set1_epi32((int)least_bits);
    const __m256 cv = _mm256_set1_ps(c);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t k = 0;
    for (; k + LANES <= count; k += LANES)
        compact_block(z, columns, k, LANES, move, least, cv, weights, next, &lo, &hi);
    if (k < count)
        compact_block(z, columns, k, count - k, move, least, cv, weights, next, &lo, &hi);
    return sum_as_double(lo, hi);
}

/* 8 values of a weight column from element at (the first `remaining`, zeros after; none read when remaining <= 0)
 * as f32: bf16 bits are the high half of their f32. */
BLOCK __m256 column_lanes(const void *w, int bf16, int64_t at, int64_t remaining)
{
    if (!bf16)
        return load((const float *)w + at, remaining);
    const uint16_t *bits = (const uint16_t *)w + at;
    uint16_t tail[LANES] = {0};
    if (remaining < LANES) {
        memcpy(tail, bits, (size_t)(remaining > 0 ? remaining : 0) * sizeof *bits);
        bits = tail;
    }
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)bits));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* The mask of maskload_pd / maskstore_pd for the first `remaining` of 4 doubles. */
BLOCK __m256i doubles_below(int64_t remaining)
{
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(remaining), _mm256_setr_epi64x(0, 1, 2, 3));
}

/* 32 sums from k (the first `remaining`) over columns j0..j1, in eight registers. */
BLOCK void add_columns_chunk(double *sums, int64_t remaining, const void *w, int bf16, int64_t stride,
                             const double *factors, int64_t j0, int64_t j1)
{
    __m256d acc[8];
    for (int q = 0; q < 8; q++)
        acc[q] = remaining >= 4 * LANES ? _mm256_loadu_pd(sums + 4 * q)
                                        : _mm256_maskload_pd(sums + 4 * q, doubles_below(remaining - 4 * q));
    for (int64_t j = j0; j < j1; j++) {
        if (factors[j] == 0.0)
            continue;
        const __m256d f = _mm256_set1_pd(factors[j]);
        for (int q = 0; q < 4; q++) {
            const __m256 a = column_lanes(w, bf16, j * stride + LANES * q, remaining - LANES * q);
            acc[2 * q] = _mm256_fmadd_pd(f, low_half(a), acc[2 * q]);
            acc[2 * q + 1] = _mm256_fmadd_pd(f, high_half(a), acc[2 * q + 1]);
        }
    }
    for (int q = 0; q < 8; q++)
        if (remaining >= 4 * LANES)
            _mm256_storeu_pd(sums + 4 * q, acc[q]);
        else
            _mm256_maskstore_pd(sums + 4 * q, doubles_below(remaining - 4 * q), acc[q]);
}

/* 32 sums at a time, over blocks of COLUMN_BLOCK columns: a block's part of the weight (its columns' count elements)
 * stays within a few pages while the sums' chunks go over it, so that the walk down each column streams and the pages
 * stay in the TLB. */
enum { COLUMN_BLOCK = 64 };

static void add_columns(double *sums, int64_t count, const void *w, int bf16, int64_t stride, const double *factors,
                        int64_t columns)
{
    const size_t width = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t j0 = 0; j0 < columns; j0 += COLUMN_BLOCK) {
        const int64_t j1 = j0 + COLUMN_BLOCK < columns ? j0 + COLUMN_BLOCK : columns;
        int64_t k = 0;
        for (; k + 4 * LANES <= count; k += 4 * LANES)
            add_columns_chunk(sums + k, 4 * LANES, (const char *)w + k * width, bf16, stride, factors, j0, j1);
        if (k < count)
            add_columns_chunk(sums + k, count - k, (const char *)w + k * width, bf16, stride, factors, j0, j1);
    }
}

FH_ROW_KERNEL_TABLE(fh_row_kernels_avx2, "avx2");
