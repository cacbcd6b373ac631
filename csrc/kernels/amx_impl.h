/*
 * bfloat16 products on AMX tiles (TDPBF16PS).  Included twice by avx512.c:
 *   AMX_EMULATE 0: the "amx" set's kernel, with the tile instructions;
 *   AMX_EMULATE 1: the same code over a software model of the tiles, for the
 *                  test suite on CPUs without AMX ("amx_emulated", testing.h).
 * The two differ only in what the T_* macros below expand to, so the tile
 * configuration, the blocking, the padding and the strides are tested on every
 * CPU with AVX512-BF16; the instructions themselves run only on AMX CPUs.
 *
 * gemm_bf16's contract (internal.h), for a panel of nr = 32 query rows: c is
 * m x 32 floats, b is kpairs x 32 pairs, a is m x kpairs pairs at any strides.
 * Every tile is 16 rows x 64 bytes (palette 1):
 *   tmm0-3  C: rows [r0 + 16i, +16) x columns [16j, +16), tile 2i + j
 *   tmm4-5  A: 16 rows x 16 pairs of a, row block i
 *   tmm6-7  B: 16 pairs x 16 columns of b, column half j
 * A step of 16 pairs loads two B and (up to) two A tiles for four products.  A
 * block with fewer than 16 rows or pairs, or an a whose pairs are not
 * contiguous (a_ks != 1), is copied into a zero-padded buffer first, so that a
 * tile never reads past the caller's rows and padding multiplies zero by zero.
 *
 * The instruction, as the SDM describes it: for each C[m][n], two float sums
 * from zero, of A[m][2k] B[k][2n] and of A[m][2k+1] B[k][2n+1] over k < 16 in
 * order (each bfloat16 product is exact in float), then C[m][n] += their sum;
 * every addition rounds to nearest even, subnormal inputs and results are
 * flushed to zero, and MXCSR is not consulted.  The emulator does the same in
 * C with fused multiply-adds (under the caller's rounding mode, which sdpa
 * leaves at nearest; its flush modes change nothing here, every input and
 * result being flushed explicitly).
 */

#if AMX_EMULATE
#define AMX_FN(name) name##_amx_emulated
#else
#define AMX_FN(name) name##_amx
#endif

#ifndef SDPA_AMX_COMMON
#define SDPA_AMX_COMMON

/* LDTILECFG's 64-byte operand */
typedef struct amx_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
_Static_assert(sizeof(amx_config) == 64, "the tile configuration is 64 bytes");

/* palette 1, tiles 0-7 of 16 rows x 64 bytes */
static _Alignas(64) const amx_config amx_tile_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* The block at src (rows x 16 elements of 32 bits, row stride ld elements)
 * where a tile can load it in place; else copied into buf (16 x 16, zero
 * padded).  *stride is set in bytes. */
static inline const void *amx_rows_src(const void *src, int64_t ld, int rows, int cols, uint32_t *buf,
                                       int64_t *stride) {
    if (rows == 16 && cols == 16) {
        *stride = ld * 4;
        return src;
    }
    memset(buf, 0, 16 * 16 * 4);
    for (int r = 0; r < rows; r++) memcpy(buf + r * 16, (const uint32_t *)src + r * ld, (size_t)cols * 4);
    *stride = 64;
    return buf;
}

/* rows x kp pairs of a at (a_rs, a_ks), in place when whole and contiguous */
static inline const void *amx_a_src(const uint32_t *a, int64_t a_rs, int64_t a_ks, int rows, int kp,
                                    uint32_t *buf, int64_t *stride) {
    if (a_ks == 1) return amx_rows_src(a, a_rs, rows, kp, buf, stride);
    memset(buf, 0, 16 * 16 * 4);
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < kp; k++) buf[r * 16 + k] = a[r * a_rs + k * a_ks];
    *stride = 64;
    return buf;
}

/* The emulator: eight tiles of 16 x 16 32-bit elements and their shapes. */
typedef struct amx_tiles {
    uint32_t t[8][16][16];
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t palette;
} amx_tiles;

/* A tile used with a shape the kernel does not configure is a bug in the
 * kernel, which real tiles would turn into wrong results or a fault. */
static void amx_emu_check(const amx_tiles *st, int t) {
    if (st->palette != 1 || st->rows[t] != 16 || st->colsb[t] != 64) abort();
}

static void amx_emu_config(amx_tiles *st, const amx_config *cfg) {
    st->palette = cfg->palette;
    for (int t = 0; t < 8; t++) {
        st->rows[t] = cfg->rows[t];
        st->colsb[t] = cfg->colsb[t];
    }
}

static void amx_emu_load(amx_tiles *st, int t, const void *src, int64_t stride) {
    amx_emu_check(st, t);
    for (int r = 0; r < 16; r++) memcpy(st->t[t][r], (const char *)src + r * stride, 64);
}

