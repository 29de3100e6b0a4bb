/* TRL's current DPO loss types (DPOTrainer._compute_loss, huggingface/trl f2cd5771): each term and its
 * derivatives with respect to the summed log-probs c and r. cs = c - ref_c, rs = r - ref_r, d = cs - rs. */
#include "dpo_loss_types.h"

int fh_dpo_type_count(const fh_preference_options *o)
{
    return o->loss_type_count ? o->loss_type_count : 1;
}

fh_preference_loss_type fh_dpo_type(const fh_preference_options *o, int k)
{
    return o->loss_type_count ? o->loss_types[k] : o->loss_type;
}

double fh_dpo_weight(const fh_preference_options *o, int k)
{
    return o->loss_type_count ? o->loss_weights[k] : 1.0;
}

int fh_dpo_lists(const fh_preference_options *o, fh_preference_loss_type type)
{
    for (int k = 0; k < fh_dpo_type_count(o); k++)
        if (fh_dpo_type(o, k) == type)
            return 1;
    return 0;
}

double fh_dpo_weight_of(const fh_preference_options *o, fh_preference_loss_type type)
{
    double w = 0.0;
    for (int k = 0; k < fh_dpo_type_count(o); k++)
        w += fh_dpo_type(o, k) == type ? fh_dpo_weight(o, k) : 0.0;
    return w;
}

/* -(1 - ls) log sig(beta u) - ls log sig(-beta u) (sigmoid with label smoothing: aot's form) and d/du. */
static double smoothed_sigmoid(double beta, double ls, double u, double *slope)
{
    *slope = -(1.0 - ls) * beta * fh_sigmoid(-beta * u) + ls * beta * fh_sigmoid(beta * u);
    return -(1.0 - ls) * fh_log_sigmoid(beta * u) - ls * fh_log_sigmoid(-beta * u);
}

/* One term: its value, and its derivatives with respect to cs and rs in *s_c, *s_r (those with respect to c and r:
 * the reference is a constant). */
