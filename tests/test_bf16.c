/* bf16 hidden states and weight: every cross-entropy option, both layouts, both schedules and their tile
 * edges, with fp32 or bf16 gradients and with fp32 dU, against the double reference run on the same
 * bf16-valued inputs (tolerances in tests/cases/ce_case.c); and the dtype contract. In a build without oneDNN, bf16 must
 * be refused with FH_ERR_INVALID_DTYPE. */
#include "bf16.h"
#include "ce_case.h"
#include "ce_harness.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ce_case_spec bf16_spec(fh_layout layout, int train_step)
{
    ce_case_spec s;
    ce_case_spec_default(&s);
    s.n = 97;
    s.hidden = 67;
    s.vocab = 1031;
    s.layout = layout;
    s.train_step = train_step;
    s.dtype = FH_DTYPE_BF16;
    s.seed = 11;
    return s;
}

static void test_options(void)
{
    for (int layout = 0; layout < 2; layout++)
        for (int train_step = 0; train_step < 2; train_step++)
            for (int options = 0; options < 2; options++) {
                ce_case_spec s = bf16_spec((fh_layout)layout, train_step);
                if (options) {
                    s.bias = 1;
                    s.ignore_frac = 0.1;
                    s.label_smoothing = 0.1;
                    s.class_weights = 1;
                    s.softcap = 30.0;
                    s.z_loss = 1e-4;
                    s.reduction = FH_REDUCTION_NONE;
                }
                cp_check_spec(&s, options ? "bf16, every option" : "bf16, no options");
            }
}

/* The spec's case in the streaming passes with edge tiles in both directions, in a train step of three row blocks,
 * and in a train step with beta 1: every GEMM shape the engine prepares. */
static void check_schedules(ce_case_spec s)
{
    s.train_step = 0;
    s.tile_rows = 40;
    s.tile_vocab = 300;
    cp_check_spec(&s, "bf16 streaming, edge tiles");
    s.train_step = 1;
    s.tile_vocab = 0;
    cp_check_spec(&s, "bf16 train step, three row blocks");
    s.tile_rows = 0;
    s.grad_beta = 1.0f;
    cp_check_spec(&s, "bf16 train step, beta 1");
}

/* check_schedules with a bias, and the train step's streaming fallback under a small budget. */
static void test_tiles_and_beta(void)
{
    for (int layout = 0; layout < 2; layout++) {
        ce_case_spec s = bf16_spec((fh_layout)layout, 1);
        s.bias = 1;
        check_schedules(s);
        s.budget = 64 << 10;
        cp_check_spec(&s, "bf16 train step, streaming fallback under a small budget");
    }
}

/* logit_scale (with and without softcap), DFT, the entropy and the correct count in bf16: both layouts, every
 * reduction, fp32 and bf16 gradients, through check_schedules (streaming over edge tiles, three row blocks, beta 1)
 * and the train step's streaming fallback under a small budget. Tolerances: ce_metrics_pass (tests/cases/ce_case.c: the
 * bf16 gradient bounds plus CE_DFT_REL_TOL with DFT). */
static void test_logit_scale_dft_entropy(void)
{
    const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};
    for (int layout = 0; layout < 2; layout++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++) {
            ce_case_spec s = bf16_spec((fh_layout)layout, 1);
            s.bias = 1;
            s.ignore_frac = 0.1;
            s.reduction = reductions[r];
            s.grad_dtype = (fh_dtype)((layout + (int)r) % 2);
            s.ce_logit_scale = r == 1 ? 0.5 : 2.0;
            s.softcap = r == 2 ? 0.0 : 15.0;
            s.token_scaling = r != 1;
            s.entropy = 1;
            s.seed = 40 + r;
            check_schedules(s);
            s.tile_rows = 0;
            s.grad_beta = 0.0f;
            s.budget = 64 << 10;
            cp_check_spec(&s, "bf16 train step, streaming fallback under a small budget");
        }
}

/* bf16 gradients (f32 accumulators while streaming, direct in row blocks) and fp32 dU (BLIS on f32 copies of the
 * tiles), with every option, in check_schedules (beta 1: the old bf16 value added in f32). */
