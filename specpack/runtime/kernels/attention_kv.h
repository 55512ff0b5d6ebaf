/* The part of attention.c that reads the KV cache, for one cache element type: attention.c includes
 * it once per type, with
 *
 *   KV_T          the element type (float, or uint16_t holding IEEE fp16)
 *   KV(name)      name with the type's suffix (name_f32, name_f16)
 *   LOAD1(p)      one element at p as a float
 *   LOAD8(p)      eight elements at p as an __m256
 *   LOAD16(p)     sixteen elements at p as an __m512 (AVX-512 code only)
 *
 * Every load widens exactly, and everything after a load is the same for both types: a row's
 * result on an fp16 cache equals its result on that cache widened to fp32, bit for bit. Scalar
 * tails are explicit fmaf, never a * b + c, so the compiler's contraction choices (which may differ
 * between the two copies) cannot change a bit.
 */

static inline float KV(dot)(const float *a, const KV_T *b, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOAD8(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s = fmaf(a[i], LOAD1(b + i), s);
    return s;
}

/* Keys [t, n) (fewer than eight) of `scores`, one dot product each. */
static void KV(scores_tail)(const attn_job *j, const float *const *qs, int64_t nq, const KV_T *K, int64_t t,
                            int64_t n, float *s, int64_t lds)
{
    for (; t < n; t++)
        for (int64_t qi = 0; qi < nq; qi++) s[qi * lds + t] = j->scale * KV(dot)(qs[qi], K + t * j->ld, j->dk);
}

/* s[qi * lds + t] = scale * q_qi.K[t] for positions t < n (one key every ld elements) and nq
 * queries: exactly `scale * dot(q, key, dk)`, eight keys at a time (eight independent FMA chains
 * sharing each load of q, their lanes summed together), every key read once for all the queries. */
static void KV(scores)(const attn_job *j, const float *const *qs, int64_t nq, const KV_T *K, int64_t n, float *s,
                       int64_t lds)
{
    const int64_t dk = j->dk, ld = j->ld, d8 = dk / 8 * 8;
    const __m256 scale = _mm256_set1_ps(j->scale);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
#define KEYS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define KPTR(i) const KV_T *k##i = K + (t + i) * ld;
        KEYS(KPTR)
        for (int64_t qi = 0; qi < nq; qi++) {
            const float *q = qs[qi];
#define KDECL(i) __m256 a##i = _mm256_setzero_ps();
            KEYS(KDECL)
            for (int64_t i = 0; i < d8; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
#define KFMA(x) a##x = _mm256_fmadd_ps(qv, LOAD8(k##x + i), a##x);
                KEYS(KFMA)
            }
            __m256 r = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
            if (d8 < dk) { /* dot's scalar tail, key by key */
                float part[8];
                const KV_T *keys[8] = {k0, k1, k2, k3, k4, k5, k6, k7};
                _mm256_storeu_ps(part, r);
                for (int k = 0; k < 8; k++)
                    for (int64_t i = d8; i < dk; i++) part[k] = fmaf(q[i], LOAD1(keys[k] + i), part[k]);
                r = _mm256_loadu_ps(part);
            }
            _mm256_storeu_ps(s + qi * lds + t, _mm256_mul_ps(scale, r));
        }
#undef KDECL
#undef KFMA
    }
    KV(scores_tail)(j, qs, nq, K, t, n, s, lds);
}

WEIGHTED_SUMS(KV(weighted_sums), , __m256, 8, OP256, _mm256_set1_ps, LOAD8)

/* KV(scores) three queries at a time (AVX-512VL: 32 ymm registers for 24 chains): each key vector is
 * loaded once for three queries instead of once per query, the load ports' work, not the FMAs',
 * being what bounds it. Each (query, key) goes through the same chain and lane sum: the same bits. */
