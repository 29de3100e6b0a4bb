/* libFuzzer harness over fusedhead's public API (tests/hardening/README.md, "Fuzzing").
 *
 * Each input is decoded into one call of an entry point of tests/entry_points.def (a listed entry point without an
 * action here does not compile). One input in eight drives a setup call (fuzz_setup_call: parameters, wisdom
 * entries and files, views, option defaults, status strings, with NULL pointers). The others drive a head call or a
 * workspace query, with sizes (small, 0, negative, 2^31.., 2^62, INT64_MIN/MAX, arbitrary), strides (padded,
 * overlapping, zero, negative, huge),
 * options (every field, valid or not), targets/ids/masks, special float values in every input, dtypes (fp32 or
 * bf16 x and weight, sometimes mismatched or unknown; each gradient fp32, bf16 or unknown), context parameters
 * (threads, tiles, memory budget, CHECK_FINITE, FP32_DU) and an optional caller workspace of a random size.
 * A distillation call also draws its teacher (hidden size, layout, strides, dtypes and bias of its own; n and V
 * the student's or, now and then, others; sometimes NULL pointers) with the same rules for its buffers; a top-k
 * distillation call its k (valid or not), ids and log-probs (padded, out of range, not finite, NULL). A KTO call
 * also draws its options, labels (sometimes neither 0 nor 1) and which reference and KL inputs it passes.
 *
 * Allocations stay bounded: when the shape is small (n <= 48, hidden <= 48, vocab <= 700, every view
 * <= 2^16 elements) every buffer is allocated with exactly the size its view needs, so ASan sees any
 * access outside it. Otherwise the library must reject the shape during validation (sizes < 1, a size
 * product or a view's last element offset overflowing, a last element more than PTRDIFF_MAX bytes from its
 * base, overlapping strides): those calls get pointers to tiny buffers and must fail. Large shapes that are
 * valid go only to the workspace queries, which are pure.
 *
 * Invariants (abort() on violation, so that libFuzzer reports it):
 *   - no crash, hang, out-of-bounds access or undefined behaviour (ASan, UBSan);
 *   - a call that returns an error leaves every output byte untouched (outputs are canary-filled), and the
 *     workspace queries leave *bytes untouched on error;
 *   - inputs are never written;
 *   - a shape the library must reject is rejected, and so are mismatched or unknown dtypes and bf16 gradients
 *     of fp32 inputs; a distillation teacher whose n or V is not the student's is rejected by the calls, and so
 *     are a top-k teacher with k outside [1, FH_DISTILL_TOPK_MAX_K] and NULL teachers, ids or log-probs;
 *   - a successful train step with a caller workspace had at least the bytes queried for its gradients, and no
 *     call of any head refuses a caller workspace of the size its query gave;
 *   - a gradient over x, the weight or another gradient, or a caller workspace over x, is refused;
 *   - a successful query never exceeds the memory budget; argmax outputs lie in [0, V); a successful
 *     distillation call (top-k too) gives ignored tokens a per-token loss of 0. */
#include "fusedhead.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CANARY 0xA5
#define CHECK(cond, ...)                                                                                          \
    do {                                                                                                          \
        if (!(cond)) {                                                                                            \
            fprintf(stderr, "fuzz_api: invariant violated at line %d: ", __LINE__);                               \
            fprintf(stderr, __VA_ARGS__);                                                                         \
            fprintf(stderr, "\n");                                                                                \
            abort();                                                                                              \
        }                                                                                                         \
    } while (0)

/* ---- input decoding ---- */

typedef struct reader {
    const uint8_t *data;
    size_t size, at;
} reader;

static uint8_t u8(reader *r)
{
    return r->at < r->size ? r->data[r->at++] : 0;
}

static uint64_t u64(reader *r)
{
    uint64_t v = 0;
    for (int k = 0; k < 8; k++)
        v = v << 8 | u8(r);
    return v;
}

static int64_t pick_size(reader *r, int64_t small_max)
{
    const uint8_t mode = u8(r);
    switch (mode % 16) {
    case 0: return 0;
    case 1: return -(int64_t)(u8(r) % 4) - 1;
    case 2: return INT64_MIN;
    case 3: return INT64_MAX;
    case 4: return (int64_t)1 << (31 + u8(r) % 32); /* 2^31 .. 2^62 */
    case 5: return (int64_t)u64(r);
    case 6: return ((int64_t)1 << (u8(r) % 63)) + (int64_t)(u8(r) % 3) - 1;
    default: return 1 + (int64_t)(u8(r) % (uint64_t)small_max);
    }
}

/* A stride for a view whose natural stride is `natural`: padded, or something odd. */
static int64_t pick_stride(reader *r, int64_t natural)
{
    const uint8_t mode = u8(r);
    switch (mode % 16) {
    case 0: return 0;
    case 1: return -1 - (int64_t)(u8(r) % 4);
    case 2: return (int64_t)((uint64_t)natural - 1u);
    case 3: return INT64_MAX / (2 + u8(r) % 4);
    case 4: return (int64_t)1 << (40 + u8(r) % 23);
    case 5: return (int64_t)u64(r);
    case 6: return INT64_MIN;
    case 7:
    case 8: return (int64_t)((uint64_t)natural + u8(r) % 4u);
    default: return natural;
    }
}

static float pick_float(reader *r)
{
    const uint8_t mode = u8(r);
    const float small = (float)((int)u8(r) - 128) / 32.0f;
    switch (mode % 32) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    case 3: return 1e30f;
    case 4: return -3e38f;
    case 5: return 1e-40f; /* subnormal */
    case 6: return 0.0f;
    case 7: return -0.0f;
    case 8: return small * 1000.0f;
    default: return small;
    }
}

/* count elements of size 4 (fp32) or 2 (bf16: the upper half of an fp32 pick). */
static void fill_elements(reader *r, void *data, size_t count, size_t size)
{
    for (size_t i = 0; i < count; i++) {
        const float f = pick_float(r);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        if (size == 2) {
            const uint16_t half = (uint16_t)(bits >> 16);
            memcpy((char *)data + i * 2, &half, 2);
        } else {
            memcpy((char *)data + i * 4, &f, 4);
        }
    }
}

static double pick_double(reader *r, const double *choices, int count)
{
    const uint8_t k = u8(r);
    if (k % 8 == 7) {
        const uint64_t bits = u64(r);
        double d;
        memcpy(&d, &bits, sizeof d);
        return d;
    }
    return choices[k % count];
}

/* ---- view geometry (what the harness knows independently of the library) ---- */

/* Last element offset of a rows x cols view, or -1 when it overflows int64. */
static int64_t last_offset(int64_t rows, int64_t cols, int64_t rs, int64_t cs)
{
    int64_t a, b, s;
    if (__builtin_mul_overflow(rows - 1, rs, &a) || __builtin_mul_overflow(cols - 1, cs, &b) ||
        __builtin_add_overflow(a, b, &s))
        return -1;
    return s;
}

/* Views whose last element fits int64 but lies more than PTRDIFF_MAX bytes from the base: 1 when the
 * environment sets FH_FUZZ_SKIP_BYTE_OFFSETS (inputs with such a view are then skipped, to explore past
 * that finding while it is open; see README.md), else they must be rejected like any overflow. */
static int skip_byte_offsets = -1;

static int byte_offset_overflows(int64_t rows, int64_t cols, int64_t rs, int64_t cs, size_t element_size)
{
    const int64_t last = last_offset(rows, cols, rs, cs);
    return last > PTRDIFF_MAX / (int64_t)element_size;
}

/* 1 when a view must be rejected: strides < 1, overlapping elements (the larger stride does not step over
 * the whole extent of the smaller one), or a last element that overflows int64 or lies more than
 * PTRDIFF_MAX bytes from the base. Sizes are >= 1 here. */
static int view_invalid(int64_t rows, int64_t cols, int64_t rs, int64_t cs, size_t element_size)
{
    if (rs < 1 || cs < 1)
        return 1;
    if (rows > 1 && cols > 1) {
        const int row_outer = rs >= cs;
        const int64_t inner_stride = row_outer ? cs : rs, inner_count = row_outer ? cols : rows;
        const int64_t outer_stride = row_outer ? rs : cs;
        if (outer_stride / inner_count < inner_stride)
            return 1;
    }
    const int64_t last = last_offset(rows, cols, rs, cs);
    return last < 0 || last > PTRDIFF_MAX / (int64_t)element_size;
}

static int product_overflows(int64_t a, int64_t b)
{
    int64_t p;
    return __builtin_mul_overflow(a, b, &p);
}

/* ---- buffers ---- */

typedef struct buffer {
    void *p;
    size_t bytes;
    void *copy; /* inputs: a copy to check they are never written */
} buffer;

static void *alloc_exact(buffer *b, size_t bytes)
{
    b->bytes = bytes;
    b->p = malloc(bytes ? bytes : 1);
    b->copy = NULL;
    return b->p;
}

static void seal_input(buffer *b)
{
    b->copy = malloc(b->bytes ? b->bytes : 1);
    memcpy(b->copy, b->p, b->bytes);
}

static void check_input(const buffer *b, const char *name)
{
    if (b->p && b->copy)
        CHECK(memcmp(b->p, b->copy, b->bytes) == 0, "input %s was written", name);
}

static int untouched(const buffer *b)
{
    const unsigned char *c = b->p;
    for (size_t i = 0; c && i < b->bytes; i++)
        if (c[i] != CANARY)
            return 0;
    return 1;
}

static void release(buffer *b)
{
    free(b->p);
    free(b->copy);
    memset(b, 0, sizeof *b);
}

/* The entry points, from tests/entry_points.def. Head calls and workspace queries run on one decoded linear problem
 * (LLVMFuzzerTestOneInput); setup calls have actions of their own (fuzz_setup_call). Both dispatch in a switch with no
 * default, and -Wswitch is an error here: a listed entry point without a fuzz action does not compile. */
#pragma GCC diagnostic error "-Wswitch"
#define FH_SETUP_CALL(name)
#define FH_HEAD_CALL(name) CALL_##name,
#define FH_WORKSPACE_QUERY(name) CALL_##name,
typedef enum linear_call {
#include "entry_points.def"
} linear_call;
#undef FH_HEAD_CALL
#undef FH_WORKSPACE_QUERY
#define FH_HEAD_CALL(name) 0,
#define FH_WORKSPACE_QUERY(name) 1,
static const unsigned char call_is_query[] = {
#include "entry_points.def"
};
#undef FH_SETUP_CALL
#undef FH_HEAD_CALL
#undef FH_WORKSPACE_QUERY
#define FH_SETUP_CALL(name) SETUP_##name,
#define FH_HEAD_CALL(name)
#define FH_WORKSPACE_QUERY(name)
typedef enum setup_call {
#include "entry_points.def"
} setup_call;
#undef FH_SETUP_CALL
#define FH_SETUP_CALL(name) #name,
static const char *const setup_names[] = {
#include "entry_points.def"
};
#undef FH_SETUP_CALL
#undef FH_HEAD_CALL
#undef FH_WORKSPACE_QUERY
/* The counts are the tables' lengths: a count in the enums would be a value the switches cannot handle. */
#define LINEAR_CALLS (sizeof call_is_query / sizeof *call_is_query)
#define SETUP_CALLS (sizeof setup_names / sizeof *setup_names)

