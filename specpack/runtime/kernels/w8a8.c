/* Int8 weights times int8 activations (weight format SP_W8A8, "w8a8"): llama.cpp's Q8_0 x Q8_0 dot
 * products, with AVX-512 VNNI where the CPU has it (and AMX tiles for slabs of 3+ rows where it has
 * those too), else AVX2. sp_linear (linear.c) hands fmt SP_W8A8 here.
 *
 * Weights: the Q8_0 blocks of SP_Q8 (one fp32 scale per 32 k and column, amax / 127), the values
 * stored as q + 128 (unsigned) in VNNI order: a panel is ceil(K/32) blocks of [16 scales (fp32),
 * 8 groups of 4 k x 16 columns], each group 64 bytes with column j's four k at bytes 4j..4j+3, so
 * one vpdpbusd multiplies a group by four activations and sums them into each column's lane.
 *
 * Activations: each row is quantized per block of 32 k before the product, on the caller's thread,
 * block-major (block b's rows side by side, so a tile reads its rows at fixed offsets from one pointer):
 * d = amax / 127, q = round-half-even(x * (1 / d)) (0 where d is 0), and c = 128 * sum(q), the
 * product of the weights' +128 offset with the block (subtracted from the integer sum).
 *
 * Reduction order (the determinism contract): per row, block and column the integer sum
 * s_b = sum over the block's k of (w + 128) * q - c is exact whatever order adds it (at most
 * 32 * 255 * 127 in magnitude), then f_b = float(s_b) * d_b; acc = f_0 * scale_0, then
 * acc = fma(f_b, scale_b, acc) in block order; then acc + bias, then residual + that. A row's
 * quantization and sums involve that row only, so row i of an M-row product is bit-identical to
 * the 1-row product of row i, on any thread count, and the AVX2 tiles (CPUs without VNNI) give the
 * same bits as the VNNI tiles. */
#pragma GCC optimize("fp-contract=off") /* every multiply and add as written, on both paths */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define NR 16                         /* output columns per panel */
#define QB 32                         /* k per block (one weight scale, one activation scale) */
#define QG (QB / 4)                   /* groups of 4 k per block */
#define BLOCK_BYTES (NR * 4 + QB * NR) /* 16 fp32 scales + 32 x 16 bytes = 576 */

typedef struct {
    const int8_t *q;     /* [B][M][QB] the quantized rows, block-major */
    const float *d;      /* [B][M] their scales */
    const int32_t *c;    /* [B][M] 128 * sum(q) per block */
    const char *w;
    const float *bias, *res;
    float *y;
    int64_t M, N, B, ldy, ldr, prefetch;
    int vnni_few, vnni_many; /* VNNI tiles for slabs of 1-2 / 3+ rows (sp_linear's isa bits) */
    int amx;                 /* slabs of 3+ rows through AMX tiles (`amx_panels`) */
} qjob_t;

/* ---------------------------------------------------------------- activations */

/* One block's scale and values: the contract's arithmetic, one element at a time. */
static void quantize_block(const float *xb, int64_t n, int8_t *qb, float *d, int32_t *c)
{
    float amax = 0.0f;
    for (int64_t k = 0; k < n; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
    const float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int64_t k = 0; k < QB; k++) {
        float v = k < n ? nearbyintf(xb[k] * inv) : 0.0f; /* the default mode: half to even */
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        qb[k] = (int8_t)v;
        sum += qb[k];
    }
    *d = db;
    *c = 128 * sum;
}

/* The same with AVX-512 (the same operations per element: a product, rounding half to even). */
static __attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_block_z(
    const float *xb, int64_t n, int8_t *qb, float *d, int32_t *c)
{
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(m0, xb), b = _mm512_maskz_loadu_ps(m1, xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))), lo), hi);
    const __m512i qc = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))), lo), hi);
    _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(qc));
    *d = db;
    *c = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
}

/* x [M, K] (row stride ldx) -> q [B][M][32], d and c [B][M]. `fast`: AVX-512 (the same bits). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t B, int8_t *q, float *d,
                          int32_t *c, int fast)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < B; b++) {
            const int64_t n = K - b * QB < QB ? K - b * QB : QB;
            (fast ? quantize_block_z : quantize_block)(x + i * ldx + b * QB, n, q + (b * M + i) * QB, d + b * M + i,
                                                       c + b * M + i);
        }
}

/* The Euclidean norms of row x [K] as this file rounds it (x') and of its rounding error (x - x'), in
 * double: what the greedy screen (screen.c) bounds the w8a8 product's distance from x's with. */
