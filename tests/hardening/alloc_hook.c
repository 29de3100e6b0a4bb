/* Allocation interposer with failure injection: see alloc_hook.h. */
#include "alloc_hook.h"

#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* ---- the next allocator in lookup order ---------------------------------------------------- */

typedef void *(*malloc_fn)(size_t);
typedef void *(*calloc_fn)(size_t, size_t);
typedef void *(*realloc_fn)(void *, size_t);
typedef void *(*aligned_fn)(size_t, size_t);
typedef int (*posix_memalign_fn)(void **, size_t, size_t);
typedef void (*free_fn)(void *);

static calloc_fn real_calloc;
static realloc_fn real_realloc;
static aligned_fn real_aligned_alloc, real_memalign;
static posix_memalign_fn real_posix_memalign;
static free_fn real_free;
static _Atomic(malloc_fn) real_malloc; /* stored last: once set, every other pointer is too */

/* dlsym may allocate while the pointers are being resolved: those requests are served from here and
 * never freed. */
static _Alignas(64) unsigned char bootstrap[1 << 16];
static atomic_size_t bootstrap_used;
static __thread int resolving;

static void *bootstrap_alloc(size_t bytes, size_t align)
{
    if (align < 16)
        align = 16;
    for (;;) {
        size_t used = atomic_load(&bootstrap_used);
        const size_t start = (used + align - 1) / align * align;
        if (start + bytes > sizeof bootstrap || start + bytes < start)
            return NULL;
        if (atomic_compare_exchange_weak(&bootstrap_used, &used, start + bytes))
            return bootstrap + start;
    }
}

static int in_bootstrap(const void *p)
{
    return (const unsigned char *)p >= bootstrap && (const unsigned char *)p < bootstrap + sizeof bootstrap;
}

static void resolve(void)
{
    if (atomic_load_explicit(&real_malloc, memory_order_acquire))
        return;
    resolving = 1;
    real_calloc = (calloc_fn)dlsym(RTLD_NEXT, "calloc");
    real_realloc = (realloc_fn)dlsym(RTLD_NEXT, "realloc");
    real_aligned_alloc = (aligned_fn)dlsym(RTLD_NEXT, "aligned_alloc");
    real_memalign = (aligned_fn)dlsym(RTLD_NEXT, "memalign");
    real_posix_memalign = (posix_memalign_fn)dlsym(RTLD_NEXT, "posix_memalign");
    real_free = (free_fn)dlsym(RTLD_NEXT, "free");
    const malloc_fn m = (malloc_fn)dlsym(RTLD_NEXT, "malloc");
    resolving = 0;
    atomic_store_explicit(&real_malloc, m, memory_order_release);
}

/* ---- attribution, counting, injection ------------------------------------------------------ */

enum { MAX_SEGMENTS = 8, MAX_RECORDS = 4096 };
static uintptr_t segment_begin[MAX_SEGMENTS], segment_end[MAX_SEGMENTS];
static int segment_count;
static atomic_int hook_seen;

static atomic_int mode = AH_LIBRARY;
static atomic_long fail_at = -1, counted, failures;
static __thread int armed_thread; /* AH_THIS_THREAD counts only on the thread that called ah_arm/ah_reset */

static pthread_mutex_t records_lock = PTHREAD_MUTEX_INITIALIZER;
static void *record_ptr[MAX_RECORDS];
static size_t record_size[MAX_RECORDS];
static atomic_long live_blocks;
static size_t live_bytes, peak_bytes; /* under records_lock */

static int from_library(const void *caller)
{
    const uintptr_t a = (uintptr_t)caller;
    for (int s = 0; s < segment_count; s++)
        if (a >= segment_begin[s] && a < segment_end[s])
            return 1;
    return 0;
}

/* 1 when this allocation must fail. */
static int counts_and_fails(int library)
{
    const int m = atomic_load(&mode);
    if (!(m == AH_LIBRARY ? library : armed_thread))
        return 0;
    const long index = atomic_fetch_add(&counted, 1);
    if (index == atomic_load(&fail_at)) {
        atomic_fetch_add(&failures, 1);
        return 1;
    }
    return 0;
}

static void record(void *p, size_t bytes)
{
    pthread_mutex_lock(&records_lock);
    for (int k = 0; k < MAX_RECORDS; k++)
        if (!record_ptr[k]) {
            record_ptr[k] = p;
            record_size[k] = bytes;
            atomic_fetch_add(&live_blocks, 1);
            live_bytes += bytes;
            peak_bytes = live_bytes > peak_bytes ? live_bytes : peak_bytes;
            break;
        }
    pthread_mutex_unlock(&records_lock);
}

static void forget(void *p)
{
    if (!p || atomic_load(&live_blocks) == 0)
        return;
    pthread_mutex_lock(&records_lock);
    for (int k = 0; k < MAX_RECORDS; k++)
        if (record_ptr[k] == p) {
            live_bytes -= record_size[k];
            record_ptr[k] = NULL;
            record_size[k] = 0;
            atomic_fetch_sub(&live_blocks, 1);
            break;
        }
    pthread_mutex_unlock(&records_lock);
}

