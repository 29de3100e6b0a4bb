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
#define FH_SETUP_CALL(name)
#define FH_HEAD_CALL(name) #name,
#define FH_WORKSPACE_QUERY(name)
    static const char *const names[HU_CALL_COUNT] = {
#include "entry_points.def"
    };
#undef FH_SETUP_CALL
#undef FH_HEAD_CALL
#undef FH_WORKSPACE_QUERY
    return (unsigned)call < HU_CALL_COUNT ? names[call] : "?";
}

int hu_call_on_sequences(hu_call call)
{
    return call != HU_fh_ce_forward && call != HU_fh_ce_backward && call != HU_fh_ce_forward_backward &&
           call != HU_fh_logprob_forward && call != HU_fh_logprob_backward && call != HU_fh_logprob_forward_keep &&
           call != HU_fh_logprob_backward_kept && call != HU_fh_logprob_forward_backward;
}

int hu_call_is_preference(hu_call call)
{
    return call == HU_fh_preference_forward || call == HU_fh_preference_forward_backward;
}

int hu_call_is_kto(hu_call call)
{
    return call == HU_fh_kto_forward || call == HU_fh_kto_forward_backward;
}

int hu_call_is_distill(hu_call call)
{
    return call == HU_fh_distill_forward || call == HU_fh_distill_forward_backward;
}

int hu_call_is_distill_topk(hu_call call)
{
    return call == HU_fh_distill_topk_forward || call == HU_fh_distill_topk_forward_backward;
}

int hu_call_is_support(hu_call call)
{
    return call == HU_fh_logprob_support_forward || call == HU_fh_logprob_support_backward ||
           call == HU_fh_logprob_support_forward_backward;
}

int hu_call_has_grads(hu_call call)
{
    return call == HU_fh_ce_backward || call == HU_fh_ce_forward_backward || call == HU_fh_logprob_backward ||
           call == HU_fh_logprob_backward_kept || call == HU_fh_logprob_support_backward ||
           call == HU_fh_logprob_support_forward_backward ||
           call == HU_fh_logprob_forward_backward || call == HU_fh_grpo_backward ||
           call == HU_fh_grpo_forward_backward || call == HU_fh_preference_forward_backward ||
           call == HU_fh_kto_forward_backward || call == HU_fh_distill_forward_backward ||
           call == HU_fh_distill_topk_forward_backward;
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
    o->logits = tu_alloc(un * uv, sizeof(float));
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
    free(o->logits);
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
        {"kept logits", m->logits, n * v * sizeof(float)},
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
    /* The top-k teacher, from the teacher's generator (after the teacher's values). */
    p->topk_ids = tu_alloc((size_t)(n * HU_TOPK_K), sizeof(int64_t));
    p->topk_logprobs = tu_alloc((size_t)(n * HU_TOPK_K), sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        const int64_t padded = i == 3 ? HU_TOPK_K : i % 3 == 1 ? 2 : 0;
        for (int64_t e = 0; e < HU_TOPK_K; e++) {
            const int pad = e >= HU_TOPK_K - padded;
            p->topk_ids[i * HU_TOPK_K + e] = pad ? 0 : (int64_t)(ref_uniform(&teacher_rng) * (double)vocab);
            p->topk_logprobs[i * HU_TOPK_K + e] = pad ? -INFINITY : (float)(-1.0 - 0.4 * (double)e);
        }
    }
    p->support_ids = tu_alloc((size_t)(n * HU_SUPPORT_K), sizeof(int64_t));
    hu_support_fill(p->support_ids, p->ids, n, vocab);
    fh_distill_topk_options_init(&p->distill_topk);
    p->distill_topk.temperature = 0.7;
    p->distill_topk.weight_hard_loss = 0.3;
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
    free(p->topk_ids);
    free(p->topk_logprobs);
    free(p->support_ids);
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
                             p->advantages, p->old_logps, p->ref_logps, p->sampling_logps, NULL, NULL};
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
                            kl && p->kto_kl_per_sequence ? p->kto_kl_logratios : NULL, NULL};
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

