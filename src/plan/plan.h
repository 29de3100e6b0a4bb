/* How a call is tiled, on how many threads, and where its buffers sit in the workspace; and the one
 * workspace-acquire every head uses. One plan serves every head. Plan functions only read the context:
 * a failure's message goes to `messages` (the calling context, or NULL for the pure size queries). */
#ifndef FH_PLAN_H
#define FH_PLAN_H

#include "core/context.h"
#include "filter_buffers.h"
#include "gemm/gemm.h"

/* Per-token double arrays ("slots") reserved for the head and the engine; each head names the ones it
 * uses (FH_CE_SLOT_*, FH_GRPO_SLOT_*). */
#define FH_WORKSPACE_SLOTS 10
/* bf16 row blocks keep their dU in chunks of this many vocabulary columns (fh_plan). */
#define FH_DU_CHUNK 8192

/* The workspace's buffers, each a row of the plan's one buffer table (plan.c), which sizes and places them for
 * fh_plan_* and carves them for fh_workspace_acquire; gradient filtering's rows follow (filter_buffers.h). */
enum {
    FH_BUFFER_SLOTS,          /* FH_WORKSPACE_SLOTS arrays of n doubles */
    FH_BUFFER_TILE,           /* tile_rows x tile_vocab floats (not when the tile sits in dweight) */
    FH_BUFFER_COMPANION_TILE, /* pair plans: the companion head's tile */
    FH_BUFFER_COLUMN,         /* tile_vocab doubles (bias-gradient column sums) */
    FH_BUFFER_DU,             /* bf16_du: dU in bf16 (what of it does not sit in dweight) */
    FH_BUFFER_DX_ACC,         /* accumulators: n x H */
    FH_BUFFER_DW_ACC,         /*   and H x tile_vocab floats */
    FH_BUFFER_X32,            /* fp32_du: the tile's x rows (tile_rows x H) */
    FH_BUFFER_W32,            /*   and weight columns (H x tile_vocab) in f32 */
    FH_BUFFER_DX_BLOCK,       /* bf16 row blocks summing a bf16 dx over several GEMMs: tile_rows x H floats */
    FH_BUFFER_SCRATCH,        /* the convert path's panels (scratch_floats) */
    FH_BUFFER_HEAD_ROWS,      /* n rows of head_row_bytes: a head's own per-row state beyond the slots */
    FH_BUFFER_FILTER,         /* the first of filtering's FH_FILTER_BUFFERS */
    FH_BUFFERS = FH_BUFFER_FILTER + FH_FILTER_BUFFERS
};

