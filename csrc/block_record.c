/* Block.unpack: a zero-copy batch made whole from its layout record in one
 * C call (fastpin/_zerocopy.py). The worker that collated the batch into the
 * block sent the record (format and parser: fastpin.h, record.c) and a tuple
 * of the objects it names; here every host view is made, as Arena.pin_tree
 * makes pin_memory's (torch tensors through torch's DLPack exchange API,
 * arrays through NumPy's C API), and the containers are rebuilt around them.
 * Nothing is made before fp_record_parse has checked the whole record
 * against the block. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "dlpack.h"
#include "fastpin.h"
#include "module.h"

typedef struct {
    fp_state *st;
    PyObject *block;            /* borrowed: the Block being unpacked */
    const fp_record_t *r;
    PyObject *const *objects;   /* borrowed from the caller's tuple */
    PyObject *ordinary;         /* borrowed callable for leaves not in the block, or NULL */
    PyObject *leaf;             /* borrowed: a callable for each view, a list of the
                                   leaves themselves, or NULL */
    PyObject *from_dlpack;      /* a reference to torch.from_dlpack, where torch has no
                                   exchange API; else NULL */
    size_t at;                  /* next node byte */
    uint32_t next_leaf;
    uint32_t next_object;
} fp_unpack_t;

/* The NumPy dtype of array leaf l: a new reference, or NULL. Only plain
 * numbers go by type number; everything else (structured, byte-swapped,
 * datetime, strings) came as a dtype object. Never one holding references:
 * the block is raw memory. */
static PyArray_Descr *fp_record_descr(fp_unpack_t *u, const fp_record_leaf_t *l)
{
    PyArray_Descr *descr;
    if (l->object == FP_RECORD_NONE) {
        int t = l->type;
        if (!(PyTypeNum_ISBOOL(t) || PyTypeNum_ISINTEGER(t) || PyTypeNum_ISFLOAT(t) ||
              PyTypeNum_ISCOMPLEX(t))) {
            PyErr_Format(PyExc_ValueError, "layout record: NumPy type number %d is not a "
                         "plain number type", t);
            return NULL;
        }
        if (!(descr = PyArray_DescrFromType(t)))
            return NULL;
    } else {
        PyObject *obj = u->objects[l->object];
        if (!PyArray_DescrCheck(obj)) {
            PyErr_Format(PyExc_ValueError, "layout record: an array's dtype object is a %.100s",
                         Py_TYPE(obj)->tp_name);
            return NULL;
        }
        descr = (PyArray_Descr *)Py_NewRef(obj);
    }
    if (PyDataType_REFCHK(descr) || (uint64_t)PyDataType_ELSIZE(descr) != l->itemsize) {
        PyErr_Format(PyExc_ValueError, "layout record: dtype %R for %u-byte elements of raw "
                     "memory", (PyObject *)descr, l->itemsize);
        Py_DECREF(descr);
        return NULL;
    }
    return descr;
}

/* The host view of leaf i over the block: a new reference, or NULL. */
static PyObject *fp_record_view(fp_unpack_t *u, uint32_t i)
{
    fp_state *st = u->st;
    fp_record_leaf_t l;
    fp_record_leaf(u->r, i, &l);
    fp_lease_t *lease = ((BlockObject *)u->block)->lease;
    PyObject *out;
    if (l.kind == FP_RECORD_ARRAY) {
        PyArray_Descr *descr = fp_record_descr(u, &l);
        if (!descr)
            return NULL;
        int64_t strides[FP_RECORD_MAX_NDIM];
        for (int k = 0; k < l.ndim; k++)
            strides[k] = l.strides[k] * (int64_t)l.itemsize; /* checked: no overflow */
        out = fp_block_array(u->block, descr, l.ndim, l.shape, strides, l.offset);
    } else {
        DLDataType dtype = {.code = l.code, .bits = l.bits, .lanes = l.type};
        void *data = lease->ptr + l.offset;
        if (u->from_dlpack) {
            PyObject *capsule = fp_dlpack_capsule(lease, data, l.ndim, l.shape, l.strides,
                                                  dtype, -1, 0);
            if (!capsule)
                return NULL;
            out = PyObject_CallOneArg(u->from_dlpack, capsule);
            Py_DECREF(capsule);
        } else {
            DLManagedTensorVersioned *t = fp_dlpack_managed(lease, data, l.ndim, l.shape,
                                                            l.strides, dtype);
            void *made = NULL;
            /* On failure torch owns t all the same (the API takes it). */
            if (!t || st->torch_api->managed_tensor_to_py_object_no_sync(t, &made))
                return NULL;
            out = made;
        }
        if (out && l.object != FP_RECORD_NONE) /* a dtype DLPack has no code for */
            Py_SETREF(out, PyObject_CallMethodOneArg(out, st->names[FP_NAME_VIEW],
                                                     u->objects[l.object]));
        if (out && (l.flags & FP_RECORD_REQUIRES_GRAD)) {
            PyObject *r = PyObject_CallMethodNoArgs(out, st->names[FP_NAME_REQUIRES_GRAD_]);
            if (!r)
                Py_CLEAR(out);
            Py_XDECREF(r);
        }
    }
    if (out && u->leaf)
        Py_SETREF(out, PyObject_CallOneArg(u->leaf, out));
    return out;
}

