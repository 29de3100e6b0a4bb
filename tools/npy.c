#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
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

/* Returns -1 after writing "path: message" to why. */
static int fail(char *why, size_t why_size, const char *path, const char *format, ...)
{
    if (!why || why_size == 0)
        return -1;
    va_list args;
    va_start(args, format);
    const int len = snprintf(why, why_size, "%s: ", path);
    if (len >= 0 && (size_t)len < why_size)
        vsnprintf(why + len, why_size - (size_t)len, format, args);
    va_end(args);
    return -1;
}

/* The value of 'key' in the header's dictionary, spaces skipped; NULL when the key is missing. */
static const char *header_value(const char *header, const char *key)
{
    const char *k = strstr(header, key);
    if (!k)
        return NULL;
    k += strlen(key);
    while (*k == ' ')
        k++;
    if (*k++ != ':')
        return NULL;
    while (*k == ' ')
        k++;
    return k;
}

/* Parses "(d0, d1, ...)" into shape; returns the number of dimensions, or -1 when malformed or too many. */
static int parse_shape(const char *text, int64_t *shape)
{
    if (*text++ != '(')
        return -1;
    int ndim = 0;
    for (;;) {
        while (*text == ' ' || *text == ',')
            text++;
        if (*text == ')')
            return ndim;
        char *end;
        errno = 0;
        const long long d = strtoll(text, &end, 10);
        if (end == text || errno || d < 0 || ndim == NPY_MAX_DIMS)
            return -1;
        shape[ndim++] = d;
        text = end;
        if (*text != ',' && *text != ')' && *text != ' ')
            return -1;
    }
}

/* Checks the header (dtype, order, dimensions) and stores the shape and the element count. */
static int check_header(const char *header, const char *path, const char *dtype, int ndim, int64_t *shape,
                        size_t *elements, char *why, size_t why_size)
{
    const char *descr = header_value(header, "'descr'"), *order = header_value(header, "'fortran_order'");
    const char *shape_text = header_value(header, "'shape'");
    if (!descr || !order || !shape_text || (*descr != '\'' && *descr != '"'))
        return fail(why, why_size, path, "malformed .npy header \"%s\"", header);
    const size_t len = strcspn(descr + 1, "'\"");
    if (len != strlen(dtype) || strncmp(descr + 1, dtype, len) != 0)
        return fail(why, why_size, path, "dtype '%.*s', expected '%s' (%s)", (int)len, descr + 1, dtype,
                    strcmp(dtype, "<i8") == 0 ? "int64" : strcmp(dtype, "<f4") == 0 ? "float32" : "float64");
    if (strncmp(order, "False", 5) != 0)
        return fail(why, why_size, path, "Fortran order; expected C order (np.ascontiguousarray)");
    int64_t dims[NPY_MAX_DIMS];
    const int found = parse_shape(shape_text, dims);
    if (found < 0)
        return fail(why, why_size, path, "malformed shape in .npy header \"%s\"", header);
    if (found != ndim)
        return fail(why, why_size, path, "ndim %d, expected %d", found, ndim);
    *elements = 1;
    for (int d = 0; d < ndim; d++) {
        if (dims[d] > 0 && *elements > SIZE_MAX / 8 / (size_t)dims[d])
            return fail(why, why_size, path, "shape too large");
        *elements *= (size_t)dims[d];
        shape[d] = dims[d];
    }
    return 0;
}

int npy_read(const char *path, const char *dtype, int ndim, int64_t *shape, void *data, size_t count, char *why,
             size_t why_size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(why, why_size, path, "%s", strerror(errno));
    unsigned char pre[12];
    char *header = NULL;
    int status = -1;
    if (fread(pre, 1, 8, f) != 8 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        fail(why, why_size, path, "not a .npy file (no \\x93NUMPY magic)");
        goto done;
    }
    /* Format 1.0 stores the header length in 2 bytes, 2.0 and 3.0 (UTF-8 header) in 4. */
    const int wide = pre[6] >= 2;
    if (pre[6] < 1 || pre[6] > 3 || fread(pre + 8, 1, wide ? 4 : 2, f) != (wide ? 4u : 2u)) {
        fail(why, why_size, path, "unsupported .npy format version %d.%d", pre[6], pre[7]);
        goto done;
    }
    const unsigned long header_len = pre[8] | (unsigned long)pre[9] << 8 |
                                     (wide ? (unsigned long)pre[10] << 16 | (unsigned long)pre[11] << 24 : 0);
    const long offset = (wide ? 12 : 10) + (long)header_len;
    header = header_len < (1ul << 24) ? malloc(header_len + 1) : NULL;
    if (!header || fread(header, 1, header_len, f) != header_len) {
        fail(why, why_size, path, "truncated or oversized .npy header");
        goto done;
    }
    header[header_len] = '\0';
    size_t elements = 0;
    if (check_header(header, path, dtype, ndim, shape, &elements, why, why_size) != 0)
        goto done;
    const size_t size = item_size(dtype);
    if (fseek(f, 0, SEEK_END) != 0 || ftell(f) < offset || (size_t)(ftell(f) - offset) / size < elements) {
        fail(why, why_size, path, "truncated: the shape needs %zu bytes of data", elements * size);
        goto done;
    }
    if (data && count > elements) {
        fail(why, why_size, path, "%zu elements asked for, the file holds %zu", count, elements);
        goto done;
    }
    if (data && (fseek(f, offset, SEEK_SET) != 0 || fread(data, size, count, f) != count)) {
        fail(why, why_size, path, "read error");
        goto done;
    }
    status = 0;
done:
    free(header);
    fclose(f);
    return status;
}
