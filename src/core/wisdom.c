/* Wisdom: tile configurations measured by fh_tune, kept in the context and in a text file:
 *   # comment
 *   fusedhead-wisdom 1
 *   <threads> <n> <hidden> <vocab> forward|backward|train_step <tile_rows> <tile_vocab> [bf16]
 * (an entry without the last word is fp32, so files written before bf16 read as they did). */
#include "wisdom.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* Whether the line's numbers (fields 1-4, 6 and 7) fit a long long: sscanf's %lld would saturate (1e23 as
 * 100000000000000000000000 read as LLONG_MAX). */
static int numbers_fit(const char *line)
{
    const char *p = line;
    for (int field = 0; field < 7 && *p; field++) {
        p += strspn(p, " \t");
        if (field != 4) {
            char *end;
            errno = 0;
            (void)strtoll(p, &end, 10);
            if (errno == ERANGE)
                return 0;
        }
        p += strcspn(p, " \t\r\n");
    }
    return 1;
}

/* Parses one entry line; returns 0 or -1. */
static int parse_entry(const char *line, fh_tile_config *e)
{
    if (!numbers_fit(line))
        return -1;
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

/* A wisdom file is a few KiB (one short line per measured shape): anything past this is not one. */
#define WISDOM_MAX_BYTES ((long)1 << 20)
#define WISDOM_MAX_LINE 511

/* Parses the open file into entries; FH_OK or an error naming `where` and the line. */
static fh_status parse_file(fh_context *ctx, FILE *f, const char *where, fh_tile_config *entries, int *count)
{
    int line_number = 0, header = 0;
    char line[WISDOM_MAX_LINE + 2];
    fh_status st = FH_OK;
    *count = 0;
    long start = ftell(f);
    while (st == FH_OK && fgets(line, sizeof line, f)) {
        line_number++;
        /* fgets stops at a newline, a full buffer or the end; fewer characters before the first NUL than it read
         * (an unterminated last line included): the line held a NUL. */
        const size_t length = strlen(line);
        const long end = ftell(f);
        const int complete = length > 0 && line[length - 1] == '\n';
        if (!complete && length == sizeof line - 1)
            return fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: line longer than %d bytes", where, line_number,
                           WISDOM_MAX_LINE);
        if (end - start != (long)length)
            return fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: a NUL byte (not a text file)", where, line_number);
        start = end;
        const char *p = line + strspn(line, " \t");
        if (*p == '#' || *p == '\n' || *p == '\0')
            continue;
        if (!header) {
            const size_t h = strlen(WISDOM_HEADER);
            header = strncmp(p, WISDOM_HEADER, h) == 0 && p[h + strspn(p + h, " \t\r\n")] == '\0';
            if (!header)
                st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: expected \"" WISDOM_HEADER "\"", where, line_number);
        } else if (*count == FH_WISDOM_CAPACITY) {
            st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: more than %d entries", where, line_number,
                         FH_WISDOM_CAPACITY);
        } else if (parse_entry(p, &entries[*count]) != 0) {
            st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s:%d: malformed entry", where, line_number);
        } else {
            ++*count;
        }
    }
    if (st == FH_OK && ferror(f))
        st = fh_fail(ctx, FH_ERR_WISDOM_IO, "%s: read error", where);
    if (st == FH_OK && !header)
        st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s: no \"" WISDOM_HEADER "\" line", where);
    return st;
}

FH_API fh_status fh_context_load_wisdom(fh_context *ctx, const char *path)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    const int from_environment = !path;
    if (!path)
        path = getenv("FH_WISDOM");
    if (!path)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "no wisdom path given and FH_WISDOM is not set");
    char where[320];
    snprintf(where, sizeof where, "%s%.300s", from_environment ? "FH_WISDOM=" : "", path);
    /* O_NONBLOCK: opening a FIFO without a writer would block in open itself, before any check. Then only a
     * regular file of bounded size: a device or a FIFO (/dev/zero, a pipe) would never end. */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return fh_fail(ctx, FH_ERR_WISDOM_IO, "%s: cannot open: %s", where, strerror(errno));
    struct stat info;
    fh_status st = FH_OK;
    if (fstat(fd, &info) != 0)
        st = fh_fail(ctx, FH_ERR_WISDOM_IO, "%s: cannot stat: %s", where, strerror(errno));
    else if (!S_ISREG(info.st_mode))
        st = fh_fail(ctx, FH_ERR_WISDOM_IO, "%s: not a regular file", where);
    else if (info.st_size > WISDOM_MAX_BYTES)
        st = fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s: %lld bytes, more than a wisdom file's %ld", where,
                     (long long)info.st_size, WISDOM_MAX_BYTES);
    FILE *f = st == FH_OK ? fdopen(fd, "r") : NULL;
    if (st == FH_OK && !f)
        st = fh_fail(ctx, errno == ENOMEM ? FH_ERR_OUT_OF_MEMORY : FH_ERR_WISDOM_IO, "%s: cannot open: %s", where,
                     strerror(errno));
    if (!f) {
        close(fd);
        return st;
    }
    /* Parsed whole, then merged into a copy of the table: a malformed file, or one that would overflow the table,
     * adds nothing. */
    fh_tile_config entries[FH_WISDOM_CAPACITY];
    int count = 0;
    if (st == FH_OK)
        st = parse_file(ctx, f, where, entries, &count);
    fclose(f);
    if (st != FH_OK)
        return st;
    fh_tile_config table[FH_WISDOM_CAPACITY];
    int size = ctx->wisdom_count;
    memcpy(table, ctx->wisdom, (size_t)size * sizeof *table);
    for (int k = 0; k < count; k++) {
        int at = 0;
        while (at < size && !same_key(&table[at], &entries[k]))
            at++;
        if (at == FH_WISDOM_CAPACITY)
            return fh_fail(ctx, FH_ERR_INVALID_WISDOM, "%s: its entries and the %d loaded already exceed the table's %d",
                           where, ctx->wisdom_count, FH_WISDOM_CAPACITY);
        table[at] = entries[k];
        if (at == size)
            size++;
    }
    memcpy(ctx->wisdom, table, (size_t)size * sizeof *table);
    ctx->wisdom_count = size;
    return FH_OK;
}

FH_API fh_status fh_context_save_wisdom(fh_context *ctx, const char *path)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    if (!path)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "no wisdom path given");
    FILE *f = fopen(path, "w");
    if (!f)
        return fh_fail(ctx, FH_ERR_WISDOM_IO, "%.300s: cannot open for writing: %s", path, strerror(errno));
    int ok = fprintf(f, "# written by fusedhead: threads n hidden vocab call tile_rows tile_vocab [bf16]\n" WISDOM_HEADER
                        "\n") > 0;
    for (int k = 0; ok && k < ctx->wisdom_count; k++) {
        const fh_tile_config *e = &ctx->wisdom[k];
        ok = fprintf(f, "%lld %lld %lld %lld %s %lld %lld%s\n", (long long)e->threads, (long long)e->n,
                     (long long)e->hidden, (long long)e->vocab, call_names[e->call], (long long)e->tile_rows,
                     (long long)e->tile_vocab, e->dtype == FH_DTYPE_BF16 ? " bf16" : "") > 0;
    }
    const int error = errno;
    const int closed = fclose(f) == 0;
    if (!ok || !closed)
        return fh_fail(ctx, FH_ERR_WISDOM_IO, "%.300s: cannot write: %s", path, strerror(ok ? errno : error));
    return FH_OK;
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
