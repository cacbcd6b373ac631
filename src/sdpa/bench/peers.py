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
import os
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core, scaled_dot_product_attention as _sdpa
from ..reference import causal_mask
from .onnxgraph import (
    INPUT_NAMES,
    MASK_NAME,
    MHA_ATTENTION_BIAS,
    MHA_KEY_PADDING_MASK,
    OUTPUT_NAME,
    attention_model,
    mha_model,
)
from .shapes import HALF_DTYPES, GiB, Shape, score_bytes
from .threads import SdpaThreads, TorchThreads

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

#: The throughput suite's implementations: sdpa, the textbook NumPy version, and the
#: peers, each run when its package is installed and reported absent otherwise:
#: torch's ``scaled_dot_product_attention``, ONNX Runtime's ONNX ``Attention`` operator
#: (``ort``) and its ``com.microsoft`` ``MultiHeadAttention`` contrib operator
#: (``ort-mha``), and OpenVINO's ``ScaledDotProductAttention`` (``openvino``).
IMPLEMENTATIONS = ("sdpa", "numpy", "torch", "ort", "ort-mha", "openvino")

#: ``sdpa@SET`` (for example ``sdpa@avx512_bf16``) runs sdpa with the kernel set SET
#: forced for its calls, beside ``sdpa`` on the set chosen for this CPU: two kernel
#: sets of one machine compared in one run.
KERNEL_SET_PREFIX = "sdpa@"


def kernel_set_of(impl: str) -> Optional[str]:
    """The kernel set ``impl`` forces (``sdpa@SET``), or None."""
    return impl[len(KERNEL_SET_PREFIX):] if impl.startswith(KERNEL_SET_PREFIX) else None


def is_implementation(impl: str) -> bool:
    """Whether the suite knows ``impl``: one of :data:`IMPLEMENTATIONS`, or ``sdpa@SET``
    for a kernel set SET of this build (whether the CPU runs it or not)."""
    return impl in IMPLEMENTATIONS or kernel_set_of(impl) in _core.ISAS


def ordered(impls: Iterable[str]) -> List[str]:
    """``impls`` in report order: :data:`IMPLEMENTATIONS`' order, ``sdpa@SET`` after ``sdpa``."""
    def key(impl: str) -> Tuple[int, int]:
        if impl in IMPLEMENTATIONS:
            return (IMPLEMENTATIONS.index(impl), 0)
        isa = kernel_set_of(impl)
        return (0, 1 + (_core.ISAS.index(isa) if isa in _core.ISAS else len(_core.ISAS)))

    return sorted(set(impls), key=key)


#: The peers the suite runs in float32 only (q, k and v all float32).
FLOAT32_PEERS = ("ort", "ort-mha", "openvino")

#: The latency mode's: sdpa on NumPy arrays and on torch tensors, torch's own
#: function, and ONNX Runtime's Attention operator.
LATENCY_IMPLEMENTATIONS = ("sdpa", "sdpa.torch", "torch", "ort")

#: NumPy's version builds the whole score matrix; above this many bytes it is skipped.
NUMPY_MAX_SCORE_BYTES = 2 * GiB

