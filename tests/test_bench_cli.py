"""Smoke tests of the benchmark tooling (``python -m sdpa.bench``) on tiny shapes."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import sys
import time

import numpy as np
import pytest

from sdpa import bench, reference
from sdpa.bench import peers
from sdpa.bench.report import describe_latency_skips, describe_skips
from sdpa.bench.shapes import make_inputs

# Tiny problems: one prefill (GQA, causal, L != S) and one decode step.
TINY = ("tiny", 1, 4, 2, 16, 24, 8, True)
TINY_DECODE = "tiny-decode:1,4,2,1,64,8"
FAST = dict(min_time=0.0, repeat=2)


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    """No rest between implementations: these runs time nothing that matters."""
    monkeypatch.setattr(bench.suite, "SETTLE_S", 0.0)


@pytest.fixture(scope="module")
def refs():
    return bench.measure_references([1, 2], "float32", gemm_n=32, bandwidth_mib=1, **FAST)


@pytest.mark.parametrize("L, S", [(1, 1), (1, 7), (5, 5), (5, 9), (9, 5), (16, 24), (24, 16)])
def test_causal_pairs_counts_the_unmasked_entries(L, S):
    assert bench.causal_pairs(L, S) == int(reference.causal_mask(L, S).sum())


def test_flops_and_bytes():
    full = bench.Shape("x", 2, 4, 2, 3, 5, 8, False, Ev=6)
    assert bench.attention_flops(full) == 2 * 2 * 4 * 3 * 5 * (8 + 6)
    causal = bench.Shape("x", 2, 4, 2, 5, 5, 8, True)
    assert bench.attention_flops(causal) == 2 * 2 * 4 * 15 * 16
    assert bench.kv_bytes(full, 4) == 2 * 2 * 5 * (8 + 6) * 4
    assert not full.decode and bench.Shape("d", 1, 1, 1, 1, 9, 4).decode


def test_parse_shape():
    assert bench.parse_shape("1k") is next(s for s in bench.SHAPES if s.name == "1k")
    s = bench.parse_shape(TINY)
    assert (s.name, s.Hq, s.Hkv, s.L, s.S, s.E, s.Ev, s.causal) == ("tiny", 4, 2, 16, 24, 8, 8, True)
    s = bench.parse_shape("mine:2,8,8,32,32,16,causal")
    assert (s.B, s.L, s.causal) == (2, 32, True)
    assert bench.parse_shape(TINY_DECODE).causal is False
    with pytest.raises(ValueError, match="unknown shape"):
        bench.parse_shape("no-such-shape")
    with pytest.raises(ValueError, match="multiple"):
        bench.parse_shape(("bad", 1, 3, 2, 4, 4, 8, False))


def test_suite_shapes_are_the_documented_ones():
    dims = {s.name: (s.B, s.Hq, s.Hkv, s.L, s.S, s.E, s.causal) for s in bench.SHAPES}
    assert dims["gqa-2k"] == (1, 32, 8, 2048, 2048, 128, True)
    assert dims["decode-gqa-32k"] == (1, 32, 8, 1, 32768, 128, False)
    assert len(dims) == 13
    masks = {s.name: (s.B, s.Hq, s.Hkv, s.L, s.S, s.E, s.causal, s.mask) for s in bench.SHAPES if s.mask}
    assert masks == {
        "mask-dense-bool": (1, 16, 16, 2048, 2048, 64, False, "dense-bool"),
        "mask-dense-float": (1, 16, 16, 2048, 2048, 64, False, "dense-float"),
        "mask-padding": (8, 12, 12, 512, 512, 64, False, "padding"),
    }
    assert all(s.L <= 1024 for s in bench.QUICK_SHAPES)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "hq, hkv, L, S, causal", [(4, 4, 6, 6, False), (4, 2, 5, 9, True), (6, 3, 9, 5, True)]
)
def test_numpy_attention_matches_the_reference(dtype, hq, hkv, L, S, causal):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, hq, L, 8)).astype(dtype)
    k = rng.standard_normal((2, hkv, S, 8)).astype(dtype)
    v = rng.standard_normal((2, hkv, S, 5)).astype(dtype)
    got = bench.numpy_attention(q, k, v, causal)
    want = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_time_call_honours_repeat_and_min_time():
    calls = []
    times = bench.time_call(lambda: calls.append(1), min_time=0.0, repeat=3)
    assert len(times) == 3 and len(calls) == 4  # one warm-up
    times = bench.time_call(lambda: time.sleep(0.002), min_time=0.01, repeat=1)
    assert sum(times) >= 0.01 and len(times) >= 2


def test_references(refs):
    gemm, bw = refs["gemm"], refs["bandwidth"]
    assert gemm["n"] == 32 and gemm["results"]
    assert all(e["gflops"] > 0 for e in gemm["results"])
    assert [e["threads"] for e in bw["results"]] == [1, 2]
    assert all(e["gbps"] > 0 for e in bw["results"])


def test_run_suite_on_tiny_shapes(refs):
    rows = bench.run_suite([TINY, TINY_DECODE], threads=[1, 2], references=refs, **FAST)
    assert [(r["shape"], r["threads"]) for r in rows] == [
        ("tiny", 1),
        ("tiny", 2),
        ("tiny-decode", 1),
        ("tiny-decode", 2),
    ]
    for row in rows:
        for key in ("B", "Hq", "Hkv", "L", "S", "E", "Ev", "causal", "decode", "dtype", "flops", "kv_bytes"):
            assert key in row
        assert list(row["impls"]) == list(bench.IMPLEMENTATIONS)
        for impl in ("sdpa", "numpy"):
            r = row["impls"][impl]
            assert r["status"] == "ok", r
            assert r["median_s"] > 0 and r["gflops"] > 0 and r["runs"] >= 2
            assert math.isclose(r["gflops"], row["flops"] / r["median_s"] / 1e9)
        assert row["impls"]["torch"]["status"] in ("ok", "absent")
        for impl in ("ort", "openvino"):
            assert row["impls"][impl]["status"] in ("ok", "absent"), row["impls"][impl]
        # grouped-query attention: MultiHeadAttention has one head count
        assert row["impls"]["ort-mha"]["status"] in ("unsupported", "absent")
        assert row["sdpa_pct_gemm"] > 0
        # float32 outputs against the float64 reference, on every query row of these shapes
        assert row["error_rows"] == row["L"]
        for impl, r in row["impls"].items():
            if r["status"] == "ok":
                assert 0 <= r["max_abs_err"] < 1e-5, (impl, r["max_abs_err"])
        assert row["sdpa_err"] == row["impls"]["sdpa"]["max_abs_err"]
        if row["decode"]:
            assert row["sdpa_gbps"] > 0 and row["sdpa_pct_bandwidth"] > 0
            assert row["impls"]["sdpa"]["gbps"] == row["sdpa_gbps"]
        else:
            assert row["sdpa_gbps"] is None and row["sdpa_pct_bandwidth"] is None
    assert rows[0]["flops"] == 2 * 1 * 4 * bench.causal_pairs(16, 24) * 16

    table = bench.format_table(rows)
    assert table.splitlines()[0].split()[:3] == ["shape", "threads", "sdpa"]
    assert "tiny-decode" in table
    assert "% sgemm" in table and "sdpa err" in table and "torch err" in table


def test_skips_show_as_dashes(monkeypatch):
    monkeypatch.setattr(peers, "_load_torch", lambda: None)
    monkeypatch.setattr(peers.packages, "_torch_error", "torch is not installed")
    rows = bench.run_suite([TINY], threads=[1], impls=["sdpa", "numpy", "torch"], numpy_max_bytes=16, **FAST)
    impls = rows[0]["impls"]
    assert impls["numpy"]["status"] == "skipped" and "score matrix" in impls["numpy"]["reason"]
    assert impls["torch"] == {"status": "absent", "reason": "torch is not installed"}
    assert rows[0]["sdpa_over_torch"] is None and rows[0]["sdpa_pct_gemm"] is None
    line = bench.format_table(rows).splitlines()[2].split()
    assert line[:2] == ["tiny", "1"] and line[3:6] == ["-", "absent", "-"]


def test_float64_and_impl_subset():
    rows = bench.run_suite([TINY], threads=[1], impls=["sdpa"], dtype="float64", **FAST)
    assert rows[0]["dtype"] == "float64" and list(rows[0]["impls"]) == ["sdpa"]
    with pytest.raises(ValueError):
        bench.run_suite([TINY], threads=[1], impls=["nope"], **FAST)


def test_sdpa_on_a_forced_kernel_set_beside_its_own_choice(tmp_path, capsys, monkeypatch):
    """sdpa@SET: sdpa with one kernel set forced for its calls, in the same run as
    sdpa on the CPU's choice; a set the CPU cannot run is reported absent; the
    choice before (named or default) is restored after."""
    from sdpa import _core

    before, named = _core.isa(), _core.isa_named()
    sets_seen = []
    real = peers._sdpa

    def recording(*args, **kwargs):
        sets_seen.append(_core.isa())
        return real(*args, **kwargs)

    monkeypatch.setattr(peers, "_sdpa", recording)
    unrunnable = [f"sdpa@{s}" for s in _core.ISAS if not _core.isa_supported(s)]
    impls = ["sdpa", "sdpa@scalar"] + unrunnable
    rows = bench.run_suite([TINY], threads=[1], impls=impls, **FAST)
    assert "scalar" in sets_seen and before in sets_seen
    assert _core.isa() == before and _core.isa_named() == named
    r = rows[0]["impls"]
    assert r["sdpa@scalar"]["status"] == "ok" and r["sdpa@scalar"]["gflops"] > 0
    assert "scalar forced" in r["sdpa@scalar"]["kernel_how"]
    assert r["sdpa@scalar"]["agreement"]["agrees"]
    assert rows[0]["sdpa_over"]["sdpa@scalar"] > 0
    for impl in unrunnable:
        assert r[impl]["status"] == "absent" and "cannot run" in r[impl]["reason"]
    header = bench.format_table(rows).splitlines()[0].split()
    assert header.index("sdpa@scalar") == header.index("sdpa") + 2  # right after sdpa's column
    with pytest.raises(ValueError, match="sdpa@SET"):
        bench.run_suite([TINY], threads=[1], impls=["sdpa@sse9"], **FAST)
    assert bench.main(CLI_FAST + ["--impls", "sdpa,sdpa@sse9"]) == 2
    assert "sdpa@SET" in capsys.readouterr().err
    assert bench.main(CLI_FAST + ["--impls", "sdpa,sdpa@scalar"]) == 0
    assert "sdpa@scalar GFLOP/s" in capsys.readouterr().out


def test_progress_bar_redraws_one_line():
    out = io.StringIO()
    p = bench.Progress(2, stream=out)
    p.show("tiny: sdpa")
    p.advance()
    p.show("tiny: numpy")
    p.close()
    text = out.getvalue()
    assert text.count("\r") >= 3 and "\n" not in text
    assert "1/2" in text and "tiny: numpy" in text


CLI_FAST = [
    "--shapes", "tiny:1,2,2,16,16,8,causal,tiny-decode:1,4,2,1,32,8",
    "--threads", "1",
    "--min-time", "0",
    "--repeat", "1",
    "--gemm-size", "32",
    "--bandwidth-mib", "1",
    "--no-progress",
]  # fmt: skip


def test_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(CLI_FAST + ["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sdpa GFLOP/s" in out and "tiny-decode" in out
    data = json.loads(path.read_text())
    assert set(data) >= {"machine", "settings", "references", "results"}
    machine = data["machine"]
    for key in ("platform", "cpu_model", "cpu_count", "numpy", "torch", "sdpa_config", "date", "git_commit"):
        assert key in machine
    assert [r["shape"] for r in data["results"]] == ["tiny", "tiny-decode"]
    assert data["results"][0]["impls"]["sdpa"]["gflops"] > 0
    assert data["settings"]["threads"] == [1] and data["settings"]["complete"] is True


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.main(CLI_FAST + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_shapes(capsys):
    assert bench.main(["--shapes", "no-such-shape", "--no-progress"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_cli_lists_shapes(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(s.name in out for s in bench.SHAPES)


# --------------------------------------------------------------------------- latency mode


def test_latency_shapes_are_the_documented_ones():
    dims = {s.name: (s.B, s.Hq, s.Hkv, s.L, s.S, s.E, s.causal) for s in bench.LATENCY_SHAPES}
    assert dims == {
        "decode-256": (1, 8, 8, 1, 256, 64, False),
        "decode-gqa-1k": (1, 32, 8, 1, 1024, 128, False),
        "tiny-prefill": (1, 8, 8, 32, 32, 64, True),
    }
    assert bench.parse_shape("decode-256") is bench.LATENCY_SHAPES[0]


def test_loop_times_runs_tight_loops():
    calls = []
    times, number = bench.loop_times(lambda: calls.append(1), min_time=0.0, repeat=3)
    assert len(times) == 3 and number == 1 and len(calls) == 4  # one warm-up loop
    times, number = bench.loop_times(lambda: time.sleep(0.001), min_time=0.02, repeat=2)
    assert number >= 8 and all(t >= 0.001 for t in times)


@pytest.mark.parametrize("shape", [TINY, TINY_DECODE, ("ev", 2, 4, 4, 3, 5, 8, False, 6)])
def test_onnx_runtime_attention_matches_the_reference(shape):
    pytest.importorskip("onnxruntime")
    shape = bench.parse_shape(shape)
    q, k, v = make_inputs(shape, np.dtype(np.float32), 0)
    run = peers.make_latency_runner("ort", shape, q, k, v, threads=1)
    want = reference.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa)
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)


def test_latency_rows_report_absent_packages(monkeypatch):
    monkeypatch.setattr(peers, "_load_torch", lambda: None)
    monkeypatch.setattr(peers.packages, "_torch_error", "torch is not installed")
    monkeypatch.setattr(peers, "_load_onnxruntime", lambda: None)
    monkeypatch.setattr(peers.packages, "_ort_error", "onnxruntime is not installed")
    rows = bench.run_latency([TINY_DECODE], threads=[1], min_time=0.0, repeat=1)
    impls = rows[0]["impls"]
    assert impls["sdpa"]["status"] == "ok" and impls["sdpa"]["median_s"] > 0
    assert impls["ort"] == {"status": "absent", "reason": "onnxruntime is not installed"}
    assert impls["torch"]["status"] == impls["sdpa.torch"]["status"] == "absent"
    assert rows[0]["sdpa_over_torch"] is None and rows[0]["sdpa_over_ort"] is None
    line = bench.format_latency_table(rows).splitlines()[2].split()
    assert line[:2] == ["tiny-decode", "1"] and line[3:6] == ["absent"] * 3 and line[6:] == ["-"] * 3
    notes = describe_latency_skips(rows)
    assert notes == [
        "sdpa.torch absent (torch is not installed)",
        "torch absent (torch is not installed)",
        "ort absent (onnxruntime is not installed)",
    ]


def _installed(module):
    return importlib.util.find_spec(module) is not None


def test_cli_latency_smoke(tmp_path, capsys):
    """--latency on its own shapes, one loop of one call each: every peer that is installed runs."""
    path = tmp_path / "latency.json"
    argv = ["--latency", "--repeat", "1", "--min-time", "0", "--no-generate", "--no-progress"]
    assert bench.main(argv + ["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sdpa µs" in out and "sdpa.torch/torch" in out and "generate()" not in out
    data = json.loads(path.read_text())
    assert data["settings"]["mode"] == "latency" and data["settings"]["threads"] == [2]
    assert data["generate"] == []
    assert [r["shape"] for r in data["latency"]] == [s.name for s in bench.LATENCY_SHAPES]
    expected = {"sdpa": "ok", "sdpa.torch": "ok", "torch": "ok", "ort": "ok"}
    if not _installed("torch"):
        expected.update({"sdpa.torch": "absent", "torch": "absent"})
    if not _installed("onnxruntime"):
        expected["ort"] = "absent"
    for row in data["latency"]:
        assert {impl: r["status"] for impl, r in row["impls"].items()} == expected, row["impls"]
        assert row["impls"]["sdpa"]["calls_per_loop"] == 1 and row["impls"]["sdpa"]["loops"] == 1
        assert (row["sdpa_over_torch"] is None) == (expected["torch"] != "ok")
        assert (row["sdpa_over_ort"] is None) == (expected["ort"] != "ok")


def test_cli_latency_with_generate(tmp_path, capsys):
    """generate() of the tiny Llama follows the table (or says why it cannot run)."""
    path = tmp_path / "latency.json"
    argv = ["--latency", "--shapes", "decode-256", "--impls", "sdpa", "--threads", "1"]
    argv += ["--repeat", "1", "--min-time", "0", "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    assert "generate() of a tiny random-weight Llama, 1 thread:" in capsys.readouterr().out
    [generated] = json.loads(path.read_text())["generate"]
    assert generated["threads"] == 1
    assert generated["status"] == ("ok" if _installed("torch") and _installed("transformers") else "absent")


def test_generate_with_and_without_the_patch(monkeypatch):
    if not (_installed("torch") and _installed("transformers")):
        result = bench.measure_generate(1, min_time=0.0, repeat=1)
        assert result["status"] == "absent", result
        assert "absent" in bench.format_generate(result)
        return
    import sdpa.torch

    calls = []
    attention = sdpa.torch.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    monkeypatch.setattr(sdpa.torch, "scaled_dot_product_attention", counted)  # what patch() installs
    result = bench.measure_generate(1, min_time=0.0, repeat=1)
    assert result["status"] == "ok", result
    # the warm-up and the timed run with the patch: each new token calls it once per layer
    assert len(calls) >= 2 * 32 * 2
    assert result["new_tokens"] == 32 and result["prompt_tokens"] == 16
    assert result["same_tokens"] is True
    assert len(result["torch"]["times_s"]) == len(result["sdpa"]["times_s"]) == 1
    assert result["sdpa_over_torch"] == result["sdpa"]["median_s"] / result["torch"]["median_s"]
    text = bench.format_generate(result)
    assert "sdpa.torch.patch()" in text and "same tokens" in text


def test_cli_latency_rejects_throughput_options(capsys):
    assert bench.main(["--latency", "--impls", "numpy", "--no-progress"]) == 2
    assert "sdpa.torch" in capsys.readouterr().err
    assert bench.main(["--latency", "--plot", "x.png", "--no-progress"]) == 2


# --------------------------------------------------------------------------- 16 bits and errors

_ml_dtypes_missing = importlib.util.find_spec("ml_dtypes") is None

#: --dtype values to run, bfloat16 skipped without ml_dtypes (NumPy's bfloat16 dtype).
HALF = [
    pytest.param("bfloat16", marks=pytest.mark.skipif(_ml_dtypes_missing, reason="ml_dtypes is not installed")),
    "float16",
]

#: Bound on a 16-bit output's max error against the reference: outputs here are below 4
#: in magnitude, so rounding them costs at most 2 units of roundoff (2**-8 for bfloat16,
#: 2**-11 for float16); four times that leaves room for the arithmetic.
HALF_ERR = {"bfloat16": 8 * 2.0**-8, "float16": 8 * 2.0**-11}


def test_sample_rows():
    assert list(bench.sample_rows(5, 64)) == [0, 1, 2, 3, 4]
    rows = bench.sample_rows(1000, 16, seed=3)
    assert len(rows) == 16 and rows[0] == 0 and rows[-1] == 999
    assert list(rows) == sorted(set(rows))
    assert list(bench.sample_rows(1000, 16, seed=3)) == list(rows)


@pytest.mark.parametrize(
    "spec", ["c:1,4,2,40,30,8,causal", "c2:2,2,2,30,40,8,causal", "f:1,4,4,40,40,8", "d:1,4,2,1,50,8"]
)
def test_reference_sample_is_the_reference_on_its_rows(spec):
    """A sample of rows (causal ones reading only the keys they see) equals the full reference there."""
    shape = bench.parse_shape(spec)
    q, k, v = make_inputs(shape, np.dtype(np.float32), 0)
    sample = bench.reference_sample(shape, q, k, v, max_rows=8, seed=1)
    assert sample.rows.size == min(8, shape.L) and sample.expected.dtype == np.float64
    full = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=shape.causal, enable_gqa=shape.gqa
    )
    np.testing.assert_allclose(sample.expected, full[:, :, sample.rows], rtol=1e-12, atol=1e-14)
    assert bench.max_abs_error(full, sample) < 1e-14
    assert bench.max_abs_error(full + 0.5, sample) == pytest.approx(0.5)
    assert math.isnan(bench.max_abs_error(np.full_like(full, np.nan), sample))


def test_dtypes():
    assert bench.bench_dtype("float16") == np.float16 and bench.bench_dtype("float32") == np.float32
    with pytest.raises(ValueError, match="dtype must be"):
        bench.bench_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be"):
        bench.bench_dtype(">f4")
    assert bench.suite_dtypes("float32", "float16") == (np.float32, np.float16)
    assert bench.suite_dtypes("float16") == (np.float16, np.float16)
    with pytest.raises(ValueError, match="cache"):
        bench.suite_dtypes("float64", "float16")


def test_bfloat16_without_ml_dtypes(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    with pytest.raises(ValueError, match="ml_dtypes"):
        bench.bench_dtype("bfloat16")
    assert bench.main(CLI_FAST + ["--dtype", "bfloat16"]) == 2
    assert "ml_dtypes" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", HALF)
def test_cli_16bit(dtype, tmp_path, capsys):
    """sdpa and torch in the 16-bit dtype, NumPy skipped, err columns present and small."""
    path = tmp_path / "bench.json"
    assert bench.main(CLI_FAST + ["--dtype", dtype, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{dtype} (sdpa computes in float32; the gemm reference is float32)" in out
    assert "float32 gemm 32^3" in out
    header = out.split("\n\n", 1)[1].splitlines()[0]
    for column in ("% f32 gemm", "sdpa err", "torch err", "err sdpa/torch"):
        assert column in header
    assert "numpy skipped (NumPy has no " + dtype in out and "another dtype" in out

    data = json.loads(path.read_text())
    settings = data["settings"]
    assert (settings["dtype"], settings["kv_dtype"], settings["gemm_dtype"]) == (dtype, dtype, "float32")
    assert settings["error_rows"] == 64
    for row in data["results"]:
        assert (row["dtype"], row["kv_dtype"]) == (dtype, dtype)
        assert row["kv_bytes"] == row["B"] * row["Hkv"] * row["S"] * (row["E"] + row["Ev"]) * 2
        numpy_result = row["impls"]["numpy"]
        assert numpy_result["status"] == "skipped" and "another dtype" in numpy_result["reason"]
        sdpa_result = row["impls"]["sdpa"]
        assert sdpa_result["status"] == "ok" and 0 < sdpa_result["max_abs_err"] < HALF_ERR[dtype]
        assert row["sdpa_err"] == sdpa_result["max_abs_err"]
        if row["decode"]:
            assert sdpa_result["gbps"] == pytest.approx(row["kv_bytes"] / sdpa_result["median_s"] / 1e9)
        torch_result = row["impls"]["torch"]
        if _installed("torch"):
            assert torch_result["status"] == "ok", torch_result
            assert 0 < torch_result["max_abs_err"] < 2 * HALF_ERR[dtype] and "note" not in torch_result
            assert row["sdpa_err_over_torch"] == pytest.approx(row["sdpa_err"] / row["torch_err"])
        else:
            assert torch_result["status"] == "absent" and row["sdpa_err_over_torch"] is None


def test_decode_bytes_count_the_cache_itemsize():
    rows = bench.run_suite([TINY_DECODE], threads=[1], impls=["sdpa"], dtype="float16", **FAST)
    assert rows[0]["kv_bytes"] == 1 * 2 * 64 * (8 + 8) * 2
    r = rows[0]["impls"]["sdpa"]
    assert r["gbps"] == pytest.approx(rows[0]["kv_bytes"] / r["median_s"] / 1e9)


@pytest.mark.parametrize("kv_dtype", HALF)
def test_cli_float32_query_against_a_16bit_cache(kv_dtype, tmp_path, capsys):
    """--kv-dtype: sdpa reads the 16-bit cache with a float32 query; torch casts the query."""
    path = tmp_path / "bench.json"
    assert bench.main(CLI_FAST + ["--dtype", "float32", "--kv-dtype", kv_dtype, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"float32 query, {kv_dtype} k and v" in out and "% sgemm" in out
    data = json.loads(path.read_text())
    assert (data["settings"]["dtype"], data["settings"]["kv_dtype"]) == ("float32", kv_dtype)
    for row in data["results"]:
        assert (row["dtype"], row["kv_dtype"]) == ("float32", kv_dtype)
        assert row["impls"]["numpy"]["status"] == "skipped"
        # the reference sees the very values sdpa does, so only float32 arithmetic is left
        assert row["impls"]["sdpa"]["max_abs_err"] < 1e-5
        torch_result = row["impls"]["torch"]
        if _installed("torch"):
            assert torch_result["status"] == "ok" and f"query cast to {kv_dtype}" in torch_result["note"]
            assert torch_result["max_abs_err"] < 2 * HALF_ERR[kv_dtype]
    if _installed("torch"):
        assert f"torch: query cast to {kv_dtype}" in out


def test_16bit_without_torch(monkeypatch):
    monkeypatch.setattr(peers, "_load_torch", lambda: None)
    monkeypatch.setattr(peers.packages, "_torch_error", "torch is not installed")
    rows = bench.run_suite([TINY], threads=[1], impls=["sdpa", "numpy", "torch"], dtype="float16", **FAST)
    impls = rows[0]["impls"]
    assert impls["sdpa"]["status"] == "ok" and impls["sdpa"]["max_abs_err"] < HALF_ERR["float16"]
    assert impls["torch"] == {"status": "absent", "reason": "torch is not installed"}
    assert rows[0]["torch_err"] is None and rows[0]["sdpa_err_over_torch"] is None
    line = bench.format_table(rows, "float16").splitlines()[2].split()
    assert line[3:6] == ["-", "absent", "-"] and line[-2:] == ["-", "-"]
    assert describe_skips(rows) == [
        "tiny: numpy skipped (NumPy has no float16 BLAS matmul: the textbook version would compute in another dtype)",
        "tiny: torch absent (torch is not installed)",
    ]


def test_error_rows_zero_leaves_the_columns_out():
    rows = bench.run_suite([TINY], threads=[1], impls=["sdpa"], error_rows=0, **FAST)
    assert rows[0]["error_rows"] is None and "max_abs_err" not in rows[0]["impls"]["sdpa"]
    assert "err" not in bench.format_table(rows).splitlines()[0]


def test_cli_rejects_mismatched_dtypes(capsys):
    assert bench.main(CLI_FAST + ["--dtype", "float16", "--kv-dtype", "float64"]) == 2
    assert "cache" in capsys.readouterr().err
    assert bench.main(["--latency", "--dtype", "float16", "--no-progress"]) == 2
    assert "--latency runs float32 or float64" in capsys.readouterr().err
    assert bench.main(CLI_FAST + ["--error-rows", "-1"]) == 2


def test_cli_plot_16bit_cache(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.main(CLI_FAST + ["--dtype", "float32", "--kv-dtype", "float16", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- masks, peers, agreement

#: Tiny masked problems, one per kind of mask (L != S, and B > 1 for the padding mask).
TINY_MASKED = [
    "tm-bool:1,4,4,24,40,8,dense-bool",
    "tm-float:1,4,4,24,40,8,dense-float",
    "tm-pad:3,4,4,16,40,8,padding",
]

#: The module each optional implementation needs.
PEER_MODULES = {"torch": "torch", "ort": "onnxruntime", "ort-mha": "onnxruntime", "openvino": "openvino"}

#: The implementations other than sdpa whose packages are installed here.
AVAILABLE_PEERS = [i for i in bench.IMPLEMENTATIONS[1:] if i not in PEER_MODULES or _installed(PEER_MODULES[i])]


def test_parse_masked_shapes():
    s = bench.parse_shape("m:2,4,4,8,12,8,causal,padding")
    assert (s.B, s.causal, s.mask) == (2, True, "padding")
    assert bench.parse_shape("m:2,4,4,8,12,8,dense-float").mask == "dense-float"
    assert bench.parse_shape(("m", 1, 2, 2, 4, 4, 8, False, None, "dense-bool")).mask == "dense-bool"
    assert "mask=padding" in bench.parse_shape("mask-padding").describe()
    with pytest.raises(ValueError, match="mask must be one of"):
        bench.Shape("m", 1, 1, 1, 4, 4, 8, mask="sparse")
    from sdpa.bench.shapes import split_shapes

    specs = ["1k", "m:1,4,4,8,8,8,dense-bool", "mask-padding"]
    assert split_shapes(",".join(specs)) == specs


def test_masks_are_drawn_as_documented():
    dense = bench.parse_shape("d:1,2,2,300,400,8,dense-bool")
    keep = bench.make_mask(dense, np.dtype(np.float32), 0)
    assert keep.shape == (300, 400) and keep.dtype == np.bool_ and keep.any(axis=1).all()
    assert abs(keep.mean() - bench.MASK_DENSITY) < 0.01
    additive = bench.make_mask(bench.parse_shape("f:1,2,2,300,400,8,dense-float"), np.dtype(np.float32), 0)
    assert additive.dtype == np.float32 and set(np.unique(additive)) == {0.0, -np.inf}
    np.testing.assert_array_equal(additive == 0, keep)  # the same pattern, for one seed
    padding = bench.parse_shape("p:64,2,2,16,512,8,padding")
    pad = bench.make_mask(padding, np.dtype(np.float32), 0)
    assert pad.shape == (64, 1, 1, 512) and pad.dtype == np.bool_
    lengths = pad.sum(axis=-1).ravel()
    assert lengths.min() >= 200 and lengths.max() <= 512 and len(set(lengths)) > 10
    assert (pad[..., :200]).all()  # kept keys come first
    assert bench.make_mask(bench.parse_shape("1k"), np.dtype(np.float32), 0) is None
    # the work counts the pairs the mask keeps
    assert bench.kept_pairs(padding, pad) == int(lengths.sum()) * 2 * 16
    assert bench.attention_flops(padding, pad) == 2 * bench.kept_pairs(padding, pad) * 16
    assert bench.attention_flops(dense, keep) == 2 * 2 * int(keep.sum()) * 16
    assert bench.attention_flops(dense) == 2 * 2 * 300 * 400 * 16


def test_numpy_attention_takes_masks():
    shape = bench.parse_shape("g:2,4,2,6,9,8,padding")
    q, k, v = make_inputs(shape, np.dtype(np.float64), 0)
    for mask in (bench.make_mask(shape, np.dtype(np.float64), 1), np.where(np.eye(6, 9, dtype=bool), 0.0, -np.inf)):
        got = bench.numpy_attention(q, k, v, mask=mask)
        want = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_masked_shapes_with_every_peer():
    """Every installed peer takes each kind of mask, agrees with sdpa, and says which
    kernel ran; the others are reported absent; sdpa's unmasked speed comes with it."""
    rows = bench.run_suite(TINY_MASKED, threads=[1], **FAST)
    assert [r["shape"] for r in rows] == ["tm-bool", "tm-float", "tm-pad"]
    for row in rows:
        assert row["impls"]["sdpa"]["kernel"] == "fused" and row["impls"]["sdpa"]["max_abs_err"] < 1e-5
        for impl in bench.IMPLEMENTATIONS[1:]:
            r = row["impls"][impl]
            if impl not in AVAILABLE_PEERS:
                assert r == {"status": "absent", "reason": f"{PEER_MODULES[impl]} is not installed"}
                continue
            assert r["status"] == "ok", (row["shape"], impl, r)
            assert r["agreement"]["agrees"] and r["agreement"]["max_abs_diff"] < 1e-5
            assert r["max_abs_err"] < 1e-5
            assert r["kernel"] in ("fused", "unfused") and r["kernel_how"]
            assert row["sdpa_over"][impl] == pytest.approx(row["impls"]["sdpa"]["gflops"] / r["gflops"])
        # the flops are those of the pairs the mask keeps; the unmasked run counts them all
        assert 0 < row["mask_kept"] < 1 and row["flops"] == round(row["unmasked_flops"] * row["mask_kept"])
        assert row["sdpa_unmasked"]["median_s"] > 0 and row["sdpa_unmasked"]["runs"] >= 2
        assert row["sdpa_mask_speed"] == row["sdpa_unmasked"]["median_s"] / row["impls"]["sdpa"]["median_s"]
    expected = {"numpy": "unfused", "ort": "unfused", "ort-mha": "unfused", "openvino": "fused"}
    for impl, kernel in expected.items():
        if impl in AVAILABLE_PEERS:
            assert {row["impls"][impl]["kernel"] for row in rows} == {kernel}, impl
    notes = bench.suite_notes(rows, 64)
    assert any(note.startswith("kernels: sdpa fused; numpy unfused") for note in notes)


