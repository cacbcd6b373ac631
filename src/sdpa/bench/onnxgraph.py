"""A one-node ONNX model, the ``Attention`` operator of opset 23, for ONNX Runtime.

The model is written straight in the protobuf wire format (a handful of
length-delimited and integer fields), so that timing ONNX Runtime needs only the
``onnxruntime`` package, not ``onnx`` as well.  Field numbers are those of
``onnx.proto``.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

__all__ = ["INPUT_NAMES", "OUTPUT_NAME", "attention_model"]

INPUT_NAMES = ("query", "key", "value")
OUTPUT_NAME = "output"

#: ``TensorProto.DataType`` of the dtypes the benchmark uses.
_ELEM_TYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 11}

_IR_VERSION = 11  # the IR version that came with opset 23
_OPSET = 23
_ATTRIBUTE_INT = 2  # AttributeProto.AttributeType.INT


def _varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint: 7 bits a byte, low bits first."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _int_field(field: int, value: int) -> bytes:
    """An integer field (wire type 0)."""
    return _varint(field << 3) + _varint(value)


def _bytes_field(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, or an embedded message."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _str_field(field: int, text: str) -> bytes:
    """A string field."""
    return _bytes_field(field, text.encode("utf-8"))


def _tensor_info(name: str, elem_type: int, dims: Sequence[int]) -> bytes:
    """A ValueInfoProto: a tensor's name, element type and fixed dimensions."""
    shape = b"".join(_bytes_field(1, _int_field(1, d)) for d in dims)  # TensorShapeProto.dim.dim_value
    tensor = _int_field(1, elem_type) + _bytes_field(2, shape)  # TypeProto.Tensor
    return _str_field(1, name) + _bytes_field(2, _bytes_field(1, tensor))  # name, TypeProto.tensor_type


def attention_model(
    q_shape: Tuple[int, ...], k_shape: Tuple[int, ...], v_shape: Tuple[int, ...], causal: bool, dtype: np.dtype
) -> bytes:
    """The serialized ModelProto of ``output = Attention(query, key, value)``.

    Inputs and output are 4-D, (B, H, L, E) as sdpa takes them: query ``q_shape``, key
    ``k_shape`` and value ``v_shape``, with query heads a multiple of key/value heads
    (grouped-query attention).  ``is_causal`` is ``causal``; the scale is the default
    ``1 / sqrt(E)``.  Raises ValueError for a dtype without an ONNX code here.
    """
    dt = np.dtype(dtype)
    if dt not in _ELEM_TYPES:
        raise ValueError(f"no ONNX element type for {dt}")
    elem = _ELEM_TYPES[dt]
    dims = dict(zip(INPUT_NAMES, (q_shape, k_shape, v_shape)))
    dims[OUTPUT_NAME] = tuple(q_shape[:3]) + (v_shape[3],)
    is_causal = _str_field(1, "is_causal") + _int_field(3, int(causal)) + _int_field(20, _ATTRIBUTE_INT)
    node = (
        b"".join(_str_field(1, name) for name in INPUT_NAMES)
        + _str_field(2, OUTPUT_NAME)
        + _str_field(4, "Attention")
        + _bytes_field(5, is_causal)
    )
    graph = (
        _bytes_field(1, node)
        + _str_field(2, "attention")
        + b"".join(_bytes_field(11, _tensor_info(name, elem, dims[name])) for name in INPUT_NAMES)
        + _bytes_field(12, _tensor_info(OUTPUT_NAME, elem, dims[OUTPUT_NAME]))
    )
    opset = _int_field(2, _OPSET)  # OperatorSetIdProto: the default domain, version 23
    return _int_field(1, _IR_VERSION) + _str_field(2, "sdpa.bench") + _bytes_field(7, graph) + _bytes_field(8, opset)
