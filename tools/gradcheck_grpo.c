/* fh_gradcheck --loss grpo: the fused GRPO head against the double-precision TRL-semantics reference. */
#include "enum_options.h"
#include "gradcheck_common.h"
#include "gradcheck_grpo.h"

#include "grpo_case.h"
#include "grpo_convert.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss grpo --batch B --seq T --hidden H --vocab V --loss-type X\n"
            "       --is-level token|sequence [--beta b] [--epsilon-low e] [--epsilon-high e] [--delta d]\n"
            "       [--temperature t] [--no-old-logps] [--entropy-coef c] [--layout hv|vh] [--bias]\n"
            "       [--threads T] [--seed S] [--train-step] [--tile-rows R] [--tile-vocab C] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-du] [--dump DIR] [--grad-filter-eps EPS]\n"
            "       [--grad-filter-tail estimate|drop] [--logit-scale S] [--budget BYTES]\n"
            "       [--num-items-in-batch N] [--max-completion-length L] [--top-entropy-quantile q]\n"
            "       [--off-policy-mask-threshold t] [--bias-correction-kl] [--sampling-logps]\n"
            "       [--vllm-is-mode M] [--vllm-is-clip-min c|none] [--vllm-is-clip-max c|none]\n"
            "       [--no-vllm-is-correction] [--vespo-k-pos k] [--vespo-lambda-pos l] [--vespo-k-neg k]\n"
            "       [--vespo-lambda-neg l] [--sapo-temperature-pos t] [--sapo-temperature-neg t]\n"
            "  X: grpo bnpo dr_grpo dapo cispo sapo luspo vespo (default dapo, TRL's)\n"
            "  M: token_truncate token_mask sequence_truncate sequence_mask (default sequence_mask); the correction\n"
            "     applies with --sampling-logps (the sampler's log-probs: the old ones, or the current ones with\n"
            "     --no-old-logps, plus U(-0.15, 0.15))\n");
}

