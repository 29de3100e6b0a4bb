/* Determinism beyond tests/test_determinism.c: every entry point (cross-entropy forward, backward, train
 * step on both schedules; GRPO forward, backward, train step at both importance-sampling levels; the preference
 * and KTO calls (KTO: its reference per token and one KL value); the distillation calls, their train step in row blocks and (budget 300000) streaming, with a teacher of
 * another hidden size and layout, on both problems) gives
 * bitwise-identical outputs across repeated runs with the same thread count (1, 2, and 0 = OpenMP's
 * default) and configuration, on fresh contexts and on one reused context, at a shape where BLIS splits
 * the GEMMs between threads and the tiles leave remainders.
 *
 * The test "facts across thread counts and tile sizes" measures, without asserting (nothing in the API
 * promises it), whether results change between 1 and 2 threads and between tile configurations, and
 * prints what it finds; tests/hardening/README.md records the answer. */
#include "hardening_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 131, H = 40, V = 1031, B = 4, T = 33 };

typedef struct config {
    int threads;
    int64_t tile_rows, tile_vocab, budget;
} config;

typedef struct problems {
    cp_problem ce;
    hu_grpo_problem grpo_token, grpo_sequence;
    hu_saved ce_saved, token_saved, sequence_saved;
} problems;

static fh_status run_on(fh_context *ctx, hu_call call, const problems *p, int sequence, hu_outputs *o)
{
    const hu_grpo_problem *g = sequence ? &p->grpo_sequence : &p->grpo_token;
    const hu_saved *saved = hu_call_on_sequences(call) ? (sequence ? &p->sequence_saved : &p->token_saved) : &p->ce_saved;
    return hu_run(ctx, call, &p->ce, g, saved, o);
}

static fh_context *context_for(const config *c)
{
    fh_context *ctx = tu_context(c->threads, c->tile_rows, c->tile_vocab, 0);
    fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, c->budget);
    return ctx;
}

static fh_status run_fresh(const config *c, hu_call call, const problems *p, int sequence, hu_outputs *o)
{
    fh_context *ctx = context_for(c);
    const fh_status st = run_on(ctx, call, p, sequence, o);
    fh_context_destroy(ctx);
    return st;
}

