/* Internal declarations shared by the driver, dispatch and kernels. */
#ifndef SDPA_INTERNAL_H
#define SDPA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "sdpa.h"

/* Every scratch buffer and packed panel is aligned to this many bytes. */
#define SDPA_ALIGN 64

/*
 * Kernels: single-threaded, allocation free.  The contracts (f32 shown; the f64
 * table has the same slots with double):
 *
 *   qk(m, n, e, q, kp, s, ld_s)
 *       s[i*ld_s + j] = sum_c q[i*e + c] * kp_j[c]   for i < m, j < round_up(n, nr)
 *       q  : m rows of e elements, row-major (already multiplied by the scale)
 *       kp : the key block packed by pack_k: panels of nr keys, each panel e x nr
 *            (c-major), keys past n zero.
 *   pv(m, n, ev, p, ld_p, v, ld_v, acc)
 *       acc[i*ev + c] += sum_{j<n} p[i*ld_p + j] * v[j*ld_v + c]   for i < m, c < ev
 *       (v rows contiguous; ld_v may be anything, negative included)
 *   softmax(s, n, row_max, p)            -- one row of masked, scaled scores
 *       p[j] = exp(s[j] - row_max), returns sum_j p[j]; s and p may alias.
 *   row_max(s, n) -> max_j s[j]; NaN propagates, -inf when n == 0 or all -inf.
 *
 * nr is the key panel width of the table (key blocks are multiples of it).
 */
typedef struct kernels_f32 {
    void (*qk)(int m, int n, int64_t e, const float *q, const float *kp, float *s, int64_t ld_s);
    void (*pv)(int m, int n, int64_t ev, const float *p, int64_t ld_p, const float *v, int64_t ld_v,
               float *acc);
    float (*softmax)(const float *s, int n, float row_max, float *p);
    float (*row_max)(const float *s, int n);
} kernels_f32;

typedef struct kernels_f64 {
    void (*qk)(int m, int n, int64_t e, const double *q, const double *kp, double *s, int64_t ld_s);
    void (*pv)(int m, int n, int64_t ev, const double *p, int64_t ld_p, const double *v,
               int64_t ld_v, double *acc);
    double (*softmax)(const double *s, int n, double row_max, double *p);
    double (*row_max)(const double *s, int n);
} kernels_f64;

/* One instruction-set level: its kernels and its blocking parameters. */
typedef struct kernel_table {
    const char *name;
    int nr_f32, tile_q_f32, tile_k_f32;  /* key panel width, query rows, keys per tile */
    int nr_f64, tile_q_f64, tile_k_f64;
    kernels_f32 f32;
    kernels_f64 f64;
} kernel_table;

/* The table for this CPU (or the one forced by SDPA_ISA), chosen once. */
const kernel_table *sdpa_kernel_table(void);

/* The portable C kernels: the reference every other level is tested against. */
extern const kernel_table sdpa_kernels_scalar;

#endif
