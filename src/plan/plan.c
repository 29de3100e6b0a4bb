/* Tile sizing under the memory budget, buffer placement in the workspace, and acquiring it. */
#include "plan.h"

#include "core/linear.h"
#include "kernels/row_kernels.h"
#include "core/wisdom.h"

#define ALIGN 64
#define DEFAULT_TILE_ROWS 1024
/* Measured with fh_tune at N=1024 H=1024 V=32768 on 2 threads: forward 1024 x 8192 (wider tiles amortise
 * the GEMM's packing of the hidden block), backward 1024 x 2048 (narrower tiles keep the dweight tile's
 * accumulation in cache). */
#define DEFAULT_TILE_VOCAB_FORWARD 8192
#define DEFAULT_TILE_VOCAB_BACKWARD 2048
#define MIN_TILE_VOCAB 16
/* Batch-invariant mode (FH_PARAM_BATCH_INVARIANT) looks wisdom up as for a call of this many rows, whatever the call's
 * (and with the thread count of large calls): its tiles then depend on H, V, the call and the dtype only. */
#define INVARIANT_WISDOM_ROWS 1024

static int batch_invariant(const fh_context *ctx)
{
    return ctx->params[FH_PARAM_BATCH_INVARIANT] != 0;
}

static size_t align_up(size_t x)
{
    return (x + ALIGN - 1) / ALIGN * ALIGN;
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* *bytes of a buffer (0 when unused); 0, or -1 on overflow. */
static int buffer_bytes(const fh_buffer_size *b, size_t *bytes)
{
    size_t elems;
    *bytes = 0;
    if (!b->used)
        return 0;
    if (__builtin_mul_overflow((size_t)b->rows, (size_t)b->cols, &elems) ||
        __builtin_mul_overflow(elems, b->elem_size, bytes) || *bytes > SIZE_MAX / 16)
        return -1;
    return 0;
}

static int64_t du_columns_in_dweight(const fh_plan *plan)
{
    return min64(plan->tile_vocab, plan->du_chunks_in_dweight * plan->du_chunk);
}

/* Bytes of one dU element in the du buffer and dweight's memory. */
static size_t du_bytes(const fh_plan *plan)
{
    return plan->f32_du_chunks ? sizeof(float) : sizeof(uint16_t);
}

static fh_filter_shape filter_shape(const fh_plan *plan)
{
    const fh_filter_shape shape = {plan->filter_eps > 0.0, plan->tail_estimate, plan->bf16_du,  plan->row_blocks,
                                   plan->threads,          plan->tile_rows,     plan->tile_vocab, plan->hidden};
    return shape;
}

/* The buffer table: every buffer of the workspace, used or not, and its size. */
static void buffer_table(const fh_plan *plan, int64_t n, fh_buffer_size table[FH_BUFFERS])
{
    const int64_t rows = plan->tile_rows, cols = plan->tile_vocab, hidden = plan->hidden;
    /* bf16 row blocks sum a bf16 dx in f32 over several GEMMs (filtered ones, or one per dU chunk) before rounding. */
    const int dx_block =
        plan->row_blocks && plan->bf16_du && (plan->filter_eps > 0.0 || plan->du_chunk < plan->tile_vocab);
    const fh_buffer_size engine[FH_BUFFER_FILTER] = {
        [FH_BUFFER_SLOTS] = {1, n, FH_WORKSPACE_SLOTS, sizeof(double)},
        [FH_BUFFER_TILE] = {!plan->tile_in_dweight, plan->f32_du_chunks ? plan->threads : rows, cols, sizeof(float)},
        [FH_BUFFER_COMPANION_TILE] = {plan->companion, rows, cols, sizeof(float)},
        [FH_BUFFER_COLUMN] = {1, 1, cols, sizeof(double)},
        [FH_BUFFER_DU] = {plan->bf16_du || plan->f32_du_chunks,
                          plan->dw_block_acc ? max64(rows, plan->du_rows) : plan->row_blocks ? n : rows,
                          cols - du_columns_in_dweight(plan), du_bytes(plan)},
        [FH_BUFFER_DX_ACC] = {plan->accumulators, n, hidden, sizeof(float)},
        [FH_BUFFER_DW_ACC] = {plan->accumulators || plan->dw_block_acc, hidden, cols, sizeof(float)},
        [FH_BUFFER_X32] = {plan->fp32_du, rows, hidden, sizeof(float)},
        [FH_BUFFER_W32] = {plan->fp32_du, hidden, cols, sizeof(float)},
        [FH_BUFFER_DX_BLOCK] = {dx_block, rows, hidden, sizeof(float)},
        [FH_BUFFER_SCRATCH] = {plan->scratch_floats > 0, 1, plan->scratch_floats, sizeof(float)},
        [FH_BUFFER_HEAD_ROWS] = {plan->head_row_bytes > 0, n, (int64_t)plan->head_row_bytes, 1},
    };
    for (int b = 0; b < FH_BUFFER_FILTER; b++)
        table[b] = engine[b];
    const fh_filter_shape shape = filter_shape(plan);
    fh_filter_buffer_sizes(&shape, table + FH_BUFFER_FILTER);
}

/* Places the buffer table's rows in the workspace; returns 0, or -1 if a size overflows. */
static int place_buffers(fh_plan *plan, int64_t n)
{
    plan->scratch_floats =
        plan->convert_panels ? fh_gemm_scratch_floats(plan->tile_rows * plan->tile_vocab, plan->gemm_order) : 0;
    fh_buffer_size table[FH_BUFFERS];
    buffer_table(plan, n, table);
    size_t at = 0;
    for (int b = 0; b < FH_BUFFERS; b++) {
        size_t bytes;
        if (buffer_bytes(&table[b], &bytes))
            return -1;
        plan->used[b] = (unsigned char)table[b].used;
        plan->offset[b] = at;
        at += align_up(bytes);
    }
    plan->bytes = at + ALIGN; /* + slack for a caller's base */
    return 0;
}

static void nothing_in_dweight(fh_plan *plan)
{
    plan->du_chunks_in_dweight = 0;
    plan->du_at_byte = 0;
    plan->tile_in_dweight = 0;
    plan->tile_at_byte = 0;
}

/* The weight (and so dweight) stored [V, H] without gaps. */
static int dense_vh(const fh_linear *lin)
{
    return lin->w_stride_hidden == 1 && lin->w_stride_vocab == lin->hidden;
}

/* What the pass computes and which of the bf16 path's buffers it needs (see fh_plan); companion: a pair plan. */
/* What a plan knows of a companion head: none, its dtype (its GEMMs may need the convert path's panels), or none
 * for a head that runs its own pair kernels over lin's tile alone (no filtering, as with a companion). */
enum { NO_COMPANION, COMPANION_F32, COMPANION_BF16, OWN_KERNELS };

/* What a plan holds for its head besides lin's buffers: the companion (above), and the bytes per row of the head's
 * own per-row state (fh_plan.head_row_bytes). */
typedef struct plan_head {
    int companion;
    size_t row_bytes;
} plan_head;

static const plan_head NO_HEAD = {NO_COMPANION, 0};

static plan_head pair_head(const fh_linear *companion, size_t head_row_bytes)
{
    const int kind = !companion                              ? OWN_KERNELS
                     : companion->x_dtype == FH_DTYPE_BF16 ? COMPANION_BF16
                                                           : COMPANION_F32;
    const plan_head h = {kind, head_row_bytes};
    return h;
}

static void set_schedule(const fh_context *ctx, const fh_linear *lin, int gradients, int row_blocks, plan_head head,
                         fh_plan *plan)
{
    const int companion = head.companion;
    plan->head_row_bytes = head.row_bytes;
    plan->companion = companion == COMPANION_F32 || companion == COMPANION_BF16;
    plan->bf16_gemms = lin->x_dtype == FH_DTYPE_BF16 || companion == COMPANION_BF16;
    plan->gemm_order = batch_invariant(ctx) ? FH_GEMM_ROW_INVARIANT : FH_GEMM_FASTEST;
    plan->convert_panels =
        plan->bf16_gemms && (fh_gemm_bf16_path() == FH_BF16_CONVERT || plan->gemm_order == FH_GEMM_ROW_INVARIANT);
    const int bf16 = lin->x_dtype == FH_DTYPE_BF16 && gradients;
    plan->hidden = lin->hidden;
    plan->gradients = gradients;
    plan->row_blocks = row_blocks;
    plan->fp32_du = bf16 && ctx->params[FH_PARAM_FP32_DU] != 0;
    plan->bf16_du = bf16 && !plan->fp32_du;
    plan->accumulators = bf16 && !row_blocks;
    plan->dw_block_acc = 0;
    plan->du_rows = 0;
    plan->f32_du_chunks = 0;
    plan->filter_eps = gradients && companion == NO_COMPANION ? ctx->grad_filter_eps : 0.0;
    plan->tail_estimate = plan->filter_eps > 0.0 && ctx->grad_filter_tail == FH_FILTER_TAIL_ESTIMATE;
    /* Chunks only where dweight may hold them (see place_in_dweight): in the [H, V] layout oneDNN writes a chunk's
     * strided dweight through an f32 scratchpad of its size (32 MiB more peak memory at H=1024). */
    plan->du_chunk = row_blocks && plan->bf16_du && plan->filter_eps == 0.0 && dense_vh(lin)
                         ? min64(lin->vocab, FH_DU_CHUNK)
                         : lin->vocab;
    nothing_in_dweight(plan);
}

/* Tile sizes before the budget: parameters, else wisdom, else defaults. */
static void preferred_tiles(const fh_context *ctx, const fh_linear *lin, int threads, fh_call call, int64_t *rows,
                            int64_t *cols)
{
    int large_call_threads = threads;
    const int invariant = batch_invariant(ctx) && fh_context_threads(ctx, &large_call_threads) == FH_OK;
    const fh_tile_config *w = fh_wisdom_lookup(ctx, invariant ? large_call_threads : threads,
                                               invariant ? INVARIANT_WISDOM_ROWS : lin->n, lin->hidden, lin->vocab,
                                               call, lin->x_dtype);
    const int64_t rows_param = ctx->params[FH_PARAM_TILE_ROWS], cols_param = ctx->params[FH_PARAM_TILE_VOCAB];
    *rows = rows_param > 0 ? rows_param : w ? w->tile_rows : 0;
    *cols = cols_param > 0 ? cols_param : w ? w->tile_vocab : 0;
}

static fh_status plan_make(const fh_context *ctx, const fh_linear *lin, fh_call call, plan_head head, fh_plan *plan,
                           fh_context *messages)
{
    const int64_t n = lin->n, vocab = lin->vocab, budget = fh_budget_bytes(ctx);
    int64_t rows, cols;
    plan->threads = fh_threads(ctx, lin);
    set_schedule(ctx, lin, call != FH_CALL_FORWARD, 0, head, plan);
    preferred_tiles(ctx, lin, plan->threads, call, &rows, &cols);
    plan->tile_rows = min64(n, rows > 0 ? rows : DEFAULT_TILE_ROWS);
    const int64_t default_cols = call == FH_CALL_FORWARD ? DEFAULT_TILE_VOCAB_FORWARD : DEFAULT_TILE_VOCAB_BACKWARD;
    plan->tile_vocab = min64(vocab, cols > 0 ? cols : default_cols);
    for (;;) {
        if (place_buffers(plan, n) != 0)
            return fh_fail(messages, FH_ERR_SIZE_OVERFLOW, "workspace size for n = %lld overflows", (long long)n);
        if ((int64_t)plan->bytes <= budget)
            return FH_OK;
        /* Shrink the vocabulary side first: rows keep the GEMMs' reuse of the weight tile. Batch-invariant mode
         * keeps the vocabulary tile (a row's sums run over its tiles) and shrinks the rows only. */
        if (plan->tile_vocab > MIN_TILE_VOCAB && !batch_invariant(ctx))
            plan->tile_vocab = plan->tile_vocab / 2 > MIN_TILE_VOCAB ? plan->tile_vocab / 2 : MIN_TILE_VOCAB;
        else if (plan->tile_rows > 1)
            plan->tile_rows /= 2;
        else if (batch_invariant(ctx))
            return fh_fail(messages, FH_ERR_BUDGET_TOO_SMALL,
                           "memory budget of %lld bytes cannot hold %zu bytes (n = %lld, one row of the %lld-column "
                           "vocabulary tile that batch-invariant mode keeps at every n)",
                           (long long)budget, plan->bytes, (long long)n, (long long)plan->tile_vocab);
        else
            return fh_fail(messages, FH_ERR_BUDGET_TOO_SMALL,
                           "memory budget of %lld bytes cannot hold %zu bytes (n = %lld, smallest tile)",
                           (long long)budget, plan->bytes, (long long)n);
    }
}

fh_status fh_plan_make(const fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan,
                       fh_context *messages)
{
    return plan_make(ctx, lin, call, NO_HEAD, plan, messages);
}

static fh_status plan_streaming(const fh_context *ctx, const fh_linear *lin, plan_head head, fh_plan plans[2],
                                fh_context *messages)
{
    const fh_status st = plan_make(ctx, lin, FH_CALL_FORWARD, head, &plans[0], messages);
    return st == FH_OK ? plan_make(ctx, lin, FH_CALL_BACKWARD, head, &plans[1], messages) : st;
}

fh_status fh_plan_streaming(const fh_context *ctx, const fh_linear *lin, fh_plan plans[2], fh_context *messages)
{
    return plan_streaming(ctx, lin, NO_HEAD, plans, messages);
}

/* ---- row blocks that keep every row's dU, in dweight's memory (fh_plan) ----
 * A dense dweight (bf16, or fp32) with beta 0 is written only by the chunk GEMMs after the last block, in vocabulary
 * order. Until then its memory can hold a bf16 plan's logits block (dead by then; fp32 plans compute their logits
 * into the chunks), and in the [V, H] layout dU chunks packed at its end: chunk c's GEMM writes dweight rows up to the
 * chunk's last column, which must stay below chunk c's own place. In bytes, with w bytes per dweight element and d
 * per dU element (bf16 or f32), chunk c packed from `start` sits at start + n c T d, so it fits when that is at least
 * (c T + width_c) H w: true for the leading chunks when H w >= n d, never for the last one; the chunks that do not fit
 * stay in the workspace. */

/* How many leading dU chunks fit packed at the end of a [V, H] dweight of w bytes per element, above its first
 * `reserved` bytes; their first byte in *start. */
static int64_t chunks_fitting(const fh_plan *plan, int64_t n, int64_t vocab, int64_t hidden, int64_t w,
                              int64_t reserved, int64_t *start)
{
    const int64_t t = plan->du_chunk, chunks = (vocab + t - 1) / t, bytes = vocab * hidden * w;
    const int64_t d = (int64_t)du_bytes(plan);
    for (int64_t m = chunks; m > 0; m--) {
        const int64_t at = bytes - n * min64(vocab, m * t) * d;
        int fits = at >= reserved;
        for (int64_t c = 0; c < m && fits; c++)
            fits = at + n * c * t * d >= (c * t + min64(t, vocab - c * t)) * hidden * w;
        if (fits) {
            *start = at;
            return m;
        }
    }
    return 0;
}

/* Moves the logits block and the dU chunks that fit into dweight's memory: the placement, with the block there or
 * not, that leaves the least in the workspace. Returns 1 when something moved. */
static int place_in_dweight(fh_plan *plan, const fh_linear *lin, const fh_linear_grads *grads)
{
    const int64_t n = lin->n, vocab = lin->vocab, hidden = lin->hidden;
    if (!grads || !grads->dweight || grads->dweight_beta != 0.0f || !plan->row_blocks ||
        !(plan->bf16_du || plan->f32_du_chunks) || plan->dw_block_acc || plan->filter_eps > 0.0)
        return 0;
    const int vh = dense_vh(lin);
    if (!vh && !(lin->w_stride_vocab == 1 && lin->w_stride_hidden == vocab))
        return 0;
    const int64_t w = grads->dweight_dtype == FH_DTYPE_BF16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float);
    if (hidden > INT64_MAX / w / vocab) /* no such dweight in memory */
        return 0;
    const size_t dweight_bytes = (size_t)(vocab * hidden * w);
    /* The block nowhere, at dweight's first aligned byte, or at its first byte (when the aligned one leaves a chunk
     * without room: a caller's dweight need not be aligned); the placement that saves the most, the earlier on ties. */
    const size_t aligned = (ALIGN - (uintptr_t)grads->dweight % ALIGN) % ALIGN, tile_at[3] = {0, aligned, 0};
    const size_t tile_bytes = (size_t)(plan->tile_rows * vocab) * sizeof(float);
    int64_t start[3] = {0, 0, 0}, chunks[3] = {0, 0, 0};
    size_t saved[3] = {0, 0, 0};
    int best = 0;
    for (int p = 0; p < 3; p++) {
        /* f32_du_chunks has no logits block: its logits go straight into the chunks. */
        if ((p == 2 && aligned == 0) || (p > 0 && (plan->f32_du_chunks || tile_at[p] + tile_bytes > dweight_bytes)))
            continue;
        const int64_t reserved = p > 0 ? (int64_t)(tile_at[p] + tile_bytes) : 0;
        chunks[p] = vh ? chunks_fitting(plan, n, vocab, hidden, w, reserved, &start[p]) : 0;
        saved[p] = (p > 0 ? tile_bytes : 0) + (size_t)(n * min64(vocab, chunks[p] * plan->du_chunk)) * du_bytes(plan);
        best = saved[p] > saved[best] ? p : best;
    }
    plan->tile_in_dweight = best > 0;
    plan->tile_at_byte = tile_at[best];
    plan->du_chunks_in_dweight = chunks[best];
    plan->du_at_byte = (size_t)start[best];
    (void)place_buffers(plan, n); /* smaller than a size that did not overflow */
    return plan->tile_in_dweight || plan->du_chunks_in_dweight > 0;
}

