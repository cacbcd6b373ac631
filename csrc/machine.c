/* The machine's own limits, measured by the roofline report
 * (`python -m sdpa.bench --roofline`): the read bandwidth of a streaming sum,
 * and the peaks of float32 FMA and int8 dot products on the kernel set in use,
 * each on a given number of threads.  Not part of the C API (testing.h). */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "internal.h"
#include "testing.h"

static double seconds_now(void) { return 1e-9 * sdpa_now_ns(); }

/* Sum of n 64-bit words in 8 independent chains (the compiler vectorizes it). */
static uint64_t sum_words(const uint64_t *w, int64_t n) {
    uint64_t a[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] += w[i + k];
    for (; i < n; i++) a[0] += w[i];
    uint64_t t = 0;
    for (int k = 0; k < 8; k++) t += a[k];
    return t;
}

double sdpa_probe_read(const void *buf, size_t bytes, int threads) {
    const uint64_t *w = (const uint64_t *)buf;
    const int64_t n = (int64_t)(bytes / 8);
    volatile uint64_t sink = 0;
    if (threads < 1) threads = 1;
    const double t0 = seconds_now();
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = n * id / nt, hi = n * (id + 1) / nt;
        const uint64_t s = sum_words(w + lo, hi - lo);
#pragma omp atomic
        sink += s;
    }
#else
    sink += sum_words(w, n);
#endif
    const double t = seconds_now() - t0;
    (void)sink;
    return t;
}

double sdpa_probe_peak(int kind, int threads, double seconds, const char **name) {
    const sdpa_peak_fn fn = sdpa_peak_for(kind, name);
    if (threads < 1) threads = 1;
    /* steps for about `seconds` a thread, from a short run on this thread */
    int64_t iters = 1 << 12;
    double t = 0;
    for (;;) {
        const double t0 = seconds_now();
        fn(iters);
        t = seconds_now() - t0;
        if (t > 2e-3 || iters > ((int64_t)1 << 40)) break;
        iters *= 4;
    }
    iters = (int64_t)((double)iters * seconds / (t > 0 ? t : 1e-9)) + 1;
    double ops = 0;
    const double t0 = seconds_now();
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : ops)
    ops += fn(iters);
#else
    ops = fn(iters);
#endif
    return ops / (seconds_now() - t0);
}
