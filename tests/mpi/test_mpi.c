/* fusedhead_mpi against the single-process library: every rank builds the whole problem, computes the
 * single-process result itself (libfusedhead), then its share through fusedhead_mpi, and compares its
 * share: loss and metrics within 1e-6 relative, per-token outputs and gradients within 1e-5 normwise,
 * argmax exactly; bf16 inputs (a subset of the cases, where the library has oneDNN) against the single-process
 * bf16 result, gradients within 4e-3 normwise: shards change the GEMMs' shapes, and a logit one fp32 ulp apart
 * may round dZ to the neighbouring bf16 value (2^-8 relative, the bound of tests/cases/ce_case.c); with bf16 gradients
 * (summed in fp32 across ranks, rounded once) 2^-8 more, each element's own rounding. Layouts: vocab-parallel
 * over the world (uneven shards), data-parallel over the world
 * (uneven token batches), and a 2 x (size/2) grid when the size is even and >= 4.
 * Run: mpirun -np 2|3|4 fh_mpi_tests */
#include <fusedhead.h>
#include <fusedhead_mpi.h>

#include "bf16.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#define LOSS_TOL 1e-6
#define GRAD_TOL 1e-5
#define BF16_GRAD_TOL 4e-3

static int world_rank, world_size, failures, checks;
static char case_name[256];
/* > 0: gradient filtering at this eps, tail dropped, on the contexts make_context creates (filtered_ce_cases). */
static double filter_eps;

#define FAIL(...)                                                                                                    \
    do {                                                                                                             \
        failures++;                                                                                                  \
        fprintf(stderr, "[rank %d] FAIL %s: ", world_rank, case_name);                                              \
        fprintf(stderr, __VA_ARGS__);                                                                                \
        fprintf(stderr, "\n");                                                                                       \
    } while (0)

/* ---- helpers ----------------------------------------------------------------------------------- */

static double uniform(uint64_t seed, uint64_t i)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0; /* [-1, 1) */
}

static void *alloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return p;
}

static void check_status(const char *what, fh_status st, fh_context *ctx)
{
    checks++;
    if (st != FH_OK) {
        const char *why = "";
        if (ctx)
            fh_context_message(ctx, &why);
        FAIL("%s returned %d (%s): %s", what, (int)st, fh_status_string(st), why);
    }
}

static void check_scalar(const char *what, double got, double want, double tol)
{
    checks++;
    if (isnan(got) && isnan(want))
        return;
    const double scale = fabs(want) > 1e-9 ? fabs(want) : 1e-9;
    if (!(fabs(got - want) <= tol * scale))
        FAIL("%s = %.12g, single process %.12g (relative error %.3g)", what, got, want, fabs(got - want) / scale);
}

/* ||got - want|| / ||want||, both read as rows x cols floats with row strides. */
static void check_rows(const char *what, const float *got, int64_t got_stride, const float *want,
                       int64_t want_stride, int64_t rows, int64_t cols, double tol)
{
    checks++;
    double err = 0.0, ref = 0.0;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < cols; k++) {
            const double g = got[i * got_stride + k], w = want[i * want_stride + k];
            err += (g - w) * (g - w);
            ref += w * w;
        }
    err = sqrt(err);
    ref = sqrt(ref);
    if (!(err <= tol * (ref > 1e-30 ? ref : 1e-30)))
        FAIL("%s: normwise relative error %.3g (|ref| = %.3g)", what, err / (ref > 0 ? ref : 1), ref);
}

/* Element (k, j) of an [H, V] view stored in either layout. */
static int64_t at(fh_layout layout, int64_t h, int64_t v, int64_t k, int64_t j)
{
    return layout == FH_LAYOUT_HV ? k * v + j : j * h + k;
}

static void check_weight_shard(const char *what, const float *got, const float *want, fh_layout layout, int64_t h,
                               int64_t v, int64_t off, int64_t vl, double tol)
{
    float *a = alloc((size_t)(h * vl), sizeof(float)), *b = alloc((size_t)(h * vl), sizeof(float));
    for (int64_t k = 0; k < h; k++)
        for (int64_t j = 0; j < vl; j++) {
            a[k * vl + j] = got[at(layout, h, v, k, off + j)];
            b[k * vl + j] = want[at(layout, h, v, k, off + j)];
        }
    check_rows(what, a, vl, b, vl, h, vl, tol);
    free(a);
    free(b);
}

/* Part r of count split in proportion to (r + bias): contiguous, uneven. */
static void share(int64_t count, int parts, int r, int bias, int64_t *first, int64_t *size)
{
    int64_t total = 0, before = 0;
    for (int q = 0; q < parts; q++) {
        total += q + bias;
        if (q < r)
            before += q + bias;
    }
    *first = count * before / total;
    *size = count * (before + r + bias) / total - *first;
}

static fh_context *make_context(int small_tiles)
{
    fh_context *ctx;
    if (fh_context_create(&ctx) != FH_OK)
        MPI_Abort(MPI_COMM_WORLD, 3);
    fh_context_set(ctx, FH_PARAM_THREADS, 1);
    if (filter_eps > 0.0) {
        fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, filter_eps);
        fh_context_set(ctx, FH_PARAM_GRAD_FILTER_TAIL, FH_FILTER_TAIL_DROP);
    }
    if (small_tiles) {
        fh_context_set(ctx, FH_PARAM_TILE_ROWS, 16);
        fh_context_set(ctx, FH_PARAM_TILE_VOCAB, 32);
    }
    return ctx;
}

/* ---- layouts ----------------------------------------------------------------------------------- */

typedef struct config {
    const char *name;
    MPI_Comm vocab, data; /* the test's own communicators (MPI_COMM_SELF when absent) */
    int pv, pd, vr, dr;
} config;

static config make_config(const char *name, int vocab_ranks)
{
    config c = {name, MPI_COMM_NULL, MPI_COMM_NULL, 0, 0, 0, 0};
    MPI_Comm_split(MPI_COMM_WORLD, world_rank / vocab_ranks, world_rank, &c.vocab);
    MPI_Comm_split(MPI_COMM_WORLD, world_rank % vocab_ranks, world_rank, &c.data);
    MPI_Comm_size(c.vocab, &c.pv);
    MPI_Comm_size(c.data, &c.pd);
    MPI_Comm_rank(c.vocab, &c.vr);
    MPI_Comm_rank(c.data, &c.dr);
    return c;
}

static fh_mpi_layout *make_layout(const config *c, int64_t v, int64_t *off, int64_t *vl)
{
    share(v, c->pv, c->vr, 2, off, vl);
    fh_mpi_layout *L = NULL;
    /* Alternate between the C and the Fortran handles' constructors (every rank makes the same calls, so they
     * alternate alike): MPI_COMM_NULL stands for a missing kind. */
    static int made = 0;
    const MPI_Comm vocab = c->pv > 1 ? c->vocab : MPI_COMM_NULL, data = c->pd > 1 ? c->data : MPI_COMM_NULL;
    const int fortran = made++ % 2;
    const fh_status st = fortran ? fh_mpi_layout_create_fortran(MPI_Comm_c2f(vocab), MPI_Comm_c2f(data), *vl, &L)
                                 : fh_mpi_layout_create(vocab, data, *vl, &L);
    check_status(fortran ? "fh_mpi_layout_create_fortran" : "fh_mpi_layout_create", st, NULL);
    if (st != FH_OK)
        MPI_Abort(MPI_COMM_WORLD, 4);
    fh_mpi_layout_info info;
    fh_mpi_layout_query(L, &info);
    checks++;
    if (info.vocab_offset != *off || info.local_vocab != *vl || info.total_vocab != v || info.vocab_ranks != c->pv ||
        info.data_ranks != c->pd)
        FAIL("layout info: offset %lld local %lld total %lld ranks %d x %d", (long long)info.vocab_offset,
             (long long)info.local_vocab, (long long)info.total_vocab, info.vocab_ranks, info.data_ranks);
    return L;
}

/* ---- problems ---------------------------------------------------------------------------------- */

typedef struct problem {
    int64_t n, h, v;
    fh_layout layout;
    float *x, *w, *b, *cw;
    fh_dtype dtype;
    uint16_t *xb, *wb; /* bf16: x and w's bits (x and w then hold their bf16 values), else NULL */
    fh_dtype grad_dtype; /* of the fusedhead_mpi call's gradients */
} problem;

static void make_problem(problem *p, int64_t n, int64_t h, int64_t v, fh_layout layout, uint64_t seed, fh_dtype dtype)
{
    p->dtype = dtype;
    p->grad_dtype = FH_DTYPE_F32;
    p->xb = p->wb = NULL;
    p->n = n;
    p->h = h;
    p->v = v;
    p->layout = layout;
    p->x = alloc((size_t)(n * h), sizeof(float));
    p->w = alloc((size_t)(h * v), sizeof(float));
    p->b = alloc((size_t)v, sizeof(float));
    p->cw = alloc((size_t)v, sizeof(float));
    for (int64_t i = 0; i < n * h; i++)
        p->x[i] = (float)uniform(seed, (uint64_t)i);
    for (int64_t i = 0; i < h * v; i++)
        p->w[i] = (float)(0.6 * uniform(seed + 1, (uint64_t)i));
    for (int64_t j = 0; j < v; j++) {
        p->b[j] = (float)(0.3 * uniform(seed + 2, (uint64_t)j));
        p->cw[j] = (float)(1.0 + 0.5 * uniform(seed + 3, (uint64_t)j));
    }
    if (dtype == FH_DTYPE_BF16) {
        p->xb = alloc((size_t)(n * h), sizeof(uint16_t));
        p->wb = alloc((size_t)(h * v), sizeof(uint16_t));
        for (int64_t i = 0; i < n * h; i++)
            p->x[i] = bf16_to_float(p->xb[i] = bf16_from_float(p->x[i]));
        for (int64_t i = 0; i < h * v; i++)
            p->w[i] = bf16_to_float(p->wb[i] = bf16_from_float(p->w[i]));
    }
}

/* The library's gradient tolerance for the problem's dtypes (file comment); dbias sums the fp32 dU. */
static double grad_tol(const problem *p)
{
    return (p->dtype == FH_DTYPE_BF16 ? BF16_GRAD_TOL : GRAD_TOL) + (p->grad_dtype == FH_DTYPE_BF16 ? BF16_GRAD_TOL : 0.0);
}

static double dbias_tol(const problem *p)
{
    return GRAD_TOL + (p->grad_dtype == FH_DTYPE_BF16 ? BF16_GRAD_TOL : 0.0);
}

/* bf16 gradient buffers: the floats' values as bf16 bits before the call, read back into the floats after it. */
static uint16_t *bits_of(const float *values, int64_t count)
{
    uint16_t *bits = alloc((size_t)count, sizeof(uint16_t));
    for (int64_t i = 0; i < count; i++)
        bits[i] = bf16_from_float(values[i]);
    return bits;
}

static void read_back(uint16_t *bits, float *values, int64_t count)
{
    for (int64_t i = 0; i < count; i++)
        values[i] = bf16_to_float(bits[i]);
    free(bits);
}

static void free_problem(problem *p)
{
    free(p->x);
    free(p->w);
    free(p->b);
    free(p->cw);
    free(p->xb);
    free(p->wb);
}

/* Elements from the start of the problem's weight to the shard lin's first. */
static int64_t weight_offset(const problem *p, const fh_linear *lin)
{
    return p->dtype == FH_DTYPE_BF16 ? (const uint16_t *)lin->weight - p->wb : (const float *)lin->weight - p->w;
}

static int have_bf16(void)
{
    fh_kernel_info info;
    return fh_kernel_query(&info) == FH_OK && strcmp(info.bf16_gemm, "none") != 0;
}

