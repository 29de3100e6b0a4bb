/* distill_topk: the fused top-k teacher distillation head (fh_distill_topk_forward, fh_distill_topk_forward_backward)
 * against the double-precision reference ref_distill_topk_linear (ref/ref_distill_topk.h, itself checked by finite
 * differences in ref_distill_topk_fdcheck.c; TRL's server distillation at f2cd5771):
 *   - tail / no tail x k 1, 5, 64 x temperature 1 / 0.7 x the three schedules (row blocks, several row blocks,
 *     streaming), weight_hard_loss 0 / 0.4 and the reduction (mean / sum / none) cycling, and the forward alone;
 *     ragged teacher rows (padded entries, a fully padded token), ignored tokens, a bias;
 *   - exact values: k = 1 without the tail is 0 with zero gradients; a fully padded token adds 0 and is counted;
 *     ignored tokens have a per-token loss and dx rows of exactly 0; every token ignored gives 0;
 *   - a repeated id is two support entries (TRL's gather), as the reference has it;
 *   - gradient beta 1 accumulates; bf16 student with fp32 and bf16 gradients; gradient filtering has no effect;
 *   - the workspace query: exactly that size works, one byte less fails;
 *   - the API contracts: each bad argument's status, a message naming it, outputs untouched.
 *
 * Inputs: x U(-1, 1), the weight scaled so that the logits have standard deviation ~2 (ce_fill_linear); the teacher's
 * k entries the largest of a random log-softmax (logits of standard deviation 2) in order, independent of the student.
 *
 * Tolerances: those of the distillation head (tests/test_distill.c derives them), for the same reasons: the loss
 * parts 1e-5 max(1, |r|) (fp32 logits and exps, log-sum-exps accurate to ~1e-6 absolute, sums in double), per-token
 * losses 1e-5 (1 + |r|), gradients normwise 1e-5 (dU formed in fp32 from the same log-sum-exps, two fp32 GEMMs);
 * bf16 inputs: the gradients ce_grad_tolerance (2^-8 for dU rounded to bf16, + 2^-8 for bf16 gradients). The
 * largest errors measured here (portable, AVX2 and AVX-512 row kernels alike; FH_TEST_VERBOSE=1 prints them): loss
 * 5.9e-8, per-token 1.8e-7, gradients 4.4e-7 fp32 and 2.4e-3 bf16. */
#include "bf16.h"
#include "ce_case.h"
#include "ref_distill_topk.h"
#include "test_util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOPK_LOSS_TOL 1e-5
#define TOPK_TOKEN_TOL 1e-5
#define TOPK_GRAD_TOL CE_GRAD_NORM_REL_TOL

enum { N = 24, H = 16, V = 517, STREAM_ROWS = 8, STREAM_VOCAB = 64, SPLIT_ROWS = 7 };

typedef enum schedule { ROW_BLOCKS, ROW_BLOCKS_SPLIT, STREAMING } schedule;

/* A row block holds at least min(n, 256) = N V-wide fp32 rows (4 N V bytes); half that cannot hold one, while the
 * streaming tiles (8 x 64 floats, 10 n doubles of per-row state) fit easily. */
static const int64_t STREAM_BUDGET = 2 * N * V;

typedef struct spec {
    int64_t k;
    fh_distill_topk_options o;
    schedule sched;
    fh_dtype dtype, grad_dtype;
    float grad_beta;
    int targets;   /* else NULL (soft only) */
    int duplicate; /* token 5 repeats its first id */
    double grad_filter_eps;
    uint64_t seed;
} spec;

typedef struct problem {
    float *x, *weight, *bias;
    uint16_t *x_bf16, *weight_bf16;
    double *rx, *rw, *rb;
    fh_linear lin;
    int64_t *ids, *targets;
    float *logprobs, *grad_output;
    double *ref_logprobs;
} problem;

static void spec_default(spec *s, int64_t k)
{
    memset(s, 0, sizeof *s);
    s->k = k;
    fh_distill_topk_options_init(&s->o);
    s->dtype = s->grad_dtype = FH_DTYPE_F32;
    s->targets = 1;
    s->seed = 11;
}

