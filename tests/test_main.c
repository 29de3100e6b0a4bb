/* fh_tests [SUITE...]: registers every suite and runs all of them, or only the named ones (ctest runs
 * one suite per test). Exits 0 only when every assertion passed; 1 on a failure; 2 on a usage error. */
#include "test_util.h"

#include <CUnit/Basic.h>
#include <stdio.h>

/* GRPO suites (tests/test_grpo.c: grpo_reference, grpo_masks, grpo_clip, grpo_shapes, grpo_determinism,
 * grpo_metrics; tests/test_grpo_contracts.c: grpo_contracts). */
int tu_register_grpo(void);
int tu_register_grpo_contracts(void);

int main(int argc, char **argv)
{
    int (*const registrations[])(void) = {tu_register_shapes,     tu_register_options,  tu_register_ignored,
                                          tu_register_boundaries, tu_register_extremes, tu_register_reference,
                                          tu_register_contracts,  tu_register_determinism,
                                          tu_register_grpo,       tu_register_grpo_contracts};
    if (CU_initialize_registry() != CUE_SUCCESS) {
        fprintf(stderr, "fh_tests: %s\n", CU_get_error_msg());
        return 2;
    }
    for (size_t k = 0; k < TU_COUNT(registrations); k++)
        if (registrations[k]() != 0) {
            fprintf(stderr, "fh_tests: registration failed: %s\n", CU_get_error_msg());
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
        CU_pSuite suite = CU_get_suite(argv[a]);
        if (!suite) {
            fprintf(stderr, "fh_tests: no suite named '%s'\n", argv[a]);
            rc = 2;
            continue;
        }
        CU_basic_run_suite(suite);
        /* Run summaries are reset by each run: accumulate. */
        failures += CU_get_number_of_failures() + CU_get_number_of_suites_failed();
    }
    CU_cleanup_registry();
    if (rc == 0 && failures > 0)
        rc = 1;
    return rc;
}
