#include "materialized.h"

#include "bench_gemm.h"
#include "bf16.h"

#include <math.h>
#include <stdlib.h>

int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab, int bf16, int distill)
{
    const size_t count = (size_t)n * (size_t)vocab;
    b->bf16 = bf16;
    b->logits = malloc(count * sizeof(float));
    b->teacher_logits = distill ? malloc(count * sizeof(float)) : NULL;
    b->dlogits = distill && !bf16 ? NULL : malloc(count * (bf16 ? sizeof(uint16_t) : sizeof(float)));
    if (!b->logits || (distill && !b->teacher_logits) || ((!distill || bf16) && !b->dlogits)) {
        materialized_free(b);
        return -1;
    }
    return 0;
}

void materialized_free(materialized_buffers *b)
{
    free(b->logits);
    free(b->teacher_logits);
    free(b->dlogits);
    b->logits = b->teacher_logits = NULL;
    b->dlogits = NULL;
}

double materialized_train_step(const materialized_buffers *b, int64_t n, int64_t hidden, int64_t vocab,
                               const void *x, const void *w, int64_t w_stride_hidden, int64_t w_stride_vocab,
                               const int64_t *targets, float *dx, float *dw, int threads)
{
    const int64_t sh = w_stride_hidden, sv = w_stride_vocab;
    if (bench_gemm(b->bf16, n, vocab, hidden, x, hidden, 1, w, sh, sv, b->logits, vocab, 1, threads) != 0)
        return NAN;
    double loss = 0.0;
    int64_t counted = 0;
    for (int64_t i = 0; i < n; i++)
        counted += targets[i] != MATERIALIZED_IGNORE_INDEX;
    const float inv_n = counted ? 1.0f / (float)counted : 0.0f;
#pragma omp parallel for num_threads(threads) reduction(+ : loss) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *z = b->logits + i * vocab;
        /* bf16: the gradient overwrites the logits row, then is rounded into dlogits. */
        float *dz = b->bf16 ? z : (float *)b->dlogits + i * vocab;
        if (targets[i] == MATERIALIZED_IGNORE_INDEX) { /* as torch: the row is computed, its gradient is 0 */
            for (int64_t j = 0; j < vocab; j++)
                dz[j] = 0.0f;
            for (int64_t j = 0; b->bf16 && j < vocab; j++)
                ((uint16_t *)b->dlogits)[i * vocab + j] = 0;
            continue;
        }
        float m = -INFINITY;
        for (int64_t j = 0; j < vocab; j++)
            m = z[j] > m ? z[j] : m;
        double s = 0.0;
        for (int64_t j = 0; j < vocab; j++)
            s += expf(z[j] - m);
        const double lse = m + log(s);
        loss += lse - z[targets[i]];
        for (int64_t j = 0; j < vocab; j++)
            dz[j] = expf((float)(z[j] - lse)) * inv_n;
        dz[targets[i]] -= inv_n;
        for (int64_t j = 0; b->bf16 && j < vocab; j++)
            ((uint16_t *)b->dlogits)[i * vocab + j] = bf16_from_float(dz[j]);
    }
    if (bench_gemm(b->bf16, n, hidden, vocab, b->dlogits, vocab, 1, w, sv, sh, dx, hidden, 1, threads) != 0 ||
        bench_gemm(b->bf16, hidden, vocab, n, x, 1, hidden, b->dlogits, vocab, 1, dw, sh, sv, threads) != 0)
        return NAN;
    return counted ? loss / (double)counted : 0.0;
}

/* The logits z [n, vocab] = x W of a linear (no bias), into an fp32 buffer. Returns 0, or -1 when the GEMM fails. */
static int logits_of(const fh_linear *lin, int bf16, float *z, int threads)
{
    return bench_gemm(bf16, lin->n, lin->vocab, lin->hidden, lin->x, lin->x_row_stride, 1, lin->weight,
                      lin->w_stride_hidden, lin->w_stride_vocab, z, lin->vocab, 1, threads);
}

/* log-sum-exp of scale z over a row: fp32 exps of (scale z_j - max) summed in double. */
static double row_lse(const float *z, int64_t vocab, float scale)
{
    float m = -INFINITY;
    for (int64_t j = 0; j < vocab; j++)
        m = fmaxf(m, z[j] * scale);
    double s = 0.0;
    for (int64_t j = 0; j < vocab; j++)
        s += expf(z[j] * scale - m);
    return m + log(s);
}

/* log m = log(beta q + (1 - beta) p) from ls = log p and lt = log q, as a log-add-exp. */
static float log_mixture(float ls, float lt, float log_beta, float log_1m_beta)
{
    const float a = log_1m_beta + ls, b = log_beta + lt;
    return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
}

/* The baseline holds 2 N V floats, both heads' logits, and with bf16 inputs N V bf16 for dU's copy: dU overwrites
 * the student's logits row by row once that row's loss is known. Per row: the log-sum-exps (double sums of fp32
 * exps), the divergence D (and jsd's K = sum_j p_j (log p_j - log m_j)), then dU in place. */
