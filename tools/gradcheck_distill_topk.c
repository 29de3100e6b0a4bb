/* fh_gradcheck --loss distill_topk: the fused top-k distillation head (fh_distill_topk_forward,
 * fh_distill_topk_forward_backward) against the double-precision reference ref_distill_topk_linear
 * (ref/ref_distill_topk.h; TRL's server distillation) on the same random inputs: the student's x in U(-1, 1) and its
 * weight scaled so that its logits have standard deviation --logit-scale (default 2; ce_fill_linear); the teacher's
 * k entries per token (--k, default 20) the largest of a random log-softmax over V (logits of standard deviation
 * --logit-scale, independent of the student), in order; ragged: a fraction up to --pad-frac of each row's last
 * entries padded (log-prob -inf, id 0), every entry of every fifth token from the fourth; --no-tail drops the tail
 * bucket; a fraction --ignore-frac of the targets ignore_index (or no targets with --no-targets); grad_output
 * --grad-output for mean and sum, U(-1.5, 1.5) per token for none.
 *
 * The single-call step runs in row blocks unless the memory budget cannot hold one (--budget, with --tile-rows and
 * --tile-vocab for the streaming tiles): a row block holds the student's V-wide fp32 logits rows (4 V bytes per row;
 * blocks of at least min(n, 256) rows), and with bf16 inputs every row's bf16 dU (2 n V bytes).
 *
 * Tolerances, those of fh_gradcheck --loss distill (tools/gradcheck_distill.c, derived in tests/test_distill.c):
 *   loss, soft_loss, hard_loss: |fused - reference| <= 1e-5 max(1, |reference|): fp32 logits and exps carry an
 *     absolute error of ~1e-6 in the log-sum-exps whatever D's size; per_token_loss: 1e-5 (1 + |r|);
 *   dx, dweight, dbias: normwise relative 1e-5 (CE_GRAD_NORM_REL_TOL); bf16 inputs: dx and dweight 2^-8 (dU rounded
 *     once to bf16), bf16 gradients 2^-8 more (ce_grad_tolerance). */
#include "enum_options.h"
#include "gradcheck_common.h"
#include "gradcheck_distill_topk.h"
#include "npy.h"

#include "bf16.h"
#include "ce_case.h"
#include "ref_distill_topk.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOPK_LOSS_TOL 1e-5
#define TOPK_TOKEN_TOL 1e-5
#define TOPK_GRAD_TOL CE_GRAD_NORM_REL_TOL

static const char *const reductions[] = {"mean", "sum", "none"}; /* fh_reduction order */

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss distill_topk [--k K] [--no-tail] [--pad-frac F] [--temperature T]\n"
            "       [--weight-soft-loss W] [--weight-hard-loss W] [--n N] [--hidden H] [--vocab V] [--layout hv|vh]\n"
            "       [--bias] [--ignore-frac F] [--no-targets] [--reduction mean|sum|none] [--grad-output g]\n"
            "       [--threads T] [--seed S] [--tile-rows R] [--tile-vocab C] [--budget BYTES] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-du] [--logit-scale S] [--dump DIR]\n"
            "  defaults: k 20, the tail, pad-frac 0.3, temperature 1, weights 1 and 0, n 64, H 67, V 5003, hv, mean\n");
}

typedef struct topk_spec {
    int64_t n, hidden, vocab, k;
    fh_layout layout;
    int bias, no_targets, no_tail;
    double ignore_frac, logit_scale, pad_frac;
    fh_distill_topk_options options;
    float grad_output;
    int threads, fp32_du;
    int64_t tile_rows, tile_vocab, budget;
    uint64_t seed;
    fh_dtype dtype, grad_dtype;
} topk_spec;

static int topk_option(void *spec, const char *a, const char *v)
{
    topk_spec *s = spec;
    if (strcmp(a, "--no-targets") == 0) {
        s->no_targets = 1;
        return 1;
    }
    if (strcmp(a, "--no-tail") == 0) {
        s->no_tail = 1;
        return 1;
    }
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0)
        return strcmp(v, "distill_topk") ? -1 : 2;
    if (strcmp(a, "--k") == 0)
        s->k = atoll(v);
    else if (strcmp(a, "--pad-frac") == 0)
        s->pad_frac = atof(v);
    else if (strcmp(a, "--temperature") == 0)
        s->options.temperature = atof(v);
    else if (strcmp(a, "--weight-soft-loss") == 0)
        s->options.weight_soft_loss = atof(v);
    else if (strcmp(a, "--weight-hard-loss") == 0)
        s->options.weight_hard_loss = atof(v);
    else
        return 0;
    return 2;
}

