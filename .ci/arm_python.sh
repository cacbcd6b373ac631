#!/usr/bin/env bash
# A smoke test of the Python package on aarch64, under QEMU: Debian's arm64
# CPython 3.11 and NumPy (their .deb files unpacked into a directory, nothing
# installed), sdpa._core cross-compiled for them from the same sources as
# setup.py's, then a script (tests/arm_smoke.py) that imports sdpa, shows its
# configuration and checks attention against the float64 reference on each
# kernel set.  Adds the arm64 architecture to dpkg to fetch the packages.
#
#   bash .ci/arm_python.sh        (SDPA_ARM_PY_DIR=dir keeps the files there)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS
if [[ -n "${SDPA_ARM_PY_DIR:-}" ]]; then
    WORK="$SDPA_ARM_PY_DIR"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-armpy.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
fi

echo "== Debian's arm64 CPython and NumPy, unpacked into $WORK/root"
. "$ROOT/.ci/apt.sh"
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    ci_locked dpkg --add-architecture arm64
    ci_apt update -qq
fi
mkdir -p "$WORK/debs" "$WORK/root"
roots=(python3.11-minimal:arm64 libpython3.11-stdlib:arm64 libpython3.11-dev:arm64 python3-numpy:arm64)
# their libraries, recursively: not the tools, development files or other BLAS
# builds (the reference BLAS and LAPACK are linked below as the alternatives would)
pkgs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
        --no-enhances --no-pre-depends "${roots[@]}" 2>/dev/null | grep -E '^[a-z0-9].*:arm64$' | sort -u |
    grep -v -E '^(dpkg|tar|install-info|libatlas3-base|libblis4|libopenblas0|python3:|python3\.11:|libc-dev-bin|linux-libc-dev|libc6-dev|libcrypt-dev|libnsl-dev|libtirpc-dev|rpcsvc-proto|libexpat1-dev|zlib1g-dev)')
(cd "$WORK/debs" && ci_apt download $pkgs >/dev/null 2>&1)
for d in "$WORK"/debs/*.deb; do dpkg -x "$d" "$WORK/root"; done
LIBDIR="$WORK/root/usr/lib/aarch64-linux-gnu"
ln -sf blas/libblas.so.3 "$LIBDIR/libblas.so.3"
ln -sf lapack/liblapack.so.3 "$LIBDIR/liblapack.so.3"
PY=(qemu-aarch64-static -cpu max -L "$WORK/root" "$WORK/root/usr/bin/python3.11")
"${PY[@]}" -c "import numpy, platform; print('python', platform.python_version(), platform.machine(), 'numpy', numpy.__version__)"

echo "== sdpa._core cross-compiled for it"
CYTHON=(cython)
if ! command -v cython >/dev/null; then
    python3 -m venv "$WORK/cy"
    "$WORK/cy/bin/pip" install -q "Cython>=3"
    CYTHON=("$WORK/cy/bin/cython")
fi
"${CYTHON[@]}" -3 "$ROOT/src/sdpa/_core.pyx" -o "$WORK/_core.c"
mkdir -p "$WORK/pkg/sdpa"
cp -r "$ROOT"/src/sdpa/. "$WORK/pkg/sdpa/"
rm -f "$WORK"/pkg/sdpa/_core*.so "$WORK/pkg/sdpa/_core.c"
NPINC="$(find "$WORK/root/usr/lib/python3/dist-packages/numpy" -name arrayobject.h -path '*numpy/arrayobject.h' | head -n 1)"
NPINC="${NPINC%/numpy/arrayobject.h}"
# setup.py's flags and sources (every csrc file; those of another architecture compile to nothing)
aarch64-linux-gnu-gcc -O3 -std=c11 -fno-math-errno -fvisibility=hidden -Wall -Wno-unused-function -fopenmp \
    -fPIC -shared -DNPY_NO_DEPRECATED_API=NPY_1_22_API_VERSION \
    -I"$ROOT/csrc/include" -I"$ROOT/csrc" -I"$NPINC" \
    -I"$WORK/root/usr/include/python3.11" -I"$WORK/root/usr/include" \
    "$WORK/_core.c" "$ROOT"/csrc/*.c "$ROOT"/csrc/kernels/*.c -lm \
    -o "$WORK/pkg/sdpa/_core.cpython-311-aarch64-linux-gnu.so" 2> "$WORK/cc.log" || { cat "$WORK/cc.log"; exit 1; }

echo "== the smoke test, emulated"
OMP_WAIT_POLICY=passive PYTHONPATH="$WORK/pkg" "${PY[@]}" "$ROOT/tests/arm_smoke.py"

echo "== Arm Python done in $((SECONDS - start)) s"
