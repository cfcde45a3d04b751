/* Calls accel's torch allocator ABI as torch does: dlopen the library, dlsym the two
 * names, then alloc/free from native threads (tests/allocator/test_torch_allocator.py).
 * Each thread fills its blocks with its own byte and checks them before freeing, so
 * two threads handed overlapping memory fail the check. */

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);

#define THREADS 8
#define HELD 16

static alloc_fn torch_alloc;
static free_fn torch_free;
static pthread_t threads[THREADS];
static int started, finished;

struct work {
    int id, iters, device, max_size;
    int failures; /* NULL from alloc, or memory another thread wrote */
};
static struct work works[THREADS];

static void *worker(void *p) {
    struct work *w = p;
    void *stream = (void *)(uintptr_t)(w->id % 2 ? 0x1000 : 0); /* two streams */
    unsigned char mark = (unsigned char)(w->id + 1);
    void *held[HELD];
    ssize_t sizes[HELD];
    unsigned x = 12345u + (unsigned)w->id;
    for (int i = 0; i < w->iters; i++) {
        for (int k = 0; k < HELD; k++) {
            x = x * 1103515245u + 12345u;
            sizes[k] = (ssize_t)((x >> 8) % (unsigned)w->max_size);
            held[k] = torch_alloc(sizes[k], w->device, stream);
            if (held[k] == NULL)
                w->failures++;
            else if (sizes[k] > 0)
                memset(held[k], mark, (size_t)sizes[k]);
        }
        for (int k = 0; k < HELD; k++) {
            if (held[k] == NULL)
                continue;
            unsigned char *bytes = held[k];
            for (ssize_t j = 0; j < sizes[k]; j += 61)
                if (bytes[j] != mark) {
                    w->failures++;
                    break;
                }
            torch_free(held[k], sizes[k], w->device, stream);
        }
    }
    __atomic_add_fetch(&finished, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* Starts the threads; 0, or -1 when the library or a name is missing. */
int harness_start(const char *path, const char *alloc_name, const char *free_name, int device, int iters,
                  int max_size) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return -1;
    torch_alloc = (alloc_fn)dlsym(lib, alloc_name);
    torch_free = (free_fn)dlsym(lib, free_name);
    if (torch_alloc == NULL || torch_free == NULL)
        return -1;
    finished = 0;
    for (int t = 0; t < THREADS; t++) {
        works[t] = (struct work){.id = t, .iters = iters, .device = device, .max_size = max_size};
        if (pthread_create(&threads[t], NULL, worker, &works[t]) != 0)
            return -1;
    }
    started = 1;
    return 0;
}

/* Waits for the threads; the failures they saw. */
int harness_join(void) {
    int failures = 0;
    for (int t = 0; started && t < THREADS; t++) {
        pthread_join(threads[t], NULL);
        failures += works[t].failures;
    }
    started = 0;
    return failures;
}

/* How many threads are still running. */
int harness_running(void) { return started ? THREADS - __atomic_load_n(&finished, __ATOMIC_ACQUIRE) : 0; }
