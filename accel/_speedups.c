/* accel._speedups: the C implementation of hot paths of buffers, streams and graphs.
 *
 * A mandatory part of every build, like the allocator's native core (setup.py builds
 * both; accel/_native.py refuses a missing or stale build with an ImportError). Each
 * hot path here is the implementation of its common case, on accel's Python objects,
 * through CPython's public C API only; whenever a condition of that case fails, or an
 * object is not of the exact class expected, it hands the call, before changing
 * anything, to the Python function it stands in for, which keeps only the other cases.
 * (The caching allocator's books are not here: they are the native core's,
 * csrc/accel_core.c. Its steps that hand out or take back a block, with the block's
 * handle, are here, in C: see "the core step" below; DeviceAllocator calls the rest
 * through cffi.)
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

/* The CRC-32 of this file, passed by setup.py. accel/_native.py compares it with the
 * source beside the package and refuses a module built from another version of it: an
 * old build (in build/ or in the tree, kept when a later build had no compiler) reads
 * slots and calls methods that the current Python code may no longer have. */
#ifndef ACCEL_SPEEDUPS_SOURCE_CRC32
#error "build accel/_speedups.c through setup.py: it defines ACCEL_SPEEDUPS_SOURCE_CRC32, checked by accel/_native.py"
#endif

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

/* -- what install_*() are given ---------------------------------------------------- */

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

/* o.<name> is ``want`` (by identity: True, a dtype, an allocator): 1, 0, or 0 with the error cleared */
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

/* -- the core step: a block's handle and the core's books change together ----------------
 *
 * accel_core_malloc and the registration of the block's handle (a CoreBlock in the
 * allocator's ``_live``), and the handle's removal and accel_core_free (or _hold,
 * _release_held), are each one C call here, with no Python bytecode in between: a Python
 * signal handler (Ctrl-C's KeyboardInterrupt) runs only between bytecodes, so it cannot
 * land between the core's books and the handle's and lose a block. DeviceAllocator (its
 * lock-free pair and its locked paths), the compiled allocate and Buffer.free, and
 * accel.empty's tensors all take these steps: there is one of each. The core is called
 * with the GIL held; it neither needs the GIL nor waits for it (it calls its upstream with
 * its own mutex released, and the upstream's callback takes the GIL it already has). */

typedef int (*core_malloc_fn)(void *core, int64_t nbytes, uint64_t stream, uint64_t pool, int flags, uint64_t *ptr,
                              int64_t *size);
typedef int (*core_ptr_fn)(void *core, uint64_t ptr);
#define CORE_NO_RETRY 1 /* accel_core.h's ACCEL_CORE_NO_RETRY: a refusal is the caller's to handle */
#define CORE_MAX_REQUEST (INT64_C(1) << 60)
/* accel/allocator/_blocks.py's states */
#define BLOCK_ALLOCATED 1
#define BLOCK_PENDING 2
#define BLOCK_RETIRED 3

/* A caller's handle of a block the native core handed out (accel/allocator/_blocks.py
 * documents it): ALLOCATED, PENDING (freed, held in the core until other streams' events
 * pass) or RETIRED (freed: a stale second free of it is refused). */
typedef struct {
    PyObject_HEAD
    uint64_t address;      /* ptr, for the core */
    PyObject *ptr;         /* int: the key in the allocator's _live */
    PyObject *size;        /* int */
    PyObject *requested;   /* int */
    PyObject *stream;      /* int: the stream's handle, or a retired stream's key */
    PyObject *owner;       /* the DeviceAllocator */
    PyObject *stream_uses; /* set of handles, or None */
    PyObject *frames;      /* list of frames (history), or None */
    int state;
    int event_count;
} CoreBlock;

static int
coreblock_traverse(PyObject *self, visitproc visit, void *arg)
{
    CoreBlock *b = (CoreBlock *)self;
    Py_VISIT(b->owner);
    Py_VISIT(b->stream_uses);
    Py_VISIT(b->frames);
    return 0;
}

static int
coreblock_clear(PyObject *self)
{
    CoreBlock *b = (CoreBlock *)self;
    Py_CLEAR(b->owner);
    Py_CLEAR(b->stream_uses);
    Py_CLEAR(b->frames);
    return 0;
}

