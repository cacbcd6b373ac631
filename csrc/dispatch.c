/* Chooses the kernel table: the best kernel set whose declared features this
 * CPU (and OS) has, decided once (x86: cpuid + xgetbv; AArch64: the kernel's
 * hardware capabilities, getauxval on Linux, sysctlbyname on macOS), unless SDPA_ISA names
 * another or sdpa_set_isa switches.  A kernel set named by SDPA_ISA that is
 * unknown, or that this CPU cannot run, is an error (every call returns
 * SDPA_ERR_BAD_ISA), never a silent fallback.  Every table the driver gets is
 * complete: what a set does not have comes from the portable kernels.
 *
 * AMX: besides the CPU (cpuid) and the OS's XSAVE support (XCR0), Linux makes
 * a process ask for the tile data state before its first tile instruction
 * (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).  That request is made
 * once per process, by the first call that would run a tile instruction (a
 * bfloat16 problem on the tiled path, sdpa_kernel_table_for_tiles): never at
 * load, nor for calls of other dtypes, nor when the set is only asked about.
 * When the OS refuses it (an old kernel, a seccomp filter), the default choice
 * falls back to the best set without tiles; a named "amx" makes those calls
 * an error.  The testing unit (testing.c) drives the same state through
 * sdpa_dispatch_* (testing.h). */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall(), which -std=c11 hides */
#endif
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "testing.h"

#if SDPA_HAVE_AMX_KERNELS
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if SDPA_HAVE_NEON_KERNELS && defined(__linux__)
#include <sys/auxv.h>
#endif
#if SDPA_HAVE_NEON_KERNELS && defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

/* ---- the sets ---- */

/* Every set this build has, best first; test-only sets are never the default
 * nor taken by name from SDPA_ISA or sdpa_set_isa. */
typedef struct kernel_set {
    const kernel_table *declared;
    int test_only;
} kernel_set;

static const kernel_set sets[] = {
#if SDPA_HAVE_AMX_KERNELS
    {&sdpa_kernels_amx, 0},
#endif
#if SDPA_HAVE_X86_KERNELS
    {&sdpa_kernels_avx512_bf16, 0},
    {&sdpa_kernels_avx512, 0},
    {&sdpa_kernels_avx2, 0},
    {&sdpa_kernels_amx_emulated, 1},
#endif
#if SDPA_HAVE_NEON_EXT_KERNELS
    {&sdpa_kernels_neon_bf16, 0},
#endif
#if SDPA_HAVE_NEON_KERNELS
    {&sdpa_kernels_neon, 0},
#endif
    {&sdpa_kernels_scalar, 0},
};
#define NUM_SETS ((int)(sizeof(sets) / sizeof(sets[0])))

/* The names of every set: the one list (sdpa_isa_name gives it to the
 * extension), for SDPA_ISA's message and for the names a build without their
 * code still knows (never supported there). */
#define KNOWN_SETS(NAME, LAST) NAME("scalar") NAME("avx2") NAME("avx512") NAME("avx512_bf16") NAME("amx") NAME("neon") \
    LAST("neon_bf16")
#define AS_ENTRY(n) n,
#define AS_TEXT(n) n ", "
#define AS_LAST_TEXT(n) "and " n
static const char *const known_names[] = {KNOWN_SETS(AS_ENTRY, AS_ENTRY)};
#define NUM_KNOWN ((int)(sizeof(known_names) / sizeof(known_names[0])))
/* "scalar, avx2, ..., and neon_bf16": a literal, written once at compile time */
#define ALL_SET_NAMES KNOWN_SETS(AS_TEXT, AS_LAST_TEXT)

const char *sdpa_isa_name(int i) { return i >= 0 && i < NUM_KNOWN ? known_names[i] : NULL; }

/* ---- completion ---- */

#define SDPA_FILL(ret, name, params) \
    if (!dst->name) dst->name = ref->name, filled++;

static int complete_f32(kernels_f32 *dst, const kernels_f32 *ref) {
    int filled = 0;
    SDPA_TYPED_KERNELS(SDPA_FILL, float)
    if (!dst->bf16.tiles_begin) dst->bf16.tiles_begin = ref->bf16.tiles_begin, filled++;
    if (!dst->bf16.tiles_end) dst->bf16.tiles_end = ref->bf16.tiles_end, filled++;
    return filled;
}

