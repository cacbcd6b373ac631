"""The dtype rule and the reading of array-likes: which dtypes sdpa computes
in, what a call's operands become, and the array types of the signatures."""
from __future__ import annotations

from typing import (
    Any,
    Protocol,
    Tuple,
    Union,
)

import numpy as np
import numpy.typing as npt

from . import _core

_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)

#: The float dtypes sdpa computes and stores natively.
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
#: The quantized formats of a KV cache, by the core's code (``_core.QUANTIZED``
#: has the codes by name).
QUANTIZED_NAMES = {int(code): name for name, code in _core.QUANTIZED.items()}
INT8 = int(_core.QUANTIZED["int8"])
INT4 = int(_core.QUANTIZED["int4"])
FP8_NAMES = tuple(name for name in _core.QUANTIZED if name.startswith("float8"))
FP8_CODES = tuple(int(_core.QUANTIZED[name]) for name in FP8_NAMES)


def needs_scales(code: Any) -> bool:
    """Whether the quantized format ``code`` is stored only with scales: int8
    and int4 are; float8 holds values up to its range without them."""
    return code not in FP8_CODES


#: Why a bfloat16 tensor cannot be read without ml_dtypes, and the cure.
NEEDS_ML_DTYPES = "bfloat16 tensors need ml_dtypes (NumPy's bfloat16 dtype): pip install ml_dtypes"


def width_of(code: Any) -> int:
    """The values a stored element of the format ``code`` holds: 2 for int4
    (two a byte), else 1."""
    return 2 if code == INT4 else 1


def _is_bfloat16(dt: np.dtype[Any]) -> bool:
    """ml_dtypes.bfloat16 (of either byte order), without importing ml_dtypes."""
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def _single_or_half(dt: np.dtype[Any]) -> bool:
    """float32, float16 or bfloat16: the dtypes computed in float32."""
    return (dt.kind == "f" and dt.itemsize in (2, 4)) or _is_bfloat16(dt)

# numpy.exceptions appeared in NumPy 1.25; older releases have the class at the top level


class SupportsDLPack(Protocol):
    """An object exporting its memory through the DLPack protocol."""

    def __dlpack__(self) -> Any: ...


#: What the array arguments accept: NumPy arrays and anything NumPy can read
#: (``__array__``, the buffer protocol, nested sequences), or a ``__dlpack__`` producer.
ArrayInput = Union[npt.ArrayLike, SupportsDLPack]
Array = npt.NDArray[Any]
#: The arrays sdpa returns: float32 or float64.
FloatArray = npt.NDArray[np.floating[Any]]
#: ``scaled_dot_product_attention``'s result: the output, or a tuple holding the
#: output and the weights and/or log-sum-exp asked for.
AttentionResult = Union[FloatArray, Tuple[FloatArray, ...]]


def _to_array(x: Any, name: str) -> Array:
    """Any array-like to an ndarray, without copying where possible.

    NumPy arrays are used as they are; objects with ``__array__`` (CPU torch
    tensors, pandas and xarray objects, ...) hand over their memory through it;
    objects with only ``__dlpack__`` are read through DLPack, also in place.
    """
    if isinstance(x, np.ndarray):
        return x
    if str(getattr(x, "dtype", "")) == "torch.bfloat16" and hasattr(x, "view"):
        # NumPy has no bfloat16 of its own: the same memory as ml_dtypes' bfloat16
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}: {NEEDS_ML_DTYPES}") from None
        import torch

        try:
            return np.asarray(x.view(torch.int16)).view(ml_dtypes.bfloat16)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"{name}: cannot read the bfloat16 tensor ({exc})") from None
    if not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception as exc:  # noqa: BLE001 - report what the producer said
            raise TypeError(f"{name}: cannot read it through __dlpack__ ({exc})") from None
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"{name}: expected an array-like of real numbers, got {type(x).__name__} ({exc})"
        ) from None