static const double *sort_keys;
static int by_logprob(const void *a, const void *b)
{
    const double x = sort_keys[*(const int64_t *)a], y = sort_keys[*(const int64_t *)b];
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Token 3's entries all padded, the others' last (i % 3) entries; tokens 2, 9 and 17 ignored. */
static void problem_make(problem *p, const spec *s)
{
    memset(p, 0, sizeof *p);
    uint64_t rng = s->seed * 7919 + 1;
    const int64_t k = s->k;
    p->x = tu_alloc(N * H, sizeof(float));
    p->weight = tu_alloc(H * V, sizeof(float));
    p->bias = tu_alloc(V, sizeof(float));
    ce_fill_linear(&rng, N, H, V, 2.0, p->x, p->weight, p->bias);
    if (s->dtype == FH_DTYPE_BF16) {
        p->x_bf16 = bf16_round_in_place(p->x, N * H);
        p->weight_bf16 = bf16_round_in_place(p->weight, H * V);
    }
    p->lin = ce_case_linear(N, H, V, FH_LAYOUT_VH, s->dtype, p->x, p->x_bf16, p->weight, p->weight_bf16, p->bias);
    p->rx = tu_doubles(p->x, N * H);
    p->rw = ce_weight_to_reference(FH_LAYOUT_VH, H, V, p->weight);
    p->rb = tu_doubles(p->bias, V);
    p->ids = tu_alloc((size_t)(N * k), sizeof(int64_t));
    p->logprobs = tu_alloc((size_t)(N * k), sizeof(float));
    p->ref_logprobs = tu_alloc((size_t)(N * k), sizeof(double));
    double lp[V];
    int64_t order[V];
    for (int64_t i = 0; i < N; i++) {
        double max = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < V; j++)
            max = fmax(max, lp[j] = 2.0 * 1.7320508075688772 * (2.0 * ref_uniform(&rng) - 1.0));
        for (int64_t j = 0; j < V; j++)
            sum += exp(lp[j] - max);
        for (int64_t j = 0; j < V; j++) {
            lp[j] -= max + log(sum);
            order[j] = j;
        }
        sort_keys = lp;
        qsort(order, V, sizeof(int64_t), by_logprob);
        const int64_t padded = i == 3 ? k : k > 1 ? i % 3 : 0;
        for (int64_t e = 0; e < k; e++) {
            const int pad = e >= k - padded;
            p->ids[i * k + e] = pad ? -1 : order[e];
            p->logprobs[i * k + e] = pad ? -INFINITY : (float)lp[order[e]];
        }
    }
    if (s->duplicate && k > 1)
        p->ids[5 * k + 1] = p->ids[5 * k];
    for (int64_t e = 0; e < N * k; e++)
        p->ref_logprobs[e] = p->logprobs[e];
    p->targets = tu_alloc(N, sizeof(int64_t));
    for (int64_t i = 0; i < N; i++)
        p->targets[i] = i == 2 || i == 9 || i == 17 ? s->o.ignore_index : (int64_t)(ref_uniform(&rng) * V);
    p->targets[0] = V - 1; /* the last column counts */
    p->grad_output = tu_alloc(N, sizeof(float));
    for (int64_t i = 0; i < N; i++)
        p->grad_output[i] = s->o.reduction == FH_REDUCTION_NONE ? (float)(3.0 * ref_uniform(&rng) - 1.5) : 1.3f;
}

static void problem_free(problem *p)
{
    void *a[] = {p->x, p->weight, p->bias, p->x_bf16, p->weight_bf16, p->rx, p->rw, p->rb,
                 p->ids, p->targets, p->logprobs, p->grad_output, p->ref_logprobs};
    for (size_t j = 0; j < TU_COUNT(a); j++)
        free(a[j]);
}

static fh_context *context_of(const spec *s)
{
    fh_context *ctx = s->sched == STREAMING ? tu_context(2, STREAM_ROWS, STREAM_VOCAB, STREAM_BUDGET)
                      : s->sched == ROW_BLOCKS_SPLIT ? tu_context(2, SPLIT_ROWS, 0, 0)
                                                     : tu_context(2, 0, 0, 0);
    if (s->grad_filter_eps > 0.0)
        TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, s->grad_filter_eps) == FH_OK, "filter eps");
    return ctx;
}

/* The fused results: [0] the forward's, [1] the step's. */
typedef struct fused {
    double loss[2], soft[2], hard[2];
    float per_token[2][N];
    float dx[N * H], dweight[H * V], dbias[V];
} fused;

static fh_status run_fused(const spec *s, const problem *p, fused *f)
{
    fh_context *ctx = context_of(s);
    const fh_topk_teacher t = {s->k, p->ids, p->logprobs};
    const int64_t *targets = s->targets ? p->targets : NULL;
    fh_distill_outputs out = {&f->loss[0], &f->soft[0], &f->hard[0], f->per_token[0]};
    fh_status st = fh_distill_topk_forward(ctx, &p->lin, &t, targets, &s->o, &out);
    if (st == FH_OK) {
        ce_grads_io io;
        ce_grads_io_begin(&io, s->grad_dtype, N, H, V, s->grad_beta, f->dx, f->dweight, f->dbias);
        out = (fh_distill_outputs){&f->loss[1], &f->soft[1], &f->hard[1], f->per_token[1]};
        st = fh_distill_topk_forward_backward(ctx, &p->lin, &t, targets, &s->o, p->grad_output, &out, &io.grads);
        ce_grads_io_finish(&io);
    }
    fh_context_destroy(ctx);
    return st;
}

typedef struct reference {
    ref_distill_result r;
    double per_token[N], dx[N * H], dweight[H * V], dbias[V];
} reference;

