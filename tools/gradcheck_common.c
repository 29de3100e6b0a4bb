#include "gradcheck_common.h"

#include "enum_options.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* One shared option (gradcheck_own_option's contract); those whose field is NULL are not the loss's. */
static int shared_option(const gradcheck_options *o, const char *a, const char *v)
{
    const struct {
        const char *name;
        int *field;
    } flags[] = {{"--bias", o->bias}, {"--train-step", o->train_step}, {"--fp32-du", o->fp32_du}};
    for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
        if (flags[k].field && strcmp(a, flags[k].name) == 0) {
            *flags[k].field = 1;
            return 1;
        }
    if (!v)
        return 0;
    const struct {
        const char *name;
        int64_t *field;
    } sizes[] = {{"--n", o->n},           {"--batch", o->batch},           {"--seq", o->seq},
                 {"--hidden", o->hidden}, {"--vocab", o->vocab},           {"--tile-rows", o->tile_rows},
                 {"--tile-vocab", o->tile_vocab}, {"--budget", o->budget}};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        if (sizes[k].field && strcmp(a, sizes[k].name) == 0) {
            *sizes[k].field = atoll(v);
            return 2;
        }
    const struct {
        const char *name;
        double *field;
    } reals[] = {{"--ignore-frac", o->ignore_frac},
                 {"--grad-filter-eps", o->grad_filter_eps},
                 {"--logit-scale", o->logit_scale}};
    for (size_t k = 0; k < sizeof reals / sizeof reals[0]; k++)
        if (reals[k].field && strcmp(a, reals[k].name) == 0) {
            *reals[k].field = atof(v);
            return 2;
        }
#define TAKES(option, field) (o->field && strcmp(a, option) == 0)
    if (TAKES("--threads", threads))
        *o->threads = atoi(v);
    else if (TAKES("--seed", seed))
        *o->seed = strtoull(v, NULL, 10);
    else if (TAKES("--grad-output", grad_output))
        *o->grad_output = (float)atof(v);
    else if (TAKES("--layout", layout))
        return parse_layout(v, o->layout) != 0 ? -1 : 2;
    else if (TAKES("--reduction", reduction))
        return parse_reduction(v, o->reduction) != 0 ? -1 : 2;
    else if (TAKES("--dtype", dtype))
        return parse_dtype(v, o->dtype) != 0 ? -1 : 2;
    else if (TAKES("--grad-dtype", grad_dtype))
        return parse_dtype(v, o->grad_dtype) != 0 ? -1 : 2;
    else if (TAKES("--grad-filter-tail", grad_filter_tail))
        return parse_filter_tail(v, o->grad_filter_tail) != 0 ? -1 : 2;
    else if (TAKES("--dump", dump))
        *o->dump = v;
    else
        return 0;
#undef TAKES
    return 2;
}

int gradcheck_parse(int argc, char **argv, const gradcheck_options *shared, gradcheck_own_option own, void *spec)
{
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int used = shared_option(shared, argv[i], v);
        if (used == 0)
            used = own(spec, argv[i], v);
        if (used <= 0)
            return -1;
        i += used - 1;
    }
    return 0;
}

int gradcheck_main(const gradcheck_loss *loss, void *check, int argc, char **argv)
{
    const char *dump = NULL;
    if (loss->parse(check, argc, argv, &dump) != 0) {
        loss->usage();
        return 2;
    }
    int rc = loss->run(check);
    if (rc == 0) {
        rc = loss->report(check) ? 0 : 1;
        if (dump) {
            mkdir(dump, 0777); /* may exist already; a failed write says the rest */
            if (loss->dump(check, dump) != 0) {
                fprintf(stderr, "fh_gradcheck: could not write to %s\n", dump);
                rc = 2;
            }
        }
    }
    loss->free(check);
    return rc;
}

void *gradcheck_calloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "fh_gradcheck: out of memory\n");
        exit(2);
    }
    return p;
}

double *gradcheck_doubles(const float *f, size_t count)
{
    if (!f)
        return NULL;
    double *d = gradcheck_calloc(count, sizeof *d);
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

fh_status gradcheck_context(fh_context **ctx, int threads, int64_t tile_rows, int64_t tile_vocab, int64_t budget,
                            int fp32_du)
{
    *ctx = NULL;
    fh_status st = fh_context_create(ctx);
    const struct {
        fh_param param;
        int64_t value;
    } settings[] = {{FH_PARAM_THREADS, threads},
                    {FH_PARAM_TILE_ROWS, tile_rows},
                    {FH_PARAM_TILE_VOCAB, tile_vocab},
                    {FH_PARAM_MEMORY_BUDGET, budget},
                    {FH_PARAM_FP32_DU, fp32_du}};
    for (size_t j = 0; st == FH_OK && j < sizeof settings / sizeof settings[0]; j++)
        st = fh_context_set(*ctx, settings[j].param, settings[j].value);
    return st;
}

int gradcheck_library_failed(fh_status st, const char *message)
{
    const int has_message = message && message[0];
    fprintf(stderr, "fh_gradcheck: the library returned %d (%s)%s%s\n", (int)st, fh_status_string(st),
            has_message ? ": " : "", has_message ? message : "");
    return 2;
}

void gradcheck_json_number(FILE *f, const char *name, double x, const char *tail)
{
    if (isnan(x))
        fprintf(f, "\"%s\": null%s", name, tail);
    else
        fprintf(f, "\"%s\": %.17g%s", name, x, tail);
}

double gradcheck_skipped_fraction(const fh_filter_stats *stats)
{
    return stats->gradient_flops > 0 ? stats->skipped_flops / stats->gradient_flops : 0.0;
}