static int complete_f64(kernels_f64 *dst, const kernels_f64 *ref) {
    int filled = 0;
    SDPA_TYPED_KERNELS(SDPA_FILL, double)
    return filled;
}
#undef SDPA_FILL

/* A set's narrower table (half or quarter width), completed against the next
 * wider one: its panel kernels its own or the portable ones (which take any
 * width), the rest the set's (the same bits at any width).  Its address, or
 * NULL (and nr 0) where the set declares none, or not gemm and the softmax
 * update at a width less than the wider one's. */
#define SDPA_PORTABLE_PANEL(name) \
    if (!h->name) h->name = portable->name;
#define SDPA_COMPLETE_HALF(T, name, complete)                                                                \
    static const T *name(T *h, const T *set, const T *portable) {                                            \
        if (h->nr <= 0 || h->nr >= set->nr || !h->gemm || !h->online_softmax_update) {                     \
            memset(h, 0, sizeof(*h));                                                                       \
            return NULL;                                                                                    \
        }                                                                                                   \
        SDPA_PANEL_KERNELS(SDPA_PORTABLE_PANEL)                                                             \
        complete(h, set);                                                                                   \
        h->half = NULL;                                                                                     \
        return h;                                                                                           \
    }
SDPA_COMPLETE_HALF(kernels_f32, complete_half_f32, complete_f32)
SDPA_COMPLETE_HALF(kernels_f64, complete_half_f64, complete_f64)
#undef SDPA_COMPLETE_HALF
#undef SDPA_PORTABLE_PANEL

int sdpa_complete_table(kernel_table *dst, const kernel_table *src) {
    *dst = *src;
    int filled = complete_f32(&dst->f32, &sdpa_kernels_scalar.f32) + complete_f64(&dst->f64, &sdpa_kernels_scalar.f64);
    if (!dst->dropout_bits) dst->dropout_bits = sdpa_kernels_scalar.dropout_bits, filled++;
    /* the portable gemm and softmax update are built for the scalar panel width
     * alone: a set of another width must have its own (left unset otherwise, so
     * that sdpa_table_is_complete says so) */
    if (dst->f32.nr != sdpa_kernels_scalar.f32.nr) {
        if (!src->f32.gemm) dst->f32.gemm = NULL, filled--;
        if (!src->f32.online_softmax_update) dst->f32.online_softmax_update = NULL, filled--;
    }
    if (dst->f64.nr != sdpa_kernels_scalar.f64.nr) {
        if (!src->f64.gemm) dst->f64.gemm = NULL, filled--;
        if (!src->f64.online_softmax_update) dst->f64.online_softmax_update = NULL, filled--;
    }
    dst->f32.half = complete_half_f32(&dst->f32_half, &dst->f32, &sdpa_kernels_scalar.f32);
    /* a quarter-width table under a half one only (set's half's half) */
    const kernels_f32 *quarter = complete_half_f32(&dst->f32_quarter, &dst->f32_half, &sdpa_kernels_scalar.f32);
    if (dst->f32.half) dst->f32_half.half = quarter;
    else memset(&dst->f32_quarter, 0, sizeof(dst->f32_quarter));
    dst->f64.half = complete_half_f64(&dst->f64_half, &dst->f64, &sdpa_kernels_scalar.f64);
    return filled;
}

#define SDPA_COUNT_SET(ret, name, params) set += k->name != NULL, all++;

