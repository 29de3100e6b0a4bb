/* fh_bench: fused vs materialized, time and peak memory.
 *
 * Every case runs in its own child process so that peak-RSS readings do not mix. In the child, inputs
 * and outputs are allocated and touched first; then the peak-RSS counter is reset (/proc/self/clear_refs)
 * and the case runs 1 + reps times: the first call is reported on its own (it pays for workspace
 * allocation and page faults), the best of the rest is the steady-state time. Efficiency is GFLOP/s
 * divided by the ceiling: the best GFLOP/s of a 2048^3 GEMM in the run's dtype (for fp32 the faster of BLIS sgemm
 * and oneDNN's f32 matmul, whichever the library uses; for bf16 the library's path) on the same threads, timed in
 * each case's child right after the case (not before: the GEMM libraries' first use and their packing buffers belong
 * to the case's first call and peak memory), as many times as the case (at most 10), and the best of
 * those over the run: a shared machine's speed drifts over minutes, so a ceiling measured once could be caught slow,
 * and would read efficiencies above 1; the best over the run's cases needs no more repetitions per case.
 *
 * --distribution says what the CE cases (and distillation's student) compute on: uniform random data (the default:
 * a near-uniform softmax), a synthetic peaked softmax of a chosen mean entropy, or a batch saved from a trained model
 * (real data; a trained head's softmax is what gradient filtering feeds on). Before the cases, a child makes the inputs once, calibrates
 * a peaked distribution and measures the softmax on a sample of rows; the report's first line states the
 * distribution, whether it is real or synthetic, and those measurements. */
#include "fusedhead.h"
#include "bench_gemm.h"
#include "bench_inputs.h"
#include "bench_softmax.h"
#include "bf16.h"
#include "materialized.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* CASE_FILTERED: the train step with gradient filtering (--grad-filter-eps), beside the exact one; its flop basis
 * stays the dense 6NHV, so that its GFLOP/s and efficiency read as speed against the same work. Its process then
 * also times the two alternately (result.paired_*), so that a slow spell of the machine hits both alike. */
/* CASE_SUPPORT_*: the log-prob head over a support of --support K ids per token (fh_logprob_support_*), beside the
 * full-vocabulary cases; their flop basis is the 6 N K H of the dot products, forward and backward. */
typedef enum bench_case {
    CASE_SGEMM, CASE_FORWARD, CASE_SPLIT, CASE_TRAIN, CASE_FILTERED, CASE_MATERIALIZED, CASE_SUPPORT_SPLIT,
    CASE_SUPPORT_TRAIN, CASE_COUNT
} bench_case;

static const char *case_names[CASE_COUNT] = {"sgemm_2048", "fused_forward", "fused_split", "fused_train_step",
                                             "fused_train_step_filtered", "materialized"};
static const char *bf16_ceiling_name = "bf16_gemm_2048";
static const char *ce_case_basis[CASE_COUNT] = {"2*2048^3", "2NHV", "8NHV", "6NHV", "6NHV", "6NHV"};

enum { CEILING_REPS = 10 };

/* Distillation's teacher: logits of this standard deviation (the student's uniform inputs give about 0.6, a
 * near-uniform softmax), so that its softmax is well away from uniform. */
static const float teacher_logit_std = 3.0f;

typedef enum head_kind {
    HEAD_CE, HEAD_GRPO, HEAD_PREFERENCE, HEAD_DISTILL, HEAD_KTO, HEAD_DISTILL_TOPK, HEAD_LOGPROB
} head_kind;

typedef struct shape {
    int64_t n, hidden, vocab;
    int threads;
    int64_t budget; /* 0 = library default */
    fh_layout layout;
    int reps;
    fh_dtype dtype; /* of x and weight (the ceiling's and the materialized baseline's GEMMs follow it) */
    fh_dtype grad_dtype; /* of the fused cases' dx and dweight: x's unless --grad-dtype says */
    int fp32_du;         /* FH_PARAM_FP32_DU */
    int batch_invariant; /* FH_PARAM_BATCH_INVARIANT */
    head_kind head;      /* --loss: ce, grpo (n = batch * seq tokens, TRL defaults, on-policy) or a preference loss
                            (n = 2 batch seq: batch pairs, TRL defaults, reference-free) */
    fh_preference_loss preference;
    int64_t batch, seq;
    bench_distribution dist;   /* --distribution (CE only); a peaked one calibrated once per shape */
    bench_softmax_stats stats; /* what the inputs' softmax looks like (describe_inputs) */
    double filter_eps;         /* --grad-filter-eps: 0 = no filtered case */
    fh_filter_tail filter_tail; /* --grad-filter-tail estimate|drop (default estimate) */
    int64_t tile_rows;         /* --tile-rows: FH_PARAM_TILE_ROWS of every fused case (0 = the library's choice) */
    int64_t teacher_hidden;    /* distill: the teacher's hidden size (--teacher-hidden, default H) */
    fh_distill_options distill;             /* distill: --divergence, --beta, --temperature, --weight-hard-loss */
    bench_softmax_stats teacher_stats;      /* distill: the teacher's softmax (describe_inputs) */
    double ignore_frac;        /* --ignore-frac (CE): this share of the rows get ignore_index */
    int ignore_scattered;      /* --ignore-pattern scattered: single rows at random; runs (default): the first
                                  ignore_frac of every IGNORE_RUN_ROWS rows, as masked prompts */
    fh_grpo_options grpo;      /* grpo: TRL's defaults, --grpo-loss-type, --top-entropy-quantile, and with
                                  --grpo-trl-options the sampler's log-probs (vLLM importance sampling, TRL's
                                  sequence_mask), off_policy_mask_threshold 0.5, beta 0.04 with the bias-corrected KL
                                  and entropy_coef 0.01 */
    int grpo_trl_options;
    int64_t topk_k;            /* distill_topk: the teacher's entries per token (--k, default 20) */
    int topk_no_tail;          /* distill_topk: --no-tail (TRL's loss_add_tail False) */
    int64_t support_k;         /* logprob: --support K, each token's support (0: the full-vocabulary cases only) */
    double padding_frac;       /* --packed P (grpo, preference, kto): sequences of lengths 1 .. T about T (1 - P), so
                                  that a share P of the [B, T] rows is padding; the train step is also measured on the
                                  packed rows (cu_seqlens) against the padded ones */
    double padding_frac_measured; /* the share of padding those lengths give */
} shape;

/* The period of --ignore-pattern runs: a sequence of this many tokens whose first part is its prompt. */
#define IGNORE_RUN_ROWS 256

/* GRPO's cases: the forward, today's streaming step (forward + backward, 8 NHV) and the single-call step
 * (fh_grpo_forward_backward: row blocks of whole sequences); no materialized baseline. */
static const char *grpo_loss_names[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};

static const char *grpo_case_names[CASE_COUNT] = {NULL, "grpo_forward", "grpo_streaming", "grpo_train_step", NULL,
                                                  NULL};

/* The preference losses' cases: the forward and the single-call step (fh_preference_forward_backward: row
 * blocks of whole pairs); no materialized baseline. */
static const char *preference_names[] = {"dpo", "orpo", "simpo", "cpo"};
static const char *preference_case_names[][CASE_COUNT] = {
    {NULL, "dpo_forward", NULL, "dpo_train_step", NULL, NULL},
    {NULL, "orpo_forward", NULL, "orpo_train_step", NULL, NULL},
    {NULL, "simpo_forward", NULL, "simpo_train_step", NULL, NULL},
    {NULL, "cpo_forward", NULL, "cpo_train_step", NULL, NULL}};

/* KTO's cases: the forward and the single-call step (fh_kto_forward_backward: row blocks of whole sequences); no
 * materialized baseline. */
static const char *kto_case_names[CASE_COUNT] = {NULL, "kto_forward", NULL, "kto_train_step", NULL, NULL};

/* Distillation's cases: the forward, the single-call step (fh_distill_forward_backward: row blocks of both heads'
 * logits) and the materialized baseline (materialized_distill_train_step). */
static const char *distill_case_names[CASE_COUNT] = {NULL, "distill_forward", NULL, "distill_train_step", NULL,
                                                     "materialized_distill"};
static const char *divergence_names[] = {"forward_kl", "reverse_kl", "jsd"};

/* Top-k distillation's cases: the forward and the single-call step (fh_distill_topk_forward_backward: row blocks of
 * the student's logits, 6 NHV); no materialized baseline. */
static const char *distill_topk_case_names[CASE_COUNT] = {NULL, "distill_topk_forward", NULL,
                                                          "distill_topk_train_step", NULL, NULL};

/* The log-prob head's cases: log-probs, entropies and lse with their gradients (upstream 1 and 0.01) over the whole
 * vocabulary (forward, forward + backward, the single call) and, with --support K, over each token's K ids. */
static const char *logprob_case_names[CASE_COUNT] = {NULL, "logprob_forward", "logprob_split", "logprob_train_step",
                                                     NULL, NULL, "support_split", "support_train_step"};

static const char *case_name(bench_case c, const shape *s)
{
    if (c == CASE_SGEMM)
        return s->dtype == FH_DTYPE_BF16 ? bf16_ceiling_name : case_names[c];
    switch (s->head) {
    case HEAD_GRPO: return grpo_case_names[c];
    case HEAD_PREFERENCE: return preference_case_names[s->preference][c];
    case HEAD_DISTILL: return distill_case_names[c];
    case HEAD_KTO: return kto_case_names[c];
    case HEAD_DISTILL_TOPK: return distill_topk_case_names[c];
    case HEAD_LOGPROB: return logprob_case_names[c];
    default: return case_names[c];
    }
}

/* Distillation's forward passes over both heads' tiles: jsd's mixture needs both log-sum-exps first, so it streams
 * them twice (beta 0 and 1 are the KLs, and top-k supports keep what they need in one: one pass); the train step's
 * row blocks hold them, one GEMM each. */
static int distill_passes(const shape *s)
{
    const fh_distill_options *o = &s->distill;
    return o->divergence == FH_DIVERGENCE_JSD && o->beta > 0.0 && o->beta < 1.0 && o->top_k == 0 ? 2 : 1;
}

/* What a case's GFLOP/s and efficiency count (flops_of); distillation adds the teacher's logits GEMMs. */
static const char *case_basis(bench_case c, const shape *s)
{
    if (c == CASE_SUPPORT_SPLIT || c == CASE_SUPPORT_TRAIN)
        return "6NKH";
    if (s->head != HEAD_DISTILL || c == CASE_SGEMM)
        return ce_case_basis[c];
    if (c == CASE_FORWARD)
        return distill_passes(s) == 2 ? "4N(Hs+Ht)V" : "2N(Hs+Ht)V";
    return "2N(Hs+Ht)V+4NHsV";
}

