/* 6-bit weights times int8 activations (weight format SP_W6A8, "w6a8"): llama.cpp's Q6_K blocks kept at 8 bits a
 * weight (the file: 6.56), multiplied as llama.cpp's vec_dot_q6_K_q8_K does (integer dot products per 16 values,
 * one float fold per 16), with AVX-512 VNNI where the CPU has it, else AVX2. sp_linear hands fmt SP_W6A8 here.
 *
 * Weights: per panel of 16 columns and block of 32 k, 512 bytes: the 16 columns' scales of k 0..15 (fp32: Q6_K's
 * d * sc_j, exact in fp32), those of k 16..31, then the values u (0..63, a value being scale * (u - 32)): their
 * low 4 bits as w4a8.c stores nibbles (region r of 64 bytes: group 2r in low nibbles, 2r + 1 in high ones, column
 * j's four k at bytes 4j..4j+3 of a group), then their high 2 bits, 16 bytes a group: byte t holds those of the
 * group's lanes t, t + 16, t + 32 and t + 48 (lane 4j + i: column j, k 4g + i) at bits 0-1, 2-3, 4-5 and 6-7.
 *
 * Activations: w8a8.c's (sp_block_rows), and per row and block the sums of q over k 0..15 and 16..31.
 *
 * Reduction order (the determinism contract): per row, block, half h (k 0..15, 16..31) and column the integer
 * t_h = sum over the half's k of u * q - 32 * sum of q is exact; g_h = float(t_h) * d_a; acc = g_lo * s_lo for
 * the first block, else fma(g_lo, s_lo, acc); then acc = fma(g_hi, s_hi, acc); then acc + bias, then
 * residual + that. Row-exact like w8a8.c; the AVX2 tiles give the VNNI ones' bits, and linear.py's
 * `w6a8_linear` is the same arithmetic in torch. */
#pragma GCC optimize("fp-contract=off")
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NR 16
#define QB 32
#define QG (QB / 4)
#define SCALES (NR * 8)                          /* 2 x 16 fp32 */
#define PLANE (SCALES + QB * NR / 2)             /* the high bits start after the nibbles */
#define BLOCK_BYTES (PLANE + QB * NR / 4)        /* 512 */

typedef struct {
    const int8_t *q;        /* [B][M][QB] */
    const float *d;         /* [B][M] */
    const int32_t *half;    /* [B][M][2] 32 * (sum of q over k 0..15, over 16..31) */
    const char *w;
    const float *bias, *res;
    float *y;
    int64_t M, N, B, ldy, ldr;
    int vnni_few, vnni_many;
} job6_t;

#define AVX2 __attribute__((target("avx2,fma")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define MR2 2
#define MRZ 4

/* ---------------------------------------------------------------- AVX2 */

/* The values of group g (one 32-byte half h: columns 8h..8h+7) from nibbles `nib` (low or high nibbles already
 * taken) and the group's 16-byte plane at `pl`: bits (2 * (2h + lane / 16)) of each plane byte. */
static inline AVX2 __attribute__((always_inline)) __m256i six_avx2(__m256i nib, const char *pl, int h)
{
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)pl));
    const __m256i shift = h ? _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6) : _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i two = _mm256_and_si256(_mm256_srlv_epi32(b, shift), _mm256_set1_epi8(3));
    return _mm256_or_si256(nib, _mm256_slli_epi16(two, 4));
}

