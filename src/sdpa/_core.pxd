# The C declarations sdpa._core uses: the public API (sdpa.h), two internal
# functions (internal.h) and the test hooks (testing.h).  Cython reads this file
# with _core.pyx (a module's own .pxd); sdpa.h is the reference for every field.
from libc.stdint cimport uint64_t, int8_t, int32_t, int64_t, uint32_t

cdef extern from "numpy/ndarraytypes.h":
    enum: NPY_USERDEF  # the first type number of dtypes registered by other packages

cdef extern from "sdpa.h" nogil:
    ctypedef enum sdpa_status:
        SDPA_OK
        SDPA_ERR_NO_MEMORY
        SDPA_ERR_INTERRUPTED
        SDPA_ERR_BAD_ISA
        SDPA_ERR_NOT_FINITE
        SDPA_ERR_BAD_PAGES
        SDPA_ERR_BAD_RAGGED
    ctypedef enum sdpa_dtype:
        SDPA_FLOAT32
        SDPA_FLOAT64
        SDPA_BFLOAT16
        SDPA_FLOAT16
        SDPA_INT8
        SDPA_FP8_E4M3
        SDPA_FP8_E5M2
        SDPA_INT4
    ctypedef enum sdpa_mask_kind:
        SDPA_MASK_NONE
        SDPA_MASK_BOOL
        SDPA_MASK_ADDITIVE
    enum: SDPA_MAX_BATCH_DIMS
    int64_t SDPA_MAX_POSITION
    enum: SDPA_MAX_THREADS
    float SDPA_INT8_MAX
    float SDPA_INT4_MAX
    float SDPA_FP8_E4M3_MAX
    float SDPA_FP8_E5M2_MAX
    ctypedef int (*sdpa_interrupt_fn)(void *user_data) noexcept
    ctypedef struct sdpa_view:
        void *data
        int64_t batch_strides[SDPA_MAX_BATCH_DIMS]
        int64_t head_stride
        int64_t row_stride
        int64_t col_stride
    ctypedef struct sdpa_problem:
        sdpa_dtype dtype
        sdpa_dtype kv_dtype
        int32_t num_batch_dims
        int64_t batch_shape[SDPA_MAX_BATCH_DIMS]
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
        int64_t key_lengths_strides[SDPA_MAX_BATCH_DIMS]
        int32_t num_threads
        sdpa_interrupt_fn interrupt
        void *interrupt_data
        int64_t window_left
        int64_t window_right
        int64_t align_offset
        double softcap
        sdpa_view alibi
        sdpa_view sinks
        sdpa_view key_scale
        sdpa_view value_scale
        int64_t kv_group_size
        const int32_t *block_table
        int64_t block_table_stride
        int64_t block_size
        int64_t num_blocks
        int32_t integer_qk
        const int64_t *cu_seqlens_q
        const int64_t *cu_seqlens_k
        int32_t offsets_from_end
        int32_t integer_pv
        sdpa_view topk_indices
        int64_t topk
        sdpa_view block_states
        int64_t block_q, block_k
        sdpa_view key_scores
        int64_t key_scores_rows
        double dropout_p
        uint64_t dropout_seed
    void sdpa_problem_init(sdpa_problem *p)
    ctypedef struct sdpa_grads:
        sdpa_view grad_out
        sdpa_view grad_query
        sdpa_view grad_key
        sdpa_view grad_value
        sdpa_view grad_sinks
    void sdpa_grads_init(sdpa_grads *g)
    sdpa_status sdpa_attention_backward(const sdpa_problem *p, const sdpa_grads *g)
    sdpa_status sdpa_check_backward(const sdpa_problem *p, const sdpa_grads *g, const char **field)
    ctypedef struct sdpa_topk_problem:
        size_t struct_size
        int64_t batch, heads, len_q, len_kv, head_dim, k
        const float *query
        int64_t query_strides[3]
        sdpa_dtype key_dtype
        const void *key
        int64_t key_strides[2]
        const float *key_scale
        int64_t key_scale_strides[2]
        const float *weights
        int64_t weights_strides[2]
        const int64_t *key_lengths
        int causal
        int num_threads
        int32_t *indices
        float *scores
    void sdpa_topk_problem_init(sdpa_topk_problem *p)
    sdpa_status sdpa_index_topk(const sdpa_topk_problem *p)
    sdpa_status sdpa_quantize(sdpa_dtype dt, const float *src, int64_t src_row_stride, int64_t rows,
                              int64_t cols, int64_t group_size, void *dst, int64_t dst_row_stride,
                              float *scales, int64_t scale_row_stride)
    sdpa_status sdpa_quantize_int8(const float *src, int64_t src_row_stride, int64_t rows, int64_t cols,
                                   int64_t group_size, int8_t *dst, int64_t dst_row_stride, float *scales,
                                   int64_t scale_row_stride)
    sdpa_status sdpa_attention(const sdpa_problem *p)
    sdpa_status sdpa_check(const sdpa_problem *p, const char **field)
    const char *sdpa_status_message(sdpa_status status)
    int sdpa_has_openmp()
    int sdpa_default_num_threads()
    int sdpa_max_threads()
    const char *sdpa_version()
    void sdpa_cache_sizes(int64_t *l1d, int64_t *l2)
    int sdpa_isa_supported(const char *name)
    const char *sdpa_isa_name(int i)
    sdpa_status sdpa_set_isa(const char *name)
    const char *sdpa_isa()

