/* Chooses the kernel table: the best kernel set this CPU supports, decided once
 * (cpuid + xgetbv), unless SDPA_ISA names another or sdpa_set_isa switches.
 * A kernel set named by SDPA_ISA that is unknown, or that this CPU cannot run,
 * is an error (every call returns SDPA_ERR_BAD_ISA), never a silent fallback.
 *
 * AMX: besides the CPU (cpuid) and the OS's XSAVE support (XCR0), Linux makes
 * a process ask for the tile data state before its first tile instruction
 * (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).  That request is made
 * once per process, by the first call that would run a tile instruction (a
 * bfloat16 problem on the tiled path, sdpa_kernel_table_for_tiles): never at
 * load, nor for calls of other dtypes, nor when the set is only asked about.
 * When the OS refuses it (an old kernel, a seccomp filter), the default choice
 * falls back to avx512_bf16; a forced "amx" makes those calls an error. */
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

/* The kernel sets, lowest first; a CPU that runs one runs those before it. */
static const kernel_table *const isa_tables[] = {
    &sdpa_kernels_scalar,
#if SDPA_HAVE_X86_KERNELS
    &sdpa_kernels_avx2,
    &sdpa_kernels_avx512,
    &sdpa_kernels_avx512_bf16,
#endif
#if SDPA_HAVE_AMX_KERNELS
    &sdpa_kernels_amx,
#endif
};
#define NUM_ISAS ((int)(sizeof(isa_tables) / sizeof(isa_tables[0])))

#if SDPA_HAVE_X86_KERNELS
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

/* The index of the best set: 0 = scalar, 1 = avx2 + fma + f16c, 2 = avx512
 * f/bw/dq/vl, 3 = that and avx512_bf16, 4 = that and amx-tile + amx-bf16; the
 * OS must save the registers too (for AMX: XCR0's XTILECFG and XTILEDATA). */
static int detect_level(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int has_fma = (c >> 12) & 1, has_osxsave = (c >> 27) & 1, has_avx = (c >> 28) & 1;
    const int has_f16c = (c >> 29) & 1;
    if (!has_osxsave || !has_avx || !has_fma || !has_f16c) return 0;
    unsigned long long xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return 0;  /* the OS saves SSE and AVX state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned int max_subleaf = a;
    const int has_avx2 = (b >> 5) & 1;
    if (!has_avx2) return 0;
    const int avx512 = ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1);
    if (!avx512 || (xcr0 & 0xE0) != 0xE0) return 1;  /* opmask and zmm state too */
    if (max_subleaf < 1) return 2;
    __cpuid_count(7, 1, a, b, c, d);
    const int has_bf16 = (a >> 5) & 1;  /* AVX512_BF16: VDPBF16PS, VCVTNEPS2BF16 */
    if (!has_bf16) return 2;
#if SDPA_HAVE_AMX_KERNELS
    __cpuid_count(7, 0, a, b, c, d);
    const int has_amx = ((d >> 24) & 1) && ((d >> 22) & 1);  /* AMX-TILE, AMX-BF16 */
    if (has_amx && (xcr0 & 0x60000ull) == 0x60000ull) return 4;
#endif
    return 3;
}
#else
static int detect_level(void) { return 0; }
#endif

/* -1 until detected; every thread that races to detect finds the same value */
static SDPA_ATOMIC(int) cpu_level_cache = -1;

static int cpu_level(void) {
    int level = sdpa_atomic_load(&cpu_level_cache);
    if (level < 0) {
        level = detect_level();
        sdpa_atomic_store(&cpu_level_cache, level);
    }
    return level;
}

/* The tile data permission: 0 not asked yet, 1 granted, -1 refused. */
static SDPA_ATOMIC(int) amx_permission = 0;

#if SDPA_HAVE_AMX_KERNELS
#define SDPA_ARCH_GET_XCOMP_PERM 0x1022
#define SDPA_ARCH_REQ_XCOMP_PERM 0x1023
#define SDPA_XFEATURE_XTILEDATA 18

static int ask_for_tiles(void) {
    unsigned long bits = 0;
    const unsigned long get = SDPA_ARCH_GET_XCOMP_PERM, req = SDPA_ARCH_REQ_XCOMP_PERM;
    const unsigned long xtiledata = SDPA_XFEATURE_XTILEDATA;
    if (syscall(SYS_arch_prctl, get, &bits) == 0 && (bits >> xtiledata) & 1)
        return 1;  /* granted before, by this library or another */
    if (syscall(SYS_arch_prctl, req, xtiledata) != 0) return 0;
    bits = 0;
    return syscall(SYS_arch_prctl, get, &bits) == 0 && (bits >> xtiledata) & 1;
}
#else
static int ask_for_tiles(void) { return 0; }
#endif

