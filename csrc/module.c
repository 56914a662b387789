/* fastpin._C: the CPython bindings of the core.
 *
 * Types: Arena (an fp_arena_t) and Block (an fp_lease_t: one allocated
 * block, exported to torch through DLPack and to NumPy through its C API).
 * Every call that may wait (arena lock, event, memcpy) runs with the GIL
 * released; the core never touches Python and reports through an int status
 * that fp_raise() turns into an exception. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#include <numpy/arrayobject.h>
#include <limits.h>

#include "dlpack.h"
#include "fastpin.h"
#include "module.h"

static struct PyModuleDef fp_module;

fp_state *fp_state_of_type(PyTypeObject *type)
{
    return PyType_GetModuleState(type);
}

/* Raises the exception for a core status and returns NULL. */
PyObject *fp_raise(fp_state *st, int status)
{
    const char *msg = fp_error_message();
    switch (status) {
    case FP_ENOMEM:
    case FP_ETOOBIG:
        PyErr_SetString(st->ArenaFullError, msg);
        break;
    case FP_ECUDA:
        PyErr_SetString(st->CudaError, msg);
        break;
    case FP_EOS:
        PyErr_SetString(PyExc_OSError, msg);
        break;
    case FP_EINVAL:
        PyErr_SetString(PyExc_ValueError, msg);
        break;
    default:
        PyErr_SetString(st->Error, msg);
    }
    return NULL;
}

/* The copy pool of this process, made on first use; under the GIL. */
fp_copier_t *fp_get_copier(fp_state *st)
{
    /* In a forked child the parent's pool has no threads: leave it (its
     * mutexes may be held by threads that no longer exist) and start anew. */
    if (st->copier && !fp_same_process(st->copier_pid)) {
        st->copier = NULL;
        st->busy = 0;
    }
    /* A new size takes effect once no run is in flight: runs hold the pool
     * with the GIL released. Joining idle threads is quick. */
    if (st->copier && st->resize && st->busy == 0) {
        fp_copier_destroy(st->copier);
        st->copier = NULL;
    }
    if (!st->copier) {
        int status = fp_copier_create(&st->copier, st->threads);
        if (status) {
            st->copier = NULL;
            fp_raise(st, status);
            return NULL;
        }
        st->copier_pid = fp_pid();
        st->resize = 0;
        fp_copier_set_streaming(st->copier, !st->no_streaming);
        /* set_affinity checked the list against this process's CPUs; should
         * a new pool's threads be refused them now, they run unpinned. */
        if (st->ncpus)
            (void)fp_copier_set_affinity(st->copier, st->cpus, st->ncpus);
    }
    return st->copier;
}

/* ---- argument checks ------------------------------------------------- */

/* Reads `obj` (an int, or anything with __index__) into `out` if it lies in
 * [lo, hi]; else raises, naming the argument and what it may be, with the value
 * as given (PyArg's "K" would wrap -5 to 2**64 - 5 without a word). */
static int fp_u64_arg(PyObject *obj, const char *name, uint64_t lo, uint64_t hi,
                      const char *allowed, uint64_t *out)
{
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an integer, %s, not %.100s %R", name, allowed,
                     Py_TYPE(obj)->tp_name, obj);
        return -1;
    }
    PyObject *index = PyNumber_Index(obj);
    if (!index)
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    unsigned long long u = 0;
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(index);
        return -1;
    }
    int ok;
    if (overflow > 0) {
        u = PyLong_AsUnsignedLongLong(index);
        ok = !(u == (unsigned long long)-1 && PyErr_Occurred());
        PyErr_Clear();
    } else {
        ok = overflow == 0 && v >= 0;
        u = (unsigned long long)v;
    }
    if (!ok || u < lo || u > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be %s, not %R", name, allowed, index);
        Py_DECREF(index);
        return -1;
    }
    Py_DECREF(index);
    *out = u;
    return 0;
}

/* Reads a copy's (dst, src, nbytes) for `what`: each an address or size >= 0
 * (not wrapped, as "K" would), and neither range running past the end of the
 * address space. */
