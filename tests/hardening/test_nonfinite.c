/* NaN and Inf in the inputs. What is affected, exactly (and everything else is bitwise what a run
 * without the non-finite value gives):
 *   x[i][k] NaN, token i not ignored:   token i's per_token_loss, logp and lse are NaN, so is the reduced
 *       loss; dx row i is NaN; dweight and dbias are NaN everywhere (every column of dZ row i is NaN and
 *       dweight = X^T dZ mixes it into every element, x[i][k'] = 0 included since 0 * NaN = NaN). Other
 *       tokens' per-token outputs, argmax and dx rows are unchanged, bit for bit.
 *   x[i][k] NaN, token i ignored:       the loss is unchanged (ignored tokens are skipped, not multiplied by
 *       0); per_token_loss[i] = logp[i] = 0, lse[i] NaN. A call that runs its GEMMs on the rows that count only
 *       (the split backward here; docs/losses.md, "Rows that count") never reads row i: dx row i is 0 and dweight and
 *       dbias are bitwise the clean run's. A call that computes every row (the train step asked for the lse
 *       output) gives the row dZ exactly 0 (all its coefficients are 0: no p is formed), so dx row i is 0 and dbias
 *       the clean run's; only dweight's hidden row k is NaN (x^T dZ: NaN * 0). Torch poisons every gradient there
 *       (its log_softmax backward computes 0 - exp(NaN) * 0 for that row).
 *   x[i][k] = +-Inf: as NaN (the row's logits hold +-Inf, exp(Inf - Inf) = NaN). With a softcap the logits
 *       saturate to +-cap instead: token i's loss stays finite, dx row i is 0 (dz/du = 1 - tanh^2 = 0) and
 *       only row k of dweight (the hidden unit holding the Inf: Inf * 0) is NaN.
 *   weight (k, v) or bias[v] NaN: column v of every token's logits is NaN: every token's lse is NaN, every
 *       non-ignored token's loss, the reduced loss, every gradient element but the dx rows of ignored tokens (their
 *       dZ rows are 0 in every schedule: 0, or NaN only at the NaN weight's hidden unit in a call that computes
 *       every row, 0 x NaN in dZ W).
 *   GRPO, x row of an unmasked token i NaN: token i's logp, entropy and lse are NaN, the loss is NaN. Token
 *       level: dx rows other than i unchanged. Sequence level (GSPO): the sequence's log-ratio is NaN, so
 *       every dx row of that sequence is NaN; other sequences unchanged. dweight and dbias NaN.
 *   GRPO, NaN in old/ref log-probs or advantages: not scanned (FH_PARAM_CHECK_FINITE covers x, weight and
 *       bias); the loss is NaN, also when the token is masked out (the mask multiplies, NaN * 0 = NaN, as
 *       in TRL).
 *   Distillation, NaN in the student's or the teacher's x row of a counted token i: token i's per-token loss
 *       and the loss are non-finite, dx row i is, dweight and dbias are NaN everywhere; other tokens' per-token
 *       losses and dx rows are unchanged, bit for bit. Token i ignored (target ignore_index): its dZ row is
 *       exactly 0 and, the head running on the rows that count, its rows are never read: a NaN in either
 *       changes nothing at all (dx row i is 0).
 *   FH_PARAM_CHECK_FINITE = 1: any NaN/+-Inf in x, weight or bias (the distillation teacher's too, named as the
 *       teacher's) fails every entry point with FH_ERR_NONFINITE_INPUT before any output is written; padding
 *       between the rows of strided views is never read (NaN there is accepted, and never written: dx padding
 *       keeps its bytes). */
#include "hardening_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 13, H = 6, V = 40, POISONED = 3, IGNORED = 5 };

static int all_nan(const float *a, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (!isnan(a[i]))
            return 0;
    return 1;
}

static int none_finite(const float *a, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (isfinite(a[i]))
            return 0;
    return 1;
}

static int rows_equal_except(const void *a, const void *b, int64_t rows, size_t row_bytes, int64_t skip)
{
    for (int64_t r = 0; r < rows; r++)
        if (r != skip && memcmp((const char *)a + (size_t)r * row_bytes, (const char *)b + (size_t)r * row_bytes,
                                row_bytes) != 0)
            return 0;
    return 1;
}

static void make_ce(cp_problem *p, fh_reduction reduction, double softcap)
{
    cp_problem_init(p, N, H, V, FH_LAYOUT_VH, CP_BIAS | CP_CLASS_WEIGHTS);
    cp_problem_randomize(p, 900, 3.0);
    p->options.reduction = reduction;
    p->options.label_smoothing = 0.1;
    p->options.z_loss = 1e-4;
    p->options.softcap = softcap;
    p->targets[IGNORED] = -100;
}

