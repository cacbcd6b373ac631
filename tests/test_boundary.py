"""The boundary between Python and the C core: a prepared ``sdpa._core.Call``
holds the options, checked once when it is made (a TypeError or ValueError
naming the option); its ``run`` takes arrays in the core's own form and declines
the rest with a reason code naming the argument, writing nothing; the general
path (sdpa._api), which converts and then runs the same call, agrees with it
bit for bit.  ``_api.core_attention`` is the keyword form of both steps."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import sdpa
from conftest import make_qkv
from sdpa import _api, _core


def both_paths(q, k, v, **kw):
    """(core, general) results of one call; core is a reason code when it declines."""
    fast = _api.core_attention(q, k, v, **kw)
    if kw.get("out") is not None:
        kw["out"] = np.empty_like(kw["out"])
    general = _api._attention_general(q, k, v, **kw)
    return fast, general


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


CASES = {
    "decode": dict(batch=(1,), hq=8, L=1, S=256, E=64),
    "prefill": dict(batch=(2,), hq=3, L=37, S=41, E=16),
    "gqa": dict(batch=(2,), hq=8, hkv=2, L=5, S=19, E=8),
    "2-d": dict(batch=(), hq=None, L=6, S=7, E=5),
    "3-d": dict(batch=(), hq=3, L=6, S=7, E=5),
    "two-batch-dims": dict(batch=(2, 3), hq=2, L=4, S=9, E=8, Ev=3),
    "empty-keys": dict(batch=(2,), hq=2, L=3, S=0, E=4),
}
KWARGS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom-right": {"is_causal": "bottom_right"},
    "scale": {"scale": 0.3},
    "lse": {"return_lse": True},
    "weights": {"return_weights": True, "return_lse": True},
    "threads": {"num_threads": 2},
    "window": {"window": (2, 1), "is_causal": True},
    "softcap": {"softcap": 1.5},
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kwargs", KWARGS.values(), ids=KWARGS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_core_entry_equals_general_path(rng, case, kwargs, dtype):
    q, k, v = make_qkv(rng, dtype=dtype, **case)
    kw = dict(kwargs)
    if case.get("hkv"):
        kw["enable_gqa"] = True
    fast, general = both_paths(q, k, v, **kw)
    assert type(fast) is not int, f"the core declined a call in its own form: {_core.reason(fast)}"
    fast, general = as_tuple(fast), as_tuple(general)
    assert len(fast) == len(general)
    for a, b in zip(fast, general):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_core_entry_masks_lengths_variants_and_out(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=4, L=9, S=13, E=8, dtype=np.float32)
    bool_mask = rng.random((4, 9, 13)) < 0.7
    float_mask = rng.standard_normal((2, 1, 9, 13)).astype(np.float32)
    lengths = np.array([13, 5])
    slopes = rng.random(4).astype(np.float32)
    sinks = rng.standard_normal((2, 4)).astype(np.float32)
    out = np.empty((2, 9, 4, 8), np.float32).transpose(0, 2, 1, 3)
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"key_lengths": lengths},
               {"alibi_slopes": slopes}, {"sinks": sinks, "window": [3, -1]},
               {"out": out, "attn_mask": bool_mask, "is_causal": True}):
        fast, general = both_paths(q, k, v, **kw)
        assert type(fast) is not int, (kw, _core.reason(fast))
        np.testing.assert_array_equal(fast, general)
        if "out" in kw:
            assert fast is out


@pytest.mark.parametrize(
    "why, change, argument",
    [
        ("int32 converts", lambda a: dict(q=a["q"].astype(np.int32)), "query"),
        ("mixed key and value", lambda a: dict(v=a["v"].astype(np.float16)), "value"),
        ("mixed dtypes", lambda a: dict(k=a["k"].astype(np.float64)), "key"),
        ("a list", lambda a: dict(q=a["q"].tolist()), "query"),
        ("byte-swapped", lambda a: dict(v=a["v"].astype(a["v"].dtype.newbyteorder())), "value"),
        ("float16 mask", lambda a: dict(attn_mask=np.zeros((5, 7), np.float16)), "attn_mask"),
        ("mask shape", lambda a: dict(attn_mask=np.zeros((5, 6), bool)), "attn_mask"),
        ("int32 lengths", lambda a: dict(key_lengths=np.array([3], np.int32)), "key_lengths"),
        ("negative lengths", lambda a: dict(key_lengths=np.array([-1])), "key_lengths"),
        ("out overlaps q", lambda a: dict(out=a["q"]), "out"),
        ("bad shapes", lambda a: dict(k=a["k"][..., :3]), "key"),
        ("float64 slopes", lambda a: dict(alibi_slopes=np.ones(2)), "alibi_slopes"),
        ("sinks shape", lambda a: dict(sinks=np.ones(3, np.float32)), "sinks"),
        ("gqa that does not divide", lambda a: dict(enable_gqa=True, k=np.concatenate([a["k"], a["k"][:, :1]], 1),
                                                      v=np.concatenate([a["v"], a["v"][:, :1]], 1)), "enable_gqa"),
    ],
)
def test_core_entry_declines_with_the_argument_and_writes_nothing(rng, why, change, argument):
    q, k, v = make_qkv(rng, batch=(1,), hq=2, L=5, S=7, E=4, dtype=np.float32)
    args = dict(q=q, k=k, v=v)
    kw = change(args)
    for name in "qkv":
        args[name] = kw.pop(name, args[name])
    out = kw.get("out")
    before = None if out is None else out.copy()
    code = _api.core_attention(args["q"], args["k"], args["v"], **kw)
    assert type(code) is int, why
    assert _core.reason(code).startswith(argument + " "), (why, _core.reason(code))
    if before is not None:
        np.testing.assert_array_equal(out, before)


@pytest.mark.parametrize(
    "option, error, argument",
    [
        (dict(num_threads=0), ValueError, "num_threads"),
        (dict(num_threads=2.0), TypeError, "num_threads"),
        (dict(is_causal="diagonal"), ValueError, "is_causal"),
        (dict(window=(2.0, 0)), TypeError, "window"),
        (dict(window=(-2, 0)), ValueError, "window"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(scale="1"), TypeError, "scale"),
        (dict(group_size=4.0), TypeError, "group_size"),
        (dict(group_size=4), ValueError, "group_size"),  # groups belong to a quantized cache
        (dict(integer_qk=True), ValueError, "integer_qk"),
        (dict(kv_dtype=float(_core.QUANTIZED["int8"])), ValueError, "kv_dtype"),
        (dict(kv_dtype=_core.QUANTIZED["int8"], group_size=2**63), ValueError, "group_size"),
    ],
)
def test_options_are_checked_once_when_the_call_is_made(rng, option, error, argument):
    q, k, v = make_qkv(rng, batch=(1,), hq=2, L=5, S=7, E=4, dtype=np.float32)
    with pytest.raises(error, match=f"^{argument}:"):
        _core.Call(**option)
    with pytest.raises(error, match=f"^{argument}:"):
        _api.core_attention(q, k, v, **option)
    public = {n: x for n, x in option.items() if n not in ("group_size", "integer_qk", "kv_dtype")}
    if public:
        with pytest.raises(error, match=f"^{argument}:"):
            sdpa.scaled_dot_product_attention(q, k, v, **public)


@pytest.mark.parametrize(
    "given, canonical",
    [
        (dict(is_causal=np.bool_(True)), dict(is_causal=True)),
        (dict(is_causal="top_left"), dict(is_causal=True)),
        (dict(scale=1), dict(scale=1.0)),
        (dict(scale=np.float32(0.5)), dict(scale=0.5)),
        (dict(num_threads=np.int64(2)), dict(num_threads=2)),
        (dict(softcap=2), dict(softcap=2.0)),
        (dict(return_weights=1), dict(return_weights=True)),
        (dict(window=[2, np.int32(1)], is_causal=True), dict(window=(2, 1), is_causal=True)),
    ],
)
def test_options_in_another_form_make_the_same_call(rng, given, canonical):
    q, k, v = make_qkv(rng, batch=(1,), hq=2, L=5, S=7, E=4, dtype=np.float32)
    assert _core.Call(**given).constants == _core.Call(**canonical).constants
    plain = _core.plain()
    as_given = plain.prepared(*(given.get(n, d) for n, d in PREPARED_DEFAULTS.items()))
    assert as_given is plain.prepared(*(canonical.get(n, d) for n, d in PREPARED_DEFAULTS.items()))
    results = (as_tuple(_api.core_attention(q, k, v, **kw)) for kw in (given, canonical))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


PREPARED_DEFAULTS = dict(is_causal=False, scale=None, enable_gqa=False, window=None, softcap=None,
                         num_threads=None, return_weights=False, return_lse=False)


def test_prepared_calls_are_kept_by_their_options_and_survive_pickling():
    import copy
    import pickle

    plain = _core.plain()
    a = plain.prepared(True, 0.5, False, None, None, None, False, True)
    assert plain.prepared(True, 0.5, False, None, None, None, False, True) is a
    assert plain.prepared(False, 0.5, False, None, None, None, False, True) is not a
    for clone in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert type(clone) is _core.Call and clone.constants == a.constants
    # the number kept is bounded: a caller cycling through scales does not grow it without end
    for i in range(2 * _core.MAX_PREPARED_CALLS):
        plain.prepared(False, 1.0 + i, False, None, None, None, False, False)
    assert plain.prepared_count() <= _core.MAX_PREPARED_CALLS
    # many keys of one call (thread counts past the largest are taken as it) are bounded too
    for i in range(2 * _core.MAX_PREPARED_CALLS):
        plain.prepared(False, None, False, None, None, _core.MAX_NUM_THREADS + i, False, False)
    assert plain.prepared_count() <= _core.MAX_PREPARED_CALLS


def test_quantized_operands_are_declined_naming_the_argument(rng):
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.integers(-127, 128, (1, 2, 5, 8)).astype(np.int8)
    v = rng.integers(-127, 128, (1, 2, 5, 4)).astype(np.int8)
    ks, vs = np.ones((1, 2, 5, 1), np.float32), np.ones((1, 2, 5, 1), np.float32)
    assert type(_api.core_attention(q, k, v, key_scale=ks, value_scale=vs)) is not int
    cases = [
        (dict(q=q.astype(np.float64)), "query has a dtype"),
        (dict(k=k.astype(np.int16)), "key has a dtype"),
        (dict(v=v.astype(np.float32)), "value has a dtype"),
        (dict(ks=ks.astype(np.float64)), "key_scale has a dtype"),
        (dict(vs=vs.astype(np.float16)), "value_scale has a dtype"),
        (dict(ks=np.ones((1, 2, 4, 1), np.float32)), "key_scale has a shape"),
        (dict(vs=np.ones((1, 2, 5, 3), np.float32)), "value_scale has a shape"),
        (dict(group_size=3), "group_size has a value"),
    ]
    for change, reason in cases:
        a = dict(q=q, k=k, v=v, ks=ks, vs=vs, group_size=0)
        a.update(change)
        code = _api.core_attention(a["q"], a["k"], a["v"], key_scale=a["ks"], value_scale=a["vs"],
                               group_size=a["group_size"])
        assert type(code) is int and _core.reason(code).startswith(reason), (reason, code)
    swapped = np.array([5], dtype=np.dtype(np.int64).newbyteorder())
    code = _api.core_attention(q[0], k[0].astype(np.float32), v[0].astype(np.float32), key_lengths=swapped)
    assert _core.reason(code).startswith("key_lengths is not native")


def test_reason_codes_name_every_argument_and_rule():
    for arg, name in enumerate(_core.ARGUMENTS):
        for rule, text in enumerate(_core.RULES):
            assert _core.reason(arg * 8 + rule) == f"{name} {text}"
    for bad in (-1, 8 * len(_core.ARGUMENTS), len(_core.RULES)):
        with pytest.raises(ValueError, match="not a reason code"):
            _core.reason(bad)


def test_prepared_operands_the_core_declines_raise_naming_the_argument(rng):
    q, k, v = make_qkv(rng, batch=(2,), hq=2, L=3, S=4, E=5, dtype=np.float32)
    call = _core.plain()
    with pytest.raises(ValueError, match="^sdpa: value has a shape"):
        _api.call_core(call, q, k[..., :3, :], v)  # S of key and value differ
    with pytest.raises(ValueError, match="^sdpa: out has a shape"):
        _api.call_core(call, q, k, v, out=np.empty((2, 1, 3, 5), np.float32))  # an output must not broadcast
    with pytest.raises(ValueError, match="^sdpa: key has a dtype"):
        _api.call_core(call, q, k.astype(np.float64), v)
    ro = np.empty((2, 2, 3, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="^sdpa: out is not native, aligned and .* writeable"):
        _api.call_core(call, q, k, v, out=ro)


def test_out_interleaved_with_an_input_gets_the_result_by_a_copy(rng):
    """The core's overlap test is by span; an out that only interleaves with the
    query (no shared element) is taken by the general path, which computes into
    a new array and copies."""
    base = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    q, out = base[..., ::2], base[..., 1::2]
    k = rng.standard_normal((1, 2, 7, 4)).astype(np.float32)
    v = rng.standard_normal((1, 2, 7, 4)).astype(np.float32)
    q_before = q.copy()
    assert _api.core_attention(q, k, v, out=out) == _core.OUT_MAY_OVERLAP
    expected = sdpa.scaled_dot_product_attention(q_before, k, v)
    result = sdpa.scaled_dot_product_attention(q, k, v, out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(q, q_before)


def test_weights_beyond_the_machines_memory_are_declined(rng):
    total = _core.physical_memory_bytes()
    if total is None:
        pytest.skip("the OS does not tell this machine's memory")
    q = np.zeros((1, 1, 1 << 20, 1), np.float32)
    k = v = np.broadcast_to(np.zeros((1, 1, 1, 1), np.float32), (1, 1, 1 << 20, 1))
    heads = total // (1 << 42) + 1  # heads * 2**20 * 2**20 * 4 bytes > total
    q = np.broadcast_to(q, (1, int(heads), 1 << 20, 1))
    code = _api.core_attention(q, k, v, return_weights=True)
    assert _core.reason(code).startswith("return_weights would need more memory")
    with pytest.raises(MemoryError, match="return_weights"):
        sdpa.scaled_dot_product_attention(q, k, v, return_weights=True)


def run_python(code, **env):
    import os

    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["avx9000", "neon" if sys.platform != "darwin" else "avx512"])
def test_unknown_or_unsupported_sdpa_isa_is_an_error(value):
    if value in sdpa.config()["isas_supported"]:
        pytest.skip(f"{value} is supported here")
    code = (
        "import warnings, numpy as np\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import sdpa\n"
        "print(len(w), w[0].category.__name__ if w else '')\n"
        "print(sdpa.config()['isa'])\n"
        "try:\n"
        "    sdpa.scaled_dot_product_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)))\n"
        "except ValueError as exc:\n"
        "    print('ValueError', exc)\n"
    )
    proc = run_python(code, SDPA_ISA=value)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "1 RuntimeWarning"
    assert lines[1] == "none"
    assert lines[2].startswith("ValueError") and "SDPA_ISA" in lines[2] and value in lines[2]


def test_supported_sdpa_isa_is_used():
    for name in sdpa.config()["isas_supported"]:
        proc = run_python("import sdpa; print(sdpa.config()['isa'])", SDPA_ISA=name)
        assert proc.stdout.strip() == name, proc.stderr
