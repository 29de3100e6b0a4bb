/* Shapes: fused vs double reference where tiles end. Small tiles (8 rows x 16 vocabulary columns) make
 * every size in {1, tile - 1, tile, tile + 1, odd primes} land on a different edge; both weight layouts,
 * with and without bias, 1 and 2 threads, separate forward + backward calls and the single-call train
 * step (row blocks across the whole vocabulary, or streaming when they do not fit).
 * Tolerances: ce_metrics_pass (justified in tests/cases/ce_case.c). */
#include "ce_harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TILE_ROWS = 8, TILE_VOCAB = 16 };

static const int64_t grid_n[] = {1, TILE_ROWS - 1, TILE_ROWS, TILE_ROWS + 1, 13, 37};
static const int64_t grid_vocab[] = {1, TILE_VOCAB - 1, TILE_VOCAB, TILE_VOCAB + 1, 13, 37};
/* H is not tiled by the library but is BLIS's k dimension (micro-kernel unroll edges). */
static const int64_t grid_hidden[] = {1, 7, 8, 9, 13, 37};

/* Largest reference cost: 37 * 37 * 37 doubles per GEMM; ~3500 runs in all, about a second. */
static void run_grid(fh_layout layout, int threads)
{
    uint64_t seed = 1;
    for (size_t a = 0; a < TU_COUNT(grid_n); a++)
        for (size_t b = 0; b < TU_COUNT(grid_vocab); b++)
            for (size_t c = 0; c < TU_COUNT(grid_hidden); c++)
                for (int variant = 0; variant < 4; variant++) {
                    const int bias = variant & 1, train_step = variant >> 1;
                    ce_case_spec s;
                    ce_case_spec_default(&s);
                    s.n = grid_n[a];
                    s.vocab = grid_vocab[b];
                    s.hidden = grid_hidden[c];
                    s.layout = layout;
                    s.bias = bias;
                    s.threads = threads;
                    s.tile_rows = TILE_ROWS;
                    s.tile_vocab = TILE_VOCAB;
                    s.train_step = train_step;
                    s.seed = seed++;
                    cp_check_spec(&s, "tile edges");
                }
}

static void test_edges_hv_1thread(void) { run_grid(FH_LAYOUT_HV, 1); }
static void test_edges_vh_1thread(void) { run_grid(FH_LAYOUT_VH, 1); }
static void test_edges_hv_2threads(void) { run_grid(FH_LAYOUT_HV, 2); }
static void test_edges_vh_2threads(void) { run_grid(FH_LAYOUT_VH, 2); }

/* Degenerate and uneven tiles (1 x 1, 3 x 5), and shapes crossing the library's default tiles by one
 * row and one column (the defaults are not documented; 1025 x 2049 crosses 1024 x 2048 and any power of
 * two below; reference cost 1025 * 2049 * 3 doubles). Both call styles. */
static void test_tile_configurations(void)
{
    static const struct {
        int64_t n, hidden, vocab, tile_rows, tile_vocab;
    } cases[] = {{37, 9, 37, 1, 1}, {37, 9, 37, 3, 5}, {37, 9, 37, 37, 37}, {37, 9, 37, 0, 0},
                 {5, 4, 40, 2, 1}, {1025, 3, 2049, 0, 0}};
    for (size_t k = 0; k < TU_COUNT(cases); k++)
        for (int variant = 0; variant < 4; variant++) {
            const int layout = variant & 1, train_step = variant >> 1;
            ce_case_spec s;
            ce_case_spec_default(&s);
            s.n = cases[k].n;
            s.hidden = cases[k].hidden;
            s.vocab = cases[k].vocab;
            s.tile_rows = cases[k].tile_rows;
            s.tile_vocab = cases[k].tile_vocab;
            s.layout = (fh_layout)layout;
            s.bias = 1;
            s.train_step = train_step;
            s.seed = 100 + k;
            cp_check_spec(&s, "tile configuration");
        }
}

/* A memory budget makes the library shrink its tiles (and the train step fall back from row blocks to
 * streaming when a row block does not fit): each size query must then fit the budget, and the results
 * must still match the reference. Budget 1 MiB lets the train step use row blocks of the whole vocabulary. */