int sdpa_table_is_complete(const kernel_table *kt) {
    int set = 0, all = 0;
    {
        const kernels_f32 *k = &kt->f32;
        SDPA_TYPED_KERNELS(SDPA_COUNT_SET, float)
        set += (k->bf16.tiles_begin != NULL) + (k->bf16.tiles_end != NULL), all += 2;
        if (kt->bf16_products)
            set += (k->bf16.gemm_bf16 != NULL) + (k->bf16.pack_q_pairs != NULL) + (k->bf16.pack_v_pairs != NULL) +
                   (k->bf16.online_softmax_pairs != NULL),
                all += 4;
    }
    {
        const kernels_f64 *k = &kt->f64;
        SDPA_TYPED_KERNELS(SDPA_COUNT_SET, double)
    }
    for (const kernels_f32 *wide = &kt->f32, *k = wide->half; k; wide = k, k = k->half) {
        SDPA_TYPED_KERNELS(SDPA_COUNT_SET, float)
        all += k->nr <= 0 || k->nr >= wide->nr;
    }
    if (kt->f64.half) {
        const kernels_f64 *k = kt->f64.half;
        SDPA_TYPED_KERNELS(SDPA_COUNT_SET, double)
        all += k->nr <= 0 || k->nr >= kt->f64.nr;
    }
    return set == all && kt->f32.nr > 0 && kt->f64.nr > 0 && kt->dropout_bits;
}
#undef SDPA_COUNT_SET

/* The complete tables, made once, the first time any is needed; a thread that
 * finds another making them waits (microseconds, once per process). */
static kernel_table complete_tables[NUM_SETS];
static SDPA_ATOMIC(int) tables_state = 0; /* 0 not made, 1 being made, 2 made */

static const kernel_table *complete(int i) {
    if (sdpa_atomic_load(&tables_state) != 2) {
        int expected = 0;
        if (sdpa_atomic_cas(&tables_state, &expected, 1)) {
            for (int j = 0; j < NUM_SETS; j++) sdpa_complete_table(&complete_tables[j], sets[j].declared);
            sdpa_atomic_store(&tables_state, 2);
        } else {
            while (sdpa_atomic_load(&tables_state) != 2) {
            } /* another thread is making them (microseconds, once per process) */
        }
    }
    return &complete_tables[i];
}

/* ---- the CPU's features ---- */

#if SDPA_HAVE_X86_KERNELS
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

/* SDPA_FEATURE_* bits: what the CPU has and the OS saves (XCR0: ymm for AVX2,
 * opmasks and zmm for AVX-512, XTILECFG and XTILEDATA for AMX). */
static unsigned detect_features(void) {
    unsigned f = 0;
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int has_fma = (c >> 12) & 1, has_osxsave = (c >> 27) & 1, has_avx = (c >> 28) & 1;
    const int has_f16c = (c >> 29) & 1;
    if (!has_osxsave || !has_avx) return 0;
    const unsigned long long xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return 0; /* the OS saves SSE and AVX state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned int max_subleaf = a;
    const unsigned int leaf7_b = b, leaf7_c = c, leaf7_d = d;
    if (((leaf7_b >> 5) & 1) && has_fma && has_f16c) f |= SDPA_FEATURE_AVX2;
    const int avx512 = ((leaf7_b >> 16) & 1) && ((leaf7_b >> 17) & 1) && ((leaf7_b >> 30) & 1) && ((leaf7_b >> 31) & 1);
    if (avx512 && (xcr0 & 0xE0) == 0xE0) f |= SDPA_FEATURE_AVX512;
    if ((f & SDPA_FEATURE_AVX512) && ((leaf7_c >> 11) & 1)) f |= SDPA_FEATURE_AVX512_VNNI; /* VPDPBUSD */
    if (max_subleaf >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if ((a >> 5) & 1) f |= SDPA_FEATURE_AVX512_BF16; /* VDPBF16PS, VCVTNEPS2BF16 */
        if (((a >> 4) & 1) && (f & SDPA_FEATURE_AVX2)) f |= SDPA_FEATURE_AVX_VNNI;
    }
    const int has_amx = ((leaf7_d >> 24) & 1) && ((leaf7_d >> 22) & 1); /* AMX-TILE, AMX-BF16 */
    if (has_amx && (xcr0 & 0x60000ull) == 0x60000ull) f |= SDPA_FEATURE_AMX_BF16;
    return f;
}
#elif SDPA_HAVE_NEON_KERNELS
#if defined(__linux__)
/* the bits of <asm/hwcap.h>, which an old libc's headers may lack */
#define SDPA_HWCAP_ASIMD (1ul << 1)
#define SDPA_HWCAP_ASIMDDP (1ul << 20)
#define SDPA_HWCAP2_BF16 (1ul << 14)

