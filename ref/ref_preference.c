/* The preference reference: TRL's DPO, CPO/SimPO and ORPO losses written out in double, all logits materialized.
 *
 * TRL facts this follows (huggingface/trl: DPOTrainer.dpo_loss, CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss
 * and their get_batch_loss_metrics), in the form fusedhead.h fixes:
 *  - sequence log-probs are (per_token_logps * loss_mask).sum(-1), divided by the mask's sum for ipo (DPO and
 *    CPO: average_log_prob when loss_type == "ipo"), simpo and orpo; the division is clamped to >= 1 here, so that
 *    a sequence with no tokens has l = 0 rather than TRL's 0 / 0.
 *  - dpo: logits = (pi_c - pi_r) - (ref_c - ref_r) (reference_free: ref 0). sigmoid, robust, hinge and ipo are
 *    TRL's formulas; robust divides by 1 - 2 ls. rpo_alpha adds rpo_alpha * nll_loss to every pair's loss, so
 *    the mean adds it once.
 *  - cpo: the same loss types without a reference, ipo on averaged log-probs; simpo: logits minus
 *    simpo_gamma / beta, the sigmoid form with label smoothing; loss = losses.mean() + cpo_alpha * nll_loss.
 *  - orpo: log_odds = (c - r) - (log1p(-exp(c)) - log1p(-exp(r))) on averaged log-probs (written
 *    log(-expm1(c)) here, the same value without cancellation); loss = nll - beta * logsigmoid(log_odds).mean().
 *  - nll_loss: cross-entropy on the chosen half, mean over its (mask-weighted) tokens.
 *  - rewards: beta * (policy - reference) for dpo, beta * policy for cpo, simpo and orpo; accuracies
 *    (chosen > rejected).float().mean(); logits/chosen is the mean of the chosen half's logits over its masked
 *    tokens for dpo (DPOTrainer), over all its tokens for cpo, simpo and orpo (CPOTrainer, ORPOTrainer). */
#include "ref_preference.h"

#include "ref_grpo.h"
#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

void ref_preference_options_default(ref_preference_options *o)
{
    o->loss = REF_PREFERENCE_DPO;
    o->loss_type = REF_PREFERENCE_SIGMOID;
    o->beta = 0.1;
    o->label_smoothing = 0.0;
    o->simpo_gamma = 0.5;
    o->rpo_alpha = 0.0;
    o->cpo_alpha = 1.0;
    o->dpo_semantics = REF_PREFERENCE_TRL_CURRENT;
    o->count = 0;
    o->discopop_tau = 0.05;
}

static int current(const ref_preference_options *o)
{
    return o->loss == REF_PREFERENCE_DPO && o->dpo_semantics == REF_PREFERENCE_TRL_CURRENT;
}

/* The listed types (loss_type alone, weight 1, when count is 0). */
static int type_count(const ref_preference_options *o)
{
    return o->count ? o->count : 1;
}

static ref_preference_loss_type type_at(const ref_preference_options *o, int k)
{
    return o->count ? o->types[k] : o->loss_type;
}

static double weight_at(const ref_preference_options *o, int k)
{
    return o->count ? o->weights[k] : 1.0;
}

static int lists(const ref_preference_options *o, ref_preference_loss_type type)
{
    int found = 0;
    for (int k = 0; k < type_count(o); k++)
        found |= type_at(o, k) == type;
    return found;
}

int ref_preference_averaged(const ref_preference_options *o)
{
    return !current(o) && (o->loss == REF_PREFERENCE_SIMPO || o->loss == REF_PREFERENCE_ORPO || o->loss_type == REF_PREFERENCE_IPO);
}

/* TRL's loss_type choices of each loss. */
static int has_loss_type(const ref_preference_options *o, ref_preference_loss_type type)
{
    if (type < REF_PREFERENCE_SIGMOID || type >= REF_PREFERENCE_LOSS_TYPES)
        return 0;
    switch (o->loss) {
    case REF_PREFERENCE_DPO: return current(o) || type <= REF_PREFERENCE_ROBUST;
    case REF_PREFERENCE_CPO: return type != REF_PREFERENCE_ROBUST;
    default: return type == REF_PREFERENCE_SIGMOID;
    }
}