static const char *const loss_types[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};
static const char *const is_modes[] = {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"};

/* A bound of the vLLM importance-sampling ratio: a number, or "none" (NaN). 0, or -1 for neither. */
static int parse_bound(const char *v, double *bound)
{
    if (strcmp(v, "none") == 0) {
        *bound = NAN;
        return 0;
    }
    char *end;
    *bound = strtod(v, &end);
    return *end == '\0' && end != v ? 0 : -1;
}

/* The GRPO case, as gradcheck_main runs it. */
typedef struct grpo_check {
    grpo_case_spec spec;
    grpo_case c;
    grpo_metrics_diff d;
} grpo_check;

/* GRPO's own options (gradcheck_own_option). */
static int grpo_option(void *spec, const char *a, const char *v)
{
    grpo_case_spec *s = spec;
    if (strcmp(a, "--no-old-logps") == 0) {
        s->old_logps = 0;
        return 1;
    }
    if (strcmp(a, "--sampling-logps") == 0) {
        s->sampling_logps = 1;
        return 1;
    }
    if (strcmp(a, "--bias-correction-kl") == 0) {
        s->options.use_bias_correction_kl = 1;
        return 1;
    }
    if (strcmp(a, "--no-vllm-is-correction") == 0) {
        s->options.vllm_importance_sampling_correction = 0;
        return 1;
    }
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0)
        return strcmp(v, "grpo") ? -1 : 2;
    if (strcmp(a, "--loss-type") == 0) {
        const int k = option_index(v, loss_types, 8);
        if (k < 0)
            return -1;
        s->options.loss_type = (fh_grpo_loss_type)k;
    } else if (strcmp(a, "--is-level") == 0) {
        if (strcmp(v, "token") && strcmp(v, "sequence"))
            return -1;
        s->options.importance_sampling_level = strcmp(v, "token") ? FH_GRPO_IS_SEQUENCE : FH_GRPO_IS_TOKEN;
    } else if (strcmp(a, "--beta") == 0)
        s->options.beta = atof(v);
    else if (strcmp(a, "--epsilon-low") == 0)
        s->options.epsilon_low = atof(v);
    else if (strcmp(a, "--epsilon-high") == 0)
        s->options.epsilon_high = atof(v);
    else if (strcmp(a, "--delta") == 0)
        s->options.delta = atof(v);
    else if (strcmp(a, "--temperature") == 0)
        s->options.temperature = atof(v);
    else if (strcmp(a, "--entropy-coef") == 0)
        s->options.entropy_coef = atof(v);
    else if (strcmp(a, "--num-items-in-batch") == 0)
        s->options.num_items_in_batch = atof(v);
    else if (strcmp(a, "--max-completion-length") == 0)
        s->options.max_completion_length = atoll(v);
    else if (strcmp(a, "--top-entropy-quantile") == 0)
        s->options.top_entropy_quantile = atof(v);
    else if (strcmp(a, "--off-policy-mask-threshold") == 0)
        s->options.off_policy_mask_threshold = atof(v);
    else if (strcmp(a, "--vllm-is-mode") == 0) {
        const int k = option_index(v, is_modes, 4);
        if (k < 0)
            return -1;
        s->options.vllm_importance_sampling_mode = (fh_grpo_vllm_is_mode)k;
    } else if (strcmp(a, "--vllm-is-clip-min") == 0) {
        if (parse_bound(v, &s->options.vllm_importance_sampling_clip_min))
            return -1;
    } else if (strcmp(a, "--vllm-is-clip-max") == 0) {
        if (parse_bound(v, &s->options.vllm_importance_sampling_clip_max))
            return -1;
    } else if (strcmp(a, "--vespo-k-pos") == 0)
        s->options.vespo_k_pos = atof(v);
    else if (strcmp(a, "--vespo-lambda-pos") == 0)
        s->options.vespo_lambda_pos = atof(v);
    else if (strcmp(a, "--vespo-k-neg") == 0)
        s->options.vespo_k_neg = atof(v);
    else if (strcmp(a, "--vespo-lambda-neg") == 0)
        s->options.vespo_lambda_neg = atof(v);
    else if (strcmp(a, "--sapo-temperature-pos") == 0)
        s->options.sapo_temperature_pos = atof(v);
    else if (strcmp(a, "--sapo-temperature-neg") == 0)
        s->options.sapo_temperature_neg = atof(v);
    else
        return 0;
    return 2;
}

static int parse(void *check, int argc, char **argv, const char **dump)
{
    grpo_case_spec *s = &((grpo_check *)check)->spec;
    grpo_case_spec_default(s);
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump),
                                      .batch = &s->batch,
                                      .seq = &s->seq,
                                      .train_step = &s->train_step,
                                      .grad_filter_eps = &s->grad_filter_eps,
                                      .grad_filter_tail = &s->grad_filter_tail,
                                      .logit_scale = &s->logit_scale,
                                      .budget = &s->budget};
    if (gradcheck_parse(argc, argv, &shared, grpo_option, s) != 0)
        return -1;
    return s->batch > 0 && s->seq > 0 && s->hidden > 0 && s->vocab > 0 ? 0 : -1;
}

static int run(void *check)
{
    grpo_check *k = check;
    const fh_status st = grpo_case_run(&k->spec, &k->c, &k->d);
    return st == FH_OK ? 0 : gradcheck_library_failed(st, NULL);
}

/* Every metric under TRL's key (grpo_metrics_fields). */
static void print_metrics(FILE *f, const fh_grpo_metrics *m)
{
    double values[GRPO_METRIC_COUNT];
    grpo_metrics_fields(m, values);
    fputc('{', f);
    for (int k = 0; k < GRPO_METRIC_COUNT; k++)
        gradcheck_json_number(f, grpo_metric_keys[k], values[k], k + 1 < GRPO_METRIC_COUNT ? ", " : "}");
}

