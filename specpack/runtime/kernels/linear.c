/* Small-M linear layer, y[M,N] = x[M,K] @ W[N,K]^T (+ bias) (+ residual), for AVX2 + FMA (+ F16C).
 * x, y and the sums are fp32; W is stored in one of four formats (the "weight formats" below).
 *
 * Weight layout ("panels"): W is cut into P = ceil(N/16) panels of 16 output columns; panel p is
 * stored K-major, w[p][k][j] = W[16p + j][k], zero-padded past N. One k of a panel is one 64-byte
 * cache line in fp32 (32 bytes in fp16/bf16), and a thread's share of panels is one sequential
 * stream. Weight formats:
 *   SP_F32   float
 *   SP_F16   IEEE half, widened in registers with F16C (vcvtph2ps)
 *   SP_BF16  bfloat16 (the top 16 bits of an fp32), widened by a 16-bit shift
 *   SP_Q8    int8 with one fp32 scale per 32 k and column (llama.cpp's Q8_0 blocks): a panel is
 *            ceil(K/32) blocks of [16 scales (fp32), 32 x 16 int8 (k-major)], 576 bytes each;
 *            W[16p + j][k] ~= scale[b][j] * q[b][k - 32b][j], b = k / 32.
 *
 * Reduction order (the determinism contract): every output element y[i][n] is summed in fixed
 * k-blocks of KB: for each block b, s_b = one fused multiply-add chain from 0 over the block's k;
 * acc = s_0, then acc = acc + s_b in block order; then acc + bias[n]; then residual[i][n] + that.
 * fp16 and bf16 weights are widened exactly to fp32 and go through the same chain, so their result
 * is bit-identical to the fp32 kernel on the widened weights. Int8 uses blocks of 32 (its scale
 * blocks): s_b = the chain over the block's k of x * q, then acc = s_0 * scale_0, then
 * acc = fma(s_b, scale_b, acc). Blocked summation keeps the rounding error growing with KB + K/KB
 * instead of K (on SmolLM2 the logits' largest difference to ONNX Runtime's MLAS fell from 1.0e-4
 * to 5.3e-5 with it). The order does not depend on M, on which rows share a tile, on which thread
 * computes the panel or on how many threads run, so row i of an M-row product is bit-identical to
 * the 1-row product of row i, in every format.
 *
 * Threads: chunks of panels go to the pool (pool.c); a panel is computed the same way on any thread.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define NR SP_PANEL_COLS /* output columns per panel: two ymm registers */
#define MR_MAX 6       /* rows per register tile: 12 accumulators + 2 weights + 1 broadcast */
#define CHUNK_BYTES SP_CHUNK_BYTES

enum { SP_F32 = 0, SP_F16 = 1, SP_BF16 = 2, SP_Q8 = 3, SP_W8A8 = 4 /* w8a8.c */, SP_BF16T = 7 /* bf16_tiles.c */,
       SP_W4A8 = 8, SP_W4A8K = 9, SP_W4A8S = 10 /* w4a8.c */, SP_W6A8 = 11 /* w6a8.c */,
       SP_W5A8S = 12, SP_W5A8K = 13, SP_W5A8 = 14 /* w4a8.c */ };
#define Q8_BLOCK 32                                  /* k per int8 scale block */
#define Q8_BLOCK_BYTES (NR * 4 + Q8_BLOCK * NR)      /* 16 fp32 scales + 32 x 16 int8 = 576 */

/* ---------------------------------------------------------------- compute */

#define KB 128          /* k-block: 8 KB of fp32 panel, stays in L1; the summation's block too */

/* Software prefetch into L2 (T1), `prefetch` cache lines (default 128 = 8 KB) ahead of the k being
 * computed. Measured on the 113 MB fp32 head at M = 8: ratio to M = 1 of 1.06 with T1 against
 * 1.29 with T0 (L1 fill buffers run out) and 1.9 without prefetching, M = 1 alike. The distance
 * is a per-call argument, tuned per machine (kernels/tuning.py); 0 disables. */

/* Prefetch at every PF_EVERY-th k: about once per 64-byte line of the stream. */
#define PF_EVERY(fmt) ((fmt) == SP_F32 ? 1 : (fmt) == SP_Q8 ? 4 : 2)

/* The 16 weights of one k of a panel, widened to fp32 in two registers. */
static inline __attribute__((always_inline)) void load16(const int fmt, const char *w, int64_t k,
                                                         __m256 *w0, __m256 *w1)
{
    if (fmt == SP_F32) {
        const float *wk = (const float *)w + k * NR;
        *w0 = _mm256_loadu_ps(wk);
        *w1 = _mm256_loadu_ps(wk + 8);
    } else if (fmt == SP_F16) {
        const uint16_t *wk = (const uint16_t *)w + k * NR;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wk));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wk + 8)));
    } else if (fmt == SP_BF16) {
        const uint16_t *wk = (const uint16_t *)w + k * NR;
        const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)wk));
        const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wk + 8)));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    } else { /* SP_Q8: w points at the block's int8 rows, k counts within the block. Two 8-byte
              * loads straight into the widening shuffles: one shuffle fewer than a 16-byte load
              * and a split (M = 1 runs ~1.4x faster) */
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k * NR))));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k * NR + 8))));
    }
}

/* Fold one row's block sums (16 columns in c0, c1) into `acc`, which holds the earlier k-blocks'
 * sum (`first`: there are none): acc + s, or for int8 fma(s, scale, acc); then add `bias` (after
 * the last block; or NULL), then `res` (or NULL), and store. */
