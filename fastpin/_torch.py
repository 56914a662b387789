"""What fastpin says when a part of it that needs PyTorch runs without it, and
the one torch binding it reaches past the public API for (CurrentStream).

fastpin does not depend on torch (users bring the build that fits their
machine): pin_memory of NumPy batches, configure, stats and cuda_status work
without it; collate, Loader, install and the benchmark need it."""
from __future__ import annotations

import sys

INSTALL = ("install the PyTorch build for this machine first, e.g. "
           "`pip install torch --index-url https://download.pytorch.org/whl/cpu` "
           "(CPU only) or the command for your CUDA version from "
           "https://pytorch.org/get-started/locally/")


def message(what: str) -> str:
    return (f"{what} needs PyTorch, which this Python ({sys.executable}) cannot import. "
            f"fastpin.pin_memory of NumPy arrays works without it; for {what}, {INSTALL}.")


def require(what: str):
    """The torch module, or a ModuleNotFoundError that says `what` needs it
    and how to install it (an import error inside torch itself is left as is)."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(message(what), name="torch") from None
    return torch


class CurrentStream:
    """The current stream of one GPU, read and set by id through the bindings
    torch.cuda.current_stream() and set_stream() call, without a Stream object
    made each time (a step does this for every batch: the public calls cost
    several times as much); a torch without those bindings gets the public
    calls."""

    __slots__ = ("torch", "index", "get", "set", "device", "last")

    def __init__(self, torch, index: int):
        self.torch = torch
        self.index = index
        c = torch._C
        self.get = getattr(c, "_cuda_getCurrentStream", None)
        self.set = getattr(c, "_cuda_setStream", None)
        self.device = getattr(c, "_cuda_getDevice", None)
        self.last = None  # the Stream object of the stream last asked for

    def swap(self, stream):
        """Make `stream` (of this GPU) current and return what to restore();
        None, changing nothing, where another GPU is the current device."""
        if self.get is None or self.set is None or self.device is None:
            cuda = self.torch.cuda
            if cuda.current_device() != self.index:
                return None
            previous = cuda.current_stream(self.index)
            cuda.set_stream(stream)
            return previous
        if self.device() != self.index:
            return None
        previous = self.get(self.index)
        self.set(stream_id=stream.stream_id, device_index=stream.device_index,
                 device_type=stream.device_type)
        return previous

    def restore(self, previous) -> None:
        if isinstance(previous, tuple):
            self.set(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        else:
            self.torch.cuda.set_stream(previous)

    def stream(self):
        """The current stream of this GPU, as a torch Stream (the same object
        while it stays current)."""
        if self.get is None:
            return self.torch.cuda.current_stream(self.index)
        ids = self.get(self.index)
        last = self.last
        if last is None or last.stream_id != ids[0]:
            last = self.last = self.torch.cuda.Stream(stream_id=ids[0], device_index=ids[1],
                                                      device_type=ids[2])
        return last
