/* 4- and 5-bit weights times int8 activations (weight formats w4a8, w4a8k, w4a8s, w5a8s, w5a8k, w5a8): llama.cpp's
 * Q4_1 blocks (Q4_K's 32-value sub-blocks in w4a8k, Q4_0's in w4a8s; Q5_0, Q5_K and Q5_1 in the 5-bit three)
 * kept quantized, multiplied as llama.cpp's vec_dot_q4_1_q8_1 does (integer dot products, one float fold per block),
 * with AVX-512 VNNI where the CPU has it, else AVX2. sp_linear (linear.c) hands fmt SP_W4A8 here.
 *
 * Weights: per panel of 16 columns and block of 32 k (every GGUF block of a column is one block here),
 * 320 bytes: the 16 columns' scales d (fp16), their offsets m (fp16: Q4_1's m, Q4_0's -8 d), then the 32 x 16
 * values u (0..15) as nibbles in VNNI order (w4a8k: d and m in fp32, 384 bytes: Q4_K's d * sc_j and
 * -dmin * m_j, exact in fp32, not in fp16; w4a8s: d alone, 288 bytes, a value d (u - 8): Q4_0's 4.5 bits;
 * w5a8k: w4a8k's layout plus the plane below, 448 bytes (Q5_K's sub-blocks); w5a8: w4a8's plus the plane, 384
 * bytes (Q5_1); w5a8s: d alone, then after the nibbles the values' fifth bits, a 64-bit mask a group of 4 k (bit L: lane L =
 * 4j + i, column j, k 4g + i; one kmov and one masked add on AVX-512), 352 bytes, a value d (u - 16): Q5_0's
 * 5.5 bits): region r (0..3) is 64 bytes, its byte 4j + i holding column j's
 * value at k = 8r + i in the low nibble and at k = 8r + 4 + i in the high one, so masking a region gives one
 * group of 4 k x 16 columns (as w8a8.c stores bytes) and shifting it the next. A value is d u + m.
 *
 * Activations: w8a8.c's (sp_block_rows): per block d_a = amax / 127, q = round-half-even(x / d_a), and
 * the block's sum of q, from which s_a = d_a * (float)sum (llama.cpp's Q8_1 `s`, here in fp32).
 *
 * Reduction order (the determinism contract): per row, block and column the integer sum
 * t_b = sum over the block's k of u * q is exact (at most 32 * 15 * 127), g_b = float(t_b) * d_a,
 * acc = g_0 * d_0 then acc = fma(g_b, d_b, acc) for b > 0, and after each block acc = fma(m_b, s_a, acc)
 * (w4a8s: t_b = sum of u * q - 8 * sum of q, still exact, and no m term: llama.cpp's Q4_0 x Q8_0 dot;
 * w5a8s likewise with 16);
 * then acc + bias, then residual + that. A row's quantization and sums involve that row only, so row i of
 * an M-row product is bit-identical to the 1-row product of row i on any thread count, and the AVX2
 * tiles give the bits of the VNNI ones (linear.py's `w4a8_linear` is the same arithmetic in torch). */
#pragma GCC optimize("fp-contract=off") /* every multiply and add as written, on both paths */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NR 16                          /* output columns per panel */
#define QB 32                          /* k per block */
#define QG (QB / 4)                    /* groups of 4 k per block */
/* the layouts: fp16 d and m, fp32 d and m, fp16 d alone (offset 8), fp16 d alone and a bit plane (offset 16) */
/* ... and the 5-bit ones, each its 4-bit layout plus the plane: w5a8s (Q5_0), w5a8k (Q5_K), w5a8 (Q5_1) */
enum { W4 = 0, W4K = 1, W4S = 2, W5S = 3, W5K = 4, W5 = 5 };
#define WIDE(kind) ((kind) == W4K || (kind) == W5K)                            /* fp32 d and m */
#define FIFTH(kind) ((kind) >= W5S)                                            /* a plane of fifth bits */
#define SCALE_BYTES(kind) (WIDE(kind) ? NR * 8 : SYMMETRIC(kind) ? NR * 2 : NR * 4) /* of 16 columns */
#define PLANE_BYTES(kind) (FIFTH(kind) ? QB * NR / 8 : 0)
#define BLOCK_BYTES(kind) (SCALE_BYTES(kind) + QB * NR / 2 + PLANE_BYTES(kind)) /* 320 384 288 352 448 384 */
#define SYMMETRIC(kind) ((kind) == W4S || (kind) == W5S)                     /* no m: an integer offset */
#define OFFSET_SHIFT(kind) ((kind) == W5S ? 3 : 4) /* the offset (8 or 16) times sum(q) is c >> this */

