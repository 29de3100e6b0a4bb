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

int parse_layout(const char *name, fh_layout *layout)
{
    if (strcmp(name, "hv") == 0)
        *layout = FH_LAYOUT_HV;
    else if (strcmp(name, "vh") == 0)
        *layout = FH_LAYOUT_VH;
    else
        return -1;
    return 0;
}

int parse_reduction(const char *name, fh_reduction *reduction)
{
    if (strcmp(name, "mean") == 0)
        *reduction = FH_REDUCTION_MEAN;
    else if (strcmp(name, "sum") == 0)
        *reduction = FH_REDUCTION_SUM;
    else if (strcmp(name, "none") == 0)
        *reduction = FH_REDUCTION_NONE;
    else
        return -1;
    return 0;
}

int option_index(const char *name, const char *const *names, int count)
{
    for (int k = 0; k < count; k++)
        if (strcmp(name, names[k]) == 0)
            return k;
    return -1;
}
