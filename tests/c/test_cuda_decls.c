/* Checks fastpin.h's driver declarations against the toolkit's cuda.h:
 * every entry point's parameter list, the symbol string cuda.c loads, the
 * handle types and the constants. Built only where cuda.h exists; needs no
 * libcuda to build or run (nothing here calls the driver). */
#include <stdio.h>
#include <string.h>

#include <cuda.h>

#include "fastpin.h"

/* ---- types and constants ------------------------------------------------ */

#define SAME_TYPE(a, b) __builtin_types_compatible_p(a, b)

/* fp_cu_result_t stands in for CUresult in our prototypes: gcc gives an
 * enum with no negative values unsigned int as its type, so the two are
 * incompatible as types but identical in the calling convention. */
_Static_assert(sizeof(CUresult) == sizeof(fp_cu_result_t), "CUresult size");
_Static_assert(_Alignof(CUresult) == _Alignof(fp_cu_result_t),
               "CUresult alignment");
_Static_assert(SAME_TYPE(fp_cu_device_t, CUdevice), "CUdevice");
_Static_assert(SAME_TYPE(fp_cu_deviceptr_t, CUdeviceptr), "CUdeviceptr");
_Static_assert(SAME_TYPE(fp_cu_context_t, CUcontext), "CUcontext");
_Static_assert(SAME_TYPE(fp_cu_stream_t, CUstream), "CUstream");
_Static_assert(SAME_TYPE(fp_cu_event_t, CUevent), "CUevent");

_Static_assert(FP_CUDA_SUCCESS == CUDA_SUCCESS, "CUDA_SUCCESS");
_Static_assert(FP_CUDA_ERROR_NOT_READY == CUDA_ERROR_NOT_READY,
               "CUDA_ERROR_NOT_READY");
_Static_assert(FP_CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ==
                   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
               "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
_Static_assert(FP_CU_MEMHOSTREGISTER_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE,
               "CU_MEMHOSTREGISTER_PORTABLE");
_Static_assert(FP_CU_STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING,
               "CU_STREAM_NON_BLOCKING");
_Static_assert(FP_CU_EVENT_DISABLE_TIMING == CU_EVENT_DISABLE_TIMING,
               "CU_EVENT_DISABLE_TIMING");
_Static_assert(FP_CU_POINTER_ATTRIBUTE_MEMORY_TYPE == CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
               "CU_POINTER_ATTRIBUTE_MEMORY_TYPE");
_Static_assert(FP_CU_MEMORYTYPE_HOST == CU_MEMORYTYPE_HOST, "CU_MEMORYTYPE_HOST");
/* A pointer constant is no integer constant expression: its type here, its
 * value in main. */
_Static_assert(SAME_TYPE(__typeof__(FP_CU_STREAM_LEGACY),
                         __typeof__(CU_STREAM_LEGACY)),
               "CU_STREAM_LEGACY type");

/* ---- prototypes ---------------------------------------------------------- */

/* From here on our parameter lists read CUresult where they say
 * fp_cu_result_t (cuGetErrorString takes one), so each list can be compared
 * whole against the driver's. The typedefs above already used the real one. */
#define fp_cu_result_t CUresult

/* `name` is macro-expanded when substituted: cuda.h maps each plain name to
 * the versioned symbol it declares (cuMemHostRegister -> _v2), so &name is
 * the driver's declaration of that symbol; main checks that it is the
 * symbol cuda.c loads. */
#define CHECK_PROTOTYPE(name, sym, params)                                 \
    typedef CUresult (*check_##name##_t) params;                           \
    _Static_assert(SAME_TYPE(__typeof__(&name), check_##name##_t),         \
                   #name " (" sym "): parameters differ from cuda.h's");
FP_CUDA_ENTRY_POINTS(CHECK_PROTOTYPE)
#if CUDA_VERSION >= 12050 /* the optional ones, where this cuda.h has them */
FP_CUDA_OPTIONAL_ENTRY_POINTS(CHECK_PROTOTYPE)
#endif
#undef CHECK_PROTOTYPE

#undef fp_cu_result_t

/* The symbol cuda.h binds a plain name to, as a string. */
#define EXPANDED_NAME(name) EXPANDED_NAME_(name)
#define EXPANDED_NAME_(name) #name

struct entry {
    const char *name;     /* the X-macro's plain name */
    const char *declared; /* what cuda.h maps it to */
    const char *loaded;   /* the symbol cuda.c asks dlsym for */
};

static const struct entry entries[] = {
#define ENTRY(name, sym, params) {#name, EXPANDED_NAME(name), sym},
    FP_CUDA_ENTRY_POINTS(ENTRY)
#if CUDA_VERSION >= 12050
    FP_CUDA_OPTIONAL_ENTRY_POINTS(ENTRY)
#endif
#undef ENTRY
};

int main(void)
{
    int failures = 0;
    size_t n = sizeof entries / sizeof *entries;

    for (size_t i = 0; i < n; i++)
        if (strcmp(entries[i].declared, entries[i].loaded) != 0) {
            printf("FAIL %s: cuda.h declares %s, fastpin.h loads %s\n",
                   entries[i].name, entries[i].declared, entries[i].loaded);
            failures++;
        }
    if (FP_CU_STREAM_LEGACY != CU_STREAM_LEGACY) {
        printf("FAIL FP_CU_STREAM_LEGACY differs from CU_STREAM_LEGACY\n");
        failures++;
    }
    if (failures) {
        printf("test_cuda_decls: %d FAILED (cuda.h of CUDA %d)\n", failures,
               CUDA_VERSION);
        return 1;
    }
    printf("test_cuda_decls: %zu entry points match cuda.h of CUDA %d: ok\n",
           n, CUDA_VERSION);
    return 0;
}