static void run_reference(const spec *s, const problem *p, reference *r)
{
    const fh_distill_topk_options *o = &s->o;
    const ref_distill_topk_options ro = {o->add_tail, o->temperature, o->weight_soft_loss, o->weight_hard_loss,
                                         o->ignore_index, (int)o->reduction};
    const ref_topk_teacher t = {s->k, p->ids, p->ref_logprobs};
    const ref_linear lin = {N, H, V, p->rx, p->rw, p->rb};
    double g[N], dw[H * V];
    for (int i = 0; i < N; i++)
        g[i] = p->grad_output[i];
    r->r.per_token_loss = r->per_token;
    TU_CHECK(ref_distill_topk_linear(&lin, &t, s->targets ? p->targets : NULL, &ro, g, &r->r, r->dx, dw, r->dbias) == 0,
             "the reference failed");
    ce_weight_from_reference(FH_LAYOUT_VH, H, V, dw, r->dweight);
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

static double worst_loss, worst_token, worst_grad, worst_grad_bf16;

/* One case against the reference (with beta 1 the gradients started at `prior` each). */
static void check_case(const spec *s, const char *label)
{
    problem p;
    problem_make(&p, s);
    static fused f;
    static reference r;
    const float prior = 0.25f;
    for (size_t j = 0; j < N * H; j++)
        f.dx[j] = s->grad_beta != 0.0f ? prior : NAN;
    for (size_t j = 0; j < H * V; j++)
        f.dweight[j] = s->grad_beta != 0.0f ? prior : NAN;
    for (size_t j = 0; j < V; j++)
        f.dbias[j] = s->grad_beta != 0.0f ? prior : NAN;
    const fh_status st = run_fused(s, &p, &f);
    TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
    run_reference(s, &p, &r);
    if (s->grad_beta != 0.0f) {
        for (size_t j = 0; j < N * H; j++)
            r.dx[j] += prior;
        for (size_t j = 0; j < H * V; j++)
            r.dweight[j] += prior;
        for (size_t j = 0; j < V; j++)
            r.dbias[j] += prior;
    }
    double e_loss = 0.0, e_tok = 0.0;
    for (int c = 0; c < 2; c++) {
        e_loss = fmax(e_loss, fmax(rel(f.loss[c], r.r.loss), fmax(rel(f.soft[c], r.r.soft_loss),
                                                                 rel(f.hard[c], r.r.hard_loss))));
        for (int i = 0; i < N; i++) {
            const double e = fabs(f.per_token[c][i] - r.per_token[i]) / (1.0 + fabs(r.per_token[i]));
            e_tok = isnan(e) ? INFINITY : fmax(e_tok, e);
        }
    }
    const int bf16 = s->dtype == FH_DTYPE_BF16;
    const double tol = ce_grad_tolerance(TOPK_GRAD_TOL, bf16, s->grad_dtype);
    const double tol_bias = ce_grad_tolerance(TOPK_GRAD_TOL, 0, s->grad_dtype);
    const double e_dx = norm_rel(f.dx, r.dx, N * H), e_dw = norm_rel(f.dweight, r.dweight, H * V);
    const double e_db = norm_rel(f.dbias, r.dbias, V);
    TU_CHECK(e_loss <= TOPK_LOSS_TOL && e_tok <= TOPK_TOKEN_TOL,
             "%s: loss error %.3g (tol %g), per-token %.3g (tol %g)", label, e_loss, TOPK_LOSS_TOL, e_tok,
             TOPK_TOKEN_TOL);
    TU_CHECK(e_dx <= tol && e_dw <= tol && e_db <= tol_bias, "%s: dx %.3g dweight %.3g (tol %g), dbias %.3g (tol %g)",
             label, e_dx, e_dw, tol, e_db, tol_bias);
    worst_loss = fmax(worst_loss, e_loss);
    worst_token = fmax(worst_token, e_tok);
    if (bf16)
        worst_grad_bf16 = fmax(worst_grad_bf16, fmax(e_dx, e_dw));
    else
        worst_grad = fmax(worst_grad, fmax(e_dx, fmax(e_dw, e_db)));
    problem_free(&p);
}

static const char *const schedules[] = {"row blocks", "row blocks split", "streaming"};
static const char *const reductions[] = {"mean", "sum", "none"};

static void test_reference_matrix(void)
{
    static const int64_t ks[] = {1, 5, 64};
    int index = 0;
    for (int tail = 0; tail < 2; tail++)
        for (int ki = 0; ki < 3; ki++)
            for (int ti = 0; ti < 2; ti++)
                for (int sc = 0; sc < 3; sc++, index++) {
                    const int hard = (index / 3) % 2;
                    spec s;
                    spec_default(&s, ks[ki]);
                    s.o.add_tail = tail;
                    s.o.temperature = ti ? 0.7 : 1.0;
                    s.o.weight_hard_loss = hard ? 0.4 : 0.0;
                    s.o.weight_soft_loss = hard ? 0.6 : 1.0;
                    s.o.reduction = (fh_reduction)(index % 3);
                    s.targets = hard || index % 2;
                    s.sched = (schedule)sc;
                    s.seed = 100 + (uint64_t)index;
                    char label[160];
                    snprintf(label, sizeof label, "tail %d k %lld T %g hard %g %s %s%s", tail, (long long)s.k,
                             s.o.temperature, s.o.weight_hard_loss, reductions[s.o.reduction], schedules[sc],
                             s.targets ? "" : " no targets");
                    check_case(&s, label);
                }
}

/* k = 1 without the tail: the renormalised support is {1} on both sides, so D = 1 (0 - 0) = 0, and the head forms
 * it as exactly 0 (qt = exp(a - a) = 1, B = s + log 1 = s, D = 0 - s + 1 s); the soft gradient -1 + 1 exp(s - B) is
 * exactly 0 too, so the GEMMs multiply zeros. */
static void test_k1_without_tail_is_zero(void)
{
    for (int sc = 0; sc < 3; sc++) {
        spec s;
        spec_default(&s, 1);
        s.o.add_tail = 0;
        s.o.temperature = 0.7;
        s.targets = 0;
        s.sched = (schedule)sc;
        problem p;
        problem_make(&p, &s);
        static fused f;
        TU_CHECK(run_fused(&s, &p, &f) == FH_OK, "status");
        TU_CHECK(f.loss[0] == 0.0 && f.loss[1] == 0.0 && tu_all_equal_f(f.per_token[1], N, 0.0f), "%s: loss %g",
                 schedules[sc], f.loss[1]);
        TU_CHECK(tu_all_equal_f(f.dx, N * H, 0.0f) && tu_all_equal_f(f.dweight, H * V, 0.0f) &&
                     tu_all_equal_f(f.dbias, V, 0.0f),
                 "%s: a gradient is not exactly 0", schedules[sc]);
        problem_free(&p);
    }
}

/* Token 3 has no valid entry: its D is 0 exactly (with and without the tail), it is counted in the mean (TRL's
 * batchmean over the completion mask), and its dx row is exactly 0 (its dU is 0). Ignored tokens: per-token 0, dx 0. */
static void test_padded_and_ignored_tokens(void)
{
    for (int tail = 0; tail < 2; tail++) {
        spec s;
        spec_default(&s, 5);
        s.o.add_tail = tail;
        s.o.reduction = FH_REDUCTION_MEAN;
        problem p;
        problem_make(&p, &s);
        static fused f;
        TU_CHECK(run_fused(&s, &p, &f) == FH_OK, "status");
        double sum = 0.0;
        int counted = 0;
        for (int i = 0; i < N; i++) {
            sum += f.per_token[1][i];
            counted += p.targets[i] != s.o.ignore_index;
        }
        TU_CHECK(f.per_token[1][3] == 0.0f, "tail %d: the padded token's loss is %g", tail, f.per_token[1][3]);
        TU_CHECK(fabs(f.loss[1] - sum / counted) <= 1e-6 * fabs(f.loss[1]),
                 "tail %d: loss %.9g is not the per-token sum over the %d counted tokens (%.9g)", tail, f.loss[1],
                 counted, sum / counted);
        int zero = tu_all_equal_f(f.dx + 3 * H, H, 0.0f);
        for (int i = 0; i < N; i++)
            if (p.targets[i] == s.o.ignore_index)
                zero &= f.per_token[1][i] == 0.0f && tu_all_equal_f(f.dx + i * H, H, 0.0f);
        TU_CHECK(zero, "tail %d: a padded or ignored token has a loss or a dx", tail);
        problem_free(&p);
    }
}

static void test_duplicate_ids(void)
{
    for (int tail = 0; tail < 2; tail++) {
        spec s;
        spec_default(&s, 5);
        s.o.add_tail = tail;
        s.duplicate = 1;
        check_case(&s, tail ? "a repeated id, tail" : "a repeated id, no tail");
    }
}

static void test_accumulation_filtering_bf16(void)
{
    spec s;
    spec_default(&s, 20);
    s.grad_beta = 1.0f;
    s.o.weight_hard_loss = 0.3;
    check_case(&s, "beta 1, row blocks");
    s.sched = STREAMING;
    check_case(&s, "beta 1, streaming");
    spec_default(&s, 20);
    s.grad_filter_eps = 1e-3;
    check_case(&s, "filtering on (no effect)");
    static const fh_dtype grads[] = {FH_DTYPE_F32, FH_DTYPE_BF16};
    for (int sc = 0; sc < 3; sc++)
        for (int g = 0; g < 2; g++) {
            spec_default(&s, 20);
            s.dtype = FH_DTYPE_BF16;
            s.grad_dtype = grads[g];
            s.sched = (schedule)sc;
            s.o.add_tail = sc != 1;
            s.o.temperature = 0.7;
            s.o.weight_hard_loss = 0.4;
            char label[96];
            snprintf(label, sizeof label, "bf16, %s gradients, %s", g ? "bf16" : "fp32", schedules[sc]);
            check_case(&s, label);
        }
    if (getenv("FH_TEST_VERBOSE"))
        printf("\n  worst so far: loss %.2e, per-token %.2e, gradients %.2e fp32, %.2e bf16 (dx, dweight)\n", worst_loss,
               worst_token, worst_grad, worst_grad_bf16);
}

static void test_all_ignored(void)
{
    spec s;
    spec_default(&s, 5);
    s.o.weight_hard_loss = 0.5;
    problem p;
    problem_make(&p, &s);
    for (int i = 0; i < N; i++)
        p.targets[i] = s.o.ignore_index;
    static fused f;
    TU_CHECK(run_fused(&s, &p, &f) == FH_OK, "status");
    TU_CHECK(f.loss[1] == 0.0 && f.soft[1] == 0.0 && f.hard[1] == 0.0, "loss %g", f.loss[1]);
    TU_CHECK(tu_all_equal_f(f.dx, N * H, 0.0f) && tu_all_equal_f(f.dweight, H * V, 0.0f) &&
                 tu_all_equal_f(f.dbias, V, 0.0f),
             "a gradient is not 0");
    problem_free(&p);
}

/* With a caller's workspace the rows that count are not compacted (counted_rows.h): ignored tokens then pass through
 * the head's kernels, which must still not read their entries (token 2's are garbage here). */
static void test_workspace_query(void)
{
    spec s;
    spec_default(&s, 5);
    problem p;
    problem_make(&p, &s);
    p.ids[2 * s.k] = V + 5;
    p.ids[2 * s.k + 1] = -3;
    p.logprobs[2 * s.k + 2] = NAN;
    p.logprobs[2 * s.k + 3] = INFINITY;
    const fh_topk_teacher t = {s.k, p.ids, p.logprobs};
    for (int less = 0; less < 2; less++) {
        fh_context *ctx = tu_context(2, 0, 0, 0);
        size_t bytes = 0;
        TU_CHECK(fh_distill_topk_workspace_size(ctx, &p.lin, &bytes) == FH_OK && bytes > 0, "query");
        void *ws = tu_alloc(bytes, 1);
        TU_CHECK(fh_context_set_workspace(ctx, ws, bytes - (size_t)less) == FH_OK, "set workspace");
        static float dx[N * H], dw[H * V];
        fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw};
        double loss;
        fh_distill_outputs out = {.loss = &loss};
        const fh_status st = fh_distill_topk_forward_backward(ctx, &p.lin, &t, p.targets, &s.o, p.grad_output, &out, &g);
        const fh_status fw = fh_distill_topk_forward(ctx, &p.lin, &t, p.targets, &s.o, &out);
        TU_CHECK(less ? st == FH_ERR_WORKSPACE_TOO_SMALL && fw == FH_ERR_WORKSPACE_TOO_SMALL
                      : st == FH_OK && fw == FH_OK && isfinite(loss) && tu_all_finite_f(dx, N * H) &&
                            tu_all_equal_f(dx + 2 * H, H, 0.0f),
                 "%s bytes: status %d and %d", less ? "one byte less than the query's" : "the query's", (int)st,
                 (int)fw);
        fh_context_destroy(ctx);
        free(ws);
    }
    problem_free(&p);
}