static inline AVX2 __attribute__((always_inline)) void tile_avx2(const int mr, const job6_t *j, const char *w,
                                                                 int64_t m0, float *out, int64_t ldo,
                                                                 const float *bias, const float *res, int64_t ldr)
{
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256 f[MR2][2];
    for (int64_t b = 0; b < j->B; b++) {
        const char *blk = w + b * BLOCK_BYTES;
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        __m256i s[MR2][2][2]; /* row, half of k, half of columns */
        for (int i = 0; i < mr; i++)
            for (int k = 0; k < 2; k++) s[i][k][0] = s[i][k][1] = _mm256_setzero_si256();
        for (int r = 0; r < QG / 2; r++) {
            const char *wr = blk + SCALES + r * 64, *pl = blk + PLANE + r * 32;
            __m256i a[2], c[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wr + 32 * h));
                a[h] = six_avx2(_mm256_and_si256(v, low), pl, h);
                c[h] = six_avx2(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), pl + 16, h);
            }
            for (int i = 0; i < mr; i++) {
                const __m256i xa = _mm256_set1_epi32(xq[i * QG + 2 * r]), xb = _mm256_set1_epi32(xq[i * QG + 2 * r + 1]);
                for (int h = 0; h < 2; h++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a[h], xa), ones),
                                                       _mm256_madd_epi16(_mm256_maddubs_epi16(c[h], xb), ones));
                    s[i][r >= 2][h] = _mm256_add_epi32(s[i][r >= 2][h], p);
                }
            }
        }
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_set1_ps(j->d[b * j->M + m0 + i]);
            const int32_t *off = j->half + 2 * (b * j->M + m0 + i);
            for (int h = 0; h < 2; h++) {
                const __m256 g0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s[i][0][h], _mm256_set1_epi32(off[0]))), a);
                const __m256 g1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s[i][1][h], _mm256_set1_epi32(off[1]))), a);
                const __m256 lo = _mm256_loadu_ps((const float *)blk + 8 * h), hi = _mm256_loadu_ps((const float *)blk + NR + 8 * h);
                const __m256 acc = b == 0 ? _mm256_mul_ps(g0, lo) : _mm256_fmadd_ps(g0, lo, f[i][h]);
                f[i][h] = _mm256_fmadd_ps(g1, hi, acc);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) {
            __m256 v = f[i][h];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + i * ldr + 8 * h), v);
            _mm256_storeu_ps(out + i * ldo + 8 * h, v);
        }
}

typedef void (*tile_fn)(const job6_t *, const char *, int64_t, float *, int64_t, const float *, const float *, int64_t);
static AVX2 void tile2_1(const job6_t *j, const char *w, int64_t m0, float *o, int64_t ldo, const float *b,
                         const float *r, int64_t ldr) { tile_avx2(1, j, w, m0, o, ldo, b, r, ldr); }
static AVX2 void tile2_2(const job6_t *j, const char *w, int64_t m0, float *o, int64_t ldo, const float *b,
                         const float *r, int64_t ldr) { tile_avx2(2, j, w, m0, o, ldo, b, r, ldr); }
static const tile_fn TILES2[MR2 + 1] = {0, tile2_1, tile2_2};

/* ---------------------------------------------------------------- AVX-512 VNNI */

static inline VNNI __attribute__((always_inline)) __m512i six_z(__m512i nib, const char *pl)
{
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)pl));
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i two = _mm512_and_si512(_mm512_srlv_epi32(b, shift), _mm512_set1_epi8(3));
    return _mm512_or_si512(nib, _mm512_slli_epi16(two, 4));
}

static inline VNNI __attribute__((always_inline)) void tile_z(const int mr, const job6_t *j, const char *w, int64_t m0,
                                                              float *out, int64_t ldo, const float *bias,
                                                              const float *res, int64_t ldr)
{
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f[MRZ];
    for (int64_t b = 0; b < j->B; b++) {
        const char *blk = w + b * BLOCK_BYTES;
        const int32_t *xq = (const int32_t *)(j->q + (b * j->M + m0) * QB);
        __m512i s[MRZ][2];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) s[i][0] = s[i][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int r = 0; r < QG / 2; r++) {
            const __m512i v = _mm512_loadu_si512(blk + SCALES + r * 64);
            const __m512i a = six_z(_mm512_and_si512(v, low), blk + PLANE + r * 32);
            const __m512i c = six_z(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), blk + PLANE + r * 32 + 16);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                s[i][r >= 2] = _mm512_dpbusd_epi32(s[i][r >= 2], a, _mm512_set1_epi32(xq[i * QG + 2 * r]));
                s[i][r >= 2] = _mm512_dpbusd_epi32(s[i][r >= 2], c, _mm512_set1_epi32(xq[i * QG + 2 * r + 1]));
            }
        }
        const __m512 lo = _mm512_loadu_ps(blk), hi = _mm512_loadu_ps(blk + NR * 4);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(j->d[b * j->M + m0 + i]);
            const int32_t *off = j->half + 2 * (b * j->M + m0 + i);
            const __m512 g0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][0], _mm512_set1_epi32(off[0]))), a);
            const __m512 g1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][1], _mm512_set1_epi32(off[1]))), a);
            const __m512 acc = b == 0 ? _mm512_mul_ps(g0, lo) : _mm512_fmadd_ps(g0, lo, f[i]);
            f[i] = _mm512_fmadd_ps(g1, hi, acc);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        __m512 v = f[i];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + i * ldr), v);
        _mm512_storeu_ps(out + i * ldo, v);
    }
}

