/* int8 quantization of key and value rows (sdpa_quantize_int8): symmetric,
 * one float32 scale per group of columns.  The loops are written for the
 * compiler's vectorizer (no calls, no branches in the inner loops). */
#include <float.h>
#include <math.h>
#include <string.h>

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

/* dst[i] = round(x[i] * inv), ties to even, for |x[i] * inv| <= 127: adding
 * and subtracting 1.5 * 2^23 rounds in the current (nearest) rounding mode. */
static void round_to_int8(const float *x, int64_t n, float inv, int8_t *dst) {
    const float magic = 12582912.0f;
    for (int64_t i = 0; i < n; i++) {
        float r = (x[i] * inv + magic) - magic;
        r = r > 127.0f ? 127.0f : r;
        r = r < -127.0f ? -127.0f : r;
        dst[i] = (int8_t)(int)r;
    }
}

sdpa_status sdpa_quantize_int8(const float *src, int64_t src_row_stride, int64_t rows, int64_t cols,
                               int64_t group_size, int8_t *dst, int64_t dst_row_stride, float *scales,
                               int64_t scale_row_stride) {
    const int64_t groups = sdpa_int8_scales_per_row(cols, group_size);
    if (rows < 0 || groups < 0) return SDPA_ERR_BAD_SHAPE;
    if (rows == 0 || cols == 0) return SDPA_OK;
    if (!src || !dst || !scales) return SDPA_ERR_NULL_POINTER;
    const int64_t g = group_size == 0 ? cols : group_size;
    for (int64_t r = 0; r < rows; r++)  /* nothing is written unless every value is finite */
        if (non_finite(src + r * src_row_stride, cols) != 0) return SDPA_ERR_NOT_FINITE;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = src + r * src_row_stride;
        int8_t *q = dst + r * dst_row_stride;
        float *sc = scales + r * scale_row_stride;
        for (int64_t k = 0; k < groups; k++) {
            const float m = abs_max(x + k * g, g);
            /* a group of zeros, or of values so small that their scale would be
             * subnormal, is stored as zeros with a scale of 0 */
            float scale = m / 127.0f >= FLT_MIN ? m / 127.0f : 0.0f;
            /* m / 127 may round up so far that 127 * scale overflows (m near
             * FLT_MAX): take the float below, so every stored value is finite */
            if (scale * 127.0f > FLT_MAX) scale = nextafterf(scale, 0.0f);
            const float inv = scale > 0 ? 1.0f / scale : 0.0f;
            sc[k] = scale;
            round_to_int8(x + k * g, g, inv, q + k * g);
        }
    }
    return SDPA_OK;
}
