/* Wisdom files (fh_context_load_wisdom, FH_WISDOM at fh_context_create): what is accepted, and that everything
 * else fails quickly, names the file, the line and the fault, and adds nothing to the context. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER "fusedhead-wisdom 1\n"

/* A temporary file holding `text` (length bytes); its path in path. */
static void write_file(char path[64], const char *text, size_t length)
{
    strcpy(path, "/tmp/fh_wisdom_XXXXXX");
    const int fd = mkstemp(path);
    TU_CHECK(fd >= 0, "mkstemp");
    FILE *f = fdopen(fd, "w");
    TU_CHECK(f && fwrite(text, 1, length, f) == length && fclose(f) == 0, "writing %s", path);
}

static int entries(fh_context *ctx)
{
    /* Probe through the public API: save, then count the entry lines. */
    char path[64];
    write_file(path, "", 0);
    TU_CHECK(fh_context_save_wisdom(ctx, path) == FH_OK, "save_wisdom");
    FILE *f = fopen(path, "r");
    char line[600];
    int count = 0;
    while (f && fgets(line, sizeof line, f))
        count += line[0] >= '0' && line[0] <= '9';
    if (f)
        fclose(f);
    unlink(path);
    return count;
}

/* Loads `text` into a context holding one entry already: the status, the message in message. */
static fh_status load(const char *text, size_t length, char *message, size_t capacity, int *count_after)
{
    char path[64];
    write_file(path, text, length);
    fh_context *ctx = tu_context(0, 0, 0, 0);
    const fh_tile_config one = {2, 64, 32, 1000, FH_CALL_FORWARD, 64, 512, FH_DTYPE_F32};
    TU_CHECK(fh_context_add_wisdom(ctx, &one) == FH_OK, "add_wisdom");
    const fh_status st = fh_context_load_wisdom(ctx, path);
    const char *msg = "";
    fh_context_message(ctx, &msg);
    snprintf(message, capacity, "%s", msg);
    *count_after = entries(ctx);
    fh_context_destroy(ctx);
    unlink(path);
    return st;
}

static void test_accepted(void)
{
    char message[512];
    int count;
    const char *text = "# comment\n\n   " HEADER "2 128 64 1000 forward 64 512\n4 128 64 1000 train_step 128 1024 bf16\n"
                       "2 64 32 1000 forward 32 256";
    TU_CHECK(load(text, strlen(text), message, sizeof message, &count) == FH_OK, "a valid file: %s", message);
    /* The second line replaced nothing; the last replaced the entry loaded before (same key). */
    TU_CHECK(count == 3, "%d entries after loading, expected 3", count);
}

static void expect_refused(const char *what, const char *text, size_t length, fh_status expected, const char *mention)
{
    char message[512];
    int count;
    const fh_status st = load(text, length, message, sizeof message, &count);
    TU_CHECK(st == expected, "%s: status %d, expected %d (%s)", what, (int)st, (int)expected, message);
    TU_CHECK(count == 1, "%s: the context holds %d entries after a refused load, expected its 1", what, count);
    TU_CHECK(strstr(message, "/tmp/fh_wisdom_") && strstr(message, mention), "%s: message '%s' lacks the path or '%s'",
             what, message, mention);
}

static void test_refused(void)
{
    const char *no_header = "2 128 64 1000 forward 64 512\n", *longer_header = "fusedhead-wisdom 12\n",
               *malformed = HEADER "2 128 64 1000 forwards 64 512\n";
    expect_refused("no header", no_header, strlen(no_header), FH_ERR_INVALID_WISDOM, ":1:");
    expect_refused("a header with more after it", longer_header, strlen(longer_header), FH_ERR_INVALID_WISDOM, ":1:");
    expect_refused("a malformed entry", malformed, strlen(malformed), FH_ERR_INVALID_WISDOM, ":2: malformed");
    const char nul[] = HEADER "2 128 64 1000 forward 64 512\0 junk\n";
    expect_refused("a NUL byte", nul, sizeof nul - 1, FH_ERR_INVALID_WISDOM, ":2: a NUL byte");
    /* The same on an unterminated last line: what follows the NUL was dropped silently (issue 41). */
    const char nul_last[] = HEADER "2 128 64 1000 forward 64 512\0 junk";
    expect_refused("a NUL byte on an unterminated last line", nul_last, sizeof nul_last - 1, FH_ERR_INVALID_WISDOM,
                   ":2: a NUL byte");
    /* Numbers beyond int64 are malformed, not saturated to INT64_MAX (issue 41). */
    const char huge[] = HEADER "2 100000000000000000000000 64 1000 forward 64 512\n";
    expect_refused("n = 1e23", huge, sizeof huge - 1, FH_ERR_INVALID_WISDOM, ":2: malformed");
    const char huge_tile[] = HEADER "2 128 64 1000 forward 64 -100000000000000000000000\n";
    expect_refused("tile_vocab = -1e23", huge_tile, sizeof huge_tile - 1, FH_ERR_INVALID_WISDOM, ":2: malformed");
    /* A long comment: not split into a second, misreported line. */
    char long_line[700] = HEADER "#";
    memset(long_line + strlen(long_line), 'x', 600);
    long_line[sizeof long_line - 2] = '\n';
    long_line[sizeof long_line - 1] = '\0';
    expect_refused("a line of 600 bytes", long_line, strlen(long_line), FH_ERR_INVALID_WISDOM, ":2: line longer");
    /* The table holds 256: 256 new entries on top of the one loaded overflow it, and the load adds none. */
    size_t capacity = 64 + 257 * 48, length = strlen(HEADER);
    char *many = tu_alloc(capacity, 1);
    strcpy(many, HEADER);
    for (int k = 0; k < 256; k++)
        length += (size_t)snprintf(many + length, capacity - length, "2 %d 64 1000 forward 64 512\n", 100 + k);
    expect_refused("256 new entries beside 1", many, length, FH_ERR_INVALID_WISDOM, "exceed");
    /* 257 entries in one file: more than the table. */
    length += (size_t)snprintf(many + length, capacity - length, "2 99 64 1000 forward 64 512\n");
    expect_refused("257 entries", many, length, FH_ERR_INVALID_WISDOM, ":258: more than 256");
    free(many);
}

