"""Random problems: arrays of query, key and value, masks, special values,
memory layouts, and the :class:`Choices` the generators take their decisions from."""
from __future__ import annotations

from typing import (
    Any,
    Callable,
    Dict,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import numpy as np
import numpy.typing as npt

T = TypeVar("T")
Shape = Tuple[int, ...]

#: Float dtypes sdpa takes (non-native byte order included); bfloat16 too when
#: ml_dtypes is installed (importing it registers the dtype with NumPy).
FLOAT_DTYPES = ["float32", "float64", "float16", ">f4", ">f8"]
_ml_dtypes: Any
try:
    import ml_dtypes as _ml_dtypes

    FLOAT_DTYPES.append("bfloat16")
except ImportError:  # pragma: no cover - bfloat16 is then not drawn
    _ml_dtypes = None
#: Other dtypes sdpa converts (to float64).
OTHER_DTYPES = ["int8", "int32", "int64", "uint8", "bool"]
#: The kinds of special value :func:`special_value` makes.
SPECIALS = ["nan", "inf", "-inf", "subnormal", "huge", "-huge", "overflow", "zero", "-zero"]


# --------------------------------------------------------------------------- random problems


def randn(
    rng: np.random.Generator, shape: Union[int, Sequence[int]], dtype: npt.DTypeLike = np.float64
) -> np.ndarray:
    """Standard normal values of ``shape``, converted to ``dtype``."""
    return rng.standard_normal(shape).astype(dtype)


def make_qkv(
    rng: np.random.Generator,
    batch: Sequence[int] = (),
    hq: Optional[int] = 1,
    hkv: Optional[int] = None,
    L: int = 4,
    S: int = 5,
    E: int = 8,
    Ev: Optional[int] = None,
    dtype: npt.DTypeLike = np.float64,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random query (*batch, hq, L, E), key (*batch, hkv, S, E), value (*batch, hkv, S, Ev).

    ``hkv`` defaults to ``hq`` and ``Ev`` to ``E``; ``hq=None`` leaves out the head
    dim (2-D problems when batch is empty).
    """
    hkv = hq if hkv is None else hkv
    Ev = E if Ev is None else Ev
    hq_dims = () if hq is None else (hq,)
    hkv_dims = () if hkv is None else (hkv,)
    q = randn(rng, tuple(batch) + hq_dims + (L, E), dtype)
    k = randn(rng, tuple(batch) + hkv_dims + (S, E), dtype)
    v = randn(rng, tuple(batch) + hkv_dims + (S, Ev), dtype)
    return q, k, v


def random_mask(
    rng: np.random.Generator,
    shape: Sequence[int],
    kind: str,
    dtype: npt.DTypeLike = np.float64,
    p_keep: float = 0.7,
) -> Any:
    """A random ``attn_mask`` of ``shape``.

    ``kind="bool"``: True (takes part) with probability ``p_keep`` (a 0-d mask is
    ``np.True_``); ``kind="float"``: N(0, 2) values, ``-inf`` where not kept.
    """
    keep = rng.random(shape) < p_keep
    if kind == "bool":
        if keep.ndim == 0:
            return np.bool_(True)
        return keep
    if kind != "float":
        raise ValueError(f"kind: expected 'bool' or 'float', got {kind!r}")
    values = (2.0 * rng.standard_normal(shape)).astype(dtype)
    return np.where(keep, values, -np.inf).astype(dtype)


def _single_or_half(dt: np.dtype) -> bool:
    return dt.newbyteorder("=") in (np.dtype(np.float16), np.dtype(np.float32)) or dt.name == "bfloat16"


def result_dtype(query: Any, key: Any, value: Any) -> np.dtype:
    """The documented output dtype for a query, key and value like these: the
    query's own dtype (native byte order) when every one is float32, float16 or
    bfloat16, else float64 (float64, integers, bool, Python lists of numbers)."""
    dts = [np.asarray(a).dtype for a in (query, key, value)]
    if all(_single_or_half(d) for d in dts):
        return dts[0].newbyteorder("=")
    return np.dtype(np.float64)


def compute_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """What a problem with this output dtype computes in, and returns weights
    and lse in: float64 for float64, float32 for everything else."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# --------------------------------------------------------------------------- decisions


class Choices(Protocol):
    """Where the generators below take their decisions from."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""
        ...

    def pick(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        ...

    def boolean(self) -> bool:
        """True or False."""
        ...


class RandomChoices:
    """:class:`Choices` from a NumPy Generator."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def pick(self, options: Sequence[T]) -> T:
        return options[int(self.rng.integers(0, len(options)))]

    def boolean(self) -> bool:
        return bool(self.rng.integers(0, 2))


class _Drawn:
    """:class:`Choices` from Hypothesis' ``draw``: each decision is drawn, so that
    Hypothesis can search and shrink it."""

    def __init__(self, draw: Callable[..., Any]) -> None:
        from hypothesis import strategies

        self.draw = draw
        self.st = strategies

    def integer(self, lo: int, hi: int) -> int:
        return int(self.draw(self.st.integers(lo, hi)))

    def pick(self, options: Sequence[T]) -> T:
        option: T = self.draw(self.st.sampled_from(options))
        return option

    def boolean(self) -> bool:
        return bool(self.draw(self.st.booleans()))


# --------------------------------------------------------------------------- special values


def special_value(kind: str, dtype: npt.DTypeLike, rng: np.random.Generator, role: str = "q") -> float:
    """A value of ``kind`` (one of :data:`SPECIALS`) for an operand of ``dtype``.

    ``role`` is "q", "k" or "v": "huge" values are smaller for query and key
    (their products still fit the dtype) than for value; "overflow" values are
    those whose products overflow the dtype.  "subnormal" is a random small
    multiple of the dtype's smallest subnormal.
    """
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16" and _ml_dtypes is not None:
        fi: Any = _ml_dtypes.finfo(dtype)
    else:
        fi = np.finfo(dtype if dtype.itemsize >= 2 else np.float32)
    wide = dtype.itemsize == 8
    if kind == "nan":
        return np.nan
    if kind == "inf":
        return np.inf
    if kind == "-inf":
        return -np.inf
    if kind == "subnormal":
        return float(fi.smallest_subnormal) * int(rng.integers(1, 100))
    if kind in ("huge", "-huge"):
        if role == "v":
            value = 1e200 if wide else (1e30 if dtype.itemsize == 4 else 3e4)
        else:
            value = 1e30 if wide else (1e18 if dtype.itemsize == 4 else 6e4)
        return -value if kind == "-huge" else value
    if kind == "overflow":  # products of two of these overflow the dtype
        return 1e160 if wide else (1e20 if dtype.itemsize == 4 else 6e4)
    if kind == "zero":
        return 0.0
    if kind == "-zero":
        return -0.0
    raise ValueError(f"kind: expected one of {SPECIALS}, got {kind!r}")


MAGNITUDES = (1.0, 1.0, 1.0, 1e-3, 20.0)


def random_values(
    rng: np.random.Generator,
    shape: Sequence[int],
    dtype: npt.DTypeLike,
    role: str = "q",
    specials: Sequence[str] = (),
    *,
    choices: Optional[Choices] = None,
    magnitudes: Sequence[float] = MAGNITUDES,
) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` with random contents.

    bool: fair coin flips; integers: -3..3 (0..3 unsigned); floats: normal values
    times one of ``magnitudes``, with up to three of the ``specials`` (kinds of
    :data:`SPECIALS`) written into single elements, whole rows (the last dim) or
    whole columns (one feature of every row).  ``choices`` decides the magnitude
    and the special values (a :class:`RandomChoices` on ``rng`` by default).
    """
    choices = RandomChoices(rng) if choices is None else choices
    shape = tuple(shape)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -3
        return rng.integers(lo, 4, size=shape).astype(dt)
    magnitude = choices.pick(magnitudes)
    x = rng.standard_normal(shape) * magnitude
    if specials and x.size:
        for _ in range(choices.integer(0, 3)):
            kind = choices.pick(specials)
            value = special_value(kind, dt, rng, role)
            where = choices.pick(["element", "element", "row", "column"])
            idx: Tuple[Any, ...] = tuple(int(rng.integers(0, n)) for n in shape)
            if where == "row":  # a whole query/key/value row
                idx = idx[:-1] + (slice(None),)
            elif where == "column" and len(shape) >= 2:  # one feature of every row
                idx = idx[:-2] + (slice(None), idx[-1])
            x[idx] = value
    with np.errstate(over="ignore"):
        return x.astype(dt)


# --------------------------------------------------------------------------- layouts


def place(x: np.ndarray, layout: Dict[str, Any]) -> Any:
    """The values of ``x`` in the memory layout ``layout`` describes.

    ``layout["kind"]``: "as-is" (``x`` itself), "contiguous" (a C-order copy),
    "fortran", "unaligned" (elements one byte off their alignment), "list"
    (nested Python lists) or "strided": a view into a larger buffer whose dims
    are in the order ``layout["perm"]``, taking every ``layout["steps"][d]``-th
    element of dim ``d`` and reversed where ``layout["flips"][d]``.  With
    ``layout["readonly"]`` the array is made read-only.
    """
    kind = layout["kind"]
    if kind == "as-is":
        y = x
    elif kind == "list":
        return x.tolist()
    elif kind == "contiguous":
        y = np.array(x, order="C")
    elif kind == "fortran":
        y = np.asfortranarray(x)
    elif kind == "unaligned":
        raw = bytearray(x.nbytes + 1)
        y = np.frombuffer(raw, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
        y[...] = x
    elif kind == "strided":
        perm, steps = layout["perm"], layout["steps"]
        buf = np.empty(tuple(x.shape[p] * steps[p] for p in perm), dtype=x.dtype)
        y = buf.transpose(np.argsort(perm))[tuple(slice(None, None, s) for s in steps)]
        for axis, flip in enumerate(layout["flips"]):
            if flip:
                y = np.flip(y, axis)
        y[...] = x
    else:
        raise ValueError(f"layout: unknown kind {kind!r}")
    if layout.get("readonly"):
        y = y.view()
        y.flags.writeable = False
    return y


def broadcastable_shape(choices: Choices, full_shape: Sequence[int], max_ndim: int) -> Shape:
    """A shape that broadcasts to ``full_shape``: each dim full or 1, and maybe
    fewer leading dims (at most ``max_ndim`` in all)."""
    shape = [n if choices.boolean() else 1 for n in full_shape]
    drop = choices.integer(0, len(shape))
    while drop and shape and (shape[0] == 1 or len(shape) > max_ndim):
        shape.pop(0)
        drop -= 1
    while len(shape) > max_ndim:
        shape.pop(0)
    return tuple(shape)