def test_peers_say_what_they_cannot_take():
    """Grouped heads and a causal mask with L != S for MultiHeadAttention, a causal mask
    together with a mask for OpenVINO: unsupported, with the reason."""
    impls = [i for i in ("ort-mha", "openvino") if i in AVAILABLE_PEERS]
    if not impls:
        pytest.skip("neither onnxruntime nor openvino is installed")
    shapes = ["gqa:1,4,2,8,8,8", "c:1,2,2,8,12,8,causal", "cm:2,2,2,8,8,8,causal,padding"]
    rows = bench.run_suite(shapes, threads=[1], impls=["sdpa"] + impls, error_rows=0, **FAST)
    status = {impl: {row["shape"]: row["impls"][impl]["status"] for row in rows} for impl in impls}
    if "ort-mha" in impls:
        assert status["ort-mha"] == {"gqa": "unsupported", "c": "unsupported", "cm": "ok"}
        assert "grouped-query" in rows[0]["impls"]["ort-mha"]["reason"]
    if "openvino" in impls:
        assert status["openvino"] == {"gqa": "ok", "c": "ok", "cm": "unsupported"}
        assert "ignores attention_mask" in rows[2]["impls"]["openvino"]["reason"]
    assert "unsup" in bench.format_table(rows)


def test_a_wrong_peer_is_reported_not_timed(monkeypatch):
    """A peer whose output is off by 1e-3 (a wrong mask or scale would be far off) is
    reported as disagreeing with sdpa, once per shape, and not timed at any thread count."""
    prepare = peers.prepare
    calls = []

    def wrong(name, *args, **kwargs):
        prepared = prepare(name, *args, **kwargs)
        if name == "sdpa":
            return prepared

        def call():
            calls.append(name)
            return prepared.call() + 1e-3

        return peers.Prepared(call, prepared.output, prepared.kernel, prepared.kernel_how)

    monkeypatch.setattr(peers, "prepare", wrong)
    rows = bench.run_suite(["tm-pad:3,4,4,16,40,8,padding"], threads=[1, 2], impls=["sdpa"] + AVAILABLE_PEERS, **FAST)
    assert sorted(calls) == sorted(AVAILABLE_PEERS)  # each one's warm-up, checked, then nothing
    for row in rows:
        assert row["impls"]["sdpa"]["status"] == "ok"
        for impl in AVAILABLE_PEERS:
            r = row["impls"][impl]
            assert r["status"] == "mismatch" and "median_s" not in r and "times_s" not in r
            assert "differs from sdpa's by up to 0.001" in r["reason"] and "not timed" in r["reason"]
            assert r["agreement"]["agrees"] is False and r["agreement"]["threads"] == 1
            assert row["sdpa_over"][impl] is None
    line = bench.format_table(rows).splitlines()[2].split()
    assert line[:2] == ["tm-pad", "1"] and line[3 : 3 + len(AVAILABLE_PEERS)] == ["WRONG"] * len(AVAILABLE_PEERS)
    notes = describe_skips(rows)
    for impl in AVAILABLE_PEERS:
        assert any(f"{impl} mismatch (output differs from sdpa's" in note for note in notes), impl


