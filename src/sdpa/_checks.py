"""The checks of a call's arguments, each with a message naming the argument:
sizes, shapes, overlap, causality, scale, the model variants and ``out``."""
from __future__ import annotations

import math
import numbers
from typing import (
    Any,
    Callable,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
    cast,
)

import numpy as np

from . import _core
from ._dtypes import (
    INT4,
    INT8,
    QUANTIZED_NAMES,
    Array,
    _as_operand,
    _check_real,
    _is_bfloat16,
    _to_array,
)

MAX_BATCH_DIMS = _core.MAX_BATCH_DIMS
_INT64_MAX = (1 << 63) - 1

_TooHardError: Type[Exception] = getattr(np, "exceptions", np).TooHardError
# the stubs of some NumPy releases only allow max_work in {0, -1}; any int works
_shares_memory: Callable[..., bool] = np.shares_memory


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
    """The machine's memory (None when unknown), as the core bounds the weights."""
    return _core.physical_memory_bytes()


def count(value: object, name: str, minimum: int = 0) -> int:
    """An int (NumPy integers included, bool not) of at least ``minimum``:
    TypeError / ValueError naming ``name`` otherwise.  The one check of sizes,
    counts and capacities across sdpa."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def int64_copy(a: Array, name: str) -> Array:
    """An integer array as int64, a copy; unsigned values beyond int64 are
    refused (a cast would wrap them to negative numbers, which mean other
    things: a skipped slot, an unused entry)."""
    if a.dtype.kind == "u" and a.dtype.itemsize >= 8 and a.size and int(a.max()) > _INT64_MAX:
        t = int(np.argmax(a > _INT64_MAX))
        raise ValueError(f"{name}: entry {t} is {int(a.ravel()[t])}, beyond int64")
    return a.astype(np.int64)


def broadcasts_to(shape: Tuple[int, ...], target: Tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` unchanged."""
    try:
        return tuple(np.broadcast_shapes(shape, target)) == tuple(target)
    except ValueError:
        return False


