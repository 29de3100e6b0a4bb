/* logprob_support: fh_logprob_support_* against the double reference over the same support (ref_logprob_support, through
 * tests/cases/logprob_case.c, tolerances there: the log-prob head's): fp32 and bf16, CSR and padded, supports of 1,
 * 8 and V ids, both layouts, forward + backward and the single call, temperature / softcap / scale, beta 1 and bf16
 * gradients; per-row results independent of the other rows; the call contract; GRPO over a support. */
#include "logprob_harness.h"
#include "rng.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Both forms x sizes 1, 8 and V x both calls, fp32 and bf16, the layouts alternating. */
static void test_forms_sizes_calls(void)
{
    for (int dtype = 0; dtype <= 1; dtype++)
        for (int form = 0; form <= 1; form++)
            for (int size = 0; size < 3; size++)
                for (int step = 0; step <= 1; step++) {
                    logprob_case_spec s;
                    logprob_case_spec_default(&s);
                    s.support = form ? LOGPROB_SUPPORT_PADDED : LOGPROB_SUPPORT_CSR;
                    s.support_size = size == 0 ? 1 : size == 1 ? 8 : s.vocab;
                    s.train_step = step;
                    s.dtype = (fh_dtype)dtype;
                    s.layout = (fh_layout)((form + size + step) % 2);
                    s.seed = 300 + (uint64_t)(dtype * 12 + form * 6 + size * 2 + step);
                    lp_check_spec(&s, "form, size, call");
                }
}

/* A temperature with softcap and logit_scale, and no entropy gradient; cold (0.3) and hot (2.5) temperatures; beta 1
 * with bf16 gradients; no bias and nothing ignored. */
static void test_options_and_gradients(void)
{
    for (int variant = 0; variant < 5; variant++)
        for (int dtype = 0; dtype <= 1; dtype++) {
            logprob_case_spec s;
            logprob_case_spec_default(&s);
            s.support = variant % 2 ? LOGPROB_SUPPORT_PADDED : LOGPROB_SUPPORT_CSR;
            s.support_size = 64;
            s.dtype = (fh_dtype)dtype;
            s.layout = (fh_layout)(variant % 2);
            s.train_step = variant >= 3;
            s.seed = 400 + (uint64_t)(variant * 2 + dtype);
            if (variant == 0) {
                s.options.temperature = 0.7;
                s.options.softcap = 5.0;
                s.options.logit_scale = 0.5;
                s.g_entropy = 0;
            }
            if (variant == 1)
                s.options.temperature = 0.3;
            if (variant == 2)
                s.options.temperature = 2.5;
            if (variant == 3) {
                s.grad_beta = 1.0f;
                s.grad_dtype = (fh_dtype)dtype;
            }
            if (variant == 4) {
                s.bias = 0;
                s.ignore_frac = 0.0;
                s.threads = 1;
            }
            lp_check_spec(&s, "options and gradients");
        }
}

/* The support call's inputs for the contract and row tests: N rows of H over V, every row's support the ids
 * i, i + 1, .. i + K - 1 (mod V), its target the second. */
enum { N = 12, H = 16, V = 50, K = 5 };
typedef struct small_call {
    float x[N * H], w[V * H], logp[N], entropy[N], lse[N], dx[N * H], dw[V * H];
    int64_t targets[N], ids[N * K], offsets[N + 1];
    fh_linear lin;
    fh_support csr, padded;
    fh_logprob_options o;
} small_call;

static void small_call_init(small_call *c)
{
    uint64_t rng = 77;
    for (int e = 0; e < N * H; e++)
        c->x[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    for (int e = 0; e < V * H; e++)
        c->w[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < K; k++)
            c->ids[i * K + k] = (i + k) % V;
        c->targets[i] = (i + 1) % V;
        c->offsets[i] = (int64_t)i * K;
    }
    c->offsets[N] = N * K;
    fh_linear_init(&c->lin, N, H, V, c->x, c->w, FH_LAYOUT_VH, NULL);
    c->csr = (fh_support){c->ids, c->offsets, 0};
    c->padded = (fh_support){c->ids, NULL, K};
    fh_logprob_options_init(&c->o);
}

