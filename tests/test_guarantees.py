"""Process-level promises: fork safety, floating-point control flags, and an
import that changes nothing else in the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import sdpa
from sdpa import _core


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_forked_after_a_threaded_call_does_not_hang():
    script = textwrap.dedent(
        """
        import os, sys
        import numpy as np
        import sdpa
        q = np.random.default_rng(0).standard_normal((2, 4, 300, 64)).astype(np.float32)
        expected = sdpa.scaled_dot_product_attention(q, q, q, num_threads=2)
        pid = os.fork()
        if pid == 0:
            got = sdpa.scaled_dot_product_attention(q, q, q, num_threads=2)
            os._exit(0 if np.array_equal(got, expected) else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_fp_control_flags_unchanged_in_every_thread(num_threads):
    before = _core.fp_flags(num_threads)
    rng = np.random.default_rng(1)
    tiny = np.float32(1e-39)  # a subnormal
    q = (rng.standard_normal((2, 3, 70, 16)) * tiny).astype(np.float32)
    k = rng.standard_normal((2, 3, 90, 16)).astype(np.float32)
    v = (rng.standard_normal((2, 3, 90, 16)) * tiny).astype(np.float32)
    out = sdpa.scaled_dot_product_attention(q, k, v, num_threads=num_threads)
    out1 = sdpa.scaled_dot_product_attention(q[:, :, :1], k, v, num_threads=num_threads)
    assert _core.fp_flags(num_threads) == before
    # subnormal values survive: nothing flushed them to zero
    assert np.any((out != 0) & (np.abs(out) < np.finfo(np.float32).tiny))
    assert np.any(out1 != 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_thread_computes_in_the_callers_fp_mode(dtype):
    """With flush-to-zero on in the caller (torch.set_flush_denormal(True)), every
    worker computes under it too: the same bits for any thread count, and the
    workers' own flags are back afterwards."""
    rng = np.random.default_rng(2)
    tiny = np.finfo(dtype).tiny / 8  # subnormal
    q = rng.standard_normal((2, 4, 64, 16)).astype(dtype)
    k = rng.standard_normal((2, 4, 96, 16)).astype(dtype)
    v = (rng.standard_normal((2, 4, 96, 16)) * tiny).astype(dtype)
    _core.fp_flags(3)  # three workers, started with flush-to-zero off
    if not _core.set_flush_to_zero(True):
        pytest.skip("no flush-to-zero mode on this CPU")
    try:
        results = [sdpa.scaled_dot_product_attention(q, k, v, num_threads=n) for n in (1, 2, 3, 2, 3)]
        decode = [sdpa.scaled_dot_product_attention(q[:, :, :1], k, v, num_threads=n) for n in (1, 2, 3)]
        # the workers' own flags come back after a call (teams of one size keep
        # their threads; a thread started while the caller flushes inherits that)
        _core.fp_flags(3)
        workers_before = _core.fp_flags(3)
        sdpa.scaled_dot_product_attention(q, k, v, num_threads=3)
        workers_after = _core.fp_flags(3)
        caller_after = _core.fp_flags(1)
    finally:
        _core.set_flush_to_zero(False)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    for r in decode[1:]:
        np.testing.assert_array_equal(r, decode[0])
    assert not np.any(results[0]) and not np.any(decode[0])  # the subnormal values were read as 0
    assert workers_after == workers_before
    assert caller_after[0] != 0  # the caller's own flags stay as it set them


IMPORT_CODE = """
import json, os, sys
before = dict(os.environ)
modules = set(sys.modules)
import sdpa
print(json.dumps({"environ_changed": dict(os.environ) != before,
                  "torch_imported": "torch" in sys.modules and "torch" not in modules}))
"""


@pytest.mark.parametrize("env_extra", [{}, {"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "1000"}])
def test_import_leaves_the_environment_alone(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", IMPORT_CODE], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"environ_changed": False, "torch_imported": False}
