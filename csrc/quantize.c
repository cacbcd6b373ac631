/* Quantization of key and value rows (sdpa_quantize, sdpa_quantize_int8):
 * int8, int4 and float8, symmetric, one float32 scale per group of columns.
 * The int8 loops are written for the compiler's vectorizer (no calls, no
 * branches in the inner loops). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "convert.h"
#include "internal.h"

int64_t sdpa_int8_scales_per_row(int64_t cols, int64_t group_size) {
    if (cols < 0 || group_size < 0) return -1;
    if (group_size == 0) return 1;
    if (cols % group_size != 0) return -1;
    return cols / group_size;
}

/* Zero for finite x[0..n), NaN otherwise (x * 0 is NaN for inf and NaN). */
static float non_finite(const float *x, int64_t n) {
    float acc = 0;
    for (int64_t i = 0; i < n; i++) acc += x[i] * 0.0f;
    return acc;
}

/* max |x[i]| for finite x: the bits of |x| order as integers do, and an
 * integer max reduction vectorizes where a float one may not. */
static float abs_max(const float *x, int64_t n) {
    int32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t b;
        memcpy(&b, x + i, sizeof b);
        b &= 0x7fffffff;
        m = b > m ? b : m;
    }
    float r;
    memcpy(&r, &m, sizeof r);
    return r;
}

/* dst[i] = round(x[i] / scale) in [-127, 127] (convert.h) */
static void round_to_int8(const float *x, int64_t n, float scale, int8_t *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = (int8_t)(int)sdpa_round_quotient(x[i], scale, SDPA_INT8_MAX);
}

/* dst[i] = the nibble of round(x[i] / scale) + 8, in [-7, 7]: value c in
 * byte c / 2, low nibble first (n even, dst written whole) */
static void round_to_int4(const float *x, int64_t n, float scale, uint8_t *dst) {
    for (int64_t i = 0; i < n; i += 2) {
        const int a = (int)sdpa_round_quotient(x[i], scale, SDPA_INT4_MAX);
        const int b = (int)sdpa_round_quotient(x[i + 1], scale, SDPA_INT4_MAX);
        dst[i / 2] = (uint8_t)((unsigned)(a + 8) | ((unsigned)(b + 8) << 4));
    }
}

/* dst[i] = x[i] / scale in the format (a scale of 0: zeros of x's sign) */
static void round_to_fp8(sdpa_dtype dt, const float *x, int64_t n, float scale, uint8_t *dst) {
    if (dt == SDPA_FP8_E4M3)
        for (int64_t i = 0; i < n; i++) dst[i] = sdpa_f32_to_e4m3(scale > 0 ? x[i] / scale : x[i] * 0.0f);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = sdpa_f32_to_e5m2(scale > 0 ? x[i] / scale : x[i] * 0.0f);
}

/* the largest stored magnitude of each dtype */
static float quantized_max(sdpa_dtype dt) {
    switch (dt) {
        case SDPA_INT8: return SDPA_INT8_MAX;
        case SDPA_INT4: return SDPA_INT4_MAX;
        case SDPA_FP8_E4M3: return SDPA_FP8_E4M3_MAX;
        default: return SDPA_FP8_E5M2_MAX;
    }
}

sdpa_status sdpa_quantize(sdpa_dtype dt, const float *src, int64_t src_row_stride, int64_t rows, int64_t cols,
                          int64_t group_size, void *dst, int64_t dst_row_stride, float *scales,
                          int64_t scale_row_stride) {
    if (dt != SDPA_INT8 && dt != SDPA_INT4 && dt != SDPA_FP8_E4M3 && dt != SDPA_FP8_E5M2) return SDPA_ERR_BAD_DTYPE;
    const int64_t groups = sdpa_int8_scales_per_row(cols, group_size);
    if (rows < 0 || groups < 0) return SDPA_ERR_BAD_SHAPE;
    if (dt == SDPA_INT4 && (cols % 2 || group_size % 2)) return SDPA_ERR_BAD_SHAPE;
    if (rows == 0 || cols == 0) return SDPA_OK;
    const int fp8 = dt == SDPA_FP8_E4M3 || dt == SDPA_FP8_E5M2;
    if (!src || !dst || (!scales && !fp8)) return SDPA_ERR_NULL_POINTER;
    const int64_t g = group_size == 0 ? cols : group_size;
    const float top = quantized_max(dt);
    for (int64_t r = 0; r < rows; r++) {  /* nothing is written unless every value can be */
        const float *x = src + r * src_row_stride;
        if (non_finite(x, cols) != 0 || (!scales && abs_max(x, cols) > top)) return SDPA_ERR_NOT_FINITE;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *x = src + r * src_row_stride;
        uint8_t *q = (uint8_t *)dst + r * dst_row_stride;
        if (!scales) {  /* float8, the values as they are */
            round_to_fp8(dt, x, cols, 1.0f, q);
            continue;
        }
        float *sc = scales + r * scale_row_stride;
        for (int64_t k = 0; k < groups; k++) {
            const float m = abs_max(x + k * g, g);
            /* a group of zeros, or of values so small that their scale would be
             * subnormal, is stored as zeros with a scale of 0 */
            float scale = m / top >= FLT_MIN ? m / top : 0.0f;
            /* m / top may round up so far that top * scale overflows (m near
             * FLT_MAX): take the float below, so every stored value is finite */
            if (scale * top > FLT_MAX) scale = nextafterf(scale, 0.0f);
            sc[k] = scale;
            if (dt == SDPA_INT8)
                round_to_int8(x + k * g, g, scale, (int8_t *)q + k * g);
            else if (dt == SDPA_INT4)
                round_to_int4(x + k * g, g, scale, q + k * g / 2);
            else
                round_to_fp8(dt, x + k * g, g, scale, q + k * g);
        }
    }
    return SDPA_OK;
}

sdpa_status sdpa_quantize_int8(const float *src, int64_t src_row_stride, int64_t rows, int64_t cols,
                               int64_t group_size, int8_t *dst, int64_t dst_row_stride, float *scales,
                               int64_t scale_row_stride) {
    return sdpa_quantize(SDPA_INT8, src, src_row_stride, rows, cols, group_size, dst, dst_row_stride, scales,
                         scale_row_stride);
}
