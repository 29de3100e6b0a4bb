/* The context object and the helpers every entry point uses to report errors. */
#ifndef FH_CONTEXT_H
#define FH_CONTEXT_H

#include "fusedhead.h"

#define FH_MESSAGE_CAPACITY 256
#define FH_WISDOM_CAPACITY 256
#define FH_PARAM_COUNT 10

struct fh_context {
    int64_t params[FH_PARAM_COUNT]; /* indexed by fh_param; 0 = default. The filter's two live in grad_filter_* */
    void *workspace;            /* caller's or ours */
    size_t workspace_bytes;
    int workspace_is_callers;
    size_t budget_held;         /* bytes a call holds outside the workspace, within the budget (fh_budget_hold) */
    char message[FH_MESSAGE_CAPACITY];
    fh_tile_config wisdom[FH_WISDOM_CAPACITY];
    int wisdom_count;
    double grad_filter_eps;                             /* FH_PARAM_GRAD_FILTER_EPS; 0 = off */
    fh_filter_tail grad_filter_tail;                    /* FH_PARAM_GRAD_FILTER_TAIL */
    fh_filter_stats filter_stats;                       /* the last call's, reset when it acquires its workspace */
    struct fh_gemm_cache *gemm_cache;                   /* the GEMM providers' state, NULL until needed */
    void (*gemm_cache_destroy)(struct fh_gemm_cache *); /* set by the plan layer with the first workspace */
};

/* Records a formatted message on ctx (if not NULL) and returns status, so that checks read
 * `return fh_fail(ctx, FH_ERR_..., "targets[%lld] = ...", ...)`. */
fh_status fh_fail(fh_context *ctx, fh_status status, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

/* Clears the message at the start of an entry point. */
void fh_clear_message(fh_context *ctx);

/* Effective values of the parameters (defaults resolved). Threads: the parameter when set, else
 * OpenMP's default (OMP_NUM_THREADS or all processors), except 1 for problems too small to amortise a
 * parallel region; at most the CPUs available unless FH_PARAM_OVERSUBSCRIBE. */
int fh_threads(const fh_context *ctx, const fh_linear *lin);
/* The memory budget less what the running call holds (fh_budget_hold): what its plans may take. */
int64_t fh_budget_bytes(const fh_context *ctx);

/* Counts bytes that a call allocates outside the workspace (the counted rows' copies) against the budget until
 * fh_budget_release, so that they and the workspace stay within it together: the context's own workspace, kept
 * from earlier calls, is freed first when it is larger than the rest of the budget (the call's plan, made for that
 * rest, allocates again what it needs). The caller keeps bytes at most the budget. */
void fh_budget_hold(fh_context *ctx, size_t bytes);
void fh_budget_release(fh_context *ctx, size_t bytes);

/* Returns a workspace of at least `bytes`: the caller's (FH_ERR_WORKSPACE_TOO_SMALL if short) or the
 * context's own, grown (and kept for reuse) when needed; the old one is freed before the new one is allocated when
 * the two together would pass the budget. */
fh_status fh_acquire_workspace(fh_context *ctx, size_t bytes, void **workspace);

#endif
