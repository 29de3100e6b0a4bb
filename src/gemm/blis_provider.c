/* Debian's BLIS 0.9.0 does not recognise recent AMD CPUs (family 0x1A) and silently uses its generic
 * kernels, about 5x slower than its skx kernels on the same AVX-512 hardware. BLIS reads
 * BLIS_ARCH_TYPE (an integer arch_t id in 0.9.0) once, when it initialises, and its per-configuration
 * context functions are not exported; so the only way to choose is to set that variable before BLIS
 * initialises. We do it when the library is loaded (and again, idempotently, before any BLIS call of
 * ours), and never when the user has set BLIS_ARCH_TYPE. On other architectures (aarch64) BLIS's own
 * choice stands. */
#include "blis_provider.h"

#include <blis.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static pthread_once_t selection_once = PTHREAD_ONCE_INIT;
static int user_override;
static int library_choice = -1; /* arch_t id we asked for, or -1 */

static int cpu_has_skx_features(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

static void select_kernels(void)
{
    if (getenv("BLIS_ARCH_TYPE")) {
        user_override = 1;
        return;
    }
    if (cpu_has_skx_features()) {
        char id[16];
        snprintf(id, sizeof id, "%d", (int)BLIS_ARCH_SKX);
        if (setenv("BLIS_ARCH_TYPE", id, 0) == 0)
            library_choice = BLIS_ARCH_SKX;
    }
}

static void ensure_selected(void)
{
    pthread_once(&selection_once, select_kernels);
}

__attribute__((constructor)) static void select_at_load(void)
{
    ensure_selected();
}

void fh_blis_kernel_set(fh_kernel_info *info)
{
    ensure_selected();
    /* bli_arch_query_id() before initialisation aborts inside BLIS when BLIS_ARCH_TYPE is set. */
    bli_init();
    const arch_t id = bli_arch_query_id();
    info->kernel_set = bli_arch_string(id);
    info->selected_by_library = library_choice >= 0 && (int)id == library_choice;
    info->user_override = user_override;
}

void fh_blis_sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc, int threads)
{
    ensure_selected();
    float one = 1.0f;
    rntm_t rntm = BLIS_RNTM_INITIALIZER;
    bli_rntm_set_num_threads(threads, &rntm);
    /* BLIS's small-matrix ("sup") path reads operands in place, and its haswell kernels read past the end
     * of some strided views (a guard page after a [V, H] weight faults). The packed path stays in bounds,
     * and our tiles are large enough that sup would not be chosen for speed anyway. */
    bli_rntm_disable_l3_sup(&rntm);
    /* BLIS takes non-const operands but does not write A or B. */
    bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &one, (float *)a, rsa, csa, (float *)b, rsb,
                 csb, &beta, c, rsc, csc, NULL, &rntm);
}
