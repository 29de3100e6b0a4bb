#include "hardening_util.h"

#include "bf16.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *hu_call_name(hu_call call)
{
    static const char *names[HU_CALL_COUNT] = {"fh_ce_forward",         "fh_ce_backward",
                                               "fh_ce_forward_backward", "fh_logprob_forward",
                                               "fh_logprob_backward",    "fh_logprob_forward_backward",
                                               "fh_grpo_forward",
                                               "fh_grpo_backward",       "fh_grpo_forward_backward",
                                               "fh_preference_forward",  "fh_preference_forward_backward",
                                               "fh_kto_forward",         "fh_kto_forward_backward",
                                               "fh_distill_forward",     "fh_distill_forward_backward"};
    return (unsigned)call < HU_CALL_COUNT ? names[call] : "?";
}

int hu_call_on_sequences(hu_call call)
{
    return call >= HU_GRPO_FORWARD;
}

int hu_call_is_preference(hu_call call)
{
    return call == HU_PREFERENCE_FORWARD || call == HU_PREFERENCE_TRAIN_STEP;
}

int hu_call_is_kto(hu_call call)
{
    return call == HU_KTO_FORWARD || call == HU_KTO_TRAIN_STEP;
}

int hu_call_is_distill(hu_call call)
{
    return call == HU_DISTILL_FORWARD || call == HU_DISTILL_TRAIN_STEP;
}

int hu_call_has_grads(hu_call call)
{
    return call == HU_CE_BACKWARD || call == HU_CE_TRAIN_STEP || call == HU_LOGPROB_BACKWARD ||
           call == HU_LOGPROB_TRAIN_STEP || call == HU_GRPO_BACKWARD ||
           call == HU_GRPO_TRAIN_STEP || call == HU_PREFERENCE_TRAIN_STEP || call == HU_KTO_TRAIN_STEP ||
           call == HU_DISTILL_TRAIN_STEP;
}

void hu_outputs_alloc(hu_outputs *o, int64_t n, int64_t hidden, int64_t vocab, int has_bias)
{
    memset(o, 0, sizeof *o);
    o->n = n;
    o->hidden = hidden;
    o->vocab = vocab;
    o->has_bias = has_bias;
    const size_t un = (size_t)n, uh = (size_t)hidden, uv = (size_t)vocab;
    o->per_token_loss = tu_alloc(un, sizeof(float));
    o->logp = tu_alloc(un, sizeof(float));
    o->lse = tu_alloc(un, sizeof(float));
    o->entropy = tu_alloc(un, sizeof(float));
    o->argmax = tu_alloc(un, sizeof(int64_t));
    o->sequence_logps = tu_alloc(un, sizeof(float));
    o->rewards = tu_alloc(un, sizeof(float));
    o->dx = tu_alloc(un * uh, sizeof(float));
    o->dweight = tu_alloc(uh * uv, sizeof(float));
    o->dbias = has_bias ? tu_alloc(uv, sizeof(float)) : NULL;
}

void hu_outputs_free(hu_outputs *o)
{
    free(o->per_token_loss);
    free(o->logp);
    free(o->lse);
    free(o->entropy);
    free(o->argmax);
    free(o->sequence_logps);
    free(o->rewards);
    free(o->dx);
    free(o->dweight);
    free(o->dbias);
    memset(o, 0, sizeof *o);
}

typedef struct part {
    const char *name;
    void *data;
    size_t bytes;
} part;

static size_t parts_of(const hu_outputs *o, part *p)
{
    const size_t n = (size_t)o->n, h = (size_t)o->hidden, v = (size_t)o->vocab;
    hu_outputs *m = (hu_outputs *)o;
    const part all[] = {
        {"loss", &m->loss, sizeof m->loss},
        {"z_loss", &m->z_loss, sizeof m->z_loss},
        {"soft_loss", &m->soft_loss, sizeof m->soft_loss},
        {"hard_loss", &m->hard_loss, sizeof m->hard_loss},
        {"metrics", &m->metrics, sizeof m->metrics},
        {"preference_metrics", &m->preference_metrics, sizeof m->preference_metrics},
        {"kto_metrics", &m->kto_metrics, sizeof m->kto_metrics},
        {"sequence_logps", m->sequence_logps, n * sizeof(float)},
        {"rewards", m->rewards, n * sizeof(float)},
        {"per_token_loss", m->per_token_loss, n * sizeof(float)},
        {"per_token_logp", m->logp, n * sizeof(float)},
        {"lse", m->lse, n * sizeof(float)},
        {"entropy", m->entropy, n * sizeof(float)},
        {"argmax", m->argmax, n * sizeof(int64_t)},
        {"dx", m->dx, n * h * sizeof(float)},
        {"dweight", m->dweight, h * v * sizeof(float)},
        {"dbias", m->dbias, m->dbias ? v * sizeof(float) : 0},
    };
    memcpy(p, all, sizeof all);
    return TU_COUNT(all);
}