static unsigned detect_features(void) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    unsigned f = 0;
    if (!(hw & SDPA_HWCAP_ASIMD)) return 0;
    f |= SDPA_FEATURE_NEON;
    if (hw2 & SDPA_HWCAP2_BF16) f |= SDPA_FEATURE_NEON_BF16;
    if (hw & SDPA_HWCAP_ASIMDDP) f |= SDPA_FEATURE_NEON_DOTPROD;
    return f;
}
#elif defined(__APPLE__)
static int sysctl_flag(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v != 0;
}

static unsigned detect_features(void) {
    unsigned f = SDPA_FEATURE_NEON; /* every Apple arm64 CPU */
    if (sysctl_flag("hw.optional.arm.FEAT_BF16")) f |= SDPA_FEATURE_NEON_BF16;
    if (sysctl_flag("hw.optional.arm.FEAT_DotProd")) f |= SDPA_FEATURE_NEON_DOTPROD;
    return f;
}
#else
/* Advanced SIMD is part of every AArch64 CPU; the extensions are not asked for here */
static unsigned detect_features(void) { return SDPA_FEATURE_NEON; }
#endif
#else
static unsigned detect_features(void) { return 0; }
#endif

/* ~0u until detected; every thread that races to detect finds the same value */
static SDPA_ATOMIC(unsigned) features_cache = ~0u;

static unsigned cpu_features(void) {
    unsigned f = sdpa_atomic_load(&features_cache);
    if (f == ~0u) {
        f = detect_features();
        sdpa_atomic_store(&features_cache, f);
    }
    return f;
}

/* ---- integer_qk's scores ---- */

static SDPA_ATOMIC(int) portable_dot_qi = 0;

void sdpa_testing_portable_dot_qi(int on) { sdpa_atomic_store(&portable_dot_qi, on); }

#if !SDPA_HAVE_X86_KERNELS
int (*const sdpa_dot_qi_vnni)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                              const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                              void *) = NULL;
int (*const sdpa_dot_qi_avx_vnni)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                                  const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                                  void *) = NULL;
#endif
#if !SDPA_HAVE_NEON_KERNELS
int (*const sdpa_dot_qi_neon)(sdpa_dtype, int, int, int64_t, int64_t, const int8_t *, int64_t, const float *,
                              const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                              void *) = NULL;
#endif

sdpa_dot_qi_f32_fn sdpa_dot_qi_for(const kernel_table *kt) {
    if (sdpa_atomic_load(&portable_dot_qi)) return kt->f32.dot_qi;
    if (sdpa_dot_qi_vnni && (kt->features & SDPA_FEATURE_AVX512) && (cpu_features() & SDPA_FEATURE_AVX512_VNNI))
        return sdpa_dot_qi_vnni;
    if (sdpa_dot_qi_avx_vnni && (kt->features & SDPA_FEATURE_AVX2) && (cpu_features() & SDPA_FEATURE_AVX_VNNI))
        return sdpa_dot_qi_avx_vnni;
    if (sdpa_dot_qi_neon && (kt->features & SDPA_FEATURE_NEON) && (cpu_features() & SDPA_FEATURE_NEON_DOTPROD))
        return sdpa_dot_qi_neon;
    return kt->f32.dot_qi;
}

#if !SDPA_HAVE_X86_KERNELS
const sdpa_pv_qi_fn sdpa_pv_qi_vnni = NULL, sdpa_pv_qi_avx2 = NULL;
const sdpa_peak_fn sdpa_peak_fma_avx512 = NULL, sdpa_peak_vnni_avx512 = NULL, sdpa_peak_fma_avx2 = NULL,
                   sdpa_peak_vnni_avx2 = NULL;
#endif
#if !SDPA_HAVE_NEON_KERNELS
const sdpa_peak_fn sdpa_peak_fma_neon = NULL, sdpa_peak_sdot_neon = NULL;
#endif

/* The portable probes: what the compiler makes of plain loops. */
static double peak_fma_portable(int64_t iters) {
    float a[12];
    for (int k = 0; k < 12; k++) a[k] = (float)k;
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] = a[k] * 0.999999f + 1e-7f;
    volatile float sink = a[0] + a[11];
    (void)sink;
    return (double)iters * 12 * 2;
}