/* Below this many rows a block streams instead: each block re-reads (fp32: and re-writes) the H x V weight gradient
 * and repacks the weight, so thin blocks lose to streaming's 8 NHV. Measured against streaming, best of 2 in one
 * process (fp32 CE train step, 2 threads, AMD Zen 4, 2026-11-29), as times of one block of every row: 128-row blocks
 * 1.38 / streaming 1.35 at N=1024 H=1024 V=32768, 1.25 / 1.34 at N=512 H=1536 V=151643, 1.11 / 1.40 at N=256
 * H=2304 V=262144; 64-row blocks 1.84 and 1.62; bf16 at N=1024 H=1024 V=32768 128-row blocks 1.06 / streaming 1.45.
 * (It was 256 rows, set on 2026-11-22 against an engine whose thin blocks ran at 0.57 of sgemm.) */
#define MIN_ROW_BLOCK 128
/* fp32 row blocks that write dweight themselves stop at this many rows (or at a taller group), a pair's excepted
 * (PAIR_ROW_BLOCK): taller ones save only the per-block re-read and re-write of dweight and repacking of the weight,
 * while their logits grow past the weight gradient's size. At N=8192 H=1024 V=32768 (fp32 CE, 2 threads, AMD Zen 4,
 * 2026-11-29; one process, heights alternating, best of 2) eight 1024-row blocks took 8520 - 8662 ms against 8228 -
 * 8393 for the three 2731-row ones that 512 MiB holds (3%), with 128 MiB of logits instead of 341: the step's peak
 * (294 MiB) is then below torch's own chunked F.linear_cross_entropy's (335) and it stays the fastest (bench/peers.py). */