void sp_w8a8_norms(const float *x, int64_t K, double *hat, double *err)
{
    double h = 0.0, e = 0.0;
    for (int64_t k0 = 0; k0 < K; k0 += QB) {
        const int64_t n = K - k0 < QB ? K - k0 : QB;
        int8_t q[QB];
        float d;
        int32_t c;
        quantize_block(x + k0, n, q, &d, &c);
        for (int64_t k = 0; k < n; k++) {
            const double v = (double)q[k] * d; /* exact: 8 bits times 24 */
            h += v * v;
            e += (x[k0 + k] - v) * (x[k0 + k] - v);
        }
    }
    *hat = sqrt(h);
    *err = sqrt(e);
}

/* ---------------------------------------------------------------- AVX2 */

#define AVX2 __attribute__((target("avx2,fma")))
#define MR2 4 /* rows an AVX2 tile holds: 2 x mr integer sums, the float ones spilled once per block */

/* s + the four products of one group and column per lane: |x| times w with x's sign. */
static inline AVX2 __attribute__((always_inline)) __m256i dot_avx2(__m256i s, __m256i w, __m256i x, __m256i ax,
                                                                   __m256i ones)
{
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), ones));
}

/* Rows [m0, m0 + mr) times the panel at `w` with AVX2 (CPUs without VNNI), llama.cpp's way: per
 * group, the weights back to signed (xor 0x80), each given the sign of its activation, times the
 * activation's magnitude (vpmaddubsw: pairs of at most 127 * 127 * 2, no saturation), summed to
 * 32 bits (vpmaddwd by ones). That is the integer sum s_b of the contract exactly (the +128 offset
 * and c never enter), folded as the VNNI tiles fold it: the same bits. 16 columns to out per row,
 * bias and (res != NULL) residual added. */
static inline AVX2 __attribute__((always_inline)) void qtile_avx2(
    const int mr, const qjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, const float *bias,
    const float *res, int64_t ldr)
{
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 f[MR2][2];
    for (int64_t b = 0; b < j->B; b++) {
        const char *blk = w + b * BLOCK_BYTES;
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        const float *xd = j->d + b * j->M + m0;
        __m256i s[MR2][2];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < QG; g++) {
            const char *wg = blk + NR * 4 + g * 64;
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wg), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + 32)), flip);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                const __m256i x = _mm256_set1_epi32(xq[i * QG + g]), ax = _mm256_sign_epi8(x, x);
                s[i][0] = dot_avx2(s[i][0], w0, x, ax, ones);
                s[i][1] = dot_avx2(s[i][1], w1, x, ax, ones);
            }
        }
        const __m256 d0 = _mm256_loadu_ps((const float *)blk), d1 = _mm256_loadu_ps((const float *)blk + 8);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_set1_ps(xd[i]);
            const __m256 g0 = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][0]), a);
            const __m256 g1 = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][1]), a);
            f[i][0] = b == 0 ? _mm256_mul_ps(g0, d0) : _mm256_fmadd_ps(g0, d0, f[i][0]);
            f[i][1] = b == 0 ? _mm256_mul_ps(g1, d1) : _mm256_fmadd_ps(g1, d1, f[i][1]);
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

typedef void (*ytile_fn)(const qjob_t *, const char *, int64_t, float *, int64_t, const float *, const float *,
                          int64_t);
#define YTILE_FN(R)                                                                              \
    static AVX2 void ytile_##R(const qjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, \
                                const float *bias, const float *res, int64_t ldr)                \
    { qtile_avx2(R, j, w, m0, out, ldo, bias, res, ldr); }
YTILE_FN(1) YTILE_FN(2) YTILE_FN(3) YTILE_FN(4)
static const ytile_fn YTILES[MR2 + 1] = {0, ytile_1, ytile_2, ytile_3, ytile_4};

