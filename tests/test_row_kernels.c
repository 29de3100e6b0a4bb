/* The row kernels themselves (src/kernels/row_kernels_impl.h): the set in use (FH_ROW_KERNELS, or the best set this CPU and
 * build run) against double precision and against the portable set, kernel by kernel, on rows of odd lengths (every
 * vector tail). With FH_ROW_KERNELS=portable the comparisons are of the portable set with itself, and the exp sweep
 * checks libm's expf.
 *
 * fh_tests links the row kernels' own objects (the CMake target fusedhead_row_kernels; libfusedhead's copies are
 * hidden); test_choice checks that both copies chose alike.
 *
 * Tolerances, u = 2^-24 (stated again beside each check):
 *   exp (the vector sets' inline exp, libm's expf): within 1 ulp of exp in double, 2^-149 in the subnormals; so two
 *     sets' exps of the same float are at most 2 floats apart.
 *   sums in double of the same float terms in another order: (count - 1) 2^-53 of the sum of magnitudes, < 2^-40
 *     for the lengths here (at most 5003 terms).
 *   a float term whose exp is 2 floats off: relative 2^-22; terms built from it with a few more roundings that may
 *     differ between sets (fma against a product and a sum, 1 / (scale cap) against a division): 2^-20. */
#include "test_util.h"

#include "../src/kernels/row_kernels_impl.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The set under test: the one the functions of row_kernels.h run in this process. */
static const fh_row_kernel_set *set_in_use(void)
{
    return fh_row_kernels_in_use();
}

static const fh_row_kernel_set *portable(void)
{
    return &fh_row_kernels_portable;
}

/* ---- helpers ---- */

static uint64_t next_bits(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s, double lo, double hi)
{
    return lo + (hi - lo) * ((double)(next_bits(s) >> 11) * 0x1.0p-53);
}

static float *floats(int64_t count)
{
    return tu_alloc((size_t)count, sizeof(float));
}

static void fill(float *p, int64_t count, uint64_t *s, double lo, double hi)
{
    for (int64_t j = 0; j < count; j++)
        p[j] = (float)uniform(s, lo, hi);
}

static float *copy_of(const float *p, int64_t count)
{
    float *c = floats(count);
    memcpy(c, p, (size_t)count * sizeof(float));
    return c;
}

/* The float's place in the order of all floats (-0 and +0 the same). */
static int64_t float_order(float f)
{
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i >= 0 ? (int64_t)i : -(int64_t)(i & 0x7fffffff);
}

/* How many floats apart a and b are (0 for two NaNs, a large number for a NaN and a number). */
static int64_t floats_apart(float a, float b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0 : INT64_MAX;
    const int64_t d = float_order(a) - float_order(b);
    return d < 0 ? -d : d;
}

/* |got - want| in ulps of the float nearest want (2^-149 in the subnormals); inf counts as 2^128, as IEEE rounding
 * treats it, and is exact from FLT_MAX + half its ulp on. */
static double ulp_error(float got, double want)
{
    const double g = isinf(got) ? copysign(0x1.0p128, got) : got;
    if (fabs(want) >= 0x1.0p128 - 0x1.0p103)
        return isinf(got) && (got > 0) == (want > 0) ? 0.0 : INFINITY;
    int e;
    frexp(fabs(want), &e); /* fabs(want) = m 2^e, m in [0.5, 1): float ulp 2^(e - 24) */
    const double ulp = ldexp(1.0, e - 24 > -149 ? e - 24 : -149);
    return fabs(g - want) / ulp;
}

/* a and b equal within tol (absolute), or both NaN. */
static int close_to(double a, double b, double tol)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    if (a == b)
        return 1;
    return fabs(a - b) <= tol;
}

static const int64_t lengths[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 127, 255, 1001, 5003};

/* ---- the choice ---- */

static const char *const set_names[] = {"avx512", "avx2", "portable"}; /* best first */

/* Whatever FH_ROW_KERNELS says: the set in use is the one asked for when it runs here, else portable with a refusal
 * that names the request; unset, the best set that runs. libfusedhead's own copy chose the same. */
static void test_choice(void)
{
    const char *asked = getenv("FH_ROW_KERNELS");
    const char *name = fh_row_kernels_name(), *refusal = fh_row_kernels_refusal();
    TU_CHECK(fh_row_kernels_supported("portable") == 1, "portable is always supported");
    TU_CHECK(!fh_row_kernels_supported("sse9") && !fh_row_kernels_supported(NULL) &&
                 !fh_row_kernels_supported("AVX2"),
             "unknown names are not supported");
    TU_CHECK(strcmp(name, fh_row_kernels_in_use()->name) == 0, "name %s vs the table's %s", name,
             fh_row_kernels_in_use()->name);
    int known = 0;
    for (size_t k = 0; k < TU_COUNT(set_names); k++)
        known |= asked && strcmp(asked, set_names[k]) == 0;
    if (!asked || !asked[0]) {
        const char *best = NULL;
        for (size_t k = 0; k < TU_COUNT(set_names) && !best; k++)
            if (fh_row_kernels_supported(set_names[k]))
                best = set_names[k];
        TU_CHECK(best && strcmp(name, best) == 0 && !refusal, "default: %s (best supported %s), refusal %s", name,
                 best ? best : "none", refusal ? refusal : "none");
    } else if (known && fh_row_kernels_supported(asked))
        TU_CHECK(strcmp(name, asked) == 0 && !refusal, "FH_ROW_KERNELS=%s: %s, refusal %s", asked, name,
                 refusal ? refusal : "none");
    else {
        char start[96];
        snprintf(start, sizeof start, known ? "FH_ROW_KERNELS=%.40s, but " : "FH_ROW_KERNELS=%.40s is not one of",
                 asked);
        TU_CHECK(strcmp(name, "portable") == 0 && refusal && strncmp(refusal, start, strlen(start)) == 0,
                 "FH_ROW_KERNELS=%s: %s, refusal %s", asked, name, refusal ? refusal : "none");
        if (known && refusal)
            TU_CHECK(strstr(refusal, "(it has: ") != NULL, "the refusal lists what runs: %s", refusal);
    }
    fh_kernel_info info;
    memset(&info, 0, sizeof info);
    TU_CHECK(fh_kernel_query(&info) == FH_OK && info.elementwise && strcmp(info.elementwise, name) == 0,
             "libfusedhead's set %s vs %s", info.elementwise ? info.elementwise : "NULL", name);
    if (refusal)
        TU_CHECK(info.refusal && strcmp(info.refusal, refusal) == 0, "libfusedhead's refusal %s vs %s",
                 info.refusal ? info.refusal : "NULL", refusal);
}

