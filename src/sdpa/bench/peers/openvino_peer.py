"""OpenVINO's ``ScaledDotProductAttention`` compiled for the CPU."""
from __future__ import annotations

import importlib
from typing import Any, List, Optional

import numpy as np

from ..shapes import Shape
from .common import Prepared
from .numpy_peer import _grouped_mask, _mask4
from .packages import _load_openvino

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