#define FP32_ROW_BLOCK 1024
/* bf16 row blocks keep every row's bf16 dU (the dweight GEMM runs once, over all rows), so a block's height
 * only sets how often the weight is re-read by the logits and dx GEMMs: 512 and 1024 rows ran no faster than
 * 256 but hold more f32 logits, 128 rows ran 8 - 10% slower (fh_bench --dtype bf16 at N=1024 H=1024 V=32768
 * and N=512 H=1536 V=151643, 2 threads). */
#define BF16_ROW_BLOCK 256
/* A pair's block holds two V-wide rows of fp32 logits per row. Its height was capped at 224 rows to keep the workspace
 * a small part of the materialized logits (2 N V floats), but each block re-reads and re-writes the H x V dweight in
 * a GEMM of only its rows: at N = 1024, H = 1024, V = 32768 (jsd, fp32, 2 threads, AMD Zen 4, 2026-11-29) blocks of
 * 224, 256, 512 and 1024 rows took 2036, 1945, 1748 and 1641 ms, and the 224-row step lost to Liger's materialized
 * JSD (0.95x). So a pair takes as many rows as the budget holds, as cross-entropy does (256 MiB of logits here, still
 * under half of Liger's peak), and streams only below PAIR_ROW_BLOCK rows. */
#define PAIR_ROW_BLOCK 224
/* Where every row's bf16 dU does not fit (dw_block_acc), rows without groups still run BF16_ROW_BLOCK-row blocks, and
 * the du buffer keeps the dU of several for one dweight GEMM into the f32 accumulator per span: taller blocks ran
 * their logits and dx GEMMs slower (N=8192 H=1024 V=32768, 2 threads, AMD Zen 4, 2026-11-29: five 1639-row blocks
 * 1391 and 1449 ms against 1321 and 1340 for 256-row ones), and each span reads and writes the H x V accumulator.
 * Spans stop at BF16_SPAN_ROWS rows: there, the CE step took 4432 ms with spans of 2048 rows, 4417 / 4429 / 4441 with
 * 1024 / 4096 / 5376 (as many as the budget held), and 4572 in the five tall blocks; in a second run spans of 512 and
 * 256 rows ran 5% and 8% slower than 1024. 2048 keeps the accumulator's passes few where memory is slower. */
