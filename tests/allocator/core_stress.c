/* The native core alone, with no Python at all, under threads: built by
 * tests/allocator/test_native_core.py with -fsanitize=thread and with
 * -fsanitize=address,undefined. Threads allocate (two streams, two pools), write their
 * mark into what they got and check it before freeing (some held, then released);
 * one more thread gives the cache back, reads the books and makes the policy calls
 * (keep/release a pool, freeze, gc threshold, divisions, re-key) meanwhile. The
 * upstream refuses now and then, so the give-back-and-retry path runs too. The
 * policy thread turns expandable segments on and off: their reservations are
 * PROT_NONE mappings whose pages the map callback makes writable (and the unmap one
 * inaccessible again), so a block handed out over a page that is not mapped faults
 * when its owner writes its mark. Exit 0 when every check held. */

#include "accel_core.h"

#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 6
#define ITERS 200
#define HELD 8

static pthread_mutex_t upstream_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t outstanding, calls;
static int stop;

static int upstream_alloc(void *ctx, int device, int64_t size, uint64_t *ptr) {
    (void)ctx, (void)device;
    pthread_mutex_lock(&upstream_lock);
    int refuse = ++calls % 23 == 0;
    pthread_mutex_unlock(&upstream_lock);
    if (refuse)
        return 1;
    void *p = aligned_alloc(512, (size_t)size);
    if (p == NULL)
        return 1;
    pthread_mutex_lock(&upstream_lock);
    outstanding += size;
    pthread_mutex_unlock(&upstream_lock);
    *ptr = (uint64_t)(uintptr_t)p;
    return 0;
}

static void upstream_free(void *ctx, int device, uint64_t ptr, int64_t size) {
    (void)ctx, (void)device;
    free((void *)(uintptr_t)ptr);
    pthread_mutex_lock(&upstream_lock);
    outstanding -= size;
    pthread_mutex_unlock(&upstream_lock);
}

#define PAGE (2LL << 20)
#define RESERVATION (512LL << 20)
static int64_t reserved_left, mapped_left, vm_calls;