static void test_memory_budget_shrinks_tiles(void)
{
    static const int64_t budgets[] = {4096, 8192, 20000, 1 << 20};
    cp_problem p;
    cp_problem_init(&p, 37, 9, 300, FH_LAYOUT_VH, CP_BIAS);
    cp_problem_randomize(&p, 7, 3.0);
    for (size_t k = 0; k < TU_COUNT(budgets); k++)
        for (int train_step = 0; train_step <= 1; train_step++) {
            const cp_config cfg = {.threads = 1, .memory_budget = budgets[k], .train_step = train_step};
            fh_context *ctx = cp_context(&cfg);
            fh_linear lin;
            cp_problem_linear(&p, &lin);
            size_t bytes = 0;
            const fh_status st = train_step ? fh_ce_forward_backward_workspace_size(ctx, &lin, &p.options, &bytes)
                                            : fh_ce_workspace_size(ctx, &lin, &p.options, &bytes);
            TU_CHECK(st == FH_OK, "budget %lld, train step %d: workspace size status %d", (long long)budgets[k],
                     train_step, (int)st);
            TU_CHECK(bytes > 0 && bytes <= (size_t)budgets[k], "budget %lld, train step %d: workspace size %zu does not fit",
                     (long long)budgets[k], train_step, bytes);
            fh_context_destroy(ctx);
            char label[64];
            snprintf(label, sizeof label, "memory budget %lld", (long long)budgets[k]);
            cp_check_against_reference(&p, &cfg, label);
        }
    cp_problem_free(&p);
}

/* Strided views: x rows padded, the weight padded (or gapped) in either orientation, dx rows padded.
 * dweight uses the weight's strides. The padding must stay untouched and the values must match the
 * contiguous reference (ce_metrics_pass). */
static void test_strided_views(void)
{
    enum { N = 13, H = 7, V = 37, XPAD = 3, DXPAD = 2 };
    static const struct {
        const char *name;
        int64_t w_stride_hidden, w_stride_vocab;
    } views[] = {
        {"hv padded rows", V + 5, 1},      /* [H, V + 5] */
        {"vh padded rows", 1, H + 2},      /* [V, H + 2] */
        {"gapped", 2, 2 * H + 1},          /* elements at 2k + (2H + 1) v: disjoint, neither contiguous */
    };
    const float canary = 12345.0f;
    for (size_t variant = 0; variant < 2 * TU_COUNT(views); variant++) {
        const size_t k = variant / 2;
        const int train_step = (int)(variant % 2);
        cp_problem p;
        cp_problem_init(&p, N, H, V, FH_LAYOUT_HV, CP_BIAS);
        cp_problem_randomize(&p, 40 + k, 3.0);
        const int64_t sh = views[k].w_stride_hidden, sv = views[k].w_stride_vocab;
        const size_t wspan = (size_t)((H - 1) * sh + (V - 1) * sv + 1);
        const size_t xspan = (size_t)(N * (H + XPAD)), dxspan = (size_t)(N * (H + DXPAD));
        float *x = malloc(xspan * sizeof *x), *w = malloc(wspan * sizeof *w);
        float *dx = malloc(dxspan * sizeof *dx), *dw = malloc(wspan * sizeof *dw);
        for (size_t i = 0; i < xspan; i++)
            x[i] = canary;
        for (size_t i = 0; i < wspan; i++)
            w[i] = dw[i] = canary;
        for (size_t i = 0; i < dxspan; i++)
            dx[i] = canary;
        for (int64_t i = 0; i < N; i++)
            for (int64_t c = 0; c < H; c++) {
                x[i * (H + XPAD) + c] = p.x[i * H + c];
                dx[i * (H + DXPAD) + c] = NAN; /* beta 0 must overwrite */
            }
        for (int64_t c = 0; c < H; c++)
            for (int64_t j = 0; j < V; j++) {
                w[c * sh + j * sv] = p.weight[cp_weight_index(&p, c, j)];
                dw[c * sh + j * sv] = NAN;
            }
        const fh_linear lin = {N, H, V, x, H + XPAD, w, sh, sv, p.bias, FH_DTYPE_F32, FH_DTYPE_F32};
        cp_fused f;
        memset(&f, 0, sizeof f);
        f.per_token_loss = calloc(N, sizeof(float));
        f.logp = calloc(N, sizeof(float));
        f.lse = calloc(N, sizeof(float));
        f.argmax = calloc(N, sizeof(int64_t));
        f.dx = calloc(N * H, sizeof(float));
        f.dweight = calloc(H * V, sizeof(float));
        f.dbias = calloc(V, sizeof(float));
        const cp_config cfg = {.threads = 2, .tile_rows = 4, .tile_vocab = 16};
        fh_context *ctx = cp_context(&cfg);
        fh_ce_outputs out = {&f.loss, &f.z_loss, f.per_token_loss, f.logp, f.lse, f.argmax, NULL, NULL};
        fh_linear_grads g = {.dx = dx, .dx_row_stride = H + DXPAD, .dx_beta = 0.0f, .dweight = dw, .dweight_beta = 0.0f, .dbias = f.dbias, .dbias_beta = 0.0f};
        fh_status st;
        if (train_step)
            st = fh_ce_forward_backward(ctx, &lin, p.targets, &p.options, p.grad_output, &out, &g);
        else if ((st = fh_ce_forward(ctx, &lin, p.targets, &p.options, &out)) == FH_OK)
            st = fh_ce_backward(ctx, &lin, p.targets, &p.options, f.lse, p.grad_output, &g);
        TU_CHECK(st == FH_OK, "%s, train step %d: status %d", views[k].name, train_step, (int)st);
        fh_context_destroy(ctx);
        /* Gather the views into contiguous arrays; count writes into the padding. */
        size_t touched = 0;
        for (int64_t i = 0; i < N; i++)
            for (int64_t c = H; c < H + DXPAD; c++)
                touched += dx[i * (H + DXPAD) + c] != canary;
        for (int64_t i = 0; i < N; i++)
            for (int64_t c = 0; c < H; c++)
                f.dx[i * H + c] = dx[i * (H + DXPAD) + c];
        size_t in_view = 0;
        for (int64_t c = 0; c < H; c++)
            for (int64_t j = 0; j < V; j++) {
                f.dweight[cp_weight_index(&p, c, j)] = dw[c * sh + j * sv];
                in_view++;
            }
        size_t untouched = 0;
        for (size_t i = 0; i < wspan; i++)
            untouched += dw[i] == canary;
        TU_CHECK(touched == 0, "%s, train step %d: %zu dx padding elements written", views[k].name, train_step,
                 touched);
        TU_CHECK(untouched == wspan - in_view, "%s, train step %d: dweight padding written (%zu of %zu untouched)",
                 views[k].name, train_step, untouched, wspan - in_view);
        if (st == FH_OK) {
            cp_reference r;
            ce_metrics m;
            char ms[512];
            cp_run_reference(&p, 0.0f, &r);
            cp_measure(&p, &f, &r, &m);
            cp_format_metrics(&m, ms, sizeof ms);
            TU_CHECK(ce_metrics_pass(&m), "%s, train step %d: fused vs reference: %s", views[k].name, train_step, ms);
            cp_reference_free(&r);
        }
        cp_fused_free(&f);
        free(x);
        free(w);
        free(dx);
        free(dw);
        cp_problem_free(&p);
    }
}

