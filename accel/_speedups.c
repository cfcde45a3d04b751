/* accel._speedups: optional C versions of the caching allocator's hot paths.
 *
 * Pure Python is accel's reference and its fallback: this module is built when a
 * compiler is there (setup.py marks it optional) and used unless ACCEL_PURE_PYTHON=1
 * (accel/_native.py decides). Every function here does, step by step, what the
 * Python code it replaces does, on the same objects: Block, Segment, Pool, FreeList,
 * Counts and Buffer stay the Python classes of accel/allocator (so weak references,
 * pickling, repr and every slow path keep working unchanged), and this module reads
 * and writes their __slots__ at the offsets their member descriptors give. Whenever
 * a condition of a fast path fails, or an object is not of the exact class expected,
 * it calls the Python method it stands in for, before changing anything.
 *
 * The whole suite runs both ways (tests/test_speedups.py says which one ran).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The CRC-32 of this file, passed by setup.py. accel/_native.py compares it with the
 * source beside the package and refuses a module built from another version of it: an
 * old build (in build/ or in the tree, kept when a later build had no compiler) reads
 * slots and calls methods that the current Python code may no longer have. */
#ifndef ACCEL_SPEEDUPS_SOURCE_CRC32
#error "build accel/_speedups.c through setup.py: it defines ACCEL_SPEEDUPS_SOURCE_CRC32, checked by accel/_native.py"
#endif

/* -- what install_allocator() was given ------------------------------------------ */

static PyTypeObject *Block_T, *Segment_T, *Pool_T, *FreeList_T, *Counts_T, *Every_T;
static PyObject *py_free_held; /* the Python method */
static PyObject *py_fl_replace, *py_fl_remove, *py_fl_add;         /* FreeList's methods */
static PyObject *py_note_active_peak, *InvalidHandleError;
static PyObject *FREE, *ALLOCATED, *RETIRED;                       /* block states */
static PyObject *freelist_globals, *s_LOAD;                        /* accel/allocator/_freelist.py */
static PyObject *ONE;
static long long SMALL_SIZE, MAX_REQUEST;
static Py_ssize_t OVERSIZE_ALLOCATIONS, ACTIVE;

/* slot offsets */
static Py_ssize_t B_ptr, B_size, B_requested, B_stream, B_pool, B_segment, B_state, B_mapped,
    B_prev, B_next, B_event_count, B_stream_uses, B_gc_base, B_frames;
static Py_ssize_t SG_owner, SG_expandable, SG_head, SG_stream, SG_pool;
static Py_ssize_t P_small, P_kind, P_free, P_calls;
static Py_ssize_t F_keys, F_blocks, F_maxes, F_len, F_fit_k, F_fit_i;

enum { ST_ALLOCATION, ST_ALLOCATED_BYTES, ST_REQUESTED_BYTES, ST_INACTIVE_SPLIT, ST_INACTIVE_SPLIT_BYTES, N_HOT };
static const char *const hot_names[N_HOT] = {
    "allocation", "allocated_bytes", "requested_bytes", "inactive_split", "inactive_split_bytes",
};
static Py_ssize_t C_cur[N_HOT], C_peak[N_HOT], C_total[N_HOT], E_peak[N_HOT];
static Py_ssize_t C_other, C_every;

/* interned attribute names of the (dict-based) allocator and stream */
static PyObject *s_lock, *s_fast, *s_gc_frees, *s_pending, *s_small, *s_large, *s_ms, *s_gc_threshold,
    *s_kinds, *s_s, *s_device, *s_backend, *s_history, *s_orphaned, *s_malloc_steps, *s_free_block,
    *s_acquire, *s_release, *s_dev, *s_runtime, *s_closed, *s_handle;

/* -- slots ------------------------------------------------------------------------- */

static int
slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *out)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL)
        return -1;
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) || ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ attribute", type->tp_name, name);
        Py_DECREF(descr);
        return -1;
    }
    *out = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    return 0;
}

/* The value of a slot, borrowed; AttributeError when it was never set. */
static inline PyObject *
get(PyObject *o, Py_ssize_t off)
{
    PyObject *v = SLOT(o, off);
    if (v == NULL)
        PyErr_Format(PyExc_AttributeError, "a slot of %s is not set", Py_TYPE(o)->tp_name);
    return v;
}

static inline void
set(PyObject *o, Py_ssize_t off, PyObject *v)
{
    Py_INCREF(v);
    Py_XSETREF(SLOT(o, off), v);
}

/* Store a new reference (stolen); -1 when v is NULL (an error is set). */
static inline int
set_new(PyObject *o, Py_ssize_t off, PyObject *v)
{
    if (v == NULL)
        return -1;
    Py_XSETREF(SLOT(o, off), v);
    return 0;
}

/* v + d as Python computes it: C arithmetic while it fits, Python's otherwise. */
static PyObject *
add_ll(PyObject *v, long long d)
{
    if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow), r;
        if (!overflow && !(x == -1 && PyErr_Occurred()) && !__builtin_add_overflow(x, d, &r))
            return PyLong_FromLongLong(r);
        PyErr_Clear();
    }
    PyObject *dd = PyLong_FromLongLong(d);
    if (dd == NULL)
        return NULL;
    PyObject *r = PyNumber_Add(v, dd);
    Py_DECREF(dd);
    return r;
}

/* o.slot += d; *out (borrowed) is the new value. */
static int
slot_add(PyObject *o, Py_ssize_t off, long long d, PyObject **out)
{
    PyObject *v = get(o, off);
    if (v == NULL || set_new(o, off, add_ll(v, d)) < 0)
        return -1;
    if (out != NULL)
        *out = SLOT(o, off);
    return 0;
}

/* o.slot -= v (a Python int) */
static int
slot_sub(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *x = get(o, off);
    return x == NULL ? -1 : set_new(o, off, PyNumber_Subtract(x, v));
}