/* The materialized distillation is over the whole vocabulary: not run beside top-k supports. */
static int case_runs(bench_case c, const shape *s)
{
    return case_name(c, s) != NULL && (c != CASE_FILTERED || s->filter_eps > 0.0) &&
           (c < CASE_SUPPORT_SPLIT || s->support_k > 0) &&
           !(c == CASE_MATERIALIZED && s->head == HEAD_DISTILL && s->distill.top_k > 0);
}

typedef struct result {
    int ok;
    double flops, best_ms, first_ms, ceiling_gflops, loss;
    double skipped_fraction; /* of the gradient GEMMs' flops, by filtering (fh_context_filter_stats) */
    int64_t workspace_bytes, peak_growth_bytes;
    double paired_exact_ms, paired_filtered_ms; /* CASE_FILTERED: best of the alternating calls; else NaN */
    double paired_counted_ms, paired_ignored_ms; /* CASE_TRAIN with --ignore-frac: every row counted and the ignored
                                                   rows, best of the alternating calls; else NaN */
    double paired_padded_ms, paired_packed_ms;   /* CASE_TRAIN with --packed: the padded [B, T] rows and the packed
                                                   ones, best of the alternating calls; else NaN */
} result;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

/* A field of /proc/self/status in bytes ("VmRSS:", "VmHWM:"). */
static int64_t proc_status_bytes(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int64_t kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, strlen(field)) == 0)
            kb = atoll(line + strlen(field));
    if (f)
        fclose(f);
    return kb * 1024;
}

static int reset_peak_rss(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f)
        return -1;
    const int ok = fputs("5", f) >= 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* The ceiling's GEMM on provider: sg[0] and sg[1] hold floats or (bf16) bf16 bits, sg[2] floats. */
static int gemm_2048(const shape *s, bench_provider provider, void *const sg[3])
{
    return bench_gemm_on(provider, 2048, 2048, 2048, sg[0], 2048, 1, sg[1], 2048, 1, sg[2], 2048, 1, s->threads);
}

/* The best time of the fastest GEMM here for the run's dtype: for fp32 both BLIS sgemm and oneDNN's f32 matmul (the
 * library uses one of them, chosen by a rule per CPU class, and its efficiency is judged against the faster), their
 * repetitions alternating; for bf16 the library's path. */
static double gemm_best_ms(const shape *s, void *const sg[3])
{
    bench_provider providers[2];
    int count = 1;
    if (s->dtype == FH_DTYPE_BF16) {
        if (bench_library_provider(1, &providers[0]) != 0)
            return INFINITY;
    } else {
        providers[0] = BENCH_BLIS;
#ifdef FH_HAVE_ONEDNN
        providers[count++] = BENCH_ONEDNN_F32;
#endif
    }
    const int reps = s->reps < CEILING_REPS ? s->reps : CEILING_REPS;
    double best = INFINITY;
    for (int k = 0; k < reps; k++)
        for (int p = 0; p < count; p++) {
            const double t = now_ms();
            if (gemm_2048(s, providers[p], sg) == 0)
                best = fmin(best, now_ms() - t);
        }
    return best;
}

/* The heads' inputs beside x, w and the targets: the sequence heads' per-token and per-sequence inputs and GRPO's
 * saved log-probs; distillation's teacher (its x and w, and their bf16 copies in a bf16 run). */
typedef struct head_inputs {
    float *mask, *advantages, *logp;
    float *sampling_logp, *ref_logp; /* grpo with --grpo-trl-options */
    float *entropy;                  /* grpo: the forward's, for the split backward */
    bench_inputs teacher;
    int64_t *ignored_targets; /* CE with --ignore-frac: the targets with the ignored rows, which the fused cases take */
    uint8_t *labels;          /* kto: desirable and undesirable sequences alternating */
    float *ref_logps;         /* kto: per-sequence reference log-probs */
    int64_t *topk_ids;        /* distill_topk: the teacher's [N, k] ids and log-probs */
    float *topk_logprobs;
    int64_t *support_ids;     /* logprob with --support K: [N, K] padded, each token's target first */
    float *g_logp, *g_entropy; /* logprob: the upstream gradients, 1 and 0.01 */
    /* --packed: the sequences' offsets, each packed row's padded row, and the per-row inputs over the packed rows */
    int64_t *cu_seqlens, *padded_row, packed_n;
    void *packed_x;
    int64_t *packed_targets;
    float *packed_mask, *packed_ref_logp, *packed_sampling_logp;
    int use_packed; /* run_once calls the packed form */
} head_inputs;

/* Sequence b's length with --packed: T - round(2 P (T - 1) u_b), the u_b the S midpoints (k + 1/2) / S in an order
 * that a prime multiplier scatters over the batch: lengths spread evenly over T - 2P (T - 1) .. T, whose mean leaves
 * P (T - 1) / T of the rows padding. */
static int64_t sequence_length(const shape *s, int64_t b)
{
    const int64_t sequences = s->n / s->seq;
    const double u = ((double)(((uint64_t)b * 2654435761u) % (uint64_t)sequences) + 0.5) / (double)sequences;
    return s->seq - (int64_t)llround(2.0 * s->padding_frac * (double)(s->seq - 1) * u);
}

/* --packed's rows: the sequences end to end (their padding left out), as copies of the padded inputs. */
static int packed_inputs_make(const shape *s, const bench_inputs *in, head_inputs *g)
{
    const int64_t sequences = s->n / s->seq, h = s->hidden;
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    const size_t x_elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    g->cu_seqlens = malloc((size_t)(sequences + 1) * sizeof(int64_t));
    g->padded_row = malloc((size_t)s->n * sizeof(int64_t));
    if (!g->cu_seqlens || !g->padded_row)
        return -1;
    g->cu_seqlens[0] = 0;
    for (int64_t b = 0; b < sequences; b++) {
        const int64_t length = sequence_length(s, b);
        for (int64_t t = 0; t < length; t++)
            g->padded_row[g->cu_seqlens[b] + t] = b * s->seq + t;
        g->cu_seqlens[b + 1] = g->cu_seqlens[b] + length;
    }
    const int64_t n = g->packed_n = g->cu_seqlens[sequences];
    g->packed_x = malloc((size_t)(n * h) * x_elem);
    g->packed_targets = malloc((size_t)n * sizeof(int64_t));
    g->packed_mask = malloc((size_t)n * sizeof(float));
    g->packed_ref_logp = g->ref_logp ? malloc((size_t)n * sizeof(float)) : NULL;
    g->packed_sampling_logp = g->sampling_logp ? malloc((size_t)n * sizeof(float)) : NULL;
    if (!g->packed_x || !g->packed_targets || !g->packed_mask || (g->ref_logp && !g->packed_ref_logp) ||
        (g->sampling_logp && !g->packed_sampling_logp))
        return -1;
    const char *x = bf16 ? (const char *)in->x_bf16 : (const char *)in->x;
    for (int64_t k = 0; k < n; k++) {
        const int64_t i = g->padded_row[k];
        memcpy((char *)g->packed_x + (size_t)(k * h) * x_elem, x + (size_t)(i * h) * x_elem, (size_t)h * x_elem);
        g->packed_targets[k] = in->targets[i];
        g->packed_mask[k] = g->mask[i];
        if (g->ref_logp)
            g->packed_ref_logp[k] = g->ref_logp[i];
        if (g->sampling_logp)
            g->packed_sampling_logp[k] = g->sampling_logp[i];
    }
    return 0;
}

/* The CE targets with --ignore-frac's rows set to ignore_index (-100). */
static int64_t *ignored_targets(const shape *s, const int64_t *targets)
{
    int64_t *t = malloc((size_t)s->n * sizeof(int64_t));
    for (int64_t i = 0; t && i < s->n; i++) {
        /* scattered: a fixed hash of the row in [0, 1) (Knuth's multiplicative constant) */
        const double u = s->ignore_scattered ? (double)((uint32_t)(i * 2654435761u) >> 8) / 16777216.0
                                             : (double)(i % IGNORE_RUN_ROWS) / IGNORE_RUN_ROWS;
        t[i] = u < s->ignore_frac ? -100 : targets[i];
    }
    return t;
}

/* The top-k teacher: k distinct ids per row (odd steps through the vocabulary) holding 0.9 of the mass evenly. */
static int topk_teacher_make(const shape *s, head_inputs *g)
{
    const int64_t k = s->topk_k;
    g->topk_ids = malloc((size_t)(s->n * k) * sizeof(int64_t));
    g->topk_logprobs = malloc((size_t)(s->n * k) * sizeof(float));
    if (!g->topk_ids || !g->topk_logprobs)
        return -1;
    for (int64_t i = 0; i < s->n; i++)
        for (int64_t e = 0; e < k; e++) {
            g->topk_ids[i * k + e] = (i * 31 + e * 97) % s->vocab;
            g->topk_logprobs[i * k + e] = (float)log(0.9 / (double)k);
        }
    return 0;
}

/* The log-prob head's inputs: its outputs, upstream gradients and (--support K) the support: each token's target
 * and K - 1 ids spread over the vocabulary (V / K apart, or consecutive when K^2 >= V), all distinct, as scattered
 * as a sampler's kept set can be. */
static int logprob_inputs_make(const shape *s, const int64_t *targets, head_inputs *g)
{
    const int64_t k = s->support_k, step = k * k < s->vocab ? s->vocab / k : 1;
    g->logp = malloc((size_t)s->n * sizeof(float));
    g->entropy = malloc((size_t)s->n * sizeof(float));
    g->g_logp = bench_filled((size_t)s->n, 0.0f, 31);
    g->g_entropy = bench_filled((size_t)s->n, 0.0f, 32);
    g->support_ids = k ? malloc((size_t)(s->n * k) * sizeof(int64_t)) : NULL;
    if (!g->logp || !g->entropy || !g->g_logp || !g->g_entropy || (k && !g->support_ids))
        return -1;
    for (int64_t i = 0; i < s->n; i++) {
        g->g_logp[i] = 1.0f;
        g->g_entropy[i] = 0.01f;
        for (int64_t e = 0; e < k; e++)
            g->support_ids[i * k + e] = (targets[i] + e * step) % s->vocab;
    }
    return 0;
}