static ZMM_ATTR void KV(scores_z)(const attn_job *j, const float *const *qs, int64_t nq, const KV_T *K, int64_t n,
                                  float *s, int64_t lds)
{
    const int64_t dk = j->dk, ld = j->ld;
    if (dk % 8) { /* a scalar tail per key: the one-query loop */
        KV(scores)(j, qs, nq, K, n, s, lds);
        return;
    }
    const __m256 scale = _mm256_set1_ps(j->scale);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        KEYS(KPTR) /* KV(scores)'s macros, still defined */
        for (int64_t q0 = 0; q0 < nq; q0 += 3) {
            const int64_t w = nq - q0 < 3 ? nq - q0 : 3; /* past the last query: the first again, not stored */
            const float *qa = qs[q0], *qb = qs[w > 1 ? q0 + 1 : q0], *qc = qs[w > 2 ? q0 + 2 : q0];
#define KDECL(i) __m256 a##i = _mm256_setzero_ps(), b##i = a##i, c##i = a##i;
            KEYS(KDECL)
            for (int64_t i = 0; i < dk; i += 8) {
                const __m256 va = _mm256_loadu_ps(qa + i), vb = _mm256_loadu_ps(qb + i), vc = _mm256_loadu_ps(qc + i);
#define KFMA(x)                                                                                  \
                {                                                                                \
                    const __m256 kv = LOAD8(k##x + i);                                           \
                    a##x = _mm256_fmadd_ps(va, kv, a##x), b##x = _mm256_fmadd_ps(vb, kv, b##x);  \
                    c##x = _mm256_fmadd_ps(vc, kv, c##x);                                        \
                }
                KEYS(KFMA)
            }
            _mm256_storeu_ps(s + q0 * lds + t, _mm256_mul_ps(scale, hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7)));
            if (w > 1)
                _mm256_storeu_ps(s + (q0 + 1) * lds + t, _mm256_mul_ps(scale, hsum8x8(b0, b1, b2, b3, b4, b5, b6, b7)));
            if (w > 2)
                _mm256_storeu_ps(s + (q0 + 2) * lds + t, _mm256_mul_ps(scale, hsum8x8(c0, c1, c2, c3, c4, c5, c6, c7)));
        }
#undef KEYS
#undef KPTR
#undef KDECL
#undef KFMA
    }
    KV(scores_tail)(j, qs, nq, K, t, n, s, lds);
}

/* KV(weighted_sums) in zmm registers, with the query heads of one row (which see the same keys: the
 * G heads of its KV head) up to six at a time: each value vector is loaded once for all of them and
 * their 4 x 6 accumulators keep the FMA units busy where one query's four chains wait on the FMA
 * latency. Each query's lanes go through the same chain, key by key: the same bits. */
/* W (a constant where inlined) queries of one row: their sums in acc[W][64] over the keys ps[c..)
 * below b1 (and below m), p[q * lds + c] query q's weight of key c; returns the next c. */
