/* Scalar conversions between float and the 16-bit element types, portable C.
 * bfloat16 is the upper half of a float32; float16 is IEEE 754 binary16.  Both
 * narrowings round to nearest, ties to even, and keep NaN a NaN. */
#ifndef SDPA_CONVERT_H
#define SDPA_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline float sdpa_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t sdpa_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float sdpa_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13); /* inf, NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400u)) mant <<= 1, exp--;
        u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t sdpa_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf, or inf */
    if (a < 0x38800000u) { /* below the smallest normal: subnormal or zero */
        if (a < 0x33000000u) return sign; /* below half the smallest subnormal */
        const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14..24: the bits that fall off */
        uint32_t r = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u; /* rebias the exponent: 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* float8 e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits; no
 * infinities, S.1111.111 NaN; largest 448) and e5m2 (the upper byte of a
 * float16: bias 15, 2 mantissa bits, IEEE infinities and NaN; largest finite
 * 57344).  Widening is exact; narrowing rounds to nearest, ties to even,
 * saturates at the largest finite value and keeps NaN a NaN. */
static inline float sdpa_e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, exp = (b >> 3) & 0xfu, mant = b & 7u;
    uint32_t u;
    if ((b & 0x7fu) == 0x7fu) {
        u = sign | 0x7fc00000u;
    } else if (exp == 0) { /* subnormal: mant * 2^-9, exact */
        const float f = (float)mant * (1.0f / 512.0f);
        return sign ? -f : f;
    } else {
        u = sign | ((exp + 120u) << 23) | (mant << 20);
    }
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float sdpa_e5m2_to_f32(uint8_t b) { return sdpa_f16_to_f32((uint16_t)((uint16_t)b << 8)); }

/* round(f) for 0 <= f < 2^22, ties to even, whatever the rounding mode */
static inline uint32_t sdpa_round_small(float f) {
    uint32_t i = (uint32_t)f;
    const float rest = f - (float)i;
    if (rest > 0.5f || (rest == 0.5f && (i & 1u))) i++;
    return i;
}

/* round(x / scale), ties to even, clamped to [-top, top]; 0 for a scale of 0.
 * The quotient itself, rounded once (not x times a rounded 1 / scale, whose
 * error can carry a value across a tie); adding and subtracting 1.5 * 2^23
 * rounds in the current (nearest) rounding mode.  int8 (top 127: caches and
 * integer_qk's query rows) and int4 (top 7) values. */
static inline float sdpa_round_quotient(float x, float scale, float top) {
    const float magic = 12582912.0f;
    const float r = scale > 0 ? (x / scale + magic) - magic : 0.0f;
    return r > top ? top : r < -top ? -top : r;
}

/* x as a float8 of mbits mantissa bits and exponent bias `bias`, `top` its
 * largest finite code (the byte without its sign) */
static inline uint8_t sdpa_f32_to_fp8(float x, unsigned mbits, unsigned bias, unsigned top) {
    const unsigned shift = 23 - mbits;
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    const uint32_t largest = (((top >> mbits) + 127u - bias) << 23) | ((top & ((1u << mbits) - 1)) << shift);
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= largest) return (uint8_t)(sign | top); /* the largest finite value and beyond */
    if (a < (128u - bias) << 23) { /* below the smallest normal: steps of 2^(1 - bias - mbits) */
        float f;
        memcpy(&f, &a, sizeof(f));
        return (uint8_t)(sign | sdpa_round_small(f * (float)(1u << (bias + mbits - 1))));
    }
    const uint32_t r = a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u);
    return (uint8_t)(sign | ((r >> shift) - ((127u - bias) << mbits)));
}

static inline uint8_t sdpa_f32_to_e4m3(float x) { return sdpa_f32_to_fp8(x, 3, 7, 0x7eu); }   /* largest 448 */
static inline uint8_t sdpa_f32_to_e5m2(float x) { return sdpa_f32_to_fp8(x, 2, 15, 0x7bu); }  /* 57344 */

/* Value c of a quantized row (SDPA_INT8, _FP8_E4M3, _FP8_E5M2, _INT4; dt as an
 * int, so that this header needs no sdpa.h), unscaled. */
static inline float sdpa_quantized_value(int dt, const uint8_t *row, int64_t c) {
    switch (dt) {
        case 4: return (float)(int8_t)row[c];
        case 5: return sdpa_e4m3_to_f32(row[c]);
        case 6: return sdpa_e5m2_to_f32(row[c]);
        default: return (float)((int)((row[c >> 1] >> ((c & 1) * 4)) & 15u) - 8);
    }
}

#endif
