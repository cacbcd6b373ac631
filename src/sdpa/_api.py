"""The public attention call and its general path.  The dtype rule lives in
``_dtypes``, the thread settings in ``_threads``, the argument checks in
``_checks``; the names other modules take from here are re-exported.

A call first takes the prepared call of its options (``sdpa._core.Call``,
checked once and kept by their key), which takes NumPy arrays that need no
conversion at C speed and declines anything else with a reason code.  Such
calls come here (:func:`general`): array-likes are read (in place where
possible), dtypes converted by the documented rule, every array checked with a
message naming it, and the converted arrays handed to the same prepared call
again (:func:`call_core`).
"""
from __future__ import annotations

import math
from typing import (
    Any,
    Dict,
    List,
    Literal,
    Optional,
    Tuple,
    Union,
    cast,
    overload,
)

import numpy as np

from . import _core
from ._checks import (
    _WINDOW_MAX as _WINDOW_MAX,
    MAX_BATCH_DIMS as MAX_BATCH_DIMS,
    ShapePlan as ShapePlan,
    _broadcast as _broadcast,
    _causal_offset as _causal_offset,
    _no_internal_overlap as _no_internal_overlap,
    _overlaps as _overlaps,
    _physical_memory_bytes as _physical_memory_bytes,
    count as count,
    declined as declined,
    dropout_args as dropout_args,
    head_values as head_values,
    key_lengths_checked as key_lengths_checked,
    key_score_rows as key_score_rows,
    mask_checked as mask_checked,
    output_array as output_array,
    plan_shapes as plan_shapes,
    scale_of as scale_of,
    softcap_value as softcap_value,
    window_sides as window_sides,
)
from ._dtypes import (
    _FLOAT32 as _FLOAT32,
    _FLOAT64 as _FLOAT64,
    Array as Array,
    ArrayInput as ArrayInput,
    AttentionResult as AttentionResult,
    FloatArray as FloatArray,
    SupportsDLPack as SupportsDLPack,
    _as_operand as _as_operand,
    _check_real as _check_real,
    _is_bfloat16 as _is_bfloat16,
    _single_or_half as _single_or_half,
    _to_array as _to_array,
    compute_dtype as compute_dtype,
    float_dtype as float_dtype,
    operand_dtypes as operand_dtypes,
    quantized_query_dtype as quantized_query_dtype,
    result_dtype as result_dtype,
    width_of as width_of,
)
from ._threads import (
    _MAX_THREADS as _MAX_THREADS,
    get_num_threads as get_num_threads,
    set_num_threads as set_num_threads,
    thread_count as thread_count,
)
from .blockmask import BlockMask


