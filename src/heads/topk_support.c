/* Top-k supports of a distillation pair (topk_support.h). The divergence over a row's support S, with lp = s - lse_s
 * and lq = t - lse_t the full-vocabulary log-probabilities at its entries and L_p = logsumexp_S(lp):
 *   xs = lp - L_p (renormalised) or lp plus the tail entry log(1 - exp(min(L_p, -1e-7))); xt likewise;
 *   D = sum over the entries of f(xs, xt):  forward KL q (xt - xs), reverse KL p (xs - xt),
 *       jsd beta q (xt - log m) + (1 - beta) p (xs - log m), m = beta q + (1 - beta) p  (p = exp(xs), q = exp(xt));
 *   G = df/dxs:  forward -q,  reverse p (xs - xt + 1),  jsd (1 - beta) p (xs - log m)  (the m terms cancel).
 * Back to lp (pi = softmax_S(lp)): renormalised, dD/dlp_e = G_e - pi_e sum G; with the tail,
 * dD/dlp_e = G_e + G_tail c pi_e, c = d tail / d L_p = -exp(L_p) / (1 - exp(L_p)) where TRL's clamp lets L_p through
 * (0 where it holds it). Then dD/ds_j = g_j [j in S] - p_j sum g (lp = s - lse_s): the dense coefficient is -sum g,
 * 0 without the tail (sum g = 0 there). Everything past the logits is in double. */
#include "topk_support.h"

#include <math.h>
#include <stdlib.h>

/* TRL's _add_tail_bucket clamps logsumexp(top-k) to at most -1e-7, so that 1 - exp(.) stays positive. */
static const double TAIL_CLAMP = -1e-7;

/* An empty place: worse than any column, and past every id when the heap is sorted by id. */
static const fh_topk_entry EMPTY = {-INFINITY, -INFINITY, INT64_MAX};

static int heaps_of(fh_topk_select select)
{
    return select == FH_TOPK_UNION ? 2 : 1;
}

/* Heap h of a row is keyed by the teacher's logit (the first heap unless only the student's is kept). */
static int keyed_by_teacher(const fh_topk_rows *r, int h)
{
    return h == 0 && r->select != FH_TOPK_STUDENT;
}

static fh_topk_entry *heap(const fh_topk_rows *r, int64_t i, int h)
{
    return r->entries + ((size_t)i * (size_t)heaps_of(r->select) + (size_t)h) * (size_t)r->k;
}

size_t fh_topk_row_bytes(int64_t k, int heaps)
{
    return (size_t)k * (size_t)heaps * sizeof(fh_topk_entry);
}

fh_topk_rows fh_topk_rows_begin(void *head_rows, int64_t n, int64_t k, fh_topk_select select, int add_tail,
                                double beta, float inv_t)
{
    const fh_topk_rows r = {head_rows, k, select, add_tail, beta, inv_t};
    const size_t entries = (size_t)n * (size_t)heaps_of(select) * (size_t)k;
    for (size_t e = 0; e < entries; e++)
        r.entries[e] = EMPTY;
    return r;
}

/* a leaves the heap before b: a smaller key, or an equal key at a higher column. */
static int worse(float key_a, int64_t id_a, float key_b, int64_t id_b)
{
    return key_a < key_b || (key_a == key_b && id_a > id_b);
}

static float key_of(const fh_topk_entry *e, int by_teacher)
{
    return by_teacher ? e->t : e->s;
}

/* Puts e in place of the heap's root (its worst entry) and restores the order. */
static void replace_root(fh_topk_entry *h, int64_t k, int by_teacher, fh_topk_entry e)
{
    const float key = key_of(&e, by_teacher);
    int64_t at = 0;
    for (;;) {
        int64_t child = 2 * at + 1;
        if (child >= k)
            break;
        if (child + 1 < k && worse(key_of(&h[child + 1], by_teacher), h[child + 1].id, key_of(&h[child], by_teacher),
                                   h[child].id))
            child++;
        if (!worse(key_of(&h[child], by_teacher), h[child].id, key, e.id))
            break;
        h[at] = h[child];
        at = child;
    }
    h[at] = e;
}

void fh_topk_rows_fold(const fh_topk_rows *r, int64_t i, const float *z, const float *cz, int64_t count,
                       int64_t first_column)
{
    const float it = r->inv_t;
    for (int h = 0; h < heaps_of(r->select); h++) {
        fh_topk_entry *top = heap(r, i, h);
        const int by_teacher = keyed_by_teacher(r, h);
        const float *keys = by_teacher ? cz : z;
        float root = key_of(&top[0], by_teacher);
        for (int64_t c = 0; c < count; c++) {
            const float key = it * keys[c];
            if (key < root || (key == root && first_column + c > top[0].id))
                continue;
            const fh_topk_entry e = {it * z[c], it * cz[c], first_column + c};
            replace_root(top, r->k, by_teacher, e);
            root = key_of(&top[0], by_teacher);
        }
    }
}

static int by_id(const void *a, const void *b)
{
    const int64_t x = ((const fh_topk_entry *)a)->id, y = ((const fh_topk_entry *)b)->id;
    return (x > y) - (x < y);
}

