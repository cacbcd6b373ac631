"""Type stub of the compiled extension sdpa._core (src/sdpa/_core.pyx)."""
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

MAX_BATCH_DIMS: int
MASK_NONE: int
MASK_BOOL: int
MASK_ADDITIVE: int
ISAS: Tuple[str, ...]

def version() -> str: ...
def isa() -> str: ...
def isa_supported(name: str) -> bool: ...
def set_isa(name: str) -> None: ...
def kernel_exp(name: str, x: npt.NDArray[np.floating[Any]]) -> None: ...
def fp_flags(num_threads: int = 1) -> List[int]: ...
def has_openmp() -> bool: ...
def default_num_threads() -> int: ...
def attention(
    is_float64: bool,
    batch_shape: Tuple[int, ...],
    heads: int,
    group: int,
    L: int,
    S: int,
    E: int,
    Ev: int,
    q: npt.NDArray[Any],
    q_strides: Sequence[int],
    k: npt.NDArray[Any],
    k_strides: Sequence[int],
    v: npt.NDArray[Any],
    v_strides: Sequence[int],
    out: npt.NDArray[Any],
    out_strides: Sequence[int],
    mask_kind: int,
    mask: Optional[npt.NDArray[Any]],
    mask_strides: Optional[Sequence[int]],
    scale: float,
    causal: bool,
    causal_offset: int,
    weights: Optional[npt.NDArray[Any]],
    weights_strides: Optional[Sequence[int]],
    num_threads: int,
    interruptible: bool = False,
    lse: Optional[npt.NDArray[Any]] = None,
    lse_strides: Optional[Sequence[int]] = None,
    key_lengths: Optional[npt.NDArray[Any]] = None,
    key_lengths_strides: Optional[Sequence[int]] = None,
) -> None: ...