void hu_support_fill(int64_t *ids, const int64_t *targets, int64_t n, int64_t vocab)
{
    for (int64_t i = 0; i < n; i++) {
        const int64_t y = targets[i] >= 0 && targets[i] < vocab ? targets[i] : 0;
        for (int64_t e = 0; e < HU_SUPPORT_K; e++)
            ids[i * HU_SUPPORT_K + e] = (i % 3 == 2 && e >= HU_SUPPORT_K - 2) || e >= vocab ? -1 : (y + e) % vocab;
    }
}

void hu_support(const hu_grpo_problem *p, fh_support *support)
{
    const fh_support s = {p->support_ids, NULL, HU_SUPPORT_K};
    *support = s;
}

void hu_topk_teacher(const hu_grpo_problem *p, fh_topk_teacher *teacher)
{
    const fh_topk_teacher t = {HU_TOPK_K, p->topk_ids, p->topk_logprobs};
    *teacher = t;
}

/* The distillation query with a teacher, top-k's without. */
static fh_status distill_query(const fh_context *ctx, const fh_linear *student, const fh_linear *teacher, size_t *bytes)
{
    fh_distill_options o;
    fh_distill_options_init(&o);
    return teacher ? fh_distill_workspace_size(ctx, student, teacher, &o, bytes)
                   : fh_distill_topk_workspace_size(ctx, student, bytes);
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
    if (distill_query(ctx, student, teacher, &bytes) != FH_OK) {
        fh_context_destroy(ctx);
        return 0;
    }
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, mid);
        if (distill_query(ctx, student, teacher, &bytes) == FH_OK)
            hi = mid;
        else
            lo = mid;
    }
    fh_context_destroy(ctx);
    /* Half of what the row blocks' logits alone take (min(n, 256) rows of both heads, or of the student's for
     * top-k): larger streaming tiles than the smallest (faster), still too small for row blocks. */
    const int64_t rows = student->n < 256 ? student->n : 256;
    const int64_t half = rows * student->vocab * (teacher ? 4 : 2);
    return half > hi ? half : hi;
}

void hu_saved_from(hu_saved *s, const hu_outputs *forward, int64_t n)
{
    const size_t logits = (size_t)n * (size_t)forward->vocab;
    s->lse = tu_alloc((size_t)n, sizeof(float));
    s->logp = tu_alloc((size_t)n, sizeof(float));
    s->entropy = tu_alloc((size_t)n, sizeof(float));
    s->logits = tu_alloc(logits, sizeof(float));
    memcpy(s->lse, forward->lse, (size_t)n * sizeof(float));
    memcpy(s->logp, forward->logp, (size_t)n * sizeof(float));
    memcpy(s->entropy, forward->entropy, (size_t)n * sizeof(float));
    memcpy(s->logits, forward->logits, logits * sizeof(float));
}

void hu_saved_free(hu_saved *s)
{
    free(s->lse);
    free(s->logp);
    free(s->entropy);
    free(s->logits);
    memset(s, 0, sizeof *s);
}

/* The calls of a cp_problem: cross-entropy and log-probs. */
static fh_status run_on_tokens(fh_context *ctx, hu_call call, const cp_problem *p_ce, const hu_saved *saved,
                               hu_outputs *o, fh_linear_grads *g)
{
    fh_linear lin;
    cp_problem_linear(p_ce, &lin);
    fh_ce_outputs out = {&o->loss, &o->z_loss, o->per_token_loss, o->logp, o->lse, o->argmax, NULL, NULL};
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    lo.ignore_index = p_ce->options.ignore_index;
    lo.softcap = p_ce->options.softcap;
    fh_logprob_outputs lout = {o->logp, o->entropy, o->lse};
    const float *up = p_ce->grad_output;
    switch (call) {
    case HU_fh_logprob_forward: return fh_logprob_forward(ctx, &lin, p_ce->targets, &lo, &lout);
    case HU_fh_logprob_backward:
        return fh_logprob_backward(ctx, &lin, p_ce->targets, &lo, saved->lse, NULL, up, NULL, up, g);
    case HU_fh_logprob_forward_keep: return fh_logprob_forward_keep(ctx, &lin, p_ce->targets, &lo, &lout, o->logits);
    case HU_fh_logprob_backward_kept:
        return fh_logprob_backward_kept(ctx, &lin, p_ce->targets, &lo, saved->logits, saved->lse, NULL, up, NULL, up, g);
    case HU_fh_logprob_forward_backward:
        return fh_logprob_forward_backward(ctx, &lin, p_ce->targets, &lo, up, up, up, &lout, g);
    case HU_fh_ce_forward: return fh_ce_forward(ctx, &lin, p_ce->targets, &p_ce->options, &out);
    case HU_fh_ce_backward:
        return fh_ce_backward(ctx, &lin, p_ce->targets, &p_ce->options, saved->lse, p_ce->grad_output, g);
    default: return fh_ce_forward_backward(ctx, &lin, p_ce->targets, &p_ce->options, p_ce->grad_output, &out, g);
    }
}