static void test_gradient_dtypes(void)
{
    for (int fp32_du = 0; fp32_du < 2; fp32_du++)
        for (int grad_dtype = 0; grad_dtype < 2; grad_dtype++)
            for (int layout = 0; layout < 2; layout++) {
                ce_case_spec s = bf16_spec((fh_layout)layout, 0);
                s.fp32_du = fp32_du;
                s.grad_dtype = (fh_dtype)grad_dtype;
                s.bias = 1;
                s.ignore_frac = 0.1;
                s.label_smoothing = 0.1;
                s.class_weights = 1;
                s.softcap = 30.0;
                check_schedules(s);
            }
}

/* With beta 0 a bf16 gradient is its fp32 twin rounded once, bit for bit: the same GEMMs accumulate the same f32
 * values (in the caller's fp32 buffer, or in the f32 accumulator / the GEMM's own) before the one rounding. Weight
 * views with unit vocabulary stride, unit hidden stride, and neither; the streaming passes over edge tiles and
 * the train step's row blocks. */
static void test_bf16_gradients_are_rounded_fp32(void)
{
    enum { N = 23, H = 9, V = 301 };
    static const int64_t strides[][2] = {{V, 1}, {1, H}, {2 * V + 1, 2}, {2, 3 * H}}; /* hidden, vocab */
    uint64_t rng = 5;
    uint16_t x[N * H];
    for (int i = 0; i < N * H; i++)
        x[i] = bf16_from_float((float)(2.0 * ref_uniform(&rng) - 1.0));
    int64_t targets[N];
    for (int i = 0; i < N; i++)
        targets[i] = (i * 53) % V;
    fh_ce_options o;
    fh_ce_options_init(&o);
    for (size_t k = 0; k < TU_COUNT(strides); k++) {
        const int64_t sh = strides[k][0], sv = strides[k][1], extent = (H - 1) * sh + (V - 1) * sv + 1;
        uint16_t *w = calloc((size_t)extent, sizeof *w), *dw16 = calloc((size_t)extent, sizeof *dw16);
        float *dw32 = calloc((size_t)extent, sizeof *dw32);
        uint16_t dx16[N * H];
        float dx32[N * H], lse[N];
        for (int64_t j = 0; j < V; j++)
            for (int64_t h = 0; h < H; h++)
                w[h * sh + j * sv] = bf16_from_float((float)(0.6 * ref_uniform(&rng) - 0.3));
        fh_linear lin;
        fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_HV, NULL);
        lin.w_stride_hidden = sh;
        lin.w_stride_vocab = sv;
        lin.x_dtype = lin.weight_dtype = FH_DTYPE_BF16;
        for (int train_step = 0; train_step < 2; train_step++) {
            fh_context *ctx = tu_context(2, train_step ? 10 : 7, train_step ? 0 : 64, 0);
            const float one = 1.0f;
            fh_ce_outputs out = {.lse = lse};
            fh_linear_grads g32 = {.dx = dx32, .dx_row_stride = H, .dweight = dw32};
            fh_linear_grads g16 = {.dx = dx16, .dx_row_stride = H, .dweight = dw16, .dx_dtype = FH_DTYPE_BF16,
                                   .dweight_dtype = FH_DTYPE_BF16};
            fh_status st = fh_ce_forward(ctx, &lin, targets, &o, &out);
            for (int pass = 0; st == FH_OK && pass < 2; pass++)
                st = train_step ? fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, pass ? &g16 : &g32)
                                : fh_ce_backward(ctx, &lin, targets, &o, lse, &one, pass ? &g16 : &g32);
            TU_CHECK(st == FH_OK, "strides %zu, %s: status %d", k, train_step ? "train step" : "split", (int)st);
            int64_t dx_mismatch = 0, dw_mismatch = 0;
            for (int i = 0; i < N * H; i++)
                dx_mismatch += dx16[i] != bf16_from_float(dx32[i]);
            for (int64_t j = 0; j < V; j++)
                for (int64_t h = 0; h < H; h++)
                    dw_mismatch += dw16[h * sh + j * sv] != bf16_from_float(dw32[h * sh + j * sv]);
            TU_CHECK(dx_mismatch == 0 && dw_mismatch == 0,
                     "strides (%lld, %lld), %s: %lld dx and %lld dweight elements differ from the rounded fp32 gradient",
                     (long long)sh, (long long)sv, train_step ? "train step" : "split", (long long)dx_mismatch,
                     (long long)dw_mismatch);
            fh_context_destroy(ctx);
        }
        free(w);
        free(dw16);
        free(dw32);
    }
}

