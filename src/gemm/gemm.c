/* Provider dispatch: the one place that knows which library multiplies which element types, and the choice of
 * each type's path. */
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

int64_t fh_gemm_scratch_floats(int64_t tile_elements, fh_gemm_order order)
{
    const int64_t floats = tile_elements < SCRATCH_FLOATS ? tile_elements : SCRATCH_FLOATS;
    const int64_t least =
        order == FH_GEMM_ROW_INVARIANT ? FH_GEMM_INVARIANT_SCRATCH_MIN_FLOATS : FH_GEMM_SCRATCH_MIN_FLOATS;
    return floats > least ? floats : least;
}

/* ---- The paths, chosen once ----
 * Each element type has two paths: the library's own BLIS one (fp32: BLIS sgemm; bf16: convert) and oneDNN's matmul
 * (fp32: onednn; bf16: native). Measured side by side (2 threads unless said):
 * fp32 (oneDNN 2.6.3 brg:avx512_core against BLIS 0.9.0 skx, each product of the CE train step timed in the library,
 * docs/performance.md "The fp32 GEMM"): on an Intel Xeon Cascade Lake (family 6 model 85) oneDNN is 1.08-1.16 times
 * faster on the logits product, 1.8-2.9 times slower on dx = dU W (a long inner dimension) and between 0.83 and 1.06
 * times BLIS's speed on dweight: the train step is no faster. On a 16-core Emerald Rapids (family 6 model 207) BLIS
 * sgemm was level with MKL. So the default is blis on every CPU measured; onednn is there to force and measure.
 * bf16 (fh_bench --dtype bf16 --layout vh, N=1024 H=1024 V=32768, train step): oneDNN 2.6 multiplies bf16 natively
 * with AVX512-BF16 (brg:avx512_core_bf16) or AMX (brg:avx512_core_amx); on AVX-512 without BF16 it emulates them
 * (gemm:jit), and without AVX-512 it has no bf16 matmul.
 *   gemm:jit (Intel Xeon family 6 model 207, ONEDNN_MAX_CPU_ISA=AVX512_CORE): 3361 ms, convert 882 ms;
 *   brg:avx512_core_bf16 on that Intel CPU: 1260-1277 ms, convert 923-939 ms (its VDPBF16PS issues on one port, so
 *   it peaks at fp32 FMA's rate and BLIS sgemm is the better kernel);
 *   brg:avx512_core_bf16 on AMD EPYC Zen 5: a bf16 matmul at about twice sgemm's rate;
 *   AMX: 3.5 times sgemm (16-core Intel Xeon).
 * So the default is native with AMX, and with AVX512-BF16 on AMD; convert everywhere else. */

/* What oneDNN's bf16 matmul needs, as a refusal says it. Debian's oneDNN 2.6 for aarch64 has none (it is built without
 * the Arm Compute Library, docs/aarch64.md). */
#if defined(__x86_64__) || defined(__i386__)
#define NATIVE_NEEDS ", it needs AVX-512"
#else
#define NATIVE_NEEDS ""
#endif

/* One element type's choice: its variable, the names of its BLIS path and of its oneDNN path, and what was chosen
 * (onednn: the oneDNN path). */
typedef struct path_choice {
    pthread_once_t once;
    const char *variable, *own_name, *onednn_name, *type_name, *needs;
    fh_elem_type type;
    int onednn;
    const char *refusal;
    char refusal_text[320];
    char description[352];
} path_choice;

static path_choice fp32_choice = {.once = PTHREAD_ONCE_INIT, .variable = "FH_FP32_GEMM", .own_name = "blis",
                                  .onednn_name = "onednn", .type_name = "fp32", .needs = "", .type = FH_ELEM_F32};
static path_choice bf16_choice = {.once = PTHREAD_ONCE_INIT, .variable = "FH_BF16_GEMM", .own_name = "convert",
                                  .onednn_name = "native", .type_name = "bf16", .needs = NATIVE_NEEDS,
                                  .type = FH_ELEM_BF16};

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

/* Whether oneDNN's matmul of this type runs here (a reference implementation does not count: it is orders of
 * magnitude slower), and whether it is the faster path by the measurements above; *onednn describes it. */
static void onednn_offer(fh_elem_type type, int *available, int *faster, char *onednn, size_t size)
{
#ifdef FH_HAVE_ONEDNN
    const char *implementation = fh_onednn_implementation(type);
    *available = strcmp(implementation, "unavailable") != 0 && strncmp(implementation, "ref", 3) != 0;
    *faster = type == FH_ELEM_BF16 && *available &&
              (strstr(implementation, "amx") || (strstr(implementation, "bf16") && cpu_is_amd()));
    if (*available)
        snprintf(onednn, size, "%s: %s", fh_onednn_version(), implementation);
    else
        snprintf(onednn, size, "%s: no %s matmul on this CPU", fh_onednn_version(), type == FH_ELEM_F32 ? "fp32" : "bf16");
#else
    (void)type;
    *available = *faster = 0;
    snprintf(onednn, size, "no oneDNN in this build");
#endif
}

