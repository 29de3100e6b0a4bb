/* The options of the gradcheck commands that name a value: --dtype f32|bf16, --grad-filter-tail estimate|drop. */
#ifndef FH_TOOLS_ENUM_OPTIONS_H
#define FH_TOOLS_ENUM_OPTIONS_H

#include "fusedhead.h"

/* 0 and *dtype set, or -1 for an unknown name. */
int parse_dtype(const char *name, fh_dtype *dtype);

/* 0 and *tail set, or -1 for an unknown name. */
int parse_filter_tail(const char *name, fh_filter_tail *tail);

#endif
