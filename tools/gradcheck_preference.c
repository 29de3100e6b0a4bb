/* fh_gradcheck --loss dpo|orpo|simpo|cpo: the fused preference head against the double-precision TRL-semantics
 * reference. The single-call step runs in row blocks of whole pairs when --tile-rows holds at least one pair (2 T
 * rows; the default does at these sizes) and streams otherwise; the tolerances, printed with the results, are
 * justified in tests/cases/preference_case.c. */
#include "enum_options.h"
#include "gradcheck_common.h"
#include "gradcheck_preference.h"

#include "npy.h"
#include "preference_case.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const losses[] = {"dpo", "orpo", "simpo", "cpo"}; /* fh_preference_loss order */
static const char *const loss_types[] = {"sigmoid",  "hinge",    "ipo",      "robust",   "exo_pair",
                                         "nca_pair", "bco_pair", "sppo_hard", "aot",     "aot_unpaired",
                                         "apo_zero", "apo_down", "discopop", "sft",      "sigmoid_norm"};
static const char *const semantics[] = {"current", "0.28"}; /* fh_preference_dpo_semantics order */
static const char *const ref_modes[] = {"none", "sequence", "token"};

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss dpo|orpo|simpo|cpo --batch B --seq T --hidden H --vocab V\n"
            "       [--loss-type TYPE[,TYPE...]] [--loss-weights w[,w...]] [--trl current|0.28] [--beta b]\n"
            "       [--label-smoothing e] [--simpo-gamma g] [--discopop-tau t] [--rpo-alpha a] [--cpo-alpha a]\n"
            "       [--ref none|sequence|token] [--grad-output g] [--layout hv|vh]\n"
            "       [--bias] [--threads T] [--seed S] [--tile-rows R] [--tile-vocab C] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-du] [--dump DIR]\n"
            "  --batch counts pairs (2B sequences); --ref is dpo's reference log-probs (the other losses take none);\n"
            "  TYPE: sigmoid hinge ipo robust exo_pair nca_pair bco_pair sppo_hard aot aot_unpaired apo_zero\n"
            "  apo_down discopop sft sigmoid_norm; a list, or --loss-weights, is TRL's current loss_type list\n"
            "  (dpo at --trl current, the default)\n");
}

int gradcheck_is_preference(const char *loss)
{
    return option_index(loss, losses, 4) >= 0;
}

/* The preference case, as gradcheck_main runs it. */
typedef struct preference_check {
    preference_case_spec spec;
    preference_case c;
    preference_diff d;
} preference_check;

/* The next comma-separated item of *at into item (truncated to its size); 0 at the end of the list. */
static int next_item(const char **at, char *item, size_t size)
{
    if (!**at)
        return 0;
    const size_t length = strcspn(*at, ",");
    snprintf(item, size, "%.*s", (int)length, *at);
    *at += length + ((*at)[length] == ',');
    return 1;
}

/* --loss-type: one name (loss_type), or a comma-separated list (TRL's current loss_type list, weights 1 until
 * --loss-weights says otherwise). 0, or -1 for an unknown name or too long a list. */
static int parse_types(preference_case_spec *s, const char *list)
{
    char name[32];
    int count = 0;
    for (const char *at = list; next_item(&at, name, sizeof name);) {
        const int k = option_index(name, loss_types, 15);
        if (k < 0 || count == FH_PREFERENCE_MAX_LOSS_TYPES)
            return -1;
        s->options.loss_types[count] = (fh_preference_loss_type)k;
        if (s->options.loss_type_count <= count)
            s->options.loss_weights[count] = 1.0;
        count++;
    }
    if (count == 0)
        return -1;
    s->options.loss_type = s->options.loss_types[0];
    s->options.loss_type_count = count > 1 || s->options.loss_type_count ? count : 0;
    return 0;
}