#define BF16_SPAN_ROWS 2048

/* Sets the plan to blocks of at most `rows` rows, balanced, but never below group_rows (when rows holds it): groups of
 * their own heights (packed sequences) do not split evenly, and the tallest must fit a block. -1 if a size
 * overflows. */
static int balanced_blocks(fh_plan *plan, int64_t n, int64_t rows, int64_t group_rows)
{
    const int64_t blocks = (n + rows - 1) / rows, balanced = (n + blocks - 1) / blocks;
    plan->tile_rows = balanced < group_rows && group_rows <= rows ? group_rows : balanced;
    return place_buffers(plan, n);
}

/* fp32 row blocks keep every row's f32 dU in chunks (f32_du_chunks), their logits computed straight into them, instead
 * of writing dweight themselves, when the chunks that fit in dweight's memory (place_in_dweight) shrink the workspace
 * by at least half their logits block: at N <= H, where all but the last chunk or so fit. At N=1024 H=1024 V=32768
 * (fp32 CE, 2 threads, AMD Zen 4, 2026-11-29) the workspace fell from 128.3 to 32.6 MiB (one chunk stays) for 1 - 2%
 * of the step (1062 - 1064 ms against 1049 - 1051, fh_bench --layout vh; the row loops load and store each row); at
 * N=512 H=1536 V=151643 as fast as the logits block in dweight's memory that it replaced. Not at a lower height: two
 * 512-row blocks at N=1024 pack the weight twice for the logits and dx GEMMs (5% slower, measured on the same day
 * when these blocks kept their logits in a block). The plan stays as it was otherwise. Returns 1 when kept. */
