/* Top-k teacher distillation (formulas in fusedhead.h; TRL's server-distillation forward KL at f2cd5771): the
 * teacher is k ids and log-probs per token, the student the engine's linear, run through this file's own pair kernels
 * with no companion. Per row the fold keeps online log-sum-exps of the tempered student logits s over the vocabulary,
 * of s over the teacher's valid ids (B), of the untempered u when the cross-entropy needs them apart, the cross term
 * sum_k qt_k s[id_k] and u at the target; the teacher's side is O(k) from its log-probs alone. dU is dense only
 * through the tail (a p) and the cross-entropy (softmax(u)); the support's part is scattered into the teacher's ids,
 * so that a row costs O(V + k). */
#include "counted_rows.h"
#include "distill_shared.h"
#include "engine/engine.h"
#include "core/linear.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Workspace slots, [n] each. The running maxima become log-sum-exps when a row's pass ends; the sums of exps, no
 * longer needed then, hold the gradient's row constants. */
enum {
    SLOT_S_MAX_THEN_LSE,
    SLOT_S_SUM_THEN_A,   /* sum exp(s - max), then the dense coefficient a (gradient) */
    SLOT_B_MAX_THEN_LSE, /* B = logsumexp of s over the valid ids */
    SLOT_B_SUM_THEN_M,   /* then the support terms' m (gradient) */
    SLOT_CROSS_THEN_D,   /* sum_k qt_k s[id_k] over the valid entries, then D */
    SLOT_U_MAX_THEN_LSE,
    SLOT_U_SUM,
    SLOT_U_TARGET,
    SLOT_SHIFT,          /* teacher_row's shift, set before the passes: qt_k = exp(a_k - shift) without another scan */
    SLOT_COEF,           /* d objective / d l_i: the upstream gradient over the mean's count; 0 when ignored */
    SLOTS
};
_Static_assert(SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

/* TRL's _add_tail_bucket clamps logsumexp(top-k) to at most -1e-7, so that 1 - exp(.) stays positive in fp32. */
static const double TAIL_CLAMP = -1e-7;

FH_API fh_status fh_distill_topk_options_init(fh_distill_topk_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_distill_topk_options defaults = {1, 1.0, 1.0, 0.0, -100, FH_REDUCTION_MEAN};
    *options = defaults;
    return FH_OK;
}

typedef struct topk_head {
    const fh_distill_topk_options *o;
    const fh_topk_teacher *teacher;
    const int64_t *targets; /* NULL: every token counts */
    float inv_t;
    int hard;               /* weight_hard_loss != 0 */
    int separate_u;         /* targets and temperature != 1: u's log-sum-exp is not s's */
    double *const *slot;
} topk_head;

static fh_distill_terms terms_of(const void *options)
{
    const fh_distill_topk_options *o = options;
    const fh_distill_terms t = {o->temperature, o->weight_soft_loss, o->weight_hard_loss, o->ignore_index, o->reduction};
    return t;
}

/* The teacher's side of row i: xt_k = a_k - shift and qt_k = exp(xt_k) for its valid entries, and with the tail
 * its extra entry. */
typedef struct teacher_row {
    int64_t valid;         /* entries with a log-prob > -inf */
    double shift;          /* logsumexp of the valid a without the tail (renormalised), 0 with it */
    double mass;           /* sum_k qt_k */
    double sum_qx;         /* sum_k qt_k xt_k, plus the tail's term */
    double q_tail, x_tail; /* with the tail: its qt and xt (1 and 0 when nothing is valid) */
} teacher_row;

static teacher_row teacher_of(const topk_head *h, int64_t i)
{
    const int64_t k = h->teacher->k;
    const float *a = h->teacher->logprobs + i * k;
    teacher_row r = {0, 0.0, 0.0, 0.0, 0.0, 0.0};
    double max = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < k; e++)
        max = a[e] > max ? a[e] : max;
    for (int64_t e = 0; e < k; e++)
        if (a[e] > -INFINITY) {
            sum += exp(a[e] - max);
            r.valid++;
        }
    const double lse = r.valid ? max + log(sum) : -INFINITY;
    r.shift = h->o->add_tail ? 0.0 : lse;
    for (int64_t e = 0; e < k; e++)
        if (a[e] > -INFINITY) {
            const double x = a[e] - r.shift, q = exp(x);
            r.mass += q;
            r.sum_qx += q * x;
        }
    if (h->o->add_tail) {
        r.q_tail = -expm1(fmin(lse, TAIL_CLAMP));
        r.x_tail = log(r.q_tail);
        r.sum_qx += r.q_tail * r.x_tail;
    }
    return r;
}

