"""One-node ONNX models for ONNX Runtime: the ``Attention`` operator of opset 23, and
the ``com.microsoft`` domain's ``MultiHeadAttention`` contrib operator.

The models are written straight in the protobuf wire format (a handful of
length-delimited and integer fields), so that timing ONNX Runtime needs only the
``onnxruntime`` package, not ``onnx`` as well.  Field numbers are those of
``onnx.proto``.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "INPUT_NAMES",
    "MASK_NAME",
    "OUTPUT_NAME",
    "MHA_KEY_PADDING_MASK",
    "MHA_ATTENTION_BIAS",
    "attention_model",
    "mha_model",
]

INPUT_NAMES = ("query", "key", "value")
#: The Attention operator's optional fourth input, when the model has one.
MASK_NAME = "attn_mask"
#: MultiHeadAttention's optional mask inputs: an int32 (B, S) key padding mask (1: a key
#: that takes part, 0: padding), and a float bias added to the scaled scores.
MHA_KEY_PADDING_MASK = "key_padding_mask"
MHA_ATTENTION_BIAS = "attention_bias"
OUTPUT_NAME = "output"

#: ``TensorProto.DataType`` of the dtypes the benchmark uses.
_ELEM_TYPES = {
    np.dtype(np.float32): 1,
    np.dtype(np.int32): 6,
    np.dtype(np.bool_): 9,
    np.dtype(np.float64): 11,
}

_IR_VERSION = 11  # the IR version that came with opset 23
_OPSET = 23
_MS_DOMAIN = "com.microsoft"
_MS_OPSET = 1
_ATTRIBUTE_INT = 2  # AttributeProto.AttributeType.INT

#: An input or output of the graph: its name, NumPy dtype and fixed dimensions.
TensorSpec = Tuple[str, np.dtype, Tuple[int, ...]]


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


def _elem_type(dtype: np.dtype) -> int:
    """The ONNX element type of a NumPy dtype; ValueError for one without a code here."""
    dt = np.dtype(dtype)
    if dt not in _ELEM_TYPES:
        raise ValueError(f"no ONNX element type for {dt}")
    return _ELEM_TYPES[dt]


def _tensor_info(spec: TensorSpec) -> bytes:
    """A ValueInfoProto: a tensor's name, element type and fixed dimensions."""
    name, dtype, dims = spec
    shape = b"".join(_bytes_field(1, _int_field(1, d)) for d in dims)  # TensorShapeProto.dim.dim_value
    tensor = _int_field(1, _elem_type(dtype)) + _bytes_field(2, shape)  # TypeProto.Tensor
    return _str_field(1, name) + _bytes_field(2, _bytes_field(1, tensor))  # name, TypeProto.tensor_type


def _model(
    op_type: str,
    domain: str,
    node_inputs: Sequence[str],
    inputs: Sequence[TensorSpec],
    output: TensorSpec,
    attributes: Mapping[str, int],
) -> bytes:
    """The serialized ModelProto of a graph of one node, ``output = op_type(node_inputs)``.

    ``node_inputs`` names the node's inputs in order, ``""`` for an optional input left
    out; ``inputs`` are the graph's inputs (those named).  Integer attributes only.
    """
    attrs = b"".join(
        _bytes_field(5, _str_field(1, name) + _int_field(3, int(value)) + _int_field(20, _ATTRIBUTE_INT))
        for name, value in attributes.items()
    )
    node = (
        b"".join(_str_field(1, name) for name in node_inputs)
        + _str_field(2, output[0])
        + _str_field(4, op_type)
        + attrs
        + (_str_field(7, domain) if domain else b"")
    )
    graph = (
        _bytes_field(1, node)
        + _str_field(2, op_type.lower())
        + b"".join(_bytes_field(11, _tensor_info(spec)) for spec in inputs)
        + _bytes_field(12, _tensor_info(output))
    )
    opsets = _bytes_field(8, _int_field(2, _OPSET))  # OperatorSetIdProto: the default domain, version 23
    if domain:
        opsets += _bytes_field(8, _str_field(1, domain) + _int_field(2, _MS_OPSET))
    return _int_field(1, _IR_VERSION) + _str_field(2, "sdpa.bench") + _bytes_field(7, graph) + opsets