/* Whether this process may run tile instructions, asked of the OS once (two
 * threads racing here both ask; the answer is the same). */
static SDPA_ATOMIC(int) tile_requests;

static int tiles_permitted(void) {
    int state = sdpa_atomic_load(&amx_permission);
    if (state == 0) {
        sdpa_atomic_store(&tile_requests, sdpa_atomic_load(&tile_requests) + 1);  /* a count for the tests */
        state = ask_for_tiles() ? 1 : -1;
        sdpa_atomic_store(&amx_permission, state);
    }
    return state > 0;
}

static int index_of_name(const char *name) {
    if (!name) return -1;
    for (int i = 0; i < NUM_ISAS; i++)
        if (strcmp(name, isa_tables[i]->name) == 0) return i;
    /* names of sets this build has no code for (non-x86): known, never supported */
    if (strcmp(name, "avx2") == 0 || strcmp(name, "avx512") == 0 || strcmp(name, "avx512_bf16") == 0 ||
        strcmp(name, "amx") == 0)
        return NUM_ISAS;
    return -1;
}

/* tests: the emulated set stands in for amx towards the OS's answer */
static SDPA_ATOMIC(int) emulated_needs_tiles = 0;

static int needs_tiles(const kernel_table *kt) {
#if SDPA_HAVE_AMX_KERNELS
    if (kt == &sdpa_kernels_amx) return 1;
#endif
#if SDPA_HAVE_X86_KERNELS
    if (kt == &sdpa_kernels_amx_emulated && sdpa_atomic_load(&emulated_needs_tiles)) return 1;
#endif
    (void)kt;
    return 0;
}

/* kt needs the tile state, and the OS has refused it */
static int tiles_refused(const kernel_table *kt) { return needs_tiles(kt) && sdpa_atomic_load(&amx_permission) < 0; }

/* A set this CPU and build run, unless it needs the tile state and the OS
 * refused it (asked only when a call first needs tiles). */
static int usable(int i) {
    return i >= 0 && i < NUM_ISAS && i <= cpu_level() && !tiles_refused(isa_tables[i]);
}

const kernel_table *sdpa_kernel_table_named(const char *name) {
    int i = index_of_name(name);
    return usable(i) ? isa_tables[i] : NULL;
}

/* The choice: a table and whether it was named (SDPA_ISA, sdpa_set_isa), in one
 * pointer so that a call reads both at once; NULL once SDPA_ISA was found
 * unusable, with env_error set.  Decided on the first call that needs it. */
typedef struct choice {
    const kernel_table *kt;
    int by_name;
} choice;

#define SDPA_BOTH(t) {{&t, 0}, {&t, 1}}
static const choice choices[][2] = {
    SDPA_BOTH(sdpa_kernels_scalar),
#if SDPA_HAVE_X86_KERNELS
    SDPA_BOTH(sdpa_kernels_avx2),
    SDPA_BOTH(sdpa_kernels_avx512),
    SDPA_BOTH(sdpa_kernels_avx512_bf16),
    SDPA_BOTH(sdpa_kernels_amx_emulated),
#endif
#if SDPA_HAVE_AMX_KERNELS
    SDPA_BOTH(sdpa_kernels_amx),
#endif
};
#undef SDPA_BOTH

static const choice *choice_of(const kernel_table *kt, int by_name) {
    for (size_t i = 0; i < sizeof(choices) / sizeof(choices[0]); i++)
        if (choices[i][0].kt == kt) return &choices[i][by_name ? 1 : 0];
    return NULL;
}

enum { CHOICE_UNDECIDED, CHOICE_MADE, CHOICE_ENV_ERROR };
static SDPA_ATOMIC(int) choice_state = CHOICE_UNDECIDED;
static SDPA_ATOMIC(const choice *) chosen = NULL;
static SDPA_ATOMIC(const char *) env_error = NULL;

/* Decides from the CPU and SDPA_ISA alone: no request to the OS here, since
 * this runs when the module loads (sdpa_isa_env_error). */
