"""A smoke test of the installed package on any machine, written for aarch64
under QEMU (.ci/arm_python.sh runs it with Debian's arm64 CPython and NumPy,
where pytest is not at hand): ``python tests/arm_smoke.py``.

It shows the configuration, checks that an AArch64 build has the neon sets,
and on every kernel set this CPU runs compares attention (float32, float64
and float16; decoding and the tiled path; GQA; causal) and an int8 KV cache's
decoding step against the float64 reference, the outputs of 1 and 2 threads
bit for bit, and integer_qk's kernel against the portable one.  Exits 1 on
any failure."""

from __future__ import annotations

import platform
import sys

import numpy as np

import sdpa
from sdpa import _core, reference

TOL = {np.float32: 2e-5, np.float64: 1e-12, np.float16: 2e-3}


def main() -> int:
    sdpa.show_config()
    sets = sdpa.config()["isas_supported"]
    failures = []
    if platform.machine().lower() in ("aarch64", "arm64") and "neon" not in sets:
        failures.append(f"an AArch64 build without the neon set: {sets}")
    rng = np.random.default_rng(0)
    for isa in sets:
        _core.set_isa(isa)
        checked = 0
        for dtype in (np.float32, np.float64, np.float16):
            for heads, kv_heads, L, S, causal in ((8, 8, 1, 256, False), (8, 2, 1, 300, False),
                                                  (4, 2, 40, 70, True), (2, 2, 130, 131, False)):
                q = rng.standard_normal((1, heads, L, 64)).astype(dtype)
                k = rng.standard_normal((1, kv_heads, S, 64)).astype(dtype)
                v = rng.standard_normal((1, kv_heads, S, 64)).astype(dtype)
                gqa = heads != kv_heads
                got = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, num_threads=1)
                two = sdpa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, num_threads=2)
                want = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                err = float(np.max(np.abs(got.astype(np.float64) - want)))
                what = f"[{isa}] {np.dtype(dtype).name} H={heads}/{kv_heads} L={L} S={S}"
                if got.dtype != dtype or not err <= TOL[dtype]:
                    failures.append(f"{what}: max error {err:.2e}")
                if not np.array_equal(got, two):
                    failures.append(f"{what}: 1 and 2 threads differ")
                checked += 1
        cache = sdpa.KVCache(1, 2, 512, 64, dtype="int8")
        cache.append(rng.standard_normal((1, 2, 300, 64)).astype(np.float32),
                     rng.standard_normal((1, 2, 300, 64)).astype(np.float32))
        q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
        got = cache.attend(q)
        want = reference.scaled_dot_product_attention(q, cache.keys, cache.values, enable_gqa=True)
        err = float(np.max(np.abs(got - want)))
        if not err <= 2e-5:
            failures.append(f"[{isa}] int8 cache decoding: max error {err:.2e}")
        checked += 1
        # integer_qk: the set's kernel against the portable one (the same integer
        # sums, so the same bits, unless a VNNI kernel takes groups in parts)
        for name, group in (("int8", None), ("int4", 32)):
            cache = sdpa.KVCache(1, 2, 512, 64, dtype=name, group_size=group)
            cache.append(rng.standard_normal((1, 2, 301, 64)).astype(np.float32),
                         rng.standard_normal((1, 2, 301, 64)).astype(np.float32))
            fast = cache.attend(q, integer_qk=True)
            kernel = _core.dot_qi_kernel()
            _core.set_portable_dot_qi(True)
            try:
                slow = cache.attend(q, integer_qk=True)
            finally:
                _core.set_portable_dot_qi(False)
            same = np.array_equal(fast, slow) if kernel in ("portable", "neon_dotprod") or group is None \
                else np.allclose(fast, slow, rtol=1e-5, atol=1e-6)
            if not same:
                failures.append(f"[{isa}] integer_qk over {name}: the {kernel} kernel differs from the portable one")
            checked += 1
        print(f"{isa}: {checked} cases (integer_qk: {_core.dot_qi_kernel()})")
    _core.set_isa(None)
    for f in failures:
        print("FAIL", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
