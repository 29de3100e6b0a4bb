/* GCC's x86 CPU builtins, for a build on another architecture (force-included into fh_tests' sources by
 * CMakeLists.txt off x86-64, for tests/test_kernel_choice.c and tests/hardening/test_guard_pages.c): GCC 12 has them on
 * x86 only. Every x86 feature and
 * vendor they can name is absent from an aarch64 CPU, which is what they answer here. */
#if defined(__x86_64__) || defined(__i386__)
#error "x86 has these builtins: this header is for other architectures only"
#endif
#define __builtin_cpu_init() ((void)0)
#define __builtin_cpu_supports(feature) ((void)(feature), 0)
#define __builtin_cpu_is(name) ((void)(name), 0)
