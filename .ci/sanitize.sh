#!/usr/bin/env bash
# Builds sdpa with AddressSanitizer + UndefinedBehaviorSanitizer into a fresh
# virtual environment and runs the test suite (tests/) under it, once, its isa
# fixture going through every kernel set this CPU supports (or once per set
# named in SDPA_SANITIZE_ISAS, each forced with SDPA_ISA).
#
#   bash .ci/sanitize.sh [SOURCE_TREE]
#
# SOURCE_TREE defaults to the repository that holds this script.  It is copied
# first, so that no object file of an earlier, unsanitized build can be reused.
# Under SDPA_ISA the tests' `isa` fixture runs the forced set alone, and every
# other test runs on it too.
# Any sanitizer report aborts the process that hit it and fails the run; the
# reports (with file:line stacks) are printed at the end of each kernel set.
#
# Environment:
#   SDPA_SANITIZE_VENV   where to create the virtual environment (default: a new
#                        temporary directory, removed at the end)
#   SDPA_SANITIZE_ISAS   kernel sets to force, one run each (default: "every", one
#                        run with no set forced)
#   PYTEST_ADDOPTS       extra pytest options, as usual
#
# Needs gcc with its ASan and UBSan runtimes (libasan, libubsan) and access to
# PyPI for the pinned versions in .ci/requirements-sanitize.txt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "${1:-$here/..}" && pwd)"
start=$SECONDS

work="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-sanitize.XXXXXX")"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# ---- a clean copy of the sources -------------------------------------------------
tree="$work/src"
mkdir -p "$tree"
if git -C "$src" rev-parse --show-toplevel >/dev/null 2>&1 &&
    [ "$(git -C "$src" rev-parse --show-toplevel)" = "$src" ]; then
    # tracked and untracked-but-not-ignored files: no build/, no *.so, no _core.c
    (cd "$src" && git ls-files -co --exclude-standard -z | tar cf - --null -T -) | tar xf - -C "$tree"
else
    tar cf - -C "$src" --exclude=build --exclude='*.so' --exclude='*.o' \
        --exclude=src/sdpa/_core.c --exclude='.venv*' --exclude=.git . | tar xf - -C "$tree"
fi

# ---- the sanitizer runtimes ------------------------------------------------------
CC="${CC:-gcc}"
export CC
libasan="$("$CC" -print-file-name=libasan.so)"
libubsan="$("$CC" -print-file-name=libubsan.so)"
if [ ! -e "$libasan" ]; then
    echo "sanitize: $CC has no libasan.so (got '$libasan'); install the ASan runtime" >&2
    exit 2
fi
preload="$(readlink -f "$libasan")"
if [ -e "$libubsan" ]; then
    preload="$preload:$(readlink -f "$libubsan")"
fi

# ---- the virtual environment and the sanitized build ------------------------------
venv="${SDPA_SANITIZE_VENV:-$work/venv}"
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -r "$here/requirements-sanitize.txt"

san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
echo "sanitize: building $src with: $san"
# setup.py's OpenMP probe compiles with CFLAGS but links its test program with the
# bare compiler driver (no LDFLAGS), so the driver itself carries -fsanitize; the
# probe program then runs under ASan, without leak checking.
(
    cd "$tree"
    CC="$CC -fsanitize=address,undefined" CFLAGS="$san" LDFLAGS="-fsanitize=address,undefined" \
        ASAN_OPTIONS=detect_leaks=0 SDPA_REQUIRE_OPENMP=1 \
        "$py" -m pip install -q --no-build-isolation --no-cache-dir --no-deps .
)

# the extension must really carry the instrumentation
pkg="$(cd "$work" && "$py" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("sdpa").origin))')"
so="$(ls "$pkg"/_core*.so | head -n 1)"
# (nm's output is captured first: with pipefail, grep -q closing the pipe early
# would make nm fail with SIGPIPE and the check fail at random)
symbols="$(nm -D "$so")"
if ! grep -q '__asan_report\|__ubsan_handle' <<<"$symbols"; then
    echo "sanitize: $so is not instrumented" >&2
    exit 1
fi

# ---- the tests, once per kernel set ----------------------------------------------
# Reports go to files: pytest captures file descriptor 2 and would lose a report
# written there by a process that is then aborted.
logs="$work/reports"
mkdir -p "$logs"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$logs/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
export SDPA_REQUIRE_OPENMP=1
run_py() { (cd "$work" && LD_PRELOAD="$preload" "$py" "$@"); }

# by default one run in which the tests' isa fixture goes through every kernel set
# the CPU supports ("every"): one run per set took 10-17 minutes each on a 2-core
# Xeon with five sets, past CI's time
isas="${SDPA_SANITIZE_ISAS:-every}"
echo "sanitize: kernel sets: $isas"
run_py -c "import sdpa; sdpa.show_config()"

status=0
for isa in $isas; do
    t0=$SECONDS
    echo "sanitize: ---- SDPA_ISA=$isa ----"
    if [ "$isa" = every ]; then
        # no SDPA_ISA: the isa fixture runs each set, the other tests the CPU's choice;
        # run from outside the tree, so the installed (sanitized) package is imported
        if run_py -m pytest "$tree/tests" -q -p no:cacheprovider; then ok=0; else ok=1; fi
    else
        got="$(SDPA_ISA="$isa" run_py -c "import sdpa; print(sdpa.config()['isa'])")"
        if [ "$got" != "$isa" ]; then
            echo "sanitize: SDPA_ISA=$isa selected '$got'" >&2
            status=1
            continue
        fi
        if SDPA_ISA="$isa" run_py -m pytest "$tree/tests" -q -p no:cacheprovider; then ok=0; else ok=1; fi
    fi
    if [ "$ok" -ne 0 ]; then
        echo "sanitize: SDPA_ISA=$isa: FAILED" >&2
        status=1
    fi
    # any report fails the run, also one from a subprocess whose exit a test let pass
    if [ -n "$(ls -A "$logs")" ]; then
        for report in "$logs"/*; do
            echo "sanitize: ---- $(basename "$report") (SDPA_ISA=$isa) ----" >&2
            cat "$report" >&2
        done
        rm -f "$logs"/*
        status=1
    fi
    echo "sanitize: SDPA_ISA=$isa took $((SECONDS - t0)) s"
done

echo "sanitize: total $((SECONDS - start)) s"
exit $status
