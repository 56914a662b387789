"""torch for the package's modules, or None where it cannot be imported.

Only `python -m fastpin.bench` gets past the package's __init__ without torch
(every other import stops there, saying what to install): --help and --list
need no torch, and main() says what to install before it measures anything."""
from __future__ import annotations

try:
    import torch
    from torch.utils.data import Dataset
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":
        raise
    torch = None  # type: ignore[assignment]
    Dataset = object  # type: ignore[assignment,misc]

__all__ = ["Dataset", "torch"]