double materialized_distill_train_step(const materialized_buffers *b, const fh_linear *student,
                                       const fh_linear *teacher, const int64_t *targets,
                                       const fh_distill_options *o, float *dx, float *dw, int threads)
{
    const int64_t n = student->n, vocab = student->vocab;
    if (student->bias || teacher->bias || logits_of(student, b->bf16, b->logits, threads) != 0 ||
        logits_of(teacher, b->bf16, b->teacher_logits, threads) != 0)
        return NAN;
    /* jsd with beta 0 is the forward KL and with beta 1 the reverse KL (fusedhead.h). */
    fh_divergence divergence = o->divergence;
    if (divergence == FH_DIVERGENCE_JSD && o->beta == 0.0)
        divergence = FH_DIVERGENCE_FORWARD_KL;
    else if (divergence == FH_DIVERGENCE_JSD && o->beta == 1.0)
        divergence = FH_DIVERGENCE_REVERSE_KL;
    const int hard = o->weight_hard_loss != 0.0;
    const float it = (float)(1.0 / o->temperature), beta = (float)o->beta;
    const float log_beta = (float)log(o->beta), log_1m_beta = (float)log1p(-o->beta);
    double count = 0.0;
    for (int64_t i = 0; i < n; i++)
        count += !targets || targets[i] != o->ignore_index;
    const double inv_count = count > 0.0 ? 1.0 / count : 0.0;
    double soft = 0.0, hard_sum = 0.0;
#pragma omp parallel for num_threads(threads) reduction(+ : soft, hard_sum) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *z = b->logits + i * vocab;
        const float *cz = b->teacher_logits + i * vocab;
        const int64_t target = targets && targets[i] != o->ignore_index ? targets[i] : -1;
        const int counted = !targets || target >= 0;
        const float lse_s = (float)row_lse(z, vocab, it), lse_t = (float)row_lse(cz, vocab, it);
        const float lse_u = !hard ? 0.0f : it == 1.0f ? lse_s : (float)row_lse(z, vocab, 1.0f);
        double d = 0.0, k = 0.0;
        for (int64_t j = 0; j < vocab; j++) {
            const float ls = z[j] * it - lse_s, lt = cz[j] * it - lse_t;
            if (divergence == FH_DIVERGENCE_FORWARD_KL)
                d += (double)expf(lt) * ((double)lt - ls);
            else if (divergence == FH_DIVERGENCE_REVERSE_KL)
                d += (double)expf(ls) * ((double)ls - lt);
            else {
                const float p = expf(ls), q = expf(lt), lm = log_mixture(ls, lt, log_beta, log_1m_beta);
                const double kp = (double)p * (ls - lm);
                d += (double)beta * q * (lt - lm) + (1.0 - beta) * kp;
                k += kp;
            }
        }
        const double ce = hard && target >= 0 ? (double)lse_u - z[target] : 0.0;
        if (counted) {
            soft += d;
            hard_sum += ce;
        }
        /* dU = coef (weight_soft dD/ds / temperature + weight_hard (softmax(u) - onehot(target))). */
        const double coef = counted ? inv_count : 0.0;
        const float g_soft = (float)(coef * o->weight_soft_loss * it), g_hard = (float)(coef * o->weight_hard_loss);
        const float dd = (float)d, kk = (float)k;
        for (int64_t j = 0; j < vocab; j++) {
            const float ls = z[j] * it - lse_s, lt = cz[j] * it - lse_t, p = expf(ls);
            float ds;
            if (divergence == FH_DIVERGENCE_FORWARD_KL)
                ds = p - expf(lt);
            else if (divergence == FH_DIVERGENCE_REVERSE_KL)
                ds = p * (ls - lt - dd);
            else
                ds = (1.0f - beta) * p * (ls - log_mixture(ls, lt, log_beta, log_1m_beta) - kk);
            z[j] = g_soft * ds + (hard ? g_hard * expf(z[j] - lse_u) : 0.0f);
        }
        if (hard && target >= 0)
            z[target] -= g_hard;
        for (int64_t j = 0; b->bf16 && j < vocab; j++)
            ((uint16_t *)b->dlogits)[i * vocab + j] = bf16_from_float(z[j]);
    }
    const void *du = b->bf16 ? b->dlogits : (const void *)b->logits;
    const int64_t hs = student->hidden, sh = student->w_stride_hidden, sv = student->w_stride_vocab;
    if (bench_gemm(b->bf16, n, hs, vocab, du, vocab, 1, student->weight, sv, sh, dx, hs, 1, threads) != 0 ||
        bench_gemm(b->bf16, hs, vocab, n, student->x, 1, student->x_row_stride, du, vocab, 1, dw, sh, sv, threads) != 0)
        return NAN;
    return (o->weight_soft_loss * soft + o->weight_hard_loss * hard_sum) * inv_count;
}