static int options_valid(const ref_preference_options *o)
{
    if (!o || o->loss < REF_PREFERENCE_DPO || o->loss > REF_PREFERENCE_CPO ||
        (o->dpo_semantics != REF_PREFERENCE_TRL_CURRENT && o->dpo_semantics != REF_PREFERENCE_TRL_0_28) ||
        o->count < 0 || o->count > 16 || (o->count > 0 && !current(o)))
        return 0;
    for (int k = 0; k < type_count(o); k++)
        if (!has_loss_type(o, type_at(o, k)) || !isfinite(weight_at(o, k)))
            return 0;
    const double ls = o->label_smoothing;
    const int current_ok = !current(o) || (o->rpo_alpha == 0.0 && (!lists(o, REF_PREFERENCE_EXO_PAIR) || ls > 0.0) &&
                                           (!lists(o, REF_PREFERENCE_DISCOPOP) || o->discopop_tau > 0.0));
    return current_ok && o->beta > 0.0 && isfinite(o->beta) && ls >= 0.0 &&
           (lists(o, REF_PREFERENCE_ROBUST) ? ls < 0.5 : ls <= 0.5) && isfinite(o->simpo_gamma) &&
           isfinite(o->rpo_alpha) && isfinite(o->cpo_alpha);
}

/* The NLL term's weight. */
static double nll_alpha(const ref_preference_options *o)
{
    if (current(o)) {
        double w = 0.0;
        for (int k = 0; k < type_count(o); k++)
            w += type_at(o, k) == REF_PREFERENCE_SFT ? weight_at(o, k) : 0.0;
        return w;
    }
    return o->loss == REF_PREFERENCE_DPO ? o->rpo_alpha : o->loss == REF_PREFERENCE_ORPO ? 1.0 : o->cpo_alpha;
}

static double log_sigmoid(double x)
{
    return x >= 0.0 ? -log1p(exp(-x)) : x - log1p(exp(x));
}

