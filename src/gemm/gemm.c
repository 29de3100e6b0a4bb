/* Provider dispatch: the one place that knows which library multiplies which element types, and the choice of
 * the bf16 path. */
#include "gemm.h"

#include "blis_provider.h"
#include "convert_provider.h"
#ifdef FH_HAVE_ONEDNN
#include "onednn_provider.h"
#endif

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The convert path's panels at full size (convert_provider.c: up to 2048 x 2048 of A, 2048 x 512 of B and of a
 * staged C), never more than the tile whose products they serve, never less than the minimum. */
#define SCRATCH_FLOATS ((int64_t)6 << 20)

int64_t fh_gemm_scratch_floats(int64_t tile_elements)
{
    const int64_t floats = tile_elements < SCRATCH_FLOATS ? tile_elements : SCRATCH_FLOATS;
    return floats > FH_GEMM_SCRATCH_MIN_FLOATS ? floats : FH_GEMM_SCRATCH_MIN_FLOATS;
}

/* ---- The bf16 path, chosen once ----
 * oneDNN 2.6 multiplies bf16 natively with AVX512-BF16 (brg:avx512_core_bf16) or AMX (brg:avx512_core_amx); on
 * AVX-512 without BF16 it emulates them (gemm:jit), and without AVX-512 it has no bf16 matmul. Measured side by
 * side (README, "CPUs"; fh_bench --dtype bf16 --layout vh, 2 threads, N=1024 H=1024 V=32768, train step):
 *   gemm:jit (Intel Xeon family 6 model 207, ONEDNN_MAX_CPU_ISA=AVX512_CORE): 3361 ms, convert 882 ms;
 *   brg:avx512_core_bf16 on that Intel CPU: 1260-1277 ms, convert 923-939 ms (its VDPBF16PS issues on one port, so
 *   it peaks at fp32 FMA's rate and BLIS sgemm is the better kernel);
 *   brg:avx512_core_bf16 on AMD EPYC Zen 5: a bf16 matmul at about twice sgemm's rate;
 *   AMX: 3.5 times sgemm (16-core Intel Xeon).
 * So the default is native with AMX, and with AVX512-BF16 on AMD; convert everywhere else. */
static pthread_once_t path_once = PTHREAD_ONCE_INIT;
/* What oneDNN's bf16 matmul needs, as a refusal says it. Debian's oneDNN 2.6 for aarch64 has none (it is built without
 * the Arm Compute Library, docs/aarch64.md). */
#if defined(__x86_64__) || defined(__i386__)
#define NATIVE_NEEDS ", it needs AVX-512"
#else
#define NATIVE_NEEDS ""
#endif
static fh_bf16_path path = FH_BF16_CONVERT;
static const char *refusal;
static char refusal_text[320];
static char description[352];

#ifdef FH_HAVE_ONEDNN
static int cpu_is_amd(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
#else
    return 0;
#endif
}
#endif

static void choose_path(void)
{
    const char *forced = getenv("FH_BF16_GEMM");
#ifdef FH_HAVE_ONEDNN
    const char *implementation = fh_onednn_implementation();
    const int available = strcmp(implementation, "unavailable") != 0;
    const int faster_native = strstr(implementation, "amx") || (strstr(implementation, "bf16") && cpu_is_amd());
    char onednn[96];
    if (available)
        snprintf(onednn, sizeof onednn, "%s: %s", fh_onednn_version(), implementation);
    else
        snprintf(onednn, sizeof onednn, "%s: no bf16 matmul on this CPU", fh_onednn_version());
#else
    const int available = 0, faster_native = 0;
    const char *onednn = "no oneDNN in this build";
#endif
    if (!forced || !forced[0])
        path = faster_native ? FH_BF16_NATIVE : FH_BF16_CONVERT;
    else if (strcmp(forced, "convert") == 0)
        path = FH_BF16_CONVERT;
    else if (strcmp(forced, "native") == 0 && available)
        path = FH_BF16_NATIVE;
    else {
        if (strcmp(forced, "native") == 0)
            snprintf(refusal_text, sizeof refusal_text,
                     "FH_BF16_GEMM=native, but there is no native bf16 GEMM here (%s%s): unset "
                     "FH_BF16_GEMM or set it to convert", onednn, NATIVE_NEEDS);
        else
            snprintf(refusal_text, sizeof refusal_text, "FH_BF16_GEMM=%.40s is not one of native, convert", forced);
        refusal = refusal_text;
    }
    if (refusal)
        snprintf(description, sizeof description, "refused (%s)", refusal);
    else if (path == FH_BF16_NATIVE)
        snprintf(description, sizeof description, "native (%s)", onednn);
    else
        snprintf(description, sizeof description, "convert (bf16 widened to f32, BLIS sgemm; %s)", onednn);
}