/* The same rows inside a call of N rows and alone, or among others in another order: bitwise the same logp, entropy,
 * lse and dx rows (each row's sums run over its own entries only). */
static void test_rows_independent(void)
{
    small_call c;
    small_call_init(&c);
    fh_context *ctx = tu_context(2, 0, 0, 0);
    float g[N];
    for (int i = 0; i < N; i++)
        g[i] = 0.25f * (float)(i % 5) - 0.5f;
    fh_logprob_outputs out = {c.logp, c.entropy, c.lse};
    fh_linear_grads grads = {.dx = c.dx, .dx_row_stride = H};
    TU_CHECK(fh_logprob_support_forward_backward(ctx, &c.lin, c.targets, &c.csr, &c.o, g, g, g, &out, &grads) == FH_OK,
             "all rows");
    /* rows 3..7 alone, in reverse order */
    enum { M = 5 };
    small_call r;
    float g_r[M];
    memcpy(&r, &c, sizeof r);
    for (int m = 0; m < M; m++) {
        const int i = 7 - m;
        memcpy(r.x + m * H, c.x + i * H, H * sizeof(float));
        r.targets[m] = c.targets[i];
        memcpy(r.ids + m * K, c.ids + i * K, K * sizeof(int64_t));
        g_r[m] = g[i];
    }
    fh_linear_init(&r.lin, M, H, V, r.x, r.w, FH_LAYOUT_VH, NULL);
    r.padded = (fh_support){r.ids, NULL, K};
    fh_logprob_outputs out_r = {r.logp, r.entropy, r.lse};
    fh_linear_grads grads_r = {.dx = r.dx, .dx_row_stride = H};
    TU_CHECK(fh_logprob_support_forward_backward(ctx, &r.lin, r.targets, &r.padded, &r.o, g_r, g_r, g_r, &out_r,
                                                 &grads_r) == FH_OK,
             "five rows");
    int same = 1;
    for (int m = 0; m < M; m++) {
        const int i = 7 - m;
        same &= r.logp[m] == c.logp[i] && r.entropy[m] == c.entropy[i] && r.lse[m] == c.lse[i] &&
                memcmp(r.dx + m * H, c.dx + i * H, H * sizeof(float)) == 0;
    }
    TU_CHECK(same, "a row's logp, entropy, lse and dx do not depend on the other rows (CSR among 12, padded among 5)");
    fh_context_destroy(ctx);
}

/* One refused call: its status, a message naming the cause, and the outputs untouched. */
static void refused(small_call *c, const fh_support *support, fh_status want, const char *words, const char *what)
{
    fh_context *ctx = tu_context(2, 0, 0, 0);
    for (int i = 0; i < N; i++)
        c->logp[i] = 42.0f;
    for (int e = 0; e < N * H; e++)
        c->dx[e] = 42.0f;
    fh_logprob_outputs out = {c->logp, NULL, c->lse};
    fh_linear_grads grads = {.dx = c->dx, .dx_row_stride = H};
    const float g[N] = {0};
    const fh_status st[2] = {fh_logprob_support_forward(ctx, &c->lin, c->targets, support, &c->o, &out),
                             fh_logprob_support_forward_backward(ctx, &c->lin, c->targets, support, &c->o, g, NULL,
                                                                 NULL, &out, &grads)};
    const char *message = "";
    fh_context_message(ctx, &message);
    int untouched = 1;
    for (int i = 0; i < N; i++)
        untouched &= c->logp[i] == 42.0f;
    for (int e = 0; e < N * H; e++)
        untouched &= c->dx[e] == 42.0f;
    TU_CHECK(st[0] == want && st[1] == want && strstr(message, words) && untouched,
             "%s: statuses %d, %d (want %d), message \"%s\" (want \"%s\"), outputs untouched %d", what, (int)st[0],
             (int)st[1], (int)want, message, words, untouched);
    fh_context_destroy(ctx);
}

