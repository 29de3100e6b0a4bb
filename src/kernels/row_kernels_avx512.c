/* The AVX-512 row kernels (same contracts as row_kernels.h), with an inline 1-ulp vector exp and SLEEF's 1-ulp tanh
 * and log1p: the table fh_row_kernels_avx512. Built with -mavx512f -mavx512dq -mfma and only run when the CPU has
 * them. */
#include "row_kernels_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <sleef.h>

#define LANES 16

static __mmask16 tail_mask(int64_t remaining)
{
    return remaining >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

/* exp of 16 floats to within 1 ulp, inline: SLEEF's is a call, across which the callers' accumulators are spilled
 * (every vector register is caller-saved). x = n ln2 + r, |r| <= ln2 / 2 (r exact: one fma with the high part of
 * ln2, which has 9 trailing zero bits, then the low part); e^r by its degree-7 Taylor polynomial (truncation
 * 3e-9, below half an ulp); scalef multiplies by 2^n, rounding once into the subnormals and saturating to inf. The
 * clamps keep n finite (x = -inf gives 0) and, with the NaN as their second operand, let a NaN through. */
static __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Sum of the 16 floats as doubles. */
static double sum_as_double(__m512d lo, __m512d hi)
{
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

/* The 16 floats' first and last 8 as doubles. */
static __m512d low_half(__m512 v)
{
    return _mm512_cvtps_pd(_mm512_castps512_ps256(v));
}

static __m512d high_half(__m512 v)
{
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static void accumulate_double(__m512 v, __m512d *lo, __m512d *hi)
{
    *lo = _mm512_add_pd(*lo, low_half(v));
    *hi = _mm512_add_pd(*hi, high_half(v));
}

static void transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
{
    const int capped = tf->softcap > 0.0f, scaled = tf->inv_temperature != 1.0f;
    const __m512 cap = _mm512_set1_ps(tf->softcap), inv_cap = _mm512_set1_ps(capped ? 1.0f / tf->softcap : 0.0f);
    const __m512 scale = _mm512_set1_ps(tf->inv_temperature);
    if (!bias && !capped && !scaled)
        return;
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        __m512 v = _mm512_maskz_loadu_ps(m, z + j);
        if (bias)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
        if (capped)
            v = _mm512_mul_ps(cap, Sleef_tanhf16_u10avx512f(_mm512_mul_ps(v, inv_cap)));
        if (scaled)
            v = _mm512_mul_ps(v, scale);
        _mm512_mask_storeu_ps(z + j, m, v);
    }
}

static void fold(float *z, int64_t count, int64_t first_column, int64_t target_column, const fh_fold_request *request,
                 fh_fold_state *state)
{
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = neg_inf;
    __m512i vidx = _mm512_set1_epi32(-1);
    const __m512i step = _mm512_set1_epi32(LANES);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 any_nan = 0;
    for (int64_t j = 0; j < count; j += LANES, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 m = tail_mask(count - j);
        const __m512 v = _mm512_mask_loadu_ps(neg_inf, m, z + j);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        any_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_mask_blend_ps(gt, vmax, v);
        vidx = _mm512_mask_blend_epi32(gt, vidx, idx);
    }
    const float tile_max = _mm512_reduce_max_ps(vmax);
    /* Lowest index among the lanes holding the maximum (each lane kept its first occurrence). */
    const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(tile_max), _CMP_EQ_OQ);
    const int64_t tile_argmax =
        tile_max == -INFINITY ? -1 : _mm512_mask_reduce_min_epi32(at_max, vidx);

    if (target_column >= 0 && target_column < count)
        state->z_target = z[target_column];
    if (request->weighted_sum) {
        const float *weights = request->weights;
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (int64_t j = 0; j < count; j += LANES) {
            const __mmask16 m = tail_mask(count - j);
            __m512 v = _mm512_maskz_loadu_ps(m, z + j);
            if (weights)
                v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weights + j)); /* exact: product of two floats */
            accumulate_double(v, &lo, &hi);
        }
        state->sum_weighted_z += sum_as_double(lo, hi);
    }
    if (any_nan) {
        state->sum_exp = state->sum_z_exp = NAN;
        return;
    }
    if (tile_argmax < 0) { /* every logit is -inf: nothing to add */
        if (request->store_exps)
            memset(z, 0, (size_t)count * sizeof(float));
        return;
    }
    const __m512 shift = _mm512_set1_ps(tile_max);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    __m512d zlo = _mm512_setzero_pd(), zhi = _mm512_setzero_pd();
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        const __m512 v = _mm512_mask_loadu_ps(neg_inf, m, z + j);
        const __m512 e = exp16(_mm512_sub_ps(v, shift));
        if (request->next) /* one cache line of it per 16 exps, so that it comes from L3 or memory in their shadow */
            _mm_prefetch((const char *)(request->next + j), _MM_HINT_T1);
        accumulate_double(e, &lo, &hi);
        if (request->entropy) /* tail lanes have e = 0; zero their -inf too so 0 * -inf is not NaN */
            accumulate_double(_mm512_mul_ps(e, _mm512_maskz_mov_ps(m, v)), &zlo, &zhi);
        if (request->store_exps)
            _mm512_mask_storeu_ps(z + j, m, e);
    }
    fh_row_merge(state, tile_max, first_column + tile_argmax, sum_as_double(lo, hi), sum_as_double(zlo, zhi));
}