/* Rows [m0, m0 + ms) times panel p with the AVX2 tiles, in tiles of at most MR2 rows. */
static void panel_avx2(const qjob_t *j, int64_t p, int64_t m0, int64_t ms, float *out, int64_t ldo,
                       const float *bias, const float *res)
{
    const char *w = j->w + p * j->B * BLOCK_BYTES;
    const int64_t ntiles = (ms + MR2 - 1) / MR2;
    for (int64_t t = 0, r = 0; t < ntiles; t++) {
        const int64_t mr = (ms - r) / (ntiles - t);
        YTILES[mr](j, w, m0 + r, out + r * ldo, ldo, bias, res ? res + r * j->ldr : 0, j->ldr);
        r += mr;
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define CELLS(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3) /* row i's four panels */
#define MR_OF(np) ((np) == 4 ? 3 : 6) /* rows a tile holds: mr x np int and float accumulators <= 24 */

/* Rows [m0, m0 + mr) times np (1, 2 or 4) adjacent panels from `w` over every block, each row's
 * sums in registers throughout (an integer sum per block, folded into a float one); results (bias
 * and residual added) to out[np * 16] per row (row stride ldo; res likewise with ldr, NULL: none).
 * `pf`: prefetch this many bytes ahead of the weights read (0: none), for the panels whose bit is set
 * in `pfmask`. */
static inline VNNI __attribute__((always_inline)) void qtile(
    const int np, const int mr, const qjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo,
    const float *bias, const float *res, int64_t ldr, int64_t pf, int pfmask)
{
    const int64_t B = j->B, pb = B * BLOCK_BYTES;
#define FDECL(i, q) __m512 f##i##q = _mm512_setzero_ps(); __m512i s##i##q = _mm512_setzero_si512();
#define QDECL(i) CELLS(FDECL, i)
    ROWS6(QDECL)
    for (int64_t b = 0; b < B; b++) {
        const char *blk = w + b * BLOCK_BYTES;
        /* this block's rows m0.. at fixed offsets from one pointer: few general registers, so the
         * unrolled groups below keep every accumulator and weight in registers (9 rows: 4-7% faster
         * than rows apart, each with its own pointer) */
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        const float *xd = j->d + b * j->M + m0;
        const int32_t *xc = j->c + b * j->M + m0;
        if (pf)
            for (int q = 0; q < np; q++)
                if (pfmask >> q & 1)
                    for (int64_t l = 0; l < BLOCK_BYTES; l += 64) _mm_prefetch(blk + q * pb + pf + l, _MM_HINT_T1);
#define SINIT(i, q) if (np > q) s##i##q = c##i;
#define QINIT(i)                                                                                 \
        if (mr > i) {                                                                            \
            const __m512i c##i = _mm512_set1_epi32(-xc[i]);                                      \
            CELLS(SINIT, i)                                                                      \
        }
        ROWS6(QINIT)
#pragma GCC unroll 8
        for (int g = 0; g < QG; g++) {
            const char *wg = blk + NR * 4 + g * 64;
            const __m512i u0 = _mm512_loadu_si512(wg);
            const __m512i u1 = np > 1 ? _mm512_loadu_si512(wg + pb) : u0;
            const __m512i u2 = np > 2 ? _mm512_loadu_si512(wg + 2 * pb) : u0;
            const __m512i u3 = np > 3 ? _mm512_loadu_si512(wg + 3 * pb) : u0;
#define DOT(i, q) if (np > q) s##i##q = _mm512_dpbusd_epi32(s##i##q, u##q, x);
#define QSTEP(i)                                                                                 \
            if (mr > i) {                                                                        \
                const __m512i x = _mm512_set1_epi32(xq[i * QG + g]);                                    \
                CELLS(DOT, i)                                                                    \
            }
            ROWS6(QSTEP)
        }
        const __m512 d0 = _mm512_loadu_ps((const float *)blk);
        const __m512 d1 = np > 1 ? _mm512_loadu_ps((const float *)(blk + pb)) : d0;
        const __m512 d2 = np > 2 ? _mm512_loadu_ps((const float *)(blk + 2 * pb)) : d0;
        const __m512 d3 = np > 3 ? _mm512_loadu_ps((const float *)(blk + 3 * pb)) : d0;
#define FOLD(i, q)                                                                               \
        if (np > q) {                                                                            \
            const __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(s##i##q), a);                      \
            f##i##q = b == 0 ? _mm512_mul_ps(g, d##q) : _mm512_fmadd_ps(g, d##q, f##i##q);       \
        }
#define QFOLD(i)                                                                                 \
        if (mr > i) {                                                                            \
            const __m512 a = _mm512_set1_ps(xd[i]);                                 \
            CELLS(FOLD, i)                                                                       \
        }
        ROWS6(QFOLD)
    }
#define STORE(i, q)                                                                              \
    if (np > q) {                                                                                \
        __m512 v = f##i##q;                                                                      \
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + q * NR));                          \
        if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + i * ldr + q * NR), v);                  \
        _mm512_storeu_ps(out + i * ldo + q * NR, v);                                             \
    }