static void test_contract(void)
{
    small_call c;
    small_call_init(&c);
    refused(&c, NULL, FH_ERR_NULL_POINTER, "support is NULL", "no support");
    fh_support bad = {NULL, c.offsets, 0};
    refused(&c, &bad, FH_ERR_NULL_POINTER, "support->ids", "no ids");
    bad = (fh_support){c.ids, NULL, 0};
    refused(&c, &bad, FH_ERR_INVALID_SUPPORT, "support->k = 0", "padded, k 0");
    c.offsets[0] = 1;
    refused(&c, &c.csr, FH_ERR_INVALID_SUPPORT, "offsets[0] = 1", "offsets not from 0");
    c.offsets[0] = 0;
    c.offsets[4] = c.offsets[3] - 1;
    refused(&c, &c.csr, FH_ERR_INVALID_SUPPORT, "offsets[4]", "offsets decreasing");
    c.offsets[4] = 4 * K;
    c.ids[2 * K + 3] = V;
    refused(&c, &c.csr, FH_ERR_INVALID_SUPPORT, "outside [0, 50)", "an id = V");
    c.ids[2 * K + 3] = -1;
    refused(&c, &c.csr, FH_ERR_INVALID_SUPPORT, "outside [0, 50)", "CSR: -1 is no padding");
    c.ids[2 * K + 3] = -2;
    refused(&c, &c.padded, FH_ERR_INVALID_SUPPORT, "is not -1 (padding)", "padded: -2");
    c.ids[2 * K + 3] = 2;
    refused(&c, &c.padded, FH_ERR_INVALID_SUPPORT, "lists it twice", "an id twice in a row");
    c.ids[2 * K + 3] = 2 + 3;
    c.targets[6] = 30;
    refused(&c, &c.csr, FH_ERR_INVALID_SUPPORT, "row 6: its target 30 is not in its support", "target outside");
    c.targets[6] = -100; /* an ignored row's support need not hold its target */
    fh_context *ctx = tu_context(2, 0, 0, 0);
    fh_logprob_outputs out = {c.logp, c.entropy, c.lse};
    TU_CHECK(fh_logprob_support_forward(ctx, &c.lin, c.targets, &c.csr, &c.o, &out) == FH_OK &&
                 c.logp[6] == 0.0f && c.entropy[6] == 0.0f && c.lse[6] == 0.0f && c.logp[5] < 0.0f,
             "an ignored row: 0 whatever its support, a counted one's logp negative");
    /* Budget, caller's workspace and the size query. */
    size_t bytes = 0;
    TU_CHECK(fh_logprob_support_workspace_size(ctx, &c.lin, &c.csr, &bytes) == FH_OK && bytes > 0, "size query");
    fh_context *small = tu_context(2, 0, 0, (int64_t)bytes - 1);
    TU_CHECK(fh_logprob_support_forward(small, &c.lin, c.targets, &c.csr, &c.o, &out) == FH_ERR_BUDGET_TOO_SMALL,
             "a budget one byte short of the workspace");
    fh_context_destroy(small);
    void *workspace = tu_alloc(bytes, 1);
    fh_context *callers = tu_context(2, 0, 0, 0);
    TU_CHECK(fh_context_set_workspace(callers, workspace, bytes) == FH_OK &&
                 fh_logprob_support_forward(callers, &c.lin, c.targets, &c.csr, &c.o, &out) == FH_OK,
             "the caller's workspace of the queried size");
    TU_CHECK(fh_context_set_workspace(callers, workspace, bytes - 1) == FH_OK &&
                 fh_logprob_support_forward(callers, &c.lin, c.targets, &c.csr, &c.o, &out) ==
                     FH_ERR_WORKSPACE_TOO_SMALL,
             "one byte less");
    fh_context_destroy(callers);
    free(workspace);
    /* Outputs over the support's arrays, and the backward's saved inputs. */
    fh_logprob_outputs over = {(float *)(void *)c.ids, NULL, NULL};
    TU_CHECK(fh_logprob_support_forward(ctx, &c.lin, c.targets, &c.csr, &c.o, &over) == FH_ERR_OVERLAPPING_BUFFERS,
             "logp over support->ids");
    fh_linear_grads grads = {.dx = c.dx, .dx_row_stride = H};
    TU_CHECK(fh_logprob_support_backward(ctx, &c.lin, c.targets, &c.csr, &c.o, NULL, NULL, c.logp, NULL, NULL,
                                         &grads) == FH_ERR_NULL_POINTER,
             "backward without lse");
    TU_CHECK(fh_logprob_support_backward(ctx, &c.lin, c.targets, &c.csr, &c.o, c.lse, NULL, c.logp, c.logp, NULL,
                                         &grads) == FH_ERR_NULL_POINTER,
             "backward with g_entropy but no entropy");
    TU_CHECK(fh_logprob_support_backward(ctx, &c.lin, c.targets, &c.csr, &c.o, c.lse, NULL, c.logp, NULL, NULL,
                                         NULL) == FH_ERR_NULL_POINTER &&
                 fh_logprob_support_forward_backward(ctx, &c.lin, c.targets, &c.csr, &c.o, c.logp, NULL, NULL, &out,
                                                     NULL) == FH_ERR_NULL_POINTER,
             "backward and the single call without gradients: refused, as fh_logprob_*'s (not run as a forward)");
    fh_context_destroy(ctx);
}