static int dump_case(const void *check, const char *dir)
{
    const grpo_case *c = &((const grpo_check *)check)->c;
    const grpo_case_spec *s = &c->spec;
    const int64_t bt[2] = {s->batch, s->seq}, b1[1] = {s->batch}, nh[2] = {s->batch * s->seq, s->hidden};
    const int64_t w2[2] = {s->layout == FH_LAYOUT_HV ? s->hidden : s->vocab,
                           s->layout == FH_LAYOUT_HV ? s->vocab : s->hidden};
    int bad = 0;
    bad |= npy_write(dir, "hidden", "<f4", c->x, 2, nh);
    bad |= npy_write(dir, "weight", "<f4", c->weight, 2, w2);
    bad |= npy_write(dir, "completion_ids", "<i8", c->ids, 2, bt);
    bad |= npy_write(dir, "completion_mask", "<f4", c->mask, 2, bt);
    bad |= npy_write(dir, "advantages", "<f4", c->advantages, 1, b1);
    if (c->old_logps)
        bad |= npy_write(dir, "old_per_token_logps", "<f4", c->old_logps, 2, bt);
    bad |= npy_write(dir, "ref_per_token_logps", "<f4", c->ref_logps, 2, bt);
    if (c->sampling_logps)
        bad |= npy_write(dir, "sampling_per_token_logps", "<f4", c->sampling_logps, 2, bt);
    bad |= npy_write(dir, "per_token_logp", "<f4", c->logp, 2, bt);
    bad |= npy_write(dir, "per_token_loss", "<f4", c->per_token_loss, 2, bt);
    bad |= npy_write(dir, "entropy", "<f4", c->entropy, 2, bt);
    bad |= npy_write(dir, "loss", "<f8", &c->loss, 0, NULL);
    bad |= npy_write(dir, "dhidden", "<f4", c->dx, 2, nh);
    bad |= npy_write(dir, "dweight", "<f4", c->dweight, 2, w2);
    if (c->bias) {
        const int64_t v1[1] = {s->vocab};
        bad |= npy_write(dir, "bias", "<f4", c->bias, 1, v1);
        bad |= npy_write(dir, "dbias", "<f4", c->dbias, 1, v1);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/metrics.json", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    print_metrics(f, &c->metrics);
    fputc('\n', f);
    return (fclose(f) != 0) | bad;
}

static int report(const void *check)
{
    const grpo_check *k = check;
    const grpo_case *c = &k->c;
    const grpo_metrics_diff *d = &k->d;
    const int pass = grpo_metrics_pass(d);
    printf("{\n  \"loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"abs_diff_loss\": %.3e,\n  \"loss_tolerance\": %.3e,\n"
           "  \"logp_max_abs\": %.3e,\n  \"per_token_loss_max_abs\": %.3e,\n  \"entropy_max_abs\": %.3e,\n"
           "  \"metrics_max_abs\": %.3e,\n  \"dhidden_max_abs\": %.3e,\n  \"dhidden_max_rel\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_max_abs\": %.3e,\n  \"dweight_max_rel\": %.3e,\n"
           "  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n  \"metrics\": ",
           c->loss, c->ref_loss, d->abs_diff_loss, d->loss_tolerance, d->logp_max_abs, d->per_token_loss_max_abs,
           d->entropy_max_abs, d->metrics_max_abs, d->dhidden_max_abs, d->dhidden_max_rel, d->dhidden_norm_rel,
           d->dweight_max_abs, d->dweight_max_rel, d->dweight_norm_rel, d->dbias_norm_rel);
    print_metrics(stdout, &c->metrics);
    printf(",\n  \"ref_metrics\": ");
    print_metrics(stdout, &c->ref_metrics);
    printf(",\n  \"tolerance\": {\"loss_abs_per_unit\": %g, \"metrics_abs\": %g, \"grad_norm_rel\": %g},\n"
           "  \"grad_filter_eps\": %g,\n  \"filter_skipped_fraction\": %.4f,\n  \"pass\": %s\n}\n",
           GRPO_LOSS_TOL, GRPO_METRIC_TOL, d->grad_norm_rel_tol, k->spec.grad_filter_eps,
           gradcheck_skipped_fraction(&c->filter_stats), pass ? "true" : "false");
    return pass;
}

static void free_check(void *check)
{
    grpo_case_free(&((grpo_check *)check)->c);
}

int gradcheck_grpo(int argc, char **argv)
{
    static const gradcheck_loss grpo = {usage, parse, run, report, dump_case, free_check};
    grpo_check check = {0};
    return gradcheck_main(&grpo, &check, argc, argv);
}
