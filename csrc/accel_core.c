/* accel's native allocator core (see accel_core.h). No Python.h: nothing here needs
 * or touches the GIL, and the core's mutex is never held across an upstream call. */

#include "accel_core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

#define KB_MIN 512
#define SMALL_SIZE (1LL << 20)
#define SMALL_BUFFER (2LL << 20)
#define MIN_LARGE_ALLOC (10LL << 20)
#define ROUND_LARGE (2LL << 20)
#define MAX_REQUEST (1LL << 60)

/* statistic bases (accel/allocator/_stats.py) */
enum {
    ST_ALLOCATION = 0, ST_SEGMENT = 8, ST_ACTIVE = 16, ST_INACTIVE_SPLIT = 24, ST_ALLOCATED_BYTES = 32,
    ST_RESERVED_BYTES = 40, ST_ACTIVE_BYTES = 48, ST_INACTIVE_SPLIT_BYTES = 56, ST_REQUESTED_BYTES = 64,
    ST_OVERSIZE_ALLOCATIONS = 72, ST_OVERSIZE_SEGMENTS = 80,
    ST_NUM_ALLOC_RETRIES = 88, ST_NUM_OOMS = 89, ST_NUM_SYNC_ALL_STREAMS = 90, ST_NUM_DEVICE_ALLOC = 91,
    ST_NUM_DEVICE_FREE = 92,
};

typedef struct segment segment;
typedef struct freelist freelist;

typedef struct block {
    uint64_t ptr;
    int64_t size;
    int64_t requested;
    segment *seg;
    struct block *prev, *next; /* neighbours in the segment, by address */
    int state;         /* ACCEL_CORE_FREE, _ALLOCATED, _HELD or (expandable) _UNMAPPED, MAPPING, UNMAPPING */
    int torch;         /* allocated through accel_torch_alloc: only accel_torch_free frees it */
    uint64_t gc_base;  /* the core's gc clock when the block joined a free list */
    /* free-list treap, keyed by (size, ptr) */
    struct block *left, *right;
    uint32_t priority;
} block;

struct freelist { /* the free blocks of one (pool, kind, stream), plain or expandable */
    uint64_t pool;
    uint64_t stream;
    int small;
    int expandable;
    block *root;
    int64_t count;
};

struct segment {
    uint64_t base;
    int64_t size;
    uint64_t stream;
    uint64_t pool;
    int small;
    /* expandable: size is the reservation's, tiled by blocks, unmapped ones included;
     * page: the bytes of one mapping; grown_at: the core's growth count when it last
     * grew, last_growth: by how many bytes (see give_back_holes) */
    int expandable;
    int64_t page;
    uint64_t grown_at;
    int64_t last_growth;
    int pins; /* threads growing it with the lock released: it is not given back meanwhile */
    block *head;
    segment *prev, *next; /* every segment of the core */
};

/* allocated blocks by address: open addressing, linear probing, backward-shift deletion */
typedef struct {
    block **slots;
    uint64_t mask;
    uint64_t used;
} ptrmap;

struct accel_core {
    pthread_mutex_t lock;
    int device;
    accel_upstream_alloc_fn upstream_alloc;
    accel_upstream_free_fn upstream_free;
    void *ctx;
    int64_t max_split_size, max_non_split_rounding, large_segment;
    int64_t divisions[ACCEL_CORE_DIVISION_SLOTS]; /* roundup_power2_divisions (<= 1: none) */
    int any_divisions;
    int64_t gc_threshold; /* bytes reserved above which a miss collects old blocks (0: off) */
    uint64_t gc_clock;    /* best-fit searches of the default large pool: the age of blocks */
    int frozen;           /* nonzero: nothing goes back upstream (a capture is under way) */
    uint64_t *kept;       /* pools whose free segments stay cached (graph pools in use) */
    int64_t nkept, capkept;
    freelist *lists;
    int64_t nlists, caplists;
    segment *segments;
    ptrmap allocated;
    /* expandable segments (accel_core_set_vm / _set_expandable) */
    accel_vm_ops vm;
    int has_vm, expandable;
    int64_t page, reserve_size, keep_free;
    uint64_t growths;
    uint32_t seed;
    int64_t s[ACCEL_CORE_STAT_SLOTS];
};

/* -- statistics ------------------------------------------------------------------- */

static void stat_add(int64_t *s, int base, int pool, int64_t n) {
    int64_t c = s[base + pool] += n;
    if (n > 0) {
        s[base + 4 + pool] += n;
        if (c > s[base + 2 + pool])
            s[base + 2 + pool] = c;
        if (c + s[base + 1 - pool] > s[base + 6])
            s[base + 6] = c + s[base + 1 - pool];
    }
}

/* -- the free lists: treaps ordered by (size, ptr) -------------------------------- */

static int key_less(const block *a, const block *b) {
    return a->size < b->size || (a->size == b->size && a->ptr < b->ptr);
}

static uint32_t next_priority(accel_core *c) {
    uint32_t x = c->seed; /* xorshift32 */
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return c->seed = x;
}

/* Splits t into keys < k and keys >= k. */
static void treap_split(block *t, const block *k, block **lo, block **hi) {
    if (t == NULL) {
        *lo = *hi = NULL;
    } else if (key_less(t, k)) {
        treap_split(t->right, k, &t->right, hi);
        *lo = t;
    } else {
        treap_split(t->left, k, lo, &t->left);
        *hi = t;
    }
}

static block *treap_merge(block *a, block *b) {
    if (a == NULL)
        return b;
    if (b == NULL)
        return a;
    if (a->priority > b->priority) {
        a->right = treap_merge(a->right, b);
        return a;
    }
    b->left = treap_merge(a, b->left);
    return b;
}

static void list_insert(accel_core *c, freelist *l, block *b) {
    b->gc_base = c->gc_clock;
    b->priority = next_priority(c);
    b->left = b->right = NULL;
    block **at = &l->root;
    while (*at != NULL && (*at)->priority > b->priority)
        at = key_less(b, *at) ? &(*at)->left : &(*at)->right;
    treap_split(*at, b, &b->left, &b->right);
    *at = b;
    l->count++;
}

static void list_remove(freelist *l, block *b) {
    block **at = &l->root;
    while (*at != b)
        at = key_less(b, *at) ? &(*at)->left : &(*at)->right;
    *at = treap_merge(b->left, b->right);
    b->left = b->right = NULL;
    l->count--;
}

