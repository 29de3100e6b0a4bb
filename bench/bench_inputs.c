#include "bench_inputs.h"

#include "bf16.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { PEAKED_SEED = 6 };
static const double default_peaked_entropy = 2.0; /* nats: about the trained example head's 2.3 on held-out text */

/* The benchmark's LCG: a value in [0, 1). */
static float next_unit(unsigned *seed)
{
    *seed = *seed * 1664525u + 1013904223u;
    return (float)(*seed >> 8) / 16777216.0f;
}

static void fill(float *p, size_t count, float scale, unsigned seed)
{
    for (size_t i = 0; i < count; i++)
        p[i] = scale * (next_unit(&seed) - 0.5f);
}

float *bench_filled(size_t count, float scale, unsigned seed)
{
    float *p = malloc(count * sizeof(float));
    if (p)
        fill(p, count, scale, seed);
    return p;
}

int bench_distribution_parse(const char *text, bench_distribution *d)
{
    *d = (bench_distribution){BENCH_UNIFORM, 0.0, 1.0f, NULL};
    if (strcmp(text, "uniform") == 0)
        return 0;
    if (strncmp(text, "peaked", 6) == 0 && (text[6] == '\0' || text[6] == ':')) {
        d->kind = BENCH_PEAKED;
        d->entropy = default_peaked_entropy;
        if (text[6] == '\0')
            return 0;
        char *end;
        d->entropy = strtod(text + 7, &end);
        return *end == '\0' && end != text + 7 && d->entropy > 0 && isfinite(d->entropy) ? 0 : -1;
    }
    d->kind = BENCH_REPLAY;
    d->dir = text;
    return 0;
}

static void replay_path(char *path, size_t size, const char *dir, const char *name)
{
    snprintf(path, size, "%s/%s.npy", dir, name);
}

int bench_replay_shape(const char *dir, int64_t *n, int64_t *hidden, int64_t *vocab, char *why, size_t why_size)
{
    char path[4096];
    int64_t x[2], t[1], w[2];
    replay_path(path, sizeof path, dir, "hidden");
    if (npy_read(path, "<f4", 2, x, NULL, 0, why, why_size) != 0)
        return -1;
    replay_path(path, sizeof path, dir, "targets");
    if (npy_read(path, "<i8", 1, t, NULL, 0, why, why_size) != 0)
        return -1;
    replay_path(path, sizeof path, dir, "weight");
    if (npy_read(path, "<f4", 2, w, NULL, 0, why, why_size) != 0)
        return -1;
    if (t[0] != x[0] || w[1] != x[1] || x[0] < 1 || x[1] < 1 || w[0] < 1) {
        snprintf(why, why_size, "%s: hidden.npy [%lld, %lld], targets.npy [%lld] and weight.npy [%lld, %lld] do not "
                 "make a batch: expected [N, H], [N] and [V, H], none empty", dir, (long long)x[0], (long long)x[1],
                 (long long)t[0], (long long)w[0], (long long)w[1]);
        return -1;
    }
    *n = x[0], *hidden = x[1], *vocab = w[0];
    return 0;
}

