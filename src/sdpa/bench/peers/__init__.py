"""The implementations being timed: sdpa, a textbook NumPy version, and the peers
PyTorch, ONNX Runtime (two operators) and OpenVINO.

Each is prepared once per (shape, thread count) by :func:`prepare`: whatever a caller
would do once (tensors over the arrays, a session or a compiled model, bindings of
inputs and outputs, a copy into another layout) happens there, outside the timed
calls, and the result says how to read the output in sdpa's layout and which kernel
ran.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ... import _core, scaled_dot_product_attention as _sdpa
from ..shapes import HALF_DTYPES, GiB, Shape, score_bytes
from ..threads import SdpaThreads, TorchThreads
from . import packages as _packages
from .common import (
    AGREEMENT_TOLERANCE,
    FLOAT32_PEERS,
    IMPLEMENTATIONS,
    KERNEL_SET_PREFIX as KERNEL_SET_PREFIX,
    KERNELS,
    LATENCY_IMPLEMENTATIONS,
    NUMPY_MAX_SCORE_BYTES,
    Prepared,
    _same,
    _static,
    is_implementation as is_implementation,
    kernel_set as kernel_set,
    kernel_set_of as kernel_set_of,
    ordered as ordered,
)
from .numpy_peer import _mask4, numpy_attention
from .openvino_peer import _openvino
from .ort_peer import _ort_attention, _ort_mha, _ort_runner
from .packages import _load_onnxruntime, _load_openvino, _load_torch
from .torch_peer import _torch_inputs, _torch_kernel

__all__ = [
    "IMPLEMENTATIONS",
    "FLOAT32_PEERS",
    "LATENCY_IMPLEMENTATIONS",
    "NUMPY_MAX_SCORE_BYTES",
    "KERNELS",
    "AGREEMENT_TOLERANCE",
    "Prepared",
    "numpy_attention",
    "prepare",
    "make_runner",
    "absent_reason",
    "skip_reason",
    "unsupported_reason",
    "peer_note",
    "agreement",
    "check_dtype",
    "output_array",
    "make_latency_runner",
    "latency_absent_reason",
    "latency_scope",
]


def absent_reason(impl: str) -> Optional[str]:
    """Why ``impl`` cannot run here (its package is not installed or cannot be imported), or None."""
    isa = kernel_set_of(impl)
    if isa is not None and not _core.isa_supported(isa):
        return f"this CPU (or build) cannot run the {isa} kernel set"
    if impl == "torch" and _load_torch() is None:
        return _packages._torch_error
    if impl in ("ort", "ort-mha") and _load_onnxruntime() is None:
        return _packages._ort_error
    if impl == "openvino" and _load_openvino() is None:
        return _packages._openvino_error
    return None


# --------------------------------------------------------------------------- what runs where


def skip_reason(
    impl: str, shape: Shape, itemsize: int, numpy_max_bytes: int, dtypes: Sequence[np.dtype] = ()
) -> Optional[str]:
    """Why ``impl`` is not run on ``shape`` with operands of ``dtypes`` (a 16-bit one for
    NumPy, too much memory, a dtype other than float32 for the float32 peers), or None."""
    if impl == "numpy":
        half = [np.dtype(d).name for d in dtypes if np.dtype(d).name in HALF_DTYPES]
        if half:
            return (
                f"NumPy has no {half[0]} BLAS matmul: the textbook version would compute in another "
                "dtype"
            )
        need = score_bytes(shape, itemsize)
        if need > numpy_max_bytes:
            return f"score matrix needs {need / GiB:.1f} GiB (limit {numpy_max_bytes / GiB:.1f} GiB)"
    if impl in FLOAT32_PEERS:
        other = [np.dtype(d).name for d in dtypes if np.dtype(d) != np.float32]
        if other:
            return f"run in float32 only here, not {other[0]}"
    return None


def unsupported_reason(impl: str, shape: Shape, mask: Optional[np.ndarray] = None) -> Optional[str]:
    """Why ``impl`` cannot take ``shape`` (with ``mask``) as it is, or None."""
    if impl == "ort-mha":
        if shape.gqa:
            return (
                "MultiHeadAttention has one head count for q, k and v: no grouped-query attention "
                "(k and v would have to be repeated per query head)"
            )
        if shape.causal and shape.L != shape.S:
            return "its causal mask (unidirectional) is defined for L = S only"
        if mask is not None and mask.dtype == np.bool_ and _mask4(mask).shape[1] != 1:
            return "a bool mask per head: its key_padding_mask has no head dimension"
    if impl == "openvino" and shape.causal and mask is not None:
        return "its operator ignores attention_mask when causal is set"
    return None


def peer_note(impl: str, dtype: np.dtype, kv_dtype: np.dtype, shape: Optional[Shape] = None) -> Optional[str]:
    """What differs in how ``impl`` runs a query of ``dtype`` against k and v of ``kv_dtype``
    (torch casts the query to the cache's dtype, since its function takes one dtype),
    and on ``shape`` (layouts and mask forms that a peer needs, made once, untimed)."""
    if impl == "torch" and np.dtype(dtype) != np.dtype(kv_dtype):
        return (
            f"query cast to {np.dtype(kv_dtype).name} once, outside the timed calls "
            f"(torch takes one dtype for q, k and v); its output is {np.dtype(kv_dtype).name}"
        )
    if shape is None:
        return None
    notes: List[str] = []
    if impl == "ort-mha":
        notes.append(
            "q, k and v copied once, untimed, into the operator's layout (B, L or S, H·E); output (B, L, H·Ev)"
        )
        if shape.mask == "padding":
            notes.append("the padding mask as an int32 (B, S) key_padding_mask")
        elif shape.mask == "dense-bool":
            notes.append("the bool mask as an int32 (B, L, S) key_padding_mask")
        elif shape.mask == "dense-float":
            notes.append("the float mask as a (1, 1, L, S) attention_bias")
    if impl == "ort" and shape.mask == "padding":
        notes.append(
            "the (B, 1, 1, S) padding mask broadcast to (B, 1, L, S) once, untimed "
            "(its Attention takes no mask broadcast over L)"
        )
    if impl == "openvino" and shape.gqa:
        notes.append("grouped heads as a 5-D broadcast: q (B, Hkv, group, L, E) against k, v (B, Hkv, 1, S, E)")
    return "; ".join(notes) or None


def prepare(
    impl: str,
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    threads: int,
    mask: Optional[np.ndarray] = None,
) -> Prepared:
    """``impl`` ready to compute the attention of ``shape`` on q, k, v (and ``mask``, when
    the shape has one) with ``threads`` threads.  torch's thread count is the caller's
    to set (``torch.set_num_threads``), and NumPy's BLAS pool's (threadpoolctl)."""
    if impl == "sdpa":
        gqa = shape.gqa
        causal = shape.causal

        def run_sdpa() -> Any:
            return _sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, num_threads=threads)

        return Prepared(run_sdpa, _same, KERNELS["sdpa"], _static("sdpa"))

    isa = kernel_set_of(impl)
    if isa is not None:
        gqa, causal = shape.gqa, shape.causal

        def run_sdpa_on_set() -> Any:
            return _sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, num_threads=threads)

        return Prepared(run_sdpa_on_set, _same, KERNELS["sdpa"], _static("sdpa") + f", kernel set {isa} forced",
                        functools.partial(kernel_set, isa))

    if impl == "numpy":

        def run_numpy() -> Any:
            return numpy_attention(q, k, v, shape.causal, mask)

        return Prepared(run_numpy, _same, KERNELS["numpy"], _static("numpy"))

    if impl == "torch":
        torch = _load_torch()
        F = torch.nn.functional
        tq, tk, tv, kwargs = _torch_inputs(shape, q, k, v, mask)

        def run_torch() -> Any:
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, **kwargs)

        kernel, how = _torch_kernel(tq, tk, tv, kwargs)
        return Prepared(run_torch, _same, kernel, how)

    if impl == "ort":
        return _ort_attention(shape, q, k, v, threads, mask)

    if impl == "ort-mha":
        return _ort_mha(shape, q, k, v, threads, mask)

    if impl == "openvino":
        return _openvino(shape, q, k, v, threads, mask)

    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")


def make_runner(
    impl: str,
    shape: Shape,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    threads: int,
    mask: Optional[np.ndarray] = None,
) -> Callable[[], Any]:
    """A zero-argument callable that computes the attention once with ``impl``
    (:func:`prepare`'s ``call``)."""
    return prepare(impl, shape, q, k, v, threads, mask).call


def output_array(out: Any) -> np.ndarray:
    """An output (a NumPy array or a torch tensor, of any float dtype) as a float64 array."""
    if isinstance(out, np.ndarray):
        if out.dtype.itemsize == 2:  # float16 and bfloat16 via float32, exactly
            out = out.astype(np.float32)
        return out.astype(np.float64)
    torch = _load_torch()
    return np.asarray(out.detach().to(torch.float64).numpy())


def check_dtype(*dtypes: Any) -> str:
    """The dtype whose tolerance an agreement check uses: the coarsest of those given
    (NumPy dtypes, torch dtypes or names)."""
    names = {str(d).replace("torch.", "") for d in dtypes}
    for name in ("bfloat16", "float16", "float32"):
        if name in names:
            return name
    return "float64"


def agreement(out: Any, want: Any, dtype_name: str) -> Dict[str, Any]:
    """How an output agrees with sdpa's (``want``), both in sdpa's layout: the largest
    difference, and whether ``np.allclose`` holds at :data:`AGREEMENT_TOLERANCE`'s
    tolerance for ``dtype_name`` (NaN agreeing with NaN only)."""
    rtol, atol = AGREEMENT_TOLERANCE.get(dtype_name, AGREEMENT_TOLERANCE["float32"])
    got, ref = output_array(out), output_array(want)
    if got.shape != ref.shape:
        reason = f"output of shape {got.shape}, sdpa's is {ref.shape}"
        return {"agrees": False, "max_abs_diff": None, "rtol": rtol, "atol": atol, "reason": reason}
    ok = bool(np.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True))
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - ref)
    finite = diff[np.isfinite(diff)]
    worst = float(finite.max()) if finite.size else 0.0
    if finite.size != diff.size and not np.array_equal(np.isnan(got), np.isnan(ref)):
        worst = math.nan
    return {"agrees": ok, "max_abs_diff": worst, "rtol": rtol, "atol": atol}


