/* The GRPO suites' harness (tests/test_grpo_*.c): problems with caller-chosen inputs (masks, advantages, old and
 * reference log-probs, clip bounds), the fused GRPO head run on them (fh_grpo_forward / fh_grpo_backward /
 * fh_grpo_forward_backward), the double-precision TRL-semantics reference (ref/ref_grpo.h) on the same inputs,
 * and the comparison with every tolerance below.
 *
 * Tolerances (every comparison in the GRPO suites uses these, or says why it is exact):
 *   loss            GRPO_LOSS_TOL * max(1, |loss|)   (tests/cases/grpo_case.c: every term is advantage x ratio-like
 *                   factor x normaliser; the fp32 logits put ~1e-6 on each log-prob)
 *   metrics         GRPO_METRIC_TOL absolute, NaN only against NaN. The clip counts are exact as long as no ratio
 *                   sits within the fused-vs-reference log-prob difference of a bound: old log-probs are drawn here
 *                   at least GP_BOUND_GUARD = 1e-3 (in log-ratio) away from every bound, while the log-probs may
 *                   differ by at most GP_TOKEN_TOL (1 + |logp|) < 2e-4 (asserted; ~1e-6 (1 + |logp|) in practice);
 *                   or the ratio sits exactly on the bound in both (grpo_clip).
 *   gradients       GRPO_GRAD_NORM_REL_TOL normwise relative (same engine and fp32 GEMMs as cross-entropy).
 *   vespo's phi and the on-policy sequence importance-sampling ratio: each of the above plus twice the derived
 *                   grpo_slack (grpo_case.h): detached factors exponential in a row's sum of log-probs.
 *   per-token       GP_TOKEN_TOL * (1 + |ref|) on per_token_logp, entropy, lse and per_token_loss (see below). */
#ifndef FH_GRPO_HARNESS_H
#define FH_GRPO_HARNESS_H

#include "fusedhead.h"
#include "grpo_case.h"
#include "test_util.h"

#include <stddef.h>
#include <stdint.h>

/* Per-token values are stored as fp32: the final rounding alone is 2^-24 |v| ~ 6e-8 (1 + |v|). Before it, the
 * logits carry the fp32 GEMM error (H <= 37 products of |x| <= 1 with weights scaled to logits of ~3, divided by
 * temperature >= 0.7): well under 1e-6, and logp = z_y - lse, H = lse - sum p z and lse are 1-Lipschitz in the
 * max-norm of the logits up to a factor 2. per_token_loss multiplies the log-prob error by r |A| (r < 3 here) or
 * by exp(ref - logp) (< 2) times beta. 1e-5 leaves an order of magnitude over all of that (the largest error seen
 * over these suites is ~1e-6). */
#define GP_TOKEN_TOL 1e-5
/* Minimum |log r - log bound| of drawn ratios (see above). */
#define GP_BOUND_GUARD 1e-3

typedef struct gp_problem {
    int64_t batch, seq, hidden, vocab;
    fh_layout layout;
    float *x, *weight, *bias; /* bias NULL when off */
    int64_t *ids;
    float *mask, *adv;
    float *old;  /* NULL: on-policy */
    float *ref;  /* always filled; passed to the library only when beta != 0 */
    float *samp; /* the sampler's log-probs (sampling_per_token_logps), or NULL */
    uint64_t rng;
} gp_problem;

typedef struct gp_config {
    int threads;
    int64_t tile_rows, tile_vocab; /* 0: library default */
    int train_step;                /* 1: fh_grpo_forward_backward; 0: fh_grpo_forward + fh_grpo_backward */
    float grad_output;             /* 0 means 1 */
    float grad_beta;               /* 0: gradients overwrite NaN-filled buffers; 1: accumulate onto 1.0 */
} gp_config;

typedef struct gp_fused {
    double loss;
    fh_grpo_metrics metrics;
    float *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias;
} gp_fused;

typedef struct gp_reference {
    double loss;
    fh_grpo_metrics metrics;
    double *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias; /* dweight in the problem's layout */
    grpo_ref_detail detail; /* for grpo_slack_of */
} gp_reference;

typedef struct gp_diff {
    double loss, loss_tol;
    double metrics; /* the largest metric difference beyond its slack (grpo_case.h: grpo_slack) */
    double grad_tol; /* GRPO_GRAD_NORM_REL_TOL plus twice the grad_rel slack */
    double logp, entropy, lse, per_token_loss;
    double dx, dweight, dbias;
    int64_t masked_rows_touched; /* dx rows of mask-0 tokens that are not exactly the prefill (0 or 1) */
} gp_diff;

int64_t gp_n(const gp_problem *p);

/* Random head (logits of typical size 3, ce_fill_linear), random ids, masks with a random-length tail of padding
 * per row and the last row empty when B > 1, padding ids out of range (-100) on every other padded position,
 * advantages cycling +, -, 0 over the rows (magnitudes in [0.25, 1.25)), on-policy, ref log-probs unset. */
void gp_init(gp_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, fh_layout layout, int bias,
             uint64_t seed);

/* After a test rewrites the mask: every unmasked token gets an id in [0, V) (padding keeps its ids). */
void gp_fix_ids(gp_problem *p);

void gp_free(gp_problem *p);

int gp_isnan(double v);