static int head_inputs_make(const shape *s, const int64_t *targets, head_inputs *g)
{
    if (s->head == HEAD_DISTILL_TOPK)
        return topk_teacher_make(s, g);
    if (s->head == HEAD_LOGPROB)
        return logprob_inputs_make(s, targets, g);
    if (s->head == HEAD_DISTILL) {
        if (bench_inputs_make_teacher(s->n, s->teacher_hidden, s->vocab, teacher_logit_std, &g->teacher) != 0)
            return -1;
        return s->dtype == FH_DTYPE_BF16 ? bench_inputs_add_bf16(s->n, s->teacher_hidden, s->vocab, &g->teacher) : 0;
    }
    g->mask = malloc((size_t)s->n * sizeof(float));
    g->logp = malloc((size_t)s->n * sizeof(float));
    g->entropy = malloc((size_t)s->n * sizeof(float));
    g->advantages = malloc((size_t)s->n / s->seq * sizeof(float));
    if (!g->mask || !g->logp || !g->entropy || !g->advantages)
        return -1;
    for (int64_t i = 0; i < s->n; i++) /* the last eighth of each sequence is padding, or --packed's share */
        g->mask[i] = i % s->seq < (s->padding_frac > 0.0 ? sequence_length(s, i / s->seq) : s->seq - s->seq / 8);
    for (int64_t b = 0; b < s->n / s->seq; b++)
        g->advantages[b] = b % 2 ? -1.0f : 1.0f;
    if (s->head == HEAD_KTO) {
        /* The uniform inputs' sequence log-probs are about -log V per unmasked token: references around them. */
        const int64_t sequences = s->n / s->seq;
        g->labels = malloc((size_t)sequences);
        g->ref_logps = bench_filled((size_t)sequences, 1.0f, 23);
        if (!g->labels || !g->ref_logps)
            return -1;
        for (int64_t b = 0; b < sequences; b++) {
            g->labels[b] = b % 2 == 0;
            g->ref_logps[b] -= (float)((double)(s->seq - s->seq / 8) * log((double)s->vocab));
        }
    }
    if (s->head == HEAD_GRPO && s->grpo_trl_options) {
        /* Near the uniform inputs' log-probs, -log V, so that ratios and masks see both sides of their bounds. */
        g->sampling_logp = bench_filled((size_t)s->n, 0.2f, 21);
        g->ref_logp = bench_filled((size_t)s->n, 0.2f, 22);
        if (!g->sampling_logp || !g->ref_logp)
            return -1;
        for (int64_t i = 0; i < s->n; i++) {
            g->sampling_logp[i] -= (float)log((double)s->vocab);
            g->ref_logp[i] -= (float)log((double)s->vocab);
        }
    }
    return 0;
}

/* The linear over x and w of the inputs (of the given hidden size) in the run's layout and dtype, no bias. */
static void linear_of(const shape *s, const bench_inputs *in, int64_t hidden, fh_linear *lin)
{
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    fh_linear_init(lin, s->n, hidden, s->vocab, bf16 ? (const void *)in->x_bf16 : in->x,
                   bf16 ? (const void *)in->w_bf16 : in->w, s->layout, NULL);
    lin->x_dtype = lin->weight_dtype = s->dtype;
}

/* With --packed's packed form chosen (use_packed): the linear over the packed rows, and the per-row inputs. */
static void packed_form(const shape *s, const head_inputs *g, fh_linear *lin, const int64_t **targets,
                        const float **mask, const float **ref_logp, const float **sampling_logp)
{
    if (!g->use_packed)
        return;
    fh_linear_init(lin, g->packed_n, s->hidden, s->vocab, g->packed_x, lin->weight, s->layout, NULL);
    lin->x_dtype = lin->weight_dtype = s->dtype;
    *targets = g->packed_targets;
    *mask = g->packed_mask;
    *ref_logp = g->packed_ref_logp;
    *sampling_logp = g->packed_sampling_logp;
}

/* One preference-loss call of the case (TRL's defaults for the loss, reference-free). */
static int run_preference(bench_case c, const shape *s, const fh_linear *lin, const bench_inputs *in,
                          const head_inputs *g, fh_context *ctx, fh_linear_grads *grads, double *loss)
{
    fh_preference_options o;
    fh_preference_options_init(&o);
    o.loss = s->preference;
    fh_linear l = *lin;
    const int64_t *targets = in->targets;
    const float *mask = g->mask, *unused_ref, *unused_sampling;
    packed_form(s, g, &l, &targets, &mask, &unused_ref, &unused_sampling);
    const fh_preference_batch batch = {s->batch, g->use_packed ? 0 : s->seq, targets, mask, NULL, NULL,
                                       g->use_packed ? g->cu_seqlens : NULL};
    fh_preference_outputs out = {.loss = loss};
    const float grad_one = 1.0f;
    if (c == CASE_FORWARD)
        return fh_preference_forward(ctx, &l, &batch, &o, &out) == FH_OK ? 0 : -1;
    return fh_preference_forward_backward(ctx, &l, &batch, &o, &grad_one, &out, grads) == FH_OK ? 0 : -1;
}

/* One KTO call of the case (TRL's defaults, loss_type kto, a per-sequence reference, a KL value). */
static int run_kto(bench_case c, const shape *s, const fh_linear *lin, const bench_inputs *in, const head_inputs *g,
                   fh_context *ctx, fh_linear_grads *grads, double *loss)
{
    fh_kto_options o;
    fh_kto_options_init(&o);
    const float kl = 0.1f, grad_one = 1.0f;
    fh_linear l = *lin;
    const int64_t *targets = in->targets;
    const float *mask = g->mask, *unused_ref, *unused_sampling;
    packed_form(s, g, &l, &targets, &mask, &unused_ref, &unused_sampling);
    const fh_kto_batch batch = {s->batch, g->use_packed ? 0 : s->seq, targets, mask, g->labels, g->ref_logps, NULL,
                                &kl, NULL, g->use_packed ? g->cu_seqlens : NULL};
    fh_kto_outputs out = {.loss = loss};
    if (c == CASE_FORWARD)
        return fh_kto_forward(ctx, &l, &batch, &o, &out) == FH_OK ? 0 : -1;
    return fh_kto_forward_backward(ctx, &l, &batch, &o, &grad_one, &out, grads) == FH_OK ? 0 : -1;
}

/* One GRPO call of the case. */
static int run_grpo(bench_case c, const shape *s, const fh_linear *lin, const bench_inputs *in, const head_inputs *g,
                    fh_context *ctx, fh_linear_grads *grads, double *loss)
{
    const fh_grpo_options o = s->grpo;
    fh_linear l = *lin;
    const int64_t *targets = in->targets;
    const float *mask = g->mask, *ref_logp = g->ref_logp, *sampling_logp = g->sampling_logp;
    packed_form(s, g, &l, &targets, &mask, &ref_logp, &sampling_logp);
    const fh_grpo_batch batch = {s->batch, g->use_packed ? 0 : s->seq, targets, mask, g->advantages, NULL, ref_logp,
                                 sampling_logp, NULL, g->use_packed ? g->cu_seqlens : NULL};
    fh_grpo_outputs out = {.loss = loss, .per_token_logp = g->logp, .entropy = g->entropy, .lse = in->lse};
    const float grad_one = 1.0f;
    switch (c) {
    case CASE_FORWARD: return fh_grpo_forward(ctx, &l, &batch, &o, &out) == FH_OK ? 0 : -1;
    case CASE_SPLIT:
        if (fh_grpo_forward(ctx, &l, &batch, &o, &out) != FH_OK)
            return -1;
        return fh_grpo_backward(ctx, &l, &batch, &o, g->logp, in->lse, g->entropy, &grad_one, grads) == FH_OK ? 0 : -1;
    case CASE_TRAIN: return fh_grpo_forward_backward(ctx, &l, &batch, &o, &grad_one, &out, grads) == FH_OK ? 0 : -1;
    default: return -1;
    }
}

/* One distillation call of the case, the teacher's linear beside the student's. */
static int run_distill(bench_case c, const shape *s, const fh_linear *student, const bench_inputs *in,
                       const head_inputs *g, fh_context *ctx, const materialized_buffers *mb, fh_linear_grads *grads,
                       double *loss)
{
    fh_linear teacher;
    linear_of(s, &g->teacher, s->teacher_hidden, &teacher);
    fh_distill_outputs out = {.loss = loss};
    const float grad_one = 1.0f;
    fh_status st;
    switch (c) {
    case CASE_FORWARD:
        st = fh_distill_forward(ctx, student, &teacher, in->targets, &s->distill, &out);
        return st == FH_OK ? 0 : -1;
    case CASE_TRAIN:
        st = fh_distill_forward_backward(ctx, student, &teacher, in->targets, &s->distill, &grad_one, &out, grads);
        return st == FH_OK ? 0 : -1;
    case CASE_MATERIALIZED:
        *loss = materialized_distill_train_step(mb, student, &teacher, in->targets, &s->distill, in->dx, in->dw,
                                                s->threads);
        return isfinite(*loss) ? 0 : -1;
    default: return -1;
    }
}

/* One top-k distillation call of the case (TRL's defaults: the tail, temperature 1, soft loss only). */
static int run_distill_topk(bench_case c, const shape *s, const fh_linear *student, const bench_inputs *in,
                            const head_inputs *g, fh_context *ctx, fh_linear_grads *grads, double *loss)
{
    fh_distill_topk_options o;
    fh_distill_topk_options_init(&o);
    o.add_tail = !s->topk_no_tail;
    const fh_topk_teacher teacher = {s->topk_k, g->topk_ids, g->topk_logprobs};
    fh_distill_outputs out = {.loss = loss};
    const float grad_one = 1.0f;
    if (c == CASE_FORWARD)
        return fh_distill_topk_forward(ctx, student, &teacher, in->targets, &o, &out) == FH_OK ? 0 : -1;
    return fh_distill_topk_forward_backward(ctx, student, &teacher, in->targets, &o, &grad_one, &out, grads) == FH_OK
               ? 0
               : -1;
}

/* One log-prob call of the case, over the vocabulary or the support; its loss the sum of the log-probs. */
static int run_logprob(bench_case c, const shape *s, const fh_linear *lin, const bench_inputs *in,
                       const head_inputs *g, fh_context *ctx, fh_linear_grads *grads, double *loss)
{
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    const fh_support support = {g->support_ids, NULL, s->support_k};
    fh_logprob_outputs out = {g->logp, g->entropy, in->lse};
    fh_status st;
    switch (c) {
    case CASE_FORWARD: st = fh_logprob_forward(ctx, lin, in->targets, &o, &out); break;
    case CASE_SPLIT:
        st = fh_logprob_forward(ctx, lin, in->targets, &o, &out);
        if (st == FH_OK)
            st = fh_logprob_backward(ctx, lin, in->targets, &o, in->lse, g->entropy, g->g_logp, g->g_entropy, NULL,
                                     grads);
        break;
    case CASE_TRAIN:
        st = fh_logprob_forward_backward(ctx, lin, in->targets, &o, g->g_logp, g->g_entropy, NULL, &out, grads);
        break;
    case CASE_SUPPORT_SPLIT:
        st = fh_logprob_support_forward(ctx, lin, in->targets, &support, &o, &out);
        if (st == FH_OK)
            st = fh_logprob_support_backward(ctx, lin, in->targets, &support, &o, in->lse, g->entropy, g->g_logp,
                                             g->g_entropy, NULL, grads);
        break;
    case CASE_SUPPORT_TRAIN:
        st = fh_logprob_support_forward_backward(ctx, lin, in->targets, &support, &o, g->g_logp, g->g_entropy, NULL,
                                                 &out, grads);
        break;
    default: return -1;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < s->n; i++)
        sum += g->logp[i];
    *loss = sum;
    return st == FH_OK ? 0 : -1;
}