static inline __attribute__((always_inline)) void finish(
    const int fmt, int first, __m256 c0, __m256 c1, float *acc, const float *scale, const float *bias,
    const float *res)
{
    if (fmt == SP_Q8) {
        const __m256 d0 = _mm256_loadu_ps(scale), d1 = _mm256_loadu_ps(scale + 8);
        c0 = first ? _mm256_mul_ps(c0, d0) : _mm256_fmadd_ps(c0, d0, _mm256_loadu_ps(acc));
        c1 = first ? _mm256_mul_ps(c1, d1) : _mm256_fmadd_ps(c1, d1, _mm256_loadu_ps(acc + 8));
    } else if (!first) {
        c0 = _mm256_add_ps(_mm256_loadu_ps(acc), c0);
        c1 = _mm256_add_ps(_mm256_loadu_ps(acc + 8), c1);
    }
    if (bias) {
        c0 = _mm256_add_ps(c0, _mm256_loadu_ps(bias));
        c1 = _mm256_add_ps(c1, _mm256_loadu_ps(bias + 8));
    }
    if (res) {
        c0 = _mm256_add_ps(_mm256_loadu_ps(res), c0);
        c1 = _mm256_add_ps(_mm256_loadu_ps(res + 8), c1);
    }
    _mm256_storeu_ps(acc, c0);
    _mm256_storeu_ps(acc + 8, c1);
}

/* One register tile: rows x[0..mr) times the panel's 16 columns over k in [k0, k1). The block's
 * products are summed from zero in registers, then folded into `acc` (row stride lda; see
 * `finish`). Named accumulators, not an array: GCC spills arrays of vectors to the stack. */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
static inline __attribute__((always_inline)) void tile(
    const int fmt, const int mr, const int prefetch, const float *x, int64_t ldx, const char *w,
    int64_t k0, int64_t k1, float *acc, int64_t lda, int first, const float *bias, const float *res,
    int64_t ldr, const float *scale, const char *pf, int64_t pfstep)
{
#define DECL(i)                                                                                  \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();                         \
    const float *x##i = x + (mr > i ? i : 0) * ldx;
    ROWS(DECL)
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch && ((k - k0) & (PF_EVERY(fmt) - 1)) == 0) _mm_prefetch(pf + (k - k0) * pfstep, _MM_HINT_T1);
        __m256 w0, w1;
        load16(fmt, w, fmt == SP_Q8 ? k - k0 : k, &w0, &w1);
#define STEP(i)                                                                                  \
        if (mr > i) {                                                                            \
            const __m256 b = _mm256_broadcast_ss(x##i + k);                                      \
            c##i##0 = _mm256_fmadd_ps(b, w0, c##i##0);                                           \
            c##i##1 = _mm256_fmadd_ps(b, w1, c##i##1);                                           \
        }
        ROWS(STEP)
    }
#define STORE(i)                                                                                 \
    if (mr > i) finish(fmt, first, c##i##0, c##i##1, acc + i * lda, scale, bias, res ? res + i * ldr : 0);
    ROWS(STORE)
}

/* A wide tile for one or two rows: `np` consecutive panels at once (mr = 1: 4 panels, mr = 2: 2),
 * so 8 independent FMA chains are in flight where a one-panel tile would have 2 or 4 and wait on
 * the FMA latency. Each output element is summed exactly as `tile` sums it. w[j], acc[j], scale[j]
 * are panel j's; bias and res cover the np * 16 columns. */
#define PANELS(X) X(0) X(1) X(2) X(3)
static inline __attribute__((always_inline)) void wtile(
    const int fmt, const int mr, const int np, const int prefetch, const float *x, int64_t ldx,
    const char *const *w, int64_t k0, int64_t k1, float *acc, int64_t lda, int first,
    const float *bias, const float *res, int64_t ldr, const float *const *scale, const char *const *pf,
    int64_t bpk)
{
#define WDECL(j)                                                                                 \
    __m256 a##j##0 = _mm256_setzero_ps(), a##j##1 = _mm256_setzero_ps();                         \
    __m256 b##j##0 = _mm256_setzero_ps(), b##j##1 = _mm256_setzero_ps();
    PANELS(WDECL)
    const float *x1 = x + (mr > 1 ? ldx : 0);
    for (int64_t k = k0; k < k1; k++) {
        const __m256 u = _mm256_broadcast_ss(x + k), v = _mm256_broadcast_ss(x1 + k);
#define WSTEP(j)                                                                                 \
        if (np > j) {                                                                            \
            if (prefetch && ((k - k0) & (PF_EVERY(fmt) - 1)) == 0)                                \
                _mm_prefetch(pf[j] + (k - k0) * bpk, _MM_HINT_T1);                               \
            __m256 w0, w1;                                                                       \
            load16(fmt, w[j], fmt == SP_Q8 ? k - k0 : k, &w0, &w1);                              \
            a##j##0 = _mm256_fmadd_ps(u, w0, a##j##0);                                           \
            a##j##1 = _mm256_fmadd_ps(u, w1, a##j##1);                                           \
            if (mr > 1) {                                                                        \
                b##j##0 = _mm256_fmadd_ps(v, w0, b##j##0);                                       \
                b##j##1 = _mm256_fmadd_ps(v, w1, b##j##1);                                       \
            }                                                                                    \
        }
        PANELS(WSTEP)
    }
#define WSTORE(j)                                                                                \
    if (np > j) {                                                                                \
        finish(fmt, first, a##j##0, a##j##1, acc + j * NR, scale[j], bias ? bias + j * NR : 0,    \
               res ? res + j * NR : 0);                                                          \
        if (mr > 1)                                                                              \
            finish(fmt, first, b##j##0, b##j##1, acc + lda + j * NR, scale[j],                    \
                   bias ? bias + j * NR : 0, res ? res + ldr + j * NR : 0);                      \
    }
    PANELS(WSTORE)
}

