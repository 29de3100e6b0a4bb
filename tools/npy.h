/* Minimal writer and reader for NumPy .npy files (little-endian, C order). */
#ifndef FH_NPY_H
#define FH_NPY_H

#include <stddef.h>
#include <stdint.h>

/* dtype: "<f4", "<f8" or "<i8". ndim 0 writes a scalar. Format 1.0. Returns 0 or -1 on I/O error. */
int npy_write(const char *dir, const char *name, const char *dtype, const void *data, int ndim,
              const int64_t *shape);

enum { NPY_MAX_DIMS = 8 };

/* Reads what np.save writes (format 1.0, 2.0 or 3.0): checks that the file's dtype is `dtype` ("<f4", "<f8" or
 * "<i8"), that it is in C order with ndim (at most NPY_MAX_DIMS) dimensions, and that it holds all of its data;
 * stores the dimensions in shape. When data is not NULL, reads the first count elements into it (count at most
 * the product of the dimensions: a prefix of the rows). Returns 0, or -1 with a message naming the file and the
 * problem in why (NULL: no message). */
int npy_read(const char *path, const char *dtype, int ndim, int64_t *shape, void *data, size_t count, char *why,
             size_t why_size);

#endif
