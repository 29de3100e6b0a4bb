/*
 * fusedhead: language-model head losses computed straight from hidden states and the lm_head weight,
 * without materializing the [N, V] logits.
 *
 * Conventions
 *   - Every function returns fh_status (FH_OK == 0), except fh_status_string. Nothing aborts or exits.
 *     On error no output buffer is modified; fh_context_message() tells what was wrong.
 *   - Sizes and strides are int64_t. Matrices are (pointer, strides) views as in BLIS, so the lm_head
 *     in [H, V] (flax) and [V, H] (torch nn.Linear.weight) layouts are the same data, zero copies.
 *   - Hidden states and weight in fp32 (BLIS GEMMs) or bf16 (oneDNN, or BLIS on f32-widened panels; f32
 *     accumulation either way); logits
 *     leave the GEMM in f32; per-token statistics and reductions in double. Gradients are fp32, or with bf16
 *     inputs each of dx, dweight, dbias fp32 or bf16 (accumulated in f32 within a call, rounded once).
 *   - Gradients take an explicit beta: 0 overwrites (even NaN garbage), 1 accumulates.
 *   - A context holds configuration and the workspace. Calls on one context must not run concurrently;
 *     separate contexts may be used from separate threads.
 */
#ifndef FUSEDHEAD_H
#define FUSEDHEAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(FH_BUILDING_LIBRARY)
#define FH_API __attribute__((visibility("default")))
#else
#define FH_API
#endif

/* ---------------------------------------------------------------------------------------------
 * Status codes, of every module (the parallel one's included). Values are stable; they are grouped by tens, one
 * decade per kind of failure (renumbered once in 0.1.0, README "Conventions").
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_status {
    FH_OK = 0,
    /* 1..9: shapes, pointers and strides */
    FH_ERR_NULL_POINTER = 1,          /* a required pointer is NULL */
    FH_ERR_INVALID_SIZE = 2,          /* N, H or V is zero or negative; a batch's sequences do not make its n rows
                                         (B x T, or cu_seqlens) */
    FH_ERR_INVALID_STRIDE = 3,        /* a stride is < 1, or makes elements of a matrix overlap */
    FH_ERR_SIZE_OVERFLOW = 4,         /* a size or offset product does not fit in 64 bits */
    FH_ERR_TARGET_OUT_OF_RANGE = 5,   /* a target is outside [0, V) and is not ignore_index */
    FH_ERR_MISSING_OUTPUT = 6,        /* an output the call needs is NULL (e.g. per-token loss for 'none') */
    FH_ERR_NONFINITE_INPUT = 7,       /* NaN or Inf in x, weight or bias (only with FH_PARAM_CHECK_FINITE) */
    FH_ERR_INVALID_LAYOUT = 8,        /* fh_linear_init: layout is neither FH_LAYOUT_HV nor FH_LAYOUT_VH */
    FH_ERR_INVALID_DTYPE = 9,         /* an unknown fh_dtype, x and weight of different dtypes, bf16 in a build
                                         without oneDNN, or bf16 where a call does not take it yet */
    /* 10..19: option values */
    FH_ERR_INVALID_REDUCTION = 10,
    FH_ERR_INVALID_LABEL_SMOOTHING = 11, /* outside [0, 1] or not finite */
    FH_ERR_INVALID_SOFTCAP = 12,         /* neither 0 (off) nor a positive normal fp32 value */
    FH_ERR_INVALID_Z_LOSS = 13,          /* negative or not finite (0 disables) */
    FH_ERR_INVALID_CLASS_WEIGHT = 14,    /* a class weight is negative or not finite */
    FH_ERR_INVALID_BETA = 15,            /* a gradient beta other than 0 or 1 */
    FH_ERR_INVALID_GRAD_OUTPUT = 16,     /* the upstream gradient is not finite */
    FH_ERR_INVALID_MASK = 17,            /* a completion-mask value is negative or not finite */
    FH_ERR_INVALID_TEMPERATURE = 18,     /* temperature <= 0, or 1/temperature outside fp32 range */
    FH_ERR_INVALID_GRPO_OPTION = 19,     /* loss_type, importance_sampling_level, epsilon, delta, beta, SAPO or
                                            VESPO parameters, entropy_coef, top_entropy_quantile, the off-policy
                                            threshold or the vLLM importance-sampling mode and bounds out of range */
    /* 20..29: workspace and memory */
    FH_ERR_WORKSPACE_TOO_SMALL = 20,  /* the caller's workspace is smaller than fh_workspace_size() */
    FH_ERR_OUT_OF_MEMORY = 21,
    FH_ERR_BUDGET_TOO_SMALL = 22,     /* the memory budget cannot hold the smallest tile */
    FH_ERR_WISDOM_IO = 23,            /* the wisdom file cannot be read or written */
    FH_ERR_INVALID_WISDOM = 24,       /* a wisdom file line or entry is malformed, or the table is full */
    FH_ERR_OVERLAPPING_BUFFERS = 25,  /* a gradient's memory overlaps x, the weight, the bias, another gradient or
                                         the caller's workspace, or the workspace overlaps an input (the message
                                         names both) */
    /* 30..39: context, parameters and environment */
    FH_ERR_INVALID_PARAM = 30,        /* unknown fh_param, or one of the other kind (integer / real) */
    FH_ERR_INVALID_PARAM_VALUE = 31,  /* value outside fh_param_bounds() / fh_param_real_bounds(), or NaN */
    FH_ERR_KERNELS_UNAVAILABLE = 32,  /* FH_ROW_KERNELS, FH_FP32_GEMM or FH_BF16_GEMM names a kernel set or GEMM
                                         path that is unknown, or that this CPU or build lacks (the message says
                                         which) */
    /* 40..49: the GEMM providers */
    FH_ERR_GEMM_FAILED = 40,          /* a GEMM provider (oneDNN) refused a product's shapes or strides,
                                         or failed while running it, for a reason other than memory */
    /* 50..59: option values of the preference and distillation heads, and logit_scale */
    FH_ERR_INVALID_PREFERENCE_OPTION = 50, /* loss, loss_type (or the list and its weights), dpo_semantics, beta,
                                              label_smoothing, simpo_gamma, rpo_alpha, cpo_alpha or discopop_tau out
                                              of range, a loss_type the loss does not have, use_weighting; KTO's
                                              loss_type, beta, weights, labels, KL inputs or reference missing */
    FH_ERR_INVALID_DISTILL_OPTION = 51, /* divergence unknown, beta outside [0, 1], a loss weight negative or
                                           not finite, top_k or add_tail out of range; top-k teacher: add_tail, its k
                                           or a NaN or +inf log-prob */
    FH_ERR_TEACHER_MISMATCH = 52,       /* the teacher's n or V differs from the student's */
    FH_ERR_INVALID_LOGIT_SCALE = 53,    /* logit_scale not a positive normal fp32 value, or softcap / logit_scale
                                           or logit_scale / temperature outside fp32's normal range */
    FH_ERR_INVALID_SUPPORT = 54,        /* a support (fh_support): offsets not from 0 and non-decreasing, an id outside
                                           [0, V) (padded: other than -1), an id twice in a row, or a counted row's
                                           target not in its row's support */
    /* 60..69: the parallel heads (fusedhead_parallel.h, and over MPI fusedhead_mpi.h); the names are MPI's, the
       statuses any collectives' */
    FH_ERR_MPI = 60,                  /* a collective (MPI's or the caller's) failed (the message has its description:
                                         MPI's error string, the Python exception) */
    FH_ERR_MPI_LAYOUT = 61,           /* groups, shards or token counts are inconsistent across ranks */
    FH_ERR_MPI_MISMATCH = 62          /* ranks made one call with different configurations (the message names what
                                         differs: an option, a gradient asked for on some ranks only, a reduction) */
} fh_status;

/* A static, human-readable description of a status; never NULL (unknown values get a generic text). */
FH_API const char *fh_status_string(fh_status status);

/* ---------------------------------------------------------------------------------------------
 * Context: configuration, workspace, last error message.
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_context fh_context;

/* The workspace cap when FH_PARAM_MEMORY_BUDGET is 0 (docs/performance.md, "Memory budget", says why). */
#define FH_DEFAULT_MEMORY_BUDGET ((int64_t)512 << 20)

