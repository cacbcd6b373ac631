# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The thin layer between Python and the C core.

A :class:`Call` is the one entry: made once for a call's options (checked by
``sdpa._checks.call_constants``, and kept by their key), it takes the arrays
of each call as they are, builds one ``sdpa_problem`` from them (reading
shapes, strides and dtypes from the arrays themselves), releases the GIL
around the computation and turns status codes into exceptions.  Arrays it
cannot take as they are (other array-likes, dtypes to convert, arguments to
reject) it declines with a reason code, having written nothing; ``sdpa._api``
then converts what it can and runs the same call again, or raises an error
that names the argument.
"""
cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.pythread cimport PyThread_get_thread_ident
from libc.float cimport DBL_MAX
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uintptr_t, int8_t, uint32_t, uint64_t

import threading

cnp.import_array()

MAX_BATCH_DIMS = SDPA_MAX_BATCH_DIMS
# the largest key count, position offset and window side (a larger side shows every key)
MAX_POSITION = SDPA_MAX_POSITION


def _isa_names():
    cdef int i = 0
    names = []
    while sdpa_isa_name(i) != NULL:
        names.append(sdpa_isa_name(i).decode())
        i += 1
    return tuple(names)


# every kernel set's name, from the core's one list
ISAS = _isa_names()

cdef enum:
    # dims of a full operand: batch dims, then (head, row, column)
    MAX_DIMS = SDPA_MAX_BATCH_DIMS + 3

# thread counts above this are taken as this (sdpa.h: a sanity bound, not a tuning knob)
MAX_NUM_THREADS = SDPA_MAX_THREADS


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


def isas_supported():
    """The kernel sets of ISAS this CPU runs, in ISAS's order."""
    return [n for n in ISAS if isa_supported(n)]


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
                         f"supported: {isas_supported()}")


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


def set_threads_setting(int n):
    """The thread count calls use when not given one (0: the OpenMP default),
    kept by the core, which caps it by each call's work as it does the OpenMP
    default; sdpa._api validates it first."""
    sdpa_set_threads_setting(n)


def threads_setting():
    return sdpa_threads_setting()


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
    if (tile_q < 0 or tile_k < 0 or chunk < 0 or tile_q > SDPA_TESTING_MAX_TILE or tile_k > SDPA_TESTING_MAX_TILE
            or chunk > SDPA_TESTING_MAX_CHUNK):
        raise ValueError(f"set_blocking: tile_q and tile_k in 0..{SDPA_TESTING_MAX_TILE}, "
                         f"chunk in 0..{SDPA_TESTING_MAX_CHUNK}")
    sdpa_testing_set_blocking(tile_q, tile_k, chunk)


def set_packing(mode):
    """Forces whether later tiled calls pack K and V once per call, process-wide
    (for tests): "never" (a tile at a time in each task), "always" (whenever the
    format packs: 16-bit or int8 K/V, bfloat16 V pairs), or "rule"."""
    modes = {"rule": 0, "never": 1, "always": 2}
    if mode not in modes:
        raise ValueError(f"set_packing: one of {', '.join(modes)}")
    sdpa_testing_set_packing(modes[mode])


def set_fold_group(min_group):
    """The smallest GQA group whose decoding rows run as the rows of one query,
    process-wide (for tests and benchmarks): None for the rule, an int >= 1, or
    0 for never."""
    sdpa_testing_set_fold_group(0 if min_group is None else (-1 if min_group == 0 else int(min_group)))


def set_pack_group(mode):
    """Whether the tiled path packs a GQA group's heads into its rows (test
    hook): "rule", "never" or "always" (wherever it is allowed)."""
    modes = {"rule": 0, "never": 1, "always": 2}
    if mode not in modes:
        raise ValueError(f"set_pack_group: expected one of {', '.join(modes)}, got {mode!r}")
    sdpa_testing_set_pack_group(modes[mode])


def set_portable_dot_qi(bint on):
    """integer_qk's scores and integer_pv's products by the portable kernels
    everywhere (True), or by the fastest this CPU has (False, the default);
    process-wide, for tests."""
    sdpa_testing_portable_dot_qi(on)


def dot_qi_kernel():
    """The kernel integer_qk's scores run on now: "avx512_vnni", "avx_vnni", "neon_dotprod" or "portable"."""
    return sdpa_testing_dot_qi_kernel().decode()


def probe_read(cnp.ndarray buf not None, int threads):
    """Seconds ``threads`` threads take to read a C-contiguous array once, a
    streaming sum each of its share (the roofline report's read bandwidth)."""
    if not cnp.PyArray_IS_C_CONTIGUOUS(buf):
        raise ValueError("probe_read: buf must be C-contiguous")
    cdef const void *data = cnp.PyArray_DATA(buf)
    cdef size_t nbytes = <size_t>cnp.PyArray_NBYTES(buf)
    cdef double t
    with nogil:
        t = sdpa_probe_read(data, nbytes, threads)
    return t


def probe_peak(int kind, int threads, double seconds=0.2):
    """Operations a second of float32 FMA (kind 0) or int8 dot products
    (kind 1, VPDPBUSD / SDOT where the set in use and the CPU have them) on
    ``threads`` threads, and the probe's name (the roofline report's peaks)."""
    cdef const char *name = NULL
    cdef double ops
    with nogil:
        ops = sdpa_probe_peak(kind, threads, seconds, &name)
    return ops, name.decode()


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


def table_complete(name, bint declared=False):
    """Whether the named set's table, as calls run with it (test-only sets
    too; with ``declared``, the set's own before the portable kernels fill it
    in), has every kernel the driver may call; None for a set this CPU cannot
    run."""
    cdef int r = sdpa_testing_table_complete(name.encode(), declared)
    return None if r < 0 else bool(r)


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


cdef struct _call_state:
    # what an interrupt callback raised: a reference of its own, or NULL (a C
    # struct on the caller's stack, not a Python object: no allocation a call)
    PyObject *pending


cdef int _poll_signals(void *user_data) noexcept nogil:
    # runs Python's signal handlers; what they raise (KeyboardInterrupt) is kept
    # and raised once the C call has returned
    cdef _call_state *state = <_call_state *>user_data
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as exc:
            if state.pending == NULL:
                Py_INCREF(exc)
                state.pending = <PyObject *>exc
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


cdef int _planned_threads(const sdpa_problem *p):
    cdef int64_t parts = 0, items = 0, merges = 0
    cdef int threads = 0
    sdpa_testing_plan(p, 0, NULL, 0, &parts, NULL, 0, &items, &threads, &merges)
    return threads


cdef object _execute(sdpa_problem *p, bint interruptible, dict arrays):
    """Runs the problem without the GIL; raises on failure."""
    cdef sdpa_status status
    cdef _call_state call
    cdef object pending = None
    call.pending = NULL
    if _observer is not None:  # the threads the call runs with, as the planner decides them
        arrays["num_threads"] = _planned_threads(p)
        _observer(arrays)
    if interruptible:
        p.interrupt = _poll_signals
        p.interrupt_data = <void *>&call
    with nogil:
        status = sdpa_attention(p)
    if call.pending != NULL:  # take over the callback's reference
        pending = <object>call.pending
        Py_XDECREF(call.pending)
        call.pending = NULL
    if status == SDPA_OK:
        return
    if status == SDPA_ERR_INTERRUPTED:
        raise pending if pending is not None else KeyboardInterrupt()
    if status == SDPA_ERR_NO_MEMORY:
        raise MemoryError("sdpa: " + sdpa_status_message(status).decode())
    if status == SDPA_ERR_BAD_ISA:
        import os
        env = os.environ.get('SDPA_ISA')
        raise ValueError("sdpa: " + (f"SDPA_ISA={env!r}: " if env else "")
                         + (isa_env_error() or sdpa_status_message(status).decode()))
    # a rule of sdpa.h broken: the core names the field
    cdef const char *field = NULL
    text = "sdpa: " + sdpa_status_message(status).decode()
    if sdpa_check(p, &field) == status and field != NULL:
        text += f" (sdpa_problem.{field.decode()})"
    raise ValueError(text)


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


cdef inline int64_t _width(int code) noexcept:
    """The values a stored element of the storage ``code`` holds: 2 for int4
    (two a byte, low nibble first), else 1."""
    return 2 if code == SDPA_INT4 else 1


