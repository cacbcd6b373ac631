"""sdpa: fast, fused scaled dot-product attention on CPUs.

    >>> import numpy as np, sdpa
    >>> q = k = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> v = np.array([[2.0, 3.0], [4.0, 5.0]])
    >>> np.round(sdpa.scaled_dot_product_attention(q, k, v), 2)
    array([[2.66, 3.66],
           [3.34, 4.34]])

NumPy arrays in, NumPy arrays out.  The work happens in a C core that never
builds the L x S score matrix (unless the weights are asked for) and runs on
OpenMP threads (see :func:`set_num_threads`).  ``sdpa.reference`` holds a plain
NumPy version for checking; ``sdpa.torch`` (which imports torch) takes and
returns torch tensors.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, overload

# Read by the OpenMP runtime when it loads, so set before _core is imported.
# Worker threads that spin after a call starve the BLAS threads NumPy runs between
# attention calls (a 0.1 ms decode step took 12 ms on 2 cores); unless the user
# chose a policy, idle OpenMP threads sleep.  Prefill speed is unchanged.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import numpy as np

from . import _core, reference
from ._api import ArrayInput, AttentionResult, FloatArray, get_num_threads, set_num_threads
from ._api import attention as _attention
from .kvcache import KVCache, KVCacheFullError
from .layers import MultiHeadAttention
from .merge import merge_attention

__all__ = [
    "scaled_dot_product_attention",
    "merge_attention",
    "KVCache",
    "KVCacheFullError",
    "MultiHeadAttention",
    "set_num_threads",
    "get_num_threads",
    "show_config",
    "config",
    "reference",
    "__version__",
]

__version__ = _core.version()


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
    key_lengths: Optional[ArrayInput] = ...,
    out: Optional[np.ndarray[Any, Any]] = ...,
    num_threads: Optional[int] = ...,
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
    key_lengths: Optional[ArrayInput] = ...,
    out: Optional[np.ndarray[Any, Any]] = ...,
    num_threads: Optional[int] = ...,
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
    key_lengths: Optional[ArrayInput] = ...,
    out: Optional[np.ndarray[Any, Any]] = ...,
    num_threads: Optional[int] = ...,
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
    key_lengths: Optional[ArrayInput] = ...,
    out: Optional[np.ndarray[Any, Any]] = ...,
    num_threads: Optional[int] = ...,
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
    key_lengths: Optional[ArrayInput] = ...,
    out: Optional[np.ndarray[Any, Any]] = ...,
    num_threads: Optional[int] = ...,
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
    key_lengths: Optional[ArrayInput] = None,
    out: Optional[np.ndarray[Any, Any]] = None,
    num_threads: Optional[int] = None,
) -> AttentionResult:
    """Scaled dot-product attention: ``softmax(scale * Q Kᵀ + mask) V``.

    The semantics are those of ``torch.nn.functional.scaled_dot_product_attention``
    (without dropout).

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
    out : numpy.ndarray, optional
        Preallocated output of shape (..., Hq, L, Ev) and the result dtype; any
        strides; must not overlap the inputs.
    num_threads : int, optional
        Threads for this call; ``None`` uses the value set with
        :func:`set_num_threads`, else the OpenMP default (``OMP_NUM_THREADS``, or a
        threadpoolctl limit); :func:`get_num_threads` tells which.  Results are
        bitwise identical for every thread count.

    Returns
    -------
    output : numpy.ndarray, shape (..., Hq, L, Ev)
        With ``return_weights`` and/or ``return_lse``, a tuple
        ``(output, weights, lse)`` holding those asked for, in that order.  A query row that can see
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
    return _attention(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        return_weights=return_weights,
        return_lse=return_lse,
        key_lengths=key_lengths,
        out=out,
        num_threads=num_threads,
    )


def config() -> Dict[str, Any]:
    """Build and runtime facts: version, OpenMP, the OpenMP default thread count
    (``default_num_threads``), the count a call uses now (``num_threads``, see
    :func:`get_num_threads`), the kernel set in use (``isa``; set
    ``SDPA_ISA=scalar|avx2|avx512`` to force a lower one) and the kernel sets this
    CPU supports."""
    isas: List[str] = [name for name in _core.ISAS if _core.isa_supported(name)]
    return {
        "version": __version__,
        "openmp": bool(_core.has_openmp()),
        "default_num_threads": int(_core.default_num_threads()),
        "num_threads": get_num_threads(),
        "isa": _core.isa(),
        "isas_supported": isas,
    }


def show_config() -> None:
    """Print :func:`config` as ``key: value`` lines."""
    for name, value in config().items():
        print(f"{name}: {value}")
