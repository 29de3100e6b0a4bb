/* Determinism: the same call gives bitwise-identical loss, per-token outputs and gradients, run twice
 * on fresh contexts, on a context whose workspace was used (and left dirty) by a different problem,
 * and with a caller-owned workspace. */
#include "ce_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* NULL when a and b are bitwise identical, else the name of the first differing output. */
static const char *first_difference(const cp_problem *p, const cp_fused *a, const cp_fused *b)
{
    const size_t n = (size_t)p->n, h = (size_t)p->hidden, v = (size_t)p->vocab;
    const struct {
        const char *name;
        const void *x, *y;
        size_t bytes;
    } parts[] = {
        {"loss", &a->loss, &b->loss, sizeof a->loss},
        {"z_loss", &a->z_loss, &b->z_loss, sizeof a->z_loss},
        {"per_token_loss", a->per_token_loss, b->per_token_loss, n * sizeof(float)},
        {"per_token_logp", a->logp, b->logp, n * sizeof(float)},
        {"lse", a->lse, b->lse, n * sizeof(float)},
        {"argmax", a->argmax, b->argmax, n * sizeof(int64_t)},
        {"dx", a->dx, b->dx, n * h * sizeof(float)},
        {"dweight", a->dweight, b->dweight, h * v * sizeof(float)},
        {"dbias", a->dbias, b->dbias, a->dbias && b->dbias ? v * sizeof(float) : 0},
    };
    for (size_t k = 0; k < TU_COUNT(parts); k++)
        if (parts[k].bytes && memcmp(parts[k].x, parts[k].y, parts[k].bytes) != 0)
            return parts[k].name;
    return NULL;
}

static void make_problem(cp_problem *p, fh_reduction reduction, uint64_t seed)
{
    cp_problem_init(p, 29, 11, 53, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
    p->options.reduction = reduction;
    p->options.label_smoothing = 0.1;
    p->options.softcap = 3.0;
    p->options.z_loss = 1e-3;
    cp_problem_randomize(p, seed, 3.0);
    p->targets[2] = p->targets[7] = -100;
}

static const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};

static void test_repeated_runs(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int threads = 1; threads <= 2; threads++)
            for (int variant = 0; variant < 4; variant++) {
                const int beta = variant & 1, train_step = variant >> 1;
                cp_problem p;
                make_problem(&p, reductions[r], 500 + r);
                const cp_config cfg = {.threads = threads, .tile_rows = 8, .tile_vocab = 16, .grad_beta = (float)beta,
                                       .train_step = train_step};
                cp_fused a, b;
                const fh_status sa = cp_run_fused(&p, &cfg, &a), sb = cp_run_fused(&p, &cfg, &b);
                TU_CHECK(sa == FH_OK && sb == FH_OK, "status %d, %d", (int)sa, (int)sb);
                const char *d = sa == FH_OK && sb == FH_OK ? first_difference(&p, &a, &b) : NULL;
                TU_CHECK(d == NULL, "reduction %d, %d threads, beta %d, train step %d: %s differs between identical runs",
                         (int)reductions[r], threads, beta, train_step, d ? d : "");
                cp_fused_free(&a);
                cp_fused_free(&b);
                cp_problem_free(&p);
            }
}

/* A context reused after a larger, different problem (its workspace holds that problem's leftovers)
 * and a caller-owned workspace filled with garbage both give the fresh context's results; separate
 * calls and the train step. */
static void test_reused_and_caller_workspaces(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int train_step = 0; train_step <= 1; train_step++) {
            cp_problem p, big;
            make_problem(&p, reductions[r], 600 + r);
            cp_problem_init(&big, 61, 5, 97, FH_LAYOUT_HV, CP_BIAS);
            cp_problem_randomize(&big, 700 + r, 5.0);
            const cp_config cfg = {.threads = 2, .tile_rows = 8, .tile_vocab = 16, .train_step = train_step};
            cp_fused fresh, reused, callers, scratch;
            TU_CHECK(cp_run_fused(&p, &cfg, &fresh) == FH_OK, "fresh run");

            fh_context *ctx = cp_context(&cfg);
            TU_CHECK(cp_run_fused_on(ctx, &big, &cfg, &scratch) == FH_OK, "other problem");
            TU_CHECK(cp_run_fused_on(ctx, &p, &cfg, &reused) == FH_OK, "reused context");
            fh_context_destroy(ctx);

            ctx = cp_context(&cfg);
            fh_linear lin;
            cp_problem_linear(&p, &lin);
            size_t bytes = 0;
            const fh_status st = train_step ? fh_ce_forward_backward_workspace_size(ctx, &lin, &p.options, &bytes)
                                            : fh_ce_workspace_size(ctx, &lin, &p.options, &bytes);
            TU_CHECK(st == FH_OK, "size query");
            unsigned char *ws = malloc(bytes ? bytes : 1);
            for (size_t i = 0; i < bytes; i++)
                ws[i] = (unsigned char)(i * 131 + 7);
            TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "set_workspace");
            TU_CHECK(cp_run_fused_on(ctx, &p, &cfg, &callers) == FH_OK, "caller workspace");
            fh_context_destroy(ctx);
            free(ws);

            const char *d1 = first_difference(&p, &fresh, &reused), *d2 = first_difference(&p, &fresh, &callers);
            TU_CHECK(d1 == NULL, "reduction %d, train step %d: %s differs on a reused context", (int)reductions[r],
                     train_step, d1 ? d1 : "");
            /* The split backward skips the ignored rows on the library's workspace and not on a caller's, where it
             * allocates nothing (src/heads/counted_rows.h): every per-row result is still bitwise the same, and dweight and
             * dbias sum the same terms without the zeros, in another grouping, so they agree to 1e-6 normwise
             * (measured 8e-8; dbias bitwise) instead of bitwise. */
            const int compacted = !train_step;
            cp_fused per_row = callers;
            per_row.dweight = fresh.dweight;
            per_row.dbias = fresh.dbias;
            d2 = first_difference(&p, &fresh, compacted ? &per_row : &callers);
            TU_CHECK(d2 == NULL, "reduction %d, train step %d: %s differs with a caller workspace", (int)reductions[r],
                     train_step, d2 ? d2 : "");
            if (compacted) {
                const double dw = tu_norm_rel_f(callers.dweight, fresh.dweight, (size_t)(p.hidden * p.vocab));
                const double db = callers.dbias ? tu_norm_rel_f(callers.dbias, fresh.dbias, (size_t)p.vocab) : 0.0;
                TU_CHECK(dw <= 1e-6 && db <= 1e-6, "reduction %d: dweight %.2e, dbias %.2e normwise with a caller "
                         "workspace", (int)reductions[r], dw, db);
            }
            cp_fused_free(&fresh);
            cp_fused_free(&reused);
            cp_fused_free(&callers);
            cp_fused_free(&scratch);
            cp_problem_free(&p);
            cp_problem_free(&big);
        }
}

static const tu_test tests[] = {
    {"identical runs are bitwise identical", test_repeated_runs},
    {"reused context and caller workspace", test_reused_and_caller_workspaces},
};
const tu_suite suite_determinism = {tests, TU_COUNT(tests)};
