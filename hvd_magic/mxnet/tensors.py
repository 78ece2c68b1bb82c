"""NDArrays in and out of ``hvd_magic.collectives``, and Horovod's MXNet error types.

An NDArray travels as the numpy array ``asnumpy()`` gives; a result comes back as a new
NDArray on the input's context, or is written into the input (the in-place ops). Horovod's
MPI build takes these dtypes: uint8, int8, int32, int64, float16, float32, float64.

Horovod's MXNet ops report failures as ``mxnet.base.MXNetError``; the runtime raises
ValueError, TypeError or :class:`~hvd_magic.collectives.HvdError`. :func:`mx_errors` turns
each into a class that is both (``ValueError`` and ``MXNetError``, ...), so that code
catching either keeps working. mxnet is imported on first use only.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy as np

from hvd_magic.collectives import HvdError

# The dtypes of Horovod's TensorUtil::GetDType for MXNet (its MPI build).
DTYPES = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64")


def mx() -> Any:
    """The mxnet module, imported on first use."""
    import mxnet
    return mxnet


def check_dtype(name: str, fn: str) -> None:
    """Raise TypeError unless ``name`` is a dtype Horovod's MXNet ops take (pure)."""
    if name not in DTYPES:
        raise TypeError(f"hvd_magic.mxnet.{fn}: dtype {name} is not supported (Horovod's MXNet ops "
                        f"take {', '.join(DTYPES)}); cast it with .astype(...)")


def is_ndarray(x: Any) -> bool:
    return isinstance(x, mx().nd.NDArray)


def to_numpy(x: Any, fn: str) -> np.ndarray:
    """The numpy copy of an NDArray that travels; TypeError for anything else."""
    if not is_ndarray(x):
        raise TypeError(f"hvd_magic.mxnet.{fn} takes an mxnet NDArray, not {type(x).__name__}; "
                        "for numpy arrays use hvd_magic.collectives")
    if getattr(x, "stype", "default") != "default":
        raise TypeError(f"hvd_magic.mxnet.{fn}: a {x.stype} NDArray is not supported; "
                        "pass x.tostype('default')")
    check_dtype(np.dtype(x.dtype).name, fn)
    return x.asnumpy()


def to_numpy_list(xs: Any, fn: str) -> list:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"hvd_magic.mxnet.{fn} takes a list of NDArrays, not {type(xs).__name__}")
    if not xs:
        raise ValueError(f"hvd_magic.mxnet.{fn} got an empty list; pass at least one NDArray")
    return [to_numpy(x, fn) for x in xs]


def like(arr: Any, ref: Any) -> Any:
    """``arr`` (numpy) as a new NDArray with ``ref``'s dtype and context."""
    return mx().nd.array(np.asarray(arr), ctx=ref.context, dtype=ref.dtype)


def write_into(dst: Any, arr: Any) -> Any:
    """Copy ``arr`` (numpy, ``dst``'s shape) into the NDArray ``dst``; return ``dst``."""
    arr = np.asarray(arr)
    if dst.shape == ():
        dst[()] = arr.reshape(())
    else:
        dst[:] = arr.reshape(dst.shape)
    return dst


@functools.lru_cache(maxsize=None)
def mx_error_class(cls: type) -> type:
    """``cls`` that is also an ``MXNetError`` (what Horovod's MXNet ops raise)."""
    base = mx().base.MXNetError
    if issubclass(cls, base):
        return cls
    return type(cls.__name__, (cls, base), {"__module__": "hvd_magic.mxnet",
                                            "__doc__": cls.__doc__})


@contextlib.contextmanager
def mx_errors() -> Iterator[None]:
    """Re-raise the runtime's ValueError, TypeError and HvdError as the same error that is
    also an MXNetError; the message and the original (as ``__cause__``) are kept."""
    try:
        yield
    except (ValueError, TypeError, HvdError) as exc:
        try:
            new = mx_error_class(type(exc))(*exc.args)
        except Exception:      # an error class whose constructor differs: leave it as it is
            raise exc from None
        raise new.with_traceback(exc.__traceback__) from exc