@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    return_key_scores: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
    block_mask: Optional[BlockMask] = ...,
    key_scores_window: Optional[int] = ...,
    dropout_p: float = ...,
    seed: Optional[int] = ...,
) -> FloatArray: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[True],
    return_lse: Literal[True],
    return_key_scores: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
    block_mask: Optional[BlockMask] = ...,
    key_scores_window: Optional[int] = ...,
    dropout_p: float = ...,
    seed: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    return_key_scores: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
    block_mask: Optional[BlockMask] = ...,
    key_scores_window: Optional[int] = ...,
    dropout_p: float = ...,
    seed: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    return_key_scores: Literal[False] = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
    block_mask: Optional[BlockMask] = ...,
    key_scores_window: Optional[int] = ...,
    dropout_p: float = ...,
    seed: Optional[int] = ...,
) -> Tuple[FloatArray, FloatArray]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = ...,
    is_causal: Union[bool, str] = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    return_weights: bool = ...,
    return_lse: bool = ...,
    return_key_scores: bool = ...,
    key_lengths: Optional[ArrayInput] = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayInput] = ...,
    sinks: Optional[ArrayInput] = ...,
    out: Optional[Array] = ...,
    num_threads: Optional[int] = ...,
    block_mask: Optional[BlockMask] = ...,
    key_scores_window: Optional[int] = ...,
    dropout_p: float = ...,
    seed: Optional[int] = ...,
) -> AttentionResult: ...
def scaled_dot_product_attention(
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    attn_mask: Optional[ArrayInput] = None,
    is_causal: Union[bool, str] = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    return_key_scores: bool = False,
    key_lengths: Optional[ArrayInput] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    out: Optional[Array] = None,
    num_threads: Optional[int] = None,
    block_mask: Optional[BlockMask] = None,
    key_scores_window: Optional[int] = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
) -> AttentionResult:
    """Scaled dot-product attention: ``softmax(scale * Q Kᵀ + mask) V``.

    The semantics are those of ``torch.nn.functional.scaled_dot_product_attention``.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, E)
    key : array_like, shape (..., Hkv, S, E)
    value : array_like, shape (..., Hkv, S, Ev)
        Every input has 2 or more dims.  Dim -3 is the head dim; the dims before it
        are batch dims, which broadcast against each other.  float32 and float64
        are used as they are; float16 is computed as float32; bool and integers as
        float64.  Mixed float32/float64 inputs are computed as float64.
    attn_mask : array_like, optional, broadcastable to (..., Hq, L, S)
        bool: True means the key takes part in attention.  float: added to the
        scaled scores (use -inf to mask).
    is_causal : bool or str, default False
        True (or ``"top_left"``) masks key ``s`` for query row ``l`` when ``s > l``,
        i.e. ``tril(ones(L, S))``; ``"bottom_right"`` uses ``tril(ones(L, S), S - L)``,
        where the last query row sees every key.  Combined with ``attn_mask`` if both
        are given.
    scale : float, optional
        Multiplies ``Q Kᵀ``; defaults to ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: Hq must be a multiple of Hkv, and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.  Without it, Hq and Hkv must be
        equal or broadcast (one of them 1).
    return_weights : bool, default False
        Also return the attention weights, shape (..., Hq, L, S).  They are only
        computed when asked for, and need L * S elements per head.
    return_lse : bool, default False
        Also return the natural log-sum-exp of each row's scaled, masked scores,
        shape (..., Hq, L), in the output's dtype (-inf for a row that sees no key).
        With it, results over disjoint chunks of the keys can be combined exactly
        by :func:`merge_attention`.
    key_lengths : array_like of int, optional, broadcastable to the batch dims
        Keys at or past ``key_lengths[b]`` are ignored for batch index ``b`` (the
        dims before the head dim), as for right-padded batches; no mask is built.
    window : (int, int), optional
        Sliding-window (local) attention: key ``s`` is visible to query row ``l``
        only when ``l + o - left <= s <= l + o + right``, with ``o = 0`` when
        ``is_causal`` is True or ``"top_left"`` and ``o = S - L`` otherwise (rows
        aligned to the last keys).  ``-1`` leaves a side unbounded; Mistral's
        window of ``w`` keys is ``window=(w - 1, 0)`` with ``is_causal``.  Key
        blocks outside every row's window are never read, so the cost follows
        the window, not S.
    softcap : float, optional
        Caps the scaled scores: ``x -> softcap * tanh(x / softcap)``, before
        ``attn_mask`` and ALiBi are added (Gemma 2).  Must be finite and > 0.
    alibi_slopes : array_like, shape (Hq,) or (..., Hq), optional
        ALiBi: adds ``-slope * |l + o - s|`` to the score of row ``l`` and key
        ``s`` (``o`` as for ``window``), one slope per query head (broadcasting
        against the batch dims).
    sinks : array_like, shape (Hq,) or (..., Hq), optional
        Attention sinks: a logit per query head that joins every row's softmax
        denominator, neither scaled nor capped, and adds no value:
        ``out = sum_s e^(x_s) v_s / (sum_s e^(x_s) + e^sink)`` (gpt-oss).  The
        weights and the log-sum-exp include it; a row that sees no key still
        gives zeros, and its log-sum-exp is the sink.
    out : numpy.ndarray, optional
        Preallocated output of shape (..., Hq, L, Ev) and the result dtype; any
        strides; must not overlap the inputs.
    num_threads : int, optional
        Threads for this call; ``None`` uses the value set with
        :func:`set_num_threads`, else the OpenMP default (``OMP_NUM_THREADS``, or a
        threadpoolctl limit); :func:`get_num_threads` tells which.  Results are
        bitwise identical for every thread count.
    block_mask : BlockMask, optional
        Block-sparse attention (:class:`sdpa.BlockMask`): only the (query block,
        key block) tiles it lists are read and computed.  In its partial blocks
        ``attn_mask``, ``is_causal`` and ``window`` apply as usual; its full
        blocks skip every element test (computed entirely, even above the causal
        diagonal), but a float ``attn_mask`` is still added there.  A row that
        sees no key gives zeros (lse -inf).  Not with ``return_weights`` or
        ``return_key_scores``.
    return_key_scores : bool, default False
        Also return, last, the attention mass of every key: float32 (..., Hkv, S),
        for each key the sum over the query rows and over the query heads of its
        key/value head's group of the softmax weight it received (H2O's score for
        evicting keys from a cache).  Masked keys score 0; each row counted adds
        1 over the keys, to rounding.  Computed from the probabilities of the
        output, without the weights (..., L, S): the rows counted run on the
        path decoding rows take, which keeps each key's probabilities.
    key_scores_window : int, optional
        With ``return_key_scores``: count only the last ``key_scores_window``
        query rows (SnapKV's observation window); default every row.
    dropout_p : float, default 0.0
        Dropout on the attention weights (training): each weight is kept with
        probability ``1 - dropout_p`` and divided by it, or dropped.  The
        softmax and the lse are those before dropout.  The mask is a function
        of ``seed`` and each weight's (batch, head, row, key) alone (Philox),
        so it is bitwise the same for every thread count and kernel set, and
        :func:`attention_backward` draws it again.  Not with
        ``return_weights``, ``return_key_scores`` or ``block_mask``.
    seed : int, optional
        In [0, 2**64); required when ``dropout_p > 0``.

    Returns
    -------
    output : numpy.ndarray, shape (..., Hq, L, Ev)
        With ``return_weights``, ``return_lse`` and/or ``return_key_scores``, a
        tuple ``(output, weights, lse, key_scores)`` holding those asked for, in
        that order.  A query row that can see
        no key (everything masked, or S == 0) gives zeros.

    Raises
    ------
    ValueError
        Shapes that do not fit together (the message names them), a bad ``out``.
    TypeError
        Unsupported dtypes or argument types.
    MemoryError
        The requested weights cannot fit in memory.
    """
    # the prepared call of these options (kept by their key), then the arrays
    call = _PLAIN.prepared(is_causal, scale, enable_gqa, window, softcap, num_threads, return_weights, return_lse)
    rows = key_score_rows(return_key_scores, key_scores_window)
    dropout = None if dropout_p == 0.0 and seed is None else dropout_args(dropout_p, seed)
    if dropout is not None and (return_weights or return_key_scores or block_mask is not None):
        raise ValueError("dropout_p: not with return_weights, return_key_scores or block_mask")
    if block_mask is not None:  # checked against the call's lengths on the general path
        return general(
            call, query, key, value, attn_mask=attn_mask, key_lengths=key_lengths, alibi_slopes=alibi_slopes,
            sinks=sinks, out=out, block_mask=block_mask, key_scores=rows,
        )
    result = call.run(query, key, value, attn_mask, key_lengths, alibi_slopes, sinks, out, key_scores=rows,
                      dropout=dropout)
    if not isinstance(result, int):
        return result
    # declined (not in the core's own form): convert, check, explain
    return general(
        call, query, key, value, attn_mask=attn_mask, key_lengths=key_lengths, alibi_slopes=alibi_slopes,
        sinks=sinks, out=out, key_scores=rows, dropout=dropout,
    )


