/* Per-token statistics across the vocab group: every rank's packed records gathered and merged here, in rank order
 * (every rank computes the same bits), or maxima then sums (FH_PARALLEL_PARAM_STATS_COLLECTIVE). */
#include "parallel_internal.h"

#include <stdint.h>
#include <math.h>
#include <string.h>

/* b = a (+) b for one record. Every field is a symmetric function of the two records (sums of two
 * terms, max, lowest index on ties), so the result does not depend on which rank's record is which. */
static void merge_record(const double *a, double *b)
{
    const double la = a[FHP_LSE], lb = b[FHP_LSE];
    double lse, wa, wb;
    if (isnan(la) || isnan(lb)) {
        lse = wa = wb = NAN;
    } else {
        const double top = la > lb ? la : lb;
        if (top == -INFINITY) { /* every logit -inf on both sides */
            lse = -INFINITY;
            wa = wb = 0.0;
        } else if (top == INFINITY) {
            lse = wa = wb = NAN; /* as the single process: exp(inf - inf) */
        } else {
            const double ea = exp(la - top), eb = exp(lb - top), s = ea + eb;
            lse = top + log(s);
            wa = ea / s;
            wb = eb / s;
        }
    }
    b[FHP_SUM_PZ] = a[FHP_SUM_PZ] * wa + b[FHP_SUM_PZ] * wb;
    b[FHP_LSE] = lse;
    if (a[FHP_MAX] > b[FHP_MAX] || (a[FHP_MAX] == b[FHP_MAX] && a[FHP_ARGMAX] < b[FHP_ARGMAX])) {
        b[FHP_MAX] = a[FHP_MAX];
        b[FHP_ARGMAX] = a[FHP_ARGMAX];
    }
    b[FHP_Z_TARGET] += a[FHP_Z_TARGET];
    b[FHP_SUM_WZ] += a[FHP_SUM_WZ];
    b[FHP_TARGET_WEIGHT] += a[FHP_TARGET_WEIGHT];
}

size_t fhp_combine_bytes(const fh_parallel_layout *L, int64_t n)
{
    const size_t m = (size_t)n + 1;
    const size_t packed = ((size_t)L->vocab_ranks + 1) * m * FHP_RECORD * sizeof(double);
    const size_t two_step = 2 * m * sizeof(double) + 2 * m * sizeof(int64_t) + 5 * m * sizeof(double);
    return packed > two_step ? packed : two_step;
}

/* The shard's largest logit. The engine keeps lse = max + log(sum_exp); the max is an fp32 value, so
 * rounding max + log(s) - log(s) to fp32 gives it back exactly unless |max| < ~1e-7 log(s). Only argmax
 * ties across shards depend on it. */
static double shard_max(double lse, double sum_exp)
{
    if (!(sum_exp > 0.0))
        return sum_exp == 0.0 ? -INFINITY : NAN;
    return (double)(float)(lse - log(sum_exp));
}

static void pack(const fh_parallel_layout *L, int64_t n, const fh_token_stats *s, const double *extra, double *r)
{
    for (int64_t i = 0; i < n; i++, r += FHP_RECORD) {
        r[FHP_LSE] = s->lse[i];
        r[FHP_MAX] = s->argmax ? shard_max(s->lse[i], s->sum_exp[i]) : 0.0;
        r[FHP_Z_TARGET] = s->z_target[i];
        r[FHP_SUM_WZ] = s->sum_weighted_z ? s->sum_weighted_z[i] : 0.0;
        r[FHP_SUM_PZ] = s->sum_pz ? s->sum_pz[i] : 0.0;
        r[FHP_ARGMAX] = s->argmax ? (double)(s->argmax[i] + L->vocab_offset) : 0.0;
        r[FHP_TARGET_WEIGHT] = extra ? extra[i] : 0.0;
    }
    /* One more record carries extra[n]; its other fields are neutral. */
    const double tail[FHP_RECORD] = {0.0, -INFINITY, 0.0, 0.0, 0.0, 0.0, extra ? extra[n] : 0.0};
    memcpy(r, tail, sizeof tail);
}

static void unpack(int64_t n, const double *r, const fh_token_stats *s, double *extra)
{
    for (int64_t i = 0; i < n; i++, r += FHP_RECORD) {
        s->lse[i] = r[FHP_LSE];
        s->z_target[i] = r[FHP_Z_TARGET];
        if (s->sum_weighted_z)
            s->sum_weighted_z[i] = r[FHP_SUM_WZ];
        if (s->sum_pz)
            s->sum_pz[i] = r[FHP_SUM_PZ];
        if (s->argmax)
            s->argmax[i] = (int64_t)r[FHP_ARGMAX];
        if (extra)
            extra[i] = r[FHP_TARGET_WEIGHT];
    }
    if (extra)
        extra[n] = r[FHP_TARGET_WEIGHT];
}