/* One call of the case, its loss in *loss (NaN for the sgemm); returns 0 or -1. */
static int run_once(bench_case c, const shape *s, const bench_inputs *in, const head_inputs *heads, fh_context *ctx,
                    const materialized_buffers *mb, void *const gemm_buffers[3], double *loss)
{
    fh_linear lin;
    linear_of(s, in, s->hidden, &lin);
    fh_ce_options o;
    fh_ce_options_init(&o);
    const float grad_one = 1.0f;
    *loss = NAN;
    fh_ce_outputs out = {loss, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    /* in->dx and in->dw are float buffers, large enough for bf16 gradients too. */
    fh_linear_grads g = {.dx = in->dx, .dx_row_stride = s->hidden, .dweight = in->dw, .dx_dtype = s->grad_dtype,
                         .dweight_dtype = s->grad_dtype};
    if (s->head == HEAD_GRPO && c != CASE_SGEMM)
        return run_grpo(c, s, &lin, in, heads, ctx, &g, loss);
    if (s->head == HEAD_PREFERENCE && c != CASE_SGEMM)
        return run_preference(c, s, &lin, in, heads, ctx, &g, loss);
    if (s->head == HEAD_DISTILL && c != CASE_SGEMM)
        return run_distill(c, s, &lin, in, heads, ctx, mb, &g, loss);
    if (s->head == HEAD_KTO && c != CASE_SGEMM)
        return run_kto(c, s, &lin, in, heads, ctx, &g, loss);
    if (s->head == HEAD_DISTILL_TOPK && c != CASE_SGEMM)
        return run_distill_topk(c, s, &lin, in, heads, ctx, &g, loss);
    if (s->head == HEAD_LOGPROB && c != CASE_SGEMM)
        return run_logprob(c, s, &lin, in, heads, ctx, &g, loss);
    const int64_t *targets = heads->ignored_targets ? heads->ignored_targets : in->targets;
    switch (c) {
    case CASE_SGEMM: {
        bench_provider provider;
        return bench_library_provider(s->dtype == FH_DTYPE_BF16, &provider) == 0 ? gemm_2048(s, provider, gemm_buffers)
                                                                                 : -1;
    }
    case CASE_FORWARD:
        return fh_ce_forward(ctx, &lin, targets, &o, &out) == FH_OK ? 0 : -1;
    case CASE_SPLIT:
        out.lse = in->lse;
        if (fh_ce_forward(ctx, &lin, targets, &o, &out) != FH_OK)
            return -1;
        return fh_ce_backward(ctx, &lin, targets, &o, in->lse, &grad_one, &g) == FH_OK ? 0 : -1;
    case CASE_TRAIN:
    case CASE_FILTERED:
        return fh_ce_forward_backward(ctx, &lin, targets, &o, &grad_one, &out, &g) == FH_OK ? 0 : -1;
    case CASE_MATERIALIZED:
        *loss = materialized_train_step(mb, s->n, s->hidden, s->vocab, lin.x, lin.weight, lin.w_stride_hidden,
                                        lin.w_stride_vocab, targets, in->dx, in->dw, s->threads);
        return isfinite(*loss) ? 0 : -1;
    default:
        return -1;
    }
}

static double flops_of(bench_case c, const shape *s)
{
    const double nhv = (double)s->n * s->hidden * s->vocab;
    if (c == CASE_SUPPORT_SPLIT || c == CASE_SUPPORT_TRAIN)
        return 6.0 * (double)s->n * (double)s->support_k * (double)s->hidden;
    if (s->head == HEAD_DISTILL && c != CASE_SGEMM) {
        const double both = (double)s->n * (double)(s->hidden + s->teacher_hidden) * s->vocab;
        return c == CASE_FORWARD ? 2.0 * distill_passes(s) * both : 2.0 * both + 4.0 * nhv;
    }
    switch (c) {
    case CASE_SGEMM: return 2.0 * 2048.0 * 2048.0 * 2048.0;
    case CASE_FORWARD: return 2.0 * nhv;
    case CASE_SPLIT: return 8.0 * nhv;
    default: return 6.0 * nhv;
    }
}

/* The exact and the filtered train step alternately, after a round that warms both up: best of s->reps each. */
static int paired_steps(const shape *s, const bench_inputs *in, const head_inputs *heads, fh_context *ctx,
                        void *const gemm_buffers[3], result *r)
{
    double best[2] = {INFINITY, INFINITY}, loss;
    for (int k = 0; k <= s->reps; k++)
        for (int filtered = 0; filtered < 2; filtered++) {
            if (fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, filtered ? s->filter_eps : 0.0) != FH_OK)
                return -1;
            const double t = now_ms();
            if (run_once(filtered ? CASE_FILTERED : CASE_TRAIN, s, in, heads, ctx, NULL, gemm_buffers, &loss) != 0)
                return -1;
            const double ms = now_ms() - t;
            if (k > 0 && ms < best[filtered])
                best[filtered] = ms;
        }
    r->paired_exact_ms = best[0];
    r->paired_filtered_ms = best[1];
    return 0;
}

/* The train step with every row counted and with --ignore-frac's rows ignored, alternately, after a round that warms
 * both up: best of s->reps each. */
static int paired_ignored(const shape *s, const bench_inputs *in, head_inputs *heads, fh_context *ctx,
                          void *const gemm_buffers[3], result *r)
{
    int64_t *const ignored = heads->ignored_targets;
    double best[2] = {INFINITY, INFINITY}, loss;
    int failed = 0;
    for (int k = 0; k <= s->reps && !failed; k++)
        for (int ignoring = 0; ignoring < 2 && !failed; ignoring++) {
            heads->ignored_targets = ignoring ? ignored : NULL;
            const double t = now_ms();
            failed = run_once(CASE_TRAIN, s, in, heads, ctx, NULL, gemm_buffers, &loss) != 0;
            const double ms = now_ms() - t;
            if (k > 0 && ms < best[ignoring])
                best[ignoring] = ms;
        }
    heads->ignored_targets = ignored;
    r->paired_counted_ms = best[0];
    r->paired_ignored_ms = best[1];
    return failed ? -1 : 0;
}

/* The train step on the padded [B, T] rows and on the packed ones, alternately, after a round that warms both up:
 * best of s->reps each. */
static int paired_packed(const shape *s, const bench_inputs *in, head_inputs *heads, fh_context *ctx,
                         void *const gemm_buffers[3], result *r)
{
    double best[2] = {INFINITY, INFINITY}, loss;
    int failed = 0;
    for (int k = 0; k <= s->reps && !failed; k++)
        for (int packed = 0; packed < 2 && !failed; packed++) {
            heads->use_packed = packed;
            const double t = now_ms();
            failed = run_once(CASE_TRAIN, s, in, heads, ctx, NULL, gemm_buffers, &loss) != 0;
            const double ms = now_ms() - t;
            if (k > 0 && ms < best[packed])
                best[packed] = ms;
        }
    heads->use_packed = 0;
    r->paired_padded_ms = best[0];
    r->paired_packed_ms = best[1];
    return failed ? -1 : 0;
}

static result measure_in_child(bench_case c, const shape *s)
{
    result r = {0, flops_of(c, s), INFINITY, 0.0, 0.0, NAN, 0.0, 0, 0, NAN, NAN, NAN, NAN, NAN, NAN};
    bench_inputs in;
    fh_context *ctx = NULL;
    void *sg[3] = {NULL, NULL, NULL};
    materialized_buffers mb = {0, NULL, NULL, NULL};
    head_inputs heads;
    memset(&heads, 0, sizeof heads);
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    char why[512];
    if (bench_inputs_make_from(&s->dist, s->layout, s->n, s->hidden, s->vocab, &in, why, sizeof why) != 0 ||
        fh_context_create(&ctx) != FH_OK)
        return r;
    if (s->head != HEAD_CE && head_inputs_make(s, in.targets, &heads) != 0)
        return r;
    if (s->head == HEAD_CE && s->ignore_frac > 0.0 && !(heads.ignored_targets = ignored_targets(s, in.targets)))
        return r;
    if (bf16 && bench_inputs_add_bf16(s->n, s->hidden, s->vocab, &in) != 0)
        return r;
    if (s->padding_frac > 0.0 && c == CASE_TRAIN && packed_inputs_make(s, &in, &heads) != 0)
        return r;
    fh_context_set(ctx, FH_PARAM_THREADS, s->threads);
    fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, s->budget);
    fh_context_set(ctx, FH_PARAM_FP32_DU, s->fp32_du);
    fh_context_set(ctx, FH_PARAM_BATCH_INVARIANT, s->batch_invariant);
    if (fh_context_set(ctx, FH_PARAM_TILE_ROWS, s->tile_rows) != FH_OK)
        return r;
    if (c == CASE_FILTERED && (fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, s->filter_eps) != FH_OK ||
                               fh_context_set(ctx, FH_PARAM_GRAD_FILTER_TAIL, s->filter_tail) != FH_OK))
        return r;
    for (int k = 0; k < 3; k++) {
        float *values = bench_filled(2048u * 2048u, 1.0f, 10 + k);
        sg[k] = values;
        /* bf16 operands: the same values' bits packed into the buffer's first half. */
        for (size_t i = 0; values && bf16 && k < 2 && i < 2048u * 2048u; i++)
            ((uint16_t *)values)[i] = bf16_from_float(values[i]);
        if (!values)
            return r;
    }
    fh_linear lin, teacher;
    linear_of(s, &in, s->hidden, &lin);
    fh_ce_options o;
    fh_ce_options_init(&o);
    size_t ws = 0;
    if (s->head == HEAD_GRPO && c != CASE_SGEMM)
        fh_grpo_workspace_size(ctx, &lin, &ws);
    else if (s->head == HEAD_PREFERENCE && c != CASE_SGEMM)
        fh_preference_workspace_size(ctx, &lin, &ws);
    else if (s->head == HEAD_KTO && c != CASE_SGEMM)
        fh_kto_workspace_size(ctx, &lin, &ws);
    else if (s->head == HEAD_DISTILL) {
        linear_of(s, &heads.teacher, s->teacher_hidden, &teacher);
        if (c == CASE_FORWARD || c == CASE_TRAIN)
            fh_distill_workspace_size(ctx, &lin, &teacher, &s->distill, &ws);
    }
    else if (s->head == HEAD_DISTILL_TOPK && c != CASE_SGEMM)
        fh_distill_topk_workspace_size(ctx, &lin, &ws);
    else if (c == CASE_SUPPORT_SPLIT || c == CASE_SUPPORT_TRAIN) {
        const fh_support support = {heads.support_ids, NULL, s->support_k};
        fh_logprob_support_workspace_size(ctx, &lin, &support, &ws);
    } else if (s->head == HEAD_LOGPROB && c != CASE_SGEMM)
        fh_logprob_workspace_size(ctx, &lin, &ws);
    else if (c == CASE_FORWARD || c == CASE_SPLIT)
        fh_ce_workspace_size(ctx, &lin, &o, &ws);
    else if (c == CASE_TRAIN || c == CASE_FILTERED) {
        /* What the call takes: the query that sees the gradients leaves out what their dweight holds. */
        const fh_linear_grads g = {.dx = in.dx, .dx_row_stride = s->hidden, .dweight = in.dw,
                                   .dx_dtype = s->grad_dtype, .dweight_dtype = s->grad_dtype};
        fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &o, &g, &ws);
    }
    r.workspace_bytes = (int64_t)ws;
    const int64_t base = proc_status_bytes("VmRSS:");
    if (reset_peak_rss() != 0)
        return r;
    double t = now_ms();
    /* The materialized path's buffers belong to the call: a framework allocates them per step. */
    if (c == CASE_MATERIALIZED && materialized_alloc(&mb, s->n, s->vocab, bf16, s->head == HEAD_DISTILL) != 0)
        return r;
    if (run_once(c, s, &in, &heads, ctx, &mb, sg, &r.loss) != 0)
        return r;
    r.first_ms = now_ms() - t;
    const int reps = c == CASE_SGEMM && s->reps < CEILING_REPS ? CEILING_REPS : s->reps;
    for (int k = 0; k < reps; k++) {
        t = now_ms();
        if (run_once(c, s, &in, &heads, ctx, &mb, sg, &r.loss) != 0)
            return r;
        const double ms = now_ms() - t;
        r.best_ms = ms < r.best_ms ? ms : r.best_ms;
    }
    r.peak_growth_bytes = proc_status_bytes("VmHWM:") - base;
    fh_filter_stats filtered;
    fh_context_filter_stats(ctx, &filtered);
    r.skipped_fraction = filtered.gradient_flops > 0 ? filtered.skipped_flops / filtered.gradient_flops : 0.0;
    r.ceiling_gflops = flops_of(CASE_SGEMM, s) / (gemm_best_ms(s, sg) * 1e6);
    if (c == CASE_FILTERED && paired_steps(s, &in, &heads, ctx, sg, &r) != 0)
        return r;
    if (c == CASE_TRAIN && heads.ignored_targets && paired_ignored(s, &in, &heads, ctx, sg, &r) != 0)
        return r;
    if (c == CASE_TRAIN && heads.cu_seqlens && paired_packed(s, &in, &heads, ctx, sg, &r) != 0)
        return r;
    r.ok = 1;
    return r;
}

