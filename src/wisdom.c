/* Wisdom: tile configurations measured by fh_tune, kept in the context and in a text file:
 *   # comment
 *   fusedhead-wisdom 1
 *   <threads> <n> <hidden> <vocab> forward|backward|train_step <tile_rows> <tile_vocab> [bf16]
 * (an entry without the last word is fp32, so files written before bf16 read as they did). */
#include "wisdom.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *call_names[] = {"forward", "backward", "train_step"};
#define WISDOM_HEADER "fusedhead-wisdom 1"

static int valid(const fh_tile_config *e)
{
    return e->threads >= 1 && e->n >= 1 && e->hidden >= 1 && e->vocab >= 1 && (unsigned)e->call <= FH_CALL_TRAIN_STEP &&
           e->tile_rows >= 1 && e->tile_vocab >= 1 && (e->dtype == FH_DTYPE_F32 || e->dtype == FH_DTYPE_BF16);
}

static int same_key(const fh_tile_config *a, const fh_tile_config *b)
{
    return a->threads == b->threads && a->n == b->n && a->hidden == b->hidden && a->vocab == b->vocab &&
           a->call == b->call && a->dtype == b->dtype;
}

FH_API fh_status fh_context_add_wisdom(fh_context *ctx, const fh_tile_config *entry)
{
    if (!ctx || !entry)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    if (!valid(entry))
        return fh_fail(ctx, FH_ERR_INVALID_WISDOM, "wisdom entry has a size < 1, an unknown call or an unknown dtype");
    for (int k = 0; k < ctx->wisdom_count; k++)
        if (same_key(&ctx->wisdom[k], entry)) {
            ctx->wisdom[k] = *entry;
            return FH_OK;
        }
    if (ctx->wisdom_count == FH_WISDOM_CAPACITY)
        return fh_fail(ctx, FH_ERR_INVALID_WISDOM, "the wisdom table is full (%d entries)", FH_WISDOM_CAPACITY);
    ctx->wisdom[ctx->wisdom_count++] = *entry;
    return FH_OK;
}

/* Parses one entry line; returns 0 or -1. */
static int parse_entry(const char *line, fh_tile_config *e)
{
    char call[32], dtype[32];
    long long threads, n, hidden, vocab, rows, cols;
    char extra;
    const int fields = sscanf(line, "%lld %lld %lld %lld %31s %lld %lld %31s %c", &threads, &n, &hidden, &vocab, call,
                              &rows, &cols, dtype, &extra);
    if (fields != 7 && !(fields == 8 && strcmp(dtype, "bf16") == 0))
        return -1;
    int k = 0;
    while (k < 3 && strcmp(call, call_names[k]))
        k++;
    const fh_tile_config parsed = {threads, n, hidden, vocab, (fh_call)k, rows, cols,
                                   fields == 8 ? FH_DTYPE_BF16 : FH_DTYPE_F32};
    *e = parsed;
    return k < 3 && valid(e) ? 0 : -1;
}

FH_API fh_status fh_context_load_wisdom(fh_context *ctx, const char *path)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    if (!path)
        path = getenv("FH_WISDOM");
    if (!path)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "no wisdom path given and FH_WISDOM is not set");
    FILE *f = fopen(path, "r");
    if (!f)
        return fh_fail(ctx, FH_ERR_WISDOM_IO, "cannot open wisdom file %s", path);
    /* Parse everything first so that a malformed file adds nothing. */
    fh_tile_config entries[FH_WISDOM_CAPACITY];
    int count = 0, line_number = 0, header = 0;
    char line[512];
    fh_status st = FH_OK;
    while (st == FH_OK && fgets(line, sizeof line, f)) {
        line_number++;
        const char *p = line + strspn(line, " \t");
        if (*p == '#' || *p == '\n' || *p == '\0')
            continue;
        if (!header) {
            header = strncmp(p, WISDOM_HEADER, strlen(WISDOM_HEADER)) == 0;
            if (!header)
                st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: expected \"" WISDOM_HEADER "\"", path, line_number);
            continue;
        }
        if (count == FH_WISDOM_CAPACITY || parse_entry(p, &entries[count]) != 0)
            st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: malformed entry (or more than %d)", path, line_number,
                         FH_WISDOM_CAPACITY);
        else
            count++;
    }
    if (ferror(f) && st == FH_OK)
        st = fh_fail(ctx, FH_ERR_WISDOM_IO, "error reading wisdom file %s", path);
    fclose(f);
    if (st == FH_OK && !header)
        st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s: no \"" WISDOM_HEADER "\" line", path);
    for (int k = 0; st == FH_OK && k < count; k++)
        st = fh_context_add_wisdom(ctx, &entries[k]);
    return st;
}

FH_API fh_status fh_context_save_wisdom(const fh_context *ctx, const char *path)
{
    if (!ctx || !path)
        return FH_ERR_NULL_POINTER;
    FILE *f = fopen(path, "w");
    if (!f)
        return FH_ERR_WISDOM_IO;
    int ok = fprintf(f, "# written by fusedhead: threads n hidden vocab call tile_rows tile_vocab [bf16]\n" WISDOM_HEADER
                        "\n") > 0;
    for (int k = 0; ok && k < ctx->wisdom_count; k++) {
        const fh_tile_config *e = &ctx->wisdom[k];
        ok = fprintf(f, "%lld %lld %lld %lld %s %lld %lld%s\n", (long long)e->threads, (long long)e->n,
                     (long long)e->hidden, (long long)e->vocab, call_names[e->call], (long long)e->tile_rows,
                     (long long)e->tile_vocab, e->dtype == FH_DTYPE_BF16 ? " bf16" : "") > 0;
    }
    ok = (fclose(f) == 0) && ok;
    return ok ? FH_OK : FH_ERR_WISDOM_IO;
}

const fh_tile_config *fh_wisdom_lookup(const fh_context *ctx, int64_t threads, int64_t n, int64_t hidden,
                                       int64_t vocab, fh_call call, fh_dtype dtype)
{
    const fh_tile_config *best = NULL;
    double best_distance = INFINITY;
    for (int k = 0; k < ctx->wisdom_count; k++) {
        const fh_tile_config *e = &ctx->wisdom[k];
        if (e->threads != threads || e->hidden != hidden || e->vocab != vocab || e->call != call ||
            e->dtype != (int)dtype)
            continue;
        const double distance = fabs(log((double)e->n / (double)n));
        if (distance < best_distance) {
            best_distance = distance;
            best = e;
        }
    }
    return best;
}
