"""Coverage-guided fuzzing of sdpa.scaled_dot_product_attention with atheris.

Every input byte string is decoded into one call: sizes (0 included), dtypes,
head layouts (equal, grouped-query, broadcast, 2-D), batch dims that broadcast,
masks, causal modes, key lengths, the model variants (windows, softcaps,
ALiBi slopes, sinks), weights and log-sum-exp, memory layouts (transposed,
reversed, strided, zero-stride, unaligned, read-only, lists), ``out=``, thread
counts, special values (NaN, +-inf, subnormals, huge), and now and then one
deliberate mistake (mismatched shapes, bad dtypes or arguments).  For each call:

* it must not crash, and the only exceptions allowed are ValueError, TypeError
  and MemoryError -- and those only for the calls with a deliberate mistake;
* the inputs must be unchanged afterwards;
* the result has the documented shape and dtype, and the same bits with another
  thread count;
* when every value is finite, it must match the float64 reference
  (``sdpa.reference``) within a tolerance scaled by the conditioning of each
  row: ``sdpa.testing.assert_matches_reference`` compares it, as it does for
  tests/test_fuzz.py.

The values, special values, layouts and broadcast shapes come from
``sdpa.testing``, with the input's bytes taking its decisions.

    pip install atheris
    python fuzz/fuzz_attention.py -atheris_runs=100000 corpus/
    python fuzz/fuzz_attention.py --smoke 2000      # random inputs, no atheris needed

See fuzz/README.md for long runs and sanitizer builds.
"""
from __future__ import annotations

import os
import sys

import numpy as np

if __name__ == "__main__" and "--smoke" not in sys.argv:
    import atheris

    with atheris.instrument_imports():
        import sdpa
else:
    import sdpa

# imported after sdpa, outside the instrumentation: coverage of the checks
# themselves would only distract the search
from sdpa.testing import (  # noqa: E402
    FLOAT_DTYPES,
    OTHER_DTYPES,
    SOFTCAPS,
    SPECIALS,
    assert_matches_reference,
    broadcastable_shape,
    place,
    random_values,
    result_dtype,
)

ALLOWED = (ValueError, TypeError, MemoryError)


