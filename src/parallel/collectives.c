/* What every file of the layer uses on a group (fh_collectives): one-rank groups, the optional reduce-scatter, errors,
 * sums, maxima, splits. */
#include "parallel_internal.h"

#include "core/context.h"

#include <stdio.h>
#include <string.h>

static int one_rank_allreduce(void *handle, void *buffer, int64_t count, fh_collective_type type,
                              fh_collective_op op)
{
    (void)handle, (void)buffer, (void)count, (void)type, (void)op;
    return 0;
}

static int one_rank_allgather(void *handle, const void *send, void *receive, int64_t bytes)
{
    (void)handle;
    if (receive != send)
        memmove(receive, send, (size_t)bytes);
    return 0;
}

void fhp_one_rank(fh_collectives *group)
{
    const fh_collectives one = {NULL, 0, 1, one_rank_allreduce, one_rank_allgather, NULL, NULL, NULL};
    *group = one;
}

int fhp_reduce_scatter(const fh_collectives *group, float *buffer, float *receive, const int64_t *counts)
{
    if (group->reduce_scatter)
        return group->reduce_scatter(group->handle, buffer, receive, counts);
    int64_t total = 0, first = 0;
    for (int r = 0; r < group->size; r++) {
        total += counts[r];
        first += r < group->rank ? counts[r] : 0;
    }
    const int err = group->allreduce(group->handle, buffer, total, FH_COLLECTIVE_FLOAT, FH_COLLECTIVE_SUM);
    if (err == 0 && receive != buffer + first)
        memmove(receive, buffer + first, sizeof(float) * (size_t)counts[group->rank]);
    return err;
}

fh_status fhp_group_error(fh_context *ctx, const fh_collectives *group, int code, const char *what)
{
    char text[512] = "";
    if (group->describe)
        group->describe(group->handle, code, text, sizeof text);
    else
        snprintf(text, sizeof text, "code %d", code);
    return fh_fail(ctx, FH_ERR_MPI, "%s failed: %s", what, text);
}

void fhp_split(int64_t count, int parts, int r, int64_t *first, int64_t *size)
{
    const int64_t base = count / parts, extra = count % parts;
    *first = r * base + (r < extra ? r : extra);
    *size = base + (r < extra);
}

fh_status fhp_sum(fh_context *ctx, const fh_collectives *group, double *values, int64_t n)
{
    if (group->size == 1)
        return FH_OK;
    const int err = group->allreduce(group->handle, values, n, FH_COLLECTIVE_DOUBLE, FH_COLLECTIVE_SUM);
    return err == 0 ? FH_OK : fhp_group_error(ctx, group, err, "the all-reduce of sums");
}

fh_status fhp_max(fh_context *ctx, const fh_collectives *group, double *values, int64_t n)
{
    if (group->size == 1)
        return FH_OK;
    const int err = group->allreduce(group->handle, values, n, FH_COLLECTIVE_DOUBLE, FH_COLLECTIVE_MAX);
    return err == 0 ? FH_OK : fhp_group_error(ctx, group, err, "the all-reduce of maxima");
}
