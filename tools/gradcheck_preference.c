/* fh_gradcheck --loss dpo|orpo|simpo|cpo: the fused preference head against the double-precision TRL-semantics
 * reference. The single-call step runs in row blocks of whole pairs when --tile-rows holds at least one pair (2 T
 * rows; the default does at these sizes) and streams otherwise; the tolerances, printed with the results, are
 * justified in ref/preference_case.c. */
#include "enum_options.h"
#include "gradcheck_preference.h"

#include "npy.h"
#include "preference_case.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const losses[] = {"dpo", "orpo", "simpo", "cpo"}; /* fh_preference_loss order */
static const char *const loss_types[] = {"sigmoid", "hinge", "ipo", "robust"};
static const char *const ref_modes[] = {"none", "sequence", "token"};

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss dpo|orpo|simpo|cpo --batch B --seq T --hidden H --vocab V\n"
            "       [--loss-type sigmoid|hinge|ipo|robust] [--beta b] [--label-smoothing e] [--simpo-gamma g]\n"
            "       [--rpo-alpha a] [--cpo-alpha a] [--ref none|sequence|token] [--grad-output g] [--layout hv|vh]\n"
            "       [--bias] [--threads T] [--seed S] [--tile-rows R] [--tile-vocab C] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-dz] [--dump DIR]\n"
            "  --batch counts pairs (2B sequences); --ref is dpo's reference log-probs (the other losses take none)\n");
}

/* The index of name in names[count], or -1. */
static int lookup(const char *name, const char *const *names, int count)
{
    for (int k = 0; k < count; k++)
        if (strcmp(name, names[k]) == 0)
            return k;
    return -1;
}

int gradcheck_is_preference(const char *loss)
{
    return lookup(loss, losses, 4) >= 0;
}

static int parse(int argc, char **argv, preference_case_spec *s, const char **dump)
{
    preference_case_spec_default(s);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int k;
#define VALUE_OPTION(name) (strcmp(a, name) == 0 && v && ++i)
        if (VALUE_OPTION("--loss")) {
            if ((k = lookup(v, losses, 4)) < 0)
                return -1;
            s->options.loss = (fh_preference_loss)k;
        } else if (VALUE_OPTION("--loss-type")) {
            if ((k = lookup(v, loss_types, 4)) < 0)
                return -1;
            s->options.loss_type = (fh_preference_loss_type)k;
        } else if (VALUE_OPTION("--ref")) {
            if ((k = lookup(v, ref_modes, 3)) < 0)
                return -1;
            s->ref = (preference_ref_mode)k;
        } else if (VALUE_OPTION("--batch"))
            s->pairs = atoll(v);
        else if (VALUE_OPTION("--seq"))
            s->seq = atoll(v);
        else if (VALUE_OPTION("--hidden"))
            s->hidden = atoll(v);
        else if (VALUE_OPTION("--vocab"))
            s->vocab = atoll(v);
        else if (VALUE_OPTION("--beta"))
            s->options.beta = atof(v);
        else if (VALUE_OPTION("--label-smoothing"))
            s->options.label_smoothing = atof(v);
        else if (VALUE_OPTION("--simpo-gamma"))
            s->options.simpo_gamma = atof(v);
        else if (VALUE_OPTION("--rpo-alpha"))
            s->options.rpo_alpha = atof(v);
        else if (VALUE_OPTION("--cpo-alpha"))
            s->options.cpo_alpha = atof(v);
        else if (VALUE_OPTION("--grad-output"))
            s->grad_output = (float)atof(v);
        else if (VALUE_OPTION("--layout")) {
            if (strcmp(v, "hv") && strcmp(v, "vh"))
                return -1;
            s->layout = strcmp(v, "vh") == 0 ? FH_LAYOUT_VH : FH_LAYOUT_HV;
        } else if (strcmp(a, "--bias") == 0)
            s->bias = 1;
        else if (VALUE_OPTION("--dtype")) {
            if (parse_dtype(v, &s->dtype) != 0)
                return -1;
        } else if (VALUE_OPTION("--grad-dtype")) {
            if (parse_dtype(v, &s->grad_dtype) != 0)
                return -1;
        } else if (strcmp(a, "--fp32-dz") == 0)
            s->fp32_dz = 1;
        else if (VALUE_OPTION("--threads"))
            s->threads = atoi(v);
        else if (VALUE_OPTION("--tile-rows"))
            s->tile_rows = atoll(v);
        else if (VALUE_OPTION("--tile-vocab"))
            s->tile_vocab = atoll(v);
        else if (VALUE_OPTION("--seed"))
            s->seed = strtoull(v, NULL, 10);
        else if (VALUE_OPTION("--dump"))
            *dump = v;
        else
            return -1;
#undef VALUE_OPTION
    }
    const int ref_ok = s->ref == PREFERENCE_REF_NONE || s->options.loss == FH_PREFERENCE_DPO;
    return ref_ok && s->pairs > 0 && s->seq > 0 && s->hidden > 0 && s->vocab > 0 ? 0 : -1;
}

