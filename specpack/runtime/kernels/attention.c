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
 * Work: an item is a group of up to four consecutive rows of one sequence (a verified draft, a
 * prefill chunk) and one KV head: its keys and values are read from memory once for every query
 * head of that group (grouped-query heads too), not once per row and head; the scores are computed
 * for every position any of its rows sees, and each row then takes the ones it sees.
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
    const int64_t *group; /* row groups: rows [group[i], group[i + 1]) share a slot */
} attn_job;

#define GROUP_ROWS 4 /* rows of one sequence per item: each reads the keys once for all of them */

static inline float dot(const float *a, const float *b, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Per-thread working memory, grown as needed. */
static __thread char *buf;
static __thread int64_t buf_bytes;

static char *reserve(int64_t bytes)
{
    if (bytes <= buf_bytes) return buf;
    char *b = realloc(buf, (size_t)bytes);
    if (!b) return 0;
    buf = b;
    buf_bytes = bytes;
    return buf;
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

/* Eight vectors' lanes summed, each in hsum8's tree ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)):
 * lane k of the result is hsum8(a_k), bit for bit, for a fraction of the shuffles. */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7)
{
#define HALVES(x, y) _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31))
    const __m256 s01 = HALVES(a0, a1), s23 = HALVES(a2, a3), s45 = HALVES(a4, a5), s67 = HALVES(a6, a7);
#undef HALVES
    /* per 128-bit lane [s0 + s2, s1 + s3] of two keys: low lanes keys 0, 2 (4, 6), high 1, 3 (5, 7) */
    const __m256 t0 = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
    const __m256 t1 = _mm256_add_ps(_mm256_shuffle_ps(s45, s67, 0x44), _mm256_shuffle_ps(s45, s67, 0xEE));
    /* t0 + t1 of each key: low lanes keys 0, 2, 4, 6, high lanes 1, 3, 5, 7 */
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
    return _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* s[qi * lds + t] = scale * q_qi.K[t] for positions t < n (one key every ld floats) and nq queries:
 * exactly `scale * dot(q, key, dk)`, eight keys at a time (eight independent FMA chains sharing each
 * load of q, their lanes summed together), every key read once for all the queries. */
static void scores(const attn_job *j, const float *const *qs, int64_t nq, const float *K, int64_t n, float *s,
                   int64_t lds)
{
    const int64_t dk = j->dk, ld = j->ld, d8 = dk / 8 * 8;
    const __m256 scale = _mm256_set1_ps(j->scale);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
#define KEYS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define KPTR(i) const float *k##i = K + (t + i) * ld;
        KEYS(KPTR)
        for (int64_t qi = 0; qi < nq; qi++) {
            const float *q = qs[qi];
#define KDECL(i) __m256 a##i = _mm256_setzero_ps();
            KEYS(KDECL)
            for (int64_t i = 0; i < d8; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
#define KFMA(x) a##x = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k##x + i), a##x);
                KEYS(KFMA)
            }
            __m256 r = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
            if (d8 < dk) { /* dot's scalar tail, key by key */
                float part[8];
                const float *keys[8] = {k0, k1, k2, k3, k4, k5, k6, k7};
                _mm256_storeu_ps(part, r);
                for (int k = 0; k < 8; k++)
                    for (int64_t i = d8; i < dk; i++) part[k] += q[i] * keys[k][i];
                r = _mm256_loadu_ps(part);
            }
            _mm256_storeu_ps(s + qi * lds + t, _mm256_mul_ps(scale, r));
        }
#undef KEYS
#undef KPTR
#undef KDECL
#undef KFMA
    }
    for (; t < n; t++)
        for (int64_t qi = 0; qi < nq; qi++) s[qi * lds + t] = j->scale * dot(qs[qi], K + t * ld, dk);
}

/* s[0..n) = exp(s[pos[t]] - max) (the scores this query's row sees, taken in order, in place),
 * returning their sum: one polynomial, sums in fixed 8-lane groups. */
static float softmax_terms(float *s, const int32_t *pos, int64_t n)
{
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        s[t] = s[pos[t]];
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
    return sum;
}

#define VALUE_BLOCK 32 /* keys per pass over the queries' accumulators: their values stay in L1 */

/* Query qi's output lanes [d0, d0 + 64): inv[qi] * the sum over its visible keys t of p_qi[t] V[pos[t]],
 * one FMA per key and lane in key order. The keys go in blocks of VALUE_BLOCK positions, every query
 * of the item through a block before the next (its accumulators wait in acc[qi][64]), so each value
 * is read once for all of them. VEC is the vector type (__m256 or __m512: each lane goes through the
 * same chain, so both give the same bits), L its lanes, OP(x) its intrinsic _mm256_x or _mm512_x. */
#define WEIGHTED_SUMS(NAME, ATTR, VEC, L, OP, SET1)                                                \
    static ATTR void NAME(const attn_job *j, int64_t nq, int64_t G, const float *V, const int32_t *pos, \
                          const int64_t *npos, const float *p, int64_t lds, int64_t n,                \
                          const float *inv, float *acc, int64_t *cur, float *const *outs, int64_t d0)  \
    {                                                                                            \
        const int64_t ld = j->ld;                                                                \
        memset(acc, 0, (size_t)nq * 64 * sizeof(float));                                          \
        memset(cur, 0, (size_t)nq * sizeof(int64_t));                                             \
        for (int64_t b1 = VALUE_BLOCK; b1 - VALUE_BLOCK < n; b1 += VALUE_BLOCK)                   \
            for (int64_t qi = 0; qi < nq; qi++) {                                                \
                const int32_t *ps = pos + qi / G * n; /* each row's positions, n apart */          \
                const int64_t m = npos[qi / G];                                                  \
                const float *pq = p + qi * lds;                                                  \
                float *aq = acc + qi * 64;                                                       \
                int64_t c = cur[qi];                                                             \
                if (c >= m || ps[c] >= b1) continue;                                             \
                VEC a[64 / L];                                                                   \
                for (int i = 0; i < 64 / L; i++) a[i] = OP(loadu_ps)(aq + L * i);                 \
                for (; c < m && ps[c] < b1; c++) {                                               \
                    const float *v = V + (int64_t)ps[c] * ld + d0;                               \
                    const VEC pt = SET1(pq[c]);                                                  \
                    for (int i = 0; i < 64 / L; i++) a[i] = OP(fmadd_ps)(pt, OP(loadu_ps)(v + L * i), a[i]); \
                }                                                                                \
                for (int i = 0; i < 64 / L; i++) OP(storeu_ps)(aq + L * i, a[i]);                 \
                cur[qi] = c;                                                                     \
            }                                                                                    \
        for (int64_t qi = 0; qi < nq; qi++) {                                                    \
            const VEC iv = SET1(inv[qi]);                                                        \
            for (int i = 0; i < 64 / L; i++)                                                     \
                OP(storeu_ps)(outs[qi] + d0 + L * i, OP(mul_ps)(OP(loadu_ps)(acc + qi * 64 + L * i), iv)); \
        }                                                                                        \
    }
#define OP256(x) _mm256_##x
#define OP512(x) _mm512_##x
WEIGHTED_SUMS(weighted_sums, , __m256, 8, OP256, _mm256_set1_ps)
WEIGHTED_SUMS(weighted_sums_z, __attribute__((target("avx512f,avx2,fma"))), __m512, 16, OP512, _mm512_set1_ps)

/* Lanes [d0, dv) (fewer than 64) of one query's output, the same sums in a generic loop. */
static void weighted_rest(const float *V, const int32_t *pos, int64_t n, const float *p, int64_t ld, int64_t d0,
                          int64_t dv, float inv, float *out)
{
    const int64_t w = dv - d0, full = w / 8;
    const __m256 inv8 = _mm256_set1_ps(inv);
    __m256 a[8];
    float rest[8] = {0};
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const float *v = V + (int64_t)pos[t] * ld + d0;
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int64_t i = 0; i < full; i++) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), a[i]);
        for (int64_t i = 8 * full; i < w; i++) rest[i - 8 * full] += p[t] * v[i];
    }
    for (int64_t i = 0; i < full; i++) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(a[i], inv8));
    for (int64_t i = 8 * full; i < w; i++) out[d0 + i] = rest[i - 8 * full] * inv;
}