/* Forward + backward (or the train step) on 2 threads with small tiles. */
static fh_status run_ce(const cp_problem *p, int train_step, hu_outputs *o)
{
    hu_outputs_alloc(o, p->n, p->hidden, p->vocab, p->bias != NULL);
    fh_context *ctx = tu_context(2, 4, 16, 0);
    fh_status st;
    if (train_step) {
        st = hu_run(ctx, HU_fh_ce_forward_backward, p, NULL, NULL, o);
    } else {
        st = hu_run(ctx, HU_fh_ce_forward, p, NULL, NULL, o);
        hu_saved saved;
        hu_saved_from(&saved, o, p->n);
        if (st == FH_OK)
            st = hu_run(ctx, HU_fh_ce_backward, p, NULL, &saved, o);
        hu_saved_free(&saved);
    }
    fh_context_destroy(ctx);
    return st;
}

static const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};

/* Token `row`'s hidden state gets `value` at column 2; checks the rules at the top of the file. */
static void check_x_row(int64_t row, float value, double softcap)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int train_step = 0; train_step <= 1; train_step++) {
            char label[128];
            snprintf(label, sizeof label, "x[%lld][2] = %g, %s token, softcap %g, reduction %d, train step %d",
                     (long long)row, (double)value, row == IGNORED ? "ignored" : "active", softcap,
                     (int)reductions[r], train_step);
            cp_problem p;
            make_ce(&p, reductions[r], softcap);
            hu_outputs clean, dirty;
            fh_status st = run_ce(&p, train_step, &clean);
            TU_CHECK(st == FH_OK, "%s: clean run: %d", label, (int)st);
            p.x[row * H + 2] = value;
            st = run_ce(&p, train_step, &dirty);
            TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
            const size_t fb = sizeof(float);
            TU_CHECK(rows_equal_except(clean.per_token_loss, dirty.per_token_loss, N, fb, row) &&
                         rows_equal_except(clean.logp, dirty.logp, N, fb, row) &&
                         rows_equal_except(clean.lse, dirty.lse, N, fb, row) &&
                         rows_equal_except(clean.argmax, dirty.argmax, N, sizeof(int64_t), row),
                     "%s: another token's per-token output changed", label);
            TU_CHECK(rows_equal_except(clean.dx, dirty.dx, N, H * fb, row), "%s: another token's dx row changed", label);
            TU_CHECK(dirty.argmax[row] >= 0 && dirty.argmax[row] < V, "%s: argmax[%lld] = %lld", label, (long long)row,
                     (long long)dirty.argmax[row]);
            const int capped = softcap > 0.0 && isinf(value);
            if (capped) {
                /* Saturated logits: finite loss, zero dx row, NaN only in dweight's row 2. */
                TU_CHECK(isfinite(dirty.per_token_loss[row]) && isfinite(dirty.lse[row]) && isfinite(dirty.loss),
                         "%s: loss %g, per-token %g, lse %g: expected finite (saturated softcap)", label, dirty.loss,
                         (double)dirty.per_token_loss[row], (double)dirty.lse[row]);
                int zero = 1;
                for (int k = 0; k < H; k++)
                    zero &= dirty.dx[row * H + k] == 0.0f;
                TU_CHECK(zero, "%s: dx row %lld is not 0", label, (long long)row);
                int pattern = 1;
                for (int k = 0; k < H; k++)
                    for (int j = 0; j < V; j++) {
                        const float g = dirty.dweight[(size_t)j * H + k]; /* VH layout */
                        pattern &= k == 2 ? isnan(g) : isfinite(g);
                    }
                TU_CHECK(pattern, "%s: dweight is not NaN exactly on hidden row 2", label);
                TU_CHECK(tu_all_finite_f(dirty.dbias, V), "%s: dbias not finite", label);
            } else {
                if (row == IGNORED) {
                    TU_CHECK(memcmp(&dirty.loss, &clean.loss, sizeof dirty.loss) == 0 &&
                                 memcmp(&dirty.z_loss, &clean.z_loss, sizeof dirty.z_loss) == 0,
                             "%s: the loss of an ignored token's row changed the loss: %.17g vs %.17g", label,
                             dirty.loss, clean.loss);
                    TU_CHECK(dirty.per_token_loss[row] == 0.0f && dirty.logp[row] == 0.0f && !isfinite(dirty.lse[row]),
                             "%s: ignored token: per-token loss %g, logp %g, lse %g", label,
                             (double)dirty.per_token_loss[row], (double)dirty.logp[row], (double)dirty.lse[row]);
                } else {
                    TU_CHECK(!isfinite(dirty.loss), "%s: loss %g is finite", label, dirty.loss);
                    TU_CHECK(!isfinite(dirty.per_token_loss[row]) && !isfinite(dirty.logp[row]) &&
                                 !isfinite(dirty.lse[row]),
                             "%s: per-token loss %g, logp %g, lse %g: expected non-finite", label,
                             (double)dirty.per_token_loss[row], (double)dirty.logp[row], (double)dirty.lse[row]);
                }
                if (row == IGNORED && !train_step) {
                    /* The split backward runs on the rows that count: row i is never read. */
                    TU_CHECK(tu_all_equal_f(dirty.dx + row * H, H, 0.0f), "%s: dx row %lld is not 0", label,
                             (long long)row);
                    TU_CHECK(memcmp(dirty.dweight, clean.dweight, (size_t)(H * V) * fb) == 0 &&
                                 memcmp(dirty.dbias, clean.dbias, (size_t)V * fb) == 0,
                             "%s: dweight or dbias differs from the clean run's", label);
                } else if (row == IGNORED) {
                    /* Every row computed: the ignored row's dZ is exactly 0 (its coefficients are), so only the NaN
                     * itself reaches dweight, through x^T dZ: hidden row 2, NaN x 0. */
                    TU_CHECK(tu_all_equal_f(dirty.dx + row * H, H, 0.0f), "%s: dx row %lld is not 0", label,
                             (long long)row);
                    int pattern = 1;
                    for (int k = 0; k < H; k++)
                        for (int j = 0; j < V; j++) {
                            const float g = dirty.dweight[(size_t)j * H + k]; /* VH layout */
                            pattern &= k == 2 ? isnan(g) : isfinite(g);
                        }
                    TU_CHECK(pattern, "%s: dweight is not NaN exactly on hidden row 2", label);
                    TU_CHECK(memcmp(dirty.dbias, clean.dbias, (size_t)V * fb) == 0,
                             "%s: dbias differs from the clean run's", label);
                } else {
                    TU_CHECK(none_finite(dirty.dx + row * H, H), "%s: dx row %lld has a finite element", label,
                             (long long)row);
                    TU_CHECK(none_finite(dirty.dweight, H * V) && none_finite(dirty.dbias, V),
                             "%s: dweight or dbias has a finite element", label);
                }
            }
            hu_outputs_free(&clean);
            hu_outputs_free(&dirty);
            cp_problem_free(&p);
        }
}