static int fp_span_args(PyObject *dst_obj, PyObject *src_obj, PyObject *size_obj,
                        const char *what, uint64_t *dst, uint64_t *src, uint64_t *size)
{
    char name[64];
    PyOS_snprintf(name, sizeof name, "%s: dst", what);
    if (fp_u64_arg(dst_obj, name, 0, UINTPTR_MAX, "an address >= 0", dst))
        return -1;
    PyOS_snprintf(name, sizeof name, "%s: src", what);
    if (fp_u64_arg(src_obj, name, 0, UINTPTR_MAX, "an address >= 0", src))
        return -1;
    PyOS_snprintf(name, sizeof name, "%s: nbytes", what);
    if (fp_u64_arg(size_obj, name, 0, UINT64_MAX, "a number of bytes >= 0", size))
        return -1;
    if (*size > UINTPTR_MAX - *dst || *size > UINTPTR_MAX - *src) {
        PyErr_Format(PyExc_ValueError, "%s: %llu bytes from address %llu to %llu run past the "
                     "end of the address space", what, (unsigned long long)*size,
                     (unsigned long long)*src, (unsigned long long)*dst);
        return -1;
    }
    return 0;
}

/* ---- Block ------------------------------------------------------------- */

/* Returns a new reference to a Block that steals `lease`'s reference. */
PyObject *Block_wrap(fp_state *st, fp_lease_t *lease)
{
    BlockObject *self = PyObject_New(BlockObject, st->BlockType);
    if (!self) {
        fp_lease_decref(lease);
        return NULL;
    }
    self->lease = lease;
    return (PyObject *)self;
}

static void Block_dealloc(BlockObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    fp_lease_decref(self->lease);
    PyObject_Free(self);
    Py_DECREF(type);
}

/* Reads a sequence of ints into `out`; returns its length or -1. */
static int fp_int64_seq(PyObject *seq, int64_t *out, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > FP_DLPACK_MAX_NDIM) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: %zd dimensions (at most %d)", what, n,
                     FP_DLPACK_MAX_NDIM);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return (int)n;
}

/* Checks that `ndim` dims of `shape` x `strides` (in units of `unit` bytes)
 * at `offset`, `itemsize` bytes an element, lie inside the block, and that the
 * element count fits an int64 (torch and NumPy refuse more, torch only after
 * it has called the capsule's deleter: a double free once the capsule dies).
 * Nothing is exported until this passes. No arithmetic here can wrap: every
 * term is bounded by the block's size before it is scaled. */
static int fp_check_extent(fp_lease_t *lease, uint64_t offset, int ndim,
                           const int64_t *shape, const int64_t *strides,
                           int64_t unit, int64_t itemsize)
{
    int64_t numel = 1;
    int empty = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || strides[i] < 0) {
            PyErr_Format(PyExc_ValueError, "negative shape or stride (dimension %d: shape %lld, "
                         "stride %lld)", i, (long long)shape[i], (long long)strides[i]);
            return -1;
        }
        if (__builtin_mul_overflow(numel, shape[i], &numel)) {
            PyErr_Format(PyExc_ValueError, "a shape whose element count overflows int64 "
                         "(dimension %d of %lld)", i, (long long)shape[i]);
            return -1;
        }
        empty |= shape[i] == 0;
    }
    if (empty)
        return 0;
    unsigned __int128 size = lease->size, last = 0;
    for (int i = 0; i < ndim; i++) {
        /* < 2**63 x < 2**63: no wrap; past the block means refused. */
        unsigned __int128 span = (unsigned __int128)(shape[i] - 1) * (uint64_t)strides[i];
        if (span > size || span * (uint64_t)unit > size)
            goto too_big;
        last += span * (uint64_t)unit;
        if (last > size)
            goto too_big;
    }
    if ((unsigned __int128)offset + last + (uint64_t)itemsize <= size)
        return 0;
too_big:
    PyErr_Format(PyExc_ValueError, "a view at offset %llu with this shape and these strides "
                 "(%lld-byte elements) does not fit a block of %llu bytes",
                 (unsigned long long)offset, (long long)itemsize,
                 (unsigned long long)lease->size);
    return -1;
}

/* Block.dlpack(offset, shape, strides, code, bits, lanes=1, version=-1,
 * readonly=False) -> new capsule over part of the block. */
