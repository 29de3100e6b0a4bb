/* Allocation-failure injection (alloc_hook.h). For every entry point, the k-th allocation made by
 * libfusedhead's own code fails, for k = 0, 1, ... until a run injects nothing. Each failure must:
 *   - return FH_ERR_OUT_OF_MEMORY from the call that hit it (fh_context_create or the entry point),
 *   - leave every output bit-identical (canary) and, for fh_context_create, the context pointer unset,
 *   - leave the context usable: the same call without injection then succeeds with the results of a run
 *     that never failed, bitwise,
 *   - leak nothing: after fh_context_destroy no block allocated by libfusedhead is live.
 * BLIS is warmed up with the same shapes and thread count first (its pools are then allocated) and BLIS's
 * and libgomp's allocations are never failed: BLIS aborts on allocation failure by design.
 * The wisdom file functions allocate only through libc (fopen): there every allocation of the calling
 * thread is failed in turn, and they must return FH_ERR_WISDOM_IO / FH_ERR_OUT_OF_MEMORY or succeed.
 * Distillation: both schedules of its train step (row blocks, and streaming under a budget too small for its
 * row blocks, hu_distill_streaming_budget), every divergence and reduction, no targets, and bf16 students,
 * teachers or both. KTO: the reference per token and the KL as one value, and (variant 1) the reference per
 * sequence and the KL as per-sequence log-ratios. */
#include "alloc_hook.h"
#include "hardening_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_STEPS = 64 };

static int hooks_ready(void)
{
    static int state = 0; /* 0 unknown, 1 ready, -1 unavailable */
    if (state == 0)
        state = ah_init() == 0 ? 1 : -1;
    TU_CHECK(state == 1, "the allocation hooks are not in effect (malloc is not interposed)");
    return state == 1;
}

typedef struct scenario {
    const char *label;
    hu_call call;
    const cp_problem *ce;
    const hu_grpo_problem *grpo;
    const hu_saved *saved;
    int threads;
    int64_t tile_rows, tile_vocab, budget;
    double filter_eps; /* FH_PARAM_GRAD_FILTER_EPS */
} scenario;

static fh_context *scenario_context(const scenario *s, fh_status *create_status)
{
    fh_context *sentinel = (fh_context *)(uintptr_t)0x5A5A5A5A;
    fh_context *ctx = sentinel;
    *create_status = fh_context_create(&ctx);
    if (*create_status != FH_OK) {
        TU_CHECK(ctx == sentinel, "%s: a failed fh_context_create wrote the context pointer", s->label);
        return NULL;
    }
    const fh_status a = fh_context_set(ctx, FH_PARAM_THREADS, s->threads);
    const fh_status b = fh_context_set(ctx, FH_PARAM_TILE_ROWS, s->tile_rows);
    const fh_status c = fh_context_set(ctx, FH_PARAM_TILE_VOCAB, s->tile_vocab);
    const fh_status d = fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, s->budget);
    const fh_status e = fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, s->filter_eps);
    TU_CHECK(a == FH_OK && b == FH_OK && c == FH_OK && d == FH_OK && e == FH_OK, "%s: fh_context_set", s->label);
    return ctx;
}