static void test_nan_in_active_row(void)
{
    check_x_row(POISONED, NAN, 0.0);
}

static void test_nan_in_ignored_row(void)
{
    check_x_row(IGNORED, NAN, 0.0);
}

static void test_inf_in_row(void)
{
    check_x_row(POISONED, INFINITY, 0.0);
    check_x_row(POISONED, -INFINITY, 0.0);
    check_x_row(POISONED, INFINITY, 20.0);
}

/* A NaN in the weight or the bias: every token is affected. */
static void test_nan_in_weight_or_bias(void)
{
    for (int where = 0; where < 2; where++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++)
            for (int train_step = 0; train_step <= 1; train_step++) {
                cp_problem p;
                make_ce(&p, reductions[r], 0.0);
                if (where == 0)
                    p.weight[cp_weight_index(&p, 1, 7)] = NAN;
                else
                    p.bias[7] = NAN;
                hu_outputs o;
                const fh_status st = run_ce(&p, train_step, &o);
                const char *what = where == 0 ? "weight(1, 7)" : "bias[7]";
                TU_CHECK(st == FH_OK, "%s NaN: status %d", what, (int)st);
                TU_CHECK(isnan(o.loss) && all_nan(o.lse, N), "%s NaN, reduction %d: loss %g, lse not all NaN", what,
                         (int)reductions[r], o.loss);
                for (int64_t i = 0; i < N; i++)
                    TU_CHECK(i == IGNORED ? o.per_token_loss[i] == 0.0f : isnan(o.per_token_loss[i]),
                             "%s NaN: per-token loss %lld = %g", what, (long long)i, (double)o.per_token_loss[i]);
                /* The ignored token's row adds nothing: the split backward skips it, the train step gives it a dZ
                 * row of 0, whose dx row dZ W is 0 but for the NaN weight's hidden unit 1 (0 x NaN). Every other
                 * element is NaN. */
                int dx_pattern = 1;
                for (int64_t i = 0; i < N; i++)
                    for (int64_t k = 0; k < H; k++) {
                        const float d = o.dx[i * H + k];
                        dx_pattern &= i != IGNORED                            ? isnan(d)
                                      : train_step && where == 0 && k == 1 ? isnan(d)
                                                                           : d == 0.0f;
                    }
                TU_CHECK(dx_pattern && all_nan(o.dweight, H * V) && all_nan(o.dbias, V),
                         "%s NaN, reduction %d, train step %d: a gradient element is not as expected", what,
                         (int)reductions[r], train_step);
                hu_outputs_free(&o);
                cp_problem_free(&p);
            }
}

