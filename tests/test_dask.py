"""sdpa.dask: attention over keys and values chunked across a dask cluster.

The chunking cases run on dask's synchronous scheduler; the distribution cases
on a real distributed.LocalCluster with 2 worker processes: the same results as
the single call, keys and values that stay on their workers, and a worker dying
mid-computation.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import sdpa

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")
import sdpa.dask as sd  # noqa: E402

# the helpers below are sent to the worker processes by value: they cannot import this file
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _arrays(rng, q_shape, k_shape, ev, dtype=np.float32):
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(k_shape[:-1] + (ev,)).astype(dtype)
    return q, k, v


def _close(actual, expected, dtype=np.float32):
    tol = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}.get(np.dtype(dtype), 1e-2)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


CASES = [
    # (q shape, k shape, Ev, chunks of k, kwargs)
    ((2, 4, 6, 16), (2, 4, 90, 16), 16, (1, 2, 25, 16), {}),
    ((2, 4, 6, 16), (2, 4, 90, 16), 16, (2, 4, 30, 16), {"is_causal": True}),
    ((2, 4, 6, 16), (2, 4, 90, 16), 16, (2, 4, 30, 16), {"is_causal": "bottom_right"}),
    ((1, 2, 50, 8), (1, 2, 20, 8), 8, (1, 1, 7, 8), {"is_causal": "bottom_right"}),  # L > S
    ((1, 2, 50, 8), (1, 2, 20, 8), 8, (1, 1, 7, 8), {"is_causal": True}),
    ((2, 8, 3, 16), (2, 2, 70, 16), 12, (1, 1, 20, 16), {"enable_gqa": True}),
    ((2, 8, 3, 16), (2, 2, 70, 16), 12, (1, 1, 20, 16), {"enable_gqa": True, "is_causal": "bottom_right"}),
    ((2, 4, 5, 16), (2, 4, 64, 16), 16, (1, 4, 16, 8), {"key_lengths": np.array([40, 3])}),
    ((2, 4, 5, 16), (2, 4, 64, 16), 16, (2, 4, 16, 16),
     {"key_lengths": np.array([[0], [17]]).reshape(2), "is_causal": "bottom_right"}),
    ((3, 16), (40, 16), 16, (9, 16), {}),  # no head dim
    ((1, 4, 16), (2, 4, 40, 16), 16, (1, 2, 9, 16), {}),  # query batch broadcast
    ((2, 4, 4, 16), (2, 1, 40, 16), 16, (1, 1, 13, 16), {}),  # key heads broadcast
    ((2, 4, 4, 16), (2, 4, 0, 16), 16, (1, 4, 1, 16), {}),  # no keys
]


@pytest.mark.parametrize("q_shape, k_shape, ev, chunks, kwargs", CASES)
def test_chunked_equals_the_single_call(rng, q_shape, k_shape, ev, chunks, kwargs):
    q, k, v = _arrays(rng, q_shape, k_shape, ev)
    kd = da.from_array(k, chunks=chunks)
    vd = da.from_array(v, chunks=chunks[:-1] + (ev,))
    qd = da.from_array(q, chunks=q.shape[:-2] + (max(1, q.shape[-2] // 2), q.shape[-1]))  # L chunked
    out, lse = sd.scaled_dot_product_attention(qd, kd, vd, return_lse=True, **kwargs)
    assert out.shape == q.shape[:-1] + (ev,) or out.ndim == max(q.ndim, k.ndim)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    want, want_lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got_lse.shape == want_lse.shape and got_lse.dtype == want_lse.dtype
    _close(got, want)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    seen = ~np.isneginf(want_lse)
    _close(got_lse[seen], want_lse[seen])


@pytest.mark.parametrize("as_dask", [True, False])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "row"])
def test_chunked_mask(rng, mask_kind, as_dask):
    q, k, v = _arrays(rng, (2, 4, 6, 16), (2, 2, 80, 16), 16)
    if mask_kind == "bool":
        mask = rng.random((2, 4, 6, 80)) > 0.4
        mask[0, 0, 0] = False  # a row that sees no key
    elif mask_kind == "float":
        mask = rng.standard_normal((1, 4, 6, 80)).astype(np.float32)
    else:
        mask = rng.random((80,)) > 0.5  # one row broadcast to every query
    md = da.from_array(mask, chunks=mask.shape[:-1] + (17,)) if as_dask else mask
    kd = da.from_array(k, chunks=(1, 2, 20, 16))
    vd = da.from_array(v, chunks=(1, 2, 20, 16))
    got = sd.scaled_dot_product_attention(q, kd, vd, attn_mask=md, enable_gqa=True).compute(scheduler="sync")
    want = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    _close(got, want)


@pytest.mark.parametrize("kv_heads", [(1, 4), (4, 1), (1, 2)])
def test_chunked_gqa_with_a_broadcast_key_or_value_head(rng, kv_heads):
    """enable_gqa with one of key and value broadcasting its single head: the
    group is that of the heads both have, as the single call derives it."""
    hk, hv = kv_heads
    q = rng.standard_normal((1, 4, 3, 16)).astype(np.float32)
    k = rng.standard_normal((1, hk, 40, 16)).astype(np.float32)
    v = rng.standard_normal((1, hv, 40, 16)).astype(np.float32)
    kd = da.from_array(k, chunks=(1, hk, 16, 16))
    vd = da.from_array(v, chunks=(1, hv, 16, 16))
    got = sd.scaled_dot_product_attention(q, kd, vd, enable_gqa=True).compute(scheduler="sync")
    _close(got, sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_chunked_dtypes(rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v = _arrays(rng, (1, 4, 5, 32), (1, 4, 96, 32), 32, np.float32)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    kd, vd = (da.from_array(a, chunks=(1, 4, 32, 32)) for a in (k, v))
    got = sd.scaled_dot_product_attention(q, kd, vd, is_causal="bottom_right").compute(scheduler="sync")
    want = sdpa.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")
    assert got.dtype == want.dtype
    # 16-bit: the partials are merged in float32 and rounded once, so the result is the
    # float64 reference rounded, within a unit of the single call's rounding
    ref = sdpa.reference.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v)), is_causal="bottom_right"
    )
    tol = 1e-12 if np.dtype(dtype) == np.float64 else (1e-2 if np.dtype(dtype).itemsize == 2 else 0)
    np.testing.assert_allclose(got.astype(np.float64), ref, atol=tol, rtol=tol)
    _close(got.astype(np.float64), want.astype(np.float64), dtype)


def test_causal_chunks_no_row_can_see_are_not_computed(rng):
    q, k, v = _arrays(rng, (1, 2, 4, 8), (1, 2, 100, 8), 8)
    kd, vd = (da.from_array(a, chunks=(1, 2, 10, 8)) for a in (k, v))
    out = sd.scaled_dot_product_attention(q, kd, vd, is_causal=True)  # rows 0..3 see keys 0..3
    names = {key[0] if isinstance(key, tuple) else key for key in dict(out.__dask_graph__())}
    assert sum(str(n).startswith("_partial") for n in names) == 1
    _close(out.compute(scheduler="sync"), sdpa.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("split_every", [2, 3, 8])
def test_tree_of_merges(rng, split_every):
    q, k, v = _arrays(rng, (1, 2, 3, 8), (1, 2, 130, 8), 8)
    kd, vd = (da.from_array(a, chunks=(1, 2, 10, 8)) for a in (k, v))
    got = sd.scaled_dot_product_attention(q, kd, vd, split_every=split_every).compute(scheduler="sync")
    _close(got, sdpa.scaled_dot_product_attention(q, k, v))


def test_bad_arguments(rng):
    q, k, v = _arrays(rng, (1, 2, 3, 8), (1, 2, 10, 8), 8)
    kd = da.from_array(k, chunks=(1, 2, 5, 8))
    with pytest.raises(ValueError, match="split_every"):
        sd.scaled_dot_product_attention(q, kd, v, split_every=1)
    with pytest.raises(ValueError, match="attn_mask"):
        sd.scaled_dot_product_attention(q, kd, v, attn_mask=np.ones((3, 9), bool))
    with pytest.raises(TypeError, match="attn_mask"):
        sd.scaled_dot_product_attention(q, kd, v, attn_mask=np.ones((3, 10), np.int32))
    with pytest.raises(ValueError, match="key_lengths"):
        sd.scaled_dot_product_attention(q, kd, v, key_lengths=np.array([-1]))
    with pytest.raises(TypeError, match="key_lengths"):
        sd.scaled_dot_product_attention(q, kd, v, key_lengths=np.array([1.5]))
    with pytest.raises(ValueError, match="is_causal"):
        sd.scaled_dot_product_attention(q, kd, v, is_causal="diagonal")
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        sd.scaled_dot_product_attention(q, kd[kd[0, 0, :, 0] > 0], v)
    with pytest.raises(ValueError):
        sd.scaled_dot_product_attention(q, kd[..., :4], v)


def test_importing_sdpa_does_not_import_dask():
    code = "import sys, sdpa; print(json.dumps('dask' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


# ---- a real cluster: 2 worker processes ------------------------------------------------

def _cluster():
    return distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
        silence_logs=logging.CRITICAL,
    )


@pytest.fixture(scope="module")
def client():
    with _cluster() as cluster, distributed.Client(cluster) as c:
        yield c


def _workers(client):
    return sorted(client.nthreads())  # asked of the scheduler (scheduler_info() may be a stale cache)


def _placed(client, a, chunk, workers):
    """a (..., S, E) as a dask array whose key chunk i lives on workers[i % len]."""
    pieces = []
    for i, s0 in enumerate(range(0, a.shape[-2], chunk)):
        block = np.ascontiguousarray(a[..., s0:s0 + chunk, :])
        future = client.scatter(block, workers=[workers[i % len(workers)]])
        pieces.append(da.from_delayed(dask.delayed(future), block.shape, dtype=block.dtype))
    return da.concatenate(pieces, axis=-2)


@pytest.mark.parametrize("kwargs", [
    {}, {"is_causal": True}, {"is_causal": "bottom_right"}, {"enable_gqa": True},
    {"key_lengths": np.array([300, 41])}, {"mask": True},
])
def test_cluster_equals_the_single_call(client, rng, kwargs):
    kwargs = dict(kwargs)
    hq = 8 if kwargs.get("enable_gqa") else 4
    q, k, v = _arrays(rng, (2, hq, 3, 32), (2, 4, 400, 32), 32)
    workers = _workers(client)
    kd, vd = (_placed(client, a, 100, workers) for a in (k, v))
    if kwargs.pop("mask", False):
        mask = rng.random((2, 1, 3, 400)) > 0.5
        kwargs["attn_mask"] = da.from_array(mask, chunks=(2, 1, 3, 100))
    got, lse = client.compute(sd.scaled_dot_product_attention(q, kd, vd, return_lse=True, **kwargs), sync=True)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = mask
    want, want_lse = sdpa.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    _close(got, want)
    _close(lse, want_lse)


def test_keys_and_values_stay_on_their_workers(client, rng):
    """The bytes workers send each other while computing are a small fraction of
    one key chunk: only the partial results (and the merges') move."""
    chunk = 8192
    q, k, v = _arrays(rng, (1, 8, 4, 64), (1, 4, 4 * chunk, 64), 64)
    workers = _workers(client)
    kd, vd = (_placed(client, a, chunk, workers) for a in (k, v))

    def clear(dask_worker):
        dask_worker.transfer_incoming_log.clear()
        dask_worker.transfer_outgoing_log.clear()

    def moved(dask_worker):
        return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)

    client.run(clear)
    got = client.compute(sd.scaled_dot_product_attention(q, kd, vd, enable_gqa=True), sync=True)
    total = sum(client.run(moved).values())
    chunk_bytes = k[..., :chunk, :].nbytes
    keys = client.run(lambda dask_worker: [list(e["keys"]) for e in dask_worker.transfer_incoming_log])
    assert total < 0.05 * chunk_bytes, f"{total} bytes moved between workers; a key chunk is {chunk_bytes}: {keys}"
    _close(got, sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def _kill(client, worker):
    """SIGKILL the worker process (its nanny starts a new one, at a new address)."""
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)