static fh_status run_distill(fh_context *ctx, hu_call call, const hu_grpo_problem *p, hu_outputs *o,
                             fh_linear_grads *g)
{
    fh_linear lin, teacher;
    hu_distill_linears(p, &lin, &teacher);
    const int64_t *targets = p->distill_no_targets ? NULL : p->ids;
    fh_distill_outputs out = {&o->loss, &o->soft_loss, &o->hard_loss, o->per_token_loss};
    if (call == HU_fh_distill_forward)
        return fh_distill_forward(ctx, &lin, &teacher, targets, &p->distill, &out);
    return fh_distill_forward_backward(ctx, &lin, &teacher, targets, &p->distill, p->distill_grad, &out, g);
}

static fh_status run_distill_topk(fh_context *ctx, hu_call call, const hu_grpo_problem *p, hu_outputs *o,
                                  fh_linear_grads *g)
{
    fh_linear lin, unused;
    hu_distill_linears(p, &lin, &unused); /* the student, bf16 where hu_distill_use_bf16 made it */
    fh_topk_teacher teacher;
    hu_topk_teacher(p, &teacher);
    const int64_t *targets = p->distill_no_targets ? NULL : p->ids;
    fh_distill_outputs out = {&o->loss, &o->soft_loss, &o->hard_loss, o->per_token_loss};
    if (call == HU_fh_distill_topk_forward)
        return fh_distill_topk_forward(ctx, &lin, &teacher, targets, &p->distill_topk, &out);
    return fh_distill_topk_forward_backward(ctx, &lin, &teacher, targets, &p->distill_topk, p->distill_grad, &out, g);
}

static fh_status run_support(fh_context *ctx, hu_call call, const hu_grpo_problem *p, const hu_saved *saved,
                             hu_outputs *o, fh_linear_grads *g)
{
    fh_linear lin;
    hu_grpo_linear(p, &lin);
    fh_support support;
    hu_support(p, &support);
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    lo.temperature = 0.9;
    fh_logprob_outputs out = {o->logp, o->entropy, o->lse};
    const float *up = p->distill_grad;
    if (call == HU_fh_logprob_support_forward)
        return fh_logprob_support_forward(ctx, &lin, p->ids, &support, &lo, &out);
    if (call == HU_fh_logprob_support_backward)
        return fh_logprob_support_backward(ctx, &lin, p->ids, &support, &lo, saved->lse, saved->entropy, up, up, up, g);
    return fh_logprob_support_forward_backward(ctx, &lin, p->ids, &support, &lo, up, up, up, &out, g);
}

static fh_status run_preference(fh_context *ctx, hu_call call, const hu_grpo_problem *p, hu_outputs *o,
                                fh_linear_grads *g)
{
    TU_CHECK(p->batch % 2 == 0, "a preference call needs an even batch, got %lld", (long long)p->batch);
    fh_linear lin;
    hu_grpo_linear(p, &lin);
    const fh_preference_batch pairs = {p->batch / 2, p->seq, p->ids, p->mask, NULL, p->ref_logps, NULL};
    fh_preference_outputs out = {&o->loss, &o->preference_metrics, o->sequence_logps, o->rewards, o->logp};
    if (call == HU_fh_preference_forward)
        return fh_preference_forward(ctx, &lin, &pairs, &p->preference, &out);
    return fh_preference_forward_backward(ctx, &lin, &pairs, &p->preference, &p->grad_output, &out, g);
}