static void amx_emu_store(amx_tiles *st, int t, void *dst, int64_t stride) {
    amx_emu_check(st, t);
    for (int r = 0; r < 16; r++) memcpy((char *)dst + r * stride, st->t[t][r], 64);
}

static void amx_emu_zero(amx_tiles *st, int t) {
    amx_emu_check(st, t);
    memset(st->t[t], 0, sizeof(st->t[t]));
}

/* half 0 (low) or 1 (high) of a pair as float, a subnormal flushed to zero */
static inline float amx_emu_bf16(uint32_t pair, int half) {
    uint32_t bits = (half ? pair >> 16 : pair & 0xFFFFu) << 16;
    if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float amx_emu_ftz(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

static void amx_emu_dpbf16ps(amx_tiles *st, int c, int a, int b) {
    amx_emu_check(st, c);
    amx_emu_check(st, a);
    amx_emu_check(st, b);
    for (int m = 0; m < 16; m++) {
        float even[16] = {0}, odd[16] = {0};
        for (int k = 0; k < 16; k++) {
            const uint32_t ak = st->t[a][m][k];
            for (int n = 0; n < 16; n++) {
                const uint32_t bk = st->t[b][k][n];
                even[n] = amx_emu_ftz(fmaf(amx_emu_bf16(ak, 0), amx_emu_bf16(bk, 0), even[n]));
                odd[n] = amx_emu_ftz(fmaf(amx_emu_bf16(ak, 1), amx_emu_bf16(bk, 1), odd[n]));
            }
        }
        float row[16];
        memcpy(row, st->t[c][m], sizeof(row));
        for (int n = 0; n < 16; n++) row[n] = amx_emu_ftz(amx_emu_ftz(row[n]) + amx_emu_ftz(even[n] + odd[n]));
        memcpy(st->t[c][m], row, sizeof(row));
    }
}

#endif /* SDPA_AMX_COMMON */

#if AMX_EMULATE
/* the emulated tiles of this thread: configured (palette 1) between
 * tiles_begin and tiles_end, as a thread's real tiles are */
static _Thread_local amx_tiles amx_emu_state = {.palette = 0};
#define tiles_ amx_emu_state
#define T_STATE (void)0
#define T_CONFIGURED() (amx_emu_state.palette != 0)
#define T_SET_CONFIGURED(on) (void)0
#define T_CONFIG(cfg) amx_emu_config(&tiles_, (cfg))
#define T_LOAD(t, src, stride) amx_emu_load(&tiles_, t, (src), (stride))
#define T_STORE(t, dst, stride) amx_emu_store(&tiles_, t, (dst), (stride))
#define T_ZERO(t) amx_emu_zero(&tiles_, t)
#define T_DP(c, a, b) amx_emu_dpbf16ps(&tiles_, c, a, b)
#define T_RELEASE() (tiles_.palette = 0)
#else
/* GCC's tile load and configuration intrinsics are asm statements that do not
 * tell the compiler they read memory (12.2's ldtilecfg names 8 of the 64
 * bytes), so stores to a buffer they read could be dropped or moved after
 * them, and later stores to it moved before them: a compiler barrier on each
 * side, with the buffer's address escaping. */
#define AMX_BARRIER(ptr) __asm__ volatile("" : : "r"(ptr) : "memory")
/* whether this thread's tiles are configured by tiles_begin */
static _Thread_local int amx_configured = 0;
#define T_STATE (void)0
#define T_CONFIGURED() amx_configured
#define T_SET_CONFIGURED(on) (amx_configured = (on))
#define T_CONFIG(cfg)               \
    do {                            \
        AMX_BARRIER(cfg);           \
        _tile_loadconfig(cfg);      \
        AMX_BARRIER(cfg);           \
    } while (0)
#define T_LOAD(t, src, stride)             \
    do {                                   \
        AMX_BARRIER(src);                  \
        _tile_loadd(t, (src), (stride));   \
        AMX_BARRIER(src);                  \
    } while (0)
#define T_STORE(t, dst, stride) _tile_stored(t, (dst), (stride))
#define T_ZERO(t) _tile_zero(t)
#define T_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define T_RELEASE() _tile_release()
#endif

/* C tile t (row block i, half j): from c in place, or its rows copied in */
#define AMX_LOAD_C(t, i, j, rows)                                                          \
    do {                                                                                   \
        int64_t s_;                                                                        \
        const void *p_ = amx_rows_src(c + (r0 + 16 * (i)) * ldc + 16 * (j), ldc, rows, 16, \
                                      (uint32_t *)cbuf, &s_);                              \
        T_LOAD(t, p_, s_);                                                                 \
    } while (0)

/* C tile t to c, in place when whole, else through cbuf */
#define AMX_STORE_C(t, i, j, rows)                                                      \
    do {                                                                                \
        float *d_ = c + (r0 + 16 * (i)) * ldc + 16 * (j);                               \
        if ((rows) == 16) {                                                             \
            T_STORE(t, d_, ldc * 4);                                                    \
        } else {                                                                        \
            T_STORE(t, cbuf, 64);                                                       \
            for (int r_ = 0; r_ < (rows); r_++) memcpy(d_ + r_ * ldc, cbuf + r_ * 16, 64); \
        }                                                                               \
    } while (0)

/* Asks for the a rows of the next k-step of this row block (the 64-byte line
 * after each of its up to 32 rows), or at its end the first lines of the
 * next row block's rows: a tile load from L2 waits, one from L1 does not. */
static inline void AMX_FN(prefetch_next)(const uint32_t *a, int64_t a_rs, int m, int64_t kpairs, int r0, int64_t p0) {
    int64_t col = p0 + 16;
    int first = r0;
    if (col >= kpairs) {
        col = 0;
        first = r0 + 32;
    }
    const int last = first + 32 < m ? first + 32 : m;
    for (int r = first; r < last; r++) __builtin_prefetch(a + r * a_rs + col, 0, 3);
}

#if AMX_EMULATE
static SDPA_ATOMIC(long) amx_emulated_calls = 0;
long sdpa_testing_amx_emulated_calls(void) { return sdpa_atomic_load(&amx_emulated_calls); }
#endif

static void AMX_FN(gemm_bf16)(int m, int64_t kpairs, const uint32_t *a, int64_t a_rs, int64_t a_ks,
                              const uint32_t *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
#if AMX_EMULATE
    atomic_fetch_add(&amx_emulated_calls, 1);
#endif
    if (m <= 0) return;
    T_STATE;
    _Alignas(64) uint32_t abuf[2][16 * 16];
    _Alignas(64) uint32_t bbuf[2][16 * 16];
    _Alignas(64) float cbuf[16 * 16];
    const int own = !T_CONFIGURED();  /* configured here, unless for the whole task */
    if (own) T_CONFIG(&amx_tile_config);
    for (int r0 = 0; r0 < m; r0 += 32) {
        const int rows0 = m - r0 < 16 ? m - r0 : 16;
        const int rows1 = m - r0 - 16 <= 0 ? 0 : (m - r0 - 16 < 16 ? m - r0 - 16 : 16);
        if (accumulate) {
            AMX_LOAD_C(0, 0, 0, rows0);
            AMX_LOAD_C(1, 0, 1, rows0);
            if (rows1) {
                AMX_LOAD_C(2, 1, 0, rows1);
                AMX_LOAD_C(3, 1, 1, rows1);
            }
        } else {
            T_ZERO(0);
            T_ZERO(1);
            if (rows1) {
                T_ZERO(2);
                T_ZERO(3);
            }
        }
        for (int64_t p0 = 0; p0 < kpairs; p0 += 16) {
            const int kp = (int)(kpairs - p0 < 16 ? kpairs - p0 : 16);
            int64_t s;
            if (a_ks == 1) AMX_FN(prefetch_next)(a, a_rs, m, kpairs, r0, p0);
            const void *src = amx_rows_src(b + p0 * ldb, ldb, kp, 16, bbuf[0], &s);
            T_LOAD(6, src, s);
            src = amx_rows_src(b + p0 * ldb + 16, ldb, kp, 16, bbuf[1], &s);
            T_LOAD(7, src, s);
            src = amx_a_src(a + r0 * a_rs + p0 * a_ks, a_rs, a_ks, rows0, kp, abuf[0], &s);
            T_LOAD(4, src, s);
            T_DP(0, 4, 6);
            T_DP(1, 4, 7);
            if (rows1) {
                src = amx_a_src(a + (r0 + 16) * a_rs + p0 * a_ks, a_rs, a_ks, rows1, kp, abuf[1], &s);
                T_LOAD(5, src, s);
                T_DP(2, 5, 6);
                T_DP(3, 5, 7);
            }
        }
        AMX_STORE_C(0, 0, 0, rows0);
        AMX_STORE_C(1, 0, 1, rows0);
        if (rows1) {
            AMX_STORE_C(2, 1, 0, rows1);
            AMX_STORE_C(3, 1, 1, rows1);
        }
    }
    if (own) T_RELEASE();
}

/* The tile configuration loaded once for the products of a task (LDTILECFG
 * and TILERELEASE cost about 80 ns a pair, measured on a Xeon: a tenth of a
 * small product), and released at its end, so that a thread keeps no tile
 * state between calls. */
static void AMX_FN(tiles_begin)(void) {
    T_CONFIG(&amx_tile_config);
    T_SET_CONFIGURED(1);
}

static void AMX_FN(tiles_end)(void) {
    T_RELEASE();
    T_SET_CONFIGURED(0);
}

#undef AMX_LOAD_C
#undef AMX_STORE_C
#undef T_STATE
#undef T_CONFIGURED
#undef T_SET_CONFIGURED
#if AMX_EMULATE
#undef tiles_
#endif
#undef T_CONFIG
#undef T_LOAD
#undef T_STORE
#undef T_ZERO
#undef T_DP
#undef T_RELEASE
#undef AMX_BARRIER
#undef AMX_FN
