/* The options of the gradcheck commands that name a value: --dtype f32|bf16, --grad-filter-tail estimate|drop,
 * --layout hv|vh, --reduction mean|sum|none, and each loss's own lists of names. */
#ifndef FH_TOOLS_ENUM_OPTIONS_H
#define FH_TOOLS_ENUM_OPTIONS_H

#include "fusedhead.h"

/* 0 and *dtype set, or -1 for an unknown name. */
int parse_dtype(const char *name, fh_dtype *dtype);

/* 0 and *tail set, or -1 for an unknown name. */
int parse_filter_tail(const char *name, fh_filter_tail *tail);

/* 0 and *layout set, or -1 for an unknown name. */
int parse_layout(const char *name, fh_layout *layout);

/* 0 and *reduction set, or -1 for an unknown name. */
int parse_reduction(const char *name, fh_reduction *reduction);

/* The index of name in names[count], or -1. */
int option_index(const char *name, const char *const *names, int count);

#endif
