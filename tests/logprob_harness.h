/* The log-prob suites' harness (tests/test_logprob.c, tests/test_logprob_support.c): a logprob_case spec run and held
 * to its tolerances (tests/cases/logprob_case.c), the failure naming the spec and every difference. */
#ifndef FH_LOGPROB_HARNESS_H
#define FH_LOGPROB_HARNESS_H

#include "logprob_case.h"

/* Asserts FH_OK and logprob_diff_pass; what names the check. */
void lp_check_spec(const logprob_case_spec *s, const char *what);

#endif