/* ---- exp ---- */

/* The fold's stored exps of rows [0, x...] (x <= 0): exp(x) itself. Returns the largest error in ulps over the
 * `count` arguments, and checks the specials: -inf gives 0, a NaN makes the sums NaN. */
static double fold_exp_errors(const fh_row_kernel_set *set, const float *x, int64_t count)
{
    enum { ROW = 4097 }; /* 4096 arguments after the 0: a tail of 1 */
    float *row = floats(ROW);
    double worst = 0.0;
    int64_t worst_at = -1;
    const fh_fold_request request = {NULL, 0, 0, 1, NULL};
    for (int64_t i0 = 0; i0 < count; i0 += ROW - 1) {
        const int64_t m = count - i0 < ROW - 1 ? count - i0 : ROW - 1;
        row[0] = 0.0f;
        memcpy(row + 1, x + i0, (size_t)m * sizeof(float));
        fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
        set->fold(row, m + 1, 0, -1, &request, &st);
        TU_CHECK(row[0] == 1.0f && st.max == 0.0 && st.argmax == 0, "exp(0) = %a, max %g, argmax %lld", row[0],
                 st.max, (long long)st.argmax);
        for (int64_t j = 0; j < m; j++) {
            const double e = ulp_error(row[1 + j], exp((double)x[i0 + j]));
            if (e > worst) {
                worst = e;
                worst_at = i0 + j;
            }
        }
    }
    if (worst_at >= 0 && worst > 1.0)
        printf("\n    fold exp: %.3f ulp at x = %a", worst, x[worst_at]);
    /* -inf gives an exact 0; a NaN makes the sums NaN and leaves the row as it was. */
    float specials[5] = {0.0f, -INFINITY, -1.0f, -INFINITY, -0.0f};
    fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
    set->fold(specials, 5, 0, -1, &request, &st);
    TU_CHECK(specials[1] == 0.0f && specials[3] == 0.0f && specials[4] == 1.0f && specials[0] == 1.0f,
             "exps of [0, -inf, -1, -inf, -0]: %a %a %a %a %a", specials[0], specials[1], specials[2], specials[3],
             specials[4]);
    float with_nan[3] = {0.0f, NAN, -1.0f};
    st = (fh_fold_state){-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
    set->fold(with_nan, 3, 0, -1, &request, &st);
    TU_CHECK(isnan(st.sum_exp) && with_nan[0] == 0.0f && isnan(with_nan[1]) && with_nan[2] == -1.0f,
             "a NaN: sum %g, row %a %a %a", st.sum_exp, with_nan[0], with_nan[1], with_nan[2]);
    free(row);
    return worst;
}

/* The forward-KL pair gradient with lse_s = 0, a teacher of probability 0 and unit weights: dU = exp(z), any
 * sign. Returns the largest error in ulps. */
static double pair_exp_errors(const fh_row_kernel_set *set, const float *x, int64_t count)
{
    enum { ROW = 4095 };
    float *row = floats(ROW), *teacher = floats(ROW);
    for (int64_t j = 0; j < ROW; j++)
        teacher[j] = -INFINITY;
    const fh_pair_row r = {.divergence = FH_PAIR_FORWARD_KL, .inv_t = 1.0f, .beta = 0.5f, .g_soft = 1.0f};
    double worst = 0.0;
    int64_t worst_at = -1;
    for (int64_t i0 = 0; i0 < count; i0 += ROW) {
        const int64_t m = count - i0 < ROW ? count - i0 : ROW;
        memcpy(row, x + i0, (size_t)m * sizeof(float));
        set->pair_gradient(row, teacher, m, &r);
        for (int64_t j = 0; j < m; j++) {
            const double e = isnan(x[i0 + j]) ? (isnan(row[j]) ? 0.0 : INFINITY)
                                              : ulp_error(row[j], exp((double)x[i0 + j]));
            if (e > worst) {
                worst = e;
                worst_at = i0 + j;
            }
        }
    }
    if (worst_at >= 0 && worst > 1.0)
        printf("\n    pair exp: %.3f ulp at x = %a", worst, x[worst_at]);
    free(row);
    free(teacher);
    return worst;
}

/* Within 1 ulp of exp in double over a dense sweep: evenly spaced values and evenly spaced bit patterns of
 * [-110, 0] through the fold (the subnormal results from x < -87.34, 0 below -103.98), and of [0, 89] through the
 * pair gradient (inf above 88.72), every float of [88.70, 88.75] around the overflow, and the specials. */
static void test_exp_ulps(void)
{
    const fh_row_kernel_set *set = set_in_use();
    enum { SPACED = 1 << 21 };
    float *x = floats(2 * SPACED);
    for (int64_t k = 0; k < SPACED; k++)
        x[k] = (float)(-110.0 * ((double)k + 0.5) / SPACED);
    const uint32_t lowest = 0xc2dc0000u; /* -110 */
    for (int64_t k = 0; k < SPACED; k++) {
        const uint32_t bits = 0x80000000u + (uint32_t)((double)(lowest - 0x80000000u) * (double)k / SPACED);
        memcpy(&x[SPACED + k], &bits, sizeof bits);
    }
    const double fold_worst = fold_exp_errors(set, x, 2 * SPACED);
    for (int64_t k = 0; k < SPACED; k++)
        x[k] = (float)(89.0 * ((double)k + 0.5) / SPACED);
    const uint32_t highest = 0x42b20000u; /* 89 */
    for (int64_t k = 0; k < SPACED; k++) {
        const uint32_t bits = (uint32_t)((double)highest * (double)k / SPACED);
        memcpy(&x[SPACED + k], &bits, sizeof bits);
    }
    double pair_worst = pair_exp_errors(set, x, 2 * SPACED);
    int64_t m = 0;
    for (float v = 88.70f; v <= 88.75f; v = nextafterf(v, INFINITY))
        x[m++] = v;
    const float specials[] = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 89.0f, 1e30f, -1e30f, -110.0f, -87.336544f,
                              -103.27893f, -103.97208f, 88.72283f, 88.72284f, FLT_MIN, -FLT_MIN};
    for (size_t k = 0; k < TU_COUNT(specials); k++)
        x[m++] = specials[k];
    const double edge_worst = pair_exp_errors(set, x, m);
    pair_worst = pair_worst > edge_worst ? pair_worst : edge_worst;
    /* Tolerance: 1 ulp (the inline exp's polynomial truncation and roundings stay below it; libm's expf is within
     * 0.51). */
    TU_CHECK(fold_worst <= 1.0 && pair_worst <= 1.0, "%s exp: %.4f ulp (x <= 0), %.4f ulp (x >= 0)", set->name,
             fold_worst, pair_worst);
    printf("\n    %s exp: max %.4f ulp (x in [-110, 0]), %.4f ulp (x in [0, 89]) ", set->name, fold_worst,
           pair_worst);
    free(x);
}

