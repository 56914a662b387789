/* fastpin._C: the CPython bindings of the core, this file the module itself:
 * its state, the helpers every binding file shares (fp_raise, the copy pool,
 * argument checks), its functions and its init.
 *
 * The types are in arena_type.c (Arena) and block_type.c (Block), the batch
 * calls of pin_memory in batch.c; module.h is what they share. Every call
 * that may wait (arena lock, event, memcpy) runs with the GIL released; the
 * core never touches Python and reports through an int status that
 * fp_raise() turns into an exception. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fastpin_ARRAY_API
#include <numpy/arrayobject.h>
#include <limits.h>

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
        (void)fp_copier_set_spin(st->copier, st->spin_ns); /* checked by set_spin */
        (void)fp_copier_set_tuning(st->copier, &st->tuning); /* checked by set_copy_tuning */
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
int fp_u64_arg(PyObject *obj, const char *name, uint64_t lo, uint64_t hi,
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

/* set_spin(ns): how long the copy pool's threads stay ready after a chunk
 * (fp_copier_set_spin); applies to the running pool at once and to every pool
 * made later in this process. Not yet a user setting. */
static PyObject *fp_set_spin(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    uint64_t ns;
    if (fp_u64_arg(arg, "spin", 0, FP_COPIER_SPIN_MAX, "0 to 10000000 (ns)", &ns))
        return NULL;
    st->spin_ns = ns;
    if (st->copier && fp_same_process(st->copier_pid)) {
        int status = fp_copier_set_spin(st->copier, ns);
        if (status)
            return fp_raise(st, status);
    }
    Py_RETURN_NONE;
}

static PyObject *fp_get_spin(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    fp_copier_t *copier = fp_get_copier(PyModule_GetState(module));
    return copier ? PyLong_FromUnsignedLongLong(fp_copier_spin_ns(copier)) : NULL;
}

/* set_team_grain(bytes): the least bytes each thread of torch's OpenMP team
 * copies of a batch in the torch span (batch.c); 0: torch's copy_ fills the
 * span instead. Not yet a user setting. */
static PyObject *fp_set_team_grain(PyObject *module, PyObject *arg)
{
    fp_state *st = PyModule_GetState(module);
    uint64_t grain;
    if (fp_u64_arg(arg, "team_grain", 0, FP_COPIER_TUNE_MAX, "0 to 2**40 (bytes)", &grain))
        return NULL;
    st->team_grain = grain;
    Py_RETURN_NONE;
}

/* The tuning's fields by name, for set_copy_tuning's keywords and
 * copy_tuning's dict. */
static size_t *fp_tuning_field(fp_copier_tuning_t *t, int i, const char **name)
{
    static const char *const names[] = {"inline_max", "inline_spin", "stream_min",
                                        "chunk_min", "chunk_max", "chunk_min_spin"};
    size_t *const fields[] = {&t->inline_max, &t->inline_spin, &t->stream_min,
                              &t->chunk_min, &t->chunk_max, &t->chunk_min_spin};
    if (i < 0 || i >= (int)(sizeof names / sizeof *names))
        return NULL;
    *name = names[i];
    return fields[i];
}

/* set_copy_tuning(*, inline_max=, inline_spin=, stream_min=, chunk_min=,
 * chunk_max=, chunk_min_spin=): the copy pool's cut-overs in bytes (see
 * fp_copier_tuning_t); those not given keep their value. Applies to the
 * running pool from its next run and to every pool made later in this
 * process. Not yet a user setting. */
static PyObject *fp_set_copy_tuning(PyObject *module, PyObject *args, PyObject *kwargs)
{
    fp_state *st = PyModule_GetState(module);
    if (PyTuple_GET_SIZE(args) != 0)
        return PyErr_Format(PyExc_TypeError, "set_copy_tuning() takes keyword arguments only");
    fp_copier_tuning_t t = st->tuning;
    Py_ssize_t used = 0;
    const char *name;
    size_t *field;
    for (int i = 0; (field = fp_tuning_field(&t, i, &name)) != NULL; i++) {
        PyObject *value = kwargs ? PyDict_GetItemString(kwargs, name) : NULL; /* borrowed */
        if (value == NULL)
            continue;
        uint64_t v;
        if (fp_u64_arg(value, name, 0, FP_COPIER_TUNE_MAX, "a number of bytes, 0 to 2**40", &v))
            return NULL;
        *field = (size_t)v;
        used++;
    }
    if (kwargs && PyDict_GET_SIZE(kwargs) != used) {
        PyObject *key;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &key, NULL)) {
            int known = 0;
            for (int i = 0; (field = fp_tuning_field(&t, i, &name)) != NULL; i++)
                known |= PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, name) == 0;
            if (!known)
                return PyErr_Format(PyExc_TypeError,
                                    "set_copy_tuning() got an unexpected keyword argument %R", key);
        }
    }
    int status = fp_copier_tuning_check(&t);
    if (status)
        return fp_raise(st, status);
    st->tuning = t;
    if (st->copier && fp_same_process(st->copier_pid)) {
        status = fp_copier_set_tuning(st->copier, &t);
        if (status)
            return fp_raise(st, status);
    }
    Py_RETURN_NONE;
}

