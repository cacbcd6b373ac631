"""Packaging: the wheel installs into a fresh virtual environment and runs, and the
sdist carries everything a wheel is built from (and builds one on its own).

Slow (two compilations, a venv, network or a package index for the build
requirements), so they only run with SDPA_PACKAGING_TESTS=1.  The project is copied
to a temporary directory first, so the checkout gets no build products.
"""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    os.environ.get("SDPA_PACKAGING_TESTS") != "1",
    reason="packaging tests are slow; set SDPA_PACKAGING_TESTS=1 to run them",
)

WORKED_EXAMPLE = [
    "  weights = [[0.67, 0.33], [0.33, 0.67]]",
    "  output  = [[2.66, 3.66], [3.34, 4.34]]",
]

BUILD_PRODUCTS = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv*", ".pytest_cache",
    ".hypothesis", ".benchmarks", ".mypy_cache", "*.so", "*.pyd", "*.o", "_core.c",
)


def run(*args, cwd=None, timeout=1200):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A clean copy of the project."""
    dest = tmp_path_factory.mktemp("src") / "sdpa"
    shutil.copytree(ROOT, dest, ignore=BUILD_PRODUCTS)
    return dest


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source)
    wheels = list(out.glob("sdpa-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def sdist(source, tmp_path_factory):
    pytest.importorskip("build", reason="the sdist is built with `python -m build` (pip install build)")
    out = tmp_path_factory.mktemp("sdist")
    run(sys.executable, "-m", "build", "--sdist", "--outdir", out, source)
    sdists = list(out.glob("sdpa-*.tar.gz"))
    assert len(sdists) == 1, sdists
    return sdists[0]


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for name in (
        "sdpa/__init__.py", "sdpa/_api.py", "sdpa/torch.py", "sdpa/transformers.py", "sdpa/_core.pyi", "sdpa/py.typed",
        "sdpa/bench/__init__.py", "sdpa/bench/__main__.py",
    ):
        assert name in names, name
    assert any(n.startswith("sdpa/_core.") and n.endswith((".so", ".pyd")) for n in names), names
    assert not any(n.startswith(("csrc/", "tests/")) for n in names)


def test_wheel_installs_and_runs(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    run(python, "-m", "pip", "install", "-q", wheel, "numpy")
    # from an empty directory: the installed package, not a source tree
    where = run(python, "-c", "import sdpa; print(sdpa.__file__)", cwd=tmp_path)
    assert Path(where.strip()).resolve().is_relative_to(venv.resolve())
    out = run(python, "-m", "sdpa", cwd=tmp_path)
    lines = out.splitlines()
    for expected in WORKED_EXAMPLE:
        assert expected in lines, out
    assert "(OK)" in out, out


def sdist_members(path):
    with tarfile.open(path) as tar:
        top = tar.getnames()[0].split("/")[0]
        return {name[len(top) + 1:] for name in tar.getnames() if name.startswith(top + "/")}


def test_sdist_contents(sdist, source):
    names = sdist_members(sdist)
    for name in (
        "csrc/include/sdpa.h", "csrc/kernels/avx512.c", "src/sdpa/_core.pyx", "src/sdpa/_core.pxd",
        "src/sdpa/_core.pyi", "src/sdpa/py.typed", "src/sdpa/torch.py", "src/sdpa/transformers.py",
        "src/sdpa/dask/sharded.py", "src/sdpa/testing/checker.py",
        "README.md", "setup.py", "pyproject.toml",
        "MANIFEST.in", "tests/conftest.py",
    ):
        assert name in names, name
    c_sources = {p.relative_to(source).as_posix() for p in (source / "csrc").rglob("*") if p.suffix in (".c", ".h")}
    assert c_sources and c_sources <= names, c_sources - names
    assert "src/sdpa/_core.c" not in names
    assert not any(n.endswith((".so", ".pyd", ".o", ".pyc")) for n in names)


def test_wheel_builds_from_the_sdist_alone(sdist, tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path, sdist)
    wheels = list(tmp_path.glob("sdpa-*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert any(n.startswith("sdpa/_core.") and n.endswith((".so", ".pyd")) for n in names), names
