/* The --dtype f32|bf16 option of both gradcheck commands. */
#ifndef FH_TOOLS_DTYPE_OPTION_H
#define FH_TOOLS_DTYPE_OPTION_H

#include "fusedhead.h"

/* 0 and *dtype set, or -1 for an unknown name. */
int parse_dtype(const char *name, fh_dtype *dtype);

#endif
