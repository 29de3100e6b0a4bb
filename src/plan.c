/* Tile sizing under the memory budget and workspace layout. */
#include "plan.h"

#include "wisdom.h"

#define ALIGN 64
#define DEFAULT_TILE_ROWS 1024
/* Measured with fh_tune at N=1024 H=1024 V=32768 on 2 threads: forward 1024 x 8192 (wider tiles amortise
 * the GEMM's packing of the hidden block), backward 1024 x 2048 (narrower tiles keep the dweight tile's
 * accumulation in cache). */
#define DEFAULT_TILE_VOCAB_FORWARD 8192
#define DEFAULT_TILE_VOCAB_BACKWARD 2048
#define MIN_TILE_VOCAB 16

static size_t align_up(size_t x)
{
    return (x + ALIGN - 1) / ALIGN * ALIGN;
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Returns 0 and the layout, or -1 if a size overflows. */
static int layout(fh_plan *plan, int64_t n)
{
    size_t token_bytes, tile_elems, tile_bytes, column_bytes;
    if (__builtin_mul_overflow((size_t)n, (size_t)FH_TOKEN_ARRAYS * sizeof(double), &token_bytes) ||
        __builtin_mul_overflow((size_t)plan->tile_rows, (size_t)plan->tile_vocab, &tile_elems) ||
        __builtin_mul_overflow(tile_elems, sizeof(float), &tile_bytes) ||
        __builtin_mul_overflow((size_t)plan->tile_vocab, sizeof(double), &column_bytes) ||
        token_bytes > SIZE_MAX / 4 || tile_bytes > SIZE_MAX / 4)
        return -1;
    plan->tokens_offset = 0;
    plan->tile_offset = align_up(token_bytes);
    plan->column_offset = plan->tile_offset + align_up(tile_bytes);
    plan->bytes = plan->column_offset + align_up(column_bytes) + ALIGN; /* + slack for a caller's base */
    return 0;
}

/* Tile sizes before the budget: parameters, else wisdom, else defaults. */
static void preferred_tiles(const fh_context *ctx, const fh_linear *lin, fh_call call, int64_t *rows, int64_t *cols)
{
    const fh_tile_config *w = fh_wisdom_lookup(ctx, fh_threads(ctx, lin), lin->n, lin->hidden, lin->vocab, call);
    const int64_t rows_param = ctx->params[FH_PARAM_TILE_ROWS], cols_param = ctx->params[FH_PARAM_TILE_VOCAB];
    *rows = rows_param > 0 ? rows_param : w ? w->tile_rows : 0;
    *cols = cols_param > 0 ? cols_param : w ? w->tile_vocab : 0;
}

fh_status fh_plan_make(fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan)
{
    const int64_t n = lin->n, vocab = lin->vocab, budget = fh_budget_bytes(ctx);
    int64_t rows, cols;
    preferred_tiles(ctx, lin, call, &rows, &cols);
    plan->tile_rows = min64(n, rows > 0 ? rows : DEFAULT_TILE_ROWS);
    const int64_t default_cols = call == FH_CALL_FORWARD ? DEFAULT_TILE_VOCAB_FORWARD : DEFAULT_TILE_VOCAB_BACKWARD;
    plan->tile_vocab = min64(vocab, cols > 0 ? cols : default_cols);
    for (;;) {
        if (layout(plan, n) != 0)
            return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "workspace size for n = %lld overflows",
                           (long long)n);
        if ((int64_t)plan->bytes <= budget)
            return FH_OK;
        /* Shrink the vocabulary side first: rows keep the GEMMs' reuse of the weight tile. */
        if (plan->tile_vocab > MIN_TILE_VOCAB)
            plan->tile_vocab = plan->tile_vocab / 2 > MIN_TILE_VOCAB ? plan->tile_vocab / 2 : MIN_TILE_VOCAB;
        else if (plan->tile_rows > 1)
            plan->tile_rows /= 2;
        else
            return fh_fail(ctx, FH_ERR_BUDGET_TOO_SMALL,
                           "memory budget of %lld bytes cannot hold %zu bytes (n = %lld, smallest tile)",
                           (long long)budget, plan->bytes, (long long)n);
    }
}

fh_status fh_plan_streaming_bytes(fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    fh_plan forward, backward;
    fh_status st = fh_plan_make(ctx, lin, FH_CALL_FORWARD, &forward);
    if (st == FH_OK)
        st = fh_plan_make(ctx, lin, FH_CALL_BACKWARD, &backward);
    if (st == FH_OK)
        *bytes = forward.bytes > backward.bytes ? forward.bytes : backward.bytes;
    return st;
}

int fh_plan_make_row_blocks(const fh_context *ctx, const fh_linear *lin, fh_plan *plan)
{
    const int64_t n = lin->n, vocab = lin->vocab, budget = fh_budget_bytes(ctx);
    int64_t rows_param, unused;
    preferred_tiles(ctx, lin, FH_CALL_TRAIN_STEP, &rows_param, &unused);
    plan->tile_vocab = vocab;
    plan->tile_rows = 1;
    if (layout(plan, n) != 0 || (int64_t)plan->bytes > budget)
        return -1;
    /* Each further row costs vocab floats. */
    int64_t rows = 1 + (budget - (int64_t)plan->bytes) / (vocab * (int64_t)sizeof(float));
    /* Blocks thinner than FH_MIN_ROW_BLOCK lose to streaming (the H x V dweight is re-read per block);
     * an explicit FH_PARAM_TILE_ROWS (or measured wisdom) is honoured. */
    const int64_t min_rows = rows_param > 0 ? 1 : min64(n, FH_MIN_ROW_BLOCK);
    if (rows_param > 0)
        rows = min64(rows, rows_param);
    rows = min64(rows, n);
    if (rows < min_rows)
        return -1;
    const int64_t blocks = (n + rows - 1) / rows;
    plan->tile_rows = (n + blocks - 1) / blocks;
    return layout(plan, n);
}

void fh_plan_lower_rows(fh_plan *plan, int64_t n, int64_t rows)
{
    plan->tile_rows = rows;
    (void)layout(plan, n); /* cannot overflow: the taller tile did not */
}

fh_workspace fh_workspace_carve(const fh_plan *plan, void *base, int64_t n)
{
    char *aligned = (char *)(((uintptr_t)base + ALIGN - 1) / ALIGN * ALIGN);
    fh_workspace ws;
    double *tokens = (double *)(aligned + plan->tokens_offset);
    for (int a = 0; a < FH_TOKEN_ARRAYS; a++)
        ws.token[a] = tokens + (size_t)a * (size_t)n;
    ws.tile = (float *)(aligned + plan->tile_offset);
    ws.column = (double *)(aligned + plan->column_offset);
    return ws;
}
