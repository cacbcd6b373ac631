"""The public attention call, its input normalisation, and the validators and
dtype rule the other modules share.

A call first goes to ``sdpa._core.try_attention``, which takes NumPy arrays that
need no conversion at C speed.  Anything else comes here: array-likes are read
(in place where possible), dtypes converted by the documented rule, every
argument checked with a message naming it, and the prepared arrays handed to
``sdpa._core.run``, which reads their shapes and strides itself.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Literal,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Type,
    Union,
    overload,
)

import numpy as np
import numpy.typing as npt

from . import _core

MAX_BATCH_DIMS = _core.MAX_BATCH_DIMS

_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)


def _is_bfloat16(dt: np.dtype[Any]) -> bool:
    """ml_dtypes.bfloat16 (of either byte order), without importing ml_dtypes."""
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def _single_or_half(dt: np.dtype[Any]) -> bool:
    """float32, float16 or bfloat16: the dtypes computed in float32."""
    return (dt.kind == "f" and dt.itemsize in (2, 4)) or _is_bfloat16(dt)

# numpy.exceptions appeared in NumPy 1.25; older releases have the class at the top level
_TooHardError: Type[Exception] = getattr(np, "exceptions", np).TooHardError
# the stubs of some NumPy releases only allow max_work in {0, -1}; any int works
_shares_memory: Callable[..., bool] = np.shares_memory


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
            raise TypeError(f"{name}: a bfloat16 tensor needs ml_dtypes (pip install ml_dtypes)") from None
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


def compute_dtype(dtype: Any) -> np.dtype[Any]:
    """What a problem whose output is ``dtype`` computes in, and returns weights
    and lse in: float64 for float64, else float32."""
    return _FLOAT64 if np.dtype(dtype) == _FLOAT64 else _FLOAT32


def _as_operand(a: Array, dtype: np.dtype[Any]) -> Array:
    """Native-endian, aligned array of ``dtype``; copies only when it must."""
    if a.dtype != dtype:  # also covers non-native byte order
        a = a.astype(dtype)
    if not a.flags.aligned or any(s % a.itemsize for s in a.strides):
        a = np.array(a, dtype=dtype, order="C")
    return a


def _broadcast(shapes: Sequence[Tuple[int, ...]], names: Sequence[str], what: str) -> Tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        seen = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes))
        raise ValueError(f"{what} do not broadcast: {seen}") from None


def _no_internal_overlap(a: Array) -> bool:
    dims = sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1)
    if a.size == 0:  # no elements, nothing to overlap (NumPy may give them zero strides)
        return True
    extent = a.itemsize
    for st, n in dims:
        if st < extent:
            return False
        extent = st * (n - 1) + extent
    return True


def _overlaps(a: Array, b: Array) -> bool:
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(_shares_memory(a, b, max_work=10**6))
    except _TooHardError:
        return True


def _physical_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


_MAX_THREADS = 1 << 16


def count(value: object, name: str, minimum: int = 0) -> int:
    """An int (NumPy integers included, bool not) of at least ``minimum``:
    TypeError / ValueError naming ``name`` otherwise.  The one check of sizes,
    counts and capacities across sdpa."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def float_dtype(dtype: Any, name: str = "dtype") -> np.dtype[Any]:
    """A storage dtype: float16, bfloat16, float32 or float64 (TypeError naming
    ``name`` otherwise).  The one check of the dtypes of caches and layers."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {dtype!r}") from None
    # kind "f" also holds ml_dtypes' 8-bit floats (float8_e5m2, ...), which
    # nothing in sdpa computes or stores
    if not (dt.kind == "f" and dt.itemsize in (2, 4, 8)) and not _is_bfloat16(dt):
        raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {dt}")
    return dt.newbyteorder("=")


def thread_count(num_threads: object, name: str = "num_threads") -> Optional[int]:
    """None, or a thread count >= 1 (counts above 65536 are taken as 65536; the
    core then uses at most ``sdpa.config()["max_threads"]``)."""
    if num_threads is None:
        return None
    if isinstance(num_threads, bool) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(f"{name}: expected None or an int, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"{name}: must be >= 1 (or None for the default), got {num_threads}")
    return min(int(num_threads), _MAX_THREADS)


def set_num_threads(num_threads: Optional[int]) -> None:
    """Set the number of threads later calls use when they are not given ``num_threads``.

    ``None`` goes back to the OpenMP default: ``OMP_NUM_THREADS``, or the limit set
    with ``threadpoolctl.threadpool_limits(n, user_api="openmp")``, else one thread
    per CPU.  The setting holds for the whole process (every Python thread); an
    explicit ``num_threads=`` argument still wins over it.  Like the OpenMP default,
    the set value is a most: a small problem gets fewer threads (at least 4 MFLOP of
    work each), since waking a thread costs more than it saves there; only
    ``num_threads=`` is taken as asked.  Results do not depend on the thread count.

    Raises
    ------
    TypeError
        ``num_threads`` is not an int or None.
    ValueError
        ``num_threads`` is smaller than 1.
    """
    n = thread_count(num_threads)
    _core.set_threads_setting(0 if n is None else n)


def get_num_threads() -> int:
    """The number of threads a call without ``num_threads=`` uses now.

    The value set with :func:`set_num_threads`, else the OpenMP default of the
    calling thread (``omp_get_max_threads()``, which follows ``OMP_NUM_THREADS`` and
    threadpoolctl).  Always 1 when sdpa was built without OpenMP.
    """
    if not _core.has_openmp():
        return 1
    n = _core.threads_setting() or max(1, int(_core.default_num_threads()))
    return min(n, _core.max_threads())


def _causal_offset(is_causal: Union[bool, str], L: int, S: int) -> Tuple[bool, int]:
    if isinstance(is_causal, str):
        if is_causal == "top_left":
            return True, 0
        if is_causal == "bottom_right":
            return True, S - L
        raise ValueError(
            f"is_causal: expected a bool, 'top_left' or 'bottom_right', got {is_causal!r}"
        )
    if isinstance(is_causal, (bool, np.bool_)):
        return bool(is_causal), 0
    raise TypeError(
        f"is_causal: expected a bool, 'top_left' or 'bottom_right', got {type(is_causal).__name__}"
    )


def scale_of(scale: object, E: int) -> float:
    """``scale=`` checked: None (``1 / sqrt(E)``) or a real number; NaN and inf
    are taken (every result is then NaN)."""
    if scale is None:
        return 1.0 / math.sqrt(E) if E > 0 else 1.0
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            return float(scale)
        except OverflowError:
            raise ValueError(f"scale: {scale!r} is too large for a float64") from None
    raise TypeError(f"scale: expected None or a real number, got {type(scale).__name__}")


def output_array(
    out: object,
    shape: Tuple[int, ...],
    dtype: np.dtype[Any],
    operands: Sequence[Tuple[Optional[Array], str]],
    shapes: str,
) -> Array:
    """A new output of ``shape`` and ``dtype``, or ``out=`` checked: that shape
    and dtype, writeable, aligned, no element over another, and no overlap with
    any of ``operands`` (the caller's arrays and their converted copies)."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}; {shapes}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} (the query's, after promotion), got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out: the array is read-only")
    if not out.flags.aligned or any(st % out.itemsize for st in out.strides):
        raise ValueError("out: the array is not aligned to its element size")
    if not _no_internal_overlap(out):
        raise ValueError(f"out: its elements overlap each other (strides {out.strides})")
    for operand, name in operands:
        if operand is not None and _overlaps(out, operand):
            raise ValueError(f"out: overlaps the memory of {name}")
    return out