/* 16 bytes at p, or the first `remaining` of them and zeros after (no read past the end). */
static __m128i load_bytes(const uint8_t *p, int64_t remaining)
{
    if (remaining >= LANES)
        return _mm_loadu_si128((const __m128i *)(const void *)p);
    uint8_t bytes[LANES] = {0};
    memcpy(bytes, p, (size_t)remaining);
    return _mm_loadu_si128((const __m128i *)(const void *)bytes);
}

/* marks[j] |= 1 for the lanes of at_least (j.. + remaining; no byte written past the end). */
static void set_marks(uint8_t *marks, __mmask16 at_least, int64_t remaining)
{
    const __m128i set = _mm_or_si128(load_bytes(marks, remaining),
                                     _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(at_least, _mm512_set1_epi32(1))));
    if (remaining >= LANES)
        _mm_storeu_si128((__m128i *)(void *)marks, set);
    else {
        uint8_t bytes[LANES];
        _mm_storeu_si128((__m128i *)(void *)bytes, set);
        memcpy(marks, bytes, (size_t)remaining);
    }
}

/* fh_row_marking's work on the dU of columns j.. (lanes m, class weights w): on the bits, |dU| is an AND and the
 * comparison an integer one (non-negative floats order as their bits do, and a NaN's bits exceed infinity's). */
static void mark_lanes(fh_row_marking *mk, __m512 du, __m512 w, __mmask16 m, int64_t j, int64_t remaining,
                       __m512d *lo, __m512d *hi)
{
    uint32_t least;
    memcpy(&least, &mk->threshold, sizeof least);
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(du), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 at_least = _mm512_mask_cmpge_epu32_mask(m, bits, _mm512_set1_epi32((int)least));
    const __mmask16 below = m & ~at_least;
    if (at_least)
        set_marks(mk->marks + j, at_least, remaining);
    if (!below || !mk->nu)
        return;
    const __m512 d = _mm512_maskz_sub_ps(below, du, _mm512_mul_ps(_mm512_set1_ps(mk->c), w));
    accumulate_double(d, lo, hi);
    float *nu = mk->nu + j;
    _mm512_mask_storeu_ps(nu, below, _mm512_add_ps(_mm512_maskz_loadu_ps(below, nu), _mm512_abs_ps(d)));
}