static PyObject *Block_dlpack(BlockObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"offset", "shape", "strides", "code", "bits", "lanes",
                             "version", "readonly", NULL};
    PyObject *offset_obj, *shape_obj, *strides_obj;
    unsigned char code, bits;
    int lanes = 1, minor = -1, readonly = 0;
    uint64_t offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOObb|iip:dlpack", kwlist, &offset_obj,
                                     &shape_obj, &strides_obj, &code, &bits, &lanes,
                                     &minor, &readonly))
        return NULL;
    if (fp_u64_arg(offset_obj, "dlpack: offset", 0, UINT64_MAX, "a byte offset >= 0", &offset))
        return NULL;
    if (lanes < 1 || lanes > UINT16_MAX)
        return PyErr_Format(PyExc_ValueError, "dlpack: lanes must be 1 to 65535, not %d", lanes);
    int64_t shape[FP_DLPACK_MAX_NDIM], strides[FP_DLPACK_MAX_NDIM];
    int ndim = fp_int64_seq(shape_obj, shape, "shape");
    if (ndim < 0)
        return NULL;
    int nstrides = fp_int64_seq(strides_obj, strides, "strides");
    if (nstrides < 0)
        return NULL;
    if (nstrides != ndim)
        return PyErr_Format(PyExc_ValueError, "%d strides for %d dimensions", nstrides, ndim);
    if (minor < -1 || minor > FP_DLPACK_MINOR)
        return PyErr_Format(PyExc_ValueError, "DLPack version 1.%d is not produced (1.0 to 1.%d, "
                            "or -1 for a legacy capsule)", minor, FP_DLPACK_MINOR);
    int64_t itemsize = ((int64_t)bits * lanes + 7) / 8;
    if (fp_check_extent(self->lease, offset, ndim, shape, strides, itemsize, itemsize))
        return NULL;
    DLDataType dtype = {.code = code, .bits = bits, .lanes = (uint16_t)lanes};
    return fp_dlpack_capsule(self->lease, self->lease->ptr + offset, ndim, shape, strides,
                             dtype, minor, readonly);
}

/* Block.numpy(offset, shape, strides, dtype) -> new ndarray over part of the
 * block (strides in bytes, as NumPy's), whose base is this Block. */
static PyObject *Block_numpy(BlockObject *self, PyObject *args)
{
    PyObject *offset_obj, *shape_obj, *strides_obj;
    PyArray_Descr *descr;
    uint64_t offset;
    if (!PyArg_ParseTuple(args, "OOOO&:numpy", &offset_obj, &shape_obj, &strides_obj,
                          PyArray_DescrConverter, &descr))
        return NULL;
    if (fp_u64_arg(offset_obj, "numpy: offset", 0, UINT64_MAX, "a byte offset >= 0", &offset)) {
        Py_DECREF(descr);
        return NULL;
    }
    if (PyDataType_REFCHK(descr)) {
        /* Object references cannot live in raw block memory. */
        PyErr_Format(PyExc_TypeError, "a block cannot hold arrays of dtype %R", descr);
        Py_DECREF(descr);
        return NULL;
    }
    int64_t shape[FP_DLPACK_MAX_NDIM], strides[FP_DLPACK_MAX_NDIM];
    int ndim = fp_int64_seq(shape_obj, shape, "shape");
    int nstrides = ndim < 0 ? -1 : fp_int64_seq(strides_obj, strides, "strides");
    if (nstrides < 0 || nstrides != ndim ||
        fp_check_extent(self->lease, offset, ndim, shape, strides, 1,
                        (int64_t)PyDataType_ELSIZE(descr))) {
        if (nstrides >= 0 && nstrides != ndim)
            PyErr_Format(PyExc_ValueError, "%d strides for %d dimensions", nstrides, ndim);
        Py_DECREF(descr);
        return NULL;
    }
    return fp_block_array((PyObject *)self, descr, ndim, shape, strides, offset);
}

PyObject *fp_block_array(PyObject *block, PyArray_Descr *descr, int ndim, const int64_t *shape,
                         const int64_t *strides, uint64_t offset)
{
    npy_intp dims[FP_DLPACK_MAX_NDIM], npstrides[FP_DLPACK_MAX_NDIM];
    for (int i = 0; i < ndim; i++) {
        dims[i] = (npy_intp)shape[i];
        if (strides)
            npstrides[i] = (npy_intp)strides[i];
    }
    /* Steals the reference to descr. */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims,
                                         strides ? npstrides : NULL,
                                         ((BlockObject *)block)->lease->ptr + offset,
                                         NPY_ARRAY_WRITEABLE, NULL);
    if (!arr)
        return NULL;
    Py_INCREF(block);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, block) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* The array API's __dlpack__: the whole block as a 1-D uint8 tensor. */