# the base of the public function's prepared calls: float keys and values
_PLAIN = _core.plain()


def call_core(
    call: _core.Call,
    query: Array,
    key: Array,
    value: Array,
    *,
    attn_mask: Optional[Array] = None,
    key_lengths: Optional[Array] = None,
    alibi_slopes: Optional[Array] = None,
    sinks: Optional[Array] = None,
    out: Optional[Array] = None,
    key_scale: Optional[Array] = None,
    value_scale: Optional[Array] = None,
    blocks: Optional[Tuple[Array, int, int]] = None,
    key_scores: Optional[int] = None,
    dropout: Optional[Tuple[float, int]] = None,
) -> AttentionResult:
    """A prepared call on arrays the general path has converted and checked
    (``blocks``: a block map as :meth:`sdpa._core.Call.run` takes it).
    An ``out`` whose span meets an input's without sharing an element with it
    (the core's test is by span, the general path's exact) gets the result by
    a copy; any other decline is a ValueError naming the argument."""
    extras = (alibi_slopes, sinks, key_lengths)
    result = call.run_cache(query, key, value, key_scale, value_scale, attn_mask, out, extras, blocks=blocks,
                            key_scores=key_scores, dropout=dropout)
    if not isinstance(result, int):
        return result
    if result == _core.OUT_MAY_OVERLAP and out is not None:
        result = call.run_cache(query, key, value, key_scale, value_scale, attn_mask, None, extras, blocks=blocks,
                                key_scores=key_scores, dropout=dropout)
        if not isinstance(result, int):
            if isinstance(result, tuple):
                np.copyto(out, result[0])
                return (cast(FloatArray, out), *result[1:])
            np.copyto(out, result)
            return cast(FloatArray, out)
    raise declined(result)


