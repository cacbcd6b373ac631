"""The implementations being timed: sdpa, a textbook NumPy version, PyTorch and ONNX Runtime."""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from .. import scaled_dot_product_attention as _sdpa
from ..reference import causal_mask
from .onnxgraph import INPUT_NAMES, OUTPUT_NAME, attention_model
from .shapes import HALF_DTYPES, GiB, Shape, score_bytes
from .threads import SdpaThreads, TorchThreads

__all__ = [
    "IMPLEMENTATIONS",
    "LATENCY_IMPLEMENTATIONS",
    "NUMPY_MAX_SCORE_BYTES",
    "numpy_attention",
    "make_runner",
    "skip_reason",
    "peer_note",
    "make_latency_runner",
    "latency_absent_reason",
    "latency_scope",
]

#: The throughput suite's implementations.
IMPLEMENTATIONS = ("sdpa", "numpy", "torch")

#: The latency mode's: sdpa on NumPy arrays and on torch tensors, torch's own
#: function, and ONNX Runtime's Attention operator.
LATENCY_IMPLEMENTATIONS = ("sdpa", "sdpa.torch", "torch", "ort")

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
        tq, tk, tv, kwargs = _torch_inputs(shape, q, k, v)

        def run_torch() -> Any:
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, **kwargs)

        return run_torch

    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")


def _tensor(a: np.ndarray) -> Any:
    """A CPU tensor sharing the array's memory (ml_dtypes' bfloat16 as torch.bfloat16)."""
    torch = _load_torch()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _torch_inputs(
    shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray
) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """q, k, v as tensors sharing the arrays' memory, and the keywords of torch's function.

    torch's function takes one dtype for all three: a query of another dtype than the
    key and value (a float32 query against a 16-bit cache) is cast to theirs, here,
    once (see :func:`peer_note`).
    """
    torch = _load_torch()
    F = torch.nn.functional
    tq, tk, tv = (_tensor(a) for a in (q, k, v))
    if tq.dtype != tk.dtype:
        tq = tq.to(tk.dtype)
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
    return tq, tk, tv, kwargs


def skip_reason(
    impl: str, shape: Shape, itemsize: int, numpy_max_bytes: int, dtypes: Sequence[np.dtype] = ()
) -> Optional[str]:
    """Why ``impl`` is not run on ``shape`` with operands of ``dtypes`` (a 16-bit one for
    NumPy, too much memory, torch missing), or None."""
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
    if impl == "torch" and _load_torch() is None:
        return _torch_error
    return None


def peer_note(impl: str, dtype: np.dtype, kv_dtype: np.dtype) -> Optional[str]:
    """What differs in how ``impl`` runs a query of ``dtype`` against k and v of ``kv_dtype``:
    torch casts the query to the cache's dtype, since its function takes one dtype."""
    if impl == "torch" and np.dtype(dtype) != np.dtype(kv_dtype):
        return (
            f"query cast to {np.dtype(kv_dtype).name} once, outside the timed calls "
            f"(torch takes one dtype for q, k and v); its output is {np.dtype(kv_dtype).name}"
        )
    return None


# --------------------------------------------------------------------------- latency mode

_ort_module: Any = None
_ort_error: Optional[str] = None


def _load_onnxruntime() -> Any:
    """``onnxruntime`` when it can be imported, else None (the reason is kept for the report)."""
    global _ort_module, _ort_error
    if _ort_module is None and _ort_error is None:
        try:
            import onnxruntime  # noqa: PLC0415 - optional

            _ort_module = onnxruntime
        except ImportError as exc:
            missing = getattr(exc, "name", None) == "onnxruntime"
            _ort_error = (
                "onnxruntime is not installed" if missing else f"onnxruntime cannot be imported ({exc})"
            )
    return _ort_module


def latency_absent_reason(impl: str) -> Optional[str]:
    """Why ``impl`` cannot run here (its package is not installed), or None."""
    if impl in ("sdpa.torch", "torch") and _load_torch() is None:
        return _torch_error
    if impl == "ort" and _load_onnxruntime() is None:
        return _ort_error
    return None


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


def _ort_runner(shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> Callable[[], Any]:
    """ONNX Runtime's Attention operator (opset 23) in a session of ``threads`` intra-op threads.

    Inputs and output are bound once to the arrays' memory (io_binding), so a call is
    the session's run alone, writing into the same output array each time.
    """
    ort = _load_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    model = attention_model(q.shape, k.shape, v.shape, shape.causal, q.dtype)
    session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
    out = np.empty(q.shape[:3] + v.shape[3:], dtype=q.dtype)
    binding = session.io_binding()
    for name, array in zip(INPUT_NAMES, (q, k, v)):
        binding.bind_cpu_input(name, array)
    binding.bind_output(OUTPUT_NAME, "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
    run = session.run_with_iobinding

    def run_ort() -> Any:
        run(binding)
        return out

    return run_ort


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