/* ---- transform ---- */

static void test_transform(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 11;
    const fh_transform plain = {0.0f, 1.0f}, tempered = {0.0f, 1.0f / 0.7f}, capped = {30.0f, 1.0f / 0.7f};
    const fh_transform *transforms[] = {&plain, &tempered, &capped};
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *bias = floats(n);
        fill(z, n, &s, -100.0, 100.0);
        fill(bias, n, &s, -1.0, 1.0);
        for (size_t t = 0; t < TU_COUNT(transforms); t++)
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                float *a = copy_of(z, n), *b = copy_of(z, n);
                set->transform(a, n, with_bias ? bias : NULL, transforms[t]);
                portable()->transform(b, n, with_bias ? bias : NULL, transforms[t]);
                /* Tolerance: without a softcap the same float operations, exact; with one, tanh within 1 ulp
                 * (SLEEF) and 2 ulps (glibc's tanhf), then the same two products: 5 floats apart. */
                const int64_t tol = transforms[t]->softcap > 0.0f ? 5 : 0;
                int64_t worst = 0, at = 0;
                for (int64_t j = 0; j < n; j++)
                    if (floats_apart(a[j], b[j]) > worst) {
                        worst = floats_apart(a[j], b[j]);
                        at = j;
                    }
                TU_CHECK(worst <= tol, "transform n %lld, softcap %g, bias %d: column %lld %a vs %a (%lld floats)",
                         (long long)n, transforms[t]->softcap, with_bias, (long long)at, a[at], b[at],
                         (long long)worst);
                free(a);
                free(b);
            }
        free(z);
        free(bias);
    }
}

/* ---- fold ---- */

/* Folds row (count columns) in tiles of `tile` columns with set, as the engine does (target relative to each tile,
 * exps stored only for a single-tile row). */
static fh_fold_state fold_tiles(const fh_row_kernel_set *set, float *row, int64_t count, int64_t tile, int64_t target,
                                const float *weights, int weighted, int entropy, int store_exps)
{
    fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
    for (int64_t v0 = 0; v0 < count; v0 += tile) {
        const int64_t vb = count - v0 < tile ? count - v0 : tile;
        const fh_fold_request request = {weights ? weights + v0 : NULL, weighted, entropy, store_exps,
                                         v0 + vb < count ? row + v0 + vb : NULL};
        set->fold(row + v0, vb, v0, target - v0, &request, &st);
    }
    return st;
}

static void check_fold(const fh_row_kernel_set *set, const float *z, int64_t n, int64_t tile, int64_t target,
                       const float *weights, int variant, const char *what)
{
    const int weighted = variant & 1, entropy = (variant >> 1) & 1, store = tile >= n && ((variant >> 2) & 1);
    float *a = copy_of(z, n), *b = copy_of(z, n);
    const fh_fold_state sa = fold_tiles(set, a, n, tile, target, weights, weighted, entropy, store);
    const fh_fold_state sb = fold_tiles(portable(), b, n, tile, target, weights, weighted, entropy, store);
    double magnitude_wz = 0.0, magnitude_ze = 0.0;
    for (int64_t j = 0; j < n; j++) {
        magnitude_wz += fabs((double)(weights ? weights[j] : 1.0f) * z[j]);
        if (sb.max > -INFINITY)
            magnitude_ze += fabs((double)z[j]) * exp((double)z[j] - sb.max);
    }
    TU_CHECK(sa.max == sb.max && sa.argmax == sb.argmax && close_to(sa.z_target, sb.z_target, 0.0),
             "%s, n %lld, tile %lld: max %g vs %g, argmax %lld vs %lld, z_target %g vs %g", what, (long long)n,
             (long long)tile, sa.max, sb.max, (long long)sa.argmax, (long long)sb.argmax, sa.z_target, sb.z_target);
    /* Tolerance: the same float products summed in double in another order, 2^-40 of their magnitudes. */
    TU_CHECK(close_to(sa.sum_weighted_z, sb.sum_weighted_z, 0x1.0p-40 * magnitude_wz),
             "%s, n %lld, tile %lld: sum_weighted_z %.17g vs %.17g", what, (long long)n, (long long)tile,
             sa.sum_weighted_z, sb.sum_weighted_z);
    /* Tolerance: every exp within 2 floats of portable's (relative 2^-22), positive terms, and their order in
     * double (2^-40); the tiles' merges are the same double operations. */
    TU_CHECK(close_to(sa.sum_exp, sb.sum_exp, (0x1.0p-22 + 0x1.0p-40) * fabs(sb.sum_exp)),
             "%s, n %lld, tile %lld: sum_exp %.17g vs %.17g", what, (long long)n, (long long)tile, sa.sum_exp,
             sb.sum_exp);
    /* Tolerance: the exps as above, and the product z e rounded to float in the vector sets (2^-24): 2^-21 of the
     * terms' magnitudes (in units of the final maximum's exps). */
    TU_CHECK(close_to(sa.sum_z_exp, sb.sum_z_exp, 0x1.0p-21 * magnitude_ze + 0x1.0p-40 * fabs(sb.sum_z_exp)),
             "%s, n %lld, tile %lld: sum_z_exp %.17g vs %.17g (magnitude %g)", what, (long long)n, (long long)tile,
             sa.sum_z_exp, sb.sum_z_exp, magnitude_ze);
    /* Stored exps (the same float argument z - max in both): each within 1 ulp of exp, so 2 floats apart. Without
     * store_exps, or with a NaN in the row, the row is left as it was. */
    int64_t worst = 0, at = 0;
    for (int64_t j = 0; j < n; j++)
        if (floats_apart(a[j], b[j]) > worst) {
            worst = floats_apart(a[j], b[j]);
            at = j;
        }
    TU_CHECK(worst <= (store ? 2 : 0), "%s, n %lld, store %d: column %lld %a vs %a", what, (long long)n, store,
             (long long)at, a[at], b[at]);
    if (!store)
        TU_CHECK(memcmp(a, z, (size_t)n * sizeof(float)) == 0, "%s, n %lld: the row was written", what,
                 (long long)n);
    free(a);
    free(b);
}

