# cython: language_level=3, boundscheck=False, wraparound=False
"""The thin layer between Python and the C core: buffers in, the GIL released
around the computation, status codes out as exceptions.  All checking of shapes
and dtypes happens in sdpa._api before this is called."""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_RECORDS_RO, PyBUF_RECORDS
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, int64_t

cdef extern from "sdpa.h" nogil:
    ctypedef enum sdpa_status:
        SDPA_OK
        SDPA_ERR_NO_MEMORY
        SDPA_ERR_INTERRUPTED
    ctypedef enum sdpa_dtype:
        SDPA_FLOAT32
        SDPA_FLOAT64
    ctypedef enum sdpa_mask_kind:
        SDPA_MASK_NONE
        SDPA_MASK_BOOL
        SDPA_MASK_ADDITIVE
    int SDPA_MAX_BATCH_DIMS
    ctypedef int (*sdpa_interrupt_fn)(void *user_data) noexcept
    ctypedef struct sdpa_view:
        void *data
        int64_t batch_strides[8]
        int64_t head_stride
        int64_t row_stride
        int64_t col_stride
    ctypedef struct sdpa_problem:
        sdpa_dtype dtype
        int32_t num_batch_dims
        int64_t batch_shape[8]
        int64_t num_heads
        int64_t gqa_group
        int64_t len_q
        int64_t len_kv
        int64_t head_dim
        int64_t head_dim_v
        sdpa_view query
        sdpa_view key
        sdpa_view value
        sdpa_view out
        sdpa_mask_kind mask_kind
        sdpa_view mask
        double scale
        int32_t causal
        int64_t causal_offset
        sdpa_view weights
        sdpa_view lse
        const int64_t *key_lengths
        int64_t key_lengths_strides[8]
        int32_t num_threads
        sdpa_interrupt_fn interrupt
        void *interrupt_data
    void sdpa_problem_init(sdpa_problem *p)
    sdpa_status sdpa_attention(const sdpa_problem *p)
    const char *sdpa_status_message(sdpa_status status)
    int sdpa_has_openmp()
    int sdpa_default_num_threads()
    const char *sdpa_version()
    int sdpa_isa_supported(const char *name)
    sdpa_status sdpa_set_isa(const char *name)
    const char *sdpa_isa()

cdef extern from "internal.h" nogil:
    sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n)
    void sdpa_fp_flags_in_threads(int num_threads, int *flags)

MAX_BATCH_DIMS = SDPA_MAX_BATCH_DIMS
MASK_NONE = SDPA_MASK_NONE
MASK_BOOL = SDPA_MASK_BOOL
MASK_ADDITIVE = SDPA_MASK_ADDITIVE


def version():
    return sdpa_version().decode()


ISAS = ("scalar", "avx2", "avx512")


def isa():
    """The kernel set in use."""
    return sdpa_isa().decode()


def isa_supported(name):
    return bool(sdpa_isa_supported(name.encode()))


def set_isa(name):
    """Switches the kernel set for later calls; ValueError if this CPU lacks it."""
    if sdpa_set_isa(name.encode()) != SDPA_OK:
        raise ValueError(f"kernel set {name!r} is unknown or not supported by this CPU; "
                         f"supported: {[n for n in ISAS if isa_supported(n)]}")


