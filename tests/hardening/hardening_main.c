/* fh_hardening_tests [SUITE[/TEXT]...]: the hardening suites (README.md in this directory). Runs every suite,
 * or only the named ones (ctest runs one suite per test); SUITE/TEXT runs only that suite's tests whose name
 * contains TEXT. Exits 0 only when every assertion passed; 1 on a failure; 2 on a usage error. */
#include "hardening_util.h"

#include <CUnit/Basic.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    int (*const registrations[])(void) = {hu_register_alloc_failure, hu_register_overflow,
                                          hu_register_nonfinite,     hu_register_hard_determinism,
                                          hu_register_numeric_extremes, hu_register_thread_safety,
                                          hu_register_guard_pages};
    if (CU_initialize_registry() != CUE_SUCCESS) {
        fprintf(stderr, "fh_hardening_tests: %s\n", CU_get_error_msg());
        return 2;
    }
    for (size_t k = 0; k < TU_COUNT(registrations); k++)
        if (registrations[k]() != 0) {
            fprintf(stderr, "fh_hardening_tests: registration failed: %s\n", CU_get_error_msg());
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
            fprintf(stderr, "fh_hardening_tests: no suite named '%s'\n", name);
            rc = 2;
            continue;
        }
        for (CU_pTest t = suite->pTest; only && t; t = t->pNext)
            CU_set_test_active(t, strstr(t->pName, only) ? CU_TRUE : CU_FALSE);
        CU_basic_run_suite(suite);
        failures += CU_get_number_of_failures() + CU_get_number_of_suites_failed();
    }
    CU_cleanup_registry();
    if (rc == 0 && failures > 0)
        rc = 1;
    return rc;
}
