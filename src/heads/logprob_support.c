/* Log-probs over a support (fusedhead.h, "Log-probs over a support"): the checks of a support, its rows compacted
 * (the entries of the counted rows, padding dropped, each target's entry found), and the per-row math on the
 * engine's column logits through the row kernels that fold and differentiate the full head's tiles. The pass
 * (fh_support_pass, logprob_head.h) serves the log-prob head here and the GRPO head's support form. */
#include "logprob_head.h"

#include "core/linear.h"

#include <math.h>
#include <string.h>

/* Workspace threads: those of a call whose GEMMs would make entries x H multiply-adds. */
static int support_threads(const fh_context *ctx, const fh_linear *lin, int64_t entries)
{
    fh_linear work = *lin;
    work.n = 1;
    work.vocab = entries > 0 ? entries : 1;
    return fh_threads(ctx, &work);
}

static size_t round8(size_t bytes)
{
    return (bytes + 7) / 8 * 8;
}

/* The support's shape: pointers, k, offsets from 0 and non-decreasing; entries written. */
static fh_status check_support_shape(fh_context *ctx, const fh_linear *lin, const fh_support *s, int64_t *entries)
{
    if (!s || !s->ids)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !s ? "support" : "support->ids");
    if (!s->offsets) {
        if (s->k < 1)
            return fh_fail(ctx, FH_ERR_INVALID_SUPPORT,
                           "support->k = %lld: a padded support (offsets NULL) has at least one entry per row",
                           (long long)s->k);
        int64_t total;
        if (__builtin_mul_overflow(lin->n, s->k, &total) || total > INT64_MAX / 16)
            return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "the padded support's N x k = %lld x %lld entries overflow a size",
                           (long long)lin->n, (long long)s->k);
        *entries = total;
        return FH_OK;
    }
    if (s->offsets[0] != 0)
        return fh_fail(ctx, FH_ERR_INVALID_SUPPORT, "support->offsets[0] = %lld: CSR offsets start at 0",
                       (long long)s->offsets[0]);
    for (int64_t i = 0; i < lin->n; i++)
        if (s->offsets[i + 1] < s->offsets[i])
            return fh_fail(ctx, FH_ERR_INVALID_SUPPORT,
                           "support->offsets[%lld] = %lld < offsets[%lld] = %lld: row %lld would have a negative "
                           "number of ids",
                           (long long)(i + 1), (long long)s->offsets[i + 1], (long long)i, (long long)s->offsets[i],
                           (long long)i);
    if (s->offsets[lin->n] > INT64_MAX / 16)
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "the support's %lld entries overflow a size",
                       (long long)s->offsets[lin->n]);
    *entries = s->offsets[lin->n];
    return FH_OK;
}

/* The workspace: the compacted rows (begin [n + 1], ids, each row's target entry [n]), the entries' logits, the
 * duplicate check's marks [the whole vocabulary], the per-token slots (FH_WORKSPACE_SLOTS x n doubles) and the
 * engine's scratch. */
static size_t workspace_bytes(const fh_context *ctx, const fh_linear *lin, int64_t entries, int64_t total_vocab)
{
    const size_t n = (size_t)lin->n, e = (size_t)entries;
    const size_t scratch = fh_engine_column_scratch_floats(lin, entries, support_threads(ctx, lin, entries));
    return (n + 1) * 8 + e * 8 + n * 8 + round8(e * 4) + round8((size_t)total_vocab) + FH_WORKSPACE_SLOTS * n * 8 +
           scratch * 4;
}

static void carve(void *base, const fh_linear *lin, int64_t entries, int64_t total_vocab, fh_support_pass *p)
{
    const size_t n = (size_t)lin->n, e = (size_t)entries;
    char *at = base;
    p->begin = (int64_t *)at;
    at += (n + 1) * 8;
    p->ids = (int64_t *)at;
    at += e * 8;
    p->target = (int64_t *)at;
    at += n * 8;
    p->z = (float *)at;
    at += round8(e * 4);
    p->seen = (unsigned char *)at;
    at += round8((size_t)total_vocab);
    memset(&p->ws, 0, sizeof p->ws);
    for (int k = 0; k < FH_WORKSPACE_SLOTS; k++, at += n * 8)
        p->ws.slot[k] = (double *)at;
    p->scratch = (float *)at;
}

