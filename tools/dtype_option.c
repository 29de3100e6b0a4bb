#include "dtype_option.h"

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
