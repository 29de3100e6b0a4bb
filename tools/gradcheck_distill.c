/* fh_gradcheck --loss distill: the fused distillation head (fh_distill_forward, fh_distill_forward_backward) against
 * the double-precision reference ref_distill_linear (ref/ref_distill.h; TRL GKD / Liger semantics) on the same random
 * inputs: both heads' x in U(-1, 1) and weights scaled so that their logits have standard deviation --logit-scale
 * (default 2; tests/cases/ce_case.c's ce_fill_linear), the teacher independent of the student; a fraction --ignore-frac of the
 * targets ignore_index (or no targets at all with --no-targets); grad_output --grad-output for mean and sum, U(-1.5,
 * 1.5) per token for none.
 *
 * The single-call step runs in row blocks unless the memory budget cannot hold one (--budget, with --tile-rows and
 * --tile-vocab for the streaming tiles): a row block holds both heads' V-wide fp32 logits rows (8 V bytes per row),
 * and with bf16 inputs every row's bf16 dU (2 n V bytes), so a budget below that streams ("streaming": true in the
 * output; with --fp32-du the step always streams).
 *
 * Tolerances (tests/test_distill.c derives them and gives the measured worst cases):
 *   loss, soft_loss, hard_loss: |fused - reference| <= 1e-5 max(1, |reference|): the head's fp32 exps and
 *     log-probabilities carry an absolute error of ~1e-6 whatever D's size; per_token_loss: 1e-5 (1 + |r|);
 *   dx, dweight, dbias: normwise relative 1e-5 (CE_GRAD_NORM_REL_TOL); with bf16 inputs (unless --fp32-du) dx and
 *     dweight take CE_BF16_GRAD_NORM_REL_TOL = 2^-8 ~ 4e-3 (dU rounded once to bf16), and bf16 gradients add 2^-8
 *     for their own rounding (ce_grad_tolerance, tests/cases/ce_case.c).
 * jsd between nearly disjoint distributions (D close to its maximum, e.g. --logit-scale 3 --temperature 0.5) forms a
 * gradient that is a small difference of fp32 terms: its relative error then exceeds 1e-5 (tests/test_distill.c,
 * "jsd near its maximum"). */
#include "enum_options.h"
#include "gradcheck_common.h"
#include "gradcheck_distill.h"
#include "npy.h"

#include "bf16.h"
#include "ce_case.h"
#include "ref_distill.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DISTILL_LOSS_TOL 1e-5
#define DISTILL_TOKEN_TOL 1e-5
#define DISTILL_GRAD_TOL CE_GRAD_NORM_REL_TOL

static const char *const divergences[] = {"forward_kl", "reverse_kl", "jsd"}; /* fh_divergence order */
static const char *const reductions[] = {"mean", "sum", "none"};                /* fh_reduction order */

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss distill --divergence forward_kl|reverse_kl|jsd [--beta B] [--temperature T]\n"
            "       [--weight-soft-loss W] [--weight-hard-loss W] [--n N] [--hidden H] [--teacher-hidden Ht]\n"
            "       [--vocab V] [--layout hv|vh] [--teacher-layout hv|vh] [--bias] [--teacher-bias]\n"
            "       [--ignore-frac F] [--no-targets] [--reduction mean|sum|none] [--grad-output g] [--threads T]\n"
            "       [--seed S] [--tile-rows R] [--tile-vocab C] [--budget BYTES] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-du] [--logit-scale S] [--top-k K] [--no-tail] [--dump DIR]\n"
            "  defaults: jsd, beta 0.5, temperature 1, weights 1 and 0, n 64, H 67, Ht = H, V 5003, hv, mean;\n"
            "  --top-k K: the divergence over each token's top-k support (TRL's iw_opd), the tail unless --no-tail;\n"
            "  --dtype bf16 makes both heads bf16\n");
}

typedef struct distill_spec {
    int64_t n, hidden, teacher_hidden, vocab;
    fh_layout layout, teacher_layout;
    int bias, teacher_bias, no_targets;
    double ignore_frac, logit_scale;
    fh_distill_options options;
    float grad_output;
    int threads, fp32_du;
    int64_t tile_rows, tile_vocab, budget;
    uint64_t seed;
    fh_dtype dtype, grad_dtype;
} distill_spec;

