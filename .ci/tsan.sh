#!/usr/bin/env bash
# Builds sdpa with ThreadSanitizer into a fresh virtual environment and runs the
# test suite under it.  GCC's libgomp hides its synchronisation from TSan, which
# then reports every OpenMP barrier as a race; so the extension is compiled by
# gcc (-fopenmp, the GOMP interface) but linked against LLVM's libomp, which
# implements that interface and, with its Archer tool (libarcher.so, loaded
# through OMP_TOOL_LIBRARIES), tells TSan about its barriers.  Only sdpa's own
# code is instrumented; reports from uninstrumented modules are ignored.
#
#   bash .ci/tsan.sh [SOURCE_TREE]
#
# Needs gcc's libtsan and LLVM's libomp with Archer (Debian: libomp-14-dev,
# installed here when missing and running as root).  About 4 minutes on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "${1:-$here/..}" && pwd)"
start=$SECONDS

llvm_lib="${SDPA_LLVM_LIB:-$(ls -d /usr/lib/llvm-*/lib 2>/dev/null | sort -V | tail -n 1)}"
if [[ -z "$llvm_lib" || ! -e "$llvm_lib/libarcher.so" ]]; then
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
        . "$here/apt.sh"
        ci_apt_install libomp-14-dev
        llvm_lib=/usr/lib/llvm-14/lib
    else
        echo "tsan: needs LLVM's libomp with libarcher.so (Debian: libomp-14-dev)" >&2
        exit 2
    fi
fi
libtsan="$(gcc -print-file-name=libtsan.so)"

work="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-tsan.XXXXXX")"
trap 'rm -rf "$work"' EXIT
tree="$work/src"
mkdir -p "$tree"
(cd "$src" && git ls-files -co --exclude-standard -z | tar cf - --null -T -) | tar xf - -C "$tree"

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -r "$here/requirements-sanitize.txt"

export OMP_TOOL_LIBRARIES="$llvm_lib/libarcher.so"
reports="$work/reports"
mkdir -p "$reports"
# the OpenMP probe in setup.py runs under TSan too: no reports into the log dir yet
export TSAN_OPTIONS="ignore_noninstrumented_modules=1"
(
    cd "$tree"
    CC=gcc CFLAGS="-fsanitize=thread -g -O1" LDFLAGS="-fsanitize=thread" \
        SDPA_OPENMP_CFLAGS="-fopenmp" \
        SDPA_OPENMP_LDFLAGS="-L$llvm_lib -Wl,-rpath,$llvm_lib -lomp" SDPA_REQUIRE_OPENMP=1 \
        "$py" -m pip install -q --no-build-isolation --no-cache-dir --no-deps .
)
export TSAN_OPTIONS="ignore_noninstrumented_modules=1:halt_on_error=0:log_path=$reports/tsan"
status=0
(cd "$work" && LD_PRELOAD="$libtsan" "$py" -c "import sdpa; sdpa.show_config()")
if ! (cd "$work" && LD_PRELOAD="$libtsan" "$py" -m pytest "$tree/tests" -q -p no:cacheprovider); then
    echo "tsan: the tests FAILED" >&2
    status=1
fi
if [[ -n "$(ls -A "$reports")" ]]; then
    for report in "$reports"/*; do
        echo "tsan: ---- $(basename "$report") ----" >&2
        cat "$report" >&2
    done
    status=1
fi
echo "tsan: total $((SECONDS - start)) s"
exit $status
