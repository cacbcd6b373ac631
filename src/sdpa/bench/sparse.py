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
  and peak measured by the library's C probes at the same thread count;
- block-sparse prefill: (1, 16, 8,192, 8,192, 64) float32 and bfloat16, a
  :class:`~sdpa.BlockMask` of 128 x 128 blocks: 10% of them (random, full)
  and all of them against the dense call, a causal map (full below the
  diagonal, partial on it) with ``is_causal`` against ``is_causal`` alone;
- ``sdpa.torch.flex_attention`` against torch's ``flex_attention`` compiled
  (``torch.compile``, as its docs recommend) on one BlockMask: a causal
  document mask of 4 documents in 8,192 tokens, float32 and bfloat16;
- key scores: the decoding step of decode-gqa-32k (1, 32/8, S 32,768, E 128,
  float32) with ``return_key_scores`` against without, and (1, 16, 4,096,
  4,096, 64) causal prefill with ``key_scores_window=64`` against without.

``--quick`` divides S (and the prefill rows) by 16, the block-sparse, flex and
key-score sizes by 4.  Implementations of a case
are timed in alternating rounds; rates are medians.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._api import scaled_dot_product_attention
from ..sparse import index_topk, sparse_attention
from .roofline import measure_limits
from .threads import SdpaThreads, TorchThreads, threads_text
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
    ("blocks-f32-10", "L=S 8192 H16 E64 float32, 10% of 128x128 blocks, against dense"),
    ("blocks-f32-100", "L=S 8192 H16 E64 float32, every block full, against dense"),
    ("blocks-f32-causal", "L=S 8192 H16 E64 float32, a causal map with is_causal, against is_causal"),
    ("blocks-bf16-10", "L=S 8192 H16 E64 bfloat16, 10% of 128x128 blocks, against dense"),
    ("blocks-bf16-100", "L=S 8192 H16 E64 bfloat16, every block full, against dense"),
    ("blocks-bf16-causal", "L=S 8192 H16 E64 bfloat16, a causal map with is_causal, against is_causal"),
    ("flex-doc-f32", "flex_attention L 8192 H16 E64 float32, causal documents of 2048, against torch compiled"),
    ("flex-doc-bf16", "flex_attention L 8192 H16 E64 bfloat16, causal documents of 2048, against torch compiled"),
    ("scores-decode", "decode Hq32/8 S32768 E128 float32 with key scores, against without"),
    ("scores-prefill", "L=S 4096 H16 E64 float32 causal, key scores of the last 64 rows, against without"),
)

#: The sequence length of the block-sparse and flex cases, the keys of the
#: key-score decoding step and the rows of its prefill (``--quick``: / 4).
_BLOCK_L, _FLEX_L = 8192, 8192
_SCORES = {"S": 32768, "L": 4096}

#: The sizes of the cases (``--quick``: S and L / 16, k / 4).
_SIZES = {"S": 131072, "k": 2048, "L": 1024}


def _ml(name: str) -> Any:
    import ml_dtypes  # noqa: PLC0415

    return np.dtype(getattr(ml_dtypes, name))


