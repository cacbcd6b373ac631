"""Key/value cache for autoregressive decoding.

A decoder recomputes nothing for the tokens it has already seen: each attention
layer keeps their keys and values, appends those of the new tokens at every step,
and attends the new queries to everything kept so far.  :class:`KVCache` is that
storage for one layer, preallocated so that a step costs one copy of the new
tokens and no reallocation.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union, cast

import numpy as np

from . import _core
from ._api import (
    ArrayInput,
    AttentionResult,
    count,
    float_dtype,
    general,
    key_score_rows,
    quantized_query_dtype,
    result_dtype,
)
from ._checks import flag
from ._dtypes import (
    FLOAT_NAMES,
    FP8_NAMES,
    INT8,
    QUANTIZED_NAMES,
    _check_real,
    needs_scales,
    width_of,
)

__all__ = ["KVCache", "KVCacheFullError", "CacheFormat"]


class KVCacheFullError(ValueError):
    """Appending would go past the capacity of a :class:`KVCache` that may not grow."""


class KVCache:
    """Preallocated key/value storage of one attention layer.

    Keys are kept in an array of shape (batch, num_kv_heads, capacity, head_dim),
    values in one of shape (batch, num_kv_heads, capacity, head_dim_v); the first
    :attr:`length` positions along dim 2 are filled.

    Parameters
    ----------
    batch : int
        Sequences decoded side by side.
    num_kv_heads : int
        Key/value heads (Hkv).
    capacity : int
        Positions reserved up front.
    head_dim : int
        Features of a key (E).
    head_dim_v : int, optional
        Features of a value (Ev); defaults to ``head_dim``.
    dtype : numpy dtype or str, default float32
        Storage dtype: float32, float64, float16 or ``ml_dtypes.bfloat16``;
        appended arrays are converted to it.  A 16-bit cache takes half the
        memory and half the reading time of a float32 one: attention reads it
        in place (a float32 query against it gives float32 results).

        Quantized caches (the kernels dequantize as they read, the cache is
        never copied; appended values must be finite):

        - ``"int8"`` (or ``np.int8``): symmetric, round to nearest, a float32
          scale ``max|x| / 127`` per (batch, head, position), or per group of
          ``group_size`` features; about a quarter of float32's bytes.
        - ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (or ml_dtypes' types of those
          names): one byte a value, the scale ``max|x| / 448`` (``/ 57344``)
          per position and head, or per group, so that the format's range is
          used; ``scale=None`` stores the values as they are (they must then
          fit: ``|x| <= 448`` / ``57344``).
        - ``"int4"`` (or ``ml_dtypes.int4``): two values a byte, symmetric in
          [-7, 7], a float32 scale ``max|x| / 7`` per group of ``group_size``
          features (32 by default where it divides both head dims, else a whole
          row); about an eighth of float32's bytes (plus the scales).

        Any other dtype is refused with a TypeError listing these.
    group_size : int, optional
        Quantized caches only: features per scale, a divisor of ``head_dim``
        and ``head_dim_v`` (even for int4); by default one scale covers a whole
        key (or value) row (int4: groups of 32 where they fit).  Smaller groups
        follow outliers more closely at 4 bytes per group.
    scale : ``"absmax"`` or None, default ``"absmax"``
        float8 caches: ``None`` keeps no scales (values stored as they are);
        every other quantized cache needs its scales.
    grow : bool, default False
        When an append does not fit: False raises :class:`KVCacheFullError`;
        True reallocates with (at least) twice the capacity, so that appends stay
        amortized O(tokens).
    latent : bool, default False
        MLA's latent cache (DeepSeek-style absorbed attention): the values are
        the first ``head_dim_v`` features of the keys, stored once.
        :meth:`append` then takes the keys only (``v`` None), and attention reads
        the latent once for both products.  An int8 latent's values use the
        keys' scales (one per row, or the first ``head_dim_v // group_size``
        groups).
    window : int, optional
        A rolling cache for sliding-window attention in which each position sees
        itself and the ``window - 1`` positions before it: when an append does
        not fit, the positions no new query can see any more are dropped (the
        last ``window - 1`` are moved to the front) before the storage grows or
        the append fails.  A capacity of ``window - 1`` plus the longest append,
        and some room beyond it so that the move is rare, bounds the memory for
        any number of steps.  :attr:`start` counts the positions dropped.
        Attention aligned to the last key (``is_causal="bottom_right"``) with
        ``window=(window - 1, 0)`` gives over the held keys what it gives over
        all of them.

    A cache may be shared by Python threads: :meth:`append`, :meth:`reserve`
    and :meth:`reset` hold a lock, so concurrent appends each land whole, one
    after the other (in an unspecified order), and :attr:`keys` / :attr:`values`
    see a cache between two of them.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import KVCache
    >>> cache = KVCache(batch=1, num_kv_heads=2, capacity=16, head_dim=4)
    >>> k = v = np.ones((1, 2, 3, 4), dtype=np.float32)
    >>> _ = cache.append(k, v)
    >>> len(cache), cache.keys.shape
    (3, (1, 2, 3, 4))

    Storage of an int8 cache: ``key_data`` int8 (batch, num_kv_heads,
    capacity, head_dim) and ``key_scales`` float32 (batch, num_kv_heads,
    capacity, head_dim // group_size, or 1); key feature ``c`` of a position is
    ``float32(key_data[..., c]) * key_scales[..., c // group_size]`` (in float32),
    and values alike.  :attr:`keys` / :attr:`values` return those dequantized
    values as float32 copies.  A float8 cache stores the format's bytes as
    uint8 (``key_data.view(ml_dtypes.float8_e4m3fn)`` reads them), an int4
    cache stores uint8 (batch, num_kv_heads, capacity, head_dim // 2): value
    ``c`` in byte ``c // 2``, the low nibble for even ``c``, each nibble the
    value plus 8; their :attr:`keys` and :attr:`values` are dequantized alike.
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        head_dim_v: int | None = None,
        dtype: Any = np.float32,
        grow: bool = False,
        window: Optional[int] = None,
        group_size: Optional[int] = None,
        latent: bool = False,
        scale: Optional[str] = "absmax",
    ) -> None:
        self._batch = count(batch, "batch", 1)
        self._heads = count(num_kv_heads, "num_kv_heads", 1)
        capacity = count(capacity, "capacity", 0)
        fmt = self._format = CacheFormat.make(dtype, head_dim, head_dim_v, group_size=group_size, latent=latent,
                                              scale=scale)
        self._e, self._ev = fmt.head_dim, fmt.head_dim_v
        self._dtype = fmt.storage
        self._code = fmt.code  # the core's code of a quantized cache, 0 for float
        self._base = fmt.call()  # the prepared calls of this storage, without integer products
        self._int8 = self._code != 0  # quantized: scales, and dequantized keys / values
        self._width = fmt.width  # values a stored byte holds
        self._scaled = fmt.scaled
        self._group = fmt.group  # quantized: features per scale, 0 for whole rows
        self._latent = fmt.latent
        self.grow = bool(grow)
        self._window = None if window is None else count(window, "window", 1)
        self._lock = threading.Lock()
        self._length = 0
        self._start = 0
        self._k, self._v, self._ks, self._vs = self._storage(capacity)

    def _storage(self, capacity: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Zeroed keys, values and (quantized with scales; else empty) their scales for capacity positions."""
        return self._format.allocate((self._batch, self._heads, capacity))

    # ------------------------------------------------------------------ sizes

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def num_kv_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._e

    @property
    def head_dim_v(self) -> int:
        return self._ev

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype: int8 for an int8 cache, uint8 for float8 and int4
        ones (:attr:`quantization` names them)."""
        return self._dtype

    @property
    def quantization(self) -> Optional[str]:
        """``"int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or ``"int4"`` for a
        quantized cache; None for a float one."""
        return QUANTIZED_NAMES.get(self._code)

    @property
    def group_size(self) -> Optional[int]:
        """Features per scale of a quantized cache; None when one scale covers
        each row, and for a float cache or a float8 one without scales."""
        return self._group or None

    @property
    def _name(self) -> str:
        return self._format.name

    @property
    def format(self) -> CacheFormat:
        """What the cache stores and how (dtype, scales, groups, latent)."""
        return self._format

    @property
    def length(self) -> int:
        """Positions held (all appended so far, less :attr:`start` for a rolling cache)."""
        return self._length

    def __len__(self) -> int:
        return self._length

    @property
    def window(self) -> Optional[int]:
        """The window of a rolling cache (positions each query sees), or None."""
        return self._window

    @property
    def start(self) -> int:
        """Positions dropped from the front of a rolling cache: ``keys[..., i, :]``
        is position ``start + i`` of the sequence.  Always 0 without a window."""
        return self._start

    @property
    def capacity(self) -> int:
        """Positions that fit before the storage is full."""
        return self._k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the storage (keys, values and int8 scales, whole capacity; a
        latent cache's values are the keys' bytes, counted once)."""
        if self._latent:
            return self._k.nbytes + self._ks.nbytes
        return self._k.nbytes + self._v.nbytes + self._ks.nbytes + self._vs.nbytes

    @property
    def latent(self) -> bool:
        """Whether the values are the keys' first head_dim_v features (MLA)."""
        return self._latent

    # ------------------------------------------------------------------ contents

    @property
    def keys(self) -> np.ndarray:
        """The filled keys, (batch, num_kv_heads, length, head_dim): a read-only view
        of the storage, valid until the next :meth:`reset`, growth or (with a
        window) roll.  For an int8 cache, a new float32 array of the dequantized keys (the values
        attention computes with)."""
        with self._lock:
            k, ks = self._k[:, :, : self._length], self._ks[:, :, : self._length]
        return self._filled(k, ks)

    @property
    def values(self) -> np.ndarray:
        """The filled values, (batch, num_kv_heads, length, head_dim_v): a read-only
        view of the storage, valid until the next :meth:`reset`, growth or (with
        a window) roll.  For an int8 cache, a new float32 array of the dequantized values."""
        with self._lock:
            v, vs = self._v[:, :, : self._length], self._vs[:, :, : self._length]
        return self._filled(v, vs)

    def _filled(self, data: np.ndarray, scales: np.ndarray) -> np.ndarray:
        if self._int8:
            return dequantize(self._code, data, scales if self._scaled else None)
        data.flags.writeable = False
        return data

    @property
    def key_data(self) -> np.ndarray:
        """The filled part of the key storage as it is (int8 for an int8 cache), read only."""
        with self._lock:
            view = self._k[:, :, : self._length]
        view.flags.writeable = False
        return view

    @property
    def value_data(self) -> np.ndarray:
        """The filled part of the value storage as it is, read only."""
        with self._lock:
            view = self._v[:, :, : self._length]
        view.flags.writeable = False
        return view

    @property
    def key_scales(self) -> Optional[np.ndarray]:
        """A quantized cache's scales of the filled keys, float32 (batch,
        num_kv_heads, length, groups), read only; None for a float cache or a
        float8 one without scales."""
        if not self._scaled:
            return None
        with self._lock:
            view = self._ks[:, :, : self._length]
        view.flags.writeable = False
        return view

    @property
    def value_scales(self) -> Optional[np.ndarray]:
        """The scales of the filled values, as :attr:`key_scales`."""
        if not self._scaled:
            return None
        with self._lock:
            view = self._vs[:, :, : self._length]
        view.flags.writeable = False
        return view

    def check_fits(
        self, batch: int, num_kv_heads: int, head_dim: int, head_dim_v: Optional[int] = None
    ) -> None:
        """ValueError unless this cache holds keys and values of these sizes
        (``head_dim_v`` defaults to ``head_dim``)."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        mine = (self._batch, self._heads, self._e, self._ev)
        if mine != (batch, num_kv_heads, head_dim, head_dim_v):
            raise ValueError(
                f"cache: holds (batch={self._batch}, num_kv_heads={self._heads}, "
                f"head_dim={self._e}, head_dim_v={self._ev}), but this call needs "
                f"(batch={batch}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
                f"head_dim_v={head_dim_v})"
            )

    def append(self, k: Any, v: Any = None) -> Tuple[np.ndarray, np.ndarray]:
        """Append the keys and values of T new positions.

        Parameters
        ----------
        k : array_like, shape (batch, num_kv_heads, T, head_dim)
        v : array_like, shape (batch, num_kv_heads, T, head_dim_v)
            T >= 1.  Converted to the cache's dtype.  None, and only None, for a
            latent cache (its values are the keys' first head_dim_v features).

        Returns
        -------
        (keys, values) : the filled part after the append, as :attr:`keys` and
        :attr:`values` give it: for an int8 cache, dequantized copies of the
        whole cache (costly at every step: attend with :meth:`attend` instead,
        which reads the int8 storage in place).

        Raises
        ------
        ValueError
            Shapes that do not fit the cache, or (int8) a value that is NaN or
            infinite (nothing is written).
        KVCacheFullError
            The positions do not fit and the cache may not grow (nothing is written).
        """
        end = self._append(k, v)
        with self._lock:
            keys, values = self._k[:, :, :end], self._v[:, :, :end]
            kscales, vscales = self._ks[:, :, :end], self._vs[:, :, :end]
        return self._filled(keys, kscales), self._filled(values, vscales)

    def _checked(self, k: Any, v: Any) -> Tuple[np.ndarray, np.ndarray]:
        """The keys and values of an append, checked against this cache (shapes,
        dtypes and, for int8, finite values; converted to native float32 then);
        raises naming ``k`` or ``v`` before anything is written."""
        if self._latent != (v is None):
            raise ValueError(
                "v: a latent cache takes the keys only (its values are their first head_dim_v features)"
                if self._latent else "v: expected the values (only a latent cache takes None)"
            )
        k = np.asarray(k)
        v = k[..., : self._ev] if v is None else np.asarray(v)
        expected_k = (self._batch, self._heads, "T", self._e)
        expected_v = (self._batch, self._heads, "T", self._ev)
        for a, name, expected in ((k, "k", expected_k), (v, "v", expected_v)):
            _check_real(a, name)
            if (
                a.ndim != 4
                or a.shape[:2] != expected[:2]
                or a.shape[3] != expected[3]
            ):
                shown = "(" + ", ".join(str(x) for x in expected) + ")"
                raise ValueError(
                    f"{name}: expected shape {shown} (batch, num_kv_heads, tokens, features), "
                    f"got shape {a.shape}"
                )
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(
                f"k and v: must hold the same number of tokens (dim 2); got k {k.shape}, "
                f"v {v.shape}"
            )
        if T < 1:
            raise ValueError(f"k and v: expected at least one token (dim 2), got k {k.shape}")
        if self._int8:
            # native, aligned, contiguous float32 (a misaligned buffer, such as one
            # unpickled from a network message, is copied)
            k = np.require(k, np.float32, ["C", "A"])
            v = np.require(v, np.float32, ["C", "A"])
            for a, name in ((k, "k"), (v, "v")):
                check_storable(a, name, self._code, self._scaled)
        return k, v

    def _append(self, k: Any, v: Any) -> int:
        """append without building its result; returns the length after it."""
        k, v = self._checked(k, v)
        T = k.shape[2]
        with self._lock:
            if self._length + T > self.capacity and self._window is not None:
                kept = min(self._length, self._window - 1)
                if kept + T <= self.capacity or self.grow:  # else fail below, nothing dropped
                    self._roll(T)
            start, end = self._length, self._length + T
            if end > self.capacity:
                if not self.grow:
                    raise KVCacheFullError(
                        f"KVCache is full: {start} of {self.capacity} positions are used "
                        f"and {T} more do not fit; make it larger or pass grow=True"
                    )
                self._reserve(max(end, 2 * self.capacity))
            if self._int8:
                ks = self._ks[:, :, start:end] if self._scaled else None
                _core.quantize(self._code, k, self._k[:, :, start:end], ks, self._group)
                if not self._latent:
                    vs = self._vs[:, :, start:end] if self._scaled else None
                    _core.quantize(self._code, v, self._v[:, :, start:end], vs, self._group)
            else:
                np.copyto(self._k[:, :, start:end], k, casting="same_kind")
                if not self._latent:
                    np.copyto(self._v[:, :, start:end], v, casting="same_kind")
            self._length = end
        return end

    def _roll(self, T: int) -> None:  # with the lock held
        """Drop the positions that none of T new queries can see: keep the last
        window - 1 at the front."""
        assert self._window is not None
        keep = min(self._length, self._window - 1)
        drop = self._length - keep
        if drop == 0:
            return
        for a in (self._k, self._ks) if self._latent else (self._k, self._v, self._ks, self._vs):
            a[:, :, :keep] = a[:, :, drop:self._length].copy()
        self._length = keep
        self._start += drop

    def reserve(self, capacity: int) -> None:
        """Make room for at least ``capacity`` positions (keeps the contents)."""
        capacity = count(capacity, "capacity", 0)
        with self._lock:
            if capacity > self.capacity:
                self._reserve(capacity)

    def _reserve(self, capacity: int) -> None:  # with the lock held
        n = self._length
        new = self._storage(capacity)
        for a, old in zip(new, (self._k, self._v, self._ks, self._vs)):
            if not (self._latent and (old is self._v or old is self._vs)):  # views of the keys
                a[:, :, :n] = old[:, :, :n]
        self._k, self._v, self._ks, self._vs = new

    def attend(
        self,
        query: ArrayInput,
        attn_mask: Optional[ArrayInput] = None,
        is_causal: Union[bool, str] = "bottom_right",
        scale: Optional[float] = None,
        *,
        return_lse: bool = False,
        out: Optional[np.ndarray] = None,
        num_threads: Optional[int] = None,
        window: Optional[Tuple[int, int]] = None,
        softcap: Optional[float] = None,
        alibi_slopes: Optional[ArrayInput] = None,
        sinks: Optional[ArrayInput] = None,
        integer_qk: bool = False,
        integer_pv: bool = False,
        return_key_scores: bool = False,
        key_scores_window: Optional[int] = None,
    ) -> AttentionResult:
        """Attention of ``query`` over the held keys and values.

        :func:`sdpa.scaled_dot_product_attention` with the cache as key and
        value: ``query`` is (batch, num_heads, L, head_dim), ``num_heads`` a
        multiple of ``num_kv_heads`` (grouped-query attention is inferred), and
        the keywords mean what they mean there.  ``is_causal`` defaults to
        ``"bottom_right"``: the L queries are the last L positions.  A rolling
        cache's ``window`` defaults to ``(window - 1, 0)``.  An int8 cache is
        read in place, dequantized by the kernels; its query is computed in
        float32 (a 16-bit query keeps its dtype for the output, any other is
        converted to float32).  So are float8 and int4 caches.

        ``integer_qk=True`` (int8 and int4 caches only) computes the scores of
        decoding-size calls in integers: each scaled query row is rounded to
        int8 with its own scale (``max|q| / 127``) and multiplied with the
        stored keys exactly (AVX512-VNNI / AVX-VNNI where the CPU has them,
        the same integer sums in portable C where not); the weighted sum of
        the values stays in float.  It adds the query's rounding, about
        ``2^-8 max|q| |k|`` per term, to the scores (docs/guarantees.md gives
        the measured error); long queries (the tiled path) compute in float
        whatever it says.

        ``integer_pv=True`` (int8 and int4 caches only) computes the weighted
        sum of the values of decoding-size calls in integers: for each query
        row, each run of 64 keys and each value scale group, the weights
        times the values' scales are rounded to 0..255 against the run's
        largest, and multiplied with the stored values exactly (AVX512-VNNI
        where the CPU has it, the same integer sums in portable C where not).
        It adds the weights' rounding, at most ``2^-9`` of the run's largest
        weight per term (docs/guarantees.md gives the measured error); the
        VNNI and portable kernels give the same bits.  Both switches together compute both
        products in integers.

        ``return_key_scores=True`` also returns, last, each held key's attention
        mass, float32 (batch, num_kv_heads, length), indexed as :attr:`keys` is
        (``key_scores_window``: the last rows only), as
        :func:`sdpa.scaled_dot_product_attention` computes it: with
        :meth:`keep`, an H2O-style eviction of the keys that received little
        attention.
        """
        return self._attend(
            query, attn_mask, is_causal, scale, return_lse, out, num_threads,
            window, softcap, alibi_slopes, sinks, None, integer_qk, integer_pv,
            key_score_rows(return_key_scores, key_scores_window),
        )

    def _attend(
        self,
        query: ArrayInput,
        attn_mask: Optional[ArrayInput],
        is_causal: Union[bool, str],
        scale: Optional[float],
        return_lse: bool,
        out: Optional[np.ndarray],
        num_threads: Optional[int],
        window: Optional[Tuple[int, int]] = None,
        softcap: Optional[float] = None,
        alibi_slopes: Optional[ArrayInput] = None,
        sinks: Optional[ArrayInput] = None,
        diagonal: Optional[int] = None,
        integer_qk: bool = False,
        integer_pv: bool = False,
        key_scores: Optional[int] = None,
    ) -> AttentionResult:
        """attend; ``diagonal`` (see ``sdpa._api._attention_general``) replaces
        ``is_causal`` when the held positions are one range of a longer sequence.

        The storage needs no checks: a call whose query and keywords the core
        takes as they are runs from the core's one entry (int8 and float caches
        alike); anything else takes the general path, which converts or raises
        naming the argument."""
        if integer_qk is False and integer_pv is False:  # the common call: its base kept by the cache
            base = self._base
        else:
            base = base_call(self._code, self._group, integer_qk, integer_pv)
        if window is None and self._window is not None:
            window = (self._window - 1, 0)
        shape = getattr(query, "shape", None)
        if shape is None:
            shape = np.shape(cast(Any, query))
        gqa = (shape[-3] if len(shape) >= 3 else 1) != self._heads
        call = base.prepared(is_causal, scale, gqa, window, softcap, num_threads, False, return_lse)
        if diagonal is not None:
            call = call.at_diagonal(diagonal)
        ks: Optional[np.ndarray] = None
        vs: Optional[np.ndarray] = None
        with self._lock:
            n = self._length
            k, v = self._k[:, :, :n], self._v[:, :, :n]
            if self._scaled:
                ks, vs = self._ks[:, :, :n], self._vs[:, :, :n]
        extras = None if alibi_slopes is None and sinks is None else (alibi_slopes, sinks, None)
        result = call.run_cache(query, k, v, ks, vs, attn_mask, out, extras, key_scores=key_scores)
        if not isinstance(result, int):
            return result
        return general(
            call, query, k, v, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, out=out,
            key_scale=ks, value_scale=vs, key_scores=key_scores,
        )

    def result_dtype(self, query_dtype: Any) -> np.dtype:
        """The dtype of :meth:`attend`'s output for a query of ``query_dtype``."""
        qdt = np.dtype(query_dtype)
        if self._int8:
            return quantized_query_dtype(qdt)
        return result_dtype(qdt, self._dtype, self._dtype)

    def keep(self, positions: ArrayInput) -> None:
        """Keep only the listed held positions of each (batch index, key/value
        head), in the order given, at the front: ``positions`` ints (batch,
        num_kv_heads, n) or broadcastable to it (n the same for every head),
        each in ``[0, length)`` and listed once per head.  The length becomes
        n; the keys' positions in the sequence are then the caller's to track
        (causality counts the held keys).  With the scores of
        :meth:`attend`'s ``return_key_scores``, the eviction of H2O or SnapKV::

            out, scores = cache.attend(q, return_key_scores=True)
            top = np.sort(np.argsort(scores, axis=-1)[..., -budget:], axis=-1)
            cache.keep(top)

        Not for a rolling cache (ValueError): its positions are a range."""
        if self._window is not None:
            raise ValueError("positions: a rolling cache keeps a range of positions, not a selection")
        idx = np.asarray(positions)
        if idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer) or idx.ndim != 3:
            raise TypeError(f"positions: expected ints (batch, num_kv_heads, n), got {idx.dtype} {idx.shape}")
        with self._lock:
            n_held = self._length
            try:
                idx = np.broadcast_to(idx, (self._batch, self._heads, idx.shape[-1]))
            except ValueError:
                raise ValueError(
                    f"positions: shape {idx.shape} does not broadcast to ({self._batch}, {self._heads}, n)"
                ) from None
            if idx.size and (idx.min() < 0 or idx.max() >= n_held):
                raise ValueError(f"positions: expected positions in [0, {n_held})")
            ordered = np.sort(idx, axis=-1)
            if (ordered[..., 1:] == ordered[..., :-1]).any():
                raise ValueError("positions: a position is listed twice for one head")
            n = idx.shape[-1]
            take = idx[..., None]
            arrays = [self._k, self._ks] + ([] if self._latent else [self._v, self._vs])
            for a in arrays:
                if a.ndim == 4 and a.shape[2] >= n_held:
                    a[:, :, :n] = np.take_along_axis(a[:, :, :n_held], take, axis=2)
            self._length = n

    def reset(self) -> None:
        """Forget every position (the storage is kept for reuse)."""
        with self._lock:
            self._length = 0
            self._start = 0

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self._batch}, num_kv_heads={self._heads}, "
            f"length={self._length}, capacity={self.capacity}, head_dim={self._e}, "
            f"head_dim_v={self._ev}, dtype={self._name}, grow={self.grow}"
            + (f", group_size={self.group_size}" if self._group else "")
            + (", scale=None" if self._int8 and not self._scaled else "")
            + (", latent=True" if self._latent else "")
            + (f", window={self._window}, start={self._start})" if self._window is not None else ")")
        )


