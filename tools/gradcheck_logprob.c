/* fh_gradcheck --loss logprob: the fused log-prob head against the double-precision reference (ref/ref_logprob.h):
 * logp, entropy and lse, and the gradients of sum g_logp logp + g_entropy H + g_lse lse for random upstream gradients,
 * over the vocabulary or (--support) over a random support per token (fh_logprob_support_*); the tolerances, printed
 * with the results, are justified in tests/cases/logprob_case.c. */
#include "gradcheck_common.h"
#include "gradcheck_logprob.h"

#include "logprob_case.h"
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss logprob --n N --hidden H --vocab V [--temperature T] [--softcap C]\n"
            "       [--head-logit-scale M] [--no-entropy-grad] [--no-lse-grad] [--ignore-frac F] [--layout hv|vh]\n"
            "       [--bias] [--threads T] [--seed S] [--train-step] [--budget BYTES] [--tile-rows R] [--tile-vocab C]\n"
            "       [--dtype f32|bf16] [--grad-dtype f32|bf16] [--fp32-du] [--logit-scale S] [--dump DIR]\n"
            "       [--support csr|padded --support-size K]\n"
            "  --head-logit-scale: the head's logit_scale option; --logit-scale: the inputs' typical |logit|\n"
            "  --support: over a support per token (CSR: 1..K ids, padded: K entries with up to a third -1; K = V: every\n"
            "  id), each counted token's target among them\n");
}

/* The log-prob case, as gradcheck_main runs it. */
typedef struct logprob_check {
    logprob_case_spec spec;
    logprob_case c;
    logprob_diff d;
} logprob_check;

/* The head's own options (gradcheck_own_option). */
static int logprob_option(void *spec, const char *a, const char *v)
{
    logprob_case_spec *s = spec;
    if (strcmp(a, "--no-entropy-grad") == 0 || strcmp(a, "--no-lse-grad") == 0) {
        *(strcmp(a, "--no-lse-grad") == 0 ? &s->g_lse : &s->g_entropy) = 0;
        return 1;
    }
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0)
        return strcmp(v, "logprob") ? -1 : 2;
    if (strcmp(a, "--temperature") == 0)
        s->options.temperature = atof(v);
    else if (strcmp(a, "--softcap") == 0)
        s->options.softcap = atof(v);
    else if (strcmp(a, "--head-logit-scale") == 0)
        s->options.logit_scale = atof(v);
    else if (strcmp(a, "--support") == 0 && (strcmp(v, "csr") == 0 || strcmp(v, "padded") == 0))
        s->support = strcmp(v, "csr") == 0 ? LOGPROB_SUPPORT_CSR : LOGPROB_SUPPORT_PADDED;
    else if (strcmp(a, "--support-size") == 0)
        s->support_size = atoll(v);
    else
        return 0;
    return 2;
}

static int parse(void *check, int argc, char **argv, const char **dump)
{
    logprob_case_spec *s = &((logprob_check *)check)->spec;
    logprob_case_spec_default(s);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump),
                                      .n = &s->n,
                                      .train_step = &s->train_step,
                                      .ignore_frac = &s->ignore_frac,
                                      .logit_scale = &s->data_scale,
                                      .budget = &s->budget};
    if (gradcheck_parse(argc, argv, &shared, logprob_option, s) != 0)
        return -1;
    const int support_ok = s->support == LOGPROB_FULL_VOCAB ? s->support_size == 0
                                                            : s->support_size >= 1 && s->support_size <= s->vocab;
    return s->n > 0 && s->hidden > 0 && s->vocab > 0 && support_ok ? 0 : -1;
}

static int run(void *check)
{
    logprob_check *k = check;
    const fh_status st = logprob_case_run(&k->spec, &k->c, &k->d);
    return st == FH_OK ? 0 : gradcheck_library_failed(st, NULL);
}

static int dump_case(const void *check, const char *dir)
{
    const logprob_check *k = check;
    const logprob_case *c = &k->c;
    const logprob_case_spec *s = &k->spec;
    const int64_t n1[1] = {s->n}, v1[1] = {s->vocab}, nh[2] = {s->n, s->hidden};
    const int64_t w2[2] = {s->layout == FH_LAYOUT_HV ? s->hidden : s->vocab,
                           s->layout == FH_LAYOUT_HV ? s->vocab : s->hidden};
    static const char *const values[3] = {"logp", "entropy", "lse"}, *const upstream[3] = {"g_logp", "g_entropy",
                                                                                             "g_lse"};
    int bad = 0;
    bad |= npy_write(dir, "hidden", "<f4", c->x, 2, nh);
    bad |= npy_write(dir, "weight", "<f4", c->weight, 2, w2);
    bad |= npy_write(dir, "targets", "<i8", c->targets, 1, n1);
    for (int j = 0; j < 3; j++) {
        bad |= npy_write(dir, values[j], "<f4", c->values + j * s->n, 1, n1);
        if (c->g[j])
            bad |= npy_write(dir, upstream[j], "<f4", c->g[j], 1, n1);
    }
    bad |= npy_write(dir, "dhidden", "<f4", c->grads[0], 2, nh);
    bad |= npy_write(dir, "dweight", "<f4", c->grads[1], 2, w2);
    if (c->bias) {
        bad |= npy_write(dir, "bias", "<f4", c->bias, 1, v1);
        bad |= npy_write(dir, "dbias", "<f4", c->grads[2], 1, v1);
    }
    return bad;
}

static int report(const void *check)
{
    const logprob_check *k = check;
    const logprob_diff *d = &k->d;
    const int pass = logprob_diff_pass(d);
    printf("{\n  \"logp_max_abs\": %.3e,\n  \"entropy_max_abs\": %.3e,\n  \"lse_max_abs\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n"
           "  \"ignored_rows_zero\": %s,\n  \"tolerance\": {\"values_abs\": %g, \"grad_norm_rel\": %g, "
           "\"dbias_norm_rel\": %g},\n  \"pass\": %s\n}\n",
           d->logp_max_abs, d->entropy_max_abs, d->lse_max_abs, d->dhidden_norm_rel, d->dweight_norm_rel,
           d->dbias_norm_rel, d->ignored_outputs_zero ? "true" : "false", d->value_tol, d->grad_tol, d->dbias_tol,
           pass ? "true" : "false");
    return pass;
}

static void free_check(void *check)
{
    logprob_case_free(&((logprob_check *)check)->c);
}

int gradcheck_logprob(int argc, char **argv)
{
    static const gradcheck_loss logprob = {usage, parse, run, report, dump_case, free_check};
    logprob_check check;
    memset(&check, 0, sizeof check);
    return gradcheck_main(&logprob, &check, argc, argv);
}
