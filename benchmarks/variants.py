"""The model variants against the plain kernel: what a sliding window saves, what
softcap, ALiBi and sinks cost, and what the same attention costs as a dense mask.

Rounds alternate between the variants (so that a noisy machine slows all of them
alike) and the medians are reported, as seconds, GFLOP/s over the pairs each
call computes, and ratios to the first call of the case (the plain one).  Two more
cases: packed sequences of mixed lengths (``varlen_attention``) against the padded
batch with ``key_lengths`` ("useful" GFLOP/s count the sequences' own pairs only),
and greedy ``generate()`` of a tiny Llama with transformers' own "sdpa" and with
``sdpa.transformers.register()``.

    python benchmarks/variants.py                  # 2 threads, the default shapes
    python benchmarks/variants.py --threads 1 --rounds 5 --json out.json
    python benchmarks/variants.py --quick          # small shapes, a smoke run

torch (when installed) is timed with the dense masks its users build today for a
window or ALiBi (torch's SDPA has no window, softcap or sink argument).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import sdpa
from sdpa.bench.machine import machine_info
from sdpa.bench.timing import Progress


def alibi_slopes(heads: int) -> np.ndarray:
    """The geometric slopes of the ALiBi paper for a power-of-two head count."""
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


def pairs(L: int, S: int, causal: bool, window: Optional[Tuple[int, int]]) -> int:
    """(l, s) pairs a row sees: causal aligned bottom-right, the window's sides."""
    i = np.arange(L)[:, None] + (S - L)
    lo = np.zeros((L, 1), dtype=np.int64)
    hi = np.full((L, 1), S - 1, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window is not None:
        left, right = window
        if left >= 0:
            lo = np.maximum(lo, i - left)
        if right >= 0:
            hi = np.minimum(hi, i + right)
    return int(np.maximum(hi - lo + 1, 0).sum())


def cases(quick: bool) -> List[Dict[str, Any]]:
    """(shape, variants) to time: prefill with a window, and the per-score variants on
    a causal prefill and a decode step."""
    if quick:
        long_, mid, dec = (1, 4, 4, 1024, 1024, 64), (1, 4, 4, 512, 512, 64), (4, 8, 8, 1, 1024, 64)
        win = 128
    else:
        long_, mid, dec = (1, 16, 16, 8192, 8192, 64), (1, 16, 16, 2048, 2048, 64), (8, 32, 8, 1, 4096, 128)
        win = 512
    return [
        {"name": f"causal-{long_[3]}", "shape": long_, "causal": True,
         "variants": ["plain", f"window-{win}"], "window": (win - 1, 0)},
        {"name": f"causal-{mid[3]}", "shape": mid, "causal": True,
         "variants": ["plain", "softcap", "alibi", "sinks", "all"], "window": None},
        {"name": f"decode-{dec[4]}", "shape": dec, "causal": False,
         "variants": ["plain", "softcap", "alibi", "sinks", "all"], "window": None},
    ]


def make_calls(case: Dict[str, Any], threads: int, with_torch: bool) -> Dict[str, Tuple[Callable[[], Any], int]]:
    """name -> (call, pairs per head and batch it computes)."""
    B, Hq, Hkv, L, S, E = case["shape"]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    out = np.empty((B, Hq, L, E), np.float32)
    causal = "bottom_right" if case["causal"] else False
    base = dict(is_causal=causal, enable_gqa=Hq != Hkv, out=out, num_threads=threads)
    extra = {
        "plain": {},
        "softcap": {"softcap": 50.0},
        "alibi": {"alibi_slopes": alibi_slopes(Hq)},
        "sinks": {"sinks": rng.standard_normal(Hq).astype(np.float32)},
        "all": {"softcap": 50.0, "alibi_slopes": alibi_slopes(Hq), "sinks": rng.standard_normal(Hq).astype(np.float32)},
    }
    calls: Dict[str, Tuple[Callable[[], Any], int]] = {}
    full = pairs(L, S, case["causal"], None)
    for name in case["variants"]:
        if name.startswith("window"):
            kw = {"window": case["window"]}
            n = pairs(L, S, case["causal"], case["window"])
        else:
            kw = extra[name]
            n = full

        def run(kw: Dict[str, Any] = kw) -> Any:
            return sdpa.scaled_dot_product_attention(q, k, v, **base, **kw)

        calls[name] = (run, n)
    if with_torch:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        gqa = Hq != Hkv
        i = np.arange(L)[:, None] + (S - L)
        j = np.arange(S)[None, :]
        for name in case["variants"]:
            if name.startswith("window"):
                left = case["window"][0]
                keep = torch.from_numpy((j <= i) & (j >= i - left))
                calls["torch " + name + " (bool mask)"] = (
                    lambda m=keep: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, enable_gqa=gqa),
                    pairs(L, S, case["causal"], case["window"]),
                )
            elif name == "plain":
                calls["torch plain"] = (
                    lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=bool(case["causal"]) and L == S,
                                                           enable_gqa=gqa),
                    full,
                )
            elif name == "alibi" and L > 1:
                bias = -alibi_slopes(Hq)[:, None, None] * np.abs(i - j)
                if case["causal"]:
                    bias = np.where(j <= i, bias, -np.inf)
                tb = torch.from_numpy(bias.astype(np.float32))
                calls["torch alibi (float mask)"] = (
                    lambda b=tb: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=b, enable_gqa=gqa),
                    full,
                )
    return calls