void hu_outputs_fill(hu_outputs *o, unsigned char byte)
{
    part p[20];
    const size_t count = parts_of(o, p);
    for (size_t k = 0; k < count; k++)
        if (p[k].bytes)
            memset(p[k].data, byte, p[k].bytes);
}

const char *hu_outputs_diff(const hu_outputs *a, const hu_outputs *b)
{
    part pa[20], pb[20];
    const size_t count = parts_of(a, pa);
    parts_of(b, pb);
    for (size_t k = 0; k < count; k++)
        if (pa[k].bytes != pb[k].bytes || (pa[k].bytes && memcmp(pa[k].data, pb[k].data, pa[k].bytes) != 0))
            return pa[k].name;
    return NULL;
}

int hu_outputs_untouched(const hu_outputs *o, unsigned char byte)
{
    part p[20];
    const size_t count = parts_of(o, p);
    for (size_t k = 0; k < count; k++) {
        const unsigned char *d = p[k].data;
        for (size_t i = 0; i < p[k].bytes; i++)
            if (d[i] != byte)
                return 0;
    }
    return 1;
}

void hu_grpo_problem_init(hu_grpo_problem *p, int64_t batch, int64_t seq, int64_t hidden, int64_t vocab,
                          fh_layout layout, int bias, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->batch = batch;
    p->seq = seq;
    p->hidden = hidden;
    p->vocab = vocab;
    p->layout = layout;
    const int64_t n = batch * seq;
    p->x = tu_alloc((size_t)(n * hidden), sizeof(float));
    p->weight = tu_alloc((size_t)(hidden * vocab), sizeof(float));
    p->bias = bias ? tu_alloc((size_t)vocab, sizeof(float)) : NULL;
    p->ids = tu_alloc((size_t)n, sizeof(int64_t));
    p->mask = tu_alloc((size_t)n, sizeof(float));
    p->advantages = tu_alloc((size_t)batch, sizeof(float));
    p->old_logps = tu_alloc((size_t)n, sizeof(float));
    p->ref_logps = tu_alloc((size_t)n, sizeof(float));
    uint64_t rng = seed * 7919 + 17;
    ce_fill_linear(&rng, n, hidden, vocab, 3.0, p->x, p->weight, p->bias);
    const double base = -log((double)vocab);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t length = 1 + (int64_t)(ref_uniform(&rng) * (double)seq);
        p->advantages[b] = (float)(2.0 * ref_uniform(&rng) - 1.0);
        for (int64_t t = 0; t < seq; t++) {
            const int64_t i = b * seq + t;
            p->mask[i] = t < length ? 1.0f : 0.0f;
            p->ids[i] = t >= length && ref_uniform(&rng) < 0.5 ? -100 : (int64_t)(ref_uniform(&rng) * (double)vocab);
            p->old_logps[i] = (float)(base + 0.8 * (ref_uniform(&rng) - 0.5));
            p->ref_logps[i] = (float)(base + 0.8 * (ref_uniform(&rng) - 0.5));
        }
    }
    fh_grpo_options_init(&p->options);
    p->options.beta = 0.04;
    fh_preference_options_init(&p->preference);
    p->preference.label_smoothing = 0.1; /* TRL's current DPO: MPO's list, robust reading the smoothing */
    p->preference.loss_type_count = 3;
    p->preference.loss_types[0] = FH_PREFERENCE_SIGMOID, p->preference.loss_weights[0] = 0.8;
    p->preference.loss_types[1] = FH_PREFERENCE_ROBUST, p->preference.loss_weights[1] = 0.2;
    p->preference.loss_types[2] = FH_PREFERENCE_SFT, p->preference.loss_weights[2] = 0.5;
    p->grad_output = 1.0f;
    /* The teacher, from a generator of its own (the GRPO inputs above stay those of earlier versions). */
    uint64_t teacher_rng = seed * 104729 + 29;
    p->teacher_hidden = hidden + 3;
    p->teacher_layout = layout == FH_LAYOUT_HV ? FH_LAYOUT_VH : FH_LAYOUT_HV;
    p->teacher_x = tu_alloc((size_t)(n * p->teacher_hidden), sizeof(float));
    p->teacher_weight = tu_alloc((size_t)(p->teacher_hidden * vocab), sizeof(float));
    p->teacher_bias = tu_alloc((size_t)vocab, sizeof(float));
    ce_fill_linear(&teacher_rng, n, p->teacher_hidden, vocab, 3.0, p->teacher_x, p->teacher_weight, p->teacher_bias);
    p->distill_grad = tu_alloc((size_t)n, sizeof(float));
    tu_fill_uniform(p->distill_grad, (size_t)n, &teacher_rng, 0.25, 1.25);
    fh_distill_options_init(&p->distill);
    p->distill.beta = 0.3;
    p->distill.temperature = 2.0;
    p->distill.weight_soft_loss = 0.8;
    p->distill.weight_hard_loss = 0.4;
    /* TRL's sampler log-probs, from a generator of their own too; the off-policy mask reads them as well. */
    uint64_t sampling_rng = seed * 6151 + 43;
    p->sampling_logps = tu_alloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p->sampling_logps[i] = p->old_logps[i] + (float)(0.2 * (ref_uniform(&sampling_rng) - 0.5));
    p->options.off_policy_mask_threshold = 0.0;
    /* KTO, from a generator of its own as well: labels alternate (both kinds in any batch of two or more). */
    uint64_t kto_rng = seed * 7727 + 61;
    fh_kto_options_init(&p->kto);
    p->kto.undesirable_weight = 1.5;
    p->kto_labels = tu_alloc((size_t)batch, sizeof(uint8_t));
    p->kto_ref_logps = tu_alloc((size_t)batch, sizeof(float));
    p->kto_kl_logratios = tu_alloc((size_t)batch, sizeof(float));
    p->kto_kl = (float)(0.5 * ref_uniform(&kto_rng));
    for (int64_t b = 0; b < batch; b++) {
        double sum = 0.0;
        for (int64_t t = 0; t < seq; t++)
            sum += (double)p->mask[b * seq + t] * (double)p->ref_logps[b * seq + t];
        p->kto_labels[b] = b % 2 == 0;
        p->kto_ref_logps[b] = (float)(sum + 2.0 * ref_uniform(&kto_rng) - 1.0);
        p->kto_kl_logratios[b] = (float)(ref_uniform(&kto_rng) - 0.3);
    }
}

