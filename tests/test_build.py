"""Build facts reported by sdpa.config(), and the public names."""
import os

import numpy as np

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


def test_kernel_sets_reported():
    cfg = sdpa.config()
    assert "isa" in cfg and "isas_supported" in cfg
    assert "scalar" in cfg["isas_supported"]
    assert cfg["isa"] in cfg["isas_supported"]
