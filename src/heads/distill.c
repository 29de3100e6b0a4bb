/* Distillation head (forward KL, reverse KL, generalized JSD, plus a hard-label cross-entropy; TRL's GKD and
 * Liger's semantics, formulas in fusedhead.h): the student is the engine's linear, the teacher its pair's
 * companion, and this file's kernels fold and differentiate both rows of each tile. Per row they keep online
 * log-sum-exps of the tempered student (s) and teacher (t) logits, of the untempered student logits (u) when
 * the cross-entropy needs them apart, and the KLs' cross term; the JSD's mixture log m = log(beta q + (1 - beta) p)
 * needs both log-sum-exps first, so it folds in a second pass. With top_k (topk_support.h) the one pass keeps the
 * rows' top-k selections instead of the cross term, and each row's divergence over its support follows in finish. */
#include "counted_rows.h"
#include "distill_shared.h"
#include "topk_support.h"
#include "engine/engine.h"
#include "core/linear.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Workspace slots, [n] each. The running maxima become log-sum-exps when a row's first pass ends. */
enum {
    SLOT_S_MAX_THEN_LSE,
    SLOT_S_SUM,         /* sum exp(s - max) */
    SLOT_T_MAX_THEN_LSE,
    SLOT_T_SUM_THEN_JSD_K_SP, /* then (jsd) sum_j p_j sp_j (fh_row_jsd_sums' sums[2]) */
    SLOT_CROSS_THEN_D,  /* forward KL: sum exp(t - max) (t - s); reverse KL: sum exp(s - max) (s - t); then D */
    SLOT_U_MAX_THEN_LSE,
    SLOT_U_SUM,
    SLOT_U_TARGET,      /* u at the target */
    SLOT_JSD_K,         /* sum_j p_j log(m_j / p_j) (sums[1]): jsd's gradient term, or the one above */
    SLOT_COEF,          /* d objective / d l_i: the upstream gradient over the mean's count; 0 when ignored */
    SLOTS
};
_Static_assert(SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

FH_API fh_status fh_distill_options_init(fh_distill_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_distill_options defaults = {FH_DIVERGENCE_JSD, 0.5, 1.0, 1.0, 0.0, -100, FH_REDUCTION_MEAN, 0, 1};
    *options = defaults;
    return FH_OK;
}

typedef struct distill_head {
    const fh_distill_options *o;
    const int64_t *targets;  /* NULL: every token counts */
    fh_divergence divergence; /* jsd with beta 0 or 1 is the forward or reverse KL */
    float inv_t;
    int hard;                /* weight_hard_loss != 0: the cross-entropy's gradient */
    int separate_u;          /* targets (the cross-entropy is reported) and temperature != 1: u's statistics are
                                not s's */
    double log_beta, log_1m_beta; /* jsd: log(beta) and log(1 - beta) */
    double *const *slot;
    fh_topk_rows topk;       /* top_k < V: the rows' selections (topk.k 0: the whole vocabulary) */
} distill_head;

static int counted(const distill_head *h, int64_t i)
{
    return fh_distill_counted(h->targets, h->o->ignore_index, i);
}

static fh_distill_terms terms_of(const void *options)
{
    const fh_distill_options *o = options;
    const fh_distill_terms t = {o->temperature, o->weight_soft_loss, o->weight_hard_loss, o->ignore_index, o->reduction};
    return t;
}

/* jsd at beta 0 and 1 is the forward and the reverse KL (TRL's special cases). */
static fh_divergence effective_divergence(const fh_distill_options *o)
{
    if (o->divergence == FH_DIVERGENCE_JSD && o->beta == 0.0)
        return FH_DIVERGENCE_FORWARD_KL;
    if (o->divergence == FH_DIVERGENCE_JSD && o->beta == 1.0)
        return FH_DIVERGENCE_REVERSE_KL;
    return o->divergence;
}

/* top_k: 0 or at least V (the whole vocabulary), or a support of at most FH_DISTILL_TOPK_MAX_K columns. */
static int top_k_valid(const fh_distill_options *o, int64_t vocab)
{
    return o->top_k >= 0 && (o->top_k <= FH_DISTILL_TOPK_MAX_K || o->top_k >= vocab);
}

/* A support narrower than the vocabulary (TRL: top_k >= V is the whole vocabulary). */
static int topk_of(const fh_distill_options *o, int64_t vocab)
{
    return o->top_k > 0 && o->top_k < vocab;
}

/* Whose top-k the support takes: the teacher's (forward KL), the student's (reverse KL), both (jsd). */
static fh_topk_select select_of(const distill_head *h)
{
    return h->divergence == FH_DIVERGENCE_FORWARD_KL   ? FH_TOPK_TEACHER
           : h->divergence == FH_DIVERGENCE_REVERSE_KL ? FH_TOPK_STUDENT
                                                       : FH_TOPK_UNION;
}

static size_t head_row_bytes(const fh_distill_options *o, const fh_linear *student)
{
    if (!topk_of(o, student->vocab))
        return 0;
    return fh_topk_row_bytes(o->top_k, effective_divergence(o) == FH_DIVERGENCE_JSD ? 2 : 1);
}

static int64_t target_in(const distill_head *h, int64_t i, int64_t first_column, int64_t count)
{
    if (!h->targets || !counted(h, i))
        return -1;
    const int64_t t = h->targets[i] - first_column;
    return t >= 0 && t < count ? t : -1;
}

/* Adds a chunk's sums of exps (at the running max, raised to the chunk's first) to a row's. */
static void fold_lse(double *max, double *sum, double *cross, float chunk_max, const float *a, const float *b,
                     int64_t count, float scale)
{
    double *const running[2] = {sum, cross};
    fh_lse_raise(max, chunk_max, running, cross ? 2 : 1);
    double sums[2] = {0.0, 0.0};
    fh_row_exp_sums(a, cross ? b : NULL, count, scale, (float)*max, sums);
    *sum += sums[0];
    if (cross)
        *cross += sums[1];
}

/* Pass 0: maxima and sums of exps of s, t (and u), the KL's cross term, u at the target. */
static void fold_statistics(const distill_head *h, int64_t i, const float *z, const float *cz, int64_t count,
                            int64_t first_column)
{
    double *const *slot = h->slot;
    const float it = h->inv_t;
    float max_z, max_cz;
    fh_row_pair_max(z, cz, count, &max_z, &max_cz);
    const fh_divergence d = h->divergence;
    double *cross = h->topk.k ? NULL : &slot[SLOT_CROSS_THEN_D][i];
    /* inv_t > 0: the largest of inv_t z is inv_t times the largest z */
    fold_lse(&slot[SLOT_S_MAX_THEN_LSE][i], &slot[SLOT_S_SUM][i], d == FH_DIVERGENCE_REVERSE_KL ? cross : NULL,
             it * max_z, z, cz, count, it);
    fold_lse(&slot[SLOT_T_MAX_THEN_LSE][i], &slot[SLOT_T_SUM_THEN_JSD_K_SP][i], d == FH_DIVERGENCE_FORWARD_KL ? cross : NULL,
             it * max_cz, cz, z, count, it);
    if (h->topk.k)
        fh_topk_rows_fold(&h->topk, i, z, cz, count, first_column);
    if (h->separate_u)
        fold_lse(&slot[SLOT_U_MAX_THEN_LSE][i], &slot[SLOT_U_SUM][i], NULL, max_z, z, NULL, count, 1.0f);
    const int64_t t = target_in(h, i, first_column, count);
    if (t >= 0)
        slot[SLOT_U_TARGET][i] = z[t];
}

/* Row i's constants once its first pass is finished. */
static fh_pair_row row_of(const distill_head *h, int64_t i)
{
    double *const *slot = h->slot;
    static const fh_pair_divergence kinds[] = {FH_PAIR_FORWARD_KL, FH_PAIR_REVERSE_KL, FH_PAIR_JSD};
    const double coef = slot[SLOT_COEF][i];
    /* jsd's gradient takes the term whose sum is nearer 0 (fh_row_pair_gradient); set once the second pass is done */
    const int k_of_softplus = h->divergence == FH_DIVERGENCE_JSD &&
                              fabs(slot[SLOT_T_SUM_THEN_JSD_K_SP][i]) < fabs(slot[SLOT_JSD_K][i]);
    const fh_pair_row r = {.divergence = kinds[h->divergence],
                           .inv_t = h->inv_t,
                           .beta = (float)h->o->beta,
                           .log_odds = (float)(h->log_beta - h->log_1m_beta),
                           .log_beta = (float)h->log_beta,
                           .log_1m_beta = (float)h->log_1m_beta,
                           .lse_s = (float)slot[SLOT_S_MAX_THEN_LSE][i],
                           .lse_t = (float)slot[SLOT_T_MAX_THEN_LSE][i],
                           .lse_u = (float)slot[SLOT_U_MAX_THEN_LSE][i],
                           .lse_t_minus_s = (float)(slot[SLOT_T_MAX_THEN_LSE][i] - slot[SLOT_S_MAX_THEN_LSE][i]),
                           .d = (float)slot[SLOT_CROSS_THEN_D][i],
                           .k = (float)slot[k_of_softplus ? SLOT_T_SUM_THEN_JSD_K_SP : SLOT_JSD_K][i],
                           .g_soft = (float)(coef * h->o->weight_soft_loss),
                           .g_hard = (float)(coef * h->o->weight_hard_loss),
                           .k_of_softplus = k_of_softplus};
    return r;
}

static void fold(const void *self, int pass, int64_t i, const float *z, const float *cz, int64_t count,
                 int64_t first_column)
{
    const distill_head *h = self;
    if (pass == 0) {
        fold_statistics(h, i, z, cz, count, first_column);
        return;
    }
    /* Pass 1 (jsd): D and K over the row, from its final log-sum-exps. */
    const fh_pair_row r = row_of(h, i);
    double sums[3] = {0.0, 0.0, 0.0};
    fh_row_jsd_sums(z, cz, count, &r, sums);
    h->slot[SLOT_CROSS_THEN_D][i] += sums[0];
    h->slot[SLOT_JSD_K][i] += sums[1];
    h->slot[SLOT_T_SUM_THEN_JSD_K_SP][i] += sums[2];
}

static void finish(const void *self, int pass, int64_t i)
{
    const distill_head *h = self;
    double *const *slot = h->slot;
    if (pass != 0)
        return;
    const double lse_s = slot[SLOT_S_MAX_THEN_LSE][i] + log(slot[SLOT_S_SUM][i]);
    const double lse_t = slot[SLOT_T_MAX_THEN_LSE][i] + log(slot[SLOT_T_SUM_THEN_JSD_K_SP][i]);
    slot[SLOT_S_MAX_THEN_LSE][i] = lse_s;
    slot[SLOT_T_MAX_THEN_LSE][i] = lse_t;
    double *d = &slot[SLOT_CROSS_THEN_D][i];
    if (h->topk.k) /* D over the row's support, and the gradient's dense coefficient in SLOT_JSD_K */
        *d = fh_topk_rows_finish(&h->topk, i, lse_s, lse_t, &slot[SLOT_JSD_K][i]);
    else if (h->divergence == FH_DIVERGENCE_FORWARD_KL) /* sum q (t - s) - lse_t + lse_s */
        *d = *d / slot[SLOT_T_SUM_THEN_JSD_K_SP][i] - lse_t + lse_s;
    else if (h->divergence == FH_DIVERGENCE_REVERSE_KL)
        *d = *d / slot[SLOT_S_SUM][i] - lse_s + lse_t;
    else { /* the second pass sums D and both gradient terms (fh_row_jsd_sums) */
        *d = 0.0;
        slot[SLOT_JSD_K][i] = slot[SLOT_T_SUM_THEN_JSD_K_SP][i] = 0.0;
    }
    if (h->separate_u)
        slot[SLOT_U_MAX_THEN_LSE][i] += log(slot[SLOT_U_SUM][i]);
    else
        slot[SLOT_U_MAX_THEN_LSE][i] = lse_s; /* temperature 1 (or no targets): u is s */
}

/* dU of row i: coef (weight_soft dD/ds / T + weight_hard (softmax(u) - onehot)); 0 for an ignored row. */
static void gradient(const void *self, int64_t i, float *z, const float *cz, int64_t count, int64_t first_column)
{
    const distill_head *h = self;
    if (h->slot[SLOT_COEF][i] == 0.0) {
        memset(z, 0, (size_t)count * sizeof(float));
        return;
    }
    const fh_pair_row r = row_of(h, i);
    if (h->topk.k) {
        /* a p (the tail's dense part) and the cross-entropy's softmax, then the support's terms */
        const double a = h->slot[SLOT_JSD_K][i];
        const fh_softmax_pair sp = {h->inv_t, r.lse_s, (float)((double)r.g_soft * a * h->inv_t), r.lse_u,
                                    h->hard ? r.g_hard : 0.0f};
        if (sp.a != 0.0f || sp.b != 0.0f)
            fh_row_softmax_pair(z, count, &sp);
        else
            memset(z, 0, (size_t)count * sizeof(float));
        fh_topk_rows_scatter(&h->topk, i, r.g_soft * h->inv_t, z, count, first_column);
    } else {
        fh_row_pair_gradient(z, cz, count, &r);
    }
    const int64_t t = target_in(h, i, first_column, count);
    if (h->hard && t >= 0)
        z[t] -= r.g_hard;
}

static fh_status check_options(fh_context *ctx, const fh_linear *student, const int64_t *targets,
                               const fh_distill_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if ((unsigned)o->divergence > FH_DIVERGENCE_JSD)
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION,
                       "divergence = %d is not forward_kl (0), reverse_kl (1) or jsd (2)", (int)o->divergence);
    if (!(o->beta >= 0.0 && o->beta <= 1.0))
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION, "beta = %g is outside [0, 1]", o->beta);
    if (!top_k_valid(o, student->vocab))
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION,
                       "top_k = %lld is neither in [0, %d] nor >= V = %lld (0 and >= V: the whole vocabulary)",
                       (long long)o->top_k, FH_DISTILL_TOPK_MAX_K, (long long)student->vocab);
    if (o->add_tail != 0 && o->add_tail != 1)
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION, "add_tail = %d is not 0 or 1", o->add_tail);
    const fh_distill_terms t = terms_of(o);
    return fh_distill_check_terms(ctx, student, targets, &t);
}