/* ---- Contracts: a bad argument's status, a message naming it, outputs untouched ---- */

typedef struct call {
    spec s;
    problem p;
    fh_topk_teacher t;
    const fh_topk_teacher *tp;
    const int64_t *targets;
    const float *grad_output;
    double loss;
    float per_token[N];
    float *per_token_out;
    fh_distill_outputs out;
    float dx[N * H], dweight[H * V];
} call;

static void call_init(call *c)
{
    spec_default(&c->s, 4);
    problem_make(&c->p, &c->s);
    c->t = (fh_topk_teacher){c->s.k, c->p.ids, c->p.logprobs};
    c->tp = &c->t;
    c->targets = c->p.targets;
    c->grad_output = c->p.grad_output;
    c->per_token_out = c->per_token;
}

typedef void mutate_fn(call *c);
static void no_teacher(call *c) { c->tp = NULL; }
static void no_ids(call *c) { c->t.ids = NULL; }
static void no_logprobs(call *c) { c->t.logprobs = NULL; }
static void k_zero(call *c) { c->t.k = 0; }
static void k_too_large(call *c) { c->t.k = FH_DISTILL_TOPK_MAX_K + 1; }
static void logprob_nan(call *c) { c->p.logprobs[1 * 4 + 2] = NAN; }
static void logprob_inf(call *c) { c->p.logprobs[4 * 4] = INFINITY; }
static void id_minus_one(call *c) { c->p.ids[6 * 4 + 1] = -1; }
static void id_vocab(call *c) { c->p.ids[7 * 4] = V; }
static void add_tail_two(call *c) { c->s.o.add_tail = 2; }
static void temperature_zero(call *c) { c->s.o.temperature = 0.0; }
static void weight_negative(call *c) { c->s.o.weight_soft_loss = -1.0; }
static void weight_nan(call *c) { c->s.o.weight_hard_loss = NAN; }
static void reduction_three(call *c) { c->s.o.reduction = (fh_reduction)3; }
static void hard_without_targets(call *c) { c->s.o.weight_hard_loss = 0.5, c->targets = NULL; }
static void target_vocab(call *c) { c->p.targets[1] = V; }
static void none_without_per_token(call *c) { c->s.o.reduction = FH_REDUCTION_NONE, c->per_token_out = NULL; }
static void per_token_over_logprobs(call *c) { c->per_token_out = c->p.logprobs; }
static void grad_output_nan(call *c) { c->p.grad_output[0] = NAN; }
/* Accepted: a padded entry's id and an ignored token's entries are never read. */
static void padded_id_garbage(call *c) { c->p.ids[3 * 4 + 1] = -12345; }
static void ignored_token_garbage(call *c) { c->p.ids[2 * 4] = V + 5, c->p.logprobs[2 * 4 + 1] = NAN; }