static int keep_f32_du(const fh_context *ctx, fh_plan *plan, const fh_linear *lin, const fh_linear_grads *grads)
{
    if (plan->bf16_gemms || plan->companion || plan->filter_eps > 0.0 || batch_invariant(ctx) || !dense_vh(lin))
        return 0;
    const fh_plan own = *plan;
    const size_t block = (size_t)(own.tile_rows * own.tile_vocab) * sizeof(float);
    plan->f32_du_chunks = 1;
    plan->du_chunk = min64(lin->vocab, FH_DU_CHUNK);
    if (place_buffers(plan, lin->n) == 0 && place_in_dweight(plan, lin, grads) && plan->bytes + block / 2 <= own.bytes)
        return 1;
    *plan = own;
    return 0;
}

/* Row-block plan for the single-call train step: tile_vocab = vocab and as many rows as the budget
 * holds, balanced across blocks. Returns 0 when at least min(n, MIN_ROW_BLOCK) rows fit (a companion's plan:
 * PAIR_ROW_BLOCK), else -1 (the caller streams instead). fp32 dU with bf16 inputs always streams
 * (its f32 copy of the weight would be H x V). bf16 blocks stop at BF16_ROW_BLOCK rows and fp32 ones writing
 * dweight at FP32_ROW_BLOCK, or at group_rows when a group (a sequence, a pair) is taller, so that it still runs in
 * row blocks. When grads' dweight can hold the logits block or dU chunks (place_in_dweight, keep_f32_du), the
 * blocks take their full height if what stays in the workspace fits the budget; else the budget sets the height, as
 * without. */