static void gradient(float *z, int64_t count, int64_t target_column, const float *weights, const fh_coef *coef,
                     const fh_transform *tf, fh_row_marking *marking)
{
    /* lse = hi + lo in floats: (z - hi) is exact near the maximum, so p keeps double-like accuracy. */
    const float lse_hi = (float)coef->lse, lse_lo = (float)(coef->lse - (double)lse_hi);
    const __m512 vhi = _mm512_set1_ps(lse_hi), vlo = _mm512_set1_ps(lse_lo);
    const __m512 va = _mm512_set1_ps((float)coef->a), vc = _mm512_set1_ps((float)coef->c);
    const __m512 ve = _mm512_set1_ps((float)coef->e), vsum_pz = _mm512_set1_ps((float)coef->sum_pz);
    const int from_exps = coef->p_scale != 0.0;
    const __m512 p_scale = _mm512_set1_ps((float)coef->p_scale);
    const int entropy_term = coef->e != 0.0;
    const float scale = tf->inv_temperature, cap = tf->softcap;
    const int capped = cap > 0.0f;
    const __m512 vscale = _mm512_set1_ps(scale), one = _mm512_set1_ps(1.0f);
    const __m512 inv_cap_scaled = _mm512_set1_ps(capped ? 1.0f / (scale * cap) : 0.0f);
    const int has_target = target_column >= 0 && target_column < count;
    const __m512 b_term = _mm512_set1_ps(has_target ? (float)coef->b * fh_dz_du(z[target_column], tf) : 0.0f);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        const __m512 v = _mm512_maskz_loadu_ps(m, z + j);
        const __m512 p = from_exps ? _mm512_mul_ps(v, p_scale) : exp16(_mm512_sub_ps(_mm512_sub_ps(v, vhi), vlo));
        const __m512 w = weights ? _mm512_maskz_loadu_ps(m, weights + j) : one;
        __m512 dz = _mm512_fmadd_ps(va, p, _mm512_mul_ps(vc, w));
        if (entropy_term)
            dz = _mm512_fmadd_ps(_mm512_mul_ps(ve, p), _mm512_sub_ps(v, vsum_pz), dz);
        __m512 dzdu = vscale;
        if (capped) {
            const __m512 t = _mm512_mul_ps(v, inv_cap_scaled);
            dzdu = _mm512_mul_ps(vscale, _mm512_mul_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t)));
        }
        __m512 du = _mm512_mul_ps(dz, dzdu);
        if (has_target && target_column >= j && target_column < j + LANES)
            du = _mm512_mask_add_ps(du, (__mmask16)(1u << (target_column - j)), du, b_term);
        _mm512_mask_storeu_ps(z + j, m, du);
        if (marking)
            mark_lanes(marking, du, w, m, j, count - j, &lo, &hi);
    }
    if (marking)
        marking->tail = sum_as_double(lo, hi);
}

static void pair_max(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 mz = neg_inf, mc = neg_inf;
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        /* max_ps returns its second operand when either is NaN: the running maximum, so NaNs are skipped. */
        mz = _mm512_max_ps(_mm512_mask_loadu_ps(neg_inf, m, z + j), mz);
        mc = _mm512_max_ps(_mm512_mask_loadu_ps(neg_inf, m, cz + j), mc);
    }
    *max_z = _mm512_reduce_max_ps(mz);
    *max_cz = _mm512_reduce_max_ps(mc);
}

static void exp_sums(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2])
{
    const __m512 vscale = _mm512_set1_ps(scale), vshift = _mm512_set1_ps(shift);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd(), clo = _mm512_setzero_pd(), chi = _mm512_setzero_pd();
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        const __m512 sa = _mm512_mul_ps(vscale, _mm512_maskz_loadu_ps(m, a + j));
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(sa, vshift)));
        accumulate_double(e, &lo, &hi);
        if (b) {
            const __m512 sb = _mm512_mul_ps(vscale, _mm512_maskz_loadu_ps(m, b + j));
            accumulate_double(_mm512_mul_ps(e, _mm512_sub_ps(sa, sb)), &clo, &chi);
        }
    }
    sums[0] += sum_as_double(lo, hi);
    sums[1] += sum_as_double(clo, chi);
}

/* softplus(x) = log(1 + e^x) (plus) and softplus(-x) (minus), without overflow. */
static void softplus_pair(__m512 x, __m512 *plus, __m512 *minus)
{
    const __m512 zero = _mm512_setzero_ps();
    const __m512 minus_abs = _mm512_min_ps(x, _mm512_sub_ps(zero, x));
    const __m512 tail = Sleef_log1pf16_u10avx512f(exp16(minus_abs));
    *plus = _mm512_add_ps(_mm512_max_ps(x, zero), tail);
    *minus = _mm512_add_ps(_mm512_max_ps(_mm512_sub_ps(zero, x), zero), tail);
}

/* Row j's log p and log q: inv_t z - lse_s and inv_t cz - lse_t (tail lanes 0), inv_t z rounded before the
 * subtraction as the lse's own sums round it (fh_row_exp_sums): a fused multiply-subtract would leave log p of the
 * largest entry up to half an ulp of inv_t z above 0 (p = e^32 at inv_t z ~ 1e9). */
