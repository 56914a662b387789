"""What fastpin says when a part of it that needs PyTorch runs without it.

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
