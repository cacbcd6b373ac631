"""A long call stops within about a second of Ctrl-C (SIGINT) with KeyboardInterrupt."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, threading, time
    import numpy as np
    import sdpa

    q = np.random.default_rng(0).standard_normal((4, 8, 8192, 64)).astype(np.float32)
    sdpa.scaled_dot_product_attention(q[:1, :1, :256], q[:1, :1, :256], q[:1, :1, :256])
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.perf_counter()
    try:
        sdpa.scaled_dot_product_attention(q, q, q, num_threads=1)
        print("finished", time.perf_counter() - t0)
    except KeyboardInterrupt:
        print("interrupted", time.perf_counter() - t0)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery by os.kill is POSIX")
def test_ctrl_c_interrupts_a_long_call():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    word, seconds = out.stdout.split()
    assert word == "interrupted", out.stdout
    assert float(seconds) < 1.5


LONG_SINGLE_TASK = textwrap.dedent(
    """
    import os, signal, threading, time
    import numpy as np
    import sdpa

    rows = int(os.environ["ROWS"])
    q = np.ones((1, 1, rows, 64), np.float32)
    # 10**8 keys read through a zero stride: one task, about 5 s of work
    k = np.broadcast_to(np.ones((1, 1, 1, 64), np.float32), (1, 1, 10**8, 64))
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.perf_counter()
    try:
        sdpa.scaled_dot_product_attention(q, k, k, num_threads=1)
        print("finished", time.perf_counter() - t0)
    except KeyboardInterrupt:
        print("interrupted", time.perf_counter() - t0)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery by os.kill is POSIX")
@pytest.mark.parametrize("rows", [16, 1], ids=["tiled", "row-mode"])
def test_ctrl_c_interrupts_a_call_that_is_one_long_task(rows):
    import os

    out = subprocess.run([sys.executable, "-c", LONG_SINGLE_TASK], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, ROWS=str(rows)))
    assert out.returncode == 0, out.stderr
    word, seconds = out.stdout.split()
    assert word == "interrupted", out.stdout
    assert float(seconds) < 1.5