static void log_probs(const fh_pair_row *r, const float *z, const float *cz, int64_t j, __mmask16 m, __m512 *ls,
                      __m512 *lt)
{
    const __m512 it = _mm512_set1_ps(r->inv_t);
    *ls = _mm512_maskz_sub_ps(m, _mm512_mul_ps(it, _mm512_maskz_loadu_ps(m, z + j)), _mm512_set1_ps(r->lse_s));
    *lt = _mm512_maskz_sub_ps(m, _mm512_mul_ps(it, _mm512_maskz_loadu_ps(m, cz + j)), _mm512_set1_ps(r->lse_t));
}

/* jsd's lp, lq and sp of 16 columns (fh_row_jsd_sums): each of the two forms only where a lane needs it. */
static void jsd_logs(const fh_pair_row *r, const float *z, const float *cz, int64_t j, __mmask16 m, __m512 *lp,
                     __m512 *lq, __m512 *sp)
{
    const __m512 diff = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, cz + j), _mm512_maskz_loadu_ps(m, z + j));
    const __m512 delta = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(r->inv_t), diff), _mm512_set1_ps(r->lse_t_minus_s));
    const __m512 log_1m_beta = _mm512_set1_ps(r->log_1m_beta);
    const __mmask16 near = _mm512_cmp_ps_mask(_mm512_abs_ps(delta), _mm512_set1_ps(1.0f), _CMP_LT_OQ);
    *lp = *lq = *sp = _mm512_setzero_ps();
    if (near) {
        const __m512 e = Sleef_expm1f16_u10avx512f(delta);
        *lp = Sleef_log1pf16_u10avx512f(_mm512_mul_ps(_mm512_set1_ps(r->beta), e));
        *lq = _mm512_sub_ps(*lp, delta);
        *sp = _mm512_sub_ps(*lp, log_1m_beta);
    }
    if (near != (__mmask16)0xffff) {
        __m512 far_sp, far_spn;
        softplus_pair(_mm512_add_ps(_mm512_set1_ps(r->log_odds), delta), &far_sp, &far_spn);
        *lp = _mm512_mask_blend_ps(near, _mm512_add_ps(log_1m_beta, far_sp), *lp);
        *lq = _mm512_mask_blend_ps(near, _mm512_add_ps(_mm512_set1_ps(r->log_beta), far_spn), *lq);
        *sp = _mm512_mask_blend_ps(near, far_sp, *sp);
    }
}

static void jsd_sums(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[3])
{
    const __m512 beta = _mm512_set1_ps(r->beta), one_m_beta = _mm512_set1_ps(1.0f - r->beta);
    __m512d dlo = _mm512_setzero_pd(), dhi = _mm512_setzero_pd(), klo = _mm512_setzero_pd(), khi = _mm512_setzero_pd();
    __m512d slo = _mm512_setzero_pd(), shi = _mm512_setzero_pd();
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        __m512 ls, lt, lp, lq, sp;
        log_probs(r, z, cz, j, m, &ls, &lt);
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(ls));
        const __m512 q = _mm512_maskz_mov_ps(m, exp16(lt));
        jsd_logs(r, z, cz, j, m, &lp, &lq, &sp);
        const __m512 kp = _mm512_mul_ps(p, lp);
        const __m512 d = _mm512_fmadd_ps(_mm512_mul_ps(beta, q), lq, _mm512_mul_ps(one_m_beta, kp));
        accumulate_double(_mm512_sub_ps(_mm512_setzero_ps(), d), &dlo, &dhi);
        accumulate_double(kp, &klo, &khi);
        accumulate_double(_mm512_mul_ps(p, sp), &slo, &shi);
    }
    sums[0] += sum_as_double(dlo, dhi);
    sums[1] += sum_as_double(klo, khi);
    sums[2] += sum_as_double(slo, shi);
}

