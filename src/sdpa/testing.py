"""Random problems, special values and checks for testing attention code, in the
spirit of ``numpy.testing``.

* :func:`randn`, :func:`make_qkv`, :func:`random_mask`: random query, key and
  value arrays and masks from a NumPy Generator.
* :data:`SPECIALS`, :func:`special_value`, :func:`random_values`: arrays with
  NaN, infinities, subnormals, signed zeros or huge magnitudes written into them.
* :func:`place`: the same values in another memory layout (strided, transposed,
  reversed, unaligned, read-only, Fortran order, a list).
* :func:`assert_matches_reference`: a result against :mod:`sdpa.reference`, row by
  row, with a tolerance that follows the conditioning of each row; special values
  in the inputs included.
* Hypothesis strategies: :func:`qkv_problems` (finite problems) and
  :func:`attention_calls` (whole calls: sizes from 0, heads, masks, causal modes,
  key lengths, windows, softcaps, ALiBi, sinks, dtypes, layouts, special values).  Hypothesis is imported when a
  strategy is made, so ``import sdpa.testing`` works without it.

Decisions other than array contents (how many special values, where, which
magnitude) are taken from a :class:`Choices` object: a NumPy Generator by
default (:class:`RandomChoices`), Hypothesis' ``draw`` in the strategies, or the
bytes of a fuzzer's input.  sdpa's own tests, its Hypothesis suite and its fuzz
harness all draw from here.
"""
from __future__ import annotations

import math
from typing import (
    TYPE_CHECKING,
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

from . import reference as _reference

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "randn",
    "make_qkv",
    "random_mask",
    "result_dtype",
    "compute_dtype",
    "Choices",
    "RandomChoices",
    "FLOAT_DTYPES",
    "OTHER_DTYPES",
    "SPECIALS",
    "SOFTCAPS",
    "special_value",
    "random_values",
    "place",
    "broadcastable_shape",
    "assert_matches_reference",
    "values",
    "layouts",
    "qkv_problems",
    "attention_calls",
    "describe_call",
    "cache_calls",
    "varlen_calls",
]

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


# --------------------------------------------------------------------------- checking results


def assert_matches_reference(
    out: npt.ArrayLike,
    weights: Optional[npt.ArrayLike],
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    key_lengths: Optional[npt.ArrayLike] = None,
    *,
    lse: Optional[npt.ArrayLike] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[npt.ArrayLike] = None,
    sinks: Optional[npt.ArrayLike] = None,
) -> None:
    """Check the result of one ``sdpa.scaled_dot_product_attention`` call (its
    output and, unless None, its weights and log-sum-exp) against
    :mod:`sdpa.reference`, one output row at a time, whatever the inputs hold.
    The call's keywords are passed on: the mask, causality, key lengths and the
    model variants (``window``, ``softcap``, ``alibi_slopes``, ``sinks``).

    The expected row comes from the float64 reference, given every keyword,
    restricted to the keys the row can see: those before its key length, within
    its causal limit and within its window.  Keys past the key length are never
    read (sdpa promises it), so they never count.  Keys outside a row's causal
    limit or window, before the key length, may or may not be read, depending on
    sdpa's tiling: NaN or inf in their V rows may reach the row through a zero
    weight (``0 * NaN``) or not, so those entries only have to be "non-finite or
    equal to the value without them".  ALiBi slopes and sinks are taken in the
    compute dtype, as sdpa takes them.

    For each row:

    * The row is left unchecked when the computation in the result dtype cannot
      be compared with float64 at all: a finite score, mask or ALiBi term (or
      ``scale * q``) beyond the range of the result dtype, a float64 ``q @ k.T``
      that overflows in the reference, a ``scale * q`` that underflows to 0
      while the key holds an inf (``0 * inf`` is NaN where the reference has
      ``tiny * inf``), or V values so large that the unnormalised sum over the
      keys overflows, or a V value the row sees beyond the range of a 16-bit
      output (the average then rounds to inf correctly).  Everything else is
      checked.
    * A NaN (or +inf) score makes the whole row NaN, and so does a NaN sink in a
      row that sees a key; an ALiBi slope of +-inf or NaN gives NaN or infinite
      scores, with the same consequences as in the reference.
    * A row that sees no key (everything masked, or a window that holds no key)
      gives zeros, also where the dense reference has ``0 * NaN`` from a V row;
      its weights are 0 and its log-sum-exp is -inf, or the sink exactly.
    * Where the reference is NaN the result must be NaN; where it is +-inf, the
      same inf or NaN (float32 weights underflow to 0 sooner, and ``0 * inf`` is
      NaN).  Where the softmax is decided by rounding (below), so is which
      weights are 0: a column with an inf in a V row the row sees must be inf
      or NaN, one with a NaN there NaN.
    * Where the reference is finite the result must be finite and close.
      "Close" is scaled by the conditioning of the row: each score carries a
      rounding error of about ``d = eps * ((E + 4) * sum_c |scale q_c k_c| + 2 *
      (|mask| + |ALiBi term|) + 2 |sink|)``, where a softcap ``c`` bounds the
      first term by ``2 c`` (``c tanh(x / c)`` is 1-Lipschitz and within
      ``(-c, c)``) and adds ``16 eps c`` of its own; a score error ``d`` changes
      a weight by a factor up to ``e^(2d)``, so the allowed error is ``(expm1(2
      d) + 16 eps (S + E + 8)) * max |v|`` plus a few subnormals.  With huge
      scores (near 1e36 in float32) ``d`` is enormous and the softmax is decided
      by rounding; the only fair requirement left is the one every softmax
      average meets: each output lies within the range of the V values of the
      keys the row sees (and 0, with a sink: a key whose value is zero).
    * Weights may come out 0 where the reference's are below ``e^-87.33``
      (``e^-708.39`` in float64), just above the smallest normal number of the
      compute dtype, times the scores' error factor: sdpa's exponential is
      exactly 0 more than 87.33 (708.39) below the row's max, never subnormal,
      and a weight below the smallest normal number is 0
      (``docs/guarantees.md``); and with a sink far above every score of the
      row (by more than ``log(max)``, 88 in float32), the denominator
      overflows there.
    * The log-sum-exp is within ``d + 16 eps (S + E + 8) + 8 eps |lse|`` of the
      reference's (the log-sum-exp is 1-Lipschitz in the scores and the sink),
      in either regime; NaN and infinities as the reference's.

    The compute dtype (which sets eps and the range) follows from that of ``out``:
    float64, or float32 for every other output; a 16-bit output adds its own
    rounding, half an ulp of each value (a whole subnormal spacing below its
    smallest normal number), and a bfloat16 one also the rounding
    of the weights to bfloat16 before P V (on kernel sets with bfloat16
    products): half an ulp of each weight, times the largest |v|, plus the
    smallest normal float32 number (those products take subnormal inputs as 0).
    """
    got = np.asarray(out)
    cd = compute_dtype(got.dtype)
    out_eps = {"float16": 2.0**-11, "bfloat16": 2.0**-8}.get(np.dtype(got.dtype).name, 0.0)
    # and below its smallest normal number, the spacing of its subnormals; the
    # bfloat16 products of the avx512_bf16 kernel set (VDPBF16PS) take
    # subnormal weights and V values as 0, whatever the floating-point mode
    out_sub = {"float16": 2.0**-24, "bfloat16": 2.0**-126}.get(np.dtype(got.dtype).name, 0.0)
    p_eps = 2.0**-8 if np.dtype(got.dtype).name == "bfloat16" else 0.0
    if not any(x is not None and np.size(x) for x in (got, weights, lse)):
        return
    variants = _Variants(window, softcap, alibi_slopes, sinks)
    with np.errstate(all="ignore"):
        _check_rows(got, weights, lse, query, key, value, attn_mask, is_causal, scale, enable_gqa, key_lengths,
                    variants, cd, out_eps, out_sub, p_eps)


