/* pin_memory's fast path: a whole batch in one C call (fastpin/_pin.py).
 *
 * Arena.pin_batch(leaves) takes the leaves of one batch (flattened by the
 * Python layer) and, when every one is a plain torch tensor or NumPy array
 * that one memcpy copies, places them all in one block, each at a
 * GRANULE-aligned offset (the leaf pipeline's one rule, fastpin/_leaves.py),
 * copies them with the GIL released and gives back their views. torch tensors
 * are read and made through torch's DLPack C exchange API (no Python call
 * per conversion), arrays through NumPy's C API. A leaf this path does not
 * take (another type, a gather, autograd, a device tensor) makes the whole
 * call return None before anything is allocated, and the Python pipeline
 * does the batch: one block per batch either way, one set of rules. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "fastpin.h"
#include "module.h"

enum { FP_LEAF_TENSOR, FP_LEAF_ARRAY, FP_LEAF_KEEP };

typedef struct {
    PyObject *leaf;    /* borrowed: the caller's list holds it */
    int kind;          /* FP_LEAF_*: KEEP comes back as it is (pinned already) */
    int ndim;
    size_t dims;       /* its shape in the dims pool, then (tensors) its strides */
    DLDataType dtype;  /* tensors */
    const char *src;   /* first byte to copy */
    uint64_t nbytes;
    uint64_t offset;   /* in the block */
} fp_leaf_t;

typedef struct {
    fp_leaf_t *leaves;
    int64_t *dims;     /* every leaf's shape and strides */
    size_t ndims, cap;
} fp_batch_t;

/* `items` (an array of *cap entries of `size` bytes) grown to hold `need`:
 * the capacity doubled from `first` until it does. The new array, or NULL
 * with MemoryError (items and *cap unchanged). */
static void *fp_grow(void *items, size_t *cap, size_t need, size_t size, size_t first)
{
    size_t n = *cap ? *cap : first;
    while (n < need)
        n *= 2;
    void *grown = n > SIZE_MAX / size ? NULL : PyMem_Realloc(items, n * size);
    if (!grown)
        return PyErr_NoMemory();
    *cap = n;
    return grown;
}

/* Room for `n` more entries in the dims pool; -1 with MemoryError. The first
 * call makes the pool even for n == 0 (a 0-d leaf): its shape is copied to,
 * and its view made from, a pointer into it, and memcpy's may not be NULL. */
static int fp_dims_reserve(fp_batch_t *b, size_t n)
{
    if (b->dims && b->ndims + n <= b->cap)
        return 0;
    int64_t *dims = fp_grow(b->dims, &b->cap, b->ndims + n, sizeof *dims, 64);
    if (!dims)
        return -1;
    b->dims = dims;
    return 0;
}

/* Flag `which` (FP_NAME_*) of tensor x, an exact torch.Tensor: 1 if it is
 * true, 0 if not, -1 on an error. Through the type's own descriptor, read
 * once: the attribute's getter or the method, called on x, with no lookup
 * and no bound method per call (torch's __torch_function__ handling is in
 * them, so it still applies). */
static int fp_flag(fp_state *st, PyObject *x, int which)
{
    PyObject *d = st->flags[which];
    PyObject *r = which == FP_NAME_REQUIRES_GRAD
                      ? Py_TYPE(d)->tp_descr_get(d, x, (PyObject *)Py_TYPE(x))
                      : PyObject_Vectorcall(d, &x, 1, NULL);
    if (!r)
        return -1;
    int flag = PyObject_IsTrue(r);
    Py_DECREF(r);
    return flag;
}

/* How `ndim` x shape x strides (elements) lie: 2 contiguous (row-major,
 * size-1 dimensions aside), 1 dense (a permutation of a contiguous layout,
 * channels_last included: one memcpy copies it and the strides are kept),
 * 0 neither (a gather). As _leaves._is_dense. */