/* Adds a chunk's sum of exps (at the running max, raised to the chunk's first) to a row's. */
static void fold_lse(double *max, double *sum, float chunk_max, const float *z, int64_t count, float scale)
{
    double *const running[1] = {sum};
    fh_lse_raise(max, chunk_max, running, 1);
    double sums[2] = {0.0, 0.0};
    fh_row_exp_sums(z, NULL, count, scale, (float)*max, sums);
    *sum += sums[0];
}

/* The valid entry e's column within columns first .. first + count - 1, or -1. */
static int64_t entry_column(const topk_head *h, int64_t i, int64_t e, int64_t first, int64_t count)
{
    const int64_t k = h->teacher->k;
    if (!(h->teacher->logprobs[i * k + e] > -INFINITY))
        return -1;
    const int64_t c = h->teacher->ids[i * k + e] - first;
    return c >= 0 && c < count ? c : -1;
}

/* s at a column of the row, as the gradient kernel forms it (inv_t times the fp32 logit). */
static double tempered(const topk_head *h, const float *z, int64_t c)
{
    return (double)(h->inv_t * z[c]);
}

/* The one forward pass: s's and u's log-sum-exps, the support's (B) and cross term, u at the target. z is u, cz
 * NULL (no companion). */
static void fold(const void *self, int pass, int64_t i, const float *z, const float *cz, int64_t count,
                 int64_t first_column)
{
    (void)pass;
    (void)cz;
    const topk_head *h = self;
    double *const *slot = h->slot;
    float max_z, unused;
    fh_row_pair_max(z, z, count, &max_z, &unused);
    /* inv_t > 0: the largest of inv_t z is inv_t times the largest z */
    fold_lse(&slot[SLOT_S_MAX_THEN_LSE][i], &slot[SLOT_S_SUM_THEN_A][i], h->inv_t * max_z, z, count, h->inv_t);
    if (h->separate_u)
        fold_lse(&slot[SLOT_U_MAX_THEN_LSE][i], &slot[SLOT_U_SUM][i], max_z, z, count, 1.0f);
    if (h->targets && fh_distill_counted(h->targets, h->o->ignore_index, i)) {
        const int64_t t = h->targets[i] - first_column;
        if (t >= 0 && t < count)
            slot[SLOT_U_TARGET][i] = z[t];
    }
    const int64_t k = h->teacher->k;
    for (int64_t e = 0; e < k; e++) {
        const int64_t c = entry_column(h, i, e, first_column, count);
        if (c < 0)
            continue;
        const double s = tempered(h, z, c);
        double *const b_sum[1] = {&slot[SLOT_B_SUM_THEN_M][i]};
        fh_lse_raise(&slot[SLOT_B_MAX_THEN_LSE][i], s, b_sum, 1);
        slot[SLOT_B_SUM_THEN_M][i] += exp(s - slot[SLOT_B_MAX_THEN_LSE][i]);
        slot[SLOT_CROSS_THEN_D][i] += exp(h->teacher->logprobs[i * k + e] - slot[SLOT_SHIFT][i]) * s;
    }
}

/* Row i's log-sum-exps, D and the gradient's row constants once every column is folded:
 *   D = sum_k qt_k (xt_k - xs_k) (+ tail) = sum qt xt - sum_k qt_k s_k + Q c (- qt_tail xs_tail), with xs_k = s_k - c,
 *   c = B without the tail, lse_s with it;
 *   dD/ds_j = a p_j + sum_k G_k [j = id_k],  G_k = -qt_k + m pi_k,  pi_k = exp(s_k - B),
 *   without the tail: a = 0, m = Q;  with it, through L = B - lse_s (constant where TRL's clamp holds it):
 *   c = dxs_tail/dL = -exp(L) / (1 - exp(L)) for L <= -1e-7 (else 0), a = Q + qt_tail c, m = -qt_tail c. */