CACHE_DTYPES = FLOAT_NAMES + tuple(_core.QUANTIZED)

# the float8 formats' largest magnitudes, by the core's code
_FP8_MAX = {int(_core.QUANTIZED[name]): _core.QUANTIZED_MAX[name] for name in FP8_NAMES}


def article(name: str) -> str:
    """ "an" before a format's name that starts with "int", else "a"."""
    return "an" if name.startswith("int") else "a"


def check_storable(a: np.ndarray, name: str, code: int, scaled: bool) -> None:
    """ValueError naming ``name`` unless the float32 values ``a`` can be
    stored in the quantized format ``code`` (``scaled``: with scales): finite,
    and within a float8 format's range where it has no scales.  The rule of
    :meth:`KVCache.append` and :func:`sdpa.paged_write` alike."""
    kind = QUANTIZED_NAMES[code]
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: {article(kind)} {kind} cache holds finite values only; got NaN or inf")
    if not scaled and code in _FP8_MAX and a.size:
        top, got = _FP8_MAX[code], float(np.abs(a).max())
        if got > top:
            raise ValueError(f"{name}: {article(kind)} {kind} cache without scales holds values up to {top:g} in "
                             f"magnitude; got {got:g} (scales would take them)")


def _quantized_name(dtype: Any) -> Optional[str]:
    """The quantized cache ``dtype`` asks for (a name, np.int8 or an ml_dtypes
    type of those names), or None."""
    if isinstance(dtype, str):
        return dtype if dtype in _core.QUANTIZED else None
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return None
    return name if name in _core.QUANTIZED else None


