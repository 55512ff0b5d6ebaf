/* What the panel kernels share (linear.c, w8a8.c, bf16_tiles.c call these; this file calls none of
 * them): the CPU's AVX-512 support, a partial panel's store, the per-thread activation scratch, the
 * product over no k, and the pool's split of a product into groups of four panels. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Whether this CPU and its OS run AVX-512F (libgcc checks the OS saves the zmm state). */
int sp_avx512(void)
{
    static int ok = -1;
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
             && __builtin_cpu_supports("avx512vl");
    }
    return ok;
}

/* A partial panel's rows [m0, m0 + ms) from scratch [ms][16] into y's columns [n0, n0 + cols), the
 * residual (row stride ldr; NULL: none) added as the full panels add it: res + sum. */
void sp_store_partial(const float *scratch, int64_t m0, int64_t ms, int64_t n0, int64_t cols, const float *res,
                      int64_t ldr, float *y, int64_t ldy)
{
    for (int64_t i = m0; i < m0 + ms; i++) {
        float *yi = y + i * ldy + n0;
        const float *si = scratch + (i - m0) * SP_PANEL_COLS;
        if (res)
            for (int64_t c = 0; c < cols; c++) yi[c] = res[i * ldr + n0 + c] + si[c];
        else
            memcpy(yi, si, cols * sizeof(float));
    }
}

/* The activation scratch of one call, kept per thread and grown as needed (no allocation per call). */
static __thread struct { void *mem; int64_t bytes; } rows_buf;

void *sp_rows_memory(int64_t bytes)
{
    if (bytes > rows_buf.bytes) {
        free(rows_buf.mem);
        rows_buf.bytes = 0;
        rows_buf.mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!rows_buf.mem) return 0;
        rows_buf.bytes = bytes;
    }
    return rows_buf.mem;
}

void sp_empty_product(int64_t M, int64_t N, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t n = 0; n < N; n++) {
            const float v = bias ? 0.0f + bias[n] : 0.0f;
            y[i * ldy + n] = res ? res[i * ldr + n] + v : v;
        }
}

typedef struct {
    sp_slab_fn slab;
    const void *job;
    int64_t M, N;
} slabs_t;

/* Work item g of sp_parallel_slabs: panels [4g, 4g + 4). */
static void slab_group(const void *arg, int64_t g, float *scratch)
{
    const slabs_t *s = arg;
    const int64_t P = (s->N + SP_PANEL_COLS - 1) / SP_PANEL_COLS, p0 = 4 * g, p1 = p0 + 4 < P ? p0 + 4 : P;
    for (int64_t m0 = 0; m0 < s->M; m0 += 16) {
        const int64_t ms = s->M - m0 < 16 ? s->M - m0 : 16;
        for (int64_t p = p0; p < p1;) {
            const int np = (p + 4) * SP_PANEL_COLS <= s->N && p + 4 <= p1 ? 4 : (p + 2) * SP_PANEL_COLS <= s->N && p + 2 <= p1 ? 2 : 1;
            s->slab(s->job, p, np, m0, ms, scratch);
            p += np;
        }
    }
}

void sp_parallel_slabs(sp_slab_fn slab, const void *job, int64_t M, int64_t N, int64_t group_bytes, int nthreads)
{
    const slabs_t s = {slab, job, M, N};
    const int64_t items = (N + 4 * SP_PANEL_COLS - 1) / (4 * SP_PANEL_COLS), by_bytes = SP_CHUNK_BYTES / (group_bytes > 0 ? group_bytes : 1);
    const int64_t balanced = items / (4 * (nthreads > 1 ? nthreads : 1));
    sp_parallel(slab_group, &s, items, by_bytes < balanced ? by_bytes : balanced, nthreads);
}
