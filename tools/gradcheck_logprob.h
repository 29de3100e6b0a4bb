/* fh_gradcheck --loss logprob. */
#ifndef FH_GRADCHECK_LOGPROB_H
#define FH_GRADCHECK_LOGPROB_H

/* Parses argv (after --loss logprob), runs the case, prints JSON; returns the process exit code. */
int gradcheck_logprob(int argc, char **argv);

#endif
