/* fastpin._C.Arena: one arena of the core (an fp_arena_t), its blocks handed
 * out as Blocks (block_type.c). Every call that may wait (the arena lock,
 * registration, the copy pool) runs with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "fastpin.h"
#include "module.h"

static PyObject *Arena_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"capacity", "shared", "device", "cuda", "max_blocks", "numa_node",
                             NULL};
    PyObject *capacity_obj, *max_blocks_obj = NULL;
    int shared = 0, device = 0, cuda = 1, numa_node = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$pipOi:Arena", kwlist, &capacity_obj,
                                     &shared, &device, &cuda, &max_blocks_obj, &numa_node))
        return NULL;
    uint64_t capacity, max_blocks = 0;
    if (fp_u64_arg(capacity_obj, "Arena: capacity", 1, FP_MAX_CAPACITY,
                   "a number of bytes from 1 to 8796093022208 (2**43)", &capacity) ||
        (max_blocks_obj && fp_u64_arg(max_blocks_obj, "Arena: max_blocks", 0, UINT32_MAX - 1,
                                      "0 (the default) to 4294967294", &max_blocks)))
        return NULL;
    if (device < 0)
        return PyErr_Format(PyExc_ValueError, "Arena: device must be a CUDA ordinal >= 0, not %d",
                            device);
    ArenaObject *self = (ArenaObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    int flags = (shared ? FP_ARENA_SHARED : 0) | (cuda ? 0 : FP_ARENA_NO_CUDA);
    int status;
    /* Registration page-locks the whole region: seconds for many GiB. */
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_create_numa(&self->arena, capacity, (uint32_t)max_blocks, flags, device,
                                  numa_node);
    Py_END_ALLOW_THREADS
    if (status) {
        Py_DECREF(self);
        return fp_raise(fp_state_of_type(type), status);
    }
    return (PyObject *)self;
}

/* Arena.attach(fd) -> new Arena over the shared arena behind memfd `fd`, made
 * by another process (or this one); never registered with CUDA here. */
static PyObject *Arena_attach(PyTypeObject *type, PyObject *arg)
{
    int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0)
        return NULL;
    ArenaObject *self = (ArenaObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_attach(&self->arena, fd);
    Py_END_ALLOW_THREADS
    if (status) {
        Py_DECREF(self);
        return fp_raise(fp_state_of_type(type), status);
    }
    return (PyObject *)self;
}

static void Arena_dealloc(ArenaObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->weakreflist)
        PyObject_ClearWeakRefs((PyObject *)self);
    fp_arena_t *arena = self->arena;
    /* The last reference unregisters the region and destroys up to one event
     * per descriptor: without the GIL. */
    if (arena) {
        Py_BEGIN_ALLOW_THREADS
        fp_arena_decref(arena);
        Py_END_ALLOW_THREADS
    }
    type->tp_free(self);
    Py_DECREF(type);
}

/* A block of `size` bytes of `arena`, taken with the GIL held (letting it go
 * and taking it back costs more than the allocator's bookkeeping, and another
 * thread may keep it meanwhile); let go only to wait where the GPU's copies
 * hold the room. 0, or a status (no exception set). */
static int fp_lease_take(fp_arena_t *arena, uint64_t size, fp_lease_t **lease)
{
    int status = fp_lease_try_alloc(arena, size, lease);
    if (status == FP_EBUSY) {
        Py_BEGIN_ALLOW_THREADS
        status = fp_lease_alloc(arena, size, lease);
        Py_END_ALLOW_THREADS
    }
    return status;
}

static PyObject *Arena_alloc(ArenaObject *self, PyObject *arg)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    uint64_t size;
    if (fp_u64_arg(arg, "alloc: nbytes", 0, UINT64_MAX, "a number of bytes >= 0", &size))
        return NULL;
    fp_lease_t *lease;
    int status = fp_lease_take(self->arena, size, &lease);
    if (status)
        return fp_raise(st, status);
    return Block_wrap(st, lease);
}