/* Small deterministic bf16 hidden states [n, H] and weight, and targets spread over the vocabulary by `step`. */
static void fill_problem(uint16_t *x, uint16_t *w, int64_t *targets, int64_t n, int64_t h, int64_t v, int64_t step)
{
    for (int64_t i = 0; i < n * h; i++)
        x[i] = bf16_from_float((float)((i % 7) - 3) * 0.1f);
    for (int64_t i = 0; i < v * h; i++)
        w[i] = bf16_from_float((float)((i % 11) - 5) * 0.05f);
    for (int64_t i = 0; i < n; i++)
        targets[i] = (i * step) % v;
}

/* A caller's workspace of exactly the queried size serves bf16 calls whatever their gradient dtypes: the query
 * does not see them, so the plan reserves the accumulators of bf16 gradients. */
static void test_queried_workspace_serves_bf16_gradients(void)
{
    enum { N = 50, H = 24, V = 700 };
    static uint16_t x[N * H], w[V * H], dx[N * H], dw[V * H];
    int64_t targets[N];
    fill_problem(x, w, targets, N, H, V, 37);
    fh_ce_options o;
    fh_ce_options_init(&o);
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
    lin.x_dtype = lin.weight_dtype = FH_DTYPE_BF16;
    for (int train_step = 0; train_step < 2; train_step++)
        for (int64_t budget = 0; budget <= (64 << 10); budget += 64 << 10) {
            fh_context *ctx = tu_context(1, 16, 96, budget);
            size_t bytes = 0;
            const fh_status q = train_step ? fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &bytes)
                                           : fh_ce_workspace_size(ctx, &lin, &o, &bytes);
            void *ws = malloc(bytes);
            TU_CHECK(q == FH_OK && ws && fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "query and set %zu bytes",
                     bytes);
            float lse[N];
            double loss = 0.0;
            fh_ce_outputs out = {.loss = &loss, .lse = lse};
            fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw, .dx_dtype = FH_DTYPE_BF16,
                                 .dweight_dtype = FH_DTYPE_BF16};
            const float one = 1.0f;
            fh_status st = train_step ? fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &g)
                                      : fh_ce_forward(ctx, &lin, targets, &o, &out);
            if (st == FH_OK && !train_step)
                st = fh_ce_backward(ctx, &lin, targets, &o, lse, &one, &g);
            TU_CHECK(st == FH_OK, "%s, budget %lld, in the queried %zu bytes: status %d", train_step ? "train step" : "split",
                     (long long)budget, bytes, (int)st);
            fh_context_destroy(ctx);
            free(ws);
        }
}

/* The train step keeps its logits block and its dU chunks in the memory of a dense dweight with beta 0 (written
 * only after the last block). At N = 40, H = 160, V = 20000 the dU has three chunks of 8192 columns or fewer: with
 * [V, H] the first two and the block fit in a bf16 or fp32 dweight, the last chunk stays in the workspace; with
 * [H, V] only the block does; with beta 1 nothing does. At N = 240 (H < N < 2 H) the chunks fit in an fp32
 * dweight only. Under a 1 MiB budget, which cannot hold the block or the dU (4.6 MiB), the step runs in row blocks
 * with them in dweight, and streams with beta 1. Each against the reference (the tolerances of tests/cases/ce_case.c for
 * the gradients' dtype), in one row block and in three. */
