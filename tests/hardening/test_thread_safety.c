/* Thread safety: separate contexts used concurrently from several pthreads (4 workers, each with its own
 * context, FH_PARAM_THREADS = 1, different shapes and entry points, distillation's included; two of them read
 * the same input arrays) give bitwise the results of the same calls made serially. The concurrent phase runs first in the
 * process, so the library's one-time initialisation (BLIS kernel selection, row-kernel choice, BLIS's own
 * init) races too. A fifth worker makes invalid calls (cross-entropy and distillation) on its own context
 * meanwhile: each context's message stays its own. */
#include "hardening_util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { WORKERS = 4, ROUNDS = 3, JOBS = 5 };

typedef struct job {
    hu_call call; /* a backward job runs its forward first, on the same context, for the saved state */
    const cp_problem *ce;
    const hu_grpo_problem *grpo;
} job;

typedef struct worker {
    job jobs[JOBS];
    hu_outputs concurrent[ROUNDS][JOBS];
    fh_status status[ROUNDS][JOBS];
    int64_t tile_rows, tile_vocab;
} worker;

static atomic_int start_gate;

static void wait_for_gate(void)
{
    while (!atomic_load(&start_gate))
        ;
}

static void alloc_outputs(const job *j, hu_outputs *o)
{
    const int grpo = hu_call_on_sequences(j->call);
    const int64_t n = grpo ? j->grpo->batch * j->grpo->seq : j->ce->n;
    hu_outputs_alloc(o, n, grpo ? j->grpo->hidden : j->ce->hidden, grpo ? j->grpo->vocab : j->ce->vocab,
                     grpo ? j->grpo->bias != NULL : j->ce->bias != NULL);
    hu_outputs_fill(o, 0);
}

/* The job's call; for a backward, the matching forward first (into scratch outputs) for lse/logp/entropy. */
static fh_status run_job(fh_context *ctx, const job *j, hu_outputs *o)
{
    if (j->call != HU_fh_ce_backward && j->call != HU_fh_grpo_backward)
        return hu_run(ctx, j->call, j->ce, j->grpo, NULL, o);
    hu_outputs forward;
    alloc_outputs(j, &forward);
    const hu_call fwd = j->call == HU_fh_ce_backward ? HU_fh_ce_forward : HU_fh_grpo_forward;
    fh_status st = hu_run(ctx, fwd, j->ce, j->grpo, NULL, &forward);
    hu_saved saved;
    hu_saved_from(&saved, &forward, forward.n);
    if (st == FH_OK)
        st = hu_run(ctx, j->call, j->ce, j->grpo, &saved, o);
    hu_saved_free(&saved);
    hu_outputs_free(&forward);
    return st;
}

static void *work(void *arg)
{
    worker *w = arg;
    wait_for_gate();
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return NULL;
    fh_context_set(ctx, FH_PARAM_THREADS, 1);
    fh_context_set(ctx, FH_PARAM_TILE_ROWS, w->tile_rows);
    fh_context_set(ctx, FH_PARAM_TILE_VOCAB, w->tile_vocab);
    for (int round = 0; round < ROUNDS; round++)
        for (int k = 0; k < JOBS; k++) {
            const job *j = &w->jobs[k];
            w->status[round][k] = run_job(ctx, j, &w->concurrent[round][k]);
        }
    fh_context_destroy(ctx);
    return NULL;
}

typedef struct error_worker {
    int mismatches, calls;
} error_worker;

/* Invalid calls (each with its own message) while the workers compute. */
static void *make_errors(void *arg)
{
    error_worker *e = arg;
    wait_for_gate();
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return NULL;
    float x[4] = {0}, w[4] = {0};
    int64_t targets[2] = {0, 0};
    fh_linear lin;
    fh_linear_init(&lin, 2, 2, 2, x, w, FH_LAYOUT_HV, NULL);
    fh_ce_options o;
    fh_ce_options_init(&o);
    double loss;
    fh_ce_outputs out = {.loss = &loss};
    /* Every other call a distillation (the teacher the student's view). */
    fh_distill_options d;
    fh_distill_options_init(&d);
    fh_distill_outputs dout = {.loss = &loss};
    for (int k = 0; k < 2000; k++) {
        targets[1] = 1000 + k;
        const fh_status st = k % 2 ? fh_distill_forward(ctx, &lin, &lin, targets, &d, &dout)
                                   : fh_ce_forward(ctx, &lin, targets, &o, &out);
        const char *message = "";
        fh_context_message(ctx, &message);
        char expected[32];
        snprintf(expected, sizeof expected, "= %d ", 1000 + k);
        e->calls++;
        if (st != FH_ERR_TARGET_OUT_OF_RANGE || !strstr(message, expected))
            e->mismatches++;
    }
    fh_context_destroy(ctx);
    return NULL;
}