static int fp_layout_kind(int ndim, const int64_t *shape, const int64_t *strides)
{
    int64_t expected = 1;
    int contiguous = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        if (shape[i] == 0)
            return 2;
        if (shape[i] == 1)
            continue;
        if (strides[i] != expected)
            contiguous = 0;
        expected *= shape[i];
    }
    if (contiguous)
        return 2;
    /* Dense: sorted by stride, each stride is the product of the sizes below. */
    int order[FP_DLPACK_MAX_NDIM], n = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 1)
            continue;
        int j = n++;
        while (j > 0 && strides[order[j - 1]] > strides[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    expected = 1;
    for (int k = 0; k < n; k++) {
        if (strides[order[k]] != expected)
            return 0;
        expected *= shape[order[k]];
    }
    return 1;
}

/* How fp_read_tensor asks whether a tensor is pinned already (it then comes
 * back as it is): not at all (no GPU), by the driver (a context current: one
 * call, no Python), or by tensor.is_pinned(). */
enum { FP_PINNED_NEVER = 0, FP_PINNED_BY_TORCH = 1, FP_PINNED_BY_DRIVER = 2 };

/* Reads a plain torch tensor into *l; 1 if it takes this path, 0 if the
 * Python pipeline must do the batch, -1 on an error. */
static int fp_read_tensor(fp_state *st, fp_batch_t *b, fp_leaf_t *l, int check_pinned)
{
    DLTensor dl;
    if (st->torch_api->dltensor_from_py_object_no_sync(l->leaf, &dl)) {
        PyErr_Clear(); /* sparse, nested, quantized, ...: torch's own path */
        return 0;
    }
    if (dl.device.device_type != kDLCPU || dl.ndim < 0 || dl.ndim > FP_DLPACK_MAX_NDIM ||
        dl.dtype.lanes != 1 || dl.dtype.bits == 0 || dl.dtype.bits % 8)
        return 0;
    /* The view is valid until control returns to torch: copy it out first. */
    if (fp_dims_reserve(b, 2 * (size_t)dl.ndim))
        return -1;
    int64_t *shape = b->dims + b->ndims, *strides = shape + dl.ndim;
    memcpy(shape, dl.shape, (size_t)dl.ndim * sizeof *shape);
    uint64_t numel = 1;
    for (int i = 0; i < dl.ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
            return 0;
    if (dl.strides)
        memcpy(strides, dl.strides, (size_t)dl.ndim * sizeof *strides);
    int kind = dl.strides ? fp_layout_kind(dl.ndim, shape, strides) : 2;
    if (kind == 0)
        return 0;
    if (kind == 2) /* canonical strides: size-1 dimensions may carry any */
        for (int64_t i = dl.ndim - 1, step = 1; i >= 0; i--) {
            strides[i] = step; /* step <= numel: no wrap */
            step *= shape[i] > 1 ? shape[i] : 1;
        }
    l->ndim = dl.ndim;
    l->dims = b->ndims;
    l->dtype = dl.dtype;
    l->src = (const char *)dl.data + dl.byte_offset;
    if (__builtin_mul_overflow(numel, (uint64_t)dl.dtype.bits / 8, &l->nbytes))
        return 0;
    b->ndims += 2 * (size_t)dl.ndim;
    /* What DLPack does not say: autograd, and the lazy conjugate/negative
     * bits (their data is exported as stored). */
    int flag = fp_flag(st, l->leaf, FP_NAME_REQUIRES_GRAD);
    if (flag)
        return flag < 0 ? -1 : 0;
    if ((flag = fp_flag(st, l->leaf, FP_NAME_IS_NEG)))
        return flag < 0 ? -1 : 0;
    if (dl.dtype.code == kDLComplex && (flag = fp_flag(st, l->leaf, FP_NAME_IS_CONJ)))
        return flag < 0 ? -1 : 0;
    if (check_pinned == FP_PINNED_BY_DRIVER)
        flag = fp_cuda_is_pinned(l->src);
    else if (check_pinned && (flag = fp_flag(st, l->leaf, FP_NAME_IS_PINNED)) < 0)
        return -1;
    if (flag)
        l->kind = FP_LEAF_KEEP;
    return 1;
}

/* Reads a plain, C-contiguous NumPy array of plain data into *l; 1, or 0
 * for the Python pipeline, -1 on an error. */
static int fp_read_array(fp_batch_t *b, fp_leaf_t *l)
{
    PyArrayObject *a = (PyArrayObject *)l->leaf;
    if (PyDataType_REFCHK(PyArray_DESCR(a)) || !PyArray_IS_C_CONTIGUOUS(a))
        return 0;
    int ndim = PyArray_NDIM(a);
    if (ndim > FP_DLPACK_MAX_NDIM || fp_dims_reserve(b, (size_t)ndim))
        return ndim > FP_DLPACK_MAX_NDIM ? 0 : -1;
    for (int i = 0; i < ndim; i++)
        b->dims[b->ndims + i] = PyArray_DIM(a, i);
    l->ndim = ndim;
    l->dims = b->ndims;
    l->src = PyArray_BYTES(a);
    l->nbytes = (uint64_t)PyArray_NBYTES(a);
    b->ndims += (size_t)ndim;
    return 1;
}

/* `out` (a new reference, stolen) with the dtype of `leaf`, for the 8-bit
 * integer codes: DLPack has one for several torch dtypes (uint1..uint7
 * travel as uint8 bytes, int1..int7 as int8), so a view gives the leaf's own
 * back. What torch makes of each code is read once. */
static PyObject *fp_same_dtype(fp_state *st, PyObject *out, PyObject *leaf, uint8_t code)
{
    PyObject **made = &st->byte_dtypes[code == kDLUInt];
    if (!*made && !(*made = PyObject_GetAttr(out, st->names[FP_NAME_DTYPE]))) {
        Py_DECREF(out);
        return NULL;
    }
    PyObject *want = PyObject_GetAttr(leaf, st->names[FP_NAME_DTYPE]);
    if (want && want != *made) {
        PyObject *view = PyObject_CallMethodOneArg(out, st->names[FP_NAME_VIEW], want);
        Py_SETREF(out, view);
    }
    if (!want)
        Py_CLEAR(out);
    Py_XDECREF(want);
    return out;
}

/* The view of leaf l over `block` (lease), a new reference or NULL. */
static PyObject *fp_leaf_view(fp_state *st, fp_batch_t *b, const fp_leaf_t *l, PyObject *block)
{
    fp_lease_t *lease = ((BlockObject *)block)->lease;
    const int64_t *shape = b->dims + l->dims;
    if (l->kind == FP_LEAF_TENSOR) {
        DLManagedTensorVersioned *t = fp_dlpack_managed(lease, lease->ptr + l->offset, l->ndim,
                                                        shape, shape + l->ndim, l->dtype);
        void *made = NULL;
        /* On failure torch owns t all the same (the API takes it): at worst
         * this block outlives its batch, never a double free. */
        if (!t || st->torch_api->managed_tensor_to_py_object_no_sync(t, &made))
            return NULL;
        if ((l->dtype.code == kDLInt || l->dtype.code == kDLUInt) && l->dtype.bits == 8)
            return fp_same_dtype(st, made, l->leaf, l->dtype.code);
        return made; /* every other code is one torch dtype */
    }
    PyArray_Descr *descr = PyArray_DESCR((PyArrayObject *)l->leaf);
    Py_INCREF(descr); /* stolen below */
    return fp_block_array(block, descr, l->ndim, shape, NULL, l->offset);
}

/* Reads every leaf; 1: all take this path, 0: the Python pipeline, -1. */
static int fp_read_batch(fp_state *st, fp_batch_t *b, PyObject **items, Py_ssize_t n,
                         int check_pinned)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        fp_leaf_t *l = &b->leaves[i];
        l->leaf = items[i];
        int took;
        if (st->TensorType && Py_TYPE(l->leaf) == (PyTypeObject *)st->TensorType) {
            l->kind = FP_LEAF_TENSOR;
            took = fp_read_tensor(st, b, l, check_pinned);
        } else if (Py_TYPE(l->leaf) == &PyArray_Type) {
            l->kind = FP_LEAF_ARRAY;
            took = fp_read_array(b, l);
        } else {
            took = 0;
        }
        if (took <= 0)
            return took;
    }
    return 1;
}