#define TILEZ(R)                                                                                   \
    static VNNI void tilez_##R(const job6_t *j, const char *w, int64_t m0, float *o, int64_t ldo, \
                               const float *b, const float *r, int64_t ldr)                      \
    { tile_z(R, j, w, m0, o, ldo, b, r, ldr); }
TILEZ(1) TILEZ(2) TILEZ(3) TILEZ(4)
static const tile_fn TILESZ[MRZ + 1] = {0, tilez_1, tilez_2, tilez_3, tilez_4};

/* ---------------------------------------------------------------- driver */

/* Rows [m0, m0 + ms) times panels [p, p + np), one panel at a time: full ones straight into y, a partial last
 * one through scratch [16][16]. */
static void slab(const void *job, int64_t p, int np, int64_t m0, int64_t ms, float *scratch)
{
    const job6_t *j = job;
    for (int q = 0; q < np; q++) {
        const int64_t n0 = (p + q) * NR, cols = j->N - n0 < NR ? j->N - n0 : NR;
        const int full = cols == NR;
        float *out = full ? j->y + m0 * j->ldy + n0 : scratch;
        const int64_t ldo = full ? j->ldy : NR;
        const float *res = full && j->res ? j->res + m0 * j->ldr + n0 : 0;
        float bias[NR] = {0};
        if (j->bias) memcpy(bias, j->bias + n0, cols * sizeof(float));
        const int z = ms >= 3 ? j->vnni_many : j->vnni_few, most = z ? MRZ : MR2;
        const int64_t ntiles = (ms + most - 1) / most;
        for (int64_t t = 0, r = 0; t < ntiles; t++) {
            const int64_t mr = (ms - r) / (ntiles - t);
            (z ? TILESZ : TILES2)[mr](j, j->w + (p + q) * j->B * BLOCK_BYTES, m0 + r, out + r * ldo, ldo,
                                      j->bias ? bias : 0, res ? res + r * j->ldr : 0, j->ldr);
            r += mr;
        }
        if (!full)
            sp_store_partial(scratch, m0, ms, n0, cols, j->res, j->ldr, j->y, j->ldy);
    }
}

void sp_linear_w6a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N, const float *bias,
                    const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads, int isa)
{
    sp_rows_t r;
    if (!sp_block_rows(x, M, K, ldx, N, bias, res, ldr, y, ldy, isa, 2 * sizeof(int32_t), &r))
        return;
    int32_t *half = r.extra; /* 32 * the sums of q over k 0..15 and 16..31, per row and block */
    for (int64_t i = 0; i < M * r.B; i++) {
        int32_t lo = 0, hi = 0;
        for (int k = 0; k < QB / 2; k++) lo += r.q[i * QB + k], hi += r.q[i * QB + QB / 2 + k];
        half[2 * i] = 32 * lo, half[2 * i + 1] = 32 * hi;
    }
    const job6_t job = {r.q, r.d, half, w, bias, res, y, M, N, r.B, ldy, ldr, (isa & 1) && sp_vnni(),
                        (isa & 2) && sp_vnni()};
    sp_parallel_slabs(slab, &job, M, N, 4 * r.B * BLOCK_BYTES, nthreads);
}