static PyObject *Block___dlpack__(BlockObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy))
        return NULL;
    if (stream != Py_None && !(PyLong_Check(stream) && PyLong_AsLong(stream) == -1))
        return PyErr_Format(PyExc_BufferError,
                            "a host block takes no stream (got %R)", stream);
    if (dl_device != Py_None) {
        int type, id;
        if (!PyArg_ParseTuple(dl_device, "ii", &type, &id))
            return NULL;
        if (type != kDLCPU)
            return PyErr_Format(PyExc_BufferError,
                                "a fastpin block lives on the host (kDLCPU), not device type %d",
                                type);
    }
    if (copy == Py_True)
        return PyErr_Format(PyExc_BufferError, "fastpin blocks are exported without copying");
    int minor = -1;
    if (max_version != Py_None) {
        unsigned int major, want_minor;
        if (!PyArg_ParseTuple(max_version, "II", &major, &want_minor))
            return NULL;
        if (major >= FP_DLPACK_MAJOR)
            minor = major > FP_DLPACK_MAJOR || want_minor >= FP_DLPACK_MINOR ? FP_DLPACK_MINOR
                                                                               : (int)want_minor;
    }
    int64_t shape = (int64_t)self->lease->size, stride = 1;
    DLDataType u8 = {.code = kDLUInt, .bits = 8, .lanes = 1};
    return fp_dlpack_capsule(self->lease, self->lease->ptr, 1, &shape, &stride, u8, minor, 0);
}

static PyObject *Block___dlpack_device__(BlockObject *self, PyObject *Py_UNUSED(ignored))
{
    (void)self;
    return Py_BuildValue("(ii)", kDLCPU, 0);
}

static PyObject *Block_get_ptr(BlockObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromVoidPtr(self->lease->ptr);
}

static PyObject *Block_get_nbytes(BlockObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(self->lease->size);
}

static PyObject *Block_get_index(BlockObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLong(self->lease->block);
}

/* Block.detach(): give the block up for another process (or this one) to
 * adopt by (index, nbytes); freeing this Block no longer frees the block. */
static PyObject *Block_detach(BlockObject *self, PyObject *Py_UNUSED(ignored))
{
    int status = fp_lease_detach(self->lease);
    if (status)
        return fp_raise(fp_state_of_type(Py_TYPE(self)), status);
    Py_RETURN_NONE;
}

/* What must finish before the block is reused: "any" (every stream of the
 * arena's device: the default, and what a user may see), an int handle of
 * the one stream fastpin's own copies read it on (0: the legacy default
 * stream), or None when no GPU reads it. Returns a new reference. */
static PyObject *Block_get_consumer(BlockObject *self, void *Py_UNUSED(c))
{
    fp_cu_stream_t s = self->lease->consumer;
    if (!s)
        Py_RETURN_NONE;
    if (s == FP_STREAM_ANY)
        return PyUnicode_FromString("any");
    return PyLong_FromVoidPtr(s == FP_CU_STREAM_LEGACY ? NULL : (void *)s);
}

static int Block_set_consumer(BlockObject *self, PyObject *value, void *Py_UNUSED(c))
{
    if (!value || value == Py_None) {
        self->lease->consumer = NULL;
        return 0;
    }
    fp_cu_stream_t stream;
    if (PyUnicode_Check(value)) {
        if (PyUnicode_CompareWithASCIIString(value, "any") != 0) {
            PyErr_Format(PyExc_ValueError,
                         "consumer_stream must be 'any', a stream handle (int) or None, not %R",
                         value);
            return -1;
        }
        stream = FP_STREAM_ANY;
    } else {
        void *s = PyLong_AsVoidPtr(value);
        if (!s && PyErr_Occurred())
            return -1;
        stream = s ? (fp_cu_stream_t)s : FP_CU_STREAM_LEGACY;
    }
    if (!fp_arena_registered(self->lease->arena))
        return 0; /* nothing to wait for without CUDA */
    self->lease->consumer = stream;
    return 0;
}

