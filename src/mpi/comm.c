/* The MPI module: fusedhead_parallel.h's collectives (fh_collectives) over MPI communicators, and the layouts made
 * of them (include/fusedhead_mpi.h). The heads themselves are libfusedhead's. */
#include "fusedhead_mpi.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* A group's handle is its communicator's Fortran handle (an integer) stored in the pointer: no allocation, so
 * nothing can fail between the duplication of the communicators and the layout's agreement. */
static void *handle_of(MPI_Comm comm)
{
    return (void *)(intptr_t)MPI_Comm_c2f(comm);
}

static MPI_Comm comm_of(void *handle)
{
    return MPI_Comm_f2c((MPI_Fint)(intptr_t)handle);
}

static MPI_Datatype mpi_type(fh_collective_type type)
{
    return type == FH_COLLECTIVE_FLOAT ? MPI_FLOAT : type == FH_COLLECTIVE_DOUBLE ? MPI_DOUBLE : MPI_INT64_T;
}

static int mpi_allreduce(void *handle, void *buffer, int64_t count, fh_collective_type type, fh_collective_op op)
{
    const MPI_Op mpi_op = op == FH_COLLECTIVE_SUM ? MPI_SUM : op == FH_COLLECTIVE_MAX ? MPI_MAX : MPI_MIN;
    const size_t size = type == FH_COLLECTIVE_FLOAT ? sizeof(float) : sizeof(double); /* int64_t: 8 too */
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

static void mpi_release(void *handle)
{
    MPI_Comm comm = comm_of(handle);
    MPI_Comm_free(&comm);
}

/* A duplicate of comm (MPI_COMM_SELF's when comm is MPI_COMM_NULL) that returns errors. */
static int duplicate(MPI_Comm comm, MPI_Comm *dup)
{
    int err = MPI_Comm_dup(comm == MPI_COMM_NULL ? MPI_COMM_SELF : comm, dup);
    if (err == MPI_SUCCESS)
        err = MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN);
    return err;
}

static fh_collectives collectives_over(MPI_Comm comm)
{
    fh_collectives group = {handle_of(comm), 0, 1, mpi_allreduce, mpi_allgather, mpi_reduce_scatter, mpi_describe,
                            mpi_release};
    MPI_Comm_rank(comm, &group.rank);
    MPI_Comm_size(comm, &group.size);
    return group;
}

FH_MPI_API fh_status fh_mpi_layout_create(MPI_Comm vocab_comm, MPI_Comm data_comm, int64_t local_vocab,
                                          fh_mpi_layout **layout)
{
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return FH_ERR_MPI;
    /* The layout owns duplicates of the communicators (the caller's may be freed afterwards). */
    MPI_Comm vocab = MPI_COMM_NULL, data = MPI_COMM_NULL;
    int err = duplicate(vocab_comm, &vocab);
    if (err == MPI_SUCCESS)
        err = duplicate(data_comm, &data);
    fh_status st = FH_ERR_MPI;
    if (err == MPI_SUCCESS) {
        const fh_collectives vg = collectives_over(vocab), dg = collectives_over(data);
        st = fh_parallel_layout_create(&vg, &dg, local_vocab, layout);
    }
    if (st != FH_OK) {
        if (vocab != MPI_COMM_NULL)
            MPI_Comm_free(&vocab);
        if (data != MPI_COMM_NULL)
            MPI_Comm_free(&data);
    }
    return st;
}

FH_MPI_API fh_status fh_mpi_layout_create_grid(MPI_Comm comm, int vocab_ranks, int64_t local_vocab,
                                               fh_mpi_layout **layout)
{
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || comm == MPI_COMM_NULL)
        return FH_ERR_MPI;
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    /* Agreed before the splits, which every rank must make alike: a NULL layout and vocab_ranks (valid, and the
     * same on every rank: unsigned maxima of its bits and of their complements). */
    const uint64_t ranks_bits = (uint64_t)(int64_t)vocab_ranks;
    uint64_t args[4] = {layout == NULL, vocab_ranks < 1 || size % vocab_ranks != 0, ranks_bits, ~ranks_bits};
    if (MPI_Allreduce(MPI_IN_PLACE, args, 4, MPI_UINT64_T, MPI_MAX, comm) != MPI_SUCCESS)
        return FH_ERR_MPI;
    if (args[0])
        return FH_ERR_NULL_POINTER;
    if (args[1] || args[2] != ~args[3])
        return FH_ERR_MPI_LAYOUT;
    MPI_Comm vocab = MPI_COMM_NULL, data = MPI_COMM_NULL;
    int err = MPI_Comm_split(comm, rank / vocab_ranks, rank, &vocab);
    if (err == MPI_SUCCESS)
        err = MPI_Comm_split(comm, rank % vocab_ranks, rank, &data);
    fh_status st = err == MPI_SUCCESS ? fh_mpi_layout_create(vocab, data, local_vocab, layout) : FH_ERR_MPI;
    if (vocab != MPI_COMM_NULL)
        MPI_Comm_free(&vocab);
    if (data != MPI_COMM_NULL)
        MPI_Comm_free(&data);
    return st;
}

FH_MPI_API fh_status fh_mpi_layout_create_fortran(MPI_Fint vocab_comm, MPI_Fint data_comm, int64_t local_vocab,
                                                  fh_mpi_layout **layout)
{
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
        return FH_ERR_MPI;
    return fh_mpi_layout_create(MPI_Comm_f2c(vocab_comm), MPI_Comm_f2c(data_comm), local_vocab, layout);
}