/* The block's layout: GRANULE-aligned offsets, one copy per leaf placed
 * (*placed of them, *data bytes of leaf data); returns the block's bytes, or
 * UINT64_MAX past what any arena holds. */
static uint64_t fp_batch_pack(fp_batch_t *b, Py_ssize_t n, fp_copy_t *copies, uint64_t *offsets,
                              Py_ssize_t *placed, uint64_t *data)
{
    uint64_t total = 0;
    *placed = 0;
    *data = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        fp_leaf_t *l = &b->leaves[i];
        if (l->kind == FP_LEAF_KEEP)
            continue;
        total = (total + FP_GRANULE - 1) & ~(uint64_t)(FP_GRANULE - 1);
        if (l->nbytes > FP_MAX_CAPACITY || total + l->nbytes > FP_MAX_CAPACITY)
            return UINT64_MAX;
        l->offset = total;
        copies[*placed] = (fp_copy_t){.src = l->nbytes ? l->src : NULL, .size = l->nbytes};
        offsets[(*placed)++] = total;
        total += l->nbytes;
        *data += l->nbytes;
    }
    return total;
}

/* Every leaf's view over the new block, into a new list. */
static PyObject *fp_batch_views(fp_state *st, fp_batch_t *b, PyObject **items, Py_ssize_t n,
                                PyObject *block)
{
    PyObject *outs = PyList_New(n);
    if (!outs)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const fp_leaf_t *l = &b->leaves[i];
        PyObject *out;
        if (l->kind == FP_LEAF_KEEP) {
            out = Py_NewRef(items[i]);
        } else if (!(out = fp_leaf_view(st, b, l, block))) {
            Py_DECREF(outs);
            return NULL;
        }
        PyList_SET_ITEM(outs, i, out);
    }
    return outs;
}