/* Reads pin()'s `n` sources from `fast` into `copies` (src and size) and
 * their `align`-aligned offsets in the block; *total is the block's size.
 * Returns 0, or -1 with an exception set. */
static int fp_pin_sources(fp_state *st, PyObject *fast, Py_ssize_t n, uint64_t align,
                          fp_copy_t *copies, uint64_t *offsets, uint64_t *total)
{
    *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *addr_obj, *size_obj;
        uint64_t addr, size;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OO:pin", &addr_obj, &size_obj) ||
            fp_u64_arg(addr_obj, "pin: a source's address", 0, UINTPTR_MAX, "an address >= 0",
                       &addr) ||
            fp_u64_arg(size_obj, "pin: a source's nbytes", 0, UINT64_MAX, "a number of bytes >= 0",
                       &size))
            return -1;
        /* Bounded before rounding, so nothing below wraps (2**64 - 1 would
         * round to a 0-byte block and then be copied in full). */
        if (size > FP_MAX_CAPACITY || *total + size > FP_MAX_CAPACITY) {
            PyErr_Format(st->ArenaFullError, "pin: %llu bytes (source %zd) and %llu before it: "
                         "more than any arena holds (2**43 bytes)", (unsigned long long)size,
                         i, (unsigned long long)*total);
            return -1;
        }
        if (addr && size > UINTPTR_MAX - addr) {
            PyErr_Format(PyExc_ValueError, "pin: source %zd at address %llu of %llu bytes runs "
                         "past the end of the address space", i, (unsigned long long)addr,
                         (unsigned long long)size);
            return -1;
        }
        offsets[i] = *total;
        copies[i].src = (const void *)(uintptr_t)addr;
        copies[i].size = size;
        *total += (size + align - 1) & ~(uint64_t)(align - 1);
    }
    return 0;
}

/* Returns a new reference to (block, offsets as a tuple of `n` ints). */
static PyObject *fp_pin_result(PyObject *block, const uint64_t *offsets, Py_ssize_t n)
{
    PyObject *offsets_obj = PyTuple_New(n);
    if (!offsets_obj)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(offsets[i]);
        if (!o) {
            Py_DECREF(offsets_obj);
            return NULL;
        }
        PyTuple_SET_ITEM(offsets_obj, i, o);
    }
    PyObject *result = PyTuple_Pack(2, block, offsets_obj);
    Py_DECREF(offsets_obj);
    return result;
}

int fp_pin_copies(fp_state *st, fp_arena_t *arena, fp_copy_t *copies, const uint64_t *offsets,
                  Py_ssize_t n, uint64_t total, unsigned team, fp_lease_t **lease)
{
    *lease = NULL;
    fp_copier_t *copier = team ? NULL : fp_get_copier(st);
    if (!team && !copier)
        return -1;
    st->busy++; /* the pool is kept as it is while the GIL may be let go */
    int status = fp_lease_take(arena, total, lease);
    if (!status) {
        size_t used = 0;
        uint64_t bytes = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (copies[i].src && copies[i].size) {
                copies[used] = copies[i];
                copies[used++].dst = (*lease)->ptr + offsets[i];
                bytes += copies[i].size;
            }
        PyThreadState *save = bytes >= FP_GIL_COPY_MIN ? PyEval_SaveThread() : NULL;
        if (team)
            fp_team_copy(&st->team, copies, used, team);
        else
            status = fp_copier_run(copier, copies, used);
        if (save)
            PyEval_RestoreThread(save);
    }
    st->busy--;
    if (status) {
        if (*lease)
            fp_lease_decref(*lease);
        *lease = NULL;
        fp_raise(st, status);
        return -1;
    }
    return 0;
}

