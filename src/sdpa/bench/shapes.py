"""The attention problems the benchmark runs, and the work each one does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..reference import causal_mask

__all__ = [
    "GiB",
    "MiB",
    "Shape",
    "SHAPES",
    "QUICK_SHAPES",
    "LATENCY_SHAPES",
    "CACHE_SHAPES",
    "ShapeLike",
    "parse_shape",
    "split_shapes",
    "causal_pairs",
    "attention_flops",
    "kv_bytes",
    "score_bytes",
    "DTYPES",
    "HALF_DTYPES",
    "bench_dtype",
    "make_inputs",
    "MASKS",
    "MASK_DENSITY",
    "PADDING_MIN_FRACTION",
    "make_mask",
    "kept_pairs",
    "unmasked",
]

GiB = 1024**3
MiB = 1024**2


#: The masks a shape can carry (:func:`make_mask` draws them): a dense (L, S) bool mask
#: keeping :data:`MASK_DENSITY` of the pairs at random, the same as an additive float
#: mask of 0 and -inf, and a BERT-style (B, 1, 1, S) bool padding mask keeping the
#: first keys of each batch entry, a random count of them.
MASKS = ("dense-bool", "dense-float", "padding")

#: The fraction of (l, s) pairs a dense mask keeps.
MASK_DENSITY = 0.7

#: A padding mask keeps between this fraction of S (rounded) and all S keys of each
#: batch entry: 200 to 512 keys at S = 512.
PADDING_MIN_FRACTION = 200 / 512


@dataclass(frozen=True)
class Shape:
    """One attention problem: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), and
    the kind of attention mask it is given (one of :data:`MASKS`, or None)."""

    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    causal: bool = False
    Ev: Optional[int] = None  # defaults to E
    mask: Optional[str] = None

    def __post_init__(self) -> None:
        if self.Ev is None:
            object.__setattr__(self, "Ev", self.E)
        if self.mask is not None and self.mask not in MASKS:
            raise ValueError(f"shape {self.name!r}: mask must be one of {', '.join(MASKS)}, got {self.mask!r}")
        for field in ("B", "Hq", "Hkv", "L", "S", "E", "Ev"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"shape {self.name!r}: {field} must be >= 1")
        if self.Hq % self.Hkv:
            raise ValueError(f"shape {self.name!r}: Hq ({self.Hq}) must be a multiple of Hkv ({self.Hkv})")

    @property
    def decode(self) -> bool:
        """A single query row per head: bound by streaming K and V, not by arithmetic."""
        return self.L == 1

    @property
    def gqa(self) -> bool:
        """Grouped-query attention: fewer key/value heads than query heads."""
        return self.Hq != self.Hkv

    def describe(self) -> str:
        """The dimensions in one line, as ``--list`` prints them."""
        heads = f"{self.Hq}" if not self.gqa else f"{self.Hq}/{self.Hkv}"
        ev = f" Ev={self.Ev}" if self.Ev != self.E else ""
        return (
            f"B={self.B} H={heads} L={self.L} S={self.S} E={self.E}{ev}"
            + (" causal" if self.causal else "")
            + (f" mask={self.mask}" if self.mask else "")
        )


SHAPES: List[Shape] = [
    Shape("bert-base", 8, 12, 12, 128, 128, 64, False),
    Shape("1k", 1, 16, 16, 1024, 1024, 64, False),
    Shape("2k-causal-e128", 1, 32, 32, 2048, 2048, 128, True),
    Shape("4k-causal", 1, 16, 16, 4096, 4096, 64, True),
    Shape("gqa-2k", 1, 32, 8, 2048, 2048, 128, True),
    Shape("long-16k", 1, 8, 8, 16384, 16384, 64, True),
    Shape("e80", 1, 16, 16, 2048, 2048, 80, True),
    Shape("e96", 1, 16, 16, 2048, 2048, 96, True),
    Shape("decode-mha", 8, 32, 32, 1, 2048, 128, False),
    Shape("decode-gqa-32k", 1, 32, 8, 1, 32768, 128, False),
    Shape("mask-dense-bool", 1, 16, 16, 2048, 2048, 64, False, mask="dense-bool"),
    Shape("mask-dense-float", 1, 16, 16, 2048, 2048, 64, False, mask="dense-float"),
    Shape("mask-padding", 8, 12, 12, 512, 512, 64, False, mask="padding"),
]

#: Small shapes for smoke runs (``--quick``): seconds, not minutes.
QUICK_SHAPES: List[Shape] = [
    SHAPES[0],
    SHAPES[1],
    Shape("e80-512", 1, 16, 16, 512, 512, 80, True),
    Shape("decode-gqa-4k", 1, 32, 8, 1, 4096, 128, False),
]

#: Small problems, where fixed costs per call weigh most (``--latency``): a decode step
#: of a small model, one of a larger GQA model, and a short causal prefill.
LATENCY_SHAPES: List[Shape] = [
    Shape("decode-256", 1, 8, 8, 1, 256, 64, False),
    Shape("decode-gqa-1k", 1, 32, 8, 1, 1024, 128, False),
    Shape("tiny-prefill", 1, 8, 8, 32, 32, 64, True),
]

_SHAPES_BY_NAME: Dict[str, Shape] = {s.name: s for s in SHAPES + QUICK_SHAPES + LATENCY_SHAPES}

#: Decode steps over a long and a shorter grouped-query cache (``--cache-dtypes``);
#: ``--quick`` keeps the shorter one.
CACHE_SHAPES: List[Shape] = [_SHAPES_BY_NAME["decode-gqa-32k"], _SHAPES_BY_NAME["decode-gqa-4k"]]

ShapeLike = Union[Shape, str, Sequence[Any]]


def parse_shape(spec: ShapeLike) -> Shape:
    """A :class:`Shape` from a suite name, a tuple, or ``"name:B,Hq,Hkv,L,S,E[,causal][,MASK]"``
    (MASK one of :data:`MASKS`).

    Tuples are ``(name, B, Hq, Hkv, L, S, E, causal[, Ev[, mask]])``.
    """
    if isinstance(spec, Shape):
        return spec
    if isinstance(spec, str):
        spec = spec.strip()
        if spec in _SHAPES_BY_NAME:
            return _SHAPES_BY_NAME[spec]
        if ":" not in spec:
            known = ", ".join(_SHAPES_BY_NAME)
            raise ValueError(
                f"unknown shape {spec!r}; known shapes: {known} (or NAME:B,Hq,Hkv,L,S,E[,causal])"
            )
        name, _, dims = spec.partition(":")
        parts = [p.strip() for p in dims.split(",") if p.strip()]
        mask = parts.pop() if parts and parts[-1] in MASKS else None
        causal = False
        if len(parts) == 7:
            flag = parts.pop().lower()
            if flag not in ("causal", "c", "true", "1", "false", "0", "full"):
                raise ValueError(
                    f"shape {spec!r}: the 7th field must be 'causal' or 'full', the last may be one of "
                    + ", ".join(MASKS)
                )
            causal = flag in ("causal", "c", "true", "1")
        if len(parts) != 6:
            raise ValueError(f"shape {spec!r}: expected NAME:B,Hq,Hkv,L,S,E[,causal][,MASK]")
        try:
            B, Hq, Hkv, L, S, E = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"shape {spec!r}: dims must be integers") from None
        return Shape(name or "custom", B, Hq, Hkv, L, S, E, causal, mask=mask)
    fields = list(spec)
    if len(fields) not in (8, 9, 10):
        raise ValueError(f"shape tuple must be (name, B, Hq, Hkv, L, S, E, causal[, Ev[, mask]]); got {spec!r}")
    name, B, Hq, Hkv, L, S, E, causal = fields[:8]
    Ev = int(fields[8]) if len(fields) >= 9 and fields[8] is not None else None
    mask = str(fields[9]) if len(fields) == 10 and fields[9] is not None else None
    return Shape(str(name), int(B), int(Hq), int(Hkv), int(L), int(S), int(E), bool(causal), Ev, mask)


def split_shapes(text: str) -> List[str]:
    """Split ``--shapes`` on commas, keeping the commas inside NAME:B,Hq,... specs."""
    items: List[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if items and ":" in items[-1] and ":" not in token and token not in _SHAPES_BY_NAME:
            items[-1] += "," + token
        else:
            items.append(token)
    return items


# --------------------------------------------------------------------------- work counts


def causal_pairs(L: int, S: int) -> int:
    """Number of (l, s) pairs with ``s <= l`` in an L x S grid (top-left causal mask)."""
    m = min(L, S)
    return m * (m + 1) // 2 + (L - m) * S


def attention_flops(shape: Shape, mask: Optional[np.ndarray] = None) -> int:
    """Multiply-adds of Q Kᵀ and P V, counted as 2 flops, over the unmasked pairs only.

    With ``mask`` (the shape's, from :func:`make_mask`), the pairs it keeps are counted,
    exactly (see :func:`kept_pairs`); without it, a masked shape counts every pair (or
    the causal ones), as its unmasked run does.
    """
    if mask is not None:
        return 2 * kept_pairs(shape, mask) * (shape.E + shape.Ev)
    pairs = causal_pairs(shape.L, shape.S) if shape.causal else shape.L * shape.S
    return 2 * shape.B * shape.Hq * pairs * (shape.E + shape.Ev)


def kept_pairs(shape: Shape, mask: np.ndarray) -> int:
    """The (b, h, l, s) entries that take part in attention under ``mask`` (and the causal
    mask, when the shape has one): True in a bool mask, above -inf in an additive one."""
    keep = np.asarray(mask)
    keep = keep if keep.dtype == np.bool_ else keep.astype(np.float32) > -np.inf
    full = (shape.B, shape.Hq, shape.L, shape.S)
    keep4 = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
    if shape.causal:
        keep4 = keep4 & causal_mask(shape.L, shape.S)
    # broadcasting repeats entries, so every entry of keep4 stands for the same count
    return int(np.count_nonzero(keep4)) * (int(np.prod(full)) // keep4.size)


def kv_bytes(shape: Shape, itemsize: int) -> int:
    """Bytes of K and V, each read once: what a decode step has to stream from memory."""
    return shape.B * shape.Hkv * shape.S * (shape.E + shape.Ev) * itemsize


def score_bytes(shape: Shape, itemsize: int) -> int:
    """Bytes of the whole (B, Hq, L, S) score matrix, which a textbook version builds."""
    return shape.B * shape.Hq * shape.L * shape.S * itemsize


# --------------------------------------------------------------------------- dtypes and inputs

#: The dtypes the suite runs in (``--dtype``); sdpa computes the 16-bit ones in float32.
DTYPES = ("float32", "float64", "bfloat16", "float16")

#: The 16-bit ones, also the choices of a key/value cache of its own dtype (``--kv-dtype``).
HALF_DTYPES = ("bfloat16", "float16")


def bench_dtype(dtype: Union[str, np.dtype, type]) -> np.dtype:
    """The NumPy dtype of one of :data:`DTYPES` (bfloat16 is ``ml_dtypes.bfloat16``).

    ValueError for any other dtype, and for bfloat16 when ml_dtypes is not installed.
    """
    if isinstance(dtype, str) and dtype.strip() == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415 - optional: NumPy's bfloat16 dtype
        except ImportError:
            raise ValueError("bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES or not dt.isnative:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dt


def make_inputs(
    shape: Shape, dtype: np.dtype, seed: int, kv_dtype: Optional[np.dtype] = None
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard-normal q, k, v of ``shape``, the same for every implementation: q in
    ``dtype``, k and v in ``kv_dtype`` (default: ``dtype``).

    The values are drawn in float32 and rounded to the dtype, so runs in different
    dtypes with one seed see the same numbers, rounded.
    """
    rng = np.random.default_rng(seed)
    dtypes = (dtype, dtype if kv_dtype is None else kv_dtype, dtype if kv_dtype is None else kv_dtype)
    q, k, v = (
        rng.standard_normal(d, dtype=np.float32).astype(dt, copy=False)
        for d, dt in zip(
            (
                (shape.B, shape.Hq, shape.L, shape.E),
                (shape.B, shape.Hkv, shape.S, shape.E),
                (shape.B, shape.Hkv, shape.S, shape.Ev),
            ),
            dtypes,
        )
    )
    return q, k, v


def _mask_rng(seed: int) -> np.random.Generator:
    """The masks' own random stream, so that q, k and v do not depend on the mask."""
    return np.random.default_rng([seed, 0x6D61736B])


def make_mask(shape: Shape, dtype: np.dtype, seed: int) -> Optional[np.ndarray]:
    """The attention mask of ``shape`` (None when it has none), the same for every
    implementation; a float mask is in ``dtype``, the query's.

    ``dense-bool``: (L, S) bool, each pair kept with probability :data:`MASK_DENSITY`
    (a row that would keep no key keeps one, at random, so that no output row is
    undefined); ``dense-float``: the same pattern as 0 (kept) and -inf (masked);
    ``padding``: (B, 1, 1, S) bool keeping the first ``n_b`` keys of batch entry ``b``,
    ``n_b`` drawn between ``round(PADDING_MIN_FRACTION * S)`` (at least 1) and S.
    """
    if shape.mask is None:
        return None
    rng = _mask_rng(seed)
    L, S = shape.L, shape.S
    if shape.mask == "padding":
        low = max(1, round(PADDING_MIN_FRACTION * S))
        lengths = rng.integers(low, S + 1, size=shape.B)
        return (np.arange(S)[None, :] < lengths[:, None]).reshape(shape.B, 1, 1, S)
    keep = rng.random((L, S), dtype=np.float32) < MASK_DENSITY
    empty = np.flatnonzero(~keep.any(axis=1))
    keep[empty, rng.integers(0, S, size=empty.size)] = True
    if shape.mask == "dense-bool":
        return keep
    # -inf in the dtype: built in float32 and cast (ml_dtypes' bfloat16 has -inf)
    return np.where(keep, np.float32(0), np.float32(-np.inf)).astype(dtype)


def unmasked(shape: Shape) -> Shape:
    """The same problem without its mask (sdpa's own unmasked speed is measured on it)."""
    return Shape(shape.name, shape.B, shape.Hq, shape.Hkv, shape.L, shape.S, shape.E, shape.causal, shape.Ev)
