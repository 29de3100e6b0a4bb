/* The contract driver (contract_driver.h). */
#include "contract_driver.h"

#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fh_context *context_at(void *fixture, size_t offset)
{
    fh_context *ctx;
    memcpy(&ctx, (char *)fixture + offset, sizeof ctx);
    return ctx;
}

static void *region(void *fixture, cd_region r)
{
    return (char *)fixture + r.offset;
}

static const char *message_of(fh_context *ctx)
{
    const char *msg = NULL;
    fh_context_message(ctx, &msg);
    return msg;
}

/* The message after a call: empty after a success; after an error non-empty, with `word` (if any). */
static void check_message(fh_context *ctx, int error, const char *word, const char *label, const char *entry)
{
    const char *msg = message_of(ctx);
    if (!error) {
        TU_CHECK(msg && msg[0] == '\0', "%s, %s: message after success \"%s\"", label, entry, msg ? msg : "(null)");
        return;
    }
    TU_CHECK(msg && msg[0], "%s, %s: empty message", label, entry);
    if (word)
        TU_CHECK(msg && tu_mentions(msg, word), "%s, %s: message \"%s\" does not name '%s'", label, entry,
                 msg ? msg : "(null)", word);
}

static int all_finite(const void *p, cd_region r, cd_kind kind)
{
    if (kind == CD_F32)
        return tu_all_finite_f(p, r.bytes / sizeof(float));
    for (size_t i = 0; kind == CD_F64 && i < r.bytes / sizeof(double); i++)
        if (!isfinite(((const double *)p)[i]))
            return 0;
    return 1;
}

static int is_asked(const char *name, const char *const *asked, size_t count)
{
    for (size_t k = 0; k < count; k++)
        if (asked[k] && strcmp(asked[k], name) == 0)
            return 1;
    return 0;
}

/* After a successful call from the canary: the parts `which` writes (of those asked, when asked is given) differ
 * from the canary and are finite where their kind says so; every other part is still the canary. */
static void check_parts(const cd_api *api, void *f, const unsigned char *canary, int which, const char *const *asked,
                        size_t asked_count, const char *label)
{
    const char *entry = api->call_name(which);
    for (size_t k = 0; k < api->part_count; k++) {
        const cd_output *p = &api->parts[k];
        const void *at = region(f, p->at);
        const int same = memcmp(at, canary, p->at.bytes) == 0;
        if ((p->written_by & which) && (!asked || is_asked(p->name, asked, asked_count))) {
            TU_CHECK(!same, "%s, %s left %s at the canary", label, entry, p->name);
            TU_CHECK(all_finite(at, p->at, p->kind), "%s, %s: %s not finite", label, entry, p->name);
        } else
            TU_CHECK(same, "%s, %s wrote %s, which it %s", label, entry, p->name,
                     asked ? "was not asked for" : "does not produce");
    }
}

/* The canary that outputs are compared with: as large as the whole outputs region. */
static unsigned char *canary_block(const cd_api *api)
{
    unsigned char *c = tu_alloc(1, api->outputs.bytes);
    tu_fill_canary(c, api->outputs.bytes);
    return c;
}

void cd_run_bad_arguments(const cd_api *api, const cd_case *cases, size_t count)
{
    void *f = tu_alloc(1, api->fixture_bytes);
    void *out_before = tu_alloc(1, api->outputs.bytes), *in_before = tu_alloc(1, api->inputs.bytes);
    for (size_t k = 0; k < count; k++) {
        const cd_case *c = &cases[k];
        /* A case that names no entry point, or one the suite lacks, would check nothing there. */
        TU_CHECK(c->calls != 0 && (c->calls & ~api->all) == 0, "%s: entry points %#x, the suite has %#x", c->name,
                 (unsigned)c->calls, (unsigned)api->all);
        for (int which = 1; which <= api->all; which *= 2) {
            if (!(c->calls & which))
                continue;
            const char *entry = api->call_name(which);
            api->init(f);
            c->mutate(f);
            memcpy(out_before, region(f, api->outputs), api->outputs.bytes);
            memcpy(in_before, region(f, api->inputs), api->inputs.bytes);
            const fh_status st = api->call(f, which);
            TU_CHECK(st == c->expected, "%s, %s: status %d (%s), expected %d (%s)", c->name, entry, (int)st,
                     fh_status_string(st), (int)c->expected, fh_status_string(c->expected));
            TU_CHECK(memcmp(out_before, region(f, api->outputs), api->outputs.bytes) == 0,
                     "%s, %s: an output buffer was modified", c->name, entry);
            TU_CHECK(memcmp(in_before, region(f, api->inputs), api->inputs.bytes) == 0,
                     "%s, %s: an input was modified", c->name, entry);
            fh_context *passed = context_at(f, api->call_ctx_at);
            if (passed)
                check_message(passed, 1, c->mentions, c->name, entry);
            fh_context_destroy(context_at(f, api->ctx_at));
        }
    }
    free(f);
    free(out_before);
    free(in_before);
}

