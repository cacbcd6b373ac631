"""Type stub of the compiled extension sdpa._core (src/sdpa/_core.pyx)."""
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

MAX_BATCH_DIMS: int
ISAS: Tuple[str, ...]

def version() -> str: ...
def isa() -> str: ...
def isa_env_error() -> Optional[str]: ...
def isa_supported(name: str) -> bool: ...
def set_isa(name: str) -> None: ...
def has_openmp() -> bool: ...
def default_num_threads() -> int: ...
def max_threads() -> int: ...
def cache_sizes() -> Tuple[int, int]: ...
def set_threads_setting(n: int) -> None: ...
def threads_setting() -> int: ...
def kernel_exp(name: str, x: npt.NDArray[np.floating[Any]]) -> None: ...
def fp_flags(num_threads: int = 1) -> List[int]: ...
def set_flush_to_zero(on: bool) -> bool: ...
def set_blocking(tile_q: int = 0, tile_k: int = 0, chunk: int = 0) -> None: ...
def ask_for_tiles() -> bool: ...
def pretend_tiles_refused(refused: bool, as_default: bool = True) -> None: ...
def use_kernels(name: str) -> None: ...
def gemm_bf16(name: str, m: int, kpairs: int, a: np.ndarray, a_rs: int, a_ks: int, b: np.ndarray, ldb: int,
              c: np.ndarray, ldc: int, accumulate: bool) -> None: ...
def set_observer(fn: Optional[Callable[[Dict[str, Any]], None]]) -> None: ...
def run(
    q: npt.NDArray[Any],
    k: npt.NDArray[Any],
    v: npt.NDArray[Any],
    out: npt.NDArray[Any],
    *,
    mask: Optional[npt.NDArray[Any]] = None,
    weights: Optional[npt.NDArray[Any]] = None,
    lse: Optional[npt.NDArray[Any]] = None,
    key_lengths: Optional[npt.NDArray[Any]] = None,
    scale: float = 1.0,
    causal: bool = False,
    causal_offset: int = 0,
    group: int = 1,
    num_threads: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    align_offset: int = 0,
    softcap: float = 0.0,
    alibi: Optional[npt.NDArray[Any]] = None,
    sinks: Optional[npt.NDArray[Any]] = None,
    k_scale: Optional[npt.NDArray[Any]] = None,
    v_scale: Optional[npt.NDArray[Any]] = None,
    group_size: int = 0,
) -> None: ...
def quantize_int8(
    src: npt.NDArray[Any], dst: npt.NDArray[Any], scales: npt.NDArray[Any], group_size: int = 0
) -> None: ...
def try_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    return_weights: Any,
    return_lse: Any,
    key_lengths: Any,
    out: Any,
    num_threads: Any,
    *,
    k_scale: Optional[npt.NDArray[Any]] = None,
    v_scale: Optional[npt.NDArray[Any]] = None,
    group_size: int = 0,
    diagonal: Optional[int] = None,
) -> Union[None, npt.NDArray[np.floating[Any]], Tuple[npt.NDArray[np.floating[Any]], ...]]: ...