void hu_grpo_problem_free(hu_grpo_problem *p)
{
    free(p->x);
    free(p->weight);
    free(p->bias);
    free(p->ids);
    free(p->mask);
    free(p->advantages);
    free(p->old_logps);
    free(p->sampling_logps);
    free(p->ref_logps);
    free(p->teacher_x);
    free(p->teacher_weight);
    free(p->teacher_bias);
    free(p->distill_grad);
    free(p->kto_labels);
    free(p->kto_ref_logps);
    free(p->kto_kl_logratios);
    free(p->x_bf16);
    free(p->weight_bf16);
    free(p->teacher_x_bf16);
    free(p->teacher_weight_bf16);
    memset(p, 0, sizeof *p);
}

void hu_grpo_linear(const hu_grpo_problem *p, fh_linear *lin)
{
    const fh_status st = fh_linear_init(lin, p->batch * p->seq, p->hidden, p->vocab, p->x, p->weight, p->layout,
                                        p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init: %d", (int)st);
}

void hu_grpo_batch(const hu_grpo_problem *p, fh_grpo_batch *batch)
{
    const fh_grpo_batch b = {p->batch,      p->seq,        p->ids,        p->mask,
                             p->advantages, p->old_logps, p->ref_logps, p->sampling_logps};
    *batch = b;
}

void hu_kto_batch(const hu_grpo_problem *p, fh_kto_batch *batch)
{
    const int kl = p->kto.loss_type == FH_KTO_LOSS_KTO;
    const fh_kto_batch b = {p->batch,
                            p->seq,
                            p->ids,
                            p->mask,
                            p->kto_labels,
                            p->kto_ref_per_sequence ? p->kto_ref_logps : NULL,
                            p->kto_ref_per_sequence ? NULL : p->ref_logps,
                            kl && !p->kto_kl_per_sequence ? &p->kto_kl : NULL,
                            kl && p->kto_kl_per_sequence ? p->kto_kl_logratios : NULL};
    *batch = b;
}

void hu_distill_linears(const hu_grpo_problem *p, fh_linear *student, fh_linear *teacher)
{
    const int64_t n = p->batch * p->seq;
    const int s16 = p->x_bf16 != NULL, t16 = p->teacher_x_bf16 != NULL;
    fh_status st = fh_linear_init(student, n, p->hidden, p->vocab, s16 ? (const void *)p->x_bf16 : p->x,
                                  s16 ? (const void *)p->weight_bf16 : p->weight, p->layout, p->bias);
    TU_CHECK(st == FH_OK, "fh_linear_init (student): %d", (int)st);
    student->x_dtype = student->weight_dtype = s16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    st = fh_linear_init(teacher, n, p->teacher_hidden, p->vocab, t16 ? (const void *)p->teacher_x_bf16 : p->teacher_x,
                        t16 ? (const void *)p->teacher_weight_bf16 : p->teacher_weight, p->teacher_layout,
                        p->teacher_bias);
    TU_CHECK(st == FH_OK, "fh_linear_init (teacher): %d", (int)st);
    teacher->x_dtype = teacher->weight_dtype = t16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
}

void hu_distill_use_bf16(hu_grpo_problem *p, int student, int teacher)
{
    const size_t n = (size_t)(p->batch * p->seq), v = (size_t)p->vocab;
    if (student && !p->x_bf16) {
        p->x_bf16 = bf16_round_in_place(p->x, n * (size_t)p->hidden);
        p->weight_bf16 = bf16_round_in_place(p->weight, (size_t)p->hidden * v);
        TU_CHECK(p->x_bf16 && p->weight_bf16, "bf16 copies: out of memory");
    }
    if (teacher && !p->teacher_x_bf16) {
        p->teacher_x_bf16 = bf16_round_in_place(p->teacher_x, n * (size_t)p->teacher_hidden);
        p->teacher_weight_bf16 = bf16_round_in_place(p->teacher_weight, (size_t)p->teacher_hidden * v);
        TU_CHECK(p->teacher_x_bf16 && p->teacher_weight_bf16, "bf16 copies: out of memory");
    }
}

int64_t hu_distill_streaming_budget(const fh_linear *student, const fh_linear *teacher, int threads)
{
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return 0;
    fh_context_set(ctx, FH_PARAM_THREADS, threads);
    int64_t lo = 0, hi = (int64_t)1 << 30; /* lo fails (0 is the default budget: never tried), hi works */
    size_t bytes;
    fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, hi);
    if (fh_distill_workspace_size(ctx, student, teacher, &bytes) != FH_OK) {
        fh_context_destroy(ctx);
        return 0;
    }
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, mid);
        if (fh_distill_workspace_size(ctx, student, teacher, &bytes) == FH_OK)
            hi = mid;
        else
            lo = mid;
    }
    fh_context_destroy(ctx);
    /* Half of what the row blocks' logits alone take (min(n, 256) rows of both heads): larger streaming tiles
     * than the smallest (faster), still too small for row blocks. */
    const int64_t rows = student->n < 256 ? student->n : 256;
    const int64_t half = rows * student->vocab * 4;
    return half > hi ? half : hi;
}

