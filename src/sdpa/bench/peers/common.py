"""What every implementation shares: the registry of implementations and kernels,
the agreement tolerances, and :class:`Prepared`, a run made ready."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Tuple

from ... import _core
from ..shapes import GiB

#: The throughput suite's implementations: sdpa, the textbook NumPy version, and the
#: peers, each run when its package is installed and reported absent otherwise:
#: torch's ``scaled_dot_product_attention``, ONNX Runtime's ONNX ``Attention`` operator
#: (``ort``) and its ``com.microsoft`` ``MultiHeadAttention`` contrib operator
#: (``ort-mha``), and OpenVINO's ``ScaledDotProductAttention`` (``openvino``).
IMPLEMENTATIONS = ("sdpa", "numpy", "torch", "ort", "ort-mha", "openvino")

#: ``sdpa@SET`` (for example ``sdpa@avx512_bf16``) runs sdpa with the kernel set SET
#: forced for its calls, beside ``sdpa`` on the set chosen for this CPU: two kernel
#: sets of one machine compared in one run.
KERNEL_SET_PREFIX = "sdpa@"


def kernel_set_of(impl: str) -> Optional[str]:
    """The kernel set ``impl`` forces (``sdpa@SET``), or None."""
    return impl[len(KERNEL_SET_PREFIX):] if impl.startswith(KERNEL_SET_PREFIX) else None


def is_implementation(impl: str) -> bool:
    """Whether the suite knows ``impl``: one of :data:`IMPLEMENTATIONS`, or ``sdpa@SET``
    for a kernel set SET of this build (whether the CPU runs it or not)."""
    return impl in IMPLEMENTATIONS or kernel_set_of(impl) in _core.ISAS


def ordered(impls: Iterable[str]) -> List[str]:
    """``impls`` in report order: :data:`IMPLEMENTATIONS`' order, ``sdpa@SET`` after ``sdpa``."""
    def key(impl: str) -> Tuple[int, int]:
        if impl in IMPLEMENTATIONS:
            return (IMPLEMENTATIONS.index(impl), 0)
        isa = kernel_set_of(impl)
        return (0, 1 + (_core.ISAS.index(isa) if isa in _core.ISAS else len(_core.ISAS)))

    return sorted(set(impls), key=key)


#: The peers the suite runs in float32 only (q, k and v all float32).
FLOAT32_PEERS = ("ort", "ort-mha", "openvino")

#: The latency mode's: sdpa on NumPy arrays and on torch tensors, torch's own
#: function, and ONNX Runtime's Attention operator.
LATENCY_IMPLEMENTATIONS = ("sdpa", "sdpa.torch", "torch", "ort")

#: NumPy's version builds the whole score matrix; above this many bytes it is skipped.
NUMPY_MAX_SCORE_BYTES = 2 * GiB

#: The kernel each implementation runs, "fused" (one pass over K and V per block of
#: query rows, no score matrix in memory) or "unfused" (the scores of a whole head, or
#: of all of them, written to memory, then softmax, then P V), as far as it can be told
#: without a profiler.  Where the implementation itself says, that is read at run time
#: instead (see :func:`prepare`): torch's own choice of backend, and the layers of
#: OpenVINO's compiled model.
KERNELS: Dict[str, str] = {
    # sdpa's own kernel: blocks of keys with an online softmax, never the score matrix.
    "sdpa": "fused",
    # numpy_attention below: the whole (B, Hq, L, S) score matrix, softmax, then P V.
    "numpy": "unfused",
    # On CPU, torch's dispatcher picks _scaled_dot_product_flash_attention_for_cpu for
    # float32 (and float64, bfloat16, float16), with masks and grouped heads too; what it
    # picks is read from torch._fused_sdp_choice at run time where that exists.
    "torch": "fused",
    # ONNX Runtime's CPU kernel of the ONNX Attention operator (1.32 and before)
    # computes Q Kᵀ of every head into a (B, H, L, S) buffer, then softmax, then P V:
    # its peak memory grows by that buffer (1 GiB at B=1, H=4, L=S=8192 in float32).
    "ort": "unfused",
    # MultiHeadAttention on CPU runs MLAS's flash attention when it is given neither a
    # mask nor a bias, is not unidirectional (causal), and gets K and V as (B, S, H·E),
    # unless ORT_DISABLE_FLASH_ATTENTION is set; otherwise the same unfused path as
    # above (both seen in the source and in peak memory).  See _ort_mha_kernel.
    "ort-mha": "fused",
    # ScaledDotProductAttention compiles to one fused layer on CPU (the plugin's own
    # SDPA node, or a Snippets subgraph of MatMul, Softmax and MatMul); the compiled
    # model's layers are read at run time, and a separate Softmax layer means unfused
    # (as with grouped heads, given as a 5-D broadcast).
    "openvino": "fused",
}

#: ``(rtol, atol)`` of the check of a peer's output against sdpa's, by the dtype of the
#: coarser of the two outputs: float32 roundoff of a few thousand terms in float32, the
#: rounding of q, k, v or the output in 16 bits.  Outputs of these random problems are
#: about 0.03 to 2 in size, and a wrong mask or scale moves them by about as much.
AGREEMENT_TOLERANCE: Dict[str, Tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-5),
    "float16": (2.0**-8, 2.0**-10),
    "bfloat16": (2.0**-5, 2.0**-7),
}


# --------------------------------------------------------------------------- preparing a run


@dataclass
class Prepared:
    """One implementation made ready for one problem.

    ``call`` computes the attention once (what is timed); ``output`` turns what it
    returns into sdpa's layout, (B, Hq, L, Ev), an array or a tensor (untimed);
    ``kernel`` is "fused" or "unfused" and ``kernel_how`` says how that is known;
    ``setting`` is what the calls run under, entered once around them (sdpa@SET:
    its kernel set).
    """

    call: Callable[[], Any]
    output: Callable[[Any], Any]
    kernel: str
    kernel_how: str
    setting: Callable[[], ContextManager[Any]] = contextlib.nullcontext


@contextlib.contextmanager
def kernel_set(name: str) -> Iterator[None]:
    """sdpa's kernel set forced to ``name`` inside, and the choice before restored
    after: a named set, or the default one (which a refused AMX tile state can
    still turn into avx512_bf16)."""
    named = _core.isa_named()
    _core.set_isa(name)
    try:
        yield
    finally:
        _core.set_isa(named)


def _same(out: Any) -> Any:
    return out


def _static(impl: str) -> str:
    return f"static table (sdpa.bench.peers.KERNELS[{impl!r}])"