static fh_status check_pair_shapes(fh_context *ctx, const fh_linear *student, const fh_linear *teacher)
{
    if (teacher->n != student->n || teacher->vocab != student->vocab)
        return fh_fail(ctx, FH_ERR_TEACHER_MISMATCH,
                       "the teacher has n = %lld and V = %lld, the student n = %lld and V = %lld", (long long)teacher->n,
                       (long long)teacher->vocab, (long long)student->n, (long long)student->vocab);
    return FH_OK;
}

/* The teacher's own checks, its failures named as the teacher's; the pair's shapes before scanning its values. */
static fh_status check_teacher(fh_context *ctx, const fh_linear *student, const fh_linear *teacher)
{
    if (!teacher)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "teacher is NULL");
    fh_status st = fh_check_linear(ctx, teacher);
    if (st == FH_OK && (st = check_pair_shapes(ctx, student, teacher)) != FH_OK)
        return st;
    if (st == FH_OK)
        st = fh_check_finite(ctx, teacher);
    if (st != FH_OK) {
        const char *message = "";
        char copy[256];
        (void)fh_context_message(ctx, &message);
        snprintf(copy, sizeof copy, "%s", message);
        return fh_fail(ctx, st, "teacher: %s", copy);
    }
    return FH_OK;
}

static fh_status check(fh_context *ctx, const fh_distill_call *c)
{
    const fh_status st = check_teacher(ctx, c->student, c->teacher);
    return st == FH_OK ? check_options(ctx, c->student, c->targets, c->options) : st;
}

