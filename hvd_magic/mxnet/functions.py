"""Start every rank from the root's model: ``broadcast_parameters`` (deferred-initialised
parameters included), plus the object collectives, re-exported."""
from __future__ import annotations

import types
from typing import Any, Optional

import hvd_magic.collectives as C
from hvd_magic.collectives import allgather_object, broadcast_object

from .tensors import mx, mx_errors, to_numpy, write_into

__all__ = ["broadcast_parameters", "broadcast_object", "allgather_object"]


def param_items(params: Any) -> list:
    """``(name, value)`` pairs of a dict or gluon ParameterDict, sorted by name (the order
    every rank uses); ValueError for anything else."""
    valid: tuple = (dict,)
    try:
        from mxnet.gluon.parameter import ParameterDict
        valid = (dict, ParameterDict)
    except ImportError:        # MXNet 2 has no ParameterDict: collect_params() is a dict
        pass
    if not isinstance(params, valid):
        raise ValueError(f"broadcast_parameters takes a dict of NDArrays or Parameters, or "
                         f"block.collect_params(), not {type(params).__name__}")
    return sorted(params.items(), key=lambda kv: str(kv[0]))


def _broadcast_after_init(param: Any, root_rank: int, name: str) -> None:
    """A deferred-initialised parameter gets the root's values as soon as its first forward
    pass initialises it (on every rank, as every rank runs that pass). MXNet offers no public
    hook there: the parameter's own initialiser is wrapped, as Horovod does."""
    init_impl = param._init_impl

    def init_then_broadcast(self: Any, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        for data in self.list_data():
            with mx_errors():
                out = C.broadcast(to_numpy(data, "broadcast_parameters"), root_rank, name=name)
            write_into(data, out)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: Optional[str] = None) -> None:
    """Overwrite, in place, every rank's parameters with ``root_rank``'s.

    ``params`` is ``block.collect_params()`` or a dict of NDArrays (``Module.get_params()``).
    Parameters whose shape is not known yet (deferred initialisation) are broadcast when
    their first forward pass initialises them. ``prefix`` keeps the names of two calls apart
    (two models, two calls). Example, 2 ranks::

        rank 0: dense0_weight = [[0.1, 0.2]]  ->  [[0.1, 0.2]]
        rank 1: dense0_weight = [[0.7, 0.3]]  ->  [[0.1, 0.2]]
    """
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a string, got {prefix!r}")
    items = param_items(params)
    if C.size() == 1:
        return
    prefix = prefix or ""
    gluon = mx().gluon
    pending = []
    for key, p in items:
        name = prefix + str(key)
        if isinstance(p, gluon.parameter.Parameter):
            try:
                data = p.list_data()
            except gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank, name)
                continue
        else:
            data = [p]
        for i, d in enumerate(data):
            with mx_errors():
                h = C.broadcast_async(to_numpy(d, "broadcast_parameters"), root_rank,
                                      name=name if i == 0 else f"{name}.ctx{i}")
            pending.append((d, h))
    with mx_errors():
        results = [(d, h.wait()) for d, h in pending]
    for d, out in results:
        write_into(d, out)
