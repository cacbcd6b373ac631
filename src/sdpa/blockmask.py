"""Block-sparse attention: a map of which (query block, key block) tiles to compute.

:class:`BlockMask` takes the layout of PyTorch's FlexAttention ``BlockMask``:
for each (batch, query head, query block), the key blocks to compute, and
apart from them the blocks known to be wholly visible.  Given to
:func:`sdpa.scaled_dot_product_attention` as ``block_mask=``, only the listed
blocks are read and computed, so the cost follows the blocks, not L x S:

- a *partial* block (listed in ``kv_indices``) is computed with every rule of
  the call: ``attn_mask``, ``is_causal``, ``window`` and ``key_lengths``;
- a *full* block (listed in ``full_kv_indices``) skips every element test: it
  is computed entirely, even above the causal diagonal (the map is the
  caller's word), but a float ``attn_mask`` is still added there, and keys
  past ``key_lengths`` are still ignored;
- a block listed nowhere is never read; a row that sees no key gives 0 (and
  lse -inf).

The map is held as one int8 state per block (0 skipped, 1 partial, 2 full),
:attr:`BlockMask.states`, which the core reads for each query block.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ._checks import count
from ._dtypes import _to_array

__all__ = ["BlockMask"]

Array = np.ndarray

SKIP, PARTIAL, FULL = 0, 1, 2


def _pair(value: Any, name: str) -> Tuple[int, int]:
    """A pair of positive ints (an int stands for both)."""
    pair = (value, value) if isinstance(value, (int, np.integer)) else value
    try:
        a, b = pair
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}") from None
    return count(a, name, 1), count(b, name, 1)


def _counts_and_lists(counts: Any, lists: Any, names: Tuple[str, str]) -> Tuple[Array, Array]:
    """Counts (..., QB) and lists (..., QB, W) as integer arrays, checked."""
    c = _to_array(counts, names[0])
    x = _to_array(lists, names[1])
    for a, name in ((c, names[0]), (x, names[1])):
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{names[1]}: expected (..., query blocks, width), got shape {x.shape}")
    if c.ndim < 1 or c.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"{names[0]}: expected (..., {x.shape[-2]}) (a count per query block of {names[1]} "
            f"{x.shape}), got shape {c.shape}"
        )
    try:
        np.broadcast_shapes(c.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(f"{names[0]}: shape {c.shape} does not broadcast with {names[1]} {x.shape}") from None
    width = x.shape[-1]
    bad = (c < 0) | (c > width)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{names[0]}: entry {at} is {int(c[at])}, not a count in [0, {width}] (the width of {names[1]})"
        )
    return c, x


def _place(states: Array, counts: Array, lists: Array, kb: int, state: int, names: Tuple[str, str]) -> None:
    """Marks the first counts[...] blocks of each list with ``state`` in
    states (..., QB, kb + 1), whose last column takes the unused entries."""
    shape = states.shape[:-1] + lists.shape[-1:]
    c = np.broadcast_to(counts[..., None], shape)
    x = np.broadcast_to(lists, shape)
    used = np.arange(shape[-1]) < c
    bad = used & ((x < 0) | (x >= kb))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{names[1]}: entry {at} is {int(x[at])}, not a key block in [0, {kb})")
    idx = np.where(used, x, kb).astype(np.int64)  # unused entries go to a spare column
    ordered = np.sort(idx, axis=-1)
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] < kb)
    if twice.any():
        at = tuple(int(i) for i in np.argwhere(twice)[0])
        raise ValueError(f"{names[1]}: key block {int(ordered[at])} is listed twice for query block {at[:-1]}")
    if state == FULL:
        clash = np.take_along_axis(states, idx, axis=-1) == PARTIAL
        if (clash & used).any():
            at = tuple(int(i) for i in np.argwhere(clash & used)[0])
            raise ValueError(
                f"{names[1]}: key block {int(x[at])} of query block {at[:-1]} is listed as partial "
                f"(kv_indices) and full"
            )
    np.put_along_axis(states, idx, state, axis=-1)


class BlockMask:
    """A block map for :func:`sdpa.scaled_dot_product_attention` (``block_mask=``).

    Parameters
    ----------
    kv_num_blocks : array_like of int, shape (..., QB)
        For each (batch, query head, query block), how many entries of
        ``kv_indices`` to read: the partial blocks (computed with the call's
        masks, causality and window).
    kv_indices : array_like of int, shape (..., QB, W)
        Key block numbers in ``[0, KB)``; entries past a row's count are never
        read, whatever they hold.  A block listed twice in one row is refused.
    full_kv_num_blocks, full_kv_indices : array_like of int, optional
        The same for the blocks computed in full (no element test).  A block
        may not be both partial and full.
    block_size : int or (int, int), default (128, 128)
        Query rows and keys a block; any positive sizes.
    seq_lengths : (int, int), optional
        The (L, S) the map was made for: a call of other lengths is refused.
        It sets the number of key blocks, KB = ceil(S / block_size[1]); without
        it KB is ``kv_indices.shape[-1]`` (FlexAttention's layout).

    The leading dims are (batch..., heads) and broadcast against the call's
    (heads count query heads, as in FlexAttention); QB must be
    ``ceil(L / block_size[0])`` for the call.

    Raises
    ------
    TypeError
        Arguments that are not integer arrays or ints.
    ValueError
        Counts past the width of their lists, an entry past the key blocks, a
        block listed twice or both partial and full, shapes that do not fit.
    """

    __slots__ = ("states", "block_size", "seq_lengths")

    states: Array
    block_size: Tuple[int, int]
    seq_lengths: Optional[Tuple[int, int]]

    def __init__(
        self,
        kv_num_blocks: Any,
        kv_indices: Any,
        *,
        full_kv_num_blocks: Any = None,
        full_kv_indices: Any = None,
        block_size: Any = (128, 128),
        seq_lengths: Optional[Tuple[int, int]] = None,
    ) -> None:
        self.block_size = _pair(block_size, "block_size")
        names = ("kv_num_blocks", "kv_indices")
        counts, lists = _counts_and_lists(kv_num_blocks, kv_indices, names)
        full: Optional[Tuple[Array, Array]] = None
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            given, missing = ("full_kv_num_blocks", "full_kv_indices")[:: 1 if full_kv_indices is None else -1]
            raise ValueError(f"{missing}: expected with {given}")
        if full_kv_num_blocks is not None:
            full = _counts_and_lists(full_kv_num_blocks, full_kv_indices, ("full_kv_num_blocks", "full_kv_indices"))
        if seq_lengths is not None:
            L, S = self.seq_lengths = _pair(seq_lengths, "seq_lengths")
            qb, kb = -(-L // self.block_size[0]), -(-S // self.block_size[1])
            if lists.shape[-2] != qb:
                raise ValueError(
                    f"kv_indices: expected {qb} query blocks (L {L} in blocks of {self.block_size[0]}), "
                    f"got shape {lists.shape}"
                )
        else:
            self.seq_lengths = None
            kb = lists.shape[-1]
        lead = np.broadcast_shapes(counts.shape, lists.shape[:-1])
        if full is not None:
            lead = np.broadcast_shapes(lead, full[0].shape, full[1].shape[:-1])
        states = np.zeros(lead + (kb + 1,), dtype=np.int8)  # a spare column for unused entries
        _place(states, counts, lists, kb, PARTIAL, names)
        if full is not None:
            _place(states, full[0], full[1], kb, FULL, ("full_kv_num_blocks", "full_kv_indices"))
        self.states = np.ascontiguousarray(states[..., :kb])
        self.states.flags.writeable = False

    @classmethod
    def from_states(
        cls, states: Any, block_size: Any = (128, 128), seq_lengths: Optional[Tuple[int, int]] = None
    ) -> "BlockMask":
        """A map from its states (..., QB, KB): 0 skipped, 1 partial, 2 full."""
        s = _to_array(states, "states")
        if s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.integer) or s.ndim < 2:
            raise TypeError(f"states: expected integers (..., QB, KB), got {s.dtype} {s.shape}")
        if ((s < SKIP) | (s > FULL)).any():
            raise ValueError("states: expected 0 (skipped), 1 (partial) or 2 (full)")
        self = cls.__new__(cls)
        self.block_size = _pair(block_size, "block_size")
        self.seq_lengths = None if seq_lengths is None else _pair(seq_lengths, "seq_lengths")
        self.states = np.ascontiguousarray(s, dtype=np.int8)
        self.states.flags.writeable = False
        return self

    @classmethod
    def from_dense(cls, visible: Any, block_size: Any = (128, 128)) -> "BlockMask":
        """The map of a bool mask (..., L, S): a block with every element
        visible is full, one with some partial, one with none skipped."""
        m = _to_array(visible, "visible")
        if m.dtype != np.bool_ or m.ndim < 2:
            raise TypeError(f"visible: expected a bool array (..., L, S), got {m.dtype} {m.shape}")
        bq, bk = _pair(block_size, "block_size")
        L, S = m.shape[-2:]
        qb, kb = -(-L // bq), -(-S // bk)
        if (L, S) == (qb * bq, kb * bk):
            padded = m
        else:
            padded = np.zeros(m.shape[:-2] + (qb * bq, kb * bk), dtype=np.bool_)
            padded[..., :L, :S] = m
        tiles = padded.reshape(m.shape[:-2] + (qb, bq, kb, bk))
        seen = tiles.sum(axis=(-3, -1), dtype=np.int64)
        rows = np.minimum(bq, L - np.arange(qb) * bq)[:, None]
        cols = np.minimum(bk, S - np.arange(kb) * bk)[None, :]
        states = np.where(seen == rows * cols, FULL, np.where(seen > 0, PARTIAL, SKIP))
        return cls.from_states(states, (bq, bk), (L, S))

    @property
    def shape(self) -> Tuple[int, ...]:
        """The states' shape: (..., QB, KB)."""
        return tuple(self.states.shape)

    def sparsity(self) -> float:
        """The share of blocks never computed (0 to 1)."""
        return float((self.states == SKIP).mean()) if self.states.size else 0.0

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
            f"sparsity={self.sparsity():.2f})"
        )

    def blocks_for(self, L: int, S: int) -> Tuple[Array, int, int]:
        """The core's block map for a call of L query rows and S keys: the
        states, block_q, block_k; a ValueError naming ``block_mask`` when the
        map was not made for them."""
        bq, bk = self.block_size
        if self.seq_lengths is not None and self.seq_lengths != (L, S):
            raise ValueError(f"block_mask: made for (L, S) = {self.seq_lengths}, the call has ({L}, {S})")
        qb, kb = -(-L // bq), -(-S // bk)
        if self.states.shape[-2:] != (qb, kb):
            raise ValueError(
                f"block_mask: expected (..., {qb}, {kb}) blocks for L {L} and S {S} in blocks of {bq} x {bk}, "
                f"got {self.states.shape}"
            )
        return self.states, bq, bk
