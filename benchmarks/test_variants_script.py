"""benchmarks/variants.py runs end to end (small shapes, one round), so that it cannot rot."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import variants  # noqa: E402


def test_quick_run_writes_every_case(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert variants.main(["--quick", "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cases = {r["case"] for r in data["results"]}
    assert {"causal-1024", "causal-512", "decode-1024", "varlen-4"} <= cases
    for r in data["results"]:
        assert r["seconds"] > 0
    assert "window-128" in capsys.readouterr().out