void cd_run_valid_calls(const cd_api *api, const cd_case *then, size_t count, void (*check)(void *fixture, int which))
{
    void *f = tu_alloc(1, api->fixture_bytes), *in_before = tu_alloc(1, api->inputs.bytes);
    unsigned char *canary = canary_block(api);
    for (int which = 1; which <= api->all; which *= 2) {
        const char *entry = api->call_name(which);
        api->init(f);
        memcpy(in_before, region(f, api->inputs), api->inputs.bytes);
        const fh_status st = api->call(f, which);
        TU_CHECK(st == FH_OK, "%s: status %d (%s)", entry, (int)st, fh_status_string(st));
        check_parts(api, f, canary, which, NULL, 0, "the fixture");
        if (check)
            check(f, which);
        TU_CHECK(memcmp(in_before, region(f, api->inputs), api->inputs.bytes) == 0, "%s modified an input", entry);
        fh_context *ctx = context_at(f, api->ctx_at);
        check_message(ctx, 0, NULL, "the fixture", entry);
        /* The message follows the last call: set by an error, cleared by the next success. */
        for (size_t k = 0; k < count; k++) {
            then[k].mutate(f);
            const fh_status got = api->call(f, which);
            TU_CHECK(got == then[k].expected, "%s, %s: status %d (%s), expected %d", then[k].name, entry, (int)got,
                     fh_status_string(got), (int)then[k].expected);
            check_message(ctx, then[k].expected != FH_OK, then[k].mentions, then[k].name, entry);
        }
        fh_context_destroy(ctx);
    }
    free(f);
    free(in_before);
    free(canary);
}

