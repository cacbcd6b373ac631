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


def test_openmp_and_the_thread_limits_agree():
    """A build without OpenMP runs one thread; one with it up to max_threads
    (at least 8).  CI sets SDPA_REQUIRE_OPENMP=1 where the build must have it."""
    cfg = sdpa.config()
    assert isinstance(cfg["openmp"], bool)
    if os.environ.get("SDPA_REQUIRE_OPENMP") == "1":
        assert cfg["openmp"] is True
    if cfg["openmp"]:  # 4 per CPU, at least 8, unless OMP_THREAD_LIMIT says fewer
        assert cfg["max_threads"] >= (1 if os.environ.get("OMP_THREAD_LIMIT") else 8)
        assert cfg["default_num_threads"] >= 1
    else:
        assert cfg["max_threads"] == 1 and cfg["default_num_threads"] == 1


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
    """More threads than the default: the same bits as one thread, on a
    problem whose outputs differ from row to row (random values, enough rows
    and keys for every thread to get work)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 4, 96, 40)) for _ in range(3))
    n = sdpa.config()["default_num_threads"] + 3
    many = sdpa.scaled_dot_product_attention(q, k, v, num_threads=n)
    one = sdpa.scaled_dot_product_attention(q, k, v, num_threads=1)
    assert np.unique(one).size > one.size // 2  # no constant output hiding a difference
    np.testing.assert_array_equal(many, one)


def test_kernel_sets_reported():
    cfg = sdpa.config()
    assert "isa" in cfg and "isas_supported" in cfg
    assert "scalar" in cfg["isas_supported"]
    assert cfg["isa"] in cfg["isas_supported"]


def test_this_readme_names_every_test_file():
    """tests/README.md has a row for every test file here and in tests/c."""
    import pathlib

    here = pathlib.Path(__file__).resolve().parent
    readme = (here / "README.md").read_text(encoding="utf-8")
    files = sorted(p.name for p in here.glob("*.py") if p.name != "conftest.py")
    files += sorted(f"c/{p.name}" for p in (here / "c").glob("*.c"))
    missing = [f for f in files if f"`{f}`" not in readme]
    assert not missing, f"tests/README.md does not name {missing}"