static double sigmoid(double x)
{
    return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

/* d sigmoid(y) / dy. */
static double sigmoid_slope(double y)
{
    return sigmoid(y) * sigmoid(-y);
}

/* The ranks of B keys, ascending, ties by index: at[k] is the pair at sorted position k. */
static void sorted_positions(const double *key, int64_t pairs, int64_t *at)
{
    for (int64_t b = 0; b < pairs; b++) {
        int64_t rank = 0;
        for (int64_t j = 0; j < pairs; j++)
            rank += key[j] < key[b] || (key[j] == key[b] && j < b);
        at[rank] = b;
    }
}

/* aot (sorted c - r against sorted ref_c - ref_r) or aot_unpaired (sorted cs against sorted rs): the sum over the
 * sorted positions of the smoothed sigmoid term; w times its derivatives added to dl. Returns -1 without memory. */
static int sorted_term(const ref_preference_options *o, int unpaired, int64_t B, const double *l, const double *ref,
                       double w, double *total, double *dl)
{
    double *first = malloc(sizeof(double) * (size_t)B), *second = malloc(sizeof(double) * (size_t)B);
    int64_t *at_first = malloc(sizeof(int64_t) * (size_t)B), *at_second = malloc(sizeof(int64_t) * (size_t)B);
    if (!first || !second || !at_first || !at_second) {
        free(first), free(second), free(at_first), free(at_second);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        first[b] = unpaired ? l[b] - ref[b] : l[b] - l[B + b];
        second[b] = unpaired ? l[B + b] - ref[B + b] : ref[b] - ref[B + b];
    }
    sorted_positions(first, B, at_first);
    sorted_positions(second, B, at_second);
    const double beta = o->beta, ls = o->label_smoothing;
    for (int64_t k = 0; k < B; k++) {
        const int64_t a = at_first[k], b = at_second[k];
        const double y = beta * (first[a] - second[b]);
        *total += w * (-(1.0 - ls) * log_sigmoid(y) - ls * log_sigmoid(-y));
        const double slope = beta * (-(1.0 - ls) * sigmoid(-y) + ls * sigmoid(y));
        /* aot: first[a] = c_a - r_a; aot_unpaired: first[a] = c_a - ref_c_a and second[b] = r_b - ref_r_b. */
        dl[a] += w * slope;
        dl[B + (unpaired ? b : a)] -= w * slope;
    }
    free(first), free(second), free(at_first), free(at_second);
    return 0;
}

/* TRL's current DPO over the call's B pairs, from summed l and ref and the counts n = max(sum m, 1): the sum over
 * pairs of the weighted terms (aot's over sorted positions; sft, the NLL, aside), with its derivatives with respect to
 * each l added to dl. Returns -1 without memory. */
static int current_terms(const ref_preference_options *o, int64_t B, const double *l, const double *ref,
                         const double *n, double *total, double *dl)
{
    const double beta = o->beta, ls = o->label_smoothing;
    *total = 0.0;
    for (int k = 0; k < type_count(o); k++) {
        const ref_preference_loss_type type = type_at(o, k);
        const double w = weight_at(o, k);
        if (type == REF_PREFERENCE_AOT || type == REF_PREFERENCE_AOT_UNPAIRED) {
            if (sorted_term(o, type == REF_PREFERENCE_AOT_UNPAIRED, B, l, ref, w, total, dl))
                return -1;
            continue;
        }
        for (int64_t b = 0; b < B && type != REF_PREFERENCE_SFT; b++) {
            const double cs = l[b] - ref[b], rs = l[B + b] - ref[B + b], x = beta * (cs - rs);
            const double u = cs / n[b] - rs / n[B + b]; /* ipo, sigmoid_norm: per-token scores */
            double v = 0.0, gc = 0.0, gr = 0.0, gx = 0.0; /* d v / d cs, d v / d rs, d v / d x */
            switch (type) {
            case REF_PREFERENCE_SIGMOID: v = -log_sigmoid(x), gx = -sigmoid(-x); break;
            case REF_PREFERENCE_HINGE: v = 1.0 - x > 0.0 ? 1.0 - x : 0.0, gx = 1.0 - x > 0.0 ? -1.0 : 0.0; break;
            case REF_PREFERENCE_ROBUST:
                v = (-(1.0 - ls) * log_sigmoid(x) + ls * log_sigmoid(-x)) / (1.0 - 2.0 * ls);
                gx = (-(1.0 - ls) * sigmoid(-x) - ls * sigmoid(x)) / (1.0 - 2.0 * ls);
                break;
            case REF_PREFERENCE_EXO_PAIR: {
                const double qw = sigmoid(x), ql = sigmoid(-x);
                const double tw = log_sigmoid(x) - log(1.0 - ls), tl = log_sigmoid(-x) - log(ls);
                v = qw * tw + ql * tl;
                /* d qw = qw ql, d log sig(x) = ql; d ql = -qw ql, d log sig(-x) = -qw */
                gx = qw * ql * tw + qw * ql - qw * ql * tl - ql * qw;
                break;
            }
            case REF_PREFERENCE_DISCOPOP: {
                const double mod = sigmoid(x / o->discopop_tau), a = -log_sigmoid(x), e = exp(-x);
                const double dmod = mod * (1.0 - mod) / o->discopop_tau;
                v = a * (1.0 - mod) + e * mod;
                gx = -sigmoid(-x) * (1.0 - mod) - a * dmod - e * mod + e * dmod;
                break;
            }
            case REF_PREFERENCE_NCA_PAIR:
                v = -log_sigmoid(beta * cs) - 0.5 * log_sigmoid(-beta * cs) - 0.5 * log_sigmoid(-beta * rs);
                gc = beta * (-sigmoid(-beta * cs) + 0.5 * sigmoid(beta * cs));
                gr = beta * 0.5 * sigmoid(beta * rs);
                break;
            case REF_PREFERENCE_BCO_PAIR:
                v = -log_sigmoid(beta * cs) - log_sigmoid(-beta * rs);
                gc = -beta * sigmoid(-beta * cs);
                gr = beta * sigmoid(beta * rs);
                break;
            case REF_PREFERENCE_SPPO_HARD:
                v = pow(cs - 0.5 / beta, 2.0) + pow(rs + 0.5 / beta, 2.0);
                gc = 2.0 * (cs - 0.5 / beta);
                gr = 2.0 * (rs + 0.5 / beta);
                break;
            case REF_PREFERENCE_APO_ZERO:
                v = 1.0 - sigmoid(beta * cs) + sigmoid(beta * rs);
                gc = -beta * sigmoid_slope(beta * cs);
                gr = beta * sigmoid_slope(beta * rs);
                break;
            case REF_PREFERENCE_APO_DOWN:
                v = sigmoid(beta * cs) + 1.0 - sigmoid(x);
                gc = beta * sigmoid_slope(beta * cs);
                gx = -sigmoid_slope(x);
                break;
            case REF_PREFERENCE_IPO:
                v = pow(u - 1.0 / (2.0 * beta), 2.0);
                gc = 2.0 * (u - 1.0 / (2.0 * beta)) / n[b];
                gr = -2.0 * (u - 1.0 / (2.0 * beta)) / n[B + b];
                break;
            default: /* sigmoid_norm */
                v = -log_sigmoid(beta * u);
                gc = -beta * sigmoid(-beta * u) / n[b];
                gr = beta * sigmoid(-beta * u) / n[B + b];
                break;
            }
            /* x = beta (cs - rs) */
            *total += w * v;
            dl[b] += w * (gc + beta * gx);
            dl[B + b] += w * (gr - beta * gx);
        }
    }
    return 0;
}

/* One pair: its loss, d loss / d c and d loss / d r, and orpo's log odds (NaN otherwise). */
typedef struct pair_terms {
    double loss, d_chosen, d_rejected, log_odds;
} pair_terms;

static pair_terms pair_of(const ref_preference_options *o, double c, double r, double ref_c, double ref_r)
{
    const double beta = o->beta, ls = o->label_smoothing;
    pair_terms p = {0.0, 0.0, 0.0, NAN};
    if (o->loss == REF_PREFERENCE_ORPO) {
        /* d o / d c = 1 + e^c / (1 - e^c) = 1 / (1 - e^c); d o / d r = -1 / (1 - e^r). */
        p.log_odds = (c - r) - (log(-expm1(c)) - log(-expm1(r)));
        p.loss = -beta * log_sigmoid(p.log_odds);
        const double d = -beta * sigmoid(-p.log_odds);
        p.d_chosen = d / -expm1(c);
        p.d_rejected = -d / -expm1(r);
        return p;
    }
    const double u = o->loss == REF_PREFERENCE_DPO     ? (c - ref_c) - (r - ref_r)
                     : o->loss == REF_PREFERENCE_SIMPO ? c - r - o->simpo_gamma / beta
                                                       : c - r;
    /* d log sig(beta u) / du = beta sig(-beta u); d log sig(-beta u) / du = -beta sig(beta u). */
    double du;
    switch (o->loss_type) {
    case REF_PREFERENCE_SIGMOID:
        p.loss = -(1.0 - ls) * log_sigmoid(beta * u) - ls * log_sigmoid(-beta * u);
        du = -(1.0 - ls) * beta * sigmoid(-beta * u) + ls * beta * sigmoid(beta * u);
        break;
    case REF_PREFERENCE_ROBUST:
        p.loss = (-(1.0 - ls) * log_sigmoid(beta * u) + ls * log_sigmoid(-beta * u)) / (1.0 - 2.0 * ls);
        du = (-(1.0 - ls) * beta * sigmoid(-beta * u) - ls * beta * sigmoid(beta * u)) / (1.0 - 2.0 * ls);
        break;
    case REF_PREFERENCE_HINGE:
        p.loss = 1.0 - beta * u > 0.0 ? 1.0 - beta * u : 0.0;
        du = 1.0 - beta * u > 0.0 ? -beta : 0.0;
        break;
    default: /* ipo */
        p.loss = (u - 1.0 / (2.0 * beta)) * (u - 1.0 / (2.0 * beta));
        du = 2.0 * (u - 1.0 / (2.0 * beta));
        break;
    }
    p.d_chosen = du;
    p.d_rejected = -du;
    return p;
}

static int tokens_valid(const ref_preference_tokens *tk, const ref_preference_options *o)
{
    return tk && tk->pairs > 0 && tk->seq > 0 && tk->logp && tk->mask && !(tk->ref_logps && tk->ref_per_token_logps) &&
           (o->loss == REF_PREFERENCE_DPO || (!tk->ref_logps && !tk->ref_per_token_logps));
}

int ref_preference_head(const ref_preference_tokens *tk, const ref_preference_options *o, double grad_output,
                        ref_preference_result *r, double *g_logp)
{
    if (!options_valid(o) || !tokens_valid(tk, o))
        return -2;
    const int64_t B = tk->pairs, T = tk->seq, S = 2 * B;
    const double *mask = tk->mask;
    double *count = malloc(sizeof(double) * (size_t)S); /* max(sum_t m, 1) */
    double *l = malloc(sizeof(double) * (size_t)S);
    double *ref = malloc(sizeof(double) * (size_t)S);
    double *dl = malloc(sizeof(double) * (size_t)S);    /* d (mean of pair losses) / d l_s */
    if (!count || !l || !ref || !dl) {
        free(count), free(l), free(ref), free(dl);
        return -1;
    }
    const int avg = ref_preference_averaged(o);
    double chosen_mask = 0.0, nll_sum = 0.0;
    for (int64_t s = 0; s < S; s++) {
        double ms = 0.0, ls = 0.0, rs = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = s * T + t;
            ms += mask[i];
            ls += mask[i] * tk->logp[i];
            if (tk->ref_per_token_logps)
                rs += mask[i] * tk->ref_per_token_logps[i];
        }
        if (s < B) {
            chosen_mask += ms;
            nll_sum -= ls;
        }
        count[s] = ms < 1.0 ? 1.0 : ms;
        l[s] = avg ? ls / count[s] : ls;
        ref[s] = tk->ref_logps ? tk->ref_logps[s] : avg ? rs / count[s] : rs;
    }
    const double nll = nll_sum / (chosen_mask < 1.0 ? 1.0 : chosen_mask), alpha = nll_alpha(o);
    const int dpo = o->loss == REF_PREFERENCE_DPO;

    const int now = current(o);
    double loss = 0.0, rc = 0.0, rr = 0.0, acc = 0.0, lc = 0.0, lr = 0.0, odds = 0.0, odds_ratio = 0.0;
    for (int64_t s = 0; s < S; s++)
        dl[s] = 0.0;
    if (now && current_terms(o, B, l, ref, count, &loss, dl)) {
        free(count), free(l), free(ref), free(dl);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        const pair_terms p = now ? (pair_terms){0.0, dl[b], dl[B + b], NAN} : pair_of(o, l[b], l[B + b], ref[b], ref[B + b]);
        const double reward_c = o->beta * (l[b] - (dpo ? ref[b] : 0.0));
        const double reward_r = o->beta * (l[B + b] - (dpo ? ref[B + b] : 0.0));
        loss += p.loss;
        dl[b] = p.d_chosen / (double)B;
        dl[B + b] = p.d_rejected / (double)B;
        rc += reward_c;
        rr += reward_r;
        acc += reward_c > reward_r ? 1.0 : 0.0;
        lc += l[b];
        lr += l[B + b];
        odds += p.log_odds;
        odds_ratio += log_sigmoid(p.log_odds);
        if (r && r->rewards) {
            r->rewards[b] = reward_c;
            r->rewards[B + b] = reward_r;
        }
    }
    loss = loss / (double)B + (alpha != 0.0 ? alpha * nll : 0.0);

    /* g_logp = grad (d loss / d l_s) (d l_s / d logp_i) + grad alpha d NLL / d logp_i. */
    for (int64_t s = 0; g_logp && s < S; s++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = s * T + t;
            const double seq_part = dl[s] * mask[i] / (avg ? count[s] : 1.0);
            const double nll_part = s < B ? -alpha * mask[i] / (chosen_mask < 1.0 ? 1.0 : chosen_mask) : 0.0;
            g_logp[i] = grad_output * (seq_part + nll_part);
        }

    if (r) {
        ref_preference_metrics *m = &r->metrics;
        r->loss = loss;
        m->rewards_chosen = rc / (double)B;
        m->rewards_rejected = rr / (double)B;
        m->rewards_accuracies = acc / (double)B;
        m->rewards_margins = (rc - rr) / (double)B;
        m->logps_chosen = lc / (double)B;
        m->logps_rejected = lr / (double)B;
        m->logits_chosen = m->logits_rejected = NAN;
        if (tk->logit_means) {
            double zsum[2] = {0.0, 0.0}, msum[2] = {0.0, 0.0};
            /* DPOTrainer: masked means; CPOTrainer and ORPOTrainer: means over every token of the half. */
            for (int64_t i = 0; i < S * T; i++) {
                const double w = o->loss == REF_PREFERENCE_DPO ? mask[i] : 1.0;
                zsum[i >= B * T] += w * tk->logit_means[i];
                msum[i >= B * T] += w;
            }
            /* The current DPOTrainer logs 0 over no token, v0.28's torch's mean of nothing (NaN). */
            m->logits_chosen = msum[0] > 0.0 ? zsum[0] / msum[0] : now ? 0.0 : NAN;
            m->logits_rejected = msum[1] > 0.0 ? zsum[1] / msum[1] : now ? 0.0 : NAN;
        }
        /* TRL: DPOTrainer v0.28 logs nll_loss only with rpo_alpha, the current one never; CPOTrainer sets it to 0
         * when cpo_alpha is 0. */
        m->nll_loss = now ? NAN : alpha != 0.0 ? nll : o->loss == REF_PREFERENCE_DPO ? NAN : 0.0;
        /* The current DPOTrainer's entropy (every token, masked) and chosen-half token accuracy, 0 over no token. */
        m->entropy = m->mean_token_accuracy = NAN;
        if (now && tk->entropy && tk->correct) {
            double h = 0.0, all = 0.0, right = 0.0;
            for (int64_t i = 0; i < S * T; i++) {
                h += mask[i] * tk->entropy[i];
                all += mask[i];
                right += i < B * T ? mask[i] * tk->correct[i] : 0.0;
            }
            m->entropy = all > 0.0 ? h / all : 0.0;
            m->mean_token_accuracy = chosen_mask > 0.0 ? right / chosen_mask : 0.0;
        }
        m->log_odds_ratio = o->loss == REF_PREFERENCE_ORPO ? odds_ratio / (double)B : NAN;
        m->log_odds_chosen = o->loss == REF_PREFERENCE_ORPO ? odds / (double)B : NAN;
        for (int64_t s = 0; r->sequence_logps && s < S; s++)
            r->sequence_logps[s] = l[s];
    }
    free(count), free(l), free(ref), free(dl);
    return 0;
}