class Bytes:
    """Reads decisions from a byte string; zeros once it runs out.  These are
    the ``sdpa.testing.Choices`` the generators there take."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos < len(self.data):
            self.pos += 1
            return self.data[self.pos - 1]
        return 0

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""
        span = hi - lo + 1
        if span <= 1:
            return lo
        x = 0
        for _ in range(1 if span <= 256 else 2 if span <= 65536 else 4):
            x = (x << 8) | self.byte()
        return lo + x % span

    def boolean(self) -> bool:
        return bool(self.byte() & 1)

    def pick(self, seq):
        return seq[self.integer(0, len(seq) - 1)]

    def one_in(self, n: int) -> bool:
        return self.integer(0, n - 1) == 0


class Mistake(Exception):
    """Raised by the decoder when it cannot apply the chosen mistake."""


DTYPES = FLOAT_DTYPES * 3 + OTHER_DTYPES + ["uint16"]
MAGNITUDES = [1.0, 1.0, 1e-3, 3.0]  # moderate: finite problems are compared
MISTAKES = [
    "E", "S", "heads", "gqa", "ndim", "dtype", "mask-shape", "mask-dtype", "causal", "scale",
    "threads", "key-lengths", "out-shape", "out-dtype", "out-readonly", "out-overlap", "batch",
    "window", "softcap", "head-values",
]


def lay_out(r: Bytes, x: np.ndarray):
    """The values of ``x`` in a layout chosen by the bytes."""
    kind = r.integer(0, 7)
    if kind == 0 or x.ndim == 0:
        return x
    if kind == 1:
        return place(x, {"kind": "fortran"})
    if kind == 2:
        return place(x, {"kind": "unaligned"})
    if kind == 3 and 0 < x.size <= 4096:  # (an empty array has no list form)
        return place(x, {"kind": "list"})
    perm = list(range(x.ndim))
    for i in range(x.ndim - 1, 0, -1):  # a permutation from the bytes
        j = r.integer(0, i)
        perm[i], perm[j] = perm[j], perm[i]
    steps = [r.pick([1, 1, 2]) for _ in range(x.ndim)]
    flips = [r.one_in(3) for _ in range(x.ndim)]
    layout = {"kind": "strided", "perm": perm, "steps": steps, "flips": flips, "readonly": r.one_in(4)}
    return place(x, layout)


def decode(data: bytes) -> dict:
    """One call's arguments, and what is expected of it."""
    r = Bytes(data)
    rng = np.random.default_rng(r.integer(0, 2**32 - 1))
    regime = r.integer(0, 9)
    if regime < 7:
        L, S = r.integer(0, 12), r.pick([r.integer(0, 40), 0, 1, 65])
        E, Ev = r.integer(0, 24), r.integer(0, 24)
        batch = tuple(r.pick([0, 1, 2, 3]) for _ in range(r.integer(0, 2)))
    elif regime < 9:  # the row path and its 1024-key chunks
        L, S, E, Ev = r.integer(1, 3), r.integer(0, 2100), r.integer(1, 40), r.integer(1, 24)
        batch = tuple(r.pick([1, 2]) for _ in range(r.integer(0, 1)))
    else:  # several query and key blocks
        L, S, E, Ev = r.integer(13, 150), r.integer(0, 150), r.integer(1, 70), r.integer(1, 40)
        batch = tuple(r.pick([1, 2]) for _ in range(r.integer(0, 1)))

    mode = r.pick(["same", "gqa", "q1", "kv1", "2d"])
    gqa = False
    if mode == "2d" and not batch:
        H, hq, hk, hv = 1, None, None, None
    elif mode == "gqa":
        hkv, group = r.integer(1, 3), r.integer(1, 3)
        H, hq, gqa = hkv * group, hkv * group, True
        hk, hv = r.pick([(hkv, hkv), (1, hkv), (hkv, 1)])
    elif mode == "q1":
        H = r.integer(2, 3)
        hq, hk, hv = 1, H, H
    elif mode == "kv1":
        H = r.integer(2, 3)
        hq, hk, hv = H, 1, 1
    else:
        H = r.integer(0, 3)
        hq = hk = hv = H
    if int(np.prod(batch, dtype=np.int64)) * max(H, 1) * max(L, 1) * max(S, 1) > 100_000:
        S = min(S, 8)

    mixed = r.one_in(4)
    dts = [r.pick(DTYPES) for _ in range(3 if mixed else 1)] * (1 if mixed else 3)
    specials = r.one_in(3)
    mistake = r.pick(MISTAKES) if r.one_in(8) else None

    def shape_of(h, rows, cols):
        if h is None:
            return (rows, cols)
        return tuple(n if r.boolean() else 1 for n in batch) + (h, rows, cols)

    def values(shape, dtype, role):
        kinds = SPECIALS if specials else ()
        return random_values(rng, shape, dtype, role, kinds, choices=r, magnitudes=MAGNITUDES)

    full = {
        "q": values(shape_of(hq, L, E), dts[0], "q"),
        "k": values(shape_of(hk, S, E), dts[1], "k"),
        "v": values(shape_of(hv, S, Ev), dts[2], "v"),
    }
    shaped = {}
    for name, x in full.items():
        if x.ndim > 2 and r.one_in(3):  # leave out leading size-1 dims
            while x.ndim > 2 and x.shape[0] == 1 and r.boolean():
                x = x[0]
        shaped[name] = x
    # the shapes sdpa will see
    bshape = tuple(np.broadcast_shapes(*(a.shape[:-3] for a in shaped.values())))
    has_heads = max(a.ndim for a in shaped.values()) >= 3
    out_shape = bshape + ((H,) if has_heads else ()) + (L, Ev)
    weights_shape = out_shape[:-1] + (S,)
    cdtype = result_dtype(*full.values())  # until a list layout turns something into float64

    kwargs = {}
    causal = r.pick([False, False, True, "top_left", "bottom_right"])
    kwargs["is_causal"] = causal
    mask = None
    mkind = r.pick([None, None, "bool", "float"])
    if mkind:
        mshape = broadcastable_shape(r, weights_shape, len(weights_shape))
        if mkind == "bool":
            mask = rng.random(mshape) < r.pick([0.0, 0.6, 1.0])
        else:
            mask = rng.standard_normal(mshape).astype(np.float16).astype(np.float64)
            mask[rng.random(mshape) < 0.3] = -np.inf
            if specials and mask.size:
                choices = [-np.inf, 6e4, np.inf, np.nan]
                mask[tuple(int(rng.integers(0, n)) for n in mshape)] = r.pick(choices)
            mask = mask.astype(r.pick([cdtype, np.float16, np.float64]))
        kwargs["attn_mask"] = mask
    kwargs["enable_gqa"] = gqa or (r.one_in(4) and mode == "same" and H > 0)
    if r.one_in(4):
        kwargs["scale"] = r.pick([0.0, -0.5, 0.3, 2.0, 1e-3])
    if r.one_in(4):
        lengths = rng.integers(0, S + 3, size=broadcastable_shape(r, bshape, len(bshape)))
        kwargs["key_lengths"] = lengths.astype(r.pick(["int64", "int32"]))
    kwargs["num_threads"] = r.pick([None, 1, 2, 3])
    kwargs["return_weights"] = r.one_in(3)
    kwargs["return_lse"] = r.one_in(4)
    # the model variants; slopes and sinks finite unless special values are on
    if r.one_in(3):
        kwargs["window"] = tuple(r.pick([-1, 0, 1, 3, r.integer(0, L + S + 1)]) for _ in range(2))
    if r.one_in(4):
        kwargs["softcap"] = r.pick(SOFTCAPS)
    head_target = out_shape[:-2] if has_heads else (1,)  # (batch..., query heads)
    for name in ("alibi_slopes", "sinks"):
        if r.one_in(4):
            shape = broadcastable_shape(r, head_target, len(head_target))
            x = np.array(rng.random(shape) / 2 if name == "alibi_slopes" else 3 * rng.standard_normal(shape))
            if specials and x.size:
                x[tuple(int(rng.integers(0, n)) for n in shape)] = r.pick([np.nan, -np.inf, 6e4, -6e4])
            kwargs[name] = x.astype(r.pick(["float64", "float32", "float16"]))
    if r.one_in(4):
        out = np.zeros(tuple(reversed(out_shape)), dtype=cdtype).T  # reversed strides
        kwargs["out"] = out

    args = {name: lay_out(r, x) for name, x in shaped.items()}
    if mask is not None and r.boolean():
        kwargs["attn_mask"] = lay_out(r, mask)

    if any(isinstance(a, list) for a in args.values()):  # lists of numbers are float64 (or int)
        cdtype = np.dtype(np.float64)
        kwargs.pop("out", None)
    if mistake is not None:
        apply_mistake(mistake, args, kwargs, out_shape, rng)
    return dict(args=args, kwargs=kwargs, out_shape=out_shape, cdtype=cdtype, mistake=mistake,
                specials=specials)


