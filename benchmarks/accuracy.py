"""Accuracy of float32 (and float64) results against the float64 reference.

    python benchmarks/accuracy.py                  # the table in docs/guarantees.md
    python benchmarks/accuracy.py --sizes 128 1024 --rows 512 --markdown

Inputs are standard normal, drawn in float32 (so the reference sees exactly the
same numbers), shape (1, 1, L, E) with S = L keys.  The reference
(``sdpa.reference``, float64) builds the whole L x S score matrix, so for large L
it is computed on a sample of query rows only (the first, the last and random
ones; a causal mask is cut to those rows): each output row depends on its own
query row alone, so the sample is exact for the rows it covers.

A second table covers decoding (L = 1, one query row against S keys), which runs
the row path: keys in chunks of 1024, partial results merged at the end.

With ``--half``, a third table: bfloat16 and float16 inputs (the same normal
values rounded to 16 bits), sdpa's error and PyTorch's own error in that dtype
against the float64 reference on the rounded values, per shape.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import sdpa

reference = sdpa.reference.scaled_dot_product_attention


def errors(out: np.ndarray, expected: np.ndarray):
    diff = np.abs(out.astype(np.float64) - expected)
    rel = diff / np.maximum(np.abs(expected), 1e-30)
    return float(diff.max()), float(diff.mean()), float(np.median(rel))


def sample_rows(rng, L: int, n: int) -> np.ndarray:
    if L <= n:
        return np.arange(L)
    rows = rng.choice(np.arange(1, L - 1), size=n - 2, replace=False)
    return np.sort(np.concatenate([[0, L - 1], rows]))


def square_case(rng, L: int, E: int, causal: bool, max_rows: int, threads):
    q, k, v = (rng.standard_normal((1, 1, L, E)).astype(np.float32) for _ in range(3))
    t0 = time.perf_counter()
    out32 = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, num_threads=threads)
    seconds = time.perf_counter() - t0
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out64 = sdpa.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, num_threads=threads)
    rows = sample_rows(rng, L, max_rows)
    mask = sdpa.reference.causal_mask(L, L)[rows] if causal else None
    expected = reference(q[:, :, rows], k, v, mask)
    return dict(
        L=L, causal=causal, rows=len(rows), seconds=seconds,
        f32=errors(out32[:, :, rows], expected), f64=errors(out64[:, :, rows], expected),
    )


def decode_case(rng, S: int, E: int, threads):
    q = rng.standard_normal((1, 2, 1, E)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, E)).astype(np.float32) for _ in range(2))
    out32 = sdpa.scaled_dot_product_attention(q, k, v, num_threads=threads)
    out64 = sdpa.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), num_threads=threads
    )
    heads = [reference(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1]) for h in range(q.shape[1])]
    expected = np.concatenate(heads, axis=1)
    return dict(S=S, f32=errors(out32, expected), f64=errors(out64, expected))


HALF_CASES = [  # (name, L, S, E, causal, mask)
    ("1k", 1024, 1024, 64, False, None),
    ("2k causal E=128", 2048, 2048, 128, True, None),
    ("E=80, bool mask", 512, 512, 80, False, "bool"),
    ("E=96, float mask", 512, 700, 96, False, "float"),
    ("E=256 causal", 256, 256, 256, True, None),
    ("decode S=4096", 1, 4096, 128, False, None),
]


def half_case(rng, dtype, L: int, S: int, E: int, causal: bool, mask_kind, max_rows: int, threads):
    """sdpa's and torch's max abs error in ``dtype`` (None without torch)."""
    q = rng.standard_normal((1, 4, L, E)).astype(dtype)
    k, v = (rng.standard_normal((1, 4, S, E)).astype(dtype) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = rng.random((L, S)) < 0.7
        mask[:, 0] = True
    elif mask_kind == "float":
        mask = np.where(rng.random((L, S)) < 0.3, -np.inf, rng.standard_normal((L, S))).astype(np.float32)
        mask[:, 0] = 0
    ours = sdpa.scaled_dot_product_attention(q, k, v, mask, causal, num_threads=threads)
    rows = sample_rows(rng, L, max_rows)
    rmask = None if mask is None else mask[rows]
    if causal:
        cm = sdpa.reference.causal_mask(L, S)[rows]
        rmask = cm if rmask is None else (rmask & cm if rmask.dtype == bool else np.where(cm, rmask, -np.inf))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    expected = reference(q64[:, :, rows], k64, v64, rmask)
    ours_err = float(np.abs(ours[:, :, rows].astype(np.float64) - expected).max())
    theirs_err = None
    try:
        import torch
    except ImportError:
        return ours_err, theirs_err
    tdt = torch.bfloat16 if np.dtype(dtype).name == "bfloat16" else torch.float16
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(tdt) for x in (q, k, v))
    tmask = None
    if mask is not None:
        tmask = torch.from_numpy(mask) if mask.dtype == bool else torch.from_numpy(mask).to(tdt)
    with torch.no_grad():
        theirs = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=causal)
    theirs_err = float(np.abs(theirs.float().numpy()[:, :, rows].astype(np.float64) - expected).max())
    return ours_err, theirs_err


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 1024, 4096, 16384], help="L = S")
    parser.add_argument(
        "--decode", type=int, nargs="*", default=[1024, 16384, 262144, 1048576], help="S for L = 1"
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256, help="query rows checked against the reference")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    parser.add_argument("--half", action="store_true", help="the bfloat16 / float16 table only (needs ml_dtypes)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    E = args.head_dim
    cfg = sdpa.config()
    print(f"sdpa {cfg['version']}, kernels {cfg['isa']}, {cfg['default_num_threads']} threads, "
          f"E = Ev = {E}, seed {args.seed}")
    print()
    if args.half:
        import ml_dtypes

        head = ["case (4 heads)", "dtype", "sdpa max abs err", "torch max abs err", "sdpa / torch"]
        body = []
        for dtype in (ml_dtypes.bfloat16, np.float16):
            for name, L, S, E_, causal, mask_kind in HALF_CASES:
                ours, theirs = half_case(rng, dtype, L, S, E_, causal, mask_kind, args.rows, args.threads)
                body.append([name, np.dtype(dtype).name, f"{ours:.2e}", "-" if theirs is None else f"{theirs:.2e}",
                             "-" if not theirs else f"{ours / theirs:.2f}"])
        table(head, body, args.markdown)
        return

    head = ["L = S", "causal", "rows checked", "float32 max abs err", "float32 mean abs err",
            "float32 median rel err", "float64 max abs err"]
    body = []
    for L in args.sizes:
        for causal in (False, True):
            r = square_case(rng, L, E, causal, args.rows, args.threads)
            body.append([str(L), "yes" if causal else "no", str(r["rows"]), f"{r['f32'][0]:.2e}",
                         f"{r['f32'][1]:.2e}", f"{r['f32'][2]:.2e}", f"{r['f64'][0]:.2e}"])
    table(head, body, args.markdown)

    if args.decode:
        print()
        head = ["L", "S (2 heads)", "float32 max abs err", "float32 mean abs err", "float32 median rel err",
                "float64 max abs err"]
        body = []
        for S in args.decode:
            r = decode_case(rng, S, E, args.threads)
            body.append(["1", str(S), f"{r['f32'][0]:.2e}", f"{r['f32'][1]:.2e}", f"{r['f32'][2]:.2e}",
                         f"{r['f64'][0]:.2e}"])
        table(head, body, args.markdown)


def table(head, body, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("| " + " | ".join("---:" for _ in head) + " |")
        for row in body:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in body:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
