/* Chooses the kernel table once per process. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const kernel_table *choose(void) {
    return &sdpa_kernels_scalar;
}

const kernel_table *sdpa_kernel_table(void) {
    /* a benign race: every thread computes the same answer */
    static const kernel_table *volatile chosen = NULL;
    const kernel_table *kt = chosen;
    if (!kt) {
        kt = choose();
        chosen = kt;
    }
    return kt;
}
