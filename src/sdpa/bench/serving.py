"""The serving mode: ``python -m sdpa.bench --serving``.

Serving is many small, ragged calls.  Each case times sdpa's one call against
the ways the same work is done otherwise, in alternating rounds
(:func:`~sdpa.bench.timing.alternating_loop_times`), and reports GFLOP/s
(the scores each row sees, causal ones counted once, times 2 (E + Ev)) or GB/s
of K/V, as ratios measured in the same run:

- dense: one (1, 16/4, 1024, 1024, 128) causal float32 call, the rate the
  varlen cases are held against;
- varlen-short / varlen-long: 256 packed sequences of U[8, 64] tokens and 64 of
  U[32, 512] (Hq 16, Hkv 4, E 128, causal), one call against one call per
  sequence;
- mixed: a paged batch of 4 sequences prefilling 256-token chunks onto
  1,024-4,096-token contexts and 60 decoding at 512-4,096 (Hq 32, Hkv 8,
  E 128, blocks of 16), one call (``query_start_loc``) against the same work as
  separate calls (one decode call and 4 chunk calls);
- chunks: the mixed batch's 4 chunks, paged in one call, against the same
  chunks as 4 calls on contiguous arrays;
- shared: 16 forks of an 8,192-token prompt plus 128 own tokens each, decoding
  in one call (the prompt's blocks read once), against the same call with the
  prompt's blocks copied under distinct ids for each fork;
- decode-SET-DTYPE-bsN: paged decoding (B 8, Hq 32 / Hkv 8, S 4,096, E 128)
  against the contiguous call, on each kernel set this CPU runs, float32 and
  bfloat16, blocks of 16 and 128.
"""

from __future__ import annotations

import importlib.util
import statistics
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from .._api import scaled_dot_product_attention
from ..paged import paged_attention
from ..varlen import varlen_attention
from .paged import _pool
from .peers.common import kernel_set
from .plan import mixed_batch
from .threads import SdpaThreads, threads_text
from .timing import Progress, alternating_loop_times

__all__ = ["SERVING_CASES", "iter_serving", "format_serving_table"]

#: (name, what) of the cases before the per-set decoding ones.
SERVING_CASES: Tuple[Tuple[str, str], ...] = (
    ("dense", "(1, 16/4, 1024, 1024, 128) causal float32"),
    ("varlen-short", "256 sequences of U[8, 64], Hq16/4 E128 causal: one call vs one per sequence"),
    ("varlen-long", "64 sequences of U[32, 512], Hq16/4 E128 causal: one call vs one per sequence"),
    ("mixed", "4 chunks of 256 onto 1-4K + 60 decodes at 512-4K, Hq32/8 E128 bs16: one call vs 5"),
    ("chunks", "the mixed batch's 4 chunks, paged in one call vs 4 calls on contiguous arrays"),
    ("shared", "16 forks of an 8192 prompt + 128 each, Hq32/8 E128 bs16: prompt read once vs copied ids"),
)

#: --quick: shorter sequences, fewer of them
_QUICK = {"varlen": 4, "context": 4, "prompt": 8, "decode": 8}


def causal_pairs(L: int, S: int) -> int:
    """Scores a bottom-right causal (L, S) problem keeps."""
    return L * (S - L) + L * (L + 1) // 2 if S >= L else L * (L + 1) // 2 - (L - S) * (L - S + 1) // 2


def _bf16() -> Optional[np.dtype]:
    if importlib.util.find_spec("ml_dtypes") is None:
        return None
    import ml_dtypes  # noqa: PLC0415

    return np.dtype(ml_dtypes.bfloat16)


Case = Tuple[str, str, Dict[str, Callable[[], Any]], Dict[str, Any], Optional[str]]


def _varlen_case(rng: np.random.Generator, name: str, what: str, n: int, lo: int, hi: int) -> Case:
    lens = rng.integers(lo, hi + 1, n)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q = rng.standard_normal((T, 16, 128), dtype=np.float32)
    k = rng.standard_normal((T, 4, 128), dtype=np.float32)
    v = rng.standard_normal((T, 4, 128), dtype=np.float32)
    out = np.empty_like(q)

    def per_sequence() -> None:
        for i in range(n):
            a, z = int(cu[i]), int(cu[i + 1])
            scaled_dot_product_attention(q[a:z].transpose(1, 0, 2), k[a:z].transpose(1, 0, 2),
                                         v[a:z].transpose(1, 0, 2), is_causal=True, enable_gqa=True,
                                         out=out[a:z].transpose(1, 0, 2))

    impls: Dict[str, Callable[[], Any]] = {
        "sdpa": partial(varlen_attention, q, k, v, cu, cu, is_causal=True, out=out), "per-sequence": per_sequence}
    flops = sum(16 * causal_pairs(int(L), int(L)) * 2 * 256 for L in lens)
    return name, what, impls, {"flops": flops}, None