/* ---- FH_PARAM_CHECK_FINITE ---- */

typedef struct finite_problem {
    cp_problem ce;
    hu_grpo_problem grpo;
    hu_saved ce_saved, grpo_saved;
} finite_problem;

static void finite_problem_init(finite_problem *f)
{
    make_ce(&f->ce, FH_REDUCTION_MEAN, 0.0);
    hu_grpo_problem_init(&f->grpo, 4, 5, H, V, FH_LAYOUT_VH, 1, 901);
    hu_outputs o;
    hu_outputs_alloc(&o, N, H, V, 1);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    TU_CHECK(hu_run(ctx, HU_fh_ce_forward, &f->ce, NULL, NULL, &o) == FH_OK, "CE forward");
    hu_saved_from(&f->ce_saved, &o, N);
    hu_outputs_free(&o);
    const int64_t n = f->grpo.batch * f->grpo.seq;
    hu_outputs_alloc(&o, n, H, V, 1);
    TU_CHECK(hu_run(ctx, HU_fh_grpo_forward, NULL, &f->grpo, NULL, &o) == FH_OK, "GRPO forward");
    hu_saved_from(&f->grpo_saved, &o, n);
    fh_context_destroy(ctx);
    hu_outputs_free(&o);
}

static void finite_problem_free(finite_problem *f)
{
    cp_problem_free(&f->ce);
    hu_grpo_problem_free(&f->grpo);
    hu_saved_free(&f->ce_saved);
    hu_saved_free(&f->grpo_saved);
}

static void test_check_finite_rejects(void)
{
    finite_problem f;
    finite_problem_init(&f);
    static const float values[] = {NAN, INFINITY, -INFINITY};
    static const char *where_names[] = {"x", "weight", "bias"};
    for (int call = 0; call < HU_CALL_COUNT; call++) {
        const int grpo = hu_call_on_sequences((hu_call)call);
        const int distill = hu_call_is_distill((hu_call)call);
        const int64_t n = grpo ? f.grpo.batch * f.grpo.seq : N, th = f.grpo.teacher_hidden;
        /* 3..5: the distillation teacher's x, weight and bias */
        float *arrays[6] = {grpo ? f.grpo.x : f.ce.x, grpo ? f.grpo.weight : f.ce.weight, grpo ? f.grpo.bias : f.ce.bias,
                            f.grpo.teacher_x, f.grpo.teacher_weight, f.grpo.teacher_bias};
        const size_t sizes[6] = {(size_t)(n * H), (size_t)(H * V), (size_t)V, (size_t)(n * th), (size_t)(th * V),
                                 (size_t)V};
        hu_outputs clean, checked;
        hu_outputs_alloc(&clean, n, H, V, 1);
        hu_outputs_alloc(&checked, n, H, V, 1);
        hu_outputs_fill(&clean, 0);
        hu_outputs_fill(&checked, 0);
        fh_context *ctx = tu_context(2, 4, 16, 0);
        const hu_saved *saved = grpo ? &f.grpo_saved : &f.ce_saved;
        TU_CHECK(hu_run(ctx, (hu_call)call, &f.ce, &f.grpo, saved, &clean) == FH_OK, "clean run");
        TU_CHECK(fh_context_set(ctx, FH_PARAM_CHECK_FINITE, 1) == FH_OK, "set CHECK_FINITE");
        const fh_status st = hu_run(ctx, (hu_call)call, &f.ce, &f.grpo, saved, &checked);
        const char *d = hu_outputs_diff(&clean, &checked);
        TU_CHECK(st == FH_OK && d == NULL, "%s: finite inputs with CHECK_FINITE: status %d, %s", hu_call_name((hu_call)call),
                 (int)st, d ? d : "identical");
        for (int where = 0; where < (distill ? 6 : 3); where++)
            for (size_t v = 0; v < TU_COUNT(values); v++)
                for (int pos = 0; pos < 3; pos++) {
                    const size_t at = pos == 0 ? 0 : pos == 1 ? sizes[where] / 2 : sizes[where] - 1;
                    const float saved_value = arrays[where][at];
                    arrays[where][at] = values[v];
                    hu_outputs_fill(&checked, TU_CANARY);
                    const fh_status bad = hu_run(ctx, (hu_call)call, &f.ce, &f.grpo, saved, &checked);
                    arrays[where][at] = saved_value;
                    const char *message = "";
                    fh_context_message(ctx, &message);
                    const char *who = where >= 3 ? "teacher " : "";
                    TU_CHECK(bad == FH_ERR_NONFINITE_INPUT, "%s: %s%s[%zu] = %g: status %d", hu_call_name((hu_call)call),
                             who, where_names[where % 3], at, (double)values[v], (int)bad);
                    TU_CHECK(hu_outputs_untouched(&checked, TU_CANARY), "%s: %s%s[%zu] = %g: an output was written",
                             hu_call_name((hu_call)call), who, where_names[where % 3], at, (double)values[v]);
                    TU_CHECK(tu_mentions(message, where_names[where % 3]) && (where < 3) != tu_mentions(message, "teacher"),
                             "%s: message \"%s\" does not name %s%s (or names the teacher for the student)",
                             hu_call_name((hu_call)call), message, who, where_names[where % 3]);
                }
        fh_context_destroy(ctx);
        hu_outputs_free(&clean);
        hu_outputs_free(&checked);
    }
    finite_problem_free(&f);
}