typedef struct {
    const int8_t *q;  /* [B][M][QB] the quantized rows, block-major */
    const float *d;   /* [B][M] their scales */
    const float *s;   /* [B][M] d_a * sum(q) */
    const int32_t *c; /* [B][M] 128 * sum(q) (w4a8s: its offset, 8 * sum(q), is c / 16) */
    const char *w;
    const float *bias, *res;
    float *y;
    int64_t M, N, B, ldy, ldr;
    int vnni_few, vnni_many; /* VNNI tiles for slabs of 1-2 / 3+ rows (sp_linear's isa bits) */
    int kind;                /* W4 ... W5 */
} wjob_t;

/* ---------------------------------------------------------------- AVX2 */

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define MR2 4

/* Rows [m0, m0 + mr) times the panel at `w`: per group, the 8 columns' four u (unsigned) times the row's
 * four q (signed) by vpmaddubsw (pairs of at most 2 * 15 * 127: no saturation), summed to 32 bits. */
static inline AVX2 __attribute__((always_inline)) __m256 scales8(const int wide, const char *at, int i)
{ /* the i-th group of 8 fp16 (wide: fp32) values from `at` */
    return wide ? _mm256_loadu_ps((const float *)at + 8 * i) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at + i));
}

/* Group g's fifth bits for the 32 lanes of half h (columns 8h..8h+7), from its 64-bit mask at `pl`, as 16 or 0. */
static inline AVX2 __attribute__((always_inline)) __m256i fifth_avx2(const char *pl, int h)
{
    const __m256i word = _mm256_set1_epi32(*(const int32_t *)(pl + 4 * h));
    const __m256i spread = _mm256_shuffle_epi8(word, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

static inline AVX2 __attribute__((always_inline)) void wtile_avx2(
    const int kind, const int mr, const wjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, const float *bias,
    const float *res, int64_t ldr)
{
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256 f[MR2][2];
    for (int64_t b = 0; b < j->B; b++) {
        const char *blk = w + b * BLOCK_BYTES(kind);
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        __m256i s[MR2][2];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int r = 0; r < QG / 2; r++) {
            const char *wr = blk + SCALE_BYTES(kind) + r * 64;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)wr), v1 = _mm256_loadu_si256((const __m256i *)(wr + 32));
            __m256i a0 = _mm256_and_si256(v0, low), a1 = _mm256_and_si256(v1, low);
            __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            if (FIFTH(kind)) {
                const char *pl = blk + SCALE_BYTES(kind) + QB * NR / 2 + r * 16;
                a0 = _mm256_or_si256(a0, fifth_avx2(pl, 0)), a1 = _mm256_or_si256(a1, fifth_avx2(pl, 1));
                b0 = _mm256_or_si256(b0, fifth_avx2(pl + 8, 0)), b1 = _mm256_or_si256(b1, fifth_avx2(pl + 8, 1));
            }
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                const __m256i xa = _mm256_set1_epi32(xq[i * QG + 2 * r]), xb = _mm256_set1_epi32(xq[i * QG + 2 * r + 1]);
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(a0, xa), _mm256_maddubs_epi16(b0, xb));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(a1, xa), _mm256_maddubs_epi16(b1, xb));
                s[i][0] = _mm256_add_epi32(s[i][0], _mm256_madd_epi16(p0, ones));
                s[i][1] = _mm256_add_epi32(s[i][1], _mm256_madd_epi16(p1, ones));
            }
        }
        const int wide = WIDE(kind);
        const char *at_m = blk + SCALE_BYTES(kind) / 2;
        const __m256 d0 = scales8(wide, blk, 0), d1 = scales8(wide, blk, 1);
        const __m256 n0 = SYMMETRIC(kind) ? d0 : scales8(wide, at_m, 0);
        const __m256 n1 = SYMMETRIC(kind) ? d1 : scales8(wide, at_m, 1);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_set1_ps(j->d[b * j->M + m0 + i]), sa = _mm256_set1_ps(j->s[b * j->M + m0 + i]);
            if (SYMMETRIC(kind)) { /* the offset (8 or 16) in integers */
                const __m256i o = _mm256_set1_epi32(j->c[b * j->M + m0 + i] >> OFFSET_SHIFT(kind));
                s[i][0] = _mm256_sub_epi32(s[i][0], o);
                s[i][1] = _mm256_sub_epi32(s[i][1], o);
            }
            const __m256 g0 = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][0]), a);
            const __m256 g1 = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][1]), a);
            f[i][0] = b == 0 ? _mm256_mul_ps(g0, d0) : _mm256_fmadd_ps(g0, d0, f[i][0]);
            f[i][1] = b == 0 ? _mm256_mul_ps(g1, d1) : _mm256_fmadd_ps(g1, d1, f[i][1]);
            if (!SYMMETRIC(kind)) {
                f[i][0] = _mm256_fmadd_ps(n0, sa, f[i][0]);
                f[i][1] = _mm256_fmadd_ps(n1, sa, f[i][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) {
            __m256 v = f[i][h];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + i * ldr + 8 * h), v);
            _mm256_storeu_ps(out + i * ldo + 8 * h, v);
        }
}