def kernel_exp(name, x):
    """e**x by the exp kernel of kernel set `name`, in place on a contiguous
    float32/float64 array (for testing the kernels)."""
    cdef Py_buffer view
    cdef sdpa_status st
    PyObject_GetBuffer(x, &view, PyBUF_RECORDS)
    try:
        if view.itemsize not in (4, 8) or view.len != view.itemsize * x.size or not x.flags.c_contiguous:
            raise TypeError("kernel_exp: a contiguous float32/float64 array")
        st = sdpa_kernel_exp(name.encode(), SDPA_FLOAT32 if view.itemsize == 4 else SDPA_FLOAT64,
                             view.buf, view.len // view.itemsize)
    finally:
        PyBuffer_Release(&view)
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


def has_openmp():
    return bool(sdpa_has_openmp())


def default_num_threads():
    return sdpa_default_num_threads()


cdef int _poll_signals(void *user_data) noexcept nogil:
    # runs Python's signal handlers; what they raise (KeyboardInterrupt) is kept
    # and raised once the C call has returned
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as exc:
            (<_Buffers>user_data).pending = exc
            return 1
        return 0


cdef class _Buffers:
    """Holds the buffers of one call; released when the call ends."""
    cdef Py_buffer views[8]
    cdef int count
    cdef object pending

    def __cinit__(self):
        self.count = 0

    cdef void *get(self, object arr, bint writable) except NULL:
        cdef int flags = PyBUF_RECORDS if writable else PyBUF_RECORDS_RO
        PyObject_GetBuffer(arr, &self.views[self.count], flags)
        self.count += 1
        cdef void *ptr = self.views[self.count - 1].buf
        # an empty array may have no storage: any non-NULL pointer will do, it is never read
        return ptr if ptr != NULL else <void *>&self.count

    def __dealloc__(self):
        cdef int i
        for i in range(self.count):
            PyBuffer_Release(&self.views[i])


cdef void _fill_view(sdpa_view *view, void *data, strides, int nb) except *:
    cdef int i
    view.data = data
    for i in range(nb):
        view.batch_strides[i] = strides[i]
    view.head_stride = strides[nb]
    view.row_stride = strides[nb + 1]
    view.col_stride = strides[nb + 2]


def attention(bint is_float64, tuple batch_shape, int64_t heads, int64_t group,
              int64_t L, int64_t S, int64_t E, int64_t Ev,
              q, q_strides, k, k_strides, v, v_strides, out, out_strides,
              int mask_kind, mask, mask_strides,
              double scale, bint causal, int64_t causal_offset,
              weights, weights_strides, int num_threads, bint interruptible=False,
              lse=None, lse_strides=None, key_lengths=None, key_lengths_strides=None):
    """Runs the C core on prepared arrays; strides are in elements, right-aligned
    to batch_shape + (head, row, col)."""
    cdef sdpa_problem p
    cdef sdpa_status status
    cdef int nb = len(batch_shape)
    cdef int i
    cdef _Buffers bufs = _Buffers()
    sdpa_problem_init(&p)
    p.dtype = SDPA_FLOAT64 if is_float64 else SDPA_FLOAT32
    p.num_batch_dims = nb
    for i in range(nb):
        p.batch_shape[i] = batch_shape[i]
    p.num_heads = heads
    p.gqa_group = group
    p.len_q = L
    p.len_kv = S
    p.head_dim = E
    p.head_dim_v = Ev
    _fill_view(&p.query, bufs.get(q, False), q_strides, nb)
    _fill_view(&p.key, bufs.get(k, False), k_strides, nb)
    _fill_view(&p.value, bufs.get(v, False), v_strides, nb)
    _fill_view(&p.out, bufs.get(out, True), out_strides, nb)
    p.mask_kind = <sdpa_mask_kind>mask_kind
    if mask is not None:
        _fill_view(&p.mask, bufs.get(mask, False), mask_strides, nb)
    if weights is not None:
        _fill_view(&p.weights, bufs.get(weights, True), weights_strides, nb)
    if lse is not None:  # (..., heads, L): the column stride is unused
        _fill_view(&p.lse, bufs.get(lse, True), list(lse_strides) + [0], nb)
    if key_lengths is not None:
        p.key_lengths = <const int64_t *>bufs.get(key_lengths, False)
        for i in range(nb):
            p.key_lengths_strides[i] = key_lengths_strides[i]
    p.scale = scale
    p.causal = causal
    p.causal_offset = causal_offset
    p.num_threads = num_threads
    if interruptible:
        p.interrupt = _poll_signals
        p.interrupt_data = <void *>bufs
    with nogil:
        status = sdpa_attention(&p)
    if status == SDPA_OK:
        return
    if status == SDPA_ERR_INTERRUPTED:
        raise bufs.pending if bufs.pending is not None else KeyboardInterrupt()
    if status == SDPA_ERR_NO_MEMORY:
        raise MemoryError("sdpa: " + sdpa_status_message(status).decode())
    raise ValueError("sdpa: " + sdpa_status_message(status).decode())
