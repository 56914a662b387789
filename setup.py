"""Build of fastpin's one extension module, fastpin._C (plain C).

Build switches, by environment variable (after msgspec's setup.py):
  FASTPIN_DEBUG=1         -O0 -g, asserts and the allocator's invariant checks on
  FASTPIN_SANITIZE=...    address (ASan + UBSan) or thread (TSan)
  FASTPIN_WERROR=1        warnings are errors (CI and our own builds; never a user's)
"""
import os
import sysconfig

import numpy
from setuptools import Extension, setup

SOURCES = ["arena.c", "arena_type.c", "batch.c", "block_record.c", "block_type.c", "copier.c",
           "cuda.c", "dlpack.c", "error.c", "lease.c", "module.c", "prim.c", "record.c",
           "repair.c", "stage.c", "team.c", "tlsf.c"]

cflags = ["-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden"]
ldflags = []
libraries = ["dl"]
if os.environ.get("FASTPIN_WERROR") == "1":
    cflags.append("-Werror")
if os.environ.get("FASTPIN_DEBUG") == "1":
    cflags += ["-O0", "-g3", "-UNDEBUG", "-DFP_DEBUG"]
else:
    cflags += ["-O2"]
sanitize = os.environ.get("FASTPIN_SANITIZE", "")
if sanitize == "address":
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    cflags += flags
    ldflags += flags
elif sanitize == "thread":
    cflags += ["-fsanitize=thread"]
    ldflags += ["-fsanitize=thread"]
elif sanitize:
    raise SystemExit(f"FASTPIN_SANITIZE must be 'address' or 'thread', not {sanitize!r}")

# Python's own CFLAGS may carry -O3/-g options; ours come last and win.
setup(
    ext_modules=[
        Extension(
            "fastpin._C",
            sources=[os.path.join("csrc", s) for s in SOURCES],
            depends=[os.path.join("csrc", h)
                     for h in ("fastpin.h", "arena_internal.h", "dlpack.h", "module.h",
                               "streaming.h")],
            include_dirs=["csrc", numpy.get_include()],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            libraries=libraries,
        )
    ],
)