typedef enum fh_param {
    FH_PARAM_THREADS = 0,       /* threads for GEMMs and elementwise work; 0 = OpenMP's default
                                   (OMP_NUM_THREADS, else all processors), 1 for tiny problems. Either is
                                   lowered to the CPUs this process may use (affinity mask, cgroup CPU
                                   quota) unless FH_PARAM_OVERSUBSCRIBE is 1 */
    FH_PARAM_TILE_ROWS = 1,     /* tokens per tile; 0 = default */
    FH_PARAM_TILE_VOCAB = 2,    /* vocabulary columns per tile; 0 = default */
    FH_PARAM_MEMORY_BUDGET = 3, /* max bytes a call allocates: the workspace, per-token state included, and the
                                   copies of the rows that count (at most half); tiles shrink to fit;
                                   0 = FH_DEFAULT_MEMORY_BUDGET */
    FH_PARAM_CHECK_FINITE = 4,  /* 1: scan x, weight and bias and return FH_ERR_NONFINITE_INPUT on NaN/Inf
                                   (costs one read of each); 0 (default): NaN/Inf propagate to the loss and
                                   to the gradient rows of the affected tokens */
    FH_PARAM_FP32_DU = 5,       /* bf16 inputs only. dU is the loss's gradient with respect to the logits
                                   X W + b, what the gradient GEMMs take (dU = dZ dz/du, below). 0 (default): dU is
                                   formed in f32 and rounded once to bf16 for the dX and dW GEMMs (bf16 x bf16,
                                   oneDNN), as torch's bf16 autograd does;
                                   1: dU stays f32 and the gradient GEMMs run in fp32 (BLIS) on f32 copies of
                                   the bf16 tiles of x and weight: the fp32 path's accuracy on the bf16 values,
                                   at the fp32 GEMM rate, and the train step streams (8 N H V flops) */
    FH_PARAM_OVERSUBSCRIBE = 6, /* 1: run FH_PARAM_THREADS threads even beyond the CPUs available (BLIS's barriers
                                   spin: on 2 cores 3 threads ran 4x slower, 16 threads 28x); 0 (default): clamp */
    FH_PARAM_GRAD_FILTER_TAIL = 7, /* an fh_filter_tail: what gradient filtering does with the terms it skips;
                                      0 = FH_FILTER_TAIL_ESTIMATE (default) */
    FH_PARAM_GRAD_FILTER_EPS = 8,  /* real-valued (fh_context_set_real): gradient filtering's threshold, in [0, 1);
                                      0 (default) = off */
    FH_PARAM_BATCH_INVARIANT = 9   /* 1: every per-row result (a token's loss, log-prob, entropy, lse, its dx row) is
                                      bit for bit the same whatever the other rows of the call and however many
                                      there are: tiles and schedules independent of N (docs/correctness.md, "Batch
                                      invariance"); a budget that cannot hold them at any N is
                                      FH_ERR_BUDGET_TOO_SMALL. 0 (default): chosen per N for speed */
} fh_param;

FH_API fh_status fh_context_create(fh_context **ctx);
/* Frees the context and the workspace it allocated (never a caller's workspace). NULL is accepted. */
FH_API fh_status fh_context_destroy(fh_context *ctx);
/* Integer parameters. set refuses a value outside fh_param_bounds (inclusive) with FH_ERR_INVALID_PARAM_VALUE and
 * leaves the parameter as it was; get gives the value set (0 = default). A real-valued parameter
 * (FH_PARAM_GRAD_FILTER_EPS) is FH_ERR_INVALID_PARAM here, as is an unknown one. */
FH_API fh_status fh_context_set(fh_context *ctx, fh_param param, int64_t value);
FH_API fh_status fh_context_get(const fh_context *ctx, fh_param param, int64_t *value);
FH_API fh_status fh_param_bounds(fh_param param, int64_t *min_value, int64_t *max_value);
/* Real-valued parameters, the same contract with doubles: bounds inclusive (a half-open range such as eps's [0, 1)
 * reports its largest double as max), NaN refused, an integer parameter FH_ERR_INVALID_PARAM. */
FH_API fh_status fh_context_set_real(fh_context *ctx, fh_param param, double value);
FH_API fh_status fh_context_get_real(const fh_context *ctx, fh_param param, double *value);
FH_API fh_status fh_param_real_bounds(fh_param param, double *min_value, double *max_value);
/* The threads a call runs (one above the tiny-problem size): FH_PARAM_THREADS or OpenMP's default, clamped to the
 * CPUs this process may use unless FH_PARAM_OVERSUBSCRIBE. */
FH_API fh_status fh_context_threads(const fh_context *ctx, int *threads);
/* Wisdom (FFTW-style): tile configurations measured by fh_tune for a shape, thread count and call. When
 * FH_PARAM_TILE_ROWS / FH_PARAM_TILE_VOCAB are left at 0, a call uses the entry with the same threads,
 * hidden, vocab and call and the nearest n (in log scale), else the built-in defaults; the memory budget
 * still caps every tile. fh_context_create loads the file named by the FH_WISDOM environment variable when
 * it is set (and fails with its status if that file is unreadable or malformed). */
typedef enum fh_call {
    FH_CALL_FORWARD = 0,    /* streaming forward (fh_ce_forward, fh_grpo_forward) */
    FH_CALL_BACKWARD = 1,   /* streaming backward */
    FH_CALL_TRAIN_STEP = 2  /* fh_ce_forward_backward's row blocks (tile_rows only) */
} fh_call;

typedef struct fh_tile_config {
    int64_t threads, n, hidden, vocab;
    fh_call call;
    int64_t tile_rows, tile_vocab;
    int dtype; /* fh_dtype of x and weight: 0 (fp32) unless set; bf16 calls use bf16 entries only */
} fh_tile_config;

/* Adds an entry (replacing one with the same threads, n, hidden, vocab, call and dtype). At most 256 entries. */
FH_API fh_status fh_context_add_wisdom(fh_context *ctx, const fh_tile_config *entry);
/* Adds the entries of a wisdom file; path NULL reads $FH_WISDOM. */
FH_API fh_status fh_context_load_wisdom(fh_context *ctx, const char *path);
/* Writes every entry of the context to a wisdom file (a text file, one entry per line); on failure
 * FH_ERR_WISDOM_IO with the path and the system's reason in the context's message. */
FH_API fh_status fh_context_save_wisdom(fh_context *ctx, const char *path);

/* Describes the last error returned by a call on this context ("" after success). Valid until the next
 * call on the context. The workspace-size queries are pure and leave it unchanged. With ctx NULL: why this
 * thread's last fh_context_create failed ("" if it did not), e.g. the FH_WISDOM file, line and fault. */
FH_API fh_status fh_context_message(const fh_context *ctx, const char **message);
/* Hands the context a caller-owned workspace; from then on the library never allocates a workspace for calls
 * on this context. Calls whose GEMMs run on oneDNN (the native bf16 path, the onednn fp32 path: fh_kernel_query)
 * still build their primitives, once per GEMM shape, in a cache the context owns (made by the first such call;
 * oneDNN allocates what a primitive holds). NULL/0 returns to
 * library-managed workspace (allocated once, reused across calls). */
FH_API fh_status fh_context_set_workspace(fh_context *ctx, void *workspace, size_t bytes);

/* Gradient filtering (as Cut Cross-Entropy's; FH_PARAM_GRAD_FILTER_EPS, FH_PARAM_GRAD_FILTER_TAIL): in every
 * backward pass (split backward and train step, every head), once a tile's dU = dZ * dz/du is formed, each
 * vocabulary column where every |dU| is below eps times its row's scale, over the tile's rows (a row block in the
 * train step), skips its share of the dx and dweight GEMMs: those run on the kept columns only, gathered. A row's
 * scale is the largest magnitude of its coefficients in dZ = a p + b onehot + e p (z - sum p z) + c w, so that in
 * cross-entropy (a = -b) the test is p dz/du < eps, whatever the reduction's 1/N. Only the softmax terms of dZ
 * (a p and the entropy term) are skipped (and estimated, FH_PARAM_GRAD_FILTER_TAIL): a column that holds a row's
 * target is kept, and the dense rank-one term c w (label smoothing, class weights) is applied exactly over the
 * skipped columns, as c (W w) to dx and w (X^T c) to dweight. Skipped dweight columns honour beta (0 writes
 * zeros). With a softcap the c w term is not rank one, so a tile with a nonzero c under a softcap is not filtered.
 * eps 0 (the default) is off: results are bit for bit the unfiltered ones. eps must be in [0, 1)
 * (fh_context_set_real); CCE's choice is the dtype's machine epsilon / 32 (2^-12 for bf16, 2^-28 for fp32).
 * docs/filtering.md gives the measured effect.
 *
 * What filtering does with the softmax terms of the columns it skips (the tail: every one below eps, together a
 * few percent of a trained row's mass). FH_FILTER_TAIL_ESTIMATE (the default) replaces them, per tile, by the
 * rank-one product of their row sums and their columns' share of the tile's dropped magnitude: dx_i += r_i s and
 * dweight_j += (nu_j / S) sum_i r_i x_i, with r_i the sum of row i's skipped softmax terms, nu_j the sum of column
 * j's magnitudes, S that of all of them and s = sum_j (nu_j / S) W[:, j]. Each row's skipped total is kept exactly;
 * the sums are taken in the pass that marks the columns, and the terms cost H-vectors and a write of the skipped
 * dweight columns, against the skipped GEMMs' 4 N H V flops. (bf16 row
 * blocks, whose dweight is one product after the blocks, estimate the columns every block skipped as
 * nu_j sum_b (sum_{i in b} r_i x_i) / sum_b S_b.) FH_FILTER_TAIL_DROP leaves them out, as Cut Cross-Entropy does:
 * the gradient then lacks that mass, a bias that slows training on heads whose tail is heavy (docs/filtering.md). */
typedef enum fh_filter_tail { FH_FILTER_TAIL_ESTIMATE = 0, FH_FILTER_TAIL_DROP = 1 } fh_filter_tail;

/* The gradient GEMM work of the last call on the context (0 for a call with no backward): the flops the
 * unfiltered dx and dweight GEMMs would run (4 N H V per backward pass) and those filtering skipped. */
typedef struct fh_filter_stats {
    double gradient_flops;
    double skipped_flops;
} fh_filter_stats;
FH_API fh_status fh_context_filter_stats(const fh_context *ctx, fh_filter_stats *stats);

