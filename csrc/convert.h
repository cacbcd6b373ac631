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

#endif
