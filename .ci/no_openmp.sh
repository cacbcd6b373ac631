#!/usr/bin/env bash
# The serial build: sdpa compiled without OpenMP (SDPA_DISABLE_OPENMP=1), as on a
# platform without an OpenMP runtime, installed into a fresh virtual
# environment; the test suite must pass on it too.
#
#   bash .ci/no_openmp.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/sdpa-serial.XXXXXX")"
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
(cd "$ROOT" && SDPA_DISABLE_OPENMP=1 SDPA_REQUIRE_OPENMP=0 "$py" -m pip install -q ".[test]")
# run from outside the tree, so the installed (serial) package is imported
got="$(cd "$work" && "$py" -c 'import sdpa; print(sdpa.config()["openmp"])')"
if [[ "$got" != "False" ]]; then
    echo "no_openmp: the extension was built with OpenMP ($got)" >&2
    exit 1
fi
(cd "$work" && "$py" -m pytest "$ROOT/tests" -q -p no:cacheprovider)
echo "== the serial build passed"