/* The node at u->at and what it holds: a new reference, or NULL. The record
 * is parsed: counts, kinds and indices are all in range. */
static PyObject *fp_unpack_node(fp_unpack_t *u)
{
    uint32_t n;
    int kind = fp_record_node(u->r, &u->at, &n);
    switch (kind) {
    case FP_RECORD_NODE_LEAF:
        if (u->leaf && PyList_Check(u->leaf)) { /* made by the caller (device views) */
            uint32_t i = u->next_leaf++;
            if ((Py_ssize_t)i >= PyList_GET_SIZE(u->leaf)) {
                PyErr_Format(PyExc_ValueError, "unpack: %zd leaves given for a record of %u",
                             PyList_GET_SIZE(u->leaf), u->r->nleaves);
                return NULL;
            }
            return Py_NewRef(PyList_GET_ITEM(u->leaf, i));
        }
        return fp_record_view(u, u->next_leaf++);
    case FP_RECORD_NODE_OBJECT:
        return Py_NewRef(u->objects[u->next_object++]);
    case FP_RECORD_NODE_ORDINARY: {
        PyObject *obj = u->objects[u->next_object++];
        return u->ordinary ? PyObject_CallOneArg(u->ordinary, obj) : Py_NewRef(obj);
    }
    case FP_RECORD_NODE_DICT: {
        PyObject *const *keys = u->objects + u->next_object;
        u->next_object += n;
        PyObject *dict = PyDict_New();
        for (uint32_t k = 0; dict && k < n; k++) {
            PyObject *value = fp_unpack_node(u);
            if (!value || PyDict_SetItem(dict, keys[k], value))
                Py_CLEAR(dict);
            Py_XDECREF(value);
        }
        return dict;
    }
    case FP_RECORD_NODE_LIST:
    case FP_RECORD_NODE_TUPLE: {
        int list = kind == FP_RECORD_NODE_LIST;
        PyObject *seq = list ? PyList_New(n) : PyTuple_New(n);
        for (uint32_t k = 0; seq && k < n; k++) {
            PyObject *item = fp_unpack_node(u);
            if (!item)
                Py_CLEAR(seq);
            else if (list)
                PyList_SET_ITEM(seq, k, item);
            else
                PyTuple_SET_ITEM(seq, k, item);
        }
        return seq;
    }
    }
    PyErr_SetString(PyExc_SystemError, "layout record: a node the parser let through");
    return NULL;
}

/* Block.unpack(record, objects, ordinary=None, leaf=None) -> the batch: its
 * structure with every leaf's host view over this block (leaf(view) where
 * `leaf` is a callable; where it is a list, its i-th item for leaf i, no view
 * made), the objects named by the record in their places and the leaves not
 * in the block as ordinary(x) (as they are without it). Returns a new
 * reference; ValueError for a record that does not describe this block. */
PyObject *Block_unpack(BlockObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    if (nargs < 2 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "unpack takes 2 to 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *record = args[0], *objects = args[1];
    PyObject *ordinary = nargs > 2 && args[2] != Py_None ? args[2] : NULL;
    PyObject *leaf = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    if (!PyBytes_Check(record) || !PyTuple_Check(objects)) {
        PyErr_Format(PyExc_TypeError, "unpack: a bytes record and a tuple of objects, not "
                     "%.100s and %.100s", Py_TYPE(record)->tp_name, Py_TYPE(objects)->tp_name);
        return NULL;
    }
    fp_record_t r;
    if (fp_record_parse(PyBytes_AS_STRING(record), (size_t)PyBytes_GET_SIZE(record),
                        self->lease->size, &r))
        return fp_raise(st, FP_EINVAL);
    if ((uint64_t)PyTuple_GET_SIZE(objects) != r.nobjects) {
        PyErr_Format(PyExc_ValueError, "layout record: it names %u objects, %zd were sent",
                     r.nobjects, PyTuple_GET_SIZE(objects));
        return NULL;
    }
    fp_unpack_t u = {.st = st, .block = (PyObject *)self, .r = &r,
                     .objects = &PyTuple_GET_ITEM(objects, 0), .ordinary = ordinary,
                     .leaf = leaf};
    if (leaf && PyList_Check(leaf) && PyList_GET_SIZE(leaf) != (Py_ssize_t)r.nleaves) {
        PyErr_Format(PyExc_ValueError, "unpack: %zd leaves given for a record of %u",
                     PyList_GET_SIZE(leaf), r.nleaves);
        return NULL;
    }
    if (r.nleaves && !st->torch_api && !(leaf && PyList_Check(leaf))) {
        /* No exchange API (or use_torch not called): torch.from_dlpack. */
        PyObject *torch = PyImport_ImportModule("torch");
        u.from_dlpack = torch ? PyObject_GetAttrString(torch, "from_dlpack") : NULL;
        Py_XDECREF(torch);
        if (!u.from_dlpack)
            return NULL;
    }
    PyObject *out = fp_unpack_node(&u);
    Py_XDECREF(u.from_dlpack);
    return out;
}
