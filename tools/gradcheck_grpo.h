/* fh_gradcheck --loss grpo. */
#ifndef FH_GRADCHECK_GRPO_H
#define FH_GRADCHECK_GRPO_H

/* Parses argv (after --loss grpo), runs the case, prints JSON; returns the process exit code. */
int gradcheck_grpo(int argc, char **argv);

#endif
