"""pytest-benchmark suite: sdpa and PyTorch on the shapes of ``python -m sdpa.bench``.

    pytest benchmarks --benchmark-only                       # time the default subset
    SDPA_BENCH_ALL=1 pytest benchmarks --benchmark-only      # the full-size shapes
    pytest benchmarks --benchmark-disable -q                 # run each case once (CI)

By default every shape is scaled down (prefill L and S to at most 512, batch to at
most 2, decode S to at most 4096) and the largest shapes are left out, so the
whole run stays short on a small machine.  SDPA_BENCH_ALL=1 uses the sizes as
listed in ``sdpa.bench.SHAPES``.  SDPA_BENCH_THREADS=1,4 picks the thread counts
(default: 1 and all CPUs).  Inputs are float32; PyTorch cases are skipped when
torch is not installed.  The masked shapes (``mask-*``) are left to
``python -m sdpa.bench``, which gives every implementation the same mask.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import sdpa
from sdpa.bench import SHAPES, Shape, attention_flops, kv_bytes

pytest.importorskip("pytest_benchmark")

RUN_ALL = os.environ.get("SDPA_BENCH_ALL", "").strip() not in ("", "0")

#: Shapes that take minutes per case at full size; only run with SDPA_BENCH_ALL=1.
FULL_SIZE_ONLY = {"long-16k"}

MAX_PREFILL_LEN = 512
MAX_DECODE_LEN = 4096
MAX_BATCH = 2


def _thread_counts():
    text = os.environ.get("SDPA_BENCH_THREADS", "").strip()
    if text:
        return list(dict.fromkeys(int(t) for t in text.split(",") if t.strip()))
    n = os.cpu_count() or 1
    return [1] if n == 1 else [1, n]


def _scaled(shape: Shape) -> Shape:
    """The shape itself under SDPA_BENCH_ALL, else a smaller one with the same heads and E."""
    if RUN_ALL:
        return shape
    if shape.decode:
        S = min(shape.S, MAX_DECODE_LEN)
        L = 1
    else:
        L = min(shape.L, MAX_PREFILL_LEN)
        S = min(shape.S, MAX_PREFILL_LEN)
    B = min(shape.B, MAX_BATCH)
    if (B, L, S) == (shape.B, shape.L, shape.S):
        return shape
    return dataclasses.replace(shape, name=f"{shape.name}@{S if shape.decode else L}", B=B, L=L, S=S)


def _shape_params():
    params = []
    for shape in SHAPES:
        if shape.mask:  # masked shapes: python -m sdpa.bench gives every implementation the mask
            continue
        marks = []
        if shape.name in FULL_SIZE_ONLY and not RUN_ALL:
            marks.append(pytest.mark.skip(reason="full-size shape; set SDPA_BENCH_ALL=1"))
        params.append(pytest.param(shape, id=_scaled(shape).name, marks=marks))
    return params


THREADS = _thread_counts()


@pytest.fixture(scope="module")
def inputs_cache():
    """float32 q, k, v per shape, made once and shared by every case of that shape."""
    cache = {}

    def get(shape: Shape):
        if shape.name not in cache:
            cache.clear()  # keep one shape's inputs alive at a time
            rng = np.random.default_rng(0)
            q = rng.standard_normal((shape.B, shape.Hq, shape.L, shape.E), dtype=np.float32)
            k = rng.standard_normal((shape.B, shape.Hkv, shape.S, shape.E), dtype=np.float32)
            v = rng.standard_normal((shape.B, shape.Hkv, shape.S, shape.Ev), dtype=np.float32)
            cache[shape.name] = (q, k, v)
        return cache[shape.name]

    return get


@pytest.fixture
def torch_threads():
    """torch, with its thread count restored after the test."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def _describe(benchmark, shape: Shape, threads: int, impl: str) -> None:
    benchmark.group = f"{shape.name} threads={threads}"
    benchmark.extra_info.update(
        impl=impl,
        threads=threads,
        shape=dataclasses.asdict(shape),
        flops=attention_flops(shape),
        kv_bytes=kv_bytes(shape, 4),
    )


def _record_rates(benchmark, shape: Shape) -> None:
    """GFLOP/s (and GB/s for decode) of the median time, into the saved extra_info."""
    stats = getattr(benchmark, "stats", None)
    median = getattr(getattr(stats, "stats", None), "median", None)
    if median:
        benchmark.extra_info["gflops"] = attention_flops(shape) / median / 1e9
        if shape.decode:
            benchmark.extra_info["gbps"] = kv_bytes(shape, 4) / median / 1e9


def _check(out, shape: Shape) -> None:
    assert tuple(out.shape) == (shape.B, shape.Hq, shape.L, shape.Ev)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("threads", THREADS, ids=lambda n: f"t{n}")
@pytest.mark.parametrize("full_shape", _shape_params())
def test_sdpa(benchmark, inputs_cache, full_shape, threads):
    shape = _scaled(full_shape)
    q, k, v = inputs_cache(shape)
    _describe(benchmark, shape, threads, "sdpa")
    out = benchmark(
        sdpa.scaled_dot_product_attention,
        q,
        k,
        v,
        is_causal=shape.causal,
        enable_gqa=shape.gqa,
        num_threads=threads,
    )
    _record_rates(benchmark, shape)
    _check(out, shape)


@pytest.mark.parametrize("threads", THREADS, ids=lambda n: f"t{n}")
@pytest.mark.parametrize("full_shape", _shape_params())
def test_torch(benchmark, inputs_cache, torch_threads, full_shape, threads):
    torch = torch_threads
    shape = _scaled(full_shape)
    q, k, v = (torch.from_numpy(a) for a in inputs_cache(shape))
    torch.set_num_threads(threads)
    kwargs = {"is_causal": shape.causal}
    if shape.gqa:
        kwargs["enable_gqa"] = True
    sdpa_fn = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.inference_mode():
            return sdpa_fn(q, k, v, **kwargs)

    _describe(benchmark, shape, threads, "torch")
    out = benchmark(run)
    _record_rates(benchmark, shape)
    _check(out, shape)
