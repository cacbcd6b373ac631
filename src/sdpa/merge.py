"""Combining attention computed over disjoint chunks of the keys.

Attention over all keys can be computed piece by piece: split the keys (and
values) into chunks, attend the queries to each chunk with ``return_lse=True``,
and merge the partial results.  With ``lse_i`` the log-sum-exp of a row's scores
over chunk ``i`` and ``out_i`` its softmax-weighted values,

    m   = max_i lse_i
    w_i = exp(lse_i - m)
    out = sum_i w_i out_i / sum_i w_i
    lse = m + log(sum_i w_i)

which is the attention over the union of the chunks, and its log-sum-exp.  This
is what split-key decoding, ring attention and paged caches are built on.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple, Union

import numpy as np

from ._dtypes import _check_real, _is_bfloat16

__all__ = ["merge_attention"]

ArrayOrSequence = Union[np.ndarray, Sequence[Any]]


def _split(arg: Any, name: str) -> List[np.ndarray]:
    """A sequence of arrays, or one array stacked along axis 0, as a list."""
    if isinstance(arg, (list, tuple)):
        parts = [np.asarray(a) for a in arg]
    elif isinstance(arg, np.ndarray) or hasattr(arg, "__array__"):
        stacked = np.asarray(arg)
        if stacked.ndim < 1:
            raise ValueError(
                f"{name}: expected a sequence of arrays or an array stacked along axis 0, "
                f"got a scalar"
            )
        parts = list(stacked)
    else:
        try:
            parts = [np.asarray(a) for a in arg]
        except TypeError:
            raise TypeError(
                f"{name}: expected a sequence of arrays or an array stacked along axis 0, "
                f"got {type(arg).__name__}"
            ) from None
    if not parts:
        raise ValueError(f"{name}: needs at least one chunk, got none")
    for i, a in enumerate(parts):
        _check_real(a, f"{name}[{i}]")
    return parts


def merge_attention(
    outputs: ArrayOrSequence, lses: ArrayOrSequence
) -> Tuple[np.ndarray, np.ndarray]:
    """Merge attention results over disjoint chunks of the keys.

    Parameters
    ----------
    outputs : sequence of arrays of shape (..., L, Ev), or one array (n, ..., L, Ev)
        The attention output of each chunk, e.g. from
        ``scaled_dot_product_attention(q, k_i, v_i, return_lse=True)``.
    lses : sequence of arrays of shape (..., L), or one array (n, ..., L)
        The matching log-sum-exp of each chunk's scaled, masked scores; ``-inf``
        for a row that sees no key of that chunk.

    Returns
    -------
    output : numpy.ndarray, shape (..., L, Ev)
        The attention output over all the chunks' keys.  Rows whose lses are all
        ``-inf`` (no key visible anywhere) give zeros.
    lse : numpy.ndarray, shape (..., L)
        The log-sum-exp over all the chunks' keys (``-inf`` for such rows).

    Both are of the result dtype of the inputs (NumPy's promotion; float64 when
    every input is an integer or bool array).  float16 and bfloat16 (ml_dtypes)
    are computed in float32.  A row whose largest lse is ``+inf`` (a sink of
    ``+inf`` given to one chunk) gets the mean of the outputs of its chunks at
    ``+inf`` (zeros, for a sink's chunk) and an lse of ``+inf``, as one call over
    all the keys gives.

    Raises
    ------
    ValueError
        No chunks, different numbers of outputs and lses, or shapes that do not
        fit (every output must have the same shape, every lse that shape without
        its last dim).
    TypeError
        Inputs that are not real numbers.

    Examples
    --------
    >>> import numpy as np, sdpa
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 16))          # (heads, L, E)
    >>> k = rng.standard_normal((2, 10, 16))         # (heads, S, E)
    >>> v = rng.standard_normal((2, 10, 8))          # (heads, S, Ev)
    >>> parts = [sdpa.scaled_dot_product_attention(q, k[:, a:b], v[:, a:b], return_lse=True)
    ...          for a, b in [(0, 4), (4, 10)]]
    >>> out, lse = sdpa.merge_attention([o for o, _ in parts], [s for _, s in parts])
    >>> full, full_lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full) and np.allclose(lse, full_lse))
    True
    """
    outs = _split(outputs, "outputs")
    ls = _split(lses, "lses")
    if len(outs) != len(ls):
        raise ValueError(
            f"outputs and lses: expected one lse per output, got {len(outs)} outputs and "
            f"{len(ls)} lses"
        )
    out_shape = outs[0].shape
    if len(out_shape) < 2:
        raise ValueError(
            f"outputs[0]: expected at least 2 dims (..., L, Ev), got shape {out_shape}"
        )
    for i, o in enumerate(outs):
        if o.shape != out_shape:
            raise ValueError(
                f"outputs: every chunk's output must have the same shape; outputs[0] has "
                f"shape {out_shape}, outputs[{i}] has shape {o.shape}"
            )
    lse_shape = out_shape[:-1]
    for i, s in enumerate(ls):
        if s.shape != lse_shape:
            raise ValueError(
                f"lses[{i}]: expected shape {lse_shape} (the outputs' shape {out_shape} "
                f"without its last dim), got shape {s.shape}"
            )

    dtype = np.result_type(*outs, *ls)
    if _is_bfloat16(dtype):
        compute = np.dtype(np.float32)
    else:
        if dtype.kind != "f":
            dtype = np.dtype(np.float64)
        compute = np.promote_types(dtype, np.float32)

    lse_all = np.stack([s.astype(compute, copy=False) for s in ls])
    m = np.max(lse_all, axis=0)
    # rows that see no key anywhere: every lse is -inf; shift by 0 there so that
    # exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan
    seen = ~np.isneginf(m)
    shift = np.where(seen, m, 0)
    with np.errstate(invalid="ignore"):
        weights = np.exp(lse_all - shift)
    # rows whose largest lse is +inf (a sink of +inf): the chunks at +inf weigh
    # 1 each, the others 0, and the merged lse is +inf, as one call over all the
    # keys gives
    top = np.isposinf(m)
    if top.any():
        weights = np.where(top, np.isposinf(lse_all).astype(compute), weights)
    denom = np.sum(weights, axis=0)

    acc = np.zeros(out_shape, dtype=compute)
    for w, o in zip(weights, outs):
        acc += w[..., None] * o.astype(compute, copy=False)
    has_mass = denom > 0
    out = np.divide(acc, denom[..., None], out=np.zeros_like(acc), where=has_mass[..., None])
    lse = np.full(lse_shape, -np.inf, dtype=compute)
    np.log(denom, out=lse, where=has_mass)
    lse += shift  # +inf rows: log(count) + inf = +inf
    # nan anywhere in a row's lses stays nan in that row's results
    nan_rows = np.isnan(m)
    if nan_rows.any():
        out[nan_rows] = np.nan
        lse[nan_rows] = np.nan
    return out.astype(dtype, copy=False), lse.astype(dtype, copy=False)