static double term(const fh_preference_options *o, fh_preference_loss_type type, const fh_dpo_pair *p, double *s_c,
                   double *s_r)
{
    const double beta = o->beta, ls = o->label_smoothing;
    const double cs = p->c - p->ref_c, rs = p->r - p->ref_r, d = cs - rs, x = beta * d;
    double value = 0.0, s = 0.0; /* s: the derivative with respect to d, for the terms of d alone */
    *s_c = *s_r = 0.0;
    switch (type) {
    case FH_PREFERENCE_SIGMOID: value = -fh_log_sigmoid(x), s = -beta * fh_sigmoid(-x); break;
    case FH_PREFERENCE_HINGE:
        value = fmax(1.0 - x, 0.0);
        s = 1.0 - x > 0.0 ? -beta : 0.0; /* relu's gradient is 0 at 0, as torch's */
        break;
    case FH_PREFERENCE_ROBUST:
        value = (-(1.0 - ls) * fh_log_sigmoid(x) + ls * fh_log_sigmoid(-x)) / (1.0 - 2.0 * ls);
        s = (-(1.0 - ls) * beta * fh_sigmoid(-x) - ls * beta * fh_sigmoid(x)) / (1.0 - 2.0 * ls);
        break;
    case FH_PREFERENCE_EXO_PAIR:
        /* d/dx [sig(x)(log sig(x) - log(1 - ls)) + sig(-x)(log sig(-x) - log ls)] = sig(x) sig(-x) (x - log(1 - ls)
         * + log ls), as log sig(x) - log sig(-x) = x. */
        value = fh_sigmoid(x) * (fh_log_sigmoid(x) - log1p(-ls)) + fh_sigmoid(-x) * (fh_log_sigmoid(-x) - log(ls));
        s = beta * fh_sigmoid(x) * fh_sigmoid(-x) * (x - log1p(-ls) + log(ls));
        break;
    case FH_PREFERENCE_DISCOPOP: {
        const double q = fh_sigmoid(x / o->discopop_tau), logistic = -fh_log_sigmoid(x), exponential = exp(-x);
        value = logistic * (1.0 - q) + exponential * q;
        s = beta * (-fh_sigmoid(-x) * (1.0 - q) - exponential * q +
                    (exponential - logistic) * q * (1.0 - q) / o->discopop_tau);
        break;
    }
    case FH_PREFERENCE_APO_DOWN:
        value = fh_sigmoid(beta * cs) + 1.0 - fh_sigmoid(x);
        *s_c = beta * fh_sigmoid(beta * cs) * fh_sigmoid(-beta * cs);
        s = -beta * fh_sigmoid(x) * fh_sigmoid(-x);
        break;
    case FH_PREFERENCE_NCA_PAIR:
        value = -fh_log_sigmoid(beta * cs) - 0.5 * fh_log_sigmoid(-beta * cs) - 0.5 * fh_log_sigmoid(-beta * rs);
        *s_c = beta * (-fh_sigmoid(-beta * cs) + 0.5 * fh_sigmoid(beta * cs));
        *s_r = 0.5 * beta * fh_sigmoid(beta * rs);
        break;
    case FH_PREFERENCE_BCO_PAIR:
        value = -fh_log_sigmoid(beta * cs) - fh_log_sigmoid(-beta * rs);
        *s_c = -beta * fh_sigmoid(-beta * cs);
        *s_r = beta * fh_sigmoid(beta * rs);
        break;
    case FH_PREFERENCE_SPPO_HARD:
        value = (cs - 0.5 / beta) * (cs - 0.5 / beta) + (rs + 0.5 / beta) * (rs + 0.5 / beta);
        *s_c = 2.0 * (cs - 0.5 / beta);
        *s_r = 2.0 * (rs + 0.5 / beta);
        break;
    case FH_PREFERENCE_APO_ZERO:
        value = 1.0 - fh_sigmoid(beta * cs) + fh_sigmoid(beta * rs);
        *s_c = -beta * fh_sigmoid(beta * cs) * fh_sigmoid(-beta * cs);
        *s_r = beta * fh_sigmoid(beta * rs) * fh_sigmoid(-beta * rs);
        break;
    case FH_PREFERENCE_IPO:
    case FH_PREFERENCE_SIGMOID_NORM: {
        /* TRL divides each sequence's score by its completion length here only. */
        const double u = cs / p->n_c - rs / p->n_r;
        double du;
        if (type == FH_PREFERENCE_IPO) {
            value = (u - 1.0 / (2.0 * beta)) * (u - 1.0 / (2.0 * beta));
            du = 2.0 * (u - 1.0 / (2.0 * beta));
        } else {
            value = -fh_log_sigmoid(beta * u);
            du = -beta * fh_sigmoid(-beta * u);
        }
        *s_c = du / p->n_c;
        *s_r = -du / p->n_r;
        break;
    }
    default: break; /* aot, aot_unpaired, sft: not a pair's own */
    }
    *s_c += s;
    *s_r -= s;
    return value;
}

double fh_dpo_pair_terms(const fh_preference_options *o, const fh_dpo_pair *p, double *d_c, double *d_r)
{
    double loss = 0.0;
    *d_c = *d_r = 0.0;
    for (int k = 0; k < fh_dpo_type_count(o); k++) {
        double s_c, s_r;
        const double w = fh_dpo_weight(o, k), value = term(o, fh_dpo_type(o, k), p, &s_c, &s_r);
        loss += w * value;
        *d_c += w * s_c;
        *d_r += w * s_r;
    }
    return loss;
}

/* The value aot (of c - r, or of ref_c - ref_r) or aot_unpaired (of cs, or of rs) sorts, for pair b. */
typedef enum sort_key { KEY_LOGRATIO, KEY_REF_LOGRATIO, KEY_CHOSEN_SCORE, KEY_REJECTED_SCORE } sort_key;