/* JSON has no NaN: metrics TRL does not log are null. */
static void json_number(const char *name, double x, const char *tail)
{
    if (isnan(x))
        printf("\"%s\": null%s", name, tail);
    else
        printf("\"%s\": %.17g%s", name, x, tail);
}

static void print_metrics(const fh_preference_metrics *m)
{
    putchar('{');
    json_number("rewards/chosen", m->rewards_chosen, ", ");
    json_number("rewards/rejected", m->rewards_rejected, ", ");
    json_number("rewards/accuracies", m->rewards_accuracies, ", ");
    json_number("rewards/margins", m->rewards_margins, ", ");
    json_number("logps/chosen", m->logps_chosen, ", ");
    json_number("logps/rejected", m->logps_rejected, ", ");
    json_number("logits/chosen", m->logits_chosen, ", ");
    json_number("logits/rejected", m->logits_rejected, ", ");
    json_number("nll_loss", m->nll_loss, ", ");
    json_number("log_odds_ratio", m->log_odds_ratio, ", ");
    json_number("log_odds_chosen", m->log_odds_chosen, "}");
}

/* Both calls' outputs as .npy files in dir (gradients flat, dweight in the weight's layout). */
static int dump_case(const char *dir, const preference_case *c)
{
    const preference_case_spec *s = &c->spec;
    const int64_t sequences[1] = {2 * s->pairs}, tokens[1] = {2 * s->pairs * s->seq},
                  dx[1] = {2 * s->pairs * s->seq * s->hidden}, dw[1] = {s->hidden * s->vocab}, v[1] = {s->vocab};
    const preference_fused_outputs *calls[2] = {&c->forward, &c->step};
    const char *const names[2][4] = {{"forward_loss", "forward_sequence_logps", "forward_rewards", "forward_logp"},
                                     {"loss", "sequence_logps", "rewards", "logp"}};
    mkdir(dir, 0777);
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

int gradcheck_preference(int argc, char **argv)
{
    preference_case_spec spec;
    const char *dump = NULL;
    if (parse(argc, argv, &spec, &dump) != 0) {
        usage();
        return 2;
    }
    preference_case c;
    preference_diff d;
    const fh_status st = preference_case_run(&spec, &c, &d);
    if (st != FH_OK) {
        fprintf(stderr, "fh_gradcheck: the library returned %d (%s)\n", (int)st, fh_status_string(st));
        preference_case_free(&c);
        return 2;
    }
    const int pass = preference_diff_pass(&d);
    printf("{\n  \"loss\": %.17g,\n  \"forward_loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"abs_diff_loss\": %.3e,\n"
           "  \"loss_tolerance\": %.3e,\n  \"metrics_max_rel\": %.3e,\n  \"sequence_logps_max_rel\": %.3e,\n"
           "  \"rewards_max_rel\": %.3e,\n  \"logp_max_rel\": %.3e,\n  \"dhidden_norm_rel\": %.3e,\n"
           "  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n  \"masked_rows_touched\": %lld,\n"
           "  \"metrics\": ",
           c.step.loss, c.forward.loss, c.ref_loss, d.loss, d.loss_tolerance, d.metrics, d.sequence_logps, d.rewards,
           d.logp, d.dx, d.dweight, d.dbias, (long long)d.masked_rows_touched);
    print_metrics(&c.step.metrics);
    printf(",\n  \"ref_metrics\": ");
    print_metrics(&c.ref_metrics);
    printf(",\n  \"tolerance\": {\"loss_abs_per_unit\": %g, \"metrics_rel\": %g, \"token_rel\": %g, "
           "\"grad_norm_rel\": %g, \"dbias_norm_rel\": %g},\n  \"pass\": %s\n}\n",
           PREFERENCE_LOSS_TOL, PREFERENCE_METRIC_TOL, PREFERENCE_TOKEN_TOL, d.grad_tolerance, d.dbias_tolerance,
           pass ? "true" : "false");
    int rc = pass ? 0 : 1;
    if (dump && dump_case(dump, &c) != 0) {
        fprintf(stderr, "fh_gradcheck: could not write to %s\n", dump);
        rc = 2;
    }
    preference_case_free(&c);
    return rc;
}