static void test_fold(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 23;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *weights = floats(n);
        fill(weights, n, &s, 0.25, 4.0);
        const int64_t tiles[] = {n, 7, 64, n / 2 + 1};
        for (int shape = 0; shape < 5; shape++) {
            fill(z, n, &s, -20.0, 20.0);
            const char *what = "random";
            if (shape == 1 && n > 2) { /* a tie for the maximum, the later one first in its lane order */
                z[n - 1] = 25.0f;
                z[n / 2] = 25.0f;
                what = "tied maximum";
            } else if (shape == 2) { /* a few -inf (not the entropy's: 0 * -inf is a NaN in every set) */
                for (int64_t j = 0; j < n; j += 3)
                    z[j] = -INFINITY;
                what = "some -inf";
            } else if (shape == 3) {
                for (int64_t j = 0; j < n; j++)
                    z[j] = -INFINITY;
                what = "all -inf";
            } else if (shape == 4) {
                z[(n * 5) / 7] = NAN;
                what = "a NaN";
            }
            for (size_t t = 0; t < TU_COUNT(tiles); t++)
                for (int variant = 0; variant < 8; variant++) {
                    if (shape == 2 && (variant & 2))
                        continue;
                    const int64_t target = (int64_t)(uniform(&s, 0.0, (double)n + 1.0)) - 1; /* -1: none */
                    check_fold(set, z, n, tiles[t], target, (variant & 1) && (n & 1) ? weights : NULL, variant, what);
                }
        }
        free(z);
        free(weights);
    }
}

/* ---- gradient ---- */

/* dz/du of the transform at transformed value z (in double). */
static double dz_du(float z, const fh_transform *tf)
{
    if (!(tf->softcap > 0.0f))
        return tf->inv_temperature;
    const double t = z / ((double)tf->inv_temperature * tf->softcap);
    return tf->inv_temperature * (1.0 - t * t);
}

typedef struct gradient_case {
    fh_coef coef;
    fh_transform tf;
    int weights, exps, marks, nu, nan;
} gradient_case;

