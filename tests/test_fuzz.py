"""Randomized differential testing against the float64 reference.

Hypothesis draws whole problems: sizes including 0 (L, S, E, Ev, heads, batch),
grouped-query and broadcast heads, 2-D problems, batch dims that broadcast, bool
and float masks of any broadcastable shape, every causal mode, key lengths,
dtypes (float32, float64, float16, non-native byte order, integers, bool, mixed),
memory layouts (transposed, reversed, strided, zero-stride broadcast views,
unaligned, read-only, a strided ``out=``), thread counts, and special values
written into the inputs: NaN, +-inf, subnormals, signed zeros and magnitudes
large enough for the scores to overflow.

Expected values come from ``sdpa.reference`` (float64), called on what each query
row can see: the keys before its key length and, with causality, before its
causal limit.  Keys past the key length are never read (a promise, see
tests/test_nan_contract.py), so the reference never sees them.  Keys above the
causal diagonal may or may not be read, depending on the tiling: NaN or inf in
their V rows may reach the row through a zero weight (``0 * NaN``) or not, so
those entries only have to be "non-finite or equal to the value without them".

How a result is compared, for each output row:

* The row is left unchecked when the computation in the result dtype cannot be
  compared with float64 at all: a finite score (or ``scale * q``) that exceeds
  the range of the result dtype, a float64 intermediate ``q @ k.T`` that
  overflows in the reference, a ``scale * q`` that underflows to 0 while the
  key holds an inf (``0 * inf`` is NaN where the reference has ``tiny * inf``),
  or V values so large that the unnormalised sum over the keys overflows.
  Everything else is checked.
* A NaN (or +inf) score makes the whole row NaN.
* A row that sees no key gives zeros, also where the dense reference has
  ``0 * NaN`` from a V row (tests/test_nan_contract.py).
* Where the reference is NaN the result must be NaN; where it is +-inf, the
  same inf or NaN (float32 weights underflow to 0 sooner, and ``0 * inf`` is
  NaN).
* Where the reference is finite the result must be finite and close.  "Close"
  is scaled by the conditioning of the row: each score carries a rounding
  error of about ``eps * (E + 4) * sum_c |scale q_c k_c|`` (plus the mask's),
  and a score error ``d`` changes a weight by a factor up to ``e^(2d)``, so
  the allowed error is ``(expm1(2 d) + 16 eps (S + E + 8)) * max |v|`` plus a
  few subnormals.  With huge q and k (scores near 1e36 in float32) ``d`` is
  enormous and the softmax is decided by rounding; the only fair requirement
  left is the one every softmax average meets: each output lies within the
  range of the V values of the keys the row sees.

Run longer with ``HYPOTHESIS_PROFILE=dev`` (see tests/conftest.py and
fuzz/README.md).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

import sdpa
from conftest import result_dtype

attention = sdpa.scaled_dot_product_attention
reference = sdpa.reference.scaled_dot_product_attention

FLOAT_DTYPES = ["float32", "float64", "float16", ">f4", ">f8"]
OTHER_DTYPES = ["int8", "int32", "int64", "uint8", "bool"]
SPECIALS = ["nan", "inf", "-inf", "subnormal", "huge", "-huge", "overflow", "zero", "-zero"]


# --------------------------------------------------------------------------- drawing problems


def special_value(kind: str, dtype: np.dtype, rng: np.random.Generator, role: str) -> float:
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
    return -0.0


@st.composite
def values(draw, rng, shape, dtype, role, specials=SPECIALS):
    """An array of ``shape`` and ``dtype`` with random contents, and for float
    dtypes a few special values written into single elements or whole rows."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        lo = 0 if dtype.kind == "u" else -3
        return rng.integers(lo, 4, size=shape).astype(dtype)
    magnitude = draw(st.sampled_from([1.0, 1.0, 1.0, 1e-3, 20.0]))
    x = rng.standard_normal(shape) * magnitude
    if specials and x.size:
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(specials))
            value = special_value(kind, dtype, rng, role)
            where = draw(st.sampled_from(["element", "element", "row", "column"]))
            idx = tuple(int(rng.integers(0, n)) for n in shape)
            if where == "row":  # a whole query/key/value row
                idx = idx[:-1] + (slice(None),)
            elif where == "column" and len(shape) >= 2:  # one feature of every row
                idx = idx[:-2] + (slice(None), idx[-1])
            x[idx] = value
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@st.composite
def layouts(draw, ndim):
    """How an array is laid out in memory: dim order, reversed dims, steps."""
    return dict(
        perm=draw(st.permutations(range(ndim))),
        flips=draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)),
        steps=draw(st.lists(st.sampled_from([1, 1, 1, 2]), min_size=ndim, max_size=ndim)),
        kind=draw(st.sampled_from(["strided"] * 6 + ["contiguous", "unaligned"])),
        readonly=draw(st.booleans()),
    )