/* Distillation's own options (gradcheck_own_option). */
static int distill_option(void *spec, const char *a, const char *v)
{
    distill_spec *s = spec;
    int k;
    if (strcmp(a, "--teacher-bias") == 0) {
        s->teacher_bias = 1;
        return 1;
    }
    if (strcmp(a, "--no-targets") == 0) {
        s->no_targets = 1;
        return 1;
    }
    if (strcmp(a, "--no-tail") == 0) {
        s->options.add_tail = 0;
        return 1;
    }
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0)
        return strcmp(v, "distill") ? -1 : 2;
    if (strcmp(a, "--divergence") == 0) {
        if ((k = option_index(v, divergences, 3)) < 0)
            return -1;
        s->options.divergence = (fh_divergence)k;
    } else if (strcmp(a, "--teacher-layout") == 0) {
        if (parse_layout(v, &s->teacher_layout) != 0)
            return -1;
    } else if (strcmp(a, "--beta") == 0)
        s->options.beta = atof(v);
    else if (strcmp(a, "--temperature") == 0)
        s->options.temperature = atof(v);
    else if (strcmp(a, "--weight-soft-loss") == 0)
        s->options.weight_soft_loss = atof(v);
    else if (strcmp(a, "--weight-hard-loss") == 0)
        s->options.weight_hard_loss = atof(v);
    else if (strcmp(a, "--teacher-hidden") == 0)
        s->teacher_hidden = atoll(v);
    else if (strcmp(a, "--top-k") == 0)
        s->options.top_k = atoll(v);
    else
        return 0;
    return 2;
}

static int parse_spec(distill_spec *s, int argc, char **argv, const char **dump)
{
    memset(s, 0, sizeof *s);
    s->n = 64;
    s->hidden = 67;
    s->teacher_hidden = 0; /* = hidden */
    s->vocab = 5003;
    s->ignore_frac = 0.1;
    s->logit_scale = 2.0;
    s->grad_output = 1.0f;
    s->seed = 1;
    fh_distill_options_init(&s->options);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump),
                                      .n = &s->n,
                                      .ignore_frac = &s->ignore_frac,
                                      .reduction = &s->options.reduction,
                                      .grad_output = &s->grad_output,
                                      .budget = &s->budget,
                                      .logit_scale = &s->logit_scale};
    if (gradcheck_parse(argc, argv, &shared, distill_option, s) != 0)
        return -1;
    if (s->teacher_hidden == 0)
        s->teacher_hidden = s->hidden;
    return s->n > 0 && s->hidden > 0 && s->teacher_hidden > 0 && s->vocab > 0 && s->logit_scale > 0.0 ? 0 : -1;
}

/* One head's inputs: fp32 values (bf16-valued for bf16), the bf16 bits the library reads then, the reference's
 * doubles with the canonical [H, V] weight. */
typedef struct head {
    float *x, *weight, *bias;
    uint16_t *x_bf16, *weight_bf16;
    double *rx, *rw, *rb;
    fh_linear lin;
    ref_linear ref;
} head;

static void head_make(head *h, uint64_t *rng, const distill_spec *s, int64_t hidden, fh_layout layout, int bias)
{
    const size_t nh = (size_t)(s->n * hidden), hv = (size_t)(hidden * s->vocab);
    memset(h, 0, sizeof *h);
    h->x = gradcheck_calloc(nh, sizeof(float));
    h->weight = gradcheck_calloc(hv, sizeof(float));
    h->bias = bias ? gradcheck_calloc((size_t)s->vocab, sizeof(float)) : NULL;
    ce_fill_linear(rng, s->n, hidden, s->vocab, s->logit_scale, h->x, h->weight, h->bias);
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    if (bf16) {
        h->x_bf16 = bf16_round_in_place(h->x, nh);
        h->weight_bf16 = bf16_round_in_place(h->weight, hv);
        if (!h->x_bf16 || !h->weight_bf16) {
            fprintf(stderr, "fh_gradcheck: out of memory\n");
            exit(2);
        }
    }
    fh_linear_init(&h->lin, s->n, hidden, s->vocab, bf16 ? (const void *)h->x_bf16 : h->x,
                   bf16 ? (const void *)h->weight_bf16 : h->weight, layout, h->bias);
    h->lin.x_dtype = h->lin.weight_dtype = s->dtype;
    h->rx = gradcheck_doubles(h->x, nh);
    h->rw = ce_weight_to_reference(layout, hidden, s->vocab, h->weight);
    h->rb = gradcheck_doubles(h->bias, (size_t)s->vocab);
    const ref_linear r = {s->n, hidden, s->vocab, h->rx, h->rw, h->rb};
    h->ref = r;
}

