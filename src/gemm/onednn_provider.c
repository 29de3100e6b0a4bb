/* oneDNN matmul behind the GEMM layer. Two facts measured with oneDNN 2.6 on AVX512-BF16 shape this file:
 * - a column-major C (a [V, H] dweight seen as its [H, V] view) has no fast implementation ("ref:any", about
 *   a thousand times slower), while transposed A and B do ("brg:avx512_core_bf16"); so a column-major C is
 *   computed as C^T = B^T A^T, which only swaps strides;
 * - building a primitive costs 0.3-15 ms, as much as a small GEMM: primitives are cached per (shape,
 *   strides, types, accumulate, threads) with their memory objects, never rebuilt per tile or per call, and
 *   a run only points the memory objects at the caller's data (no allocation).
 * oneDNN runs on the OpenMP runtime that BLIS and the row kernels use (libgomp); it takes its thread count
 * from the calling thread's omp_get_max_threads() when a primitive is built and run, so both happen under
 * the caller's count, restored afterwards. */
#include "onednn_provider.h"

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every GEMM of one call's passes (full and edge tiles, both accumulate modes; with gradient filtering, each
 * power-of-two chunk of column blocks too: about 60 for a streamed call) with room for a few more shapes; the least
 * recently used entry goes first. */
#define CACHE_ENTRIES 96

typedef struct gemm_key {
    int64_t m, n, k;
    int64_t strides[6]; /* A, B, C: row, column */
    int types[3];
    int accumulate;
    int threads;
} gemm_key;

typedef struct cache_entry {
    gemm_key key;
    dnnl_primitive_t primitive; /* NULL: the entry is free */
    dnnl_memory_t memory[3];    /* A, B, C, their handles set per run */
    uint64_t last_use;
} cache_entry;

struct fh_gemm_cache {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    cache_entry entries[CACHE_ENTRIES];
    uint64_t clock;
};

static const int arguments[3] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};

/* The library's status for a oneDNN failure: memory, or the provider's own. */
static fh_status status_of(dnnl_status_t s)
{
    return s == dnnl_success ? FH_OK : s == dnnl_out_of_memory ? FH_ERR_OUT_OF_MEMORY : FH_ERR_GEMM_FAILED;
}

fh_status fh_onednn_cache_create(fh_gemm_cache **cache)
{
    fh_gemm_cache *c = calloc(1, sizeof *c);
    if (!c)
        return FH_ERR_OUT_OF_MEMORY;
    dnnl_status_t s = dnnl_engine_create(&c->engine, dnnl_cpu, 0);
    if (s != dnnl_success) {
        free(c);
        return status_of(s);
    }
    s = dnnl_stream_create(&c->stream, c->engine, dnnl_stream_default_flags);
    if (s != dnnl_success) {
        dnnl_engine_destroy(c->engine);
        free(c);
        return status_of(s);
    }
    *cache = c;
    return FH_OK;
}

static void release(cache_entry *entry)
{
    for (int o = 0; o < 3; o++)
        if (entry->memory[o])
            dnnl_memory_destroy(entry->memory[o]);
    if (entry->primitive)
        dnnl_primitive_destroy(entry->primitive);
    memset(entry, 0, sizeof *entry);
}

void fh_onednn_cache_destroy(fh_gemm_cache *cache)
{
    if (!cache)
        return;
    for (int e = 0; e < CACHE_ENTRIES; e++)
        release(&cache->entries[e]);
    dnnl_stream_destroy(cache->stream);
    dnnl_engine_destroy(cache->engine);
    free(cache);
}

static dnnl_data_type_t dnnl_type(int type)
{
    return type == FH_ELEM_BF16 ? dnnl_bf16 : dnnl_f32;
}

/* The stride of a dimension of extent 1 never steps: it is set to a dense row-major layout's, so that equal
 * products share a key and oneDNN sees a plain layout (a 1 x n view with strides (1, 1), as dweight is for a [V, H]
 * weight with H = 1, was accepted by its matmul descriptor and then refused at execution). */