/* The first n rows of a saved batch; the [V, H] weight transposed for the hv layout. */
static int read_replay(const char *dir, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in,
                       char *why, size_t why_size)
{
    char path[4096];
    int64_t shape[2];
    replay_path(path, sizeof path, dir, "hidden");
    if (npy_read(path, "<f4", 2, shape, in->x, (size_t)n * hidden, why, why_size) != 0)
        return -1;
    replay_path(path, sizeof path, dir, "targets");
    if (npy_read(path, "<i8", 1, shape, in->targets, (size_t)n, why, why_size) != 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (in->targets[i] < 0 || in->targets[i] >= vocab) {
            snprintf(why, why_size, "%s: targets[%lld] = %lld is outside [0, %lld)", path, (long long)i,
                     (long long)in->targets[i], (long long)vocab);
            return -1;
        }
    const size_t hv = (size_t)hidden * vocab;
    float *vh = layout == FH_LAYOUT_VH ? in->w : malloc(hv * sizeof(float));
    replay_path(path, sizeof path, dir, "weight");
    if (!vh || npy_read(path, "<f4", 2, shape, vh, hv, why, why_size) != 0) {
        if (!vh)
            snprintf(why, why_size, "out of memory for a transposed copy of %s", path);
        if (vh != in->w)
            free(vh);
        return -1;
    }
    if (vh != in->w) {
        for (int64_t j = 0; j < vocab; j++)
            for (int64_t k = 0; k < hidden; k++)
                in->w[k * vocab + j] = vh[j * hidden + k];
        free(vh);
    }
    return 0;
}

static int64_t gcd(int64_t a, int64_t b)
{
    while (b) {
        const int64_t r = a % b;
        a = b, b = r;
    }
    return a;
}

/* Peaked: a language model's softmax in miniature. Token j has the Zipf log-prior -ln(1 + rank_j); the ranks are
 * spread over the vocabulary by a fixed bijection, so that frequent tokens are not adjacent and vocabulary sorting
 * has work to do, as in the example's trained head (its blocks of negligible entries are more numerous once the
 * vocabulary is sorted). Row i's target t_i is drawn from that Zipf distribution and its logit stands out by
 * ln V; every logit gets noise of unit variance. With r_j ~ U(-a, a)^(H-1), a = sqrt(3 / (H - 1)) (|r_j|^2 ~ 1)
 * and u_i ~ U(-sqrt 3, sqrt 3)^(H-1):
 *     W[j] = (-ln(1 + rank_j), r_j)        x_i = scale (1, u_i + ln V r_t / |r_t|^2)
 *     x_i . W[j] = scale (-ln(1 + rank_j) + u_i . r_j + ln V (r_t . r_j) / |r_t|^2)
 * scale, an inverse temperature, sets the mean entropy (bench_peaked_calibrate): the softmax's entropy falls
 * monotonically from ln V at scale 0. */
static int make_peaked(float scale, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in,
                       char *why, size_t why_size)
{
    if (hidden < 2) {
        snprintf(why, why_size, "the peaked distribution needs --hidden 2 or more (one column holds the prior)");
        return -1;
    }
    double *cumulative = malloc((size_t)vocab * sizeof(double));
    if (!cumulative) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    int64_t stride = 7919; /* token of rank r: r * stride mod V, a bijection when gcd(stride, V) = 1 */
    while (gcd(stride, vocab) != 1)
        stride += 2;
    const int64_t hstride = layout == FH_LAYOUT_VH ? 1 : vocab, vstride = layout == FH_LAYOUT_VH ? hidden : 1;
    const float a = sqrtf(3.0f / (float)(hidden - 1));
    unsigned seed = PEAKED_SEED;
    double total = 0.0;
    for (int64_t r = 0; r < vocab; r++) {
        const int64_t j = r * stride % vocab;
        in->w[j * vstride] = -logf(1.0f + (float)r);
        for (int64_t k = 1; k < hidden; k++)
            in->w[j * vstride + k * hstride] = a * (2.0f * next_unit(&seed) - 1.0f);
        cumulative[r] = total += 1.0 / (1.0 + (double)r);
    }
    const float margin = logf((float)vocab), root3 = sqrtf(3.0f);
    for (int64_t i = 0; i < n; i++) {
        /* The target's rank: the first r with cumulative[r] > u (inverse transform sampling). */
        const double u = next_unit(&seed) * total;
        int64_t lo = 0, hi = vocab - 1;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (cumulative[mid] > u)
                hi = mid;
            else
                lo = mid + 1;
        }
        const int64_t t = lo * stride % vocab;
        in->targets[i] = t;
        float norm2 = 0.0f;
        for (int64_t k = 1; k < hidden; k++)
            norm2 += in->w[t * vstride + k * hstride] * in->w[t * vstride + k * hstride];
        float *x = in->x + i * hidden;
        x[0] = scale;
        for (int64_t k = 1; k < hidden; k++)
            x[k] = scale * (root3 * (2.0f * next_unit(&seed) - 1.0f) +
                            margin * in->w[t * vstride + k * hstride] / norm2);
    }
    free(cumulative);
    return 0;
}

