/* Small-M fp32 linear layer, y[M,N] = x[M,K] @ W[N,K]^T (+ bias), for AVX2 + FMA.
 *
 * Weight layout ("panels"): W is cut into P = ceil(N/16) panels of 16 output columns; panel p is
 * stored K-major, w[p][k][j] = W[16p + j][k], zero-padded past N. One k of a panel is one 64-byte
 * cache line, and a thread's share of panels is one sequential stream.
 *
 * Reduction order (the determinism contract): every output element y[i][n] is summed in fixed
 * k-blocks of KB: for each block b, s_b = one fused multiply-add chain from 0 over the block's k;
 * acc = s_0, then acc = acc + s_b in block order; then acc + bias[n]. Blocked summation keeps the
 * rounding error growing with KB + K/KB instead of K (on SmolLM2 the logits' largest difference to
 * ONNX Runtime's MLAS fell from 1.0e-4 to 5.3e-5 with it). The order does not depend on M, on which rows share a tile, on which
 * thread computes the panel or on how many threads run, so row i of an M-row product is
 * bit-identical to the 1-row product of row i.
 *
 * Threads: chunks of panels go to the pool (pool.c); a panel is computed the same way on any thread.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NR 16          /* output columns per panel: two ymm registers */
#define MR_MAX 6       /* rows per register tile: 12 accumulators + 2 weights + 1 broadcast */
#define CHUNK_BYTES (128 * 1024) /* of weights: ~10 us of work, the most a caller waits for */

/* ---------------------------------------------------------------- compute */

#define KB 128          /* k-block: 8 KB of panel, stays in L1; the summation's block too */

/* Software prefetch into L2 (T1), 128 lines = 8 KB ahead of the k being computed. Measured on
 * the 113 MB head at M = 8: ratio to M = 1 of 1.06 with T1 against 1.29 with T0 (L1 fill buffers
 * run out) and 1.9 without prefetching, M = 1 alike. */
static int prefetch_dist = 128; /* cache lines (= k steps) ahead; 0 disables */

/* One register tile: rows x[0..mr) times the panel's 16 columns over k in [k0, k1). The block's
 * products are summed from zero in registers, then added to `acc` (row stride lda), which holds
 * the sum of the earlier k-blocks (`first`: there are none); `bias` (16 floats, or NULL) is added
 * after the last block. Named accumulators, not an array: GCC spills arrays of vectors to the
 * stack. */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
static inline __attribute__((always_inline)) void tile(
    const int mr, const int prefetch, const float *x, int64_t ldx, const float *w, int64_t k0,
    int64_t k1, float *acc, int64_t lda, int first, const float *bias, const char *pf, int64_t pfstep)
{
#define DECL(i)                                                                                  \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();                         \
    const float *x##i = x + (mr > i ? i : 0) * ldx;
    ROWS(DECL)
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * NR;
        if (prefetch) _mm_prefetch(pf + (k - k0) * pfstep, _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#define STEP(i)                                                                                  \
        if (mr > i) {                                                                            \
            const __m256 b = _mm256_broadcast_ss(x##i + k);                                      \
            c##i##0 = _mm256_fmadd_ps(b, w0, c##i##0);                                           \
            c##i##1 = _mm256_fmadd_ps(b, w1, c##i##1);                                           \
        }
        ROWS(STEP)
    }
#define STORE(i)                                                                                 \
    if (mr > i) {                                                                                \
        if (!first) {                                                                            \
            c##i##0 = _mm256_add_ps(_mm256_loadu_ps(acc + i * lda), c##i##0);                    \
            c##i##1 = _mm256_add_ps(_mm256_loadu_ps(acc + i * lda + 8), c##i##1);                \
        }                                                                                        \
        if (bias) {                                                                              \
            c##i##0 = _mm256_add_ps(c##i##0, _mm256_loadu_ps(bias));                             \
            c##i##1 = _mm256_add_ps(c##i##1, _mm256_loadu_ps(bias + 8));                         \
        }                                                                                        \
        _mm256_storeu_ps(acc + i * lda, c##i##0);                                                \
        _mm256_storeu_ps(acc + i * lda + 8, c##i##1);                                            \
    }
    ROWS(STORE)
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                        int, const float *, const char *, int64_t);
#define TILE_FN(R, PF)                                                                           \
    static void tile##R##_##PF(const float *x, int64_t ldx, const float *w, int64_t k0,          \
                               int64_t k1, float *acc, int64_t lda, int first, const float *bias, \
                               const char *pf, int64_t pfstep)                                   \
    { tile(R, PF, x, ldx, w, k0, k1, acc, lda, first, bias, pf, pfstep); }
TILE_FN(1, 0) TILE_FN(2, 0) TILE_FN(3, 0) TILE_FN(4, 0) TILE_FN(5, 0) TILE_FN(6, 0)
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1) TILE_FN(5, 1) TILE_FN(6, 1)
static const tile_fn TILES[2][MR_MAX + 1] = {
    {0, tile1_0, tile2_0, tile3_0, tile4_0, tile5_0, tile6_0},
    {0, tile1_1, tile2_1, tile3_1, tile4_1, tile5_1, tile6_1},
};

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t M, N, K, ldx, ldy;
} job_t;

