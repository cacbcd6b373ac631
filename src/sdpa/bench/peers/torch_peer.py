"""PyTorch's ``scaled_dot_product_attention``: tensors over the arrays and the
backend torch picks."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..shapes import Shape
from .common import KERNELS, _static
from .packages import _load_torch

# --------------------------------------------------------------------------- torch


def _tensor(a: np.ndarray) -> Any:
    """A CPU tensor sharing the array's memory (ml_dtypes' bfloat16 as torch.bfloat16)."""
    torch = _load_torch()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _torch_inputs(
    shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray] = None
) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """q, k, v as tensors sharing the arrays' memory, and the keywords of torch's function.

    torch's function takes one dtype for all three: a query of another dtype than the
    key and value (a float32 query against a 16-bit cache) is cast to theirs, here,
    once (see :func:`peer_note`), and so is a float mask.
    """
    torch = _load_torch()
    F = torch.nn.functional
    tq, tk, tv = (_tensor(a) for a in (q, k, v))
    if tq.dtype != tk.dtype:
        tq = tq.to(tk.dtype)
    kwargs: Dict[str, Any] = {"is_causal": shape.causal}
    if mask is not None:
        tmask = _tensor(mask)
        if tmask.dtype != torch.bool and tmask.dtype != tq.dtype:
            tmask = tmask.to(tq.dtype)
        kwargs["attn_mask"] = tmask
    if shape.gqa:
        try:
            with torch.inference_mode():
                F.scaled_dot_product_attention(tq[:, :, :1], tk[:, :, :1], tv[:, :, :1], enable_gqa=True)
            kwargs["enable_gqa"] = True
        except TypeError:  # older torch: expand K and V to every query head up front
            group = shape.Hq // shape.Hkv
            tk = tk.repeat_interleave(group, dim=1)
            tv = tv.repeat_interleave(group, dim=1)
    return tq, tk, tv, kwargs


#: torch's backends (``torch.nn.attention.SDPBackend``) that are fused kernels.
_TORCH_FUSED_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _torch_kernel(tq: Any, tk: Any, tv: Any, kwargs: Dict[str, Any]) -> Tuple[str, str]:
    """The kernel torch's dispatcher picks for these inputs, from ``torch._fused_sdp_choice``
    (the function it asks itself) where that exists, else :data:`KERNELS`."""
    torch = _load_torch()
    try:
        choice = int(torch._fused_sdp_choice(tq, tk, tv, dropout_p=0.0, **kwargs))
        from torch.nn.attention import SDPBackend  # noqa: PLC0415

        backends: Dict[str, Any] = dict(SDPBackend.__members__)
        name = next(n for n, b in backends.items() if int(b) == choice)
    except Exception:  # noqa: BLE001 - a private function: fall back on the table
        return KERNELS["torch"], _static("torch")
    kernel = "fused" if name in _TORCH_FUSED_BACKENDS else "unfused"
    return kernel, f"torch._fused_sdp_choice: {name}"