fh_bf16_path fh_gemm_bf16_path(void)
{
    pthread_once(&path_once, choose_path);
    return path;
}

const char *fh_gemm_bf16_refusal(void)
{
    pthread_once(&path_once, choose_path);
    return refusal;
}

const char *fh_gemm_bf16_provider(void)
{
    pthread_once(&path_once, choose_path);
    return description;
}

/* ---- Dispatch ---- */
static int both(const fh_gemm_input *a, const fh_gemm_input *b, fh_elem_type type)
{
    return a->type == type && b->type == type;
}

fh_status fh_gemm_prepare(fh_gemm_cache **cache, const fh_gemm_scratch *scratch, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                          int threads)
{
    if (both(a, b, FH_ELEM_F32))
        return c->type == FH_ELEM_F32 ? FH_OK : FH_ERR_INVALID_DTYPE;
    if (!both(a, b, FH_ELEM_BF16) || fh_gemm_bf16_refusal())
        return FH_ERR_INVALID_DTYPE;
    if (fh_gemm_bf16_path() == FH_BF16_CONVERT)
        return scratch && scratch->data && scratch->floats >= FH_GEMM_SCRATCH_MIN_FLOATS ? FH_OK : FH_ERR_GEMM_FAILED;
#ifdef FH_HAVE_ONEDNN
    const fh_status st = *cache ? FH_OK : fh_onednn_cache_create(cache);
    return st == FH_OK ? fh_onednn_prepare(*cache, m, n, k, a, b, accumulate, c, threads) : st;
#else
    (void)cache, (void)m, (void)n, (void)k, (void)accumulate, (void)threads;
    return FH_ERR_INVALID_DTYPE; /* not reached: without oneDNN the path is convert */
#endif
}

fh_status fh_gemm(fh_gemm_cache *cache, const fh_gemm_scratch *scratch, int64_t m, int64_t n, int64_t k,
                  const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                  int threads)
{
    if (both(a, b, FH_ELEM_F32) && c->type == FH_ELEM_F32) {
        fh_blis_sgemm(m, n, k, a->data, a->row_stride, a->col_stride, b->data, b->row_stride, b->col_stride,
                      accumulate ? 1.0f : 0.0f, c->data, c->row_stride, c->col_stride, threads);
        return FH_OK;
    }
    if (!both(a, b, FH_ELEM_BF16) || fh_gemm_bf16_refusal())
        return FH_ERR_INVALID_DTYPE;
    if (fh_gemm_bf16_path() == FH_BF16_CONVERT)
        return fh_convert_gemm(scratch, m, n, k, a, b, accumulate, c, threads);
#ifdef FH_HAVE_ONEDNN
    return cache ? fh_onednn_gemm(cache, m, n, k, a, b, accumulate, c, threads) : FH_ERR_GEMM_FAILED;
#else
    (void)cache;
    return FH_ERR_INVALID_DTYPE;
#endif
}

void fh_gemm_cache_destroy(fh_gemm_cache *cache)
{
#ifdef FH_HAVE_ONEDNN
    fh_onednn_cache_destroy(cache);
#else
    (void)cache;
#endif
}