static double peak_int_portable(int64_t iters) {
    uint32_t a[12];  /* unsigned: the sums wrap */
    for (int k = 0; k < 12; k++) a[k] = (uint32_t)k;
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) a[k] += (uint32_t)(k + 3) * (uint32_t)(i & 7);
    volatile uint32_t sink = a[0] + a[11];
    (void)sink;
    return (double)iters * 12 * 2;
}

sdpa_peak_fn sdpa_peak_for(int kind, const char **name) {
    const kernel_table *kt = sdpa_kernel_table();
    const unsigned have = kt ? kt->features : 0, cpu = cpu_features();
    struct { sdpa_peak_fn fn; unsigned set, cpu; const char *name; } options[] = {
        {kind ? sdpa_peak_vnni_avx512 : sdpa_peak_fma_avx512, SDPA_FEATURE_AVX512,
         kind ? SDPA_FEATURE_AVX512_VNNI : 0, kind ? "avx512_vnni" : "avx512"},
        {kind ? sdpa_peak_vnni_avx2 : sdpa_peak_fma_avx2, SDPA_FEATURE_AVX2, kind ? SDPA_FEATURE_AVX_VNNI : 0,
         kind ? "avx_vnni" : "avx2"},
        {kind ? sdpa_peak_sdot_neon : sdpa_peak_fma_neon, SDPA_FEATURE_NEON, kind ? SDPA_FEATURE_NEON_DOTPROD : 0,
         kind ? "neon_dotprod" : "neon"},
    };
    for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++)
        if (options[i].fn && (have & options[i].set) && (cpu & options[i].cpu) == options[i].cpu) {
            *name = options[i].name;
            return options[i].fn;
        }
    *name = "portable";
    return kind ? peak_int_portable : peak_fma_portable;
}

sdpa_pv_qi_fn sdpa_pv_qi_for(const kernel_table *kt) {
    if (sdpa_atomic_load(&portable_dot_qi)) return sdpa_pv_qi_portable;
    if (sdpa_pv_qi_vnni && (kt->features & SDPA_FEATURE_AVX512) && (cpu_features() & SDPA_FEATURE_AVX512_VNNI))
        return sdpa_pv_qi_vnni;
    if (sdpa_pv_qi_avx2 && (kt->features & SDPA_FEATURE_AVX2)) return sdpa_pv_qi_avx2;
    return sdpa_pv_qi_portable;
}

const char *sdpa_testing_dot_qi_kernel(void) {
    const kernel_table *kt = sdpa_kernel_table();
    const sdpa_dot_qi_f32_fn f = kt ? sdpa_dot_qi_for(kt) : NULL;
    if (f && f == sdpa_dot_qi_vnni) return "avx512_vnni";
    if (f && f == sdpa_dot_qi_avx_vnni) return "avx_vnni";
    if (f && f == sdpa_dot_qi_neon) return "neon_dotprod";
    return "portable";
}

/* ---- the tile state ---- */

/* The tile data permission: 0 not asked yet, 1 granted, -1 refused. */
static SDPA_ATOMIC(int) amx_permission = 0;
/* How many times a call asked the OS (for the tests) */
static SDPA_ATOMIC(int) tile_requests;
/* tests: the emulated set stands in for amx towards the OS's answer */
static SDPA_ATOMIC(int) emulated_needs_tiles = 0;

#if SDPA_HAVE_AMX_KERNELS
#define SDPA_ARCH_GET_XCOMP_PERM 0x1022
#define SDPA_ARCH_REQ_XCOMP_PERM 0x1023
#define SDPA_XFEATURE_XTILEDATA 18

int sdpa_dispatch_ask_for_tiles(void) {
    unsigned long bits = 0;
    const unsigned long get = SDPA_ARCH_GET_XCOMP_PERM, req = SDPA_ARCH_REQ_XCOMP_PERM;
    const unsigned long xtiledata = SDPA_XFEATURE_XTILEDATA;
    if (syscall(SYS_arch_prctl, get, &bits) == 0 && (bits >> xtiledata) & 1)
        return 1; /* granted before, by this library or another */
    if (syscall(SYS_arch_prctl, req, xtiledata) != 0) return 0;
    bits = 0;
    return syscall(SYS_arch_prctl, get, &bits) == 0 && (bits >> xtiledata) & 1;
}
#else
int sdpa_dispatch_ask_for_tiles(void) { return 0; }
#endif

