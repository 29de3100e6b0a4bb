#include "enum_options.h"

#include <string.h>

int parse_dtype(const char *name, fh_dtype *dtype)
{
    if (strcmp(name, "f32") == 0)
        *dtype = FH_DTYPE_F32;
    else if (strcmp(name, "bf16") == 0)
        *dtype = FH_DTYPE_BF16;
    else
        return -1;
    return 0;
}

int parse_filter_tail(const char *name, fh_filter_tail *tail)
{
    if (strcmp(name, "estimate") == 0)
        *tail = FH_FILTER_TAIL_ESTIMATE;
    else if (strcmp(name, "drop") == 0)
        *tail = FH_FILTER_TAIL_DROP;
    else
        return -1;
    return 0;
}