static void test_scratch_in_dweight(void)
{
    ce_case_spec s = bf16_spec(FH_LAYOUT_VH, 1);
    s.hidden = 160;
    s.vocab = 20000;
    s.bias = 1;
    s.label_smoothing = 0.1;
    for (int grad_dtype = 0; grad_dtype < 2; grad_dtype++)
        for (int layout = 0; layout < 2; layout++)
            for (int beta = 0; beta < 2; beta++)
                for (int64_t rows = 0; rows <= 16; rows += 16) {
                    s.n = 40;
                    s.layout = (fh_layout)layout;
                    s.grad_dtype = (fh_dtype)grad_dtype;
                    s.grad_beta = (float)beta;
                    s.tile_rows = rows;
                    cp_check_spec(&s, beta ? "bf16 train step, beta 1: nothing in dweight"
                                           : "bf16 train step, logits block and dU chunks in dweight");
                }
    s.n = 40;
    s.layout = FH_LAYOUT_VH;
    s.grad_dtype = FH_DTYPE_BF16;
    s.tile_rows = 0;
    s.budget = 1 << 20;
    for (int beta = 0; beta < 2; beta++) {
        s.grad_beta = (float)beta;
        cp_check_spec(&s, beta ? "bf16 train step under a 1 MiB budget, beta 1: streams"
                               : "bf16 train step under a 1 MiB budget: row blocks with scratch in dweight");
    }
    s.budget = 0;
    s.n = 240;
    s.grad_dtype = FH_DTYPE_F32;
    s.grad_beta = 0.0f;
    cp_check_spec(&s, "bf16 train step, dU chunks in an fp32 dweight, H < N < 2 H");
}

/* When every row's bf16 dU does not fit the budget, the train step's row blocks add their dweight GEMMs into an f32
 * accumulator (bf16 dweight; an fp32 one directly), one GEMM per span of blocks whose dU the du buffer holds, rounded
 * once after the last span, instead of streaming. N = 200, H = 48, V = 3001, every row's dU (1.2 MB) beyond the
 * budget: under 1 MiB the accumulator (0.6 MB) and blocks of about 24 rows (18 KB a row: logits and dU) fit, nine
 * blocks, each its own span; under 1.4 MiB 20-row blocks in spans of several (the du buffer's rest of the budget) and
 * a shorter last span. Both layouts, bf16 and fp32 gradients, beta 0 and 1, against the reference (the tolerances of
 * tests/cases/ce_case.c for the gradients' dtype). */
static void test_blocks_with_a_dweight_accumulator(void)
{
    static const struct {
        int64_t tile_rows, budget;
        const char *what;
    } runs[] = {{40, 1 << 20, "bf16 train step, row blocks with a dweight accumulator, a span each"},
                {8, 1150 << 10, "bf16 train step, row blocks with a dweight accumulator, spans of several"}};
    ce_case_spec s = bf16_spec(FH_LAYOUT_VH, 1);
    s.n = 200;
    s.hidden = 48;
    s.vocab = 3001;
    s.bias = 1;
    for (size_t run = 0; run < TU_COUNT(runs); run++)
        for (int grad_dtype = 0; grad_dtype < 2; grad_dtype++)
            for (int layout = 0; layout < 2; layout++)
                for (int beta = 0; beta < 2; beta++) {
                    s.tile_rows = runs[run].tile_rows;
                    s.budget = runs[run].budget;
                    s.layout = (fh_layout)layout;
                    s.grad_dtype = (fh_dtype)grad_dtype;
                    s.grad_beta = (float)beta;
                    cp_check_spec(&s, runs[run].what);
                }
}

/* The caller's workspace such a train step needs shrinks by what dweight holds, and the query that sees the
 * gradients says by how much: at N = 40, H = 160, V = 20000 ([V, H] with bf16 or fp32 gradients, [H, V]) and at
 * N = 240 in 80-row blocks with an fp32 dweight, beta 0, it answers at least the logits block (3.1 and 6.1 MiB)
 * less than the query that does not (which the test's fixed workspaces then cannot hold), and a workspace of exactly
 * its answer serves the call; with beta 1 nothing moves, and both queries agree. */
