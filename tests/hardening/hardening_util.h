/* Helpers shared by the hardening suites: every output a call can write gathered in one place (so that a
 * canary fill and a bitwise comparison cover all of them), every head call run from a problem, and a GRPO problem
 * with random inputs (also a preference batch, a KTO batch, and with its teachers a distillation and a top-k
 * distillation problem). Cross-entropy problems are tests/ce_harness.h's. */
#ifndef FH_HARDENING_UTIL_H
#define FH_HARDENING_UTIL_H

#include "ce_harness.h"

#include <stddef.h>
#include <stdint.h>

/* The head calls: the FH_HEAD_CALL lines of tests/entry_points.def, as HU_<entry point>, so that the suites that loop
 * over them take a new head call in. hu_run dispatches them in a switch with no default and -Wswitch an error: a
 * listed head call that hu_run cannot run does not compile. */
#define FH_SETUP_CALL(name)
#define FH_HEAD_CALL(name) HU_##name,
#define FH_WORKSPACE_QUERY(name)
typedef enum hu_call {
#include "entry_points.def"
} hu_call;
#undef FH_HEAD_CALL
#define FH_HEAD_CALL(name) +1
enum { HU_CALL_COUNT = 0
#include "entry_points.def"
};
#undef FH_SETUP_CALL
#undef FH_HEAD_CALL
#undef FH_WORKSPACE_QUERY
const char *hu_call_name(hu_call call);
/* GRPO, preference, KTO, distillation and top-k distillation calls run on a hu_grpo_problem (preference: its even
 * batch as pairs; KTO: its sequences with their labels; distillation: its n tokens, ids as targets, and its teacher;
 * top-k: its n tokens, ids as targets, and its top-k teacher), the others on a cp_problem (log-probs: its targets,
 * ignore_index and softcap, temperature 1, grad_output as each upstream gradient). */
int hu_call_on_sequences(hu_call call);
int hu_call_is_preference(hu_call call);
int hu_call_is_kto(hu_call call);
int hu_call_is_distill(hu_call call);
int hu_call_is_distill_topk(hu_call call);
/* Log-probs over a support: on a hu_grpo_problem's n tokens, its ids as targets, over its support. */
int hu_call_is_support(hu_call call);
/* The calls with gradients (backward or train step). */
int hu_call_has_grads(hu_call call);

/* Everything a call writes. Arrays are sized for the problem; dbias only when the problem has a bias. */
typedef struct hu_outputs {
    int64_t n, hidden, vocab;
    int has_bias;
    double loss, z_loss;
    double soft_loss, hard_loss; /* distillation */
    fh_grpo_metrics metrics;
    fh_preference_metrics preference_metrics;
    fh_kto_metrics kto_metrics;
    float *per_token_loss, *logp, *lse, *entropy;
    float *sequence_logps, *rewards; /* n each (a preference batch has 2B <= n sequences, a KTO batch B <= n) */
    int64_t *argmax;
    float *dx, *dweight, *dbias;
    float *logits; /* [n, vocab]: the log-probs' kept logits */
} hu_outputs;

void hu_outputs_alloc(hu_outputs *o, int64_t n, int64_t hidden, int64_t vocab, int has_bias);
void hu_outputs_free(hu_outputs *o);
/* Every byte of every output (scalars, metrics and arrays) set to `byte`. */
void hu_outputs_fill(hu_outputs *o, unsigned char byte);
/* NULL when bitwise identical, else the name of the first output that differs. */
const char *hu_outputs_diff(const hu_outputs *a, const hu_outputs *b);
/* 1 when every byte of every output still equals `byte`. */
int hu_outputs_untouched(const hu_outputs *o, unsigned char byte);

/* A GRPO problem with every input the batch can have. With an even batch it is also a preference batch:
 * sequences b and batch/2 + b a pair, the reference log-probs per token, `preference` options. It is a KTO batch
 * too: sequence b desirable for even b, undesirable for odd b, `kto` options, the reference log-probs per token
 * (ref_logps) or per sequence (kto_ref_logps), the KL term as one value or as per-sequence log-ratios (neither for
 * apo_zero_unpaired). With its teacher it is a distillation problem: the student is the GRPO linear, the targets are the ids (-100 ignored, or NULL
 * with distill_no_targets), the teacher has its own hidden size, the other layout and a bias. */
