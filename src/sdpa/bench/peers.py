"""The implementations being timed: sdpa, a textbook NumPy version, and PyTorch."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import numpy as np

from .. import scaled_dot_product_attention as _sdpa
from ..reference import causal_mask
from .shapes import GiB, Shape, score_bytes

__all__ = ["IMPLEMENTATIONS", "NUMPY_MAX_SCORE_BYTES", "numpy_attention", "make_runner", "skip_reason"]

IMPLEMENTATIONS = ("sdpa", "numpy", "torch")

#: NumPy's version builds the whole score matrix; above this many bytes it is skipped.
NUMPY_MAX_SCORE_BYTES = 2 * GiB


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> np.ndarray:
    """Textbook attention in the inputs' dtype: full score matrix, softmax, then P V.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev); Hq a multiple of Hkv (GQA).
    """
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    # query heads of one group side by side, so K and V broadcast instead of being copied
    qg = q.reshape(B, Hkv, group, L, E)
    kg = k[:, :, None]
    vg = v[:, :, None]
    scores = qg @ np.swapaxes(kg, -1, -2)  # (B, Hkv, group, L, S)
    scores *= 1.0 / math.sqrt(E)
    if causal:
        np.copyto(scores, -np.inf, where=~causal_mask(L, S))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ vg  # (B, Hkv, group, L, Ev)
    return out.reshape(B, Hq, L, v.shape[-1])


_torch_module: Any = None
_torch_error: Optional[str] = None


def _load_torch() -> Any:
    """``torch`` when it can be imported, else None (the reason is kept for the report)."""
    global _torch_module, _torch_error
    if _torch_module is None and _torch_error is None:
        try:
            import torch  # noqa: PLC0415 - optional, heavy

            _torch_module = torch
        except ImportError as exc:
            missing = getattr(exc, "name", None) == "torch"
            _torch_error = "torch is not installed" if missing else f"torch cannot be imported ({exc})"
    return _torch_module


def make_runner(
    impl: str, shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int
) -> Callable[[], Any]:
    """A zero-argument callable that computes the attention once with ``impl``."""
    if impl == "sdpa":
        gqa = shape.gqa
        causal = shape.causal

        def run_sdpa() -> Any:
            return _sdpa(q, k, v, is_causal=causal, enable_gqa=gqa, num_threads=threads)

        return run_sdpa

    if impl == "numpy":

        def run_numpy() -> Any:
            return numpy_attention(q, k, v, shape.causal)

        return run_numpy

    if impl == "torch":
        torch = _load_torch()
        F = torch.nn.functional
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        kwargs: Dict[str, Any] = {"is_causal": shape.causal}
        if shape.gqa:
            try:
                with torch.inference_mode():
                    F.scaled_dot_product_attention(tq[:, :, :1], tk[:, :, :1], tv[:, :, :1], enable_gqa=True)
                kwargs["enable_gqa"] = True
            except TypeError:  # older torch: expand K and V to every query head up front
                group = shape.Hq // shape.Hkv
                tk = tk.repeat_interleave(group, dim=1)
                tv = tv.repeat_interleave(group, dim=1)

        def run_torch() -> Any:
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, **kwargs)

        return run_torch

    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")


def skip_reason(impl: str, shape: Shape, itemsize: int, numpy_max_bytes: int) -> Optional[str]:
    """Why ``impl`` is not run on ``shape`` (too much memory, torch missing), or None."""
    if impl == "numpy":
        need = score_bytes(shape, itemsize)
        if need > numpy_max_bytes:
            return f"score matrix needs {need / GiB:.1f} GiB (limit {numpy_max_bytes / GiB:.1f} GiB)"
    if impl == "torch" and _load_torch() is None:
        return _torch_error
    return None
