/* The greedy screen (kernels/screen.py): a row's argmax over a linear head's outputs, exactly as the
 * full product gives it, from a cheap w8a8 pass over an int8 copy of the head plus the exact value
 * of the few columns that pass could not rule out.
 *
 * For output v, the full kernel's value F_v and the cheap pass's A_v differ by at most
 *     b_v = alpha * e_v + beta * m_v
 * where e_v = ||W_v - Q_v|| (the head's row against its int8 copy, Euclidean), m_v = ||W_v||,
 * alpha = ||x'|| + 2 gamma M, beta = ||x - x'|| + 4 gamma M, x' the row as w8a8 rounds it,
 * M = max(||x||, ||x'||) and gamma = K u / (1 - K u) (u = 2^-24): the exact sums differ by
 * x'.(Q_v - W_v) + (x' - x).W_v (Cauchy-Schwarz on each), and each kernel's rounding is at most
 * gamma_k sum |x_i W_vi| (or |x'_i Q_vi|) with k the longest chain of roundings it has (133 in fp32's
 * blocked sums, 51 in int8's, 19 in w8a8's), below gamma = gamma_K for any K they run, so together
 * at most gamma M (||W_v|| + ||Q_v||) <= gamma M (2 m_v + e_v): half of the room given. So the argmax
 * v* of F has A_v* + b_v* >= F_v* >= F_s >= A_s - b_s for every s: every column whose A_v + b_v
 * reaches L = max_s (A_s - b_s) is a candidate, v* among them; their exact values (`column`, the
 * full kernel's arithmetic for that one column) decide, the first of equal maxima winning as in the
 * full row (`screen_row` widens the bounds for the float arithmetic that compares them). */
#pragma GCC optimize("fp-contract=off") /* every multiply and add as written: `column` is bit-exact */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define NR 16       /* output columns per panel (linear.c) */
#define KB 128      /* linear.c's summation block for the float formats */
#define Q8_BLOCK 32 /* and its int8 scale block */
#define Q8_BLOCK_BYTES (NR * 4 + Q8_BLOCK * NR)

enum { SP_F32 = 0, SP_F16 = 1, SP_BF16 = 2, SP_Q8 = 3 };

/* Weight k of column j of a float-format panel, widened to fp32 (exactly, as the tiles widen it). */
static inline float weight_at(int fmt, const char *panel, int64_t k, int j)
{
    if (fmt == SP_F32) return ((const float *)panel)[k * NR + j];
    const uint16_t h = ((const uint16_t *)panel)[k * NR + j];
    if (fmt == SP_F16) return _cvtsh_ss(h);
    union { uint32_t u; float f; } b = {(uint32_t)h << 16};
    return b.f;
}

/* Output `col` of x [K] times the packed head w (linear.c's layout and format, no bias): the same
 * operations in the same order as linear.c's tiles apply to that column's lane, so the same bits. */
static float column(const float *x, int64_t K, const char *w, int fmt, int64_t col)
{
    const int j = (int)(col % NR);
    float acc = 0.0f;
    if (fmt == SP_Q8) {
        const int64_t B = (K + Q8_BLOCK - 1) / Q8_BLOCK;
        const char *panel = w + col / NR * B * Q8_BLOCK_BYTES;
        for (int64_t b = 0; b < B; b++) {
            const char *blk = panel + b * Q8_BLOCK_BYTES;
            const int8_t *q = (const int8_t *)(blk + NR * 4);
            const int64_t k0 = b * Q8_BLOCK, k1 = k0 + Q8_BLOCK < K ? k0 + Q8_BLOCK : K;
            float s = 0.0f;
            for (int64_t k = k0; k < k1; k++) s = fmaf(x[k], (float)q[(k - k0) * NR + j], s);
            const float d = ((const float *)blk)[j];
            acc = b == 0 ? s * d : fmaf(s, d, acc);
        }
        return acc;
    }
    const char *panel = w + col / NR * K * NR * (fmt == SP_F32 ? 4 : 2);
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        float s = 0.0f;
        for (int64_t k = k0; k < k1; k++) s = fmaf(x[k], weight_at(fmt, panel, k, j), s);
        acc = k0 == 0 ? s : acc + s;
    }
    return acc;
}

typedef struct {
    const float *x;
    int64_t K, ldx;
    float *y; /* in: the cheap pass's rows; out: the screened rows */
    int64_t V, ldy;
    const float *e, *m; /* [V] each: e_v and m_v */
    const char *w;
    int fmt;
    int64_t cap;
    int64_t *count;
} screen_job_t;

static double norm2(const float *x, int64_t K)
{
    double s = 0.0;
    for (int64_t k = 0; k < K; k++) s += (double)x[k] * x[k];
    return sqrt(s);
}

/* L = max_v fl(a_v - fl(fma(alpha, e_v, fl(beta * m_v)))) over the row, or NaN where a value is not
 * finite. */
