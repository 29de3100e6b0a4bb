/* The parallel heads (include/fusedhead_parallel.h) in one process, over collectives this file provides: threads as
 * ranks, their collectives a shared-memory exchange behind a barrier. What MPI's and torch.distributed's ranks run
 * (tests/mpi, python/tests/test_distributed.py) then runs here on every kernel variant and under the sanitizers:
 *   - a layout of one-rank groups (NULL) gives the single-process call's results;
 *   - vocab-parallel and data-parallel teams of 2 and 3 threads (uneven shards) give the single process's loss, dx
 *     rows and dweight shard, with every gradient reduction, the reduce-scatters through the fallback of a table
 *     without one (an all-reduce and a copy);
 *   - groups the layout refuses, a collective that fails (at the layout's agreement, and inside a head's pass on
 *     every rank): FH_ERR_MPI with the table's description; the handle released once at destroy.
 * Bounds: the C MPI suite's (tests/mpi/test_mpi.c): 1e-6 relative for the loss (statistics combined in double, only
 * the order of the sums differs), 1e-5 normwise for gradients. */
#include "fusedhead_parallel.h"
#include "test_util.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_RANKS = 3, N = 40, H = 12, V = 301 };

/* ---- threads as ranks ------------------------------------------------------------------------------------- */

typedef struct team {
    pthread_barrier_t barrier;
    int size;
    const void *slots[MAX_RANKS]; /* each rank's buffer during a collective */
    int fail_at;                  /* the collective (counted per rank from 1) that fails on every rank; 0: none */
} team;

typedef struct member {
    team *t;
    int rank, calls, released;
} member;

static size_t type_size(fh_collective_type type)
{
    return type == FH_COLLECTIVE_FLOAT ? sizeof(float) : sizeof(double); /* int64_t: 8 too */
}

static double element(const void *p, int64_t i, fh_collective_type type)
{
    return type == FH_COLLECTIVE_FLOAT    ? ((const float *)p)[i]
           : type == FH_COLLECTIVE_DOUBLE ? ((const double *)p)[i]
                                          : (double)((const int64_t *)p)[i];
}

static void set_element(void *p, int64_t i, fh_collective_type type, double v)
{
    if (type == FH_COLLECTIVE_FLOAT)
        ((float *)p)[i] = (float)v;
    else if (type == FH_COLLECTIVE_DOUBLE)
        ((double *)p)[i] = v;
    else
        ((int64_t *)p)[i] = (int64_t)v;
}

static int planted(member *m)
{
    return ++m->calls == m->t->fail_at ? 7 : 0;
}

/* Every rank reads every rank's buffer into its own result, then (after a second barrier: all have read) writes it.
 * int64 values here are small (flags, sizes, statuses) or bit patterns compared with max: kept exact by reducing
 * them as int64, not through double. */
static int team_allreduce(void *handle, void *buffer, int64_t count, fh_collective_type type, fh_collective_op op)
{
    member *m = handle;
    const int failed = planted(m);
    if (failed)
        return failed;
    team *t = m->t;
    t->slots[m->rank] = buffer;
    pthread_barrier_wait(&t->barrier);
    void *result = malloc((size_t)count * type_size(type) + 1);
    for (int64_t i = 0; i < count; i++) {
        if (type == FH_COLLECTIVE_INT64) {
            int64_t acc = ((const int64_t *)t->slots[0])[i];
            for (int r = 1; r < t->size; r++) {
                const int64_t v = ((const int64_t *)t->slots[r])[i];
                acc = op == FH_COLLECTIVE_SUM ? acc + v : op == FH_COLLECTIVE_MAX ? (v > acc ? v : acc)
                                                                                 : (v < acc ? v : acc);
            }
            ((int64_t *)result)[i] = acc;
            continue;
        }
        double acc = element(t->slots[0], i, type);
        for (int r = 1; r < t->size; r++) {
            const double v = element(t->slots[r], i, type);
            acc = op == FH_COLLECTIVE_SUM ? acc + v : op == FH_COLLECTIVE_MAX ? fmax(acc, v) : fmin(acc, v);
        }
        set_element(result, i, type, acc);
    }
    pthread_barrier_wait(&t->barrier);
    memcpy(buffer, result, (size_t)count * type_size(type));
    free(result);
    return 0;
}

