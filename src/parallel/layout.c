/* The fh_parallel_layout object: a grid of vocab x data groups (the caller's collectives), this rank's shard,
 * parameters, per-call scratch. */
#include "parallel_internal.h"

#include "core/context.h"

#include <limits.h>
#include <stdlib.h>

static void free_layout(fh_parallel_layout *L)
{
    if (!L)
        return;
    if (L->vocab.release)
        L->vocab.release(L->vocab.handle);
    if (L->data.release)
        L->data.release(L->data.handle);
    free(L->scratch);
    free(L);
}

/* The layout's checks, collective over both groups, with the same status on every rank: over vocab, [layout NULL,
 * out of memory, a size < 1] (a rank with a NULL layout joins too, so that every rank fails), the sum of the sizes
 * and this rank's offset (the lower ranks' sizes, from every rank's size gathered); over data, the same shard
 * everywhere ([offset, size, total, vocab ranks] as maxima of the values and of their complements, read as int64),
 * the vocab group's verdict, and every rank's vocab group the same size; then the data verdict back over vocab. L,
 * when not NULL, gets the offset and total. */
static fh_status agree_on_layout(const fh_collectives *vocab, const fh_collectives *data, int null_layout,
                                 int no_memory, int64_t local_vocab, fh_parallel_layout *L)
{
    int64_t worst[3] = {null_layout, no_memory, local_vocab < 1};
    int err = vocab->allreduce(vocab->handle, worst, 3, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MAX);
    const int64_t size = local_vocab > 0 ? local_vocab : 0;
    int64_t *sizes = err == 0 ? malloc(sizeof(int64_t) * (size_t)vocab->size) : NULL;
    int64_t total = 0, offset = 0, gathered = sizes != NULL;
    /* Every rank gathers, or none (when a rank could not allocate the buffer: every rank then fails) */
    if (err == 0)
        err = vocab->allreduce(vocab->handle, &gathered, 1, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MIN);
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
        err = data->allreduce(data->handle, shard, 2 * S, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MAX);
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
        err = vocab->allreduce(vocab->handle, &overall, 1, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MAX);
    if (err == 0 && overall == FH_OK && L) {
        L->vocab_offset = offset;
        L->total_vocab = total;
    }
    return err != 0 ? FH_ERR_MPI : (fh_status)overall;
}

/* A caller's group, checked (locally), or a one-rank group when group is NULL. */
static fh_status take_group(const fh_collectives *group, fh_collectives *taken)
{
    if (!group) {
        fhp_one_rank(taken);
        return FH_OK;
    }
    if (!group->allreduce || !group->allgather)
        return FH_ERR_NULL_POINTER;
    if (group->size < 1 || group->rank < 0 || group->rank >= group->size)
        return FH_ERR_MPI_LAYOUT;
    *taken = *group;
    return FH_OK;
}

FH_API fh_status fh_parallel_layout_create(const fh_collectives *vocab, const fh_collectives *data,
                                           int64_t local_vocab, fh_parallel_layout **layout)
{
    fh_collectives vg, dg;
    fh_status st = take_group(vocab, &vg);
    if (st == FH_OK)
        st = take_group(data, &dg);
    if (st != FH_OK)
        return st;
    /* Every rank makes the same collective calls whatever fails locally, and learns the outcome from reduced
     * values, so that all of them return the same status. */
    fh_parallel_layout *L = calloc(1, sizeof *L);
    st = agree_on_layout(&vg, &dg, layout == NULL, L == NULL, local_vocab, L);
    if (st != FH_OK) {
        free(L);
        return st;
    }
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

FH_API fh_status fh_parallel_layout_destroy(fh_parallel_layout *layout)
{
    free_layout(layout);
    return FH_OK;
}

FH_API fh_status fh_parallel_layout_query(const fh_parallel_layout *L, fh_parallel_layout_info *info)
{
    if (!L || !info)
        return FH_ERR_NULL_POINTER;
    const fh_parallel_layout_info i = {L->vocab_rank, L->vocab_ranks, L->data_rank,  L->data_ranks,
                                  L->vocab_offset, L->local_vocab, L->total_vocab};
    *info = i;
    return FH_OK;
}

static const int param_max[FH_PARALLEL_PARAM_COUNT] = {FH_PARALLEL_STATS_MAX_THEN_SUM, FH_PARALLEL_NO_REDUCTION,
                                                  FH_PARALLEL_NO_REDUCTION};

FH_API fh_status fh_parallel_layout_set(fh_parallel_layout *L, fh_parallel_param param, int value)
{
    if (!L)
        return FH_ERR_NULL_POINTER;
    if ((unsigned)param >= FH_PARALLEL_PARAM_COUNT)
        return FH_ERR_INVALID_PARAM;
    if (value < 0 || value > param_max[param])
        return FH_ERR_INVALID_PARAM_VALUE;
    L->params[param] = value;
    return FH_OK;
}

FH_API fh_status fh_parallel_layout_get(const fh_parallel_layout *L, fh_parallel_param param, int *value)
{
    if (!L || !value)
        return FH_ERR_NULL_POINTER;
    if ((unsigned)param >= FH_PARALLEL_PARAM_COUNT)
        return FH_ERR_INVALID_PARAM;
    *value = L->params[param];
    return FH_OK;
}

FH_API fh_status fh_parallel_dx_rows(const fh_parallel_layout *L, int64_t n, int64_t *first, int64_t *count)
{
    if (!L || !first || !count)
        return FH_ERR_NULL_POINTER;
    if (n < 1)
        return FH_ERR_INVALID_SIZE;
    fhp_split(n, L->vocab_ranks, L->vocab_rank, first, count);
    return FH_OK;
}

FH_API fh_status fh_parallel_dweight_part(const fh_parallel_layout *L, int64_t hidden, int64_t *first, int64_t *count)
{
    if (!L || !first || !count)
        return FH_ERR_NULL_POINTER;
    int64_t elements;
    if (hidden < 1)
        return FH_ERR_INVALID_SIZE;
    if (__builtin_mul_overflow(hidden, L->local_vocab, &elements))
        return FH_ERR_SIZE_OVERFLOW;
    fhp_split(elements, L->data_ranks, L->data_rank, first, count);
    return FH_OK;
}

fh_status fhp_check_shard(const fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin)
{
    if (lin->vocab != L->local_vocab)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "lin->vocab = %lld but this rank's shard has %lld columns",
                       (long long)lin->vocab, (long long)L->local_vocab);
    if (lin->n >= INT_MAX / FHP_RECORD)
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "lin->n = %lld is too large for the collectives' int counts",
                       (long long)lin->n);
    return FH_OK;
}

fh_status fhp_scratch(fh_parallel_layout *L, fh_context *ctx, size_t bytes, void **p)
{
    if (L->scratch_bytes < bytes) {
        const size_t rounded = (bytes + 63) / 64 * 64;
        void *fresh = aligned_alloc(64, rounded);
        if (!fresh)
            return fh_fail(ctx, FH_ERR_OUT_OF_MEMORY, "could not allocate %zu bytes of scratch for the parallel heads",
                           bytes);
        free(L->scratch);
        L->scratch = fresh;
        L->scratch_bytes = rounded;
    }
    *p = L->scratch;
    return FH_OK;
}

void fhp_local_targets(const fh_parallel_layout *L, const int64_t *targets, int64_t n, const int64_t *ignore,
                       int64_t *local)
{
    const int64_t lo = L->vocab_offset, hi = L->vocab_offset + L->local_vocab;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = targets[i];
        local[i] = (!ignore || t != *ignore) && t >= lo && t < hi ? t - lo : -1;
    }
}