static int make_row_blocks(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                           int64_t group_rows, plan_head head, fh_plan *plan)
{
    const int64_t n = lin->n, vocab = lin->vocab, budget = fh_budget_bytes(ctx);
    int64_t rows_param, unused;
    plan->threads = fh_threads(ctx, lin);
    set_schedule(ctx, lin, 1, 1, head, plan);
    if (plan->fp32_du)
        return -1;
    preferred_tiles(ctx, lin, plan->threads, FH_CALL_TRAIN_STEP, &rows_param, &unused);
    plan->tile_vocab = vocab;
    /* An explicit FH_PARAM_TILE_ROWS (or measured wisdom) is honoured. */
    const int64_t cap = min64(n, rows_param > 0 ? rows_param
                                 : plan->bf16_du ? (group_rows > BF16_ROW_BLOCK ? group_rows : BF16_ROW_BLOCK)
                                                 : n);
    if (balanced_blocks(plan, n, cap, group_rows) == 0 &&
        (place_in_dweight(plan, lin, grads) || keep_f32_du(ctx, plan, lin, grads)) && (int64_t)plan->bytes <= budget)
        return 0;
    nothing_in_dweight(plan);
    plan->f32_du_chunks = 0;
    plan->du_chunk = plan->bf16_du ? plan->du_chunk : vocab;
    plan->tile_rows = 1;
    int64_t rows_cap = cap;
    if (!plan->bf16_du && !plan->companion && rows_param <= 0) /* fp32 blocks writing dweight themselves */
        rows_cap = min64(rows_cap, max64(FP32_ROW_BLOCK, group_rows));
    if (place_buffers(plan, n) != 0 || (int64_t)plan->bytes > budget) {
        /* Every row's bf16 dU does not fit: blocks that add their dweight into an f32 accumulator instead (no
         * filtering): rows in groups as tall as the budget holds, other rows (a pair's too) in cap-row blocks whose
         * dU spans several (below); else stream. */
        if (!plan->bf16_du || plan->filter_eps > 0.0)
            return -1;
        plan->dw_block_acc = 1;
        plan->du_chunk = vocab;
        if (group_rows > 1)
            rows_cap = min64(n, rows_param > 0 ? rows_param : n);
        if (place_buffers(plan, n) != 0 || (int64_t)plan->bytes > budget)
            return -1;
    }
    /* Each further row costs vocab floats of logits (and with dw_block_acc its bf16 dU) and filtering's share; the
     * buffers' alignment is absorbed by the final check below. */
    const fh_filter_shape shape = filter_shape(plan);
    const int64_t filter_row_bytes = fh_filter_row_bytes(&shape);
    const int64_t row_bytes = (plan->companion ? 2 : 1) * vocab * (int64_t)sizeof(float) +
                              (plan->dw_block_acc ? vocab * (int64_t)sizeof(uint16_t) : 0) + filter_row_bytes;
    const int64_t rows = min64(rows_cap, 1 + (budget - (int64_t)plan->bytes) / row_bytes);
    /* Blocks thinner than MIN_ROW_BLOCK (a pair's PAIR_ROW_BLOCK) lose to streaming (the H x V dweight is re-read
     * per block), unless the caller asked for them, or for batch invariance (row blocks at every n). */
    const int64_t min_rows = rows_param > 0 || batch_invariant(ctx)
                                 ? 1
                                 : min64(n, plan->companion ? PAIR_ROW_BLOCK : MIN_ROW_BLOCK);
    if (rows < min_rows || balanced_blocks(plan, n, rows, group_rows) != 0)
        return -1;
    while ((int64_t)plan->bytes > budget && plan->tile_rows > min_rows) {
        plan->tile_rows--;
        (void)place_buffers(plan, n); /* smaller than a size that did not overflow */
    }
    if ((int64_t)plan->bytes > budget)
        return -1;
    if (plan->dw_block_acc && group_rows == 1) {
        /* Spans of whole blocks, as many as the rest of the budget holds. */
        const int64_t more = (budget - (int64_t)plan->bytes) / (vocab * (int64_t)sizeof(uint16_t));
        const int64_t span = min64(min64(n, BF16_SPAN_ROWS), plan->tile_rows + more);
        plan->du_rows = max64(1, span / plan->tile_rows) * plan->tile_rows;
        /* The buffers' alignment may take a block's worth back; du_rows = tile_rows fit above. */
        while ((place_buffers(plan, n) != 0 || (int64_t)plan->bytes > budget) && plan->du_rows > plan->tile_rows)
            plan->du_rows -= plan->tile_rows;
    }
    if (!place_in_dweight(plan, lin, grads))
        (void)keep_f32_du(ctx, plan, lin, grads);
    return 0;
}

static fh_status invariant_blocks_too_big(const fh_context *ctx, const fh_linear *lin, fh_context *messages)
{
    return fh_fail(messages, FH_ERR_BUDGET_TOO_SMALL,
                   "memory budget of %lld bytes cannot hold the train step's row blocks (n = %lld, V = %lld), which "
                   "batch-invariant mode runs at every n (streaming would sum each row in another order)",
                   (long long)fh_budget_bytes(ctx), (long long)lin->n, (long long)lin->vocab);
}