def test_agreement():
    a = np.array([[0.5, -1.0], [np.nan, 2.0]], dtype=np.float32)
    verdict = peers.agreement(a + 1e-6, a, "float32")
    assert verdict["agrees"] and verdict["max_abs_diff"] == pytest.approx(1e-6, rel=0.1)
    assert not peers.agreement(a + 1e-3, a, "float32")["agrees"]
    assert peers.agreement(a + 1e-3, a, "bfloat16")["agrees"]  # 16-bit tolerance
    b = a.copy()
    b[0, 0] = np.nan
    verdict = peers.agreement(b, a, "float32")
    assert not verdict["agrees"] and math.isnan(verdict["max_abs_diff"])
    assert not peers.agreement(a[:1], a, "float32")["agrees"]
    assert peers.check_dtype(np.dtype(np.float32), "bfloat16") == "bfloat16"
    assert peers.check_dtype(np.dtype(np.float64)) == "float64"


def test_absent_peers_are_reported(monkeypatch):
    monkeypatch.setattr(peers, "_load_onnxruntime", lambda: None)
    monkeypatch.setattr(peers.packages, "_ort_error", "onnxruntime is not installed")
    monkeypatch.setattr(peers, "_load_openvino", lambda: None)
    monkeypatch.setattr(peers.packages, "_openvino_error", "openvino is not installed")
    rows = bench.run_suite([TINY], threads=[1], impls=["sdpa", "ort", "ort-mha", "openvino"], **FAST)
    impls = rows[0]["impls"]
    assert impls["ort"] == impls["ort-mha"] == {"status": "absent", "reason": "onnxruntime is not installed"}
    assert impls["openvino"] == {"status": "absent", "reason": "openvino is not installed"}
    assert bench.format_table(rows).splitlines()[2].split()[3:6] == ["absent"] * 3
    assert "tiny: openvino absent (openvino is not installed)" in describe_skips(rows)