static void check_gradient(const fh_row_kernel_set *set, const float *u, const float *weights, int64_t n,
                           int64_t target, const gradient_case *gc, uint64_t *s)
{
    /* The row as the engine hands it over: transformed logits, or the fold's exps with p_scale = exp(max - lse). */
    float *z = copy_of(u, n);
    portable()->transform(z, n, NULL, &gc->tf);
    if (gc->nan)
        z[n / 3] = NAN;
    fh_coef k = gc->coef;
    double max = -INFINITY, sum = 0.0, sum_pz = 0.0;
    for (int64_t j = 0; j < n; j++)
        max = z[j] > max ? z[j] : max;
    for (int64_t j = 0; j < n; j++) {
        sum += exp(z[j] - max);
        sum_pz += z[j] * exp(z[j] - max);
    }
    k.lse = max + log(sum);
    k.sum_pz = sum_pz / sum;
    float *in = copy_of(z, n);
    if (gc->exps) {
        const fh_fold_request request = {NULL, 0, 0, 1, NULL};
        fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
        portable()->fold(in, n, 0, -1, &request, &st); /* one input for both sets */
        k.p_scale = exp(max - k.lse);
    }
    /* The per-column tolerance: p within 2^-21 (1 + |z - lse|) of portable's (the exps 2 floats apart; portable
     * rounds z - lse once from double, the vector sets subtract lse's two float halves), and a few roundings that
     * differ (fma, 1 / (scale cap) against a division): 2^-20 of the terms' magnitudes times |dz/du|. */
    double *tol = tu_alloc((size_t)n, sizeof(double));
    const double b_dzdu = target >= 0 && target < n ? fabs(k.b * dz_du(z[target], &gc->tf)) : 0.0;
    for (int64_t j = 0; j < n; j++) {
        const double p = exp((double)z[j] - k.lse), w = weights && gc->weights ? weights[j] : 1.0;
        const double spread = gc->exps ? 1.0 : 1.0 + fabs(z[j] - k.lse);
        tol[j] = 0x1.0p-20 * ((fabs(k.a) * p + fabs(k.e) * p * fabs(z[j] - k.sum_pz)) * spread + fabs(k.c * w)) *
                     fabs(dz_du(z[j], &gc->tf)) +
                 0x1.0p-20 * (j == target ? b_dzdu : 0.0) + 0x1.0p-140;
    }
    float *a = copy_of(in, n), *b = copy_of(in, n);
    /* The threshold in the widest gap between the 70th and 95th percentiles of portable's |dU| (a column within the
     * tolerance of it could be marked by one set and not the other). */
    float *ref = copy_of(in, n);
    portable()->gradient(ref, n, target, gc->weights ? weights : NULL, &k, &gc->tf, NULL);
    float *sorted = floats(n);
    int64_t finite = 0;
    for (int64_t j = 0; j < n; j++)
        if (!isnan(ref[j]))
            sorted[finite++] = fabsf(ref[j]);
    for (int64_t i = 1; i < finite; i++) /* insertion sort: n is small */
        for (int64_t j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) {
            const float t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    float threshold = 0.0f;
    double gap = -1.0;
    for (int64_t i = (finite * 7) / 10; i + 1 < finite && i < (finite * 95) / 100 + 1; i++)
        if (sorted[i + 1] - sorted[i] > gap) {
            gap = sorted[i + 1] - sorted[i];
            threshold = 0.5f * (sorted[i] + sorted[i + 1]);
        }
    if (finite < 2)
        threshold = 1.0f;
    double widest = 0.0;
    for (int64_t j = 0; j < n; j++)
        widest = tol[j] > widest ? tol[j] : widest;
    const int marks_decided = gap < 0.0 || gap > 4.0 * widest;
    uint8_t *ma = tu_alloc((size_t)n, 1), *mb = tu_alloc((size_t)n, 1);
    float *nua = floats(n), *nub = floats(n);
    for (int64_t j = 0; j < n; j++) {
        ma[j] = mb[j] = (uint8_t)(next_bits(s) & 1);
        nua[j] = nub[j] = (float)uniform(s, 0.0, 1.0);
    }
    fh_row_marking mka = {threshold, 0.03f, ma, gc->nu ? nua : NULL, -1.0};
    fh_row_marking mkb = {threshold, 0.03f, mb, gc->nu ? nub : NULL, -1.0};
    set->gradient(a, n, target, gc->weights ? weights : NULL, &k, &gc->tf, gc->marks ? &mka : NULL);
    portable()->gradient(b, n, target, gc->weights ? weights : NULL, &k, &gc->tf, gc->marks ? &mkb : NULL);
    int64_t bad = -1;
    double tail_tol = 0.0, tail_magnitude = 0.0;
    for (int64_t j = 0; j < n; j++) {
        if (!close_to(a[j], b[j], tol[j]) && bad < 0)
            bad = j;
        tail_tol += tol[j];
        tail_magnitude += fabs(b[j]) + fabs(0.03 * (weights && gc->weights ? weights[j] : 1.0));
    }
    TU_CHECK(bad < 0, "gradient n %lld (weights %d, exps %d, softcap %g, e %g, NaN %d): column %lld %a vs %a (tol %g)",
             (long long)n, gc->weights, gc->exps, gc->tf.softcap, k.e, gc->nan, (long long)(bad < 0 ? 0 : bad),
             a[bad < 0 ? 0 : bad], b[bad < 0 ? 0 : bad], tol[bad < 0 ? 0 : bad]);
    if (gc->marks && marks_decided) {
        TU_CHECK(memcmp(ma, mb, (size_t)n) == 0, "gradient n %lld: marks differ (threshold %g)", (long long)n,
                 threshold);
        if (gc->nu) {
            int64_t off = -1;
            for (int64_t j = 0; j < n && off < 0; j++)
                if (!close_to(nua[j], nub[j], tol[j] + 0x1.0p-23 * nub[j]))
                    off = j;
            TU_CHECK(off < 0, "gradient n %lld: nu[%lld] %a vs %a", (long long)n, (long long)(off < 0 ? 0 : off),
                     nua[off < 0 ? 0 : off], nub[off < 0 ? 0 : off]);
            /* Tolerance: the columns' own tolerances, plus the order of the double sum. */
            TU_CHECK(close_to(mka.tail, mkb.tail, tail_tol + 0x1.0p-40 * tail_magnitude),
                     "gradient n %lld: tail %.17g vs %.17g", (long long)n, mka.tail, mkb.tail);
        }
    }
    free(z);
    free(in);
    free(tol);
    free(a);
    free(b);
    free(ref);
    free(sorted);
    free(ma);
    free(mb);
    free(nua);
    free(nub);
}

static void test_gradient(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 37;
    const gradient_case cases[] = {
        /* coef {lse (set below), a, b, c, e, sum_pz (below), p_scale}, transform, weights, exps, marks, nu, NaN */
        {{0, 0.37, -0.37, 0.0, 0.0, 0, 0}, {0.0f, 1.0f}, 0, 0, 0, 0, 0},
        {{0, 0.37, -0.33, -0.004, 0.0, 0, 0}, {0.0f, 1.0f}, 1, 0, 1, 1, 0},
        {{0, 0.37, -0.37, 0.0, 0.2, 0, 0}, {0.0f, 1.0f / 0.7f}, 0, 0, 1, 0, 0},
        {{0, 0.37, -0.33, -0.004, 0.1, 0, 0}, {30.0f, 1.0f / 0.7f}, 1, 0, 1, 1, 0},
        {{0, 0.37, -0.37, 0.0, 0.0, 0, 0}, {0.0f, 1.0f}, 0, 1, 1, 1, 0},
        {{0, 0.5, -0.45, -0.002, 0.0, 0, 0}, {0.0f, 1.0f / 0.7f}, 1, 1, 1, 0, 0},
        {{0, 0.37, -0.37, 0.0, 0.0, 0, 0}, {0.0f, 1.0f}, 0, 0, 1, 1, 1},
    };
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *u = floats(n), *weights = floats(n);
        fill(weights, n, &s, 0.25, 4.0);
        for (size_t c = 0; c < TU_COUNT(cases); c++)
            for (int r = 0; r < 2; r++) {
                fill(u, n, &s, -12.0, 12.0);
                const int64_t target = r ? (int64_t)uniform(&s, 0.0, (double)n) : -1;
                check_gradient(set, u, weights, n, target, &cases[c], &s);
            }
        free(u);
        free(weights);
    }
}

/* ---- the pair kernels ---- */

static void test_pair_max(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 41;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *cz = floats(n);
        for (int shape = 0; shape < 3; shape++) {
            fill(z, n, &s, -50.0, 50.0);
            fill(cz, n, &s, -50.0, 50.0);
            if (shape == 1) /* NaNs ignored */
                for (int64_t j = 0; j < n; j += 2)
                    z[j] = cz[n - 1 - j] = NAN;
            if (shape == 2) /* nothing but -inf and NaN: -inf */
                for (int64_t j = 0; j < n; j++) {
                    z[j] = j & 1 ? NAN : -INFINITY;
                    cz[j] = NAN;
                }
            float a[2], b[2];
            set->pair_max(z, cz, n, &a[0], &a[1]);
            portable()->pair_max(z, cz, n, &b[0], &b[1]);
            /* Tolerance: none (a maximum). */
            TU_CHECK(a[0] == b[0] && a[1] == b[1], "pair_max n %lld shape %d: %g %g vs %g %g", (long long)n, shape,
                     a[0], a[1], b[0], b[1]);
        }
        free(z);
        free(cz);
    }
}

/* The tempered log-sum-exps of a student and teacher row. */
static fh_pair_row pair_row_of(const float *z, const float *cz, int64_t n, fh_pair_divergence divergence)
{
    const float inv_t = 1.0f / 1.5f, beta = 0.3f;
    double ms = -INFINITY, mt = -INFINITY, mu = -INFINITY, ss = 0.0, st = 0.0, su = 0.0;
    for (int64_t j = 0; j < n; j++) {
        ms = fmax(ms, inv_t * z[j]);
        mt = fmax(mt, inv_t * cz[j]);
        mu = fmax(mu, z[j]);
    }
    for (int64_t j = 0; j < n; j++) {
        ss += exp(inv_t * z[j] - ms);
        st += exp(inv_t * cz[j] - mt);
        su += exp(z[j] - mu);
    }
    const fh_pair_row r = {.divergence = divergence,
                           .inv_t = inv_t,
                           .beta = beta,
                           .log_odds = logf(beta / (1.0f - beta)),
                           .log_beta = logf(beta),
                           .log_1m_beta = log1pf(-beta),
                           .lse_s = (float)(ms + log(ss)),
                           .lse_t = (float)(mt + log(st)),
                           .lse_u = (float)(mu + log(su)),
                           .lse_t_minus_s = (float)((mt + log(st)) - (ms + log(ss))),
                           .d = 0.4f,
                           .k = 0.3f,
                           .g_soft = 0.8f};
    return r;
}

