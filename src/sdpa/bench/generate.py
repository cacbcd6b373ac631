"""Greedy ``generate()`` of a tiny random-weight Llama, with and without ``sdpa.torch.patch()``.

A model this small spends its time on fixed costs per call (the Python of the
model and of ``generate()``, operator dispatch, small allocations), so the figure
says what sdpa's entry costs in a real decoding loop: each new token calls the
attention once per layer with one query row.
"""

from __future__ import annotations

import importlib
import statistics
import time
from typing import Any, Dict, List

from .suite import ratio
from .threads import SdpaThreads, TorchThreads

__all__ = ["LLAMA_CONFIG", "PROMPT_TOKENS", "NEW_TOKENS", "measure_generate"]

#: ``transformers.LlamaConfig`` arguments of the model: 2 layers, 4 query and 2
#: key/value heads of 16 dimensions.
LLAMA_CONFIG: Dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
PROMPT_TOKENS = 16
NEW_TOKENS = 32


def measure_generate(threads: int, *, min_time: float = 0.5, repeat: int = 5, seed: int = 0) -> Dict[str, Any]:
    """Seconds per ``generate()`` call with torch's attention and with sdpa's, in turns.

    The model (``LlamaForCausalLM``, ``attn_implementation="sdpa"``, eval mode, weights
    from ``seed``) continues a random prompt of :data:`PROMPT_TOKENS` tokens by exactly
    :data:`NEW_TOKENS` greedy tokens, on ``threads`` threads (torch's and sdpa's).  After
    one warm-up call of each, calls alternate between the two until each has at least
    ``repeat`` calls and ``min_time`` seconds.

    Returns ``{"status": "ok", "threads", "model", "prompt_tokens", "new_tokens",
    "torch": {"median_s", "min_s", "times_s"}, "sdpa": {...}, "sdpa_over_torch",
    "same_tokens"}`` (``same_tokens``: both produced the same tokens), or ``{"status":
    "absent" | "error", "threads", "reason"}``.
    """
    try:
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        name = getattr(exc, "name", None)
        missing = name in ("torch", "transformers")
        reason = f"{name} is not installed" if missing else f"cannot be imported ({exc})"
        return {"status": "absent", "threads": threads, "reason": reason}
    try:
        sdpa_torch = importlib.import_module("sdpa.torch")
        with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
            torch.manual_seed(seed)
            config = transformers.LlamaConfig(**LLAMA_CONFIG, attn_implementation="sdpa")
            model = transformers.LlamaForCausalLM(config).eval()
            prompt = torch.randint(0, config.vocab_size, (1, PROMPT_TOKENS))
        kwargs = {
            "attention_mask": torch.ones_like(prompt),
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,  # no early stop at the end-of-sequence token
            "do_sample": False,
            "pad_token_id": 0,
        }

        def generate() -> Any:
            with torch.no_grad():
                return model.generate(prompt, **kwargs)

        with TorchThreads(torch, threads), SdpaThreads(threads):
            plain = generate()
            with sdpa_torch.patch():
                patched = generate()
            times: Dict[str, List[float]] = {"torch": [], "sdpa": []}

            def timed(which: str) -> None:
                if which == "sdpa":
                    with sdpa_torch.patch():
                        t0 = time.perf_counter()
                        generate()
                else:
                    t0 = time.perf_counter()
                    generate()
                times[which].append(time.perf_counter() - t0)

            rounds = 0
            while any(len(t) < repeat or sum(t) < min_time for t in times.values()):
                # ABBA: neither side always runs second (warm caches favour the later one)
                for which in ("torch", "sdpa") if rounds % 2 == 0 else ("sdpa", "torch"):
                    timed(which)
                rounds += 1
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        return {"status": "error", "threads": threads, "reason": f"{type(exc).__name__}: {exc}"}

    def summary(t: List[float]) -> Dict[str, Any]:
        """The median, the best and every one of a list of times."""
        return {"median_s": statistics.median(t), "min_s": min(t), "times_s": t}

    result: Dict[str, Any] = {
        "status": "ok",
        "threads": threads,
        "model": dict(LLAMA_CONFIG),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": int(plain.shape[1]) - PROMPT_TOKENS,
        "torch": summary(times["torch"]),
        "sdpa": summary(times["sdpa"]),
        "same_tokens": bool(torch.equal(plain, patched)),
    }
    result["sdpa_over_torch"] = ratio(result["sdpa"]["median_s"], result["torch"]["median_s"])
    return result