class _Variants:
    """The model-variant keywords of one call, as the checks take them."""

    def __init__(
        self,
        window: Optional[Tuple[int, int]],
        softcap: Optional[float],
        alibi_slopes: Optional[npt.ArrayLike],
        sinks: Optional[npt.ArrayLike],
    ) -> None:
        # sides past 2**61 show every key, as sdpa takes them
        self.window = None if window is None else (min(int(window[0]), 2**61), min(int(window[1]), 2**61))
        self.softcap = None if softcap is None else float(softcap)
        self.alibi_slopes = alibi_slopes
        self.sinks = sinks


def _heads(shape: Sequence[int]) -> int:
    return shape[-3] if len(shape) >= 3 else 1


def _expand(
    out_shape: Shape,
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike],
    enable_gqa: bool,
    key_lengths: Optional[npt.ArrayLike],
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray], np.ndarray]:
    """float64 q, k, v (N, H, rows, cols) and mask (N, H, L, S) of one call, with
    batch dims and heads broadcast and grouped-query heads repeated, and the key
    length of each of the N batch entries."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    L, S = q.shape[-2], k.shape[-2]
    has_heads = len(out_shape) >= 3
    batch = tuple(out_shape[:-3]) if has_heads else ()
    H = out_shape[-3] if has_heads else 1
    N = int(np.prod(batch, dtype=np.int64))
    hkv = max(_heads(k.shape), _heads(v.shape))

    def heads(x: np.ndarray, grouped: bool) -> np.ndarray:
        if x.ndim < 3:
            x = x[None]
        x = np.broadcast_to(x, batch + x.shape[-3:])
        if grouped and enable_gqa:  # key/value head g serves query heads g * group ...
            x = np.broadcast_to(x, batch + (hkv,) + x.shape[-2:])
            x = np.repeat(x, H // hkv, axis=-3)
        else:
            x = np.broadcast_to(x, batch + (H,) + x.shape[-2:])
        return x.reshape((N, H) + x.shape[-2:])

    m = None
    if attn_mask is not None:
        m = np.broadcast_to(np.asarray(attn_mask), tuple(out_shape[:-1]) + (S,)).reshape((N, H, L, S))
    lengths = np.full(N, S, dtype=np.int64)
    if key_lengths is not None:
        kl = np.asarray(key_lengths).astype(np.int64)
        lengths = np.minimum(np.broadcast_to(kl, batch).reshape(N), S)
    return heads(q, False), heads(k, True), heads(v, True), m, lengths


def _head_values(x: Optional[npt.ArrayLike], out_shape: Shape, cd: np.dtype) -> Optional[np.ndarray]:
    """ALiBi slopes or sinks ((Hq,) or (batch..., Hq)) as (N, H) float64, rounded
    to the compute dtype first, as sdpa reads them."""
    if x is None:
        return None
    has_heads = len(out_shape) >= 3
    batch = tuple(out_shape[:-3]) if has_heads else ()
    H = out_shape[-3] if has_heads else 1
    a = np.asarray(x).astype(cd).astype(np.float64)
    return np.broadcast_to(a, batch + (H,)).reshape(-1, H)


def _visible_ranges(
    is_causal: Union[bool, str], window: Optional[Tuple[int, int]], L: int, S: int, lengths: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """The keys each query row can see, ``first[n, l] <= s < end[n, l]``: before
    the key length, within the causal limit and within the window."""
    rows = np.arange(L, dtype=np.int64)
    first = np.zeros(L, dtype=np.int64)
    end = np.full(L, S, dtype=np.int64)
    if is_causal:
        end = np.minimum(end, rows + (S - L if is_causal == "bottom_right" else 0) + 1)
    if window is not None:
        o = 0 if is_causal != "bottom_right" and bool(is_causal) else S - L
        left, right = window
        if left >= 0:
            first = np.maximum(first, rows + o - left)
        if right >= 0:
            end = np.minimum(end, rows + o + right + 1)
    end = np.clip(np.minimum(end[None, :], lengths[:, None]), 0, S)  # (N, L)
    first = np.minimum(np.broadcast_to(np.clip(first, 0, S), end.shape), end)
    return first, end


def _check_rows(
    got: np.ndarray,
    weights: Optional[npt.ArrayLike],
    lse: Optional[npt.ArrayLike],
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: Optional[npt.ArrayLike],
    is_causal: Union[bool, str],
    scale: Optional[float],
    enable_gqa: bool,
    key_lengths: Optional[npt.ArrayLike],
    variants: _Variants,
    cd: np.dtype,
    out_eps: float,
    out_sub: float = 0.0,
    p_eps: float = 0.0,
) -> None:
    fi = np.finfo(cd)
    eps = float(fi.eps)
    q, k, v, m, lengths = _expand(got.shape, query, key, value, attn_mask, enable_gqa, key_lengths)
    slopes = _head_values(variants.alibi_slopes, got.shape, cd)
    sinks = _head_values(variants.sinks, got.shape, cd)
    cap = variants.softcap
    N, H, L, E = q.shape
    S, Ev = k.shape[-2], v.shape[-1]
    # the largest weight the exponential's cut (docs/guarantees.md) may leave 0:
    # e^cut, a little above the smallest normal number
    cut = float(np.exp(-87.33 if cd == np.float32 else -708.39))
    tol = dict(eps=eps, big=float(fi.max), sub=float(fi.smallest_subnormal), tiny=cut, S=S, E=E,
               out_eps=out_eps, out_sub=out_sub, p_eps=p_eps)
    out = got.astype(np.float64).reshape((N, H, L, Ev))
    w = None if weights is None else np.asarray(weights, dtype=np.float64).reshape((N, H, L, S))
    got_lse = None if lse is None else np.asarray(lse, dtype=np.float64).reshape((N, H, L))
    s = scale if scale is not None else (1.0 / math.sqrt(E) if E > 0 else 1.0)

    first, end = _visible_ranges(is_causal, variants.window, L, S, lengths)  # (N, L)
    cols = np.arange(S)
    visible = (cols >= first[:, None, :, None]) & (cols < end[:, None, :, None])  # (N, 1, L, S)

    # ALiBi's term of each score (NaN for an infinite slope at distance 0, as in the reference)
    bias = None
    if slopes is not None:
        o = 0 if (bool(is_causal) and is_causal != "bottom_right") else S - L
        distance = np.abs(np.arange(L)[:, None] + o - cols[None, :]).astype(np.float64)
        bias = -slopes[:, :, None, None] * distance

    # bounds on what the kernel computes in the result dtype, from finite terms
    qf = np.where(np.isfinite(q), q, 0.0)
    kf = np.abs(np.where(np.isfinite(k), k, 0.0))
    sq = (cd.type(s) * q.astype(cd)).astype(np.float64)  # scale * q as the kernel forms it
    sq_over = (np.isfinite(q) & ~np.isfinite(sq)).any(axis=-1)
    sq_under = (q != 0) & np.isfinite(q) & (sq == 0)
    bound = np.where(np.isfinite(sq), np.abs(sq), 0.0) @ np.swapaxes(kf, -1, -2)
    unscaled = np.abs(qf) @ np.swapaxes(kf, -1, -2)
    k_inf = (~np.isfinite(k)).astype(np.float64)
    under_inf = sq_under.astype(np.float64) @ np.swapaxes(k_inf, -1, -2) > 0
    if m is None or m.dtype == bool:
        mabs = np.zeros((N, H, L, S))
    else:
        mabs = np.where(np.isfinite(m), np.abs(m.astype(np.float64)), 0.0)
    if bias is not None:
        mabs = mabs + np.where(np.isfinite(bias), np.abs(bias), 0.0)

    # the reference's scores, for which keys a row sees at all
    scores = (q @ np.swapaxes(k, -1, -2)) * s
    if cap is not None:
        scores = cap * np.tanh(scores / cap)
    if bias is not None:
        scores = scores + bias
    if m is not None:
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m
    seen = visible & ~(scores == -np.inf)

    # the rounding error of each row's scores (see the docstring)
    score_bound = np.max(np.where(visible, bound, 0.0), axis=-1, initial=0)  # (N, H, L)
    mask_bound = np.max(np.where(visible, mabs, 0.0), axis=-1, initial=0)
    pre = eps * (E + 4) * score_bound
    if cap is not None:
        pre = np.minimum(pre, 2 * cap) + 16 * eps * cap
    sink_abs = np.zeros((N, H)) if sinks is None else np.where(np.isfinite(sinks), np.abs(sinks), 0.0)
    d = pre + eps * (2 * mask_bound + 2 * sink_abs[:, :, None])

    # rows the result dtype cannot be compared on (see the docstring)
    out_max = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}.get(got.dtype.name, np.inf)
    vabs = np.where(np.isfinite(v), np.abs(v), 0.0)
    vmax_row = np.max(np.where(visible, vabs.max(axis=-1, initial=0)[:, :, None, :], 0.0), axis=-1, initial=0)
    skip = (
        sq_over
        | (under_inf & visible).any(axis=-1)
        | (np.max(np.where(visible, bound + mabs, 0.0), axis=-1, initial=0) > tol["big"] / 16)
        | (np.max(np.where(visible, unscaled, 0.0), axis=-1, initial=0) > 1e300)
        | ((end - first)[:, None, :] * vmax_row > tol["big"] / 16)
        # a V value beyond a 16-bit output's range: the average may round to inf there
        | (vmax_row > out_max)
    )

    window = variants.window
    exp_out, exp_w, exp_lse = _reference.scaled_dot_product_attention(
        q, k, v, m, is_causal, scale, return_weights=True, return_lse=True, key_lengths=lengths,
        window=window, softcap=cap, alibi_slopes=slopes, sinks=sinks,
    )
    exp_w = np.broadcast_to(exp_w, (N, H, L, S))
    exp_sink = np.full((N, H), -np.inf) if sinks is None else sinks
    has_sink = sinks is not None

    if _check_clean(out, w, got_lse, q, k, v, m, slopes, sinks, skip, d, visible, seen, exp_out, exp_w, exp_lse,
                    exp_sink, first, end, has_sink, **tol):
        return
    for n in range(N):
        length = int(lengths[n])
        for h in range(H):
            for l in range(L):
                if skip[n, h, l]:
                    continue
                a, b = int(first[n, l]), int(end[n, l])
                wr = exp_w[n, h, l]
                # the reference restricted to the keys the row sees: its weights
                # elsewhere are 0, but V rows there may hold NaN (0 * NaN)
                exp_row = wr[a:b] @ v[n, h, a:b]
                _check_row(
                    f"row (batch {n}, head {h}, query {l}), keys {a}..{b - 1} visible",
                    exp_row, wr, exp_lse[n, h, l],
                    out[n, h, l], None if w is None else w[n, h, l], None if got_lse is None else got_lse[n, h, l],
                    v=v[n, h], first=a, end=b, length=length, seen=seen[n, h, l], d=float(d[n, h, l]),
                    has_sink=has_sink, **tol,
                )


def _check_clean(
    out: np.ndarray,
    w: Optional[np.ndarray],
    got_lse: Optional[np.ndarray],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    m: Optional[np.ndarray],
    slopes: Optional[np.ndarray],
    sinks: Optional[np.ndarray],
    skip: np.ndarray,
    d: np.ndarray,
    visible: np.ndarray,
    seen: np.ndarray,
    exp_out: np.ndarray,
    exp_w: np.ndarray,
    exp_lse: np.ndarray,
    exp_sink: np.ndarray,
    first: np.ndarray,
    end: np.ndarray,
    has_sink: bool,
    *,
    eps: float,
    big: float,
    sub: float,
    tiny: float,
    S: int,
    E: int,
    out_eps: float = 0.0,
    out_sub: float = 0.0,
    p_eps: float = 0.0,
) -> bool:
    """The checks of :func:`_check_row` for every row at once, where they come
    down to closeness: finite inputs (a mask may hold -inf, a sink may be -inf)
    that no row has to be skipped for, and rounding errors of the scores small
    enough for the tolerance to apply.  False (nothing checked) for anything
    else."""
    if not (np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(v).all()):
        return False
    if m is not None and m.dtype != bool and (np.isnan(m).any() or (m == np.inf).any()):
        return False
    if slopes is not None and not np.isfinite(slopes).all():
        return False
    if sinks is not None and (np.isnan(sinks).any() or (sinks == np.inf).any()):
        return False
    if skip.any() or (d > 0.05).any():
        return False
    # with finite values the keys outside each row's range only add zero weights
    # times finite values: the dense reference gives what the restricted one does
    vmax = np.max(np.where(visible[..., None], np.abs(v)[:, :, None], 0.0), axis=-2, initial=0)  # (N, H, L, Ev)
    N, H, L, _ = q.shape
    none = ~seen.any(axis=-1)  # rows that see no key: zeros
    rows = ~none

    def first_bad(bad: np.ndarray, what: str) -> str:
        n, h, l = np.argwhere(bad)[0][:3]
        return f"row (batch {n}, head {h}, query {l}), keys {first[n, l]}..{end[n, l] - 1} visible: {what}"

    bad = none & (out != 0).any(axis=-1)
    assert not bad.any(), first_bad(bad, "a row that sees no key gave nonzero values")
    bad = rows & ~np.isfinite(out).all(axis=-1)
    assert not bad.any(), first_bad(bad, "finite values expected")
    rounding = 16 * eps * (S + E + 8)
    tol = (np.expm1(2 * d)[..., None] + rounding + p_eps) * vmax + 8 * (S + 1) * sub + out_eps * np.abs(exp_out)
    tol += out_sub
    err = np.abs(out - exp_out)
    bad = rows & (err > tol).any(axis=-1)
    assert not bad.any(), first_bad(bad, f"error above the tolerance: {err[bad][0]} > {tol[bad][0]}")
    if w is not None:
        bad = none & (w != 0).any(axis=-1)
        assert not bad.any(), first_bad(bad, "weights of a row that sees no key")
        wtol = (np.expm1(2 * d)[..., None] + rounding) * exp_w + 8 * sub + tiny * np.exp(2 * d)[..., None]
        bad = rows & (visible & (np.abs(w - exp_w) > wtol)).any(axis=-1)
        assert not bad.any(), first_bad(bad, "weights off")
        bad = rows & (~visible & (w != 0)).any(axis=-1)
        assert not bad.any(), first_bad(bad, "weights outside the visible keys")
    if got_lse is not None:
        expected_none = np.broadcast_to(exp_sink[:, :, None], none.shape)
        bad = none & ~((got_lse == expected_none) | (np.isnan(got_lse) & np.isnan(expected_none)))
        assert not bad.any(), first_bad(bad, f"lse of a row that sees no key: {got_lse[bad][0]}, "
                                             f"expected {expected_none[bad][0]}")
        lse_tol = d + rounding + 8 * eps * np.abs(exp_lse)
        bad = rows & ~(np.abs(got_lse - exp_lse) <= lse_tol)
        assert not bad.any(), first_bad(bad, f"lse {got_lse[bad][0]}, expected {exp_lse[bad][0]}")
    return True


def _check_row(
    where: str,
    exp_out: np.ndarray,
    exp_w: np.ndarray,
    exp_lse: float,
    got: np.ndarray,
    got_w: Optional[np.ndarray],
    got_lse: Optional[float],
    *,
    v: np.ndarray,
    first: int,
    end: int,
    length: int,
    seen: np.ndarray,
    d: float,
    has_sink: bool,
    eps: float,
    big: float,
    sub: float,
    tiny: float,
    S: int,
    E: int,
    out_eps: float = 0.0,
    out_sub: float = 0.0,
    p_eps: float = 0.0,
) -> None:
    # V entries the row may or may not multiply by a zero weight: outside its
    # causal limit and window, before the key length
    outside = np.concatenate([v[:first], v[end:length]])
    hidden = ~np.isfinite(outside).all(axis=0)
    rounding = 16 * eps * (S + E + 8)

    if got_lse is not None:  # V plays no part in it
        if np.isnan(exp_lse):
            assert np.isnan(got_lse), f"{where}: expected a NaN lse, got {got_lse}"
        elif not seen.any() or np.isinf(exp_lse):
            assert got_lse == exp_lse, f"{where}: expected the lse {exp_lse}, got {got_lse}"
        else:
            lse_tol = d + rounding + 8 * eps * abs(exp_lse)
            assert abs(got_lse - exp_lse) <= lse_tol, f"{where}: lse {got_lse}, expected {exp_lse} +- {lse_tol}"

    if np.isnan(exp_w).any():  # a NaN or +inf score, or a NaN sink: the whole row is NaN
        assert np.isnan(got).all(), f"{where}: expected a NaN row, got {got}"
        if got_w is not None and seen.any():
            assert np.isnan(got_w[seen]).all(), f"{where}: expected NaN weights, got {got_w}"
        return

    if not seen.any():  # the row sees no key: zeros, whatever V holds
        assert (got == 0).all(), f"{where}: a row that sees no key gave {got}"
        if got_w is not None:
            assert (got_w == 0).all(), f"{where}: weights of a row that sees no key: {got_w}"
        return

    vis = v[first:end]
    if d <= 0.05:
        ref_nan = np.isnan(exp_out)
        assert np.isnan(got[ref_nan]).all(), f"{where}: NaN expected in {np.flatnonzero(ref_nan)}, got {got}"
        ref_inf = np.isinf(exp_out)
        assert (np.isnan(got) | (got == exp_out))[ref_inf].all(), f"{where}: expected {exp_out}, got {got}"
    else:
        # Which weights underflow to 0 is decided by rounding too: an inf in a V
        # row the row sees gives an inf (a positive weight) or NaN (0 * inf)
        # where the reference may have the other; a NaN gives NaN
        v_nan = np.isnan(vis).any(axis=0)
        v_inf = np.isinf(vis).any(axis=0) & ~v_nan
        assert np.isnan(got[v_nan]).all(), f"{where}: NaN expected in {np.flatnonzero(v_nan)}, got {got}"
        assert (~np.isfinite(got[v_inf])).all(), f"{where}: inf or NaN expected in {np.flatnonzero(v_inf)}, got {got}"

    finite = np.isfinite(exp_out)
    may = hidden & finite  # non-finite, or equal to the value without those V rows
    assert (np.isfinite(got) | may)[finite].all(), f"{where}: expected finite {exp_out}, got {got}"

    vmax = np.max(np.where(np.isfinite(vis), np.abs(vis), 0), axis=0, initial=0.0)
    if d <= 0.05:
        tol = (np.expm1(2 * d) + rounding + p_eps) * vmax + 8 * (S + 1) * sub + out_eps * np.abs(exp_out) + out_sub
        err = np.abs(got - exp_out)
        close = (err <= tol) | (may & ~np.isfinite(got))
        assert close[finite].all(), (
            f"{where}: error {err[finite & ~close]} above {tol[finite & ~close]}\n"
            f"expected {exp_out}\ngot      {got}"
        )
        if got_w is not None:
            wtol = (np.expm1(2 * d) + rounding) * exp_w[first:end] + 8 * sub + tiny * np.exp(2 * d)  # the cut
            werr = np.abs(got_w[first:end] - exp_w[first:end])
            assert (werr <= wtol).all(), f"{where}: weights off by {werr.max()}"
            assert (got_w[:first] == 0).all() and (got_w[end:] == 0).all(), (
                f"{where}: weights outside the visible keys"
            )
    else:
        # The softmax is decided by rounding: each output is an average of the V
        # values of the keys the row sees (and of 0, a sink's value)
        cols = finite & ~may
        vs = v[seen]
        if has_sink:
            vs = np.concatenate([vs, np.zeros((1, v.shape[-1]))])
        lo, hi = vs.min(axis=0), vs.max(axis=0)
        slack = (rounding + out_eps + p_eps) * np.maximum(np.abs(lo), np.abs(hi)) + 8 * (S + 1) * sub + out_sub
        inside = (got >= lo - slack) & (got <= hi + slack)
        assert inside[cols].all(), f"{where}: {got} outside [{lo}, {hi}]"
        if got_w is not None:
            assert ((got_w >= 0) & (got_w <= 1 + 1e-6)).all(), f"{where}: weights {got_w}"
            assert (got_w[~seen] == 0).all(), f"{where}: weights {got_w}"


# --------------------------------------------------------------------------- Hypothesis strategies


def _draw_values(
    draw: Callable[..., Any],
    rng: np.random.Generator,
    shape: Sequence[int],
    dtype: npt.DTypeLike,
    role: str,
    specials: Sequence[str] = SPECIALS,
) -> np.ndarray:
    return random_values(rng, shape, dtype, role, specials, choices=_Drawn(draw))


def values(
    rng: np.random.Generator,
    shape: Sequence[int],
    dtype: npt.DTypeLike,
    role: str = "q",
    specials: Sequence[str] = SPECIALS,
) -> "SearchStrategy[np.ndarray]":
    """A Hypothesis strategy for :func:`random_values`: the contents come from
    ``rng``, the magnitude and the special values are drawn."""
    from hypothesis import strategies as st

    return st.composite(_draw_values)(rng, shape, dtype, role, specials)


def _draw_layout(draw: Callable[..., Any], ndim: int) -> Dict[str, Any]:
    from hypothesis import strategies as st

    return dict(
        perm=draw(st.permutations(range(ndim))),
        flips=draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)),
        steps=draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=ndim, max_size=ndim)),
        kind=draw(st.sampled_from(["strided"] * 6 + ["contiguous", "unaligned"])),
        readonly=draw(st.booleans()),
    )


def layouts(ndim: int) -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for the ``layout`` of :func:`place`: strided most of
    the time (dim order, reversed dims, steps), else contiguous or unaligned;
    read-only or not."""
    from hypothesis import strategies as st

    return st.composite(_draw_layout)(ndim)


