/* The run-time choice of a set of row kernels (row_kernels_impl.h), the functions of row_kernels.h that run the
 * chosen set's, and the helpers every set shares. */
#include "row_kernels_impl.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fh_fold_state fh_fold_state_initial(void)
{
    const fh_fold_state st = {-INFINITY, 0.0, 0.0, 0.0, 0.0, 0};
    return st;
}

void fh_lse_raise(double *max, double new_max, double *const *sums, int count)
{
    if (!(new_max > *max))
        return;
    const double rescale = exp(*max - new_max);
    for (int k = 0; k < count; k++)
        *sums[k] *= rescale;
    *max = new_max;
}

void fh_row_merge(fh_fold_state *state, float tile_max, int64_t tile_argmax, double tile_sum, double tile_sum_z)
{
    if (tile_max > state->max) {
        double *const sums[2] = {&state->sum_exp, &state->sum_z_exp};
        fh_lse_raise(&state->max, tile_max, sums, 2);
        state->sum_exp += tile_sum;
        state->sum_z_exp += tile_sum_z;
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

/* Why a set this library knows is not in this build (its name the argument). */
#if defined(__x86_64__) || defined(__i386__)
#define FH_SET_NOT_BUILT "this build has no %s set (no SLEEF or compiler support when it was built)"
#elif defined(__aarch64__)
#define FH_SET_NOT_BUILT "%s is an x86-64 set, and this library is built for aarch64"
#else
#define FH_SET_NOT_BUILT "%s is an x86-64 set, and this library is built for another architecture"
#endif

/* The sets this library knows, best first: the table (NULL when not built) and what the CPU needs for it. */
typedef struct known_set {
    const char *name;
    const fh_row_kernel_set *table;
    const char *needs; /* the CPU features, as a refusal names them; NULL: none */
} known_set;

static const known_set known_sets[] = {
#ifdef FH_HAVE_AVX512_KERNELS
    {"avx512", &fh_row_kernels_avx512, "AVX-512F/DQ"},
#else
    {"avx512", NULL, "AVX-512F/DQ"},
#endif
#ifdef FH_HAVE_AVX2_KERNELS
    {"avx2", &fh_row_kernels_avx2, "AVX2/FMA"},
#else
    {"avx2", NULL, "AVX2/FMA"},
#endif
    {"portable", &fh_row_kernels_portable, NULL},
};
enum { KNOWN_SETS = sizeof known_sets / sizeof known_sets[0] };

/* 1 when the CPU (and the OS, which must save the wider registers: libgcc's checks include that) can run set k. */
static int cpu_runs(const known_set *k)
{
    if (!k->needs)
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (strcmp(k->name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    if (strcmp(k->name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return 0;
}

static int runs(const known_set *k)
{
    return k->table && cpu_runs(k);
}

static const fh_row_kernel_set *kernels = &fh_row_kernels_portable;
static char refusal[256]; /* empty: none */
static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;

/* refusal = "FH_ROW_KERNELS=<asked>, but <why> (it has: <the sets that run here>)". */
static void refuse(const char *asked, const char *why)
{
    char has[64] = "";
    for (int k = 0; k < KNOWN_SETS; k++)
        if (runs(&known_sets[k]))
            snprintf(has + strlen(has), sizeof has - strlen(has), "%s%s", has[0] ? ", " : "", known_sets[k].name);
    snprintf(refusal, sizeof refusal, "FH_ROW_KERNELS=%.40s, but %s (it has: %s)", asked, why, has);
}

static void choose_kernels(void)
{
    const char *asked = getenv("FH_ROW_KERNELS");
    if (!asked || !asked[0]) {
        for (int k = 0; k < KNOWN_SETS; k++)
            if (runs(&known_sets[k])) {
                kernels = known_sets[k].table;
                return;
            }
        return;
    }
    for (int k = 0; k < KNOWN_SETS; k++) {
        const known_set *set = &known_sets[k];
        if (strcmp(asked, set->name) != 0)
            continue;
        char why[96];
        if (!set->table) {
            snprintf(why, sizeof why, FH_SET_NOT_BUILT, set->name);
            refuse(asked, why);
        } else if (!cpu_runs(set)) {
            snprintf(why, sizeof why, "this CPU lacks %s", set->needs);
            refuse(asked, why);
        } else
            kernels = set->table;
        return;
    }
    snprintf(refusal, sizeof refusal, "FH_ROW_KERNELS=%.40s is not one of portable, avx2, avx512", asked);
}

/* pthread_once makes the first choice visible to every thread (one atomic load after). */
const fh_row_kernel_set *fh_row_kernels_in_use(void)
{
    pthread_once(&kernels_once, choose_kernels);
    return kernels;
}

const char *fh_row_kernels_name(void)
{
    return fh_row_kernels_in_use()->name;
}

const char *fh_row_kernels_refusal(void)
{
    fh_row_kernels_in_use();
    return refusal[0] ? refusal : NULL;
}

int fh_row_kernels_supported(const char *name)
{
    for (int k = 0; name && k < KNOWN_SETS; k++)
        if (strcmp(name, known_sets[k].name) == 0)
            return runs(&known_sets[k]);
    return 0;
}

void fh_row_transform(float *z, int64_t count, const float *bias, const fh_transform *tf)
{
    fh_row_kernels_in_use()->transform(z, count, bias, tf);
}

void fh_row_fold(float *z, int64_t count, int64_t first_column, int64_t target_column,
                 const fh_fold_request *request, fh_fold_state *state)
{
    fh_row_kernels_in_use()->fold(z, count, first_column, target_column, request, state);
}

void fh_row_gradient(float *z, int64_t count, int64_t target_column, const float *weights, const fh_coef *coef,
                     const fh_transform *tf, fh_row_marking *marking)
{
    /* A row whose coefficients are all 0 (an ignored or masked token) has dU = 0 whatever its p: set without
     * computing p, whose lse may be a placeholder (an ignored row's saved lse is 0: exp(z - 0) overflows, and inf x 0
     * would be NaN). Such a row marks nothing for filtering either. */
    if (coef->a == 0.0 && coef->b == 0.0 && coef->c == 0.0 && coef->e == 0.0) {
        memset(z, 0, (size_t)count * sizeof *z);
        return;
    }
    fh_row_kernels_in_use()->gradient(z, count, target_column, weights, coef, tf, marking);
}

void fh_row_pair_max(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz)
{
    fh_row_kernels_in_use()->pair_max(z, cz, count, max_z, max_cz);
}

void fh_row_exp_sums(const float *a, const float *b, int64_t count, float scale, float shift, double sums[2])
{
    fh_row_kernels_in_use()->exp_sums(a, b, count, scale, shift, sums);
}

void fh_row_jsd_sums(const float *z, const float *cz, int64_t count, const fh_pair_row *r, double sums[3])
{
    fh_row_kernels_in_use()->jsd_sums(z, cz, count, r, sums);
}

void fh_row_pair_gradient(float *z, const float *cz, int64_t count, const fh_pair_row *r)
{
    fh_row_kernels_in_use()->pair_gradient(z, cz, count, r);
}

void fh_row_softmax_pair(float *z, int64_t count, const fh_softmax_pair *r)
{
    fh_row_kernels_in_use()->softmax_pair(z, count, r);
}

double fh_row_compact(float *z, const int64_t *columns, int64_t count, int move, float threshold, float c,
                      const float *weights, const float *next)
{
    return fh_row_kernels_in_use()->compact(z, columns, count, move, threshold, c, weights, next);
}

void fh_row_add_columns(double *sums, int64_t count, const void *w, int bf16, int64_t stride, const double *factors,
                        int64_t columns)
{
    fh_row_kernels_in_use()->add_columns(sums, count, w, bf16, stride, factors, columns);
}

void fh_row_to_bf16(const void *src, int64_t count, void *dst)
{
    fh_row_kernels_in_use()->to_bf16(src, count, dst);
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
