/* fh_gradcheck --loss kto. */
#ifndef FH_GRADCHECK_KTO_H
#define FH_GRADCHECK_KTO_H

/* Parses argv, runs the case (fh_kto_forward and fh_kto_forward_backward against the reference), prints JSON;
 * returns the process exit code. */
int gradcheck_kto(int argc, char **argv);

#endif
