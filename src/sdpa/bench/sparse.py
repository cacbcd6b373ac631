"""The sparse mode: ``python -m sdpa.bench --sparse``.

Times top-k sparse attention and its indexer against the dense work they stand
for, and against the machine's own limits measured in the same run:

- decode: (1, Hq 32, Hkv 8, L 1, S 131,072, E 128), k 2,048 positions shared
  by all heads, float32 and bfloat16 caches, against dense decoding over 2,048
  contiguous keys (the same bytes and flops), the same keys at each call (from the
  last-level cache) and the next 2,048 at each call ("from memory", as a
  model's layers read their caches).  Positions drawn uniformly
  ("random": every row anywhere in a 1 GiB cache) or as 32 runs of 64
  ("runs": block-wise selection, as NSA-style selectors make);
- MLA decode: 128 query heads over one latent head (E 576, Ev 512, bfloat16,
  the value a view of the key), S 131,072, k 2,048;
- prefill: (1, Hq 32, Hkv 8, L 1,024, S 65,536, E 128), k 2,048, float32; each
  block of 64 rows shares 1,536 positions and adds 512 of its own (as
  neighbouring rows of DeepSeek's sparse attention do), against a dense call
  over 2,048 keys: GFLOP/s of the products each row computes;
- the indexer: ``index_topk`` over S 131,072 keys (Hi 64, Ei 128, L 1), float8
  e4m3 keys with scales (and float32, bfloat16), against its roofline
  max(bytes / read bandwidth, 2 Hi Ei S / float32 FMA peak), the bandwidth
  and peak measured by the library's C probes at the same thread count.

``--quick`` divides S (and the prefill rows) by 16.  Implementations of a case
are timed in alternating rounds; rates are medians.
"""

from __future__ import annotations

import importlib.util
import statistics
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._api import scaled_dot_product_attention
from ..sparse import index_topk, sparse_attention
from .roofline import measure_limits
from .threads import SdpaThreads, threads_text
from .timing import Progress, alternating_loop_times

__all__ = ["SPARSE_CASES", "iter_sparse", "format_sparse_table"]

#: (name, what) of each case, in the order they run.
SPARSE_CASES: Tuple[Tuple[str, str], ...] = (
    ("decode-f32-random", "decode Hq32/8 S131072 E128 k2048 float32, uniform positions"),
    ("decode-f32-runs", "decode Hq32/8 S131072 E128 k2048 float32, 32 runs of 64"),
    ("decode-bf16-random", "decode Hq32/8 S131072 E128 k2048 bfloat16, uniform positions"),
    ("mla-decode", "MLA Hq128/1 S131072 E576/Ev512 k2048 bfloat16, V a view of K"),
    ("prefill-f32", "L1024 S65536 Hq32/8 E128 k2048 float32, 64-row blocks share 1536"),
    ("indexer-fp8", "index_topk Hi64 Ei128 S131072 k2048, float8_e4m3fn keys with scales"),
    ("indexer-f32", "index_topk Hi64 Ei128 S131072 k2048, float32 keys"),
    ("indexer-bf16", "index_topk Hi64 Ei128 S131072 k2048, bfloat16 keys"),
)

#: The sizes of the cases (``--quick``: S and L / 16, k / 4).
_SIZES = {"S": 131072, "k": 2048, "L": 1024}


def _ml(name: str) -> Any:
    import ml_dtypes  # noqa: PLC0415

    return np.dtype(getattr(ml_dtypes, name))


def case_available(name: str) -> bool:
    """The bfloat16, MLA and float8 cases need ml_dtypes."""
    plain = name in ("decode-f32-random", "decode-f32-runs", "prefill-f32", "indexer-f32")
    return plain or importlib.util.find_spec("ml_dtypes") is not None