/* A C long long of a Python int; 0 when it is none, or does not fit. */
static inline int
as_ll(PyObject *v, long long *out)
{
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* An address or size below 2**63 (every one a host or device gives; 0 otherwise, and the
 * caller takes the Python path). */
static inline int
as_ull(PyObject *v, unsigned long long *out)
{
    long long x;
    if (!as_ll(v, &x) || x < 0)
        return 0;
    *out = (unsigned long long)x;
    return 1;
}

/* -- statistics (accel/allocator/_stats.py) ------------------------------------------ */

/* One hot statistic of Counts k rises by n: current, total, peak, and the peak of all. */
static int
rise(PyObject *k, PyObject *o, PyObject *every, int stat, long long n)
{
    PyObject *c, *peak, *other, *all;
    if (slot_add(k, C_cur[stat], n, &c) < 0 || slot_add(k, C_total[stat], n, NULL) < 0)
        return -1;
    Py_INCREF(c);
    if ((peak = get(k, C_peak[stat])) == NULL)
        goto error;
    int r = PyObject_RichCompareBool(c, peak, Py_GT);
    if (r < 0)
        goto error;
    if (r)
        set(k, C_peak[stat], c);
    if ((other = get(o, C_cur[stat])) == NULL || (all = PyNumber_Add(c, other)) == NULL)
        goto error;
    Py_DECREF(c);
    if ((peak = get(every, E_peak[stat])) == NULL) {
        Py_DECREF(all);
        return -1;
    }
    r = PyObject_RichCompareBool(all, peak, Py_GT);
    if (r > 0)
        set(every, E_peak[stat], all);
    Py_DECREF(all);
    return r < 0 ? -1 : 0;
error:
    Py_DECREF(c);
    return -1;
}

static int
counts_parts(PyObject *k, PyObject **o, PyObject **every)
{
    if ((*o = get(k, C_other)) == NULL || (*every = get(k, C_every)) == NULL)
        return -1;
    if (!Py_IS_TYPE(*o, Counts_T) || !Py_IS_TYPE(*every, Every_T)) {
        PyErr_SetString(PyExc_TypeError, "Counts.other or Counts.every of an unexpected type");
        return -1;
    }
    return 0;
}

/* S.add_inactive_split(k, size) */
static int
add_inactive_split(PyObject *k, long long size)
{
    PyObject *o, *every;
    if (counts_parts(k, &o, &every) < 0)
        return -1;
    if (rise(k, o, every, ST_INACTIVE_SPLIT, 1) < 0)
        return -1;
    return rise(k, o, every, ST_INACTIVE_SPLIT_BYTES, size);
}

/* S.add_allocation(k, s, size, nbytes) */
static int
add_allocation(PyObject *k, PyObject *s, long long size, long long nbytes)
{
    PyObject *o, *every;
    if (counts_parts(k, &o, &every) < 0)
        return -1;
    if (rise(k, o, every, ST_ALLOCATION, 1) < 0 || rise(k, o, every, ST_ALLOCATED_BYTES, size) < 0
        || rise(k, o, every, ST_REQUESTED_BYTES, nbytes) < 0)
        return -1;
    if (!PyList_CheckExact(s) || PyList_GET_SIZE(s) <= ACTIVE + 1) {
        PyErr_SetString(PyExc_TypeError, "the allocator's statistics are not a list of slots");
        return -1;
    }
    int r = PyObject_IsTrue(PyList_GET_ITEM(s, ACTIVE));
    if (r == 0)
        r = PyObject_IsTrue(PyList_GET_ITEM(s, ACTIVE + 1));
    if (r < 0)
        return -1;
    if (r) {
        /* active = allocated + pending: its peak needs a look only while some block is pending */
        PyObject *args[2] = {k, s};
        PyObject *res = PyObject_Vectorcall(py_note_active_peak, args, 2, NULL);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

/* -- the free list (accel/allocator/_freelist.py) ------------------------------------ */

/* size << 64 | ptr */
static PyObject *
make_key(unsigned long long size, unsigned long long ptr)
{
    unsigned char bytes[16];
    for (int j = 0; j < 8; j++) {
        bytes[j] = (unsigned char)(ptr >> (8 * j));
        bytes[8 + j] = (unsigned char)(size >> (8 * j));
    }
    return _PyLong_FromByteArray(bytes, 16, 1, 0);
}

static Py_ssize_t
bisect_left(PyObject *list, PyObject *key)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int r = PyObject_RichCompareBool(PyList_GET_ITEM(list, mid), key, Py_LT);
        if (r < 0)
            return -1;
        if (r)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The free list's lists, checked: 0 when they are not what FreeList keeps. */
static int
fl_lists(PyObject *fl, PyObject **keys, PyObject **blocks, PyObject **maxes)
{
    *keys = SLOT(fl, F_keys);
    *blocks = SLOT(fl, F_blocks);
    *maxes = SLOT(fl, F_maxes);
    return *keys != NULL && *blocks != NULL && *maxes != NULL && PyList_CheckExact(*keys)
           && PyList_CheckExact(*blocks) && PyList_CheckExact(*maxes)
           && PyList_GET_SIZE(*keys) == PyList_GET_SIZE(*maxes) && PyList_GET_SIZE(*blocks) == PyList_GET_SIZE(*maxes);
}

static int
set_index(PyObject *fl, Py_ssize_t off, Py_ssize_t v)
{
    return set_new(fl, off, PyLong_FromSsize_t(v));
}

/* FreeList.best_fit: a new reference, Py_None, or NULL on error. */
static PyObject *
fl_best_fit(PyObject *fl, long long size)
{
    PyObject *keys, *blocks, *maxes;
    if (!Py_IS_TYPE(fl, FreeList_T) || !fl_lists(fl, &keys, &blocks, &maxes))
        return PyObject_CallMethod(fl, "best_fit", "L", size);
    PyObject *key = make_key((unsigned long long)size, 0);
    if (key == NULL)
        return NULL;
    Py_ssize_t k = bisect_left(maxes, key), i;
    if (k < 0)
        goto error;
    if (k == PyList_GET_SIZE(maxes)) {
        Py_DECREF(key);
        Py_RETURN_NONE;
    }
    PyObject *bucket = PyList_GET_ITEM(keys, k), *bblocks = PyList_GET_ITEM(blocks, k);
    if (!PyList_CheckExact(bucket) || !PyList_CheckExact(bblocks)) {
        Py_DECREF(key);
        return PyObject_CallMethod(fl, "best_fit", "L", size);
    }
    if ((i = bisect_left(bucket, key)) < 0)
        goto error;
    Py_DECREF(key);
    if (i >= PyList_GET_SIZE(bblocks)) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return NULL;
    }
    if (set_index(fl, F_fit_k, k) < 0 || set_index(fl, F_fit_i, i) < 0)
        return NULL;
    PyObject *block = PyList_GET_ITEM(bblocks, i);
    Py_INCREF(block);
    return block;
error:
    Py_DECREF(key);
    return NULL;
}

static PyObject *
call3(PyObject *f, PyObject *a, PyObject *b, PyObject *c, PyObject *d, Py_ssize_t n)
{
    PyObject *args[4] = {a, b, c, d};
    return PyObject_Vectorcall(f, args, n, NULL);
}

/* Where best_fit left (k, i), when keys[k][i] == key there: 1 and the bucket; 0 else. */
static int
at_fit(PyObject *fl, PyObject *keys, PyObject *key, Py_ssize_t *k, Py_ssize_t *i, PyObject **bucket)
{
    PyObject *fk = SLOT(fl, F_fit_k), *fi = SLOT(fl, F_fit_i);
    long long kk, ii;
    if (!as_ll(fk, &kk) || !as_ll(fi, &ii) || kk < 0 || ii < 0 || kk >= PyList_GET_SIZE(keys))
        return 0;
    *bucket = PyList_GET_ITEM(keys, kk);
    if (!PyList_CheckExact(*bucket) || ii >= PyList_GET_SIZE(*bucket))
        return 0;
    *k = (Py_ssize_t)kk;
    *i = (Py_ssize_t)ii;
    return PyObject_RichCompareBool(PyList_GET_ITEM(*bucket, ii), key, Py_EQ);
}

static int
block_key(PyObject *block, unsigned long long *size, unsigned long long *ptr)
{
    return as_ull(SLOT(block, B_size), size) && as_ull(SLOT(block, B_ptr), ptr) && *size < (1ULL << 62);
}

/* FreeList.replace(size, ptr, block) */
static int
fl_replace(PyObject *fl, PyObject *size, PyObject *ptr, PyObject *block)
{
    PyObject *keys, *blocks, *maxes, *key = NULL, *new_key = NULL, *bucket, *bblocks;
    unsigned long long s, p, ns, np;
    Py_ssize_t k, i;
    int r;
    if (!Py_IS_TYPE(fl, FreeList_T) || !Py_IS_TYPE(block, Block_T) || !fl_lists(fl, &keys, &blocks, &maxes)
        || !as_ull(size, &s) || !as_ull(ptr, &p) || s >= (1ULL << 62) || !block_key(block, &ns, &np))
        goto python;
    if ((key = make_key(s, p)) == NULL || (new_key = make_key(ns, np)) == NULL)
        goto error;
    PyObject *len = SLOT(fl, F_len);
    long long n;
    if (as_ll(len, &n) && n == 1 && PyList_GET_SIZE(maxes) == 1) {
        bucket = PyList_GET_ITEM(keys, 0);
        bblocks = PyList_GET_ITEM(blocks, 0);
        r = PyObject_RichCompareBool(PyList_GET_ITEM(maxes, 0), key, Py_EQ);
        if (r < 0)
            goto error;
        if (r && PyList_CheckExact(bucket) && PyList_CheckExact(bblocks) && PyList_GET_SIZE(bucket) == 1
            && PyList_GET_SIZE(bblocks) == 1) {
            /* the only block (a segment's rest, cut and merged back by a pair) */
            Py_INCREF(new_key);
            PyList_SetItem(bucket, 0, new_key);
            Py_INCREF(new_key);
            PyList_SetItem(maxes, 0, new_key);
            Py_INCREF(block);
            PyList_SetItem(bblocks, 0, block);
            goto done;
        }
    }
    r = at_fit(fl, keys, key, &k, &i, &bucket);
    if (r < 0)
        goto error;
    if (r) {
        /* in place when the new key still sorts between its neighbours */
        Py_ssize_t nb = PyList_GET_SIZE(bucket), nbuckets = PyList_GET_SIZE(keys);
        bblocks = PyList_GET_ITEM(blocks, k);
        if (!PyList_CheckExact(bblocks) || PyList_GET_SIZE(bblocks) != nb)
            goto python;
        int fits;
        if ((r = PyObject_RichCompareBool(new_key, key, Py_LT)) < 0)
            goto error;
        if (r) {
            if (i)
                fits = PyObject_RichCompareBool(PyList_GET_ITEM(bucket, i - 1), new_key, Py_LT);
            else if (k)
                fits = PyObject_RichCompareBool(PyList_GET_ITEM(maxes, k - 1), new_key, Py_LT);
            else
                fits = 1; /* -1 < new_key: keys are never negative */
        }
        else if (i + 1 < nb)
            fits = PyObject_RichCompareBool(new_key, PyList_GET_ITEM(bucket, i + 1), Py_LT);
        else if (k + 1 == nbuckets)
            fits = 1;
        else {
            PyObject *next = PyList_GET_ITEM(keys, k + 1);
            if (!PyList_CheckExact(next) || PyList_GET_SIZE(next) == 0)
                goto python;
            fits = PyObject_RichCompareBool(new_key, PyList_GET_ITEM(next, 0), Py_LT);
        }
        if (fits < 0)
            goto error;
        if (fits) {
            if ((r = PyObject_RichCompareBool(PyList_GET_ITEM(maxes, k), key, Py_EQ)) < 0)
                goto error;
            Py_INCREF(new_key);
            PyList_SetItem(bucket, i, new_key);
            Py_INCREF(block);
            PyList_SetItem(bblocks, i, block);
            if (r) {
                Py_INCREF(new_key);
                PyList_SetItem(maxes, k, new_key);
            }
            goto done;
        }
    }
python:
    Py_XDECREF(key);
    Py_XDECREF(new_key);
    {
        PyObject *res = call3(py_fl_replace, fl, size, ptr, block, 4);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
done:
    Py_DECREF(key);
    Py_DECREF(new_key);
    return 0;
error:
    Py_XDECREF(key);
    Py_XDECREF(new_key);
    return -1;
}

/* FreeList.remove(block) */
static int
fl_remove(PyObject *fl, PyObject *block)
{
    PyObject *keys, *blocks, *maxes, *key = NULL, *bucket, *bblocks;
    unsigned long long s, p;
    Py_ssize_t k, i;
    long long n;
    if (!Py_IS_TYPE(fl, FreeList_T) || !Py_IS_TYPE(block, Block_T) || !fl_lists(fl, &keys, &blocks, &maxes)
        || !block_key(block, &s, &p) || !as_ll(SLOT(fl, F_len), &n))
        goto python;
    if ((key = make_key(s, p)) == NULL)
        return -1;
    int r = at_fit(fl, keys, key, &k, &i, &bucket);
    Py_DECREF(key);
    if (r < 0)
        return -1;
    if (!r)
        goto python;
    /* the best fit, taken whole */
    bblocks = PyList_GET_ITEM(blocks, k);
    Py_ssize_t nb = PyList_GET_SIZE(bucket);
    if (!PyList_CheckExact(bblocks) || PyList_GET_SIZE(bblocks) != nb)
        goto python;
    if (set_new(fl, F_len, PyLong_FromLongLong(n - 1)) < 0)
        return -1;
    if (nb == 1) {
        if (PySequence_DelItem(keys, k) < 0 || PySequence_DelItem(blocks, k) < 0 || PySequence_DelItem(maxes, k) < 0)
            return -1;
        return 0;
    }
    if (PySequence_DelItem(bucket, i) < 0 || PySequence_DelItem(bblocks, i) < 0)
        return -1;
    if (i == nb - 1) {
        PyObject *last = PyList_GET_ITEM(bucket, nb - 2);
        Py_INCREF(last);
        PyList_SetItem(maxes, k, last);
    }
    return 0;
python:
    {
        PyObject *res = call3(py_fl_remove, fl, block, NULL, NULL, 2);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
}

/* FreeList.add(block) */
static int
fl_add(PyObject *fl, PyObject *block)
{
    PyObject *keys, *blocks, *maxes, *key = NULL, *bucket, *bblocks;
    unsigned long long s, p;
    long long kk, ii, n;
    if (!Py_IS_TYPE(fl, FreeList_T) || !Py_IS_TYPE(block, Block_T) || !fl_lists(fl, &keys, &blocks, &maxes)
        || !block_key(block, &s, &p) || !as_ll(SLOT(fl, F_len), &n) || !as_ll(SLOT(fl, F_fit_k), &kk)
        || !as_ll(SLOT(fl, F_fit_i), &ii) || kk < 0 || ii < 0 || kk >= PyList_GET_SIZE(keys))
        goto python;
    bucket = PyList_GET_ITEM(keys, kk);
    bblocks = PyList_GET_ITEM(blocks, kk);
    if (!PyList_CheckExact(bucket) || !PyList_CheckExact(bblocks) || ii >= PyList_GET_SIZE(bucket)
        || PyList_GET_SIZE(bblocks) != PyList_GET_SIZE(bucket))
        goto python;
    /* the bucket must stay within 2 * LOAD keys (read each time: tests change LOAD), or
     * FreeList.add splits it */
    PyObject *load = PyDict_GetItemWithError(freelist_globals, s_LOAD);
    long long lo;
    if (load == NULL) {
        if (PyErr_Occurred())
            return -1;
        goto python;
    }
    if (!as_ll(load, &lo) || PyList_GET_SIZE(bucket) + 1 > 2 * lo)
        goto python;
    if ((key = make_key(s, p)) == NULL)
        return -1;
    /* where best_fit looked last, if the key goes just there: no search */
    int r = PyObject_RichCompareBool(key, PyList_GET_ITEM(bucket, ii), Py_LT);
    if (r > 0) {
        if (ii)
            r = PyObject_RichCompareBool(PyList_GET_ITEM(bucket, ii - 1), key, Py_LT);
        else if (kk)
            r = PyObject_RichCompareBool(PyList_GET_ITEM(maxes, kk - 1), key, Py_LT);
    }
    if (r < 0) {
        Py_DECREF(key);
        return -1;
    }
    if (!r) {
        Py_DECREF(key);
        goto python;
    }
    if (set_new(fl, F_len, PyLong_FromLongLong(n + 1)) < 0 || PyList_Insert(bucket, ii, key) < 0
        || PyList_Insert(bblocks, ii, block) < 0) {
        Py_DECREF(key);
        return -1;
    }
    Py_DECREF(key);
    return 0;
python:
    {
        PyObject *res = call3(py_fl_add, fl, block, NULL, NULL, 2);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
}

/* -- blocks ------------------------------------------------------------------------ */

/* Block(ptr, size, segment), as Block.__init__ makes it (mapped). */
static PyObject *
new_block(unsigned long long ptr, PyObject *size, PyObject *segment)
{
    PyObject *stream = get(segment, SG_stream), *pool = get(segment, SG_pool);
    if (stream == NULL || pool == NULL)
        return NULL;
    PyObject *p = PyLong_FromUnsignedLongLong(ptr);
    if (p == NULL)
        return NULL;
    PyObject *b = Block_T->tp_alloc(Block_T, 0);
    if (b == NULL) {
        Py_DECREF(p);
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    SLOT(b, B_ptr) = p;
    set(b, B_size, size);
    set(b, B_requested, zero);
    set(b, B_segment, segment);
    set(b, B_stream, stream);
    set(b, B_pool, pool);
    set(b, B_state, FREE);
    set(b, B_mapped, Py_True);
    set(b, B_prev, Py_None);
    set(b, B_next, Py_None);
    set(b, B_event_count, zero);
    set(b, B_stream_uses, Py_None);
    set(b, B_gc_base, zero);
    set(b, B_frames, Py_None);
    Py_DECREF(zero);
    return b;
}

static inline int
is_block_or_none(PyObject *o)
{
    return o != NULL && (o == Py_None || Py_IS_TYPE(o, Block_T));
}


/* -- compiled methods ----------------------------------------------------------------- */

/* A C function standing in for a Python function or method: called with the Python
 * function's arguments (self first, for a method), it binds as a method does, and
 * carries the Python function's name, docstring and signature (functools.update_wrapper:
 * __wrapped__), so that help(), inspect.signature and docs/gen_api.py see the same. */
typedef PyObject *(*impl_t)(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    impl_t impl;
    PyObject *wrapped;
    PyObject *dict;
} Compiled;

static PyObject *
compiled_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Compiled *c = (Compiled *)self;
    return c->impl(c->wrapped, args, PyVectorcall_NARGS(nargsf), kwnames);
}

static PyObject *
compiled_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyObject *
compiled_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<compiled %R>", ((Compiled *)self)->wrapped);
}

static PyGetSetDef compiled_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Compiled_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups.compiled",
    .tp_basicsize = sizeof(Compiled),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(Compiled, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = compiled_get,
    .tp_dictoffset = offsetof(Compiled, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_repr = compiled_repr,
    .tp_getset = compiled_getset,
    .tp_doc = "A compiled stand-in for the Python function in __wrapped__ (accel/_speedups.c).",
};

/* The Python function, called with the same arguments. */
static PyObject *
call_wrapped(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return PyObject_Vectorcall(wrapped, args, nargs, kwnames);
}

static PyObject *
make_compiled(impl_t impl, PyObject *wrapped)
{
    Compiled *c = PyObject_New(Compiled, &Compiled_T);
    if (c == NULL)
        return NULL;
    c->vectorcall = compiled_vectorcall;
    c->impl = impl;
    Py_INCREF(wrapped);
    c->wrapped = wrapped;
    c->dict = PyDict_New();
    PyObject *functools = PyImport_ImportModule("functools"), *r = NULL;
    if (c->dict != NULL && functools != NULL)
        r = PyObject_CallMethod(functools, "update_wrapper", "OO", (PyObject *)c, wrapped);
    Py_XDECREF(functools);
    if (r == NULL)
        return NULL; /* c is kept: its type has no dealloc beyond the default */
    Py_DECREF(r);
    return (PyObject *)c;
}

/* Put a compiled stand-in for cls.<name> on cls; 0 or -1. */
static int
replace_method(PyTypeObject *cls, const char *name, impl_t impl, PyObject **wrapped_out)
{
    PyObject *wrapped = PyDict_GetItemString(cls->tp_dict, name);
    if (wrapped == NULL || !PyFunction_Check(wrapped)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a Python function", cls->tp_name, name);
        return -1;
    }
    Py_INCREF(wrapped);
    PyObject *c = make_compiled(impl, wrapped);
    int r = c == NULL ? -1 : PyObject_SetAttrString((PyObject *)cls, name, c);
    Py_XDECREF(c);
    if (wrapped_out != NULL && r == 0)
        *wrapped_out = wrapped; /* kept */
    else
        Py_DECREF(wrapped);
    return r;
}

/* -- the allocator (accel/allocator/_caching.py) ----------------------------------- */

/* o.<name> for an attribute kept in the instance's __dict__ (the allocator's, a stream's,
 * a runtime's: none of these names is a descriptor of their classes): a look in that dict,
 * without the class's; anything else takes the generic way. A new reference. */
static inline PyObject *
attr(PyObject *o, PyObject *name)
{
    PyObject **dp = _PyObject_GetDictPtr(o);
    if (dp != NULL && *dp != NULL) {
        PyObject *v = PyDict_GetItemWithError(*dp, name);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(o, name);
}

/* The allocator's threading.Lock, taken and given back as its acquire() and release()
 * do: on CPython 3.10-3.12 a _thread.lock is this struct (Modules/_threadmodule.c), and an
 * uncontended acquire is a non-blocking PyThread_acquire_lock_timed and ``locked = 1``.
 * A contended one, another lock type or another CPython calls the methods. */
#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030D0000
#define DIRECT_LOCK 1
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock_lock;
    PyObject *in_weakreflist;
    char locked;
} lockobject;
#else
#define DIRECT_LOCK 0
#endif
static PyTypeObject *Lock_T;

static int lock_call(PyObject *lock, PyObject *name);

static int
lock_acquire(PyObject *lock)
{
#if DIRECT_LOCK
    if (Py_IS_TYPE(lock, Lock_T) && PyThread_acquire_lock_timed(((lockobject *)lock)->lock_lock, 0, 0) == PY_LOCK_ACQUIRED) {
        ((lockobject *)lock)->locked = 1;
        return 0;
    }
#endif
    return lock_call(lock, s_acquire);
}

static int
lock_release(PyObject *lock)
{
#if DIRECT_LOCK
    if (Py_IS_TYPE(lock, Lock_T) && ((lockobject *)lock)->locked) {
        ((lockobject *)lock)->locked = 0;
        PyThread_release_lock(((lockobject *)lock)->lock_lock);
        return 0;
    }
#endif
    return lock_call(lock, s_release);
}

static int
lock_call(PyObject *lock, PyObject *name)
{
    PyObject *res = PyObject_VectorcallMethod(name, &lock, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* Release the lock whatever happened ("finally: lock.release()"); returns result,
 * or NULL when the release failed. */
static PyObject *
release(PyObject *lock, PyObject *result)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (lock_release(lock) < 0) {
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    return result;
}

/* Truth of self.<name>; -1 on error. */
static int
truth(PyObject *o, PyObject *name)
{
    PyObject *v = attr(o, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* self._kinds[pool.kind], a new reference, or NULL with no error when it is not a Counts. */
static PyObject *
kind_counts(PyObject *self, PyObject *pool)
{
    PyObject *kinds = attr(self, s_kinds), *kind = get(pool, P_kind);
    if (kinds == NULL || kind == NULL) {
        Py_XDECREF(kinds);
        return NULL;
    }
    PyObject *k = PyObject_GetItem(kinds, kind);
    Py_DECREF(kinds);
    if (k != NULL && !Py_IS_TYPE(k, Counts_T))
        Py_CLEAR(k);
    return k;
}

/* malloc's fast path, the lock held: a new reference to the block, Py_None when the
 * fast path does not apply (nothing was changed), NULL on error. */
static PyObject *
malloc_fast(PyObject *self, long long nbytes, PyObject *handle)
{
    PyObject *pool = NULL, *free, *block = NULL, *k = NULL, *ms = NULL, *result = NULL;
    int r = truth(self, s_fast);
    if (r <= 0)
        goto none_or_error;
    if ((r = truth(self, s_gc_frees)) != 0 || (r = truth(self, s_pending)) != 0)
        goto not_fast;
    long long size = nbytes < 512 ? 512 : (nbytes + 511) & -512;
    pool = attr(self, size <= SMALL_SIZE ? s_small : s_large);
    if (pool == NULL)
        return NULL;
    PyObject *frees = Py_IS_TYPE(pool, Pool_T) ? get(pool, P_free) : NULL;
    if (frees == NULL || !PyDict_CheckExact(frees)) {
        r = PyErr_Occurred() ? -1 : 0;
        goto not_fast;
    }
    free = PyDict_GetItemWithError(frees, handle);
    if (free == NULL || !Py_IS_TYPE(free, FreeList_T)) {
        r = PyErr_Occurred() ? -1 : 0;
        goto not_fast;
    }
    Py_INCREF(free);
    block = fl_best_fit(free, size);
    Py_DECREF(free); /* the dict holds it: nothing below runs Python code before its use */
    if (block == NULL)
        goto error;
    if (block == Py_None || !Py_IS_TYPE(block, Block_T)) {
        r = 0;
        goto not_fast;
    }
    PyObject *segment = SLOT(block, B_segment), *bsize = SLOT(block, B_size), *nxt = SLOT(block, B_next),
             *prev = SLOT(block, B_prev), *ptr = SLOT(block, B_ptr);
    long long full;
    unsigned long long p;
    if (segment == NULL || !Py_IS_TYPE(segment, Segment_T) || !as_ll(bsize, &full) || !is_block_or_none(nxt)
        || !is_block_or_none(prev) || !as_ull(ptr, &p) || SLOT(segment, SG_expandable) == NULL) {
        r = 0;
        goto not_fast;
    }
    if ((ms = attr(self, s_ms)) == NULL)
        goto error;
    if ((r = PyObject_RichCompareBool(bsize, ms, Py_LT)) <= 0)
        goto not_fast;
    if ((r = PyObject_IsTrue(SLOT(segment, SG_expandable))) != 0) {
        r = r < 0 ? -1 : 0;
        goto not_fast;
    }
    if ((k = kind_counts(self, pool)) == NULL) {
        r = PyErr_Occurred() ? -1 : 0;
        goto not_fast;
    }
    /* the fast path proper: from here on, the books change */
    if ((r = truth(self, s_gc_threshold)) < 0)
        goto error;
    if (r && slot_add(pool, P_calls, 1, NULL) < 0)
        goto error;
    long long remaining = full - size;
    PyObject *small = get(pool, P_small);
    if (small == NULL || (r = PyObject_IsTrue(small)) < 0)
        goto error;
    if (remaining >= 512 && (r || remaining > SMALL_SIZE)) {
        /* _split: a new block object for the rest, which takes this one's place on the free list */
        PyObject *rsize = PyLong_FromLongLong(remaining);
        if (rsize == NULL)
            goto error;
        PyObject *rest = new_block(p + (unsigned long long)size, rsize, segment);
        Py_DECREF(rsize);
        if (rest == NULL)
            goto error;
        set(rest, B_next, nxt);
        set(rest, B_prev, block);
        set(block, B_next, rest);
        if (nxt != Py_None)
            set(nxt, B_prev, rest);
        PyObject *calls = get(pool, P_calls);
        if (calls == NULL) {
            Py_DECREF(rest);
            goto error;
        }
        set(rest, B_gc_base, calls);
        PyObject *fullobj = bsize;
        Py_INCREF(fullobj);
        if (set_new(block, B_size, PyLong_FromLongLong(size)) < 0) {
            Py_DECREF(fullobj);
            Py_DECREF(rest);
            goto error;
        }
        /* free is still listed by pool.free (nothing ran Python code since) */
        free = PyDict_GetItemWithError(frees, handle);
        if (free == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, handle);
            Py_DECREF(fullobj);
            Py_DECREF(rest);
            goto error;
        }
        Py_INCREF(free);
        r = fl_replace(free, fullobj, ptr, rest);
        Py_DECREF(free);
        Py_DECREF(fullobj);
        Py_DECREF(rest);
        if (r < 0)
            goto error;
        if (prev != Py_None || nxt != Py_None) {
            /* the free part that was counted shrinks to the rest */
            if (slot_add(k, C_cur[ST_INACTIVE_SPLIT_BYTES], -size, NULL) < 0)
                goto error;
        }
        else if (add_inactive_split(k, remaining) < 0)
            goto error;
    }
    else {
        /* _split without a cut: the whole block leaves the list */
        size = full;
        free = PyDict_GetItemWithError(frees, handle);
        if (free == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, handle);
            goto error;
        }
        Py_INCREF(free);
        r = fl_remove(free, block);
        Py_DECREF(free);
        if (r < 0)
            goto error;
        if (prev != Py_None || nxt != Py_None) {
            if (slot_add(k, C_cur[ST_INACTIVE_SPLIT], -1, NULL) < 0
                || slot_add(k, C_cur[ST_INACTIVE_SPLIT_BYTES], -full, NULL) < 0)
                goto error;
        }
    }
    /* _account */
    set(block, B_state, ALLOCATED);
    if (set_new(block, B_requested, PyLong_FromLongLong(nbytes)) < 0)
        goto error;
    PyObject *s = attr(self, s_s);
    if (s == NULL)
        goto error;
    r = add_allocation(k, s, size, nbytes);
    Py_DECREF(s);
    if (r < 0)
        goto error;
    result = block;
    block = NULL;
    goto out;
not_fast:
    if (r < 0)
        goto error;
    result = Py_None;
    Py_INCREF(result);
    goto out;
none_or_error:
    if (r == 0) {
        result = Py_None;
        Py_INCREF(result);
    }
    return result;
error:
out:
    Py_XDECREF(pool);
    Py_XDECREF(block);
    Py_XDECREF(k);
    Py_XDECREF(ms);
    return result;
}

/* Whether stream is one malloc accepts without a look at the Python checks: 1 yes,
 * 0 no (the Python method says why), -1 error. */
static int
stream_ok(PyObject *self, PyObject *stream)
{
    PyObject *a = attr(stream, s_dev), *b = NULL, *rt = NULL, *c = NULL;
    int r = -1;
    if (a == NULL || (b = attr(self, s_device)) == NULL)
        goto out;
    if ((r = PyObject_RichCompareBool(a, b, Py_NE)) != 0) {
        r = r < 0 ? -1 : 0;
        goto out;
    }
    Py_CLEAR(a);
    Py_CLEAR(b);
    if ((rt = attr(stream, s_runtime)) == NULL || (a = attr(rt, s_backend)) == NULL
        || (b = attr(self, s_backend)) == NULL) {
        r = -1;
        goto out;
    }
    if (a != b) {
        r = 0;
        goto out;
    }
    if ((c = attr(stream, s_closed)) == NULL) {
        r = -1;
        goto out;
    }
    r = PyObject_IsTrue(c);
    r = r < 0 ? -1 : !r;
out:
    if (r < 0 && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear(); /* not a Stream: the Python method says so */
        r = 0;
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(rt);
    Py_XDECREF(c);
    return r;
}

/* DeviceAllocator.malloc(nbytes, stream) */
static PyObject *
allocator_malloc(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    long long nbytes;
    if (nargs != 3 || kwnames != NULL || !as_ll(args[1], &nbytes) || nbytes <= 0 || nbytes >= MAX_REQUEST)
        return call_wrapped(wrapped, args, nargs, kwnames); /* the Python method raises accel's error */
    PyObject *self = args[0], *stream = args[2];
    int r = stream_ok(self, stream);
    if (r < 0)
        return NULL;
    if (!r)
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *handle = attr(stream, s_handle);
    if (handle == NULL)
        return NULL;
    PyObject *lock = attr(self, s_lock);
    if (lock == NULL || lock_acquire(lock) < 0) {
        Py_XDECREF(lock);
        Py_DECREF(handle);
        return NULL;
    }
    PyObject *block = malloc_fast(self, nbytes, handle);
    if (block == Py_None) {
        Py_DECREF(block);
        PyObject *sargs[4] = {self, args[1], stream, handle};
        block = PyObject_VectorcallMethod(s_malloc_steps, sargs, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    block = release(lock, block);
    Py_DECREF(lock);
    Py_DECREF(handle);
    return block;
}

/* _free_held's fast paths; Py_None when done, NULL on error. */
static PyObject *
free_held(PyObject *self, PyObject *block)
{
    PyObject *segment, *pool, *k = NULL, *history = NULL, *ms = NULL, *prev, *nxt, *size, *frees;
    int r;
    if (!Py_IS_TYPE(block, Block_T) || (segment = SLOT(block, B_segment)) == NULL
        || !Py_IS_TYPE(segment, Segment_T) || (pool = SLOT(block, B_pool)) == NULL || !Py_IS_TYPE(pool, Pool_T)
        || SLOT(block, B_stream_uses) == NULL || !is_block_or_none(prev = SLOT(block, B_prev))
        || !is_block_or_none(nxt = SLOT(block, B_next)) || (size = SLOT(block, B_size)) == NULL
        || SLOT(segment, SG_expandable) == NULL || (frees = SLOT(pool, P_free)) == NULL
        || !PyDict_CheckExact(frees) || SLOT(block, B_stream) == NULL || SLOT(block, B_requested) == NULL)
        goto python;
    if ((r = PyObject_IsTrue(SLOT(block, B_stream_uses))) != 0)
        goto python_or_error;
    if ((history = attr(self, s_history)) == NULL)
        return NULL;
    if (history != Py_None || (r = truth(self, s_orphaned)) != 0)
        goto python_or_error;
    if ((k = kind_counts(self, pool)) == NULL) {
        r = PyErr_Occurred() ? -1 : 1;
        goto python_or_error;
    }
    Py_INCREF(block);
    /* the common case of _free_locked inline: no other stream, no history */
    if (slot_sub(k, C_cur[ST_ALLOCATION], ONE) < 0 || slot_sub(k, C_cur[ST_ALLOCATED_BYTES], size) < 0)
        goto error;
    if ((ms = attr(self, s_ms)) == NULL || (r = PyObject_RichCompareBool(size, ms, Py_GE)) < 0)
        goto error;
    if (r) {
        PyObject *s = attr(self, s_s);
        if (s == NULL)
            goto error;
        PyObject *idx = PyLong_FromSsize_t(OVERSIZE_ALLOCATIONS), *v = NULL, *nv = NULL;
        if (idx != NULL && (v = PyObject_GetItem(s, idx)) != NULL && (nv = add_ll(v, -1)) != NULL)
            r = PyObject_SetItem(s, idx, nv);
        else
            r = -1;
        Py_XDECREF(idx);
        Py_XDECREF(v);
        Py_XDECREF(nv);
        Py_DECREF(s);
        if (r < 0)
            goto error;
    }
    if ((r = truth(self, s_fast)) < 0)
        goto error;
    int prev_free = 0;
    if (r && prev != Py_None) {
        PyObject *st = get(prev, B_state);
        if (st == NULL || (prev_free = PyObject_RichCompareBool(st, FREE, Py_EQ)) < 0)
            goto error;
    }
    if (r && !prev_free) {
        if ((r = PyObject_IsTrue(SLOT(segment, SG_expandable))) < 0)
            goto error;
        if (r)
            goto free_block;
        /* the fast paths of _free_block: the block is retired either way */
        int next_free = 0;
        if (nxt != Py_None) {
            PyObject *st = get(nxt, B_state);
            if (st == NULL || (next_free = PyObject_RichCompareBool(st, FREE, Py_EQ)) < 0)
                goto error;
        }
        if (next_free) {
            /* the free block after takes this one's place (an allocate+free pair) */
            PyObject *listed_size = SLOT(nxt, B_size), *listed_ptr = SLOT(nxt, B_ptr), *free;
            if (listed_size == NULL || listed_ptr == NULL) {
                PyErr_SetString(PyExc_AttributeError, "a free block without size or ptr");
                goto error;
            }
            Py_INCREF(listed_size);
            Py_INCREF(listed_ptr);
            Py_INCREF(nxt);
            Py_INCREF(prev);
            long long merged_ll = 0;
            PyObject *merged = NULL;
            r = -1;
            if (slot_sub(k, C_cur[ST_REQUESTED_BYTES], SLOT(block, B_requested)) < 0)
                goto merge_out;
            set(block, B_state, RETIRED);
            set(block, B_prev, Py_None);
            set(block, B_next, Py_None);
            set(nxt, B_ptr, SLOT(block, B_ptr));
            if ((merged = PyNumber_Add(listed_size, size)) == NULL)
                goto merge_out;
            set(nxt, B_size, merged);
            set(nxt, B_prev, prev);
            if (prev != Py_None)
                set(prev, B_next, nxt);
            else
                set(segment, SG_head, nxt);
            if ((free = PyObject_GetItem(frees, SLOT(block, B_stream))) == NULL)
                goto merge_out;
            r = fl_replace(free, listed_size, listed_ptr, nxt);
            Py_DECREF(free);
            if (r < 0)
                goto merge_out;
            r = -1;
            PyObject *calls = get(pool, P_calls);
            if (calls == NULL)
                goto merge_out;
            set(nxt, B_gc_base, calls);
            /* inactive_split: the listed rest leaves it; the merged block joins it
             * again only if the segment is still split */
            if (slot_add(k, C_cur[ST_INACTIVE_SPLIT], -1, NULL) < 0
                || slot_sub(k, C_cur[ST_INACTIVE_SPLIT_BYTES], listed_size) < 0)
                goto merge_out;
            if (prev != Py_None || SLOT(nxt, B_next) != Py_None) {
                if (!as_ll(merged, &merged_ll)) {
                    PyErr_SetString(PyExc_OverflowError, "block size out of range");
                    goto merge_out;
                }
                if (add_inactive_split(k, merged_ll) < 0)
                    goto merge_out;
            }
            r = 0;
        merge_out:
            Py_XDECREF(merged);
            Py_DECREF(listed_size);
            Py_DECREF(listed_ptr);
            Py_DECREF(nxt);
            Py_DECREF(prev);
            if (r < 0)
                goto error;
            goto done;
        }
        PyObject *free = PyDict_GetItemWithError(frees, SLOT(block, B_stream));
        if (free == NULL && PyErr_Occurred())
            goto error;
        if (free != NULL) {
            /* no free neighbour: a new block object stands in for this one (a cached
             * pair that reuses a hole) */
            unsigned long long p;
            long long sz;
            if (!as_ull(SLOT(block, B_ptr), &p) || !as_ll(size, &sz)) {
                PyErr_SetString(PyExc_OverflowError, "block address or size out of range");
                goto error;
            }
            Py_INCREF(free);
            Py_INCREF(prev);
            Py_INCREF(nxt);
            r = -1;
            if (slot_sub(k, C_cur[ST_REQUESTED_BYTES], SLOT(block, B_requested)) < 0)
                goto hole_out;
            set(block, B_state, RETIRED);
            set(block, B_prev, Py_None);
            set(block, B_next, Py_None);
            PyObject *new = new_block(p, size, segment);
            if (new == NULL)
                goto hole_out;
            set(new, B_prev, prev);
            set(new, B_next, nxt);
            if (prev != Py_None)
                set(prev, B_next, new);
            else
                set(segment, SG_head, new);
            if (nxt != Py_None)
                set(nxt, B_prev, new);
            PyObject *calls = get(pool, P_calls);
            if (calls != NULL) {
                set(new, B_gc_base, calls);
                if (fl_add(free, new) == 0
                    && ((prev == Py_None && nxt == Py_None) || add_inactive_split(k, sz) == 0))
                    r = 0;
            }
            Py_DECREF(new);
        hole_out:
            Py_DECREF(free);
            Py_DECREF(prev);
            Py_DECREF(nxt);
            if (r < 0)
                goto error;
            goto done;
        }
    }
free_block: {
    PyObject *args[2] = {self, block};
    PyObject *res = PyObject_VectorcallMethod(s_free_block, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (res == NULL)
        goto error;
    Py_DECREF(res);
}
done:
    Py_DECREF(block);
    Py_DECREF(k);
    Py_XDECREF(ms);
    Py_XDECREF(history);
    Py_RETURN_NONE;
error:
    Py_DECREF(block);
    Py_XDECREF(k);
    Py_XDECREF(ms);
    Py_XDECREF(history);
    return NULL;
python_or_error:
    Py_XDECREF(history);
    Py_XDECREF(k);
    if (r < 0)
        return NULL;
python: {
    PyObject *args[2] = {self, block};
    return PyObject_Vectorcall(py_free_held, args, 2, NULL);
}
}

/* DeviceAllocator._free_held(block) */
static PyObject *
allocator_free_held(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL)
        return call_wrapped(wrapped, args, nargs, kwnames);
    return free_held(args[0], args[1]);
}

/* DeviceAllocator.free_from_finalizer(block) */
static PyObject *
allocator_free_from_finalizer(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL)
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *self = args[0], *block = args[1];
    /* another allocator's block (or none): the Python function raises as free() does */
    PyObject *segment = Py_IS_TYPE(block, Block_T) ? SLOT(block, B_segment) : NULL;
    if (segment == NULL || !Py_IS_TYPE(segment, Segment_T) || SLOT(segment, SG_owner) != self)
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *lock = attr(self, s_lock), *res = NULL;
    if (lock == NULL)
        return NULL;
    int r;
#if DIRECT_LOCK
    if (Py_IS_TYPE(lock, Lock_T)) {
        /* acquire(blocking=False) */
        r = PyThread_acquire_lock_timed(((lockobject *)lock)->lock_lock, 0, 0) == PY_LOCK_ACQUIRED;
        if (r)
            ((lockobject *)lock)->locked = 1;
    }
    else
#endif
    {
        PyObject *largs[2] = {lock, Py_False};
        PyObject *got = PyObject_VectorcallMethod(s_acquire, largs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        r = got == NULL ? -1 : PyObject_IsTrue(got);
        Py_XDECREF(got);
    }
    if (r < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    if (r) {
        PyObject *state = PyObject_GetAttrString(block, "state");
        r = state == NULL ? -1 : PyObject_RichCompareBool(state, ALLOCATED, Py_EQ);
        Py_XDECREF(state);
        if (r > 0)
            res = free_held(self, block);
        else if (r == 0) {
            res = Py_None;
            Py_INCREF(res);
        }
        res = release(lock, res);
    }
    else {
        /* the lock is taken (maybe by this thread): the free waits for the next call */
        PyObject *q = attr(self, s_gc_frees);
        if (q != NULL)
            res = PyObject_CallMethod(q, "append", "O", block);
        Py_XDECREF(q);
    }
    Py_DECREF(lock);
    return res;
}

/* DeviceAllocator.free(block) */
static PyObject *
allocator_free(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL || !Py_IS_TYPE(args[1], Block_T))
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *self = args[0], *block = args[1];
    PyObject *lock = attr(self, s_lock), *res = NULL;
    if (lock == NULL)
        return NULL;
    if (lock_acquire(lock) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    PyObject *state = get(block, B_state), *segment, *owner;
    int r = state == NULL ? -1 : PyObject_RichCompareBool(state, ALLOCATED, Py_NE);
    if (r == 0) {
        if ((segment = get(block, B_segment)) == NULL || (owner = PyObject_GetAttrString(segment, "owner")) == NULL)
            r = -1;
        else {
            r = owner != self;
            Py_DECREF(owner);
        }
    }
    if (r > 0) {
        PyObject *msg = PyUnicode_FromFormat(
            "%R is not allocated by %R (freed twice, or from another allocator)", block, self);
        if (msg != NULL) {
            PyErr_SetObject(InvalidHandleError, msg);
            Py_DECREF(msg);
        }
    }
    else if (r == 0)
        res = free_held(self, block);
    res = release(lock, res);
    Py_DECREF(lock);
    return res;
}


/* -- install ------------------------------------------------------------------------ */

static int
intern(PyObject **out, const char *s)
{
    *out = PyUnicode_InternFromString(s);
    return *out == NULL ? -1 : 0;
}

static int
get_type(PyObject *ns, const char *name, PyTypeObject **out)
{
    PyObject *t = PyMapping_GetItemString(ns, name);
    if (t == NULL)
        return -1;
    if (!PyType_Check(t)) {
        PyErr_Format(PyExc_TypeError, "%s is not a class", name);
        Py_DECREF(t);
        return -1;
    }
    *out = (PyTypeObject *)t; /* kept for the life of the process */
    return 0;
}

static int
get_obj(PyObject *ns, const char *name, PyObject **out)
{
    *out = PyMapping_GetItemString(ns, name);
    return *out == NULL ? -1 : 0;
}

static int
get_ll(PyObject *ns, const char *name, long long *out)
{
    PyObject *v = PyMapping_GetItemString(ns, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int installed = 0;

/* install_allocator(names): put the compiled methods on DeviceAllocator. ``names`` maps
 * the names below to the allocator module's classes, functions and constants. */
static PyObject *
install_allocator(PyObject *module, PyObject *ns)
{
    if (installed)
        Py_RETURN_NONE;
    PyTypeObject *alloc;
    long long v;
    if (get_type(ns, "DeviceAllocator", &alloc) < 0 || get_type(ns, "Block", &Block_T) < 0
        || get_type(ns, "Segment", &Segment_T) < 0 || get_type(ns, "Pool", &Pool_T) < 0
        || get_type(ns, "FreeList", &FreeList_T) < 0 || get_type(ns, "Counts", &Counts_T) < 0
        || get_type(ns, "Every", &Every_T) < 0 || get_obj(ns, "note_active_peak", &py_note_active_peak) < 0
        || get_obj(ns, "InvalidHandleError", &InvalidHandleError) < 0 || get_obj(ns, "FREE", &FREE) < 0
        || get_obj(ns, "ALLOCATED", &ALLOCATED) < 0 || get_obj(ns, "RETIRED", &RETIRED) < 0
        || get_ll(ns, "SMALL_SIZE", &SMALL_SIZE) < 0 || get_ll(ns, "MAX_REQUEST", &MAX_REQUEST) < 0
        || get_ll(ns, "OVERSIZE_ALLOCATIONS", &v) < 0)
        return NULL;
    OVERSIZE_ALLOCATIONS = (Py_ssize_t)v;
    if (get_type(ns, "Lock", &Lock_T) < 0 || get_obj(ns, "freelist_module", &freelist_globals) < 0
        || intern(&s_LOAD, "LOAD") < 0)
        return NULL;
    if ((freelist_globals = PyModule_GetDict(freelist_globals)) == NULL)
        return NULL;
    Py_INCREF(freelist_globals);
#if DIRECT_LOCK
    if (Lock_T->tp_basicsize != sizeof(lockobject))
        Lock_T = NULL; /* not the _thread.lock above (another build): call the methods, never refuse to load */
#endif
    if ((ONE = PyLong_FromLong(1)) == NULL)
        return NULL;
    if (get_ll(ns, "ACTIVE", &v) < 0)
        return NULL;
    ACTIVE = (Py_ssize_t)v;
    PyObject *d = alloc->tp_dict;
    if ((py_free_held = PyDict_GetItemString(d, "_free_held")) == NULL
        || (py_fl_replace = PyDict_GetItemString(FreeList_T->tp_dict, "replace")) == NULL
        || (py_fl_remove = PyDict_GetItemString(FreeList_T->tp_dict, "remove")) == NULL
        || (py_fl_add = PyDict_GetItemString(FreeList_T->tp_dict, "add")) == NULL) {
        PyErr_SetString(PyExc_TypeError, "DeviceAllocator or FreeList lacks a method the compiled paths replace");
        return NULL;
    }
    Py_INCREF(py_free_held);
    Py_INCREF(py_fl_replace);
    Py_INCREF(py_fl_remove);
    Py_INCREF(py_fl_add);
#define OFF(T, name, var) (slot_offset(T, name, &var) < 0)
    if (OFF(Block_T, "ptr", B_ptr) || OFF(Block_T, "size", B_size) || OFF(Block_T, "requested", B_requested)
        || OFF(Block_T, "stream", B_stream) || OFF(Block_T, "pool", B_pool) || OFF(Block_T, "segment", B_segment)
        || OFF(Block_T, "state", B_state) || OFF(Block_T, "mapped", B_mapped) || OFF(Block_T, "prev", B_prev)
        || OFF(Block_T, "next", B_next) || OFF(Block_T, "event_count", B_event_count)
        || OFF(Block_T, "stream_uses", B_stream_uses) || OFF(Block_T, "gc_base", B_gc_base)
        || OFF(Block_T, "frames", B_frames) || OFF(Segment_T, "owner", SG_owner)
        || OFF(Segment_T, "expandable", SG_expandable) || OFF(Segment_T, "head", SG_head)
        || OFF(Segment_T, "stream", SG_stream) || OFF(Segment_T, "pool", SG_pool) || OFF(Pool_T, "small", P_small)
        || OFF(Pool_T, "kind", P_kind) || OFF(Pool_T, "free", P_free) || OFF(Pool_T, "calls", P_calls)
        || OFF(FreeList_T, "_keys", F_keys) || OFF(FreeList_T, "_blocks", F_blocks)
        || OFF(FreeList_T, "_maxes", F_maxes) || OFF(FreeList_T, "_len", F_len)
        || OFF(FreeList_T, "_fit_k", F_fit_k) || OFF(FreeList_T, "_fit_i", F_fit_i)
        || OFF(Counts_T, "other", C_other) || OFF(Counts_T, "every", C_every))
        return NULL;
    /* Block.__init__ sets every slot: new_block() does the same, and must know them all */
    if (Block_T->tp_basicsize != (Py_ssize_t)(sizeof(PyObject) + 14 * sizeof(PyObject *))
        || Block_T->tp_dictoffset != 0 || Block_T->tp_weaklistoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "Block's slots are not the ones the compiled paths know");
        return NULL;
    }
    for (int i = 0; i < N_HOT; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s", hot_names[i]);
        if (OFF(Counts_T, name, C_cur[i]))
            return NULL;
        snprintf(name, sizeof name, "%s_peak", hot_names[i]);
        if (OFF(Counts_T, name, C_peak[i]) || OFF(Every_T, name, E_peak[i]))
            return NULL;
        snprintf(name, sizeof name, "%s_total", hot_names[i]);
        if (OFF(Counts_T, name, C_total[i]))
            return NULL;
    }
#undef OFF
    if (intern(&s_lock, "_lock") || intern(&s_fast, "_fast") || intern(&s_gc_frees, "_gc_frees")
        || intern(&s_pending, "_pending") || intern(&s_small, "_small") || intern(&s_large, "_large")
        || intern(&s_ms, "_ms") || intern(&s_gc_threshold, "_gc_threshold") || intern(&s_kinds, "_kinds")
        || intern(&s_s, "_s") || intern(&s_device, "device") || intern(&s_backend, "backend")
        || intern(&s_history, "_history") || intern(&s_orphaned, "_orphaned")
        || intern(&s_malloc_steps, "_malloc_steps") || intern(&s_free_block, "_free_block")
        || intern(&s_acquire, "acquire") || intern(&s_release, "release") || intern(&s_dev, "_device")
        || intern(&s_runtime, "_runtime") || intern(&s_closed, "_closed") || intern(&s_handle, "_handle"))
        return NULL;
    if (replace_method(alloc, "malloc", allocator_malloc, NULL) < 0
        || PyObject_SetAttrString((PyObject *)alloc, "malloc_checked", PyDict_GetItemString(alloc->tp_dict, "malloc")) < 0
        || replace_method(alloc, "free", allocator_free, NULL) < 0
        || replace_method(alloc, "_free_held", allocator_free_held, NULL) < 0
        || replace_method(alloc, "free_from_finalizer", allocator_free_from_finalizer, NULL) < 0)
        return NULL;
    installed = 1;
    Py_RETURN_NONE;
}


/* -- buffers (accel/allocator/_buffer.py) --------------------------------------------- */

/* A Buffer's slots (_block, _allocator, _nbytes, _stream, _lease) and the runtime's
 * attributes are read and written by name (PyObject_GetAttr, PyObject_SetAttr: a slot's
 * member descriptor, an instance's __dict__), never at an offset: nothing here reads an
 * object's layout (issue 27). Module globals are looked up in the module's dict, and a
 * borrowed reference from it is used only before the next call that can run Python code. */

static PyTypeObject *Buffer_T;
static PyObject *runtime_globals, *buffer_globals, *mempool_globals, *EXTENSION;
static PyObject *s_runtime_g, *s_forked_from, *s_collecting, *s_open, *s_state, *s_streams, *s_default_streams,
    *s_extensions, *s_allocators, *s_free, *s_free_from_finalizer, *s_malloc, *s_device_kw, *s_stream_kw,
    *s_block, *s_allocator, *s_nbytes, *s_stream, *s_lease, *s_buffer_device;

/* A module global, borrowed (NULL without an error when it is missing). */
static inline PyObject *
global(PyObject *globals, PyObject *name)
{
    return PyDict_GetItemWithError(globals, name);
}

/* What Buffer.free and Buffer.__del__ end with: the buffer lets go of ``block``, then
 * ``allocator.<method>(block)`` takes it back (both references owned by the caller). */
static PyObject *
give_back(PyObject *self, PyObject *allocator, PyObject *block, PyObject *method)
{
    if (PyObject_SetAttr(self, s_block, Py_None) < 0)
        return NULL;
    PyObject *fargs[2] = {allocator, block};
    PyObject *res = PyObject_VectorcallMethod(method, fargs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (res == NULL)
        return NULL;
    Py_DECREF(res);
    Py_RETURN_NONE;
}

/* self._block, self._lease and self._allocator of an exact Buffer, new references: 0, or
 * -1 with no error when one was never set (__init__ never ran: the Python method says so). */
static int
buffer_slots(PyObject *self, PyObject **block, PyObject **lease, PyObject **allocator)
{
    *lease = *allocator = NULL;
    if ((*block = PyObject_GetAttr(self, s_block)) == NULL || (*lease = PyObject_GetAttr(self, s_lease)) == NULL
        || (*allocator = PyObject_GetAttr(self, s_allocator)) == NULL) {
        PyErr_Clear();
        Py_XDECREF(*block);
        Py_XDECREF(*lease);
        return -1;
    }
    return 0;
}

/* Buffer.free() */
static PyObject *
buffer_free(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1 || kwnames != NULL || !Py_IS_TYPE(args[0], Buffer_T))
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *self = args[0], *block, *lease, *allocator, *result;
    if (buffer_slots(self, &block, &lease, &allocator) < 0)
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *forked = global(runtime_globals, s_forked_from);
    if (block == Py_None) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    else if (lease != Py_None || forked != Py_None) /* a lease, a fork, or an error */
        result = PyErr_Occurred() ? NULL : call_wrapped(wrapped, args, nargs, kwnames);
    else {
        PyObject *collecting = global(buffer_globals, s_collecting);
        int r = collecting == NULL ? -1 : PyObject_IsTrue(collecting);
        if (r < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_NameError, "_collecting");
            result = NULL;
        }
        else
            result = give_back(self, allocator, block, r ? s_free_from_finalizer : s_free);
    }
    Py_DECREF(block);
    Py_DECREF(lease);
    Py_DECREF(allocator);
    return result;
}

/* Buffer.__del__() */
static PyObject *
buffer_del(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1 || kwnames != NULL || !Py_IS_TYPE(args[0], Buffer_T))
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *self = args[0], *block, *lease, *allocator, *result;
    if (buffer_slots(self, &block, &lease, &allocator) < 0)
        return call_wrapped(wrapped, args, nargs, kwnames); /* __init__ never ran: the Python method */
    if (block == Py_None) { /* freed */
        Py_INCREF(Py_None);
        result = Py_None;
    }
    else if (lease != Py_None)
        result = call_wrapped(wrapped, args, nargs, kwnames);
    else
        result = give_back(self, allocator, block, s_free_from_finalizer);
    Py_DECREF(block);
    Py_DECREF(lease);
    Py_DECREF(allocator);
    return result;
}

/* dict.get(key) of an attribute that is a dict: borrowed, NULL without an error when absent
 * (or when the attribute is no dict: the caller takes the Python path). */
static PyObject *
dict_attr_get(PyObject *o, PyObject *name, PyObject *key, PyObject **hold)
{
    PyObject *d = PyObject_GetAttr(o, name);
    if (d == NULL)
        return NULL;
    if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(d, key);
    *hold = d; /* keeps v alive */
    return v;
}

/* allocate(nbytes, *, device=None, stream=None): the current stream of the current
 * device and its allocator, when they exist already and no MemPool is in use. */
static PyObject *
buffer_allocate(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1)
        return call_wrapped(wrapped, args, nargs, kwnames);
    if (kwnames != NULL) {
        /* device=None and stream=None are the defaults */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            int known = PyUnicode_Compare(name, s_device_kw) == 0 || PyUnicode_Compare(name, s_stream_kw) == 0;
            if (!known || args[nargs + i] != Py_None)
                return call_wrapped(wrapped, args, nargs, kwnames);
        }
    }
    PyObject *runtime = global(runtime_globals, s_runtime_g), *open = global(mempool_globals, s_open);
    if (runtime == NULL || runtime == Py_None || open == NULL || !PyLong_CheckExact(open) || PyLong_AsLong(open) != 0) {
        if (PyErr_Occurred())
            return NULL;
        return call_wrapped(wrapped, args, nargs, kwnames);
    }
    Py_INCREF(runtime);
    PyObject *state = NULL, *index = NULL, *streams = NULL, *defaults = NULL, *exts = NULL, *allocators = NULL,
             *found, *stream, *allocator, *result = NULL;
    /* state is a threading.local: its attributes are the thread's */
    if ((state = PyObject_GetAttr(runtime, s_state)) == NULL || (index = PyObject_GetAttr(state, s_buffer_device)) == NULL)
        goto out;
    stream = dict_attr_get(state, s_streams, index, &streams);
    if (stream == NULL) {
        if (PyErr_Occurred())
            goto out;
        stream = dict_attr_get(runtime, s_default_streams, index, &defaults);
        if (stream == NULL)
            goto python;
    }
    found = dict_attr_get(runtime, s_extensions, EXTENSION, &exts);
    if (found == NULL || found == Py_None)
        goto python;
    allocator = dict_attr_get(found, s_allocators, index, &allocators);
    if (allocator == NULL || allocator == Py_None)
        goto python;
    Py_INCREF(stream);
    Py_INCREF(allocator);
    PyObject *margs[3] = {allocator, args[0], stream};
    PyObject *block = PyObject_VectorcallMethod(s_malloc, margs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (block != NULL) {
        /* Buffer(block, allocator, stream, nbytes): what Buffer.__init__ sets */
        result = Buffer_T->tp_alloc(Buffer_T, 0);
        if (result != NULL
            && (PyObject_SetAttr(result, s_block, block) < 0 || PyObject_SetAttr(result, s_allocator, allocator) < 0
                || PyObject_SetAttr(result, s_nbytes, args[0]) < 0 || PyObject_SetAttr(result, s_stream, stream) < 0
                || PyObject_SetAttr(result, s_lease, Py_None) < 0))
            Py_CLEAR(result); /* its __del__ gives back the block, when it was set */
        Py_DECREF(block);
    }
    Py_DECREF(stream);
    Py_DECREF(allocator);
    goto out;
python:
    if (!PyErr_Occurred())
        result = call_wrapped(wrapped, args, nargs, kwnames);
out:
    Py_DECREF(runtime);
    Py_XDECREF(state);
    Py_XDECREF(index);
    Py_XDECREF(streams);
    Py_XDECREF(defaults);
    Py_XDECREF(exts);
    Py_XDECREF(allocators);
    return result;
}

static int buffers_installed = 0;

/* install_buffers(names): compiled Buffer.free, Buffer.__del__ and allocate (put in the
 * buffer module's globals). */
static PyObject *
install_buffers(PyObject *module, PyObject *ns)
{
    if (buffers_installed)
        Py_RETURN_NONE;
    PyObject *rt_mod, *buf_mod, *mp_mod;
    if (get_type(ns, "Buffer", &Buffer_T) < 0 || get_obj(ns, "runtime_module", &rt_mod) < 0
        || get_obj(ns, "buffer_module", &buf_mod) < 0 || get_obj(ns, "mempool_module", &mp_mod) < 0
        || get_obj(ns, "EXTENSION", &EXTENSION) < 0)
        return NULL;
    if ((runtime_globals = PyModule_GetDict(rt_mod)) == NULL || (buffer_globals = PyModule_GetDict(buf_mod)) == NULL
        || (mempool_globals = PyModule_GetDict(mp_mod)) == NULL)
        return NULL;
    Py_INCREF(runtime_globals);
    Py_INCREF(buffer_globals);
    Py_INCREF(mempool_globals);
    if (intern(&s_runtime_g, "_runtime") || intern(&s_forked_from, "_forked_from")
        || intern(&s_collecting, "_collecting") || intern(&s_open, "_open") || intern(&s_state, "_state")
        || intern(&s_streams, "streams") || intern(&s_default_streams, "_default_streams")
        || intern(&s_extensions, "extensions") || intern(&s_allocators, "allocators") || intern(&s_free, "free")
        || intern(&s_free_from_finalizer, "free_from_finalizer") || intern(&s_malloc, "malloc")
        || intern(&s_device_kw, "device") || intern(&s_stream_kw, "stream") || intern(&s_buffer_device, "device")
        || intern(&s_block, "_block") || intern(&s_allocator, "_allocator") || intern(&s_nbytes, "_nbytes")
        || intern(&s_stream, "_stream") || intern(&s_lease, "_lease"))
        return NULL;
    PyObject *py_allocate = PyDict_GetItemString(buffer_globals, "allocate");
    if (py_allocate == NULL || !PyFunction_Check(py_allocate)) {
        PyErr_SetString(PyExc_TypeError, "the buffer module's allocate is not a Python function");
        return NULL;
    }
    PyObject *c = make_compiled(buffer_allocate, py_allocate);
    if (c == NULL || PyDict_SetItemString(buffer_globals, "allocate", c) < 0) {
        Py_XDECREF(c);
        return NULL;
    }
    Py_DECREF(c);
    if (replace_method(Buffer_T, "free", buffer_free, NULL) < 0 || replace_method(Buffer_T, "__del__", buffer_del, NULL) < 0)
        return NULL;
    buffers_installed = 1;
    Py_RETURN_NONE;
}

/* -- graphed calls (accel/graph/_compiled.py, accel/graph/_graphed.py) ------------------ */

/* A graphed call of a compiled program, in its steady state: the arguments are contiguous
 * host torch.Tensors (exactly that class) of the graph's shapes and dtypes, not negated or
 * conjugated views, on the calling thread's default stream, and (for an engine that reads
 * them where they lie) the engine's binding already points at their memory and no run of
 * it is under way. Then this is the engine's run and little else. Every other call goes
 * to ``fallback``, the Python call of accel/graph/_compiled.py it stands in for (which
 * checks everything again, copies, repoints the binding, or returns None), and so do calls
 * whose arguments are not a tuple: this never refuses or copies anything itself, and it
 * returns None only where the Python call does (another stream: the caller replays there).
 *
 * A tensor is read through torch's public Python API only (its shape, dtype and is_cpu
 * attributes, its is_contiguous(), data_ptr(), is_neg() and is_conj() methods), each by an
 * interned name: no torch symbol is looked up and no object layout of torch or CPython is
 * read (issue 27). torch's C interface for AOTInductor (aoti_torch_*) was faster, but it
 * takes an at::Tensor*, which only a private layout (THPVariable's, or the TensorImpl
 * pointer ``_cdata`` gives, taken for one) provides: the public calls cost about 1.5 us
 * more a call on a loaded machine, and still 0.5 us less than the Python call
 * (docs/benchmarks.md, "The steady call on torch's public API"). */

static PyTypeObject *Tensor_T;  /* torch.Tensor */
static PyObject *py_check_memory; /* accel.graph._compiled.check_memory */
static PyObject *py_is_grad_enabled; /* torch.is_grad_enabled */
static PyObject *s_shape, *s_dtype, *s_is_cpu, *s_is_contiguous, *s_is_neg, *s_is_conj, *s_data_ptr, *s_call_,
    *s_refuse, *s_gstreams, *s_taken, *s_busy, *s_head_acquire, *s_head_release;
static PyTypeObject *Binding_T;  /* accel.graph._compiled._Binding */
static int graphs_installed = 0;
/* Bumped by set_current() each time a thread's current stream changes (accel._runtime makes
 * every change through it): a SteadyCall that found the default stream current on a thread
 * at one count needs not ask that thread's state again until the count moves. */
static unsigned long long streams_epoch = 1;

/* Set in a forked child: every call goes to the fallback, which refuses it there (the
 * engines' thread pools have no threads in the child: a run waits for them forever). */
static volatile int forked_child = 0;

static void
note_fork_in_child(void)
{
    forked_child = 1;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int taking;   /* 1: run() runs a binding pointed at the arguments (ONNX Runtime); 0: run(list) */
    int real;     /* no input is complex: the conjugate bit is not asked */
    Py_ssize_t n; /* the graph's inputs */
    PyObject *fallback, *shapes, *dtypes, *thread, *device, *default_stream, *run;
    PyObject *finish; /* taking: the outputs returned; direct: None (one output: result[0]) or finish(result) */
    PyObject *binding; /* taking: the _Binding the fallback shares */
    PyObject *handed; /* direct: a list of n Nones for the next run() (NULL: none; see steady_run) */
    unsigned long long *checked;  /* direct: the addresses check_memory last passed (n) */
    int checked_set;              /* whether ``checked`` holds any (a freed tensor's address can be 0) */
    /* The thread (its PyThreadState id, never reused) on which the default stream was last
     * found current, and streams_epoch then; 0: none. */
    unsigned long long default_on, default_at;
} SteadyCall;

static PyTypeObject SteadyCall_T;

/* 1 if o.<name>() is True, 0 if not (or it failed: the error is cleared, the fallback redoes it) */
static inline int
method_true(PyObject *o, PyObject *name)
{
    PyObject *r = PyObject_VectorcallMethod(name, &o, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(r);
    return r == Py_True;
}

/* o.<name> is ``want`` (by identity: True, a dtype): 1, 0, or 0 with the error cleared */
static inline int
attr_is(PyObject *o, PyObject *name, PyObject *want)
{
    PyObject *r = PyObject_GetAttr(o, name);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(r);
    return r == want;
}

/* Whether argument ``i`` is a steady one (its address then in pointers[i]): of the
 * graph's signature, on the host, contiguous, not negated or conjugated. */
static int
steady_tensor(SteadyCall *c, Py_ssize_t i, PyObject *a, unsigned long long *pointers)
{
    if (!Py_IS_TYPE(a, Tensor_T))
        return 0; /* a subclass may answer anything: the Python call asks it */
    PyObject *shape = PyObject_GetAttr(a, s_shape);
    if (shape == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(c->shapes, i), Py_EQ);
    Py_DECREF(shape);
    if (same <= 0) {
        PyErr_Clear();
        return 0;
    }
    if (!attr_is(a, s_dtype, PyTuple_GET_ITEM(c->dtypes, i)) || !attr_is(a, s_is_cpu, Py_True)
        || !method_true(a, s_is_contiguous))
        return 0;
    PyObject *p = PyObject_VectorcallMethod(s_data_ptr, &a, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (p == NULL) {
        PyErr_Clear();
        return 0;
    }
    pointers[i] = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !method_true(a, s_is_neg) && (c->real || !method_true(a, s_is_conj));
}

/* steady_call on a tuple of the graph's count, its addresses read into ``pointers``. */
static PyObject *
steady_run(SteadyCall *c, PyObject *args, unsigned long long *pointers)
{
    PyObject **items = &PyTuple_GET_ITEM(args, 0);
    for (Py_ssize_t i = 0; i < c->n; i++)
        if (!steady_tensor(c, i, items[i], pointers))
            goto fallback;
    /* thread.streams.get(device, default) is default: asked again only where the thread or
     * the epoch moved since it last was (the thread-local's lookup is most of this call's
     * own time). The epoch is read first: a change made while this asks is seen next call. */
    unsigned long long epoch = streams_epoch, on = PyThreadState_GetID(PyThreadState_Get());
    if (c->default_at != epoch || c->default_on != on) {
        PyObject *streams = PyObject_GetAttr(c->thread, s_gstreams);
        if (streams == NULL) {
            PyErr_Clear();
            goto fallback;
        }
        if (!PyDict_CheckExact(streams)) {
            Py_DECREF(streams);
            goto fallback;
        }
        PyObject *current = PyDict_GetItemWithError(streams, c->device);
        Py_DECREF(streams); /* current stays alive: this thread's state keeps that dict */
        if (current == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        if (current != NULL && current != c->default_stream)
            Py_RETURN_NONE; /* another stream: the caller replays the graph on it */
        c->default_on = on;
        c->default_at = epoch;
    }
    if (c->taking) {
        /* The binding points at these addresses (_Binding.taken: one int, or a tuple of n)
         * and no run is under way: test and set ``busy`` with the GIL held throughout, as
         * the Python call's steady path does (see _taking_call). Its slots are read and
         * written as attributes: member descriptors, which run no Python code. */
        PyObject *taken = PyObject_GetAttr(c->binding, s_taken), *busy;
        if (taken == NULL) {
            PyErr_Clear();
            goto fallback;
        }
        int agree = 1;
        if (c->n == 1 && !PyTuple_Check(taken))
            agree = PyLong_CheckExact(taken) && PyLong_AsUnsignedLongLong(taken) == pointers[0];
        else if (!PyTuple_CheckExact(taken) || PyTuple_GET_SIZE(taken) != c->n)
            agree = 0;
        else
            for (Py_ssize_t i = 0; i < c->n && agree; i++) {
                PyObject *t = PyTuple_GET_ITEM(taken, i);
                agree = PyLong_CheckExact(t) && PyLong_AsUnsignedLongLong(t) == pointers[i];
            }
        Py_DECREF(taken);
        if (!agree || (busy = PyObject_GetAttr(c->binding, s_busy)) == NULL) {
            PyErr_Clear();
            goto fallback;
        }
        Py_DECREF(busy); /* compared by identity only */
        if (busy != Py_False || PyObject_SetAttr(c->binding, s_busy, Py_True) < 0) {
            PyErr_Clear();
            goto fallback;
        }
        PyObject *r = PyObject_CallNoArgs(c->run), *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* the run's error, kept while busy is set back */
        if (PyObject_SetAttr(c->binding, s_busy, Py_False) < 0) {
            if (r == NULL) { /* the run's error is the one to raise */
                PyErr_Clear();
                PyErr_Restore(type, value, tb);
                return NULL;
            }
            Py_DECREF(r);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        Py_INCREF(c->finish);
        return c->finish;
    }
    int fresh = !c->checked_set;
    for (Py_ssize_t i = 0; i < c->n; i++)
        fresh |= pointers[i] != c->checked[i];
    if (fresh) {
        /* memory at new addresses: refuse a tensor with none behind it, as the Python call does */
        PyObject *r = PyObject_CallOneArg(py_check_memory, args);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        memcpy(c->checked, pointers, c->n * sizeof(unsigned long long));
        c->checked_set = 1;
    }
    /* The list of the arguments: the kept one, taken out of the SteadyCall while it runs
     * (a call made meanwhile, on another thread or below this one, makes its own), else a
     * new one. */
    PyObject *list = c->handed;
    if (list != NULL)
        c->handed = NULL;
    else if ((list = PyList_New(c->n)) == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < c->n; i++) {
        Py_INCREF(items[i]);
        Py_XSETREF(PyList_GET_ITEM(list, i), items[i]); /* a new list holds NULLs, the kept one Nones */
    }
    PyObject *result = PyObject_CallOneArg(c->run, list);
    /* Kept for the next call only where the runner neither kept it nor changed its length:
     * a list the runner still holds would keep this call's tensors alive after the runner
     * let it go, and one it emptied or grew was read past its end (an emptied one: SIGSEGV)
     * or handed to the next run with more items than the Python call's. Between calls it
     * holds Nones, no caller's tensors. */
    if (Py_REFCNT(list) == 1 && PyList_GET_SIZE(list) == c->n) {
        for (Py_ssize_t i = 0; i < c->n; i++) {
            Py_INCREF(Py_None);
            Py_SETREF(PyList_GET_ITEM(list, i), Py_None); /* may run a finalizer: only this holds list */
        }
        if (c->handed == NULL) /* a call made meanwhile may have kept its own */
            c->handed = list;
        else
            Py_DECREF(list);
    }
    else
        Py_DECREF(list);
    if (result == NULL)
        return NULL;
    PyObject *out;
    if (c->finish == Py_None)
        out = PySequence_GetItem(result, 0);
    else
        out = PyObject_CallOneArg(c->finish, result);
    Py_DECREF(result);
    return out;
fallback:
    return PyObject_CallOneArg(c->fallback, args);
}

/* The steady call on the tuple ``args``: a new reference, NULL with an error, or whatever
 * the fallback returns. The addresses read are this call's own, never the SteadyCall's: a
 * call made while this one runs Python code (check_memory, a thread-local's first
 * __init__, a finalizer), on another thread or from a hook on this one, read its own
 * into shared ones, and this call then recorded that other call's addresses as checked
 * (a freed tensor's address 0 went to the runner unchecked: SIGSEGV) or ran a binding
 * pointed at the other call's memory (its result for this call's). */
static PyObject *
steady_call(SteadyCall *c, PyObject *args)
{
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != c->n || forked_child)
        return PyObject_CallOneArg(c->fallback, args);
    unsigned long long local[8], *pointers = local;
    if (c->n > 8 && (pointers = PyMem_Malloc(c->n * sizeof(unsigned long long))) == NULL)
        return PyErr_NoMemory();
    PyObject *r = steady_run(c, args, pointers);
    if (pointers != local)
        PyMem_Free(pointers);
    return r;
}

static PyObject *
steady_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    SteadyCall *c = (SteadyCall *)self;
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL)
        return steady_call(c, args[0]);
    return PyObject_Vectorcall(c->fallback, args, nargsf, kwnames);
}

static int
steady_traverse(PyObject *self, visitproc visit, void *arg)
{
    SteadyCall *c = (SteadyCall *)self;
    Py_VISIT(c->fallback);
    Py_VISIT(c->shapes);
    Py_VISIT(c->dtypes);
    Py_VISIT(c->thread);
    Py_VISIT(c->device);
    Py_VISIT(c->default_stream);
    Py_VISIT(c->run);
    Py_VISIT(c->finish);
    Py_VISIT(c->binding);
    Py_VISIT(c->handed);
    return 0;
}

static int
steady_clear(PyObject *self)
{
    SteadyCall *c = (SteadyCall *)self;
    Py_CLEAR(c->fallback);
    Py_CLEAR(c->shapes);
    Py_CLEAR(c->dtypes);
    Py_CLEAR(c->thread);
    Py_CLEAR(c->device);
    Py_CLEAR(c->default_stream);
    Py_CLEAR(c->run);
    Py_CLEAR(c->finish);
    Py_CLEAR(c->binding);
    Py_CLEAR(c->handed);
    return 0;
}

static void
steady_dealloc(PyObject *self)
{
    SteadyCall *c = (SteadyCall *)self;
    PyObject_GC_UnTrack(self);
    steady_clear(self);
    PyMem_Free(c->checked);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *
steady_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"fallback", "inputs", "thread", "device", "default", "run", "finish", "binding", "real",
                            NULL};
    PyObject *fallback, *inputs, *thread, *device, *dflt, *run, *finish, *binding;
    int real;
    if (!graphs_installed) {
        PyErr_SetString(PyExc_RuntimeError, "accel._speedups.install_graphs() has not run");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOOOOOp:SteadyCall", names, &fallback, &PyList_Type, &inputs,
                                     &thread, &device, &dflt, &run, &finish, &binding, &real))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(run) || PyList_GET_SIZE(inputs) == 0
        || (binding != Py_None && !Py_IS_TYPE(binding, Binding_T))) {
        PyErr_SetString(PyExc_TypeError, "SteadyCall: fallback and run must be callable, inputs a list of tensors, "
                                         "binding a _Binding or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(inputs);
    SteadyCall *c = (SteadyCall *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->vectorcall = steady_vectorcall;
    c->taking = binding != Py_None;
    c->real = real;
    c->n = n;
    Py_INCREF(fallback);
    c->fallback = fallback;
    Py_INCREF(thread);
    c->thread = thread;
    Py_INCREF(device);
    c->device = device;
    Py_INCREF(dflt);
    c->default_stream = dflt;
    Py_INCREF(run);
    c->run = run;
    Py_INCREF(finish);
    c->finish = finish;
    Py_INCREF(binding);
    c->binding = binding;
    c->shapes = PyTuple_New(n);
    c->dtypes = PyTuple_New(n);
    c->checked = PyMem_Calloc(n, sizeof(unsigned long long));
    if (c->shapes == NULL || c->dtypes == NULL || c->checked == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(inputs, i), *shape = PyObject_GetAttr(t, s_shape), *dtype;
        if (shape == NULL || !PyTuple_Check(shape)) {
            Py_XDECREF(shape);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "SteadyCall: inputs must be tensors");
            goto error;
        }
        PyTuple_SET_ITEM(c->shapes, i, shape);
        if ((dtype = PyObject_GetAttr(t, s_dtype)) == NULL)
            goto error;
        PyTuple_SET_ITEM(c->dtypes, i, dtype);
    }
    return (PyObject *)c;
error:
    Py_DECREF(c);
    return NULL;
}

static PyObject *
steady_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<compiled %R>", ((SteadyCall *)self)->fallback);
}

static PyMemberDef steady_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(SteadyCall, fallback), READONLY, "The Python call it stands in for."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SteadyCall_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups.SteadyCall",
    .tp_basicsize = sizeof(SteadyCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SteadyCall, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = steady_new,
    .tp_traverse = steady_traverse,
    .tp_clear = steady_clear,
    .tp_dealloc = steady_dealloc,
    .tp_repr = steady_repr,
    .tp_members = steady_members,
    .tp_doc = "SteadyCall(fallback, inputs, thread, device, default, run, finish, binding, real): a compiled "
              "graphed call's steady path; every other call goes to fallback (accel/_speedups.c).",
};

/* GraphedCallable's base: a call tries ``_hot`` first (the last compiled call's bound call,
 * see accel/graph/_graphed.py's _CallHead, which this does step by step), then self._call.
 * Not in grad mode: there self._call decides whether autograd would record (and refuses).
 * Only on the thread that made the callable (``_owner``), holding ``_lock`` (a threading.RLock,
 * whose acquire lets go of the GIL while it waits), and reading ``_hot`` again under it: another
 * thread's call writes the same static inputs and outputs (see _CallHead). */
typedef struct {
    PyObject_HEAD
    PyObject *hot;
    Py_ssize_t hits;
    PyObject *lock;
    unsigned long owner;
} CallHead;

/* hot(args) under h->lock, re-read there; *called is 0 where _hot was gone by then. */
static PyObject *
head_locked_hot(CallHead *h, PyObject *args, int *called)
{
    *called = 0;
    PyObject *got = PyObject_CallMethodNoArgs(h->lock, s_head_acquire);
    if (got == NULL)
        return NULL;
    Py_DECREF(got);
    PyObject *hot = h->hot, *r = NULL;
    *called = hot != NULL && hot != Py_None;
    if (*called) {
        Py_INCREF(hot);
        r = Py_IS_TYPE(hot, &SteadyCall_T) ? steady_call((SteadyCall *)hot, args) : PyObject_CallOneArg(hot, args);
        Py_DECREF(hot);
    }
    PyObject *type, *value, *tb; /* the call's exception, if any, outlives the release */
    PyErr_Fetch(&type, &value, &tb);
    PyObject *released = PyObject_CallMethodNoArgs(h->lock, s_head_release);
    if (released == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(r);
        return NULL;
    }
    Py_DECREF(released);
    PyErr_Restore(type, value, tb);
    return r;
}

static PyObject *
head_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    CallHead *h = (CallHead *)self;
    PyObject *hot = h->hot;
    if (hot != NULL && hot != Py_None && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
        PyObject *grad = PyObject_CallNoArgs(py_is_grad_enabled); /* set: hot is only set once installed */
        if (grad == NULL)
            return NULL;
        Py_DECREF(grad);
        if (grad == Py_True || h->lock == NULL || h->lock == Py_None || PyThread_get_thread_ident() != h->owner)
            hot = NULL;
    }
    if (hot != NULL && hot != Py_None && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
        int called;
        PyObject *r = head_locked_hot(h, args, &called);
        if (r == NULL && !called && !PyErr_Occurred())
            r = Py_NewRef(Py_None); /* _hot was reset meanwhile: the lookup */
        if (r == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) /* NotImplementedError is one */
                return NULL;
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL)
                PyException_SetTraceback(value, tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyObject *fargs[3] = {self, args, value};
            r = PyObject_VectorcallMethod(s_refuse, fargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_XDECREF(value);
            if (r != NULL) { /* _refuse raises */
                Py_DECREF(r);
                PyErr_SetString(PyExc_SystemError, "GraphedCallable._refuse returned");
            }
            return NULL;
        }
        if (r != Py_None) {
            h->hits++;
            return r;
        }
        Py_DECREF(r);
    }
    PyObject *fargs[3] = {self, args, kwargs != NULL ? kwargs : Py_None};
    return PyObject_VectorcallMethod(s_call_, fargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static int
head_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((CallHead *)self)->hot);
    Py_VISIT(((CallHead *)self)->lock);
    return 0;
}

static int
head_clear(PyObject *self)
{
    Py_CLEAR(((CallHead *)self)->hot);
    Py_CLEAR(((CallHead *)self)->lock);
    return 0;
}

static void
head_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    head_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMemberDef head_members[] = {
    {"_hot", T_OBJECT, offsetof(CallHead, hot), 0, "The bound call a call tries first (None: none)."},
    {"hits", T_PYSSIZET, offsetof(CallHead, hits), 0, "Calls that replayed a cached graph."},
    {"_lock", T_OBJECT, offsetof(CallHead, lock), 0, "The lock calls hold (a threading.RLock)."},
    {"_owner", T_ULONG, offsetof(CallHead, owner), 0, "The thread that takes the hot path."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CallHead_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups._CallHead",
    .tp_basicsize = sizeof(CallHead),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_call = head_call,
    .tp_new = PyType_GenericNew,
    .tp_traverse = head_traverse,
    .tp_clear = head_clear,
    .tp_dealloc = head_dealloc,
    .tp_members = head_members,
    .tp_doc = "GraphedCallable's compiled base: its __call__ (accel/graph/_graphed.py's _CallHead, in C).",
};

/* install_graphs(names): what SteadyCall reads (torch.Tensor, check_memory, _Binding).
 * Called again (importlib.reload of accel.graph._compiled, as IPython's autoreload does),
 * it takes the new module's check_memory and _Binding class: SteadyCalls made from then on
 * were refused for their new _Binding (a TypeError for every ONNX Runtime graph). The old
 * objects are kept, as the first ones are, for the process. */
static PyObject *
install_graphs(PyObject *module, PyObject *ns)
{
    PyTypeObject *tensor, *binding;
    PyObject *check, *grad_enabled;
    if (get_type(ns, "Tensor", &tensor) < 0)
        return NULL;
    if (get_obj(ns, "check_memory", &check) < 0) {
        Py_DECREF(tensor);
        return NULL;
    }
    if (get_obj(ns, "is_grad_enabled", &grad_enabled) < 0) {
        Py_DECREF(tensor);
        Py_DECREF(check);
        return NULL;
    }
    if (get_type(ns, "Binding", &binding) < 0) {
        Py_DECREF(tensor);
        Py_DECREF(check);
        Py_DECREF(grad_enabled);
        return NULL;
    }
    Tensor_T = tensor;
    py_check_memory = check;
    py_is_grad_enabled = grad_enabled;
    Binding_T = binding;
    if (graphs_installed)
        Py_RETURN_NONE;
    if (intern(&s_shape, "shape") || intern(&s_dtype, "dtype") || intern(&s_is_cpu, "is_cpu")
        || intern(&s_is_contiguous, "is_contiguous") || intern(&s_is_neg, "is_neg") || intern(&s_is_conj, "is_conj")
        || intern(&s_data_ptr, "data_ptr") || intern(&s_call_, "_call") || intern(&s_refuse, "_refuse")
        || intern(&s_gstreams, "streams") || intern(&s_taken, "taken") || intern(&s_busy, "busy")
        || intern(&s_head_acquire, "acquire") || intern(&s_head_release, "release"))
        return NULL;
    if (pthread_atfork(NULL, NULL, note_fork_in_child) != 0) {
        PyErr_SetString(PyExc_OSError, "install_graphs: pthread_atfork failed");
        return NULL;
    }
    graphs_installed = 1;
    Py_RETURN_NONE;
}

/* set_current(streams, index, stream): ``streams[index] = stream`` (a thread's current
 * streams, an exact dict; stream None: ``streams.pop(index, None)``), with streams_epoch
 * bumped right before, no Python code between the two: a SteadyCall called before sees the
 * old state at the old count, one called after (from the old stream's finalizer too, which
 * the store may run) asks again and sees the new. Bumped after the store, a call made in
 * between (a signal handler, a profile or trace hook) took the default stream it
 * remembered for current. */
static PyObject *
set_current(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    /* index: any key the Python store takes (a device index, an int: hashed and compared
     * in C) */
    if (nargs != 3 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "set_current(streams, index, stream): a dict, a key, a stream or None");
        return NULL;
    }
    streams_epoch++;
    int has = args[2] != Py_None ? PyDict_SetItem(args[0], args[1], args[2]) : PyDict_Contains(args[0], args[1]);
    if (has < 0 || (args[2] == Py_None && has && PyDict_DelItem(args[0], args[1]) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"install_allocator", install_allocator, METH_O,
     "Replace DeviceAllocator's malloc, free, _free_held and free_from_finalizer by compiled versions."},
    {"install_buffers", install_buffers, METH_O,
     "Replace Buffer.free, Buffer.__del__ and the buffer module's allocate by compiled versions."},
    {"install_graphs", install_graphs, METH_O, "Give SteadyCall what it reads (torch.Tensor, check_memory, _Binding)."},
    {"set_current", (PyCFunction)(void (*)(void))set_current, METH_FASTCALL,
     "streams[index] = stream (None: pop), SteadyCalls told first: a thread's current stream changed."},
    {NULL, NULL, 0, NULL},
};

/* The module runs with the GIL, and says so (Py_mod_gil, Python 3.13+: a free-threaded
 * interpreter turns the GIL back on when it imports it, with a RuntimeWarning, instead of
 * running this code unlocked). What relies on it:
 *  - the allocator's compiled paths (install_allocator) take and give back the allocator's
 *    threading.Lock themselves and read and write its objects' fields between the Python
 *    methods they call;
 *  - a SteadyCall's caches (the list it hands the runner, the addresses check_memory last
 *    passed, the thread and stream count on which the default stream was last found
 *    current) and a taking call's test and set of its binding's ``busy`` are each made
 *    with no other thread running Python in between, as the Python steady path's are
 *    (accel/graph/_compiled.py gives a taking engine no SteadyCall where
 *    sys._is_gil_enabled() is false); _CallHead's hit count and streams_epoch are plain
 *    increments;
 *  - references borrowed from dicts (module globals, a thread's current streams) are used
 *    before the next call that can run Python code, which with the GIL no other thread
 *    can run either;
 *  - what install_* stores (the classes, interned names, module dicts) is written once, at
 *    the import of the module that calls it, and kept for the process: one interpreter's
 *    objects, so the module refuses other interpreters (Py_mod_multiple_interpreters). */
static int
module_exec(PyObject *m)
{
    if (PyType_Ready(&Compiled_T) < 0 || PyType_Ready(&SteadyCall_T) < 0 || PyType_Ready(&CallHead_T) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "SteadyCall", (PyObject *)&SteadyCall_T) < 0
        || PyModule_AddObjectRef(m, "_CallHead", (PyObject *)&CallHead_T) < 0
        || PyModule_AddStringConstant(m, "SOURCE_CRC32", ACCEL_SPEEDUPS_SOURCE_CRC32) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "accel._speedups",
    "Optional C versions of accel's allocation hot paths (see accel/_native.py).", 0, module_methods, module_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module);
}
