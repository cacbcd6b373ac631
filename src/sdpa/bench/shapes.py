"""The attention problems the benchmark runs, and the work each one does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "GiB",
    "MiB",
    "Shape",
    "SHAPES",
    "QUICK_SHAPES",
    "LATENCY_SHAPES",
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
]

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class Shape:
    """One attention problem: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)."""

    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    causal: bool = False
    Ev: Optional[int] = None  # defaults to E

    def __post_init__(self) -> None:
        if self.Ev is None:
            object.__setattr__(self, "Ev", self.E)
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
        return f"B={self.B} H={heads} L={self.L} S={self.S} E={self.E}{ev}" + (
            " causal" if self.causal else ""
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

ShapeLike = Union[Shape, str, Sequence[Any]]


def parse_shape(spec: ShapeLike) -> Shape:
    """A :class:`Shape` from a suite name, a tuple, or ``"name:B,Hq,Hkv,L,S,E[,causal]"``.

    Tuples are ``(name, B, Hq, Hkv, L, S, E, causal[, Ev])``.
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
        causal = False
        if len(parts) == 7:
            flag = parts.pop().lower()
            if flag not in ("causal", "c", "true", "1", "false", "0", "full"):
                raise ValueError(f"shape {spec!r}: the 7th field must be 'causal' or 'full'")
            causal = flag in ("causal", "c", "true", "1")
        if len(parts) != 6:
            raise ValueError(f"shape {spec!r}: expected NAME:B,Hq,Hkv,L,S,E[,causal]")
        try:
            B, Hq, Hkv, L, S, E = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"shape {spec!r}: dims must be integers") from None
        return Shape(name or "custom", B, Hq, Hkv, L, S, E, causal)
    fields = list(spec)
    if len(fields) not in (8, 9):
        raise ValueError(f"shape tuple must be (name, B, Hq, Hkv, L, S, E, causal[, Ev]); got {spec!r}")
    name, B, Hq, Hkv, L, S, E, causal = fields[:8]
    Ev = int(fields[8]) if len(fields) == 9 and fields[8] is not None else None
    return Shape(str(name), int(B), int(Hq), int(Hkv), int(L), int(S), int(E), bool(causal), Ev)


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


def attention_flops(shape: Shape) -> int:
    """Multiply-adds of Q Kᵀ and P V, counted as 2 flops, over the unmasked pairs only."""
    pairs = causal_pairs(shape.L, shape.S) if shape.causal else shape.L * shape.S
    return 2 * shape.B * shape.Hq * pairs * (shape.E + shape.Ev)


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
