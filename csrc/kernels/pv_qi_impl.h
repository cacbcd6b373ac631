/* integer_pv's products (internal.h's pv_qi) in plain C, the reference every
 * version matches bit for bit: the weights, their scales and bytes, then the
 * exact int32 sums, a group's values at a time, so that the compiler
 * vectorizes the inner loops for the target it builds for (included by
 * scalar.c as the portable kernel, and by avx2.c under its target). */
#include <float.h>
#include <math.h>

#ifndef PV_QI_NAME
#error "define PV_QI_NAME"
#endif

#ifndef PV_QI_STATIC
#define PV_QI_STATIC
#endif

PV_QI_STATIC int PV_QI_NAME(sdpa_dtype dt, int m, int n, int64_t ev, int64_t g, const float *p, int64_t ldp,
                            const float *vs, const uint8_t *const *rows, float *acc, int64_t ldacc, void *work) {
    if ((dt != SDPA_INT8 && dt != SDPA_INT4) || g <= 0 || ev % g || n > SDPA_PV_KEYS || (dt == SDPA_INT4 && g % 2))
        return 0;
    const int64_t ng = ev / g;
    int32_t *sum = (int32_t *)work;
    float *scale = (float *)(sum + ev);    /* [ng] */
    uint8_t *u = (uint8_t *)(scale + ng);  /* [ng][SDPA_PV_KEYS] */
    float w[SDPA_PV_KEYS];
    for (int x = 0; x < m; x++) {
        for (int64_t i = 0; i < ng; i++) {
            float mx = 0;
            int nan = 0;
            for (int j = 0; j < n; j++) {
                w[j] = p[x * ldp + j] * vs[i * SDPA_PV_KEYS + j];
                mx = w[j] > mx ? w[j] : mx;
                nan |= w[j] != w[j];
            }
            const float sc = nan ? NAN : mx / 255.0f >= FLT_MIN ? mx / 255.0f : 0.0f;
            const float inv = sc > 0 ? 1.0f / sc : 0.0f;
            scale[i] = sc;
            for (int j = 0; j < n; j++) {
                const float r = w[j] * inv + 0.5f;
                u[i * SDPA_PV_KEYS + j] = (uint8_t)(int)(r < 255.0f ? r : 255.0f);
            }
        }
        for (int64_t c = 0; c < ev; c++) sum[c] = 0;
        for (int j = 0; j < n; j++)
            for (int64_t i = 0; i < ng; i++) {
                const int32_t wt = u[i * SDPA_PV_KEYS + j];
                int32_t *si = sum + i * g;
                if (wt == 0) continue;  /* adds nothing */
                if (dt == SDPA_INT8) {
                    const int8_t *v8 = (const int8_t *)rows[j] + i * g;
                    for (int64_t c = 0; c < g; c++) si[c] += wt * (int32_t)v8[c];
                } else {
                    const uint8_t *v4 = rows[j] + i * g / 2;
                    for (int64_t b = 0; b < g / 2; b++) {
                        si[2 * b] += wt * ((int32_t)(v4[b] & 15u) - 8);
                        si[2 * b + 1] += wt * ((int32_t)(v4[b] >> 4) - 8);
                    }
                }
            }
        float *ax = acc + x * ldacc;
        for (int64_t i = 0; i < ng; i++)
            for (int64_t c = i * g; c < (i + 1) * g; c++) ax[c] = ax[c] + (float)sum[c] * scale[i];
    }
    return 1;
}