/* ---------------------------------------------------------------------------------------------
 * Kernels in use. Debian's BLIS 0.9.0 does not recognise recent AMD CPUs and falls back to slow
 * generic kernels. Before BLIS initialises, the library selects the best kernel set the CPU supports
 * (skx on AVX-512 CPUs) unless the user set BLIS_ARCH_TYPE. fusedhead's own row kernels and its fp32 and bf16 GEMM
 * paths are chosen once per process from the CPU, unless the environment forces them:
 *   FH_ROW_KERNELS=portable|avx2|avx512   the row kernels (exp, fold, gradient, rounding, ...)
 *   FH_FP32_GEMM=blis|onednn              fp32 GEMMs through BLIS sgemm or oneDNN's f32 matmul
 *   FH_BF16_GEMM=native|convert           bf16 GEMMs through oneDNN's bf16 matmul, or widened to f32 for BLIS
 * A forced choice this CPU or build lacks (or an unknown name) is refused: the calls that need it return
 * FH_ERR_KERNELS_UNAVAILABLE with `refusal` as their message; nothing else changes.
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_kernel_info {
    const char *kernel_set; /* BLIS's name for the configuration in use: "skx", "haswell", "zen3", "generic", ... */
    int selected_by_library; /* 1 if fusedhead chose it, 0 if BLIS did (or the user did) */
    int user_override;       /* 1 if BLIS_ARCH_TYPE was set in the environment */
    const char *elementwise; /* the row kernels in use: "avx512", "avx2" or "portable" */
    const char *bf16_gemm;   /* the bf16 path and what runs it, e.g. "native (oneDNN 2.6.3 brg:avx512_core_bf16)",
                                "convert (bf16 widened to f32, BLIS sgemm; oneDNN 2.6.3 unavailable)" */
    const char *bf16_path;   /* "native", "convert", or "refused" (FH_BF16_GEMM forces what is missing) */
    const char *refusal;     /* NULL, or why FH_ROW_KERNELS, FH_BF16_GEMM or FH_FP32_GEMM cannot be honoured */
    const char *fp32_gemm;   /* the fp32 path and what runs it, e.g. "onednn (oneDNN 2.6.3: brg:avx512_core)",
                                "blis (BLIS sgemm; oneDNN 2.6.3: gemm:jit)" */
    const char *fp32_path;   /* "blis", "onednn", or "refused" (FH_FP32_GEMM forces what is missing) */
} fh_kernel_info;

FH_API fh_status fh_kernel_query(fh_kernel_info *info);

/* ---------------------------------------------------------------------------------------------
 * The linear head: hidden states [N, H] times the lm_head weight viewed as [H, V], plus a bias.
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_layout {
    FH_LAYOUT_HV = 0, /* weight stored [H, V] row-major (flax/JAX kernel) */
    FH_LAYOUT_VH = 1  /* weight stored [V, H] row-major (torch nn.Linear.weight) */
} fh_layout;

/* Element type of the hidden states and the weight. bf16 elements are raw bfloat16 bits (uint16_t, the
 * upper half of an fp32), as torch.bfloat16 stores them. */
typedef enum fh_dtype {
    FH_DTYPE_F32 = 0,
    FH_DTYPE_BF16 = 1
} fh_dtype;

typedef struct fh_linear {
    int64_t n;          /* tokens (B*T) */
    int64_t hidden;     /* H */
    int64_t vocab;      /* V */
    const void *x;      /* hidden states; element (i, k) at x[i * x_row_stride + k] (x_dtype elements) */
    int64_t x_row_stride;
    const void *weight; /* element (k, v) of the [H, V] view at weight[k * w_stride_hidden + v * w_stride_vocab] */
    int64_t w_stride_hidden;
    int64_t w_stride_vocab;
    const float *bias;  /* [V] contiguous fp32, or NULL */
    fh_dtype x_dtype;   /* 0 (fp32) unless set; x and weight must have the same dtype */
    fh_dtype weight_dtype;
} fh_linear;

/* Fills a fh_linear for contiguous fp32 storage in the given layout; for bf16 set x_dtype and weight_dtype
 * to FH_DTYPE_BF16 afterwards. */
FH_API fh_status fh_linear_init(fh_linear *lin, int64_t n, int64_t hidden, int64_t vocab, const void *x,
                                const void *weight, fh_layout layout, const float *bias);

/* Gradient outputs. A NULL pointer skips that gradient. dweight uses the weight's strides. Each gradient is
 * fp32 (float) unless its dtype says bf16 (raw bits, uint16_t), which needs bf16 x and weight. A bf16 gradient
 * is accumulated in f32 inside the call and rounded once at the end; with beta 1 the old value is added in f32
 * before that rounding. */
typedef struct fh_linear_grads {
    void *dx;             /* [N, H], element (i, k) at dx[i * dx_row_stride + k] */
    int64_t dx_row_stride;
    float dx_beta;        /* 0 overwrites, 1 accumulates */
    void *dweight;
    float dweight_beta;
    void *dbias;          /* [V] */
    float dbias_beta;
    fh_dtype dx_dtype;    /* 0 (fp32) unless set */
    fh_dtype dweight_dtype;
    fh_dtype dbias_dtype;
} fh_linear_grads;

/* ---------------------------------------------------------------------------------------------
 * Cross-entropy (torch.nn.functional.cross_entropy semantics, plus softcap, logit scale, z-loss and DFT).
 *
 *   v_j      = logit_scale u_j,    u = x W + bias          (Cohere's logit_scale; Granite's 1 / logits_scaling)
 *   z_j      = softcap > 0 ? softcap * tanh(v_j / softcap) : v_j
 *   lse      = log sum_j exp(z_j)
 *   ce_i     = (1 - eps) w_y (lse - z_y) + (eps / V) sum_j w_j (lse - z_j)     (w = class weights or 1)
 *   zl_i     = z_loss * lse^2
 *   token_scaling (DFT): ce_i and zl_i multiplied by sg(p_y) = exp(z_y - lse), no gradient through it
 *   mean:    loss = sum_i ce_i / sum_i w_{y_i}  +  sum_i zl_i / count     (over non-ignored tokens)
 *   sum:     loss = sum_i ce_i + sum_i zl_i
 *   none:    per_token_loss_i = ce_i + zl_i (0 for ignored tokens)
 * If every token is ignored the loss is 0 and every gradient is 0 (never NaN).
 * DFT scales as Liger-Kernel's use_token_scaling does (ops/fused_linear_cross_entropy.py): the whole per-token loss,
 * label smoothing and z-loss included (so the z_loss output too), and its whole gradient row, by softmax(z)[y]
 * detached; without label smoothing and z-loss it is TRL's SFT loss_type "dft", -sg(p_y) log p_y.
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_reduction {
    FH_REDUCTION_MEAN = 0,
    FH_REDUCTION_SUM = 1,
    FH_REDUCTION_NONE = 2
} fh_reduction;

typedef struct fh_ce_options {
    int64_t ignore_index;        /* default -100 */
    fh_reduction reduction;      /* default mean */
    double label_smoothing;      /* in [0, 1]; default 0 */
    const float *class_weights;  /* [V] non-negative, or NULL */
    double softcap;              /* 0 = off; else a positive normal fp32 value */
    double z_loss;               /* coefficient of lse^2; 0 = off */
    double logit_scale;          /* multiplies x W + bias before the softcap; default 1 */
    int token_scaling;           /* non-zero: DFT, each token's loss times sg(p_target) (Liger use_token_scaling,
                                    TRL SFT loss_type "dft"); default 0 */
} fh_ce_options;

FH_API fh_status fh_ce_options_init(fh_ce_options *options);

typedef struct fh_ce_outputs {
    double *loss;            /* scalar; for 'none' receives the sum of per-token losses. May be NULL. */
    double *z_loss;          /* the z-loss part of loss, reduced like it. May be NULL. */
    float *per_token_loss;   /* [N]; required for 'none' */
    float *per_token_logp;   /* [N] log p(target); 0 for ignored tokens */
    float *lse;              /* [N] log-sum-exp of z (the scaled, softcapped logits); needed by fh_ce_backward */
    int64_t *argmax;         /* [N] index of the largest logit (lowest index on ties) */
    float *entropy;          /* [N] entropy of softmax(z), -sum_j p_j log p_j; 0 for ignored tokens; no gradient */
    int64_t *correct;        /* scalar: non-ignored tokens whose argmax is their target (token accuracy = correct /
                                their count) */
} fh_ce_outputs;

/* Streaming forward: holds at most one tile of logits. Any output pointer may be NULL except as noted. */
FH_API fh_status fh_ce_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                               const fh_ce_options *options, fh_ce_outputs *out);

/* Streaming backward: recomputes each tile from lse (as written by fh_ce_forward). With token_scaling it first
 * recomputes each token's target logit z_y (one dot product of its x row and the target's weight column, 2 N H
 * flops) for p_y = exp(z_y - lse), which scales its row before the first tile.
 * grad_output: one value for mean/sum, N values for 'none'; NaN/Inf is rejected
 * (FH_ERR_INVALID_GRAD_OUTPUT) rather than propagated. */
FH_API fh_status fh_ce_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                const fh_ce_options *options, const float *lse, const float *grad_output,
                                fh_linear_grads *grads);

/* Single-call train step, for callers who know the upstream gradient up front (mean/sum in a training
 * step, or per-token weights for 'none'): the forward outputs and the gradients in one call.
 * Row-block schedule: logits for a block of rows across the whole vocabulary (within the memory
 * budget), their statistics, dU in place, then both gradient GEMMs: 6 N H V flops instead of the 8 of
 * forward + backward. When the budget cannot hold a useful row block it streams (forward, then
 * backward) instead; the results are the same either way. */
FH_API fh_status fh_ce_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                        const fh_ce_options *options, const float *grad_output,
                                        fh_ce_outputs *out, fh_linear_grads *grads);