/* Bytes of leaf data that torch's threads copy instead of the copy pool: a
 * batch of lo to hi bytes, by torch's OpenMP team (st->team, where found and
 * team_grain is not 0), else by its copy_ where every leaf placed is a torch
 * tensor. */
typedef struct {
    uint64_t lo, hi;
} fp_span_t;

/* Whether a batch of `data` bytes lies in the torch span, where torch's
 * threads fill it (see fp_span_t). Never in a process forked from the one
 * that loaded fastpin: GNU libgomp's pool of threads does not survive fork,
 * and a parallel region in the child of a process that ran one waits for
 * them forever (torch's own ops too); there the copy pool, made anew in each
 * process, copies. */
static int fp_in_span(const fp_state *st, uint64_t data, const fp_span_t *span)
{
    return span && data >= span->lo && data <= span->hi && fp_same_process(st->pid);
}

/* Whether every leaf of the batch is a torch tensor: torch's copy_ fills
 * only tensor views (the team copies bytes, arrays' as well). */
static int fp_all_tensors(const fp_batch_t *b, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (b->leaves[i].kind == FP_LEAF_ARRAY)
            return 0;
    return 1;
}

/* Threads of torch's OpenMP team that copy a batch of `data` bytes in the
 * torch span: one per team_grain bytes, at most the calling thread's torch
 * threads (the caller asked torch.get_num_threads, which sets the runtime's
 * count for this thread); 0 where no team was found or team_grain is 0:
 * torch's copy_ fills the views. */
static unsigned fp_team_size(const fp_state *st, uint64_t data)
{
    if (!st->team.parallel || !st->team_grain)
        return 0;
    uint64_t want = (data + st->team_grain - 1) / st->team_grain;
    int most = st->team.max_threads();
    if (most < 1)
        most = 1;
    return want < (uint64_t)most ? (want ? (unsigned)want : 1) : (unsigned)most;
}

/* Fills the views of a reserved block (its first byte at base) by torch's
 * Tensor.copy_, leaf by leaf (torch's intra-op threads, the GIL released):
 * where the calling thread has several, they stay hot between calls, and in
 * the range the caller gives (fastpin/_pin.py's _torch_copy) beat the pool. A
 * leaf whose dtype torch cannot copy (a shell dtype) is copied by memcpy. 0,
 * or -1 with an exception. */
static int fp_torch_fill(fp_state *st, const fp_batch_t *b, Py_ssize_t n, PyObject *views,
                         char *base)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        const fp_leaf_t *l = &b->leaves[i];
        if (l->kind != FP_LEAF_TENSOR || !l->nbytes)
            continue;
        PyObject *r = PyObject_CallMethodOneArg(PyList_GET_ITEM(views, i),
                                                st->names[FP_NAME_COPY_], l->leaf);
        if (r) {
            Py_DECREF(r);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        Py_BEGIN_ALLOW_THREADS
        memcpy(base + l->offset, l->src, l->nbytes);
        Py_END_ALLOW_THREADS
    }
    return 0;
}

/* The pinned views of `items` (n leaves, held by the caller) in a new list;
 * Py_None when a leaf needs the Python pipeline (nothing allocated); NULL
 * with an exception. by_torch: see fp_span_t (NULL: the pool copies). */
