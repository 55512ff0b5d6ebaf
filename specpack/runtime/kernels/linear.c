/* Small-M fp32 linear layer, y[M,N] = x[M,K] @ W[N,K]^T (+ bias), for AVX2 + FMA.
 *
 * Weight layout ("panels"): W is cut into P = ceil(N/16) panels of 16 output columns; panel p is
 * stored K-major, w[p][k][j] = W[16p + j][k], zero-padded past N. One k of a panel is one 64-byte
 * cache line, and a thread's share of panels is one sequential stream.
 *
 * Reduction order (the determinism contract): every output element y[i][n] is summed in fixed
 * k-blocks of KB: for each block b, s_b = one fused multiply-add chain from 0 over the block's k;
 * acc = s_0, then acc = acc + s_b in block order; then acc + bias[n]. Blocked summation keeps the
 * rounding error growing with KB + K/KB instead of K (on SmolLM2 the logits' largest difference to
 * ONNX Runtime's MLAS fell from 1.0e-4 to 5.3e-5 with it). The order does not depend on M, on which rows share a tile, on which
 * thread computes the panel or on how many threads run, so row i of an M-row product is
 * bit-identical to the 1-row product of row i.
 *
 * Threads: the caller's thread plus a small persistent pool of workers that claim chunks of panels
 * from an atomic ticket (a late-waking worker just takes fewer chunks, or none). Idle workers
 * spin for `spin_us` after a job (set from Python: 300 us, so the next layer's matmul finds them
 * awake), then sleep on a futex.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#define NR 16          /* output columns per panel: two ymm registers */
#define MR_MAX 6       /* rows per register tile: 12 accumulators + 2 weights + 1 broadcast */
#define MAX_THREADS 16
#define CHUNK_BYTES (128 * 1024) /* of weights: ~10 us of work, the most a caller waits for */
/* How long a caller spins for its workers' last chunks before sleeping on a futex. Bounded,
 * because on this machine class the two vCPUs are SMT siblings: a spinning thread costs the other
 * ~40% of its FMA throughput (113 -> 70 GFLOP/s measured). 10, 50 and 200 us measured the same
 * in a decode loop; back-to-back calls gain a little from the longer ones. */
#define CALLER_SPIN_NS 50000

/* ---------------------------------------------------------------- compute */

#define KB 128          /* k-block: 8 KB of panel, stays in L1; the summation's block too */

/* Software prefetch into L2 (T1), 128 lines = 8 KB ahead of the k being computed. Measured on
 * the 113 MB head at M = 8: ratio to M = 1 of 1.06 with T1 against 1.29 with T0 (L1 fill buffers
 * run out) and 1.9 without prefetching, M = 1 alike. */
static int prefetch_dist = 128; /* cache lines (= k steps) ahead; 0 disables */

/* One register tile: rows x[0..mr) times the panel's 16 columns over k in [k0, k1). The block's
 * products are summed from zero in registers, then added to `acc` (row stride lda), which holds
 * the sum of the earlier k-blocks (`first`: there are none); `bias` (16 floats, or NULL) is added
 * after the last block. Named accumulators, not an array: GCC spills arrays of vectors to the
 * stack. */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
static inline __attribute__((always_inline)) void tile(
    const int mr, const int prefetch, const float *x, int64_t ldx, const float *w, int64_t k0,
    int64_t k1, float *acc, int64_t lda, int first, const float *bias, const char *pf, int64_t pfstep)
{
#define DECL(i)                                                                                  \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();                         \
    const float *x##i = x + (mr > i ? i : 0) * ldx;
    ROWS(DECL)
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * NR;
        if (prefetch) _mm_prefetch(pf + (k - k0) * pfstep, _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#define STEP(i)                                                                                  \
        if (mr > i) {                                                                            \
            const __m256 b = _mm256_broadcast_ss(x##i + k);                                      \
            c##i##0 = _mm256_fmadd_ps(b, w0, c##i##0);                                           \
            c##i##1 = _mm256_fmadd_ps(b, w1, c##i##1);                                           \
        }
        ROWS(STEP)
    }
#define STORE(i)                                                                                 \
    if (mr > i) {                                                                                \
        if (!first) {                                                                            \
            c##i##0 = _mm256_add_ps(_mm256_loadu_ps(acc + i * lda), c##i##0);                    \
            c##i##1 = _mm256_add_ps(_mm256_loadu_ps(acc + i * lda + 8), c##i##1);                \
        }                                                                                        \
        if (bias) {                                                                              \
            c##i##0 = _mm256_add_ps(c##i##0, _mm256_loadu_ps(bias));                             \
            c##i##1 = _mm256_add_ps(c##i##1, _mm256_loadu_ps(bias + 8));                         \
        }                                                                                        \
        _mm256_storeu_ps(acc + i * lda, c##i##0);                                                \
        _mm256_storeu_ps(acc + i * lda + 8, c##i##1);                                            \
    }
    ROWS(STORE)
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                        int, const float *, const char *, int64_t);
#define TILE_FN(R, PF)                                                                           \
    static void tile##R##_##PF(const float *x, int64_t ldx, const float *w, int64_t k0,          \
                               int64_t k1, float *acc, int64_t lda, int first, const float *bias, \
                               const char *pf, int64_t pfstep)                                   \
    { tile(R, PF, x, ldx, w, k0, k1, acc, lda, first, bias, pf, pfstep); }
TILE_FN(1, 0) TILE_FN(2, 0) TILE_FN(3, 0) TILE_FN(4, 0) TILE_FN(5, 0) TILE_FN(6, 0)
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1) TILE_FN(5, 1) TILE_FN(6, 1)
static const tile_fn TILES[2][MR_MAX + 1] = {
    {0, tile1_0, tile2_0, tile3_0, tile4_0, tile5_0, tile6_0},
    {0, tile1_1, tile2_1, tile3_1, tile4_1, tile5_1, tile6_1},
};

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t M, N, K, ldx, ldy;
} job_t;