static void
coreblock_dealloc(PyObject *self)
{
    CoreBlock *b = (CoreBlock *)self;
    PyObject_GC_UnTrack(self);
    coreblock_clear(self);
    Py_XDECREF(b->ptr);
    Py_XDECREF(b->size);
    Py_XDECREF(b->requested);
    Py_XDECREF(b->stream);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *
coreblock_repr(PyObject *self)
{
    CoreBlock *b = (CoreBlock *)self;
    static const char *names[] = {"free", "allocated", "pending", "freed"};
    const char *state = b->state >= 0 && b->state <= 3 ? names[b->state] : "?";
    char address[24]; /* PyUnicode_FromFormat has no %llx before Python 3.12: it would print the format */
    PyOS_snprintf(address, sizeof address, "0x%llx", (unsigned long long)b->address);
    return PyUnicode_FromFormat("<Block %s %S bytes %s>", address, b->size, state);
}

static PyMemberDef coreblock_members[] = {
    {"ptr", T_OBJECT_EX, offsetof(CoreBlock, ptr), READONLY, "The block's address."},
    {"size", T_OBJECT_EX, offsetof(CoreBlock, size), READONLY, "Its size in bytes (rounded)."},
    {"requested", T_OBJECT_EX, offsetof(CoreBlock, requested), READONLY, "The size asked for."},
    {"stream", T_OBJECT_EX, offsetof(CoreBlock, stream), 0, "Its stream's handle (a retired stream's key)."},
    {"owner", T_OBJECT_EX, offsetof(CoreBlock, owner), READONLY, "The DeviceAllocator it came from."},
    {"stream_uses", T_OBJECT, offsetof(CoreBlock, stream_uses), 0, "Other streams that used it (record_stream)."},
    {"frames", T_OBJECT, offsetof(CoreBlock, frames), 0, "Where it was allocated, when history is on."},
    {"state", T_INT, offsetof(CoreBlock, state), 0, "ALLOCATED, PENDING or RETIRED."},
    {"event_count", T_INT, offsetof(CoreBlock, event_count), 0, "Events its reuse still waits for."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreBlock_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups.CoreBlock",
    .tp_basicsize = sizeof(CoreBlock),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = coreblock_traverse,
    .tp_clear = coreblock_clear,
    .tp_dealloc = coreblock_dealloc,
    .tp_repr = coreblock_repr,
    .tp_members = coreblock_members,
    .tp_doc = "A caller's handle of a block of the native allocator core (made by CoreSteps.malloc).",
};

/* One allocator's core and handles: DeviceAllocator._steps. */
typedef struct {
    PyObject_HEAD
    void *core;
    core_malloc_fn malloc;
    core_ptr_fn free, hold, release_held;
    PyObject *owner; /* the DeviceAllocator */
    PyObject *live;  /* owner._live: ptr -> CoreBlock */
    PyObject *known; /* owner._known: the stream handles it keys memory by */
    PyObject *error; /* InvalidHandleError */
} CoreSteps;

static PyTypeObject CoreSteps_T;

/* accel_core_malloc(nbytes, stream, pool, flags) and the block's handle in _live: a new
 * reference to the CoreBlock; NULL with *rc set to the core's refusal (no error: the
 * caller handles it), or NULL with an error (the memory went back to the core). */
static PyObject *
step_malloc(CoreSteps *s, PyObject *nbytes, PyObject *stream, uint64_t pool, int flags, int *rc)
{
    *rc = 0;
    long long n = PyLong_AsLongLong(nbytes);
    uint64_t key = n == -1 && PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(stream);
    if (PyErr_Occurred())
        return NULL;
    /* everything that can fail before the core call is made first */
    CoreBlock *b = PyObject_GC_New(CoreBlock, &CoreBlock_T);
    if (b == NULL)
        return NULL;
    b->ptr = b->size = b->requested = b->stream = b->owner = b->stream_uses = b->frames = NULL;
    b->state = BLOCK_ALLOCATED;
    b->event_count = 0;
    int known = PySet_Contains(s->known, stream);
    if (known < 0 || (!known && PySet_Add(s->known, stream) < 0)) {
        Py_DECREF(b);
        return NULL;
    }
    uint64_t ptr;
    int64_t size;
    *rc = s->malloc(s->core, n, key, pool, flags, &ptr, &size);
    if (*rc != 0) {
        Py_DECREF(b);
        return NULL;
    }
    b->address = ptr;
    Py_INCREF(nbytes);
    b->requested = nbytes;
    Py_INCREF(stream);
    b->stream = stream;
    Py_INCREF(s->owner);
    b->owner = s->owner;
    Py_INCREF(Py_None);
    b->stream_uses = Py_None;
    Py_INCREF(Py_None);
    b->frames = Py_None;
    if ((b->ptr = PyLong_FromUnsignedLongLong(ptr)) == NULL || (b->size = PyLong_FromLongLong(size)) == NULL
        || PyDict_SetItem(s->live, b->ptr, (PyObject *)b) < 0) {
        s->free(s->core, ptr); /* no handle of it is out */
        Py_DECREF(b);
        return NULL;
    }
    PyObject_GC_Track((PyObject *)b);
    return (PyObject *)b;
}

/* ``block`` is the handle in _live at its address: 0, or -1 with the error (freed twice). */
static int
step_live(CoreSteps *s, CoreBlock *b)
{
    PyObject *claimed = PyDict_GetItemWithError(s->live, b->ptr);
    if (claimed != (PyObject *)b) {
        if (!PyErr_Occurred())
            PyErr_Format(s->error, "%R is not allocated by %R (freed twice)", (PyObject *)b, s->owner);
        return -1;
    }
    return 0;
}

/* ``block`` out of _live, with no Python code run between the look-up and the removal (so
 * of two racing frees one does): 0, or -1 with the error. */
static int
step_claim(CoreSteps *s, CoreBlock *b)
{
    return step_live(s, b) < 0 ? -1 : PyDict_DelItem(s->live, b->ptr);
}

static int
step_broken(CoreSteps *s, CoreBlock *b)
{
    PyErr_Format(s->error, "the allocator core of %R does not hold %R, which it handed out", s->owner, (PyObject *)b);
    return -1;
}

/* The free of an allocated block: out of _live, RETIRED, accel_core_free. 0 or -1. */
static int
step_free(CoreSteps *s, CoreBlock *b)
{
    if (step_claim(s, b) < 0)
        return -1;
    b->state = BLOCK_RETIRED;
    return s->free(s->core, b->address) != 0 ? step_broken(s, b) : 0;
}

/* The common free (DeviceAllocator.free and the compiled Buffer.free without the lock): an allocated
 * block of this allocator used on its own stream only is freed (step_free); its checks
 * and the claim are one C call, so a record_stream (locked, in another thread) marks a
 * use either before (this is then not the common case: the locked path orders the reuse)
 * or after (it finds the handle gone and refuses). 1 freed, 0 not the common case
 * (nothing changed), -1 with an error. */
static int
step_free_plain(CoreSteps *s, CoreBlock *b)
{
    if (b->state != BLOCK_ALLOCATED || b->stream_uses != Py_None || b->owner != s->owner)
        return 0;
    return step_free(s, b) < 0 ? -1 : 1;
}

static int
check_block(CoreSteps *s, PyObject *o, int state)
{
    if (!Py_IS_TYPE(o, &CoreBlock_T) || ((CoreBlock *)o)->owner != s->owner || ((CoreBlock *)o)->state != state) {
        PyErr_Format(s->error, "%R is not %s by %R", o, state == BLOCK_PENDING ? "held" : "allocated", s->owner);
        return -1;
    }
    return 0;
}

static PyObject *
steps_malloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long pool;
    int flags, rc;
    if (nargs != 4 || !PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[2])
        || !PyLong_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "malloc(nbytes, stream, pool, flags) takes four ints");
        return NULL;
    }
    if ((pool = PyLong_AsUnsignedLongLong(args[2])) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if ((flags = (int)PyLong_AsLong(args[3])) == -1 && PyErr_Occurred())
        return NULL;
    PyObject *block = step_malloc((CoreSteps *)self, args[0], args[1], pool, flags, &rc);
    return block != NULL || PyErr_Occurred() ? block : PyLong_FromLong(rc);
}