static int team_allgather(void *handle, const void *send, void *receive, int64_t bytes)
{
    member *m = handle;
    const int failed = planted(m);
    if (failed)
        return failed;
    team *t = m->t;
    t->slots[m->rank] = send;
    pthread_barrier_wait(&t->barrier);
    char *all = malloc((size_t)(bytes * t->size) + 1);
    for (int r = 0; r < t->size; r++)
        memcpy(all + r * bytes, t->slots[r], (size_t)bytes);
    pthread_barrier_wait(&t->barrier);
    memcpy(receive, all, (size_t)(bytes * t->size));
    free(all);
    return 0;
}

static void team_describe(void *handle, int code, char *text, size_t size)
{
    snprintf(text, size, "planted failure %d on rank %d", code, ((const member *)handle)->rank);
}

static void team_release(void *handle)
{
    ((member *)handle)->released++;
}

static fh_collectives collectives_of(member *m)
{
    const fh_collectives c = {m, m->rank, m->t->size, team_allreduce, team_allgather, NULL, team_describe,
                              team_release};
    return c;
}

/* ---- the problem and the single process ---------------------------------------------------------------------- */

typedef struct problem {
    float x[N * H], w[V * H];
    int64_t targets[N];
    fh_ce_options options;
    double loss;                /* the single process's */
    float dx[N * H], dw[V * H]; /* its gradients */
} problem;