static PyObject *fp_pin_items(fp_state *st, ArenaObject *self, PyObject **items, Py_ssize_t n,
                              int check_pinned, const fp_span_t *by_torch)
{
    fp_batch_t b = {.leaves = PyMem_Calloc((size_t)n + 1, sizeof *b.leaves)};
    fp_copy_t *copies = PyMem_Calloc((size_t)n + 1, sizeof *copies);
    uint64_t *offsets = PyMem_Calloc((size_t)n + 1, sizeof *offsets);
    PyObject *result = NULL, *block = NULL;
    if (!b.leaves || !copies || !offsets) {
        PyErr_NoMemory();
        goto done;
    }
    int took;
    {
        /* The driver answers for the arena's context (the device's primary
         * one, where torch's pinned memory is registered too). */
        fp_cu_context_t ctx = check_pinned ? fp_arena_context(self->arena) : NULL;
        FP_CUDA_SCOPE(scope, ctx);
        took = fp_read_batch(st, &b, items, n,
                             !check_pinned   ? FP_PINNED_NEVER
                             : scope.current ? FP_PINNED_BY_DRIVER
                                            : FP_PINNED_BY_TORCH);
    }
    if (took <= 0) {
        result = took < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t placed;
    uint64_t data, total = fp_batch_pack(&b, n, copies, offsets, &placed, &data);
    if (total == UINT64_MAX) {
        PyErr_Format(st->ArenaFullError, "pin_batch: more bytes than any arena holds (2**43)");
        goto done;
    }
    int in_span = placed && fp_in_span(st, data, by_torch);
    unsigned team = in_span ? fp_team_size(st, data) : 0;
    int torch_fills = in_span && (team || fp_all_tensors(&b, n));
    if (torch_fills && !team)
        for (Py_ssize_t i = 0; i < placed; i++)
            copies[i].src = NULL; /* the block only reserved: torch fills its views */
    if (placed) {
        fp_lease_t *lease;
        if (fp_pin_copies(st, self->arena, copies, offsets, placed, total, team, &lease))
            goto done;
        if (!(block = Block_wrap(st, lease)))
            goto done;
    }
    if ((result = fp_batch_views(st, &b, items, n, block)) && torch_fills && !team &&
        fp_torch_fill(st, &b, n, result, ((BlockObject *)block)->lease->ptr))
        Py_CLEAR(result); /* its views go, and with them the block */
    if (result) {
        st->pinned.by_torch += (uint64_t)torch_fills;
        st->pinned.by_team += (uint64_t)(team > 0);
        st->pinned.batches++;
        st->pinned.leaves += (uint64_t)placed;
        st->pinned.bytes += data;
    }
done:
    Py_XDECREF(block);
    PyMem_Free(b.leaves);
    PyMem_Free(b.dims);
    PyMem_Free(copies);
    PyMem_Free(offsets);
    return result;
}

PyObject *Arena_pin_batch(ArenaObject *self, PyObject *args)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    PyObject *list;
    int check_pinned;
    fp_span_t span = {1, 0}; /* none: lo > hi */
    if (!PyArg_ParseTuple(args, "O!p|KK:pin_batch", &PyList_Type, &list, &check_pinned,
                          &span.lo, &span.hi))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject **items = PyMem_Malloc(((size_t)n + 1) * sizeof *items);
    if (!items)
        return PyErr_NoMemory();
    /* Held: Python code may run meanwhile (a tensor's attributes) and change the list. */
    for (Py_ssize_t i = 0; i < n; i++)
        items[i] = Py_NewRef(PyList_GET_ITEM(list, i));
    PyObject *result = fp_pin_items(st, self, items, n, check_pinned, &span);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(items[i]);
    PyMem_Free(items);
    return result;
}

/* ---- a whole batch: pin_tree ----------------------------------------------
 *
 * pin_memory's one C call for the common batch: a leaf, or exact lists,
 * tuples and dicts of leaves and of plain values (None, bool, int, float,
 * str, bytes), as flatten (fastpin/_walk.py) would walk it. The walk records
 * every node in preorder, holding a reference to each leaf, value and key,
 * and reads each container once, so the rebuild pairs keys and values as
 * they were. Anything else (another type, deeper nesting) is left to the
 * Python pipeline, before anything is allocated. */

enum { FP_NODE_LEAF, FP_NODE_VALUE, FP_NODE_KEY, FP_NODE_LIST, FP_NODE_TUPLE, FP_NODE_DICT };

/* Containers nested deeper than this go to the Python pipeline. */
#define FP_TREE_DEPTH 32

typedef struct {
    int kind;       /* FP_NODE_* */
    Py_ssize_t n;   /* a container's items (a dict's: key and value pairs) */
    PyObject *obj;  /* a reference: a leaf, a value or a key; NULL for containers */
} fp_node_t;

typedef struct {
    fp_node_t *nodes;
    size_t count, cap;
    PyObject **leaves; /* borrowed from nodes, in order */
    size_t nleaves, leaves_cap;
} fp_tree_t;

/* Appends a node (taking a reference to obj) and, for a leaf, the leaf; -1
 * with MemoryError. */
static int fp_tree_push(fp_tree_t *t, int kind, Py_ssize_t n, PyObject *obj)
{
    if (t->count == t->cap) {
        fp_node_t *nodes = fp_grow(t->nodes, &t->cap, t->count + 1, sizeof *nodes, 16);
        if (!nodes)
            return -1;
        t->nodes = nodes;
    }
    if (kind == FP_NODE_LEAF && t->nleaves == t->leaves_cap) {
        PyObject **leaves = fp_grow(t->leaves, &t->leaves_cap, t->nleaves + 1, sizeof *leaves, 8);
        if (!leaves)
            return -1;
        t->leaves = leaves;
    }
    t->nodes[t->count++] = (fp_node_t){kind, n, Py_XNewRef(obj)};
    if (kind == FP_NODE_LEAF)
        t->leaves[t->nleaves++] = obj;
    return 0;
}

