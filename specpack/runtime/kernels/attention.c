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
 * (MLA passes the latent cache as both, dk = latent + rope, dv = latent). The elements are fp32,
 * or IEEE fp16 (kv16: half the bytes to read per key), widened exactly to fp32 as they are loaded:
 * a row's result on an fp16 cache is, bit for bit, its result on that cache widened to fp32. The
 * code that depends on the element type is attention_kv.h, included once per type.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

typedef struct {
    const float *q;
    const void *k, *v; /* float, or uint16_t (fp16) with kv16 */
    int kv16;
    float *out;
    int64_t ldq, ldo;                        /* row strides of q [R, H*dk] and out [R, H*dv] */
    int64_t slot_stride, head_stride, ld;   /* cache strides, in elements */
    int64_t H, KVH, dk, dv;
    const int64_t *slot, *ctx, *len;
    const uint8_t *mask;
    int64_t ldm;
    float scale;
    const int64_t *group; /* row groups: rows [group[i], group[i + 1]) share a slot */
} attn_job;

#define GROUP_ROWS 4 /* rows of one sequence per item: each reads the keys once for all of them */

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

/* s[0..n) = exp(s[pos[t]] - max) (the scores this query's row sees, taken in order, in place),
 * returning their sum: one polynomial, sums in fixed 8-lane groups. */
static float softmax_terms(float *s, const int32_t *pos, int64_t n)
{
    if (n == 0 || pos[n - 1] != n - 1) /* positions 0..n-1 (a chain's) are already in place */
        for (int64_t t = 0; t < n; t++) s[t] = s[pos[t]];
    /* the maximum in eight lanes, then across them: exact, so the order does not matter (one
     * compare chain over every score bound a row's softmax by its latency) */
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + t), m); /* a NaN score is skipped, as below */
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
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

/* Whether the AVX-512 loops run (where the CPU has AVX-512): the same bits as the AVX2 ones, which
 * sp_attention_avx512(0) selects (the tests compare the two). */
static int zmm_on = 1;
void sp_attention_avx512(int on) { zmm_on = on; }
static int zmm(void) { return zmm_on && sp_avx512(); }
#define ZMM_ATTR __attribute__((target("avx512f,avx512vl,avx2,fma,f16c"))) /* the AVX-512 loops */

/* An item's working memory (see item). */
typedef struct {
    float *s, *acc, *inv;
    int64_t *npos, *cur;
    const float **qs;
    float **outs;
    int32_t *pos;
} item_mem;

/* Query qi's output lanes [d0, d0 + 64): inv[qi] * the sum over its visible keys t of p_qi[t] V[pos[t]],
 * one FMA per key and lane in key order. The keys go in blocks of VALUE_BLOCK positions, every query
 * of the item through a block before the next (its accumulators wait in acc[qi][64]), so each value
 * is read once for all of them. VEC is the vector type (__m256 or __m512: each lane goes through the
 * same chain, so both give the same bits), L its lanes, OP(x) its intrinsic _mm256_x or _mm512_x,
 * LOAD(p) L cache elements (of attention_kv.h's KV_T) as a VEC. */
#define WEIGHTED_SUMS(NAME, ATTR, VEC, L, OP, SET1, LOAD)                                          \
    static ATTR void NAME(const attn_job *j, int64_t nq, int64_t G, const KV_T *V, const int32_t *pos,  \
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
                    const KV_T *v = V + (int64_t)ps[c] * ld + d0;                                \
                    const VEC pt = SET1(pq[c]);                                                  \
                    for (int i = 0; i < 64 / L; i++) a[i] = OP(fmadd_ps)(pt, LOAD(v + L * i), a[i]); \
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

/* The cache readers, per element type (attention_kv.h): *_f32 and *_f16. */
#define KV_T float
#define KV(name) name##_f32
#define LOAD1(p) (*(p))
#define LOAD8(p) _mm256_loadu_ps(p)
#define LOAD16(p) _mm512_loadu_ps(p)
#include "attention_kv.h"

#define KV_T uint16_t
#define KV(name) name##_f16
#define LOAD1(p) _cvtsh_ss(*(p))
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attention_kv.h"

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
    item_mem m;
    m.s = (float *)mem, m.acc = m.s + nq * lds; /* 32-byte multiples first */
    m.npos = (int64_t *)(m.acc + nq * 64), m.cur = m.npos + nr;
    m.qs = (const float **)(m.cur + nq);
    m.outs = (float **)(m.qs + nq), m.inv = (float *)(m.outs + nq);
    m.pos = (int32_t *)(m.inv + nq);
    for (int64_t i = 0; i < nr; i++) m.npos[i] = visible(j, r0 + i, m.pos + i * n);
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t r = r0 + qi / G, h = g * G + qi % G;
        m.qs[qi] = j->q + r * j->ldq + h * j->dk;
        m.outs[qi] = j->out + r * j->ldo + h * j->dv;
    }
    const int64_t base = j->slot[r0] * j->slot_stride + g * j->head_stride;
    (j->kv16 ? attend_f16 : attend_f32)(j, &m, nq, G, n, lds, base);
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
void sp_attention(const float *q, int64_t R, int64_t H, int64_t ldq, const void *k, const void *v, int kv16,
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
    const attn_job job = {q, k, v, kv16, out, ldq, ldo, slot_stride, head_stride, ld, H, KVH, dk, dv,
                          slot, ctx, len, mask, ldm, scale, group};
    sp_parallel(item, &job, ng * KVH, 1, nthreads);
    free(group);
}
