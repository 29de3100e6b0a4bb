/* What every fh_parallel_* entry point shares: the prologue, the per-call scratch, agreement on errors across
 * the grid (every rank makes the same collective calls whatever failed locally, and learns the outcome
 * from reduced values, so that all of them return the same status), and the failure path. */
#include "parallel_internal.h"

#include "core/context.h"

#include <stdio.h>
#include <string.h>

fh_status fhp_call_start(fhp_call *c, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin, int entry,
                         fhp_pass_fn pass, const void *head)
{
    memset(c, 0, sizeof *c);
    c->pass = pass;
    c->head = head;
    /* A NULL context still joins the agreement (fhp_call_agree), so that every rank fails; a NULL layout cannot: it
     * holds the groups. */
    c->L = L;
    c->ctx = ctx;
    if (!ctx || !L)
        return FH_ERR_NULL_POINTER;
    c->lin = lin;
    fhp_call_config(c, "the entry point", entry);
    fhp_call_config(c, "the stats collective", L->params[FH_PARALLEL_PARAM_STATS_COLLECTIVE]);
    fhp_call_config(c, "the dx reduction", L->params[FH_PARALLEL_PARAM_DX_REDUCTION]);
    fhp_call_config(c, "the dweight reduction", L->params[FH_PARALLEL_PARAM_DWEIGHT_REDUCTION]);
    if (lin) {
        fhp_call_config(c, "the hidden size", lin->hidden);
        fhp_call_config(c, "x's dtype", lin->x_dtype);
        fhp_call_config(c, "the weight's dtype", lin->weight_dtype);
        fhp_call_config(c, "a bias given", lin->bias != NULL);
    }
    return FH_OK;
}

/* Appends a value's exact encoding (bits) of the given kind and scope. */
static void add(fhp_call *c, const char *name, uint64_t bits, unsigned char kind, unsigned char vocab_only)
{
    fhp_config *k = &c->config;
    if (k->count == FHP_CONFIG_MAX) /* a programming error: the tests' mismatch cases would miss a value */
        return;
    k->names[k->count] = name;
    k->kind[k->count] = kind;
    k->vocab_only[k->count] = vocab_only;
    k->bits[k->count++] = bits;
}

void fhp_call_config(fhp_call *c, const char *name, int64_t value)
{
    add(c, name, (uint64_t)value, FHP_INTEGER, 0);
}

void fhp_call_config_vocab(fhp_call *c, const char *name, int64_t value)
{
    add(c, name, (uint64_t)value, FHP_INTEGER, 1);
}

void fhp_call_config_real(fhp_call *c, const char *name, double value)
{
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    add(c, name, bits, FHP_DOUBLE, 0);
}

void fhp_call_config_float(fhp_call *c, const char *name, float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    add(c, name, bits, FHP_FLOAT, 0);
}

void fhp_call_config_grads(fhp_call *c, const fh_linear_grads *grads)
{
    fhp_call_config(c, "dx asked for", grads && grads->dx);
    fhp_call_config(c, "dweight asked for", grads && grads->dweight);
    fhp_call_config(c, "dbias asked for", grads && grads->dbias);
    if (grads)
        fhp_call_config(c, "the gradients' dtypes",
                        grads->dx_dtype * 9 + grads->dweight_dtype * 3 + grads->dbias_dtype);
}

static size_t round_up_64(size_t bytes)
{
    return (bytes + 63) / 64 * 64;
}

fh_status fhp_call_scratch(fhp_call *c, const int64_t *ids, size_t head_bytes)
{
    fh_status st = fhp_check_shard(c->L, c->ctx, c->lin);
    if (st != FH_OK)
        return st;
    const int64_t n = c->lin->n;
    const size_t local_bytes = round_up_64((size_t)n * sizeof(int64_t)), head = round_up_64(head_bytes);
    char *scratch = NULL;
    st = fhp_scratch(c->L, c->ctx, local_bytes + head + fhp_combine_bytes(c->L, n), (void **)&scratch);
    if (st != FH_OK)
        return st;
    c->engine_ids = ids;
    c->local = (int64_t *)scratch;
    c->head_scratch = scratch + local_bytes;
    c->records = scratch + local_bytes + head;
    return FH_OK;
}

