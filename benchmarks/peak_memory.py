"""Extra memory of one attention call: peak RSS above the inputs and output.

Each implementation runs in a fresh subprocess: allocate and touch q, k, v and the
output, note the peak RSS, run one call, and report how far the peak rose.

    python benchmarks/peak_memory.py                      # the long-16k shape
    python benchmarks/peak_memory.py --shape 1,8,8,4096,4096,64 --impls sdpa,torch
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
import numpy as np
B, Hq, Hkv, L, S, E = map(int, sys.argv[1].split(","))
impl = sys.argv[2]
rng = np.random.default_rng(0)
q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
v = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
out = np.ones((B, Hq, L, E), dtype=np.float32)  # touched: its pages count in the base
if impl == "sdpa":
    import sdpa
    run = lambda: sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv, out=out)
    sdpa.scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :])  # load everything
elif impl == "torch":
    import torch
    tq, tk, tv, to = (torch.from_numpy(a) for a in (q, k, v, out))
    def run():
        to.copy_(torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=Hq != Hkv))
    torch.nn.functional.scaled_dot_product_attention(tq[..., :8, :], tk[..., :8, :], tv[..., :8, :])
    # the result tensor torch allocates is the output: count it as such
    out = None
elif impl == "numpy":
    from sdpa import reference
    run = lambda: reference.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out_kib = 0 if out is not None else B * Hq * L * E * 4 // 1024
print(json.dumps({"impl": impl, "extra_mib": max(peak - base - out_kib, 0) / 1024}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8,8,16384,16384,64", help="B,Hq,Hkv,L,S,E (causal)")
    ap.add_argument("--impls", default="sdpa,torch")
    args = ap.parse_args(argv)
    rows = []
    for impl in args.impls.split(","):
        res = subprocess.run([sys.executable, "-c", CHILD, args.shape, impl], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{impl}: failed: {res.stderr.strip().splitlines()[-1] if res.stderr else res.returncode}")
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{impl:6s} shape ({args.shape}) causal: peak RSS {row['extra_mib']:.1f} MiB above inputs + output")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