static void pair_gradient(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    const __m512 g_soft = _mm512_set1_ps(r->g_soft * r->inv_t), g_hard = _mm512_set1_ps(r->g_hard);
    const __m512 d = _mm512_set1_ps(r->d), k = _mm512_set1_ps(r->k), lse_u = _mm512_set1_ps(r->lse_u);
    const __m512 one_m_beta = _mm512_set1_ps(1.0f - r->beta);
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        __m512 ls, lt, soft;
        log_probs(r, z, cz, j, m, &ls, &lt);
        const __m512 p = exp16(ls);
        switch (r->divergence) {
        case FH_PAIR_FORWARD_KL: soft = _mm512_sub_ps(p, exp16(lt)); break;
        case FH_PAIR_REVERSE_KL: soft = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_sub_ps(ls, lt), d)); break;
        default: {
            __m512 lp, lq, sp;
            jsd_logs(r, z, cz, j, m, &lp, &lq, &sp);
            soft = _mm512_mul_ps(_mm512_mul_ps(one_m_beta, p), _mm512_sub_ps(k, r->k_of_softplus ? sp : lp));
            break;
        }
        }
        __m512 du = _mm512_mul_ps(g_soft, soft);
        if (r->g_hard != 0.0f) {
            const __m512 u = _mm512_maskz_loadu_ps(m, z + j);
            du = _mm512_fmadd_ps(g_hard, exp16(_mm512_sub_ps(u, lse_u)), du);
        }
        _mm512_mask_storeu_ps(z + j, m, du);
    }
}

static void softmax_pair(float *z, int64_t count, const fh_softmax_pair *r)
{
    const __m512 scale = _mm512_set1_ps(r->scale), shift_a = _mm512_set1_ps(r->shift_a), a = _mm512_set1_ps(r->a);
    const __m512 shift_b = _mm512_set1_ps(r->shift_b), b = _mm512_set1_ps(r->b);
    for (int64_t j = 0; j < count; j += LANES) {
        const __mmask16 m = tail_mask(count - j);
        const __m512 u = _mm512_maskz_loadu_ps(m, z + j);
        const __m512 second = r->b != 0.0f ? _mm512_mul_ps(b, exp16(_mm512_sub_ps(u, shift_b))) : _mm512_setzero_ps();
        const __m512 du = _mm512_fmadd_ps(a, exp16(_mm512_sub_ps(_mm512_mul_ps(scale, u), shift_a)), second);
        _mm512_mask_storeu_ps(z + j, m, du);
    }
}

/* The portable rounding (ties to even, NaN kept quiet), 16 at a time on the bits: each step reads 64 bytes at 4 j and
 * writes 32 at 2 j, so that a row narrowed in place never overwrites what it has yet to read. */
static void to_bf16(const void *src, int64_t count, void *dst)
{
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES) {
        const __m512i bits = _mm512_loadu_si512((const char *)src + j * (int64_t)sizeof(float));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), infinity);
        const __m512i high = _mm512_srli_epi32(bits, 16);
        const __m512i rounded =
            _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(high, one))), 16);
        const __m512i out = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, quiet));
        _mm256_storeu_si256((__m256i *)((char *)dst + j * (int64_t)sizeof(uint16_t)), _mm512_cvtepi32_epi16(out));
    }
    if (j < count)
        fh_row_kernels_portable.to_bf16((const char *)src + j * (int64_t)sizeof(float), count - j,
                                        (char *)dst + j * (int64_t)sizeof(uint16_t));
}

/* 16 floats of base at columns[0..16) (the first `remaining` of them, zeros after): two gathers of 8 by 64-bit
 * index. */