static PyMethodDef Block_methods[] = {
    {"dlpack", (PyCFunction)(void (*)(void))Block_dlpack, METH_VARARGS | METH_KEYWORDS,
     "dlpack(offset, shape, strides, code, bits, lanes=1, version=-1, readonly=False)\n"
     "A DLPack capsule over part of the block (strides in elements)."},
    {"numpy", (PyCFunction)Block_numpy, METH_VARARGS,
     "numpy(offset, shape, strides, dtype)\nAn ndarray over part of the block "
     "(strides in bytes)."},
    {"__dlpack__", (PyCFunction)(void (*)(void))Block___dlpack__,
     METH_VARARGS | METH_KEYWORDS, "The whole block as a 1-D uint8 DLPack capsule."},
    {"__dlpack_device__", (PyCFunction)Block___dlpack_device__, METH_NOARGS, NULL},
    {"detach", (PyCFunction)Block_detach, METH_NOARGS,
     "detach()\nGive the block up for adoption (Arena.adopt(index, nbytes)), in the process\n"
     "that allocated it: dropping this Block then leaves the block allocated."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Block_getset[] = {
    {"ptr", (getter)Block_get_ptr, NULL, "address of the first byte", NULL},
    {"nbytes", (getter)Block_get_nbytes, NULL, "bytes asked for", NULL},
    {"index", (getter)Block_get_index, NULL, "descriptor index in the arena", NULL},
    {"consumer_stream", (getter)Block_get_consumer, (setter)Block_set_consumer,
     "what the block's free event covers: 'any' stream of its device, one stream "
     "handle, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Block_slots[] = {
    {Py_tp_dealloc, Block_dealloc},
    {Py_tp_methods, Block_methods},
    {Py_tp_getset, Block_getset},
    {Py_tp_doc, "One block of an Arena. Freed (after the GPU is done with it) when the\n"
                "Block and every tensor or array made from it are gone."},
    {0, NULL},
};

static PyType_Spec Block_spec = {
    .name = "fastpin._C.Block",
    .basicsize = sizeof(BlockObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Block_slots,
};

/* ---- Arena ------------------------------------------------------------- */

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

static PyObject *Arena_alloc(ArenaObject *self, PyObject *arg)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    uint64_t size;
    if (fp_u64_arg(arg, "alloc: nbytes", 0, UINT64_MAX, "a number of bytes >= 0", &size))
        return NULL;
    fp_lease_t *lease;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_lease_alloc(self->arena, size, &lease);
    Py_END_ALLOW_THREADS
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

int fp_pin_copies(fp_state *st, fp_arena_t *arena, fp_copy_t *copies,
                  const uint64_t *offsets, Py_ssize_t n, uint64_t total, fp_lease_t **lease)
{
    *lease = NULL;
    fp_copier_t *copier = fp_get_copier(st);
    if (!copier)
        return -1;
    int status;
    st->busy++;
    Py_BEGIN_ALLOW_THREADS
    status = fp_lease_alloc(arena, total, lease);
    if (!status) {
        size_t used = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (copies[i].src && copies[i].size) {
                copies[used] = copies[i];
                copies[used++].dst = (*lease)->ptr + offsets[i];
            }
        status = fp_copier_run(copier, copies, used);
    }
    Py_END_ALLOW_THREADS
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
    if (fp_pin_copies(st, self->arena, copies, offsets, n, total, &lease))
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
     "pin_batch(leaves, check_pinned) -> list | None\n"
     "A batch's leaves, plain torch tensors and NumPy arrays that one memcpy each\n"
     "copies, into one block (each at a GRANULE-aligned offset): the pinned views,\n"
     "in order (counted in pin_counts()). None: a leaf needs the Python pipeline\n"
     "(another type, a gather, autograd, torch not yet registered by use_torch);\n"
     "nothing was allocated. With check_pinned, pinned tensors come back as they are."},
    {"pin_tree", (PyCFunction)(void (*)(void))Arena_pin_tree, METH_FASTCALL,
     "pin_tree(data, check_pinned) -> pinned data | NotImplemented\n"
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

static PyType_Spec Arena_spec = {
    .name = "fastpin._C.Arena",
    .basicsize = sizeof(ArenaObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Arena_slots,
};

/* ---- module functions -------------------------------------------------- */

static PyObject *fp_cuda_status(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    int state;
    Py_BEGIN_ALLOW_THREADS
    state = fp_cuda_load();
    Py_END_ALLOW_THREADS
    static const char *names[] = {"no_driver", "no_device", "ready"};
    return Py_BuildValue("{sssssisiss}", "state", names[state], "reason", fp_cuda.reason,
                         "driver_version", fp_cuda.driver_version, "device_count",
                         fp_cuda.device_count, "fence",
                         state == FP_CUDA_READY ? fp_cuda_fence_kind() : NULL);
}

/* The rwlock may be held by a free for one driver call: wait without the GIL. */
static PyObject *fp_capture_begin_py(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    Py_BEGIN_ALLOW_THREADS
    fp_cuda_capture_begin();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *fp_capture_end_py(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    Py_BEGIN_ALLOW_THREADS
    fp_cuda_capture_end();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *fp_captures_py(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = fp_cuda_captures();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *fp_set_threads(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > 1024)
        return PyErr_Format(PyExc_ValueError, "threads must be 0 (default) to 1024, not %ld", n);
    st->threads = (int)n;
    st->resize = 1;
    Py_RETURN_NONE;
}

/* set_affinity(cpus): pin the copy pool's threads to these CPUs (a sequence of
 * ints; None or empty: give them the caller's affinity back). Applies to the
 * running pool at once and to every pool made later in this process. */
static PyObject *fp_set_affinity(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    int *cpus = NULL;
    Py_ssize_t n = 0;
    if (arg != Py_None) {
        PyObject *fast = PySequence_Fast(arg, "set_affinity() takes a sequence of CPU numbers");
        if (!fast)
            return NULL;
        n = PySequence_Fast_GET_SIZE(fast);
        cpus = PyMem_Calloc((size_t)n + 1, sizeof *cpus);
        if (!cpus) {
            Py_DECREF(fast);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            long c = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
            if ((c == -1 && PyErr_Occurred()) || c < 0 || c >= FP_COPIER_MAX_CPU) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "no CPU %ld (0 to %d)", c,
                                 FP_COPIER_MAX_CPU - 1);
                Py_DECREF(fast);
                PyMem_Free(cpus);
                return NULL;
            }
            cpus[i] = (int)c;
        }
        Py_DECREF(fast);
    }
    fp_copier_t *copier = fp_get_copier(st);
    if (!copier) {
        PyMem_Free(cpus);
        return NULL;
    }
    int status = fp_copier_set_affinity(copier, cpus, (size_t)n);
    if (status) {
        PyMem_Free(cpus);
        return fp_raise(st, status);
    }
    PyMem_Free(st->cpus);
    st->cpus = n ? cpus : NULL;
    st->ncpus = (size_t)n;
    if (!n)
        PyMem_Free(cpus);
    Py_RETURN_NONE;
}

/* pci_bus_id(device) -> "dddd:bb:dd.f", the PCI address of a CUDA device, as
 * the driver says it (no context is made). */
static PyObject *fp_pci_bus_id(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    long ordinal = PyLong_AsLong(arg);
    if (ordinal == -1 && PyErr_Occurred())
        return NULL;
    char bus_id[64] = {0};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fp_cuda_pci_bus_id(ordinal < INT_MIN || ordinal > INT_MAX ? -1 : (int)ordinal,
                                bus_id, (int)sizeof bus_id - 1);
    Py_END_ALLOW_THREADS
    if (status)
        return fp_raise(st, status);
    return PyUnicode_FromString(bus_id);
}

/* block_size(nbytes) -> the bytes of arena a request of `nbytes` takes. */
static PyObject *fp_block_size(PyObject *Py_UNUSED(module), PyObject *arg)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (n > FP_MAX_CAPACITY)
        return PyErr_Format(PyExc_ValueError, "%llu bytes is more than an arena can hold", n);
    return PyLong_FromUnsignedLongLong(fp_arena_round(n));
}

/* set_streaming(on): whether large runs of the copy pool use streaming stores
 * (see fp_copier_run); applies to the running pool from its next run. */
static PyObject *fp_set_streaming(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    st->no_streaming = !on;
    if (st->copier && fp_same_process(st->copier_pid))
        fp_copier_set_streaming(st->copier, on);
    Py_RETURN_NONE;
}

static PyObject *fp_get_streaming(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    fp_copier_t *copier = fp_get_copier(PyModule_GetState(module));
    return copier ? PyBool_FromLong(fp_copier_streams(copier)) : NULL;
}

static PyObject *fp_current_device(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    return PyLong_FromLong(fp_cuda_current_device());
}

static PyObject *fp_get_threads(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    fp_copier_t *copier = fp_get_copier(PyModule_GetState(module));
    return copier ? PyLong_FromLong(fp_copier_threads(copier)) : NULL;
}

static PyObject *fp_cpu_count_py(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    (void)module;
    return PyLong_FromLong(fp_cpu_count());
}

/* copy(dst, src, nbytes): memcpy between raw addresses on the copy pool, GIL
 * released. For benchmarks and tests; the caller vouches for the addresses. */
static PyObject *fp_copy(PyObject *module, PyObject *args)
{
    fp_state *st = PyModule_GetState(module);
    PyObject *dst_obj, *src_obj, *size_obj;
    uint64_t dst, src, size;
    if (!PyArg_ParseTuple(args, "OOO:copy", &dst_obj, &src_obj, &size_obj) ||
        fp_span_args(dst_obj, src_obj, size_obj, "copy", &dst, &src, &size))
        return NULL;
    fp_copier_t *copier = fp_get_copier(st);
    if (!copier)
        return NULL;
    fp_copy_t c = {.dst = (void *)(uintptr_t)dst, .src = (const void *)(uintptr_t)src,
                   .size = size};
    int status;
    st->busy++;
    Py_BEGIN_ALLOW_THREADS
    status = fp_copier_run(copier, &c, 1);
    Py_END_ALLOW_THREADS
    st->busy--;
    if (status)
        return fp_raise(st, status);
    Py_RETURN_NONE;
}

/* h2d(arena, stream, [(dst, src, nbytes, pinned), ...], chunk=0): queue
 * host-to-device copies on a CUDA stream (a raw handle), staging pageable
 * sources through `arena` in chunks. GIL released throughout. */
static PyObject *fp_h2d(PyObject *module, PyObject *args)
{
    fp_state *st = PyModule_GetState(module);
    PyObject *arena_obj, *items_obj;
    unsigned long long stream, chunk = 0;
    if (!PyArg_ParseTuple(args, "O!KO|K:h2d", st->ArenaType, &arena_obj, &stream, &items_obj,
                          &chunk))
        return NULL;
    fp_arena_t *arena = ((ArenaObject *)arena_obj)->arena;
    PyObject *fast = PySequence_Fast(items_obj, "h2d() takes a sequence of (dst, src, nbytes, pinned)");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    fp_h2d_t *items = PyMem_Calloc((size_t)n + 1, sizeof *items);
    PyObject *result = NULL;
    if (!items) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dst_obj, *src_obj, *size_obj;
        uint64_t dst, src, size;
        int pinned;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOOp:h2d", &dst_obj, &src_obj,
                              &size_obj, &pinned) ||
            fp_span_args(dst_obj, src_obj, size_obj, "h2d", &dst, &src, &size))
            goto done;
        items[i] = (fp_h2d_t){.dst = dst, .src = (const void *)(uintptr_t)src, .size = size,
                              .pinned = pinned};
    }
    fp_copier_t *copier = fp_get_copier(st);
    if (!copier)
        goto done;
    int status;
    st->busy++;
    Py_BEGIN_ALLOW_THREADS
    status = fp_stage_h2d(copier, arena, fp_arena_context(arena),
                          (fp_cu_stream_t)(uintptr_t)stream, items, (size_t)n, chunk);
    Py_END_ALLOW_THREADS
    st->busy--;
    if (status) {
        fp_raise(st, status);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(fast);
    PyMem_Free(items);
    return result;
}

static PyMethodDef fp_methods[] = {
    {"pin_counts", fp_pin_counts, METH_NOARGS,
     "pin_counts() -> (batches, leaves, bytes) that Arena.pin_batch placed in this process."},
    {"use_torch", fp_use_torch, METH_VARARGS,
     "use_torch(Tensor, api) -> bool\nLet pin_batch take torch tensors, through torch's\n"
     "DLPack C exchange API (the capsule Tensor.__dlpack_c_exchange_api__);\n"
     "False (and nothing changes) where that API is missing or of another major version."},
    {"h2d", fp_h2d, METH_VARARGS,
     "h2d(arena, stream, [(dst, src, nbytes, pinned), ...], chunk=0)\n"
     "Queue host-to-device copies on a CUDA stream, staging pageable sources through\n"
     "arena blocks of `chunk` bytes (0: 8 MiB, or a quarter of a smaller arena)."},
    {"cuda_status", fp_cuda_status, METH_NOARGS,
     "The CUDA driver's state: {'state': 'ready' | 'no_device' | 'no_driver', 'reason', ...}."},
    {"capture_begin", fp_capture_begin_py, METH_NOARGS,
     "A CUDA graph capture begins in this process: free fences wait until it ends."},
    {"capture_end", fp_capture_end_py, METH_NOARGS, "A capture announced by capture_begin ended."},
    {"captures", fp_captures_py, METH_NOARGS, "Captures under way (capture_begin not yet ended)."},
    {"set_threads", fp_set_threads, METH_O, "Size of the copy pool (0: the default)."},
    {"set_streaming", fp_set_streaming, METH_O,
     "Whether the copy pool's runs of 4 MiB or more use streaming stores (default: where "
     "the CPU has them)."},
    {"streaming", fp_get_streaming, METH_NOARGS,
     "Whether the copy pool's large runs use streaming stores."},
    {"get_threads", fp_get_threads, METH_NOARGS, "Size of the copy pool."},
    {"current_device", fp_current_device, METH_NOARGS,
     "The CUDA ordinal of the context current in this thread, or -1 (none, or no driver)."},
    {"block_size", fp_block_size, METH_O,
     "block_size(nbytes) -> int\nThe bytes of arena one request of `nbytes` takes (its size class):\n"
     "at most 1/16 more, for sizing an arena's capacity."},
    {"set_affinity", fp_set_affinity, METH_O,
     "set_affinity(cpus)\nPin the copy pool's threads to these CPUs (None: undo), now and\n"
     "for every pool made later in this process."},
    {"pci_bus_id", fp_pci_bus_id, METH_O,
     "pci_bus_id(device) -> str\nThe PCI address of a CUDA device, from the driver."},
    {"cpu_count", fp_cpu_count_py, METH_NOARGS, "CPUs this process may run on."},
    {"copy", fp_copy, METH_VARARGS, "copy(dst, src, nbytes) between raw addresses."},
    {NULL, NULL, 0, NULL},
};

/* ---- module ------------------------------------------------------------ */

static int fp_exec(PyObject *module)
{
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    fp_state *st = PyModule_GetState(module);
    st->ArenaType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Arena_spec, NULL);
    st->BlockType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Block_spec, NULL);
    if (!st->ArenaType || !st->BlockType)
        return -1;
    if (PyModule_AddType(module, st->ArenaType) < 0 || PyModule_AddType(module, st->BlockType) < 0)
        return -1;
    st->Error = PyErr_NewExceptionWithDoc("fastpin.FastpinError",
                                          "A failure inside fastpin's core.", PyExc_RuntimeError,
                                          NULL);
    if (!st->Error)
        return -1;
    st->CudaError = PyErr_NewExceptionWithDoc(
        "fastpin.CudaError", "A CUDA driver call failed; the message is the driver's.",
        st->Error, NULL);
    PyObject *bases = PyTuple_Pack(2, st->Error, PyExc_MemoryError);
    if (!st->CudaError || !bases)
        return -1;
    st->ArenaFullError = PyErr_NewExceptionWithDoc(
        "fastpin.ArenaFullError",
        "The arena has no room for a request, or the request exceeds its cap.", bases, NULL);
    Py_DECREF(bases);
    if (!st->ArenaFullError)
        return -1;
    if (PyModule_AddObjectRef(module, "FastpinError", st->Error) < 0 ||
        PyModule_AddObjectRef(module, "CudaError", st->CudaError) < 0 ||
        PyModule_AddObjectRef(module, "ArenaFullError", st->ArenaFullError) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "GRANULE", FP_GRANULE) < 0)
        return -1;
    PyObject *max_capacity = PyLong_FromUnsignedLongLong(FP_MAX_CAPACITY);
    if (!max_capacity)
        return -1;
    int added = PyModule_AddObjectRef(module, "MAX_CAPACITY", max_capacity);
    Py_DECREF(max_capacity);
    return added;
}

