/* Can this CPU overlap a weight stream with VNNI compute, and which software prefetch helps? (BENCHMARKS,
 * "Where the multi-row products lose their time".) Two threads each walk half of a 128 MB buffer in slabs
 * of 20 KB (a w8a8 panel pair at K = 576); per slab, two passes of vpdpbusd over it from cache (about the
 * work of a 9-12 row tile). Prints the stream alone, the compute alone (one slab reused), and both with:
 * no software prefetch (the hardware prefetchers only), the next slab prefetched at its start in one burst
 * (T0 / T1 / T2, 1-4 slabs ahead), and the next slab's lines prefetched spread over the first pass (T0 / T1).
 * Then the same without software prefetch in "calls" of 0.5 / 4 / 32 MB per thread with a barrier between
 * them, as a forward's 120 products are.
 *
 *   gcc -O2 -fopenmp bench/overlap.c -o /tmp/overlap && /tmp/overlap
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOT ((size_t)128 << 20)
#define SLAB ((size_t)20 << 10)
enum { NONE, BURST_T0, BURST_T1, BURST_T2, SPREAD_T0, SPREAD_T1 };
static const char *NAMES[] = {"none (hardware only)", "burst T0", "burst T1", "burst T2", "spread T0", "spread T1"};
static char *buf;

static inline void prefetch(const char *p, int how)
{
    if (how == BURST_T0 || how == SPREAD_T0) _mm_prefetch(p, _MM_HINT_T0);
    else if (how == BURST_T1 || how == SPREAD_T1) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T2);
}

/* ms for the whole buffer: passes 0 = stream only; hot = the first slab every time (compute only). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double run(int passes, int how, int dist, int hot)
{
    const double t = omp_get_wtime();
    long long sink = 0;
#pragma omp parallel num_threads(2) reduction(+ : sink)
    {
        const char *base = buf + omp_get_thread_num() * (TOT / 2), *end = base + TOT / 2;
        __m512i acc[12];
        for (int a = 0; a < 12; a++) acc[a] = _mm512_setzero_si512();
        const __m512i x = _mm512_set1_epi32(0x01020304);
        for (size_t s = 0; s < TOT / 2 / SLAB; s++) {
            const char *p = base + (hot ? 0 : s * SLAB), *next = p + dist * SLAB;
            const int ahead = how != NONE && !hot && next + SLAB <= end;
            if (ahead && how <= BURST_T2)
                for (size_t l = 0; l < SLAB; l += 64) prefetch(next + l, how);
            if (passes == 0)
                for (size_t l = 0; l < SLAB; l += 64) acc[0] = _mm512_add_epi32(acc[0], _mm512_load_si512(p + l));
            for (int r = 0; r < passes; r++)
                for (size_t l = 0; l < SLAB; l += 128) {
                    if (ahead && how >= SPREAD_T0 && r == 0) {
                        prefetch(next + l, how);
                        prefetch(next + l + 64, how);
                    }
                    const __m512i w0 = _mm512_load_si512(p + l), w1 = _mm512_load_si512(p + l + 64);
#pragma GCC unroll 6
                    for (int a = 0; a < 6; a++) {
                        acc[a] = _mm512_dpbusd_epi32(acc[a], w0, x);
                        acc[6 + a] = _mm512_dpbusd_epi32(acc[6 + a], w1, x);
                    }
                }
        }
        for (int a = 0; a < 12; a++) sink += _mm512_reduce_add_epi32(acc[a]);
    }
    if (sink == 42) puts("");
    return (omp_get_wtime() - t) * 1e3;
}

/* ms for stream + compute (two passes, hardware prefetch only) in calls of `call` bytes per thread. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double calls(size_t call)
{
    const double t = omp_get_wtime();
    long long sink = 0;
#pragma omp parallel num_threads(2) reduction(+ : sink)
    {
        const int id = omp_get_thread_num();
        __m512i acc[12];
        for (int a = 0; a < 12; a++) acc[a] = _mm512_setzero_si512();
        const __m512i x = _mm512_set1_epi32(0x01020304);
        for (size_t c0 = 0; c0 < TOT / 2; c0 += call) {
            const char *base = buf + 2 * c0 + id * call; /* this thread's half of the call */
            for (size_t s = 0; s < call / SLAB; s++)
                for (int r = 0; r < 2; r++)
                    for (size_t l = 0; l < SLAB; l += 128) {
                        const __m512i w0 = _mm512_load_si512(base + s * SLAB + l);
                        const __m512i w1 = _mm512_load_si512(base + s * SLAB + l + 64);
#pragma GCC unroll 6
                        for (int a = 0; a < 6; a++) {
                            acc[a] = _mm512_dpbusd_epi32(acc[a], w0, x);
                            acc[6 + a] = _mm512_dpbusd_epi32(acc[6 + a], w1, x);
                        }
                    }
#pragma omp barrier
        }
        for (int a = 0; a < 12; a++) sink += _mm512_reduce_add_epi32(acc[a]);
    }
    if (sink == 42) puts("");
    return (omp_get_wtime() - t) * 1e3;
}

int main(void)
{
    if (!__builtin_cpu_supports("avx512vnni")) {
        puts("this CPU has no AVX-512 VNNI");
        return 1;
    }
    buf = aligned_alloc(64, TOT);
    memset(buf, 1, TOT);
    for (int round = 0; round < 2; round++) {
        printf("round %d: stream only %.2f ms, compute only %.2f ms\n", round + 1, run(0, NONE, 0, 0), run(2, NONE, 0, 1));
        for (int how = NONE; how <= SPREAD_T1; how++)
            for (int dist = 1; dist <= (how == NONE ? 1 : 4); dist *= 2)
                printf("  both, prefetch %-20s %d slab(s) ahead: %.2f ms\n", NAMES[how], dist, run(2, how, dist, 0));
        for (size_t call = (size_t)512 << 10; call <= TOT / 2; call *= 8)
            printf("  both, in calls of %5zu KB a thread with a barrier between: %.2f ms\n", call >> 10, calls(call));
    }
    return 0;
}
