/* The fh_mpi_layout object (a grid of duplicated vocab x data communicators; "layout" in the public
 * name): this rank's shard, parameters, per-call scratch. */
#include "mpi_internal.h"

#include "core/context.h"

#include <limits.h>
#include <stdlib.h>

/* A duplicate of comm (MPI_COMM_SELF's when comm is MPI_COMM_NULL) that returns errors. */
static int duplicate(MPI_Comm comm, MPI_Comm *dup)
{
    int err = MPI_Comm_dup(comm == MPI_COMM_NULL ? MPI_COMM_SELF : comm, dup);
    if (err == MPI_SUCCESS)
        err = MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN);
    return err;
}

static void free_layout(fh_mpi_layout *L)
{
    if (!L)
        return;
    if (L->vocab_comm != MPI_COMM_NULL)
        MPI_Comm_free(&L->vocab_comm);
    if (L->data_comm != MPI_COMM_NULL)
        MPI_Comm_free(&L->data_comm);
    free(L->scratch);
    free(L);
}

/* The layout's checks, collective over both groups, with the same status on every rank: over vocab, [layout NULL,
 * out of memory, a size < 1] (a rank with a NULL layout joins too, so that every rank fails), the sum of the sizes
 * and this rank's offset (the lower ranks' sizes, from every rank's size gathered); over data, the same shard
 * everywhere ([offset, size, total, vocab ranks] as maxima of the values and of their complements, read as int64),
 * the vocab group's verdict, and every rank's vocab group the same size; then the data verdict back over vocab. L,
 * when not NULL, gets the offset and total. */
static fh_status agree_on_layout(const fh_group *vocab, const fh_group *data, int null_layout, int no_memory,
                                 int64_t local_vocab, fh_mpi_layout *L)
{
    int64_t worst[3] = {null_layout, no_memory, local_vocab < 1};
    int err = vocab->allreduce(vocab->handle, worst, 3, FH_GROUP_INT64, FH_GROUP_MAX);
    const int64_t size = local_vocab > 0 ? local_vocab : 0;
    int64_t *sizes = err == 0 ? malloc(sizeof(int64_t) * (size_t)vocab->size) : NULL;
    int64_t total = 0, offset = 0, gathered = sizes != NULL;
    /* Every rank gathers, or none (when a rank could not allocate the buffer: every rank then fails) */
    if (err == 0)
        err = vocab->allreduce(vocab->handle, &gathered, 1, FH_GROUP_INT64, FH_GROUP_MIN);
    if (err == 0 && gathered) {
        err = vocab->allgather(vocab->handle, &size, sizes, (int64_t)sizeof size);
        for (int r = 0; err == 0 && r < vocab->size; r++) {
            total += sizes[r];
            offset += r < vocab->rank ? sizes[r] : 0;
        }
    }
    free(sizes);
    fh_status st = err != 0                ? FH_ERR_MPI
                   : worst[0]              ? FH_ERR_NULL_POINTER
                   : worst[1] || !gathered ? FH_ERR_OUT_OF_MEMORY
                   : worst[2]              ? FH_ERR_INVALID_SIZE
                                           : FH_OK;
    enum { S = 5 };
    int64_t shard[2 * S] = {offset, size, total, vocab->size, st};
    for (int k = 0; k < S; k++)
        shard[S + k] = ~shard[k];
    if (err == 0)
        err = data->allreduce(data->handle, shard, 2 * S, FH_GROUP_INT64, FH_GROUP_MAX);
    if (err != 0)
        st = FH_ERR_MPI;
    else if (shard[4] != FH_OK)
        st = (fh_status)shard[4]; /* the worst status of any vocab group */
    else
        for (int k = 0; k < 4; k++)
            if (shard[k] != ~shard[S + k])
                st = FH_ERR_MPI_LAYOUT;
    int64_t overall = st;
    if (err == 0)
        err = vocab->allreduce(vocab->handle, &overall, 1, FH_GROUP_INT64, FH_GROUP_MAX);
    if (err == 0 && overall == FH_OK && L) {
        L->vocab_offset = offset;
        L->total_vocab = total;
    }
    return err != 0 ? FH_ERR_MPI : (fh_status)overall;
}