def varlen_case(quick: bool, threads: int) -> Dict[str, Any]:
    """Packed sequences of mixed lengths against the padded batch with key_lengths."""
    lens = [64, 128, 256, 96] if quick else [128, 512, 2048, 256, 1024, 64, 768, 1536]
    H, E = (4, 64) if quick else (16, 64)
    rng = np.random.default_rng(0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    q = rng.standard_normal((cu[-1], H, E), dtype=np.float32)
    k = rng.standard_normal((cu[-1], H, E), dtype=np.float32)
    v = rng.standard_normal((cu[-1], H, E), dtype=np.float32)
    Lmax = max(lens)

    def pad(a: np.ndarray) -> np.ndarray:
        out = np.zeros((len(lens), H, Lmax, E), np.float32)
        for i, n in enumerate(lens):
            out[i, :, :n] = a[cu[i]:cu[i + 1]].transpose(1, 0, 2)
        return out

    qp, kp, vp = pad(q), pad(k), pad(v)
    real = sum(n * (n + 1) // 2 for n in lens)  # causal pairs of the sequences themselves
    padded_pairs = sum(int(np.minimum(np.arange(1, Lmax + 1), n).sum()) for n in lens)  # padded rows too
    out = np.empty_like(q)
    outp = np.empty_like(qp)
    calls = {
        "varlen": (lambda: sdpa.varlen_attention(q, k, v, cu, cu, is_causal=True, out=out, num_threads=threads),
                   real),
        "padded + key_lengths": (lambda: sdpa.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True, key_lengths=lens, out=outp, num_threads=threads), padded_pairs),
    }
    total = int(cu[-1])
    return {"name": f"varlen-{len(lens)}", "shape": (1, H, H, total, total, E), "calls": calls, "real": real}


def generate_case(threads: int) -> Optional[Dict[str, Any]]:
    """Greedy generate() of a tiny Llama: transformers' own "sdpa" against sdpa registered."""
    try:
        import torch
        import transformers

        import sdpa.transformers as st
    except ImportError:
        return None
    from sdpa.bench.generate import LLAMA_CONFIG, NEW_TOKENS, PROMPT_TOKENS

    torch.set_num_threads(threads)
    sdpa.set_num_threads(threads)
    name = st.register()
    torch.manual_seed(0)
    models = {}
    for impl in ("sdpa", name):
        config = transformers.LlamaConfig(**LLAMA_CONFIG, attn_implementation=impl)
        torch.manual_seed(0)
        models[impl] = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, PROMPT_TOKENS))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
              do_sample=False, pad_token_id=0)

    def gen(m: Any) -> Any:
        with torch.inference_mode():
            return m.generate(prompt, **kw)

    calls = {
        "transformers sdpa": (lambda: gen(models["sdpa"]), 0),
        f"sdpa.transformers ({name})": (lambda: gen(models[name]), 0),
    }
    return {"name": "generate-llama", "shape": None, "calls": calls}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians are reported")
    ap.add_argument("--quick", action="store_true", help="small shapes")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's dense-mask equivalents out")
    ap.add_argument("--json", metavar="FILE", help="write the machine and every timing as JSON")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401

        with_torch = not args.no_torch
    except ImportError:
        with_torch = False

    all_cases = cases(args.quick)
    built = [(c, make_calls(c, args.threads, with_torch)) for c in all_cases]
    vc = varlen_case(args.quick, args.threads)
    built.append((vc, vc["calls"]))
    if with_torch:
        gc_ = generate_case(args.threads)
        if gc_ is not None:
            built.append((gc_, gc_["calls"]))
    progress = Progress(sum(len(calls) for _, calls in built) * args.rounds, enabled=sys.stderr.isatty())
    results: List[Dict[str, Any]] = []
    for case, calls in built:
        times: Dict[str, List[float]] = {n: [] for n in calls}
        for fn, _ in calls.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for name, (fn, _) in calls.items():
                progress.show(f"{case['name']} {name}")
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                progress.advance()
        first = statistics.median(times[next(iter(calls))])  # the plain call, or the first peer
        for name, (_fn, n) in calls.items():
            t = statistics.median(times[name])
            row = {"case": case["name"], "variant": name, "seconds": t, "vs_plain": first / t, "gflops": None}
            if case["shape"] is not None:
                B, Hq, Hkv, L, S, E = case["shape"]
                row["shape"] = list(case["shape"])
                row["pairs"] = n
                row["gflops"] = 2.0 * B * Hq * n * (2 * E) / t / 1e9  # over the pairs the call computes
                if "real" in case:  # and over the pairs of the sequences alone
                    row["useful_gflops"] = 2.0 * Hq * case["real"] * (2 * E) / t / 1e9
            results.append(row)
    progress.close()

    print(f"threads={args.threads} rounds={args.rounds} cpu={machine_info().get('cpu_model')}")
    print(f"{'case':<14} {'variant':<34} {'ms':>10} {'GFLOP/s':>9} {'useful':>8} {'speed vs first':>15}")
    for r in results:
        g = f"{r['gflops']:.1f}" if r["gflops"] is not None else "-"
        u = f"{r['useful_gflops']:.1f}" if "useful_gflops" in r else "-"
        print(f"{r['case']:<14} {r['variant']:<34} {r['seconds'] * 1e3:>10.2f} {g:>9} {u:>8} "
              f"{r['vs_plain']:>14.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "threads": args.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