static void choose(path_choice *c)
{
    const char *forced = getenv(c->variable);
    int available, faster;
    char onednn[96];
    onednn_offer(c->type, &available, &faster, onednn, sizeof onednn);
    if (!forced || !forced[0])
        c->onednn = faster;
    else if (strcmp(forced, c->own_name) == 0)
        c->onednn = 0;
    else if (strcmp(forced, c->onednn_name) == 0 && available)
        c->onednn = 1;
    else {
        if (strcmp(forced, c->onednn_name) == 0)
            snprintf(c->refusal_text, sizeof c->refusal_text,
                     "%s=%s, but there is no oneDNN %s matmul here (%s%s): unset %s or set it to %s", c->variable,
                     forced, c->type_name, onednn, c->needs, c->variable, c->own_name);
        else
            snprintf(c->refusal_text, sizeof c->refusal_text, "%s=%.40s is not one of %s, %s", c->variable, forced,
                     c->onednn_name, c->own_name);
        c->refusal = c->refusal_text;
    }
    if (c->refusal)
        snprintf(c->description, sizeof c->description, "refused (%s)", c->refusal);
    else if (c->onednn)
        snprintf(c->description, sizeof c->description, "%s (%s)", c->onednn_name, onednn);
    else if (c->type == FH_ELEM_F32)
        snprintf(c->description, sizeof c->description, "blis (BLIS sgemm; %s)", onednn);
    else
        snprintf(c->description, sizeof c->description, "convert (bf16 widened to f32, BLIS sgemm; %s)", onednn);
}

static void choose_fp32(void)
{
    choose(&fp32_choice);
}

static void choose_bf16(void)
{
    choose(&bf16_choice);
}

static const path_choice *fp32(void)
{
    pthread_once(&fp32_choice.once, choose_fp32);
    return &fp32_choice;
}

static const path_choice *bf16(void)
{
    pthread_once(&bf16_choice.once, choose_bf16);
    return &bf16_choice;
}

fh_fp32_path fh_gemm_fp32_path(void)
{
    return fp32()->onednn ? FH_FP32_ONEDNN : FH_FP32_BLIS;
}

const char *fh_gemm_fp32_refusal(void)
{
    return fp32()->refusal;
}

const char *fh_gemm_fp32_provider(void)
{
    return fp32()->description;
}

fh_bf16_path fh_gemm_bf16_path(void)
{
    return bf16()->onednn ? FH_BF16_NATIVE : FH_BF16_CONVERT;
}

const char *fh_gemm_bf16_refusal(void)
{
    return bf16()->refusal;
}

const char *fh_gemm_bf16_provider(void)
{
    return bf16()->description;
}

/* ---- Dispatch ---- */
static int both(const fh_gemm_input *a, const fh_gemm_input *b, fh_elem_type type)
{
    return a->type == type && b->type == type;
}

/* Which provider multiplies these operands into c. */
typedef enum provider { BLIS, CONVERT, ONEDNN, NONE } provider;

static provider provider_of(fh_gemm_order order, const fh_gemm_input *a, const fh_gemm_input *b,
                            const fh_gemm_output *c)
{
    const int fastest = order == FH_GEMM_FASTEST;
    if (both(a, b, FH_ELEM_F32))
        return c->type != FH_ELEM_F32 || fh_gemm_fp32_refusal()               ? NONE
               : fastest && fh_gemm_fp32_path() == FH_FP32_ONEDNN ? ONEDNN
                                                                  : BLIS;
    if (!both(a, b, FH_ELEM_BF16) || fh_gemm_bf16_refusal())
        return NONE;
    return fastest && fh_gemm_bf16_path() == FH_BF16_NATIVE ? ONEDNN : CONVERT;
}

fh_status fh_gemm_prepare(fh_gemm_cache **cache, const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m,
                          int64_t n, int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate,
                          const fh_gemm_output *c, int threads)
{
    switch (provider_of(order, a, b, c)) {
    case BLIS:
        return FH_OK;
    case CONVERT:
        return scratch && scratch->data && scratch->floats >= fh_gemm_scratch_floats(0, order) ? FH_OK
                                                                                              : FH_ERR_GEMM_FAILED;
    case ONEDNN: {
#ifdef FH_HAVE_ONEDNN
        const fh_status st = *cache ? FH_OK : fh_onednn_cache_create(cache);
        return st == FH_OK ? fh_onednn_prepare(*cache, m, n, k, a, b, accumulate, c, threads) : st;
#else
        break; /* not reached: without oneDNN no path is oneDNN's */
#endif
    }
    case NONE:
        break;
    }
    (void)cache, (void)m, (void)n, (void)k, (void)accumulate, (void)threads;
    return FH_ERR_INVALID_DTYPE;
}

fh_status fh_gemm(fh_gemm_cache *cache, const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m, int64_t n,
                  int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                  int threads)
{
    switch (provider_of(order, a, b, c)) {
    case BLIS:
        fh_blis_sgemm(m, n, k, a->data, a->row_stride, a->col_stride, b->data, b->row_stride, b->col_stride,
                      accumulate ? 1.0f : 0.0f, c->data, c->row_stride, c->col_stride, threads);
        return FH_OK;
    case CONVERT:
        return fh_convert_gemm(scratch, order, m, n, k, a, b, accumulate, c, threads);
    case ONEDNN:
#ifdef FH_HAVE_ONEDNN
        return cache ? fh_onednn_gemm(cache, m, n, k, a, b, accumulate, c, threads) : FH_ERR_GEMM_FAILED;
#else
        break;
#endif
    case NONE:
        break;
    }
    (void)cache;
    return FH_ERR_INVALID_DTYPE;
}

void fh_gemm_cache_destroy(fh_gemm_cache *cache)
{
#ifdef FH_HAVE_ONEDNN
    fh_onednn_cache_destroy(cache);
#else
    (void)cache;
#endif
}
