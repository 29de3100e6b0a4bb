/* The kernels a process runs: the row-kernel set and the fp32 and bf16 GEMM paths chosen from the CPU, or forced by
 * FH_ROW_KERNELS / FH_FP32_GEMM / FH_BF16_GEMM; a forced choice this CPU lacks, or an unknown name, refused by every
 * call that needs it with FH_ERR_KERNELS_UNAVAILABLE and the reason, its outputs untouched. The expectations are
 * derived here from the CPU's flags and the environment (ctest runs this suite under several environments,
 * tests/CMakeLists.txt), including ONEDNN_MAX_CPU_ISA, through which oneDNN sees the support of a lesser CPU. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cpu_has(const char *set)
{
    __builtin_cpu_init();
    if (strcmp(set, "portable") == 0)
        return 1;
    if (strcmp(set, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(set, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return 0;
}

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && v[0] ? v : NULL;
}

/* The row kernels expected, or NULL when FH_ROW_KERNELS must be refused. */
static const char *expected_row_kernels(void)
{
    const char *forced = env("FH_ROW_KERNELS");
    if (forced)
        return cpu_has(forced) ? forced : NULL;
    return cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "portable";
}

/* Whether oneDNN sees AVX-512 (avx512_core) here, within ONEDNN_MAX_CPU_ISA's limit. */
static int onednn_avx512_core(void)
{
    const char *limit = env("ONEDNN_MAX_CPU_ISA");
    const int below_avx512 = limit && (strcmp(limit, "AVX2") == 0 || strncmp(limit, "SSE", 3) == 0 ||
                                       strcmp(limit, "AVX") == 0 || strcmp(limit, "AVX2_VNNI") == 0);
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && !below_avx512;
}

/* What oneDNN 2.6 offers for a bf16 matmul here: 0 nothing (it needs AVX-512), 1 an emulation (gemm:jit) or bf16
 * dot products that run no faster than BLIS sgemm (AVX512-BF16 on Intel), 2 faster dot products (AMX, AVX512-BF16
 * on AMD), within ONEDNN_MAX_CPU_ISA's limit (src/gemm/gemm.c has the measurements). */
static int onednn_bf16(void)
{
    const char *limit = env("ONEDNN_MAX_CPU_ISA");
    const int below_bf16 = limit && (strcmp(limit, "AVX512_CORE") == 0 || strcmp(limit, "AVX512_CORE_VNNI") == 0);
    if (!onednn_avx512_core())
        return 0;
    const int dot = (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_is("amd")) ||
                    __builtin_cpu_supports("amx-bf16");
    return dot && !below_bf16 ? 2 : 1;
}

/* The bf16 path expected, or NULL when FH_BF16_GEMM must be refused. */
static const char *expected_bf16_path(void)
{
    const char *forced = env("FH_BF16_GEMM");
    if (!forced)
        return onednn_bf16() == 2 ? "native" : "convert";
    if (strcmp(forced, "convert") == 0)
        return "convert";
    return strcmp(forced, "native") == 0 && onednn_bf16() > 0 ? "native" : NULL;
}

/* The fp32 path expected, or NULL when FH_FP32_GEMM must be refused. Debian's oneDNN 2.6 has an f32 matmul on every
 * CPU here (brgemm with AVX-512, gemm:jit below it and on aarch64); BLIS is the default everywhere (src/gemm/gemm.c
 * has the measurements). */
static const char *expected_fp32_path(void)
{
    const char *forced = env("FH_FP32_GEMM");
    if (!forced)
        return "blis";
    return strcmp(forced, "blis") == 0 || strcmp(forced, "onednn") == 0 ? forced : NULL;
}

/* A GEMM path as fh_kernel_query reports it (in_use, described by gemm) against the one expected (NULL: variable's
 * value refused, and the refusal says so). */
static void check_path(const char *type, const char *in_use, const char *gemm, const char *expected,
                       const char *variable, const char *refusal)
{
    TU_CHECK(strcmp(in_use, expected ? expected : "refused") == 0, "%s path %s, expected %s (%s)", type, in_use,
             expected ? expected : "refused", gemm);
    TU_CHECK(strncmp(gemm, in_use, strlen(in_use)) == 0, "%s GEMM '%s' does not start with its path %s", type, gemm,
             in_use);
    if (!expected)
        TU_CHECK(refusal && strstr(refusal, variable), "%s=%s: refusal '%s'", variable, env(variable),
                 refusal ? refusal : "(none)");
}