/* The smallest block of at least size bytes (its key is the least (size, ptr) >= (size, 0)). */
static block *list_best_fit(freelist *l, int64_t size) {
    block *t = l->root, *best = NULL;
    while (t != NULL) {
        if (t->size >= size) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

static freelist *find_list(accel_core *c, uint64_t pool, int small, int exp, uint64_t stream, int create) {
    for (int64_t i = 0; i < c->nlists; i++) {
        freelist *l = &c->lists[i];
        if (l->stream == stream && l->small == small && l->pool == pool && l->expandable == exp)
            return l;
    }
    if (!create)
        return NULL;
    if (c->nlists == c->caplists) {
        int64_t cap = c->caplists ? 2 * c->caplists : 8;
        freelist *grown = realloc(c->lists, (size_t)cap * sizeof(freelist));
        if (grown == NULL)
            return NULL;
        c->lists = grown;
        c->caplists = cap;
    }
    freelist *l = &c->lists[c->nlists++];
    l->pool = pool;
    l->small = small;
    l->expandable = exp;
    l->stream = stream;
    l->root = NULL;
    l->count = 0;
    return l;
}

/* -- allocated blocks by address --------------------------------------------------- */

static uint64_t ptr_hash(uint64_t p) {
    p ^= p >> 33;
    p *= 0xff51afd7ed558ccdULL;
    p ^= p >> 33;
    return p;
}

static int map_grow(ptrmap *m) {
    uint64_t cap = m->slots ? 2 * (m->mask + 1) : 64;
    block **slots = calloc(cap, sizeof(block *));
    if (slots == NULL)
        return -1;
    if (m->slots != NULL) {
        for (uint64_t i = 0; i <= m->mask; i++) {
            block *b = m->slots[i];
            if (b != NULL) {
                uint64_t j = ptr_hash(b->ptr) & (cap - 1);
                while (slots[j] != NULL)
                    j = (j + 1) & (cap - 1);
                slots[j] = b;
            }
        }
        free(m->slots);
    }
    m->slots = slots;
    m->mask = cap - 1;
    return 0;
}

/* Reserves room for one more entry (called before the books change, so that a failed
 * malloc of the table leaves them as they were). */
static int map_reserve(ptrmap *m) {
    if (m->slots == NULL || 2 * (m->used + 1) > m->mask + 1)
        return map_grow(m);
    return 0;
}

static void map_put(ptrmap *m, block *b) {
    uint64_t j = ptr_hash(b->ptr) & m->mask;
    while (m->slots[j] != NULL)
        j = (j + 1) & m->mask;
    m->slots[j] = b;
    m->used++;
}

static block *map_take(ptrmap *m, uint64_t ptr, int take) {
    if (m->slots == NULL)
        return NULL;
    uint64_t j = ptr_hash(ptr) & m->mask;
    while (m->slots[j] != NULL && m->slots[j]->ptr != ptr)
        j = (j + 1) & m->mask;
    block *found = m->slots[j];
    if (found == NULL || !take)
        return found;
    /* backward-shift deletion: move later entries of the run into the hole */
    uint64_t hole = j;
    for (uint64_t k = (j + 1) & m->mask; m->slots[k] != NULL; k = (k + 1) & m->mask) {
        uint64_t home = ptr_hash(m->slots[k]->ptr) & m->mask;
        /* the entry at k may move to hole when its home is not in (hole, k] */
        if ((k > hole && (home <= hole || home > k)) || (k < hole && home <= hole && home > k)) {
            m->slots[hole] = m->slots[k];
            hole = k;
        }
    }
    m->slots[hole] = NULL;
    m->used--;
    return found;
}

/* -- the core ------------------------------------------------------------------------ */

EXPORT accel_core *accel_core_new(int device, accel_upstream_alloc_fn alloc, accel_upstream_free_fn release,
                                  void *ctx) {
    accel_core *c = calloc(1, sizeof(accel_core));
    if (c == NULL)
        return NULL;
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        free(c);
        return NULL;
    }

    c->device = device;
    c->upstream_alloc = alloc;
    c->upstream_free = release;
    c->ctx = ctx;
    c->max_split_size = 0;
    c->max_non_split_rounding = 20LL << 20;
    c->large_segment = 20LL << 20;
    c->seed = 2463534242u;
    return c;
}

static int oversize(const accel_core *c, int64_t size);

EXPORT void accel_core_configure(accel_core *c, int64_t max_split_size, int64_t max_non_split_rounding,
                                 int64_t large_segment) {
    pthread_mutex_lock(&c->lock);
    int changed = c->max_split_size != max_split_size;
    c->max_split_size = max_split_size;
    c->max_non_split_rounding = max_non_split_rounding;
    c->large_segment = large_segment;
    if (changed) {
        /* count the oversize blocks and segments again under the new bound, so that
         * frees under it keep the statistics right (peaks only rise) */
        int64_t blocks = 0, segments = 0;
        for (segment *seg = c->segments; seg != NULL; seg = seg->next) {
            segments += !seg->expandable && oversize(c, seg->size);
            for (block *b = seg->head; b != NULL; b = b->next)
                blocks += b->state == ACCEL_CORE_ALLOCATED && oversize(c, b->size);
        }
        int64_t counts[2] = {blocks, segments};
        int bases[2] = {ST_OVERSIZE_ALLOCATIONS, ST_OVERSIZE_SEGMENTS};
        for (int i = 0; i < 2; i++) {
            int64_t *s = &c->s[bases[i]];
            s[4] += counts[i] > s[0] ? counts[i] - s[0] : 0;
            s[0] = counts[i];
            s[2] = s[2] > counts[i] ? s[2] : counts[i];
            s[6] = s[6] > counts[i] ? s[6] : counts[i];
        }
    }
    pthread_mutex_unlock(&c->lock);
}

EXPORT void accel_core_set_divisions(accel_core *c, const int64_t *divisions) {
    pthread_mutex_lock(&c->lock);
    c->any_divisions = 0;
    for (int i = 0; i < ACCEL_CORE_DIVISION_SLOTS; i++) {
        c->divisions[i] = divisions[i];
        c->any_divisions |= divisions[i] > 1;
    }
    pthread_mutex_unlock(&c->lock);
}

EXPORT void accel_core_set_gc_threshold(accel_core *c, int64_t threshold) {
    pthread_mutex_lock(&c->lock);
    c->gc_threshold = threshold > 0 ? threshold : 0;
    pthread_mutex_unlock(&c->lock);
}

EXPORT void accel_core_freeze(accel_core *c, int frozen) {
    pthread_mutex_lock(&c->lock);
    c->frozen = frozen;
    pthread_mutex_unlock(&c->lock);
}

static int bit_length(uint64_t n) { return n == 0 ? 0 : 64 - __builtin_clzll(n); }

/* PyTorch's round_size for `divisions` (<= 1: none): power-of-two divisions apply
 * above 512 * divisions bytes only. (accel/allocator/_caching.py's round_size.) */
static int64_t round_divided(int64_t size, int64_t divisions) {
    if (size < KB_MIN)
        return KB_MIN;
    if (divisions > 1 && size > KB_MIN * divisions) {
        if ((size & (size - 1)) == 0)
            return size;
        int64_t floor2 = (int64_t)1 << (bit_length((uint64_t)size) - 1);
        int64_t step = floor2 >> (bit_length((uint64_t)divisions) - 1);
        if (step == 0)
            return 2 * floor2;
        return (size + step - 1) / step * step;
    }
    return (size + KB_MIN - 1) & -(int64_t)KB_MIN;
}

static int64_t round_request(const accel_core *c, int64_t n) {
    if (c->any_divisions && n >= KB_MIN) {
        int slot = bit_length((uint64_t)n) - 21; /* the divisions of [1 MiB, 2 MiB) are slot 0 */
        slot = slot < 0 ? 0 : (slot < ACCEL_CORE_DIVISION_SLOTS - 1 ? slot : ACCEL_CORE_DIVISION_SLOTS - 1);
        return round_divided(n, c->divisions[slot]);
    }
    return n < KB_MIN ? KB_MIN : (n + KB_MIN - 1) & -(int64_t)KB_MIN;
}

static int64_t segment_size_for(const accel_core *c, int64_t size) {
    if (size <= SMALL_SIZE)
        return SMALL_BUFFER;
    if (size < MIN_LARGE_ALLOC)
        return c->large_segment;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

static int oversize(const accel_core *c, int64_t size) { return c->max_split_size > 0 && size >= c->max_split_size; }

/* Whether a cached block of bsize bytes may serve a request of size (the oversize rules:
 * an oversize block serves only requests close to its size). Larger blocks never may
 * when this one may not, so the best fit decides. */
static int usable(const accel_core *c, int64_t bsize, int64_t size) {
    if (c->max_split_size <= 0)
        return 1;
    if (size < c->max_split_size && bsize >= c->max_split_size)
        return 0;
    if (size >= c->max_split_size && bsize >= size + c->max_non_split_rounding)
        return 0;
    return 1;
}

static int is_split(const block *b) { return b->prev != NULL || b->next != NULL; }

/* Hands out free block b (on list l) for a request of nbytes rounded to size: cut off
 * the rest when it is worth keeping (PyTorch's should_split), count it. The caller
 * reserved a ptrmap slot and, when a rest may be cut, passed a spare block. */
static void take_block(accel_core *c, freelist *l, block *b, int64_t size, int64_t nbytes, int torch, block **spare) {
    int small = b->seg->small, kind = small ? 0 : 1;
    int64_t *s = c->s;
    int64_t remaining = b->size - size;
    /* inactive splits are not counted in expandable segments, and any rest worth a
     * block is cut there (PyTorch's should_split for them) */
    int exp = b->seg->expandable;
    int was_split = !exp && is_split(b);
    list_remove(l, b);
    if (was_split)
        stat_add(s, ST_INACTIVE_SPLIT, kind, -1), stat_add(s, ST_INACTIVE_SPLIT_BYTES, kind, -b->size);
    if (remaining >= KB_MIN && (exp || small || (!oversize(c, size) && remaining > SMALL_SIZE)) && *spare != NULL) {
        block *rest = *spare;
        *spare = NULL;
        memset(rest, 0, sizeof(*rest));
        rest->ptr = b->ptr + (uint64_t)size;
        rest->size = remaining;
        rest->seg = b->seg;
        rest->prev = b;
        rest->next = b->next;
        if (b->next != NULL)
            b->next->prev = rest;
        b->next = rest;
        b->size = size;
        list_insert(c, l, rest);
        if (!exp) {
            stat_add(s, ST_INACTIVE_SPLIT, kind, 1);
            stat_add(s, ST_INACTIVE_SPLIT_BYTES, kind, remaining);
        }
    }
    b->state = ACCEL_CORE_ALLOCATED;
    b->torch = torch;
    b->requested = nbytes;
    map_put(&c->allocated, b);
    stat_add(s, ST_ALLOCATION, kind, 1);
    stat_add(s, ST_ACTIVE, kind, 1);
    stat_add(s, ST_ALLOCATED_BYTES, kind, b->size);
    stat_add(s, ST_ACTIVE_BYTES, kind, b->size);
    stat_add(s, ST_REQUESTED_BYTES, kind, nbytes);
    if (oversize(c, b->size))
        stat_add(s, ST_OVERSIZE_ALLOCATIONS, 0, 1);
}

static int kept(const accel_core *c, uint64_t pool) {
    for (int64_t i = 0; i < c->nkept; i++)
        if (c->kept[i] == pool)
            return 1;
    return 0;
}

/* (of plain segments: an expandable one goes back page by page, see unmap_free_pages) */
static int wholly_free(const segment *seg) {
    return !seg->expandable && seg->head->state == ACCEL_CORE_FREE && seg->head->next == NULL;
}

/* Unlinks wholly free segment seg (its one block on its free list) into *out and
 * uncounts it; the caller gives *out back upstream once the lock is released. */
static void detach_segment(accel_core *c, segment *seg, segment **out) {
    freelist *l = find_list(c, seg->pool, seg->small, 0, seg->stream, 0);
    list_remove(l, seg->head);
    if (seg->prev != NULL)
        seg->prev->next = seg->next;
    else
        c->segments = seg->next;
    if (seg->next != NULL)
        seg->next->prev = seg->prev;
    int kind = seg->small ? 0 : 1;
    stat_add(c->s, ST_SEGMENT, kind, -1);
    stat_add(c->s, ST_RESERVED_BYTES, kind, -seg->size);
    if (oversize(c, seg->size))
        stat_add(c->s, ST_OVERSIZE_SEGMENTS, 0, -1);
    c->s[ST_NUM_DEVICE_FREE]++;
    seg->prev = NULL;
    seg->next = *out;
    *out = seg;
}

/* Detaches every wholly free segment of the pools not kept (of `pool` alone when
 * only_pool); returns their bytes. */
static int64_t detach_free_segments(accel_core *c, segment **out, int only_pool, uint64_t pool) {
    int64_t bytes = 0;
    segment *seg = c->segments;
    while (seg != NULL) {
        segment *next = seg->next;
        if (wholly_free(seg) && (only_pool ? seg->pool == pool : !kept(c, seg->pool))) {
            bytes += seg->size;
            detach_segment(c, seg, out);
        }
        seg = next;
    }
    return bytes;
}

static void give_back(accel_core *c, segment *list) {
    while (list != NULL) {
        segment *next = list->next;
        c->upstream_free(c->ctx, c->device, list->base, list->size);
        free(list->head);
        free(list);
        list = next;
    }
}

static int64_t reserved_bytes(const accel_core *c) { return c->s[ST_RESERVED_BYTES] + c->s[ST_RESERVED_BYTES + 1]; }

/* PyTorch's garbage_collect_cached_blocks: while more than gc_threshold bytes are
 * reserved, detach the unsplit free blocks of the default large pool (every stream)
 * at least as old as their average age, oldest rounds first. */
static void collect_garbage(accel_core *c, segment **out) {
    int64_t target = reserved_bytes(c) - c->gc_threshold;
    while (target > 0) {
        uint64_t total_age = 0;
        int64_t n = 0;
        for (segment *seg = c->segments; seg != NULL; seg = seg->next)
            if (seg->pool == 0 && !seg->small && wholly_free(seg))
                total_age += c->gc_clock - seg->head->gc_base, n++;
        if (n == 0)
            return;
        double average = (double)total_age / (double)n;
        int64_t reclaimed = 0;
        for (segment *seg = c->segments, *next; seg != NULL; seg = next) {
            next = seg->next;
            if (seg->pool == 0 && !seg->small && wholly_free(seg) && (double)(c->gc_clock - seg->head->gc_base) >= average) {
                reclaimed += seg->size;
                detach_segment(c, seg, out);
            }
        }
        if (reclaimed == 0)
            return;
        target -= reclaimed;
    }
}

/* PyTorch's release_available_cached_blocks on list l (a miss of size bytes there):
 * detach the smallest unsplit free block of at least max(size, max_split_size), else
 * the largest oversize unsplit ones until that much is detached. Returns whether
 * that much was. */
static int release_available(accel_core *c, freelist *l, int64_t size, segment **out) {
    int64_t key = size > c->max_split_size ? size : c->max_split_size;
    if (l == NULL || l->count == 0)
        return 0;
    /* the list's unsplit blocks in (size, ptr) order: an in-order walk of the treap */
    block **whole = malloc((size_t)l->count * sizeof(block *));
    block **stack = malloc((size_t)l->count * sizeof(block *));
    if (whole == NULL || stack == NULL) {
        free(whole);
        free(stack);
        return 0;
    }
    int64_t n = 0, depth = 0;
    block *t = l->root;
    while (t != NULL || depth > 0) {
        while (t != NULL) {
            stack[depth++] = t;
            t = t->left;
        }
        t = stack[--depth];
        if (!is_split(t))
            whole[n++] = t;
        t = t->right;
    }
    free(stack);
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (whole[i]->size >= key) {
            total = whole[i]->size;
            detach_segment(c, whole[i]->seg, out);
            free(whole);
            return 1;
        }
    }
    for (int64_t i = n - 1; i >= 0 && total < key && whole[i]->size >= c->max_split_size; i--) {
        total += whole[i]->size;
        detach_segment(c, whole[i]->seg, out);
    }
    free(whole);
    return total >= key;
}

/* -- expandable segments --------------------------------------------------------------
 * One reservation per (pool, kind, stream), tiled by blocks like a plain segment; the
 * ranges with no pages behind them are ACCEL_CORE_UNMAPPED blocks (on no free list,
 * never merged with free ones). What the Python books of accel/allocator/_caching.py
 * did before, in the same terms: see PyTorch's ExpandableSegment, and where accel
 * differs (2 MiB pages in both pools, holes given back when a segment grows) the
 * module docstring of _caching.py. */

/* Pages are mapped and unmapped with the mutex released, and no thread ever waits for
 * another's map or unmap (a thread may hold the GIL while it allocates, torch.empty's
 * does, and the upstream's callbacks need it: a wait would deadlock). Instead the
 * range being mapped or unmapped is a block of its own meanwhile, in state MAPPING or
 * UNMAPPING: hits and frees never hand out or merge with it, growths never choose it,
 * and a segment with such a block (or a pin) is never given back. So other threads go
 * on using the books, growing other ranges (even of the same segment) at once. */
#define MAPPING 6
#define UNMAPPING 7

typedef struct { /* what a thread does once the lock is released, and finishes after */
    block **unmaps; /* UNMAPPING blocks */
    int64_t nunmaps, capunmaps;
    segment *dead; /* reservations left wholly unmapped, unlinked: to unreserve */
    int wait;      /* the pages' streams were not seen idle: the upstream waits first */
} vm_work;

static int work_unmap(vm_work *w, block *b) {
    if (w->nunmaps == w->capunmaps) {
        int64_t cap = w->capunmaps ? 2 * w->capunmaps : 8;
        block **grown = realloc(w->unmaps, (size_t)cap * sizeof(block *));
        if (grown == NULL)
            return -1;
        w->unmaps = grown;
        w->capunmaps = cap;
    }
    w->unmaps[w->nunmaps++] = b;
    return 0;
}

static void merge_unmapped(block *b);
static void bury(accel_core *c, vm_work *w, segment *seg);
static int wholly_unmapped(const segment *seg);

/* Unmaps w's UNMAPPING blocks and gives back its dead reservations, the lock released
 * meanwhile; then the blocks are UNMAPPED (merged), and segments of them left wholly
 * unmapped are given back too. The lock is held on entry and on return. */
static void run_vm_work(accel_core *c, vm_work *w) {
    while (w->nunmaps > 0 || w->dead != NULL) {
        int64_t n = w->nunmaps;
        pthread_mutex_unlock(&c->lock);
        for (int64_t i = 0; i < n; i++)
            c->vm.unmap(c->ctx, c->device, w->unmaps[i]->ptr, w->unmaps[i]->size, w->wait);
        while (w->dead != NULL) {
            segment *seg = w->dead;
            w->dead = seg->next;
            c->vm.unreserve(c->ctx, c->device, seg->base, seg->size);
            free(seg->head);
            free(seg);
        }
        pthread_mutex_lock(&c->lock);
        /* UNMAPPING blocks are this thread's alone: their pointers held */
        for (int64_t i = 0; i < n; i++) {
            block *b = w->unmaps[i];
            segment *seg = b->seg;
            b->state = ACCEL_CORE_UNMAPPED;
            merge_unmapped(b);
            if (seg->pins == 0 && wholly_unmapped(seg))
                bury(c, w, seg);
        }
        w->nunmaps = 0;
    }
    free(w->unmaps);
    w->unmaps = NULL;
    w->capunmaps = 0;
}

static segment *find_expandable(const accel_core *c, uint64_t pool, int small, uint64_t stream) {
    for (segment *seg = c->segments; seg != NULL; seg = seg->next)
        if (seg->expandable && seg->stream == stream && seg->small == small && seg->pool == pool)
            return seg;
    return NULL;
}

static freelist *exp_list(accel_core *c, const segment *seg) {
    return find_list(c, seg->pool, seg->small, 1, seg->stream, 0);
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Absorbs b's unmapped neighbours into unmapped block b. */
static void merge_unmapped(block *b) {
    block *prev = b->prev, *next = b->next;
    if (prev != NULL && prev->state == ACCEL_CORE_UNMAPPED) {
        b->ptr = prev->ptr;
        b->size += prev->size;
        b->prev = prev->prev;
        if (b->prev != NULL)
            b->prev->next = b;
        else
            b->seg->head = b;
        free(prev);
    }
    if (next != NULL && next->state == ACCEL_CORE_UNMAPPED) {
        b->size += next->size;
        b->next = next->next;
        if (b->next != NULL)
            b->next->prev = b;
        free(next);
    }
}

/* Cuts [first, last) (inside b, page aligned) out of b, which is FREE and off its list
 * (its other pieces go back on it, l) or UNMAPPED (they stay so), as a block of state
 * `state`; returns it, or NULL (books unchanged) when the host has no memory. */
static block *carve(accel_core *c, freelist *l, block *b, uint64_t first, uint64_t last, int state) {
    uint64_t end = b->ptr + (uint64_t)b->size;
    block *head = NULL, *tail = NULL;
    if (first > b->ptr && (head = calloc(1, sizeof(block))) == NULL)
        return NULL;
    if (end > last && (tail = calloc(1, sizeof(block))) == NULL) {
        free(head);
        return NULL;
    }
    int old = b->state;
    block *pieces[3] = {head, b, tail};
    uint64_t starts[3] = {b->ptr, first, last}, ends[3] = {first, last, end};
    block *prev = b->prev, *next = b->next;
    for (int i = 0; i < 3; i++) {
        block *p = pieces[i];
        if (p == NULL)
            continue;
        p->ptr = starts[i];
        p->size = (int64_t)(ends[i] - starts[i]);
        p->seg = b->seg;
        p->state = p == b ? state : old;
        p->prev = prev;
        if (prev != NULL)
            prev->next = p;
        else
            b->seg->head = p;
        prev = p;
    }
    prev->next = next;
    if (next != NULL)
        next->prev = prev;
    if (old == ACCEL_CORE_FREE) {
        if (head != NULL)
            list_insert(c, l, head);
        if (tail != NULL)
            list_insert(c, l, tail);
    }
    return b;
}

/* Free block b's whole pages [first, last) become an UNMAPPING block (b off its list;
 * its other pieces back on it), counted now; w unmaps them. Returns the bytes (0: the
 * host had no memory for the books, nothing changed). */
static int64_t unmap_range(accel_core *c, vm_work *w, block *b, uint64_t first, uint64_t last, block **out) {
    freelist *l = exp_list(c, b->seg);
    *out = b;
    if (last <= first || work_unmap(w, b) != 0)
        return 0;
    list_remove(l, b);
    block *m = carve(c, l, b, first, last, UNMAPPING);
    if (m == NULL) {
        list_insert(c, l, b);
        w->nunmaps--;
        return 0;
    }
    int64_t n = (int64_t)(last - first);
    stat_add(c->s, ST_RESERVED_BYTES, b->seg->small ? 0 : 1, -n);
    c->s[ST_NUM_DEVICE_FREE]++;
    *out = m;
    return n;
}

/* Unlinks expandable segment seg (wholly unmapped) into w->dead. */
static void bury(accel_core *c, vm_work *w, segment *seg) {
    if (seg->prev != NULL)
        seg->prev->next = seg->next;
    else
        c->segments = seg->next;
    if (seg->next != NULL)
        seg->next->prev = seg->prev;
    seg->prev = NULL;
    seg->next = w->dead;
    w->dead = seg;
}

static int wholly_unmapped(const segment *seg) {
    return seg->head->state == ACCEL_CORE_UNMAPPED && seg->head->next == NULL;
}

/* Gives back the whole free pages of the expandable segments of the pools not kept (of
 * `pool` alone when only_pool), and the reservations left wholly unmapped; the lock
 * held (released meanwhile). Returns the bytes unmapped. */
static int64_t unmap_free_pages(accel_core *c, int only_pool, uint64_t pool) {
    if (!c->has_vm)
        return 0;
    vm_work w = {.wait = 1};
    int64_t bytes = 0;
    for (segment *seg = c->segments, *next; seg != NULL; seg = next) {
        next = seg->next;
        if (!seg->expandable || !(only_pool ? seg->pool == pool : !kept(c, seg->pool)))
            continue;
        int64_t page = seg->page;
        for (block *b = seg->head; b != NULL; b = b->next) {
            if (b->state != ACCEL_CORE_FREE)
                continue;
            uint64_t first = seg->base + (uint64_t)(ceil_div((int64_t)(b->ptr - seg->base), page) * page);
            uint64_t last = seg->base + (uint64_t)((int64_t)(b->ptr + (uint64_t)b->size - seg->base) / page * page);
            bytes += unmap_range(c, &w, b, first, last, &b);
        }
        if (seg->pins == 0 && wholly_unmapped(seg))
            bury(c, &w, seg); /* (a reservation whose first map failed) */
    }
    run_vm_work(c, &w);
    return bytes;
}

/* PyTorch's expandable segments keep no oversize rules (accel neither: PyTorch #193400). */

/* Puts a new block of size bytes at the end of free block b of an expandable segment
 * (on list l) rather than at its start when that adds fewer pages to those live blocks
 * touch, or as many but touches fewer bytes of pages beyond its size (the pages live
 * blocks touch are what stays mapped at the next growth, which gives back every other
 * whole free page). Then b is that end, its start a free block (*spare) on l; returns
 * whether it was. Only b, the best fit, is looked at (_caching.py's docstring says
 * why). */
static int place_at_end(accel_core *c, freelist *l, block *b, int64_t size, block **spare) {
    int64_t rest = b->size - size;
    if (rest < KB_MIN || *spare == NULL)
        return 0;
    segment *seg = b->seg;
    int64_t page = seg->page;
    int64_t lo = (int64_t)(b->ptr - seg->base), hi = lo + b->size;
    block *nxt = b->next, *prev = b->prev;
    /* the partial page at b's end (start) is touched already when a live block starts (ends) there */
    int tail_used = hi % page != 0 && nxt != NULL && nxt->state != ACCEL_CORE_FREE && nxt->state != ACCEL_CORE_UNMAPPED;
    if (!tail_used && lo % page == 0)
        return 0; /* at the start the block is page aligned, and the end fills no touched page */
    if (c->keep_free >= c->s[ST_RESERVED_BYTES + (seg->small ? 0 : 1)])
        return 0; /* every free page is kept: the lowest place keeps holes fewer */
    int head_used =
        lo % page != 0 && prev != NULL && prev->state != ACCEL_CORE_FREE && prev->state != ACCEL_CORE_UNMAPPED;
    int64_t first = lo / page, last = ceil_div(lo + size, page);
    int64_t new_start = last - first - head_used -
                        (tail_used && last - 1 == (hi - 1) / page && (last - 1 > first || !head_used));
    int64_t first_end = (hi - size) / page, last_end = ceil_div(hi, page);
    int64_t new_end = last_end - first_end - tail_used -
                      (head_used && first_end == first && (first_end < last_end - 1 || !tail_used));
    if (new_end > new_start || (new_end == new_start && last_end - first_end >= last - first))
        return 0;
    list_remove(l, b);
    block *head = *spare;
    *spare = NULL;
    memset(head, 0, sizeof(*head));
    head->ptr = b->ptr;
    head->size = rest;
    head->seg = seg;
    head->state = ACCEL_CORE_FREE;
    head->prev = prev;
    head->next = b;
    if (prev != NULL)
        prev->next = head;
    else
        seg->head = head;
    b->prev = head;
    b->ptr += (uint64_t)rest;
    b->size = size;
    list_insert(c, l, head);
    list_insert(c, l, b);
    return 1;
}

typedef struct {
    block *b;      /* the unmapped run */
    uint64_t addr; /* the first address to map */
    int64_t n;     /* bytes to map */
    int absorb;    /* whether the new block starts in the free block before */
} target;

/* Where seg grows to hold size bytes (0: the reservation is full). Every unmapped run
 * is a candidate with the free blocks around it; chosen, in this order: the fewest
 * pages added to those live blocks touch (a whole free page the new block covers
 * counts, as it would otherwise go back); the fewest bytes of the pages it touches
 * beyond its size; the fewest pages to map; the most free bytes taken in. (As
 * _caching.py's _map_target did; its docstring has the reasoning.) */
static int map_target(const segment *seg, int64_t size, target *out) {
    int64_t page = seg->page, base = (int64_t)seg->base;
    int64_t best[4] = {0, 0, 0, 0};
    int found = 0;
    for (block *b = seg->head; b != NULL; b = b->next) {
        if (b->state != ACCEL_CORE_UNMAPPED)
            continue;
        block *prev = b->prev, *nxt = b->next;
        int64_t before = prev != NULL && prev->state == ACCEL_CORE_FREE ? prev->size : 0;
        int64_t after = nxt != NULL && nxt->state == ACCEL_CORE_FREE ? nxt->size : 0;
        int64_t run_end = (int64_t)b->ptr + b->size;
        int64_t lo = (int64_t)b->ptr - before - base, hi = run_end + after - base;
        block *left = before && prev != NULL ? prev->prev : prev;
        block *right = after && nxt != NULL ? nxt->next : nxt;
        int head_used = lo % page != 0 && left != NULL && left->state != ACCEL_CORE_FREE &&
                        left->state != ACCEL_CORE_UNMAPPED;
        int tail_used = hi % page != 0 && right != NULL && right->state != ACCEL_CORE_FREE &&
                        right->state != ACCEL_CORE_UNMAPPED;
        int64_t opt_n[2], opt_addr[2];
        int opt_absorb[2], nopt = 0;
        if (size <= before + b->size) { /* from the start of the free block before (or of the run) */
            opt_n[nopt] = ceil_div(size - before, page) * page;
            opt_addr[nopt] = (int64_t)b->ptr;
            opt_absorb[nopt++] = before > 0;
        } else if (size <= before + b->size + after) { /* across the run into the free block after */
            opt_n[nopt] = b->size;
            opt_addr[nopt] = (int64_t)b->ptr;
            opt_absorb[nopt++] = before > 0;
        }
        if (after && size <= after + b->size) { /* from a page boundary to the end of the free block after */
            int64_t n = ceil_div(size - after, page) * page;
            if (n < b->size) {
                opt_n[nopt] = n;
                opt_addr[nopt] = run_end - n;
                opt_absorb[nopt++] = 0;
            }
        }
        for (int i = 0; i < nopt; i++) {
            int64_t n = opt_n[i], addr = opt_addr[i];
            int64_t start = (opt_absorb[i] ? addr - before : addr) - base;
            int64_t taken = (opt_absorb[i] ? before : 0) + (addr + n == run_end ? after : 0);
            int64_t first = start / page, last = ceil_div(start + size, page);
            int touched = head_used && first == lo / page;
            int64_t added = last - first - touched -
                            (tail_used && last - 1 == (hi - 1) / page && (last - 1 > first || !touched));
            int64_t key[4] = {added, (last - first) * page - size, n, -taken};
            int better = !found;
            for (int k = 0; k < 4 && !better; k++) {
                if (key[k] != best[k]) {
                    better = key[k] < best[k];
                    break;
                }
            }
            if (better) {
                memcpy(best, key, sizeof(best));
                out->b = b;
                out->addr = (uint64_t)addr;
                out->n = n;
                out->absorb = opt_absorb[i];
                found = 1;
            }
        }
    }
    return found;
}

/* The streams whose idleness a growth asked (for the length of one growth). */
typedef struct {
    uint64_t streams[16];
    int idle[16];
    int n;
} idle_cache;

static int cached_idle(const idle_cache *ic, uint64_t stream) {
    for (int i = 0; i < ic->n; i++)
        if (ic->streams[i] == stream)
            return ic->idle[i];
    return -1;
}

/* The whole free pages of seg's free blocks (but joined[0], and of joined[1] those past
 * upto) into w's plan: the count of bytes. */
static int64_t whole_free_pages(const segment *seg, block *const joined[2], uint64_t upto) {
    int64_t page = seg->page, whole = 0;
    for (block *b = seg->head; b != NULL; b = b->next) {
        if (b->state != ACCEL_CORE_FREE || b == joined[0])
            continue;
        uint64_t lo = b == joined[1] && upto > b->ptr ? upto : b->ptr;
        int64_t first = ceil_div((int64_t)(lo - seg->base), page) * page;
        int64_t last = (int64_t)(b->ptr + (uint64_t)b->size - seg->base) / page * page;
        if (last > first)
            whole += last - first;
    }
    return whole;
}

/* How many bytes of seg's whole free pages may go for growing's growth (0: none): all
 * but expandable_keep_free, and but as many as seg's last growth mapped when it grew
 * since growing last did (so that two segments needing pages in turn do not pass them
 * back and forth for ever); none while its stream has queued work (its free blocks may
 * still be in use by that work) or its idleness is not known yet (*ask: the stream to
 * ask about). */
static int64_t may_go(const accel_core *c, const segment *seg, const segment *growing, block *const joined[2],
                      uint64_t upto, const idle_cache *ic, uint64_t *ask, int *asking) {
    int64_t whole = whole_free_pages(seg, joined, upto);
    int64_t keep = c->keep_free;
    if (seg->grown_at > growing->grown_at && seg->last_growth > keep)
        keep = seg->last_growth;
    if (whole <= keep)
        return 0;
    int idle = cached_idle(ic, seg->stream);
    if (idle < 0) {
        if (!*asking)
            *ask = seg->stream, *asking = 1;
        return 0;
    }
    return idle ? whole - keep : 0;
}

/* Before growing maps growth bytes: unmap whole free pages of the holes of the
 * expandable segments (growing's, then the default pools', every stream), highest
 * first, at most growth bytes in all (the lock and the vm token held; the pages go
 * back by w). Reserved memory never shrinks here otherwise (hysteresis: see may_go).
 * Nothing during a capture. */
static void give_back_holes(accel_core *c, vm_work *w, segment *growing, int64_t growth, block *const joined[2],
                            uint64_t upto, const idle_cache *ic) {
    if (c->frozen)
        return;
    int64_t unmapped = 0;
    for (int pass = 0; pass < 2 && unmapped < growth; pass++) {
        for (segment *seg = pass ? c->segments : growing, *next; seg != NULL && unmapped < growth; seg = next) {
            next = pass ? seg->next : NULL;
            if (pass && (seg == growing || !seg->expandable || seg->pool != 0))
                continue;
            uint64_t ask = 0;
            int asking = 1; /* every stream was asked before (see grow) */
            int64_t allowed = may_go(c, seg, growing, joined, upto, ic, &ask, &asking);
            int64_t page = seg->page, taken = 0;
            /* highest first: walk back from the last block */
            block *b = seg->head;
            while (b->next != NULL)
                b = b->next;
            for (block *prev; b != NULL && taken < allowed && unmapped < growth; b = prev) {
                prev = b->prev; /* (see below once b is cut) */
                if (b->state != ACCEL_CORE_FREE || b == joined[0])
                    continue;
                uint64_t lo = b == joined[1] && upto > b->ptr ? upto : b->ptr;
                int64_t first = ceil_div((int64_t)(lo - seg->base), page) * page;
                int64_t last = (int64_t)(b->ptr + (uint64_t)b->size - seg->base) / page * page;
                if (last <= first)
                    continue;
                int64_t take = last - first;
                if (take > allowed - taken)
                    take = allowed - taken;
                if (take > growth - unmapped)
                    take = growth - unmapped;
                take -= take % page;
                if (take <= 0)
                    break;
                block *m;
                uint64_t start = b->ptr;
                int64_t done = unmap_range(c, w, b, seg->base + (uint64_t)(last - take), seg->base + (uint64_t)last, &m);
                if (done == 0)
                    return; /* no memory for the books: the growth maps new pages */
                /* on past what is left of b (its start, free): each free block gives once */
                prev = m->prev != NULL && m->prev->ptr == start && m->prev != m ? m->prev->prev : m->prev;
                taken += done;
                unmapped += done;
            }
        }
    }
}

static int any_mapped(const segment *seg) {
    for (const block *b = seg->head; b != NULL; b = b->next)
        if (b->state != ACCEL_CORE_UNMAPPED && b->state != UNMAPPING)
            return 1;
    return 0;
}

enum {
    GROWN = 0, GROW_REFUSED = ACCEL_UPSTREAM_REFUSED, GROW_FAILED = ACCEL_UPSTREAM_FAILED, GROW_NO_MEMORY = 3,
    GROW_AGAIN = 4, /* the books changed while unlocked: look at the free lists again */
};

/* Grows the expandable segment of (pool, kind, stream) (reserved first if it has none)
 * by the pages a block of size bytes needs; the lock held (released meanwhile), the vm
 * token too. On GROWN, *out is the free block that holds the new pages (merged with
 * its free neighbours, on its list). */
static int grow(accel_core *c, uint64_t pool, int small, uint64_t stream, int64_t size, block **out) {
    segment *seg = find_expandable(c, pool, small, stream);
    if (seg == NULL) {
        segment *fresh = calloc(1, sizeof(segment));
        block *head = calloc(1, sizeof(block));
        if (fresh == NULL || head == NULL || find_list(c, pool, small, 1, stream, 1) == NULL) {
            free(fresh);
            free(head);
            return GROW_NO_MEMORY;
        }
        int64_t reserve = c->reserve_size;
        uint64_t va = 0;
        pthread_mutex_unlock(&c->lock);
        int rc = c->vm.reserve(c->ctx, c->device, reserve, &va);
        pthread_mutex_lock(&c->lock);
        if (rc != 0) {
            free(fresh);
            free(head);
            return rc == ACCEL_UPSTREAM_REFUSED ? GROW_REFUSED : GROW_FAILED;
        }
        seg = find_expandable(c, pool, small, stream);
        if (seg != NULL) { /* another thread reserved one meanwhile: this one goes back */
            pthread_mutex_unlock(&c->lock);
            c->vm.unreserve(c->ctx, c->device, va, reserve);
            pthread_mutex_lock(&c->lock);
            free(fresh);
            free(head);
            return GROW_AGAIN;
        }
        fresh->base = va;
        fresh->size = reserve;
        fresh->stream = stream;
        fresh->pool = pool;
        fresh->small = small;
        fresh->expandable = 1;
        fresh->page = c->page;
        fresh->head = head;
        head->ptr = va;
        head->size = reserve;
        head->seg = fresh;
        head->state = ACCEL_CORE_UNMAPPED;
        fresh->next = c->segments;
        if (c->segments != NULL)
            c->segments->prev = fresh;
        c->segments = fresh;
        seg = fresh;
    }
    /* The streams of the segments with pages to spare are asked whether they are
     * idle, without the lock: the books may change meanwhile, so the target is
     * chosen again after each question (a growth asks a few streams at most). */
    idle_cache ic = {.n = 0};
    target t = {0};
    block *joined[2];
    uint64_t upto;
plan:
    for (;;) {
        if (!map_target(seg, size, &t))
            return GROW_REFUSED; /* the reservation is full */
        block *b = t.b;
        joined[0] = t.absorb ? b->prev : NULL;
        joined[1] = t.addr + (uint64_t)t.n == b->ptr + (uint64_t)b->size ? b->next : NULL;
        if (joined[1] != NULL && joined[1]->state != ACCEL_CORE_FREE)
            joined[1] = NULL;
        upto = (t.absorb && b->prev != NULL ? b->prev->ptr : t.addr) + (uint64_t)size;
        uint64_t ask = 0;
        int asking = 0;
        if (!c->frozen && ic.n < 16) {
            may_go(c, seg, seg, joined, upto, &ic, &ask, &asking);
            for (segment *s = c->segments; s != NULL && !asking; s = s->next)
                if (s != seg && s->expandable && s->pool == 0)
                    may_go(c, s, seg, joined, upto, &ic, &ask, &asking);
        }
        if (!asking)
            break;
        seg->pins++; /* not given back while unlocked */
        pthread_mutex_unlock(&c->lock);
        int idle = c->vm.idle(c->ctx, c->device, ask);
        pthread_mutex_lock(&c->lock);
        seg->pins--;
        ic.streams[ic.n] = ask;
        ic.idle[ic.n++] = idle != 0;
    }
    vm_work w = {0};
    int had_pages = any_mapped(seg);
    give_back_holes(c, &w, seg, t.n, joined, upto, &ic);
    if (had_pages && !any_mapped(seg)) {
        /* the give-back left the growing segment with no page: planned again as a
         * fresh reservation (its first pages at its start, growth clock reset) */
        seg->pins++;
        run_vm_work(c, &w);
        seg->pins--;
        seg->grown_at = 0;
        seg->last_growth = 0;
        goto plan;
    }
    /* the run to map, merged with pages just given back next to it: a block of its own */
    block *run = seg->head;
    while (run != NULL && !(run->state == ACCEL_CORE_UNMAPPED && run->ptr <= t.addr &&
                            t.addr < run->ptr + (uint64_t)run->size))
        run = run->next;
    block *m = run == NULL ? NULL : carve(c, NULL, run, t.addr, t.addr + (uint64_t)t.n, MAPPING);
    seg->pins++; /* not given back while unlocked (by this thread's run_vm_work neither) */
    run_vm_work(c, &w); /* the give-back first: its pages may be mapped again here */
    if (m == NULL) {
        seg->pins--;
        return GROW_NO_MEMORY;
    }
    pthread_mutex_unlock(&c->lock);
    int rc = c->vm.map(c->ctx, c->device, t.addr, t.n);
    pthread_mutex_lock(&c->lock);
    seg->pins--;
    if (rc != 0) {
        m->state = ACCEL_CORE_UNMAPPED;
        merge_unmapped(m);
        return rc == ACCEL_UPSTREAM_REFUSED ? GROW_REFUSED : GROW_FAILED;
    }
    int kind = small ? 0 : 1;
    stat_add(c->s, ST_RESERVED_BYTES, kind, t.n);
    c->s[ST_NUM_DEVICE_ALLOC]++;
    seg->grown_at = ++c->growths;
    seg->last_growth = t.n;
    /* free now: merged with the free blocks around it (they may have changed while the
     * lock was released; the new block starts where the merged one does) */
    freelist *l = exp_list(c, seg);
    m->state = ACCEL_CORE_FREE;
    block *prev = m->prev, *next = m->next;
    if (prev != NULL && prev->state == ACCEL_CORE_FREE) {
        list_remove(l, prev);
        m->ptr = prev->ptr;
        m->size += prev->size;
        m->prev = prev->prev;
        if (m->prev != NULL)
            m->prev->next = m;
        else
            seg->head = m;
        free(prev);
    }
    if (next != NULL && next->state == ACCEL_CORE_FREE) {
        list_remove(l, next);
        m->size += next->size;
        m->next = next->next;
        if (m->next != NULL)
            m->next->prev = m;
        free(next);
    }
    list_insert(c, l, m);
    *out = m;
    return GROWN;
}

EXPORT void accel_core_set_vm(accel_core *c, const accel_vm_ops *ops) {
    pthread_mutex_lock(&c->lock);
    c->vm = *ops;
    c->has_vm = ops->reserve != NULL && ops->unreserve != NULL && ops->map != NULL && ops->unmap != NULL &&
                ops->idle != NULL;
    c->expandable = c->expandable && c->has_vm;
    pthread_mutex_unlock(&c->lock);
}

EXPORT void accel_core_set_expandable(accel_core *c, int on, int64_t page, int64_t reserve_size, int64_t keep_free) {
    pthread_mutex_lock(&c->lock);
    /* a page is a multiple of 512 bytes, a reservation of pages */
    int valid = page >= KB_MIN && page % KB_MIN == 0 && reserve_size >= page && reserve_size % page == 0;
    c->expandable = on && c->has_vm && valid;
    if (valid) { /* segments reserved before keep their own page */
        c->page = page;
        c->reserve_size = reserve_size;
    }
    c->keep_free = keep_free > 0 ? keep_free : 0;
    pthread_mutex_unlock(&c->lock);
}

/* The miss step after step (the lock held): those that cannot help are skipped. */
static int next_step(const accel_core *c, int step, int flags) {
    step++;
    if (step == 1 && (c->max_split_size <= 0 || c->frozen || c->expandable))
        step++;
    if (step == 2 && (c->frozen || (flags & ACCEL_CORE_NO_RETRY)))
        step++;
    return step;
}

/* A malloc refused after its last step (the lock held: released here). */
static int oom(accel_core *c, int flags, block *spare) {
    if (!(flags & ACCEL_CORE_NO_RETRY))
        c->s[ST_NUM_OOMS]++;
    pthread_mutex_unlock(&c->lock);
    free(spare);
    return ACCEL_CORE_OOM;
}

EXPORT int accel_core_malloc(accel_core *c, int64_t nbytes, uint64_t stream, uint64_t pool, int flags,
                             uint64_t *ptr, int64_t *size_out) {
    if (nbytes < 1 || nbytes >= MAX_REQUEST)
        return ACCEL_CORE_BAD_SIZE;
    /* allocated outside the lock: a cut needs a block for the rest, a miss a segment */
    block *spare = malloc(sizeof(block));
    if (spare == NULL)
        return ACCEL_CORE_NO_MEMORY;
    /* the steps of a miss, in order: ask upstream; give back oversize cached blocks
     * that could make room and ask again; give back the whole cache and ask again
     * (not with ACCEL_CORE_NO_RETRY: the caller has steps of its own first) */
    int step = (flags & ACCEL_CORE_GIVE_BACK_FIRST) ? 2 : 0, given_at = -1;
    int torch = (flags & ACCEL_CORE_TORCH) != 0;
    pthread_mutex_lock(&c->lock);
    int64_t size = round_request(c, nbytes);
    int small = size <= SMALL_SIZE;
    for (;;) {
        /* expandable segments' free blocks are reused while the setting is on (both lists
         * made first: making one may move the other) */
        freelist *le = c->expandable ? find_list(c, pool, small, 1, stream, 1) : NULL;
        freelist *l = find_list(c, pool, small, 0, stream, 1);
        if (le != NULL)
            le = find_list(c, pool, small, 1, stream, 0);
        if (l == NULL || (c->expandable && le == NULL) || map_reserve(&c->allocated) != 0) {
            pthread_mutex_unlock(&c->lock);
            free(spare);
            return ACCEL_CORE_NO_MEMORY;
        }
        if (c->gc_threshold && pool == 0 && !small && l->count)
            c->gc_clock++;
        block *b = list_best_fit(l, size);
        if (b != NULL && !usable(c, b->size, size))
            b = NULL;
        block *e = le != NULL ? list_best_fit(le, size) : NULL;
        if (e != NULL && (b == NULL || e->size < b->size)) { /* the best fit of both */
            place_at_end(c, le, e, size, &spare);
            take_block(c, le, e, size, nbytes, torch, &spare);
            *ptr = e->ptr;
            *size_out = e->size;
            pthread_mutex_unlock(&c->lock);
            free(spare);
            return ACCEL_CORE_OK;
        }
        if (b != NULL) {
            take_block(c, l, b, size, nbytes, torch, &spare);
            *ptr = b->ptr;
            *size_out = b->size;
            pthread_mutex_unlock(&c->lock);
            free(spare);
            return ACCEL_CORE_OK;
        }
        /* a miss: give back what the step says, then ask upstream, without the lock */
        segment *cached = NULL;
        int ask = 1;
        if (!c->frozen && given_at != step) { /* once per step (an expandable miss may loop) */
            given_at = step;
            if (step == 0 && c->gc_threshold)
                collect_garbage(c, &cached);
            else if (step == 1)
                ask = release_available(c, l, size, &cached); /* not enough: on to step 2 */
            else if (step == 2) {
                unmap_free_pages(c, 0, 0);
                detach_free_segments(c, &cached, 0, 0);
                c->s[ST_NUM_ALLOC_RETRIES]++;
            }
        }
        if (c->expandable) {
            /* the expandable segment grows instead (a plain segment's cache went back
             * above all the same) */
            pthread_mutex_unlock(&c->lock);
            give_back(c, cached);
            pthread_mutex_lock(&c->lock);
            if (!c->expandable)
                continue; /* turned off meanwhile */
            block *g = NULL;
            int rc = grow(c, pool, small, stream, size, &g);
            if (rc == GROW_AGAIN)
                continue;
            if (rc == GROWN) {
                if (g->size < size)
                    continue; /* its neighbours were taken meanwhile */
                take_block(c, exp_list(c, g->seg), g, size, nbytes, torch, &spare);
                *ptr = g->ptr;
                *size_out = g->size;
                pthread_mutex_unlock(&c->lock);
                free(spare);
                return ACCEL_CORE_OK;
            }
            if (rc != GROW_REFUSED) { /* not a shortage: no cache helps */
                pthread_mutex_unlock(&c->lock);
                free(spare);
                return rc == GROW_NO_MEMORY ? ACCEL_CORE_NO_MEMORY : ACCEL_CORE_OOM;
            }
            step = next_step(c, step, flags);
            if (step > 2)
                return oom(c, flags, spare);
            continue;
        }
        int64_t want = segment_size_for(c, size);
        pthread_mutex_unlock(&c->lock);
        give_back(c, cached);
        if (!ask) {
            pthread_mutex_lock(&c->lock);
            step = next_step(c, step, flags);
            if (step > 2)
                return oom(c, flags, spare);
            continue;
        }
        segment *seg = calloc(1, sizeof(segment));
        block *head = calloc(1, sizeof(block));
        uint64_t base = 0;
        int refused = ACCEL_UPSTREAM_REFUSED;
        if (seg != NULL && head != NULL)
            refused = c->upstream_alloc(c->ctx, c->device, want, &base);
        if (seg == NULL || head == NULL) {
            free(seg);
            free(head);
            free(spare);
            return ACCEL_CORE_NO_MEMORY;
        }
        if (refused == ACCEL_UPSTREAM_FAILED) { /* not a shortage: no cache helps */
            free(seg);
            free(head);
            free(spare);
            return ACCEL_CORE_OOM;
        }
        if (refused) {
            free(seg);
            free(head);
            pthread_mutex_lock(&c->lock);
            /* the next step (another thread may have freed meanwhile, so the loop
             * looks at the free list again first) */
            step = next_step(c, step, flags);
            if (step > 2)
                return oom(c, flags, spare);
            continue;
        }
        seg->base = base;
        seg->size = want;
        seg->stream = stream;
        seg->pool = pool;
        seg->small = small;
        seg->head = head;
        head->ptr = base;
        head->size = want;
        head->seg = seg;
        pthread_mutex_lock(&c->lock);
        seg->next = c->segments;
        if (c->segments != NULL)
            c->segments->prev = seg;
        c->segments = seg;
        int kind = small ? 0 : 1;
        stat_add(c->s, ST_SEGMENT, kind, 1);
        stat_add(c->s, ST_RESERVED_BYTES, kind, want);
        if (oversize(c, want))
            stat_add(c->s, ST_OVERSIZE_SEGMENTS, 0, 1);
        c->s[ST_NUM_DEVICE_ALLOC]++;
        l = find_list(c, pool, small, 0, stream, 1); /* lists may have moved while unlocked */
        if (l == NULL || map_reserve(&c->allocated) != 0) {
            /* no room in the books: the segment stays cached, free */
            if (l != NULL)
                list_insert(c, l, head);
            pthread_mutex_unlock(&c->lock);
            free(spare);
            return ACCEL_CORE_NO_MEMORY;
        }
        list_insert(c, l, head);
        take_block(c, l, head, size, nbytes, torch, &spare);
        *ptr = head->ptr;
        *size_out = head->size;
        pthread_mutex_unlock(&c->lock);
        free(spare);
        return ACCEL_CORE_OK;
    }
}

/* The caller no longer uses allocated block b: it leaves the allocated statistics
 * (it stays active and requested until its memory is free for reuse). */
static void drop_allocated(accel_core *c, block *b) {
    int kind = b->seg->small ? 0 : 1;
    stat_add(c->s, ST_ALLOCATION, kind, -1);
    stat_add(c->s, ST_ALLOCATED_BYTES, kind, -b->size);
    if (oversize(c, b->size))
        stat_add(c->s, ST_OVERSIZE_ALLOCATIONS, 0, -1);
}

/* Block b (off the ptrmap, counted active) becomes free: merged with free neighbours
 * onto its list. Returns the block objects merged away, for the caller to free once
 * the lock is released. */
static void make_free(accel_core *c, block *b, block *dead[2]) {
    segment *seg = b->seg;
    int kind = seg->small ? 0 : 1;
    int64_t *s = c->s;
    stat_add(s, ST_ACTIVE, kind, -1);
    stat_add(s, ST_ACTIVE_BYTES, kind, -b->size);
    stat_add(s, ST_REQUESTED_BYTES, kind, -b->requested);
    b->state = ACCEL_CORE_FREE;
    b->requested = 0;
    /* free neighbours merge (unmapped ones are not free); no inactive splits are
     * counted in expandable segments */
    int plain = !seg->expandable;
    freelist *l = find_list(c, seg->pool, seg->small, seg->expandable, seg->stream, 0);
    block *prev = b->prev, *next = b->next;
    if (prev != NULL && prev->state == ACCEL_CORE_FREE) { /* prev absorbs b */
        list_remove(l, prev);
        if (plain)
            stat_add(s, ST_INACTIVE_SPLIT, kind, -1), stat_add(s, ST_INACTIVE_SPLIT_BYTES, kind, -prev->size);
        prev->size += b->size;
        prev->next = next;
        if (next != NULL)
            next->prev = prev;
        dead[0] = b;
        b = prev;
    }
    if (next != NULL && next->state == ACCEL_CORE_FREE) { /* b absorbs next */
        list_remove(l, next);
        if (plain)
            stat_add(s, ST_INACTIVE_SPLIT, kind, -1), stat_add(s, ST_INACTIVE_SPLIT_BYTES, kind, -next->size);
        b->size += next->size;
        b->next = next->next;
        if (next->next != NULL)
            next->next->prev = b;
        dead[1] = next;
    }
    list_insert(c, l, b);
    if (plain && is_split(b))
        stat_add(s, ST_INACTIVE_SPLIT, kind, 1), stat_add(s, ST_INACTIVE_SPLIT_BYTES, kind, b->size);
}

/* Frees allocated block ptr if it was (torch: only if it was not) allocated through
 * accel_torch_alloc: neither side may free the other's blocks. */
static int free_block(accel_core *c, uint64_t ptr, int torch) {
    pthread_mutex_lock(&c->lock);
    block *b = map_take(&c->allocated, ptr, 1);
    if (b == NULL || b->state != ACCEL_CORE_ALLOCATED || b->torch != torch) {
        if (b != NULL) /* held, or the other side's: it stays in the map (its slot is free again) */
            map_put(&c->allocated, b);
        pthread_mutex_unlock(&c->lock);
        return ACCEL_CORE_NOT_ALLOCATED;
    }
    block *dead[2] = {NULL, NULL};
    drop_allocated(c, b);
    make_free(c, b, dead);
    pthread_mutex_unlock(&c->lock);
    free(dead[0]);
    free(dead[1]);
    return ACCEL_CORE_OK;
}

EXPORT int accel_core_free(accel_core *c, uint64_t ptr) { return free_block(c, ptr, 0); }

EXPORT int accel_core_hold(accel_core *c, uint64_t ptr) {
    pthread_mutex_lock(&c->lock);
    block *b = map_take(&c->allocated, ptr, 0);
    int rc = ACCEL_CORE_NOT_ALLOCATED;
    if (b != NULL && b->state == ACCEL_CORE_ALLOCATED && !b->torch) {
        drop_allocated(c, b);
        b->state = ACCEL_CORE_HELD;
        rc = ACCEL_CORE_OK;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

EXPORT int accel_core_release_held(accel_core *c, uint64_t ptr) {
    pthread_mutex_lock(&c->lock);
    block *b = map_take(&c->allocated, ptr, 1);
    if (b == NULL || b->state != ACCEL_CORE_HELD) {
        if (b != NULL) /* allocated: it stays in the map */
            map_put(&c->allocated, b);
        pthread_mutex_unlock(&c->lock);
        return ACCEL_CORE_NOT_HELD;
    }
    block *dead[2] = {NULL, NULL};
    make_free(c, b, dead);
    pthread_mutex_unlock(&c->lock);
    free(dead[0]);
    free(dead[1]);
    return ACCEL_CORE_OK;
}

EXPORT int64_t accel_core_empty_cache(accel_core *c) {
    segment *cached = NULL;
    pthread_mutex_lock(&c->lock);
    int64_t bytes = c->frozen ? 0 : unmap_free_pages(c, 0, 0);
    bytes += c->frozen ? 0 : detach_free_segments(c, &cached, 0, 0);
    pthread_mutex_unlock(&c->lock);
    give_back(c, cached);
    return bytes;
}

EXPORT int accel_core_keep_pool(accel_core *c, uint64_t pool, int keep) {
    pthread_mutex_lock(&c->lock);
    int64_t i = 0;
    while (i < c->nkept && c->kept[i] != pool)
        i++;
    if (keep && i == c->nkept) {
        if (c->nkept == c->capkept) {
            int64_t cap = c->capkept ? 2 * c->capkept : 8;
            uint64_t *grown = realloc(c->kept, (size_t)cap * sizeof(uint64_t));
            if (grown == NULL) {
                pthread_mutex_unlock(&c->lock);
                return ACCEL_CORE_NO_MEMORY;
            }
            c->kept = grown;
            c->capkept = cap;
        }
        c->kept[c->nkept++] = pool;
    } else if (!keep && i < c->nkept) {
        c->kept[i] = c->kept[--c->nkept];
    }
    pthread_mutex_unlock(&c->lock);
    return ACCEL_CORE_OK;
}

EXPORT int64_t accel_core_release_pool(accel_core *c, uint64_t pool) {
    segment *cached = NULL;
    pthread_mutex_lock(&c->lock);
    int64_t bytes = c->frozen ? 0 : unmap_free_pages(c, 1, pool);
    bytes += c->frozen ? 0 : detach_free_segments(c, &cached, 1, pool);
    pthread_mutex_unlock(&c->lock);
    give_back(c, cached);
    return bytes;
}

EXPORT int64_t accel_core_pool_segments(accel_core *c, uint64_t pool) {
    int64_t n = 0;
    pthread_mutex_lock(&c->lock);
    for (segment *seg = c->segments; seg != NULL; seg = seg->next)
        n += seg->pool == pool;
    pthread_mutex_unlock(&c->lock);
    return n;
}

EXPORT int64_t accel_core_rekey_stream(accel_core *c, uint64_t old, uint64_t key) {
    int64_t n = 0;
    pthread_mutex_lock(&c->lock);
    for (segment *seg = c->segments; seg != NULL; seg = seg->next)
        if (seg->stream == old)
            seg->stream = key, n++;
    int64_t count = c->nlists;
    for (int64_t i = 0; i < count; i++) {
        freelist *l = &c->lists[i];
        if (l->stream != old)
            continue;
        freelist *to = find_list(c, l->pool, l->small, l->expandable, key, 0);
        if (to == NULL) {
            l->stream = key;
            continue;
        }
        /* the new key has a list already (a caller reusing a key): move the blocks */
        while (l->root != NULL) {
            block *b = l->root;
            list_remove(l, b);
            list_insert(c, to, b);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return n;
}

EXPORT void accel_core_destroy(accel_core *c) {
    c->frozen = 0;
    c->nkept = 0;
    accel_core_empty_cache(c);
    /* what is still allocated stays with its holders; only the books go */
    for (segment *seg = c->segments, *next; seg != NULL; seg = next) {
        next = seg->next;
        for (block *b = seg->head, *bn; b != NULL; b = bn) {
            bn = b->next;
            free(b);
        }
        free(seg);
    }
    free(c->lists);
    free(c->kept);
    free(c->allocated.slots);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

EXPORT void accel_core_stats(accel_core *c, int64_t *out) {
    pthread_mutex_lock(&c->lock);
    memcpy(out, c->s, sizeof(c->s));
    pthread_mutex_unlock(&c->lock);
}

EXPORT void accel_core_reset_peak(accel_core *c) {
    pthread_mutex_lock(&c->lock);
    for (int base = 0; base < ST_NUM_ALLOC_RETRIES; base += 8) {
        c->s[base + 2] = c->s[base];
        c->s[base + 3] = c->s[base + 1];
        c->s[base + 6] = c->s[base] + c->s[base + 1];
    }
    pthread_mutex_unlock(&c->lock);
}

EXPORT int64_t accel_core_blocks(accel_core *c, accel_core_block_info *out, int64_t cap) {
    int64_t n = 0;
    pthread_mutex_lock(&c->lock);
    for (segment *seg = c->segments; seg != NULL; seg = seg->next) {
        for (block *b = seg->head; b != NULL; b = b->next, n++) {
            if (n < cap) {
                accel_core_block_info *i = &out[n];
                i->segment = seg->base;
                i->segment_size = seg->size;
                i->stream = seg->stream;
                i->pool = seg->pool;
                i->small = seg->small;
                i->expandable = seg->expandable;
                /* a range being mapped or unmapped is not mapped yet, or no more */
                i->state = b->state == MAPPING || b->state == UNMAPPING ? ACCEL_CORE_UNMAPPED : b->state;
                i->ptr = b->ptr;
                i->size = b->size;
                i->requested = b->requested;
            }
        }
    }
    pthread_mutex_unlock(&c->lock);
    return n;
}

EXPORT int64_t accel_core_allocated_size(accel_core *c, uint64_t ptr) {
    pthread_mutex_lock(&c->lock);
    block *b = map_take(&c->allocated, ptr, 0);
    int64_t size = b == NULL || b->state != ACCEL_CORE_ALLOCATED ? -1 : b->size;
    pthread_mutex_unlock(&c->lock);
    return size;
}

/* -- torch's pluggable allocator ----------------------------------------------------- */

static accel_core *_Atomic torch_cores[ACCEL_CORE_MAX_DEVICES];

/* A child forked while another thread held a core's mutex would wait for it forever,
 * and accel refuses to run in a child forked after it started: the child's torch
 * allocations get NULL (torch's out-of-memory error) instead. */
static void forget_cores_in_child(void) {
    for (int i = 0; i < ACCEL_CORE_MAX_DEVICES; i++)
        __atomic_store_n(&torch_cores[i], NULL, __ATOMIC_RELAXED);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void install_atfork(void) { pthread_atfork(NULL, NULL, forget_cores_in_child); }

EXPORT accel_core *accel_core_register_torch(int device, accel_core *core) {
    if (device < 0 || device >= ACCEL_CORE_MAX_DEVICES)
        return NULL;
    pthread_once(&atfork_once, install_atfork);
    return __atomic_exchange_n(&torch_cores[device], core, __ATOMIC_ACQ_REL);
}

/* void* alloc(ssize_t size, int device, cudaStream_t stream): NULL when out of memory
 * (torch raises its OutOfMemoryError) or when accel serves no such device. torch asks
 * for 0 bytes too; that gets the smallest block, so the pointer is unique. */
EXPORT void *accel_torch_alloc(ssize_t size, int device, void *stream) {
    if (device < 0 || device >= ACCEL_CORE_MAX_DEVICES || size < 0)
        return NULL;
    accel_core *c = __atomic_load_n(&torch_cores[device], __ATOMIC_ACQUIRE);
    if (c == NULL)
        return NULL;
    uint64_t ptr = 0;
    int64_t got = 0;
    if (accel_core_malloc(c, size ? (int64_t)size : 1, (uint64_t)(uintptr_t)stream, 0, ACCEL_CORE_TORCH, &ptr, &got) !=
        ACCEL_CORE_OK)
        return NULL;
    return (void *)(uintptr_t)ptr;
}

/* void free(void* ptr, ssize_t size, int device, cudaStream_t stream). A pointer the
 * core did not hand out to torch (an accel buffer's among them) is ignored: torch's
 * free returns nothing to report it with. */
EXPORT void accel_torch_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)stream;
    if (ptr == NULL || device < 0 || device >= ACCEL_CORE_MAX_DEVICES)
        return;
    accel_core *c = __atomic_load_n(&torch_cores[device], __ATOMIC_ACQUIRE);
    if (c != NULL)
        free_block(c, (uint64_t)(uintptr_t)ptr, 1);
}

EXPORT int accel_core_gil_free(void) { return 1; }