def prepare(kw: Dict[str, Any]) -> Tuple[_core.Call, Dict[str, Any]]:
    """Keywords (``scaled_dot_product_attention``'s, then a quantized cache's
    ``key_scale``, ``value_scale``, ``group_size`` and ``kv_dtype``, and
    ``diagonal``, ``integer_qk``, ``integer_pv``) split into a
    :class:`sdpa._core.Call` of the options and the arrays, by name.
    ``kv_dtype`` None names int8 storage when there are scales, float keys and
    values when not."""
    arrays = {n: kw[n] for n in _ARRAYS if n in kw}
    constants = {n: x for n, x in kw.items() if n not in arrays}
    if constants.get("kv_dtype") is None and (arrays.get("key_scale") is not None
                                              or arrays.get("value_scale") is not None):
        constants["kv_dtype"] = _core.QUANTIZED["int8"]
    return _core.Call(**constants), arrays


_ARRAYS = ("attn_mask", "key_lengths", "alibi_slopes", "sinks", "out", "key_scale", "value_scale")


def run(call: _core.Call, query: Any, key: Any, value: Any, arrays: Dict[str, Any]) -> Union[int, AttentionResult]:
    """``call`` on the arrays as they are: the result, or the reason code of
    the core's decline."""
    a = arrays.get
    extras = (a("alibi_slopes"), a("sinks"), a("key_lengths"))
    return call.run_cache(query, key, value, a("key_scale"), a("value_scale"), a("attn_mask"), a("out"), extras)


def core_attention(query: Any, key: Any, value: Any, **kw: Any) -> Union[int, AttentionResult]:
    """One call by keyword (:func:`prepare`) on the arrays as they are: the
    result, or the reason code of the core's decline.  The options are
    checked (a TypeError or ValueError naming one)."""
    call, arrays = prepare(kw)
    return run(call, query, key, value, arrays)


def attend(query: ArrayInput, key: ArrayInput, value: ArrayInput, **kw: Any) -> AttentionResult:
    """One call by keyword (:func:`prepare`): the core as the arrays are, else
    the general path.  For sdpa.dask and the tests, whose fixed cost does not
    matter; the hot callers keep a prepared call."""
    call, arrays = prepare(kw)
    result = run(call, query, key, value, arrays)
    if not isinstance(result, int):
        return result
    return general(call, query, key, value, **arrays)


def _attention_general(query: ArrayInput, key: ArrayInput, value: ArrayInput, **kw: Any) -> AttentionResult:
    """:func:`general` by keyword (:func:`prepare`)."""
    call, arrays = prepare(kw)
    return general(call, query, key, value, **arrays)