/* Files that are not wisdom files end at once: /dev/zero (which never ends), a directory, a missing path. */
static void test_not_regular_files(void)
{
    fh_context *ctx = tu_context(0, 0, 0, 0);
    const char *paths[] = {"/dev/zero", "/tmp", "/nonexistent/fh.wisdom"};
    for (size_t k = 0; k < TU_COUNT(paths); k++) {
        const fh_status st = fh_context_load_wisdom(ctx, paths[k]);
        const char *msg = "";
        fh_context_message(ctx, &msg);
        TU_CHECK(st == FH_ERR_WISDOM_IO && strstr(msg, paths[k]), "%s: status %d, message '%s'", paths[k], (int)st, msg);
    }
    fh_context_destroy(ctx);
}

/* A FIFO without a writer: opening it for reading would block until one comes; the load refuses it at once, as does
 * FH_WISDOM at context creation (issue 41). A watchdog turns a hang into a failed run. */
static void test_fifo(void)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/fh_wisdom_fifo_%ld", (long)getpid());
    unlink(path);
    TU_CHECK(mkfifo(path, 0600) == 0, "mkfifo %s", path);
    fh_context *ctx = tu_context(0, 0, 0, 0);
    alarm(30);
    const fh_status st = fh_context_load_wisdom(ctx, path);
    alarm(0);
    const char *msg = "";
    fh_context_message(ctx, &msg);
    TU_CHECK(st == FH_ERR_WISDOM_IO && strstr(msg, path) && strstr(msg, "not a regular file"),
             "a FIFO: status %d, message '%s'", (int)st, msg);
    fh_context_destroy(ctx);
    const char *saved = getenv("FH_WISDOM");
    char *keep = saved ? strdup(saved) : NULL;
    setenv("FH_WISDOM", path, 1);
    fh_context *created = NULL;
    alarm(30);
    const fh_status create = fh_context_create(&created);
    alarm(0);
    TU_CHECK(create == FH_ERR_WISDOM_IO && !created, "FH_WISDOM=a FIFO: status %d", (int)create);
    fh_context_destroy(created);
    if (keep)
        setenv("FH_WISDOM", keep, 1);
    else
        unsetenv("FH_WISDOM");
    free(keep);
    unlink(path);
}

/* A save that fails says why, with the path (issue 41: it returned FH_ERR_WISDOM_IO with no message). */
static void test_save_failure(void)
{
    fh_context *ctx = tu_context(0, 0, 0, 0);
    const char *path = "/nonexistent/fh.wisdom", *msg = "";
    const fh_status st = fh_context_save_wisdom(ctx, path);
    fh_context_message(ctx, &msg);
    TU_CHECK(st == FH_ERR_WISDOM_IO && strstr(msg, path) && strstr(msg, "cannot open"),
             "save to %s: status %d, message '%s'", path, (int)st, msg);
    TU_CHECK(fh_context_save_wisdom(ctx, NULL) == FH_ERR_NULL_POINTER, "save to NULL");
    fh_context_destroy(ctx);
}

/* FH_WISDOM at context creation: the failure's message, naming the variable, comes from fh_context_message(NULL). */
static void test_environment(void)
{
    const char *saved = getenv("FH_WISDOM");
    char *keep = saved ? strdup(saved) : NULL;
    setenv("FH_WISDOM", "/dev/zero", 1);
    fh_context *ctx = (fh_context *)&ctx; /* a sentinel: a failed create leaves it */
    const fh_status st = fh_context_create(&ctx);
    const char *msg = NULL;
    TU_CHECK(st == FH_ERR_WISDOM_IO && ctx == (fh_context *)&ctx, "FH_WISDOM=/dev/zero: status %d", (int)st);
    TU_CHECK(fh_context_message(NULL, &msg) == FH_OK && msg && strstr(msg, "FH_WISDOM=/dev/zero"),
             "creation message '%s'", msg ? msg : "(null)");
    char path[64];
    const char *one = HEADER "2 128 64 1000 forward 64 512\n";
    write_file(path, one, strlen(one));
    setenv("FH_WISDOM", path, 1);
    TU_CHECK(fh_context_create(&ctx) == FH_OK && entries(ctx) == 1, "FH_WISDOM=%s: not loaded", path);
    TU_CHECK(fh_context_message(NULL, &msg) == FH_OK && msg[0] == '\0', "creation message after success '%s'", msg);
    fh_context_destroy(ctx);
    unlink(path);
    if (keep)
        setenv("FH_WISDOM", keep, 1);
    else
        unsetenv("FH_WISDOM");
    free(keep);
}

static const tu_test tests[] = {
    {"accepted: comments, blank lines, fp32 and bf16 entries, replacement by key", test_accepted},
    {"refused with path and line, adding nothing", test_refused},
    {"devices, directories and missing files end at once", test_not_regular_files},
    {"FH_WISDOM at fh_context_create", test_environment},
    {"a FIFO without a writer ends at once (load and FH_WISDOM)", test_fifo},
    {"a failed save says why", test_save_failure},
};
const tu_suite suite_wisdom = {tests, TU_COUNT(tests)};