typedef void (*wtile_fn)(const wjob_t *, const char *, int64_t, float *, int64_t, const float *, const float *, int64_t);
#define WTILE2(W, R)                                                                               \
    static AVX2 void wtile2_##W##_##R(const wjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, \
                                      const float *bias, const float *res, int64_t ldr)            \
    { wtile_avx2(W, R, j, w, m0, out, ldo, bias, res, ldr); }
WTILE2(0, 1) WTILE2(0, 2) WTILE2(0, 3) WTILE2(0, 4) WTILE2(1, 1) WTILE2(1, 2) WTILE2(1, 3) WTILE2(1, 4)
WTILE2(2, 1) WTILE2(2, 2) WTILE2(2, 3) WTILE2(2, 4) WTILE2(3, 1) WTILE2(3, 2) WTILE2(3, 3) WTILE2(3, 4)
WTILE2(4, 1) WTILE2(4, 2) WTILE2(4, 3) WTILE2(4, 4) WTILE2(5, 1) WTILE2(5, 2) WTILE2(5, 3) WTILE2(5, 4)
static const wtile_fn WTILES2[6][MR2 + 1] = {{0, wtile2_0_1, wtile2_0_2, wtile2_0_3, wtile2_0_4},
                                             {0, wtile2_1_1, wtile2_1_2, wtile2_1_3, wtile2_1_4},
                                             {0, wtile2_2_1, wtile2_2_2, wtile2_2_3, wtile2_2_4},
                                             {0, wtile2_3_1, wtile2_3_2, wtile2_3_3, wtile2_3_4},
                                             {0, wtile2_4_1, wtile2_4_2, wtile2_4_3, wtile2_4_4},
                                             {0, wtile2_5_1, wtile2_5_2, wtile2_5_3, wtile2_5_4}};

/* ---------------------------------------------------------------- AVX-512 VNNI */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define MRZ(np) ((np) == 4 ? 1 : (np) == 2 ? 4 : 6) /* rows a tile holds: 2 x mr x np accumulators <= 16 */
/* Blocks ahead that a tile of two or more rows prefetches its panels' weights: their integer dots keep the
 * load ports and the out-of-order window busy enough that the hardware prefetcher falls behind and each
 * region's load stalls (perf annotate: the samples on the instructions after the loads). 32 blocks, about 10
 * KiB a panel: SmolLM2's Q4_1 layers over 4 rows 5.09 -> 4.65 ms, 9 rows 7.53 -> 6.87 (EPYC, one run A/B);
 * a one-row tile streams at the memory's speed without it and runs ~10% slower with it. */
#define PREFETCH_BLOCKS(mr) ((mr) >= 2 ? 32 : 0)
#define SPLIT(mr, np) ((mr) * (np) < 4) /* low and high nibbles summed apart */

/* Rows [m0, m0 + mr) times np (1, 2 or 4) adjacent panels from `w` (panel stride pb): one vpdpbusd per
 * group, row and panel; the sums in registers throughout. A tile of fewer than four (row, panel) pairs
 * sums the low and high nibbles' groups apart (two dependency chains, added per block: the same integers),
 * a larger one has chains enough and keeps one sum a pair, which leaves the registers for four rows of two
 * panels: a verify forward's rows then share one unpacking of the nibbles. */
static inline VNNI __attribute__((always_inline)) __m512 scales16(const int wide, const char *at)
{ /* 16 fp16 (wide: fp32) values from `at` */
    return wide ? _mm512_loadu_ps(at) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
}