static const struct {
    const char *name;
    mutate_fn *mutate;
    fh_status status;
    const char *word;
} contract_cases[] = {
    {"NULL teacher", no_teacher, FH_ERR_NULL_POINTER, "teacher"},
    {"NULL ids", no_ids, FH_ERR_NULL_POINTER, "ids"},
    {"NULL logprobs", no_logprobs, FH_ERR_NULL_POINTER, "logprobs"},
    {"k 0", k_zero, FH_ERR_INVALID_DISTILL_OPTION, "k"},
    {"k above the maximum", k_too_large, FH_ERR_INVALID_DISTILL_OPTION, "k"},
    {"a log-prob NaN", logprob_nan, FH_ERR_INVALID_DISTILL_OPTION, "logprobs"},
    {"a log-prob +inf", logprob_inf, FH_ERR_INVALID_DISTILL_OPTION, "logprobs"},
    {"a valid entry's id -1", id_minus_one, FH_ERR_TARGET_OUT_OF_RANGE, "ids"},
    {"a valid entry's id V", id_vocab, FH_ERR_TARGET_OUT_OF_RANGE, "ids"},
    {"add_tail 2", add_tail_two, FH_ERR_INVALID_DISTILL_OPTION, "add_tail"},
    {"temperature 0", temperature_zero, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"weight_soft_loss -1", weight_negative, FH_ERR_INVALID_DISTILL_OPTION, "weight_soft_loss"},
    {"weight_hard_loss NaN", weight_nan, FH_ERR_INVALID_DISTILL_OPTION, "weight_hard_loss"},
    {"reduction 3", reduction_three, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"targets NULL with weight_hard_loss", hard_without_targets, FH_ERR_NULL_POINTER, "targets"},
    {"target V", target_vocab, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"reduction none without per_token_loss", none_without_per_token, FH_ERR_MISSING_OUTPUT, "per_token_loss"},
    {"per_token_loss over the teacher's logprobs", per_token_over_logprobs, FH_ERR_OVERLAPPING_BUFFERS, "logprobs"},
    {"grad_output NaN (step only)", grad_output_nan, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"a padded entry's id is not read", padded_id_garbage, FH_OK, NULL},
    {"an ignored token's entries are not read", ignored_token_garbage, FH_OK, NULL},
};