static void finish(const void *self, int pass, int64_t i)
{
    (void)pass;
    const topk_head *h = self;
    double *const *slot = h->slot;
    const double lse_s = slot[SLOT_S_MAX_THEN_LSE][i] + log(slot[SLOT_S_SUM_THEN_A][i]);
    const double b_sum = slot[SLOT_B_SUM_THEN_M][i];
    const double b = b_sum > 0.0 ? slot[SLOT_B_MAX_THEN_LSE][i] + log(b_sum) : -INFINITY;
    slot[SLOT_S_MAX_THEN_LSE][i] = lse_s;
    slot[SLOT_B_MAX_THEN_LSE][i] = b;
    const teacher_row tr = teacher_of(h, i);
    double *d = &slot[SLOT_CROSS_THEN_D][i];
    if (tr.valid == 0)
        *d = 0.0; /* no support: TRL's masked entries (and a tail of 1 on both sides) give 0 */
    else if (!h->o->add_tail)
        *d = tr.sum_qx - *d + tr.mass * b;
    else
        *d = tr.sum_qx - *d + tr.mass * lse_s - tr.q_tail * log(-expm1(fmin(b - lse_s, TAIL_CLAMP)));
    double a = 0.0, m = tr.mass;
    if (h->o->add_tail) {
        const double l = b - lse_s, c = tr.valid && l <= TAIL_CLAMP ? -exp(l) / -expm1(l) : 0.0;
        a = tr.mass + tr.q_tail * c;
        m = -tr.q_tail * c;
    }
    slot[SLOT_S_SUM_THEN_A][i] = a;
    slot[SLOT_B_SUM_THEN_M][i] = m;
    if (h->separate_u)
        slot[SLOT_U_MAX_THEN_LSE][i] += log(slot[SLOT_U_SUM][i]);
    else
        slot[SLOT_U_MAX_THEN_LSE][i] = lse_s; /* temperature 1 (or no targets): u is s */
}

/* dU of row i (columns first_column ..): coef (weight_soft dD/ds / T + weight_hard (softmax(u) - onehot)), dD/ds
 * from the row constants of finish. */
static void gradient(const void *self, int64_t i, float *z, const float *cz, int64_t count, int64_t first_column)
{
    (void)cz;
    const topk_head *h = self;
    double *const *slot = h->slot;
    const double coef = slot[SLOT_COEF][i];
    if (coef == 0.0) {
        memset(z, 0, (size_t)count * sizeof(float));
        return;
    }
    const double lse_s = slot[SLOT_S_MAX_THEN_LSE][i], b = slot[SLOT_B_MAX_THEN_LSE][i];
    const double a = slot[SLOT_S_SUM_THEN_A][i], m = slot[SLOT_B_SUM_THEN_M][i], shift = slot[SLOT_SHIFT][i];
    /* The support's terms from s before the dense part overwrites the row. */
    const int64_t k = h->teacher->k;
    float support[FH_DISTILL_TOPK_MAX_K];
    for (int64_t e = 0; e < k; e++) {
        const int64_t c = entry_column(h, i, e, first_column, count);
        if (c >= 0)
            support[e] = (float)(-exp(h->teacher->logprobs[i * k + e] - shift) + m * exp(tempered(h, z, c) - b));
    }
    const double g_soft = coef * h->o->weight_soft_loss, g_hard = h->hard ? coef * h->o->weight_hard_loss : 0.0;
    if (a != 0.0 || g_hard != 0.0) {
        /* g_soft a inv_t p + g_hard softmax(u) */
        const fh_softmax_pair r = {h->inv_t, (float)lse_s, (float)(g_soft * a * h->inv_t),
                                   (float)slot[SLOT_U_MAX_THEN_LSE][i], (float)g_hard};
        fh_row_softmax_pair(z, count, &r);
    } else {
        memset(z, 0, (size_t)count * sizeof(float));
    }
    const float scale = (float)(g_soft * h->inv_t);
    for (int64_t e = 0; e < k; e++) {
        const int64_t c = entry_column(h, i, e, first_column, count);
        if (c >= 0)
            z[c] += scale * support[e];
    }
    if (g_hard != 0.0 && h->targets) {
        const int64_t t = h->targets[i] - first_column;
        if (t >= 0 && t < count)
            z[t] -= (float)g_hard;
    }
}

static fh_status check_options(fh_context *ctx, const fh_linear *student, const int64_t *targets,
                               const fh_distill_topk_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if (o->add_tail != 0 && o->add_tail != 1)
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION, "add_tail = %d is not 0 or 1", o->add_tail);
    const fh_distill_terms t = terms_of(o);
    return fh_distill_check_terms(ctx, student, targets, &t);
}