/* The CE problem p on views padded by XPAD, WPAD and DXPAD elements per row, the padding of x and the weight holding
 * fill and that of dx and dweight 1234.5; the outputs in o (gradients un-padded), *padding_kept whether the
 * gradients' padding was left as it was. */
enum { XPAD = 3, WPAD = 5, DXPAD = 2 };
static fh_status run_padded_ce(const cp_problem *p, int train_step, int check, float fill, hu_outputs *o,
                               int *padding_kept)
{
    const int64_t xs = H + XPAD, outer = p->layout == FH_LAYOUT_HV ? H : V, inner = p->layout == FH_LAYOUT_HV ? V : H;
    const int64_t ws = inner + WPAD, dxs = H + DXPAD;
    float *x = malloc(sizeof(float) * (size_t)(N * xs));
    float *w = malloc(sizeof(float) * (size_t)(outer * ws));
    float *dx = malloc(sizeof(float) * (size_t)(N * dxs));
    float *dw = malloc(sizeof(float) * (size_t)(outer * ws));
    for (int64_t i = 0; i < N * xs; i++)
        x[i] = i % xs < H ? p->x[i / xs * H + i % xs] : fill;
    for (int64_t i = 0; i < outer * ws; i++) {
        w[i] = i % ws < inner ? p->weight[i / ws * inner + i % ws] : fill;
        dw[i] = i % ws < inner ? NAN : 1234.5f;
    }
    for (int64_t i = 0; i < N * dxs; i++)
        dx[i] = i % dxs < H ? NAN : 1234.5f;
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, p->layout, p->bias);
    lin.x_row_stride = xs;
    if (p->layout == FH_LAYOUT_HV)
        lin.w_stride_hidden = ws;
    else
        lin.w_stride_vocab = ws;
    hu_outputs_alloc(o, N, H, V, 1);
    fh_ce_outputs out = {&o->loss, &o->z_loss, o->per_token_loss, o->logp, o->lse, o->argmax, NULL, NULL};
    fh_linear_grads g = {.dx = dx, .dx_row_stride = dxs, .dx_beta = 0.0f, .dweight = dw, .dweight_beta = 0.0f,
                         .dbias = o->dbias, .dbias_beta = 0.0f};
    fh_context *ctx = tu_context(2, 4, 16, 0);
    fh_context_set(ctx, FH_PARAM_CHECK_FINITE, check);
    fh_status st;
    if (train_step) {
        st = fh_ce_forward_backward(ctx, &lin, p->targets, &p->options, p->grad_output, &out, &g);
    } else {
        st = fh_ce_forward(ctx, &lin, p->targets, &p->options, &out);
        if (st == FH_OK)
            st = fh_ce_backward(ctx, &lin, p->targets, &p->options, o->lse, p->grad_output, &g);
    }
    fh_context_destroy(ctx);
    *padding_kept = 1;
    for (int64_t i = 0; i < N * dxs; i++) {
        if (i % dxs < H)
            o->dx[i / dxs * H + i % dxs] = dx[i];
        else
            *padding_kept &= dx[i] == 1234.5f;
    }
    for (int64_t i = 0; i < outer * ws; i++) {
        if (i % ws < inner)
            o->dweight[i / ws * inner + i % ws] = dw[i];
        else
            *padding_kept &= dw[i] == 1234.5f;
    }
    free(x);
    free(w);
    free(dx);
    free(dw);
    return st;
}