def place(x: np.ndarray, layout: dict) -> np.ndarray:
    """A view with ``layout`` holding the values of ``x``."""
    if layout["kind"] == "contiguous":
        y = np.array(x, order="C")
    elif layout["kind"] == "unaligned":
        raw = bytearray(x.nbytes + 1)
        y = np.frombuffer(raw, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
        y[...] = x
    else:
        perm, steps = layout["perm"], layout["steps"]
        buf = np.empty(tuple(x.shape[p] * steps[p] for p in perm), dtype=x.dtype)
        y = buf.transpose(np.argsort(perm))[tuple(slice(None, None, s) for s in steps)]
        for axis, flip in enumerate(layout["flips"]):
            if flip:
                y = np.flip(y, axis)
        y[...] = x
    if layout["readonly"]:
        y.flags.writeable = False
    return y


def broadcastable(draw, full_shape, max_ndim):
    """A shape that broadcasts to ``full_shape``: each dim full or 1, and maybe
    fewer leading dims (at most ``max_ndim`` in all)."""
    shape = [n if draw(st.booleans()) else 1 for n in full_shape]
    drop = draw(st.integers(0, len(shape)))
    while drop and shape and (shape[0] == 1 or len(shape) > max_ndim):
        shape.pop(0)
        drop -= 1
    while len(shape) > max_ndim:
        shape.pop(0)
    return tuple(shape)


@st.composite
def problems(draw, regime="small", specials=True):
    """One call: its arguments and what it should give.  ``regime`` picks the
    sizes: "small" (every size from 0), "decode" (a few query rows against
    900-2200 keys: the row path) or "tiled" (several query and key blocks)."""
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
    else:  # several query blocks and key blocks
        L = draw(st.integers(33, 140))
        S = draw(st.integers(1, 140))
        E = draw(st.integers(1, 70))
        Ev = draw(st.integers(1, 40))
        batch = tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=1)))

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
    arrays, full_values = {}, {}
    for (name, shape), dt in zip(full.items(), dts):
        x = draw(values(rng, shape, dt, name, SPECIALS if with_specials else ()))
        full_values[name] = x
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
    mask = mask_full = None
    if mask_kind is not None:
        mshape = broadcastable(draw, weights_shape, len(weights_shape))
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
        mask_full = mask
        if draw(st.booleans()) and mask.ndim:
            mask = place(mask, draw(layouts(mask.ndim)))

    key_lengths = None
    if draw(st.integers(0, 3)) == 0:
        batch_seen = out_shape[:-3] if maxnd >= 3 else ()
        kshape = broadcastable(draw, batch_seen, len(batch_seen))
        kdt = draw(st.sampled_from(["int64", "int32"] + (["uint8"] if S + 3 < 256 else [])))
        key_lengths = rng.integers(0, S + 3, size=kshape).astype(kdt)

    scale = draw(st.sampled_from([None, None, None, 0.0, -0.5, 0.3, 2.0, 1e-3]))
    out = None
    if draw(st.integers(0, 3)) == 0:
        layout = {**draw(layouts(len(out_shape))), "readonly": False, "kind": "strided"}
        out = place(np.zeros(out_shape, dtype=cdtype), layout)

    return dict(
        q=arrays["q"], k=arrays["k"], v=arrays["v"], full=full_values, batch=batch, H=H, gqa=gqa,
        hq=hq, hk=hk, hv=hv, L=L, S=S, E=E, Ev=Ev, mask=mask, mask_full=mask_full,
        causal=causal, key_lengths=key_lengths, scale=scale, out=out, out_shape=out_shape,
        cdtype=cdtype, return_weights=draw(st.booleans()),
        num_threads=draw(st.sampled_from([None, 1, 2, 3])),
    )