static void test_workspace_without_scratch(void)
{
    enum { MAX_N = 240, H = 160, V = 20000 };
    static const struct {
        int64_t n, tile_rows;
        fh_layout layout;
        fh_dtype grads;
        size_t bytes; /* holds what stays in the workspace, not the logits block */
    } cases[] = {{40, 0, FH_LAYOUT_VH, FH_DTYPE_BF16, (size_t)1 << 20},
                 {40, 0, FH_LAYOUT_HV, FH_DTYPE_BF16, (size_t)5 << 19},
                 {40, 0, FH_LAYOUT_VH, FH_DTYPE_F32, (size_t)1 << 20},
                 {240, 80, FH_LAYOUT_VH, FH_DTYPE_F32, (size_t)8 << 20}};
    uint16_t *x = malloc(sizeof(uint16_t) * MAX_N * H), *w = malloc(sizeof(uint16_t) * V * H);
    float *dx = calloc(MAX_N * H, sizeof(float)), *dw = calloc((size_t)V * H, sizeof(float));
    float *bias = calloc(V, sizeof(float)), *db = calloc(V, sizeof(float));
    void *ws = malloc((size_t)64 << 20);
    int64_t targets[MAX_N];
    fh_kernel_info info;
    const int convert = fh_kernel_query(&info) == FH_OK && strcmp(info.bf16_path, "convert") == 0;
    fh_ce_options o;
    fh_ce_options_init(&o);
    TU_CHECK(x && w && dx && dw && bias && db && ws, "allocations");
    for (size_t k = 0; k < TU_COUNT(cases) && x && w && dx && dw && bias && db && ws; k++)
        for (int beta = 0; beta < 2; beta++) {
            const int64_t n = cases[k].n;
            fill_problem(x, w, targets, n, H, V, 997);
            fh_linear lin;
            fh_linear_init(&lin, n, H, V, x, w, cases[k].layout, bias);
            lin.x_dtype = lin.weight_dtype = FH_DTYPE_BF16;
            fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw, .dweight_beta = (float)beta,
                                 .dbias = db, .dx_dtype = cases[k].grads, .dweight_dtype = cases[k].grads,
                                 .dbias_dtype = cases[k].grads};
            char what[96];
            snprintf(what, sizeof what, "N = %lld, %s, %s gradients, dweight beta %d", (long long)n,
                     cases[k].layout == FH_LAYOUT_VH ? "[V, H]" : "[H, V]",
                     cases[k].grads == FH_DTYPE_BF16 ? "bf16" : "fp32", beta);
            fh_context *ctx = tu_context(1, cases[k].tile_rows, 0, 0);
            size_t any = 0, these = 0;
            TU_CHECK(fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &any) == FH_OK &&
                         fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &o, &g, &these) == FH_OK,
                     "%s: queries", what);
            const size_t block = (size_t)(cases[k].tile_rows ? cases[k].tile_rows : n) * V * sizeof(float);
            /* On the convert path the workspace also holds its f32 panels: as many floats as the block, at most
             * 24 MiB (gemm.h), which stay in the workspace. */
            const size_t fixed = cases[k].bytes + (convert ? (block < ((size_t)24 << 20) ? block : (size_t)24 << 20) : 0);
            if (beta)
                TU_CHECK(these == any && any > fixed, "%s: queries %zu and %zu, fixed workspace %zu", what, these, any,
                         fixed);
            else
                TU_CHECK(these + block <= any && these <= fixed, "%s: %zu bytes with the gradients, %zu without,"
                         " a block of %zu, fixed workspace %zu", what, these, any, block, fixed);
            const size_t sizes[2] = {these, fixed};
            for (int s = 0; s < 2 && these <= ((size_t)64 << 20); s++) {
                TU_CHECK(fh_context_set_workspace(ctx, ws, sizes[s]) == FH_OK, "set a workspace");
                double loss = 0.0;
                fh_ce_outputs out = {.loss = &loss};
                const float one = 1.0f;
                const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &g);
                const fh_status expected = s == 1 && beta ? FH_ERR_WORKSPACE_TOO_SMALL : FH_OK;
                TU_CHECK(st == expected, "%s, in a workspace of %zu bytes: status %d, expected %d", what, sizes[s],
                         (int)st, (int)expected);
            }
            fh_context_destroy(ctx);
        }
    free(x);
    free(w);
    free(dx);
    free(dw);
    free(bias);
    free(db);
    free(ws);
}