typedef void (*tile_fn)(const float *, int64_t, const char *, int64_t, int64_t, float *, int64_t,
                        int, const float *, const float *, int64_t, const float *, const char *,
                        int64_t);
#define TILE_FN(F, R, PF)                                                                        \
    static void tile##F##_##R##_##PF(const float *x, int64_t ldx, const char *w, int64_t k0,     \
                                     int64_t k1, float *acc, int64_t lda, int first,             \
                                     const float *bias, const float *res, int64_t ldr,           \
                                     const float *scale, const char *pf, int64_t pfstep)         \
    { tile(F, R, PF, x, ldx, w, k0, k1, acc, lda, first, bias, res, ldr, scale, pf, pfstep); }
#define TILES_OF(F)                                                                              \
    TILE_FN(F, 1, 0) TILE_FN(F, 2, 0) TILE_FN(F, 3, 0) TILE_FN(F, 4, 0) TILE_FN(F, 5, 0)          \
    TILE_FN(F, 6, 0) TILE_FN(F, 1, 1) TILE_FN(F, 2, 1) TILE_FN(F, 3, 1) TILE_FN(F, 4, 1)          \
    TILE_FN(F, 5, 1) TILE_FN(F, 6, 1)
TILES_OF(0) TILES_OF(1) TILES_OF(2) TILES_OF(3)
#define TABLE(F)                                                                                 \
    {{0, tile##F##_1_0, tile##F##_2_0, tile##F##_3_0, tile##F##_4_0, tile##F##_5_0, tile##F##_6_0}, \
     {0, tile##F##_1_1, tile##F##_2_1, tile##F##_3_1, tile##F##_4_1, tile##F##_5_1, tile##F##_6_1}}
static const tile_fn TILES[4][2][MR_MAX + 1] = {TABLE(0), TABLE(1), TABLE(2), TABLE(3)};

typedef void (*wtile_fn)(const float *, int64_t, const char *const *, int64_t, int64_t, float *,
                         int64_t, int, const float *, const float *, int64_t, const float *const *,
                         const char *const *, int64_t);
#define WTILE_FN(F, R)                                                                           \
    static void wtile##F##_##R(const float *x, int64_t ldx, const char *const *w, int64_t k0,    \
                               int64_t k1, float *acc, int64_t lda, int first, const float *bias, \
                               const float *res, int64_t ldr, const float *const *scale,          \
                               const char *const *pf, int64_t bpk)                               \
    { wtile(F, R, R == 1 ? 4 : 2, 1, x, ldx, w, k0, k1, acc, lda, first, bias, res, ldr, scale, pf, bpk); }
WTILE_FN(0, 1) WTILE_FN(0, 2) WTILE_FN(1, 1) WTILE_FN(1, 2) WTILE_FN(2, 1) WTILE_FN(2, 2)
WTILE_FN(3, 1) WTILE_FN(3, 2)
static const wtile_fn WTILES[4][3] = {{0, wtile0_1, wtile0_2}, {0, wtile1_1, wtile1_2},
                                      {0, wtile2_1, wtile2_2}, {0, wtile3_1, wtile3_2}};

/* ---------------------------------------------------------------- AVX-512 */

/* The same tiles with one zmm register per row and panel (16 columns) instead of two ymm, for CPUs
 * with AVX-512F (run only where the CPU and OS support it: `isa`). Each output column is one lane
 * and goes through exactly the chain the AVX2 tiles compute (the same fused multiply-adds over the
 * same k, then `finish`'s adds in the same order), so the two give the same bits; what changes is
 * the work per instruction: twice the FMA width, and up to 12 rows a tile (32 registers), which
 * matters where many rows make the product compute-bound (prefill, long drafts, trees). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define MR512_MAX 12

/* Internal formats of a block widened to fp32 once (`pair_rows`), indexed from the block's start:
 * SP_WF for fp16/bf16 (summed as fp32), SP_WQ8 for int8 (still scaled per block when folded). */
enum { SP_WF = 5, SP_WQ8 = 6 };

static inline AVX512 __attribute__((always_inline)) __m512 load16z(const int fmt, const char *w, int64_t k)
{
    if (fmt == SP_F32 || fmt >= SP_WF) return _mm512_loadu_ps((const float *)w + k * NR);
    if (fmt == SP_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * NR)));
    if (fmt == SP_BF16) {
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * NR)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k * NR))));
}

/* `finish` on one zmm: the same operations, lane for lane. */
static inline AVX512 __attribute__((always_inline)) void finishz(
    const int fmt, int first, __m512 c, float *acc, const float *scale, const float *bias, const float *res)
{
    if (fmt == SP_Q8 || fmt == SP_WQ8) {
        const __m512 d = _mm512_loadu_ps(scale);
        c = first ? _mm512_mul_ps(c, d) : _mm512_fmadd_ps(c, d, _mm512_loadu_ps(acc));
    } else if (!first) {
        c = _mm512_add_ps(_mm512_loadu_ps(acc), c);
    }
    if (bias) c = _mm512_add_ps(c, _mm512_loadu_ps(bias));
    if (res) c = _mm512_add_ps(_mm512_loadu_ps(res), c);
    _mm512_storeu_ps(acc, c);
}