static void make_uniform(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in)
{
    fill(in->x, (size_t)n * hidden, 2.0f, 1);
    /* x ~ U(-1, 1), w ~ U(-a, a) with a = sqrt(3 / H): logits of standard deviation ~1. */
    fill(in->w, (size_t)hidden * vocab, 2.0f * sqrtf(3.0f / (float)hidden), 2);
    for (int64_t i = 0; i < n; i++)
        in->targets[i] = (i * 7919) % vocab;
}

int bench_inputs_make_from(const bench_distribution *d, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab,
                           bench_inputs *in, char *why, size_t why_size)
{
    const size_t nh = (size_t)n * hidden, hv = (size_t)hidden * vocab;
    in->x = malloc(nh * sizeof(float));
    in->w = malloc(hv * sizeof(float));
    in->dx = bench_filled(nh, 1.0f, 3);
    in->dw = bench_filled(hv, 1.0f, 4);
    in->lse = bench_filled((size_t)n, 1.0f, 5);
    in->targets = malloc((size_t)n * sizeof(int64_t));
    in->x_bf16 = in->w_bf16 = NULL;
    int status = 0;
    if (!in->x || !in->w || !in->dx || !in->dw || !in->lse || !in->targets) {
        snprintf(why, why_size, "out of memory");
        status = -1;
    } else if (d->kind == BENCH_PEAKED)
        status = make_peaked(d->scale, layout, n, hidden, vocab, in, why, why_size);
    else if (d->kind == BENCH_REPLAY)
        status = read_replay(d->dir, layout, n, hidden, vocab, in, why, why_size);
    else
        make_uniform(n, hidden, vocab, in);
    if (status != 0)
        bench_inputs_free(in);
    return status;
}

int bench_inputs_make(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in)
{
    const bench_distribution uniform = {BENCH_UNIFORM, 0.0, 1.0f, NULL};
    char why[64];
    return bench_inputs_make_from(&uniform, FH_LAYOUT_HV, n, hidden, vocab, in, why, sizeof why);
}

int bench_inputs_make_teacher(int64_t n, int64_t hidden, int64_t vocab, float logit_std, bench_inputs *in)
{
    *in = (bench_inputs){NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    in->x = bench_filled((size_t)n * hidden, 2.0f, 7);
    in->w = bench_filled((size_t)hidden * vocab, 6.0f * logit_std / sqrtf((float)hidden), 8);
    if (in->x && in->w)
        return 0;
    bench_inputs_free(in);
    return -1;
}

void bench_inputs_free(bench_inputs *in)
{
    free(in->x), free(in->w), free(in->dx), free(in->dw), free(in->lse), free(in->targets);
    free(in->x_bf16), free(in->w_bf16);
    in->x = in->w = in->dx = in->dw = in->lse = NULL;
    in->targets = NULL;
    in->x_bf16 = in->w_bf16 = NULL;
}

static uint16_t *bf16_copy(const float *f, size_t count)
{
    uint16_t *h = malloc(count * sizeof(uint16_t));
    for (size_t i = 0; h && i < count; i++)
        h[i] = bf16_from_float(f[i]);
    return h;
}

int bench_inputs_add_bf16(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in)
{
    in->x_bf16 = bf16_copy(in->x, (size_t)n * (size_t)hidden);
    in->w_bf16 = bf16_copy(in->w, (size_t)hidden * (size_t)vocab);
    return in->x_bf16 && in->w_bf16 ? 0 : -1;
}