/* Mixed or unknown dtypes, bf16 without a provider, bf16 gradients of fp32 inputs and unknown gradient dtypes are
 * refused by name before any output is written. */
static void test_dtype_contract(void)
{
    enum { N = 3, H = 4, V = 5 };
    float x[N * H] = {0}, w[H * V] = {0}, dx[N * H], dw[H * V];
    const int64_t targets[N] = {0, 1, 2};
    fh_context *ctx = tu_context(0, 0, 0, 0);
    fh_ce_options o;
    fh_ce_options_init(&o);
    static const struct {
        fh_dtype x, weight, dx, dweight;
        const char *named; /* in the message; NULL: valid where the build has oneDNN */
    } cases[] = {{FH_DTYPE_BF16, FH_DTYPE_F32, FH_DTYPE_F32, FH_DTYPE_F32, "dtype"},
                 {FH_DTYPE_F32, FH_DTYPE_BF16, FH_DTYPE_F32, FH_DTYPE_F32, "dtype"},
                 {(fh_dtype)7, (fh_dtype)7, FH_DTYPE_F32, FH_DTYPE_F32, "dtype"},
                 {FH_DTYPE_BF16, FH_DTYPE_BF16, FH_DTYPE_F32, FH_DTYPE_F32, NULL},
                 {FH_DTYPE_F32, FH_DTYPE_F32, FH_DTYPE_BF16, FH_DTYPE_F32, "dx_dtype"},
                 {FH_DTYPE_F32, FH_DTYPE_F32, FH_DTYPE_F32, FH_DTYPE_BF16, "dweight_dtype"},
                 {FH_DTYPE_F32, FH_DTYPE_F32, FH_DTYPE_F32, (fh_dtype)3, "dweight_dtype"}};
    float canary;
    tu_fill_canary(&canary, sizeof canary);
    for (size_t k = 0; k < TU_COUNT(cases); k++) {
        fh_linear lin;
        fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
        lin.x_dtype = cases[k].x;
        lin.weight_dtype = cases[k].weight;
        const int valid = !cases[k].named;
        tu_fill_canary(dx, sizeof dx);
        tu_fill_canary(dw, sizeof dw);
        double loss = 1234.5;
        fh_ce_outputs out = {.loss = &loss};
        fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw, .dx_dtype = cases[k].dx,
                             .dweight_dtype = cases[k].dweight};
        const float grad = 1.0f;
        const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &o, &grad, &out, &g);
        TU_CHECK(valid ? st == FH_OK : st == FH_ERR_INVALID_DTYPE, "case %zu: status %d (%s)", k, (int)st,
                 fh_status_string(st));
        if (!valid) {
            const char *why = NULL;
            fh_context_message(ctx, &why);
            TU_CHECK(why && strstr(why, cases[k].named ? cases[k].named : "dtype"), "case %zu: the message names %s: %s",
                     k, cases[k].named ? cases[k].named : "the dtype", why ? why : "(none)");
            TU_CHECK(loss == 1234.5 && tu_all_equal_f(dx, N * H, canary) && tu_all_equal_f(dw, H * V, canary),
                     "case %zu: outputs untouched", k);
        } else {
            TU_CHECK(isfinite(loss), "bf16 zeros: finite loss %g", loss);
        }
    }
    /* A bf16 weight whose last element lies 2^61 elements from its base is a valid bf16 view (2^62 bytes), but
     * its fp32 gradient, written with the same strides, would be 2^63 bytes away: refused before anything runs
     * (hardening README, finding 4). */
    {
        uint16_t xb[2] = {0, 0}, wb[1] = {0};
        const int64_t two_targets[2] = {0, 1};
        const float lse[2] = {0.0f, 0.0f}, grad = 1.0f;
        fh_linear far;
        fh_linear_init(&far, 2, 1, 2, xb, wb, FH_LAYOUT_HV, NULL);
        far.x_dtype = far.weight_dtype = FH_DTYPE_BF16;
        far.w_stride_vocab = (int64_t)1 << 61;
        fh_linear_grads g = {.dweight = dw};
        const fh_status st = fh_ce_backward(ctx, &far, two_targets, &o, lse, &grad, &g);
        const char *why = NULL;
        fh_context_message(ctx, &why);
        TU_CHECK(st == FH_ERR_SIZE_OVERFLOW && why && strstr(why, "dweight"), "far fp32 dweight: status %d, %s",
                 (int)st, why ? why : "(none)");
    }
    fh_context_destroy(ctx);
}

