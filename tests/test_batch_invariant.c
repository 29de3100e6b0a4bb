/* batch_invariant: FH_PARAM_BATCH_INVARIANT. The same 100 rows computed inside batches of 100, 1000 and 4096 rows
 * (at different places in each, among other rows, some of them ignored) give bit-for-bit the same per-row log-probs,
 * entropies, lse and dx rows, through every log-prob call (forward then backward, the pair that keeps the logits, the
 * single-call train step), fp32 and bf16, in every kernel variant this suite runs in. The context holds wisdom
 * measured at two batch sizes with different tiles and a budget under which a default train step runs row blocks at
 * 100 rows and streams at 4096: the same calls on a default context differ (checked too), so the equality is the
 * mode's doing. */
#include "bf16.h"
#include "rng.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 100, H = 48, V = 3001, BATCHES = 3 };
static const int64_t batch_rows[BATCHES] = {100, 1000, 4096};
static const int64_t first_row[BATCHES] = {0, 450, 2900}; /* where the 100 rows sit in each batch */
/* 1.375 MiB: 100 fp32 rows of V-wide logits (1.2 MB) fit one row block, the 128 below which a default train step
 * streams (src/plan/plan.c, MIN_ROW_BLOCK) do not. */
#define BUDGET ((int64_t)1408 << 10)

typedef enum { SPLIT, KEPT, TRAIN_STEP, CALLS } call_kind;
static const char *const call_names[CALLS] = {"forward then backward", "the pair keeping the logits", "train step"};

/* One batch: x (fp32, and its bf16 bits), targets, upstream gradients; the 100 rows from row `at`. */
typedef struct batch {
    int64_t n, at;
    float *x, *g_logp, *g_entropy;
    uint16_t *x_bf16;
    int64_t *targets;
} batch;

/* The 100 rows' results of one call: logp, entropy, lse, dx rows (fp32). */
typedef struct rows_out {
    float logp[ROWS], entropy[ROWS], lse[ROWS];
    float dx[ROWS * H];
} rows_out;

/* The bf16 bits of count floats (the floats left as they are, for the fp32 runs). */
static uint16_t *bf16_bits(const float *f, size_t count)
{
    uint16_t *bits = tu_alloc(count, sizeof(uint16_t));
    for (size_t e = 0; e < count; e++)
        bits[e] = bf16_from_float(f[e]);
    return bits;
}

/* Row i of a batch: one of the 100 shared rows at its place, else a row of its own (seeded by batch and row). */
static void make_batch(int b, batch *out)
{
    const int64_t n = batch_rows[b];
    out->n = n;
    out->at = first_row[b];
    out->x = tu_alloc((size_t)(n * H), sizeof(float));
    out->g_logp = tu_alloc((size_t)n, sizeof(float));
    out->g_entropy = tu_alloc((size_t)n, sizeof(float));
    out->targets = tu_alloc((size_t)n, sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        const int64_t shared = i - first_row[b];
        const int is_shared = shared >= 0 && shared < ROWS;
        uint64_t rng = is_shared ? 1000 + (uint64_t)shared : 100000 * (uint64_t)(b + 1) + (uint64_t)i;
        tu_fill_uniform(out->x + i * H, H, &rng, -1.0, 1.0);
        out->targets[i] = ref_uniform(&rng) < 0.15 ? -100 : (int64_t)(ref_uniform(&rng) * V);
        out->g_logp[i] = (float)(2.0 * ref_uniform(&rng) - 1.0);
        out->g_entropy[i] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    }
    out->x_bf16 = bf16_bits(out->x, (size_t)(n * H));
}

static void free_batch(batch *b)
{
    free(b->x);
    free(b->x_bf16);
    free(b->g_logp);
    free(b->g_entropy);
    free(b->targets);
}

/* Wisdom measured at 100 and at 4096 rows, with different tiles, for the streaming calls of both dtypes. */
static void add_wisdom(fh_context *ctx)
{
    static const fh_call calls[] = {FH_CALL_FORWARD, FH_CALL_BACKWARD};
    for (int dtype = 0; dtype <= 1; dtype++)
        for (size_t c = 0; c < TU_COUNT(calls); c++)
            for (int small = 0; small <= 1; small++) {
                const fh_tile_config e = {2, small ? 100 : 4096, H, V, calls[c], small ? 40 : 128, small ? 384 : 1024,
                                          dtype ? FH_DTYPE_BF16 : FH_DTYPE_F32};
                TU_CHECK(fh_context_add_wisdom(ctx, &e) == FH_OK, "wisdom entry");
            }
}

