"""Builds sdpa._core: the Cython wrapper plus the C core in csrc/.

OpenMP is probed: a tiny program must compile, link and run with the compiler's
OpenMP flags (or those in SDPA_OPENMP_CFLAGS / SDPA_OPENMP_LDFLAGS).  Without it
the extension is built serially with a warning; SDPA_REQUIRE_OPENMP=1 makes that
an error, and SDPA_DISABLE_OPENMP=1 builds the
serial extension on purpose.  Flags stay portable: the SIMD kernels pick the
instruction set at run time, never at build time.  The version is the one in
csrc/include/sdpa.h.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent.resolve()
CSRC = "csrc"

OPENMP_PROBE = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    printf("%d\n", n > 0 && omp_get_max_threads() > 0);
    return 0;
}
"""


def openmp_flag_candidates(compiler_type):
    if "SDPA_OPENMP_CFLAGS" in os.environ or "SDPA_OPENMP_LDFLAGS" in os.environ:
        # an OpenMP of the builder's choice, e.g. LLVM's libomp with gcc:
        # SDPA_OPENMP_CFLAGS=-fopenmp SDPA_OPENMP_LDFLAGS="-L/usr/lib/llvm-14/lib -lomp"
        return [(shlex.split(os.environ.get("SDPA_OPENMP_CFLAGS", "")),
                 shlex.split(os.environ.get("SDPA_OPENMP_LDFLAGS", "")))]
    if compiler_type == "msvc":
        return [(["/openmp"], [])]
    if sys.platform == "darwin":
        # Apple clang has no driver flag; libomp comes from Homebrew or conda
        prefixes = [os.environ.get("OPENMP_PREFIX", ""), "/opt/homebrew/opt/libomp",
                    "/usr/local/opt/libomp", os.environ.get("CONDA_PREFIX", "")]
        out = [(["-fopenmp"], ["-fopenmp"])]
        for pre in filter(None, prefixes):
            out.append((["-Xpreprocessor", "-fopenmp", f"-I{pre}/include"],
                        [f"-L{pre}/lib", "-lomp", f"-Wl,-rpath,{pre}/lib"]))
        out.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
        return out
    return [(["-fopenmp"], ["-fopenmp"])]


def probe_openmp(compiler):
    """Returns (compile_args, link_args) of a working OpenMP, or None."""
    for cflags, ldflags in openmp_flag_candidates(compiler.compiler_type):
        tmp = tempfile.mkdtemp(prefix="sdpa-omp-")
        try:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write(OPENMP_PROBE)
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
            exe = os.path.join(tmp, "probe")
            # the user's LDFLAGS too (e.g. -fsanitize=...), as the extension gets them
            user_ldflags = shlex.split(os.environ.get("LDFLAGS", ""))
            compiler.link_executable(objs, exe, extra_postargs=ldflags + user_ldflags)
            if compiler.compiler_type == "msvc" and not exe.endswith(".exe"):
                exe += ".exe"
            out = subprocess.run([exe], capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip() == "1":
                return cflags, ldflags
        except Exception:  # noqa: BLE001 - any failure means "not this flag set"
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return None


class BuildExt(build_ext):
    def build_extensions(self):
        compiler = self.compiler
        if compiler.compiler_type == "msvc":
            base = ["/O2"]
        else:
            # -fno-wrapv undoes the -fwrapv of CPython's own flags, which the compiler
            # is handed first: the core has no signed overflow (the C library, which
            # CMake builds without the flag, runs its tests and fuzz harness under UBSan),
            # and with wrapping the row kernels' address arithmetic cost decoding over
            # a bfloat16 cache 10% on Zen 4 (benchmarks/RESULTS.md, 2026-12-04 later)
            base = ["-O3", "-std=c11", "-fno-math-errno", "-fno-wrapv", "-fvisibility=hidden",
                    "-Wall", "-Wno-unused-function"]
        if os.environ.get("SDPA_DISABLE_OPENMP") == "1":
            if os.environ.get("SDPA_REQUIRE_OPENMP") == "1":
                raise RuntimeError("sdpa: SDPA_DISABLE_OPENMP=1 and SDPA_REQUIRE_OPENMP=1 contradict each other")
            print("sdpa: SDPA_DISABLE_OPENMP=1: building a serial extension", file=sys.stderr)
            omp = ()
        else:
            omp = probe_openmp(compiler)
        if omp == ():
            cflags, ldflags = [], []
        elif omp is None:
            msg = ("sdpa: OpenMP was not found (tried the usual flags for "
                   f"{compiler.compiler_type}); building a serial extension. Install an "
                   "OpenMP runtime (e.g. libomp) for multithreading.")
            if os.environ.get("SDPA_REQUIRE_OPENMP") == "1":
                raise RuntimeError(msg + " SDPA_REQUIRE_OPENMP=1 is set, so this is an error.")
            warnings.warn(msg, stacklevel=2)
            print("WARNING: " + msg, file=sys.stderr)
            cflags, ldflags = [], []
        else:
            cflags, ldflags = omp
        for ext in self.extensions:
            ext.extra_compile_args = base + cflags + ext.extra_compile_args
            ext.extra_link_args = ldflags + ext.extra_link_args
        super().build_extensions()


def c_sources():
    """Every C file of csrc/: the kernels of each architecture are selected by
    the target compiler's own macros (internal.h: the x86 sets' files compile to
    nothing for aarch64, neon.c to nothing for x86-64), so that a cross build,
    or a macOS universal2 one, gets the target's kernels."""
    srcs = sorted(str(p.relative_to(HERE)) for p in (HERE / CSRC).rglob("*.c"))
    return [s.replace(os.sep, "/") for s in srcs]


def version():
    """The version the C header declares (csrc/include/sdpa.h)."""
    header = (HERE / CSRC / "include" / "sdpa.h").read_text()
    parts = [re.search(rf"#define SDPA_VERSION_{p} (\d+)", header).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


ext = Extension(
    "sdpa._core",
    sources=["src/sdpa/_core.pyx"] + c_sources(),
    include_dirs=[f"{CSRC}/include", CSRC, numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
    depends=[str(p.relative_to(HERE)) for p in (HERE / CSRC).rglob("*.h")],
)

setup(version=version(), ext_modules=[ext], cmdclass={"build_ext": BuildExt})