void cd_run_workspace(const cd_api *api, const cd_workspace *w)
{
    enum { GUARD = 256, FILL = 0x5A };
    void *f = tu_alloc(1, api->fixture_bytes);
    void *out_before = tu_alloc(1, api->outputs.bytes), *in_before = tu_alloc(1, api->inputs.bytes);
    unsigned char *canary = canary_block(api);
    char label[160];
    for (size_t o = 0; o < w->offset_count; o++)
        for (size_t s = 0; s < w->setup_count; s++)
            for (int which = 1; which <= api->all; which *= 2) {
                const size_t offset = w->offsets[o];
                const char *entry = api->call_name(which);
                snprintf(label, sizeof label, "offset %zu, %s", offset, w->setups[s]);
                api->init(f);
                w->setup(f, s);
                fh_context *ctx = context_at(f, api->ctx_at);
                size_t bytes = 0;
                TU_CHECK(w->size(f, which, &bytes) == FH_OK && bytes > 0, "%s, %s: size query", label, entry);
                unsigned char *block = tu_alloc(offset + bytes + GUARD, 1), *ws = block + offset;
                memset(block, FILL, offset + bytes + GUARD);

                TU_CHECK(fh_context_set_workspace(ctx, ws, bytes - 1) == FH_OK, "set_workspace");
                memcpy(out_before, region(f, api->outputs), api->outputs.bytes);
                memcpy(in_before, region(f, api->inputs), api->inputs.bytes);
                fh_status st = api->call(f, which);
                TU_CHECK(st == FH_ERR_WORKSPACE_TOO_SMALL, "%s, %s: bytes - 1 gives status %d", label, entry, (int)st);
                check_message(ctx, 1, "workspace", label, entry);
                TU_CHECK(memcmp(out_before, region(f, api->outputs), api->outputs.bytes) == 0 &&
                             memcmp(in_before, region(f, api->inputs), api->inputs.bytes) == 0,
                         "%s, %s: a failed call modified an output or input", label, entry);

                TU_CHECK(fh_context_set_workspace(ctx, ws, bytes) == FH_OK, "set_workspace");
                st = api->call(f, which);
                TU_CHECK(st == FH_OK, "%s, %s: exact size gives status %d", label, entry, (int)st);
                if (w->check)
                    w->check(f, which, label);
                size_t outside = 0;
                for (size_t i = 0; i < offset; i++)
                    outside += block[i] != FILL;
                for (size_t i = 0; i < GUARD; i++)
                    outside += ws[bytes + i] != FILL;
                TU_CHECK(outside == 0, "%s, %s: %zu bytes written outside the workspace", label, entry, outside);
                check_parts(api, f, canary, which, NULL, 0, label);
                check_message(ctx, 0, NULL, label, entry);
                TU_CHECK(fh_context_set_workspace(ctx, NULL, 0) == FH_OK, "set_workspace(NULL, 0)");
                TU_CHECK(api->call(f, which) == FH_OK, "%s, %s: library-managed workspace again", label, entry);
                fh_context_destroy(ctx);
                free(block);
            }
    /* The query is pure: a refusal writes nothing to *bytes and leaves the message as it was. */
    for (size_t k = 0; k < w->refused_count * w->setup_count; k++) {
        const cd_case *c = &w->refused[k / w->setup_count];
        const size_t s = k % w->setup_count;
        for (int which = 1; which <= api->all; which *= 2) {
            if (!(c->calls & which))
                continue;
            const char *entry = api->call_name(which);
            api->init(f);
            w->setup(f, s);
            c->mutate(f);
            fh_context *passed = context_at(f, api->call_ctx_at);
            char before[1024] = "";
            if (passed)
                snprintf(before, sizeof before, "%s", message_of(passed));
            size_t bytes = 777;
            const fh_status st = w->size(f, which, &bytes);
            TU_CHECK(st == c->expected && bytes == 777,
                     "size query for %s, %s, %s: status %d, expected %d; *bytes %zu", entry, w->setups[s], c->name,
                     (int)st, (int)c->expected, bytes);
            if (passed) {
                const char *after = message_of(passed);
                TU_CHECK(after && strcmp(before, after) == 0,
                         "size query for %s, %s, %s: the pure query changed the message to \"%s\"", entry,
                         w->setups[s], c->name, after ? after : "(null)");
            }
            fh_context_destroy(context_at(f, api->ctx_at));
        }
    }
    for (int which = 1; which <= api->all; which *= 2) {
        api->init(f);
        TU_CHECK(w->size(f, which, NULL) == FH_ERR_NULL_POINTER, "size query for %s: NULL bytes",
                 api->call_name(which));
        fh_context_destroy(context_at(f, api->ctx_at));
    }
    free(f);
    free(out_before);
    free(in_before);
    free(canary);
}

void cd_run_optional_outputs(const cd_api *api, const cd_optional *steps, size_t count)
{
    void *f = tu_alloc(1, api->fixture_bytes);
    unsigned char *canary = canary_block(api);
    api->init(f);
    for (size_t k = 0; k < count; k++) {
        steps[k].mutate(f);
        for (int which = 1; which <= api->all; which *= 2) {
            if (!(steps[k].calls & which))
                continue;
            tu_fill_canary(region(f, api->outputs), api->outputs.bytes);
            const fh_status st = api->call(f, which);
            TU_CHECK(st == FH_OK, "%s, %s: status %d (%s)", steps[k].name, api->call_name(which), (int)st,
                     fh_status_string(st));
            check_parts(api, f, canary, which, steps[k].asked, TU_COUNT(steps[k].asked), steps[k].name);
        }
    }
    fh_context_destroy(context_at(f, api->ctx_at));
    free(f);
    free(canary);
}
