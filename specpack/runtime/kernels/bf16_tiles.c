/* bf16 weights on Intel AMX tiles (weight format SP_BF16T, "bf16-amx"; sp_linear hands it here).
 *
 * Sixteen rows cost about what one does: a TDPBF16PS multiplies up to 16 rows by a 32-k block of a
 * panel in ~16 cycles, where the vector kernels (linear.c) spend one FMA per row, k and 16 columns.
 * On SmolLM2 at bf16 the vector kernels take ~1.5x as long for 9 rows as for one; these tiles ~1.05x.
 *
 * Weights: panels of 16 output columns; a panel is ceil(K/32) blocks of 1 KB, each 16 k-pairs x 16
 * columns x 2 (column j's weights for k = 2i and 2i + 1 side by side: AMX's pair layout), bf16 rounded
 * to nearest, zero past N and K.
 *
 * Activations: each fp32 x is split in two bf16, hi = bf16(x) and lo = bf16(x - hi) (both rounded to
 * nearest; x - hi is exact), so hi + lo carries 16 significant bits of x (relative error <= 2^-17,
 * far below the bf16 weights' own 2^-9); stored block-major, [B][M][32] each, zero past K.
 *
 * Reduction order (the determinism contract): per row and column, s = 0; for each block b in order,
 * s = TDPBF16PS(s, hi_b, w_b), then s = TDPBF16PS(s, lo_b, w_b); then s + bias; then residual + that.
 * Each tile element is computed from its own row and column only, so row i of an M-row product is
 * bit-identical to the 1-row product of row i, on any thread count. The bits are not linear.c's bf16
 * kernel's (that one sums exact fp32 products of unsplit x): a model runs one or the other for every
 * row count (kernels/linear.py chooses at pack time), never both.
 *
 * fp16 weights stay on the vector kernel: the tiles multiply bf16 only, and splitting each fp16 block
 * into two bf16 blocks as it is read (three tile products per block) made SmolLM2's layers slower at
 * one row (14.0-15.3 ms against 11.3-11.5) and no faster at nine (15.0-16.3 against 15.3-15.7). */
#pragma GCC optimize("fp-contract=off")
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define NR 16                     /* output columns per panel */
#define KT 32                     /* k per block: 16 pairs, one tile row of 64 bytes */
#define BLOCK_BYTES (KT * NR * 2) /* 1 KB */
/* Blocks ahead each panel's stream is prefetched (into L1). SmolLM2's decoder layers at bf16, 2 threads,
 * 1 / 9 / 16 rows: none 10.5 / 10.9 / 12.1 ms, one block 10.2 / 10.5 / 11.0, two 9.6 / 10.2 / 11.1, three
 * 9.7 / 10.3 / 11.1 (into L2 instead: 9.9 / 11.2 / 12.5 at two blocks); the vector kernel 10.6 / 13.6 / 19.1. */
#define PF_BLOCKS 2

typedef struct {
    const uint16_t *hi, *lo; /* [B][M][32] the rows' two bf16 parts */
    const char *w;
    const float *bias, *res;
    float *y;
    int64_t M, N, B, ldy, ldr;
} tjob_t;

#ifndef SP_AMX
int sp_bf16_tiles(void) { return 0; }
void sp_linear_bf16t(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads)
{
    (void)x, (void)K, (void)ldx, (void)w, (void)bias, (void)res, (void)ldr, (void)nthreads;
    for (int64_t i = 0; i < M; i++)
        for (int64_t n = 0; n < N; n++) y[i * ldy + n] = NAN;
}
#else
#define TILES __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

/* Whether this CPU and OS run the tiles: AMX-BF16 and AVX512-BF16 (the splitting), and the permission. */
int sp_bf16_tiles(void)
{
    static int ok = -1;
    if (ok < 0) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        ok = sp_avx512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1)  /* AMX-BF16 */
             && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 >> 5 & 1)           /* AVX512-BF16 */
             && sp_amx_permit();
    }
    return ok;
}

/* Tiles: 0 and 1 a block of the rows' hi and lo parts (A), 2 and 3 weight blocks (B, alternating),
 * 4-7 the sums of up to four panels (C). */
static void config(int rows)
{
    sp_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    cfg.rows[2] = cfg.rows[3] = KT / 2;
    sp_amx_load(&cfg, 16 + rows); /* keys 17-32 (w8a8.c: 1-16) */
}

/* Rows [m0, m0 + ms) (ms <= 16) times np (1, 2 or 4) adjacent panels from `w` into out[np * 16] per
 * row (row stride ldo); then bias (or NULL) and residual (or NULL; row stride: the job's ldr) added. */