def int_array(x: Any, name: str, ndim: Optional[int] = None) -> Array:
    """``x`` as an array of integers (bool not), of ``ndim`` dims when given:
    TypeError / ValueError naming ``name`` otherwise."""
    a = _to_array(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {a.shape}")
    return a


def prefix_sums(value: Any, name: str, total: int, what: str) -> Array:
    """Prefix sums of n lengths (``cu_seqlens_q``, ``query_start_loc``): n + 1
    integers from 0, never decreasing, ending at ``total``, the rows of the
    packed array (``what``); a native int64 copy (the core reads it without
    the GIL)."""
    a = int_array(value, name)
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of (number of sequences + 1) prefix sums, got shape {a.shape}")
    c = int64_copy(a, name)
    if c[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(c[0])}")
    if np.any(np.diff(c) < 0):
        raise ValueError(f"{name}: must be non-decreasing (prefix sums of the lengths)")
    if c[-1] != total:
        raise ValueError(f"{name}: ends at {int(c[-1])}, but {what} holds {total} rows")
    return c


def mask_checked(dtype: np.dtype[Any], shape: Tuple[int, ...], scores_shape: Tuple[int, ...], shapes: str) -> None:
    """``attn_mask=`` of ``dtype`` and ``shape``: bool (True takes part) or
    float (added to the scores), broadcasting to the scores' shape."""
    if dtype != np.bool_ and dtype.kind != "f" and not _is_bfloat16(dtype):
        raise TypeError(
            f"attn_mask: expected a bool mask (True = takes part) or a float mask (added to "
            f"the scores), got dtype {dtype}"
        )
    if not broadcasts_to(shape, scores_shape):
        raise ValueError(
            f"attn_mask: shape {shape} does not broadcast to the scores' shape "
            f"{scores_shape} (..., heads, L, S); got {shapes}"
        )


def key_lengths_checked(kl: Array, batch_shape: Tuple[int, ...], shapes: str) -> None:
    """``key_lengths=``: integers >= 0 broadcasting to the batch dims."""
    int_array(kl, "key_lengths")
    if not broadcasts_to(kl.shape, batch_shape):
        raise ValueError(
            f"key_lengths: shape {kl.shape} does not broadcast to the batch dims {batch_shape} "
            f"(the dims before the head dim); got {shapes}"
        )
    if kl.size and int(kl.min()) < 0:
        raise ValueError(f"key_lengths: must be >= 0, got a minimum of {int(kl.min())}")


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


def causal_value(is_causal: object) -> Union[bool, str]:
    """``is_causal=`` checked: a bool (NumPy's too), ``"top_left"`` or
    ``"bottom_right"``; in its one form, True for ``"top_left"`` (the same call)."""
    causal, _ = _causal_offset(cast(Union[bool, str], is_causal), 0, 0)
    return "bottom_right" if is_causal == "bottom_right" else causal


def scale_value(scale: object) -> Optional[float]:
    """``scale=`` checked, before the head dim is known: None or a float."""
    return None if scale is None else scale_of(scale, 1)


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


_WINDOW_MAX = _core.MAX_POSITION  # the core's bound on a window side; any larger side shows every key


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
    if not broadcasts_to(a.shape, target):
        raise ValueError(
            f"{name}: shape {a.shape} does not broadcast to (batch..., query heads) {target}; "
            "give one value per query head, (Hq,) or (batch..., Hq)"
        )
    return _as_operand(a, cdtype)




def grouped_heads(hq: int, hkv: int, of: str) -> int:
    """The query heads per key/value head of a call whose GQA follows from the
    head counts (varlen, paged): ValueError unless ``hq`` is a multiple of
    ``hkv`` (those of ``of``)."""
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query: {hq} heads is not a multiple of {of}'s {hkv} key/value heads")
    return hq // hkv


def per_sequence(values: object, name: str, n: int, heads: int, cdtype: np.dtype[Any]) -> Array:
    """ALiBi slopes or sinks of a ragged or paged batch of ``n`` sequences:
    (Hq,) or (n, Hq) given, checked as :func:`head_values`, as a native
    C-contiguous (n, Hq) array of the compute type (a copy the caller cannot
    change during the call)."""
    return np.ascontiguousarray(np.broadcast_to(head_values(values, name, (n,), heads, cdtype), (n, heads)))


def flag(value: object, name: str) -> bool:
    """A switch given strictly: a bool (NumPy's too), as a bool; TypeError
    naming ``name`` otherwise (1, "yes" and None are refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def integer_switch(value: object, name: str, kv_dtype: Optional[int]) -> bool:
    """``integer_qk=`` / ``integer_pv=`` checked: a bool, True only for int8
    and int4 caches (``kv_dtype`` their core code; None: a float cache)."""
    if not flag(value, name):
        return False
    if kv_dtype not in (INT8, INT4):
        what = "keys" if name == "integer_qk" else "values"
        this = "a float cache" if kv_dtype is None else QUANTIZED_NAMES.get(kv_dtype, repr(kv_dtype))
        raise ValueError(f"{name}: only int8 and int4 caches have integer {what}; this one is {this}")
    return True


def declined(code: int) -> ValueError:
    """The error of arrays a prepared call declined (``sdpa._core.reason``
    names the argument and the rule), where the caller has checked them."""
    return ValueError(f"sdpa: {_core.reason(code)}")


def call_constants(
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
    window: object = None,
    softcap: object = None,
    num_threads: object = None,
    return_weights: object = False,
    return_lse: object = False,
    kv_dtype: object = None,
    group_size: object = 0,
    integer_qk: object = False,
    integer_pv: object = False,
    diagonal: object = None,
) -> Tuple[Any, ...]:
    """The constants of a prepared call (``sdpa._core.Call``), checked once and
    in this order, each in its one form: ``is_causal`` a bool or its string,
    ``scale`` None or a float, the flags bools, ``window`` None or a pair of
    ints (sides past the core's largest position taken as it), ``softcap``
    None or a finite float > 0, ``num_threads`` None or an int >= 1,
    ``kv_dtype`` None (float caches) or a code of ``sdpa._core.QUANTIZED``,
    ``group_size`` an int >= 0, ``diagonal`` None or an int.  A TypeError or
    ValueError names the argument that breaks its rule."""
    from ._threads import thread_count

    if kv_dtype is not None and (type(kv_dtype) is not int or kv_dtype not in QUANTIZED_NAMES):
        raise ValueError(f"kv_dtype: expected None or a code of sdpa._core.QUANTIZED, got {kv_dtype!r}")
    group = count(group_size, "group_size")
    if group > _INT64_MAX // 2:
        raise ValueError(f"group_size: {group} is beyond any head dim")
    if group and kv_dtype is None:
        raise ValueError(f"group_size: a float cache has no scale groups, got {group}")
    if diagonal is not None:
        if isinstance(diagonal, bool) or not isinstance(diagonal, numbers.Integral):
            raise TypeError(f"diagonal: expected None or an int, got {type(diagonal).__name__}")
        diagonal = int(diagonal)
        if not -_INT64_MAX <= diagonal <= _INT64_MAX:
            raise ValueError(f"diagonal: {diagonal} is beyond int64")
    return (
        causal_value(is_causal),
        scale_value(scale),
        bool(enable_gqa),
        None if window is None else window_sides(window),
        None if softcap is None else softcap_value(softcap),
        thread_count(num_threads),
        bool(return_weights),
        bool(return_lse),
        kv_dtype,
        group,
        integer_switch(integer_qk, "integer_qk", kv_dtype),
        integer_switch(integer_pv, "integer_pv", kv_dtype),
        diagonal,
    )




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


def _size(n: Any) -> Any:
    """A size as an int; a symbolic one (``torch.SymInt``) as it is."""
    return n if type(n) is int or not isinstance(n, numbers.Integral) else int(n)


def plan_shapes(
    query_shape: Sequence[Any],
    key_shape: Sequence[Any],
    value_shape: Sequence[Any],
    enable_gqa: bool = False,
    *,
    broadcast: Optional[Callable[..., Sequence[Any]]] = None,
) -> ShapePlan:
    """Check that the shapes of query, key and value fit together and return the
    sizes of the problem, output shape included (ValueError naming them if not).

    Sizes may be symbolic (``torch.SymInt``, under ``torch.compile`` with dynamic
    shapes or ``torch.export``): they are compared, which guards on their
    relations, but never turned into ints, which would fix their values; pass
    ``broadcast`` (``torch.broadcast_shapes``) to broadcast such batch dims.

    ``sdpa._core.Call`` derives the same sizes from the arrays in Cython for
    the calls it takes as they are: it cannot call into Python per call, and
    this function must take symbolic sizes, so the rule is written in both;
    tests/test_boundary.py holds the two equal.
    """
    qs, ks, vs = (tuple(_size(n) for n in s) for s in (query_shape, key_shape, value_shape))
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
    hkv = hv if hk == 1 else hk  # either broadcasts; 0 when either is 0
    if enable_gqa:
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(
                f"enable_gqa=True needs the query heads to be a multiple of the key/value heads "
                f"(dim -3); got {shapes}"
            )
        heads, group = hq, (hq // hkv if hq != 0 else 1)
    else:
        if hq != hkv and hq != 1 and hkv != 1:
            raise ValueError(
                f"query and key/value heads (dim -3) differ: {hq} vs {hkv}; they must match or "
                f"broadcast, or pass enable_gqa=True for grouped-query attention; got {shapes}"
            )
        heads = hkv if hq == 1 else hq  # 0 when either is 0
        group = 1
    batch_shapes = [s[:-3] for s in (qs, ks, vs)]
    what = "the batch dims (before dim -3) of query, key and value"
    if broadcast is None:
        batch_shape = _broadcast(batch_shapes, ("query", "key", "value"), what)
    else:
        try:
            batch_shape = tuple(broadcast(*batch_shapes))
        except (RuntimeError, ValueError):
            raise ValueError(f"{what} do not broadcast: {shapes}") from None
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


def dropout_args(dropout_p: object, seed: object) -> Optional[Tuple[float, int]]:
    """``dropout_p=`` and ``seed=`` checked: None for no dropout (``dropout_p``
    0), else (dropout_p, seed) with dropout_p in (0, 1) and seed an int in
    [0, 2**64) (required: the mask is a function of it, ValueError naming
    ``seed`` when missing)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed is not None and not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed}")
    if p == 0.0:
        return None
    if seed is None:
        raise ValueError("seed: dropout_p > 0 needs a seed (an int): the dropout mask is a function of it, "
                         "and the backward pass draws it again from the same seed")
    return p, int(seed)


def key_score_rows(return_key_scores: bool, key_scores_window: Optional[int]) -> Optional[int]:
    """The rows key scores count, as the core takes them: None (no key
    scores), 0 (every row) or the window; a TypeError or ValueError naming
    the argument."""
    if not isinstance(return_key_scores, (bool, np.bool_)):
        raise TypeError(f"return_key_scores: expected a bool, got {type(return_key_scores).__name__}")
    if key_scores_window is None:
        return 0 if return_key_scores else None
    rows = count(key_scores_window, "key_scores_window", 1)
    if not return_key_scores:
        raise ValueError("key_scores_window: only with return_key_scores=True")
    return rows
