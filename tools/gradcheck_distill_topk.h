/* fh_gradcheck --loss distill_topk. */
#ifndef FH_GRADCHECK_DISTILL_TOPK_H
#define FH_GRADCHECK_DISTILL_TOPK_H

/* Parses argv, runs the case (fh_distill_topk_forward and fh_distill_topk_forward_backward against
 * ref_distill_topk_linear), prints JSON; returns the process exit code (0 within tolerance, 1 beyond it, 2 on a
 * usage error or a failed call). */
int gradcheck_distill_topk(int argc, char **argv);

#endif
