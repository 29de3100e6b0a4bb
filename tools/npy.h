/* Minimal writer for NumPy .npy files (format 1.0, little-endian, C order). */
#ifndef FH_NPY_H
#define FH_NPY_H

#include <stdint.h>

/* dtype: "<f4", "<f8" or "<i8". ndim 0 writes a scalar. Returns 0 or -1 on I/O error. */
int npy_write(const char *dir, const char *name, const char *dtype, const void *data, int ndim,
              const int64_t *shape);

#endif