def _draw_qkv_problem(draw: Callable[..., Any], max_len: int, max_dim: int, gqa: bool) -> Dict[str, Any]:
    from hypothesis import strategies as st

    batch = draw(st.sampled_from([(), (1,), (2,), (2, 1)]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3)) if gqa else 1
    L = draw(st.integers(1, max_len))
    S = draw(st.integers(1, max_len))
    E = draw(st.integers(1, max_dim))
    Ev = draw(st.integers(1, max_dim))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, batch=batch, hq=hkv * group, hkv=hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype)
    return dict(
        q=q, k=k, v=v, rng=rng, dtype=np.dtype(dtype), batch=batch,
        hq=hkv * group, hkv=hkv, gqa=group > 1, L=L, S=S, E=E, Ev=Ev,
    )


def qkv_problems(max_len: int = 40, max_dim: int = 40, gqa: bool = True) -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for finite, contiguous problems: a dict with q, k, v
    (float32 or float64, standard normal), ``rng`` (the Generator they came from,
    for more random data), dtype, batch, hq, hkv, gqa (grouped heads), L, S, E,
    Ev.  Shapes and the seed are drawn; the contents come from the seed, which
    keeps the search fast and each example reproducible."""
    from hypothesis import strategies as st

    return st.composite(_draw_qkv_problem)(max_len, max_dim, gqa)


def _draw_attention_call(draw: Callable[..., Any], regime: str, specials: bool) -> Dict[str, Any]:
    from hypothesis import assume, strategies as st

    choices = _Drawn(draw)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if regime == "small":
        L = draw(st.integers(0, 12))
        S = draw(st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 63, 65])))
        E = draw(st.integers(0, 20))
        Ev = draw(st.integers(0, 20))
        batch = tuple(draw(st.lists(st.sampled_from([0, 1, 1, 2, 3]), max_size=2)))
    elif regime == "decode":  # at most 8 rows per kv head: the row path, 1024-key chunks
        L = draw(st.integers(1, 3))
        S = draw(st.integers(900, 2200))
        E = draw(st.integers(1, 40))
        Ev = draw(st.integers(1, 24))
        batch = tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=1)))
    elif regime == "tiled":  # several query blocks and key blocks
        L = draw(st.integers(33, 140))
        S = draw(st.integers(1, 140))
        E = draw(st.integers(1, 70))
        Ev = draw(st.integers(1, 40))
        batch = tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=1)))
    else:
        raise ValueError(f"regime: expected 'small', 'decode' or 'tiled', got {regime!r}")

    head_mode = draw(st.sampled_from(["same", "same", "gqa", "gqa", "q1", "kv1", "2d"]))
    gqa = False
    if head_mode == "2d" or (head_mode == "same" and not batch and draw(st.booleans())):
        batch, H, hq, hk, hv = (), 1, 1, 1, 1
        head_mode = "2d"
    elif head_mode == "same":
        H = draw(st.integers(0, 3))
        hq = hk = hv = H
    elif head_mode == "gqa":
        hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        H, hq, gqa = hkv * group, hkv * group, True
        hk, hv = draw(st.sampled_from([(hkv, hkv), (hkv, hkv), (1, hkv), (hkv, 1)]))
    elif head_mode == "q1":
        H = draw(st.integers(2, 3))
        hq, hk, hv = 1, H, H
    else:
        H = draw(st.integers(2, 3))
        hq, hk, hv = H, 1, 1
    assume(np.prod(batch, dtype=np.int64) * max(H, 1) * max(L, 1) * max(S, 1) <= 60_000)

    # dtypes: all the same most of the time, sometimes mixed
    if draw(st.integers(0, 3)) == 0:
        dts = [draw(st.sampled_from(FLOAT_DTYPES + OTHER_DTYPES)) for _ in range(3)]
    else:
        dts = [draw(st.sampled_from(FLOAT_DTYPES * 3 + OTHER_DTYPES))] * 3
    with_specials = specials and draw(st.integers(0, 3)) > 0

    nb = len(batch)
    full = {
        "q": tuple(n if draw(st.booleans()) else 1 for n in batch) + (hq, L, E),
        "k": tuple(n if draw(st.booleans()) else 1 for n in batch) + (hk, S, E),
        "v": tuple(n if draw(st.booleans()) else 1 for n in batch) + (hv, S, Ev),
    }
    arrays = {}
    for (name, shape), dt in zip(full.items(), dts):
        x = draw(values(rng, shape, dt, name, SPECIALS if with_specials else ()))
        if head_mode == "2d":
            x = x.reshape(shape[-2:])
        else:  # leading size-1 dims may be left out
            drop = draw(st.integers(0, nb + 1))
            while drop and x.ndim > 2 and x.shape[0] == 1:
                x = x[0]
                drop -= 1
            # or a size-1 batch dim seen as a zero-stride broadcast of the full size
            if x.ndim == nb + 3 and draw(st.integers(0, 3)) == 0:
                target = batch + x.shape[nb:]
                x = np.broadcast_to(x, target)
        if not (x.strides and 0 in x.strides and x.size > 1):
            x = place(x, draw(layouts(x.ndim)))
        arrays[name] = x

    maxnd = max(a.ndim for a in arrays.values())
    out_shape = tuple(np.broadcast_shapes(*(a.shape[:-3] for a in arrays.values())))
    if maxnd >= 3:
        out_shape = out_shape + (H,)
    out_shape = out_shape + (L, Ev)
    weights_shape = out_shape[:-1] + (S,)

    cdtype = result_dtype(*arrays.values())
    causal = draw(st.sampled_from([False, False, True, "top_left", "bottom_right"]))
    mask_kind = draw(st.sampled_from([None, None, "bool", "float"]))
    mask = None
    if mask_kind is not None:
        mshape = broadcastable_shape(choices, weights_shape, len(weights_shape))
        if mask_kind == "bool":
            keep = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
            mask = rng.random(mshape) < keep
        else:
            mdtype = np.dtype(draw(st.sampled_from([cdtype, cdtype, "float16", "float32", "float64", ">f8"])))
            m = rng.standard_normal(mshape).astype(np.float16).astype(np.float64)  # exact in any float dtype
            m[rng.random(mshape) < draw(st.sampled_from([0.0, 0.3, 0.9]))] = -np.inf
            if with_specials and m.size:
                kinds = ["-inf", "huge", "-huge", "nan", "inf"]
                for _ in range(draw(st.integers(0, 2))):
                    kind = draw(st.sampled_from(kinds))
                    val = {"-inf": -np.inf, "nan": np.nan, "inf": np.inf, "huge": 6e4, "-huge": -6e4}[kind]
                    m[tuple(int(rng.integers(0, n)) for n in mshape)] = val
            mask = m.astype(mdtype)
        if draw(st.booleans()) and mask.ndim:
            mask = place(mask, draw(layouts(mask.ndim)))

    key_lengths = None
    if draw(st.integers(0, 3)) == 0:
        batch_seen = out_shape[:-3] if maxnd >= 3 else ()
        kshape = broadcastable_shape(choices, batch_seen, len(batch_seen))
        kdt = draw(st.sampled_from(["int64", "int32"] + (["uint8"] if S + 3 < 256 else [])))
        key_lengths = rng.integers(0, S + 3, size=kshape).astype(kdt)

    scale = draw(st.sampled_from([None, None, None, 0.0, -0.5, 0.3, 2.0, 1e-3]))
    out = None
    if draw(st.integers(0, 3)) == 0:
        layout = {**draw(layouts(len(out_shape))), "readonly": False, "kind": "strided"}
        out = place(np.zeros(out_shape, dtype=cdtype), layout)

    head_target = out_shape[:-2] if maxnd >= 3 else (1,)  # (batch..., query heads)
    variants = _draw_variants(draw, rng, choices, head_target, L, S, with_specials)

    return dict(
        q=arrays["q"], k=arrays["k"], v=arrays["v"], batch=batch, H=H, gqa=gqa,
        hq=hq, hk=hk, hv=hv, L=L, S=S, E=E, Ev=Ev, mask=mask,
        causal=causal, key_lengths=key_lengths, scale=scale, out=out, out_shape=out_shape,
        cdtype=cdtype, return_weights=draw(st.booleans()), return_lse=draw(st.booleans()),
        num_threads=draw(st.sampled_from([None, 1, 2, 3])), **variants,
    )


#: Softcaps drawn: heavy capping to none at all in practice.  Not drawn: caps
#: whose float32 form overflows ``2 / c`` or ``c`` itself (below about 6e-39,
#: above about 3e38): sdpa computes a float32 problem's cap in float32, where
#: they make NaN scores.
SOFTCAPS = [1e-3, 0.5, 1.0, 2.5, 30.0, 50.0, 1e4]


def _draw_variants(
    draw: Callable[..., Any],
    rng: np.random.Generator,
    choices: Choices,
    head_target: Shape,
    L: int,
    S: int,
    with_specials: bool,
) -> Dict[str, Any]:
    """``window``, ``softcap``, ``alibi_slopes`` and ``sinks`` for one call, each
    drawn now and then (None otherwise).

    Without special values, slopes and sinks are finite.  With them, slopes may
    also be NaN, +-inf or +-6e4 (a NaN or an infinite ALiBi term, or scores
    decided by rounding), and sinks NaN, -inf (no sink), 6e4 (a sink that
    outweighs every key) or +inf (the limit: zeros, and an lse of +inf).  The
    values stay within float16's range, so that any dtype holds them.
    """
    from hypothesis import strategies as st

    window = None
    if draw(st.integers(0, 2)) == 0:
        # -1 (unbounded), small sides (a window may show a row no key), any side up to the sizes, huge
        sides = st.one_of(st.sampled_from([-1, -1, 0, 1, 3, 2**62]), st.integers(0, L + S + 1))
        window = (draw(sides), draw(sides))
    softcap = draw(st.sampled_from(SOFTCAPS)) if draw(st.integers(0, 3)) == 0 else None

    def head_values(kind: str) -> Any:
        shape = broadcastable_shape(choices, head_target, len(head_target))
        if kind == "alibi":
            style = draw(st.sampled_from(["geometric", "random", "random", "zero", "signed"]))
            if style == "geometric":  # the slopes of the ALiBi paper, 2^(-8 h / H), over the last dim
                n = shape[-1] if shape else 1
                x = np.broadcast_to(2.0 ** (-8.0 * np.arange(1, n + 1) / n), shape or (1,)).reshape(shape).copy()
            elif style == "zero":
                x = np.zeros(shape)
            else:
                x = rng.random(shape) * draw(st.sampled_from([0.01, 0.25, 1.0, 4.0]))
                if style == "signed":  # slopes < 0 favour distant keys
                    x = x * np.where(rng.random(shape) < 0.5, -1.0, 1.0)
            kinds = ["nan", "inf", "-inf", "huge", "-huge"]
        else:
            x = rng.standard_normal(shape) * draw(st.sampled_from([1.0, 4.0, 30.0])) + draw(
                st.sampled_from([0.0, 0.0, 5.0, -5.0])
            )
            kinds = ["nan", "-inf", "huge", "inf"]
        x = np.array(x, dtype=np.float64)  # (a 0-d draw is a float)
        if with_specials and x.size:
            special = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 6e4, "-huge": -6e4}
            for _ in range(draw(st.integers(0, 2))):
                idx = tuple(int(rng.integers(0, n)) for n in shape)
                x[idx] = special[draw(st.sampled_from(kinds))]
        x = x.astype(draw(st.sampled_from(["float64", "float32", "float16", ">f8"])))
        form = draw(st.sampled_from(["array", "array", "array", "list", "layout"]))
        if form == "list" and x.size:  # (an empty array has no list form)
            return x.tolist()
        if form == "layout" and x.ndim:
            return place(x, draw(layouts(x.ndim)))
        return x

    alibi = head_values("alibi") if draw(st.integers(0, 3)) == 0 else None
    sinks = head_values("sinks") if draw(st.integers(0, 3)) == 0 else None
    return dict(window=window, softcap=softcap, alibi_slopes=alibi, sinks=sinks)


def attention_calls(regime: str = "small", specials: bool = True) -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for whole calls of ``sdpa.scaled_dot_product_attention``.

    ``regime`` picks the sizes: "small" (every size from 0), "decode" (a few query
    rows against 900-2200 keys: the row path) or "tiled" (several query and key
    blocks).  Drawn: grouped-query and broadcast heads, 2-D problems, batch dims
    that broadcast, bool and float masks of any broadcastable shape, every causal
    mode, key lengths, dtypes (float32, float64, float16, non-native byte order,
    integers, bool, mixed), memory layouts (transposed, reversed, strided,
    zero-stride broadcast views, unaligned, read-only, a strided ``out=``), thread
    counts, the model variants (``window``, ``softcap``, ``alibi_slopes`` and
    ``sinks``, each now and then, slopes and sinks of any shape that broadcasts
    to (batch..., Hq), as arrays, lists or strided views) and, with
    ``specials``, special values in the inputs, masks, slopes and sinks.

    Each example is a dict: the arguments q, k, v, mask, causal, scale, gqa,
    key_lengths, window, softcap, alibi_slopes, sinks, out, return_weights,
    return_lse and num_threads; the sizes batch, H, hq, hk,
    hv, L, S, E, Ev; and what to expect: out_shape and cdtype (the result dtype).
    :func:`describe_call` says what was drawn.
    """
    from hypothesis import strategies as st

    return st.composite(_draw_attention_call)(regime, specials)


