/* Allocation-failure injection for fh_hardening_tests.
 *
 * alloc_hook.c defines malloc, calloc, realloc, aligned_alloc, posix_memalign, memalign and free in the test
 * executable. The executable comes first in the dynamic linker's lookup order, so these definitions serve
 * every allocation of the process (libfusedhead, BLIS, libgomp, CUnit, libc). Each one forwards to the
 * next definition in lookup order (dlsym(RTLD_NEXT)): ASan's allocator in the sanitizer build, valgrind's
 * under valgrind, glibc's otherwise, so every checker still sees every block.
 *
 * An allocation is attributed to libfusedhead when its return address lies in one of libfusedhead.so's
 * executable segments (found once with dl_iterate_phdr): a direct call from the library's code, such as
 * the context's calloc and the workspace's aligned_alloc. Allocations made on the library's behalf inside
 * other libraries (BLIS's packing pools, libgomp's thread teams, libc's fopen) are not attributed to it and
 * are never failed in AH_LIBRARY mode, because BLIS aborts on allocation failure by design.
 *
 * Blocks attributed to libfusedhead are recorded until freed, so a test can assert that the library holds
 * nothing after fh_context_destroy (leaks) and that a failed call did not leave half-built state behind. */
#ifndef FH_ALLOC_HOOK_H
#define FH_ALLOC_HOOK_H

#include <stddef.h>

typedef enum ah_mode {
    AH_LIBRARY = 0,     /* count and fail only allocations made directly by libfusedhead's code */
    AH_THIS_THREAD = 1  /* count and fail every allocation made on the arming thread (any caller) */
} ah_mode;

/* Finds libfusedhead's code segments. Returns 0, or -1 when the hooks are not in effect (the executable's
 * malloc is not the one being called) or libfusedhead.so is not loaded; then the tests are skipped. */
int ah_init(void);

/* From now on, the k-th counted allocation (k = 0: the next one) returns NULL with errno ENOMEM; the ones
 * before it and after it succeed. k < 0 disarms. Resets the counters below. */
void ah_arm(long k, ah_mode mode);
void ah_disarm(void);

/* Counted allocations since the last ah_arm/ah_reset (failed ones included), and failures injected. */
long ah_counted(void);
long ah_failures(void);
void ah_reset(ah_mode mode);

/* Blocks allocated by libfusedhead (whatever the mode) and not yet freed. */
long ah_live_library_blocks(void);
size_t ah_live_library_bytes(void);
/* The most bytes libfusedhead held at once since the last ah_reset_peak (which starts it at what it holds now). */
void ah_reset_peak(void);
size_t ah_peak_library_bytes(void);

#endif