/* ---- setup calls ---- */

/* An fh_param: the nine, and unknown ones on both sides. */
static fh_param pick_param(reader *r)
{
    return (fh_param)((int)(u8(r) % 12) - 1);
}

static int64_t pick_int64(reader *r)
{
    static const int64_t values[] = {0, 1, 2, 7, -1, 64, 4096, (int64_t)1 << 40, INT64_MAX, INT64_MIN};
    const uint8_t m = u8(r);
    return m % 16 < 10 ? values[m % 16] : (int64_t)u64(r);
}

static const double real_values[] = {0.0, 0x1p-12, 0.5, 1.0, -1.0, -0.0, NAN, INFINITY};

static fh_tile_config pick_wisdom_entry(reader *r)
{
    static const int64_t tile_values[] = {1, 2, 7, 64, 1000, (int64_t)1 << 40, INT64_MAX, 0, -1};
    const fh_tile_config e = {pick_size(r, 8), pick_size(r, 4096), pick_size(r, 4096), pick_size(r, 1 << 17),
                              (fh_call)((int)(u8(r) % 5) - 1), tile_values[u8(r) % 9], tile_values[u8(r) % 9],
                              (int)(u8(r) % 3)};
    return e;
}

/* A wisdom file for the load and save actions, made once per process and removed at exit. */
static char wisdom_path[] = "/tmp/fh_fuzz_wisdom_XXXXXX";

static void remove_wisdom_file(void)
{
    unlink(wisdom_path);
}

static const char *wisdom_file(void)
{
    static int made;
    if (!made) {
        const int fd = mkstemp(wisdom_path);
        CHECK(fd >= 0, "cannot create %s", wisdom_path);
        close(fd);
        atexit(remove_wisdom_file);
        made = 1;
    }
    return wisdom_path;
}

/* A context's wisdom saved by fh_context_save_wisdom loads back into a fresh one. */
static void check_saved_wisdom_loads(const char *path)
{
    fh_context *fresh = NULL;
    CHECK(fh_context_create(&fresh) == FH_OK, "fh_context_create");
    const fh_status st = fh_context_load_wisdom(fresh, path);
    const char *message = "";
    fh_context_message(fresh, &message);
    CHECK(st == FH_OK, "a saved wisdom file does not load back: status %d (%s)", (int)st, message);
    fh_context_destroy(fresh);
}

/* One setup entry point with fuzzed arguments, NULL pointers included, on a fresh context. Invariants besides
 * ASan's and UBSan's: a refused call leaves its outputs untouched; set then get gives the value back, a refused set
 * leaves it as it was, and a value set lies within the parameter's bounds; bounds are ordered; strings are never
 * NULL; a saved wisdom file loads back; a NULL context or required pointer is refused. */
static void fuzz_setup_call(setup_call call, reader *r)
{
    fh_context *ctx = NULL;
    CHECK(fh_context_create(&ctx) == FH_OK && ctx, "fh_context_create");
    fh_context *const arg = u8(r) % 16 == 0 ? NULL : ctx; /* the context argument */
    const int null_out = u8(r) % 16 == 0;                /* the output (or entry, path) pointer NULL */
    const fh_param param = pick_param(r);
    const int64_t sentinel = (int64_t)0x5A5A5A5A5A5A5A5A;
    int64_t before = sentinel, after = sentinel, lo = sentinel, hi = sentinel;
    double real_before = -7.0, real_after = -7.0, real_lo = -7.0, real_hi = -7.0;
    union {
        fh_ce_options ce;
        fh_logprob_options logprob;
        fh_grpo_options grpo;
        fh_preference_options preference;
        fh_distill_options distill;
        fh_distill_topk_options distill_topk;
        fh_kto_options kto;
    } options;
    /* Most calls must refuse a NULL context or output; the cases that differ say so. */
    int must_refuse = !arg || null_out;
    fh_status st = FH_OK;
    switch (call) {
    case SETUP_fh_status_string: {
        static const int statuses[] = {0, 1, 10, 59, 69, -1, 1000, INT32_MIN, INT32_MAX};
        const uint8_t m = u8(r);
        const int status = m % 2 ? statuses[(m >> 1) % 9] : (int)u8(r) - 128;
        const char *s = fh_status_string((fh_status)status);
        CHECK(s && *s, "fh_status_string(%d) is empty", status);
        must_refuse = 0;
        break;
    }
    case SETUP_fh_context_create: {
        fh_context *made = NULL;
        st = fh_context_create(null_out ? NULL : &made);
        CHECK(st != FH_OK || made, "fh_context_create: OK without a context");
        fh_context_destroy(made);
        must_refuse = null_out;
        break;
    }
    case SETUP_fh_context_destroy:
        /* ctx itself is destroyed below, in whatever state the input left it: here with wisdom and a parameter */
        for (int k = u8(r) % 4; k > 0; k--) {
            const fh_tile_config e = pick_wisdom_entry(r);
            fh_context_add_wisdom(ctx, &e);
        }
        fh_context_set(ctx, param, pick_int64(r));
        st = fh_context_destroy(NULL);
        CHECK(st == FH_OK, "fh_context_destroy(NULL): status %d", (int)st);
        must_refuse = 0;
        break;
    case SETUP_fh_context_set: {
        const int64_t value = pick_int64(r);
        const fh_status got = fh_context_get(ctx, param, &before);
        st = fh_context_set(arg, param, value);
        must_refuse = !arg;
        CHECK(fh_context_get(ctx, param, &after) == got, "fh_context_get's status changed with a set");
        if (st == FH_OK)
            CHECK(after == value && fh_param_bounds(param, &lo, &hi) == FH_OK && lo <= value && value <= hi,
                  "parameter %d set to %lld: reads %lld, bounds [%lld, %lld]", (int)param, (long long)value,
                  (long long)after, (long long)lo, (long long)hi);
        else
            CHECK(after == before, "a refused set of parameter %d changed it", (int)param);
        break;
    }
    case SETUP_fh_context_get:
        fh_context_set(ctx, param, pick_int64(r));
        st = fh_context_get(arg, param, null_out ? NULL : &after);
        if (st == FH_OK)
            CHECK(fh_param_bounds(param, &lo, &hi) == FH_OK && lo <= after && after <= hi,
                  "parameter %d reads %lld outside [%lld, %lld]", (int)param, (long long)after, (long long)lo,
                  (long long)hi);
        else
            CHECK(after == sentinel, "a refused fh_context_get wrote its output");
        break;
    case SETUP_fh_param_bounds:
        st = fh_param_bounds(param, null_out ? NULL : &lo, &hi);
        CHECK(st == FH_OK ? lo <= hi : lo == sentinel && hi == sentinel, "parameter %d: status %d, bounds %lld %lld",
              (int)param, (int)st, (long long)lo, (long long)hi);
        must_refuse = null_out;
        break;
    case SETUP_fh_context_set_real: {
        const double value = pick_double(r, real_values, 8);
        const fh_status got = fh_context_get_real(ctx, param, &real_before);
        st = fh_context_set_real(arg, param, value);
        must_refuse = !arg;
        CHECK(fh_context_get_real(ctx, param, &real_after) == got, "fh_context_get_real's status changed with a set");
        if (st == FH_OK)
            CHECK(real_after == value && fh_param_real_bounds(param, &real_lo, &real_hi) == FH_OK &&
                  real_lo <= value && value <= real_hi, "real parameter %d set to %g: reads %g, bounds [%g, %g]",
                  (int)param, value, real_after, real_lo, real_hi);
        else
            CHECK(memcmp(&real_after, &real_before, sizeof real_after) == 0,
                  "a refused set of real parameter %d changed it", (int)param);
        break;
    }
    case SETUP_fh_context_get_real:
        fh_context_set_real(ctx, param, pick_double(r, real_values, 8));
        st = fh_context_get_real(arg, param, null_out ? NULL : &real_after);
        if (st == FH_OK)
            CHECK(fh_param_real_bounds(param, &real_lo, &real_hi) == FH_OK && real_lo <= real_after &&
                  real_after <= real_hi, "real parameter %d reads %g outside [%g, %g]", (int)param, real_after,
                  real_lo, real_hi);
        else
            CHECK(real_after == -7.0, "a refused fh_context_get_real wrote its output");
        break;
    case SETUP_fh_param_real_bounds:
        st = fh_param_real_bounds(param, null_out ? NULL : &real_lo, &real_hi);
        CHECK(st == FH_OK ? real_lo <= real_hi : real_lo == -7.0 && real_hi == -7.0,
              "real parameter %d: status %d, bounds %g %g", (int)param, (int)st, real_lo, real_hi);
        must_refuse = null_out;
        break;
    case SETUP_fh_context_threads: {
        fh_context_set(ctx, FH_PARAM_THREADS, pick_int64(r));
        fh_context_set(ctx, FH_PARAM_OVERSUBSCRIBE, u8(r) % 2);
        int threads = -7;
        st = fh_context_threads(arg, null_out ? NULL : &threads);
        CHECK(st == FH_OK ? threads >= 1 : threads == -7, "fh_context_threads: status %d, %d threads", (int)st,
              threads);
        break;
    }
    case SETUP_fh_context_add_wisdom: {
        const int fill = u8(r) % 16 == 0; /* 300 distinct entries, past the table's 256 */
        for (int k = fill ? 300 : 1 + u8(r) % 4; k > 0; k--) {
            fh_tile_config e = pick_wisdom_entry(r);
            if (fill)
                e.n = k;
            st = fh_context_add_wisdom(arg, null_out ? NULL : &e);
        }
        if (arg && !null_out)
            CHECK(fh_context_save_wisdom(ctx, wisdom_file()) == FH_OK, "fh_context_save_wisdom");
        if (arg && !null_out)
            check_saved_wisdom_loads(wisdom_file());
        break;
    }
    case SETUP_fh_context_load_wisdom: {
        /* the rest of the input is the file */
        const char *path = wisdom_file();
        FILE *f = fopen(path, "wb");
        CHECK(f && fwrite(r->data + r->at, 1, r->size - r->at, f) == r->size - r->at && fclose(f) == 0,
              "cannot write %s", path);
        st = fh_context_load_wisdom(arg, null_out ? NULL : path); /* NULL reads $FH_WISDOM, unset here */
        must_refuse = !arg;
        break;
    }
    case SETUP_fh_context_save_wisdom: {
        for (int k = u8(r) % 4; k > 0; k--) {
            const fh_tile_config e = pick_wisdom_entry(r);
            fh_context_add_wisdom(ctx, &e);
        }
        const int unwritable = u8(r) % 8 == 0;
        st = fh_context_save_wisdom(arg, null_out ? NULL : unwritable ? "/nonexistent/fh_fuzz/wisdom" : wisdom_file());
        if (unwritable && arg && !null_out)
            CHECK(st == FH_ERR_WISDOM_IO, "saving to a missing directory: status %d", (int)st);
        if (st == FH_OK)
            check_saved_wisdom_loads(wisdom_file());
        break;
    }
    case SETUP_fh_context_message: {
        fh_context_set(ctx, param, pick_int64(r)); /* sometimes refused: a message to read */
        const char *message = NULL;
        st = fh_context_message(u8(r) % 2 ? arg : NULL, null_out ? NULL : &message); /* NULL: creation's message */
        CHECK(st != FH_OK || (message && strlen(message) < 1024), "fh_context_message");
        must_refuse = null_out;
        break;
    }
    case SETUP_fh_context_set_workspace: {
        static const size_t sizes[] = {0, 1, 63, 4096};
        const uint8_t m = u8(r);
        const size_t bytes = m % 8 < 4 ? sizes[m % 8] : (size_t)(u64(r) % 200000);
        void *workspace = m & 8 ? NULL : malloc(bytes ? bytes : 1);
        st = fh_context_set_workspace(arg, workspace, bytes);
        must_refuse = !arg;
        CHECK(st != FH_OK || workspace || bytes == 0, "a NULL workspace of %zu bytes was accepted", bytes);
        fh_context_destroy(ctx); /* before the workspace it may hold */
        ctx = NULL;
        free(workspace);
        break;
    }
    case SETUP_fh_context_filter_stats: {
        fh_filter_stats stats = {-7.0, -7.0};
        st = fh_context_filter_stats(arg, null_out ? NULL : &stats);
        CHECK(st == FH_OK ? stats.gradient_flops == 0.0 && stats.skipped_flops == 0.0
                          : stats.gradient_flops == -7.0 && stats.skipped_flops == -7.0,
              "fh_context_filter_stats on a fresh context: status %d, %g %g", (int)st, stats.gradient_flops,
              stats.skipped_flops);
        break;
    }
    case SETUP_fh_kernel_query: {
        fh_kernel_info info;
        memset(&info, 0, sizeof info);
        st = fh_kernel_query(null_out ? NULL : &info);
        CHECK(st != FH_OK || (info.kernel_set && info.elementwise && info.bf16_gemm && info.bf16_path),
              "fh_kernel_query: a NULL name");
        must_refuse = null_out;
        break;
    }
    case SETUP_fh_linear_init: {
        static const float storage[4];
        fh_linear lin, canary;
        memset(&canary, CANARY, sizeof canary);
        lin = canary;
        const int64_t n = pick_size(r, 48), hidden = pick_size(r, 48), vocab = pick_size(r, 700);
        const fh_layout layout = (fh_layout)((int)(u8(r) % 4) - 1);
        const uint8_t m = u8(r);
        st = fh_linear_init(null_out ? NULL : &lin, n, hidden, vocab, m & 1 ? NULL : storage, m & 2 ? NULL : storage,
                            layout, m & 4 ? NULL : storage);
        const int valid_layout = layout == FH_LAYOUT_HV || layout == FH_LAYOUT_VH;
        CHECK((st == FH_OK) == (!null_out && valid_layout), "fh_linear_init: status %d", (int)st);
        if (st == FH_OK)
            CHECK(lin.n == n && lin.hidden == hidden && lin.vocab == vocab && lin.x_row_stride == hidden &&
                  lin.w_stride_hidden == (layout == FH_LAYOUT_HV ? vocab : 1) &&
                  lin.w_stride_vocab == (layout == FH_LAYOUT_HV ? 1 : hidden),
                  "fh_linear_init: the view does not describe the arguments");
        else
            CHECK(memcmp(&lin, &canary, sizeof lin) == 0, "a refused fh_linear_init wrote the view");
        must_refuse = 0;
        break;
    }
    case SETUP_fh_ce_options_init:
        st = fh_ce_options_init(null_out ? NULL : &options.ce);
        must_refuse = null_out;
        break;
    case SETUP_fh_logprob_options_init:
        st = fh_logprob_options_init(null_out ? NULL : &options.logprob);
        must_refuse = null_out;
        break;
    case SETUP_fh_grpo_options_init:
        st = fh_grpo_options_init(null_out ? NULL : &options.grpo);
        must_refuse = null_out;
        break;
    case SETUP_fh_preference_options_init:
        st = fh_preference_options_init(null_out ? NULL : &options.preference);
        must_refuse = null_out;
        break;
    case SETUP_fh_distill_options_init:
        st = fh_distill_options_init(null_out ? NULL : &options.distill);
        must_refuse = null_out;
        break;
    case SETUP_fh_distill_topk_options_init:
        st = fh_distill_topk_options_init(null_out ? NULL : &options.distill_topk);
        must_refuse = null_out;
        break;
    case SETUP_fh_kto_options_init:
        st = fh_kto_options_init(null_out ? NULL : &options.kto);
        must_refuse = null_out;
        break;
    }
    if (must_refuse)
        CHECK(st != FH_OK, "%s accepted a NULL context or output", setup_names[call]);
    const char *message = NULL;
    CHECK(!ctx || (fh_context_message(ctx, &message) == FH_OK && message && strlen(message) < 1024), "message");
    fh_context_destroy(ctx);
}