def test_cli_masked_shapes(tmp_path, capsys):
    """The masked/unmasked column, the notes and the JSON of a masked run."""
    path = tmp_path / "bench.json"
    argv = CLI_FAST[:]
    argv[1] = "tm:1,2,2,16,24,8,dense-bool,tp:2,2,2,8,24,8,padding"
    assert bench.main(argv + ["--impls", "sdpa,numpy", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    header = out.split("\n\n", 1)[1].splitlines()[0]
    assert header.split()[:4] == ["shape", "threads", "sdpa", "GFLOP/s"] and "masked/unmasked" in header
    assert "ort GFLOP/s" not in header  # only the implementations asked for
    assert "masked/unmasked: sdpa's speed with the mask over its speed without it" in out
    assert "kernels: sdpa fused; numpy unfused" in out
    assert "checked against sdpa's once per shape (np.allclose, rtol=0.0001, atol=1e-05 in float32)" in out
    data = json.loads(path.read_text())
    assert data["settings"]["kernels"]["ort"] == "unfused" and data["settings"]["agreement_tolerance"]["float32"]
    assert "onnxruntime" in data["machine"] and "openvino" in data["machine"]
    for row in data["results"]:
        assert row["mask"] in ("dense-bool", "padding") and row["sdpa_mask_speed"] > 0
        assert row["impls"]["numpy"]["agreement"]["agrees"] is True


# --------------------------------------------------------------------------- cache mode

#: Bound on a step's max error against float64 attention over the float32 keys and
#: values of TINY_DECODE (standard normal, E = 8), by cache dtype: the storage rounding
#: dominates (int8: half a step of max|x| / 127 per element, up to about 0.02).
CACHE_ERR = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "int8": 2e-2, "int8:4": 2e-2, "float8_e4m3fn": 6e-2,
             "float8_e5m2:4": 1.2e-1, "int4:8": 2e-1, "int8+iqk": 4e-2, "int4:8+iqk": 2e-1}


def test_cache_shapes_are_the_documented_ones():
    assert [(s.name, s.B, s.Hq, s.Hkv, s.L, s.S, s.E) for s in bench.CACHE_SHAPES] == [
        ("decode-gqa-32k", 1, 32, 8, 1, 32768, 128),
        ("decode-gqa-4k", 1, 32, 8, 1, 4096, 128),
    ]
    assert bench.CACHE_DTYPES == ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2",
                                  "int4:32", "int8+iqk", "int4:32+iqk")


