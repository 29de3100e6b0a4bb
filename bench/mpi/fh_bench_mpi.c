/* fh_bench_mpi: vocab-parallel fused cross-entropy over MPI_COMM_WORLD (every rank a contiguous shard of
 * the vocabulary, the same tokens), against the single-process library on the whole vocabulary.
 *
 *   mpirun -np 2 fh_bench_mpi [--n 1024] [--hidden 1024] [--vocab 32768] [--threads 1] [--reps 5]
 *                             [--stats packed|max-then-sum] [--no-baseline] [--json]
 *
 * Calls: forward (fh_mpi_ce_forward), backward (fh_mpi_ce_backward from the forward's lse, dhidden
 * all-reduced), split (both) and train (fh_mpi_ce_forward_backward). Each is run once (warm-up, workspace
 * allocation) and then --reps times; a rep's time is the slowest rank's (barrier before, max after), the
 * best rep is reported. The baseline is the single-process library (fh_ce_forward, fh_ce_backward,
 * fh_ce_forward_backward) on rank 0 with the whole lm_head and the same threads, while the other ranks
 * sleep; speedup = baseline / vocab-parallel. Peak memory: each rank's VmHWM after the vocab-parallel
 * calls (before the baseline), with inputs and gradients. Then the statistics collectives alone: a
 * forward at the same n with hidden 8 and 16 vocabulary columns per rank, for each collective. */
#include <fusedhead.h>
#include <fusedhead_mpi.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct args {
    int64_t n, hidden, vocab;
    int threads, reps, stats, baseline, json;
} args;

enum { CALL_FORWARD, CALL_BACKWARD, CALL_SPLIT, CALL_TRAIN, CALL_COUNT };
static const char *call_names[CALL_COUNT] = {"forward", "backward", "split", "train"};

static int rank, ranks;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float value(uint64_t seed, uint64_t i)
{
    uint64_t z = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    z ^= z >> 29;
    return (float)((double)(z >> 40) / 16777216.0 * 2.0 - 1.0);
}

static int64_t peak_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int64_t kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0)
            kb = atoll(line + 6);
    if (f)
        fclose(f);
    return kb * 1024;
}

