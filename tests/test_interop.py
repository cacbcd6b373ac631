"""Array-likes in without copies: CPU torch tensors, __array__ and __dlpack__ objects.

The C core is handed the arrays it reads; recording them (through
sdpa._core.set_observer) shows whether they are the caller's memory or copies.
"""

import numpy as np
import pytest

import sdpa
from sdpa import _core


@pytest.fixture
def core_inputs():
    """The q, k, v and mask arrays of each call to the C core."""
    seen = []
    _core.set_observer(lambda handed: seen.append({name: handed[name] for name in ("q", "k", "v", "mask")}))
    yield seen
    _core.set_observer(None)


def same_memory(a, b):
    """a and b are the same elements of the same memory (no copy between them)."""
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and all(sa == sb for sa, sb, n in zip(a.strides, b.strides, a.shape) if n > 1)
        and np.shares_memory(a, b)
    )


class DLPackOnly:
    """Exposes an array through __dlpack__ / __dlpack_device__ and nothing else."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class ArrayOnly:
    """Exposes an ndarray through __array__ and nothing else."""

    def __init__(self, array):
        self._array = array

    def __array__(self, dtype=None, copy=None):
        if dtype is not None and np.dtype(dtype) != self._array.dtype:
            raise AssertionError("sdpa asked for a converted copy")
        return self._array


def qkv(rng, dtype=np.float32, shape=(2, 3, 9, 8)):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# --------------------------------------------------------------------------- NumPy-level


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dlpack_only_objects_are_read_in_place(rng, core_inputs, dtype):
    q, k, v = qkv(rng, dtype)
    k_view = k.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2)  # strided
    mask = rng.random((3, 9, 9)) < 0.8
    mask[..., 0] = True
    out = sdpa.scaled_dot_product_attention(DLPackOnly(q), DLPackOnly(k_view), DLPackOnly(v), DLPackOnly(mask))
    np.testing.assert_array_equal(out, sdpa.scaled_dot_product_attention(q, k_view, v, mask))
    got = core_inputs[0]
    assert same_memory(got["q"], q) and same_memory(got["k"], k_view) and same_memory(got["v"], v)
    assert same_memory(got["mask"], mask)


def test_dlpack_only_float_mask_and_key_lengths(rng):
    q, k, v = qkv(rng)
    fmask = np.where(rng.random((9, 9)) < 0.8, 0.0, -np.inf).astype(np.float32)
    fmask[:, 0] = 0.0
    lengths = np.array([9, 4])
    out = sdpa.scaled_dot_product_attention(
        DLPackOnly(q), k, v, DLPackOnly(fmask), key_lengths=DLPackOnly(lengths)
    )
    np.testing.assert_array_equal(out, sdpa.scaled_dot_product_attention(q, k, v, fmask, key_lengths=lengths))


def test_array_only_objects_are_read_in_place(rng, core_inputs):
    q, k, v = qkv(rng, np.float64)
    out = sdpa.scaled_dot_product_attention(ArrayOnly(q), ArrayOnly(k[:, :, ::2]), ArrayOnly(v[:, :, ::2]))
    np.testing.assert_array_equal(out, sdpa.scaled_dot_product_attention(q, k[:, :, ::2], v[:, :, ::2]))
    got = core_inputs[0]
    assert same_memory(got["q"], q) and same_memory(got["k"], k[:, :, ::2])


def test_numpy_views_are_read_in_place(rng, core_inputs):
    q, k, v = qkv(rng, np.float32, (2, 17, 3, 8))
    views = [a.transpose(0, 2, 1, 3)[..., ::-1, :] for a in (q, k, v)]
    views[0].flags.writeable = False
    sdpa.scaled_dot_product_attention(*views)
    got = core_inputs[0]
    for name, view in zip("qkv", views):
        assert same_memory(got[name], view)


def test_dlpack_errors_name_the_argument():
    class Broken:
        def __dlpack__(self, **kwargs):
            raise BufferError("no export today")

        def __dlpack_device__(self):
            return (1, 0)

    q = np.ones((2, 4))
    with pytest.raises(TypeError, match=r"key: cannot read it through __dlpack__ \(.*no export today"):
        sdpa.scaled_dot_product_attention(q, Broken(), q)


# --------------------------------------------------------------------------- torch tensors


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_torch_tensors_are_read_in_place(torch, core_inputs, dtype_name):
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 33, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, 33, 4, 16, generator=gen, dtype=dtype).transpose(1, 2)  # strided view
    v = torch.randn(2, 1, 40, 8, generator=gen, dtype=dtype)[:, :, 7:].expand(2, 4, 33, 8)  # offset, stride 0
    mask = torch.rand(4, 33, 33, generator=gen) < 0.8
    mask[..., 0] = True
    out = sdpa.scaled_dot_product_attention(q, k, v, mask)
    got = core_inputs[0]
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        arr = got[name]
        assert arr.__array_interface__["data"][0] == t.data_ptr(), name
        assert np.shares_memory(arr, t.numpy()), name
        assert same_memory(arr, t.numpy()), name
    np.testing.assert_array_equal(
        out, sdpa.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    )


def test_torch_writes_after_the_call_are_not_seen_by_the_result(torch):
    q = torch.ones(2, 4, 8)
    out = sdpa.scaled_dot_product_attention(q, q, q)
    q.fill_(5.0)
    np.testing.assert_array_equal(out, np.ones((2, 4, 8), dtype=np.float32))


def test_torch_float16_is_read_in_place(torch, core_inputs):
    q = torch.randn(2, 4, 8).half()
    out = sdpa.scaled_dot_product_attention(q, q, q)
    assert out.dtype == np.float16
    assert core_inputs[0]["q"].__array_interface__["data"][0] == q.data_ptr()  # no converted copy
    # float32 arithmetic on the same values, rounded once to float16
    np.testing.assert_array_equal(out, sdpa.scaled_dot_product_attention(*(q.float().numpy(),) * 3).astype(np.float16))


def test_torch_tensor_through_dlpack_only(torch, core_inputs):
    t = torch.randn(2, 3, 9, 8)
    sdpa.scaled_dot_product_attention(DLPackOnly(t), t, t)
    assert core_inputs[0]["q"].__array_interface__["data"][0] == t.data_ptr()


def test_torch_tensor_requiring_grad_is_refused(torch):
    q = torch.randn(2, 4, 8, requires_grad=True)
    with pytest.raises(TypeError, match="query"):
        sdpa.scaled_dot_product_attention(q, q.detach(), q.detach())
    # detached, the same memory is read
    sdpa.scaled_dot_product_attention(q.detach(), q.detach(), q.detach())
