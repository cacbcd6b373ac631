"""The error columns: each output against a float64 reference on a sample of query rows.

The reference is :func:`sdpa.reference.scaled_dot_product_attention` in float64, on
the very values every implementation was given (16-bit inputs converted to float64
exactly).  It builds the whole score matrix, so on large problems it is computed for
a sample of query rows only: the first, the last and random ones, as
``benchmarks/accuracy.py`` does.  Each output row depends on its own query row alone,
so the sample is exact for the rows it covers; with a causal mask those rows see only
the keys up to the last sampled row, and the reference reads no further.  An
attention mask is given to the reference on the sampled rows, as the implementations
were given it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..reference import scaled_dot_product_attention as _reference
from .shapes import Shape
from .threads import BlasThreads

__all__ = ["ERROR_ROWS", "ReferenceSample", "sample_rows", "reference_sample", "max_abs_error"]

#: Query rows checked against the reference per problem (every row when L is at most this).
ERROR_ROWS = 64


def sample_rows(L: int, n: int, seed: int = 0) -> np.ndarray:
    """``n`` sorted query-row indices out of ``L``: 0, ``L - 1`` and random others (all when L <= n)."""
    if L <= n:
        return np.arange(L)
    rng = np.random.default_rng(seed)
    middle = rng.choice(np.arange(1, L - 1), size=max(n - 2, 0), replace=False)
    return np.sort(np.concatenate([[0, L - 1], middle]).astype(np.intp))


@dataclass(frozen=True)
class ReferenceSample:
    """The float64 reference output on some query rows: ``expected`` is (B, Hq, len(rows), Ev)."""

    rows: np.ndarray
    expected: np.ndarray


def _float64(a: np.ndarray) -> np.ndarray:
    """``a`` in float64, exactly; 16-bit arrays go through float32 (exact too, and much
    faster than ml_dtypes' direct cast of bfloat16)."""
    if a.dtype.itemsize == 2:
        a = a.astype(np.float32)
    return a.astype(np.float64)


def reference_sample(
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    max_rows: int = ERROR_ROWS,
    seed: int = 0,
    attn_mask: Optional[np.ndarray] = None,
) -> ReferenceSample:
    """The float64 reference of ``shape`` on at most ``max_rows`` query rows of q, k, v
    (and ``attn_mask``, broadcastable to (B, Hq, L, S), when the problem has one).

    It runs one key/value head at a time, so that float64 copies of K and V never
    exceed one head's; the query heads sharing that head (grouped-query attention) are
    handed to it as more rows, so K and V are not repeated per query head either.
    """
    rows = sample_rows(shape.L, max_rows, seed)
    n, group = rows.size, shape.Hq // shape.Hkv
    S = shape.S
    causal: Optional[np.ndarray] = None
    if shape.causal:
        # top-left causal: query row l sees keys 0..l, so nothing past the last sampled row
        S = min(S, int(rows[-1]) + 1)
        causal = np.tile(np.arange(S)[None, :] <= rows[:, None], (group, 1))
    given: Optional[np.ndarray] = None
    if attn_mask is not None:
        # (B, Hq, n, S) on the sampled rows, float masks in float64 (-inf stays -inf)
        m = np.asarray(attn_mask)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        m = np.broadcast_to(m, (shape.B, shape.Hq, shape.L, shape.S))[:, :, rows, :S]
        given = m if m.dtype == np.bool_ else _float64(m)
    # (B, Hq, n, E) -> (B, Hkv, group * n, E): the query heads of a group one after another
    q64 = _float64(q[:, :, rows]).reshape(shape.B, shape.Hkv, group * n, shape.E)
    expected = np.empty((shape.B, shape.Hkv, group * n, v.shape[-1]))
    # products this thin run faster, and far more steadily, on one BLAS thread
    with BlasThreads(1):
        for b in range(shape.B):
            for h in range(shape.Hkv):
                kh, vh = _float64(k[b, h, :S]), _float64(v[b, h, :S])
                mask = causal
                if given is not None:
                    gm = given[b, h * group : (h + 1) * group].reshape(group * n, S)
                    if mask is None:
                        mask = gm
                    elif gm.dtype == np.bool_:
                        mask = mask & gm
                    else:
                        mask = np.where(mask, gm, -np.inf)
                expected[b, h] = _reference(q64[b, h], kh, vh, attn_mask=mask)
    return ReferenceSample(rows, expected.reshape(shape.B, shape.Hq, n, -1))


def _rows_float64(out: Any, rows: np.ndarray) -> np.ndarray:
    """The sampled query rows of an output (a NumPy array or a torch tensor) in float64."""
    if isinstance(out, np.ndarray):
        return out[:, :, rows].astype(np.float64)
    import torch  # noqa: PLC0415 - only torch's outputs come here

    picked = out.index_select(2, torch.from_numpy(rows.astype(np.int64)))
    return np.asarray(picked.to(torch.float64).numpy())


def max_abs_error(out: Any, sample: ReferenceSample) -> float:
    """The largest absolute difference between ``out`` and the reference on the sampled rows
    (``nan`` when the output holds a NaN)."""
    got = _rows_float64(out, sample.rows)
    if got.shape != sample.expected.shape:
        raise ValueError(f"output rows of shape {got.shape}, the reference's are {sample.expected.shape}")
    diff = np.abs(got - sample.expected)
    if not np.all(np.isfinite(diff)):
        return math.nan
    return float(diff.max()) if diff.size else 0.0
