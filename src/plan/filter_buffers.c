/* Gradient filtering's buffers (filter_buffers.h). */
#include "filter_buffers.h"

void fh_filter_buffer_sizes(const fh_filter_shape *s, fh_buffer_size sizes[FH_FILTER_BUFFERS])
{
    const int on = s->on, tail = s->on && s->tail_estimate;
    const int64_t rows = s->tile_rows, cols = s->tile_vocab, threads = s->threads;
    const fh_buffer_size table[FH_FILTER_BUFFERS] = {
        [FH_FILTER_MARKS] = {on, 2 * threads, cols, sizeof(uint8_t)},
        [FH_FILTER_FLAGS] = {on, 2, cols, sizeof(uint8_t)},
        [FH_FILTER_KEPT] = {on, 1, cols, sizeof(int64_t)},
        [FH_FILTER_ROW_C] = {on, rows, 1, sizeof(double)},
        [FH_FILTER_VECTORS] = {on, TERM_VECTORS + 1, s->hidden, sizeof(double)}, /* >= TERM_VECTORS H + 1 */
        [FH_FILTER_FACTORS] = {on, 2, cols, sizeof(double)},
        [FH_FILTER_GATHERED_DU] = {on && s->bf16_du, rows, FH_FILTER_CHUNK, sizeof(uint16_t)},
        [FH_FILTER_GATHERED_W] = {on, FH_FILTER_CHUNK, s->hidden, sizeof(float)},
        [FH_FILTER_GATHERED_DW] = {on, FH_FILTER_CHUNK, s->hidden, sizeof(float)},
        [FH_FILTER_TAIL_ROWS] = {tail, rows, 1, sizeof(double)},
        [FH_FILTER_ROW_LEAST] = {tail, rows, 1, sizeof(float)},
        [FH_FILTER_TAIL_NU] = {tail, 2 * threads, cols, sizeof(float)},
        [FH_FILTER_TAIL_COLUMNS] = {tail, s->row_blocks && s->bf16_du ? 2 : 1, cols, sizeof(double)},
    };
    for (int b = 0; b < FH_FILTER_BUFFERS; b++)
        sizes[b] = table[b];
}

int64_t fh_filter_row_bytes(const fh_filter_shape *s)
{
    if (!s->on)
        return 0;
    return (int64_t)sizeof(double) + (s->tail_estimate ? (int64_t)(sizeof(double) + sizeof(float)) : 0) +
           (s->bf16_du ? FH_FILTER_CHUNK * (int64_t)sizeof(uint16_t) + s->hidden * (int64_t)sizeof(float) : 0);
}

fh_filter_workspace fh_filter_carve(const fh_filter_shape *s, char *const at[FH_FILTER_BUFFERS])
{
    fh_filter_workspace w;
    w.thread_marks = (uint8_t *)at[FH_FILTER_MARKS];
    w.kept_flag = (uint8_t *)at[FH_FILTER_FLAGS];
    w.dw_holds = w.kept_flag ? w.kept_flag + s->tile_vocab : NULL;
    w.kept_columns = (int64_t *)at[FH_FILTER_KEPT];
    w.row_c = (double *)at[FH_FILTER_ROW_C];
    w.vectors = (double *)at[FH_FILTER_VECTORS];
    w.factors = (double *)at[FH_FILTER_FACTORS];
    w.gathered_du = at[FH_FILTER_GATHERED_DU];
    w.gathered_w = at[FH_FILTER_GATHERED_W];
    w.gathered_dw = (float *)at[FH_FILTER_GATHERED_DW];
    w.tail_rows = (double *)at[FH_FILTER_TAIL_ROWS];
    w.row_least = (float *)at[FH_FILTER_ROW_LEAST];
    w.tail_nu = (float *)at[FH_FILTER_TAIL_NU];
    w.tail_columns = (double *)at[FH_FILTER_TAIL_COLUMNS];
    return w;
}