def apply_mistake(kind, args, kwargs, out_shape, rng):
    q, k, v = (np.asarray(args[n]) for n in "qkv")
    if kind == "E":
        args["k"] = np.zeros(k.shape[:-1] + (k.shape[-1] + 1,), np.float32)
    elif kind == "S":
        args["v"] = np.zeros(v.shape[:-2] + (v.shape[-2] + 1, v.shape[-1]), np.float32)
    elif kind == "heads":
        args["q"] = np.zeros((2, 5, 3, 4))
        args["k"] = np.zeros((2, 3, 6, 4))
        args["v"] = np.zeros((2, 3, 6, 4))
        kwargs.pop("attn_mask", None)
        kwargs.pop("out", None)
        kwargs.pop("key_lengths", None)
        kwargs["enable_gqa"] = bool(rng.integers(0, 2))
    elif kind == "gqa":
        args["q"] = np.zeros((3, 2, 4))
        args["k"] = np.zeros((2, 2, 4))
        args["v"] = np.zeros((2, 2, 4))
        kwargs.update(enable_gqa=True, attn_mask=None, out=None, key_lengths=None)
    elif kind == "ndim":
        args["q"] = np.zeros(q.shape[-1:], np.float32)
    elif kind == "dtype":
        bad = [np.complex64, object, "U3", "datetime64[s]"]
        if np.dtype(np.longdouble).itemsize > 8:
            bad.append(np.longdouble)
        args["v"] = np.zeros(v.shape, dtype=bad[int(rng.integers(0, len(bad)))])
        if rng.integers(0, 2):
            args["q"] = np.full(q.shape, 2**60, dtype=np.int64)
    elif kind == "mask-shape":
        kwargs["attn_mask"] = np.ones(out_shape[:-1] + (k.shape[-2] + 2,), dtype=bool)
    elif kind == "mask-dtype":
        kwargs["attn_mask"] = np.ones(out_shape[:-1] + (k.shape[-2],), dtype=np.int32)
    elif kind == "causal":
        kwargs["is_causal"] = ["bottom-right", 1, None, 0.5][int(rng.integers(0, 4))]
    elif kind == "scale":
        kwargs["scale"] = ["1", True, [1.0], 1j][int(rng.integers(0, 4))]
    elif kind == "threads":
        kwargs["num_threads"] = [0, -1, 1.5, True, "2"][int(rng.integers(0, 5))]
    elif kind == "key-lengths":
        bad = [np.array(-1), np.array(1.5), np.zeros((7, 5), np.int64)]
        kwargs["key_lengths"] = bad[int(rng.integers(0, 3))]
    elif kind == "out-shape":
        kwargs["out"] = np.zeros(out_shape[:-1] + (out_shape[-1] + 1,), np.float64)
    elif kind == "out-dtype":
        kwargs["out"] = np.zeros(out_shape, np.float16)
    elif kind == "out-readonly":
        out = np.zeros(out_shape, np.float64)
        out.flags.writeable = False
        kwargs["out"] = out
    elif kind == "out-overlap":
        base = np.zeros((4, 5, 6))
        args["q"] = base[:, :, :4]
        args["k"] = np.zeros((4, 3, 4))
        args["v"] = np.zeros((4, 3, 2))
        kwargs.update(out=base[:, :, 3:5], attn_mask=None, key_lengths=None, enable_gqa=False)
    elif kind == "batch":
        args["q"] = np.zeros((1,) * 9 + (2, 3))
        kwargs.pop("out", None)
    elif kind == "window":
        kwargs["window"] = [(-2, 0), (0, 1.5), (3,), 4, (True, 0)][int(rng.integers(0, 5))]
    elif kind == "softcap":
        kwargs["softcap"] = [0.0, -1.0, np.nan, np.inf, "1", True][int(rng.integers(0, 6))]
    elif kind == "head-values":
        bad = [np.ones(out_shape[:-2][-1:] + (7,)), np.ones(3, bool), "abc", np.ones(2, complex)]
        kwargs[["alibi_slopes", "sinks"][int(rng.integers(0, 2))]] = bad[int(rng.integers(0, 4))]


