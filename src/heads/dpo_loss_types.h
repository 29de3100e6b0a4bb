/* TRL's current DPO loss types (DPOTrainer._compute_loss at huggingface/trl f2cd5771, formulas in fusedhead.h):
 * a pair's terms from its summed log-probs, and the aot terms that sort over the call's pairs. Scalar math on
 * per-sequence values, shared by the preference head's passes. */
#ifndef FH_DPO_LOSS_TYPES_H
#define FH_DPO_LOSS_TYPES_H

#include "fusedhead.h"
#include "sigmoid.h"


/* The options' loss-type list: loss_types[0 .. loss_type_count), or the one loss_type with weight 1. */
int fh_dpo_type_count(const fh_preference_options *o);
fh_preference_loss_type fh_dpo_type(const fh_preference_options *o, int k);
double fh_dpo_weight(const fh_preference_options *o, int k);
/* 1 when the list names type (whatever its weight); the summed weights of its entries of that type. */
int fh_dpo_lists(const fh_preference_options *o, fh_preference_loss_type type);
double fh_dpo_weight_of(const fh_preference_options *o, fh_preference_loss_type type);

/* One pair: summed log-probs c, r, their references, and token counts n_c, n_r (max(sum m, 1)). */
typedef struct fh_dpo_pair {
    double c, r, ref_c, ref_r, n_c, n_r;
} fh_dpo_pair;

/* The weighted sum of the pair's terms over the listed types but aot, aot_unpaired and sft (which are not a pair's
 * own), and its derivatives with respect to c and r. */
double fh_dpo_pair_terms(const fh_preference_options *o, const fh_dpo_pair *p, double *d_c, double *d_r);

/* The aot and aot_unpaired terms of a call's B pairs (l and ref: [2B], chosen then rejected), summed over the sorted
 * positions and weighted; when d is not NULL, scale times their derivatives with respect to each l is added to
 * d [2B]. order: [2B] scratch. */
double fh_dpo_sorted_terms(const fh_preference_options *o, int64_t pairs, const double *l, const double *ref,
                           int64_t *order, double scale, double *d);

#endif