#define ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static inline AVX512 __attribute__((always_inline)) void tilez(
    const int fmt, const int mr, const int prefetch, const float *x, int64_t ldx, const char *w,
    int64_t k0, int64_t k1, float *acc, int64_t lda, int first, const float *bias, const float *res,
    int64_t ldr, const float *scale, const char *pf, int64_t pfstep)
{
#define ZDECL(i)                                                                                 \
    __m512 c##i = _mm512_setzero_ps();                                                           \
    const float *x##i = x + (mr > i ? i : 0) * ldx;
    ROWS12(ZDECL)
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch && ((k - k0) & (PF_EVERY(fmt) - 1)) == 0) _mm_prefetch(pf + (k - k0) * pfstep, _MM_HINT_T1);
        const __m512 w0 = load16z(fmt, w, fmt == SP_Q8 ? k - k0 : k);
#define ZSTEP(i)                                                                                 \
        if (mr > i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(x##i[k]), w0, c##i);
        ROWS12(ZSTEP)
    }
#define ZSTORE(i)                                                                                \
    if (mr > i) finishz(fmt, first, c##i, acc + i * lda, scale, bias, res ? res + i * ldr : 0);
    ROWS12(ZSTORE)
}

/* `wtile` for one or two rows over four panels: 4 or 8 independent chains of 16 columns. */
static inline AVX512 __attribute__((always_inline)) void wtilez(
    const int fmt, const int mr, const int prefetch, const float *x, int64_t ldx,
    const char *const *w, int64_t k0, int64_t k1, float *acc, int64_t lda, int first,
    const float *bias, const float *res, int64_t ldr, const float *const *scale, const char *const *pf,
    int64_t bpk)
{
#define WZDECL(j) __m512 a##j = _mm512_setzero_ps(), b##j = _mm512_setzero_ps();
    PANELS(WZDECL)
    const float *x1 = x + (mr > 1 ? ldx : 0);
    for (int64_t k = k0; k < k1; k++) {
        const __m512 u = _mm512_set1_ps(x[k]), v = _mm512_set1_ps(x1[k]);
#define WZSTEP(j)                                                                                \
        if (prefetch && ((k - k0) & (PF_EVERY(fmt) - 1)) == 0)                                    \
            _mm_prefetch(pf[j] + (k - k0) * bpk, _MM_HINT_T1);                                   \
        {                                                                                        \
            const __m512 w0 = load16z(fmt, w[j], fmt == SP_Q8 ? k - k0 : k);                     \
            a##j = _mm512_fmadd_ps(u, w0, a##j);                                                 \
            if (mr > 1) b##j = _mm512_fmadd_ps(v, w0, b##j);                                     \
        }
        PANELS(WZSTEP)
    }
#define WZSTORE(j)                                                                               \
    finishz(fmt, first, a##j, acc + j * NR, scale[j], bias ? bias + j * NR : 0, res ? res + j * NR : 0); \
    if (mr > 1)                                                                                  \
        finishz(fmt, first, b##j, acc + lda + j * NR, scale[j], bias ? bias + j * NR : 0,        \
                res ? res + ldr + j * NR : 0);
    PANELS(WZSTORE)
}

#define ZTILE_FN(F, R, PF)                                                                       \
    static AVX512 void ztile##F##_##R##_##PF(const float *x, int64_t ldx, const char *w, int64_t k0, \
                                             int64_t k1, float *acc, int64_t lda, int first,     \
                                             const float *bias, const float *res, int64_t ldr,   \
                                             const float *scale, const char *pf, int64_t pfstep) \
    { tilez(F, R, PF, x, ldx, w, k0, k1, acc, lda, first, bias, res, ldr, scale, pf, pfstep); }
#define ZTILES_PF(F, PF)                                                                         \
    ZTILE_FN(F, 1, PF) ZTILE_FN(F, 2, PF) ZTILE_FN(F, 3, PF) ZTILE_FN(F, 4, PF) ZTILE_FN(F, 5, PF) \
    ZTILE_FN(F, 6, PF) ZTILE_FN(F, 7, PF) ZTILE_FN(F, 8, PF) ZTILE_FN(F, 9, PF) ZTILE_FN(F, 10, PF) \
    ZTILE_FN(F, 11, PF) ZTILE_FN(F, 12, PF)
ZTILES_PF(0, 0) ZTILES_PF(0, 1) ZTILES_PF(1, 0) ZTILES_PF(1, 1) ZTILES_PF(2, 0) ZTILES_PF(2, 1)
ZTILES_PF(3, 0) ZTILES_PF(3, 1)
#define ZROW(F, PF)                                                                              \
    {0, ztile##F##_1_##PF, ztile##F##_2_##PF, ztile##F##_3_##PF, ztile##F##_4_##PF,              \
     ztile##F##_5_##PF, ztile##F##_6_##PF, ztile##F##_7_##PF, ztile##F##_8_##PF,                 \
     ztile##F##_9_##PF, ztile##F##_10_##PF, ztile##F##_11_##PF, ztile##F##_12_##PF}
static const tile_fn ZTILES[4][2][MR512_MAX + 1] = {{ZROW(0, 0), ZROW(0, 1)}, {ZROW(1, 0), ZROW(1, 1)},
                                                    {ZROW(2, 0), ZROW(2, 1)}, {ZROW(3, 0), ZROW(3, 1)}};
#define WZTILE_FN(F, R)                                                                          \
    static AVX512 void wztile##F##_##R(const float *x, int64_t ldx, const char *const *w, int64_t k0, \
                                       int64_t k1, float *acc, int64_t lda, int first, const float *bias, \
                                       const float *res, int64_t ldr, const float *const *scale,  \
                                       const char *const *pf, int64_t bpk)                       \
    { wtilez(F, R, 1, x, ldx, w, k0, k1, acc, lda, first, bias, res, ldr, scale, pf, bpk); }
WZTILE_FN(0, 1) WZTILE_FN(0, 2) WZTILE_FN(1, 1) WZTILE_FN(1, 2) WZTILE_FN(2, 1) WZTILE_FN(2, 2)
WZTILE_FN(3, 1) WZTILE_FN(3, 2)
static const wtile_fn WZTILES[4][3] = {{0, wztile0_1, wztile0_2}, {0, wztile1_1, wztile1_2},
                                       {0, wztile2_1, wztile2_2}, {0, wztile3_1, wztile3_2}};

/* Two adjacent panels (32 columns) for up to 13 rows: up to 26 accumulators, and per k two weight
 * loads and one broadcast a row for 2 * mr FMAs (the one-panel tile loads one broadcast per FMA,
 * which bounds it by the load ports). Up to 13 rows, one pass over the block: a 9- or 13-row
 * verify (a draft of 8, a tree of 12) costs 2% less than in tiles of 8 (fp32, SmolLM2). Panel b's
 * weights, scales and columns follow panel a's. */
#define ROWS13(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#define MR2_MAX 13
static inline AVX512 __attribute__((always_inline)) void tile2z(
    const int fmt, const int mr, const int prefetch, const float *x, int64_t ldx, const char *wa,
    const char *wb, int64_t k0, int64_t k1, float *acc, int64_t lda, int first, const float *bias,
    const float *res, int64_t ldr, const float *sa, const float *sb, const char *pfa, const char *pfb,
    int64_t pfstep)
{
#define PDECL(i)                                                                                 \
    __m512 c##i##a = _mm512_setzero_ps(), c##i##b = _mm512_setzero_ps();                         \
    const float *x##i = x + (mr > i ? i : 0) * ldx;
    ROWS13(PDECL)
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch && ((k - k0) & (PF_EVERY(fmt) - 1)) == 0) {
            _mm_prefetch(pfa + (k - k0) * pfstep, _MM_HINT_T1);
            _mm_prefetch(pfb + (k - k0) * pfstep, _MM_HINT_T1);
        }
        const int64_t kk = fmt == SP_Q8 || fmt >= SP_WF ? k - k0 : k;
        const __m512 w0 = load16z(fmt, wa, kk), w1 = load16z(fmt, wb, kk);
#define PSTEP(i)                                                                                 \
        if (mr > i) {                                                                            \
            const __m512 u = _mm512_set1_ps(x##i[k]);                                            \
            c##i##a = _mm512_fmadd_ps(u, w0, c##i##a);                                           \
            c##i##b = _mm512_fmadd_ps(u, w1, c##i##b);                                           \
        }
        ROWS13(PSTEP)
    }
#define PSTORE(i)                                                                                \
    if (mr > i) {                                                                                \
        const float *r = res ? res + i * ldr : 0;                                                \
        finishz(fmt, first, c##i##a, acc + i * lda, sa, bias, r);                                \
        finishz(fmt, first, c##i##b, acc + i * lda + NR, sb, bias ? bias + NR : 0, r ? r + NR : 0); \
    }
    ROWS13(PSTORE)
}

typedef void (*tile2_fn)(const float *, int64_t, const char *, const char *, int64_t, int64_t, float *, int64_t,
                         int, const float *, const float *, int64_t, const float *, const float *,
                         const char *, const char *, int64_t);
#define PTILE_FN(F, R, PF)                                                                       \
    static AVX512 void ptile##F##_##R##_##PF(const float *x, int64_t ldx, const char *wa, const char *wb, \
                                             int64_t k0, int64_t k1, float *acc, int64_t lda, int first, \
                                             const float *bias, const float *res, int64_t ldr,   \
                                             const float *sa, const float *sb, const char *pfa,  \
                                             const char *pfb, int64_t pfstep)                    \
    { tile2z(F, R, PF, x, ldx, wa, wb, k0, k1, acc, lda, first, bias, res, ldr, sa, sb, pfa, pfb, pfstep); }
#define PTILES_PF(F, PF)                                                                         \
    PTILE_FN(F, 1, PF) PTILE_FN(F, 2, PF) PTILE_FN(F, 3, PF) PTILE_FN(F, 4, PF) PTILE_FN(F, 5, PF) \
    PTILE_FN(F, 6, PF) PTILE_FN(F, 7, PF) PTILE_FN(F, 8, PF) PTILE_FN(F, 9, PF) PTILE_FN(F, 10, PF) \
    PTILE_FN(F, 11, PF) PTILE_FN(F, 12, PF) PTILE_FN(F, 13, PF)
PTILES_PF(0, 0) PTILES_PF(0, 1) PTILES_PF(1, 0) PTILES_PF(1, 1) PTILES_PF(2, 0) PTILES_PF(2, 1)
PTILES_PF(3, 0) PTILES_PF(3, 1)
#define PROW(F, PF)                                                                              \
    {0, ptile##F##_1_##PF, ptile##F##_2_##PF, ptile##F##_3_##PF, ptile##F##_4_##PF,              \
     ptile##F##_5_##PF, ptile##F##_6_##PF, ptile##F##_7_##PF, ptile##F##_8_##PF,                 \
     ptile##F##_9_##PF, ptile##F##_10_##PF, ptile##F##_11_##PF, ptile##F##_12_##PF, ptile##F##_13_##PF}
static const tile2_fn PTILES[4][2][MR2_MAX + 1] = {{PROW(0, 0), PROW(0, 1)}, {PROW(1, 0), PROW(1, 1)},
                                                   {PROW(2, 0), PROW(2, 1)}, {PROW(3, 0), PROW(3, 1)}};
PTILES_PF(5, 0) PTILES_PF(6, 0)
static const tile2_fn WIDENED[2][MR2_MAX + 1] = {PROW(5, 0), PROW(6, 0)}; /* [int8] */

/* k in [0, n) of a block of format fmt (16-bit: from its first k; int8: the block's values) widened
 * to fp32 in `out` [n][16], exactly as the tiles widen them in registers; the source stream is
 * prefetched `ahead` bytes on as it goes (0: not). */
static AVX512 void widen_block(int fmt, const char *w, int64_t n, float *out, int64_t ahead)
{
    const int64_t bpk = fmt == SP_Q8 ? NR : NR * 2;
    for (int64_t k = 0; k < n; k++) {
        if (ahead && (k & (PF_EVERY(fmt) - 1)) == 0) _mm_prefetch(w + k * bpk + ahead, _MM_HINT_T1);
        _mm512_storeu_ps(out + k * NR, load16z(fmt, w, k));
    }
}

typedef struct {
    const float *x, *bias, *res;
    const char *w;
    float *y;
    int64_t M, N, K, ldx, ldy, ldr, panel_bytes;
    int64_t group; /* panels per work item. 4: slabs of one or two rows go through wide tiles
                    * (`wtile`); 1: every panel alone. Either gives the same bits; which is faster
                    * depends on the machine (tuned at first load, see kernels/tuning.py). */
    int64_t prefetch;
    int fmt;
    int zmm_few, zmm_many; /* AVX-512 tiles for slabs of 1-2 / 3+ rows (`sp_linear`'s isa): the same bits */
} job_t;

/* Whether a slab of ms rows runs the AVX-512 tiles. */
static int zmm_for(const job_t *j, int64_t ms) { return ms >= 3 ? j->zmm_many : j->zmm_few; }

/* Bytes of one k of a panel (the stream rate per k). */
static int64_t k_bytes(int fmt) { return fmt == SP_F32 ? 64 : fmt == SP_Q8 ? Q8_BLOCK_BYTES / Q8_BLOCK : 32; }

int64_t sp_panel_bytes(int fmt, int64_t K)
{
    if (fmt == SP_Q8 || fmt == SP_W8A8) return (K + Q8_BLOCK - 1) / Q8_BLOCK * Q8_BLOCK_BYTES;
    if (fmt == SP_BF16T) return (K + 31) / 32 * 32 * NR * 2;
    return K * NR * (fmt == SP_F32 ? 4 : 2);
}

/* The summation blocks: KB for the float formats, the scale blocks for int8. Tiles run over
 * these blocks (a block of KB k stays in L1 while every tile reuses it). */
static int64_t block_k(int fmt) { return fmt == SP_Q8 ? Q8_BLOCK : KB; }

/* Where block [k0, ..) of a panel starts, and its int8 scales (NULL for the float formats). */
static const char *block_at(int fmt, const char *w, int64_t k0, const float **scale)
{
    if (fmt != SP_Q8) {
        *scale = 0;
        return w;
    }
    const char *blk = w + k0 / Q8_BLOCK * Q8_BLOCK_BYTES;
    *scale = (const float *)blk;
    return blk + NR * 4;
}

/* Rows [m0, m0 + ms) (ms <= 16) times panel p. Rows go in ceil(ms/6) balanced tiles (8 rows: 4 +
 * 4, so each tile keeps >= 8 FMA chains in flight; AVX-512: ceil(ms/12) tiles), over the summation k-blocks: every tile reuses
 * the block from L1, so the panel is read from memory once. */
static void panel_rows(const job_t *j, int64_t p, int64_t m0, int64_t ms, float *scratch)
{
    const int64_t K = j->K, n0 = p * NR, cols = j->N - n0 < NR ? j->N - n0 : NR;
    const char *w = j->w + p * j->panel_bytes;
    const int full = cols == NR;
    const int64_t lda = full ? j->ldy : NR; /* a partial panel goes through scratch [16][16] */
    float bias16[NR] = {0};
    if (j->bias) memcpy(bias16, j->bias + n0, cols * sizeof(float));
    /* the same k-blocks for every M: a row's sums do not depend on how many rows there are */
    const int64_t kb = block_k(j->fmt), nblocks = K > 0 ? (K + kb - 1) / kb : 1;
    const int zmm = zmm_for(j, ms);
    const int64_t mrmax = zmm ? MR512_MAX : MR_MAX;
    const int64_t bpk = k_bytes(j->fmt), ntiles = (ms + mrmax - 1) / mrmax;
    const tile_fn *tiles = zmm ? ZTILES[j->fmt][j->prefetch > 0] : TILES[j->fmt][j->prefetch > 0];
    float *acc = full ? j->y + m0 * j->ldy + n0 : scratch;
    /* the residual goes in at the last block; a partial panel adds it when copying out */
    const float *res = full && j->res ? j->res + m0 * j->ldr + n0 : 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t k0 = b * kb, k1 = k0 + kb < K ? k0 + kb : K;
        const float *scale;
        const char *wb = block_at(j->fmt, w, k0, &scale);
        const int last = k1 == K;
        for (int64_t t = 0, r = 0; t < ntiles; t++) {
            const int64_t mr = (ms - r) / (ntiles - t);
            /* the tiles share prefetching the line `prefetch` ahead of each k of the block, so
             * memory requests flow while any tile computes */
            const char *pf = w + k0 * bpk + j->prefetch * 64 + t * (k1 - k0) * bpk / ntiles;
            tiles[mr](j->x + (m0 + r) * j->ldx, j->ldx, wb, k0, k1,
                acc + r * lda, lda, k0 == 0, last && j->bias ? bias16 : 0,
                last && res ? res + r * j->ldr : 0, j->ldr, scale, pf, (bpk + ntiles - 1) / ntiles);
            r += mr;
        }
    }
    if (!full)
        sp_store_partial(scratch, m0, ms, n0, cols, j->res, j->ldr, j->y, j->ldy);
}

/* Rows [m0, m0 + ms) times the full panels p and p + 1 (AVX-512): as `panel_rows`, in
 * ceil(ms/13) balanced tiles of both panels at once. With three tiles or more, a 16-bit or int8 block
 * is widened to fp32 once (in L1) for all of them instead of in every tile: the same values in the
 * same chains, so the same bits. */
static void pair_rows(const job_t *j, int64_t p, int64_t m0, int64_t ms)
{
    const int64_t K = j->K, n0 = p * NR, kb = block_k(j->fmt), bpk = k_bytes(j->fmt);
    const int64_t nblocks = K > 0 ? (K + kb - 1) / kb : 1, ntiles = (ms + MR2_MAX - 1) / MR2_MAX;
    const char *wa = j->w + p * j->panel_bytes, *wb = wa + j->panel_bytes;
    const int once = j->fmt != SP_F32 && ntiles > 2;
    const tile2_fn *tiles = once ? WIDENED[j->fmt == SP_Q8] : PTILES[j->fmt][j->prefetch > 0];
    float fa[KB * NR] __attribute__((aligned(64))), fb[KB * NR] __attribute__((aligned(64)));
    float *acc = j->y + m0 * j->ldy + n0;
    const float *res = j->res ? j->res + m0 * j->ldr + n0 : 0, *bias = j->bias ? j->bias + n0 : 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t k0 = b * kb, k1 = k0 + kb < K ? k0 + kb : K;
        const float *sa, *sb;
        const char *ba = block_at(j->fmt, wa, k0, &sa), *bb = block_at(j->fmt, wb, k0, &sb);
        const int last = k1 == K;
        if (once) {
            const int64_t from = j->fmt == SP_Q8 ? 0 : k0 * bpk, ahead = j->prefetch * 64;
            widen_block(j->fmt, ba + from, k1 - k0, fa, ahead);
            widen_block(j->fmt, bb + from, k1 - k0, fb, ahead);
            ba = (const char *)fa, bb = (const char *)fb;
        }
        for (int64_t t = 0, r = 0; t < ntiles; t++) {
            const int64_t mr = (ms - r) / (ntiles - t), ahead = j->prefetch * 64 + t * (k1 - k0) * bpk / ntiles;
            tiles[mr](j->x + (m0 + r) * j->ldx, j->ldx, ba, bb, k0, k1, acc + r * j->ldy, j->ldy, k0 == 0,
                      last ? bias : 0, last && res ? res + r * j->ldr : 0, j->ldr, sa, sb,
                      wa + k0 * bpk + ahead, wb + k0 * bpk + ahead, (bpk + ntiles - 1) / ntiles);
            r += mr;
        }
    }
}

