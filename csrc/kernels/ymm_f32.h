/* Float helpers on 256-bit vectors that need no more than AVX2 (plus what the
 * including file's target adds): the AVX2 set's and the AVX-512 set's
 * quarter-width panels (avx512_f32q.h) share them.  Included inside an x86
 * target region, after <immintrin.h>. */
#ifndef SDPA_YMM_F32_H
#define SDPA_YMM_F32_H

/* 8 floats rounded to bfloat16 as sdpa_f32_to_bf16 does (see avx512.c) */
static inline __m128i f32_to_bf16_avx2(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x400000))), nan));
    r = _mm256_srli_epi32(r, 16);  /* 8 values of 16 bits in 32-bit lanes: pack them */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* r[i] (row i of an 8 x 8 block) becomes column i */
static inline void transpose8_ps(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
            u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
        }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* 8 bytes of a bool mask: 0 where nonzero (visible), -inf where zero */
static inline __m256 bool8_to_neginf_ps(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
    return _mm256_and_ps(hidden, _mm256_set1_ps(-INFINITY));
}

#endif