static void fp_tree_free(fp_tree_t *t)
{
    for (size_t i = 0; i < t->count; i++)
        Py_XDECREF(t->nodes[i].obj);
    PyMem_Free(t->nodes);
    PyMem_Free(t->leaves);
}

static int fp_is_plain_value(PyObject *x)
{
    PyTypeObject *type = Py_TYPE(x);
    return x == Py_None || type == &PyBool_Type || type == &PyLong_Type ||
           type == &PyFloat_Type || type == &PyUnicode_Type || type == &PyBytes_Type;
}

/* Records x and what it holds; 1, 0 when the Python pipeline must walk it,
 * -1 on an error. Runs no Python code, so no container changes under it. */
static int fp_tree_walk(fp_state *st, fp_tree_t *t, PyObject *x, int depth)
{
    PyTypeObject *type = Py_TYPE(x);
    if ((st->TensorType && type == (PyTypeObject *)st->TensorType) || type == &PyArray_Type)
        return fp_tree_push(t, FP_NODE_LEAF, 0, x) ? -1 : 1;
    if (fp_is_plain_value(x))
        return fp_tree_push(t, FP_NODE_VALUE, 0, x) ? -1 : 1;
    if (depth >= FP_TREE_DEPTH)
        return 0;
    if (type == &PyList_Type || type == &PyTuple_Type) {
        Py_ssize_t n = Py_SIZE(x);
        PyObject **items = type == &PyList_Type ? ((PyListObject *)x)->ob_item
                                                : ((PyTupleObject *)x)->ob_item;
        if (fp_tree_push(t, type == &PyList_Type ? FP_NODE_LIST : FP_NODE_TUPLE, n, NULL))
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            int r = fp_tree_walk(st, t, items[i], depth + 1);
            if (r <= 0)
                return r;
        }
        return 1;
    }
    if (type == &PyDict_Type) {
        if (fp_tree_push(t, FP_NODE_DICT, PyDict_GET_SIZE(x), NULL))
            return -1;
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(x, &pos, &key, &value)) {
            if (fp_tree_push(t, FP_NODE_KEY, 0, key))
                return -1;
            int r = fp_tree_walk(st, t, value, depth + 1);
            if (r <= 0)
                return r;
        }
        return 1;
    }
    return 0;
}

/* The structure from node *at on, its leaves from `outs` (the pinned views,
 * in order, from *leaf on): a new reference, or NULL. */
static PyObject *fp_tree_build(const fp_tree_t *t, size_t *at, PyObject *outs, Py_ssize_t *leaf)
{
    const fp_node_t *node = &t->nodes[(*at)++];
    if (node->kind == FP_NODE_LEAF)
        return Py_NewRef(PyList_GET_ITEM(outs, (*leaf)++));
    if (node->kind == FP_NODE_VALUE)
        return Py_NewRef(node->obj);
    if (node->kind == FP_NODE_DICT) {
        PyObject *dict = PyDict_New();
        for (Py_ssize_t i = 0; dict && i < node->n; i++) {
            PyObject *key = t->nodes[(*at)++].obj;
            PyObject *value = fp_tree_build(t, at, outs, leaf);
            if (!value || PyDict_SetItem(dict, key, value))
                Py_CLEAR(dict);
            Py_XDECREF(value);
        }
        return dict;
    }
    int list = node->kind == FP_NODE_LIST;
    PyObject *seq = list ? PyList_New(node->n) : PyTuple_New(node->n);
    for (Py_ssize_t i = 0; seq && i < node->n; i++) {
        PyObject *item = fp_tree_build(t, at, outs, leaf);
        if (!item)
            Py_CLEAR(seq);
        else if (list)
            PyList_SET_ITEM(seq, i, item);
        else
            PyTuple_SET_ITEM(seq, i, item);
    }
    return seq;
}

/* `data` pinned into `arena` (see pin_tree): a new reference, NotImplemented
 * for the Python pipeline, or NULL with an exception. */
