#include "materialized.h"

#include "bench_gemm.h"
#include "bf16.h"

#include <math.h>
#include <stdlib.h>

int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab, int bf16)
{
    const size_t count = (size_t)n * (size_t)vocab;
    b->bf16 = bf16;
    b->logits = malloc(count * sizeof(float));
    b->dlogits = malloc(count * (bf16 ? sizeof(uint16_t) : sizeof(float)));
    if (!b->logits || !b->dlogits) {
        materialized_free(b);
        return -1;
    }
    return 0;
}

void materialized_free(materialized_buffers *b)
{
    free(b->logits);
    free(b->dlogits);
    b->logits = NULL;
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
    const float inv_n = 1.0f / (float)n;
#pragma omp parallel for num_threads(threads) reduction(+ : loss) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *z = b->logits + i * vocab;
        /* bf16: the gradient overwrites the logits row, then is rounded into dlogits. */
        float *dz = b->bf16 ? z : (float *)b->dlogits + i * vocab;
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
    return loss / (double)n;
}