static int problem_valid(const ref_preference_problem *p)
{
    if (!p || p->pairs <= 0 || p->seq <= 0 || p->hidden <= 0 || p->vocab <= 0 || !p->x || !p->weight ||
        !p->targets || !p->mask)
        return 0;
    for (int64_t i = 0; i < 2 * p->pairs * p->seq; i++)
        if (p->mask[i] != 0.0 && (p->targets[i] < 0 || p->targets[i] >= p->vocab))
            return 0;
    return 1;
}

static ref_linear linear_of(const ref_preference_problem *p)
{
    const ref_linear lin = {2 * p->pairs * p->seq, p->hidden, p->vocab, p->x, p->weight, p->bias};
    return lin;
}

/* Per token: logp (0 for an out-of-range target), the mean logit, the entropy and whether the argmax (lowest index
 * of the largest logit, as torch's argmax) is the target. */
typedef struct token_values {
    double *u, *logp, *mean, *entropy, *correct;
} token_values;

static void token_values_free(token_values *tv)
{
    free(tv->u), free(tv->logp), free(tv->mean), free(tv->entropy), free(tv->correct);
}

static int materialize(const ref_preference_problem *p, token_values *tv)
{
    const ref_linear lin = linear_of(p);
    const int64_t n = lin.n, v = p->vocab;
    tv->u = ref_linear_logits(&lin);
    tv->logp = malloc(sizeof(double) * (size_t)n);
    tv->mean = malloc(sizeof(double) * (size_t)n);
    tv->entropy = malloc(sizeof(double) * (size_t)n);
    tv->correct = malloc(sizeof(double) * (size_t)n);
    if (!tv->u || !tv->logp || !tv->mean || !tv->entropy || !tv->correct) {
        token_values_free(tv);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        const double *ui = tv->u + i * v, lse = ref_linear_row_lse(ui, v);
        const int64_t y = p->targets[i];
        double sum = 0.0, plogp = 0.0;
        int64_t argmax = 0;
        for (int64_t j = 0; j < v; j++) {
            sum += ui[j];
            plogp += exp(ui[j] - lse) * (ui[j] - lse);
            argmax = ui[j] > ui[argmax] ? j : argmax;
        }
        tv->mean[i] = sum / (double)v;
        tv->entropy[i] = -plogp;
        tv->correct[i] = argmax == y;
        tv->logp[i] = y >= 0 && y < v ? ui[y] - lse : 0.0;
    }
    return 0;
}