/* --loss-weights: one weight per listed type, comma-separated; makes the list explicit. */
static int parse_weights(preference_case_spec *s, const char *list)
{
    char w[32];
    int count = 0;
    for (const char *at = list; next_item(&at, w, sizeof w);) {
        if (count == FH_PREFERENCE_MAX_LOSS_TYPES)
            return -1;
        s->options.loss_weights[count++] = atof(w);
    }
    if (s->options.loss_type_count == 0)
        s->options.loss_types[0] = s->options.loss_type;
    s->options.loss_type_count = count;
    return 0;
}

/* The preference losses' own options (gradcheck_own_option); every one takes a value. */
static int preference_option(void *spec, const char *a, const char *v)
{
    preference_case_spec *s = spec;
    int k;
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0) {
        if ((k = option_index(v, losses, 4)) < 0)
            return -1;
        s->options.loss = (fh_preference_loss)k;
    } else if (strcmp(a, "--loss-type") == 0)
        return parse_types(s, v) ? -1 : 2;
    else if (strcmp(a, "--loss-weights") == 0)
        return parse_weights(s, v) ? -1 : 2;
    else if (strcmp(a, "--trl") == 0) {
        if ((k = option_index(v, semantics, 2)) < 0)
            return -1;
        s->options.dpo_semantics = (fh_preference_dpo_semantics)k;
    } else if (strcmp(a, "--ref") == 0) {
        if ((k = option_index(v, ref_modes, 3)) < 0)
            return -1;
        s->ref = (preference_ref_mode)k;
    } else if (strcmp(a, "--beta") == 0)
        s->options.beta = atof(v);
    else if (strcmp(a, "--label-smoothing") == 0)
        s->options.label_smoothing = atof(v);
    else if (strcmp(a, "--simpo-gamma") == 0)
        s->options.simpo_gamma = atof(v);
    else if (strcmp(a, "--rpo-alpha") == 0)
        s->options.rpo_alpha = atof(v);
    else if (strcmp(a, "--cpo-alpha") == 0)
        s->options.cpo_alpha = atof(v);
    else if (strcmp(a, "--discopop-tau") == 0)
        s->options.discopop_tau = atof(v);
    else
        return 0;
    return 2;
}

static int parse(void *check, int argc, char **argv, const char **dump)
{
    preference_case_spec *s = &((preference_check *)check)->spec;
    preference_case_spec_default(s);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump), .batch = &s->pairs, .seq = &s->seq,
                                      .grad_output = &s->grad_output};
    if (gradcheck_parse(argc, argv, &shared, preference_option, s) != 0)
        return -1;
    const int ref_ok = s->ref == PREFERENCE_REF_NONE || s->options.loss == FH_PREFERENCE_DPO;
    return ref_ok && s->pairs > 0 && s->seq > 0 && s->hidden > 0 && s->vocab > 0 ? 0 : -1;
}

static int run(void *check)
{
    preference_check *k = check;
    const fh_status st = preference_case_run(&k->spec, &k->c, &k->d);
    return st == FH_OK ? 0 : gradcheck_library_failed(st, NULL);
}

static void print_metrics(const fh_preference_metrics *m)
{
    putchar('{');
    gradcheck_json_number(stdout, "rewards/chosen", m->rewards_chosen, ", ");
    gradcheck_json_number(stdout, "rewards/rejected", m->rewards_rejected, ", ");
    gradcheck_json_number(stdout, "rewards/accuracies", m->rewards_accuracies, ", ");
    gradcheck_json_number(stdout, "rewards/margins", m->rewards_margins, ", ");
    gradcheck_json_number(stdout, "logps/chosen", m->logps_chosen, ", ");
    gradcheck_json_number(stdout, "logps/rejected", m->logps_rejected, ", ");
    gradcheck_json_number(stdout, "logits/chosen", m->logits_chosen, ", ");
    gradcheck_json_number(stdout, "logits/rejected", m->logits_rejected, ", ");
    gradcheck_json_number(stdout, "nll_loss", m->nll_loss, ", ");
    gradcheck_json_number(stdout, "log_odds_ratio", m->log_odds_ratio, ", ");
    gradcheck_json_number(stdout, "log_odds_chosen", m->log_odds_chosen, ", ");
    gradcheck_json_number(stdout, "entropy", m->entropy, ", ");
    gradcheck_json_number(stdout, "mean_token_accuracy", m->mean_token_accuracy, "}");
}

