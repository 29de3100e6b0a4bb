/* bf16 products where oneDNN's bf16 matmul is missing or slower than BLIS sgemm (gemm.c says where): the operands
 * are widened to f32 in panels and multiplied by BLIS sgemm, so the product is exact per term and accumulated in
 * f32, as a native bf16 GEMM's is.
 *
 * Loop order: C is cut into row panels of mc rows; within one, A's panel (mc x kc) is widened once per k panel and
 * B's (kc x nc) once per k and column panel, so with mc = m (every product the engine makes has m <= MC_MAX except
 * the dweight GEMMs of very wide models) each operand element is widened exactly once. A bf16 C is staged in an f32
 * panel (mc x nc), which needs the k panels innermost: A's panel is then re-widened per column panel unless k fits
 * one panel. Panels follow their operand's contiguous direction, so that widening streams through memory and sgemm
 * gets a plain row- or column-major panel. */
#include "convert_provider.h"

#include "blis_provider.h"

#include <string.h>

#define MC_MAX 2048
#define KC_MAX FH_GEMM_K_PANEL
#define NC_MAX 512
/* Below this many multiply-adds a panel's product, and below this many elements a widening, runs on one thread:
 * a second one costs more to wake than it saves (thin tiles under small budgets make many tiny panels). */
#define PARALLEL_MACS ((int64_t)1 << 21)
#define PARALLEL_ELEMENTS ((int64_t)1 << 14)

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static float widen(uint16_t bits)
{
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* Nearest bf16, ties to even; a NaN stays a (quiet) NaN. */
static uint16_t narrow(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* An f32 panel: element (r, c) at data + r rs + c cs. */
typedef struct panel {
    float *data;
    int64_t rs, cs;
} panel;

/* Row-major when the view's rows are its contiguous direction, else column-major. */
static panel panel_for(float *data, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols)
{
    const int by_rows = col_stride <= row_stride;
    const panel p = {data, by_rows ? cols : 1, by_rows ? 1 : rows};
    return p;
}

/* The rows x cols block of bf16 view v at (r0, c0), widened into a panel at data. */
static panel widen_block(const fh_gemm_input *v, int64_t r0, int64_t c0, int64_t rows, int64_t cols, float *data,
                         int threads)
{
    const panel p = panel_for(data, v->row_stride, v->col_stride, rows, cols);
    const int by_rows = p.cs == 1;
    const int64_t outer = by_rows ? rows : cols, inner = by_rows ? cols : rows;
    const int64_t outer_stride = by_rows ? v->row_stride : v->col_stride;
    const int64_t inner_stride = by_rows ? v->col_stride : v->row_stride;
    const uint16_t *base = (const uint16_t *)v->data + r0 * v->row_stride + c0 * v->col_stride;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t o = 0; o < outer; o++) {
        const uint16_t *src = base + o * outer_stride;
        float *dst = data + o * inner;
        if (inner_stride == 1)
            for (int64_t i = 0; i < inner; i++)
                dst[i] = widen(src[i]);
        else
            for (int64_t i = 0; i < inner; i++)
                dst[i] = widen(src[i * inner_stride]);
    }
    return p;
}

/* The staged f32 panel s (rows x cols) into the bf16 block of c at (r0, c0): s, plus the old value when
 * accumulating, rounded once. */
static void round_block(const panel *s, const fh_gemm_output *c, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                        int accumulate, int threads)
{
    const int by_rows = s->cs == 1;
    const int64_t outer = by_rows ? rows : cols, inner = by_rows ? cols : rows;
    const int64_t outer_stride = by_rows ? c->row_stride : c->col_stride;
    const int64_t inner_stride = by_rows ? c->col_stride : c->row_stride;
    uint16_t *base = (uint16_t *)c->data + r0 * c->row_stride + c0 * c->col_stride;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t o = 0; o < outer; o++) {
        uint16_t *dst = base + o * outer_stride;
        const float *src = s->data + o * inner;
        for (int64_t i = 0; i < inner; i++) {
            const float old = accumulate ? widen(dst[i * inner_stride]) : 0.0f;
            dst[i * inner_stride] = narrow(src[i] + old);
        }
    }
}