def _slow_block(seed, shape, delay):
    time.sleep(delay)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_a_worker_dying_mid_computation_gives_the_right_result_or_an_error(rng):
    shape = (1, 2, 64, 16)
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    seeds = range(8)

    def lazy(offset):
        return da.concatenate([
            da.from_delayed(dask.delayed(_slow_block, pure=True)(s + offset, shape, 0.3), shape, np.float32)
            for s in seeds
        ], axis=2)

    k = np.concatenate([_slow_block(s, shape, 0) for s in seeds], axis=2)
    v = np.concatenate([_slow_block(s + 100, shape, 0) for s in seeds], axis=2)
    with _cluster() as cluster, distributed.Client(cluster) as c:
        future = c.compute(sd.scaled_dot_product_attention(q, lazy(0), lazy(100)))
        time.sleep(0.8)  # some blocks are done, others are running
        _kill(c, _workers(c)[0])
        want = sdpa.scaled_dot_product_attention(q, k, v)
        try:
            _close(future.result(timeout=120), want)
        except distributed.KilledWorker:
            # a clear error is acceptable (a task's worker died too often); a
            # wrong result is not, and the cluster must still compute right
            _close(c.compute(sd.scaled_dot_product_attention(q, lazy(0), lazy(100))).result(timeout=120), want)