/* The first entry of a heap sorted by id whose id is >= id (k if none). */
static int64_t first_at_least(const fh_topk_entry *e, int64_t k, int64_t id)
{
    int64_t lo = 0, hi = k;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (e[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Sorts the heaps by id and, for the union, takes the student's entries that the teacher's heap holds out (emptied,
 * moved to the end): every column of the support once. */
static void make_support(const fh_topk_rows *r, int64_t i)
{
    const int heaps = heaps_of(r->select);
    for (int h = 0; h < heaps; h++)
        qsort(heap(r, i, h), (size_t)r->k, sizeof(fh_topk_entry), by_id);
    if (heaps < 2)
        return;
    const fh_topk_entry *teacher = heap(r, i, 0);
    fh_topk_entry *student = heap(r, i, 1);
    int64_t kept = 0;
    for (int64_t e = 0; e < r->k; e++) {
        const int64_t at = first_at_least(teacher, r->k, student[e].id);
        if (!(at < r->k && teacher[at].id == student[e].id))
            student[kept++] = student[e];
    }
    for (int64_t e = kept; e < r->k; e++)
        student[e] = EMPTY;
}

/* a (la - lb), 0 when a is 0 (an underflowed probability adds nothing, as TRL's nan_to_num). */
static double plog(double a, double la, double lb)
{
    return a == 0.0 ? 0.0 : a * (la - lb);
}

/* f(xs, xt) of the divergence, and G = df/dxs. */
static double divergence_term(const fh_topk_rows *r, double xs, double xt, double *g)
{
    const double p = exp(xs), q = exp(xt);
    switch (r->select) {
    case FH_TOPK_TEACHER:
        *g = -q;
        return plog(q, xt, xs);
    case FH_TOPK_STUDENT:
        *g = p == 0.0 ? 0.0 : p * (xs - xt + 1.0);
        return plog(p, xs, xt);
    default: {
        const double beta = r->beta, lm = log(beta * q + (1.0 - beta) * p);
        *g = (1.0 - beta) * plog(p, xs, lm);
        return beta * plog(q, xt, lm) + (1.0 - beta) * plog(p, xs, lm);
    }
    }
}

/* Visits each entry e of row i's support. */
#define FOR_SUPPORT(r, i, e)                                                                                          \
    for (int h_ = 0; h_ < heaps_of((r)->select); h_++)                                                               \
        for (fh_topk_entry *e = heap((r), (i), h_), *end_ = e + (r)->k; e < end_ && e->id != INT64_MAX; e++)

double fh_topk_rows_finish(const fh_topk_rows *r, int64_t i, double lse_s, double lse_t, double *dense)
{
    make_support(r, i);
    /* L_p and L_q: the support's log-sum-exps of the log-probabilities */
    double max_p = -INFINITY, max_q = -INFINITY;
    FOR_SUPPORT(r, i, e) {
        max_p = fmax(max_p, e->s - lse_s);
        max_q = fmax(max_q, e->t - lse_t);
    }
    double sum_p = 0.0, sum_q = 0.0;
    FOR_SUPPORT(r, i, e) {
        sum_p += exp(e->s - lse_s - max_p);
        sum_q += exp(e->t - lse_t - max_q);
    }
    const double l_p = max_p + log(sum_p), l_q = max_q + log(sum_q);
    const double shift_p = r->add_tail ? 0.0 : l_p, shift_q = r->add_tail ? 0.0 : l_q;
    /* D and the sum of the entries' G */
    double d = 0.0, sum_g = 0.0;
    FOR_SUPPORT(r, i, e) {
        double g;
        d += divergence_term(r, e->s - lse_s - shift_p, e->t - lse_t - shift_q, &g);
        sum_g += g;
    }
    double g_tail = 0.0, c = 0.0;
    if (r->add_tail) {
        const double tail_p = log(-expm1(fmin(l_p, TAIL_CLAMP))), tail_q = log(-expm1(fmin(l_q, TAIL_CLAMP)));
        d += divergence_term(r, tail_p, tail_q, &g_tail);
        c = l_p <= TAIL_CLAMP ? -exp(l_p) / -expm1(l_p) : 0.0;
    }
    /* dD/dlp per entry (into s, its logit no longer needed; G formed again), and the dense coefficient -sum of them */
    double sum_dlp = 0.0;
    FOR_SUPPORT(r, i, e) {
        double g;
        (void)divergence_term(r, e->s - lse_s - shift_p, e->t - lse_t - shift_q, &g);
        const double pi = exp(e->s - lse_s - l_p);
        const double dlp = r->add_tail ? g + g_tail * c * pi : g - pi * sum_g;
        e->s = (float)dlp;
        sum_dlp += dlp;
    }
    *dense = r->add_tail ? -sum_dlp : 0.0;
    return d;
}

void fh_topk_rows_scatter(const fh_topk_rows *r, int64_t i, float scale, float *du, int64_t count,
                          int64_t first_column)
{
    for (int h = 0; h < heaps_of(r->select); h++) {
        const fh_topk_entry *e = heap(r, i, h);
        for (int64_t at = first_at_least(e, r->k, first_column); at < r->k && e[at].id < first_column + count; at++)
            du[e[at].id - first_column] += scale * e[at].s;
    }
}