def describe_call(p: Dict[str, Any]) -> str:
    """A readable account of a call drawn by :func:`attention_calls`."""
    parts = [f"{n}: {p[n].dtype}{p[n].shape} strides={p[n].strides}" for n in ("q", "k", "v")]
    m = p["mask"]
    parts.append("mask: None" if m is None else f"mask: {m.dtype}{m.shape}")
    for key in ("batch", "H", "gqa", "L", "S", "E", "Ev", "causal", "scale", "key_lengths", "num_threads",
                "return_weights", "return_lse", "window", "softcap"):
        if key in p:
            parts.append(f"{key}={p[key]!r}")
    for key in ("alibi_slopes", "sinks"):
        x = p.get(key)
        if isinstance(x, np.ndarray):
            parts.append(f"{key}: {x.dtype}{x.shape} strides={x.strides} {x.tolist()!r}")
        else:
            parts.append(f"{key}={x!r}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- caches and packed sequences


def _draw_cache_call(draw: Callable[..., Any], specials: bool) -> Dict[str, Any]:
    from hypothesis import strategies as st

    from .kvcache import KVCache

    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    choices = _Drawn(draw)
    storage = draw(st.sampled_from(["int8", "int8", "float16", "float32"] + (["bfloat16"] if _ml_dtypes else [])))
    E = draw(st.sampled_from([1, 3, 8, 16, 20, 32, 64, 72, 128]))
    Ev = draw(st.sampled_from([E, E, 8, 24, 64]))
    group_size = None
    if storage == "int8" and draw(st.booleans()):
        common = math.gcd(E, Ev)
        group_size = draw(st.sampled_from([g for g in range(1, common + 1) if common % g == 0]))
    batch = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    # appends: decoding-sized and chunk-sized, long enough for several key tiles
    appends = draw(st.lists(st.one_of(st.integers(1, 4), st.integers(5, 400)), min_size=1, max_size=4))
    S = sum(appends)
    cache = KVCache(batch, hkv, S, E, Ev, dtype=storage, group_size=group_size)
    for T in appends:
        k = random_values(rng, (batch, hkv, T, E), np.float32, "k", (), choices=choices)
        v = random_values(rng, (batch, hkv, T, Ev), np.float32, "v", (), choices=choices)
        if specials and storage in ("int8", "float32") and draw(st.integers(0, 3)) == 0:
            # the float32 extremes: the largest finite value, subnormals, signed zeros
            for x in (k, v):
                x[tuple(int(rng.integers(0, n)) for n in x.shape)] = draw(
                    st.sampled_from([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-40, -0.0])
                )
        cache.append(k, v)
    L = draw(st.sampled_from([1, 1, 2, 3, 5, 16, 33]))
    L = min(L, S)
    qdtype = draw(st.sampled_from(["float32", "float32", "float16", "float64"] + (["bfloat16"] if _ml_dtypes else [])))
    q = random_values(rng, (batch, hkv * group, L, E), qdtype, "q", (), choices=choices)
    causal = draw(st.sampled_from(["bottom_right", "bottom_right", False, True]))
    mask = None
    if draw(st.integers(0, 3)) == 0:
        mshape = broadcastable_shape(choices, (batch, hkv * group, L, S), 4)
        mask = rng.random(mshape) < draw(st.sampled_from([0.5, 0.9]))
    variants = _draw_variants(draw, rng, choices, (batch, hkv * group), L, S, False)
    scale = draw(st.sampled_from([None, None, 0.3, -0.5]))
    return dict(
        cache=cache, q=q, mask=mask, causal=causal, scale=scale, storage=storage, group_size=group_size,
        batch=batch, hkv=hkv, hq=hkv * group, L=L, S=S, E=E, Ev=Ev, appends=appends,
        num_threads=draw(st.sampled_from([None, 1, 2, 3])), **variants,
    )


def cache_calls(specials: bool = True) -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for :meth:`sdpa.KVCache.attend` calls.

    A cache of a drawn storage dtype (int8, with whole-row or grouped scales,
    float16, bfloat16 or float32), sizes and head counts, filled by one to four
    appends of 1-400 positions; then a query of a drawn dtype (float32,
    float64, float16, bfloat16) with 1-33 rows and 1-8 query heads per
    key/value head, a causal mode, now and then a bool mask, a scale and the
    model variants (``window``, ``softcap``, ``alibi_slopes``, ``sinks``).
    With ``specials``, some appends hold the float32 extremes (the largest
    finite value, subnormals, -0).

    Each example is a dict: ``cache``, ``q``, ``mask``, ``causal``, ``scale``,
    ``num_threads``, the variants, and the sizes (``batch``, ``hkv``, ``hq``,
    ``L``, ``S``, ``E``, ``Ev``, ``appends``, ``storage``, ``group_size``).
    """
    from hypothesis import strategies as st

    return st.composite(_draw_cache_call)(specials)


def _draw_varlen_call(draw: Callable[..., Any]) -> Dict[str, Any]:
    from hypothesis import strategies as st

    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    choices = _Drawn(draw)
    n = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    lq = [draw(st.integers(1, 2) if decode else st.integers(0, 40)) for _ in range(n)]
    lk = [draw(st.integers(0, 300) if decode else st.integers(0, 70)) for _ in range(n)]
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    E = draw(st.integers(1, 40))
    Ev = draw(st.integers(1, 40))
    dt = draw(st.sampled_from(FLOAT_DTYPES))
    q = random_values(rng, (sum(lq), hq, E), dt, "q", (), choices=choices)
    k = random_values(rng, (sum(lk), hkv, E), dt, "k", (), choices=choices)
    v = random_values(rng, (sum(lk), hkv, Ev), dt, "v", (), choices=choices)
    variants = _draw_variants(draw, rng, choices, (n, hq) if draw(st.booleans()) else (hq,), 1, 1, False)
    return dict(
        q=q, k=k, v=v, cu_q=np.concatenate([[0], np.cumsum(lq)]).astype(np.int32),
        cu_k=np.concatenate([[0], np.cumsum(lk)]).astype(np.int64), lq=lq, lk=lk, hq=hq, hkv=hkv, E=E, Ev=Ev,
        causal=draw(st.sampled_from([False, True, "bottom_right"])),
        scale=draw(st.sampled_from([None, None, 0.3])), num_threads=draw(st.sampled_from([None, 1, 2, 3])),
        **variants,
    )


def varlen_calls() -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for :func:`sdpa.varlen_attention` calls: one to
    four packed sequences (decoding-sized, 1-2 query rows against up to 300
    keys, or prefill-sized, empty sequences included), grouped heads, a float
    dtype (float16 and bfloat16 included), a causal mode, a scale, and the
    model variants with slopes and sinks per head or per sequence and head.

    Each example is a dict: ``q``, ``k``, ``v`` (packed), ``cu_q``, ``cu_k``,
    ``lq``, ``lk`` (the lengths), ``causal``, ``scale``, ``num_threads``, the
    variants, and ``hq``, ``hkv``, ``E``, ``Ev``.
    """
    from hypothesis import strategies as st

    return st.composite(_draw_varlen_call)()