/* A random student and teacher row, and its constants. */
static fh_pair_row pair_rows(float *z, float *cz, int64_t n, uint64_t *s, fh_pair_divergence divergence)
{
    fill(z, n, s, -15.0, 15.0);
    fill(cz, n, s, -15.0, 15.0);
    return pair_row_of(z, cz, n, divergence);
}

/* jsd's log(m / p) and log(m / q) in double from the row's float constants. */
static void jsd_logs_double(const fh_pair_row *r, float z, float cz, double *lp, double *lq)
{
    const double ls = r->inv_t * z - (double)r->lse_s, lt = r->inv_t * cz - (double)r->lse_t;
    const double m = r->beta * exp(lt) + (1.0 - r->beta) * exp(ls);
    *lp = log(m) - ls;
    *lq = log(m) - lt;
}

static void test_exp_sums(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 43;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *cz = floats(n);
        for (int with_b = 0; with_b < 2; with_b++) {
            const fh_pair_row r = pair_rows(z, cz, n, &s, FH_PAIR_FORWARD_KL);
            double a[2] = {0.5, -0.25}, b[2] = {0.5, -0.25}, cross = 0.0;
            set->exp_sums(z, with_b ? cz : NULL, n, r.inv_t, r.lse_s, a);
            portable()->exp_sums(z, with_b ? cz : NULL, n, r.inv_t, r.lse_s, b);
            for (int64_t j = 0; j < n; j++)
                cross += exp(r.inv_t * z[j] - r.lse_s) * fabs(r.inv_t * z[j] - r.inv_t * cz[j]);
            /* Tolerance: the same float arguments, exps 2 floats apart (2^-22 of each positive term), the order of
             * the double sums (2^-40). */
            TU_CHECK(close_to(a[0], b[0], (0x1.0p-22 + 0x1.0p-40) * fabs(b[0])) &&
                         close_to(a[1], b[1], (0x1.0p-22 + 0x1.0p-40) * (cross + 0.25)),
                     "exp_sums n %lld, b %d: %.17g %.17g vs %.17g %.17g", (long long)n, with_b, a[0], a[1], b[0],
                     b[1]);
        }
        free(z);
        free(cz);
    }
}

static void test_jsd_sums(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 47;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *cz = floats(n);
        const fh_pair_row r = pair_rows(z, cz, n, &s, FH_PAIR_JSD);
        double a[3] = {0.0, 0.0, 0.0}, b[3] = {0.0, 0.0, 0.0}, magnitude_d = 0.0, magnitude_k = 0.0,
               magnitude_k_sp = 0.0;
        set->jsd_sums(z, cz, n, &r, a);
        portable()->jsd_sums(z, cz, n, &r, b);
        for (int64_t j = 0; j < n; j++) {
            const double ls = r.inv_t * z[j] - r.lse_s, lt = r.inv_t * cz[j] - r.lse_t;
            double lp, lq;
            jsd_logs_double(&r, z[j], cz[j], &lp, &lq);
            magnitude_d += r.beta * exp(lt) * fabs(lq) + (1.0 - r.beta) * exp(ls) * fabs(lp);
            magnitude_k += exp(ls) * fabs(lp);
            magnitude_k_sp += exp(ls) * (fabs(lp) + fabs(r.log_1m_beta));
        }
        /* Tolerance: per term, p and q 2 floats apart, the logs' expm1/exp and log1p within 1 ulp in each set, then
         * up to 4 roundings: 2^-19 of the terms' magnitudes (in double). */
        TU_CHECK(close_to(a[0], b[0], 0x1.0p-19 * magnitude_d) && close_to(a[1], b[1], 0x1.0p-19 * magnitude_k) &&
                     close_to(a[2], b[2], 0x1.0p-19 * magnitude_k_sp),
                 "jsd_sums n %lld: %.17g %.17g %.17g vs %.17g %.17g %.17g", (long long)n, a[0], a[1], a[2], b[0], b[1],
                 b[2]);
        free(z);
        free(cz);
    }
}

/* Nearly identical rows (log q - log p ~ 3e-3, D ~ 1e-6): jsd_sums' D against double from the same floats. */
static void test_jsd_sums_near_identical(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 61;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *cz = floats(n), *noise = floats(n);
        fill(z, n, &s, -15.0, 15.0);
        fill(noise, n, &s, -6e-3, 6e-3);
        for (int64_t j = 0; j < n; j++)
            cz[j] = z[j] + noise[j];
        const fh_pair_row r = pair_row_of(z, cz, n, FH_PAIR_JSD);
        double sums[3] = {0.0, 0.0, 0.0}, exact = 0.0, magnitude = 0.0, lse_s = -INFINITY, lse_t = -INFINITY;
        set->jsd_sums(z, cz, n, &r, sums);
        for (int64_t j = 0; j < n; j++) { /* the tempered rows' log-sum-exps, in double throughout */
            lse_s = fmax(lse_s, (double)r.inv_t * z[j]);
            lse_t = fmax(lse_t, (double)r.inv_t * cz[j]);
        }
        double sum_s = 0.0, sum_t = 0.0;
        for (int64_t j = 0; j < n; j++) {
            sum_s += exp((double)r.inv_t * z[j] - lse_s);
            sum_t += exp((double)r.inv_t * cz[j] - lse_t);
        }
        lse_s += log(sum_s);
        lse_t += log(sum_t);
        for (int64_t j = 0; j < n; j++) {
            const double ls = (double)r.inv_t * z[j] - lse_s, lt = (double)r.inv_t * cz[j] - lse_t;
            const double log_m = log(r.beta * exp(lt) + (1.0 - r.beta) * exp(ls));
            exact -= r.beta * exp(lt) * (log_m - lt) + (1.0 - r.beta) * exp(ls) * (log_m - ls);
            magnitude += r.beta * exp(lt) * fabs(log_m - lt) + (1.0 - r.beta) * exp(ls) * fabs(log_m - ls);
        }
        /* Tolerance: each term's logs are O(delta) and carry their own size to a few ulps (expm1, log1p), so the
         * error is a few roundings of the terms' magnitudes, 2^-19 of them (~2e-9 here, where D ~ 1e-6; summing
         * constant-sized terms against the binary entropy, as the softplus form alone would, is off by ~1e-8);
         * plus 2^-40 for the row's float constants (log-sum-exps of rounded inv_t z), which move delta by ~1e-7
         * and a single column's D by its square. */
        const double tol = 0x1.0p-19 * magnitude + 0x1.0p-40;
        TU_CHECK(close_to(sums[0], exact, tol), "jsd_sums of nearly identical rows, n %lld: %.17g vs %.17g (tol %.3g)",
                 (long long)n, sums[0], exact, tol);
        free(z);
        free(cz);
        free(noise);
    }
}

