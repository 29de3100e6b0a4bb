/* fh_gradcheck: runs the fused cross-entropy (--loss grpo, logprob, dpo|orpo|simpo|cpo, distill, distill_topk, kto: those heads) and the
 * double-precision reference on random inputs, prints the differences as JSON and exits non-zero past tolerance.
 * --dump DIR writes every input and fused output as .npy so other tools can check them independently. Exits 77 (a
 * skip for ctest), saying why, when FH_ROW_KERNELS or FH_BF16_GEMM asks for kernels this CPU or build lacks. */
#include "ce_case.h"
#include "gradcheck_common.h"
#include "gradcheck_distill.h"
#include "gradcheck_distill_topk.h"
#include "gradcheck_grpo.h"
#include "gradcheck_logprob.h"
#include "gradcheck_preference.h"
#include "gradcheck_kto.h"
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void)
{
    fprintf(stderr,
            "usage: fh_gradcheck [--loss ce] --n N --hidden H --vocab V [--layout hv|vh] [--bias] [--ignore-frac F]\n"
            "       [--label-smoothing E] [--class-weights] [--softcap C] [--z-loss S]\n"
            "       [--reduction mean|sum|none] [--threads T] [--seed S] [--dump DIR]\n"
            "       [--train-step] [--budget BYTES] [--tile-rows R] [--tile-vocab C] [--dtype f32|bf16]\n"
            "       [--grad-dtype f32|bf16] [--fp32-du] [--grad-filter-eps EPS]\n"
            "       [--grad-filter-tail estimate|drop] [--logit-scale S] [--ce-logit-scale M] [--token-scaling]\n"
            "       [--entropy]\n"
            "       fh_gradcheck --loss grpo ... (fh_gradcheck --loss grpo --help)\n"
            "       fh_gradcheck --loss logprob ... (fh_gradcheck --loss logprob --help)\n"
            "       fh_gradcheck --loss dpo|orpo|simpo|cpo ... (fh_gradcheck --loss dpo --help)\n"
            "       fh_gradcheck --loss distill ... (fh_gradcheck --loss distill --help)\n"
            "       fh_gradcheck --loss distill_topk ... (fh_gradcheck --loss distill_topk --help)\n"
            "       fh_gradcheck --loss kto ... (fh_gradcheck --loss kto --help)\n");
}

/* The cross-entropy case, as gradcheck_main runs it. */
typedef struct ce_check {
    ce_case_spec spec;
    ce_case c;
    ce_metrics m;
    const char *kernel_set; /* the row kernels in use, for the JSON */
} ce_check;

/* CE's own options (gradcheck_own_option). */
static int ce_option(void *spec, const char *a, const char *v)
{
    ce_case_spec *s = spec;
    const struct {
        const char *name;
        int *field;
    } flags[] = {{"--class-weights", &s->class_weights}, {"--token-scaling", &s->token_scaling},
                 {"--entropy", &s->entropy}};
    for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
        if (strcmp(a, flags[k].name) == 0) {
            *flags[k].field = 1;
            return 1;
        }
    if (!v)
        return 0;
    if (strcmp(a, "--loss") == 0)
        return 2; /* "ce" (checked in main) */
    if (strcmp(a, "--label-smoothing") == 0)
        s->label_smoothing = atof(v);
    else if (strcmp(a, "--softcap") == 0)
        s->softcap = atof(v);
    else if (strcmp(a, "--z-loss") == 0)
        s->z_loss = atof(v);
    else if (strcmp(a, "--ce-logit-scale") == 0)
        s->ce_logit_scale = atof(v);
    else
        return 0;
    return 2;
}

static int parse(void *check, int argc, char **argv, const char **dump)
{
    ce_case_spec *s = &((ce_check *)check)->spec;
    ce_case_spec_default(s);
    s->n = 257;
    s->hidden = 129;
    s->vocab = 5003;
    const gradcheck_options shared = {GRADCHECK_EVERY_LOSS_OPTIONS(s, dump),
                                      .n = &s->n,
                                      .ignore_frac = &s->ignore_frac,
                                      .reduction = &s->reduction,
                                      .train_step = &s->train_step,
                                      .budget = &s->budget,
                                      .grad_filter_eps = &s->grad_filter_eps,
                                      .grad_filter_tail = &s->grad_filter_tail,
                                      .logit_scale = &s->logit_scale};
    return gradcheck_parse(argc, argv, &shared, ce_option, s);
}

static int run(void *check)
{
    ce_check *k = check;
    const fh_status st = ce_case_run(&k->spec, &k->c, &k->m);
    return st == FH_OK ? 0 : gradcheck_library_failed(st, NULL);
}