# ---- ShardedKVCache -------------------------------------------------------------------

def _kv(rng, T, heads=2, e=16):
    return (rng.standard_normal((1, heads, T, e)).astype(np.float32),
            rng.standard_normal((1, heads, T, e)).astype(np.float32))


@pytest.mark.parametrize("dtype, group", [(np.float32, None), ("int8", None), ("int8", 8), ("bfloat16", None),
                                          ("int4", 8), ("float8_e4m3fn", None)])
def test_sharded_cache_equals_one_cache(client, rng, dtype, group):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    cache = sd.ShardedKVCache(1, 2, 100, 16, dtype=dtype, group_size=group, client=client)
    one = sdpa.KVCache(1, 2, 100, 16, dtype=dtype, group_size=group)
    try:
        assert cache.workers == _workers(client) and cache.shard_capacity == 50
        for T in (30, 40, 1, 19):  # the second append spans both shards
            k, v = _kv(rng, T)
            cache.append(k, v)
            one.append(k, v)
        assert cache.shard_lengths == [50, 40] and len(cache) == 90
        np.testing.assert_array_equal(cache.keys, one.keys)
        np.testing.assert_array_equal(cache.values, one.values)
        assert cache.nbytes == one.nbytes
        for L, causal in ((1, "bottom_right"), (5, "bottom_right"), (5, True), (5, False)):
            q = rng.standard_normal((1, 4, L, 16)).astype(np.float32)
            got, lse = cache.attend(q, is_causal=causal, return_lse=True)
            want, want_lse = one.attend(q, is_causal=causal, return_lse=True)
            assert got.dtype == want.dtype
            _close(got, want)
            _close(lse, want_lse)
        mask = rng.random((1, 1, 2, 90)) > 0.3
        q = rng.standard_normal((1, 4, 2, 16)).astype(np.float32)
        _close(cache.attend(q, mask, is_causal=False), one.attend(q, mask, is_causal=False))
        cache.reset()
        assert len(cache) == 0 and not cache.attend(q).any()
    finally:
        cache.close()