/* The teacher's x, weight and bias. */
static int teacher_buffers(const fh_distill_call *c, fh_buffer *b)
{
    const fh_linear *teacher = c->teacher;
    b[0] = fh_view_buffer("the teacher's x", teacher->x, teacher->n, teacher->hidden, teacher->x_row_stride, 1,
                          teacher->x_dtype);
    b[1] = fh_view_buffer("the teacher's weight", teacher->weight, teacher->hidden, teacher->vocab,
                          teacher->w_stride_hidden, teacher->w_stride_vocab, teacher->weight_dtype);
    b[2] = fh_view_buffer("the teacher's bias", teacher->bias, 1, teacher->vocab, 0, 1, FH_DTYPE_F32);
    return 3;
}

/* The head over the workspace's slots, every row's running state at its start, and (grad_output not NULL) every
 * row's coefficient. */
static distill_head head_of(const fh_workspace *ws, const fh_linear *student, const int64_t *targets,
                            const fh_distill_options *o, const float *grad_output)
{
    distill_head h = {o, targets, effective_divergence(o), (float)(1.0 / o->temperature),
                      o->weight_hard_loss != 0.0, 0, 0.0, 0.0, ws->slot, {0}};
    h.separate_u = targets && h.inv_t != 1.0f;
    h.log_beta = log(o->beta);
    h.log_1m_beta = log1p(-o->beta);
    for (int64_t i = 0; i < student->n; i++) {
        for (int s = 0; s < SLOTS; s++)
            ws->slot[s][i] = 0.0;
        ws->slot[SLOT_S_MAX_THEN_LSE][i] = ws->slot[SLOT_T_MAX_THEN_LSE][i] = ws->slot[SLOT_U_MAX_THEN_LSE][i] =
            -INFINITY;
    }
    if (topk_of(o, student->vocab))
        h.topk = fh_topk_rows_begin(ws->head_rows, student->n, o->top_k, select_of(&h), (int)o->add_tail, o->beta,
                                    h.inv_t);
    const fh_distill_terms t = terms_of(o);
    if (grad_output)
        fh_distill_coefficients(student->n, targets, &t, grad_output, ws->slot[SLOT_COEF]);
    return h;
}

