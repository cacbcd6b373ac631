"""Hypothesis strategies over whole calls: :func:`qkv_problems`,
:func:`attention_calls`, :func:`cache_calls`, :func:`varlen_calls` and
:func:`paged_calls`, and the
values and layouts they draw.  Hypothesis is imported when a strategy is made."""
from __future__ import annotations

import math
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Sequence,
)

import numpy as np
import numpy.typing as npt

from .problems import (
    FLOAT_DTYPES,
    OTHER_DTYPES,
    SPECIALS,
    Choices,
    Shape,
    _Drawn,
    _ml_dtypes,
    broadcastable_shape,
    make_qkv,
    place,
    random_values,
    result_dtype,
)

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

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

    from ..kvcache import KVCache

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


PAGED_STORAGE = ("float32", "float16", "bfloat16", "float64", "int8", "int4", "float8_e4m3fn", "float8_e5m2")


def _draw_paged_call(draw: Callable[..., Any]) -> Dict[str, Any]:
    from hypothesis import strategies as st

    from ..paged import PagedKVCache

    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    storage = draw(st.sampled_from([s for s in PAGED_STORAGE + ("int8", "int4") if _ml_dtypes or s != "bfloat16"]))
    quantized = storage in ("int8", "int4") or storage.startswith("float8")
    scaled = quantized and (not storage.startswith("float8") or draw(st.booleans()))
    latent = draw(st.integers(0, 3)) == 0
    E = draw(st.sampled_from([2, 8, 16, 32, 64]))
    Ev = draw(st.sampled_from([E, E, 8, 32]))
    if latent:
        Ev = min(Ev, E)
    group_size = None
    if scaled and storage in ("int8", "int4") and draw(st.booleans()):
        common = math.gcd(E, Ev)
        sizes = [g for g in range(1, common + 1) if common % g == 0 and (storage == "int8" or g % 2 == 0)]
        group_size = draw(st.sampled_from(sizes))
    bs = draw(st.sampled_from([1, 2, 5, 16]))
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    # what happens to the pool: sequence 0 gets a first append, then appends
    # (empty ones too), forks, new sequences and writes that skip every token
    ops = [("append", 0, draw(st.integers(1, 40)))]
    nseq = 1
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["append", "append", "fork", "new", "skipped"]))
        if kind == "append":
            ops.append(("append", draw(st.integers(0, nseq - 1)), draw(st.sampled_from([0, 1, 3, 17, 40]))))
        elif kind == "fork":
            ops.append(("fork", draw(st.integers(0, nseq - 1)), 0))
            nseq += 1
        elif kind == "new":
            ops.append(("new", 0, 0))
            nseq += 1
        else:
            ops.append(("skipped", 0, draw(st.integers(0, 3))))
    positions = sum(t for k, _, t in ops if k == "append")
    forks = sum(1 for k, _, _ in ops if k == "fork")
    # room for every append's blocks (each sequence's may start a new one) and each fork's copy
    num_blocks = -(-positions // bs) + len(ops) + forks + draw(st.integers(0, 3))
    cache = PagedKVCache(num_blocks, bs, hkv, E, Ev, dtype=storage, group_size=group_size, latent=latent,
                         scale=None if storage.startswith("float8") and not scaled else "absmax")
    seqs = [cache.add_sequence()]
    for kind, who, T in ops:
        if kind == "append":
            k = rng.standard_normal((hkv, T, E)).astype(np.float32)
            v = None if latent else rng.standard_normal((hkv, T, Ev)).astype(np.float32)
            cache.append(seqs[who], k, v)
        elif kind == "fork":
            seqs.append(cache.fork(seqs[who]))
        elif kind == "new":
            seqs.append(cache.add_sequence())
    lens = {s: cache.seq_len(s) for s in seqs}
    L = draw(st.sampled_from([1, 1, 1, 2, 3, 5]))
    L = min(L, max(lens.values()))
    usable = [s for s in seqs if lens[s] >= L]
    ids = draw(st.lists(st.sampled_from(usable), min_size=1, max_size=4))
    qdtypes = {"float64": ["float64"], "float16": ["float16", "float32"],
               "bfloat16": ["bfloat16", "float32"]}.get(storage, ["float32", "float32", "float16"]
                                                        + (["bfloat16"] if _ml_dtypes else []))
    qdtype = draw(st.sampled_from(qdtypes))
    q = random_values(rng, (len(ids), hkv * group, L, E), qdtype, "q", ())
    tree = None
    if L > 1 and draw(st.integers(0, 2)) == 0:
        tree = rng.random((len(ids), L, L) if draw(st.booleans()) else (L, L)) < 0.6
        tree |= np.eye(L, dtype=bool)
    lowbit = storage in ("int8", "int4") and scaled
    return dict(
        seed=seed, cache=cache, ops=ops, seqs=seqs, ids=ids, q=q, L=L, E=E, Ev=Ev, hkv=hkv, hq=hkv * group, bs=bs,
        storage=storage, scaled=scaled, latent=latent, group_size=group_size, tree=tree,
        is_causal=draw(st.booleans()) if tree is None else True,
        scale=draw(st.sampled_from([None, None, 0.3])),
        integer_qk=lowbit and draw(st.booleans()), integer_pv=lowbit and draw(st.booleans()),
        skipped=[t for k, _, t in ops if k == "skipped"],
        num_threads=draw(st.sampled_from([None, 1, 2, 3])),
    )


def paged_calls() -> "SearchStrategy[Dict[str, Any]]":
    """A Hypothesis strategy for :meth:`sdpa.PagedKVCache.attend` calls.

    A pool of a drawn storage dtype (float32, float16, bfloat16, float64,
    int8 and int4 with whole-row or grouped scales, float8 with scales or
    without), block size (1, 2, 5, 16), head dims and heads, now and then a
    latent (MLA) cache, filled by a random history: appends of 0-40
    positions, forks (sharing full blocks, copying a partial one), new
    sequences, and ``skipped`` writes (lists of 0-3 tokens whose slots are
    all -1, which the test makes).  Then a query over 1-4 of the sequences
    (repeats allowed) with 1-5 rows and 1-8 query heads per key/value head,
    a query dtype the cache pairs with, causality or a tree mask, a scale,
    ``integer_qk`` / ``integer_pv`` on int8 and int4 caches, and a thread
    count.

    Each example is a dict: ``seed`` (of the values), ``cache``, ``ops`` (the history), ``seqs``,
    ``ids``, ``q``, ``tree``, ``is_causal``, ``scale``, ``integer_qk``,
    ``integer_pv``, ``skipped``, ``num_threads`` and the sizes (``L``, ``E``,
    ``Ev``, ``hkv``, ``hq``, ``bs``, ``storage``, ``scaled``, ``latent``,
    ``group_size``).
    """
    from hypothesis import strategies as st

    return st.composite(_draw_paged_call)()
