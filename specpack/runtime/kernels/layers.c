/* The small ops between a decoder layer's matrix products, fused, for AVX2 + FMA: RMSNorm with its
 * scale, RoPE with the KV-cache write (fp32, or rounded to fp16), SiLU times up. Each is one call over every row of a batched
 * forward (the residual adds ride in the linear kernel's epilogue, linear.c).
 *
 * Row-exact, as the rest of the kernels: every row is computed by one fixed sequence of operations
 * that does not depend on the other rows or on how many there are.
 *
 * RoPE is computed as torch computes `x * cos + rotate_half(x) * sin`: two products rounded, then
 * their sum. The compiler must not contract those into a fused multiply-add (which rounds once),
 * hence the pragmas: with them the result is bit-identical to the torch ops it replaces.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* y[0..n) = w * (x * (1 / sqrt(mean(x^2) + eps))): the sum of squares in 8 lanes over k (a tail
 * past the last multiple of 8 is added in order after the lanes), the lanes summed in a fixed
 * tree. x and y may be the same. */
static void rmsnorm_row(const float *x, const float *w, int64_t n, float eps, float *y)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum8(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    const __m256 r8 = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r8)));
    for (; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* y[r] = rmsnorm(x[r]) * w for R rows of n. */
void sp_rmsnorm(const float *x, int64_t R, int64_t n, int64_t ldx, const float *w, float eps, float *y,
                int64_t ldy)
{
    for (int64_t r = 0; r < R; r++) rmsnorm_row(x + r * ldx, w, n, eps, y + r * ldy);
}

/* silu(g) * u = g / (1 + exp(-g)) * u on 8 lanes. */
static inline __m256 silu_mul8(__m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

/* y[r][i] = silu(gu[r][i]) * gu[r][n + i] for i < n: the gate and up halves of a fused
 * [R, 2n] product. A tail past the last multiple of 8 goes through the same lanes, zero-padded. */
void sp_silu_mul(const float *gu, int64_t R, int64_t n, int64_t ldg, float *y, int64_t ldy)
{
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * ldg, *u = g + n;
        float *yr = y + r * ldy;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        if (i < n) {
            float gt[8] = {0}, ut[8] = {0}, out[8];
            memcpy(gt, g + i, (size_t)(n - i) * sizeof(float));
            memcpy(ut, u + i, (size_t)(n - i) * sizeof(float));
            _mm256_storeu_ps(out, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
            memcpy(yr + i, out, (size_t)(n - i) * sizeof(float));
        }
    }
}

/* out[0..hd) = x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1], halves of hd / 2),
 * products rounded before the sum, as torch's ops round them. out may not alias x. */
static void rope_head(const float *x, const float *cos, const float *sin, int64_t hd, float *out)
{
    const int64_t h = hd / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i] * cos[i], b = -x[i + h] * sin[i];
        out[i] = a + b;
    }
    for (int64_t i = h; i < hd; i++) {
        const float a = x[i] * cos[i], b = x[i - h] * sin[i];
        out[i] = a + b;
    }
}

/* x[0..n) into a cache at element `at`: fp32 as is, or rounded to IEEE fp16 (kv16; to nearest
 * even, as torch's .to(torch.float16) rounds). */
static void store_kv(void *cache, int64_t at, const float *x, int64_t n, int kv16)
{
    if (!kv16) {
        memcpy((float *)cache + at, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)cache + at;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

/* For each row r of a fused q/k/v product qkv [R, (H + 2 KVH) * hd] (row stride ldq): optionally
 * RMSNorm each q and k head (qn, kn: [hd] weights, or NULL; Qwen3), rotate q in place and k into
 * the key cache with cos/sin [R, hd] (row stride ldc), and copy v into the value cache, both at
 * (slot[r], head, write[r]) (cache strides, in elements, as in attention.c; elements fp32, or fp16
 * with kv16). */
void sp_rope_cache(float *qkv, int64_t R, int64_t ldq, int64_t H, int64_t KVH, int64_t hd,
                   const float *cos, const float *sin, int64_t ldc, const float *qn, const float *kn, float eps,
                   void *kc, void *vc, int kv16, int64_t slot_stride, int64_t head_stride, int64_t ld,
                   const int64_t *slot, const int64_t *write)
{
    float tmp[1024];
    if (hd > 1024) return; /* refused by the caller */
    for (int64_t r = 0; r < R; r++) {
        float *q = qkv + r * ldq, *k = q + H * hd;
        const float *v = k + KVH * hd, *c = cos + r * ldc, *s = sin + r * ldc;
        const int64_t base = slot[r] * slot_stride + write[r] * ld;
        for (int64_t h = 0; h < H; h++) {
            float *qh = q + h * hd;
            if (qn) rmsnorm_row(qh, qn, hd, eps, qh);
            rope_head(qh, c, s, hd, tmp);
            memcpy(qh, tmp, (size_t)hd * sizeof(float));
        }
        for (int64_t h = 0; h < KVH; h++) {
            float *kh = k + h * hd;
            if (kn) rmsnorm_row(kh, kn, hd, eps, kh);
            rope_head(kh, c, s, hd, tmp);
            store_kv(kc, base + h * head_stride, tmp, hd, kv16);
            store_kv(vc, base + h * head_stride, v + h * hd, hd, kv16);
        }
    }
}