static inline ZMM_ATTR __attribute__((always_inline)) int64_t KV(value_chunk)(
    const int W, const KV_T *V, int64_t ld, int64_t d0, const int32_t *ps, int64_t m, int64_t c, int64_t b1,
    const float *p, int64_t lds, float *acc)
{
#define QS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define QLOAD(q)                                                                                 \
    __m512 a##q##0, a##q##1, a##q##2, a##q##3;                                                   \
    const float *p##q = p + (W > q ? q : 0) * lds;                                               \
    if (W > q) {                                                                                 \
        const float *aq = acc + q * 64;                                                          \
        a##q##0 = _mm512_loadu_ps(aq), a##q##1 = _mm512_loadu_ps(aq + 16);                      \
        a##q##2 = _mm512_loadu_ps(aq + 32), a##q##3 = _mm512_loadu_ps(aq + 48);                  \
    }
    QS(QLOAD)
    for (; c < m && ps[c] < b1; c++) {
        const KV_T *v = V + (int64_t)ps[c] * ld + d0;
        const __m512 v0 = LOAD16(v), v1 = LOAD16(v + 16), v2 = LOAD16(v + 32), v3 = LOAD16(v + 48);
#define QFMA(q)                                                                                  \
        if (W > q) {                                                                             \
            const __m512 pt = _mm512_set1_ps(p##q[c]);                                           \
            a##q##0 = _mm512_fmadd_ps(pt, v0, a##q##0), a##q##1 = _mm512_fmadd_ps(pt, v1, a##q##1); \
            a##q##2 = _mm512_fmadd_ps(pt, v2, a##q##2), a##q##3 = _mm512_fmadd_ps(pt, v3, a##q##3); \
        }
        QS(QFMA)
    }
#define QSTORE(q)                                                                                \
    if (W > q) {                                                                                 \
        float *aq = acc + q * 64;                                                                \
        _mm512_storeu_ps(aq, a##q##0), _mm512_storeu_ps(aq + 16, a##q##1);                       \
        _mm512_storeu_ps(aq + 32, a##q##2), _mm512_storeu_ps(aq + 48, a##q##3);                  \
    }
    QS(QSTORE)
#undef QLOAD
#undef QFMA
#undef QSTORE
#undef QS
    return c;
}

static ZMM_ATTR void KV(weighted_sums_z)(const attn_job *j, int64_t nq, int64_t G, const KV_T *V, const int32_t *pos,
                                         const int64_t *npos, const float *p, int64_t lds, int64_t n, const float *inv,
                                         float *acc, int64_t *cur, float *const *outs, int64_t d0)
{
    const int64_t ld = j->ld;
    memset(acc, 0, (size_t)nq * 64 * sizeof(float));
    memset(cur, 0, (size_t)nq * sizeof(int64_t));
    for (int64_t b1 = VALUE_BLOCK; b1 - VALUE_BLOCK < n; b1 += VALUE_BLOCK)
        for (int64_t q0 = 0, q1; q0 < nq; q0 = q1) {
            const int64_t r = q0 / G, w = (r + 1) * G - q0 < 6 ? (r + 1) * G - q0 : 6; /* within row r */
            const int32_t *ps = pos + r * n;
            const int64_t m = npos[r];
            int64_t c = cur[q0];
            q1 = q0 + w;
            if (c >= m || ps[c] >= b1) continue;
            const float *pq = p + q0 * lds;
            float *aq = acc + q0 * 64;
            switch (w) { /* a loop for each width, without a branch per query inside */
            case 1: c = KV(value_chunk)(1, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            case 2: c = KV(value_chunk)(2, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            case 3: c = KV(value_chunk)(3, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            case 4: c = KV(value_chunk)(4, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            case 5: c = KV(value_chunk)(5, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            default: c = KV(value_chunk)(6, V, ld, d0, ps, m, c, b1, pq, lds, aq); break;
            }
            for (int64_t q = q0; q < q1; q++) cur[q] = c;
        }
    for (int64_t qi = 0; qi < nq; qi++) {
        const __m512 iv = _mm512_set1_ps(inv[qi]);
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(outs[qi] + d0 + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(acc + qi * 64 + 16 * i), iv));
    }
}

/* Lanes [d0, dv) (fewer than 64) of one query's output, the same sums in a generic loop. */
static void KV(weighted_rest)(const KV_T *V, const int32_t *pos, int64_t n, const float *p, int64_t ld, int64_t d0,
                              int64_t dv, float inv, float *out)
{
    const int64_t w = dv - d0, full = w / 8;
    const __m256 inv8 = _mm256_set1_ps(inv);
    __m256 a[8];
    float rest[8] = {0};
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const KV_T *v = V + (int64_t)pos[t] * ld + d0;
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int64_t i = 0; i < full; i++) a[i] = _mm256_fmadd_ps(pt, LOAD8(v + 8 * i), a[i]);
        for (int64_t i = 8 * full; i < w; i++) rest[i - 8 * full] = fmaf(p[t], LOAD1(v + i), rest[i - 8 * full]);
    }
    for (int64_t i = 0; i < full; i++) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(a[i], inv8));
    for (int64_t i = 8 * full; i < w; i++) out[d0 + i] = rest[i - 8 * full] * inv;
}

/* An item's attention once its rows' visible positions and query / output pointers are known
 * (see item): scores, softmax terms, weighted sums of the values. */
static void KV(attend)(const attn_job *j, const item_mem *m, int64_t nq, int64_t G, int64_t n, int64_t lds,
                       int64_t base)
{
    const KV_T *K = (const KV_T *)j->k + base, *V = (const KV_T *)j->v + base;
    (zmm() ? KV(scores_z) : KV(scores))(j, m->qs, nq, K, n, m->s, lds);
    for (int64_t qi = 0; qi < nq; qi++) { /* a row that sees nothing attends to nothing: zeros */
        const int64_t np = m->npos[qi / G];
        m->inv[qi] = np ? 1.0f / softmax_terms(m->s + qi * lds, m->pos + qi / G * n, np) : 0.0f;
    }
    int64_t d0 = 0;
    for (; d0 + 64 <= j->dv; d0 += 64)
        (zmm() ? KV(weighted_sums_z) : KV(weighted_sums))(j, nq, G, V, m->pos, m->npos, m->s, lds, n, m->inv,
                                                               m->acc, m->cur, m->outs, d0);
    if (d0 < j->dv)
        for (int64_t qi = 0; qi < nq; qi++)
            KV(weighted_rest)(V, m->pos + qi / G * n, m->npos[qi / G], m->s + qi * lds, j->ld, d0, j->dv, m->inv[qi],
                              m->outs[qi]);
}

#undef KV_T
#undef KV
#undef LOAD1
#undef LOAD8
#undef LOAD16