/* FH_PARAM_CHECK_FINITE reads bf16 bits: a NaN or an Inf in x or weight is named, nothing is written; without the
 * check a NaN in row i of x reaches row i's loss. */
static void test_nonfinite_bf16(void)
{
    enum { N = 5, H = 8, V = 40 };
    uint16_t x[N * H], w[H * V];
    uint64_t rng = 77;
    for (int i = 0; i < N * H; i++)
        x[i] = bf16_from_float((float)(2.0 * ref_uniform(&rng) - 1.0));
    for (int i = 0; i < H * V; i++)
        w[i] = bf16_from_float((float)(2.0 * ref_uniform(&rng) - 1.0));
    const int64_t targets[N] = {0, 1, 2, 3, 4};
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.reduction = FH_REDUCTION_NONE;
    static const struct {
        int in_x;
        int at;
        uint16_t bits;
        const char *name;
    } cases[] = {{1, 2 * H + 3, 0x7fc0, "x[2][3]"}, {0, 5 * V + 7, 0xff80, "weight element (hidden 5, vocab 7)"}};
    for (size_t k = 0; k < TU_COUNT(cases); k++) {
        uint16_t *target = cases[k].in_x ? x : w;
        const uint16_t saved = target[cases[k].at];
        target[cases[k].at] = cases[k].bits;
        for (int check = 0; check <= 1; check++) {
            fh_context *ctx = tu_context(1, 0, 0, 0);
            fh_context_set(ctx, FH_PARAM_CHECK_FINITE, check);
            fh_linear lin;
            fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_HV, NULL);
            lin.x_dtype = lin.weight_dtype = FH_DTYPE_BF16;
            float per_token[N];
            tu_fill_canary(per_token, sizeof per_token);
            fh_ce_outputs out = {.per_token_loss = per_token};
            const fh_status st = fh_ce_forward(ctx, &lin, targets, &o, &out);
            const char *why = "";
            fh_context_message(ctx, &why);
            if (check) {
                float canary;
                tu_fill_canary(&canary, sizeof canary);
                TU_CHECK(st == FH_ERR_NONFINITE_INPUT && strstr(why, cases[k].name) &&
                             tu_all_equal_f(per_token, N, canary),
                         "%s non-finite, checked: status %d, message \"%s\", outputs untouched", cases[k].name,
                         (int)st, why);
            } else {
                /* NaN in x row 2 poisons that row only; -Inf in a weight column makes every logit of that
                 * column -Inf or NaN (0 x -Inf), so every row's loss is NaN or still finite (-Inf drops out of
                 * the softmax): only the call's success is asserted there. */
                TU_CHECK(st == FH_OK, "%s non-finite, unchecked: status %d", cases[k].name, (int)st);
                if (cases[k].in_x)
                    TU_CHECK(isnan(per_token[2]) && isfinite(per_token[1]) && isfinite(per_token[3]),
                             "NaN in x row 2: losses %g %g %g", (double)per_token[1], (double)per_token[2],
                             (double)per_token[3]);
            }
            fh_context_destroy(ctx);
        }
        target[cases[k].at] = saved;
    }
}