static int dump_case(const void *check, const char *dir)
{
    const ce_case *c = &((const ce_check *)check)->c;
    const ce_case_spec *s = &c->spec;
    const int64_t nh[2] = {s->n, s->hidden}, n1[1] = {s->n}, v1[1] = {s->vocab};
    const int64_t w2[2] = {s->layout == FH_LAYOUT_HV ? s->hidden : s->vocab,
                           s->layout == FH_LAYOUT_HV ? s->vocab : s->hidden};
    const int64_t g1[1] = {s->reduction == FH_REDUCTION_NONE ? s->n : 1};
    int bad = 0;
    bad |= npy_write(dir, "hidden", "<f4", c->x, 2, nh);
    bad |= npy_write(dir, "weight", "<f4", c->weight, 2, w2);
    bad |= npy_write(dir, "targets", "<i8", c->targets, 1, n1);
    bad |= npy_write(dir, "grad_output", "<f4", c->grad_output, 1, g1);
    bad |= npy_write(dir, "loss", "<f8", &c->loss, 0, NULL);
    bad |= npy_write(dir, "per_token_loss", "<f4", c->per_token_loss, 1, n1);
    bad |= npy_write(dir, "per_token_logp", "<f4", c->logp, 1, n1);
    bad |= npy_write(dir, "lse", "<f4", c->lse, 1, n1);
    bad |= npy_write(dir, "correct", "<i8", &c->correct, 0, NULL);
    if (c->entropy)
        bad |= npy_write(dir, "entropy", "<f4", c->entropy, 1, n1);
    bad |= npy_write(dir, "dhidden", "<f4", c->dx, 2, nh);
    bad |= npy_write(dir, "dweight", "<f4", c->dweight, 2, w2);
    if (c->bias) {
        bad |= npy_write(dir, "bias", "<f4", c->bias, 1, v1);
        bad |= npy_write(dir, "dbias", "<f4", c->dbias, 1, v1);
    }
    if (c->class_weights)
        bad |= npy_write(dir, "class_weights", "<f4", c->class_weights, 1, v1);
    return bad;
}

static int report(const void *check)
{
    const ce_check *k = check;
    const ce_case *c = &k->c;
    const ce_metrics *m = &k->m;
    const int pass = ce_metrics_pass(m);
    printf("{\n  \"loss\": %.17g,\n  \"ref_loss\": %.17g,\n  \"abs_diff_loss\": %.3e,\n  \"rel_diff_loss\": %.3e,\n"
           "  \"abs_diff_z_loss\": %.3e,\n  \"per_token_loss_max_abs\": %.3e,\n  \"logp_max_abs\": %.3e,\n"
           "  \"lse_max_abs\": %.3e,\n  \"dhidden_max_abs\": %.3e,\n  \"dhidden_max_rel\": %.3e,\n"
           "  \"dhidden_norm_rel\": %.3e,\n  \"dweight_max_abs\": %.3e,\n  \"dweight_max_rel\": %.3e,\n"
           "  \"dweight_norm_rel\": %.3e,\n  \"dbias_norm_rel\": %.3e,\n  \"argmax_mismatches\": %lld,\n"
           "  \"correct\": %lld,\n  \"ref_correct\": %lld,\n  \"correct_mismatch\": %lld,\n  \"entropy_max_abs\": %.3e,\n"
           "  \"tolerance\": {\"loss_rel\": %g, \"grad_norm_rel\": %g, \"dbias_norm_rel\": %g, \"entropy_abs\": %g},\n"
           "  \"blis_kernel_set\": \"%s\",\n"
           "  \"grad_filter_eps\": %g,\n  \"filter_skipped_fraction\": %.4f,\n  \"pass\": %s\n}\n",
           c->loss, c->ref_loss, m->abs_diff_loss, m->rel_diff_loss, m->abs_diff_z_loss, m->per_token_loss_max_abs,
           m->logp_max_abs, m->lse_max_abs, m->dhidden_max_abs, m->dhidden_max_rel, m->dhidden_norm_rel,
           m->dweight_max_abs, m->dweight_max_rel, m->dweight_norm_rel, m->dbias_norm_rel,
           (long long)m->argmax_mismatches, (long long)c->correct, (long long)c->ref_correct,
           (long long)m->correct_mismatch, m->entropy_max_abs, m->loss_rel_tol, m->grad_norm_rel_tol,
           m->dbias_norm_rel_tol, m->entropy_tol, k->kernel_set,
           k->spec.grad_filter_eps, gradcheck_skipped_fraction(&c->filter_stats), pass ? "true" : "false");
    return pass;
}

static void free_check(void *check)
{
    ce_case_free(&((ce_check *)check)->c);
}

int main(int argc, char **argv)
{
    fh_kernel_info kernels;
    if (fh_kernel_query(&kernels) == FH_OK && kernels.refusal) {
        printf("fh_gradcheck: skipped: %s\n", kernels.refusal);
        return 77;
    }
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--loss") == 0) {
            if (strcmp(argv[i + 1], "grpo") == 0)
                return gradcheck_grpo(argc, argv);
            if (strcmp(argv[i + 1], "logprob") == 0)
                return gradcheck_logprob(argc, argv);
            if (gradcheck_is_preference(argv[i + 1]))
                return gradcheck_preference(argc, argv);
            if (strcmp(argv[i + 1], "distill") == 0)
                return gradcheck_distill(argc, argv);
            if (strcmp(argv[i + 1], "kto") == 0)
                return gradcheck_kto(argc, argv);
            if (strcmp(argv[i + 1], "distill_topk") == 0)
                return gradcheck_distill_topk(argc, argv);
            if (strcmp(argv[i + 1], "ce") != 0) {
                usage();
                return 2;
            }
        }
    static const gradcheck_loss ce = {usage, parse, run, report, dump_case, free_check};
    ce_check check = {.kernel_set = kernels.kernel_set};
    return gradcheck_main(&ce, &check, argc, argv);
}
