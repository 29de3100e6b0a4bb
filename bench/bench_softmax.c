#include "bench_softmax.h"

#include "bench_gemm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { SAMPLE_ROWS = 128 };

/* The fp32 logits [rows, V] of up to SAMPLE_ROWS rows spread evenly over the batch, from row 0 or (half_offset)
 * from half their spacing; NULL when memory runs out. */
static float *sample_logits(const bench_inputs *in, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab,
                            int threads, int half_offset, int64_t *rows)
{
    *rows = n < SAMPLE_ROWS ? n : SAMPLE_ROWS;
    const int64_t spacing = n / *rows, first = half_offset ? spacing / 2 : 0;
    float *z = malloc((size_t)*rows * vocab * sizeof(float));
    const int vh = layout == FH_LAYOUT_VH;
    if (z && bench_gemm(0, *rows, vocab, hidden, in->x + first * hidden, spacing * hidden, 1, in->w, vh ? 1 : vocab,
                        vh ? hidden : 1, z, vocab, 1, threads) != 0) {
        free(z);
        z = NULL;
    }
    return z;
}

/* The statistics of softmax(tau z) over rows of logits z [rows, V], in double. With m the row's largest logit,
 * s = sum exp(tau (z_j - m)) and q_j = tau (z_j - m): ln p_j = q_j - ln s, and the entropy is
 * ln s - sum e^q_j q_j / s. */
static void softmax_stats(const float *z, int64_t rows, int64_t vocab, double tau, bench_softmax_stats *st)
{
    const double log_2m12 = -12.0 * log(2.0), log_2m28 = -28.0 * log(2.0);
    double entropy = 0.0;
    int64_t below_2m12 = 0, below_2m28 = 0;
    for (int64_t i = 0; i < rows; i++) {
        const float *row = z + i * vocab;
        float m = row[0];
        for (int64_t j = 1; j < vocab; j++)
            m = row[j] > m ? row[j] : m;
        double s = 0.0, sq = 0.0;
        for (int64_t j = 0; j < vocab; j++) {
            const double q = tau * ((double)row[j] - m), e = exp(q);
            s += e;
            sq += e * q;
        }
        const double log_s = log(s);
        entropy += log_s - sq / s;
        for (int64_t j = 0; j < vocab; j++) {
            const double log_p = tau * ((double)row[j] - m) - log_s;
            below_2m12 += log_p < log_2m12;
            below_2m28 += log_p < log_2m28;
        }
    }
    const double entries = (double)rows * (double)vocab;
    *st = (bench_softmax_stats){rows, entropy / (double)rows, (double)below_2m12 / entries,
                                (double)below_2m28 / entries};
}

static double mean_entropy(const float *z, int64_t rows, int64_t vocab, double tau)
{
    bench_softmax_stats st;
    softmax_stats(z, rows, vocab, tau, &st);
    return st.mean_entropy;
}

int bench_peaked_calibrate(bench_distribution *d, bench_inputs *in, fh_layout layout, int64_t n, int64_t hidden,
                           int64_t vocab, int threads, char *why, size_t why_size)
{
    if (d->entropy >= log((double)vocab)) {
        snprintf(why, why_size, "peaked:%g: a softmax over V = %lld tokens has entropy below ln V = %.3f nats",
                 d->entropy, (long long)vocab, log((double)vocab));
        return -1;
    }
    int64_t rows;
    float *z = sample_logits(in, layout, n, hidden, vocab, threads, 0, &rows);
    if (!z) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    /* The entropy falls monotonically as the scale grows (its derivative is -scale Var_p(z)): bracket, then bisect
     * to a relative 1e-4 of the scale (far below the sample's own error). 2^20 bounds the bracket: beyond it float
     * logits overflow anyway. */
    double lo = 0.0, hi = 1.0;
    while (hi < 0x1p20 && mean_entropy(z, rows, vocab, hi) > d->entropy)
        lo = hi, hi *= 2.0;
    const int reached = mean_entropy(z, rows, vocab, hi) <= d->entropy;
    while (reached && hi - lo > 1e-4 * hi) {
        const double mid = 0.5 * (lo + hi);
        if (mean_entropy(z, rows, vocab, mid) > d->entropy)
            lo = mid;
        else
            hi = mid;
    }
    free(z);
    if (!reached) {
        snprintf(why, why_size, "peaked:%g: no scale up to 2^20 brings the mean entropy that low", d->entropy);
        return -1;
    }
    d->scale = (float)(0.5 * (lo + hi));
    for (size_t i = 0; i < (size_t)n * hidden; i++)
        in->x[i] *= d->scale;
    return 0;
}

int bench_softmax_measure(const bench_inputs *in, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab,
                          int threads, bench_softmax_stats *stats)
{
    int64_t rows;
    float *z = sample_logits(in, layout, n, hidden, vocab, threads, 1, &rows);
    if (!z)
        return -1;
    softmax_stats(z, rows, vocab, 1.0, stats);
    free(z);
    return 0;
}
