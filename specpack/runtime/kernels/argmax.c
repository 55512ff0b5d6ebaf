/* The greedy pick: each row's index of its largest value, as torch.argmax gives it (the first of
 * equal maxima; a NaN counts as the largest, the first NaN wins), for AVX2. Four independent chains
 * of 8 lanes keep the compare-and-blend latency hidden; each lane keeps the first index of its own
 * maximum (only a strictly larger value replaces it), and the lanes are merged by value, then by the
 * smaller index, so the result is the first occurrence whatever the lane layout. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static int64_t argmax_row(const float *v, int64_t n)
{
    const __m256i step = _mm256_set1_epi32(32); /* indices a pass of four chains covers */
    __m256 best[4];
    __m256i idx[4], cur[4];
    __m256 nan = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        best[c] = _mm256_set1_ps(-INFINITY);
        cur[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
        idx[c] = cur[c];
    }
    int64_t i = 0;
    for (; i + 32 <= n && n < INT32_MAX; i += 32)
        for (int c = 0; c < 4; c++) {
            const __m256 x = _mm256_loadu_ps(v + i + 8 * c);
            const __m256 gt = _mm256_cmp_ps(x, best[c], _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            best[c] = _mm256_blendv_ps(best[c], x, gt);
            idx[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx[c]), _mm256_castsi256_ps(cur[c]), gt));
            cur[c] = _mm256_add_epi32(cur[c], step);
        }
    float bv[32];
    int32_t bi[32];
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(bv + 8 * c, best[c]);
        _mm256_storeu_si256((__m256i *)(bi + 8 * c), idx[c]);
    }
    float mv = -INFINITY;
    int64_t mi = 0;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    if (i > 0)
        for (int l = 0; l < 32; l++)
            if (bv[l] > mv || (bv[l] == mv && bi[l] < mi)) mv = bv[l], mi = bi[l];
    for (; i < n; i++) { /* the tail, in order: only a strictly larger value replaces */
        if (isnan(v[i])) any_nan = 1;
        if (v[i] > mv || (i == 0 && !(v[i] < mv))) mv = v[i], mi = i;
    }
    if (any_nan)
        for (int64_t k = 0; k < n; k++)
            if (isnan(v[k])) return k;
    return mi;
}

/* out[r] = the argmax of row r of x [R, n] (row stride ld). */
void sp_argmax(const float *x, int64_t R, int64_t n, int64_t ld, int64_t *out)
{
    for (int64_t r = 0; r < R; r++) out[r] = n > 0 ? argmax_row(x + r * ld, n) : 0;
}
