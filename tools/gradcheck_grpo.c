/* fh_gradcheck --loss grpo: the fused GRPO head against the double-precision TRL-semantics reference. */
#include "enum_options.h"
#include "gradcheck_grpo.h"

#include "grpo_case.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck --loss grpo --batch B --seq T --hidden H --vocab V --loss-type X\n"
            "       --is-level token|sequence [--beta b] [--epsilon-low e] [--epsilon-high e] [--delta d]\n"
            "       [--temperature t] [--no-old-logps] [--entropy-coef c] [--layout hv|vh] [--bias]\n"
            "       [--threads T] [--seed S] [--train-step] [--tile-rows R] [--tile-vocab C] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-dz] [--dump DIR] [--grad-filter-eps EPS]\n"
            "       [--grad-filter-tail estimate|drop] [--logit-scale S]\n"
            "  X: grpo bnpo dr_grpo dapo cispo sapo\n");
}

static const char *loss_types[] = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"};

static int parse(int argc, char **argv, grpo_case_spec *s, const char **dump)
{
    grpo_case_spec_default(s);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define VALUE_OPTION(name) (strcmp(a, name) == 0 && v && ++i)
        if (VALUE_OPTION("--loss")) {
            if (strcmp(v, "grpo"))
                return -1;
        } else if (VALUE_OPTION("--batch"))
            s->batch = atoll(v);
        else if (VALUE_OPTION("--seq"))
            s->seq = atoll(v);
        else if (VALUE_OPTION("--hidden"))
            s->hidden = atoll(v);
        else if (VALUE_OPTION("--vocab"))
            s->vocab = atoll(v);
        else if (VALUE_OPTION("--loss-type")) {
            int k = 0;
            while (k < 6 && strcmp(v, loss_types[k]))
                k++;
            if (k == 6)
                return -1;
            s->options.loss_type = (fh_grpo_loss_type)k;
        } else if (VALUE_OPTION("--is-level")) {
            if (strcmp(v, "token") && strcmp(v, "sequence"))
                return -1;
            s->options.importance_sampling_level = strcmp(v, "token") ? FH_GRPO_IS_SEQUENCE : FH_GRPO_IS_TOKEN;
        } else if (VALUE_OPTION("--beta"))
            s->options.beta = atof(v);
        else if (VALUE_OPTION("--epsilon-low"))
            s->options.epsilon_low = atof(v);
        else if (VALUE_OPTION("--epsilon-high"))
            s->options.epsilon_high = atof(v);
        else if (VALUE_OPTION("--delta"))
            s->options.delta = atof(v);
        else if (VALUE_OPTION("--temperature"))
            s->options.temperature = atof(v);
        else if (VALUE_OPTION("--entropy-coef"))
            s->options.entropy_coef = atof(v);
        else if (strcmp(a, "--no-old-logps") == 0)
            s->old_logps = 0;
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
        } else if (VALUE_OPTION("--grad-filter-eps")) {
            s->grad_filter_eps = atof(v);
        } else if (VALUE_OPTION("--grad-filter-tail")) {
            if (parse_filter_tail(v, &s->grad_filter_tail) != 0)
                return -1;
        } else if (VALUE_OPTION("--logit-scale")) {
            s->logit_scale = atof(v);
        } else if (strcmp(a, "--fp32-dz") == 0) {
            s->fp32_dz = 1;
        } else if (VALUE_OPTION("--threads"))
            s->threads = atoi(v);
        else if (VALUE_OPTION("--tile-rows"))
            s->tile_rows = atoll(v);
        else if (VALUE_OPTION("--tile-vocab"))
            s->tile_vocab = atoll(v);
        else if (VALUE_OPTION("--seed"))
            s->seed = strtoull(v, NULL, 10);
        else if (strcmp(a, "--train-step") == 0)
            s->train_step = 1;
        else if (VALUE_OPTION("--dump"))
            *dump = v;
        else
            return -1;