static double key_of(sort_key key, int64_t pairs, const double *l, const double *ref, int64_t b)
{
    switch (key) {
    case KEY_LOGRATIO: return l[b] - l[pairs + b];
    case KEY_REF_LOGRATIO: return ref[b] - ref[pairs + b];
    case KEY_CHOSEN_SCORE: return l[b] - ref[b];
    default: return l[pairs + b] - ref[pairs + b];
    }
}

/* Whether pair a sorts before pair b: by ascending key, ties by index (so a total order, and the order a stable sort
 * gives: -0.0 and 0.0 tie). */
static int before(sort_key key, int64_t pairs, const double *l, const double *ref, int64_t a, int64_t b)
{
    const double ka = key_of(key, pairs, l, ref, a), kb = key_of(key, pairs, l, ref, b);
    return ka < kb || (!(ka > kb) && a < b);
}

/* order[0 .. B): the pairs by ascending key, ties by index. A heap sort, O(B log B) in place (B may be a large
 * batch's pair count; the order slots hold nothing else). */
static void sort_pairs(sort_key key, int64_t pairs, const double *l, const double *ref, int64_t *order)
{
    for (int64_t k = 0; k < pairs; k++)
        order[k] = k;
    for (int64_t end = pairs, start = pairs / 2; end > 1;) {
        if (start > 0) {
            start--; /* building the heap */
        } else {
            end--; /* the largest to the end */
            const int64_t top = order[0];
            order[0] = order[end];
            order[end] = top;
        }
        for (int64_t root = start;;) { /* sift down within [0, end) */
            int64_t child = 2 * root + 1;
            if (child >= end)
                break;
            if (child + 1 < end && before(key, pairs, l, ref, order[child], order[child + 1]))
                child++;
            if (!before(key, pairs, l, ref, order[root], order[child]))
                break;
            const int64_t t = order[root];
            order[root] = order[child];
            order[child] = t;
            root = child;
        }
    }
}

double fh_dpo_sorted_terms(const fh_preference_options *o, int64_t pairs, const double *l, const double *ref,
                           int64_t *order, double scale, double *d)
{
    double loss = 0.0;
    for (int unpaired = 0; unpaired < 2; unpaired++) {
        const double w = fh_dpo_weight_of(o, unpaired ? FH_PREFERENCE_AOT_UNPAIRED : FH_PREFERENCE_AOT);
        if (!fh_dpo_lists(o, unpaired ? FH_PREFERENCE_AOT_UNPAIRED : FH_PREFERENCE_AOT))
            continue;
        /* aot: delta_k = sorted(c - r)_k - sorted(ref_c - ref_r)_k, whose gradient reaches c and r of the pair at
         * order_a[k]; aot_unpaired: sorted(cs)_k - sorted(rs)_k, reaching c of order_a[k] and r of order_b[k]. */
        int64_t *order_a = order, *order_b = order + pairs;
        sort_pairs(unpaired ? KEY_CHOSEN_SCORE : KEY_LOGRATIO, pairs, l, ref, order_a);
        sort_pairs(unpaired ? KEY_REJECTED_SCORE : KEY_REF_LOGRATIO, pairs, l, ref, order_b);
        for (int64_t k = 0; k < pairs; k++) {
            const int64_t a = order_a[k], b = order_b[k];
            const double delta = unpaired ? (l[a] - ref[a]) - (l[pairs + b] - ref[pairs + b])
                                          : (l[a] - l[pairs + a]) - (ref[b] - ref[pairs + b]);
            double slope;
            loss += w * smoothed_sigmoid(o->beta, o->label_smoothing, delta, &slope);
            if (d) {
                d[a] += scale * w * slope;
                d[pairs + (unpaired ? b : a)] -= scale * w * slope;
            }
        }
    }
    return loss;
}