def general(
    call: _core.Call,
    query: ArrayInput,
    key: ArrayInput,
    value: ArrayInput,
    *,
    attn_mask: Optional[ArrayInput] = None,
    key_lengths: Optional[ArrayInput] = None,
    alibi_slopes: Optional[ArrayInput] = None,
    sinks: Optional[ArrayInput] = None,
    out: Optional[Array] = None,
    key_scale: Optional[Array] = None,
    value_scale: Optional[Array] = None,
    block_mask: Optional[BlockMask] = None,
    key_scores: Optional[int] = None,
    dropout: Optional[Tuple[float, int]] = None,
) -> AttentionResult:
    """A prepared call for any arrays: converts what it can, raises with a
    message naming the argument for what it cannot, and calls the core once.
    With a quantized ``call`` (``call.kv_dtype``), key and value are the
    storage of a :class:`KVCache` (uint8 but for int8; int4 holds two values
    a byte) and ``key_scale``, ``value_scale`` its scales, checked by it, and
    the query is computed in float32 (kept if 16-bit)."""
    code = call.kv_dtype  # the quantized storage's code
    quantized = code is not None
    q = _to_array(query, "query")
    k = _to_array(key, "key")
    v = _to_array(value, "value")
    given = [(q, "query"), (k, "key"), (v, "value")]  # the caller's memory, before any conversion
    for a, name in given:
        _check_real(a, name)
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, features), got shape {a.shape}")
    if quantized:
        dtype = quantized_query_dtype(q.dtype)
    else:
        dtype, kv_float = operand_dtypes(q.dtype, k.dtype, v.dtype)  # dtype: the query's and the output's
        k, v = (_as_operand(a, kv_float) for a in (k, v))
    cdtype = compute_dtype(dtype)  # of weights, lse and a float mask
    q = _as_operand(q, dtype)

    # an int4 cache's columns hold two values each
    width = width_of(code)
    k_shape, v_shape = k.shape[:-1] + (k.shape[-1] * width,), v.shape[:-1] + (v.shape[-1] * width,)
    plan = plan_shapes(q.shape, k_shape, v_shape, call.enable_gqa)
    S = plan.S
    batch_shape = plan.batch_shape
    out_shape, weights_shape = plan.out_shape, plan.weights_shape
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
    blocks = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                f"block_mask: expected an sdpa.BlockMask, got {type(block_mask).__name__} (a torch BlockMask "
                f"goes through sdpa.torch.flex_attention)"
            )
        if call.return_weights:
            raise ValueError("block_mask: not with return_weights (the weights of skipped blocks are not computed)")
        if key_scores is not None:
            raise ValueError("block_mask: not with return_key_scores")
        blocks = block_mask.blocks_for(plan.L, S)
        states = blocks[0]
        if states.ndim > 2 and states.shape[-3] not in (1, plan.heads):
            raise ValueError(f"block_mask: {states.shape[-3]} heads, the call has {plan.heads} query heads")
        try:
            np.broadcast_shapes(states.shape[:-3], batch_shape)
        except ValueError:
            raise ValueError(
                f"block_mask: batch dims {states.shape[:-3]} do not broadcast with {batch_shape}"
            ) from None

    # mask: bool (True = takes part) or float (added), broadcastable to weights_shape
    m: Optional[Array] = None
    if attn_mask is not None:
        m = _to_array(attn_mask, "attn_mask")
        given.append((m, "attn_mask"))
        mask_checked(m.dtype, m.shape, weights_shape, shapes)
        if m.dtype == np.bool_:
            if not m.flags.aligned:
                m = np.array(m, order="C")
        else:
            _check_real(m, "attn_mask")
            m = _as_operand(m, cdtype)

    lengths: Optional[Array] = None
    if key_lengths is not None:
        kl = _to_array(key_lengths, "key_lengths")
        given.append((kl, "key_lengths"))
        key_lengths_checked(kl, batch_shape, shapes)
        lengths = np.array(np.minimum(kl, S), dtype=np.int64, order="C")  # a new, native, contiguous array

    heads = {
        name: head_values(_remember(values, name, given), name, batch_shape, plan.heads, cdtype)
        for values, name in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks"))
        if values is not None
    }

    # the arrays the core reads, and the caller's own where they were converted
    operands = given + [(q, "query"), (k, "key"), (v, "value"), (m, "attn_mask")]
    operands += [(heads.get(n), n) for n in ("alibi_slopes", "sinks")]
    if key_scale is not None and value_scale is not None:
        operands += [(key_scale, "the key scales"), (value_scale, "the value scales")]
    result = output_array(out, out_shape, dtype, operands, shapes)

    if call.return_weights:
        nbytes = math.prod(weights_shape) * cdtype.itemsize
        total = _physical_memory_bytes()
        if total is not None and nbytes > total:
            raise MemoryError(
                f"return_weights: the weights {weights_shape} need {nbytes / 2**30:.1f} GiB, "
                f"more than this machine's {total / 2**30:.1f} GiB of memory"
            )

    return call_core(
        call, q, k, v, attn_mask=m, key_lengths=lengths, alibi_slopes=heads.get("alibi_slopes"),
        sinks=heads.get("sinks"), out=result, key_scale=key_scale, value_scale=value_scale, blocks=blocks,
        key_scores=key_scores, dropout=dropout,
    )


def _remember(values: object, name: str, given: List[Tuple[Array, str]]) -> Array:
    """``values`` as an array, added to ``given`` (the caller's memory, for
    the overlap check of ``out``)."""
    original = _to_array(values, name)
    given.append((original, name))
    return original