/* One value's encoding as the message shows it. */
static void show(const fhp_config *k, int i, uint64_t bits, char *text, size_t size)
{
    if (k->kind[i] == FHP_INTEGER) {
        snprintf(text, size, "%lld", (long long)(int64_t)bits);
    } else if (k->kind[i] == FHP_DOUBLE) {
        double v;
        memcpy(&v, &bits, sizeof v);
        snprintf(text, size, "%.17g (bits 0x%016llx)", v, (unsigned long long)bits);
    } else {
        const uint32_t b32 = (uint32_t)bits;
        float v;
        memcpy(&v, &b32, sizeof v);
        snprintf(text, size, "%.9g (bits 0x%08lx)", (double)v, (unsigned long)b32);
    }
}

/* "name: A on one rank, B on another" for the first value of the scope (vocab_only or not) whose encodings differ
 * across the ranks, into message; 0 when every one agrees. hi and not_lo: the maxima of every value's bits and of
 * their complements (~ of the minimum), the bits read as int64: no arithmetic on the encodings, so every bit pattern
 * (-0.0, a NaN's payload, INT64_MIN) is its own value. */
static int disagreement(const fhp_config *k, const uint64_t *hi, const uint64_t *not_lo, int vocab_only,
                        char *message, size_t size)
{
    for (int i = 0; i < k->count; i++) {
        const uint64_t lo = ~not_lo[i];
        if (k->vocab_only[i] != vocab_only || lo == hi[i])
            continue;
        char a[64], b[64];
        show(k, i, lo, a, sizeof a);
        show(k, i, hi[i], b, sizeof b);
        snprintf(message, size, "%s: %s on one rank, %s on another", k->names[i], a, b);
        return 1;
    }
    return 0;
}

/* fhp_call_agree without the cleanup. */
static fh_status agree(fh_parallel_layout *L, fh_context *ctx, fh_status st, int64_t n, const fhp_config *config)
{
    /* Over vocab, as maxima of the bits read as int64: the worst status, n and ~n, every configuration value's bits
     * and their complements (~max(~bits) is the minimum: the two differ unless every rank has the same bits); then the
     * verdict and the ranges over data. On a grid this reaches every rank; every rank reduces the same FHP_CONFIG_MAX
     * values (a failed rank's may be partial: they are compared only when every rank succeeded). The vocab_only values
     * (shapes of the tokens a vocab group shares) are compared over vocab only. */
    enum { K = FHP_CONFIG_MAX };
    uint64_t worst[3 + 2 * K] = {(uint64_t)st, (uint64_t)n, ~(uint64_t)n};
    for (int i = 0; i < K; i++) {
        worst[3 + i] = i < config->count ? config->bits[i] : 0;
        worst[3 + K + i] = ~worst[3 + i];
    }
    int err = 0;
    if (L->vocab.size > 1)
        err = L->vocab.allreduce(L->vocab.handle, worst, 3 + 2 * K, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MAX);
    if (err != 0)
        return fhp_group_error(ctx, &L->vocab, err, "the all-reduce of the agreement");
    char vocab_what[200];
    uint64_t verdict = worst[0];
    if (verdict == FH_OK && worst[1] != ~worst[2])
        verdict = FH_ERR_MPI_LAYOUT;
    else if (verdict == FH_OK && disagreement(config, worst + 3, worst + 3 + K, 1, vocab_what, sizeof vocab_what))
        verdict = FH_ERR_MPI_MISMATCH;
    uint64_t overall[1 + 2 * K];
    overall[0] = verdict;
    memcpy(overall + 1, worst + 3, 2 * K * sizeof(uint64_t));
    if (L->data.size > 1)
        err = L->data.allreduce(L->data.handle, overall, 1 + 2 * K, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MAX);
    if (err != 0)
        return fhp_group_error(ctx, &L->data, err, "the all-reduce of the agreement");
    if (st != FH_OK)
        return st;
    if (verdict == FH_ERR_MPI_LAYOUT && worst[0] == FH_OK)
        return fh_fail(ctx, FH_ERR_MPI_LAYOUT, "lin->n differs across the vocab group (%lld to %lld)",
                       (long long)~worst[2], (long long)worst[1]);
    if (verdict == FH_ERR_MPI_MISMATCH && worst[0] == FH_OK)
        return fh_fail(ctx, FH_ERR_MPI_MISMATCH, "the ranks of the vocab group made this call with different "
                       "configurations: %s", vocab_what);
    if (overall[0] != FH_OK)
        return fh_fail(ctx, (fh_status)overall[0], "another rank failed this call: %s",
                       fh_status_string((fh_status)overall[0]));
    char what[200];
    if (disagreement(config, overall + 1, overall + 1 + K, 0, what, sizeof what))
        return fh_fail(ctx, FH_ERR_MPI_MISMATCH, "the ranks made this call with different configurations: %s", what);
    return FH_OK;
}