/* fp32 row blocks keep every row's f32 dU in chunks, their logits computed straight into them, in the memory of a
 * dense [V, H] dweight with beta 0 (written only after the last block) where that leaves the workspace smaller: at
 * N <= H. At N = 8, H = 32, V = 20000 (three chunks of at most 8192 columns) the first two chunks fit, the last stays
 * in the workspace; at N = 48 > H nothing fits and the blocks write dweight themselves. Against the reference
 * (ce_metrics_pass; the class weights, bias and label smoothing exercise the loaded rows' columns): one row block and
 * three, a 512 KiB budget (which cannot hold the 640 KB block beside the 160 KB of column sums), beta 1 (nothing
 * moves) and [H, V] (nothing moves). Small, for qemu's sake (scripts/test-aarch64). */
static void test_fp32_chunks_in_dweight(void)
{
    ce_case_spec s;
    ce_case_spec_default(&s);
    s.hidden = 32;
    s.vocab = 20000;
    s.bias = 1;
    s.label_smoothing = 0.1;
    s.train_step = 1;
    s.seed = 23;
    for (int layout = 0; layout < 2; layout++)
        for (int beta = 0; beta < 2; beta++)
            for (int run = 0; run < 4; run++) {
                static const int64_t n[4] = {8, 8, 8, 48}, rows[4] = {0, 3, 0, 0}, budget[4] = {0, 0, 512 << 10, 0};
                s.n = n[run];
                s.tile_rows = rows[run];
                s.budget = budget[run];
                s.layout = (fh_layout)layout;
                s.grad_beta = (float)beta;
                cp_check_spec(&s, layout == FH_LAYOUT_VH && !beta && n[run] < s.hidden
                                      ? "fp32 train step, dU chunks in dweight"
                                      : "fp32 train step, nothing in dweight");
            }
}