static void run_scenario(const scenario *s)
{
    const int64_t n = hu_call_on_sequences(s->call) ? s->grpo->batch * s->grpo->seq : s->ce->n;
    const int64_t h = hu_call_on_sequences(s->call) ? s->grpo->hidden : s->ce->hidden;
    const int64_t v = hu_call_on_sequences(s->call) ? s->grpo->vocab : s->ce->vocab;
    const int bias = hu_call_on_sequences(s->call) ? s->grpo->bias != NULL : s->ce->bias != NULL;
    hu_outputs expected, got;
    hu_outputs_alloc(&expected, n, h, v, bias);
    hu_outputs_alloc(&got, n, h, v, bias);

    /* Warm-up (BLIS pools, OpenMP team) and the results of a run that never fails. */
    fh_status st;
    fh_context *ctx = scenario_context(s, &st);
    hu_outputs_fill(&expected, TU_CANARY); /* what a call does not write stays canary, as in `got` */
    st = ctx ? hu_run(ctx, s->call, s->ce, s->grpo, s->saved, &expected) : st;
    TU_CHECK(st == FH_OK, "%s: warm-up: status %d", s->label, (int)st);
    fh_context_destroy(ctx);
    TU_CHECK(ah_live_library_blocks() == 0, "%s: %ld library blocks live after destroy", s->label,
             ah_live_library_blocks());

    /* How many allocations the library makes for create + call + destroy. */
    ah_reset(AH_LIBRARY);
    ctx = scenario_context(s, &st);
    if (ctx)
        st = hu_run(ctx, s->call, s->ce, s->grpo, s->saved, &got);
    fh_context_destroy(ctx);
    const long total = ah_counted();
    TU_CHECK(st == FH_OK && total >= 2, "%s: counting run: status %d, %ld library allocations (expected >= 2: "
             "the context and its workspace)", s->label, (int)st, total);

    long k;
    for (k = 0; k < MAX_STEPS; k++) {
        ah_arm(k, AH_LIBRARY);
        ctx = scenario_context(s, &st);
        if (!ctx) {
            TU_CHECK(st == FH_ERR_OUT_OF_MEMORY && ah_failures() == 1,
                     "%s: k = %ld: fh_context_create returned %d (%ld failures injected)", s->label, k, (int)st,
                     ah_failures());
            ah_disarm();
            TU_CHECK(ah_live_library_blocks() == 0, "%s: k = %ld: %ld library blocks live after a failed create",
                     s->label, k, ah_live_library_blocks());
            continue;
        }
        hu_outputs_fill(&got, TU_CANARY);
        st = hu_run(ctx, s->call, s->ce, s->grpo, s->saved, &got);
        const long injected = ah_failures();
        ah_disarm();
        if (injected == 0) {
            TU_CHECK(st == FH_OK, "%s: k = %ld: status %d without any failure injected", s->label, k, (int)st);
            const char *d = hu_outputs_diff(&got, &expected);
            TU_CHECK(d == NULL, "%s: k = %ld: %s differs from the warm-up run", s->label, k, d ? d : "");
            fh_context_destroy(ctx);
            TU_CHECK(ah_live_library_blocks() == 0, "%s: %ld library blocks live after destroy", s->label,
                     ah_live_library_blocks());
            break;
        }
        const char *message = "";
        fh_context_message(ctx, &message);
        TU_CHECK(st == FH_ERR_OUT_OF_MEMORY, "%s: k = %ld: status %d (%s) after an allocation failure, expected "
                 "FH_ERR_OUT_OF_MEMORY", s->label, k, (int)st, message);
        TU_CHECK(tu_mentions(message, "allocate"), "%s: k = %ld: message \"%s\" does not say what failed", s->label,
                 k, message);
        TU_CHECK(hu_outputs_untouched(&got, TU_CANARY), "%s: k = %ld: a call that failed with status %d wrote an "
                 "output", s->label, k, (int)st);
        /* The context is still usable and gives the same results. */
        st = hu_run(ctx, s->call, s->ce, s->grpo, s->saved, &got);
        TU_CHECK(st == FH_OK, "%s: k = %ld: retry after the failure: status %d", s->label, k, (int)st);
        const char *d = st == FH_OK ? hu_outputs_diff(&got, &expected) : NULL;
        TU_CHECK(d == NULL, "%s: k = %ld: retry: %s differs from the warm-up run", s->label, k, d ? d : "");
        fh_context_destroy(ctx);
        TU_CHECK(ah_live_library_blocks() == 0, "%s: k = %ld: %ld library blocks (%zu bytes) live after destroy",
                 s->label, k, ah_live_library_blocks(), ah_live_library_bytes());
    }
    TU_CHECK(k == total, "%s: %ld injection steps for %ld library allocations", s->label, k, total);
    if (getenv("FH_HARDENING_VERBOSE"))
        printf("\n    %s: %ld library allocations, each failed in turn", s->label, total);
    hu_outputs_free(&expected);
    hu_outputs_free(&got);
}

/* The problems every scenario uses: tiles small enough for several vocabulary tiles and row blocks. */
typedef struct problems {
    cp_problem ce_mean, ce_none, ce_bf16;
    hu_grpo_problem grpo;
    hu_grpo_problem kto_per_sequence; /* grpo with KTO's reference and KL per sequence (shares its arrays) */
    hu_grpo_problem distill_bf16[3]; /* bf16 student; bf16 teacher; both (fp32 otherwise; empty without bf16) */
    hu_saved ce_saved_mean, ce_saved_none, ce_saved_bf16, grpo_saved;
} problems;

static void saved_from_forward(hu_call forward, const cp_problem *ce, const hu_grpo_problem *grpo, hu_saved *saved)
{
    const int64_t n = ce ? ce->n : grpo->batch * grpo->seq;
    hu_outputs o;
    hu_outputs_alloc(&o, n, ce ? ce->hidden : grpo->hidden, ce ? ce->vocab : grpo->vocab, 0);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    const fh_status st = hu_run(ctx, forward, ce, grpo, NULL, &o);
    TU_CHECK(st == FH_OK, "forward for the saved state: %d", (int)st);
    fh_context_destroy(ctx);
    hu_saved_from(saved, &o, n);
    hu_outputs_free(&o);
}