static fh_status run(fh_context *ctx, call_kind kind, const batch *b, const void *weight, fh_dtype dtype,
                     rows_out *out)
{
    const int64_t n = b->n;
    fh_linear lin;
    fh_linear_init(&lin, n, H, V, dtype == FH_DTYPE_BF16 ? (const void *)b->x_bf16 : b->x, weight, FH_LAYOUT_VH,
                   NULL);
    lin.x_dtype = lin.weight_dtype = dtype;
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = 0.9;
    float *values = tu_alloc((size_t)(3 * n), sizeof(float)), *dx = tu_alloc((size_t)(n * H), sizeof(float));
    float *dw = tu_alloc((size_t)(H * V), sizeof(float));
    float *kept = kind == KEPT ? tu_alloc((size_t)(n * V), sizeof(float)) : NULL;
    fh_logprob_outputs lo = {values, values + n, values + 2 * n};
    fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw};
    fh_status st;
    if (kind == TRAIN_STEP) {
        st = fh_logprob_forward_backward(ctx, &lin, b->targets, &o, b->g_logp, b->g_entropy, NULL, &lo, &g);
    } else {
        st = kind == KEPT ? fh_logprob_forward_keep(ctx, &lin, b->targets, &o, &lo, kept)
                          : fh_logprob_forward(ctx, &lin, b->targets, &o, &lo);
        if (st == FH_OK)
            st = kind == KEPT ? fh_logprob_backward_kept(ctx, &lin, b->targets, &o, kept, lo.lse, lo.entropy,
                                                         b->g_logp, b->g_entropy, NULL, &g)
                              : fh_logprob_backward(ctx, &lin, b->targets, &o, lo.lse, lo.entropy, b->g_logp,
                                                    b->g_entropy, NULL, &g);
    }
    memcpy(out->logp, lo.logp + b->at, sizeof out->logp);
    memcpy(out->entropy, lo.entropy + b->at, sizeof out->entropy);
    memcpy(out->lse, lo.lse + b->at, sizeof out->lse);
    memcpy(out->dx, dx + b->at * H, sizeof out->dx);
    free(values);
    free(dx);
    free(dw);
    free(kept);
    return st;
}

/* Which of the four results differ between two runs ("" when none). */
static const char *difference(const rows_out *a, const rows_out *b)
{
    return memcmp(a->logp, b->logp, sizeof a->logp)           ? "logp"
           : memcmp(a->entropy, b->entropy, sizeof a->entropy) ? "entropy"
           : memcmp(a->lse, b->lse, sizeof a->lse)             ? "lse"
           : memcmp(a->dx, b->dx, sizeof a->dx)                ? "dx rows"
                                                               : "";
}

/* One call kind and dtype under a budget, in both modes: bit for bit in batch-invariant mode; with
 * default_differs, the default context's rows differ somewhere (so that the test shows the mode's effect). */
static void check_invariance(call_kind kind, int bf16, int64_t budget, int default_differs, batch *batches,
                             const float *w, const uint16_t *w_bf16, rows_out *out)
{
    const char *const dtype = bf16 ? "bf16" : "fp32";
    int differs_somewhere = 0;
    for (int invariant = 1; invariant >= 0; invariant--) {
        fh_context *ctx = tu_context(2, 0, 0, budget);
        add_wisdom(ctx);
        TU_CHECK(fh_context_set(ctx, FH_PARAM_BATCH_INVARIANT, invariant) == FH_OK, "batch_invariant");
        for (int b = 0; b < BATCHES; b++) {
            const fh_status st = run(ctx, kind, &batches[b], bf16 ? (const void *)w_bf16 : w,
                                     bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32, &out[b]);
            TU_CHECK(st == FH_OK, "%s, %s, %lld rows: status %d", call_names[kind], dtype, (long long)batch_rows[b],
                     (int)st);
        }
        for (int b = 1; b < BATCHES; b++) {
            const char *differs = difference(&out[0], &out[b]);
            if (invariant)
                TU_CHECK(differs[0] == 0, "%s, %s: the 100 rows' %s differ between batches of 100 and %lld",
                         call_names[kind], dtype, differs, (long long)batch_rows[b]);
            differs_somewhere |= !invariant && differs[0] != 0;
        }
        fh_context_destroy(ctx);
    }
    TU_CHECK(differs_somewhere || !default_differs,
             "%s, %s: the default context gave the same rows in every batch too: the wisdom and budget here no longer "
             "vary its tiles, and this test no longer shows the mode's effect", call_names[kind], dtype);
}

