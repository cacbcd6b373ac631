"""benchmarks/bf16_products.py runs end to end (one small case), so that it cannot rot."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import bf16_products  # noqa: E402

from sdpa import _core  # noqa: E402


def test_quick_run(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bf16_products.main(["--quick", "--emulated", "--rounds", "1", "--min-time", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    if not _core.isa_supported("avx512_bf16"):
        assert "no kernel set" in text
        pytest.skip("no AVX512-BF16 here")
    data = json.loads(out.read_text())
    sets = {r["set"] for r in data["results"]}
    assert {"avx512_bf16", "amx_emulated"} <= sets
    assert all(r["gflops"] > 0 for r in data["results"])
