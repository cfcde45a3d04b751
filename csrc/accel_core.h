/* accel's native allocator core: the books of a caching allocator (segments cut into
 * blocks, best-fit free lists per (pool, kind, stream), split and merge, statistics),
 * in plain C with no Python.h: it touches no Python object, so it needs no GIL and
 * is correct without one. Each core has its own mutex; an upstream (where new
 * segments, and expandable segments' pages, come from) is called with that mutex
 * released, and no thread ever waits for another's upstream call.
 *
 * The same shared library exports torch's pluggable-allocator C ABI
 * (accel_torch_alloc / accel_torch_free) over the cores registered per device.
 *
 * This header is read by cffi (csrc/build_core.py): plain declarations only. */

#include <stdint.h>
#include <sys/types.h>

typedef struct accel_core accel_core;

/* Results of accel_core_malloc / accel_core_free. */
#define ACCEL_CORE_OK 0
#define ACCEL_CORE_OOM 1           /* the upstream refused, after the cache was given back */
#define ACCEL_CORE_BAD_SIZE 2      /* size < 1 or >= 2**60 */
#define ACCEL_CORE_NOT_ALLOCATED 3 /* free of an address the core did not hand out */
#define ACCEL_CORE_NO_MEMORY 4     /* the host's malloc failed for the core's own books */
#define ACCEL_CORE_NOT_HELD 5      /* release_held of an address that is not held */

/* accel_core_malloc's flags. NO_RETRY: on a refusal, return ACCEL_CORE_OOM without
 * giving the whole cache back (the caller has steps of its own first, then calls again
 * with GIVE_BACK_FIRST: give the cache back and count a retry before asking). */
#define ACCEL_CORE_NO_RETRY 1
#define ACCEL_CORE_GIVE_BACK_FIRST 2
/* TORCH: for accel_torch_alloc; such a block is freed by accel_torch_free only, and
 * accel_core_free (accel's) frees only the others. */
#define ACCEL_CORE_TORCH 4

/* Block states in snapshots. */
#define ACCEL_CORE_FREE 0
#define ACCEL_CORE_ALLOCATED 1
#define ACCEL_CORE_HELD 2 /* freed by its caller, its reuse waiting (see accel_core_hold) */
#define ACCEL_CORE_UNMAPPED 3 /* an expandable segment's range with no pages mapped */

/* roundup_power2_divisions: one per power-of-two size range, from [1 MiB, 2 MiB) up
 * (below 1 MiB the first applies, from 2**35 bytes the last). */
#define ACCEL_CORE_DIVISION_SLOTS 16

/* Statistic slots: the layout of accel/allocator/_stats.py's flat list. Each of the
 * 11 statistics owns 8 slots from base = 8 * index: +0/+1 current (small/large pool),
 * +2/+3 peak, +4/+5 total increase, +6 peak over both pools; then the scalars. */
#define ACCEL_CORE_STAT_SLOTS 93

/* Where a core gets memory: returns 0 and sets *ptr, ACCEL_UPSTREAM_REFUSED when out
 * of memory (the core gives cached memory back and asks again), or
 * ACCEL_UPSTREAM_FAILED on any other failure (an interrupt, a driver fault: the malloc
 * stops there, as PyTorch raises a non-OOM error at once, and returns ACCEL_CORE_OOM
 * uncounted). Called without the core's lock held, from whichever thread allocated. */
#define ACCEL_UPSTREAM_REFUSED 1
#define ACCEL_UPSTREAM_FAILED 2
typedef int (*accel_upstream_alloc_fn)(void *ctx, int device, int64_t size, uint64_t *ptr);
typedef void (*accel_upstream_free_fn)(void *ctx, int device, uint64_t ptr, int64_t size);

/* Expandable segments' virtual memory (accel_core_set_vm), each called without the
 * core's lock held, from whichever thread allocated or gave back:
 * reserve: an address range of size bytes (*va), no memory behind it: 0,
 *   ACCEL_UPSTREAM_REFUSED or ACCEL_UPSTREAM_FAILED;
 * unreserve: give a reservation (wholly unmapped) back;
 * map: physical pages over [va, va + nbytes) (page multiples), all or nothing: 0,
 *   ACCEL_UPSTREAM_REFUSED (out of memory, or a cap) or ACCEL_UPSTREAM_FAILED;
 * unmap: unmap and release the pages of [va, va + nbytes) (it cannot fail: what goes
 *   wrong is the upstream's to keep and report); wait nonzero: work queued on the
 *   segment's stream may still use them (wait for the device first), 0: the stream was
 *   seen idle, and a map by the same thread follows (a growth's: it may map the same
 *   physical pages again);
 * idle: whether stream has no queued work (the free pages of its segment may be given
 *   back to make room for another segment's growth only then). */
typedef int (*accel_upstream_reserve_fn)(void *ctx, int device, int64_t size, uint64_t *va);
typedef void (*accel_upstream_unreserve_fn)(void *ctx, int device, uint64_t va, int64_t size);
typedef int (*accel_upstream_map_fn)(void *ctx, int device, uint64_t va, int64_t nbytes);
typedef void (*accel_upstream_unmap_fn)(void *ctx, int device, uint64_t va, int64_t nbytes, int wait);
typedef int (*accel_upstream_idle_fn)(void *ctx, int device, uint64_t stream);
typedef struct {
    accel_upstream_reserve_fn reserve;
    accel_upstream_unreserve_fn unreserve;
    accel_upstream_map_fn map;
    accel_upstream_unmap_fn unmap;
    accel_upstream_idle_fn idle;
} accel_vm_ops;