typedef struct topk_check {
    topk_spec spec;
    float *x, *weight, *bias;
    uint16_t *x_bf16, *weight_bf16;
    double *rx, *rw, *rb;
    fh_linear lin;
    int64_t *ids, *targets;
    float *logprobs, *grad_output;
    double *ref_logprobs;
    double loss[2], soft[2], hard[2]; /* forward's, the step's */
    float *per_token[2];
    float *dx, *dweight, *dbias;
    size_t workspace;
    ref_distill_result r;
    double *ref_per_token, *ref_dx, *ref_dw_hv, *ref_dweight, *ref_dbias, *g;
} topk_check;

static int parse(void *check, int argc, char **argv, const char **dump)
{
    topk_spec *s = &((topk_check *)check)->spec;
    memset(s, 0, sizeof *s);
    s->n = 64;
    s->hidden = 67;
    s->vocab = 5003;
    s->k = 20;
    s->pad_frac = 0.3;
    s->ignore_frac = 0.1;
    s->logit_scale = 2.0;
    s->grad_output = 1.0f;
    s->seed = 1;
    fh_distill_topk_options_init(&s->options);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump),
                                      .n = &s->n,
                                      .ignore_frac = &s->ignore_frac,
                                      .reduction = &s->options.reduction,
                                      .grad_output = &s->grad_output,
                                      .budget = &s->budget,
                                      .logit_scale = &s->logit_scale};
    if (gradcheck_parse(argc, argv, &shared, topk_option, s) != 0)
        return -1;
    s->options.add_tail = !s->no_tail;
    return s->n > 0 && s->hidden > 0 && s->vocab > 0 && s->k >= 1 && s->k <= s->vocab && s->logit_scale > 0.0 ? 0
                                                                                                              : -1;
}

static int dump_case(const void *check, const char *dir)
{
    const topk_check *c = check;
    const topk_spec *s = &c->spec;
    const int64_t n[1] = {s->n}, dx[1] = {s->n * s->hidden}, dw[1] = {s->hidden * s->vocab};
    int bad = npy_write(dir, "loss", "<f8", &c->loss[1], 0, NULL);
    bad |= npy_write(dir, "per_token", "<f4", c->per_token[1], 1, n);
    bad |= npy_write(dir, "dhidden", "<f4", c->dx, 1, dx);
    bad |= npy_write(dir, "dweight", "<f4", c->dweight, 1, dw);
    return bad;
}

static double rel(double f, double r)
{
    const double e = fabs(f - r) / fmax(1.0, fabs(r));
    return isnan(e) ? INFINITY : e;
}

static double norm_rel(const float *f, const double *r, size_t count)
{
    const double e = ce_compare(f, r, count).norm_rel;
    return isnan(e) ? INFINITY : e;
}

static int report(const void *check)
{
    const topk_check *c = check;
    const topk_spec *s = &c->spec;
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab;
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    const double grad_tol = ce_grad_tolerance(TOPK_GRAD_TOL, bf16 && !s->fp32_du, s->grad_dtype);
    const double dbias_tol = ce_grad_tolerance(TOPK_GRAD_TOL, 0, s->grad_dtype);
    double e_loss = 0.0, e_tok = 0.0;
    for (int j = 0; j < 2; j++) {
        e_loss = fmax(e_loss, fmax(rel(c->loss[j], c->r.loss), fmax(rel(c->soft[j], c->r.soft_loss),
                                                                   rel(c->hard[j], c->r.hard_loss))));
        for (size_t i = 0; i < n; i++) {
            const double e = fabs((double)c->per_token[j][i] - c->ref_per_token[i]) / (1.0 + fabs(c->ref_per_token[i]));
            e_tok = isnan(e) ? INFINITY : fmax(e_tok, e);
        }
    }
    const double e_dx = norm_rel(c->dx, c->ref_dx, n * h), e_dw = norm_rel(c->dweight, c->ref_dweight, h * v);
    const double e_db = c->dbias ? norm_rel(c->dbias, c->ref_dbias, v) : 0.0;
    const double row_block_floor = 4.0 * (double)v * (double)(s->n < 256 ? s->n : 256) +
                                   (bf16 ? 2.0 * (double)n * (double)v : 0.0);
    const int streaming = (bf16 && s->fp32_du) || (s->budget > 0 && (double)s->budget < row_block_floor);
    const int pass = e_loss <= TOPK_LOSS_TOL && e_tok <= TOPK_TOKEN_TOL && e_dx <= grad_tol && e_dw <= grad_tol &&
                     e_db <= dbias_tol;
    const fh_distill_topk_options *o = &s->options;
    printf("{\n  \"k\": %lld,\n  \"add_tail\": %d,\n  \"temperature\": %g,\n  \"weight_soft_loss\": %g,\n"
           "  \"weight_hard_loss\": %g,\n  \"reduction\": \"%s\",\n  \"dtype\": \"%s\",\n  \"grad_dtype\": \"%s\",\n"
           "  \"workspace_bytes\": %zu,\n  \"streaming\": %s,\n",
           (long long)s->k, o->add_tail, o->temperature, o->weight_soft_loss, o->weight_hard_loss,
           reductions[o->reduction], bf16 ? "bf16" : "f32", s->grad_dtype == FH_DTYPE_BF16 ? "bf16" : "f32",
           c->workspace, streaming ? "true" : "false");
    printf("  \"loss\": %.17g,\n  \"forward_loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"soft_loss\": %.17g,\n"
           "  \"ref_soft_loss\": %.17g,\n  \"loss_rel\": %.3e,\n  \"per_token_loss_max_rel\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n"
           "  \"tolerance\": {\"loss_rel\": %g, \"per_token_rel\": %g, \"grad_norm_rel\": %g, \"dbias_norm_rel\": %g},\n"
           "  \"pass\": %s\n}\n",
           c->loss[1], c->loss[0], c->r.loss, c->soft[1], c->r.soft_loss, e_loss, e_tok, e_dx, e_dw, e_db,
           TOPK_LOSS_TOL, TOPK_TOKEN_TOL, grad_tol, dbias_tol, pass ? "true" : "false");
    return pass;
}