#define QSTORE(i) if (mr > i) { CELLS(STORE, i) }
    ROWS6(QSTORE)
}

typedef void (*qtile_fn)(const qjob_t *, const char *, int64_t, float *, int64_t, const float *, const float *,
                         int64_t, int64_t, int);
#define QTILE_FN(NP, R)                                                                          \
    static VNNI void qtile##NP##_##R(const qjob_t *j, const char *w, int64_t m0, float *out, int64_t ldo, \
                                     const float *bias, const float *res, int64_t ldr, int64_t pf, int pfmask) \
    { qtile(NP, R, j, w, m0, out, ldo, bias, res, ldr, pf, pfmask); }
QTILE_FN(1, 1) QTILE_FN(1, 2) QTILE_FN(1, 3) QTILE_FN(1, 4) QTILE_FN(1, 5) QTILE_FN(1, 6)
QTILE_FN(2, 1) QTILE_FN(2, 2) QTILE_FN(2, 3) QTILE_FN(2, 4) QTILE_FN(2, 5) QTILE_FN(2, 6)
QTILE_FN(4, 1) QTILE_FN(4, 2) QTILE_FN(4, 3)
static const qtile_fn QTILES[5][7] = {
    {0}, {0, qtile1_1, qtile1_2, qtile1_3, qtile1_4, qtile1_5, qtile1_6},
    {0, qtile2_1, qtile2_2, qtile2_3, qtile2_4, qtile2_5, qtile2_6}, {0}, {0, qtile4_1, qtile4_2, qtile4_3}};

static int vnni_ok(void)
{
    static int ok = -1;
    if (ok < 0) ok = sp_avx512() && __builtin_cpu_supports("avx512vnni");
    return ok;
}

int sp_vnni(void) { return vnni_ok(); }

/* ---------------------------------------------------------------- AMX */

/* Intel AMX (Sapphire Rapids and later): one TDPBSUD multiplies a block's int8 activations of up to
 * 16 rows (tile A: rows x 32 bytes, exactly the quantized rows' block-major layout) by a block of a
 * panel's weights (tile B: 8 x 64 bytes, exactly the VNNI order panels are stored in) into 16 x 16
 * int32 sums: the contract's integer sums plus c, exact, so subtracting c and folding as the VNNI
 * tiles fold gives the same bits. The permission and the per-thread configuration (for the slab's
 * row count) are amx.c's. SPECPACK_AMX=0, or sp_w8a8_amx(0), keeps the VNNI tiles. */
static int amx_on = 1;
void sp_w8a8_amx(int on) { amx_on = on; }

#ifndef SP_AMX
static int amx_ok(void) { return 0; }
int sp_amx(void) { return 0; }
static void amx_slab(const qjob_t *j, const char *w, int np, int64_t m0, int64_t ms, float *out, int64_t ldo,
                     const float *bias, const float *res)
{
    (void)j, (void)w, (void)np, (void)m0, (void)ms, (void)out, (void)ldo, (void)bias, (void)res;
}
#else
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma")))

static int amx_ok(void)
{
    static int ok = -1;
    if (ok < 0) {
        unsigned a, b, c, d;
        ok = vnni_ok() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1) /* AMX-INT8 */
             && sp_amx_permit();
    }
    return ok;
}

int sp_amx(void) { return amx_ok(); }

/* Tiles: 0 the rows' activations of a block (A), 1 and 2 weight blocks (B, alternating), 3-6 the
 * int32 sums of up to four panels (C). */
