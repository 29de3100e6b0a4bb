/* Log-prob head: per-token log-probs, entropies and log-sum-exps of a tempered head, and the gradients back from
 * upstream gradients of each (formulas in fusedhead.h). The shared pieces (slots, token values) serve the GRPO and
 * KTO heads too. The engine does every tile; this file is checks and [N] vectors. */
#include "logprob_head.h"

#include "counted_rows.h"
#include "core/linear.h"

#include <math.h>
#include <string.h>

FH_API fh_status fh_logprob_options_init(fh_logprob_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_logprob_options defaults = {-100, 1.0, 0.0, 1.0};
    *options = defaults;
    return FH_OK;
}

fh_engine_pass fh_logprob_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids,
                               fh_transform tf)
{
    const fh_engine_pass p = {.plan = plan, .ws = ws, .lin = lin, .tf = tf, .targets = ids};
    return p;
}

fh_token_stats fh_logprob_stats_in(const fh_workspace *ws, int entropy)
{
    double *const *slot = ws->slot;
    const fh_token_stats stats = {slot[FH_LOGPROB_SLOT_LSE],
                                  slot[FH_LOGPROB_SLOT_Z_TARGET_THEN_A],
                                  NULL,
                                  entropy ? slot[FH_LOGPROB_SLOT_SUM_PZ] : NULL,
                                  slot[FH_LOGPROB_SLOT_SUM_EXP_THEN_C],
                                  NULL};
    return stats;
}

void fh_logprob_token_values(const fh_workspace *ws, const int64_t *ids, int64_t i0, int64_t i1, int64_t vocab,
                             int entropy)
{
    const fh_token_stats stats = fh_logprob_stats_in(ws, entropy);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t id = ids[i];
        ws->slot[FH_LOGPROB_SLOT_LOGP][i] = id >= 0 && id < vocab ? stats.z_target[i] - stats.lse[i] : 0.0;
        if (entropy)
            ws->slot[FH_LOGPROB_SLOT_ENTROPY][i] = stats.lse[i] - stats.sum_pz[i];
    }
}

void fh_logprob_load_saved(const fh_workspace *ws, int64_t n, const float *logp, const float *lse,
                           const float *entropy)
{
    double *const *slot = ws->slot;
    for (int64_t i = 0; i < n; i++) {
        slot[FH_LOGPROB_SLOT_LSE][i] = lse[i];
        if (logp)
            slot[FH_LOGPROB_SLOT_LOGP][i] = logp[i];
        slot[FH_LOGPROB_SLOT_ENTROPY][i] = entropy ? entropy[i] : 0.0;
        /* only used when e != 0 */
        slot[FH_LOGPROB_SLOT_SUM_PZ][i] = slot[FH_LOGPROB_SLOT_LSE][i] - slot[FH_LOGPROB_SLOT_ENTROPY][i];
    }
}

static int ignored(fh_logprob_rows rows, int64_t i)
{
    return rows.targets && rows.targets[i] == rows.ignore_index;
}

void fh_logprob_write_outputs(const fh_workspace *ws, int64_t n, fh_logprob_rows rows, float *logp, float *entropy,
                              float *lse)
{
    double *const *slot = ws->slot;
    for (int64_t i = 0; i < n; i++) {
        const int skip = ignored(rows, i);
        if (logp)
            logp[i] = skip ? 0.0f : (float)slot[FH_LOGPROB_SLOT_LOGP][i];
        if (entropy)
            entropy[i] = skip ? 0.0f : (float)slot[FH_LOGPROB_SLOT_ENTROPY][i];
        if (lse)
            lse[i] = skip ? 0.0f : (float)slot[FH_LOGPROB_SLOT_LSE][i];
    }
}

/* ---- fh_logprob_* ------------------------------------------------------------------------------ */

fh_status fh_logprob_check_call(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                const fh_logprob_options *o, int64_t target_vocab, fh_transform *tf)
{
    fh_status st = fh_check_call(ctx, lin);
    if (st == FH_OK && (!targets || !o))
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !targets ? "targets" : "options");
    if (st == FH_OK)
        st = fh_engine_transform(ctx, o->temperature, o->softcap, o->logit_scale, tf);
    if (st != FH_OK)
        return st;
    if (target_vocab <= 0)
        target_vocab = lin->vocab;
    return fh_check_targets(ctx, targets, lin->n, o->ignore_index, target_vocab);
}

