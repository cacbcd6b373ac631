# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The thin layer between Python and the C core.

Both entry points build one ``sdpa_problem`` from NumPy arrays, reading shapes,
strides and dtypes from the arrays themselves, release the GIL around the
computation and turn status codes into exceptions:

``try_attention``
    The whole public call, for the common case: NumPy arrays of one native
    dtype (or a quantized cache's int8 storage and its scales), no conversion
    needed.  Everything is checked here at C speed.  It returns None for
    anything else (other array-likes, dtypes to convert, arguments to
    reject), and the caller takes the general path in
    ``sdpa._api``, which converts what it can and explains what it cannot.
``run``
    Arrays that path has prepared.  It checks again that every operand fits the
    problem its output describes, so no call can make the core read or write
    out of bounds.
"""
cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uintptr_t, int8_t, uint32_t

import threading

cnp.import_array()

MAX_BATCH_DIMS = SDPA_MAX_BATCH_DIMS
ISAS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")

cdef enum:
    # dims of a full operand: batch dims, then (head, row, column)
    MAX_DIMS = SDPA_MAX_BATCH_DIMS + 3
    # thread counts above this are taken as this (a sanity bound, not a tuning knob)
    MAX_THREADS = 1 << 16


# ---------------------------------------------------------------- facts

def version():
    return sdpa_version().decode()


def isa():
    """The kernel set in use."""
    return sdpa_isa().decode()


def isa_env_error():
    """Why the SDPA_ISA environment variable cannot be honoured, or None."""
    cdef const char *msg = sdpa_isa_env_error()
    return None if msg == NULL else msg.decode()


def isa_supported(name):
    return bool(sdpa_isa_supported(name.encode()))


def isa_named():
    """The kernel set in use when it was named (SDPA_ISA, :func:`set_isa`), or
    None when it is the default choice."""
    cdef const char *name = sdpa_isa_named()
    return None if name == NULL else name.decode()


def set_isa(name):
    """Switches the kernel set for later calls; ValueError if this CPU lacks it.
    None returns to the choice made at first use (SDPA_ISA, else the CPU's best)."""
    if name is None:
        sdpa_reset_isa()
        return
    if sdpa_set_isa(name.encode()) != SDPA_OK:
        raise ValueError(f"kernel set {name!r} is unknown or not supported by this CPU; "
                         f"supported: {[n for n in ISAS if isa_supported(n)]}")


def has_openmp():
    return bool(sdpa_has_openmp())


def default_num_threads():
    """The OpenMP default of the calling thread (omp_get_max_threads())."""
    return sdpa_default_num_threads()


def max_threads():
    """The most threads a call uses: 4 per CPU, at least 8 (1 without OpenMP)."""
    return sdpa_max_threads()


def cache_sizes():
    """(L1 data, L2) cache sizes in bytes, as the tiles are chosen from them."""
    cdef int64_t l1d = 0, l2 = 0
    sdpa_cache_sizes(&l1d, &l2)
    return int(l1d), int(l2)


# Set by sdpa.set_num_threads(); 0: the OpenMP default.  Process-wide.
cdef int _threads_setting = 0


cdef int32_t _setting_for(const sdpa_problem *p) noexcept nogil:
    """The thread count of a call without num_threads=: the setting, but, as
    the core does with the OpenMP default, no more threads than
    SDPA_MIN_FLOPS_PER_THREAD of work each (0 where there is no setting)."""
    cdef int32_t n = _threads_setting
    cdef double flops = 2.0 * <double>p.num_heads * <double>p.len_q * <double>p.len_kv \
        * <double>(p.head_dim + p.head_dim_v)
    cdef int i
    if n <= 1:
        return n
    for i in range(p.num_batch_dims):
        flops *= <double>p.batch_shape[i]
    flops /= SDPA_MIN_FLOPS_PER_THREAD
    if flops < n:
        return 1 if flops < 1 else <int32_t>flops
    return n


def set_threads_setting(int n):
    """The thread count calls use when not given one (0: the OpenMP default);
    sdpa._api validates it first."""
    global _threads_setting
    _threads_setting = n


def threads_setting():
    return _threads_setting


# ---------------------------------------------------------------- test hooks

def kernel_exp(name, cnp.ndarray x):
    """e**x by the exp kernel of kernel set `name`, in place on a contiguous
    float32/float64 array (for testing the kernels)."""
    cdef int t = cnp.PyArray_TYPE(x)
    if (t != cnp.NPY_FLOAT32 and t != cnp.NPY_FLOAT64) or not cnp.PyArray_IS_C_CONTIGUOUS(x) \
            or not cnp.PyArray_ISWRITEABLE(x) or not cnp.PyArray_ISNOTSWAPPED(x):
        raise TypeError("kernel_exp: a contiguous, writable float32/float64 array")
    cdef sdpa_status st = sdpa_kernel_exp(name.encode(), SDPA_FLOAT32 if t == cnp.NPY_FLOAT32 else SDPA_FLOAT64,
                                          cnp.PyArray_DATA(x), cnp.PyArray_SIZE(x))
    if st != SDPA_OK:
        raise ValueError(sdpa_status_message(st).decode())


PROFILE_PHASES = ("pack", "qk", "mask", "softmax", "pv", "epilogue")


def profile_start():
    """Zeroes the phase profile of the tiled path and turns its timers on for
    the calls that follow (process-wide)."""
    sdpa_profile_start()


def profile_read():
    """The phase profile since :func:`profile_start`: nanoseconds summed over
    threads per phase (``PROFILE_PHASES``) and ``"scores"``, the scores computed."""
    cdef double ns[8]
    cdef double scores = 0
    cdef int n = sdpa_profile_read(ns, 8, &scores)
    out = {PROFILE_PHASES[i]: ns[i] for i in range(min(n, len(PROFILE_PHASES)))}
    out["scores"] = scores
    return out


def profile_stop():
    """Turns the phase timers off."""
    sdpa_profile_stop()


def panel_rows(name, dtype):
    """The panel width (query rows per score tile) of kernel set `name` for
    float32 or float64 (for tests); 0 for an unknown set."""
    return int(sdpa_testing_panel_rows(name.encode(), SDPA_FLOAT64 if dtype == "float64" else SDPA_FLOAT32))


def kernel_softmax(name, int row, cnp.ndarray s, cnp.ndarray row_max, cnp.ndarray row_sum, cnp.ndarray acc):
    """One online softmax step of kernel set `name`, in place (for tests):
    row 0 (False): its panel softmax, s (n, nr), row_max and row_sum (nr,), acc
    (ev, nr) with nr = panel_rows(name, dtype); row 1 (True): its row_softmax, s
    (n,), row_max and row_sum (1,), acc (ev,); row 2: its bfloat16 softmax_pairs
    on the panel (float32, scale 1), P's pairs written back over s's first
    ceil(n/2) rows as uint32 bits (the rest zero).  All contiguous, writable, of
    one dtype, float32 or float64."""
    if row not in (0, 1, 2):
        raise ValueError("kernel_softmax: row is 0 (panel), 1 (row) or 2 (bfloat16 pairs)")
    cdef int t = cnp.PyArray_TYPE(s)
    arrays = (s, row_max, row_sum, acc)
    if (t != cnp.NPY_FLOAT32 and t != cnp.NPY_FLOAT64) or any(
            cnp.PyArray_TYPE(x) != t or not cnp.PyArray_IS_C_CONTIGUOUS(x) or not cnp.PyArray_ISWRITEABLE(x)
            or not cnp.PyArray_ISNOTSWAPPED(x) for x in arrays):
        raise TypeError("kernel_softmax: contiguous, writable float32/float64 arrays of one dtype")
    nr = 1 if row == 1 else panel_rows(name, "float64" if t == cnp.NPY_FLOAT64 else "float32")
    if nr == 0:
        raise ValueError(f"kernel_softmax: unknown kernel set {name!r}")
    n = s.shape[0]
    ev = acc.shape[0]
    if (s.size != n * nr or row_max.size != nr or row_sum.size != nr or acc.size != ev * nr
            or (row != 1 and (s.ndim != 2 or acc.ndim != 2))):
        raise ValueError(f"kernel_softmax: shapes (n, {nr}), ({nr},), ({nr},), (ev, {nr}) expected")
    cdef sdpa_status st = sdpa_testing_softmax(
        name.encode(), SDPA_FLOAT32 if t == cnp.NPY_FLOAT32 else SDPA_FLOAT64, row, cnp.PyArray_DATA(s), n,
        cnp.PyArray_DATA(row_max), cnp.PyArray_DATA(row_sum), cnp.PyArray_DATA(acc), ev)
    if st != SDPA_OK:
        raise ValueError(sdpa_status_message(st).decode())


def fp_flags(int num_threads=1):
    """The floating-point control flags (x86: MXCSR FTZ/DAZ bits) seen by each of
    num_threads OpenMP threads (for tests: a call must leave them unchanged)."""
    if num_threads < 1 or num_threads > 256:
        raise ValueError("num_threads: 1..256")
    cdef int flags[256]
    sdpa_fp_flags_in_threads(num_threads, flags)
    return [flags[i] for i in range(num_threads)]


def set_blocking(int tile_q=0, int tile_k=0, int chunk=0):
    """Forces the blocking of later calls, process-wide (for tests): query rows
    per task (rounded up to the panel width), keys per tile, keys per chunk in
    row mode; 0 restores the rule for that one."""
    if tile_q < 0 or tile_k < 0 or chunk < 0 or tile_q > 4096 or tile_k > 4096 or chunk > 65536:
        raise ValueError("set_blocking: tile_q and tile_k in 0..4096, chunk in 0..65536")
    sdpa_testing_set_blocking(tile_q, tile_k, chunk)


def set_packing(mode):
    """Forces whether later tiled calls pack K and V once per call, process-wide
    (for tests): "never" (a tile at a time in each task), "always" (whenever the
    format packs: 16-bit or int8 K/V, bfloat16 V pairs), or "rule"."""
    modes = {"rule": 0, "never": 1, "always": 2}
    if mode not in modes:
        raise ValueError(f"set_packing: one of {', '.join(modes)}")
    sdpa_testing_set_packing(modes[mode])


def ask_for_tiles():
    """Asks the OS for the AMX tile state now (for tests): True when this
    process may run tile instructions; False off Linux x86 and where refused."""
    return bool(sdpa_testing_ask_for_tiles())


def stand_in(int mode, bint as_default=True):
    """For tests: amx_emulated stands in for amx towards the OS (mode 1: the OS
    is asked at its first bfloat16 tiled call; -1: taken as refused), as the
    default choice or as named; mode 0 ends it."""
    if sdpa_testing_stand_in(mode, as_default) != SDPA_OK:
        raise ValueError("stand_in: amx_emulated needs AVX512-BF16")


def tile_requests():
    """How many times calls have asked the OS for the AMX tile state (for tests)."""
    return int(sdpa_testing_tile_requests())


def amx_emulated_calls():
    """How many times amx_emulated's product kernel has run (for tests)."""
    return int(sdpa_testing_amx_emulated_calls())


HAVE_AMX_KERNELS = bool(sdpa_testing_have_amx_kernels())


def use_kernels(name):
    """Like :func:`set_isa`, and also takes ``"amx_emulated"`` (for tests): the
    amx set's kernel over a software model of the tiles, on any CPU with
    AVX512-BF16."""
    if sdpa_testing_use_kernels(name.encode()) != SDPA_OK:
        raise ValueError(f"use_kernels: {name!r} cannot run on this CPU")


def gemm_bf16(name, int m, int64_t kpairs, cnp.ndarray a, int64_t a_rs, int64_t a_ks, cnp.ndarray b,
              int64_t ldb, cnp.ndarray c, int64_t ldc, bint accumulate, long repeat=1):
    """The named kernel set's bfloat16 product on its own (for tests):
    ``c[r*ldc + x] (=, or += when accumulate) sum_p dot2(a[r*a_rs + p*a_ks],
    b[p*ldb + x])`` for r < m, x < 32, on flat uint32 pair arrays a and b and a
    float32 array c; b and c 64-byte aligned, ldb and ldc multiples of 16.  Run
    ``repeat`` times in a row between the set's tile set-up and release, as a
    task of a call runs its products (for timing the kernel alone)."""
    if (cnp.PyArray_TYPE(a) != cnp.NPY_UINT32 or cnp.PyArray_TYPE(b) != cnp.NPY_UINT32
            or cnp.PyArray_TYPE(c) != cnp.NPY_FLOAT32 or a.ndim != 1 or b.ndim != 1 or c.ndim != 1
            or not all(cnp.PyArray_IS_C_CONTIGUOUS(x) and cnp.PyArray_ISNOTSWAPPED(x) for x in (a, b, c))
            or not cnp.PyArray_ISWRITEABLE(c)):
        raise TypeError("gemm_bf16: flat contiguous uint32 a and b, a writable float32 c")
    if repeat < 1:
        raise ValueError("gemm_bf16: repeat >= 1")
    if m < 0 or kpairs < 0 or a_rs < 0 or a_ks < 0 or ldb < 32 or ldc < 32 or ldb % 16 or ldc % 16:
        raise ValueError("gemm_bf16: m, kpairs and strides >= 0; ldb and ldc multiples of 16, >= 32")
    if ((<uintptr_t>cnp.PyArray_DATA(b)) % 64 or (<uintptr_t>cnp.PyArray_DATA(c)) % 64):
        raise ValueError("gemm_bf16: b and c 64-byte aligned")
    if m and kpairs and (m - 1) * a_rs + (kpairs - 1) * a_ks >= a.shape[0]:
        raise ValueError("gemm_bf16: a too small")
    if kpairs and (kpairs - 1) * ldb + 32 > b.shape[0]:
        raise ValueError("gemm_bf16: b too small")
    if m and (m - 1) * ldc + 32 > c.shape[0]:
        raise ValueError("gemm_bf16: c too small")
    if sdpa_testing_gemm_bf16(name.encode(), m, kpairs, <const uint32_t *>cnp.PyArray_DATA(a), a_rs, a_ks,
                              <const uint32_t *>cnp.PyArray_DATA(b), ldb, <float *>cnp.PyArray_DATA(c), ldc,
                              accumulate, repeat) != SDPA_OK:
        raise ValueError(f"gemm_bf16: {name!r} has no bfloat16 product on this CPU")


def set_flush_to_zero(bint on):
    """Flush-to-zero and denormals-are-zero on or off in the calling thread, as
    torch.set_flush_denormal does (for tests); False where the CPU has no such
    mode."""
    return bool(sdpa_set_flush_to_zero(on))


# Called, when set, with a dict of what each call hands to the core (the arrays
# and num_threads), before the computation: tests use it to see that inputs are
# read in place.
_observer = None


def set_observer(fn):
    global _observer
    _observer = fn


# ---------------------------------------------------------------- building a problem

cdef uintptr_t _main_thread_ident = <uintptr_t>threading.main_thread().ident


cdef class _Call:
    """State of one call: what an interrupt callback raised."""
    cdef object pending


cdef int _poll_signals(void *user_data) noexcept nogil:
    # runs Python's signal handlers; what they raise (KeyboardInterrupt) is kept
    # and raised once the C call has returned
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as exc:
            (<_Call>user_data).pending = exc
            return 1
        return 0


# NumPy's type number of ml_dtypes.bfloat16, found when a bfloat16 array first
# comes (its module is imported by then); -1 before.
cdef int _bf16_typenum = -1


cdef int _find_bf16_typenum() except -2:
    global _bf16_typenum
    import sys
    ml_dtypes = sys.modules.get("ml_dtypes")
    if ml_dtypes is not None:
        import numpy
        _bf16_typenum = numpy.dtype(ml_dtypes.bfloat16).num
    return _bf16_typenum


cdef int _dtype_of(cnp.ndarray a) except -2:
    """The core's dtype of a native, aligned float32, float64, float16 or
    bfloat16 array; -1 for anything else."""
    if not cnp.PyArray_ISNOTSWAPPED(a) or not cnp.PyArray_ISALIGNED(a):
        return -1
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT32:
        return SDPA_FLOAT32
    if t == cnp.NPY_FLOAT64:
        return SDPA_FLOAT64
    if t == cnp.NPY_FLOAT16:
        return SDPA_FLOAT16
    if t >= NPY_USERDEF and t == (_bf16_typenum if _bf16_typenum >= 0 else _find_bf16_typenum()):
        return SDPA_BFLOAT16
    return -1


cdef inline int _compute_dtype(int dt) noexcept:
    """float64 problems compute in float64, all others in float32."""
    return SDPA_FLOAT64 if dt == SDPA_FLOAT64 else SDPA_FLOAT32


cdef inline bint _pairs(int qdt, int kvdt) noexcept:
    """Whether a query of qdt may attend keys and values of kvdt."""
    if qdt < 0 or kvdt < 0:
        return False
    return (qdt == SDPA_FLOAT64) == (kvdt == SDPA_FLOAT64)


cdef inline int _typenum_of(int dt) noexcept:
    if dt == SDPA_FLOAT64:
        return cnp.NPY_FLOAT64
    if dt == SDPA_FLOAT16:
        return cnp.NPY_FLOAT16
    if dt == SDPA_BFLOAT16:
        return _bf16_typenum
    return cnp.NPY_FLOAT32


cdef int _fill_view(sdpa_view *view, cnp.ndarray a, int nb, int ncore, const int64_t *expect,
                    bint output) noexcept:
    """Fills view from a, right-aligned to nb batch dims and then (head, row,
    column), (head, row) when ncore is 2 (lse), or (head,) when it is 1 (ALiBi
    slopes, sinks), the sizes `expect` gives.
    Every dim of a must equal the expected size, or (inputs only) be 1 to
    broadcast; a missing leading dim counts as 1.  Strides in elements, 0 where
    a dim broadcasts.  Returns 0, or 1 when a does not fit."""
    cdef int nd = nb + ncore
    cdef int ndim = cnp.PyArray_NDIM(a)
    cdef int pad = nd - ndim
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(a)
    cdef cnp.npy_intp item = cnp.PyArray_ITEMSIZE(a)
    cdef int64_t st[MAX_DIMS]
    cdef int i
    if pad < 0 or nd > MAX_DIMS or nb > SDPA_MAX_BATCH_DIMS:
        return 1
    for i in range(pad):
        if output and expect[i] != 1:
            return 1
        st[i] = 0
    for i in range(ndim):
        if shape[i] == expect[pad + i] and (shape[i] != 1 or output):
            if strides[i] % item:
                return 1
            st[pad + i] = strides[i] // item
        elif shape[i] == 1 and not output:
            st[pad + i] = 0
        else:
            return 1
    for i in range(nb):
        view.batch_strides[i] = st[i]
    view.head_stride = st[nb]
    view.row_stride = st[nb + 1] if ncore >= 2 else 0
    view.col_stride = st[nb + 2] if ncore == 3 else 0
    view.data = cnp.PyArray_DATA(a)
    if view.data == NULL:  # storage of an empty array, never read
        view.data = <void *>view
    return 0


cdef int _fill_lengths(sdpa_problem *p, cnp.ndarray kl) noexcept:
    """key_lengths: native int64 whose dims broadcast to the batch dims."""
    cdef int ndim = cnp.PyArray_NDIM(kl)
    cdef int nb = p.num_batch_dims, pad = nb - ndim, i
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(kl)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(kl)
    if pad < 0 or cnp.PyArray_TYPE(kl) != cnp.NPY_INT64 or not cnp.PyArray_ISNOTSWAPPED(kl) \
            or not cnp.PyArray_ISALIGNED(kl):
        return 1
    for i in range(pad):
        p.key_lengths_strides[i] = 0
    for i in range(ndim):
        if shape[i] == 1:
            p.key_lengths_strides[pad + i] = 0
        elif shape[i] == p.batch_shape[pad + i] and strides[i] % 8 == 0:
            p.key_lengths_strides[pad + i] = strides[i] // 8
        else:
            return 1
    p.key_lengths = <const int64_t *>cnp.PyArray_DATA(kl)
    return 0


cdef object _execute(sdpa_problem *p, bint interruptible, dict arrays):
    """Runs the problem without the GIL; raises on failure."""
    cdef sdpa_status status
    cdef _Call call = None
    if _observer is not None:
        arrays["num_threads"] = p.num_threads
        _observer(arrays)
    if interruptible:
        call = _Call()
        p.interrupt = _poll_signals
        p.interrupt_data = <void *>call
    with nogil:
        status = sdpa_attention(p)
    if status == SDPA_OK:
        return
    if status == SDPA_ERR_INTERRUPTED:
        raise call.pending if call is not None and call.pending is not None else KeyboardInterrupt()
    if status == SDPA_ERR_NO_MEMORY:
        raise MemoryError("sdpa: " + sdpa_status_message(status).decode())
    if status == SDPA_ERR_BAD_ISA:
        import os
        env = os.environ.get('SDPA_ISA')
        raise ValueError("sdpa: " + (f"SDPA_ISA={env!r}: " if env else "")
                         + (isa_env_error() or sdpa_status_message(status).decode()))
    raise ValueError("sdpa: " + sdpa_status_message(status).decode())


cdef inline bint _interruptible():
    # Ctrl-C is delivered to the main thread: poll for it there
    return <uintptr_t>PyThread_get_thread_ident() == _main_thread_ident


cdef void _expected(int64_t *dst, const int64_t *batch, int nb, int64_t h, int64_t r, int64_t c) noexcept:
    cdef int i
    for i in range(nb):
        dst[i] = batch[i]
    dst[nb] = h
    dst[nb + 1] = r
    dst[nb + 2] = c


cdef int _int8_kv(int dt, cnp.ndarray k, cnp.ndarray v, cnp.ndarray k_scale,
                  cnp.ndarray v_scale) except -1:
    """Whether k and v are the int8 storage of a quantized cache that a query of
    the core's dtype dt may attend: int8 k and v, native aligned float32 scales,
    and a float32 or 16-bit query."""
    return k_scale is not None and v_scale is not None and dt >= 0 and dt != SDPA_FLOAT64 \
        and cnp.PyArray_TYPE(k) == cnp.NPY_INT8 and cnp.PyArray_TYPE(v) == cnp.NPY_INT8 \
        and _dtype_of(k_scale) == SDPA_FLOAT32 and _dtype_of(v_scale) == SDPA_FLOAT32


cdef int _fill_scales(sdpa_problem *p, cnp.ndarray k_scale, cnp.ndarray v_scale, int64_t group_size,
                      int64_t *ex) noexcept:
    """The views of an int8 problem's scales, whose sizes p already holds:
    (batch..., Hkv, S, E / G) and (batch..., Hkv, S, Ev / G), G = group_size (0:
    one scale per row).  Returns 0; 2 when group_size does not divide E and Ev;
    1 when a scale array does not fit."""
    cdef int nb = p.num_batch_dims
    cdef int64_t hkv = p.num_heads // p.gqa_group
    if group_size < 0 or (group_size > 0 and (p.head_dim % group_size or p.head_dim_v % group_size)):
        return 2
    p.kv_group_size = group_size
    _expected(ex, p.batch_shape, nb, hkv, p.len_kv, p.head_dim // group_size if group_size else 1)
    if _fill_view(&p.key_scale, k_scale, nb, 3, ex, False):
        return 1
    _expected(ex, p.batch_shape, nb, hkv, p.len_kv, p.head_dim_v // group_size if group_size else 1)
    return _fill_view(&p.value_scale, v_scale, nb, 3, ex, False)


def run(cnp.ndarray q not None, cnp.ndarray k not None, cnp.ndarray v not None,
        cnp.ndarray out not None, *, cnp.ndarray mask=None, cnp.ndarray weights=None,
        cnp.ndarray lse=None, cnp.ndarray key_lengths=None, double scale=1.0,
        bint causal=False, int64_t causal_offset=0, int64_t group=1, int num_threads=0,
        int64_t window_left=-1, int64_t window_right=-1, int64_t align_offset=0,
        double softcap=0.0, cnp.ndarray alibi=None, cnp.ndarray sinks=None,
        cnp.ndarray k_scale=None, cnp.ndarray v_scale=None, int64_t group_size=0):
    """Computes attention into `out` (and `weights`, `lse`) from arrays prepared by
    sdpa._api, native and aligned: q and out of one dtype (float32, float64,
    float16 or bfloat16), k and v of one (float64 with float64 only), weights,
    lse and a float mask of the compute type (float64 for float64, else
    float32), or a bool mask; int64 key_lengths; alibi slopes and sinks of the
    compute type, (batch..., heads) broadcasting.  The problem's sizes are read
    from out (batch..., heads, L, Ev; 2-D: one head), q (E) and k (S).
    With k_scale and v_scale (float32, (batch..., Hkv, S, E / G) and (..., Ev / G),
    G = group_size or the whole row for 0), k and v are int8 and the query is
    not float64: a quantized cache."""
    cdef sdpa_problem p
    cdef int64_t ex[MAX_DIMS]
    cdef int nd = cnp.PyArray_NDIM(out), nb, i
    cdef cnp.npy_intp *os = cnp.PyArray_DIMS(out)
    cdef int dt = _dtype_of(q), kvdt = _dtype_of(k), cdt = _compute_dtype(dt)
    cdef bint int8 = k_scale is not None or v_scale is not None
    sdpa_problem_init(&p)
    if int8:
        if not _int8_kv(dt, k, v, k_scale, v_scale):
            raise TypeError("sdpa._core.run: int8 k and v need float32 k_scale and v_scale, "
                            "and a float32 or 16-bit query")
        kvdt = SDPA_INT8
    if nd < 2 or nd > MAX_DIMS or cnp.PyArray_NDIM(q) < 2 or cnp.PyArray_NDIM(k) < 2 or dt < 0 \
            or group < 1:
        raise ValueError("sdpa._core.run: operands that do not describe a problem")
    if not int8 and (not _pairs(dt, kvdt) or _dtype_of(v) != kvdt) or _dtype_of(out) != dt:
        raise TypeError("sdpa._core.run: operands of dtypes that do not go together")
    for a in (weights, lse):
        if a is not None and _dtype_of(a) != cdt:
            raise TypeError("sdpa._core.run: weights and lse must be of the compute type")
    nb = nd - 3 if nd >= 3 else 0
    p.dtype = <sdpa_dtype>dt
    if kvdt != dt:
        p.kv_dtype = <sdpa_dtype>kvdt
    p.num_batch_dims = nb
    for i in range(nb):
        p.batch_shape[i] = os[i]
    p.num_heads = os[nd - 3] if nd >= 3 else 1
    p.gqa_group = group
    p.len_q = os[nd - 2]
    p.head_dim_v = os[nd - 1]
    p.head_dim = cnp.PyArray_DIMS(q)[cnp.PyArray_NDIM(q) - 1]
    p.len_kv = cnp.PyArray_DIMS(k)[cnp.PyArray_NDIM(k) - 2]
    if p.num_heads % group:
        raise ValueError("sdpa._core.run: group does not divide the heads")
    bad = False
    _expected(ex, p.batch_shape, nb, p.num_heads, p.len_q, p.head_dim)
    bad |= _fill_view(&p.query, q, nb, 3, ex, False)
    _expected(ex, p.batch_shape, nb, p.num_heads // group, p.len_kv, p.head_dim)
    bad |= _fill_view(&p.key, k, nb, 3, ex, False)
    _expected(ex, p.batch_shape, nb, p.num_heads // group, p.len_kv, p.head_dim_v)
    bad |= _fill_view(&p.value, v, nb, 3, ex, False)
    _expected(ex, p.batch_shape, nb, p.num_heads, p.len_q, p.head_dim_v)
    bad |= _fill_view(&p.out, out, nb, 3, ex, True)
    _expected(ex, p.batch_shape, nb, p.num_heads, p.len_q, p.len_kv)
    if mask is not None:
        if cnp.PyArray_TYPE(mask) == cnp.NPY_BOOL:
            p.mask_kind = SDPA_MASK_BOOL
        elif _dtype_of(mask) == cdt:
            p.mask_kind = SDPA_MASK_ADDITIVE
        else:
            raise TypeError("sdpa._core.run: a float mask must be of the compute type")
        bad |= _fill_view(&p.mask, mask, nb, 3, ex, False)
    if weights is not None:
        bad |= _fill_view(&p.weights, weights, nb, 3, ex, True)
    if lse is not None:
        bad |= _fill_view(&p.lse, lse, nb, 2, ex, True)
    if key_lengths is not None:
        bad |= _fill_lengths(&p, key_lengths)
    for a in (alibi, sinks):
        if a is not None and _dtype_of(a) != cdt:
            raise TypeError("sdpa._core.run: alibi slopes and sinks must be of the compute type")
    if alibi is not None:
        bad |= _fill_view(&p.alibi, alibi, nb, 1, ex, False)
    if sinks is not None:
        bad |= _fill_view(&p.sinks, sinks, nb, 1, ex, False)
    if int8:
        i = _fill_scales(&p, k_scale, v_scale, group_size, ex)
        if i == 2:
            raise ValueError("sdpa._core.run: group_size must divide head_dim and head_dim_v")
        bad |= i
    if bad:
        raise ValueError("sdpa._core.run: an operand does not fit the problem")
    for a in (out, weights, lse):
        if a is not None and not cnp.PyArray_ISWRITEABLE(a):
            raise ValueError("sdpa._core.run: a read-only output")
    p.scale = scale
    p.causal = causal
    p.causal_offset = causal_offset
    p.window_left = window_left
    p.window_right = window_right
    p.align_offset = align_offset
    p.softcap = softcap
    p.num_threads = num_threads if num_threads > 0 else _setting_for(&p)
    arrays = None
    if _observer is not None:
        arrays = {"q": q, "k": k, "v": v, "mask": mask}
    _execute(&p, _interruptible(), arrays)


def quantize_int8(cnp.ndarray src not None, cnp.ndarray dst not None, cnp.ndarray scales not None,
                  int64_t group_size=0):
    """Quantizes src (float32, (N, H, T, C)) into dst (int8, the same shape) and
    scales (float32, (N, H, T, C / group_size, or 1 for 0)), each with
    contiguous columns and any other strides.  ValueError for a NaN or infinite
    value: nothing of its (N, H) slab is written, but earlier slabs may be (the
    caller checks first)."""
    cdef cnp.npy_intp *sh = cnp.PyArray_DIMS(src)
    cdef int64_t n, h, i, j, rows, cols, groups
    cdef sdpa_status st = SDPA_OK
    cdef const char *sp
    cdef char *dp
    cdef char *cp
    cdef cnp.npy_intp *ss
    cdef cnp.npy_intp *ds
    cdef cnp.npy_intp *cs
    if cnp.PyArray_NDIM(src) != 4 or cnp.PyArray_NDIM(dst) != 4 or cnp.PyArray_NDIM(scales) != 4 \
            or _dtype_of(src) != SDPA_FLOAT32 or cnp.PyArray_TYPE(dst) != cnp.NPY_INT8 \
            or _dtype_of(scales) != SDPA_FLOAT32 or not cnp.PyArray_ISWRITEABLE(dst) \
            or not cnp.PyArray_ISWRITEABLE(scales):
        raise TypeError("sdpa._core.quantize_int8: operands of the wrong kind")
    n, h, rows, cols = sh[0], sh[1], sh[2], sh[3]
    groups = cols // group_size if group_size > 0 else 1
    for i in range(4):
        if cnp.PyArray_DIMS(dst)[i] != sh[i] or cnp.PyArray_DIMS(scales)[i] != (sh[i] if i < 3 else groups):
            raise ValueError("sdpa._core.quantize_int8: shapes that do not fit")
    ss, ds, cs = cnp.PyArray_STRIDES(src), cnp.PyArray_STRIDES(dst), cnp.PyArray_STRIDES(scales)
    if (cols > 1 and (ss[3] != 4 or ds[3] != 1)) or (groups > 1 and cs[3] != 4) \
            or ss[2] % 4 or cs[2] % 4:
        raise ValueError("sdpa._core.quantize_int8: rows must be contiguous")
    with nogil:
        for i in range(n):
            if st != SDPA_OK:
                break
            for j in range(h):
                sp = cnp.PyArray_BYTES(src) + i * ss[0] + j * ss[1]
                dp = cnp.PyArray_BYTES(dst) + i * ds[0] + j * ds[1]
                cp = cnp.PyArray_BYTES(scales) + i * cs[0] + j * cs[1]
                st = sdpa_quantize_int8(<const float *>sp, ss[2] // 4, rows, cols, group_size,
                                        <int8_t *>dp, ds[2], <float *>cp, cs[2] // 4)
                if st != SDPA_OK:
                    break
    if st != SDPA_OK:
        raise ValueError("sdpa: " + sdpa_status_message(st).decode())


# ---------------------------------------------------------------- the fast path

cdef bint _extent(cnp.ndarray a, uintptr_t *lo, uintptr_t *hi) noexcept:
    """The bytes a's elements span, [lo, hi); False when a has no element."""
    cdef int i
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(a)
    cdef cnp.npy_intp low = 0, high = cnp.PyArray_ITEMSIZE(a)
    for i in range(cnp.PyArray_NDIM(a)):
        if shape[i] == 0:
            return False
        if strides[i] < 0:
            low += (shape[i] - 1) * strides[i]
        else:
            high += (shape[i] - 1) * strides[i]
    lo[0] = <uintptr_t>cnp.PyArray_BYTES(a) + low
    hi[0] = <uintptr_t>cnp.PyArray_BYTES(a) + high
    return True


cdef bint _disjoint(cnp.ndarray a, cnp.ndarray b) noexcept:
    """True when a and b surely share no byte (their spans do not meet)."""
    cdef uintptr_t alo, ahi, blo, bhi
    if b is None or not _extent(a, &alo, &ahi) or not _extent(b, &blo, &bhi):
        return True
    return ahi <= blo or bhi <= alo


cdef bint _no_self_overlap(cnp.ndarray a) noexcept:
    """No two elements of a share memory: sorted by stride, each dim's stride
    clears everything the smaller dims span."""
    cdef int n = 0, i, j, nd = cnp.PyArray_NDIM(a)
    cdef cnp.npy_intp st[MAX_DIMS]
    cdef cnp.npy_intp sz[MAX_DIMS]
    cdef cnp.npy_intp extent = cnp.PyArray_ITEMSIZE(a), s, z
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(a)
    if nd > MAX_DIMS:
        return False
    for i in range(nd):
        if shape[i] == 0:
            return True
        if shape[i] > 1:
            s = strides[i] if strides[i] >= 0 else -strides[i]
            j = n
            while j > 0 and st[j - 1] > s:
                st[j] = st[j - 1]
                sz[j] = sz[j - 1]
                j -= 1
            st[j] = s
            sz[j] = shape[i]
            n += 1
    for i in range(n):
        if st[i] < extent:
            return False
        extent = st[i] * (sz[i] - 1) + extent
    return True


# try_attention's bound on |diagonal|: any int64 offset the core takes
_DIAGONAL_MAX = (1 << 63) - 1


cdef inline bint _dims(cnp.ndarray a, int *nd, cnp.npy_intp **shape) noexcept:
    """a's dims, when it has 2 to MAX_DIMS of them."""
    nd[0] = cnp.PyArray_NDIM(a)
    shape[0] = cnp.PyArray_DIMS(a)
    return 2 <= nd[0] <= MAX_DIMS


def try_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                  return_weights, return_lse, key_lengths, out, num_threads, *,
                  k_scale=None, v_scale=None, int64_t group_size=0, diagonal=None):
    """scaled_dot_product_attention's arguments, as given.  When every one is in
    the form the core takes as it is, computes and returns the result; returns
    None when the call needs the general path (conversions, or an error).

    For a quantized cache, key and value are its int8 storage, and k_scale,
    v_scale and group_size its scales, as sdpa._core.run takes them.
    ``diagonal``, an int, replaces the causal alignment as in
    sdpa._api._attention_general (is_causal must still be valid)."""
    cdef cnp.ndarray q, k, v, m = None, o = None, kl = None, lse = None, ks = None, vs = None
    cdef cnp.npy_intp *shapes[3]
    cdef int nds[3]
    cdef int nd, nb, mn, i, j, t, dt, kvdt
    cdef int64_t hq, hk, hv, hkv, heads, group, L, S, E, Ev, size, n
    cdef int64_t ex[MAX_DIMS]
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef sdpa_problem p
    cdef bint has_heads

    if return_weights is not False:
        return None
    if not (cnp.PyArray_CheckExact(query) and cnp.PyArray_CheckExact(key)
            and cnp.PyArray_CheckExact(value)):
        return None
    q, k, v = <cnp.ndarray>query, <cnp.ndarray>key, <cnp.ndarray>value
    if not (_dims(q, &nds[0], &shapes[0]) and _dims(k, &nds[1], &shapes[1])
            and _dims(v, &nds[2], &shapes[2])):
        return None
    dt = _dtype_of(q)
    if k_scale is None and v_scale is None:
        kvdt = _dtype_of(k)
        if not _pairs(dt, kvdt) or _dtype_of(v) != kvdt:
            return None
    else:
        if not (cnp.PyArray_CheckExact(k_scale) and cnp.PyArray_CheckExact(v_scale)):
            return None
        ks, vs = <cnp.ndarray>k_scale, <cnp.ndarray>v_scale
        if not _int8_kv(dt, k, v, ks, vs):
            return None
        kvdt = SDPA_INT8

    # the sizes, worked out as sdpa._api.plan_shapes does
    L = shapes[0][nds[0] - 2]
    E = shapes[0][nds[0] - 1]
    S = shapes[1][nds[1] - 2]
    Ev = shapes[2][nds[2] - 1]
    if shapes[1][nds[1] - 1] != E or shapes[2][nds[2] - 2] != S:
        return None
    nd = max(nds[0], max(nds[1], nds[2]))
    has_heads = nd >= 3
    hq = shapes[0][nds[0] - 3] if nds[0] >= 3 else 1
    hk = shapes[1][nds[1] - 3] if nds[1] >= 3 else 1
    hv = shapes[2][nds[2] - 3] if nds[2] >= 3 else 1
    if hk != hv and hk != 1 and hv != 1:
        return None
    hkv = max(hk, hv) if min(hk, hv) > 0 else 0
    if enable_gqa is True:
        if hkv == 0 or hq % hkv:
            return None
        heads = hq
        group = max(hq // max(hkv, 1), 1)
    elif enable_gqa is False:
        if hq != hkv and hq != 1 and hkv != 1:
            return None
        heads = 0 if hq == 0 or hkv == 0 else max(hq, hkv)
        group = 1
    else:
        return None
    nb = nd - 3 if has_heads else 0
    sdpa_problem_init(&p)
    p.num_batch_dims = nb
    for i in range(nb):  # the batch dims broadcast: equal sizes, or 1
        size = 1
        for t in range(3):
            j = i - (nd - nds[t])
            if j >= 0:
                n = shapes[t][j]
                if size == 1:
                    size = n
                elif n != 1 and n != size:
                    return None
        p.batch_shape[i] = size
    p.dtype = <sdpa_dtype>dt
    if kvdt != dt:
        p.kv_dtype = <sdpa_dtype>kvdt
    p.num_heads = heads
    p.gqa_group = group
    p.len_q = L
    p.len_kv = S
    p.head_dim = E
    p.head_dim_v = Ev

    # scalars
    if scale is None:
        p.scale = 1.0 / sqrt(<double>E) if E > 0 else 1.0
    elif type(scale) is float:
        p.scale = <double>scale
    else:
        return None
    if is_causal is False:
        p.causal = 0
    elif is_causal is True or (type(is_causal) is str and is_causal == "top_left"):
        p.causal = 1
    elif type(is_causal) is str and is_causal == "bottom_right":
        p.causal = 1
        p.causal_offset = S - L
    else:
        return None
    if diagonal is not None:
        if type(diagonal) is not int or not (-_DIAGONAL_MAX <= diagonal <= _DIAGONAL_MAX):
            return None
        p.causal = 1
        p.causal_offset = diagonal
    if num_threads is None:
        p.num_threads = -1  # the setting, capped by the work once the sizes are known
    elif type(num_threads) is int and 1 <= num_threads:
        p.num_threads = num_threads if num_threads < MAX_THREADS else MAX_THREADS
    else:
        return None

    # operands
    _expected(ex, p.batch_shape, nb, heads, L, E)
    if _fill_view(&p.query, q, nb, 3, ex, False):
        return None
    _expected(ex, p.batch_shape, nb, heads // group, S, E)
    if _fill_view(&p.key, k, nb, 3, ex, False):
        return None
    _expected(ex, p.batch_shape, nb, heads // group, S, Ev)
    if _fill_view(&p.value, v, nb, 3, ex, False):
        return None
    if ks is not None and _fill_scales(&p, ks, vs, group_size, ex):
        return None
    if attn_mask is not None:
        if not cnp.PyArray_CheckExact(attn_mask):
            return None
        m = <cnp.ndarray>attn_mask
        if cnp.PyArray_TYPE(m) == cnp.NPY_BOOL and cnp.PyArray_ISALIGNED(m):
            p.mask_kind = SDPA_MASK_BOOL
        elif _dtype_of(m) == _compute_dtype(dt):
            p.mask_kind = SDPA_MASK_ADDITIVE
        else:
            return None
        _expected(ex, p.batch_shape, nb, heads, L, S)
        if _fill_view(&p.mask, m, nb, 3, ex, False):
            return None
    if key_lengths is not None:
        if not cnp.PyArray_CheckExact(key_lengths):
            return None
        kl = <cnp.ndarray>key_lengths
        if not cnp.PyArray_IS_C_CONTIGUOUS(kl) or _fill_lengths(&p, kl):
            return None
        for i in range(cnp.PyArray_SIZE(kl)):
            if p.key_lengths[i] < 0:
                return None

    # the output (and lse)
    mn = nb + 3 if has_heads else 2
    for i in range(nb):
        dims[i] = p.batch_shape[i]
    if has_heads:
        dims[nb] = heads
    dims[mn - 2] = L
    dims[mn - 1] = Ev
    if out is None:
        o = cnp.PyArray_EMPTY(mn, dims, cnp.PyArray_TYPE(q), 0)  # the query's dtype
    else:
        if not cnp.PyArray_CheckExact(out):
            return None
        o = <cnp.ndarray>out
        if _dtype_of(o) != dt or not cnp.PyArray_ISWRITEABLE(o) or not _no_self_overlap(o):
            return None
        if not (_disjoint(o, q) and _disjoint(o, k) and _disjoint(o, v) and _disjoint(o, m)
                and _disjoint(o, kl) and _disjoint(o, ks) and _disjoint(o, vs)):
            return None
    _expected(ex, p.batch_shape, nb, heads, L, Ev)
    if _fill_view(&p.out, o, nb, 3, ex, True):
        return None
    if return_lse is True:
        lse = cnp.PyArray_EMPTY(mn - 1, dims, _typenum_of(_compute_dtype(dt)), 0)
        if _fill_view(&p.lse, lse, nb, 2, ex, True):
            return None
    elif return_lse is not False:
        return None

    if cnp.PyArray_SIZE(o) or (lse is not None and cnp.PyArray_SIZE(lse)):
        if p.num_threads < 0:
            p.num_threads = _setting_for(&p)
        arrays = None
        if _observer is not None:
            arrays = {"q": q, "k": k, "v": v, "mask": m}
        _execute(&p, _interruptible(), arrays)
    if lse is not None:
        return o, lse
    return o
