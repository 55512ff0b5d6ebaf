/* What the kernel sources share: the thread pool (pool.c), AMX's permission and tile configuration
 * (amx.c), and the kernels decoder.c calls. */
#pragma once
#include <stdint.h>

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SP_AMX 1 /* the compiler knows AMX */
#endif

/* Per-thread scratch handed to every item: 16 x 16 floats (a partial linear panel). */
#define SP_SCRATCH_FLOATS 256

/* Run fn(job, item, scratch) for item in [0, n_items) on the caller's thread plus up to
 * nthreads - 1 pool workers, in chunks of `chunk` consecutive items. Which thread runs an item
 * never changes its result: every kernel computes an item the same way on any thread. When the
 * pool is busy (another caller), or nthreads <= 1, the caller runs every item itself. */
void sp_parallel(void (*fn)(const void *job, int64_t item, float *scratch), const void *job,
                 int64_t n_items, int64_t chunk, int nthreads);

/* Whether the CPU and OS run AVX-512F/BW/VL (panels.c). */
int sp_avx512(void);

/* What the panel kernels share (panels.c; linear.c, w8a8.c and bf16_tiles.c use them, panels.c none of
 * them): a panel's output columns, the weight bytes one work item holds at most (~10 us of work, the most
 * a caller waits for), a partial panel's rows from scratch into y, residual added; */
#define SP_PANEL_COLS 16
#define SP_CHUNK_BYTES (128 * 1024)
void sp_store_partial(const float *scratch, int64_t m0, int64_t ms, int64_t n0, int64_t cols, const float *res,
                      int64_t ldr, float *y, int64_t ldy);
/* a call's activation scratch (quantized or split rows), per thread, grown as needed (NULL: no memory); */
void *sp_rows_memory(int64_t bytes);
/* y = res + bias for a product over no k (bias, res: NULL for none); */
void sp_empty_product(int64_t M, int64_t N, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy);
/* and the product of M rows by N columns over the pool: groups of four panels (`group_bytes` of weights
 * each) per work item, four at once where all are full, else a full pair and single panels (a partial
 * panel is the last), every row in slabs of 16, each slab(job, p, np, m0, ms, scratch) computing rows
 * [m0, m0 + ms) times panels [p, p + np); chunks of at most 128 KB of weights, and at least four per
 * thread (small layers: a balanced finish). */
typedef void (*sp_slab_fn)(const void *job, int64_t p, int np, int64_t m0, int64_t ms, float *scratch);
void sp_parallel_slabs(sp_slab_fn slab, const void *job, int64_t M, int64_t N, int64_t group_bytes, int nthreads);

/* The kernels a decoder layer is made of (linear.c, attention.c, layers.c), for decoder.c. */
void sp_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int fmt, int64_t N,
               const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads,
               int group, int prefetch, int isa);
void sp_linear_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads,
                    int prefetch, int isa);
/* w8a8.c's activations, which w4a8.c and w6a8.c share: x [M, K] (row stride ldx) quantized per block of 32 k into
 * the calling thread's scratch, block-major: q [B][M][32] int8, d [B][M] (amax / 127), c [B][M] (128 * sum(q)),
 * then `extra` bytes per row and block for the caller's own values. Returns 0 where there is nothing to multiply,
 * y then written: the empty product (K = 0: y = res + bias), or NaN (no memory for the rows: said in the output
 * rather than left stale). `isa` as sp_linear's: AVX-512 quantization (the same bits) where either bit is set. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *c;
    void *extra;
    int64_t B;
} sp_rows_t;
int sp_block_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t N, const float *bias, const float *res,
                  int64_t ldr, float *y, int64_t ldy, int isa, int64_t extra, sp_rows_t *rows);
/* 4/5-bit weights times int8 activations (w4a8.c; `kind` 0 w4a8, 1 w4a8k: fp32 scales, 2 w4a8s: no offsets, 3 w5a8) and
 * whether AVX-512 VNNI runs here (w8a8.c). */
void sp_linear_w4a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads, int isa,
                    int kind);
int sp_vnni(void);
/* 6-bit weights (Q6_K's values, scales per 16 k) times int8 activations (w6a8.c). */
void sp_linear_w6a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads, int isa);
void sp_attention(const float *q, int64_t R, int64_t H, int64_t ldq, const void *k, const void *v, int kv16,
                  int64_t KVH, int64_t slot_stride, int64_t head_stride, int64_t ld, int64_t dk,
                  int64_t dv, const int64_t *slot, const int64_t *ctx, const int64_t *len,
                  const uint8_t *mask, int64_t ldm, float scale, float *out, int64_t ldo,
                  int nthreads);
void sp_rmsnorm(const float *x, int64_t R, int64_t n, int64_t ldx, const float *w, float eps, float *y,
                int64_t ldy);
void sp_silu_mul(const float *gu, int64_t R, int64_t n, int64_t ldg, float *y, int64_t ldy);
void sp_rope_cache(float *qkv, int64_t R, int64_t ldq, int64_t H, int64_t KVH, int64_t hd,
                   const float *cos, const float *sin, int64_t ldc, const float *qn, const float *kn, float eps,
                   void *kc, void *vc, int kv16, int64_t slot_stride, int64_t head_stride, int64_t ld,
                   const int64_t *slot, const int64_t *write);

/* AMX (amx.c): the tile data permission, asked once per process (1: granted), and a tile
 * configuration loaded on the calling thread unless its current one has the same key (> 0). */
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} sp_tilecfg_t;
int sp_amx_permit(void);
/* GCC's AMX tile load and store intrinsics are asm statements that do not tell the compiler they read
 * or write memory, so it may move (or drop) plain stores and loads of the same data across them: a
 * compiler barrier between the two, wherever a tile reads what the code wrote or the code reads what a
 * tile stored. */
#define SP_TILE_FENCE() __asm__ volatile("" ::: "memory")
void sp_amx_load(const sp_tilecfg_t *cfg, int key);
/* The calling thread's configuration is no longer taken as loaded: code outside these kernels may have
 * run on it since its last tile instruction, and released the tiles (oneDNN does after its own AMX
 * products, as torch's bf16 matmuls on the CPU run) or loaded its own configuration; a tile
 * instruction after a release, with the configuration still taken as ours, is an illegal
 * instruction. sp_parallel calls it for its caller on every call (its workers run only these kernels). */
void sp_amx_forget(void);

/* bf16 weights on AMX tiles (bf16_tiles.c): whether they run here, and the product sp_linear hands
 * format SP_BF16T. */
int sp_bf16_tiles(void);
void sp_linear_bf16t(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N,
                     const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int nthreads);

/* The norms of a row as w8a8 rounds it and of its rounding error (w8a8.c), for screen.c. */
void sp_w8a8_norms(const float *x, int64_t K, double *hat, double *err);

/* Rows ids[0..n) of a GGUF block table as fp32 (gguf_rows.c; kind: gguf_blocks.TYPES' index): 0, or 1 + the
 * index of the first id outside 0..rows-1. */
int64_t sp_gguf_rows(int kind, const uint8_t *raw, int64_t rows, int64_t row_bytes, const int64_t *ids, int64_t n,
                     int64_t cols, float *out);

/* Each row's index of its largest value (argmax.c): x [R, n] with row stride ld -> out [R]. */
void sp_argmax(const float *x, int64_t R, int64_t n, int64_t ld, int64_t *out);