typedef struct fh_plan {
    int threads;          /* fh_threads of the call, fixed once here */
    int64_t tile_rows;    /* tokens per tile */
    int64_t tile_vocab;   /* vocabulary columns per tile */
    int64_t hidden;       /* H, for the buffers below */
    int gradients;        /* the pass writes gradients (backward, train step) */
    int row_blocks;       /* the train step's row blocks (tile_vocab = vocab) */
    /* bf16 inputs. bf16_du: dU rounded to bf16 into its own buffer (du), tile_rows x tile_vocab when
     * streaming, all n rows in row blocks (so that dweight is one GEMM over every row, rounded once; one block's
     * rows with dw_block_acc);
     * fp32_du (FH_PARAM_FP32_DU): dU stays f32 and the gradient GEMMs take f32 copies of the x rows (x32) and
     * weight columns (w32) of the tile. Streaming with bf16 inputs reserves the f32 accumulators of bf16
     * gradients (dx_acc n x H, dw_acc H x tile_vocab), whatever the call's gradient dtypes, so that the size
     * queries, which do not see them, hold for every call. */
    int bf16_du, fp32_du, accumulators;
    /* bf16 row blocks when every row's dU does not fit the budget: dweight GEMMs add into dw_acc (H x vocab f32,
     * for a bf16 dweight; an fp32 one takes them directly), rounded once after the last block. du holds du_rows rows
     * (du_chunk = vocab): the dU of a span of consecutive one-segment blocks, whose dweight is one GEMM over the span
     * (rows without groups: BF16_ROW_BLOCK-row blocks, spans as tall as the budget holds, up to BF16_SPAN_ROWS), or
     * of one block (rows in groups: blocks as tall as the budget holds; a paired block's segments one GEMM each). */
    int dw_block_acc;
    int64_t du_rows;
    /* bf16 row blocks keep every row's dU in chunks of du_chunk columns (the last may be narrower), each n x width
     * row-major: dx is a GEMM per chunk (through dx_block, in f32, for a bf16 dx) and dweight, after the last block,
     * a GEMM per chunk, written in vocabulary order. One chunk (du_chunk = vocab) unless the weight is dense [V, H]
     * and filtering is off. When dweight is a dense output (bf16 or fp32) overwritten (beta 0), its memory is free
     * until those GEMMs (plan.c): a bf16 plan's logits block may sit at its start (tile_in_dweight, tile_at_byte in) and,
     * with the [V, H] layout, the first du_chunks_in_dweight chunks packed at its end (from byte du_at_byte), where chunk c is read
     * before the GEMMs of chunks 0..c write over it; the other chunks stay in the workspace's du. */
    int64_t du_chunk, du_chunks_in_dweight;
    size_t du_at_byte;
    int tile_in_dweight;
    size_t tile_at_byte;
    /* fp32 row blocks that keep every row's f32 dU in chunks as bf16_du keeps its bf16 one (du then holds floats),
     * dweight after the last block. Their logits are computed straight into the chunks (a GEMM per chunk), so there
     * is no logits block: the tile holds one V-wide row per thread, into which the row loops load a row from the
     * chunks and from which its dU goes back. Only where the chunks that fit in dweight's memory leave the
     * workspace at least half a block smaller than blocks writing dweight themselves (at N <= H). */
    int f32_du_chunks;
    /* Gradient filtering (FH_PARAM_GRAD_FILTER_EPS): filter_eps > 0 in gradient passes; tail_estimate:
     * FH_FILTER_TAIL_ESTIMATE. Its buffers: filter_buffers.h. */
    double filter_eps;
    int tail_estimate;
    /* bf16_gemms: lin's GEMMs are bf16. On the convert path (fh_gemm_bf16_path) bf16 GEMMs widen their operands
     * into f32 panels (convert_panels): scratch_floats of them (fh_gemm_scratch_floats of the tile), 0 otherwise.
     * bf16_gemms: lin's or a companion's are bf16. */
    int bf16_gemms, convert_panels;
    int64_t scratch_floats;
    /* FH_GEMM_ROW_INVARIANT in batch-invariant mode (FH_PARAM_BATCH_INVARIANT), which then puts bf16 GEMMs on the
     * convert path whatever fh_gemm_bf16_path says; else FH_GEMM_FASTEST. */
    fh_gemm_order gemm_order;
    int companion;        /* a pair plan (fh_plan_pair_*): a second tile for the companion head's logits */
    size_t head_row_bytes; /* a pair plan's head keeps this many bytes of its own per row (head_rows), or 0 */
    unsigned char used[FH_BUFFERS]; /* the buffer table's rows that this plan uses */
    size_t offset[FH_BUFFERS];      /* and where they start */
    size_t bytes;         /* total, including slack to align any caller pointer */
} fh_plan;

/* Chooses tile sizes for a streaming call from the context's parameters, else its wisdom for (threads,
 * shape, call), else the defaults; shrunk to fit the memory budget. */
fh_status fh_plan_make(const fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan,
                       fh_context *messages);

/* The streaming forward's plan (plans[0]) and backward's (plans[1]). */
fh_status fh_plan_streaming(const fh_context *ctx, const fh_linear *lin, fh_plan plans[2], fh_context *messages);

/* The single-call train step's plan: row blocks of tile_vocab = vocab and as many rows as the budget holds
 * (*row_blocks = 1), else the streaming backward's tiles, in which the fallback runs both passes. In bf16 row
 * blocks, what fits of the logits block and the dU chunks moves into the memory of grads' dweight when it is a
 * dense output with beta 0 and filtering is off (see fh_plan), and in fp32 ones at N <= H (f32_du_chunks); the
 * workspace only shrinks. The size queries (grads NULL) keep everything in the workspace. */
fh_status fh_plan_train_step(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                             fh_plan *plan, int *row_blocks, fh_context *messages);

/* The train step's plan with row blocks of whole groups (a sequence, a preference pair): uniform, of group_rows rows
 * each and balanced across blocks; else of their own heights, group_rows the tallest, in blocks of up to tile_rows.
 * *row_blocks = 0 (stream) when not one group fits. */
