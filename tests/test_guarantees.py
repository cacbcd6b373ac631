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