def describe(p) -> str:
    parts = [f"{n}: {p[n].dtype}{p[n].shape} strides={p[n].strides}" for n in ("q", "k", "v")]
    m = p["mask"]
    parts.append("mask: None" if m is None else f"mask: {m.dtype}{m.shape}")
    for key in ("batch", "H", "gqa", "L", "S", "E", "Ev", "causal", "scale", "key_lengths", "num_threads"):
        parts.append(f"{key}={p[key]!r}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- expected values


def expand(p):
    """float64 arrays (N, H, rows, cols) for q, k, v and mask (N, H, L, S), and
    the key length of each of the N batch entries."""
    batch, H = p["batch"], p["H"]
    full = p["full"]
    nb = len(batch)
    # the batch shape sdpa sees (views may broadcast a size-1 dim), padded to nb dims
    seen = tuple(np.broadcast_shapes(*(p[n].shape[:-3] for n in "qkv")))
    bfull = (1,) * (nb - len(seen)) + seen
    N = int(np.prod(bfull, dtype=np.int64))

    def heads(x, grouped):
        x = np.broadcast_to(x.astype(np.float64), bfull + x.shape[nb:])
        if grouped and p["gqa"]:  # key/value head g serves query heads g * group ...
            hkv = max(p["hk"], p["hv"])
            x = np.broadcast_to(x, bfull + (hkv,) + x.shape[nb + 1 :])
            x = np.repeat(x, H // hkv, axis=nb)
        else:
            x = np.broadcast_to(x, bfull + (H,) + x.shape[nb + 1 :])
        return x.reshape((N,) + x.shape[nb:])

    q = heads(full["q"], False)
    k = heads(full["k"], True)
    v = heads(full["v"], True)
    L, S = p["L"], p["S"]
    m = p["mask_full"]
    if m is not None:
        m = np.broadcast_to(m, p["out_shape"][:-1] + (S,))
        m = np.broadcast_to(m.reshape((1,) * (nb + 3 - m.ndim) + m.shape), bfull + (H, L, S))
        m = m.reshape((N, H, L, S))
    lengths = np.full(N, S, dtype=np.int64)
    if p["key_lengths"] is not None:
        kl = np.asarray(p["key_lengths"]).astype(np.int64)
        kl = kl.reshape((1,) * (nb - kl.ndim) + kl.shape) if nb else kl.reshape(())
        lengths = np.minimum(np.broadcast_to(kl, bfull).reshape(N), S)
    return q, k, v, m, lengths


def causal_limits(p, lengths_n):
    """Keys each query row can see: 0 .. lim[l]-1."""
    L, S = p["L"], p["S"]
    lim = np.full(L, lengths_n, dtype=np.int64)
    if p["causal"]:
        d = S - L if p["causal"] == "bottom_right" else 0
        lim = np.clip(np.arange(L) + d + 1, 0, lengths_n)
    return lim


def check(p, out, weights):
    """Compares ``out`` (and ``weights``) with the reference, row by row."""
    cd = np.dtype(p["cdtype"])
    fi = np.finfo(cd)
    tol = dict(eps=float(fi.eps), big=float(fi.max), sub=float(fi.smallest_subnormal), S=p["S"], E=p["E"])
    if out.size == 0:
        return
    q, k, v, m, lengths = expand(p)
    N, H, L, S, E = q.shape[0], p["H"], p["L"], p["S"], p["E"]
    out = np.asarray(out, dtype=np.float64).reshape((N, H, L, p["Ev"]))
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64).reshape((N, H, L, S))
    scale = p["scale"] if p["scale"] is not None else (1.0 / np.sqrt(E) if E > 0 else 1.0)

    # bounds on what the kernel computes in the result dtype, from finite terms
    qf = np.where(np.isfinite(q), q, 0.0)
    kf = np.abs(np.where(np.isfinite(k), k, 0.0))
    sq = (cd.type(scale) * q.astype(cd)).astype(np.float64)  # scale * q as the kernel forms it
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
    # the reference's scores, for which keys a row sees at all
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    if m is not None:
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m
    seen = ~(scores == -np.inf)

    for n in range(N):
        length = int(lengths[n])
        lim = causal_limits(p, length)
        for h in range(H):
            for j in np.unique(lim):
                j = int(j)
                rows = np.flatnonzero(lim == j)
                mask_nl = None if m is None else m[n, h][np.ix_(rows, np.arange(j))]
                exp_out, exp_w = reference(
                    q[n, h, rows], k[n, h, :j], v[n, h, :j], mask_nl, False, p["scale"], return_weights=True
                )
                for i, l in enumerate(rows):
                    # rows the result dtype cannot be compared on (see the module docstring)
                    vj = v[n, h, :j]
                    vmax = float(np.max(np.where(np.isfinite(vj), np.abs(vj), 0), initial=0))
                    if (
                        sq_over[n, h, l]
                        or under_inf[n, h, l, :j].any()
                        or np.max(bound[n, h, l, :j] + mabs[n, h, l, :j], initial=0) > tol["big"] / 16
                        or np.max(unscaled[n, h, l, :j], initial=0) > 1e300
                        or j * vmax > tol["big"] / 16
                    ):
                        continue
                    check_row(
                        f"row (batch {n}, head {h}, query {l}), {j} keys visible",
                        exp_out[i], exp_w[i], out[n, h, l], None if weights is None else weights[n, h, l],
                        v=v[n, h], j=j, length=length, seen=seen[n, h, l, :j],
                        score_bound=float(np.max(bound[n, h, l, :j], initial=0)),
                        mask_bound=float(np.max(mabs[n, h, l, :j], initial=0)), **tol,
                    )


def check_row(where, exp_out, exp_w, got, got_w, *, v, j, length, seen, score_bound, mask_bound,
              eps, big, sub, S, E):
    # V entries the row may or may not multiply by a zero weight: above its
    # causal limit, before the key length
    hidden = ~np.isfinite(v[j:length]).all(axis=0) if length > j else np.zeros(v.shape[-1], bool)

    if np.isnan(exp_w).any():  # a NaN or +inf score: the whole row is NaN
        assert np.isnan(got).all(), f"{where}: expected a NaN row, got {got}"
        if got_w is not None and seen.any():
            assert np.isnan(got_w[:j][seen]).all(), f"{where}: expected NaN weights, got {got_w[:j]}"
        return

    if not (exp_w > 0).any():  # the row sees no key: zeros, whatever V holds
        assert (got == 0).all(), f"{where}: a row that sees no key gave {got}"
        if got_w is not None:
            assert (got_w == 0).all(), f"{where}: weights of a row that sees no key: {got_w}"
        return

    ref_nan = np.isnan(exp_out)
    assert np.isnan(got[ref_nan]).all(), f"{where}: NaN expected in {np.flatnonzero(ref_nan)}, got {got}"
    ref_inf = np.isinf(exp_out)
    assert (np.isnan(got) | (got == exp_out))[ref_inf].all(), f"{where}: expected {exp_out}, got {got}"

    finite = np.isfinite(exp_out)
    may = hidden & finite  # non-finite, or equal to the value without those V rows
    assert (np.isfinite(got) | may)[finite].all(), f"{where}: expected finite {exp_out}, got {got}"

    d = eps * ((E + 4) * score_bound + 2 * mask_bound)  # the rounding error of a score
    rounding = 16 * eps * (S + E + 8)
    vmax = np.max(np.where(np.isfinite(v[:j]), np.abs(v[:j]), 0), axis=0, initial=0.0)
    if d <= 0.05:
        tol = (np.expm1(2 * d) + rounding) * vmax + 8 * (S + 1) * sub
        err = np.abs(got - exp_out)
        close = (err <= tol) | (may & ~np.isfinite(got))
        assert close[finite].all(), (
            f"{where}: error {err[finite & ~close]} above {tol[finite & ~close]}\n"
            f"expected {exp_out}\ngot      {got}"
        )
        if got_w is not None:
            wtol = (np.expm1(2 * d) + rounding) * exp_w + 8 * sub
            werr = np.abs(got_w[:j] - exp_w)
            assert (werr <= wtol).all(), f"{where}: weights off by {werr.max()}"
            assert (got_w[j:] == 0).all(), f"{where}: weights past the visible keys"
    else:
        # The softmax is decided by rounding: each output is an average of the V
        # values of the keys the row sees.
        cols = finite & ~may
        vs = v[:j][seen]
        lo, hi = vs.min(axis=0), vs.max(axis=0)
        slack = rounding * np.maximum(np.abs(lo), np.abs(hi)) + 8 * (S + 1) * sub
        inside = (got >= lo - slack) & (got <= hi + slack)
        assert inside[cols].all(), f"{where}: {got} outside [{lo}, {hi}]"
        if got_w is not None:
            assert ((got_w >= 0) & (got_w <= 1 + 1e-6)).all(), f"{where}: weights {got_w}"
            assert (got_w[:j][~seen] == 0).all() and (got_w[j:] == 0).all(), f"{where}: weights {got_w}"


# --------------------------------------------------------------------------- the tests


def snapshot(*arrays):
    return [None if a is None else np.array(a, copy=True) for a in arrays]


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
@pytest.mark.parametrize("regime", ["small", "decode", "tiled"])
@given(data=st.data())
def test_matches_reference(data, regime, specials):
    p = data.draw(problems(regime, specials))
    note(describe(p))
    inputs = (p["q"], p["k"], p["v"], p["mask"], p["key_lengths"])
    before = snapshot(*inputs)
    kwargs = dict(
        attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"], enable_gqa=p["gqa"],
        key_lengths=p["key_lengths"], return_weights=p["return_weights"], out=p["out"],
        num_threads=p["num_threads"],
    )
    with np.errstate(all="ignore"):
        result = attention(p["q"], p["k"], p["v"], **kwargs)
    out, weights = result if p["return_weights"] else (result, None)
    assert out.shape == p["out_shape"] and out.dtype == p["cdtype"]
    if p["out"] is not None:
        assert out is p["out"]
    if weights is not None:
        assert weights.shape == p["out_shape"][:-1] + (p["S"],)

    # nothing written to the inputs
    for a, b in zip(inputs, before):
        if a is not None:
            assert np.array_equal(a, b, equal_nan=True)

    # the same bits for another thread count
    other = 3 if p["num_threads"] != 3 else 1
    again = attention(p["q"], p["k"], p["v"], **{**kwargs, "out": None, "num_threads": other})
    again_out = again[0] if p["return_weights"] else again
    assert np.array_equal(again_out, out, equal_nan=True)

    with np.errstate(all="ignore"):
        check(p, out, weights)


@pytest.mark.parametrize("shape", [(2, 0), (3, 2, 0), (2, 0, 4)])
def test_empty_out_is_accepted(shape):
    """NumPy gives arrays without elements zero strides: no overlap for all that."""
    *lead, L, Ev = shape
    q = np.ones(tuple(lead) + (L, 4), np.float32)
    k = np.ones(tuple(lead) + (5, 4), np.float32)
    v = np.ones(tuple(lead) + (5, Ev), np.float32)
    out = np.empty(shape, np.float32)
    assert attention(q, k, v, out=out) is out


def test_fuzz_harness_smoke():
    """fuzz/fuzz_attention.py decodes random bytes and checks each call; a few
    hundred inputs here keep it working without atheris."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_attention.py"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    spec = importlib.util.spec_from_file_location("fuzz_attention", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    rng = np.random.default_rng(20241129)
    for _ in range(300):
        data = rng.integers(0, 256, size=int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        try:
            harness.TestOneInput(data)
        except BaseException as exc:
            raise AssertionError(f"fuzz input {data.hex()} failed: {exc!r}") from exc
