# Cross build for aarch64 (ARM64) Linux on a Debian x86-64 machine: Debian's cross compiler (gcc-aarch64-linux-gnu)
# and the arm64 multiarch libraries (dpkg --add-architecture arm64; libblis-dev:arm64, libcunit1-dev:arm64,
# libdnnl2:arm64, ...; scripts/install-deps installs them). Tests run under qemu-user: ctest prefixes every
# test command with CMAKE_CROSSCOMPILING_EMULATOR. docs/aarch64.md has the whole procedure.
#
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
# Debian's multiarch layout: libraries in /usr/lib/aarch64-linux-gnu, arch-specific headers in
# /usr/include/aarch64-linux-gnu, the rest of /usr/include shared by every architecture. No sysroot: the cross
# compiler searches those directories itself.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Libraries only from the arm64 directories: never an x86-64 library that happens to sit in /usr/lib or
# /usr/local/lib.
set(CMAKE_IGNORE_PATH /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/local/lib/x86_64-linux-gnu)

# oneDNN: Debian 12's libdnnl-dev cannot be installed for arm64 beside the amd64 one that the x86 build uses (it is
# marked Multi-Arch: same, yet both ship /usr/include/oneapi/dnnl/dnnl_config.h, which differs in one line,
# DNNL_GPU_RUNTIME: OCL on amd64, NONE on arm64, a macro that no C declaration depends on). So the headers are the
# amd64 package's (the same oneDNN 2.6.3: libdnnl2:arm64 and :amd64 must have one version, and libdnnl-dev requires
# its own), and the library is libdnnl2:arm64's, linked by its full name (only libdnnl-dev has the libdnnl.so link).
if(NOT ONEDNN_LIBRARY AND EXISTS /usr/lib/aarch64-linux-gnu/libdnnl.so.2)
  set(ONEDNN_LIBRARY /usr/lib/aarch64-linux-gnu/libdnnl.so.2 CACHE FILEPATH "oneDNN (libdnnl2:arm64)")
endif()

# Run test programs (ctest, try_run) under qemu-user with the arm64 multiarch libraries: their loader
# /lib/ld-linux-aarch64.so.1 and libc come from libc6:arm64, so no -L prefix is needed (a prefix of
# /usr/aarch64-linux-gnu would pair the cross toolchain's loader with the multiarch libc, two builds of glibc).
find_program(FH_QEMU_AARCH64 qemu-aarch64)
if(FH_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${FH_QEMU_AARCH64})
endif()
