#!/usr/bin/env bash
# CI for the C core on its own, without Python: a CMake build (Release, OpenMP
# required) in a temporary directory, the exported symbols, ctest (the C tests,
# the examples, the fuzz harness on random inputs), the C tests (--quick) under
# valgrind memcheck, and the fuzz harness under ASan + UBSan.
#
#   bash .ci/c_tests.sh            (SDPA_C_BUILD_DIR=dir keeps the build there)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n "${SDPA_C_BUILD_DIR:-}" ]]; then
    BUILD="$SDPA_C_BUILD_DIR"
    mkdir -p "$BUILD"
else
    BUILD="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-cbuild.XXXXXX")"
    trap 'rm -rf "$BUILD"' EXIT
fi
JOBS="$(nproc 2>/dev/null || echo 2)"
# passive waiting: spinning OpenMP threads slow down oversubscribed runs
# (the tests use up to 3 threads) and valgrind, which runs one thread at a time
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

echo "== configure and build ($BUILD)"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSDPA_REQUIRE_OPENMP=ON \
    -DSDPA_BUILD_TESTS=ON -DSDPA_BUILD_EXAMPLES=ON
cmake --build "$BUILD" --parallel "$JOBS"

echo "== exported symbols: exactly the SDPA_API functions of sdpa.h"
LIB="$(find "$BUILD" -maxdepth 1 -name 'libsdpa.so*' -type f | head -n 1)"
if [[ -n "$LIB" ]] && command -v nm >/dev/null; then
    exported="$(nm -D --defined-only "$LIB" | awk '$2 == "T" {print $3}' | sort)"
    declared="$(grep -E '^SDPA_API ' "$ROOT/csrc/include/sdpa.h" |
        sed -E 's/^SDPA_API [^(]*[ *(]\(?([a-z_0-9]+)\)?\(.*/\1/' | sort)"
    if [[ "$exported" != "$declared" ]]; then
        echo "exported symbols differ from the SDPA_API declarations:"
        diff <(echo "$declared") <(echo "$exported") || true
        exit 1
    fi
    echo "$(echo "$exported" | wc -l) symbols, as declared"
else
    echo "skipped (no shared libsdpa.so or no nm)"
fi

echo "== ctest"
(cd "$BUILD" && ctest --output-on-failure)

echo "== examples"
"$BUILD/sdpa_seed_example"
"$BUILD/sdpa_int8_decode"
"$BUILD/sdpa_paged_decode"
"$BUILD/sdpa_sparse_decode"

echo "== valgrind memcheck: sdpa_test_core --quick"
if ! command -v valgrind >/dev/null; then
    . "$ROOT/.ci/apt.sh"
    ci_apt_install valgrind
fi
OMP_NUM_THREADS=2 valgrind --tool=memcheck --error-exitcode=1 --leak-check=full \
    --suppressions="$ROOT/tests/c/valgrind.supp" \
    "$BUILD/sdpa_test_core" --quick

echo "== the C API fuzz harness, random inputs, under ASan + UBSan"
cc -O1 -g -std=c11 -fopenmp -fsanitize=address,undefined -fno-sanitize-recover=all \
    -DSDPA_FUZZ_STANDALONE -I"$ROOT/csrc/include" -I"$ROOT/csrc" \
    "$ROOT/fuzz/fuzz_problem.c" "$ROOT"/csrc/*.c "$ROOT"/csrc/kernels/*.c -lm -o "$BUILD/fuzz_problem_asan"
ASAN_OPTIONS=detect_leaks=1 "$BUILD/fuzz_problem_asan" --runs 4000 --seed 1

echo "== C tests passed"