static void write_outputs(const distill_head *h, int64_t n, fh_distill_outputs *out)
{
    const fh_distill_terms t = terms_of(h->o);
    fh_distill_write_outputs(n, h->targets, &t, h->slot[SLOT_CROSS_THEN_D], h->slot[SLOT_U_MAX_THEN_LSE],
                             h->slot[SLOT_U_TARGET], out);
}

static fh_pair_kernels kernels_of(const distill_head *h, const fh_linear *teacher)
{
    const int passes = h->divergence == FH_DIVERGENCE_JSD && !h->topk.k ? 2 : 1;
    const fh_pair_kernels k = {teacher, passes, fold, finish, gradient, h};
    return k;
}

static fh_status forward(fh_context *ctx, const fh_distill_call *c)
{
    fh_plan plans[2];
    fh_workspace ws;
    fh_status st = fh_plan_pair_streaming(ctx, c->student, c->teacher, head_row_bytes(c->options, c->student),
                                          plans, ctx);
    if (st == FH_OK)
        st = fh_workspace_acquire(ctx, c->student->n, plans, 1, &ws);
    if (st != FH_OK)
        return st;
    const distill_head h = head_of(&ws, c->student, c->targets, c->options, NULL);
    const fh_pair_kernels kernels = kernels_of(&h, c->teacher);
    const fh_engine_pass pass = fh_distill_pass(&plans[0], &ws, c->student, &kernels);
    st = fh_engine_forward(&pass);
    if (st == FH_OK)
        write_outputs(&h, c->student->n, c->out);
    return fh_gemm_failure(ctx, st);
}

