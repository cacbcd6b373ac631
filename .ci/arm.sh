#!/usr/bin/env bash
# The Arm kernels on an x86-64 machine: libsdpa, its C tests, fuzz harness and
# examples cross-compiled for aarch64 (cmake/aarch64-linux-gnu.cmake) and run
# under QEMU's user-mode emulator:
#   - ctest on an emulated CPU with every extension (-cpu max): the quick C
#     tests on every kernel set (scalar, neon, neon_bf16) in one run and on
#     each set alone (forced by SDPA_ISA), the fuzz harness, the examples;
#   - the default choice on CPUs with fewer extensions: neon_bf16 on "max",
#     neon on a Neoverse N1 (DotProd, no BF16) and on a Cortex-A57 (neither),
#     where SDPA_ISA=neon_bf16 is refused; the quick C tests on the Cortex-A57
#     (the neon set with integer_qk's portable kernel).
# The C tests include FPCR.FZ set by the caller and honoured on every worker
# thread (test_fp_mode), bitwise thread-count independence, NaN and subnormal
# inputs, on each set.
# Installs the cross compiler, the target's C library dev files and OpenMP, and
# QEMU when missing (apt).
#
#   bash .ci/arm.sh            (SDPA_ARM_BUILD_DIR=dir keeps the build there)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS

need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
[[ -e /usr/aarch64-linux-gnu/lib/libgomp.so.1 ]] || need+=(libgomp1-arm64-cross)
# the C library's dev files: startup objects and libc.so for linking (without
# them the compiler runs but cannot link: "cannot find Scrt1.o / crti.o")
[[ -e /usr/aarch64-linux-gnu/lib/crti.o && -e /usr/aarch64-linux-gnu/lib/Scrt1.o &&
   -e /usr/aarch64-linux-gnu/lib/libc.so ]] || need+=(libc6-dev-arm64-cross)
if ((${#need[@]})); then
    echo "== installing ${need[*]}"
    . "$ROOT/.ci/apt.sh"
    ci_apt_install "${need[@]}"
fi

if [[ -n "${SDPA_ARM_BUILD_DIR:-}" ]]; then
    BUILD="$SDPA_ARM_BUILD_DIR"
    mkdir -p "$BUILD"
else
    BUILD="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-armbuild.XXXXXX")"
    trap 'rm -rf "$BUILD"' EXIT
fi
JOBS="$(nproc 2>/dev/null || echo 2)"
export OMP_WAIT_POLICY=passive
QEMU=(qemu-aarch64-static -L /usr/aarch64-linux-gnu)

echo "== cross-compile for aarch64 ($BUILD)"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_TOOLCHAIN_FILE="$ROOT/cmake/aarch64-linux-gnu.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DSDPA_REQUIRE_OPENMP=ON -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$BUILD" --parallel "$JOBS" >/dev/null
aarch64-linux-gnu-readelf -h "$BUILD/sdpa_test_core" | grep -q AArch64 || { echo "not an aarch64 build"; exit 1; }

echo "== ctest under qemu -cpu max (every set; each set alone; fuzz harness; examples)"
# c_core, the long sweep, is left to Arm hardware: it takes tens of minutes emulated
(cd "$BUILD" && ctest --output-on-failure -E '^c_core$')

echo "== the default kernel set on three emulated CPUs"
default_isa() {  # the set the seed example reports ("sdpa X, kernels: neon"), which it checks
    "${QEMU[@]}" -cpu "$1" "$BUILD/sdpa_seed_example" | sed -n 's/^sdpa .*, kernels: \([a-z0-9_]*\)$/\1/p'
}
check_isa() {
    local got
    got="$(default_isa "$1")"
    echo "$1: $got"
    [[ "$got" == "$2" ]] || { echo "expected $2 on $1"; exit 1; }
}
check_isa max neon_bf16
check_isa neoverse-n1 neon
check_isa cortex-a57 neon

echo "== the quick C tests on a Cortex-A57 (neon, portable integer_qk)"
"${QEMU[@]}" -cpu cortex-a57 "$BUILD/sdpa_test_core" --quick | tail -n 1

echo "== SDPA_ISA=neon_bf16 on a CPU without BF16 is refused"
if SDPA_ISA=neon_bf16 "${QEMU[@]}" -cpu cortex-a57 "$BUILD/sdpa_seed_example" >/dev/null 2>&1; then
    echo "SDPA_ISA=neon_bf16 ran on a Cortex-A57"
    exit 1
fi
echo "refused"

echo "== Arm done in $((SECONDS - start)) s"