static PyObject *fp_pin_tree(fp_state *st, ArenaObject *arena, PyObject *data, int check_pinned,
                             const fp_span_t *span)
{
    fp_tree_t t = {0};
    PyObject *result = NULL;
    int walked = fp_tree_walk(st, &t, data, 0);
    if (walked == 0)
        result = Py_NewRef(Py_NotImplemented);
    if (walked <= 0)
        goto done;
    PyObject *outs = fp_pin_items(st, arena, t.leaves, (Py_ssize_t)t.nleaves, check_pinned, span);
    if (outs == Py_None)
        result = Py_NewRef(Py_NotImplemented);
    else if (outs) {
        size_t at = 0;
        Py_ssize_t leaf = 0;
        result = fp_tree_build(&t, &at, outs, &leaf);
    }
    Py_XDECREF(outs);
done:
    fp_tree_free(&t);
    return result;
}

PyObject *Arena_pin_tree(ArenaObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    fp_state *st = fp_state_of_type(Py_TYPE(self));
    int check_pinned;
    fp_span_t span = {1, 0}; /* none: lo > hi */
    if (nargs != 2 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "pin_tree takes 2 or 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if ((check_pinned = PyObject_IsTrue(args[1])) < 0)
        return NULL;
    if (nargs == 4) {
        span.lo = PyLong_AsUnsignedLongLong(args[2]);
        span.hi = PyLong_AsUnsignedLongLong(args[3]);
        if (PyErr_Occurred())
            return NULL;
    }
    return fp_pin_tree(st, self, args[0], check_pinned, &span);
}

/* ---- fastpin.pin_memory's common call: pin_default ---------------------
 *
 * pin_memory(batch) with no arguments, once a call has found the current
 * GPU's default arena made: the same arena, read from the same registry
 * (fastpin._arena's, by device) at each call, without the prologue's dozen
 * Python steps (1-2 us a call). Anything else (a device set by configure(),
 * no arena for the current device, a full arena, a forked child) answers None
 * and the Python layer does the call. */

PyObject *fp_set_pin_default(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    fp_state *st = PyModule_GetState(module);
    if (nargs == 1 && args[0] == Py_None) {
        Py_CLEAR(st->pin_default.arenas);
        Py_CLEAR(st->pin_default.settings);
        Py_CLEAR(st->pin_default.threads);
        Py_RETURN_NONE;
    }
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "set_pin_default takes 1 or 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyDict_Check(args[0]) || !PyCallable_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "set_pin_default(arenas: dict, settings, check_pinned, "
                                         "lo, hi, threads: callable)");
        return NULL;
    }
    int check_pinned = PyObject_IsTrue(args[2]);
    uint64_t lo = PyLong_AsUnsignedLongLong(args[3]), hi = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred() || check_pinned < 0)
        return NULL;
    Py_XSETREF(st->pin_default.arenas, Py_NewRef(args[0]));
    Py_XSETREF(st->pin_default.settings, Py_NewRef(args[1]));
    Py_XSETREF(st->pin_default.threads, Py_NewRef(args[5]));
    st->pin_default.check_pinned = check_pinned;
    st->pin_default.lo = lo;
    st->pin_default.hi = hi;
    st->pin_default.pid = fp_pid();
    Py_RETURN_NONE;
}

/* The Arena pin_default pins into (a new reference), or NULL (no error set):
 * none set, a device configured, no arena for the current one, or its
 * GrowingArena's newest segment not an Arena. */
static ArenaObject *fp_default_segment(fp_state *st)
{
    PyObject *arenas = st->pin_default.arenas, *settings = st->pin_default.settings;
    if (!arenas || !fp_same_process(st->pin_default.pid))
        return NULL;
    PyObject *device = PyObject_GetAttr(settings, st->names[FP_NAME_DEVICE]);
    int configured = device != Py_None;
    Py_XDECREF(device);
    PyObject *index = configured ? NULL : PyLong_FromLong(fp_cuda_current_device());
    PyObject *arena = index ? PyDict_GetItemWithError(arenas, index) : NULL;
    Py_XDECREF(index);
    if (!arena) {
        PyErr_Clear();
        return NULL;
    }
    if (Py_IS_TYPE(arena, st->ArenaType))
        return (ArenaObject *)Py_NewRef(arena);
    /* A GrowingArena: its segments, newest first, replaced whole on growth.
     * Held across the lookup, which could in principle run Python code. */
    Py_INCREF(arena);
    PyObject *segments = PyObject_GetAttr(arena, st->names[FP_NAME_SEGMENTS]);
    PyObject *first = segments && PyTuple_Check(segments) && PyTuple_GET_SIZE(segments) > 0
                          ? PyTuple_GET_ITEM(segments, 0)
                          : NULL;
    ArenaObject *out = first && Py_IS_TYPE(first, st->ArenaType) ? (ArenaObject *)Py_NewRef(first)
                                                                 : NULL;
    Py_XDECREF(segments);
    Py_DECREF(arena);
    PyErr_Clear();
    return out;
}