def test_parse_cache_dtypes():
    assert bench.parse_cache_dtypes("float32, int8:4,int8,float32") == ["float32", "int8:4", "int8"]
    assert bench.parse_cache_dtypes("int4:32+iqk,float8_e5m2:16,int8+iqk") == ["int4:32+iqk", "float8_e5m2:16",
                                                                              "int8+iqk"]
    assert bench.parse_cache_dtypes("int8+ipv,int4:32+iqk+ipv,int8+ipv+iqk") == ["int8+ipv", "int4:32+iqk+ipv",
                                                                              "int8+ipv+iqk"]
    assert bench.split_spec("int4:32+iqk+ipv") == ("int4", 32, True, True)
    assert bench.split_spec("int8+ipv") == ("int8", None, False, True)
    for bad in ("int3", "int8:0", "int8:x", "float32:2", "float64", " , ", "float8_e4m3fn+iqk", "int8+x",
                "float32+iqk", "float8_e5m2+ipv", "int8+ipv+ipv", "int8+"):
        with pytest.raises(ValueError, match="cache dtype|at least one"):
            bench.parse_cache_dtypes(bad)


def test_alternating_loop_times_rotates_the_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times, numbers = bench.alternating_loop_times(fns, min_time=0.0, repeat=4)
    assert numbers == {"a": 1, "b": 1, "c": 1} and all(len(t) == 4 for t in times.values())
    # one loop each to pick the counts, then the rounds, each starting one further on
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab" + "abc"
    times, numbers = bench.alternating_loop_times({"s": lambda: time.sleep(0.001)}, min_time=0.02, repeat=2)
    assert numbers["s"] >= 8 and all(t >= 0.001 for t in times["s"])