static void head_free(head *h)
{
    void *p[] = {h->x, h->weight, h->bias, h->x_bf16, h->weight_bf16, h->rx, h->rw, h->rb};
    for (size_t k = 0; k < sizeof p / sizeof p[0]; k++)
        free(p[k]);
}

typedef struct fused_outputs {
    double loss, soft, hard;
    float *per_token;
} fused_outputs;

/* max over the array of |f - r| / (1 + |r|); NaN anywhere: infinite. */
static double token_diff(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)f[i] - r[i]) / (1.0 + fabs(r[i]));
        m = isnan(e) ? INFINITY : fmax(m, e);
    }
    return m;
}

static double loss_diff(double f, double r)
{
    const double e = fabs(f - r) / fmax(1.0, fabs(r));
    return isnan(e) ? INFINITY : e;
}

static double outputs_diff(const fused_outputs *f, const ref_distill_result *r)
{
    return fmax(loss_diff(f->loss, r->loss), fmax(loss_diff(f->soft, r->soft_loss), loss_diff(f->hard, r->hard_loss)));
}

static double norm_rel(const float *f, const double *r, size_t count)
{
    const double e = ce_compare(f, r, count).norm_rel;
    return isnan(e) ? INFINITY : e;
}

/* The reference's results on the case's inputs (dweight in the student's layout). */
typedef struct reference {
    ref_distill_result r;
    double *per_token, *dx, *dweight, *dbias;
} reference;

/* The fused step's gradients (fp32 values of bf16 ones). */
typedef struct gradients {
    float *dx, *dweight, *dbias;
} gradients;

/* The distillation case, as gradcheck_main runs it. */
typedef struct distill_check {
    distill_spec spec;
    head student, teacher;
    int64_t *targets;
    float *grad_output;
    fused_outputs fwd, step; /* fh_distill_forward's, fh_distill_forward_backward's */
    gradients gr;
    size_t workspace;
    reference ref;
    double *dw, *g; /* the reference's dweight ([H, V]) and grad_output */
} distill_check;

static int parse(void *check, int argc, char **argv, const char **dump)
{
    return parse_spec(&((distill_check *)check)->spec, argc, argv, dump);
}

/* Both calls' outputs as .npy files in dir (gradients flat, dweight in the weight's layout). */
static int dump_case(const void *check, const char *dir)
{
    const distill_check *k = check;
    const distill_spec *s = &k->spec;
    const int64_t n[1] = {s->n}, dx[1] = {s->n * s->hidden}, dw[1] = {s->hidden * s->vocab}, v[1] = {s->vocab};
    const fused_outputs *calls[2] = {&k->fwd, &k->step};
    const char *const names[2][4] = {{"forward_loss", "forward_soft_loss", "forward_hard_loss", "forward_per_token"},
                                     {"loss", "soft_loss", "hard_loss", "per_token"}};
    int bad = 0;
    for (int j = 0; j < 2; j++) {
        bad |= npy_write(dir, names[j][0], "<f8", &calls[j]->loss, 0, NULL);
        bad |= npy_write(dir, names[j][1], "<f8", &calls[j]->soft, 0, NULL);
        bad |= npy_write(dir, names[j][2], "<f8", &calls[j]->hard, 0, NULL);
        bad |= npy_write(dir, names[j][3], "<f4", calls[j]->per_token, 1, n);
    }
    bad |= npy_write(dir, "dhidden", "<f4", k->gr.dx, 1, dx);
    bad |= npy_write(dir, "dweight", "<f4", k->gr.dweight, 1, dw);
    if (k->gr.dbias)
        bad |= npy_write(dir, "dbias", "<f4", k->gr.dbias, 1, v);
    return bad;
}