static __m512 gather_columns(const float *base, const int64_t *columns, int64_t remaining)
{
    const __mmask16 m = tail_mask(remaining);
    const __m512i lo = _mm512_maskz_loadu_epi64((__mmask8)m, columns);
    const __m512i hi = _mm512_maskz_loadu_epi64((__mmask8)(m >> 8), columns + 8);
    const __m256 a = _mm512_mask_i64gather_ps(_mm256_setzero_ps(), (__mmask8)m, lo, base, 4);
    const __m256 b = _mm512_mask_i64gather_ps(_mm256_setzero_ps(), (__mmask8)(m >> 8), hi, base, 4);
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

/* In place: the gather of z[k..k + 16) reads columns >= k, which no earlier store (below k) has touched. The next
 * row's columns are prefetched to L2 as this row's are read (the rows of a block are read back from L3 or memory). */
static double compact(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                      const float *weights, const float *next)
{
    uint32_t least_bits;
    memcpy(&least_bits, &threshold, sizeof least_bits);
    const __m512i least = _mm512_set1_epi32((int)least_bits), magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512 cv = _mm512_set1_ps(c), unit = _mm512_set1_ps(1.0f);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t k = 0; k < count; k += LANES) {
        const __mmask16 m = tail_mask(count - k);
        const __m512 v = gather_columns(z, columns + k, count - k);
        if (next) {
            _mm_prefetch((const char *)(next + columns[k]), _MM_HINT_T1);
            if (count - k > LANES / 2)
                _mm_prefetch((const char *)(next + columns[k + LANES / 2]), _MM_HINT_T1);
        }
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), magnitude);
        const __mmask16 below = _mm512_mask_cmplt_epu32_mask(m, bits, least);
        if (below) {
            const __m512 w = weights ? gather_columns(weights, columns + k, count - k) : unit;
            accumulate_double(_mm512_maskz_sub_ps(below, v, _mm512_mul_ps(cv, w)), &lo, &hi);
        }
        if (move)
            _mm512_mask_storeu_ps(z + k, m, v);
    }
    return sum_as_double(lo, hi);
}

/* The f32 values of 16 bf16 bits (the first `remaining` of them, zeros after): the bits are the high half of their
 * f32. A short tail goes through a local copy (16-bit masked loads need AVX512BW). */
static __m512 bf16_lanes(const uint16_t *bits, int64_t remaining)
{
    uint16_t tail[LANES] = {0};
    if (remaining < LANES) {
        memcpy(tail, bits, (size_t)(remaining > 0 ? remaining : 0) * sizeof *bits);
        bits = tail;
    }
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 values of a weight column from element at (the first `remaining`, zeros after) as f32. */
static __m512 column_lanes(const void *w, int bf16, int64_t at, int64_t remaining)
{
    if (bf16)
        return bf16_lanes((const uint16_t *)w + at, remaining);
    return _mm512_maskz_loadu_ps(remaining > 0 ? tail_mask(remaining) : 0, (const float *)w + at);
}

/* 32 sums at a time in four registers, over blocks of COLUMN_BLOCK columns: a block's part of the weight (its
 * columns' count elements) stays within a few pages while the sums' chunks go over it, so that the walk down each
 * column streams and the pages stay in the TLB (a chunk at a time over every column took one page per element). */
enum { COLUMN_BLOCK = 64 };

static void add_columns(double *sums, int64_t count, const void *w, int bf16, int64_t stride, const double *factors,
                        int64_t columns)
{
    for (int64_t j0 = 0; j0 < columns; j0 += COLUMN_BLOCK) {
        const int64_t j1 = j0 + COLUMN_BLOCK < columns ? j0 + COLUMN_BLOCK : columns;
        for (int64_t k = 0; k < count; k += 2 * LANES) {
            __mmask8 m[4];
            __m512d acc[4];
            for (int q = 0; q < 4; q++) {
                const int64_t left = count - k - 8 * q;
                m[q] = left >= 8 ? (__mmask8)0xff : left > 0 ? (__mmask8)((1u << left) - 1u) : 0;
                acc[q] = _mm512_maskz_loadu_pd(m[q], sums + k + 8 * q);
            }
            for (int64_t j = j0; j < j1; j++) {
                if (factors[j] == 0.0)
                    continue;
                const __m512d f = _mm512_set1_pd(factors[j]);
                const __m512 a = column_lanes(w, bf16, j * stride + k, count - k);
                const __m512 b = column_lanes(w, bf16, j * stride + k + LANES, count - k - LANES);
                acc[0] = _mm512_fmadd_pd(f, low_half(a), acc[0]);
                acc[1] = _mm512_fmadd_pd(f, high_half(a), acc[1]);
                acc[2] = _mm512_fmadd_pd(f, low_half(b), acc[2]);
                acc[3] = _mm512_fmadd_pd(f, high_half(b), acc[3]);
            }
            for (int q = 0; q < 4; q++)
                _mm512_mask_storeu_pd(sums + k + 8 * q, m[q], acc[q]);
        }
    }
}

FH_ROW_KERNEL_TABLE(fh_row_kernels_avx512, "avx512");
