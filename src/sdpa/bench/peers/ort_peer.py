"""ONNX Runtime: the ONNX ``Attention`` operator and the ``com.microsoft``
``MultiHeadAttention`` contrib operator, in sessions with bound inputs and outputs."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ..onnxgraph import (
    INPUT_NAMES,
    MASK_NAME,
    MHA_ATTENTION_BIAS,
    MHA_KEY_PADDING_MASK,
    OUTPUT_NAME,
    attention_model,
    mha_model,
)
from ..shapes import Shape
from .common import KERNELS, Prepared, _same, _static
from .numpy_peer import _mask4
from .packages import _load_onnxruntime

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