/* Small fixed values: x (n x h floats), the weight (h x v) and targets. */
static void fill_fp32_problem(float *x, float *w, int64_t *targets, int64_t n, int64_t h, int64_t v)
{
    for (int64_t i = 0; i < n * h; i++)
        x[i] = (float)((i % 7) - 3) * 0.1f;
    for (int64_t i = 0; i < v * h; i++)
        w[i] = (float)((i % 11) - 5) * 0.05f;
    for (int64_t i = 0; i < n; i++)
        targets[i] = (i * 997) % v;
}

/* The query that sees such a call's gradients answers what stays in the workspace, and a workspace of exactly that
 * serves the call. H = 16, V = 32768: four chunks of 8192 columns. At N = 8 and at N = H = 16 all but the last chunk
 * fit in dweight, so the answer is the other query's (which holds the N x V logits block) less the block, plus one
 * chunk and the tile's one V-wide row (one thread); at N = 32 > H only one chunk would fit (three would stay, more
 * than half the block), and with beta 1 or [H, V] nothing moves: both queries agree. */
static void test_fp32_workspace_without_scratch(void)
{
    enum { MAX_N = 32, H = 16, V = 32768 };
    float *x = calloc((size_t)MAX_N * H, sizeof(float)), *w = calloc((size_t)V * H, sizeof(float));
    float *dx = calloc((size_t)MAX_N * H, sizeof(float)), *dw = calloc((size_t)V * H, sizeof(float));
    int64_t targets[MAX_N];
    TU_CHECK(x && w && dx && dw, "allocations");
    if (x && w)
        fill_fp32_problem(x, w, targets, MAX_N, H, V);
    fh_ce_options o;
    fh_ce_options_init(&o);
    for (int run = 0; run < 12 && x && w && dx && dw; run++) {
        static const int64_t ns[3] = {8, H, MAX_N};
        const int64_t n = ns[run / 4];
        const fh_layout layout = run & 2 ? FH_LAYOUT_HV : FH_LAYOUT_VH;
        const int beta = run & 1, moves = n <= H && layout == FH_LAYOUT_VH && !beta;
        fh_linear lin;
        fh_linear_init(&lin, n, H, V, x, w, layout, NULL);
        fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw, .dweight_beta = (float)beta};
        fh_context *ctx = tu_context(1, 0, 0, 0);
        size_t any = 0, these = 0;
        TU_CHECK(fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &any) == FH_OK &&
                     fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &o, &g, &these) == FH_OK,
                 "N = %lld, run %d: queries", (long long)n, run);
        const size_t block = (size_t)n * V * sizeof(float), chunk = (size_t)n * 8192 * sizeof(float);
        const size_t row = (size_t)V * sizeof(float);
        if (moves)
            TU_CHECK(these + block <= any + chunk + row + 64 && these + block + 64 >= any + chunk + row,
                     "N = %lld: %zu bytes with the gradients, %zu without, a block of %zu, a chunk of %zu",
                     (long long)n, these, any, block, chunk);
        else
            TU_CHECK(these == any, "N = %lld, run %d: queries %zu and %zu", (long long)n, run, these, any);
        void *ws = malloc(these);
        TU_CHECK(ws && fh_context_set_workspace(ctx, ws, these) == FH_OK, "set a workspace of %zu bytes", these);
        double loss = 0.0;
        fh_ce_outputs out = {.loss = &loss};
        const float one = 1.0f;
        const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &g);
        TU_CHECK(st == FH_OK, "N = %lld, run %d, in a workspace of %zu bytes: status %d", (long long)n, run, these,
                 (int)st);
        fh_context_destroy(ctx);
        free(ws);
    }
    free(x);
    free(w);
    free(dx);
    free(dw);
}

/* f's leading 16 bits: a bf16 value near it. */
static uint16_t bf16_bits(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* A caller's dweight need not be aligned (torch's sits 16 bytes past a 64-byte boundary). fp32 (N = 8, H = 14,
 * V = 32768): the dU chunks are placed by bytes from dweight's first, three of four fit. bf16 (N = 8, H = 22,
 * V = 32768): the f32 logits block (1 MiB) and three of the four bf16 chunks (128 KiB each) fill dweight (1.375 MiB)
 * exactly, so with the unaligned dweight the block sits at its first byte, not its first aligned one (which would
 * leave room for two chunks). Either way the workspace is the aligned call's, and the loss and gradients equal that
 * call's bit for bit. */