/* Prints the JSON; returns 1 within every tolerance. */
static int report(const void *check)
{
    const distill_check *k = check;
    const distill_spec *s = &k->spec;
    const fused_outputs *fwd = &k->fwd, *step = &k->step;
    const gradients *gr = &k->gr;
    const reference *ref = &k->ref;
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    const ref_distill_result *r = &ref->r;
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    const double grad_tol = ce_grad_tolerance(DISTILL_GRAD_TOL, bf16 && !s->fp32_du, s->grad_dtype);
    const double dbias_tol = ce_grad_tolerance(DISTILL_GRAD_TOL, 0, s->grad_dtype);
    const double e_fwd = outputs_diff(fwd, r), e_step = outputs_diff(step, r);
    const double e_tok =
        fmax(token_diff(fwd->per_token, ref->per_token, n), token_diff(step->per_token, ref->per_token, n));
    const double e_dx = norm_rel(gr->dx, ref->dx, n * h), e_dw = norm_rel(gr->dweight, ref->dweight, h * v);
    const double e_db = gr->dbias ? norm_rel(gr->dbias, ref->dbias, v) : 0.0;
    /* A row block holds both heads' V-wide fp32 rows, and with bf16 inputs every row's bf16 dU, beside the top-k
     * selections (n rows of k 16-byte entries per kept head): a budget below that cannot hold one, so the step streams
     * (as it always does with fp32 dU). */
    const fh_distill_options *o = &s->options;
    const int both = o->divergence == FH_DIVERGENCE_JSD && o->beta > 0.0 && o->beta < 1.0;
    const double selections =
        o->top_k > 0 && o->top_k < (int64_t)v ? (both ? 2.0 : 1.0) * 16.0 * (double)n * (double)o->top_k : 0.0;
    const double row_block_floor = 8.0 * (double)v + (bf16 ? 2.0 * (double)n * (double)v : 0.0) + selections;
    const int streaming = (bf16 && s->fp32_du) || (s->budget > 0 && (double)s->budget < row_block_floor);
    const int pass = e_fwd <= DISTILL_LOSS_TOL && e_step <= DISTILL_LOSS_TOL && e_tok <= DISTILL_TOKEN_TOL &&
                     e_dx <= grad_tol && e_dw <= grad_tol && e_db <= dbias_tol;
    printf("{\n  \"divergence\": \"%s\",\n  \"beta\": %g,\n  \"top_k\": %lld,\n  \"add_tail\": %d,\n"
           "  \"temperature\": %g,\n  \"weight_soft_loss\": %g,\n"
           "  \"weight_hard_loss\": %g,\n  \"reduction\": \"%s\",\n  \"dtype\": \"%s\",\n  \"grad_dtype\": \"%s\",\n"
           "  \"workspace_bytes\": %zu,\n  \"streaming\": %s,\n",
           divergences[o->divergence], o->beta, (long long)o->top_k, o->add_tail, o->temperature,
           o->weight_soft_loss, o->weight_hard_loss,
           reductions[o->reduction], bf16 ? "bf16" : "f32", s->grad_dtype == FH_DTYPE_BF16 ? "bf16" : "f32",
           k->workspace,
           streaming ? "true" : "false");
    printf("  \"loss\": %.17g,\n  \"forward_loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"soft_loss\": %.17g,\n"
           "  \"ref_soft_loss\": %.17g,\n  \"hard_loss\": %.17g,\n  \"ref_hard_loss\": %.17g,\n"
           "  \"loss_rel\": %.3e,\n  \"forward_loss_rel\": %.3e,\n  \"per_token_loss_max_rel\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n"
           "  \"tolerance\": {\"loss_rel\": %g, \"per_token_rel\": %g, \"grad_norm_rel\": %g, "
           "\"dbias_norm_rel\": %g},\n"
           "  \"pass\": %s\n}\n",
           step->loss, fwd->loss, r->loss, step->soft, r->soft_loss, step->hard, r->hard_loss, e_step, e_fwd, e_tok,
           e_dx, e_dw, e_db, DISTILL_LOSS_TOL, DISTILL_TOKEN_TOL, grad_tol, dbias_tol, pass ? "true" : "false");
    return pass;
}