/* All M rows times one panel. Rows go in ceil(M/6) balanced tiles (8 rows: 4 + 4, so each tile
 * keeps >= 8 FMA chains in flight), over k-blocks of KB: every tile reuses the block from L1, so
 * the panel is read from memory once. */
static void panel(const job_t *j, int64_t p, float *scratch)
{
    const int64_t K = j->K, n0 = p * NR, cols = j->N - n0 < NR ? j->N - n0 : NR;
    const float *w = j->w + p * K * NR;
    const int full = cols == NR;
    const int64_t lda = full ? j->ldy : NR; /* a partial panel goes through scratch [16][16] */
    float bias16[NR] = {0};
    if (j->bias) memcpy(bias16, j->bias + n0, cols * sizeof(float));
    /* the same k-blocks for every M: a row's sums do not depend on how many rows there are */
    const int64_t kb = KB, nblocks = K > 0 ? (K + kb - 1) / kb : 1;
    for (int64_t m0 = 0; m0 < j->M; m0 += 16) { /* rows in slabs of 16 so scratch stays small */
        const int64_t ms = j->M - m0 < 16 ? j->M - m0 : 16;
        const int64_t ntiles = (ms + MR_MAX - 1) / MR_MAX;
        float *acc = full ? j->y + m0 * j->ldy + n0 : scratch;
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t k0 = b * kb, k1 = k0 + kb < K ? k0 + kb : K;
            for (int64_t t = 0, r = 0; t < ntiles; t++) {
                const int64_t mr = (ms - r) / (ntiles - t);
                /* the tiles share prefetching the line `prefetch_dist` ahead of each k of the
                 * block, so memory requests flow while any tile computes */
                const char *pf = (const char *)(w + k0 * NR) + prefetch_dist * 64
                                 + t * (k1 - k0) * 64 / ntiles;
                TILES[prefetch_dist > 0][mr](j->x + (m0 + r) * j->ldx, j->ldx, w, k0, k1,
                    acc + r * lda, lda, k0 == 0, k1 == K && j->bias ? bias16 : 0, pf,
                    (64 + ntiles - 1) / ntiles);
                r += mr;
            }
        }
        if (!full)
            for (int64_t i = m0; i < m0 + ms; i++)
                memcpy(j->y + i * j->ldy + n0, scratch + (i - m0) * NR, cols * sizeof(float));
    }
}

/* ---------------------------------------------------------------- pool */

/* Work is handed out as chunks of panels through one atomic word, `ticket` = (job id << 32) |
 * chunks left unclaimed. A thread claims a chunk by decrementing it, only while the id is the
 * current job's, so the job's description cannot change under a claimed chunk (the caller posts
 * the next job only after every chunk of this one is done). Nobody waits for a worker that
 * has not shown up: the caller takes what is left, then waits only for chunks already claimed. */
static struct {
    pthread_mutex_t lock;        /* one pooled job at a time; other callers run alone */
    int nworkers, active;        /* started; taking part (by id) */
    _Atomic uint32_t gen;        /* job id, bumped once per job; workers sleep on it */
    _Atomic uint64_t ticket;
    _Atomic uint32_t completed;  /* chunks of the current job done; the caller sleeps on it */
    _Atomic int caller_sleeps;
    _Atomic int sleepers;
    int64_t nchunks, chunk;
    job_t job;
    long spin_ns;
    uint32_t spawn_gen;          /* gen when the workers were started */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = 0};