static void make_problem(problem *p, uint64_t seed)
{
    uint64_t rng = seed;
    tu_fill_uniform(p->x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(p->w, V * H, &rng, -1.0, 1.0);
    for (int i = 0; i < N; i++)
        p->targets[i] = i % 7 == 3 ? -100 : (int64_t)((i * 131 + 17) % V);
    fh_ce_options_init(&p->options);
    p->options.label_smoothing = 0.1;
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, p->x, p->w, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    const float one = 1.0f;
    fh_ce_outputs out = {.loss = &p->loss};
    fh_linear_grads g = {.dx = p->dx, .dx_row_stride = H, .dweight = p->dw};
    TU_CHECK(fh_ce_forward_backward(ctx, &lin, p->targets, &p->options, &one, &out, &g) == FH_OK,
             "the single-process step");
    fh_context_destroy(ctx);
}

static void split(int64_t count, int parts, int r, int64_t *first, int64_t *size)
{
    const int64_t base = count / parts, extra = count % parts;
    *first = r * base + (r < extra ? r : extra);
    *size = base + (r < extra);
}

/* ---- one rank's call ----------------------------------------------------------------------------------------- */

enum { VOCAB_PARALLEL, DATA_PARALLEL };

/* Rank m's tokens (data-parallel) or vocabulary shard (vocab-parallel) of the N x V problem, and its layout over the
 * team (NULL when the creation fails: *status says why). */
static fh_parallel_layout *rank_layout(member *m, int kind, int64_t *row0, int64_t *rows, int64_t *col0, int64_t *cols,
                                       fh_status *status)
{
    const int vocab = kind == VOCAB_PARALLEL;
    *row0 = 0, *rows = N, *col0 = 0, *cols = V;
    if (vocab)
        split(V, m->t->size, m->rank, col0, cols);
    else
        split(N, m->t->size, m->rank, row0, rows);
    const fh_collectives group = collectives_of(m);
    fh_parallel_layout *L = NULL;
    *status = fh_parallel_layout_create(vocab ? &group : NULL, vocab ? NULL : &group, *cols, &L);
    return *status == FH_OK ? L : NULL;
}

/* A rank's call done: a failure's message kept, the context and layout destroyed. */
static void rank_end(fh_context *ctx, fh_parallel_layout *L, fh_status status, char *message, size_t size)
{
    const char *msg = NULL;
    if (status != FH_OK && fh_context_message(ctx, &msg) == FH_OK && msg)
        snprintf(message, size, "%s", msg);
    fh_context_destroy(ctx);
    fh_parallel_layout_destroy(L);
}

typedef struct rank_job {
    member m;
    const problem *p;
    int kind, reduction;
    fh_status create_status, status;
    double loss;
    char message[256];
    float dx[N * H], dw[V * H];
    int64_t row0, rows, col0, cols; /* this rank's tokens and shard */
} rank_job;

static void *run_rank(void *arg)
{
    rank_job *j = arg;
    const problem *p = j->p;
    const int vocab = j->kind == VOCAB_PARALLEL;
    fh_parallel_layout *L = rank_layout(&j->m, j->kind, &j->row0, &j->rows, &j->col0, &j->cols, &j->create_status);
    if (!L)
        return NULL;
    fh_parallel_layout_set(L, vocab ? FH_PARALLEL_PARAM_DX_REDUCTION : FH_PARALLEL_PARAM_DWEIGHT_REDUCTION,
                           j->reduction);
    fh_linear lin;
    fh_linear_init(&lin, j->rows, H, j->cols, p->x + j->row0 * H, p->w + j->col0 * H, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    const float one = 1.0f;
    fh_ce_outputs out = {.loss = &j->loss};
    fh_linear_grads g = {.dx = j->dx, .dx_row_stride = H, .dweight = j->dw};
    if (vocab && j->reduction == FH_PARALLEL_REDUCE_SCATTER) { /* dx points at this rank's block of rows */
        int64_t first, count;
        fh_parallel_dx_rows(L, N, &first, &count);
        g.dx = j->dx + first * H;
    }
    j->status = fh_parallel_ce_forward_backward(ctx, L, &lin, p->targets + j->row0, &p->options, &one, &out, &g);
    rank_end(ctx, L, j->status, j->message, sizeof j->message);
    return NULL;
}

/* Runs fn on ranks threads of one team, rank r's on the job at jobs + r * job_size (a struct whose first field is its
 * member, the rest filled by the caller). */
static void run_threads(int ranks, int fail_at, void *(*fn)(void *), void *jobs, size_t job_size)
{
    team t = {.size = ranks, .fail_at = fail_at};
    pthread_barrier_init(&t.barrier, NULL, (unsigned)ranks);
    pthread_t threads[MAX_RANKS];
    for (int r = 0; r < ranks; r++) {
        member *m = (member *)((char *)jobs + (size_t)r * job_size);
        m->t = &t;
        m->rank = r;
        pthread_create(&threads[r], NULL, fn, m);
    }
    for (int r = 0; r < ranks; r++)
        pthread_join(threads[r], NULL);
    pthread_barrier_destroy(&t.barrier);
}

/* Runs ranks threads; jobs[r] gets rank r's results. */
static void run_team(rank_job *jobs, int ranks, const problem *p, int kind, int reduction, int fail_at)
{
    for (int r = 0; r < ranks; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r].p = p;
        jobs[r].kind = kind;
        jobs[r].reduction = reduction;
    }
    run_threads(ranks, fail_at, run_rank, jobs, sizeof jobs[0]);
}

/* ---- tests --------------------------------------------------------------------------------------------------- */

static void test_one_rank_layout(void)
{
    static problem p;
    make_problem(&p, 11);
    fh_parallel_layout *L = NULL;
    TU_CHECK(fh_parallel_layout_create(NULL, NULL, V, &L) == FH_OK, "a layout of one-rank groups");
    fh_parallel_layout_info info;
    TU_CHECK(fh_parallel_layout_query(L, &info) == FH_OK && info.vocab_ranks == 1 && info.data_ranks == 1 &&
                 info.vocab_offset == 0 && info.total_vocab == V,
             "its info");
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, p.x, p.w, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    static float dx[N * H], dw[V * H];
    double loss = 0.0;
    const float one = 1.0f;
    fh_ce_outputs out = {.loss = &loss};
    fh_linear_grads g = {.dx = dx, .dx_row_stride = H, .dweight = dw};
    TU_CHECK(fh_parallel_ce_forward_backward(ctx, L, &lin, p.targets, &p.options, &one, &out, &g) == FH_OK,
             "the step on it");
    TU_CHECK(fabs(loss - p.loss) <= 1e-6 * fabs(p.loss) && tu_norm_rel_f(dx, p.dx, N * H) <= 1e-5 &&
                 tu_norm_rel_f(dw, p.dw, V * H) <= 1e-5,
             "one rank: loss %.9g vs %.9g, dx %.2e, dweight %.2e", loss, p.loss, tu_norm_rel_f(dx, p.dx, N * H),
             tu_norm_rel_f(dw, p.dw, V * H));
    /* GRPO over a support has no parallel form: refused, never run as if the shard's support were the whole. */
    int64_t ids[N];
    float mask[N], adv = 1.0f;
    for (int i = 0; i < N; i++) {
        ids[i] = p.targets[i] < 0 ? 0 : p.targets[i];
        mask[i] = 1.0f;
    }
    const fh_support support = {ids, NULL, 1};
    const fh_grpo_batch batch = {1, N, ids, mask, &adv, NULL, NULL, NULL, &support, NULL};
    fh_grpo_options o;
    fh_grpo_options_init(&o);
    fh_grpo_outputs grpo_out = {.loss = &loss};
    const char *message = "";
    TU_CHECK(fh_parallel_grpo_forward(ctx, L, &lin, &batch, &o, &grpo_out) == FH_ERR_INVALID_SUPPORT &&
                 fh_context_message(ctx, &message) == FH_OK && strstr(message, "no vocabulary- or data-parallel form"),
             "GRPO over a support on a layout: refused (%s)", message);
    /* Nor have packed sequences: GRPO's and KTO's refused, loss untouched. */
    const int64_t cu[2] = {0, N};
    const fh_grpo_batch packed = {1, 0, ids, mask, &adv, NULL, NULL, NULL, NULL, cu};
    loss = 12345.0;
    TU_CHECK(fh_parallel_grpo_forward(ctx, L, &lin, &packed, &o, &grpo_out) == FH_ERR_INVALID_SIZE && loss == 12345.0 &&
                 fh_context_message(ctx, &message) == FH_OK && strstr(message, "packed sequences have no"),
             "packed GRPO on a layout: refused (%s)", message);
    const uint8_t label = 1;
    const fh_kto_batch kto_packed = {1, 0, ids, mask, &label, &adv, NULL, NULL, NULL, cu};
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    ko.loss_type = FH_KTO_LOSS_APO_ZERO_UNPAIRED;
    fh_kto_outputs kto_out = {.loss = &loss};
    TU_CHECK(fh_parallel_kto_forward(ctx, L, &lin, &kto_packed, &ko, &kto_out) == FH_ERR_INVALID_SIZE &&
                 loss == 12345.0 && fh_context_message(ctx, &message) == FH_OK &&
                 strstr(message, "packed sequences have no"),
             "packed KTO on a layout: refused (%s)", message);
    fh_context_destroy(ctx);
    fh_parallel_layout_destroy(L);
}

/* dw_gathered: rank 0's buffer holds every rank's part of dweight (the others' are not checked). */
static void check_team(const rank_job *jobs, int ranks, const problem *p, const char *what, int dw_gathered)
{
    for (int r = 0; r < ranks; r++) {
        const rank_job *j = &jobs[r];
        TU_CHECK(j->create_status == FH_OK && j->status == FH_OK, "%s, rank %d: status %d / %d (%s)", what, r,
                 (int)j->create_status, (int)j->status, j->message);
        if (j->status != FH_OK)
            continue;
        TU_CHECK(fabs(j->loss - p->loss) <= 1e-6 * fabs(p->loss), "%s, rank %d: loss %.9g vs %.9g", what, r,
                 j->loss, p->loss);
        int64_t first = j->row0, count = j->rows; /* the dx rows this rank holds, and where in its buffer */
        if (j->kind == VOCAB_PARALLEL && j->reduction == FH_PARALLEL_REDUCE_SCATTER)
            split(N, ranks, r, &first, &count);
        const float *dx = j->dx + (j->kind == VOCAB_PARALLEL ? first : 0) * H;
        const double ddx = tu_norm_rel_f(dx, p->dx + first * H, (size_t)(count * H));
        const double ddw =
            dw_gathered && r > 0 ? 0.0 : tu_norm_rel_f(j->dw, p->dw + j->col0 * H, (size_t)(j->cols * H));
        TU_CHECK(ddx <= 1e-5 && ddw <= 1e-5 && j->m.released == 1, "%s, rank %d: dx %.2e, dweight %.2e, released %d",
                 what, r, ddx, ddw, j->m.released);
    }
}

static void test_vocab_parallel_threads(void)
{
    static problem p;
    make_problem(&p, 12);
    static rank_job jobs[MAX_RANKS];
    for (int ranks = 2; ranks <= 3; ranks++)
        for (int reduction = FH_PARALLEL_ALLREDUCE; reduction <= FH_PARALLEL_REDUCE_SCATTER; reduction++) {
            char what[96];
            snprintf(what, sizeof what, "vocab-parallel, %d threads, dx %s", ranks,
                     reduction ? "reduce-scattered (all-reduce and copy)" : "all-reduced");
            run_team(jobs, ranks, &p, VOCAB_PARALLEL, reduction, 0);
            check_team(jobs, ranks, &p, what, 0);
        }
}

/* dweight reduce-scattered: each rank holds its part of the dense storage (fh_parallel_dweight_part); the rest of
 * its buffer is scratch, so the other parts are taken from the ranks that hold them. */
static void test_data_parallel_threads(void)
{
    static problem p;
    make_problem(&p, 13);
    static rank_job jobs[MAX_RANKS];
    for (int ranks = 2; ranks <= 3; ranks++)
        for (int reduction = FH_PARALLEL_ALLREDUCE; reduction <= FH_PARALLEL_REDUCE_SCATTER; reduction++) {
            char what[96];
            snprintf(what, sizeof what, "data-parallel, %d threads, dweight %s", ranks,
                     reduction ? "reduce-scattered (all-reduce and copy)" : "all-reduced");
            run_team(jobs, ranks, &p, DATA_PARALLEL, reduction, 0);
            if (reduction == FH_PARALLEL_REDUCE_SCATTER)
                for (int r = 1; r < ranks; r++) { /* every part into rank 0's buffer */
                    int64_t first, count;
                    split((int64_t)V * H, ranks, r, &first, &count);
                    memcpy(jobs[0].dw + first, jobs[r].dw + first, sizeof(float) * (size_t)count);
                }
            check_team(jobs, ranks, &p, what, reduction == FH_PARALLEL_REDUCE_SCATTER);
        }
}

static void test_refused_groups_and_failed_collectives(void)
{
    team t = {.size = 1};
    pthread_barrier_init(&t.barrier, NULL, 1);
    member m = {&t, 0, 0, 0};
    fh_collectives c = collectives_of(&m);
    fh_parallel_layout *L = NULL;
    c.allgather = NULL;
    TU_CHECK(fh_parallel_layout_create(&c, NULL, V, &L) == FH_ERR_NULL_POINTER && !L, "a table without allgather");
    c = collectives_of(&m);
    c.rank = 1;
    TU_CHECK(fh_parallel_layout_create(NULL, &c, V, &L) == FH_ERR_MPI_LAYOUT && !L, "rank 1 of a one-rank group");
    TU_CHECK(m.calls == 0 && m.released == 0, "refused before any collective, nothing released");
    c = collectives_of(&m);
    t.fail_at = 1;
    TU_CHECK(fh_parallel_layout_create(&c, NULL, V, &L) == FH_ERR_MPI && !L && m.released == 0,
             "a collective failing at the layout's agreement");
    TU_CHECK(fh_parallel_layout_create(&c, NULL, V, NULL) == FH_ERR_NULL_POINTER, "a NULL layout");
    pthread_barrier_destroy(&t.barrier);

    /* Each collective of a layout's creation and of a train step failing in turn, on every rank of a team (as a
     * torn-down group would): every rank returns FH_ERR_MPI with the table's description, from the creation or from
     * the step (its gradients then partly written), and a layout that was made is released once. */
    static problem p;
    make_problem(&p, 14);
    static rank_job jobs[2];
    run_team(jobs, 2, &p, VOCAB_PARALLEL, FH_PARALLEL_ALLREDUCE, 0);
    const int total = jobs[0].m.calls;
    TU_CHECK(total >= 6, "a vocab-parallel step made %d collectives", total);
    for (int fail_at = 1; fail_at <= total; fail_at++) {
        run_team(jobs, 2, &p, VOCAB_PARALLEL, FH_PARALLEL_ALLREDUCE, fail_at);
        for (int r = 0; r < 2; r++) {
            const rank_job *j = &jobs[r];
            const int made = j->create_status == FH_OK;
            TU_CHECK((made ? j->status : j->create_status) == FH_ERR_MPI && j->m.released == made &&
                         (!made || tu_mentions(j->message, "planted failure 7")),
                     "collective %d of %d failing, rank %d: creation %d, step %d, message '%s', released %d",
                     fail_at, total, r, (int)j->create_status, (int)j->status, j->message, j->m.released);
        }
    }
}

/* ---- log-probs over a support across ranks ----------------------------------------------------------------- */

enum { SUPPORT_K = 9 };

/* Padded supports of SUPPORT_K ids per token spread over the whole vocabulary (so that every shard of 2 or 3 holds
 * some of most rows' entries, and a few rows have none in a shard), each with its target, padding in every fifth row;
 * upstream gradients on logp, the entropy and lse; the single process's outputs and gradients. */
typedef struct support_problem {
    float x[N * H], w[V * H];
    int64_t targets[N], ids[N * SUPPORT_K];
    float g_logp[N], g_entropy[N], g_lse[N];
    float logp[N], entropy[N], lse[N];
    float dx[N * H], dw[V * H];
} support_problem;

static void make_support_problem(support_problem *p, uint64_t seed)
{
    uint64_t rng = seed;
    tu_fill_uniform(p->x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(p->w, V * H, &rng, -1.0, 1.0);
    tu_fill_uniform(p->g_logp, N, &rng, -1.0, 1.0);
    tu_fill_uniform(p->g_entropy, N, &rng, -0.1, 0.1);
    tu_fill_uniform(p->g_lse, N, &rng, -0.5, 0.5);
    for (int i = 0; i < N; i++) {
        const int64_t base = (int64_t)((i * 131 + 17) % V);
        p->targets[i] = i % 7 == 3 ? -100 : base;
        for (int e = 0; e < SUPPORT_K; e++) /* 37 e mod V: distinct for e < SUPPORT_K */
            p->ids[i * SUPPORT_K + e] = i % 5 == 0 && e >= SUPPORT_K - 2 ? -1 : (base + 37 * e) % V;
    }
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, p->x, p->w, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = 0.8;
    const fh_support support = {p->ids, NULL, SUPPORT_K};
    fh_logprob_outputs out = {p->logp, p->entropy, p->lse};
    fh_linear_grads g = {.dx = p->dx, .dx_row_stride = H, .dweight = p->dw};
    TU_CHECK(fh_logprob_support_forward_backward(ctx, &lin, p->targets, &support, &o, p->g_logp, p->g_entropy,
                                                 p->g_lse, &out, &g) == FH_OK,
             "the single-process support step");
    fh_context_destroy(ctx);
}

typedef struct support_job {
    member m;
    const support_problem *p;
    int kind, split; /* split: the forward, then the backward on its saved lse and entropy */
    fh_status create_status, status;
    char message[256];
    float logp[N], entropy[N], lse[N];
    float dx[N * H], dw[V * H];
    int64_t row0, rows, col0, cols;
} support_job;

static void *run_support_rank(void *arg)
{
    support_job *j = arg;
    const support_problem *p = j->p;
    fh_parallel_layout *L = rank_layout(&j->m, j->kind, &j->row0, &j->rows, &j->col0, &j->cols, &j->create_status);
    if (!L)
        return NULL;
    fh_linear lin;
    fh_linear_init(&lin, j->rows, H, j->cols, p->x + j->row0 * H, p->w + j->col0 * H, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = 0.8;
    const int64_t r0 = j->row0;
    const fh_support support = {p->ids + r0 * SUPPORT_K, NULL, SUPPORT_K};
    fh_logprob_outputs out = {j->logp + r0, j->entropy + r0, j->lse + r0};
    fh_linear_grads g = {.dx = j->dx + r0 * H, .dx_row_stride = H, .dweight = j->dw};
    const int64_t *targets = p->targets + r0;
    if (j->split) {
        j->status = fh_parallel_logprob_support_forward(ctx, L, &lin, targets, &support, &o, &out);
        if (j->status == FH_OK)
            j->status = fh_parallel_logprob_support_backward(ctx, L, &lin, targets, &support, &o, out.lse,
                                                             out.entropy, p->g_logp + r0, p->g_entropy + r0,
                                                             p->g_lse + r0, &g);
    } else {
        j->status = fh_parallel_logprob_support_forward_backward(ctx, L, &lin, targets, &support, &o, p->g_logp + r0,
                                                                 p->g_entropy + r0, p->g_lse + r0, &out, &g);
    }
    rank_end(ctx, L, j->status, j->message, sizeof j->message);
    return NULL;
}

/* Vocab- and data-parallel teams of 2 and 3 threads, the single call and the forward then the backward: every rank's
 * per-token outputs (its tokens) within 1e-6 of the single process's (relative to 1 + |value|: statistics combined in
 * double), dx (vocab: every rank's all-reduced rows) and the dweight shard (data: all-reduced) within 1e-5 normwise. */
static void test_support_threads(void)
{
    static support_problem p;
    make_support_problem(&p, 15);
    static support_job jobs[MAX_RANKS];
    for (int kind = VOCAB_PARALLEL; kind <= DATA_PARALLEL; kind++)
        for (int ranks = 2; ranks <= 3; ranks++)
            for (int split_calls = 0; split_calls < 2; split_calls++) {
                for (int r = 0; r < ranks; r++) {
                    memset(&jobs[r], 0, sizeof jobs[r]);
                    jobs[r].p = &p;
                    jobs[r].kind = kind;
                    jobs[r].split = split_calls;
                }
                run_threads(ranks, 0, run_support_rank, jobs, sizeof jobs[0]);
                for (int r = 0; r < ranks; r++) {
                    const support_job *j = &jobs[r];
                    TU_CHECK(j->create_status == FH_OK && j->status == FH_OK,
                             "support, %s, %d ranks, rank %d: %d / %d (%s)", kind == VOCAB_PARALLEL ? "vocab" : "data",
                             ranks, r, (int)j->create_status, (int)j->status, j->message);
                    if (j->status != FH_OK)
                        continue;
                    double worst = 0.0;
                    for (int64_t i = j->row0; i < j->row0 + j->rows; i++) {
                        const float got[3] = {j->logp[i], j->entropy[i], j->lse[i]};
                        const float want[3] = {p.logp[i], p.entropy[i], p.lse[i]};
                        for (int k = 0; k < 3; k++)
                            worst = fmax(worst, fabs((double)got[k] - want[k]) / (1.0 + fabs((double)want[k])));
                    }
                    const double ddx = tu_norm_rel_f(j->dx + j->row0 * H, p.dx + j->row0 * H, (size_t)(j->rows * H));
                    const double ddw = tu_norm_rel_f(j->dw, p.dw + j->col0 * H, (size_t)(j->cols * H));
                    TU_CHECK(worst <= 1e-6 && ddx <= 1e-5 && ddw <= 1e-5,
                             "support, %s, %d ranks%s, rank %d: per-token %.2e, dx %.2e, dweight %.2e",
                             kind == VOCAB_PARALLEL ? "vocab" : "data", ranks, split_calls ? ", split" : "", r, worst,
                             ddx, ddw);
                }
            }
}

static const tu_test tests[] = {
    {"a layout of one-rank groups gives the single process's step", test_one_rank_layout},
    {"vocab-parallel threads: loss, dx and the dweight shard, dx all-reduced or reduce-scattered",
     test_vocab_parallel_threads},
    {"data-parallel threads: loss, their dx rows, dweight all-reduced or reduce-scattered", test_data_parallel_threads},
    {"groups refused, collectives failing at creation and inside a pass", test_refused_groups_and_failed_collectives},
    {"log-probs over a support: vocab- and data-parallel threads, single call and split", test_support_threads},
};
const tu_suite suite_parallel = {tests, TU_COUNT(tests)};