/* All M rows times one panel. Rows go in ceil(M/6) balanced tiles (8 rows: 4 + 4, so each tile
 * keeps >= 8 FMA chains in flight), over k-blocks of KB: every tile reuses the block from L1, so
 * the panel is read from memory once. */
static void panel(const void *job, int64_t p, float *scratch)
{
    const job_t *j = job;
    const int64_t K = j->K, n0 = p * NR, cols = j->N - n0 < NR ? j->N - n0 : NR;
    const float *w = j->w + p * K * NR;
    const int full = cols == NR;
    const int64_t lda = full ? j->ldy : NR; /* a partial panel goes through scratch [16][16] */
    float bias16[NR] = {0};
    if (j->bias) memcpy(bias16, j->bias + n0, cols * sizeof(float));
    /* the same k-blocks for every M: a row's sums do not depend on how many rows there are */
    const int64_t kb = KB, nblocks = K > 0 ? (K + kb - 1) / kb : 1;
    for (int64_t m0 = 0; m0 < j->M; m0 += 16) { /* rows in slabs of 16 so scratch stays small */
        const int64_t ms = j->M - m0 < 16 ? j->M - m0 : 16;
        const int64_t ntiles = (ms + MR_MAX - 1) / MR_MAX;
        float *acc = full ? j->y + m0 * j->ldy + n0 : scratch;
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t k0 = b * kb, k1 = k0 + kb < K ? k0 + kb : K;
            for (int64_t t = 0, r = 0; t < ntiles; t++) {
                const int64_t mr = (ms - r) / (ntiles - t);
                /* the tiles share prefetching the line `prefetch_dist` ahead of each k of the
                 * block, so memory requests flow while any tile computes */
                const char *pf = (const char *)(w + k0 * NR) + prefetch_dist * 64
                                 + t * (k1 - k0) * 64 / ntiles;
                TILES[prefetch_dist > 0][mr](j->x + (m0 + r) * j->ldx, j->ldx, w, k0, k1,
                    acc + r * lda, lda, k0 == 0, k1 == K && j->bias ? bias16 : 0, pf,
                    (64 + ntiles - 1) / ntiles);
                r += mr;
            }
        }
        if (!full)
            for (int64_t i = m0; i < m0 + ms; i++)
                memcpy(j->y + i * j->ldy + n0, scratch + (i - m0) * NR, cols * sizeof(float));
    }
}

/* ---------------------------------------------------------------- API */

int sp_abi_version(void) { return 2; }

void sp_set_prefetch(int lines) { prefetch_dist = lines; }

/* y[M,N] (row stride ldy) = x[M,K] (row stride ldx) @ W^T + bias, W packed as above. */
void sp_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N,
               const float *bias, float *y, int64_t ldy, int nthreads)
{
    if (M <= 0 || N <= 0) return;
    const job_t job = {x, w, bias, y, M, N, K, ldx, ldy};
    const int64_t chunk = CHUNK_BYTES / ((K > 0 ? K : 1) * NR * 4);
    sp_parallel(panel, &job, (N + NR - 1) / NR, chunk, nthreads);
}
