"""The error columns: each output against a float64 reference on a sample of query rows.

The reference is :func:`sdpa.reference.scaled_dot_product_attention` in float64, on
the very values every implementation was given (16-bit inputs converted to float64
exactly).  It builds the whole score matrix, so on large problems it is computed for
a sample of query rows only: the first, the last and random ones, as
``benchmarks/accuracy.py`` does.  Each output row depends on its own query row alone,
so the sample is exact for the rows it covers; with a causal mask those rows see only
the keys up to the last sampled row, and the reference reads no further.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..reference import causal_mask, scaled_dot_product_attention as _reference
from .shapes import Shape

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


def reference_sample(
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    max_rows: int = ERROR_ROWS,
    seed: int = 0,
) -> ReferenceSample:
    """The float64 reference of ``shape`` on at most ``max_rows`` query rows of q, k, v."""
    rows = sample_rows(shape.L, max_rows, seed)
    q64 = q[:, :, rows].astype(np.float64)
    mask: Optional[np.ndarray] = None
    if shape.causal:
        # top-left causal: query row l sees keys 0..l, so nothing past the last sampled row
        seen = min(shape.S, int(rows[-1]) + 1)
        k, v = k[:, :, :seen], v[:, :, :seen]
        mask = causal_mask(shape.L, seen)[rows]
    expected = _reference(
        q64,
        k.astype(np.float64),
        v.astype(np.float64),
        attn_mask=mask,
        enable_gqa=shape.gqa,
    )
    return ReferenceSample(rows, np.asarray(expected))


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
