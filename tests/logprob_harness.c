#include "logprob_harness.h"

#include "test_util.h"

void lp_check_spec(const logprob_case_spec *s, const char *what)
{
    logprob_case c;
    logprob_diff d;
    const fh_status st = logprob_case_run(s, &c, &d);
    logprob_case_free(&c);
    TU_CHECK(st == FH_OK, "%s: status %d (%s)", what, (int)st, fh_status_string(st));
    if (st != FH_OK)
        return;
    char detail[512];
    logprob_diff_describe(s, &d, detail, sizeof detail);
    TU_CHECK(logprob_diff_pass(&d), "%s (%s)", what, detail);
}
