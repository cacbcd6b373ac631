"""Thread control: set_num_threads / get_num_threads, OMP_NUM_THREADS and threadpoolctl."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import sdpa
from conftest import under_sanitizer
from sdpa import _core

HAS_OPENMP = sdpa.config()["openmp"]
needs_openmp = pytest.mark.skipif(not HAS_OPENMP, reason="built without OpenMP")


@pytest.fixture(autouse=True)
def reset_threads():
    sdpa.set_num_threads(None)
    yield
    sdpa.set_num_threads(None)


@pytest.fixture
def core_threads():
    """The threads each call runs with in the C core (its planner's choice)."""
    seen = []
    _core.set_observer(lambda handed: seen.append(handed["num_threads"]))
    yield seen
    _core.set_observer(None)


def run_python(code, **env):
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def planned(*counts):
    """The thread counts the planner gives calls: as asked with OpenMP, one
    thread each in the serial build."""
    return list(counts) if HAS_OPENMP else [1] * len(counts)


def small_problem():
    rng = np.random.default_rng(5)
    return tuple(rng.standard_normal((2, 3, 17, 8)) for _ in range(3))


def test_default_is_the_openmp_default():
    expected = _core.default_num_threads() if HAS_OPENMP else 1
    assert sdpa.get_num_threads() == expected >= 1
    cfg = sdpa.config()
    assert cfg["num_threads"] == expected
    assert cfg["default_num_threads"] == _core.default_num_threads()


@needs_openmp
def test_set_and_reset():
    sdpa.set_num_threads(3)
    assert sdpa.get_num_threads() == 3
    assert sdpa.config()["num_threads"] == 3
    # the OpenMP default itself is left alone
    assert sdpa.config()["default_num_threads"] == _core.default_num_threads()
    sdpa.set_num_threads(np.int64(5))
    assert sdpa.get_num_threads() == 5 and type(sdpa.get_num_threads()) is int
    sdpa.set_num_threads(None)
    assert sdpa.get_num_threads() == _core.default_num_threads()


def large_problem():
    """Work enough for many threads: 2*2*3*128*128*(64+64) = 25 MFLOP."""
    rng = np.random.default_rng(6)
    return tuple(rng.standard_normal((2, 3, 128, 64)).astype(np.float32) for _ in range(3))


def test_calls_use_the_set_value(core_threads):
    q, k, v = large_problem()
    sdpa.scaled_dot_product_attention(q, k, v)
    sdpa.set_num_threads(3)
    sdpa.scaled_dot_product_attention(q, k, v)
    sdpa.scaled_dot_product_attention(q, k, v, num_threads=1)  # an explicit value wins
    sdpa.scaled_dot_product_attention(q, k, v, num_threads=None)
    sdpa.scaled_dot_product_attention(q.astype(np.float64), k, v)  # the general path too
    sdpa.set_num_threads(None)
    sdpa.scaled_dot_product_attention(q, k, v)
    default = min(_core.default_num_threads(), 26)  # 25 MFLOP and 0.8 MB read: at most 26 threads of 1
    assert core_threads == planned(default, 3, 1, 3, 3, default)


def test_set_value_gives_small_problems_fewer_threads(core_threads):
    """Like the OpenMP default, the set value is capped at 1 MFLOP of work per
    thread, a byte of keys and values counting as 2 (starting threads costs
    more than a small problem); an explicit num_threads= is taken as asked."""
    q, k, v = small_problem()  # 2*2*3*17*17*16 flops, 2*3*17*16*8 bytes: one thread
    sdpa.set_num_threads(3)
    sdpa.scaled_dot_product_attention(q, k, v)
    sdpa.scaled_dot_product_attention(q, k, v, scale=0.5, return_lse=True)
    sdpa.scaled_dot_product_attention(q, k, v, num_threads=3)
    # 7x the rows and keys in float32: 2*2*3*119*119*16 = 2.7 MFLOP and 2*3*119*16*4 bytes: 2 threads
    q2, k2, v2 = (np.concatenate([a] * 7, axis=-2).astype(np.float32) for a in (q, k, v))
    sdpa.scaled_dot_product_attention(q2, k2, v2)
    assert core_threads == planned(1, 1, 3, 2)


def test_layers_use_the_set_value(core_threads):
    layer = sdpa.MultiHeadAttention(256, 4, rng=0)
    x = np.random.default_rng(0).standard_normal((2, 128, 256))
    sdpa.set_num_threads(2)
    layer(x)
    layer(x, num_threads=1)
    assert core_threads == planned(2, 1)


def test_value_seen_from_other_threads(core_threads):
    q, k, v = large_problem()
    sdpa.set_num_threads(2)
    t = threading.Thread(target=sdpa.scaled_dot_product_attention, args=(q, k, v))
    t.start()
    t.join()
    assert core_threads == planned(2)


def test_results_do_not_depend_on_the_setting():
    q, k, v = small_problem()
    expected = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    for n in (1, 2, 3):
        sdpa.set_num_threads(n)
        np.testing.assert_array_equal(sdpa.scaled_dot_product_attention(q, k, v, is_causal=True), expected)


@pytest.mark.parametrize("bad", [0, -1, -(2**70)])
def test_bad_values(bad):
    sdpa.set_num_threads(2)
    with pytest.raises(ValueError, match="num_threads"):
        sdpa.set_num_threads(bad)
    assert _core.threads_setting() == 2  # unchanged by the failed call


@pytest.mark.parametrize("bad", [2.0, "2", True, [2], np.float64(2)])
def test_bad_types(bad):
    with pytest.raises(TypeError, match="num_threads"):
        sdpa.set_num_threads(bad)
    assert _core.threads_setting() == 0  # still the OpenMP default


def test_huge_value_is_capped(core_threads):
    sdpa.set_num_threads(10**9)
    # the core caps what it is handed at max_threads (4 per CPU, at least 8)
    assert sdpa.get_num_threads() == (sdpa.config()["max_threads"] if HAS_OPENMP else 1)
    q = np.ones((1, 1, 2))
    sdpa.scaled_dot_product_attention(q, q, q, num_threads=10**9)
    assert core_threads == [1]  # taken as max_threads, then as the one task there is


RLIMIT_CODE = """
import resource
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**29, 3 * 2**29))  # 1.5 GiB of address space
import sdpa
q = np.ones((16, 32, 128, 16), np.float32)  # 512 tasks: room for 512 threads
out = sdpa.scaled_dot_product_attention(q, q, q, num_threads=512)
print("ok", float(out.sum()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux applies it")
@pytest.mark.skipif(under_sanitizer(), reason="a sanitizer runtime needs more address space than the limit")
def test_too_many_threads_do_not_end_the_process():
    """512 threads' stacks do not fit in 1.5 GiB; the cap keeps the runtime from
    failing to create them (libgomp would print an error and exit)."""
    assert run_python(RLIMIT_CODE).split()[0] == "ok"


def test_max_threads_reported():
    cap = sdpa.config()["max_threads"]
    assert cap == (max(8, 4 * os.cpu_count()) if HAS_OPENMP else 1) or cap < 4 * os.cpu_count()


@needs_openmp
def test_follows_omp_num_threads():
    code = "import sdpa; print(sdpa.get_num_threads(), sdpa.config()['default_num_threads'])"
    out = run_python(code, OMP_NUM_THREADS="3")
    assert out.split() == ["3", "3"]


def test_omp_wait_policy_is_left_to_the_user():
    code = "import os, sdpa; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "None", proc.stderr
    assert run_python(code, OMP_WAIT_POLICY="ACTIVE").strip() == "ACTIVE"


# --------------------------------------------------------------------------- threadpoolctl

INFO_CODE = r"""
import json
import numpy
from threadpoolctl import threadpool_info
before = threadpool_info()
import sdpa
after = threadpool_info()
print(json.dumps({"before": before, "after": after}))
"""


@needs_openmp
def test_threadpool_info_lists_the_openmp_runtime():
    pytest.importorskip("threadpoolctl")
    info = json.loads(run_python(INFO_CODE))
    openmp_before = [lib for lib in info["before"] if lib["user_api"] == "openmp"]
    openmp_after = [lib for lib in info["after"] if lib["user_api"] == "openmp"]
    assert openmp_after, info["after"]
    if not openmp_before:  # then the runtime listed is the one sdpa brought in
        assert any(os.path.basename(lib["filepath"]).startswith(("libgomp", "libomp", "libiomp", "vcomp"))
                   for lib in openmp_after), openmp_after
    for lib in openmp_after:
        assert lib["num_threads"] >= 1


@needs_openmp
def test_threadpool_limits_apply():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    default = sdpa.get_num_threads()
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert sdpa.get_num_threads() == 1
        assert sdpa.config()["default_num_threads"] == 1
    assert sdpa.get_num_threads() == default
    with threadpoolctl.threadpool_limits(limits=2, user_api="openmp"):
        assert sdpa.get_num_threads() == 2


@needs_openmp
def test_threadpool_limits_in_a_fresh_process():
    pytest.importorskip("threadpoolctl")
    code = (
        "import sdpa, threadpoolctl\n"
        "d = sdpa.get_num_threads()\n"
        "with threadpoolctl.threadpool_limits(1, user_api='openmp'):\n"
        "    inside = sdpa.get_num_threads()\n"
        "print(d, inside, sdpa.get_num_threads())\n"
    )
    default, inside, after = run_python(code, OMP_NUM_THREADS="3").split()
    assert (default, inside, after) == ("3", "1", "3")


@needs_openmp
def test_set_num_threads_wins_over_threadpool_limits(core_threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    q, k, v = large_problem()
    sdpa.set_num_threads(2)
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert sdpa.get_num_threads() == 2
        sdpa.scaled_dot_product_attention(q, k, v)
    assert core_threads == [2]