#: The kernel each implementation runs, "fused" (one pass over K and V per block of
#: query rows, no score matrix in memory) or "unfused" (the scores of a whole head, or
#: of all of them, written to memory, then softmax, then P V), as far as it can be told
#: without a profiler.  Where the implementation itself says, that is read at run time
#: instead (see :func:`prepare`): torch's own choice of backend, and the layers of
#: OpenVINO's compiled model.
KERNELS: Dict[str, str] = {
    # sdpa's own kernel: blocks of keys with an online softmax, never the score matrix.
    "sdpa": "fused",
    # numpy_attention below: the whole (B, Hq, L, S) score matrix, softmax, then P V.
    "numpy": "unfused",
    # On CPU, torch's dispatcher picks _scaled_dot_product_flash_attention_for_cpu for
    # float32 (and float64, bfloat16, float16), with masks and grouped heads too; what it
    # picks is read from torch._fused_sdp_choice at run time where that exists.
    "torch": "fused",
    # ONNX Runtime's CPU kernel of the ONNX Attention operator (1.32 and before)
    # computes Q Kᵀ of every head into a (B, H, L, S) buffer, then softmax, then P V:
    # its peak memory grows by that buffer (1 GiB at B=1, H=4, L=S=8192 in float32).
    "ort": "unfused",
    # MultiHeadAttention on CPU runs MLAS's flash attention when it is given neither a
    # mask nor a bias, is not unidirectional (causal), and gets K and V as (B, S, H·E),
    # unless ORT_DISABLE_FLASH_ATTENTION is set; otherwise the same unfused path as
    # above (both seen in the source and in peak memory).  See _ort_mha_kernel.
    "ort-mha": "fused",
    # ScaledDotProductAttention compiles to one fused layer on CPU (the plugin's own
    # SDPA node, or a Snippets subgraph of MatMul, Softmax and MatMul); the compiled
    # model's layers are read at run time, and a separate Softmax layer means unfused
    # (as with grouped heads, given as a 5-D broadcast).
    "openvino": "fused",
}

#: ``(rtol, atol)`` of the check of a peer's output against sdpa's, by the dtype of the
#: coarser of the two outputs: float32 roundoff of a few thousand terms in float32, the
#: rounding of q, k, v or the output in 16 bits.  Outputs of these random problems are
#: about 0.03 to 2 in size, and a wrong mask or scale moves them by about as much.
AGREEMENT_TOLERANCE: Dict[str, Tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-5),
    "float16": (2.0**-8, 2.0**-10),
    "bfloat16": (2.0**-5, 2.0**-7),
}


def _mask4(mask: np.ndarray) -> np.ndarray:
    """A mask broadcastable to (B, Hq, L, S) as a 4-D view (leading dims of 1 added)."""
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _grouped_mask(mask: np.ndarray, Hkv: int, group: int) -> np.ndarray:
    """A mask broadcastable to (B, Hq, L, S) as a view broadcastable to (B, Hkv, group,
    L, S): the query heads of one key/value head side by side."""
    m = _mask4(mask)
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], Hkv, group, m.shape[2], m.shape[3])