/* v plus 16 in the lanes whose bit is set in group g's 64-bit mask at `pl`. */
static inline VNNI __attribute__((always_inline)) __m512i fifth_z(__m512i v, const char *pl)
{
    return _mm512_mask_add_epi8(v, _load_mask64((__mmask64 *)pl), v, _mm512_set1_epi8(16));
}

static inline VNNI __attribute__((always_inline)) void wtile_z(
    const int kind, const int np, const int mr, const wjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo,
    const float *bias, const float *res, int64_t ldr)
{
    const int64_t pb = j->B * BLOCK_BYTES(kind);
    const int wide = WIDE(kind);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f[6][4];
    for (int64_t b = 0; b < j->B; b++) {
        const char *blk = w + b * BLOCK_BYTES(kind);
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        __m512i s[6][4], t[6][4];
        if (PREFETCH_BLOCKS(mr))
#pragma GCC unroll 4
            for (int q = 0; q < np; q++)
                for (int l = 0; l < BLOCK_BYTES(kind); l += 64)
                    _mm_prefetch(blk + q * pb + PREFETCH_BLOCKS(mr) * BLOCK_BYTES(kind) + l, _MM_HINT_T0);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
            for (int q = 0; q < np; q++) s[i][q] = t[i][q] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int r = 0; r < QG / 2; r++) {
            __m512i lo[4], hi[4];
#pragma GCC unroll 4
            for (int q = 0; q < np; q++) {
                const __m512i v = _mm512_loadu_si512(blk + q * pb + SCALE_BYTES(kind) + r * 64);
                lo[q] = _mm512_and_si512(v, low);
                hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (FIFTH(kind)) {
                    const char *pl = blk + q * pb + SCALE_BYTES(kind) + QB * NR / 2 + r * 16;
                    lo[q] = fifth_z(lo[q], pl);
                    hi[q] = fifth_z(hi[q], pl + 8);
                }
            }
#pragma GCC unroll 6
            for (int i = 0; i < mr; i++) {
                const __m512i xa = _mm512_set1_epi32(xq[i * QG + 2 * r]), xb = _mm512_set1_epi32(xq[i * QG + 2 * r + 1]);
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    s[i][q] = _mm512_dpbusd_epi32(s[i][q], lo[q], xa);
                    if (SPLIT(mr, np))
                        t[i][q] = _mm512_dpbusd_epi32(t[i][q], hi[q], xb);
                    else
                        s[i][q] = _mm512_dpbusd_epi32(s[i][q], hi[q], xb);
                }
            }
        }
#pragma GCC unroll 4
        for (int q = 0; q < np; q++) {
            const __m512 d = scales16(wide, blk + q * pb);
            const __m512 n = SYMMETRIC(kind) ? d : scales16(wide, blk + q * pb + SCALE_BYTES(kind) / 2);
#pragma GCC unroll 6
            for (int i = 0; i < mr; i++) {
                __m512i sum = SPLIT(mr, np) ? _mm512_add_epi32(s[i][q], t[i][q]) : s[i][q];
                if (SYMMETRIC(kind)) /* the offset (8 or 16) in integers */
                    sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(j->c[b * j->M + m0 + i] >> OFFSET_SHIFT(kind)));
                const __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(j->d[b * j->M + m0 + i]));
                const __m512 acc = b == 0 ? _mm512_mul_ps(g, d) : _mm512_fmadd_ps(g, d, f[i][q]);
                f[i][q] = SYMMETRIC(kind) ? acc : _mm512_fmadd_ps(n, _mm512_set1_ps(j->s[b * j->M + m0 + i]), acc);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int q = 0; q < np; q++) {
            __m512 v = f[i][q];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + q * NR));
            if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + i * ldr + q * NR), v);
            _mm512_storeu_ps(out + i * ldo + q * NR, v);
        }
}

#define WTILEZ(W, NP, R)                                                                             \
    static VNNI void wtilez##W##_##NP##_##R(const wjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, \
                                            const float *bias, const float *res, int64_t ldr)        \
    { wtile_z(W, NP, R, j, w, m0, out, ldo, bias, res, ldr); }