fh_status fh_logprob_check_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                    const float *saved_lse, const float *saved_entropy, const fh_logprob_grads *g,
                                    const fh_logprob_outputs *out, int gradients, const fh_linear_grads *grads,
                                    const float *keep, const float *kept)
{
    const float *const arrays[3] = {g->logp, g->entropy, g->lse};
    static const char *const names[3] = {"g_logp", "g_entropy", "g_lse"};
    for (int k = 0; k < 3; k++)
        for (int64_t i = 0; arrays[k] && i < lin->n; i++)
            if (!isfinite(arrays[k][i]))
                return fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "%s[%lld] = %g is not finite", names[k], (long long)i,
                               (double)arrays[k][i]);
    if (gradients) {
        const fh_status st = fh_check_grads(ctx, lin, grads);
        if (st != FH_OK)
            return st;
    }
    const size_t n = (size_t)lin->n, floats = n * sizeof(float);
    size_t logits_bytes = 0;
    if ((keep || kept) && __builtin_mul_overflow(n * sizeof(float), (size_t)lin->vocab, &logits_bytes))
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "the kept logits, N x V = %lld x %lld floats, overflow a size",
                       (long long)lin->n, (long long)lin->vocab);
    const fh_buffer inputs[] = {{"targets", targets, n * sizeof(int64_t)},
                                {"the saved lse", saved_lse, floats},
                                {"the saved entropy", saved_entropy, floats},
                                {"g_logp", g->logp, floats},
                                {"g_entropy", g->entropy, floats},
                                {"g_lse", g->lse, floats},
                                {"the kept logits", kept, logits_bytes}};
    const fh_buffer outputs[] = {{"logp", out ? out->logp : NULL, floats},
                                 {"entropy", out ? out->entropy : NULL, floats},
                                 {"lse", out ? out->lse : NULL, floats},
                                 {"the kept logits", keep, logits_bytes}};
    return fh_check_apart(ctx, lin, grads, outputs, 4, inputs, 7);
}

void fh_logprob_coefficients(const fh_logprob_grads *g, fh_logprob_rows rows, int64_t i, fh_coef *k)
{
    k->a = k->b = k->c = k->e = 0.0;
    if (ignored(rows, i))
        return;
    const double g_logp = g->logp ? g->logp[i] : 0.0;
    k->a = (g->lse ? g->lse[i] : 0.0) - g_logp;
    k->b = g_logp;
    k->e = g->entropy ? -(double)g->entropy[i] : 0.0;
}

fh_coef_arrays fh_logprob_coefs_in(const fh_workspace *ws, int64_t n, const fh_logprob_grads *g,
                                   fh_logprob_rows rows)
{
    double *a = ws->slot[FH_LOGPROB_SLOT_Z_TARGET_THEN_A], *b = ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B],
           *c = ws->slot[FH_LOGPROB_SLOT_SUM_EXP_THEN_C], *e = ws->slot[FH_LOGPROB_SLOT_G_ENTROPY_THEN_E];
    for (int64_t i = 0; i < n; i++) {
        fh_coef k;
        fh_logprob_coefficients(g, rows, i, &k);
        a[i] = k.a;
        b[i] = k.b;
        c[i] = k.c;
        e[i] = k.e;
    }
    const fh_coef_arrays coefs = {ws->slot[FH_LOGPROB_SLOT_LSE], a, b, c, g->entropy ? e : NULL,
                                  ws->slot[FH_LOGPROB_SLOT_SUM_PZ]};
    return coefs;
}

FH_API fh_status fh_logprob_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_every_bytes(ctx, lin, bytes);
}

/* One fh_logprob_* call after its checks: what it computes (kind) and on what; the run functions below take it on the
 * whole problem or on its counted rows (run_counted). */
typedef struct logprob_call {
    fh_call kind; /* FH_CALL_TRAIN_STEP: the single-call train step */
    const fh_linear *lin;
    const int64_t *targets;
    fh_transform tf;
    fh_logprob_rows rows;
    const float *lse, *entropy; /* backward: what the forward saved */
    fh_logprob_grads g;         /* backward, train step */
    fh_logprob_outputs out;     /* forward, train step */
    const fh_linear_grads *grads;
    float *keep;                /* forward: the logits kept for a backward (fh_engine_pass's keep), or NULL */
    const float *kept;          /* backward: the logits a forward kept, or NULL */
    const int64_t *kept_rows;   /* the kept row of each of lin's rows (the counted rows'), or NULL: the same */
} logprob_call;

/* Streams the forward; leaves lse, sum_pz, logp and entropy (double) in the workspace. */
static fh_status forward_pass(const fh_plan *plan, const fh_workspace *ws, const logprob_call *c, int entropy)
{
    const fh_token_stats stats = fh_logprob_stats_in(ws, entropy);
    fh_engine_pass pass = fh_logprob_pass(plan, ws, c->lin, c->targets, c->tf);
    pass.stats = &stats;
    pass.keep = c->keep;
    pass.kept_rows = c->kept_rows;
    const fh_status st = fh_engine_forward(&pass);
    if (st == FH_OK)
        fh_logprob_token_values(ws, c->targets, 0, c->lin->n, c->lin->vocab, entropy);
    return st;
}

