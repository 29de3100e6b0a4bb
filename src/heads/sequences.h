/* Heads over whole sequences of T rows (preference pairs, KTO's sequences): in row blocks of whole sequences, a
 * block's coefficients come per sequence, once its rows' statistics are in the workspace's slots, and each row's from
 * its sequence's. */
#ifndef FH_SEQUENCES_H
#define FH_SEQUENCES_H

#include "engine/engine.h"

typedef struct fh_sequence_coefs {
    int64_t seq;                                                  /* T, the rows of a sequence */
    void (*sequences)(const void *self, int64_t s0, int64_t s1); /* the coefficients of sequences s0 .. s1 - 1 */
    void (*row)(const void *self, int64_t i, fh_coef *k);        /* row i's, after its sequence's */
    const void *self;
} fh_sequence_coefs;

/* fh_engine_row_blocks on pass (its stats, grads and paired_rows set by the head), the coefficients from coefs. */
fh_status fh_sequence_row_blocks(fh_engine_pass *pass, const fh_sequence_coefs *coefs);

#endif