/* Sorts column indices by descending log-prob. */
static const double *sort_keys;
static int by_logprob(const void *a, const void *b)
{
    const double x = sort_keys[*(const int64_t *)a], y = sort_keys[*(const int64_t *)b];
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The teacher's k entries per token: the largest of a random log-softmax, the row's last ones padded. */
static void make_teacher(topk_check *c, uint64_t *rng)
{
    const topk_spec *s = &c->spec;
    const int64_t k = s->k, v = s->vocab;
    double *lp = gradcheck_calloc((size_t)v, sizeof(double));
    int64_t *order = gradcheck_calloc((size_t)v, sizeof(int64_t));
    for (int64_t i = 0; i < s->n; i++) {
        double max = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < v; j++) {
            lp[j] = s->logit_scale * 1.7320508075688772 * (2.0 * ref_uniform(rng) - 1.0); /* std logit_scale */
            max = fmax(max, lp[j]);
        }
        for (int64_t j = 0; j < v; j++)
            sum += exp(lp[j] - max);
        for (int64_t j = 0; j < v; j++) {
            lp[j] -= max + log(sum);
            order[j] = j;
        }
        sort_keys = lp;
        qsort(order, (size_t)v, sizeof(int64_t), by_logprob);
        const int64_t padded = i % 5 == 3 && s->pad_frac > 0.0 ? k : (int64_t)(ref_uniform(rng) * s->pad_frac * (double)k);
        for (int64_t e = 0; e < k; e++) {
            const int pad = e >= k - padded;
            c->ids[i * k + e] = pad ? 0 : order[e];
            c->logprobs[i * k + e] = pad ? -INFINITY : (float)lp[order[e]];
            c->ref_logprobs[i * k + e] = c->logprobs[i * k + e];
        }
    }
    free(lp);
    free(order);
}