/* Draws the inputs, runs both fused calls and the reference: 0, or 2 having said why. */
static int run(void *check)
{
    distill_check *k = check;
    const distill_spec *s = &k->spec;
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    uint64_t rng = s->seed * 104729 + 3;
    head_make(&k->student, &rng, s, s->hidden, s->layout, s->bias);
    head_make(&k->teacher, &rng, s, s->teacher_hidden, s->teacher_layout, s->teacher_bias);
    k->targets = gradcheck_calloc(n, sizeof(int64_t));
    for (size_t i = 0; i < n; i++) {
        k->targets[i] = (int64_t)(ref_uniform(&rng) * (double)s->vocab);
        if (ref_uniform(&rng) < s->ignore_frac)
            k->targets[i] = s->options.ignore_index;
    }
    const int64_t *call_targets = s->no_targets ? NULL : k->targets;
    k->grad_output = gradcheck_calloc(n, sizeof(float));
    for (size_t i = 0; i < n; i++)
        k->grad_output[i] =
            s->options.reduction == FH_REDUCTION_NONE ? (float)(3.0 * ref_uniform(&rng) - 1.5) : s->grad_output;

    /* The fused calls: fh_distill_forward, then fh_distill_forward_backward into NaN-filled gradients (beta 0 must
     * overwrite them). */
    fh_context *ctx;
    fh_status st = gradcheck_context(&ctx, s->threads, s->tile_rows, s->tile_vocab, s->budget, s->fp32_du);
    k->fwd.per_token = gradcheck_calloc(n, sizeof(float));
    k->step.per_token = gradcheck_calloc(n, sizeof(float));
    gradients *gr = &k->gr;
    ce_alloc_grads(n, h, v, s->bias, 0.0f, &gr->dx, &gr->dweight, &gr->dbias);
    if (st == FH_OK) {
        fh_distill_outputs out = {&k->fwd.loss, &k->fwd.soft, &k->fwd.hard, k->fwd.per_token};
        st = fh_distill_forward(ctx, &k->student.lin, &k->teacher.lin, call_targets, &s->options, &out);
    }
    if (st == FH_OK) {
        ce_grads_io io;
        ce_grads_io_begin(&io, s->grad_dtype, n, h, v, 0.0f, gr->dx, gr->dweight, gr->dbias);
        fh_distill_outputs out = {&k->step.loss, &k->step.soft, &k->step.hard, k->step.per_token};
        st = fh_distill_forward_backward(ctx, &k->student.lin, &k->teacher.lin, call_targets, &s->options,
                                         k->grad_output, &out, &io.grads);
        ce_grads_io_finish(&io);
    }
    if (st == FH_OK)
        st = fh_distill_workspace_size(ctx, &k->student.lin, &k->teacher.lin, &s->options, &k->workspace);
    if (st != FH_OK) {
        const char *message = "";
        if (ctx)
            fh_context_message(ctx, &message);
        gradcheck_library_failed(st, message);
    }
    fh_context_destroy(ctx);

    /* The reference, in the student's layout for the comparison. */
    const ref_distill_options ro = {(ref_divergence)s->options.divergence, s->options.beta, s->options.temperature,
                                    s->options.weight_soft_loss, s->options.weight_hard_loss, s->options.ignore_index,
                                    (int)s->options.reduction, s->options.top_k, s->options.add_tail};
    reference *ref = &k->ref;
    ref->per_token = gradcheck_calloc(n, sizeof(double));
    ref->dx = gradcheck_calloc(n * h, sizeof(double));
    ref->dweight = gradcheck_calloc(h * v, sizeof(double));
    ref->dbias = s->bias ? gradcheck_calloc(v, sizeof(double)) : NULL;
    ref->r.per_token_loss = ref->per_token;
    k->dw = gradcheck_calloc(h * v, sizeof(double));
    k->g = gradcheck_doubles(k->grad_output, n);
    if (st != FH_OK)
        return 2;
    if (ref_distill_linear(&k->student.ref, &k->teacher.ref, call_targets, &ro, k->g, &ref->r, ref->dx, k->dw,
                           ref->dbias) != 0) {
        fprintf(stderr, "fh_gradcheck: the reference failed where the library succeeded\n");
        return 2;
    }
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, k->dw, ref->dweight);
    return 0;
}

static void free_check(void *check)
{
    distill_check *k = check;
    head_free(&k->student);
    head_free(&k->teacher);
    void *p[] = {k->targets, k->grad_output, k->fwd.per_token, k->step.per_token, k->gr.dx, k->gr.dweight,
                 k->gr.dbias, k->ref.per_token, k->ref.dx, k->ref.dweight, k->ref.dbias, k->dw, k->g};
    for (size_t j = 0; j < sizeof p / sizeof p[0]; j++)
        free(p[j]);
}

int gradcheck_distill(int argc, char **argv)
{
    static const gradcheck_loss distill = {usage, parse, run, report, dump_case, free_check};
    distill_check check = {0};
    return gradcheck_main(&distill, &check, argc, argv);
}