fh_status fh_plan_train_step_groups(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                    int64_t group_rows, int uniform, fh_plan *plan, int *row_blocks);

/* Plans for a pass with a companion head (fh_pair_kernels): the companion's tile beside lin's, no gradient
 * filtering, and train-step row blocks of two rows of logits per row, as many as the budget holds, streaming below
 * 224 rows (plan.c's PAIR_ROW_BLOCK). As fh_plan_streaming and fh_plan_train_step otherwise. companion NULL: a head's own
 * pair kernels over lin's tile alone, no filtering, lin's tile and row blocks as fh_plan_train_step's.
 * head_row_bytes > 0 reserves that many bytes per row for the head's own state (fh_workspace.head_rows, all n
 * rows whatever the schedule: a streaming row's state lives from its first tile to its last). */
fh_status fh_plan_pair_streaming(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                 size_t head_row_bytes, fh_plan plans[2], fh_context *messages);
fh_status fh_plan_pair_train_step(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                  size_t head_row_bytes, const fh_linear_grads *grads, fh_plan *plan, int *row_blocks,
                                  fh_context *messages);
/* Workspace bytes of every call of a head with a companion (the larger of the two above; pure). */
fh_status fh_plan_pair_query_bytes(const fh_context *ctx, const fh_linear *lin, const fh_linear *companion,
                                   size_t head_row_bytes, size_t *bytes);

/* The train step's row-block plan with blocks of exactly `rows` rows: a height agreed with other ranks, no taller
 * than this rank's own fh_plan_train_step or fh_plan_train_step_groups plan, so that it fits the budget as that did. */
fh_status fh_plan_train_step_rows(const fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads,
                                  int64_t rows, fh_plan *plan, fh_context *messages);

/* Workspace bytes of a call for the size queries (lin checked; nothing is reported): the train step's
 * plan, for the gradients grads (checked) when given, else the larger of the streaming passes'. */
fh_status fh_plan_query_bytes(const fh_context *ctx, const fh_linear *lin, int train_step,
                              const fh_linear_grads *grads, size_t *bytes);

/* The larger of the two above, for a head whose calls stream and run the train step in row blocks of whole
 * groups (fh_plan_train_step_groups), whatever the groups' height. */
fh_status fh_plan_query_every_bytes(const fh_context *ctx, const fh_linear *lin, size_t *bytes);

/* Pointers into an acquired workspace (NULL for buffers the plan does not use). */
typedef struct fh_workspace {
    double *slot[FH_WORKSPACE_SLOTS];
    float *tile;
    float *companion_tile; /* pair plans: the companion head's tile, NULL otherwise */
    double *column;
    uint16_t *du;
    float *dx_acc, *dw_acc, *x32, *w32;
    float *dx_block;
    fh_filter_workspace filter;
    fh_filter_stats *filter_stats;           /* the context's, reset by fh_workspace_acquire */
    fh_gemm_cache **gemm_cache;  /* the context's, for the GEMM providers that keep state */
    fh_gemm_scratch scratch;     /* the convert path's panels (fh_plan.scratch_floats), {NULL, 0} otherwise */
    void *head_rows;             /* n x fh_plan.head_row_bytes (16-byte aligned), or NULL */
} fh_workspace;

/* One workspace for the passes of a call (plans[0..count)), as large as the largest: ws[k] is it carved
 * for plans[k]. The slots sit at the same offset in every plan, so they carry values from one pass to the
 * next. FH_ERR_KERNELS_UNAVAILABLE, before anything is computed, when FH_ROW_KERNELS or FH_FP32_GEMM, or for bf16
 * GEMMs FH_BF16_GEMM, forces what this CPU or build lacks. */
fh_status fh_workspace_acquire(fh_context *ctx, int64_t n, const fh_plan *plans, int count, fh_workspace *ws);

/* A streaming call's plan and workspace: one pass (call), or both (plans[0] and ws[0] forward, plans[1]
 * and ws[1] backward). Failures are reported on ctx. */
fh_status fh_prepare_pass(fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan, fh_workspace *ws);
fh_status fh_prepare_streaming(fh_context *ctx, const fh_linear *lin, fh_plan plans[2], fh_workspace ws[2]);

/* A failure of the engine's GEMMs (FH_OK passes through), reported on ctx. */
fh_status fh_gemm_failure(fh_context *ctx, fh_status status);

#endif