/* Runs fn(arg, out) in a child process and copies its size bytes of out back. Each case runs in its own child so
 * that peak-RSS readings do not mix, and anything else that computes does too: GNU OpenMP's thread pool (BLIS's)
 * does not survive a fork, so the parent never starts one. Returns 0, or -1 when the child fails. */
static int in_child(void (*fn)(const void *arg, void *out), const void *arg, void *out, size_t size)
{
    int fd[2];
    if (pipe(fd) != 0)
        return -1;
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        fn(arg, out);
        const ssize_t w = write(fd[1], out, size);
        _exit(w == (ssize_t)size ? 0 : 1);
    }
    close(fd[1]);
    const int ok = pid > 0 && read(fd[0], out, size) == (ssize_t)size;
    close(fd[0]);
    if (pid > 0)
        waitpid(pid, NULL, 0);
    return ok ? 0 : -1;
}

typedef struct description {
    int status;
    float scale; /* peaked: the calibrated scale */
    bench_softmax_stats stats, teacher_stats;
    char why[512];
} description;

static void describe_in_child(const void *arg, void *out)
{
    const shape *s = arg;
    description *d = out;
    bench_distribution dist = s->dist;
    bench_inputs in;
    d->status = bench_inputs_make_from(&dist, s->layout, s->n, s->hidden, s->vocab, &in, d->why, sizeof d->why);
    if (d->status != 0)
        return;
    if (dist.kind == BENCH_PEAKED)
        d->status = bench_peaked_calibrate(&dist, &in, s->layout, s->n, s->hidden, s->vocab, s->threads, d->why,
                                           sizeof d->why);
    d->scale = dist.scale;
    if (d->status == 0 &&
        bench_softmax_measure(&in, s->layout, s->n, s->hidden, s->vocab, s->threads, &d->stats) != 0) {
        snprintf(d->why, sizeof d->why, "out of memory");
        d->status = -1;
    }
    bench_inputs_free(&in);
    if (d->status == 0 && s->head == HEAD_DISTILL) {
        bench_inputs teacher;
        if (bench_inputs_make_teacher(s->n, s->teacher_hidden, s->vocab, teacher_logit_std, &teacher) != 0 ||
            bench_softmax_measure(&teacher, s->layout, s->n, s->teacher_hidden, s->vocab, s->threads,
                                  &d->teacher_stats) != 0) {
            snprintf(d->why, sizeof d->why, "out of memory");
            d->status = -1;
        }
        bench_inputs_free(&teacher);
    }
}

/* Calibrates a peaked distribution for the shape and measures the softmax that the inputs give, once before the
 * cases (whose children then make the same inputs). Returns 0, or -1 with the reason in why. */
static int describe_inputs(shape *s, char *why, size_t why_size)
{
    description d = {-1, 1.0f, {0, 0, 0, 0}, {0, 0, 0, 0}, "the child process failed"};
    if (in_child(describe_in_child, s, &d, sizeof d) != 0 || d.status != 0) {
        snprintf(why, why_size, "%s", d.why);
        return -1;
    }
    s->dist.scale = d.scale;
    s->stats = d.stats;
    s->teacher_stats = d.teacher_stats;
    return 0;
}

/* "uniform", "peaked:E" or "replay" (the table's first line names the folder). */
static const char *distribution_label(const bench_distribution *d, char buffer[32])
{
    if (d->kind == BENCH_PEAKED) {
        snprintf(buffer, 32, "peaked:%g", d->entropy);
        return buffer;
    }
    return d->kind == BENCH_REPLAY ? "replay" : "uniform";
}

typedef struct case_request {
    bench_case c;
    const shape *s;
} case_request;

static void measure_case(const void *arg, void *out)
{
    const case_request *q = arg;
    *(result *)out = measure_in_child(q->c, q->s);
}

static result run_case(bench_case c, const shape *s)
{
    result r = {0, 0, 0, 0, 0, NAN, 0.0, 0, 0, NAN, NAN, NAN, NAN, NAN, NAN};
    const case_request q = {c, s};
    if (in_child(measure_case, &q, &r, sizeof r) != 0)
        r.ok = 0;
    return r;
}

static const char *layout_name(fh_layout layout)
{
    return layout == FH_LAYOUT_VH ? "vh" : "hv";
}

typedef enum format { FORMAT_TABLE, FORMAT_JSON, FORMAT_CSV } format;

static double gflops(const result *r)
{
    return r->ok ? r->flops / (r->best_ms * 1e6) : 0.0;
}

/* Every case's ceiling becomes the best one measured in the run (one after each case, and the ceiling GEMM's own
 * case): a ceiling measured while the machine was busy would read efficiencies above 1. */
static void share_best_ceiling(result res[CASE_COUNT])
{
    double best = res[CASE_SGEMM].ok ? gflops(&res[CASE_SGEMM]) : 0.0;
    for (int c = 0; c < CASE_COUNT; c++)
        if (res[c].ok && res[c].ceiling_gflops > best)
            best = res[c].ceiling_gflops;
    for (int c = 0; c < CASE_COUNT; c++)
        res[c].ceiling_gflops = best;
}

static double efficiency(const result *r)
{
    return r->ok && r->ceiling_gflops > 0 ? gflops(r) / r->ceiling_gflops : 0.0;
}

/* One CSV row (columns in csv_header). */
static void print_row(FILE *out, const shape *s, bench_case c, const result *r)
{
    char label[32];
    fprintf(out, "%lld,%lld,%lld,%d,%s,%s,%.3f,%.1f,%.3f,%.3f,%lld,%lld,%.1f,%s,%.4f,%.6f,%.6f,%.4f,%.3f,%.3f\n",
            (long long)s->n,
            (long long)s->hidden, (long long)s->vocab, s->threads, case_name(c, s), case_basis(c, s), r->best_ms, gflops(r),
            efficiency(r), r->first_ms, (long long)r->workspace_bytes, (long long)r->peak_growth_bytes,
            r->ceiling_gflops, distribution_label(&s->dist, label), s->stats.mean_entropy, s->stats.below_2m12,
            s->stats.below_2m28, r->skipped_fraction, r->paired_exact_ms, r->paired_filtered_ms);
}

/* %.9g, or null for NaN (the sgemm has no loss). */
static const char *json_number(double x, char buffer[32])
{
    if (isnan(x))
        return "null";
    snprintf(buffer, 32, "%.9g", x);
    return buffer;
}

static const char *dtype_name(fh_dtype dtype)
{
    return dtype == FH_DTYPE_BF16 ? "bf16" : "fp32";
}

