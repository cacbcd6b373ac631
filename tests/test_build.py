"""Build facts reported by sdpa.config(), and the public names."""
import os
import subprocess
import sys

import numpy as np
import pytest

import sdpa
import sdpa.testing


def test_config_keys_and_types():
    cfg = sdpa.config()
    assert isinstance(cfg, dict)
    for key in ("version", "openmp", "default_num_threads"):
        assert key in cfg, f"config() lacks {key!r}"
    assert cfg["version"] == sdpa.__version__
    assert isinstance(cfg["version"], str) and cfg["version"].count(".") >= 2
    assert isinstance(cfg["openmp"], bool)
    assert isinstance(cfg["default_num_threads"], int)
    assert cfg["default_num_threads"] >= 1
    if not cfg["openmp"]:
        assert cfg["default_num_threads"] == 1


def test_config_returns_a_fresh_dict():
    cfg = sdpa.config()
    cfg["version"] = "changed"
    assert sdpa.config()["version"] == sdpa.__version__


def test_openmp_when_required():
    # CI sets SDPA_REQUIRE_OPENMP=1 where the build must have OpenMP.
    if os.environ.get("SDPA_REQUIRE_OPENMP") == "1":
        assert sdpa.config()["openmp"] is True


def test_show_config(capsys):
    sdpa.show_config()
    lines = capsys.readouterr().out.splitlines()
    cfg = sdpa.config()
    assert len(lines) == len(cfg)
    for line, (key, value) in zip(lines, cfg.items()):
        assert line == f"{key}: {value}"


def test_public_names():
    """The one check of the public names, for sdpa, sdpa.reference and sdpa.testing."""
    for name in sdpa.__all__:
        assert hasattr(sdpa, name), name
    for name in (
        "scaled_dot_product_attention", "merge_attention", "KVCache", "KVCacheFullError",
        "MultiHeadAttention", "set_num_threads", "get_num_threads", "config", "show_config",
        "reference", "__version__",
    ):
        assert name in sdpa.__all__ and hasattr(sdpa, name), name
    for name in ("scaled_dot_product_attention", "merge_attention", "set_num_threads", "get_num_threads",
                 "config", "show_config"):
        assert callable(getattr(sdpa, name)), name
    for name in ("scaled_dot_product_attention", "causal_mask", "key_length_mask", "multi_head_attention"):
        assert name in sdpa.reference.__all__ and callable(getattr(sdpa.reference, name)), name
    for name in sdpa.testing.__all__:
        assert hasattr(sdpa.testing, name), name


def test_more_threads_than_default_work():
    q = np.ones((2, 4, 8))
    n = sdpa.config()["default_num_threads"] + 3
    np.testing.assert_array_equal(
        sdpa.scaled_dot_product_attention(q, q, q, num_threads=n),
        sdpa.scaled_dot_product_attention(q, q, q, num_threads=1),
    )


def test_default_threads_follow_omp_num_threads():
    if not sdpa.config()["openmp"]:
        pytest.skip("built without OpenMP")
    code = "import sdpa; print(sdpa.config()['default_num_threads'])"
    env = dict(os.environ, OMP_NUM_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


def test_kernel_sets_reported():
    cfg = sdpa.config()
    assert "isa" in cfg and "isas_supported" in cfg
    assert "scalar" in cfg["isas_supported"]
    assert cfg["isa"] in cfg["isas_supported"]


# Runs in a fresh interpreter with SDPA_ISA set, so that each kernel set the CPU
# supports is checked, not only the one picked by default.
KERNEL_CHECK = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import sdpa
from conftest import check_against_reference, make_qkv

assert sdpa.config()["isa"] == sys.argv[1], sdpa.config()
rng = np.random.default_rng(20240601)
cases = 0
for dtype in (np.float32, np.float64):
    for L, S in ((1, 267), (7, 8), (33, 31), (65, 64), (127, 9), (267, 267)):
        for E in (1, 16, 31, 64, 80, 128, 256):
            q, k, v = make_qkv(rng, batch=(2,), hq=4, hkv=2, L=L, S=S, E=E, Ev=(E % 48) + 1, dtype=dtype)
            causal = (False, True, "bottom_right")[cases % 3]
            mask = None
            if cases % 2:
                keep = rng.random((4, L, S)) < 0.7
                mask = keep if cases % 4 == 1 else np.where(keep, rng.standard_normal((4, L, S)), -np.inf).astype(dtype)
            args = (q[..., ::-1, :], k.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2), v, mask, causal, None, True)
            out, weights = check_against_reference(*args, num_threads=1)
            for n in (2, 3):
                out_n, weights_n = sdpa.scaled_dot_product_attention(*args, return_weights=True, num_threads=n)
                assert np.array_equal(out_n, out) and np.array_equal(weights_n, weights), (L, S, E, n)
            cases += 1
print("ok", cases)
"""


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_each_kernel_set_against_reference(isa):
    if isa not in sdpa.config()["isas_supported"]:
        pytest.skip(f"this CPU does not support {isa}")
    env = dict(os.environ, SDPA_ISA=isa)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK, isa, tests_dir], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok")
