/* Attention of a few query rows against their sequences' KV caches, for AVX2 + FMA.
 *
 * One call covers every row of a batched forward: row r belongs to the sequence in cache slot
 * slot[r] and sees the keys of that slot at positions [0, ctx[r]) (committed tokens) plus, among
 * the new ones that start at ctx[r], either every position up to len[r] (a chain: mask NULL) or
 * the positions ctx[r] + j where mask[r * ldm + j] is set (a tree). Query head h reads KV head
 * h / (H / KVH) (grouped-query attention, transformers' repeat_kv order).
 *
 * Determinism (the contract the batched engine rests on): the output of (row, head) is computed
 * by one fixed sequence of operations over exactly the keys it sees, in position order: scores
 * q.k (one FMA chain per 8 lanes, lanes summed in a fixed tree), their maximum, exp(s - max) with
 * one polynomial, the sum of those in fixed 8-lane groups, the weighted sum of values in key
 * order, one division. Nothing depends on the other rows, on how many rows or sequences share the
 * call, on which thread runs the item, or on the thread count: a row's result is bit-identical
 * whether its sequence decodes alone, verifies a draft of any length, or shares the step with
 * others. (Scores are not the dot products SDPA computes bit for bit; they differ in the last
 * bits, as any other summation order would.)
 *
 * Cache layout: element (slot, kv head, position, i) of the keys at
 * k[slot * slot_stride + head * head_stride + position * ld + i], i < dk; values alike with dv
 * (MLA passes the latent cache as both, dk = latent + rope, dv = latent).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t ldq, ldo;                        /* row strides of q [R, H*dk] and out [R, H*dv] */
    int64_t slot_stride, head_stride, ld;   /* cache strides, in floats */
    int64_t H, KVH, dk, dv;
    const int64_t *slot, *ctx, *len;
    const uint8_t *mask;
    int64_t ldm;
    float scale;
} attn_job;

static inline float dot(const float *a, const float *b, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Per-thread buffer for one head's scores and visible key positions, grown as needed. */
static __thread float *buf;
static __thread int64_t buf_cap;

static int reserve(int64_t n)
{
    if (n <= buf_cap) return 1;
    float *b = realloc(buf, (size_t)n * 2 * sizeof(float));
    if (!b) return 0;
    buf = b;
    buf_cap = n;
    return 1;
}

/* The positions row r sees, in order, into pos[]; returns how many. */
static int64_t visible(const attn_job *j, int64_t r, int32_t *pos)
{
    const int64_t ctx = j->ctx[r], len = j->len[r];
    int64_t n = 0;
    if (!j->mask) {
        for (int64_t p = 0; p < len; p++) pos[n++] = (int32_t)p;
        return n;
    }
    for (int64_t p = 0; p < ctx; p++) pos[n++] = (int32_t)p;
    const uint8_t *m = j->mask + r * j->ldm;
    for (int64_t p = ctx; p < len; p++)
        if (m[p - ctx]) pos[n++] = (int32_t)p;
    return n;
}

/* out[0..dv) = softmax(scale * q.K) V over the n keys at pos[], for one query head. */
static void one_head(const attn_job *j, const float *q, const float *K, const float *V,
                     const int32_t *pos, int64_t n, float *s, float *out)
{
    const int64_t dk = j->dk, dv = j->dv, ld = j->ld;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        s[t] = j->scale * dot(q, K + (int64_t)pos[t] * ld, dk);
        mx = s[t] > mx ? s[t] : mx;
    }
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    if (t < n) { /* the tail through the same polynomial, lanes past n masked to zero */
        float tail[8] = {0};
        for (int64_t i = t; i < n; i++) tail[i - t] = s[i] - mx;
        float e[8];
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(tail)));
        for (int64_t i = t; i < n; i++) { s[i] = e[i - t]; sum += e[i - t]; }
    }
    const float inv = 1.0f / sum;
    for (int64_t d0 = 0; d0 < dv; d0 += 64) { /* 64 output lanes at a time: 8 accumulators */
        const int64_t w = dv - d0 < 64 ? dv - d0 : 64, full = w / 8;
        __m256 a[8];
        float rest[8] = {0};
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t t2 = 0; t2 < n; t2++) {
            const float *v = V + (int64_t)pos[t2] * ld + d0;
            const __m256 p = _mm256_set1_ps(s[t2]);
            for (int64_t i = 0; i < full; i++) a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), a[i]);
            for (int64_t i = 8 * full; i < w; i++) rest[i - 8 * full] += s[t2] * v[i];
        }
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < full; i++) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(a[i], inv8));
        for (int64_t i = 8 * full; i < w; i++) out[d0 + i] = rest[i - 8 * full] * inv;
    }
}

/* Item = (row, kv head): the query heads of that group for that row. */
static void item(const void *job, int64_t it, float *scratch)
{
    (void)scratch;
    const attn_job *j = job;
    const int64_t r = it / j->KVH, g = it % j->KVH, G = j->H / j->KVH;
    const int64_t cap = j->len[r] > 1 ? j->len[r] : 1;
    if (!reserve(cap)) { /* out of memory (a few KB): NaNs, never a silent wrong number */
        for (int64_t h = g * G; h < (g + 1) * G; h++)
            for (int64_t i = 0; i < j->dv; i++) j->out[r * j->ldo + h * j->dv + i] = NAN;
        return;
    }
    float *s = buf;
    int32_t *pos = (int32_t *)(buf + cap);
    const int64_t n = visible(j, r, pos);
    if (n == 0) { /* a row that sees nothing attends to nothing */
        for (int64_t h = g * G; h < (g + 1) * G; h++)
            memset(j->out + r * j->ldo + h * j->dv, 0, (size_t)j->dv * sizeof(float));
        return;
    }
    const int64_t base = j->slot[r] * j->slot_stride + g * j->head_stride;
    for (int64_t h = g * G; h < (g + 1) * G; h++)
        one_head(j, j->q + r * j->ldq + h * j->dk, j->k + base, j->v + base, pos, n, s,
                 j->out + r * j->ldo + h * j->dv);
}

/* See the comment at the top. A row that sees no key gets zeros. */
void sp_attention(const float *q, int64_t R, int64_t H, int64_t ldq, const float *k, const float *v,
                  int64_t KVH, int64_t slot_stride, int64_t head_stride, int64_t ld, int64_t dk,
                  int64_t dv, const int64_t *slot, const int64_t *ctx, const int64_t *len,
                  const uint8_t *mask, int64_t ldm, float scale, float *out, int64_t ldo,
                  int nthreads)
{
    const attn_job job = {q, k, v, out, ldq, ldo, slot_stride, head_stride, ld, H, KVH, dk, dv,
                          slot, ctx, len, mask, ldm, scale};
    sp_parallel(item, &job, R * KVH, 1, nthreads);
}