static void *alloc_floats(int64_t count)
{
    float *p = malloc(sizeof(float) * (size_t)count);
    if (!p) {
        fprintf(stderr, "rank %d: out of memory (%lld floats)\n", rank, (long long)count);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return p;
}

static void fail(fh_status st, fh_context *ctx, const char *what)
{
    if (st == FH_OK)
        return;
    const char *why = "";
    fh_context_message(ctx, &why);
    fprintf(stderr, "rank %d: %s: %s (%s)\n", rank, what, fh_status_string(st), why);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Waits at a barrier without spinning a core (the baseline runs meanwhile). */
static void sleepy_barrier(void)
{
    MPI_Request request;
    MPI_Ibarrier(MPI_COMM_WORLD, &request);
    int done = 0;
    const struct timespec pause = {0, 1000000};
    while (MPI_Test(&request, &done, MPI_STATUS_IGNORE), !done)
        nanosleep(&pause, NULL);
}

typedef struct problem {
    fh_linear lin;
    int64_t *targets;
    float *lse, *dx, *dw;
    double loss;
} problem;

/* This rank's shard [first, first + local) of a torch-layout [V, H] weight, generated from global indices. */
static problem make(const args *a, const float *x, int64_t first, int64_t local)
{
    problem p;
    float *w = alloc_floats(local * a->hidden);
    const float scale = 1.0f / sqrtf((float)a->hidden);
    for (int64_t v = 0; v < local; v++)
        for (int64_t k = 0; k < a->hidden; k++)
            w[v * a->hidden + k] = scale * value(2, (uint64_t)((first + v) * a->hidden + k));
    fh_linear_init(&p.lin, a->n, a->hidden, local, x, w, FH_LAYOUT_VH, NULL);
    p.targets = malloc(sizeof(int64_t) * (size_t)a->n);
    for (int64_t i = 0; i < a->n; i++)
        p.targets[i] = (int64_t)((value(3, (uint64_t)i) + 1.0f) * 0.5f * (float)a->vocab) % a->vocab;
    p.lse = alloc_floats(a->n);
    p.dx = alloc_floats(a->n * a->hidden);
    p.dw = alloc_floats(local * a->hidden);
    memset(p.dx, 0, sizeof(float) * (size_t)(a->n * a->hidden));
    memset(p.dw, 0, sizeof(float) * (size_t)(local * a->hidden));
    p.loss = 0.0;
    return p;
}

static void release(problem *p)
{
    free((void *)p->lin.weight);
    free(p->targets);
    free(p->lse);
    free(p->dx);
    free(p->dw);
}

/* One call; layout NULL runs the single-process library. */
static void run_call(int call, fh_context *ctx, fh_mpi_layout *L, problem *p)
{
    fh_ce_options o;
    fh_ce_options_init(&o);
    const float one = 1.0f;
    fh_ce_outputs out = {.loss = &p->loss, .lse = p->lse};
    fh_linear_grads g = {.dx = p->dx, .dx_row_stride = p->lin.hidden, .dweight = p->dw};
    fh_status st = FH_OK;
    if (call == CALL_FORWARD || call == CALL_SPLIT)
        st = L ? fh_mpi_ce_forward(ctx, L, &p->lin, p->targets, &o, &out) : fh_ce_forward(ctx, &p->lin, p->targets, &o, &out);
    fail(st, ctx, "forward");
    if (call == CALL_BACKWARD || call == CALL_SPLIT)
        st = L ? fh_mpi_ce_backward(ctx, L, &p->lin, p->targets, &o, p->lse, &one, &g)
               : fh_ce_backward(ctx, &p->lin, p->targets, &o, p->lse, &one, &g);
    fail(st, ctx, "backward");
    if (call == CALL_TRAIN)
        st = L ? fh_mpi_ce_forward_backward(ctx, L, &p->lin, p->targets, &o, &one, &out, &g)
               : fh_ce_forward_backward(ctx, &p->lin, p->targets, &o, &one, &out, &g);
    fail(st, ctx, "train step");
}

/* Best of reps of the slowest rank's time, and the first call's; comm: who takes part. */
static void time_call(const args *a, int call, fh_context *ctx, fh_mpi_layout *L, problem *p, MPI_Comm comm,
                      double *best, double *first)
{
    *best = INFINITY;
    for (int r = 0; r <= a->reps; r++) {
        MPI_Barrier(comm);
        const double t0 = now();
        run_call(call, ctx, L, p);
        double t = now() - t0;
        MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);
        if (r == 0)
            *first = t;
        else if (t < *best)
            *best = t;
    }
    if (a->reps == 0)
        *best = *first;
}

static int parse(int argc, char **argv, args *a)
{
    const args defaults = {1024, 1024, 32768, 1, 5, FH_MPI_STATS_PACKED, 1, 0};
    *a = defaults;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(s, "--n") && v)
            a->n = atoll(argv[++i]);
        else if (!strcmp(s, "--hidden") && v)
            a->hidden = atoll(argv[++i]);
        else if (!strcmp(s, "--vocab") && v)
            a->vocab = atoll(argv[++i]);
        else if (!strcmp(s, "--threads") && v)
            a->threads = atoi(argv[++i]);
        else if (!strcmp(s, "--reps") && v)
            a->reps = atoi(argv[++i]);
        else if (!strcmp(s, "--stats") && v)
            a->stats = !strcmp(argv[++i], "max-then-sum") ? FH_MPI_STATS_MAX_THEN_SUM : FH_MPI_STATS_PACKED;
        else if (!strcmp(s, "--no-baseline"))
            a->baseline = 0;
        else if (!strcmp(s, "--json"))
            a->json = 1;
        else
            return -1;
    }
    return a->n > 0 && a->hidden > 0 && a->vocab >= ranks && a->threads > 0 && a->reps >= 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    args a;
    if (parse(argc, argv, &a) != 0) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np P fh_bench_mpi [--n N] [--hidden H] [--vocab V] [--threads T] "
                            "[--reps R] [--stats packed|max-then-sum] [--no-baseline] [--json]\n");
        MPI_Finalize();
        return 2;
    }
    const int64_t first = a.vocab * rank / ranks, local = a.vocab * (rank + 1) / ranks - first;
    float *x = alloc_floats(a.n * a.hidden);
    for (int64_t i = 0; i < a.n * a.hidden; i++)
        x[i] = value(1, (uint64_t)i);
    fh_context *ctx;
    fh_context_create(&ctx);
    fh_context_set(ctx, FH_PARAM_THREADS, a.threads);
    fh_mpi_layout *L;
    fail(fh_mpi_layout_create(MPI_COMM_WORLD, MPI_COMM_NULL, local, &L), ctx, "fh_mpi_layout_create");
    fh_mpi_layout_set(L, FH_MPI_PARAM_STATS_COLLECTIVE, a.stats);

    fh_kernel_info kernels;
    fh_kernel_query(&kernels);
    if (rank == 0 && !a.json)
        printf("# BLIS kernels: %s, element-wise: %s; %d rank(s) x %d thread(s); N=%lld H=%lld V=%lld; stats "
               "collective: %s\n",
               kernels.kernel_set, kernels.elementwise, ranks, a.threads, (long long)a.n, (long long)a.hidden,
               (long long)a.vocab, a.stats == FH_MPI_STATS_PACKED ? "packed" : "max-then-sum");

    /* Vocab-parallel. */
    problem p = make(&a, x, first, local);
    double best[CALL_COUNT], first_time[CALL_COUNT], base[CALL_COUNT];
    for (int c = 0; c < CALL_COUNT; c++)
        time_call(&a, c, ctx, L, &p, MPI_COMM_WORLD, &best[c], &first_time[c]);
    const double loss_parallel = p.loss;
    int64_t peak = peak_rss_bytes();
    int64_t *peaks = malloc(sizeof(int64_t) * (size_t)ranks);
    MPI_Gather(&peak, 1, MPI_INT64_T, peaks, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    release(&p);

    /* Baseline: the single-process library on rank 0 with the whole vocabulary. */
    double loss_single = NAN;
    for (int c = 0; c < CALL_COUNT; c++)
        base[c] = NAN;
    if (a.baseline) {
        if (rank == 0) {
            problem whole = make(&a, x, 0, a.vocab);
            double unused;
            for (int c = 0; c < CALL_COUNT; c++)
                time_call(&a, c, ctx, NULL, &whole, MPI_COMM_SELF, &base[c], &unused);
            loss_single = whole.loss;
            release(&whole);
        }
        sleepy_barrier();
    }

    /* The statistics collectives alone: almost no GEMM work per rank. */
    double collective[2];
    {
        args tiny = a;
        tiny.hidden = 8;
        tiny.vocab = 16 * ranks;
        fh_mpi_layout *T;
        fail(fh_mpi_layout_create(MPI_COMM_WORLD, MPI_COMM_NULL, 16, &T), ctx, "fh_mpi_layout_create");
        float *tx = alloc_floats(a.n * 8);
        for (int64_t i = 0; i < a.n * 8; i++)
            tx[i] = value(5, (uint64_t)i);
        problem q = make(&tiny, tx, 16 * rank, 16);
        tiny.reps = a.reps > 20 ? a.reps : 20;
        for (int k = 0; k < 2; k++) {
            double unused;
            fh_mpi_layout_set(T, FH_MPI_PARAM_STATS_COLLECTIVE, k);
            time_call(&tiny, CALL_FORWARD, ctx, T, &q, MPI_COMM_WORLD, &collective[k], &unused);
        }
        release(&q);
        free(tx);
        fh_mpi_layout_destroy(T);
    }

    if (rank == 0) {
        if (a.json) {
            printf("{\"ranks\": %d, \"threads\": %d, \"n\": %lld, \"hidden\": %lld, \"vocab\": %lld, \"calls\": {", ranks,
                   a.threads, (long long)a.n, (long long)a.hidden, (long long)a.vocab);
            for (int c = 0; c < CALL_COUNT; c++)
                printf("%s\"%s\": {\"best_ms\": %.3f, \"first_ms\": %.3f, \"baseline_ms\": %.3f, \"speedup\": %.3f}",
                       c ? ", " : "", call_names[c], 1e3 * best[c], 1e3 * first_time[c], 1e3 * base[c],
                       base[c] / best[c]);
            printf("}, \"peak_rss_bytes\": [");
            for (int r = 0; r < ranks; r++)
                printf("%s%lld", r ? ", " : "", (long long)peaks[r]);
            printf("], \"stats_forward_ms\": {\"packed\": %.4f, \"max_then_sum\": %.4f}}\n", 1e3 * collective[0],
                   1e3 * collective[1]);
        } else {
            printf("%-9s %12s %12s %14s %8s\n", "call", "best_ms", "first_ms", "1-rank_lib_ms", "speedup");
            for (int c = 0; c < CALL_COUNT; c++)
                printf("%-9s %12.2f %12.2f %14.2f %8.2f\n", call_names[c], 1e3 * best[c], 1e3 * first_time[c],
                       1e3 * base[c], base[c] / best[c]);
            printf("loss: vocab-parallel %.9f, single process %.9f\n", loss_parallel, loss_single);
            for (int r = 0; r < ranks; r++)
                printf("rank %d peak RSS: %.1f MiB\n", r, (double)peaks[r] / (1 << 20));
            printf("statistics collective alone (forward at N=%lld, H=8, 16 columns per rank): packed %.3f ms, "
                   "max-then-sum %.3f ms\n",
                   (long long)a.n, 1e3 * collective[0], 1e3 * collective[1]);
        }
    }
    free(peaks);
    free(x);
    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    MPI_Finalize();
    return 0;
}
