/* Lookup of measured tile configurations (see fh_context_add_wisdom). */
#ifndef FH_WISDOM_H
#define FH_WISDOM_H

#include "context.h"

/* The entry for (threads, hidden, vocab, call, dtype) with the nearest n, or NULL. */
const fh_tile_config *fh_wisdom_lookup(const fh_context *ctx, int64_t threads, int64_t n, int64_t hidden,
                                       int64_t vocab, fh_call call, fh_dtype dtype);

#endif