/* Rows [m0, m0 + ms) (ms = 1 or 2) times the four full panels from p0, in wide tiles. */
static void wide_rows(const job_t *j, int64_t p0, int64_t m0, int64_t ms)
{
    const int64_t K = j->K, n0 = p0 * NR, kb = block_k(j->fmt), bpk = k_bytes(j->fmt);
    const int64_t nblocks = K > 0 ? (K + kb - 1) / kb : 1;
    float *acc = j->y + m0 * j->ldy + n0;
    const float *res = j->res ? j->res + m0 * j->ldr + n0 : 0, *bias = j->bias ? j->bias + n0 : 0;
    const float *x = j->x + m0 * j->ldx;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t k0 = b * kb, k1 = k0 + kb < K ? k0 + kb : K;
        const char *w[4], *pf[4];
        const float *scale[4];
        for (int q = 0; q < 4; q++) {
            const char *wp = j->w + (p0 + q) * j->panel_bytes;
            w[q] = block_at(j->fmt, wp, k0, &scale[q]);
            pf[q] = wp + k0 * bpk + j->prefetch * 64;
        }
        const int last = k1 == K;
        const float *bl = last ? bias : 0, *rl = last ? res : 0;
        if (zmm_for(j, ms)) {
            WZTILES[j->fmt][ms](x, j->ldx, w, k0, k1, acc, j->ldy, k0 == 0, bl, rl, j->ldr, scale, pf, bpk);
        } else if (ms == 1) {
            WTILES[j->fmt][1](x, j->ldx, w, k0, k1, acc, j->ldy, k0 == 0, bl, rl, j->ldr, scale, pf, bpk);
        } else {
            WTILES[j->fmt][2](x, j->ldx, w, k0, k1, acc, j->ldy, k0 == 0, bl, rl, j->ldr, scale, pf, bpk);
            WTILES[j->fmt][2](x, j->ldx, w + 2, k0, k1, acc + 2 * NR, j->ldy, k0 == 0,
                              bl ? bl + 2 * NR : 0, rl ? rl + 2 * NR : 0, j->ldr, scale + 2, pf + 2, bpk);
        }
    }
}