/* Workspace bytes that fh_ce_forward/fh_ce_backward need for this shape under the context's settings.
 * Pure: allocates nothing, changes nothing. */
FH_API fh_status fh_ce_workspace_size(const fh_context *ctx, const fh_linear *lin,
                                      const fh_ce_options *options, size_t *bytes);

/* Workspace bytes that fh_ce_forward_backward needs (the row-block schedule when it fits the budget), whatever
 * its gradients. */
FH_API fh_status fh_ce_forward_backward_workspace_size(const fh_context *ctx, const fh_linear *lin,
                                                       const fh_ce_options *options, size_t *bytes);
/* The same for a call with exactly these gradients (pointers included: with bf16 inputs, and with fp32 ones at
 * N <= H, a dense [V, H] dweight that the call overwrites holds the row blocks' logits and dU until it is written,
 * and where it starts decides what fits): at most the size above, often far less (docs/bf16.md,
 * docs/performance.md). The gradients are checked as the call checks them. */
FH_API fh_status fh_ce_forward_backward_workspace_size_with_grads(const fh_context *ctx, const fh_linear *lin,
                                                                  const fh_ce_options *options,
                                                                  const fh_linear_grads *grads, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * Log-probs: the per-token statistics every policy-gradient and preference loss is a function of, and their
 * gradients back, so that any such loss is a few lines on [N] vectors and no [N, V] logits exist.
 *
 *   u = x W + bias,  v = logit_scale u,  z = softcap > 0 ? softcap tanh(v / softcap) : v,  s = z / temperature
 *   lse_i  = log sum_j exp(s_ij),  p_i = softmax(s_i)
 *   logp_i = s_{i, y_i} - lse_i,   H_i = -sum_j p_ij log p_ij = lse_i - sum_j p_ij s_ij
 *   backward, from upstream g_logp, g_entropy, g_lse (each [N], or NULL for 0):
 *   dL/ds_ij = g_logp_i ([j = y_i] - p_ij) - g_entropy_i p_ij (s_ij - lse_i + H_i) + g_lse_i p_ij
 * Tokens whose target is ignore_index get logp, entropy and lse 0 and no gradient; every other target is in
 * [0, V).
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_logprob_options { /* defaults from fh_logprob_options_init */
    int64_t ignore_index;           /* -100 */
    double temperature;             /* 1.0; > 0 */
    double softcap;                 /* 0 = off; else a positive normal fp32 value */
    double logit_scale;             /* 1.0 */
} fh_logprob_options;

FH_API fh_status fh_logprob_options_init(fh_logprob_options *options);

typedef struct fh_logprob_outputs { /* [N] each; any may be NULL */
    float *logp;
    float *entropy;
    float *lse;                     /* fh_logprob_backward needs it */
} fh_logprob_outputs;

/* Streaming forward. */
FH_API fh_status fh_logprob_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                    const fh_logprob_options *options, fh_logprob_outputs *out);

/* Streaming backward from what fh_logprob_forward wrote: lse, and entropy when g_entropy is given (else it may be
 * NULL). g_logp, g_entropy, g_lse: [N] upstream gradients or NULL (0); each must be finite. */
FH_API fh_status fh_logprob_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                     const fh_logprob_options *options, const float *lse, const float *entropy,
                                     const float *g_logp, const float *g_entropy, const float *g_lse,
                                     fh_linear_grads *grads);

/* The same pair keeping the logits between the calls: fh_logprob_forward_keep writes, besides the outputs, the rows'
 * logits x W (before bias, scale, cap and temperature) into logits [N, V] (row-major fp32, N V 4 bytes of the
 * caller's; 0 in the rows whose target is ignore_index), and fh_logprob_backward_kept reads them
 * there instead of recomputing them: the backward makes two GEMMs of N H V instead of three, the pair 3 instead of 4
 * (what a materialized step makes), for N V 4 bytes held from the forward to the backward, outside the memory
 * budget (fusedhead.torch keeps them when they take at most half of it). Arguments and results otherwise as
 * fh_logprob_forward and fh_logprob_backward; logits NULL is FH_ERR_NULL_POINTER, and the kept logits may overlap
 * no other argument (FH_ERR_OVERLAPPING_BUFFERS). The backward's result is the recomputing one's up to the fp32
 * rounding of logits computed on other tiles. */
FH_API fh_status fh_logprob_forward_keep(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                         const fh_logprob_options *options, fh_logprob_outputs *out, float *logits);
FH_API fh_status fh_logprob_backward_kept(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                          const fh_logprob_options *options, const float *logits, const float *lse,
                                          const float *entropy, const float *g_logp, const float *g_entropy,
                                          const float *g_lse, fh_linear_grads *grads);

/* Forward and backward in one call, for callers who know the upstream gradients up front: row blocks (6 N H V
 * flops) as fh_ce_forward_backward, streaming when the budget cannot hold a block; the same results either way. */
FH_API fh_status fh_logprob_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                             const fh_logprob_options *options, const float *g_logp,
                                             const float *g_entropy, const float *g_lse, fh_logprob_outputs *out,
                                             fh_linear_grads *grads);

/* Workspace bytes the log-prob calls need, the largest of the three (pure). */
FH_API fh_status fh_logprob_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * Log-probs over a support: each token's log-prob, entropy and log-sum-exp over a set S_i of vocabulary ids given
 * per token (a sampler's kept set: top-k / top-p, vLLM's return_sampling_mask) instead of the whole vocabulary,
 * with their gradients. With s as in fh_logprob (the same options):
 *
 *   lse_S,i = log sum_{j in S_i} exp(s_ij),  p_ij = exp(s_ij - lse_S,i) on S_i (0 elsewhere)
 *   logp_i  = s_{i, y_i} - lse_S,i,          H_i = lse_S,i - sum_{j in S_i} p_ij s_ij
 *   backward: dL/ds_ij as fh_logprob's for j in S_i, 0 for every other column
 *
 * The target of a counted row must be in its row's support (the sampled token is in the sampler's kept set); a row
 * whose target is ignore_index gets 0 and no gradient, and its support is only checked for validity. No logits tile
 * exists: each id's logit is one dot product of the token's row of x with that weight column (summed in fp32 like a
 * GEMM's, then biased and transformed by the row kernels, as fh_logprob's tiles), so a call costs 2 H per entry
 * forward, 4 H per entry backward and the reads of those weight columns: with |S| = 64 at N = 4096, H = 2048,
 * V = 151643, 1.4 to 1.6% of the full head's time (docs/performance.md). The weight's columns are contiguous in FH_LAYOUT_VH; in
 * FH_LAYOUT_HV each of a column's elements is on its own cache line, so the reads cost about 16x more there.
 * A dweight with beta 0 is written whole (zeros outside every support), so a call's floor is one write of V H.
 * The full-vocabulary lse, when a caller wants both (TRL's importance ratio against a full-vocabulary old
 * log-prob), is fh_logprob_forward's on the same rows.
 * Per-row results depend on that row's entries only, in their order: batch-invariant in every mode.
 * ------------------------------------------------------------------------------------------- */
typedef struct fh_support {
    const int64_t *ids;     /* CSR: row i's ids are ids[offsets[i] .. offsets[i + 1]); padded: ids[i k .. i k + k),
                               entries -1 being padding */
    const int64_t *offsets; /* CSR: [N + 1], offsets[0] = 0, non-decreasing; NULL: padded */
    int64_t k;              /* padded: entries per row, >= 1; CSR: unread */
} fh_support;

/* Outputs as fh_logprob_forward's (lse is lse_S, which fh_logprob_support_backward needs). */
FH_API fh_status fh_logprob_support_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                            const fh_support *support, const fh_logprob_options *options,
                                            fh_logprob_outputs *out);
/* From what the forward wrote: lse, and entropy when g_entropy is given (else it may be NULL); upstream gradients as
 * fh_logprob_backward's. */
FH_API fh_status fh_logprob_support_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                             const fh_support *support, const fh_logprob_options *options,
                                             const float *lse, const float *entropy, const float *g_logp,
                                             const float *g_entropy, const float *g_lse, fh_linear_grads *grads);
/* Both in one call (the logits of the support computed once). */
FH_API fh_status fh_logprob_support_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                                     const fh_support *support, const fh_logprob_options *options,
                                                     const float *g_logp, const float *g_entropy, const float *g_lse,
                                                     fh_logprob_outputs *out, fh_linear_grads *grads);
/* Workspace bytes the three calls need for this support (pure; its offsets are checked as a call checks them, its
 * ids are not read): FH_ERR_BUDGET_TOO_SMALL when they pass the memory budget, as the calls then fail. */