/* ---- head calls and workspace queries ---- */

enum { IN_X, IN_W, IN_BIAS, IN_CW, IN_TARGETS, IN_GRAD, IN_LSE, IN_LOGP, IN_ENTROPY, IN_MASK, IN_ADV, IN_OLD, IN_REF,
       IN_SAMP, IN_TEACHER_X, IN_TEACHER_W, IN_TEACHER_BIAS, IN_LABELS, IN_KL, IN_KL_LOGRATIOS, IN_TOPK_IDS,
       IN_TOPK_LOGPROBS, IN_LOGITS, IN_SUPPORT_IDS, IN_SUPPORT_OFFSETS, IN_CU_SEQLENS, IN_COUNT };
enum { OUT_LOSS, OUT_ZLOSS, OUT_METRICS, OUT_PTL, OUT_LOGP, OUT_LSE, OUT_ENTROPY, OUT_ARGMAX, OUT_DX, OUT_DW, OUT_DB,
       OUT_PREFERENCE_METRICS, OUT_SEQUENCE_LOGPS, OUT_REWARDS, OUT_SOFT_LOSS, OUT_HARD_LOSS, OUT_CORRECT,
       OUT_KTO_METRICS, OUT_LOGITS, OUT_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size, 0};
    /* One input in eight (first byte 224..255) drives a setup call, the others a head call or workspace query. */
    const uint8_t pick = u8(&r);
    if (pick >= 224) {
        fuzz_setup_call((setup_call)(pick % SETUP_CALLS), &r);
        return 0;
    }
    const linear_call call = (linear_call)(pick % LINEAR_CALLS);
    const int preference = call == CALL_fh_preference_forward || call == CALL_fh_preference_forward_backward ||
                           call == CALL_fh_preference_workspace_size;
    const int kto = call == CALL_fh_kto_forward || call == CALL_fh_kto_forward_backward ||
                    call == CALL_fh_kto_workspace_size;
    /* grpo: a batch of sequences (GRPO's, the preference calls' 2 x pairs, or KTO's) */
    const int grpo = call == CALL_fh_grpo_forward || call == CALL_fh_grpo_backward ||
                     call == CALL_fh_grpo_forward_backward || call == CALL_fh_grpo_workspace_size || preference || kto;
    const int distill = call == CALL_fh_distill_forward || call == CALL_fh_distill_forward_backward ||
                        call == CALL_fh_distill_workspace_size;
    const int topk = call == CALL_fh_distill_topk_forward || call == CALL_fh_distill_topk_forward_backward ||
                     call == CALL_fh_distill_topk_workspace_size;
    const int logprob = call == CALL_fh_logprob_forward || call == CALL_fh_logprob_backward ||
                        call == CALL_fh_logprob_forward_keep || call == CALL_fh_logprob_backward_kept ||
                        call == CALL_fh_logprob_forward_backward;
    const int support = call == CALL_fh_logprob_support_forward || call == CALL_fh_logprob_support_backward ||
                        call == CALL_fh_logprob_support_forward_backward ||
                        call == CALL_fh_logprob_support_workspace_size;
    const int query = call_is_query[call];
    const int has_grads = call == CALL_fh_ce_backward || call == CALL_fh_ce_forward_backward ||
                          call == CALL_fh_logprob_backward || call == CALL_fh_logprob_forward_backward ||
                          call == CALL_fh_logprob_backward_kept || call == CALL_fh_logprob_support_backward ||
                          call == CALL_fh_logprob_support_forward_backward ||
                          call == CALL_fh_grpo_backward || call == CALL_fh_grpo_forward_backward ||
                          call == CALL_fh_preference_forward_backward || call == CALL_fh_kto_forward_backward ||
                          call == CALL_fh_distill_forward_backward || call == CALL_fh_distill_topk_forward_backward;

    /* dtypes: x fp32 or bf16, the weight the same, the other one or unknown; each gradient fp32 or bf16 (dx
     * unknown when all three bits are set); fp32 dU. */
    const uint8_t dtype_bits = u8(&r);
    const fh_dtype other = dtype_bits & 1 ? FH_DTYPE_F32 : FH_DTYPE_BF16;
    const fh_dtype x_dtype = dtype_bits & 1 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    const fh_dtype w_dtype = (dtype_bits & 6) == 6 ? (fh_dtype)7 : dtype_bits & 2 ? other : x_dtype;
    const fh_dtype dx_dtype = (dtype_bits & 0x38) == 0x38 ? (fh_dtype)9 : dtype_bits & 8 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    const fh_dtype dw_dtype = dtype_bits & 16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    const fh_dtype db_dtype = dtype_bits & 32 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    const int dtype_bad = w_dtype != x_dtype;
    const int grad_dtype_bad = (dtype_bits & 0x38) == 0x38 || (x_dtype == FH_DTYPE_F32 && (dtype_bits & 0x38) != 0);
    const size_t x_size = x_dtype == FH_DTYPE_BF16 ? 2 : 4, w_size = w_dtype == FH_DTYPE_BF16 ? 2 : 4;
    const size_t dx_size = dx_dtype == FH_DTYPE_BF16 ? 2 : 4;

    /* Shape and strides. */
    int64_t n = pick_size(&r, 48), hidden = pick_size(&r, 48), vocab = pick_size(&r, 700);
    const fh_layout layout = (fh_layout)(u8(&r) & 1);
    const int64_t x_rs = pick_stride(&r, hidden);
    const int64_t w_rs = pick_stride(&r, layout == FH_LAYOUT_HV ? vocab : 1);
    const int64_t w_cs = pick_stride(&r, layout == FH_LAYOUT_HV ? 1 : hidden);
    const int64_t dx_rs = pick_stride(&r, hidden);
    const int bias_on = u8(&r) & 1;
    int64_t batch = 1, seq = n;
    if (grpo) {
        const uint8_t m = u8(&r);
        if (m % 8 == 0) {
            batch = pick_size(&r, 8);
            seq = pick_size(&r, 48);
        } else if (n >= 1 && n <= 48) {
            batch = 1 + m % 4;
            while (n % batch)
                batch--;
            seq = n / batch;
        }
    }

    /* Distillation's teacher: hidden size, layout, strides, dtypes and bias of its own; n and V the student's, or
     * (one input in 16 each) others; now and then a NULL teacher, x or weight. */
    int64_t tn = n, th = 1, tv = vocab, t_x_rs = 1, t_w_rs = 1, t_w_cs = 1;
    fh_layout t_layout = FH_LAYOUT_HV;
    fh_dtype t_x_dtype = FH_DTYPE_F32, t_w_dtype = FH_DTYPE_F32;
    int t_bias_on = 0, t_pointer = 0; /* 1: teacher NULL, 2: its x NULL, 3: its weight NULL */
    if (distill) {
        const uint8_t tb = u8(&r);
        if (tb % 16 == 0)
            tn = pick_size(&r, 48);
        if (tb % 16 == 1)
            tv = pick_size(&r, 700);
        th = tb & 16 ? hidden : pick_size(&r, 48);
        t_layout = (fh_layout)((tb >> 5) & 1);
        t_x_rs = pick_stride(&r, th);
        t_w_rs = pick_stride(&r, t_layout == FH_LAYOUT_HV ? tv : 1);
        t_w_cs = pick_stride(&r, t_layout == FH_LAYOUT_HV ? 1 : th);
        const uint8_t td = u8(&r);
        t_x_dtype = td & 1 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
        t_w_dtype = (td & 6) == 6 ? (fh_dtype)7 : td & 2 ? (td & 1 ? FH_DTYPE_F32 : FH_DTYPE_BF16) : t_x_dtype;
        t_bias_on = (td >> 3) & 1;
        t_pointer = td >> 4 == 15 ? 1 : td >> 4 == 14 ? 2 : td >> 4 == 13 ? 3 : 0;
    }
    const size_t tx_size = t_x_dtype == FH_DTYPE_BF16 ? 2 : 4, tw_size = t_w_dtype == FH_DTYPE_BF16 ? 2 : 4;
    const int t_sizes_bad = tn < 1 || th < 1 || tv < 1;
    const int t_lin_bad = distill && (t_sizes_bad || product_overflows(tn, tv) || product_overflows(th, tv) ||
                                      product_overflows(tn, th) || view_invalid(tn, th, t_x_rs, 1, tx_size) ||
                                      view_invalid(th, tv, t_w_rs, t_w_cs, tw_size));
    const int t_mismatch = distill && (tn != n || tv != vocab);
    const int t_dtype_bad = distill && t_w_dtype != t_x_dtype;
    const int64_t tx_last = !distill || t_lin_bad ? 0 : last_offset(tn, th, t_x_rs, 1);
    const int64_t tw_last = !distill || t_lin_bad ? 0 : last_offset(th, tv, t_w_rs, t_w_cs);
    const int t_small = !t_lin_bad && tn <= 48 && th <= 48 && tv <= 700 && tx_last < 65536 && tw_last < 65536;

    /* Top-k distillation's teacher: k entries per token (mostly 1..8; now and then 0, negative, past
     * FH_DISTILL_TOPK_MAX_K or huge); now and then a NULL teacher, ids or log-probs. */
    int64_t topk_k = 1;
    int topk_pointer = 0; /* 1: teacher NULL, 2: its ids NULL, 3: its log-probs NULL */
    if (topk && !query) {
        const uint8_t kb = u8(&r);
        topk_k = kb % 4 == 0 ? pick_size(&r, FH_DISTILL_TOPK_MAX_K + 1) : 1 + (kb >> 2) % 8;
        topk_pointer = kb >> 5 == 7 ? 1 + u8(&r) % 3 : 0;
    }
    const int topk_k_bad = topk_k < 1 || topk_k > FH_DISTILL_TOPK_MAX_K;

    const int sizes_bad = n < 1 || hidden < 1 || vocab < 1;
    const int overflow = !sizes_bad && (product_overflows(n, vocab) || product_overflows(hidden, vocab) ||
                                        product_overflows(n, hidden));
    const int lin_bad = sizes_bad || overflow || view_invalid(n, hidden, x_rs, 1, x_size) ||
                        view_invalid(hidden, vocab, w_rs, w_cs, w_size);
    const int dx_bad = !lin_bad && has_grads && view_invalid(n, hidden, dx_rs, 1, dx_size);
    const int64_t x_last = lin_bad ? -1 : last_offset(n, hidden, x_rs, 1);
    const int64_t w_last = lin_bad ? -1 : last_offset(hidden, vocab, w_rs, w_cs);
    const int64_t dx_last = lin_bad || dx_bad || !has_grads ? 0 : last_offset(n, hidden, dx_rs, 1);
    /* small: the inputs get exact-size buffers; otherwise tiny ones, which only a rejected call may get. */
    const int small = !lin_bad && n <= 48 && hidden <= 48 && vocab <= 700 && x_last < 65536 && w_last < 65536 &&
                      dx_last < 65536;
    const int must_reject = lin_bad || dx_bad;
    if (skip_byte_offsets < 0)
        skip_byte_offsets = getenv("FH_FUZZ_SKIP_BYTE_OFFSETS") != NULL;
    if (skip_byte_offsets && !sizes_bad && !overflow &&
        (byte_offset_overflows(n, hidden, x_rs, 1, x_size) || byte_offset_overflows(hidden, vocab, w_rs, w_cs, w_size) ||
         (has_grads && byte_offset_overflows(n, hidden, dx_rs, 1, dx_size))))
        return 0;
    if (getenv("FH_FUZZ_DEBUG"))
        fprintf(stderr, "call %d n=%lld h=%lld v=%lld layout %d strides x %lld w %lld %lld dx %lld batch %lld seq %lld: "
                "lin_bad %d dx_bad %d small %d\n", call, (long long)n, (long long)hidden, (long long)vocab, (int)layout,
                (long long)x_rs, (long long)w_rs, (long long)w_cs, (long long)dx_rs, (long long)batch, (long long)seq,
                lin_bad, dx_bad, small);
    if (getenv("FH_FUZZ_DEBUG") && distill)
        fprintf(stderr, "teacher n=%lld h=%lld v=%lld layout %d strides x %lld w %lld %lld dtypes %d %d bias %d "
                "pointer %d: bad %d mismatch %d small %d\n", (long long)tn, (long long)th, (long long)tv, (int)t_layout,
                (long long)t_x_rs, (long long)t_w_rs, (long long)t_w_cs, (int)t_x_dtype, (int)t_w_dtype, t_bias_on,
                t_pointer, t_lin_bad, t_mismatch, t_small);
    if (!small && !must_reject && !query)
        return 0; /* valid but large: only the pure queries may take it (next input) */
    if (!small && !lin_bad && !query)
        return 0; /* dx invalid but the rest large and valid: the library reads the inputs first */
    /* A valid, large teacher of a student the library accepts: the call would read it (the query does not). A
     * mismatched one is refused, after its CHECK_FINITE scan (below). */
    if (distill && !query && !lin_bad && !dtype_bad && !t_small && !t_lin_bad && !t_dtype_bad && !t_mismatch &&
        !t_pointer)
        return 0;

    /* Context. */
    fh_context *ctx = NULL;
    if (fh_context_create(&ctx) != FH_OK)
        return 0;
    const uint8_t threads = u8(&r);
    fh_context_set(ctx, FH_PARAM_THREADS, threads % 8 == 0 ? 2 : 1);
    const uint8_t tiles = u8(&r);
    if (tiles & 1)
        fh_context_set(ctx, FH_PARAM_TILE_ROWS, (int64_t)(u8(&r) % 70) - 2);
    if (tiles & 2)
        fh_context_set(ctx, FH_PARAM_TILE_VOCAB, (int64_t)(u8(&r) % 300) - 2);
    int64_t budget = 0;
    if (tiles & 4) {
        static const int64_t budgets[] = {0, 1, 64, 4096, 20000, 100000, 1000000, (int64_t)1 << 50, -1};
        budget = budgets[u8(&r) % 9];
        if (fh_context_set(ctx, FH_PARAM_MEMORY_BUDGET, budget) != FH_OK)
            budget = 0;
    }
    fh_context_set(ctx, FH_PARAM_CHECK_FINITE, (tiles & 8) != 0);
    /* The teacher's CHECK_FINITE scan comes before the n / V comparison: a valid but large mismatched teacher is
     * read then, so it cannot have tiny buffers. */
    if (distill && !query && !lin_bad && !dtype_bad && !t_small && !t_lin_bad && !t_dtype_bad && !t_pointer &&
        (tiles & 8)) {
        fh_context_destroy(ctx);
        return 0;
    }
    fh_context_set(ctx, FH_PARAM_FP32_DU, (dtype_bits & 64) != 0);
    if (tiles & 16) { /* gradient filtering, including values it must refuse */
        static const double eps[] = {0.0, 0x1p-12, 0.02, 0.5, 0.999, -1.0, 1.0, NAN};
        fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, eps[u8(&r) % 8]);
        fh_context_set(ctx, FH_PARAM_GRAD_FILTER_TAIL, u8(&r) % 3); /* 2 must be refused */
    }
    const int64_t effective_budget = budget > 0 ? budget : FH_DEFAULT_MEMORY_BUDGET;

    /* Inputs. Tiny buffers when the shape must be rejected. */
    buffer in[IN_COUNT], out[OUT_COUNT];
    memset(in, 0, sizeof in);
    memset(out, 0, sizeof out);
    const size_t un = small ? (size_t)n : 4, uv = small ? (size_t)vocab : 4;
    const size_t x_elems = small ? (size_t)x_last + 1 : 4, w_elems = small ? (size_t)w_last + 1 : 4;
    void *x = alloc_exact(&in[IN_X], x_elems * x_size);
    void *w = alloc_exact(&in[IN_W], w_elems * w_size);
    fill_elements(&r, x, x_elems, x_size);
    fill_elements(&r, w, w_elems, w_size);
    float *bias = bias_on ? alloc_exact(&in[IN_BIAS], uv * sizeof(float)) : NULL;
    for (size_t j = 0; bias && j < uv; j++)
        bias[j] = pick_float(&r);

    fh_linear lin;
    const uint8_t layout_byte = u8(&r);
    const fh_status init_status = fh_linear_init(&lin, n, hidden, vocab, x, w,
                                                 layout_byte % 16 == 0 ? (fh_layout)(2 + layout_byte / 16) : layout, bias);
    CHECK((layout_byte % 16 == 0) == (init_status != FH_OK), "fh_linear_init: status %d", (int)init_status);
    const fh_linear described = {n, hidden, vocab, u8(&r) % 32 == 0 ? NULL : x, x_rs, u8(&r) % 32 == 0 ? NULL : w,
                                 w_rs, w_cs, bias, x_dtype, w_dtype};
    lin = described;

    /* Wisdom entries (tile sizes measured elsewhere), sometimes for exactly this shape. */
    const uint8_t wisdom = u8(&r);
    for (int k = 0; k < wisdom % 4; k++) {
        static const int64_t tile_values[] = {1, 2, 7, 64, 1000, (int64_t)1 << 40, INT64_MAX, 0, -1};
        const fh_tile_config e = {wisdom & 16 ? 1 : (int64_t)(u8(&r) % 4), wisdom & 32 ? n : pick_size(&r, 48),
                                  wisdom & 32 ? hidden : pick_size(&r, 48), wisdom & 32 ? vocab : pick_size(&r, 700),
                                  (fh_call)(u8(&r) % 4), tile_values[u8(&r) % 9], tile_values[u8(&r) % 9], x_dtype};
        fh_context_add_wisdom(ctx, &e);
    }

    /* Cross-entropy options. */
    fh_ce_options ce;
    fh_ce_options_init(&ce);
    static const int64_t ignores[] = {-100, -1, 0, 1, INT64_MIN};
    ce.ignore_index = ignores[u8(&r) % 5];
    ce.reduction = (fh_reduction)(u8(&r) % 5 == 4 ? 7 : u8(&r) % 3);
    static const double smoothing[] = {0.0, 0.0, 0.1, 1.0, 1.0000001, -0.1, NAN, INFINITY};
    ce.label_smoothing = pick_double(&r, smoothing, 8);
    static const double softcaps[] = {0.0, 0.0, 30.0, 1e-3, 1e-38, 1e-50, 1e39, -1.0, NAN};
    ce.softcap = pick_double(&r, softcaps, 9);
    static const double zlosses[] = {0.0, 0.0, 1e-4, 1.0, 1e300, -1e-4, NAN, INFINITY};
    ce.z_loss = pick_double(&r, zlosses, 8);
    /* logit_scale: valid, or out of fp32's normal range alone or as softcap / logit_scale (1e-3 with softcap 1e-38). */
    static const double logit_scales[] = {1.0, 1.0, 0.5, 4.0, 1e-3, 1e38, 0.0, -1.0, 1e-50, 1e39, NAN, INFINITY};
    ce.logit_scale = pick_double(&r, logit_scales, 12);
    ce.token_scaling = u8(&r) % 4 == 0;
    if (u8(&r) % 4 == 0) {
        float *cw = alloc_exact(&in[IN_CW], uv * sizeof(float));
        for (size_t j = 0; j < uv; j++)
            cw[j] = u8(&r) % 16 == 0 ? pick_float(&r) : (float)(u8(&r) % 5) * 0.5f;
        ce.class_weights = cw;
    }
    int64_t *targets = alloc_exact(&in[IN_TARGETS], un * sizeof(int64_t));
    for (size_t i = 0; i < un; i++) {
        const uint8_t t = u8(&r);
        targets[i] = t % 16 == 0 ? ce.ignore_index : t % 16 == 1 ? -1 : t % 16 == 2 ? vocab
                   : t % 16 == 3 ? INT64_MIN : (int64_t)(u8(&r) % (uint64_t)(small ? vocab : 4));
    }
    float *grad = alloc_exact(&in[IN_GRAD], un * sizeof(float));
    for (size_t i = 0; i < un; i++)
        grad[i] = u8(&r) % 16 == 0 ? pick_float(&r) : 1.0f;
    float *lse_in = alloc_exact(&in[IN_LSE], un * sizeof(float));
    float *logp_in = alloc_exact(&in[IN_LOGP], un * sizeof(float));
    float *entropy_in = alloc_exact(&in[IN_ENTROPY], un * sizeof(float));
    for (size_t i = 0; i < un; i++) {
        lse_in[i] = u8(&r) % 8 == 0 ? pick_float(&r) : 3.0f;
        logp_in[i] = u8(&r) % 8 == 0 ? pick_float(&r) : -3.0f;
        entropy_in[i] = u8(&r) % 8 == 0 ? pick_float(&r) : 2.0f;
    }
    /* The log-probs' kept logits (N x V): absent now and then (NULL refused). */
    float *logits_in = u8(&r) % 16 ? alloc_exact(&in[IN_LOGITS], un * uv * sizeof(float)) : NULL;
    for (size_t e = 0; logits_in && e < un * uv; e++)
        logits_in[e] = (float)(u8(&r) % 16) - 8.0f;

    /* GRPO options and batch. */
    fh_grpo_options go;
    fh_grpo_options_init(&go);
    go.loss_type = (fh_grpo_loss_type)(u8(&r) % 9);
    go.importance_sampling_level = (fh_grpo_is_level)(u8(&r) % 3);
    static const double temps[] = {1.0, 0.7, 1e-3, 1e-40, 1e40, 0.0, -1.0, NAN};
    go.temperature = pick_double(&r, temps, 8);
    static const double eps[] = {0.2, 0.0, 0.28, 5.0, -0.1, NAN, INFINITY};
    go.epsilon_low = pick_double(&r, eps, 7);
    go.epsilon_high = u8(&r) % 2 ? NAN : pick_double(&r, eps, 7);
    static const double deltas[] = {NAN, 0.0, 1.5, 1e-3, -1.0, INFINITY};
    go.delta = pick_double(&r, deltas, 6);
    static const double betas[] = {0.0, 0.04, 1.0, 1e10, -0.1, NAN};
    go.beta = pick_double(&r, betas, 6);
    static const double taus[] = {1.0, 1.05, 1e-3, 0.0, -1.0, NAN};
    go.sapo_temperature_pos = pick_double(&r, taus, 6);
    go.sapo_temperature_neg = pick_double(&r, taus, 6);
    static const double items[] = {0.0, 10.0, 1e-300, -5.0, NAN, INFINITY};
    go.num_items_in_batch = pick_double(&r, items, 6);
    go.max_completion_length = (int64_t)(u8(&r) % 8) - 2;
    static const double coefs[] = {0.0, 0.01, -0.5, 1e300, NAN};
    go.entropy_coef = pick_double(&r, coefs, 5);
    /* TRL's options up to f2cd5771, valid and not. */
    static const double quantiles[] = {1.0, 1.0, 0.5, 0.0, 1.5, -0.1, NAN};
    go.top_entropy_quantile = pick_double(&r, quantiles, 7);
    static const double thresholds[] = {NAN, NAN, 0.0, -1e300, 0.1, INFINITY};
    go.off_policy_mask_threshold = pick_double(&r, thresholds, 6);
    go.use_bias_correction_kl = u8(&r) % 2;
    go.vllm_importance_sampling_correction = u8(&r) % 4 != 0;
    go.vllm_importance_sampling_mode = (fh_grpo_vllm_is_mode)(u8(&r) % 5);
    static const double bounds[] = {NAN, NAN, 3.0, 0.5, 1.0, 0.0, -1.0, INFINITY};
    go.vllm_importance_sampling_clip_min = pick_double(&r, bounds, 8);
    go.vllm_importance_sampling_clip_max = pick_double(&r, bounds, 8);
    static const double vespo[] = {2.0, 3.0, 0.0, -1.0, 1e300, NAN, INFINITY};
    go.vespo_k_pos = pick_double(&r, vespo, 7);
    go.vespo_lambda_pos = pick_double(&r, vespo, 7);
    go.vespo_k_neg = pick_double(&r, vespo, 7);
    go.vespo_lambda_neg = pick_double(&r, vespo, 7);
    /* Log-prob options: CE's ignore_index and softcap, GRPO's temperature, a logit scale of its own. */
    fh_logprob_options lo;
    fh_logprob_options_init(&lo);
    lo.ignore_index = ce.ignore_index;
    lo.temperature = go.temperature;
    lo.softcap = ce.softcap;
    static const double scales[] = {1.0, 1.0, 0.5, 1e-30, 1e30, 0.0, -1.0, NAN};
    lo.logit_scale = pick_double(&r, scales, 8);
    float *mask = alloc_exact(&in[IN_MASK], un * sizeof(float));
    for (size_t i = 0; i < un; i++) {
        const uint8_t m = u8(&r);
        mask[i] = m % 8 == 0 ? pick_float(&r) : (float)(m % 2);
    }
    const size_t ub = small && batch >= 1 && batch <= 48 ? (size_t)batch : 4;
    float *adv = alloc_exact(&in[IN_ADV], ub * sizeof(float));
    for (size_t b = 0; b < ub; b++)
        adv[b] = pick_float(&r);
    float *old = u8(&r) % 2 ? alloc_exact(&in[IN_OLD], un * sizeof(float)) : NULL;
    float *ref = u8(&r) % 4 ? alloc_exact(&in[IN_REF], un * sizeof(float)) : NULL;
    float *samp = u8(&r) % 2 ? alloc_exact(&in[IN_SAMP], un * sizeof(float)) : NULL;
    for (size_t i = 0; i < un; i++) {
        if (old)
            old[i] = u8(&r) % 8 == 0 ? pick_float(&r) : -3.0f + (float)(u8(&r) % 16) / 16.0f;
        if (ref)
            ref[i] = u8(&r) % 8 == 0 ? pick_float(&r) : -3.0f + (float)(u8(&r) % 16) / 16.0f;
        if (samp)
            samp[i] = u8(&r) % 8 == 0 ? pick_float(&r) : -3.0f + (float)(u8(&r) % 16) / 16.0f;
    }
    /* The batch's arrays are [batch, seq]; when batch * seq differs from n the library must say so before
     * reading them, so n-sized arrays are enough. One GRPO batch in four is over a support: each token's target
     * alone (padded, k 1: -1 is padding, ignore_index and V are refused unless masked); its workspace is the
     * support's (fh_logprob_support_workspace_size), which the caller-workspace query below asks for. */
    const fh_support grpo_support = {targets, NULL, 1};
    const int grpo_call = call == CALL_fh_grpo_forward || call == CALL_fh_grpo_backward ||
                          call == CALL_fh_grpo_forward_backward;
    const int grpo_over_support = grpo_call && u8(&r) % 4 == 0;
    fh_grpo_batch gb = {batch, seq, targets, mask, adv, old, ref, samp, grpo_over_support ? &grpo_support : NULL, NULL};

    /* Preference options and batch: batch sequences as batch / 2 pairs (an odd batch cannot match n), the
     * reference none, per sequence (adv's ub >= batch values) or per token, sometimes both. */
    fh_preference_options po;
    fh_preference_options_init(&po);
    po.loss = (fh_preference_loss)(u8(&r) % 5);
    po.loss_type = (fh_preference_loss_type)(u8(&r) % 16);
    po.dpo_semantics = (fh_preference_dpo_semantics)(u8(&r) % 3);
    po.loss_type_count = u8(&r) % 4 == 0 ? (int)(u8(&r) % 18) - 1 : 0; /* a list, sometimes too long or negative */
    for (int k = 0; k < FH_PREFERENCE_MAX_LOSS_TYPES; k++) {
        po.loss_types[k] = (fh_preference_loss_type)(u8(&r) % 16);
        po.loss_weights[k] = pick_double(&r, (const double[]){1.0, 0.5, -0.3, 0.0, NAN}, 5);
    }
    po.discopop_tau = pick_double(&r, (const double[]){0.05, 1.0, 0.0, -1.0, NAN}, 5);
    po.use_weighting = u8(&r) % 8 == 0;
    static const double pref_betas[] = {0.1, 2.0, 1e-300, 0.0, -0.1, NAN, INFINITY};
    po.beta = pick_double(&r, pref_betas, 7);
    static const double pref_smoothing[] = {0.0, 0.1, 0.5, 0.6, -0.1, NAN};
    po.label_smoothing = pick_double(&r, pref_smoothing, 6);
    static const double gammas[] = {0.5, 0.0, -3.0, NAN, INFINITY};
    po.simpo_gamma = pick_double(&r, gammas, 5);
    static const double alphas[] = {0.0, 1.0, 0.5, -1.0, NAN, INFINITY};
    po.rpo_alpha = u8(&r) % 2 ? 0.0 : pick_double(&r, alphas, 6); /* nonzero only at TRL v0.28's semantics */
    po.cpo_alpha = pick_double(&r, alphas, 6);
    const uint8_t ref_mode = u8(&r) % 4;
    const int64_t pairs = batch / 2 ? batch / 2 : batch;
    fh_preference_batch pb = {pairs, seq, targets, mask, ref_mode & 1 ? adv : NULL, ref_mode & 2 ? ref : NULL, NULL};

    /* KTO options and batch (read for KTO calls only): every option valid or not; batch sequences with labels
     * mostly 0 or 1; the reference as the preference batch's (none, per sequence, per token or both); the KL term
     * none, one value, per-sequence log-ratios (ub >= batch values) or both. */
    fh_kto_options ko;
    fh_kto_options_init(&ko);
    fh_kto_batch kb;
    memset(&kb, 0, sizeof kb);
    if (kto) {
        const size_t kto_first_byte = r.at;
        const uint8_t kt = u8(&r);
        ko.loss_type = (fh_kto_loss_type)(kt % 8 == 7 ? -1 : kt % 3);
        static const double kto_betas[] = {0.1, 2.0, 1e-300, 0.0, -0.1, NAN, INFINITY};
        ko.beta = pick_double(&r, kto_betas, 7);
        static const double kto_weights[] = {1.0, 1.33, 0.0, 1e300, -1.0, NAN, INFINITY};
        ko.desirable_weight = pick_double(&r, kto_weights, 7);
        ko.undesirable_weight = pick_double(&r, kto_weights, 7);
        uint8_t *labels = alloc_exact(&in[IN_LABELS], ub);
        for (size_t b = 0; b < ub; b++) {
            const uint8_t l = u8(&r);
            labels[b] = l % 16 == 15 ? (uint8_t)(2 + l / 16) : l & 1;
        }
        const uint8_t kl_mode = u8(&r);
        float *kl = kl_mode & 1 ? alloc_exact(&in[IN_KL], sizeof(float)) : NULL;
        if (kl)
            *kl = u8(&r) % 8 == 0 ? pick_float(&r) : (float)(u8(&r) % 16) / 16.0f;
        float *kl_logratios = kl_mode & 2 ? alloc_exact(&in[IN_KL_LOGRATIOS], ub * sizeof(float)) : NULL;
        for (size_t b = 0; kl_logratios && b < ub; b++)
            kl_logratios[b] = u8(&r) % 8 == 0 ? pick_float(&r) : (float)((int)(u8(&r) % 16) - 4) / 16.0f;
        const fh_kto_batch k = {batch, seq, targets, mask, labels, ref_mode & 1 ? adv : NULL, ref_mode & 2 ? ref : NULL,
                                kl, kl_logratios, NULL};
        kb = k;
        if (getenv("FH_FUZZ_DEBUG"))
            fprintf(stderr, "kto (input bytes %zu..%zu) loss_type %d beta %g weights %g %g reference mode %d kl mode %d\n",
                    kto_first_byte, r.at, (int)ko.loss_type, ko.beta, ko.desirable_weight, ko.undesirable_weight,
                    ref_mode, kl_mode % 4);
    }

    /* One GRPO, preference or KTO batch in four is packed: cu_seqlens, S + 1 offsets of its S sequences (a pair's
     * two for preference), evenly spread from 0 to n, one entry in four then off by one or out of range (not from 0,
     * not increasing, not ending at n); seq 0, or in one packed batch in eight the [B, T] one (refused). Exact-size
     * offsets when S fits n, else 4 of them: the library refuses more sequences than rows before reading them. */
    if (u8(&r) % 4 == 0) {
        const int64_t sequences = call == CALL_fh_preference_forward || call == CALL_fh_preference_forward_backward
                                      ? 2 * pairs : batch;
        const int fits = small && sequences >= 1 && sequences <= n;
        const size_t entries = fits ? (size_t)sequences + 1 : 4;
        int64_t *cu = alloc_exact(&in[IN_CU_SEQLENS], entries * sizeof(int64_t));
        for (size_t k = 0; k < entries; k++)
            cu[k] = fits ? (int64_t)k * n / sequences : (int64_t)k;
        if (u8(&r) % 4 == 0) {
            static const int64_t offs[] = {-1, 1, INT64_MIN, INT64_MAX};
            const size_t k = u8(&r) % entries;
            const int64_t off = offs[u8(&r) % 4];
            cu[k] = off == INT64_MIN || off == INT64_MAX ? off : cu[k] + off;
        }
        const int64_t packed_seq = u8(&r) % 8 == 0 ? seq : 0;
        gb.cu_seqlens = pb.cu_seqlens = kb.cu_seqlens = cu;
        gb.seq = pb.seq = kb.seq = packed_seq;
    }

    /* The distillation teacher's buffers (late in the input: a short input then runs out in the teacher's values,
     * not in the student's pointers): exact sizes when its view is small, tiny ones otherwise (then the calls must
     * refuse it). */
    fh_linear teacher_lin;
    memset(&teacher_lin, 0, sizeof teacher_lin);
    if (distill) {
        const size_t tx_elems = t_small ? (size_t)tx_last + 1 : 4, tw_elems = t_small ? (size_t)tw_last + 1 : 4;
        const size_t utv = t_small ? (size_t)tv : 4;
        void *tx = alloc_exact(&in[IN_TEACHER_X], tx_elems * tx_size);
        void *tw = alloc_exact(&in[IN_TEACHER_W], tw_elems * tw_size);
        fill_elements(&r, tx, tx_elems, tx_size);
        fill_elements(&r, tw, tw_elems, tw_size);
        float *tbias = t_bias_on ? alloc_exact(&in[IN_TEACHER_BIAS], utv * sizeof(float)) : NULL;
        for (size_t j = 0; tbias && j < utv; j++)
            tbias[j] = u8(&r) % 8 == 0 ? pick_float(&r) : 0.25f;
        const fh_linear t = {tn, th, tv, t_pointer == 2 ? NULL : tx, t_x_rs, t_pointer == 3 ? NULL : tw, t_w_rs, t_w_cs,
                             tbias, t_x_dtype, t_w_dtype};
        teacher_lin = t;
    }
    const fh_linear *teacher = t_pointer == 1 ? NULL : &teacher_lin;

    /* The top-k teacher's [n, k] ids and log-probs: exact sizes for a small student and a valid k, tiny ones
     * otherwise (then the calls must refuse). Mostly valid entries (a zero byte gives id 0 and log-prob 0), some
     * padded (-inf), some out of range or not finite. */
    fh_topk_teacher topk_teacher = {topk_k, NULL, NULL};
    if (topk && !query) {
        const size_t entries = small && !topk_k_bad ? (size_t)n * (size_t)topk_k : 4;
        int64_t *ids = alloc_exact(&in[IN_TOPK_IDS], entries * sizeof(int64_t));
        float *logprobs = alloc_exact(&in[IN_TOPK_LOGPROBS], entries * sizeof(float));
        for (size_t e = 0; e < entries; e++) {
            const uint8_t m = u8(&r);
            ids[e] = m % 32 == 31 ? (m & 32 ? vocab : -1) : (int64_t)(u8(&r) % (uint64_t)(small ? vocab : 4));
            logprobs[e] = m % 16 == 15 ? pick_float(&r) : m % 16 == 14 ? -INFINITY : -0.25f * (float)(m % 16);
        }
        topk_teacher.ids = topk_pointer == 2 ? NULL : ids;
        topk_teacher.logprobs = topk_pointer == 3 ? NULL : logprobs;
    }

    /* A support for the support calls: padded [n, k] or CSR with k (padded) or up to k (CSR) ids per row, k mostly
     * 1..8, now and then 0 or negative (padded: refused); each row's first id its target when that is in range (so
     * that most calls run), the others drawn, now and then -1, V or a repeat; now and then the support or its ids
     * NULL, or CSR offsets not from 0 or decreasing. A query gets a padded support (it reads no ids). Exact sizes
     * for a small student, tiny ones otherwise (the calls must refuse it for its shape before reading them). */
    int64_t support_k = 1;
    int support_pointer = 0, support_csr = 0, support_offsets_bad = 0; /* pointer 1: support NULL, 2: ids NULL */
    fh_support support_arg = {NULL, NULL, 0};
    if (support) {
        const uint8_t sb = u8(&r);
        support_k = sb % 8 == 0 ? -(int64_t)(u8(&r) % 3) : 1 + (sb >> 3) % 8;
        support_pointer = query ? 0 : sb >> 6 == 3 && u8(&r) % 4 == 0 ? 1 + u8(&r) % 2 : 0;
        support_csr = !query && (sb >> 6) % 2 == 1 && support_k >= 1;
        const size_t rows = small ? (size_t)n : 4, k = support_k >= 1 ? (size_t)support_k : 1;
        int64_t *ids = alloc_exact(&in[IN_SUPPORT_IDS], rows * k * sizeof(int64_t));
        int64_t *offsets = support_csr ? alloc_exact(&in[IN_SUPPORT_OFFSETS], (rows + 1) * sizeof(int64_t)) : NULL;
        size_t e = 0;
        for (size_t i = 0; i < rows; i++) {
            const size_t count = support_csr ? u8(&r) % (k + 1) : k;
            for (size_t c = 0; c < count; c++, e++) {
                const uint8_t m = u8(&r);
                ids[e] = c == 0 && small && targets[i] >= 0 && targets[i] < vocab && m % 8 ? targets[i]
                         : m % 32 == 31 ? (m & 32 ? vocab : -1)
                         : m % 32 == 30 && c > 0 ? ids[e - 1]
                                                 : (int64_t)(u8(&r) % (uint64_t)(small ? vocab : 4));
            }
            if (offsets)
                offsets[i + 1] = (int64_t)e;
        }
        if (offsets) {
            offsets[0] = 0;
            const uint8_t m = u8(&r);
            support_offsets_bad = m % 16 == 15;
            if (support_offsets_bad)
                offsets[m % 2 ? 0 : rows / 2 + 1] = -1 - (int64_t)(m >> 4);
        }
        support_arg = (fh_support){support_pointer == 2 ? NULL : ids, offsets, support_csr ? 0 : support_k};
    }

    /* Distillation options (read for distillation and top-k distillation calls only): every field valid or not; the
     * targets drawn above (with the cross-entropy ignore_index, mostly the same here), or NULL; the head's top_k and
     * add_tail on half the calls. Top-k's options are the shared fields and add_tail (0, 1, or neither). */
    fh_distill_options dopt;
    fh_distill_options_init(&dopt);
    const int64_t *dtargets = targets;
    if (distill || topk) {
        const uint8_t dv = u8(&r);
        dopt.divergence = (fh_divergence)(dv % 8 == 7 ? -1 : dv % 4);
        static const double dbetas[] = {0.5, 0.0, 1.0, 0.3, -0.1, 1.0000001, NAN, INFINITY};
        dopt.beta = pick_double(&r, dbetas, 8);
        static const double dtemps[] = {1.0, 2.0, 0.5, 1e-3, 3e-39, 1e-39, 1e30, 1e46, 0.0, -1.0, NAN, INFINITY};
        dopt.temperature = pick_double(&r, dtemps, 12);
        static const double dweights[] = {1.0, 0.0, 0.5, 1e300, -1.0, NAN, INFINITY};
        dopt.weight_soft_loss = pick_double(&r, dweights, 7);
        dopt.weight_hard_loss = pick_double(&r, dweights, 7);
        const uint8_t dm = u8(&r);
        dopt.ignore_index = dm % 4 ? ce.ignore_index : ignores[(dm >> 2) % 5];
        dopt.reduction = (fh_reduction)(dm >> 4 == 15 ? 7 : (dm >> 4) % 3);
        if (u8(&r) % 8 == 7)
            dtargets = NULL;
        /* top_k: the whole vocabulary (0, or at least V), supports up to FH_DISTILL_TOPK_MAX_K, or out of range */
        static const int64_t dks[] = {0, 1, 3, 64, FH_DISTILL_TOPK_MAX_K, FH_DISTILL_TOPK_MAX_K + 1, -1, INT64_MAX};
        const uint8_t dk = u8(&r);
        dopt.top_k = dk % 2 ? dks[(dk >> 1) % 8] : 0;
        dopt.add_tail = dk >> 4 == 15 ? 2 : (dk >> 4) % 2;
    }
    fh_distill_topk_options topt;
    fh_distill_topk_options_init(&topt);
    if (topk) {
        const uint8_t tail = u8(&r);
        topt.add_tail = tail % 8 == 7 ? (int)(tail >> 3) - 16 : tail % 2;
        topt.temperature = dopt.temperature;
        topt.weight_soft_loss = dopt.weight_soft_loss;
        topt.weight_hard_loss = dopt.weight_hard_loss;
        topt.ignore_index = dopt.ignore_index;
        topt.reduction = dopt.reduction;
    }

    /* Outputs, canary-filled. */
    const size_t dx_elems = small && has_grads && !dx_bad ? (size_t)dx_last + 1 : 4;
    const int want = u8(&r);
    double *loss = (want & 1) ? alloc_exact(&out[OUT_LOSS], sizeof(double)) : NULL;
    double *zl = (want & 2) ? alloc_exact(&out[OUT_ZLOSS], sizeof(double)) : NULL;
    fh_grpo_metrics *metrics = (want & 4) ? alloc_exact(&out[OUT_METRICS], sizeof(fh_grpo_metrics)) : NULL;
    float *ptl = (want & 8) ? alloc_exact(&out[OUT_PTL], un * sizeof(float)) : NULL;
    float *logp = (want & 16) ? alloc_exact(&out[OUT_LOGP], un * sizeof(float)) : NULL;
    float *lse = (want & 32) ? alloc_exact(&out[OUT_LSE], un * sizeof(float)) : NULL;
    float *entropy = (want & 64) ? alloc_exact(&out[OUT_ENTROPY], un * sizeof(float)) : NULL;
    int64_t *argmax = (want & 128) ? alloc_exact(&out[OUT_ARGMAX], un * sizeof(int64_t)) : NULL;
    float *logits = (want & 2) ? alloc_exact(&out[OUT_LOGITS], un * uv * sizeof(float)) : NULL;
    int64_t *correct = (want & 64) ? alloc_exact(&out[OUT_CORRECT], sizeof(int64_t)) : NULL;
    fh_preference_metrics *pref_metrics =
        (want & 4) ? alloc_exact(&out[OUT_PREFERENCE_METRICS], sizeof(fh_preference_metrics)) : NULL;
    fh_kto_metrics *kto_metrics = kto && (want & 4) ? alloc_exact(&out[OUT_KTO_METRICS], sizeof(fh_kto_metrics)) : NULL;
    double *soft_loss = (distill || topk) && (want & 2) ? alloc_exact(&out[OUT_SOFT_LOSS], sizeof(double)) : NULL;
    double *hard_loss = (distill || topk) && (want & 4) ? alloc_exact(&out[OUT_HARD_LOSS], sizeof(double)) : NULL;
    /* KTO: one per sequence (ub >= batch wherever the batch can match n). */
    const size_t sequences = kto ? ub : small && pairs >= 1 && 2 * pairs <= (int64_t)ub ? (size_t)(2 * pairs) : 4;
    float *seq_logps = (want & 8) ? alloc_exact(&out[OUT_SEQUENCE_LOGPS], sequences * sizeof(float)) : NULL;
    float *rewards = (want & 32) ? alloc_exact(&out[OUT_REWARDS], sequences * sizeof(float)) : NULL;
    const int grads_want = u8(&r);
    void *dx = (grads_want & 1) ? alloc_exact(&out[OUT_DX], dx_elems * (dx_dtype == FH_DTYPE_BF16 ? 2 : 4)) : NULL;
    void *dw = (grads_want & 2) ? alloc_exact(&out[OUT_DW], w_elems * (dw_dtype == FH_DTYPE_BF16 ? 2 : 4)) : NULL;
    void *db = (grads_want & 4) ? alloc_exact(&out[OUT_DB], uv * (db_dtype == FH_DTYPE_BF16 ? 2 : 4)) : NULL;
    static const float grad_betas[] = {0.0f, 0.0f, 1.0f, 0.5f, NAN, -1.0f};
    fh_linear_grads g = {.dx = dx, .dx_row_stride = dx_rs, .dx_beta = grad_betas[u8(&r) % 6], .dweight = dw,
                         .dweight_beta = grad_betas[u8(&r) % 6], .dbias = db, .dbias_beta = grad_betas[u8(&r) % 6],
                         .dx_dtype = dx_dtype, .dweight_dtype = dw_dtype, .dbias_dtype = db_dtype};
    for (int k = 0; k < OUT_COUNT; k++)
        if (out[k].p)
            memset(out[k].p, CANARY, out[k].bytes);
    for (int k = 0; k < IN_COUNT; k++)
        if (in[k].p)
            seal_input(&in[k]);

    /* Caller workspace: none, the queried size, one byte less, or random. */
    const uint8_t ws_mode = u8(&r) % 6;
    size_t needed = 0;
    void *workspace = NULL;
    size_t ws_bytes = 0;
    fh_status query_status = FH_ERR_INVALID_SIZE;
    if (!query && small) {
        query_status = distill              ? fh_distill_workspace_size(ctx, &lin, teacher, &dopt, &needed)
                       : topk               ? fh_distill_topk_workspace_size(ctx, &lin, &needed)
                       : preference         ? fh_preference_workspace_size(ctx, &lin, &needed)
                       : kto                ? fh_kto_workspace_size(ctx, &lin, &needed)
                       : grpo_over_support  ? fh_logprob_support_workspace_size(ctx, &lin, &grpo_support, &needed)
                       : grpo               ? fh_grpo_workspace_size(ctx, &lin, &needed)
                       : logprob            ? fh_logprob_workspace_size(ctx, &lin, &needed)
                       : support            ? fh_logprob_support_workspace_size(ctx, &lin, &support_arg, &needed)
                       : call == CALL_fh_ce_forward_backward
                           ? fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &ce, &g, &needed)
                                              : fh_ce_workspace_size(ctx, &lin, &ce, &needed);
        if (ws_mode >= 3) {
            ws_bytes = ws_mode == 3 ? needed : ws_mode == 4 ? (needed ? needed - 1 : 0) : (size_t)(u64(&r) % 200000);
            if (ws_bytes > 0 && ws_bytes <= ((size_t)64 << 20)) {
                workspace = malloc(ws_bytes);
                fh_context_set_workspace(ctx, workspace, ws_bytes);
            }
        }
    }

    /* Overlapping buffers (README, Conventions): a gradient over x, over the weight or over another gradient, or the
     * caller's workspace over x. The call must fail (FH_ERR_OVERLAPPING_BUFFERS unless another fault comes first),
     * with x and the weight unwritten (inputs are checked below) and no output touched. */
    const uint8_t alias = query ? 0 : u8(&r) % 12;
    int aliased = 0;
    if (alias == 1 && has_grads && g.dx && x) {
        g.dx = x;
        aliased = 1;
    } else if (alias == 2 && has_grads && g.dweight && w) {
        g.dweight = w;
        aliased = 1;
    } else if (alias == 3 && has_grads && g.dx && g.dweight) {
        g.dx = g.dweight;
        aliased = 1;
    } else if (alias == 4 && lin.x == x && small && in[IN_X].bytes > 0) {
        fh_context_set_workspace(ctx, x, in[IN_X].bytes);
        aliased = 1;
    }

    fh_status st;
    size_t bytes = 0xA5A5A5A5u;
    fh_ce_outputs ce_out = {loss, zl, ptl, logp, lse, argmax, entropy, correct};
    fh_grpo_outputs grpo_out = {loss, metrics, logp, ptl, entropy, lse};
    fh_preference_outputs pref_out = {loss, pref_metrics, seq_logps, rewards, logp};
    fh_kto_outputs kto_out = {loss, kto_metrics, seq_logps, rewards, logp};
    fh_distill_outputs distill_out = {loss, soft_loss, hard_loss, ptl};
    fh_logprob_outputs lp_out = {logp, entropy, lse};
    const int null_struct = u8(&r) % 64 == 0;
    const fh_topk_teacher *topk_arg = topk_pointer == 1 ? NULL : &topk_teacher;
    const fh_support *support_arg_ptr = support_pointer == 1 ? NULL : &support_arg;
    switch (call) {
    case CALL_fh_ce_forward: st = fh_ce_forward(ctx, &lin, targets, &ce, null_struct ? NULL : &ce_out); break;
    case CALL_fh_ce_backward:
        st = fh_ce_backward(ctx, &lin, targets, &ce, lse_in, grad, null_struct ? NULL : &g);
        break;
    case CALL_fh_ce_forward_backward:
        st = fh_ce_forward_backward(ctx, &lin, targets, &ce, grad, &ce_out, null_struct ? NULL : &g);
        break;
    case CALL_fh_ce_workspace_size: st = fh_ce_workspace_size(ctx, &lin, &ce, &bytes); break;
    case CALL_fh_ce_forward_backward_workspace_size:
        st = fh_ce_forward_backward_workspace_size(ctx, &lin, &ce, &bytes);
        break;
    case CALL_fh_ce_forward_backward_workspace_size_with_grads:
        st = fh_ce_forward_backward_workspace_size_with_grads(ctx, &lin, &ce, null_struct ? NULL : &g, &bytes);
        break;
    case CALL_fh_logprob_forward: st = fh_logprob_forward(ctx, &lin, targets, &lo, null_struct ? NULL : &lp_out); break;
    case CALL_fh_logprob_backward:
        st = fh_logprob_backward(ctx, &lin, targets, &lo, lse_in, entropy_in, grad, grads_want & 1 ? grad : NULL,
                                 grads_want & 2 ? grad : NULL, null_struct ? NULL : &g);
        break;
    case CALL_fh_logprob_forward_keep:
        st = fh_logprob_forward_keep(ctx, &lin, targets, &lo, null_struct ? NULL : &lp_out, logits);
        break;
    case CALL_fh_logprob_backward_kept:
        st = fh_logprob_backward_kept(ctx, &lin, targets, &lo, logits_in, lse_in, entropy_in, grad,
                                      grads_want & 1 ? grad : NULL, grads_want & 2 ? grad : NULL,
                                      null_struct ? NULL : &g);
        break;
    case CALL_fh_logprob_forward_backward:
        st = fh_logprob_forward_backward(ctx, &lin, targets, &lo, grad, grads_want & 1 ? grad : NULL,
                                         grads_want & 2 ? grad : NULL, &lp_out, null_struct ? NULL : &g);
        break;
    case CALL_fh_logprob_workspace_size: st = fh_logprob_workspace_size(ctx, &lin, &bytes); break;
    case CALL_fh_logprob_support_forward:
        st = fh_logprob_support_forward(ctx, &lin, targets, support_arg_ptr, &lo, null_struct ? NULL : &lp_out);
        break;
    case CALL_fh_logprob_support_backward:
        st = fh_logprob_support_backward(ctx, &lin, targets, support_arg_ptr, &lo, lse_in, entropy_in, grad,
                                         grads_want & 1 ? grad : NULL, grads_want & 2 ? grad : NULL,
                                         null_struct ? NULL : &g);
        break;
    case CALL_fh_logprob_support_forward_backward:
        st = fh_logprob_support_forward_backward(ctx, &lin, targets, support_arg_ptr, &lo, grad,
                                                 grads_want & 1 ? grad : NULL, grads_want & 2 ? grad : NULL, &lp_out,
                                                 null_struct ? NULL : &g);
        break;
    case CALL_fh_logprob_support_workspace_size:
        st = fh_logprob_support_workspace_size(ctx, &lin, &support_arg, &bytes);
        break;
    case CALL_fh_grpo_forward: st = fh_grpo_forward(ctx, &lin, null_struct ? NULL : &gb, &go, &grpo_out); break;
    case CALL_fh_grpo_backward:
        st = fh_grpo_backward(ctx, &lin, &gb, &go, logp_in, lse_in, entropy_in, grad, null_struct ? NULL : &g);
        break;
    case CALL_fh_grpo_forward_backward:
        st = fh_grpo_forward_backward(ctx, &lin, &gb, &go, grad, &grpo_out, null_struct ? NULL : &g);
        break;
    case CALL_fh_grpo_workspace_size: st = fh_grpo_workspace_size(ctx, &lin, &bytes); break;
    case CALL_fh_preference_forward:
        st = fh_preference_forward(ctx, &lin, null_struct ? NULL : &pb, &po, &pref_out);
        break;
    case CALL_fh_preference_forward_backward:
        st = fh_preference_forward_backward(ctx, &lin, &pb, &po, grad, &pref_out, null_struct ? NULL : &g);
        break;
    case CALL_fh_preference_workspace_size: st = fh_preference_workspace_size(ctx, &lin, &bytes); break;
    case CALL_fh_distill_forward:
        st = fh_distill_forward(ctx, &lin, teacher, dtargets, &dopt, null_struct ? NULL : &distill_out);
        break;
    case CALL_fh_distill_forward_backward:
        st = fh_distill_forward_backward(ctx, &lin, teacher, dtargets, &dopt, grad, &distill_out,
                                         null_struct ? NULL : &g);
        break;
    case CALL_fh_distill_workspace_size: st = fh_distill_workspace_size(ctx, &lin, teacher, &dopt, &bytes); break;
    case CALL_fh_distill_topk_forward:
        st = fh_distill_topk_forward(ctx, &lin, topk_arg, dtargets, &topt, null_struct ? NULL : &distill_out);
        break;
    case CALL_fh_distill_topk_forward_backward:
        st = fh_distill_topk_forward_backward(ctx, &lin, topk_arg, dtargets, &topt, grad, &distill_out,
                                              null_struct ? NULL : &g);
        break;
    case CALL_fh_distill_topk_workspace_size: st = fh_distill_topk_workspace_size(ctx, &lin, &bytes); break;
    case CALL_fh_kto_forward: st = fh_kto_forward(ctx, &lin, null_struct ? NULL : &kb, &ko, &kto_out); break;
    case CALL_fh_kto_forward_backward:
        st = fh_kto_forward_backward(ctx, &lin, &kb, &ko, grad, &kto_out, null_struct ? NULL : &g);
        break;
    case CALL_fh_kto_workspace_size: st = fh_kto_workspace_size(ctx, &lin, &bytes); break;
    }

    if (getenv("FH_FUZZ_DEBUG"))
        fprintf(stderr, "status %d\n", (int)st);
    /* dx is validated only when it is requested (and the grads struct is passed). */
    if ((lin_bad || (dx_bad && dx && !null_struct)) && lin.x && lin.weight)
        CHECK(st != FH_OK, "call %d accepted a shape it must reject (n=%lld h=%lld v=%lld strides %lld %lld %lld "
              "dx %lld)", call, (long long)n, (long long)hidden, (long long)vocab, (long long)x_rs, (long long)w_rs,
              (long long)w_cs, (long long)dx_rs);
    if (dtype_bad && lin.x && lin.weight)
        CHECK(st != FH_OK, "call %d accepted x_dtype %d with weight_dtype %d", call, (int)x_dtype, (int)w_dtype);
    if (grad_dtype_bad && has_grads && !null_struct && lin.x && lin.weight)
        CHECK(st != FH_OK, "call %d accepted gradient dtypes %d %d %d with x_dtype %d", call, (int)dx_dtype,
              (int)dw_dtype, (int)db_dtype, (int)x_dtype);
    /* The teacher: a NULL pointer, an invalid view or a dtype mismatch always; n or V not the student's in the
     * calls (the query sizes the student's workspace and does not compare them). */
    if (topk && !query && (topk_pointer || topk_k_bad) && lin.x && lin.weight)
        CHECK(st != FH_OK, "call %d accepted a top-k teacher it must reject (k=%lld, pointer %d)", call,
              (long long)topk_k, topk_pointer);
    if (support && !query && (support_pointer || support_k < 1 || support_offsets_bad) && lin.x && lin.weight)
        CHECK(st != FH_OK, "call %d accepted a support it must reject (k=%lld, pointer %d, CSR %d, offsets bad %d)",
              call, (long long)support_k, support_pointer, support_csr, support_offsets_bad);
    if (distill && (t_pointer || t_lin_bad || t_dtype_bad || (t_mismatch && !query)))
        CHECK(st != FH_OK, "call %d accepted a teacher it must reject (n=%lld h=%lld v=%lld strides %lld %lld %lld "
              "dtypes %d %d pointer %d; student n=%lld v=%lld)", call, (long long)tn, (long long)th, (long long)tv,
              (long long)t_x_rs, (long long)t_w_rs, (long long)t_w_cs, (int)t_x_dtype, (int)t_w_dtype, t_pointer,
              (long long)n, (long long)vocab);
    if (query) {
        if (st != FH_OK)
            CHECK(bytes == 0xA5A5A5A5u, "a failed query wrote *bytes");
        else
            CHECK(bytes <= (size_t)effective_budget, "query answered %zu bytes over a budget of %lld", bytes,
                  (long long)effective_budget);
    } else {
        if (st != FH_OK)
            for (int k = 0; k < OUT_COUNT; k++)
                CHECK(untouched(&out[k]), "call %d failed with status %d but wrote output %d", call, (int)st, k);
        /* The train step's query for its gradients is exact; the others are the larger of two passes' needs. */
        if (st == FH_OK && workspace && call == CALL_fh_ce_forward_backward)
            CHECK(query_status == FH_OK && ws_bytes >= needed,
                  "call %d succeeded with a %zu-byte caller workspace; the query said %zu (status %d)", call, ws_bytes,
                  needed, (int)query_status);
        if (aliased)
            CHECK(st != FH_OK, "call %d accepted overlapping buffers (mode %d)", call, alias);
        /* Every head: a caller workspace of exactly the queried size is never too small. */
        if (workspace && ws_mode == 3 && query_status == FH_OK && !aliased)
            CHECK(st != FH_ERR_WORKSPACE_TOO_SMALL, "call %d refused a caller workspace of the %zu bytes its query gave",
                  call, needed);
        if (st == FH_OK && argmax && (call == CALL_fh_ce_forward || call == CALL_fh_ce_forward_backward))
            for (size_t i = 0; i < un; i++)
                CHECK(argmax[i] >= 0 && argmax[i] < vocab, "argmax[%zu] = %lld outside [0, %lld)", i,
                      (long long)argmax[i], (long long)vocab);
        if (st == FH_OK && correct && (call == CALL_fh_ce_forward || call == CALL_fh_ce_forward_backward))
            CHECK(*correct >= 0 && *correct <= n, "correct = %lld outside [0, %lld]", (long long)*correct, (long long)n);
        if (st == FH_OK && (distill || topk) && ptl && dtargets)
            for (size_t i = 0; i < un; i++)
                CHECK(dtargets[i] != dopt.ignore_index || ptl[i] == 0.0f,
                      "distillation: ignored token %zu has a per-token loss of %g", i, (double)ptl[i]);
    }
    const char *message = NULL;
    CHECK(fh_context_message(ctx, &message) == FH_OK && message && strlen(message) < 256, "message");
    CHECK(strlen(fh_status_string(st)) > 0, "status string");
    static const char *in_names[IN_COUNT] = {"x", "weight", "bias", "class_weights", "targets", "grad_output", "lse",
                                             "logp", "entropy", "mask", "advantages", "old", "ref", "sampling",
                                             "teacher x", "teacher weight", "teacher bias", "labels", "kl",
                                             "kl_logratios", "top-k ids", "top-k log-probs",
                                             "kept logits", "support ids", "support offsets", "cu_seqlens"};
    for (int k = 0; k < IN_COUNT; k++)
        check_input(&in[k], in_names[k]);

    fh_context_destroy(ctx);
    free(workspace);
    for (int k = 0; k < IN_COUNT; k++)
        release(&in[k]);
    for (int k = 0; k < OUT_COUNT; k++)
        release(&out[k]);
    return 0;
}