static void test_concurrent_contexts(void)
{
    cp_problem ce_a, ce_b;
    cp_problem_init(&ce_a, 97, 24, 1500, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
    cp_problem_randomize(&ce_a, 3000, 3.0);
    ce_a.options.label_smoothing = 0.1;
    ce_a.options.softcap = 30.0;
    ce_a.options.z_loss = 1e-4;
    ce_a.targets[5] = -100;
    cp_problem_init(&ce_b, 40, 64, 777, FH_LAYOUT_HV, 0);
    cp_problem_randomize(&ce_b, 3001, 3.0);
    ce_b.options.reduction = FH_REDUCTION_NONE;
    hu_grpo_problem g_a, g_b;
    hu_grpo_problem_init(&g_a, 4, 21, 32, 999, FH_LAYOUT_VH, 1, 3002);
    g_a.options.entropy_coef = 0.01;
    hu_grpo_problem_init(&g_b, 2, 30, 16, 1201, FH_LAYOUT_HV, 0, 3003);
    g_b.options.importance_sampling_level = FH_GRPO_IS_SEQUENCE;
    g_b.options.loss_type = FH_GRPO_LOSS_SAPO;
    g_b.distill.divergence = FH_DIVERGENCE_FORWARD_KL;
    g_b.distill.reduction = FH_REDUCTION_NONE;
    static worker workers[WORKERS];
    memset(workers, 0, sizeof workers);
    const job plan[WORKERS][JOBS] = {
        {{HU_fh_ce_forward, &ce_a, NULL}, {HU_fh_ce_backward, &ce_a, NULL}, {HU_fh_ce_forward_backward, &ce_a, NULL},
         {HU_fh_grpo_forward_backward, NULL, &g_b}, {HU_fh_distill_forward_backward, NULL, &g_a}},
        /* Same inputs as worker 0, other order and tiles. */
        {{HU_fh_ce_forward_backward, &ce_a, NULL}, {HU_fh_distill_forward, NULL, &g_a}, {HU_fh_ce_forward, &ce_a, NULL},
         {HU_fh_grpo_forward, NULL, &g_a}, {HU_fh_ce_backward, &ce_a, NULL}},
        {{HU_fh_ce_forward, &ce_b, NULL}, {HU_fh_ce_forward_backward, &ce_b, NULL}, {HU_fh_distill_forward_backward, NULL, &g_b},
         {HU_fh_ce_backward, &ce_b, NULL}, {HU_fh_grpo_backward, NULL, &g_b}},
        {{HU_fh_grpo_forward, NULL, &g_a}, {HU_fh_grpo_backward, NULL, &g_a}, {HU_fh_grpo_forward_backward, NULL, &g_a},
         {HU_fh_ce_forward_backward, &ce_b, NULL}, {HU_fh_distill_forward, NULL, &g_b}},
    };
    static const int64_t tiles[WORKERS][2] = {{0, 0}, {16, 128}, {8, 64}, {32, 256}};
    for (int w = 0; w < WORKERS; w++) {
        workers[w].tile_rows = tiles[w][0];
        workers[w].tile_vocab = tiles[w][1];
        for (int k = 0; k < JOBS; k++) {
            workers[w].jobs[k] = plan[w][k];
            for (int round = 0; round < ROUNDS; round++)
                alloc_outputs(&plan[w][k], &workers[w].concurrent[round][k]);
        }
    }
    pthread_t threads[WORKERS + 1];
    error_worker errors = {0, 0};
    atomic_store(&start_gate, 0);
    int created = 0;
    for (int w = 0; w < WORKERS; w++)
        created += pthread_create(&threads[w], NULL, work, &workers[w]) == 0;
    created += pthread_create(&threads[WORKERS], NULL, make_errors, &errors) == 0;
    TU_CHECK(created == WORKERS + 1, "pthread_create");
    atomic_store(&start_gate, 1);
    for (int w = 0; w < created; w++)
        pthread_join(threads[w], NULL);
    TU_CHECK(errors.calls == 2000 && errors.mismatches == 0,
             "error worker: %d of %d calls returned the wrong status or another context's message", errors.mismatches,
             errors.calls);

    /* Serial runs of the same calls, same settings. */
    for (int w = 0; w < WORKERS; w++) {
        fh_context *ctx = tu_context(1, workers[w].tile_rows, workers[w].tile_vocab, 0);
        for (int k = 0; k < JOBS; k++) {
            const job *j = &workers[w].jobs[k];
            hu_outputs serial;
            alloc_outputs(j, &serial);
            const fh_status st = run_job(ctx, j, &serial);
            TU_CHECK(st == FH_OK, "serial %s: %d", hu_call_name(j->call), (int)st);
            for (int round = 0; round < ROUNDS; round++) {
                const char *d = hu_outputs_diff(&serial, &workers[w].concurrent[round][k]);
                TU_CHECK(workers[w].status[round][k] == FH_OK && d == NULL,
                         "worker %d, round %d, %s: concurrent status %d, %s differs from the serial run", w, round,
                         hu_call_name(j->call), (int)workers[w].status[round][k], d ? d : "nothing");
                hu_outputs_free(&workers[w].concurrent[round][k]);
            }
            hu_outputs_free(&serial);
        }
        fh_context_destroy(ctx);
    }
    cp_problem_free(&ce_a);
    cp_problem_free(&ce_b);
    hu_grpo_problem_free(&g_a);
    hu_grpo_problem_free(&g_b);
}

static const tu_test tests[] = {
    {"concurrent contexts match serial runs bitwise", test_concurrent_contexts},
};
const tu_suite suite_thread_safety = {tests, TU_COUNT(tests)};