static int counted(const fh_support_rows *rows, int64_t i)
{
    return rows->mask ? rows->mask[i] != 0.0f : rows->targets[i] != rows->ignore_index;
}

/* Compacts the support into p (the counted rows' ids in lin's columns, padding dropped, as lin's column indices)
 * while checking every row's ids: in [0, total_vocab) (padded: or -1), none twice, a counted row's target among
 * them (in whichever shard). */
static fh_status compact(fh_context *ctx, const fh_support *s, int64_t first_column, int64_t total_vocab,
                         fh_support_pass *p)
{
    const fh_linear *lin = p->lin;
    memset(p->seen, 0, (size_t)total_vocab);
    int64_t kept = 0;
    for (int64_t i = 0; i < lin->n; i++) {
        const int64_t first = s->offsets ? s->offsets[i] : i * s->k, end = s->offsets ? s->offsets[i + 1] : first + s->k;
        const int row_counts = counted(&p->rows, i);
        p->begin[i] = kept;
        p->target[i] = -1;
        int target_found = 0;
        fh_status st = FH_OK;
        int64_t e = first;
        for (; e < end; e++) {
            const int64_t id = s->ids[e];
            if (!s->offsets && id == -1)
                continue;
            if (id < 0 || id >= total_vocab) {
                st = fh_fail(ctx, FH_ERR_INVALID_SUPPORT, "support->ids[%lld] = %lld (row %lld) is outside [0, %lld)%s",
                             (long long)e, (long long)id, (long long)i, (long long)total_vocab,
                             s->offsets ? "" : " and is not -1 (padding)");
                break;
            }
            if (p->seen[id]) {
                st = fh_fail(ctx, FH_ERR_INVALID_SUPPORT,
                             "support->ids[%lld] = %lld: row %lld lists it twice (a support is a set)", (long long)e,
                             (long long)id, (long long)i);
                break;
            }
            p->seen[id] = 1;
            const int64_t column = id - first_column;
            target_found |= row_counts && id == p->rows.targets[i];
            if (row_counts && column >= 0 && column < lin->vocab) {
                if (id == p->rows.targets[i])
                    p->target[i] = kept - p->begin[i];
                p->ids[kept++] = column;
            }
        }
        for (int64_t f = first; f < e; f++)
            if (s->ids[f] >= 0)
                p->seen[s->ids[f]] = 0;
        if (st == FH_OK && row_counts && !target_found)
            st = fh_fail(ctx, FH_ERR_INVALID_SUPPORT,
                         "row %lld: its target %lld is not in its support (%lld ids); the sampled token is in the "
                         "sampler's kept set",
                         (long long)i, (long long)p->rows.targets[i], (long long)(end - first));
        if (st != FH_OK)
            return st;
    }
    p->begin[lin->n] = kept;
    return FH_OK;
}

fh_status fh_support_pass_begin(fh_context *ctx, const fh_linear *lin, fh_support_rows rows, const fh_support *support,
                                fh_transform tf, const fh_linear_grads *grads, const fh_buffer *outputs,
                                int output_count, fh_support_pass *p)
{
    return fh_support_pass_begin_shard(ctx, lin, rows, support, 0, lin->vocab, tf, grads, outputs, output_count, p);
}

fh_status fh_support_pass_begin_shard(fh_context *ctx, const fh_linear *lin, fh_support_rows rows,
                                      const fh_support *support, int64_t first_column, int64_t total_vocab,
                                      fh_transform tf, const fh_linear_grads *grads, const fh_buffer *outputs,
                                      int output_count, fh_support_pass *p)
{
    int64_t entries = 0;
    fh_status st = check_support_shape(ctx, lin, support, &entries);
    const size_t bytes = st == FH_OK ? workspace_bytes(ctx, lin, entries, total_vocab) : 0;
    if (st == FH_OK && (int64_t)bytes > fh_budget_bytes(ctx))
        st = fh_fail(ctx, FH_ERR_BUDGET_TOO_SMALL,
                     "a support of %lld entries over %lld tokens needs %zu bytes of workspace; the memory budget is "
                     "%lld",
                     (long long)entries, (long long)lin->n, bytes, (long long)fh_budget_bytes(ctx));
    const fh_buffer inputs[] = {
        {"support->ids", support ? support->ids : NULL, (size_t)entries * sizeof(int64_t)},
        {"support->offsets", support ? support->offsets : NULL, ((size_t)lin->n + 1) * sizeof(int64_t)}};
    if (st == FH_OK)
        st = fh_check_apart(ctx, lin, grads, outputs, output_count, inputs, 2);
    void *base = NULL;
    if (st == FH_OK)
        st = fh_acquire_workspace(ctx, bytes, &base);
    if (st != FH_OK)
        return st;
    p->lin = lin;
    p->rows = rows;
    p->tf = tf;
    carve(base, lin, entries, total_vocab, p);
    st = compact(ctx, support, first_column, total_vocab, p);
    if (st != FH_OK)
        return st;
    p->threads = support_threads(ctx, lin, p->begin[lin->n]);
    const fh_row_columns columns = {p->begin, p->ids};
    fh_engine_column_logits(lin, &columns, tf, p->threads, p->scratch, p->z);
    return FH_OK;
}