_WINDOW_MAX = 1 << 61  # the core's bound on a window side; any larger side shows every key


def window_sides(window: object) -> Tuple[int, int]:
    """``window=(left, right)`` checked: ints >= -1 (-1: unbounded), sides past
    2**61 taken as 2**61 (which already shows every key)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"window: expected a pair (left, right) of ints (-1 for an unbounded side), got {window!r}"
        )
    sides = []
    for side, name in zip(window, ("left", "right")):
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window: the {name} side must be an int, got {type(side).__name__}")
        if side < -1:
            raise ValueError(f"window: the {name} side must be >= 0, or -1 for unbounded, got {side}")
        sides.append(min(int(side), _WINDOW_MAX))
    return sides[0], sides[1]


def softcap_value(softcap: object) -> float:
    """``softcap=`` checked: a finite real number > 0."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected None or a real number, got {type(softcap).__name__}")
    try:
        c = float(softcap)
    except OverflowError:
        raise ValueError(f"softcap: {softcap!r} is too large for a float64") from None
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap: must be finite and > 0, got {softcap!r}")
    return c


def head_values(
    values: object, name: str, batch_shape: Tuple[int, ...], heads: int, cdtype: np.dtype[Any]
) -> Array:
    """ALiBi slopes or sink logits: one real number per query head, (Hq,) or
    (batch..., Hq) broadcasting, as a native array of the compute type."""
    a = _to_array(values, name)
    if a.dtype == np.bool_:
        raise TypeError(f"{name}: expected real numbers, got dtype bool")
    _check_real(a, name)
    target = batch_shape + (heads,)
    try:
        ok = np.broadcast_shapes(a.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name}: shape {a.shape} does not broadcast to (batch..., query heads) {target}; "
            "give one value per query head, (Hq,) or (batch..., Hq)"
        )
    return _as_operand(a, cdtype)


