/* The DLPack ABI, written from the specification (DLPack 1.1,
 * https://dmlc.github.io/dlpack/latest/c_api.html). Only the parts fastpin
 * produces are declared; the layouts must match the spec byte for byte. */
#ifndef FASTPIN_DLPACK_H
#define FASTPIN_DLPACK_H

#include <Python.h>
#include <stdint.h>

#include "fastpin.h"

#define FP_DLPACK_MAJOR 1
#define FP_DLPACK_MINOR 1

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
    /* 7..17: the float8 / float6 / float4 codes; passed through as given. */
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL would mean compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ull << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ull << 1)

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#define FP_DLPACK_MAX_NDIM 64

/* The C exchange API (DLPack 1.3: a framework's type carries it as the
 * capsule `__dlpack_c_exchange_api__`, named "dlpack_exchange_api"): function
 * pointers that convert tensors without a Python call each way. fastpin reads
 * a torch tensor's layout with dltensor_from_py_object_no_sync and hands its
 * own exports to torch with managed_tensor_to_py_object_no_sync. Both
 * return 0, or -1 with a Python exception set. */
typedef struct fp_exchange_api_header_s {
    DLPackVersion version;                  /* the consumer checks the major */
    struct fp_exchange_api_header_s *prev_api;
} fp_exchange_api_header_t;

typedef struct {
    fp_exchange_api_header_t header;
    /* (prototype, out, error_ctx, set_error) -> status; unused here */
    int (*managed_tensor_allocator)(DLTensor *, DLManagedTensorVersioned **, void *,
                                    void (*)(void *, const char *, const char *));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object,
                                                 DLManagedTensorVersioned **out);
    /* Takes ownership of `tensor`. */
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    /* A non-owning view of `py_object` in *out, valid until control returns
     * to it (its shape and strides point into the producer's memory); may be
     * NULL where a framework does not offer it. */
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(DLDeviceType device_type, int32_t device_id,
                               void **out_current_stream);
} fp_exchange_api_t;

/* Exports `ndim` x `shape` x `strides` elements of `dtype` at `data` (inside
 * `lease`'s block) as a DLPack capsule named "dltensor", or
 * "dltensor_versioned" when `minor` >= 0 (version 1.minor). The capsule and,
 * once consumed, the tensor built from it hold one lease reference, dropped
 * by a deleter that is safe from any thread and at interpreter exit.
 * Returns a new reference, or NULL with an exception set. */
/* The same export as a bare versioned managed tensor, for a consumer that
 * takes it directly (the exchange API); its deleter drops the reference.
 * Returns NULL with an exception set. */
DLManagedTensorVersioned *fp_dlpack_managed(fp_lease_t *lease, void *data, int ndim,
                                            const int64_t *shape, const int64_t *strides,
                                            DLDataType dtype);

PyObject *fp_dlpack_capsule(fp_lease_t *lease, void *data, int ndim,
                            const int64_t *shape, const int64_t *strides,
                            DLDataType dtype, int minor, int readonly);

#endif /* FASTPIN_DLPACK_H */
