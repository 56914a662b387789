/* What the binding files of fastpin._C share (module.c, arena_type.c,
 * block_type.c, batch.c, block_record.c): the module state, the two object
 * types and the helpers that raise, read an argument, find the copy pool and wrap a lease. Not part of the core's interface (fastpin.h). Include it
 * after numpy/arrayobject.h (with the file's own NO_IMPORT_ARRAY choice):
 * fp_block_array takes a PyArray_Descr. */
#ifndef FASTPIN_MODULE_H
#define FASTPIN_MODULE_H

#include <Python.h>

#include "dlpack.h"
#include "fastpin.h"

/* Attribute names the bindings ask objects for, interned when the module is
 * made (fp_names_init). */
enum {
    FP_NAME_REQUIRES_GRAD,
    FP_NAME_IS_NEG,
    FP_NAME_IS_CONJ,
    FP_NAME_IS_PINNED,
    FP_FLAGS, /* the names before this are flags, read through the type's descriptors */
    FP_NAME_DTYPE = FP_FLAGS,
    FP_NAME_VIEW,
    FP_NAME_REQUIRES_GRAD_, /* the method (block_record.c) */
    FP_NAME_COPY_,          /* Tensor.copy_: a batch copied by torch (batch.c) */
    FP_NAME_SEGMENTS,       /* GrowingArena.segments (batch.c's pin_default) */
    FP_NAME_DEVICE,         /* settings.device (the same) */
    FP_NAMES
};

typedef struct {
    PyTypeObject *ArenaType;  /* fastpin._C.Arena */
    PyTypeObject *BlockType;  /* fastpin._C.Block */
    PyObject *Error;          /* fastpin.FastpinError (RuntimeError) */
    PyObject *CudaError;      /* driver failures */
    PyObject *ArenaFullError; /* no room, or larger than the cap (MemoryError) */
    fp_copier_t *copier;      /* made on first use; under the GIL */
    pid_t copier_pid;         /* process that made it: a forked child makes its own */
    int threads;              /* wanted pool size, 0 = default; under the GIL */
    int no_streaming;         /* set_streaming(False) was called; under the GIL */
    uint64_t spin_ns;         /* set_spin(ns): for every pool made; under the GIL */
    fp_copier_tuning_t tuning; /* set_copy_tuning(): for every pool made; under the GIL */
    int resize;               /* threads changed since the pool was made */
    int busy;                 /* runs using the pool with the GIL released */
    int *cpus;                /* CPUs the pool's threads are pinned to (PyMem), or
                                 NULL; under the GIL */
    size_t ncpus;             /* entries in cpus */
    PyObject *TensorType;     /* torch.Tensor once use_torch() ran, or NULL */
    PyObject *torch_api_obj;  /* the capsule that keeps torch_api valid */
    const fp_exchange_api_t *torch_api; /* torch's DLPack exchange API, or NULL */
    PyObject *names[FP_NAMES];
    PyObject *flags[FP_FLAGS]; /* torch.Tensor's descriptors of those names (use_torch) */
    pid_t pid;                /* the process that made the module: torch's
                                 threads fill the torch span only there (an
                                 OpenMP team does not survive fork) */
    fp_team_t team;           /* torch's OpenMP team (use_torch), or all NULL */
    uint64_t team_grain;      /* the least bytes a member of it copies for the
                                 torch span; 0: torch's copy_ fills the span
                                 (set_team_grain); under the GIL */
    PyObject *byte_dtypes[2]; /* torch.int8, torch.uint8: what torch makes of DLPack's
                                 8-bit int and uint codes (batch.c), or NULL */
    struct {
        uint64_t batches, leaves, bytes;
        uint64_t by_torch;    /* of the batches, those torch's threads filled
                                 (its copy_, or its OpenMP team) */
        uint64_t by_team;     /* of those, the ones the team filled */
    } pinned;                 /* what pin_batch placed in this process; under the GIL */
    struct {
        PyObject *arenas;     /* fastpin's default arenas by device (a dict), or
                                 NULL: pin_default declines */
        PyObject *settings;   /* fastpin's settings: declines where .device is set */
        PyObject *threads;    /* torch.get_num_threads (or one answering 0) */
        int check_pinned;     /* pin_tree's check_pinned: a GPU is up */
        uint64_t lo, hi;      /* pin_tree's torch span */
        pid_t pid;            /* who set it: a forked child declines */
    } pin_default;            /* set_pin_default(); under the GIL (batch.c) */
} fp_state;