#define WTILESZ_OF(W)                                                                                \
    WTILEZ(W, 1, 1) WTILEZ(W, 1, 2) WTILEZ(W, 1, 3) WTILEZ(W, 1, 4) WTILEZ(W, 1, 5) WTILEZ(W, 1, 6)    \
    WTILEZ(W, 2, 1) WTILEZ(W, 2, 2) WTILEZ(W, 2, 3) WTILEZ(W, 2, 4) WTILEZ(W, 4, 1)
WTILESZ_OF(0) WTILESZ_OF(1) WTILESZ_OF(2) WTILESZ_OF(3) WTILESZ_OF(4) WTILESZ_OF(5)
#define WTABLE(W) {{0}, {0, wtilez##W##_1_1, wtilez##W##_1_2, wtilez##W##_1_3, wtilez##W##_1_4, wtilez##W##_1_5,  \
                         wtilez##W##_1_6}, {0, wtilez##W##_2_1, wtilez##W##_2_2, wtilez##W##_2_3, wtilez##W##_2_4}, {0}, \
                 {0, wtilez##W##_4_1}}
static const wtile_fn WTILESZ[6][5][7] = {WTABLE(0), WTABLE(1), WTABLE(2), WTABLE(3), WTABLE(4), WTABLE(5)};

/* ---------------------------------------------------------------- driver */

/* Rows [m0, m0 + ms) times panels [p, p + np) (np 1, 2 or 4): full panels straight into y, a partial last
 * one through scratch [16][16]. Tiles of np <= 2 panels; rows split evenly over the fewest tiles. */
static void slab(const void *job, int64_t p, int np, int64_t m0, int64_t ms, float *scratch)
{
    const wjob_t *j = job;
    if (np == 4 && (ms > 1 || !j->vnni_few)) { /* four panels at once: one row on VNNI only */
        slab(job, p, 2, m0, ms, scratch);
        slab(job, p + 2, 2, m0, ms, scratch);
        return;
    }
    const int64_t n0 = p * NR, cols = j->N - n0 < NR * np ? j->N - n0 : NR * np;
    const int full = cols == NR * np;
    float *out = full ? j->y + m0 * j->ldy + n0 : scratch;
    const int64_t ldo = full ? j->ldy : NR;
    const float *res = full && j->res ? j->res + m0 * j->ldr + n0 : 0;
    float bias[4 * NR] = {0};
    if (j->bias) memcpy(bias, j->bias + n0, cols * sizeof(float));
    const int64_t pb = j->B * BLOCK_BYTES(j->kind);
    if (ms >= 3 ? j->vnni_many : j->vnni_few) {
        const int64_t ntiles = (ms + MRZ(np) - 1) / MRZ(np);
        for (int64_t t = 0, r = 0; t < ntiles; t++) {
            const int64_t mr = (ms - r) / (ntiles - t);
            WTILESZ[j->kind][np][mr](j, j->w + p * pb, m0 + r, out + r * ldo, ldo, j->bias ? bias : 0,
                            res ? res + r * j->ldr : 0, j->ldr);
            r += mr;
        }
    } else {
        for (int q = 0; q < np; q++) {
            const int64_t ntiles = (ms + MR2 - 1) / MR2;
            for (int64_t t = 0, r = 0; t < ntiles; t++) {
                const int64_t mr = (ms - r) / (ntiles - t);
                WTILES2[j->kind][mr](j, j->w + (p + q) * pb, m0 + r, out + r * ldo + q * NR, ldo, j->bias ? bias + q * NR : 0,
                            res ? res + r * j->ldr + q * NR : 0, j->ldr);
                r += mr;
            }
        }
    }
    if (!full)
        sp_store_partial(scratch, m0, ms, n0, cols, j->res, j->ldr, j->y, j->ldy);
}

void sp_linear_w4a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N, const float *bias,
                    const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads, int isa, int kind)
{
    sp_rows_t r;
    if (kind < W4 || kind > W5 || !sp_block_rows(x, M, K, ldx, N, bias, res, ldr, y, ldy, isa, sizeof(float), &r))
        return;
    float *s = r.extra; /* d_a * sum(q) per row and block */
    for (int64_t i = 0; i < M * r.B; i++) s[i] = r.d[i] * (float)(r.c[i] / 128);
    const wjob_t job = {r.q, r.d, s, r.c, w, bias, res, y, M, N, r.B, ldy, ldr, (isa & 1) && sp_vnni(),
                        (isa & 2) && sp_vnni(), kind};
    sp_parallel_slabs(slab, &job, M, N, 4 * r.B * BLOCK_BYTES(kind), nthreads);
}