static fh_status step_run(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                          const fh_linear_grads *grads)
{
    const fh_distill_call *c = self;
    const distill_head h = head_of(&ws[0], c->student, c->targets, c->options, c->grad_output);
    const fh_pair_kernels kernels = kernels_of(&h, c->teacher);
    fh_engine_pass pass = fh_distill_pass(&plans[0], &ws[0], c->student, &kernels);
    pass.grads = grads;
    fh_status st;
    if (row_blocks)
        st = fh_engine_row_blocks(&pass);
    else {
        /* Streaming: every forward pass, then the backward recomputing both tiles (the pass holds grads, so the
         * forward prepares the backward's GEMMs too). */
        st = fh_engine_forward(&pass);
        if (st == FH_OK)
            st = fh_engine_backward(&pass);
    }
    if (st == FH_OK)
        write_outputs(&h, c->student->n, c->out);
    return st;
}

static fh_status run(fh_context *ctx, const fh_distill_call *c)
{
    if (!c->grads)
        return forward(ctx, c);
    const fh_train_step_head head = {.group_rows = 1,
                                     .companion = c->teacher,
                                     .head_row_bytes = head_row_bytes(c->options, c->student),
                                     .run = step_run,
                                     .self = c};
    return fh_engine_train_step(ctx, c->student, c->grads, &head);
}