static inline TILES __attribute__((always_inline)) void panels(
    const int np, const tjob_t *j, const char *w, int64_t m0, int64_t ms, float *out, int64_t ldo,
    const float *bias, const float *res)
{
    const int64_t pb = j->B * BLOCK_BYTES;
    config((int)ms);
    _tile_zero(4);
    if (np > 1) _tile_zero(5);
    if (np > 2) { _tile_zero(6); _tile_zero(7); }
    for (int64_t b = 0; b < j->B; b++) {
        const char *wb = w + b * BLOCK_BYTES;
        for (int q = 0; q < np; q++) /* a tile load waits for its lines: ask for them early */
            for (int l = 0; l < BLOCK_BYTES / 64; l++) _mm_prefetch(wb + q * pb + PF_BLOCKS * BLOCK_BYTES + l * 64, _MM_HINT_T0);
        _tile_loadd(0, j->hi + (b * j->M + m0) * KT, KT * 2);
        _tile_loadd(1, j->lo + (b * j->M + m0) * KT, KT * 2);
        _tile_loadd(2, wb, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(4, 1, 2);
        if (np > 1) { _tile_loadd(3, wb + pb, 64); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(5, 1, 3); }
        if (np > 2) {
            _tile_loadd(2, wb + 2 * pb, 64); _tile_dpbf16ps(6, 0, 2); _tile_dpbf16ps(6, 1, 2);
            _tile_loadd(3, wb + 3 * pb, 64); _tile_dpbf16ps(7, 0, 3); _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, out, ldo * 4);
    if (np > 1) _tile_stored(5, out + NR, ldo * 4);
    if (np > 2) { _tile_stored(6, out + 2 * NR, ldo * 4); _tile_stored(7, out + 3 * NR, ldo * 4); }
    SP_TILE_FENCE();
    if (!bias && !res) return;
    for (int64_t i = 0; i < ms; i++)
        for (int q = 0; q < np; q++) {
            float *o = out + i * ldo + q * NR;
            __m512 v = _mm512_loadu_ps(o);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + q * NR));
            if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + i * j->ldr + q * NR), v);
            _mm512_storeu_ps(o, v);
        }
}

static TILES void slab_tiles(const tjob_t *j, const char *w, int np, int64_t m0, int64_t ms, float *out,
                             int64_t ldo, const float *bias, const float *res)
{
    if (np == 4) panels(4, j, w, m0, ms, out, ldo, bias, res);
    else if (np == 2) panels(2, j, w, m0, ms, out, ldo, bias, res);
    else panels(1, j, w, m0, ms, out, ldo, bias, res);
}

/* Rows [m0, m0 + ms) times panels [p, p + np): full panels straight into y, a partial last one
 * (np = 1) through scratch [16][16]. */
static void slab(const void *job, int64_t p, int np, int64_t m0, int64_t ms, float *scratch)
{
    const tjob_t *j = job;
    const int64_t n0 = p * NR, cols = j->N - n0 < NR * np ? j->N - n0 : NR * np;
    const int full = cols == NR * np;
    float bias[4 * NR] = {0};
    if (j->bias) memcpy(bias, j->bias + n0, cols * sizeof(float));
    slab_tiles(j, j->w + p * j->B * BLOCK_BYTES, np, m0, ms, full ? j->y + m0 * j->ldy + n0 : scratch,
               full ? j->ldy : NR, j->bias ? bias : 0, full && j->res ? j->res + m0 * j->ldr + n0 : 0);
    if (!full)
        sp_store_partial(scratch, m0, ms, n0, cols, j->res, j->ldr, j->y, j->ldy);
}

/* Row x's 16 values from `x` (n of them; zeros past) split into hi and lo (see the top). */
static inline TILES void split16(const float *x, int64_t n, uint16_t *hi, uint16_t *lo)
{
    const __mmask16 m = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_storeu_si256((__m256i *)hi, (__m256i)h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hv)));
}

static TILES void split_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t B, uint16_t *hi, uint16_t *lo)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < B; b++) {
            const int64_t at = (b * M + i) * KT, k0 = b * KT;
            split16(x + i * ldx + k0, K - k0, hi + at, lo + at);
            split16(x + i * ldx + k0 + 16, K - k0 - 16, hi + at + 16, lo + at + 16);
        }
}

void sp_linear_bf16t(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads)
{
    const int64_t B = (K + KT - 1) / KT;
    if (B == 0) { /* no k: the sums are empty */
        sp_empty_product(M, N, bias, res, ldr, y, ldy);
        return;
    }
    uint16_t *mem = sp_bf16_tiles() ? sp_rows_memory(2 * M * B * KT * 2) : 0;
    if (!mem) { /* no tiles (the format is packed only where they run) or no memory: NaNs, never stale */
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) y[i * ldy + n] = NAN;
        return;
    }
    split_rows(x, M, K, ldx, B, mem, mem + M * B * KT);
    const tjob_t job = {mem, mem + M * B * KT, w, bias, res, y, M, N, B, ldy, ldr};
    sp_parallel_slabs(slab, &job, M, N, 4 * B * BLOCK_BYTES, nthreads);
}
#endif