static void problems_init(problems *p)
{
    memset(p, 0, sizeof *p); /* ce_saved_bf16 stays empty without a bf16 provider */
    cp_problem_init(&p->ce_mean, 37, 16, 300, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
    cp_problem_randomize(&p->ce_mean, 41, 3.0);
    p->ce_mean.options.label_smoothing = 0.1;
    p->ce_mean.options.z_loss = 1e-4;
    p->ce_mean.options.softcap = 20.0;
    p->ce_mean.targets[3] = -100;
    cp_problem_init(&p->ce_none, 23, 9, 211, FH_LAYOUT_HV, 0);
    cp_problem_randomize(&p->ce_none, 42, 3.0);
    p->ce_none.options.reduction = FH_REDUCTION_NONE;
    /* bf16 x and weight: the oneDNN provider's cache is one more allocation of the library's. */
    cp_problem_init(&p->ce_bf16, 37, 16, 300, FH_LAYOUT_VH, CP_BIAS);
    cp_problem_randomize(&p->ce_bf16, 44, 3.0);
    cp_problem_use_bf16(&p->ce_bf16);
    hu_grpo_problem_init(&p->grpo, 4, 11, 16, 257, FH_LAYOUT_VH, 1, 43);
    p->grpo.options.entropy_coef = 0.01;
    p->kto_per_sequence = p->grpo;
    p->kto_per_sequence.kto_ref_per_sequence = 1;
    p->kto_per_sequence.kto_kl_per_sequence = 1;
    saved_from_forward(HU_fh_ce_forward, &p->ce_mean, NULL, &p->ce_saved_mean);
    saved_from_forward(HU_fh_ce_forward, &p->ce_none, NULL, &p->ce_saved_none);
    saved_from_forward(HU_fh_ce_forward, &p->ce_bf16, NULL, &p->ce_saved_bf16);
    saved_from_forward(HU_fh_grpo_forward, NULL, &p->grpo, &p->grpo_saved);
    for (int k = 0; k < 3; k++) {
        hu_grpo_problem_init(&p->distill_bf16[k], 4, 11, 16, 257, FH_LAYOUT_VH, 1, 43);
        hu_distill_use_bf16(&p->distill_bf16[k], k != 1, k != 0);
    }
}

static void problems_free(problems *p)
{
    cp_problem_free(&p->ce_mean);
    cp_problem_free(&p->ce_none);
    cp_problem_free(&p->ce_bf16);
    hu_grpo_problem_free(&p->grpo);
    for (int k = 0; k < 3; k++)
        hu_grpo_problem_free(&p->distill_bf16[k]);
    hu_saved_free(&p->ce_saved_mean);
    hu_saved_free(&p->ce_saved_none);
    hu_saved_free(&p->ce_saved_bf16);
    hu_saved_free(&p->grpo_saved);
}

/* The call's outputs under `budget` (0: the default), on 2 threads with default tiles. */
static void distill_outputs_under(const hu_grpo_problem *g, hu_call call, int64_t budget, hu_outputs *o)
{
    const int64_t n = g->batch * g->seq;
    hu_outputs_alloc(o, n, g->hidden, g->vocab, g->bias != NULL);
    hu_outputs_fill(o, 0);
    fh_context *ctx = tu_context(2, 0, 0, budget);
    TU_CHECK(hu_run(ctx, call, NULL, g, NULL, o) == FH_OK, "%s, budget %lld", hu_call_name(call), (long long)budget);
    fh_context_destroy(ctx);
}

/* The budget under which the distillation train step streams, checked (forward KL): the step's losses are then
 * bitwise the forward's (both fold the same vocabulary tiles in the same order), and under the default budget
 * (row blocks: one tile of the whole vocabulary) the soft loss is not (per-token losses are fp32 and may round
 * alike). */
static int64_t distill_streaming_budget(const hu_grpo_problem *g)
{
    fh_linear student, teacher;
    hu_distill_linears(g, &student, &teacher);
    const int64_t budget = hu_distill_streaming_budget(&student, &teacher, 2);
    TU_CHECK(budget > 0, "no budget holds the distillation calls' smallest tiles");
    /* The forward KL: its first pass rescales running sums from tile to tile, so other tiles change its bits. */
    hu_grpo_problem kl = *g;
    kl.distill.divergence = FH_DIVERGENCE_FORWARD_KL;
    hu_outputs forward, streamed, blocks;
    distill_outputs_under(&kl, HU_fh_distill_forward, budget, &forward);
    distill_outputs_under(&kl, HU_fh_distill_forward_backward, budget, &streamed);
    distill_outputs_under(&kl, HU_fh_distill_forward_backward, 0, &blocks);
    const size_t bytes = (size_t)forward.n * sizeof(float);
    TU_CHECK(memcmp(forward.per_token_loss, streamed.per_token_loss, bytes) == 0 &&
                 memcmp(&forward.soft_loss, &streamed.soft_loss, sizeof(double)) == 0,
             "budget %lld: the train step's losses are not the streaming forward's (does it stream?)",
             (long long)budget);
    TU_CHECK(memcmp(&forward.soft_loss, &blocks.soft_loss, sizeof(double)) != 0,
             "default budget: the train step's soft loss %.17g is bitwise the streaming forward's (row blocks fold "
             "the whole vocabulary at once, so it should differ in the last bits)", blocks.soft_loss);
    if (getenv("FH_HARDENING_VERBOSE"))
        printf("\n    distillation streams under a budget of %lld bytes", (long long)budget);
    hu_outputs_free(&forward);
    hu_outputs_free(&streamed);
    hu_outputs_free(&blocks);
    return budget;
}

/* The budget under which the top-k train step streams, checked: below the workspace its row blocks take. */
static int64_t topk_streaming_budget(const hu_grpo_problem *g)
{
    fh_linear student, teacher;
    hu_distill_linears(g, &student, &teacher);
    const int64_t budget = hu_distill_streaming_budget(&student, NULL, 2);
    fh_context *ctx = tu_context(2, 0, 0, 0);
    size_t row_blocks = 0;
    const fh_status st = fh_distill_topk_workspace_size(ctx, &student, &row_blocks);
    fh_context_destroy(ctx);
    TU_CHECK(budget > 0 && st == FH_OK && (size_t)budget < row_blocks,
             "top-k: a streaming budget of %lld bytes, row blocks take %zu (status %d)", (long long)budget, row_blocks,
             (int)st);
    return budget;
}

/* Distillation beyond the loop over every entry point (whose variants run its train step in row blocks): the
 * streaming schedule, each divergence and reduction, no targets, and bf16 students and teachers (the oneDNN
 * provider's cache is one more library allocation), in row blocks and streaming. */
static void distill_scenarios(problems *p)
{
    const int64_t streaming = distill_streaming_budget(&p->grpo);
    /* Shallow copies of the problem with other options (they share its arrays; never freed). */
    hu_grpo_problem none = p->grpo, reverse = p->grpo, forward_kl = p->grpo, reverse_jsd = p->grpo;
    none.distill.reduction = FH_REDUCTION_NONE;
    none.distill.divergence = FH_DIVERGENCE_FORWARD_KL;
    reverse.distill.reduction = FH_REDUCTION_SUM;
    reverse.distill.divergence = FH_DIVERGENCE_REVERSE_KL;
    forward_kl.distill.beta = 0.0; /* jsd at beta 0 is the forward KL */
    forward_kl.distill.weight_hard_loss = 0.0;
    forward_kl.distill_no_targets = 1;
    reverse_jsd.distill.beta = 1.0;
    reverse_jsd.distill.temperature = 1.0;
    const struct {
        const char *what;
        const hu_grpo_problem *g;
    } problems_of[] = {
        {"jsd, mean", &p->grpo},
        {"forward_kl, none", &none},
        {"reverse_kl, sum", &reverse},
        {"jsd beta 0, no targets", &forward_kl},
        {"jsd beta 1, temperature 1", &reverse_jsd},
        {"bf16 student", &p->distill_bf16[0]},
        {"bf16 teacher", &p->distill_bf16[1]},
        {"bf16 student and teacher", &p->distill_bf16[2]},
    };
    const int count = (int)TU_COUNT(problems_of);
    for (int k = 0; k < count; k++) {
        /* bf16 students' streaming backward holds f32 gradient accumulators: a budget of their own. */
        fh_linear student, teacher;
        hu_distill_linears(problems_of[k].g, &student, &teacher);
        const int64_t budget = k < 5 ? streaming : hu_distill_streaming_budget(&student, &teacher, 2);
        TU_CHECK(budget > 0, "%s: no streaming budget", problems_of[k].what);
        for (int call = HU_fh_distill_forward; call <= HU_fh_distill_forward_backward; call++)
            for (int schedule = 0; schedule < 2; schedule++) {
                /* 0: row blocks of 8 rows on 2 threads (small tiles for the forward); 1: streaming. */
                char label[160];
                snprintf(label, sizeof label, "%s (%s), %s", hu_call_name((hu_call)call), problems_of[k].what,
                         schedule ? "streaming budget" : "row blocks / small tiles");
                const scenario s = {label,      (hu_call)call, &p->ce_mean, problems_of[k].g, NULL, 2, schedule ? 0 : 8,
                                    schedule ? 0 : 64, schedule ? budget : 0, 0.0};
                run_scenario(&s);
            }
    }
    /* Top-k distillation: without the tail and reduction none, and a bf16 student, in both schedules. */
    hu_grpo_problem no_tail = p->grpo;
    no_tail.distill_topk.add_tail = 0;
    no_tail.distill_topk.reduction = FH_REDUCTION_NONE;
    const struct {
        const char *what;
        const hu_grpo_problem *g;
    } topk_problems[] = {{"tail, mean", &p->grpo}, {"no tail, none", &no_tail}, {"bf16 student", &p->distill_bf16[0]}};
    for (size_t k = 0; k < TU_COUNT(topk_problems); k++) {
        const int64_t budget = topk_streaming_budget(topk_problems[k].g);
        for (int call = HU_fh_distill_topk_forward; call <= HU_fh_distill_topk_forward_backward; call++)
            for (int schedule = 0; schedule < 2; schedule++) {
                char label[160];
                snprintf(label, sizeof label, "%s (%s), %s", hu_call_name((hu_call)call), topk_problems[k].what,
                         schedule ? "streaming budget" : "row blocks / small tiles");
                const scenario s = {label,     (hu_call)call,      &p->ce_mean,          topk_problems[k].g,
                                    NULL,      2,                  schedule ? 0 : 8,     schedule ? 0 : 64,
                                    schedule ? budget : 0, 0.0};
                run_scenario(&s);
            }
    }
}

static void test_every_entry_point(void)
{
    if (!hooks_ready())
        return;
    problems p;
    problems_init(&p);
    for (int call = 0; call < HU_CALL_COUNT; call++)
        for (int variant = 0; variant < 3; variant++) {
            /* 0: 2 threads, small tiles; 1: 1 thread, default tiles; 2: a budget that forces the train step
             * to stream (and small tiles elsewhere). */
            const int grpo = hu_call_on_sequences((hu_call)call);
            const int none = !grpo && variant == 1;
            const int kto_per_sequence = hu_call_is_kto((hu_call)call) && variant == 1;
            char label[128];
            snprintf(label, sizeof label, "%s, variant %d%s%s", hu_call_name((hu_call)call), variant,
                     none ? " (reduction none)" : "", kto_per_sequence ? " (reference and KL per sequence)" : "");
            const scenario s = {label,
                                (hu_call)call,
                                none ? &p.ce_none : &p.ce_mean,
                                kto_per_sequence ? &p.kto_per_sequence : &p.grpo,
                                grpo ? &p.grpo_saved : none ? &p.ce_saved_none : &p.ce_saved_mean,
                                variant == 1 ? 1 : 2,
                                variant == 1 ? 0 : 8,
                                variant == 1 ? 0 : 64,
                                variant == 2 ? 200000 : 0,
                                0.0};
            run_scenario(&s);
        }
    /* Gradient filtering: its buffers are the workspace's, and bf16 filtering makes the per-block GEMMs ready
     * up front like the others. */
    for (int call = 0; call < HU_CALL_COUNT; call++) {
        const int grpo = hu_call_on_sequences((hu_call)call);
        char label[128];
        snprintf(label, sizeof label, "%s, gradient filtering", hu_call_name((hu_call)call));
        const scenario s = {label, (hu_call)call, &p.ce_mean, &p.grpo, grpo ? &p.grpo_saved : &p.ce_saved_mean, 2,
                            8, 64, 0, 0.02};
        run_scenario(&s);
    }
    for (int call = HU_fh_ce_forward; call <= HU_fh_ce_forward_backward; call++)
        for (int variant = 0; variant < 2; variant++) {
            char label[128];
            snprintf(label, sizeof label, "bf16 %s, variant %d", hu_call_name((hu_call)call), variant);
            const scenario s = {label, (hu_call)call, &p.ce_bf16, &p.grpo, &p.ce_saved_bf16, 2, variant ? 0 : 8,
                                variant ? 0 : 64, 0, 0.0};
            run_scenario(&s);
            char filtered[160];
            snprintf(filtered, sizeof filtered, "%s, gradient filtering", label);
            const scenario f = {filtered, (hu_call)call, &p.ce_bf16, &p.grpo, &p.ce_saved_bf16, 2, variant ? 0 : 8,
                                variant ? 0 : 64, 0, 0.02};
            run_scenario(&f);
        }
    distill_scenarios(&p);
    problems_free(&p);
}

/* A context whose workspace was sized by a small call: a larger call fails to grow it, then the small call
 * runs again without allocating, and the larger one succeeds once allocation works. */
static void test_failed_growth_keeps_workspace(void)
{
    if (!hooks_ready())
        return;
    cp_problem small, large;
    cp_problem_init(&small, 5, 8, 50, FH_LAYOUT_HV, CP_BIAS);
    cp_problem_randomize(&small, 51, 3.0);
    cp_problem_init(&large, 300, 8, 3000, FH_LAYOUT_HV, CP_BIAS);
    cp_problem_randomize(&large, 52, 3.0);
    for (int call = HU_fh_ce_forward; call <= HU_fh_ce_forward_backward; call++) {
        const hu_call c = (hu_call)call;
        hu_saved saved_small, saved_large;
        saved_from_forward(HU_fh_ce_forward, &small, NULL, &saved_small);
        saved_from_forward(HU_fh_ce_forward, &large, NULL, &saved_large);
        hu_outputs out_small, ref_small, out_large, ref_large;
        hu_outputs_alloc(&out_small, small.n, small.hidden, small.vocab, 1);
        hu_outputs_alloc(&ref_small, small.n, small.hidden, small.vocab, 1);
        hu_outputs_alloc(&out_large, large.n, large.hidden, large.vocab, 1);
        hu_outputs_alloc(&ref_large, large.n, large.hidden, large.vocab, 1);
        hu_outputs_fill(&ref_small, TU_CANARY);
        hu_outputs_fill(&ref_large, TU_CANARY);
        fh_context *ctx = tu_context(2, 0, 0, 0);
        TU_CHECK(hu_run(ctx, c, &large, NULL, &saved_large, &ref_large) == FH_OK, "large warm-up");
        fh_context_destroy(ctx);

        ctx = tu_context(2, 0, 0, 0);
        TU_CHECK(hu_run(ctx, c, &small, NULL, &saved_small, &ref_small) == FH_OK, "small call");
        ah_arm(0, AH_LIBRARY);
        hu_outputs_fill(&out_large, TU_CANARY);
        fh_status st = hu_run(ctx, c, &large, NULL, &saved_large, &out_large);
        const long injected = ah_failures();
        ah_disarm();
        TU_CHECK(injected == 1 && st == FH_ERR_OUT_OF_MEMORY, "%s: growing the workspace: %ld failures, status %d",
                 hu_call_name(c), injected, (int)st);
        TU_CHECK(hu_outputs_untouched(&out_large, TU_CANARY), "%s: the failed call wrote an output",
                 hu_call_name(c));
        ah_reset(AH_LIBRARY);
        hu_outputs_fill(&out_small, TU_CANARY);
        st = hu_run(ctx, c, &small, NULL, &saved_small, &out_small);
        TU_CHECK(st == FH_OK && ah_counted() == 0, "%s: small call after the failed growth: status %d, %ld library "
                 "allocations (its workspace must have been kept)", hu_call_name(c), (int)st, ah_counted());
        const char *d = hu_outputs_diff(&out_small, &ref_small);
        TU_CHECK(d == NULL, "%s: small call after the failed growth: %s differs", hu_call_name(c), d ? d : "");
        hu_outputs_fill(&out_large, TU_CANARY);
        st = hu_run(ctx, c, &large, NULL, &saved_large, &out_large);
        d = hu_outputs_diff(&out_large, &ref_large);
        TU_CHECK(st == FH_OK && d == NULL, "%s: large call once allocation works: status %d, %s", hu_call_name(c),
                 (int)st, d ? d : "identical");
        fh_context_destroy(ctx);
        TU_CHECK(ah_live_library_blocks() == 0, "%s: %ld library blocks live after destroy", hu_call_name(c),
                 ah_live_library_blocks());
        hu_outputs_free(&out_small);
        hu_outputs_free(&ref_small);
        hu_outputs_free(&out_large);
        hu_outputs_free(&ref_large);
        hu_saved_free(&saved_small);
        hu_saved_free(&saved_large);
    }
    cp_problem_free(&small);
    cp_problem_free(&large);
}

/* With a caller workspace of the queried size, no entry point allocates at all; on oneDNN's fp32 path, once the
 * context holds the call's primitives (built by a first call, fh_context_set_workspace's contract). */
static void test_caller_workspace_never_allocates(void)
{
    if (!hooks_ready())
        return;
    fh_kernel_info kernels;
    const int primitives = fh_kernel_query(&kernels) == FH_OK && strcmp(kernels.fp32_path, "onednn") == 0;
    problems p;
    problems_init(&p);
    for (int call = 0; call < HU_CALL_COUNT; call++) {
        const hu_call c = (hu_call)call;
        const int grpo = hu_call_on_sequences(c);
        fh_context *ctx = tu_context(2, 8, 64, 0);
        fh_linear lin;
        size_t bytes = 0;
        fh_status st;
        if (hu_call_is_distill(c)) {
            fh_linear teacher;
            hu_distill_linears(&p.grpo, &lin, &teacher);
            st = fh_distill_workspace_size(ctx, &lin, &teacher, &p.grpo.distill, &bytes);
        } else if (hu_call_is_distill_topk(c)) {
            hu_grpo_linear(&p.grpo, &lin);
            st = fh_distill_topk_workspace_size(ctx, &lin, &bytes);
        } else if (hu_call_is_support(c)) {
            hu_grpo_linear(&p.grpo, &lin);
            fh_support support;
            hu_support(&p.grpo, &support);
            st = fh_logprob_support_workspace_size(ctx, &lin, &support, &bytes);
        } else if (grpo) {
            hu_grpo_linear(&p.grpo, &lin);
            st = hu_call_is_preference(c) ? fh_preference_workspace_size(ctx, &lin, &bytes)
                 : hu_call_is_kto(c)      ? fh_kto_workspace_size(ctx, &lin, &bytes)
                                          : fh_grpo_workspace_size(ctx, &lin, &bytes);
        } else {
            cp_problem_linear(&p.ce_mean, &lin);
            st = c >= HU_fh_logprob_forward ? fh_logprob_workspace_size(ctx, &lin, &bytes)
                 : c == HU_fh_ce_forward_backward
                     ? fh_ce_forward_backward_workspace_size(ctx, &lin, &p.ce_mean.options, &bytes)
                                         : fh_ce_workspace_size(ctx, &lin, &p.ce_mean.options, &bytes);
        }
        TU_CHECK(st == FH_OK, "%s: workspace query: %d", hu_call_name(c), (int)st);
        void *ws = malloc(bytes);
        TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "set_workspace");
        const int64_t n = grpo ? p.grpo.batch * p.grpo.seq : p.ce_mean.n;
        hu_outputs o;
        hu_outputs_alloc(&o, n, grpo ? p.grpo.hidden : p.ce_mean.hidden, grpo ? p.grpo.vocab : p.ce_mean.vocab, 1);
        if (primitives) {
            /* The first call creates the oneDNN provider's primitive cache: one library allocation, kept. */
            ah_reset(AH_LIBRARY);
            st = hu_run(ctx, c, &p.ce_mean, &p.grpo, grpo ? &p.grpo_saved : &p.ce_saved_mean, &o);
            TU_CHECK(st == FH_OK && ah_counted() <= 1, "%s: first call with a caller workspace: status %d, %ld "
                     "library allocations (at most the GEMM cache expected)", hu_call_name(c), (int)st, ah_counted());
        }
        ah_arm(0, AH_LIBRARY); /* any library allocation would fail */
        st = hu_run(ctx, c, &p.ce_mean, &p.grpo, grpo ? &p.grpo_saved : &p.ce_saved_mean, &o);
        const long counted = ah_counted();
        ah_disarm();
        TU_CHECK(st == FH_OK && counted == 0, "%s with a caller workspace: status %d, %ld library allocations",
                 hu_call_name(c), (int)st, counted);
        fh_context_destroy(ctx);
        free(ws);
        hu_outputs_free(&o);
    }
    /* Both distillations: default tiles (row blocks), the streaming budget, bf16 students and teachers (top-k has
     * no teacher head: its query and budget take none). */
    static const hu_call distill_calls[] = {HU_fh_distill_forward, HU_fh_distill_forward_backward,
                                            HU_fh_distill_topk_forward, HU_fh_distill_topk_forward_backward};
    for (int k = 0; k < 4; k++) {
        const hu_grpo_problem *g = k == 0 ? &p.grpo : &p.distill_bf16[k - 1];
        fh_linear student, teacher_head;
        hu_distill_linears(g, &student, &teacher_head);
        for (int schedule = 0; schedule < 2; schedule++)
            for (size_t c = 0; c < TU_COUNT(distill_calls); c++) {
                const hu_call call = distill_calls[c];
                const fh_linear *teacher = hu_call_is_distill(call) ? &teacher_head : NULL;
                const int64_t budget = schedule ? hu_distill_streaming_budget(&student, teacher, 2) : 0;
                fh_context *ctx = tu_context(2, 0, 0, budget);
                size_t bytes = 0;
                fh_status st = teacher ? fh_distill_workspace_size(ctx, &student, teacher, &g->distill, &bytes)
                                       : fh_distill_topk_workspace_size(ctx, &student, &bytes);
                TU_CHECK(st == FH_OK, "%s workspace query: %d", hu_call_name(call), (int)st);
                void *ws = malloc(bytes);
                TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "set_workspace");
                hu_outputs o;
                hu_outputs_alloc(&o, g->batch * g->seq, g->hidden, g->vocab, 1);
                if (k > 0 || primitives) {
                    /* bf16, or fp32 on oneDNN's path: the first call on a context creates the oneDNN provider's
                     * primitive cache (one library allocation, kept by the context), caller workspace or not; the
                     * calls after it allocate nothing. */
                    ah_reset(AH_LIBRARY);
                    st = hu_run(ctx, call, NULL, g, NULL, &o);
                    TU_CHECK(st == FH_OK && ah_counted() <= 1, "%s (problem %d): first bf16 call with a caller "
                             "workspace: status %d, %ld library allocations (at most the GEMM cache expected)",
                             hu_call_name(call), k, (int)st, ah_counted());
                }
                ah_arm(0, AH_LIBRARY);
                st = hu_run(ctx, call, NULL, g, NULL, &o);
                const long counted = ah_counted();
                ah_disarm();
                TU_CHECK(st == FH_OK && counted == 0,
                         "%s (problem %d, %s) with a caller workspace of %zu bytes: status %d, %ld library "
                         "allocations", hu_call_name(call), k, schedule ? "streaming" : "row blocks", bytes,
                         (int)st, counted);
                fh_context_destroy(ctx);
                free(ws);
                hu_outputs_free(&o);
            }
    }
    problems_free(&p);
}