static fh_status run_forward(const void *self, const fh_plan *plan, const fh_workspace *ws)
{
    const logprob_call *c = self;
    const fh_status st = forward_pass(plan, ws, c, c->out.entropy != NULL);
    if (st == FH_OK)
        fh_logprob_write_outputs(ws, c->lin->n, c->rows, c->out.logp, c->out.entropy, c->out.lse);
    return st;
}

static fh_status run_backward(const void *self, const fh_plan *plan, const fh_workspace *ws)
{
    const logprob_call *c = self;
    fh_engine_pass pass = fh_logprob_pass(plan, ws, c->lin, c->targets, c->tf);
    pass.grads = c->grads;
    pass.kept = c->kept;
    pass.kept_rows = c->kept_rows;
    const fh_status st = fh_engine_prepare(&pass);
    if (st != FH_OK)
        return st;
    fh_logprob_load_saved(ws, c->lin->n, NULL, c->lse, c->entropy);
    const fh_coef_arrays coefs = fh_logprob_coefs_in(ws, c->lin->n, &c->g, c->rows);
    pass.coefs = &coefs;
    return fh_engine_backward(&pass);
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    const logprob_call *c = self;
    fh_logprob_coefficients(&c->g, c->rows, i, k);
}

static fh_status step_run(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                          const fh_linear_grads *grads)
{
    const logprob_call *c = self;
    const int entropy = c->out.entropy || c->g.entropy;
    fh_status st;
    if (row_blocks) {
        const fh_token_stats stats = fh_logprob_stats_in(&ws[0], entropy);
        const fh_coef_source source = {row_coefficients, NULL, c};
        fh_engine_pass pass = fh_logprob_pass(&plans[0], &ws[0], c->lin, c->targets, c->tf);
        pass.stats = &stats;
        pass.source = &source;
        pass.grads = grads;
        st = fh_engine_row_blocks(&pass);
        if (st == FH_OK)
            fh_logprob_token_values(&ws[0], c->targets, 0, c->lin->n, c->lin->vocab, entropy);
    } else {
        /* Streaming fallback: forward, then backward on the same plan (the pass holds grads, so the forward
         * prepares the backward's GEMMs too). The coefficients overwrite z_target and sum_exp, read by then. */
        const fh_token_stats stats = fh_logprob_stats_in(&ws[0], entropy);
        fh_engine_pass pass = fh_logprob_pass(&plans[0], &ws[0], c->lin, c->targets, c->tf);
        pass.stats = &stats;
        pass.grads = grads;
        st = fh_engine_forward(&pass);
        if (st == FH_OK) {
            fh_logprob_token_values(&ws[0], c->targets, 0, c->lin->n, c->lin->vocab, entropy);
            const fh_coef_arrays coefs = fh_logprob_coefs_in(&ws[0], c->lin->n, &c->g, c->rows);
            pass.coefs = &coefs;
            st = fh_engine_backward(&pass);
        }
    }
    if (st == FH_OK)
        fh_logprob_write_outputs(&ws[0], c->lin->n, c->rows, c->out.logp, c->out.entropy, c->out.lse);
    return st;
}

static fh_status run(fh_context *ctx, const void *self)
{
    static const fh_head_calls calls = {run_forward, run_backward, step_run};
    const logprob_call *c = self;
    return fh_engine_run_call(ctx, c->kind, &calls, c->lin, c->grads, c);
}

/* The call on its counted rows (counted_rows.h): ignored rows have outputs 0 and no gradient, so their GEMMs are
 * skipped. Its per-row arrays: lse, entropy and the three upstream gradients, then the three outputs. */
static fh_status run_on(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                        float *const *a, void *extra)
{
    (void)extra;
    const logprob_call *c = self;
    const logprob_call counted = {c->kind,          &rows->lin, targets, c->tf, {NULL, 0}, a[0], a[1],
                                  {a[2], a[3], a[4]}, {a[5], a[6], a[7]}, c->grads ? &rows->grads : NULL,
                                  c->keep,          c->kept,    rows->rows};
    return run(ctx, &counted);
}

