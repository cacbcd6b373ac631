"""Greedy decoding with a small decoder-only Transformer and per-layer KV caches.

The model has random weights, so the tokens mean nothing; what matters is the
pipeline: a prompt is run through every layer at once (prefill), then one token
at a time is generated, each step attending to the keys and values kept in the
caches.  Each block is pre-norm:

    h = x + attention(rmsnorm(x))        grouped-query attention, causal
    x = h + mlp(rmsnorm(h))              SiLU, 4x wide

Prints the throughput of prefill and decode, then checks that the cached
decode gives what one causal pass over the whole sequence gives.  With
``--kv-cache``, the caches hold another dtype (several, comma-separated, are
run one after the other): float32 gives the full pass's logits to rounding,
16-bit, int8, float8 and int4 caches to their own precision; ``+iqk`` after
int8 or int4 decodes with integer Q.K (``integer_qk=True``).

    python examples/decoder.py --layers 4 --tokens 32 --threads 2
    python examples/decoder.py --prompt 2048 --kv-cache float32,bfloat16,int8,float8_e4m3fn,int4,int4+iqk
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import sdpa
from sdpa import KVCache, MultiHeadAttention


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * gain


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Block:
    """One pre-norm decoder block: attention and MLP, each with a residual."""

    def __init__(self, embed: int, heads: int, kv_heads: int, rng: np.random.Generator) -> None:
        self.attn = MultiHeadAttention(embed, heads, kv_heads, bias=False, rng=rng)
        hidden = 4 * embed
        self.w_up = (rng.standard_normal((embed, hidden)) / np.sqrt(embed)).astype(np.float32)
        self.w_down = (rng.standard_normal((hidden, embed)) / np.sqrt(hidden)).astype(np.float32)
        self.norm_attn = np.ones(embed, dtype=np.float32)
        self.norm_mlp = np.ones(embed, dtype=np.float32)

    def __call__(self, x: np.ndarray, cache: Optional[KVCache], threads: Optional[int]) -> np.ndarray:
        h = x + self.attn(rms_norm(x, self.norm_attn), cache, causal=True, num_threads=threads)
        return h + silu(rms_norm(h, self.norm_mlp) @ self.w_up) @ self.w_down


class Decoder:
    def __init__(self, layers: int, embed: int, heads: int, kv_heads: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.embedding = rng.standard_normal((vocab, embed)).astype(np.float32)
        self.blocks = [Block(embed, heads, kv_heads, rng) for _ in range(layers)]
        self.norm_out = np.ones(embed, dtype=np.float32)
        self.unembedding = (rng.standard_normal((embed, vocab)) / np.sqrt(embed)).astype(np.float32)

    def new_caches(self, batch: int, capacity: int, dtype: Any = None) -> List[KVCache]:
        return [b.attn.new_cache(batch, capacity, dtype=dtype) for b in self.blocks]

    def logits(self, tokens: np.ndarray, caches: Optional[List[KVCache]], threads: Optional[int]) -> np.ndarray:
        """tokens (batch, T) -> logits (batch, T, vocab); with caches, the tokens
        continue what the caches hold."""
        x = self.embedding[tokens]
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], threads)
        return rms_norm(x, self.norm_out) @ self.unembedding


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate (default 32)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (default 64)")
    # 0: sdpa's default, which gives small problems (a small model's decode step)
    # fewer threads, so that waking threads does not cost more than it saves.
    ap.add_argument("--threads", type=int, default=0,
                    help="attention threads (default 0: sdpa's default)")
    ap.add_argument("--embed", type=int, default=512, help="model width (default 512)")
    ap.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache", default="float32",
                    help="cache dtypes, comma-separated: float32, bfloat16, float16, int8, float8_e4m3fn, "
                    "float8_e5m2, int4, and int8+iqk / int4+iqk for integer Q.K (default float32)")
    ap.add_argument("--no-check", action="store_true", help="skip the check against a full pass")
    args = ap.parse_args(argv)
    cache_types = [t.strip() for t in args.kv_cache.split(",") if t.strip()]
    known: Dict[str, Any] = {"float32": np.float32, "float16": np.float16, "int8": "int8", "int8+iqk": "int8",
                             "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int4": "int4",
                             "int4+iqk": "int4"}
    try:
        import ml_dtypes

        known["bfloat16"] = ml_dtypes.bfloat16
    except ImportError:
        pass
    if not cache_types or any(t not in known for t in cache_types):
        ap.error(f"--kv-cache: expected some of {', '.join(known)}, got {args.kv_cache!r}")
    if args.layers < 1 or args.tokens < 1 or args.prompt < 1 or args.batch < 1:
        ap.error("--layers, --tokens, --prompt and --batch must be >= 1")
    if args.threads < 0:
        ap.error("--threads must be >= 0")
    threads = args.threads or None

    model = Decoder(args.layers, args.embed, args.heads, args.kv_heads, args.vocab, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompt = rng.integers(0, args.vocab, size=(args.batch, args.prompt))
    total = args.prompt + args.tokens
    print(
        f"sdpa {sdpa.__version__} ({sdpa.config()['isa']}), {args.layers} layers, embed {args.embed}, "
        f"{args.heads} query heads, {args.kv_heads} kv heads, batch {args.batch}, "
        f"attention threads: {threads or 'sdpa default'}"
    )
    # the largest relative difference from the full pass each cache type allows
    tolerance = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2, "int8": 5e-2, "int8+iqk": 5e-2,
                 "float8_e4m3fn": 1e-1, "float8_e5m2": 2e-1, "int4": 3e-1, "int4+iqk": 3e-1}
    failed = False
    for cache_type in cache_types:
        caches = model.new_caches(args.batch, total, known[cache_type])
        for block in model.blocks:
            block.attn.integer_qk = cache_type.endswith("+iqk")

        # prefill: the whole prompt in one pass per layer; the last position predicts
        t0 = time.perf_counter()
        step_logits = [model.logits(prompt, caches, threads)[:, -1]]
        t_prefill = time.perf_counter() - t0
        generated = [np.argmax(step_logits[-1], axis=-1)]

        # decode: one token per step, through the caches
        t0 = time.perf_counter()
        for _ in range(args.tokens - 1):
            step_logits.append(model.logits(generated[-1][:, None], caches, threads)[:, -1])
            generated.append(np.argmax(step_logits[-1], axis=-1))
        t_decode = time.perf_counter() - t0

        tokens = np.stack(generated, axis=1)  # (batch, tokens)
        mib = sum(c.nbytes for c in caches) / 2**20
        print(f"[{cache_type} cache, {mib:.1f} MiB] prefill: {args.batch * args.prompt} tokens in "
              f"{t_prefill * 1e3:.1f} ms, {args.batch * args.prompt / t_prefill:,.0f} tokens/s")
        if args.tokens > 1:
            n = args.batch * (args.tokens - 1)
            print(f"[{cache_type} cache] decode:  {n} tokens in {t_decode * 1e3:.1f} ms, "
                  f"{n / t_decode:,.0f} tokens/s")
        print("generated:", " ".join(str(t) for t in tokens[0][:16]) + (" ..." if args.tokens > 16 else ""))
        assert all(len(c) == total - 1 for c in caches)

        if args.no_check:
            continue
        # the same logits from one causal pass over prompt + generated tokens, no cache
        sequence = np.concatenate([prompt, tokens[:, :-1]], axis=1)
        full = model.logits(sequence, None, threads)[:, args.prompt - 1 :]
        cached = np.stack(step_logits, axis=1)
        err = float(np.max(np.abs(full - cached)) / max(float(np.max(np.abs(full))), 1e-30))
        same = bool(np.array_equal(np.argmax(full, axis=-1), tokens))
        ok = err < tolerance[cache_type]
        failed |= not ok
        print(f"check: cached decode vs full pass, max relative difference {err:.2e}, "
              f"same tokens: {same} -> {'OK' if ok else 'MISMATCH'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