static fh_status plan_train_step(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                 int64_t group_rows, plan_head head, fh_plan *plan, int *row_blocks,
                                 fh_context *messages)
{
    *row_blocks = make_row_blocks(ctx, lin, grads, group_rows, head, plan) == 0;
    if (*row_blocks)
        return FH_OK;
    /* fp32 dU streams at every n; anything else streams only when no row block fits, which depends on n. */
    if (batch_invariant(ctx) && !plan->fp32_du)
        return invariant_blocks_too_big(ctx, lin, messages);
    return plan_make(ctx, lin, FH_CALL_BACKWARD, head, plan, messages);
}

fh_status fh_plan_train_step(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                             fh_plan *plan, int *row_blocks, fh_context *messages)
{
    return plan_train_step(ctx, lin, grads, 1, NO_HEAD, plan, row_blocks, messages);
}

fh_status fh_plan_pair_streaming(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                 size_t head_row_bytes, fh_plan plans[2], fh_context *messages)
{
    return plan_streaming(ctx, lin, pair_head(companion, head_row_bytes), plans, messages);
}

fh_status fh_plan_pair_train_step(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                  size_t head_row_bytes, const fh_linear_grads *grads, fh_plan *plan, int *row_blocks,
                                  fh_context *messages)
{
    return plan_train_step(ctx, lin, grads, 1, pair_head(companion, head_row_bytes), plan, row_blocks, messages);
}

/* Lowers a row-block plan being made to blocks of `rows` rows (<= its own); its workspace only shrinks. */
static void lower_rows(fh_plan *plan, int64_t n, int64_t rows)
{
    plan->tile_rows = rows;
    (void)place_buffers(plan, n); /* cannot overflow: the taller tile did not */
}

fh_status fh_plan_train_step_rows(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                  int64_t rows, fh_plan *plan, fh_context *messages)
{
    plan->threads = fh_threads(ctx, lin);
    set_schedule(ctx, lin, 1, 1, NO_HEAD, plan);
    plan->tile_vocab = lin->vocab;
    plan->tile_rows = rows;
    if (place_buffers(plan, lin->n) != 0)
        return fh_fail(messages, FH_ERR_SIZE_OVERFLOW, "workspace size for n = %lld overflows", (long long)lin->n);
    if (!place_in_dweight(plan, lin, grads))
        (void)keep_f32_du(ctx, plan, lin, grads);
    return FH_OK;
}

fh_status fh_plan_train_step_groups(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                    int64_t group_rows, int uniform, fh_plan *plan, int *row_blocks)
{
    const fh_status st = plan_train_step(ctx, lin, grads, group_rows, NO_HEAD, plan, row_blocks, ctx);
    if (st != FH_OK || !*row_blocks)
        return st;
    const int64_t groups = lin->n / group_rows, fit = plan->tile_rows / group_rows;
    if (fit < 1) { /* not one group per block: the streaming plan, as when no block fits (its buffers, none in dweight) */
        *row_blocks = 0;
        if (batch_invariant(ctx))
            return invariant_blocks_too_big(ctx, lin, ctx);
        return plan_make(ctx, lin, FH_CALL_BACKWARD, NO_HEAD, plan, ctx);
    }
    if (uniform) {
        const int64_t blocks = (groups + fit - 1) / fit;
        lower_rows(plan, lin->n, (groups + blocks - 1) / blocks * group_rows);
    }
    return FH_OK;
}

/* Bytes of the streaming passes (group_rows 0), else of the train step with groups of group_rows rows, for the
 * gradients grads (what their dweight holds not counted) or, NULL, any. */
static fh_status query_bytes(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                             int64_t group_rows, plan_head head, size_t *bytes)
{
    fh_status st = fh_check_linear(NULL, lin);
    if (st == FH_OK && grads)
        st = fh_check_grads(NULL, lin, grads);
    if (st != FH_OK)
        return st;
    fh_plan plans[2];
    int row_blocks;
    if (group_rows > 0) {
        st = plan_train_step(ctx, lin, grads, group_rows, head, &plans[0], &row_blocks, NULL);
        plans[1] = plans[0];
    } else {
        st = plan_streaming(ctx, lin, head, plans, NULL);
    }
    if (st == FH_OK)
        *bytes = plans[0].bytes > plans[1].bytes ? plans[0].bytes : plans[1].bytes;
    return st;
}

fh_status fh_plan_query_bytes(const fh_context *ctx, const fh_linear *lin, int train_step,
                              const fh_linear_grads *grads, size_t *bytes)
{
    return query_bytes(ctx, lin, grads, train_step ? 1 : 0, NO_HEAD, bytes);
}

fh_status fh_plan_pair_query_bytes(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                   size_t head_row_bytes, size_t *bytes)
{
    size_t streaming, train_step;
    const plan_head head = pair_head(companion, head_row_bytes);
    fh_status st = query_bytes(ctx, lin, NULL, 0, head, &streaming);
    if (st == FH_OK)
        st = query_bytes(ctx, lin, NULL, 1, head, &train_step);
    if (st == FH_OK)
        *bytes = streaming > train_step ? streaming : train_step;
    return st;
}

