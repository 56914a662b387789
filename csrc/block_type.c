/* fastpin._C.Block: one allocated block of an Arena (an fp_lease_t),
 * exported to torch through DLPack and to NumPy through its C API. Nothing is
 * exported before fp_check_extent has found the view inside the block. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "dlpack.h"
#include "fastpin.h"
#include "module.h"

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
    {"unpack", (PyCFunction)(void (*)(void))Block_unpack, METH_FASTCALL,
     "unpack(record, objects, ordinary=None, leaf=None)\nA zero-copy batch from its layout "
     "record: its structure, each leaf a view\nof this block (leaf(view) where given), the "
     "leaves not in it ordinary(x)."},
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

PyType_Spec Block_spec = {
    .name = "fastpin._C.Block",
    .basicsize = sizeof(BlockObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Block_slots,
};