/* Item = (row group, kv head): every query head of that KV head for every row of the group. */
static void item(const void *job, int64_t it, float *scratch)
{
    (void)scratch;
    const attn_job *j = job;
    const int64_t gi = it / j->KVH, g = it % j->KVH, G = j->H / j->KVH;
    const int64_t r0 = j->group[gi], nr = j->group[gi + 1] - r0, nq = nr * G;
    int64_t n = 1; /* the positions any row of the group sees lie below the largest len */
    for (int64_t r = r0; r < r0 + nr; r++) n = j->len[r] > n ? j->len[r] : n;
    const int64_t lds = (n + 7) / 8 * 8;
    char *mem = reserve(nr * n * 4 + nr * 8 + nq * (8 + 8 + 8 + 4 + 64 * 4) + nq * lds * 4 + 64);
    if (!mem) { /* out of memory: NaNs, never a silent wrong number */
        for (int64_t r = r0; r < r0 + nr; r++)
            for (int64_t h = g * G; h < (g + 1) * G; h++)
                for (int64_t i = 0; i < j->dv; i++) j->out[r * j->ldo + h * j->dv + i] = NAN;
        return;
    }
    float *s = (float *)mem, *acc = s + nq * lds; /* 32-byte multiples first */
    int64_t *npos = (int64_t *)(acc + nq * 64), *cur = npos + nr;
    const float **qs = (const float **)(cur + nq);
    float **outs = (float **)(qs + nq), *inv = (float *)(outs + nq);
    int32_t *pos = (int32_t *)(inv + nq);
    for (int64_t i = 0; i < nr; i++) npos[i] = visible(j, r0 + i, pos + i * n);
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t r = r0 + qi / G, h = g * G + qi % G;
        qs[qi] = j->q + r * j->ldq + h * j->dk;
        outs[qi] = j->out + r * j->ldo + h * j->dv;
    }
    const int64_t base = j->slot[r0] * j->slot_stride + g * j->head_stride;
    scores(j, qs, nq, j->k + base, n, s, lds);
    for (int64_t qi = 0; qi < nq; qi++) /* a row that sees nothing attends to nothing: zeros */
        inv[qi] = npos[qi / G] ? 1.0f / softmax_terms(s + qi * lds, pos + qi / G * n, npos[qi / G]) : 0.0f;
    int64_t d0 = 0;
    for (; d0 + 64 <= j->dv; d0 += 64)
        (sp_avx512() ? weighted_sums_z : weighted_sums)(j, nq, G, j->v + base, pos, npos, s, lds, n, inv, acc,
                                                         cur, outs, d0);
    if (d0 < j->dv)
        for (int64_t qi = 0; qi < nq; qi++)
            weighted_rest(j->v + base, pos + qi / G * n, npos[qi / G], s + qi * lds, j->ld, d0, j->dv, inv[qi],
                          outs[qi]);
}