static void test_contracts(void)
{
    for (size_t k = 0; k < TU_COUNT(contract_cases); k++)
        for (int step = 0; step < 2; step++) {
            static call c;
            call_init(&c);
            contract_cases[k].mutate(&c);
            const int step_only = contract_cases[k].mutate == grad_output_nan;
            tu_fill_canary(&c.loss, sizeof c.loss);
            tu_fill_canary(c.per_token, sizeof c.per_token);
            tu_fill_canary(c.dx, sizeof c.dx);
            tu_fill_canary(c.dweight, sizeof c.dweight);
            const int overlap = c.per_token_out == c.p.logprobs;
            c.out = (fh_distill_outputs){&c.loss, NULL, NULL, c.per_token_out};
            fh_context *ctx = tu_context(2, 0, 0, 0);
            fh_linear_grads g = {.dx = c.dx, .dx_row_stride = H, .dweight = c.dweight};
            const fh_status st =
                step ? fh_distill_topk_forward_backward(ctx, &c.p.lin, c.tp, c.targets, &c.s.o, c.grad_output, &c.out,
                                                        &g)
                     : fh_distill_topk_forward(ctx, &c.p.lin, c.tp, c.targets, &c.s.o, &c.out);
            const fh_status want = step_only && !step ? FH_OK : contract_cases[k].status;
            const char *message = "";
            fh_context_message(ctx, &message);
            TU_CHECK(st == want, "%s (%s): status %d, want %d (%s)", contract_cases[k].name,
                     step ? "forward_backward" : "forward", (int)st, (int)want, message);
            if (want != FH_OK) {
                unsigned char canary[sizeof c.loss];
                tu_fill_canary(canary, sizeof canary);
                int untouched = memcmp(&c.loss, canary, sizeof canary) == 0;
                for (size_t j = 0; j < sizeof c.dx; j++)
                    untouched &= ((unsigned char *)c.dx)[j] == TU_CANARY;
                for (size_t j = 0; j < sizeof c.per_token && !overlap; j++)
                    untouched &= ((unsigned char *)c.per_token)[j] == TU_CANARY;
                TU_CHECK(untouched, "%s: an output was written", contract_cases[k].name);
                TU_CHECK(!contract_cases[k].word || tu_mentions(message, contract_cases[k].word),
                         "%s: the message \"%s\" does not name %s", contract_cases[k].name, message,
                         contract_cases[k].word);
            }
            fh_context_destroy(ctx);
            problem_free(&c.p);
        }
}