cdef extern from "internal.h" nogil:
    void sdpa_set_threads_setting(int n)
    int sdpa_threads_setting()
    const char *sdpa_isa_named()
    void sdpa_reset_isa()


cdef extern from "testing.h" nogil:
    sdpa_status sdpa_kernel_exp(const char *name, sdpa_dtype dtype, void *x, int64_t n)
    void sdpa_fp_flags_in_threads(int num_threads, int *flags)
    int sdpa_set_flush_to_zero(int on)
    const char *sdpa_isa_env_error()
    enum: SDPA_TESTING_MAX_TILE
    enum: SDPA_TESTING_MAX_CHUNK
    void sdpa_testing_set_blocking(int tile_q, int tile_k, int chunk)
    void sdpa_testing_set_packing(int mode)
    void sdpa_testing_set_fold_group(int min_group)
    void sdpa_testing_set_pack_group(int mode)
    void sdpa_testing_portable_dot_qi(int on)
    const char *sdpa_testing_dot_qi_kernel()
    double sdpa_probe_read(const void *buf, size_t nbytes, int threads)
    double sdpa_probe_peak(int kind, int threads, double seconds, const char **name)
    int sdpa_testing_ask_for_tiles()
    sdpa_status sdpa_testing_stand_in(int mode, int as_default)
    int sdpa_testing_tile_requests()
    long sdpa_testing_amx_emulated_calls()
    sdpa_status sdpa_testing_softmax(const char *name, sdpa_dtype dtype, int row, void *s, int n, void *row_max,
                                     void *row_sum, void *acc, int64_t ev)
    int sdpa_testing_panel_rows(const char *name, sdpa_dtype dtype)
    void sdpa_profile_start()
    int sdpa_profile_read(double *ns, int n, double *scores)
    void sdpa_profile_stop()
    int sdpa_testing_have_amx_kernels()
    sdpa_status sdpa_testing_use_kernels(const char *name)
    int sdpa_testing_table_complete(const char *name, int declared)
    ctypedef struct sdpa_part_info:
        int64_t seq
        int64_t members
        int64_t heads
        int64_t rows
        int64_t keys
        int64_t tasks
        int32_t row_mode
        int32_t staged
        int32_t tree
        int32_t packed
        double cost
    sdpa_status sdpa_testing_plan(const sdpa_problem *p, int threads, sdpa_part_info *parts, int64_t max_parts,
                                  int64_t *num_parts, double *costs, int64_t max_items, int64_t *num_items,
                                  int *num_threads, int64_t *num_merges)
    sdpa_status sdpa_testing_gemm_bf16(const char *name, int m, int64_t kpairs, const uint32_t *a, int64_t a_rs,
                                       int64_t a_ks, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                                       int accumulate, long repeat)