fh_token_stats fh_support_pass_fold(const fh_support_pass *p, int entropy)
{
    const fh_token_stats s = fh_logprob_stats_in(&p->ws, 1);
    for (int64_t i = 0; i < p->lin->n; i++) {
        const int64_t e0 = p->begin[i], count = p->begin[i + 1] - e0;
        double lse = 0.0, sum_pz = 0.0, z_target = 0.0, sum_exp = 1.0;
        if (counted(&p->rows, i)) {
            fh_fold_state st = fh_fold_state_initial();
            const fh_fold_request request = {NULL, 0, entropy, 0, NULL};
            fh_row_fold(p->z + e0, count, 0, p->target[i], &request, &st);
            sum_exp = st.sum_exp;
            lse = count > 0 ? st.max + log(st.sum_exp) : -INFINITY; /* no entry in this shard */
            sum_pz = count > 0 && entropy ? st.sum_z_exp / st.sum_exp : 0.0;
            z_target = p->target[i] >= 0 ? st.z_target : 0.0;
        }
        s.lse[i] = lse;
        s.sum_pz[i] = sum_pz;
        s.z_target[i] = z_target;
        s.sum_exp[i] = sum_exp;
    }
    return s;
}

void fh_support_pass_finish_values(const fh_support_pass *p, int entropy)
{
    double *const *slot = p->ws.slot;
    const fh_token_stats s = fh_logprob_stats_in(&p->ws, 1);
    for (int64_t i = 0; i < p->lin->n; i++) {
        const int row_counts = counted(&p->rows, i);
        const double lse = row_counts ? s.lse[i] : 0.0;
        s.sum_pz[i] = row_counts && entropy ? s.sum_pz[i] : lse;
        slot[FH_LOGPROB_SLOT_LSE][i] = lse;
        slot[FH_LOGPROB_SLOT_LOGP][i] = row_counts ? s.z_target[i] - lse : 0.0;
        slot[FH_LOGPROB_SLOT_ENTROPY][i] = lse - s.sum_pz[i];
    }
}

void fh_support_pass_values(const fh_support_pass *p, int entropy)
{
    (void)fh_support_pass_fold(p, entropy);
    fh_support_pass_finish_values(p, entropy);
}

void fh_support_pass_gradients(fh_support_pass *p, const fh_coef_arrays *coefs, const fh_linear_grads *grads)
{
    /* dU of every entry in place of its logit: the full head's row gradient on the row's entries (dU stays f32: no
     * GEMM takes it). */
    for (int64_t i = 0; i < p->lin->n; i++) {
        if (!counted(&p->rows, i))
            continue;
        const fh_coef k = {coefs->lse[i], coefs->a[i], coefs->b[i], coefs->c[i], coefs->e ? coefs->e[i] : 0.0,
                           coefs->sum_pz ? coefs->sum_pz[i] : 0.0, 0.0};
        fh_row_gradient(p->z + p->begin[i], p->begin[i + 1] - p->begin[i], p->target[i], NULL, &k, &p->tf, NULL);
    }
    const fh_row_columns columns = {p->begin, p->ids};
    fh_engine_column_gradients(p->lin, &columns, p->z, grads, p->threads, p->scratch);
}

/* ---- fh_logprob_support_* ---- */

/* One call after its checks: the outputs (forward) or what the forward saved (backward), and the gradients. */
typedef struct support_call {
    const fh_linear *lin;
    const int64_t *targets;
    const fh_support *support;
    const fh_logprob_options *options;
    const float *lse, *entropy; /* backward: what the forward saved, or NULL */
    fh_logprob_grads g;
    fh_logprob_outputs out;
    int gradients;                /* a backward or the single call: grads required */
    const fh_linear_grads *grads;
} support_call;