/* Whether this process may run tile instructions, asked of the OS once (two
 * threads racing here both ask; the answer is the same). */
static int tiles_permitted(void) {
    int state = sdpa_atomic_load(&amx_permission);
    if (state == 0) {
        sdpa_atomic_store(&tile_requests, sdpa_atomic_load(&tile_requests) + 1);
        state = sdpa_dispatch_ask_for_tiles() ? 1 : -1;
        sdpa_atomic_store(&amx_permission, state);
    }
    return state > 0;
}

static int needs_tiles(const kernel_table *kt) {
    if (kt->features & SDPA_FEATURE_AMX_BF16) return 1;
#if SDPA_HAVE_X86_KERNELS
    if (strcmp(kt->name, sdpa_kernels_amx_emulated.name) == 0 && sdpa_atomic_load(&emulated_needs_tiles)) return 1;
#endif
    return 0;
}

/* kt needs the tile state, and the OS has refused it */
static int tiles_refused(const kernel_table *kt) { return needs_tiles(kt) && sdpa_atomic_load(&amx_permission) < 0; }

/* A set this CPU runs (its features), unless it needs the tile state and the
 * OS refused it (asked only when a call first needs tiles). */
static int runs_here(int i) {
    const unsigned need = sets[i].declared->features;
    return (cpu_features() & need) == need && !tiles_refused(sets[i].declared);
}

/* The index of the named set (test-only sets when allowed), -1 when this build
 * has none of that name; NUM_SETS for a known name without code here. */
static int index_of_name(const char *name, int allow_test_only) {
    if (!name) return -1;
    for (int i = 0; i < NUM_SETS; i++)
        if (strcmp(name, sets[i].declared->name) == 0 && (allow_test_only || !sets[i].test_only)) return i;
    for (int k = 0; k < NUM_KNOWN; k++)
        if (strcmp(name, known_names[k]) == 0) return NUM_SETS;
    return -1;
}

/* The best set this machine runs (the last, scalar, runs everywhere). */
static int best_set(int skip_tiles) {
    for (int i = 0; i < NUM_SETS; i++)
        if (!sets[i].test_only && runs_here(i) && !(skip_tiles && needs_tiles(sets[i].declared))) return i;
    return NUM_SETS - 1;
}

const kernel_table *sdpa_kernel_table_named(const char *name) {
    int i = index_of_name(name, 0);
    return i >= 0 && i < NUM_SETS && runs_here(i) ? complete(i) : NULL;
}

/* ---- the choice ---- */

/* The choice: a set and whether it was named (SDPA_ISA, sdpa_set_isa), in one
 * pointer so that a call reads both at once; NULL once SDPA_ISA was found
 * unusable, with env_error set.  Decided on the first call that needs it. */
typedef struct choice {
    int set;
    int by_name;
} choice;

#define SDPA_BOTH(i) {{i, 0}, {i, 1}}
static const choice choices[8][2] = {SDPA_BOTH(0), SDPA_BOTH(1), SDPA_BOTH(2), SDPA_BOTH(3),
                                     SDPA_BOTH(4), SDPA_BOTH(5), SDPA_BOTH(6), SDPA_BOTH(7)};
#undef SDPA_BOTH
typedef char sdpa_a_choice_for_every_set[NUM_SETS <= 8 ? 1 : -1];

enum { CHOICE_UNDECIDED, CHOICE_MADE, CHOICE_ENV_ERROR };
static SDPA_ATOMIC(int) choice_state = CHOICE_UNDECIDED;
static SDPA_ATOMIC(const choice *) chosen = NULL;
static SDPA_ATOMIC(const char *) env_error = NULL;

/* Decides from the CPU and SDPA_ISA alone: no request to the OS here, since
 * this runs when the module loads (sdpa_isa_env_error). */