/* Work item g: panels [g * group, (g + 1) * group), every row, in slabs of 16 rows (so scratch
 * stays small). */
static void panel_group(const void *job, int64_t g, float *scratch)
{
    const job_t *j = job;
    const int64_t P = (j->N + NR - 1) / NR, p0 = g * j->group;
    const int64_t p1 = p0 + j->group < P ? p0 + j->group : P;
    const int wide = j->group == 4 && p1 - p0 == 4 && p1 * NR <= j->N;
    if (j->zmm_many && j->M > 16) { /* many rows: each full pair over all of them, its blocks widened once */
        for (int64_t p = p0; p < p1; p++) {
            if (p + 1 < p1 && (p + 2) * NR <= j->N) {
                pair_rows(j, p++, 0, j->M);
                continue;
            }
            for (int64_t m0 = 0; m0 < j->M; m0 += 16)
                panel_rows(j, p, m0, j->M - m0 < 16 ? j->M - m0 : 16, scratch);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < j->M; m0 += 16) {
        const int64_t ms = j->M - m0 < 16 ? j->M - m0 : 16;
        if (wide && ms <= 2)
            wide_rows(j, p0, m0, ms);
        else
            for (int64_t p = p0; p < p1; p++) {
                /* panels go in pairs (a broadcast feeds two FMAs), fp32 at any row count, the other
                 * formats from 3 rows (SmolLM2's layers at 4 and 9 rows: 6-10% faster at fp16, bf16
                 * and int8 than one panel a tile, which widens once per k for up to 12 rows) */
                if (zmm_for(j, ms) && (j->fmt == SP_F32 || ms >= 3) && p + 1 < p1 && (p + 2) * NR <= j->N) {
                    pair_rows(j, p, m0, ms);
                    p++;
                } else {
                    panel_rows(j, p, m0, ms, scratch);
                }
            }
    }
}

/* ---------------------------------------------------------------- API */

int sp_abi_version(void) { return 5; }


/* y[M,N] (row stride ldy) = res + (x[M,K] (row stride ldx) @ W^T + bias), W packed as above in
 * format `fmt`; bias (N) and res (row stride ldr) may be NULL. y must not overlap x or res.
 * `group` (1 or 4 panels per work item), `prefetch` (lines ahead) and `isa` change speed only. isa
 * bit 0: slabs of 1-2 rows run AVX-512 tiles, bit 1: slabs of 3+ rows do (where the CPU has
 * AVX-512; else AVX2): streaming one row and computing many can prefer different sets. */
void sp_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int fmt, int64_t N,
               const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads,
               int group, int prefetch, int isa)
{
    if (M <= 0 || N <= 0) return;
    if (fmt == SP_W8A8) { /* int8 activations too: its own kernel */
        sp_linear_w8a8(x, M, K, ldx, w, N, bias, res, ldr, y, ldy, nthreads, prefetch, isa);
        return;
    }
    if (fmt == SP_W6A8) { /* 6-bit weights (Q6_K), int8 activations */
        sp_linear_w6a8(x, M, K, ldx, w, N, bias, res, ldr, y, ldy, nthreads, isa);
        return;
    }
    if ((fmt >= SP_W4A8 && fmt <= SP_W4A8S) || (fmt >= SP_W5A8S && fmt <= SP_W5A8)) { /* 4/5-bit weights */
        sp_linear_w4a8(x, M, K, ldx, w, N, bias, res, ldr, y, ldy, nthreads, isa,
                       fmt >= SP_W5A8S ? fmt - SP_W5A8S + 3 : fmt - SP_W4A8);
        return;
    }
    if (fmt == SP_BF16T) { /* bf16 on AMX tiles: its own kernel and reduction order */
        sp_linear_bf16t(x, M, K, ldx, w, N, bias, res, ldr, y, ldy, nthreads);
        return;
    }
    if (fmt < SP_F32 || fmt > SP_Q8) return;
    const int64_t pb = sp_panel_bytes(fmt, K);
    const int few = (isa & 1) && sp_avx512(), many = (isa & 2) && sp_avx512();
    /* AVX-512 takes panels at least in pairs (pair_rows) */
    const int64_t G = group == 4 ? 4 : few || many ? 2 : 1, P = (N + NR - 1) / NR;
    const job_t job = {x, bias, res, w, y, M, N, K, ldx, ldy, ldr, pb > 0 ? pb : 0, G,
                       prefetch > 0 ? prefetch : 0, fmt, few, many};
    const int64_t chunk = CHUNK_BYTES / ((pb > 0 ? pb : NR * 4) * G);
    sp_parallel(panel_group, &job, (P + G - 1) / G, chunk, nthreads);
}