static void amx_config(int rows)
{
    sp_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)rows, cfg.colsb[0] = QB;
    for (int t = 1; t <= 2; t++) cfg.rows[t] = QG, cfg.colsb[t] = 64;
    for (int t = 3; t <= 6; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = NR * 4;
    sp_amx_load(&cfg, rows); /* keys 1-16 (bf16_tiles.c: 17-32) */
}

/* Rows [m0, m0 + ms) (3 <= ms <= 16) times np (1, 2 or 4) adjacent panels from `w`: block b's
 * integer products on the tiles while block b - 1's sums (stored a step earlier, so not waited for)
 * are folded as the VNNI tiles fold them; results, bias and (res != NULL) residual added, to
 * out[np * 16] per row (row stride ldo; res likewise with the job's ldr). */
static inline AMX __attribute__((always_inline)) void amx_panels(
    const int np, const qjob_t *j, const char *w, int64_t m0, int64_t ms, float *out, int64_t ldo,
    const float *bias, const float *res)
{
    const int64_t pb = j->B * BLOCK_BYTES;
    int32_t sums[2][4][16 * NR] __attribute__((aligned(64)));
    float f[4][16 * NR] __attribute__((aligned(64)));
    amx_config((int)ms);
    for (int64_t b = 0; b <= j->B; b++) {
        if (b < j->B) {
            const char *wb = w + b * BLOCK_BYTES + NR * 4;
            int32_t (*s)[16 * NR] = sums[b & 1];
            _tile_loadd(0, j->q + (b * j->M + m0) * QB, QB);
            _tile_zero(3);
            _tile_loadd(1, wb, 64);
            _tile_dpbsud(3, 0, 1);
            if (np > 1) { _tile_zero(4); _tile_loadd(2, wb + pb, 64); _tile_dpbsud(4, 0, 2); }
            if (np > 2) { _tile_zero(5); _tile_loadd(1, wb + 2 * pb, 64); _tile_dpbsud(5, 0, 1); }
            if (np > 3) { _tile_zero(6); _tile_loadd(2, wb + 3 * pb, 64); _tile_dpbsud(6, 0, 2); }
            _tile_stored(3, s[0], NR * 4);
            if (np > 1) _tile_stored(4, s[1], NR * 4);
            if (np > 2) _tile_stored(5, s[2], NR * 4);
            if (np > 3) _tile_stored(6, s[3], NR * 4);
            SP_TILE_FENCE();
        }
        if (b == 0) continue;
        const int64_t bp = b - 1, at = bp * j->M + m0;
        for (int q = 0; q < np; q++) {
            const __m512 dw = _mm512_loadu_ps((const float *)(w + q * pb + bp * BLOCK_BYTES));
            const int32_t *sq = sums[bp & 1][q];
            float *fq = f[q];
            for (int64_t i = 0; i < ms; i++) {
                const __m512i si = _mm512_sub_epi32(_mm512_load_si512(sq + i * NR), _mm512_set1_epi32(j->c[at + i]));
                const __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_set1_ps(j->d[at + i]));
                _mm512_store_ps(fq + i * NR, bp == 0 ? _mm512_mul_ps(g, dw) : _mm512_fmadd_ps(g, dw, _mm512_load_ps(fq + i * NR)));
            }
        }
    }
    for (int q = 0; q < np; q++)
        for (int64_t i = 0; i < ms; i++) {
            __m512 v = _mm512_load_ps(f[q] + i * NR);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + q * NR));
            if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + i * j->ldr + q * NR), v);
            _mm512_storeu_ps(out + i * ldo + q * NR, v);
        }
}

static AMX void amx_slab(const qjob_t *j, const char *w, int np, int64_t m0, int64_t ms, float *out, int64_t ldo,
                         const float *bias, const float *res)
{
    if (np == 4) amx_panels(4, j, w, m0, ms, out, ldo, bias, res);
    else if (np == 2) amx_panels(2, j, w, m0, ms, out, ldo, bias, res);
    else amx_panels(1, j, w, m0, ms, out, ldo, bias, res);
}
#endif

/* ---------------------------------------------------------------- driver */

/* Rows [m0, m0 + ms) (ms <= 16) times panels [p, p + np): full panels straight into y, a partial
 * last one through scratch [16][16]. */
