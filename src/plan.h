/* How a call is tiled and how its workspace is laid out. One plan serves every head. */
#ifndef FH_PLAN_H
#define FH_PLAN_H

#include "context.h"

/* Per-token double arrays reserved for the head and the engine (running max and sum, target logit,
 * weighted logit sum, argmax, backward coefficients...). */
#define FH_TOKEN_ARRAYS 10

typedef struct fh_plan {
    int64_t tile_rows;    /* tokens per tile */
    int64_t tile_vocab;   /* vocabulary columns per tile */
    size_t tokens_offset; /* FH_TOKEN_ARRAYS arrays of n doubles */
    size_t tile_offset;   /* tile_rows * tile_vocab floats */
    size_t column_offset; /* tile_vocab doubles (bias-gradient column sums) */
    size_t bytes;         /* total, including slack to align any caller pointer */
} fh_plan;

/* Chooses tile sizes for a streaming call from the context's parameters, else its wisdom for (threads,
 * shape, call), else the defaults; shrunk to fit the memory budget. */
fh_status fh_plan_make(fh_context *ctx, const fh_linear *lin, fh_call call, fh_plan *plan);

/* Workspace bytes a streaming forward + backward pair needs: the larger of their plans. */
fh_status fh_plan_streaming_bytes(fh_context *ctx, const fh_linear *lin, size_t *bytes);

/* Row-block plan for the single-call train step: tile_vocab = vocab and as many rows as the budget
 * holds, balanced across blocks. Returns 0 when at least min(n, FH_MIN_ROW_BLOCK) rows fit, else -1
 * (the caller streams instead). */
#define FH_MIN_ROW_BLOCK 256
int fh_plan_make_row_blocks(const fh_context *ctx, const fh_linear *lin, fh_plan *plan);

/* Lowers a row-block plan to rows (<= plan->tile_rows) per block, e.g. a height agreed with other ranks;
 * its workspace only shrinks. */
void fh_plan_lower_rows(fh_plan *plan, int64_t n, int64_t rows);

/* Pointers into an acquired workspace. */
typedef struct fh_workspace {
    double *token[FH_TOKEN_ARRAYS];
    float *tile;
    double *column;
} fh_workspace;

fh_workspace fh_workspace_carve(const fh_plan *plan, void *base, int64_t n);

#endif