static void test_pair_gradient(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 53;
    const fh_pair_divergence divergences[] = {FH_PAIR_FORWARD_KL, FH_PAIR_REVERSE_KL, FH_PAIR_JSD};
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *cz = floats(n);
        for (size_t d = 0; d < TU_COUNT(divergences); d++)
            for (int variant = 0; variant < 4; variant++) {
                const int hard = variant & 1;
                fh_pair_row r = pair_rows(z, cz, n, &s, divergences[d]);
                r.g_hard = hard ? 0.25f : 0.0f;
                r.k_of_softplus = variant >> 1;
                float *a = copy_of(z, n), *b = copy_of(z, n);
                set->pair_gradient(a, cz, n, &r);
                portable()->pair_gradient(b, cz, n, &r);
                int64_t bad = -1;
                double tol_bad = 0.0;
                for (int64_t j = 0; j < n && bad < 0; j++) {
                    const double ls = r.inv_t * z[j] - r.lse_s, lt = r.inv_t * cz[j] - r.lse_t;
                    const double p = exp(ls), q = exp(lt);
                    double lp, lq;
                    jsd_logs_double(&r, z[j], cz[j], &lp, &lq);
                    const double soft = divergences[d] == FH_PAIR_FORWARD_KL   ? p + q
                                        : divergences[d] == FH_PAIR_REVERSE_KL ? p * (fabs(ls - lt) + fabs(r.d))
                                                                               : p * (fabs(r.k) + fabs(lp) + 1.0);
                    /* Tolerance: the exps 2 floats apart and jsd's logs as in jsd_sums, a few roundings: 2^-19 of
                     * the terms' magnitudes (jsd's lp: 2^-19 of max(|lp|, 1), as its softplus form rounds log(1 -
                     * beta) + sp); the hard term's exp likewise. */
                    const double tol = 0x1.0p-19 * (fabs(r.g_soft * r.inv_t) * soft +
                                                    fabs(r.g_hard) * exp((double)z[j] - r.lse_u)) +
                                       0x1.0p-140;
                    if (!close_to(a[j], b[j], tol)) {
                        bad = j;
                        tol_bad = tol;
                    }
                }
                TU_CHECK(bad < 0,
                         "pair_gradient n %lld, divergence %d, hard %d, k of softplus %d: column %lld %a vs %a (tol %g)",
                         (long long)n, (int)divergences[d], hard, r.k_of_softplus, (long long)(bad < 0 ? 0 : bad),
                         a[bad < 0 ? 0 : bad], b[bad < 0 ? 0 : bad], tol_bad);
                free(a);
                free(b);
            }
        free(z);
        free(cz);
    }
}

/* softmax_pair against the formula in double on the same float arguments (scale u, then - shift, rounded as the
 * kernel documents) and against the portable set: each exp within 1 ulp (2 floats between sets), then a product and
 * an fma or a product and a sum: 2^-20 of the terms' magnitudes. Without the second term (b = 0) it contributes
 * nothing, also where its exp would overflow (shift_b far below u). */
static void test_softmax_pair(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 61;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n);
        fill(z, n, &s, -6.0, 6.0);
        for (int second = 0; second < 2; second++) {
            const fh_softmax_pair r = {1.0f / 0.7f, 7.5f, -0.8f, second ? 5.0f : -200.0f, second ? 0.3f : 0.0f};
            float *a = copy_of(z, n), *b = copy_of(z, n);
            set->softmax_pair(a, n, &r);
            portable()->softmax_pair(b, n, &r);
            int64_t bad = -1;
            for (int64_t j = 0; j < n && bad < 0; j++) {
                const float arg_a = r.scale * z[j] - r.shift_a, arg_b = z[j] - r.shift_b;
                const double ta = fabs(r.a) * exp(arg_a), tb = second ? fabs(r.b) * exp(arg_b) : 0.0;
                const double want = r.a * exp(arg_a) + (second ? r.b * exp(arg_b) : 0.0);
                const double tol = 0x1.0p-20 * (ta + tb) + 0x1.0p-140;
                if (!close_to(a[j], want, tol) || !close_to(a[j], b[j], tol))
                    bad = j;
            }
            TU_CHECK(bad < 0, "softmax_pair n %lld, second term %d: column %lld %a vs portable %a", (long long)n, second,
                     (long long)(bad < 0 ? 0 : bad), a[bad < 0 ? 0 : bad], b[bad < 0 ? 0 : bad]);
            free(a);
            free(b);
        }
        free(z);
    }
}

/* ---- filtering's compaction and column sums ---- */

static void test_compact(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 59;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        float *z = floats(n), *weights = floats(n), *next = floats(n);
        int64_t *columns = tu_alloc((size_t)n, sizeof(int64_t));
        fill(weights, n, &s, 0.25, 4.0);
        fill(next, n, &s, -1.0, 1.0);
        for (int variant = 0; variant < 8; variant++) {
            fill(z, n, &s, -1e-3, 1e-3);
            z[0] = NAN; /* never below the threshold */
            int64_t kept = 0;
            for (int64_t j = 0; j < n; j++)
                if (variant >= 4 || uniform(&s, 0.0, 1.0) < 0.4)
                    columns[kept++] = j;
            const int move = variant & 1;
            const float threshold = variant & 2 ? 5e-4f : 0.0f, c = 1e-4f;
            const float *w = variant & 4 ? weights : NULL;
            float *a = copy_of(z, n), *b = copy_of(z, n);
            const double ra = set->compact(a, columns, kept, move, threshold, c, w, next);
            const double rb = portable()->compact(b, columns, kept, move, threshold, c, w, next);
            double magnitude = 0.0;
            for (int64_t k = 0; k < kept; k++)
                if (!isnan(z[columns[k]]))
                    magnitude += fabs(z[columns[k]]) + c * (w ? w[columns[k]] : 1.0f);
            /* Tolerance: the same float differences summed in double in another order (2^-40); the moves are
             * exact. */
            TU_CHECK(close_to(ra, rb, 0x1.0p-40 * magnitude) && memcmp(a, b, (size_t)n * sizeof(float)) == 0,
                     "compact n %lld, variant %d: %.17g vs %.17g, rows %s", (long long)n, variant, ra, rb,
                     memcmp(a, b, (size_t)n * sizeof(float)) == 0 ? "equal" : "differ");
            free(a);
            free(b);
        }
        free(z);
        free(weights);
        free(next);
        free(columns);
    }
}

