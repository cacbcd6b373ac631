"""torch tensors as NumPy arrays and back, over the same memory: the one
conversion of :mod:`sdpa.torch` and :mod:`sdpa.transformers` (imported by
them, never by ``import sdpa``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._dtypes import NEEDS_ML_DTYPES

#: The tensor dtypes sdpa computes natively.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SINGLE_OR_HALF = (torch.float32, torch.bfloat16, torch.float16)

_bfloat16: Any = None  # ml_dtypes.bfloat16, once a bfloat16 tensor has come


def numpy_bfloat16() -> Any:
    """NumPy's bfloat16 dtype (ml_dtypes'); a TypeError saying how to get it."""
    global _bfloat16
    if _bfloat16 is None:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(NEEDS_ML_DTYPES) from None
        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


def eager_numpy(t: Tensor) -> Any:
    """The memory of a tensor that requires no grad as a NumPy array, no copy
    (bfloat16 as ml_dtypes' bfloat16)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_bfloat16())
    return t.numpy()


def as_numpy(t: Tensor) -> Any:
    """:func:`eager_numpy` of ``t.detach()``: the data without the autograd history."""
    return eager_numpy(t.detach())


def as_tensor(a: np.ndarray) -> Tensor:
    """A NumPy result as a tensor over the same memory."""
    if a.dtype.kind == "V":  # ml_dtypes' bfloat16 (asking a dtype its name costs a microsecond)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def check_on_cpu(t: Any, name: str) -> None:
    """ValueError naming ``name`` for a tensor that is not on the CPU."""
    if isinstance(t, Tensor) and t.device.type != "cpu":
        raise ValueError(f"{name}: sdpa runs on the CPU; got a tensor on {t.device}")