/* Ignored rows at temperature 0.05, logits to +-160 (s to +-3200): a call that computes every row (a caller's
 * workspace, gradient filtering on the context) gives finite gradients equal to the default context's, which compacts
 * the ignored rows away: no ignored row's gradient is formed from a statistic it does not have (issue 41). dx bit for
 * bit (a row's dx depends on its own logits only), dweight and dbias to fp32 summation order (1e-6 normwise, as the
 * counted-rows comparisons). */
/* A student of rows x hid x cols (x in +-1, the weight in +-0.5, a bias in +-bias_range) and a teacher's TEACHER_K
 * entries per row, spread over the vocabulary, for the schedule comparisons below; targets are the caller's. */
enum { TEACHER_K = 4 };
typedef struct student_case {
    float *x, *w, *b, *logprobs;
    int64_t *targets, *ids;
    fh_linear lin; /* [V, H], with the bias */
    fh_topk_teacher teacher;
} student_case;

static void student_case_make(student_case *c, int64_t rows, int64_t hid, int64_t cols, double bias_range,
                              uint64_t seed)
{
    uint64_t rng = seed;
    c->x = tu_alloc((size_t)(rows * hid), sizeof(float));
    c->w = tu_alloc((size_t)(hid * cols), sizeof(float));
    c->b = tu_alloc((size_t)cols, sizeof(float));
    c->logprobs = tu_alloc((size_t)(rows * TEACHER_K), sizeof(float));
    c->targets = tu_alloc((size_t)rows, sizeof(int64_t));
    c->ids = tu_alloc((size_t)(rows * TEACHER_K), sizeof(int64_t));
    tu_fill_uniform(c->x, (size_t)(rows * hid), &rng, -1.0, 1.0);
    tu_fill_uniform(c->w, (size_t)(hid * cols), &rng, -0.5, 0.5);
    tu_fill_uniform(c->b, (size_t)cols, &rng, -bias_range, bias_range);
    for (int64_t i = 0; i < rows; i++)
        for (int k = 0; k < TEACHER_K; k++) {
            c->ids[i * TEACHER_K + k] = (i * 7919 + k * 5003) % cols;
            c->logprobs[i * TEACHER_K + k] = -0.5f - (float)k;
        }
    fh_linear_init(&c->lin, rows, hid, cols, c->x, c->w, FH_LAYOUT_VH, c->b);
    c->teacher = (fh_topk_teacher){TEACHER_K, c->ids, c->logprobs};
}

static void student_case_free(student_case *c)
{
    free(c->x);
    free(c->w);
    free(c->b);
    free(c->logprobs);
    free(c->targets);
    free(c->ids);
}

static void test_ignored_rows_cold_temperature(void)
{
    enum { ROWS = 48, HID = 16, COLS = 300 };
    student_case c;
    student_case_make(&c, ROWS, HID, COLS, 150.0, 4144);
    for (int64_t i = 0; i < ROWS; i++)
        c.targets[i] = i % 3 == 0 ? -100 : (i * 31) % COLS;
    fh_distill_topk_options o;
    fh_distill_topk_options_init(&o);
    o.temperature = 0.05;
    o.weight_hard_loss = 0.5;
    static const char *const names[3] = {"the default context", "a caller's workspace", "gradient filtering"};
    const size_t counts[3] = {ROWS * HID, HID * COLS, COLS};
    const float one = 1.0f;
    float *grads[3][3];
    for (int run = 0; run < 3; run++) {
        for (int j = 0; j < 3; j++)
            grads[run][j] = tu_alloc(counts[j], sizeof(float));
        fh_context *ctx = tu_context(2, 0, 0, 0);
        void *workspace = NULL;
        size_t bytes = 0;
        if (run == 1) {
            TU_CHECK(fh_distill_topk_workspace_size(ctx, &c.lin, &bytes) == FH_OK, "workspace size");
            workspace = tu_alloc(bytes, 1);
            TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
        }
        if (run == 2)
            TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0x1.0p-28) == FH_OK, "filtering on");
        double loss = 0.0;
        fh_distill_outputs out = {.loss = &loss};
        fh_linear_grads gr = {.dx = grads[run][0], .dx_row_stride = HID, .dweight = grads[run][1],
                              .dbias = grads[run][2]};
        const fh_status st = fh_distill_topk_forward_backward(ctx, &c.lin, &c.teacher, c.targets, &o, &one, &out, &gr);
        TU_CHECK(st == FH_OK, "%s: status %d", names[run], (int)st);
        for (int j = 0; j < 3; j++)
            TU_CHECK(tu_all_finite_f(grads[run][j], counts[j]), "%s: gradient %d finite", names[run], j);
        if (run > 0) {
            TU_CHECK(memcmp(grads[run][0], grads[0][0], counts[0] * sizeof(float)) == 0,
                     "%s: dx bit for bit the default context's", names[run]);
            for (int j = 0; j < 3; j++) {
                const double d = tu_norm_rel_f(grads[run][j], grads[0][j], counts[j]);
                TU_CHECK(d <= 1e-6, "%s: gradient %d %.2e normwise from the default context's", names[run], j, d);
            }
        }
        fh_context_destroy(ctx);
        free(workspace);
    }
    for (int run = 0; run < 3; run++)
        for (int j = 0; j < 3; j++)
            free(grads[run][j]);
    student_case_free(&c);
}