/* Lines ahead that a lone tile of two or more rows prefetches at least, whatever the tuned distance (measured at
 * one and nine rows, one row weighing double: it often picks none): the dots of several rows keep the hardware
 * prefetcher behind, as in w4a8.c. SmolLM2's 49152 x 576 head over 4 rows, quiet Zen 4, tuned 0 -> 256 lines:
 * 1.40 -> 1.02 ms (one row 1.0 ms either way). */
#define ROWS_PREFETCH 256

static void slab(const void *job, int64_t p, int np, int64_t m0, int64_t ms, float *scratch)
{
    const qjob_t *j = job;
    if (np == 4 && ms > MR_OF(4) && !j->amx && j->vnni_many) {
        /* more rows than one 4-panel tile holds: panels in pairs, tiles of up to 6 rows, so each weight
         * is read from cache by ceil(ms / 6) tiles instead of ceil(ms / 3) (the products' 120 layers of
         * SmolLM2 at 6 / 9 / 16 rows, Zen 4: 3-12% faster); the same sums in the same order */
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
    if (ms >= 3 && j->amx) {
        amx_slab(j, j->w + p * j->B * BLOCK_BYTES, np, m0, ms, out, ldo, j->bias ? bias : 0, res);
    } else if (!(ms >= 3 ? j->vnni_many : j->vnni_few)) {
        for (int q = 0; q < np; q++) /* a partial panel's residual is added below, as for the tiles */
            panel_avx2(j, p + q, m0, ms, out + q * NR, ldo, j->bias ? bias + q * NR : 0, res ? res + q * NR : 0);
    } else {
        const int64_t ntiles = (ms + MR_OF(np) - 1) / MR_OF(np), pb = j->B * BLOCK_BYTES;
        const char *w = j->w + p * pb;
        for (int64_t t = 0, r = 0; t < ntiles; t++) {
            const int64_t mr = (ms - r) / (ntiles - t);
            /* one tile: it prefetches `prefetch` lines ahead in its own panels; several: they share
             * prefetching the next np panels (the next work item) so the weights stream while the
             * later tiles compute from cache */
            int mask = 0;
            for (int q = 0; q < np; q++) mask |= (q % ntiles == t) << q;
            const int64_t lines = mr >= 2 && j->prefetch < ROWS_PREFETCH ? ROWS_PREFETCH : j->prefetch;
            QTILES[np][mr](j, w, m0 + r, out + r * ldo, ldo, j->bias ? bias : 0, res ? res + r * j->ldr : 0,
                           j->ldr, ntiles == 1 ? lines * 64 : np * pb, ntiles == 1 ? 15 : mask);
            r += mr;
        }
    }
    if (!full)
        sp_store_partial(scratch, m0, ms, n0, cols, j->res, j->ldr, j->y, j->ldy);
}

int sp_block_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const float *bias, const float *res,
                  int64_t ldr, float *y, int64_t ldy, int isa, int64_t extra, sp_rows_t *rows)
{
    const int64_t B = (K + QB - 1) / QB;
    if (B == 0) { /* no k: the sums are empty */
        sp_empty_product(M, N, bias, res, ldr, y, ldy);
        return 0;
    }
    char *mem = sp_rows_memory(M * B * (QB + 8 + extra));
    if (!mem) { /* out of memory for M x K bytes: say so in the output rather than leave it stale */
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) y[i * ldy + n] = NAN;
        return 0;
    }
    rows->B = B;
    rows->q = (int8_t *)mem;
    rows->d = (float *)(mem + M * B * QB);
    rows->c = (int32_t *)(rows->d + M * B);
    rows->extra = rows->c + M * B;
    quantize_rows(x, M, K, ldx, B, rows->q, rows->d, rows->c, (isa & 3) && sp_avx512());
    return 1;
}

void sp_linear_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N, const float *bias,
                   const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads, int prefetch, int isa)
{
    sp_rows_t r;
    if (!sp_block_rows(x, M, K, ldx, N, bias, res, ldr, y, ldy, isa, 0, &r))
        return;
    const qjob_t job = {r.q, r.d, r.c, w, bias, res, y, M, N, r.B, ldy, ldr, prefetch > 0 ? prefetch : 0,
                        (isa & 1) && vnni_ok(), (isa & 2) && vnni_ok(), (isa & 2) && M >= 3 && amx_on && amx_ok()};
    sp_parallel_slabs(slab, &job, M, N, 4 * r.B * BLOCK_BYTES, nthreads);
}
