"""Sizes past 2**31: more scores than an int32 can count, element offsets that an
int32 cannot hold, and weights too large for the machine.

Always run (a few seconds in all):

* more than 2**31 scores in one call (L * S > 2**31, E = Ev = 1), checked on
  every row against what any softmax average must satisfy and on a few rows
  against the reference;
* element offsets past 2**31 in every operand, without the memory: strided
  views into sparse anonymous mappings (only the pages a view touches are ever
  backed by memory);
* ``return_weights`` larger than physical memory raises ``MemoryError`` at once,
  before anything is allocated.

Set ``SDPA_LARGE_TESTS=1`` to also run the heavy ones (about 12 GiB of free
memory needed; they are skipped with the reason otherwise): a contiguous
float32 value array of more than 2**31 elements, and a bool mask plus
``return_weights`` with L * S > 2**31.
"""
from __future__ import annotations

import mmap
import os
import resource
import sys
import time

import numpy as np
import pytest

import sdpa
from conftest import seed_for
from sdpa import _core

attention = sdpa.scaled_dot_product_attention
reference = sdpa.reference.scaled_dot_product_attention

GiB = 2**30
LARGE = os.environ.get("SDPA_LARGE_TESTS") == "1"


def available_memory() -> int:
    """Bytes of memory free for a new allocation: the larger of the kernel's free
    pages (os.sysconf) and, on Linux, MemAvailable, which counts reclaimable cache."""
    free = 0
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = max(free, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return free


def heavy(gib: float):
    """Skip unless SDPA_LARGE_TESTS=1 and ``gib`` GiB of memory are free."""
    if not LARGE:
        return pytest.mark.skip(reason=f"needs ~{gib:g} GiB and a minute; set SDPA_LARGE_TESTS=1 to run")
    free = available_memory()
    return pytest.mark.skipif(
        free < gib * GiB, reason=f"needs {gib:g} GiB of free memory, {free / GiB:.1f} GiB available"
    )


def max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# --------------------------------------------------------------------------- > 2**31 scores


@pytest.mark.parametrize("is_causal", [False, "bottom_right"])
def test_more_than_2_31_scores(is_causal):
    if _core.isa() == "scalar" and not LARGE:
        pytest.skip("the portable kernels take ~25 s for 2**31 scores; set SDPA_LARGE_TESTS=1 to run")
    L, S = 65536, 32769  # L * S = 2**31 + 65536
    assert L * S > 2**31
    rng = np.random.default_rng(seed_for(f"2**31-scores-{is_causal}"))
    q = rng.standard_normal((L, 1)).astype(np.float32)
    k = rng.standard_normal((S, 1)).astype(np.float32)
    v = rng.integers(-8, 8, size=(S, 1)).astype(np.float32)
    out = attention(q, k, v, is_causal=is_causal)
    assert out.shape == (L, 1)

    # every row is an average of the values it sees; rows that see none are zeros
    first_blind = 0
    if is_causal == "bottom_right":
        first_blind = L - S  # rows l < L - S see no key
        assert (out[:first_blind] == 0).all()
        lo = np.minimum.accumulate(v[:, 0])
        hi = np.maximum.accumulate(v[:, 0])
        seen = np.arange(first_blind, L) - first_blind  # last key each row sees
        lo, hi = lo[seen], hi[seen]
    else:
        lo, hi = v.min(), v.max()
    rows_out = out[first_blind:, 0]
    assert np.isfinite(rows_out).all()
    slack = 1e-5 * 8
    assert (rows_out >= lo - slack).all() and (rows_out <= hi + slack).all()

    # a few rows against the reference, including the last ones, whose scores sit
    # past index 2**31 of the L x S matrix
    rows = np.array([0, 1, first_blind, L // 2, L - S + 17, L - 2, L - 1])
    mask = None
    if is_causal:
        mask = np.arange(S)[None, :] <= (rows[:, None] + S - L)
    expected = reference(q[rows], k, v, mask)
    np.testing.assert_allclose(out[rows], expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- far offsets, sparse


MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class Sparse:
    """Views with element offsets past 2**31 into anonymous mappings whose
    untouched pages are never backed by memory."""

    def __init__(self):
        self.maps = []

    def view(self, shape, dtype, strides, *, start=0):
        """A view of ``shape`` with element ``strides`` (any sign); element
        [0, ..., 0] sits ``start`` elements into its mapping."""
        dtype = np.dtype(dtype)
        lo = start + sum(min(0, st * (n - 1)) for n, st in zip(shape, strides))
        hi = start + sum(max(0, st * (n - 1)) for n, st in zip(shape, strides))
        assert lo >= 0, "the view starts before its mapping"
        nbytes = ((hi + 1) * dtype.itemsize + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        except (OSError, ValueError, OverflowError) as exc:
            pytest.skip(f"cannot map {nbytes / GiB:.0f} GiB of address space: {exc}")
        self.maps.append(mm)
        base = np.frombuffer(mm, dtype=dtype)
        return np.lib.stride_tricks.as_strided(
            base[start:], shape=shape, strides=tuple(st * dtype.itemsize for st in strides)
        )

    def close(self):
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass


@pytest.fixture
def sparse():
    s = Sparse()
    yield s
    s.close()


FAR = 2**31 + 4099  # an element distance no int32 can hold


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sparse anonymous mappings (Linux)")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "L,hq,hkv,S",
    [(2, 4, 2, 1500), (70, 2, 1, 300)],
    ids=["row-path", "tiled-path"],
)
def test_element_offsets_past_2_31(sparse, dtype, L, hq, hkv, S):
    rng = np.random.default_rng(seed_for(f"far-{L}-{np.dtype(dtype).name}"))
    B, E, Ev = 2, 16, 8
    row = FAR // (S - 1) + 1  # consecutive keys a page or more apart
    # query: batch dim FAR apart, rows read backwards
    q = sparse.view((B, hq, L, E), dtype, (FAR, L * E, -E, 1), start=(L - 1) * E)
    # key: rows far apart (row index * stride > 2**31), batch and heads beyond that
    k = sparse.view((B, hkv, S, E), dtype, (hkv * S * row, S * row, row, 1))
    # value: features 3 apart, rows far apart, heads reversed
    v = sparse.view((B, hkv, S, Ev), dtype, (hkv * S * row, -S * row, row, 3), start=(hkv - 1) * S * row)
    # bool mask with a batch stride past 2**31
    mask = sparse.view((B, 1, L, S), np.bool_, (FAR, 0, S, 1))
    # output with heads FAR apart
    out = sparse.view((B, hq, L, Ev), dtype, (hq * FAR, FAR, Ev, 1))
    for a in (q, k, v):
        a[...] = rng.standard_normal(a.shape)
    mask[...] = rng.random(mask.shape) < 0.8
    for a in (q, k, v, mask, out):  # every operand spans more than 2**31 elements
        assert sum(abs(st) // a.itemsize * (n - 1) for n, st in zip(a.shape, a.strides)) > 2**31

    before = max_rss_bytes()
    compact = [np.array(a) for a in (q, k, v, mask)]
    for kwargs in ({}, {"is_causal": "bottom_right", "key_lengths": np.array([S, S // 2 + 1])}):
        result = attention(q, k, v, mask, enable_gqa=hq != hkv, out=out, **kwargs)
        assert result is out
        expected = reference(*compact, enable_gqa=hq != hkv, **kwargs)
        tol = 2e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
        # and so does the same call on compact copies
        plain = attention(*compact, enable_gqa=hq != hkv, **kwargs)
        np.testing.assert_allclose(out, plain, rtol=tol, atol=tol)
    assert max_rss_bytes() - before < 1 * GiB


# --------------------------------------------------------------------------- weights too large


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weights_larger_than_memory_raise_before_allocating(dtype):
    # zero-stride views: the inputs take no memory, the weights would take 16 TiB
    L = S = 1 << 20
    q = np.broadcast_to(np.asarray(0.5, dtype), (4, L, 64))
    k = np.broadcast_to(np.asarray(0.25, dtype), (4, S, 64))
    v = np.broadcast_to(np.asarray(1.0, dtype), (4, S, 1))
    before = max_rss_bytes()
    t0 = time.perf_counter()
    with pytest.raises(MemoryError, match="return_weights"):
        attention(q, k, v, return_weights=True)
    assert time.perf_counter() - t0 < 5
    assert max_rss_bytes() - before < 256 * 2**20


def test_weights_whose_size_overflows_int64_raise_memory_error():
    # Ev = 0 keeps the output empty; the weights would have 2**80 elements
    q = np.broadcast_to(np.float32(1), (1 << 20, 1 << 20, 1 << 20, 1))
    k = np.broadcast_to(np.float32(1), (1, 1, 1 << 20, 1))
    v = np.broadcast_to(np.float32(1), (1, 1, 1 << 20, 0))
    with pytest.raises(MemoryError, match="return_weights"):
        attention(q, k, v, return_weights=True)
    out = attention(q, k, v)
    assert out.shape == (1 << 20, 1 << 20, 1 << 20, 0)


# --------------------------------------------------------------------------- heavy


@heavy(12)
def test_contiguous_value_array_past_2_31_elements():
    """A float32 V of 2**31 + 4096 elements (8 GiB), read in place."""
    E, Ev = 1, 64
    S = (2**31 + 4096) // Ev
    v = np.zeros((S, Ev), dtype=np.float32)
    assert v.size > 2**31
    k = np.zeros((S, E), dtype=np.float32)
    far = [S - 1, S - 5, 2**31 // Ev + 3]  # keys whose V rows start past element 2**31
    near = [0, 5]
    for j, key in enumerate(far + near):
        v[key] = np.arange(Ev, dtype=np.float32) * (j + 1) / Ev
    k[far] = 10.0  # with q = 1: scores 10 for the far keys, 0 elsewhere
    boost = np.exp(np.float64(10.0))
    weights = np.ones(S)
    weights[far] = boost
    expected_row = (weights[:, None][far + near] * v[far + near].astype(np.float64)).sum(0) / weights.sum()

    # The row path (L = 1) combines 32768 chunk partials of 1024 keys, in double
    # precision, so it stays as close as the tiled path (L = 16).
    for L, rtol in ((1, 1e-5), (16, 1e-5)):
        q = np.ones((L, E), dtype=np.float32)
        out = attention(q, k, v, scale=1.0)
        np.testing.assert_allclose(out, np.broadcast_to(expected_row, (L, Ev)), rtol=rtol, atol=1e-7)


@heavy(12)
def test_mask_and_weights_past_2_31_elements():
    """A (L, S) bool mask of 2**31 + 65536 bytes and float32 weights of the same
    number of elements (8 GiB)."""
    L, S = 65536, 32769
    rng = np.random.default_rng(seed_for("2**31-mask"))
    q = rng.standard_normal((L, 1)).astype(np.float32)
    k = rng.standard_normal((S, 1)).astype(np.float32)
    v = rng.standard_normal((S, 1)).astype(np.float32)
    mask = np.ones((L, S), dtype=bool)
    rows = np.array([0, 1, L // 2, L - 2, L - 1])
    mask[rows[:, None], rng.integers(0, S, size=(len(rows), 100))] = False
    mask[L - 1, : S // 2] = False  # the last row: past element 2**31 of the mask
    out, weights = attention(q, k, v, mask, return_weights=True)
    expected_out, expected_w = reference(q[rows], k, v, mask[rows], return_weights=True)
    np.testing.assert_allclose(out[rows], expected_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(weights[rows], expected_w, rtol=1e-4, atol=1e-7)
    assert (weights[L - 1, : S // 2] == 0).all()
