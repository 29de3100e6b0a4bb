/* The contract driver of the contract suites (test_contracts.c, test_grpo_contracts.c, test_preference.c,
 * test_distill.c): one loop per contract, so that every head is judged by the same checks. A suite describes its
 * fixture (a valid call on a new context, which each case changes in one way), its entry points and its outputs;
 * the driver runs
 *   - cd_run_bad_arguments: each refused argument's status, untouched outputs and inputs, a message naming it;
 *   - cd_run_valid_calls: the unbroken call writes exactly its outputs; the message is empty after a success and
 *     present after an error;
 *   - cd_run_workspace: a caller workspace of exactly the queried size works, one byte less is refused, nothing is
 *     written outside it; the size query's own refusals are pure;
 *   - cd_run_optional_outputs: outputs left NULL are skipped, the others written. */
#ifndef FH_CONTRACT_DRIVER_H
#define FH_CONTRACT_DRIVER_H

#include "fusedhead.h"

#include <stddef.h>

/* One change to a fresh fixture (the suite's fixture type, passed as void *) and what each entry point it names
 * must then return. */
typedef struct cd_case {
    const char *name;
    void (*mutate)(void *fixture);
    int calls; /* the entry points concerned: bits of cd_api.all */
    fh_status expected;
    const char *mentions; /* a word the message must contain (NULL: none demanded; an FH_OK case: empty message) */
} cd_case;

/* Bytes of the fixture: where, how many. */
typedef struct cd_region {
    size_t offset, bytes;
} cd_region;
/* A member of the fixture type as a region (usable in static initialisers; member may be `out.dx`). */
#define CD_MEMBER(type, member) {offsetof(type, member), sizeof(((type *)0)->member)}

/* One output buffer: which entry points write it, and whether its values must then be finite. */
typedef enum cd_kind { CD_BYTES, CD_F32, CD_F64 } cd_kind;
typedef struct cd_output {
    const char *name;
    cd_region at;
    int written_by; /* bits of cd_api.all */
    cd_kind kind;   /* CD_F32 / CD_F64: every value finite after a successful call that writes it */
} cd_output;
#define CD_OUTPUT(type, name, member, written_by, kind) {name, CD_MEMBER(type, out.member), written_by, kind}

/* A suite's fixture and entry points. */
typedef struct cd_api {
    size_t fixture_bytes;
    void (*init)(void *fixture); /* a valid call on a new context, every output at the canary */
    fh_status (*call)(void *fixture, int which); /* which: one bit of all */
    const char *(*call_name)(int which);
    int all;                    /* the entry points' bits (1, 2, 4, ...), run in that order */
    cd_region outputs, inputs;  /* everything a call writes, everything it reads: bit-identical after a refusal */
    size_t ctx_at;              /* offset of the fixture's own fh_context * (destroyed after each case) */
    size_t call_ctx_at;         /* offset of the fh_context * passed; NULL after mutate: no message to ask */
    const cd_output *parts;     /* the buffers of outputs, each once */
    size_t part_count;
} cd_api;
/* The cd_api fields of a fixture type whose members ctx, call_ctx, in and out are the ones above. */
#define CD_FIXTURE(type)                                                                                           \
    .fixture_bytes = sizeof(type), .outputs = CD_MEMBER(type, out), .inputs = CD_MEMBER(type, in),                 \
    .ctx_at = offsetof(type, ctx), .call_ctx_at = offsetof(type, call_ctx)

/* For each case and each entry point it names, on a fresh fixture: the expected status, outputs and inputs
 * bit-identical, and (when a context was passed) a non-empty message that mentions the case's word. */
void cd_run_bad_arguments(const cd_api *api, const cd_case *cases, size_t count);

/* For each entry point, on a fresh fixture: FH_OK; each part written (and finite) if the entry point writes it,
 * else still the canary (so that the canary comparisons of the other tests can fail); check (if any); inputs
 * untouched; an empty message. Then, on the same context, each of `then` in order (their changes accumulate):
 * its status, and a message naming its word after an error, an empty one after a success. */
void cd_run_valid_calls(const cd_api *api, const cd_case *then, size_t count, void (*check)(void *fixture, int which));

/* The caller workspace (fh_context_set_workspace). */
typedef struct cd_workspace {
    const size_t *offsets; /* where the workspace starts in its block (no alignment is documented) */
    size_t offset_count;
    const char *const *setups; /* labels of the settings to run under: setup(fixture, k) applies the k-th */
    size_t setup_count;
    void (*setup)(void *fixture, size_t k);
    /* The size query for an entry point, on what the fixture passes (call_ctx and the like), so that cases apply. */
    fh_status (*size)(void *fixture, int which, size_t *bytes);
    void (*check)(void *fixture, int which, const char *label); /* optional: after the exact-size call */
    const cd_case *refused; /* cases the size query refuses: *bytes and the message stay as they were */
    size_t refused_count;
} cd_workspace;

/* For each offset, setup and entry point, on a fresh fixture: the query gives a size > 0; one byte less is
 * refused with FH_ERR_WORKSPACE_TOO_SMALL, a message naming the workspace and untouched outputs and inputs; the
 * exact size succeeds (then check), writes nothing outside it (guard bytes on both sides), finite outputs, an
 * empty message; the library's own workspace again succeeds. Then each refused case under each setup, and a NULL
 * *bytes. */
void cd_run_workspace(const cd_api *api, const cd_workspace *w);

/* A call with only some outputs asked for ("any output may be NULL"). */
typedef struct cd_optional {
    const char *name;
    void (*mutate)(void *fixture); /* on one fixture, in order: the changes accumulate */
    int calls;
    const char *asked[4]; /* the parts the outputs now point at, by name (the rest NULL) */
} cd_optional;

/* On one fixture, each step in turn: every entry point of the step succeeds from the canary, writes the asked parts
 * it produces (finite) and nothing else. */
void cd_run_optional_outputs(const cd_api *api, const cd_optional *steps, size_t count);

#endif