static ref_preference_tokens tokens_of(const ref_preference_problem *p, const token_values *tv)
{
    const ref_preference_tokens tk = {p->pairs,    p->seq,         tv->logp,      p->mask,    p->ref_logps,
                                      p->ref_per_token_logps, tv->mean, tv->entropy, tv->correct};
    return tk;
}

int ref_preference_forward(const ref_preference_problem *p, const ref_preference_options *o,
                           ref_preference_result *r)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    token_values tv;
    if (materialize(p, &tv))
        return -1;
    const ref_preference_tokens tk = tokens_of(p, &tv);
    const int rc = ref_preference_head(&tk, o, 1.0, r, NULL);
    for (int64_t i = 0; rc == 0 && r && r->logp && i < 2 * p->pairs * p->seq; i++)
        r->logp[i] = tv.logp[i];
    token_values_free(&tv);
    return rc;
}

int ref_preference_backward(const ref_preference_problem *p, const ref_preference_options *o, double grad_output,
                            double *dx, double *dweight, double *dbias)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    const ref_linear lin = linear_of(p);
    const int64_t n = lin.n, v = p->vocab;
    token_values tv;
    if (materialize(p, &tv))
        return -1;
    double *g = malloc(sizeof(double) * (size_t)n);
    double *du = malloc(sizeof(double) * (size_t)(n * v));
    int rc = !g || !du ? -1 : 0;
    if (rc == 0) {
        const ref_preference_tokens tk = tokens_of(p, &tv);
        rc = ref_preference_head(&tk, o, grad_output, NULL, g);
    }
    if (rc == 0) {
        /* d logp / d u_j = onehot_j - p_j: GRPO's row gradient at temperature 1 without an entropy term. */
        for (int64_t i = 0; i < n; i++)
            ref_grpo_row_grad(tv.u + i * v, v, 1.0, p->targets[i], g[i], 0.0, du + i * v);
        ref_linear_backward(&lin, du, dx, dweight, dbias);
    }
    token_values_free(&tv);
    free(g), free(du);
    return rc;
}