def test_sharded_cache_bad_input_changes_nothing(client, rng):
    with sd.ShardedKVCache(1, 2, 20, 16, dtype="int8", client=client) as cache:
        k, v = _kv(rng, 15)
        cache.append(k, v)
        before = cache.keys
        with pytest.raises(sdpa.KVCacheFullError):
            cache.append(*_kv(rng, 6))
        with pytest.raises(ValueError, match=r"k: expected shape \(1, 2, T, 16\)"):
            cache.append(*_kv(rng, 2, heads=3))
        with pytest.raises(ValueError):
            cache.append(k[:, :, :2], v[:, :, :3])
        bad = k[:, :, :3].copy()
        bad[0, 0, 2, 0] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            cache.append(bad, bad)
        with pytest.raises(ValueError, match="query"):
            cache.attend(np.zeros((1, 3, 1, 16), np.float32))
        with pytest.raises(ValueError, match="attn_mask"):
            cache.attend(np.zeros((1, 2, 1, 16), np.float32), np.ones((1, 1, 1, 7), bool))
        assert cache.shard_lengths == [10, 5]
        np.testing.assert_array_equal(cache.keys, before)


@pytest.mark.parametrize("capacity, error, match", [
    (-1, ValueError, "capacity: must be >= 0, got -1"),
    (-3, ValueError, "capacity: must be >= 0, got -3"),
    (2.5, TypeError, "capacity: expected an int, got float"),
    ("10", TypeError, "capacity: expected an int, got str"),
    (True, TypeError, "capacity: expected an int, got bool"),
])
def test_sharded_cache_checks_capacity_on_the_client(capacity, error, match):
    """KVCache's errors, raised here before any shard is made: the client given
    is a stand-in that fails if it is used at all."""
    with pytest.raises(error, match=match):
        sd.ShardedKVCache(1, 2, capacity, 16, client=object())
    with pytest.raises(error, match=match):
        sdpa.KVCache(1, 2, capacity, 16)


