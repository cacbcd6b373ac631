/* Dropout's keep masks (kernel_table.dropout_bits, internal.h), plain C that
 * each set's file compiles for its own target (vectorized by the compiler
 * across the row groups).  Included with PHILOX_NAME defined.
 *
 * Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
 * 3", SC 2011): ten rounds of two 32 x 32 -> 64-bit products on a 128-bit
 * counter, the key bumped by the Weyl constants between rounds.  Its four
 * words give eight 16-bit numbers, one for each row of a group of eight. */
static void PHILOX_NAME(uint64_t seed, uint32_t b, uint32_t h, uint32_t g0, int ng, uint64_t s0, int n,
                        uint32_t thr, uint32_t *out) {
    enum { CHUNK = 64 };
    uint16_t u[8 * CHUNK];  /* each (key, group)'s eight numbers, in row order */
    const int shift = ng >= 8 ? 3 : ng >= 4 ? 2 : ng >= 2 ? 1 : 0;  /* ng: 1, 2, 4 or 8 */
    const int total = n << shift;
    const uint32_t k0 = (uint32_t)seed;
    for (int i0 = 0; i0 < total; i0 += CHUNK) {
        const int m = total - i0 < CHUNK ? total - i0 : CHUNK;
        for (int i = 0; i < m; i++) {  /* (key, group) pairs side by side in the vector lanes */
            const uint64_t s = s0 + (uint64_t)((i0 + i) >> shift);
            uint32_t x0 = (uint32_t)s, x1 = g0 + (uint32_t)((i0 + i) & (ng - 1)), x2 = h, x3 = b, a = k0;
            uint32_t c = (uint32_t)(seed >> 32) ^ (uint32_t)(s >> 32);
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
            uint16_t *ui = u + 8 * i;
            ui[0] = (uint16_t)x0, ui[1] = (uint16_t)(x0 >> 16), ui[2] = (uint16_t)x1, ui[3] = (uint16_t)(x1 >> 16);
            ui[4] = (uint16_t)x2, ui[5] = (uint16_t)(x2 >> 16), ui[6] = (uint16_t)x3, ui[7] = (uint16_t)(x3 >> 16);
        }
        uint32_t *o = out + 8 * (int64_t)i0;
        for (int k = 0; k < 8 * m; k++) o[k] = u[k] >= thr ? 0xFFFFFFFFu : 0u;
    }
}
