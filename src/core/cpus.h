/* The CPUs this process may use: its affinity mask, lowered to a cgroup CPU quota where one is set. */
#ifndef FH_CPUS_H
#define FH_CPUS_H

/* At least 1; read once per process. */
int fh_cpus_available(void);

#endif
