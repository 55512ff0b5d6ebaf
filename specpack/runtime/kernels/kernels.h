/* What the kernel sources share: the thread pool (pool.c). */
#pragma once
#include <stdint.h>

/* Per-thread scratch handed to every item: 16 x 16 floats (a partial linear panel). */
#define SP_SCRATCH_FLOATS 256

/* Run fn(job, item, scratch) for item in [0, n_items) on the caller's thread plus up to
 * nthreads - 1 pool workers, in chunks of `chunk` consecutive items. Which thread runs an item
 * never changes its result: every kernel computes an item the same way on any thread. When the
 * pool is busy (another caller), or nthreads <= 1, the caller runs every item itself. */
void sp_parallel(void (*fn)(const void *job, int64_t item, float *scratch), const void *job,
                 int64_t n_items, int64_t chunk, int nthreads);
