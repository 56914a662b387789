/* Blocks out to Python as DLPack capsules.
 *
 * Pinned host memory goes out as kDLCPU: PyTorch refuses kDLCUDAHost on
 * import, and for a consumer on the host the two are the same memory. */
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"

/* One allocation per export: the managed tensor, then its shape and strides.
 * malloc, not PyMem: the deleter runs on whatever thread frees the tensor,
 * often without the GIL. */
typedef struct fp_export_s {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } t;               /* what the capsule points to */
    fp_lease_t *lease; /* the reference this export holds */
    int64_t dims[];    /* ndim shape entries, then ndim strides */
} fp_export_t;

static void fp_export_release(fp_export_t *e)
{
    fp_lease_decref(e->lease);
    free(e);
}

static void fp_dlpack_deleter(DLManagedTensor *self)
{
    fp_export_release((fp_export_t *)self->manager_ctx);
}

static void fp_dlpack_deleter_versioned(DLManagedTensorVersioned *self)
{
    fp_export_release((fp_export_t *)self->manager_ctx);
}

/* A capsule nobody consumed still owns its tensor (the spec's rule); one that
 * was consumed was renamed "used_dltensor..." and owns nothing. */
static void fp_capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *t = PyCapsule_GetPointer(capsule, "dltensor");
        t->deleter(t);
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *t = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        t->deleter(t);
    }
}

/* A new export of the view (no reference taken yet), its DLTensor in *dl;
 * NULL with an exception set. */
static fp_export_t *fp_export_new(fp_lease_t *lease, void *data, int ndim,
                                  const int64_t *shape, const int64_t *strides,
                                  DLDataType dtype, DLTensor *dl)
{
    if (ndim < 0 || ndim > FP_DLPACK_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "DLPack export of %d dimensions (at most %d)",
                     ndim, FP_DLPACK_MAX_NDIM);
        return NULL;
    }
    fp_export_t *e = calloc(1, sizeof *e + 2 * (size_t)ndim * sizeof(int64_t));
    if (!e) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(e->dims, shape, (size_t)ndim * sizeof(int64_t));
    memcpy(e->dims + ndim, strides, (size_t)ndim * sizeof(int64_t));
    e->lease = lease;
    *dl = (DLTensor){
        .data = data,
        .device = {.device_type = kDLCPU, .device_id = 0},
        .ndim = ndim,
        .dtype = dtype,
        .shape = e->dims,
        .strides = e->dims + ndim,
        .byte_offset = 0,
    };
    return e;
}

DLManagedTensorVersioned *fp_dlpack_managed(fp_lease_t *lease, void *data, int ndim,
                                            const int64_t *shape, const int64_t *strides,
                                            DLDataType dtype)
{
    DLTensor dl;
    fp_export_t *e = fp_export_new(lease, data, ndim, shape, strides, dtype, &dl);
    if (!e)
        return NULL;
    DLManagedTensorVersioned *t = &e->t.versioned;
    t->version = (DLPackVersion){FP_DLPACK_MAJOR, FP_DLPACK_MINOR};
    t->manager_ctx = e;
    t->deleter = fp_dlpack_deleter_versioned;
    t->flags = 0;
    t->dl_tensor = dl;
    fp_lease_incref(lease);
    return t;
}

PyObject *fp_dlpack_capsule(fp_lease_t *lease, void *data, int ndim,
                            const int64_t *shape, const int64_t *strides,
                            DLDataType dtype, int minor, int readonly)
{
    DLTensor dl;
    fp_export_t *e = fp_export_new(lease, data, ndim, shape, strides, dtype, &dl);
    if (!e)
        return NULL;
    const char *name;
    if (minor >= 0) {
        DLManagedTensorVersioned *t = &e->t.versioned;
        t->version = (DLPackVersion){FP_DLPACK_MAJOR, (uint32_t)minor};
        t->manager_ctx = e;
        t->deleter = fp_dlpack_deleter_versioned;
        t->flags = readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
        t->dl_tensor = dl;
        name = "dltensor_versioned";
    } else {
        DLManagedTensor *t = &e->t.legacy;
        t->dl_tensor = dl;
        t->manager_ctx = e;
        t->deleter = fp_dlpack_deleter;
        name = "dltensor";
    }
    PyObject *capsule = PyCapsule_New(&e->t, name, fp_capsule_destructor);
    if (!capsule) {
        free(e);
        return NULL;
    }
    fp_lease_incref(lease);
    return capsule;
}
