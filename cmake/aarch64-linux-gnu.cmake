# Cross-compiles libsdpa, its C tests, fuzz harness and examples for 64-bit Arm
# Linux with Debian's cross compiler, and runs them under QEMU's user-mode
# emulator, so that plain `ctest` tests the Arm kernels on an x86-64 machine:
#
#   apt-get install gcc-aarch64-linux-gnu libgomp1-arm64-cross qemu-user-static
#   cmake -S . -B build-arm -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
#   cmake --build build-arm --parallel
#   (cd build-arm && ctest --output-on-failure)
#
# SDPA_QEMU_CPU picks the emulated CPU: "max" (the default) has every
# extension QEMU knows (FEAT_BF16, FEAT_DotProd, FEAT_I8MM, SVE), so every
# kernel set runs; "cortex-a57" has none (the neon set alone); "neoverse-n1"
# has DotProd and no BF16.  On an Arm machine, leave this file out.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(SDPA_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "Prefix of the cross tools (gcc, ar, ...)")
set(CMAKE_C_COMPILER "${SDPA_CROSS_PREFIX}gcc")
set(SDPA_CROSS_SYSROOT "/usr/aarch64-linux-gnu" CACHE PATH "The target's libraries (libc, libgomp), for QEMU's -L")

# the target's own files first; the build machine's programs
set(CMAKE_FIND_ROOT_PATH "${SDPA_CROSS_SYSROOT}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

set(SDPA_QEMU_CPU "max" CACHE STRING "The CPU QEMU emulates for the tests (qemu-aarch64-static -cpu help)")
find_program(SDPA_QEMU_AARCH64 NAMES qemu-aarch64-static qemu-aarch64)
if(SDPA_QEMU_AARCH64)
    set(CMAKE_CROSSCOMPILING_EMULATOR "${SDPA_QEMU_AARCH64};-cpu;${SDPA_QEMU_CPU};-L;${SDPA_CROSS_SYSROOT}")
endif()

# the C tests also run once per kernel set, forced by SDPA_ISA (c_core_quick_<set>)
set(SDPA_TEST_ISAS "scalar;neon;neon_bf16" CACHE STRING "Kernel sets the C tests run on alone, one test each")