static void canonical_strides(int64_t rows, int64_t cols, int64_t *row_stride, int64_t *col_stride)
{
    if (cols == 1)
        *col_stride = 1;
    if (rows == 1)
        *row_stride = cols * *col_stride;
}

/* The key of a product, with a column-major C turned into C^T = B^T A^T; *swap tells that A and B trade
 * places. */
static gemm_key key_of(int64_t m, int64_t n, int64_t k, const fh_gemm_input *a, const fh_gemm_input *b,
                       int accumulate, const fh_gemm_output *c, int threads, int *swap)
{
    *swap = c->row_stride < c->col_stride && m > 1;
    const fh_gemm_input *first = *swap ? b : a, *second = *swap ? a : b;
    gemm_key key;
    memset(&key, 0, sizeof key); /* compared with memcmp, padding included */
    key.m = *swap ? n : m;
    key.n = *swap ? m : n;
    key.k = k;
    const int64_t given[6] = {first->row_stride, first->col_stride, second->row_stride, second->col_stride,
                              c->row_stride, c->col_stride};
    for (int s = 0; s < 6; s++)
        key.strides[s] = given[*swap ? s ^ 1 : s];
    const int64_t rows[3] = {key.m, key.k, key.m}, cols[3] = {key.k, key.n, key.n};
    for (int o = 0; o < 3; o++)
        canonical_strides(rows[o], cols[o], &key.strides[2 * o], &key.strides[2 * o + 1]);
    key.types[0] = (int)first->type;
    key.types[1] = (int)second->type;
    key.types[2] = (int)c->type;
    key.accumulate = accumulate != 0;
    key.threads = threads;
    return key;
}

/* Builds entry's primitive and memory objects for key; the first oneDNN failure's status. */
static dnnl_status_t build(fh_gemm_cache *cache, const gemm_key *key, cache_entry *entry)
{
    const int64_t rows[3] = {key->m, key->k, key->m}, cols[3] = {key->k, key->n, key->n};
    dnnl_memory_desc_t md[3];
    dnnl_status_t s = dnnl_success;
    for (int o = 0; o < 3 && s == dnnl_success; o++) {
        const dnnl_dims_t dims = {rows[o], cols[o]};
        const dnnl_dims_t strides = {key->strides[2 * o], key->strides[2 * o + 1]};
        s = dnnl_memory_desc_init_by_strides(&md[o], 2, dims, dnnl_type(key->types[o]), strides);
    }
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post_ops = NULL;
    dnnl_primitive_desc_t pd = NULL;
    if (s == dnnl_success)
        s = dnnl_matmul_desc_init(&desc, &md[0], &md[1], NULL, &md[2]);
    if (s == dnnl_success)
        s = dnnl_primitive_attr_create(&attr);
    /* C += A B is a matmul with a sum post-op of scale 1. */
    if (s == dnnl_success && key->accumulate)
        s = dnnl_post_ops_create(&post_ops);
    if (s == dnnl_success && key->accumulate)
        s = dnnl_post_ops_append_sum(post_ops, 1.0f);
    if (s == dnnl_success && key->accumulate)
        s = dnnl_primitive_attr_set_post_ops(attr, post_ops);
    if (s == dnnl_success)
        s = dnnl_primitive_desc_create(&pd, &desc, attr, cache->engine, NULL);
    if (s == dnnl_success)
        s = dnnl_primitive_create(&entry->primitive, pd);
    for (int o = 0; o < 3 && s == dnnl_success; o++)
        s = dnnl_memory_create(&entry->memory[o], &md[o], cache->engine, DNNL_MEMORY_NONE);
    if (pd)
        dnnl_primitive_desc_destroy(pd);
    if (post_ops)
        dnnl_post_ops_destroy(post_ops);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    if (s != dnnl_success)
        release(entry);
    else
        entry->key = *key;
    return s;
}

/* The entry for key, built on a miss in the least recently used place; NULL when oneDNN fails (*status says
 * why). */
