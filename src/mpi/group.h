/* A group of ranks and the few collectives the parallel heads make over it: the interface between the heads' scale-out
 * (agreement, per-token statistics, normalisers, gradient reductions) and whatever moves the bytes. comm.c implements
 * it over an MPI communicator; every other file of the module calls only these. Every rank of a group makes the same
 * calls in the same order, from the thread that makes the fusedhead call. Each function returns 0 or a nonzero code,
 * which describe() turns into text. */
#ifndef FH_MPI_GROUP_H
#define FH_MPI_GROUP_H

#include <stddef.h>
#include <stdint.h>

typedef enum fh_group_type { FH_GROUP_FLOAT = 0, FH_GROUP_DOUBLE = 1, FH_GROUP_INT64 = 2 } fh_group_type;
typedef enum fh_group_op { FH_GROUP_SUM = 0, FH_GROUP_MAX = 1, FH_GROUP_MIN = 2 } fh_group_op;

typedef struct fh_group {
    void *handle;
    int rank, size;
    /* buffer[0..count) becomes the element-wise op over the ranks (in place). */
    int (*allreduce)(void *handle, void *buffer, int64_t count, fh_group_type type, fh_group_op op);
    /* receive[r * bytes .. (r + 1) * bytes) becomes rank r's send[0..bytes), on every rank. */
    int (*allgather)(void *handle, const void *send, void *receive, int64_t bytes);
    /* The float sum of every rank's buffer, split in size blocks of counts[r] elements in rank order: rank r's block
     * into receive (which may be buffer: then at its start). */
    int (*reduce_scatter)(void *handle, float *buffer, float *receive, const int64_t *counts);
    /* What code means, into text[0..size). */
    void (*describe)(void *handle, int code, char *text, size_t size);
} fh_group;

#endif