# --------------------------------------------------------------------------- the checks


def snapshot(x):
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else None


def TestOneInput(data: bytes) -> None:
    p = decode(data)
    args, kwargs = p["args"], p["kwargs"]
    before = {n: snapshot(a) for n, a in list(args.items()) + [("mask", kwargs.get("attn_mask"))]}
    try:
        with np.errstate(all="ignore"):
            result = sdpa.scaled_dot_product_attention(args["q"], args["k"], args["v"], **kwargs)
    except ALLOWED as exc:
        if p["mistake"] is None:
            raise AssertionError(f"a valid call raised {type(exc).__name__}: {exc}") from exc
        return
    for name, a in list(args.items()) + [("mask", kwargs.get("attn_mask"))]:
        if before[name] is not None:
            assert np.array_equal(a, before[name], equal_nan=True), f"{name} was modified"
    if p["mistake"] is not None:
        return  # some mistakes are not mistakes for every shape; that call worked

    extra = kwargs["return_weights"] or kwargs["return_lse"]
    out = result[0] if extra else result
    assert out.shape == p["out_shape"], (out.shape, p["out_shape"])
    assert out.dtype == p["cdtype"], (out.dtype, p["cdtype"])
    if kwargs.get("out") is not None:
        assert out is kwargs["out"]

    other = {None: 1, 1: 2, 2: 3, 3: 1}[kwargs["num_threads"]]
    again = sdpa.scaled_dot_product_attention(
        args["q"], args["k"], args["v"], **{**kwargs, "out": None, "num_threads": other}
    )
    again = again if isinstance(again, tuple) else (again,)
    first = result if isinstance(result, tuple) else (result,)
    for a, b in zip(first, again):
        assert np.array_equal(a, b, equal_nan=True), "results differ between thread counts"

    # without special values every input is finite and moderate: compare
    if not p["specials"] and out.size:
        assert np.isfinite(out).all(), "finite inputs gave a non-finite result"
        weights = result[1] if kwargs["return_weights"] else None
        lse = result[-1] if kwargs["return_lse"] else None
        variants = {n: kwargs.get(n) for n in ("window", "softcap", "alibi_slopes", "sinks")}
        assert_matches_reference(
            out, weights, args["q"], args["k"], args["v"], kwargs.get("attn_mask"), kwargs["is_causal"],
            kwargs.get("scale"), kwargs["enable_gqa"], kwargs.get("key_lengths"), lse=lse, **variants,
        )


def main() -> None:
    if "--smoke" in sys.argv:
        i = sys.argv.index("--smoke")
        n = int(sys.argv[i + 1]) if len(sys.argv) > i + 1 else 1000
        rng = np.random.default_rng(int(os.environ.get("FUZZ_SEED", "0")))
        for _ in range(n):
            data = rng.integers(0, 256, size=int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
            try:
                TestOneInput(data)
            except BaseException:
                print(f"failing input: {data.hex()}", file=sys.stderr)
                raise
        print(f"{n} inputs ok")
        return
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
