/* Dropout's random bits (kernel_table.dropout_bits, internal.h), plain C that
 * each set's file compiles for its own target (vectorized by the compiler
 * across the row groups).  Included with PHILOX_NAME defined.
 *
 * Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
 * 3", SC 2011): ten rounds of two 32 x 32 -> 64-bit products on a 128-bit
 * counter, the key bumped by the Weyl constants between rounds. */
static void PHILOX_NAME(uint64_t seed, uint32_t b, uint32_t h, uint32_t q0, int nq, uint64_t s0, int n,
                        uint32_t *out) {
    const uint32_t k0 = (uint32_t)seed;
    for (int j = 0; j < n; j++) {
        const uint64_t s = s0 + (uint64_t)j;
        const uint32_t k1 = (uint32_t)(seed >> 32) ^ (uint32_t)(s >> 32);
        uint32_t *o = out + (int64_t)j * 4 * nq;
        for (int q = 0; q < nq; q++) {
            uint32_t x0 = (uint32_t)s, x1 = q0 + (uint32_t)q, x2 = h, x3 = b, a = k0, c = k1;
            for (int r = 0; r < 10; r++) {
                const uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
                const uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ a, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ c;
                x1 = (uint32_t)p1;
                x3 = (uint32_t)p0;
                x0 = y0;
                x2 = y2;
                a += 0x9E3779B9u;
                c += 0xBB67AE85u;
            }
            o[4 * q] = x0;
            o[4 * q + 1] = x1;
            o[4 * q + 2] = x2;
            o[4 * q + 3] = x3;
        }
    }
}
