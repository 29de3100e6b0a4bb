/* fh_gradcheck --loss kto: the fused KTO head against the double-precision TRL-semantics reference. The single-call
 * step runs in row blocks of whole sequences when --tile-rows holds at least one sequence (T rows; the default does
 * at these sizes) and streams otherwise; the tolerances, printed with the results, are justified in
 * tests/cases/kto_case.c. */
#include "enum_options.h"
#include "gradcheck_common.h"
#include "gradcheck_kto.h"

#include "kto_case.h"
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const loss_types[] = {"kto", "apo_zero_unpaired"}; /* fh_kto_loss_type order */
static const char *const ref_modes[] = {"sequence", "token"};
static const char *const kl_modes[] = {"value", "logratios"};

static void usage(void)
{
    fprintf(stderr, "usage: fh_gradcheck --loss kto --batch B --seq T --hidden H --vocab V\n"
                    "       [--loss-type kto|apo_zero_unpaired] [--beta b] [--desirable-weight w]\n"
                    "       [--undesirable-weight w] [--ref sequence|token] [--kl value|logratios] [--grad-output g]\n"
                    "       [--layout hv|vh] [--bias] [--threads T] [--seed S] [--tile-rows R] [--tile-vocab C]\n"
                    "       [--dtype f32|bf16] [--grad-dtype f32|bf16] [--fp32-du] [--dump DIR]\n"
                    "  --batch counts sequences; --kl is kto's KL input (apo_zero_unpaired takes none)\n");
}

typedef struct kto_check {
    kto_case_spec spec;
    kto_case c;
    kto_diff d;
} kto_check;

/* KTO's own options (gradcheck_own_option); every one takes a value. */
static int kto_option(void *spec, const char *a, const char *v)
{
    kto_case_spec *s = spec;
    int k;
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0) {
        if (strcmp(v, "kto") != 0)
            return -1;
    } else if (strcmp(a, "--loss-type") == 0) {
        if ((k = option_index(v, loss_types, 2)) < 0)
            return -1;
        s->options.loss_type = (fh_kto_loss_type)k;
    } else if (strcmp(a, "--ref") == 0) {
        if ((k = option_index(v, ref_modes, 2)) < 0)
            return -1;
        s->ref = (kto_ref_mode)k;
    } else if (strcmp(a, "--kl") == 0) {
        if ((k = option_index(v, kl_modes, 2)) < 0)
            return -1;
        s->kl = (kto_kl_mode)k;
    } else if (strcmp(a, "--beta") == 0)
        s->options.beta = atof(v);
    else if (strcmp(a, "--desirable-weight") == 0)
        s->options.desirable_weight = atof(v);
    else if (strcmp(a, "--undesirable-weight") == 0)
        s->options.undesirable_weight = atof(v);
    else
        return 0;
    return 2;
}

static int parse(void *check, int argc, char **argv, const char **dump)
{
    kto_case_spec *s = &((kto_check *)check)->spec;
    kto_case_spec_default(s);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump), .batch = &s->batch, .seq = &s->seq,
                                      .grad_output = &s->grad_output};
    if (gradcheck_parse(argc, argv, &shared, kto_option, s) != 0)
        return -1;
    return s->batch > 0 && s->seq > 0 && s->hidden > 0 && s->vocab > 0 ? 0 : -1;
}

static int run(void *check)
{
    kto_check *k = check;
    const fh_status st = kto_case_run(&k->spec, &k->c, &k->d);
    return st == FH_OK ? 0 : gradcheck_library_failed(st, NULL);
}

static void print_metrics(const fh_kto_metrics *m)
{
    putchar('{');
    gradcheck_json_number(stdout, "kl", m->kl, ", ");
    gradcheck_json_number(stdout, "rewards/chosen", m->rewards_chosen, ", ");
    gradcheck_json_number(stdout, "rewards/rejected", m->rewards_rejected, ", ");
    gradcheck_json_number(stdout, "rewards/margins", m->rewards_margins, ", ");
    gradcheck_json_number(stdout, "logps/chosen", m->logps_chosen, ", ");
    gradcheck_json_number(stdout, "logps/rejected", m->logps_rejected, ", ");
    gradcheck_json_number(stdout, "logits/chosen", m->logits_chosen, ", ");
    gradcheck_json_number(stdout, "logits/rejected", m->logits_rejected, ", ");
    gradcheck_json_number(stdout, "entropy", m->entropy, "}");
}

/* Both calls' outputs as .npy files in dir (gradients flat, dweight in the weight's layout). */
static int dump_case(const void *check, const char *dir)
{
    const kto_case *c = &((const kto_check *)check)->c;
    const kto_case_spec *s = &c->spec;
    const int64_t sequences[1] = {s->batch}, tokens[1] = {s->batch * s->seq}, dx[1] = {s->batch * s->seq * s->hidden},
                  dw[1] = {s->hidden * s->vocab}, v[1] = {s->vocab};
    const kto_fused_outputs *calls[2] = {&c->forward, &c->step};
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
    const kto_case *c = &((const kto_check *)check)->c;
    const kto_diff *d = &((const kto_check *)check)->d;
    const int pass = kto_diff_pass(d);
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
           KTO_LOSS_TOL, KTO_METRIC_TOL, KTO_TOKEN_TOL, d->grad_tolerance, d->dbias_tolerance, pass ? "true" : "false");
    return pass;
}

static void free_check(void *check)
{
    kto_case_free(&((kto_check *)check)->c);
}

int gradcheck_kto(int argc, char **argv)
{
    static const gradcheck_loss kto = {usage, parse, run, report, dump_case, free_check};
    kto_check check = {0};
    return gradcheck_main(&kto, &check, argc, argv);
}