def quantized_code(dtype: Any) -> int:
    """The core's code of the quantized cache ``dtype`` asks for; 0 for any other."""
    name = _quantized_name(dtype)
    return 0 if name is None else int(_core.QUANTIZED[name])


CACHE_LINE = 64


def aligned_full(shape: Tuple[int, ...], fill: Any, dtype: Any) -> np.ndarray:
    """``np.full(shape, fill, dtype)`` starting on a cache line.  NumPy's own
    allocations start 16 bytes past one (glibc's malloc), so that every
    64-byte load of a cached key row straddles two lines: a float32 decoding
    step through KVCache took 8-11% longer where the cache fits in L2
    (256-4K positions, 2 threads; benchmarks/RESULTS.md 2026-12-04), and the
    same at 32K positions, where memory bounds it."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    a = raw[start : start + nbytes].view(dt).reshape(shape)
    a.fill(fill)
    return a


@dataclass(frozen=True)
class CacheFormat:
    """What a KV cache stores and how, checked once: the one home of the
    format's rules, shared by :class:`KVCache`, :class:`~sdpa.PagedKVCache`
    (and so :class:`~sdpa.dask.ShardedKVCache`, which keeps KVCache's).

    ``name`` is the format ("float32", ..., "int8", "int4", "float8_e4m3fn",
    "float8_e5m2"); ``storage`` the arrays' dtype; ``code`` the core's code of
    a quantized format (0 for float); ``width`` the values a stored element
    holds (2 for int4); ``scaled`` whether float32 scales go with it;
    ``group`` the features a scale (0: the whole row); ``latent`` whether the
    values are the keys' first ``head_dim_v`` features (MLA)."""

    name: str
    storage: np.dtype[Any]
    code: int
    width: int
    scaled: bool
    group: int
    latent: bool
    head_dim: int
    head_dim_v: int

    @classmethod
    def make(cls, dtype: Any, head_dim: Any, head_dim_v: Any = None, *, group_size: Any = None,
             latent: Any = False, scale: Optional[str] = "absmax") -> "CacheFormat":
        """The format a cache's constructor asks for; ValueError or TypeError
        naming the argument that breaks a rule."""
        e = count(head_dim, "head_dim", 1)
        ev = e if head_dim_v is None else count(head_dim_v, "head_dim_v", 1)
        storage = cache_dtype(dtype)
        code = quantized_code(dtype)
        name = QUANTIZED_NAMES.get(code, str(storage))
        width = width_of(code)
        if scale not in ("absmax", None):
            raise ValueError(f'scale: expected "absmax" or None, got {scale!r}')
        if scale is None and needs_scales(code):
            raise ValueError(f"scale: only a float8 cache may go without scales; this one is {name}")
        scaled = code != 0 and scale is not None
        group = 0
        if group_size is not None:
            if not scaled:
                raise ValueError(f"group_size: only a quantized cache with scales has groups; this one is {name}")
            group = count(group_size, "group_size", 1)
            if e % group or ev % group or group % width:
                raise ValueError(f"group_size: {group} must divide head_dim ({e}) and head_dim_v ({ev})"
                                 + (" and be even" if width == 2 else ""))
        elif width == 2 and e % 32 == 0 and ev % 32 == 0:
            group = 32  # int4's default: a scale per 32 features where that divides both
        if width == 2 and (e % 2 or ev % 2):
            raise ValueError(f"head_dim: an int4 cache holds two values a byte, so head_dim ({e}) and "
                             f"head_dim_v ({ev}) must be even")
        flag(latent, "latent")
        if latent and ev > e:
            raise ValueError(f"head_dim_v: a latent cache's values are the first head_dim_v of the keys' {e} "
                             f"features; got {ev}")
        return cls(name, storage, code, width, scaled, group, bool(latent), e, ev)

    @property
    def kv_dtype(self) -> Optional[str]:
        """The ``kv_dtype`` the paged functions take for this storage (None for
        float and int8 arrays, which say what they hold)."""
        return None if self.code in (0, INT8) else self.name

    def call(self, integer_qk: object = False, integer_pv: object = False) -> _core.Call:
        """The base prepared call of this storage (see ``sdpa._core.Call``),
        with the integer products asked for (checked there)."""
        return base_call(self.code, self.group, integer_qk, integer_pv)

    def allocate(self, rows: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Keys, values and scales for ``rows`` (leading dims) positions, each
        starting on a cache line, holding zeros: (rows..., head_dim / width),
        (rows..., head_dim_v / width) and float32 (rows..., groups), no groups
        (a last dim of 0) without scales.  A latent format's values (and their
        scales) are views of the keys'."""
        w = self.width
        fill = 0x88 if w == 2 else 0  # zero bytes are zeros, but for int4, whose nibbles hold the value plus 8
        gk = (self.head_dim // self.group if self.group else 1) if self.scaled else 0
        gv = (self.head_dim_v // self.group if self.group else 1) if self.scaled else 0
        k = aligned_full(rows + (self.head_dim // w,), fill, self.storage)
        ks = aligned_full(rows + (gk,), 0, np.float32)
        if self.latent:
            return k, k[..., : self.head_dim_v // w], ks, ks[..., :gv]
        return k, aligned_full(rows + (self.head_dim_v // w,), fill, self.storage), ks, \
            aligned_full(rows + (gv,), 0, np.float32)


def cache_dtype(dtype: Any, name: str = "dtype") -> np.dtype[Any]:
    """The storage dtype of a :class:`KVCache`: int8 (an int8 cache), uint8
    (float8 and int4 caches), or float16, bfloat16, float32 or float64.
    TypeError naming ``name`` and listing those otherwise."""
    quantized = _quantized_name(dtype)
    if quantized is not None:
        return np.dtype(np.int8 if quantized == "int8" else np.uint8)
    try:
        return float_dtype(dtype, name)
    except TypeError:
        shown = repr(dtype) if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
        raise TypeError(
            f"{name}: a KV cache stores {', '.join(CACHE_DTYPES[:4])}, or the quantized "
            f"{', '.join(repr(n) for n in CACHE_DTYPES[4:])}; got {shown}"
        ) from None


def _fp8_table(code: int) -> np.ndarray:
    """The float32 value of each of the 256 bytes of a float8 format."""
    b = np.arange(256, dtype=np.uint16)
    if code == _core.QUANTIZED["float8_e5m2"]:
        return (b << 8).view(np.float16).astype(np.float32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, mant = (b >> 3) & 15, (b & 7).astype(np.float64)
    value = np.where(exp == 0, mant * 2.0**-9, (1 + mant / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    value = np.where((b & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


_TABLES: dict[int, np.ndarray] = {}


def dequantize(code: int, data: np.ndarray, scales: Optional[np.ndarray]) -> np.ndarray:
    """The float32 values of quantized storage (the core's ``code``), each times
    its group's scale (in float32, as the kernels compute): a new array of
    shape (..., features)."""
    if code == _core.QUANTIZED["int8"]:
        values = data.astype(np.float32)
    elif code == _core.QUANTIZED["int4"]:
        values = np.empty(data.shape[:-1] + (2 * data.shape[-1],), np.float32)
        values[..., 0::2] = (data & 15).astype(np.float32) - 8
        values[..., 1::2] = (data >> 4).astype(np.float32) - 8
    else:
        table = _TABLES.get(code)
        if table is None:
            table = _TABLES[code] = _fp8_table(code)
        values = table[data]
    if scales is None:
        return values
    width = values.shape[-1] // max(scales.shape[-1], 1)
    return cast(np.ndarray, values * np.repeat(scales, width, axis=-1))


# the base prepared calls of the cache formats met so far, by (code,
# group_size, integer_qk, integer_pv); past this many it starts again
_BASES: Dict[Tuple[int, int, bool, bool], _core.Call] = {}
_MAX_BASES = 64


def base_call(code: int, group: int, integer_qk: object, integer_pv: object) -> _core.Call:
    """The base prepared call (``sdpa._core.Call``) of a cache format (``code``
    the core's code of its quantized storage, 0 for float keys and values),
    kept by its key; the integer switches are checked by the Call."""
    if type(integer_qk) is not bool or type(integer_pv) is not bool:
        return _core.Call(kv_dtype=code or None, group_size=group, integer_qk=integer_qk, integer_pv=integer_pv)
    key = (code, group, integer_qk, integer_pv)
    base = _BASES.get(key)
    if base is None:
        base = _core.Call(kv_dtype=code or None, group_size=group, integer_qk=integer_qk, integer_pv=integer_pv)
        if len(_BASES) >= _MAX_BASES:
            _BASES.clear()
        _BASES[key] = base
    return base
