#include "npy.h"

#include <stdio.h>
#include <string.h>

static size_t item_size(const char *dtype)
{
    return dtype[2] == '4' ? 4 : 8;
}

int npy_write(const char *dir, const char *name, const char *dtype, const void *data, int ndim,
              const int64_t *shape)
{
    char path[4096], shape_text[256] = "", header[512];
    snprintf(path, sizeof path, "%s/%s.npy", dir, name);
    size_t count = 1;
    for (int d = 0; d < ndim; d++) {
        char part[32];
        snprintf(part, sizeof part, ndim == 1 ? "%lld," : (d ? " %lld" : "%lld"), (long long)shape[d]);
        if (ndim > 1 && d < ndim - 1)
            strcat(part, ",");
        strcat(shape_text, part);
        count *= (size_t)shape[d];
    }
    int len = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", dtype,
                       shape_text);
    /* magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64. */
    const int total = (10 + len + 1 + 63) / 64 * 64;
    while (10 + len + 1 < total)
        header[len++] = ' ';
    header[len++] = '\n';
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    const unsigned char preamble[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(len & 0xff),
                                        (unsigned char)(len >> 8)};
    int ok = fwrite(preamble, 1, 10, f) == 10 && fwrite(header, 1, (size_t)len, f) == (size_t)len &&
             fwrite(data, item_size(dtype), count, f) == count;
    ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}