/* The teacher's entries of the counted tokens (an ignored token's are never read). */
static fh_status check_teacher(fh_context *ctx, const fh_linear *student, const fh_topk_teacher *t,
                               const int64_t *targets, const fh_distill_topk_options *o)
{
    if (!t || !t->ids || !t->logprobs)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the teacher, its ids or its logprobs are NULL");
    if (t->k < 1 || t->k > FH_DISTILL_TOPK_MAX_K)
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION, "the teacher's k = %lld is outside [1, %d]",
                       (long long)t->k, FH_DISTILL_TOPK_MAX_K);
    /* Its [n, k] arrays' bytes (8 per id), before any entry is read or the overlap check sizes them. */
    int64_t entries;
    if (__builtin_mul_overflow(student->n, t->k, &entries) || entries > PTRDIFF_MAX / (int64_t)sizeof(int64_t))
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "the teacher's [n, k] = [%lld, %lld] arrays' bytes overflow 64 bits",
                       (long long)student->n, (long long)t->k);
    for (int64_t i = 0; i < student->n; i++) {
        if (targets && targets[i] == o->ignore_index)
            continue;
        for (int64_t e = 0; e < t->k; e++) {
            const float a = t->logprobs[i * t->k + e];
            const int64_t id = t->ids[i * t->k + e];
            if (isnan(a) || a == INFINITY)
                return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION,
                               "the teacher's logprobs[%lld][%lld] = %g is neither finite nor -inf (padding)",
                               (long long)i, (long long)e, (double)a);
            if (a > -INFINITY && (id < 0 || id >= student->vocab))
                return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                               "the teacher's ids[%lld][%lld] = %lld is outside [0, %lld)", (long long)i,
                               (long long)e, (long long)id, (long long)student->vocab);
        }
    }
    return FH_OK;
}

static fh_status check(fh_context *ctx, const fh_distill_call *c)
{
    const fh_status st = check_options(ctx, c->student, c->targets, c->options);
    return st == FH_OK ? check_teacher(ctx, c->student, c->teacher, c->targets, c->options) : st;
}

/* The teacher's ids and log-probs. */
static int teacher_buffers(const fh_distill_call *c, fh_buffer *b)
{
    const fh_topk_teacher *teacher = c->teacher;
    const size_t entries = (size_t)c->student->n * (size_t)teacher->k;
    b[0] = (fh_buffer){"the teacher's ids", teacher->ids, entries * sizeof(int64_t)};
    b[1] = (fh_buffer){"the teacher's logprobs", teacher->logprobs, entries * sizeof(float)};
    return 2;
}

/* The head over the workspace's slots, every row's running state at its start, and (grad_output not NULL) every
 * row's coefficient. */
static topk_head head_of(const fh_workspace *ws, const fh_linear *student, const fh_topk_teacher *teacher,
                         const int64_t *targets, const fh_distill_topk_options *o, const float *grad_output)
{
    topk_head h = {o, teacher, targets, (float)(1.0 / o->temperature), o->weight_hard_loss != 0.0, 0, ws->slot};
    h.separate_u = targets && h.inv_t != 1.0f;
    for (int64_t i = 0; i < student->n; i++) {
        for (int s = 0; s < SLOTS; s++)
            ws->slot[s][i] = 0.0;
        ws->slot[SLOT_S_MAX_THEN_LSE][i] = ws->slot[SLOT_B_MAX_THEN_LSE][i] = ws->slot[SLOT_U_MAX_THEN_LSE][i] =
            -INFINITY;
        ws->slot[SLOT_SHIFT][i] = teacher_of(&h, i).shift;
    }
    const fh_distill_terms t = terms_of(o);
    if (grad_output)
        fh_distill_coefficients(student->n, targets, &t, grad_output, ws->slot[SLOT_COEF]);
    return h;
}

static void write_outputs(const topk_head *h, int64_t n, fh_distill_outputs *out)
{
    const fh_distill_terms t = terms_of(h->o);
    fh_distill_write_outputs(n, h->targets, &t, h->slot[SLOT_CROSS_THEN_D], h->slot[SLOT_U_MAX_THEN_LSE],
                             h->slot[SLOT_U_TARGET], out);
}