typedef struct hu_grpo_problem {
    int64_t batch, seq, hidden, vocab;
    fh_layout layout;
    float *x, *weight, *bias; /* bias may be NULL */
    int64_t *ids;
    float *mask, *advantages, *old_logps, *ref_logps;
    float *sampling_logps; /* the sampler's: the old ones + U(-0.1, 0.1); the default options' importance-sampling
                              correction (sequence_mask below 3) applies */
    fh_grpo_options options;
    fh_preference_options preference;
    /* KTO. */
    fh_kto_options kto;
    uint8_t *kto_labels;        /* [batch] */
    float *kto_ref_logps;       /* [batch] reference sequence log-probs */
    float kto_kl;               /* the KL term as TRL uses it (>= 0) */
    float *kto_kl_logratios;    /* [batch] */
    int kto_ref_per_sequence;   /* 1: kto_ref_logps, 0: ref_logps per token */
    int kto_kl_per_sequence;    /* 1: kto_kl_logratios, 0: kto_kl (kto only) */
    float grad_output;
    /* Distillation. */
    int64_t teacher_hidden;   /* hidden + 3 */
    fh_layout teacher_layout; /* the other layout */
    float *teacher_x, *teacher_weight, *teacher_bias;
    fh_distill_options distill;
    int distill_no_targets;   /* 1: targets NULL (weight_hard_loss must then be 0) */
    float *distill_grad;      /* [n] grad_output; element 0 serves mean and sum */
    /* Set by hu_distill_use_bf16: the distillation calls read these bf16 bits, else NULL (fp32). */
    uint16_t *x_bf16, *weight_bf16, *teacher_x_bf16, *teacher_weight_bf16;
    /* Top-k distillation (the student's bf16 bits too): HU_TOPK_K entries per token, ragged (the last two of tokens
     * 1, 4, 7, ... padded, token 3's all: no valid entry), the ids as targets unless distill_no_targets, grad_output
     * distill_grad. */
    int64_t *topk_ids;    /* [n, HU_TOPK_K] */
    float *topk_logprobs; /* [n, HU_TOPK_K] */
    fh_distill_topk_options distill_topk;
    /* Log-probs over a support: HU_SUPPORT_K entries per token, padded: its id (when counted), then distinct others,
     * the last two of tokens 2, 5, 8, ... -1 (hu_support_fill). */
    int64_t *support_ids; /* [n, HU_SUPPORT_K] */
} hu_grpo_problem;
enum { HU_TOPK_K = 7, HU_SUPPORT_K = 6 };

/* Random inputs (logits of standard deviation ~3, masks with a padded tail, advantages of both signs, old
 * and reference log-probs within +-0.4 of log(1/V), sampler log-probs within +-0.1 of the old ones), TRL default
 * options with beta 0.04 and the off-policy mask at 0; DPO at TRL's current semantics, label smoothing 0.1 and the
 * loss types sigmoid, robust and sft weighted 0.8, 0.2 and 0.5; KTO's loss kto, beta 0.1, undesirable_weight 1.5,
 * reference sequence log-probs within +-1 of the masked sums of the token ones, a KL value in [0, 0.5) and KL
 * log-ratios in [-0.3, 0.7), the reference per token and the KL as one value. */
void hu_grpo_problem_init(hu_grpo_problem *p, int64_t batch, int64_t seq, int64_t hidden, int64_t vocab,
                          fh_layout layout, int bias, uint64_t seed);
void hu_grpo_problem_free(hu_grpo_problem *p);
void hu_grpo_linear(const hu_grpo_problem *p, fh_linear *lin);
void hu_grpo_batch(const hu_grpo_problem *p, fh_grpo_batch *batch);
/* The KTO batch: the reference and KL inputs the problem's switches and loss type choose. */
void hu_kto_batch(const hu_grpo_problem *p, fh_kto_batch *batch);
/* The distillation calls' student and teacher (bf16 views where hu_distill_use_bf16 made them). */
void hu_distill_linears(const hu_grpo_problem *p, fh_linear *student, fh_linear *teacher);
/* Rounds the student's and/or the teacher's x and weight to bf16 in place; the distillation calls then read
 * their bf16 bits. */
void hu_distill_use_bf16(hu_grpo_problem *p, int student, int teacher);
/* ids [n, HU_SUPPORT_K], a padded support of the n targets (in [0, vocab) or ignored): entry e of row i (target y, 0
 * when ignored) (y + e) mod vocab, -1 for e >= vocab and for the last two of rows 2, 5, 8, ... */
void hu_support_fill(int64_t *ids, const int64_t *targets, int64_t n, int64_t vocab);
/* The support calls' support (the problem's). */
void hu_support(const hu_grpo_problem *p, fh_support *support);
/* The top-k distillation calls' teacher. */
void hu_topk_teacher(const hu_grpo_problem *p, fh_topk_teacher *teacher);
/* A memory budget under which the distillation calls (teacher given) or the top-k distillation calls (teacher NULL)
 * run on a context with `threads` and default tiles, and their train step streams: half of what its row blocks'
 * logits take (min(n, 256) rows of both heads' logits across the vocabulary; top-k: the student's), or the smallest
 * budget the calls accept when that is more (tiny shapes, where the row blocks may then fit too). 0 when no budget
 * up to 2^30 suffices. */
int64_t hu_distill_streaming_budget(const fh_linear *student, const fh_linear *teacher, int threads);

/* Saved forward state that the backward calls read (lse, logp, entropy, the kept logits; the support backward takes
 * any lse, as its result is a function of its inputs whatever they are): from a successful forward
 * (its logits output, [n, vocab], as written or as allocated). */
typedef struct hu_saved {
    float *lse, *logp, *entropy, *logits;
} hu_saved;
void hu_saved_from(hu_saved *s, const hu_outputs *forward, int64_t n);
void hu_saved_free(hu_saved *s);

/* One call of `call` on ctx, writing into o (beta 0 gradients). Cross-entropy and log-prob calls use p_ce, the others
 * p_grpo; backward calls read `saved` (the log-prob backward its lse, as a CE forward with the same softcap writes it,
 * and no entropy gradient). */
fh_status hu_run(fh_context *ctx, hu_call call, const cp_problem *p_ce, const hu_grpo_problem *p_grpo,
                 const hu_saved *saved, hu_outputs *o);

/* Runs `body(arg)` in a forked child, so that a crash fails only the assertion that called it. Returns
 * the child's exit status (0..255), or 1000 + the signal number that killed it. */
int hu_run_isolated(int (*body)(void *), void *arg);

#endif