static void choose(void) {
    const char *forced = getenv("SDPA_ISA");
    int set = best_set(0);
    const char *error = NULL;
    int by_name = 0;
    if (forced && *forced) {
        int i = index_of_name(forced, 0);
        if (i < 0)
            error = "SDPA_ISA names no kernel set (the sets are " ALL_SET_NAMES ")";
        else if (i == NUM_SETS || !runs_here(i))
            error = "SDPA_ISA names a kernel set this CPU or build cannot run";
        else
            set = i;
        by_name = 1;
    }
    sdpa_atomic_store(&env_error, error);
    sdpa_atomic_store(&chosen, error ? (const choice *)NULL : &choices[set][by_name]);
    sdpa_atomic_store(&choice_state, error ? CHOICE_ENV_ERROR : CHOICE_MADE);
}

/* An explicit choice (sdpa_set_isa, the testing unit): replaces whatever SDPA_ISA said. */
static void make_choice(int set, int by_name) {
    sdpa_atomic_store(&chosen, &choices[set][by_name ? 1 : 0]);
    sdpa_atomic_store(&env_error, (const char *)NULL);
    sdpa_atomic_store(&choice_state, CHOICE_MADE);
}

static const choice *current(void) {
    if (sdpa_atomic_load(&choice_state) == CHOICE_UNDECIDED) choose();
    return sdpa_atomic_load(&chosen);
}

const kernel_table *sdpa_kernel_choice(int *by_name) {
    const choice *c = current();
    if (by_name) *by_name = c ? c->by_name : 0;
    return c ? complete(c->set) : NULL;
}

const kernel_table *sdpa_kernel_table(void) { return sdpa_kernel_choice(NULL); }

const kernel_table *sdpa_kernel_table_for_tiles(const kernel_table *kt, int by_name) {
    if (!needs_tiles(kt) || tiles_permitted()) return kt;
    if (!by_name) return complete(best_set(1)); /* the best set without tiles */
    return NULL; /* named (SDPA_ISA=amx, sdpa_set_isa): an error, never a silent fallback */
}

const char *sdpa_isa_env_error(void) {
    const choice *c = current();
    if (c && c->by_name && tiles_refused(sets[c->set].declared))
        return "the amx kernel set was named, and the OS refused this process the AMX tile state (arch_prctl)";
    return sdpa_atomic_load(&env_error);
}

int sdpa_isa_supported(const char *name) { return sdpa_kernel_table_named(name) != NULL; }

sdpa_status sdpa_set_isa(const char *name) {
    int i = index_of_name(name, 0);
    if (i < 0 || i == NUM_SETS || !runs_here(i)) return SDPA_ERR_BAD_ISA;
    make_choice(i, 1);
    return SDPA_OK;
}

void sdpa_reset_isa(void) { choose(); }

const char *sdpa_isa_named(void) {
    const choice *c = current();
    return c && c->by_name ? sets[c->set].declared->name : NULL;
}

const char *sdpa_isa(void) {
    const choice *c = current();
    if (!c) return "none";
    /* the default choice whose tiles the OS refused runs as the best set without */
    if (!c->by_name && tiles_refused(sets[c->set].declared)) return sets[best_set(1)].declared->name;
    return sets[c->set].declared->name;
}

/* ---- the state the testing unit drives (testing.h) ---- */

const kernel_table *sdpa_dispatch_find(const char *name, int *needs_tile_state, int declared) {
    int i = index_of_name(name, 1);
    if (i < 0 || i == NUM_SETS) return NULL;
    const unsigned need = sets[i].declared->features;
    if ((cpu_features() & need) != need) return NULL; /* the OS's answer on tiles is the caller's to ask */
    if (needs_tile_state) *needs_tile_state = needs_tiles(sets[i].declared);
    return declared ? sets[i].declared : complete(i);
}

int sdpa_dispatch_tiles_permitted(void) { return tiles_permitted(); }

int sdpa_dispatch_tile_requests(void) { return sdpa_atomic_load(&tile_requests); }

sdpa_status sdpa_dispatch_use(const kernel_table *kt, int by_name) {
    for (int i = 0; i < NUM_SETS; i++)
        if (complete(i) == kt) {
            make_choice(i, by_name);
            return SDPA_OK;
        }
    return SDPA_ERR_BAD_ISA;
}

void sdpa_dispatch_set_tile_state(int permission, int emulated_stands_in) {
    sdpa_atomic_store(&amx_permission, permission);
    sdpa_atomic_store(&emulated_needs_tiles, emulated_stands_in);
}