static float lowest_top(const float *a, const float *e, const float *m, int64_t V, float alpha, float beta)
{
    const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta), zero = _mm256_setzero_ps();
    __m256 lo = _mm256_set1_ps(-INFINITY), bad = zero;
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_loadu_ps(a + v);
        const __m256 b = _mm256_fmadd_ps(al, _mm256_loadu_ps(e + v), _mm256_mul_ps(be, _mm256_loadu_ps(m + v)));
        lo = _mm256_max_ps(lo, _mm256_sub_ps(x, b));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ)); /* inf or NaN */
    }
    float l[8];
    _mm256_storeu_ps(l, lo);
    float top = -INFINITY;
    int nonfinite = _mm256_movemask_ps(bad) != 0;
    for (int i = 0; i < 8; i++) top = l[i] > top ? l[i] : top;
    for (; v < V; v++) {
        const float b = fmaf(alpha, e[v], beta * m[v]);
        nonfinite |= !isfinite(a[v]);
        top = a[v] - b > top ? a[v] - b : top;
    }
    return nonfinite ? NAN : top;
}

/* The columns v with fl(a_v + b_v) >= top into cand (their count; past `cap` the count only grows),
 * and the row set to -inf. */
static int64_t candidates(float *a, const float *e, const float *m, int64_t V, float alpha, float beta, float top,
                          int32_t *cand, int64_t cap)
{
    const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta), t = _mm256_set1_ps(top);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t count = 0, v = 0;
    for (; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_loadu_ps(a + v);
        const __m256 b = _mm256_fmadd_ps(al, _mm256_loadu_ps(e + v), _mm256_mul_ps(be, _mm256_loadu_ps(m + v)));
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(x, b), t, _CMP_GE_OQ));
        _mm256_storeu_ps(a + v, ninf);
        for (; m; m &= m - 1, count++)
            if (count < cap) cand[count] = (int32_t)(v + __builtin_ctz(m));
    }
    for (; v < V; v++) {
        if (a[v] + fmaf(alpha, e[v], beta * m[v]) >= top) {
            if (count < cap) cand[count] = (int32_t)v;
            count++;
        }
        a[v] = -INFINITY;
    }
    return count;
}

/* One row: count[r] = its candidates, the row rewritten to their exact values and -inf elsewhere;
 * -1 where a value is not finite, the row is too small to bound in float, or more than `cap`
 * columns pass (the caller computes that row in full). `scratch` holds the candidates' indices.
 * alpha and beta are widened for the float arithmetic above: each evaluation of a_v -+ b_v is off by
 * at most u |a_v| + 4 u b_v, and the slack (16 u M more on each, then 16 u on each; |a_v| <=
 * M (m_v + e_v) (1 + gamma)) covers both sides of the comparison. */
static void screen_row(const void *job_, int64_t r, float *scratch)
{
    const screen_job_t *job = job_;
    const float *x = job->x + r * job->ldx;
    float *y = job->y + r * job->ldy;
    const int64_t V = job->V, K = job->K;
    double hat, err;
    sp_w8a8_norms(x, K, &hat, &err);
    const double u = ldexp(1.0, -24), gamma = K * u / (1.0 - K * u), norm = norm2(x, K);
    const double most = norm > hat ? norm : hat, slack = 1.0 + 16.0 * u;
    const double alpha = (hat + (2.0 * gamma + 16.0 * u) * most) * slack;
    const double beta = (err + (4.0 * gamma + 16.0 * u) * most) * slack;
    job->count[r] = -1;
    if (!(most > 1e-20) || !(most < 1e30) || !isfinite(beta)) return; /* far from underflow and overflow */
    const float top = lowest_top(y, job->e, job->m, V, (float)alpha, (float)beta);
    if (isnan(top)) return;
    int32_t *cand = (int32_t *)scratch;
    const int64_t cap = job->cap < SP_SCRATCH_FLOATS ? job->cap : SP_SCRATCH_FLOATS;
    const int64_t count = candidates(y, job->e, job->m, V, (float)alpha, (float)beta, top, cand, cap);
    if (count > cap) return;
    for (int64_t i = 0; i < count; i++) y[cand[i]] = column(x, K, job->w, job->fmt, cand[i]);
    job->count[r] = count;
}

/* Screen rows x [R, K] (stride ldx) whose cheap-pass outputs y [R, V] (stride ldy) are given, with
 * bounds [2][V] (e, then m), against the packed head w of format fmt (SP_F32, SP_F16, SP_BF16 or SP_Q8); see the top of this file. */
void sp_screen(const float *x, int64_t R, int64_t K, int64_t ldx, float *y, int64_t V, int64_t ldy,
               const float *bounds, const void *w, int fmt, int64_t cap, int64_t *count, int nthreads)
{
    const screen_job_t job = {x, K, ldx, y, V, ldy, bounds, bounds + V, w, fmt, cap, count};
    sp_parallel(screen_row, &job, R, 1, R > 1 ? nthreads : 1);
}
