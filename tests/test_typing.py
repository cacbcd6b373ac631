"""mypy on the installed package, and on user code calling its API.

The package directory sdpa is imported from is copied and checked with the
project's mypy configuration (pyproject.toml), together with a snippet of user code
whose calls must type-check, except the lines marked ``# error``, which must not.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sdpa

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

USER_CODE = '''\
from typing import Tuple

import numpy as np
import numpy.typing as npt

import sdpa

q = np.zeros((2, 3, 8), dtype=np.float32)
out: npt.NDArray[np.floating] = sdpa.scaled_dot_product_attention(q, q, q, is_causal=True)
pair: Tuple[np.ndarray, np.ndarray] = sdpa.scaled_dot_product_attention(q, q, q, return_weights=True)
o, lse = sdpa.scaled_dot_product_attention([[1.0, 2.0]], q, q, return_lse=True)
o, w, lse = sdpa.scaled_dot_product_attention(q, q, q, None, "bottom_right", return_weights=True, return_lse=True)
any_result = sdpa.scaled_dot_product_attention(q, q, q, return_weights=bool(q.size))
n: int = sdpa.get_num_threads()
sdpa.set_num_threads(2)
sdpa.set_num_threads(None)
config = sdpa.config()


class DLPackOnly:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, *, stream: object = None) -> object:
        return self.a.__dlpack__()

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (1, 0)


sdpa.scaled_dot_product_attention(DLPackOnly(q), q, q)
bad: np.ndarray = sdpa.scaled_dot_product_attention(q, q, q, return_weights=True)  # error
sdpa.scaled_dot_product_attention(object(), q, q)  # error
sdpa.set_num_threads("2")  # error
sdpa.get_num_threads(1)  # error
'''


def test_mypy_passes(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    if not PYPROJECT.is_file():
        pytest.skip("the project's pyproject.toml (mypy configuration) is not next to the tests")

    # A copy of the package as installed, so that mypy sees it as the top-level
    # package sdpa (run on a path inside site-packages, it would treat the whole
    # of site-packages as project code).
    package = Path(sdpa.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "sdpa", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    assert (tmp_path / "sdpa" / "_core.pyi").is_file(), "the _core.pyi stub is not installed"
    assert (tmp_path / "sdpa" / "py.typed").is_file(), "py.typed is not installed"
    if importlib.util.find_spec("torch") is None:
        # sdpa.torch and sdpa.transformers are only checked where torch (its types) is installed
        (tmp_path / "sdpa" / "torch.py").unlink()
        (tmp_path / "sdpa" / "transformers.py").unlink()
    (tmp_path / "user_code.py").write_text(USER_CODE)

    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "mypy",
            "--config-file", str(PYPROJECT),
            "--cache-dir", str(tmp_path / ".mypy_cache"),
            "--no-color-output", "--no-error-summary", "--show-error-codes",
            "sdpa", "user_code.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = proc.stdout + proc.stderr
    error_lines = [line for line in report.splitlines() if re.match(r"^[^:]+:\d+: error:", line)]
    expected = {
        i + 1 for i, line in enumerate(USER_CODE.splitlines()) if line.endswith("# error")
    }
    in_package = [line for line in error_lines if not line.startswith("user_code.py:")]
    assert not in_package, "mypy finds errors in the package:\n" + report
    seen = {int(line.split(":")[1]) for line in error_lines}
    assert seen == expected, f"errors on lines {sorted(seen)}, expected {sorted(expected)}:\n{report}"
    assert proc.returncode == 1, report  # 1: type errors found (the expected ones), not a crash