static void problems_init(problems *p)
{
    cp_problem_init(&p->ce, N, H, V, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
    cp_problem_randomize(&p->ce, 1000, 3.0);
    p->ce.options.label_smoothing = 0.05;
    p->ce.options.z_loss = 1e-4;
    p->ce.options.softcap = 15.0;
    p->ce.targets[7] = p->ce.targets[100] = -100;
    hu_grpo_problem_init(&p->grpo_token, B, T, H, V, FH_LAYOUT_HV, 1, 1001);
    p->grpo_token.options.entropy_coef = 0.01;
    p->grpo_token.options.temperature = 0.7;
    hu_grpo_problem_init(&p->grpo_sequence, B, T, H, V, FH_LAYOUT_VH, 0, 1002);
    p->grpo_sequence.options.importance_sampling_level = FH_GRPO_IS_SEQUENCE;
    p->grpo_sequence.options.loss_type = FH_GRPO_LOSS_DAPO;
    const config one = {1, 0, 0, 0};
    hu_outputs o;
    hu_outputs_alloc(&o, N, H, V, 1);
    TU_CHECK(run_fresh(&one, HU_fh_ce_forward, p, 0, &o) == FH_OK, "CE forward");
    hu_saved_from(&p->ce_saved, &o, N);
    hu_outputs_free(&o);
    hu_outputs_alloc(&o, B * T, H, V, 1);
    TU_CHECK(run_fresh(&one, HU_fh_grpo_forward, p, 0, &o) == FH_OK, "GRPO forward");
    hu_saved_from(&p->token_saved, &o, B * T);
    TU_CHECK(run_fresh(&one, HU_fh_grpo_forward, p, 1, &o) == FH_OK, "GSPO forward");
    hu_saved_from(&p->sequence_saved, &o, B * T);
    hu_outputs_free(&o);
}

static void problems_free(problems *p)
{
    cp_problem_free(&p->ce);
    hu_grpo_problem_free(&p->grpo_token);
    hu_grpo_problem_free(&p->grpo_sequence);
    hu_saved_free(&p->ce_saved);
    hu_saved_free(&p->token_saved);
    hu_saved_free(&p->sequence_saved);
}

static void outputs_for(hu_call call, int sequence, hu_outputs *o)
{
    const int grpo = hu_call_on_sequences(call);
    hu_outputs_alloc(o, grpo ? B * T : N, H, V, grpo ? !sequence : 1);
    hu_outputs_fill(o, 0);
}

static void test_repeated_runs(void)
{
    problems p;
    problems_init(&p);
    /* Small tiles with remainders; default tiles; a budget that makes the train step stream. */
    static const config configs[] = {
        {1, 16, 96, 0}, {2, 16, 96, 0}, {0, 16, 96, 0}, {1, 0, 0, 0}, {2, 0, 0, 0}, {2, 0, 0, 300000},
    };
    for (size_t c = 0; c < TU_COUNT(configs); c++)
        for (int call = 0; call < HU_CALL_COUNT; call++)
            for (int sequence = 0; sequence <= hu_call_on_sequences((hu_call)call); sequence++) {
                hu_outputs first, again;
                outputs_for((hu_call)call, sequence, &first);
                outputs_for((hu_call)call, sequence, &again);
                fh_status st = run_fresh(&configs[c], (hu_call)call, &p, sequence, &first);
                TU_CHECK(st == FH_OK, "%s: status %d", hu_call_name((hu_call)call), (int)st);
                fh_context *reused = context_for(&configs[c]);
                for (int rep = 0; rep < 3; rep++) {
                    /* Fresh context, then the same context again (its workspace dirty from the last run). */
                    hu_outputs_fill(&again, 0); /* outputs a call does not write stay 0 in both */
                    st = rep == 0 ? run_fresh(&configs[c], (hu_call)call, &p, sequence, &again)
                                  : run_on(reused, (hu_call)call, &p, sequence, &again);
                    const char *d = hu_outputs_diff(&first, &again);
                    TU_CHECK(st == FH_OK && d == NULL,
                             "%s%s, threads %d, tiles %lld x %lld, budget %lld, repetition %d: status %d, %s differs",
                             hu_call_name((hu_call)call), sequence ? " (sequence level)" : "", configs[c].threads,
                             (long long)configs[c].tile_rows, (long long)configs[c].tile_vocab,
                             (long long)configs[c].budget, rep, (int)st, d ? d : "nothing");
                }
                fh_context_destroy(reused);
                hu_outputs_free(&first);
                hu_outputs_free(&again);
            }
    problems_free(&p);
}

/* Measured, not asserted: printed for the README. */
static void test_facts_across_configurations(void)
{
    problems p;
    problems_init(&p);
    static const struct {
        const char *what;
        config a, b;
    } pairs[] = {
        {"1 vs 2 threads, default tiles", {1, 0, 0, 0}, {2, 0, 0, 0}},
        {"1 vs 2 threads, 16 x 96 tiles", {1, 16, 96, 0}, {2, 16, 96, 0}},
        {"tile rows 16 vs 32 (vocab 96), 1 thread", {1, 16, 96, 0}, {1, 32, 96, 0}},
        {"tile vocab 96 vs 128 (rows 16), 1 thread", {1, 16, 96, 0}, {1, 16, 128, 0}},
        {"default tiles vs 16 x 96, 1 thread", {1, 0, 0, 0}, {1, 16, 96, 0}},
        {"budget 300000 (smaller tiles; train step streams)", {1, 0, 0, 0}, {1, 0, 0, 300000}},
    };
    printf("\n  determinism facts (N=%d H=%d V=%d; GRPO B=%d T=%d):\n", N, H, V, B, T);
    for (size_t k = 0; k < TU_COUNT(pairs); k++)
        for (int call = 0; call < HU_CALL_COUNT; call++) {
            hu_outputs a, b;
            outputs_for((hu_call)call, 0, &a);
            outputs_for((hu_call)call, 0, &b);
            const fh_status sa = run_fresh(&pairs[k].a, (hu_call)call, &p, 0, &a);
            const fh_status sb = run_fresh(&pairs[k].b, (hu_call)call, &p, 0, &b);
            TU_CHECK(sa == FH_OK && sb == FH_OK, "status %d, %d", (int)sa, (int)sb);
            const char *d = hu_outputs_diff(&a, &b);
            printf("    %-52s %-26s %s%s\n", pairs[k].what, hu_call_name((hu_call)call), d ? "DIFFERS in " : "identical",
                   d ? d : "");
            hu_outputs_free(&a);
            hu_outputs_free(&b);
        }
    problems_free(&p);
}

static const tu_test tests[] = {
    {"repeated runs, every entry point and configuration", test_repeated_runs},
    {"facts across thread counts and tile sizes (printed)", test_facts_across_configurations},
};
const tu_suite suite_hard_determinism = {tests, TU_COUNT(tests)};
