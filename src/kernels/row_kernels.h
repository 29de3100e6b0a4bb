/* Elementwise work on one row of a logits tile. Tile rows are independent, so callers thread over
 * rows; every function is deterministic for a given row. */
#ifndef FH_ROW_KERNELS_H
#define FH_ROW_KERNELS_H

#include <stdint.h>
#include <string.h>

/* Elementwise transform of the raw logits u: z = cap(u) * inv_temperature, cap(u) = c tanh(u / c)
 * when softcap c > 0, else u. */
typedef struct fh_transform {
    float softcap;
    float inv_temperature;
} fh_transform;

/* One row's backward coefficients: dZ_j = a p_j + b [j = y] + c w_j + e p_j (z_j - sum_pz), with
 * p = softmax(z) = exp(z - lse); then dU = dZ * dz/du. p_scale non-zero: the row holds a fold's exps
 * exp(z - max) instead of z (fh_fold_request.store_exps), and p = exps * p_scale, p_scale = exp(max - lse); then z is
 * gone, so e must be 0 and the transform without a softcap. */
typedef struct fh_coef {
    double lse, a, b, c, e, sum_pz, p_scale;
} fh_coef;

/* Running statistics of one token across tiles. */
typedef struct fh_fold_state {
    double max;
    double sum_exp;        /* sum of exp(z - max) */
    double z_target;
    double sum_weighted_z;
    double sum_z_exp;      /* sum of z exp(z - max), for sum_j p_j z_j */
    int64_t argmax;
} fh_fold_state;

/* What a fold accumulates besides max, sum of exps, target logit and argmax. */
typedef struct fh_fold_request {
    const float *weights;  /* class weights for sum_weighted_z, or NULL (all 1) */
    int weighted_sum;      /* update sum_weighted_z */
    int entropy;           /* update sum_z_exp */
    int store_exps;        /* overwrite z with exp(z - the tile's maximum), once everything else has read it */
    const float *next;     /* the row to be folded after this one (count floats), prefetched meanwhile, or NULL */
} fh_fold_request;

/* The online log-sum-exp's one step: sums of exps taken at a running maximum *max, raised to new_max when that is
 * larger (sums[k] *= exp(*max - new_max)); a maximum of -inf has empty sums, which stay 0. Every running
 * log-sum-exp (fh_row_merge, distillation's) goes through it. */
void fh_lse_raise(double *max, double new_max, double *const *sums, int count);

/* A fresh state: max -inf, sums 0. */
fh_fold_state fh_fold_state_initial(void);

/* ---- Which set of kernels runs ----
 * Sets: "portable" (C at the library's base ISA), "avx2" (AVX2 + FMA), "avx512" (AVX-512F/DQ); the last two are
 * built on x86-64 only (on aarch64 "portable" is the one set, docs/aarch64.md). The choice is made once, at the first
 * call of any function below: FH_ROW_KERNELS=portable|avx2|avx512 in the environment forces a set; unset or empty,
 * the best set that this CPU and build support. A forced set that is unknown, not built, or that this CPU lacks is
 * refused: the portable set runs (nothing crashes) and fh_row_kernels_refusal says why. */

/* "portable", "avx2" or "avx512": the set in use. */
const char *fh_row_kernels_name(void);

/* NULL when the set in use is the one asked for (or none was); else why FH_ROW_KERNELS was refused, e.g.
 * "FH_ROW_KERNELS=avx512, but this CPU lacks AVX-512F/DQ (it has: avx2, portable)". A static string. */
const char *fh_row_kernels_refusal(void);

/* 1 when this CPU and build can run the set called name, else 0 (also for an unknown name or NULL). */
int fh_row_kernels_supported(const char *name);

/* ---- The kernels: one function type each; every set (row_kernels_impl.h) implements each type, and the functions
 * declared with it below run the chosen set's. ---- */

/* z[j] = transform(z[j] + bias[j]) for j < count; bias may be NULL. */
typedef void fh_row_transform_fn(float *z, int64_t count, const float *bias, const fh_transform *tf);
fh_row_transform_fn fh_row_transform;

/* Folds count transformed logits (vocabulary columns first_column..) into state. target_column is
 * relative to the row (outside [0, count) when the target is not in this tile). z is written only with
 * store_exps; then a row of one tile holds exps that fh_row_gradient can use without another exp. */
typedef void fh_row_fold_fn(float *z, int64_t count, int64_t first_column, int64_t target_column,
                            const fh_fold_request *request, fh_fold_state *state);
fh_row_fold_fn fh_row_fold;

/* What gradient filtering notes of a row on the way (filter_row_kernels.h). */
typedef struct fh_row_marking fh_row_marking;

/* Overwrites transformed logits z with dU = (a p + c w + e p (z - sum_pz)) * dz/du + b [j = target] dz/du,
 * p = exp(z - lse) (or from the fold's exps: fh_coef.p_scale); weights may be NULL (all 1). With marking (may be
 * NULL), notes the row for filtering on the way. */
typedef void fh_row_gradient_fn(float *z, int64_t count, int64_t target_column, const float *weights,
                                const fh_coef *coef, const fh_transform *tf, fh_row_marking *marking);
fh_row_gradient_fn fh_row_gradient;

/* ---- Two rows at once: a distillation student's raw logits z and its teacher's cz (bias added, untempered) ----
 * s = inv_t z and t = inv_t cz are the tempered rows, p = softmax(s), q = softmax(t). */
