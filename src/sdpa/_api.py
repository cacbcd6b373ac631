"""Input checking, broadcasting and stride bookkeeping for the public API.

Everything here is cheap bookkeeping on shapes and strides; the arithmetic happens
in the C core (``sdpa._core``), which is handed strided views and never copies.
"""
from __future__ import annotations

import math
import numbers
import os
import threading
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core

MAX_BATCH_DIMS = _core.MAX_BATCH_DIMS

_FLOAT32_KINDS = (np.dtype(np.float16), np.dtype(np.float32))


def _to_array(x: Any, name: str) -> np.ndarray:
    """Any array-like to an ndarray, without copying where possible."""
    if isinstance(x, np.ndarray):
        return x
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


def _check_real(a: np.ndarray, name: str) -> None:
    """Reject dtypes that cannot be converted to float32/float64 exactly."""
    dt = a.dtype
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
        if a.size and int(np.max(np.abs(a.astype(np.float64, copy=False)))) > 2**53:
            raise TypeError(
                f"{name}: integer values beyond 2**53 cannot be represented exactly in float64"
            )
        return
    raise TypeError(
        f"{name}: dtype {dt} is not supported; sdpa takes real numbers "
        "(float32 and float64 natively; float16, bool and integers are converted)"
    )


def _compute_dtype(arrays: Sequence[np.ndarray]) -> np.dtype:
    """float32 when every operand is float16/float32, float64 otherwise."""
    if all(a.dtype.newbyteorder("=") in _FLOAT32_KINDS for a in arrays):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _as_operand(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
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


def _elem_strides(a: np.ndarray, target_ndim: int) -> List[int]:
    """Strides in elements, right-aligned to ``target_ndim`` dims; 0 where the
    array lacks the dim or has size 1 there (a broadcast)."""
    pad = target_ndim - a.ndim
    out = [0] * pad
    for size, st in zip(a.shape, a.strides):
        out.append(0 if size == 1 else st // a.itemsize)
    return out


def _no_internal_overlap(a: np.ndarray) -> bool:
    dims = sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1)
    extent = a.itemsize
    for st, n in dims:
        if st < extent:
            return False
        extent = st * (n - 1) + extent
    return True


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=10**6))
    except np.exceptions.TooHardError:
        return True


def _physical_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_threads(num_threads: Optional[int]) -> int:
    if num_threads is None:
        return 0
    if isinstance(num_threads, bool) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(f"num_threads: expected None or an int, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1 (or None for the default), got {num_threads}")
    return min(int(num_threads), 1 << 16)


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


def attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    key_lengths: Any = None,
    out: Optional[np.ndarray] = None,
    num_threads: Optional[int] = None,
):
    q = _to_array(query, "query")
    k = _to_array(key, "key")
    v = _to_array(value, "value")
    for a, name in ((q, "query"), (k, "key"), (v, "value")):
        _check_real(a, name)
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, features), got shape {a.shape}")
    dtype = _compute_dtype((q, k, v))
    q, k, v = (_as_operand(a, dtype) for a in (q, k, v))

    L, E = q.shape[-2:]
    S, Ek = k.shape[-2:]
    Sv, Ev = v.shape[-2:]
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
    if Ek != E:
        raise ValueError(f"query and key must have the same last dim (E); got {shapes}")
    if Sv != S:
        raise ValueError(f"key and value must have the same sequence length (dim -2); got {shapes}")

    # Heads live at dim -3 of inputs with 3+ dims; the dims before are batch dims.
    ndim = max(q.ndim, k.ndim, v.ndim)
    has_heads = ndim >= 3
    hq = q.shape[-3] if q.ndim >= 3 else 1
    hk = k.shape[-3] if k.ndim >= 3 else 1
    hv = v.shape[-3] if v.ndim >= 3 else 1
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
        [a.shape[:-3] for a in (q, k, v)], ("query", "key", "value"), "the batch dims (before dim -3) of query, key and value"
    )
    nb = len(batch_shape)
    if nb > MAX_BATCH_DIMS:
        raise ValueError(f"at most {MAX_BATCH_DIMS} batch dims are supported; got {shapes}")

    out_shape = batch_shape + ((heads,) if has_heads else ()) + (L, Ev)
    weights_shape = batch_shape + ((heads,) if has_heads else ()) + (L, S)

    if scale is None:
        scale_value = 1.0 / math.sqrt(E) if E > 0 else 1.0
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        scale_value = float(scale)
    else:
        raise TypeError(f"scale: expected None or a real number, got {type(scale).__name__}")
    causal, causal_offset = _causal_offset(is_causal, L, S)
    threads = _check_threads(num_threads)

    # mask: bool (True = takes part) or float (added), broadcastable to weights_shape
    mask_kind = _core.MASK_NONE
    m = None
    if attn_mask is not None:
        m = _to_array(attn_mask, "attn_mask")
        if m.dtype == np.bool_:
            mask_kind = _core.MASK_BOOL
            if not m.flags.aligned:
                m = np.array(m, order="C")
        elif m.dtype.kind == "f":
            _check_real(m, "attn_mask")
            mask_kind = _core.MASK_ADDITIVE
            m = _as_operand(m, dtype)
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

    lengths = None
    if key_lengths is not None:
        kl = _to_array(key_lengths, "key_lengths")
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
        lengths = np.ascontiguousarray(np.minimum(kl, S), dtype=np.int64)

    if out is None:
        result = np.empty(out_shape, dtype=dtype)
    else:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a numpy.ndarray, got {type(out).__name__}")
        if out.shape != out_shape:
            raise ValueError(f"out: expected shape {out_shape}, got {out.shape}; {shapes}")
        if out.dtype != dtype:
            raise TypeError(f"out: expected dtype {dtype} (the inputs' dtype), got {out.dtype}")
        if not out.flags.writeable:
            raise ValueError("out: the array is read-only")
        if not out.flags.aligned or any(s % out.itemsize for s in out.strides):
            raise ValueError("out: the array is not aligned to its element size")
        if not _no_internal_overlap(out):
            raise ValueError(f"out: its elements overlap each other (strides {out.strides})")
        for a, name in ((q, "query"), (k, "key"), (v, "value"), (m, "attn_mask")):
            if a is not None and _overlaps(out, a):
                raise ValueError(f"out: overlaps the memory of {name}")
        result = out

    weights = None
    if return_weights:
        nbytes = math.prod(weights_shape) * dtype.itemsize
        total = _physical_memory_bytes()
        if total is not None and nbytes > total:
            raise MemoryError(
                f"return_weights: the weights {weights_shape} need {nbytes / 2**30:.1f} GiB, "
                f"more than this machine's {total / 2**30:.1f} GiB of memory"
            )
        weights = np.empty(weights_shape, dtype=dtype)

    lse = np.empty(out_shape[:-1], dtype=dtype) if return_lse else None

    if result.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        full = nb + 3  # batch dims + (head, row, col); 2-D problems get a head of 1
        _core.attention(
            dtype == np.float64,
            batch_shape,
            heads,
            group,
            L, S, E, Ev,
            q, _elem_strides(q, full),
            k, _elem_strides(k, full),
            v, _elem_strides(v, full),
            result, _elem_strides(result, full),
            mask_kind,
            m, None if m is None else _elem_strides(m, full),
            scale_value,
            causal, causal_offset,
            weights, None if weights is None else _elem_strides(weights, full),
            threads,
            # Ctrl-C is delivered to the main thread: poll for it there
            threading.current_thread() is threading.main_thread(),
            lse, None if lse is None else _elem_strides(lse, full - 1),
            lengths, None if lengths is None else _elem_strides(lengths, nb),
        )

    extra = tuple(x for x, wanted in ((weights, return_weights), (lse, return_lse)) if wanted)
    return (result,) + extra if extra else result