cdef inline int _fill_cache(sdpa_problem *p, cnp.ndarray k, cnp.ndarray v, cnp.ndarray ks, cnp.ndarray vs,
                            int64_t group, int nb, const int64_t *outer, int64_t hkv, int64_t rows, int64_t *ex) noexcept:
    """The views of a cache's keys and values, (outer..., hkv, rows, E / w) and
    (outer..., hkv, rows, Ev / w) with w = 2 for int4 (two values a byte, read
    along the row), and of a quantized cache's scales ks and vs (None: none),
    (outer..., hkv, rows, E / G or 1) and the same with Ev, G = group (0: one
    scale a row); p holds the dtypes and head dims, outer the nb dims before
    the heads (the batch dims, or a paged cache's blocks).  The one home of
    these rules for dense and paged calls: 0, or the reason code."""
    cdef int64_t cw = _width(p.kv_dtype)
    cdef int64_t E = p.head_dim, Ev = p.head_dim_v
    _expected(ex, outer, nb, hkv, rows, E // cw)
    if _fill_view(&p.key, k, nb, 3, ex, False):
        return _why(ARG_KEY, RULE_SHAPE)
    _expected(ex, outer, nb, hkv, rows, Ev // cw)
    if _fill_view(&p.value, v, nb, 3, ex, False):
        return _why(ARG_VALUE, RULE_SHAPE)
    if cw == 2:  # whole bytes along a row; a single column: any stride, read as contiguous
        if E // 2 > 1 and p.key.col_stride != 1:
            return _why(ARG_KEY, RULE_LAYOUT)
        if Ev // 2 > 1 and p.value.col_stride != 1:
            return _why(ARG_VALUE, RULE_LAYOUT)
        p.key.col_stride = 1
        p.value.col_stride = 1
    if ks is None:
        return _why(ARG_GROUP_SIZE, RULE_VALUE) if group else 0
    if group and (E % group or Ev % group):
        return _why(ARG_GROUP_SIZE, RULE_VALUE)
    p.kv_group_size = group
    _expected(ex, outer, nb, hkv, rows, E // group if group else 1)
    if _fill_view(&p.key_scale, ks, nb, 3, ex, False):
        return _why(ARG_KEY_SCALE, RULE_SHAPE)
    _expected(ex, outer, nb, hkv, rows, Ev // group if group else 1)
    if _fill_view(&p.value_scale, vs, nb, 3, ex, False):
        return _why(ARG_VALUE_SCALE, RULE_SHAPE)
    return 0


# the quantized key/value dtypes by name, and their core codes
# the core's codes of the float dtypes, by name
FLOATS = {"float32": SDPA_FLOAT32, "float64": SDPA_FLOAT64, "bfloat16": SDPA_BFLOAT16, "float16": SDPA_FLOAT16}
QUANTIZED = {"int8": SDPA_INT8, "float8_e4m3fn": SDPA_FP8_E4M3, "float8_e5m2": SDPA_FP8_E5M2, "int4": SDPA_INT4}
# the largest magnitude each stores (sdpa.h), by name
QUANTIZED_MAX = {"int8": SDPA_INT8_MAX, "float8_e4m3fn": SDPA_FP8_E4M3_MAX, "float8_e5m2": SDPA_FP8_E5M2_MAX,
                 "int4": SDPA_INT4_MAX}


def quantize(int code, cnp.ndarray src not None, cnp.ndarray dst not None, scales, int64_t group_size=0):
    """Quantizes src (float32, (N, H, T, C)) into dst (int8 for SDPA_INT8, else
    uint8; (N, H, T, C), or (N, H, T, C / 2) for int4) and scales (float32, (N,
    H, T, C / group_size, or 1 for 0); None for float8 without scales), each
    with contiguous columns and any other strides.  ValueError for a NaN or
    infinite value (or, without scales, one beyond the float8 range): nothing
    of its (N, H) slab is written, but earlier slabs may be (the caller checks
    first)."""
    cdef cnp.npy_intp *sh = cnp.PyArray_DIMS(src)
    cdef int64_t n, h, i, j, rows, cols, groups, width
    cdef sdpa_status st = SDPA_OK
    cdef const char *sp
    cdef char *dp
    cdef char *cp = NULL
    cdef cnp.npy_intp *ss
    cdef cnp.npy_intp *ds
    cdef cnp.npy_intp *cs = NULL
    cdef cnp.ndarray sc = None
    cdef int want = cnp.NPY_INT8 if code == SDPA_INT8 else cnp.NPY_UINT8
    if code not in (SDPA_INT8, SDPA_FP8_E4M3, SDPA_FP8_E5M2, SDPA_INT4):
        raise ValueError(f"sdpa._core.quantize: {code} is not a quantized dtype")
    if scales is not None:
        sc = <cnp.ndarray?>scales
    elif code == SDPA_INT8 or code == SDPA_INT4:
        raise TypeError("sdpa._core.quantize: int8 and int4 need scales")
    if cnp.PyArray_NDIM(src) != 4 or cnp.PyArray_NDIM(dst) != 4 \
            or _dtype_of(src) != SDPA_FLOAT32 or cnp.PyArray_TYPE(dst) != want \
            or not cnp.PyArray_ISWRITEABLE(dst) \
            or (sc is not None and (cnp.PyArray_NDIM(sc) != 4 or _dtype_of(sc) != SDPA_FLOAT32
                                    or not cnp.PyArray_ISWRITEABLE(sc))):
        raise TypeError("sdpa._core.quantize: operands of the wrong kind")
    n, h, rows, cols = sh[0], sh[1], sh[2], sh[3]
    groups = cols // group_size if group_size > 0 else 1
    width = _width(code)
    for i in range(4):
        if cnp.PyArray_DIMS(dst)[i] != (sh[i] if i < 3 else (cols + width - 1) // width) \
                or (sc is not None and cnp.PyArray_DIMS(sc)[i] != (sh[i] if i < 3 else groups)):
            raise ValueError("sdpa._core.quantize: shapes that do not fit")
    if n == 0 or h == 0 or rows == 0 or cols == 0:  # nothing to store (an empty array's strides say nothing)
        return
    ss, ds = cnp.PyArray_STRIDES(src), cnp.PyArray_STRIDES(dst)
    if sc is not None:
        cs = cnp.PyArray_STRIDES(sc)
    if (cols > width and (ss[3] != 4 or ds[3] != 1)) or (sc is not None and ((groups > 1 and cs[3] != 4)
                                                                          or cs[2] % 4)) or ss[2] % 4:
        raise ValueError("sdpa._core.quantize: rows must be contiguous")
    with nogil:
        for i in range(n):
            if st != SDPA_OK:
                break
            for j in range(h):
                sp = cnp.PyArray_BYTES(src) + i * ss[0] + j * ss[1]
                dp = cnp.PyArray_BYTES(dst) + i * ds[0] + j * ds[1]
                if sc is not None:
                    cp = cnp.PyArray_BYTES(sc) + i * cs[0] + j * cs[1]
                st = sdpa_quantize(<sdpa_dtype>code, <const float *>sp, ss[2] // 4, rows, cols, group_size,
                                   <void *>dp, ds[2], <float *>cp, cs[2] // 4 if cs != NULL else 0)
                if st != SDPA_OK:
                    break
    if st != SDPA_OK:
        raise ValueError("sdpa: " + sdpa_status_message(st).decode())


def index_topk(cnp.ndarray q not None, cnp.ndarray key not None, int key_code, key_scale,
               cnp.ndarray weights not None, int64_t k, key_lengths, bint causal, int num_threads):
    """sdpa_index_topk (sdpa.h) on arrays sdpa.sparse.index_topk checked: q
    float32 (B, H, L, E), key (B, S, E) of the core's dtype ``key_code``
    (bfloat16 and float16 as uint16, float8 as uint8), key_scale float32 (B,
    S) or None, weights float32 (B, L, H), key_lengths int64 (B,) or None;
    the last dim of each contiguous, every array native and aligned.  Returns
    (indices int32 (B, L, k), scores float32 (B, L, k))."""
    cdef sdpa_topk_problem p
    cdef cnp.ndarray ks = None
    cdef cnp.ndarray kl = None
    cdef cnp.npy_intp *qs = cnp.PyArray_STRIDES(q)
    cdef cnp.npy_intp *kst = cnp.PyArray_STRIDES(key)
    cdef cnp.npy_intp *ws = cnp.PyArray_STRIDES(weights)
    cdef int64_t B = cnp.PyArray_DIM(q, 0), L = cnp.PyArray_DIM(q, 2)
    cdef sdpa_status st
    cdef int64_t ke = cnp.PyArray_ITEMSIZE(key)
    if _dtype_of(q) != SDPA_FLOAT32 or _dtype_of(weights) != SDPA_FLOAT32 or cnp.PyArray_NDIM(q) != 4 \
            or cnp.PyArray_NDIM(key) != 3 or cnp.PyArray_NDIM(weights) != 3 or k < 0:
        raise TypeError("sdpa._core.index_topk: operands of the wrong kind")
    sdpa_topk_problem_init(&p)
    p.batch, p.heads, p.len_q, p.head_dim = B, cnp.PyArray_DIM(q, 1), L, cnp.PyArray_DIM(q, 3)
    p.len_kv, p.k = cnp.PyArray_DIM(key, 1), k
    p.query = <const float *>cnp.PyArray_DATA(q)
    p.query_strides[0], p.query_strides[1], p.query_strides[2] = qs[0] // 4, qs[1] // 4, qs[2] // 4
    p.key_dtype = <sdpa_dtype>key_code
    p.key = <const void *>cnp.PyArray_DATA(key)
    p.key_strides[0], p.key_strides[1] = kst[0] // ke, kst[1] // ke
    if key_scale is not None:
        ks = <cnp.ndarray?>key_scale
        p.key_scale = <const float *>cnp.PyArray_DATA(ks)
        p.key_scale_strides[0] = cnp.PyArray_STRIDES(ks)[0] // 4
        p.key_scale_strides[1] = cnp.PyArray_STRIDES(ks)[1] // 4
    p.weights = <const float *>cnp.PyArray_DATA(weights)
    p.weights_strides[0], p.weights_strides[1] = ws[0] // 4, ws[1] // 4
    if key_lengths is not None:
        kl = <cnp.ndarray?>key_lengths
        p.key_lengths = <const int64_t *>cnp.PyArray_DATA(kl)
    p.causal = causal
    p.num_threads = num_threads
    cdef cnp.npy_intp dims[3]
    dims[0], dims[1], dims[2] = B, L, k
    cdef cnp.ndarray indices = cnp.PyArray_EMPTY(3, dims, cnp.NPY_INT32, 0)
    cdef cnp.ndarray scores = cnp.PyArray_EMPTY(3, dims, cnp.NPY_FLOAT32, 0)
    p.indices = <int32_t *>cnp.PyArray_DATA(indices)
    p.scores = <float *>cnp.PyArray_DATA(scores)
    with nogil:
        st = sdpa_index_topk(&p)
    if st != SDPA_OK:
        if st == SDPA_ERR_NO_MEMORY:
            raise MemoryError("sdpa: " + sdpa_status_message(st).decode())
        raise ValueError("sdpa: " + sdpa_status_message(st).decode())
    return indices, scores


def quantize_int8(cnp.ndarray src not None, cnp.ndarray dst not None, cnp.ndarray scales not None,
                  int64_t group_size=0):
    """:func:`quantize` to int8."""
    quantize(SDPA_INT8, src, dst, scales, group_size)


# ---------------------------------------------------------------- the one entry

# Why a Call declined its arrays: a reason code is argument * 8 + rule, and
# reason(code) says it in words.
ARGUMENTS = ("query", "key", "value", "attn_mask", "is_causal", "scale", "enable_gqa",
             "return_weights", "return_lse", "key_lengths", "window", "softcap",
             "alibi_slopes", "sinks", "out", "num_threads", "key_scale", "value_scale",
             "group_size", "diagonal", "kv_dtype", "integer_qk", "integer_pv", "cu_seqlens_q", "cu_seqlens_k",
             "block_tables", "seq_lens", "query_start_loc", "tree_mask", "indices", "block_mask")
RULES = ("is not of a type the core takes as it is",
         "has a dtype the core does not take as it is, or one that does not go with the others",
         "has a shape that does not fit the problem",
         "has a value the core does not take",
         "is not native, aligned and (for an output) writeable",
         "may share memory with an input, or its elements one another",
         "would need more memory than this machine has")

cdef enum:
    ARG_QUERY, ARG_KEY, ARG_VALUE, ARG_MASK, ARG_CAUSAL, ARG_SCALE, ARG_GQA, ARG_WEIGHTS, \
        ARG_LSE, ARG_LENGTHS, ARG_WINDOW, ARG_SOFTCAP, ARG_ALIBI, ARG_SINKS, ARG_OUT, \
        ARG_THREADS, ARG_KEY_SCALE, ARG_VALUE_SCALE, ARG_GROUP_SIZE, ARG_DIAGONAL, ARG_KV_DTYPE, \
        ARG_INTEGER_QK, ARG_INTEGER_PV, ARG_CU_Q, ARG_CU_K, ARG_TABLES, ARG_SEQ_LENS, ARG_QUERY_START, \
        ARG_TREE, ARG_INDICES, ARG_BLOCK_MASK
cdef enum:
    RULE_TYPE, RULE_DTYPE, RULE_SHAPE, RULE_VALUE, RULE_LAYOUT, RULE_OVERLAP, RULE_MEMORY

# the reason the general path answers by computing into a new array and copying
OUT_MAY_OVERLAP = ARG_OUT * 8 + RULE_OVERLAP


def reason(int code):
    """A reason code of a :class:`Call`'s runs in words: the argument, then the rule."""
    if not (0 <= code < 8 * len(ARGUMENTS)) or (code & 7) >= len(RULES):
        raise ValueError(f"sdpa._core.reason: {code} is not a reason code")
    return f"{ARGUMENTS[code >> 3]} {RULES[code & 7]}"


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


def _physical_memory():
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


_memory_bytes = _physical_memory()


def physical_memory_bytes():
    """This machine's memory in bytes, or None where the OS does not say; the
    attention weights may take at most this much."""
    return _memory_bytes


cdef inline bint _dims(cnp.ndarray a, int *nd, cnp.npy_intp **shape) noexcept:
    """a's dims, when it has 2 to MAX_DIMS of them."""
    nd[0] = cnp.PyArray_NDIM(a)
    shape[0] = cnp.PyArray_DIMS(a)
    return 2 <= nd[0] <= MAX_DIMS


cdef inline int _why(int argument, int rule) noexcept:
    return argument * 8 + rule


cdef int _fill_head_values(sdpa_view *view, values, int argument, int cdt, int nb,
                           const int64_t *ex) noexcept:
    """ALiBi slopes or sinks: a native array of the compute type that broadcasts
    to (batch..., heads); 0, or the reason it is not."""
    if not cnp.PyArray_CheckExact(values):
        return _why(argument, RULE_TYPE)
    if _dtype_of(<cnp.ndarray>values) != cdt:
        return _why(argument, RULE_DTYPE)
    if _fill_view(view, <cnp.ndarray>values, nb, 1, ex, False):
        return _why(argument, RULE_SHAPE)
    return 0


cdef inline int _fill_heads(sdpa_problem *p, alibi_slopes, sinks, int cdt, int nb, const int64_t *ex) noexcept:
    """A call's per-head values, each None or as :func:`_fill_head_values`
    takes it, ex the (batch..., heads) they broadcast to; 0 or the reason."""
    cdef int why = 0
    if alibi_slopes is not None:
        why = _fill_head_values(&p.alibi, alibi_slopes, ARG_ALIBI, cdt, nb, ex)
    if not why and sinks is not None:
        why = _fill_head_values(&p.sinks, sinks, ARG_SINKS, cdt, nb, ex)
    return why


cdef inline int _out_checked(out, int dt) noexcept:
    """out=: an ndarray of the query's dtype dt, writeable; 0 or the reason
    (its shape is checked where its view is filled)."""
    if not cnp.PyArray_CheckExact(out):
        return _why(ARG_OUT, RULE_TYPE)
    if _dtype_of(<cnp.ndarray>out) != dt:
        return _why(ARG_OUT, RULE_DTYPE)
    if not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
        return _why(ARG_OUT, RULE_LAYOUT)
    return 0


cdef int _storage(int code, int dt, cnp.ndarray k, cnp.ndarray v, key_scale, value_scale, int *kvdt) except -1:
    """Whether keys, values and scales fit a query of dtype dt: float keys and
    values of a dtype that pairs with it, without scales, for code -1; else the
    storage of the quantized code (int8, or uint8 for float8 and int4) with
    float32 scale arrays (both; int8 and int4 need them, float8 may go
    without) and a float32 or 16-bit query.  0 with *kvdt the keys' dtype,
    or the reason code."""
    cdef int t
    if code < 0:
        if key_scale is not None or value_scale is not None:
            return _why(ARG_KEY_SCALE if key_scale is not None else ARG_VALUE_SCALE, RULE_VALUE)
        kvdt[0] = _dtype_of(k)
        if not _pairs(dt, kvdt[0]):
            return _why(ARG_KEY, RULE_DTYPE)
        if _dtype_of(v) != kvdt[0]:
            return _why(ARG_VALUE, RULE_DTYPE)
        return 0
    kvdt[0] = code
    if key_scale is not None or value_scale is not None or code == SDPA_INT8 or code == SDPA_INT4:
        if not cnp.PyArray_CheckExact(key_scale):
            return _why(ARG_KEY_SCALE, RULE_TYPE)
        if not cnp.PyArray_CheckExact(value_scale):
            return _why(ARG_VALUE_SCALE, RULE_TYPE)
        if _dtype_of(<cnp.ndarray>key_scale) != SDPA_FLOAT32:
            return _why(ARG_KEY_SCALE, RULE_DTYPE)
        if _dtype_of(<cnp.ndarray>value_scale) != SDPA_FLOAT32:
            return _why(ARG_VALUE_SCALE, RULE_DTYPE)
    if dt == SDPA_FLOAT64:
        return _why(ARG_QUERY, RULE_DTYPE)
    t = cnp.NPY_INT8 if code == SDPA_INT8 else cnp.NPY_UINT8
    if cnp.PyArray_TYPE(k) != t:
        return _why(ARG_KEY, RULE_DTYPE)
    if cnp.PyArray_TYPE(v) != t:
        return _why(ARG_VALUE, RULE_DTYPE)
    return 0


cdef object _call_constants = None  # sdpa._checks.call_constants, imported at first use

# prepared calls a base keeps by their options; past this many it starts again
# (a key holds no array, so a full table means options that change each call)
cdef enum:
    MAX_PREPARED = 256
MAX_PREPARED_CALLS = MAX_PREPARED  # the bound, seen from Python


cdef class Call:
    """A prepared call: the constants of ``scaled_dot_product_attention`` (and
    of a cache's format), checked once by ``sdpa._checks.call_constants``; each
    call then passes only its arrays.

    ``Call(is_causal=False, scale=None, enable_gqa=False, window=None,
    softcap=None, num_threads=None, return_weights=False, return_lse=False,
    kv_dtype=None, group_size=0, integer_qk=False, integer_pv=False,
    diagonal=None)``, all by keyword, raises a TypeError or ValueError naming
    an argument that breaks its rule.  ``kv_dtype`` (a value of
    :data:`QUANTIZED`; None: float keys and values of the query's kind)
    names a quantized cache's storage, whose scales :meth:`run_cache` takes;
    ``diagonal``, an int, makes the call causal with row l seeing keys s <= l
    + diagonal (the window and ALiBi stay aligned by ``is_causal``).

    :meth:`run` and :meth:`run_cache` compute when every array is in the form
    the core takes as it is, and return what the public function returns (the
    output, or a tuple with the weights and/or lse asked for); otherwise they
    return a reason code, an int (``reason(code)`` says which argument broke
    which rule), having computed and written nothing.  :meth:`prepared` gives
    the call of this cache format with other options, kept by their key."""
    cdef int causal_mode  # 0: none, 1: top left, 2: bottom right, 3: from diagonal
    cdef bint top_left  # is_causal True or "top_left": the window and ALiBi aligned to the first keys
    cdef int64_t diagonal
    cdef bint has_scale
    cdef double scale
    cdef bint gqa
    cdef bint has_window
    cdef int64_t window_left, window_right
    cdef double softcap  # 0: none
    cdef int threads  # 0: the setting
    cdef bint weights, lse
    cdef int kvdt  # -1: float keys and values; else the quantized code
    cdef int64_t group
    cdef bint iqk, ipv
    cdef readonly tuple constants
    cdef dict _prepared
    # the options of the last call prepared(), as given, and that call: a loop
    # passing the same objects each time skips building and hashing a key
    cdef object _last_causal, _last_scale, _last_gqa, _last_window, _last_softcap, _last_threads
    cdef object _last_weights, _last_lse
    cdef Call _last

    def __init__(self, *, is_causal=False, scale=None, enable_gqa=False, window=None, softcap=None,
                 num_threads=None, return_weights=False, return_lse=False, kv_dtype=None, group_size=0,
                 integer_qk=False, integer_pv=False, diagonal=None):
        global _call_constants
        if _call_constants is None:
            from sdpa._checks import call_constants
            _call_constants = call_constants
        c = _call_constants(is_causal, scale, enable_gqa, window, softcap, num_threads, return_weights,
                            return_lse, kv_dtype, group_size, integer_qk, integer_pv, diagonal)
        self.constants = c
        is_causal, scale, enable_gqa, window, softcap, num_threads, return_weights, return_lse, \
            kv_dtype, group_size, integer_qk, integer_pv, diagonal = c
        self.causal_mode = 0 if is_causal is False else 1 if (is_causal is True or is_causal == "top_left") else 2
        self.top_left = self.causal_mode == 1
        if diagonal is not None:
            self.causal_mode = 3
            self.diagonal = diagonal
        self.has_scale = scale is not None
        self.scale = scale if scale is not None else 0.0
        self.gqa = enable_gqa
        self.has_window = window is not None
        if window is not None:  # sides past SDPA_MAX_POSITION already taken as it (call_constants)
            self.window_left = window[0]
            self.window_right = window[1]
        self.softcap = softcap if softcap is not None else 0.0
        self.threads = 0 if num_threads is None else num_threads  # at most SDPA_MAX_THREADS (call_constants)
        self.weights = return_weights
        self.lse = return_lse
        self.kvdt = -1 if kv_dtype is None else kv_dtype
        self.group = group_size
        self.iqk = integer_qk
        self.ipv = integer_pv
        self._prepared = {}

    @property
    def kv_dtype(self):
        """The quantized storage's code, or None for float keys and values."""
        return None if self.kvdt < 0 else self.kvdt

    @property
    def enable_gqa(self):
        return self.gqa

    @property
    def return_weights(self):
        return self.weights

    def prepared(self, is_causal, scale, enable_gqa, window, softcap, num_threads, return_weights, return_lse):
        """The call of this one's cache format (kv_dtype, group_size, integer_qk,
        integer_pv) with these options, made (and checked) once and kept by
        their key; a TypeError or ValueError naming an option that breaks its
        rule.  Options already in their one form (bools, a str, None or a
        float, a tuple of two ints, None or an int) are looked up as they are."""
        if self._last is not None and is_causal is self._last_causal and scale is self._last_scale \
                and enable_gqa is self._last_gqa and window is self._last_window \
                and softcap is self._last_softcap and num_threads is self._last_threads \
                and return_weights is self._last_weights and return_lse is self._last_lse:
            return self._last
        cdef tuple key = None
        if (type(is_causal) is bool or type(is_causal) is str) and (scale is None or type(scale) is float) \
                and type(enable_gqa) is bool \
                and (window is None or (type(window) is tuple and len(<tuple>window) == 2
                                        and type((<tuple>window)[0]) is int and type((<tuple>window)[1]) is int)) \
                and (softcap is None or type(softcap) is float) and (num_threads is None or type(num_threads) is int) \
                and type(return_weights) is bool and type(return_lse) is bool:
            key = (is_causal, scale, enable_gqa, window, softcap, num_threads, return_weights, return_lse)
            found = self._prepared.get(key)
            if found is not None:
                self._remember(key, found)
                return found
        c = self.constants
        call = Call(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window, softcap=softcap,
                    num_threads=num_threads, return_weights=return_weights, return_lse=return_lse,
                    kv_dtype=c[8], group_size=c[9], integer_qk=c[10], integer_pv=c[11])
        canonical = call.constants[:8]
        found = self._prepared.get(canonical)
        if found is not None:
            call = found
        if len(self._prepared) + 2 > MAX_PREPARED:  # whatever key is added: many can mean one call
            self._prepared.clear()
        self._prepared[canonical] = call
        if key is not None:
            self._prepared[key] = call
            self._remember(key, call)
        return call

    cdef void _remember(self, tuple key, Call call):
        """Keeps ``call`` as the last one prepared, for options given as ``key``."""
        self._last_causal, self._last_scale, self._last_gqa, self._last_window, self._last_softcap, \
            self._last_threads, self._last_weights, self._last_lse = key
        self._last = call

    def prepared_count(self):
        """How many keys :meth:`prepared` holds now (at most MAX_PREPARED_CALLS)."""
        return len(self._prepared)

    def at_diagonal(self, diagonal):
        """This call with ``diagonal`` (None: back to ``is_causal``'s own)."""
        return _call_of(self.constants[:12] + (diagonal,))

    def __reduce__(self):
        return _call_of, (self.constants,)

    def run(self, query, key, value, attn_mask=None, key_lengths=None, alibi_slopes=None, sinks=None, out=None,
            blocks=None, key_scores=None, dropout=None):
        """The call over float keys and values (a reason code when declined);
        ``blocks`` None or a block map (states, block_q, block_k): int8 states
        (..., Hq or 1, ceil(L / block_q), ceil(S / block_k)) of 0, 1 and 2
        (others refused by the core with a ValueError, nothing written);
        ``key_scores`` None or the rows they count (0: every row): the key
        scores (..., Hkv, S), float32, are then returned last; ``dropout``
        None or (dropout_p, seed): dropout_p in (0, 1), seed an int in
        [0, 2**64) (checked by the caller)."""
        return self._run(query, key, value, None, None, attn_mask, key_lengths, alibi_slopes, sinks, out, None,
                         blocks, key_scores, dropout)

    def run_cache(self, query, key, value, key_scale, value_scale, attn_mask=None, out=None, extras=None,
                  indices=None, blocks=None, key_scores=None, dropout=None):
        """The call over a cache's keys and values, with the scales of a
        quantized one (None: unscaled float8, or a float cache); ``extras``
        None or (alibi_slopes, sinks, key_lengths); ``indices`` None or the
        positions each row attends (top-k lists: native, aligned int32
        (..., Hkv or 1, L, k), entries in [-1, S), not checked here: the
        core refuses others with a ValueError, writing nothing); ``blocks``
        ``key_scores`` and ``dropout`` as for :meth:`run`."""
        if extras is None:
            return self._run(query, key, value, key_scale, value_scale, attn_mask, None, None, None, out, indices,
                             blocks, key_scores, dropout)
        alibi_slopes, sinks, key_lengths = extras
        return self._run(query, key, value, key_scale, value_scale, attn_mask, key_lengths, alibi_slopes, sinks,
                         out, indices, blocks, key_scores, dropout)

    def run_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, extras=None, out=None, *,
                   int plan_threads=-1):
        """Packed sequences in one call (float keys and values; arrays as
        :func:`sdpa.varlen_attention` checks them): query (T, Hq, E), key
        (Tk, Hkv, E) and value (Tk, Hkv, Ev) of dtypes the core takes as they
        are; cu_seqlens_q and cu_seqlens_k native, C-contiguous int64 prefix
        sums (n + 1); ``extras`` None or (alibi_slopes, sinks), each (n, Hq)
        of the compute type or None; out (T, Hq, Ev) of the query's dtype or
        None.  Causal with the diagonal, the window and ALiBi counted from each
        sequence's end (from its start for ``is_causal`` True).  Returns the
        output, and the lse (T, Hq) with ``return_lse``, or a reason code.
        With plan_threads >= 0 nothing is computed: it returns what the
        planner makes of the call for that many threads (0: this machine's),
        a dict."""
        return _varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, extras, out, plan_threads)

    def run_paged(self, query, key_cache, value_cache, block_tables, seq_lens, scales=None, extras=None,
                  out=None, *, int plan_threads=-1, key_scores=None):
        """Attention over paged caches of this call's format (arrays as
        :func:`sdpa.paged_attention` checks them): query (B, Hq, L, E) of a
        dtype the core takes, or packed (T, Hq, E) with query_start_loc;
        key_cache (N, Hkv, bs, E / w) and value_cache (N, Hkv, bs, Ev / w)
        of the format's storage (w 2 for int4); ``scales`` None or (key_scale,
        value_scale), float32 (N, Hkv, bs, E / G or 1); int32 block_tables (B,
        max_blocks) and int64 seq_lens (B,), both C-contiguous; ``extras``
        None or (alibi_slopes, sinks, query_start_loc, tree_mask): (B, Hq) of
        the compute type, native int64 prefix sums (B + 1), a bool (B, L, L)
        (is_causal then False); out of the output's shape, (B, Hq, L, Ev) or
        (T, Hq, Ev).  Row l of sequence b is at position seq_lens[b] - L_b +
        l.  Returns the output, and the lse with ``return_lse``, or a reason
        code.  A block id out of range where it is read, or a sequence longer
        than its table, is a ValueError and nothing is written.  ``key_scores``
        None or the rows they count (0: all; not with a packed query or a
        tree): the key scores (B, Hkv, max_blocks x block_size) by position,
        float32, returned last.
        plan_threads as for :meth:`run_varlen`."""
        return _paged(self, query, key_cache, value_cache, block_tables, seq_lens, scales, extras, out,
                      plan_threads, key_scores)

    cdef void _fill_constants(self, sdpa_problem *p, int64_t E) noexcept:
        """The call's constants into p (E: the head dim, for the default scale)."""
        p.scale = self.scale if self.has_scale else (1.0 / sqrt(<double>E) if E > 0 else 1.0)
        p.causal = self.causal_mode != 0
        p.num_threads = self.threads
        if self.has_window:
            p.window_left = self.window_left
            p.window_right = self.window_right
        p.softcap = self.softcap
        p.integer_qk = self.iqk
        p.integer_pv = self.ipv

    cdef object _run(self, query, key, value, key_scale, value_scale, attn_mask, key_lengths, alibi_slopes,
                     sinks, out, indices, blocks, key_scores, dropout=None):
        cdef cnp.ndarray q, k, v, m = None, o = None, kl = None, lse = None, w = None, ix = None, bm = None
        cdef cnp.ndarray ksc = None
        cdef cnp.ndarray ks = None, vs = None
        cdef cnp.npy_intp *shapes[3]
        cdef int nds[3]
        cdef int nd, nb, mn, i, j, t, dt, kvdt, cdt, why
        cdef int64_t hq, hk, hv, hkv, heads, group, L, S, E, Ev, size, n
        cdef int64_t cw  # values a stored column holds: 2 for int4
        cdef int64_t ex[MAX_DIMS]
        cdef cnp.npy_intp dims[MAX_DIMS]
        cdef sdpa_problem p
        cdef double nbytes

        if not cnp.PyArray_CheckExact(query):
            return _why(ARG_QUERY, RULE_TYPE)
        if not cnp.PyArray_CheckExact(key):
            return _why(ARG_KEY, RULE_TYPE)
        if not cnp.PyArray_CheckExact(value):
            return _why(ARG_VALUE, RULE_TYPE)
        q, k, v = <cnp.ndarray>query, <cnp.ndarray>key, <cnp.ndarray>value
        if not _dims(q, &nds[0], &shapes[0]):
            return _why(ARG_QUERY, RULE_SHAPE)
        if not _dims(k, &nds[1], &shapes[1]):
            return _why(ARG_KEY, RULE_SHAPE)
        if not _dims(v, &nds[2], &shapes[2]):
            return _why(ARG_VALUE, RULE_SHAPE)
        dt = _dtype_of(q)
        if dt < 0:
            return _why(ARG_QUERY, RULE_DTYPE)
        cdt = _compute_dtype(dt)
        why = _storage(self.kvdt, dt, k, v, key_scale, value_scale, &kvdt)
        if why:
            return why
        if key_scale is not None:  # checked by _storage: both scales, float32 arrays
            ks, vs = <cnp.ndarray>key_scale, <cnp.ndarray>value_scale
        cw = _width(kvdt)

        # the sizes, as sdpa._checks.plan_shapes derives them for the general path
        # (which explains what does not fit); tests/test_boundary.py holds the two equal
        L = shapes[0][nds[0] - 2]
        E = shapes[0][nds[0] - 1]
        S = shapes[1][nds[1] - 2]
        Ev = shapes[2][nds[2] - 1] * cw
        if shapes[1][nds[1] - 1] * cw != E:
            return _why(ARG_KEY, RULE_SHAPE)
        if shapes[2][nds[2] - 2] != S:
            return _why(ARG_VALUE, RULE_SHAPE)
        nd = max(nds[0], max(nds[1], nds[2]))
        hq = shapes[0][nds[0] - 3] if nds[0] >= 3 else 1
        hk = shapes[1][nds[1] - 3] if nds[1] >= 3 else 1
        hv = shapes[2][nds[2] - 3] if nds[2] >= 3 else 1
        if hk != hv and hk != 1 and hv != 1:
            return _why(ARG_VALUE, RULE_SHAPE)
        hkv = max(hk, hv) if min(hk, hv) > 0 else 0
        if self.gqa:
            if hkv == 0 or hq % hkv:
                return _why(ARG_GQA, RULE_SHAPE)
            heads = hq
            group = max(hq // max(hkv, 1), 1)
        else:
            if hq != hkv and hq != 1 and hkv != 1:
                return _why(ARG_QUERY, RULE_SHAPE)
            heads = 0 if hq == 0 or hkv == 0 else max(hq, hkv)
            group = 1
        nb = nd - 3 if nd >= 3 else 0
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
                        return _why(ARG_QUERY + t, RULE_SHAPE)
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

        # the constants
        self._fill_constants(&p, E)
        if self.causal_mode == 2:
            p.causal_offset = S - L
        elif self.causal_mode == 3:
            p.causal_offset = self.diagonal
        if self.has_window or alibi_slopes is not None:
            # aligned by is_causal: to the first keys for True / "top_left", else to the last
            p.align_offset = 0 if self.top_left else S - L

        # operands
        _expected(ex, p.batch_shape, nb, heads, L, E)
        if _fill_view(&p.query, q, nb, 3, ex, False):
            return _why(ARG_QUERY, RULE_SHAPE)
        why = _fill_cache(&p, k, v, ks, vs, self.group, nb, p.batch_shape, heads // group, S, ex)
        if why:
            return why
        _expected(ex, p.batch_shape, nb, heads, L, S)  # the scores' shape: mask, slopes, sinks
        if attn_mask is not None:
            if not cnp.PyArray_CheckExact(attn_mask):
                return _why(ARG_MASK, RULE_TYPE)
            m = <cnp.ndarray>attn_mask
            if cnp.PyArray_TYPE(m) == cnp.NPY_BOOL:
                if not cnp.PyArray_ISALIGNED(m):
                    return _why(ARG_MASK, RULE_LAYOUT)
                p.mask_kind = SDPA_MASK_BOOL
            elif _dtype_of(m) == cdt:
                p.mask_kind = SDPA_MASK_ADDITIVE
            else:
                return _why(ARG_MASK, RULE_DTYPE)
            if _fill_view(&p.mask, m, nb, 3, ex, False):
                return _why(ARG_MASK, RULE_SHAPE)
        why = _fill_heads(&p, alibi_slopes, sinks, cdt, nb, ex)
        if why:
            return why
        if key_lengths is not None:
            if not cnp.PyArray_CheckExact(key_lengths):
                return _why(ARG_LENGTHS, RULE_TYPE)
            kl = <cnp.ndarray>key_lengths
            if cnp.PyArray_TYPE(kl) != cnp.NPY_INT64:
                return _why(ARG_LENGTHS, RULE_DTYPE)
            if not (cnp.PyArray_ISNOTSWAPPED(kl) and cnp.PyArray_ISALIGNED(kl) and cnp.PyArray_IS_C_CONTIGUOUS(kl)):
                return _why(ARG_LENGTHS, RULE_LAYOUT)
            if _fill_lengths(&p, kl):
                return _why(ARG_LENGTHS, RULE_SHAPE)
            for i in range(cnp.PyArray_SIZE(kl)):
                if p.key_lengths[i] < 0:
                    return _why(ARG_LENGTHS, RULE_VALUE)
        if indices is not None:  # top-k lists (..., Hkv or 1, L, k)
            if not cnp.PyArray_CheckExact(indices):
                return _why(ARG_INDICES, RULE_TYPE)
            ix = <cnp.ndarray>indices
            if cnp.PyArray_TYPE(ix) != cnp.NPY_INT32:
                return _why(ARG_INDICES, RULE_DTYPE)
            if not (cnp.PyArray_ISNOTSWAPPED(ix) and cnp.PyArray_ISALIGNED(ix)) or cnp.PyArray_NDIM(ix) < 1:
                return _why(ARG_INDICES, RULE_LAYOUT)
            n = cnp.PyArray_DIMS(ix)[cnp.PyArray_NDIM(ix) - 1]
            _expected(ex, p.batch_shape, nb, heads // group, L, n)
            if _fill_view(&p.topk_indices, ix, nb, 3, ex, False):
                return _why(ARG_INDICES, RULE_SHAPE)
            p.topk = n
        if blocks is not None:  # a block map: (states, block_q, block_k)
            states, p.block_q, p.block_k = blocks
            if not cnp.PyArray_CheckExact(states):
                return _why(ARG_BLOCK_MASK, RULE_TYPE)
            bm = <cnp.ndarray>states
            if cnp.PyArray_TYPE(bm) != cnp.NPY_INT8:
                return _why(ARG_BLOCK_MASK, RULE_DTYPE)
            if p.block_q < 1 or p.block_k < 1:
                return _why(ARG_BLOCK_MASK, RULE_VALUE)
            _expected(ex, p.batch_shape, nb, heads, (L + p.block_q - 1) // p.block_q, (S + p.block_k - 1) // p.block_k)
            if _fill_view(&p.block_states, bm, nb, 3, ex, False):
                return _why(ARG_BLOCK_MASK, RULE_SHAPE)

        # the outputs: out (checked) or new, the weights and lse new
        mn = nb + 3 if nd >= 3 else 2
        for i in range(nb):
            dims[i] = p.batch_shape[i]
        if nd >= 3:
            dims[nb] = heads
        dims[mn - 2] = L
        dims[mn - 1] = Ev
        if out is not None:
            why = _out_checked(out, dt)
            if why:
                return why
            o = <cnp.ndarray>out
            if not (_no_self_overlap(o) and _disjoint(o, q) and _disjoint(o, k) and _disjoint(o, v)
                    and _disjoint(o, m) and _disjoint(o, kl) and _disjoint(o, ks) and _disjoint(o, vs)
                    and _disjoint(o, ix) and _disjoint(o, bm)
                    and (alibi_slopes is None or _disjoint(o, <cnp.ndarray>alibi_slopes))
                    and (sinks is None or _disjoint(o, <cnp.ndarray>sinks))):
                return OUT_MAY_OVERLAP
            _expected(ex, p.batch_shape, nb, heads, L, Ev)
            if _fill_view(&p.out, o, nb, 3, ex, True):
                return _why(ARG_OUT, RULE_SHAPE)
        if self.weights:
            nbytes = 8.0 if cdt == SDPA_FLOAT64 else 4.0
            for i in range(mn - 1):
                nbytes *= dims[i]
            nbytes *= S
            if _memory_bytes is not None and nbytes > _memory_bytes:
                return _why(ARG_WEIGHTS, RULE_MEMORY)
        if o is None:
            o = cnp.PyArray_EMPTY(mn, dims, cnp.PyArray_TYPE(q), 0)  # the query's dtype
            _expected(ex, p.batch_shape, nb, heads, L, Ev)
            _fill_view(&p.out, o, nb, 3, ex, True)
        if self.weights:
            dims[mn - 1] = S
            w = cnp.PyArray_EMPTY(mn, dims, _typenum_of(cdt), 0)
            dims[mn - 1] = Ev
            _expected(ex, p.batch_shape, nb, heads, L, S)
            _fill_view(&p.weights, w, nb, 3, ex, True)
        if self.lse:
            lse = cnp.PyArray_EMPTY(mn - 1, dims, _typenum_of(cdt), 0)
            _expected(ex, p.batch_shape, nb, heads, L, Ev)
            _fill_view(&p.lse, lse, nb, 2, ex, True)
        if key_scores is not None:  # (..., Hkv, S) float32, the rows counted
            p.key_scores_rows = key_scores
            if nd >= 3:
                dims[nb] = heads // group
            dims[mn - 2] = S
            ksc = cnp.PyArray_EMPTY(mn - 1, dims, cnp.NPY_FLOAT32, 0)  # every element written
            _expected(ex, p.batch_shape, nb, heads // group, S, 1)
            _fill_view(&p.key_scores, ksc, nb, 2, ex, True)
            p.key_scores.col_stride = p.key_scores.row_stride
            p.key_scores.row_stride = 0
        if dropout is not None:
            p.dropout_p = dropout[0]
            p.dropout_seed = dropout[1]

        if cnp.PyArray_SIZE(o) or (w is not None and cnp.PyArray_SIZE(w)) \
                or (lse is not None and cnp.PyArray_SIZE(lse)) or (ksc is not None and cnp.PyArray_SIZE(ksc)):
            arrays = None
            if _observer is not None:
                arrays = {"q": q, "k": k, "v": v, "mask": m}
            _execute(&p, _interruptible(), arrays)
        if w is None and lse is None and ksc is None:
            return o
        return (o,) + tuple(a for a in (w, lse, ksc) if a is not None)


def _call_of(tuple constants):
    """The :class:`Call` of these constants, in the order of its ``constants``."""
    c = constants
    return Call(is_causal=c[0], scale=c[1], enable_gqa=c[2], window=c[3], softcap=c[4], num_threads=c[5],
                return_weights=c[6], return_lse=c[7], kv_dtype=c[8], group_size=c[9], integer_qk=c[10],
                integer_pv=c[11], diagonal=c[12])


# the plain call's base: float keys and values
cdef Call _plain = None


def plain():
    """The base :class:`Call` of float keys and values, whose
    :meth:`Call.prepared` the public function asks for its options."""
    global _plain
    if _plain is None:
        _plain = Call()
    return _plain


# ---------------------------------------------------------------- ragged and paged calls

# the layout of sdpa_part_info (testing.h), for plan()
_PART_FIELDS = ("seq", "members", "heads", "rows", "keys", "tasks", "row_mode", "staged", "tree", "packed",
                "cost")


cdef object _plan_of(sdpa_problem *p, int threads):
    """What the planner makes of p for `threads` threads (0: as a call would):
    the parts in the order their tasks run, each work item's estimated cost,
    the threads a call would start and the sequences merged from parts."""
    cdef int64_t num_parts = 0, num_items = 0, num_merges = 0
    cdef int num_threads = 0
    cdef sdpa_status st = sdpa_testing_plan(p, threads, NULL, 0, &num_parts, NULL, 0, &num_items, &num_threads,
                                            &num_merges)
    if st != SDPA_OK:
        raise ValueError("sdpa: " + sdpa_status_message(st).decode())
    cdef cnp.npy_intp n_costs[1]
    cdef cnp.npy_intp n_raw[1]
    n_costs[0] = num_items
    n_raw[0] = max(num_parts, 1) * sizeof(sdpa_part_info)
    cdef cnp.ndarray costs = cnp.PyArray_EMPTY(1, n_costs, cnp.NPY_FLOAT64, 0)
    cdef cnp.ndarray raw = cnp.PyArray_EMPTY(1, n_raw, cnp.NPY_UINT8, 0)
    cdef sdpa_part_info *info = <sdpa_part_info *>cnp.PyArray_DATA(raw)
    st = sdpa_testing_plan(p, threads, info, num_parts, &num_parts, <double *>cnp.PyArray_DATA(costs), num_items,
                           &num_items, &num_threads, &num_merges)
    if st != SDPA_OK:
        raise ValueError("sdpa: " + sdpa_status_message(st).decode())
    parts = []
    cdef int64_t i
    for i in range(num_parts):
        parts.append({"seq": info[i].seq, "members": info[i].members, "heads": info[i].heads,
                      "rows": info[i].rows, "keys": info[i].keys, "tasks": info[i].tasks,
                      "row_mode": bool(info[i].row_mode), "staged": bool(info[i].staged),
                      "tree": bool(info[i].tree), "packed": bool(info[i].packed), "cost": info[i].cost})
    return {"threads": num_threads, "merges": num_merges, "parts": parts, "costs": costs}


cdef object _finish_call(sdpa_problem *p, int plan_threads, q, k, v, mask, cnp.ndarray o, cnp.ndarray lse,
                         bint return_lse, cnp.ndarray scores=None):
    """Computes p (or, plan_threads >= 0, describes its plan) and returns the
    output, with the lse when asked; the observer sees q, k, v and mask."""
    if plan_threads >= 0:
        return _plan_of(p, plan_threads)
    if cnp.PyArray_SIZE(o) or (lse is not None and cnp.PyArray_SIZE(lse)):
        _execute(p, _interruptible(), {"q": q, "k": k, "v": v, "mask": mask} if _observer is not None else None)
    if scores is not None:
        return (o, lse, scores) if return_lse else (o, scores)
    return (o, lse) if return_lse else o


cdef int _fill_packed(sdpa_view *view, cnp.ndarray a, int64_t heads, int64_t rows, int64_t cols, bint output):
    """A packed (rows, heads, cols) operand (or (rows, heads), cols -1: an
    lse) as a view of (head, row, column): the rows of every sequence one
    after the other.  Returns 0, or 1 when it does not fit."""
    cdef int64_t ex[3]
    ex[0], ex[1], ex[2] = heads, rows, cols
    if cnp.PyArray_NDIM(a) != (2 if cols < 0 else 3):
        return 1
    if cols < 0:
        return _fill_view(view, a.T, 0, 2, ex, output)
    return _fill_view(view, a.transpose(1, 0, 2), 0, 3, ex, output)


cdef int _fill_prefix_sums(const int64_t **dst, cnp.ndarray a, int64_t n):
    """n + 1 native int64 prefix sums, C-contiguous (checked in sdpa.varlen / sdpa.paged)."""
    if cnp.PyArray_TYPE(a) != cnp.NPY_INT64 or cnp.PyArray_NDIM(a) != 1 or a.shape[0] != n + 1 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISNOTSWAPPED(a) \
            or not cnp.PyArray_ISALIGNED(a):
        return 1
    dst[0] = <const int64_t *>cnp.PyArray_DATA(a)
    return 0


cdef object _varlen(Call c, query, key, value, cu_seqlens_q, cu_seqlens_k, extras, out, int plan_threads):
    """:meth:`Call.run_varlen`."""
    cdef cnp.ndarray q, k, v, o, lse = None
    cdef sdpa_problem p
    cdef int64_t ex[2]
    cdef cnp.npy_intp dims[3]
    cdef int dt, kvdt, cdt, why
    cdef int64_t T, Hq, E, Tk, Hkv, Ev, n
    alibi_slopes, sinks = (None, None) if extras is None else extras
    if c.kvdt >= 0:
        return _why(ARG_KV_DTYPE, RULE_VALUE)
    if c.causal_mode == 3:
        return _why(ARG_DIAGONAL, RULE_VALUE)
    if c.weights:
        return _why(ARG_WEIGHTS, RULE_VALUE)
    for a, arg in ((query, ARG_QUERY), (key, ARG_KEY), (value, ARG_VALUE), (cu_seqlens_q, ARG_CU_Q),
                   (cu_seqlens_k, ARG_CU_K)):
        if not cnp.PyArray_CheckExact(a):
            return _why(arg, RULE_TYPE)
    q, k, v = <cnp.ndarray>query, <cnp.ndarray>key, <cnp.ndarray>value
    dt = _dtype_of(q)
    if dt < 0:
        return _why(ARG_QUERY, RULE_DTYPE)
    why = _storage(-1, dt, k, v, None, None, &kvdt)
    if why:
        return why
    if q.ndim != 3:
        return _why(ARG_QUERY, RULE_SHAPE)
    if k.ndim != 3:
        return _why(ARG_KEY, RULE_SHAPE)
    if v.ndim != 3:
        return _why(ARG_VALUE, RULE_SHAPE)
    cdt = _compute_dtype(dt)
    T, Hq, E = q.shape[0], q.shape[1], q.shape[2]
    Tk, Hkv, Ev = k.shape[0], k.shape[1], v.shape[2]
    if cnp.PyArray_NDIM(<cnp.ndarray>cu_seqlens_q) != 1:
        return _why(ARG_CU_Q, RULE_SHAPE)
    n = (<cnp.ndarray>cu_seqlens_q).shape[0] - 1
    if Hkv < 1 or Hq % Hkv or k.shape[2] != E:
        return _why(ARG_KEY, RULE_SHAPE)
    if v.shape[0] != Tk or v.shape[1] != Hkv:
        return _why(ARG_VALUE, RULE_SHAPE)
    if n < 0:
        return _why(ARG_CU_Q, RULE_SHAPE)
    sdpa_problem_init(&p)
    p.dtype = <sdpa_dtype>dt
    if kvdt != dt:
        p.kv_dtype = <sdpa_dtype>kvdt
    p.num_batch_dims = 1
    p.batch_shape[0] = n
    p.num_heads = Hq
    p.gqa_group = Hq // Hkv
    p.len_q = T
    p.len_kv = Tk
    p.head_dim = E
    p.head_dim_v = Ev
    c._fill_constants(&p, E)
    # the diagonal, the window and ALiBi count from each sequence's end unless
    # the call is causal from the top left
    p.offsets_from_end = c.causal_mode != 1
    if _fill_prefix_sums(&p.cu_seqlens_q, cu_seqlens_q, n):
        return _why(ARG_CU_Q, RULE_SHAPE)
    if _fill_prefix_sums(&p.cu_seqlens_k, cu_seqlens_k, n):
        return _why(ARG_CU_K, RULE_SHAPE)
    if _fill_packed(&p.query, q, Hq, T, E, False):
        return _why(ARG_QUERY, RULE_SHAPE)
    if _fill_packed(&p.key, k, Hkv, Tk, E, False):
        return _why(ARG_KEY, RULE_SHAPE)
    if _fill_packed(&p.value, v, Hkv, Tk, Ev, False):
        return _why(ARG_VALUE, RULE_SHAPE)
    ex[0], ex[1] = n, Hq
    why = _fill_heads(&p, alibi_slopes, sinks, cdt, 1, ex)
    if why:
        return why
    dims[0], dims[1], dims[2] = T, Hq, Ev
    if out is None:
        o = cnp.PyArray_EMPTY(3, dims, cnp.PyArray_TYPE(q), 0)
    else:
        why = _out_checked(out, dt)
        if why:
            return why
        o = <cnp.ndarray>out
    if _fill_packed(&p.out, o, Hq, T, Ev, True):
        return _why(ARG_OUT, RULE_SHAPE)
    if c.lse:
        lse = cnp.PyArray_EMPTY(2, dims, _typenum_of(cdt), 0)
        _fill_packed(&p.lse, lse, Hq, T, -1, True)
    return _finish_call(&p, plan_threads, q, k, v, None, o, lse, c.lse)


cdef object _paged(Call c, query, key_cache, value_cache, block_tables, seq_lens, scales, extras, out,
                   int plan_threads, key_scores):
    """:meth:`Call.run_paged`."""
    cdef cnp.ndarray q, kc, vc, bt, sl, o, lse = None, ks = None, vs = None, tm = None, ksc = None
    cdef sdpa_problem p
    cdef int64_t ex[MAX_DIMS]
    cdef cnp.npy_intp dims[4]
    cdef int dt, cdt, why, kvdt
    cdef bint packed
    cdef int64_t B, Hq, L, T = 0, E, Ev, Hkv, bs, cw = _width(c.kvdt)
    alibi_slopes, sinks, query_start_loc, tree_mask = (None, None, None, None) if extras is None else extras
    key_scale, value_scale = (None, None) if scales is None else scales
    packed = query_start_loc is not None
    if c.causal_mode > 1:  # a paged row's position is set by its sequence's length
        return _why(ARG_CAUSAL if c.causal_mode == 2 else ARG_DIAGONAL, RULE_VALUE)
    if c.weights:
        return _why(ARG_WEIGHTS, RULE_VALUE)
    for a, arg in ((query, ARG_QUERY), (key_cache, ARG_KEY), (value_cache, ARG_VALUE), (block_tables, ARG_TABLES),
                   (seq_lens, ARG_SEQ_LENS)):
        if not cnp.PyArray_CheckExact(a):
            return _why(arg, RULE_TYPE)
    q, kc, vc, bt, sl = <cnp.ndarray>query, <cnp.ndarray>key_cache, <cnp.ndarray>value_cache, \
        <cnp.ndarray>block_tables, <cnp.ndarray>seq_lens
    dt = _dtype_of(q)
    if dt < 0:
        return _why(ARG_QUERY, RULE_DTYPE)
    if q.ndim != (3 if packed else 4):
        return _why(ARG_QUERY, RULE_SHAPE)
    if kc.ndim != 4:
        return _why(ARG_KEY, RULE_SHAPE)
    if vc.ndim != 4:
        return _why(ARG_VALUE, RULE_SHAPE)
    if bt.ndim != 2:
        return _why(ARG_TABLES, RULE_SHAPE)
    if cnp.PyArray_TYPE(bt) != cnp.NPY_INT32:
        return _why(ARG_TABLES, RULE_DTYPE)
    if not (cnp.PyArray_IS_C_CONTIGUOUS(bt) and cnp.PyArray_ISNOTSWAPPED(bt) and cnp.PyArray_ISALIGNED(bt)):
        return _why(ARG_TABLES, RULE_LAYOUT)
    cdt = _compute_dtype(dt)
    B = bt.shape[0]
    if packed:
        T, Hq, E = q.shape[0], q.shape[1], q.shape[2]
        L = T
    else:
        Hq, L, E = q.shape[1], q.shape[2], q.shape[3]
        if q.shape[0] != B:
            return _why(ARG_QUERY, RULE_SHAPE)
    Hkv, bs, Ev = kc.shape[1], kc.shape[2], vc.shape[3] * cw
    if Hkv < 1 or Hq % Hkv or bs < 1 or kc.shape[3] * cw != E:
        return _why(ARG_KEY, RULE_SHAPE)
    if vc.shape[0] != kc.shape[0] or vc.shape[1] != Hkv or vc.shape[2] != bs:
        return _why(ARG_VALUE, RULE_SHAPE)
    sdpa_problem_init(&p)
    p.dtype = <sdpa_dtype>dt
    why = _storage(c.kvdt, dt, kc, vc, key_scale, value_scale, &kvdt)
    if why:
        return why
    p.kv_dtype = <sdpa_dtype>kvdt
    if key_scale is not None:  # checked by _storage: both scales, float32 arrays
        ks, vs = <cnp.ndarray>key_scale, <cnp.ndarray>value_scale
    p.num_batch_dims = 1
    p.batch_shape[0] = B
    p.num_heads = Hq
    p.gqa_group = Hq // Hkv
    p.len_q = L
    p.len_kv = bt.shape[1] * bs
    p.head_dim = E
    p.head_dim_v = Ev
    c._fill_constants(&p, E)
    p.block_table = <const int32_t *>cnp.PyArray_DATA(bt)
    p.block_table_stride = bt.shape[1]
    p.block_size = bs
    p.num_blocks = kc.shape[0]
    if packed:
        if not cnp.PyArray_CheckExact(query_start_loc) or _fill_prefix_sums(&p.cu_seqlens_q, query_start_loc, B):
            return _why(ARG_QUERY_START, RULE_SHAPE)
        if _fill_packed(&p.query, q, Hq, T, E, False):
            return _why(ARG_QUERY, RULE_SHAPE)
    else:
        _expected(ex, p.batch_shape, 1, Hq, L, E)
        if _fill_view(&p.query, q, 1, 3, ex, False):
            return _why(ARG_QUERY, RULE_SHAPE)
    why = _fill_cache(&p, kc, vc, ks, vs, c.group, 1, &p.num_blocks, Hkv, bs, ex)
    if why:
        return why
    ex[0], ex[1] = B, Hq
    why = _fill_heads(&p, alibi_slopes, sinks, cdt, 1, ex)
    if why:
        return why
    if tree_mask is not None:
        if not cnp.PyArray_CheckExact(tree_mask):
            return _why(ARG_TREE, RULE_TYPE)
        tm = <cnp.ndarray>tree_mask
        if cnp.PyArray_TYPE(tm) != cnp.NPY_BOOL:
            return _why(ARG_TREE, RULE_DTYPE)
        if packed or p.causal:  # a tree decides the last L positions itself
            return _why(ARG_TREE, RULE_VALUE)
        _expected(ex, p.batch_shape, 1, 1, L, L)
        ex[1] = Hq
        if tm.ndim != 3 or _fill_view(&p.mask, tm[:, None], 1, 3, ex, False):
            return _why(ARG_TREE, RULE_SHAPE)
        p.mask_kind = SDPA_MASK_BOOL
    if cnp.PyArray_TYPE(sl) != cnp.NPY_INT64:
        return _why(ARG_SEQ_LENS, RULE_DTYPE)
    if not (cnp.PyArray_IS_C_CONTIGUOUS(sl) and cnp.PyArray_ISNOTSWAPPED(sl) and cnp.PyArray_ISALIGNED(sl)):
        return _why(ARG_SEQ_LENS, RULE_LAYOUT)
    if sl.ndim != 1 or sl.shape[0] != B:
        return _why(ARG_SEQ_LENS, RULE_SHAPE)
    p.key_lengths = <const int64_t *>cnp.PyArray_DATA(sl)
    p.key_lengths_strides[0] = 1
    if packed:
        dims[0], dims[1], dims[2] = T, Hq, Ev
    else:
        dims[0], dims[1], dims[2], dims[3] = B, Hq, L, Ev
    if out is None:
        o = cnp.PyArray_EMPTY(3 if packed else 4, dims, cnp.PyArray_TYPE(q), 0)
    else:
        why = _out_checked(out, dt)
        if why:
            return why
        o = <cnp.ndarray>out
    _expected(ex, p.batch_shape, 1, Hq, L, Ev)
    if (_fill_packed(&p.out, o, Hq, T, Ev, True) if packed else _fill_view(&p.out, o, 1, 3, ex, True)):
        return _why(ARG_OUT, RULE_SHAPE)
    if c.lse:
        lse = cnp.PyArray_EMPTY(2 if packed else 3, dims, _typenum_of(cdt), 0)
        if packed:
            _fill_packed(&p.lse, lse, Hq, T, -1, True)
        else:
            _fill_view(&p.lse, lse, 1, 2, ex, True)
    if key_scores is not None:  # (B, Hkv, len_kv) by position
        if packed or tm is not None:
            return _why(ARG_QUERY_START if packed else ARG_TREE, RULE_VALUE)
        dims[0], dims[1], dims[2] = B, Hkv, p.len_kv
        ksc = cnp.PyArray_EMPTY(3, dims, cnp.NPY_FLOAT32, 0)  # every element written
        p.key_scores.data = cnp.PyArray_DATA(ksc)
        p.key_scores.batch_strides[0] = Hkv * p.len_kv
        p.key_scores.head_stride = p.len_kv
        p.key_scores.col_stride = 1
        p.key_scores_rows = key_scores
    return _finish_call(&p, plan_threads, q, kc, vc, tm, o, lse, c.lse, ksc)


def backward(q, k, v, out, lse, grad_out, grad_query, grad_key, grad_value, attn_mask, key_lengths, alibi_slopes,
             sinks, grad_sinks, *, int64_t gqa_group, double scale, bint causal, int64_t causal_offset,
             int64_t align_offset, int64_t window_left, int64_t window_right, double softcap, int num_threads,
             double dropout_p=0.0, uint64_t seed=0):
    """The gradients of one attention call into grad_query, grad_key, grad_value
    (and grad_sinks): arrays as :func:`sdpa.attention_backward` prepares them.
    All have nb + 3 dims (nb + 2 for lse, nb + 1 for slopes and sinks, nb for
    key_lengths): q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev),
    out and grad_out (..., Hq, L, Ev) of one dtype (inputs may broadcast by
    dims of 1); lse (..., Hq, L), an additive mask, slopes and sinks of the
    compute type; the gradients exactly their full shapes, not overlapping
    anything.  Raises ValueError naming the field the core refuses."""
    cdef cnp.ndarray a
    cdef sdpa_problem p
    cdef sdpa_grads g
    cdef int64_t ex[MAX_DIMS]
    cdef int nb = cnp.PyArray_NDIM(<cnp.ndarray>q) - 3, i, dt
    # the sizes, from the gradients' full (unbroadcast) shapes
    cdef cnp.npy_intp *qs = cnp.PyArray_DIMS(<cnp.ndarray>grad_query)
    cdef cnp.npy_intp *ks = cnp.PyArray_DIMS(<cnp.ndarray>grad_key)
    cdef cnp.npy_intp *vs = cnp.PyArray_DIMS(<cnp.ndarray>grad_value)
    cdef sdpa_status status
    cdef const char *field = NULL
    dt = _dtype_of(<cnp.ndarray>q)
    if dt < 0:
        raise TypeError(f"query: dtype {q.dtype} not supported")
    sdpa_problem_init(&p)
    sdpa_grads_init(&g)
    p.dtype = <sdpa_dtype>dt
    p.num_batch_dims = nb
    for i in range(nb):
        p.batch_shape[i] = cnp.PyArray_DIM(<cnp.ndarray>grad_query, i)
    p.num_heads = qs[nb]
    p.gqa_group = gqa_group
    p.len_q = qs[nb + 1]
    p.head_dim = qs[nb + 2]
    p.len_kv = ks[nb + 1]
    p.head_dim_v = vs[nb + 2]
    p.scale = scale
    p.causal = causal
    p.causal_offset = causal_offset
    p.align_offset = align_offset
    p.window_left = window_left
    p.window_right = window_right
    p.softcap = softcap
    p.num_threads = num_threads
    p.dropout_p = dropout_p
    p.dropout_seed = seed
    cdef int64_t H = p.num_heads, Hkv = p.num_heads // max(gqa_group, 1), L = p.len_q, S = p.len_kv
    cdef int64_t E = p.head_dim, Ev = p.head_dim_v
    views = ((q, <uintptr_t>&p.query, H, L, E, 3, False, "query"), (k, <uintptr_t>&p.key, Hkv, S, E, 3, False, "key"),
             (v, <uintptr_t>&p.value, Hkv, S, Ev, 3, False, "value"), (out, <uintptr_t>&p.out, H, L, Ev, 3, False, "out"),
             (grad_out, <uintptr_t>&g.grad_out, H, L, Ev, 3, False, "grad_out"),
             (grad_query, <uintptr_t>&g.grad_query, H, L, E, 3, True, "grad_query"),
             (grad_key, <uintptr_t>&g.grad_key, Hkv, S, E, 3, True, "grad_key"),
             (grad_value, <uintptr_t>&g.grad_value, Hkv, S, Ev, 3, True, "grad_value"))
    for arr, view_addr, h, r, c, ncore, output, name in views:
        a = <cnp.ndarray>arr
        if cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(<cnp.ndarray>q):
            raise TypeError(f"{name}: expected the query's dtype {q.dtype}, got {arr.dtype}")
        _expected(ex, p.batch_shape, nb, h, r, c)
        if _fill_view(<sdpa_view *><uintptr_t>view_addr, a, nb, ncore, ex, output):
            raise ValueError(f"{name}: shape {arr.shape} does not fit")
    _expected(ex, p.batch_shape, nb, H, L, S)
    if _fill_view(&p.lse, <cnp.ndarray>lse, nb, 2, ex, False):
        raise ValueError(f"lse: shape {lse.shape} does not fit")
    if attn_mask is not None:
        a = <cnp.ndarray>attn_mask
        p.mask_kind = SDPA_MASK_BOOL if cnp.PyArray_TYPE(a) == cnp.NPY_BOOL else SDPA_MASK_ADDITIVE
        if _fill_view(&p.mask, a, nb, 3, ex, False):
            raise ValueError(f"attn_mask: shape {attn_mask.shape} does not fit")
    if key_lengths is not None and _fill_lengths(&p, <cnp.ndarray>key_lengths):
        raise ValueError("key_lengths: does not fit the batch dims")
    for arr, view_addr, output, name in ((alibi_slopes, <uintptr_t>&p.alibi, False, "alibi_slopes"),
                                         (sinks, <uintptr_t>&p.sinks, False, "sinks"),
                                         (grad_sinks, <uintptr_t>&g.grad_sinks, True, "grad_sinks")):
        if arr is not None and _fill_view(<sdpa_view *><uintptr_t>view_addr, <cnp.ndarray>arr, nb, 1, ex, output):
            raise ValueError(f"{name}: shape {arr.shape} does not fit")
    with nogil:
        status = sdpa_attention_backward(&p, &g)
    if status == SDPA_OK:
        return
    if status == SDPA_ERR_NO_MEMORY:
        raise MemoryError("sdpa: " + sdpa_status_message(status).decode())
    text = "sdpa: " + sdpa_status_message(status).decode()
    if sdpa_check_backward(&p, &g, &field) == status and field != NULL:
        text += f" ({field.decode()})"
    raise ValueError(text)