def test_run_cache_on_a_tiny_decode(refs):
    specs = ["float32", "float16", "int8", "int8:4", "float8_e4m3fn", "float8_e5m2:4", "int4:8", "int8+iqk",
             "int4:8+iqk"] + ([] if _ml_dtypes_missing else ["bfloat16"])
    rows = bench.run_cache([TINY_DECODE], threads=[1, 2], cache_dtypes=specs, references=refs, **FAST)
    assert [(r["shape"], r["threads"]) for r in rows] == [("tiny-decode", 1), ("tiny-decode", 2)]
    rows_kv = 1 * 2 * 64  # B * Hkv * S
    expected_bytes = {
        "float32": rows_kv * 16 * 4,
        "bfloat16": rows_kv * 16 * 2,
        "float16": rows_kv * 16 * 2,
        "int8": rows_kv * (16 + 2 * 4),  # one float32 scale per key row and per value row
        "int8:4": rows_kv * (16 + 4 * 4),  # two per row of 8 features each
        "float8_e4m3fn": rows_kv * (16 + 2 * 4),
        "float8_e5m2:4": rows_kv * (16 + 2 * 2 * 4),  # two scales a row of 8
        "int4:8": rows_kv * (8 + 2 * 4),  # half a byte a value, one scale a row of 8
        "int8+iqk": rows_kv * (16 + 2 * 4),
        "int4:8+iqk": rows_kv * (8 + 2 * 4),
    }
    for row in rows:
        assert row["baseline"] == "float32" and row["dtype"] == "float32" and row["error_rows"] == 1
        assert list(row["caches"]) == specs
        assert row["bandwidth_gbps"] > 0
        for spec, r in row["caches"].items():
            assert r["status"] == "ok", (spec, r)
            assert r["bytes"] == expected_bytes[spec], spec
            assert r["rounds"] == len(r["times_s"]) == 2 and r["calls_per_round"] == 1
            assert r["median_s"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
            assert r["pct_bandwidth"] == pytest.approx(100 * r["gbps"] / row["bandwidth_gbps"])
            assert r["speedup"] == pytest.approx(row["caches"]["float32"]["median_s"] / r["median_s"])
            assert 0 <= r["max_abs_err"] < CACHE_ERR[spec], (spec, r["max_abs_err"])
        # rounding the cache costs accuracy; the float32 one has float32 arithmetic alone
        assert row["caches"]["int8"]["max_abs_err"] > 10 * row["caches"]["float32"]["max_abs_err"]
    lines = bench.format_cache_table(rows).splitlines()
    assert lines[0].split() == ["shape", "threads", "cache", "MiB", "ms", "GB/s", "%", "bw", "vs", "float32", "err"]
    assert [line.split()[2] for line in lines[2:]] == specs * 2
    assert lines[2].split()[7] == "1.00x"


def test_run_cache_reports_what_it_cannot_make(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    specs = ["int8", "bfloat16", "int8:3"]
    rows = bench.run_cache([TINY_DECODE], threads=[1], cache_dtypes=specs, error_rows=0, **FAST)
    caches = rows[0]["caches"]
    assert caches["int8"]["status"] == "ok" and caches["int8"]["speedup"] == 1.0
    assert "max_abs_err" not in caches["int8"]
    reason = "a bfloat16 cache needs ml_dtypes (pip install ml_dtypes)"
    assert caches["bfloat16"] == {"status": "absent", "reason": reason}
    assert caches["int8:3"]["status"] == "unsupported" and "must divide head_dim" in caches["int8:3"]["reason"]
    lines = bench.format_cache_table(rows).splitlines()
    assert "err" not in lines[0]
    assert lines[3].split() == ["tiny-decode", "1", "bfloat16", "absent"]
    assert lines[4].split() == ["tiny-decode", "1", "int8:3", "unsup"]
    notes = bench.cache_notes(rows)
    assert notes[-2] == "bfloat16 absent (a bfloat16 cache needs ml_dtypes (pip install ml_dtypes))"
    assert notes[-1].startswith("int8:3 unsupported (group_size: 3 must divide head_dim (8)")
    assert not any(note.startswith("err:") for note in notes)


def test_cli_cache_dtypes(tmp_path, capsys):
    """--cache-dtypes alone: every cache dtype, the table, the notes and the JSON."""
    path = tmp_path / "cache.json"
    argv = ["--cache-dtypes", "--shapes", TINY_DECODE, "--threads", "1", "--min-time", "0", "--repeat", "1"]
    argv += ["--bandwidth-mib", "1", "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "float32 query, float32, bfloat16, float16, int8, float8_e4m3fn, float8_e5m2, int4:32, int8+iqk, " \
        "int4:32+iqk caches" in out
    assert "gemm" not in out and "read bandwidth" in out
    assert "ms: median of 1 round alternating between the caches" in out
    assert "int8 and float8: one byte each, int4: half a byte, and their float32 scales" in out
    assert ("bfloat16 absent" in out) == _ml_dtypes_missing
    data = json.loads(path.read_text())
    settings = data["settings"]
    assert settings["mode"] == "cache" and settings["cache_dtypes"] == list(bench.CACHE_DTYPES)
    assert data["references"]["gemm"]["results"] == []
    [row] = data["cache"]
    assert list(row["caches"]) == list(bench.CACHE_DTYPES)
    statuses = {spec: r["status"] for spec, r in row["caches"].items()}
    bf16 = "absent" if _ml_dtypes_missing else "ok"
    # groups of 32 do not fit the tiny shape's 8 features
    want = {spec: bf16 if spec == "bfloat16" else "unsupported" if ":32" in spec else "ok"
            for spec in bench.CACHE_DTYPES}
    assert statuses == want
    assert row["caches"]["int8"]["bytes"] < row["caches"]["float16"]["bytes"] < row["caches"]["float32"]["bytes"]


def test_cli_cache_dtypes_quick(capsys):
    argv = ["--cache-dtypes", "int8,float32", "--quick", "--threads", "1", "--min-time", "0", "--repeat", "1"]
    assert bench.main(argv + ["--bandwidth-mib", "0", "--error-rows", "0", "--no-progress"]) == 0
    lines = capsys.readouterr().out.split("\n\n", 1)[1].splitlines()
    assert lines[0].split()[-2:] == ["vs", "int8"]  # the first dtype is the baseline
    assert [line.split()[:3] for line in lines[2:4]] == [["decode-gqa-4k", "1", d] for d in ("int8", "float32")]


def test_cli_cache_dtypes_rejects(capsys):
    base = ["--no-progress", "--cache-dtypes"]
    assert bench.main(base + ["int3"]) == 2
    assert "cache dtype 'int3'" in capsys.readouterr().err
    for extra in (["--latency"], ["--impls", "sdpa"], ["--dtype", "float16"], ["--kv-dtype", "float16"]):
        assert bench.main(base + ["int8"] + extra) == 2, extra
        assert "--cache-dtypes" in capsys.readouterr().err


def test_cli_profile_reports_the_phases(tmp_path, capsys):
    """--profile: ns per score per core of each phase of the tiled path, per
    shape and kernel set; a decoding shape says it ran the row path."""
    path = tmp_path / "profile.json"
    args = ["--profile", "--shapes", "tiny:1,4,2,40,72,16,causal," + TINY_DECODE, "--threads", "1,2",
            "--impls", "sdpa,sdpa@scalar", "--repeat", "2", "--no-progress", "--json", str(path)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    for column in ("pack", "qk", "mask", "softmax", "pv", "epilogue", "around", "wall"):
        assert column in out
    assert "row path" in out
    rows = json.loads(path.read_text())["results"]
    assert [(r["shape"], r["threads"], r["impl"]) for r in rows] == [
        (s, n, i) for s in ("tiny", "tiny-decode") for n in (1, 2) for i in ("sdpa", "sdpa@scalar")]
    for r in rows[:4]:
        assert r["status"] == "ok"
        assert r["scores_per_call"] > 0 and r["wall"] > 0
        assert r["total"] == pytest.approx(sum(r["phases"].values()))
        assert r["around"] == pytest.approx(r["total"] - r["phases"]["qk"] - r["phases"]["pv"])
    assert rows[1]["isa"] == "scalar"
    assert all(r["status"].startswith("row path") for r in rows[4:])


def test_cli_profile_rejects_peers_and_other_modes(capsys):
    assert bench.main(["--profile", "--impls", "sdpa,torch", "--no-progress"]) == 2
    assert "sdpa@SET" in capsys.readouterr().err
    assert bench.main(["--profile", "--latency", "--no-progress"]) == 2
    assert "mode of its own" in capsys.readouterr().err


def test_cli_paged_smoke(tmp_path, capsys, monkeypatch):
    """--paged at a tiny size: every case runs, the JSON has a row per case."""
    from sdpa.bench import paged

    monkeypatch.setattr(paged, "_QUICK", {"decode": 48, "prefill": 64, "prefix": 32, "mla": 64})
    path = tmp_path / "paged.json"
    rc = bench.main(["--paged", "--quick", "--threads", "1", "--min-time", "0", "--repeat", "1",
               "--bandwidth-mib", "4", "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    names = [name for name, _ in paged.PAGED_CASES if paged.case_available(name)]  # bfloat16: ml_dtypes
    for name in names:
        assert name in out
    rows = json.loads(path.read_text())["results"]
    assert [r["case"] for r in rows] == names
    assert all(r["median_s"]["paged"] > 0 for r in rows)
    speeds = {r["case"]: r["speed"] for r in rows}
    assert "duplicated" in speeds["shared-prefix"] and "contiguous" in speeds["decode-f32-bs16"]
    assert bench.main(["--paged", "--latency"]) == 2


def test_cli_backward_smoke(tmp_path, capsys, monkeypatch):
    """--backward at a tiny size: every case runs, the JSON has the ratios the
    targets are stated in; an unknown case is an error."""
    from sdpa.bench import training

    monkeypatch.setattr(training, "_SIZES", {"B": 1, "H": 2, "S": 512, "E": 32})
    path = tmp_path / "backward.json"
    rc = bench.main(["--backward", "--quick", "--threads", "1", "--min-time", "0", "--repeat", "1",
                     "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    names = [name for name, _ in training.BACKWARD_CASES if training.backward_case_available(name)]
    rows = json.loads(path.read_text())["results"]
    assert [r["case"] for r in rows] == names
    for r in rows:
        assert r["case"] in out
        key = "backward_over_forward" if r["case"].startswith("backward") else (
            "dropout_speed" if r["case"].startswith("dropout") else "vs_torch")
        assert r[key] > 0
    assert bench.main(["--backward", "--cases", "nothing"]) == 2


def test_cli_sparse_smoke(tmp_path, capsys, monkeypatch):
    """--sparse at a tiny size: every case runs against its references, the
    indexer against its roofline, the JSON has a row per case."""
    from sdpa.bench import sparse

    monkeypatch.setattr(sparse, "_SIZES", {"S": 4096, "k": 256, "L": 160})
    monkeypatch.setattr(sparse, "_BLOCK_L", 1024)
    monkeypatch.setattr(sparse, "_FLEX_L", 2048)
    monkeypatch.setattr(sparse, "_SCORES", {"S": 4096, "L": 512})
    path = tmp_path / "sparse.json"
    rc = bench.main(["--sparse", "--quick", "--threads", "1", "--min-time", "0", "--repeat", "1",
                     "--bandwidth-mib", "4", "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    names = [name for name, _ in sparse.SPARSE_CASES if sparse.case_available(name)]
    for name in names:
        assert name in out
    rows = json.loads(path.read_text())["results"]
    assert [r["case"] for r in rows] == names
    assert all(r["median_s"]["sparse"] > 0 for r in rows)
    by = {r["case"]: r for r in rows}
    assert by["decode-f32-random"]["vs_dense"] > 0 and by["decode-f32-random"]["vs_dense_cold"] > 0
    assert 0 < by["indexer-f32"]["of_roofline"]
    assert by["blocks-f32-10"]["vs_dense"] > 0 and by["scores-decode"]["overhead"]
    if "flex-doc-f32" in by:
        assert by["flex-doc-f32"]["vs_torch"] > 0
    assert bench.main(["--sparse", "--latency"]) == 2
    assert bench.main(["--sparse", "--cases", "nope"]) == 2


def test_cli_serving_smoke(tmp_path, capsys, monkeypatch):
    """--serving at a tiny size: the cases asked for run, each against its
    other ways, the JSON has a row per case."""
    from sdpa.bench import serving

    monkeypatch.setattr(serving, "_QUICK", {"varlen": 64, "context": 64, "prompt": 512, "decode": 256})
    path = tmp_path / "serving.json"
    rc = bench.main(["--serving", "--quick", "--threads", "1", "--min-time", "0", "--repeat", "1", "--no-progress",
                     "--cases", "dense,varlen-short,mixed,chunks,shared,decode-scalar", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    names = [r["case"] for r in rows]
    assert names[:5] == ["dense", "varlen-short", "mixed", "chunks", "shared"]
    assert all(n.startswith("decode-scalar-") for n in names[5:]) and len(names) > 5
    speeds = {r["case"]: r["speed"] for r in rows}
    assert "per-sequence" in speeds["varlen-short"] and "separate" in speeds["mixed"]
    assert "contiguous" in speeds["chunks"] and "copied-ids" in speeds["shared"]
    assert all(r["gflops"] > 0 for r in rows)
    assert "of dense" in out
    assert bench.main(["--serving", "--latency"]) == 2


def test_cli_plan_balance(capsys):
    """--plan: every serving case planned for the thread counts asked, its
    balance simulated (a ratio in (0, 1])."""
    from sdpa.bench.plan import PLAN_CASES, balance

    assert bench.main(["--plan", "--threads", "4,64", "--cases", "varlen-long,mixed"]) == 0
    out = capsys.readouterr().out
    assert "varlen-long" in out and "mixed" in out and "varlen-short" not in out
    # the costliest task last: one thread runs it after two of the others (6 against the ideal 4)
    assert balance([1.0] * 8, 4) == 1.0 and balance([1.0, 1.0, 1.0, 1.0, 4.0], 2) == pytest.approx(4 / 6)
    assert [name for name, _ in PLAN_CASES] == ["varlen-short", "varlen-long", "mixed", "shared"]
    assert bench.main(["--plan", "--cases", "nonsense"]) == 2


# --------------------------------------------------------------------------- roofline report

def test_step_operations_count_the_products_where_they_run():
    shape = bench.parse_shape("s:2,8,2,1,100,16")
    per = 2.0 * 2 * 2 * 100 * 4 * 16  # 2 x batch x Hkv x S x rows a head x E
    assert bench.step_operations(shape, "float32") == {"float_ops": 2 * per, "int_ops": 0}
    assert bench.step_operations(shape, "int8+iqk") == {"float_ops": per, "int_ops": per}
    assert bench.step_operations(shape, "int4:8+ipv") == {"float_ops": per, "int_ops": per}
    assert bench.step_operations(shape, "int8+iqk+ipv") == {"float_ops": 0, "int_ops": 2 * per}


def test_machine_limits_are_measured():
    limits = bench.measure_limits([1, 2], bandwidth_mib=4, repeat=1, peak_seconds=0.01)
    for n in (1, 2):
        lim = limits[n]
        assert lim["read_gbps"] > 0 and lim["fma_gops"] > 0 and lim["dot_gops"] > 0
        assert lim["fma_probe"] in ("avx512", "avx2", "neon", "portable")
        assert lim["dot_probe"] in ("avx512_vnni", "avx_vnni", "neon_dotprod", "portable")


def test_cli_roofline(tmp_path, capsys):
    path = tmp_path / "roofline.json"
    argv = ["--roofline", "--shapes", "tiny:1,4,2,1,512,64", "--threads", "1", "--min-time", "0", "--repeat", "1",
            "--bandwidth-mib", "4", "--no-progress", "--cache-dtypes", "float32,int8,int8+iqk+ipv,int4:32+ipv",
            "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 thread: read" in out and "int8 dot products" in out and "of roofline" in out
    data = json.loads(path.read_text())
    assert data["settings"]["mode"] == "roofline"
    lim = data["limits"]["1"]
    [row] = data["roofline"]
    for r in row["caches"].values():
        assert r["status"] == "ok"
        assert r["roofline_s"] == max(r["bytes_s"], r["ops_s"]) > 0
        assert r["bytes_s"] == pytest.approx(r["bytes"] / (lim["read_gbps"] * 1e9))
        assert r["of_roofline"] == pytest.approx(r["roofline_s"] / r["median_s"])
        assert r["bound"] in ("bytes", "ops")
    assert row["caches"]["int8+iqk+ipv"]["float_ops"] == 0
    assert bench.main(["--roofline", "--latency"]) == 2
