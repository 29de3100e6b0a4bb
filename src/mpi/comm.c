/* The group interface (group.h) over an MPI communicator, and what every file of the module uses on a group: errors,
 * sums, maxima, splits. */
#include "mpi_internal.h"

#include "core/context.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

static MPI_Comm comm_of(void *handle)
{
    return *(const MPI_Comm *)handle;
}

static MPI_Datatype mpi_type(fh_group_type type)
{
    return type == FH_GROUP_FLOAT ? MPI_FLOAT : type == FH_GROUP_DOUBLE ? MPI_DOUBLE : MPI_INT64_T;
}

static int mpi_allreduce(void *handle, void *buffer, int64_t count, fh_group_type type, fh_group_op op)
{
    const MPI_Op mpi_op = op == FH_GROUP_SUM ? MPI_SUM : op == FH_GROUP_MAX ? MPI_MAX : MPI_MIN;
    const size_t size = type == FH_GROUP_FLOAT ? sizeof(float) : sizeof(double); /* int64_t: 8 too */
    const int64_t chunk = (int64_t)1 << 30; /* MPI's counts are ints */
    for (int64_t done = 0; done < count; done += chunk) {
        const int64_t now = count - done < chunk ? count - done : chunk;
        const int err = MPI_Allreduce(MPI_IN_PLACE, (char *)buffer + (size_t)done * size, (int)now, mpi_type(type),
                                      mpi_op, comm_of(handle));
        if (err != MPI_SUCCESS)
            return err;
    }
    return MPI_SUCCESS;
}

static int mpi_allgather(void *handle, const void *send, void *receive, int64_t bytes)
{
    /* Whole 8-byte words where they fit an int count, else bytes */
    if (bytes % 8 == 0 && bytes / 8 <= INT_MAX)
        return MPI_Allgather(send, (int)(bytes / 8), MPI_UINT64_T, receive, (int)(bytes / 8), MPI_UINT64_T,
                             comm_of(handle));
    if (bytes > INT_MAX)
        return MPI_ERR_COUNT;
    return MPI_Allgather(send, (int)bytes, MPI_BYTE, receive, (int)bytes, MPI_BYTE, comm_of(handle));
}

static int mpi_reduce_scatter(void *handle, float *buffer, float *receive, const int64_t *counts)
{
    int size = 1;
    MPI_Comm_size(comm_of(handle), &size);
    int *ints = malloc(sizeof(int) * (size_t)size);
    if (!ints)
        return MPI_ERR_NO_MEM;
    int err = MPI_SUCCESS;
    for (int r = 0; r < size; r++) {
        if (counts[r] > INT_MAX)
            err = MPI_ERR_COUNT;
        ints[r] = (int)counts[r];
    }
    if (err == MPI_SUCCESS)
        err = MPI_Reduce_scatter(receive == buffer ? MPI_IN_PLACE : buffer, receive, ints, MPI_FLOAT, MPI_SUM,
                                 comm_of(handle));
    free(ints);
    return err;
}

static void mpi_describe(void *handle, int code, char *text, size_t size)
{
    (void)handle;
    char mpi_text[MPI_MAX_ERROR_STRING] = "";
    int length = 0;
    MPI_Error_string(code, mpi_text, &length);
    snprintf(text, size, "%s", mpi_text);
}

void fhm_group_over(MPI_Comm *comm, fh_group *group)
{
    group->handle = comm;
    MPI_Comm_rank(*comm, &group->rank);
    MPI_Comm_size(*comm, &group->size);
    group->allreduce = mpi_allreduce;
    group->allgather = mpi_allgather;
    group->reduce_scatter = mpi_reduce_scatter;
    group->describe = mpi_describe;
}

fh_status fhm_group_error(fh_context *ctx, const fh_group *group, int code, const char *what)
{
    char text[MPI_MAX_ERROR_STRING] = "";
    group->describe(group->handle, code, text, sizeof text);
    return fh_fail(ctx, FH_ERR_MPI, "%s failed: %s", what, text);
}

void fhm_split(int64_t count, int parts, int r, int64_t *first, int64_t *size)
{
    const int64_t base = count / parts, extra = count % parts;
    *first = r * base + (r < extra ? r : extra);
    *size = base + (r < extra);
}

fh_status fhm_sum(fh_context *ctx, const fh_group *group, double *values, int64_t n)
{
    if (group->size == 1)
        return FH_OK;
    const int err = group->allreduce(group->handle, values, n, FH_GROUP_DOUBLE, FH_GROUP_SUM);
    return err == 0 ? FH_OK : fhm_group_error(ctx, group, err, "the all-reduce of sums");
}

fh_status fhm_max(fh_context *ctx, const fh_group *group, double *values, int64_t n)
{
    if (group->size == 1)
        return FH_OK;
    const int err = group->allreduce(group->handle, values, n, FH_GROUP_DOUBLE, FH_GROUP_MAX);
    return err == 0 ? FH_OK : fhm_group_error(ctx, group, err, "the all-reduce of maxima");
}