static fh_status forward(fh_context *ctx, const fh_distill_call *c)
{
    fh_plan plans[2];
    fh_workspace ws;
    fh_status st = fh_plan_pair_streaming(ctx, c->student, NULL, 0, plans, ctx);
    if (st == FH_OK)
        st = fh_workspace_acquire(ctx, c->student->n, plans, 1, &ws);
    if (st != FH_OK)
        return st;
    const topk_head h = head_of(&ws, c->student, c->teacher, c->targets, c->options, NULL);
    const fh_pair_kernels kernels = {NULL, 1, fold, finish, gradient, &h};
    const fh_engine_pass pass = fh_distill_pass(&plans[0], &ws, c->student, &kernels);
    st = fh_engine_forward(&pass);
    if (st == FH_OK)
        write_outputs(&h, c->student->n, c->out);
    return fh_gemm_failure(ctx, st);
}

/* The train step on the pair plan without a companion: row blocks, or the streaming fallback (the forward, then the
 * backward recomputing the tiles; the pass holds grads, so the forward prepares the backward's GEMMs too). */
static fh_status train_step(fh_context *ctx, const fh_distill_call *c)
{
    fh_plan plan;
    fh_workspace ws;
    int row_blocks = 0;
    fh_status st = fh_plan_pair_train_step(ctx, c->student, NULL, 0, c->grads, &plan, &row_blocks, ctx);
    if (st == FH_OK)
        st = fh_workspace_acquire(ctx, c->student->n, &plan, 1, &ws);
    if (st != FH_OK)
        return st;
    const topk_head h = head_of(&ws, c->student, c->teacher, c->targets, c->options, c->grad_output);
    const fh_pair_kernels kernels = {NULL, 1, fold, finish, gradient, &h};
    fh_engine_pass pass = fh_distill_pass(&plan, &ws, c->student, &kernels);
    pass.grads = c->grads;
    if (row_blocks)
        st = fh_engine_row_blocks(&pass);
    else if ((st = fh_engine_forward(&pass)) == FH_OK)
        st = fh_engine_backward(&pass);
    if (st == FH_OK)
        write_outputs(&h, c->student->n, c->out);
    return fh_gemm_failure(ctx, st);
}

static fh_status run(fh_context *ctx, const fh_distill_call *c)
{
    return c->grads ? train_step(ctx, c) : forward(ctx, c);
}

/* On the counted rows, with the teacher's k ids and log-probs of each. */
static fh_status run_counted(fh_context *ctx, const fh_distill_call *counted, const fh_counted_rows *rows,
                             void *teacher_rows)
{
    const fh_topk_teacher *all = counted->teacher;
    const size_t k = (size_t)all->k;
    int64_t *ids = teacher_rows;
    float *logprobs = (float *)(ids + (size_t)rows->count * k);
    fh_counted_rows_gather(rows, all->ids, k * sizeof(int64_t), ids);
    fh_counted_rows_gather(rows, all->logprobs, k * sizeof(float), logprobs);
    const fh_topk_teacher teacher = {all->k, ids, logprobs};
    fh_distill_call c = *counted;
    c.teacher = &teacher;
    return run(ctx, &c);
}

static size_t teacher_row_bytes(const void *teacher)
{
    return (size_t)((const fh_topk_teacher *)teacher)->k * (sizeof(int64_t) + sizeof(float));
}

static const fh_distill_kind kind = {check, terms_of, teacher_buffers, teacher_row_bytes, run, run_counted};

FH_API fh_status fh_distill_topk_forward(fh_context *ctx, const fh_linear *student, const fh_topk_teacher *teacher,
                                         const int64_t *targets, const fh_distill_topk_options *options,
                                         fh_distill_outputs *out)
{
    const fh_distill_call c = {student, teacher, targets, options, NULL, out, NULL};
    return fh_distill_entry(ctx, &kind, &c, 0);
}

FH_API fh_status fh_distill_topk_forward_backward(fh_context *ctx, const fh_linear *student,
                                                  const fh_topk_teacher *teacher, const int64_t *targets,
                                                  const fh_distill_topk_options *options, const float *grad_output,
                                                  fh_distill_outputs *out, fh_linear_grads *grads)
{
    const fh_distill_call c = {student, teacher, targets, options, grad_output, out, grads};
    return fh_distill_entry(ctx, &kind, &c, 1);
}

FH_API fh_status fh_distill_topk_workspace_size(const fh_context *ctx, const fh_linear *student, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    const fh_status st = fh_check_linear(NULL, student);
    return st == FH_OK ? fh_plan_pair_query_bytes(ctx, student, NULL, 0, bytes) : st;
}