static long futex(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, addr, op, val, NULL, NULL, 0);
}

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run chunks of job `id` until none is left. */
static void run_chunks(uint32_t id)
{
    float scratch[16 * NR];
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        do {
            if ((uint32_t)(t >> 32) != id || (uint32_t)t == 0) return;
        } while (!atomic_compare_exchange_weak(&pool.ticket, &t, t - 1));
        const int64_t c = pool.nchunks - (uint32_t)t, P = (pool.job.N + NR - 1) / NR;
        const int64_t p1 = (c + 1) * pool.chunk < P ? (c + 1) * pool.chunk : P;
        for (int64_t p = c * pool.chunk; p < p1; p++) panel(&pool.job, p, scratch);
        if (atomic_fetch_add(&pool.completed, 1) + 1 == pool.nchunks && atomic_load(&pool.caller_sleeps))
            futex(&pool.completed, FUTEX_WAKE_PRIVATE, 1);
    }
}

/* Spin until *addr != old for at most spin_ns, then sleep on the futex (counted in *sleeping). */
static void wait_change(_Atomic uint32_t *addr, uint32_t old, long spin_ns, _Atomic int *sleeping)
{
    const long t0 = now_ns();
    for (int i = 0; atomic_load_explicit(addr, memory_order_acquire) == old; i++) {
        if ((i & 255) == 0 && now_ns() - t0 > spin_ns) {
            atomic_fetch_add(sleeping, 1);
            while (atomic_load(addr) == old) futex(addr, FUTEX_WAIT_PRIVATE, old);
            atomic_fetch_sub(sleeping, 1);
            return;
        }
        _mm_pause();
    }
}

static void *worker(void *arg)
{
    const int id = (int)(intptr_t)arg;
    uint32_t seen = pool.spawn_gen; /* the first job may be posted before this thread runs */
    for (;;) {
        wait_change(&pool.gen, seen, pool.spin_ns, &pool.sleepers);
        seen = atomic_load(&pool.gen);
        if (id <= pool.active) run_chunks(seen);
    }
    return NULL;
}

static void grow_pool(int n)
{
    pool.spawn_gen = atomic_load(&pool.gen);
    while (pool.nworkers < n && pool.nworkers < MAX_THREADS - 1) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, (void *)(intptr_t)(pool.nworkers + 1)) != 0) return;
        pthread_detach(th);
        pool.nworkers++;
    }
}

static void after_fork_child(void)
{
    /* the workers did not survive fork(): start over with an empty pool */
    pthread_mutex_init(&pool.lock, NULL);
    pool.nworkers = 0;
    atomic_store(&pool.sleepers, 0);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* ---------------------------------------------------------------- API */

int sp_abi_version(void) { return 1; }

void sp_set_spin_us(long us) { pool.spin_ns = us * 1000; }

void sp_set_prefetch(int lines) { prefetch_dist = lines; }

/* y[M,N] (row stride ldy) = x[M,K] (row stride ldx) @ W^T + bias, W packed as above. */
void sp_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N,
               const float *bias, float *y, int64_t ldy, int nthreads)
{
    if (M <= 0 || N <= 0) return;
    const job_t job = {x, w, bias, y, M, N, K, ldx, ldy};
    const int64_t P = (N + NR - 1) / NR;
    int64_t chunk = CHUNK_BYTES / ((K > 0 ? K : 1) * NR * 4);
    chunk = chunk < 1 ? 1 : chunk;
    if (nthreads > P) nthreads = (int)P;
    pthread_once(&fork_once, install_fork_handler);
    if (nthreads <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        float scratch[16 * NR];
        for (int64_t p = 0; p < P; p++) panel(&job, p, scratch);
        return;
    }
    grow_pool(nthreads - 1);
    const uint32_t id = atomic_load(&pool.gen) + 1;
    pool.job = job;
    pool.chunk = chunk;
    pool.nchunks = (P + chunk - 1) / chunk;
    pool.active = nthreads - 1;
    atomic_store(&pool.completed, 0);
    atomic_store(&pool.ticket, (uint64_t)id << 32 | (uint64_t)pool.nchunks);
    atomic_store(&pool.gen, id);
    if (atomic_load(&pool.sleepers) > 0) futex(&pool.gen, FUTEX_WAKE_PRIVATE, MAX_THREADS);
    run_chunks(id);
    const uint32_t n = (uint32_t)pool.nchunks;
    for (uint32_t done; (done = atomic_load(&pool.completed)) != n;) /* chunks still running */
        wait_change(&pool.completed, done, CALLER_SPIN_NS, &pool.caller_sleeps);
    pthread_mutex_unlock(&pool.lock);
}