static PyObject *
steps_free(PyObject *self, PyObject *block)
{
    CoreSteps *s = (CoreSteps *)self;
    if (check_block(s, block, BLOCK_ALLOCATED) < 0 || step_free(s, (CoreBlock *)block) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
steps_free_plain(PyObject *self, PyObject *block)
{
    int r = Py_IS_TYPE(block, &CoreBlock_T) ? step_free_plain((CoreSteps *)self, (CoreBlock *)block) : 0;
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
steps_hold(PyObject *self, PyObject *block)
{
    CoreSteps *s = (CoreSteps *)self;
    if (check_block(s, block, BLOCK_ALLOCATED) < 0)
        return NULL;
    CoreBlock *b = (CoreBlock *)block;
    if (step_live(s, b) < 0)
        return NULL;
    if (s->hold(s->core, b->address) != 0) {
        step_broken(s, b);
        return NULL;
    }
    b->state = BLOCK_PENDING;
    Py_RETURN_NONE;
}

static PyObject *
steps_release(PyObject *self, PyObject *block)
{
    CoreSteps *s = (CoreSteps *)self;
    if (check_block(s, block, BLOCK_PENDING) < 0 || step_claim(s, (CoreBlock *)block) < 0)
        return NULL;
    CoreBlock *b = (CoreBlock *)block;
    b->state = BLOCK_RETIRED;
    if (s->release_held(s->core, b->address) != 0) {
        step_broken(s, b);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int
steps_traverse(PyObject *self, visitproc visit, void *arg)
{
    CoreSteps *s = (CoreSteps *)self;
    Py_VISIT(s->owner);
    Py_VISIT(s->live);
    Py_VISIT(s->known);
    Py_VISIT(s->error);
    return 0;
}

static int
steps_clear(PyObject *self)
{
    CoreSteps *s = (CoreSteps *)self;
    Py_CLEAR(s->owner);
    Py_CLEAR(s->live);
    Py_CLEAR(s->known);
    Py_CLEAR(s->error);
    return 0;
}

static void
steps_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    steps_clear(self);
    Py_TYPE(self)->tp_free(self);
}

/* CoreSteps(owner, core, live, known, entry_points, error) */
static PyObject *
steps_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *owner, *core, *live, *known, *entries, *error;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "CoreSteps takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O:CoreSteps", &owner, &PyLong_Type, &core, &PyDict_Type, &live, &PySet_Type,
                          &known, &PyTuple_Type, &entries, &error))
        return NULL;
    void *at[5] = {PyLong_AsVoidPtr(core)};
    for (Py_ssize_t i = 0; i < 4 && !PyErr_Occurred(); i++)
        at[i + 1] = PyTuple_GET_SIZE(entries) == 4 ? PyLong_AsVoidPtr(PyTuple_GET_ITEM(entries, i)) : NULL;
    if (PyErr_Occurred())
        return NULL;
    if (at[0] == NULL || at[1] == NULL || at[2] == NULL || at[3] == NULL || at[4] == NULL
        || !PyType_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "CoreSteps: a core's address, the addresses of accel_core_malloc, _free, "
                                         "_hold and _release_held, and an exception class");
        return NULL;
    }
    CoreSteps *s = (CoreSteps *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->core = at[0];
    s->malloc = (core_malloc_fn)at[1];
    s->free = (core_ptr_fn)at[2];
    s->hold = (core_ptr_fn)at[3];
    s->release_held = (core_ptr_fn)at[4];
    Py_INCREF(owner);
    s->owner = owner;
    Py_INCREF(live);
    s->live = live;
    Py_INCREF(known);
    s->known = known;
    Py_INCREF(error);
    s->error = error;
    return (PyObject *)s;
}

static PyMethodDef steps_methods[] = {
    {"malloc", (PyCFunction)(void (*)(void))steps_malloc, METH_FASTCALL,
     "malloc(nbytes, stream, pool, flags): the block's CoreBlock, in _live; or the core's refusal (an int)."},
    {"free", steps_free, METH_O, "free(block): out of _live, RETIRED, back into the core."},
    {"free_plain", steps_free_plain, METH_O,
     "free_plain(block): free it if it is an allocated block used on its own stream only; True if freed."},
    {"hold", steps_hold, METH_O, "hold(block): PENDING, held in the core (it stays in _live)."},
    {"release", steps_release, METH_O, "release(block): a held block out of _live, RETIRED, reusable by the core."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreSteps_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups.CoreSteps",
    .tp_basicsize = sizeof(CoreSteps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = steps_traverse,
    .tp_clear = steps_clear,
    .tp_dealloc = steps_dealloc,
    .tp_new = steps_new,
    .tp_methods = steps_methods,
    .tp_doc = "A DeviceAllocator's core steps: the core's books and the blocks' handles changed together.",
};

/* -- the caching allocator's lock (accel/allocator/_fork.py) ------------------------------
 *
 * OwnedLock: a lock that knows the thread holding it (``owner``, 0 when free), so that a
 * blocking acquire on that thread (a garbage-collection callback or finalizer run inside
 * the allocator's call) is refused with NotSupportedError instead of waiting forever. In C
 * because only here is the lock taken or let go together with its owner: Python code
 * between the two is where Ctrl-C's KeyboardInterrupt lands (a signal's handler runs
 * between bytecodes), and it left the lock held for good (every later call on the thread
 * refused, or every call waiting forever once owner was 0). ``with lock:`` is whole too:
 * __enter__ and __exit__ are each one C call. */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;
    PyObject *what; /* names the lock's user in the refusal */
} OwnedLock;

static PyObject *
ownedlock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"what", NULL};
    PyObject *what;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "U:OwnedLock", names, &what))
        return NULL;
    OwnedLock *self = (OwnedLock *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if ((self->lock = PyThread_allocate_lock()) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(what);
    self->what = what;
    return (PyObject *)self;
}

static void
ownedlock_dealloc(PyObject *o)
{
    OwnedLock *self = (OwnedLock *)o;
    if (self->lock != NULL) {
        if (self->owner != 0) /* freeing a held lock is undefined */
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_XDECREF(self->what);
    Py_TYPE(o)->tp_free(o);
}

static int64_t
monotonic_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* The lock, waiting at most ``us`` microseconds (-1: for ever) with the GIL released, the
 * signal handlers run meanwhile (an interrupt raises before the lock is taken): 1 taken,
 * 0 timed out, -1 with the handler's error. */
static int
ownedlock_wait(OwnedLock *self, int64_t us)
{
    int64_t deadline = us < 0 ? -1 : monotonic_us() + us;
    for (;;) {
        PyLockStatus r;
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(self->lock, (PY_TIMEOUT_T)us, 1);
        Py_END_ALLOW_THREADS
        if (r != PY_LOCK_INTR)
            return r == PY_LOCK_ACQUIRED;
        if (Py_MakePendingCalls() < 0)
            return -1;
        if (deadline >= 0 && (us = deadline - monotonic_us()) < 0)
            us = 0;
    }
}

/* The lock taken (True), or not when not blocking or timed out (False). */
static PyObject *
ownedlock_take(OwnedLock *self, int blocking, double timeout)
{
    if (!PyThread_acquire_lock(self->lock, 0)) {
        if (!blocking)
            Py_RETURN_FALSE;
        /* owner is this thread's ident only while this thread holds the lock; a thread
         * acting for another (accel's upstream thread runs the main thread's upstream
         * calls while that waits: caller_ident in accel/allocator/_fork.py) is that one */
        unsigned long caller = PyThread_get_thread_ident();
        if (timeout < 0 && self->owner != 0) {
            PyObject *fork = PyImport_ImportModule("accel.allocator._fork");
            PyObject *ident = fork == NULL ? NULL : PyObject_CallMethod(fork, "caller_ident", NULL);
            Py_XDECREF(fork);
            if (ident == NULL)
                return NULL;
            caller = PyLong_AsUnsignedLong(ident);
            Py_DECREF(ident);
            if (caller == (unsigned long)-1 && PyErr_Occurred())
                return NULL;
        }
        if (timeout < 0 && self->owner == caller) {
            PyObject *errors = PyImport_ImportModule("accel._errors");
            PyObject *error = errors == NULL ? NULL : PyObject_GetAttrString(errors, "NotSupportedError");
            Py_XDECREF(errors);
            if (error != NULL) {
                PyErr_Format(error,
                             "%U was called again on a thread that is already inside it (a garbage-collection "
                             "callback or finalizer run in the middle of its call), where it would wait for itself "
                             "forever: allocate or query from such a callback only outside accel calls, or defer "
                             "the work to later",
                             self->what);
                Py_DECREF(error);
            }
            return NULL;
        }
        int got = ownedlock_wait(self, timeout < 0 ? -1 : (int64_t)(timeout * 1e6));
        if (got <= 0)
            return got < 0 ? NULL : Py_NewRef(Py_False);
    }
    self->owner = PyThread_get_thread_ident();
    Py_RETURN_TRUE;
}

/* acquire(blocking=True, timeout=-1) */
static PyObject *
ownedlock_acquire(PyObject *o, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    return ownedlock_take((OwnedLock *)o, blocking, timeout);
}

static PyObject *
ownedlock_release(PyObject *o, PyObject *unused)
{
    OwnedLock *self = (OwnedLock *)o;
    if (self->owner == 0) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    self->owner = 0;
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

/* call_if_free(fn, *args): fn(*args) holding the lock when it is free now, the lock given
 * back however fn ends: True when it ran, False when the lock was held (fn not called).
 * One call: ``if lock.acquire(False): try:`` has a point between the two where an
 * interrupt lands with the lock taken. */
static PyObject *
ownedlock_call_if_free(PyObject *o, PyObject *const *args, Py_ssize_t nargs)
{
    OwnedLock *self = (OwnedLock *)o;
    if (nargs < 1 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "call_if_free(fn, *args) takes a callable");
        return NULL;
    }
    if (!PyThread_acquire_lock(self->lock, 0))
        Py_RETURN_FALSE;
    self->owner = PyThread_get_thread_ident();
    PyObject *r = PyObject_Vectorcall(args[0], args + 1, (size_t)(nargs - 1), NULL);
    self->owner = 0;
    PyThread_release_lock(self->lock);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_TRUE;
}

static PyObject *
ownedlock_enter(PyObject *o, PyObject *unused)
{
    return ownedlock_take((OwnedLock *)o, 1, -1);
}

static PyObject *
ownedlock_exit(PyObject *o, PyObject *args)
{
    return ownedlock_release(o, NULL);
}

static PyObject *
ownedlock_repr(PyObject *o)
{
    OwnedLock *self = (OwnedLock *)o;
    return PyUnicode_FromFormat("<OwnedLock of %U, %s>", self->what, self->owner ? "held" : "free");
}

static PyMethodDef ownedlock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))ownedlock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): take the lock; a blocking acquire on the thread that holds it raises "
     "NotSupportedError."},
    {"release", ownedlock_release, METH_NOARGS, "Let go of the lock."},
    {"call_if_free", (PyCFunction)(void (*)(void))ownedlock_call_if_free, METH_FASTCALL,
     "call_if_free(fn, *args): fn(*args) holding the lock if it is free now (given back however fn ends); "
     "True when fn ran, False when the lock was held."},
    {"__enter__", ownedlock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", ownedlock_exit, METH_VARARGS, "release()"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ownedlock_members[] = {
    {"owner", T_ULONG, offsetof(OwnedLock, owner), READONLY, "The ident of the thread holding the lock, 0 when free."},
    {"what", T_OBJECT_EX, offsetof(OwnedLock, what), READONLY, "What the lock guards (named in the refusal)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject OwnedLock_T = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "accel._speedups.OwnedLock",
    .tp_basicsize = sizeof(OwnedLock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ownedlock_new,
    .tp_dealloc = ownedlock_dealloc,
    .tp_repr = ownedlock_repr,
    .tp_methods = ownedlock_methods,
    .tp_members = ownedlock_members,
    .tp_doc = "OwnedLock(what): a lock that knows the thread holding it (accel/allocator/_fork.py).",
};

/* -- the common pair ------------------------------------------------------------------
 *
 * While a DeviceAllocator's ``_plain`` is True (no capture, history,
 * pending events, queued finalizer frees; see DeviceAllocator._plain), its malloc and free
 * are the core steps above and take no lock: the compiled allocate and Buffer.free/__del__
 * take them here. Every other case, and a core refusal, goes to DeviceAllocator's methods
 * by name: the core stays the only place blocks are found, split and counted. */

static PyObject *s_plain, *s_steps, *s_closed, *s_handle, *s_malloc_refused;

/* allocator._steps while allocator._plain is True, a new reference; NULL without an error
 * otherwise. */
static CoreSteps *
plain_steps(PyObject *allocator)
{
    if (!attr_is(allocator, s_plain, Py_True))
        return NULL;
    PyObject *steps = PyObject_GetAttr(allocator, s_steps);
    if (steps == NULL || !Py_IS_TYPE(steps, &CoreSteps_T)) {
        PyErr_Clear();
        Py_XDECREF(steps);
        return NULL;
    }
    return (CoreSteps *)steps;
}

/* DeviceAllocator.malloc(nbytes, stream) in the common case: a new reference to the
 * block's handle (a CoreBlock), NULL with an error, or NULL without one where it is not
 * the common case (nothing changed: the caller calls malloc). ``stream`` is the runtime's
 * current stream of the allocator's device (so of its device and backend). */
static PyObject *
plain_malloc(PyObject *allocator, PyObject *nbytes, PyObject *stream)
{
    if (!PyLong_CheckExact(nbytes))
        return NULL;
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(nbytes, &overflow);
    if (overflow || n < 1 || n >= CORE_MAX_REQUEST) /* malloc says what is wrong */
        return NULL;
    PyObject *closed = PyObject_GetAttr(stream, s_closed);
    if (closed != Py_False) { /* closed (malloc refuses it), or unreadable */
        Py_XDECREF(closed);
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(closed);
    CoreSteps *steps = plain_steps(allocator);
    PyObject *handle = steps == NULL ? NULL : PyObject_GetAttr(stream, s_handle);
    if (handle == NULL || !PyLong_CheckExact(handle)) {
        Py_XDECREF(steps);
        Py_XDECREF(handle);
        PyErr_Clear();
        return NULL;
    }
    int rc;
    PyObject *block = step_malloc(steps, nbytes, handle, 0, CORE_NO_RETRY, &rc);
    Py_DECREF(steps);
    Py_DECREF(handle);
    if (block == NULL && rc != 0) { /* the refusal's steps are DeviceAllocator's (give the cache back, raise) */
        PyObject *rargs[4] = {allocator, PyLong_FromLong(rc), nbytes, stream};
        if (rargs[1] == NULL)
            return NULL;
        block = PyObject_VectorcallMethod(s_malloc_refused, rargs, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(rargs[1]);
    }
    else if (block != NULL) {
        /* The block is live and its handle noted in _known (step_malloc): a close of the
         * stream meanwhile is seen here (DeviceAllocator._closed_meanwhile). */
        PyObject *closed = PyObject_GetAttr(stream, s_closed);
        if (closed != Py_False) { /* closed meanwhile (or unreadable): the locked path's steps */
            Py_XDECREF(closed);
            PyErr_Clear();
            PyObject *rargs[5] = {allocator, PyLong_FromLong(0), nbytes, stream, block};
            PyObject *got = rargs[1] == NULL ? NULL
                            : PyObject_VectorcallMethod(s_malloc_refused, rargs, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_XDECREF(rargs[1]);
            Py_SETREF(block, got);
        }
        else
            Py_DECREF(closed);
    }
    return block;
}

/* DeviceAllocator.free(block) in the common case (step_free_plain):
 * 1 freed, -1 with an error, 0 not the common case (nothing changed: the caller calls
 * the allocator's method). */
static int
plain_free(PyObject *allocator, PyObject *block)
{
    if (!Py_IS_TYPE(block, &CoreBlock_T))
        return 0;
    CoreSteps *steps = plain_steps(allocator);
    if (steps == NULL)
        return 0;
    int r = step_free_plain(steps, (CoreBlock *)block);
    Py_DECREF(steps);
    return r;
}

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
    int freed = plain_free(allocator, block);
    if (freed != 0) {
        if (freed < 0)
            return NULL;
        Py_RETURN_NONE;
    }
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
    block = PyObject_GetAttr(self, s_block);
    if (block == Py_None) { /* freed: the common case, after free() */
        Py_DECREF(block);
        Py_RETURN_NONE;
    }
    Py_XDECREF(block);
    PyErr_Clear();
    if (buffer_slots(self, &block, &lease, &allocator) < 0)
        return call_wrapped(wrapped, args, nargs, kwnames); /* __init__ never ran: the Python method */
    if (lease != Py_None)
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

/* The current stream of the current device and its allocator, when they exist already and
 * no MemPool is in use (allocate's common case): 1 with new references in *stream and
 * *allocator (and the runtime in *runtime), 0 without an error where it is not that case,
 * -1 with an error. */
static int
current_allocator(PyObject **runtime_out, PyObject **stream_out, PyObject **allocator_out)
{
    PyObject *runtime = global(runtime_globals, s_runtime_g), *open = global(mempool_globals, s_open);
    if (runtime == NULL || runtime == Py_None || open == NULL || !PyLong_CheckExact(open) || PyLong_AsLong(open) != 0)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(runtime);
    PyObject *state = NULL, *index = NULL, *streams = NULL, *defaults = NULL, *exts = NULL, *allocators = NULL,
             *found, *stream, *allocator;
    int r = -1;
    /* state is a threading.local: its attributes are the thread's */
    if ((state = PyObject_GetAttr(runtime, s_state)) == NULL || (index = PyObject_GetAttr(state, s_buffer_device)) == NULL)
        goto out;
    r = 0;
    stream = dict_attr_get(state, s_streams, index, &streams);
    if (stream == NULL) {
        if (PyErr_Occurred() || (stream = dict_attr_get(runtime, s_default_streams, index, &defaults)) == NULL)
            goto out;
    }
    found = dict_attr_get(runtime, s_extensions, EXTENSION, &exts);
    if (found == NULL || found == Py_None)
        goto out;
    allocator = dict_attr_get(found, s_allocators, index, &allocators);
    if (allocator == NULL || allocator == Py_None)
        goto out;
    Py_INCREF(stream);
    Py_INCREF(allocator);
    Py_INCREF(runtime);
    *stream_out = stream;
    *allocator_out = allocator;
    *runtime_out = runtime;
    r = 1;
out:
    if (PyErr_Occurred())
        r = -1;
    Py_DECREF(runtime);
    Py_XDECREF(state);
    Py_XDECREF(index);
    Py_XDECREF(streams);
    Py_XDECREF(defaults);
    Py_XDECREF(exts);
    Py_XDECREF(allocators);
    return r;
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
    PyObject *runtime, *stream, *allocator, *result = NULL;
    int found = current_allocator(&runtime, &stream, &allocator);
    if (found <= 0)
        return found < 0 ? NULL : call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *block = plain_malloc(allocator, args[0], stream);
    if (block == NULL && !PyErr_Occurred()) {
        PyObject *margs[3] = {allocator, args[0], stream};
        block = PyObject_VectorcallMethod(s_malloc, margs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
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
    Py_DECREF(runtime);
    Py_DECREF(stream);
    Py_DECREF(allocator);
    return result;
}

/* -- accel.empty on the host (accel/_interop/torch.py) -------------------------------------
 *
 * Its common case (a shape of ints, a dtype seen before, the current device and stream, no
 * MemPool, a host backend, a plain allocator): the block from the core step, handed to
 * torch as a DLPack capsule (DLPack's public, versioned C ABI: the legacy "dltensor"
 * DLManagedTensor, which every torch accel supports reads) that holds the block's handle,
 * with no Buffer between them. torch calls the deleter when the tensor's storage dies,
 * wherever that is: another thread, one without the GIL (it takes it), a garbage
 * collection (the allocator's finalizer path). During interpreter exit it calls nothing:
 * the memory goes with the process. */

typedef struct {
    int32_t device_type, device_id;
} DLDevice;

typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;

#define EMPTY_MAX_DIMS 64
static PyObject *empty_dtypes;    /* accel._interop.torch._dtypes */
static PyObject *torch_from_dlpack; /* torch.from_dlpack, once torch is imported */
static PyObject *s_float32, *s_dtype_kw, *s_backend, *s_torch_device_type, *s_cpu;

/* A block of a tensor torch let go of goes back as a finalizer's free does. */
static void
empty_deleter(DLManagedTensor *mt)
{
    PyObject *block = mt->manager_ctx;
    if (Py_IsInitialized()) { /* not during interpreter exit (its threads may be gone) */
        PyGILState_STATE gil = PyGILState_Ensure();
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* torch may let go while an exception unwinds */
        PyObject *owner = ((CoreBlock *)block)->owner;
        int freed = plain_free(owner, block);
        if (freed == 0) {
            PyObject *fargs[2] = {owner, block};
            PyObject *r = PyObject_VectorcallMethod(s_free_from_finalizer, fargs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            freed = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        if (freed < 0)
            PyErr_WriteUnraisable(block);
        Py_DECREF(block);
        PyErr_Restore(type, value, tb);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(mt);
}

/* A capsule torch never consumed (it refused it) lets go of the block itself. */
static void
empty_capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
        mt->deleter(mt);
    }
}

/* ``shape`` as dims (an int, or a tuple of ints, each in [0, 2**63)) whose elements of
 * ``itemsize`` bytes fit a core request: the number of dims, and *nbytes (at least one
 * item: a tensor with no elements is accel memory too); -1 where it is not that case. */
static int
empty_shape(PyObject *shape, int64_t itemsize, int64_t *dims, int64_t *nbytes)
{
    int ndim;
    if (PyLong_CheckExact(shape)) {
        ndim = 1;
        dims[0] = PyLong_AsLongLong(shape);
    }
    else if (PyTuple_CheckExact(shape) && PyTuple_GET_SIZE(shape) <= EMPTY_MAX_DIMS) {
        ndim = (int)PyTuple_GET_SIZE(shape);
        for (int i = 0; i < ndim; i++) {
            PyObject *d = PyTuple_GET_ITEM(shape, i);
            dims[i] = PyLong_CheckExact(d) ? PyLong_AsLongLong(d) : -1;
        }
    }
    else
        return -1;
    /* a dim past int64 left an OverflowError: cleared before any return, an overflowing
     * product of the dims before it included (the Python path says what is wrong) */
    PyErr_Clear();
    int64_t n = itemsize, nonzero = 1;
    for (int i = 0; i < ndim; i++) {
        if (dims[i] < 0) /* negative, or past int64 */
            return -1;
        if (dims[i] && __builtin_mul_overflow(nonzero, dims[i], &nonzero))
            return -1;
        n = dims[i] == 0 ? 0 : n;
    }
    if (n && __builtin_mul_overflow(nonzero, itemsize, &n))
        return -1;
    *nbytes = n ? n : itemsize;
    return *nbytes < CORE_MAX_REQUEST ? ndim : -1;
}

/* empty(shape, *, dtype="float32", device=None, stream=None) */
static PyObject *
host_empty(PyObject *wrapped, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *dtype = s_float32;
    if (nargs != 1)
        return call_wrapped(wrapped, args, nargs, kwnames);
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_Compare(name, s_dtype_kw) == 0)
            dtype = args[nargs + i];
        else if ((PyUnicode_Compare(name, s_device_kw) != 0 && PyUnicode_Compare(name, s_stream_kw) != 0)
                 || args[nargs + i] != Py_None)
            return call_wrapped(wrapped, args, nargs, kwnames);
    }
    /* (torch dtype, name, itemsize, DLPack code, bits), cached by the Python path */
    PyObject *entry = PyDict_GetItemWithError(empty_dtypes, dtype);
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) {
        PyErr_Clear(); /* an unhashable dtype: the Python path says so */
        return call_wrapped(wrapped, args, nargs, kwnames);
    }
    long itemsize = PyLong_AsLong(PyTuple_GET_ITEM(entry, 2)), code = PyLong_AsLong(PyTuple_GET_ITEM(entry, 3)),
         bits = PyLong_AsLong(PyTuple_GET_ITEM(entry, 4));
    if (PyErr_Occurred())
        return NULL;
    if (torch_from_dlpack == NULL) { /* torch was imported: the Python path resolved the dtype */
        PyObject *torch = PyImport_ImportModule("torch");
        torch_from_dlpack = torch == NULL ? NULL : PyObject_GetAttrString(torch, "from_dlpack");
        Py_XDECREF(torch);
        if (torch_from_dlpack == NULL)
            return NULL;
    }
    int64_t dims[EMPTY_MAX_DIMS], nbytes;
    int ndim = empty_shape(args[0], itemsize, dims, &nbytes);
    if (ndim < 0)
        return call_wrapped(wrapped, args, nargs, kwnames);
    PyObject *runtime, *stream, *allocator, *backend = NULL, *kind = NULL, *size = NULL, *block = NULL, *result = NULL;
    int found = current_allocator(&runtime, &stream, &allocator);
    if (found <= 0)
        return found < 0 ? NULL : call_wrapped(wrapped, args, nargs, kwnames);
    if ((backend = PyObject_GetAttr(runtime, s_backend)) == NULL
        || (kind = PyObject_GetAttr(backend, s_torch_device_type)) == NULL || (size = PyLong_FromLongLong(nbytes)) == NULL)
        goto out;
    if (!PyUnicode_Check(kind) || PyUnicode_Compare(kind, s_cpu) != 0
        || (block = plain_malloc(allocator, size, stream)) == NULL) {
        if (!PyErr_Occurred()) /* not the common case: nothing was allocated */
            result = call_wrapped(wrapped, args, nargs, kwnames);
        goto out;
    }
    DLManagedTensor *mt = PyMem_RawMalloc(sizeof(DLManagedTensor) + 2 * (size_t)ndim * sizeof(int64_t));
    if (mt == NULL) {
        PyErr_NoMemory();
        if (plain_free(allocator, block) == 0) /* the allocator stopped being plain: its own free */
            Py_XDECREF(PyObject_CallMethodOneArg(allocator, s_free_from_finalizer, block));
        goto out;
    }
    int64_t *shape = (int64_t *)(mt + 1), *strides = shape + ndim, stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        shape[i] = dims[i];
        strides[i] = stride;
        stride *= dims[i] ? dims[i] : 1; /* a zero counts as one, as in torch's contiguous strides */
    }
    mt->dl_tensor.data = (void *)(uintptr_t)((CoreBlock *)block)->address;
    mt->dl_tensor.device = (DLDevice){1, 0}; /* kDLCPU */
    mt->dl_tensor.ndim = ndim;
    mt->dl_tensor.dtype = (DLDataType){(uint8_t)code, (uint8_t)bits, 1};
    mt->dl_tensor.shape = shape;
    mt->dl_tensor.strides = strides;
    mt->dl_tensor.byte_offset = 0;
    mt->manager_ctx = block; /* the capsule, then torch, owns the reference */
    mt->deleter = empty_deleter;
    block = NULL;
    PyObject *capsule = PyCapsule_New(mt, "dltensor", empty_capsule_destructor);
    if (capsule == NULL) {
        mt->deleter(mt);
        goto out;
    }
    result = PyObject_CallOneArg(torch_from_dlpack, capsule);
    Py_DECREF(capsule);
out:
    Py_XDECREF(block);
    Py_XDECREF(size);
    Py_XDECREF(kind);
    Py_XDECREF(backend);
    Py_DECREF(runtime);
    Py_DECREF(stream);
    Py_DECREF(allocator);
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
        || intern(&s_stream, "_stream") || intern(&s_lease, "_lease") || intern(&s_plain, "_plain")
        || intern(&s_steps, "_steps") || intern(&s_closed, "_closed") || intern(&s_handle, "_handle")
        || intern(&s_malloc_refused, "_malloc_refused"))
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

/* install_empty(module): the compiled empty of accel._interop.torch (put in its globals),
 * after install_buffers. */
static PyObject *
install_empty(PyObject *module, PyObject *torch_module)
{
    if (!buffers_installed) {
        PyErr_SetString(PyExc_RuntimeError, "install_empty needs install_buffers first");
        return NULL;
    }
    if (empty_dtypes != NULL)
        Py_RETURN_NONE;
    PyObject *globals = PyModule_GetDict(torch_module);
    if (globals == NULL)
        return NULL;
    PyObject *py_empty = PyDict_GetItemString(globals, "empty"), *dtypes = PyDict_GetItemString(globals, "_dtypes");
    if (py_empty == NULL || !PyFunction_Check(py_empty) || dtypes == NULL || !PyDict_CheckExact(dtypes)) {
        PyErr_SetString(PyExc_TypeError, "the module has no Python function empty and dict _dtypes");
        return NULL;
    }
    if (intern(&s_float32, "float32") || intern(&s_dtype_kw, "dtype") || intern(&s_backend, "backend")
        || intern(&s_torch_device_type, "torch_device_type") || intern(&s_cpu, "cpu"))
        return NULL;
    PyObject *c = make_compiled(host_empty, py_empty);
    if (c == NULL || PyDict_SetItemString(globals, "empty", c) < 0) {
        Py_XDECREF(c);
        return NULL;
    }
    Py_DECREF(c);
    Py_INCREF(dtypes);
    empty_dtypes = dtypes;
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
    PyObject *failed;  /* raises an error of run() as an accel error (Engine.failed); None: as it is */
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

/* The pending exception, normalized, with its traceback attached (a new reference;
 * the error indicator is cleared). */
static PyObject *
take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* NULL, with the error run() raised (pending) handed to c->failed as the Python call does
 * (an Exception only: an interrupt stays as it is). Only a failing run comes here. */
static PyObject *
run_failed(SteadyCall *c)
{
    if (c->failed == Py_None || !PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;
    PyObject *value = take_exception();
    PyObject *r = PyObject_CallOneArg(c->failed, value); /* raises: NULL */
    Py_XDECREF(value);
    if (r != NULL) { /* it returned: not as Engine.failed does; refuse rather than return a value */
        Py_DECREF(r);
        PyErr_SetString(PyExc_SystemError, "SteadyCall: failed returned instead of raising");
    }
    return NULL;
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
         * and no run is under way: test and set ``busy`` with the GIL held throughout (the
         * Python call, _taking_call, takes the binding's lock for every call handed to it
         * and waits out a run under way). Its slots are read and written as attributes:
         * member descriptors, which run no Python code. */
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
                return run_failed(c);
            }
            Py_DECREF(r);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
        if (r == NULL)
            return run_failed(c);
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
        return run_failed(c);
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
    Py_VISIT(c->failed);
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
    Py_CLEAR(c->failed);
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
                            "failed", NULL};
    PyObject *fallback, *inputs, *thread, *device, *dflt, *run, *finish, *binding, *failed = Py_None;
    int real;
    if (!graphs_installed) {
        PyErr_SetString(PyExc_RuntimeError, "accel._speedups.install_graphs() has not run");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOOOOOp|O:SteadyCall", names, &fallback, &PyList_Type, &inputs,
                                     &thread, &device, &dflt, &run, &finish, &binding, &real, &failed))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(run) || PyList_GET_SIZE(inputs) == 0
        || (binding != Py_None && !Py_IS_TYPE(binding, Binding_T)) || (failed != Py_None && !PyCallable_Check(failed))) {
        PyErr_SetString(PyExc_TypeError, "SteadyCall: fallback and run must be callable, inputs a list of tensors, "
                                         "binding a _Binding or None, failed callable or None");
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
    Py_INCREF(failed);
    c->failed = failed;
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

/* GraphedCallable's base (the only implementation of its call's head: see the comment
 * above GraphedCallable in accel/graph/_graphed.py): a call tries ``_hot`` first (the last
 * compiled call's bound call), then self._call.
 * Not in grad mode: there self._call decides whether autograd would record (and refuses).
 * Only on the thread that made the callable (``_owner``), holding ``_lock`` (a threading.RLock,
 * whose acquire lets go of the GIL while it waits), and reading ``_hot`` again under it: another
 * thread's call writes the same static inputs and outputs. */
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
            PyObject *value = take_exception();
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
    .tp_doc = "GraphedCallable's base: the head of its __call__ (see accel/graph/_graphed.py).",
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
    /* index: any dict key (a device index, an int: hashed and compared in C) */
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
    {"install_buffers", install_buffers, METH_O,
     "Replace Buffer.free, Buffer.__del__ and the buffer module's allocate by compiled versions."},
    {"install_empty", install_empty, METH_O, "Replace accel._interop.torch's empty by a compiled version."},
    {"install_graphs", install_graphs, METH_O, "Give SteadyCall what it reads (torch.Tensor, check_memory, _Binding)."},
    {"set_current", (PyCFunction)(void (*)(void))set_current, METH_FASTCALL,
     "streams[index] = stream (None: pop), SteadyCalls told first: a thread's current stream changed."},
    {NULL, NULL, 0, NULL},
};

/* The module runs with the GIL, and says so (Py_mod_gil, Python 3.13+: a free-threaded
 * interpreter turns the GIL back on when it imports it, with a RuntimeWarning, instead of
 * running this code unlocked). What relies on it:
 *  - a SteadyCall's caches (the list it hands the runner, the addresses check_memory last
 *    passed, the thread and stream count on which the default stream was last found
 *    current) and a taking call's test and set of its binding's ``busy`` are each made
 *    with no other thread running Python in between (accel/graph/_compiled.py gives a taking engine no SteadyCall where
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
    if (PyType_Ready(&Compiled_T) < 0 || PyType_Ready(&SteadyCall_T) < 0 || PyType_Ready(&CallHead_T) < 0
        || PyType_Ready(&CoreBlock_T) < 0 || PyType_Ready(&CoreSteps_T) < 0 || PyType_Ready(&OwnedLock_T) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "SteadyCall", (PyObject *)&SteadyCall_T) < 0
        || PyModule_AddObjectRef(m, "CoreBlock", (PyObject *)&CoreBlock_T) < 0
        || PyModule_AddObjectRef(m, "CoreSteps", (PyObject *)&CoreSteps_T) < 0
        || PyModule_AddObjectRef(m, "OwnedLock", (PyObject *)&OwnedLock_T) < 0
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
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "accel._speedups",
    "The C implementation of accel's hot paths (see accel/_native.py).", 0, module_methods, module_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module);
}
