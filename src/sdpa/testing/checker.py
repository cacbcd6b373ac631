"""The oracle: :func:`assert_matches_reference` checks one call's result against
:mod:`sdpa.reference`, row by row, with a tolerance that follows the conditioning of each row."""
from __future__ import annotations

import math
from typing import (
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy as np
import numpy.typing as npt

from .. import _core, reference as _reference
from .problems import Shape, compute_dtype

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
        # sides past the core's largest position show every key, as sdpa takes them
        top = _core.MAX_POSITION
        self.window = None if window is None else (min(int(window[0]), top), min(int(window[1]), top))
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
