"""CUDA graph captures announced to the C core, so that no free fence breaks one.

A block the user can see is freed with a fence over its whole CUDA context
(cuCtxRecordEvent: the block is reused only after every stream has passed
the copies queued before the free). The driver refuses such a fence while a
stream of the context is capturing, and invalidates that capture. torch
captures through torch.cuda.CUDAGraph (torch.cuda.graph,
make_graphed_callables, torch.compile's CUDA graph trees): its capture_begin
and capture_end are wrapped here to tell the core, and a block freed during
a capture gets its fence once the capture has ended, before it is reused.
Captures made outside torch.cuda.CUDAGraph are not seen: a fence that meets
one defers itself too (the driver says so), but that capture is lost."""
from __future__ import annotations

import functools
import sys
import threading

from . import _C

_lock = threading.Lock()
watching = False  # read without the lock on the hot path; set once under it


def watch() -> None:
    """Wrap torch.cuda.CUDAGraph's capture_begin/capture_end, once, when torch
    is imported and a GPU is usable (a no-op otherwise; call again later)."""
    global watching
    torch = sys.modules.get("torch")
    if watching or torch is None or _C.cuda_status()["state"] != "ready":
        return
    with _lock:
        if watching:
            return
        graph = getattr(torch.cuda, "CUDAGraph", None)
        if graph is not None:
            _wrap(graph)
        watching = True


def _wrap(graph: type) -> None:
    begin, end = graph.capture_begin, graph.capture_end

    @functools.wraps(begin)
    def capture_begin(self, *args, **kwargs):
        _C.capture_begin()
        try:
            out = begin(self, *args, **kwargs)
        except BaseException:
            _C.capture_end()
            raise
        self._fastpin_capturing = True
        return out

    @functools.wraps(end)
    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            # Only a capture this wrapper saw begin: torch.cuda.graph calls
            # capture_end even when capture_begin raised.
            if self.__dict__.pop("_fastpin_capturing", False):
                _C.capture_end()

    graph.capture_begin = capture_begin
    graph.capture_end = capture_end
