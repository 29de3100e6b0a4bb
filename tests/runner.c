/* The CUnit runner of fh_tests and fh_hardening_tests: PROGRAM [SUITE[/TEXT]...] registers the suites of
 * suites.def and runs all of them, or only the named ones (ctest runs one suite per test); SUITE/TEXT runs only
 * that suite's tests whose name contains TEXT. Exits 0 only when every assertion passed; 1 on a failure; 2 on a
 * usage error; 77 (ctest's SKIP_RETURN_CODE) when FH_ROW_KERNELS or FH_BF16_GEMM asks for kernels this CPU or build
 * lacks, after printing why, unless FH_TEST_EXPECT_REFUSAL is set (the kernel_choice suite tests that refusal).
 * PROGRAM --kernels only prints the kernels of this environment and exits 0, or 77 as above.
 *
 * CMake compiles this file once per program: with FH_RUNNER_HARDENING it takes the FH_HARDENING_SUITE lines (the
 * suites that need the allocation hook linked in), without it the FH_SUITE lines. */
#include "test_util.h"

#include <CUnit/Basic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FH_RUNNER_HARDENING
#define FH_SUITE(name)
#define FH_HARDENING_SUITE(name) FH_RUNNER_ENTRY(name)
#else
#define FH_SUITE(name) FH_RUNNER_ENTRY(name)
#define FH_HARDENING_SUITE(name)
#endif

#define FH_RUNNER_ENTRY(name) extern const tu_suite suite_##name;
#include "suites.def"
#undef FH_RUNNER_ENTRY

typedef struct named_suite {
    const char *name;
    const tu_suite *suite;
} named_suite;

static const named_suite suites[] = {
#define FH_RUNNER_ENTRY(name) {#name, &suite_##name},
#include "suites.def"
#undef FH_RUNNER_ENTRY
};

static int register_suite(const named_suite *s)
{
    CU_pSuite suite = CU_add_suite(s->name, NULL, NULL);
    if (!suite)
        return -1;
    for (size_t i = 0; i < s->suite->count; i++)
        if (!CU_add_test(suite, s->suite->tests[i].name, s->suite->tests[i].run))
            return -1;
    return 0;
}

/* Prints the kernels of this run; 1 when the run is to be skipped. */
static int skip_for_kernels(const char *program)
{
    fh_kernel_info info;
    if (fh_kernel_query(&info) != FH_OK)
        return 0;
    printf("%s: row kernels %s, bf16 GEMMs %s, fp32 GEMMs %s, BLIS %s\n", program, info.elementwise, info.bf16_gemm,
           info.fp32_gemm, info.kernel_set);
    if (!info.refusal || getenv("FH_TEST_EXPECT_REFUSAL"))
        return 0;
    printf("%s: skipped: %s\n", program, info.refusal);
    return 1;
}

int main(int argc, char **argv)
{
    const char *program = argv[0];
    const char *slash = strrchr(program, '/');
    if (slash)
        program = slash + 1;
    if (skip_for_kernels(program))
        return 77;
    if (argc == 2 && strcmp(argv[1], "--kernels") == 0)
        return 0;
    if (CU_initialize_registry() != CUE_SUCCESS) {
        fprintf(stderr, "%s: %s\n", program, CU_get_error_msg());
        return 2;
    }
    for (size_t k = 0; k < TU_COUNT(suites); k++)
        if (register_suite(&suites[k]) != 0) {
            fprintf(stderr, "%s: registration failed: %s\n", program, CU_get_error_msg());
            CU_cleanup_registry();
            return 2;
        }
    CU_basic_set_mode(CU_BRM_VERBOSE);
    int rc = 0;
    unsigned failures = 0;
    if (argc < 2) {
        CU_basic_run_tests();
        failures = CU_get_number_of_failures() + CU_get_number_of_suites_failed();
    }
    for (int a = 1; a < argc; a++) {
        char name[128];
        snprintf(name, sizeof name, "%s", argv[a]);
        char *only = strchr(name, '/');
        if (only)
            *only++ = '\0';
        CU_pSuite suite = CU_get_suite(name);
        if (!suite) {
            fprintf(stderr, "%s: no suite named '%s'\n", program, name);
            rc = 2;
            continue;
        }
        for (CU_pTest t = suite->pTest; only && t; t = t->pNext)
            CU_set_test_active(t, strstr(t->pName, only) ? CU_TRUE : CU_FALSE);
        CU_basic_run_suite(suite);
        /* Run summaries are reset by each run: accumulate. */
        failures += CU_get_number_of_failures() + CU_get_number_of_suites_failed();
    }
    CU_cleanup_registry();
    if (rc == 0 && failures > 0)
        rc = 1;
    return rc;
}