/* Every libc allocation of the wisdom functions fails in turn (fopen's FILE and buffer). */
static void test_wisdom_io_under_allocation_failure(void)
{
    if (!hooks_ready())
        return;
    char path[] = "/tmp/fh_hardening_wisdom_XXXXXX";
    const int fd = mkstemp(path);
    TU_CHECK(fd >= 0, "mkstemp");
    if (fd < 0)
        return;
    close(fd);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    const fh_tile_config e = {1, 100, 64, 1000, FH_CALL_FORWARD, 64, 256, FH_DTYPE_F32};
    TU_CHECK(fh_context_add_wisdom(ctx, &e) == FH_OK, "add_wisdom");
    TU_CHECK(fh_context_save_wisdom(ctx, path) == FH_OK, "save_wisdom");
    const long live_before = ah_live_library_blocks(); /* ctx itself */
    for (int which = 0; which < 3; which++) {
        long k;
        for (k = 0; k < MAX_STEPS; k++) {
            fh_context *target = NULL;
            fh_status st;
            if (which == 2) {
                setenv("FH_WISDOM", path, 1);
                fh_context *sentinel = (fh_context *)(uintptr_t)0x5A5A5A5A;
                target = sentinel;
                ah_arm(k, AH_THIS_THREAD);
                st = fh_context_create(&target);
                ah_disarm();
                unsetenv("FH_WISDOM");
                if (st != FH_OK)
                    TU_CHECK(target == sentinel, "fh_context_create with FH_WISDOM: a failure wrote the pointer");
                else
                    fh_context_destroy(target);
            } else {
                ah_arm(k, AH_THIS_THREAD);
                st = which == 0 ? fh_context_load_wisdom(ctx, path) : fh_context_save_wisdom(ctx, path);
                ah_disarm();
            }
            const long injected = ah_failures();
            TU_CHECK(st == FH_OK || (injected > 0 && (st == FH_ERR_WISDOM_IO || st == FH_ERR_OUT_OF_MEMORY)),
                     "%s, allocation %ld failing: status %d",
                     which == 0 ? "load_wisdom" : which == 1 ? "save_wisdom" : "create with FH_WISDOM", k, (int)st);
            if (getenv("FH_HARDENING_VERBOSE"))
                printf("\n    wisdom case %d, k = %ld: status %d, %ld failures, %ld live", which, k, (int)st, injected,
                       ah_live_library_blocks());
            TU_CHECK(ah_live_library_blocks() == live_before, "%s: %ld library blocks live, %ld before",
                     which == 2 ? "create with FH_WISDOM" : "wisdom I/O", ah_live_library_blocks(), live_before);
            if (injected == 0)
                break;
        }
        TU_CHECK(k < MAX_STEPS, "wisdom case %d: still failing after %d steps", which, MAX_STEPS);
        TU_CHECK(k > 0, "wisdom case %d: no allocation was failed (is the hook counting this thread?)", which);
    }
    /* The file written last must still load (a failed save may leave it truncated, so save it again). */
    TU_CHECK(fh_context_save_wisdom(ctx, path) == FH_OK && fh_context_load_wisdom(ctx, path) == FH_OK,
             "wisdom round trip after the injections");
    fh_context_destroy(ctx);
    TU_CHECK(ah_live_library_blocks() == 0, "%ld library blocks live", ah_live_library_blocks());
    unlink(path);
}

static const tu_test tests[] = {
    {"k-th library allocation fails, every entry point", test_every_entry_point},
    {"failed workspace growth keeps the old workspace", test_failed_growth_keeps_workspace},
    {"caller workspace: no library allocation", test_caller_workspace_never_allocates},
    {"wisdom I/O with failing libc allocations", test_wisdom_io_under_allocation_failure},
};
const tu_suite suite_alloc_failure = {tests, TU_COUNT(tests)};