static fh_status run(fh_context *ctx, const support_call *c)
{
    const fh_linear *lin = c->lin;
    fh_transform tf;
    fh_status st = fh_logprob_check_call(ctx, lin, c->targets, c->options, 0, &tf);
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, c->targets, c->lse, c->entropy, &c->g, &c->out, c->gradients,
                                       c->grads, NULL, NULL);
    if (st != FH_OK)
        return st;
    const fh_logprob_rows rows = {c->targets, c->options->ignore_index};
    const fh_support_rows support_rows = {c->targets, c->options->ignore_index, NULL};
    const size_t floats = (size_t)lin->n * sizeof(float);
    const fh_buffer outputs[] = {{"logp", c->out.logp, floats}, {"entropy", c->out.entropy, floats},
                                 {"lse", c->out.lse, floats}};
    fh_support_pass p;
    st = fh_support_pass_begin(ctx, lin, support_rows, c->support, tf, c->grads, outputs, 3, &p);
    if (st != FH_OK)
        return st;
    if (c->lse)
        fh_logprob_load_saved(&p.ws, lin->n, NULL, c->lse, c->entropy);
    else
        fh_support_pass_values(&p, c->out.entropy != NULL || c->g.entropy != NULL);
    fh_logprob_write_outputs(&p.ws, lin->n, rows, c->out.logp, c->out.entropy, c->out.lse);
    if (!c->gradients)
        return FH_OK;
    const fh_coef_arrays coefs = fh_logprob_coefs_in(&p.ws, lin->n, &c->g, rows);
    fh_support_pass_gradients(&p, &coefs, c->grads);
    return FH_OK;
}

FH_API fh_status fh_logprob_support_forward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                            const fh_support *support, const fh_logprob_options *options,
                                            fh_logprob_outputs *out)
{
    if (ctx && !out)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    support_call c = {.lin = lin, .targets = targets, .support = support, .options = options};
    if (out)
        c.out = *out;
    return run(ctx, &c);
}

FH_API fh_status fh_logprob_support_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                             const fh_support *support, const fh_logprob_options *options,
                                             const float *lse, const float *entropy, const float *g_logp,
                                             const float *g_entropy, const float *g_lse, fh_linear_grads *grads)
{
    if (ctx && (!lse || (g_entropy && !entropy)))
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lse ? "lse" : "entropy (g_entropy is given)");
    const support_call c = {.lin = lin,  .targets = targets, .support = support, .options = options, .lse = lse,
                            .entropy = g_entropy ? entropy : NULL, .g = {g_logp, g_entropy, g_lse}, .gradients = 1,
                            .grads = grads};
    return run(ctx, &c);
}

FH_API fh_status fh_logprob_support_forward_backward(fh_context *ctx, const fh_linear *lin, const int64_t *targets,
                                                     const fh_support *support, const fh_logprob_options *options,
                                                     const float *g_logp, const float *g_entropy, const float *g_lse,
                                                     fh_logprob_outputs *out, fh_linear_grads *grads)
{
    if (ctx && !out)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    support_call c = {.lin = lin, .targets = targets, .support = support, .options = options,
                      .g = {g_logp, g_entropy, g_lse}, .gradients = 1, .grads = grads};
    if (out)
        c.out = *out;
    return run(ctx, &c);
}

fh_status fh_support_workspace_size(const fh_context *ctx, const fh_linear *lin, const fh_support *support,
                                    size_t *bytes)
{
    if (!ctx || !lin || !bytes)
        return FH_ERR_NULL_POINTER;
    fh_status st = fh_check_linear(NULL, lin);
    int64_t entries = 0;
    if (st == FH_OK)
        st = check_support_shape(NULL, lin, support, &entries);
    const size_t needed = st == FH_OK ? workspace_bytes(ctx, lin, entries, lin->vocab) : 0;
    if (st == FH_OK && (int64_t)needed > fh_budget_bytes(ctx))
        st = FH_ERR_BUDGET_TOO_SMALL;
    if (st == FH_OK)
        *bytes = needed;
    return st;
}

FH_API fh_status fh_logprob_support_workspace_size(const fh_context *ctx, const fh_linear *lin,
                                                   const fh_support *support, size_t *bytes)
{
    return fh_support_workspace_size(ctx, lin, support, bytes);
}