/* Wisdom entries carry a dtype: a bf16 entry tiles bf16 calls only, and survives a save and a load. */
static void test_wisdom_dtype(void)
{
    enum { N = 64, H = 16, V = 5000 };
    static float x[N * H], w[H * V];
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_ce_options o;
    fh_ce_options_init(&o);
    fh_linear f32, bf16;
    fh_linear_init(&f32, N, H, V, x, w, FH_LAYOUT_HV, NULL);
    bf16 = f32;
    bf16.x_dtype = bf16.weight_dtype = FH_DTYPE_BF16;
    size_t before_f32 = 0, before_bf16 = 0, after_f32 = 0, after_bf16 = 0;
    TU_CHECK(fh_ce_workspace_size(ctx, &f32, &o, &before_f32) == FH_OK, "fp32 query");
    const int bf16_ok = fh_ce_workspace_size(ctx, &bf16, &o, &before_bf16) == FH_OK;
    TU_CHECK(bf16_ok, "bf16 query (bf16 runs in every build: oneDNN or the convert path)");
    /* A tile much smaller than the defaults, for bf16 forward calls only. */
    const fh_tile_config e = {1, N, H, V, FH_CALL_FORWARD, 8, 64, FH_DTYPE_BF16};
    TU_CHECK(fh_context_add_wisdom(ctx, &e) == FH_OK, "add a bf16 entry");
    char path[] = "/tmp/fh_wisdom_dtype_XXXXXX";
    const int fd = mkstemp(path);
    TU_CHECK(fd >= 0, "temporary file");
    if (fd >= 0)
        close(fd);
    fh_context *loaded = tu_context(1, 0, 0, 0);
    TU_CHECK(fh_context_save_wisdom(ctx, path) == FH_OK && fh_context_load_wisdom(loaded, path) == FH_OK,
             "save and load %s", path);
    unlink(path);
    TU_CHECK(fh_ce_workspace_size(loaded, &f32, &o, &after_f32) == FH_OK, "fp32 query after");
    TU_CHECK(after_f32 == before_f32, "a bf16 entry changed an fp32 call's workspace: %zu -> %zu", before_f32,
             after_f32);
    if (bf16_ok) {
        TU_CHECK(fh_ce_workspace_size(loaded, &bf16, &o, &after_bf16) == FH_OK, "bf16 query after");
        TU_CHECK(after_bf16 < before_bf16, "the bf16 entry (8 x 64 forward tiles) did not shrink the bf16 workspace: "
                 "%zu -> %zu", before_bf16, after_bf16);
    }
    const fh_tile_config bad = {1, N, H, V, FH_CALL_FORWARD, 8, 64, 7};
    TU_CHECK(fh_context_add_wisdom(ctx, &bad) == FH_ERR_INVALID_WISDOM, "an unknown dtype is refused");
    fh_context_destroy(ctx);
    fh_context_destroy(loaded);
}

static const tu_test tests[] = {
    {"every option, both layouts and schedules", test_options},
    {"edge tiles, row blocks, streaming fallback, beta 1", test_tiles_and_beta},
    {"fp32 and bf16 gradients, fp32 dU", test_gradient_dtypes},
    {"logit_scale, DFT, entropy and correct count", test_logit_scale_dft_entropy},
    {"bf16 gradients are the fp32 ones rounded once", test_bf16_gradients_are_rounded_fp32},
    {"the queried workspace serves bf16 gradients", test_queried_workspace_serves_bf16_gradients},
    {"logits block and dU chunks in dweight's memory", test_scratch_in_dweight},
    {"row blocks with a dweight accumulator when every row's dU does not fit", test_blocks_with_a_dweight_accumulator},
    {"a smaller workspace with scratch in dweight, and the query that sees it", test_workspace_without_scratch},
    {"dtype contract", test_dtype_contract},
    {"wisdom entries per dtype", test_wisdom_dtype},
    {"non-finite bf16 inputs", test_nonfinite_bf16},
};
const tu_suite suite_bf16 = {tests, TU_COUNT(tests)};
