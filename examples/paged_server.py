"""Continuous batching over a paged KV cache: a stream of requests served by a fixed pool of blocks.

Each request has a prompt of random length (most of them after a shared system
prompt) and asks for a random number of new tokens.  The server keeps one
:class:`sdpa.PagedKVCache` for one attention layer and, step by step:

- admits waiting requests while the pool has room for their prompt: a request
  forks the system prompt's sequence (its full blocks are shared, not copied),
  appends its own prompt and attends it in chunks (chunked prefill);
- decodes one token for every running request in one batched
  :func:`sdpa.paged_attention` call (the shared prompt's blocks are read once
  for all of them);
- frees the blocks of finished requests, which later ones then take.

The "model" is one attention layer with random projections: the point is the
cache's bookkeeping and the attention calls, which a real engine would make
per layer.  The first requests to finish are checked against attention over
their keys and values laid out contiguously; tokens/s are printed at the end.

    python examples/paged_server.py --requests 64 --blocks 2048 --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

import sdpa
from sdpa.bench.timing import Progress


@dataclass
class Request:
    rid: int
    prompt: int
    new_tokens: int
    seq: int = -1
    done: int = 0
    keys: List[np.ndarray] = field(default_factory=list)  # kept only for the final check
    values: List[np.ndarray] = field(default_factory=list)


class Layer:
    """Random K/V/Q projections of random token embeddings: (Hkv, T, E) and (Hq, T, E)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def tokens(self, n: int) -> tuple:
        k = self.rng.standard_normal((self.kv_heads, n, self.head_dim), dtype=np.float32)
        v = self.rng.standard_normal((self.kv_heads, n, self.head_dim), dtype=np.float32)
        q = self.rng.standard_normal((self.heads, n, self.head_dim), dtype=np.float32)
        return q, k, v


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks in the pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--system-prompt", type=int, default=512, help="tokens every request starts with")
    ap.add_argument("--max-prompt", type=int, default=256, help="a request's own prompt: 1 to this many tokens")
    ap.add_argument("--max-new", type=int, default=64, help="tokens to generate: 1 to this many")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk")
    ap.add_argument("--max-batch", type=int, default=32, help="requests decoding at once")
    ap.add_argument("--dtype", default="float32", help="the cache's dtype (float32, bfloat16, float16, int8)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    layer = Layer(args.heads, args.kv_heads, args.head_dim, args.seed + 1)
    cache = sdpa.PagedKVCache(args.blocks, args.block_size, args.kv_heads, args.head_dim, dtype=args.dtype)
    kw = {"num_threads": args.threads}

    system = cache.add_sequence()
    _, sk, sv = layer.tokens(args.system_prompt)
    cache.append(system, sk, sv)

    waiting = [Request(i, int(rng.integers(1, args.max_prompt + 1)), int(rng.integers(1, args.max_new + 1)))
               for i in range(args.requests)]
    total_new = sum(r.new_tokens for r in waiting)
    running: Dict[int, Request] = {}
    finished: List[Request] = []
    progress = Progress(total_new, enabled=sys.stderr.isatty() if args.progress is None else args.progress)
    prefill_tokens = decode_tokens = steps = 0
    prefill_s = decode_s = worst = 0.0

    def check(r: Request) -> float:
        """A query's attention over a finished request's blocks against its keys
        and values laid out contiguously (float64 reference)."""
        k = np.concatenate([sk] + r.keys, axis=1)[None]
        v = np.concatenate([sv] + r.values, axis=1)[None]
        q, _, _ = layer.tokens(1)
        bt, lens = cache.tables([r.seq])
        got = sdpa.paged_attention(q[None], cache.key_cache, cache.value_cache, bt, lens,
                                   key_scale=cache.key_scale, value_scale=cache.value_scale)
        ref = sdpa.reference.scaled_dot_product_attention(q[None].astype(np.float64), k.astype(np.float64),
                                                          v.astype(np.float64), enable_gqa=True)
        return float(np.abs(got - ref).max())
    start = time.perf_counter()

    while waiting or running:
        # admit while the pool holds every block the running requests and this one
        # will still take (the system prompt's full blocks are shared, not taken)
        def blocks_to_come(r: Request) -> int:
            final = -(-(args.system_prompt + r.prompt + r.new_tokens) // args.block_size)
            held = len(cache.block_table(r.seq)) if r.seq >= 0 else args.system_prompt // args.block_size
            return final - held

        while waiting and len(running) < args.max_batch:
            r = waiting[0]
            if sum(blocks_to_come(x) for x in running.values()) + blocks_to_come(r) > cache.free_blocks:
                break
            waiting.pop(0)
            r.seq = cache.fork(system)
            t0 = time.perf_counter()
            for c0 in range(0, r.prompt, args.chunk):
                n = min(args.chunk, r.prompt - c0)
                q, k, v = layer.tokens(n)
                cache.append(r.seq, k, v)
                r.keys.append(k), r.values.append(v)
                cache.attend([r.seq], q[None], **kw)  # chunked prefill: the chunk's last n positions
            prefill_s += time.perf_counter() - t0
            prefill_tokens += r.prompt
            running[r.rid] = r
        if not running:
            raise MemoryError("the pool cannot hold one request: pass more --blocks")
        # decode one token for every running request, in one call
        batch = list(running.values())
        t0 = time.perf_counter()
        qs = []
        for r in batch:
            q, k, v = layer.tokens(1)
            cache.append(r.seq, k, v)
            r.keys.append(k), r.values.append(v)
            qs.append(q)
        cache.attend([r.seq for r in batch], np.stack(qs), **kw)
        decode_s += time.perf_counter() - t0
        decode_tokens += len(batch)
        steps += 1
        for r in batch:
            r.done += 1
            progress.advance()
            if r.done == r.new_tokens:  # done: checked (the first few), then its blocks go back
                del running[r.rid]
                if len(finished) < 3:
                    worst = max(worst, check(r))
                finished.append(r)
                cache.free(r.seq)
                r.keys, r.values = [], []
        progress.show(f"{len(finished)}/{args.requests} done, {len(running)} running, "
                      f"{cache.free_blocks}/{args.blocks} blocks free")
    wall = time.perf_counter() - start
    progress.close()

    cache.free(system)

    print(f"sdpa {sdpa.__version__}, kernels {sdpa.config()['isa']}, cache {args.dtype}, blocks of "
          f"{args.block_size}, pool {args.blocks} blocks")
    print(f"{args.requests} requests after a {args.system_prompt}-token system prompt: {prefill_tokens} prompt "
          f"tokens, {decode_tokens} generated in {steps} batched steps, {wall:.2f} s")
    print(f"prefill {prefill_tokens / prefill_s:,.0f} tokens/s, decode {decode_tokens / decode_s:,.0f} tokens/s "
          "(attention of one layer)")
    print(f"max |paged - float64 reference| over 3 requests: {worst:.2e}; all blocks back in the pool: "
          f"{cache.free_blocks == args.blocks}")
    return 0 if cache.free_blocks == args.blocks and worst < 5e-2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
