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
NumPy version for checking, and ``sdpa.testing`` (imported on its own) random
problems and checks for tests; ``sdpa.torch`` (which imports torch) takes and
returns torch tensors.
"""
from __future__ import annotations

from typing import Any, Dict, List

from . import _core, reference
from ._api import (
    ArrayInput as ArrayInput,  # re-exported for typing
    AttentionResult as AttentionResult,
    FloatArray as FloatArray,
    get_num_threads,
    scaled_dot_product_attention,
    set_num_threads,
)
from .blockmask import BlockMask
from .kvcache import KVCache, KVCacheFullError
from .layers import MultiHeadAttention
from .merge import merge_attention
from .paged import PagedKVCache, paged_attention, paged_write
from .sparse import index_topk, sparse_attention
from .training import attention_backward
from .varlen import varlen_attention

__all__ = [
    "scaled_dot_product_attention",
    "attention_backward",
    "merge_attention",
    "varlen_attention",
    "paged_attention",
    "paged_write",
    "sparse_attention",
    "index_topk",
    "PagedKVCache",
    "KVCache",
    "KVCacheFullError",
    "BlockMask",
    "MultiHeadAttention",
    "set_num_threads",
    "get_num_threads",
    "show_config",
    "config",
    "reference",
    "__version__",
]

__version__: str = _core.version()

if _core.isa_env_error():  # every call would fail: say so now, once
    import os as _os
    import warnings as _warnings

    _warnings.warn(
        f"sdpa: SDPA_ISA={_os.environ.get('SDPA_ISA')!r}: {_core.isa_env_error()}; every call "
        f"will raise ValueError. This CPU supports: {', '.join(_core.isas_supported())}",
        RuntimeWarning,
        stacklevel=2,
    )


def config() -> Dict[str, Any]:
    """Build and runtime facts: version, OpenMP, the OpenMP default thread count
    (``default_num_threads``), the most threads a call uses (``max_threads``: 4
    per CPU, at least 8), the count a call uses now (``num_threads``, see
    :func:`get_num_threads`), the kernel set in use (``isa``; set
    ``SDPA_ISA=scalar|avx2|avx512|avx512_bf16|amx`` on x86-64,
    ``SDPA_ISA=scalar|neon|neon_bf16`` on AArch64, to force one), the kernel
    sets this CPU supports, the L1 data and L2 cache sizes in bytes that the
    tiles are chosen from (``l1d_cache``, ``l2_cache``; docs/blocking.md), and
    the kernel ``integer_qk`` scores run on now (``integer_qk``: "avx512_vnni",
    "avx_vnni" for the avx2 set, "neon_dotprod" for the neon sets, or
    "portable" on a CPU or kernel set without them)."""
    isas: List[str] = _core.isas_supported()
    l1d, l2 = _core.cache_sizes()
    return {
        "version": __version__,
        "openmp": bool(_core.has_openmp()),
        "default_num_threads": int(_core.default_num_threads()),
        "max_threads": int(_core.max_threads()),
        "num_threads": get_num_threads(),
        "isa": _core.isa(),
        "isas_supported": isas,
        "l1d_cache": l1d,
        "l2_cache": l2,
        "integer_qk": _core.dot_qi_kernel(),
    }


def show_config() -> None:
    """Print :func:`config` as ``key: value`` lines."""
    for name, value in config().items():
        print(f"{name}: {value}")