@pytest.mark.parametrize("workers, error, match", [
    ("tcp://127.0.0.1:1", TypeError, "workers: expected a sequence"),
    ([1, 2], TypeError, "workers: expected worker addresses"),
    ([], ValueError, "workers: expected at least one"),
])
def test_sharded_cache_checks_workers_on_the_client(workers, error, match):
    with pytest.raises(error, match=match):
        sd.ShardedKVCache(1, 2, 8, 16, client=object(), workers=workers)


def test_sharded_cache_worker_lost_is_an_error():
    """A call to a killed worker fails once connecting to it times out
    (distributed.comm.timeouts.connect, 30 s by default; 3 s here)."""
    rng = np.random.default_rng(5)
    with dask.config.set({"distributed.comm.timeouts.connect": "3s"}), _cluster() as cluster, \
            distributed.Client(cluster) as c:
        cache = sd.ShardedKVCache(1, 2, 40, 16, client=c)
        cache.append(*_kv(rng, 30))
        q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
        cache.attend(q)
        _kill(c, cache.workers[1])
        with pytest.raises(sd.ShardLostError, match="shard 1"):
            cache.attend(q)
        with pytest.raises(sd.ShardLostError):  # and every later call
            cache.append(*_kv(rng, 1))


def test_the_long_context_example_runs(capsys):
    """examples/dask_long_context.py at a small size, with its check."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "dask_long_context.py"
    spec = importlib.util.spec_from_file_location("dask_long_context", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--workers", "2", "--keys", "5000", "--steps", "3", "--dtype", "int8", "--check"]) == 0
    shown = capsys.readouterr().out
    assert "dashboard:" in shown and "tokens/s" in shown and "check: max" in shown
