"""DLPack type codes of the dtypes fastpin exports, as PyTorch's own export
writes them (tests/test_dlpack.py checks the table against torch)."""
from __future__ import annotations

# DLDataTypeCode values from the DLPack specification.
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6

# torch dtype name -> (code, bits, lanes)
_TORCH = {
    "bool": (_BOOL, 8, 1),
    "uint8": (_UINT, 8, 1),
    "uint16": (_UINT, 16, 1),
    "uint32": (_UINT, 32, 1),
    "uint64": (_UINT, 64, 1),
    "int8": (_INT, 8, 1),
    "int16": (_INT, 16, 1),
    "int32": (_INT, 32, 1),
    "int64": (_INT, 64, 1),
    "float16": (_FLOAT, 16, 1),
    "float32": (_FLOAT, 32, 1),
    "float64": (_FLOAT, 64, 1),
    "bfloat16": (_BFLOAT, 16, 1),
    "complex32": (_COMPLEX, 32, 1),
    "complex64": (_COMPLEX, 64, 1),
    "complex128": (_COMPLEX, 128, 1),
    "float8_e4m3fn": (10, 8, 1),
    "float8_e4m3fnuz": (11, 8, 1),
    "float8_e5m2": (12, 8, 1),
    "float8_e5m2fnuz": (13, 8, 1),
    "float8_e8m0fnu": (14, 8, 1),
    "float4_e2m1fn_x2": (17, 4, 2),
}

_cache: dict = {}


def torch_dlpack_type(dtype):
    """(code, bits, lanes) of a torch dtype, or None where fastpin leaves it to
    torch (quantized and bit types, which DLPack cannot carry)."""
    try:
        return _cache[dtype]
    except KeyError:
        pass
    name = str(dtype).rpartition(".")[2]
    code = _TORCH.get(name)
    _cache[dtype] = code
    return code


_UINT_OF_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_carriers: dict = {}


def torch_carrier(dtype):
    """How fastpin exports a torch dtype: ((code, bits, lanes), None) for a dtype
    DLPack carries, ((uint code...), dtype) for one it does not but whose bytes
    an unsigned integer of the same size can carry (the sub-byte shells
    torch.uint1..int7, bit types) with a .view(dtype) after import, or None
    (quantized types: left to torch)."""
    try:
        return _carriers[dtype]
    except KeyError:
        pass
    import torch

    direct = torch_dlpack_type(dtype)
    result = None
    if direct is not None:
        result = (direct, None)
    else:
        quantized = dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2,
                              torch.quint2x4)
        name = None if quantized else _UINT_OF_SIZE.get(dtype.itemsize)
        if name is not None:
            try:
                torch.empty(1, dtype=getattr(torch, name)).view(dtype)
                result = (_TORCH[name], dtype)
            except (RuntimeError, TypeError):
                result = None
    _carriers[dtype] = result
    return result