/* Arena.pin(sources, align=GRANULE) -> (Block, offsets): one block holding
 * every source at `align`-aligned offsets (align=1 packs them back to back, as
 * a stacked batch), filled by the copy pool with the GIL released.
 * A source is (address, nbytes); address 0 only reserves room. The caller
 * keeps the sources alive for the call. */
static PyObject *Arena_pin(ArenaObject *self, PyObject *args)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    PyObject *arg;
    unsigned long long align = FP_GRANULE;
    if (!PyArg_ParseTuple(args, "O|K:pin", &arg, &align))
        return NULL;
    if (align == 0 || (align & (align - 1)) || align > FP_GRANULE)
        return PyErr_Format(PyExc_ValueError,
                            "align must be a power of two up to %u, not %llu", FP_GRANULE, align);
    PyObject *fast = PySequence_Fast(arg, "pin() takes a sequence of (address, nbytes)");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    fp_copy_t *copies = PyMem_Calloc((size_t)n + 1, sizeof *copies);
    uint64_t *offsets = PyMem_Calloc((size_t)n + 1, sizeof *offsets);
    PyObject *result = NULL, *block = NULL;
    uint64_t total;
    if (!copies || !offsets) {
        PyErr_NoMemory();
        goto done;
    }
    if (fp_pin_sources(st, fast, n, align, copies, offsets, &total) < 0)
        goto done;
    fp_lease_t *lease;
    if (fp_pin_copies(st, self->arena, copies, offsets, n, total, 0, &lease))
        goto done;
    block = Block_wrap(st, lease);
    if (block)
        result = fp_pin_result(block, offsets, n);
done:
    Py_XDECREF(block);
    Py_DECREF(fast);
    PyMem_Free(copies);
    PyMem_Free(offsets);
    return result;
}

/* Arena.adopt(index, nbytes) -> new Block over a block another process (or
 * this one) allocated and detached; this process frees it from then on. */
static PyObject *Arena_adopt(ArenaObject *self, PyObject *args)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    unsigned long long index, size;
    if (!PyArg_ParseTuple(args, "KK:adopt", &index, &size))
        return NULL;
    fp_lease_t *lease;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_lease_adopt(self->arena, index > UINT32_MAX ? UINT32_MAX : (uint32_t)index,
                            size, &lease);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(st, status);
    return Block_wrap(st, lease);
}

static PyObject *Arena_reclaim(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    uint32_t n;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_reclaim(self->arena, &n);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(fp_state_of_type(Py_TYPE(self)), status);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Arena_count_fallback(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    fp_arena_count_fallback(self->arena); /* lock-free */
    Py_RETURN_NONE;
}

static PyObject *Arena_prefault(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    int done;
    Py_BEGIN_ALLOW_THREADS
    done = fp_arena_prefault(self->arena);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *Arena_owner(ArenaObject *self, PyObject *arg)
{
    unsigned long long index = PyLong_AsUnsignedLongLong(arg);
    if (index == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pid_t owner = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_owner(self->arena, index > UINT32_MAX ? UINT32_MAX : (uint32_t)index,
                            &owner);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(fp_state_of_type(Py_TYPE(self)), status);
    return PyLong_FromLong((long)owner);
}

/* An Arena holds a mapping and a lock of this process: what crosses to a
 * worker is the fd, attached there. */
static PyObject *Arena___reduce__(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    return PyErr_Format(PyExc_TypeError,
                        "cannot pickle 'fastpin._C.Arena' object: pass its fd (Arena.fd) to "
                        "the other process and call Arena.attach(fd) there");
}

static PyObject *Arena_stats(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    fp_arena_stats_t s;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_stats(self->arena, &s);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(fp_state_of_type(Py_TYPE(self)), status);
    PyObject *classes = PyDict_New();
    if (!classes)
        return NULL;
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++) {
        if (!s.class_blocks[c])
            continue;
        /* Keyed by the class's block size, which users can read. */
        PyObject *k = PyLong_FromUnsignedLongLong(fp_arena_class_size(c));
        PyObject *v = PyLong_FromUnsignedLong(s.class_blocks[c]);
        int rc = k && v ? PyDict_SetItem(classes, k, v) : -1;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(classes);
            return NULL;
        }
    }
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsIsIsIsIsOsOsisN}", "capacity", s.capacity, "bytes_in_use",
        s.bytes_in_use, "bytes_requested", s.bytes_requested, "high_water", s.high_water,
        "bytes_pending", s.bytes_pending, "allocs", s.allocs, "failed", s.failed, "waits", s.waits,
        "fallbacks", s.fallbacks, "lock_recoveries", s.lock_recoveries, "reclaimed", s.reclaimed,
        "blocks_in_use", s.blocks_in_use, "blocks_pending", s.blocks_pending, "blocks_foreign",
        s.blocks_foreign, "max_blocks", s.max_blocks, "registered",
        s.registered ? Py_True : Py_False, "shared", s.shared ? Py_True : Py_False,
        "numa_node", s.numa_node, "class_blocks", classes);
}