static void print_report(format f, const shape *s, const result *res, const fh_kernel_info *kernels, FILE *out)
{
    char num[32], pe[32], pf[32], pc[32], pi[32], pd[32], pk[32], label[32];
    const char *data = s->dist.kind == BENCH_REPLAY ? "real" : "synthetic";
    if (f == FORMAT_JSON) {
        fprintf(out, "{\n  \"n\": %lld, \"hidden\": %lld, \"vocab\": %lld, \"layout\": \"%s\", \"threads\": %d, "
                     "\"budget_bytes\": %lld,\n  \"blis_kernel_set\": \"%s\", \"row_kernels\": \"%s\", \"sgemm_gflops\": %.1f, "
                     "\"dtype\": \"%s\", \"fp32_path\": \"%s\", \"fp32_gemm\": \"%s\", \"bf16_path\": \"%s\", \"bf16_gemm\": \"%s\",\n  \"distribution\": \"%s\", \"data\": \"%s\", "
                     "\"softmax_sample_rows\": %lld, \"mean_entropy\": %.6g, \"frac_p_below_2m12\": %.6g, "
                     "\"frac_p_below_2m28\": %.6g, \"ignore_frac\": %.6g, \"ignore_pattern\": \"%s\", "
                     "\"padding_frac\": %.6g,",
                (long long)s->n, (long long)s->hidden, (long long)s->vocab, layout_name(s->layout), s->threads,
                (long long)s->budget, kernels->kernel_set, kernels->elementwise, gflops(&res[CASE_SGEMM]),
                dtype_name(s->dtype), kernels->fp32_path, kernels->fp32_gemm, kernels->bf16_path, kernels->bf16_gemm, distribution_label(&s->dist, label), data, (long long)s->stats.rows,
                s->stats.mean_entropy, s->stats.below_2m12, s->stats.below_2m28, s->ignore_frac,
                s->ignore_scattered ? "scattered" : "runs", s->padding_frac);
        if (s->head == HEAD_GRPO)
            fprintf(out, "\n  \"grpo_loss_type\": \"%s\", \"top_entropy_quantile\": %.9g, \"grpo_trl_options\": %s,",
                    grpo_loss_names[s->grpo.loss_type], s->grpo.top_entropy_quantile,
                    s->grpo_trl_options ? "true" : "false");
        if (s->head == HEAD_LOGPROB)
            fprintf(out, "\n  \"support_k\": %lld,", (long long)s->support_k);
        if (s->head == HEAD_DISTILL_TOPK)
            fprintf(out, "\n  \"topk_k\": %lld, \"add_tail\": %s,", (long long)s->topk_k,
                    s->topk_no_tail ? "false" : "true");
        if (s->head == HEAD_DISTILL)
            fprintf(out, "\n  \"teacher_hidden\": %lld, \"divergence\": \"%s\", \"beta\": %.9g, \"temperature\": %.9g, "
                         "\"weight_hard_loss\": %.9g, \"teacher_mean_entropy\": %.6g,",
                    (long long)s->teacher_hidden, divergence_names[s->distill.divergence], s->distill.beta,
                    s->distill.temperature, s->distill.weight_hard_loss, s->teacher_stats.mean_entropy);
        fprintf(out, "\n  \"cases\": [\n");
        /* A comma after every case but the last that runs (cases that do not run may sit between). */
        const char *separator = "";
        for (int c = 0; c < CASE_COUNT; c++) {
            if (!case_runs((bench_case)c, s))
                continue;
            fprintf(out,
                    "%s    {\"name\": \"%s\", \"ok\": %s, \"flop_basis\": \"%s\", \"flops\": %.6g, \"best_ms\": %.3f, "
                    "\"gflops\": %.1f, \"efficiency\": %.3f, \"first_call_ms\": %.3f, \"workspace_bytes\": %lld, "
                    "\"peak_rss_growth_bytes\": %lld, \"ceiling_gflops\": %.1f, \"loss\": %s, \"skipped_fraction\": %.4f, "
                    "\"paired_exact_ms\": %s, \"paired_filtered_ms\": %s, \"paired_counted_ms\": %s, "
                    "\"paired_ignored_ms\": %s, \"paired_padded_ms\": %s, \"paired_packed_ms\": %s}",
                    separator, case_name((bench_case)c, s), res[c].ok ? "true" : "false", case_basis((bench_case)c, s),
                    res[c].flops, res[c].best_ms, gflops(&res[c]), efficiency(&res[c]), res[c].first_ms,
                    (long long)res[c].workspace_bytes, (long long)res[c].peak_growth_bytes, res[c].ceiling_gflops,
                    json_number(res[c].loss, num), res[c].skipped_fraction, json_number(res[c].paired_exact_ms, pe),
                    json_number(res[c].paired_filtered_ms, pf), json_number(res[c].paired_counted_ms, pc),
                    json_number(res[c].paired_ignored_ms, pi), json_number(res[c].paired_padded_ms, pd),
                    json_number(res[c].paired_packed_ms, pk));
            separator = ",\n";
        }
        fprintf(out, "\n  ]\n}\n");
        return;
    }
    if (f == FORMAT_CSV) {
        for (int c = 0; c < CASE_COUNT; c++)
            if (case_runs((bench_case)c, s))
                print_row(out, s, (bench_case)c, &res[c]);
        return;
    }
    /* Distillation's options and teacher, and the teacher's softmax (empty for the other heads). */
    char distill[160] = "", teacher[80] = "";
    if (s->head == HEAD_DISTILL) {
        snprintf(distill, sizeof distill,
                 ", distill %s (beta %g, temperature %g, weight_hard_loss %g, top_k %lld%s), teacher H=%lld",
                 divergence_names[s->distill.divergence], s->distill.beta, s->distill.temperature,
                 s->distill.weight_hard_loss, (long long)s->distill.top_k,
                 s->distill.top_k && s->distill.add_tail ? " with the tail" : "", (long long)s->teacher_hidden);
        snprintf(teacher, sizeof teacher, "; the teacher's mean softmax entropy %.3f nats",
                 s->teacher_stats.mean_entropy);
    }
    if (s->head == HEAD_DISTILL_TOPK)
        snprintf(distill, sizeof distill, ", distill_topk k %lld%s", (long long)s->topk_k,
                 s->topk_no_tail ? " without the tail" : " with the tail");
    if (s->head == HEAD_LOGPROB)
        snprintf(distill, sizeof distill, ", logprob (g_logp 1, g_entropy 0.01)%s%.0lld%s",
                 s->support_k ? ", support of " : "", (long long)s->support_k, s->support_k ? " ids per token" : "");
    if (s->head == HEAD_GRPO)
        snprintf(distill, sizeof distill, ", grpo %s (top_entropy_quantile %g%s)", grpo_loss_names[s->grpo.loss_type],
                 s->grpo.top_entropy_quantile, s->grpo_trl_options ? ", sampler IS, off-policy mask, KL" : "");
    fprintf(out, "fh_bench: N=%lld H=%lld V=%lld%s, %s (gradients %s%s%s), layout %s, %d threads, budget %s, BLIS kernel "
                 "set %s, row kernels %s, fp32 GEMMs %s, bf16 GEMMs %s, best of %d; inputs %s%s%s (%s data): mean softmax entropy %.3f nats, p < "
                 "2^-12 %.4f, p < 2^-28 %.4f (%lld rows sampled)%s\n\n",
            (long long)s->n, (long long)s->hidden, (long long)s->vocab, distill, dtype_name(s->dtype),
            dtype_name(s->grad_dtype),
            s->fp32_du ? ", fp32 dU" : "", s->batch_invariant ? ", batch-invariant" : "", layout_name(s->layout),
            s->threads, s->budget ? "set" : "default", kernels->kernel_set, kernels->elementwise, kernels->fp32_gemm,
            kernels->bf16_gemm,
            s->reps,
            distribution_label(&s->dist, label), s->dist.kind == BENCH_REPLAY ? " of " : "",
            s->dist.kind == BENCH_REPLAY ? s->dist.dir : "", data, s->stats.mean_entropy, s->stats.below_2m12,
            s->stats.below_2m28, (long long)s->stats.rows, teacher);
    /* The basis column is as wide as its longest entry (distillation's), at least 9. */
    int basis_width = 9;
    for (int c = 0; c < CASE_COUNT; c++)
        if (case_runs((bench_case)c, s) && (int)strlen(case_basis((bench_case)c, s)) > basis_width)
            basis_width = (int)strlen(case_basis((bench_case)c, s));
    fprintf(out, "%-26s %-*s %10s %9s %9s %6s %10s %12s %14s %8s\n", "case", basis_width, "basis", "best ms", "GFLOP/s",
            "ceiling", "eff.", "first ms", "workspace", "peak RSS +", "skipped");
    for (int c = 0; c < CASE_COUNT; c++) {
        if (!case_runs((bench_case)c, s))
            continue;
        if (!res[c].ok) {
            fprintf(out, "%-26s failed\n", case_name((bench_case)c, s));
            continue;
        }
        fprintf(out, "%-26s %-*s %10.1f %9.1f %9.1f %6.3f %10.1f %9.1f MiB %10.1f MiB %8.4f\n",
                case_name((bench_case)c, s), basis_width, case_basis((bench_case)c, s), res[c].best_ms, gflops(&res[c]), res[c].ceiling_gflops,
                efficiency(&res[c]), res[c].first_ms, res[c].workspace_bytes / 1048576.0,
                res[c].peak_growth_bytes / 1048576.0, res[c].skipped_fraction);
    }
    const result *filtered = &res[CASE_FILTERED];
    if (case_runs(CASE_FILTERED, s) && filtered->ok)
        fprintf(out, "\n%s and %s alternating in one process, best of %d each: %.1f and %.1f ms, %.2fx\n",
                case_name(CASE_TRAIN, s), case_name(CASE_FILTERED, s), s->reps, filtered->paired_exact_ms,
                filtered->paired_filtered_ms, filtered->paired_exact_ms / filtered->paired_filtered_ms);
    for (int c = CASE_SUPPORT_SPLIT; c <= CASE_SUPPORT_TRAIN; c++) {
        const bench_case full = c == CASE_SUPPORT_SPLIT ? CASE_SPLIT : CASE_TRAIN;
        if (case_runs((bench_case)c, s) && res[c].ok && res[full].ok)
            fprintf(out, "%s%s / %s: %.4f\n", c == CASE_SUPPORT_SPLIT ? "\n" : "", case_name((bench_case)c, s),
                    case_name(full, s), res[c].best_ms / res[full].best_ms);
    }
    const result *train = &res[CASE_TRAIN];
    if (case_runs(CASE_TRAIN, s) && train->ok && s->head == HEAD_CE && s->ignore_frac > 0.0)
        fprintf(out, "\n%s with %.0f%% of the rows ignored (%s) and with every row counted, alternating in one process, "
                     "best of %d each: %.1f and %.1f ms, ratio %.3f\n",
                case_name(CASE_TRAIN, s), 100.0 * s->ignore_frac,
                s->ignore_scattered ? "scattered" : "prompt-like runs", s->reps, train->paired_ignored_ms,
                train->paired_counted_ms, train->paired_ignored_ms / train->paired_counted_ms);
    if (case_runs(CASE_TRAIN, s) && train->ok && s->padding_frac > 0.0)
        fprintf(out, "\n%s on the packed rows (cu_seqlens) and on the padded [B, T] rows (%.1f%% of them padding), "
                     "alternating in one process, best of %d each: %.1f and %.1f ms, ratio %.3f\n",
                case_name(CASE_TRAIN, s), 100.0 * s->padding_frac_measured, s->reps, train->paired_packed_ms,
                train->paired_padded_ms, train->paired_packed_ms / train->paired_padded_ms);
}

static const char csv_header[] =
    "n,hidden,vocab,threads,case,flop_basis,best_ms,gflops,efficiency,first_call_ms,workspace_bytes,"
    "peak_rss_growth_bytes,ceiling_gflops,distribution,mean_entropy,frac_p_below_2m12,frac_p_below_2m28,"
    "skipped_fraction,paired_exact_ms,paired_filtered_ms\n";

/* Sweeps n or vocab, writes DIR/sweep_<what>.csv (rows grouped by case, so that each case's points are
 * consecutive and gnuplot joins them) and a gnuplot script rendering two PNGs. */