/* Both calls' outputs as .npy files in dir (gradients flat, dweight in the weight's layout). */
static int dump_case(const void *check, const char *dir)
{
    const preference_case *c = &((const preference_check *)check)->c;
    const preference_case_spec *s = &c->spec;
    const int64_t sequences[1] = {2 * s->pairs}, tokens[1] = {2 * s->pairs * s->seq},
                  dx[1] = {2 * s->pairs * s->seq * s->hidden}, dw[1] = {s->hidden * s->vocab}, v[1] = {s->vocab};
    const preference_fused_outputs *calls[2] = {&c->forward, &c->step};
    const char *const names[2][4] = {{"forward_loss", "forward_sequence_logps", "forward_rewards", "forward_logp"},
                                     {"loss", "sequence_logps", "rewards", "logp"}};
    int bad = 0;
    for (int k = 0; k < 2; k++) {
        bad |= npy_write(dir, names[k][0], "<f8", &calls[k]->loss, 0, NULL);
        bad |= npy_write(dir, names[k][1], "<f4", calls[k]->sequence_logps, 1, sequences);
        bad |= npy_write(dir, names[k][2], "<f4", calls[k]->rewards, 1, sequences);
        bad |= npy_write(dir, names[k][3], "<f4", calls[k]->logp, 1, tokens);
    }
    bad |= npy_write(dir, "dhidden", "<f4", c->dx, 1, dx);
    bad |= npy_write(dir, "dweight", "<f4", c->dweight, 1, dw);
    if (c->dbias)
        bad |= npy_write(dir, "dbias", "<f4", c->dbias, 1, v);
    return bad;
}

static int report(const void *check)
{
    const preference_case *c = &((const preference_check *)check)->c;
    const preference_diff *d = &((const preference_check *)check)->d;
    const int pass = preference_diff_pass(d);
    printf("{\n  \"loss\": %.17g,\n  \"forward_loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"abs_diff_loss\": %.3e,\n"
           "  \"loss_tolerance\": %.3e,\n  \"metrics_max_rel\": %.3e,\n  \"sequence_logps_max_rel\": %.3e,\n"
           "  \"rewards_max_rel\": %.3e,\n  \"logp_max_rel\": %.3e,\n  \"dhidden_norm_rel\": %.3e,\n"
           "  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n  \"masked_rows_touched\": %lld,\n"
           "  \"metrics\": ",
           c->step.loss, c->forward.loss, c->ref_loss, d->loss, d->loss_tolerance, d->metrics, d->sequence_logps,
           d->rewards, d->logp, d->dx, d->dweight, d->dbias, (long long)d->masked_rows_touched);
    print_metrics(&c->step.metrics);
    printf(",\n  \"ref_metrics\": ");
    print_metrics(&c->ref_metrics);
    printf(",\n  \"tolerance\": {\"loss_abs_per_unit\": %g, \"metrics_rel\": %g, \"token_rel\": %g, "
           "\"grad_norm_rel\": %g, \"dbias_norm_rel\": %g},\n  \"pass\": %s\n}\n",
           PREFERENCE_LOSS_TOL, PREFERENCE_METRIC_TOL, PREFERENCE_TOKEN_TOL, d->grad_tolerance, d->dbias_tolerance,
           pass ? "true" : "false");
    return pass;
}

static void free_check(void *check)
{
    preference_case_free(&((preference_check *)check)->c);
}

int gradcheck_preference(int argc, char **argv)
{
    static const gradcheck_loss preference = {usage, parse, run, report, dump_case, free_check};
    preference_check check = {0};
    return gradcheck_main(&preference, &check, argc, argv);
}