static int run(void *check)
{
    topk_check *c = check;
    const topk_spec *s = &c->spec;
    const size_t n = (size_t)s->n, h = (size_t)s->hidden, v = (size_t)s->vocab, nk = n * (size_t)s->k;
    uint64_t rng = s->seed * 104729 + 5;
    c->x = gradcheck_calloc(n * h, sizeof(float));
    c->weight = gradcheck_calloc(h * v, sizeof(float));
    c->bias = s->bias ? gradcheck_calloc(v, sizeof(float)) : NULL;
    ce_fill_linear(&rng, s->n, s->hidden, s->vocab, s->logit_scale, c->x, c->weight, c->bias);
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    if (bf16 && (!(c->x_bf16 = bf16_round_in_place(c->x, n * h)) ||
                 !(c->weight_bf16 = bf16_round_in_place(c->weight, h * v)))) {
        fprintf(stderr, "fh_gradcheck: out of memory\n");
        return 2;
    }
    c->lin = ce_case_linear(s->n, s->hidden, s->vocab, s->layout, s->dtype, c->x, c->x_bf16, c->weight,
                            c->weight_bf16, c->bias);
    c->ids = gradcheck_calloc(nk, sizeof(int64_t));
    c->logprobs = gradcheck_calloc(nk, sizeof(float));
    c->ref_logprobs = gradcheck_calloc(nk, sizeof(double));
    make_teacher(c, &rng);
    c->targets = gradcheck_calloc(n, sizeof(int64_t));
    for (size_t i = 0; i < n; i++) {
        c->targets[i] = (int64_t)(ref_uniform(&rng) * (double)s->vocab);
        if (ref_uniform(&rng) < s->ignore_frac)
            c->targets[i] = s->options.ignore_index;
    }
    const int64_t *targets = s->no_targets ? NULL : c->targets;
    c->grad_output = gradcheck_calloc(n, sizeof(float));
    for (size_t i = 0; i < n; i++)
        c->grad_output[i] =
            s->options.reduction == FH_REDUCTION_NONE ? (float)(3.0 * ref_uniform(&rng) - 1.5) : s->grad_output;
    const fh_topk_teacher teacher = {s->k, c->ids, c->logprobs};

    fh_context *ctx;
    fh_status st = gradcheck_context(&ctx, s->threads, s->tile_rows, s->tile_vocab, s->budget, s->fp32_du);
    c->per_token[0] = gradcheck_calloc(n, sizeof(float));
    c->per_token[1] = gradcheck_calloc(n, sizeof(float));
    ce_alloc_grads(n, h, v, s->bias, 0.0f, &c->dx, &c->dweight, &c->dbias);
    if (st == FH_OK) {
        fh_distill_outputs out = {&c->loss[0], &c->soft[0], &c->hard[0], c->per_token[0]};
        st = fh_distill_topk_forward(ctx, &c->lin, &teacher, targets, &s->options, &out);
    }
    if (st == FH_OK) {
        ce_grads_io io;
        ce_grads_io_begin(&io, s->grad_dtype, n, h, v, 0.0f, c->dx, c->dweight, c->dbias);
        fh_distill_outputs out = {&c->loss[1], &c->soft[1], &c->hard[1], c->per_token[1]};
        st = fh_distill_topk_forward_backward(ctx, &c->lin, &teacher, targets, &s->options, c->grad_output, &out,
                                              &io.grads);
        ce_grads_io_finish(&io);
    }
    if (st == FH_OK)
        st = fh_distill_topk_workspace_size(ctx, &c->lin, &c->workspace);
    if (st != FH_OK) {
        const char *message = "";
        if (ctx)
            fh_context_message(ctx, &message);
        gradcheck_library_failed(st, message);
    }
    fh_context_destroy(ctx);
    if (st != FH_OK)
        return 2;

    const fh_distill_topk_options *o = &s->options;
    const ref_distill_topk_options ro = {o->add_tail, o->temperature, o->weight_soft_loss, o->weight_hard_loss,
                                         o->ignore_index, (int)o->reduction};
    const ref_topk_teacher rt = {s->k, c->ids, c->ref_logprobs};
    c->rx = gradcheck_doubles(c->x, n * h);
    c->rw = ce_weight_to_reference(s->layout, s->hidden, s->vocab, c->weight);
    c->rb = gradcheck_doubles(c->bias, v);
    const ref_linear student = {s->n, s->hidden, s->vocab, c->rx, c->rw, c->rb};
    c->ref_per_token = gradcheck_calloc(n, sizeof(double));
    c->ref_dx = gradcheck_calloc(n * h, sizeof(double));
    c->ref_dw_hv = gradcheck_calloc(h * v, sizeof(double));
    c->ref_dweight = gradcheck_calloc(h * v, sizeof(double));
    c->ref_dbias = c->bias ? gradcheck_calloc(v, sizeof(double)) : NULL;
    c->g = gradcheck_doubles(c->grad_output, n);
    c->r.per_token_loss = c->ref_per_token;
    if (ref_distill_topk_linear(&student, &rt, targets, &ro, c->g, &c->r, c->ref_dx, c->ref_dw_hv, c->ref_dbias)) {
        fprintf(stderr, "fh_gradcheck: the reference failed where the library succeeded\n");
        return 2;
    }
    ce_weight_from_reference(s->layout, s->hidden, s->vocab, c->ref_dw_hv, c->ref_dweight);
    return 0;
}

static void free_check(void *check)
{
    topk_check *c = check;
    void *p[] = {c->x, c->weight, c->bias, c->x_bf16, c->weight_bf16, c->rx, c->rw, c->rb, c->ids, c->targets,
                 c->logprobs, c->grad_output, c->ref_logprobs, c->per_token[0], c->per_token[1], c->dx, c->dweight,
                 c->dbias, c->ref_per_token, c->ref_dx, c->ref_dw_hv, c->ref_dweight, c->ref_dbias, c->g};
    for (size_t j = 0; j < sizeof p / sizeof p[0]; j++)
        free(p[j]);
}

int gradcheck_distill_topk(int argc, char **argv)
{
    static const gradcheck_loss topk = {usage, parse, run, report, dump_case, free_check};
    topk_check check = {0};
    return gradcheck_main(&topk, &check, argc, argv);
}
