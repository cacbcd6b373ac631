"""The training mode: ``python -m sdpa.bench --backward``.

Times the backward pass and dropout against the forward and against torch, on
the same inputs in one run:

- backward (B 4, H 16, S 2,048, E 64, causal), float32 and bfloat16:
  ``sdpa.attention_backward`` (from the forward's output and lse) against
  sdpa's forward that keeps the lse (the issue's bound: at most 2.5x it), and
  against torch's CPU flash backward (``torch.autograd.grad`` of
  ``scaled_dot_product_attention`` under ``SDPBackend.FLASH_ATTENTION``, the
  graph built once, so that only the backward is timed);
- a training step (forward and backward through autograd) of
  ``sdpa.torch.scaled_dot_product_attention`` against torch's flash one;
- dropout (``dropout_p=0.1``) in the forward against the forward without it.

``--quick``: B 1, S 512.  The implementations of a case are timed in
alternating rounds, each timed loop after an untimed call (torch's OpenMP
threads spin a while after its calls, and slowed the next sdpa call by up to
1.8x on 2 cores); times are medians.
"""

from __future__ import annotations

import importlib.util
import statistics
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._api import scaled_dot_product_attention
from ..training import attention_backward
from .threads import SdpaThreads, TorchThreads, threads_text
from .timing import Progress, alternating_loop_times

__all__ = ["BACKWARD_CASES", "iter_backward", "format_backward_table", "backward_case_available"]

#: (name, what) of each case, in the order they run.
BACKWARD_CASES: Tuple[Tuple[str, str], ...] = (
    ("backward-f32", "B4 H16 S2048 E64 causal float32: backward against the forward and torch's flash backward"),
    ("backward-bf16", "B4 H16 S2048 E64 causal bfloat16: backward against the forward and torch's flash backward"),
    ("step-f32", "B4 H16 S2048 E64 causal float32: forward + backward through autograd, sdpa.torch against torch"),
    ("dropout-f32", "B4 H16 S2048 E64 causal float32: the forward with dropout_p 0.1 against without"),
    ("dropout-bf16", "B4 H16 S2048 E64 causal bfloat16: the forward with dropout_p 0.1 against without"),
)

_SIZES = {"B": 4, "H": 16, "S": 2048, "E": 64}


def backward_case_available(name: str) -> bool:
    """torch for the cases that time it, ml_dtypes for bfloat16."""
    if name.startswith(("backward", "step")) and importlib.util.find_spec("torch") is None:
        return False
    return "bf16" not in name or importlib.util.find_spec("ml_dtypes") is not None


Case = Tuple[str, str, Dict[str, Callable[[], Any]], Dict[str, Any]]


def _sizes(quick: bool) -> Tuple[int, int, int, int]:
    return (1 if quick else _SIZES["B"]), _SIZES["H"], _SIZES["S"] // (4 if quick else 1), _SIZES["E"]


def _cases(rng: np.random.Generator, quick: bool, names: Sequence[str]) -> Iterator[Case]:
    what = dict(BACKWARD_CASES)
    B, H, S, E = _sizes(quick)
    flops = 4.0 * B * H * S * S * E / 2  # the causal forward's products
    for name in names:
        if name.startswith("dropout"):
            q, k, v = (_data(rng, (B, H, S, E), name) for _ in range(3))
            impls: Dict[str, Callable[[], Any]] = {
                "dropout": partial(scaled_dot_product_attention, q, k, v, is_causal=True, dropout_p=0.1, seed=1),
                "forward": partial(scaled_dot_product_attention, q, k, v, is_causal=True),
            }
            yield name, what[name], impls, {"flops": flops}
        elif name.startswith("backward"):
            yield name, what[name], _backward_impls(rng, name, (B, H, S, E)), {"flops": flops * 2.5}
        elif name == "step-f32":
            yield name, what[name], _step_impls(rng, (B, H, S, E)), {"flops": flops * 3.5}


def _data(rng: np.random.Generator, shape: Tuple[int, ...], name: str) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    if "bf16" in name:
        import ml_dtypes  # noqa: PLC0415

        return x.astype(ml_dtypes.bfloat16)
    return x