static void sgemm_panels(int64_t m, int64_t n, int64_t k, const panel *a, const panel *b, float beta, float *c,
                         int64_t rsc, int64_t csc, int threads)
{
    fh_blis_sgemm(m, n, k, a->data, a->rs, a->cs, b->data, b->rs, b->cs, beta, c, rsc, csc,
                  m * n * k < PARALLEL_MACS ? 1 : threads);
}

/* Panel extents that fit floats: the largest extent halved until A's, B's and (staged) C's panels fit; for
 * FH_GEMM_ROW_INVARIANT the larger of mc and nc, never kc (at 1 x 1 they fit its scratch). */
static void choose_panels(fh_gemm_order order, int64_t m, int64_t n, int64_t k, int staged, int64_t floats,
                          int64_t *mc, int64_t *nc, int64_t *kc)
{
    const int fixed_k = order == FH_GEMM_ROW_INVARIANT;
    *mc = min64(m, MC_MAX);
    *nc = min64(n, NC_MAX);
    *kc = min64(k, KC_MAX);
    while (*mc * *kc + *kc * *nc + (staged ? *mc * *nc : 0) > floats) {
        int64_t *largest = *mc >= *nc && (fixed_k || *mc >= *kc) ? mc : fixed_k || *nc >= *kc ? nc : kc;
        *largest = (*largest + 1) / 2;
    }
}

fh_status fh_convert_gemm(const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                          int threads)
{
    if (!scratch || !scratch->data || scratch->floats < fh_gemm_scratch_floats(0, order))
        return FH_ERR_GEMM_FAILED;
    const int staged = c->type == FH_ELEM_BF16;
    int64_t mc, nc, kc;
    choose_panels(order, m, n, k, staged, scratch->floats, &mc, &nc, &kc);
    float *const a_data = scratch->data, *const b_data = a_data + mc * kc, *const c_data = b_data + kc * nc;
    for (int64_t i0 = 0; i0 < m; i0 += mc) {
        const int64_t mb = min64(mc, m - i0);
        if (!staged) {
            float *const out = (float *)c->data + i0 * c->row_stride;
            for (int64_t p0 = 0; p0 < k; p0 += kc) {
                const int64_t kb = min64(kc, k - p0);
                const panel ap = widen_block(a, i0, p0, mb, kb, a_data, threads);
                const float beta = p0 > 0 || accumulate ? 1.0f : 0.0f;
                for (int64_t j0 = 0; j0 < n; j0 += nc) {
                    const int64_t nb = min64(nc, n - j0);
                    const panel bp = widen_block(b, p0, j0, kb, nb, b_data, threads);
                    sgemm_panels(mb, nb, kb, &ap, &bp, beta, out + j0 * c->col_stride, c->row_stride, c->col_stride,
                                 threads);
                }
            }
            continue;
        }
        panel ap = {a_data, 0, 0};
        for (int64_t j0 = 0; j0 < n; j0 += nc) {
            const int64_t nb = min64(nc, n - j0);
            const panel cp = panel_for(c_data, c->row_stride, c->col_stride, mb, nb);
            for (int64_t p0 = 0; p0 < k; p0 += kc) {
                const int64_t kb = min64(kc, k - p0);
                if (j0 == 0 || kc < k) /* one k panel: A's stays widened across the column panels */
                    ap = widen_block(a, i0, p0, mb, kb, a_data, threads);
                const panel bp = widen_block(b, p0, j0, kb, nb, b_data, threads);
                sgemm_panels(mb, nb, kb, &ap, &bp, p0 > 0 ? 1.0f : 0.0f, cp.data, cp.rs, cp.cs, threads);
            }
            round_block(&cp, c, i0, j0, mb, nb, accumulate, threads);
        }
    }
    return FH_OK;
}