void hu_saved_from(hu_saved *s, const hu_outputs *forward, int64_t n)
{
    s->lse = tu_alloc((size_t)n, sizeof(float));
    s->logp = tu_alloc((size_t)n, sizeof(float));
    s->entropy = tu_alloc((size_t)n, sizeof(float));
    memcpy(s->lse, forward->lse, (size_t)n * sizeof(float));
    memcpy(s->logp, forward->logp, (size_t)n * sizeof(float));
    memcpy(s->entropy, forward->entropy, (size_t)n * sizeof(float));
}

void hu_saved_free(hu_saved *s)
{
    free(s->lse);
    free(s->logp);
    free(s->entropy);
    memset(s, 0, sizeof *s);
}

fh_status hu_run(fh_context *ctx, hu_call call, const cp_problem *p_ce, const hu_grpo_problem *p_grpo,
                 const hu_saved *saved, hu_outputs *o)
{
    fh_linear lin;
    fh_linear_grads g = {.dx = o->dx, .dx_row_stride = o->hidden, .dx_beta = 0.0f, .dweight = o->dweight, .dweight_beta = 0.0f, .dbias = o->dbias, .dbias_beta = 0.0f};
    if (!hu_call_on_sequences(call)) {
        cp_problem_linear(p_ce, &lin);
        fh_ce_outputs out = {&o->loss, &o->z_loss, o->per_token_loss, o->logp, o->lse, o->argmax, NULL, NULL};
        fh_logprob_options lo;
        fh_logprob_options_init(&lo);
        lo.ignore_index = p_ce->options.ignore_index;
        lo.softcap = p_ce->options.softcap;
        fh_logprob_outputs lout = {o->logp, o->entropy, o->lse};
        const float *up = p_ce->grad_output;
        switch (call) {
        case HU_LOGPROB_FORWARD: return fh_logprob_forward(ctx, &lin, p_ce->targets, &lo, &lout);
        case HU_LOGPROB_BACKWARD:
            return fh_logprob_backward(ctx, &lin, p_ce->targets, &lo, saved->lse, NULL, up, NULL, up, &g);
        case HU_LOGPROB_TRAIN_STEP:
            return fh_logprob_forward_backward(ctx, &lin, p_ce->targets, &lo, up, up, up, &lout, &g);
        case HU_CE_FORWARD: return fh_ce_forward(ctx, &lin, p_ce->targets, &p_ce->options, &out);
        case HU_CE_BACKWARD:
            return fh_ce_backward(ctx, &lin, p_ce->targets, &p_ce->options, saved->lse, p_ce->grad_output, &g);
        default:
            return fh_ce_forward_backward(ctx, &lin, p_ce->targets, &p_ce->options, p_ce->grad_output, &out, &g);
        }
    }
    if (hu_call_is_distill(call)) {
        fh_linear teacher;
        hu_distill_linears(p_grpo, &lin, &teacher);
        const int64_t *targets = p_grpo->distill_no_targets ? NULL : p_grpo->ids;
        fh_distill_outputs out = {&o->loss, &o->soft_loss, &o->hard_loss, o->per_token_loss};
        if (call == HU_DISTILL_FORWARD)
            return fh_distill_forward(ctx, &lin, &teacher, targets, &p_grpo->distill, &out);
        return fh_distill_forward_backward(ctx, &lin, &teacher, targets, &p_grpo->distill, p_grpo->distill_grad, &out,
                                           &g);
    }
    hu_grpo_linear(p_grpo, &lin);
    if (hu_call_is_preference(call)) {
        TU_CHECK(p_grpo->batch % 2 == 0, "a preference call needs an even batch, got %lld", (long long)p_grpo->batch);
        const fh_preference_batch pairs = {p_grpo->batch / 2, p_grpo->seq, p_grpo->ids, p_grpo->mask, NULL,
                                           p_grpo->ref_logps};
        fh_preference_outputs out = {&o->loss, &o->preference_metrics, o->sequence_logps, o->rewards, o->logp};
        if (call == HU_PREFERENCE_FORWARD)
            return fh_preference_forward(ctx, &lin, &pairs, &p_grpo->preference, &out);
        return fh_preference_forward_backward(ctx, &lin, &pairs, &p_grpo->preference, &p_grpo->grad_output, &out, &g);
    }
    if (hu_call_is_kto(call)) {
        fh_kto_batch batch;
        hu_kto_batch(p_grpo, &batch);
        fh_kto_outputs out = {&o->loss, &o->kto_metrics, o->sequence_logps, o->rewards, o->logp};
        if (call == HU_KTO_FORWARD)
            return fh_kto_forward(ctx, &lin, &batch, &p_grpo->kto, &out);
        return fh_kto_forward_backward(ctx, &lin, &batch, &p_grpo->kto, &p_grpo->grad_output, &out, &g);
    }
    fh_grpo_batch batch;
    hu_grpo_batch(p_grpo, &batch);
    fh_grpo_outputs out = {&o->loss, &o->metrics, o->logp, o->per_token_loss, o->entropy, o->lse};
    switch (call) {
    case HU_GRPO_FORWARD: return fh_grpo_forward(ctx, &lin, &batch, &p_grpo->options, &out);
    case HU_GRPO_BACKWARD:
        return fh_grpo_backward(ctx, &lin, &batch, &p_grpo->options, saved->logp, saved->lse, saved->entropy,
                                &p_grpo->grad_output, &g);
    default: return fh_grpo_forward_backward(ctx, &lin, &batch, &p_grpo->options, &p_grpo->grad_output, &out, &g);
    }
}

int hu_run_isolated(int (*body)(void *), void *arg)
{
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0)
        return 999;
    if (pid == 0) {
        alarm(60); /* a hang in the child ends as SIGALRM instead of hanging the suite */
        _exit(body(arg) & 0xff);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid)
        return 998;
    if (WIFSIGNALED(status))
        return 1000 + WTERMSIG(status);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 997;
}
