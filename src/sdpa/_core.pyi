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
def isas_supported() -> List[str]: ...
def isa_named() -> Optional[str]: ...
def set_isa(name: Optional[str]) -> None: ...
def has_openmp() -> bool: ...
def default_num_threads() -> int: ...
def max_threads() -> int: ...
def cache_sizes() -> Tuple[int, int]: ...
def set_threads_setting(n: int) -> None: ...
def threads_setting() -> int: ...
def kernel_exp(name: str, x: npt.NDArray[np.floating[Any]]) -> None: ...
def panel_rows(name: str, dtype: str) -> int: ...
def kernel_softmax(name: str, row: int, s: np.ndarray, row_max: np.ndarray, row_sum: np.ndarray,
                   acc: np.ndarray) -> None: ...
PROFILE_PHASES: Tuple[str, ...]
def set_packing(mode: str) -> None: ...
def set_fold_group(min_group: Optional[int]) -> None: ...
def set_portable_dot_qi(on: bool) -> None: ...
def dot_qi_kernel() -> str: ...
def probe_read(buf: npt.NDArray[Any], threads: int) -> float: ...
def probe_peak(kind: int, threads: int, seconds: float = ...) -> Tuple[float, str]: ...
def profile_start() -> None: ...
def profile_read() -> Dict[str, float]: ...
def profile_stop() -> None: ...
def fp_flags(num_threads: int = 1) -> List[int]: ...
def set_flush_to_zero(on: bool) -> bool: ...
def set_blocking(tile_q: int = 0, tile_k: int = 0, chunk: int = 0) -> None: ...
def ask_for_tiles() -> bool: ...
def stand_in(mode: int, as_default: bool = True) -> None: ...
def tile_requests() -> int: ...
def amx_emulated_calls() -> int: ...
HAVE_AMX_KERNELS: bool
def use_kernels(name: str) -> None: ...
def gemm_bf16(name: str, m: int, kpairs: int, a: np.ndarray, a_rs: int, a_ks: int, b: np.ndarray, ldb: int,
              c: np.ndarray, ldc: int, accumulate: bool, repeat: int = 1) -> None: ...
def table_complete(name: str, declared: bool = False) -> Optional[bool]: ...
def set_pack_group(mode: str) -> None: ...
def set_observer(fn: Optional[Callable[[Dict[str, Any]], None]]) -> None: ...
FLOATS: Dict[str, int]
QUANTIZED: Dict[str, int]
QUANTIZED_MAX: Dict[str, float]
def quantize(
    code: int, src: npt.NDArray[Any], dst: npt.NDArray[Any], scales: Optional[npt.NDArray[Any]],
    group_size: int = 0,
) -> None: ...
def quantize_int8(
    src: npt.NDArray[Any], dst: npt.NDArray[Any], scales: npt.NDArray[Any], group_size: int = 0
) -> None: ...
def index_topk(
    q: npt.NDArray[Any], key: npt.NDArray[Any], key_code: int, key_scale: Optional[npt.NDArray[Any]],
    weights: npt.NDArray[Any], k: int, key_lengths: Optional[npt.NDArray[Any]], causal: bool, num_threads: int,
) -> Tuple[npt.NDArray[Any], npt.NDArray[Any]]: ...
ARGUMENTS: Tuple[str, ...]
RULES: Tuple[str, ...]
OUT_MAY_OVERLAP: int
MAX_POSITION: int
def reason(code: int) -> str: ...
def physical_memory_bytes() -> Optional[int]: ...
Result = Union[int, npt.NDArray[np.floating[Any]], Tuple[npt.NDArray[np.floating[Any]], ...]]
MAX_NUM_THREADS: int
MAX_PREPARED_CALLS: int

class Call:
    constants: Tuple[Any, ...]
    def __init__(
        self,
        *,
        is_causal: Any = False,
        scale: Any = None,
        enable_gqa: Any = False,
        window: Any = None,
        softcap: Any = None,
        num_threads: Any = None,
        return_weights: Any = False,
        return_lse: Any = False,
        kv_dtype: Optional[int] = None,
        group_size: Any = 0,
        integer_qk: Any = False,
        integer_pv: Any = False,
        diagonal: Any = None,
    ) -> None: ...
    @property
    def kv_dtype(self) -> Optional[int]: ...
    @property
    def enable_gqa(self) -> bool: ...
    @property
    def return_weights(self) -> bool: ...
    def prepared(
        self,
        is_causal: Any,
        scale: Any,
        enable_gqa: Any,
        window: Any,
        softcap: Any,
        num_threads: Any,
        return_weights: Any,
        return_lse: Any,
    ) -> Call: ...
    def prepared_count(self) -> int: ...
    def at_diagonal(self, diagonal: Optional[int]) -> Call: ...
    def run(
        self,
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        key_lengths: Any = None,
        alibi_slopes: Any = None,
        sinks: Any = None,
        out: Any = None,
        blocks: Optional[Tuple[Any, int, int]] = None,
        key_scores: Optional[int] = None,
        dropout: Optional[Tuple[float, int]] = None,
    ) -> Result: ...
    def run_cache(
        self,
        query: Any,
        key: Any,
        value: Any,
        key_scale: Any,
        value_scale: Any,
        attn_mask: Any = None,
        out: Any = None,
        extras: Optional[Tuple[Any, Any, Any]] = None,
        indices: Any = None,
        blocks: Optional[Tuple[Any, int, int]] = None,
        key_scores: Optional[int] = None,
        dropout: Optional[Tuple[float, int]] = None,
    ) -> Result: ...
    def run_varlen(
        self,
        query: Any,
        key: Any,
        value: Any,
        cu_seqlens_q: Any,
        cu_seqlens_k: Any,
        extras: Optional[Tuple[Any, Any]] = None,
        out: Any = None,
        *,
        plan_threads: int = -1,
    ) -> Any: ...
    def run_paged(
        self,
        query: Any,
        key_cache: Any,
        value_cache: Any,
        block_tables: Any,
        seq_lens: Any,
        scales: Optional[Tuple[Any, Any]] = None,
        extras: Optional[Tuple[Any, Any, Any, Any]] = None,
        out: Any = None,
        *,
        plan_threads: int = -1,
        key_scores: Optional[int] = None,
    ) -> Any: ...

def plain() -> Call: ...

def backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    grad_out: Any,
    grad_query: Any,
    grad_key: Any,
    grad_value: Any,
    attn_mask: Any,
    key_lengths: Any,
    alibi_slopes: Any,
    sinks: Any,
    grad_sinks: Any,
    *,
    gqa_group: int,
    scale: float,
    causal: bool,
    causal_offset: int,
    align_offset: int,
    window_left: int,
    window_right: int,
    softcap: float,
    num_threads: int,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> None: ...