/* Rows in groups of at most GROUP_ROWS consecutive rows of one slot (a run of L such rows in
 * ceil(L / GROUP_ROWS) groups of near-equal size): starts into group[], returns how many. */
static int64_t row_groups(const int64_t *slot, int64_t R, int64_t *group)
{
    int64_t ng = 0;
    for (int64_t r = 0; r < R;) {
        int64_t e = r + 1;
        while (e < R && slot[e] == slot[r]) e++;
        const int64_t parts = (e - r + GROUP_ROWS - 1) / GROUP_ROWS;
        for (int64_t i = 0; i < parts; i++) group[ng++] = r + (e - r) * i / parts;
        r = e;
    }
    group[ng] = R;
    return ng;
}

/* See the comment at the top. A row that sees no key gets zeros. */
void sp_attention(const float *q, int64_t R, int64_t H, int64_t ldq, const float *k, const float *v,
                  int64_t KVH, int64_t slot_stride, int64_t head_stride, int64_t ld, int64_t dk,
                  int64_t dv, const int64_t *slot, const int64_t *ctx, const int64_t *len,
                  const uint8_t *mask, int64_t ldm, float scale, float *out, int64_t ldo,
                  int nthreads)
{
    int64_t *group = malloc((size_t)(R + 1) * sizeof(int64_t));
    if (!group) { /* out of memory: NaNs, never a silent wrong number */
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < H * dv; i++) out[r * ldo + i] = NAN;
        return;
    }
    const int64_t ng = row_groups(slot, R, group);
    const attn_job job = {q, k, v, out, ldq, ldo, slot_stride, head_stride, ld, H, KVH, dk, dv,
                          slot, ctx, len, mask, ldm, scale, group};
    sp_parallel(item, &job, ng * KVH, 1, nthreads);
    free(group);
}