static void test_add_columns(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 61;
    const int64_t column_counts[] = {1, 3, 64, 65, 130};
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li], stride = n + 5;
        for (size_t ci = 0; ci < TU_COUNT(column_counts); ci++)
            for (int bf16 = 0; bf16 < 2; bf16++) {
                const int64_t columns = column_counts[ci];
                float *w = floats(columns * stride);
                uint16_t *wb = tu_alloc((size_t)(columns * stride), sizeof(uint16_t));
                fill(w, columns * stride, &s, -2.0, 2.0);
                portable()->to_bf16(w, columns * stride, wb);
                double *factors = tu_alloc((size_t)columns, sizeof(double));
                double *a = tu_alloc((size_t)n, sizeof(double)), *b = tu_alloc((size_t)n, sizeof(double));
                for (int64_t j = 0; j < columns; j++)
                    factors[j] = uniform(&s, 0.0, 1.0) < 0.2 ? 0.0 : uniform(&s, -3.0, 3.0);
                for (int64_t k = 0; k < n; k++)
                    a[k] = b[k] = uniform(&s, -1.0, 1.0);
                double *initial = tu_alloc((size_t)n, sizeof(double));
                memcpy(initial, a, (size_t)n * sizeof(double));
                const void *src = bf16 ? (const void *)wb : (const void *)w;
                set->add_columns(a, n, src, bf16, stride, factors, columns);
                portable()->add_columns(b, n, src, bf16, stride, factors, columns);
                int64_t bad = -1;
                for (int64_t k = 0; k < n && bad < 0; k++) {
                    double magnitude = fabs(initial[k]);
                    for (int64_t j = 0; j < columns; j++)
                        magnitude += fabs(factors[j] * (bf16 ? fh_bf16_to_f32(wb[j * stride + k]) : w[j * stride + k]));
                    /* Tolerance: the same sums in the same order, fused or not: columns 2^-53 of the magnitudes,
                     * below 2^-45 for 130 columns. */
                    if (!close_to(a[k], b[k], 0x1.0p-45 * magnitude))
                        bad = k;
                }
                TU_CHECK(bad < 0, "add_columns n %lld, columns %lld, bf16 %d: sum %lld %.17g vs %.17g", (long long)n,
                         (long long)columns, bf16, (long long)(bad < 0 ? 0 : bad), a[bad < 0 ? 0 : bad],
                         b[bad < 0 ? 0 : bad]);
                free(w);
                free(wb);
                free(factors);
                free(a);
                free(b);
                free(initial);
            }
    }
}

/* ---- bf16 rounding ---- */

static void test_to_bf16(void)
{
    const fh_row_kernel_set *set = set_in_use();
    uint64_t s = 67;
    for (size_t li = 0; li < TU_COUNT(lengths); li++) {
        const int64_t n = lengths[li];
        uint32_t *bits = tu_alloc((size_t)n, sizeof(uint32_t));
        for (int64_t j = 0; j < n; j++) {
            bits[j] = (uint32_t)next_bits(&s); /* every class: NaNs, infinities, subnormals */
            if (j % 4 == 1)
                bits[j] = (bits[j] & 0xffff0000u) | 0x8000u; /* a tie */
            if (j % 7 == 3)
                bits[j] = j & 8 ? 0x7f800000u : 0xff7fffffu; /* inf; -FLT_MAX rounds to -inf */
        }
        uint16_t *a = tu_alloc((size_t)n, sizeof(uint16_t)), *b = tu_alloc((size_t)n, sizeof(uint16_t));
        set->to_bf16(bits, n, a);
        portable()->to_bf16(bits, n, b);
        /* In place: narrowed into the row's own first half. */
        uint32_t *in_place = tu_alloc((size_t)n, sizeof(uint32_t));
        memcpy(in_place, bits, (size_t)n * sizeof(uint32_t));
        set->to_bf16(in_place, n, in_place);
        /* Tolerance: none (the same rounding on the bits). */
        TU_CHECK(memcmp(a, b, (size_t)n * sizeof(uint16_t)) == 0 &&
                     memcmp(in_place, b, (size_t)n * sizeof(uint16_t)) == 0,
                 "to_bf16 n %lld: %s", (long long)n,
                 memcmp(a, b, (size_t)n * sizeof(uint16_t)) ? "differs from portable" : "differs in place");
        free(bits);
        free(a);
        free(b);
        free(in_place);
    }
}

static const tu_test tests[] = {
    {"set in use: the one FH_ROW_KERNELS asks for, the best one, or a refusal", test_choice},
    {"exp within 1 ulp: dense sweep, subnormal results, overflow, -inf, NaN", test_exp_ulps},
    {"transform (bias, temperature, softcap) vs portable", test_transform},
    {"fold vs portable: tiles, weights, entropy, stored exps, ties, -inf, NaN", test_fold},
    {"gradient vs portable: coefficients, softcap, stored exps, marks, nu, tail", test_gradient},
    {"pair_max vs portable", test_pair_max},
    {"exp_sums vs portable", test_exp_sums},
    {"jsd_sums vs portable", test_jsd_sums},
    {"jsd_sums of nearly identical rows vs double", test_jsd_sums_near_identical},
    {"pair_gradient vs portable: every divergence, hard term", test_pair_gradient},
    {"softmax_pair vs double and portable: one and two terms", test_softmax_pair},
    {"compact vs portable: thresholds, weights, in place", test_compact},
    {"add_columns vs portable: f32 and bf16 columns", test_add_columns},
    {"to_bf16 vs portable: every class of float, in place", test_to_bf16},
};
const tu_suite suite_row_kernels = {tests, TU_COUNT(tests)};
