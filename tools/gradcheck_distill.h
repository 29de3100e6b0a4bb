/* fh_gradcheck --loss distill. */
#ifndef FH_GRADCHECK_DISTILL_H
#define FH_GRADCHECK_DISTILL_H

/* Parses argv, runs the case (fh_distill_forward and fh_distill_forward_backward against ref_distill_linear), prints
 * JSON; returns the process exit code (0 within tolerance, 1 beyond it, 2 on a usage error or a failed call). */
int gradcheck_distill(int argc, char **argv);

#endif
