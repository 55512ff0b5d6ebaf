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
#undef KEYS
#undef KPTR
#undef KDECL
#undef KFMA
    }
    for (; t < n; t++)
        for (int64_t qi = 0; qi < nq; qi++) s[qi * lds + t] = j->scale * KV(dot)(qs[qi], K + t * ld, dk);
}

WEIGHTED_SUMS(KV(weighted_sums), , __m256, 8, OP256, _mm256_set1_ps, LOAD8)
WEIGHTED_SUMS(KV(weighted_sums_z), __attribute__((target("avx512f,avx2,fma,f16c"))), __m512, 16, OP512,
              _mm512_set1_ps, LOAD16)

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
    KV(scores)(j, m->qs, nq, K, n, m->s, lds);
    for (int64_t qi = 0; qi < nq; qi++) { /* a row that sees nothing attends to nothing: zeros */
        const int64_t np = m->npos[qi / G];
        m->inv[qi] = np ? 1.0f / softmax_terms(m->s + qi * lds, m->pos + qi / G * n, np) : 0.0f;
    }
    int64_t d0 = 0;
    for (; d0 + 64 <= j->dv; d0 += 64)
        (sp_avx512() ? KV(weighted_sums_z) : KV(weighted_sums))(j, nq, G, V, m->pos, m->npos, m->s, lds, n, m->inv,
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
