/* fh_tune: sweeps tile sizes for a shape and thread count, prints the table, and saves the fastest
 * configuration of each call (streaming forward, streaming backward, train-step row blocks) as wisdom
 * that contexts load (fh_context_load_wisdom, or FH_WISDOM=path). Every configuration is timed best-of-k
 * after one warm-up call, on one context whose workspace is reused, as a trainer would run it. */
#include "bench_inputs.h"
#include "fusedhead.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct tune_args {
    int64_t n, hidden, vocab;
    int threads, reps;
    const char *wisdom;
    fh_dtype dtype;
} tune_args;

typedef struct problem {
    bench_inputs in;
    fh_linear lin;
    fh_ce_options options;
} problem;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int make_problem(const tune_args *a, problem *p)
{
    const int bf16 = a->dtype == FH_DTYPE_BF16;
    if (bench_inputs_make(a->n, a->hidden, a->vocab, &p->in) != 0 ||
        (bf16 && bench_inputs_add_bf16(a->n, a->hidden, a->vocab, &p->in) != 0))
        return -1;
    fh_linear_init(&p->lin, a->n, a->hidden, a->vocab, bf16 ? (const void *)p->in.x_bf16 : p->in.x,
                   bf16 ? (const void *)p->in.w_bf16 : p->in.w, FH_LAYOUT_HV, NULL);
    p->lin.x_dtype = p->lin.weight_dtype = a->dtype;
    fh_ce_options_init(&p->options);
    return 0;
}

static fh_status run_call(fh_context *ctx, fh_call call, problem *p)
{
    double loss;
    const float grad = 1.0f;
    fh_ce_outputs out = {&loss, NULL, NULL, NULL, p->in.lse, NULL, NULL, NULL};
    fh_linear_grads g = {.dx = p->in.dx, .dx_row_stride = p->lin.hidden, .dx_beta = 0.0f, .dweight = p->in.dw, .dweight_beta = 0.0f, .dbias = NULL, .dbias_beta = 0.0f};
    switch (call) {
    case FH_CALL_FORWARD: return fh_ce_forward(ctx, &p->lin, p->in.targets, &p->options, &out);
    case FH_CALL_BACKWARD: return fh_ce_backward(ctx, &p->lin, p->in.targets, &p->options, p->in.lse, &grad, &g);
    default: return fh_ce_forward_backward(ctx, &p->lin, p->in.targets, &p->options, &grad, &out, &g);
    }
}

/* Best-of-reps milliseconds for one configuration, or INFINITY if the library refuses it. */
static double time_config(const tune_args *a, problem *p, fh_call call, int64_t rows, int64_t cols)
{
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return INFINITY;
    fh_context_set(ctx, FH_PARAM_THREADS, a->threads);
    fh_context_set(ctx, FH_PARAM_TILE_ROWS, rows);
    fh_context_set(ctx, FH_PARAM_TILE_VOCAB, cols);
    /* The train step's rows are limited by the budget: make room for the largest candidate. */
    if (call == FH_CALL_TRAIN_STEP)
        fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, (int64_t)rows * a->vocab * 4 + ((int64_t)64 << 20));
    double best = INFINITY;
    if (call == FH_CALL_BACKWARD && run_call(ctx, FH_CALL_FORWARD, p) != FH_OK)
        best = NAN; /* lse for the backward */
    for (int k = 0; k <= a->reps && !isnan(best); k++) {
        const double t = now_ms();
        if (run_call(ctx, call, p) != FH_OK) {
            best = NAN;
            break;
        }
        const double ms = now_ms() - t;
        if (k > 0 && ms < best) /* k == 0 is the warm-up */
            best = ms;
    }
    fh_context_destroy(ctx);
    return isnan(best) ? INFINITY : best;
}

static const char *call_name(fh_call call)
{
    return call == FH_CALL_FORWARD ? "forward" : call == FH_CALL_BACKWARD ? "backward" : "train_step";
}

static void usage(void)
{
    fprintf(stderr, "usage: fh_tune [--n N] [--hidden H] [--vocab V] [--threads T] [--reps K] [--wisdom FILE]\n"
                    "               [--dtype f32|bf16]\n"
                    "  sweeps tile_rows x tile_vocab (streaming forward and backward) and the row-block height\n"
                    "  (train step); adds the fastest of each to FILE (default fusedhead.wisdom)\n");
}