static void test_choice_follows_cpu_and_environment(void)
{
    fh_kernel_info info;
    TU_CHECK(fh_kernel_query(&info) == FH_OK, "fh_kernel_query");
    const char *rows = expected_row_kernels(), *path = expected_bf16_path(), *fp32 = expected_fp32_path();
    if (rows)
        TU_CHECK(strcmp(info.elementwise, rows) == 0, "row kernels %s, expected %s", info.elementwise, rows);
    else
        TU_CHECK(strcmp(info.elementwise, "portable") == 0 && info.refusal && strstr(info.refusal, "FH_ROW_KERNELS"),
                 "FH_ROW_KERNELS=%s on this CPU: row kernels %s, refusal '%s'", env("FH_ROW_KERNELS"),
                 info.elementwise, info.refusal ? info.refusal : "(none)");
    check_path("bf16", info.bf16_path, info.bf16_gemm, path, "FH_BF16_GEMM", info.refusal);
    check_path("fp32", info.fp32_path, info.fp32_gemm, fp32, "FH_FP32_GEMM", info.refusal);
    if (rows && path && fp32)
        TU_CHECK(info.refusal == NULL, "nothing refused, yet: %s", info.refusal);
}

enum { N = 5, H = 16, V = 300 };

/* A CE train step in fp32 or bf16 (the same values): the status, with its message; the outputs canary-filled
 * before, and whether they still are after. */
static fh_status train_step(int bf16, char *message, size_t capacity, int *untouched)
{
    static float x[N * H], w[V * H];
    static uint16_t xb[N * H], wb[V * H];
    static float dx[N * H], dw[V * H];
    uint64_t rng = 7;
    tu_fill_uniform(x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(w, V * H, &rng, -1.0, 1.0);
    /* Truncated to bf16: the fp32 call gets other values, which does not matter here. */
    for (int i = 0; i < N * H + V * H; i++) {
        const float f = i < N * H ? x[i] : w[i - N * H];
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        *(i < N * H ? &xb[i] : &wb[i - N * H]) = (uint16_t)(bits >> 16);
    }
    const int64_t targets[N] = {0, 17, 299, 3, 150};
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, bf16 ? (const void *)xb : x, bf16 ? (const void *)wb : w, FH_LAYOUT_VH, NULL);
    lin.x_dtype = lin.weight_dtype = bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    fh_ce_options opt;
    fh_ce_options_init(&opt);
    double loss;
    tu_fill_canary(&loss, sizeof loss);
    tu_fill_canary(dx, sizeof dx);
    tu_fill_canary(dw, sizeof dw);
    const float grad_loss = 1.0f;
    fh_ce_outputs out = {.loss = &loss};
    fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw};
    const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &opt, &grad_loss, &out, &g);
    const char *why = "";
    fh_context_message(ctx, &why);
    snprintf(message, capacity, "%s", why);
    double canary;
    tu_fill_canary(&canary, sizeof canary);
    float canary_f;
    tu_fill_canary(&canary_f, sizeof canary_f);
    *untouched = memcmp(&loss, &canary, sizeof loss) == 0 && tu_all_equal_f(dx, N * H, canary_f) &&
                 tu_all_equal_f(dw, V * H, canary_f);
    fh_context_destroy(ctx);
    return st;
}

static void test_refused_choice_refuses_calls(void)
{
    fh_kernel_info info;
    TU_CHECK(fh_kernel_query(&info) == FH_OK, "fh_kernel_query");
    const int rows_refused = expected_row_kernels() == NULL, path_refused = expected_bf16_path() == NULL;
    /* A refused fp32 path refuses every call: bf16 calls multiply in f32 too (--fp32-du, a companion's products). */
    const int fp32_refused = expected_fp32_path() == NULL;
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        char message[256];
        int untouched;
        const fh_status st = train_step(bf16, message, sizeof message, &untouched);
        const char *dtype = bf16 ? "bf16" : "fp32";
        if (rows_refused || fp32_refused || (bf16 && path_refused)) {
            TU_CHECK(st == FH_ERR_KERNELS_UNAVAILABLE, "%s call: status %d, expected FH_ERR_KERNELS_UNAVAILABLE", dtype,
                     (int)st);
            TU_CHECK(info.refusal && strcmp(message, info.refusal) == 0, "%s call: message '%s', refusal '%s'", dtype,
                     message, info.refusal ? info.refusal : "(none)");
            TU_CHECK(untouched, "%s call refused but wrote its outputs", dtype);
        } else {
            TU_CHECK(st == FH_OK, "%s call: status %d (%s)", dtype, (int)st, message);
            TU_CHECK(!untouched, "%s call succeeded but left its outputs as they were", dtype);
        }
    }
}

static const tu_test tests[] = {
    {"the choice follows the CPU and the environment", test_choice_follows_cpu_and_environment},
    {"a refused choice refuses the calls that need it", test_refused_choice_refuses_calls},
};
const tu_suite suite_kernel_choice = {tests, TU_COUNT(tests)};
