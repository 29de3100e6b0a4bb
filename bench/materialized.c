#include "materialized.h"

#include <blis.h>
#include <math.h>
#include <stdlib.h>

int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab)
{
    const size_t bytes = (size_t)n * (size_t)vocab * sizeof(float);
    b->logits = malloc(bytes);
    b->dlogits = malloc(bytes);
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
    b->logits = b->dlogits = NULL;
}

static void gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                 int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    float one = 1.0f, zero = 0.0f;
    rntm_t rntm = BLIS_RNTM_INITIALIZER;
    bli_rntm_set_num_threads(threads, &rntm);
    bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &one, (float *)a, rsa, csa, (float *)b, rsb, csb,
                 &zero, c, rsc, csc, NULL, &rntm);
}

double materialized_train_step(const materialized_buffers *b, int64_t n, int64_t hidden, int64_t vocab,
                               const float *x, const float *w, int64_t w_stride_hidden, int64_t w_stride_vocab,
                               const int64_t *targets, float *dx, float *dw, int threads)
{
    const int64_t sh = w_stride_hidden, sv = w_stride_vocab;
    gemm(n, vocab, hidden, x, hidden, 1, w, sh, sv, b->logits, vocab, 1, threads);
    double loss = 0.0;
    const float inv_n = 1.0f / (float)n;
#pragma omp parallel for num_threads(threads) reduction(+ : loss) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *z = b->logits + i * vocab;
        float *dz = b->dlogits + i * vocab;
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
    }
    gemm(n, hidden, vocab, b->dlogits, vocab, 1, w, sv, sh, dx, hidden, 1, threads);
    gemm(hidden, vocab, n, x, 1, hidden, b->dlogits, vocab, 1, dw, sh, sv, threads);
    return loss / (double)n;
}
