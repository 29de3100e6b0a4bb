#include "bench_gemm.h"

#include "bf16.h"

#include <blis.h>
#include <fusedhead.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#ifdef FH_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

static void sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                  int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    float one = 1.0f, zero = 0.0f;
    rntm_t rntm = BLIS_RNTM_INITIALIZER;
    bli_rntm_set_num_threads(threads, &rntm);
    bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &one, (float *)a, rsa, csa, (float *)b, rsb, csb,
                 &zero, c, rsc, csc, NULL, &rntm);
}

#ifdef FH_HAVE_ONEDNN
/* One primitive per call: building it costs milliseconds, against the seconds the benchmark's GEMMs take. A
 * column-major C runs as C^T = B^T A^T (oneDNN 2.6 has no fast kernel for it), as the library does. */
static int onednn_matmul(int bf16, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa,
                         const void *b, int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    if (rsc < csc && m > 1)
        return onednn_matmul(bf16, n, m, k, b, csb, rsb, a, csa, rsa, c, csc, rsc, threads);
    static dnnl_engine_t engine;
    static dnnl_stream_t stream;
    if (!engine && (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success ||
                    dnnl_stream_create(&stream, engine, dnnl_stream_default_flags) != dnnl_success))
        return -1;
    const dnnl_dims_t dims[3] = {{m, k}, {k, n}, {m, n}}, strides[3] = {{rsa, csa}, {rsb, csb}, {rsc, csc}};
    const dnnl_data_type_t operands = bf16 ? dnnl_bf16 : dnnl_f32, types[3] = {operands, operands, dnnl_f32};
    void *const data[3] = {(void *)a, (void *)b, c};
    const int args[3] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
    dnnl_memory_desc_t md[3];
    dnnl_memory_t mem[3] = {NULL, NULL, NULL};
    dnnl_exec_arg_t exec[3];
    int ok = 1;
    for (int o = 0; o < 3; o++) {
        ok = ok && dnnl_memory_desc_init_by_strides(&md[o], 2, dims[o], types[o], strides[o]) == dnnl_success &&
             dnnl_memory_create(&mem[o], &md[o], engine, data[o]) == dnnl_success;
        exec[o].arg = args[o];
        exec[o].memory = mem[o];
    }
    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t primitive = NULL;
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    ok = ok && dnnl_matmul_desc_init(&desc, &md[0], &md[1], NULL, &md[2]) == dnnl_success &&
         dnnl_primitive_desc_create(&pd, &desc, NULL, engine, NULL) == dnnl_success &&
         dnnl_primitive_create(&primitive, pd) == dnnl_success &&
         dnnl_primitive_execute(primitive, stream, 3, exec) == dnnl_success && dnnl_stream_wait(stream) == dnnl_success;
    omp_set_num_threads(saved);
    if (primitive)
        dnnl_primitive_destroy(primitive);
    if (pd)
        dnnl_primitive_desc_destroy(pd);
    for (int o = 0; o < 3; o++)
        if (mem[o])
            dnnl_memory_destroy(mem[o]);
    return ok ? 0 : -1;
}
#endif

/* The convert path's way, done plainly: both operands widened whole to f32 (exact), then sgemm. */
static int widened_sgemm(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t rsa, int64_t csa,
                         const uint16_t *b, int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    float *a32 = malloc((size_t)(m * k) * sizeof(float)), *b32 = malloc((size_t)(k * n) * sizeof(float));
    if (!a32 || !b32) {
        free(a32);
        free(b32);
        return -1;
    }
#pragma omp parallel for num_threads(threads)
    for (int64_t i = 0; i < m; i++)
        for (int64_t p = 0; p < k; p++)
            a32[i * k + p] = bf16_to_float(a[i * rsa + p * csa]);
#pragma omp parallel for num_threads(threads)
    for (int64_t p = 0; p < k; p++)
        for (int64_t j = 0; j < n; j++)
            b32[p * n + j] = bf16_to_float(b[p * rsb + j * csb]);
    sgemm(m, n, k, a32, k, 1, b32, n, 1, c, rsc, csc, threads);
    free(a32);
    free(b32);
    return 0;
}

int bench_gemm_on(bench_provider provider, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa,
                  const void *b, int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    switch (provider) {
    case BENCH_BLIS:
        sgemm(m, n, k, a, rsa, csa, b, rsb, csb, c, rsc, csc, threads);
        return 0;
    case BENCH_WIDENED:
        return widened_sgemm(m, n, k, a, rsa, csa, b, rsb, csb, c, rsc, csc, threads);
    case BENCH_ONEDNN_F32:
    case BENCH_ONEDNN_BF16:
#ifdef FH_HAVE_ONEDNN
        return onednn_matmul(provider == BENCH_ONEDNN_BF16, m, n, k, a, rsa, csa, b, rsb, csb, c, rsc, csc, threads);
#else
        return -1;
#endif
    }
    return -1;
}

int bench_library_provider(int bf16, bench_provider *provider)
{
    fh_kernel_info info;
    if (fh_kernel_query(&info) != FH_OK || strcmp(bf16 ? info.bf16_path : info.fp32_path, "refused") == 0)
        return -1;
    if (bf16)
        *provider = strcmp(info.bf16_path, "convert") == 0 ? BENCH_WIDENED : BENCH_ONEDNN_BF16;
    else
        *provider = strcmp(info.fp32_path, "blis") == 0 ? BENCH_BLIS : BENCH_ONEDNN_F32;
    return 0;
}

int bench_gemm(int bf16, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
               int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads)
{
    bench_provider provider;
    if (bench_library_provider(bf16, &provider) != 0)
        return -1;
    return bench_gemm_on(provider, m, n, k, a, rsa, csa, b, rsb, csb, c, rsc, csc, threads);
}
