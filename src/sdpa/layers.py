"""Attention layers built on :func:`sdpa.scaled_dot_product_attention`."""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np

from ._api import (
    _is_bfloat16,
    _to_array,
    compute_dtype,
    count,
    float_dtype,
    result_dtype,
    scaled_dot_product_attention,
)
from ._checks import flag
from .kvcache import KVCache, cache_dtype

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention:
    """The attention layer of a Transformer, with grouped-query attention.

    For an input ``x`` of shape (batch, T, embed_dim)::

        q = x @ w_q + b_q    -> (batch, num_heads,    T, head_dim)
        k = x @ w_k + b_k    -> (batch, num_kv_heads, T, head_dim)
        v = x @ w_v + b_v    -> (batch, num_kv_heads, T, head_dim)
        o = attention(q, k, v)                  # query head h uses kv head h // group
        y = o @ w_o + b_o    <- o as (batch, T, num_heads * head_dim)

    ``num_kv_heads == num_heads`` is classic multi-head attention, fewer key/value
    heads (a divisor of ``num_heads``) grouped-query attention, and one key/value
    head multi-query attention.

    Parameters
    ----------
    embed_dim : int
        Features of the input and of the output.
    num_heads : int
        Query heads (Hq).
    num_kv_heads : int, optional
        Key/value heads (Hkv), a divisor of ``num_heads``; defaults to ``num_heads``.
    head_dim : int, optional
        Features per head (D); defaults to ``embed_dim // num_heads``, which then
        must divide evenly.
    bias : bool, default True
        Give every projection a bias.
    dtype : numpy dtype, default float32
        dtype of the weights, of the activations between them and of the
        attention: float32, float64, float16 or ``ml_dtypes.bfloat16``.  With a
        16-bit dtype the attention and its cache are 16-bit end to end; the
        projections multiply in float32 (NumPy has no fast 16-bit matmul) and
        round their results to the layer's dtype.
    rng : numpy.random.Generator or int, optional
        Source (or seed) of the random initial weights; seed 0 when not given, so
        that two layers built alike are equal.
    window : int, optional
        Sliding-window attention (Mistral, Gemma 2/3, gpt-oss): each position
        sees itself and the ``window - 1`` positions before it (and, with
        ``causal=False``, as many after it).  Its caches (:meth:`new_cache`)
        roll, so decoding holds at most about ``window`` positions.
    sinks : array_like, shape (num_heads,), optional
        Attention-sink logits, one per query head (gpt-oss): each joins its
        head's softmax denominator and adds no value (see
        :func:`sdpa.scaled_dot_product_attention`).  Kept in :attr:`sinks`.
    kv_cache_dtype : numpy dtype or str, optional
        The storage dtype of the caches :meth:`new_cache` makes (see
        :class:`KVCache`); the layer's dtype by default.  ``"int8"`` quantizes
        the cached keys and values: a quarter of the float32 memory and of the
        bytes each decoding step reads, at about 1e-3 of accuracy;
        ``"float8_e4m3fn"``, ``"float8_e5m2"`` and ``"int4"`` (an eighth) too.
    integer_qk : bool, default False
        Decode over an int8 or int4 cache with integer Q.K (see
        :meth:`KVCache.attend`); a float cache then raises.
    integer_pv : bool, default False
        The same for the weighted sum of the values (integer P.V).

    Attributes
    ----------
    w_q : (embed_dim, num_heads * head_dim)
    w_k, w_v : (embed_dim, num_kv_heads * head_dim)
    w_o : (num_heads * head_dim, embed_dim)
    b_q : (num_heads * head_dim,) or None
    b_k, b_v : (num_kv_heads * head_dim,) or None
    b_o : (embed_dim,) or None
        NumPy arrays of ``dtype``; they may be replaced by arrays of the same shape.
    window : int or None
    sinks : (num_heads,) or None
        float64 for a float64 layer, else float32.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import MultiHeadAttention
    >>> layer = MultiHeadAttention(64, num_heads=8, num_kv_heads=2)
    >>> x = np.random.default_rng(0).standard_normal((1, 10, 64)).astype(np.float32)
    >>> full = layer(x)                         # causal self-attention over 10 tokens
    >>> cache = layer.new_cache(batch=1, capacity=16)
    >>> steps = [layer(x[:, :6], cache)] + [layer(x[:, t:t + 1], cache) for t in range(6, 10)]
    >>> bool(np.allclose(np.concatenate(steps, axis=1), full, atol=1e-5))
    True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        bias: bool = True,
        dtype: Any = np.float32,
        rng: Union[np.random.Generator, int, None] = None,
        *,
        window: Optional[int] = None,
        sinks: Any = None,
        kv_cache_dtype: Any = None,
        integer_qk: bool = False,
        integer_pv: bool = False,
    ) -> None:
        self._configure(embed_dim, num_heads, num_kv_heads, head_dim, dtype, window, sinks)
        self.integer_qk = flag(integer_qk, "integer_qk")
        self.integer_pv = flag(integer_pv, "integer_pv")
        if kv_cache_dtype is not None:  # checked now, not at the first new_cache
            cache_dtype(kv_cache_dtype, "kv_cache_dtype")
        self.kv_cache_dtype: Any = kv_cache_dtype
        if not isinstance(rng, np.random.Generator):
            rng = np.random.default_rng(0 if rng is None else rng)
        embed_dim, num_heads, num_kv_heads = self.embed_dim, self.num_heads, self.num_kv_heads
        head_dim, dtype = self.head_dim, self.dtype

        def weight(fan_in: int, fan_out: int) -> np.ndarray:
            return (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(dtype)

        def bias_of(fan_in: int, fan_out: int) -> Optional[np.ndarray]:
            if not bias:
                return None
            bound = 1.0 / math.sqrt(fan_in)
            return rng.uniform(-bound, bound, fan_out).astype(dtype)

        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        self.w_q = weight(embed_dim, q_dim)
        self.w_k = weight(embed_dim, kv_dim)
        self.w_v = weight(embed_dim, kv_dim)
        self.w_o = weight(q_dim, embed_dim)
        self.b_q = bias_of(embed_dim, q_dim)
        self.b_k = bias_of(embed_dim, kv_dim)
        self.b_v = bias_of(embed_dim, kv_dim)
        self.b_o = bias_of(q_dim, embed_dim)

    def _configure(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int],
        head_dim: Optional[int],
        dtype: Any,
        window: Optional[int] = None,
        sinks: Any = None,
    ) -> None:
        """Check and set the sizes, the dtype, the window and the sinks."""
        embed_dim = count(embed_dim, "embed_dim", 1)
        num_heads = count(num_heads, "num_heads", 1)
        num_kv_heads = num_heads if num_kv_heads is None else count(num_kv_heads, "num_kv_heads", 1)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads: must divide num_heads; got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}"
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim: must be a multiple of num_heads when head_dim is not given; "
                    f"got embed_dim={embed_dim}, num_heads={num_heads}"
                )
            head_dim = embed_dim // num_heads
        head_dim = count(head_dim, "head_dim", 1)
        dtype = float_dtype(dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.window: Optional[int] = None if window is None else count(window, "window", 1)
        self.sinks: Optional[np.ndarray] = None
        if sinks is not None:
            a = np.asarray(sinks)
            if not (a.dtype.kind in "iuf" or a.dtype.name == "bfloat16") or a.shape != (num_heads,):
                raise ValueError(
                    f"sinks: expected {num_heads} real numbers (one per query head), got "
                    f"shape {a.shape} of dtype {a.dtype}"
                )
            self.sinks = a.astype(compute_dtype(dtype))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_weights(
        cls,
        w_q: Any,
        w_k: Any,
        w_v: Any,
        w_o: Any,
        b_q: Any = None,
        b_k: Any = None,
        b_v: Any = None,
        b_o: Any = None,
        *,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        dtype: Any = None,
        window: Optional[int] = None,
        sinks: Any = None,
    ) -> "MultiHeadAttention":
        """A layer with the given weights (same layout as the attributes; ``x @ w``),
        and optionally a sliding window and attention sinks (as for the constructor).

        ``dtype`` defaults to the result dtype of the weights (float64 for
        non-float weights).  The arrays are copied.
        """
        arrays = [np.asarray(a) for a in (w_q, w_k, w_v, w_o)]
        biases = [None if b is None else np.asarray(b) for b in (b_q, b_k, b_v, b_o)]
        if dtype is None:
            dtype = np.result_type(*arrays, *(b for b in biases if b is not None))
            if dtype.kind != "f" and dtype.name != "bfloat16":
                dtype = np.float64
        wq, wk, wv, wo = arrays
        for a, name in zip(arrays, ("w_q", "w_k", "w_v", "w_o")):
            if a.ndim != 2:
                raise ValueError(f"{name}: expected a 2-D weight (in, out), got shape {a.shape}")
        num_heads = count(num_heads, "num_heads", 1)
        num_kv_heads = num_heads if num_kv_heads is None else count(num_kv_heads, "num_kv_heads", 1)
        embed_dim = wq.shape[0]
        if wq.shape[1] % num_heads:
            raise ValueError(
                f"w_q: its {wq.shape[1]} output features do not split into num_heads={num_heads} "
                f"heads; got shape {wq.shape}"
            )
        head_dim = wq.shape[1] // num_heads
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        expected = {
            "w_q": (embed_dim, q_dim),
            "w_k": (embed_dim, kv_dim),
            "w_v": (embed_dim, kv_dim),
            "w_o": (q_dim, embed_dim),
        }
        for a, name in zip(arrays, expected):
            if a.shape != expected[name]:
                raise ValueError(
                    f"{name}: expected shape {expected[name]} for embed_dim={embed_dim}, "
                    f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}; "
                    f"got {a.shape}"
                )
        for b, name, n in zip(biases, ("b_q", "b_k", "b_v", "b_o"), (q_dim, kv_dim, kv_dim, embed_dim)):
            if b is not None and b.shape != (n,):
                raise ValueError(f"{name}: expected shape {(n,)}, got {b.shape}")

        layer = cls.__new__(cls)
        layer._configure(embed_dim, num_heads, num_kv_heads, head_dim, dtype, window, sinks)
        layer.w_q, layer.w_k, layer.w_v, layer.w_o = (np.array(a, dtype=layer.dtype) for a in arrays)
        layer.b_q, layer.b_k, layer.b_v, layer.b_o = (
            None if b is None else np.array(b, dtype=layer.dtype) for b in biases
        )
        return layer

    @classmethod
    def from_torch(cls, module: Any, dtype: Any = None) -> "MultiHeadAttention":
        """A layer with the weights of a ``torch.nn.MultiheadAttention``
        (also :func:`sdpa.torch.layer_from_module`).

        ``layer(x, causal=False)`` with ``x`` of shape (batch, T, embed_dim) then
        equals ``module(x, x, x, need_weights=False)[0]`` (for a module with
        ``batch_first=False``, transpose its (T, batch, embed_dim) input and
        output).  The module must have ``kdim == vdim == embed_dim`` and neither
        ``add_bias_kv`` nor ``add_zero_attn``.  Dropout is not applied (as in
        ``module.eval()``).  ``dtype`` defaults to that of the module's weights
        (bfloat16 modules give ``ml_dtypes.bfloat16`` layers).  torch is not
        imported: the weights are read through their ``__array__``."""

        def weight(t: Any) -> np.ndarray:
            # the tensor's memory, detached and on the CPU; bfloat16 as ml_dtypes' bfloat16
            return np.asarray(_to_array(t.detach().cpu(), "module"))

        def to_numpy(t: Any) -> Optional[np.ndarray]:
            return None if t is None else weight(t)

        embed_dim = int(module.embed_dim)
        kdim, vdim = int(module.kdim), int(module.vdim)
        if not (kdim == vdim == embed_dim):
            raise ValueError(
                f"from_torch: needs kdim == vdim == embed_dim; got embed_dim={embed_dim}, "
                f"kdim={kdim}, vdim={vdim}"
            )
        if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
            raise ValueError("from_torch: modules with add_bias_kv=True are not supported")
        if getattr(module, "add_zero_attn", False):
            raise ValueError("from_torch: modules with add_zero_attn=True are not supported")

        if getattr(module, "in_proj_weight", None) is not None:
            w = weight(module.in_proj_weight)  # (3 E, E), torch's (out, in)
            wq, wk, wv = w[:embed_dim], w[embed_dim : 2 * embed_dim], w[2 * embed_dim :]
        else:
            wq, wk, wv = (weight(getattr(module, f"{n}_proj_weight")) for n in "qkv")
        b = to_numpy(getattr(module, "in_proj_bias", None))
        bq, bk, bv = (None, None, None) if b is None else (
            b[:embed_dim], b[embed_dim : 2 * embed_dim], b[2 * embed_dim :]
        )
        wo = weight(module.out_proj.weight)
        bo = to_numpy(module.out_proj.bias)
        if dtype is None:
            dtype = wq.dtype if wq.dtype.kind == "f" or _is_bfloat16(wq.dtype) else np.float32
        return cls.from_weights(
            wq.T, wk.T, wv.T, wo.T, bq, bk, bv, bo,
            num_heads=int(module.num_heads), dtype=dtype,
        )

    # ------------------------------------------------------------------ use

    def new_cache(self, batch: int, capacity: int, grow: bool = False, dtype: Any = None) -> KVCache:
        """An empty :class:`KVCache` for this layer: (batch, num_kv_heads, capacity,
        head_dim), of ``dtype`` if given (``"int8"`` included), else the layer's
        ``kv_cache_dtype``, else the layer's dtype; rolling with the layer's
        window, if it has one."""
        if dtype is None:
            dtype = self.dtype if getattr(self, "kv_cache_dtype", None) is None else self.kv_cache_dtype
        return KVCache(
            batch,
            self.num_kv_heads,
            capacity,
            self.head_dim,
            dtype=dtype,
            grow=grow,
            window=self.window,
        )

    def _matmul(self, x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        """x @ w + b in the compute type (NumPy has no fast 16-bit matmul),
        returned in the layer's dtype."""
        y = np.matmul(x, w, dtype=compute_dtype(self.dtype))
        if b is not None:
            y += b
        return y.astype(self.dtype, copy=False)

    def _project(self, x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray], heads: int) -> np.ndarray:
        """(batch, T, embed_dim) -> (batch, heads, T, D), a transposed view."""
        y = self._matmul(x, w, b)
        B, T, _ = y.shape
        return y.reshape(B, T, heads, -1).transpose(0, 2, 1, 3)

    def __call__(
        self,
        x: Any,
        cache: Optional[KVCache] = None,
        causal: bool = True,
        num_threads: Optional[int] = None,
    ) -> np.ndarray:
        """Apply the layer.

        Parameters
        ----------
        x : array_like, shape (batch, T, embed_dim) or (T, embed_dim)
            Converted to the layer's dtype.
        cache : KVCache, optional
            Without one, self-attention over the T positions of ``x`` (causal
            with ``tril(ones(T, T))`` when ``causal``).  With one, the keys and
            values of ``x`` are appended to it, and the T new positions attend to
            every cached position, causally aligned to the end
            (``tril(ones(T, S), S - T)`` for S cached positions): a prefill of
            the first tokens followed by steps of one token gives what one call
            over the whole sequence gives.
        causal : bool, default True
            Mask the positions after each query's own.
        num_threads : int, optional
            Threads for the attention (see :func:`sdpa.scaled_dot_product_attention`).

        Returns
        -------
        numpy.ndarray of the layer's dtype, the shape of ``x``.
        """
        x = np.asarray(x)
        if x.ndim not in (2, 3) or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x: expected shape (batch, T, {self.embed_dim}) or (T, {self.embed_dim}), "
                f"got {x.shape}"
            )
        squeeze = x.ndim == 2
        if squeeze:
            x = x[None]
        x = x.astype(self.dtype, copy=False)
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim

        q = self._project(x, self.w_q, self.b_q, Hq)
        k = self._project(x, self.w_k, self.b_k, Hkv)
        v = self._project(x, self.w_v, self.b_v, Hkv)
        window = None if self.window is None else (self.window - 1, 0 if causal else self.window - 1)
        # The output is written straight into (batch, T, heads, D) memory, so the
        # heads are concatenated for the output projection without a copy.
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache: expected a KVCache, got {type(cache).__name__}")
            cache.check_fits(B, Hkv, D)
            if cache.window is not None and (self.window is None or cache.window < self.window):
                # it drops positions this layer's queries still see: wrong results, silently
                raise ValueError(
                    f"cache: rolls with window={cache.window}, which drops positions this layer "
                    f"(window={self.window}) attends to; use a cache from new_cache(), or one whose "
                    "window is at least the layer's"
                )
            cache._append(k, v)
            merged = np.empty((B, T, Hq, D), dtype=cache.result_dtype(q.dtype))
            cache.attend(
                q,
                is_causal="bottom_right" if causal else False,
                out=merged.transpose(0, 2, 1, 3),
                num_threads=num_threads,
                window=window,
                sinks=self.sinks,
                integer_qk=getattr(self, "integer_qk", False),
                integer_pv=getattr(self, "integer_pv", False),
            )
        else:
            merged = np.empty((B, T, Hq, D), dtype=result_dtype(q.dtype, k.dtype, v.dtype))
            scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=bool(causal),
                enable_gqa=Hkv != Hq,
                out=merged.transpose(0, 2, 1, 3),
                num_threads=num_threads,
                window=window,
                sinks=self.sinks,
            )
        y = self._matmul(merged.reshape(B, T, Hq * D).astype(self.dtype, copy=False), self.w_o, self.b_o)
        return y[0] if squeeze else y

    def __repr__(self) -> str:
        return (
            f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"bias={self.b_q is not None}, dtype={self.dtype}"
            + (f", window={self.window}" if self.window is not None else "")
            + (", sinks=..." if self.sinks is not None else "")
            + ")"
        )
