/* The library's GRPO types as the reference's, and back: the one conversion every fused-vs-reference
 * comparison uses (ref/grpo_case.c, the CUnit harness), so that no test can check against a drifted copy. */
#ifndef FH_GRPO_CONVERT_H
#define FH_GRPO_CONVERT_H

#include "fusedhead.h"
#include "ref_grpo.h"

/* fh_grpo_options as ref_grpo_options, with the entropy bonus in TRL's masked-mean form, which the library
 * implements (fusedhead.h: entropy_coef). */
ref_grpo_options grpo_ref_options(const fh_grpo_options *o);

/* The reference's metrics in the library's struct, to compare field by field. */
fh_grpo_metrics grpo_fh_metrics(const ref_grpo_metrics *m);

#endif
