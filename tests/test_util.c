#include "test_util.h"

#include "ce_case.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tu_check(int ok, unsigned line, const char *file, const char *func, const char *format, ...)
{
    if (ok) {
        CU_assertImplementation(CU_TRUE, line, "", file, func, CU_FALSE);
        return;
    }
    char text[1536];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof text, format, args);
    va_end(args);
    CU_assertImplementation(CU_FALSE, line, text, file, func, CU_FALSE);
}

void tu_fill_canary(void *p, size_t bytes)
{
    memset(p, TU_CANARY, bytes);
}

void *tu_alloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        abort();
    }
    return p;
}

double *tu_doubles(const float *f, size_t count)
{
    if (!f)
        return NULL;
    double *d = tu_alloc(count, sizeof(double));
    for (size_t i = 0; i < count; i++)
        d[i] = f[i];
    return d;
}

fh_context *tu_context(int threads, int64_t tile_rows, int64_t tile_vocab, int64_t memory_budget)
{
    fh_context *ctx = NULL;
    fh_status st = fh_context_create(&ctx);
    TU_CHECK(st == FH_OK && ctx, "fh_context_create: %d", (int)st);
    if (!ctx)
        return NULL;
    const struct {
        fh_param param;
        int64_t value;
    } settings[] = {{FH_PARAM_THREADS, threads},
                    {FH_PARAM_TILE_ROWS, tile_rows},
                    {FH_PARAM_TILE_VOCAB, tile_vocab},
                    {FH_PARAM_MEMORY_BUDGET, memory_budget}};
    for (size_t k = 0; k < TU_COUNT(settings); k++) {
        st = fh_context_set(ctx, settings[k].param, settings[k].value);
        TU_CHECK(st == FH_OK, "fh_context_set(%d, %lld): %d", (int)settings[k].param,
                 (long long)settings[k].value, (int)st);
    }
    return ctx;
}

int tu_all_finite_f(const float *a, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

int tu_all_equal_f(const float *a, size_t count, float value)
{
    for (size_t i = 0; i < count; i++)
        if (!(a[i] == value))
            return 0;
    return 1;
}

double tu_norm_rel_f(const float *a, const float *b, size_t count)
{
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double d = (double)a[i] - b[i];
        diff += d * d;
        norm += (double)b[i] * b[i];
    }
    return norm > 0.0 ? sqrt(diff / norm) : sqrt(diff);
}

double tu_max_abs_diff(const float *f, const double *r, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++) {
        const double e = fabs((double)f[i] - r[i]);
        if (e > m || isnan(e))
            m = e;
        if (isnan(m))
            return m;
    }
    return m;
}

double tu_max_abs_d(const double *a, size_t count)
{
    double m = 0.0;
    for (size_t i = 0; i < count; i++)
        m = fabs(a[i]) > m ? fabs(a[i]) : m;
    return m;
}

static int is_alnum(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

int tu_mentions(const char *text, const char *word)
{
    for (const char *s = text; (s = strstr(s, word)) != NULL; s++)
        if (s == text || !is_alnum(s[-1]))
            return 1;
    return 0;
}

void tu_fill_uniform(float *p, size_t count, uint64_t *rng, double lo, double hi)
{
    for (size_t i = 0; i < count; i++)
        p[i] = (float)(lo + (hi - lo) * ref_uniform(rng));
}