/* This rank's view: tokens [n0, n0 + nr), vocabulary shard [off, off + vl). */
static fh_linear shard_linear(const problem *p, int64_t n0, int64_t nr, int64_t off, int64_t vl, int bias)
{
    const int bf16 = p->dtype == FH_DTYPE_BF16;
    const int64_t w_offset = p->layout == FH_LAYOUT_HV ? off : off * p->h;
    fh_linear l = {nr, p->h, vl, bf16 ? (const void *)(p->xb + n0 * p->h) : p->x + n0 * p->h, p->h,
                   bf16 ? (const void *)(p->wb + w_offset) : p->w + w_offset, 0, 0, bias ? p->b + off : NULL,
                   p->dtype, p->dtype};
    l.w_stride_hidden = p->layout == FH_LAYOUT_HV ? p->v : 1;
    l.w_stride_vocab = p->layout == FH_LAYOUT_HV ? 1 : p->h;
    return l;
}

static void fill_nan(float *a, int64_t count)
{
    for (int64_t i = 0; i < count; i++)
        a[i] = NAN;
}

static int all_finite(const float *a, int64_t count)
{
    for (int64_t i = 0; i < count; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

/* Gradient buffers of the problem's shapes, prefilled (beta 1: known values; beta 0: NaN garbage). */
typedef struct grads {
    float *dx, *dw, *db;
} grads;

static void prefill(float *a, int64_t count, int beta1, uint64_t seed)
{
    for (int64_t i = 0; i < count; i++)
        a[i] = beta1 ? (float)uniform(seed, (uint64_t)i) : NAN;
}

/* ---- cross-entropy ----------------------------------------------------------------------------- */

typedef struct ce_case {
    const char *name;
    int64_t n, h, v;
    fh_layout layout;
    int bias, class_weights;
    double ignore_frac;
    int64_t ignore_index;
    fh_reduction reduction;
    double label_smoothing, softcap, z_loss;
    int train_step;
    int stats;             /* fh_mpi_stats_collective */
    int dx_mode, dw_mode;  /* fh_mpi_reduction */
    int beta1;             /* accumulate into prefilled gradients */
    int dx_pad;            /* dx row stride h + dx_pad */
    int small_tiles;
    int block_rows;        /* > 0: a budget for this many rows of the widest shard on every rank (row blocks
                              whose heights differ across uneven shards: the ranks must agree) */
    int tight_rank;        /* the last rank's budget holds only streaming tiles: every rank must stream */
    int omit;              /* gradients left NULL: OMIT_DX | OMIT_DWEIGHT | OMIT_DBIAS */
    int in_place;          /* reduction none: per_token_loss written over this rank's grad_output */
} ce_case;

/* Set around ce_cases' scaled runs (as filter_eps around the filtered ones): fh_ce_options.logit_scale (0: 1),
 * token_scaling (DFT), and the entropy and correct outputs asked for (extras). */
static struct {
    double logit_scale;
    int token_scaling, extras;
} scaling;

enum { OMIT_DX = 1, OMIT_DWEIGHT = 2, OMIT_DBIAS = 4 };

static void run_ce(const config *cfg, const ce_case *c, fh_dtype dtype, fh_dtype grad_dtype)
{
    snprintf(case_name, sizeof case_name, "%s / ce %s%s%s%s%s%s%s", cfg->name, c->name,
             dtype == FH_DTYPE_BF16 ? " bf16" : "", grad_dtype == FH_DTYPE_BF16 ? ", bf16 gradients" : "",
             filter_eps > 0.0 ? ", filtered" : "", c->omit & OMIT_DX ? ", no dx" : "",
             c->omit & OMIT_DWEIGHT ? ", no dweight" : "", c->omit & OMIT_DBIAS ? ", no dbias" : "");
    if (c->in_place)
        strncat(case_name, ", per_token_loss over grad_output", sizeof case_name - strlen(case_name) - 1);
    if (scaling.logit_scale > 0.0 || scaling.token_scaling || scaling.extras) {
        char more[80];
        snprintf(more, sizeof more, ", logit_scale %g%s%s", scaling.logit_scale > 0.0 ? scaling.logit_scale : 1.0,
                 scaling.token_scaling ? ", DFT" : "", scaling.extras ? ", entropy and correct" : "");
        strncat(case_name, more, sizeof case_name - strlen(case_name) - 1);
    }
    problem p;
    make_problem(&p, c->n, c->h, c->v, c->layout, 1000 + (uint64_t)c->n + (uint64_t)c->v, dtype);
    p.grad_dtype = grad_dtype;
    const int64_t n = c->n, h = c->h, v = c->v;
    int64_t *targets = alloc((size_t)n, sizeof(int64_t));
    float *grad_out = alloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        targets[i] = 0.5 * (uniform(77, (uint64_t)i) + 1.0) < c->ignore_frac
                         ? c->ignore_index
                         : (int64_t)((uniform(78, (uint64_t)i) + 1.0) * 0.5 * (double)v) % v;
        grad_out[i] = (float)(0.75 + 0.5 * uniform(79, (uint64_t)i));
    }
    if (c->ignore_frac >= 1.0)
        for (int64_t i = 0; i < n; i++)
            targets[i] = c->ignore_index;
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.ignore_index = c->ignore_index;
    o.reduction = c->reduction;
    o.label_smoothing = c->label_smoothing;
    o.softcap = c->softcap;
    o.z_loss = c->z_loss;
    o.class_weights = c->class_weights ? p.cw : NULL;
    o.logit_scale = scaling.logit_scale > 0.0 ? scaling.logit_scale : 1.0;
    o.token_scaling = scaling.token_scaling;
    const float *grad_output = c->reduction == FH_REDUCTION_NONE ? grad_out : grad_out + 1;

    /* The single process on the whole problem. */
    fh_context *ctx = make_context(c->small_tiles);
    const fh_linear full = shard_linear(&p, 0, n, 0, v, c->bias);
    double ref_loss = 0.0, ref_zl = 0.0;
    float *ref_ptl = alloc((size_t)n, 4), *ref_logp = alloc((size_t)n, 4), *ref_lse = alloc((size_t)n, 4);
    int64_t *ref_argmax = alloc((size_t)n, 8), ref_correct = -1;
    float *ref_entropy = alloc((size_t)n, 4);
    grads ref = {alloc((size_t)(n * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    fh_ce_outputs rout = {&ref_loss, &ref_zl, ref_ptl, ref_logp, ref_lse, ref_argmax,
                          scaling.extras ? ref_entropy : NULL, scaling.extras ? &ref_correct : NULL};
    fh_linear_grads rg = {.dx = ref.dx, .dx_row_stride = h, .dx_beta = 0.0f, .dweight = ref.dw, .dweight_beta = 0.0f, .dbias = c->bias ? ref.db : NULL, .dbias_beta = 0.0f};
    check_status("reference fh_ce_forward_backward", fh_ce_forward_backward(ctx, &full, targets, &o, grad_output, &rout, &rg),
                 ctx);
    if (c->beta1) { /* expected = previous + gradient */
        float *prev = alloc((size_t)(n * h), 4);
        prefill(prev, n * h, 1, 11);
        for (int64_t i = 0; i < n * h; i++)
            ref.dx[i] += prev[i];
        free(prev);
        prev = alloc((size_t)(h * v), 4);
        prefill(prev, h * v, 1, 12);
        for (int64_t i = 0; i < h * v; i++)
            ref.dw[i] += prev[i];
        free(prev);
        prev = alloc((size_t)v, 4);
        prefill(prev, v, 1, 13);
        for (int64_t i = 0; i < v; i++)
            ref.db[i] += prev[i];
        free(prev);
    }

    /* This rank's share through fusedhead_mpi. */
    int64_t off, vl, n0, nr;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    share(n, cfg->pd, cfg->dr, 1, &n0, &nr);
    fh_mpi_layout_set(L, FH_MPI_PARAM_STATS_COLLECTIVE, c->stats);
    fh_mpi_layout_set(L, FH_MPI_PARAM_DX_REDUCTION, c->dx_mode);
    fh_mpi_layout_set(L, FH_MPI_PARAM_DWEIGHT_REDUCTION, c->dw_mode);
    fh_ce_options lo = o;
    lo.class_weights = c->class_weights ? p.cw + off : NULL;
    const fh_linear lin = shard_linear(&p, n0, nr, off, vl, c->bias);
    if (c->block_rows > 0) {
        /* The widest shard (the last: shares grow with the rank) fits block_rows rows; a row parameter of
         * nr lifts the 256-row minimum of budget-sized blocks without capping them. */
        int64_t off_w, vl_w;
        size_t bytes = 0;
        share(v, cfg->pv, cfg->pv - 1, 2, &off_w, &vl_w);
        const fh_linear widest = shard_linear(&p, n0, nr, off_w, vl_w, c->bias);
        check_status("set tile rows", fh_context_set(ctx, FH_PARAM_TILE_ROWS, c->block_rows), ctx);
        check_status("row-block workspace size", fh_ce_forward_backward_workspace_size(ctx, &widest, &lo, &bytes),
                     ctx);
        check_status("set budget", fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, (int64_t)bytes), ctx);
        check_status("set tile rows", fh_context_set(ctx, FH_PARAM_TILE_ROWS, nr), ctx);
    }
    if (c->tight_rank && world_rank == world_size - 1) {
        /* Exactly the streaming workspace of 4 x 16 tiles: not one row of the shard fits. */
        size_t bytes = 0;
        check_status("set tile rows", fh_context_set(ctx, FH_PARAM_TILE_ROWS, 4), ctx);
        check_status("set tile vocab", fh_context_set(ctx, FH_PARAM_TILE_VOCAB, 16), ctx);
        check_status("streaming workspace size", fh_ce_workspace_size(ctx, &lin, &lo, &bytes), ctx);
        check_status("set budget", fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, (int64_t)bytes), ctx);
    }
    double loss = NAN, zl = NAN;
    float *ptl = alloc((size_t)nr, 4), *logp = alloc((size_t)nr, 4), *lse = alloc((size_t)nr, 4);
    int64_t *argmax = alloc((size_t)nr, 8), correct = -2;
    float *entropy = alloc((size_t)nr, 4);
    int64_t dx_first = 0, dx_rows = nr;
    if (c->dx_mode == FH_MPI_REDUCE_SCATTER && cfg->pv > 1)
        fh_mpi_dx_rows(L, nr, &dx_first, &dx_rows);
    const int64_t dx_stride = h + c->dx_pad;
    grads mine = {alloc((size_t)(nr * dx_stride), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    {
        float *prev = alloc((size_t)(n * h), 4);
        prefill(prev, n * h, c->beta1, 11);
        for (int64_t i = 0; i < dx_rows; i++)
            for (int64_t k = 0; k < dx_stride; k++)
                mine.dx[i * dx_stride + k] = k < h ? prev[(n0 + dx_first + i) * h + k] : 123.0f;
        free(prev);
    }
    prefill(mine.dw, h * v, c->beta1, 12);
    prefill(mine.db, v, c->beta1, 13);
    const float beta = c->beta1 ? 1.0f : 0.0f;
    const int bf16_grads = grad_dtype == FH_DTYPE_BF16;
    uint16_t *bits[3] = {NULL, NULL, NULL};
    if (bf16_grads) {
        bits[0] = bits_of(mine.dx, nr * dx_stride);
        bits[1] = bits_of(mine.dw, h * v);
        bits[2] = bits_of(mine.db, v);
    }
    fh_linear_grads g = {.dx = bf16_grads ? (void *)bits[0] : mine.dx, .dx_row_stride = dx_stride, .dx_beta = beta,
                         .dweight = bf16_grads ? (void *)(bits[1] + weight_offset(&p, &lin)) : mine.dw + weight_offset(&p, &lin),
                         .dweight_beta = beta,
                         .dbias = c->bias ? (bf16_grads ? (void *)(bits[2] + off) : mine.db + off) : NULL,
                         .dbias_beta = beta, .dx_dtype = grad_dtype, .dweight_dtype = grad_dtype, .dbias_dtype = grad_dtype};
    if (c->omit & OMIT_DX)
        g.dx = NULL;
    if (c->omit & OMIT_DWEIGHT)
        g.dweight = NULL;
    if (c->omit & OMIT_DBIAS)
        g.dbias = NULL;
    fh_ce_outputs out = {&loss, &zl, ptl, logp, lse, argmax, scaling.extras ? entropy : NULL,
                         scaling.extras ? &correct : NULL};
    const float *local_grad = c->reduction == FH_REDUCTION_NONE ? grad_out + n0 : grad_output;
    if (c->in_place) { /* the rank's upstream gradient in the per_token_loss buffer, which the step overwrites */
        memcpy(ptl, grad_out + n0, (size_t)nr * sizeof(float));
        local_grad = ptl;
    }
    if (c->train_step) {
        check_status("fh_mpi_ce_forward_backward",
                     fh_mpi_ce_forward_backward(ctx, L, &lin, targets + n0, &lo, local_grad, &out, &g), ctx);
    } else {
        check_status("fh_mpi_ce_forward", fh_mpi_ce_forward(ctx, L, &lin, targets + n0, &lo, &out), ctx);
        check_status("fh_mpi_ce_backward",
                     fh_mpi_ce_backward(ctx, L, &lin, targets + n0, &lo, lse, local_grad, &g), ctx);
    }
    if (bf16_grads) {
        read_back(bits[0], mine.dx, nr * dx_stride);
        read_back(bits[1], mine.dw, h * v);
        read_back(bits[2], mine.db, v);
    }
    check_scalar("loss", loss, ref_loss, LOSS_TOL);
    check_scalar("z_loss", zl, ref_zl, LOSS_TOL);
    check_rows("per_token_loss", ptl, 1, ref_ptl + n0, 1, nr, 1, GRAD_TOL);
    check_rows("per_token_logp", logp, 1, ref_logp + n0, 1, nr, 1, GRAD_TOL);
    check_rows("lse", lse, 1, ref_lse + n0, 1, nr, 1, GRAD_TOL);
    if (scaling.extras) {
        /* Entropy as the per-token values; the correct count is the whole batch's, of argmaxes that agree exactly. */
        check_rows("entropy", entropy, 1, ref_entropy + n0, 1, nr, 1, GRAD_TOL);
        checks++;
        if (correct != ref_correct)
            FAIL("correct = %lld, single process %lld", (long long)correct, (long long)ref_correct);
    }
    checks++;
    for (int64_t i = 0; i < nr; i++)
        if (argmax[i] != ref_argmax[n0 + i]) {
            FAIL("argmax[%lld] = %lld, single process %lld", (long long)(n0 + i), (long long)argmax[i],
                 (long long)ref_argmax[n0 + i]);
            break;
        }
    /* dx: the partial sums of FH_MPI_NO_REDUCTION are summed here. */
    if (c->dx_mode == FH_MPI_NO_REDUCTION && cfg->pv > 1)
        for (int64_t i = 0; i < nr; i++)
            MPI_Allreduce(MPI_IN_PLACE, mine.dx + i * dx_stride, (int)h, MPI_FLOAT, MPI_SUM, cfg->vocab);
    if (!(c->dx_mode == FH_MPI_NO_REDUCTION && cfg->pv > 1 && c->beta1) && !(c->omit & OMIT_DX))
        check_rows("dx", mine.dx, dx_stride, ref.dx + (n0 + dx_first) * h, h, dx_rows, h, grad_tol(&p));
    /* beta 1 partials: prev counted pv times; an omitted gradient: its buffer as it was (NaN, or prev). */
    checks++;
    for (int64_t i = 0; i < dx_rows && c->dx_pad; i++)
        if (mine.dx[i * dx_stride + h] != 123.0f) {
            FAIL("dx padding overwritten");
            break;
        }
    if (c->dw_mode == FH_MPI_NO_REDUCTION && cfg->pd > 1 && !c->beta1) {
        MPI_Allreduce(MPI_IN_PLACE, mine.dw, (int)(h * v), MPI_FLOAT, MPI_SUM, cfg->data); /* NaN outside the shard */
        MPI_Allreduce(MPI_IN_PLACE, mine.db, (int)v, MPI_FLOAT, MPI_SUM, cfg->data);
    }
    if (c->omit & OMIT_DWEIGHT) {
        /* not written: checked below with dbias */
    } else if (c->dw_mode == FH_MPI_REDUCE_SCATTER && cfg->pd > 1) {
        int64_t first, count;
        fh_mpi_dweight_part(L, h, &first, &count);
        const float *base = mine.dw + weight_offset(&p, &lin), *want = ref.dw + weight_offset(&p, &lin);
        check_rows("dweight part", base + first, 1, want + first, 1, count, 1, grad_tol(&p));
    } else if (!(c->dw_mode == FH_MPI_NO_REDUCTION && cfg->pd > 1 && c->beta1)) {
        check_weight_shard("dweight", mine.dw, ref.dw, c->layout, h, v, off, vl, grad_tol(&p));
    }
    if (c->bias && !(c->dw_mode == FH_MPI_NO_REDUCTION && cfg->pd > 1 && c->beta1) && !(c->omit & OMIT_DBIAS))
        check_rows("dbias", mine.db + off, 1, ref.db + off, 1, vl, 1, dbias_tol(&p));
    /* Omitted gradients' buffers are left as they were (NaN-filled with beta 0: dx's rows this rank holds). */
    const struct {
        int bit;
        const float *buffer;
        int64_t count;
    } omitted[] = {{OMIT_DX, mine.dx, dx_rows * dx_stride}, {OMIT_DWEIGHT, mine.dw, h * v}, {OMIT_DBIAS, mine.db, v}};
    for (size_t k = 0; k < sizeof omitted / sizeof omitted[0]; k++)
        for (int64_t i = 0; (c->omit & omitted[k].bit) && !c->beta1 && i < omitted[k].count; i++)
            if (!isnan(omitted[k].buffer[i]) && !(omitted[k].bit == OMIT_DX && omitted[k].buffer[i] == 123.0f)) {
                FAIL("an omitted gradient's buffer was written at %lld", (long long)i);
                break;
            }

    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    free(ptl);
    free(logp);
    free(lse);
    free(argmax);
    free(entropy);
    free(mine.dx);
    free(mine.dw);
    free(mine.db);
    free(ref.dx);
    free(ref.dw);
    free(ref.db);
    free(ref_ptl);
    free(ref_logp);
    free(ref_lse);
    free(ref_argmax);
    free(ref_entropy);
    free(targets);
    free(grad_out);
    free_problem(&p);
}

static void ce_cases(const config *cfg)
{
    const ce_case cases[] = {
        /* name, n h v, layout, bias cw, ignore, ignore_index, reduction, eps softcap zloss, train, stats,
         * dx dw, beta1, pad, small tiles, block rows, tight rank, omit, in place */
        {"mean split vh", 67, 24, 301, FH_LAYOUT_VH, 0, 0, 0.0, -100, FH_REDUCTION_MEAN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
         0, 0, 0, 0},
        {"mean train vh", 67, 24, 301, FH_LAYOUT_VH, 1, 0, 0.1, -100, FH_REDUCTION_MEAN, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1,
         0, 0, 0, 0},
        {"smoothing+class weights hv", 80, 20, 257, FH_LAYOUT_HV, 1, 1, 0.2, -100, FH_REDUCTION_MEAN, 0.1, 0, 0, 0, 0,
         0, 0, 0, 0, 1, 0, 0, 0, 0},
        {"smoothing+class weights train", 80, 20, 257, FH_LAYOUT_VH, 1, 1, 0.2, -100, FH_REDUCTION_MEAN, 0.15, 0, 0, 1,
         0, 0, 0, 0, 0, 1, 0, 0, 0, 0},
        {"smoothing+class weights max-then-sum", 80, 20, 257, FH_LAYOUT_VH, 1, 1, 0.2, -100, FH_REDUCTION_MEAN, 0.1, 0,
         0, 0, FH_MPI_STATS_MAX_THEN_SUM, 0, 0, 0, 0, 1, 0, 0, 0, 0},
        {"z-loss softcap sum", 50, 16, 190, FH_LAYOUT_HV, 1, 0, 0.1, -100, FH_REDUCTION_SUM, 0, 3.0, 1e-3, 0, 0, 0, 0,
         0, 0, 1, 0, 0, 0, 0},
        {"z-loss softcap train sum", 50, 16, 190, FH_LAYOUT_VH, 0, 1, 0.1, -100, FH_REDUCTION_SUM, 0.05, 3.0, 1e-3, 1,
         0, 0, 0, 0, 0, 1, 0, 0, 0, 0},
        {"none per-token grads", 45, 16, 170, FH_LAYOUT_VH, 1, 1, 0.2, -100, FH_REDUCTION_NONE, 0.1, 0, 1e-4, 0, 0, 0,
         0, 0, 0, 1, 0, 0, 0, 0},
        {"none train max-then-sum", 45, 16, 170, FH_LAYOUT_HV, 1, 0, 0.2, -100, FH_REDUCTION_NONE, 0, 0, 1e-4, 1,
         FH_MPI_STATS_MAX_THEN_SUM, 0, 0, 0, 0, 1, 0, 0, 0, 0},
        {"in-range ignore_index", 60, 16, 150, FH_LAYOUT_VH, 0, 1, 0.3, 7, FH_REDUCTION_MEAN, 0.1, 0, 0, 0, 0, 0, 0, 0,
         0, 1, 0, 0, 0, 0},
        {"all ignored", 30, 8, 100, FH_LAYOUT_VH, 1, 0, 1.0, -100, FH_REDUCTION_MEAN, 0.1, 0, 1e-3, 1, 0, 0, 0, 0, 0,
         1, 0, 0, 0, 0},
        {"reduce-scatter dx+dw", 70, 24, 230, FH_LAYOUT_VH, 1, 0, 0.1, -100, FH_REDUCTION_MEAN, 0, 0, 0, 0, 0,
         FH_MPI_REDUCE_SCATTER, FH_MPI_REDUCE_SCATTER, 0, 0, 1, 0, 0, 0, 0},
        {"reduce-scatter beta 1 strided dx", 70, 24, 230, FH_LAYOUT_VH, 1, 0, 0.1, -100, FH_REDUCTION_MEAN, 0, 0, 0, 1,
         0, FH_MPI_REDUCE_SCATTER, FH_MPI_REDUCE_SCATTER, 1, 3, 1, 0, 0, 0, 0},
        {"allreduce beta 1 strided dx hv", 70, 24, 230, FH_LAYOUT_HV, 1, 1, 0.1, -100, FH_REDUCTION_MEAN, 0.1, 0, 0, 0,
         0, 0, 0, 1, 5, 1, 0, 0, 0, 0},
        {"no reduction", 70, 24, 230, FH_LAYOUT_HV, 1, 0, 0.1, -100, FH_REDUCTION_MEAN, 0, 0, 0, 0, 0,
         FH_MPI_NO_REDUCTION, FH_MPI_NO_REDUCTION, 0, 0, 1, 0, 0, 0, 0},
        {"default tiles train", 130, 40, 700, FH_LAYOUT_VH, 1, 1, 0.1, -100, FH_REDUCTION_MEAN, 0.1, 0, 1e-4, 1, 0, 0,
         0, 0, 0, 0, 0, 0, 0, 0},
        {"row blocks of uneven heights smoothing+class weights", 100, 16, 301, FH_LAYOUT_VH, 1, 1, 0.15, -100,
         FH_REDUCTION_MEAN, 0.1, 0, 1e-3, 1, 0, 0, 0, 0, 0, 0, 15, 0, 0, 0},
        {"row blocks of uneven heights none beta 1", 90, 16, 280, FH_LAYOUT_HV, 0, 1, 0.2, 5, FH_REDUCTION_NONE, 0.2,
         2.0, 1e-4, 1, FH_MPI_STATS_MAX_THEN_SUM, 0, 0, 1, 2, 0, 12, 0, 0, 0},
        {"row blocks of uneven heights sum reduce-scatter", 77, 16, 260, FH_LAYOUT_VH, 1, 1, 0.1, -100,
         FH_REDUCTION_SUM, 0, 0, 1e-3, 1, 0, FH_MPI_REDUCE_SCATTER, FH_MPI_REDUCE_SCATTER, 0, 0, 0, 20, 0, 0, 0},
        {"streaming fallback on one rank", 70, 16, 300, FH_LAYOUT_VH, 1, 1, 0.2, -100, FH_REDUCTION_MEAN, 0.1, 0,
         1e-3, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0},
        {"streaming fallback on one rank sum", 64, 16, 290, FH_LAYOUT_HV, 0, 1, 0.1, 3, FH_REDUCTION_SUM, 0.05, 0,
         0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0},
        /* H > N and shards of two dU chunks or more: a bf16 train step keeps the first chunk in the memory of the
         * dweight the engine writes (the caller's, or the fp32 staging buffer of a data-parallel reduction). */
        {"train step with scratch in dweight", 30, 160, 20000, FH_LAYOUT_VH, 1, 0, 0.1, -100, FH_REDUCTION_MEAN, 0.1,
         0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        run_ce(cfg, &cases[k], FH_DTYPE_F32, FH_DTYPE_F32);
    /* In place: reduction none's per_token_loss over grad_output, in row blocks and on the streaming fallback. */
    for (int tight = 0; tight < 2; tight++) {
        ce_case c = cases[8];
        c.in_place = 1;
        c.tight_rank = tight;
        run_ce(cfg, &c, FH_DTYPE_F32, FH_DTYPE_F32);
    }
    /* Every subset of the gradients (NULL skips one), on the split pair and the train step, with either dx
     * reduction: the loss and the gradients asked for as with all three, the others untouched. */
    static const size_t subset_cases[] = {0, 1, 11};
    for (size_t k = 0; k < sizeof subset_cases / sizeof subset_cases[0]; k++)
        for (int omit = 1; omit < 8; omit++) {
            ce_case c = cases[subset_cases[k]];
            c.omit = omit;
            run_ce(cfg, &c, FH_DTYPE_F32, FH_DTYPE_F32);
        }
    /* logit_scale (with softcap), DFT, the entropy and the correct count: the split pair (DFT's target logits from the
     * shard that holds each target, summed over the vocab communicator), the train step, both statistics
     * collectives, every reduction, row blocks of uneven heights, the streaming fallback on one rank; fp32 and
     * bf16. */
    static const size_t scaled_cases[] = {0, 4, 6, 8, 17, 19};
    for (size_t k = 0; k < sizeof scaled_cases / sizeof scaled_cases[0]; k++) {
        const ce_case *c = &cases[scaled_cases[k]];
        scaling.logit_scale = k % 2 ? 0.5 : 2.0;
        scaling.token_scaling = k != 3;
        scaling.extras = 1;
        run_ce(cfg, c, FH_DTYPE_F32, FH_DTYPE_F32);
        if (have_bf16() && k % 3 == 0)
            run_ce(cfg, c, FH_DTYPE_BF16, (fh_dtype)(k / 3));
    }
    memset(&scaling, 0, sizeof scaling);
    /* bf16: split and train step, row blocks of uneven heights, the streaming fallback, reduce-scatter, scratch in
     * dweight. */
    static const size_t bf16_cases[] = {0, 3, 12, 16, 19, 21};
    for (size_t k = 0; have_bf16() && k < sizeof bf16_cases / sizeof bf16_cases[0]; k++)
        for (int grad_dtype = 0; grad_dtype < 2; grad_dtype++)
            run_ce(cfg, &cases[bf16_cases[k]], FH_DTYPE_BF16, (fh_dtype)grad_dtype);
    /* Gradient filtering over vocabulary shards: the train step, where every rank holds every row in the single
     * process's row blocks, so that a column is kept or dropped as there (the marks are per column) and the results
     * agree within the usual tolerances. (A split pair filters per row tile, which the single process's train step,
     * the reference here, does not share.) Tail dropped: the estimate's per-tile sums depend on where tiles
     * start, which shards move. eps 1/32 keeps roughly a third of these random logits' columns. Label smoothing
     * with class weights (the c w term over the skipped columns), softcap, reduce-scatter with beta 1. */
    static const size_t filtered_cases[] = {1, 3, 6, 12};
    if (cfg->pd == 1) {
        filter_eps = 1.0 / 32.0;
        for (size_t k = 0; k < sizeof filtered_cases / sizeof filtered_cases[0]; k++)
            run_ce(cfg, &cases[filtered_cases[k]], FH_DTYPE_F32, FH_DTYPE_F32);
        filter_eps = 0.0;
    }
}

/* ---- GRPO -------------------------------------------------------------------------------------- */

typedef struct grpo_case {
    fh_grpo_loss_type loss_type;
    fh_grpo_is_level level;
    double beta, entropy_coef, temperature, delta;
    int old, split, bias;
    fh_layout layout;
    int omit; /* gradients left NULL (OMIT_*) */
    /* TRL's newer options: the sampler's log-probs with a vLLM importance-sampling mode (-1: none), the top-entropy
     * quantile (< 1 streams: its threshold is reduced over the data ranks), the off-policy threshold (NaN: off), the
     * bias-corrected KL. */
    int is_mode;
    double top_entropy_quantile, off_policy, bias_kl;
} grpo_case;

static const char *loss_names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};

static void run_grpo(const config *cfg, const grpo_case *c, fh_dtype dtype)
{
    snprintf(case_name, sizeof case_name,
             "%s / grpo %s %s beta=%g ent=%g old=%d split=%d%s omit=%d is=%d q=%g opm=%g bias_kl=%g", cfg->name,
             loss_names[c->loss_type], c->level ? "sequence" : "token", c->beta, c->entropy_coef, c->old, c->split,
             dtype == FH_DTYPE_BF16 ? " bf16" : "", c->omit, c->is_mode, c->top_entropy_quantile, c->off_policy,
             c->bias_kl);
    const int64_t B = 12, T = 8, n = B * T, h = 16, v = 211;
    problem p;
    make_problem(&p, n, h, v, c->layout, 2000 + (uint64_t)c->loss_type * 7 + (uint64_t)c->level, dtype);
    int64_t *ids = alloc((size_t)n, 8);
    float *mask = alloc((size_t)n, 4), *adv = alloc((size_t)B, 4), *old = alloc((size_t)n, 4),
          *refl = alloc((size_t)n, 4), *samp = alloc((size_t)n, 4);
    for (int64_t b = 0; b < B; b++) {
        adv[b] = (float)uniform(31, (uint64_t)b);
        const int64_t length = T - (b % 4); /* trailing padding */
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            mask[i] = t < length && uniform(32, (uint64_t)i) > -0.8 ? 1.0f : 0.0f;
            ids[i] = t < length ? (int64_t)((uniform(33, (uint64_t)i) + 1.0) * 0.5 * (double)v) % v : -1;
        }
    }
    fh_grpo_options o;
    fh_grpo_options_init(&o);
    o.loss_type = c->loss_type;
    o.importance_sampling_level = c->level;
    o.beta = c->beta;
    o.entropy_coef = c->entropy_coef;
    o.temperature = c->temperature;
    o.delta = c->delta;
    o.vllm_importance_sampling_correction = c->is_mode >= 0;
    if (c->is_mode >= 0)
        o.vllm_importance_sampling_mode = (fh_grpo_vllm_is_mode)c->is_mode;
    o.vllm_importance_sampling_clip_min = c->is_mode % 2 ? 0.8 : NAN;
    o.vllm_importance_sampling_clip_max = 1.25;
    o.top_entropy_quantile = c->top_entropy_quantile;
    o.off_policy_mask_threshold = c->off_policy;
    o.use_bias_correction_kl = c->bias_kl != 0.0;
    fh_context *ctx = make_context(1);
    const fh_linear full = shard_linear(&p, 0, n, 0, v, c->bias);
    /* Old and reference log-probs near the current ones, so that ratios straddle the clip bounds. */
    {
        float *logp0 = alloc((size_t)n, 4);
        const fh_grpo_batch b0 = {B, T, ids, mask, adv, NULL, NULL, NULL, NULL, NULL};
        fh_grpo_outputs o0 = {NULL, NULL, logp0, NULL, NULL, NULL};
        fh_grpo_options plain = o;
        plain.beta = 0.0;
        check_status("reference log-probs", fh_grpo_forward(ctx, &full, &b0, &plain, &o0), ctx);
        for (int64_t i = 0; i < n; i++) {
            old[i] = logp0[i] + (float)(0.25 * uniform(34, (uint64_t)i));
            refl[i] = logp0[i] + (float)(0.3 * uniform(35, (uint64_t)i));
            samp[i] = old[i] + (float)(0.15 * uniform(36, (uint64_t)i));
        }
        free(logp0);
    }
    float *const sampling = c->is_mode >= 0 || !isnan(c->off_policy) ? samp : NULL;
    const fh_grpo_batch batch = {B,        T, ids, mask, adv, c->old ? old : NULL, c->beta != 0.0 ? refl : NULL,
                                 sampling, NULL, NULL};
    const float grad = 0.8f;
    double ref_loss;
    fh_grpo_metrics ref_m;
    float *r_logp = alloc((size_t)n, 4), *r_ptl = alloc((size_t)n, 4), *r_ent = alloc((size_t)n, 4),
          *r_lse = alloc((size_t)n, 4);
    grads ref = {alloc((size_t)(n * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    fh_grpo_outputs rout = {&ref_loss, &ref_m, r_logp, r_ptl, r_ent, r_lse};
    fh_linear_grads rg = {.dx = ref.dx, .dx_row_stride = h, .dx_beta = 0.0f, .dweight = ref.dw, .dweight_beta = 0.0f, .dbias = c->bias ? ref.db : NULL, .dbias_beta = 0.0f};
    check_status("reference fh_grpo_forward_backward", fh_grpo_forward_backward(ctx, &full, &batch, &o, &grad, &rout, &rg),
                 ctx);

    int64_t off, vl, b0, br;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    share(B, cfg->pd, cfg->dr, 1, &b0, &br);
    const int64_t n0 = b0 * T, nr = br * T;
    const fh_linear lin = shard_linear(&p, n0, nr, off, vl, c->bias);
    const fh_grpo_batch lb = {br,
                              T,
                              ids + n0,
                              mask + n0,
                              adv + b0,
                              c->old ? old + n0 : NULL,
                              c->beta != 0.0 ? refl + n0 : NULL,
                              sampling ? sampling + n0 : NULL, NULL, NULL};
    double loss = NAN;
    fh_grpo_metrics m;
    float *logp = alloc((size_t)nr, 4), *ptl = alloc((size_t)nr, 4), *ent = alloc((size_t)nr, 4),
          *lse = alloc((size_t)nr, 4);
    grads mine = {alloc((size_t)(nr * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    prefill(mine.dx, nr * h, 0, 0);
    prefill(mine.dw, h * v, 0, 0);
    prefill(mine.db, v, 0, 0);
    fh_linear_grads g = {.dx = c->omit & OMIT_DX ? NULL : mine.dx, .dx_row_stride = h, .dx_beta = 0.0f,
                         .dweight = c->omit & OMIT_DWEIGHT ? NULL : mine.dw + weight_offset(&p, &lin),
                         .dweight_beta = 0.0f, .dbias = c->bias && !(c->omit & OMIT_DBIAS) ? mine.db + off : NULL,
                         .dbias_beta = 0.0f};
    fh_grpo_outputs out = {&loss, &m, logp, ptl, ent, lse};
    if (c->split) {
        check_status("fh_mpi_grpo_forward", fh_mpi_grpo_forward(ctx, L, &lin, &lb, &o, &out), ctx);
        check_status("fh_mpi_grpo_backward",
                     fh_mpi_grpo_backward(ctx, L, &lin, &lb, &o, logp, lse, ent, &grad, &g), ctx);
    } else {
        check_status("fh_mpi_grpo_forward_backward", fh_mpi_grpo_forward_backward(ctx, L, &lin, &lb, &o, &grad, &out, &g),
                     ctx);
    }
    check_scalar("loss", loss, ref_loss, LOSS_TOL);
    check_scalar("metrics.kl", m.kl, ref_m.kl, LOSS_TOL);
    check_scalar("metrics.entropy", m.entropy, ref_m.entropy, LOSS_TOL);
    check_scalar("metrics.clip_ratio_low_mean", m.clip_ratio_low_mean, ref_m.clip_ratio_low_mean, LOSS_TOL);
    check_scalar("metrics.clip_ratio_high_mean", m.clip_ratio_high_mean, ref_m.clip_ratio_high_mean, LOSS_TOL);
    check_scalar("metrics.clip_ratio_region_mean", m.clip_ratio_region_mean, ref_m.clip_ratio_region_mean, LOSS_TOL);
    check_scalar("metrics.cispo_clip_ratio", m.cispo_clip_ratio, ref_m.cispo_clip_ratio, LOSS_TOL);
    check_scalar("metrics.clip_ratio_low_min", m.clip_ratio_low_min, ref_m.clip_ratio_low_min, LOSS_TOL);
    check_scalar("metrics.clip_ratio_high_max", m.clip_ratio_high_max, ref_m.clip_ratio_high_max, LOSS_TOL);
    check_scalar("metrics.policy_loss", m.policy_loss, ref_m.policy_loss, LOSS_TOL);
    check_scalar("metrics.entropy_coef", m.entropy_coef, ref_m.entropy_coef, LOSS_TOL);
    check_scalar("metrics.vespo_phi_seq_mean", m.vespo_phi_seq_mean, ref_m.vespo_phi_seq_mean, LOSS_TOL);
    check_scalar("metrics.sampling_logp_difference_mean", m.sampling_logp_difference_mean,
                 ref_m.sampling_logp_difference_mean, LOSS_TOL);
    check_scalar("metrics.sampling_logp_difference_max", m.sampling_logp_difference_max,
                 ref_m.sampling_logp_difference_max, LOSS_TOL);
    check_scalar("metrics.importance_sampling_ratio_min", m.importance_sampling_ratio_min,
                 ref_m.importance_sampling_ratio_min, LOSS_TOL);
    check_scalar("metrics.importance_sampling_ratio_mean", m.importance_sampling_ratio_mean,
                 ref_m.importance_sampling_ratio_mean, LOSS_TOL);
    check_scalar("metrics.importance_sampling_ratio_max", m.importance_sampling_ratio_max,
                 ref_m.importance_sampling_ratio_max, LOSS_TOL);
    check_rows("per_token_logp", logp, 1, r_logp + n0, 1, nr, 1, GRAD_TOL);
    check_rows("per_token_loss", ptl, 1, r_ptl + n0, 1, nr, 1, GRAD_TOL);
    check_rows("entropy", ent, 1, r_ent + n0, 1, nr, 1, GRAD_TOL);
    check_rows("lse", lse, 1, r_lse + n0, 1, nr, 1, GRAD_TOL);
    if (!(c->omit & OMIT_DX))
        check_rows("dx", mine.dx, h, ref.dx + n0 * h, h, nr, h, grad_tol(&p));
    if (!(c->omit & OMIT_DWEIGHT))
        check_weight_shard("dweight", mine.dw, ref.dw, c->layout, h, v, off, vl, grad_tol(&p));
    if (c->bias && !(c->omit & OMIT_DBIAS))
        check_rows("dbias", mine.db + off, 1, ref.db + off, 1, vl, 1, dbias_tol(&p));

    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    free(logp);
    free(ptl);
    free(ent);
    free(lse);
    free(r_logp);
    free(r_ptl);
    free(r_ent);
    free(r_lse);
    free(mine.dx);
    free(mine.dw);
    free(mine.db);
    free(ref.dx);
    free(ref.dw);
    free(ref.db);
    free(ids);
    free(mask);
    free(adv);
    free(old);
    free(refl);
    free(samp);
    free_problem(&p);
}

static void grpo_cases(const config *cfg)
{
    for (int lt = FH_GRPO_LOSS_GRPO; lt <= FH_GRPO_LOSS_VESPO; lt++)
        for (int level = 0; level < 2; level++) {
            const int k = lt * 2 + level;
            /* vespo takes only the token modes */
            const int is_mode = k % 3 == 2 ? -1 : lt == FH_GRPO_LOSS_VESPO ? k % 4 / 2 : k / 3 % 4;
            const grpo_case c = {(fh_grpo_loss_type)lt,
                                 (fh_grpo_is_level)level,
                                 k % 3 == 0 ? 0.04 : 0.0,
                                 k % 4 == 1 ? 0.01 : 0.0,
                                 k % 2 ? 0.7 : 1.0,
                                 k % 5 == 2 ? 1.3 : NAN,
                                 k % 6 != 5,
                                 k % 3 == 1,
                                 k % 2,
                                 k % 4 < 2 ? FH_LAYOUT_VH : FH_LAYOUT_HV,
                                 0,
                                 is_mode,
                                 k % 4 == 3 ? 0.5 : 1.0,
                                 k % 5 == 0 ? 0.02 : NAN,
                                 k % 6 == 0};
            run_grpo(cfg, &c, FH_DTYPE_F32);
            if (have_bf16() && k % 4 == 1)
                run_grpo(cfg, &c, FH_DTYPE_BF16);
        }
    /* Every subset of the gradients, on the split pair and the train step. */
    for (int omit = 1; omit < 8; omit++)
        for (int split = 0; split < 2; split++) {
            const grpo_case c = {FH_GRPO_LOSS_DAPO, FH_GRPO_IS_TOKEN, 0.04, 0.01, 1.0, NAN, 1, split, 1, FH_LAYOUT_VH,
                                 omit, -1, 1.0, NAN, 0.0};
            run_grpo(cfg, &c, FH_DTYPE_F32);
        }
}

/* ---- log-probs --------------------------------------------------------------------------------- */

typedef struct logprob_case {
    double temperature, softcap;
    int g_entropy, split, bias;
    fh_layout layout;
    int64_t ignore_index;
    int cold; /* biases to +-150: at temperature 0.05, ignored rows' logits far past exp's range from lse 0 */
    int support; /* over a padded support of SUPPORT_K ids per token spread over every shard (fh_mpi_logprob_support_*) */
} logprob_case;

enum { SUPPORT_K = 6 };

/* fh_mpi_logprob_* (or fh_mpi_logprob_support_*) on this rank's tokens and shard against the single-process call on the
 * whole problem. */
static void run_logprob(const config *cfg, const logprob_case *c, fh_dtype dtype)
{
    snprintf(case_name, sizeof case_name, "%s / logprob%s T=%g softcap=%g g_entropy=%d split=%d ignore=%lld%s%s",
             cfg->name, c->support ? " over a support" : "", c->temperature, c->softcap, c->g_entropy, c->split,
             (long long)c->ignore_index, dtype == FH_DTYPE_BF16 ? " bf16" : "", c->cold ? " logits to +-160" : "");
    const int64_t n = 45, h = 16, v = 211;
    problem p;
    make_problem(&p, n, h, v, c->layout, 3000 + (uint64_t)(c->temperature * 10), dtype);
    for (int64_t j = 0; c->cold && j < v; j++)
        p.b[j] *= 500.0f;
    int64_t *targets = alloc((size_t)n, 8);
    float *g[3];
    for (int k = 0; k < 3; k++)
        g[k] = alloc((size_t)n, 4);
    for (int64_t i = 0; i < n; i++) {
        targets[i] = (int64_t)((uniform(41, (uint64_t)i) + 1.0) * 0.5 * (double)v) % v;
        if (uniform(42, (uint64_t)i) < -0.6)
            targets[i] = c->ignore_index;
        for (int k = 0; k < 3; k++)
            g[k][i] = (float)uniform(43 + (uint64_t)k, (uint64_t)i);
    }
    const float *g_entropy = c->g_entropy ? g[1] : NULL;
    /* Each token's target (or 0 where ignored) and 5 more ids 37 apart, the last two padding in every fourth row. */
    int64_t *support_ids = alloc((size_t)(n * SUPPORT_K), 8);
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < SUPPORT_K; e++) {
            const int64_t base = targets[i] == c->ignore_index ? 0 : targets[i];
            support_ids[i * SUPPORT_K + e] = i % 4 == 0 && e >= SUPPORT_K - 2 ? -1 : (base + 37 * e) % v;
        }
    const fh_support support = {support_ids, NULL, SUPPORT_K};
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = c->temperature;
    o.softcap = c->softcap;
    o.ignore_index = c->ignore_index;
    fh_context *ctx = make_context(1);
    const fh_linear full = shard_linear(&p, 0, n, 0, v, c->bias);
    float *ref_values = alloc((size_t)(3 * n), 4);
    grads ref = {alloc((size_t)(n * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    fh_logprob_outputs rout = {ref_values, ref_values + n, ref_values + 2 * n};
    fh_linear_grads rg = {.dx = ref.dx, .dx_row_stride = h, .dweight = ref.dw, .dbias = c->bias ? ref.db : NULL};
    check_status("reference fh_logprob_forward_backward",
                 c->support ? fh_logprob_support_forward_backward(ctx, &full, targets, &support, &o, g[0], g_entropy,
                                                                  g[2], &rout, &rg)
                            : fh_logprob_forward_backward(ctx, &full, targets, &o, g[0], g_entropy, g[2], &rout, &rg),
                 ctx);

    int64_t off, vl, n0, nr;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    share(n, cfg->pd, cfg->dr, 1, &n0, &nr);
    const fh_linear lin = shard_linear(&p, n0, nr, off, vl, c->bias);
    float *values = alloc((size_t)(3 * nr), 4);
    grads mine = {alloc((size_t)(nr * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    prefill(mine.dx, nr * h, 0, 0);
    prefill(mine.dw, h * v, 0, 0);
    prefill(mine.db, v, 0, 0);
    fh_linear_grads lg = {.dx = mine.dx, .dx_row_stride = h, .dweight = mine.dw + weight_offset(&p, &lin),
                          .dbias = c->bias ? mine.db + off : NULL};
    fh_logprob_outputs out = {values, values + nr, values + 2 * nr};
    const float *lg_entropy = g_entropy ? g_entropy + n0 : NULL;
    const fh_support rows_support = {support_ids + n0 * SUPPORT_K, NULL, SUPPORT_K};
    if (c->support && c->split) {
        check_status("fh_mpi_logprob_support_forward",
                     fh_mpi_logprob_support_forward(ctx, L, &lin, targets + n0, &rows_support, &o, &out), ctx);
        check_status("fh_mpi_logprob_support_backward",
                     fh_mpi_logprob_support_backward(ctx, L, &lin, targets + n0, &rows_support, &o, out.lse,
                                                     out.entropy, g[0] + n0, lg_entropy, g[2] + n0, &lg),
                     ctx);
    } else if (c->support) {
        check_status("fh_mpi_logprob_support_forward_backward",
                     fh_mpi_logprob_support_forward_backward(ctx, L, &lin, targets + n0, &rows_support, &o, g[0] + n0,
                                                             lg_entropy, g[2] + n0, &out, &lg),
                     ctx);
    } else if (c->split) {
        check_status("fh_mpi_logprob_forward", fh_mpi_logprob_forward(ctx, L, &lin, targets + n0, &o, &out), ctx);
        check_status("fh_mpi_logprob_backward",
                     fh_mpi_logprob_backward(ctx, L, &lin, targets + n0, &o, out.lse, out.entropy, g[0] + n0,
                                             lg_entropy, g[2] + n0, &lg),
                     ctx);
    } else {
        check_status("fh_mpi_logprob_forward_backward",
                     fh_mpi_logprob_forward_backward(ctx, L, &lin, targets + n0, &o, g[0] + n0, lg_entropy, g[2] + n0,
                                                     &out, &lg),
                     ctx);
    }
    checks++;
    const int64_t shard_elements = c->layout == FH_LAYOUT_VH ? vl * h : 0; /* the [V, H] shard is contiguous */
    if (!all_finite(mine.dx, nr * h) || !all_finite(mine.dw + off * h, shard_elements) ||
        (c->bias && !all_finite(mine.db + off, vl)))
        FAIL("a gradient is not finite");
    /* Logits s up to 3200: fp32 rounds s, and the lse the split call saves, by up to 3200 2^-24 = 1.9e-4 absolute,
     * which is p's relative error (and the entropy's absolute one, lse - sum p s): 1e-3 there. */
    const double value_tol = c->cold ? 1e-3 : GRAD_TOL, gtol = c->cold ? 1e-3 : grad_tol(&p);
    check_rows("logp", values, 1, ref_values + n0, 1, nr, 1, value_tol);
    check_rows("entropy", values + nr, 1, ref_values + n + n0, 1, nr, 1, value_tol);
    check_rows("lse", values + 2 * nr, 1, ref_values + 2 * n + n0, 1, nr, 1, value_tol);
    check_rows("dx", mine.dx, h, ref.dx + n0 * h, h, nr, h, gtol);
    check_weight_shard("dweight", mine.dw, ref.dw, c->layout, h, v, off, vl, gtol);
    if (c->bias)
        check_rows("dbias", mine.db + off, 1, ref.db + off, 1, vl, 1, c->cold ? gtol : dbias_tol(&p));

    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    free(values);
    free(ref_values);
    free(mine.dx);
    free(mine.dw);
    free(mine.db);
    free(ref.dx);
    free(ref.dw);
    free(ref.db);
    free(targets);
    free(support_ids);
    for (int k = 0; k < 3; k++)
        free(g[k]);
    free_problem(&p);
}

static void logprob_cases(const config *cfg)
{
    static const double temperatures[] = {0.3, 1.0, 2.5};
    for (int k = 0; k < 6; k++) {
        for (int support = 0; support < 2; support++) {
            const logprob_case c = {temperatures[k % 3], k == 4 ? 5.0 : 0.0, k % 2, k / 3, k % 3 != 1,
                                    k % 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH, k == 5 ? 0 : -100, 0, support};
            run_logprob(cfg, &c, FH_DTYPE_F32);
            if (have_bf16() && k % 3 == support)
                run_logprob(cfg, &c, FH_DTYPE_BF16);
        }
    }
    /* The split backward computes every row: ignored ones must not form p from the placeholder lse 0. */
    const logprob_case cold = {0.05, 0.0, 1, 1, 1, FH_LAYOUT_VH, -100, 1, 0};
    run_logprob(cfg, &cold, FH_DTYPE_F32);
}

/* ---- agreement on errors ----------------------------------------------------------------------- */

/* ---- KTO --------------------------------------------------------------------------------------- */

/* One KTO case: the single-process fh_kto_forward_backward on the whole batch against this rank's share through
 * fh_mpi_kto_forward and fh_mpi_kto_forward_backward (sequences split over the data ranks, unevenly with 3). */
typedef struct kto_case {
    fh_kto_loss_type loss_type;
    int token_ref, kl_logratios, bias, small_tiles, metrics;
    fh_layout layout;
    int padded; /* data rank r pads its sequences with r more masked tokens: T differs across data ranks */
} kto_case;

static void run_kto(const config *cfg, const kto_case *c)
{
    snprintf(case_name, sizeof case_name, "%s / kto %s ref=%s kl=%s bias=%d tiles=%s metrics=%d%s", cfg->name,
             c->loss_type == FH_KTO_LOSS_KTO ? "kto" : "apo_zero_unpaired", c->token_ref ? "token" : "sequence",
             c->loss_type != FH_KTO_LOSS_KTO ? "none" : c->kl_logratios ? "logratios" : "value", c->bias,
             c->small_tiles ? "small" : "default", c->metrics, c->padded ? " T per data rank" : "");
    const int64_t B = 11, T = 20, n = B * T, h = 16, v = 211; /* small tiles: 16 rows < T, streaming */
    problem p;
    make_problem(&p, n, h, v, c->layout, 4000 + (uint64_t)c->loss_type * 5 + (uint64_t)c->token_ref, FH_DTYPE_F32);
    int64_t *ids = alloc((size_t)n, 8);
    uint8_t *labels = alloc((size_t)B, 1);
    float *mask = alloc((size_t)n, 4), *ref = alloc((size_t)B, 4), *ref_tok = alloc((size_t)n, 4),
          *klr = alloc((size_t)B, 4);
    for (int64_t b = 0; b < B; b++) {
        labels[b] = b % 3 != 1;
        ref[b] = (float)(-5.0 * (double)T + 3.0 * uniform(41, (uint64_t)b));
        klr[b] = (float)(1.0 + uniform(42, (uint64_t)b));
        const int64_t length = T - (b % 4); /* trailing padding */
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            mask[i] = t < length ? 1.0f : 0.0f;
            ids[i] = t < length ? (int64_t)((uniform(43, (uint64_t)i) + 1.0) * 0.5 * (double)v) % v : -100;
            ref_tok[i] = (float)(-5.0 + 0.5 * uniform(44, (uint64_t)i));
        }
    }
    const float kl = 0.4f, grad = 0.8f;
    const int kto = c->loss_type == FH_KTO_LOSS_KTO;
    fh_kto_options o;
    fh_kto_options_init(&o);
    o.loss_type = c->loss_type;
    o.beta = 0.3;
    o.desirable_weight = 1.3;
    fh_context *ctx = make_context(c->small_tiles);
    const fh_linear full = shard_linear(&p, 0, n, 0, v, c->bias);
    const fh_kto_batch batch = {B, T, ids, mask, labels, c->token_ref ? NULL : ref, c->token_ref ? ref_tok : NULL,
                                kto && !c->kl_logratios ? &kl : NULL, kto && c->kl_logratios ? klr : NULL, NULL};
    double ref_loss;
    fh_kto_metrics ref_m;
    float *r_logp = alloc((size_t)n, 4), *r_seq = alloc((size_t)B, 4), *r_rew = alloc((size_t)B, 4);
    grads rg_buf = {alloc((size_t)(n * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    fh_kto_outputs rout = {&ref_loss, c->metrics ? &ref_m : NULL, r_seq, r_rew, r_logp};
    fh_linear_grads rg = {.dx = rg_buf.dx, .dx_row_stride = h, .dweight = rg_buf.dw, .dbias = c->bias ? rg_buf.db : NULL};
    check_status("reference fh_kto_forward_backward", fh_kto_forward_backward(ctx, &full, &batch, &o, &grad, &rout, &rg),
                 ctx);

    int64_t off, vl, b0, br;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    share(B, cfg->pd, cfg->dr, 1, &b0, &br);
    const int64_t n0 = b0 * T, nr = br * T;
    /* This rank's sequences, padded to tl tokens (masked, ids outside [0, V), hidden states that must not count). */
    const int64_t tl = T + (c->padded ? cfg->dr : 0), nl = br * tl;
    float *xl = alloc((size_t)(nl * h), 4), *maskl = alloc((size_t)nl, 4), *ref_tokl = alloc((size_t)nl, 4);
    int64_t *idsl = alloc((size_t)nl, 8);
    for (int64_t b = 0; b < br; b++)
        for (int64_t t = 0; t < tl; t++) {
            const int64_t i = b * tl + t, src = n0 + b * T + t;
            for (int64_t k = 0; k < h; k++)
                xl[i * h + k] = t < T ? p.x[src * h + k] : (float)uniform(45, (uint64_t)(i * h + k));
            maskl[i] = t < T ? mask[src] : 0.0f;
            idsl[i] = t < T ? ids[src] : -100;
            ref_tokl[i] = t < T ? ref_tok[src] : 0.0f;
        }
    fh_linear lin = shard_linear(&p, n0, nr, off, vl, c->bias);
    lin.n = nl;
    lin.x = xl;
    const fh_kto_batch lb = {br,
                             tl,
                             idsl,
                             maskl,
                             labels + b0,
                             c->token_ref ? NULL : ref + b0,
                             c->token_ref ? ref_tokl : NULL,
                             batch.kl,
                             batch.kl_logratios ? klr + b0 : NULL, NULL};
    grads mine = {alloc((size_t)(nl * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    prefill(mine.dx, nl * h, 0, 0);
    prefill(mine.dw, h * v, 0, 0);
    prefill(mine.db, v, 0, 0);
    fh_linear_grads g = {.dx = mine.dx, .dx_row_stride = h, .dweight = mine.dw + weight_offset(&p, &lin),
                         .dbias = c->bias ? mine.db + off : NULL};
    float *logp = alloc((size_t)nl, 4), *seq = alloc((size_t)B, 4), *rew = alloc((size_t)B, 4);
    float *unpadded = alloc((size_t)(nr * h), 4); /* a padded array's first T rows of each sequence */
    for (int call = 0; call < 2; call++) {
        double loss = NAN;
        fh_kto_metrics m;
        fh_kto_outputs out = {&loss, c->metrics ? &m : NULL, seq, rew, logp};
        if (call == 0)
            check_status("fh_mpi_kto_forward", fh_mpi_kto_forward(ctx, L, &lin, &lb, &o, &out), ctx);
        else
            check_status("fh_mpi_kto_forward_backward",
                         fh_mpi_kto_forward_backward(ctx, L, &lin, &lb, &o, &grad, &out, &g), ctx);
        check_scalar("loss", loss, ref_loss, LOSS_TOL);
        if (c->metrics) {
            const double got[] = {m.kl, m.rewards_chosen, m.rewards_rejected, m.rewards_margins, m.logps_chosen,
                                  m.logps_rejected, m.logits_chosen, m.logits_rejected, m.entropy};
            const double want[] = {ref_m.kl, ref_m.rewards_chosen, ref_m.rewards_rejected, ref_m.rewards_margins,
                                   ref_m.logps_chosen, ref_m.logps_rejected, ref_m.logits_chosen,
                                   ref_m.logits_rejected, ref_m.entropy};
            for (size_t k = 0; k < sizeof got / sizeof got[0]; k++)
                check_scalar("a metric", got[k], want[k], LOSS_TOL);
        }
        check_rows("sequence_logps", seq, 1, r_seq + b0, 1, br, 1, GRAD_TOL);
        check_rows("rewards", rew, 1, r_rew + b0, 1, br, 1, GRAD_TOL);
        for (int64_t b = 0; b < br; b++)
            memcpy(unpadded + b * T, logp + b * tl, (size_t)T * sizeof(float));
        check_rows("per_token_logp", unpadded, 1, r_logp + n0, 1, nr, 1, GRAD_TOL);
    }
    int padding_dx_zero = 1;
    for (int64_t b = 0; b < br; b++) {
        memcpy(unpadded + b * T * h, mine.dx + b * tl * h, (size_t)(T * h) * sizeof(float));
        for (int64_t e = T * h; e < tl * h; e++)
            padding_dx_zero &= mine.dx[b * tl * h + e] == 0.0f;
    }
    checks++;
    if (!padding_dx_zero)
        FAIL("a padded token's dx is not 0");
    check_rows("dx", unpadded, h, rg_buf.dx + n0 * h, h, nr, h, grad_tol(&p));
    check_weight_shard("dweight", mine.dw, rg_buf.dw, c->layout, h, v, off, vl, grad_tol(&p));
    if (c->bias)
        check_rows("dbias", mine.db + off, 1, rg_buf.db + off, 1, vl, 1, dbias_tol(&p));

    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    void *ptrs[] = {ids, labels, mask, ref, ref_tok, klr, r_logp, r_seq, r_rew, rg_buf.dx, rg_buf.dw, rg_buf.db,
                    mine.dx, mine.dw, mine.db, logp, seq, rew, xl, maskl, ref_tokl, idsl, unpadded};
    for (size_t k = 0; k < sizeof ptrs / sizeof ptrs[0]; k++)
        free(ptrs[k]);
    free_problem(&p);
}

/* Both loss types, both references, both KL inputs, row blocks (default tiles) and streaming (small tiles), with
 * and without the metrics. */
static void kto_cases(const config *cfg)
{
    for (int k = 0; k < 6; k++) {
        const kto_case c = {k < 4 ? FH_KTO_LOSS_KTO : FH_KTO_LOSS_APO_ZERO_UNPAIRED, k % 2, k / 2 % 2, k % 3 == 0,
                            k % 2 == 0, k != 3, k % 3 == 1 ? FH_LAYOUT_HV : FH_LAYOUT_VH, 0};
        run_kto(cfg, &c);
    }
    /* KTO does not depend on T: data ranks may pad to different lengths (both schedules, both KL inputs). */
    for (int k = 0; k < 2; k++) {
        const kto_case c = {FH_KTO_LOSS_KTO, k, k, 1, k, 1, FH_LAYOUT_VH, 1};
        run_kto(cfg, &c);
    }
}

static void error_cases(const config *cfg)
{
    snprintf(case_name, sizeof case_name, "%s / errors", cfg->name);
    const int64_t n = 20, h = 8, v = 64;
    problem p;
    make_problem(&p, n, h, v, FH_LAYOUT_VH, 5, FH_DTYPE_F32);
    int64_t targets[20];
    for (int64_t i = 0; i < n; i++)
        targets[i] = i * 3 % v;
    fh_context *ctx = make_context(1);
    int64_t off, vl;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    fh_ce_options o;
    fh_ce_options_init(&o);
    double loss = -1.0;
    fh_ce_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    /* The last rank of the world passes a target outside [0, V): every rank must fail, none may hang. */
    if (world_rank == world_size - 1)
        targets[0] = v;
    fh_linear lin = shard_linear(&p, 0, cfg->pd > 1 ? 1 + cfg->dr : n, off, vl, 0);
    fh_status st = fh_mpi_ce_forward(ctx, L, &lin, targets, &o, &out);
    checks++;
    if (st == FH_OK || loss != -1.0)
        FAIL("a bad target on rank %d: status %d, loss %g (expected an error and no output)", world_size - 1, (int)st,
             loss);
    targets[0] = 0;
    /* Token counts that differ across the vocab communicator. */
    if (cfg->pv > 1) {
        lin.n = cfg->vr == 0 ? n - 1 : n;
        st = fh_mpi_ce_forward(ctx, L, &lin, targets, &o, &out);
        checks++;
        if (st != FH_ERR_MPI_LAYOUT)
            FAIL("n differing across the vocab communicator: status %d, expected FH_ERR_MPI_LAYOUT", (int)st);
    }
    /* A shard size that is not the layout's. */
    lin.n = n;
    lin.vocab = vl + (world_rank == 0);
    if (world_rank == 0 && lin.vocab + off > v)
        lin.vocab = vl - 1 > 0 ? vl - 1 : vl + 1;
    st = fh_mpi_ce_forward(ctx, L, &lin, targets, &o, &out);
    checks++;
    if (st == FH_OK && world_size > 1)
        FAIL("a wrong shard size on rank 0 went through");
    fh_mpi_layout_destroy(L);
    /* Data ranks that disagree on the shard. */
    if (cfg->pd > 1) {
        fh_mpi_layout *bad = NULL;
        st = fh_mpi_layout_create(cfg->pv > 1 ? cfg->vocab : MPI_COMM_NULL, cfg->data, vl + (cfg->dr == 0), &bad);
        checks++;
        if (st != FH_ERR_MPI_LAYOUT || bad)
            FAIL("data ranks with different shards: status %d, expected FH_ERR_MPI_LAYOUT", (int)st);
    }
    fh_context_destroy(ctx);
    free_problem(&p);
}

/* ---- one rank's bad argument, before any collective ------------------------------------------------ */

/* Every head entry point (the FH_PARALLEL_HEAD_CALL lines of tests/mpi/parallel_entry_points.def) with one bad
 * argument on the last rank only: a NULL context, lin, options or data (targets, batch), or a hidden size of 0. Every
 * rank returns an error and writes nothing; none may hang, which a watchdog (alarm) turns into a failed run within seconds rather than
 * ctest's timeout. The calls dispatch in a switch with no default, and -Wswitch is an error here: a listed entry point
 * without its case does not compile. The layout's own calls: layout_failure_cases. */
#pragma GCC diagnostic error "-Wswitch"
#define FH_PARALLEL_LAYOUT_CALL(name)
#define FH_PARALLEL_HEAD_CALL(name) E_##name,
typedef enum head_call {
#include "parallel_entry_points.def"
} head_call;
#undef FH_PARALLEL_HEAD_CALL
#define FH_PARALLEL_HEAD_CALL(name) +1
enum { E_COUNT = 0
#include "parallel_entry_points.def"
};
#undef FH_PARALLEL_HEAD_CALL
#define FH_PARALLEL_HEAD_CALL(name) #name,
static const char *const head_call_names[E_COUNT] = {
#include "parallel_entry_points.def"
};
#undef FH_PARALLEL_LAYOUT_CALL
#undef FH_PARALLEL_HEAD_CALL
enum { BAD_CONTEXT, BAD_LIN, BAD_OPTIONS, BAD_DATA, BAD_HIDDEN, BAD_COUNT };
#define WATCHDOG_SECONDS 60

static void early_failure_case(const config *cfg, head_call entry, int bad)
{
    static const char *const bads[BAD_COUNT] = {"NULL context", "NULL lin", "NULL options", "NULL targets or batch",
                                                "hidden 0"};
    snprintf(case_name, sizeof case_name, "%s / %s with a %s on the last rank", cfg->name, head_call_names[entry],
             bads[bad]);
    enum { B = 4, T = 5, N = B * T };
    const int64_t h = 8, v = 64;
    const int odd = world_rank == world_size - 1;
    problem p;
    make_problem(&p, N, h, v, FH_LAYOUT_VH, 7, FH_DTYPE_F32);
    fh_context *ctx = make_context(1);
    int64_t off, vl;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    fh_linear lin = shard_linear(&p, 0, N, off, vl, 0);
    if (odd && bad == BAD_HIDDEN)
        lin.hidden = 0;
    fh_context *const c = odd && bad == BAD_CONTEXT ? NULL : ctx;
    const fh_linear *const l = odd && bad == BAD_LIN ? NULL : &lin;
    const int no_options = odd && bad == BAD_OPTIONS, no_data = odd && bad == BAD_DATA;
    int64_t targets[N];
    float mask[N], saved[3][N], upstream[N], adv[B], ref[B], values[3 * N];
    uint8_t labels[B];
    for (int64_t i = 0; i < N; i++) {
        targets[i] = i * 7 % v;
        mask[i] = 1.0f;
        saved[0][i] = -3.0f; /* per-token log-prob */
        saved[1][i] = 4.0f;  /* lse */
        saved[2][i] = 1.0f;  /* entropy */
        upstream[i] = 0.5f;
    }
    for (int b = 0; b < B; b++) {
        adv[b] = (float)b - 1.5f;
        ref[b] = -15.0f;
        labels[b] = b % 2;
    }
    grads mine = {alloc((size_t)(N * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    prefill(mine.dx, N * h, 0, 0);
    prefill(mine.dw, h * v, 0, 0);
    fh_linear_grads g = {.dx = mine.dx, .dx_row_stride = h, .dweight = mine.dw + weight_offset(&p, &lin)};
    double loss = -1.0;
    const float one = 1.0f, kl = 0.2f;
    fh_ce_options co;
    fh_ce_options_init(&co);
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    fh_grpo_options go;
    fh_grpo_options_init(&go);
    go.beta = 0.0;
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    const fh_grpo_batch gb = {B, T, targets, mask, adv, NULL, NULL, NULL, NULL, NULL};
    const fh_kto_batch kb = {B, T, targets, mask, labels, ref, NULL, &kl, NULL, NULL};
    const fh_ce_options *const cop = no_options ? NULL : &co;
    const fh_logprob_options *const lop = no_options ? NULL : &lo;
    const fh_grpo_options *const gop = no_options ? NULL : &go;
    const fh_kto_options *const kop = no_options ? NULL : &ko;
    const int64_t *const t = no_data ? NULL : targets;
    const fh_grpo_batch *const gbp = no_data ? NULL : &gb;
    const fh_kto_batch *const kbp = no_data ? NULL : &kb;
    int64_t support_ids[N * 2]; /* each token's target and one more id (padded form, k = 2) */
    for (int64_t i = 0; i < N; i++) {
        support_ids[2 * i] = targets[i];
        support_ids[2 * i + 1] = (targets[i] + 1) % v;
    }
    const fh_support support = {support_ids, NULL, 2};
    const fh_support *const sp = no_data ? NULL : &support;
    fh_ce_outputs ce_out = {&loss, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    fh_logprob_outputs lp_out = {values, values + N, values + 2 * N};
    fh_grpo_outputs grpo_out = {&loss, NULL, NULL, NULL, NULL, NULL};
    fh_kto_outputs kto_out = {&loss, NULL, NULL, NULL, NULL};
    fill_nan(values, 3 * N);
    alarm(WATCHDOG_SECONDS);
    fh_status st = FH_OK;
    switch (entry) {
    case E_fh_parallel_ce_forward: st = fh_mpi_ce_forward(c, L, l, t, cop, &ce_out); break;
    case E_fh_parallel_ce_backward: st = fh_mpi_ce_backward(c, L, l, t, cop, saved[1], &one, &g); break;
    case E_fh_parallel_ce_forward_backward: st = fh_mpi_ce_forward_backward(c, L, l, t, cop, &one, &ce_out, &g); break;
    case E_fh_parallel_logprob_forward: st = fh_mpi_logprob_forward(c, L, l, t, lop, &lp_out); break;
    case E_fh_parallel_logprob_backward:
        st = fh_mpi_logprob_backward(c, L, l, t, lop, saved[1], NULL, upstream, NULL, NULL, &g);
        break;
    case E_fh_parallel_logprob_forward_backward: st = fh_mpi_logprob_forward_backward(c, L, l, t, lop, upstream, NULL, NULL, &lp_out, &g); break;
    case E_fh_parallel_logprob_support_forward:
        st = fh_mpi_logprob_support_forward(c, L, l, t, sp, lop, &lp_out);
        break;
    case E_fh_parallel_logprob_support_backward:
        st = fh_mpi_logprob_support_backward(c, L, l, t, sp, lop, saved[1], NULL, upstream, NULL, NULL, &g);
        break;
    case E_fh_parallel_logprob_support_forward_backward:
        st = fh_mpi_logprob_support_forward_backward(c, L, l, t, sp, lop, upstream, NULL, NULL, &lp_out, &g);
        break;
    case E_fh_parallel_grpo_forward: st = fh_mpi_grpo_forward(c, L, l, gbp, gop, &grpo_out); break;
    case E_fh_parallel_grpo_backward: st = fh_mpi_grpo_backward(c, L, l, gbp, gop, saved[0], saved[1], NULL, &one, &g); break;
    case E_fh_parallel_grpo_forward_backward: st = fh_mpi_grpo_forward_backward(c, L, l, gbp, gop, &one, &grpo_out, &g); break;
    case E_fh_parallel_kto_forward: st = fh_mpi_kto_forward(c, L, l, kbp, kop, &kto_out); break;
    case E_fh_parallel_kto_forward_backward: st = fh_mpi_kto_forward_backward(c, L, l, kbp, kop, &one, &kto_out, &g); break;
    }
    alarm(0);
    checks++;
    if (world_size > 1 && (st == FH_OK || loss != -1.0))
        FAIL("status %d, loss %g: expected an error and no output", (int)st, loss);
    int written = 0;
    for (int64_t i = 0; i < N * h; i++)
        written |= !isnan(mine.dx[i]);
    for (int64_t i = 0; i < 3 * N; i++)
        written |= !isnan(values[i]);
    if (world_size > 1 && written)
        FAIL("an output was written");
    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    free(mine.dx);
    free(mine.dw);
    free(mine.db);
    free_problem(&p);
}

/* The layout's constructors with one rank's bad argument: a NULL result pointer, a size INT64_MIN (whose negation
 * the agreement once took), vocab_ranks unlike the others'. Every rank fails alike. */
static void layout_failure_cases(const config *cfg)
{
    const int odd = world_rank == world_size - 1;
    snprintf(case_name, sizeof case_name, "%s / layout constructors with a bad argument on the last rank", cfg->name);
    fh_mpi_layout *L = NULL, **const out = odd ? NULL : &L;
    MPI_Comm vocab = cfg->pv > 1 ? cfg->vocab : MPI_COMM_NULL, data = cfg->pd > 1 ? cfg->data : MPI_COMM_NULL;
    alarm(WATCHDOG_SECONDS);
    const fh_status null_create = fh_mpi_layout_create(vocab, data, 10, out);
    const fh_status size_min = fh_mpi_layout_create(vocab, data, odd ? INT64_MIN : 10, &L);
    const fh_status null_grid = fh_mpi_layout_create_grid(MPI_COMM_WORLD, cfg->pv, 10, out);
    const int other_ranks = cfg->pv == 1 ? world_size : 1; /* a valid grid, but not the others' */
    const fh_status ranks_differ = fh_mpi_layout_create_grid(MPI_COMM_WORLD, odd ? other_ranks : cfg->pv, 10, &L);
    alarm(0);
    checks++;
    if (world_size > 1 && (null_create != FH_ERR_NULL_POINTER || size_min != FH_ERR_INVALID_SIZE ||
                           null_grid != FH_ERR_NULL_POINTER || ranks_differ != FH_ERR_MPI_LAYOUT || L))
        FAIL("statuses %d, %d, %d, %d (expected %d, %d, %d, %d), layout %p", (int)null_create, (int)size_min,
             (int)null_grid, (int)ranks_differ, FH_ERR_NULL_POINTER, FH_ERR_INVALID_SIZE, FH_ERR_NULL_POINTER,
             FH_ERR_MPI_LAYOUT, (void *)L);
    fh_mpi_layout_destroy(L);
}

/* ---- ranks that disagree on a call's configuration --------------------------------------------- */

/* Each kind of disagreement, rank 0 against the others: every rank returns FH_ERR_MPI_MISMATCH naming it, writes
 * nothing, and none hangs or crashes (ctest's timeout bounds the run). */
enum { DIFF_NO_DX, DIFF_NO_DWEIGHT, DIFF_CLASS_WEIGHTS, DIFF_STATS, DIFF_DX_REDUCTION, DIFF_DW_REDUCTION,
       DIFF_REDUCTION, DIFF_SMOOTHING, DIFF_LOGIT_SCALE, DIFF_TOKEN_SCALING, DIFF_CORRECT, DIFF_SOFTCAP_MINUS_ZERO,
       DIFF_SMOOTHING_SIGNED_ZERO, DIFF_IGNORE_INT64_MIN, DIFF_GRPO_LOSS, DIFF_GRPO_BETA, DIFF_GRPO_NAN_PAYLOAD,
       DIFF_COUNT };

static void mismatch_case(const config *cfg, int diff)
{
    static const char *const what[DIFF_COUNT] = {"dx asked for", "dweight asked for", "class weights given",
                                                 "the stats collective", "the dx reduction", "the dweight reduction",
                                                 "the reduction", "label_smoothing", "logit_scale", "token_scaling",
                                                 "argmax or correct asked for", "softcap", "label_smoothing",
                                                 "ignore_index", "loss_type", "beta", "delta"};
    snprintf(case_name, sizeof case_name, "%s / mismatch: %s", cfg->name, what[diff]);
    const int64_t B = 4, T = 5, n = B * T, h = 8, v = 64;
    const int odd = world_rank == 0;
    problem p;
    make_problem(&p, n, h, v, FH_LAYOUT_VH, 6, FH_DTYPE_F32);
    fh_context *ctx = make_context(1);
    int64_t off, vl;
    fh_mpi_layout *L = make_layout(cfg, v, &off, &vl);
    if (odd && diff == DIFF_STATS)
        fh_mpi_layout_set(L, FH_MPI_PARAM_STATS_COLLECTIVE, FH_MPI_STATS_MAX_THEN_SUM);
    if (odd && diff == DIFF_DX_REDUCTION)
        fh_mpi_layout_set(L, FH_MPI_PARAM_DX_REDUCTION, FH_MPI_REDUCE_SCATTER);
    if (odd && diff == DIFF_DW_REDUCTION)
        fh_mpi_layout_set(L, FH_MPI_PARAM_DWEIGHT_REDUCTION, FH_MPI_REDUCE_SCATTER);
    const fh_linear lin = shard_linear(&p, 0, n, off, vl, 0);
    grads mine = {alloc((size_t)(n * h), 4), alloc((size_t)(h * v), 4), alloc((size_t)v, 4)};
    prefill(mine.dx, n * h, 0, 0);
    prefill(mine.dw, h * v, 0, 0);
    fh_linear_grads g = {.dx = odd && diff == DIFF_NO_DX ? NULL : mine.dx, .dx_row_stride = h,
                         .dweight = odd && diff == DIFF_NO_DWEIGHT ? NULL : mine.dw + weight_offset(&p, &lin)};
    double loss = -1.0;
    const float grad_output = 1.0f;
    fh_status st;
    if (diff < DIFF_GRPO_LOSS) {
        int64_t *targets = alloc((size_t)n, sizeof(int64_t));
        for (int64_t i = 0; i < n; i++)
            targets[i] = i * 7 % v;
        fh_ce_options o;
        fh_ce_options_init(&o);
        if (odd && diff == DIFF_CLASS_WEIGHTS)
            o.class_weights = p.cw + off;
        if (odd && diff == DIFF_REDUCTION)
            o.reduction = FH_REDUCTION_SUM;
        if (odd && diff == DIFF_SMOOTHING)
            o.label_smoothing = 0.1;
        if (odd && diff == DIFF_LOGIT_SCALE)
            o.logit_scale = 2.0;
        if (odd && diff == DIFF_TOKEN_SCALING)
            o.token_scaling = 1;
        /* Exact encodings (issue 41): -0.0's bits are INT64_MIN's, which a comparison through negation missed. */
        if (diff == DIFF_SOFTCAP_MINUS_ZERO)
            o.softcap = odd ? -0.0 : 3.0;
        if (odd && diff == DIFF_SMOOTHING_SIGNED_ZERO)
            o.label_smoothing = -0.0;
        if (diff == DIFF_IGNORE_INT64_MIN)
            o.ignore_index = odd ? INT64_MIN : 5;
        int64_t correct = -1;
        fh_ce_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL, NULL, odd && diff == DIFF_CORRECT ? &correct : NULL};
        st = fh_mpi_ce_forward_backward(ctx, L, &lin, targets, &o, &grad_output, &out, &g);
        free(targets);
    } else {
        int64_t *ids = alloc((size_t)n, sizeof(int64_t));
        float *mask = alloc((size_t)n, 4), *adv = alloc((size_t)B, 4), *refl = alloc((size_t)n, 4);
        for (int64_t i = 0; i < n; i++) {
            ids[i] = i * 5 % v;
            mask[i] = 1.0f;
            refl[i] = -4.0f;
        }
        for (int64_t b = 0; b < B; b++)
            adv[b] = (float)b - 1.5f;
        fh_grpo_options o;
        fh_grpo_options_init(&o);
        o.beta = 0.04;
        if (odd && diff == DIFF_GRPO_LOSS)
            o.loss_type = FH_GRPO_LOSS_BNPO;
        if (odd && diff == DIFF_GRPO_BETA)
            o.beta = 0.05;
        if (diff == DIFF_GRPO_NAN_PAYLOAD) { /* both mean "no two-sided clipping", but are not the same bits */
            const uint64_t bits = odd ? 0x7ff8000000000001u : 0x7ff8000000000000u;
            memcpy(&o.delta, &bits, sizeof o.delta);
        }
        const fh_grpo_batch batch = {B, T, ids, mask, adv, NULL, refl, NULL, NULL, NULL};
        fh_grpo_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL};
        st = fh_mpi_grpo_forward_backward(ctx, L, &lin, &batch, &o, &grad_output, &out, &g);
        free(ids);
        free(mask);
        free(adv);
        free(refl);
    }
    const char *message = "";
    fh_context_message(ctx, &message);
    checks++;
    if (world_size > 1 && (st != FH_ERR_MPI_MISMATCH || loss != -1.0 || !strstr(message, what[diff])))
        FAIL("status %d (expected FH_ERR_MPI_MISMATCH), loss %g, message '%s'", (int)st, loss, message);
    for (int64_t i = 0; world_size > 1 && i < n * h; i++)
        if (!isnan(mine.dx[i])) {
            FAIL("dx written at %lld", (long long)i);
            break;
        }
    fh_mpi_layout_destroy(L);
    fh_context_destroy(ctx);
    free(mine.dx);
    free(mine.dw);
    free(mine.db);
    free_problem(&p);
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    /* Kernels this CPU or build lacks (FH_ROW_KERNELS, FH_BF16_GEMM; the same on every rank): a skip, 77 on every
     * rank, which ctest takes as one. */
    fh_kernel_info kernels;
    if (fh_kernel_query(&kernels) == FH_OK && kernels.refusal) {
        if (world_rank == 0)
            printf("fh_mpi_tests: skipped: %s\n", kernels.refusal);
        MPI_Finalize();
        return 77;
    }
    config configs[3];
    int count = 0;
    configs[count++] = make_config("vocab-parallel", world_size);
    configs[count++] = make_config("data-parallel", 1);
    if (world_size >= 4 && world_size % 2 == 0)
        configs[count++] = make_config("2-D grid", 2);
    for (int k = 0; k < count; k++) {
        if (world_rank == 0)
            printf("%s: %d vocab ranks x %d data ranks\n", configs[k].name, configs[k].pv, configs[k].pd);
        ce_cases(&configs[k]);
        grpo_cases(&configs[k]);
        logprob_cases(&configs[k]);
        kto_cases(&configs[k]);
        error_cases(&configs[k]);
        for (int diff = 0; diff < DIFF_COUNT; diff++)
            mismatch_case(&configs[k], diff);
        for (int entry = 0; entry < E_COUNT; entry++)
            for (int bad = 0; bad < BAD_COUNT; bad++)
                early_failure_case(&configs[k], (head_call)entry, bad);
        layout_failure_cases(&configs[k]);
        /* fh_mpi_layout_create_grid gives the same layout as the test's own split. */
        fh_mpi_layout *L = NULL;
        snprintf(case_name, sizeof case_name, "%s / create_grid", configs[k].name);
        check_status("fh_mpi_layout_create_grid",
                     fh_mpi_layout_create_grid(MPI_COMM_WORLD, configs[k].pv, 10 + configs[k].vr, &L), NULL);
        fh_mpi_layout_info info;
        if (L && fh_mpi_layout_query(L, &info) == FH_OK) {
            checks++;
            if (info.vocab_rank != configs[k].vr || info.data_rank != configs[k].dr ||
                info.total_vocab != 10 * configs[k].pv + configs[k].pv * (configs[k].pv - 1) / 2)
                FAIL("grid ranks %d/%d, total %lld", info.vocab_rank, info.data_rank, (long long)info.total_vocab);
        }
        fh_mpi_layout_destroy(L);
    }
    int totals[2] = {failures, checks};
    MPI_Allreduce(MPI_IN_PLACE, totals, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (world_rank == 0)
        printf("%d ranks: %d checks, %d failures\n", world_size, totals[1], totals[0]);
    for (int k = 0; k < count; k++) {
        MPI_Comm_free(&configs[k].vocab);
        MPI_Comm_free(&configs[k].data);
    }
    MPI_Finalize();
    return totals[0] == 0 ? 0 : 1;
}
