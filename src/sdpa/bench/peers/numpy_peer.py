"""The textbook NumPy attention: the whole score matrix, softmax, then P V."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...reference import causal_mask


def _mask4(mask: np.ndarray) -> np.ndarray:
    """A mask broadcastable to (B, Hq, L, S) as a 4-D view (leading dims of 1 added)."""
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _grouped_mask(mask: np.ndarray, Hkv: int, group: int) -> np.ndarray:
    """A mask broadcastable to (B, Hq, L, S) as a view broadcastable to (B, Hkv, group,
    L, S): the query heads of one key/value head side by side."""
    m = _mask4(mask)
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], Hkv, group, m.shape[2], m.shape[3])


def numpy_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, mask: Optional[np.ndarray] = None
) -> np.ndarray:
    """Textbook attention in the inputs' dtype: full score matrix, softmax, then P V.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev); Hq a multiple of Hkv (GQA).
    ``mask``, broadcastable to (B, Hq, L, S): bool (True: takes part) or added to the
    scaled scores.
    """
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    # query heads of one group side by side, so K and V broadcast instead of being copied
    qg = q.reshape(B, Hkv, group, L, E)
    kg = k[:, :, None]
    vg = v[:, :, None]
    scores = qg @ np.swapaxes(kg, -1, -2)  # (B, Hkv, group, L, S)
    scores *= 1.0 / math.sqrt(E)
    if causal:
        np.copyto(scores, -np.inf, where=~causal_mask(L, S))
    if mask is not None:
        m = _grouped_mask(mask, Hkv, group)
        if m.dtype == np.bool_:
            np.copyto(scores, -np.inf, where=~m)
        else:
            scores += m
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ vg  # (B, Hkv, group, L, Ev)
    return out.reshape(B, Hq, L, v.shape[-1])
