/* The GEMM layer: C (+)= A B on strided views. The engine calls only fh_gemm_prepare and fh_gemm; which
 * library multiplies is decided in gemm.c, in one place, from the views' element types and the paths chosen for
 * this process (fh_gemm_fp32_path, fh_gemm_bf16_path), so that the engine and the heads never learn which one ran:
 * for fp32 BLIS sgemm or oneDNN's matmul; for bf16 either oneDNN's matmul (native) or BLIS sgemm on panels widened
 * to f32 (convert). */
#ifndef FH_GEMM_H
#define FH_GEMM_H

#include "fusedhead.h"

/* Element types of GEMM operands. bf16 operands are multiplied exactly and accumulated in f32. */
typedef enum fh_elem_type { FH_ELEM_F32, FH_ELEM_BF16 } fh_elem_type;

/* An operand read in place: element (r, c) at data + r * row_stride + c * col_stride (strides in
 * elements of type). */
typedef struct fh_gemm_input {
    const void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_input;

/* The result, written or accumulated into in place: f32, or bf16 for bf16 operands (accumulated in f32,
 * the old value added in f32, rounded once). */
typedef struct fh_gemm_output {
    void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_output;

/* What the providers keep between calls (oneDNN's primitives); owned by a context, created on first need. */
typedef struct fh_gemm_cache fh_gemm_cache;

/* How a product may be computed. FH_GEMM_ROW_INVARIANT: each element of C summed in an order that depends on k only,
 * not on m or n (a row's products the same whatever rows share them): BLIS sgemm (its small-matrix path off), bf16
 * on the convert path with a k panel of min(k, FH_GEMM_K_PANEL) whatever the scratch, m and n. oneDNN's matmul may
 * split a product's k terms across threads by its shape (seen with its bf16 gemm:jit on 2 threads: a row's dx
 * changed with the block's height), so it is not used then. */
typedef enum fh_gemm_order { FH_GEMM_FASTEST, FH_GEMM_ROW_INVARIANT } fh_gemm_order;

/* The convert path's f32 panels, in the caller's workspace (the plan counts them in the memory budget). A
 * plan with bf16 GEMMs on the convert path reserves fh_gemm_scratch_floats(its tile, its order): as much as the
 * logits tile, up to the panels' full size (24 MiB), so that each operand element is widened once; at least 3 panels
 * of 4 x 4 (so that a budget that holds a thin tile still holds them), and for FH_GEMM_ROW_INVARIANT one row of A's
 * and one column of B's full k panel and a staged C element (the panels' other sides shrink to fit, not k). */
typedef struct fh_gemm_scratch {
    float *data;
    int64_t floats;
} fh_gemm_scratch;

#define FH_GEMM_K_PANEL 2048
#define FH_GEMM_SCRATCH_MIN_FLOATS 48
#define FH_GEMM_INVARIANT_SCRATCH_MIN_FLOATS (2 * FH_GEMM_K_PANEL + 1)
int64_t fh_gemm_scratch_floats(int64_t tile_elements, fh_gemm_order order);

/* How this process multiplies fp32: chosen once, by FH_FP32_GEMM=blis|onednn when set, else BLIS sgemm, which
 * oneDNN's f32 matmul does not beat on any CPU measured (gemm.c: the measurements). */
typedef enum fh_fp32_path { FH_FP32_BLIS, FH_FP32_ONEDNN } fh_fp32_path;
fh_fp32_path fh_gemm_fp32_path(void);

/* NULL, or why fp32 products are refused: FH_FP32_GEMM names no path, or one this build or CPU lacks. */
const char *fh_gemm_fp32_refusal(void);

/* How this process multiplies bf16: chosen once, by FH_BF16_GEMM=native|convert when set, else native where
 * oneDNN's bf16 matmul beats BLIS sgemm (AMX; AVX512-BF16 on AMD) and convert elsewhere (gemm.c: the measurements). */
typedef enum fh_bf16_path { FH_BF16_NATIVE, FH_BF16_CONVERT } fh_bf16_path;
fh_bf16_path fh_gemm_bf16_path(void);

/* NULL, or why bf16 products are refused: FH_BF16_GEMM names no path, or one this CPU or build lacks. */
const char *fh_gemm_bf16_refusal(void);

/* Makes ready what fh_gemm needs for these shapes, strides, types, accumulate mode and threads (the data
 * pointers do not matter), creating *cache when a provider needs one; so that a pass can fail before it
 * writes any output. FH_ERR_OUT_OF_MEMORY, FH_ERR_GEMM_FAILED when the provider refuses them otherwise, or
 * FH_ERR_INVALID_DTYPE when no provider multiplies these types. */
fh_status fh_gemm_prepare(fh_gemm_cache **cache, const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m,
                          int64_t n, int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate,
                          const fh_gemm_output *c, int threads);

/* C = A B (accumulate 0: C is not read) or C += A B (accumulate 1), with A m x k, B k x n and C m x n,
 * on threads threads. After fh_gemm_prepare with the same arguments it fails only if the provider fails
 * inside (FH_ERR_OUT_OF_MEMORY, FH_ERR_GEMM_FAILED). */
fh_status fh_gemm(fh_gemm_cache *cache, const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m, int64_t n,
                  int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                  int threads);

void fh_gemm_cache_destroy(fh_gemm_cache *cache);

/* The fp32 path in use and what runs it, e.g. "onednn (oneDNN 2.6.3: brg:avx512_core)" or "blis (BLIS sgemm;
 * oneDNN 2.6.3: gemm:jit)"; "refused (...)" and the reason when FH_FP32_GEMM is refused. */
const char *fh_gemm_fp32_provider(void);

/* The bf16 path in use and what runs it, e.g. "native: oneDNN 2.6.3 brg:avx512_core_bf16" or "convert: bf16
 * widened to f32, BLIS sgemm (oneDNN 2.6.3 unavailable)"; "refused: " and the reason when FH_BF16_GEMM is refused. */
const char *fh_gemm_bf16_provider(void);

#endif