/* Old log-probs = reference logp + row offset U(-0.6, 0.6) + token noise U(-0.4, 0.4): ratios in ~[0.37, 2.7] at
 * the token level and spread at the sequence level too. Redrawn until no unmasked token ratio and no sequence
 * ratio (all rows, empty ones included) is within GP_BOUND_GUARD of a bound of `o`. */
void gp_set_old(gp_problem *p, const fh_grpo_options *o);

/* Reference log-probs = reference logp +- U(0.3, 0.7), random sign: kl terms on both sides. |ref - logp| >= 0.3
 * keeps the KL gradient coefficient beta (1 - exp(ref - logp)) well conditioned: it is ~ -(ref - logp), so a
 * log-prob error e (the fp32 logits give e ~ 5e-7) moves it by e / |ref - logp| relative; ref - logp of ~0.01 (as
 * U(-0.4, 0.4) draws sometimes give) would make that 5e-5 on the token, and a KL-dominated gradient (ratios
 * clipped) would then drift towards GRPO_GRAD_NORM_REL_TOL through conditioning, not through a fault (worst seen
 * over grpo_shapes with U(-0.4, 0.4): 4.7e-6 normwise; with this draw: < 3e-6). */
void gp_set_ref(gp_problem *p, double temperature);

/* The sampler's log-probs: the old ones (the reference's current ones on-policy: call after gp_set_old) plus
 * U(-spread, spread). Importance-sampling ratios e^+-spread per token; in the sequence modes the row sums of
 * those gaps. */
void gp_set_sampling(gp_problem *p, double temperature, double spread);

fh_grpo_batch gp_batch(const gp_problem *p, const fh_grpo_options *o);

void gp_linear(const gp_problem *p, fh_linear *lin);

/* Two threads, on the library's default tiles (one tile per pass for these small problems). The engine's
 * threading is covered at length by the cross-entropy suites and the GRPO head is serial, so the GRPO suites use
 * two threads sparingly, and with as few parallel regions as possible: on an oversubscribed 2-core machine every
 * OpenMP barrier can wait a scheduler slice for a descheduled thread (seen: seconds per call with 1 x 1 tiles). */
void gp_two_threads(gp_config *c);

fh_context *gp_context(const gp_config *c);

void gp_fused_alloc(const gp_problem *p, float grad_beta, gp_fused *f);

void gp_fused_free(gp_fused *f);

/* Forward + backward (or the train step) on ctx. The backward gets what the forward saved (entropy only when
 * entropy_coef != 0: "else it may be NULL"). */
fh_status gp_run_fused_on(fh_context *ctx, const gp_problem *p, const fh_grpo_options *o, const gp_config *c,
                          gp_fused *f);

fh_status gp_run_fused(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, gp_fused *f);

/* Whether fh_grpo_backward needs the saved entropy (the entropy bonus or the top-entropy mask). */
int gp_needs_entropy(const fh_grpo_options *o);

/* ref_grpo_forward / ref_grpo_backward, plus the lse of the tempered logits. */
void gp_run_reference(const gp_problem *p, const fh_grpo_options *o, double grad_output, double grad_beta,
                      gp_reference *r);

void gp_reference_free(gp_reference *r);

/* The reference gradient of grad * loss given the per-token log-probs the head sees (as fh_grpo_backward takes
 * them): ref_grpo_head's coefficients from these logp, then ref_grpo_row_grad on the double logits. dx, dweight
 * (layout), dbias each [.] caller-allocated, dbias may be NULL. */
void gp_reference_backward_from_logp(const gp_problem *p, const fh_grpo_options *o, const float *logp_f,
                                     const float *entropy_f, double grad, double *dx, double *dweight,
                                     double *dbias);

double gp_metrics_diff(const fh_grpo_metrics *a, const fh_grpo_metrics *b);
/* The same, each metric less its slack (grpo_case.h: grpo_metric_slack). */
double gp_metrics_diff_slack(const fh_grpo_metrics *a, const fh_grpo_metrics *b, const grpo_slack *slack);

/* The slack of a fused run against the reference on problem p (grpo_case.h). */
grpo_slack gp_slack(const gp_problem *p, const fh_grpo_options *o, const gp_fused *f, const gp_reference *r);

const char *gp_loss_name(fh_grpo_loss_type t);

void gp_describe(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, char *buf, size_t size);

void gp_track(const gp_diff *d);

void gp_print_worst(const char *suite);

/* Fused vs reference with every tolerance of the header comment; asserts, and returns 1 on pass. */
int gp_check(const gp_problem *p, const fh_grpo_options *o, const gp_config *c, const char *label);

void gp_options(fh_grpo_options *o, fh_grpo_loss_type type, fh_grpo_is_level level);

/* TRL's clipped family, which logs the clip metrics: grpo, bnpo, dr_grpo, dapo, luspo. */
int gp_clipped(fh_grpo_loss_type t);

/* A deterministic pseudo-random choice for case k (one time in `one_in`), so that the options spread over a
 * matrix by its counter do not line up with the matrix's own loops (as k & 1 would with the innermost one). */
int gp_pick(int k, unsigned salt, unsigned one_in);

/* Every loss type and importance-sampling level, for the suites' option matrices. */
#define GP_LOSS_TYPES 8
#define GP_IS_LEVELS 2
extern const fh_grpo_loss_type gp_all_losses[GP_LOSS_TYPES];
extern const fh_grpo_is_level gp_all_levels[GP_IS_LEVELS];

#endif