static int sweep(const char *what, const char *dir, const shape *base, const char *kernels)
{
    enum { POINTS = 6 };
    static const int64_t ns[POINTS] = {128, 256, 512, 1024, 2048, 4096};
    static const int64_t vocabs[POINTS] = {8192, 16384, 32768, 65536, 131072, 151643};
    const int by_n = strcmp(what, "n") == 0;
    shape shapes[POINTS];
    result res[POINTS][CASE_COUNT];
    for (int k = 0; k < POINTS; k++) {
        shapes[k] = *base;
        if (by_n)
            shapes[k].n = ns[k];
        else
            shapes[k].vocab = vocabs[k];
        char why[512];
        if (describe_inputs(&shapes[k], why, sizeof why) != 0) {
            fprintf(stderr, "fh_bench: %s\n", why);
            return -1;
        }
        for (int c = 0; c < CASE_COUNT; c++)
            res[k][c] = run_case((bench_case)c, &shapes[k]);
        share_best_ceiling(res[k]);
        fprintf(stderr, "sweep %s: %s = %lld done\n", what, what, (long long)(by_n ? shapes[k].n : shapes[k].vocab));
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/sweep_%s.csv", dir, what);
    FILE *csv = fopen(path, "w");
    if (!csv)
        return -1;
    fputs(csv_header, csv);
    for (int c = 0; c < CASE_COUNT; c++)
        for (int k = 0; k < POINTS; k++)
            print_row(csv, &shapes[k], (bench_case)c, &res[k][c]);
    fclose(csv);
    snprintf(path, sizeof path, "%s/sweep_%s.gp", dir, what);
    FILE *gp = fopen(path, "w");
    if (!gp)
        return -1;
    char fixed[128];
    if (by_n)
        snprintf(fixed, sizeof fixed, "H=%lld V=%lld", (long long)base->hidden, (long long)base->vocab);
    else
        snprintf(fixed, sizeof fixed, "N=%lld H=%lld", (long long)base->n, (long long)base->hidden);
    fprintf(gp,
            "# Renders sweep_%1$s_time.png and sweep_%1$s_memory.png: run `gnuplot sweep_%1$s.gp` in this folder.\n"
            "set datafile separator ','\nset key top left noenhanced\nset grid\nset logscale x 2\n"
            "set terminal pngcairo size 900,600 noenhanced\nset xlabel '%2$s'\n"
            "cases = 'fused_forward fused_split fused_train_step materialized'\n"
            "set output 'sweep_%1$s_time.png'\nset ylabel 'time per call (ms)'\n"
            "set title 'fused vs materialized: time per call (%3$s, %4$d threads, BLIS %5$s)'\n"
            "plot for [c in cases] 'sweep_%1$s.csv' using (stringcolumn(5) eq c ? $%6$d : NaN):7 "
            "with linespoints title c\n"
            "set output 'sweep_%1$s_memory.png'\nset ylabel 'peak RSS growth (MiB)'\n"
            "set title 'fused vs materialized: peak memory (%3$s, %4$d threads)'\n"
            "plot for [c in cases] 'sweep_%1$s.csv' using (stringcolumn(5) eq c ? $%6$d : NaN):($12/1048576) "
            "with linespoints title c\n",
            what, by_n ? "tokens N" : "vocabulary V", fixed, base->threads, kernels, by_n ? 1 : 3);
    fclose(gp);
    return 0;
}

/* --loss ce|grpo|dpo|orpo|simpo|cpo|distill|kto|distill_topk|logprob */
static int parse_loss(const char *v, shape *s)
{
    s->head = strcmp(v, "ce") == 0             ? HEAD_CE
              : strcmp(v, "logprob") == 0      ? HEAD_LOGPROB
              : strcmp(v, "grpo") == 0         ? HEAD_GRPO
              : strcmp(v, "distill") == 0      ? HEAD_DISTILL
              : strcmp(v, "kto") == 0          ? HEAD_KTO
              : strcmp(v, "distill_topk") == 0 ? HEAD_DISTILL_TOPK
                                               : HEAD_PREFERENCE;
    for (int k = 0; s->head == HEAD_PREFERENCE && k < 4; k++)
        if (strcmp(v, preference_names[k]) == 0) {
            s->preference = (fh_preference_loss)k;
            return 0;
        }
    return s->head == HEAD_PREFERENCE ? -1 : 0;
}

/* --grpo-loss-type grpo|bnpo|dr_grpo|dapo|cispo|sapo|luspo|vespo */
static int parse_grpo_loss_type(const char *v, fh_grpo_options *o)
{
    for (int k = 0; k < 8; k++)
        if (strcmp(v, grpo_loss_names[k]) == 0) {
            o->loss_type = (fh_grpo_loss_type)k;
            return 0;
        }
    return -1;
}

/* --divergence forward_kl|reverse_kl|jsd */
static int parse_divergence(const char *v, fh_distill_options *o)
{
    for (int k = 0; k < 3; k++)
        if (strcmp(v, divergence_names[k]) == 0) {
            o->divergence = (fh_divergence)k;
            return 0;
        }
    return -1;
}

/* A whole argument as a finite number in [lo, hi]. Returns 0, or -1. */
static int parse_number(const char *v, double lo, double hi, double *x)
{
    char *end;
    *x = strtod(v, &end);
    return end != v && *end == '\0' && isfinite(*x) && *x >= lo && *x <= hi ? 0 : -1;
}

static void usage(void)
{
    fprintf(stderr, "usage: fh_bench [--n N] [--hidden H] [--vocab V] [--threads T] [--budget BYTES] [--reps K]\n"
                    "                [--layout hv|vh] [--dtype f32|bf16] [--grad-dtype f32|bf16] [--fp32-du] [--batch-invariant]\n"
                    "                [--json | --csv] [--sweep n|vocab --out DIR] [--grad-filter-eps EPS]\n"
                    "                [--grad-filter-tail estimate|drop] [--tile-rows R]\n"
                    "                [--ignore-frac F [--ignore-pattern runs|scattered]]   (CE: F of the rows ignored,\n"
                    "                the first F of every 256 rows, or scattered; the train step also measured against\n"
                    "                every row counted)\n"
                    "                [--distribution uniform|peaked[:ENTROPY]|DIR]   (DIR: a saved batch; H, V and at\n"
                    "                most N rows come from its files)\n"
                    "       fh_bench --loss grpo --batch B --seq T [--hidden H] [--vocab V] [the options above but --n]\n"
                    "                [--grpo-loss-type grpo|bnpo|dr_grpo|dapo|cispo|sapo|luspo|vespo]\n"
                    "                [--top-entropy-quantile Q] [--grpo-trl-options]   (TRL's defaults, dapo; with\n"
                    "                --grpo-trl-options: sampler log-probs with sequence_mask importance sampling, the\n"
                    "                off-policy mask at 0.5, beta 0.04 with the bias-corrected KL, entropy_coef 0.01)\n"
                    "                [--packed P]   (grpo, dpo, orpo, simpo, cpo, kto: sequence lengths 1 .. T about\n"
                    "                T (1 - P), the rest padding; the train step also measured on the packed rows)\n"
                    "       fh_bench --loss dpo|orpo|simpo|cpo --batch PAIRS --seq T [as for grpo]\n"
                    "       fh_bench --loss kto --batch B --seq T [as for grpo]   (TRL's defaults, a per-sequence\n"
                    "                reference, the KL term 0.1)\n"
                    "       fh_bench --loss distill [--n N] [--hidden H] [--teacher-hidden HT] [--vocab V]\n"
                    "                [--divergence forward_kl|reverse_kl|jsd] [--beta B] [--temperature T]\n"
                    "                [--weight-hard-loss W] [the options above but --sweep and --grad-filter-eps]\n"
                    "                [--k K] [--no-tail]   (defaults: HT = H, jsd, B 0.5, T 1, W 0; the teacher's\n"
                    "                hidden size HT; --k: the divergence over each token's top-K support)\n"
                    "       fh_bench --loss distill_topk [--k K] [--no-tail] [--n N] [--hidden H] [--vocab V]\n"
                    "                [the options above but --sweep and --grad-filter-eps]   (the teacher's top-K ids and\n"
                    "                log-probs, K 20, with the tail unless --no-tail)\n"
                    "       fh_bench --loss logprob [--support K] [--n N] [--hidden H] [--vocab V]\n"
                    "                [the options above but --sweep and --grad-filter-eps]   (log-probs, entropies\n"
                    "                and lse with their gradients over the vocabulary; with --support K also over\n"
                    "                each token's K ids, its target among them, and the ratios of the two)\n");
}

int main(int argc, char **argv)
{
    shape s = {.n = 1024, .hidden = 1024, .vocab = 32768, .threads = 2, .budget = 0, .layout = FH_LAYOUT_HV,
               .reps = 3, .dist = {BENCH_UNIFORM, 0.0, 1.0f, NULL}};
    format f = FORMAT_TABLE;
    int grad_dtype = -1;
    const char *sweep_what = NULL, *out_dir = ".";
    int n_given = 0, hidden_vocab_given = 0, distill_given = 0, grpo_given = 0, topk_given = 0, k_given = 0;
    fh_distill_options_init(&s.distill);
    fh_grpo_options_init(&s.grpo);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0)
            f = FORMAT_JSON;
        else if (strcmp(a, "--fp32-du") == 0)
            s.fp32_du = 1;
        else if (strcmp(a, "--batch-invariant") == 0)
            s.batch_invariant = 1;
        else if (strcmp(a, "--csv") == 0)
            f = FORMAT_CSV;
        else if (strcmp(a, "--grpo-trl-options") == 0)
            s.grpo_trl_options = grpo_given = 1;
        else if (strcmp(a, "--no-tail") == 0)
            s.topk_no_tail = topk_given = 1;
        else if (!v) {
            usage();
            return 2;
        } else if (strcmp(a, "--n") == 0)
            s.n = atoll(argv[++i]), n_given = 1;
        else if (strcmp(a, "--hidden") == 0)
            s.hidden = atoll(argv[++i]), hidden_vocab_given = 1;
        else if (strcmp(a, "--tile-rows") == 0)
            s.tile_rows = atoll(argv[++i]);
        else if (strcmp(a, "--ignore-frac") == 0) {
            if (parse_number(argv[++i], 0.0, 1.0, &s.ignore_frac) != 0) {
                usage();
                return 2;
            }
        } else if (strcmp(a, "--ignore-pattern") == 0) {
            if (strcmp(v, "runs") && strcmp(v, "scattered")) {
                usage();
                return 2;
            }
            s.ignore_scattered = strcmp(argv[++i], "scattered") == 0;
        }
        else if (strcmp(a, "--grad-filter-eps") == 0) {
            if (parse_number(argv[++i], 0.0, 1.0, &s.filter_eps) != 0 || s.filter_eps == 1.0) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--grad-filter-tail") == 0) {
            i++;
            if (!v || (strcmp(v, "estimate") != 0 && strcmp(v, "drop") != 0)) {
                usage();
                return 2;
            }
            s.filter_tail = strcmp(v, "drop") == 0 ? FH_FILTER_TAIL_DROP : FH_FILTER_TAIL_ESTIMATE;
        }
        else if (strcmp(a, "--packed") == 0) {
            if (parse_number(argv[++i], 0.0, 1.0, &s.padding_frac) != 0 ||
                !(s.padding_frac > 0.0 && s.padding_frac < 1.0)) {
                usage();
                return 2;
            }
        } else if (strcmp(a, "--support") == 0) {
            if ((s.support_k = atoll(argv[++i])) < 1) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--k") == 0) {
            topk_given = k_given = 1;
            if ((s.topk_k = atoll(argv[++i])) < 1 || s.topk_k > FH_DISTILL_TOPK_MAX_K) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--teacher-hidden") == 0) {
            distill_given = 1;
            if ((s.teacher_hidden = atoll(argv[++i])) < 1) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--divergence") == 0 || strcmp(a, "--beta") == 0 || strcmp(a, "--temperature") == 0 ||
                 strcmp(a, "--weight-hard-loss") == 0) {
            fh_distill_options *o = &s.distill;
            int bad;
            distill_given = 1;
            i++;
            if (strcmp(a, "--divergence") == 0)
                bad = parse_divergence(v, o);
            else if (strcmp(a, "--beta") == 0)
                bad = parse_number(v, 0.0, 1.0, &o->beta);
            else if (strcmp(a, "--temperature") == 0)
                bad = parse_number(v, 0.0, INFINITY, &o->temperature) != 0 || o->temperature == 0.0;
            else
                bad = parse_number(v, 0.0, INFINITY, &o->weight_hard_loss);
            if (bad) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--vocab") == 0)
            s.vocab = atoll(argv[++i]), hidden_vocab_given = 1;
        else if (strcmp(a, "--distribution") == 0) {
            if (bench_distribution_parse(argv[++i], &s.dist) != 0) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--threads") == 0)
            s.threads = atoi(argv[++i]);
        else if (strcmp(a, "--budget") == 0)
            s.budget = atoll(argv[++i]);
        else if (strcmp(a, "--layout") == 0 && (strcmp(v, "hv") == 0 || strcmp(v, "vh") == 0))
            s.layout = strcmp(argv[++i], "vh") == 0 ? FH_LAYOUT_VH : FH_LAYOUT_HV;
        else if (strcmp(a, "--dtype") == 0 && (strcmp(v, "f32") == 0 || strcmp(v, "bf16") == 0))
            s.dtype = strcmp(argv[++i], "bf16") == 0 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
        else if (strcmp(a, "--grad-dtype") == 0 && (strcmp(v, "f32") == 0 || strcmp(v, "bf16") == 0))
            grad_dtype = strcmp(argv[++i], "bf16") == 0 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
        else if (strcmp(a, "--reps") == 0)
            s.reps = atoi(argv[++i]);
        else if (strcmp(a, "--loss") == 0) {
            if (parse_loss(argv[++i], &s) != 0) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--batch") == 0)
            s.batch = atoll(argv[++i]);
        else if (strcmp(a, "--grpo-loss-type") == 0 || strcmp(a, "--top-entropy-quantile") == 0) {
            grpo_given = 1;
            i++;
            if (strcmp(a, "--grpo-loss-type") == 0 ? parse_grpo_loss_type(v, &s.grpo)
                                                   : parse_number(v, 0.0, 1.0, &s.grpo.top_entropy_quantile)) {
                usage();
                return 2;
            }
        }
        else if (strcmp(a, "--seq") == 0)
            s.seq = atoll(argv[++i]);
        else if (strcmp(a, "--sweep") == 0)
            sweep_what = argv[++i];
        else if (strcmp(a, "--out") == 0)
            out_dir = argv[++i];
        else {
            usage();
            return 2;
        }
    }
    s.grad_dtype = grad_dtype < 0 ? s.dtype : (fh_dtype)grad_dtype;
    if (distill_given && s.head != HEAD_DISTILL) {
        fprintf(stderr, "fh_bench: --teacher-hidden, --divergence, --beta, --temperature and --weight-hard-loss apply "
                        "to --loss distill only\n");
        return 2;
    }
    if (topk_given && s.head != HEAD_DISTILL_TOPK && s.head != HEAD_DISTILL) {
        fprintf(stderr, "fh_bench: --k and --no-tail apply to --loss distill_topk and distill only\n");
        return 2;
    }
    if (s.head == HEAD_DISTILL) { /* a teacher head's top-k supports (TRL's iw_opd top_k and add_tail) */
        s.distill.top_k = k_given ? s.topk_k : 0;
        s.distill.add_tail = !s.topk_no_tail;
    }
    if (s.support_k && (s.head != HEAD_LOGPROB || s.support_k > s.vocab)) {
        fprintf(stderr, "fh_bench: --support K applies to --loss logprob, with K at most V\n");
        return 2;
    }
    if (s.head == HEAD_LOGPROB && (sweep_what || s.filter_eps > 0.0)) {
        usage();
        return 2;
    }
    s.topk_k = s.topk_k ? s.topk_k : 20;
    if (s.head == HEAD_DISTILL_TOPK && (sweep_what || s.topk_k > s.vocab || s.filter_eps > 0.0)) {
        usage();
        return 2;
    }
    if (s.head == HEAD_DISTILL && sweep_what) {
        usage();
        return 2;
    }
    if (grpo_given && s.head != HEAD_GRPO) {
        fprintf(stderr, "fh_bench: --grpo-loss-type, --top-entropy-quantile and --grpo-trl-options apply to --loss grpo "
                        "only\n");
        return 2;
    }
    if (s.grpo_trl_options) {
        s.grpo.off_policy_mask_threshold = 0.5;
        s.grpo.beta = 0.04;
        s.grpo.use_bias_correction_kl = 1;
        s.grpo.entropy_coef = 0.01;
    }
    s.teacher_hidden = s.teacher_hidden ? s.teacher_hidden : s.hidden;
    if (s.head == HEAD_GRPO || s.head == HEAD_PREFERENCE || s.head == HEAD_KTO) {
        if (s.batch < 1 || s.seq < 1 || sweep_what) {
            usage();
            return 2;
        }
        s.n = (s.head == HEAD_PREFERENCE ? 2 : 1) * s.batch * s.seq;
        int64_t rows = 0;
        for (int64_t b = 0; s.padding_frac > 0.0 && b < s.n / s.seq; b++)
            rows += sequence_length(&s, b);
        s.padding_frac_measured = s.padding_frac > 0.0 ? 1.0 - (double)rows / (double)s.n : 0.0;
        /* dr_grpo's constant over packed rows is max_completion_length: T, as the padded call's default */
        if (s.padding_frac > 0.0 && s.grpo.max_completion_length <= 0)
            s.grpo.max_completion_length = s.seq;
    } else if (s.padding_frac > 0.0) {
        fprintf(stderr, "fh_bench: --packed applies to --loss grpo, dpo, orpo, simpo, cpo and kto only\n");
        return 2;
    }
    if (s.n < 1 || s.hidden < 1 || s.teacher_hidden < 1 || s.vocab < 1 || s.threads < 1 || s.reps < 1 ||
        (sweep_what && strcmp(sweep_what, "n") && strcmp(sweep_what, "vocab"))) {
        usage();
        return 2;
    }
    /* The threads the library runs (--threads clamped to the CPUs available), which every case and ceiling uses. */
    fh_context *probe = NULL;
    int threads = 0;
    if (fh_context_create(&probe) == FH_OK && fh_context_set(probe, FH_PARAM_THREADS, s.threads) == FH_OK &&
        fh_context_threads(probe, &threads) == FH_OK && threads != s.threads) {
        fprintf(stderr, "fh_bench: --threads %d: %d CPUs available here, so %d threads run\n", s.threads, threads,
                threads);
        s.threads = threads;
    }
    fh_context_destroy(probe);
    char why[512];
    if (s.dist.kind != BENCH_UNIFORM && s.head != HEAD_CE && s.head != HEAD_DISTILL) {
        fprintf(stderr, "fh_bench: --distribution applies to --loss ce and distill (the student's inputs) only\n");
        return 2;
    }
    if (s.dist.kind == BENCH_REPLAY) {
        int64_t rows;
        if (sweep_what || hidden_vocab_given) {
            fprintf(stderr, "fh_bench: a saved batch fixes H and V: no --hidden, --vocab or --sweep with it\n");
            return 2;
        }
        if (bench_replay_shape(s.dist.dir, &rows, &s.hidden, &s.vocab, why, sizeof why) != 0) {
            fprintf(stderr, "fh_bench: %s\n", why);
            return 2;
        }
        if (n_given && s.n > rows) {
            fprintf(stderr, "fh_bench: --n %lld: %s holds %lld rows\n", (long long)s.n, s.dist.dir, (long long)rows);
            return 2;
        }
        s.n = n_given ? s.n : rows;
    }
    fh_kernel_info kernels;
    fh_kernel_query(&kernels);
    if (sweep_what)
        return sweep(sweep_what, out_dir, &s, kernels.kernel_set) == 0 ? 0 : 1;
    if (describe_inputs(&s, why, sizeof why) != 0) {
        fprintf(stderr, "fh_bench: %s\n", why);
        return 2;
    }
    result res[CASE_COUNT];
    memset(res, 0, sizeof res);
    int failed = 0;
    for (int c = 0; c < CASE_COUNT; c++) {
        if (!case_runs((bench_case)c, &s))
            continue;
        res[c] = run_case((bench_case)c, &s);
        failed |= !res[c].ok;
    }
    share_best_ceiling(res);
    /* Every case computes the same loss; a benchmark of different problems would be worthless. The materialized
     * loss uses fp32 exps summed in double: 1e-5 relative is far above both errors (distillation's cases, fp32 and
     * bf16, agree to 2e-8). GRPO's cases, which have no materialized baseline, are checked against its forward, and
     * so are the preference losses'. */
    const bench_case reference = case_runs(CASE_MATERIALIZED, &s) ? CASE_MATERIALIZED : CASE_FORWARD;
    const double expected = res[reference].loss;
    for (int c = CASE_FORWARD; c <= CASE_FILTERED; c++)
        if (res[c].ok && case_runs((bench_case)c, &s) && !(fabs(res[c].loss - expected) <= 1e-5 * fabs(expected))) {
            fprintf(stderr, "fh_bench: %s loss %.9g differs from the %s %.9g\n", case_name((bench_case)c, &s),
                    res[c].loss, reference == CASE_FORWARD ? "forward's" : "materialized", expected);
            failed = 1;
        }
    if (case_runs(CASE_SUPPORT_TRAIN, &s) && res[CASE_SUPPORT_SPLIT].ok && res[CASE_SUPPORT_TRAIN].ok &&
        !(fabs(res[CASE_SUPPORT_TRAIN].loss - res[CASE_SUPPORT_SPLIT].loss) <=
          1e-5 * fabs(res[CASE_SUPPORT_SPLIT].loss))) {
        fprintf(stderr, "fh_bench: support_train_step's log-probs %.9g differ from support_split's %.9g\n",
                res[CASE_SUPPORT_TRAIN].loss, res[CASE_SUPPORT_SPLIT].loss);
        failed = 1;
    }
    if (f == FORMAT_CSV)
        fputs(csv_header, stdout);
    print_report(f, &s, res, &kernels, stdout);
    return failed ? 1 : 0;
}