int main(int argc, char **argv)
{
    tune_args a = {1024, 1024, 32768, 2, 2, "fusedhead.wisdom", FH_DTYPE_F32};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) {
            usage();
            return 2;
        }
        const char *k = argv[i], *v = argv[++i];
        if (strcmp(k, "--n") == 0)
            a.n = atoll(v);
        else if (strcmp(k, "--hidden") == 0)
            a.hidden = atoll(v);
        else if (strcmp(k, "--vocab") == 0)
            a.vocab = atoll(v);
        else if (strcmp(k, "--threads") == 0)
            a.threads = atoi(v);
        else if (strcmp(k, "--reps") == 0)
            a.reps = atoi(v);
        else if (strcmp(k, "--wisdom") == 0)
            a.wisdom = v;
        else if (strcmp(k, "--dtype") == 0 && (strcmp(v, "f32") == 0 || strcmp(v, "bf16") == 0))
            a.dtype = strcmp(v, "bf16") == 0 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
        else {
            usage();
            return 2;
        }
    }
    if (a.n < 1 || a.hidden < 1 || a.vocab < 1 || a.threads < 1 || a.reps < 1) {
        usage();
        return 2;
    }
    problem p;
    if (make_problem(&a, &p) != 0) {
        fprintf(stderr, "fh_tune: out of memory\n");
        return 1;
    }
    static const int64_t stream_rows[] = {256, 512, 1024, 2048};
    static const int64_t stream_cols[] = {1024, 2048, 4096, 8192};
    static const int64_t block_rows[] = {128, 256, 512, 1024};
    const double nhv = (double)a.n * a.hidden * a.vocab;
    printf("fh_tune: N=%lld H=%lld V=%lld, %s, %d threads, best of %d\n\n%-11s %10s %10s %10s %9s\n", (long long)a.n,
           (long long)a.hidden, (long long)a.vocab, a.dtype == FH_DTYPE_BF16 ? "bf16" : "fp32", a.threads, a.reps, "call", "tile_rows", "tile_vocab", "ms",
           "GFLOP/s");
    fh_tile_config best[3];
    for (int c = 0; c < 3; c++) {
        const fh_call call = (fh_call)c;
        const double flops = (call == FH_CALL_FORWARD ? 2.0 : 6.0) * nhv;
        double best_ms = INFINITY;
        const int row_count = 4, col_count = call == FH_CALL_TRAIN_STEP ? 1 : 4;
        for (int r = 0; r < row_count; r++)
            for (int k = 0; k < col_count; k++) {
                const int64_t rows = call == FH_CALL_TRAIN_STEP ? block_rows[r] : stream_rows[r];
                const int64_t cols = call == FH_CALL_TRAIN_STEP ? a.vocab : stream_cols[k];
                if ((rows > a.n && r > 0) || (cols > a.vocab && k > 0))
                    continue; /* the same as a smaller candidate once clipped to the shape */
                const double ms = time_config(&a, &p, call, rows, cols);
                printf("%-11s %10lld %10lld %10.1f %9.1f\n", call_name(call), (long long)rows, (long long)cols, ms,
                       flops / (ms * 1e6));
                fflush(stdout);
                if (ms < best_ms) {
                    best_ms = ms;
                    const fh_tile_config e = {a.threads, a.n, a.hidden, a.vocab, call, rows, cols, a.dtype};
                    best[c] = e;
                }
            }
        if (!isfinite(best_ms)) {
            fprintf(stderr, "fh_tune: no configuration of %s ran\n", call_name(call));
            return 1;
        }
    }
    /* Keep whatever the file already holds for other shapes. */
    fh_context *ctx = NULL;
    fh_status st = fh_context_create(&ctx);
    FILE *existing = st == FH_OK ? fopen(a.wisdom, "r") : NULL;
    if (existing) {
        fclose(existing);
        st = fh_context_load_wisdom(ctx, a.wisdom);
    }
    for (int c = 0; c < 3 && st == FH_OK; c++)
        st = fh_context_add_wisdom(ctx, &best[c]);
    if (st == FH_OK)
        st = fh_context_save_wisdom(ctx, a.wisdom);
    if (st != FH_OK) {
        const char *why = "";
        if (ctx)
            fh_context_message(ctx, &why);
        fprintf(stderr, "fh_tune: %s (%s)\n", fh_status_string(st), why);
        fh_context_destroy(ctx);
        return 1;
    }
    printf("\nbest: forward %lld x %lld, backward %lld x %lld, train step %lld rows -> %s\n",
           (long long)best[0].tile_rows, (long long)best[0].tile_vocab, (long long)best[1].tile_rows,
           (long long)best[1].tile_vocab, (long long)best[2].tile_rows, a.wisdom);
    fh_context_destroy(ctx);
    bench_inputs_free(&p.in);
    return 0;
}
