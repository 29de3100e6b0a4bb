/* The CPUs this process may use. Threads beyond them do not add speed; with BLIS's spinning barriers they take it
 * away (on 2 cores a train step ran 4 times slower at 3 threads and 28 times at 16), so fh_threads clamps to this. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "cpus.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <unistd.h>

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int available = 1;

/* ceil(quota / period), or 0 without a quota: cgroup v2's "cpu.max" ("max 100000" or "200000 100000"), else
 * cgroup v1's cfs files. Only the process's own cgroup at the usual mount point is read, which is what a
 * container sees. */
static int quota_cpus(void)
{
    long long quota = -1, period = 0;
    FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (f) {
        if (fscanf(f, "%lld %lld", &quota, &period) != 2)
            quota = -1;
        fclose(f);
    } else {
        f = fopen("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "r");
        if (f) {
            if (fscanf(f, "%lld", &quota) != 1)
                quota = -1;
            fclose(f);
        }
        f = fopen("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "r");
        if (f) {
            if (fscanf(f, "%lld", &period) != 1)
                period = 0;
            fclose(f);
        }
    }
    if (quota <= 0 || period <= 0)
        return 0;
    return (int)((quota + period - 1) / period);
}

static void count(void)
{
    cpu_set_t set;
    long cpus = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        cpus = CPU_COUNT(&set);
    if (cpus <= 0)
        cpus = sysconf(_SC_NPROCESSORS_ONLN);
    const int quota = quota_cpus();
    if (quota > 0 && quota < cpus)
        cpus = quota;
    available = cpus > 0 ? (int)cpus : 1;
}

int fh_cpus_available(void)
{
    pthread_once(&once, count);
    return available;
}