static void test_rows_bit_for_bit_in_any_batch(void)
{
    batch batches[BATCHES];
    for (int b = 0; b < BATCHES; b++)
        make_batch(b, &batches[b]);
    float *w = tu_alloc((size_t)(V * H), sizeof(float));
    uint64_t rng = 77;
    tu_fill_uniform(w, (size_t)(V * H), &rng, -0.5, 0.5);
    uint16_t *w_bf16 = bf16_bits(w, (size_t)(V * H));
    rows_out *out = tu_alloc(BATCHES, sizeof(rows_out));
    for (int bf16 = 0; bf16 <= 1; bf16++)
        for (int kind = 0; kind < CALLS; kind++) {
            /* A bf16 train step's row blocks keep every row's bf16 dU where it fits (100 rows here), else add their
             * dweight into an f32 accumulator (1000 and 4096 rows: 6 and 24 MB of dU; batch-invariant mode runs
             * such blocks however thin); either way a row's results are the same bits. The default context's rows
             * need not differ there. */
            const int accumulating = bf16 && kind == TRAIN_STEP;
            check_invariance((call_kind)kind, bf16, BUDGET, !accumulating, batches, w, w_bf16, out);
        }
    free(out);
    free(w);
    free(w_bf16);
    for (int b = 0; b < BATCHES; b++)
        free_batch(&batches[b]);
}

/* Under a budget too small for the row blocks that batch-invariant mode runs at every n, the train step fails
 * (FH_ERR_BUDGET_TOO_SMALL, naming the mode) rather than stream in another summation order; the default context
 * streams. 384 KiB for 100 bf16 rows: neither every row's dU (600 KB) nor the dweight accumulator that replaces it
 * (48 x 3001 floats, 576 KB) fits, narrow vocabulary tiles do. */
static void test_blocks_that_do_not_fit(void)
{
    batch small;
    make_batch(0, &small);
    float *w = tu_alloc((size_t)(V * H), sizeof(float));
    for (size_t e = 0; e < (size_t)(V * H); e++)
        w[e] = (float)(e % 13) * 0.01f;
    uint16_t *w_bf16 = bf16_bits(w, (size_t)(V * H));
    free(w);
    rows_out out;
    for (int invariant = 0; invariant <= 1; invariant++) {
        fh_context *ctx = tu_context(2, 0, 0, (int64_t)384 << 10);
        TU_CHECK(fh_context_set(ctx, FH_PARAM_BATCH_INVARIANT, invariant) == FH_OK, "batch_invariant");
        const fh_status st = run(ctx, TRAIN_STEP, &small, w_bf16, FH_DTYPE_BF16, &out);
        const char *message = "";
        fh_context_message(ctx, &message);
        if (invariant)
            TU_CHECK(st == FH_ERR_BUDGET_TOO_SMALL && tu_mentions(message, "batch-invariant"),
                     "invariant train step over budget: status %d, message '%s'", (int)st, message);
        else
            TU_CHECK(st == FH_OK, "default train step under the same budget: status %d", (int)st);
        fh_context_destroy(ctx);
    }
    free(w_bf16);
    free_batch(&small);
}

static const tu_test tests[] = {
    {"the same 100 rows in batches of 100, 1000 and 4096: bit for bit, every log-prob call, fp32 and bf16",
     test_rows_bit_for_bit_in_any_batch},
    {"row blocks that no budget-sized block holds: FH_ERR_BUDGET_TOO_SMALL, not another order",
     test_blocks_that_do_not_fit},
};
const tu_suite suite_batch_invariant = {tests, TU_COUNT(tests)};