PyObject *fp_pin_default(PyObject *module, PyObject *data)
{
    fp_state *st = PyModule_GetState(module);
    PyObject *result = NULL;
    ArenaObject *arena = fp_default_segment(st);
    if (!arena)
        Py_RETURN_NONE;
    /* torch's copy_ fills the span only where this thread has several torch
     * threads (DataLoader's pin thread has one): asked at every call, as the
     * Python layer did. */
    PyObject *threads = PyObject_CallNoArgs(st->pin_default.threads);
    long n = threads ? PyLong_AsLong(threads) : -1;
    Py_XDECREF(threads);
    if (n == -1 && PyErr_Occurred())
        goto done;
    fp_span_t span = {st->pin_default.lo, st->pin_default.hi}, none = {1, 0};
    result = fp_pin_tree(st, arena, data, st->pin_default.check_pinned, n > 1 ? &span : &none);
    if (!result && PyErr_ExceptionMatches(st->ArenaFullError)) {
        PyErr_Clear(); /* the Python layer grows the arena, or applies on_full */
        result = Py_NewRef(Py_None);
    }
done:
    Py_DECREF(arena);
    return result;
}

PyObject *fp_pin_counts(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    fp_state *st = PyModule_GetState(module);
    return Py_BuildValue("(KKKKK)", (unsigned long long)st->pinned.batches,
                         (unsigned long long)st->pinned.leaves,
                         (unsigned long long)st->pinned.bytes,
                         (unsigned long long)st->pinned.by_torch,
                         (unsigned long long)st->pinned.by_team);
}

int fp_names_init(fp_state *st)
{
    static const char *const names[FP_NAMES] = {
        [FP_NAME_REQUIRES_GRAD] = "requires_grad", [FP_NAME_IS_NEG] = "is_neg",
        [FP_NAME_IS_CONJ] = "is_conj", [FP_NAME_IS_PINNED] = "is_pinned",
        [FP_NAME_DTYPE] = "dtype", [FP_NAME_VIEW] = "view",
        [FP_NAME_REQUIRES_GRAD_] = "requires_grad_", [FP_NAME_COPY_] = "copy_",
        [FP_NAME_SEGMENTS] = "segments", [FP_NAME_DEVICE] = "device"};
    for (int i = 0; i < FP_NAMES; i++)
        if (!(st->names[i] = PyUnicode_InternFromString(names[i])))
            return -1;
    return 0;
}

PyObject *fp_use_torch(PyObject *module, PyObject *args)
{
    fp_state *st = PyModule_GetState(module);
    PyObject *type, *capsule;
    const char *owner = NULL;
    if (!PyArg_ParseTuple(args, "O!O|z:use_torch", &PyType_Type, &type, &capsule, &owner))
        return NULL;
    if (!PyCapsule_IsValid(capsule, "dlpack_exchange_api"))
        Py_RETURN_FALSE;
    const fp_exchange_api_t *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (!api || api->header.version.major != FP_DLPACK_MAJOR ||
        !api->dltensor_from_py_object_no_sync || !api->managed_tensor_to_py_object_no_sync)
        Py_RETURN_FALSE;
    PyObject *flags[FP_FLAGS];
    for (int i = 0; i < FP_FLAGS; i++)
        if (!(flags[i] = PyObject_GetAttr(type, st->names[i]))) {
            while (i--)
                Py_DECREF(flags[i]);
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear(); /* not torch.Tensor's shape of type */
            Py_RETURN_FALSE;
        }
    /* The attribute must be a descriptor with a getter (torch's getset); the
     * methods anything callable with the tensor first. */
    int usable = Py_TYPE(flags[FP_NAME_REQUIRES_GRAD])->tp_descr_get != NULL;
    for (int i = 0; i < FP_FLAGS; i++)
        usable = usable && (i == FP_NAME_REQUIRES_GRAD || PyCallable_Check(flags[i]));
    for (int i = 0; i < FP_FLAGS; i++) {
        if (usable)
            Py_XSETREF(st->flags[i], flags[i]);
        else
            Py_DECREF(flags[i]); /* what was registered before stays */
    }
    if (!usable)
        Py_RETURN_FALSE;
    Py_XSETREF(st->TensorType, Py_NewRef(type));
    Py_XSETREF(st->torch_api_obj, Py_NewRef(capsule));
    st->torch_api = api;
    if (owner)
        (void)fp_team_find(owner, &st->team); /* none found: all NULL, copy_ fills the span */
    Py_RETURN_TRUE;
}