static void choose(void) {
    const char *forced = getenv("SDPA_ISA");
    const kernel_table *kt = isa_tables[cpu_level()];
    const char *error = NULL;
    int by_name = 0;
    if (forced && *forced) {
        int i = index_of_name(forced);
        if (i < 0)
            error = "SDPA_ISA names no kernel set (the sets are scalar, avx2, avx512, avx512_bf16 and amx)";
        else if (!usable(i))
            error = "SDPA_ISA names a kernel set this CPU or build cannot run";
        else
            kt = isa_tables[i];
        by_name = 1;
    }
    sdpa_atomic_store(&env_error, error);
    sdpa_atomic_store(&chosen, error ? (const choice *)NULL : choice_of(kt, by_name));
    sdpa_atomic_store(&choice_state, error ? CHOICE_ENV_ERROR : CHOICE_MADE);
}

/* An explicit choice (sdpa_set_isa, the test hooks): replaces whatever SDPA_ISA said. */
static void make_choice(const choice *c) {
    sdpa_atomic_store(&chosen, c);
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
    return c ? c->kt : NULL;
}

const kernel_table *sdpa_kernel_table(void) { return sdpa_kernel_choice(NULL); }

const kernel_table *sdpa_kernel_table_for_tiles(const kernel_table *kt, int by_name) {
    if (!needs_tiles(kt) || tiles_permitted()) return kt;
#if SDPA_HAVE_X86_KERNELS
    if (!by_name) return &sdpa_kernels_avx512_bf16;
#endif
    return NULL;  /* named (SDPA_ISA=amx, sdpa_set_isa): an error, never a silent fallback */
}

const char *sdpa_isa_env_error(void) {
    const choice *c = current();
    if (c && c->by_name && tiles_refused(c->kt))
        return "the amx kernel set was named, and the OS refused this process the AMX tile state (arch_prctl)";
    return sdpa_atomic_load(&env_error);
}

int sdpa_isa_supported(const char *name) { return sdpa_kernel_table_named(name) != NULL; }

sdpa_status sdpa_set_isa(const char *name) {
    const kernel_table *kt = sdpa_kernel_table_named(name);
    if (!kt) return SDPA_ERR_BAD_ISA;
    make_choice(choice_of(kt, 1));
    return SDPA_OK;
}

void sdpa_reset_isa(void) { choose(); }

const char *sdpa_isa_named(void) {
    const choice *c = current();
    return c && c->by_name ? c->kt->name : NULL;
}

const char *sdpa_isa(void) {
    const choice *c = current();
    if (!c) return "none";
#if SDPA_HAVE_X86_KERNELS
    /* the default choice whose tiles the OS refused runs as avx512_bf16 */
    if (!c->by_name && tiles_refused(c->kt)) return sdpa_kernels_avx512_bf16.name;
#endif
    return c->kt->name;
}

/* ---- test hooks (testing.h) ---- */

int sdpa_testing_tile_requests(void) { return sdpa_atomic_load(&tile_requests); }

int sdpa_testing_ask_for_tiles(void) { return ask_for_tiles(); }

const kernel_table *sdpa_testing_table(const char *name) {
#if SDPA_HAVE_X86_KERNELS
    if (name && strcmp(name, "amx_emulated") == 0) return cpu_level() >= 3 ? &sdpa_kernels_amx_emulated : NULL;
#endif
    const kernel_table *kt = sdpa_kernel_table_named(name);
    return kt && needs_tiles(kt) && !tiles_permitted() ? NULL : kt;  /* tiles only once granted */
}

sdpa_status sdpa_testing_use_kernels(const char *name) {
#if SDPA_HAVE_X86_KERNELS
    if (name && strcmp(name, "amx_emulated") == 0) {
        if (cpu_level() < 3) return SDPA_ERR_BAD_ISA;  /* its other kernels are avx512_bf16's */
        make_choice(choice_of(&sdpa_kernels_amx_emulated, 1));
        return SDPA_OK;
    }
#endif
    return sdpa_set_isa(name);
}

sdpa_status sdpa_testing_stand_in(int mode, int as_default) {
#if SDPA_HAVE_X86_KERNELS
    if (mode == 0) {
        sdpa_atomic_store(&emulated_needs_tiles, 0);
        sdpa_atomic_store(&amx_permission, 0);  /* asked again when next needed */
        return SDPA_OK;
    }
    if (cpu_level() < 3) return SDPA_ERR_BAD_ISA;
    sdpa_atomic_store(&amx_permission, mode < 0 ? -1 : 0);
    sdpa_atomic_store(&emulated_needs_tiles, 1);
    make_choice(choice_of(&sdpa_kernels_amx_emulated, !as_default));
    return SDPA_OK;
#else
    (void)as_default;
    return mode == 0 ? SDPA_OK : SDPA_ERR_BAD_ISA;
#endif
}
