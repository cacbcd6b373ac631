"""The paged mode: ``python -m sdpa.bench --paged``.

Times :func:`sdpa.paged_attention` over block-table caches against the same
call on contiguous arrays, and against torch's SDPA over the gathered K/V:

- decode: B = 8 sequences of 4,096 positions, Hq 32 / Hkv 8, E 128, one query
  row each, blocks of 16 and of 128, float32 and bfloat16;
- prefill: a chunk of L = 512 queries into a 4,096-position context (the chunk's
  own positions included, bottom-right causal), blocks of 16;
- shared prefix: 16 sequences that fork one 8,192-token prompt and add 128
  tokens each, decoded together, against the same call with the prompt's blocks
  copied under distinct ids for each sequence;
- MLA: DeepSeek-style absorbed decoding, 128 query heads over one latent head of
  8,192 positions, E 576 / Ev 512, bfloat16, V a view of the latent's first 512
  columns: GB/s counting the latent once, against the machine's read bandwidth.

Each case's implementations are timed in alternating rounds
(:func:`~sdpa.bench.timing.alternating_loop_times`); rates are per call medians.
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._api import scaled_dot_product_attention
from ..paged import paged_attention
from .threads import SdpaThreads, TorchThreads, threads_text
from .timing import Progress, alternating_loop_times

__all__ = ["PAGED_CASES", "case_available", "iter_paged", "format_paged_table"]

#: (name, what) of each case, in the order they run.
PAGED_CASES: Tuple[Tuple[str, str], ...] = (
    ("decode-f32-bs16", "decode B8 Hq32/8 S4096 E128 float32, blocks of 16"),
    ("decode-f32-bs128", "decode B8 Hq32/8 S4096 E128 float32, blocks of 128"),
    ("decode-bf16-bs16", "decode B8 Hq32/8 S4096 E128 bfloat16, blocks of 16"),
    ("decode-bf16-bs128", "decode B8 Hq32/8 S4096 E128 bfloat16, blocks of 128"),
    ("prefill-f32-bs16", "chunk L512 into S4096, Hq32/8 E128 float32, blocks of 16"),
    ("shared-prefix", "16 forks of an 8192 prompt + 128 each, Hq32/8 E128 float32, blocks of 16"),
    ("mla-decode", "MLA Hq128/1 S8192 E576/Ev512 bfloat16, V a view of K, blocks of 64"),
)

#: --quick: shorter sequences (the prefill chunk is half the context, at most 512)
_QUICK = {"decode": 512, "prefill": 1024, "prefix": 1024, "mla": 1024}


def case_available(name: str) -> bool:
    """Whether this machine's Python can run the case: the bfloat16 ones need ml_dtypes."""
    return not ("bf16" in name or name.startswith("mla")) or importlib.util.find_spec("ml_dtypes") is not None


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _pool(rng: np.random.Generator, B: int, S: int, bs: int, Hkv: int, E: int, Ev: int, dt: np.dtype
          ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Paged caches holding B sequences of S positions in shuffled blocks, the
    tables, the lengths, and the same keys and values as contiguous arrays."""
    per = -(-S // bs)
    k = rng.standard_normal((B, Hkv, per * bs, E), dtype=np.float32).astype(dt)
    v = rng.standard_normal((B, Hkv, per * bs, Ev), dtype=np.float32).astype(dt)
    order = rng.permutation(B * per)
    kc = np.empty((B * per, Hkv, bs, E), dt)
    vc = np.empty((B * per, Hkv, bs, Ev), dt)
    bt = order.reshape(B, per).astype(np.int32)
    kc[bt.reshape(-1)] = k.reshape(B, Hkv, per, bs, E).transpose(0, 2, 1, 3, 4).reshape(-1, Hkv, bs, E)
    vc[bt.reshape(-1)] = v.reshape(B, Hkv, per, bs, Ev).transpose(0, 2, 1, 3, 4).reshape(-1, Hkv, bs, Ev)
    return kc, vc, bt, np.full(B, S, np.int64), k[:, :, :S], v[:, :, :S]


def _torch_sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> Optional[Callable[[], Any]]:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None

    def tensor(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    tq, tk, tv = tensor(q), tensor(k), tensor(v)
    L, S = q.shape[2], k.shape[2]
    mask = None
    if causal and L > 1:  # bottom-right
        mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    f = torch.nn.functional.scaled_dot_product_attention
    return lambda: f(tq, tk, tv, attn_mask=mask, enable_gqa=True)


Case = Tuple[str, str, Dict[str, Callable[[], Any]], Dict[str, Any]]


def _cases(rng: np.random.Generator, quick: bool) -> Iterator[Case]:
    """(name, what, implementations, facts) of each case; the first implementation is paged sdpa."""
    impls: Dict[str, Callable[[], Any]]
    S = _QUICK["decode"] if quick else 4096
    for name, what in PAGED_CASES[:4]:
        if not case_available(name):
            continue
        dt = _dtype("float32" if "f32" in name else "bfloat16")
        bs = 16 if name.endswith("bs16") else 128
        kc, vc, bt, sl, k, v = _pool(rng, 8, S, bs, 8, 128, 128, dt)
        q = rng.standard_normal((8, 32, 1, 128), dtype=np.float32).astype(dt)
        impls = {
            "paged": partial(paged_attention, q, kc, vc, bt, sl),
            "contiguous": partial(scaled_dot_product_attention, q, k, v, enable_gqa=True, key_lengths=sl),
        }
        t = _torch_sdpa(q, k, v, False)
        if t is not None:
            impls["torch"] = t
        yield name, what, impls, {"kv_bytes": k.nbytes + v.nbytes, "flops": 4.0 * 8 * 32 * S * 128}

    Sp = _QUICK["prefill"] if quick else 4096
    Lp = min(512, Sp // 2)
    kc, vc, bt, sl, k, v = _pool(rng, 1, Sp, 16, 8, 128, 128, np.dtype(np.float32))
    q = rng.standard_normal((1, 32, Lp, 128), dtype=np.float32)
    impls = {
        "paged": lambda: paged_attention(q, kc, vc, bt, sl),
        "contiguous": lambda: scaled_dot_product_attention(q, k, v, is_causal="bottom_right", enable_gqa=True),
    }
    t = _torch_sdpa(q, k, v, True)
    if t is not None:
        impls["torch"] = t
    kept = Lp * (Sp - Lp) + Lp * (Lp + 1) / 2
    yield PAGED_CASES[4][0], PAGED_CASES[4][1], impls, {"kv_bytes": k.nbytes + v.nbytes,
                                                        "flops": 4.0 * 32 * kept * 128}

    P = _QUICK["prefix"] if quick else 8192
    n, own, bs = 16, 128, 16
    kp, vp, btp, _, _, _ = _pool(rng, 1, P, bs, 8, 128, 128, np.dtype(np.float32))
    ko, vo, bto, _, _, _ = _pool(rng, n, own, bs, 8, 128, 128, np.dtype(np.float32))
    kc = np.concatenate([kp, ko])
    vc = np.concatenate([vp, vo])
    shared = np.concatenate([np.repeat(btp, n, axis=0), bto + kp.shape[0]], axis=1).astype(np.int32)
    # the same keys under distinct ids: the prompt's blocks copied once per sequence
    kd = np.concatenate([np.tile(kp, (n, 1, 1, 1)), ko])
    vd = np.concatenate([np.tile(vp, (n, 1, 1, 1)), vo])
    dup = shared.copy()
    dup[:, : btp.shape[1]] = btp + kp.shape[0] * np.arange(n)[:, None]
    dup[:, btp.shape[1]:] += (n - 1) * kp.shape[0]
    sl = np.full(n, P + own, np.int64)
    q = rng.standard_normal((n, 32, 1, 128), dtype=np.float32)
    impls = {
        "paged": lambda: paged_attention(q, kc, vc, shared, sl),
        "duplicated": lambda: paged_attention(q, kd, vd, dup, sl),
    }
    yield PAGED_CASES[5][0], PAGED_CASES[5][1], impls, {
        "kv_bytes": (P + n * own) * 8 * 128 * 4 * 2, "flops": 4.0 * n * 32 * (P + own) * 128}

    if not case_available(PAGED_CASES[6][0]):
        return
    Sm = _QUICK["mla"] if quick else 8192
    bf16 = _dtype("bfloat16")
    latent, _, btm, slm, lat, _ = _pool(rng, 1, Sm, 64, 1, 576, 1, bf16)
    q = rng.standard_normal((1, 128, 1, 576), dtype=np.float32).astype(bf16)
    impls = {
        "paged": lambda: paged_attention(q, latent, latent[..., :512], btm, slm, scale=0.1),
        "contiguous": lambda: scaled_dot_product_attention(q, lat, lat[..., :512], scale=0.1, enable_gqa=True),
    }
    yield PAGED_CASES[6][0], PAGED_CASES[6][1], impls, {"kv_bytes": lat.nbytes,
                                                        "flops": 2.0 * 128 * Sm * (576 + 512)}


def iter_paged(
    threads: Sequence[int],
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    seed: int = 0,
    quick: bool = False,
    progress: Optional[Progress] = None,
) -> Iterator[Dict[str, Any]]:
    """One row per case and thread count: per implementation the median seconds
    per call, GB/s of the K/V each call reads (the latent once for MLA; the
    shared prompt once for the shared-prefix case, both implementations), and
    GFLOP/s."""
    rng = np.random.default_rng(seed)
    try:  # by name: the module is optional, and mypy types it Any either way
        torch: Any = importlib.import_module("torch")
    except ImportError:
        torch = None
    for name, what, impls, facts in _cases(rng, quick):
        for n in threads:
            if progress:
                progress.show(f"paged {name}, {threads_text(n)}")
            with SdpaThreads(n):
                if torch is not None:
                    with TorchThreads(torch, n):
                        times, _ = alternating_loop_times(impls, min_time, repeat)
                else:
                    times, _ = alternating_loop_times(impls, min_time, repeat)
            med = {k: statistics.median(v) for k, v in times.items()}
            row: Dict[str, Any] = {"case": name, "what": what, "threads": n, **facts,
                                   "median_s": med, "times_s": times}
            row["gbps"] = facts["kv_bytes"] / med["paged"] / 1e9
            row["gflops"] = facts["flops"] / med["paged"] / 1e9
            row["speed"] = {k: med[k] / med["paged"] for k in med if k != "paged"}
            yield row
            if progress:
                progress.advance()


def format_paged_table(rows: List[Dict[str, Any]], bandwidth: Dict[int, float]) -> str:
    """A text table: time, GB/s (and the share of read bandwidth), GFLOP/s, and the
    speed of paged sdpa against each other implementation (other time / paged time)."""
    lines = [f"{'case':18s} {'thr':>3s} {'paged us':>10s} {'GB/s':>7s} {'of bw':>6s} {'GFLOP/s':>8s}  against"]
    for r in rows:
        bw = bandwidth.get(r["threads"])
        share = f"{r['gbps'] / bw:6.0%}" if bw else f"{'':6s}"
        vs = ", ".join(f"{k} {v:.2f}x" for k, v in r["speed"].items())
        lines.append(f"{r['case']:18s} {r['threads']:3d} {r['median_s']['paged'] * 1e6:10.0f} "
                     f"{r['gbps']:7.1f} {share} {r['gflops']:8.1f}  {vs}")
    return "\n".join(lines)