/* Common path of every allocating entry point. */
#define ALLOCATE(caller, bytes, expr)                                                                          \
    do {                                                                                                       \
        atomic_store_explicit(&hook_seen, 1, memory_order_relaxed);                                            \
        const int library_ = from_library(caller);                                                             \
        if (counts_and_fails(library_)) {                                                                      \
            errno = ENOMEM;                                                                                    \
            return NULL;                                                                                       \
        }                                                                                                      \
        void *p_ = (expr);                                                                                     \
        if (p_ && library_)                                                                                    \
            record(p_, (bytes));                                                                               \
        return p_;                                                                                             \
    } while (0)

__attribute__((noinline)) void *malloc(size_t bytes)
{
    if (resolving)
        return bootstrap_alloc(bytes, 16);
    resolve();
    ALLOCATE(__builtin_return_address(0), bytes, atomic_load(&real_malloc)(bytes));
}

__attribute__((noinline)) void *calloc(size_t count, size_t size)
{
    if (resolving) {
        void *p = count && size > SIZE_MAX / count ? NULL : bootstrap_alloc(count * size, 16);
        return p; /* static storage: already zero */
    }
    resolve();
    ALLOCATE(__builtin_return_address(0), count * size, real_calloc(count, size));
}

__attribute__((noinline)) void *aligned_alloc(size_t align, size_t bytes)
{
    if (resolving)
        return bootstrap_alloc(bytes, align);
    resolve();
    ALLOCATE(__builtin_return_address(0), bytes, real_aligned_alloc(align, bytes));
}

__attribute__((noinline)) void *memalign(size_t align, size_t bytes)
{
    if (resolving)
        return bootstrap_alloc(bytes, align);
    resolve();
    ALLOCATE(__builtin_return_address(0), bytes, real_memalign(align, bytes));
}

__attribute__((noinline)) int posix_memalign(void **out, size_t align, size_t bytes)
{
    if (resolving) {
        void *p = bootstrap_alloc(bytes, align);
        if (!p)
            return ENOMEM;
        *out = p;
        return 0;
    }
    resolve();
    atomic_store_explicit(&hook_seen, 1, memory_order_relaxed);
    const int library = from_library(__builtin_return_address(0));
    if (counts_and_fails(library))
        return ENOMEM;
    const int rc = real_posix_memalign(out, align, bytes);
    if (rc == 0 && library)
        record(*out, bytes);
    return rc;
}

__attribute__((noinline)) void *realloc(void *old, size_t bytes)
{
    if (resolving || in_bootstrap(old)) {
        void *p = resolving ? bootstrap_alloc(bytes, 16) : malloc(bytes);
        if (p && old) {
            const size_t room = (size_t)(bootstrap + sizeof bootstrap - (unsigned char *)old);
            memcpy(p, old, bytes < room ? bytes : room);
        }
        return p;
    }
    resolve();
    atomic_store_explicit(&hook_seen, 1, memory_order_relaxed);
    const int library = from_library(__builtin_return_address(0));
    if (bytes > 0 && counts_and_fails(library)) {
        errno = ENOMEM;
        return NULL; /* the old block stays valid, as realloc promises */
    }
    void *p = real_realloc(old, bytes);
    if (p || bytes == 0)
        forget(old);
    if (p && library)
        record(p, bytes);
    return p;
}

__attribute__((noinline)) void free(void *p)
{
    if (!p || in_bootstrap(p))
        return;
    resolve();
    forget(p);
    real_free(p);
}

/* ---- control ------------------------------------------------------------------------------- */

static int find_library(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    (void)data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libfusedhead.so"))
        return 0;
    for (int k = 0; k < info->dlpi_phnum && segment_count < MAX_SEGMENTS; k++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[k];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
            segment_begin[segment_count] = info->dlpi_addr + ph->p_vaddr;
            segment_end[segment_count] = info->dlpi_addr + ph->p_vaddr + ph->p_memsz;
            segment_count++;
        }
    }
    return 1;
}

int ah_init(void)
{
    if (segment_count == 0)
        dl_iterate_phdr(find_library, NULL);
    void *(*volatile allocate)(size_t) = malloc;
    void *p = allocate(1);
    free(p);
    return segment_count > 0 && atomic_load(&hook_seen) ? 0 : -1;
}

void ah_reset(ah_mode m)
{
    atomic_store(&fail_at, -1);
    atomic_store(&mode, (int)m);
    armed_thread = 1;
    atomic_store(&counted, 0);
    atomic_store(&failures, 0);
}

void ah_arm(long k, ah_mode m)
{
    ah_reset(m);
    atomic_store(&fail_at, k);
}

void ah_disarm(void)
{
    atomic_store(&fail_at, -1);
    armed_thread = 0;
    atomic_store(&mode, AH_LIBRARY);
}

long ah_counted(void)
{
    return atomic_load(&counted);
}

long ah_failures(void)
{
    return atomic_load(&failures);
}

long ah_live_library_blocks(void)
{
    return atomic_load(&live_blocks);
}

size_t ah_live_library_bytes(void)
{
    size_t total = 0;
    pthread_mutex_lock(&records_lock);
    for (int k = 0; k < MAX_RECORDS; k++)
        total += record_size[k];
    pthread_mutex_unlock(&records_lock);
    return total;
}

void ah_reset_peak(void)
{
    pthread_mutex_lock(&records_lock);
    peak_bytes = live_bytes;
    pthread_mutex_unlock(&records_lock);
}

size_t ah_peak_library_bytes(void)
{
    pthread_mutex_lock(&records_lock);
    const size_t peak = peak_bytes;
    pthread_mutex_unlock(&records_lock);
    return peak;
}
