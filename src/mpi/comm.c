/* MPI helpers every file of the module uses: error messages, sums, splits. */
#include "mpi_internal.h"

#include "core/context.h"

fh_status fhm_mpi_error(fh_context *ctx, int err, const char *what)
{
    char text[MPI_MAX_ERROR_STRING] = "";
    int length = 0;
    MPI_Error_string(err, text, &length);
    return fh_fail(ctx, FH_ERR_MPI, "%s failed: %s", what, text);
}

void fhm_split(int64_t count, int parts, int r, int64_t *first, int64_t *size)
{
    const int64_t base = count / parts, extra = count % parts;
    *first = r * base + (r < extra ? r : extra);
    *size = base + (r < extra);
}

int fhm_allreduce_sum(void *buf, int64_t count, MPI_Datatype type, MPI_Comm comm)
{
    int size = 0;
    MPI_Type_size(type, &size);
    const int64_t chunk = (int64_t)1 << 30;
    for (int64_t done = 0; done < count; done += chunk) {
        const int64_t now = count - done < chunk ? count - done : chunk;
        const int err = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + done * size, (int)now, type, MPI_SUM, comm);
        if (err != MPI_SUCCESS)
            return err;
    }
    return MPI_SUCCESS;
}

fh_status fhm_sum(fh_context *ctx, MPI_Comm comm, int ranks, double *values, int n)
{
    if (ranks == 1)
        return FH_OK;
    const int err = MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, MPI_SUM, comm);
    return err == MPI_SUCCESS ? FH_OK : fhm_mpi_error(ctx, err, "MPI_Allreduce (sums)");
}

fh_status fhm_max(fh_context *ctx, MPI_Comm comm, int ranks, double *values, int n)
{
    if (ranks == 1)
        return FH_OK;
    const int err = MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, MPI_MAX, comm);
    return err == MPI_SUCCESS ? FH_OK : fhm_mpi_error(ctx, err, "MPI_Allreduce (maxima)");
}