static int fp_traverse(PyObject *module, visitproc visit, void *arg)
{
    fp_state *st = PyModule_GetState(module);
    Py_VISIT(st->ArenaType);
    Py_VISIT(st->BlockType);
    Py_VISIT(st->Error);
    Py_VISIT(st->CudaError);
    Py_VISIT(st->ArenaFullError);
    Py_VISIT(st->TensorType);
    Py_VISIT(st->torch_api_obj);
    Py_VISIT(st->byte_dtypes[0]);
    for (int i = 0; i < FP_FLAGS; i++)
        Py_VISIT(st->flags[i]);
    Py_VISIT(st->byte_dtypes[1]);
    for (int i = 0; i < FP_NAMES; i++)
        Py_VISIT(st->names[i]);
    return 0;
}

static int fp_clear(PyObject *module)
{
    fp_state *st = PyModule_GetState(module);
    Py_CLEAR(st->ArenaType);
    Py_CLEAR(st->BlockType);
    Py_CLEAR(st->Error);
    Py_CLEAR(st->CudaError);
    Py_CLEAR(st->ArenaFullError);
    st->torch_api = NULL;
    Py_CLEAR(st->TensorType);
    Py_CLEAR(st->torch_api_obj);
    Py_CLEAR(st->byte_dtypes[0]);
    for (int i = 0; i < FP_FLAGS; i++)
        Py_CLEAR(st->flags[i]);
    Py_CLEAR(st->byte_dtypes[1]);
    for (int i = 0; i < FP_NAMES; i++)
        Py_CLEAR(st->names[i]);
    return 0;
}

static void fp_free(void *module)
{
    fp_state *st = PyModule_GetState(module);
    fp_clear(module);
    /* The module is freed only when no Python code runs, so no run is in
     * flight and the pool can be joined. */
    if (st->copier && fp_same_process(st->copier_pid) && st->busy == 0)
        fp_copier_destroy(st->copier);
    st->copier = NULL;
    PyMem_Free(st->cpus);
    st->cpus = NULL;
}

static PyModuleDef_Slot fp_slots[] = {
    {Py_mod_exec, fp_exec},
    {0, NULL},
};

static struct PyModuleDef fp_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastpin._C",
    .m_doc = "fastpin's C core: the pinned arena, the copy pool, DLPack export.",
    .m_size = sizeof(fp_state),
    .m_methods = fp_methods,
    .m_slots = fp_slots,
    .m_traverse = fp_traverse,
    .m_clear = fp_clear,
    .m_free = fp_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&fp_module); }