static fh_engine_pass call_pass(const fhp_call *c, const fh_plan *plan, const fh_workspace *ws)
{
    return c->pass(c->head, plan, ws);
}

fh_status fhp_call_prepare(fhp_call *c, fh_status st, const fh_plan *plans, const fh_workspace *ws, int count,
                           const fh_linear_grads *grads)
{
    for (int k = 0; st == FH_OK && k < count; k++) {
        fh_engine_pass pass = call_pass(c, &plans[k], &ws[k]);
        pass.grads = k == count - 1 ? grads : NULL;
        st = fh_gemm_failure(c->ctx, fh_engine_prepare(&pass));
    }
    return st;
}

fh_status fhp_call_agree(fhp_call *c, fh_status st)
{
    if (!c->L)
        return st;
    st = agree(c->L, c->ctx, st, st == FH_OK ? c->lin->n : 0, &c->config);
    if (st != FH_OK)
        fhp_grads_free(&c->g);
    return st;
}

/* The smallest row-block height over the vocab group, or 0 on every rank when any rank has none. */
static fh_status agree_rows(fhp_call *c, fh_status st, int64_t *rows)
{
    if (!c->L)
        return st;
    fh_parallel_layout *L = c->L;
    /* Over vocab: the smallest height (0 from a failed rank); then over data, whether every rank of the
     * grid has one. */
    int64_t lowest = st == FH_OK ? *rows : 0;
    const fh_collectives *failed = &L->vocab;
    int err = 0;
    if (L->vocab.size > 1)
        err = L->vocab.allreduce(L->vocab.handle, &lowest, 1, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MIN);
    int64_t all = lowest > 0;
    if (err == 0 && L->data.size > 1) {
        failed = &L->data;
        err = L->data.allreduce(L->data.handle, &all, 1, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MIN);
    }
    *rows = err == 0 && all ? lowest : 0;
    if (st != FH_OK)
        return st;
    return err == 0 ? FH_OK : fhp_group_error(c->ctx, failed, err, "the all-reduce of the row blocks");
}

fh_status fhp_call_schedule(fhp_call *c, fh_status st, int row_blocks, fh_plan plans[2], fh_workspace ws[2],
                            int64_t *rows)
{
    *rows = row_blocks ? plans[0].tile_rows : 0;
    st = agree_rows(c, st, rows);
    if (st == FH_OK && *rows > 0) {
        st = fh_plan_train_step_rows(c->ctx, c->lin, &c->g.engine, *rows, &plans[0], c->ctx);
        if (st == FH_OK)
            st = fh_workspace_acquire(c->ctx, c->lin->n, plans, 1, ws);
        st = fhp_call_prepare(c, st, plans, ws, 1, &c->g.engine);
    } else if (st == FH_OK) {
        st = fh_prepare_streaming(c->ctx, c->lin, plans, ws);
        st = fhp_call_prepare(c, st, plans, ws, 2, &c->g.engine);
    }
    return fhp_call_agree(c, st);
}

fh_status fhp_call_combine_block(const fhp_call *c, int64_t rows, const fh_token_stats *stats)
{
    return c->L->vocab_ranks > 1 ? fhp_combine_stats(c->L, c->ctx, rows, stats, NULL, c->records) : FH_OK;
}

void fhp_call_shard_ids(fhp_call *c, const int64_t *ids, const int64_t *ignore)
{
    if (c->L->vocab_ranks == 1)
        return;
    fhp_local_targets(c->L, ids, c->lin->n, ignore, c->local);
    c->engine_ids = c->local;
}

fh_status fhp_call_finish(fhp_call *c, fh_status st)
{
    if (st == FH_OK)
        return fhp_grads_finish(c->L, c->ctx, &c->g);
    fhp_grads_free(&c->g);
    return st;
}