typedef struct {
    PyObject_HEAD
    fp_arena_t *arena;     /* one reference */
    PyObject *weakreflist; /* the Python layer keys arenas by token, weakly */
} ArenaObject;

typedef struct {
    PyObject_HEAD
    fp_lease_t *lease; /* one reference; exports hold their own */
} BlockObject;

/* module.c */
fp_state *fp_state_of_type(PyTypeObject *type);
/* Raises the exception for a core status and returns NULL. */
PyObject *fp_raise(fp_state *st, int status);
/* The process's copy pool (made, or remade after fork or set_threads, on
 * first use); NULL with an exception set. Under the GIL. */
fp_copier_t *fp_get_copier(fp_state *st);
/* Reads `obj` (an int, or anything with __index__) into `out` if it lies in
 * [lo, hi]; else raises (naming the argument and what it may be) and returns -1. */
int fp_u64_arg(PyObject *obj, const char *name, uint64_t lo, uint64_t hi,
               const char *allowed, uint64_t *out);

/* block_type.c */
extern PyType_Spec Block_spec;
/* A Block owning the lease's reference (dropped on failure). */
PyObject *Block_wrap(fp_state *st, fp_lease_t *lease);
/* A writeable ndarray over `block` (a Block) at `offset`, based on the
 * Block: `ndim` sizes, strides in bytes (NULL: C order), `descr` stolen. The
 * caller has checked the extent. A new reference, or NULL. */
PyObject *fp_block_array(PyObject *block, PyArray_Descr *descr, int ndim, const int64_t *shape,
                         const int64_t *strides, uint64_t offset);

/* arena_type.c */
extern PyType_Spec Arena_spec;
/* Copies of fewer bytes keep the GIL: about 2 us at the caller's speed. */
#define FP_GIL_COPY_MIN ((uint64_t)32 << 10)
/* Allocates `total` bytes of `arena` and copies copies[i] (n entries; a NULL
 * source or 0 bytes skipped) to offsets[i] in it; the dst fields are filled
 * here. team: 0, the copy pool copies; else up to that many threads of
 * torch's OpenMP team (st->team). The GIL is let go only to wait for the
 * GPU's copies (an arena whose room they hold) and to copy FP_GIL_COPY_MIN
 * bytes or more. *lease is the new block, or NULL with an exception set
 * (returns -1). */
int fp_pin_copies(fp_state *st, fp_arena_t *arena, fp_copy_t *copies, const uint64_t *offsets,
                  Py_ssize_t n, uint64_t total, unsigned team, fp_lease_t **lease);

/* batch.c */
/* team_grain's default: torch's own grain for a copy of bytes (32768
 * elements a thread), so the team is as large as torch's copy_ would make it
 * for uint8 data. */
#define FP_TEAM_GRAIN ((uint64_t)32 << 10)
/* Interns st->names; 0, or -1 with an exception. */
int fp_names_init(fp_state *st);
PyObject *fp_use_torch(PyObject *module, PyObject *args);
PyObject *Arena_pin_batch(ArenaObject *self, PyObject *args);
PyObject *Arena_pin_tree(ArenaObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *fp_pin_counts(PyObject *module, PyObject *ignored);
PyObject *fp_set_pin_default(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *fp_pin_default(PyObject *module, PyObject *data);

/* block_record.c */
PyObject *Block_unpack(BlockObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* FASTPIN_MODULE_H */