def _backward_impls(rng: np.random.Generator, name: str, shape: Tuple[int, int, int, int]) -> Dict[str, Any]:
    import torch  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    q, k, v, g = (_data(rng, shape, name) for _ in range(4))
    out, lse = scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    dt = torch.bfloat16 if "bf16" in name else torch.float32
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(dt).requires_grad_() for x in (q, k, v))
    tg = torch.from_numpy(g.astype(np.float32)).to(dt)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def torch_backward() -> Any:
        return torch.autograd.grad(tout, (tq, tk, tv), tg, retain_graph=True)

    return {
        "backward": partial(attention_backward, g, q, k, v, out, lse, is_causal=True),
        "forward": partial(scaled_dot_product_attention, q, k, v, is_causal=True, return_lse=True),
        "torch": torch_backward,
    }


def _step_impls(rng: np.random.Generator, shape: Tuple[int, int, int, int]) -> Dict[str, Any]:
    import torch  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    from .. import torch as sdpa_torch  # noqa: PLC0415

    tq, tk, tv = (torch.from_numpy(_data(rng, shape, "f32")).requires_grad_() for _ in range(3))
    tg = torch.from_numpy(_data(rng, shape, "f32"))

    def ours() -> Any:
        out = sdpa_torch.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        return torch.autograd.grad(out, (tq, tk, tv), tg)

    def theirs() -> Any:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        return torch.autograd.grad(out, (tq, tk, tv), tg)

    return {"step": ours, "torch": theirs}


def iter_backward(
    threads: Sequence[int],
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    seed: int = 0,
    quick: bool = False,
    cases: Optional[Sequence[str]] = None,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """One row per case and thread count: the median seconds per call of each
    implementation and the ratios the targets are stated in."""
    names = [n for n, _ in BACKWARD_CASES if backward_case_available(n) and (cases is None or n in cases)]
    rng = np.random.default_rng(seed)
    for name, what, impls, facts in _cases(rng, quick, names):
        for n in threads:
            if progress:
                progress.show(f"backward {name}, {threads_text(n)}")
            torch_threads: Any = None
            if "torch" in impls:
                import torch  # noqa: PLC0415

                torch_threads = TorchThreads(torch, n)
            with SdpaThreads(n):
                if torch_threads is not None:
                    with torch_threads:
                        times, _ = alternating_loop_times(impls, min_time, repeat, settle=True)
                else:
                    times, _ = alternating_loop_times(impls, min_time, repeat, settle=True)
            med = {i: statistics.median(t) for i, t in times.items()}
            row: Dict[str, Any] = {"case": name, "what": what, "threads": n, **facts, "median_s": med,
                                   "times_s": times}
            if "backward" in med:
                row["backward_over_forward"] = med["backward"] / med["forward"]
                row["vs_torch"] = med["torch"] / med["backward"]
                row["gflops"] = facts["flops"] / med["backward"] / 1e9
            elif "step" in med:
                row["vs_torch"] = med["torch"] / med["step"]
                row["gflops"] = facts["flops"] / med["step"] / 1e9
            else:
                row["dropout_speed"] = med["forward"] / med["dropout"]
                row["gflops"] = facts["flops"] / med["dropout"] / 1e9
            yield row
            if progress:
                progress.advance()


def format_backward_table(rows: List[Dict[str, Any]]) -> str:
    """A text table of the rows of :func:`iter_backward`."""
    lines = [f"{'case':14s} {'thr':>3s} {'sdpa ms':>9s} {'GFLOP/s':>8s}  against"]
    for r in rows:
        m = r["median_s"]
        if "backward_over_forward" in r:
            ours = m["backward"]
            vs = (f"forward {m['forward'] * 1e3:.1f} ms: backward {r['backward_over_forward']:.2f}x it; "
                  f"torch's flash backward {m['torch'] * 1e3:.1f} ms: {r['vs_torch']:.2f}x")
        elif "step" in m:
            ours = m["step"]
            vs = f"torch's flash step {m['torch'] * 1e3:.1f} ms: {r['vs_torch']:.2f}x"
        else:
            ours = m["dropout"]
            vs = f"without dropout {m['forward'] * 1e3:.1f} ms: {r['dropout_speed']:.2f}x its speed"
        lines.append(f"{r['case']:14s} {r['threads']:3d} {ours * 1e3:9.1f} {r['gflops']:8.1f}  {vs}")
    return "\n".join(lines)