static fh_status combine_packed(fh_parallel_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *s,
                                double *extra, double *records)
{
    const int64_t m = n + 1;
    double *mine = records, *all = records + m * FHP_RECORD;
    pack(L, n, s, extra, mine);
    const fh_collectives *g = &L->vocab;
    const int err = g->allgather(g->handle, mine, all, m * FHP_RECORD * (int64_t)sizeof(double));
    if (err != 0)
        return fhp_group_error(ctx, g, err, "the all-gather of statistics");
    for (int r = 1; r < g->size; r++)
        for (int64_t i = 0; i < m; i++)
            merge_record(all + (r * m + i) * FHP_RECORD, all + i * FHP_RECORD);
    unpack(n, all, s, extra);
    return FH_OK;
}

/* Maxima of lse and of the shards' largest logits; with argmax, the lowest global index among the ranks whose largest
 * logit is the maximum (a minimum over indices, INT64_MAX elsewhere); then sums of (exp(lse_r - lse_max),
 * sum_pz_r exp(..), z_target, sum_weighted_z, extra). */
static fh_status combine_two_step(fh_parallel_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *s,
                                  double *extra, void *scratch)
{
    const fh_collectives *g = &L->vocab;
    const int64_t m = n + 1;
    double *top = scratch;              /* [2m]: lse's maxima, then the largest logits' */
    int64_t *index = (int64_t *)(top + 2 * m); /* [m] */
    double *sums = (double *)(index + m);      /* [5m] */
    const int with_argmax = s->argmax != NULL;
    for (int64_t i = 0; i < n; i++) {
        top[i] = s->lse[i];
        top[m + i] = with_argmax ? shard_max(s->lse[i], s->sum_exp[i]) : -INFINITY;
    }
    top[n] = top[m + n] = -INFINITY; /* the extra record */
    int err = g->allreduce(g->handle, top, with_argmax ? 2 * m : m, FH_COLLECTIVE_DOUBLE, FH_COLLECTIVE_MAX);
    if (err == 0 && with_argmax) {
        for (int64_t i = 0; i < n; i++)
            index[i] = shard_max(s->lse[i], s->sum_exp[i]) == top[m + i] ? s->argmax[i] + L->vocab_offset : INT64_MAX;
        index[n] = INT64_MAX;
        err = g->allreduce(g->handle, index, m, FH_COLLECTIVE_INT64, FH_COLLECTIVE_MIN);
    }
    if (err != 0)
        return fhp_group_error(ctx, g, err, "the all-reduce of statistics (maxima)");
    for (int64_t i = 0; i < m; i++) {
        double *r = sums + 5 * i;
        const double top_lse = top[i];
        const double scale = i == n || !isfinite(top_lse) ? (isnan(top_lse) ? NAN : 0.0) : exp(s->lse[i] - top_lse);
        r[0] = i < n ? scale : 0.0;
        r[1] = i < n && s->sum_pz ? s->sum_pz[i] * scale : 0.0;
        r[2] = i < n ? s->z_target[i] : 0.0;
        r[3] = i < n && s->sum_weighted_z ? s->sum_weighted_z[i] : 0.0;
        r[4] = extra ? extra[i] : 0.0;
    }
    err = g->allreduce(g->handle, sums, 5 * m, FH_COLLECTIVE_DOUBLE, FH_COLLECTIVE_SUM);
    if (err != 0)
        return fhp_group_error(ctx, g, err, "the all-reduce of statistics (sums)");
    for (int64_t i = 0; i < n; i++) {
        const double *r = sums + 5 * i, top_lse = top[i];
        s->lse[i] = isinf(top_lse) ? (top_lse < 0.0 ? -INFINITY : NAN) : top_lse + log(r[0]);
        s->z_target[i] = r[2];
        if (s->sum_pz)
            s->sum_pz[i] = r[1] / r[0];
        if (s->sum_weighted_z)
            s->sum_weighted_z[i] = r[3];
        if (with_argmax)
            s->argmax[i] = index[i];
        if (extra)
            extra[i] = r[4];
    }
    if (extra)
        extra[n] = sums[5 * n + 4];
    return FH_OK;
}

fh_status fhp_combine_stats(fh_parallel_layout *L, fh_context *ctx, int64_t n, const fh_token_stats *stats,
                            double *extra, void *records)
{
    if (L->vocab_ranks == 1)
        return FH_OK;
    if (L->params[FH_PARALLEL_PARAM_STATS_COLLECTIVE] == FH_PARALLEL_STATS_MAX_THEN_SUM)
        return combine_two_step(L, ctx, n, stats, extra, records);
    return combine_packed(L, ctx, n, stats, extra, records);
}
