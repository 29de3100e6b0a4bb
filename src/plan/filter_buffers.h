/* Gradient filtering's buffers: its rows of the plan's buffer table and its view of a carved workspace. The one file
 * of filtering in the plan's layer (plan/; the rest is engine/filter/): plan.c sizes, places and carves these with its
 * own, and knows nothing else of filtering. */
#ifndef FH_FILTER_BUFFERS_H
#define FH_FILTER_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

/* Filtering runs its GEMMs on the kept columns gathered this many at a time. */
#define FH_FILTER_CHUNK 1024

/* Its H-vectors (fh_filter_workspace.vectors), each the sum of one rank-one term's factor: over the skipped weight
 * columns (s), over a tile's rows (g) and over every row block's (g_all, after bf16 row blocks), for the c w term and
 * for the tail estimate; then the tail estimate's magnitude over every row block (one double). */
enum { TERM_S_C, TERM_G_C, TERM_G_ALL_C, TERM_S_TAIL, TERM_G_TAIL, TERM_G_ALL_TAIL, TERM_VECTORS };

/* One buffer of a workspace: used or not, rows x cols elements of elem_size bytes. */
typedef struct fh_buffer_size {
    int used;
    int64_t rows, cols;
    size_t elem_size;
} fh_buffer_size;

/* What sizes filtering's buffers: the plan's tiles and schedule. */
typedef struct fh_filter_shape {
    int on, tail_estimate, bf16_du, row_blocks, threads;
    int64_t tile_rows, tile_vocab, hidden;
} fh_filter_shape;

enum {
    FH_FILTER_MARKS,        /* the columns each thread marked, per segment: 2 x threads x tile_vocab bytes */
    FH_FILTER_FLAGS,        /* per-column kept_flag and dw_holds */
    FH_FILTER_KEPT,         /* the kept columns' list */
    FH_FILTER_ROW_C,        /* every tile row's c coefficient */
    FH_FILTER_VECTORS,      /* TERM_VECTORS H-vectors and a sum */
    FH_FILTER_FACTORS,      /* the terms' factors per column (2 x tile_vocab) */
    FH_FILTER_GATHERED_DU,  /* bf16 dU: tile_rows x FH_FILTER_CHUNK */
    FH_FILTER_GATHERED_W,   /* FH_FILTER_CHUNK weight rows */
    FH_FILTER_GATHERED_DW,  /* FH_FILTER_CHUNK f32 dweight columns */
    FH_FILTER_TAIL_ROWS,    /* tail estimate: every tile row's skipped sum */
    FH_FILTER_ROW_LEAST,    /*   and threshold */
    FH_FILTER_TAIL_NU,      /*   each thread's f32 profile per segment (2 x threads x tile_vocab) */
    FH_FILTER_TAIL_COLUMNS, /*   the skipped columns' sums of it (twice after bf16 row blocks: the block's, every
                                 block's) */
    FH_FILTER_BUFFERS
};

/* Pointers into a carved workspace (all NULL when filtering is off, the tail's when it drops the tail). */
typedef struct fh_filter_workspace {
    uint8_t *thread_marks; /* the columns each thread marked as large, per segment */
    uint8_t *kept_flag;    /* per column of the tile: some row marked it, its GEMMs run */
    uint8_t *dw_holds;     /* per column: dweight (or its accumulator) holds something of this call already */
    int64_t *kept_columns; /* the kept columns' list, in order */
    double *row_c, *vectors, *factors;
    void *gathered_du, *gathered_w;
    float *gathered_dw;
    double *tail_rows, *tail_columns;
    float *row_least, *tail_nu;
} fh_filter_workspace;

/* Filtering's rows of the buffer table, in the order of the enum above. */
void fh_filter_buffer_sizes(const fh_filter_shape *shape, fh_buffer_size sizes[FH_FILTER_BUFFERS]);

/* Bytes that one more row of a row block costs filtering (its c, with the tail estimate its skipped sum and
 * threshold, and with bf16 dU its gathered dU and f32 dx row). */
int64_t fh_filter_row_bytes(const fh_filter_shape *shape);

/* Filtering's view of a workspace whose buffers start at at[b] (NULL where unused). */
fh_filter_workspace fh_filter_carve(const fh_filter_shape *shape, char *const at[FH_FILTER_BUFFERS]);

#endif