static int vm_reserve(void *ctx, int device, int64_t size, uint64_t *va) {
    (void)ctx, (void)device;
    void *p = mmap(NULL, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return 1;
    __atomic_add_fetch(&reserved_left, size, __ATOMIC_RELAXED);
    *va = (uint64_t)(uintptr_t)p;
    return 0;
}

static void vm_unreserve(void *ctx, int device, uint64_t va, int64_t size) {
    (void)ctx, (void)device;
    munmap((void *)(uintptr_t)va, (size_t)size);
    __atomic_sub_fetch(&reserved_left, size, __ATOMIC_RELAXED);
}

static int vm_map(void *ctx, int device, uint64_t va, int64_t nbytes) {
    (void)ctx, (void)device;
    if (__atomic_add_fetch(&vm_calls, 1, __ATOMIC_RELAXED) % 19 == 0)
        return 1; /* out of memory now and then */
    if (mprotect((void *)(uintptr_t)va, (size_t)nbytes, PROT_READ | PROT_WRITE) != 0)
        return 2;
    __atomic_add_fetch(&mapped_left, nbytes, __ATOMIC_RELAXED);
    return 0;
}

static void vm_unmap(void *ctx, int device, uint64_t va, int64_t nbytes, int wait) {
    (void)ctx, (void)device, (void)wait;
    madvise((void *)(uintptr_t)va, (size_t)nbytes, MADV_DONTNEED);
    mprotect((void *)(uintptr_t)va, (size_t)nbytes, PROT_NONE);
    __atomic_sub_fetch(&mapped_left, nbytes, __ATOMIC_RELAXED);
}

static int vm_idle(void *ctx, int device, uint64_t stream) {
    (void)ctx, (void)device;
    return (__atomic_add_fetch(&vm_calls, 1, __ATOMIC_RELAXED) + stream) % 3 != 0;
}

static accel_core *core;
static int failures[THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned x = 777u * (unsigned)(id + 1);
    uint64_t ptrs[HELD];
    int64_t sizes[HELD];
    unsigned char mark = (unsigned char)(id + 1);
    for (int i = 0; i < ITERS; i++) {
        for (int k = 0; k < HELD; k++) {
            x = x * 1103515245u + 12345u;
            int64_t n = 1 + (int64_t)((x >> 8) % ((x & 16) ? (3u << 20) : (64u << 10)));
            int64_t got = 0;
            ptrs[k] = 0;
            if (accel_core_malloc(core, n, (uint64_t)(id % 2), (uint64_t)(id % 3 == 0), 0, &ptrs[k], &got) == ACCEL_CORE_OK) {
                sizes[k] = n;
                if (got < n)
                    failures[id]++;
                /* the first and last bytes (up to 4 KiB each): overlaps show there */
                int64_t edge = n < 4096 ? n : 4096;
                memset((void *)(uintptr_t)ptrs[k], mark, (size_t)edge);
                memset((void *)(uintptr_t)(ptrs[k] + (uint64_t)(n - edge)), mark, (size_t)edge);
            }
        }
        for (int k = 0; k < HELD; k++) {
            if (ptrs[k] == 0)
                continue;
            unsigned char *bytes = (unsigned char *)(uintptr_t)ptrs[k];
            int64_t n = sizes[k], edge = n < 4096 ? n : 4096;
            int bad = 0;
            for (int64_t j = 0; j < edge; j++)
                bad |= bytes[j] != mark || bytes[n - 1 - j] != mark;
            failures[id] += bad;
            if (k % 3 == 0) { /* a free whose reuse waits: held, then released */
                if (accel_core_hold(core, ptrs[k]) != ACCEL_CORE_OK || accel_core_free(core, ptrs[k]) == ACCEL_CORE_OK ||
                    accel_core_release_held(core, ptrs[k]) != ACCEL_CORE_OK)
                    failures[id]++;
            } else if (accel_core_free(core, ptrs[k]) != ACCEL_CORE_OK) {
                failures[id]++;
            }
        }
    }
    return NULL;
}

static void *janitor(void *arg) {
    (void)arg;
    int64_t slots[ACCEL_CORE_STAT_SLOTS];
    accel_core_block_info info[256];
    int64_t divisions[ACCEL_CORE_DIVISION_SLOTS];
    for (unsigned i = 0; !__atomic_load_n(&stop, __ATOMIC_ACQUIRE); i++) {
        accel_core_empty_cache(core);
        accel_core_stats(core, slots);
        accel_core_blocks(core, info, 256);
        /* the policy calls DeviceAllocator makes while others allocate */
        accel_core_keep_pool(core, 1, (int)(i & 1));
        accel_core_release_pool(core, 1);
        accel_core_pool_segments(core, 1);
        accel_core_freeze(core, (i & 7) == 3);
        accel_core_set_gc_threshold(core, (i & 2) ? (int64_t)48 << 20 : 0);
        for (int d = 0; d < ACCEL_CORE_DIVISION_SLOTS; d++)
            divisions[d] = (i & 4) ? 4 : 0;
        accel_core_set_divisions(core, divisions);
        accel_core_rekey_stream(core, (uint64_t)1000 + i, (uint64_t)2000 + i); /* no such stream: nothing moves */
        accel_core_set_expandable(core, (i & 8) == 0, PAGE, RESERVATION, (i & 16) ? PAGE : 0);
    }
    accel_core_freeze(core, 0);
    accel_core_keep_pool(core, 1, 0);
    return NULL;
}

int main(void) {
    core = accel_core_new(0, upstream_alloc, upstream_free, NULL);
    accel_core_configure(core, 8 << 20, 20 << 20, 20 << 20);
    accel_vm_ops ops = {vm_reserve, vm_unreserve, vm_map, vm_unmap, vm_idle};
    accel_core_set_vm(core, &ops);
    accel_core_set_expandable(core, 1, PAGE, RESERVATION, 0);
    pthread_t threads[THREADS], other;
    pthread_create(&other, NULL, janitor, NULL);
    for (int t = 0; t < THREADS; t++)
        pthread_create(&threads[t], NULL, worker, (void *)(intptr_t)t);
    int bad = 0;
    for (int t = 0; t < THREADS; t++) {
        pthread_join(threads[t], NULL);
        bad += failures[t];
    }
    __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
    pthread_join(other, NULL);
    int64_t slots[ACCEL_CORE_STAT_SLOTS];
    accel_core_stats(core, slots);
    accel_core_empty_cache(core);
    accel_core_destroy(core);
    printf("failures %d allocated %lld reserved-left %lld ooms %lld maps %lld\n", bad,
           (long long)(slots[32] + slots[33]), (long long)(outstanding + reserved_left + mapped_left),
           (long long)slots[89], (long long)vm_calls);
    return bad != 0 || slots[32] + slots[33] != 0 || outstanding != 0 || reserved_left != 0 || mapped_left != 0;
}
