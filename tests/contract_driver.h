/* The bad-argument driver of the contract suites (test_contracts.c, test_grpo_contracts.c, test_preference.c,
 * test_distill.c): one loop, so that every head's refused calls are judged by the same checks. A suite describes
 * its fixture (a valid call that each case breaks in one way) and its entry points; each case names the entry
 * points that take the broken argument, the status they must return and a word the message must contain. */
#ifndef FH_CONTRACT_DRIVER_H
#define FH_CONTRACT_DRIVER_H

#include "fusedhead.h"

#include <stddef.h>

/* One invalid argument. mutate breaks a fresh fixture (the suite's fixture type, passed as void *). */
typedef struct cd_case {
    const char *name;
    void (*mutate)(void *fixture);
    int calls; /* the entry points that take the broken argument: bits of cd_api.all */
    fh_status expected;
    const char *mentions; /* a word the message must contain (NULL: none demanded) */
} cd_case;

/* Bytes of the fixture: where, how many. */
typedef struct cd_region {
    size_t offset, bytes;
} cd_region;
/* A member of the fixture type as a region (usable in static initialisers). */
#define CD_MEMBER(type, member) {offsetof(type, member), sizeof(((type *)0)->member)}

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
} cd_api;

/* For each case and each entry point it names, on a fresh fixture: the expected status, outputs and inputs
 * bit-identical, and (when a context was passed) a non-empty message that mentions the case's word. */
void cd_run_bad_arguments(const cd_api *api, const cd_case *cases, size_t count);

#endif