def variant_arguments(
    window: object,
    softcap: object,
    alibi_slopes: object,
    sinks: object,
    is_causal: Union[bool, str],
    L: int,
    S: int,
    batch_shape: Tuple[int, ...],
    heads: int,
    cdtype: np.dtype[Any],
    given: Optional[List[Tuple[Array, str]]] = None,
) -> Dict[str, Any]:
    """The keywords of ``_core.run`` for the model variants, checked; the
    caller's slope and sink arrays are added to ``given`` (for the overlap
    check of ``out``)."""
    kw: Dict[str, Any] = {}
    if window is not None or alibi_slopes is not None:
        top_left = is_causal is True or is_causal == "top_left" or (
            isinstance(is_causal, np.bool_) and bool(is_causal)
        )
        kw["align_offset"] = 0 if top_left else S - L
    if window is not None:
        kw["window_left"], kw["window_right"] = window_sides(window)
    if softcap is not None:
        kw["softcap"] = softcap_value(softcap)
    for values, name, key in ((alibi_slopes, "alibi_slopes", "alibi"), (sinks, "sinks", "sinks")):
        if values is not None:
            original = _to_array(values, name)
            if given is not None:
                given.append((original, name))
            kw[key] = head_values(original, name, batch_shape, heads, cdtype)
    return kw


class ShapePlan(NamedTuple):
    """The sizes of one call, worked out from the operands' shapes alone."""

    batch_shape: Tuple[int, ...]
    heads: int  # output heads (0 when a head dim has size 0)
    group: int  # query heads per key/value head
    L: int
    S: int
    E: int
    Ev: int
    out_shape: Tuple[int, ...]
    weights_shape: Tuple[int, ...]