def numpy_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, mask: Optional[np.ndarray] = None
) -> np.ndarray:
    """Textbook attention in the inputs' dtype: full score matrix, softmax, then P V.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev); Hq a multiple of Hkv (GQA).
    ``mask``, broadcastable to (B, Hq, L, S): bool (True: takes part) or added to the
    scaled scores.
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
    if mask is not None:
        m = _grouped_mask(mask, Hkv, group)
        if m.dtype == np.bool_:
            np.copyto(scores, -np.inf, where=~m)
        else:
            scores += m
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ vg  # (B, Hkv, group, L, Ev)
    return out.reshape(B, Hq, L, v.shape[-1])


# --------------------------------------------------------------------------- the optional packages

_torch_module: Any = None
_torch_error: Optional[str] = None
_ort_module: Any = None
_ort_error: Optional[str] = None
_openvino_module: Any = None
_openvino_error: Optional[str] = None


def _import_error(name: str, exc: ImportError) -> str:
    """Why an optional package cannot be used: not installed, or failing to import."""
    missing = getattr(exc, "name", None) == name
    return f"{name} is not installed" if missing else f"{name} cannot be imported ({exc})"


def _load_torch() -> Any:
    """``torch`` when it can be imported, else None (the reason is kept for the report)."""
    global _torch_module, _torch_error
    if _torch_module is None and _torch_error is None:
        try:
            import torch  # noqa: PLC0415 - optional, heavy

            _torch_module = torch
        except ImportError as exc:
            _torch_error = _import_error("torch", exc)
    return _torch_module


def _load_onnxruntime() -> Any:
    """``onnxruntime`` when it can be imported, else None (the reason is kept for the report)."""
    global _ort_module, _ort_error
    if _ort_module is None and _ort_error is None:
        try:
            import onnxruntime  # noqa: PLC0415 - optional

            _ort_module = onnxruntime
        except ImportError as exc:
            _ort_error = _import_error("onnxruntime", exc)
    return _ort_module


def _load_openvino() -> Any:
    """``openvino`` when it can be imported, else None (the reason is kept for the report)."""
    global _openvino_module, _openvino_error
    if _openvino_module is None and _openvino_error is None:
        try:
            import openvino  # noqa: PLC0415 - optional, heavy

            _openvino_module = openvino
        except ImportError as exc:
            _openvino_error = _import_error("openvino", exc)
    return _openvino_module


def absent_reason(impl: str) -> Optional[str]:
    """Why ``impl`` cannot run here (its package is not installed or cannot be imported), or None."""
    isa = kernel_set_of(impl)
    if isa is not None and not _core.isa_supported(isa):
        return f"this CPU (or build) cannot run the {isa} kernel set"
    if impl == "torch" and _load_torch() is None:
        return _torch_error
    if impl in ("ort", "ort-mha") and _load_onnxruntime() is None:
        return _ort_error
    if impl == "openvino" and _load_openvino() is None:
        return _openvino_error
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


# --------------------------------------------------------------------------- preparing a run


@dataclass
class Prepared:
    """One implementation made ready for one problem.

    ``call`` computes the attention once (what is timed); ``output`` turns what it
    returns into sdpa's layout, (B, Hq, L, Ev), an array or a tensor (untimed);
    ``kernel`` is "fused" or "unfused" and ``kernel_how`` says how that is known;
    ``setting`` is what the calls run under, entered once around them (sdpa@SET:
    its kernel set).
    """

    call: Callable[[], Any]
    output: Callable[[Any], Any]
    kernel: str
    kernel_how: str
    setting: Callable[[], ContextManager[Any]] = contextlib.nullcontext


@contextlib.contextmanager
def kernel_set(name: str) -> Iterator[None]:
    """sdpa's kernel set forced to ``name`` inside, and the choice before restored
    after: a named set, or the default one (which a refused AMX tile state can
    still turn into avx512_bf16)."""
    named = _core.isa_named()
    _core.set_isa(name)
    try:
        yield
    finally:
        _core.set_isa(named)


def _same(out: Any) -> Any:
    return out


def _static(impl: str) -> str:
    return f"static table (sdpa.bench.peers.KERNELS[{impl!r}])"


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


# --------------------------------------------------------------------------- ONNX Runtime


def _ort_session(model: bytes, threads: int) -> Any:
    """An ONNX Runtime CPU session of ``model``: ``threads`` intra-op threads, one inter-op."""
    ort = _load_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


def _bound_call(session: Any, inputs: Dict[str, np.ndarray], out: np.ndarray) -> Callable[[], Any]:
    """A call of ``session`` with its inputs and its output bound once to the arrays'
    memory (io_binding): a call is the session's run alone, writing into ``out``."""
    binding = session.io_binding()
    for name, array in inputs.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output(OUTPUT_NAME, "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)

    # the binding holds the arrays' addresses only: the defaults keep the arrays alive
    def run_ort(run: Any = session.run_with_iobinding, binding: Any = binding, _held: Any = inputs) -> Any:
        run(binding)
        return out

    return run_ort


def _ort_runner(shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> Callable[[], Any]:
    """ONNX Runtime's Attention operator (opset 23) in a session of ``threads`` intra-op
    threads, inputs and output bound once (the latency mode's; no mask)."""
    return _ort_attention(shape, q, k, v, threads, None).call


def _ort_attention(
    shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int, mask: Optional[np.ndarray]
) -> Prepared:
    """The ONNX ``Attention`` operator (opset 23) on (B, H, L, E) inputs as sdpa takes
    them, grouped heads included, ``mask`` as its ``attn_mask`` input.  ONNX Runtime
    wants the mask's L dimension in full, so a padding mask (B, 1, 1, S) is broadcast to
    (B, 1, L, S) here, once."""
    inputs: Dict[str, np.ndarray] = dict(zip(INPUT_NAMES, (q, k, v)))
    mask_spec = None
    if mask is not None:
        m = mask
        if m.ndim >= 2 and m.shape[-2] != shape.L:
            m4 = _mask4(m)
            m = np.ascontiguousarray(np.broadcast_to(m4, m4.shape[:2] + (shape.L, shape.S)))
        inputs[MASK_NAME] = np.ascontiguousarray(m)
        mask_spec = (m.dtype, m.shape)
    model = attention_model(q.shape, k.shape, v.shape, shape.causal, q.dtype, mask_spec)
    session = _ort_session(model, threads)
    out = np.empty(q.shape[:3] + v.shape[3:], dtype=q.dtype)
    return Prepared(_bound_call(session, inputs, out), _same, KERNELS["ort"], _static("ort") + ", onnxruntime 1.32")


def _packed(a: np.ndarray) -> np.ndarray:
    """(B, H, S, E) as (B, S, H·E), a copy: the heads of one position side by side."""
    B, H, S, E = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(B, S, H * E))


def _ort_mha_kernel(shape: Shape, masked: bool) -> Tuple[str, str]:
    """Which of MultiHeadAttention's CPU paths runs: MLAS's flash attention, or the unfused one."""
    disabled = os.environ.get("ORT_DISABLE_FLASH_ATTENTION", "0").strip().lower() not in ("", "0", "false")
    how = _static("ort-mha") + ": flash attention without a mask, a bias or a causal mask"
    if masked or shape.causal or disabled:
        why = "ORT_DISABLE_FLASH_ATTENTION is set" if disabled else "masked" if masked else "causal"
        return "unfused", f"{how} ({why} here)"
    return "fused", how


def _ort_mha(
    shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int, mask: Optional[np.ndarray]
) -> Prepared:
    """ONNX Runtime's ``com.microsoft`` ``MultiHeadAttention`` operator: q, k and v copied
    once into its (B, L, H·E) layout (so that it can take its flash path), the mask as
    the input that takes it (a bool one as the int32 key_padding_mask, (B, S) for a
    padding mask, (B, L, S) otherwise; a float one as the attention_bias), the causal
    mask as ``unidirectional``."""
    B, H, L, _ = q.shape
    Ev = v.shape[3]
    inputs: Dict[str, np.ndarray] = dict(zip(INPUT_NAMES, (_packed(q), _packed(k), _packed(v))))
    padding = bias = None
    if mask is not None:
        m = _mask4(mask)
        if m.dtype == np.bool_:
            m3 = m[:, 0]  # (B | 1, L | 1, S): one mask for every head (see unsupported_reason)
            if m3.shape[1] == 1:
                padding = np.broadcast_to(m3[:, 0], (B, shape.S)).astype(np.int32)
            else:
                padding = np.broadcast_to(m3, (B, L, shape.S)).astype(np.int32)
            inputs[MHA_KEY_PADDING_MASK] = padding
        else:  # (B | 1, H | 1, L, S): the bias takes no broadcast over L
            bias = np.ascontiguousarray(np.broadcast_to(m, m.shape[:2] + (L, shape.S)), dtype=q.dtype)
            inputs[MHA_ATTENTION_BIAS] = bias
    model = mha_model(
        inputs["query"].shape,
        inputs["key"].shape,
        inputs["value"].shape,
        H,
        q.dtype,
        unidirectional=shape.causal,
        key_padding_mask=None if padding is None else padding.shape,
        attention_bias=None if bias is None else bias.shape,
    )
    session = _ort_session(model, threads)
    out = np.empty((B, L, H * Ev), dtype=q.dtype)

    def to_bhld(o: Any) -> Any:
        return o.reshape(B, L, H, Ev).transpose(0, 2, 1, 3)

    kernel, how = _ort_mha_kernel(shape, mask is not None)
    return Prepared(_bound_call(session, inputs, out), to_bhld, kernel, how)


# --------------------------------------------------------------------------- OpenVINO


def _openvino_opset() -> Any:
    """The newest ``openvino.opsetN`` module that has ``scaled_dot_product_attention``."""
    for version in range(20, 12, -1):
        try:
            module = importlib.import_module(f"openvino.opset{version}")
        except ImportError:
            continue
        if hasattr(module, "scaled_dot_product_attention"):
            return module
    raise RuntimeError("this openvino has no scaled_dot_product_attention operator")


def _openvino(
    shape: Shape, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int, mask: Optional[np.ndarray]
) -> Prepared:
    """OpenVINO's ``ScaledDotProductAttention`` compiled for the CPU with
    ``INFERENCE_NUM_THREADS`` = ``threads``, one stream, and ``INFERENCE_PRECISION_HINT``
    f32 (so that it does not run bfloat16 on a CPU that has it).  The inputs are the
    arrays themselves (tensors sharing their memory), set once on an infer request, and
    so is the output.  Grouped heads are given as a 5-D broadcast, q (B, Hkv, group, L,
    E) against k and v (B, Hkv, 1, S, E): the operator broadcasts batch dimensions but
    has no grouped heads of its own."""
    ov = _load_openvino()
    opset = _openvino_opset()
    B, Hq, L, E = q.shape
    Hkv, Ev = k.shape[1], v.shape[3]
    group = Hq // Hkv
    arrays: List[np.ndarray] = [q, k, v]
    if group > 1:  # views of q, k and v
        arrays = [q.reshape(B, Hkv, group, L, E), k[:, :, None], v[:, :, None]]
    if mask is not None:
        arrays.append(_grouped_mask(mask, Hkv, group) if group > 1 else _mask4(mask))
    arrays = [np.ascontiguousarray(a) for a in arrays]  # no copy of q, k, v: they are contiguous
    types = {np.dtype(np.float32): ov.Type.f32, np.dtype(np.bool_): ov.Type.boolean}
    params = [
        opset.parameter(list(a.shape), types[a.dtype], name=name)
        for a, name in zip(arrays, ("query", "key", "value", "attention_mask"))
    ]
    node = opset.scaled_dot_product_attention(*params[:3], params[3] if mask is not None else None, causal=shape.causal)
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
    }
    compiled = ov.Core().compile_model(ov.Model([node.output(0)], params, "sdpa"), "CPU", config)
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    if "f32" not in precision and "float32" not in precision:
        raise RuntimeError(f"OpenVINO compiled the model for {precision}, not f32")
    request = compiled.create_infer_request()
    for i, a in enumerate(arrays):
        request.set_input_tensor(i, ov.Tensor(a, shared_memory=True))
    out = np.empty(tuple(node.output(0).get_shape()), dtype=np.float32)
    request.set_output_tensor(0, ov.Tensor(out, shared_memory=True))

    # the tensors share the arrays' memory: the defaults keep the arrays alive
    def run_openvino(infer: Any = request.infer, _held: Any = (arrays, compiled)) -> Any:
        infer()
        return out

    def to_bhld(o: Any) -> Any:
        return o.reshape(B, Hq, L, Ev)

    layers = [str(op.get_rt_info()["layerType"].astype(str)) for op in compiled.get_runtime_model().get_ops()]
    compute = [t for t in layers if t not in ("Input", "Output", "Const")]
    kernel = "unfused" if "Softmax" in compute else "fused"
    return Prepared(run_openvino, to_bhld, kernel, "OpenVINO's compiled model: " + ", ".join(compute))


# --------------------------------------------------------------------------- latency mode


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
