/* Top-k supports of a distillation pair (fh_distill_options.top_k; formulas in fusedhead.h, TRL's
 * IWOPDTrainer.generalized_jsd_loss). While a row's tiles stream, min-heaps keep the top_k largest tempered logits of
 * the teacher, of the student, or of each (jsd), every entry with the other head's logit at its column; once the row
 * is folded its support (the heaps' union) gives the divergence, with TRL's renormalisation or its tail, and each
 * entry's gradient term; the backward scatters those terms into the row's dU. The heaps live in the workspace's head
 * rows (fh_plan_pair_*'s head_row_bytes), one row's only ever touched by the thread folding that row. */
#ifndef FH_TOPK_SUPPORT_H
#define FH_TOPK_SUPPORT_H

#include <stddef.h>
#include <stdint.h>

/* Whose top-k the support is: the teacher's (forward KL), the student's (reverse KL), their union (jsd). */
typedef enum fh_topk_select { FH_TOPK_TEACHER, FH_TOPK_STUDENT, FH_TOPK_UNION } fh_topk_select;

typedef struct fh_topk_entry {
    float s, t; /* the student's and the teacher's tempered logits at the column; after the row's finish, s holds the
                   entry's dD/ds */
    int64_t id; /* the column; INT64_MAX for an empty place (a heap's start, or a duplicate taken out of the union) */
} fh_topk_entry;

typedef struct fh_topk_rows {
    fh_topk_entry *entries; /* [n][heaps][k] */
    int64_t k;              /* 0: no top-k (every function below is then unused) */
    fh_topk_select select;
    int add_tail;
    double beta;            /* jsd's mixture weight (the union only) */
    float inv_t;            /* 1 / temperature: s = inv_t x the student's logit, t likewise */
} fh_topk_rows;

/* The head-row bytes of a top-k selection over `heaps` heads (1, or 2 for the union). */
size_t fh_topk_row_bytes(int64_t k, int heaps);

/* The selections over head_rows (n rows of fh_topk_row_bytes), every heap empty. */
fh_topk_rows fh_topk_rows_begin(void *head_rows, int64_t n, int64_t k, fh_topk_select select, int add_tail,
                                double beta, float inv_t);

/* Offers columns first_column .. first_column + count - 1 of row i (z: the student's raw logits, cz: the
 * teacher's) to its heaps; on equal logits the lower column stays. */
void fh_topk_rows_fold(const fh_topk_rows *r, int64_t i, const float *z, const float *cz, int64_t count,
                       int64_t first_column);

/* Once row i is folded, with its log-sum-exps of s and t over the whole vocabulary: returns D over the support and
 * leaves each entry's dD/ds (d with respect to the tempered student logit, the part on its column); *dense is the
 * coefficient of the full softmax p in dD/ds (nonzero through the tail only): dD/ds_j = dense p_j + the entries'. */
double fh_topk_rows_finish(const fh_topk_rows *r, int64_t i, double lse_s, double lse_t, double *dense);

/* du[j] += scale x the entry's dD/ds for the entries of row i in columns first_column .. + count - 1. */
void fh_topk_rows_scatter(const fh_topk_rows *r, int64_t i, float scale, float *du, int64_t count,
                          int64_t first_column);

#endif