FH_API fh_status fh_logprob_support_workspace_size(const fh_context *ctx, const fh_linear *lin,
                                                   const fh_support *support, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * GRPO family: TRL GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py and grpo_config.py of TRL 1.16.0; written
 * to commit f2cd57710ae345ea6428ae95363267fcf38a3dc8, whose luspo reduction and entropy-bonus normaliser 1.16.0
 * changed) for one micro-batch on one process, every option that changes the loss or its gradient. docs/losses.md
 * has the derivation; TRL's quirks are kept and marked [TRL].
 *
 *   z      = (x W + bias) / temperature                  token i = b*T + t predicts completion_ids[i] (packed:
 *                                                         i = cu_seqlens[b] + t)
 *   logp_i = log_softmax(z_i)[completion_ids_i],  H_i = lse_i - sum_j p_ij z_ij (entropy);  m_i = mask
 *   old    = old_per_token_logps, or logp detached when NULL (on-policy: ratio 1, gradient still flows)
 *   log-ratio: token level  logp_i - old_i;
 *              sequence level (GSPO)  s_b = sum_t m (logp - old) / max(sum_t m, 1), gradient flowing
 *              through the mean into every token of the sequence, as in TRL
 *   r_i = exp(log-ratio)                                  (TRL's coef_1)
 *   grpo, bnpo, dr_grpo, dapo, luspo: pol_i = -min(c1 A_b, clamp(r, 1 - eps_low, 1 + eps_high) A_b),
 *                              c1 = min(r, delta) when delta is set, else r
 *   cispo: pol_i = -sg(min(r, eps_high)) A_b logp_i          (eps_high is an absolute cap here)
 *   sapo:  pol_i = -sigmoid(tau (r - 1)) (4 / tau) A_b,       tau = A_b > 0 ? tau_pos : tau_neg
 *   vespo: pol_i = -sg(phi_b) A_b logp_i, phi_b = exp(lam + k log w - lam w), log w = clamp(sum_t m clamp(logp - old,
 *          -20, 20) [+ sum_t clamp(log is_t, log 1e-8, 20)], log 1e-8, 20); (k, lam) = A_b >= 0 ? (k_pos, lam_pos)
 *          : (k_neg, lam_neg), lam >= 1e-4; a non-finite phi is 0 (TRL's get_gamma_weights)
 *   pol_i *= keep_b (off_policy_mask_threshold: keep_b = A_b >= 0 or sum_t m (samp - sg(logp)) / max(sum_t m, 1)
 *            <= threshold, samp = sampling_per_token_logps, else old)
 *          * e_i    (top_entropy_quantile q < 1: e_i = m_i != 0 and H_i m_i >= Q, Q the (1 - q) quantile (linear,
 *                    as torch.quantile) of the entropies of every token with m != 0 in the whole batch)
 *          * is_i   (the batch has sampling_per_token_logps and vllm_importance_sampling_correction, not vespo)
 *   is: token modes exp((old_i - samp_i) m_i); sequence modes exp(sum_t (old - samp) m) for every token of b;
 *       *_truncate clamps to [clip_min, clip_max]; *_mask sets a ratio outside them to 0 (an absent bound: none)
 *   l_i  = pol_i + beta kl_i,  kl_i = exp(ref_i - logp_i) - (ref_i - logp_i) - 1     (k3)
 *          [* r_i with use_bias_correction_kl, the gradient flowing through r as well]
 *   loss  grpo, sapo: mean over sequences of sum_t m l / max(sum_t m, 1)
 *         bnpo: sum m l / max(sum m, 1);   dr_grpo: sum m l / (B max_completion_length)
 *         dapo, cispo, vespo: sum m l / N,  N = max(num_items_in_batch, 1), or max(sum m, 1) when it is <= 0
 *         luspo: mean over sequences of sum_t m l   (a sequence's sum, not its mean)
 *         minus entropy_coef times the entropy bonus, for every loss type the mean entropy over the tokens e_i m_i
 *         (m_i without the quantile): sum e m H / max(sum e m, 1), whatever num_items_in_batch [TRL: the count is
 *         the micro-batch's own, not gathered over processes]
 * Ties in min() split the gradient in halves and clamp() passes it at its bounds, as torch does. Not in the head:
 * TRL's adaptive entropy controller (trainer state across steps: pass its current coefficient as entropy_coef),
 * the division by gradient-accumulation steps and the MoE auxiliary loss. TRL divides the grpo, bnpo, dr_grpo, sapo
 * and luspo losses and every entropy bonus by the accumulation steps (scale grad_output); dapo, cispo and vespo
 * carry them in num_items_in_batch instead, so their bonus alone needs them: pass entropy_coef / steps.
 *
 * Packed sequences (cu_seqlens; GRPO, preference and KTO): the sequences lie end to end, sequence b at rows
 * cu_seqlens[b] ..; per-token arrays are [n] and every per-sequence quantity is over the sequence's rows. The
 * results are the [B, T] call's on the same sequences with mask 0 in the padding: per-token outputs and dx rows bit
 * for bit, the loss and metrics up to summation order, dweight and dbias up to the GEMMs' blocking (the row
 * blocks hold whole sequences of their own lengths). Padding costs nothing; masked rows inside a sequence still do.
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_grpo_loss_type {
    FH_GRPO_LOSS_GRPO = 0,
    FH_GRPO_LOSS_BNPO = 1,
    FH_GRPO_LOSS_DR_GRPO = 2,
    FH_GRPO_LOSS_DAPO = 3,
    FH_GRPO_LOSS_CISPO = 4,
    FH_GRPO_LOSS_SAPO = 5,
    FH_GRPO_LOSS_LUSPO = 6,
    FH_GRPO_LOSS_VESPO = 7
} fh_grpo_loss_type;

typedef enum fh_grpo_is_level {
    FH_GRPO_IS_TOKEN = 0,
    FH_GRPO_IS_SEQUENCE = 1 /* GSPO */
} fh_grpo_is_level;

typedef enum fh_grpo_vllm_is_mode {     /* TRL vllm_importance_sampling_mode */
    FH_GRPO_VLLM_IS_TOKEN_TRUNCATE = 0,
    FH_GRPO_VLLM_IS_TOKEN_MASK = 1,
    FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE = 2,
    FH_GRPO_VLLM_IS_SEQUENCE_MASK = 3
} fh_grpo_vllm_is_mode;

typedef struct fh_grpo_options {        /* TRL GRPOConfig names; defaults from fh_grpo_options_init */
    fh_grpo_loss_type loss_type;        /* dapo (TRL's default) */
    fh_grpo_is_level importance_sampling_level; /* token */
    double temperature;                 /* 1.0 */
    double epsilon_low;                 /* TRL `epsilon`: 0.2 */
    double epsilon_high;                /* NaN: same as epsilon_low */
    double delta;                       /* NaN or 0: no two-sided clipping */
    double beta;                        /* KL coefficient; 0: no KL and no reference log-probs needed */
    double sapo_temperature_pos;        /* 1.0 */
    double sapo_temperature_neg;        /* 1.05 */
    double num_items_in_batch;          /* dapo/cispo/vespo policy normaliser, at least 1 (TRL clamps it); <= 0:
                                           max(sum of mask, 1). Not the entropy bonus's */
    int64_t max_completion_length;      /* dr_grpo's constant; <= 0: T */
    double entropy_coef;                /* entropy bonus; 0 */
    double top_entropy_quantile;        /* 1.0: every token carries the policy term; in [0, 1] */
    double off_policy_mask_threshold;   /* NaN: no off-policy sequence mask */
    int use_bias_correction_kl;         /* 0 */
    int vllm_importance_sampling_correction; /* 1; applies only to a batch with sampling_per_token_logps */
    fh_grpo_vllm_is_mode vllm_importance_sampling_mode; /* sequence_mask */
    double vllm_importance_sampling_clip_min; /* NaN: no lower bound */
    double vllm_importance_sampling_clip_max; /* 3.0; NaN: no upper bound (a *_truncate mode needs one bound) */
    double vespo_k_pos, vespo_lambda_pos; /* 2.0, 3.0 */
    double vespo_k_neg, vespo_lambda_neg; /* 3.0, 2.0 */
} fh_grpo_options;

FH_API fh_status fh_grpo_options_init(fh_grpo_options *options);

typedef struct fh_grpo_batch {
    int64_t batch, seq;                 /* B, T; the fh_linear's n must be B*T */
    const int64_t *completion_ids;      /* [B, T], in [0, V) wherever the mask is non-zero */
    const float *completion_mask;       /* [B, T], 0/1 (any finite value >= 0 weighs the token) */
    const float *advantages;            /* [B] */
    const float *old_per_token_logps;   /* [B, T] or NULL (on-policy) */
    const float *ref_per_token_logps;   /* [B, T]; required when beta != 0 */
    const float *sampling_per_token_logps; /* [B, T] the sampler's (vLLM's) log-probs, or NULL */
    const fh_support *support;          /* NULL: the policy's log-probs over the vocabulary; else over each token's
                                           support (the sampler's kept set, "Log-probs over a support"): logp_i and
                                           H_i over S_i, every completion id at a non-zero mask in its support, and
                                           the masked tokens' per-token outputs 0; its workspace is
                                           fh_logprob_support_workspace_size's. No parallel form */
    const int64_t *cu_seqlens;          /* NULL: the rows are [B, T]. Else packed sequences: [B + 1] offsets,
                                           0 = cu_seqlens[0] < ... < cu_seqlens[B] = n, sequence b is rows
                                           cu_seqlens[b] .. cu_seqlens[b + 1] - 1, seq must be 0 and every [B, T]
                                           array (inputs and outputs) is [n]; dr_grpo needs max_completion_length.
                                           Results equal the [B, T] call's on the same sequences ("Packed
                                           sequences" above); a support applies as to [B, T] rows. No
                                           parallel form */
} fh_grpo_batch;

typedef struct fh_grpo_metrics {        /* TRL's logged metrics; NaN where TRL logs nothing */
    double kl;                          /* masked mean of kl (times r with use_bias_correction_kl) (beta != 0) */
    double entropy;                     /* masked mean of H */
    double clip_ratio_low_mean;         /* r < 1 - eps_low and A < 0   (clipped family, luspo) */
    double clip_ratio_high_mean;        /* r > 1 + eps_high and A > 0  (clipped family, luspo) */
    double clip_ratio_region_mean;      /* either */
    double cispo_clip_ratio;            /* r > eps_high and A > 0      (cispo) */
    double clip_ratio_low_min;          /* the least over sequences of a sequence's masked mean of the low flag */
    double clip_ratio_high_max;         /* the largest over sequences of the high flag's */
    double policy_loss;                 /* the loss before the entropy bonus (entropy_coef != 0) */
    double entropy_coef;                /* (entropy_coef != 0) */
    double vespo_phi_seq_mean;          /* vespo/phi_seq_mean: the mean of phi_b over sequences (vespo) */
    /* sampling/...: with the importance-sampling correction applied. Over this call's tokens with m != 0 (the
     * ratio's over sequences in the sequence modes); 0 when there are none, as TRL. */
    double sampling_logp_difference_mean, sampling_logp_difference_max; /* |old - samp| */
    double importance_sampling_ratio_min, importance_sampling_ratio_mean, importance_sampling_ratio_max;
} fh_grpo_metrics;

typedef struct fh_grpo_outputs {        /* any may be NULL */
    double *loss;
    fh_grpo_metrics *metrics;
    float *per_token_logp;              /* [B, T]; 0 where the id is outside [0, V) (masked padding) */
    float *per_token_loss;              /* [B, T] l_i, before masking */
    float *entropy;                     /* [B, T] */
    float *lse;                         /* [B, T] of the tempered logits; fh_grpo_backward needs it */
} fh_grpo_outputs;

FH_API fh_status fh_grpo_forward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                 const fh_grpo_options *options, fh_grpo_outputs *out);

/* Backward from what fh_grpo_forward saved: per_token_logp and lse, and entropy when entropy_coef != 0 or
 * top_entropy_quantile < 1 (else it may be NULL). grad_output: one value, d(objective)/d(loss). */
FH_API fh_status fh_grpo_backward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                  const fh_grpo_options *options, const float *per_token_logp, const float *lse,
                                  const float *entropy, const float *grad_output, fh_linear_grads *grads);

/* Forward and backward in one call. Row blocks of whole sequences (6 N H V flops, as fh_ce_forward_backward):
 * a block's logits across the whole vocabulary, its tokens' statistics, then its sequences' values (GSPO
 * log-ratios, off-policy masks, VESPO weights, importance-sampling ratios) and its rows' coefficients, dU and both
 * gradient GEMMs; the per-sequence normalisers come from the mask alone. It streams both passes instead (8 N H V
 * flops) when the memory budget cannot hold one sequence's rows, and with top_entropy_quantile < 1, whose
 * threshold needs every token's entropy before any coefficient. The results are the same either way. */
FH_API fh_status fh_grpo_forward_backward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                          const fh_grpo_options *options, const float *grad_output,
                                          fh_grpo_outputs *out, fh_linear_grads *grads);

