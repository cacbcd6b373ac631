/* The sizes of the CPU's L1 data cache and L2 cache, which the blocking rule of
 * make_plan (attention.c) reads: from cpuid on x86 (leaf 4 on Intel,
 * 0x8000001D on AMD), from sysfs on other Linux, from sysctl on macOS, and
 * 32 KiB / 1 MiB where none answers.  Detected once per process. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#if defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

#define DEFAULT_L1D ((int64_t)32 << 10)
#define DEFAULT_L2 ((int64_t)1 << 20)

#if SDPA_HAVE_X86_KERNELS
#include <cpuid.h>

/* Walks the deterministic cache parameters of `leaf` (4 or 0x8000001D): the
 * data (type 1) or unified (type 3) caches of levels 1 and 2. */
static void cpuid_caches(unsigned int leaf, int64_t *l1d, int64_t *l2) {
    for (unsigned int i = 0; i < 16; i++) {
        unsigned int a, b, c, d;
        __cpuid_count(leaf, i, a, b, c, d);
        const unsigned int type = a & 0x1f, level = (a >> 5) & 0x7;
        if (type == 0) break;  /* no more caches */
        if (type != 1 && type != 3) continue;
        const int64_t ways = ((b >> 22) & 0x3ff) + 1, parts = ((b >> 12) & 0x3ff) + 1;
        const int64_t line = (b & 0xfff) + 1, sets = (int64_t)c + 1;
        const int64_t size = ways * parts * line * sets;
        if (level == 1 && type == 1) *l1d = size;
        if (level == 2) *l2 = size;
    }
}

static void detect(int64_t *l1d, int64_t *l2) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const unsigned int max_leaf = a;
    const int amd = b == 0x68747541u || b == 0x6f677948u;  /* "Auth"enticAMD, "Hygo"nGenuine */
    if (amd) {
        if (__get_cpuid_max(0x80000000u, NULL) < 0x8000001Du) return;
        __cpuid(0x80000001u, a, b, c, d);
        if (!((c >> 22) & 1)) return;  /* no topology extensions: no leaf 0x8000001D */
        cpuid_caches(0x8000001Du, l1d, l2);
    } else if (max_leaf >= 4) {
        cpuid_caches(4, l1d, l2);
    }
}
#elif defined(__linux__)
/* sysfs: /sys/devices/system/cpu/cpu0/cache/indexN/{level,type,size} */
static int read_line(const char *path, char *buf, size_t n) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    const int ok = fgets(buf, (int)n, f) != NULL;
    fclose(f);
    return ok;
}

static void detect(int64_t *l1d, int64_t *l2) {
    char path[96], buf[64];
    for (int i = 0; i < 16; i++) {
        int level;
        long long size;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        if (!read_line(path, buf, sizeof buf)) break;
        level = buf[0] - '0';
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        if (!read_line(path, buf, sizeof buf) || strncmp(buf, "Instruction", 11) == 0) continue;
        const int data = strncmp(buf, "Data", 4) == 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!read_line(path, buf, sizeof buf) || sscanf(buf, "%lld%c", &size, &unit) < 1) continue;
        if (unit == 'K') size <<= 10;
        if (unit == 'M') size <<= 20;
        if (level == 1 && data) *l1d = (int64_t)size;
        if (level == 2) *l2 = (int64_t)size;
    }
}
#elif defined(__APPLE__)
/* The first of two sysctl names that answers, or 0. */
static int64_t sysctl_size(const char *name, const char *fallback) {
    int64_t v = 0;
    size_t n = sizeof v;
    if (sysctlbyname(name, &v, &n, NULL, 0) == 0) return v;
    v = 0;
    n = sizeof v;
    if (sysctlbyname(fallback, &v, &n, NULL, 0) == 0) return v;
    return 0;
}

static void detect(int64_t *l1d, int64_t *l2) {
    /* the performance cores' caches where there are two kinds of core */
    *l1d = sysctl_size("hw.perflevel0.l1dcachesize", "hw.l1dcachesize");
    *l2 = sysctl_size("hw.perflevel0.l2cachesize", "hw.l2cachesize");
}
#else
static void detect(int64_t *l1d, int64_t *l2) {
    (void)l1d;
    (void)l2;
}
#endif

/* 0 until detected; racing threads detect the same values */
static SDPA_ATOMIC(int64_t) l1d_cache = 0, l2_cache = 0;

void sdpa_cache_sizes(int64_t *l1d, int64_t *l2) {
    int64_t a = sdpa_atomic_load(&l1d_cache), b = sdpa_atomic_load(&l2_cache);
    if (a == 0 || b == 0) {
        a = 0, b = 0;
        detect(&a, &b);
        /* an answer out of any plausible range (a hypervisor's zeros) is ignored */
        if (a < ((int64_t)8 << 10) || a > ((int64_t)1 << 20)) a = DEFAULT_L1D;
        if (b < ((int64_t)128 << 10) || b > ((int64_t)256 << 20)) b = DEFAULT_L2;
        sdpa_atomic_store(&l1d_cache, a);
        sdpa_atomic_store(&l2_cache, b);
    }
    if (l1d) *l1d = a;
    if (l2) *l2 = b;
}