static fh_status run_counted(fh_context *ctx, const logprob_call *c)
{
    const float *const in[] = {c->lse, c->entropy, c->g.logp, c->g.entropy, c->g.lse};
    float *const out[] = {c->out.logp, c->out.entropy, c->out.lse};
    const fh_counted_call call = {.lin = c->lin, .grads = c->grads, .filtered = c->grads != NULL,
                                  .targets = c->targets, .ignore_index = c->rows.ignore_index,
                                  .in = in, .inputs = 5, .out = out, .outputs = 3,
                                  .whole = run, .counted = run_on, .self = c};
    return fh_counted_rows_run(ctx, &call);
}

/* fh_logprob_forward and fh_logprob_forward_keep; keep (or NULL) gets the logits. */
static fh_status logprob_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                 const fh_logprob_options *options, fh_logprob_outputs *out, float *keep)
{
    fh_transform tf;
    fh_status st = fh_logprob_check_call(ctx, lin, targets, options, 0, &tf);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    const fh_logprob_grads none = {NULL, NULL, NULL};
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, targets, NULL, NULL, &none, out, 0, NULL, keep, NULL);
    if (st != FH_OK)
        return st;
    const logprob_call c = {FH_CALL_FORWARD, lin,  targets, tf,   {targets, options->ignore_index}, NULL, NULL, none,
                            *out,            NULL, keep,    NULL, NULL};
    st = run_counted(ctx, &c);
    /* Ignored rows kept as 0: a backward that runs on every row (it may compact the rows where this forward did not,
     * or not where it did) reads finite logits there, whose gradient coefficients are 0. */
    for (int64_t i = 0; st == FH_OK && keep && i < lin->n; i++)
        if (targets[i] == options->ignore_index)
            memset(keep + (size_t)i * (size_t)lin->vocab, 0, (size_t)lin->vocab * sizeof(float));
    return st;
}

FH_API fh_status fh_logprob_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                    const fh_logprob_options *options, fh_logprob_outputs *out)
{
    return logprob_forward(ctx, lin, targets, options, out, NULL);
}

FH_API fh_status fh_logprob_forward_keep(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                         const fh_logprob_options *options, fh_logprob_outputs *out, float *logits)
{
    if (ctx && !logits)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "logits is NULL");
    return logprob_forward(ctx, lin, targets, options, out, logits);
}

/* fh_logprob_backward and fh_logprob_backward_kept; kept (or NULL) has the logits. */
static fh_status logprob_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                  const fh_logprob_options *options, const float *kept, const float *lse,
                                  const float *entropy, const float *g_logp, const float *g_entropy,
                                  const float *g_lse, fh_linear_grads *grads)
{
    fh_transform tf;
    fh_status st = fh_logprob_check_call(ctx, lin, targets, options, 0, &tf);
    if (st == FH_OK && (!lse || (g_entropy && !entropy)))
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lse ? "lse" : "entropy (g_entropy is given)");
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, targets, lse, entropy, &g, NULL, 1, grads, NULL, kept);
    if (st != FH_OK)
        return st;
    const logprob_call c = {FH_CALL_BACKWARD, lin,  targets, tf,   {targets, options->ignore_index},
                            lse,              g_entropy ? entropy : NULL, g, {NULL, NULL, NULL},
                            grads,            NULL, kept,    NULL};
    return run_counted(ctx, &c);
}

FH_API fh_status fh_logprob_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                     const fh_logprob_options *options, const float *lse, const float *entropy,
                                     const float *g_logp, const float *g_entropy, const float *g_lse,
                                     fh_linear_grads *grads)
{
    return logprob_backward(ctx, lin, targets, options, NULL, lse, entropy, g_logp, g_entropy, g_lse, grads);
}

FH_API fh_status fh_logprob_backward_kept(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                          const fh_logprob_options *options, const float *logits, const float *lse,
                                          const float *entropy, const float *g_logp, const float *g_entropy,
                                          const float *g_lse, fh_linear_grads *grads)
{
    if (ctx && !logits)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "logits is NULL");
    return logprob_backward(ctx, lin, targets, options, logits, lse, entropy, g_logp, g_entropy, g_lse, grads);
}

FH_API fh_status fh_logprob_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                             const fh_logprob_options *options, const float *g_logp,
                                             const float *g_entropy, const float *g_lse, fh_logprob_outputs *out,
                                             fh_linear_grads *grads)
{
    fh_transform tf;
    fh_status st = fh_logprob_check_call(ctx, lin, targets, options, 0, &tf);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, targets, NULL, NULL, &g, out, 1, grads, NULL, NULL);
    if (st != FH_OK)
        return st;
    const logprob_call c = {FH_CALL_TRAIN_STEP, lin, targets, tf, {targets, options->ignore_index}, NULL, NULL, g, *out,
                            grads, NULL, NULL, NULL};
    return run_counted(ctx, &c);
}