/* copy_tuning() -> dict: the running pool's cut-overs, spin_ns, streaming,
 * threads and spinners (the most of its threads that may spin at once),
 * team_grain, and team (whether torch's OpenMP team was found). */
static PyObject *fp_copy_tuning(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    fp_state *st = PyModule_GetState(module);
    fp_copier_t *copier = fp_get_copier(st);
    if (!copier)
        return NULL;
    fp_copier_tuning_t t;
    fp_copier_get_tuning(copier, &t);
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    const char *name;
    size_t *field;
    for (int i = 0; (field = fp_tuning_field(&t, i, &name)) != NULL; i++) {
        PyObject *v = PyLong_FromSize_t(*field);
        if (!v || PyDict_SetItemString(out, name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyObject *extra[6] = {PyLong_FromUnsignedLongLong(fp_copier_spin_ns(copier)),
                          PyBool_FromLong(fp_copier_streams(copier)),
                          PyLong_FromLong(fp_copier_threads(copier)),
                          PyLong_FromLong(fp_copier_spinners(copier)),
                          PyLong_FromUnsignedLongLong(st->team_grain),
                          PyBool_FromLong(st->team.parallel != NULL)};
    const char *extra_names[6] = {"spin_ns", "streaming", "threads", "spinners", "team_grain",
                                  "team"};
    int ok = 1;
    for (int i = 0; i < 6; i++) {
        ok = ok && extra[i] && PyDict_SetItemString(out, extra_names[i], extra[i]) == 0;
        Py_XDECREF(extra[i]);
    }
    if (!ok)
        Py_CLEAR(out);
    return out;
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
 * sources through `arena` in chunks, the GIL released meanwhile. Copies that
 * are all from pinned memory are only queued (a zero-copy block's one copy):
 * the GIL is kept, since letting it go and taking it back costs more than
 * they do wherever other threads want it. */
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
    int all_pinned = 1;
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
        all_pinned &= pinned;
    }
    int status;
    if (all_pinned) {
        /* Nothing to stage: no copier, and the GIL kept. */
        status = fp_stage_h2d(NULL, arena, fp_arena_context(arena),
                              (fp_cu_stream_t)(uintptr_t)stream, items, (size_t)n, chunk);
    } else {
        fp_copier_t *copier = fp_get_copier(st);
        if (!copier)
            goto done;
        st->busy++;
        Py_BEGIN_ALLOW_THREADS
        status = fp_stage_h2d(copier, arena, fp_arena_context(arena),
                              (fp_cu_stream_t)(uintptr_t)stream, items, (size_t)n, chunk);
        Py_END_ALLOW_THREADS
        st->busy--;
    }
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
     "pin_counts() -> (batches, leaves, bytes, by_torch, by_team): what Arena.pin_tree\n"
     "and pin_batch placed in this process; by_torch: the batches torch's threads filled\n"
     "(its copy_, or its OpenMP team), by_team: those of them the team filled."},
    {"set_pin_default", (PyCFunction)(void (*)(void))fp_set_pin_default, METH_FASTCALL,
     "set_pin_default(arenas, settings, check_pinned, lo, hi, threads) | set_pin_default(None)\n"
     "What pin_default reads: the default arenas by device (an Arena, or a GrowingArena\n"
     "whose newest segment it takes), declining while settings.device is set; it pins\n"
     "as arena.pin_tree(data, check_pinned, lo, hi) where threads() > 1, else without\n"
     "the span. None: nothing."},
    {"pin_default", fp_pin_default, METH_O,
     "pin_default(data) -> pinned data | NotImplemented | None\n"
     "pin_tree into the current device's default arena, as set_pin_default says; None\n"
     "where it cannot: nothing set, a device configured, no arena for the current one,\n"
     "a forked child, the arena full (the Python layer then grows it or applies\n"
     "on_full)."},
    {"use_torch", fp_use_torch, METH_VARARGS,
     "use_torch(Tensor, api, team=None) -> bool\nLet pin_batch take torch tensors, through\n"
     "torch's DLPack C exchange API (the capsule Tensor.__dlpack_c_exchange_api__);\n"
     "False (and nothing changes) where that API is missing or of another major version.\n"
     "team: the file name prefix of the loaded library whose OpenMP runtime torch's\n"
     "parallel copies use (\"libtorch_cpu.\"), whose team then copies the torch span."},
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
     "Whether the copy pool's runs from stream_min bytes use streaming stores (default: "
     "where the CPU has them)."},
    {"streaming", fp_get_streaming, METH_NOARGS,
     "Whether the copy pool's large runs use streaming stores."},
    {"get_threads", fp_get_threads, METH_NOARGS, "Size of the copy pool."},
    {"set_spin", fp_set_spin, METH_O,
     "set_spin(ns)\nHow long the copy pool's threads stay ready after a chunk, polling for the\n"
     "next run instead of sleeping (0, the default: they sleep at once; at most 10 ms)."},
    {"get_spin", fp_get_spin, METH_NOARGS,
     "get_spin() -> int\nNanoseconds the copy pool's threads stay ready after a chunk."},
    {"set_copy_tuning", (PyCFunction)(void (*)(void))fp_set_copy_tuning,
     METH_VARARGS | METH_KEYWORDS,
     "set_copy_tuning(*, inline_max=, inline_spin=, stream_min=, chunk_min=, chunk_max=,\n"
     "chunk_min_spin=)\nThe copy pool's cut-overs, in bytes of a run: up to inline_max the caller\n"
     "copies alone (shared with spinning threads above inline_spin), from stream_min with\n"
     "streaming stores, chunks chunk_min (chunk_min_spin when shared with spinners only) to\n"
     "chunk_max. Those not given keep their value; now and for every later pool."},
    {"set_team_grain", fp_set_team_grain, METH_O,
     "set_team_grain(bytes)\nThe least bytes each thread of torch's OpenMP team copies of a\n"
     "batch in the torch span; 0: torch's copy_ fills the span instead."},
    {"copy_tuning", fp_copy_tuning, METH_NOARGS,
     "copy_tuning() -> dict\nThe copy pool's cut-overs, spin_ns, streaming, threads and spinners\n"
     "(the most of its threads that may spin at once: the CPUs it may use, less one),\n"
     "team_grain, and team (whether torch's OpenMP team was found: use_torch)."},
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
    fp_copier_tuning_default(&st->tuning);
    st->team_grain = FP_TEAM_GRAIN;
    st->pid = fp_pid();
    if (fp_names_init(st) < 0)
        return -1;
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
    Py_VISIT(st->pin_default.arenas);
    Py_VISIT(st->pin_default.settings);
    Py_VISIT(st->pin_default.threads);
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
    Py_CLEAR(st->pin_default.arenas);
    Py_CLEAR(st->pin_default.settings);
    Py_CLEAR(st->pin_default.threads);
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
