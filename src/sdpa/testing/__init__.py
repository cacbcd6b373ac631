"""Random problems, special values and checks for testing attention code, in the
spirit of ``numpy.testing``.

* :func:`randn`, :func:`make_qkv`, :func:`random_mask`: random query, key and
  value arrays and masks from a NumPy Generator.
* :data:`SPECIALS`, :func:`special_value`, :func:`random_values`: arrays with
  NaN, infinities, subnormals, signed zeros or huge magnitudes written into them.
* :func:`place`: the same values in another memory layout (strided, transposed,
  reversed, unaligned, read-only, Fortran order, a list).
* :func:`assert_matches_reference`: a result against :mod:`sdpa.reference`, row by
  row, with a tolerance that follows the conditioning of each row; special values
  in the inputs included.
* Hypothesis strategies: :func:`qkv_problems` (finite problems) and
  :func:`attention_calls` (whole calls: sizes from 0, heads, masks, causal modes,
  key lengths, windows, softcaps, ALiBi, sinks, dtypes, layouts, special values),
  :func:`cache_calls`, :func:`varlen_calls` and :func:`paged_calls` (paged pools
  with forks, every cache dtype, latent views and tree masks).  Hypothesis is imported when a
  strategy is made, so ``import sdpa.testing`` works without it.

Decisions other than array contents (how many special values, where, which
magnitude) are taken from a :class:`Choices` object: a NumPy Generator by
default (:class:`RandomChoices`), Hypothesis' ``draw`` in the strategies, or the
bytes of a fuzzer's input.  sdpa's own tests, its Hypothesis suite and its fuzz
harness all draw from here.
"""
from __future__ import annotations

from .checker import assert_matches_reference
from .problems import (
    FLOAT_DTYPES,
    OTHER_DTYPES,
    SPECIALS,
    Choices,
    RandomChoices,
    broadcastable_shape,
    compute_dtype,
    make_qkv,
    place,
    randn,
    random_mask,
    random_values,
    result_dtype,
    special_value,
)
from .strategies import (
    SOFTCAPS,
    attention_calls,
    cache_calls,
    describe_call,
    layouts,
    paged_calls,
    qkv_problems,
    values,
    varlen_calls,
)

__all__ = [
    "randn",
    "make_qkv",
    "random_mask",
    "result_dtype",
    "compute_dtype",
    "Choices",
    "RandomChoices",
    "FLOAT_DTYPES",
    "OTHER_DTYPES",
    "SPECIALS",
    "SOFTCAPS",
    "special_value",
    "random_values",
    "place",
    "broadcastable_shape",
    "assert_matches_reference",
    "values",
    "layouts",
    "qkv_problems",
    "attention_calls",
    "describe_call",
    "cache_calls",
    "varlen_calls",
    "paged_calls",
]
