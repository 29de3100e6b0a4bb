/* The library's GRPO types as the reference's, and back: the one conversion every fused-vs-reference
 * comparison uses (tests/cases/grpo_case.c, the CUnit harness), so that no test can check against a drifted copy. */
#ifndef FH_GRPO_CONVERT_H
#define FH_GRPO_CONVERT_H

#include "fusedhead.h"
#include "ref_grpo.h"

/* fh_grpo_options as ref_grpo_options, with TRL's entropy bonus, which the library implements (fusedhead.h:
 * entropy_coef). */
ref_grpo_options grpo_ref_options(const fh_grpo_options *o);

/* The reference's metrics in the library's struct, to compare field by field. */
fh_grpo_metrics grpo_fh_metrics(const ref_grpo_metrics *m);

/* Every metric of fh_grpo_metrics as an array in declaration order (the one list every comparison and printout
 * walks, so that a metric cannot be left out of one), and TRL's key of each. */
#define GRPO_METRIC_COUNT 16
#define GRPO_METRIC_POLICY_LOSS 8        /* the indices the comparisons single out */
#define GRPO_METRIC_VESPO_PHI_SEQ_MEAN 10
#define GRPO_METRIC_IS_RATIO_MIN 13
#define GRPO_METRIC_IS_RATIO_MEAN 14
#define GRPO_METRIC_IS_RATIO_MAX 15
int grpo_metrics_fields(const fh_grpo_metrics *m, double values[GRPO_METRIC_COUNT]);
extern const char *const grpo_metric_keys[GRPO_METRIC_COUNT];

#endif