# --------------------------------------------------------------------------- latency mode


def latency_absent_reason(impl: str) -> Optional[str]:
    """Why ``impl`` cannot run here (its package is not installed), or None:
    :func:`absent_reason`, sdpa.torch needing torch."""
    return absent_reason("torch" if impl == "sdpa.torch" else impl)


def make_latency_runner(
    impl: str, shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int
) -> Callable[[], Any]:
    """A zero-argument callable computing the attention once with one of
    :data:`LATENCY_IMPLEMENTATIONS`; run it inside :func:`latency_scope`.

    Everything that a caller would do once (tensors over the arrays, the ONNX Runtime
    session and its bindings) is done here, outside the timed calls.
    """
    if impl == "sdpa":
        return make_runner("sdpa", shape, q, k, v, threads)

    if impl in ("sdpa.torch", "torch"):
        tq, tk, tv, kwargs = _torch_inputs(shape, q, k, v)
        if impl == "torch":
            fn = _load_torch().nn.functional.scaled_dot_product_attention
        else:  # sdpa.torch imports torch, so it is imported only now
            fn = importlib.import_module("sdpa.torch").scaled_dot_product_attention

        def run_tensors() -> Any:
            return fn(tq, tk, tv, **kwargs)

        return run_tensors

    if impl == "ort":
        return _ort_runner(shape, q, k, v, threads)

    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(LATENCY_IMPLEMENTATIONS)}")


@contextlib.contextmanager
def latency_scope(impl: str, threads: int) -> Iterator[None]:
    """Where ``impl``'s runner is timed: the torch-based ones under ``torch.no_grad()``,
    torch's with ``torch.set_num_threads(threads)``, sdpa.torch's with
    ``sdpa.set_num_threads(threads)``.  (sdpa is given ``num_threads=`` and ONNX Runtime
    its session's thread count directly.)"""
    if impl not in ("sdpa.torch", "torch"):
        yield
        return
    torch = _load_torch()
    threads_cm: Any = TorchThreads(torch, threads) if impl == "torch" else SdpaThreads(threads)
    with torch.no_grad(), threads_cm:
        yield