def _check_real(a: Array, name: str) -> None:
    """Reject dtypes that cannot be converted to float32/float64 exactly."""
    dt = a.dtype
    if _is_bfloat16(dt):
        return
    if dt.kind == "f":
        if dt.itemsize > 8:
            raise TypeError(
                f"{name}: dtype {dt} has more precision than float64; convert it explicitly "
                "(sdpa computes in float32 or float64)"
            )
        return
    if dt.kind == "b" or (dt.kind in "iu" and dt.itemsize <= 4):
        return
    if dt.kind in "iu":  # 64-bit integers are exact in float64 only up to 2**53
        # checked on the integers themselves: a conversion first would round them
        if a.size and (int(a.max()) > 2**53 or int(a.min()) < -(2**53)):
            raise TypeError(
                f"{name}: integer values beyond 2**53 cannot be represented exactly in float64"
            )
        return
    raise TypeError(
        f"{name}: dtype {dt} is not supported; sdpa takes real numbers "
        "(float32, float64, float16 and bfloat16 natively; bool and integers are converted to float64)"
    )


def operand_dtypes(query: Any, key: Any, value: Any) -> Tuple[np.dtype[Any], np.dtype[Any]]:
    """The dtypes the core reads the query (and writes the output) in, and the
    key and value in, for operands of these dtypes: the promotion rule.

    When every operand is float32, float16 or bfloat16 (either byte order), the
    query keeps its dtype, which is the output's, and key and value theirs when
    they share one (float32 otherwise); the arithmetic is float32.  Anything
    else (a float64, bool or integer operand) makes everything float64.
    """
    q, k, v = (np.dtype(d) for d in (query, key, value))
    if not all(_single_or_half(d) for d in (q, k, v)):
        return _FLOAT64, _FLOAT64
    kv = k.newbyteorder("=") if k.newbyteorder("=") == v.newbyteorder("=") else _FLOAT32
    return q.newbyteorder("="), kv


def result_dtype(*dtypes: Any) -> np.dtype[Any]:
    """The dtype of the output for a query, key and value of these dtypes (see
    :func:`operand_dtypes`): the query's, or float64."""
    return operand_dtypes(*dtypes)[0]


def quantized_query_dtype(dtype: Any) -> np.dtype[Any]:
    """The dtype a query against a quantized cache (int8, float8, int4) is
    read in, and the output's: its own when float32 or 16-bit, else float32
    (quantized values have no float64 products).  The rule of
    :meth:`sdpa.KVCache.attend`, the dense call's ``key_scale`` path and
    :func:`sdpa.paged_attention` alike."""
    dt = np.dtype(dtype)
    return dt.newbyteorder("=") if _single_or_half(dt) else _FLOAT32


def compute_dtype(dtype: Any) -> np.dtype[Any]:
    """What a problem whose output is ``dtype`` computes in, and returns weights
    and lse in: float64 for float64, else float32."""
    return _FLOAT64 if _FLOAT64 == dtype else _FLOAT32  # a dtype compares equal to its names and types


def _as_operand(a: Array, dtype: np.dtype[Any]) -> Array:
    """Native-endian, aligned array of ``dtype``; copies only when it must."""
    if a.dtype != dtype:  # also covers non-native byte order
        a = a.astype(dtype)
    if not a.flags.aligned or any(s % a.itemsize for s in a.strides):
        a = np.array(a, dtype=dtype, order="C")
    return a


def float_dtype(dtype: Any, name: str = "dtype") -> np.dtype[Any]:
    """A storage dtype: float16, bfloat16, float32 or float64 (TypeError naming
    ``name`` otherwise).  The one check of the dtypes of caches and layers."""
    expected = f"{', '.join(FLOAT_NAMES[:-1])} or {FLOAT_NAMES[-1]}"
    if isinstance(dtype, str) and dtype == "bfloat16":  # NumPy knows the name only as ml_dtypes' type
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}: {NEEDS_ML_DTYPES}") from None
        dtype = ml_dtypes.bfloat16
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected {expected}, got {dtype!r}") from None
    # kind "f" also holds ml_dtypes' 8-bit floats (float8_e5m2, ...), which
    # nothing in sdpa computes or stores
    if not (dt.kind == "f" and dt.itemsize in (2, 4, 8)) and not _is_bfloat16(dt):
        raise TypeError(f"{name}: expected {expected}, got {dt}")
    return dt.newbyteorder("=")