def plan_shapes(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    enable_gqa: bool = False,
) -> ShapePlan:
    """Check that the shapes of query, key and value fit together and return the
    sizes of the problem, output shape included (ValueError naming them if not)."""
    qs, ks, vs = (tuple(int(n) for n in s) for s in (query_shape, key_shape, value_shape))
    for shape, name in ((qs, "query"), (ks, "key"), (vs, "value")):
        if len(shape) < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, features), got shape {shape}")
    L, E = qs[-2:]
    S, Ek = ks[-2:]
    Sv, Ev = vs[-2:]
    shapes = f"query {qs}, key {ks}, value {vs}"
    if Ek != E:
        raise ValueError(f"query and key must have the same last dim (E); got {shapes}")
    if Sv != S:
        raise ValueError(f"key and value must have the same sequence length (dim -2); got {shapes}")

    # Heads live at dim -3 of inputs with 3+ dims; the dims before are batch dims.
    has_heads = max(len(qs), len(ks), len(vs)) >= 3
    hq = qs[-3] if len(qs) >= 3 else 1
    hk = ks[-3] if len(ks) >= 3 else 1
    hv = vs[-3] if len(vs) >= 3 else 1
    if hk != hv and hk != 1 and hv != 1:
        raise ValueError(f"key and value have different numbers of heads (dim -3); got {shapes}")
    hkv = max(hk, hv) if min(hk, hv) > 0 else 0
    if enable_gqa:
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(
                f"enable_gqa=True needs the query heads to be a multiple of the key/value heads "
                f"(dim -3); got {shapes}"
            )
        heads, group = hq, max(hq // max(hkv, 1), 1)
    else:
        if hq != hkv and hq != 1 and hkv != 1:
            raise ValueError(
                f"query and key/value heads (dim -3) differ: {hq} vs {hkv}; they must match or "
                f"broadcast, or pass enable_gqa=True for grouped-query attention; got {shapes}"
            )
        heads = 0 if 0 in (hq, hkv) else max(hq, hkv)
        group = 1
    batch_shape = _broadcast(
        [s[:-3] for s in (qs, ks, vs)],
        ("query", "key", "value"),
        "the batch dims (before dim -3) of query, key and value",
    )
    if len(batch_shape) > MAX_BATCH_DIMS:
        raise ValueError(f"at most {MAX_BATCH_DIMS} batch dims are supported; got {shapes}")

    head_dims = (heads,) if has_heads else ()
    return ShapePlan(
        batch_shape=batch_shape,
        heads=heads,
        group=group,
        L=L,
        S=S,
        E=E,
        Ev=Ev,
        out_shape=batch_shape + head_dims + (L, Ev),
        weights_shape=batch_shape + head_dims + (L, S),
    )


@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> FloatArray: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[True],
    return_lse: Literal[True],
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: bool = ...,
    return_lse: bool = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
) -> AttentionResult: ...
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    key_lengths: Optional[ArrayInput] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    out: Optional[Array] = None,
    num_threads: Optional[int] = None,
) -> AttentionResult:
    """Scaled dot-product attention: ``softmax(scale * Q Kᵀ + mask) V``.

    The semantics are those of ``torch.nn.functional.scaled_dot_product_attention``
    (without dropout).

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, E)
    key : array_like, shape (..., Hkv, S, E)
    value : array_like, shape (..., Hkv, S, Ev)
        Every input has 2 or more dims.  Dim -3 is the head dim; the dims before it
        are batch dims, which broadcast against each other.  float32 and float64
        are used as they are; float16 is computed as float32; bool and integers as
        float64.  Mixed float32/float64 inputs are computed as float64.
    attn_mask : array_like, optional, broadcastable to (..., Hq, L, S)
        bool: True means the key takes part in attention.  float: added to the
        scaled scores (use -inf to mask).
    is_causal : bool or str, default False
        True (or ``"top_left"``) masks key ``s`` for query row ``l`` when ``s > l``,
        i.e. ``tril(ones(L, S))``; ``"bottom_right"`` uses ``tril(ones(L, S), S - L)``,
        where the last query row sees every key.  Combined with ``attn_mask`` if both
        are given.
    scale : float, optional
        Multiplies ``Q Kᵀ``; defaults to ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: Hq must be a multiple of Hkv, and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.  Without it, Hq and Hkv must be
        equal or broadcast (one of them 1).
    return_weights : bool, default False
        Also return the attention weights, shape (..., Hq, L, S).  They are only
        computed when asked for, and need L * S elements per head.
    return_lse : bool, default False
        Also return the natural log-sum-exp of each row's scaled, masked scores,
        shape (..., Hq, L), in the output's dtype (-inf for a row that sees no key).
        With it, results over disjoint chunks of the keys can be combined exactly
        by :func:`merge_attention`.
    key_lengths : array_like of int, optional, broadcastable to the batch dims
        Keys at or past ``key_lengths[b]`` are ignored for batch index ``b`` (the
        dims before the head dim), as for right-padded batches; no mask is built.
    window : (int, int), optional
        Sliding-window (local) attention: key ``s`` is visible to query row ``l``
        only when ``l + o - left <= s <= l + o + right``, with ``o = 0`` when
        ``is_causal`` is True or ``"top_left"`` and ``o = S - L`` otherwise (rows
        aligned to the last keys).  ``-1`` leaves a side unbounded; Mistral's
        window of ``w`` keys is ``window=(w - 1, 0)`` with ``is_causal``.  Key
        blocks outside every row's window are never read, so the cost follows
        the window, not S.
    softcap : float, optional
        Caps the scaled scores: ``x -> softcap * tanh(x / softcap)``, before
        ``attn_mask`` and ALiBi are added (Gemma 2).  Must be finite and > 0.
    alibi_slopes : array_like, shape (Hq,) or (..., Hq), optional
        ALiBi: adds ``-slope * |l + o - s|`` to the score of row ``l`` and key
        ``s`` (``o`` as for ``window``), one slope per query head (broadcasting
        against the batch dims).
    sinks : array_like, shape (Hq,) or (..., Hq), optional
        Attention sinks: a logit per query head that joins every row's softmax
        denominator, neither scaled nor capped, and adds no value:
        ``out = sum_s e^(x_s) v_s / (sum_s e^(x_s) + e^sink)`` (gpt-oss).  The
        weights and the log-sum-exp include it; a row that sees no key still
        gives zeros, and its log-sum-exp is the sink.
    out : numpy.ndarray, optional
        Preallocated output of shape (..., Hq, L, Ev) and the result dtype; any
        strides; must not overlap the inputs.
    num_threads : int, optional
        Threads for this call; ``None`` uses the value set with
        :func:`set_num_threads`, else the OpenMP default (``OMP_NUM_THREADS``, or a
        threadpoolctl limit); :func:`get_num_threads` tells which.  Results are
        bitwise identical for every thread count.

    Returns
    -------
    output : numpy.ndarray, shape (..., Hq, L, Ev)
        With ``return_weights`` and/or ``return_lse``, a tuple
        ``(output, weights, lse)`` holding those asked for, in that order.  A query row that can see
        no key (everything masked, or S == 0) gives zeros.

    Raises
    ------
    ValueError
        Shapes that do not fit together (the message names them), a bad ``out``.
    TypeError
        Unsupported dtypes or argument types.
    MemoryError
        The requested weights cannot fit in memory.
    """
    if window is None and softcap is None and alibi_slopes is None and sinks is None:
        result = _core.try_attention(
            query, key, value, attn_mask, is_causal, scale, enable_gqa,
            return_weights, return_lse, key_lengths, out, num_threads,
        )
        if result is not None:
            return result
    # not in the core's own form: convert, check, explain
    return _attention_general(
        query, key, value, attn_mask, is_causal, scale, enable_gqa,
        return_weights, return_lse, key_lengths, out, num_threads,
        window, softcap, alibi_slopes, sinks,
    )