static PyObject *Arena_collect(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    if (fp_arena_idle(self->arena))
        Py_RETURN_NONE; /* nothing to collect: not worth letting the GIL go */
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_arena_collect(self->arena);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(fp_state_of_type(Py_TYPE(self)), status);
    Py_RETURN_NONE;
}

static PyObject *Arena_is_valid(ArenaObject *self, PyObject *Py_UNUSED(ignored))
{
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = fp_arena_is_valid(self->arena);
    Py_END_ALLOW_THREADS
    if (!ok)
        return PyErr_Format(PyExc_AssertionError, "%s", fp_error_message());
    Py_RETURN_TRUE;
}

static PyObject *Arena_get_capacity(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(fp_arena_capacity(self->arena));
}

static PyObject *Arena_get_registered(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(fp_arena_registered(self->arena));
}

static PyObject *Arena_get_base(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromVoidPtr(fp_arena_base(self->arena));
}

static PyObject *Arena_get_fd(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLong(fp_arena_fd(self->arena));
}

static PyObject *Arena_get_token(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(fp_arena_token(self->arena));
}

static PyObject *Arena_get_device(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLong(fp_arena_device(self->arena));
}

static PyObject *Arena_get_attached(ArenaObject *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(fp_arena_attached(self->arena));
}

static PyMethodDef Arena_methods[] = {
    {"pin_batch", (PyCFunction)Arena_pin_batch, METH_VARARGS,
     "pin_batch(leaves, check_pinned, lo=1, hi=0) -> list | None\n"
     "A batch's leaves, plain torch tensors and NumPy arrays that one memcpy each\n"
     "copies, into one block (each at a GRANULE-aligned offset): the pinned views,\n"
     "in order (counted in pin_counts()). None: a leaf needs the Python pipeline\n"
     "(another type, a gather, autograd, torch not yet registered by use_torch);\n"
     "nothing was allocated. With check_pinned, pinned tensors come back as they are.\n"
     "A batch of lo to hi bytes of torch tensors alone is filled by torch's copy_\n"
     "(its intra-op threads) instead of the copy pool."},
    {"pin_tree", (PyCFunction)(void (*)(void))Arena_pin_tree, METH_FASTCALL,
     "pin_tree(data, check_pinned, lo=1, hi=0) -> pinned data | NotImplemented\n"
     "pin_batch for a whole batch: a leaf, or exact lists, tuples and dicts of\n"
     "leaves and of None, bool, int, float, str and bytes (nested up to 32 deep),\n"
     "rebuilt with the pinned views. NotImplemented: something in it needs the\n"
     "Python pipeline; nothing was allocated."},
    {"alloc", (PyCFunction)Arena_alloc, METH_O, "alloc(nbytes) -> Block"},
    {"pin", (PyCFunction)Arena_pin, METH_VARARGS,
     "pin([(address, nbytes), ...], align=GRANULE) -> (Block, offsets)\n"
     "Copy every source into one new block at align-aligned offsets\n"
     "(address 0 only reserves room)."},
    {"stats", (PyCFunction)Arena_stats, METH_NOARGS, "Counters of the arena, as a dict."},
    {"collect", (PyCFunction)Arena_collect, METH_NOARGS,
     "Return blocks whose GPU copies have finished to the free lists now."},
    {"is_valid", (PyCFunction)Arena_is_valid, METH_NOARGS,
     "Check every invariant of the allocator's metadata (for tests)."},
    {"attach", (PyCFunction)Arena_attach, METH_O | METH_CLASS,
     "attach(fd) -> Arena\nMap the shared arena behind memfd `fd` (made in another process);\n"
     "never registered with CUDA. The Arena keeps its own copy of the fd."},
    {"adopt", (PyCFunction)Arena_adopt, METH_VARARGS,
     "adopt(index, nbytes) -> Block\nIn the process that created the arena: take over a\n"
     "block another process allocated and detached. ValueError says why it cannot\n"
     "(freed, already adopted, still held, another size)."},
    {"reclaim", (PyCFunction)Arena_reclaim, METH_NOARGS,
     "reclaim() -> int\nFree the blocks held by processes that no longer exist (a child\n"
     "that has exited counts, reaped or not); returns how many."},
    {"count_fallback", (PyCFunction)Arena_count_fallback, METH_NOARGS,
     "Count one batch a worker could not place in the arena (stats()['fallbacks'])."},
    {"prefault", (PyCFunction)Arena_prefault, METH_NOARGS,
     "prefault() -> bool\nIn a process that attached: map every page now, when the creator's\n"
     "registration made them resident (nothing is allocated), instead of one page\n"
     "fault per page on first write. False: nothing to do, or the kernel cannot."},
    {"owner", (PyCFunction)Arena_owner, METH_O,
     "owner(index) -> int\nThe pid that allocated an allocated block, 0 once adopted."},
    {"__reduce__", (PyCFunction)Arena___reduce__, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Arena_getset[] = {
    {"capacity", (getter)Arena_get_capacity, NULL, "the cap, bytes", NULL},
    {"registered", (getter)Arena_get_registered, NULL, "page-locked with CUDA", NULL},
    {"base", (getter)Arena_get_base, NULL, "address of the data", NULL},
    {"fd", (getter)Arena_get_fd, NULL, "memfd of a shared arena, else -1", NULL},
    {"token", (getter)Arena_get_token, NULL,
     "random 64-bit name of the arena, the same in every process that maps it", NULL},
    {"attached", (getter)Arena_get_attached, NULL, "made by Arena.attach", NULL},
    {"device", (getter)Arena_get_device, NULL,
     "CUDA ordinal whose primary context the arena is registered in, -1 if none", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Heap types declare their weak-reference slot this way (3.9+). */
static PyMemberDef Arena_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ArenaObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Arena_slots[] = {
    {Py_tp_new, Arena_new},
    {Py_tp_members, Arena_members},
    {Py_tp_dealloc, Arena_dealloc},
    {Py_tp_methods, Arena_methods},
    {Py_tp_getset, Arena_getset},
    {Py_tp_doc, "Arena(capacity, *, shared=False, device=0, cuda=True, max_blocks=0, numa_node=-1)\n"
                "One region of host memory, page-locked with CUDA once when a GPU is present.\n"
                "numa_node >= 0: its pages prefer that NUMA node (stats()['numa_node'] says\n"
                "whether the kernel agreed).\n"
                "A shared arena (a memfd) is also mapped by other processes: Arena.attach(fd)."},
    {0, NULL},
};

PyType_Spec Arena_spec = {
    .name = "fastpin._C.Arena",
    .basicsize = sizeof(ArenaObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Arena_slots,
};
