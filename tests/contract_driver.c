/* The bad-argument driver (contract_driver.h). */
#include "contract_driver.h"

#include "test_util.h"

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
            if (passed) {
                const char *msg = NULL;
                TU_CHECK(fh_context_message(passed, &msg) == FH_OK && msg && msg[0], "%s, %s: empty message",
                         c->name, entry);
                if (c->mentions)
                    TU_CHECK(msg && tu_mentions(msg, c->mentions), "%s, %s: message \"%s\" does not name '%s'",
                             c->name, entry, msg ? msg : "(null)", c->mentions);
            }
            fh_context_destroy(context_at(f, api->ctx_at));
        }
    }
    free(f);
    free(out_before);
    free(in_before);
}