typedef enum fh_pair_divergence {
    FH_PAIR_FORWARD_KL, /* KL(q || p) */
    FH_PAIR_REVERSE_KL, /* KL(p || q) */
    FH_PAIR_JSD         /* beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p, 0 < beta < 1 */
} fh_pair_divergence;

/* One row's constants for the passes after its log-sum-exps are known. */
typedef struct fh_pair_row {
    fh_pair_divergence divergence;
    float inv_t;
    float beta, log_odds;               /* jsd: beta and log(beta / (1 - beta)) */
    float log_beta, log_1m_beta;        /* jsd: log(beta) and log(1 - beta) */
    float lse_s, lse_t, lse_u;          /* log-sum-exps of s, t and the untempered u = z */
    float lse_t_minus_s;                /* lse_t - lse_s, rounded once from their double values */
    float d, k;                         /* the row's divergence; jsd's gradient term sums[1] or sums[2] (below) */
    float g_soft, g_hard;               /* the gradient's weights of dD/ds / T and of softmax(u) - onehot */
    int k_of_softplus;                  /* jsd: k is sums[2], over sp_j, rather than sums[1], over lp_j */
} fh_pair_row;

/* The largest raw logits of both rows (-inf for none; a NaN is ignored unless it is every value). */
typedef void fh_row_pair_max_fn(const float *z, const float *cz, int64_t count, float *max_z, float *max_cz);
fh_row_pair_max_fn fh_row_pair_max;

/* sums[0] += sum_j exp(scale a_j - shift); with b, also sums[1] += sum_j exp(scale a_j - shift) scale (a_j - b_j):
 * a log-sum-exp's sum and a KL's cross term (a the row whose softmax weighs it). */
typedef void fh_row_exp_sums_fn(const float *a, const float *b, int64_t count, float scale, float shift,
                                double sums[2]);
fh_row_exp_sums_fn fh_row_exp_sums;

/* jsd, per column: with delta_j = log q_j - log p_j = inv_t (cz_j - z_j) - lse_t_minus_s, the logs lp_j = log(m_j / p_j)
 * and lq_j = log(m_j / q_j), and the term -(beta q_j lq_j + (1 - beta) p_j lp_j), whose sum is D. Near delta = 0
 * lp = log1p(beta expm1(delta)) and lq = lp - delta carry their own O(delta) size (to a few ulps of delta), so a term
 * is O(p delta^2) with no constant to cancel: D of nearly identical heads (1e-6 per
 * token) comes out to ~1e-11, where summing constant-sized terms against the binary entropy left ~1e-8. Where
 * |delta| >= 1 (expm1 may overflow) lp = log(1 - beta) + softplus(x) and lq = log(beta) + softplus(-x), x =
 * log_odds + delta: exact where p and q barely overlap. sums[0] += sum_j of the terms; sums[1] += sum_j p_j lp_j;
 * sums[2] += sum_j p_j sp_j with sp_j = lp_j - log(1 - beta) (softplus(x) itself where |delta| >= 1). */
typedef void fh_row_jsd_sums_fn(const float *z, const float *cz, int64_t count, const fh_pair_row *r,
                                double sums[3]);
fh_row_jsd_sums_fn fh_row_jsd_sums;

/* Overwrites z with dU = g_soft inv_t dD/ds + g_hard softmax(u) (the caller subtracts g_hard at the target);
 * dD/ds = p - q (forward KL), p (log p - log q - d) (reverse KL), (1 - beta) p (k - lp) = (1 - beta) p (k' - sp) (jsd,
 * lp and sp as fh_row_jsd_sums forms them, k and k' their p-weighted sums). The gradient is a difference of k and a
 * column's value; the row takes the form whose sum is nearer 0, where that difference does not cancel: lp where p
 * and q are close (lp ~ beta delta), sp where they barely overlap (lp ~ log(1 - beta) wherever p is not small). */
typedef void fh_row_pair_gradient_fn(float *z, const float *cz, int64_t count, const fh_pair_row *r);
fh_row_pair_gradient_fn fh_row_pair_gradient;

/* ---- Two softmaxes of one row of raw logits u (a head with a tempered and an untempered term: top-k
 * distillation's tail and cross-entropy) ---- */
typedef struct fh_softmax_pair {
    float scale, shift_a, a; /* a exp(scale u - shift_a) */
    float shift_b, b;        /* + b exp(u - shift_b); b = 0 skips it */
} fh_softmax_pair;

/* Overwrites u with a exp(scale u_j - shift_a) + b exp(u_j - shift_b); scale u - shift_a is rounded twice (the
 * product, then the difference), as the log-probabilities of the pair kernels. */
typedef void fh_row_softmax_pair_fn(float *z, int64_t count, const fh_softmax_pair *r);
fh_row_softmax_pair_fn fh_row_softmax_pair;

/* dst[j] = src[j] rounded to the nearest bf16 (ties to even; NaN stays NaN), for j < count. dst may be src's own
 * memory (a row narrowed in place into its first half). */
typedef void fh_row_to_bf16_fn(const void *src, int64_t count, void *dst);
fh_row_to_bf16_fn fh_row_to_bf16;

/* dst[j] = src[j] (+ dst[j] when accumulate, added in f32) rounded once to bf16, for j < count (through
 * fh_row_to_bf16). */
void fh_row_add_to_bf16(const float *src, int64_t count, int accumulate, uint16_t *dst);

/* The f32 value of bf16 bits (exact). */
static inline float fh_bf16_to_f32(uint16_t bits)
{
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

#endif