static void test_scratch_in_unaligned_dweight(void)
{
    enum { N = 8, V = 32768 };
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t H = bf16 ? 22 : 14;
        const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float), dw_bytes = elem * V * (size_t)H;
        float *x = malloc(sizeof(float) * N * H), *w = malloc(sizeof(float) * V * H);
        void *dx[2] = {malloc(elem * N * H), malloc(elem * N * H)};
        char *unaligned = aligned_alloc(64, dw_bytes + 64);
        void *dw[2] = {aligned_alloc(64, dw_bytes), unaligned ? unaligned + 16 : NULL};
        int64_t targets[N];
        const int ready = x && w && dx[0] && dx[1] && dw[0] && dw[1];
        TU_CHECK(ready, "allocations");
        if (ready) {
            fill_fp32_problem(x, w, targets, N, H, V);
            if (bf16) { /* the bf16 bits of the same values, in the first half of each array */
                for (int64_t i = 0; i < N * H; i++)
                    ((uint16_t *)x)[i] = bf16_bits(x[i]);
                for (int64_t i = 0; i < V * H; i++)
                    ((uint16_t *)w)[i] = bf16_bits(w[i]);
            }
        }
        fh_ce_options o;
        fh_ce_options_init(&o);
        double loss[2] = {0.0, 0.0};
        size_t these[2] = {0, 0}, any = 0;
        const size_t block = sizeof(float) * N * V;
        for (int k = 0; k < 2 && ready; k++) {
            fh_linear lin;
            fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
            const fh_dtype dtype = bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
            lin.x_dtype = lin.weight_dtype = dtype;
            fh_linear_grads g = {.dx = dx[k], .dx_row_stride = H, .dweight = dw[k], .dx_dtype = dtype,
                                 .dweight_dtype = dtype};
            fh_context *ctx = tu_context(1, 0, 0, 0);
            TU_CHECK(fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &o, &g, &these[k]) == FH_OK &&
                         fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &any) == FH_OK,
                     "queries");
            fh_ce_outputs out = {.loss = &loss[k]};
            const float one = 1.0f;
            TU_CHECK(fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &g) == FH_OK, "call %d", k);
            fh_context_destroy(ctx);
        }
        TU_CHECK(these[0] == these[1], "%s: the workspace holds %zu bytes with an aligned dweight, %zu with an "
                 "unaligned one", bf16 ? "bf16" : "fp32", these[0], these[1]);
        /* What moved: the logits block (bf16) or most of it (fp32: all but one chunk and the tile's row). */
        TU_CHECK(these[0] + block / 2 <= any, "%s: %zu bytes stay in the workspace, %zu without the gradients",
                 bf16 ? "bf16" : "fp32", these[0], any);
        const int same_dx = ready && memcmp(dx[0], dx[1], elem * N * H) == 0;
        const int same_dw = ready && memcmp(dw[0], dw[1], dw_bytes) == 0;
        TU_CHECK(ready && loss[0] == loss[1] && same_dx && same_dw,
                 "%s, aligned and unaligned dweight: loss %.17g and %.17g, dx equal %d, dweight equal %d",
                 bf16 ? "bf16" : "fp32", loss[0], loss[1], same_dx, same_dw);
        free(x);
        free(w);
        free(dx[0]);
        free(dx[1]);
        free(dw[0]);
        free(unaligned);
    }
}

static const tu_test tests[] = {
    {"tile edges, [H,V] weight, 1 thread", test_edges_hv_1thread},
    {"tile edges, [V,H] weight, 1 thread", test_edges_vh_1thread},
    {"tile edges, [H,V] weight, 2 threads", test_edges_hv_2threads},
    {"tile edges, [V,H] weight, 2 threads", test_edges_vh_2threads},
    {"tile configurations and default tiles", test_tile_configurations},
    {"memory budget shrinks tiles", test_memory_budget_shrinks_tiles},
    {"strided views", test_strided_views},
    {"fp32 train step, logits computed into dU chunks in dweight's memory", test_fp32_chunks_in_dweight},
    {"fp32 train step, the workspace without them", test_fp32_workspace_without_scratch},
    {"logits block and dU chunks in an unaligned dweight, fp32 and bf16", test_scratch_in_unaligned_dweight},
};
const tu_suite suite_shapes = {tests, TU_COUNT(tests)};
