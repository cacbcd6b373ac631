"""sdpa as an attention implementation of Hugging Face transformers.

    >>> import torch, transformers, sdpa.transformers
    >>> name = sdpa.transformers.register()               # "cpu_attention"
    >>> model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    >>> with torch.inference_mode():
    ...     ids = model.generate(**inputs)

:func:`register` adds :func:`attention_forward` to transformers' attention
registry (``transformers.AttentionInterface``) under a name, and transformers'
boolean mask function (the one its own ``"sdpa"`` implementation uses) to the
mask registry (``transformers.masking_utils.AttentionMaskInterface``) under the
same name.  A model built or loaded with ``attn_implementation=name`` (or switched
with ``model.set_attn_implementation(name)``) then runs every attention call of
every layer on sdpa's C core, in the model's dtype (float32, bfloat16, float16 or
float64), on the tensors' memory.

The default name is ``"cpu_attention"``.  transformers gives names containing
``"sdpa"`` the checks of its own torch-SDPA backend, which refuse models such as
Gemma 2 and gpt-oss (torch's SDPA has no softcap and no sinks), and names
containing ``"flash"`` or ``"flex"`` those of its other backends, so
:func:`register` refuses such names.

What a model's attention call becomes:

- ``scaling`` is sdpa's ``scale``; ``softcap`` (Gemma 2) its ``softcap``;
  ``s_aux`` (gpt-oss's per-head sink logits) its ``sinks``; ``sliding_window``
  (Mistral, Gemma 2, gpt-oss) its ``window=(sliding_window - 1, 0)``; key and
  value with fewer heads than the query (grouped-query attention) go in as they
  are, with ``enable_gqa``; T5's ``position_bias`` is the float ``attn_mask``.
- The mask: transformers builds a boolean mask ``(batch, 1, L, S)`` (or none
  where a plain causal or full mask will do).  It is taken apart into a causal
  alignment (``is_causal`` "top_left" or "bottom_right", or none), a window, and a
  padding of the keys: a right padding becomes ``key_lengths``, any other (a left
  padding) a ``(batch, 1, 1, S)`` key mask, and keys that no row sees at the end
  (a static cache's empty slots) are not read at all.  The decomposition is
  checked to give the model's mask exactly, once per mask (every layer sharing the
  mask reuses it); a mask of any other form is passed to sdpa as it is.
- The result is written straight into a new ``(batch, L, heads, Ev)`` tensor, the
  layout transformers' attention functions return; the attention weights are
  returned (float32 weights in the query's dtype) when the model asks for them
  with ``output_attentions=True``, else None.

Training: with grad mode on and an input that requires grad (a model being
fine-tuned), or a dropout probability > 0 (a model in training mode), the call
goes through ``torch.ops.sdpa.attention_fwd``, whose backward is
:func:`sdpa.attention_backward` (the model's mask is then passed as it is,
``s_aux`` gets its gradient, and the dropout mask is drawn from a seed taken
from torch's default generator, so ``torch.manual_seed`` makes a step
reproducible).

Limits: CPU tensors; eager execution only (not under ``torch.compile``).  A query row that
sees no key (a padding position of a left-padded batch) gives zeros, as
transformers' ``"sdpa"`` does; ``"eager"`` gives an average of the values there.
Those rows never reach the tokens that are not padding.

Importing this module imports torch; transformers is imported by
:func:`register`.  ``import sdpa`` imports neither.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ._api import scaled_dot_product_attention as _attention
from ._tensors import DTYPES, as_numpy, as_tensor, check_on_cpu

__all__ = ["DEFAULT_NAME", "register", "attention_forward"]

#: The name :func:`register` uses by default.
DEFAULT_NAME = "cpu_attention"

# substrings that make transformers treat a name as one of its own backends
_RESERVED = ("sdpa", "flash", "flex", "paged|", "/", ":")


def register(name: str = DEFAULT_NAME) -> str:
    """Register sdpa with transformers under ``name``; returns ``name``.

    After it, ``attn_implementation=name`` (in ``from_pretrained``,
    ``from_config``, a config, or ``model.set_attn_implementation``) runs the
    model's attention on sdpa.  Registering again under the same name is
    harmless.

    Parameters
    ----------
    name : str
        The implementation's name, ``"cpu_attention"`` by default.  It must not
        contain ``"sdpa"``, ``"flash"``, ``"flex"``, ``"paged|"``, ``"/"`` or
        ``":"`` (transformers reads those as its own backends or Hub kernels), and
        must not be a name transformers or another library already uses.

    Raises
    ------
    ImportError
        transformers is not installed.
    ValueError
        The name is reserved or taken.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    lowered = name.lower()
    for part in _RESERVED:
        if part in lowered:
            raise ValueError(
                f"name: {name!r} contains {part!r}, which transformers reads as one of its own attention "
                f"backends (and checks or refuses models on that ground); choose another, such as {DEFAULT_NAME!r}"
            )
    if lowered == "eager":
        raise ValueError("name: 'eager' is transformers' own implementation; choose another name")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError(f"sdpa.transformers.register needs transformers (pip install transformers): {exc}") from exc
    # both registries are checked before either is written
    taken = AttentionInterface._global_mapping.get(name)
    if taken is not None and taken is not attention_forward:
        raise ValueError(f"name: {name!r} already names another attention implementation in transformers")
    taken_mask = AttentionMaskInterface._global_mapping.get(name)
    if taken_mask is not None and taken_mask is not sdpa_mask:
        raise ValueError(
            f"name: {name!r} already names another attention mask function in transformers "
            f"(AttentionMaskInterface)"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# ------------------------------------------------------------------ tensors

def _numpy(t: Tensor, name: str) -> Any:
    """The tensor's memory as a NumPy array, no copy (bfloat16 as ml_dtypes'):
    :func:`sdpa._tensors.as_numpy`, its errors naming ``name``."""
    try:
        return as_numpy(t)
    except (RuntimeError, TypeError) as exc:
        raise TypeError(f"{name}: sdpa cannot read this tensor ({exc})") from None


# ------------------------------------------------------------------ masks


class _Layout(NamedTuple):
    """A boolean mask (batch, 1, L, S) taken apart: ``keys`` leading keys take
    part (the rest are masked for every row); within them, the causal alignment,
    window and key padding (``key_lengths`` for a right padding, else
    ``key_mask``) give the mask exactly."""

    keys: int
    is_causal: Union[bool, str]
    window: Optional[Tuple[int, int]]
    key_lengths: Optional[np.ndarray]
    key_mask: Optional[Tensor]


def _band(L: int, S: int, is_causal: Union[bool, str], window: Optional[Tuple[int, int]]) -> Tensor:
    """(L, S) bool: key s visible to row l under ``is_causal`` and ``window``, as
    sdpa defines them (built from two index vectors, no (L, S) integers)."""
    diagonal = torch.arange(L).unsqueeze(1) + (0 if is_causal in (True, "top_left") else S - L)
    s = torch.arange(S).unsqueeze(0)
    visible = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        visible &= s <= diagonal
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= s >= diagonal - left
        if right >= 0:
            visible &= s <= diagonal + right
    return visible


def _take_apart(mask: Tensor, L: int, S: int, causal: bool, window_left: Optional[int]) -> Optional[_Layout]:
    """The :class:`_Layout` of a bool mask, or None when it has no such form.

    Candidates (the model's causality and window first) are checked against the
    mask element by element, so any layout returned reproduces it exactly."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != S or mask.shape[-2] not in (1, L):
        return None
    m = mask[:, 0]  # (batch, L or 1, S)
    seen = m.any(dim=1)  # (batch, S): the keys some row sees
    used = torch.nonzero(seen.any(dim=0))
    if used.numel() == 0:
        return None
    keys = int(used[-1]) + 1
    m, seen = m[..., :keys], seen[:, :keys]
    rows = m.shape[1]

    causal_ones: List[Tuple[Union[bool, str], Optional[Tuple[int, int]]]] = []
    if rows == L:
        alignments = ("bottom_right",) if L == keys else ("bottom_right", "top_left")
        for alignment in alignments:
            if window_left is not None:
                causal_ones.append((alignment, (window_left, 0)))
            causal_ones.append((alignment, None))
    plain: List[Tuple[Union[bool, str], Optional[Tuple[int, int]]]] = [(False, None)]
    candidates = causal_ones + plain if causal else plain + causal_ones

    for is_causal, window in candidates:
        band = _band(rows, keys, is_causal, window) if rows == L else torch.ones(1, keys, dtype=torch.bool)
        # keys the band hides from every row may count as taking part
        padding = seen | ~band.any(dim=0)
        if torch.equal(m, padding.unsqueeze(1) & band):
            break
    else:
        return None

    key_lengths: Optional[np.ndarray] = None
    key_mask: Optional[Tensor] = None
    if not bool(padding.all()):
        counts = padding.sum(dim=1)
        if torch.equal(padding, torch.arange(keys).unsqueeze(0) < counts.unsqueeze(1)):
            key_lengths = counts.numpy().astype(np.int64)
        else:
            key_mask = padding[:, None, None, :].contiguous()
    return _Layout(keys, is_causal, window, key_lengths, key_mask)


_layouts: "OrderedDict[int, Tuple[Any, Optional[int], Tuple[Any, ...], Optional[_Layout]]]" = OrderedDict()
_layouts_lock = threading.Lock()
_LAYOUTS_KEPT = 8


def _layout(mask: Tensor, L: int, S: int, causal: bool, window_left: Optional[int]) -> Optional[_Layout]:
    """:func:`_take_apart`, remembered for the few masks seen last: a model hands
    the same mask tensor to each of its layers.  Another tensor at the same
    address is taken apart anew, and so is one changed in place since, except an
    inference tensor (made under ``torch.inference_mode()``), which keeps no count
    of its changes: a mask must not be changed in place while a model uses it."""
    args = (L, S, causal, window_left)
    try:
        version: Optional[int] = mask._version
    except RuntimeError:  # an inference tensor
        version = None
    with _layouts_lock:
        entry = _layouts.get(id(mask))
        if entry is not None and entry[0]() is mask and entry[1] == version and entry[2] == args:
            _layouts.move_to_end(id(mask))
            return entry[3]
    layout = _take_apart(mask, L, S, causal, window_left)
    with _layouts_lock:
        _layouts[id(mask)] = (weakref.ref(mask), version, args, layout)
        while len(_layouts) > _LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    return layout


# ------------------------------------------------------------------ the attention


def attention_forward(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    position_bias: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tuple[Tensor, Optional[Tensor]]:
    """A transformers attention function computed by sdpa.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer (its ``is_causal`` and ``sliding_window`` are
        read when the call does not give them).
    query : torch.Tensor, (batch, Hq, L, E)
    key : torch.Tensor, (batch, Hkv, S, E)
    value : torch.Tensor, (batch, Hkv, S, Ev)
        CPU tensors of one dtype (float32, bfloat16, float16 or float64); Hq a
        multiple of Hkv.
    attention_mask : torch.Tensor, optional
        bool (True takes part) or float (added), broadcastable to (batch, Hq, L, S),
        as transformers' mask functions build it; None: causal (top-left, for
        L > 1) when the layer is causal, else none.
    dropout : float
        The attention dropout of a model in training mode (0 in eval mode).
    scaling : float, optional
        The scale of the scores; ``1 / sqrt(E)`` when None.
    is_causal : bool, optional
        Defaults to ``module.is_causal`` (True when absent).
    sliding_window : int, optional
        A key is visible to a query when at most ``sliding_window - 1`` positions
        before it; defaults to ``module.sliding_window``.
    softcap : float, optional
        Caps the scaled scores at ``softcap * tanh(x / softcap)``.
    s_aux : torch.Tensor, optional, (Hq,)
        Sink logits joining each row's softmax denominator.
    position_bias : torch.Tensor, optional, broadcastable to (batch, Hq, L, S)
        Added to the scaled scores (T5).
    **kwargs
        ``output_attentions=True`` also returns the weights; others are ignored.

    Returns
    -------
    (torch.Tensor, torch.Tensor or None)
        The output (batch, L, Hq, Ev) of the query's dtype, contiguous, and the
        weights (batch, Hq, L, S) when asked for, else None.

    Raises
    ------
    ValueError
        A tensor is not on the CPU; ``output_attentions`` in a call that
        needs gradients or has dropout.
    TypeError
        Unsupported dtypes.
    """
    named = (("query", query), ("key", key), ("value", value), ("s_aux", s_aux),
             ("position_bias", position_bias), ("attention_mask", attention_mask))
    for name, t in named:
        check_on_cpu(t, name)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: expected float32, float64, bfloat16 or float16, got {t.dtype}")
    L, S = query.shape[-2], key.shape[-2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    window_left = (
        int(sliding_window) - 1
        if isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool) and sliding_window > 0
        else None
    )
    if dropout or (torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for _, t in named)):
        return _training_forward(query, key, value, attention_mask, position_bias, scaling, causal, window_left,
                                 softcap, s_aux, bool(kwargs.get("output_attentions", False)), float(dropout))

    arguments: Dict[str, Any] = {}
    attn_mask: Optional[Tensor] = None
    keys = S
    if attention_mask is None:
        # transformers leaves the mask out where a plain one does: causal for a
        # prompt (top-left, which also hides a static cache's empty slots), none
        # for a single new token (whose window, if any, ends at the last key)
        if causal:
            if L > 1:
                arguments["is_causal"] = True
            if window_left is not None:
                arguments["window"] = (window_left, 0)
    else:
        layout = None
        if attention_mask.dtype == torch.bool:
            layout = _layout(attention_mask, L, S, causal, window_left)
        if layout is None:
            attn_mask = attention_mask
        else:
            keys = layout.keys
            arguments["is_causal"] = layout.is_causal
            if layout.window is not None:
                arguments["window"] = layout.window
            if layout.key_lengths is not None:
                arguments["key_lengths"] = layout.key_lengths
            attn_mask = layout.key_mask

    if position_bias is not None:
        attn_mask = _with_bias(attn_mask, position_bias[..., :keys])
    if keys < S:
        key, value = key[..., :keys, :], value[..., :keys, :]

    if s_aux is not None:
        # float64 for a float64 model; converted to the compute type either way
        arguments["sinks"] = s_aux.detach().to(torch.float64).numpy()
    if softcap is not None:
        arguments["softcap"] = softcap
    heads, kv_heads = query.shape[-3], key.shape[-3]
    want_weights = bool(kwargs.get("output_attentions", False))

    batch = tuple(query.shape[:-3])
    if key.shape[:-3] != batch or value.shape[:-3] != batch:  # (np.broadcast_shapes costs microseconds)
        batch = np.broadcast_shapes(batch, tuple(key.shape[:-3]), tuple(value.shape[:-3]))
    same_dtype = query.dtype == key.dtype == value.dtype
    output = torch.empty(*batch, L, heads, value.shape[-1], dtype=query.dtype) if same_dtype else None
    operands = (
        _numpy(query, "query"),
        _numpy(key, "key"),
        _numpy(value, "value"),
        None if attn_mask is None else _numpy(attn_mask, "attention_mask"),
    )
    arguments["scale"] = scaling
    arguments["enable_gqa"] = heads != kv_heads
    arguments["out"] = None if output is None else _numpy(output, "output").swapaxes(-2, -3)
    weights_array: Optional[np.ndarray] = None
    if want_weights:
        out_array, weights_array = _attention(*operands, return_weights=True, **arguments)
    else:
        out_array = _attention(*operands, **arguments)
    if output is None:
        output = as_tensor(out_array).transpose(-2, -3).contiguous()
    weights: Optional[Tensor] = None
    if weights_array is not None:
        weights = torch.from_numpy(weights_array).to(query.dtype)
        if keys < S:
            weights = torch.nn.functional.pad(weights, (0, S - keys))
    return output, weights


def _with_bias(mask: Optional[Tensor], bias: Tensor) -> Tensor:
    """T5's position bias joined with the mask: the float mask of both (-inf
    where a bool mask hides a key)."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, torch.tensor(float("-inf"), dtype=bias.dtype))
    return bias + mask


def _training_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    position_bias: Optional[Tensor],
    scaling: Optional[float],
    causal: bool,
    window_left: Optional[int],
    softcap: Optional[float],
    s_aux: Optional[Tensor],
    want_weights: bool,
    dropout: float,
) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`attention_forward` of a call autograd records, or with dropout:
    the model's mask as it is, through ``torch.ops.sdpa.attention_fwd``, whose
    backward is sdpa's (the sinks get their gradient); dropout's seed drawn
    from torch's default generator."""
    from .torch import _draw_seed, attention_fwd_op

    if want_weights:
        raise ValueError("output_attentions: sdpa returns no weights from a call that needs gradients "
                         "or drops weights")
    L = query.shape[-2]
    mask = attention_mask if position_bias is None else _with_bias(attention_mask, position_bias)
    is_causal = mask is None and causal and L > 1
    window = [window_left, 0] if mask is None and causal and window_left is not None else None
    out, _ = attention_fwd_op(
        query, key, value, mask, is_causal, scaling, query.shape[-3] != key.shape[-3], window, softcap, None, s_aux,
        dropout, _draw_seed() if dropout else None,
    )
    return out.transpose(-2, -3).contiguous(), None
