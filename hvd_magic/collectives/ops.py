"""Reduction ops, dtypes and the adapter between user tensors and flat buffers.

User tensors are numpy arrays or torch tensors. The runtime moves them as flat
contiguous buffers: numpy arrays for the MPI backend, torch tensors for the
torch.distributed backend. Nothing here talks to other ranks.
"""
from __future__ import annotations

import enum
import sys
import warnings
from typing import Any, Iterable, Optional, Sequence

import numpy as np


class ReduceOp(enum.IntEnum):
    """Reduction ops, with Horovod's names."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64",
          "float16", "bfloat16", "float32", "float64")
HALF = ("float16", "bfloat16")
INTEGER = ("uint8", "int8", "int16", "int32", "int64")


def to_op(op: Any) -> ReduceOp:
    """Accept a ReduceOp, its int value or a name such as 'sum'."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    elif isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        try:
            return ReduceOp(int(op))
        except ValueError:
            pass
    raise ValueError(f"unknown reduction op {op!r}; use one of hvd.Average, hvd.Sum, "
                     "hvd.Adasum, hvd.Min, hvd.Max, hvd.Product")


def resolve_op(average: Optional[bool], op: Any, fn: str) -> ReduceOp:
    """Horovod's rule for the framework faces: ``average`` (deprecated) maps to Average/Sum,
    ``op=None`` is Average; both given is a ValueError."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{fn}: pass either op=... or the deprecated average=..., not both")
        warnings.warn(f"{fn}(average=...) is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return to_op(Average if op is None else op)


def _torch():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def is_torch_type(tp: type) -> bool:
    """Whether ``tp`` is torch.Tensor or a subclass of it (torch.nn.Parameter)."""
    t = _torch()
    return t is not None and issubclass(tp, t.Tensor)


_NP_NAMES = {np.dtype(n): n for n in DTYPES if n != "bfloat16"}


def dtype_name(x: Any) -> str:
    """Canonical dtype name of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        name = _NP_NAMES.get(x.dtype)
        if name is not None:
            return name
    if is_torch(x):
        name = str(x.dtype).replace("torch.", "")
    elif isinstance(x, np.ndarray):
        name = x.dtype.name
    else:
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")
    if name not in DTYPES:
        raise TypeError(f"dtype {name} is not supported by hvd_magic collectives; "
                        f"supported: {', '.join(DTYPES)}")
    return name


_ADASUM = ReduceOp.ADASUM     # (a module constant: the enum attribute lookup costs ~0.1 us)
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def check_op_dtype(op: ReduceOp, dtype: str) -> None:
    if op == _ADASUM:
        if dtype not in _FLOATS:
            raise ValueError(f"op=Adasum needs a floating-point tensor (float16, bfloat16, float32 "
                             f"or float64), got {dtype}; cast it, or use hvd.Sum or hvd.Average")
        return
    if dtype == "bool" and op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise TypeError("Sum/Average of a bool tensor is not defined; use hvd.Max (logical or), "
                        "hvd.Min or hvd.Product (logical and), or cast to an integer type")


def device_of(x: Any) -> str:
    if is_torch(x):
        return x.device.type
    return "cpu"


def as_numpy(x: Any) -> np.ndarray:
    """A contiguous numpy view (or copy) of a CPU tensor. bfloat16 travels as int16 bits."""
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype.isnative:
        return x                # the common case, without the checks below
    if is_torch(x):
        t = x.detach()
        if t.device.type != "cpu":
            raise TypeError(f"tensor on {t.device} given to the MPI backend; CUDA tensors go "
                            "through torch.distributed (NCCL)")
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype == _torch().bfloat16:
            t = t.view(_torch().int16)
        return t.numpy()
    a = np.ascontiguousarray(x)
    if not a.dtype.isnative:   # big-endian input: every path reads the bytes as native
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.ndim == x.ndim else a.reshape(x.shape)   # ascontiguousarray makes 0-d 1-d


def flatten_torch(tensors: Sequence[Any], flat_1d: bool) -> np.ndarray:
    """The elements of CPU torch tensors of one dtype one after another, as one new numpy
    array (bfloat16 as int16 bits): one ``torch.cat`` instead of a numpy view per tensor."""
    torch = _torch()
    with torch.no_grad():
        flat = torch.cat(tensors if flat_1d else [t.reshape(-1) for t in tensors])
    return as_numpy(flat)


def torch_from_numpy(arrays: Iterable[np.ndarray], dtype: str) -> list:
    """CPU torch tensors sharing the memory of numpy ``arrays`` that carry ``dtype``."""
    torch = _torch()
    out = list(map(torch.from_numpy, arrays))
    if dtype == "bfloat16":
        out = [t.view(torch.bfloat16) for t in out]
    return out


def np_dtype(name: str) -> np.dtype:
    """numpy dtype that carries ``name`` (bfloat16 is carried as int16 bits)."""
    return np.dtype("int16") if name == "bfloat16" else np.dtype(name)


def wrap_like(arr: np.ndarray, dtype: str, like: Any) -> Any:
    """Give back ``arr`` (numpy, carrying ``dtype``) in the framework of ``like``."""
    if is_torch(like):
        torch = _torch()
        t = torch.from_numpy(arr)
        if dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        if like.device.type != "cpu":
            t = t.to(like.device)
        return t
    return arr


def upcast(arr: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of a half-precision buffer for reduction (MPI has no float16/bfloat16)."""
    if dtype == "float16":
        return arr.astype(np.float32)
    if dtype == "bfloat16":
        bits = arr.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return arr


def downcast_into(dst: np.ndarray, src: np.ndarray, dtype: str) -> None:
    """Write float32 ``src`` into half-precision ``dst`` (round to nearest even for bfloat16)."""
    if dtype == "float16":
        np.copyto(dst, src.astype(np.float16), casting="unsafe")
    elif dtype == "bfloat16":
        bits = np.ascontiguousarray(src, dtype=np.float32).view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out = ((bits + rounding) >> 16).astype(np.uint16)
        nan = np.isnan(src)
        if nan.any():
            out[nan] = 0x7FC0
        dst.view(np.uint16)[...] = out.reshape(dst.shape)
    else:
        np.copyto(dst, src, casting="unsafe")


def identity(op: ReduceOp, dtype: np.dtype) -> Any:
    """The value a joined rank contributes so that it changes nothing."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    if dtype.kind == "b":
        return op == ReduceOp.MIN
    if dtype.kind == "f":
        return np.inf if op == ReduceOp.MIN else -np.inf
    info = np.iinfo(dtype)
    return info.max if op == ReduceOp.MIN else info.min