/* GRPO over a support (fh_grpo_batch.support): with every id in every support it is the plain head (loss, per-token
 * log-probs and gradients to the fp32 summation order: 1e-5, the log-prob head's tolerances), through the forward,
 * the backward from what the forward saved and the single call; an unmasked token whose id is outside its support is
 * refused, a masked one is not (its per-token log-prob is 0). The loss against TRL's on renormalised log-probs:
 * python/tests/test_grpo.py. */
static void test_grpo_over_a_support(void)
{
    enum { B = 3, T = 4, GN = B * T, GV = 40 };
    uint64_t rng = 91;
    static float x[GN * H], w[GV * H];
    for (int e = 0; e < GN * H; e++)
        x[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    for (int e = 0; e < GV * H; e++)
        w[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    int64_t ids[GN], every[GN * GV];
    float mask[GN], old[GN], ref[GN], adv[B] = {1.0f, -0.5f, 0.8f};
    for (int i = 0; i < GN; i++) {
        ids[i] = (int64_t)(i * 7 % GV);
        mask[i] = i % T == T - 1 && i / T != 0 ? 0.0f : 1.0f;
        old[i] = -3.5f + 0.1f * (float)(i % 5);
        ref[i] = -3.6f + 0.05f * (float)(i % 3);
        for (int j = 0; j < GV; j++)
            every[i * GV + j] = (j + i) % GV;
    }
    fh_linear lin;
    fh_linear_init(&lin, GN, H, GV, x, w, FH_LAYOUT_VH, NULL);
    fh_grpo_options o;
    fh_grpo_options_init(&o);
    o.beta = 0.04;
    o.temperature = 0.8;
    o.entropy_coef = 0.01;
    const fh_support all = {every, NULL, GV};
    const float one = 1.0f;
    fh_context *ctx = tu_context(2, 0, 0, 0);
    double loss[3];
    static float logp[3][GN], lse[GN], entropy[GN], dx[3][GN * H], dw[3][GV * H];
    for (int k = 0; k < 3; k++) {
        /* 0: the plain head's single call; 1: over every id, the single call; 2: over every id, forward + backward */
        const fh_grpo_batch batch = {B, T, ids, mask, adv, old, ref, NULL, k == 0 ? NULL : &all, NULL};
        fh_grpo_outputs out = {&loss[k], NULL, logp[k], NULL, entropy, lse};
        fh_linear_grads g = {.dx = dx[k], .dx_row_stride = H, .dweight = dw[k]};
        fh_status st = k < 2 ? fh_grpo_forward_backward(ctx, &lin, &batch, &o, &one, &out, &g)
                             : fh_grpo_forward(ctx, &lin, &batch, &o, &out);
        if (k == 2 && st == FH_OK)
            st = fh_grpo_backward(ctx, &lin, &batch, &o, logp[k], lse, entropy, &one, &g);
        TU_CHECK(st == FH_OK, "GRPO call %d: status %d", k, (int)st);
    }
    double worst_logp = 0.0;
    for (int k = 1; k < 3; k++)
        for (int i = 0; i < GN; i++)
            if (mask[i] != 0.0f)
                worst_logp = fmax(worst_logp, fabs((double)logp[k][i] - (double)logp[0][i]));
    for (int k = 1; k < 3; k++)
        TU_CHECK(fabs(loss[k] - loss[0]) <= 1e-5 * fmax(1.0, fabs(loss[0])) && worst_logp <= 1e-5 &&
                     tu_norm_rel_f(dx[k], dx[0], GN * H) <= 1e-5 && tu_norm_rel_f(dw[k], dw[0], GV * H) <= 1e-5,
                 "GRPO over every id (%s) against the plain head: loss %.9g vs %.9g, logp %.2e, dx %.2e, dweight %.2e",
                 k == 1 ? "single call" : "forward + backward", loss[k], loss[0], worst_logp,
                 tu_norm_rel_f(dx[k], dx[0], GN * H), tu_norm_rel_f(dw[k], dw[0], GV * H));
    int masked_zero = 1;
    for (int i = 0; i < GN; i++)
        masked_zero &= mask[i] != 0.0f || logp[1][i] == 0.0f;
    TU_CHECK(masked_zero, "masked tokens' per-token log-probs over a support are 0");
    /* a support of each token's id alone, but the unmasked token 5's id missing; then only a masked token's */
    int64_t own[GN];
    for (int i = 0; i < GN; i++)
        own[i] = ids[i];
    const fh_support single = {own, NULL, 1};
    const fh_grpo_batch batch = {B, T, ids, mask, adv, old, ref, NULL, &single, NULL};
    fh_grpo_outputs out = {&loss[0], NULL, NULL, NULL, NULL, NULL};
    own[5] = (ids[5] + 1) % GV;
    const char *message = "";
    TU_CHECK(fh_grpo_forward(ctx, &lin, &batch, &o, &out) == FH_ERR_INVALID_SUPPORT &&
                 fh_context_message(ctx, &message) == FH_OK && strstr(message, "row 5: its target"),
             "an unmasked token outside its support: refused (%s)", message);
    own[5] = ids[5];
    own[T + T - 1] = (ids[T + T - 1] + 1) % GV; /* masked (sequence 1's last token) */
    TU_CHECK(fh_grpo_forward(ctx, &lin, &batch, &o, &out) == FH_OK && isfinite(loss[0]),
             "a masked token outside its support: accepted, loss %g", loss[0]);
    fh_context_destroy(ctx);
}

static const tu_test tests[] = {
    {"CSR and padded, |S| 1, 8 and V, both calls, fp32 and bf16, against the reference", test_forms_sizes_calls},
    {"temperature, softcap, scale, beta 1, bf16 gradients, no bias", test_options_and_gradients},
    {"a row's results do not depend on the other rows", test_rows_independent},
    {"call contract", test_contract},
    {"GRPO over a support: every id is the plain head; unmasked targets must be in it", test_grpo_over_a_support},
};
const tu_suite suite_logprob_support = {tests, TU_COUNT(tests)};
