"""python -m sdpa: the chapter's worked example, then a larger case checked
against NumPy, with the time of both."""
from __future__ import annotations

import argparse

import numpy as np

import sdpa
from sdpa import reference
from sdpa.bench.timing import median_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdpa", description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512, help="L = S of the random case")
    ap.add_argument("--dim", type=int, default=64, help="E = Ev of the random case")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    cfg = sdpa.config()
    print("sdpa " + ", ".join(f"{k}={v}" for k, v in cfg.items()))

    print("\nWorked example (L = 2, d_k = 2):")
    q = k = [[1.0, 0.0], [0.0, 1.0]]
    v = [[2.0, 3.0], [4.0, 5.0]]
    out, weights = sdpa.scaled_dot_product_attention(q, k, v, return_weights=True)
    print("  Q = K =", q, " V =", v)
    print("  weights =", np.round(weights, 2).tolist())
    print("  output  =", np.round(out, 2).tolist())

    B, H, L, E = args.batch, args.heads, args.seq, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, E), dtype=np.float32) for _ in range(3))
    print(f"\nRandom case: float32, (B, H, L, E) = ({B}, {H}, {L}, {E}), causal")
    ours = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=args.threads)
    ref = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = float(np.max(np.abs(ours - ref)))
    ok = err < 1e-4
    print(f"  max |sdpa - NumPy float64| = {err:.2e}  ({'OK' if ok else 'MISMATCH'})")

    t_sdpa = median_time(
        lambda: sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=args.threads),
        repeat=args.repeat,
    )
    t_numpy = median_time(
        lambda: reference.scaled_dot_product_attention(q, k, v, is_causal=True), repeat=args.repeat
    )
    flops = 2 * B * H * (E + E) * (L * (L + 1) // 2)
    print(f"  sdpa : {t_sdpa * 1e3:8.2f} ms  {flops / t_sdpa / 1e9:7.1f} GFLOP/s")
    print(f"  NumPy: {t_numpy * 1e3:8.2f} ms  {flops / t_numpy / 1e9:7.1f} GFLOP/s  (float64 reference)")
    print(f"  sdpa is {t_numpy / t_sdpa:.1f}x faster")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