/* Strided views whose padding holds NaN: never read (with and without CHECK_FINITE), and dx padding never
 * written. Results equal bitwise those of the same views with finite padding (a padding element read would turn
 * them NaN). Not the contiguous run's: oneDNN's f32 matmul runs its brgemm kernel on dense views and its jit sgemm on
 * padded ones, so the two may round differently (BLIS packs both into the same panels). */
static void test_nan_padding_is_never_read(void)
{
    for (int layout = 0; layout < 2; layout++)
        for (int train_step = 0; train_step <= 1; train_step++)
            for (int check = 0; check <= 1; check++) {
                cp_problem p;
                make_ce(&p, FH_REDUCTION_SUM, 0.0);
                p.layout = (fh_layout)layout;
                cp_problem_randomize(&p, 902, 3.0);
                p.targets[IGNORED] = -100;
                char label[96];
                snprintf(label, sizeof label, "layout %d, train step %d, check_finite %d", layout, train_step, check);
                hu_outputs ref, o;
                int ref_kept, kept;
                TU_CHECK(run_padded_ce(&p, train_step, 0, 1000.5f, &ref, &ref_kept) == FH_OK && ref_kept,
                         "%s: the run with finite padding", label);
                const fh_status st = run_padded_ce(&p, train_step, check, NAN, &o, &kept);
                TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
                TU_CHECK(kept, "%s: a gradient's padding was written", label);
                const char *d = hu_outputs_diff(&o, &ref);
                TU_CHECK(d == NULL, "%s: %s differs from the run with finite padding", label, d ? d : "");
                hu_outputs_free(&o);
                hu_outputs_free(&ref);
                cp_problem_free(&p);
            }
}

/* ---- GRPO ---- */

static fh_status run_grpo(const hu_grpo_problem *p, int train_step, hu_outputs *o)
{
    const int64_t n = p->batch * p->seq;
    hu_outputs_alloc(o, n, p->hidden, p->vocab, p->bias != NULL);
    fh_context *ctx = tu_context(2, 4, 16, 0);
    fh_status st;
    if (train_step) {
        st = hu_run(ctx, HU_fh_grpo_forward_backward, NULL, p, NULL, o);
    } else {
        st = hu_run(ctx, HU_fh_grpo_forward, NULL, p, NULL, o);
        hu_saved saved;
        hu_saved_from(&saved, o, n);
        if (st == FH_OK)
            st = hu_run(ctx, HU_fh_grpo_backward, NULL, p, &saved, o);
        hu_saved_free(&saved);
    }
    fh_context_destroy(ctx);
    return st;
}