static cache_entry *lookup(fh_gemm_cache *cache, const gemm_key *key, fh_status *status)
{
    *status = FH_OK;
    cache_entry *victim = &cache->entries[0];
    cache->clock++;
    for (int e = 0; e < CACHE_ENTRIES; e++) {
        cache_entry *entry = &cache->entries[e];
        if (entry->primitive && memcmp(&entry->key, key, sizeof *key) == 0) {
            entry->last_use = cache->clock;
            return entry;
        }
        if (victim->primitive && (!entry->primitive || entry->last_use < victim->last_use))
            victim = entry;
    }
    release(victim);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(key->threads);
    *status = status_of(build(cache, key, victim));
    omp_set_num_threads(saved);
    if (*status != FH_OK)
        return NULL;
    victim->last_use = cache->clock;
    return victim;
}

fh_status fh_onednn_prepare(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                            const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads)
{
    int swap;
    const gemm_key key = key_of(m, n, k, a, b, accumulate, c, threads, &swap);
    fh_status st;
    lookup(cache, &key, &st);
    return st;
}

fh_status fh_onednn_gemm(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                         const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads)
{
    int swap;
    const gemm_key key = key_of(m, n, k, a, b, accumulate, c, threads, &swap);
    fh_status st;
    cache_entry *entry = lookup(cache, &key, &st);
    if (!entry)
        return st;
    /* oneDNN takes non-const handles but does not write A or B. */
    void *const data[3] = {(void *)(swap ? b : a)->data, (void *)(swap ? a : b)->data, c->data};
    dnnl_exec_arg_t exec[3];
    dnnl_status_t s = dnnl_success;
    for (int o = 0; o < 3; o++) {
        if (s == dnnl_success)
            s = dnnl_memory_set_data_handle(entry->memory[o], data[o]);
        exec[o].arg = arguments[o];
        exec[o].memory = entry->memory[o];
    }
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    if (s == dnnl_success)
        s = dnnl_primitive_execute(entry->primitive, cache->stream, 3, exec);
    if (s == dnnl_success)
        s = dnnl_stream_wait(cache->stream);
    omp_set_num_threads(saved);
    return status_of(s);
}

static pthread_once_t description_once = PTHREAD_ONCE_INIT;
static char version[32];
static char implementations[2][64] = {"unavailable", "unavailable"}; /* by fh_elem_type */

/* Builds a small matmul of type's operands to ask oneDNN which implementation this CPU gets. */
static void query(dnnl_engine_t engine, fh_elem_type type)
{
    const char *found = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_memory_desc_t md[3];
    const dnnl_dims_t dims = {64, 64}, strides = {64, 1};
    const dnnl_data_type_t types[3] = {dnnl_type(type), dnnl_type(type), dnnl_f32};
    int ok = 1;
    for (int o = 0; ok && o < 3; o++)
        ok = dnnl_memory_desc_init_by_strides(&md[o], 2, dims, types[o], strides) == dnnl_success;
    dnnl_matmul_desc_t desc;
    ok = ok && dnnl_matmul_desc_init(&desc, &md[0], &md[1], NULL, &md[2]) == dnnl_success &&
         dnnl_primitive_desc_create(&pd, &desc, NULL, engine, NULL) == dnnl_success &&
         dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &found) == dnnl_success;
    if (ok && found)
        snprintf(implementations[type], sizeof implementations[type], "%s", found);
    if (pd)
        dnnl_primitive_desc_destroy(pd);
}

static void describe(void)
{
    const dnnl_version_t *v = dnnl_version();
    snprintf(version, sizeof version, "oneDNN %d.%d.%d", v->major, v->minor, v->patch);
    dnnl_engine_t engine = NULL;
    if (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success)
        return;
    query(engine, FH_ELEM_F32);
    query(engine, FH_ELEM_BF16);
    dnnl_engine_destroy(engine);
}

const char *fh_onednn_version(void)
{
    pthread_once(&description_once, describe);
    return version;
}

const char *fh_onednn_implementation(fh_elem_type type)
{
    pthread_once(&description_once, describe);
    return implementations[type];
}