/* On the counted rows, the teacher's too. */
static fh_status run_counted(fh_context *ctx, const fh_distill_call *counted, const fh_counted_rows *rows,
                             void *teacher_rows)
{
    const fh_linear teacher = fh_counted_rows_linear(rows, counted->teacher, teacher_rows);
    fh_distill_call c = *counted;
    c.teacher = &teacher;
    return run(ctx, &c);
}

static size_t teacher_row_bytes(const void *teacher)
{
    return fh_counted_rows_x_row_bytes(teacher);
}

static const fh_distill_kind kind = {check, terms_of, teacher_buffers, teacher_row_bytes, run, run_counted};

FH_API fh_status fh_distill_forward(fh_context *ctx, const fh_linear *student, const fh_linear *teacher,
                                    const int64_t *targets, const fh_distill_options *options,
                                    fh_distill_outputs *out)
{
    const fh_distill_call c = {student, teacher, targets, options, NULL, out, NULL};
    return fh_distill_entry(ctx, &kind, &c, 0);
}

FH_API fh_status fh_distill_forward_backward(fh_context *ctx, const fh_linear *student, const fh_linear *teacher,
                                             const int64_t *targets, const fh_distill_options *options,
                                             const float *grad_output, fh_distill_outputs *out,
                                             fh_linear_grads *grads)
{
    const fh_distill_call c = {student, teacher, targets, options, grad_output, out, grads};
    return fh_distill_entry(ctx, &kind, &c, 1);
}

FH_API fh_status fh_distill_workspace_size(const fh_context *ctx, const fh_linear *student,
                                           const fh_linear *teacher, const fh_distill_options *options,
                                           size_t *bytes)
{
    if (!ctx || !bytes || !teacher || !options)
        return FH_ERR_NULL_POINTER;
    fh_status st = fh_check_linear(NULL, student);
    if (st == FH_OK)
        st = fh_check_linear(NULL, teacher);
    if (st == FH_OK)
        st = check_pair_shapes(NULL, student, teacher);
    if (st == FH_OK && !top_k_valid(options, student->vocab))
        st = FH_ERR_INVALID_DISTILL_OPTION;
    return st == FH_OK ? fh_plan_pair_query_bytes(ctx, student, teacher, head_row_bytes(options, student), bytes)
                       : st;
}