def case_available(name: str) -> bool:
    """The bfloat16, MLA and float8 cases need ml_dtypes, the flex cases torch."""
    if name.startswith("flex") and importlib.util.find_spec("torch") is None:
        return False
    plain = name in ("decode-f32-random", "decode-f32-runs", "prefill-f32", "indexer-f32") or (
        "f32" in name and not name.startswith("flex")) or name.startswith("scores")
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
        elif name.startswith("blocks"):
            f32 = None
            yield _block_case(rng, name, what[name], _BLOCK_L // (4 if quick else 1))
        elif name.startswith("flex"):
            f32 = None
            yield _flex_case(rng, name, what[name], _FLEX_L // (4 if quick else 1))
        elif name.startswith("scores"):
            f32 = None
            yield _scores_case(rng, name, what[name], quick)


def _block_case(rng: np.random.Generator, name: str, what: str, L: int) -> Case:
    """A block-sparse case: the map's call, and the dense (or causal) call."""
    from ..blockmask import BlockMask  # noqa: PLC0415

    dt = np.dtype(np.float32) if "f32" in name else _ml("bfloat16")
    q, k, v = (rng.standard_normal((1, 16, L, 64), dtype=np.float32).astype(dt) for _ in range(3))
    nb = L // 128
    causal = name.endswith("causal")
    if causal:
        bm = BlockMask.from_dense(np.tril(np.ones((L, L), bool)), (128, 128))
        blocks = float((bm.states == 2).sum() + 0.5 * (bm.states == 1).sum()) * 16
    else:
        share = 0.1 if name.endswith("-10") else 1.0
        states = (rng.random((1, 16, nb, nb)) < share).astype(np.int8) * 2
        bm = BlockMask.from_states(states, (128, 128))
        blocks = float(states.astype(bool).sum())
    impls: Dict[str, Callable[[], Any]] = {
        "sparse": partial(scaled_dot_product_attention, q, k, v, is_causal=causal, block_mask=bm),
        "dense": partial(scaled_dot_product_attention, q, k, v, is_causal=causal),
    }
    dense = 4.0 * 64 * L * L * 16 / (2 if causal else 1)
    return name, what, impls, {"bytes": 0, "flops": 4.0 * 64 * 128 * 128 * blocks, "dense_flops": dense}


def _flex_case(rng: np.random.Generator, name: str, what: str, L: int) -> Case:
    """sdpa.torch.flex_attention against torch's, compiled, on one BlockMask."""
    import torch  # noqa: PLC0415
    from torch.nn.attention import flex_attention as flex  # noqa: PLC0415

    from .. import torch as sdpa_torch  # noqa: PLC0415

    dt = torch.float32 if name.endswith("f32") else torch.bfloat16
    docs = torch.arange(L) // (L // 4)

    def doc_causal(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (docs[qi] == docs[kv]) & (qi >= kv)

    bm = flex.create_block_mask(doc_causal, None, None, L, L, device="cpu")
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(1, 16, L, 64, generator=gen).to(dt) for _ in range(3))
    compiled = torch.compile(flex.flex_attention)
    compiled(q, k, v, block_mask=bm)  # compiled before it is timed
    sdpa_torch.flex_attention(q, k, v, block_mask=bm)  # the mask evaluated once, kept with the BlockMask
    impls: Dict[str, Callable[[], Any]] = {
        "sparse": partial(sdpa_torch.flex_attention, q, k, v, block_mask=bm),
        "torch": partial(compiled, q, k, v, block_mask=bm),
    }
    per_doc = L // 4 // 128
    blocks = 4 * (per_doc * (per_doc - 1) / 2 + per_doc / 2) * 16
    return name, what, impls, {"bytes": 0, "flops": 4.0 * 64 * 128 * 128 * blocks}


def _scores_case(rng: np.random.Generator, name: str, what: str, quick: bool) -> Case:
    """A call with key scores against the same call without."""
    if name == "scores-decode":
        S = _SCORES["S"] // (4 if quick else 1)
        q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
        k, v = (rng.standard_normal((1, 8, S, 128), dtype=np.float32) for _ in range(2))
        kw: Dict[str, Any] = dict(enable_gqa=True)
        facts = {"bytes": k.nbytes + v.nbytes, "flops": 4.0 * 32 * S * 128}
        window = None
    else:
        L = _SCORES["L"] // (4 if quick else 1)
        q, k, v = (rng.standard_normal((1, 16, L, 64), dtype=np.float32) for _ in range(3))
        kw = dict(is_causal=True)
        facts = {"bytes": 0, "flops": 4.0 * 16 * L * L / 2 * 64}
        window = 64
    impls: Dict[str, Callable[[], Any]] = {
        "sparse": partial(scaled_dot_product_attention, q, k, v, return_key_scores=True, key_scores_window=window,
                          **kw),
        "dense": partial(scaled_dot_product_attention, q, k, v, **kw),
    }
    return name, what, impls, {**facts, "overhead": True}


def _torch_threads(n: int, on: bool) -> Any:
    """torch's threads set to n where a case times torch, else nothing."""
    if not on:
        return contextlib.nullcontext()
    import torch  # noqa: PLC0415

    return TorchThreads(torch, n)


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
            with SdpaThreads(n), _torch_threads(n, "torch" in impls):
                times, _ = alternating_loop_times(impls, min_time, repeat)
            med = {i: statistics.median(t) for i, t in times.items()}
            row: Dict[str, Any] = {"case": name, "what": what, "threads": n, **facts, "median_s": med,
                                   "times_s": times, "gflops": facts["flops"] / med["sparse"] / 1e9}
            if "dense" in med:
                row["vs_dense"] = med["dense"] / med["sparse"]
                dense_flops = facts["dense_flops"] if "dense_flops" in facts else facts["flops"]
                row["dense_gflops"] = dense_flops / med["dense"] / 1e9
            if "torch" in med:
                row["vs_torch"] = med["torch"] / med["sparse"]
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
        if r.get("overhead"):
            vs = (f"without them {r['median_s']['dense'] * 1e3:.2f} ms: "
                  f"{100 * (1 / r['vs_dense'] - 1):+.1f}% to ask for them")
        elif "vs_dense" in r:
            vs = f"dense {r['median_s']['dense'] * 1e3:.2f} ms ({r['dense_gflops']:.0f} GFLOP/s): {r['vs_dense']:.2f}x"
            if "vs_dense_cold" in r:
                vs += f"; from memory {r['median_s']['dense-cold'] * 1e3:.2f} ms: {r['vs_dense_cold']:.2f}x"
        elif "vs_torch" in r:
            vs = f"torch compiled {r['median_s']['torch'] * 1e3:.2f} ms: {r['vs_torch']:.2f}x"
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
