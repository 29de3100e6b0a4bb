/* fh_gradcheck --loss dpo|orpo|simpo|cpo. */
#ifndef FH_GRADCHECK_PREFERENCE_H
#define FH_GRADCHECK_PREFERENCE_H

/* 1 when `loss` names a preference loss. */
int gradcheck_is_preference(const char *loss);

/* Parses argv, runs the case (fh_preference_forward and fh_preference_forward_backward against the reference),
 * prints JSON; returns the process exit code. */
int gradcheck_preference(int argc, char **argv);

#endif
