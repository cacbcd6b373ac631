"""benchmarks/dask_decode.py runs end to end (a small cache, one pass), so that it cannot rot."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("distributed")
sys.path.insert(0, os.path.dirname(__file__))

import dask_decode  # noqa: E402


def test_quick_run_writes_every_configuration(tmp_path):
    out = tmp_path / "d.json"
    result = dask_decode.main(["--keys", "3000", "--rounds", "2", "--passes", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    configs = [r["config"] for r in data["rows"]]
    assert configs == ["1 worker process", "2 worker processes", "one process, 1 thread", "one process, 2 threads"]
    assert all(r["ms_per_step"] > 0 for r in data["rows"])
    assert data["max_abs_diff_sharded_vs_one"] < 1e-5