#undef VALUE_OPTION
    }
    return s->batch > 0 && s->seq > 0 && s->hidden > 0 && s->vocab > 0 ? 0 : -1;
}

/* JSON has no NaN: metrics TRL does not log are null. */
static void json_number(FILE *f, const char *name, double x, const char *tail)
{
    if (isnan(x))
        fprintf(f, "\"%s\": null%s", name, tail);
    else
        fprintf(f, "\"%s\": %.17g%s", name, x, tail);
}

static void print_metrics(FILE *f, const fh_grpo_metrics *m)
{
    fputc('{', f);
    json_number(f, "kl", m->kl, ", ");
    json_number(f, "entropy", m->entropy, ", ");
    json_number(f, "clip_ratio/low_mean", m->clip_ratio_low_mean, ", ");
    json_number(f, "clip_ratio/high_mean", m->clip_ratio_high_mean, ", ");
    json_number(f, "clip_ratio/region_mean", m->clip_ratio_region_mean, ", ");
    json_number(f, "cispo_clip_ratio", m->cispo_clip_ratio, "}");
}

static int dump_case(const char *dir, const grpo_case *c)
{
    const grpo_case_spec *s = &c->spec;
    mkdir(dir, 0777);
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

int gradcheck_grpo(int argc, char **argv)
{
    grpo_case_spec spec;
    const char *dump = NULL;
    if (parse(argc, argv, &spec, &dump) != 0) {
        usage();
        return 2;
    }
    grpo_case c;
    grpo_metrics_diff d;
    const fh_status st = grpo_case_run(&spec, &c, &d);
    if (st != FH_OK) {
        fprintf(stderr, "fh_gradcheck: the library returned %d (%s)\n", (int)st, fh_status_string(st));
        grpo_case_free(&c);
        return 2;
    }
    const int pass = grpo_metrics_pass(&d);
    printf("{\n  \"loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"abs_diff_loss\": %.3e,\n  \"loss_tolerance\": %.3e,\n"
           "  \"logp_max_abs\": %.3e,\n  \"per_token_loss_max_abs\": %.3e,\n  \"entropy_max_abs\": %.3e,\n"
           "  \"metrics_max_abs\": %.3e,\n  \"dhidden_max_abs\": %.3e,\n  \"dhidden_max_rel\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_max_abs\": %.3e,\n  \"dweight_max_rel\": %.3e,\n"
           "  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n  \"metrics\": ",
           c.loss, c.ref_loss, d.abs_diff_loss, d.loss_tolerance, d.logp_max_abs, d.per_token_loss_max_abs,
           d.entropy_max_abs, d.metrics_max_abs, d.dhidden_max_abs, d.dhidden_max_rel, d.dhidden_norm_rel,
           d.dweight_max_abs, d.dweight_max_rel, d.dweight_norm_rel, d.dbias_norm_rel);
    print_metrics(stdout, &c.metrics);
    printf(",\n  \"ref_metrics\": ");
    print_metrics(stdout, &c.ref_metrics);
    printf(",\n  \"tolerance\": {\"loss_abs_per_unit\": %g, \"metrics_abs\": %g, \"grad_norm_rel\": %g},\n"
           "  \"grad_filter_eps\": %g,\n  \"filter_skipped_fraction\": %.4f,\n  \"pass\": %s\n}\n",
           GRPO_LOSS_TOL, GRPO_METRIC_TOL, d.grad_norm_rel_tol, spec.grad_filter_eps,
           c.filter_stats.gradient_flops > 0 ? c.filter_stats.skipped_flops / c.filter_stats.gradient_flops : 0.0,
           pass ? "true" : "false");
    int rc = pass ? 0 : 1;
    if (dump && dump_case(dump, &c) != 0) {
        fprintf(stderr, "fh_gradcheck: could not write to %s\n", dump);
        rc = 2;
    }
    grpo_case_free(&c);
    return rc;
}