def _positions(rng: np.random.Generator, S: int, k: int, runs: bool) -> np.ndarray:
    if runs:
        starts = rng.choice(S // 64, k // 64, replace=False) * 64
        return np.sort((starts[:, None] + np.arange(64)).reshape(-1))
    return np.sort(rng.choice(S, k, replace=False))


Case = Tuple[str, str, Dict[str, Callable[[], Any]], Dict[str, Any]]


class _Rotating:
    """Dense decoding over k contiguous keys, the next k of the cache at each
    call: keys and values that come from memory, as a model's layers read
    them, where the same k keys again would come from the last-level cache."""

    def __init__(self, q: np.ndarray, key: np.ndarray, value: np.ndarray, k: int) -> None:
        self.q, self.key, self.value, self.k, self.at = q, key, value, k, 0

    def __call__(self) -> Any:
        a = self.at
        self.at = (a + self.k) % (self.key.shape[2] // self.k * self.k)
        return scaled_dot_product_attention(self.q, self.key[:, :, a:a + self.k], self.value[:, :, a:a + self.k],
                                            enable_gqa=True)


def _cases(rng: np.random.Generator, quick: bool, names: Sequence[str]) -> Iterator[Case]:
    """(name, what, implementations, facts) of each case asked for; the first
    implementation is sdpa's sparse call."""
    what = dict(SPARSE_CASES)
    S = _SIZES["S"] // (16 if quick else 1)
    k = _SIZES["k"] // (4 if quick else 1)
    f32: Optional[Tuple[np.ndarray, np.ndarray]] = None
    for name in names:
        if name.startswith("decode"):
            if f32 is None:
                f32 = (rng.standard_normal((1, 8, S, 128), dtype=np.float32),
                       rng.standard_normal((1, 8, S, 128), dtype=np.float32))
            key, value = f32 if "f32" in name else (f32[0].astype(_ml("bfloat16")), f32[1].astype(_ml("bfloat16")))
            q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32).astype(key.dtype)
            idx = _positions(rng, S, k, name.endswith("runs"))[None, None, None, :]
            kd, vd = np.ascontiguousarray(key[:, :, :k]), np.ascontiguousarray(value[:, :, :k])
            impls: Dict[str, Callable[[], Any]] = {
                "sparse": partial(sparse_attention, q, key, value, idx),
                "dense": partial(scaled_dot_product_attention, q, kd, vd, enable_gqa=True),
                "dense-cold": _Rotating(q, key, value, k),
            }
            yield name, what[name], impls, {"bytes": kd.nbytes + vd.nbytes, "flops": 4.0 * 32 * k * 128}
        elif name == "mla-decode":
            f32 = None  # the float32 cache is no longer needed
            lat = rng.standard_normal((1, 1, S, 576), dtype=np.float32).astype(_ml("bfloat16"))
            q = rng.standard_normal((1, 128, 1, 576), dtype=np.float32).astype(lat.dtype)
            idx = _positions(rng, S, k, False)[None, None, None, :]
            ld = np.ascontiguousarray(lat[:, :, :k])
            impls = {
                "sparse": partial(sparse_attention, q, lat, lat[..., :512], idx, scale=0.1),
                "dense": partial(scaled_dot_product_attention, q, ld, ld[..., :512], scale=0.1, enable_gqa=True),
            }
            yield name, what[name], impls, {"bytes": ld.nbytes, "flops": 2.0 * 128 * k * (576 + 512)}
        elif name == "prefill-f32":
            f32 = None
            Sp, L = S // 2, _SIZES["L"] // (16 if quick else 1)
            key = rng.standard_normal((1, 8, Sp, 128), dtype=np.float32)
            value = rng.standard_normal((1, 8, Sp, 128), dtype=np.float32)
            q = rng.standard_normal((1, 32, L, 128), dtype=np.float32)
            idx = np.empty((1, 1, L, k), np.int64)
            share = k * 3 // 4
            for r0 in range(0, L, 64):
                common = rng.choice(Sp, share, replace=False)
                for r in range(r0, min(r0 + 64, L)):
                    idx[0, 0, r] = np.concatenate([common, rng.choice(Sp, k - share, replace=False)])
            kd, vd = np.ascontiguousarray(key[:, :, :k]), np.ascontiguousarray(value[:, :, :k])
            impls = {
                "sparse": partial(sparse_attention, q, key, value, idx),
                "dense": partial(scaled_dot_product_attention, q, kd, vd, enable_gqa=True),
            }
            yield name, what[name], impls, {"bytes": 0, "flops": 4.0 * 32 * L * k * 128}
        elif name.startswith("indexer"):
            f32 = None
            Hi, Ei = 64, 128
            kf = rng.standard_normal((S, Ei), dtype=np.float32)
            scale = None
            if name.endswith("fp8"):
                kx, scale = (kf / 8).astype(_ml("float8_e4m3fn")), np.full(S, 8.0, np.float32)
                per = Ei + 4
            elif name.endswith("bf16"):
                kx, per = kf.astype(_ml("bfloat16")), 2 * Ei
            else:
                kx, per = kf, 4 * Ei
            qi = rng.standard_normal((Hi, 1, Ei), dtype=np.float32)
            w = rng.random((1, Hi), dtype=np.float32)
            impls = {"sparse": partial(index_topk, qi, kx, w, k, k_scale=scale)}
            yield name, what[name], impls, {"bytes": S * per, "flops": 2.0 * Hi * Ei * S, "indexer": True}


def iter_sparse(
    threads: Sequence[int],
    *,
    min_time: float = 0.5,
    repeat: int = 5,
    seed: int = 0,
    quick: bool = False,
    cases: Optional[Sequence[str]] = None,
    progress: Optional[Progress] = None,
    limits: Optional[Dict[int, Dict[str, Any]]] = None,
) -> Iterator[Dict[str, Any]]:
    """One row per case and thread count: the median seconds per call of each
    implementation, sparse's speed against dense (dense time / sparse time:
    1 is parity, the target's 1.3x bound is 0.77), GFLOP/s, and for the
    indexer its roofline time and the share of it achieved (``limits``: those
    of :func:`~sdpa.bench.roofline.measure_limits` per thread count)."""
    names = [n for n, _ in SPARSE_CASES if case_available(n) and (cases is None or n in cases)]
    rng = np.random.default_rng(seed)
    for name, what, impls, facts in _cases(rng, quick, names):
        for n in threads:
            if progress:
                progress.show(f"sparse {name}, {threads_text(n)}")
            with SdpaThreads(n):
                times, _ = alternating_loop_times(impls, min_time, repeat)
            med = {i: statistics.median(t) for i, t in times.items()}
            row: Dict[str, Any] = {"case": name, "what": what, "threads": n, **facts, "median_s": med,
                                   "times_s": times, "gflops": facts["flops"] / med["sparse"] / 1e9}
            if "dense" in med:
                row["vs_dense"] = med["dense"] / med["sparse"]
                row["dense_gflops"] = facts["flops"] / med["dense"] / 1e9
            if "dense-cold" in med:
                row["vs_dense_cold"] = med["dense-cold"] / med["sparse"]
            if facts.get("indexer") and limits and n in limits:
                lim = limits[n]
                bytes_s = facts["bytes"] / (lim["read_gbps"] * 1e9)
                ops_s = facts["flops"] / (lim["fma_gops"] * 1e9)
                row.update(roofline_s=max(bytes_s, ops_s), bound="bytes" if bytes_s >= ops_s else "ops")
                row["of_roofline"] = row["roofline_s"] / med["sparse"]
            yield row
            if progress:
                progress.advance()


def format_sparse_table(rows: List[Dict[str, Any]]) -> str:
    """A text table: sparse ms, GFLOP/s, and against dense (dense time / sparse
    time) or, for the indexer, the roofline ms and the share achieved."""
    lines = [f"{'case':19s} {'thr':>3s} {'sparse ms':>10s} {'GFLOP/s':>8s}  against"]
    for r in rows:
        if "vs_dense" in r:
            vs = f"dense {r['median_s']['dense'] * 1e3:.2f} ms ({r['dense_gflops']:.0f} GFLOP/s): {r['vs_dense']:.2f}x"
            if "vs_dense_cold" in r:
                vs += f"; from memory {r['median_s']['dense-cold'] * 1e3:.2f} ms: {r['vs_dense_cold']:.2f}x"
        elif "roofline_s" in r:
            vs = f"roofline {r['roofline_s'] * 1e3:.2f} ms ({r['bound']}): {r['of_roofline']:.0%} of it"
        else:
            vs = ""
        lines.append(f"{r['case']:19s} {r['threads']:3d} {r['median_s']['sparse'] * 1e3:10.2f} "
                     f"{r['gflops']:8.1f}  {vs}")
    return "\n".join(lines)


def sparse_limits(threads: Sequence[int], bandwidth_mib: int, progress: Optional[Progress]) -> Dict[int, Any]:
    """The indexer's roofline limits (:func:`~sdpa.bench.roofline.measure_limits`)."""
    return measure_limits(threads, bandwidth_mib=bandwidth_mib, progress=progress)
