#!/usr/bin/env bash
# Instructions per attention score of the Arm kernel sets, counted under QEMU's
# user-mode emulator (no Arm machine needed): each instruction executed is one
# line of QEMU's trace (-singlestep -d exec,nochain), counted as it streams by.
# One call's count is (3 calls - 1 call) / 2, so that process start, the
# kernel tables and the thread pool are left out.  One thread.  Counts, not
# times: the speed of an Arm core needs an Arm machine.
#
#   bash benchmarks/arm/icount.sh [CASE ...]     (default: every case)
# Needs gcc-aarch64-linux-gnu, libgomp1-arm64-cross and qemu-user-static.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-icount.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
CASES=("$@")
((${#CASES[@]})) || CASES=(decode-f32 decode-bf16-cache decode-int8 decode-int8-iqk decode-int4-iqk decode-int4 decode-e4m3 decode-e5m2 prefill-f32 prefill-bf16 prefill-f64)
SETS=(scalar neon neon_bf16)

# the library's own flags (setup.py, CMakeLists.txt)
aarch64-linux-gnu-gcc -O3 -std=c11 -fno-math-errno -fopenmp -I"$ROOT/csrc/include" -I"$ROOT/csrc" \
    "$ROOT/benchmarks/arm/icount.c" "$ROOT"/csrc/*.c "$ROOT"/csrc/kernels/*.c -lm -o "$TMP/icount"

count() {  # instructions executed by `icount SET CASE REPEAT`
    local fifo="$TMP/trace"
    rm -f "$fifo" && mkfifo "$fifo"
    grep -c '^Trace' <"$fifo" >"$TMP/n" &
    OMP_NUM_THREADS=1 qemu-aarch64-static -cpu max -L /usr/aarch64-linux-gnu -singlestep -d exec,nochain -D "$fifo" \
        "$TMP/icount" "$1" "$2" "$3" >"$TMP/out"
    wait
    cat "$TMP/n"
}

printf '| case | scores a call |'
for s in "${SETS[@]}"; do printf ' %s |' "$s"; done
printf ' scalar / neon | scalar / neon_bf16 |\n| --- | ---: |'
for _ in "${SETS[@]}"; do printf ' ---: |'; done
printf ' ---: | ---: |\n'
for c in "${CASES[@]}"; do
    declare -A per=()
    scores=""
    for s in "${SETS[@]}"; do
        one="$(count "$s" "$c" 1)"
        three="$(count "$s" "$c" 3)"
        scores="$(sed -n 's/.*: \([0-9]*\) scores a call/\1/p' "$TMP/out")"
        per[$s]="$(python3 -c "print(f'{($three - $one) / 2 / $scores:.1f}')")"
    done
    printf '| %s | %s |' "$c" "$scores"
    for s in "${SETS[@]}"; do printf ' %s |' "${per[$s]}"; done
    python3 -c "a, b, c = ${per[scalar]}, ${per[neon]}, ${per[neon_bf16]}; print(f' {a / b:.2f}x | {a / c:.2f}x |')"
    unset per
done