def _attention_general(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput],
    is_causal: Union[bool, str],
    scale: Optional[float],
    enable_gqa: bool,
    return_weights: bool,
    return_lse: bool,
    key_lengths: Optional[ArrayInput],
    out: Optional[Array],
    num_threads: Optional[int],
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    quantized: Optional[Tuple[Array, Array, int]] = None,
    diagonal: Optional[int] = None,
) -> AttentionResult:
    """scaled_dot_product_attention for any arguments: converts what it can,
    raises with a message naming the argument for what it cannot.  With
    ``quantized = (key_scale, value_scale, group_size)``, key and value are the
    int8 storage of a :class:`KVCache` (checked by it) and the query is computed
    in float32 (kept if 16-bit).  ``diagonal``, when given, replaces
    ``is_causal``: row ``l`` sees keys ``s <= l + diagonal`` (a causal mask
    shifted by any amount, for one chunk of a longer key sequence)."""
    q = _to_array(query, "query")
    k = _to_array(key, "key")
    v = _to_array(value, "value")
    given = [(q, "query"), (k, "key"), (v, "value")]  # the caller's memory, before any conversion
    for a, name in given:
        _check_real(a, name)
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, features), got shape {a.shape}")
    quant_args: Dict[str, Any] = {}
    if quantized is None:
        dtype, kv_dtype = operand_dtypes(q.dtype, k.dtype, v.dtype)  # dtype: the query's and the output's
        k, v = (_as_operand(a, kv_dtype) for a in (k, v))
    else:
        dtype = (q.dtype if _single_or_half(q.dtype) else _FLOAT32).newbyteorder("=")
        quant_args = {"k_scale": quantized[0], "v_scale": quantized[1], "group_size": quantized[2]}
    cdtype = compute_dtype(dtype)  # of weights, lse and a float mask
    q = _as_operand(q, dtype)

    plan = plan_shapes(q.shape, k.shape, v.shape, enable_gqa)
    L, S, E = plan.L, plan.S, plan.E
    batch_shape, group = plan.batch_shape, plan.group
    out_shape, weights_shape = plan.out_shape, plan.weights_shape
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"

    scale_value = scale_of(scale, E)
    causal, causal_offset = _causal_offset(is_causal, L, S)
    if diagonal is not None:
        causal, causal_offset = True, int(diagonal)
    threads = thread_count(num_threads) or 0

    # mask: bool (True = takes part) or float (added), broadcastable to weights_shape
    m: Optional[Array] = None
    if attn_mask is not None:
        m = _to_array(attn_mask, "attn_mask")
        given.append((m, "attn_mask"))
        if m.dtype == np.bool_:
            if not m.flags.aligned:
                m = np.array(m, order="C")
        elif m.dtype.kind == "f" or _is_bfloat16(m.dtype):
            _check_real(m, "attn_mask")
            m = _as_operand(m, cdtype)
        else:
            raise TypeError(
                f"attn_mask: expected a bool mask (True = takes part) or a float mask (added to "
                f"the scores), got dtype {m.dtype}"
            )
        try:
            ok = np.broadcast_shapes(m.shape, weights_shape) == weights_shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"attn_mask: shape {m.shape} does not broadcast to the scores' shape "
                f"{weights_shape} (..., heads, L, S); got {shapes}"
            )

    lengths: Optional[Array] = None
    if key_lengths is not None:
        kl = _to_array(key_lengths, "key_lengths")
        given.append((kl, "key_lengths"))
        if kl.dtype.kind not in "iu":
            raise TypeError(f"key_lengths: expected integers, got dtype {kl.dtype}")
        try:
            ok = np.broadcast_shapes(kl.shape, batch_shape) == batch_shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"key_lengths: shape {kl.shape} does not broadcast to the batch dims {batch_shape} "
                f"(the dims before the head dim); got {shapes}"
            )
        if kl.size and int(kl.min()) < 0:
            raise ValueError(f"key_lengths: must be >= 0, got a minimum of {int(kl.min())}")
        lengths = np.asarray(np.minimum(kl, S), dtype=np.int64)  # a new, native array

    variants = variant_arguments(
        window, softcap, alibi_slopes, sinks, is_causal, L, S, batch_shape, plan.heads, cdtype, given
    )

    # the arrays the core reads, and the caller's own where they were converted
    operands = given + [(q, "query"), (k, "key"), (v, "value"), (m, "attn_mask")]
    operands += [(variants.get(n), n) for n in ("alibi", "sinks")]
    if quantized is not None:
        operands += [(quantized[0], "the key scales"), (quantized[1], "the value scales")]
    result = output_array(out, out_shape, dtype, operands, shapes)

    weights: Optional[Array] = None
    if return_weights:
        nbytes = math.prod(weights_shape) * cdtype.itemsize
        total = _physical_memory_bytes()
        if total is not None and nbytes > total:
            raise MemoryError(
                f"return_weights: the weights {weights_shape} need {nbytes / 2**30:.1f} GiB, "
                f"more than this machine's {total / 2**30:.1f} GiB of memory"
            )
        weights = np.empty(weights_shape, dtype=cdtype)

    lse = np.empty(out_shape[:-1], dtype=cdtype) if return_lse else None

    if result.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        _core.run(
            q, k, v, result,
            mask=m, weights=weights, lse=lse, key_lengths=lengths,
            scale=scale_value, causal=causal, causal_offset=causal_offset,
            group=group, num_threads=threads, **variants, **quant_args,
        )

    extra = [x for x in (weights, lse) if x is not None]  # each there iff asked for
    return (result, *extra) if extra else result