FH_MPI_API fh_status fh_mpi_layout_create(MPI_Comm vocab_comm, MPI_Comm data_comm, int64_t local_vocab,
                                          fh_mpi_layout **layout)
{
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return FH_ERR_MPI;
    fh_mpi_layout *L = calloc(1, sizeof *L);
    /* Every rank makes the same collective calls whatever fails locally, and learns the outcome from
     * reduced values, so that all of them return the same status. The communicators are duplicated into the
     * layout (or stack variables, when the allocation failed) and the checks run over their groups. */
    MPI_Comm spare[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
    MPI_Comm *vocab = L ? &L->vocab_comm : &spare[0], *data = L ? &L->data_comm : &spare[1];
    *vocab = *data = MPI_COMM_NULL;
    int err = duplicate(vocab_comm, vocab);
    if (err == MPI_SUCCESS)
        err = duplicate(data_comm, data);
    if (err != MPI_SUCCESS) {
        if (*vocab != MPI_COMM_NULL)
            MPI_Comm_free(vocab);
        free(L);
        return FH_ERR_MPI;
    }
    fh_group vg, dg;
    fhm_group_over(vocab, &vg);
    fhm_group_over(data, &dg);
    const fh_status st = agree_on_layout(&vg, &dg, layout == NULL, L == NULL, local_vocab, L);
    if (st == FH_OK) {
        L->vocab = vg;
        L->data = dg;
        L->vocab_rank = vg.rank;
        L->vocab_ranks = vg.size;
        L->data_rank = dg.rank;
        L->data_ranks = dg.size;
        L->local_vocab = local_vocab;
        *layout = L;
        return FH_OK;
    }
    MPI_Comm_free(vocab);
    MPI_Comm_free(data);
    free(L);
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

FH_MPI_API fh_status fh_mpi_layout_destroy(fh_mpi_layout *layout)
{
    free_layout(layout);
    return FH_OK;
}

FH_MPI_API fh_status fh_mpi_layout_query(const fh_mpi_layout *L, fh_mpi_layout_info *info)
{
    if (!L || !info)
        return FH_ERR_NULL_POINTER;
    const fh_mpi_layout_info i = {L->vocab_rank, L->vocab_ranks, L->data_rank,  L->data_ranks,
                                  L->vocab_offset, L->local_vocab, L->total_vocab};
    *info = i;
    return FH_OK;
}

static const int param_max[FH_MPI_PARAM_COUNT] = {FH_MPI_STATS_MAX_THEN_SUM, FH_MPI_NO_REDUCTION,
                                                  FH_MPI_NO_REDUCTION};

FH_MPI_API fh_status fh_mpi_layout_set(fh_mpi_layout *L, fh_mpi_param param, int value)
{
    if (!L)
        return FH_ERR_NULL_POINTER;
    if ((unsigned)param >= FH_MPI_PARAM_COUNT)
        return FH_ERR_INVALID_PARAM;
    if (value < 0 || value > param_max[param])
        return FH_ERR_INVALID_PARAM_VALUE;
    L->params[param] = value;
    return FH_OK;
}

FH_MPI_API fh_status fh_mpi_layout_get(const fh_mpi_layout *L, fh_mpi_param param, int *value)
{
    if (!L || !value)
        return FH_ERR_NULL_POINTER;
    if ((unsigned)param >= FH_MPI_PARAM_COUNT)
        return FH_ERR_INVALID_PARAM;
    *value = L->params[param];
    return FH_OK;
}

FH_MPI_API fh_status fh_mpi_dx_rows(const fh_mpi_layout *L, int64_t n, int64_t *first, int64_t *count)
{
    if (!L || !first || !count)
        return FH_ERR_NULL_POINTER;
    if (n < 1)
        return FH_ERR_INVALID_SIZE;
    fhm_split(n, L->vocab_ranks, L->vocab_rank, first, count);
    return FH_OK;
}

FH_MPI_API fh_status fh_mpi_dweight_part(const fh_mpi_layout *L, int64_t hidden, int64_t *first, int64_t *count)
{
    if (!L || !first || !count)
        return FH_ERR_NULL_POINTER;
    int64_t elements;
    if (hidden < 1)
        return FH_ERR_INVALID_SIZE;
    if (__builtin_mul_overflow(hidden, L->local_vocab, &elements))
        return FH_ERR_SIZE_OVERFLOW;
    fhm_split(elements, L->data_ranks, L->data_rank, first, count);
    return FH_OK;
}

fh_status fhm_check_shard(const fh_mpi_layout *L, fh_context *ctx, const fh_linear *lin)
{
    if (lin->vocab != L->local_vocab)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "lin->vocab = %lld but this rank's shard has %lld columns",
                       (long long)lin->vocab, (long long)L->local_vocab);
    if (lin->n >= INT_MAX / FHM_RECORD)
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "lin->n = %lld is too large for MPI counts", (long long)lin->n);
    return FH_OK;
}

fh_status fhm_scratch(fh_mpi_layout *L, fh_context *ctx, size_t bytes, void **p)
{
    if (L->scratch_bytes < bytes) {
        const size_t rounded = (bytes + 63) / 64 * 64;
        void *fresh = aligned_alloc(64, rounded);
        if (!fresh)
            return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate %zu bytes of MPI scratch", bytes);
        free(L->scratch);
        L->scratch = fresh;
        L->scratch_bytes = rounded;
    }
    *p = L->scratch;
    return FH_OK;
}

void fhm_local_targets(const fh_mpi_layout *L, const int64_t *targets, int64_t n, const int64_t *ignore,
                       int64_t *local)
{
    const int64_t lo = L->vocab_offset, hi = L->vocab_offset + L->local_vocab;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = targets[i];
        local[i] = (!ignore || t != *ignore) && t >= lo && t < hi ? t - lo : -1;
    }
}