def attention_model(
    q_shape: Tuple[int, ...],
    k_shape: Tuple[int, ...],
    v_shape: Tuple[int, ...],
    causal: bool,
    dtype: np.dtype,
    mask: Optional[Tuple[np.dtype, Tuple[int, ...]]] = None,
) -> bytes:
    """The serialized ModelProto of ``output = Attention(query, key, value[, attn_mask])``.

    Inputs and output are 4-D, (B, H, L, E) as sdpa takes them: query ``q_shape``, key
    ``k_shape`` and value ``v_shape``, with query heads a multiple of key/value heads
    (grouped-query attention).  ``is_causal`` is ``causal``; the scale is the default
    ``1 / sqrt(E)``.  ``mask``, the dtype (bool, or the inputs' for an additive mask) and
    shape of an ``attn_mask`` input, broadcastable to (B, Hq, L, S).  Raises ValueError
    for a dtype without an ONNX code here.
    """
    dt = np.dtype(dtype)
    inputs = [(name, dt, tuple(dims)) for name, dims in zip(INPUT_NAMES, (q_shape, k_shape, v_shape))]
    if mask is not None:
        inputs.append((MASK_NAME, np.dtype(mask[0]), tuple(mask[1])))
    output = (OUTPUT_NAME, dt, tuple(q_shape[:3]) + (v_shape[3],))
    return _model(
        "Attention", "", [spec[0] for spec in inputs], inputs, output, {"is_causal": int(causal)}
    )


def mha_model(
    q_shape: Tuple[int, ...],
    k_shape: Tuple[int, ...],
    v_shape: Tuple[int, ...],
    num_heads: int,
    dtype: np.dtype,
    *,
    unidirectional: bool = False,
    key_padding_mask: Optional[Tuple[int, ...]] = None,
    attention_bias: Optional[Tuple[int, ...]] = None,
) -> bytes:
    """The serialized ModelProto of ``output = com.microsoft.MultiHeadAttention(...)``.

    The query is (B, L, H·E), packed heads; the key and value (B, S, H·E) and (B, S, H·Ev)
    the same way, or (B, H, S, E) and (B, H, S, Ev).  The output is (B, L, H·Ev).
    ``num_heads`` is H (query and key/value heads alike: the operator has no grouped
    heads); ``unidirectional`` its causal mask.  ``key_padding_mask`` and
    ``attention_bias``, the shapes of those optional inputs (an int32 mask, a float bias
    of the inputs' dtype), when the model takes them.
    """
    dt = np.dtype(dtype)
    inputs: Dict[str, TensorSpec] = {
        name: (name, dt, tuple(dims)) for name, dims in zip(INPUT_NAMES, (q_shape, k_shape, v_shape))
    }
    if key_padding_mask is not None:
        inputs[MHA_KEY_PADDING_MASK] = (MHA_KEY_PADDING_MASK, np.dtype(np.int32), tuple(key_padding_mask))
    if attention_bias is not None:
        inputs[MHA_ATTENTION_BIAS] = (MHA_ATTENTION_BIAS, dt, tuple(attention_bias))
    # query, key, value, bias, key_padding_mask, attention_bias: the optional ones left out are ""
    order = [*INPUT_NAMES, "", MHA_KEY_PADDING_MASK, MHA_ATTENTION_BIAS]
    node_inputs = [name if name in inputs else "" for name in order]
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    v_hidden = v_shape[2] if len(v_shape) == 3 else v_shape[1] * v_shape[3]
    output = (OUTPUT_NAME, dt, (q_shape[0], q_shape[1], v_hidden))
    attributes = {"num_heads": num_heads}
    if unidirectional:
        attributes["unidirectional"] = 1
    return _model("MultiHeadAttention", _MS_DOMAIN, node_inputs, list(inputs.values()), output, attributes)
