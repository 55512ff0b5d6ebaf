/* The kernels' thread pool: the caller's thread plus a few persistent workers.
 *
 * A job is n items (linear: panels of weights; attention: (row, kv head) pairs) handed out in
 * chunks through one atomic word, `ticket` = (job id << 32) | chunks left unclaimed. A thread
 * claims a chunk by decrementing it, only while the id is the current job's, so the job's
 * description cannot change under a claimed chunk (the caller posts the next job only after every
 * chunk of this one is done). Nobody waits for a worker that has not shown up: the caller takes
 * what is left, then waits only for chunks already claimed. Idle workers spin for `spin_us` after
 * a job (set from Python: 300 us, so the next layer's matmul finds them awake), then sleep on a
 * futex.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "kernels.h"

#define MAX_THREADS 16
/* How long a caller spins for its workers' last chunks before sleeping on a futex. Bounded,
 * because where two vCPUs are SMT siblings a spinning thread costs the other ~40% of its FMA
 * throughput (113 -> 70 GFLOP/s measured on an earlier host of this machine class). 10, 50 and 200 us measured the same
 * in a decode loop; back-to-back calls gain a little from the longer ones. */
#define CALLER_SPIN_NS 50000

typedef void (*item_fn)(const void *, int64_t, float *);

static struct {
    pthread_mutex_t lock;        /* one pooled job at a time; other callers run alone */
    int nworkers, active;        /* started; taking part (by id) */
    _Atomic uint32_t gen;        /* job id, bumped once per job; workers sleep on it */
    _Atomic uint64_t ticket;
    _Atomic uint32_t completed;  /* chunks of the current job done; the caller sleeps on it */
    _Atomic int caller_sleeps;
    _Atomic int sleepers;
    int64_t nchunks, chunk, n_items;
    item_fn fn;
    const void *job;
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
    float scratch[SP_SCRATCH_FLOATS];
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        do {
            if ((uint32_t)(t >> 32) != id || (uint32_t)t == 0) return;
        } while (!atomic_compare_exchange_weak(&pool.ticket, &t, t - 1));
        const int64_t c = pool.nchunks - (uint32_t)t;
        const int64_t i1 = (c + 1) * pool.chunk < pool.n_items ? (c + 1) * pool.chunk : pool.n_items;
        for (int64_t i = c * pool.chunk; i < i1; i++) pool.fn(pool.job, i, scratch);
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

void sp_set_spin_us(long us) { pool.spin_ns = us * 1000; }

/* The hash of the sources this library was built from (kernels/_lib.py's source_hash). */
#ifndef SP_SOURCE_HASH
#define SP_SOURCE_HASH ""
#endif
const char *sp_source_hash(void) { return SP_SOURCE_HASH; }

void sp_parallel(item_fn fn, const void *job, int64_t n_items, int64_t chunk, int nthreads)
{
    if (n_items <= 0) return;
    sp_amx_forget(); /* the caller ran other code since its last call: its tile configuration may be gone */
    chunk = chunk < 1 ? 1 : chunk;
    const int64_t nchunks = (n_items + chunk - 1) / chunk;
    if (nthreads > nchunks) nthreads = (int)nchunks;
    pthread_once(&fork_once, install_fork_handler);
    if (nthreads <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        float scratch[SP_SCRATCH_FLOATS];
        for (int64_t i = 0; i < n_items; i++) fn(job, i, scratch);
        return;
    }
    grow_pool(nthreads - 1);
    const uint32_t id = atomic_load(&pool.gen) + 1;
    pool.fn = fn;
    pool.job = job;
    pool.n_items = n_items;
    pool.chunk = chunk;
    pool.nchunks = nchunks;
    pool.active = nthreads - 1;
    atomic_store(&pool.completed, 0);
    atomic_store(&pool.ticket, (uint64_t)id << 32 | (uint64_t)nchunks);
    atomic_store(&pool.gen, id);
    if (atomic_load(&pool.sleepers) > 0) futex(&pool.gen, FUTEX_WAKE_PRIVATE, MAX_THREADS);
    run_chunks(id);
    const uint32_t n = (uint32_t)nchunks;
    for (uint32_t done; (done = atomic_load(&pool.completed)) != n;) /* chunks still running */
        wait_change(&pool.completed, done, CALLER_SPIN_NS, &pool.caller_sleeps);
    pthread_mutex_unlock(&pool.lock);
}