static void test_grpo_nan_in_x_row(void)
{
    enum { B = 3, T = 5, SEQ = 1, TOKEN = 1 * T + 1 };
    for (int plain = 0; plain <= 1; plain++)
    for (int level = 0; level <= 1; level++)
        for (int train_step = 0; train_step <= 1; train_step++) {
            hu_grpo_problem p;
            hu_grpo_problem_init(&p, B, T, H, V, FH_LAYOUT_HV, 1, 903);
            p.options.importance_sampling_level = (fh_grpo_is_level)level;
            /* plain: no KL and no entropy bonus, so only the clipped ratio carries the NaN to the loss. */
            p.options.entropy_coef = plain ? 0.0 : 0.01;
            p.options.beta = plain ? 0.0 : 0.04;
            p.mask[TOKEN] = 1.0f;
            p.ids[TOKEN] = 7;
            hu_outputs clean, dirty;
            TU_CHECK(run_grpo(&p, train_step, &clean) == FH_OK, "clean GRPO run");
            p.x[TOKEN * H + 4] = NAN;
            const fh_status st = run_grpo(&p, train_step, &dirty);
            char label[96];
            snprintf(label, sizeof label, "GRPO %s level, train step %d, %s", level ? "sequence" : "token", train_step,
                     plain ? "beta 0, entropy_coef 0" : "beta 0.04, entropy_coef 0.01");
            TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
            TU_CHECK(isnan(dirty.loss) && isnan(dirty.logp[TOKEN]) && isnan(dirty.entropy[TOKEN]) &&
                         isnan(dirty.lse[TOKEN]),
                     "%s: loss %g, logp %g, entropy %g, lse %g: expected NaN", label, dirty.loss,
                     (double)dirty.logp[TOKEN], (double)dirty.entropy[TOKEN], (double)dirty.lse[TOKEN]);
            const size_t fb = sizeof(float);
            TU_CHECK(rows_equal_except(clean.logp, dirty.logp, B * T, fb, TOKEN) &&
                         rows_equal_except(clean.entropy, dirty.entropy, B * T, fb, TOKEN) &&
                         rows_equal_except(clean.lse, dirty.lse, B * T, fb, TOKEN),
                     "%s: another token's logp, entropy or lse changed", label);
            for (int64_t i = 0; i < B * T; i++) {
                const int poisoned = level == FH_GRPO_IS_SEQUENCE ? i / T == SEQ : i == TOKEN;
                if (poisoned)
                    TU_CHECK(all_nan(dirty.dx + i * H, H), "%s: dx row %lld is not NaN", label, (long long)i);
                else
                    TU_CHECK(memcmp(dirty.dx + i * H, clean.dx + i * H, H * fb) == 0, "%s: dx row %lld changed", label,
                             (long long)i);
            }
            TU_CHECK(all_nan(dirty.dweight, H * V) && all_nan(dirty.dbias, V), "%s: dweight/dbias not all NaN", label);
            hu_outputs_free(&clean);
            hu_outputs_free(&dirty);
            hu_grpo_problem_free(&p);
        }
}

/* Non-finite per-token data (not covered by CHECK_FINITE): the loss is NaN, masked position or not. */
static void test_grpo_nan_in_token_data(void)
{
    enum { B = 3, T = 5 };
    for (int what = 0; what < 4; what++)
        for (int masked = 0; masked <= 1; masked++) {
            hu_grpo_problem p;
            hu_grpo_problem_init(&p, B, T, H, V, FH_LAYOUT_HV, 0, 904);
            const int64_t i = 1 * T + 2;
            p.mask[i] = masked ? 0.0f : 1.0f;
            p.ids[i] = masked ? -100 : 3;
            if (what == 0)
                p.old_logps[i] = NAN;
            else if (what == 1)
                p.ref_logps[i] = NAN;
            else if (what == 2)
                p.advantages[1] = NAN;
            else {
                p.old_logps[i] = -INFINITY; /* ratio exp(+inf): -min(r A, clip(r) A) = +inf for A < 0 */
                p.advantages[1] = -0.5f;
            }
            if (what == 2 && masked)
                for (int64_t t = 0; t < T; t++)
                    p.mask[1 * T + t] = 0.0f;
            hu_outputs o;
            fh_context *ctx = tu_context(1, 0, 0, 0);
            fh_context_set(ctx, FH_PARAM_CHECK_FINITE, 1);
            hu_outputs_alloc(&o, B * T, H, V, 0);
            const fh_status st = hu_run(ctx, HU_fh_grpo_forward_backward, NULL, &p, NULL, &o);
            fh_context_destroy(ctx);
            static const char *names[] = {"old logp NaN", "ref logp NaN", "advantage NaN", "old logp -inf"};
            TU_CHECK(st == FH_OK, "%s, masked %d: status %d", names[what], masked, (int)st);
            TU_CHECK(!isfinite(o.loss), "%s, masked %d: loss %g is finite", names[what], masked, o.loss);
            hu_outputs_free(&o);
            hu_grpo_problem_free(&p);
        }
}

/* ---- Distillation ---- */

/* The call (train step: forward outputs and gradients) on 2 threads: row blocks of 4 rows with 16-column
 * forward tiles, or streaming under twice hu_distill_streaming_budget: the counted rows' copies, which count
 * against the budget, take at most half of it (src/heads/counted_rows.h), and the rest still streams. */
static fh_status run_distill(const hu_grpo_problem *p, hu_call call, int streaming, hu_outputs *o)
{
    const int64_t n = p->batch * p->seq;
    hu_outputs_alloc(o, n, p->hidden, p->vocab, p->bias != NULL);
    int64_t budget = 0;
    if (streaming) {
        fh_linear student, teacher;
        hu_distill_linears(p, &student, &teacher);
        budget = 2 * hu_distill_streaming_budget(&student, &teacher, 2);
    }
    fh_context *ctx = tu_context(2, streaming ? 0 : 4, streaming ? 0 : 16, budget);
    const fh_status st = hu_run(ctx, call, NULL, p, NULL, o);
    fh_context_destroy(ctx);
    return st;
}