/* Workspace bytes the GRPO calls need, the largest of forward, backward and forward_backward (pure). */
FH_API fh_status fh_grpo_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * Preference optimisation: DPO, ORPO, SimPO, CPO (TRL's DPOTrainer, ORPOTrainer and CPOTrainer semantics,
 * Liger-Kernel's chunked_loss layout), one micro-batch on one process.
 *
 *   The batch is 2B sequences of T tokens: chosen ones first (rows 0 .. B T - 1), then rejected ones; pair b
 *   is sequences b and B + b. z = x W + bias; logp_t = log_softmax(z_t)[targets_t] (0 where masked and the
 *   target is outside [0, V)). n_s = max(sum_t m_t, 1), the sequence's token count.
 *   c_b, r_b: the sequence log-probs of chosen and rejected sequence b;  beta, ls = label_smoothing.
 *   NLL = -sum over chosen tokens of m logp / max(sum of chosen m, 1)  (cross-entropy on the chosen half)
 *
 *   dpo at TRL's current semantics (dpo_semantics FH_PREFERENCE_TRL_CURRENT, the default: DPOTrainer since v0.29.0,
 *   as at commit f2cd5771): l_s = sum_t m_t logp_t for every loss type; ref_s the reference's, summed likewise
 *   (none given: 0); cs = c - ref_c, rs = r - ref_r, d = cs - rs; loss = sum_k loss_weights[k] mean_b term_k:
 *     sigmoid -log sig(beta d)            hinge relu(1 - beta d)        robust as below
 *     ipo  (cs/n_c - rs/n_r - 1/(2 beta))^2            sigmoid_norm  -log sig(beta (cs/n_c - rs/n_r))
 *     exo_pair  sig(beta d)(log sig(beta d) - log(1 - ls)) + sig(-beta d)(log sig(-beta d) - log ls)   (ls > 0)
 *     nca_pair  -log sig(beta cs) - log sig(-beta cs) / 2 - log sig(-beta rs) / 2
 *     bco_pair  -log sig(beta cs) - log sig(-beta rs)   sppo_hard  (cs - 1/(2 beta))^2 + (rs + 1/(2 beta))^2
 *     apo_zero  1 - sig(beta cs) + sig(beta rs)          apo_down   sig(beta cs) + 1 - sig(beta d)
 *     discopop  with L = beta d, q = sig(L / discopop_tau):  -log sig(L) (1 - q) + exp(-L) q
 *     aot  S(c - r)_k - S(ref_c - ref_r)_k;  aot_unpaired  S(cs)_k - S(rs)_k: S sorts the call's B values
 *          ascending (ties by index), and term_k = -(1 - ls) log sig(beta delta_k) - ls log sig(-beta delta_k)
 *     sft  NLL                                   (rpo_alpha must be 0: TRL's rpo_alpha became this term)
 *   rewards = beta (l - ref).
 *   dpo at TRL v0.28.0 (FH_PREFERENCE_TRL_0_28, DPOTrainer before its refactor; sigmoid, hinge, ipo, robust only):
 *           l_s = sum_t m_t logp_t, or that / n_s for ipo; ref aggregated as l;  u_b = (c_b - ref_c_b) - (r_b - ref_r_b)
 *           sigmoid: -(1 - ls) log sig(beta u) - ls log sig(-beta u)
 *           robust:  (-(1 - ls) log sig(beta u) + ls log sig(-beta u)) / (1 - 2 ls)
 *           hinge:   relu(1 - beta u);   ipo: (u - 1 / (2 beta))^2
 *           loss = mean_b + rpo_alpha * NLL;  rewards = beta (l - ref)
 *   cpo:    u_b = c_b - r_b (l summed, averaged for ipo); sigmoid, hinge, ipo as v0.28's dpo;
 *           loss = mean_b + cpo_alpha * NLL;  rewards = beta l
 *   simpo:  u_b = c_b - r_b - simpo_gamma / beta (averaged l), sigmoid as v0.28's dpo; loss = mean_b + cpo_alpha * NLL
 *   orpo:   o_b = (c_b - r_b) - (log(1 - exp c_b) - log(1 - exp r_b)) (averaged l);
 *           loss = NLL - mean_b beta log sig(o_b);  rewards = beta l
 * Nothing is differentiated through the reference log-probs; rewards and metrics carry no gradient. aot and
 * aot_unpaired sort over the whole call, so fh_preference_forward_backward streams with them (8 N H V flops).
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_preference_loss {
    FH_PREFERENCE_DPO = 0,
    FH_PREFERENCE_ORPO = 1,
    FH_PREFERENCE_SIMPO = 2,
    FH_PREFERENCE_CPO = 3
} fh_preference_loss;

typedef enum fh_preference_loss_type { /* TRL's loss_type: dpo at TRL's current semantics has all of them; dpo at */
    FH_PREFERENCE_SIGMOID = 0,         /* v0.28 the first four, cpo all but robust, simpo and orpo only sigmoid */
    FH_PREFERENCE_HINGE = 1,           /* (their own formulas above) */
    FH_PREFERENCE_IPO = 2,
    FH_PREFERENCE_ROBUST = 3,
    FH_PREFERENCE_EXO_PAIR = 4,
    FH_PREFERENCE_NCA_PAIR = 5,
    FH_PREFERENCE_BCO_PAIR = 6,
    FH_PREFERENCE_SPPO_HARD = 7,
    FH_PREFERENCE_AOT = 8,
    FH_PREFERENCE_AOT_UNPAIRED = 9,
    FH_PREFERENCE_APO_ZERO = 10,
    FH_PREFERENCE_APO_DOWN = 11,
    FH_PREFERENCE_DISCOPOP = 12,
    FH_PREFERENCE_SFT = 13,
    FH_PREFERENCE_SIGMOID_NORM = 14
} fh_preference_loss_type;

typedef enum fh_preference_dpo_semantics { /* which TRL DPOTrainer dpo follows */
    FH_PREFERENCE_TRL_CURRENT = 0,         /* TRL >= v0.29.0 (the DPO refactor), as at commit f2cd5771 */
    FH_PREFERENCE_TRL_0_28 = 1             /* TRL v0.28.0, the last release before it */
} fh_preference_dpo_semantics;

/* The longest loss_types list. */
#define FH_PREFERENCE_MAX_LOSS_TYPES 16

typedef struct fh_preference_options { /* TRL config names; defaults from fh_preference_options_init */
    fh_preference_loss loss;           /* dpo */
    fh_preference_loss_type loss_type; /* sigmoid; read only when loss_type_count is 0 */
    double beta;                       /* 0.1; > 0 */
    double label_smoothing;            /* 0; in [0, 0.5], < 0.5 with robust, > 0 with exo_pair */
    double simpo_gamma;                /* 0.5 (simpo) */
    double rpo_alpha;                  /* 0: no NLL term (dpo at v0.28; TRL's None); must be 0 at current semantics */
    double cpo_alpha;                  /* 1.0 (cpo and simpo; 0 for the SimPO paper's loss) */
    /* dpo at TRL's current semantics: */
    fh_preference_dpo_semantics dpo_semantics;  /* FH_PREFERENCE_TRL_CURRENT */
    int loss_type_count;                        /* 0: the one loss_type above, weight 1; else TRL's loss_type list */
    fh_preference_loss_type loss_types[FH_PREFERENCE_MAX_LOSS_TYPES];
    double loss_weights[FH_PREFERENCE_MAX_LOSS_TYPES]; /* TRL's loss_weights (finite), one per listed type */
    double discopop_tau;               /* 0.05; > 0 (discopop) */
    int use_weighting;                 /* 0; TRL's WPO weighting (DPOTrainer, both versions): not implemented, any
                                          other value is refused */
} fh_preference_options;

FH_API fh_status fh_preference_options_init(fh_preference_options *options);

typedef struct fh_preference_batch {
    int64_t pairs, seq;                /* B, T; the fh_linear's n must be 2 B T */
    const int64_t *targets;            /* [2B, T], in [0, V) wherever the mask is non-zero */
    const float *mask;                 /* [2B, T] loss mask, 0/1 (any finite value >= 0 weighs the token) */
    const float *ref_logps;            /* dpo: [2B] reference sequence log-probs, aggregated as l; or NULL */
    const float *ref_per_token_logps;  /* dpo: [2B, T] reference token log-probs, aggregated here; or NULL
                                          (at most one of the two; neither: reference log-probs
                                          0, v0.28's reference_free) */
    const int64_t *cu_seqlens;         /* NULL: the rows are [2B, T]. Else packed: [2B + 1] offsets of the chosen
                                          sequences then the rejected ones (TRL's concatenation), as
                                          fh_grpo_batch's; seq must be 0 and every [2B, T] array is [n] */
} fh_preference_batch;

typedef struct fh_preference_metrics { /* TRL's logged metrics (means over pairs); NaN where TRL logs nothing */
    double rewards_chosen, rewards_rejected, rewards_accuracies, rewards_margins;
    double logps_chosen, logps_rejected;   /* means of c and r */
    double logits_chosen, logits_rejected; /* mean of z over the whole vocabulary and the half's tokens: masked
                                              for dpo (DPOTrainer; 0 over no token at current semantics, NaN at
                                              v0.28), all of them for the others (CPO/ORPOTrainer) */
    double nll_loss;                       /* dpo at v0.28: NaN without rpo_alpha; cpo, simpo: 0 when cpo_alpha is
                                              0 (TRL); NaN for dpo at current semantics (TRL logs none) */
    double log_odds_ratio, log_odds_chosen; /* orpo: means of log sig(o) and of o */
    double entropy;                        /* dpo at current semantics: masked mean of every token's entropy */
    double mean_token_accuracy;            /* dpo at current semantics: the chosen half's masked share of tokens
                                              whose argmax is the target (0 over no token, as TRL) */
} fh_preference_metrics;

typedef struct fh_preference_outputs { /* any may be NULL */
    double *loss;
    fh_preference_metrics *metrics;
    float *sequence_logps;             /* [2B] l: chosen then rejected */
    float *rewards;                    /* [2B] chosen then rejected */
    float *per_token_logp;             /* [2B, T] */
} fh_preference_outputs;

FH_API fh_status fh_preference_forward(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *batch,
                                       const fh_preference_options *options, fh_preference_outputs *out);

/* Forward and backward in one call (grad_output: one value, d(objective)/d(loss)). Row blocks of whole pairs
 * (6 N H V flops): each block holds the same chosen and rejected sequences, so that a pair's loss and its
 * tokens' coefficients follow from the block's statistics. When the memory budget cannot hold one pair's
 * rows it streams both passes instead (8 N H V flops); the results are the same either way. */
FH_API fh_status fh_preference_forward_backward(fh_context *ctx, const fh_linear *lin,
                                                const fh_preference_batch *batch,
                                                const fh_preference_options *options, const float *grad_output,
                                                fh_preference_outputs *out, fh_linear_grads *grads);

/* Workspace bytes the preference calls need (pure). */
FH_API fh_status fh_preference_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * Distillation: a student head trained towards a teacher head over the same vocabulary (TRL's GKD
 * generalized_jsd_loss, Liger-Kernel's fused linear JSD and distillation losses). The teacher's hidden size
 * and layout may differ from the student's; it gets no gradient.
 *
 *   s = (x_s W_s + b_s) / temperature,  t = (x_t W_t + b_t) / temperature,  p = softmax(s),  q = softmax(t)
 *   forward_kl:  D_i = KL(q || p) = sum_j q_j (log q_j - log p_j)
 *   reverse_kl:  D_i = KL(p || q)
 *   jsd:         m = beta q + (1 - beta) p,  D_i = beta KL(q || m) + (1 - beta) KL(p || m);
 *                beta 0 is forward_kl and beta 1 reverse_kl, as TRL and Liger define them
 *   hard_i = -log_softmax(x_s W_s + b_s)[target_i]   (cross-entropy on the student's untempered logits)
 *   l_i = weight_soft_loss D_i + weight_hard_loss hard_i, over the tokens whose target is not ignore_index
 *   mean: loss = sum_i l_i / count;  sum: sum_i l_i;  none: per_token_loss_i = l_i (0 for ignored tokens).
 * No temperature^2 factor (neither TRL nor Liger applies one). If every token is ignored the loss is 0 and
 * every gradient is 0.
 *
 * Top-k (0 < top_k < V): TRL's generalized_jsd_loss(top_k, add_tail) (IWOPDTrainer in
 * trl/experimental/iw_opd/iw_opd_trainer.py, TRL 1.16.0). D_i is the divergence over a support S_i per token: the
 * teacher's top_k largest t for forward_kl (and jsd at beta 0), the student's top_k largest s for reverse_kl (jsd at
 * beta 1), their union for jsd. With log p and log q over the whole vocabulary:
 *   without the tail: xs_j = log p_j - logsumexp_S(log p), xt_j = log q_j - logsumexp_S(log q), j in S;
 *   with the tail:    xs_j = log p_j, xt_j = log q_j on S, and one more entry on each side,
 *                     tail = log(1 - exp(min(logsumexp_S(.), -1e-7)));
 *   D_i = the divergence above with p = exp(xs), q = exp(xt) over those entries.
 * The selection reads the fp32 tempered logits (ties to the lower id) and carries no gradient. top_k >= V is the
 * whole vocabulary (no tail), as TRL. The row work is O(V log top_k); the GEMMs are the full head's.
 * ------------------------------------------------------------------------------------------- */
/* The largest k of the top-k heads (fh_distill_options.top_k, fh_topk_teacher.k). */
#define FH_DISTILL_TOPK_MAX_K 1024

typedef enum fh_divergence {
    FH_DIVERGENCE_FORWARD_KL = 0,
    FH_DIVERGENCE_REVERSE_KL = 1,
    FH_DIVERGENCE_JSD = 2
} fh_divergence;

typedef struct fh_distill_options { /* defaults from fh_distill_options_init (Liger's and TRL's) */
    fh_divergence divergence;       /* jsd */
    double beta;                    /* jsd's mixture weight, in [0, 1]: 0.5 */
    double temperature;             /* 1.0; > 0 */
    double weight_soft_loss;        /* 1.0; >= 0 */
    double weight_hard_loss;        /* 0.0; >= 0 (needs targets) */
    int64_t ignore_index;           /* -100 */
    fh_reduction reduction;         /* mean */
    int64_t top_k;                  /* 0 (or >= V): the whole vocabulary; else at most FH_DISTILL_TOPK_MAX_K */
    int add_tail;                   /* 1 (TRL's add_tail); 0 or 1, read when 0 < top_k < V */
} fh_distill_options;

FH_API fh_status fh_distill_options_init(fh_distill_options *options);

typedef struct fh_distill_outputs { /* any may be NULL, except per_token_loss for 'none' */
    double *loss;
    double *soft_loss;              /* the divergence part of loss, reduced like it, before weight_soft_loss */
    double *hard_loss;              /* the cross-entropy part, reduced like it, before weight_hard_loss (also
                                       when that weight is 0; 0 without targets) */
    float *per_token_loss;          /* [N] l_i */
} fh_distill_outputs;

/* The loss only: both passes stream tiles of the two heads' logits (jsd streams them twice: its mixture needs
 * both log-sum-exps first). targets may be NULL when weight_hard_loss is 0 (every token counts); otherwise
 * each is in [0, V) or ignore_index. */
FH_API fh_status fh_distill_forward(fh_context *ctx, const fh_linear *student, const fh_linear *teacher,
                                    const int64_t *targets, const fh_distill_options *options,
                                    fh_distill_outputs *out);

/* Loss and the student's gradients in one call (grad_output: one value for mean and sum, N for none). Row
 * blocks (at most 224 rows) of both heads' logits across the whole vocabulary (2 N (H_s + H_t) V + 4 N H_s V flops); when the
 * memory budget cannot hold a block it streams instead (the forward, then the backward recomputing both
 * tiles); the results are the same either way. Gradient filtering does not apply to this head. */
FH_API fh_status fh_distill_forward_backward(fh_context *ctx, const fh_linear *student, const fh_linear *teacher,
                                             const int64_t *targets, const fh_distill_options *options,
                                             const float *grad_output, fh_distill_outputs *out,
                                             fh_linear_grads *grads);

/* Workspace bytes the distillation calls need with these options (pure; top-k keeps n x 2 x top_k entries of
 * the supports besides the tiles). */
FH_API fh_status fh_distill_workspace_size(const fh_context *ctx, const fh_linear *student,
                                           const fh_linear *teacher, const fh_distill_options *options,
                                           size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * Top-k teacher distillation: the teacher given per token as k token ids and log-probs (what a vLLM server
 * returns), no teacher head. TRL's ServerDistillationTrainer._compute_server_forward_kl_loss (loss_top_k,
 * loss_add_tail; trl/experimental/server_distillation/server_distillation_trainer.py at f2cd5771): the forward
 * KL over the teacher's support. Per counted token i, with S its valid entries (log-prob > -inf; an entry with
 * log-prob -inf is padding, as TRL's fill, and its id is not read), a_k the teacher's log-probs as given (the
 * server applied its temperature; only the student is tempered):
 *
 *   s = (x W + b) / temperature,  log p = log_softmax(s) over the whole vocabulary
 *   without the tail: xs_k = log p[id_k] - logsumexp_S(log p[id]),  xt_k = a_k - logsumexp_S(a)
 *   with the tail:    xs_k = log p[id_k], xt_k = a_k, and one more entry on each side:
 *                     tail = log(1 - exp(min(logsumexp_S(.), -1e-7)))
 *   D_i = sum over the entries (and the tail) of exp(xt) (xt - xs);  0 when S is empty
 *   hard_i, l_i and the reductions as fh_distill (hard on the untempered logits; mean over the counted tokens).
 * A token with no valid entry contributes 0 and is counted (TRL's batchmean). k = 1 without the tail is exactly 0.
 * Each entry is its own support element: a repeated id counts twice (TRL's gather; vLLM's top-k has none).
 * TRL defines JSD and reverse KL on a server's teacher only on the support {teacher's top-1, sampled token},
 * which needs the teacher's log-prob of the target: not provided here.
 * ------------------------------------------------------------------------------------------- */
/* Refusals besides the distillation head's: a k outside [1, FH_DISTILL_TOPK_MAX_K], a log-prob NaN or +inf, or
 * add_tail not 0 or 1 (FH_ERR_INVALID_DISTILL_OPTION); a valid entry's id outside [0, V)
 * (FH_ERR_TARGET_OUT_OF_RANGE). */

typedef struct fh_topk_teacher {
    int64_t k;                      /* entries per token, 1 .. FH_DISTILL_TOPK_MAX_K */
    const int64_t *ids;             /* [N, k] token ids in [0, V) where the log-prob is > -inf */
    const float *logprobs;          /* [N, k] finite, or -inf for a padded entry */
} fh_topk_teacher;

typedef struct fh_distill_topk_options { /* defaults from fh_distill_topk_options_init (TRL's) */
    int add_tail;                   /* 1 (loss_add_tail) */
    double temperature;             /* 1.0; > 0, the student's */
    double weight_soft_loss;        /* 1.0; >= 0 */
    double weight_hard_loss;        /* 0.0; >= 0 (needs targets) */
    int64_t ignore_index;           /* -100 */
    fh_reduction reduction;         /* mean */
} fh_distill_topk_options;

FH_API fh_status fh_distill_topk_options_init(fh_distill_topk_options *options);

/* The loss only (streams the student's tiles once). targets may be NULL when weight_hard_loss is 0 (every token
 * counts). */
FH_API fh_status fh_distill_topk_forward(fh_context *ctx, const fh_linear *student, const fh_topk_teacher *teacher,
                                         const int64_t *targets, const fh_distill_topk_options *options,
                                         fh_distill_outputs *out);

/* Loss and the student's gradients in one call: row blocks of the student's logits over the whole vocabulary
 * (6 N H V flops, the row work O(V + k)); streams when the budget cannot hold a block. Gradient filtering does
 * not apply to this head. */
FH_API fh_status fh_distill_topk_forward_backward(fh_context *ctx, const fh_linear *student,
                                                  const fh_topk_teacher *teacher, const int64_t *targets,
                                                  const fh_distill_topk_options *options, const float *grad_output,
                                                  fh_distill_outputs *out, fh_linear_grads *grads);

/* Workspace bytes the top-k distillation calls need (pure). */
FH_API fh_status fh_distill_topk_workspace_size(const fh_context *ctx, const fh_linear *student, size_t *bytes);

/* ---------------------------------------------------------------------------------------------
 * KTO: unpaired preference optimisation (TRL's KTOTrainer, loss_type "kto" and "apo_zero_unpaired"), one
 * micro-batch on one process.
 *
 *   B sequences of T tokens (rows s T ..), each desirable (labels[s] = 1) or undesirable (0). z = x W + bias;
 *   logp_t = log_softmax(z_t)[targets_t] (0 where masked and the target is outside [0, V)).
 *   l_s = sum_t m_t logp_t;  ref_s = ref_logps[s], or sum_t m_t ref_per_token_logps_t;  r_s = l_s - ref_s
 *   kl:  kto: the batch's KL term, given either as TRL uses it (kl, already clamped at 0), or as each sequence's
 *        KL log-ratio (kl_logratios: policy minus reference log-prob of its mismatched KL completion, e.g. from
 *        fh_logprob), from which the head forms TRL's max(mean_s kl_logratios_s, 0);  apo_zero_unpaired: 0
 *   kto:               desirable  1 - sig(beta (r_s - kl)),   undesirable  1 - sig(beta (kl - r_s))
 *   apo_zero_unpaired: desirable  1 - sig(beta r_s),          undesirable  sig(beta r_s)
 *   loss = (1 / B) sum_s w_s L_s,  w_s = desirable_weight or undesirable_weight;  rewards_s = beta r_s
 * Nothing is differentiated through the reference or the KL term; rewards and metrics carry no gradient.
 * TRL's KTO has no reference-free mode: one of the two reference inputs is required.
 * ------------------------------------------------------------------------------------------- */
typedef enum fh_kto_loss_type {
    FH_KTO_LOSS_KTO = 0,
    FH_KTO_LOSS_APO_ZERO_UNPAIRED = 1
} fh_kto_loss_type;

typedef struct fh_kto_options { /* TRL's KTOConfig names; defaults from fh_kto_options_init */
    fh_kto_loss_type loss_type; /* kto */
    double beta;                /* 0.1; > 0 */
    double desirable_weight;    /* 1.0; >= 0 */
    double undesirable_weight;  /* 1.0; >= 0 */
} fh_kto_options;

FH_API fh_status fh_kto_options_init(fh_kto_options *options);

typedef struct fh_kto_batch {
    int64_t batch, seq;                /* B, T; the fh_linear's n must be B T */
    const int64_t *targets;            /* [B, T], in [0, V) wherever the mask is non-zero */
    const float *mask;                 /* [B, T] completion mask, 0/1 (any finite value >= 0 weighs the token) */
    const uint8_t *labels;             /* [B] 1: desirable, 0: undesirable */
    const float *ref_logps;            /* [B] reference sequence log-probs; or NULL */
    const float *ref_per_token_logps;  /* [B, T] reference token log-probs, summed here under the mask; or NULL
                                          (exactly one of the two) */
    const float *kl;                   /* kto: one value, the KL term as TRL uses it (finite, >= 0); or NULL */
    const float *kl_logratios;         /* kto: [B] KL log-ratios (finite); or NULL (exactly one of kl and
                                          kl_logratios for kto; neither for apo_zero_unpaired) */
    const int64_t *cu_seqlens;         /* NULL: the rows are [B, T]. Else packed: [B + 1] offsets, as
                                          fh_grpo_batch's; seq must be 0 and every [B, T] array is [n] */
} fh_kto_batch;

typedef struct fh_kto_metrics { /* TRL's logged metrics (KTOTrainer without Liger); NaN where TRL logs nothing */
    double kl;                              /* the KL term used (0 for apo_zero_unpaired) */
    double rewards_chosen, rewards_rejected; /* means of beta r over the desirable / undesirable sequences */
    double rewards_margins;                 /* their difference, when the batch has both */
    double logps_chosen, logps_rejected;    /* means of l over the desirable / undesirable sequences */
    double logits_chosen, logits_rejected;  /* sum over the half's tokens with m != 0 of the mean of z over the
                                               vocabulary, divided by the half's sum of m; NaN when that is 0 */
    double entropy;                         /* sum_t m_t H_t / sum_t m_t over the batch (0 when the sum is 0) */
} fh_kto_metrics;

typedef struct fh_kto_outputs { /* any may be NULL */
    double *loss;
    fh_kto_metrics *metrics;
    float *sequence_logps;      /* [B] l */
    float *rewards;             /* [B] beta r */
    float *per_token_logp;      /* [B, T] */
} fh_kto_outputs;

FH_API fh_status fh_kto_forward(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *batch,
                                const fh_kto_options *options, fh_kto_outputs *out);

/* Forward and backward in one call (grad_output: one value, d(objective)/d(loss)). Row blocks of whole sequences
 * (6 N H V flops): a sequence's loss and its tokens' coefficients follow from the block's statistics, since the
 * KL term is an input. When the memory budget cannot hold one sequence's rows it streams both passes instead
 * (8 N H V flops); the results are the same either way. */
FH_API fh_status fh_kto_forward_backward(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *batch,
                                         const fh_kto_options *options, const float *grad_output,
                                         fh_kto_outputs *out, fh_linear_grads *grads);

/* Workspace bytes the KTO calls need (pure). */
FH_API fh_status fh_kto_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