static fh_status run_kto(fh_context *ctx, hu_call call, const hu_grpo_problem *p, hu_outputs *o, fh_linear_grads *g)
{
    fh_linear lin;
    hu_grpo_linear(p, &lin);
    fh_kto_batch batch;
    hu_kto_batch(p, &batch);
    fh_kto_outputs out = {&o->loss, &o->kto_metrics, o->sequence_logps, o->rewards, o->logp};
    if (call == HU_fh_kto_forward)
        return fh_kto_forward(ctx, &lin, &batch, &p->kto, &out);
    return fh_kto_forward_backward(ctx, &lin, &batch, &p->kto, &p->grad_output, &out, g);
}

static fh_status run_grpo(fh_context *ctx, hu_call call, const hu_grpo_problem *p, const hu_saved *saved,
                          hu_outputs *o, fh_linear_grads *g)
{
    fh_linear lin;
    hu_grpo_linear(p, &lin);
    fh_grpo_batch batch;
    hu_grpo_batch(p, &batch);
    fh_grpo_outputs out = {&o->loss, &o->metrics, o->logp, o->per_token_loss, o->entropy, o->lse};
    switch (call) {
    case HU_fh_grpo_forward: return fh_grpo_forward(ctx, &lin, &batch, &p->options, &out);
    case HU_fh_grpo_backward:
        return fh_grpo_backward(ctx, &lin, &batch, &p->options, saved->logp, saved->lse, saved->entropy,
                                &p->grad_output, g);
    default: return fh_grpo_forward_backward(ctx, &lin, &batch, &p->options, &p->grad_output, &out, g);
    }
}

/* Every head call is a case here, and a listed one without a case does not compile. */
#pragma GCC diagnostic error "-Wswitch"
fh_status hu_run(fh_context *ctx, hu_call call, const cp_problem *p_ce, const hu_grpo_problem *p_grpo,
                 const hu_saved *saved, hu_outputs *o)
{
    fh_linear_grads g = {.dx = o->dx, .dx_row_stride = o->hidden, .dx_beta = 0.0f, .dweight = o->dweight,
                         .dweight_beta = 0.0f, .dbias = o->dbias, .dbias_beta = 0.0f};
    switch (call) {
    case HU_fh_ce_forward:
    case HU_fh_ce_backward:
    case HU_fh_ce_forward_backward:
    case HU_fh_logprob_forward:
    case HU_fh_logprob_backward:
    case HU_fh_logprob_forward_keep:
    case HU_fh_logprob_backward_kept:
    case HU_fh_logprob_forward_backward: return run_on_tokens(ctx, call, p_ce, saved, o, &g);
    case HU_fh_grpo_forward:
    case HU_fh_grpo_backward:
    case HU_fh_grpo_forward_backward: return run_grpo(ctx, call, p_grpo, saved, o, &g);
    case HU_fh_preference_forward:
    case HU_fh_preference_forward_backward: return run_preference(ctx, call, p_grpo, o, &g);
    case HU_fh_distill_forward:
    case HU_fh_distill_forward_backward: return run_distill(ctx, call, p_grpo, o, &g);
    case HU_fh_distill_topk_forward:
    case HU_fh_distill_topk_forward_backward: return run_distill_topk(ctx, call, p_grpo, o, &g);
    case HU_fh_logprob_support_forward:
    case HU_fh_logprob_support_backward:
    case HU_fh_logprob_support_forward_backward: return run_support(ctx, call, p_grpo, saved, o, &g);
    case HU_fh_kto_forward:
    case HU_fh_kto_forward_backward: return run_kto(ctx, call, p_grpo, o, &g);
    }
    TU_CHECK(0, "hu_run: %d is no head call", (int)call);
    return FH_ERR_NULL_POINTER;
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