/* At N <= H with a vocabulary of several dU chunks, an fp32 train step computes its logits into the chunks, in the
 * memory of a dense [V, H] dweight it overwrites, and runs the head's own pair kernels on each row loaded into a row
 * of its own (plan.c, keep_f32_du): N = 8, H = 32, V = 20000, temperature 0.7, a hard loss, a bias. The same call
 * adding onto a zeroed dweight (beta 1, so nothing moves into it) gives the same loss bit for bit (the rows are
 * folded by the same kernels) and the same gradients to fp32 summation order (dx sums over the chunks one GEMM each,
 * the weight gradient's GEMMs group the rows differently: 1e-6 normwise, as the counted-rows comparisons). */
static void test_chunks_in_dweight(void)
{
    enum { ROWS = 8, HID = 32, COLS = 20000 };
    student_case c;
    student_case_make(&c, ROWS, HID, COLS, 2.0, 4150);
    for (int64_t i = 0; i < ROWS; i++)
        c.targets[i] = (i * 4999) % COLS;
    fh_distill_topk_options o;
    fh_distill_topk_options_init(&o);
    o.temperature = 0.7;
    o.weight_hard_loss = 0.5;
    const size_t counts[3] = {ROWS * HID, HID * COLS, COLS};
    const float one = 1.0f;
    float *grads[2][3];
    double loss[2] = {0.0, 0.0};
    for (int run = 0; run < 2; run++) {
        for (int j = 0; j < 3; j++) {
            grads[run][j] = tu_alloc(counts[j], sizeof(float));
            for (size_t e = 0; e < counts[j]; e++)
                grads[run][j][e] = 0.0f;
        }
        fh_context *ctx = tu_context(2, 0, 0, 0);
        fh_distill_outputs out = {.loss = &loss[run]};
        fh_linear_grads gr = {.dx = grads[run][0], .dx_row_stride = HID, .dweight = grads[run][1],
                              .dweight_beta = (float)run, .dbias = grads[run][2]};
        TU_CHECK(fh_distill_topk_forward_backward(ctx, &c.lin, &c.teacher, c.targets, &o, &one, &out, &gr) == FH_OK,
                 "dweight beta %d: status", run);
        fh_context_destroy(ctx);
    }
    TU_CHECK(loss[0] == loss[1], "loss %.17g and %.17g", loss[0], loss[1]);
    for (int j = 0; j < 3; j++) {
        const double d = tu_norm_rel_f(grads[0][j], grads[1][j], counts[j]);
        TU_CHECK(d <= 1e-6, "gradient %d %.2e normwise from the call with beta 1", j, d);
    }
    for (int run = 0; run < 2; run++)
        for (int j = 0; j < 3; j++)
            free(grads[run][j]);
    student_case_free(&c);
}

static const tu_test tests[] = {
    {"fused vs reference: tail x k x temperature x schedule (hard, reduction cycling)", test_reference_matrix},
    {"k = 1 without the tail is exactly 0, with zero gradients", test_k1_without_tail_is_zero},
    {"a fully padded token adds 0 and is counted; ignored tokens are 0", test_padded_and_ignored_tokens},
    {"a repeated id is two support entries, as the reference", test_duplicate_ids},
    {"beta 1 accumulates; gradient filtering has no effect; bf16", test_accumulation_filtering_bf16},
    {"every token ignored: loss 0, gradients 0", test_all_ignored},
    {"workspace: the query's size works (ignored entries unread), one byte less fails", test_workspace_query},
    {"contracts: status, message, untouched outputs", test_contracts},
    {"fp32 train step, logits computed into dU chunks in dweight's memory", test_chunks_in_dweight},
    {"ignored rows at temperature 0.05, logits to +-160: finite gradients in every schedule",
     test_ignored_rows_cold_temperature},
};
const tu_suite suite_distill_topk = {tests, TU_COUNT(tests)};