/* One block of a segment, as accel_core_blocks writes it. */
typedef struct {
    uint64_t segment;   /* the segment's base address */
    int64_t segment_size;
    uint64_t stream;
    uint64_t pool;      /* 0: the device's default pool */
    int32_t small;      /* 1: small pool, 0: large */
    int32_t state;      /* ACCEL_CORE_FREE, _ALLOCATED, _HELD or _UNMAPPED */
    int32_t expandable; /* 1: of an expandable segment (segment_size: its reservation) */
    uint64_t ptr;
    int64_t size;
    int64_t requested;
} accel_core_block_info;

accel_core *accel_core_new(int device, accel_upstream_alloc_fn alloc, accel_upstream_free_fn release, void *ctx);
/* Gives every cached segment back upstream (blocks still allocated are leaked to
 * their holders: call it once nothing is allocated) and frees the books. */
void accel_core_destroy(accel_core *core);
/* max_split_size: blocks at least this large are not split (<= 0: unlimited);
 * max_non_split_rounding: how much larger an oversize cached block may be than a
 * request it serves; large_segment: the segment size for 1-10 MiB requests. (A cap on
 * what the core reserves, such as a memory fraction, is the upstream's to apply.) */
void accel_core_configure(accel_core *core, int64_t max_split_size, int64_t max_non_split_rounding,
                          int64_t large_segment);
/* PyTorch's roundup_power2_divisions, ACCEL_CORE_DIVISION_SLOTS of them (<= 1: none). */
void accel_core_set_divisions(accel_core *core, const int64_t *divisions);
/* PyTorch's garbage collection: a miss while more than threshold bytes are reserved
 * first gives back the unsplit free blocks of the default large pool that are at
 * least as old (in best-fit searches of that pool) as their average (0: off). */
void accel_core_set_gc_threshold(accel_core *core, int64_t threshold);
/* Nonzero: nothing goes back upstream (not by empty_cache, release_pool, nor a miss's
 * give-back) until called with 0 (a graph capture is under way). */
void accel_core_freeze(accel_core *core, int frozen);
/* The upstream's virtual-memory operations, for expandable segments (copied). */
void accel_core_set_vm(accel_core *core, const accel_vm_ops *ops);
/* on nonzero (and accel_core_set_vm called): a miss grows the expandable segment of its
 * (pool, kind, stream), one reservation of reserve_size bytes mapped in page-byte
 * pages on demand, instead of asking for a new segment (PyTorch's
 * expandable_segments); free pages go back upstream by empty_cache, and (of holes, all
 * but keep_free bytes per segment) when a segment must grow. Off: free blocks of
 * expandable segments are not reused, and go back by empty_cache. */
void accel_core_set_expandable(accel_core *core, int on, int64_t page, int64_t reserve_size, int64_t keep_free);
/* A block of at least nbytes (rounded as configured) for stream in pool: *ptr, *size.
 * A miss asks upstream; refused, it gives back oversize cached blocks that make room
 * (with a max_split_size), then the whole cache (not with ACCEL_CORE_NO_RETRY). */
int accel_core_malloc(accel_core *core, int64_t nbytes, uint64_t stream, uint64_t pool, int flags, uint64_t *ptr,
                      int64_t *size);
int accel_core_free(accel_core *core, uint64_t ptr);
/* An allocated block its caller freed, whose reuse must wait (for events on other
 * streams): it leaves the allocated statistics now and stays active, requested and
 * unusable until accel_core_release_held puts it on its free list. */
int accel_core_hold(accel_core *core, uint64_t ptr);
int accel_core_release_held(accel_core *core, uint64_t ptr);
/* Gives the wholly free segments of the pools not kept back upstream; returns the
 * bytes given back. */
int64_t accel_core_empty_cache(accel_core *core);
/* keep nonzero: empty_cache and a miss's give-back leave pool's segments cached (a
 * graph pool in use); 0: they no longer do. */
int accel_core_keep_pool(accel_core *core, uint64_t pool, int keep);
/* Gives the wholly free segments of pool back upstream (kept or not); the bytes. */
int64_t accel_core_release_pool(accel_core *core, uint64_t pool);
/* How many segments pool has. */
int64_t accel_core_pool_segments(accel_core *core, uint64_t pool);
/* Keys by key what is keyed by stream old (segments, their blocks, free lists): a
 * destroyed stream's handle, which the driver may give to a new stream. Returns the
 * segments re-keyed. */
int64_t accel_core_rekey_stream(accel_core *core, uint64_t old, uint64_t key);
void accel_core_stats(accel_core *core, int64_t *out);
void accel_core_reset_peak(accel_core *core);
/* Writes up to cap blocks (address order within each segment); returns how many the
 * core has, which may be more than cap: call again with a larger buffer. */
int64_t accel_core_blocks(accel_core *core, accel_core_block_info *out, int64_t cap);
/* The size of the block allocated (not held) at ptr, or -1. */
int64_t accel_core_allocated_size(accel_core *core, uint64_t ptr);

/* torch's pluggable allocator over the core registered for each device (NULL: none). */
#define ACCEL_CORE_MAX_DEVICES 64
/* Returns the core registered before (NULL when none). */
accel_core *accel_core_register_torch(int device, accel_core *core);
void *accel_torch_alloc(ssize_t size, int device, void *stream);
void accel_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* 1: this library never uses the GIL (it includes no Python.h). */
int accel_core_gil_free(void);
