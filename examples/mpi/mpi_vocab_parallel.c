/* Vocab-parallel cross-entropy over MPI: each rank holds a contiguous shard of a torch-layout lm_head
 * ([V, H] rows), the same hidden states and targets, and gets the loss of the whole vocabulary, the
 * summed dhidden and the dweight of its own shard.
 *
 *   mpicc mpi_vocab_parallel.c -lfusedhead_mpi -lfusedhead -o mpi_vocab_parallel
 *   mpirun -np 2 ./mpi_vocab_parallel          (shards may be uneven: any rank count up to V)
 */
#include <fusedhead.h>
#include <fusedhead_mpi.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 64, H = 32, V = 1000 };

/* The full problem's values, generated from global indices so that every rank agrees. */
static float hidden_at(int64_t i) { return (float)((i * 37 % 101) - 50) / 50.0f; }
static float weight_at(int64_t v, int64_t k) { return (float)(((v * H + k) * 53 % 97) - 48) / 480.0f; }

int main(int argc, char **argv)
{
    int provided, rank, ranks;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided); /* contexts may use OpenMP threads */
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);

    /* This rank's shard of the vocabulary: rows [first, first + local) of the [V, H] weight. */
    const int64_t first = (int64_t)V * rank / ranks, local = (int64_t)V * (rank + 1) / ranks - first;
    fh_mpi_layout *layout = NULL;
    fh_status st = fh_mpi_layout_create(MPI_COMM_WORLD, MPI_COMM_NULL, local, &layout); /* vocab-parallel only */

    float *hidden = malloc(sizeof(float) * N * H), *weight = malloc(sizeof(float) * local * H);
    float *dhidden = malloc(sizeof(float) * N * H), *dweight = malloc(sizeof(float) * local * H);
    int64_t targets[N];
    for (int64_t i = 0; i < N * H; i++)
        hidden[i] = hidden_at(i);
    for (int64_t v = 0; v < local; v++)
        for (int64_t k = 0; k < H; k++)
            weight[v * H + k] = weight_at(first + v, k);
    for (int i = 0; i < N; i++)
        targets[i] = i % 7 == 0 ? -100 : (i * 31) % V; /* global vocabulary indices */

    fh_context *ctx = NULL;
    if (st == FH_OK)
        st = fh_context_create(&ctx);
    fh_linear lin;
    fh_linear_init(&lin, N, H, local, hidden, weight, FH_LAYOUT_VH, NULL); /* vocab = this shard's size */
    fh_ce_options options;
    fh_ce_options_init(&options);
    options.label_smoothing = 0.1; /* eps / V over the whole vocabulary, not per shard */
    options.z_loss = 1e-4;
    double loss = 0.0;
    const float grad_loss = 1.0f;
    fh_ce_outputs out = {.loss = &loss};
    fh_linear_grads grads = {.dx = dhidden, .dx_row_stride = H, .dweight = dweight}; /* dx summed over ranks */
    if (st == FH_OK)
        st = fh_mpi_ce_forward_backward(ctx, layout, &lin, targets, &options, &grad_loss, &out, &grads);
    if (st != FH_OK) {
        const char *why = "";
        fh_context_message(ctx, &why);
        fprintf(stderr, "rank %d: %s (%s)\n", rank, fh_status_string(st), why);
    }

    /* Rank 0 checks against the single-process library on the whole lm_head. */
    int ok = st == FH_OK;
    if (ok && rank == 0) {
        float *full = malloc(sizeof(float) * V * H), *dx1 = malloc(sizeof(float) * N * H);
        for (int64_t v = 0; v < V; v++)
            for (int64_t k = 0; k < H; k++)
                full[v * H + k] = weight_at(v, k);
        fh_linear whole;
        fh_linear_init(&whole, N, H, V, hidden, full, FH_LAYOUT_VH, NULL);
        double loss1 = 0.0;
        fh_ce_outputs out1 = {.loss = &loss1};
        fh_linear_grads g1 = {.dx = dx1, .dx_row_stride = H};
        ok = fh_ce_forward_backward(ctx, &whole, targets, &options, &grad_loss, &out1, &g1) == FH_OK &&
             fabs(loss - loss1) <= 1e-6 * fabs(loss1);
        double err = 0.0, ref = 0.0;
        for (int64_t i = 0; i < N * H; i++) {
            err += (dhidden[i] - dx1[i]) * (double)(dhidden[i] - dx1[i]);
            ref += dx1[i] * (double)dx1[i];
        }
        ok = ok && sqrt(err) <= 1e-5 * sqrt(ref);
        printf("%d ranks: loss %.6f (single process %.6f), dhidden relative error %.2e: %s\n", ranks, loss, loss1,
               sqrt(err / ref), ok ? "ok" : "MISMATCH");
        free(full);
        free(dx1);
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    fh_context_destroy(ctx);
    fh_mpi_layout_destroy(layout);
    free(hidden);
    free(weight);
    free(dhidden);
    free(dweight);
    MPI_Finalize();
    return ok ? 0 : 1;
}
