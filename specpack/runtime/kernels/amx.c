/* Intel AMX tiles (Sapphire Rapids and later), what w8a8.c and bf16_tiles.c share: the process's
 * permission to use the tile data state, and each thread's tile configuration.
 *
 * Linux grants the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM), refused
 * where any thread's alternate signal stack is too small for the larger signal frame; the request
 * is made once, the first time a kernel asks. A thread loads a tile configuration (rows and bytes
 * per row of each tile) before its first tile instruction; `sp_amx_load` skips the load while the
 * thread's current configuration has the same key, a key the caller of each kernel call forgets
 * (`sp_amx_forget`: other code on that thread may have released the tiles). A forked child loads its
 * configuration again.
 * SPECPACK_AMX=0 refuses the permission: every kernel then keeps its vector path. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

#ifndef SP_AMX
int sp_amx_permit(void) { return 0; }
void sp_amx_load(const sp_tilecfg_t *cfg, int key) { (void)cfg, (void)key; }
void sp_amx_forget(void) {}
#else
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static __thread int loaded; /* the key of this thread's tile configuration (0: none) */

static void after_fork(void) { loaded = 0; }

int sp_amx_permit(void)
{
    static int ok = -1;
    if (ok < 0) {
        unsigned a, b, c, d;
        const char *env = getenv("SPECPACK_AMX");
        ok = !(env && env[0] == '0') && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) /* AMX-TILE */
             && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
             && pthread_atfork(NULL, NULL, after_fork) == 0;
    }
    return ok;
}

__attribute__((target("amx-tile"))) void sp_amx_load(const sp_tilecfg_t *cfg, int key)
{
    if (loaded == key) return;
    _tile_loadconfig(cfg);
    loaded = key;
}

void sp_amx_forget(void) { loaded = 0; }
#endif