def _cases(rng: np.random.Generator, quick: bool) -> Iterator[Case]:
    f = _QUICK if quick else {"varlen": 1, "context": 1, "prompt": 1, "decode": 1}
    q = rng.standard_normal((1, 16, 1024 // f["context"], 128), dtype=np.float32)
    k = rng.standard_normal((1, 4, 1024 // f["context"], 128), dtype=np.float32)
    out = np.empty_like(q)
    L = q.shape[2]
    yield (SERVING_CASES[0][0], SERVING_CASES[0][1],
           {"sdpa": partial(scaled_dot_product_attention, q, k, k, is_causal=True, enable_gqa=True, out=out)},
           {"flops": 16 * causal_pairs(L, L) * 2 * 256}, None)
    yield _varlen_case(rng, *SERVING_CASES[1], 256 // f["varlen"], 8, 64)
    yield _varlen_case(rng, *SERVING_CASES[2], 64 // f["varlen"], 32, 512)

    # the mixed batch: 4 chunks of 256 rows and 60 decodes, over one pool
    lens, rows = mixed_batch(rng)
    lens = [max(n // f["context"], r) for n, r in zip(lens, rows)]
    bs, hkv, hq, e = 16, 8, 32, 128
    kc, vc, bt, sl, kd, vd = _pool(rng, len(lens), max(lens), bs, hkv, e, e, np.dtype(np.float32))
    sl = np.array(lens, np.int64)
    qsl = np.concatenate([[0], np.cumsum(rows)])
    qp = rng.standard_normal((int(qsl[-1]), hq, e), dtype=np.float32)
    outp = np.empty_like(qp)
    nc = 4
    chunk_q = [qp[qsl[b] : qsl[b + 1]].transpose(1, 0, 2)[None] for b in range(nc)]
    decode_q = np.ascontiguousarray(qp[qsl[nc] :].reshape(len(lens) - nc, 1, hq, e).transpose(0, 2, 1, 3))

    def separate() -> None:
        paged_attention(decode_q, kc, vc, bt[nc:], sl[nc:])
        for b in range(nc):
            paged_attention(chunk_q[b], kc, vc, bt[b : b + 1], sl[b : b + 1])

    chunk_pairs = sum(causal_pairs(rows[b], lens[b]) for b in range(nc))
    pairs = chunk_pairs + sum(lens[nc:])
    yield (SERVING_CASES[3][0], SERVING_CASES[3][1],
           {"sdpa": partial(paged_attention, qp, kc, vc, bt, sl, query_start_loc=qsl, out=outp), "separate": separate},
           {"flops": hq * pairs * 2 * 2 * e}, None)

    chunk_k = [kd[b : b + 1, :, : lens[b]] for b in range(nc)]
    chunk_v = [vd[b : b + 1, :, : lens[b]] for b in range(nc)]

    def contiguous() -> None:
        for b in range(nc):
            scaled_dot_product_attention(chunk_q[b], chunk_k[b], chunk_v[b], is_causal="bottom_right", enable_gqa=True)

    qc = np.ascontiguousarray(qp[: qsl[nc]])
    yield (SERVING_CASES[4][0], SERVING_CASES[4][1],
           {"sdpa": partial(paged_attention, qc, kc, vc, bt[:nc], sl[:nc], query_start_loc=qsl[: nc + 1]),
            "contiguous": contiguous},
           {"flops": hq * chunk_pairs * 2 * 2 * e}, None)

    # shared prefix: 16 forks of one prompt, then 128 own tokens each
    P, own, n = 8192 // f["prompt"], 128, 16
    kp, vp, btp, _, _, _ = _pool(rng, 1, P, bs, hkv, e, e, np.dtype(np.float32))
    ko, vo, bto, _, _, _ = _pool(rng, n, own, bs, hkv, e, e, np.dtype(np.float32))
    kcs, vcs = np.concatenate([kp, ko]), np.concatenate([vp, vo])
    shared = np.concatenate([np.repeat(btp, n, axis=0), bto + kp.shape[0]], axis=1).astype(np.int32)
    kcd = np.concatenate([np.tile(kp, (n, 1, 1, 1)), ko])
    vcd = np.concatenate([np.tile(vp, (n, 1, 1, 1)), vo])
    dup = shared.copy()
    per = btp.shape[1]
    for b in range(n):
        dup[b, :per] = btp[0] + b * kp.shape[0]
    dup[:, per:] = bto + n * kp.shape[0]
    sls = np.full(n, P + own, np.int64)
    qs = rng.standard_normal((n, hq, 1, e), dtype=np.float32)
    yield (SERVING_CASES[5][0], SERVING_CASES[5][1],
           {"sdpa": partial(paged_attention, qs, kcs, vcs, shared, sls),
            "copied-ids": partial(paged_attention, qs, kcd, vcd, dup, sls)},
           {"flops": hq * n * (P + own) * 2 * 2 * e, "kv_bytes": (kp.nbytes + vp.nbytes) + (ko.nbytes + vo.nbytes)},
           None)

    # paged decoding against the contiguous call, on every kernel set
    S = 4096 // f["decode"]
    bf16 = _bf16()
    for isa in _core.isas_supported():
        for dt in [np.dtype(np.float32)] + ([bf16] if bf16 is not None else []):
            for bsz in (16, 128):
                kc2, vc2, bt2, sl2, k2, v2 = _pool(rng, 8, S, bsz, hkv, e, e, dt)
                q2 = rng.standard_normal((8, hq, 1, e), dtype=np.float32).astype(dt)
                name = f"decode-{isa}-{'f32' if dt == np.float32 else 'bf16'}-bs{bsz}"
                yield (name, f"decode B8 Hq32/8 S{S} E128 {dt}, blocks of {bsz}, kernel set {isa}",
                       {"sdpa": partial(paged_attention, q2, kc2, vc2, bt2, sl2),
                        "contiguous": partial(scaled_dot_product_attention, q2, k2, v2, enable_gqa=True,
                                              key_lengths=sl2)},
                       {"flops": 8 * hq * S * 2 * 2 * e, "kv_bytes": k2.nbytes + v2.nbytes}, isa)


def iter_serving(
    threads: Sequence[int], *, min_time: float = 0.5, repeat: int = 5, seed: int = 0, quick: bool = False,
    progress: Optional[Progress] = None, cases: Sequence[str] = (),
) -> Iterator[Dict[str, Any]]:
    """One row per case and thread count: per implementation the median seconds
    per call; sdpa's GFLOP/s (and GB/s of K/V where it reads a cache), and the
    speed of sdpa against each other implementation (their time / sdpa's)."""
    rng = np.random.default_rng(seed)
    for name, what, impls, facts, isa in _cases(rng, quick):
        if cases and not any(name == c or name.startswith(c + "-") for c in cases):
            continue
        for n in threads:
            if progress:
                progress.show(f"serving {name}, {threads_text(n)}")
            with SdpaThreads(n), (kernel_set(isa) if isa else _nothing()):
                times, _ = alternating_loop_times(impls, min_time, repeat)
            med = {k: statistics.median(v) for k, v in times.items()}
            row: Dict[str, Any] = {"case": name, "what": what, "threads": n, "isa": isa or _core.isa(), **facts,
                                   "median_s": med, "times_s": times,
                                   "gflops": facts["flops"] / med["sdpa"] / 1e9,
                                   "speed": {k: med[k] / med["sdpa"] for k in med if k != "sdpa"}}
            if "kv_bytes" in facts:
                row["gbps"] = facts["kv_bytes"] / med["sdpa"] / 1e9
            yield row
            if progress:
                progress.advance()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def case_count(quick: bool = False) -> int:
    """How many cases :func:`iter_serving` runs on this machine (for the progress bar)."""
    sets = len(_core.isas_supported())
    return len(SERVING_CASES) + sets * (2 if _bf16() is not None else 1) * 2


def format_serving_table(rows: List[Dict[str, Any]]) -> str:
    """Time, GFLOP/s, the rate against the dense call of the same thread count
    (varlen), GB/s of K/V, and the speed against the other ways."""
    dense = {r["threads"]: r["gflops"] for r in rows if r["case"] == "dense"}
    lines = [f"{'case':26s} {'thr':>3s} {'sdpa us':>10s} {'GFLOP/s':>8s} {'of dense':>8s} {'GB/s':>7s}  against"]
    for r in rows:
        of = f"{r['gflops'] / dense[r['threads']]:8.2f}" if r["case"].startswith("varlen") and r["threads"] in dense \
            else f"{'':8s}"
        gbps = f"{r['gbps']:7.1f}" if "gbps" in r else f"{'':7s}"
        vs = ", ".join(f"{k} {v:.2f}x" for k, v in r["speed"].items())
        lines.append(f"{r['case']:26s} {r['threads']:3d} {r['median_s']['sdpa'] * 1e6:10.0f} {r['gflops']:8.1f} "
                     f"{of} {gbps}  {vs}")
    return "\n".join(lines)