static void test_distill_nan_in_x_row(void)
{
    enum { B = 3, T = 5, ACTIVE = 1 * T + 1, IGNORED_ROW = 2 * T + 3 };
    for (int teacher = 0; teacher <= 1; teacher++)
        for (int ignored = 0; ignored <= 1; ignored++)
            for (int call = HU_fh_distill_forward; call <= HU_fh_distill_forward_backward; call++)
                for (int streaming = 0; streaming <= 1; streaming++)
                    for (int none = 0; none <= 1; none++) {
                        hu_grpo_problem p;
                        hu_grpo_problem_init(&p, B, T, H, V, FH_LAYOUT_HV, 1, 905);
                        p.distill.reduction = none ? FH_REDUCTION_NONE : FH_REDUCTION_MEAN;
                        p.distill.divergence = none ? FH_DIVERGENCE_REVERSE_KL : FH_DIVERGENCE_JSD;
                        const int64_t row = ignored ? IGNORED_ROW : ACTIVE, n = B * T;
                        p.ids[ACTIVE] = 7;
                        p.ids[IGNORED_ROW] = -100;
                        char label[160];
                        snprintf(label, sizeof label, "%s, NaN in the %s's x row of %s token, %s, reduction %s",
                                 hu_call_name((hu_call)call), teacher ? "teacher" : "student",
                                 ignored ? "an ignored" : "a counted", streaming ? "streaming" : "row blocks",
                                 none ? "none (reverse KL)" : "mean (jsd)");
                        hu_outputs clean, dirty;
                        TU_CHECK(run_distill(&p, (hu_call)call, streaming, &clean) == FH_OK, "%s: clean run", label);
                        const int64_t th = p.teacher_hidden;
                        if (teacher)
                            p.teacher_x[row * th + 2] = NAN;
                        else
                            p.x[row * H + 2] = NAN;
                        const fh_status st = run_distill(&p, (hu_call)call, streaming, &dirty);
                        TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
                        const size_t fb = sizeof(float);
                        const int grads = call == HU_fh_distill_forward_backward;
                        if (ignored) {
                            /* The head runs on the rows that count: an ignored token's rows are never read. */
                            const char *d = hu_outputs_diff(&clean, &dirty);
                            TU_CHECK(d == NULL, "%s: %s changed (an ignored token's rows are never read)", label,
                                     d ? d : "");
                            TU_CHECK(!grads || tu_all_equal_f(dirty.dx + row * H, H, 0.0f), "%s: dx row %lld is not 0",
                                     label, (long long)row);
                        } else {
                            TU_CHECK(!isfinite(dirty.loss) && !isfinite(dirty.per_token_loss[row]) &&
                                         rows_equal_except(clean.per_token_loss, dirty.per_token_loss, n, fb, row),
                                     "%s: loss %g, per-token loss %g: expected non-finite, the other tokens' unchanged",
                                     label, dirty.loss, (double)dirty.per_token_loss[row]);
                            if (grads) {
                                TU_CHECK(none_finite(dirty.dx + row * H, H) &&
                                             rows_equal_except(clean.dx, dirty.dx, n, H * fb, row),
                                         "%s: dx row %lld has a finite element, or another row changed", label,
                                         (long long)row);
                                TU_CHECK(none_finite(dirty.dweight, H * V) && none_finite(dirty.dbias, V),
                                         "%s: dweight or dbias has a finite element", label);
                            }
                        }
                        hu_outputs_free(&clean);
                        hu_outputs_free(&dirty);
                        hu_grpo_problem_free(&p);
                    }
}

static const tu_test tests[] = {
    {"NaN in an active token's hidden state", test_nan_in_active_row},
    {"NaN in an ignored token's hidden state", test_nan_in_ignored_row},
    {"+-Inf in a hidden state, with and without softcap", test_inf_in_row},
    {"NaN in the weight or the bias", test_nan_in_weight_or_bias},
    {"CHECK_FINITE rejects NaN/Inf, outputs untouched", test_check_finite_rejects},
    {"NaN padding of strided views is never read", test_nan_padding_is_never_read},
    {"GRPO: NaN in a hidden state", test_grpo_nan_in_x_row},
    {"GRPO: NaN in per-token data", test_grpo_nan_in_token_data},
    {"distillation: NaN in a student's or teacher's hidden state", test_distill_nan_in_x_row},
};
const tu_suite suite_nonfinite = {tests, TU_COUNT(tests)};