fh_status fh_plan_query_every_bytes(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    /* Groups of any height up to n: the bf16 blocks then stop only at the budget, the most any group asks. */
    size_t streaming, grouped;
    fh_status st = query_bytes(ctx, lin, NULL, 0, NO_HEAD, &streaming);
    if (st == FH_OK)
        st = query_bytes(ctx, lin, NULL, lin->n, NO_HEAD, &grouped);
    if (st == FH_OK)
        *bytes = streaming > grouped ? streaming : grouped;
    return st;
}

static fh_workspace carve(const fh_plan *plan, void *base, int64_t n)
{
    char *aligned = (char *)(((uintptr_t)base + ALIGN - 1) / ALIGN * ALIGN);
    char *at[FH_BUFFERS];
    for (int b = 0; b < FH_BUFFERS; b++)
        at[b] = plan->used[b] ? aligned + plan->offset[b] : NULL;
    fh_workspace ws;
    for (int a = 0; a < FH_WORKSPACE_SLOTS; a++)
        ws.slot[a] = (double *)at[FH_BUFFER_SLOTS] + (size_t)a * (size_t)n;
    ws.tile = (float *)at[FH_BUFFER_TILE]; /* NULL when it sits in dweight: the engine's then */
    ws.companion_tile = (float *)at[FH_BUFFER_COMPANION_TILE];
    ws.column = (double *)at[FH_BUFFER_COLUMN];
    ws.du = (uint16_t *)at[FH_BUFFER_DU];
    ws.dx_acc = (float *)at[FH_BUFFER_DX_ACC];
    ws.dw_acc = (float *)at[FH_BUFFER_DW_ACC];
    ws.x32 = (float *)at[FH_BUFFER_X32];
    ws.w32 = (float *)at[FH_BUFFER_W32];
    ws.dx_block = (float *)at[FH_BUFFER_DX_BLOCK];
    const fh_filter_shape shape = filter_shape(plan);
    ws.filter = fh_filter_carve(&shape, at + FH_BUFFER_FILTER);
    ws.gemm_cache = NULL;
    ws.scratch.data = (float *)at[FH_BUFFER_SCRATCH];
    ws.scratch.floats = plan->scratch_floats;
    ws.head_rows = at[FH_BUFFER_HEAD_ROWS];
    ws.filter_stats = NULL;
    return ws;
}

fh_status fh_workspace_acquire(fh_context *ctx, int64_t n, const fh_plan *plans, int count, fh_workspace *ws)
{
    size_t bytes = 0;
    const char *refused = fh_row_kernels_refusal() ? fh_row_kernels_refusal() : fh_gemm_fp32_refusal();
    for (int k = 0; k < count; k++) {
        bytes = plans[k].bytes > bytes ? plans[k].bytes : bytes;
        if (!refused && plans[k].bf16_gemms)
            refused = fh_gemm_bf16_refusal();
    }
    if (refused)
        return fh_fail(ctx, FH_ERR_KERNELS_UNAVAILABLE, "%s", refused);
    void *base = NULL;
    const fh_status st = fh_acquire_workspace(ctx, bytes, &base);
    if (st != FH_OK)
        return st;
    for (int k = 0; k < count; k++) {
        ws[k] = carve(&plans[k], base, n);
        ws[k].gemm_cache = &ctx->gemm_cache;
        ws[k].filter_stats = &ctx->filter_stats;
    }
    ctx->filter_stats = (fh_filter_stats){0.0, 0.0};
    /* The context, a layer below the GEMM one, frees the providers' cache through this. */
    ctx->gemm_cache_destroy = fh_gemm_cache_destroy;
    return FH_OK;
}

fh_status fh_prepare_pass(fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan, fh_workspace *ws)
{
    const fh_status st = fh_plan_make(ctx, lin, call, plan, ctx);
    return st == FH_OK ? fh_workspace_acquire(ctx, lin->n, plan, 1, ws) : st;
}

fh_status fh_prepare_streaming(fh_context *ctx, const fh_linear *lin, fh_plan plans[2], fh_workspace ws[2])
{
    const fh_status st = fh_plan_streaming(ctx, lin, plans, ctx);
    return st == FH_OK ? fh_workspace_acquire(ctx, lin->n, plans, 2, ws) : st;
}

fh_status fh_gemm_failure(fh_context *ctx, fh_status status)
{
    if (status == FH_OK)
        return FH_OK;
    return fh_fail(ctx, status, "the GEMM providers (fp32: %s; bf16: %s) %s", fh_gemm_fp32_provider(),
                   fh_gemm_bf16_provider(),
                   status == FH_ERR_OUT_OF_MEMORY ? "could not allocate a primitive or its memory"
                   : status == FH_ERR_GEMM_FAILED ? "refused a product's shapes or strides, or failed while running it"
                                                  : "does not multiply these dtypes");
}
